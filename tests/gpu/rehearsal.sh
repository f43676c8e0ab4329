#!/bin/sh
# rehearsal.sh TEST_BINARY DOUBLE [ARGS...]: a dress rehearsal of a real-GPU
# test binary on a machine without one. The driver's test double is
# disguised as the driver (a private directory holding a libcuda.so.1 link
# to it, first on LD_LIBRARY_PATH; TENSORD_CUDA_DRIVER unset, so the binary
# takes it for a GPU), with its memory counted per device across processes
# (TDCUDA_STATE_DIR) and 4 GiB per device, as a small GPU. It proves the
# gpu tests' own logic — what they create, wait for and measure — so that
# the first run on a GPU fails only where the driver differs from the
# double. A skip (77) is a failure here: the disguise must hold.
[ $# -ge 2 ] || { echo "usage: rehearsal.sh TEST_BINARY DOUBLE [ARGS...]" >&2; exit 2; }
bin=$1 double=$2
shift 2
dir=$(mktemp -d /tmp/tensord-rehearsal.XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
ln -s "$double" "$dir/libcuda.so.1" && mkdir "$dir/state" || exit 1
unset TENSORD_CUDA_DRIVER
LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  TDCUDA_STATE_DIR="$dir/state" TDCUDA_MEM=4G "$bin" "$@"
rc=$?
if [ $rc = 77 ]; then
  echo "$bin skipped under the disguised double: the rehearsal did not run" >&2
  exit 1
fi
exit $rc

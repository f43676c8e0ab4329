#!/bin/sh
# reports_skip.sh TEST_BINARY DOUBLE: a real-GPU test binary, run where it
# can find no GPU ($TENSORD_CUDA_DRIVER names the driver's test double, which
# gpu_probe never takes for one), exits 77: ctest's SKIP_RETURN_CODE, so a
# run without a GPU reports its tests skipped, never passed.
[ $# -eq 2 ] || { echo "usage: reports_skip.sh TEST_BINARY DOUBLE" >&2; exit 2; }
out=$(TENSORD_CUDA_DRIVER=$2 "$1" 2>&1)
rc=$?
if [ $rc != 77 ]; then
  echo "$1 exited $rc where it found no GPU, not 77 (skipped):" >&2
  echo "$out" >&2
  exit 1
fi
echo "$out"

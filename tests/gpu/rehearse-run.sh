#!/bin/sh
# tests/gpu/rehearse-run.sh [BUILD_DIR]: runs tests/gpu/run.sh, the one-shot
# GPU check, on a machine without a GPU, with the driver's test double
# disguised as the driver: a private directory holding a libcuda.so.1 link
# to the double (first on LD_LIBRARY_PATH) and an nvidia-smi that lists one
# double device (first on PATH), memory counted per device across processes
# (TDCUDA_STATE_DIR), 4 GiB per device. It proves the script itself — the
# Release build, every stage, the table, the exit status — so that the
# first run on a real GPU fails only where the driver differs from the
# double. Its figures are the double's. Needs the double built in build/
# (make build); BUILD_DIR as for run.sh (default build-gpu-rehearsal).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd) || exit 2
double=$root/build/tests/cuda/libtdcuda_double.so
[ -f "$double" ] || { echo "rehearse-run.sh: $double: build first (make build)" >&2; exit 2; }
dir=$(mktemp -d /tmp/tensord-gpu-rehearsal.XXXXXX) || exit 1
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/bin" "$dir/state" && ln -s "$double" "$dir/libcuda.so.1" || exit 1
cat >"$dir/bin/nvidia-smi" <<'SMI'
#!/bin/sh
# A stand-in for nvidia-smi: one device, the test double's device 0.
case "$*" in
*-L*) echo "GPU 0: tensord CUDA test double (UUID: GPU-74646375-6461-646f-7562-6c6500000000)" ;;
*) echo "index, name, driver_version, memory.total [MiB], memory.used [MiB]"
   echo "0, tensord CUDA test double, double, 4096 MiB, 0 MiB" ;;
esac
SMI
chmod +x "$dir/bin/nvidia-smi" || exit 1
unset TENSORD_CUDA_DRIVER
echo "rehearse-run.sh: the TEST DOUBLE disguised as the driver: not a GPU"
PATH="$dir/bin:$PATH" LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  TDCUDA_STATE_DIR="$dir/state" TDCUDA_MEM=4G \
  sh "$root/tests/gpu/run.sh" "${1:-$root/build-gpu-rehearsal}"

#!/bin/sh
# exports.sh LIB: the driver's test double exports exactly the driver entry
# points cuda/driver.c resolves, under the versioned names cuda.h maps them
# to (cuMemGetInfo_v2, ...), plus the stream-capture entries its tests call
# directly (cuStreamBeginCapture_v2, cuStreamEndCapture) and the fault a
# test injects (tdcudaDoubleFault), and nothing else.
# Exits 1 naming the difference.
[ $# -eq 1 ] || { echo "usage: exports.sh LIB" >&2; exit 2; }
want=$(cat <<'LIST' | sort
cuCtxPopCurrent_v2
cuCtxPushCurrent_v2
cuCtxSynchronize
cuDeviceGet
cuDeviceGetAttribute
cuDeviceGetCount
cuDeviceGetName
cuDeviceGetUuid
cuDeviceGetUuid_v2
cuDevicePrimaryCtxRelease_v2
cuDevicePrimaryCtxRetain
cuEventCreate
cuEventDestroy_v2
cuEventRecord
cuEventSynchronize
cuGetErrorName
cuGetErrorString
cuInit
cuIpcCloseMemHandle
cuIpcGetEventHandle
cuIpcGetMemHandle
cuIpcOpenEventHandle
cuIpcOpenMemHandle_v2
cuMemAddressFree
cuMemAddressReserve
cuMemAlloc_v2
cuMemCreate
cuMemExportToShareableHandle
cuMemFree_v2
cuMemGetAllocationGranularity
cuMemGetInfo_v2
cuMemImportFromShareableHandle
cuMemMap
cuMemRelease
cuStreamSynchronize
cuStreamDestroy_v2
cuStreamCreate
cuMemcpyHtoDAsync_v2
cuMemcpyDtoHAsync_v2
cuMemcpy2DAsync_v2
cuMemsetD8Async
cuStreamBeginCapture_v2
cuStreamEndCapture
tdcudaDoubleFault
cuMemFreeHost
cuMemHostAlloc
cuMemSetAccess
cuMemUnmap
cuMemcpy2D_v2
cuMemcpyDtoH_v2
cuMemcpyHtoD_v2
cuMemsetD8_v2
cuStreamWaitEvent
cuModuleLoadData
cuModuleGetFunction
cuModuleUnload
cuLaunchKernel
cuMemcpyPeerAsync
cuDeviceCanAccessPeer
LIST
)
got=$(nm -D --defined-only "$1" | awk '$2 == "T" || $2 == "W" { print $3 }' |
      grep -v '^_' | sort)
if [ "$got" != "$want" ]; then
  echo "exports.sh: $1 exports other symbols than the driver's entry points:" >&2
  printf '%s\n' "$want" > /tmp/exports-want.$$
  printf '%s\n' "$got" | diff /tmp/exports-want.$$ - >&2
  rm -f /tmp/exports-want.$$
  exit 1
fi
echo "exports.sh: $(printf '%s\n' "$got" | wc -l) entry points, nothing else"

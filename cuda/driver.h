/* driver.h: the CUDA driver, loaded at run time. tensord and libtensord
 * never link libcuda: td__cu_load dlopen()s it (or the tests' double, see
 * tests/cuda/README.md) and resolves the entry points below, so one binary
 * starts on hosts with no GPU and no driver. Uses only include/ and
 * common/; daemon/ and client/ may use it. */
#ifndef TD_CUDA_DRIVER_H
#define TD_CUDA_DRIVER_H

#include "tensord.h" /* the TD_E* codes */

#include <cuda.h>

#include <stddef.h>
#include <stdint.h>

/* The driver entry points tensord uses. Each is resolved by the versioned
 * name cuda.h maps its unversioned one to (cuMemGetInfo -> cuMemGetInfo_v2),
 * so the prototypes here are the ones the symbols really have. */
typedef struct td__cu {
  CUresult (*Init)(unsigned);
  CUresult (*GetErrorName)(CUresult, const char **);
  CUresult (*GetErrorString)(CUresult, const char **);
  CUresult (*DeviceGetCount)(int *);
  CUresult (*DeviceGet)(CUdevice *, int);
  CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
  CUresult (*DeviceGetName)(char *, int, CUdevice);
  CUresult (*DeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext *);
  CUresult (*CtxSynchronize)(void);
  CUresult (*MemGetInfo)(size_t *, size_t *);
  CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                          CUmemAllocationGranularity_flags);
  CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t,
                        const CUmemAllocationProp *, unsigned long long);
  CUresult (*MemRelease)(CUmemGenericAllocationHandle);
  CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle,
                                         CUmemAllocationHandleType,
                                         unsigned long long);
  CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *,
                                           void *, CUmemAllocationHandleType);
  CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                unsigned long long);
  CUresult (*MemAddressFree)(CUdeviceptr, size_t);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                     unsigned long long);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *,
                           size_t);
  /* The legacy stream's copies (and CtxSynchronize above) are for the
   * tests and benchmarks: libtensord's own work goes on its private stream
   * (the Async entries below, client/cumap.c), never the legacy stream. */
  CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
  CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
  /* Rows between host and device, or device and device (strided views). */
  CUresult (*Memcpy2D)(const CUDA_MEMCPY2D *);
  /* The legacy path, for devices without POSIX-fd handles. */
  CUresult (*MemAlloc)(CUdeviceptr *, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*IpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
  CUresult (*IpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
  CUresult (*IpcCloseMemHandle)(CUdeviceptr);
  /* Events, for ordering a consumer after a producer's work. */
  CUresult (*EventCreate)(CUevent *, unsigned int);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventSynchronize)(CUevent);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
  CUresult (*IpcGetEventHandle)(CUipcEventHandle *, CUevent);
  CUresult (*IpcOpenEventHandle)(CUevent *, CUipcEventHandle);
  /* Loading a model: a pinned staging buffer, streams, async copies. */
  CUresult (*MemHostAlloc)(void **, size_t, unsigned int);
  CUresult (*MemFreeHost)(void *);
  CUresult (*StreamCreate)(CUstream *, unsigned int);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
  /* libtensord's own work (zeroing, td_copy), on a private non-blocking
   * stream, synchronised before a call returns; and Memcpy2D's form on a
   * stream, for rows. */
  CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*Memcpy2DAsync)(const CUDA_MEMCPY2D *, CUstream);
  /* Optional (NULL where the driver lacks one): td_copy's kernel for
   * element-strided views on one GPU and its peer copies between GPUs
   * (client/cumap.c). A driver without them only loses those paths: td_copy
   * then stages through host memory as before. */
  CUresult (*ModuleLoadData)(CUmodule *, const void *);
  CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, unsigned, CUstream, void **,
                           void **);
  CUresult (*MemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext,
                              size_t, CUstream);
  CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
} td__cu;

/* The environment variable naming the library to load instead of
 * libcuda.so.1: set only by the tests, to the driver's test double. */
#define TD__CU_DRIVER_ENV "TENSORD_CUDA_DRIVER"
#define TD__CU_DRIVER_LIB "libcuda.so.1"

/* Loads the driver once per process (thread-safe): dlopen(
 * $TENSORD_CUDA_DRIVER if set, else libcuda.so.1), dlsym every entry,
 * cuInit(0). Returns the table, valid for the life of the process (the
 * library is never unloaded), or NULL with msg (if not NULL) saying why:
 * "no CUDA driver (libcuda.so.1: <dlerror>)", "cuInit: CUDA_ERROR_NO_DEVICE
 * (no CUDA-capable device is detected)", ... A failure is kept for the life
 * of the process, except cuInit's CUDA_ERROR_SYSTEM_NOT_READY (the driver's
 * own daemons still starting, at boot): then the first call a second or
 * more later calls cuInit again (td__cu_load_transient says so meanwhile).
 * A child of fork() inherits the table, and the driver allows it nothing:
 * every call fails (CUDA_ERROR_NOT_INITIALIZED, cuInit included) once the
 * parent has initialised CUDA. Callers ask td__cu_forked first. */
const td__cu *td__cu_load(char *msg, size_t len);

/* Returns 0 if this process may call the driver: it is not loaded, or this
 * very process loaded it. In a child of fork() (or its descendant) that
 * inherited a loaded driver, returns TD_EFORKED with msg naming both pids:
 * the driver would refuse every call there, and the inherited contexts and
 * mappings are unusable. Safe in a child whatever locks the parent held:
 * it takes none. */
int td__cu_forked(char *msg, size_t len);

/* 1 if the driver is not loaded and the last td__cu_load failed in a way a
 * later call may not (see above), else 0. */
int td__cu_load_transient(void);

/* Set to 1 in the daemon's environment, serve every GPU with cuMemAlloc and
 * legacy IPC handles, as on a GPU without VMM or POSIX-fd handles: a
 * switch for tests (and tests/gpu/run.sh), never for production. */
#define TD__CU_LEGACY_ENV "TENSORD_CUDA_LEGACY"

/* Returns the TD_E* code for a CUresult: 0 for CUDA_SUCCESS,
 * OUT_OF_MEMORY -> TD_ENOMEM, INVALID_DEVICE and NO_DEVICE -> TD_ENODEV,
 * NOT_SUPPORTED -> TD_ENOSYS, INVALID_VALUE -> TD_EINVAL, else TD_EIO. */
int td__cu_code(CUresult r);

/* 1 if r is one of the driver's sticky errors (an illegal address, a
 * failed launch, an uncorrectable ECC error, ...): the context that met it
 * is unusable, every later call on it fails the same way, and only
 * destroying it (restarting the process, for the primary context that
 * tensord shares with the program) recovers. */
int td__cu_sticky(CUresult r);

/* Writes "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" into buf (len > 0) and
 * returns buf; for a sticky error (td__cu_sticky) it adds that the
 * context is unusable and the process must restart. cu may be NULL, and the
 * driver may not know r: the number then stands in for the name ("CUresult
 * 12345"). */
const char *td__cu_strerror(const td__cu *cu, CUresult r, char *buf,
                            size_t len);

/* Finds, among the devices this process sees (CUDA_VISIBLE_DEVICES applies),
 * the one whose UUID is uuid, and stores its ordinal in *out. Returns 0, or
 * TD_ENODEV if none has it (or the driver fails to say); *out is unchanged
 * on failure. */
int td__cu_device_by_uuid(const td__cu *cu, const uint8_t uuid[16],
                          CUdevice *out);

/* A GPU's UUID as text: td_gpu_uuid_str (tensord.h), MIG- where the loaded
 * driver says uuid is one of this process's MIG instances
 * (cuDeviceGetUuid_v2 gives an instance's own UUID, the first version its
 * GPU's); GPU- otherwise, and before the driver loads. TD__CU_UUID_STRLEN
 * bytes with the NUL; shorter buffers get a truncated string. Returns buf. */
#define TD__CU_UUID_STRLEN TD_UUID_STR_MAX
char *td__cu_uuid_str(const uint8_t uuid[16], char *buf, size_t len);
/* 1 if uuid is a MIG instance this process sees (see td__cu_uuid_str). */
int td__cu_uuid_is_mig(const uint8_t uuid[16]);

#endif /* TD_CUDA_DRIVER_H */

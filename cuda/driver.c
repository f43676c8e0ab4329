/* driver.c: loads the CUDA driver at run time and resolves its entry points
 * (see driver.h); maps its errors to tensord's. */
#include "driver.h"

#include "common.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The symbol cuda.h maps an entry point's name to: cuMemGetInfo is a macro
 * for cuMemGetInfo_v2, and the driver exports both, with the old ABI under
 * the old name. Stringizing the expanded macro picks the one whose prototype
 * cuda.h declares. */
#define STR_(x) #x
#define STR(x) STR_(x)
#define ENTRY(field, fn)                                                       \
  { STR(fn), offsetof(td__cu, field), 0 }
/* An entry a driver may lack: left NULL, and what needs it is skipped. */
#define OPTIONAL(field, fn)                                                    \
  { STR(fn), offsetof(td__cu, field), 1 }

static const struct {
  const char *name;
  size_t offset;
  int optional;
} entries[] = {
    ENTRY(Init, cuInit),
    ENTRY(GetErrorName, cuGetErrorName),
    ENTRY(GetErrorString, cuGetErrorString),
    ENTRY(DeviceGetCount, cuDeviceGetCount),
    ENTRY(DeviceGet, cuDeviceGet),
    ENTRY(DeviceGetUuid, cuDeviceGetUuid),
    ENTRY(DeviceGetName, cuDeviceGetName),
    ENTRY(DeviceGetAttribute, cuDeviceGetAttribute),
    ENTRY(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain),
    ENTRY(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease),
    ENTRY(CtxPushCurrent, cuCtxPushCurrent),
    ENTRY(CtxPopCurrent, cuCtxPopCurrent),
    ENTRY(CtxSynchronize, cuCtxSynchronize),
    ENTRY(MemGetInfo, cuMemGetInfo),
    ENTRY(MemGetAllocationGranularity, cuMemGetAllocationGranularity),
    ENTRY(MemCreate, cuMemCreate),
    ENTRY(MemRelease, cuMemRelease),
    ENTRY(MemExportToShareableHandle, cuMemExportToShareableHandle),
    ENTRY(MemImportFromShareableHandle, cuMemImportFromShareableHandle),
    ENTRY(MemAddressReserve, cuMemAddressReserve),
    ENTRY(MemAddressFree, cuMemAddressFree),
    ENTRY(MemMap, cuMemMap),
    ENTRY(MemUnmap, cuMemUnmap),
    ENTRY(MemSetAccess, cuMemSetAccess),
    ENTRY(MemcpyHtoD, cuMemcpyHtoD),
    ENTRY(MemcpyDtoH, cuMemcpyDtoH),
    ENTRY(MemsetD8, cuMemsetD8),
    ENTRY(Memcpy2D, cuMemcpy2D),
    ENTRY(MemAlloc, cuMemAlloc),
    ENTRY(MemFree, cuMemFree),
    ENTRY(IpcGetMemHandle, cuIpcGetMemHandle),
    ENTRY(IpcOpenMemHandle, cuIpcOpenMemHandle),
    ENTRY(IpcCloseMemHandle, cuIpcCloseMemHandle),
    ENTRY(EventCreate, cuEventCreate),
    ENTRY(EventRecord, cuEventRecord),
    ENTRY(EventSynchronize, cuEventSynchronize),
    ENTRY(EventDestroy, cuEventDestroy),
    ENTRY(StreamWaitEvent, cuStreamWaitEvent),
    ENTRY(IpcGetEventHandle, cuIpcGetEventHandle),
    ENTRY(IpcOpenEventHandle, cuIpcOpenEventHandle),
    ENTRY(MemHostAlloc, cuMemHostAlloc),
    ENTRY(MemFreeHost, cuMemFreeHost),
    ENTRY(StreamCreate, cuStreamCreate),
    ENTRY(StreamDestroy, cuStreamDestroy),
    ENTRY(StreamSynchronize, cuStreamSynchronize),
    ENTRY(MemcpyHtoDAsync, cuMemcpyHtoDAsync),
    ENTRY(MemcpyDtoHAsync, cuMemcpyDtoHAsync),
    ENTRY(MemsetD8Async, cuMemsetD8Async),
    ENTRY(Memcpy2DAsync, cuMemcpy2DAsync),
    OPTIONAL(ModuleLoadData, cuModuleLoadData),
    OPTIONAL(ModuleGetFunction, cuModuleGetFunction),
    OPTIONAL(ModuleUnload, cuModuleUnload),
    OPTIONAL(LaunchKernel, cuLaunchKernel),
    OPTIONAL(MemcpyPeerAsync, cuMemcpyPeerAsync),
    OPTIONAL(DeviceCanAccessPeer, cuDeviceCanAccessPeer),
};
/* Every field of td__cu has an entry above. */
_Static_assert(sizeof entries / sizeof entries[0] * sizeof(void (*)(void)) ==
                   sizeof(td__cu),
               "td__cu and entries[] disagree");

/* A cuInit that failed with CUDA_ERROR_SYSTEM_NOT_READY (the driver's
 * daemons, nvidia-persistenced or the fabric manager, still starting) is
 * tried again by the first call this long after it. */
#define RETRY_NS 1000000000ull

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static td__cu table;
static const td__cu *_Atomic loaded; /* &table once loaded, else NULL */
static _Atomic pid_t loaded_pid;     /* the process whose cuInit it was */
static void *lib;                    /* load_mu: dlopen'd, kept on retry */
static int given_up;                 /* load_mu: failed for good */
static int transient;                /* load_mu: the last failure may pass */
static uint64_t retry_at;            /* load_mu: CLOCK_MONOTONIC ns */
static char failure[TD__ERRMSG_MAX]; /* load_mu: why loading failed */

/* cuDeviceGetUuid of the first version, which cuda.h no longer names: on a
 * MIG instance it gives the UUID of the GPU the instance is carved from,
 * where the _v2 the table holds gives the instance's own. NULL if the
 * driver lacks it. */
static CUresult (*uuid_v1)(CUuuid *, CUdevice);

/* The UUIDs of the MIG instances among this process's devices, read once
 * when cuInit succeeds (the device list is fixed from then on). Written
 * before loaded is published, read only once it is. */
#define MAX_MIG 64
static uint8_t mig_uuids[MAX_MIG][16];
static size_t nmig;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* dlopen()s the driver and resolves every entry into table. Returns 0, or
 * -1 with failure filled (for good: the library is what it is). */
static int open_lib(void) {
  const char *path = getenv(TD__CU_DRIVER_ENV);
  if (path == NULL || path[0] == '\0')
    path = TD__CU_DRIVER_LIB;
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    /* dlerror() names the file first, mostly: then it says it all. */
    const char *e = dlerror();
    if (e != NULL && strncmp(e, path, strlen(path)) == 0)
      snprintf(failure, sizeof failure, "no CUDA driver (%s)", e);
    else
      snprintf(failure, sizeof failure, "no CUDA driver (%s: %s)", path,
               e != NULL ? e : "dlopen failed");
    return -1;
  }
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
    dlerror();
    void *sym = dlsym(h, entries[i].name);
    if (sym == NULL && entries[i].optional) {
      dlerror();
      continue; /* the field stays NULL */
    }
    if (sym == NULL) {
      const char *e = dlerror();
      snprintf(failure, sizeof failure,
               "CUDA driver %s lacks %s (%s): too old for tensord", path,
               entries[i].name, e != NULL ? e : "NULL");
      dlclose(h);
      return -1;
    }
    /* POSIX guarantees a function's address survives the round trip
     * through void * that dlsym makes. */
    memcpy((char *)&table + entries[i].offset, &sym, sizeof sym);
  }
  /* Optional: without it no device is taken for a MIG instance. */
  void *v1 = dlsym(h, "cuDeviceGetUuid");
  memcpy(&uuid_v1, &v1, sizeof v1);
  lib = h;
  return 0;
}

/* Notes which devices are MIG instances: those whose _v2 UUID differs from
 * their GPU's (the first version's). */
static void read_mig(void) {
  int n = 0;
  nmig = 0;
  if (uuid_v1 == NULL || table.DeviceGetCount(&n) != CUDA_SUCCESS)
    return;
  for (int i = 0; i < n && nmig < MAX_MIG; i++) {
    CUdevice d;
    CUuuid v1, v2;
    if (table.DeviceGet(&d, i) == CUDA_SUCCESS &&
        uuid_v1(&v1, d) == CUDA_SUCCESS &&
        table.DeviceGetUuid(&v2, d) == CUDA_SUCCESS &&
        memcmp(v1.bytes, v2.bytes, 16) != 0)
      memcpy(mig_uuids[nmig++], v2.bytes, 16);
  }
}

/* One try, with load_mu held: open the library if not yet, then cuInit. */
static void load(void) {
  if (lib == NULL && open_lib() < 0) {
    given_up = 1;
    return;
  }
  const char *path = getenv(TD__CU_DRIVER_ENV);
  if (path == NULL || path[0] == '\0')
    path = TD__CU_DRIVER_LIB;
  CUresult r = table.Init(0);
  if (r == CUDA_SUCCESS) {
    transient = 0;
    read_mig();
    atomic_store(&loaded_pid, getpid());
    atomic_store(&loaded, &table);
    return;
  }
  char e[256];
  td__cu_strerror(&table, r, e, sizeof e);
  if (r == CUDA_ERROR_SYSTEM_NOT_READY) {
    /* Keep the library: the next try is only another cuInit. */
    transient = 1;
    retry_at = now_ns() + RETRY_NS;
    snprintf(failure, sizeof failure,
             "cuInit: %s (driver %s): the driver is still starting; "
             "tried again at the next CUDA call a second from now",
             e, path);
    return;
  }
  snprintf(failure, sizeof failure, "cuInit: %s (driver %s)", e, path);
  given_up = 1;
  transient = 0;
  dlclose(lib);
  lib = NULL;
}

const td__cu *td__cu_load(char *msg, size_t len) {
  const td__cu *t = atomic_load(&loaded);
  if (t != NULL)
    return t;
  pthread_mutex_lock(&load_mu);
  if ((t = atomic_load(&loaded)) == NULL) {
    if (!given_up && (!transient || now_ns() >= retry_at))
      load();
    if ((t = atomic_load(&loaded)) == NULL)
      td__msg(msg, len, TD_ENODEV, "%s", failure);
  }
  pthread_mutex_unlock(&load_mu);
  return t;
}

int td__cu_forked(char *msg, size_t len) {
  /* loaded_pid is written before loaded is published. */
  if (atomic_load(&loaded) == NULL)
    return 0;
  pid_t by = atomic_load(&loaded_pid), self = getpid();
  if (by == self)
    return 0;
  return td__msg(msg, len, TD_EFORKED,
                 "this process (pid %d) is a fork() %s of pid %d, which had "
                 "initialised CUDA, and the driver allows a child no CUDA: "
                 "use CUDA in a process that did not inherit it (spawn, or "
                 "fork before the first CUDA call)",
                 (int)self, getppid() == by ? "child" : "descendant", (int)by);
}

int td__cu_load_transient(void) {
  pthread_mutex_lock(&load_mu);
  int t = atomic_load(&loaded) == NULL && transient;
  pthread_mutex_unlock(&load_mu);
  return t;
}

int td__cu_code(CUresult r) {
  switch (r) {
  case CUDA_SUCCESS:
    return 0;
  case CUDA_ERROR_OUT_OF_MEMORY:
    return TD_ENOMEM;
  case CUDA_ERROR_INVALID_DEVICE:
  case CUDA_ERROR_NO_DEVICE:
    return TD_ENODEV;
  case CUDA_ERROR_NOT_SUPPORTED:
    return TD_ENOSYS;
  case CUDA_ERROR_INVALID_VALUE:
    return TD_EINVAL;
  default:
    return TD_EIO;
  }
}

const char *td__cu_strerror(const td__cu *cu, CUresult r, char *buf,
                            size_t len) {
  const char *name = NULL, *text = NULL;
  if (cu != NULL) {
    if (cu->GetErrorName(r, &name) != CUDA_SUCCESS)
      name = NULL;
    if (cu->GetErrorString(r, &text) != CUDA_SUCCESS)
      text = NULL;
  }
  /* Short enough that the longest sticky error's name and text and this
   * fit the 128-byte buffers the callers format into. */
  const char *sticky = td__cu_sticky(r)
                           ? ": sticky, this GPU's context is unusable: restart"
                           : "";
  if (name != NULL && text != NULL)
    snprintf(buf, len, "%s (%s)%s", name, text, sticky);
  else if (name != NULL)
    snprintf(buf, len, "%s%s", name, sticky);
  else
    snprintf(buf, len, "CUresult %d%s", (int)r, sticky);
  return buf;
}

int td__cu_sticky(CUresult r) {
  switch (r) {
  case CUDA_ERROR_ILLEGAL_ADDRESS:
  case CUDA_ERROR_HARDWARE_STACK_ERROR:
  case CUDA_ERROR_ILLEGAL_INSTRUCTION:
  case CUDA_ERROR_MISALIGNED_ADDRESS:
  case CUDA_ERROR_INVALID_ADDRESS_SPACE:
  case CUDA_ERROR_INVALID_PC:
  case CUDA_ERROR_LAUNCH_FAILED:
  case CUDA_ERROR_LAUNCH_TIMEOUT:
  case CUDA_ERROR_ASSERT:
  case CUDA_ERROR_ECC_UNCORRECTABLE:
    return 1;
  default:
    return 0;
  }
}

int td__cu_device_by_uuid(const td__cu *cu, const uint8_t uuid[16],
                          CUdevice *out) {
  int n = 0;
  if (cu->DeviceGetCount(&n) != CUDA_SUCCESS)
    return TD_ENODEV;
  for (int i = 0; i < n; i++) {
    CUdevice d;
    CUuuid u;
    if (cu->DeviceGet(&d, i) != CUDA_SUCCESS ||
        cu->DeviceGetUuid(&u, d) != CUDA_SUCCESS)
      continue;
    if (memcmp(u.bytes, uuid, 16) == 0) {
      *out = d;
      return 0;
    }
  }
  return TD_ENODEV;
}

int td__cu_uuid_is_mig(const uint8_t uuid[16]) {
  if (atomic_load(&loaded) == NULL)
    return 0;
  for (size_t i = 0; i < nmig; i++)
    if (memcmp(mig_uuids[i], uuid, 16) == 0)
      return 1;
  return 0;
}

char *td__cu_uuid_str(const uint8_t uuid[16], char *buf, size_t len) {
  return td_gpu_uuid_str(uuid, td__cu_uuid_is_mig(uuid), buf, len);
}

/* cumap.c: this process's side of CUDA storages: naming a GPU by its UUID,
 * and mapping the VMM allocation a daemon exported (import the fd, reserve
 * an address range, map, set access), undone in reverse order. */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if TD_HAVE_CUDA
#include "driver.h"

struct td__cumap {
  const td__cu *cu;
  CUdevice dev;
  CUcontext ctx; /* the primary context, retained while mapped */
  CUdeviceptr ptr;
  size_t size;
};

/* Loads the driver. Returns it, or NULL with msg saying why. */
static const td__cu *load(char *msg, size_t len) {
  char why[256];
  const td__cu *cu = td__cu_load(why, sizeof(why));
  if (cu == NULL)
    td__msg(msg, len, TD_ENODEV, "%s", why);
  return cu;
}

int td__cu_resolve(int64_t index, uint8_t uuid[16], char *msg, size_t len) {
  const td__cu *cu = load(msg, len);
  if (cu == NULL)
    return TD_ENODEV;
  int n = 0;
  char e[128];
  CUresult r = cu->DeviceGetCount(&n);
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "cuDeviceGetCount: %s",
                   td__cu_strerror(cu, r, e, sizeof(e)));
  if (index < 0 || index >= n) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    return td__msg(msg, len, TD_ENODEV,
                   "no device cuda:%lld: this process sees %d CUDA "
                   "device(s)%s%s",
                   (long long)index, n, vis ? " (CUDA_VISIBLE_DEVICES=" : "",
                   vis ? vis : "");
  }
  CUdevice d;
  CUuuid u;
  if ((r = cu->DeviceGet(&d, (int)index)) != CUDA_SUCCESS ||
      (r = cu->DeviceGetUuid(&u, d)) != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "cuda:%lld: %s", (long long)index,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  memcpy(uuid, u.bytes, 16);
  return 0;
}

/* Undoes what td__cumap_open did, as far as it got. */
static void undo(td__cumap *m, int mapped, int reserved) {
  const td__cu *cu = m->cu;
  if (cu->CtxPushCurrent(m->ctx) == CUDA_SUCCESS) {
    CUcontext popped;
    if (mapped)
      cu->MemUnmap(m->ptr, m->size);
    if (reserved)
      cu->MemAddressFree(m->ptr, m->size);
    cu->CtxPopCurrent(&popped);
  }
  cu->DevicePrimaryCtxRelease(m->dev);
}

int td__cumap_open(const uint8_t uuid[16], int fd, uint64_t size, int ro,
                   td__cumap **out, char *msg, size_t len) {
  *out = NULL;
  const td__cu *cu = load(msg, len);
  if (cu == NULL)
    return TD_ENODEV;
  char u[48], e[128];
  td__cumap *m = calloc(1, sizeof(*m));
  if (m == NULL)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  m->cu = cu;
  m->size = size;
  if (td__cu_device_by_uuid(cu, uuid, &m->dev) < 0) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    free(m);
    return td__msg(msg, len, TD_ENODEV,
                   "the storage is on GPU %s, which this process cannot "
                   "see%s%s%s",
                   td__cu_uuid_str(uuid, u, sizeof(u)),
                   vis ? " (CUDA_VISIBLE_DEVICES=" : "", vis ? vis : "",
                   vis ? ")" : "");
  }
  const char *what = "cuDevicePrimaryCtxRetain";
  CUresult r = cu->DevicePrimaryCtxRetain(&m->ctx, m->dev);
  if (r != CUDA_SUCCESS)
    goto fail_noctx;
  what = "cuCtxPushCurrent";
  if ((r = cu->CtxPushCurrent(m->ctx)) != CUDA_SUCCESS)
    goto fail;
  int reserved = 0, mapped = 0;
  CUmemGenericAllocationHandle h;
  CUcontext popped;
  what = "cuMemImportFromShareableHandle";
  r = cu->MemImportFromShareableHandle(
      &h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    cu->CtxPopCurrent(&popped);
    goto fail;
  }
  what = "cuMemAddressReserve";
  r = cu->MemAddressReserve(&m->ptr, size, 0, 0, 0);
  reserved = r == CUDA_SUCCESS;
  if (reserved) {
    what = "cuMemMap";
    r = cu->MemMap(m->ptr, size, 0, h, 0);
    mapped = r == CUDA_SUCCESS;
  }
  if (mapped) {
    CUmemAccessDesc a = {0};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = m->dev;
    a.flags =
        ro ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    what = "cuMemSetAccess";
    r = cu->MemSetAccess(m->ptr, size, &a, 1);
  }
  /* The mapping keeps the allocation; the handle is no longer needed. */
  cu->MemRelease(h);
  cu->CtxPopCurrent(&popped);
  if (r != CUDA_SUCCESS) {
    snprintf(msg, len, "%s of %llu bytes on %s: %s", what,
             (unsigned long long)size, td__cu_uuid_str(uuid, u, sizeof(u)),
             td__cu_strerror(cu, r, e, sizeof(e)));
    undo(m, mapped, reserved);
    free(m);
    return td__cu_code(r);
  }
  *out = m;
  return 0;
fail:
  cu->DevicePrimaryCtxRelease(m->dev);
fail_noctx:
  snprintf(msg, len, "%s on %s: %s", what, td__cu_uuid_str(uuid, u, sizeof(u)),
           td__cu_strerror(cu, r, e, sizeof(e)));
  free(m);
  return td__cu_code(r);
}

void *td__cumap_addr(const td__cumap *m) {
  return (void *)(uintptr_t)m->ptr;
}

int td__cumap_index(const td__cumap *m) {
  return (int)m->dev; /* a CUdevice is the ordinal in this process */
}

int td__cumap_zero(td__cumap *m, size_t nbytes, char *msg, size_t len) {
  const td__cu *cu = m->cu;
  CUcontext popped;
  char e[128];
  CUresult r = cu->CtxPushCurrent(m->ctx);
  if (r == CUDA_SUCCESS) {
    r = cu->MemsetD8(m->ptr, 0, nbytes);
    if (r == CUDA_SUCCESS)
      r = cu->CtxSynchronize();
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "zeroing %zu bytes: %s", nbytes,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

int td__cumap_copy(td__cumap *m, int to_device, size_t off, void *host,
                   size_t n, char *msg, size_t len) {
  const td__cu *cu = m->cu;
  CUcontext popped;
  char e[128];
  CUresult r = cu->CtxPushCurrent(m->ctx);
  if (r == CUDA_SUCCESS) {
    r = to_device ? cu->MemcpyHtoD(m->ptr + off, host, n)
                  : cu->MemcpyDtoH(host, m->ptr + off, n);
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "%s of %zu bytes: %s",
                   to_device ? "cuMemcpyHtoD" : "cuMemcpyDtoH", n,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

void td__cumap_close(td__cumap *m) {
  if (m == NULL)
    return;
  undo(m, 1, 1);
  free(m);
}

#else /* !TD_HAVE_CUDA */

static int no_cuda(char *msg, size_t len) {
  return td__msg(msg, len, TD_ENODEV, "this libtensord was built without CUDA");
}

int td__cu_resolve(int64_t index, uint8_t uuid[16], char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__cumap_open(const uint8_t uuid[16], int fd, uint64_t size, int ro,
                   td__cumap **out, char *msg, size_t len) {
  *out = NULL;
  return no_cuda(msg, len);
}

void *td__cumap_addr(const td__cumap *m) {
  return NULL;
}

int td__cumap_index(const td__cumap *m) {
  return 0;
}

int td__cumap_zero(td__cumap *m, size_t nbytes, char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__cumap_copy(td__cumap *m, int to_device, size_t off, void *host,
                   size_t n, char *msg, size_t len) {
  return no_cuda(msg, len);
}

void td__cumap_close(td__cumap *m) {}

#endif /* TD_HAVE_CUDA */

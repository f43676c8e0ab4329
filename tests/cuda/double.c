/* double.c: a TEST DOUBLE of the CUDA driver (libtdcuda_double.so), NOT the
 * driver. It implements, over host memory, the subset of the driver API that
 * tensord uses (cuda/driver.h), with the driver's semantics where tensord
 * depends on them: a VMM allocation is a memfd, its exported POSIX handle a
 * real fd another process imports and maps, device pointers are addresses in
 * the calling process, granularity and capacity are enforced, read-only access
 * is really read-only (mprotect), errors are CUDA's codes. Loaded only by the
 * tests, through TENSORD_CUDA_DRIVER. It proves tensord's protocol and
 * bookkeeping, never that tensord works on a GPU. See tests/cuda/README.md. */
#include <cuda.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Only the driver's entry points are exported (the library is built with
 * hidden visibility). Definitions use cuda.h's names, so cuMemGetInfo below
 * is cuMemGetInfo_v2, with the prototype cuda.h gives it. */
#define API __attribute__((visibility("default")))

#define MAX_DEVICES 16
#define MAX_CTX_DEPTH 64
#define GRANULARITY ((size_t)2 << 20)
#define DEFAULT_DEVICES 2
#define DEFAULT_MEM ((size_t)1 << 30)
#define MEMFD_PREFIX "tdcuda-double."
#define DEVICE_NAME "tensord CUDA test double"

/* An allocation: a memfd, shared by every handle this process has on it (an
 * import of an fd whose memfd this process already holds finds it) and
 * every mapping of it. It goes with the last of them. */
typedef struct alloc {
  int fd;
  size_t size;
  int phys;       /* the physical device (index before renumbering) */
  int created;    /* made here by cuMemCreate: counts in used[phys] */
  unsigned types; /* CUmemAllocationHandleType bits it may be exported as */
  dev_t st_dev;   /* the memfd's identity, to find it on import */
  ino_t st_ino;
  uint64_t tag; /* cuMemAlloc's: random, in its legacy IPC handles */
  int handles;  /* handles naming it */
  int maps;     /* mappings of it */
} alloc;

typedef struct {
  CUmemGenericAllocationHandle id;
  alloc *a;
} handle;

typedef struct {
  uintptr_t base;
  size_t size;
} resv;

typedef struct {
  uintptr_t base;
  size_t size;
  alloc *a;
  int prot; /* PROT_NONE, PROT_READ or PROT_READ | PROT_WRITE */
  /* 0: a VMM mapping (cuMemMap); LEGACY_ALLOC: cuMemAlloc's memory;
   * LEGACY_OPEN: a legacy IPC handle opened here (cuIpcOpenMemHandle). */
  int legacy;
  pid_t pid; /* the process that made a legacy mapping (fork keeps it) */
} mapping;

#define LEGACY_ALLOC 1
#define LEGACY_OPEN 2

/* A primary context, one per visible device. */
struct CUctx_st {
  int ordinal;
  int refs; /* retains not yet released: usable while > 0 */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int nphys;                /* TDCUDA_DEVICES */
static size_t mem_total;         /* TDCUDA_MEM, per device */
static int no_posix_fd;          /* TDCUDA_NO_POSIX_FD=1 */
static int nvis;                 /* devices this process sees */
static int vis[MAX_DEVICES];     /* ordinal -> physical device */
static size_t used[MAX_DEVICES]; /* bytes created here, per physical device */
static struct CUctx_st ctxs[MAX_DEVICES]; /* by ordinal */

static handle *handles;
static size_t nhandles, caphandles;
static CUmemGenericAllocationHandle next_handle = 0x7dc0de0000000001ull;
static resv *resvs;
static size_t nresvs, capresvs;
static mapping *maps;
static size_t nmaps, capmaps;

static __thread CUcontext ctx_stack[MAX_CTX_DEPTH];
static __thread int ctx_depth;

/* ---- errors ---- */

static const struct {
  CUresult r;
  const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED",
     "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED",
     "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY",
     "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
     "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
     "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
     "invalid device context"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED",
     "context is destroyed"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED",
     "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED",
     "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
     "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int error_index(CUresult r) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].r == r)
      return (int)i;
  return -1;
}

API CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
  if (pStr == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  int i = error_index(error);
  *pStr = i < 0 ? NULL : errors[i].name;
  return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

API CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
  if (pStr == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  int i = error_index(error);
  *pStr = i < 0 ? NULL : errors[i].text;
  return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* ---- growable tables ---- */

static int grow(void **v, size_t *cap, size_t n, size_t each) {
  if (n < *cap)
    return 0;
  size_t c = *cap ? *cap * 2 : 16;
  void *p = realloc(*v, c * each);
  if (p == NULL)
    return -1;
  *v = p;
  *cap = c;
  return 0;
}

static handle *find_handle(CUmemGenericAllocationHandle id) {
  for (size_t i = 0; i < nhandles; i++)
    if (handles[i].id == id)
      return &handles[i];
  return NULL;
}

static resv *find_resv(uintptr_t p, size_t size) {
  for (size_t i = 0; i < nresvs; i++)
    if (p >= resvs[i].base && size <= resvs[i].size &&
        p - resvs[i].base <= resvs[i].size - size)
      return &resvs[i];
  return NULL;
}

/* The mapping that holds address p, or NULL. */
static mapping *map_at(uintptr_t p) {
  for (size_t i = 0; i < nmaps; i++)
    if (p >= maps[i].base && p - maps[i].base < maps[i].size)
      return &maps[i];
  return NULL;
}

/* Whether [p, p + size) is exactly a run of whole mappings. */
static int whole_mappings(uintptr_t p, size_t size) {
  if (size == 0)
    return 0;
  uintptr_t end = p + size;
  while (p < end) {
    mapping *m = map_at(p);
    if (m == NULL || m->base != p || m->size > end - p)
      return 0;
    p += m->size;
  }
  return 1;
}

/* Whether every byte of [p, p + size) is mapped with at least prot. */
static int accessible(uintptr_t p, size_t size, int prot) {
  if (size == 0)
    return 1;
  if (p + size < p)
    return 0;
  uintptr_t end = p + size;
  while (p < end) {
    mapping *m = map_at(p);
    if (m == NULL || (m->prot & prot) != prot)
      return 0;
    p = m->base + m->size;
  }
  return 1;
}

static void alloc_unref(alloc *a) {
  if (a->handles > 0 || a->maps > 0)
    return;
  close(a->fd);
  if (a->created)
    used[a->phys] -= a->size;
  free(a);
}

/* ---- initialisation and devices ---- */

static void uuid_of(int phys, unsigned char out[16]) {
  memcpy(out, "tdcudadouble", 12);
  out[12] = (unsigned char)(phys >> 24);
  out[13] = (unsigned char)(phys >> 16);
  out[14] = (unsigned char)(phys >> 8);
  out[15] = (unsigned char)phys;
}

static void uuid_str(int phys, char out[41]) {
  unsigned char u[16];
  uuid_of(phys, u);
  snprintf(out, 41,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10],
           u[11], u[12], u[13], u[14], u[15]);
}

/* Parses a size: digits, then an optional K, M or G (powers of 1024). */
static int parse_size(const char *s, size_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || end == s || s[0] == '-')
    return -1;
  int shift = 0;
  switch (*end) {
  case 'K':
    shift = 10, end++;
    break;
  case 'M':
    shift = 20, end++;
    break;
  case 'G':
    shift = 30, end++;
    break;
  }
  if (*end != '\0' || v > (SIZE_MAX >> shift))
    return -1;
  *out = (size_t)v << shift;
  return 0;
}

/* CUDA_VISIBLE_DEVICES as the driver reads it: a comma list of indexes or
 * UUIDs ("GPU-..." or an unambiguous prefix of one); the list ends at the
 * first entry that names no device (or one already listed). */
static void parse_visible(void) {
  const char *env = getenv("CUDA_VISIBLE_DEVICES");
  nvis = 0;
  if (env == NULL) {
    for (int i = 0; i < nphys; i++)
      vis[nvis++] = i;
    return;
  }
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", env);
  char *save = NULL;
  for (char *tok = strtok_r(buf, ",", &save); tok != NULL;
       tok = strtok_r(NULL, ",", &save)) {
    while (*tok == ' ')
      tok++;
    int phys = -1;
    if (strncmp(tok, "GPU-", 4) == 0) {
      size_t n = strlen(tok);
      for (int i = 0; i < nphys; i++) {
        char u[41];
        uuid_str(i, u);
        if (strncasecmp(u, tok, n) == 0) {
          if (phys >= 0) { /* ambiguous */
            phys = -1;
            break;
          }
          phys = i;
        }
      }
    } else {
      char *end;
      long v = strtol(tok, &end, 10);
      if (end != tok && *end == '\0' && v >= 0 && v < nphys)
        phys = (int)v;
    }
    if (phys < 0)
      return;
    for (int i = 0; i < nvis; i++)
      if (vis[i] == phys)
        return;
    vis[nvis++] = phys;
  }
}

API CUresult CUDAAPI cuInit(unsigned int Flags) {
  if (Flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_SUCCESS;
  if (initialized)
    goto out;
  const char *s = getenv("TDCUDA_DEVICES");
  size_t n = DEFAULT_DEVICES;
  if (s != NULL && (parse_size(s, &n) != 0 || n > MAX_DEVICES)) {
    fprintf(stderr, "tdcuda double: TDCUDA_DEVICES=%s is not 0..%d\n", s,
            MAX_DEVICES);
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  nphys = (int)n;
  mem_total = DEFAULT_MEM;
  s = getenv("TDCUDA_MEM");
  if (s != NULL && parse_size(s, &mem_total) != 0) {
    fprintf(stderr, "tdcuda double: TDCUDA_MEM=%s is not a size\n", s);
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  s = getenv("TDCUDA_NO_POSIX_FD");
  no_posix_fd = s != NULL && strcmp(s, "1") == 0;
  parse_visible();
  if (nvis == 0) {
    r = CUDA_ERROR_NO_DEVICE;
    goto out;
  }
  for (int i = 0; i < nvis; i++)
    ctxs[i] = (struct CUctx_st){.ordinal = i, .refs = 0};
  initialized = 1;
out:
  pthread_mutex_unlock(&mu);
  return r;
}

/* Returns CUDA_SUCCESS if the driver is initialised and dev is an ordinal
 * this process sees. Called with mu held, or where the answer cannot change
 * (after cuInit succeeded, the devices stay). */
static CUresult check_device(CUdevice dev) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (dev < 0 || dev >= nvis)
    return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGetCount(int *count) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (count == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  *count = nvis;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (device == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= nvis)
    return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (uuid == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  uuid_of(vis[dev], (unsigned char *)uuid->bytes);
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (name == NULL || len <= 0)
    return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "%s", DEVICE_NAME);
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib,
                                          CUdevice dev) {
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (pi == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {
  case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
  case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    *pi = 1;
    break;
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    *pi = !no_posix_fd;
    break;
  case CU_DEVICE_ATTRIBUTE_INTEGRATED:
  case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
  case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
    *pi = 0;
    break;
  case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
    *pi = vis[dev] + 1;
    break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
    *pi = 8;
    break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
    *pi = attrib == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? 1 : 0;
    break;
  default:
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

/* ---- contexts ---- */

API CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (pctx == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  ctxs[dev].refs++;
  *pctx = &ctxs[dev];
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  pthread_mutex_lock(&mu);
  if (ctxs[dev].refs == 0)
    r = CUDA_ERROR_INVALID_CONTEXT;
  else
    ctxs[dev].refs--;
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx == NULL || ctx < &ctxs[0] || ctx >= &ctxs[nvis])
    return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx_depth == MAX_CTX_DEPTH)
    return CUDA_ERROR_OUT_OF_MEMORY;
  ctx_stack[ctx_depth++] = ctx;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx_depth == 0)
    return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext c = ctx_stack[--ctx_depth];
  if (pctx != NULL)
    *pctx = c;
  return CUDA_SUCCESS;
}

/* The device of this thread's current context, with mu held: CUDA_SUCCESS,
 * or CUDA_ERROR_INVALID_CONTEXT when there is none or it was released. */
static CUresult current(int *ordinal) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx_depth == 0)
    return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext c = ctx_stack[ctx_depth - 1];
  if (c->refs == 0)
    return CUDA_ERROR_INVALID_CONTEXT;
  if (ordinal != NULL)
    *ordinal = c->ordinal;
  return CUDA_SUCCESS;
}

static CUresult drain_all(void);

/* Runs every stream's queued copies (below): the context's work is done. */
API CUresult CUDAAPI cuCtxSynchronize(void) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS)
    r = drain_all();
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemGetInfo(size_t *free_, size_t *total) {
  if (free_ == NULL || total == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  if (r == CUDA_SUCCESS) {
    size_t u = used[vis[ord]];
    *total = mem_total;
    *free_ = u < mem_total ? mem_total - u : 0;
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- VMM allocations ---- */

static CUresult check_prop(const CUmemAllocationProp *prop) {
  if (prop == NULL || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  return check_device(prop->location.id);
}

API CUresult CUDAAPI cuMemGetAllocationGranularity(
    size_t *granularity, const CUmemAllocationProp *prop,
    CUmemAllocationGranularity_flags option) {
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (granularity == NULL || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                              option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_prop(prop);
  if (r == CUDA_SUCCESS)
    *granularity = GRANULARITY;
  return r;
}

static CUresult new_handle(alloc *a, CUmemGenericAllocationHandle *out) {
  if (grow((void **)&handles, &caphandles, nhandles, sizeof *handles) != 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  handles[nhandles++] = (handle){.id = next_handle++, .a = a};
  a->handles++;
  *out = handles[nhandles - 1].id;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle_,
                                 size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags) {
  if (handle_ == NULL || flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  alloc *a = NULL;
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  if ((r = check_prop(prop)) != CUDA_SUCCESS)
    goto out;
  unsigned types = (unsigned)prop->requestedHandleTypes;
  if (types & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      (types && no_posix_fd)) {
    r = CUDA_ERROR_NOT_SUPPORTED;
    goto out;
  }
  if (size == 0 || size % GRANULARITY != 0) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  int phys = vis[prop->location.id];
  if (size > mem_total - used[phys]) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  if ((a = calloc(1, sizeof *a)) == NULL) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  char name[32];
  snprintf(name, sizeof name, MEMFD_PREFIX "%d", phys);
  a->fd = memfd_create(name, MFD_CLOEXEC);
  struct stat st;
  if (a->fd < 0 || ftruncate(a->fd, (off_t)size) != 0 ||
      fstat(a->fd, &st) != 0) {
    r = errno == ENOMEM || errno == ENOSPC ? CUDA_ERROR_OUT_OF_MEMORY
                                           : CUDA_ERROR_OPERATING_SYSTEM;
    if (a->fd >= 0)
      close(a->fd);
    free(a);
    a = NULL;
    goto out;
  }
  a->size = size;
  a->phys = phys;
  a->created = 1;
  a->types = types;
  a->st_dev = st.st_dev;
  a->st_ino = st.st_ino;
  if ((r = new_handle(a, handle_)) != CUDA_SUCCESS) {
    close(a->fd);
    free(a);
    goto out;
  }
  used[phys] += size;
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle_) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  handle *h = find_handle(handle_);
  if (h == NULL) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  alloc *a = h->a;
  *h = handles[--nhandles];
  a->handles--;
  alloc_unref(a);
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemExportToShareableHandle(
    void *shareableHandle, CUmemGenericAllocationHandle handle_,
    CUmemAllocationHandleType handleType, unsigned long long flags) {
  if (shareableHandle == NULL || flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  handle *h = find_handle(handle_);
  if (h == NULL) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    r = CUDA_ERROR_NOT_SUPPORTED;
    goto out;
  }
  if (!(h->a->types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    r = CUDA_ERROR_INVALID_VALUE; /* not requested at cuMemCreate */
    goto out;
  }
  int fd = fcntl(h->a->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    r = CUDA_ERROR_OPERATING_SYSTEM;
    goto out;
  }
  *(int *)shareableHandle = fd;
out:
  pthread_mutex_unlock(&mu);
  return r;
}

/* The physical device of a memfd this double made, from its name
 * ("/memfd:tdcuda-double.<phys> (deleted)"), or -1. */
static int memfd_device(int fd) {
  char path[64], target[PATH_MAX];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, target, sizeof target - 1);
  if (n < 0)
    return -1;
  target[n] = '\0';
  const char *p = "/memfd:" MEMFD_PREFIX;
  if (strncmp(target, p, strlen(p)) != 0)
    return -1;
  char *end;
  long v = strtol(target + strlen(p), &end, 10);
  if (end == target + strlen(p) || (*end != '\0' && *end != ' ') || v < 0 ||
      v >= nphys)
    return -1;
  return (int)v;
}

API CUresult CUDAAPI cuMemImportFromShareableHandle(
    CUmemGenericAllocationHandle *handle_, void *osHandle,
    CUmemAllocationHandleType shHandleType) {
  if (handle_ == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_NOT_SUPPORTED;
  int fd = (int)(intptr_t)osHandle;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  struct stat st;
  int phys = memfd_device(fd);
  if (phys < 0 || fstat(fd, &st) != 0 || st.st_size <= 0 ||
      (size_t)st.st_size % GRANULARITY != 0) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  int seen = 0;
  for (int i = 0; i < nvis; i++)
    seen |= vis[i] == phys;
  if (!seen) { /* its GPU is hidden from this process */
    r = CUDA_ERROR_INVALID_DEVICE;
    goto out;
  }
  /* This process may hold that memory already (made or imported here). */
  alloc *a = NULL;
  for (size_t i = 0; i < nhandles && a == NULL; i++)
    if (handles[i].a->st_dev == st.st_dev && handles[i].a->st_ino == st.st_ino)
      a = handles[i].a;
  for (size_t i = 0; i < nmaps && a == NULL; i++)
    if (maps[i].a->st_dev == st.st_dev && maps[i].a->st_ino == st.st_ino)
      a = maps[i].a;
  if (a == NULL) {
    if ((a = calloc(1, sizeof *a)) == NULL) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
      goto out;
    }
    a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (a->fd < 0) {
      free(a);
      r = CUDA_ERROR_OPERATING_SYSTEM;
      goto out;
    }
    a->size = (size_t)st.st_size;
    a->phys = phys;
    a->types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    a->st_dev = st.st_dev;
    a->st_ino = st.st_ino;
  }
  if ((r = new_handle(a, handle_)) != CUDA_SUCCESS)
    alloc_unref(a);
out:
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- address ranges and mappings ---- */

API CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size,
                                         size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) {
  if (ptr == NULL || flags != 0 || size == 0 || size % GRANULARITY != 0 ||
      (alignment & (alignment - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (alignment < GRANULARITY)
    alignment = GRANULARITY;
  if (size > SIZE_MAX - alignment)
    return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  if (grow((void **)&resvs, &capresvs, nresvs, sizeof *resvs) != 0) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  /* addr is a hint, as for the driver: ignored here. */
  size_t span = size + alignment;
  char *p = mmap(NULL, span, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  uintptr_t base = ((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1);
  size_t head = base - (uintptr_t)p, tail = span - head - size;
  if (head > 0)
    munmap(p, head);
  if (tail > 0)
    munmap((char *)base + size, tail);
  resvs[nresvs++] = (resv){.base = base, .size = size};
  *ptr = (CUdeviceptr)base;
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  resv *v = find_resv((uintptr_t)ptr, size);
  if (v == NULL || v->base != (uintptr_t)ptr || v->size != size) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  /* Stricter than the driver documents: the range must be unmapped. */
  for (size_t i = 0; i < nmaps; i++)
    if (maps[i].base >= v->base && maps[i].base - v->base < v->size) {
      r = CUDA_ERROR_INVALID_VALUE;
      goto out;
    }
  munmap((void *)v->base, v->size);
  *v = resvs[--nresvs];
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle_,
                              unsigned long long flags) {
  uintptr_t p = (uintptr_t)ptr;
  if (flags != 0 || offset != 0 || size == 0 || size % GRANULARITY != 0 ||
      p % GRANULARITY != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  handle *h = find_handle(handle_);
  if (h == NULL || size > h->a->size || find_resv(p, size) == NULL) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  for (size_t i = 0; i < nmaps; i++)
    if (maps[i].base < p + size && p < maps[i].base + maps[i].size) {
      r = CUDA_ERROR_ALREADY_MAPPED;
      goto out;
    }
  if (grow((void **)&maps, &capmaps, nmaps, sizeof *maps) != 0) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  if (mmap((void *)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->a->fd, 0) ==
      MAP_FAILED) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  maps[nmaps++] = (mapping){.base = p, .size = size, .a = h->a};
  h->a->maps++;
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  uintptr_t p = (uintptr_t)ptr;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  if (!whole_mappings(p, size) || map_at(p)->legacy) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  /* Back to a PROT_NONE reservation. */
  if (mmap((void *)p, size, PROT_NONE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
           0) == MAP_FAILED) {
    r = CUDA_ERROR_OPERATING_SYSTEM;
    goto out;
  }
  for (size_t i = 0; i < nmaps;) {
    if (maps[i].base >= p && maps[i].base - p < size) {
      alloc *a = maps[i].a;
      maps[i] = maps[--nmaps];
      a->maps--;
      alloc_unref(a);
    } else {
      i++;
    }
  }
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size,
                                    const CUmemAccessDesc *desc, size_t count) {
  uintptr_t p = (uintptr_t)ptr;
  if (desc == NULL || count == 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      r = CUDA_ERROR_INVALID_VALUE;
      goto out;
    }
    if ((r = check_device(desc[i].location.id)) != CUDA_SUCCESS)
      goto out;
    switch (desc[i].flags) {
    case CU_MEM_ACCESS_FLAGS_PROT_NONE:
      break;
    case CU_MEM_ACCESS_FLAGS_PROT_READ:
      prot |= PROT_READ;
      break;
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
      prot |= PROT_READ | PROT_WRITE;
      break;
    default:
      r = CUDA_ERROR_INVALID_VALUE;
      goto out;
    }
  }
  if (!whole_mappings(p, size)) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  if (mprotect((void *)p, size, prot) != 0) {
    r = CUDA_ERROR_OPERATING_SYSTEM;
    goto out;
  }
  for (uintptr_t q = p; q < p + size;) {
    mapping *m = map_at(q);
    m->prot = prot;
    q += m->size;
  }
out:
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- copies ---- */

/* Checks that [p, p + n) is mapped with prot in this thread's context. */
static CUresult check_range(uintptr_t p, size_t n, int prot) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && !accessible(p, n, prot))
    r = CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost,
                                  size_t ByteCount) {
  if (srcHost == NULL && ByteCount > 0)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r =
      check_range((uintptr_t)dstDevice, ByteCount, PROT_READ | PROT_WRITE);
  if (r == CUDA_SUCCESS && ByteCount > 0)
    memcpy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
  return r;
}

API CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice,
                                  size_t ByteCount) {
  if (dstHost == NULL && ByteCount > 0)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_range((uintptr_t)srcDevice, ByteCount, PROT_READ);
  if (r == CUDA_SUCCESS && ByteCount > 0)
    memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
  return r;
}

API CUresult CUDAAPI cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc,
                                size_t N) {
  CUresult r = check_range((uintptr_t)dstDevice, N, PROT_READ | PROT_WRITE);
  if (r == CUDA_SUCCESS && N > 0)
    memset((void *)(uintptr_t)dstDevice, uc, N);
  return r;
}

/* One side of a 2D copy: its first byte (X and Y applied) in *p, and, for
 * device memory, the rows' span checked mapped with prot in this thread's
 * context. Host and device are the only kinds the double knows. */
static CUresult copy2d_side(CUmemorytype type, const void *host,
                            CUdeviceptr dev, size_t x, size_t y, size_t pitch,
                            size_t width, size_t height, int prot,
                            uintptr_t *p) {
  size_t span;
  if (__builtin_mul_overflow(y + height - 1, pitch, &span) ||
      __builtin_add_overflow(span, x + width, &span))
    return CUDA_ERROR_INVALID_VALUE;
  switch (type) {
  case CU_MEMORYTYPE_HOST:
    if (host == NULL)
      return CUDA_ERROR_INVALID_VALUE;
    *p = (uintptr_t)host + y * pitch + x;
    return CUDA_SUCCESS;
  case CU_MEMORYTYPE_DEVICE:
    *p = (uintptr_t)dev + y * pitch + x;
    return check_range(*p, span - y * pitch - x, prot);
  default:
    return CUDA_ERROR_INVALID_VALUE;
  }
}

/* TDCUDA_MEMCPY2D_LOG=path: each cuMemcpy2D appends a line "width height"
 * there, so that tests can count the copies the library made. */
static void log_copy2d(size_t width, size_t height) {
  const char *path = getenv("TDCUDA_MEMCPY2D_LOG");
  if (path == NULL || path[0] == '\0')
    return;
  FILE *f = fopen(path, "ae");
  if (f == NULL)
    return;
  fprintf(f, "%zu %zu\n", width, height);
  fclose(f);
}

/* Height rows of WidthInBytes, each pitch apart on its side; as the driver,
 * a pitch below the width (with more than one row) is refused. Arrays are
 * not supported. */
API CUresult CUDAAPI cuMemcpy2D(const CUDA_MEMCPY2D *c) {
  if (c == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_range(0, 0, PROT_NONE); /* a context is current */
  if (r != CUDA_SUCCESS || c->WidthInBytes == 0 || c->Height == 0)
    return r;
  if (c->Height > 1 &&
      (c->srcPitch < c->WidthInBytes || c->dstPitch < c->WidthInBytes))
    return CUDA_ERROR_INVALID_VALUE;
  uintptr_t s, d;
  r = copy2d_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes,
                  c->srcY, c->srcPitch, c->WidthInBytes, c->Height, PROT_READ,
                  &s);
  if (r == CUDA_SUCCESS)
    r = copy2d_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes,
                    c->dstY, c->dstPitch, c->WidthInBytes, c->Height,
                    PROT_READ | PROT_WRITE, &d);
  if (r != CUDA_SUCCESS)
    return r;
  for (size_t i = 0; i < c->Height; i++)
    memcpy((void *)(d + i * c->dstPitch), (const void *)(s + i * c->srcPitch),
           c->WidthInBytes);
  log_copy2d(c->WidthInBytes, c->Height);
  return CUDA_SUCCESS;
}

/* ---- legacy allocations and their IPC handles ---- */

/* What a legacy IPC handle holds in its 64 bytes: enough for another
 * process to find the memfd (through /proc/<pid>/fd/<fd>) and to check that
 * it is the allocation named (the tag, also in the memfd's name). */
typedef struct {
  char magic[8]; /* "tdcudaIP" */
  int32_t pid;
  int32_t fd;
  uint64_t tag;
  uint64_t size;
  int32_t phys;
} ipc_handle;
_Static_assert(sizeof(ipc_handle) <= sizeof(CUipcMemHandle),
               "ipc_handle outgrows CUipcMemHandle");
#define IPC_MAGIC "tdcudaIP"

/* The legacy mapping at exactly p made by this process with kind, or NULL.
 * Called with mu held. */
static mapping *legacy_at(uintptr_t p, int kind) {
  mapping *m = map_at(p);
  return m != NULL && m->base == p && m->legacy == kind && m->pid == getpid()
             ? m
             : NULL;
}

/* Drops mapping m (munmap, its alloc's count). Called with mu held. */
static void legacy_drop(mapping *m) {
  alloc *a = m->a;
  munmap((void *)m->base, m->size);
  *m = maps[--nmaps];
  a->maps--;
  alloc_unref(a);
}

/* Maps a (a memfd of size bytes) read-write at a new address and records
 * it with kind. Returns the driver's result. Called with mu held. */
static CUresult legacy_map(alloc *a, int kind, CUdeviceptr *out) {
  if (grow((void **)&maps, &capmaps, nmaps, sizeof *maps) != 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
  if (p == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  maps[nmaps++] = (mapping){.base = (uintptr_t)p,
                            .size = a->size,
                            .a = a,
                            .prot = PROT_READ | PROT_WRITE,
                            .legacy = kind,
                            .pid = getpid()};
  a->maps++;
  *out = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
  if (dptr == NULL || bytesize == 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord;
  alloc *a = NULL;
  CUresult r = current(&ord);
  if (r != CUDA_SUCCESS)
    goto out;
  int phys = vis[ord];
  /* The driver rounds small sizes up too; the double counts what it maps. */
  size_t size = (bytesize + 4095) & ~(size_t)4095;
  if (size > mem_total - used[phys]) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  if ((a = calloc(1, sizeof *a)) == NULL) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  int rnd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (rnd < 0 || read(rnd, &a->tag, sizeof a->tag) != sizeof a->tag)
    a->tag = (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)a;
  if (rnd >= 0)
    close(rnd);
  char name[64];
  snprintf(name, sizeof name, MEMFD_PREFIX "%d.%016llx", phys,
           (unsigned long long)a->tag);
  a->fd = memfd_create(name, MFD_CLOEXEC);
  struct stat st;
  if (a->fd < 0 || ftruncate(a->fd, (off_t)size) != 0 ||
      fstat(a->fd, &st) != 0) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    if (a->fd >= 0)
      close(a->fd);
    free(a);
    goto out;
  }
  a->size = size;
  a->phys = phys;
  a->created = 1;
  a->st_dev = st.st_dev;
  a->st_ino = st.st_ino;
  used[phys] += size;
  if ((r = legacy_map(a, LEGACY_ALLOC, dptr)) != CUDA_SUCCESS)
    alloc_unref(a); /* no handle, no mapping: goes */
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS) {
    mapping *m = legacy_at((uintptr_t)dptr, LEGACY_ALLOC);
    if (m == NULL)
      r = CUDA_ERROR_INVALID_VALUE;
    else
      legacy_drop(m);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *pHandle,
                                       CUdeviceptr dptr) {
  if (pHandle == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS) {
    mapping *m = legacy_at((uintptr_t)dptr, LEGACY_ALLOC);
    if (m == NULL) {
      r = CUDA_ERROR_INVALID_VALUE; /* not the base of a cuMemAlloc */
    } else {
      ipc_handle h = {.pid = getpid(),
                      .fd = m->a->fd,
                      .tag = m->a->tag,
                      .size = m->a->size,
                      .phys = m->a->phys};
      memcpy(h.magic, IPC_MAGIC, 8);
      memset(pHandle, 0, sizeof *pHandle);
      memcpy(pHandle->reserved, &h, sizeof h);
    }
  }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle ipc,
                                        unsigned int Flags) {
  if (pdptr == NULL || Flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    return CUDA_ERROR_INVALID_VALUE;
  ipc_handle h;
  memcpy(&h, ipc.reserved, sizeof h);
  if (memcmp(h.magic, IPC_MAGIC, 8) != 0)
    return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&mu);
  int ord, fd = -1;
  alloc *a = NULL;
  CUresult r = current(&ord);
  if (r != CUDA_SUCCESS)
    goto out;
  /* The driver refuses a process's own handles. */
  if (h.pid == getpid()) {
    r = CUDA_ERROR_INVALID_CONTEXT;
    goto out;
  }
  /* The memory is opened on the device it lives on, which must be the
   * current context's (the double does not model peer access). */
  if (h.phys < 0 || h.phys >= nphys || vis[ord] != h.phys) {
    r = CUDA_ERROR_INVALID_DEVICE;
    goto out;
  }
  char path[64], link[128], want[96];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  snprintf(want, sizeof want, "/memfd:" MEMFD_PREFIX "%d.%016llx", h.phys,
           (unsigned long long)h.tag);
  if (n < 0 || (link[n] = '\0', strncmp(link, want, strlen(want)) != 0) ||
      (fd = open(path, O_RDWR | O_CLOEXEC)) < 0) {
    r = CUDA_ERROR_INVALID_HANDLE; /* its owner or its memory is gone */
    goto out;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != h.size) {
    r = CUDA_ERROR_INVALID_HANDLE;
    goto out;
  }
  /* Stricter than the driver, which counts a second open in the same
   * context and returns the same pointer: tensord opens once per process. */
  for (size_t i = 0; i < nmaps; i++)
    if (maps[i].legacy == LEGACY_OPEN && maps[i].pid == getpid() &&
        maps[i].a->st_dev == st.st_dev && maps[i].a->st_ino == st.st_ino) {
      r = CUDA_ERROR_ALREADY_MAPPED;
      goto out;
    }
  if ((a = calloc(1, sizeof *a)) == NULL) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  a->fd = fd;
  fd = -1;
  a->size = h.size;
  a->phys = h.phys;
  a->tag = h.tag;
  a->st_dev = st.st_dev;
  a->st_ino = st.st_ino;
  if ((r = legacy_map(a, LEGACY_OPEN, pdptr)) != CUDA_SUCCESS)
    alloc_unref(a);
out:
  if (fd >= 0)
    close(fd);
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS) {
    mapping *m = legacy_at((uintptr_t)dptr, LEGACY_OPEN);
    if (m == NULL)
      r = CUDA_ERROR_INVALID_VALUE;
    else
      legacy_drop(m);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- events ---- */

/* Work is synchronous here, so an event is complete once recorded: what
 * the double keeps is the handles' semantics. An interprocess event's
 * state lives in a one-page memfd that its IPC handle names, as a legacy
 * allocation's does. */
struct CUevent_st {
  unsigned flags;
  int fd;            /* CU_EVENT_INTERPROCESS: the memfd, else -1 */
  uint64_t tag;      /* in its IPC handle and the memfd's name */
  uint64_t *records; /* how often recorded (shared for IPC events) */
  int opened;        /* made by cuIpcOpenEventHandle */
  pid_t pid;         /* the process that made it */
  /* An opened event: where its exporter keeps it (pid, fd number), which
   * must still hold it whenever the event is used. */
  pid_t exporter;
  int exporter_fd;
};

#define EVENT_PREFIX "tdcuda-event."
static void event_check_exporter(const char *call, CUevent ev);
static void log_event_wait(CUstream stream, int sync);
static int stream_known(CUstream s);
#define IPC_EVENT_MAGIC "tdcudaEV"

static CUevent *events;
static size_t nevents, capevents;

/* Whether ev is a live event of this process. Called with mu held. */
static int event_live(CUevent ev) {
  for (size_t i = 0; i < nevents; i++)
    if (events[i] == ev)
      return ev->pid == getpid();
  return 0;
}

/* Makes an event over fd (>= 0: a shared page) and lists it. Returns the
 * driver's result. Called with mu held; fd is the event's on success. */
static CUresult event_make(unsigned flags, int fd, uint64_t tag, int opened,
                           CUevent *out) {
  if (grow((void **)&events, &capevents, nevents, sizeof *events) != 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  CUevent ev = calloc(1, sizeof *ev);
  if (ev == NULL)
    return CUDA_ERROR_OUT_OF_MEMORY;
  if (fd >= 0) {
    ev->records = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ev->records == MAP_FAILED) {
      free(ev);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  } else if ((ev->records = calloc(1, sizeof *ev->records)) == NULL) {
    free(ev);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  ev->flags = flags;
  ev->fd = fd;
  ev->tag = tag;
  ev->opened = opened;
  ev->pid = getpid();
  events[nevents++] = ev;
  *out = ev;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  if (phEvent == NULL ||
      Flags & ~(unsigned)(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING |
                          CU_EVENT_INTERPROCESS))
    return CUDA_ERROR_INVALID_VALUE;
  /* The driver's rule: an interprocess event cannot time. */
  if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int fd = -1;
  uint64_t tag = 0;
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && (Flags & CU_EVENT_INTERPROCESS)) {
    int rnd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (rnd < 0 || read(rnd, &tag, sizeof tag) != sizeof tag)
      tag = (uint64_t)getpid() << 32 ^ (uint64_t)nevents;
    if (rnd >= 0)
      close(rnd);
    char name[48];
    snprintf(name, sizeof name, EVENT_PREFIX "%016llx",
             (unsigned long long)tag);
    fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, 4096) != 0)
      r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r == CUDA_SUCCESS)
    r = event_make(Flags, fd, tag, 0, phEvent);
  if (r != CUDA_SUCCESS && fd >= 0)
    close(fd);
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
  (void)hStream; /* every stream's work is done already */
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && !event_live(hEvent))
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS)
    __atomic_add_fetch(hEvent->records, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  pthread_mutex_lock(&mu);
  CUresult r = event_live(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    event_check_exporter("cuEventSynchronize", hEvent);
    log_event_wait(NULL, 1);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_ERROR_INVALID_HANDLE;
  for (size_t i = 0; i < nevents; i++)
    if (events[i] == hEvent && hEvent->pid == getpid()) {
      events[i] = events[--nevents];
      if (hEvent->fd >= 0) {
        munmap(hEvent->records, 4096);
        close(hEvent->fd);
      } else {
        free(hEvent->records);
      }
      free(hEvent);
      r = CUDA_SUCCESS;
      break;
    }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent,
                                       unsigned int Flags) {
  if (Flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && (!stream_known(hStream) || !event_live(hEvent)))
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    event_check_exporter("cuStreamWaitEvent", hEvent);
    log_event_wait(hStream, 0);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

typedef struct {
  char magic[8]; /* "tdcudaEV" */
  int32_t pid;
  int32_t fd;
  uint64_t tag;
  uint64_t check; /* ipc_event_check of the above: tells forged from gone */
} ipc_event;
_Static_assert(sizeof(ipc_event) <= sizeof(CUipcEventHandle),
               "ipc_event outgrows CUipcEventHandle");

/* A hash of h's pid, fd and tag, so that a handle the double made and a
 * forged or damaged one differ: only the first may name an event whose
 * exporter destroyed it or died (undefined on the driver, below). */
static uint64_t ipc_event_check(const ipc_event *h) {
  uint64_t x =
      h->tag ^ ((uint64_t)(uint32_t)h->pid << 32 | (uint64_t)(uint32_t)h->fd);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb3fe1a85ec53ull;
  return x ^ x >> 33;
}

/* Whether process pid still holds, as fd, the memfd of the event tag: true
 * while its exporter has neither destroyed it nor exited. */
static int exporter_holds(pid_t pid, int fd, uint64_t tag) {
  char path[64], link[128], want[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
  snprintf(want, sizeof want, "/memfd:" EVENT_PREFIX "%016llx",
           (unsigned long long)tag);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0)
    return 0;
  link[n] = '\0';
  return strncmp(link, want, strlen(want)) == 0;
}

/* What a real driver does with an imported event whose exporter destroyed
 * it or exited is undefined (cuIpcOpenEventHandle's documentation): a wait
 * may hang, or read memory since reused. The double stops the program
 * there, loudly, so that no test passes on what a GPU would not do. */
static int exited(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH)
    return 1;
  char path[64], stat[256] = "";
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "re");
  if (f != NULL) {
    if (fgets(stat, sizeof stat, f) == NULL)
      stat[0] = '\0';
    fclose(f);
  }
  const char *state = strrchr(stat, ')');
  return state != NULL && state[1] == ' ' && state[2] == 'Z'; /* a zombie */
}

static void event_gone(const char *call, pid_t pid, uint64_t tag) {
  int gone = exited(pid);
  fprintf(stderr,
          "tdcuda double: %s: interprocess event %016llx of process %d, "
          "which %s: undefined behaviour on a real driver\n",
          call, (unsigned long long)tag, (int)pid,
          gone ? "has exited" : "destroyed it (or is exiting)");
  abort();
}

/* TDCUDA_EVENT_LOG=path (read at each call): each successful
 * cuEventSynchronize appends "sync", each cuStreamWaitEvent "wait 0x<the
 * stream>", so that tests see who waited on what (the double's events make
 * no one wait). */
static void log_event_wait(CUstream stream, int sync) {
  const char *path = getenv("TDCUDA_EVENT_LOG");
  if (path == NULL || path[0] == '\0')
    return;
  FILE *f = fopen(path, "ae");
  if (f == NULL)
    return;
  if (sync)
    fprintf(f, "sync\n");
  else
    fprintf(f, "wait 0x%llx\n", (unsigned long long)(uintptr_t)stream);
  fclose(f);
}

/* Stops the program if ev is an opened event whose exporter no longer
 * holds it. Called with mu held, on a live event. */
static void event_check_exporter(const char *call, CUevent ev) {
  if (ev->opened && !exporter_holds(ev->exporter, ev->exporter_fd, ev->tag))
    event_gone(call, ev->exporter, ev->tag);
}

API CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle *pHandle,
                                         CUevent event) {
  if (pHandle == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_SUCCESS;
  if (!event_live(event))
    r = CUDA_ERROR_INVALID_HANDLE;
  else if (!(event->flags & CU_EVENT_INTERPROCESS) || event->opened)
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    ipc_event h = {.pid = getpid(), .fd = event->fd, .tag = event->tag};
    memcpy(h.magic, IPC_EVENT_MAGIC, 8);
    h.check = ipc_event_check(&h);
    memset(pHandle, 0, sizeof *pHandle);
    memcpy(pHandle->reserved, &h, sizeof h);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *phEvent,
                                          CUipcEventHandle handle_) {
  if (phEvent == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  ipc_event h;
  memcpy(&h, handle_.reserved, sizeof h);
  if (memcmp(h.magic, IPC_EVENT_MAGIC, 8) != 0 ||
      h.check != ipc_event_check(&h))
    return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&mu);
  int fd = -1;
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  if (h.pid == getpid()) { /* as for memory: not one's own */
    r = CUDA_ERROR_INVALID_CONTEXT;
    goto out;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
  /* A handle the double made, whose event is gone: see event_gone. */
  if (!exporter_holds(h.pid, h.fd, h.tag) ||
      (fd = open(path, O_RDWR | O_CLOEXEC)) < 0 ||
      !exporter_holds(h.pid, h.fd, h.tag))
    event_gone("cuIpcOpenEventHandle", h.pid, h.tag);
  r = event_make(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, fd, h.tag, 1,
                 phEvent);
  if (r == CUDA_SUCCESS) {
    (*phEvent)->exporter = h.pid;
    (*phEvent)->exporter_fd = h.fd;
    fd = -1;
  }
out:
  if (fd >= 0)
    close(fd);
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- pinned host memory, streams, asynchronous copies ---- */

/* Page-locked host memory (cuMemHostAlloc): an anonymous mapping the double
 * lists, so that an asynchronous copy can insist on it. */
typedef struct {
  uintptr_t base;
  size_t size;
} pinned;

static pinned *pins;
static size_t npins, cappins;

/* One copy queued on a stream: run at its synchronisation, not before. */
typedef struct {
  uintptr_t dst;
  const void *src;
  size_t n;
} queued;

struct CUstream_st {
  unsigned flags;
  pid_t pid;
  queued *q;
  size_t nq, capq;
  CUresult sticky; /* a queued copy that found its memory gone */
};

static CUstream *streams;
static size_t nstreams, capstreams;
static struct CUstream_st null_stream; /* the legacy default stream, 0 */

/* Appends the size of each cuMemHostAlloc to $TDCUDA_HOSTALLOC_LOG (read
 * at each call), so that a test can see how much a program pinned. */
static void log_hostalloc(size_t n) {
  const char *path = getenv("TDCUDA_HOSTALLOC_LOG");
  if (path == NULL || path[0] == '\0')
    return;
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0)
    return;
  char line[32];
  int len = snprintf(line, sizeof line, "%zu\n", n);
  if (write(fd, line, (size_t)len) != len) {
    /* a test's log: nothing to do */
  }
  close(fd);
}

API CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize,
                                    unsigned int Flags) {
  if (pp == NULL || bytesize == 0 ||
      Flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                          CU_MEMHOSTALLOC_WRITECOMBINED))
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  void *p = MAP_FAILED;
  if (r == CUDA_SUCCESS &&
      grow((void **)&pins, &cappins, npins, sizeof *pins) != 0)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r == CUDA_SUCCESS) {
    pins[npins].base = (uintptr_t)p;
    pins[npins++].size = bytesize;
    *pp = p;
  }
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS)
    log_hostalloc(bytesize);
  return r;
}

/* Whether [p, p + n) lies in one pinned allocation. Called with mu held. */
static int is_pinned(const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < npins; i++)
    if (a >= pins[i].base && a - pins[i].base <= pins[i].size &&
        n <= pins[i].size - (a - pins[i].base))
      return 1;
  return 0;
}

/* Whether a queued copy reads [base, base + size). Called with mu held. */
static int queued_from(uintptr_t base, size_t size) {
  for (size_t i = 0; i <= nstreams; i++) {
    CUstream s = i < nstreams ? streams[i] : &null_stream;
    for (size_t j = 0; j < s->nq; j++)
      if ((uintptr_t)s->q[j].src - base < size)
        return 1;
  }
  return 0;
}

API CUresult CUDAAPI cuMemFreeHost(void *p) {
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < npins; i++)
    if (pins[i].base == (uintptr_t)p) {
      /* Stricter than the driver (which waits): freeing staging memory
       * that a queued copy still reads is a program's bug. */
      if (queued_from(pins[i].base, pins[i].size))
        break;
      munmap(p, pins[i].size);
      pins[i] = pins[--npins];
      r = CUDA_SUCCESS;
      break;
    }
  pthread_mutex_unlock(&mu);
  return r;
}

/* The stream s names, or NULL if it is no live stream of this process
 * (0 is the default stream). Called with mu held. */
static CUstream stream_of(CUstream s) {
  if (s == NULL)
    return &null_stream;
  for (size_t i = 0; i < nstreams; i++)
    if (streams[i] == s)
      return s->pid == getpid() ? s : NULL;
  return NULL;
}

/* Whether s names a stream the driver would take in this process: 0, the
 * special handles CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, or a live
 * stream of its own. Called with mu held. */
static int stream_known(CUstream s) {
  return s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD ||
         stream_of(s) != NULL;
}

/* Runs s's queued copies in order. Returns the first failure, kept. Called
 * with mu held. */
static CUresult drain(CUstream s) {
  for (size_t j = 0; j < s->nq; j++) {
    queued *c = &s->q[j];
    if (!accessible(c->dst, c->n, PROT_READ | PROT_WRITE))
      s->sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    else if (s->sticky == CUDA_SUCCESS)
      memcpy((void *)c->dst, c->src, c->n);
  }
  s->nq = 0;
  return s->sticky;
}

/* Drains every stream of this process. Called with mu held. */
static CUresult drain_all(void) {
  CUresult r = drain(&null_stream);
  for (size_t i = 0; i < nstreams; i++) {
    CUresult e = streams[i]->pid == getpid() ? drain(streams[i]) : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
      r = e;
  }
  return r;
}

API CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  if (phStream == NULL || Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  CUstream s = NULL;
  if (r == CUDA_SUCCESS &&
      (grow((void **)&streams, &capstreams, nstreams, sizeof *streams) != 0 ||
       (s = calloc(1, sizeof *s)) == NULL))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    s->flags = Flags;
    s->pid = getpid();
    streams[nstreams++] = s;
    *phStream = s;
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* The driver completes a destroyed stream's work before it goes. */
API CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && (hStream == NULL || stream_of(hStream) == NULL))
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    drain(hStream);
    for (size_t i = 0; i < nstreams; i++)
      if (streams[i] == hStream) {
        streams[i] = streams[--nstreams];
        break;
      }
    free(hStream->q);
    free(hStream);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && s == NULL)
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS)
    r = drain(s);
  pthread_mutex_unlock(&mu);
  return r;
}

/* Queued, not copied: the bytes reach the device at the stream's
 * synchronisation (or its destruction), so a program that reuses the
 * source before it synchronised copies the wrong bytes here. The source
 * must be pinned (cuMemHostAlloc): stricter than the driver, which copies
 * pageable memory synchronously. */
API CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice,
                                       const void *srcHost, size_t ByteCount,
                                       CUstream hStream) {
  if (srcHost == NULL && ByteCount > 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && s == NULL)
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS &&
      (!accessible((uintptr_t)dstDevice, ByteCount, PROT_READ | PROT_WRITE) ||
       !is_pinned(srcHost, ByteCount)))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && ByteCount > 0) {
    if (grow((void **)&s->q, &s->capq, s->nq, sizeof *s->q) != 0)
      r = CUDA_ERROR_OUT_OF_MEMORY;
    else
      s->q[s->nq++] = (queued){(uintptr_t)dstDevice, srcHost, ByteCount};
  }
  pthread_mutex_unlock(&mu);
  return r;
}

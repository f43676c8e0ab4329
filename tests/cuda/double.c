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

#include "kcopy.h" /* the copy kernel's parameters, which it emulates */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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
  /* A VMM mapping's access per device (ordinal), as cuMemSetAccess set it:
   * prot is their union, since device pointers are this process's
   * addresses whichever device uses them. */
  unsigned char access[MAX_DEVICES];
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
  int excl; /* EXCLUSIVE_PROCESS: the socket that claims the device */
  /* A sticky error (a fault in work run on it, or tdcudaDoubleFault):
   * every call that needs the context returns it until the context is
   * destroyed (its last retain released). */
  CUresult sticky;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* The driver allows a child of fork() nothing once its parent has
 * initialised CUDA: every call in the child, cuInit included, fails with
 * CUDA_ERROR_NOT_INITIALIZED, and the contexts and mappings it inherited
 * are unusable. The double does the same: init_pid is the process whose
 * cuInit succeeded, and in any other process that inherited it every
 * entry point but cuGetErrorName and cuGetErrorString refuses, before it
 * looks at any state (mu may have been held by another of the parent's
 * threads at the fork). A child forked before the parent's first cuInit
 * inherits init_pid 0: a fresh process, which may cuInit. */
static _Atomic pid_t init_pid;

static void call_log(const char *call);

static int forked_child(void) {
  pid_t p = atomic_load(&init_pid);
  return p != 0 && p != getpid();
}

/* Logs the refused call (TDCUDA_CALL_LOG) and returns what the driver
 * does. */
static CUresult refused(const char *call) {
  char line[96];
  snprintf(line, sizeof line, "%s refused", call);
  call_log(line);
  return CUDA_ERROR_NOT_INITIALIZED;
}

#define REFUSE_IN_FORKED_CHILD()                                               \
  do {                                                                         \
    if (forked_child())                                                        \
      return refused(__func__);                                                \
  } while (0)

/* A child forked before cuInit while another thread held mu (a cuInit of
 * its own, say) would find it locked forever: it starts with mu free. */
static void atfork_child(void) {
  pthread_mutex_init(&mu, NULL);
}

__attribute__((constructor)) static void register_atfork(void) {
  pthread_atfork(NULL, NULL, atfork_child);
}
static int initialized;
static int nphys;                 /* TDCUDA_DEVICES */
static size_t mem_total;          /* TDCUDA_MEM, per device */
static int no_posix_fd;           /* TDCUDA_NO_POSIX_FD=1 */
static int no_vmm;                /* TDCUDA_NO_VMM=1 */
static unsigned long not_ready;   /* TDCUDA_INIT_NOT_READY: cuInits to fail */
static int mig;                   /* TDCUDA_MIG=1 */
static int compute_mode;          /* TDCUDA_COMPUTE_MODE, a CUcomputemode */
static int sync_all;              /* TDCUDA_SYNC=1: no asynchronous work */
static unsigned long fault_after; /* TDCUDA_FAULT_AFTER: work runs to fault */
static int no_module;             /* TDCUDA_NO_MODULE=1 */
static int no_peer;               /* TDCUDA_NO_PEER=1 */
static int nvis;                  /* devices this process sees */
static int vis[MAX_DEVICES];      /* ordinal -> physical device */
static size_t used[MAX_DEVICES];  /* bytes created here, per physical device */
static char state_dir[PATH_MAX];  /* TDCUDA_STATE_DIR: memory device-wide */
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
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
     "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
     "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking "
     "stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
     "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another "
     "thread"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED",
     "operation not permitted"},
    {CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA_ERROR_DEVICE_UNAVAILABLE",
     "CUDA-capable device(s) is/are busy or unavailable"},
    {CUDA_ERROR_SYSTEM_NOT_READY, "CUDA_ERROR_SYSTEM_NOT_READY",
     "system not yet initialized"},
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

/* A fresh allocation's bytes are unspecified on the driver (memory another
 * process freed, or anything): the double writes JUNK over its first and
 * last 4 KiB, so that a program that reads memory it never wrote (a create
 * that skipped its zeroing, or read before the zeroing ran) sees non-zero
 * bytes there. Only those pages, to keep the memfd's memory untouched. */
#define JUNK 0xdb

static void junk_fill(int fd, size_t size) {
  uint8_t page[4096];
  memset(page, JUNK, sizeof page);
  size_t n = size < sizeof page ? size : sizeof page;
  if (pwrite(fd, page, n, 0) != (ssize_t)n ||
      (size > n && pwrite(fd, page, n, (off_t)(size - n)) != (ssize_t)n)) {
    /* a test double's best effort: zeros stay */
  }
}

/* ---- memory shared by every process on a device ----
 *
 * A GPU's memory is the device's, whoever allocates it: a process's
 * cuMemCreate fails CUDA_ERROR_OUT_OF_MEMORY when others filled the GPU,
 * and cuMemGetInfo counts everyone's allocations. With TDCUDA_STATE_DIR
 * the double keeps, per physical device, a file per process in that
 * directory (mem.<device>.<pid>) holding the bytes the process created
 * there; a device's use is the sum over the processes alive (a dead
 * process's file is removed by the next reader, as the driver frees what a
 * process allocated when it exits). Creates check and charge under an
 * flock on mem.<device>.lock. Without it, each process counts only its
 * own. Called with mu held. */

static int ledger_lock(int phys) {
  if (state_dir[0] == '\0')
    return -1;
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/mem.%d.lock", state_dir, phys);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd >= 0 && flock(fd, LOCK_EX) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

static void ledger_unlock(int fd) {
  if (fd >= 0)
    close(fd); /* drops the flock */
}

/* Whether pid is a process that has not exited: an exited one that its
 * parent has not reaped yet (a zombie) holds no device memory any more. */
static int alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH)
    return 0;
  char path[32], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno != ENOENT;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0)
    return 1;
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the state follows the name */
  return p == NULL || p[1] != ' ' || (p[2] != 'Z' && p[2] != 'X');
}

/* Bytes the other live processes created on phys. */
static size_t others_used(int phys) {
  if (state_dir[0] == '\0')
    return 0;
  DIR *dir = opendir(state_dir);
  if (dir == NULL)
    return 0;
  size_t sum = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    int dev, pid, end = 0;
    if (sscanf(e->d_name, "mem.%d.%d%n", &dev, &pid, &end) != 2 ||
        e->d_name[end] != '\0' || dev != phys || pid == (int)getpid())
      continue;
    char path[PATH_MAX + 300];
    snprintf(path, sizeof path, "%s/%s", state_dir, e->d_name);
    if (!alive((pid_t)pid)) {
      unlink(path); /* gone: the driver freed its memory */
      continue;
    }
    FILE *f = fopen(path, "re");
    unsigned long long n = 0;
    if (f != NULL) {
      if (fscanf(f, "%llu", &n) != 1)
        n = 0;
      fclose(f);
    }
    sum += (size_t)n;
  }
  closedir(dir);
  return sum;
}

/* Records this process's bytes on phys (written aside and renamed, so a
 * reader sees the old figure or the new one). */
static void ledger_write(int phys) {
  if (state_dir[0] == '\0')
    return;
  char path[PATH_MAX + 32], tmp[PATH_MAX + 40];
  snprintf(path, sizeof path, "%s/mem.%d.%d", state_dir, phys, (int)getpid());
  if (used[phys] == 0) {
    unlink(path);
    return;
  }
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "we");
  if (f == NULL)
    return;
  fprintf(f, "%zu\n", used[phys]);
  if (fclose(f) == 0)
    rename(tmp, path);
  else
    unlink(tmp);
}

/* The bytes free on phys for a new allocation. */
static size_t device_free(int phys) {
  size_t u = used[phys] + others_used(phys);
  return u < mem_total ? mem_total - u : 0;
}

static void alloc_unref(alloc *a) {
  if (a->handles > 0 || a->maps > 0)
    return;
  close(a->fd);
  if (a->created) {
    used[a->phys] -= a->size;
    ledger_write(a->phys);
  }
  free(a);
}

/* ---- initialisation and devices ---- */

/* A device's UUID as cuDeviceGetUuid_v2 gives it: with TDCUDA_MIG, the MIG
 * instance's own, else the GPU's (gpu_uuid_of, which the first version of
 * cuDeviceGetUuid always gives). */
static void gpu_uuid_of(int phys, unsigned char out[16]) {
  memcpy(out, "tdcudadouble", 12);
  out[12] = (unsigned char)(phys >> 24);
  out[13] = (unsigned char)(phys >> 16);
  out[14] = (unsigned char)(phys >> 8);
  out[15] = (unsigned char)phys;
}

static void uuid_of(int phys, unsigned char out[16]) {
  gpu_uuid_of(phys, out);
  if (mig)
    memcpy(out, "tdcudamiginst", 12);
}

/* As nvidia-smi -L names the device: "MIG-..." for an instance. */
static void uuid_str(int phys, char out[41]) {
  unsigned char u[16];
  uuid_of(phys, u);
  snprintf(out, 41,
           "%s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           mig ? "MIG" : "GPU", u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7],
           u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
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
    if (strncmp(tok, "GPU-", 4) == 0 || strncmp(tok, "MIG-", 4) == 0) {
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
  REFUSE_IN_FORKED_CHILD();
  if (Flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_SUCCESS;
  if (initialized)
    goto out;
  /* The driver's daemons still starting (nvidia-persistenced, the fabric
   * manager): the first TDCUDA_INIT_NOT_READY calls fail, as a real
   * cuInit does until they are up. Counted per process. */
  static int counted;
  const char *s = getenv("TDCUDA_INIT_NOT_READY");
  if (!counted) {
    counted = 1;
    not_ready = s != NULL ? strtoul(s, NULL, 10) : 0;
  }
  if (not_ready > 0) {
    not_ready--;
    r = CUDA_ERROR_SYSTEM_NOT_READY;
    goto out;
  }
  s = getenv("TDCUDA_DEVICES");
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
  s = getenv("TDCUDA_NO_VMM");
  no_vmm = s != NULL && strcmp(s, "1") == 0;
  no_posix_fd |= no_vmm; /* POSIX-fd handles are VMM handles */
  s = getenv("TDCUDA_COMPUTE_MODE");
  compute_mode = CU_COMPUTEMODE_DEFAULT;
  if (s != NULL && strcmp(s, "exclusive_process") == 0)
    compute_mode = CU_COMPUTEMODE_EXCLUSIVE_PROCESS;
  else if (s != NULL && strcmp(s, "prohibited") == 0)
    compute_mode = CU_COMPUTEMODE_PROHIBITED;
  else if (s != NULL && s[0] != '\0' && strcmp(s, "default") != 0) {
    fprintf(stderr,
            "tdcuda double: TDCUDA_COMPUTE_MODE=%s is not default, "
            "exclusive_process or prohibited\n",
            s);
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  s = getenv("TDCUDA_STATE_DIR");
  snprintf(state_dir, sizeof state_dir, "%s", s != NULL ? s : "");
  s = getenv("TDCUDA_SYNC");
  sync_all = s != NULL && strcmp(s, "1") == 0;
  s = getenv("TDCUDA_FAULT_AFTER");
  fault_after = s != NULL ? strtoul(s, NULL, 10) : 0;
  s = getenv("TDCUDA_NO_MODULE");
  no_module = s != NULL && strcmp(s, "1") == 0;
  s = getenv("TDCUDA_NO_PEER");
  no_peer = s != NULL && strcmp(s, "1") == 0;
  s = getenv("TDCUDA_MIG");
  mig = s != NULL && strcmp(s, "1") == 0;
  parse_visible();
  /* CUDA enumerates one MIG instance per process: the first of
   * CUDA_VISIBLE_DEVICES. */
  if (mig && nvis > 1)
    nvis = 1;
  if (nvis == 0) {
    r = CUDA_ERROR_NO_DEVICE;
    goto out;
  }
  for (int i = 0; i < nvis; i++)
    ctxs[i] = (struct CUctx_st){.ordinal = i, .refs = 0, .excl = -1};
  initialized = 1;
  atomic_store(&init_pid, getpid());
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
  REFUSE_IN_FORKED_CHILD();
  if (!initialized)
    return CUDA_ERROR_NOT_INITIALIZED;
  if (count == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  *count = nvis;
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (uuid == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  uuid_of(vis[dev], (unsigned char *)uuid->bytes);
  return CUDA_SUCCESS;
}

/* The first version, which cuda.h now maps to _v2: on a MIG instance, the
 * UUID of the GPU it is carved from. */
#undef cuDeviceGetUuid
API CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
API CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  REFUSE_IN_FORKED_CHILD();
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (uuid == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  gpu_uuid_of(vis[dev], (unsigned char *)uuid->bytes);
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (pi == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {
  case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    *pi = !no_vmm;
    break;
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
  case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE:
    *pi = compute_mode;
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

/* Appends "<pid> <call>" to $TDCUDA_CALL_LOG, if set (read at each call),
 * for each cuMemCreate, cuMemRelease, cuMemImportFromShareableHandle and
 * cuMemUnmap that succeeds, and "<pid> <call> refused" for every call
 * refused in a forked child (see init_pid): tests count what a process
 * asked of the driver. */
static void call_log(const char *call) {
  const char *path = getenv("TDCUDA_CALL_LOG");
  if (path == NULL || path[0] == '\0')
    return;
  FILE *f = fopen(path, "a");
  if (f == NULL)
    return;
  fprintf(f, "%d %s\n", (int)getpid(), call);
  fclose(f);
}

/* Appends "<pid> <what> <physical device>" to $TDCUDA_CTX_LOG, if set
 * (read at each call): tests watch when a process makes and destroys a
 * primary context. */
static void ctx_log(const char *what, int dev) {
  const char *path = getenv("TDCUDA_CTX_LOG");
  if (path == NULL || path[0] == '\0')
    return;
  FILE *f = fopen(path, "a");
  if (f == NULL)
    return;
  fprintf(f, "%d %s %d\n", (int)getpid(), what, vis[dev]);
  fclose(f);
}

/* The first retain makes the primary context. In PROHIBITED compute mode
 * no process may; in EXCLUSIVE_PROCESS one process at a time, which the
 * double enforces across processes with an abstract-namespace socket per
 * uid and physical device (bound while the context lives, released by the
 * kernel if the process dies). Called with mu held. */
static CUresult ctx_make(CUdevice dev) {
  if (compute_mode == CU_COMPUTEMODE_PROHIBITED)
    return CUDA_ERROR_DEVICE_UNAVAILABLE;
  if (compute_mode == CU_COMPUTEMODE_EXCLUSIVE_PROCESS) {
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return CUDA_ERROR_OPERATING_SYSTEM;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int n =
        snprintf(a.sun_path + 1, sizeof a.sun_path - 1,
                 "tdcuda-double.exclusive.%u.%d", (unsigned)getuid(), vis[dev]);
    if (bind(fd, (struct sockaddr *)&a,
             (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 +
                         (size_t)n)) != 0) {
      close(fd);
      return CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    ctxs[dev].excl = fd;
  }
  ctx_log("create", dev);
  return CUDA_SUCCESS;
}

/* The last release destroys it. Called with mu held. */
static void streams_drop(CUdevice dev);

static void ctx_destroy(CUdevice dev) {
  ctxs[dev].sticky = CUDA_SUCCESS; /* the next retain makes a new one */
  streams_drop(dev);
  if (ctxs[dev].excl >= 0) {
    close(ctxs[dev].excl);
    ctxs[dev].excl = -1;
  }
  ctx_log("destroy", dev);
}

API CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  REFUSE_IN_FORKED_CHILD();
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  if (pctx == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  if (ctxs[dev].refs == 0 && (r = ctx_make(dev)) != CUDA_SUCCESS) {
    pthread_mutex_unlock(&mu);
    return r;
  }
  ctxs[dev].refs++;
  *pctx = &ctxs[dev];
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

API CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  REFUSE_IN_FORKED_CHILD();
  CUresult r = check_device(dev);
  if (r != CUDA_SUCCESS)
    return r;
  pthread_mutex_lock(&mu);
  if (ctxs[dev].refs == 0)
    r = CUDA_ERROR_INVALID_CONTEXT;
  else if (--ctxs[dev].refs == 0)
    ctx_destroy(dev);
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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
  if (c->sticky != CUDA_SUCCESS)
    return c->sticky;
  if (ordinal != NULL)
    *ordinal = c->ordinal;
  return CUDA_SUCCESS;
}

static CUresult drain_all(void);

static CUresult current_checked(int what, int *ordinal);
#define CHECK_UNSAFE 2
#define CHECK_CONTEXT 4

/* Runs every stream's queued work (below): the context's work is done. Not
 * while a stream of the context captures. */
API CUresult CUDAAPI cuCtxSynchronize(void) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  CUresult r = current_checked(CHECK_CONTEXT, NULL);
  if (r == CUDA_SUCCESS)
    r = drain_all();
  pthread_mutex_unlock(&mu);
  return r;
}

/* Not the driver's: a test's stand-in for a kernel of its own that writes
 * out of bounds. The current context takes CUDA_ERROR_ILLEGAL_ADDRESS, a
 * sticky error: every later call that needs it fails so, until its last
 * retain is released. Exported for tests, which find it with dlsym. */
API CUresult tdcudaDoubleFault(void);
API CUresult tdcudaDoubleFault(void) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  if (r == CUDA_SUCCESS)
    ctxs[ord].sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemGetInfo(size_t *free_, size_t *total) {
  REFUSE_IN_FORKED_CHILD();
  if (free_ == NULL || total == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  if (r == CUDA_SUCCESS) {
    *total = mem_total;
    *free_ = device_free(vis[ord]);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- VMM allocations ---- */

static CUresult check_prop(const CUmemAllocationProp *prop) {
  if (no_vmm) /* a device without VMM: none of the cuMem* VMM calls work */
    return CUDA_ERROR_NOT_SUPPORTED;
  if (prop == NULL || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  return check_device(prop->location.id);
}

API CUresult CUDAAPI cuMemGetAllocationGranularity(
    size_t *granularity, const CUmemAllocationProp *prop,
    CUmemAllocationGranularity_flags option) {
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
  if (handle_ == NULL || flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  alloc *a = NULL;
  int lock = -1;
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
  lock = ledger_lock(phys);
  if (size > device_free(phys)) {
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
  junk_fill(a->fd, size);
  if ((r = new_handle(a, handle_)) != CUDA_SUCCESS) {
    close(a->fd);
    free(a);
    goto out;
  }
  used[phys] += size;
  ledger_write(phys);
  call_log("cuMemCreate");
out:
  ledger_unlock(lock);
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle_) {
  REFUSE_IN_FORKED_CHILD();
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
  call_log("cuMemRelease");
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemExportToShareableHandle(
    void *shareableHandle, CUmemGenericAllocationHandle handle_,
    CUmemAllocationHandleType handleType, unsigned long long flags) {
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
  if (handle_ == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_NOT_SUPPORTED;
  int fd = (int)(intptr_t)osHandle;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  if (no_vmm) {
    r = CUDA_ERROR_NOT_SUPPORTED;
    goto out;
  }
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
  else
    call_log("cuMemImportFromShareableHandle");
out:
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- address ranges and mappings ---- */

API CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size,
                                         size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) {
  REFUSE_IN_FORKED_CHILD();
  if (ptr == NULL || flags != 0 || size == 0 || size % GRANULARITY != 0 ||
      (alignment & (alignment - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  /* The driver documents no alignment for 0 ("default"): the double gives
   * a range aligned to 64 KiB and never to the granularity, so a caller
   * that maps into it without asking for the granularity fails cuMemMap
   * here, as it may on a real GPU. */
  size_t skew = 0;
  if (alignment == 0) {
    alignment = GRANULARITY;
    skew = (size_t)64 << 10;
  } else if (alignment < GRANULARITY) {
    alignment = GRANULARITY;
  }
  if (size > SIZE_MAX - alignment - skew)
    return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  if (no_vmm) {
    r = CUDA_ERROR_NOT_SUPPORTED;
    goto out;
  }
  if (grow((void **)&resvs, &capresvs, nresvs, sizeof *resvs) != 0) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  /* addr is a hint, as for the driver: ignored here. */
  size_t span = size + alignment + skew;
  char *p = mmap(NULL, span, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  uintptr_t base =
      (((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1)) + skew;
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
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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
  call_log("cuMemUnmap");
out:
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size,
                                    const CUmemAccessDesc *desc, size_t count) {
  REFUSE_IN_FORKED_CHILD();
  uintptr_t p = (uintptr_t)ptr;
  if (desc == NULL || count == 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r != CUDA_SUCCESS)
    goto out;
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      r = CUDA_ERROR_INVALID_VALUE;
      goto out;
    }
    if ((r = check_device(desc[i].location.id)) != CUDA_SUCCESS)
      goto out;
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
      r = CUDA_ERROR_INVALID_VALUE;
      goto out;
    }
  }
  if (!whole_mappings(p, size)) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  /* The devices named get the access given; the others keep theirs. */
  for (uintptr_t q = p; q < p + size;) {
    mapping *m = map_at(q);
    for (size_t i = 0; i < count; i++)
      m->access[desc[i].location.id] = (unsigned char)desc[i].flags;
    int prot = PROT_NONE;
    for (int d = 0; d < MAX_DEVICES; d++)
      prot |= m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                  ? PROT_READ | PROT_WRITE
              : m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ
                                                              : PROT_NONE;
    if (mprotect((void *)m->base, m->size, prot) != 0) {
      r = CUDA_ERROR_OPERATING_SYSTEM;
      goto out;
    }
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

/* The copies and memsets (cuMemcpyHtoD, ...) are with the streams below:
 * the driver runs most of them asynchronously. */

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
  REFUSE_IN_FORKED_CHILD();
  if (dptr == NULL || bytesize == 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord, lock = -1;
  alloc *a = NULL;
  CUresult r = current_checked(CHECK_UNSAFE, &ord);
  if (r != CUDA_SUCCESS)
    goto out;
  int phys = vis[ord];
  /* The driver rounds small sizes up too; the double counts what it maps. */
  size_t size = (bytesize + 4095) & ~(size_t)4095;
  lock = ledger_lock(phys);
  if (size > device_free(phys)) {
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
  junk_fill(a->fd, size);
  used[phys] += size;
  ledger_write(phys);
  if ((r = legacy_map(a, LEGACY_ALLOC, dptr)) != CUDA_SUCCESS)
    alloc_unref(a); /* no handle, no mapping: goes */
out:
  ledger_unlock(lock);
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  CUresult r = current_checked(CHECK_UNSAFE, NULL);
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
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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

static void event_recorded(CUevent ev, CUstream s);
static CUresult event_wait(CUevent ev);

API CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && !event_live(hEvent))
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS)
    __atomic_add_fetch(hEvent->records, 1, __ATOMIC_SEQ_CST);
  if (r == CUDA_SUCCESS)
    event_recorded(hEvent, hStream); /* streams' queued work: below */
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  CUresult r = event_live(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    event_check_exporter("cuEventSynchronize", hEvent);
    log_event_wait(NULL, 1);
    r = event_wait(hEvent);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

API CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
  if (Flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  if (r == CUDA_SUCCESS && (!stream_known(hStream) || !event_live(hEvent)))
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    event_check_exporter("cuStreamWaitEvent", hEvent);
    log_event_wait(hStream, 0);
    /* it waits here, on the host: looser than the driver */
    r = event_wait(hEvent);
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
  REFUSE_IN_FORKED_CHILD();
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
  REFUSE_IN_FORKED_CHILD();
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

/* Work queued on a stream: a copy or a memset of rows (one row for the 1D
 * calls), run at a synchronisation that covers its stream, not before. */
typedef struct {
  uint64_t seq; /* issue order across streams */
  int set;      /* a memset of value, else a copy */
  unsigned char value;
  int dst_host; /* the destination is (pinned) host memory */
  int src_dev;  /* the source is device memory, read when run */
  uintptr_t dst;
  size_t dpitch;
  const uint8_t *src; /* the source as it is read when run */
  size_t spitch;
  uint8_t *staged; /* a pageable source's bytes, taken at the call */
  size_t width, height;
  int ord;         /* the device of the context that issued it */
  int doomed;      /* faults when it runs (a peer copy without peer access) */
  td_kcopy *kcopy; /* a launch of the copy kernel: its parameters */
} queued;

struct CUstream_st {
  unsigned flags;
  pid_t pid;
  queued *q;
  size_t head, nq, capq; /* q[head .. nq) not yet run */
  CUresult sticky;       /* work that found its memory gone */
  /* Stream capture (cuStreamBeginCapture): work issued while capturing is
   * captured, not run. */
  int capturing;
  int invalidated; /* an unsafe call from somewhere ended its usefulness */
  CUstreamCaptureMode mode;
  pthread_t thread; /* the thread that began it */
  int ordinal;      /* its context's device */
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
  REFUSE_IN_FORKED_CHILD();
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

/* Whether queued work reads or writes host memory in [base, base + size).
 * Called with mu held. */
static int queued_on_host(uintptr_t base, size_t size) {
  for (size_t i = 0; i <= nstreams; i++) {
    CUstream s = i < nstreams ? streams[i] : &null_stream;
    for (size_t j = s->head; j < s->nq; j++) {
      queued *c = &s->q[j];
      if ((!c->set && !c->src_dev && c->staged == NULL &&
           (uintptr_t)c->src - base < size) ||
          (c->dst_host && c->dst - base < size))
        return 1;
    }
  }
  return 0;
}

API CUresult CUDAAPI cuMemFreeHost(void *p) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < npins; i++)
    if (pins[i].base == (uintptr_t)p) {
      /* Stricter than the driver (which waits): freeing staging memory
       * that queued work still reads or writes is a program's bug. */
      if (queued_on_host(pins[i].base, pins[i].size))
        break;
      munmap(p, pins[i].size);
      pins[i] = pins[--npins];
      r = CUDA_SUCCESS;
      break;
    }
  pthread_mutex_unlock(&mu);
  return r;
}

/* The stream s names, or NULL if it is no live stream of this process (0
 * and CU_STREAM_LEGACY are the legacy default stream; the per-thread one is
 * taken as it). Called with mu held. */
static CUstream stream_of(CUstream s) {
  if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
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

/* ---- asynchronous work ----
 *
 * The driver runs copies to device memory, device-to-device copies and
 * memsets asynchronously to the host, whatever the call's name ("API
 * synchronization behavior" in the driver API's documentation); the double
 * queues them on their stream (the legacy stream for the calls without a
 * stream) and runs them only at a synchronisation that covers that stream:
 * cuStreamSynchronize, cuCtxSynchronize, an event recorded after them and
 * waited for, a stream's destruction, or a call that the driver makes wait
 * for the stream (a copy to pageable host memory, a copy from pageable host
 * memory, which syncs the stream before it stages). So a reader that reads
 * before the writer synchronised sees the old bytes, here every time, where
 * a GPU would only sometimes. TDCUDA_SYNC=1 runs everything at once. */

static uint64_t next_seq; /* mu */

/* Whether synchronising s completes t's work: t is s; or s is the legacy
 * stream and t a blocking stream (the legacy stream waits for those), or
 * the other way round; or s is NULL (the whole context). */
static int covers(CUstream s, CUstream t) {
  if (t != &null_stream && t->pid != getpid())
    return 0;
  if (s == NULL || s == t)
    return 1;
  if (s == &null_stream)
    return !(t->flags & CU_STREAM_NON_BLOCKING);
  if (t == &null_stream)
    return !(s->flags & CU_STREAM_NON_BLOCKING);
  return 0;
}

/* Runs c, queued on s: the destination (and a device source) must still be
 * mapped, else s's work fails with CUDA_ERROR_ILLEGAL_ADDRESS from then
 * on, as a kernel's fault makes the driver's context fail. Called with mu
 * held. */
static void run_kcopy(CUstream s, queued *c);
static int reaches(int ord, uintptr_t p, size_t n, int need);

/* Whether the work about to run is the TDCUDA_FAULT_AFTER-th. */
static int fault_due(void) {
  static unsigned long runs;
  return fault_after > 0 && ++runs == fault_after;
}

/* c, queued on s, faults: an illegal address, sticky: the context that
 * issued it is unusable from now on, for every stream and every call, as
 * the driver's is. */
static void fault(CUstream s, const queued *c) {
  s->sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
  if (c->ord >= 0 && c->ord < nvis && ctxs[c->ord].refs > 0)
    ctxs[c->ord].sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
}

static void run(CUstream s, queued *c) {
  if (c->kcopy != NULL) {
    run_kcopy(s, c);
    return;
  }
  size_t dspan = (c->height - 1) * c->dpitch + c->width;
  size_t sspan = (c->height - 1) * c->spitch + c->width;
  if ((!c->dst_host && !accessible(c->dst, dspan, PROT_READ | PROT_WRITE)) ||
      (c->src_dev && !accessible((uintptr_t)c->src, sspan, PROT_READ)) ||
      c->doomed || fault_due())
    fault(s, c);
  else if (s->sticky == CUDA_SUCCESS)
    for (size_t i = 0; i < c->height; i++) {
      void *d = (void *)(c->dst + i * c->dpitch);
      if (c->set)
        memset(d, c->value, c->width);
      else
        memcpy(d, c->src + i * c->spitch, c->width);
    }
  free(c->staged);
  c->staged = NULL;
}

/* Runs, in the order they were issued, the queued work that synchronising
 * s completes (s NULL: all of this process's). Returns s's failure (the
 * first failure of any stream for NULL), which stays. Called with mu held. */
static CUresult drain(CUstream s) {
  for (;;) {
    CUstream best = NULL;
    for (size_t i = 0; i <= nstreams; i++) {
      CUstream t = i < nstreams ? streams[i] : &null_stream;
      if (t->head < t->nq && covers(s, t) &&
          (best == NULL || t->q[t->head].seq < best->q[best->head].seq))
        best = t;
    }
    if (best == NULL)
      break;
    run(best, &best->q[best->head++]);
  }
  CUresult r = s != NULL ? s->sticky : CUDA_SUCCESS;
  for (size_t i = 0; i <= nstreams; i++) {
    CUstream t = i < nstreams ? streams[i] : &null_stream;
    if (t->head == t->nq)
      t->head = t->nq = 0;
    if (s == NULL && covers(s, t) && r == CUDA_SUCCESS)
      r = t->sticky;
  }
  return r;
}

static CUresult drain_all(void) {
  return drain(NULL);
}

/* Issues c on s: captured (dropped) while s captures, run at once with
 * TDCUDA_SYNC=1, else queued. Takes c's staged bytes. Called with mu held. */
static CUresult enqueue(CUstream s, queued c) {
  c.seq = ++next_seq;
  if (s->capturing) {
    free(c.staged); /* into the graph being captured, which is not run */
    free(c.kcopy);
    return CUDA_SUCCESS;
  }
  if (sync_all) {
    CUresult r = drain(s);
    run(s, &c);
    return r != CUDA_SUCCESS ? r : s->sticky;
  }
  if (grow((void **)&s->q, &s->capq, s->nq, sizeof *s->q) != 0) {
    free(c.staged);
    free(c.kcopy);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  s->q[s->nq++] = c;
  return CUDA_SUCCESS;
}

/* ---- stream capture ----
 *
 * cuStreamBeginCapture puts a stream in capture on the current context's
 * device. While it captures, the driver forbids, on that device: using the
 * legacy stream when the capturing stream is a blocking one
 * (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: the legacy stream would depend on
 * it), synchronising the context or the capturing stream, and "potentially
 * unsafe" calls (synchronous copies and memsets, cuMemAlloc, cuMemFree:
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) from the capturing thread (unless
 * it began in RELAXED mode) and, for a capture begun in GLOBAL mode, from
 * every other thread. A refused call invalidates the capture, and
 * cuStreamEndCapture then fails CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. */

#define CHECK_LEGACY 1 /* the call uses the legacy stream */
/* CHECK_UNSAFE (2): the call is potentially unsafe; CHECK_CONTEXT (4): it
 * synchronises the context (above). */

/* What the calling thread's call, of the kinds in what, meets from the
 * captures under way on device ord: CUDA_SUCCESS, or the driver's error,
 * the captures it conflicts with invalidated. Called with mu held. */
static CUresult capture_check(int ord, int what) {
  CUresult r = CUDA_SUCCESS;
  for (size_t i = 0; i < nstreams; i++) {
    CUstream t = streams[i];
    if (!t->capturing || t->pid != getpid() || t->ordinal != ord)
      continue;
    int mine = pthread_equal(t->thread, pthread_self());
    CUresult e = CUDA_SUCCESS;
    if ((what & CHECK_LEGACY) && !(t->flags & CU_STREAM_NON_BLOCKING))
      e = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    else if ((what & CHECK_CONTEXT) ||
             ((what & CHECK_UNSAFE) &&
              (mine ? t->mode != CU_STREAM_CAPTURE_MODE_RELAXED
                    : t->mode == CU_STREAM_CAPTURE_MODE_GLOBAL)))
      e = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (e != CUDA_SUCCESS) {
      t->invalidated = 1;
      if (r == CUDA_SUCCESS)
        r = e;
    }
  }
  return r;
}

/* The current context's device, with the capture rules for what applied.
 * Called with mu held. */
static CUresult current_checked(int what, int *ordinal) {
  int ord;
  CUresult r = current(&ord);
  if (r == CUDA_SUCCESS)
    r = capture_check(ord, what);
  if (r == CUDA_SUCCESS && ordinal != NULL)
    *ordinal = ord;
  return r;
}

API CUresult CUDAAPI cuStreamBeginCapture(CUstream hStream,
                                          CUstreamCaptureMode mode) {
  REFUSE_IN_FORKED_CHILD();
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL &&
      mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && s == NULL)
    r = CUDA_ERROR_INVALID_HANDLE;
  else if (r == CUDA_SUCCESS && s == &null_stream)
    r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream */
  else if (r == CUDA_SUCCESS && s->capturing)
    r = CUDA_ERROR_ILLEGAL_STATE;
  if (r == CUDA_SUCCESS) {
    s->capturing = 1;
    s->invalidated = 0;
    s->mode = mode;
    s->thread = pthread_self();
    s->ordinal = ord;
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* Ends the capture. The double makes no graph: *phGraph is NULL. */
API CUresult CUDAAPI cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
  REFUSE_IN_FORKED_CHILD();
  if (phGraph == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  *phGraph = NULL;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && (s == NULL || s == &null_stream))
    r = CUDA_ERROR_INVALID_HANDLE;
  else if (r == CUDA_SUCCESS && !s->capturing)
    r = CUDA_ERROR_ILLEGAL_STATE;
  else if (r == CUDA_SUCCESS && s->mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
           !pthread_equal(s->thread, pthread_self()))
    r = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  if (r == CUDA_SUCCESS) {
    s->capturing = 0;
    if (s->invalidated)
      r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- streams ---- */

API CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  REFUSE_IN_FORKED_CHILD();
  if (phStream == NULL || Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord = 0;
  CUresult r = current(&ord);
  CUstream s = NULL;
  if (r == CUDA_SUCCESS &&
      (grow((void **)&streams, &capstreams, nstreams, sizeof *streams) != 0 ||
       (s = calloc(1, sizeof *s)) == NULL))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    s->flags = Flags;
    s->pid = getpid();
    s->ordinal = ord;
    streams[nstreams++] = s;
    *phStream = s;
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* A destroyed context takes its streams with it, and their work not yet
 * run (as after a sticky error, the reason to destroy one). Called with mu
 * held. */
static void streams_drop(CUdevice dev) {
  for (size_t i = 0; i < nstreams;) {
    CUstream s = streams[i];
    if (s->pid != getpid() || s->ordinal != dev) {
      i++;
      continue;
    }
    for (size_t j = s->head; j < s->nq; j++)
      free(s->q[j].staged);
    streams[i] = streams[--nstreams];
    free(s->q);
    free(s);
  }
}

/* The driver completes a destroyed stream's work before it goes. */
API CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && (s == NULL || s == &null_stream))
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    drain(s);
    for (size_t i = 0; i < nstreams; i++)
      if (streams[i] == s) {
        streams[i] = streams[--nstreams];
        break;
      }
    free(s->q);
    free(s);
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* A capturing stream cannot be synchronised; the legacy stream cannot be
 * while a blocking stream captures. */
API CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && s == NULL)
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && s == &null_stream)
    r = capture_check(ord, CHECK_LEGACY);
  if (r == CUDA_SUCCESS && s->capturing) {
    s->invalidated = 1;
    r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (r == CUDA_SUCCESS)
    r = drain(s);
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- copies and memsets, as the driver runs them ---- */

#define SIDE_DEVICE 0
#define SIDE_HOST 1
#define SIDE_NONE 2 /* a memset's source */

/* Issues c (rows between dst and src of the kinds given; a memset if src is
 * SIDE_NONE) on stream hStream; sync for the calls without a stream, which
 * use the legacy stream and are "potentially unsafe" during capture. The
 * device sides must be mapped with the access they need now
 * (CUDA_ERROR_INVALID_VALUE otherwise). Then, as the driver's
 * synchronisation rules have it: to device memory from a device, or a
 * memset, is queued; from pinned host memory, queued for the Async calls
 * and done at once (after the stream's earlier work) for the synchronous
 * ones; from pageable host memory, the stream's earlier work is done, the
 * source staged (copied now) and the copy to the device queued; to host
 * memory, queued for an Async call into pinned memory, else done at once
 * after the stream's earlier work. */
static CUresult issue(CUstream hStream, int sync, int dst, int src, queued c) {
  size_t dspan = (c.height - 1) * c.dpitch + c.width;
  size_t sspan = (c.height - 1) * c.spitch + c.width;
  int ord;
  pthread_mutex_lock(&mu);
  CUresult r = current(&ord);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && s == NULL)
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS)
    r = capture_check(ord, (s == &null_stream ? CHECK_LEGACY : 0) |
                               (sync ? CHECK_UNSAFE : 0));
  if (r != CUDA_SUCCESS)
    goto out;
  if ((dst == SIDE_DEVICE &&
       !accessible(c.dst, dspan, PROT_READ | PROT_WRITE)) ||
      (src == SIDE_DEVICE && !accessible((uintptr_t)c.src, sspan, PROT_READ)) ||
      (dst == SIDE_HOST && src == SIDE_NONE)) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  c.ord = ord;
  c.set = src == SIDE_NONE;
  c.dst_host = dst == SIDE_HOST;
  c.src_dev = src == SIDE_DEVICE;
  int queue;
  if (dst == SIDE_DEVICE && src != SIDE_HOST)
    queue = 1;
  else if (dst == SIDE_DEVICE && is_pinned(c.src, sspan))
    queue = !sync;
  else if (dst == SIDE_DEVICE)
    queue = 2; /* pageable: stage */
  else
    queue = !sync && src == SIDE_DEVICE && is_pinned((void *)c.dst, dspan);
  if (queue != 1 && !s->capturing && (r = drain(s)) != CUDA_SUCCESS)
    goto out;
  if (queue == 2) {
    if ((c.staged = malloc(c.width * c.height)) == NULL) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
      goto out;
    }
    for (size_t i = 0; i < c.height; i++)
      memcpy(c.staged + i * c.width, c.src + i * c.spitch, c.width);
    c.src = c.staged;
    c.spitch = c.width;
  }
  if (queue || s->capturing) {
    r = enqueue(s, c);
  } else {
    run(s, &c);
    r = s->sticky;
  }
out:
  pthread_mutex_unlock(&mu);
  return r;
}

/* A 1D copy or memset as one row. */
static queued row(uintptr_t dst, const void *src, size_t n) {
  return (queued){.dst = dst,
                  .dpitch = n,
                  .src = src,
                  .spitch = n,
                  .width = n,
                  .height = 1};
}

/* A host-to-device or device-to-host copy of ByteCount bytes on stream
 * (legacy: the call without a stream, on the legacy stream). */
static CUresult htod(CUstream stream, int legacy, CUdeviceptr dst,
                     const void *src, size_t ByteCount) {
  if (src == NULL && ByteCount > 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (ByteCount == 0)
    return check_range(0, 0, PROT_NONE);
  return issue(stream, legacy, SIDE_DEVICE, SIDE_HOST,
               row((uintptr_t)dst, src, ByteCount));
}

static CUresult dtoh(CUstream stream, int legacy, void *dst, CUdeviceptr src,
                     size_t ByteCount) {
  if (dst == NULL && ByteCount > 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (ByteCount == 0)
    return check_range(0, 0, PROT_NONE);
  return issue(stream, legacy, SIDE_HOST, SIDE_DEVICE,
               row((uintptr_t)dst, (const void *)src, ByteCount));
}

API CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost,
                                  size_t ByteCount) {
  REFUSE_IN_FORKED_CHILD();
  return htod(NULL, 1, dstDevice, srcHost, ByteCount);
}

API CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice,
                                  size_t ByteCount) {
  REFUSE_IN_FORKED_CHILD();
  return dtoh(NULL, 1, dstHost, srcDevice, ByteCount);
}

API CUresult CUDAAPI cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc,
                                size_t N) {
  REFUSE_IN_FORKED_CHILD();
  if (N == 0)
    return check_range(0, 0, PROT_NONE);
  queued c = row((uintptr_t)dstDevice, NULL, N);
  c.value = uc;
  return issue(NULL, 1, SIDE_DEVICE, SIDE_NONE, c);
}

/* Queued, not copied, when the source is pinned: the bytes are read and
 * reach the device at the stream's synchronisation (or its destruction),
 * so a program that reuses the source before it synchronised copies the
 * wrong bytes here. A pageable source is staged at the call, as the
 * driver does. */
API CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice,
                                       const void *srcHost, size_t ByteCount,
                                       CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  return htod(hStream, 0, dstDevice, srcHost, ByteCount);
}

/* Logged (TDCUDA_CALL_LOG): the library's staged td_copy reads the device
 * with it, so tests see a copy staged. */
API CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice,
                                       size_t ByteCount, CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  CUresult r = dtoh(hStream, 0, dstHost, srcDevice, ByteCount);
  if (r == CUDA_SUCCESS)
    call_log("cuMemcpyDtoHAsync");
  return r;
}

API CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc,
                                     size_t N, CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  if (N == 0)
    return check_range(0, 0, PROT_NONE);
  queued c = row((uintptr_t)dstDevice, NULL, N);
  c.value = uc;
  return issue(hStream, 0, SIDE_DEVICE, SIDE_NONE, c);
}

/* TDCUDA_MEMCPY2D_LOG=path: each cuMemcpy2D (or 2DAsync) appends a line
 * "width height" there, so that tests can count the copies the library
 * made. */
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

/* One side of a 2D copy: its first byte (X and Y applied) in *p. Host and
 * device are the only kinds the double knows. */
static CUresult copy2d_side(CUmemorytype type, const void *host,
                            CUdeviceptr dev, size_t x, size_t y, size_t pitch,
                            size_t width, size_t height, int *side,
                            uintptr_t *p) {
  size_t span;
  if (__builtin_mul_overflow(y + height - 1, pitch, &span) ||
      __builtin_add_overflow(span, x + width, &span))
    return CUDA_ERROR_INVALID_VALUE;
  switch (type) {
  case CU_MEMORYTYPE_HOST:
    if (host == NULL)
      return CUDA_ERROR_INVALID_VALUE;
    *side = SIDE_HOST;
    *p = (uintptr_t)host + y * pitch + x;
    return CUDA_SUCCESS;
  case CU_MEMORYTYPE_DEVICE:
    *side = SIDE_DEVICE;
    *p = (uintptr_t)dev + y * pitch + x;
    return CUDA_SUCCESS;
  default:
    return CUDA_ERROR_INVALID_VALUE;
  }
}

/* Height rows of WidthInBytes, each pitch apart on its side; as the driver,
 * a pitch below the width (with more than one row) is refused. Arrays are
 * not supported. */
static CUresult copy2d(const CUDA_MEMCPY2D *c, CUstream hStream, int sync) {
  if (c == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_range(0, 0, PROT_NONE); /* a context is current */
  if (r != CUDA_SUCCESS || c->WidthInBytes == 0 || c->Height == 0)
    return r;
  if (c->Height > 1 &&
      (c->srcPitch < c->WidthInBytes || c->dstPitch < c->WidthInBytes))
    return CUDA_ERROR_INVALID_VALUE;
  uintptr_t s, d;
  int sside, dside;
  r = copy2d_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes,
                  c->srcY, c->srcPitch, c->WidthInBytes, c->Height, &sside, &s);
  if (r == CUDA_SUCCESS)
    r = copy2d_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes,
                    c->dstY, c->dstPitch, c->WidthInBytes, c->Height, &dside,
                    &d);
  if (r != CUDA_SUCCESS)
    return r;
  r = issue(hStream, sync, dside, sside,
            (queued){.dst = d,
                     .dpitch = c->dstPitch,
                     .src = (const uint8_t *)s,
                     .spitch = c->srcPitch,
                     .width = c->WidthInBytes,
                     .height = c->Height});
  if (r == CUDA_SUCCESS)
    log_copy2d(c->WidthInBytes, c->Height);
  return r;
}

API CUresult CUDAAPI cuMemcpy2D(const CUDA_MEMCPY2D *pCopy) {
  REFUSE_IN_FORKED_CHILD();
  return copy2d(pCopy, NULL, 1);
}

API CUresult CUDAAPI cuMemcpy2DAsync(const CUDA_MEMCPY2D *pCopy,
                                     CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  return copy2d(pCopy, hStream, 0);
}

/* ---- events recorded on streams ----
 *
 * An event completes when the work issued on its stream before it has run:
 * waiting for it (cuEventSynchronize, cuStreamWaitEvent) runs that stream's
 * queued work. An interprocess event's waiter may be another process, which
 * cannot run this one's queue: its stream's work is run when it is
 * recorded, as a GPU would have run it by the time anyone could look. */

typedef struct {
  CUevent ev;
  CUstream s;
} mark;

static mark *marks;
static size_t nmarks, capmarks;

/* Notes that ev was recorded on stream s. Called with mu held. */
static void event_recorded(CUevent ev, CUstream s) {
  CUstream t = stream_of(s);
  if (t == NULL)
    return;
  if (ev->flags & CU_EVENT_INTERPROCESS) {
    drain(t);
    return;
  }
  for (size_t i = 0; i < nmarks; i++)
    if (marks[i].ev == ev) {
      marks[i].s = t;
      return;
    }
  if (grow((void **)&marks, &capmarks, nmarks, sizeof *marks) == 0)
    marks[nmarks++] = (mark){ev, t};
  else
    drain(t); /* no room to remember: complete it now */
}

/* Runs the work ev waits for, if ev was recorded here on a stream that
 * still lives (a destroyed stream's work is done). Called with mu held. */
static CUresult event_wait(CUevent ev) {
  for (size_t i = 0; i < nmarks; i++)
    if (marks[i].ev == ev) {
      CUstream s = marks[i].s;
      marks[i] = marks[--nmarks];
      if (s == &null_stream)
        return drain(s);
      for (size_t j = 0; j < nstreams; j++)
        if (streams[j] == s)
          return drain(s);
      return CUDA_SUCCESS;
    }
  return CUDA_SUCCESS;
}

/* ---- modules and the copy kernel ----
 *
 * The double runs no device code: it takes a fatbin (an image that starts
 * with the fatbin magic, as nvcc -fatbin writes it) for what it is and
 * knows the kernels by name, emulating each on the host when its launch
 * runs (at the stream's synchronisation, as any queued work). */

#define FATBIN_MAGIC 0xBA55ED50u

struct CUmod_st {
  int ordinal; /* the context's device it was loaded in */
};

struct CUfunc_st {
  int ordinal;
  const char *name;
};

static struct CUmod_st modules[MAX_DEVICES];
/* The kernels the double emulates, per device: the element walk and the
 * tiled one (whose result is the same walk's). */
static const char *const kernel_names[] = {TD_KCOPY_NAME, TD_KCOPY_TILED_NAME};
#define NKERNELS 2
static struct CUfunc_st kcopy_fns[MAX_DEVICES * NKERNELS];

/* Loads into the current context. TDCUDA_NO_MODULE=1: no image has code
 * for this "GPU" (CUDA_ERROR_NO_BINARY_FOR_GPU), as on a GPU newer than
 * the fatbin's PTX or older than its oldest SASS. */
API CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
  REFUSE_IN_FORKED_CHILD();
  if (module == NULL || image == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  uint32_t magic;
  if (r == CUDA_SUCCESS) {
    memcpy(&magic, image, sizeof magic);
    if (magic != FATBIN_MAGIC)
      r = CUDA_ERROR_INVALID_IMAGE;
    else if (no_module)
      r = CUDA_ERROR_NO_BINARY_FOR_GPU;
  }
  if (r == CUDA_SUCCESS) {
    modules[ord].ordinal = ord;
    *module = &modules[ord];
  }
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS)
    call_log("cuModuleLoadData");
  return r;
}

/* The module stays usable by launches already queued, as on the driver,
 * which completes them first; the double's modules hold nothing to free. */
API CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
  REFUSE_IN_FORKED_CHILD();
  if (hmod == NULL || hmod < &modules[0] || hmod >= &modules[MAX_DEVICES])
    return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&mu);
  CUresult r = current(NULL);
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS)
    call_log("cuModuleUnload");
  return r;
}

API CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod,
                                         const char *name) {
  REFUSE_IN_FORKED_CHILD();
  if (hfunc == NULL || name == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (hmod == NULL || hmod < &modules[0] || hmod >= &modules[MAX_DEVICES])
    return CUDA_ERROR_INVALID_HANDLE;
  for (int k = 0; k < NKERNELS; k++)
    if (strcmp(name, kernel_names[k]) == 0) {
      struct CUfunc_st *f = &kcopy_fns[hmod->ordinal * NKERNELS + k];
      f->ordinal = hmod->ordinal;
      f->name = kernel_names[k];
      *hfunc = f;
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_NOT_FOUND;
}

/* The byte range [*lo, *hi) one side of a copy kernel's launch reaches. */
static void kcopy_extent(const td_kcopy *p, uint64_t base, const int64_t *st,
                         uintptr_t *lo, size_t *n) {
  uint64_t last = base;
  for (int i = 0; i < p->nd; i++)
    last += (uint64_t)(p->size[i] - 1) * (uint64_t)st[i];
  *lo = (uintptr_t)base;
  *n = (size_t)(last - base) + (size_t)p->es;
}

/* Runs a queued launch of the copy kernel: every byte of both extents must
 * be mapped with the access needed, else the stream's work fails with
 * CUDA_ERROR_ILLEGAL_ADDRESS from then on, as a fault in a kernel does.
 * The same walk as the kernel's: the linear index decomposed with the last
 * dim fastest. Called with mu held. */
static void run_kcopy(CUstream s, queued *c) {
  td_kcopy *p = c->kcopy;
  uintptr_t dlo, slo;
  size_t dn, sn;
  kcopy_extent(p, p->dst, p->ds, &dlo, &dn);
  kcopy_extent(p, p->src, p->ss, &slo, &sn);
  /* A kernel runs on its context's device: every byte it touches must be
   * mapped, and a VMM mapping must let that device in (its own, or a peer
   * cuMemSetAccess named). */
  if (!accessible(dlo, dn, PROT_READ | PROT_WRITE) ||
      !accessible(slo, sn, PROT_READ) ||
      !reaches(c->ord, dlo, dn, CU_MEM_ACCESS_FLAGS_PROT_READWRITE) ||
      !reaches(c->ord, slo, sn, CU_MEM_ACCESS_FLAGS_PROT_READ) || fault_due())
    fault(s, c);
  else if (s->sticky == CUDA_SUCCESS)
    for (int64_t i = 0; i < p->numel; i++) {
      int64_t rest = i, doff = 0, soff = 0;
      for (int k = p->nd - 1; k >= 0; k--) {
        int64_t ik = rest % p->size[k];
        rest /= p->size[k];
        doff += ik * p->ds[k];
        soff += ik * p->ss[k];
      }
      memcpy((char *)(uintptr_t)p->dst + doff,
             (const char *)(uintptr_t)p->src + soff, (size_t)p->es);
    }
  free(c->kcopy);
  c->kcopy = NULL;
}

/* Queues the kernel's run on hStream, as the driver does: its parameters
 * are copied at the call (the caller may reuse them at once), the memory
 * it touches is checked only when it runs. The launch configuration is
 * checked now: a grid and block of positive dims, at most 1024 threads a
 * block, at most 48 KiB of dynamic shared memory (without the opt-in
 * attribute), kernelParams and no extra. */
API CUresult CUDAAPI cuLaunchKernel(
    CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
    unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
    unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
    void **kernelParams, void **extra) {
  REFUSE_IN_FORKED_CHILD();
  pthread_mutex_lock(&mu);
  int ord;
  CUresult r = current(&ord);
  CUstream s = r == CUDA_SUCCESS ? stream_of(hStream) : NULL;
  if (r == CUDA_SUCCESS && s == NULL)
    r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS &&
      (f == NULL || f < &kcopy_fns[0] ||
       f >= &kcopy_fns[MAX_DEVICES * NKERNELS] || f->name == NULL))
    r = CUDA_ERROR_INVALID_HANDLE;
  else if (r == CUDA_SUCCESS && f->ordinal != ord)
    r = CUDA_ERROR_INVALID_CONTEXT; /* a module of another context */
  if (r == CUDA_SUCCESS &&
      (gridDimX == 0 || gridDimY == 0 || gridDimZ == 0 || blockDimX == 0 ||
       blockDimY == 0 || blockDimZ == 0 ||
       (uint64_t)blockDimX * blockDimY * blockDimZ > 1024 || gridDimY > 65535 ||
       gridDimZ > 65535))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && sharedMemBytes > 48 * 1024)
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS &&
      (kernelParams == NULL || kernelParams[0] == NULL || extra != NULL))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS)
    r = capture_check(ord, s == &null_stream ? CHECK_LEGACY : 0);
  td_kcopy *p = NULL;
  if (r == CUDA_SUCCESS && (p = malloc(sizeof *p)) == NULL)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    memcpy(p, kernelParams[0], sizeof *p);
    /* The tiled kernel: a tile dim below the innermost, blocks of
     * TD_KCOPY_TILE x TD_KCOPY_ROWS threads, an element size it has a
     * type for (the kernel would copy nothing else). */
    int tiled = strcmp(f->name, TD_KCOPY_TILED_NAME) == 0;
    if (p->nd < 0 || p->nd > TD_KCOPY_MAX_DIMS || p->es <= 0 || p->numel < 0 ||
        p->reserved != 0 ||
        (tiled ? p->tile < 0 || p->tile >= p->nd - 1 || p->es > 16 ||
                     (p->es & (p->es - 1)) != 0 || blockDimX != TD_KCOPY_TILE ||
                     blockDimY != TD_KCOPY_ROWS
               : p->tile != -1)) {
      free(p);
      r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  if (r == CUDA_SUCCESS)
    /* Device memory only: src_dev keeps it out of the pinned-host checks. */
    r = enqueue(s, (queued){.src_dev = 1,
                            .dst = (uintptr_t)p->dst,
                            .src = (const uint8_t *)(uintptr_t)p->src,
                            .width = 1,
                            .height = 1,
                            .ord = ord,
                            .kcopy = p});
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS) {
    char line[64];
    snprintf(line, sizeof line, "cuLaunchKernel %s", f->name);
    call_log(line);
  }
  return r;
}

/* ---- peer access and peer copies ---- */

/* The physical device whose memory [p, p + n) is, or -1 if it is not all
 * mapped device memory of one device. Called with mu held. */
static int device_of(uintptr_t p, size_t n) {
  int phys = -1;
  uintptr_t end = p + n;
  while (p < end) {
    mapping *m = map_at(p);
    if (m == NULL || (phys >= 0 && m->a->phys != phys))
      return -1;
    phys = m->a->phys;
    p = m->base + m->size;
  }
  return phys;
}

/* Whether device ordinal ord may use [p, p + n) with access need (a
 * CU_MEM_ACCESS_FLAGS value): a VMM mapping must have given it that much
 * (cuMemSetAccess); legacy memory is open to peers (cuIpcOpenMemHandle's
 * LAZY_ENABLE_PEER_ACCESS, cuMemAlloc's unified addressing). Called with
 * mu held. */
static int reaches(int ord, uintptr_t p, size_t n, int need) {
  uintptr_t end = p + n;
  while (p < end) {
    mapping *m = map_at(p);
    if (m == NULL)
      return 0;
    if (!m->legacy && m->access[ord] < need)
      return 0;
    p = m->base + m->size;
  }
  return 1;
}

/* Every two different devices can reach each other, unless
 * TDCUDA_NO_PEER=1 (as GPUs on different PCIe root complexes without
 * NVLink). */
API CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev,
                                           CUdevice peerDev) {
  REFUSE_IN_FORKED_CHILD();
  if (canAccessPeer == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_device(dev);
  if (r == CUDA_SUCCESS)
    r = check_device(peerDev);
  if (r == CUDA_SUCCESS)
    *canAccessPeer = dev != peerDev && !no_peer;
  return r;
}

/* A device-to-device copy between the memory of two contexts' devices,
 * queued on hStream like any device-to-device copy. Each pointer must lie
 * in memory of its context's device (CUDA_ERROR_INVALID_VALUE otherwise);
 * the driver copies whether or not the devices have peer access (staging
 * it itself where they do not), so TDCUDA_NO_PEER changes nothing here. */
API CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dstDevice,
                                       CUcontext dstContext,
                                       CUdeviceptr srcDevice,
                                       CUcontext srcContext, size_t ByteCount,
                                       CUstream hStream) {
  REFUSE_IN_FORKED_CHILD();
  if (dstContext == NULL || dstContext < &ctxs[0] ||
      dstContext >= &ctxs[MAX_DEVICES] || srcContext == NULL ||
      srcContext < &ctxs[0] || srcContext >= &ctxs[MAX_DEVICES])
    return CUDA_ERROR_INVALID_CONTEXT;
  if (ByteCount == 0)
    return check_range(0, 0, PROT_NONE);
  pthread_mutex_lock(&mu);
  CUresult r = CUDA_SUCCESS;
  if (dstContext->refs == 0 || srcContext->refs == 0)
    r = CUDA_ERROR_INVALID_CONTEXT;
  else if (device_of((uintptr_t)dstDevice, ByteCount) !=
               vis[dstContext->ordinal] ||
           device_of((uintptr_t)srcDevice, ByteCount) !=
               vis[srcContext->ordinal])
    r = CUDA_ERROR_INVALID_VALUE;
  /* Between GPUs that reach each other the copy is one device's DMA into
   * or out of the other's memory, which a VMM mapping allows only to the
   * devices cuMemSetAccess named: without it the copy faults when it runs
   * (sticky, as any illegal address). The double does not say which
   * engine copies, so it asks each device for access to the other's
   * range; between GPUs that do not reach each other the driver stages
   * through the host with each device's own engine, which needs nothing. */
  queued c =
      row((uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount);
  if (r == CUDA_SUCCESS && dstContext != srcContext && !no_peer)
    c.doomed = !reaches(dstContext->ordinal, (uintptr_t)srcDevice, ByteCount,
                        CU_MEM_ACCESS_FLAGS_PROT_READ) ||
               !reaches(srcContext->ordinal, (uintptr_t)dstDevice, ByteCount,
                        CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS)
    r = issue(hStream, 0, SIDE_DEVICE, SIDE_DEVICE, c);
  if (r == CUDA_SUCCESS)
    call_log("cuMemcpyPeerAsync");
  return r;
}

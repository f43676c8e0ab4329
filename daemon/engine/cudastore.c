/* cudastore.c: the CUDA storage backend: one VMM allocation per storage
 * (cuMemCreate), exported once as a POSIX fd that every open dups; on a GPU
 * that cannot export POSIX fds, one cuMemAlloc per storage, exported as a
 * legacy IPC handle (cuIpcGetMemHandle: 64 bytes in every reply, no fd). The
 * driver is loaded, and each device's primary context retained, at the
 * first create on it; every call here that reaches the driver runs on the
 * thread pool (segment.c never runs a CUDA create or unlink on the loop).
 * A freed VMM allocation may wait in a pool of its own for its owner uid's
 * next create of that size (below, "the recycling pool").
 *
 * Read-only is advisory on this path: an importer picks its own access
 * flags (cuMemSetAccess), so a hostile client given a read-only reference
 * could still map the allocation read-write. On the legacy path read-only
 * cannot be asked of the driver at all: cuIpcOpenMemHandle always maps
 * read-write. docs/design.md, "CUDA". */
#include "backend.h"
#include "cudastore.h"

#include "common.h"
#include "htab.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if TD_HAVE_CUDA
#include "driver.h"
#endif

#define MAX_CAPS 64
#define MAX_DEVS 64
/* What a legacy (cuMemAlloc) storage's size is rounded up to and counted
 * as: the granularity of the VMM path on current GPUs, and what cuMemAlloc
 * itself rounds large allocations to. */
#define LEGACY_GRAN ((size_t)2 << 20)

/* What --cuda-devices and --cuda-capacity say: "K", "GPU-..." or "MIG-...". */
typedef struct sel {
  char dev[48];
  uint64_t bytes;
} sel;

static int all_devices = 1;
static sel allowed[MAX_DEVS];
static size_t nallowed;
static sel caps[MAX_CAPS];
static size_t ncaps;
/* The recycling pool's bounds: --cuda-recycle-bytes (per GPU; unset: a
 * quarter of the GPU's capacity; 0: off) and --recycle-idle. */
static int pool_set;
static uint64_t pool_bytes_opt;
static int64_t pool_idle_ms = 30000;

void td__cuda_configure_pool(int set, uint64_t bytes, int64_t idle_ms) {
  pool_set = set;
  pool_bytes_opt = bytes;
  if (idle_ms > 0)
    pool_idle_ms = idle_ms;
}

/* Returns 1 if s names a device: an ordinal or a UUID, "GPU-..." or (a
 * MIG instance's) "MIG-...". */
static int dev_syntax(const char *s) {
  uint8_t u[16];
  if (strncmp(s, "GPU-", 4) == 0 || strncmp(s, "MIG-", 4) == 0)
    return td__uuid_parse(s, u) >= 0;
  if (*s == '\0' || strlen(s) > 5)
    return 0;
  for (const char *p = s; *p; p++)
    if (*p < '0' || *p > '9')
      return 0;
  return 1;
}

int td__cuda_configure(const char *devices, const char *const *capacities,
                       size_t ncapacities, char *msg, size_t len) {
  nallowed = ncaps = 0;
  all_devices = devices == NULL;
  if (devices != NULL) {
    const char *p = devices;
    while (*p != '\0') {
      size_t n = strcspn(p, ",");
      if (n == 0 || n >= sizeof(allowed[0].dev) || nallowed == MAX_DEVS)
        return td__msg(msg, len, TD_EINVAL,
                       "--cuda-devices '%s': not a comma list of ordinals "
                       "or UUIDs (GPU-... or MIG-...)",
                       devices);
      memcpy(allowed[nallowed].dev, p, n);
      allowed[nallowed].dev[n] = '\0';
      if (!dev_syntax(allowed[nallowed].dev))
        return td__msg(msg, len, TD_EINVAL,
                       "--cuda-devices '%s': '%s' is neither an ordinal nor "
                       "a UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, "
                       "or MIG-... for a MIG instance)",
                       devices, allowed[nallowed].dev);
      nallowed++;
      p += n;
      if (*p == ',')
        p++;
    }
  }
  for (size_t i = 0; i < ncapacities; i++) {
    const char *c = capacities[i];
    const char *eq = strchr(c, '=');
    size_t n = eq ? (size_t)(eq - c) : 0;
    if (ncaps == MAX_CAPS || n == 0 || n >= sizeof(caps[0].dev))
      return td__msg(msg, len, TD_EINVAL,
                     "--cuda-capacity '%s': use K=SIZE, K a device's ordinal "
                     "or UUID (e.g. 0=8G)",
                     c);
    memcpy(caps[ncaps].dev, c, n);
    caps[ncaps].dev[n] = '\0';
    if (!dev_syntax(caps[ncaps].dev) ||
        td__parse_size(eq + 1, &caps[ncaps].bytes) < 0 ||
        caps[ncaps].bytes == 0)
      return td__msg(msg, len, TD_EINVAL,
                     "--cuda-capacity '%s': use K=SIZE, K a device's ordinal "
                     "or UUID (e.g. 0=8G)",
                     c);
    ncaps++;
  }
  return 0;
}

#if TD_HAVE_CUDA

/* Two locks. init_mu serialises the lazy start (loading the driver) and a
 * device's context (made at the first create, destroyed when its last
 * storage goes) and is held across those driver calls; only thread-pool
 * jobs take it. mu guards the allocation table and the per-device figures
 * and is never held across a driver call, so the loop (an open's dup, a
 * Stat) never waits on the GPU. */
static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* One GPU the driver shows us. Set at the load (under init_mu, published
 * under mu with ndevs) but for what a device's first create sets (gran,
 * total, capacity), its context (init_mu), and the figures (mu). */
typedef struct dev {
  int index; /* the daemon's ordinal */
  CUdevice cu;
  uint8_t uuid[16];
  int allowed;    /* --cuda-devices names it (or no list was given) */
  CUcontext ctx;  /* init_mu: retained while holds > 0, else NULL */
  int holds;      /* init_mu: live allocations and creates in flight */
  int opened;     /* gran, total, capacity and legacy are read */
  size_t gran;    /* allocation granularity */
  uint64_t total; /* device memory */
  uint64_t capacity, cap_set;
  int legacy; /* no POSIX-fd handles: cuMemAlloc and legacy IPC handles */
  uint64_t used, storages;         /* mu; used counts pooled allocations too */
  uint64_t pool_limit;             /* set with capacity */
  uint64_t pool_bytes, pool_count; /* mu */
  uint64_t releasing; /* mu: storages whose unlink or retire is queued */
  uint64_t pool_hits, pool_misses; /* mu */
} dev;

/* One allocation: a storage's, by segment name (in allocs, under mu), or
 * a pooled one (in the pool list, under mu), which keeps its hold on the
 * context, its fd and its charge against the capacity. */
typedef struct alloc {
  td__hnode node;
  struct alloc *prev, *next; /* pooled: oldest first */
  uid_t uid;                 /* pooled: whose bytes these are */
  int64_t since_ms;          /* pooled: when */
  uint64_t id;               /* never reused (td__created.alloc_id) */
  dev *d;
  CUmemGenericAllocationHandle h;
  int fd;          /* the exported POSIX fd, kept for opens to dup */
  CUdeviceptr ptr; /* legacy: cuMemAlloc's memory (h and fd unused) */
  int legacy;
  int releasing; /* its unlink or retire is queued (cuda_releasing) */
  uint64_t size;
  char name[TD__SEGMENT_NAME_MAX];
} alloc;

static const td__cu *cu; /* init_mu */
static int load_tried;   /* init_mu */
static char load_msg[256];
static dev devs[MAX_DEVS];
static size_t ndevs; /* mu */
static td__htab allocs;
static uint64_t next_alloc_id = 1; /* mu */
/* The pool, every GPU's, oldest first (mu); its ageing thread. */
static alloc *pool_oldest, *pool_newest;
static int pool_stopping; /* mu: the daemon stops; nothing more is pooled */
static pthread_cond_t pool_cv;
/* Broadcast when a storage whose release was queued is released. */
static pthread_cond_t released_cv;
static pthread_t pool_thread;
static int pool_thread_on; /* mu */

/* How long a create at the capacity waits for releases already queued. */
#define RELEASE_WAIT_MS 2000

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int name_eq(const td__hnode *n, const void *key) {
  return strcmp(td__container_of(n, alloc, node)->name, key) == 0;
}

static alloc *alloc_find(const char *name) {
  td__hnode *n =
      td__htab_find(&allocs, td__hash_bytes(name, strlen(name)), name_eq, name);
  return n ? td__container_of(n, alloc, node) : NULL;
}

/* Returns 1 if s (an ordinal or a UUID string) names d. A UUID matches by
 * its digits, whichever prefix it has: a MIG instance is "MIG-..." to
 * nvidia-smi -L and CUDA_VISIBLE_DEVICES, and was "GPU-..." in what
 * tensord printed before it told them apart. */
static int names(const char *s, const dev *d) {
  uint8_t u[16];
  if (td__uuid_parse(s, u) >= 0)
    return memcmp(u, d->uuid, 16) == 0;
  return atoi(s) == d->index;
}

/* Loads the driver and lists its devices, once (again, at most once a
 * second, while cuInit says the driver is still starting). Called with
 * init_mu held. Returns 0, or TD_ENODEV with msg saying why. */
static int load(char *msg, size_t len) {
  if (!load_tried || (cu == NULL && td__cu_load_transient())) {
    load_tried = 1;
    cu = td__cu_load(load_msg, sizeof(load_msg));
    int n = 0;
    CUresult r;
    if (cu != NULL && (r = cu->DeviceGetCount(&n)) != CUDA_SUCCESS) {
      char e[128];
      snprintf(load_msg, sizeof(load_msg), "cuDeviceGetCount: %s",
               td__cu_strerror(cu, r, e, sizeof(e)));
      cu = NULL;
    }
    size_t nd = 0;
    for (int i = 0; cu != NULL && i < n && nd < MAX_DEVS; i++) {
      dev *d = &devs[nd];
      CUuuid uu;
      if (cu->DeviceGet(&d->cu, i) != CUDA_SUCCESS ||
          cu->DeviceGetUuid(&uu, d->cu) != CUDA_SUCCESS) {
        td__warn("cuda: device %d: cannot read its UUID; not used", i);
        continue;
      }
      d->index = i;
      memcpy(d->uuid, uu.bytes, 16);
      d->allowed = all_devices;
      for (size_t k = 0; k < nallowed; k++)
        d->allowed |= names(allowed[k].dev, d);
      for (size_t k = 0; k < ncaps; k++)
        if (names(caps[k].dev, d)) {
          d->capacity = caps[k].bytes;
          d->cap_set = 1;
        }
      char u[48];
      td__info("cuda: device %d %s%s", i,
               td__cu_uuid_str(d->uuid, u, sizeof(u)),
               d->allowed ? "" : " (not in --cuda-devices: not used)");
      nd++;
    }
    pthread_mutex_lock(&mu);
    ndevs = nd;
    pthread_mutex_unlock(&mu);
    if (cu == NULL)
      td__warn("cuda: %s; CUDA creates fail%s", load_msg,
               td__cu_load_transient() ? " until it succeeds" : "");
  }
  if (cu == NULL)
    return td__msg(msg, len, TD_ENODEV, "%s", load_msg);
  return 0;
}

/* Reads what d's first create needs (with ctx current): its memory, its
 * granularity, which path serves it. Called with init_mu held. Returns 0 or
 * a negative code with msg filled. */
static int dev_read(dev *d, CUcontext ctx, char *msg, size_t len) {
  char e[128];
  /* A device without VMM, or whose VMM memory cannot be exported as a
   * POSIX fd, falls back to cuMemAlloc and legacy IPC handles; so does
   * every device when the tests force it. An attribute the driver cannot
   * read counts as unsupported. */
  int vmm = 0, posix_fd = 0;
  if (cu->DeviceGetAttribute(
          &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
          d->cu) != CUDA_SUCCESS)
    vmm = 0;
  if (cu->DeviceGetAttribute(
          &posix_fd,
          CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
          d->cu) != CUDA_SUCCESS)
    posix_fd = 0;
  const char *force = getenv(TD__CU_LEGACY_ENV);
  int forced = force != NULL && strcmp(force, "1") == 0;
  int legacy = forced || !vmm || !posix_fd;
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = d->cu;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t free_b = 0, total = 0, gran = 0;
  const char *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(ctx);
  if (r == CUDA_SUCCESS) {
    what = "cuMemGetInfo";
    r = cu->MemGetInfo(&free_b, &total);
    if (r == CUDA_SUCCESS && legacy) {
      /* No VMM granularity to ask for (a device without VMM refuses the
       * question): sizes are rounded, and counted, by LEGACY_GRAN. */
      gran = LEGACY_GRAN;
    } else if (r == CUDA_SUCCESS) {
      what = "cuMemGetAllocationGranularity";
      r = cu->MemGetAllocationGranularity(&gran, &prop,
                                          CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    }
    CUcontext popped;
    cu->CtxPopCurrent(&popped);
  }
  if (r == CUDA_SUCCESS && gran == 0)
    r = CUDA_ERROR_NOT_SUPPORTED;
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "cuda:%d: %s: %s", d->index, what,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  pthread_mutex_lock(&mu);
  d->gran = gran;
  d->total = total;
  if (!d->cap_set)
    d->capacity = total;
  d->pool_limit = pool_set ? pool_bytes_opt : d->capacity / 4;
  if (d->pool_limit > d->capacity)
    d->pool_limit = d->capacity;
  d->legacy = legacy;
  pthread_mutex_unlock(&mu);
  d->opened = 1;
  char a[32], b[32];
  td__info("cuda:%d: context made; %s of memory, %s free, granularity %zu "
           "bytes, capacity %s%s",
           d->index, td__human_bytes(total, a, sizeof(a)),
           td__human_bytes(free_b, b, sizeof(b)), gran,
           td__human_bytes(d->capacity, e, sizeof(e)),
           !legacy  ? ""
           : forced ? "; " TD__CU_LEGACY_ENV "=1: storages are cuMemAlloc'd "
                      "and shared by legacy IPC handles (a test setting)"
           : !vmm   ? "; no virtual memory management: storages are "
                      "cuMemAlloc'd and shared by legacy IPC handles"
                    : "; no POSIX-fd handles: storages are cuMemAlloc'd and "
                      "shared by legacy IPC handles");
  return 0;
}

/* Takes a hold on d's primary context for a create (kept by the storage it
 * makes): the first hold retains it, after checking that the GPU's compute
 * mode lets a context be shared at all, and the first ever reads the
 * device. tensord holds a context only while it has storages on the GPU
 * (or is making one), so a GPU it no longer uses carries none of its
 * contexts. Called with init_mu held. Returns 0 or a negative code with
 * msg filled. */
static int dev_hold(dev *d, char *msg, size_t len) {
  char u[48], e[128];
  if (d->holds > 0) {
    d->holds++;
    return 0;
  }
  int mode = CU_COMPUTEMODE_DEFAULT;
  if (cu->DeviceGetAttribute(&mode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, d->cu) !=
      CUDA_SUCCESS)
    mode = CU_COMPUTEMODE_DEFAULT;
  if (mode == CU_COMPUTEMODE_PROHIBITED)
    return td__msg(msg, len, TD_ENODEV,
                   "cuda:%d (%s) is in PROHIBITED compute mode: no process "
                   "may use it",
                   d->index, td__cu_uuid_str(d->uuid, u, sizeof(u)));
  if (mode == CU_COMPUTEMODE_EXCLUSIVE_PROCESS)
    return td__msg(msg, len, TD_EBUSY,
                   "cuda:%d (%s) is in EXCLUSIVE_PROCESS compute mode: one "
                   "process at a time may use it, so its memory cannot be "
                   "shared between processes; tensord takes no context on "
                   "it, leaving the GPU to that one process (nvidia-smi -c "
                   "DEFAULT lets processes share it)",
                   d->index, td__cu_uuid_str(d->uuid, u, sizeof(u)));
  CUcontext ctx = NULL;
  CUresult r = cu->DevicePrimaryCtxRetain(&ctx, d->cu);
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r),
                   "cuda:%d: cuDevicePrimaryCtxRetain: %s", d->index,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  if (!d->opened) {
    int err = dev_read(d, ctx, msg, len);
    if (err < 0) {
      cu->DevicePrimaryCtxRelease(d->cu);
      return err;
    }
  }
  d->ctx = ctx;
  d->holds = 1;
  return 0;
}

/* Drops a hold dev_hold took; the last releases the context. */
static void dev_drop(dev *d) {
  pthread_mutex_lock(&init_mu);
  if (--d->holds == 0) {
    CUresult r = cu->DevicePrimaryCtxRelease(d->cu);
    d->ctx = NULL;
    if (r != CUDA_SUCCESS) {
      char e[128];
      td__error("cuda:%d: cuDevicePrimaryCtxRelease: %s", d->index,
                td__cu_strerror(cu, r, e, sizeof(e)));
    } else {
      td__debug("cuda:%d: no storage left: context released", d->index);
    }
  }
  pthread_mutex_unlock(&init_mu);
}

/* Runs cuMemRelease of h in d's context. Returns the driver's result. */
static CUresult release(const dev *d, CUmemGenericAllocationHandle h) {
  CUresult r = cu->CtxPushCurrent(d->ctx);
  if (r == CUDA_SUCCESS) {
    CUcontext popped;
    r = cu->MemRelease(h);
    cu->CtxPopCurrent(&popped);
  }
  return r;
}

/* Runs cuMemFree of p in d's context. Returns the driver's result. */
static CUresult mem_free(const dev *d, CUdeviceptr p) {
  CUresult r = cu->CtxPushCurrent(d->ctx);
  if (r == CUDA_SUCCESS) {
    CUcontext popped;
    r = cu->MemFree(p);
    cu->CtxPopCurrent(&popped);
  }
  return r;
}

/* ---- the recycling pool ----
 *
 * A freed storage's VMM allocation, seen by no uid but its owner's, waits
 * here for the next create of the same rounded size by that uid on that
 * GPU: no cuMemCreate, no export, and the same fd and allocation id, so a
 * client that kept its import (cumap.c) maps nothing anew. It keeps its
 * charge against the capacity and its hold on the context; a create that
 * would not fit beside the pool evicts the GPU's oldest entries first.
 * Bounded per GPU (pool_limit bytes, TD__CUDA_POOL_MAX entries), aged out
 * after pool_idle_ms by a thread of its own, all released at the stop.
 * Legacy (cuMemAlloc) allocations are never pooled. */

#define TD__CUDA_POOL_MAX 1024

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_init(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&pool_cv, &a);
  pthread_cond_init(&released_cv, &a);
  pthread_condattr_destroy(&a);
}

/* Takes m out of the pool, still charged. Called with mu held. */
static void pool_unlist(alloc *m) {
  if (m->prev != NULL)
    m->prev->next = m->next;
  else
    pool_oldest = m->next;
  if (m->next != NULL)
    m->next->prev = m->prev;
  else
    pool_newest = m->prev;
  m->prev = m->next = NULL;
  m->d->pool_bytes -= m->size;
  m->d->pool_count--;
}

/* Takes m out of the pool and its bytes off the capacity, and appends it
 * to the list whose end is *tail. Returns the new end. Called with mu
 * held. */
static alloc **pool_evict(alloc *m, alloc **tail) {
  pool_unlist(m);
  m->d->used -= m->size;
  *tail = m;
  return &m->next;
}

/* Evicts d's oldest pooled allocation onto *tail. Returns the new end, or
 * NULL if d has none. Called with mu held. */
static alloc **pool_evict_oldest(dev *d, alloc **tail) {
  for (alloc *m = pool_oldest; m != NULL; m = m->next)
    if (m->d == d)
      return pool_evict(m, tail);
  return NULL;
}

/* Releases the next-linked evicted allocations: their fds, their memory
 * and their holds on the context. Called without mu. */
static void pool_free(alloc *list) {
  for (alloc *m = list, *next; m != NULL; m = next) {
    next = m->next;
    close(m->fd);
    CUresult r = release(m->d, m->h);
    if (r != CUDA_SUCCESS) {
      char e[128];
      td__error("cuda:%d: cuMemRelease of pooled allocation %llu: %s",
                m->d->index, (unsigned long long)m->id,
                td__cu_strerror(cu, r, e, sizeof(e)));
    }
    dev_drop(m->d);
    free(m);
  }
}

/* The ageing thread: releases each pooled allocation idle for
 * pool_idle_ms, until the stop. */
static void *pool_ager(void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  while (!pool_stopping) {
    if (pool_oldest == NULL) {
      pthread_cond_wait(&pool_cv, &mu);
      continue;
    }
    int64_t now = mono_ms(), due = pool_oldest->since_ms + pool_idle_ms;
    if (now < due) {
      struct timespec ts = {.tv_sec = due / 1000,
                            .tv_nsec = (due % 1000) * 1000000};
      pthread_cond_timedwait(&pool_cv, &mu, &ts);
      continue;
    }
    alloc *idle = NULL, **tail = &idle;
    while (pool_oldest != NULL && now - pool_oldest->since_ms >= pool_idle_ms)
      tail = pool_evict(pool_oldest, tail);
    pthread_mutex_unlock(&mu);
    for (alloc *m = idle; m != NULL; m = m->next)
      td__debug("cuda:%d: pooled allocation %llu idle for %lld ms; released",
                m->d->index, (unsigned long long)m->id,
                (long long)(now - m->since_ms));
    pool_free(idle);
    pthread_mutex_lock(&mu);
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

/* Takes the newest pooled allocation of uid on d of exactly size bytes.
 * Returns it out of the pool, still charged, or NULL. Called with mu
 * held. */
static alloc *pool_take(dev *d, uid_t uid, uint64_t size) {
  for (alloc *m = pool_newest; m != NULL; m = m->prev)
    if (m->d == d && m->uid == uid && m->size == size) {
      pool_unlist(m);
      return m;
    }
  return NULL;
}

/* The legacy path: makes m's memory with cuMemAlloc in d's context and its
 * IPC handle into out. Returns the driver's result (nothing left behind on
 * failure) and what failed in *what. */
static CUresult legacy_make(const dev *d, alloc *m, td__created *out,
                            const char **what) {
  *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(d->ctx);
  if (r != CUDA_SUCCESS)
    return r;
  *what = "cuMemAlloc";
  r = cu->MemAlloc(&m->ptr, m->size);
  if (r == CUDA_SUCCESS) {
    CUipcMemHandle h;
    *what = "cuIpcGetMemHandle";
    r = cu->IpcGetMemHandle(&h, m->ptr);
    if (r == CUDA_SUCCESS)
      memcpy(out->ipc_handle, h.reserved, sizeof(out->ipc_handle));
    else
      cu->MemFree(m->ptr);
  }
  CUcontext popped;
  cu->CtxPopCurrent(&popped);
  return r;
}

_Static_assert(sizeof(CUipcMemHandle) == sizeof(((td__created *)0)->ipc_handle),
               "a legacy IPC handle is not 64 bytes");

/* The VMM path: makes m's memory with cuMemCreate in d's context and
 * exports it as a POSIX fd into m->fd. Returns the driver's result
 * (nothing left behind on failure) and what failed in *what. */
static CUresult vmm_make(const dev *d, alloc *m, uint64_t size,
                         const char **what) {
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = d->cu;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(d->ctx);
  if (r != CUDA_SUCCESS)
    return r;
  *what = "cuMemCreate";
  r = cu->MemCreate(&m->h, size, &prop, 0);
  if (r == CUDA_SUCCESS) {
    *what = "cuMemExportToShareableHandle";
    r = cu->MemExportToShareableHandle(
        &m->fd, m->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      cu->MemRelease(m->h);
      m->fd = -1;
    }
  }
  CUcontext popped;
  cu->CtxPopCurrent(&popped);
  return r;
}

/* Makes m's memory, size bytes, on d's path, once. */
static CUresult mem_make_once(const dev *d, alloc *m, uint64_t size,
                              td__created *out, const char **what) {
  return d->legacy ? legacy_make(d, m, out, what) : vmm_make(d, m, size, what);
}

/* Evicts every pooled allocation of d onto *gone, adding up *bytes and *n.
 * Called with mu held. */
static void pool_evict_all(dev *d, alloc **gone, uint64_t *bytes, uint64_t *n) {
  alloc **tail = gone, **t;
  while (*tail != NULL)
    tail = &(*tail)->next;
  while ((t = pool_evict_oldest(d, tail)) != NULL) {
    *bytes += (*tail)->size;
    (*n)++;
    tail = t;
  }
}

/* Makes m's memory, size bytes, on d's path. A GPU's memory is shared with
 * every process on it, so the driver may be out of memory well inside
 * --cuda-capacity: then the pool gives way (all of d's pooled allocations,
 * whatever their uid, are released) and the driver is asked again; and
 * with nothing pooled, a release queued before this create (which frees
 * its memory, or pools it, in a moment on another thread) is waited for,
 * up to RELEASE_WAIT_MS, before the create fails. */
static CUresult mem_make(dev *d, alloc *m, uint64_t size, td__created *out,
                         const char **what) {
  CUresult r = mem_make_once(d, m, size, out, what);
  int64_t deadline = mono_ms() + RELEASE_WAIT_MS;
  while (r == CUDA_ERROR_OUT_OF_MEMORY) {
    alloc *gone = NULL;
    uint64_t bytes = 0, n = 0;
    int waited = 0;
    pthread_mutex_lock(&mu);
    pool_evict_all(d, &gone, &bytes, &n);
    if (gone == NULL && d->releasing > 0 && mono_ms() < deadline) {
      struct timespec ts = {.tv_sec = deadline / 1000,
                            .tv_nsec = (deadline % 1000) * 1000000};
      pthread_cond_timedwait(&released_cv, &mu, &ts);
      waited = 1;
      pool_evict_all(d, &gone, &bytes, &n);
    }
    pthread_mutex_unlock(&mu);
    if (gone == NULL && !waited)
      break;
    if (gone != NULL) {
      td__info("cuda:%d: the GPU is out of memory: released %llu pooled "
               "allocation(s) (%llu bytes) and asked again",
               d->index, (unsigned long long)n, (unsigned long long)bytes);
      pool_free(gone);
    }
    r = mem_make_once(d, m, size, out, what);
  }
  return r;
}

/* For a driver's out-of-memory: "the GPU has 4 MiB free of 16 MiB, tensord
 * holding 8 MiB of it: other processes hold the rest" into buf. */
static const char *oom_detail(const dev *d, uint64_t charged, char *buf,
                              size_t len) {
  size_t free_b = 0, total = 0;
  CUresult r = cu->CtxPushCurrent(d->ctx);
  if (r == CUDA_SUCCESS) {
    r = cu->MemGetInfo(&free_b, &total);
    CUcontext popped;
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS) {
    snprintf(buf, len, "the GPU's free memory is unknown");
    return buf;
  }
  pthread_mutex_lock(&mu);
  uint64_t mine = d->used > charged ? d->used - charged : 0;
  pthread_mutex_unlock(&mu);
  char f[32], t[32], h[32];
  snprintf(buf, len,
           "the GPU has %s free of %s, tensord holding %s of it: other "
           "processes hold the rest",
           td__human_bytes(free_b, f, sizeof(f)),
           td__human_bytes(total, t, sizeof(t)),
           td__human_bytes(mine, h, sizeof(h)));
  return buf;
}

static void cuda_unlink(const char *name);

static int cuda_create_on(const char *name, const uint8_t uuid[16],
                          uint64_t nbytes, uid_t uid, td__created *out,
                          char *msg, size_t len) {
  char u[48], e[128], a[32], b[32], c[32];
  /* The lazy start: the driver, then the device's context. */
  pthread_mutex_lock(&init_mu);
  int err = load(msg, len);
  dev *d = NULL;
  for (size_t i = 0; err == 0 && i < ndevs && d == NULL; i++)
    if (memcmp(devs[i].uuid, uuid, 16) == 0)
      d = &devs[i];
  if (err == 0 && (d == NULL || !d->allowed))
    err = td__msg(msg, len, TD_ENODEV, "%s: %s",
                  td__cu_uuid_str(uuid, u, sizeof(u)),
                  d == NULL ? "no GPU of this tensord has that UUID"
                            : "that GPU is not in --cuda-devices");
  if (err == 0)
    err = dev_hold(d, msg, len);
  pthread_mutex_unlock(&init_mu);
  if (err < 0)
    return err;
  if (nbytes > UINT64_MAX - d->gran) {
    dev_drop(d);
    return td__msg(msg, len, TD_EINVAL, "%llu bytes: too large",
                   (unsigned long long)nbytes);
  }
  uint64_t size = (nbytes + d->gran - 1) / d->gran * d->gran;
  /* The capacity is charged before the driver is asked, so that creates in
   * flight count. A pooled allocation of this uid and size is charged
   * already; else the pool gives way first if a fresh one would not fit. */
  pthread_once(&pool_once, pool_init);
  pthread_mutex_lock(&mu);
  alloc *pooled = d->legacy ? NULL : pool_take(d, uid, size);
  alloc *gone = NULL, **tail = &gone, **t;
  /* Short of room that could be had: the pool gives way first; then a
   * release queued just before this create (a client releasing, then
   * creating, at the capacity), which frees its bytes or pools them in a
   * moment on another thread, is waited for rather than failed. */
  int64_t deadline = mono_ms() + RELEASE_WAIT_MS;
  while (pooled == NULL && size <= d->capacity &&
         d->used > d->capacity - size) {
    if ((t = pool_evict_oldest(d, tail)) != NULL) {
      tail = t;
      continue;
    }
    if (d->releasing == 0 || mono_ms() >= deadline)
      break;
    struct timespec ts = {.tv_sec = deadline / 1000,
                          .tv_nsec = (deadline % 1000) * 1000000};
    pthread_cond_timedwait(&released_cv, &mu, &ts);
    pooled = d->legacy ? NULL : pool_take(d, uid, size);
  }
  if (pooled != NULL) {
    d->pool_hits++;
    d->storages++;
    snprintf(pooled->name, sizeof(pooled->name), "%s", name);
    err = td__htab_insert(&allocs, &pooled->node,
                          td__hash_bytes(name, strlen(name)));
    if (err < 0) { /* no memory: it goes, and the create fails */
      d->storages--;
      pooled->d->used -= pooled->size;
      *tail = pooled;
      pooled = NULL;
      err = td__msg(msg, len, TD_ENOMEM, "out of memory");
    }
  } else {
    if (!d->legacy && d->pool_limit > 0)
      d->pool_misses++;
    while (size <= d->capacity && d->used > d->capacity - size &&
           (t = pool_evict_oldest(d, tail)) != NULL)
      tail = t;
  }
  if (err < 0 || pooled != NULL) {
    /* answered below */
  } else if (size > d->capacity || d->used > d->capacity - size) {
    uint64_t avail = d->used < d->capacity ? d->capacity - d->used : 0;
    err = td__msg(msg, len, TD_ENOMEM,
                  "%s (%llu bytes, %llu allocated) on cuda:%d (%s) exceeds "
                  "its capacity: %s free of %s (--cuda-capacity)",
                  td__human_bytes(nbytes, a, sizeof(a)),
                  (unsigned long long)nbytes, (unsigned long long)size,
                  d->index, td__cu_uuid_str(d->uuid, u, sizeof(u)),
                  td__human_bytes(avail, b, sizeof(b)),
                  td__human_bytes(d->capacity, c, sizeof(c)));
  } else {
    d->used += size;
    d->storages++;
  }
  pthread_mutex_unlock(&mu);
  pool_free(gone); /* before a fresh allocation needs their memory */
  if (pooled != NULL) {
    dev_drop(d); /* the pooled allocation holds the context already */
    int fd = fcntl(pooled->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      err = td__msg(msg, len, -errno, "dup of the exported fd: %s",
                    strerror(errno));
      cuda_unlink(name);
      return err;
    }
    out->alloc_size = size;
    out->alloc_id = pooled->id;
    out->reused = 1;
    return fd;
  }
  if (err < 0) {
    dev_drop(d);
    return err;
  }

  alloc *m = calloc(1, sizeof(*m));
  if (m == NULL) {
    err = td__msg(msg, len, TD_ENOMEM, "out of memory");
    goto uncharge;
  }
  m->fd = -1;
  m->size = size;
  const char *what;
  CUresult r = mem_make(d, m, size, out, &what);
  if (r != CUDA_SUCCESS) {
    char detail[160] = "";
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
      oom_detail(d, size, detail, sizeof(detail));
    err = td__msg(msg, len, td__cu_code(r),
                  "%s of %s (%llu bytes) on cuda:%d (%s): %s%s%s", what,
                  td__human_bytes(size, a, sizeof(a)), (unsigned long long)size,
                  d->index, td__cu_uuid_str(d->uuid, u, sizeof(u)),
                  td__cu_strerror(cu, r, e, sizeof(e)),
                  detail[0] != '\0' ? ": " : "", detail);
    free(m);
    goto uncharge;
  }
  if (d->legacy) {
    m->legacy = 1;
    snprintf(m->name, sizeof(m->name), "%s", name);
    m->d = d;
    pthread_mutex_lock(&mu);
    m->id = next_alloc_id++;
    err =
        td__htab_insert(&allocs, &m->node, td__hash_bytes(name, strlen(name)));
    pthread_mutex_unlock(&mu);
    if (err < 0) {
      mem_free(d, m->ptr);
      free(m);
      err = td__msg(msg, len, TD_ENOMEM, "out of memory");
      goto uncharge;
    }
    out->alloc_size = size;
    out->alloc_id = m->id;
    out->legacy = 1;
    return 0;
  }
  fcntl(m->fd, F_SETFD, FD_CLOEXEC);
  int fd = fcntl(m->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    err = td__msg(msg, len, -errno, "dup of the exported fd: %s",
                  strerror(errno));
    goto unmake;
  }
  snprintf(m->name, sizeof(m->name), "%s", name);
  m->d = d;
  m->size = size;
  pthread_mutex_lock(&mu);
  m->id = next_alloc_id++;
  err = td__htab_insert(&allocs, &m->node, td__hash_bytes(name, strlen(name)));
  pthread_mutex_unlock(&mu);
  if (err < 0) {
    close(fd);
    err = td__msg(msg, len, TD_ENOMEM, "out of memory");
    goto unmake;
  }
  out->alloc_size = size;
  out->alloc_id = m->id;
  return fd;

unmake:
  close(m->fd);
  release(d, m->h);
  free(m);
uncharge:
  pthread_mutex_lock(&mu);
  d->used -= size;
  d->storages--;
  pthread_mutex_unlock(&mu);
  dev_drop(d);
  return err;
}

static int cuda_open(const char *name, int readonly) {
  pthread_mutex_lock(&mu);
  alloc *m = alloc_find(name);
  /* A legacy allocation has no fd: its replies carry its IPC handle. */
  int fd = m == NULL   ? TD_ENOENT
           : m->legacy ? TD_ENOSYS
                       : fcntl(m->fd, F_DUPFD_CLOEXEC, 0);
  if (m != NULL && !m->legacy && fd < 0)
    fd = -errno;
  pthread_mutex_unlock(&mu);
  return fd;
}

/* m's queued release has happened (it is unlinked, or in the pool): a
 * create waiting for room may look again. Called with mu held. */
static void released(alloc *m) {
  if (!m->releasing)
    return;
  m->releasing = 0;
  m->d->releasing--;
  pthread_cond_broadcast(&released_cv);
}

static void cuda_releasing(const char *name) {
  pthread_mutex_lock(&mu);
  alloc *m = alloc_find(name);
  if (m != NULL && !m->releasing) {
    m->releasing = 1;
    m->d->releasing++;
  }
  pthread_mutex_unlock(&mu);
}

static void cuda_unlink(const char *name) {
  pthread_mutex_lock(&mu);
  alloc *m = alloc_find(name);
  if (m != NULL) {
    td__htab_remove(&allocs, &m->node);
    m->d->used -= m->size;
    m->d->storages--;
    released(m);
  }
  pthread_mutex_unlock(&mu);
  if (m == NULL)
    return;
  CUresult r;
  if (m->legacy) {
    /* Freed now, whoever still has it open (the driver's rule, and why
     * tensord frees only when the last reference goes). */
    r = mem_free(m->d, m->ptr);
  } else {
    close(m->fd);
    /* The memory goes when no process maps it any more. */
    r = release(m->d, m->h);
  }
  if (r != CUDA_SUCCESS) {
    char e[128];
    td__error("cuda:%d: %s of %s: %s", m->d->index,
              m->legacy ? "cuMemFree" : "cuMemRelease", name,
              td__cu_strerror(cu, r, e, sizeof(e)));
  }
  dev_drop(m->d); /* the storage's hold on the context */
  free(m);
}

static void cuda_retire(const char *name, uid_t uid) {
  pthread_once(&pool_once, pool_init);
  pthread_mutex_lock(&mu);
  alloc *m = alloc_find(name);
  dev *d = m ? m->d : NULL;
  int keep = m != NULL && !m->legacy && !pool_stopping && d->pool_limit > 0 &&
             m->size <= d->pool_limit;
  if (keep && !pool_thread_on) {
    if (pthread_create(&pool_thread, NULL, pool_ager, NULL) == 0)
      pool_thread_on = 1;
    else
      keep = 0;
  }
  if (!keep) {
    pthread_mutex_unlock(&mu);
    cuda_unlink(name);
    return;
  }
  td__htab_remove(&allocs, &m->node);
  d->storages--;
  released(m);
  m->uid = uid;
  m->since_ms = mono_ms();
  m->name[0] = '\0';
  m->next = NULL;
  m->prev = pool_newest;
  if (pool_newest != NULL)
    pool_newest->next = m;
  else
    pool_oldest = m;
  pool_newest = m;
  d->pool_bytes += m->size;
  d->pool_count++;
  alloc *gone = NULL, **tail = &gone, **t;
  while ((d->pool_bytes > d->pool_limit || d->pool_count > TD__CUDA_POOL_MAX) &&
         (t = pool_evict_oldest(d, tail)) != NULL)
    tail = t;
  td__debug("cuda:%d: %s's allocation %llu pooled (%llu allocation(s), "
            "%llu bytes)",
            d->index, name, (unsigned long long)m->id,
            (unsigned long long)d->pool_count,
            (unsigned long long)d->pool_bytes);
  pthread_cond_signal(&pool_cv);
  pthread_mutex_unlock(&mu);
  pool_free(gone);
}

void td__cuda_pool_drain(void) {
  pthread_once(&pool_once, pool_init);
  pthread_mutex_lock(&mu);
  pool_stopping = 1;
  alloc *all = NULL, **tail = &all;
  uint64_t n = 0;
  while (pool_oldest != NULL) {
    tail = pool_evict(pool_oldest, tail);
    n++;
  }
  int on = pool_thread_on;
  pool_thread_on = 0;
  pthread_cond_signal(&pool_cv);
  pthread_mutex_unlock(&mu);
  if (on)
    pthread_join(pool_thread, NULL);
  if (n > 0)
    td__info("cuda: releasing %llu pooled allocation(s)",
             (unsigned long long)n);
  pool_free(all);
}

size_t td__cuda_stats(td__cuda_stat *out, size_t max) {
  size_t n = 0;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < ndevs; i++) {
    if (!devs[i].allowed)
      continue;
    if (n < max) {
      out[n].index = devs[i].index;
      memcpy(out[n].uuid, devs[i].uuid, 16);
      out[n].mig = td__cu_uuid_is_mig(devs[i].uuid);
      out[n].bytes_used = devs[i].used - devs[i].pool_bytes;
      out[n].capacity = devs[i].capacity;
      out[n].storages = devs[i].storages;
      out[n].pool_bytes = devs[i].pool_bytes;
      out[n].pool_allocs = devs[i].pool_count;
      out[n].pool_limit = devs[i].pool_limit;
      out[n].pool_hits = devs[i].pool_hits;
      out[n].pool_misses = devs[i].pool_misses;
    }
    n++;
  }
  pthread_mutex_unlock(&mu);
  return n;
}

int td__cuda_is_mig(const uint8_t uuid[16]) {
  return td__cu_uuid_is_mig(uuid);
}

#else /* !TD_HAVE_CUDA */

static int cuda_create_on(const char *name, const uint8_t uuid[16],
                          uint64_t nbytes, uid_t uid, td__created *out,
                          char *msg, size_t len) {
  return td__msg(msg, len, TD_ENODEV, "this tensord was built without CUDA");
}

static int cuda_open(const char *name, int readonly) {
  return TD_ENODEV;
}

static void cuda_unlink(const char *name) {}

static void cuda_releasing(const char *name) {}

static void cuda_retire(const char *name, uid_t uid) {}

void td__cuda_pool_drain(void) {}

size_t td__cuda_stats(td__cuda_stat *out, size_t max) {
  return 0;
}

int td__cuda_is_mig(const uint8_t uuid[16]) {
  return 0;
}

#endif /* TD_HAVE_CUDA */

static int cuda_create(const char *name, uint64_t nbytes, char *msg,
                       size_t len) {
  return td__msg(msg, len, TD_EINVAL, "a CUDA storage needs its GPU's UUID");
}

/* Device memory dies with the daemon: nothing outlives it to unlink. */
static int cuda_unlink_prefix(const char *prefix, td__keep_fn keep, void *arg) {
  return 0;
}

static int cuda_space(uint64_t *free_bytes, uint64_t *total_bytes) {
  return TD_ENOSYS;
}

static int cuda_describe(const char *name, td__segment_desc *out, char *msg,
                         size_t len) {
  return td__msg(msg, len, TD_ENOENT,
                 "segment %s: device memory does not outlive tensord", name);
}

const td__backend td__cuda_backend = {
    .name = "cuda",
    .device = TD_CUDA,
    .create = cuda_create,
    .create_on = cuda_create_on,
    .open = cuda_open,
    .unlink = cuda_unlink,
    .releasing = cuda_releasing,
    .retire = cuda_retire, /* pooled here, not by segment.c's pool */
    .rename = NULL,
    .reuse = NULL,
    .unlink_prefix = cuda_unlink_prefix,
    .space = cuda_space,
    .describe = cuda_describe,
};

/* cumap.c: this process's side of CUDA storages: naming a GPU by its UUID,
 * and mapping the VMM allocation a daemon exported (import the fd, reserve
 * an address range, map, set access), undone in reverse order; or opening
 * the legacy IPC handle of a GPU without POSIX-fd handles, once per process
 * and allocation. The library's own device work (zeroing, td_copy) runs on
 * a private non-blocking stream per GPU and is waited for before a call
 * returns. */
#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if TD_HAVE_CUDA
#include "driver.h"
#include "kcopy.h"

/* The copy kernel's fatbin, built by nvcc (cuda/CMakeLists.txt); of length
 * 0 in a build without nvcc. */
extern const unsigned char td__kcopy_image[];
extern const size_t td__kcopy_image_len;
_Static_assert(TD_KCOPY_MAX_DIMS == TD_MAX_DIMS,
               "cuda/kcopy.h and tensord.h disagree on the dims");

/* One legacy IPC handle open in this process. A legacy handle opens once
 * per process (the driver counts a second open in the same context, but
 * not across contexts, and the test double refuses it): every mapping of
 * the allocation — read-write and read-only ones, of any client — shares
 * it, and the last to go closes it. */
typedef struct ipc_open {
  struct ipc_open *next;
  uint8_t handle[64];
  CUdeviceptr ptr;
  unsigned users;
} ipc_open;

static pthread_mutex_t ipc_mu = PTHREAD_MUTEX_INITIALIZER;
static ipc_open *ipc_opens; /* ipc_mu */

/* The library's stream on one GPU: its own non-blocking stream in the
 * primary context, so that its work neither waits for the application's
 * streams nor makes them wait (the legacy stream would do both, and is
 * forbidden while the application captures a CUDA graph), and it is
 * synchronised alone (never cuCtxSynchronize). Made at the first work on
 * that GPU; it lives while this process maps a storage there (each mapping
 * retains the context that owns the stream) and goes with the last. */
typedef struct lib_stream {
  struct lib_stream *next;
  CUdevice dev;
  CUstream s;     /* NULL until first needed */
  unsigned users; /* mappings on dev */
  /* The copy kernel's module in the primary context, unloaded with the
   * record (the application may keep the context alive): 0 not tried yet,
   * 1 loaded, -1 failed (no image, no binary for this GPU, ...),
   * remembered so that every td_copy after the first takes the staged path
   * at once. */
  int kstate;
  CUmodule kmod;
  CUfunction kfn;   /* the element walk */
  CUfunction ktile; /* the tiled kernel, NULL if the image lacks it */
  int sms;          /* multiprocessors, for the launch's grid */
} lib_stream;

static pthread_mutex_t stream_mu = PTHREAD_MUTEX_INITIALIZER;
static lib_stream *lib_streams; /* stream_mu */

struct td__cumap {
  const td__cu *cu;
  CUdevice dev;
  CUcontext ctx; /* the primary context, retained while mapped */
  CUdeviceptr ptr;
  size_t size;
  ipc_open *ipc;  /* a legacy handle's open, or NULL for a VMM mapping */
  lib_stream *ls; /* this GPU's library stream record */
  /* A VMM mapping's allocation, for a warm reuse: the daemon's identity of
   * it (alloc_id 0: none given, never kept warm) and the exported file it
   * was imported from. */
  uint64_t instance, alloc_id;
  dev_t st_dev;
  ino_t st_ino;
  int ro;
  uint32_t peers; /* devices (bits by ordinal) given access for peer copies */
};

/* Warm mappings. tensord keeps a freed VMM allocation in its pool for the
 * same uid's next create of that size, and sends it again with the same
 * alloc_id (never reused within a daemon instance) and the same exported
 * file. So a mapping whose last handle goes is kept here a moment, warm,
 * and a reference to the same allocation in the same mode takes it back:
 * no import, no address reserve, no map, no access change. The identity
 * alone is not trusted: the fd that comes with the new reference must be
 * the very file that was imported (st_dev, st_ino). Bounded: at most
 * TD__CUWARM_MAX mappings and TENSORD_CUDA_WARM_BYTES bytes (default
 * 1 GiB; 0 turns it off), none kept past TD__CUWARM_MS, checked at every
 * open and close. A warm mapping keeps the device memory alive (the driver
 * frees an allocation with its last mapping), so an allocation the daemon
 * has really released stays allocated that long at most while the process
 * uses libtensord. A forked child starts with none. */
#define TD__CUWARM_MAX 8
#define TD__CUWARM_MS 5000
#define TD__CUWARM_BYTES ((size_t)1 << 30)

typedef struct cuwarm {
  struct cuwarm *next; /* newest first */
  td__cumap *m;
  int64_t since_ms;
} cuwarm;

static pthread_mutex_t warm_mu = PTHREAD_MUTEX_INITIALIZER;
static cuwarm *cuwarms; /* warm_mu */
static size_t ncuwarm, cuwarm_bytes;
static size_t cuwarm_max = TD__CUWARM_BYTES;
static pthread_once_t warm_once = PTHREAD_ONCE_INIT;

/* This process's clients per daemon instance (warm_mu). */
typedef struct instance_users {
  struct instance_users *next;
  uint64_t instance;
  unsigned clients;
} instance_users;

static instance_users *instances; /* warm_mu */

static void warm_init(void) {
  const char *s = getenv("TENSORD_CUDA_WARM_BYTES");
  uint64_t v;
  if (s != NULL && strcmp(s, "off") == 0)
    cuwarm_max = 0;
  else if (s != NULL && *s != '\0' && td__parse_size(s, &v) == 0 &&
           v <= SIZE_MAX)
    cuwarm_max = (size_t)v;
}

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Loads the driver into *out. Returns 0, TD_EFORKED in a child of fork()
 * that inherited a loaded driver (td__cu_forked: the driver refuses the
 * child every call, so the library says why before it asks), or TD_ENODEV;
 * with msg saying why on failure. */
static int load(const td__cu **out, char *msg, size_t len) {
  char why[256];
  int err = td__cu_forked(msg, len);
  if (err < 0)
    return err;
  if ((*out = td__cu_load(why, sizeof(why))) == NULL)
    return td__msg(msg, len, TD_ENODEV, "%s", why);
  return 0;
}

/* 1 in a child of fork() that inherited the driver: nothing of the
 * parent's contexts, streams or mappings may be handed to the driver there
 * (every call fails), so releases only forget their bookkeeping. */
static int in_forked_child(void) {
  return td__cu_forked(NULL, 0) < 0;
}

/* A forked child has its parent's opens and streams in its address space
 * but may not use them (the driver allows a child nothing of its
 * parent's): it starts with none, as the mapping cache does. */
static void atfork_child(void) {
  pthread_mutex_init(&ipc_mu, NULL);
  ipc_opens = NULL;
  pthread_mutex_init(&stream_mu, NULL);
  lib_streams = NULL;
  pthread_mutex_init(&warm_mu, NULL);
  cuwarms = NULL; /* the parent's: left mapped, never used here */
  ncuwarm = cuwarm_bytes = 0;
  instances = NULL;
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_init(void) {
  pthread_atfork(NULL, NULL, atfork_child);
}

/* Counts m among the mappings on its GPU, for the library stream's life.
 * Returns 0 or TD_ENOMEM. */
static int stream_join(td__cumap *m) {
  pthread_once(&fork_once, fork_init);
  pthread_mutex_lock(&stream_mu);
  lib_stream *l = lib_streams;
  while (l != NULL && l->dev != m->dev)
    l = l->next;
  if (l == NULL && (l = calloc(1, sizeof(*l))) != NULL) {
    l->dev = m->dev;
    l->next = lib_streams;
    lib_streams = l;
  }
  if (l != NULL)
    l->users++;
  pthread_mutex_unlock(&stream_mu);
  m->ls = l;
  return l != NULL ? 0 : TD_ENOMEM;
}

/* Waits for the library's work on m's GPU, so that nothing it issued still
 * uses the memory when m is unmapped (neither cuMemUnmap nor
 * cuIpcCloseMemHandle waits for work in flight), and, for the GPU's last
 * mapping, destroys the stream. m's context is current. */
static void stream_leave(td__cumap *m) {
  lib_stream *l = m->ls;
  if (l == NULL)
    return;
  const td__cu *cu = m->cu;
  pthread_mutex_lock(&stream_mu);
  if (l->s != NULL)
    cu->StreamSynchronize(l->s);
  if (--l->users == 0) {
    if (l->s != NULL)
      cu->StreamDestroy(l->s);
    if (l->kmod != NULL && cu->ModuleUnload != NULL)
      cu->ModuleUnload(l->kmod);
    for (lib_stream **p = &lib_streams; *p != NULL; p = &(*p)->next)
      if (*p == l) {
        *p = l->next;
        break;
      }
    free(l);
  }
  pthread_mutex_unlock(&stream_mu);
  m->ls = NULL;
}

/* The library's stream on m's GPU, made if need be. m's context is
 * current. Returns the driver's result. */
static CUresult stream_get(td__cumap *m, CUstream *out) {
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&stream_mu);
  if (m->ls->s == NULL)
    r = m->cu->StreamCreate(&m->ls->s, CU_STREAM_NON_BLOCKING);
  *out = m->ls->s;
  pthread_mutex_unlock(&stream_mu);
  return r;
}

int td__cu_resolve(int64_t index, uint8_t uuid[16], char *msg, size_t len) {
  const td__cu *cu = NULL;
  int lerr = load(&cu, msg, len);
  if (lerr < 0)
    return lerr;
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

/* An event this process exported. The driver refuses to open a process's
 * own IPC handle (CUDA_ERROR_INVALID_CONTEXT), so a wait on a key this
 * process published with an event waits on the event itself. The last
 * OWN_EVENTS distinct handles are kept; an older one is refused as
 * before. */
#define OWN_EVENTS 64
typedef struct {
  uint8_t handle[64];
  CUevent ev;
  pid_t pid; /* a forked child's copy names its parent's events */
} own_event;

static pthread_mutex_t own_mu = PTHREAD_MUTEX_INITIALIZER;
static own_event own_events[OWN_EVENTS]; /* own_mu */
static unsigned own_next;                /* own_mu: the slot to fill next */

/* Remembers that this process exported ev as handle. */
static void own_add(const uint8_t handle[64], CUevent ev) {
  pid_t pid = getpid();
  pthread_mutex_lock(&own_mu);
  own_event *o = NULL;
  for (unsigned i = 0; i < OWN_EVENTS && o == NULL; i++)
    if (own_events[i].pid == pid &&
        memcmp(own_events[i].handle, handle, 64) == 0)
      o = &own_events[i];
  if (o == NULL)
    o = &own_events[own_next++ % OWN_EVENTS];
  memcpy(o->handle, handle, 64);
  o->ev = ev;
  o->pid = pid;
  pthread_mutex_unlock(&own_mu);
}

/* The event this process exported as handle, or NULL if none is known. */
static CUevent own_find(const uint8_t handle[64]) {
  pid_t pid = getpid();
  CUevent ev = NULL;
  pthread_mutex_lock(&own_mu);
  for (unsigned i = 0; i < OWN_EVENTS && ev == NULL; i++)
    if (own_events[i].pid == pid &&
        memcmp(own_events[i].handle, handle, 64) == 0)
      ev = own_events[i].ev;
  pthread_mutex_unlock(&own_mu);
  return ev;
}

int td__cuevent_export(void *event, uint8_t out[64], char *msg, size_t len) {
  const td__cu *cu = NULL;
  int lerr = load(&cu, msg, len);
  if (lerr < 0)
    return lerr;
  CUipcEventHandle h;
  char e[128];
  CUresult r = cu->IpcGetEventHandle(&h, (CUevent)event);
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r),
                   "cuIpcGetEventHandle: %s (the event must be made with "
                   "CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)",
                   td__cu_strerror(cu, r, e, sizeof(e)));
  _Static_assert(sizeof(h.reserved) == 64, "CUipcEventHandle is not 64 bytes");
  memcpy(out, h.reserved, 64);
  own_add(out, (CUevent)event);
  return 0;
}

int td__cuevent_wait(const uint8_t uuid[16], const uint8_t handle[64],
                     void *stream, char *msg, size_t len) {
  const td__cu *cu = NULL;
  int lerr = load(&cu, msg, len);
  if (lerr < 0)
    return lerr;
  char u[48], e[128];
  CUdevice dev;
  if (td__cu_device_by_uuid(cu, uuid, &dev) < 0)
    return td__msg(msg, len, TD_ENODEV,
                   "the storage is on GPU %s, which this process cannot see",
                   td__cu_uuid_str(uuid, u, sizeof(u)));
  CUcontext ctx, popped;
  const char *what = "cuDevicePrimaryCtxRetain";
  CUresult r = cu->DevicePrimaryCtxRetain(&ctx, dev);
  if (r != CUDA_SUCCESS)
    goto fail;
  what = "cuCtxPushCurrent";
  if ((r = cu->CtxPushCurrent(ctx)) == CUDA_SUCCESS) {
    CUipcEventHandle h;
    CUevent ev;
    memcpy(h.reserved, handle, 64);
    what = "cuIpcOpenEventHandle";
    CUevent own = NULL;
    r = cu->IpcOpenEventHandle(&ev, h);
    if (r == CUDA_ERROR_INVALID_CONTEXT && (own = own_find(handle)) != NULL) {
      ev = own; /* this process's own event: used as is, not destroyed */
      r = CUDA_SUCCESS;
    }
    if (r == CUDA_SUCCESS) {
      what = stream ? "cuStreamWaitEvent" : "cuEventSynchronize";
      r = stream ? cu->StreamWaitEvent((CUstream)stream, ev, 0)
                 : cu->EventSynchronize(ev);
      /* A stream's wait holds what it needs of the event. */
      if (own == NULL)
        cu->EventDestroy(ev);
    }
    cu->CtxPopCurrent(&popped);
  }
  cu->DevicePrimaryCtxRelease(dev);
  if (r == CUDA_SUCCESS)
    return 0;
fail:
  return td__msg(msg, len, td__cu_code(r), "%s on %s: %s", what,
                 td__cu_uuid_str(uuid, u, sizeof(u)),
                 td__cu_strerror(cu, r, e, sizeof(e)));
}

/* Undoes what td__cumap_open did, as far as it got. In a forked child the
 * mapping is the parent's: nothing is undone (the driver would refuse it),
 * and the caller frees the record. */
static void undo(td__cumap *m, int mapped, int reserved) {
  const td__cu *cu = m->cu;
  CUcontext popped;
  if (in_forked_child())
    return;
  if (m->ls != NULL && cu->CtxPushCurrent(m->ctx) == CUDA_SUCCESS) {
    stream_leave(m);
    cu->CtxPopCurrent(&popped);
  }
  if (m->ipc != NULL) {
    pthread_mutex_lock(&ipc_mu);
    ipc_open *o = m->ipc;
    if (--o->users == 0) {
      for (ipc_open **p = &ipc_opens; *p != NULL; p = &(*p)->next)
        if (*p == o) {
          *p = o->next;
          break;
        }
      if (cu->CtxPushCurrent(m->ctx) == CUDA_SUCCESS) {
        cu->IpcCloseMemHandle(o->ptr);
        cu->CtxPopCurrent(&popped);
      }
      free(o);
    }
    pthread_mutex_unlock(&ipc_mu);
    cu->DevicePrimaryCtxRelease(m->dev);
    return;
  }
  if (cu->CtxPushCurrent(m->ctx) == CUDA_SUCCESS) {
    if (mapped)
      cu->MemUnmap(m->ptr, m->size);
    if (reserved)
      cu->MemAddressFree(m->ptr, m->size);
    cu->CtxPopCurrent(&popped);
  }
  cu->DevicePrimaryCtxRelease(m->dev);
}

/* Takes off, onto *gone, the warm mappings past their time, then the
 * oldest while the bounds leave no room for one more of extra bytes (0:
 * none to add). Called with warm_mu held. */
static void warm_trim(size_t extra, cuwarm **gone) {
  int64_t now = mono_ms();
  for (;;) {
    cuwarm **p = &cuwarms, **last = NULL;
    for (cuwarm *w; (w = *p) != NULL; p = &w->next)
      last = p;
    if (last == NULL)
      return;
    cuwarm *w = *last; /* the oldest */
    if (now - w->since_ms < TD__CUWARM_MS &&
        (extra == 0 ||
         (ncuwarm < TD__CUWARM_MAX && cuwarm_bytes + extra <= cuwarm_max)))
      return;
    *last = NULL;
    ncuwarm--;
    cuwarm_bytes -= w->m->size;
    w->next = *gone;
    *gone = w;
  }
}

/* Unmaps the next-linked warm mappings and frees them. */
static void warm_free(cuwarm *list) {
  for (cuwarm *w = list, *next; w != NULL; w = next) {
    next = w->next;
    undo(w->m, 1, 1);
    free(w->m);
    free(w);
  }
}

/* Takes back the warm mapping of allocation alloc_id of instance, in mode
 * ro, of size bytes and imported from the file st names. Returns it, or
 * NULL. */
static td__cumap *warm_take(uint64_t instance, uint64_t alloc_id, int ro,
                            uint64_t size, const struct stat *st) {
  cuwarm *gone = NULL, *hit = NULL;
  pthread_once(&warm_once, warm_init);
  pthread_mutex_lock(&warm_mu);
  warm_trim(0, &gone);
  for (cuwarm **p = &cuwarms, *w; (w = *p) != NULL; p = &w->next) {
    const td__cumap *m = w->m;
    if (m->instance == instance && m->alloc_id == alloc_id && m->ro == ro &&
        m->size == size && m->st_dev == st->st_dev && m->st_ino == st->st_ino) {
      *p = w->next;
      ncuwarm--;
      cuwarm_bytes -= m->size;
      hit = w;
      break;
    }
  }
  pthread_mutex_unlock(&warm_mu);
  warm_free(gone);
  td__cumap *m = hit ? hit->m : NULL;
  free(hit);
  return m;
}

/* Keeps m warm if it may be. Returns 1 if it did (m is the cache's now),
 * else 0. */
static int warm_keep(td__cumap *m) {
  pthread_once(&warm_once, warm_init);
  if (m->ipc != NULL || m->alloc_id == 0 || m->size > cuwarm_max)
    return 0;
  cuwarm *w = malloc(sizeof(*w));
  if (w == NULL)
    return 0;
  /* The library's own work on the memory ends here, as before an unmap. */
  const td__cu *cu = m->cu;
  CUcontext popped;
  if (m->ls != NULL && cu->CtxPushCurrent(m->ctx) == CUDA_SUCCESS) {
    pthread_mutex_lock(&stream_mu);
    if (m->ls->s != NULL)
      cu->StreamSynchronize(m->ls->s);
    pthread_mutex_unlock(&stream_mu);
    cu->CtxPopCurrent(&popped);
  }
  cuwarm *gone = NULL;
  w->m = m;
  w->since_ms = mono_ms();
  pthread_mutex_lock(&warm_mu);
  warm_trim(m->size, &gone);
  w->next = cuwarms;
  cuwarms = w;
  ncuwarm++;
  cuwarm_bytes += m->size;
  pthread_mutex_unlock(&warm_mu);
  warm_free(gone);
  return 1;
}

void td__cumap_client_join(uint64_t instance) {
  pthread_once(&fork_once, fork_init);
  pthread_mutex_lock(&warm_mu);
  instance_users *u = instances;
  while (u != NULL && u->instance != instance)
    u = u->next;
  if (u == NULL && (u = calloc(1, sizeof(*u))) != NULL) {
    u->instance = instance;
    u->next = instances;
    instances = u;
  }
  if (u != NULL) /* else: its warm mappings go with any client's end */
    u->clients++;
  pthread_mutex_unlock(&warm_mu);
}

void td__cumap_client_leave(uint64_t instance) {
  cuwarm *gone = NULL;
  pthread_mutex_lock(&warm_mu);
  instance_users **up = &instances, *u;
  while ((u = *up) != NULL && u->instance != instance)
    up = &u->next;
  if (u != NULL && --u->clients > 0) {
    pthread_mutex_unlock(&warm_mu);
    return;
  }
  if (u != NULL) {
    *up = u->next;
    free(u);
  }
  for (cuwarm **p = &cuwarms, *w; (w = *p) != NULL;) {
    if (w->m->instance != instance) {
      p = &w->next;
      continue;
    }
    *p = w->next;
    ncuwarm--;
    cuwarm_bytes -= w->m->size;
    w->next = gone;
    gone = w;
  }
  pthread_mutex_unlock(&warm_mu);
  warm_free(gone);
}

/* Allocates a mapping record of size bytes on the GPU with uuid, which
 * this process must see. Returns 0, TD_ENOMEM or TD_ENODEV (with msg). */
static int cumap_new(const td__cu *cu, const uint8_t uuid[16], uint64_t size,
                     td__cumap **out, char *msg, size_t len) {
  td__cumap *m = calloc(1, sizeof(*m));
  if (m == NULL)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  m->cu = cu;
  m->size = size;
  if (td__cu_device_by_uuid(cu, uuid, &m->dev) < 0) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    char u[48];
    free(m);
    return td__msg(msg, len, TD_ENODEV,
                   "the storage is on GPU %s, which this process cannot "
                   "see%s%s%s",
                   td__cu_uuid_str(uuid, u, sizeof(u)),
                   vis ? " (CUDA_VISIBLE_DEVICES=" : "", vis ? vis : "",
                   vis ? ")" : "");
  }
  *out = m;
  return 0;
}

int td__cumap_open(uint64_t instance, uint64_t alloc_id, const uint8_t uuid[16],
                   int fd, uint64_t size, int ro, td__cumap **out, char *msg,
                   size_t len) {
  *out = NULL;
  const td__cu *cu = NULL;
  int lerr = load(&cu, msg, len);
  if (lerr < 0)
    return lerr;
  ro = ro != 0;
  struct stat st;
  int known = alloc_id != 0 && fstat(fd, &st) == 0;
  if (known && (*out = warm_take(instance, alloc_id, ro, size, &st)) != NULL)
    return 0;
  char u[48], e[128];
  td__cumap *m;
  int err = cumap_new(cu, uuid, size, &m, msg, len);
  if (err < 0)
    return err;
  if (known) {
    m->instance = instance;
    m->alloc_id = alloc_id;
    m->st_dev = st.st_dev;
    m->st_ino = st.st_ino;
  }
  m->ro = ro;
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
  /* The range must start on the granularity for cuMemMap to take it, and
   * an alignment of 0 promises nothing: ask for the granularity. */
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = m->dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  what = "cuMemGetAllocationGranularity";
  r = cu->MemGetAllocationGranularity(&gran, &prop,
                                      CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r == CUDA_SUCCESS) {
    what = "cuMemAddressReserve";
    r = cu->MemAddressReserve(&m->ptr, size, gran, 0, 0);
  }
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
  if (r == CUDA_SUCCESS && stream_join(m) < 0) {
    what = "a library stream record";
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
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

int td__cumap_open_ipc(const uint8_t uuid[16], const uint8_t handle[64],
                       uint64_t size, td__cumap **out, char *msg, size_t len) {
  *out = NULL;
  pthread_once(&fork_once, fork_init);
  const td__cu *cu = NULL;
  int lerr = load(&cu, msg, len);
  if (lerr < 0)
    return lerr;
  char u[48], e[128];
  td__cumap *m;
  int err = cumap_new(cu, uuid, size, &m, msg, len);
  if (err < 0)
    return err;
  CUresult r = cu->DevicePrimaryCtxRetain(&m->ctx, m->dev);
  if (r != CUDA_SUCCESS) {
    free(m);
    return td__msg(msg, len, td__cu_code(r),
                   "cuDevicePrimaryCtxRetain on %s: %s",
                   td__cu_uuid_str(uuid, u, sizeof(u)),
                   td__cu_strerror(cu, r, e, sizeof(e)));
  }
  pthread_mutex_lock(&ipc_mu);
  ipc_open *o = ipc_opens;
  while (o != NULL && memcmp(o->handle, handle, 64) != 0)
    o = o->next;
  if (o == NULL) {
    o = calloc(1, sizeof(*o));
    CUcontext popped;
    const char *what = "cuCtxPushCurrent";
    r = o == NULL ? CUDA_ERROR_OUT_OF_MEMORY : cu->CtxPushCurrent(m->ctx);
    if (r == CUDA_SUCCESS) {
      CUipcMemHandle h;
      memcpy(h.reserved, handle, 64);
      what = "cuIpcOpenMemHandle";
      r = cu->IpcOpenMemHandle(&o->ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      cu->CtxPopCurrent(&popped);
    }
    if (r != CUDA_SUCCESS) {
      pthread_mutex_unlock(&ipc_mu);
      free(o);
      cu->DevicePrimaryCtxRelease(m->dev);
      free(m);
      return td__msg(msg, len, td__cu_code(r), "%s of %llu bytes on %s: %s",
                     what, (unsigned long long)size,
                     td__cu_uuid_str(uuid, u, sizeof(u)),
                     td__cu_strerror(cu, r, e, sizeof(e)));
    }
    memcpy(o->handle, handle, 64);
    o->next = ipc_opens;
    ipc_opens = o;
  }
  o->users++;
  pthread_mutex_unlock(&ipc_mu);
  m->ipc = o;
  m->ptr = o->ptr;
  if (stream_join(m) < 0) {
    undo(m, 0, 0);
    free(m);
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  }
  *out = m;
  return 0;
}

void *td__cumap_addr(const td__cumap *m) {
  return (void *)(uintptr_t)m->ptr;
}

int td__cumap_index(const td__cumap *m) {
  return (int)m->dev; /* a CUdevice is the ordinal in this process */
}

int td__cumap_zero(td__cumap *m, size_t nbytes, char *msg, size_t len) {
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  const td__cu *cu = m->cu;
  CUcontext popped;
  CUstream s;
  char e[128];
  const char *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(m->ctx);
  if (r == CUDA_SUCCESS) {
    what = "cuStreamCreate";
    if ((r = stream_get(m, &s)) == CUDA_SUCCESS) {
      what = "cuMemsetD8Async";
      r = cu->MemsetD8Async(m->ptr, 0, nbytes, s);
      CUresult w = cu->StreamSynchronize(s);
      if (r == CUDA_SUCCESS && w != CUDA_SUCCESS) {
        what = "cuStreamSynchronize";
        r = w;
      }
    }
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "zeroing %zu bytes: %s: %s",
                   nbytes, what, td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

int td__cumap_copy(td__cumap *m, int to_device, size_t off, void *host,
                   size_t n, char *msg, size_t len) {
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  const td__cu *cu = m->cu;
  CUcontext popped;
  CUstream s;
  char e[128];
  const char *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(m->ctx);
  if (r == CUDA_SUCCESS) {
    what = "cuStreamCreate";
    if ((r = stream_get(m, &s)) == CUDA_SUCCESS) {
      what = to_device ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
      r = to_device ? cu->MemcpyHtoDAsync(m->ptr + off, host, n, s)
                    : cu->MemcpyDtoHAsync(host, m->ptr + off, n, s);
      /* Done when the device (or the host) holds the bytes. */
      CUresult w = cu->StreamSynchronize(s);
      if (r == CUDA_SUCCESS && w != CUDA_SUCCESS) {
        what = "cuStreamSynchronize";
        r = w;
      }
    }
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r), "%s of %zu bytes: %s", what, n,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

/* Fills one side of a 2D copy: device memory at off bytes into m, or host
 * memory at address off when m is NULL. */
static void side(const td__cumap *m, uintptr_t off, CUmemorytype *type,
                 CUdeviceptr *dev, const void **host) {
  if (m != NULL) {
    *type = CU_MEMORYTYPE_DEVICE;
    *dev = m->ptr + off;
  } else {
    *type = CU_MEMORYTYPE_HOST;
    *host = (const void *)off;
  }
}

int td__cumap_copy2d(td__cumap *dm, uintptr_t dst, size_t dpitch, td__cumap *sm,
                     uintptr_t src, size_t spitch, size_t width, size_t height,
                     char *msg, size_t len) {
  td__cumap *m = dm != NULL ? dm : sm;
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  const td__cu *cu = m->cu;
  CUDA_MEMCPY2D p;
  memset(&p, 0, sizeof(p));
  const void *dhost = NULL;
  side(dm, dst, &p.dstMemoryType, &p.dstDevice, &dhost);
  p.dstHost = (void *)dhost;
  p.dstPitch = dpitch;
  side(sm, src, &p.srcMemoryType, &p.srcDevice, &p.srcHost);
  p.srcPitch = spitch;
  p.WidthInBytes = width;
  p.Height = height;
  CUcontext popped;
  CUstream s;
  char e[128];
  const char *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(m->ctx);
  if (r == CUDA_SUCCESS) {
    what = "cuStreamCreate";
    if ((r = stream_get(m, &s)) == CUDA_SUCCESS) {
      what = "cuMemcpy2DAsync";
      r = cu->Memcpy2DAsync(&p, s);
    }
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r),
                   "%s of %zu rows of %zu bytes (pitches %zu, %zu): %s", what,
                   height, width, dpitch, spitch,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

int td__cumap_sync(td__cumap *m, char *msg, size_t len) {
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  const td__cu *cu = m->cu;
  CUcontext popped;
  CUstream s;
  char e[128];
  CUresult r = cu->CtxPushCurrent(m->ctx);
  if (r == CUDA_SUCCESS) {
    if ((r = stream_get(m, &s)) == CUDA_SUCCESS)
      r = cu->StreamSynchronize(s);
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r),
                   "cuStreamSynchronize (the library's copies): %s",
                   td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

/* 0 when TENSORD_CUDA_COPY_KERNEL=0 asks for the staged path (benchmarks
 * and tests compare the two), read at each copy so that a process may
 * switch. */
static int kernel_wanted(void) {
  const char *e = getenv("TENSORD_CUDA_COPY_KERNEL");
  return e == NULL || strcmp(e, "0") != 0;
}

/* The copy kernel on m's GPU, its module loaded at the first call (m's
 * context current). Returns 1 and sets *fn, or 0 if the kernel cannot run
 * here; a failure is kept for the life of the library stream record. */
static int kernel_get(td__cumap *m, CUfunction *fn, CUfunction *tiled,
                      int *sms) {
  const td__cu *cu = m->cu;
  lib_stream *l = m->ls;
  pthread_mutex_lock(&stream_mu);
  if (l->kstate == 0) {
    l->kstate = -1;
    if (td__kcopy_image_len > 0 && cu->ModuleLoadData != NULL &&
        cu->ModuleGetFunction != NULL && cu->LaunchKernel != NULL &&
        cu->ModuleLoadData(&l->kmod, td__kcopy_image) == CUDA_SUCCESS &&
        cu->ModuleGetFunction(&l->kfn, l->kmod, TD_KCOPY_NAME) ==
            CUDA_SUCCESS) {
      l->kstate = 1;
      if (cu->ModuleGetFunction(&l->ktile, l->kmod, TD_KCOPY_TILED_NAME) !=
          CUDA_SUCCESS)
        l->ktile = NULL;
      if (cu->DeviceGetAttribute(&l->sms,
                                 CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                 m->dev) != CUDA_SUCCESS ||
          l->sms <= 0)
        l->sms = 32;
    }
  }
  *fn = l->kfn;
  *tiled = l->ktile;
  *sms = l->sms;
  int ok = l->kstate == 1;
  pthread_mutex_unlock(&stream_mu);
  return ok;
}

int td__cumap_kcopy(td__cumap *dm, size_t doff, td__cumap *sm, size_t soff,
                    int nd, const int64_t *size, const int64_t *ds,
                    const int64_t *ss, size_t es, int64_t numel, int tile,
                    char *msg, size_t len) {
  const td__cu *cu = dm->cu;
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  if (!kernel_wanted() || nd > TD_KCOPY_MAX_DIMS || es > INT32_MAX ||
      numel <= 0)
    return 1;
  td_kcopy p;
  memset(&p, 0, sizeof(p));
  p.nd = nd;
  p.es = (int32_t)es;
  p.tile = -1;
  p.numel = numel;
  p.dst = dm->ptr + doff;
  p.src = sm->ptr + soff;
  for (int i = 0; i < nd; i++) {
    p.size[i] = size[i];
    p.ds[i] = ds[i];
    p.ss[i] = ss[i];
  }
  CUcontext popped;
  CUstream s;
  CUfunction fn, tiled;
  int sms;
  char e[128];
  const char *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(dm->ctx);
  if (r != CUDA_SUCCESS)
    goto fail;
  if (!kernel_get(dm, &fn, &tiled, &sms)) {
    cu->CtxPopCurrent(&popped);
    return 1;
  }
  what = "cuStreamCreate";
  if ((r = stream_get(dm, &s)) == CUDA_SUCCESS) {
    void *args[] = {&p};
    if (tiled != NULL && tile >= 0 && tile < nd - 1 && es <= 16 &&
        (es & (es - 1)) == 0) {
      /* A transpose: tiles of (tile dim, innermost dim) over x and y,
       * the other dims over z, each grid-stride within the driver's
       * limits. */
      p.tile = tile;
      int64_t gx = (size[nd - 1] + TD_KCOPY_TILE - 1) / TD_KCOPY_TILE;
      int64_t gy = (size[tile] + TD_KCOPY_TILE - 1) / TD_KCOPY_TILE;
      int64_t gz = numel / (size[nd - 1] * size[tile]);
      gx = gx > INT32_MAX ? INT32_MAX : gx;
      gy = gy > 65535 ? 65535 : gy;
      gz = gz > 65535 ? 65535 : gz;
      what = "cuLaunchKernel " TD_KCOPY_TILED_NAME;
      r = cu->LaunchKernel(tiled, (unsigned)gx, (unsigned)gy, (unsigned)gz,
                           TD_KCOPY_TILE, TD_KCOPY_ROWS, 1, 0, s, args, NULL);
    } else {
      /* Grid-stride: enough blocks to fill every multiprocessor a few
       * times over, fewer for a small copy. */
      int64_t blocks = (numel + 255) / 256, cap = (int64_t)sms * 8;
      if (blocks > cap)
        blocks = cap;
      what = "cuLaunchKernel " TD_KCOPY_NAME;
      r = cu->LaunchKernel(fn, (unsigned)blocks, 1, 1, 256, 1, 1, 0, s, args,
                           NULL);
    }
    /* Done when the stream is; a fault in the kernel shows here. */
    CUresult w = cu->StreamSynchronize(s);
    if (r == CUDA_SUCCESS && w != CUDA_SUCCESS) {
      what = "cuStreamSynchronize after " TD_KCOPY_NAME;
      r = w;
    }
  }
  cu->CtxPopCurrent(&popped);
  if (r == CUDA_SUCCESS)
    return 0;
fail:
  return td__msg(
      msg, len, TD_EIO, "%s (%lld elements of %zu bytes, %d dims): %s", what,
      (long long)numel, es, nd, td__cu_strerror(cu, r, e, sizeof(e)));
}

/* Gives device peer access to VMM mapping m (its own device keeps its
 * own), once per mapping and device: a VMM mapping is reachable only by the
 * devices cuMemSetAccess named, and a peer copy between GPUs that reach
 * each other is one GPU's DMA into or out of the other's memory. Legacy
 * memory needs none (opened with LAZY_ENABLE_PEER_ACCESS). A current
 * context is needed. */
static CUresult peer_grant(td__cumap *m, CUdevice peer) {
  if (m->ipc != NULL || peer < 0 || peer >= 32 || (m->peers & (1u << peer)))
    return CUDA_SUCCESS;
  CUmemAccessDesc a[2];
  memset(a, 0, sizeof(a));
  a[0].location.type = a[1].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a[0].location.id = m->dev;
  a[1].location.id = peer;
  a[0].flags = a[1].flags = m->ro ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                  : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = m->cu->MemSetAccess(m->ptr, m->size, a, 2);
  if (r == CUDA_SUCCESS)
    m->peers |= 1u << peer;
  return r;
}

int td__cumap_reach(td__cumap *dm, td__cumap *sm) {
  const td__cu *cu = dm->cu;
  if (td__cu_forked(NULL, 0) < 0)
    return -1;
  int can = 0;
  if (cu->DeviceCanAccessPeer == NULL ||
      cu->DeviceCanAccessPeer(&can, dm->dev, sm->dev) != CUDA_SUCCESS || !can)
    return 0;
  CUcontext popped;
  CUresult g = cu->CtxPushCurrent(dm->ctx);
  if (g == CUDA_SUCCESS) {
    g = peer_grant(sm, dm->dev);
    if (g == CUDA_SUCCESS)
      g = peer_grant(dm, sm->dev);
    cu->CtxPopCurrent(&popped);
  }
  return g == CUDA_SUCCESS ? 1 : -1;
}

int td__cumap_peer(td__cumap *dm, size_t doff, td__cumap *sm, size_t soff,
                   size_t n, char *msg, size_t len) {
  const td__cu *cu = dm->cu;
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  if (cu->MemcpyPeerAsync == NULL)
    return 1;
  /* GPUs that reach each other copy directly: each mapping must let the
   * other GPU in, or the staged path copies instead. Where they do not
   * reach each other, the driver stages the copy through the host with
   * each GPU's own engine, which needs no access. */
  if (td__cumap_reach(dm, sm) < 0)
    return 1;
  CUcontext popped;
  CUstream s;
  char e[128];
  const char *what = "cuCtxPushCurrent";
  CUresult r = cu->CtxPushCurrent(dm->ctx);
  if (r == CUDA_SUCCESS) {
    what = "cuStreamCreate";
    if ((r = stream_get(dm, &s)) == CUDA_SUCCESS) {
      /* The driver copies directly where the GPUs can reach each other
       * (NVLink, PCIe P2P) and stages through the host where not: either
       * way one call. */
      r = cu->MemcpyPeerAsync(dm->ptr + doff, dm->ctx, sm->ptr + soff, sm->ctx,
                              n, s);
      if (r != CUDA_SUCCESS) {
        /* Refused at the call (nothing issued): a pair of GPUs, or
         * mappings, the driver will not copy between. The staged path
         * still can. */
        cu->CtxPopCurrent(&popped);
        return 1;
      }
      CUresult w = cu->StreamSynchronize(s);
      if (w != CUDA_SUCCESS) {
        what = "cuStreamSynchronize after cuMemcpyPeerAsync";
        r = w;
      }
    }
    cu->CtxPopCurrent(&popped);
  }
  if (r != CUDA_SUCCESS)
    return td__msg(msg, len, td__cu_code(r) == TD_ENOMEM ? TD_ENOMEM : TD_EIO,
                   "%s of %zu bytes from GPU %d to GPU %d: %s", what, n,
                   (int)sm->dev, (int)dm->dev,
                   td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

/* A pinned staging buffer cut into slots, each with a stream of its own:
 * a slot is filled on the host, its bytes copied to the device
 * asynchronously on its stream, and the slot given out again only after
 * that stream is synchronised. Slots go round in order (a queue), so the
 * one given out is the one whose copy was issued longest ago. */
struct td__custage {
  const td__cu *cu;
  CUcontext ctx; /* the destination's primary context (not retained here:
                    the mappings written to hold it) */
  uint8_t *buf;
  size_t slot;
  unsigned nslots;
  CUstream *streams;
  uint8_t *busy;  /* per slot: a copy issued and not yet synchronised */
  unsigned *ring; /* free slots, head first */
  unsigned head, count;
  pthread_mutex_t mu;
  pthread_cond_t cv;
};

/* Synchronises slot i's stream if a copy is outstanding. */
static CUresult slot_sync(td__custage *g, unsigned i) {
  if (!g->busy[i])
    return CUDA_SUCCESS;
  CUcontext popped;
  CUresult r = g->cu->CtxPushCurrent(g->ctx);
  if (r == CUDA_SUCCESS) {
    r = g->cu->StreamSynchronize(g->streams[i]);
    g->cu->CtxPopCurrent(&popped);
  }
  g->busy[i] = 0;
  return r;
}

int td__custage_open(td__cumap *m, size_t slot, unsigned nslots,
                     td__custage **out, char *msg, size_t len) {
  *out = NULL;
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  const td__cu *cu = m->cu;
  char e[128];
  const char *what = "out of memory";
  CUresult r = CUDA_SUCCESS;
  unsigned made = 0;
  td__custage *g = calloc(1, sizeof(*g));
  if (g == NULL || nslots == 0 || slot > SIZE_MAX / nslots)
    goto fail_nomem;
  g->cu = cu;
  g->ctx = m->ctx;
  g->slot = slot;
  g->nslots = nslots;
  g->streams = calloc(nslots, sizeof(*g->streams));
  g->busy = calloc(nslots, 1);
  g->ring = calloc(nslots, sizeof(*g->ring));
  if (g->streams == NULL || g->busy == NULL || g->ring == NULL)
    goto fail_nomem;
  CUcontext popped;
  what = "cuCtxPushCurrent";
  if ((r = cu->CtxPushCurrent(g->ctx)) != CUDA_SUCCESS)
    goto fail;
  what = "cuMemHostAlloc";
  r = cu->MemHostAlloc((void **)&g->buf, slot * nslots, 0);
  what = "cuStreamCreate";
  for (; r == CUDA_SUCCESS && made < nslots; made++)
    r = cu->StreamCreate(&g->streams[made], CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    if (made > 0)
      made--; /* the last create failed */
    for (unsigned i = 0; i < made; i++)
      cu->StreamDestroy(g->streams[i]);
    if (g->buf != NULL)
      cu->MemFreeHost(g->buf);
  }
  cu->CtxPopCurrent(&popped);
  if (r != CUDA_SUCCESS)
    goto fail;
  for (unsigned i = 0; i < nslots; i++)
    g->ring[i] = i;
  g->count = nslots;
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  *out = g;
  return 0;
fail:
  td__msg(msg, len, td__cu_code(r), "%s for %u staging slots of %zu bytes: %s",
          what, nslots, slot, td__cu_strerror(cu, r, e, sizeof(e)));
  goto out;
fail_nomem:
  td__msg(msg, len, TD_ENOMEM, "staging: out of memory");
  r = CUDA_ERROR_OUT_OF_MEMORY;
out:
  if (g != NULL) {
    free(g->streams);
    free(g->busy);
    free(g->ring);
    free(g);
  }
  return r == CUDA_ERROR_OUT_OF_MEMORY ? TD_ENOMEM : td__cu_code(r);
}

size_t td__custage_slot(const td__custage *g) {
  return g->slot;
}

int td__custage_take(td__custage *g, unsigned *slot, void **host, char *msg,
                     size_t len) {
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0)
    return ferr;
  pthread_mutex_lock(&g->mu);
  while (g->count == 0)
    pthread_cond_wait(&g->cv, &g->mu);
  unsigned i = g->ring[g->head];
  g->head = (g->head + 1) % g->nslots;
  g->count--;
  pthread_mutex_unlock(&g->mu);
  /* The slot is this thread's now: its stream is nobody else's. */
  CUresult r = slot_sync(g, i);
  if (r != CUDA_SUCCESS) {
    char e[128];
    td__custage_put(g, i, NULL, 0, 0, NULL, 0);
    return td__msg(msg, len, td__cu_code(r),
                   "cuStreamSynchronize (a staged copy to the device): %s",
                   td__cu_strerror(g->cu, r, e, sizeof(e)));
  }
  *slot = i;
  *host = g->buf + (size_t)i * g->slot;
  return 0;
}

int td__custage_put(td__custage *g, unsigned slot, td__cumap *dst, size_t off,
                    size_t n, char *msg, size_t len) {
  CUresult r = CUDA_SUCCESS;
  int ferr = dst != NULL && n > 0 ? td__cu_forked(msg, len) : 0;
  if (ferr == 0 && dst != NULL && n > 0) {
    CUcontext popped;
    if ((r = g->cu->CtxPushCurrent(g->ctx)) == CUDA_SUCCESS) {
      r = g->cu->MemcpyHtoDAsync(
          dst->ptr + off, g->buf + (size_t)slot * g->slot, n, g->streams[slot]);
      g->cu->CtxPopCurrent(&popped);
    }
    g->busy[slot] = r == CUDA_SUCCESS;
  }
  pthread_mutex_lock(&g->mu);
  g->ring[(g->head + g->count) % g->nslots] = slot;
  g->count++;
  pthread_cond_signal(&g->cv);
  pthread_mutex_unlock(&g->mu);
  if (ferr < 0)
    return ferr;
  if (r != CUDA_SUCCESS) {
    char e[128];
    return td__msg(msg, len, td__cu_code(r),
                   "cuMemcpyHtoDAsync of %zu bytes at byte %zu: %s", n, off,
                   td__cu_strerror(g->cu, r, e, sizeof(e)));
  }
  return 0;
}

int td__custage_close(td__custage *g, char *msg, size_t len) {
  if (g == NULL)
    return 0;
  const td__cu *cu = g->cu;
  CUresult first = CUDA_SUCCESS;
  int ferr = td__cu_forked(msg, len);
  if (ferr < 0) {
    /* The parent's buffer and streams: forgotten, never handed back. */
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g->streams);
    free(g->busy);
    free(g->ring);
    free(g);
    return ferr;
  }
  for (unsigned i = 0; i < g->nslots; i++) {
    CUresult r = slot_sync(g, i);
    if (first == CUDA_SUCCESS)
      first = r;
  }
  CUcontext popped;
  if (cu->CtxPushCurrent(g->ctx) == CUDA_SUCCESS) {
    for (unsigned i = 0; i < g->nslots; i++)
      cu->StreamDestroy(g->streams[i]);
    cu->MemFreeHost(g->buf);
    cu->CtxPopCurrent(&popped);
  }
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
  free(g->streams);
  free(g->busy);
  free(g->ring);
  free(g);
  if (first != CUDA_SUCCESS) {
    char e[128];
    return td__msg(msg, len, td__cu_code(first),
                   "cuStreamSynchronize (a staged copy to the device): %s",
                   td__cu_strerror(cu, first, e, sizeof(e)));
  }
  return 0;
}

void td__cumap_close(td__cumap *m) {
  if (m == NULL)
    return;
  if (in_forked_child()) {
    /* Inherited: the driver allows the child neither to keep nor to
     * unmap it. The bookkeeping goes; the address range stays as fork()
     * left it, until exit or exec. */
    free(m);
    return;
  }
  if (warm_keep(m))
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

int td__cuevent_export(void *event, uint8_t out[64], char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__cuevent_wait(const uint8_t uuid[16], const uint8_t handle[64],
                     void *stream, char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__cumap_open(uint64_t instance, uint64_t alloc_id, const uint8_t uuid[16],
                   int fd, uint64_t size, int ro, td__cumap **out, char *msg,
                   size_t len) {
  *out = NULL;
  return no_cuda(msg, len);
}

int td__cumap_open_ipc(const uint8_t uuid[16], const uint8_t handle[64],
                       uint64_t size, td__cumap **out, char *msg, size_t len) {
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

int td__cumap_copy2d(td__cumap *dm, uintptr_t dst, size_t dpitch, td__cumap *sm,
                     uintptr_t src, size_t spitch, size_t width, size_t height,
                     char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__cumap_sync(td__cumap *m, char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__cumap_kcopy(td__cumap *dm, size_t doff, td__cumap *sm, size_t soff,
                    int nd, const int64_t *size, const int64_t *ds,
                    const int64_t *ss, size_t es, int64_t numel, int tile,
                    char *msg, size_t len) {
  return 1;
}

int td__cumap_reach(td__cumap *dm, td__cumap *sm) {
  return 0;
}

int td__cumap_peer(td__cumap *dm, size_t doff, td__cumap *sm, size_t soff,
                   size_t n, char *msg, size_t len) {
  return 1;
}

void td__cumap_close(td__cumap *m) {}

void td__cumap_client_join(uint64_t instance) {}

void td__cumap_client_leave(uint64_t instance) {}

int td__custage_open(td__cumap *m, size_t slot, unsigned nslots,
                     td__custage **out, char *msg, size_t len) {
  *out = NULL;
  return no_cuda(msg, len);
}

size_t td__custage_slot(const td__custage *g) {
  return 0;
}

int td__custage_take(td__custage *g, unsigned *slot, void **host, char *msg,
                     size_t len) {
  return no_cuda(msg, len);
}

int td__custage_put(td__custage *g, unsigned slot, td__cumap *dst, size_t off,
                    size_t n, char *msg, size_t len) {
  return no_cuda(msg, len);
}

int td__custage_close(td__custage *g, char *msg, size_t len) {
  return 0;
}

#endif /* TD_HAVE_CUDA */

/* cache.c: the process's mappings of storages, keyed by (daemon instance,
 * storage id, mode), so a storage the process already holds is never mapped
 * twice, and a mapping goes with the process's last handle on it. */
#include "internal.h"

#include "htab.h"
#include "hugepages.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Mappings of at least this many bytes are populated (MADV_POPULATE_WRITE /
 * _READ at the first td_storage_data, the same work as MAP_POPULATE): one
 * call maps every page instead of a fault per page (per 16 pages for reads,
 * which the kernel's fault-around batches). Measured with bench_populate (run
 * by `make bench`; here `TD_BENCH_SCALE=0.25 build/tests/bench/bench_populate`,
 * then 0.5: two runs on 2 shared, busy CPUs, 4 KiB pages), median us of
 * mmap + touch every byte + munmap, plain -> populated, run 1 / run 2:
 *   write, existing pages  16 KiB 54 -> 34 / 56 -> 34; 256 KiB 621 -> 264 /
 *                          921 -> 439; 1 MiB 2498 -> 852 / 3902 -> 2102;
 *                          256 MiB 908 -> 446 ms / 1294 -> 590 ms
 *   write, fresh pages     16 KiB 54 -> 36 / 55 -> 36; 1 MiB 2540 -> 1277 /
 *                          4156 -> 2140
 *   read, existing pages   16 KiB 32 -> 27 / 32 -> 27; 64 KiB 73 -> 69 /
 *                          476 -> 503; 256 KiB 107 -> 84 / 184 -> 162;
 *                          1 MiB 411 -> 264 / 599 -> 477; 4 MiB 2080 -> 1420
 *                          / 6494 -> 3932; 64 and 256 MiB within +-15%
 *   read, fresh pages      x0.2 .. x0.5 from 16 KiB up
 *   populate alone (a reader that touches one element), existing pages:
 *                          4 KiB 4 -> 8; 64 KiB 4 -> 45 / 51; 1 MiB 5 -> 82 /
 *                          97; 256 MiB 0.04 -> 12 / 15 ms
 * MADV_POPULATE_WRITE / _READ cost what MAP_POPULATE costs (64 MiB of
 * existing pages, 5 rounds: 2.6-5.1 ms to populate either way, 100-115 ms
 * with the memset; read-only 2.4-3.3 ms, 43-46 ms with the sum).
 * A writer (a creator fills what it creates) gains from 16 KiB up, by a
 * third to a half. A reader gains less, and below 256 KiB nothing clear,
 * while one that reads a single element pays the populate of every page it
 * never touches: so read-only mappings populate from 256 KiB.
 * TENSORD_POPULATE_MIN (bytes, K/M/G suffixes; 0: always; "off": never)
 * overrides both, for experiments. */
#define TD__POPULATE_MIN_RW ((size_t)16 << 10)
#define TD__POPULATE_MIN_RO ((size_t)256 << 10)
/* Where /dev/shm gives huge pages only on request (huge=advise), mappings of
 * at least one huge page are madvised MADV_HUGEPAGE. */
#define TD__HUGE_MIN ((size_t)2 << 20)

/* Warm mappings. tensord recycles a freed segment for the next storage of
 * the same uid, and the segment keeps its inode; so when a process lets go
 * of a big mapping it keeps it a moment, warm, and a new handle on the same
 * inode in the same mode takes it back: no mmap, no populate, no munmap,
 * and no first touch of each page through new page-table entries, which
 * costs more than the populate itself (64 MiB, this VM: memset through a
 * fresh populated mapping 115 ms, through one already used 4 ms). Bounded:
 * at most TD__WARM_MAX mappings and TENSORD_WARM_BYTES bytes (default
 * 1 GiB; 0 turns it off), none kept past TD__WARM_MS, and those checked at
 * every acquire and release: a warm mapping pins pages the daemon may
 * already have unlinked, for that long at most while the process uses
 * libtensord. */
#define TD__WARM_MIN ((size_t)1 << 20)
#define TD__WARM_MAX 8
#define TD__WARM_MS 5000
#define TD__WARM_BYTES ((size_t)1 << 30)

struct td__mapping {
  td__hnode node;
  uint64_t instance, id;
  int mode; /* TD__MAP_RW, _RO or _COW */
  void *addr;
  size_t len;
  uint64_t handles;
  atomic_int populate; /* still to be populated, at the first td__map_addr */
  int deferred;        /* a TD_LAZY acquire skipped the populate it was due */
  dev_t dev;           /* the segment's inode, for a warm reuse (len >= */
  ino_t ino;           /* TD__WARM_MIN; ino 0: unknown) */
  td__cumap *cu;       /* a CUDA storage's mapping (addr is its pointer) */
};

typedef struct warm {
  struct warm *next; /* newest first */
  dev_t dev;
  ino_t ino;
  int mode; /* TD__MAP_RW or _RO: copy-on-write mappings are never kept */
  int populate;
  void *addr;
  size_t len;
  int64_t since_ms;
} warm;

static void *warm_take(dev_t dev, ino_t ino, int mode, size_t len,
                       int *populate);

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

typedef struct mkey {
  uint64_t instance, id;
  int mode;
} mkey;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static td__htab maps;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static size_t populate_rw = TD__POPULATE_MIN_RW;
static size_t populate_ro = TD__POPULATE_MIN_RO;
static warm *warms;
static size_t nwarm, warm_bytes;
static size_t warm_max = TD__WARM_BYTES;
/* /dev/shm is huge=advise and TENSORD_HUGE_PAGES is not "off". */
static int huge_advise;

/* Returns the bytes environment variable name asks for ("0", "64K", "1M";
 * "off": SIZE_MAX), or dflt when it is unset or not understood. */
static size_t size_env(const char *name, size_t dflt) {
  const char *s = getenv(name);
  uint64_t v;
  if (s == NULL || *s == '\0')
    return dflt;
  if (strcmp(s, "off") == 0)
    return SIZE_MAX;
  return td__parse_size(s, &v) == 0 && v <= SIZE_MAX ? (size_t)v : dflt;
}

/* A forked child inherits the mappings but not the handles that own them
 * (those belong to the parent's connections): start it with an empty cache.
 * The inherited mappings stay valid until the child exits. */
static void atfork_child(void) {
  pthread_mutex_init(&mu, NULL);
  td__htab_init(&maps);
  warms = NULL; /* the parent's to use: left mapped, as the others */
  nwarm = warm_bytes = 0;
}

static void cache_init(void) {
  td__htab_init(&maps);
  pthread_atfork(NULL, NULL, atfork_child);
  populate_rw = size_env("TENSORD_POPULATE_MIN", TD__POPULATE_MIN_RW);
  populate_ro = size_env("TENSORD_POPULATE_MIN", TD__POPULATE_MIN_RO);
  warm_max = size_env("TENSORD_WARM_BYTES", TD__WARM_BYTES);
  if (warm_max == SIZE_MAX) /* "off" */
    warm_max = 0;
  const char *h = getenv("TENSORD_HUGE_PAGES");
  if (h == NULL || strcmp(h, "off") != 0) {
    td__huge_info hi;
    td__huge_probe(&hi);
    huge_advise = hi.effective == TD__THP_ADVISE;
  }
}

#if defined(MADV_POPULATE_READ) && defined(MADV_POPULATE_WRITE)
#define HAVE_MADV_POPULATE 1
#else
#define HAVE_MADV_POPULATE 0
#endif

/* Maps nbytes of fd in mode, madvised for huge pages where /dev/shm asks
 * for that: shared, or for TD__MAP_COW private and writable over the
 * read-only fd. Sets *populate when the mapping is to be populated at its
 * first td__map_addr (at or above the threshold of its mode; a
 * copy-on-write mapping counts as read-only). Without MADV_POPULATE_*
 * (headers older than Linux 5.14) a shared mapping is populated here
 * instead, and a copy-on-write one not at all: MAP_POPULATE of a private
 * writable mapping write-faults every page, a private copy of all of it.
 * Returns the address or MAP_FAILED with errno set. */
static void *map_fd(int fd, size_t nbytes, int mode, int lazy, int *populate,
                    int *deferred) {
  int due = nbytes >= (mode == TD__MAP_RW ? populate_rw : populate_ro);
  *populate = due && !lazy;
  *deferred = due && lazy;
  int now = !HAVE_MADV_POPULATE && *populate;
  int prot = PROT_READ | (mode == TD__MAP_RO ? 0 : PROT_WRITE);
  int flags = mode == TD__MAP_COW ? MAP_PRIVATE : MAP_SHARED;
  if (now && mode != TD__MAP_COW)
    flags |= MAP_POPULATE;
  void *addr = mmap(NULL, nbytes, prot, flags, fd, 0);
  if (now)
    *populate = 0;
  /* Best effort: the advice comes before the first fault, so that the
   * populate is made of huge pages where the kernel has them. */
  if (addr != MAP_FAILED && huge_advise && nbytes >= TD__HUGE_MIN)
    madvise(addr, nbytes, MADV_HUGEPAGE);
  return addr;
}

static uint64_t mhash(const mkey *k) {
  return td__hash_u64(k->id ^ td__hash_u64(k->instance) ^ (uint64_t)k->mode);
}

static int meq(const td__hnode *n, const void *key) {
  const td__mapping *m = td__container_of(n, td__mapping, node);
  const mkey *k = key;
  return m->id == k->id && m->instance == k->instance && m->mode == k->mode;
}

int td__map_acquire(uint64_t instance, uint64_t id, int mode, size_t nbytes,
                    int fd, int lazy, td__mapping **out) {
  pthread_once(&once, cache_init);
  mkey k = {instance, id, mode};
  uint64_t h = mhash(&k);
  int err = 0;
  pthread_mutex_lock(&mu);
  td__hnode *n = td__htab_find(&maps, h, meq, &k);
  if (n != NULL) {
    td__mapping *m = td__container_of(n, td__mapping, node);
    m->handles++;
    /* A handle that is not lazy gets the populate a lazy one skipped. */
    if (!lazy && m->deferred) {
      m->deferred = 0;
      atomic_store(&m->populate, 1);
    }
    *out = m;
    goto out;
  }
  if (fd < 0) {
    err = TD_ENOENT;
    goto out;
  }
  td__mapping *m = calloc(1, sizeof(*m));
  if (m == NULL) {
    err = TD_ENOMEM;
    goto out;
  }
  int populate, deferred = 0;
  void *addr = NULL;
  struct stat sb;
  /* A copy-on-write mapping is never kept warm (ino 0): its private pages
   * hold this process's writes, not the segment's bytes. */
  if (mode != TD__MAP_COW && nbytes >= TD__WARM_MIN && warm_max > 0 &&
      fstat(fd, &sb) == 0) {
    m->dev = sb.st_dev;
    m->ino = sb.st_ino;
    addr = warm_take(m->dev, m->ino, mode, nbytes, &populate);
    if (lazy) {
      deferred = populate;
      populate = 0;
    }
  }
  if (addr == NULL)
    addr = map_fd(fd, nbytes, mode, lazy, &populate, &deferred);
  if (addr == MAP_FAILED) {
    err = -errno;
    free(m);
    goto out;
  }
  m->instance = instance;
  m->id = id;
  m->mode = mode;
  m->addr = addr;
  m->len = nbytes;
  m->handles = 1;
  atomic_init(&m->populate, populate);
  m->deferred = deferred;
  if (td__htab_insert(&maps, &m->node, h) < 0) {
    munmap(addr, nbytes);
    free(m);
    err = TD_ENOMEM;
    goto out;
  }
  *out = m;
out:
  pthread_mutex_unlock(&mu);
  /* The mapping keeps the memory; the fd is no longer needed. */
  if (fd >= 0)
    close(fd);
  return err;
}

int td__map_acquire_cuda(uint64_t instance, uint64_t id, int mode,
                         const uint8_t uuid[16], uint64_t alloc_size,
                         uint64_t alloc_id, int fd, const uint8_t *ipc_handle,
                         td__mapping **out, char *msg, size_t len) {
  pthread_once(&once, cache_init);
  mkey k = {instance, id, mode};
  uint64_t h = mhash(&k);
  int err = 0;
  pthread_mutex_lock(&mu);
  td__hnode *n = td__htab_find(&maps, h, meq, &k);
  if (n != NULL) {
    td__mapping *m = td__container_of(n, td__mapping, node);
    m->handles++;
    *out = m;
    goto out;
  }
  if (fd < 0 && ipc_handle == NULL) {
    err = TD_ENOENT;
    goto out;
  }
  td__mapping *m = calloc(1, sizeof(*m));
  if (m == NULL) {
    err = td__msg(msg, len, TD_ENOMEM, "out of memory");
    goto out;
  }
  err = ipc_handle != NULL
            ? td__cumap_open_ipc(uuid, ipc_handle, alloc_size, &m->cu, msg, len)
            : td__cumap_open(instance, alloc_id, uuid, fd, alloc_size,
                             mode != TD__MAP_RW, &m->cu, msg, len);
  if (err < 0) {
    free(m);
    goto out;
  }
  m->instance = instance;
  m->id = id;
  m->mode = mode;
  m->addr = td__cumap_addr(m->cu);
  m->len = alloc_size;
  m->handles = 1;
  atomic_init(&m->populate, 0);
  if (td__htab_insert(&maps, &m->node, h) < 0) {
    td__cumap_close(m->cu);
    free(m);
    err = td__msg(msg, len, TD_ENOMEM, "out of memory");
    goto out;
  }
  *out = m;
out:
  pthread_mutex_unlock(&mu);
  if (fd >= 0)
    close(fd);
  return err;
}

td__cumap *td__map_cumap(const td__mapping *m) {
  return m->cu;
}

/* Returns the mapping of (instance, id) in the other shared mode (read-only
 * for read-write and back), or NULL. Called with mu held. */
static td__mapping *sibling(const td__mapping *m) {
  mkey k = {m->instance, m->id,
            m->mode == TD__MAP_RW ? TD__MAP_RO : TD__MAP_RW};
  td__hnode *n = td__htab_find(&maps, mhash(&k), meq, &k);
  return n != NULL ? td__container_of(n, td__mapping, node) : NULL;
}

/* Unmaps the warm mappings past their time. Called with mu held. */
static void warm_expire(void) {
  int64_t now = now_ms();
  for (warm **p = &warms, *w; (w = *p) != NULL;) {
    if (now - w->since_ms >= TD__WARM_MS) {
      *p = w->next;
      munmap(w->addr, w->len);
      nwarm--;
      warm_bytes -= w->len;
      free(w);
    } else {
      p = &w->next;
    }
  }
}

/* Takes the warm mapping of inode (dev, ino) in that mode and of len bytes.
 * Returns its address, with *populate what it still needs, or NULL. Called
 * with mu held. */
static void *warm_take(dev_t dev, ino_t ino, int mode, size_t len,
                       int *populate) {
  warm_expire();
  for (warm **p = &warms, *w; (w = *p) != NULL; p = &w->next) {
    if (w->ino != ino || w->dev != dev || w->mode != mode || w->len != len)
      continue;
    *p = w->next;
    nwarm--;
    warm_bytes -= w->len;
    void *addr = w->addr;
    *populate = w->populate;
    free(w);
    return addr;
  }
  return NULL;
}

/* Keeps m's pages mapped, warm, if it may; else unmaps them. Called with mu
 * held. */
static void warm_keep(const td__mapping *m) {
  warm_expire();
  warm *w = NULL;
  if (m->ino != 0 && m->len <= warm_max && (w = malloc(sizeof(*w))) != NULL) {
    /* Room first: the oldest go. */
    while (nwarm >= TD__WARM_MAX || warm_bytes + m->len > warm_max) {
      warm **p = &warms;
      while ((*p)->next != NULL)
        p = &(*p)->next;
      warm *old = *p;
      *p = NULL;
      munmap(old->addr, old->len);
      nwarm--;
      warm_bytes -= old->len;
      free(old);
    }
    w->dev = m->dev;
    w->ino = m->ino;
    w->mode = m->mode;
    w->populate = atomic_load(&m->populate) || m->deferred;
    w->addr = m->addr;
    w->len = m->len;
    w->since_ms = now_ms();
    w->next = warms;
    warms = w;
    nwarm++;
    warm_bytes += w->len;
    return;
  }
  munmap(m->addr, m->len);
}

static void unmap(td__mapping *m) {
  td__htab_remove(&maps, &m->node);
  if (m->cu != NULL)
    td__cumap_close(m->cu);
  else
    warm_keep(m);
  free(m);
}

/* A read-only mapping whose last handle goes while the process still holds
 * the storage read-write stays, idle (no handle), for the next read-only
 * handle: a loop of read-only lookups and releases of a storage the process
 * holds read-write maps once. It goes with the read-write mapping's last
 * handle, so the mappings still go with the process's last handle on the
 * storage. A read-write mapping is never kept idle: a process that has let
 * go of its write access keeps no writable mapping. */
void td__map_release(td__mapping *m) {
  if (m == NULL)
    return;
  pthread_mutex_lock(&mu);
  warm_expire();
  if (--m->handles == 0) {
    td__mapping *other;
    if (m->mode == TD__MAP_COW) {
      unmap(m);
    } else if (m->mode == TD__MAP_RO) {
      if (sibling(m) == NULL)
        unmap(m);
    } else {
      other = sibling(m);
      unmap(m);
      if (other != NULL && other->handles == 0)
        unmap(other);
    }
  }
  pthread_mutex_unlock(&mu);
}

/* The populate of a mapping runs when its bytes are first asked for, not
 * when it is made: a handle that is only held (to keep a storage alive, or a
 * create timed alone) costs no populate, and the first access pays one
 * populate instead of a fault per page. Concurrent first calls populate
 * once; the others touch the pages while it runs, which only faults them. */
void *td__map_addr(td__mapping *m) {
#if HAVE_MADV_POPULATE
  if (atomic_load_explicit(&m->populate, memory_order_relaxed) &&
      atomic_exchange(&m->populate, 0))
    madvise(m->addr, m->len,
            m->mode == TD__MAP_RW ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
#endif
  return m->addr;
}

size_t td__map_count(void) {
  pthread_once(&once, cache_init);
  pthread_mutex_lock(&mu);
  size_t n = maps.count;
  pthread_mutex_unlock(&mu);
  return n;
}

/* cache.c: the process's mappings of storages, keyed by (daemon instance,
 * storage id, mode), so a storage the process already holds is never mapped
 * twice, and a mapping goes with the process's last handle on it. */
#include "internal.h"

#include "htab.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

struct td__mapping {
  td__hnode node;
  uint64_t instance, id;
  int readonly;
  void *addr;
  size_t len;
  uint64_t handles;
};

typedef struct mkey {
  uint64_t instance, id;
  int readonly;
} mkey;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static td__htab maps;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* A forked child inherits the mappings but not the handles that own them
 * (those belong to the parent's connections): start it with an empty cache.
 * The inherited mappings stay valid until the child exits. */
static void atfork_child(void) {
  pthread_mutex_init(&mu, NULL);
  td__htab_init(&maps);
}

static void cache_init(void) {
  td__htab_init(&maps);
  pthread_atfork(NULL, NULL, atfork_child);
}

static uint64_t mhash(const mkey *k) {
  return td__hash_u64(k->id ^ td__hash_u64(k->instance) ^
                      (uint64_t)k->readonly);
}

static int meq(const td__hnode *n, const void *key) {
  const td__mapping *m = td__container_of(n, td__mapping, node);
  const mkey *k = key;
  return m->id == k->id && m->instance == k->instance &&
         m->readonly == k->readonly;
}

int td__map_acquire(uint64_t instance, uint64_t id, int readonly, size_t nbytes,
                    int fd, td__mapping **out) {
  pthread_once(&once, cache_init);
  mkey k = {instance, id, readonly};
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
  if (fd < 0) {
    err = TD_ENOENT;
    goto out;
  }
  td__mapping *m = calloc(1, sizeof(*m));
  if (m == NULL) {
    err = TD_ENOMEM;
    goto out;
  }
  void *addr = mmap(NULL, nbytes, PROT_READ | (readonly ? 0 : PROT_WRITE),
                    MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    err = -errno;
    free(m);
    goto out;
  }
  m->instance = instance;
  m->id = id;
  m->readonly = readonly;
  m->addr = addr;
  m->len = nbytes;
  m->handles = 1;
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

void td__map_release(td__mapping *m) {
  if (m == NULL)
    return;
  pthread_mutex_lock(&mu);
  if (--m->handles == 0) {
    td__htab_remove(&maps, &m->node);
    munmap(m->addr, m->len);
    free(m);
  }
  pthread_mutex_unlock(&mu);
}

void *td__map_addr(const td__mapping *m) {
  return m->addr;
}

size_t td__map_count(void) {
  pthread_once(&once, cache_init);
  pthread_mutex_lock(&mu);
  size_t n = maps.count;
  pthread_mutex_unlock(&mu);
  return n;
}

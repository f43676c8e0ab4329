/* htab.h: an intrusive chained hash table, used by the daemon's registry and
 * the client's mapping cache. */
#ifndef TD_HTAB_H
#define TD_HTAB_H

#include <stddef.h>
#include <stdint.h>

#define td__container_of(ptr, type, member)                                    \
  ((type *)((char *)(ptr)-offsetof(type, member)))

typedef struct td__hnode {
  struct td__hnode *next;
  uint64_t hash;
} td__hnode;

typedef struct td__htab {
  td__hnode **buckets;
  size_t nbuckets; /* a power of two, or 0 before the first insert */
  size_t count;
  size_t lo; /* every bucket below is empty: where td__htab_any looks first */
} td__htab;

/* Returns nonzero if node holds key. */
typedef int (*td__heq)(const td__hnode *node, const void *key);

void td__htab_init(td__htab *t);
/* Frees the bucket array; the nodes belong to the caller. */
void td__htab_free(td__htab *t);
td__hnode *td__htab_find(const td__htab *t, uint64_t hash, td__heq eq,
                         const void *key);
/* Inserts node (whose key is not yet in t). Returns 0, or TD_ENOMEM if the
 * table had to grow and could not; t is then unchanged. */
int td__htab_insert(td__htab *t, td__hnode *node, uint64_t hash);
/* Removes node (which is in t). When t then holds fewer nodes than an
 * eighth of its buckets, it shrinks to a quarter of them (if that
 * allocation fails, it stays as it is): its size follows what it holds. So
 * a walk of t->buckets must not remove nodes as it goes. */
void td__htab_remove(td__htab *t, td__hnode *node);
/* Returns some node of t (the first in bucket order), or NULL if t is empty.
 * Emptying t by td__htab_any and td__htab_remove, with no insert in
 * between, visits each bucket once in all: linear in what t holds. */
td__hnode *td__htab_any(td__htab *t);

uint64_t td__hash_u64(uint64_t x);
uint64_t td__hash_bytes(const void *p, size_t len);

#endif /* TD_HTAB_H */

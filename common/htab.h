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
void td__htab_remove(td__htab *t, td__hnode *node);

uint64_t td__hash_u64(uint64_t x);
uint64_t td__hash_bytes(const void *p, size_t len);

#endif /* TD_HTAB_H */

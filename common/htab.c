/* htab.c: an intrusive chained hash table that doubles at load factor 1. */
#include "htab.h"

#include "tensord.h"

#include <stdlib.h>

void td__htab_init(td__htab *t) {
  t->buckets = NULL;
  t->nbuckets = 0;
  t->count = 0;
}

void td__htab_free(td__htab *t) {
  free(t->buckets);
  td__htab_init(t);
}

td__hnode *td__htab_find(const td__htab *t, uint64_t hash, td__heq eq,
                         const void *key) {
  if (t->nbuckets == 0)
    return NULL;
  for (td__hnode *n = t->buckets[hash & (t->nbuckets - 1)]; n; n = n->next)
    if (n->hash == hash && eq(n, key))
      return n;
  return NULL;
}

static int grow(td__htab *t) {
  size_t nb = t->nbuckets ? t->nbuckets * 2 : 64;
  td__hnode **b = calloc(nb, sizeof(*b));
  if (b == NULL)
    return TD_ENOMEM;
  for (size_t i = 0; i < t->nbuckets; i++) {
    td__hnode *n = t->buckets[i];
    while (n != NULL) {
      td__hnode *next = n->next;
      size_t j = n->hash & (nb - 1);
      n->next = b[j];
      b[j] = n;
      n = next;
    }
  }
  free(t->buckets);
  t->buckets = b;
  t->nbuckets = nb;
  return 0;
}

int td__htab_insert(td__htab *t, td__hnode *node, uint64_t hash) {
  if (t->count >= t->nbuckets) {
    int err = grow(t);
    if (err < 0)
      return err;
  }
  size_t i = hash & (t->nbuckets - 1);
  node->hash = hash;
  node->next = t->buckets[i];
  t->buckets[i] = node;
  t->count++;
  return 0;
}

void td__htab_remove(td__htab *t, td__hnode *node) {
  td__hnode **p = &t->buckets[node->hash & (t->nbuckets - 1)];
  while (*p != node)
    p = &(*p)->next;
  *p = node->next;
  node->next = NULL;
  t->count--;
}

/* splitmix64's finaliser: a cheap bijection that spreads sequential ids. */
uint64_t td__hash_u64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* FNV-1a, 64-bit. */
uint64_t td__hash_bytes(const void *p, size_t len) {
  const unsigned char *s = p;
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < len; i++) {
    h ^= s[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

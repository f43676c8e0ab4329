/* htab.c: an intrusive chained hash table that doubles at load factor 1
 * and shrinks when mostly empty. */
#include "htab.h"

#include "tensord.h"

#include <stdlib.h>

/* The fewest buckets a table that holds anything has. */
#define MIN_BUCKETS 64

void td__htab_init(td__htab *t) {
  t->buckets = NULL;
  t->nbuckets = 0;
  t->count = 0;
  t->lo = 0;
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

/* Rehashes t into nb buckets (a power of two). Returns 0, or TD_ENOMEM with
 * t unchanged. */
static int resize(td__htab *t, size_t nb) {
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
  t->lo = 0;
  return 0;
}

int td__htab_insert(td__htab *t, td__hnode *node, uint64_t hash) {
  if (t->count >= t->nbuckets) {
    int err = resize(t, t->nbuckets ? t->nbuckets * 2 : MIN_BUCKETS);
    if (err < 0)
      return err;
  }
  size_t i = hash & (t->nbuckets - 1);
  if (i < t->lo)
    t->lo = i;
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
  /* A quarter of the buckets leaves the load at a half at most: growing
   * again takes twice as many nodes, shrinking again a quarter as many, so
   * each rehash is paid for by as many inserts or removes as it moves. */
  if (t->nbuckets > MIN_BUCKETS && t->count < t->nbuckets / 8)
    resize(t, t->nbuckets / 4 > MIN_BUCKETS ? t->nbuckets / 4 : MIN_BUCKETS);
}

td__hnode *td__htab_any(td__htab *t) {
  if (t->count == 0)
    return NULL;
  while (t->buckets[t->lo] == NULL)
    t->lo++;
  return t->buckets[t->lo];
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

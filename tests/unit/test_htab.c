/* test_htab.c: common/htab.c: finds what it holds through growth and
 * shrinking, shrinks when mostly empty, and empties in linear time. */
#include "htab.h"

#include <criterion/criterion.h>
#include <stdlib.h>

typedef struct item {
  td__hnode node;
  uint64_t key;
  int in; /* in the table */
} item;

static int item_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, item, node)->key == *(const uint64_t *)key;
}

static item *find(const td__htab *t, uint64_t key) {
  td__hnode *n = td__htab_find(t, td__hash_u64(key), item_eq, &key);
  return n ? td__container_of(n, item, node) : NULL;
}

/* Asserts that t holds exactly the items of v marked in. */
static void check(const td__htab *t, item *v, size_t n) {
  size_t in = 0;
  for (size_t i = 0; i < n; i++) {
    cr_assert_eq(find(t, v[i].key), v[i].in ? &v[i] : NULL, "key %llu",
                 (unsigned long long)v[i].key);
    in += v[i].in;
  }
  cr_assert_eq(t->count, in);
}

static item *make_items(size_t n) {
  item *v = calloc(n, sizeof(*v));
  cr_assert_not_null(v);
  for (size_t i = 0; i < n; i++)
    v[i].key = i * 7 + 1;
  return v;
}

static void insert(td__htab *t, item *it) {
  cr_assert_eq(td__htab_insert(t, &it->node, td__hash_u64(it->key)), 0);
  it->in = 1;
}

static void remove_item(td__htab *t, item *it) {
  td__htab_remove(t, &it->node);
  it->in = 0;
}

TestSuite(htab, .timeout = 30);

Test(htab, shrinks_when_mostly_empty) {
  enum { N = 100000 };
  td__htab t;
  item *v = make_items(N);
  td__htab_init(&t);
  for (size_t i = 0; i < N; i++)
    insert(&t, &v[i]);
  cr_assert_geq(t.nbuckets, N);
  size_t peak = t.nbuckets;
  /* Down to 10 nodes: the table follows, a power of two with at most eight
   * buckets per node, 64 at the least. */
  for (size_t i = 10; i < N; i++)
    remove_item(&t, &v[i]);
  check(&t, v, N);
  cr_assert_eq(t.nbuckets, 64, "%zu buckets for 10 nodes (%zu at the peak)",
               t.nbuckets, peak);
  /* And grows again. */
  for (size_t i = 10; i < N; i++)
    insert(&t, &v[i]);
  check(&t, v, N);
  td__htab_free(&t);
  free(v);
}

Test(htab, size_tracks_count_through_removes) {
  enum { N = 50000 };
  td__htab t;
  item *v = make_items(N);
  td__htab_init(&t);
  for (size_t i = 0; i < N; i++)
    insert(&t, &v[i]);
  for (size_t i = 0; i < N; i++) {
    remove_item(&t, &v[i]);
    if (t.count > 0)
      cr_assert_leq(t.nbuckets, 8 * t.count > 64 ? 8 * t.count : 64,
                    "%zu buckets for %zu nodes", t.nbuckets, t.count);
    if (i % 4999 == 0)
      check(&t, v, N);
  }
  cr_assert_eq(t.count, 0);
  td__htab_free(&t);
  free(v);
}

Test(htab, any_then_remove_empties_it) {
  enum { N = 70000 };
  td__htab t;
  item *v = make_items(N);
  td__htab_init(&t);
  cr_assert_null(td__htab_any(&t), "an empty table has no node");
  for (size_t i = 0; i < N; i++)
    insert(&t, &v[i]);
  size_t seen = 0;
  for (td__hnode *n; (n = td__htab_any(&t)) != NULL; seen++) {
    item *it = td__container_of(n, item, node);
    cr_assert(it->in, "key %llu handed out twice", (unsigned long long)it->key);
    remove_item(&t, it);
    if (seen % 9999 == 0)
      check(&t, v, N);
  }
  cr_assert_eq(seen, N);
  check(&t, v, N);
  td__htab_free(&t);
  free(v);
}

Test(htab, any_sees_an_insert_below_where_it_looked) {
  td__htab t;
  item *v = make_items(200);
  td__htab_init(&t);
  for (size_t i = 0; i < 200; i++)
    insert(&t, &v[i]);
  /* Empty it to one node from the front, then put everything back: any
   * must still find every node, wherever it lands. */
  for (size_t k = 0; k < 199; k++)
    remove_item(&t, td__container_of(td__htab_any(&t), item, node));
  for (size_t i = 0; i < 200; i++)
    if (!v[i].in)
      insert(&t, &v[i]);
  check(&t, v, 200);
  size_t seen = 0;
  for (td__hnode *n; (n = td__htab_any(&t)) != NULL; seen++)
    remove_item(&t, td__container_of(n, item, node));
  cr_assert_eq(seen, 200);
  td__htab_free(&t);
  free(v);
}

/* test_pool.c: daemon/engine/pool.c, the recycling pool's bookkeeping: a create is
 * served the smallest fit of its own uid and device, within twice its size;
 * hits and misses count what they should; entries leave oldest first and
 * come back where their age puts them. */
#include "pool.h"

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KiB 1024u
#define MiB (1024u * 1024)

static td__pool p;

static void setup(void) {
  td__pool_init(&p, 64 * MiB, 30000, 0x1234);
}

TestSuite(pool, .init = setup);

/* Pools a segment of n bytes owned by uid, pooled at time t. */
static td__pooled *put(uid_t uid, uint64_t n, int64_t t) {
  td__pooled *e = calloc(1, sizeof(*e));
  cr_assert_not_null(e);
  e->uid = uid;
  e->device = TD_CPU;
  e->nbytes = n;
  e->since_ms = t;
  char msg[128];
  cr_assert_eq(td__pool_name(&p, e->name, msg, sizeof(msg)), 0, "%s", msg);
  td__pool_put(&p, e);
  return e;
}

static void drain(void) {
  td__pooled *e;
  while ((e = td__pool_pop(&p)) != NULL)
    free(e);
  cr_assert_eq(p.count, 0);
  cr_assert_eq(p.bytes, 0);
}

/* Whether name is prefix, seq, '-' and 16 lower-case hex digits. */
static int named(const char *name, const char *prefix, unsigned seq) {
  char head[64];
  snprintf(head, sizeof(head), "%s%u-", prefix, seq);
  size_t n = strlen(head);
  if (strncmp(name, head, n) != 0 || strlen(name) != n + 16)
    return 0;
  for (size_t i = n; i < n + 16; i++)
    if (!strchr("0123456789abcdef", name[i]))
      return 0;
  return 1;
}

Test(pool, names_are_under_the_instance_pool_prefix_with_a_random_tail) {
  cr_assert_str_eq(p.prefix, "/tensord.0000000000001234-pool.");
  char a[TD__SEGMENT_NAME_MAX], b[TD__SEGMENT_NAME_MAX], msg[128];
  cr_assert_eq(td__pool_name(&p, a, msg, sizeof(msg)), 0, "%s", msg);
  cr_assert_eq(td__pool_name(&p, b, msg, sizeof(msg)), 0, "%s", msg);
  cr_assert(named(a, p.prefix, 1), "%s", a);
  cr_assert(named(b, p.prefix, 2), "%s", b);
  /* Seen in /dev/shm, a name says nothing of the next one. */
  cr_assert_str_neq(a + strlen(a) - 16, b + strlen(b) - 16);
  /* The prefix is still what a sweep goes by. */
  char prefix[TD__PREFIX_MAX];
  cr_assert_eq(td__segment_prefix(a, prefix), 0);
  cr_assert_str_eq(prefix, p.prefix);
}

Test(pool, a_name_that_cannot_fit_is_refused) {
  char a[TD__SEGMENT_NAME_MAX] = "unchanged", msg[128];
  p.next_seq = UINT64_MAX - 1; /* 20 digits: 31 + 20 + 17 > 63 */
  cr_assert_eq(td__pool_name(&p, a, msg, sizeof(msg)), TD_ENAMETOOLONG);
  cr_assert_str_eq(a, "unchanged");
  cr_assert(strstr(msg, "more than 63 bytes"), "%s", msg);
}

Test(pool, only_sizes_in_range_are_wanted) {
  cr_assert_not(td__pool_wants(&p, TD__POOL_MIN_BYTES - 1));
  cr_assert(td__pool_wants(&p, TD__POOL_MIN_BYTES));
  cr_assert(td__pool_wants(&p, 64 * MiB));
  cr_assert_not(td__pool_wants(&p, 64 * MiB + 1), "larger than the bound");
  td__pool_init(&p, 0, 30000, 1);
  cr_assert_not(td__pool_wants(&p, MiB), "recycling off");
  cr_assert_null(td__pool_take(&p, 0, TD_CPU, MiB));
  cr_assert_eq(p.misses, 0, "no pool, no miss");
}

Test(pool, a_create_gets_the_smallest_fit_of_its_own_uid) {
  put(1000, 4 * MiB, 1);
  td__pooled *want = put(1000, 3 * MiB, 2);
  put(1001, 2 * MiB, 3); /* another uid: never */
  put(1000, 8 * MiB, 4); /* over twice the size: not for 2 MiB */
  cr_assert_eq(p.count, 4);
  cr_assert_eq(p.bytes, 17 * MiB);
  td__pooled *e = td__pool_take(&p, 1000, TD_CPU, 2 * MiB);
  cr_assert_eq(e, want);
  cr_assert_eq(p.hits, 1);
  cr_assert_eq(p.count, 3);
  cr_assert_eq(p.bytes, 14 * MiB);
  free(e);
  /* Nothing of uid 1002, nothing of 4 MiB..8 MiB for 9 MiB. */
  cr_assert_null(td__pool_take(&p, 1002, TD_CPU, 2 * MiB));
  cr_assert_null(td__pool_take(&p, 1000, TD_CPU, 9 * MiB));
  cr_assert_eq(p.misses, 2);
  /* Another device: never. */
  cr_assert_null(td__pool_take(&p, 1000, TD_CUDA, 4 * MiB));
  drain();
}

Test(pool, an_exact_fit_prefers_the_newest) {
  put(7, MiB, 1);
  td__pooled *newest = put(7, MiB, 2);
  td__pooled *e = td__pool_take(&p, 7, TD_CPU, MiB);
  cr_assert_eq(e, newest, "the most recently used pages first");
  free(e);
  drain();
}

Test(pool, untake_and_restore_put_entries_back_by_age) {
  td__pooled *a = put(1, MiB, 10), *b = put(1, 2 * MiB, 20);
  put(1, 3 * MiB, 30);
  td__pooled *e = td__pool_take(&p, 1, TD_CPU, MiB);
  cr_assert_eq(e, a);
  td__pool_untake(&p, e);
  cr_assert_eq(p.hits, 0, "a create that did not go ahead is no hit");
  cr_assert_eq(p.oldest, a, "back at the front: it is the oldest");
  /* Victims of a create that failed come back in their places too. */
  td__pooled *v1 = td__pool_pop(&p), *v2 = td__pool_pop(&p);
  cr_assert_eq(v1, a);
  cr_assert_eq(v2, b);
  v1->next = v2;
  v2->next = NULL;
  td__pool_restore(&p, v1);
  cr_assert_eq(p.count, 3);
  cr_assert_eq(p.bytes, 6 * MiB);
  int64_t last = 0;
  for (td__pooled *x = p.oldest; x != NULL; x = x->next) {
    cr_assert_geq(x->since_ms, last, "oldest first");
    last = x->since_ms;
    cr_assert(x->next == NULL || x->next->prev == x);
  }
  cr_assert_eq(p.newest->since_ms, 30);
  drain();
}

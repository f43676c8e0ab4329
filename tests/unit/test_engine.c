/* test_engine.c: the daemon's engine (daemon/engine) driven with plain
 * function calls, no loop and no socket: a storage's life through the
 * registry, lookups waiting for a key, events as values, and the recycling
 * pool's decisions. Links td_engine alone. */
#include "events.h"
#include "pool.h"
#include "registry.h"
#include "waitq.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MiB (1024u * 1024)

/* ---- a registry whose free hook counts what it frees ---- */

static td__registry reg;
static unsigned nfreed;
static uint64_t last_freed;

static void on_free(td__storage *s, void *arg) {
  cr_assert_eq(arg, &reg);
  cr_assert_eq(s->refs, 0, "storage %llu freed with %u references",
               (unsigned long long)s->id, s->refs);
  cr_assert_null(td__storage_find(&reg, s->id), "freed while registered");
  nfreed++;
  last_freed = s->id;
  free(s);
}

static void setup(void) {
  nfreed = 0;
  last_freed = 0;
  td__registry_init(&reg, 64 * MiB, on_free, &reg);
}

static void teardown(void) {
  td__registry_free(&reg);
}

static const td__peer alice = {100, 1000, 1000};
static const td__peer bob = {200, 1001, 1001};

/* Creates a storage of n bytes for h as the daemon does: charge, insert. */
static td__storage *create(td__holdings *h, uint64_t n) {
  td__storage *s = calloc(1, sizeof(*s));
  cr_assert_not_null(s);
  s->id = reg.next_id++;
  s->nbytes = n;
  s->device = TD_CPU;
  s->mode = 0644;
  s->owner = h->peer;
  snprintf(s->name, sizeof(s->name), "/tensord.test.%llu",
           (unsigned long long)s->id);
  char msg[256];
  cr_assert_eq(td__charge(&reg, h->peer.uid, n, 0, msg, sizeof(msg)), 0, "%s",
               msg);
  cr_assert_eq(td__storage_insert(&reg, s, h), 0);
  return s;
}

static td_view whole(uint64_t n) {
  td_view v;
  int64_t shape = (int64_t)n;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, &shape, &v), 0);
  return v;
}

/* ---- a storage's life ---- */

TestSuite(life, .init = setup, .fini = teardown, .timeout = 10);

Test(life, create_publish_lookup_take_release_disconnect) {
  td__holdings a, b;
  td__holdings_init(&a, &alice);
  td__holdings_init(&b, &bob);
  td__storage *s = create(&a, MiB);
  uint64_t id = s->id;
  cr_assert_eq(s->refs, 1);
  cr_assert_eq(a.nrefs, 1);
  cr_assert_eq(reg.nholdings, 1);
  cr_assert_eq(td__usage_of(&reg, alice.uid), MiB, "charged to its owner");
  cr_assert_eq(td__usage_of(&reg, bob.uid), 0);

  /* Publish "w" in two halves, as a journaled publish does. */
  td_view v = whole(MiB);
  td__key_prep prep;
  cr_assert_eq(td__key_prepare(&reg, "w", 1, s, alice.uid, &prep), 0);
  td__key *k = td__key_commit(&reg, &prep, &v);
  cr_assert_eq(k->storage, s);
  cr_assert_eq(s->refs, 2, "the key holds one");
  cr_assert_eq(td__keys_of(&reg, alice.uid), 1);

  /* Bob looks it up read-only, then takes a second key to it. */
  cr_assert_eq(td__key_find(&reg, "w", 1), k);
  uint32_t had = 99;
  cr_assert_eq(td__ref_add(&reg, &b, s, 1, &had), 0);
  cr_assert_eq(had, 0, "a first mapping for bob's process");
  cr_assert_eq(td__key_publish(&reg, "t", 1, s, alice.uid, &v, &k), 0);
  cr_assert_eq(td__ref_add(&reg, &b, s, 1, &had), 0);
  cr_assert_eq(had, 1);
  td__key_remove(&reg, k); /* the take: the key goes, bob's reference stays */
  cr_assert_null(td__key_find(&reg, "t", 1));
  cr_assert_eq(s->refs, 4, "alice, bob twice, key w");
  cr_assert_eq(reg.nholdings, 2);
  cr_assert_eq(td__usage_of(&reg, bob.uid), 0, "holding charges nothing");

  /* Alice releases her reference and unpublishes: bob's keep s alive. */
  cr_assert_eq(td__ref_drop(&reg, &a, id, 0, 1), 0);
  cr_assert_eq(td__ref_drop(&reg, &a, id, 0, 1), TD_ENOENT, "none left");
  td__key_remove(&reg, td__key_find(&reg, "w", 1));
  cr_assert_eq(td__keys_of(&reg, alice.uid), 0);
  cr_assert_eq(nfreed, 0);
  cr_assert_eq(s->refs, 2);

  /* Bob disconnects: the last references go, and with them s, once. */
  td__holdings_clear(&reg, &b);
  cr_assert_eq(nfreed, 1);
  cr_assert_eq(last_freed, id);
  cr_assert_null(td__storage_find(&reg, id));
  cr_assert_eq(reg.nholdings, 0);
  cr_assert_eq(reg.bytes_used, 0);
  cr_assert_eq(reg.bytes_committed, 0);
  cr_assert_eq(td__usage_of(&reg, alice.uid), 0, "credited when freed");
  td__holdings_clear(&reg, &a);
  cr_assert_eq(nfreed, 1, "nothing freed twice");
}

/* ---- waiters ---- */

/* An owner of waiters, as a connection is. */
typedef struct owner {
  const char *name;
  td__wait *waits;
} owner;

/* What the callbacks saw, in order. */
static const char *seen[8];
static int nseen;

/* Answers a woken lookup: a take removes the key, as op_lookup would. */
static void answer(td__wait *w, td__key *k, void *arg) {
  owner *o = w->owner;
  cr_assert_eq(arg, &reg);
  cr_assert_lt(nseen, 8);
  seen[nseen++] = o->name;
  if (k != NULL && w->args.take)
    td__key_remove(&reg, k);
  free(w);
}

static td__wait *wait_for(td__waits *ws, owner *o, const char *key, int take) {
  td__wait *w = calloc(1, sizeof(*w));
  cr_assert_not_null(w);
  w->owner = o;
  w->list = &o->waits;
  w->args.seq = (uint64_t)nseen + 1;
  w->args.take = take;
  w->wait_ms = -1;
  w->deadline_ms = -1;
  cr_assert_eq(td__wait_add(ws, w, key, strlen(key)), 0);
  return w;
}

static int count_one(void *arg, const td__wait *w) {
  (void)w;
  (*(int *)arg)++;
  return 0;
}

static td__key *publish(td__holdings *h, const char *key) {
  td__storage *s = create(h, 4096);
  td_view v = whole(4096);
  td__key *k = NULL;
  cr_assert_eq(td__key_publish(&reg, key, strlen(key), s, h->peer.uid, &v, &k),
               0);
  td__ref_drop(&reg, h, s->id, 0, 1); /* the key alone holds it */
  return k;
}

TestSuite(waiters, .init = setup, .fini = teardown, .timeout = 10);

Test(waiters, a_publish_wakes_them_in_arrival_order) {
  td__waits ws;
  td__waits_init(&ws);
  owner a = {"a", NULL}, b = {"b", NULL};
  nseen = 0;
  td__wait *wa = wait_for(&ws, &a, "k", 0);
  wait_for(&ws, &b, "k", 0);
  wait_for(&ws, &b, "other", 0);
  cr_assert_eq(ws.count, 3);
  cr_assert_eq(a.waits, wa);
  cr_assert_str_eq(wa->key, "k");
  cr_assert_eq(wa->len, 1);
  int n = 0;
  cr_assert_eq(td__waits_walk(&ws, count_one, &n), 0);
  cr_assert_eq(n, 3);

  td__holdings h;
  td__holdings_init(&h, &alice);
  td__key *k = publish(&h, "k");
  td__wait_wake(&ws, &reg, k, answer, &reg);
  cr_assert_eq(nseen, 2, "neither takes: both are answered");
  cr_assert_str_eq(seen[0], "a");
  cr_assert_str_eq(seen[1], "b");
  cr_assert_null(a.waits);
  cr_assert_eq(ws.count, 1, "the waiter of another key stays");
  cr_assert_not_null(td__key_find(&reg, "k", 1));
  td__waits_drop(&ws, &b.waits, answer, &reg);
  cr_assert_eq(ws.count, 0);
  td__waits_free(&ws);
  td__holdings_clear(&reg, &h);
}

Test(waiters, a_take_stops_the_wake) {
  td__waits ws;
  td__waits_init(&ws);
  owner a = {"a", NULL}, b = {"b", NULL};
  nseen = 0;
  wait_for(&ws, &a, "k", 1);
  wait_for(&ws, &b, "k", 0);
  td__holdings h;
  td__holdings_init(&h, &alice);
  td__key *k = publish(&h, "k");
  uint64_t id = k->storage->id;
  td__wait_wake(&ws, &reg, k, answer, &reg);
  cr_assert_eq(nseen, 1, "a took the key: b waits on");
  cr_assert_str_eq(seen[0], "a");
  cr_assert_null(td__key_find(&reg, "k", 1));
  cr_assert_eq(last_freed, id, "the take dropped the key's reference");
  cr_assert_eq(ws.count, 1);
  cr_assert_not_null(b.waits);

  /* b goes: its waiter with it, each through the callback, without a key. */
  td__waits_drop(&ws, &b.waits, answer, &reg);
  cr_assert_eq(nseen, 2);
  cr_assert_str_eq(seen[1], "b");
  cr_assert_null(b.waits);
  cr_assert_eq(ws.count, 0);
  cr_assert_eq(ws.queues.count, 0, "an empty queue is freed");
  td__waits_free(&ws);
  td__holdings_clear(&reg, &h);
}

Test(waiters, dropping_an_owner_removes_only_its_waiters) {
  td__waits ws;
  td__waits_init(&ws);
  owner a = {"a", NULL}, b = {"b", NULL};
  nseen = 0;
  wait_for(&ws, &a, "k", 0);
  wait_for(&ws, &b, "k", 0);
  wait_for(&ws, &a, "j", 0);
  td__waits_drop(&ws, &a.waits, answer, &reg);
  cr_assert_eq(nseen, 2);
  cr_assert_null(a.waits);
  cr_assert_eq(ws.count, 1);
  cr_assert_eq(ws.queues.count, 1, "j's queue went with its last waiter");
  /* A timeout: the server takes its waiter off by itself. */
  td__wait *w = b.waits;
  td__wait_remove(&ws, w);
  free(w);
  cr_assert_null(b.waits);
  cr_assert_eq(ws.count, 0);
  cr_assert_eq(ws.queues.count, 0);
  td__waits_free(&ws);
}

/* ---- events ---- */

Test(events, a_key_event_becomes_its_message) {
  td__storage s = {.id = 7, .nbytes = 4096, .device = TD_CPU};
  td__key *k = calloc(1, sizeof(*k) + 4);
  cr_assert_not_null(k);
  memcpy(k->name, "m/w", 4);
  k->len = 3;
  k->storage = &s;
  td__holdings h;
  td__holdings_init(&h, &alice);
  h.name = "trainer";
  td__event ev = td__key_event(TD__EV_PUBLISH, k, &h);
  cr_assert_eq(ev.type, TD__EV_PUBLISH);
  cr_assert_eq(ev.s, &s);
  cr_assert_eq(ev.key, k->name);
  cr_assert_eq(ev.key_len, 3);

  Tensord__Event e = TENSORD__EVENT__INIT;
  td__event_message(&ev, &e);
  cr_assert_eq(e.type, TENSORD__EVENT__TYPE__PUBLISH);
  cr_assert_eq(e.id, 7);
  cr_assert_eq(e.nbytes, 4096);
  cr_assert_eq(e.device, TENSORD__DEVICE__DEVICE_CPU);
  cr_assert_eq(e.key.len, 3);
  cr_assert_eq(memcmp(e.key.data, "m/w", 3), 0);
  cr_assert_eq(e.pid, alice.pid);
  cr_assert_eq(e.uid, alice.uid);
  cr_assert_str_eq(e.name, "trainer");
  cr_assert_str_eq(e.message, "");
  cr_assert_gt(e.unix_ms, 0);
  free(k);
}

Test(events, without_a_holder_the_peer_names_who) {
  td__storage s = {.id = 9, .nbytes = 1, .device = TD_CPU, .owner = bob};
  td__event ev = {.type = TD__EV_FREE, .s = &s, .peer = &s.owner};
  Tensord__Event e = TENSORD__EVENT__INIT;
  td__event_message(&ev, &e);
  cr_assert_eq(e.type, TENSORD__EVENT__TYPE__FREE);
  cr_assert_eq(e.pid, bob.pid);
  cr_assert_eq(e.uid, bob.uid);
  cr_assert_str_eq(e.name, "");
  cr_assert_eq(e.key.len, 0);

  td__event refused = {.type = TD__EV_REFUSED,
                       .code = TD_ENOENT,
                       .message = "key 'x': not published"};
  Tensord__Event r = TENSORD__EVENT__INIT;
  td__event_message(&refused, &r);
  cr_assert_eq(r.code, TD_ENOENT);
  cr_assert_str_eq(r.message, "key 'x': not published");
  cr_assert_eq(r.id, 0, "no storage");
  cr_assert_eq(r.pid, 0, "nobody named");
}

Test(events, a_prefix_matches_keys_that_begin_with_it) {
  td__event keyed = {.type = TD__EV_PUBLISH, .key = "model/w1", .key_len = 8};
  td__event keyless = {.type = TD__EV_CONNECT};
  cr_assert(td__event_matches(&keyed, "", 0), "an empty prefix: everything");
  cr_assert(td__event_matches(&keyless, "", 0));
  cr_assert(td__event_matches(&keyed, "model/", 6));
  cr_assert(td__event_matches(&keyed, "model/w1", 8), "the whole key");
  cr_assert_not(td__event_matches(&keyed, "model/w10", 9), "longer");
  cr_assert_not(td__event_matches(&keyed, "mode/", 5));
  cr_assert_not(td__event_matches(&keyless, "model/", 6),
                "no key, no match under a prefix");
}

/* ---- the pool's decisions ---- */

static td__pool pool;

static void pool_setup(void) {
  setup();
  td__pool_init(&pool, 16 * MiB, 1000, 0x42);
}

static void pool_teardown(void) {
  td__pooled *e;
  while ((e = td__pool_pop(&pool)) != NULL)
    free(e);
  teardown();
}

/* Pools a segment of n bytes of uid 1000, pooled at time t. */
static td__pooled *pool_put(uint64_t n, int64_t t) {
  td__pooled *e = calloc(1, sizeof(*e));
  cr_assert_not_null(e);
  e->uid = 1000;
  e->device = TD_CPU;
  e->nbytes = n;
  e->since_ms = t;
  snprintf(e->name, sizeof(e->name), "/tensord.test-pool.%lld", (long long)t);
  td__pool_put(&pool, e);
  return e;
}

/* Frees a next-linked list, checking it is exactly want (n entries). */
static void expect_list(td__pooled *list, td__pooled **want, int n) {
  int i = 0;
  for (td__pooled *e = list, *next; e != NULL; e = next, i++) {
    next = e->next;
    cr_assert_lt(i, n, "more than %d entries", n);
    cr_assert_eq(e, want[i], "entry %d", i);
    free(e);
  }
  cr_assert_eq(i, n);
}

TestSuite(decide, .init = pool_setup, .fini = pool_teardown, .timeout = 10);

Test(decide, make_room_takes_the_oldest_until_the_need_fits) {
  td__pooled *a = pool_put(2 * MiB, 10), *b = pool_put(3 * MiB, 20);
  pool_put(4 * MiB, 30);
  uint64_t freed = 99;
  /* 1 MiB free and 5 needed: the two oldest (5 MiB) are enough. */
  td__pooled *v = td__pool_make_room(&pool, &reg, 5 * MiB, MiB, &freed);
  cr_assert_eq(freed, 5 * MiB);
  expect_list(v, (td__pooled *[]){a, b}, 2);
  cr_assert_eq(pool.count, 1);
  cr_assert_eq(pool.bytes, 4 * MiB);
  /* Room enough already: nothing goes. */
  cr_assert_null(td__pool_make_room(&pool, &reg, MiB, MiB, &freed));
  cr_assert_eq(freed, 0);
  cr_assert_eq(pool.count, 1);
}

Test(decide, make_room_keeps_the_pool_within_the_capacity) {
  td__pooled *a = pool_put(2 * MiB, 10);
  pool_put(2 * MiB, 20);
  td__holdings h;
  td__holdings_init(&h, &alice);
  create(&h, 61 * MiB); /* 61 + 4 > 64: the oldest goes */
  uint64_t freed;
  td__pooled *v = td__pool_make_room(&pool, &reg, 0, 0, &freed);
  expect_list(v, (td__pooled *[]){a}, 1);
  cr_assert_eq(freed, 2 * MiB);
  td__holdings_clear(&reg, &h);
}

Test(decide, idle_takes_only_what_sat_too_long) {
  td__pooled *a = pool_put(MiB, 100), *b = pool_put(MiB, 500);
  td__pooled *c = pool_put(MiB, 900);
  cr_assert_null(td__pool_idle(&pool, 1099), "none idle for 1000 ms yet");
  expect_list(td__pool_idle(&pool, 1500), (td__pooled *[]){a, b}, 2);
  cr_assert_eq(pool.oldest, c);
  cr_assert_eq(pool.count, 1);
  expect_list(td__pool_idle(&pool, 1900), (td__pooled *[]){c}, 1);
  cr_assert_eq(pool.count, 0);
}

Test(decide, admit_evicts_the_oldest_for_a_segment_that_fits) {
  td__pooled *a = pool_put(6 * MiB, 10), *b = pool_put(6 * MiB, 20);
  td__pooled *gone = NULL;
  /* 12 + 8 > 16 (the pool's limit): a goes, 6 + 8 fits. */
  cr_assert(td__pool_admit(&pool, &reg, TD_CPU, 8 * MiB, &gone));
  expect_list(gone, (td__pooled *[]){a}, 1);
  cr_assert_eq(pool.oldest, b);
  /* Too small to pool, or more than the pool may hold: refused as is. */
  cr_assert_not(td__pool_admit(&pool, &reg, TD_CPU, 4096, &gone));
  cr_assert_null(gone);
  cr_assert_not(td__pool_admit(&pool, &reg, TD_CPU, 17 * MiB, &gone));
  cr_assert_null(gone);
  cr_assert_eq(pool.count, 1);
}

Test(decide, admit_refuses_what_the_capacity_cannot_hold) {
  td__pooled *a = pool_put(2 * MiB, 10);
  td__holdings h;
  td__holdings_init(&h, &alice);
  create(&h, 60 * MiB);
  td__pooled *gone = NULL;
  /* 60 + 8 > 64 even with the pool empty: everything went for nothing. */
  cr_assert_not(td__pool_admit(&pool, &reg, TD_CPU, 8 * MiB, &gone));
  expect_list(gone, (td__pooled *[]){a}, 1);
  cr_assert_eq(pool.count, 0);
  td__holdings_clear(&reg, &h);
  /* Recycling off: nothing is pooled, nothing evicted. */
  td__pool_init(&pool, 0, 1000, 0x42);
  cr_assert_not(td__pool_admit(&pool, &reg, TD_CPU, MiB, &gone));
  cr_assert_null(gone);
}

/* test_registry.c: reference bookkeeping of daemon/engine/registry.c, without any
 * I/O: storages live exactly while holders' and keys' references last. */
#include "registry.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a registry whose free_fn records what it freed ---- */

#define MAX_FREED 65536

typedef struct freed_log {
  uint64_t ids[MAX_FREED]; /* in the order they were freed */
  size_t n;
  unsigned char by_id[MAX_FREED];
} freed_log;

static freed_log freed;
static td__registry reg;

static void record_free(td__storage *s, void *arg) {
  freed_log *f = arg;
  cr_assert_lt(f->n, MAX_FREED);
  cr_assert_lt(s->id, MAX_FREED);
  cr_assert_not(f->by_id[s->id], "storage %llu freed twice",
                (unsigned long long)s->id);
  cr_assert_eq(s->refs, 0, "storage %llu freed with %u references",
               (unsigned long long)s->id, s->refs);
  cr_assert_null(td__storage_find(&reg, s->id), "freed while registered");
  f->by_id[s->id] = 1;
  f->ids[f->n++] = s->id;
  free(s);
}

static int was_freed(uint64_t id) {
  return id < MAX_FREED && freed.by_id[id];
}
static const td__peer peer_a = {100, 1000, 1000};
static const td__peer peer_b = {200, 1000, 1000};

static void setup(void) {
  memset(&freed, 0, sizeof(freed));
  td__registry_init(&reg, 1u << 30, record_free, &freed);
}

static void teardown(void) {
  td__registry_free(&reg);
}

TestSuite(registry, .init = setup, .fini = teardown, .timeout = 30);

/* Creates a storage of nbytes held once read-write by h; returns its id. */
static uint64_t make(td__holdings *h, uint64_t nbytes) {
  td__storage *s = calloc(1, sizeof(*s));
  cr_assert_not_null(s);
  s->id = reg.next_id++;
  s->nbytes = nbytes;
  s->device = TD_CPU;
  s->owner = h->peer;
  snprintf(s->name, sizeof(s->name), "/tensord.test.%llu",
           (unsigned long long)s->id);
  /* As the daemon does: charge the bytes, then register. */
  cr_assert_eq(td__charge(&reg, h->peer.uid, nbytes, 1, NULL, 0), 0);
  cr_assert_eq(td__storage_insert(&reg, s, h), 0);
  return s->id;
}

static td__storage *find(uint64_t id) {
  td__storage *s = td__storage_find(&reg, id);
  cr_assert_not_null(s, "storage %llu is live", (unsigned long long)id);
  return s;
}

static td_view whole(uint64_t nbytes) {
  td_view v;
  int64_t n = (int64_t)nbytes;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, &n, &v), 0);
  return v;
}

static void publish(const char *key, uint64_t id) {
  td__storage *s = find(id);
  td_view v = whole(s->nbytes);
  td__key *k = NULL;
  cr_assert_eq(td__key_publish(&reg, key, strlen(key), s, 1000, &v, &k), 0);
  cr_assert_not_null(k);
  cr_assert_eq(k->storage, s);
}

static void unpublish(const char *key) {
  td__key *k = td__key_find(&reg, key, strlen(key));
  cr_assert_not_null(k, "key '%s' is published", key);
  td__key_remove(&reg, k);
}

/* ---- references ---- */

Test(registry, insert_gives_one_read_write_ref) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t id = make(&h, 4096);
  cr_assert_eq(id, 1, "ids start at 1");
  td__storage *s = find(id);
  cr_assert_eq(s->refs, 1);
  td__ref *r = td__ref_find(&h, id);
  cr_assert_not_null(r);
  cr_assert_eq(r->rw, 1);
  cr_assert_eq(r->ro, 0);
  cr_assert_eq(r->storage, s);
  cr_assert_eq(r->peer->pid, peer_a.pid);
  cr_assert_eq(s->holders, r);
  cr_assert_eq(h.nrefs, 1);
  cr_assert_eq(reg.nholdings, 1);
  cr_assert_eq(reg.bytes_used, 4096);
  cr_assert_eq(reg.storages.count, 1);
  cr_assert_eq(reg.first, s);
  cr_assert_eq(reg.last, s);
  cr_assert_eq(make(&h, 1), 2, "ids grow");
  td__holdings_clear(&reg, &h);
  cr_assert_eq(freed.n, 2);
}

Test(registry, ref_add_and_drop_count_by_mode) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t id = make(&h, 64);
  td__storage *s = find(id);
  uint32_t had = 99;
  cr_assert_eq(td__ref_add(&reg, &h, s, 1, &had), 0);
  cr_assert_eq(had, 0, "no read-only reference before");
  cr_assert_eq(td__ref_add(&reg, &h, s, 1, &had), 0);
  cr_assert_eq(had, 1);
  cr_assert_eq(td__ref_add(&reg, &h, s, 0, &had), 0);
  cr_assert_eq(had, 1, "the read-write count, not the total");
  cr_assert_eq(td__ref_add(&reg, &h, s, 0, NULL), 0, "had may be NULL");
  td__ref *r = td__ref_find(&h, id);
  cr_assert_eq(r->rw, 3);
  cr_assert_eq(r->ro, 2);
  cr_assert_eq(s->refs, 5);
  cr_assert_eq(h.nrefs, 5);
  cr_assert_eq(reg.nholdings, 1, "one holdings, however many refs");

  cr_assert_eq(td__ref_drop(&reg, &h, id, 1, 2), 0);
  cr_assert_eq(r->ro, 0);
  cr_assert_eq(r->rw, 3);
  cr_assert_eq(td__ref_find(&h, id), r, "the ref stays while rw remain");
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 2), 0);
  cr_assert_eq(r->rw, 1);
  cr_assert_eq(s->refs, 1);
  cr_assert_eq(h.nrefs, 1);
  cr_assert_eq(freed.n, 0);
  cr_assert_eq(td__ref_add(&reg, &h, s, 1, &had), 0);
  cr_assert_eq(had, 0, "read-only count went back to 0");
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 1), 0);
  cr_assert_eq(freed.n, 0, "the read-only ref keeps it");
  cr_assert_eq(td__ref_drop(&reg, &h, id, 1, 1), 0);
  cr_assert_eq(freed.n, 1);
  cr_assert_eq(freed.ids[0], id);
  cr_assert_null(td__ref_find(&h, id));
  cr_assert_null(td__storage_find(&reg, id));
  cr_assert_eq(h.nrefs, 0);
  cr_assert_eq(reg.nholdings, 0);
  cr_assert_eq(reg.bytes_used, 0);
  td__holdings_clear(&reg, &h);
}

Test(registry, dropping_more_than_held_changes_nothing) {
  td__holdings h, o;
  td__holdings_init(&h, &peer_a);
  td__holdings_init(&o, &peer_b);
  uint64_t id = make(&h, 64);
  td__storage *s = find(id);
  cr_assert_eq(td__ref_add(&reg, &h, s, 1, NULL), 0);
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 2), TD_ENOENT, "holds 1 rw");
  cr_assert_eq(td__ref_drop(&reg, &h, id, 1, 2), TD_ENOENT, "holds 1 ro");
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 0), TD_ENOENT, "count 0");
  cr_assert_eq(td__ref_drop(&reg, &h, id + 1, 0, 1), TD_ENOENT, "no such id");
  cr_assert_eq(td__ref_drop(&reg, &o, id, 0, 1), TD_ENOENT,
               "another holder's reference");
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, UINT32_MAX), TD_ENOENT);
  td__ref *r = td__ref_find(&h, id);
  cr_assert_eq(r->rw, 1);
  cr_assert_eq(r->ro, 1);
  cr_assert_eq(s->refs, 2);
  cr_assert_eq(h.nrefs, 2);
  cr_assert_eq(o.nrefs, 0);
  cr_assert_eq(reg.nholdings, 1);
  cr_assert_eq(freed.n, 0);
  td__holdings_clear(&reg, &h);
  td__holdings_clear(&reg, &o);
  cr_assert_eq(freed.n, 1);
}

Test(registry, storage_is_freed_exactly_when_last_ref_goes) {
  td__holdings a, b;
  td__holdings_init(&a, &peer_a);
  td__holdings_init(&b, &peer_b);
  uint64_t id = make(&a, 100);
  td__storage *s = find(id);
  cr_assert_eq(td__ref_add(&reg, &b, s, 1, NULL), 0);
  cr_assert_eq(td__ref_add(&reg, &b, s, 1, NULL), 0);
  publish("k1", id);
  publish("k2", id);
  cr_assert_eq(s->refs, 5);
  cr_assert_eq(reg.nholdings, 2);
  cr_assert_eq(td__ref_drop(&reg, &a, id, 0, 1), 0);
  cr_assert_eq(reg.nholdings, 1);
  cr_assert_eq(td__ref_drop(&reg, &b, id, 1, 2), 0, "two at once");
  cr_assert_eq(reg.nholdings, 0);
  cr_assert_eq(freed.n, 0, "two keys still hold it");
  cr_assert_eq(s->refs, 2);
  cr_assert_null(s->holders);
  unpublish("k2");
  cr_assert_eq(freed.n, 0);
  cr_assert_eq(reg.bytes_used, 100);
  unpublish("k1");
  cr_assert_eq(freed.n, 1);
  cr_assert_eq(freed.ids[0], id);
  cr_assert_eq(reg.bytes_used, 0);
  cr_assert_eq(reg.keys.count, 0);
  cr_assert_null(reg.first);
  cr_assert_null(reg.last);
  td__holdings_clear(&reg, &a);
  td__holdings_clear(&reg, &b);
}

Test(registry, dropping_several_refs_at_once_frees_when_they_were_all) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t id = make(&h, 8);
  td__storage *s = find(id);
  for (int i = 0; i < 9; i++)
    cr_assert_eq(td__ref_add(&reg, &h, s, 0, NULL), 0);
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 9), 0);
  cr_assert_eq(freed.n, 0);
  cr_assert_eq(s->refs, 1);
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 1), 0);
  cr_assert_eq(freed.n, 1);
  id = make(&h, 8);
  s = find(id);
  for (int i = 0; i < 9; i++)
    cr_assert_eq(td__ref_add(&reg, &h, s, 0, NULL), 0);
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 10), 0);
  cr_assert_eq(freed.n, 2);
  cr_assert_eq(freed.ids[1], id);
  td__holdings_clear(&reg, &h);
}

/* ---- keys ---- */

Test(registry, key_holds_its_own_reference) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t id = make(&h, 10);
  publish("weights", id);
  td__key *k = td__key_find(&reg, "weights", 7);
  cr_assert_not_null(k);
  cr_assert_eq(k->len, 7);
  cr_assert_str_eq(k->name, "weights");
  cr_assert_null(td__key_find(&reg, "weight", 6));
  cr_assert_null(td__key_find(&reg, "weights2", 8));
  cr_assert_eq(find(id)->keys, k);
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 1), 0);
  cr_assert_eq(freed.n, 0, "the key keeps it");
  cr_assert_eq(find(id)->refs, 1);
  unpublish("weights");
  cr_assert_eq(freed.n, 1);
  td__holdings_clear(&reg, &h);
}

/* ---- events: a key's event is its publisher's connection's ---- */

static td__key *key(const char *name) {
  td__key *k = td__key_find(&reg, name, strlen(name));
  cr_assert_not_null(k, "key '%s' is published", name);
  return k;
}

static void set_event(const char *name, td__holdings *by, uint8_t fill) {
  uint8_t ev[64];
  memset(ev, fill, sizeof(ev));
  td__key_set_event(key(name), by, ev);
}

Test(registry, a_publishers_events_go_with_it_and_no_one_elses) {
  td__holdings a, b;
  td__holdings_init(&a, &peer_a);
  td__holdings_init(&b, &peer_b);
  uint64_t id = make(&a, 10);
  publish("x", id);
  publish("y", id);
  publish("z", id);
  set_event("x", &a, 1);
  set_event("y", &a, 2);
  set_event("z", &b, 3);
  cr_assert(key("x")->has_event && key("x")->evby == &a);
  cr_assert_eq(key("y")->event[0], 2);
  cr_assert_eq(td__holdings_drop_events(&a), 2);
  cr_assert_not(key("x")->has_event);
  cr_assert_not(key("y")->has_event);
  cr_assert_null(key("x")->evby);
  cr_assert(key("z")->has_event, "b's event stays");
  cr_assert_eq(td__holdings_drop_events(&a), 0, "nothing left to drop");
  /* Going, b drops its own too (td__holdings_clear_some's first call). */
  td__holdings_clear(&reg, &b);
  cr_assert_not(key("z")->has_event);
  cr_assert_eq(find(id)->refs, 4, "events are no references");
  td__holdings_clear(&reg, &a);
}

Test(registry, a_republish_or_unpublish_takes_the_event_from_its_publisher) {
  td__holdings a, b;
  td__holdings_init(&a, &peer_a);
  td__holdings_init(&b, &peer_b);
  uint64_t id = make(&a, 10);
  publish("x", id);
  publish("y", id);
  set_event("x", &a, 1);
  set_event("y", &a, 2);
  /* Another publish of x (by anyone) names new work, or none. */
  publish("x", id);
  cr_assert_not(key("x")->has_event);
  /* An unpublished key leaves a's list: a's going must not touch it. */
  unpublish("y");
  cr_assert_null(a.events, "a carries no event any more");
  /* A new event replaces the old, publisher and all. */
  set_event("x", &a, 4);
  set_event("x", &b, 5);
  cr_assert_null(a.events);
  cr_assert_eq(b.events, key("x"));
  cr_assert_eq(key("x")->event[63], 5);
  /* An event without a known publisher stays until the key changes. */
  set_event("x", NULL, 6);
  cr_assert_null(b.events);
  cr_assert_eq(td__holdings_drop_events(&b), 0);
  cr_assert(key("x")->has_event);
  td__holdings_clear(&reg, &a);
  td__holdings_clear(&reg, &b);
}

Test(registry, publish_replaces_and_old_storage_may_go) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 10), b = make(&h, 20);
  publish("k", a);
  cr_assert_eq(td__ref_drop(&reg, &h, a, 0, 1), 0);
  cr_assert_eq(find(a)->refs, 1, "only the key holds a");
  publish("k", b);
  cr_assert_eq(freed.n, 1, "a lost its key reference and went");
  cr_assert_eq(freed.ids[0], a);
  td__key *k = td__key_find(&reg, "k", 1);
  cr_assert_eq(k->storage, find(b));
  cr_assert_eq(find(b)->refs, 2);
  cr_assert_eq(reg.keys.count, 1, "replaced, not added");
  cr_assert_eq(reg.bytes_used, 20);
  td__holdings_clear(&reg, &h);
  cr_assert_eq(freed.n, 1, "b is still published");
  unpublish("k");
  cr_assert_eq(freed.n, 2);
}

Test(registry, publish_replacing_keeps_old_storage_someone_holds) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 10), b = make(&h, 20);
  publish("k", a);
  publish("k", b);
  cr_assert_eq(freed.n, 0);
  cr_assert_eq(find(a)->refs, 1);
  cr_assert_null(find(a)->keys);
  cr_assert_eq(find(b)->refs, 2);
  td__holdings_clear(&reg, &h);
  cr_assert_eq(freed.n, 1);
  cr_assert_eq(freed.ids[0], a);
  unpublish("k");
  cr_assert_eq(freed.n, 2);
}

Test(registry, publishing_same_key_onto_same_storage_frees_nothing) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 10);
  publish("k", a);
  cr_assert_eq(td__ref_drop(&reg, &h, a, 0, 1), 0);
  cr_assert_eq(find(a)->refs, 1, "the key's reference is the only one");
  td__storage *s = find(a);
  td_view v;
  int64_t shape[1] = {5};
  cr_assert_eq(td_view_contiguous(TD_INT16, 1, shape, &v), 0);
  td__key *k;
  cr_assert_eq(td__key_publish(&reg, "k", 1, s, 1000, &v, &k), 0);
  cr_assert_eq(freed.n, 0);
  cr_assert_eq(s->refs, 1);
  cr_assert_eq(k->view.dtype, TD_INT16, "the new view replaced the old");
  cr_assert_eq(reg.keys.count, 1);
  unpublish("k");
  cr_assert_eq(freed.n, 1);
  td__holdings_clear(&reg, &h);
}

Test(registry, keys_are_bytes_not_c_strings) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 10), b = make(&h, 10);
  td_view v = whole(10);
  td__key *k1, *k2;
  cr_assert_eq(td__key_publish(&reg, "ab\0c", 4, find(a), 1000, &v, &k1), 0);
  cr_assert_eq(td__key_publish(&reg, "ab\0d", 4, find(b), 1000, &v, &k2), 0);
  cr_assert_neq(k1, k2);
  cr_assert_eq(reg.keys.count, 2);
  cr_assert_eq(td__key_find(&reg, "ab\0c", 4), k1);
  cr_assert_eq(td__key_find(&reg, "ab\0d", 4), k2);
  cr_assert_null(td__key_find(&reg, "ab", 2));
  td__key_remove(&reg, k1);
  td__key_remove(&reg, k2);
  td__holdings_clear(&reg, &h);
  cr_assert_eq(freed.n, 2);
}

Test(registry, many_keys_on_one_storage) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 10);
  char key[32];
  for (int i = 0; i < 100; i++) {
    snprintf(key, sizeof(key), "key/%d", i);
    publish(key, a);
  }
  cr_assert_eq(find(a)->refs, 101);
  td__holdings_clear(&reg, &h);
  for (int i = 0; i < 100; i += 2) {
    snprintf(key, sizeof(key), "key/%d", i);
    unpublish(key);
  }
  cr_assert_eq(freed.n, 0);
  cr_assert_eq(find(a)->refs, 50);
  for (int i = 1; i < 100; i += 2) {
    snprintf(key, sizeof(key), "key/%d", i);
    unpublish(key);
  }
  cr_assert_eq(freed.n, 1);
}

Test(registry, drop_keys_frees_only_what_keys_alone_held) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 1), b = make(&h, 2), c = make(&h, 3);
  publish("a1", a);
  publish("a2", a);
  publish("b", b);
  publish("c", c);
  cr_assert_eq(td__ref_drop(&reg, &h, a, 0, 1), 0);
  cr_assert_eq(td__ref_drop(&reg, &h, c, 0, 1), 0);
  td__registry_drop_keys(&reg);
  cr_assert_eq(reg.keys.count, 0);
  cr_assert_eq(freed.n, 2);
  cr_assert(was_freed(a) && was_freed(c));
  cr_assert_eq(find(b)->refs, 1);
  td__holdings_clear(&reg, &h);
  cr_assert_eq(freed.n, 3);
}

/* ---- holdings ---- */

Test(registry, holdings_clear_frees_exactly_what_nobody_else_holds) {
  td__holdings a, b;
  td__holdings_init(&a, &peer_a);
  td__holdings_init(&b, &peer_b);
  uint64_t ids[6];
  for (int i = 0; i < 6; i++)
    ids[i] = make(&a, 10);
  /* 0: only a. 1: a and b. 2: a and a key. 3: a, many refs of both modes.
   * 4: b only (a dropped). 5: only a, read-only too. */
  cr_assert_eq(td__ref_add(&reg, &b, find(ids[1]), 1, NULL), 0);
  publish("two", ids[2]);
  for (int i = 0; i < 5; i++) {
    cr_assert_eq(td__ref_add(&reg, &a, find(ids[3]), 0, NULL), 0);
    cr_assert_eq(td__ref_add(&reg, &a, find(ids[3]), 1, NULL), 0);
  }
  cr_assert_eq(td__ref_add(&reg, &b, find(ids[4]), 0, NULL), 0);
  cr_assert_eq(td__ref_drop(&reg, &a, ids[4], 0, 1), 0);
  cr_assert_eq(td__ref_add(&reg, &a, find(ids[5]), 1, NULL), 0);
  cr_assert_eq(reg.nholdings, 2);
  cr_assert_eq(a.nrefs, 1 + 1 + 1 + 11 + 2);
  td__holdings_clear(&reg, &a);
  cr_assert_eq(a.nrefs, 0);
  cr_assert_eq(a.refs.count, 0);
  cr_assert_eq(reg.nholdings, 1);
  cr_assert_eq(freed.n, 3);
  cr_assert(was_freed(ids[0]) && was_freed(ids[3]) && was_freed(ids[5]));
  cr_assert_eq(find(ids[1])->refs, 1);
  cr_assert_eq(find(ids[2])->refs, 1);
  cr_assert_eq(find(ids[4])->refs, 1);
  cr_assert_null(find(ids[2])->holders);
  cr_assert_eq(reg.bytes_used, 30);
  td__holdings_clear(&reg, &b);
  cr_assert_eq(reg.nholdings, 0);
  cr_assert_eq(freed.n, 5);
  unpublish("two");
  cr_assert_eq(freed.n, 6);
  cr_assert_eq(reg.bytes_used, 0);
}

Test(registry, holdings_clear_of_empty_holdings_is_harmless) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  td__holdings_clear(&reg, &h);
  td__holdings_clear(&reg, &h);
  cr_assert_eq(reg.nholdings, 0);
  cr_assert_eq(freed.n, 0);
}

Test(registry, holders_list_names_every_holding) {
  td__holdings a, b;
  td__holdings_init(&a, &peer_a);
  td__holdings_init(&b, &peer_b);
  uint64_t id = make(&a, 10);
  td__storage *s = find(id);
  cr_assert_eq(td__ref_add(&reg, &b, s, 1, NULL), 0);
  int seen_a = 0, seen_b = 0, n = 0;
  for (td__ref *r = s->holders; r; r = r->snext, n++) {
    seen_a += r->peer->pid == peer_a.pid;
    seen_b += r->peer->pid == peer_b.pid;
  }
  cr_assert_eq(n, 2);
  cr_assert(seen_a == 1 && seen_b == 1);
  cr_assert_eq(td__ref_drop(&reg, &a, id, 0, 1), 0);
  cr_assert_eq(s->holders->peer->pid, peer_b.pid);
  cr_assert_null(s->holders->snext);
  cr_assert_null(s->holders->sprev);
  td__holdings_clear(&reg, &b);
  td__holdings_clear(&reg, &a);
}

/* ---- paging ---- */

Test(registry, storage_after_pages_in_id_order) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  cr_assert_null(td__storage_after(&reg, 0), "empty registry");
  cr_assert_null(td__storage_after(&reg, 5));
  uint64_t ids[10];
  for (int i = 0; i < 10; i++)
    ids[i] = make(&h, 1);
  /* Free 1, 4, 5, 6 and 10: the first, a run in the middle and the last. */
  cr_assert_eq(td__ref_drop(&reg, &h, ids[0], 0, 1), 0);
  for (int i = 3; i <= 5; i++)
    cr_assert_eq(td__ref_drop(&reg, &h, ids[i], 0, 1), 0);
  cr_assert_eq(td__ref_drop(&reg, &h, ids[9], 0, 1), 0);
  /* Live: 2 3 7 8 9. */
  static const struct {
    uint64_t after, want;
  } cases[] = {{0, 2}, {1, 2}, {2, 3}, {3, 7}, {4, 7},  {5, 7},
               {6, 7}, {7, 8}, {8, 9}, {9, 0}, {10, 0}, {1000, 0}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    td__storage *s = td__storage_after(&reg, cases[i].after);
    uint64_t got = s ? s->id : 0;
    cr_assert_eq(got, cases[i].want, "after %llu: got %llu, expected %llu",
                 (unsigned long long)cases[i].after, (unsigned long long)got,
                 (unsigned long long)cases[i].want);
  }
  /* Paging from 0 visits every live storage once, in order. */
  uint64_t prev = 0;
  int n = 0;
  for (td__storage *s = td__storage_after(&reg, 0); s;
       s = td__storage_after(&reg, s->id), n++) {
    cr_assert_gt(s->id, prev);
    prev = s->id;
  }
  cr_assert_eq(n, 5);
  td__holdings_clear(&reg, &h);
}

Test(registry, storage_after_freed_cursor_on_a_long_list) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  enum { N = 2000 };
  for (int i = 0; i < N; i++)
    make(&h, 1);
  /* Free every id divisible by 3 or 7. */
  for (uint64_t id = 1; id <= N; id++)
    if (id % 3 == 0 || id % 7 == 0)
      cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 1), 0);
  for (uint64_t after = 0; after <= N + 1; after++) {
    uint64_t want = 0;
    for (uint64_t id = after + 1; id <= N; id++)
      if (id % 3 != 0 && id % 7 != 0) {
        want = id;
        break;
      }
    td__storage *s = td__storage_after(&reg, after);
    cr_assert_eq(s ? s->id : 0, want, "after %llu", (unsigned long long)after);
  }
  td__holdings_clear(&reg, &h);
}

/* ---- accounting ---- */

Test(registry, bytes_used_counts_live_storages) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t a = make(&h, 1000), b = make(&h, 1u << 20), c = make(&h, 1);
  cr_assert_eq(reg.bytes_used, 1000 + (1u << 20) + 1);
  publish("b", b);
  cr_assert_eq(td__ref_drop(&reg, &h, b, 0, 1), 0);
  cr_assert_eq(reg.bytes_used, 1000 + (1u << 20) + 1, "b still published");
  cr_assert_eq(td__ref_drop(&reg, &h, a, 0, 1), 0);
  cr_assert_eq(reg.bytes_used, (1u << 20) + 1);
  unpublish("b");
  cr_assert_eq(reg.bytes_used, 1);
  cr_assert_eq(td__ref_drop(&reg, &h, c, 0, 1), 0);
  cr_assert_eq(reg.bytes_used, 0);
  cr_assert_eq(reg.bytes_committed, 0);
  cr_assert_eq(td__usage_of(&reg, peer_a.uid), 0);
  cr_assert_eq(reg.capacity, 1u << 30);
  td__holdings_clear(&reg, &h);
}

/* ---- limits of the counts ---- */

Test(registry, reference_counts_refuse_to_overflow) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  uint64_t id = make(&h, 64);
  td__storage *s = find(id);
  td__ref *r = td__ref_find(&h, id);
  /* As if h had opened it read-write 2^32 - 2 more times. */
  r->rw = UINT32_MAX;
  s->refs = UINT32_MAX;
  h.nrefs = UINT32_MAX;
  uint32_t had = 7;
  cr_assert_eq(td__ref_add(&reg, &h, s, 0, &had), TD_EOVERFLOW);
  cr_assert_eq(td__ref_add(&reg, &h, s, 1, &had), TD_EOVERFLOW,
               "the storage's own count is full too");
  cr_assert_eq(had, 7, "nothing reported");
  cr_assert_eq(r->rw, UINT32_MAX, "nothing changed");
  cr_assert_eq(r->ro, 0);
  cr_assert_eq(s->refs, UINT32_MAX);
  cr_assert_eq(h.nrefs, UINT32_MAX);
  td_view v = whole(64);
  td__key *k = NULL;
  cr_assert_eq(td__key_publish(&reg, "full", 4, s, 1000, &v, &k), TD_EOVERFLOW);
  cr_assert_null(k);
  cr_assert_null(td__key_find(&reg, "full", 4));
  cr_assert_eq(s->refs, UINT32_MAX);
  /* Another holder is refused as well; below the top, all works again. */
  td__holdings h2;
  td__holdings_init(&h2, &peer_b);
  cr_assert_eq(td__ref_add(&reg, &h2, s, 1, &had), TD_EOVERFLOW);
  cr_assert_null(td__ref_find(&h2, id));
  r->rw = UINT32_MAX - 1;
  s->refs = UINT32_MAX - 1;
  h.nrefs = UINT32_MAX - 1;
  cr_assert_eq(td__ref_add(&reg, &h2, s, 1, &had), 0);
  cr_assert_eq(s->refs, UINT32_MAX);
  cr_assert_eq(td__ref_drop(&reg, &h2, id, 1, 1), 0);
  cr_assert_eq(td__ref_drop(&reg, &h, id, 0, UINT32_MAX - 2), 0);
  cr_assert_eq(s->refs, 1);
  cr_assert_eq(freed.n, 0);
  td__holdings_clear(&reg, &h);
  td__holdings_clear(&reg, &h2);
  cr_assert(was_freed(id));
}

Test(registry, keys_count_against_the_uid_that_published_them) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  td__storage *s = find(make(&h, 64));
  td_view v = whole(64);
  td__key *k;
  cr_assert_eq(td__key_publish(&reg, "a", 1, s, 1000, &v, &k), 0);
  cr_assert_eq(td__key_publish(&reg, "b", 1, s, 1000, &v, &k), 0);
  cr_assert_eq(td__keys_of(&reg, 1000), 2);
  cr_assert_eq(td__keys_of(&reg, 2000), 0);
  /* Republished by another uid: the key is that uid's now. */
  cr_assert_eq(td__key_publish(&reg, "b", 1, s, 2000, &v, &k), 0);
  cr_assert_eq(k->uid, 2000);
  cr_assert_eq(td__keys_of(&reg, 1000), 1);
  cr_assert_eq(td__keys_of(&reg, 2000), 1);
  /* A prepared change that is abandoned counts nothing. */
  td__key_prep p;
  cr_assert_eq(td__key_prepare(&reg, "c", 1, s, 3000, &p), 0);
  td__key_abort(&reg, &p);
  cr_assert_null(td__key_find(&reg, "c", 1));
  cr_assert_eq(td__keys_of(&reg, 3000), 0);
  cr_assert_eq(reg.usage.count, 2, "uids 1000 and 2000, no empty entry");
  unpublish("b");
  cr_assert_eq(td__keys_of(&reg, 2000), 0);
  cr_assert_eq(reg.usage.count, 1, "uid 2000 counts nothing now");
  unpublish("a");
  cr_assert_eq(td__keys_of(&reg, 1000), 0);
  cr_assert_eq(td__usage_of(&reg, 1000), 64, "its bytes still count");
  td__holdings_clear(&reg, &h);
  cr_assert_eq(reg.usage.count, 0);
}

/* ---- keys: validation ---- */

static int valid(const char *key, size_t len) {
  char msg[128] = "";
  int err = td__key_validate(key, len, msg, sizeof(msg));
  if (err < 0)
    cr_assert_gt(strlen(msg), 0, "a reason is given");
  return err;
}

Test(registry, key_validation) {
  char buf[300];
  cr_assert_eq(valid("", 0), TD_EINVAL, "empty");
  memset(buf, 'a', sizeof(buf));
  cr_assert_eq(valid(buf, 255), 0, "exactly 255 bytes");
  cr_assert_eq(valid(buf, 256), TD_EINVAL, "256 bytes");
  cr_assert_eq(valid(buf, 1), 0);
  cr_assert_eq(valid("a\0b", 3), TD_EINVAL, "embedded NUL");
  cr_assert_eq(valid("\0", 1), TD_EINVAL);
  cr_assert_eq(valid("ab\xff", 3), TD_EINVAL, "0xff is never UTF-8");
  cr_assert_eq(valid("\x80", 1), TD_EINVAL, "lone continuation byte");
  cr_assert_eq(valid("\xc3", 1), TD_EINVAL, "truncated sequence");
  cr_assert_eq(valid("\xe2\x82", 2), TD_EINVAL, "truncated sequence");
  cr_assert_eq(valid("\xc3(", 2), TD_EINVAL, "bad continuation");
  cr_assert_eq(valid("\xc0\xaf", 2), TD_EINVAL, "overlong '/'");
  cr_assert_eq(valid("\xe0\x80\xaf", 3), TD_EINVAL, "overlong 3-byte");
  cr_assert_eq(valid("\xf0\x80\x80\xaf", 4), TD_EINVAL, "overlong 4-byte");
  cr_assert_eq(valid("\xc0\x80", 2), TD_EINVAL, "overlong NUL");
  cr_assert_eq(valid("\xed\xa0\x80", 3), TD_EINVAL, "surrogate U+D800");
  cr_assert_eq(valid("\xed\xbf\xbf", 3), TD_EINVAL, "surrogate U+DFFF");
  cr_assert_eq(valid("\xf4\x90\x80\x80", 4), TD_EINVAL, "past U+10FFFF");
  cr_assert_eq(valid("\xf8\x88\x80\x80\x80", 5), TD_EINVAL, "5-byte form");
  cr_assert_eq(valid("caf\xc3\xa9", 5), 0, "U+00E9");
  cr_assert_eq(valid("\xe2\x82\xac", 3), 0, "U+20AC");
  cr_assert_eq(valid("\xf0\x9f\x98\x80", 4), 0, "U+1F600");
  cr_assert_eq(valid("\xed\x9f\xbf", 3), 0, "U+D7FF");
  cr_assert_eq(valid("\xee\x80\x80", 3), 0, "U+E000");
  cr_assert_eq(valid("\xf4\x8f\xbf\xbf", 4), 0, "U+10FFFF");
  cr_assert_eq(valid("models/llama/layer.0/weight", 27), 0);
  /* 255 bytes that end in a complete multibyte sequence. */
  memset(buf, 'a', 252);
  memcpy(buf + 252, "\xe2\x82\xac", 3);
  cr_assert_eq(valid(buf, 255), 0);
  /* ... and one whose last sequence is cut by the length. */
  memset(buf, 'a', 253);
  memcpy(buf + 253, "\xe2\x82\xac", 3);
  cr_assert_eq(valid(buf, 255), TD_EINVAL);
  /* msg may be NULL. */
  cr_assert_eq(td__key_validate("", 0, NULL, 0), TD_EINVAL);
}

Test(registry, key_validation_messages_name_the_cause) {
  char msg[128];
  td__key_validate("a\0b", 3, msg, sizeof(msg));
  cr_assert(strstr(msg, "NUL") && strstr(msg, "1"), "'%s'", msg);
  td__key_validate("ab\xff", 3, msg, sizeof(msg));
  cr_assert(strstr(msg, "UTF-8") && strstr(msg, "2"), "'%s'", msg);
  char buf[300];
  memset(buf, 'a', sizeof(buf));
  td__key_validate(buf, 300, msg, sizeof(msg));
  cr_assert(strstr(msg, "300") && strstr(msg, "255"), "'%s'", msg);
}

/* ---- randomized, against a model ---- */

#define RH 5      /* holdings */
#define RMAX 4096 /* storages made, at most */
#define RKEYS 12  /* key names */

typedef struct model_storage {
  int live; /* the model says it should be registered */
  uint32_t rw[RH], ro[RH];
  uint64_t nbytes;
} model_storage;

typedef struct model {
  model_storage s[RMAX + 1]; /* by id */
  uint64_t key[RKEYS];       /* storage id named by each key, 0: none */
  uint64_t nmade;
} model;

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state % n);
}

static uint32_t model_refs(const model *m, uint64_t id) {
  uint32_t n = 0;
  for (int h = 0; h < RH; h++)
    n += m->s[id].rw[h] + m->s[id].ro[h];
  for (int k = 0; k < RKEYS; k++)
    n += m->key[k] == id;
  return n;
}

/* Marks storages the model says have no reference left as gone. */
static void model_collect(model *m) {
  for (uint64_t id = 1; id <= m->nmade; id++)
    if (m->s[id].live && model_refs(m, id) == 0)
      m->s[id].live = 0;
}

static uint64_t random_live(const model *m) {
  if (m->nmade == 0)
    return 0;
  for (int tries = 0; tries < 50; tries++) {
    uint64_t id = 1 + rnd((uint32_t)m->nmade);
    if (m->s[id].live)
      return id;
  }
  return 0;
}

/* Compares the registry with the model, in full. */
static void model_check(const model *m, td__holdings *hs, uint64_t step) {
  uint64_t live = 0, bytes = 0, nkeys = 0, nholdings = 0;
  for (int h = 0; h < RH; h++) {
    uint64_t n = 0;
    for (uint64_t id = 1; id <= m->nmade; id++)
      n += m->s[id].rw[h] + m->s[id].ro[h];
    cr_assert_eq(hs[h].nrefs, n,
                 "step %llu: holdings %d has %llu refs, "
                 "model %llu",
                 (unsigned long long)step, h, (unsigned long long)hs[h].nrefs,
                 (unsigned long long)n);
    nholdings += n > 0;
  }
  cr_assert_eq(reg.nholdings, nholdings, "step %llu: nholdings",
               (unsigned long long)step);
  for (uint64_t id = 1; id <= m->nmade; id++) {
    const model_storage *ms = &m->s[id];
    td__storage *s = td__storage_find(&reg, id);
    cr_assert_eq(s != NULL, ms->live, "step %llu: storage %llu %s",
                 (unsigned long long)step, (unsigned long long)id,
                 ms->live ? "was freed too early" : "was not freed");
    cr_assert_eq(was_freed(id), !ms->live, "step %llu: storage %llu free_fn",
                 (unsigned long long)step, (unsigned long long)id);
    if (!ms->live)
      continue;
    live++;
    bytes += ms->nbytes;
    cr_assert_eq(s->refs, model_refs(m, id), "step %llu: storage %llu refs",
                 (unsigned long long)step, (unsigned long long)id);
    int nh = 0, want_nh = 0;
    for (td__ref *r = s->holders; r; r = r->snext)
      nh++;
    for (int h = 0; h < RH; h++) {
      td__ref *r = td__ref_find(&hs[h], id);
      uint32_t rw = r ? r->rw : 0, ro = r ? r->ro : 0;
      cr_assert(rw == ms->rw[h] && ro == ms->ro[h],
                "step %llu: storage %llu holdings %d: rw %u ro %u, model "
                "rw %u ro %u",
                (unsigned long long)step, (unsigned long long)id, h, rw, ro,
                ms->rw[h], ms->ro[h]);
      cr_assert_eq(r != NULL, rw + ro > 0, "no empty ref is kept");
      want_nh += rw + ro > 0;
    }
    cr_assert_eq(nh, want_nh, "step %llu: storage %llu holders list",
                 (unsigned long long)step, (unsigned long long)id);
  }
  cr_assert_eq(reg.storages.count, live);
  cr_assert_eq(reg.bytes_used, bytes, "step %llu: bytes_used",
               (unsigned long long)step);
  /* The id-ordered list holds exactly the live storages. */
  uint64_t n = 0, prev = 0;
  for (td__storage *s = reg.first; s; s = s->next, n++) {
    cr_assert_gt(s->id, prev, "list in id order");
    cr_assert_eq(s->prev ? s->prev->id : 0, prev, "back links");
    prev = s->id;
  }
  cr_assert_eq(n, live);
  cr_assert_eq(reg.last ? reg.last->id : 0, prev);
  for (int k = 0; k < RKEYS; k++) {
    char name[16];
    snprintf(name, sizeof(name), "key%d", k);
    td__key *key = td__key_find(&reg, name, strlen(name));
    cr_assert_eq(key ? key->storage->id : 0, m->key[k], "step %llu: key %s",
                 (unsigned long long)step, name);
    nkeys += m->key[k] != 0;
  }
  cr_assert_eq(reg.keys.count, nkeys);
}

static void random_ops(uint64_t seed, int steps) {
  static model m;
  static td__holdings hs[RH];
  memset(&m, 0, sizeof(m));
  rng_state = seed;
  for (int h = 0; h < RH; h++) {
    td__peer p = {1000 + h, 1000, 1000};
    td__holdings_init(&hs[h], &p);
  }
  for (int step = 0; step < steps; step++) {
    int h = (int)rnd(RH);
    uint32_t op = rnd(100);
    uint64_t id = random_live(&m);
    if (op < 15 || id == 0) { /* create */
      if (m.nmade == RMAX)
        continue;
      uint64_t nbytes = 1 + rnd(1u << 16);
      uint64_t nid = make(&hs[h], nbytes);
      cr_assert_eq(nid, m.nmade + 1);
      m.nmade = nid;
      m.s[nid].live = 1;
      m.s[nid].nbytes = nbytes;
      m.s[nid].rw[h] = 1;
    } else if (op < 40) { /* add a reference */
      int ro = (int)rnd(2);
      uint32_t had = 12345;
      cr_assert_eq(td__ref_add(&reg, &hs[h], find(id), ro, &had), 0);
      uint32_t *cnt = ro ? &m.s[id].ro[h] : &m.s[id].rw[h];
      cr_assert_eq(had, *cnt, "step %d: had", step);
      (*cnt)++;
    } else if (op < 70) { /* drop references, sometimes too many */
      int ro = (int)rnd(2);
      uint32_t *cnt = ro ? &m.s[id].ro[h] : &m.s[id].rw[h];
      uint32_t count = 1 + rnd(3);
      int err = td__ref_drop(&reg, &hs[h], id, ro, count);
      if (count > *cnt) {
        cr_assert_eq(err, TD_ENOENT, "step %d: drop %u of %u", step, count,
                     *cnt);
      } else {
        cr_assert_eq(err, 0, "step %d", step);
        *cnt -= count;
      }
    } else if (op < 80) { /* publish, maybe replacing */
      int k = (int)rnd(RKEYS);
      char name[16];
      snprintf(name, sizeof(name), "key%d", k);
      publish(name, id);
      m.key[k] = id;
    } else if (op < 88) { /* unpublish */
      int k = (int)rnd(RKEYS);
      if (m.key[k] != 0) {
        char name[16];
        snprintf(name, sizeof(name), "key%d", k);
        unpublish(name);
        m.key[k] = 0;
      }
    } else if (op < 91) { /* a connection goes */
      td__holdings_clear(&reg, &hs[h]);
      td__peer p = {1000 + h, 1000, 1000};
      td__holdings_init(&hs[h], &p);
      for (uint64_t i = 1; i <= m.nmade; i++)
        m.s[i].rw[h] = m.s[i].ro[h] = 0;
    } else { /* page from a random cursor */
      uint64_t after = rnd((uint32_t)m.nmade + 2);
      uint64_t want = 0;
      for (uint64_t i = after + 1; i <= m.nmade && want == 0; i++)
        if (m.s[i].live)
          want = i;
      td__storage *s = td__storage_after(&reg, after);
      cr_assert_eq(s ? s->id : 0, want, "step %d: after %llu", step,
                   (unsigned long long)after);
    }
    model_collect(&m);
    /* A full check is O(storages); do it often, not always. */
    if (step % 7 == 0 || step == steps - 1)
      model_check(&m, hs, (uint64_t)step);
  }
  for (int h = 0; h < RH; h++) {
    td__holdings_clear(&reg, &hs[h]);
    for (uint64_t i = 1; i <= m.nmade; i++)
      m.s[i].rw[h] = m.s[i].ro[h] = 0;
    model_collect(&m);
    model_check(&m, hs, (uint64_t)steps + (uint64_t)h);
  }
  td__registry_drop_keys(&reg);
  memset(m.key, 0, sizeof(m.key));
  model_collect(&m);
  model_check(&m, hs, (uint64_t)steps + RH);
  cr_assert_eq(freed.n, m.nmade, "every storage freed exactly once");
  cr_assert_eq(reg.storages.count, 0);
  cr_assert_eq(reg.bytes_used, 0);
}

Test(registry, random_ops_match_a_model_seed_1, .timeout = 60) {
  random_ops(0x9e3779b97f4a7c15ull, 20000);
}

Test(registry, random_ops_match_a_model_seed_2, .timeout = 60) {
  random_ops(0x2545f4914f6cdd1dull, 20000);
}

Test(registry, random_ops_match_a_model_seed_3, .timeout = 60) {
  random_ops(12345, 20000);
}

Test(registry, storage_after_finds_the_next_across_wide_gaps) {
  td__holdings h;
  td__holdings_init(&h, &peer_a);
  enum { N = 6000 };
  for (int i = 0; i < N; i++)
    make(&h, 1);
  /* A wide gap with a few survivors in it, gaps of every width after it. */
  for (uint64_t id = 1; id <= N; id++) {
    int keep = id < 100 || (id < 4000 && id % 613 == 0) ||
               (id >= 4000 && (id * 2654435761u) % 100 < 10);
    if (!keep)
      cr_assert_eq(td__ref_drop(&reg, &h, id, 0, 1), 0);
  }
  uint64_t want = 0;
  for (uint64_t after = N + 1; after-- > 0;) {
    /* want: the least live id > after, found going down. */
    td__storage *s = td__storage_after(&reg, after);
    cr_assert_eq(s ? s->id : 0, want, "after %llu", (unsigned long long)after);
    if (after > 0 && after <= N && td__storage_find(&reg, after))
      want = after;
  }
  td__holdings_clear(&reg, &h);
}

/* ---- clearing in slices ---- */

/* The references held to s, as its holders and keys list them. */
static uint32_t listed_refs(const td__storage *s) {
  uint32_t n = 0;
  for (const td__ref *r = s->holders; r; r = r->snext)
    n += r->rw + r->ro;
  for (const td__key *k = s->keys; k; k = k->snext)
    n++;
  return n;
}

Test(registry, clear_some_drops_at_most_max_storages_per_call) {
  enum { N = 20000, SLICE = 1024 };
  td__holdings h, o;
  td__holdings_init(&h, &peer_a);
  td__holdings_init(&o, &peer_b);
  static uint64_t ids[N];
  size_t kept = 0;
  for (size_t i = 0; i < N; i++) {
    ids[i] = make(&h, 64);
    td__storage *s = find(ids[i]);
    if (i % 3 == 0) /* a read-only reference too: one ref, two counts */
      cr_assert_eq(td__ref_add(&reg, &h, s, 1, NULL), 0);
    if (i % 1000 == 7) { /* another holder keeps it */
      cr_assert_eq(td__ref_add(&reg, &o, s, 1, NULL), 0);
      kept++;
    } else if (i % 1000 == 8) { /* a key keeps it */
      char key[32];
      snprintf(key, sizeof(key), "k/%zu", i);
      publish(key, ids[i]);
      kept++;
    }
  }
  cr_assert_eq(reg.nholdings, 2);
  size_t left = N, calls = 0;
  while (left > 0) {
    size_t freed_before = freed.n;
    size_t now = td__holdings_clear_some(&reg, &h, SLICE);
    calls++;
    cr_assert_eq(now, left > SLICE ? left - SLICE : 0,
                 "call %zu: %zu storage(s) left of %zu", calls, now, left);
    cr_assert_eq(h.refs.count, now);
    cr_assert_leq(freed.n - freed_before, SLICE);
    left = now;
    /* In between, every live storage lists exactly its references. */
    for (const td__storage *s = reg.first; s; s = s->next)
      cr_assert_eq(listed_refs(s), s->refs, "storage %llu",
                   (unsigned long long)s->id);
  }
  cr_assert_eq(calls, (N + SLICE - 1) / SLICE);
  cr_assert_eq(h.nrefs, 0);
  cr_assert_eq(h.refs.nbuckets, 0, "an empty holdings' table is freed");
  cr_assert_eq(td__holdings_clear_some(&reg, &h, SLICE), 0, "idempotent");
  cr_assert_eq(reg.nholdings, 1, "o still holds references");
  cr_assert_eq(freed.n, N - kept, "every storage nobody else holds, once");
  cr_assert_eq(reg.storages.count, kept);
  for (size_t i = 0; i < N; i++) {
    int other = i % 1000 == 7 || i % 1000 == 8;
    cr_assert_eq(was_freed(ids[i]), !other, "storage %llu",
                 (unsigned long long)ids[i]);
    for (const td__ref *r = other ? find(ids[i])->holders : NULL; r;
         r = r->snext)
      cr_assert_neq(r->peer, &h.peer, "storage %llu: h still listed",
                    (unsigned long long)ids[i]);
  }
  td__holdings_clear(&reg, &o);
  cr_assert_eq(reg.nholdings, 0);
  td__registry_drop_keys(&reg);
  cr_assert_eq(freed.n, N);
  cr_assert_eq(reg.bytes_used, 0);
  cr_assert_eq(td__usage_of(&reg, peer_a.uid), 0);
}

/* test_journal.c: --state-dir's records as values (daemon/engine/journal.c),
 * with no file and no daemon: a registry's keys go into a snapshot and come
 * back out of a replay; a torn or damaged tail ends the replay there. */
#include "journal.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static td__registry reg;
static td__holdings hold;
static const td__peer peer = {100, 1000, 1000};

static void gone(td__storage *s, void *arg) {
  (void)arg;
  free(s);
}

static void setup(void) {
  td__registry_init(&reg, 1u << 30, gone, NULL);
  td__holdings_init(&hold, &peer);
}

static void teardown(void) {
  td__holdings_clear(&reg, &hold);
  td__registry_free(&reg);
}

TestSuite(journal, .init = setup, .fini = teardown, .timeout = 30);

/* A storage of nbytes on device whose segment has prefix, held by hold. */
static td__storage *make(uint64_t nbytes, td_device device, const char *prefix) {
  td__storage *s = calloc(1, sizeof(*s));
  cr_assert_not_null(s);
  s->id = reg.next_id++;
  s->nbytes = nbytes;
  s->device = device;
  s->owner = peer;
  snprintf(s->name, sizeof(s->name), "%s%llu-00000000deadbeef", prefix,
           (unsigned long long)s->id);
  cr_assert_eq(td__charge(&reg, peer.uid, nbytes, 1, NULL, 0), 0);
  cr_assert_eq(td__storage_insert(&reg, s, &hold), 0);
  return s;
}

static void publish(const char *key, td__storage *s, int64_t n) {
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, &n, &v), 0);
  td__key *k;
  cr_assert_eq(td__key_publish(&reg, key, strlen(key), s, 1000, &v, &k), 0);
}

static int key_is(const td__putent *e, const char *key) {
  const ProtobufCBinaryData *k = &e->r->put->key;
  return k->len == strlen(key) && memcmp(k->data, key, k->len) == 0;
}

Test(journal, a_snapshot_replays_into_the_keys_it_holds) {
  td__storage *a = make(4096, TD_CPU, "/tensord.aaaa1111.");
  td__storage *b = make(64, TD_CPU, "/tensord.bbbb2222."); /* adopted */
  td__storage *g = make(4096, TD_CUDA, "/tensord.aaaa1111.");
  publish("w/a", a, 1024);
  publish("w/b", b, 16);
  publish("gpu", g, 1024); /* device memory dies with the daemon: not kept */
  uint8_t *buf;
  size_t len;
  cr_assert_eq(td__snapshot_build(&reg, "/tensord.aaaa1111.", 7, &buf, &len), 0);

  td__loaded l = {0};
  cr_assert_eq(td__replay(&l, buf, len, "snapshot"), len);
  cr_assert_eq(l.gen, 7);
  cr_assert_eq(l.nprefixes, 2, "this instance's prefix and the adopted one");
  cr_assert_str_eq(l.prefixes[0], "/tensord.aaaa1111.");
  cr_assert_str_eq(l.prefixes[1], "/tensord.bbbb2222.");
  const td__putent *e = l.first;
  cr_assert(e != NULL && key_is(e, "w/a"));
  cr_assert_str_eq(e->r->put->segment, a->name);
  cr_assert_eq(e->r->put->nbytes, 4096);
  cr_assert_eq(e->r->put->view->n_shape, 1);
  cr_assert_eq(e->r->put->view->shape[0], 1024);
  e = e->next;
  cr_assert(e != NULL && key_is(e, "w/b") && e->next == NULL);
  td__loaded_free(&l);
  free(buf);
}

Test(journal, a_later_put_replaces_and_a_del_removes) {
  td__storage *a = make(4096, TD_CPU, "/tensord.aaaa1111.");
  td_view v;
  int64_t n = 8;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, &n, &v), 0);
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  Tensord__StateKey m;
  Tensord__View vm;
  const char *keys[] = {"k1", "k2", "k1"};
  for (int i = 0; i < 3; i++) {
    td__rec_key(keys[i], 2, a, 1000, &v, 100 + i, &m, &vm);
    r.body_case = TENSORD__STATE_RECORD__BODY_PUT;
    r.put = &m;
    cr_assert_eq(td__rec_append(&buf, &len, &cap, &r), 0);
  }
  r.body_case = TENSORD__STATE_RECORD__BODY_DEL;
  r.del.data = (uint8_t *)"k2";
  r.del.len = 2;
  cr_assert_eq(td__rec_append(&buf, &len, &cap, &r), 0);

  td__loaded l = {0};
  cr_assert_eq(td__replay(&l, buf, len, "journal.1"), len);
  cr_assert(l.first != NULL && l.first == l.last && key_is(l.first, "k1"));
  cr_assert_eq(l.first->r->put->published_unix_ms, 102, "the last put wins");
  td__loaded_free(&l);
  free(buf);
}

Test(journal, a_torn_or_damaged_tail_ends_the_replay) {
  td__storage *a = make(4096, TD_CPU, "/tensord.aaaa1111.");
  td__storage *b = make(4096, TD_CPU, "/tensord.aaaa1111.");
  publish("x", a, 1024); /* the storages go in id order: x, then y */
  publish("y", b, 1024);
  uint8_t *buf;
  size_t len;
  cr_assert_eq(td__snapshot_build(&reg, "/tensord.aaaa1111.", 1, &buf, &len), 0);
  td__loaded l = {0};
  size_t whole = td__replay(&l, buf, len, "snapshot");
  cr_assert_eq(whole, len);
  td__loaded_free(&l);

  /* A write cut short: the last record is half there. */
  memset(&l, 0, sizeof(l));
  size_t got = td__replay(&l, buf, len - 3, "journal.1");
  cr_assert_lt(got, len - 3);
  cr_assert(l.first != NULL && key_is(l.first, "x") && l.first->next == NULL,
            "the key of the whole record only");
  td__loaded_free(&l);

  /* A flipped byte in the second key's record: its CRC fails. */
  buf[got + TD__REC_HDR + 2] ^= 0x40;
  memset(&l, 0, sizeof(l));
  cr_assert_eq(td__replay(&l, buf, len, "journal.1"), got);
  cr_assert(l.first != NULL && l.first->next == NULL);
  td__loaded_free(&l);

  /* A length past the limit is no record at all. */
  buf[0] = buf[1] = buf[2] = buf[3] = 0xff;
  memset(&l, 0, sizeof(l));
  cr_assert_eq(td__replay(&l, buf, len, "journal.1"), 0);
  cr_assert_null(l.first);
  td__loaded_free(&l);
  free(buf);
}

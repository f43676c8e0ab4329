/* test_many.c: td_lookup_many, many keys in one round trip, against a real
 * tensord and forked consumers: one request for a thousand keys, per-key
 * failures, more fds than one sendmsg carries, waiting, bad frames and a
 * consumer that dies mid-reply. */
#include "harness.h"
#include "raw.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static tdt_daemon d;

TestSuite(many, .fini = tdt_cleanup, .timeout = 60);

#define NKEYS 1000

/* The producer: this process's client, and what it published. */
static td_client *prod;
static td_storage *made[NKEYS];
static char keybuf[NKEYS][32];
static const char *keys[NKEYS];

/* Publishes n storages of nbytes (mode) as "m/NNNN", each a float32 view
 * of its first elements, filled with its index. */
static void publish_n(size_t n, size_t nbytes, uint32_t mode) {
  prod = tdt_connect(&d);
  for (size_t i = 0; i < n; i++) {
    td_create_opts o = {.nbytes = nbytes, .mode = mode};
    cr_assert_eq(td_storage_create_ex(prod, &o, &made[i]), 0, "%s",
                 td_last_error(prod));
    memset(td_storage_data(made[i]), (int)(i & 0xff), nbytes);
    int64_t shape[1] = {(int64_t)(i % 16 + 1)};
    td_view v;
    cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, shape, &v), 0);
    snprintf(keybuf[i], sizeof(keybuf[i]), "m/%04zu", i);
    keys[i] = keybuf[i];
    cr_assert_eq(td_publish(prod, keys[i], made[i], &v), 0, "%s",
                 td_last_error(prod));
  }
}

static void release_made(size_t n) {
  for (size_t i = 0; i < n; i++) {
    td_storage_release(made[i]);
    made[i] = NULL;
  }
  td_close(prod);
  prod = NULL;
}

/* Requests client c has sent, as the daemon counts them. */
static uint64_t requests_of(td_client *c) {
  td_metrics *m = NULL;
  if (td_metrics_get(c, 0, TD_METRICS_NO_TEXT, &m) < 0)
    return 0;
  uint64_t n = 0;
  for (size_t i = 0; i < m->nclients; i++)
    if (m->clients[i].pid == getpid() &&
        strcmp(m->clients[i].name, td_client_name(c)) == 0)
      n = m->clients[i].requests;
  td_metrics_free(m);
  return n;
}

/* References client c holds, as the daemon counts them. */
static uint64_t refs_of(td_client *c) {
  td_metrics *m = NULL;
  if (td_metrics_get(c, 0, TD_METRICS_NO_TEXT, &m) < 0)
    return UINT64_MAX;
  uint64_t n = UINT64_MAX;
  for (size_t i = 0; i < m->nclients; i++)
    if (m->clients[i].pid == getpid() &&
        strcmp(m->clients[i].name, td_client_name(c)) == 0)
      n = m->clients[i].refs;
  td_metrics_free(m);
  return n;
}

/* Whether the handle for key i is the storage published there. */
static int is_key(const td_storage *s, const td_view *v, size_t i) {
  const uint8_t *p = td_storage_data(s);
  return s != NULL && td_storage_nbytes(s) > 0 && p[0] == (uint8_t)i &&
         p[td_storage_nbytes(s) - 1] == (uint8_t)i && v->dtype == TD_FLOAT32 &&
         v->ndim == 1 && v->shape[0] == (int64_t)(i % 16 + 1);
}

static td_storage *got[NKEYS];
static td_view views[NKEYS];
static int errs[NKEYS];

/* ---- a thousand keys ---- */

static int thousand_child(void *arg) {
  (void)arg;
  int fds = tdt_open_fds();
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  uint64_t before = requests_of(c);
  CHECK_ERR(c, td_lookup_many(c, keys, NKEYS, TD_RDONLY, 0, got, views, errs),
            0);
  uint64_t after = requests_of(c);
  /* The lookup and the second metrics call: one request for 1,000 keys. */
  if (after - before != 2) {
    fprintf(stderr, "%llu requests for one lookup_many\n",
            (unsigned long long)(after - before - 1));
    return 1;
  }
  for (size_t i = 0; i < NKEYS; i++) {
    CHECK(errs[i] == 0);
    CHECK(is_key(got[i], &views[i], i));
    CHECK(td_storage_is_readonly(got[i]));
  }
  CHECK(refs_of(c) == NKEYS);
  for (size_t i = 0; i < NKEYS; i++)
    td_storage_release(got[i]);
  CHECK(refs_of(c) == 0);
  td_close(c);
  CHECK(tdt_open_fds() == fds); /* every fd the reply brought was closed */
  return 0;
}

TDT_TEST(many, thousand_keys_in_one_request) {
  tdt_start(&d, NULL);
  publish_n(NKEYS, 4096, 0);
  cr_assert_eq(tdt_wait(tdt_fork(thousand_child, NULL)), 0);
  release_made(NKEYS);
}

/* A reply of a thousand fds reaches a process that may have only 128 open:
 * the library maps and closes them as their frames arrive. */
static int low_nofile_child(void *arg) {
  (void)arg;
  struct rlimit rl = {128, 128};
  CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  CHECK_ERR(c, td_lookup_many(c, keys, NKEYS, 0, 0, got, views, NULL), 0);
  for (size_t i = 0; i < NKEYS; i++) {
    CHECK(is_key(got[i], &views[i], i));
    CHECK(!td_storage_is_readonly(got[i]));
    td_storage_release(got[i]);
  }
  td_close(c);
  return 0;
}

TDT_TEST(many, more_fds_than_a_sendmsg_or_rlimit_holds) {
  tdt_start(&d, NULL);
  publish_n(NKEYS, 4096, 0);
  cr_assert_eq(tdt_wait(tdt_fork(low_nofile_child, NULL)), 0);
  release_made(NKEYS);
}

/* Keys that name one storage (a checkpoint shard's tensors): one fd, one
 * mapping. */
static int shared_child(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  CHECK_ERR(c, td_lookup_many(c, keys, 600, TD_RDONLY, 0, got, views, NULL), 0);
  for (size_t i = 0; i < 600; i++) {
    CHECK(td_storage_id(got[i]) == td_storage_id(got[0]));
    CHECK(td_storage_data(got[i]) == td_storage_data(got[0]));
    CHECK(views[i].offset == (int64_t)i);
  }
  CHECK(refs_of(c) == 600);
  for (size_t i = 0; i < 600; i++)
    td_storage_release(got[i]);
  td_close(c);
  return 0;
}

TDT_TEST(many, keys_of_one_storage_share_its_mapping) {
  tdt_start(&d, NULL);
  prod = tdt_connect(&d);
  cr_assert_eq(td_storage_create(prod, 4096, &made[0]), 0);
  for (size_t i = 0; i < 600; i++) {
    int64_t shape[1] = {1};
    td_view v;
    cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape, &v), 0);
    v.offset = (int64_t)i;
    snprintf(keybuf[i], sizeof(keybuf[i]), "shard/t%zu", i);
    keys[i] = keybuf[i];
    cr_assert_eq(td_publish(prod, keys[i], made[0], &v), 0, "%s",
                 td_last_error(prod));
  }
  cr_assert_eq(tdt_wait(tdt_fork(shared_child, NULL)), 0);
  release_made(1);
}

/* ---- per-key failures ---- */

static const char *mixed[] = {"m/0000", "gone/1", "m/0002", "gone/3", "m/0004"};

static int mixed_child(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  /* Per key: the found ones are kept, the missing ones say so. */
  CHECK_ERR(c, td_lookup_many(c, mixed, 5, 0, 0, got, views, errs), TD_ENOENT);
  CHECK_MSG(c, "key 'gone/1': not published");
  CHECK_MSG(c, "2 of 5 keys failed");
  CHECK(errs[0] == 0 && errs[2] == 0 && errs[4] == 0);
  CHECK(errs[1] == TD_ENOENT && errs[3] == TD_ENOENT);
  CHECK(got[1] == NULL && got[3] == NULL);
  CHECK(is_key(got[0], &views[0], 0) && is_key(got[2], &views[2], 2) &&
        is_key(got[4], &views[4], 4));
  CHECK(refs_of(c) == 3);
  for (size_t i = 0; i < 5; i++)
    td_storage_release(got[i]);
  /* All or nothing: no handle is kept. */
  CHECK_ERR(c, td_lookup_many(c, mixed, 5, 0, 0, got, NULL, NULL), TD_ENOENT);
  CHECK_MSG(c, "none was kept");
  for (size_t i = 0; i < 5; i++)
    CHECK(got[i] == NULL);
  CHECK(refs_of(c) == 0);
  td_close(c);
  return 0;
}

TDT_TEST(many, missing_keys_fail_alone_or_all) {
  tdt_start(&d, NULL);
  publish_n(5, 4096, 0);
  cr_assert_eq(tdt_wait(tdt_fork(mixed_child, NULL)), 0);
  release_made(5);
}

/* Keys 0..9 are 0644 and 10..19 0600, owned by root: uid 4246 may read the
 * first ten and nothing of the rest, nor write any. */
static int stranger_child(void *arg) {
  (void)arg;
  if (setgroups(0, NULL) < 0 || setgid(4246) < 0 || setuid(4246) < 0)
    return 2;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  CHECK_ERR(c, td_lookup_many(c, keys, 20, TD_RDONLY, 0, got, views, errs),
            TD_EACCES);
  CHECK_MSG(c, "key 'm/0010'");
  CHECK_MSG(c, "permission denied");
  CHECK_MSG(c, "10 of 20 keys failed");
  for (size_t i = 0; i < 20; i++) {
    CHECK(errs[i] == (i < 10 ? 0 : TD_EACCES));
    CHECK((got[i] != NULL) == (i < 10));
    if (i < 10)
      CHECK(is_key(got[i], &views[i], i));
    td_storage_release(got[i]);
  }
  CHECK_ERR(c, td_lookup_many(c, keys, 10, 0, 0, got, NULL, errs), TD_EACCES);
  for (size_t i = 0; i < 10; i++)
    CHECK(errs[i] == TD_EACCES && got[i] == NULL);
  CHECK(refs_of(c) == 0);
  td_close(c);
  return 0;
}

TDT_TEST(many, access_is_checked_per_key) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
  const char *args[] = {"--socket-mode", "0666", NULL};
  tdt_start(&d, args);
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  prod = tdt_connect(&d);
  for (size_t i = 0; i < 20; i++) {
    td_create_opts o = {.nbytes = 4096, .mode = i < 10 ? 0644 : 0600};
    cr_assert_eq(td_storage_create_ex(prod, &o, &made[i]), 0);
    memset(td_storage_data(made[i]), (int)i, 4096);
    int64_t shape[1] = {(int64_t)(i % 16 + 1)};
    td_view v;
    cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, shape, &v), 0);
    snprintf(keybuf[i], sizeof(keybuf[i]), "m/%04zu", i);
    keys[i] = keybuf[i];
    cr_assert_eq(td_publish(prod, keys[i], made[i], &v), 0);
  }
  cr_assert_eq(tdt_wait(tdt_fork(stranger_child, NULL)), 0);
  release_made(20);
}

/* --max-storages-per-client 8: the first eight keys are granted, the rest
 * refused, each with the daemon's reason. */
static int limit_child(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  CHECK_ERR(c, td_lookup_many(c, keys, 12, 0, 0, got, NULL, errs), TD_EMFILE);
  CHECK_MSG(c, "--max-storages-per-client");
  for (size_t i = 0; i < 12; i++) {
    CHECK(errs[i] == (i < 8 ? 0 : TD_EMFILE));
    td_storage_release(got[i]);
  }
  td_close(c);
  return 0;
}

TDT_TEST(many, storage_limit_counts_each_key) {
  const char *args[] = {"--max-storages-per-client", "8", NULL};
  tdt_start(&d, args);
  publish_n(8, 4096, 0);
  /* The producer holds 8: a second producer publishes 4 more. */
  td_client *p2 = tdt_connect(&d);
  td_storage *more[4];
  for (size_t i = 8; i < 12; i++) {
    cr_assert_eq(td_storage_create(p2, 4096, &more[i - 8]), 0);
    memset(td_storage_data(more[i - 8]), (int)i, 4096);
    snprintf(keybuf[i], sizeof(keybuf[i]), "m/%04zu", i);
    keys[i] = keybuf[i];
    cr_assert_eq(td_publish(p2, keys[i], more[i - 8], NULL), 0);
  }
  cr_assert_eq(tdt_wait(tdt_fork(limit_child, NULL)), 0);
  for (int i = 0; i < 4; i++)
    td_storage_release(more[i]);
  td_close(p2);
  release_made(8);
}

/* ---- waiting ---- */

static int wait_child(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  const char *k[] = {"m/0000", "late/1", "m/0001"};
  /* late/1 comes 200 ms after the call begins. */
  CHECK_ERR(c, td_lookup_many(c, k, 3, 0, 10000, got, views, errs), 0);
  CHECK(got[0] && got[1] && got[2]);
  for (int i = 0; i < 3; i++)
    td_storage_release(got[i]);
  /* never/1 never comes: ETIMEDOUT for it alone. */
  const char *k2[] = {"never/1", "m/0001"};
  CHECK_ERR(c, td_lookup_many(c, k2, 2, 0, 150, got, views, errs),
            TD_ETIMEDOUT);
  CHECK_MSG(c, "never/1");
  CHECK(errs[0] == TD_ETIMEDOUT && errs[1] == 0 && got[1] != NULL);
  td_storage_release(got[1]);
  td_close(c);
  return 0;
}

TDT_TEST(many, waits_for_missing_keys_within_one_deadline) {
  tdt_start(&d, NULL);
  publish_n(2, 4096, 0);
  pid_t pid = tdt_fork(wait_child, NULL);
  tdt_sleep_ms(200);
  td_storage *late;
  cr_assert_eq(td_storage_create(prod, 64, &late), 0);
  memset(td_storage_data(late), 1, 64);
  cr_assert_eq(td_publish(prod, "late/1", late, NULL), 0);
  td_storage_release(late);
  cr_assert_eq(tdt_wait(pid), 0);
  release_made(2);
}

/* ---- bad calls and bad frames ---- */

TDT_TEST(many, rejects_bad_calls) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s[2];
  int e[2];
  const char *k[] = {"a", NULL};
  cr_assert_eq(td_lookup_many(c, k, 0, 0, 0, s, NULL, NULL), 0);
  cr_assert_eq(td_lookup_many(c, k, 2, 0, 0, s, NULL, e), TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "keys[1] is NULL"), "%s",
            td_last_error(c));
  cr_assert(e[0] == TD_EINVAL && e[1] == TD_EINVAL && !s[0] && !s[1]);
  cr_assert_eq(td_lookup_many(c, k, 1, TD_TAKE, 0, s, NULL, NULL), TD_EINVAL);
  cr_assert_eq(td_lookup_many(c, k, 1, 0, -2, s, NULL, NULL), TD_EINVAL);
  cr_assert_eq(td_lookup_many(c, NULL, 1, 0, 0, s, NULL, NULL), TD_EINVAL);
  cr_assert_eq(td_lookup_many(c, k, (size_t)TD_LOOKUP_MANY_MAX + 1, 0, 0, NULL,
                              NULL, NULL),
               TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "out is NULL"), "%s", td_last_error(c));
  /* Bad keys fail alone, on the daemon's word. */
  char longkey[300];
  memset(longkey, 'x', sizeof(longkey) - 1);
  longkey[sizeof(longkey) - 1] = '\0';
  const char *bad[] = {"", longkey};
  cr_assert_eq(td_lookup_many(c, bad, 2, 0, 0, s, NULL, e), TD_EINVAL);
  cr_assert(e[0] == TD_EINVAL && e[1] == TD_EINVAL);
  td_close(c);
}

static Tensord__Response *reply_to(tdt_raw *r, uint64_t seq) {
  for (;;) {
    Tensord__Response *rep = tdt_raw_reply(r, 5000);
    cr_assert_not_null(rep, "no reply to seq %llu", (unsigned long long)seq);
    if (rep->seq == seq)
      return rep;
    tensord__response__free_unpacked(rep, NULL);
  }
}

static uint64_t queue_many(tdt_raw *r, ProtobufCBinaryData *k, size_t n) {
  Tensord__LookupMany m = TENSORD__LOOKUP_MANY__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.keys = k;
  m.n_keys = n;
  q.body_case = TENSORD__REQUEST__BODY_LOOKUP_MANY;
  q.lookup_many = &m;
  return tdt_raw_queue(r, &q);
}

TDT_TEST(many, daemon_answers_bad_frames_and_keeps_serving) {
  tdt_start(&d, NULL);
  publish_n(3, 4096, 0);
  tdt_raw r;
  tdt_raw_open(&r, &d);
  /* No keys. */
  uint64_t seq = queue_many(&r, NULL, 0);
  tdt_raw_flush(&r);
  Tensord__Response *rep = reply_to(&r, seq);
  cr_assert_eq(tdt_raw_code(rep), TD_EINVAL);
  cr_assert(strstr(rep->error->message, "no keys"), "%s", rep->error->message);
  tensord__response__free_unpacked(rep, NULL);
  /* 70,000 one-byte keys: over the cap, named. */
  size_t big = 70000;
  ProtobufCBinaryData *k = calloc(big, sizeof(*k));
  cr_assert_not_null(k);
  for (size_t i = 0; i < big; i++)
    k[i] = (ProtobufCBinaryData){1, (uint8_t *)"x"};
  seq = queue_many(&r, k, big);
  tdt_raw_flush(&r);
  rep = reply_to(&r, seq);
  cr_assert_eq(tdt_raw_code(rep), TD_EINVAL);
  cr_assert(strstr(rep->error->message, "70000 keys"), "%s",
            rep->error->message);
  tensord__response__free_unpacked(rep, NULL);
  /* 5,000 garbled keys (empty, NUL inside, bad UTF-8, too long) around
   * three good ones: each answered alone, in order, the good ones with
   * their storage. */
  static uint8_t longk[300];
  memset(longk, 'y', sizeof(longk));
  size_t n = 5000;
  for (size_t i = 0; i < n; i++) {
    switch (i % 5) {
    case 0:
      k[i] = (ProtobufCBinaryData){0, NULL};
      break;
    case 1:
      k[i] = (ProtobufCBinaryData){3, (uint8_t *)"a\0b"};
      break;
    case 2:
      k[i] = (ProtobufCBinaryData){2, (uint8_t *)"\xff\xfe"};
      break;
    case 3:
      k[i] = (ProtobufCBinaryData){sizeof(longk), longk};
      break;
    default:
      k[i] = (ProtobufCBinaryData){5, (uint8_t *)"nope/"};
    }
  }
  k[1000] = (ProtobufCBinaryData){6, (uint8_t *)"m/0000"};
  k[2500] = (ProtobufCBinaryData){6, (uint8_t *)"m/0001"};
  k[4999] = (ProtobufCBinaryData){6, (uint8_t *)"m/0002"};
  seq = queue_many(&r, k, n);
  tdt_raw_flush(&r);
  size_t next = 0, found = 0;
  for (int last = 0; !last;) {
    int fd = -1;
    rep = tdt_raw_reply_fd(&r, 5000, &fd);
    cr_assert_not_null(rep);
    if (fd >= 0)
      close(fd);
    if (rep->seq != seq) {
      tensord__response__free_unpacked(rep, NULL);
      continue;
    }
    cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_LOOKUP_MANY);
    Tensord__LookupManyReply *lm = rep->lookup_many;
    cr_assert_eq(lm->first, next);
    for (size_t j = 0; j < lm->n_items; j++, next++) {
      Tensord__LookupManyItem *it = lm->items[j];
      if (next == 1000 || next == 2500 || next == 4999) {
        cr_assert_eq(it->code, 0, "item %zu: %s", next, it->message);
        cr_assert_not_null(it->lookup);
        found++;
      } else {
        cr_assert_eq(it->code, next % 5 == 4 ? TD_ENOENT : TD_EINVAL,
                     "item %zu: %d %s", next, it->code, it->message);
      }
    }
    last = lm->last;
    tensord__response__free_unpacked(rep, NULL);
  }
  cr_assert_eq(next, n);
  cr_assert_eq(found, 3);
  free(k);
  /* Still serving this connection. */
  seq = tdt_raw_ping(&r);
  tdt_raw_flush(&r);
  rep = reply_to(&r, seq);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_PONG);
  tensord__response__free_unpacked(rep, NULL);
  tdt_raw_close(&r);
  release_made(3);
}

/* ---- a consumer that dies mid-reply ---- */

static int die_child(void *arg) {
  (void)arg;
  tdt_raw r;
  tdt_raw_open(&r, &d);
  ProtobufCBinaryData k[NKEYS];
  for (size_t i = 0; i < NKEYS; i++)
    k[i] = (ProtobufCBinaryData){strlen(keys[i]), (uint8_t *)keys[i]};
  queue_many(&r, k, NKEYS);
  tdt_raw_flush(&r);
  /* Read one frame (four fds), then die with the rest unread. */
  Tensord__Response *rep = tdt_raw_reply(&r, 5000);
  CHECK(rep != NULL && rep->body_case == TENSORD__RESPONSE__BODY_LOOKUP_MANY);
  kill(getpid(), SIGKILL);
  return 1;
}

static td_client *watcher;

/* Whether every storage is back to the key's reference and the producer's
 * handle: the dead consumer's went with it. */
static int refs_back(const tdt_daemon *dd) {
  (void)dd;
  td_metrics *m = NULL;
  if (td_metrics_get(watcher, 0, TD_METRICS_NO_TEXT, &m) < 0)
    return 0;
  uint64_t clients = m->clients_total;
  td_metrics_free(m);
  return clients == 2; /* the producer and the watcher */
}

static int refs_cb(const td_storage_info *info, void *arg) {
  *(uint32_t *)arg = info->refs;
  return 0;
}

TDT_TEST(many, consumer_killed_mid_reply_leaks_nothing) {
  tdt_start(&d, NULL);
  publish_n(NKEYS, 4096, 0);
  watcher = tdt_connect(&d);
  for (int round = 0; round < 3; round++) {
    int st = tdt_wait(tdt_fork(die_child, NULL));
    cr_assert_eq(st, 128 + SIGKILL, "child exited %d", st);
    cr_assert(tdt_until(refs_back, &d, 10000), "the dead consumer stays");
  }
  /* Each storage: the producer's handle and the key's reference. */
  for (size_t i = 0; i < NKEYS; i += 97) {
    uint32_t refs = 0;
    cr_assert_eq(
        td_info(watcher, td_storage_id(made[i]), NULL, refs_cb, NULL, &refs), 0,
        "%s", td_last_error(watcher));
    cr_assert_eq(refs, 2, "storage %zu has %u refs", i, refs);
  }
  /* And it still serves a whole lookup_many. */
  cr_assert_eq(
      td_lookup_many(watcher, keys, NKEYS, TD_RDONLY, 0, got, views, NULL), 0,
      "%s", td_last_error(watcher));
  for (size_t i = 0; i < NKEYS; i++)
    td_storage_release(got[i]);
  td_close(watcher);
  release_made(NKEYS);
}

/* ---- long keys, too many keys, the most keys ---- */

/* A key longer than a whole frame fails alone, as td_lookup would fail
 * it, and the keys around it are looked up. */
TDT_TEST(many, a_key_longer_than_a_frame_fails_alone) {
  tdt_start(&d, NULL);
  publish_n(2, 4096, 0);
  td_client *c = tdt_connect(&d);
  size_t huge = 2u << 20;
  char *longkey = malloc(huge + 1);
  cr_assert_not_null(longkey);
  memset(longkey, 'z', huge);
  longkey[huge] = '\0';
  const char *k[] = {keys[0], longkey, keys[1]};
  td_storage *s[3];
  td_view v[3];
  int e[3];
  cr_assert_eq(td_lookup_many(c, k, 3, TD_RDONLY, 0, s, v, e), TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "2097152 bytes"), "%s", td_last_error(c));
  cr_assert(strstr(td_last_error(c), "1 of 3 keys failed"), "%s",
            td_last_error(c));
  cr_assert(e[0] == 0 && e[1] == TD_EINVAL && e[2] == 0, "%d %d %d", e[0], e[1],
            e[2]);
  cr_assert(is_key(s[0], &v[0], 0) && s[1] == NULL && is_key(s[2], &v[2], 1));
  td_storage_release(s[0]);
  td_storage_release(s[2]);
  free(longkey);
  td_close(c);
  release_made(2);
}

/* n over TD_LOOKUP_MANY_MAX: the first MAX + 1 entries of out and errs are
 * written, and nothing past them. */
TDT_TEST(many, too_many_keys_write_only_max_plus_one_entries) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  size_t n = (size_t)TD_LOOKUP_MANY_MAX + 2;
  const char **k = calloc(n, sizeof(*k));
  td_storage **s = calloc(n, sizeof(*s));
  int *e = calloc(n, sizeof(*e));
  cr_assert(k && s && e);
  for (size_t i = 0; i < n; i++) {
    k[i] = "m/0000";
    s[i] = (td_storage *)&d; /* anything not NULL */
    e[i] = 1;
  }
  cr_assert_eq(td_lookup_many(c, k, n, 0, 0, s, NULL, e), TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "65538 keys"), "%s", td_last_error(c));
  for (size_t i = 0; i <= TD_LOOKUP_MANY_MAX; i++)
    cr_assert(s[i] == NULL && e[i] == TD_EINVAL, "entry %zu", i);
  cr_assert(s[n - 1] == (td_storage *)&d && e[n - 1] == 1);
  free(k);
  free(s);
  free(e);
  td_close(c);
}

/* 65,536 keys of 200 bytes (13 MB): more than one frame can carry, so the
 * library splits them into several requests. Every key is answered, in
 * order: three published ones (first, middle, last) are found, the others
 * are not. */
TDT_TEST(many, the_most_keys_span_several_requests) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  size_t n = TD_LOOKUP_MANY_MAX;
  size_t pub[3] = {0, TD_LOOKUP_MANY_MAX / 2 + 7, TD_LOOKUP_MANY_MAX - 1};
  char **k = calloc(n, sizeof(*k));
  const char **kp = calloc(n, sizeof(*kp));
  td_storage **s = calloc(n, sizeof(*s));
  td_view *v = calloc(n, sizeof(*v));
  int *e = calloc(n, sizeof(*e));
  cr_assert(k && kp && s && v && e);
  for (size_t i = 0; i < n; i++) {
    k[i] = malloc(201);
    cr_assert_not_null(k[i]);
    memset(k[i], 'k', 200);
    k[i][200] = '\0';
    char head[8];
    snprintf(head, sizeof(head), "%06zu/", i);
    memcpy(k[i], head, 7);
    kp[i] = k[i];
  }
  td_storage *mine[3];
  for (int j = 0; j < 3; j++) {
    td_view pv;
    int64_t shape[1] = {(int64_t)j + 1};
    cr_assert_eq(td_storage_create(c, 4096, &mine[j]), 0, "%s",
                 td_last_error(c));
    memset(td_storage_data(mine[j]), j + 1, 4096);
    cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, shape, &pv), 0);
    cr_assert_eq(td_publish(c, kp[pub[j]], mine[j], &pv), 0, "%s",
                 td_last_error(c));
  }
  uint64_t before = requests_of(c);
  cr_assert_eq(td_lookup_many(c, kp, n, 0, 0, s, v, e), TD_ENOENT);
  uint64_t sent = requests_of(c) - before - 1;
  cr_assert(strstr(td_last_error(c), "65533 of 65536 keys failed"), "%s",
            td_last_error(c));
  /* At most 768 KiB of keys in a request: 17 of them, or one more. */
  cr_assert(sent >= 17 && sent <= 18, "%llu requests",
            (unsigned long long)sent);
  for (size_t i = 0, j = 0; i < n; i++) {
    if (j < 3 && i == pub[j]) {
      cr_assert_eq(e[i], 0, "key %zu: %d", i, e[i]);
      cr_assert_not_null(s[i]);
      cr_assert_eq(td_storage_id(s[i]), td_storage_id(mine[j]));
      cr_assert_eq(((uint8_t *)td_storage_data(s[i]))[4095], j + 1);
      cr_assert_eq(v[i].shape[0], (int64_t)j + 1);
      td_storage_release(s[i]);
      j++;
    } else {
      cr_assert_eq(e[i], TD_ENOENT, "key %zu: %d", i, e[i]);
      cr_assert_null(s[i]);
    }
    free(k[i]);
  }
  for (int j = 0; j < 3; j++)
    td_storage_release(mine[j]);
  free(k);
  free(kp);
  free(s);
  free(v);
  free(e);
  td_close(c);
}

/* ---- threads ---- */

typedef struct many_thread {
  td_client *c;
  int failed;
} many_thread;

static void *many_thread_fn(void *p) {
  many_thread *t = p;
  td_storage **s = calloc(NKEYS, sizeof(*s));
  td_view *v = calloc(NKEYS, sizeof(*v));
  t->failed = s == NULL || v == NULL;
  for (int round = 0; round < 5 && !t->failed; round++) {
    if (td_lookup_many(t->c, keys, NKEYS, TD_RDONLY, 0, s, v, NULL) < 0) {
      fprintf(stderr, "lookup_many: %s\n", td_last_error(t->c));
      t->failed = 1;
      break;
    }
    for (size_t i = 0; i < NKEYS; i++) {
      t->failed |= !is_key(s[i], &v[i], i);
      td_storage_release(s[i]);
    }
  }
  free(s);
  free(v);
  return NULL;
}

/* Four threads share one client: replies of several frames each reach
 * their own caller, whichever thread reads them. */
static int threads_child(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  pthread_t th[4];
  many_thread t[4];
  for (int i = 0; i < 4; i++) {
    t[i] = (many_thread){c, 0};
    CHECK(pthread_create(&th[i], NULL, many_thread_fn, &t[i]) == 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    CHECK(!t[i].failed);
  }
  CHECK(refs_of(c) == 0);
  td_close(c);
  return 0;
}

TDT_TEST(many, threads_share_a_client) {
  tdt_start(&d, NULL);
  publish_n(NKEYS, 4096, 0);
  cr_assert_eq(tdt_wait(tdt_fork(threads_child, NULL)), 0);
  release_made(NKEYS);
}

/* One thread reads the others' replies (it pings without pause) while
 * another takes a thousand fds in one lookup_many, under an fd limit of 96
 * more than are open: the reader holds back once the caller has a few
 * frames queued, so what is in flight stays within the 64 fds the wire
 * may hold, those frames' 16 and the one being read. */
static atomic_int pinging;

static void *ping_fn(void *p) {
  td_client *c = p;
  intptr_t bad = 0;
  while (atomic_load(&pinging) && !bad)
    bad = td_ping(c, NULL) < 0;
  return (void *)bad;
}

static int reader_child(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  int open = tdt_open_fds();
  struct rlimit rl = {(rlim_t)open + 96, (rlim_t)open + 96};
  CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
  for (int round = 0; round < 5; round++) {
    pthread_t th;
    atomic_store(&pinging, 1);
    CHECK(pthread_create(&th, NULL, ping_fn, c) == 0);
    int err = td_lookup_many(c, keys, NKEYS, 0, 0, got, views, NULL);
    atomic_store(&pinging, 0);
    void *bad;
    pthread_join(th, &bad);
    CHECK_ERR(c, err, 0);
    CHECK(bad == NULL);
    for (size_t i = 0; i < NKEYS; i++) {
      CHECK(is_key(got[i], &views[i], i));
      td_storage_release(got[i]);
    }
  }
  CHECK(refs_of(c) == 0);
  td_close(c);
  return 0;
}

TDT_TEST(many, a_thread_reading_for_another_holds_back_its_fds) {
  tdt_start(&d, NULL);
  publish_n(NKEYS, 4096, 0);
  cr_assert_eq(tdt_wait(tdt_fork(reader_child, NULL)), 0);
  release_made(NKEYS);
}

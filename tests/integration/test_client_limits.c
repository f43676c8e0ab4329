/* test_client_limits.c: what one client or one uid may make the daemon
 * keep: storages (creates in flight included), waiting lookups, published
 * keys, unread replies; and a client in more supplementary groups than a
 * fixed buffer holds keeps its group access. */
#include "harness.h"
#include "raw.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

static void teardown(void) {
  if (d.pid > 0)
    tdt_kill(&d);
}

TestSuite(client_limits, .init = setup, .fini = teardown, .timeout = 60);

/* The next reply on r, which must come. */
static Tensord__Response *next_reply(tdt_raw *r) {
  Tensord__Response *rep = tdt_raw_reply(r, 10000);
  cr_assert_not_null(rep, "no reply from tensord (eof %d)", r->eof);
  return rep;
}

/* ---- --max-storages-per-client counts creates in flight ---- */

TDT_TEST(client_limits, creates_in_flight_count_against_max_storages) {
  tdt_start(&d, (const char *const[]){"--max-storages-per-client", "2", NULL});
  tdt_raw r;
  tdt_raw_open(&r, &d);
  /* Large creates run on the thread pool: all four arrive in one read,
   * before any of them is done. */
  for (int i = 0; i < 4; i++)
    tdt_raw_create(&r, 1u << 20);
  tdt_raw_flush(&r);
  int made = 0, refused = 0;
  for (int i = 0; i < 4; i++) {
    Tensord__Response *rep = next_reply(&r);
    if (rep->body_case == TENSORD__RESPONSE__BODY_STORAGE) {
      made++;
    } else {
      cr_assert_eq(tdt_raw_code(rep), TD_EMFILE, "seq %llu: %s",
                   (unsigned long long)rep->seq,
                   rep->error ? rep->error->message : "?");
      cr_assert(strstr(rep->error->message, "is creating") != NULL, "%s",
                rep->error->message);
      refused++;
    }
    tensord__response__free_unpacked(rep, NULL);
  }
  cr_assert_eq(made, 2, "%d storages made with --max-storages-per-client 2",
               made);
  cr_assert_eq(refused, 2);
  tdt_raw_close(&r);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- --max-waiters-per-client ---- */

TDT_TEST(client_limits, lookups_waiting_past_the_limit_are_refused) {
  tdt_start(&d, (const char *const[]){"--max-waiters-per-client", "3", NULL});
  tdt_raw r;
  tdt_raw_open(&r, &d);
  char key[32];
  for (int i = 0; i < 4; i++) {
    snprintf(key, sizeof(key), "w/%d", i);
    tdt_raw_lookup(&r, key, 0, -1);
  }
  uint64_t fourth = r.seq;
  uint64_t ping = tdt_raw_ping(&r);
  tdt_raw_flush(&r);
  /* The fourth is answered at once; the others wait. */
  Tensord__Response *rep = next_reply(&r);
  cr_assert_eq(rep->seq, fourth, "the first reply is to seq %llu",
               (unsigned long long)rep->seq);
  cr_assert_eq(tdt_raw_code(rep), TD_EMFILE);
  cr_assert(strstr(rep->error->message, "--max-waiters-per-client") != NULL,
            "%s", rep->error->message);
  tensord__response__free_unpacked(rep, NULL);
  rep = next_reply(&r);
  cr_assert_eq(rep->seq, ping);
  tensord__response__free_unpacked(rep, NULL);

  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.waiters, 3);
  /* One waiter served: room for one more. */
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "w/0", s, NULL), 0);
  rep = next_reply(&r);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_LOOKUP);
  tensord__response__free_unpacked(rep, NULL);
  tdt_raw_lookup(&r, "w/4", 0, -1);
  ping = tdt_raw_ping(&r);
  tdt_raw_flush(&r);
  rep = next_reply(&r);
  cr_assert_eq(rep->seq, ping, "the new lookup waits");
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.waiters, 3);

  tdt_raw_close(&r);
  cr_assert_eq(td_unpublish(c, "w/0"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- --max-keys-per-uid ---- */

TDT_TEST(client_limits, keys_count_against_their_uid_across_connections) {
  tdt_start(&d, (const char *const[]){"--max-keys-per-uid", "3", NULL});
  td_client *c1 = tdt_connect(&d), *c2 = tdt_connect(&d);
  td_storage *s1, *s2, *t;
  cr_assert_eq(td_storage_create(c1, 4096, &s1), 0);
  cr_assert_eq(td_storage_create(c2, 4096, &s2), 0);
  cr_assert_eq(td_publish(c1, "k/1", s1, NULL), 0);
  cr_assert_eq(td_publish(c1, "k/2", s1, NULL), 0);
  cr_assert_eq(td_publish(c1, "k/3", s1, NULL), 0);
  cr_assert_eq(td_publish(c1, "k/4", s1, NULL), TD_EDQUOT);
  char want[64];
  snprintf(want, sizeof(want), "uid %u has published 3 keys",
           (unsigned)getuid());
  cr_assert(strstr(td_last_error(c1), want) != NULL, "%s", td_last_error(c1));
  cr_assert(strstr(td_last_error(c1), "--max-keys-per-uid") != NULL);
  /* Replacing one of its own keys adds none. */
  cr_assert_eq(td_publish(c1, "k/1", s1, NULL), 0, "%s", td_last_error(c1));
  /* The keys outlive their connection, and count for every connection of
   * the uid. */
  td_storage_release(s1);
  td_close(c1);
  cr_assert_eq(td_publish(c2, "k/5", s2, NULL), TD_EDQUOT);
  cr_assert_eq(td_publish(c2, "k/1", s2, NULL), 0, "a replace: %s",
               td_last_error(c2));
  /* Unpublish and take give room back. */
  cr_assert_eq(td_unpublish(c2, "k/2"), 0);
  cr_assert_eq(td_publish(c2, "k/5", s2, NULL), 0, "%s", td_last_error(c2));
  cr_assert_eq(td_lookup(c2, "k/3", TD_TAKE, 0, &t, NULL), 0);
  td_storage_release(t);
  cr_assert_eq(td_publish(c2, "k/6", s2, NULL), 0, "%s", td_last_error(c2));
  cr_assert_eq(td_publish(c2, "k/7", s2, NULL), TD_EDQUOT);
  td_stat st;
  cr_assert_eq(td_stat_get(c2, &st), 0);
  cr_assert_eq(st.keys, 3);
  const char *keys[] = {"k/1", "k/5", "k/6"};
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_unpublish(c2, keys[i]), 0);
  td_storage_release(s2);
  td_close(c2);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- unread replies ---- */

static int only_one_client(const tdt_daemon *dd) {
  td_client *c = tdt_connect(dd);
  td_stat st;
  int ok = td_stat_get(c, &st) == 0 && st.clients == 2; /* c and this */
  td_close(c);
  return ok;
}

TDT_TEST(client_limits, unread_replies_past_64_mib_disconnect_only_that_client) {
  /* The io-timeout is out of the way: only the 64 MiB cap can act. */
  tdt_start(&d, (const char *const[]){"--io-timeout", "600000", NULL});
  /* One storage with 1024 keys of 255 bytes: an Info of it answers about
   * 300 KB to a request of a few bytes. */
  tdt_raw r;
  tdt_raw_open(&r, &d);
  uint64_t id = tdt_raw_create_now(&r, 4096);
  char key[256];
  memset(key, 'u', 255);
  key[255] = '\0';
  enum { NKEYS = 1024 };
  for (int i = 0; i < NKEYS; i++) {
    snprintf(key, 8, "%06d", i);
    key[6] = '/';
    tdt_raw_publish(&r, key, id, 0);
  }
  tdt_raw_flush(&r);
  for (int i = 0; i < NKEYS; i++) {
    Tensord__Response *rep = next_reply(&r);
    cr_assert_eq(tdt_raw_code(rep), 0);
    tensord__response__free_unpacked(rep, NULL);
  }
  tdt_raw_close(&r);

  td_client *c = tdt_connect(&d);
  /* A client that asks for about 75 MB of replies and reads none. */
  tdt_raw_open(&r, &d);
  Tensord__Info m = TENSORD__INFO__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.which_case = TENSORD__INFO__WHICH_ID;
  m.id = id;
  q.body_case = TENSORD__REQUEST__BODY_INFO;
  q.info = &m;
  for (int i = 0; i < 256; i++)
    tdt_raw_queue(&r, &q);
  tdt_raw_flush(&r);
  cr_assert(tdt_until(only_one_client, &d, 10000),
            "the client that reads nothing is still connected; see %s", d.log);
  cr_assert(tdt_log_has(&d, "did not read"), "see %s", d.log);
  cr_assert_not(tdt_log_has(&d, "unread for"), "not the io-timeout");
  cr_assert_eq(td_ping(c, NULL), 0, "the others are served: %s",
               td_last_error(c));
  /* What the socket held is there, then the end. */
  Tensord__Response *rep;
  int n = 0;
  while ((rep = tdt_raw_reply(&r, 10000)) != NULL) {
    tensord__response__free_unpacked(rep, NULL);
    n++;
  }
  cr_assert(r.eof, "after %d replies", n);
  cr_assert_lt(n, 256);
  tdt_raw_close(&r);
  td_close(c);
  tdt_stop(&d);
}

/* ---- supplementary groups ---- */

typedef struct as_job {
  uid_t uid;
  gid_t gid;
  int ngroups;
  const gid_t *groups;
  int (*fn)(void *);
} as_job;

static int as_child(void *p) {
  as_job *j = p;
  if (setgroups((size_t)j->ngroups, j->groups) < 0 || setgid(j->gid) < 0 ||
      setuid(j->uid) < 0) {
    fprintf(stderr, "cannot become uid %u: %s\n", (unsigned)j->uid,
            strerror(errno));
    return 2;
  }
  return j->fn(NULL);
}

enum { GROUP = 5099, NGROUPS = 100 };

static int owner_publishes(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  td_create_opts o = {0};
  td_storage *s;
  o.nbytes = 4096;
  o.mode = 0640;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &s), 0);
  memset(td_storage_data(s), 0x5a, 4096);
  CHECK_ERR(c, td_publish(c, "groups/k", s, NULL), 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

static int member_reads(void *arg) {
  (void)arg;
  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  td_storage *s;
  CHECK_ERR(c, td_lookup(c, "groups/k", TD_RDONLY, 0, &s, NULL), 0);
  CHECK(((const uint8_t *)td_storage_data(s))[4095] == 0x5a);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(client_limits, client_in_100_groups_keeps_the_access_of_each) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  /* The owner's primary group is GROUP; the member has it as the last of
   * 100 supplementary groups. */
  as_job owner = {4242, GROUP, 0, NULL, owner_publishes};
  cr_assert_eq(tdt_wait(tdt_fork(as_child, &owner)), 0);
  gid_t groups[NGROUPS];
  for (int i = 0; i < NGROUPS; i++)
    groups[i] = GROUP - NGROUPS + 1 + (gid_t)i;
  as_job member = {4250, 4250, NGROUPS, groups, member_reads};
  int st = tdt_wait(tdt_fork(as_child, &member));
  cr_assert_eq(st, 0, "a member of group %d among %d groups was refused", GROUP,
               NGROUPS);
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_unpublish(c, "groups/k"), 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* test_keys.c: publish, lookup with waiting and take, across real
 * processes. */
#include "harness.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;

static void setup(void) {
  tdt_start(&d, NULL);
}

TestSuite(keys, .init = setup, .fini = tdt_cleanup, .timeout = 60);

/* ---- helpers ---- */

static td_stat stat_now(void) {
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  td_close(c);
  return st;
}

static uint64_t want_waiters;
static int waiters_are(const tdt_daemon *dd) {
  (void)dd;
  return stat_now().waiters == want_waiters;
}

static void wait_for_waiters(uint64_t n) {
  want_waiters = n;
  cr_assert(tdt_until(waiters_are, &d, 20000), "%llu lookups wait, not %llu",
            (unsigned long long)stat_now().waiters, (unsigned long long)n);
}

static int want_segments;
static int segments_are(const tdt_daemon *dd) {
  return tdt_segments(dd) == want_segments;
}

/* Creates a storage of nbytes whose bytes are all value. */
static td_storage *make(td_client *c, size_t nbytes, uint8_t value) {
  td_storage *s;
  cr_assert_eq(td_storage_create(c, nbytes, &s), 0, "%s", td_last_error(c));
  memset(td_storage_data(s), value, nbytes);
  return s;
}

/* Waits up to ms for child pid; kills it if it is still running then.
 * Returns its exit status (128 + signal if killed), or -1 after a kill for
 * the time limit. A child that hangs must not hang the test: Criterion's
 * timeout would also skip the fixture that stops tensord. */
static int wait_child(pid_t pid, int ms) {
  for (int waited = 0; waited < ms; waited += 10) {
    int ws;
    if (waitpid(pid, &ws, WNOHANG) == pid)
      return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    usleep(10000);
  }
  kill(pid, SIGKILL);
  tdt_wait(pid);
  return -1;
}

typedef struct waiter_arg {
  const char *sock;
  const char *key;
  unsigned flags;
  int timeout_ms;
} waiter_arg;

/* Looks the key up. Exits 10 + the storage's first byte if it got it, 2 if
 * the lookup timed out with the expected message, 1 on anything else. */
static int waiter(void *p) {
  const waiter_arg *a = p;
  td_client *c;
  td_storage *s;
  td_view v;
  CHECK(td_connect(a->sock, &c) == 0);
  int err = td_lookup(c, a->key, a->flags, a->timeout_ms, &s, &v);
  if (err == TD_ETIMEDOUT) {
    char want[512];
    snprintf(want, sizeof(want), "key '%s': not published (waited %d ms)",
             a->key, a->timeout_ms);
    if (strstr(td_last_error(c), want) == NULL) {
      fprintf(stderr, "timeout message '%s', expected '%s'\n", td_last_error(c),
              want);
      return 1;
    }
    CHECK(s == NULL);
    td_close(c);
    return 2;
  }
  if (err != 0) {
    fprintf(stderr, "lookup '%s': %s: %s\n", a->key, td_err_name(err),
            td_last_error(c));
    return 1;
  }
  CHECK(td_storage_is_readonly(s) == ((a->flags & TD_RDONLY) != 0));
  int value = ((const uint8_t *)td_storage_data(s))[0];
  CHECK(td_storage_release(s) == 0);
  td_close(c);
  return 10 + value;
}

enum { NWAIT = 6 };

/* Forks n waiters on key, one after another, each waiting before the next
 * starts (so their order in the daemon's queue is known). */
static void fork_waiters(pid_t *pids, int n, waiter_arg *a, uint64_t base) {
  for (int i = 0; i < n; i++) {
    pids[i] = tdt_fork(waiter, a);
    wait_for_waiters(base + (uint64_t)i + 1);
  }
}

/* ---- waiting and taking ---- */

TDT_TEST(keys, one_publish_goes_to_exactly_one_of_several_takers) {
  waiter_arg a = {d.sock, "jobs/one", TD_TAKE, 5000};
  pid_t pids[NWAIT];
  fork_waiters(pids, NWAIT, &a, 0);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 4096, 7);
  cr_assert_eq(td_publish(c, "jobs/one", s, NULL), 0, "%s", td_last_error(c));
  td_storage_release(s);
  int got = 0, timed_out = 0;
  for (int i = 0; i < NWAIT; i++) {
    int st = wait_child(pids[i], 30000);
    cr_assert(st == 17 || st == 2, "waiter %d exited %d", i, st);
    got += st == 17;
    timed_out += st == 2;
  }
  cr_assert_eq(got, 1, "%d waiters took the one publish", got);
  cr_assert_eq(timed_out, NWAIT - 1);
  td_storage *t;
  cr_assert_eq(td_lookup(c, "jobs/one", 0, 0, &t, NULL), TD_ENOENT,
               "taken, so unpublished");
  td_stat st = stat_now();
  cr_assert_eq(st.keys, 0);
  cr_assert_eq(st.waiters, 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, k_publishes_go_to_k_distinct_takers) {
  enum { K = 3 };
  waiter_arg a = {d.sock, "jobs/k", TD_TAKE, 5000};
  pid_t pids[NWAIT];
  fork_waiters(pids, NWAIT, &a, 0);
  td_client *c = tdt_connect(&d);
  for (int k = 1; k <= K; k++) {
    td_storage *s = make(c, 64, (uint8_t)k);
    cr_assert_eq(td_publish(c, "jobs/k", s, NULL), 0, "%s", td_last_error(c));
    td_storage_release(s);
  }
  int seen[K + 1] = {0}, timed_out = 0;
  for (int i = 0; i < NWAIT; i++) {
    int st = wait_child(pids[i], 30000);
    if (st == 2) {
      timed_out++;
      continue;
    }
    cr_assert(st >= 11 && st <= 10 + K, "waiter %d exited %d", i, st);
    seen[st - 10]++;
    /* Waiters are served in arrival order. */
    cr_assert_eq(st - 10, i + 1, "waiter %d got publish %d", i, st - 10);
  }
  for (int k = 1; k <= K; k++)
    cr_assert_eq(seen[k], 1, "publish %d went to %d takers", k, seen[k]);
  cr_assert_eq(timed_out, NWAIT - K);
  td_storage *t;
  cr_assert_eq(td_lookup(c, "jobs/k", 0, 0, &t, NULL), TD_ENOENT);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, every_non_taking_waiter_gets_the_publish) {
  waiter_arg a = {d.sock, "model/weights", 0, 10000};
  waiter_arg ro = {d.sock, "model/weights", TD_RDONLY, 10000};
  pid_t pids[NWAIT];
  fork_waiters(pids, NWAIT / 2, &a, 0);
  fork_waiters(pids + NWAIT / 2, NWAIT / 2, &ro, NWAIT / 2);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 1 << 16, 9);
  cr_assert_eq(td_publish(c, "model/weights", s, NULL), 0);
  for (int i = 0; i < NWAIT; i++)
    cr_assert_eq(wait_child(pids[i], 30000), 19, "waiter %d", i);
  td_stat st = stat_now();
  cr_assert_eq(st.keys, 1, "still published");
  cr_assert_eq(st.waiters, 0);
  cr_assert_eq(td_unpublish(c, "model/weights"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, non_takers_ahead_of_a_taker_get_it_and_the_taker_takes_it) {
  waiter_arg look = {d.sock, "mixed", 0, 10000};
  waiter_arg take = {d.sock, "mixed", TD_TAKE, 10000};
  waiter_arg late = {d.sock, "mixed", TD_TAKE, 3000};
  pid_t pids[4];
  fork_waiters(pids, 2, &look, 0);
  fork_waiters(pids + 2, 1, &take, 2);
  fork_waiters(pids + 3, 1, &late, 3);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 64, 4);
  cr_assert_eq(td_publish(c, "mixed", s, NULL), 0);
  td_storage_release(s);
  cr_assert_eq(wait_child(pids[0], 30000), 14);
  cr_assert_eq(wait_child(pids[1], 30000), 14);
  cr_assert_eq(wait_child(pids[2], 30000), 14, "the taker got it");
  cr_assert_eq(wait_child(pids[3], 30000), 2,
               "nothing left for the second taker");
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, timeout_zero_on_missing_key_is_enoent_at_once) {
  td_client *c = tdt_connect(&d);
  td_storage *s = (td_storage *)1;
  td_view v;
  cr_assert_eq(td_lookup(c, "missing/key", 0, 0, &s, &v), TD_ENOENT);
  cr_assert_null(s);
  cr_assert(strstr(td_last_error(c), "key 'missing/key': not published"),
            "'%s'", td_last_error(c));
  cr_assert_eq(td_lookup(c, "missing/key", TD_TAKE | TD_RDONLY, 0, &s, &v),
               TD_ENOENT);
  cr_assert_eq(stat_now().waiters, 0, "nothing waits");
  td_close(c);
}

TDT_TEST(keys, short_wait_on_missing_key_times_out) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "late", 0, 50, &s, NULL), TD_ETIMEDOUT);
  cr_assert(strstr(td_last_error(c), "key 'late': not published (waited 50 "
                                     "ms)"),
            "'%s'", td_last_error(c));
  cr_assert_eq(stat_now().waiters, 0);
  cr_assert_eq(td_ping(c, NULL), 0, "the connection stays");
  td_close(c);
}

/* Waits forever for "eventually", then checks what it got. */
static int forever_waiter(void *p) {
  td_client *c;
  td_storage *s;
  td_view v;
  CHECK(td_connect(p, &c) == 0);
  CHECK(td_lookup(c, "eventually", 0, -1, &s, &v) == 0);
  CHECK(td_storage_nbytes(s) == 8192);
  const uint8_t *b = td_storage_data(s);
  CHECK(b[0] == 0x5a && b[8191] == 0x5a);
  CHECK(v.dtype == TD_UINT8 && v.ndim == 1 && v.shape[0] == 8192);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(keys, wait_forever_is_satisfied_by_a_later_publish_elsewhere) {
  pid_t pid = tdt_fork(forever_waiter, d.sock);
  wait_for_waiters(1);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 8192, 0x5a);
  cr_assert_eq(td_publish(c, "eventually", s, NULL), 0, "%s", td_last_error(c));
  td_storage_release(s);
  int st = wait_child(pid, 20000);
  cr_assert_eq(st, 0, "the waiter exited %d (-1: still waiting after 20 s)",
               st);
  cr_assert_eq(td_unpublish(c, "eventually"), 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* ---- publishing ---- */

TDT_TEST(keys, publishing_an_existing_key_replaces_it_and_frees_the_old) {
  td_client *c = tdt_connect(&d);
  td_storage *s1 = make(c, 4096, 1);
  uint64_t id1 = td_storage_id(s1);
  cr_assert_eq(td_publish(c, "latest", s1, NULL), 0);
  td_storage_release(s1);
  cr_assert_eq(tdt_segments(&d), 1, "the key keeps s1");
  td_storage *s2 = make(c, 8192, 2);
  cr_assert_eq(td_publish(c, "latest", s2, NULL), 0);
  want_segments = 1;
  cr_assert(tdt_until(segments_are, &d, 5000),
            "s1 went with its key: %d segment(s)", tdt_segments(&d));
  cr_assert_eq(td_info(c, id1, NULL, NULL, NULL, NULL), TD_ENOENT);
  td_storage *t;
  cr_assert_eq(td_lookup(c, "latest", 0, 0, &t, NULL), 0);
  cr_assert_eq(td_storage_id(t), td_storage_id(s2));
  cr_assert_eq(((uint8_t *)td_storage_data(t))[0], 2);
  td_storage_release(t);
  cr_assert_eq(stat_now().keys, 1);
  cr_assert_eq(td_unpublish(c, "latest"), 0);
  td_storage_release(s2);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, replacing_a_key_keeps_an_old_storage_that_is_still_held) {
  td_client *c = tdt_connect(&d);
  td_storage *s1 = make(c, 4096, 1), *s2 = make(c, 4096, 2);
  cr_assert_eq(td_publish(c, "k", s1, NULL), 0);
  cr_assert_eq(td_publish(c, "also", s1, NULL), 0);
  td_storage_release(s1);
  cr_assert_eq(td_publish(c, "k", s2, NULL), 0);
  cr_assert_eq(tdt_segments(&d), 2, "'also' still holds s1");
  td_storage *t;
  cr_assert_eq(td_lookup(c, "also", 0, 0, &t, NULL), 0);
  cr_assert_eq(((uint8_t *)td_storage_data(t))[0], 1);
  td_storage_release(t);
  /* Publishing a key again onto its own storage changes nothing. */
  cr_assert_eq(td_publish(c, "k", s2, NULL), 0);
  cr_assert_eq(tdt_segments(&d), 2);
  cr_assert_eq(td_unpublish(c, "also"), 0);
  want_segments = 1;
  cr_assert(tdt_until(segments_are, &d, 5000));
  cr_assert_eq(td_unpublish(c, "k"), 0);
  td_storage_release(s2);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, take_really_unpublishes) {
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 128, 3);
  cr_assert_eq(td_publish(c, "once", s, NULL), 0);
  td_storage_release(s);
  td_storage *t, *u;
  cr_assert_eq(td_lookup(c, "once", TD_TAKE, 0, &t, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(((uint8_t *)td_storage_data(t))[0], 3);
  cr_assert_eq(td_lookup(c, "once", 0, 0, &u, NULL), TD_ENOENT);
  cr_assert_eq(td_lookup(c, "once", TD_TAKE, 0, &u, NULL), TD_ENOENT);
  cr_assert_eq(td_unpublish(c, "once"), TD_ENOENT);
  cr_assert_eq(stat_now().keys, 0);
  cr_assert_eq(tdt_segments(&d), 1, "the taker holds it");
  td_storage_release(t);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000),
            "the taker's reference was the last");
  td_close(c);
}

TDT_TEST(keys, take_read_only_gives_a_read_only_handle) {
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 128, 3);
  cr_assert_eq(td_publish(c, "ro", s, NULL), 0);
  td_storage_release(s);
  td_client *c2 = tdt_connect(&d);
  td_storage *t;
  cr_assert_eq(td_lookup(c2, "ro", TD_TAKE | TD_RDONLY, 0, &t, NULL), 0);
  cr_assert(td_storage_is_readonly(t));
  cr_assert_eq(td_publish(c2, "again", t, NULL), TD_EACCES,
               "a read-only handle cannot be published");
  td_storage_release(t);
  td_close(c2);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(keys, publish_from_a_read_only_handle_is_eacces) {
  td_client *c = tdt_connect(&d);
  td_storage *rw = make(c, 256, 1);
  td_storage *ro;
  cr_assert_eq(td_storage_open(c, td_storage_id(rw), TD_RDONLY, &ro), 0);
  cr_assert_eq(td_publish(c, "nope", ro, NULL), TD_EACCES);
  cr_assert(strstr(td_last_error(c), "read-only"), "'%s'", td_last_error(c));
  /* Another client that holds it only read-only. */
  td_client *c2 = tdt_connect(&d);
  td_storage *ro2;
  cr_assert_eq(td_storage_open(c2, td_storage_id(rw), TD_RDONLY, &ro2), 0);
  cr_assert_eq(td_publish(c2, "nope", ro2, NULL), TD_EACCES);
  td_storage *t;
  cr_assert_eq(td_lookup(c, "nope", 0, 0, &t, NULL), TD_ENOENT,
               "nothing was published");
  /* A handle from another client is refused too. */
  cr_assert_eq(td_publish(c2, "nope", rw, NULL), TD_EINVAL);
  td_storage_release(ro2);
  td_close(c2);
  td_storage_release(ro);
  td_storage_release(rw);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* Storage ids are per daemon: a handle of daemon A given to a client of
 * daemon B, where a storage with the same id exists, must not publish B's. */
static tdt_daemon e;
TDT_TEST(keys, publish_refuses_a_handle_of_another_daemon) {
  tdt_start(&e, NULL);
  td_client *ca = tdt_connect(&d), *cb = tdt_connect(&e);
  td_storage *a = make(ca, 64, 'A'), *b = make(cb, 64, 'B');
  cr_assert_eq(td_storage_id(a), td_storage_id(b), "both daemons' first");
  cr_assert_neq(td_client_instance(ca), td_client_instance(cb));
  cr_assert_eq(td_publish(cb, "k", a, NULL), TD_EINVAL);
  char want[128];
  snprintf(want, sizeof(want), "tensord instance %016llx",
           (unsigned long long)td_client_instance(ca));
  cr_assert(strstr(td_last_error(cb), want), "'%s' lacks '%s'",
            td_last_error(cb), want);
  snprintf(want, sizeof(want), "instance %016llx",
           (unsigned long long)td_client_instance(cb));
  cr_assert(strstr(td_last_error(cb), want), "'%s' lacks '%s'",
            td_last_error(cb), want);
  td_storage *t;
  cr_assert_eq(td_lookup(cb, "k", 0, 0, &t, NULL), TD_ENOENT,
               "nothing was published");
  td_storage_release(b);
  td_storage_release(a);
  td_close(cb);
  td_close(ca);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  cr_assert(tdt_until(tdt_no_segments, &e, 5000));
}

/* ---- views ---- */

static void check_view_round_trip(td_client *c, td_storage *s, const char *key,
                                  const td_view *v) {
  cr_assert_eq(td_publish(c, key, s, v), 0, "%s: %s", key, td_last_error(c));
  td_storage *t;
  td_view got;
  memset(&got, 0x77, sizeof(got));
  cr_assert_eq(td_lookup(c, key, TD_RDONLY, 0, &t, &got), 0);
  cr_assert_eq(got.dtype, v->dtype, "%s: dtype", key);
  cr_assert_eq(got.ndim, v->ndim, "%s: ndim", key);
  for (int i = 0; i < v->ndim; i++) {
    cr_assert_eq(got.shape[i], v->shape[i], "%s: shape[%d]", key, i);
    cr_assert_eq(got.stride[i], v->stride[i], "%s: stride[%d]", key, i);
  }
  cr_assert_eq(got.offset, v->offset, "%s: offset", key);
  td_storage_release(t);
}

static int first_view(const td_key_info *k, void *arg) {
  td_view *v = arg;
  if (v->dtype == TD_DTYPE_INVALID)
    *v = k->view;
  return 0;
}

TDT_TEST(keys, lookup_returns_the_exact_published_view) {
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 1024, 0);
  td_view v;
  /* A transposed 4 x 3 float32 matrix, starting at element 2. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_FLOAT32;
  v.ndim = 2;
  v.shape[0] = 3;
  v.shape[1] = 4;
  v.stride[0] = 1;
  v.stride[1] = 3;
  v.offset = 2;
  check_view_round_trip(c, s, "view/transposed", &v);
  /* Every other row of a 8 x 8 int16, broadcast over a leading dim. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_INT16;
  v.ndim = 3;
  v.shape[0] = 5;
  v.shape[1] = 4;
  v.shape[2] = 8;
  v.stride[0] = 0;
  v.stride[1] = 16;
  v.stride[2] = 1;
  v.offset = 8;
  check_view_round_trip(c, s, "view/strided", &v);
  /* 0-d. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_FLOAT64;
  v.offset = 127;
  check_view_round_trip(c, s, "view/scalar", &v);
  /* Empty, at the end. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_UINT8;
  v.ndim = 2;
  v.shape[0] = 0;
  v.shape[1] = 9;
  v.stride[0] = 9;
  v.stride[1] = 1;
  v.offset = 1024;
  check_view_round_trip(c, s, "view/empty", &v);
  /* Sixteen dims. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_BOOL;
  v.ndim = TD_MAX_DIMS;
  for (int i = 0; i < TD_MAX_DIMS; i++) {
    v.shape[i] = i < 10 ? 2 : 1;
    v.stride[i] = i < 10 ? (int64_t)1 << (9 - i) : 0;
  }
  check_view_round_trip(c, s, "view/16d", &v);

  /* td_info shows the asked-for key's view first. */
  td_view first;
  memset(&first, 0, sizeof(first));
  cr_assert_eq(td_info(c, 0, "view/transposed", NULL, first_view, &first), 0);
  cr_assert_eq(first.dtype, TD_FLOAT32);
  cr_assert_eq(first.ndim, 2);
  cr_assert_eq(first.stride[0], 1);
  cr_assert_eq(first.stride[1], 3);
  cr_assert_eq(first.offset, 2);
  td_storage_release(s);
  const char *keys[] = {"view/transposed", "view/strided", "view/scalar",
                        "view/empty", "view/16d"};
  for (int i = 0; i < 5; i++)
    cr_assert_eq(td_unpublish(c, keys[i]), 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

typedef struct view_arg {
  const char *sock;
} view_arg;

static int view_reader(void *p) {
  const view_arg *a = p;
  td_client *c;
  td_storage *s;
  td_view v;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK(td_lookup(c, "shared/view", TD_RDONLY, 5000, &s, &v) == 0);
  CHECK(v.dtype == TD_FLOAT32 && v.ndim == 2);
  CHECK(v.shape[0] == 3 && v.shape[1] == 4);
  CHECK(v.stride[0] == 1 && v.stride[1] == 3);
  CHECK(v.offset == 2);
  const float *f = td_storage_data(s);
  /* Element (i, j) is storage element 2 + i + 3 j. */
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++)
      CHECK(f[v.offset + i * v.stride[0] + j * v.stride[1]] ==
            (float)(2 + i + 3 * j));
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(keys, another_process_reads_through_the_published_view) {
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 16 * sizeof(float), 0);
  float *f = td_storage_data(s);
  for (int i = 0; i < 16; i++)
    f[i] = (float)i;
  td_view v;
  memset(&v, 0, sizeof(v));
  v.dtype = TD_FLOAT32;
  v.ndim = 2;
  v.shape[0] = 3;
  v.shape[1] = 4;
  v.stride[0] = 1;
  v.stride[1] = 3;
  v.offset = 2;
  cr_assert_eq(td_publish(c, "shared/view", s, &v), 0);
  view_arg a = {d.sock};
  cr_assert_eq(wait_child(tdt_fork(view_reader, &a), 30000), 0);
  cr_assert_eq(td_unpublish(c, "shared/view"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

typedef struct lookup_job {
  td_client *c;
  int err;
} lookup_job;

static void *lookup_forever(void *p) {
  lookup_job *j = p;
  td_storage *s = NULL;
  j->err = td_lookup(j->c, "never/comes", 0, -1, &s, NULL);
  td_storage_release(s);
  return NULL;
}

/* In a child (a crash or hang must not take the fixture with it): rounds of
 * a thread waiting in td_lookup while the main thread calls td_close. */
static int close_while_waiting(void *p) {
  const char *sock = p;
  td_client *st;
  CHECK(td_connect(sock, &st) == 0);
  for (int i = 0; i < 20; i++) {
    lookup_job j = {NULL, 1};
    CHECK(td_connect(sock, &j.c) == 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, lookup_forever, &j) == 0);
    td_stat s;
    int tries = 0;
    do {
      CHECK(td_stat_get(st, &s) == 0);
      if (s.waiters == 1)
        break;
      usleep(1000);
    } while (++tries < 10000);
    CHECK(s.waiters == 1);
    td_close(j.c);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    if (pthread_timedjoin_np(t, NULL, &until) != 0) {
      fprintf(stderr,
              "round %d: td_close did not wake the thread waiting "
              "in td_lookup within 10 s\n",
              i);
      return 3;
    }
    if (j.err != TD_ENOTCONN && j.err != TD_ECONNRESET) {
      fprintf(stderr, "round %d: the waiting lookup returned %s\n", i,
              td_err_name(j.err));
      return 4;
    }
  }
  td_close(st);
  return 0;
}

/* td_close from one thread while another waits in td_lookup: the waiting
 * call returns an error (td_close's comment: "a thread blocked reading wakes
 * with an error"), and the daemon forgets the waiter. */
TDT_TEST(keys, closing_the_client_wakes_a_thread_waiting_in_lookup, .timeout = 60) {
  pid_t pid = tdt_fork(close_while_waiting, d.sock);
  int status = wait_child(pid, 30000);
  cr_assert_eq(status, 0,
               "the child %s with %d (see its stderr): 3 = hang, 4 = wrong "
               "error, >128 = killed by a signal",
               status < 0 ? "was killed after 30 s" : "exited", status);
  wait_for_waiters(0);
}

/* ---- key edge cases ---- */

TDT_TEST(keys, longest_and_multibyte_keys_work) {
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 64, 5), *t;
  char k255[256];
  memset(k255, 'z', 255);
  k255[255] = '\0';
  /* 85 three-byte characters: 255 bytes. */
  char euro[256];
  for (int i = 0; i < 85; i++)
    memcpy(euro + 3 * i, "\xe2\x82\xac", 3);
  euro[255] = '\0';
  const char *keys[] = {k255, euro, "caf\xc3\xa9/\xf0\x9f\x98\x80", "x"};
  for (int i = 0; i < 4; i++) {
    cr_assert_eq(td_publish(c, keys[i], s, NULL), 0, "key %d: %s", i,
                 td_last_error(c));
    cr_assert_eq(td_lookup(c, keys[i], TD_RDONLY, 0, &t, NULL), 0);
    cr_assert_eq(((uint8_t *)td_storage_data(t))[0], 5);
    td_storage_release(t);
  }
  cr_assert_eq(stat_now().keys, 4);
  /* One byte less is another key. */
  k255[254] = '\0';
  cr_assert_eq(td_lookup(c, k255, 0, 0, &t, NULL), TD_ENOENT);
  k255[254] = 'z';
  for (int i = 0; i < 4; i++)
    cr_assert_eq(td_unpublish(c, keys[i]), 0, "key %d", i);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

typedef struct same_client_job {
  td_client *c;
  int err;
  uint8_t value;
} same_client_job;

static void *wait_on_shared_client(void *p) {
  same_client_job *j = p;
  td_storage *s = NULL;
  j->err = td_lookup(j->c, "same/client", TD_TAKE, 10000, &s, NULL);
  if (j->err == 0) {
    j->value = ((uint8_t *)td_storage_data(s))[0];
    td_storage_release(s);
  }
  return NULL;
}

/* One client, two threads: a lookup waiting for a key must not hold up the
 * other thread's calls, whose replies overtake it. */
TDT_TEST(keys, a_waiting_lookup_does_not_block_other_calls_on_its_client) {
  same_client_job j = {tdt_connect(&d), 1, 0};
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, wait_on_shared_client, &j), 0);
  wait_for_waiters(1);
  td_storage *s;
  for (int i = 0; i < 20; i++) {
    cr_assert_eq(td_ping(j.c, NULL), 0);
    cr_assert_eq(td_storage_create(j.c, 4096, &s), 0, "%s", td_last_error(j.c));
    td_storage_release(s);
  }
  s = make(j.c, 128, 42);
  cr_assert_eq(td_publish(j.c, "same/client", s, NULL), 0);
  td_storage_release(s);
  pthread_join(t, NULL);
  cr_assert_eq(j.err, 0, "%s", td_err_name(j.err));
  cr_assert_eq(j.value, 42);
  td_close(j.c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

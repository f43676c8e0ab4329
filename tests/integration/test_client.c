/* test_client.c: libtensord's contract with a caller: one error channel for
 * every failing call, and what a forked child may do with its parent's
 * client and storages. */
#include "harness.h"

#include <criterion/criterion.h>
#include <dlpack/dlpack.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;

/* Every test starts its own daemon and stops it at its end (so that
 * tdt_stop's checks count); a test that fails midway leaves nothing. */
static void setup(void) {
  memset(&d, 0, sizeof(d));
}

static void teardown(void) {
  if (d.pid > 0)
    tdt_kill(&d);
}

TestSuite(client, .init = setup, .fini = teardown, .timeout = 60);

#define HAS(s, needle)                                                         \
  cr_assert(strstr((s), (needle)) != NULL, "'%s' does not name '%s'", (s),     \
            (needle))

/* ---- one error channel ---- */

static int lookup_missing(td_client *c, const char *key) {
  td_storage *s;
  return td_lookup(c, key, 0, 0, &s, NULL);
}

/* A failure on one client leaves the message of another's in place, for
 * td_last_error(c); td_last_error(NULL) has the latest of all. */
TDT_TEST(client, errors_of_two_clients_do_not_overwrite_each_other) {
  tdt_start(&d, NULL);
  td_client *a = tdt_connect(&d);
  td_client *b = tdt_connect(&d);
  cr_assert_eq(lookup_missing(a, "missing-on-a"), TD_ENOENT);
  cr_assert_eq(lookup_missing(b, "missing-on-b"), TD_ENOENT);
  HAS(td_last_error(a), "missing-on-a");
  HAS(td_last_error(b), "missing-on-b");
  HAS(td_last_error(NULL), "missing-on-b");
  /* Interleaved again, the other way round, and a success between. */
  cr_assert_eq(lookup_missing(b, "again-on-b"), TD_ENOENT);
  cr_assert_eq(td_ping(a, NULL), 0);
  cr_assert_eq(lookup_missing(a, "again-on-a"), TD_ENOENT);
  HAS(td_last_error(a), "again-on-a");
  HAS(td_last_error(b), "again-on-b");
  HAS(td_last_error(NULL), "again-on-a");
  td_close(a);
  td_close(b);
  tdt_stop(&d);
}

/* Sixteen clients that fail in turn each keep their own message. */
TDT_TEST(client, sixteen_clients_keep_their_messages) {
  tdt_start(&d, NULL);
  td_client *c[16];
  char key[32];
  for (int i = 0; i < 16; i++) {
    c[i] = tdt_connect(&d);
    snprintf(key, sizeof(key), "missing-%d-", i);
    cr_assert_eq(lookup_missing(c[i], key), TD_ENOENT);
  }
  for (int i = 0; i < 16; i++) {
    snprintf(key, sizeof(key), "missing-%d-", i);
    HAS(td_last_error(c[i]), key);
    td_close(c[i]);
  }
  tdt_stop(&d);
}

static void noop_deleter(DLManagedTensor *m) {
  (void)m;
}

/* A view error and a client error are read the same way: whichever came
 * last is td_last_error(NULL) and td_view_last_error(); a call on c that
 * fails in the library's own checks (td_from_dlpack) is td_last_error(c)
 * too; and td_connect's and td_copy's failures are there as well. */
TDT_TEST(client, view_and_client_errors_are_read_the_same_way) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);

  td_view v;
  int64_t shape[2] = {4, -3};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), TD_EINVAL);
  HAS(td_last_error(NULL), "negative size -3");
  HAS(td_view_last_error(), "negative size -3");

  cr_assert_eq(lookup_missing(c, "after-a-view-error"), TD_ENOENT);
  HAS(td_last_error(NULL), "after-a-view-error");
  HAS(td_view_last_error(), "after-a-view-error");
  HAS(td_last_error(c), "after-a-view-error");

  /* A view error after it: the client's own message stays. */
  shape[1] = 3;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_narrow(&v, 5, 0, 1), TD_EINVAL);
  HAS(td_last_error(NULL), "dim 5");
  HAS(td_last_error(c), "after-a-view-error");

  /* td_copy knows no client: td_last_error(NULL). */
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 48, &s), 0, "%s", td_last_error(c));
  td_view big;
  int64_t bshape[1] = {1000};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, bshape, &big), 0);
  cr_assert_eq(td_copy(s, &big, s, &big), TD_ERANGE);
  HAS(td_last_error(NULL), "copy");

  /* td_from_dlpack takes c: its own checks' failure is c's as well. */
  DLManagedTensor m;
  memset(&m, 0, sizeof(m));
  int64_t dshape[1] = {4};
  float data[4] = {0};
  m.dl_tensor.data = data;
  m.dl_tensor.device.device_type = kDLCPU;
  m.dl_tensor.ndim = 1;
  m.dl_tensor.shape = dshape;
  m.dl_tensor.dtype.code = kDLFloat;
  m.dl_tensor.dtype.bits = 32;
  m.dl_tensor.dtype.lanes = 4;
  m.deleter = noop_deleter;
  td_storage *out;
  cr_assert_eq(td_from_dlpack(c, &m, NULL, 0, &out), TD_EINVAL);
  HAS(td_last_error(NULL), "lanes");
  HAS(td_last_error(c), "lanes");

  /* td_connect has no client yet: td_last_error(NULL). */
  char nowhere[160];
  snprintf(nowhere, sizeof(nowhere), "%s/nobody.sock", d.dir);
  td_client *none;
  cr_assert_lt(td_connect(nowhere, &none), 0);
  HAS(td_last_error(NULL), "nobody.sock");
  HAS(td_last_error(c), "lanes");

  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
}

/* ---- fork ---- */

typedef struct fork_job {
  td_client *c;
  td_storage *s;
  pid_t parent;
  const char *sock;
} fork_job;

/* In the child: the parent's client refuses with TD_EFORKED, naming both
 * pids; the mapping is there and shared; releasing the parent's handle and
 * closing the parent's client are safe and send nothing; a new connection
 * works. */
static int child_of_fork(void *p) {
  fork_job *j = p;
  char want[64];
  CHECK_ERR(j->c, td_ping(j->c, NULL), TD_EFORKED);
  snprintf(want, sizeof(want), "process %d", (int)j->parent);
  CHECK_MSG(j->c, want);
  snprintf(want, sizeof(want), "process %d", (int)getpid());
  CHECK_MSG(j->c, want);
  CHECK_MSG(j->c, "td_connect");
  CHECK(strstr(td_last_error(NULL), "td_connect") != NULL);
  td_storage *s2;
  CHECK_ERR(j->c, td_storage_open(j->c, td_storage_id(j->s), 0, &s2),
            TD_EFORKED);
  CHECK_ERR(j->c, td_unpublish(j->c, "forked"), TD_EFORKED);

  uint8_t *b = td_storage_data(j->s);
  CHECK(b[0] == 0x5a && b[4095] == 0xa5);
  b[1] = 0x77; /* the parent sees it: the mapping is shared */

  CHECK(td_storage_release(j->s) == 0);
  td_close(j->c);

  td_client *c;
  CHECK_ERR(NULL, td_connect(j->sock, &c), 0);
  td_storage *s;
  CHECK_ERR(c, td_lookup(c, "forked", TD_RDONLY, 0, &s, NULL), 0);
  CHECK(((uint8_t *)td_storage_data(s))[1] == 0x77);
  td_storage_release(s);
  td_close(c);
  return 0;
}

typedef struct refs_seen {
  uint32_t refs;
} refs_seen;

static int note_refs(const td_storage_info *info, void *arg) {
  ((refs_seen *)arg)->refs = info->refs;
  return 0;
}

TDT_TEST(client, a_forked_child_gets_eforked_and_leaves_the_parent_alone) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  uint8_t *b = td_storage_data(s);
  b[0] = 0x5a;
  b[4095] = 0xa5;
  cr_assert_eq(td_publish(c, "forked", s, NULL), 0, "%s", td_last_error(c));

  fork_job j = {c, s, getpid(), d.sock};
  cr_assert_eq(tdt_wait(tdt_fork(child_of_fork, &j)), 0, "the child failed");

  /* The parent's connection, handle and reference are as they were. */
  cr_assert_eq(b[1], 0x77, "the child's write is seen");
  cr_assert_eq(td_ping(c, NULL), 0, "%s", td_last_error(c));
  refs_seen seen = {0};
  cr_assert_eq(td_info(c, td_storage_id(s), NULL, note_refs, NULL, &seen), 0,
               "%s", td_last_error(c));
  cr_assert_eq(seen.refs, 2, "%u references, not the handle's and the key's",
               seen.refs);
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "forked"), 0, "%s", td_last_error(c));
  td_close(c);
  tdt_stop(&d);
}

static atomic_int stop_pinging;

static void *ping_until_stopped(void *p) {
  td_client *c = p;
  while (!atomic_load(&stop_pinging))
    if (td_ping(c, NULL) < 0)
      break;
  return NULL;
}

static int child_pings(void *p) {
  td_client *c = p;
  CHECK_ERR(c, td_ping(c, NULL), TD_EFORKED);
  td_close(c);
  return 0;
}

/* Waits up to ms for pid; kills it then. Returns its exit status, or -1 if
 * it had to be killed. */
static int wait_child(pid_t pid, int ms) {
  for (int waited = 0; waited < ms; waited += 5) {
    int ws;
    if (waitpid(pid, &ws, WNOHANG) == pid)
      return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  kill(pid, SIGKILL);
  tdt_wait(pid);
  return -1;
}

/* Forks while another thread is in the middle of calls on the client (its
 * locks may be held, its socket mid-message): the child's call must fail
 * with TD_EFORKED at once, neither hang on a lock copied held nor talk on
 * the parent's socket, and the parent's calls go on undisturbed. */
TDT_TEST(client, fork_while_another_thread_is_mid_call) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  atomic_store(&stop_pinging, 0);
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, ping_until_stopped, c), 0);
  int bad = 0;
  for (int i = 0; i < 50 && bad == 0; i++) {
    int st = wait_child(tdt_fork(child_pings, c), 10000);
    if (st != 0) {
      bad = 1;
      cr_expect_eq(st, 0, "fork %d: child %s (%d)", i,
                   st < 0 ? "hung" : "failed", st);
    }
  }
  atomic_store(&stop_pinging, 1);
  pthread_join(t, NULL);
  cr_assert_eq(td_ping(c, NULL), 0, "%s", td_last_error(c));
  td_close(c);
  tdt_stop(&d);
}

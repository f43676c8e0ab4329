/* test_quota.c: the limits tensord sets on its clients: --quota per uid,
 * --max-clients, --max-storages-per-client, and --io-timeout for clients
 * that stall mid-request or never read their replies. */
#include "harness.h"

#include "tensord.pb-c.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

/* A test that fails midway leaves no daemon, segment or directory. */
TestSuite(quota, .init = setup, .fini = tdt_cleanup);

/* ---- helpers ---- */

#define cr_assert_msg_has(c, needle)                                           \
  cr_assert(strstr(td_last_error(c), (needle)) != NULL,                        \
            "message '%s' does not name '%s'", td_last_error(c), (needle))

static uint64_t want_clients;

/* Whether the daemon has want_clients connections besides the one asking. */
static int clients_are(const tdt_daemon *dd) {
  td_client *c;
  if (td_connect(dd->sock, &c) != 0)
    return 0;
  td_stat st;
  int ok = td_stat_get(c, &st) == 0 && st.clients == want_clients + 1;
  td_close(c);
  return ok;
}

/* Runs fn as uid/gid in a forked child; asserts it exits 0. */
typedef struct as_job {
  uid_t uid;
  gid_t gid;
  int (*fn)(void *);
} as_job;

static int as_child(void *p) {
  as_job *j = p;
  if (setgroups(0, NULL) < 0 || setgid(j->gid) < 0 || setuid(j->uid) < 0) {
    fprintf(stderr, "cannot become uid %u: %s\n", (unsigned)j->uid,
            strerror(errno));
    return 2;
  }
  return j->fn(NULL);
}

static void run_as(uid_t uid, gid_t gid, int (*fn)(void *)) {
  as_job j = {uid, gid, fn};
  int st = tdt_wait(tdt_fork(as_child, &j));
  cr_assert_eq(st, 0, "child as uid %u exited %d", (unsigned)uid, st);
}

/* ---- --quota ---- */

static int other_uid_has_its_own_quota(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s, *t = NULL;
  if (td_connect(d.sock, &c) != 0) {
    fprintf(stderr, "connect: %s\n", td_last_error(NULL));
    return 1;
  }
  /* Root uses most of its quota; this uid has all of its own. */
  CHECK_ERR(c, td_storage_create(c, 1 << 20, &s), 0);
  CHECK_ERR(c, td_storage_create(c, 1, &t), TD_EDQUOT);
  CHECK(t == NULL);
  char uid[32];
  snprintf(uid, sizeof(uid), "uid %u", (unsigned)getuid());
  CHECK_MSG(c, uid);
  CHECK_MSG(c, "(1 bytes)");
  CHECK_MSG(c, "(1048576 bytes)");
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(quota, creates_past_the_quota_get_edquot_naming_uid_and_figures,
         .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--quota", "1M", "--socket-mode", "0666",
                                      NULL});
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.quota, 1 << 20);
  cr_assert_gt(st.capacity, 2 << 20, "the quota binds before the capacity");

  td_storage *a, *b, *x = (td_storage *)1;
  cr_assert_eq(td_storage_create(c, 700000, &a), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 400000, &x), TD_EDQUOT, "%s",
               td_last_error(c));
  cr_assert_null(x);
  char uid[32];
  snprintf(uid, sizeof(uid), "uid %u", (unsigned)getuid());
  cr_assert_msg_has(c, uid);
  cr_assert_msg_has(c, "quota");
  cr_assert_msg_has(c, "(400000 bytes)");
  cr_assert_msg_has(c, "(700000 bytes)");
  cr_assert_msg_has(c, "of 1.0 MiB");
  /* Exactly what is left fits; then nothing does. */
  cr_assert_eq(td_storage_create(c, 348576, &b), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 1, &x), TD_EDQUOT);
  cr_assert_msg_has(c, "(1048576 bytes)");

  /* The quota is the uid's, not the connection's. */
  td_client *c2 = tdt_connect(&d);
  cr_assert_eq(td_storage_create(c2, 1, &x), TD_EDQUOT);
  td_close(c2);

  /* Another uid has a quota of its own. */
  if (geteuid() == 0) {
    cr_assert_eq(chmod(d.dir, 0755), 0);
    run_as(4242, 4242, other_uid_has_its_own_quota);
  }

  /* A published storage still counts after its handle is released... */
  cr_assert_eq(td_publish(c, "quota/b", b, NULL), 0);
  td_storage_release(b);
  cr_assert_eq(td_storage_create(c, 1, &x), TD_EDQUOT);
  /* ...and releasing the last reference gives the bytes back. */
  td_storage_release(a);
  cr_assert_eq(td_storage_create(c, 700000, &a), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 1, &x), TD_EDQUOT);
  cr_assert_eq(td_unpublish(c, "quota/b"), 0);
  cr_assert_eq(td_storage_create(c, 348576, &b), 0, "%s", td_last_error(c));
  td_storage_release(a);
  td_storage_release(b);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

TDT_TEST(quota, opening_anothers_storage_costs_no_quota, .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--quota", "64K", NULL});
  td_client *c = tdt_connect(&d), *o = tdt_connect(&d);
  td_storage *s, *t, *x;
  cr_assert_eq(td_storage_create(c, 64 << 10, &s), 0, "%s", td_last_error(c));
  /* Same uid: opening is free, creating is not. */
  cr_assert_eq(td_storage_open(o, td_storage_id(s), 0, &t), 0);
  cr_assert_eq(td_storage_create(o, 1, &x), TD_EDQUOT);
  td_storage_release(s);
  /* The creator's handle is gone, the storage lives on through o's: still
   * charged to the uid that created it. */
  cr_assert_eq(td_storage_create(c, 1, &x), TD_EDQUOT);
  td_storage_release(t);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  cr_assert_eq(td_storage_create(c, 64 << 10, &x), 0, "%s", td_last_error(c));
  td_storage_release(x);
  td_close(o);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- --max-clients ---- */

TDT_TEST(quota, max_clients_refuses_the_next_with_eusers, .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--max-clients", "2", NULL});
  td_client *c1 = tdt_connect(&d);
  td_stat st;
  /* The harness's own check connection may still be closing. */
  for (int i = 0; i < 2500; i++) {
    cr_assert_eq(td_stat_get(c1, &st), 0);
    if (st.clients == 1)
      break;
    tdt_sleep_ms(2);
  }
  cr_assert_eq(st.clients, 1);
  cr_assert_eq(st.max_clients, 2);
  td_client *c2 = tdt_connect(&d);

  td_client *c3 = (td_client *)1;
  cr_assert_eq(td_connect(d.sock, &c3), TD_EUSERS, "third connect: %s",
               td_last_error(NULL));
  cr_assert_null(c3);
  const char *msg = td_last_error(NULL);
  cr_assert(strstr(msg, "--max-clients") != NULL, "'%s'", msg);
  cr_assert(strstr(msg, "2") != NULL, "names the limit: '%s'", msg);
  cr_assert(tdt_log_has(&d, "--max-clients"), "the daemon logs the refusal");

  /* On the wire: an Error with seq 0, then the daemon hangs up. */
  int fd = tdt_raw_connect(&d, 0);
  td__wire w;
  td__wire_init(&w, fd);
  td__frame f;
  int got;
  while ((got = td__wire_frame(&w, &f)) == 0) {
    struct pollfd p = {fd, POLLIN, 0};
    cr_assert_eq(poll(&p, 1, 5000), 1, "no reply from tensord");
    cr_assert_gt(td__wire_recv(&w, 0), 0, "hung up without saying why");
  }
  cr_assert_eq(got, 1);
  Tensord__Response *r = tensord__response__unpack(NULL, f.len, f.data);
  cr_assert_not_null(r);
  cr_assert_eq(r->seq, 0);
  cr_assert_eq(r->body_case, TENSORD__RESPONSE__BODY_ERROR);
  cr_assert_eq(r->error->code, TD_EUSERS);
  tensord__response__free_unpacked(r, NULL);
  td__wire_consume(&w, &f);
  struct pollfd p = {fd, POLLIN, 0};
  cr_assert_eq(poll(&p, 1, 5000), 1);
  ssize_t n = td__wire_recv(&w, 0);
  cr_assert(n == 0 || n == TD_ECONNRESET, "then closed: %zd", n);
  td__wire_free(&w);
  close(fd);

  /* Those in are served as before. */
  cr_assert_eq(td_ping(c1, NULL), 0, "%s", td_last_error(c1));
  cr_assert_eq(td_ping(c2, NULL), 0, "%s", td_last_error(c2));
  cr_assert_eq(td_stat_get(c2, &st), 0);
  cr_assert_eq(st.clients, 2);

  /* One leaves: a newcomer gets in (once the daemon has seen it go). */
  td_close(c1);
  c3 = NULL;
  for (int i = 0; i < 2500 && c3 == NULL; i++) {
    int err = td_connect(d.sock, &c3);
    if (err == 0)
      break;
    cr_assert_eq(err, TD_EUSERS, "%s", td_last_error(NULL));
    tdt_sleep_ms(2);
  }
  cr_assert_not_null(c3, "a place freed up, but no connection got it");
  cr_assert_eq(td_ping(c3, NULL), 0);
  cr_assert_eq(td_connect(d.sock, &c1), TD_EUSERS, "full again");
  td_close(c3);
  td_close(c2);
  tdt_stop(&d);
}

/* ---- --max-storages-per-client ---- */

TDT_TEST(quota, max_storages_per_client_is_emfile_naming_the_limit,
         .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--max-storages-per-client", "3", NULL});
  td_client *c = tdt_connect(&d), *o = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.max_storages_per_client, 3);
  td_storage *s[3], *x = (td_storage *)1;
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_storage_create(c, 4096, &s[i]), 0, "create %d: %s", i,
                 td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &x), TD_EMFILE, "%s",
               td_last_error(c));
  cr_assert_null(x);
  cr_assert_msg_has(c, "--max-storages-per-client");
  cr_assert_msg_has(c, "3 storages");
  cr_assert_eq(tdt_storages(&d), 3, "the refused create made nothing");

  /* A fourth storage of someone else's: no lookup, no open. */
  td_storage *four;
  cr_assert_eq(td_storage_create(o, 4096, &four), 0);
  cr_assert_eq(td_publish(o, "fourth", four, NULL), 0);
  cr_assert_eq(td_lookup(c, "fourth", TD_RDONLY, 0, &x, NULL), TD_EMFILE);
  cr_assert_msg_has(c, "--max-storages-per-client");
  cr_assert_msg_has(c, "fourth");
  cr_assert_eq(td_storage_open(c, td_storage_id(four), 0, &x), TD_EMFILE);
  cr_assert_msg_has(c, "--max-storages-per-client");
  cr_assert_eq(td_lookup(c, "fourth", TD_TAKE, 0, &x, NULL), TD_EMFILE);
  cr_assert_eq(td_lookup(c, "fourth", TD_RDONLY, 0, &x, NULL), TD_EMFILE,
               "the refused take left the key");
  /* What it holds already it may open again, read-write or read-only. */
  td_storage *again;
  cr_assert_eq(td_storage_open(c, td_storage_id(s[0]), TD_RDONLY, &again), 0,
               "%s", td_last_error(c));
  td_storage_release(again);
  cr_assert_eq(td_storage_open(c, td_storage_id(s[1]), 0, &again), 0, "%s",
               td_last_error(c));
  td_storage_release(again);
  /* The limit is per client: o has room. */
  cr_assert_eq(td_storage_create(o, 4096, &x), 0);
  td_storage_release(x);

  /* Releasing one makes room for exactly one. */
  td_storage_release(s[2]);
  cr_assert_eq(td_lookup(c, "fourth", TD_RDONLY, 0, &s[2], NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &x), TD_EMFILE);
  td_storage_release(s[2]);
  cr_assert_eq(td_storage_create(c, 4096, &s[2]), 0, "%s", td_last_error(c));

  for (int i = 0; i < 3; i++)
    td_storage_release(s[i]);
  cr_assert_eq(td_unpublish(o, "fourth"), 0);
  td_storage_release(four);
  td_close(o);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- --io-timeout ---- */

/* Whether one line of d's log contains both a and b. */
static int log_line_has(const char *a, const char *b) {
  FILE *f = fopen(d.log, "r");
  if (f == NULL)
    return 0;
  char line[2048];
  int found = 0;
  while (!found && fgets(line, sizeof(line), f))
    found = strstr(line, a) != NULL && strstr(line, b) != NULL;
  fclose(f);
  return found;
}

/* Waits up to timeout_ms for fd to reach end of stream, reading (and
 * dropping) whatever comes first. Returns 1 at EOF or reset, 0 if the
 * connection is still open when time runs out. */
static int closed_within(int fd, int timeout_ms) {
  char buf[65536];
  for (int waited = 0; waited < timeout_ms; waited += 100) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 100) != 1)
      continue;
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET))
      return 1;
    waited -= 100; /* reading is progress, not waiting */
  }
  return 0;
}

static void send_all(int fd, const void *buf, size_t len) {
  cr_assert_eq(send(fd, buf, len, MSG_NOSIGNAL), (ssize_t)len, "send: %s",
               strerror(errno));
}

TDT_TEST(quota, half_sent_request_is_disconnected_after_io_timeout,
         .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--io-timeout", "300", NULL});
  /* Half a frame header, then nothing. */
  int fd = tdt_raw_connect(&d, 1);
  const uint8_t hdr[8] = {20, 0, 0, 0, 0, 0, 'T', 'D'};
  send_all(fd, hdr, 4);
  char buf[16];
  struct pollfd p = {fd, POLLIN, 0};
  cr_assert_eq(poll(&p, 1, 10000), 1, "still connected after 10 s");
  cr_assert_eq(recv(fd, buf, sizeof(buf), 0), 0, "the daemon hung up");
  close(fd);
  char want[64];
  snprintf(want, sizeof(want), "client %d: sent 4 bytes of a request",
           (int)getpid());
  cr_assert(log_line_has(want, "disconnecting it"),
            "the log names the client's pid: %s", want);

  /* A whole header and half a payload, then nothing. */
  fd = tdt_raw_connect(&d, 1);
  send_all(fd, hdr, 8);
  const uint8_t half[10] = {0};
  send_all(fd, half, sizeof(half));
  cr_assert(closed_within(fd, 10000), "still connected after 10 s");
  close(fd);
  snprintf(want, sizeof(want), "client %d: sent 18 bytes of a request",
           (int)getpid());
  cr_assert(tdt_log_has(&d, want), "%s", want);

  /* An idle client owes nothing and stays, well past the timeout. */
  td_client *c = tdt_connect(&d);
  tdt_sleep_ms(1200);
  cr_assert_eq(td_ping(c, NULL), 0, "idle client: %s", td_last_error(c));
  want_clients = 1;
  cr_assert(tdt_until(clients_are, &d, 5000), "only the idle client is left");
  td_close(c);
  tdt_stop(&d);
}

TDT_TEST(quota, client_that_never_reads_is_disconnected, .timeout = 60) {
  tdt_start(&d, (const char *const[]){"--io-timeout", "300", NULL});
  td_client *other = tdt_connect(&d);
  int fd = tdt_raw_connect(&d, 1);
  td__wire w;
  td__wire_init(&w, fd);
  enum { N = 400, PAYLOAD = 60 * 1024 };
  uint8_t *payload = calloc(1, PAYLOAD);
  for (int i = 0; i < N; i++) {
    Tensord__Ping pm = TENSORD__PING__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    pm.payload.data = payload;
    pm.payload.len = PAYLOAD;
    req.seq = 2 + (uint64_t)i;
    req.body_case = TENSORD__REQUEST__BODY_PING;
    req.ping = &pm;
    size_t len = tensord__request__get_packed_size(&req);
    uint8_t *p = td__wire_reserve(&w, len);
    cr_assert_not_null(p);
    tensord__request__pack(&req, p);
    cr_assert_eq(td__wire_commit(&w, len, NULL, 0), 0);
  }
  free(payload);
  /* Send, never read, until the daemon stops taking requests (or hangs
   * up). */
  for (;;) {
    int err = td__wire_flush(&w, MSG_DONTWAIT);
    if (err != TD_EAGAIN)
      break;
    struct pollfd p = {fd, POLLOUT, 0};
    if (poll(&p, 1, 500) == 0)
      break;
    cr_assert_eq(td_ping(other, NULL), 0, "others are served meanwhile");
  }
  /* The daemon gives up on it; others are served throughout. */
  want_clients = 1;
  int gone = 0;
  for (int i = 0; i < 100 && !gone; i++) {
    cr_assert_eq(td_ping(other, NULL), 0, "%s", td_last_error(other));
    gone = clients_are(&d);
    if (!gone)
      tdt_sleep_ms(100);
  }
  cr_assert(gone, "a client that reads nothing is still connected after "
                  "10 s with --io-timeout 300");
  cr_assert(closed_within(fd, 10000), "its socket reaches end of stream");
  char want[64];
  snprintf(want, sizeof(want), "client %d: ", (int)getpid());
  cr_assert(log_line_has(want, "disconnecting it"),
            "a log line names the client's pid: %s...disconnecting it", want);
  /* The line gives the cause: replies it did not read. (The daemon stopped
   * reading this client's requests itself, so part of one may sit in its
   * buffer: that is not the client's stall.) */
  snprintf(want, sizeof(want), "client %d: left ", (int)getpid());
  int blames_replies = log_line_has(want, "of replies unread");
  char said[256] = "";
  FILE *f = fopen(d.log, "r");
  while (f && fgets(said, sizeof(said), f) && !strstr(said, "disconnecting"))
    ;
  if (f)
    fclose(f);
  td__wire_free(&w);
  close(fd);
  cr_assert_eq(td_ping(other, NULL), 0);
  td_storage *s;
  cr_assert_eq(td_storage_create(other, 4096, &s), 0);
  td_storage_release(s);
  td_close(other);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
  cr_assert(blames_replies,
            "the log line should blame the unread replies ('%s... of replies "
            "unread'); it said: %s",
            want, said);
}

/* ---- running out of fds ---- */

/* Open fds of the daemon now. */
static int daemon_fds(void) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)d.pid);
  DIR *dir = opendir(path);
  cr_assert_not_null(dir, "%s: %s", path, strerror(errno));
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL)
    n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

typedef struct connect_job {
  td_client *c;
  int err;
} connect_job;

static void *connect_thread(void *p) {
  connect_job *j = p;
  j->err = td_connect(d.sock, &j->c);
  return NULL;
}

TDT_TEST(quota, running_out_of_fds_is_an_error_reply_not_a_crash,
         .timeout = 60) {
  enum { LIMIT = 64, MAX = 128 };
  if (getenv("TDT_DAEMON_WRAPPER") != NULL)
    cr_skip_test("under a tool such as valgrind the daemon's fds are the "
                 "tool's to count");
  tdt_start(&d, NULL);
  /* Lower the running daemon's limit (it raised its soft limit to the hard
   * one at start; this lowers both). */
  struct rlimit low = {LIMIT, LIMIT};
  cr_assert_eq(prlimit(d.pid, RLIMIT_NOFILE, &low, NULL), 0, "prlimit: %s",
               strerror(errno));

  td_client *c = tdt_connect(&d), *o = tdt_connect(&d);
  td_storage *s0, *x;
  cr_assert_eq(td_storage_create(c, 4096, &s0), 0);
  /* Clients until every fd number below LIMIT is taken in the daemon. */
  td_client **many = calloc(MAX, sizeof(*many));
  int n = 0;
  for (int stable = 0; stable < 3 && n < MAX;) {
    if (daemon_fds() < LIMIT) {
      many[n++] = tdt_connect(&d);
      stable = 0;
    } else {
      stable++;
      tdt_sleep_ms(50);
    }
  }
  cr_assert_eq(daemon_fds(), LIMIT, "the daemon's fds are all taken");

  /* A create needs an fd: the client is told, the daemon goes on. */
  cr_assert_eq(td_storage_create(c, 4096, &x), TD_EMFILE, "%s",
               td_last_error(c));
  cr_assert_null(x);
  cr_assert(strstr(td_last_error(c), "open files") != NULL, "'%s'",
            td_last_error(c));
  cr_assert_eq(tdt_segments(&d), 1, "the failed create left no segment");
  /* So does an open that needs a new fd. */
  cr_assert_eq(td_storage_open(o, td_storage_id(s0), 0, &x), TD_EMFILE, "%s",
               td_last_error(o));
  cr_assert_eq(td_ping(c, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(td_ping(many[n - 1], NULL), 0);
  td_stat st;
  cr_assert_eq(td_stat_get(o, &st), 0);
  cr_assert_eq(st.storages, 1);

  /* A newcomer waits in the backlog; the daemon says why, keeps serving
   * the others, and takes it in once an fd is free. */
  connect_job j = {NULL, 1};
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, connect_thread, &j), 0);
  for (int i = 0; i < 100 && !tdt_log_has(&d, "accept: Too many open files");
       i++)
    tdt_sleep_ms(50);
  cr_assert(tdt_log_has(&d, "accept: Too many open files"), "see %s", d.log);
  cr_assert_eq(td_ping(c, NULL), 0, "%s", td_last_error(c));
  td_close(many[--n]);
  pthread_join(t, NULL);
  cr_assert_eq(j.err, 0, "the waiting client got in: %s", td_err_name(j.err));
  cr_assert_eq(td_ping(j.c, NULL), 0);
  td_close(j.c);

  /* Free fds again: everything works. */
  td_close(many[--n]);
  td_close(many[--n]);
  int err = TD_EMFILE;
  for (int i = 0; i < 2500 && err == TD_EMFILE; i++) {
    err = td_storage_create(c, 4096, &x);
    if (err == TD_EMFILE)
      tdt_sleep_ms(2);
  }
  cr_assert_eq(err, 0, "%s", td_last_error(c));
  td_storage_release(x);
  cr_assert_eq(td_storage_open(o, td_storage_id(s0), 0, &x), 0, "%s",
               td_last_error(o));
  td_storage_release(x);
  while (n > 0)
    td_close(many[--n]);
  free(many);
  td_storage_release(s0);
  td_close(o);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

TDT_TEST(quota, limits_show_in_stat, .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--quota", "2G", "--max-clients", "7",
                                      "--max-storages-per-client", "9", NULL});
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.quota, 2ull << 30);
  cr_assert_eq(st.max_clients, 7);
  cr_assert_eq(st.max_storages_per_client, 9);
  td_close(c);
  tdt_stop(&d);
  tdt_start(&d, NULL);
  c = tdt_connect(&d);
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.quota, 0, "no quota unless asked");
  cr_assert_eq(st.max_clients, 0);
  cr_assert_eq(st.max_storages_per_client, 0);
  td_close(c);
  tdt_stop(&d);
}

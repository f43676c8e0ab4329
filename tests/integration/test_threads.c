/* test_threads.c: one client shared by many threads: no stall when replies
 * pile up, td_close wakes blocked threads, releases racing opens keep the
 * mapping cache exact, and each thread keeps its own error messages. Also
 * run under ThreadSanitizer (make tsan, ctest label threads). */
#include "harness.h"

#include "tensord.pb-c.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>

static tdt_daemon d;

/* Every test starts its own daemon and stops it at its end (so that
 * tdt_stop's checks count); a test that fails midway leaves nothing. */
static void setup(void) {
  memset(&d, 0, sizeof(d));
}

static void teardown(void) {
  if (d.pid > 0) {
    kill(d.pid, SIGCONT);
    tdt_kill(&d);
  }
}

TestSuite(threads, .init = setup, .fini = teardown, .timeout = 60);

/* ---- helpers ---- */

/* Returns this process's socket connected to path, or -1. */
static int client_fd(const char *path) {
  for (int fd = 0; fd < 4096; fd++) {
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode))
      continue;
    struct sockaddr_un sa;
    socklen_t len = sizeof(sa);
    if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0 &&
        sa.sun_family == AF_UNIX && strcmp(sa.sun_path, path) == 0)
      return fd;
  }
  return -1;
}

/* Shrinks the send buffer of the (one) client socket connected to path to
 * the least the kernel allows, so that a few requests the daemon has not
 * read yet fill it and the next send blocks: what happens anyway with
 * enough threads, made certain. */
static void shrink_sndbuf(const char *path) {
  int fd = client_fd(path);
  cr_assert_geq(fd, 0, "no socket connected to %s", path);
  int one = 1;
  cr_assert_eq(setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &one, sizeof(one)), 0);
}

/* The system call thread tid of this process is blocked in now, or -1 if
 * it is running. */
static long syscall_of(pid_t tid) {
  char path[64], buf[64] = "";
  snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", (int)tid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return -1;
  int ok = fgets(buf, sizeof(buf), f) != NULL;
  fclose(f);
  return ok && buf[0] >= '0' && buf[0] <= '9' ? atol(buf) : -1;
}

/* Joins t, waiting at most ms; returns 0 if it ended. */
static int join_within(pthread_t t, int ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000;
  }
  return pthread_timedjoin_np(t, NULL, &ts);
}

/* ---- replies that pile up ---- */

typedef struct worker {
  td_client *c;
  const char *key;
  int iters;
  int fails;
  int first_err;
  char msg[256];
  atomic_int tid; /* set by the thread itself */
} worker;

static int count_keys(const td_key_info *k, void *arg) {
  (*(int *)arg)++;
  return 0;
}

static void *info_loop(void *p) {
  worker *w = p;
  for (int i = 0; i < w->iters; i++) {
    int n = 0;
    int err = td_info(w->c, 0, w->key, NULL, count_keys, &n);
    if (err < 0 && w->fails++ == 0) {
      w->first_err = err;
      snprintf(w->msg, sizeof(w->msg), "%s", td_last_error(w->c));
    }
  }
  return NULL;
}

#define NKEYS 1024
#define NTHREADS 16

/* Sixteen threads ask for ~0.5 MB replies through one client whose send
 * buffer holds a few requests. The daemon stops reading a client with more
 * than 4 MiB of replies unsent; a sender blocked in sendmsg must then not
 * keep the reader from taking replies, or both sides wait until the daemon
 * gives up (--io-timeout) and every call fails. */
TDT_TEST(threads, replies_that_pile_up_do_not_stall_a_shared_client) {
  tdt_start(&d, (const char *const[]){"--io-timeout", "1000", NULL});
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0, "%s", td_last_error(c));
  char key[TD_KEY_MAX + 1];
  memset(key, 'k', TD_KEY_MAX);
  key[TD_KEY_MAX] = '\0';
  for (int i = 0; i < NKEYS; i++) {
    char num[8];
    snprintf(num, sizeof(num), "%06d", i);
    memcpy(key, num, 6);
    cr_assert_eq(td_publish(c, key, s, NULL), 0, "%s", td_last_error(c));
  }
  shrink_sndbuf(d.sock);
  worker w[NTHREADS];
  pthread_t t[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    w[i] = (worker){c, key, 40, 0, 0, "", 0};
    cr_assert_eq(pthread_create(&t[i], NULL, info_loop, &w[i]), 0);
  }
  for (int i = 0; i < NTHREADS; i++)
    pthread_join(t[i], NULL);
  for (int i = 0; i < NTHREADS; i++)
    cr_expect_eq(w[i].fails, 0, "thread %d: %d calls failed, first %s: %s", i,
                 w[i].fails, td_err_name(w[i].first_err), w[i].msg);
  cr_expect_not(tdt_log_has(&d, "of replies unread for"),
                "tensord found the client stalled");
  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
}

/* ---- td_close from another thread ---- */

static void *ping_once(void *p) {
  worker *w = p;
  atomic_store(&w->tid, gettid());
  w->first_err = td_ping(w->c, NULL);
  if (w->first_err < 0)
    snprintf(w->msg, sizeof(w->msg), "%s", td_last_error(w->c));
  return NULL;
}

static void *close_client(void *p) {
  td_close(p);
  return NULL;
}

/* A process that sends SIGCONT to a stopped daemon if the test process
 * dies (a crash in the test would otherwise leave it stopped for good,
 * holding ctest's output pipe). */
static pid_t stopped_daemon;

static void resume_daemon(int sig) {
  kill(stopped_daemon, SIGCONT);
  _exit(0);
}

static int resume_on_death(void *p) {
  stopped_daemon = *(pid_t *)p;
  signal(SIGTERM, resume_daemon);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  while (getppid() != 1)
    pause(); /* until SIGTERM, or SIGKILL from the test */
  resume_daemon(0);
  return 0;
}

/* With tensord stopped, pings fill the client's send buffer until a thread
 * blocks in sendmsg; the others wait for the send lock or a reply. Once
 * every thread is blocked inside its call (none may start one after
 * td_close), td_close from another thread must return at once and wake
 * them all, each failing with TD_ENOTCONN. */
TDT_TEST(threads, td_close_wakes_a_thread_blocked_sending) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  shrink_sndbuf(d.sock);
  pid_t guard = tdt_fork(resume_on_death, &d.pid);
  cr_assert_eq(kill(d.pid, SIGSTOP), 0);
  enum { N = 16 };
  worker w[N];
  pthread_t t[N];
  for (int i = 0; i < N; i++) {
    w[i] = (worker){c, NULL, 1, 0, 1, "", 0};
    cr_assert_eq(pthread_create(&t[i], NULL, ping_once, &w[i]), 0);
  }
  int sending = 0, inside = 0;
  for (int waited = 0; (!sending || inside < N) && waited < 10000;
       waited += 5) {
    tdt_sleep_ms(5);
    sending = inside = 0;
    for (int i = 0; i < N; i++) {
      long sc = atomic_load(&w[i].tid) > 0 ? syscall_of(w[i].tid) : -1;
      sending += sc == SYS_sendmsg;
      inside += sc == SYS_sendmsg || sc == SYS_recvmsg || sc == SYS_futex;
    }
  }
  cr_assert(sending > 0, "no thread blocked in sendmsg within 10 s");
  cr_assert_eq(inside, N, "%d of %d threads blocked in their calls", inside, N);
  pthread_t closer;
  cr_assert_eq(pthread_create(&closer, NULL, close_client, c), 0);
  int closed = join_within(closer, 10000);
  int joined = 0;
  for (int i = 0; closed == 0 && i < N; i++)
    joined += join_within(t[i], 10000) == 0;
  kill(d.pid, SIGCONT); /* lets everything finish even if the above failed */
  kill(guard, SIGKILL);
  tdt_wait(guard);
  cr_assert_eq(closed, 0, "td_close blocked behind a thread in sendmsg");
  cr_assert_eq(joined, N,
               "%d of %d threads still inside a call after "
               "td_close",
               N - joined, N);
  for (int i = 0; i < N; i++) {
    cr_expect_eq(w[i].first_err, TD_ENOTCONN, "thread %d: %s: %s", i,
                 td_err_name(w[i].first_err), w[i].msg);
    cr_expect(strstr(w[i].msg, "td_close") != NULL, "thread %d: %s", i,
              w[i].msg);
  }
  tdt_stop(&d);
}

/* ---- releases racing opens ---- */

typedef struct racer {
  td_client *c;
  uint64_t id;
  unsigned flags;
  int iters;
  int bad;
  char msg[256];
} racer;

static void *open_release_loop(void *p) {
  racer *r = p;
  for (int i = 0; i < r->iters && r->bad == 0; i++) {
    td_storage *s;
    int err = td_storage_open(r->c, r->id, r->flags, &s);
    if (err < 0) {
      r->bad = 1;
      snprintf(r->msg, sizeof(r->msg), "open: %s", td_last_error(r->c));
      break;
    }
    const uint8_t *b = td_storage_data(s);
    for (size_t k = 0; k < td_storage_nbytes(s); k += 512)
      if (b[k] != (uint8_t)(k / 512 + 7)) {
        r->bad = 2;
        snprintf(r->msg, sizeof(r->msg), "byte %zu is %u", k, b[k]);
      }
    td_storage_release(s);
  }
  return NULL;
}

/* Mappings of daemon d's segments in this process. */
static int mapped_segments(void) {
  char needle[64], line[512];
  snprintf(needle, sizeof(needle), "/dev/shm/tensord.%016llx.",
           (unsigned long long)d.instance);
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert_not_null(f);
  int n = 0;
  while (fgets(line, sizeof(line), f))
    n += strstr(line, needle) != NULL;
  fclose(f);
  return n;
}

typedef struct refs_seen {
  uint32_t refs;
  uint32_t mine;
} refs_seen;

static int note_refs(const td_storage_info *info, void *arg) {
  refs_seen *r = arg;
  r->refs = info->refs;
  for (size_t i = 0; i < info->nholders; i++)
    if (info->holders[i].pid == getpid())
      r->mine += info->holders[i].refs;
  return 0;
}

/* Two threads of one client open and release one storage as fast as they
 * can, one read-write and one read-only, while the main thread holds a
 * handle: each release may be the mode's last while the other thread's
 * open is on its way. Every open must see the bytes, and at the end the
 * process has exactly the main thread's mapping and the daemon exactly its
 * and the key's references: nothing leaked, nothing unmapped twice. */
TDT_TEST(threads, releases_racing_opens_keep_mappings_and_references_exact) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64 * 1024, &s), 0, "%s", td_last_error(c));
  uint8_t *b = td_storage_data(s);
  for (size_t k = 0; k < td_storage_nbytes(s); k += 512)
    b[k] = (uint8_t)(k / 512 + 7);
  cr_assert_eq(td_publish(c, "race", s, NULL), 0, "%s", td_last_error(c));
  uint64_t id = td_storage_id(s);
  td_storage_release(s); /* only the key holds it now */
  cr_assert_eq(mapped_segments(), 0);

  racer r[4] = {{c, id, 0, 3000, 0, ""},
                {c, id, 0, 3000, 0, ""},
                {c, id, TD_RDONLY, 3000, 0, ""},
                {c, id, TD_RDONLY, 3000, 0, ""}};
  pthread_t t[4];
  for (int i = 0; i < 4; i++)
    cr_assert_eq(pthread_create(&t[i], NULL, open_release_loop, &r[i]), 0);
  for (int i = 0; i < 4; i++)
    pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++)
    cr_expect_eq(r[i].bad, 0, "racer %d: %s", i, r[i].msg);

  cr_assert_eq(mapped_segments(), 0, "a released storage is still mapped");
  refs_seen seen = {0, 0};
  cr_assert_eq(td_info(c, id, NULL, note_refs, NULL, &seen), 0, "%s",
               td_last_error(c));
  cr_assert_eq(seen.refs, 1, "%u references where only the key's is left",
               seen.refs);
  cr_assert_eq(seen.mine, 0, "this process still holds %u", seen.mine);
  td_close(c);
  tdt_stop(&d);
}

/* ---- errors, per thread ---- */

typedef struct err_job {
  td_client *a, *b;
  int n;
  int bad;
  char msg[512];
} err_job;

/* Fails on a and b (and in the view algebra) with messages that carry the
 * thread's number, and checks after each that every channel still says what
 * this thread last failed with. */
static void *fail_loop(void *p) {
  err_job *j = p;
  char ka[64], kb[64], want_a[80], want_b[80], want_v[80];
  for (int i = 0; i < 200 && !j->bad; i++) {
    snprintf(ka, sizeof(ka), "missing-a-%d-%d", j->n, i);
    snprintf(kb, sizeof(kb), "missing-b-%d-%d", j->n, i);
    td_storage *s;
    int ea = td_lookup(j->a, ka, 0, 0, &s, NULL);
    int eb = td_lookup(j->b, kb, 0, 0, &s, NULL);
    td_view v;
    int64_t shape = -(int64_t)(j->n * 1000 + i) - 1;
    int ev = td_view_contiguous(TD_FLOAT32, 1, &shape, &v);
    snprintf(want_a, sizeof(want_a), "'%s'", ka);
    snprintf(want_b, sizeof(want_b), "'%s'", kb);
    snprintf(want_v, sizeof(want_v), "%lld", (long long)shape);
    if (ea != TD_ENOENT || eb != TD_ENOENT || ev != TD_EINVAL ||
        strstr(td_last_error(j->a), want_a) == NULL ||
        strstr(td_last_error(j->b), want_b) == NULL ||
        strstr(td_last_error(NULL), want_v) == NULL ||
        strstr(td_view_last_error(), want_v) == NULL) {
      j->bad = 1;
      snprintf(j->msg, sizeof(j->msg), "a: %s | b: %s | any: %s",
               td_last_error(j->a), td_last_error(j->b), td_last_error(NULL));
    }
  }
  return NULL;
}

/* Eight threads fail on two shared clients at once: each thread reads its
 * own last failure per client and of any call, never another thread's. */
TDT_TEST(threads, each_thread_reads_its_own_errors_per_client) {
  tdt_start(&d, NULL);
  td_client *a = tdt_connect(&d);
  td_client *b = tdt_connect(&d);
  err_job j[8];
  pthread_t t[8];
  for (int i = 0; i < 8; i++) {
    j[i] = (err_job){a, b, i, 0, ""};
    cr_assert_eq(pthread_create(&t[i], NULL, fail_loop, &j[i]), 0);
  }
  for (int i = 0; i < 8; i++)
    pthread_join(t[i], NULL);
  for (int i = 0; i < 8; i++)
    cr_expect_eq(j[i].bad, 0, "thread %d: %s", i, j[i].msg);
  td_close(a);
  td_close(b);
  tdt_stop(&d);
}

/* ---- a daemon that hangs up with a reason ---- */

/* A stand-in for tensord on a socket of our own: answers Hello and pings,
 * and after `hangup_after` pings sends a connection error (seq 0) and hangs
 * up, as tensord does on a protocol error. */
typedef struct fake {
  char dir[64];
  char path[108];
  int lfd;
  int hangup_after;
  pthread_t thread;
} fake;

static int fake_reply(td__wire *w, Tensord__Response *r) {
  size_t len = tensord__response__get_packed_size(r);
  uint8_t *p = td__wire_reserve(w, len);
  if (p == NULL)
    return -1;
  tensord__response__pack(r, p);
  if (td__wire_commit(w, len, NULL, 0) < 0)
    return -1;
  return td__wire_flush(w, 0);
}

static void *fake_serve(void *p) {
  fake *f = p;
  int fd = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0)
    return NULL;
  td__wire w;
  td__wire_init(&w, fd);
  int pings = 0, done = 0;
  while (!done) {
    td__frame fr;
    int got = td__wire_frame(&w, &fr);
    if (got < 0)
      break;
    if (got == 0) {
      if (td__wire_recv(&w, 0) <= 0)
        break;
      continue;
    }
    Tensord__Request *req = tensord__request__unpack(NULL, fr.len, fr.data);
    td__close_fds(fr.fds, fr.nfds);
    td__wire_consume(&w, &fr);
    if (req == NULL)
      break;
    Tensord__Response r = TENSORD__RESPONSE__INIT;
    Tensord__HelloReply h = TENSORD__HELLO_REPLY__INIT;
    Tensord__Pong pong = TENSORD__PONG__INIT;
    Tensord__Error e = TENSORD__ERROR__INIT;
    r.seq = req->seq;
    if (req->body_case == TENSORD__REQUEST__BODY_HELLO) {
      h.version = TD_PROTOCOL_VERSION;
      h.instance = 1;
      h.pid = getpid();
      r.body_case = TENSORD__RESPONSE__BODY_HELLO;
      r.hello = &h;
    } else if (++pings <= f->hangup_after) {
      r.body_case = TENSORD__RESPONSE__BODY_PONG;
      r.pong = &pong;
    } else {
      e.code = TD_EPROTO;
      e.message = "the fake daemon hangs up now";
      r.seq = 0;
      r.body_case = TENSORD__RESPONSE__BODY_ERROR;
      r.error = &e;
      done = 1;
    }
    tensord__request__free_unpacked(req, NULL);
    if (fake_reply(&w, &r) < 0)
      break;
  }
  td__wire_free(&w);
  close(fd);
  return NULL;
}

static void fake_start(fake *f, int hangup_after) {
  memset(f, 0, sizeof(*f));
  snprintf(f->dir, sizeof(f->dir), "/tmp/tensord-test.XXXXXX");
  cr_assert_not_null(mkdtemp(f->dir));
  snprintf(f->path, sizeof(f->path), "%.60s/fake.sock", f->dir);
  f->hangup_after = hangup_after;
  f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
  cr_assert(f->lfd >= 0 &&
            bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
            listen(f->lfd, 4) == 0);
  cr_assert_eq(pthread_create(&f->thread, NULL, fake_serve, f), 0);
}

static void fake_stop(fake *f) {
  pthread_join(f->thread, NULL);
  close(f->lfd);
  unlink(f->path);
  rmdir(f->dir);
}

static void *ping_loop(void *p) {
  worker *w = p;
  int err = 0;
  while (err == 0)
    err = td_ping(w->c, NULL);
  w->first_err = err;
  snprintf(w->msg, sizeof(w->msg), "%s", td_last_error(w->c));
  return NULL;
}

/* Threads ping until the daemon hangs up with a reason: every thread's call
 * fails with the daemon's code and reason, also a thread whose send failed
 * before the reason was read (it waits for the reader, or reads what is
 * left itself). The reason is written into the client by whichever thread
 * reads it while the others look: under ThreadSanitizer this is where a racy
 * read of it shows. */
TDT_TEST(threads, a_hang_up_reason_reaches_every_thread) {
  for (int round = 0; round < 20; round++) {
    fake f;
    fake_start(&f, 200);
    td_client *c;
    cr_assert_eq(td_connect(f.path, &c), 0, "%s", td_last_error(NULL));
    enum { N = 8 };
    worker w[N];
    pthread_t t[N];
    for (int i = 0; i < N; i++) {
      w[i] = (worker){c, NULL, 0, 0, 0, "", 0};
      cr_assert_eq(pthread_create(&t[i], NULL, ping_loop, &w[i]), 0);
    }
    for (int i = 0; i < N; i++)
      pthread_join(t[i], NULL);
    for (int i = 0; i < N; i++)
      cr_expect(w[i].first_err == TD_EPROTO &&
                    strstr(w[i].msg, "the fake daemon hangs up now") != NULL,
                "round %d, thread %d: %s: %s", round, i,
                td_err_name(w[i].first_err), w[i].msg);
    td_close(c);
    fake_stop(&f);
  }
}

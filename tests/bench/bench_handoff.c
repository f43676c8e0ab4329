/* bench_handoff.c: latency of handing a storage of N bytes from a producer
 * process to a consumer process through tensord, against passing an fd
 * directly.
 *
 * What is measured. One handoff runs from the moment the producer starts it
 * to the moment the consumer, a separate forked process with its own
 * td_client, has read the storage's first and last byte. Both ends read
 * CLOCK_MONOTONIC, which is one clock for the whole machine: the producer
 * keeps t0, the consumer sends t1 back over a pipe together with the two
 * bytes it read, and the sample is t1 - t0, one way. The pipe only paces the
 * loop; it is not on the clock. The producer checks the bytes (it writes the
 * iteration's value into both), so a stale mapping would be caught.
 *
 * Before each handoff the producer waits until the consumer is already
 * waiting: for tensord, until the daemon counts one waiter (its lookup has
 * arrived) and the consumer's /proc/PID/stat says S (asleep in recvmsg); for
 * the floors, until the consumer is asleep in recvmsg. So every row measures
 * the same thing: a handoff to a consumer that is blocked and must be woken.
 *
 * Noise. On a small VM the cost of a wake-up depends mostly on whether the
 * woken process shares the waker's CPU (a context switch, a few us) or not
 * (an inter-processor interrupt to an idle vCPU, tens of us), and unpinned
 * processes land either way from one run to the next. So the producer is
 * pinned to one CPU and every consumer to another (tensord is left to the
 * scheduler): each row is a cross-CPU handoff. And the msg, floor and pooled
 * handoffs of one size are interleaved round by round, so that their ratios
 * compare samples taken under the same load.
 *
 * Rows, for N = 4 KiB, 1 MiB, 64 MiB, 1 GiB:
 *   floor   the baseline: the producer sends the consumer an fd of a memfd of
 *           N bytes (made once) with sendmsg(SCM_RIGHTS) on a Unix stream
 *           socketpair; the consumer mmaps it, reads first and last byte
 *           (t1), then munmaps and closes it. t0 just before sendmsg.
 *   pooled  a pool of 2 storages of N bytes that both sides already hold (the
 *           consumer keeps one handle on each, so its mapping is cached and
 *           tensord sends no fd). The producer writes the bytes, then t0,
 *           td_publish(key); the consumer's td_lookup(key, TD_TAKE |
 *           TD_RDONLY, -1) returns, it reads the bytes (t1) and releases
 *           the handle it got. Pool storages are republished round-robin.
 *           Should cost one message each way regardless of N.
 *   fresh   t0, then td_storage_create(N), write the bytes, td_publish,
 *           td_storage_release; the consumer's lookup brings a new fd, it
 *           mmaps, reads (t1) and releases (munmap). Includes the daemon's
 *           shm_open + posix_fallocate of N bytes, so it grows with N.
 * and one "msg" row: a bare 16-byte message over the same socketpair, no
 * fd: one wake-up of a blocked process, the cheapest thing any handoff does.
 *
 * Columns: p50 and p99 in microseconds (nearest rank; with fewer than 100
 * samples p99 is the maximum), p50 over the floor's p50 for the same N, and
 * p50 over the bare message's p50. A pooled handoff needs two hops
 * (producer -> tensord -> consumer) where the floor needs one; the target is
 * pooled p50 <= 2x floor p50 at every N, and the same p50 at every N.
 *
 * Usage: bench_handoff SOCKET (or $TENSORD_SOCKET). $TD_BENCH_SCALE scales
 * the time budgets. Sizes that the daemon's capacity, /dev/shm or free memory
 * cannot hold three times over are skipped with a note. */
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define KEY "bench/handoff"
#define POOL 2
#define NSIZES 4

static const uint64_t sizes[NSIZES] = {4096ull, 1ull << 20, 64ull << 20,
                                       1ull << 30};

/* What the consumer sends back after each handoff. */
typedef struct back_msg {
  uint64_t t1;
  uint8_t first, last;
  uint8_t pad[6];
} back_msg;

/* What the floor's producer sends (with or without an fd). */
typedef struct floor_msg {
  uint64_t nbytes;
  uint8_t value;
  uint8_t has_fd;
  uint8_t pad[6];
} floor_msg;

typedef struct consumer_arg {
  const char *sock;
  int back;  /* write end of the pacing pipe */
  int sp;    /* floor: the consumer's end of the socketpair */
  int keep;  /* tensord: handles to keep from the first lookups (the pool) */
  int other; /* the producer's end of the socketpair, closed in the child */
} consumer_arg;

/* How long a case runs: warm-up handoffs (not recorded), then at least min
 * and at most max recorded ones, stopping once seconds have passed. */
typedef struct budget {
  int warmup, min, max;
  double seconds;
} budget;

typedef struct result {
  int skipped;
  uint64_t p50, p99;
  size_t n;
} result;

static double scale;
static int consumer_cpu = -1; /* -1: not pinned */

static void pin_consumer(void) {
  bench_pin(consumer_cpu);
}

/* ---- consumers (forked) ---- */

static int floor_consumer(void *arg) {
  const consumer_arg *a = arg;
  floor_msg m;
  int fd;
  close(a->other); /* so that the producer's close is our end of file */
  pin_consumer();
  while (bench_recv_fd(a->sp, &m, sizeof(m), &fd) == 1) {
    back_msg b;
    memset(&b, 0, sizeof(b));
    if (m.has_fd) {
      if (fd < 0)
        bench_die("floor consumer: no fd came with the message");
      const volatile uint8_t *p =
          mmap(NULL, m.nbytes, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED)
        bench_die("floor consumer: mmap: %s", strerror(errno));
      b.first = p[0];
      b.last = p[m.nbytes - 1];
      b.t1 = bench_now_ns();
      munmap((void *)p, m.nbytes);
      close(fd);
    } else {
      b.t1 = bench_now_ns();
      b.first = b.last = m.value;
    }
    bench_write_full(a->back, &b, sizeof(b));
  }
  return 0;
}

/* Takes what the producer publishes under KEY until it reads a 0. */
static int td_consumer(void *arg) {
  const consumer_arg *a = arg;
  pin_consumer();
  td_client *c = bench_connect(a->sock);
  td_storage *keep[POOL];
  int nkeep = 0;
  for (;;) {
    td_storage *s;
    int err = td_lookup(c, KEY, TD_TAKE | TD_RDONLY, -1, &s, NULL);
    if (err < 0)
      bench_die("consumer: lookup: %s", td_last_error(c));
    const volatile uint8_t *p = td_storage_data(s);
    size_t n = td_storage_nbytes(s);
    back_msg b;
    memset(&b, 0, sizeof(b));
    b.first = p[0];
    b.last = p[n - 1];
    b.t1 = bench_now_ns();
    if (nkeep < a->keep && nkeep < POOL)
      keep[nkeep++] = s;
    else
      td_storage_release(s);
    bench_write_full(a->back, &b, sizeof(b));
    if (b.first == 0)
      break;
  }
  for (int i = 0; i < nkeep; i++)
    td_storage_release(keep[i]);
  td_close(c);
  return 0;
}

/* ---- the producer's side ---- */

static void check_back(const back_msg *b, uint8_t v, const char *what) {
  if (b->first != v || b->last != v)
    bench_die("%s: consumer read %u/%u where %u was written", what, b->first,
              b->last, v);
}

static void result_of(bench_samples *s, result *r) {
  r->skipped = 0;
  r->n = s->n;
  r->p50 = bench_pct(s, 50);
  r->p99 = bench_pct(s, 99);
}

/* Whether the loop of case b should run handoff i (counting warm-up). */
static int more(const budget *b, int i, uint64_t t_start) {
  int rec = i - b->warmup;
  if (rec < b->min)
    return 1;
  if (rec >= b->max)
    return 0;
  return (double)(bench_now_ns() - t_start) < b->seconds * scale * 1e9;
}

typedef struct floor_ctx {
  int sp;   /* the producer's end */
  int back; /* read end of the pacing pipe */
  int statfd;
  pid_t pid;
  uint64_t nbytes; /* of the memfd now */
  int mfd;
  volatile uint8_t *map; /* the producer's mapping of it */
} floor_ctx;

static void floor_start(floor_ctx *f) {
  int sv[2], pp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 ||
      pipe2(pp, O_CLOEXEC) < 0)
    bench_die("socketpair/pipe: %s", strerror(errno));
  consumer_arg a = {NULL, pp[1], sv[1], 0, sv[0]};
  f->pid = bench_fork(floor_consumer, &a);
  close(sv[1]);
  close(pp[1]);
  f->sp = sv[0];
  f->back = pp[0];
  f->statfd = bench_open_stat(f->pid);
  f->nbytes = 0;
  f->mfd = -1;
  f->map = NULL;
}

/* Replaces the floor's memfd with one of nbytes (0: none). */
static void floor_size(floor_ctx *f, uint64_t nbytes) {
  if (f->map != NULL)
    munmap((void *)f->map, f->nbytes);
  if (f->mfd >= 0)
    close(f->mfd);
  f->map = NULL;
  f->mfd = -1;
  f->nbytes = nbytes;
  if (nbytes == 0)
    return;
  f->mfd = memfd_create("bench-floor", MFD_CLOEXEC);
  if (f->mfd < 0 || ftruncate(f->mfd, (off_t)nbytes) < 0)
    bench_die("memfd of %llu bytes: %s", (unsigned long long)nbytes,
              strerror(errno));
  f->map = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, f->mfd, 0);
  if (f->map == MAP_FAILED)
    bench_die("mmap of the memfd: %s", strerror(errno));
}

static void floor_stop(floor_ctx *f) {
  floor_size(f, 0);
  close(f->sp);
  int st = bench_wait(f->pid);
  if (st != 0)
    bench_die("floor consumer exited with %d", st);
  close(f->back);
  close(f->statfd);
}

/* One floor handoff: the memfd (with_fd) or the bare message. Returns its
 * latency in ns. */
static uint64_t floor_once(floor_ctx *f, int with_fd, uint8_t v) {
  floor_msg m;
  memset(&m, 0, sizeof(m));
  m.nbytes = f->nbytes;
  m.value = v;
  m.has_fd = with_fd != 0;
  if (with_fd) {
    f->map[0] = v;
    f->map[f->nbytes - 1] = v;
  }
  bench_wait_asleep(f->statfd, 1000);
  uint64_t t0 = bench_now_ns();
  bench_send_fd(f->sp, &m, sizeof(m), with_fd ? f->mfd : -1);
  back_msg bk;
  if (bench_read_full(f->back, &bk, sizeof(bk)) != 1)
    bench_die("floor consumer went away");
  check_back(&bk, v, with_fd ? "floor" : "msg");
  return bk.t1 > t0 ? bk.t1 - t0 : 0;
}

static void td_check(td_client *c, int err, const char *what) {
  if (err < 0)
    bench_die("%s: %s", what, td_last_error(c));
}

/* Waits until the consumer's lookup is registered with tensord and the
 * consumer is asleep waiting for the answer. */
static void wait_consumer(td_client *c, int statfd) {
  uint64_t deadline = bench_now_ns() + 10ull * 1000000000u;
  for (;;) {
    td_stat st;
    td_check(c, td_stat_get(c, &st), "stat");
    if (st.waiters >= 1)
      break;
    if (bench_now_ns() > deadline)
      bench_die("the consumer's lookup never reached tensord");
    sched_yield();
  }
  bench_wait_asleep(statfd, 1000);
}

/* Waits (at most timeout_ms) until tensord's storages are back to want and
 * /dev/shm has stopped growing back: the daemon unlinks big segments on its
 * thread pool, after the last release. */
static void wait_quiet(td_client *c, uint64_t want, int timeout_ms) {
  uint64_t deadline = bench_now_ns() + (uint64_t)timeout_ms * 1000000u;
  uint64_t last_free = 0;
  int steady = 0;
  for (;;) {
    td_stat st;
    td_check(c, td_stat_get(c, &st), "stat");
    if (st.storages == want) {
      steady = st.shm_free == last_free ? steady + 1 : 0;
      if (steady >= 2)
        return;
    }
    last_free = st.shm_free;
    if (bench_now_ns() > deadline)
      return;
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

static void write_ends(td_storage *s, uint8_t v) {
  volatile uint8_t *p = td_storage_data(s);
  size_t n = td_storage_nbytes(s);
  p[0] = v;
  p[n - 1] = v;
}

/* A producer's side of the pooled or fresh handoffs, and its consumer. */
typedef struct td_ctx {
  td_client *c;
  int pooled;
  uint64_t nbytes;
  pid_t pid;
  int back, statfd;
  td_storage *pool[POOL];
  uint64_t n;         /* handoffs so far */
  uint64_t shm_free0; /* fresh: /dev/shm's free bytes before the first */
} td_ctx;

static void td_start(td_ctx *t, const char *sock, td_client *c, int pooled,
                     uint64_t nbytes) {
  memset(t, 0, sizeof(*t));
  t->c = c;
  t->pooled = pooled;
  t->nbytes = nbytes;
  int pp[2];
  if (pipe2(pp, O_CLOEXEC) < 0)
    bench_die("pipe: %s", strerror(errno));
  consumer_arg a = {sock, pp[1], -1, pooled ? POOL : 0, -1};
  t->pid = bench_fork(td_consumer, &a);
  close(pp[1]);
  t->back = pp[0];
  t->statfd = bench_open_stat(t->pid);
  if (!pooled)
    return;
  /* Hand each pool storage over once; the consumer keeps these handles. */
  back_msg bk;
  for (int j = 0; j < POOL; j++) {
    td_check(c, td_storage_create(c, nbytes, &t->pool[j]), "create");
    write_ends(t->pool[j], 1);
    wait_consumer(c, t->statfd);
    td_check(c, td_publish(c, KEY, t->pool[j], NULL), "publish");
    if (bench_read_full(t->back, &bk, sizeof(bk)) != 1)
      bench_die("consumer went away");
    check_back(&bk, 1, "pool set-up");
  }
}

/* tensord unlinks big segments on its thread pool: before a fresh create,
 * let the last one's pages go, so that each handoff pays for its own
 * allocation only. */
static void wait_unlinked(td_ctx *t) {
  td_stat st;
  td_check(t->c, td_stat_get(t->c, &st), "stat");
  if (t->n == 0)
    t->shm_free0 = st.shm_free;
  uint64_t deadline = bench_now_ns() + 500ull * 1000000u;
  while (st.shm_free + t->nbytes / 2 < t->shm_free0 &&
         bench_now_ns() < deadline) {
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
    td_check(t->c, td_stat_get(t->c, &st), "stat");
  }
  if (st.shm_free + t->nbytes / 2 < t->shm_free0)
    t->shm_free0 = st.shm_free; /* someone else uses /dev/shm: follow */
}

/* One handoff of value v (0 tells the consumer to stop). Returns its
 * latency in ns. */
static uint64_t td_once(td_ctx *t, uint8_t v) {
  td_client *c = t->c;
  if (!t->pooled && t->nbytes > (256u << 10))
    wait_unlinked(t);
  wait_consumer(c, t->statfd);
  uint64_t t0;
  if (t->pooled) {
    td_storage *p = t->pool[t->n % POOL];
    write_ends(p, v);
    t0 = bench_now_ns();
    td_check(c, td_publish(c, KEY, p, NULL), "publish");
  } else {
    td_storage *p;
    t0 = bench_now_ns();
    td_check(c, td_storage_create(c, v ? t->nbytes : 4096, &p), "create");
    write_ends(p, v);
    td_check(c, td_publish(c, KEY, p, NULL), "publish");
    td_storage_release(p);
  }
  t->n++;
  back_msg bk;
  if (bench_read_full(t->back, &bk, sizeof(bk)) != 1)
    bench_die("consumer went away");
  check_back(&bk, v, t->pooled ? "pooled" : "fresh");
  return bk.t1 > t0 ? bk.t1 - t0 : 0;
}

static void td_stop(td_ctx *t) {
  td_once(t, 0);
  int st = bench_wait(t->pid);
  if (st != 0)
    bench_die("consumer exited with %d", st);
  close(t->back);
  close(t->statfd);
  for (int j = 0; j < POOL; j++)
    td_storage_release(t->pool[j]);
  wait_quiet(t->c, 0, 10000);
}

/* Whether tensord, /dev/shm and memory can hold (POOL + 1) storages of n
 * bytes next to the floor's memfd; says why not in why. */
static int fits(td_client *c, uint64_t n, char *why, size_t len) {
  td_stat st;
  td_check(c, td_stat_get(c, &st), "stat");
  uint64_t need = (POOL + 1) * n, cap_free = st.capacity - st.bytes_used;
  int64_t avail = bench_meminfo("MemAvailable");
  char a[32], b[32];
  if (cap_free < need)
    snprintf(why, len, "tensord's capacity has %s free, needs %s",
             bench_size(cap_free, a, sizeof(a)),
             bench_size(need, b, sizeof(b)));
  else if (st.shm_free < need)
    snprintf(why, len, "/dev/shm has %s free, needs %s",
             bench_size(st.shm_free, a, sizeof(a)),
             bench_size(need, b, sizeof(b)));
  else if (avail >= 0 && (uint64_t)avail < need + n + (256ull << 20))
    snprintf(why, len, "%s of memory available, needs %s",
             bench_size((uint64_t)avail, a, sizeof(a)),
             bench_size(need + n + (256ull << 20), b, sizeof(b)));
  else
    return 1;
  return 0;
}

/* Formats a / b as "1.23", or "-" when there is no b. */
static const char *ratio(uint64_t a, uint64_t b, char *buf, size_t len) {
  if (b == 0)
    snprintf(buf, len, "-");
  else
    snprintf(buf, len, "%.2f", (double)a / (double)b);
  return buf;
}

static void print_row(const char *size, const char *mode, const result *r,
                      const result *floor, const result *msg) {
  char f[32], m[32];
  printf("  %-8s %-7s %6zu %9.1f %9.1f %9s %9s\n", size, mode, r->n,
         (double)r->p50 / 1e3, (double)r->p99 / 1e3,
         ratio(r->p50, floor ? floor->p50 : 0, f, sizeof(f)),
         ratio(r->p50, msg->p50, m, sizeof(m)));
}

int main(int argc, char **argv) {
  bench_init("bench_handoff");
  const char *sock = bench_socket(argc, argv);
  scale = bench_scale();
  int cpu_producer;
  consumer_cpu = bench_pin_producer(&cpu_producer);
  td_client *c = bench_connect(sock);
  td_stat st;
  td_check(c, td_stat_get(c, &st), "stat");
  if (st.storages != 0 || st.keys != 0)
    fprintf(stderr,
            "bench_handoff: warning: tensord already has %llu "
            "storage(s), %llu key(s)\n",
            (unsigned long long)st.storages, (unsigned long long)st.keys);

  /* Rounds of one msg, one floor and one pooled handoff, in turn. */
  const budget b_round = {50, 300, 5000, 2.5};
  const budget b_fresh[NSIZES] = {{20, 100, 2000, 1.2},
                                  {10, 50, 2000, 1.2},
                                  {2, 20, 500, 1.5},
                                  {1, 5, 50, 3.0}};
  result msg, fl[NSIZES], po[NSIZES], fr[NSIZES];
  char why[NSIZES][160];
  bench_samples sm = {0};

  floor_ctx f;
  floor_start(&f);
  for (int k = 0; k < NSIZES; k++) {
    uint64_t n = sizes[k];
    why[k][0] = '\0';
    if (!fits(c, n, why[k], sizeof(why[k]))) {
      fl[k].skipped = po[k].skipped = fr[k].skipped = 1;
      continue;
    }
    bench_samples sf = {0}, sp = {0}, sr = {0};
    floor_size(&f, n);
    td_ctx t;
    td_start(&t, sock, c, 1, n);
    uint64_t t_start = bench_now_ns();
    for (int i = 0; more(&b_round, i, t_start); i++) {
      if (i == b_round.warmup)
        t_start = bench_now_ns();
      uint8_t v = (uint8_t)(i % 255 + 1);
      for (int j = 0; j < 3; j++) { /* rotate the order too */
        int which = (i + j) % 3;
        uint64_t ns = which == 0   ? floor_once(&f, 0, v)
                      : which == 1 ? floor_once(&f, 1, v)
                                   : td_once(&t, v);
        if (i >= b_round.warmup)
          bench_samples_add(which == 0 ? &sm : which == 1 ? &sf : &sp, ns);
      }
    }
    td_stop(&t);
    floor_size(&f, 0);
    result_of(&sf, &fl[k]);
    result_of(&sp, &po[k]);

    td_start(&t, sock, c, 0, n);
    t_start = bench_now_ns();
    for (int i = 0; more(&b_fresh[k], i, t_start); i++) {
      if (i == b_fresh[k].warmup)
        t_start = bench_now_ns();
      uint64_t ns = td_once(&t, (uint8_t)(i % 255 + 1));
      if (i >= b_fresh[k].warmup)
        bench_samples_add(&sr, ns);
    }
    td_stop(&t);
    result_of(&sr, &fr[k]);
    bench_samples_free(&sf);
    bench_samples_free(&sp);
    bench_samples_free(&sr);
  }
  floor_stop(&f);
  result_of(&sm, &msg);
  bench_samples_free(&sm);

  printf("\nbench_handoff: producer starts a handoff -> consumer (another "
         "process) has read\nthe first and last byte; one way, consumer "
         "already waiting; microseconds\n");
  if (consumer_cpu >= 0)
    printf("(producer on CPU %d, consumers on CPU %d, tensord unpinned; msg, "
           "floor and pooled\ninterleaved round by round)\n",
           cpu_producer, consumer_cpu);
  printf("\n  %-8s %-7s %6s %9s %9s %9s %9s\n", "N", "mode", "n", "p50 us",
         "p99 us", "/floor", "/msg");
  print_row("-", "msg", &msg, NULL, &msg);
  for (int k = 0; k < NSIZES; k++) {
    char sz[32];
    bench_size(sizes[k], sz, sizeof(sz));
    if (fl[k].skipped) {
      printf("  %-8s skipped: %s\n", sz, why[k]);
      continue;
    }
    print_row(sz, "floor", &fl[k], &fl[k], &msg);
    print_row(sz, "pooled", &po[k], &fl[k], &msg);
    print_row(sz, "fresh", &fr[k], &fl[k], &msg);
  }

  printf("\n  targets (reported, not enforced):\n");
  printf("    pooled p50 <= 2x floor p50:");
  uint64_t lo = UINT64_MAX, hi = 0;
  int all_ok = 1, any = 0;
  for (int k = 0; k < NSIZES; k++) {
    if (po[k].skipped)
      continue;
    char sz[32];
    double x = (double)po[k].p50 / (double)fl[k].p50;
    printf("  %s %.2fx", bench_size(sizes[k], sz, sizeof(sz)), x);
    all_ok &= x <= 2.0;
    any = 1;
    lo = po[k].p50 < lo ? po[k].p50 : lo;
    hi = po[k].p50 > hi ? po[k].p50 : hi;
  }
  printf("  -> %s\n", !any ? "n/a" : all_ok ? "met" : "MISSED");
  if (any) {
    double spread = (double)hi / (double)lo;
    printf("    pooled p50 independent of N (max/min <= 1.5): %.2fx -> %s\n",
           spread, spread <= 1.5 ? "met" : "MISSED");
  }
  td_close(c);
  return 0;
}

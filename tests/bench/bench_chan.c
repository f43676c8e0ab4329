/* bench_chan.c: channels (issue 22 §3): the latency of a slot's handoff by
 * size against a bare futex and against the pooled publish/lookup handoff,
 * and the throughput of many ends on one channel against one channel per
 * pair.
 *
 * Latency. Two processes ping-pong: A (this one) on one CPU, B (forked, with
 * its own td_client) on another; each sample is one round trip, timed by A,
 * divided by 2. Per slot size N, four kinds of round trip take turns, round
 * by round and in a rotating order, so that their ratios compare samples
 * taken under the same load:
 *   futex   the floor: a shared page, two words; A bumps "ping" and
 *           FUTEX_WAKEs it, then FUTEX_WAITs on "pong"; B answers alike.
 *           Nothing spins; each hop wakes a process that sleeps. Not a
 *           function of N.
 *   chan    channels "ping" (A sends) and "pong" (B sends), one slot of N
 *           bytes each: A td_chan_loan, writes byte 0, td_chan_send; B
 *           td_chan_recv, reads it, td_storage_release, loans on "pong",
 *           writes it back, sends; A receives, checks it, releases. No end
 *           spins, so every hop sleeps and is woken, as in the floor.
 *   spin    the same with spin_us = SPIN_US on all four ends. One unrecorded
 *           round trip first, so that both ends are spinning (not asleep
 *           since the turn of another kind) when the recorded one starts.
 *   pooled  today's handoff, bench_handoff's pooled path, both ways: keys
 *           "ping" and "pong", a pool of POOL storages of N bytes on each
 *           side that the other side already holds (its first lookups keep
 *           a handle on each, so tensord sends no fd); A writes byte 0,
 *           td_publish; B td_lookup(TD_TAKE | TD_RDONLY, -1), reads it,
 *           releases, writes it into its own pool storage, publishes; A
 *           looks up, checks, releases. bench_handoff times one way from a
 *           consumer known to be asleep; here the round trip / 2 also
 *           counts each side's release and re-arming lookup, as a
 *           steady stream of handoffs does.
 * Columns: p50 and p99 (nearest rank; the maximum under 100 samples), chan
 * over the futex floor measured in the same rounds, chan and spin over
 * pooled.
 *
 * Throughput. 4 producers (on the first CPU) and 4 consumers (on the
 * second), each a process with its own td_client; producers loan a 4 KiB
 * slot, write a byte and send; consumers receive and release. Either all 8
 * on one channel of 64 slots, or 4 channels of 16 slots with one pair each.
 * All start together and run TPUT_S seconds; handoffs/s counts the slots
 * received in that time. The two layouts take turns, TPUT_RUNS runs each;
 * the median run is shown.
 *
 * Sizes that tensord's capacity, /dev/shm or free memory cannot hold (the
 * channels need 2 N, the pools 2 POOL N more) are skipped with a note, or
 * run without the pooled kind if only the channels fit.
 *
 * Usage: bench_chan SOCKET (or $TENSORD_SOCKET). $TD_BENCH_SCALE scales the
 * time budgets. Timings are printed, never asserted. */
#include "bench.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PING "ping"
#define PONG "pong"
#define POOL 2
#define SPIN_US 50
#define NSIZES 7
#define STOP UINT32_MAX /* the futex word's value that ends B's loop */

#define TPUT_PAIRS 4
#define TPUT_BYTES 4096
#define TPUT_SLOTS 64 /* in all, split evenly over the channels */
#define TPUT_RUNS 5
#define TPUT_S 1.0

static const uint64_t sizes[NSIZES] = {4096ull,     64ull << 10, 1ull << 20,
                                       16ull << 20, 64ull << 20, 256ull << 20,
                                       1ull << 30};

enum kind { FUTEX, CHAN, SPIN, POOLED, NKINDS };

/* The floor's words, a cache line each. */
typedef struct floor_page {
  _Alignas(64) _Atomic uint32_t ping;
  _Alignas(64) _Atomic uint32_t pong;
} floor_page;

typedef struct budget {
  int warmup, min, max;
  double seconds;
} budget;

typedef struct result {
  size_t n;
  uint64_t p50, p99;
} result;

static double scale;

/* ---- small helpers ---- */

static void td_check(td_client *c, int err, const char *what) {
  if (err < 0)
    bench_die("%s: %s", what, td_last_error(c));
}

static void futex_wait(_Atomic uint32_t *w, uint32_t val) {
  syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w, int n) {
  syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, n, NULL, NULL, 0);
}

static td_view bytes_view(uint64_t n) {
  td_view v;
  int64_t shape[1] = {(int64_t)n};
  if (td_view_contiguous(TD_UINT8, 1, shape, &v) < 0)
    bench_die("a view of %llu bytes: %s", (unsigned long long)n,
              td_view_last_error());
  return v;
}

static uint8_t first_byte(const td_storage *s) {
  return *(const volatile uint8_t *)td_storage_data(s);
}

static void set_first_byte(td_storage *s, uint8_t v) {
  *(volatile uint8_t *)td_storage_data(s) = v;
}

/* The kind of round i's j-th handoff: every kind once per round, the order
 * rotating. B runs the same schedule. */
static int kind_at(uint64_t i, int j) {
  return (int)((i + (uint64_t)j) % NKINDS);
}

static void result_of(bench_samples *s, result *r) {
  r->n = s->n;
  r->p50 = bench_pct(s, 50);
  r->p99 = bench_pct(s, 99);
}

/* Whether the loop of budget b should run round i (counting warm-up). */
static int more(const budget *b, int i, uint64_t t_start) {
  int rec = i - b->warmup;
  if (rec < b->min)
    return 1;
  if (rec >= b->max)
    return 0;
  return (double)(bench_now_ns() - t_start) < b->seconds * scale * 1e9;
}

/* Waits (at most timeout_ms) until tensord holds want storages again and
 * /dev/shm has stopped growing back: the daemon unlinks big segments on its
 * thread pool, after the last close. */
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

/* Creates channel name; one of that name may still be going (its last
 * close is a one-way message), so TD_EEXIST is retried for up to 5 s. */
static td_chan *chan_create(td_client *c, const char *name,
                            const td_chan_opts *o) {
  uint64_t deadline = bench_now_ns() + 5000000000ull;
  for (;;) {
    td_chan *ch;
    int err = td_chan_create(c, name, o, &ch);
    if (err == 0)
      return ch;
    if (err != TD_EEXIST || bench_now_ns() > deadline)
      bench_die("create channel %s: %s", name, td_last_error(c));
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* Whether tensord, /dev/shm and memory can hold need more bytes; says why
 * not in why. */
static int fits(td_client *c, uint64_t need, char *why, size_t len) {
  td_stat st;
  td_check(c, td_stat_get(c, &st), "stat");
  uint64_t cap_free = st.capacity - st.bytes_used;
  int64_t avail = bench_meminfo("MemAvailable");
  uint64_t mem_need = need + (256ull << 20);
  char a[32], b[32];
  if (cap_free < need)
    snprintf(why, len, "tensord's capacity has %s free, needs %s",
             bench_size(cap_free, a, sizeof(a)),
             bench_size(need, b, sizeof(b)));
  else if (st.shm_free < need)
    snprintf(why, len, "/dev/shm has %s free, needs %s",
             bench_size(st.shm_free, a, sizeof(a)),
             bench_size(need, b, sizeof(b)));
  else if (avail >= 0 && (uint64_t)avail < mem_need)
    snprintf(why, len, "%s of memory available, needs %s",
             bench_size((uint64_t)avail, a, sizeof(a)),
             bench_size(mem_need, b, sizeof(b)));
  else
    return 1;
  return 0;
}

/* ---- latency: B, the forked side ---- */

typedef struct pair_arg {
  const char *sock;
  uint64_t nbytes;
  int pooled; /* whether the pooled kind runs */
  int cpu;
  floor_page *fp;
} pair_arg;

/* B: answers every handoff of A's schedule until the floor's word says
 * STOP. */
static int partner(void *arg) {
  const pair_arg *a = arg;
  bench_pin(a->cpu);
  td_client *c = bench_connect(a->sock);
  td_chan *ping, *pong;
  td_check(c, td_chan_open(c, PING, TD_CHAN_RECV, 10000, &ping), "open ping");
  td_check(c, td_chan_open(c, PONG, TD_CHAN_SEND, 10000, &pong), "open pong");
  td_view view = bytes_view(a->nbytes);
  td_storage *pool[POOL] = {NULL}, *kept[POOL] = {NULL};
  if (a->pooled)
    for (int j = 0; j < POOL; j++)
      td_check(c, td_storage_create(c, a->nbytes, &pool[j]), "create");
  uint32_t last = 0;
  uint64_t npooled = 0;
  for (uint64_t i = 0;; i++) {
    for (int j = 0; j < NKINDS; j++) {
      int k = kind_at(i, j);
      td_storage *s;
      td_view v;
      uint8_t b;
      switch (k) {
      case FUTEX: {
        uint32_t w;
        while ((w = atomic_load(&a->fp->ping)) == last)
          futex_wait(&a->fp->ping, last);
        if (w == STOP)
          goto done;
        last = w;
        atomic_store(&a->fp->pong, w);
        futex_wake(&a->fp->pong, 1);
        break;
      }
      case CHAN:
      case SPIN: {
        int spin = k == SPIN ? SPIN_US : 0;
        td_chan_set_spin(ping, spin);
        td_chan_set_spin(pong, spin);
        for (int r = 0; r < (k == SPIN ? 2 : 1); r++) {
          td_check(c, td_chan_recv(ping, -1, &s, &v), "receive");
          b = first_byte(s);
          td_storage_release(s);
          td_check(c, td_chan_loan(pong, -1, &s), "loan");
          set_first_byte(s, b);
          td_check(c, td_chan_send(pong, s, &view, -1), "send");
        }
        break;
      }
      case POOLED:
        if (!a->pooled)
          break;
        td_check(c, td_lookup(c, PING, TD_TAKE | TD_RDONLY, -1, &s, NULL),
                 "lookup");
        b = first_byte(s);
        if (npooled < POOL)
          kept[npooled] = s;
        else
          td_storage_release(s);
        set_first_byte(pool[npooled % POOL], b);
        td_check(c, td_publish(c, PONG, pool[npooled % POOL], NULL), "publish");
        npooled++;
        break;
      }
    }
  }
done:
  for (int j = 0; j < POOL; j++) {
    td_storage_release(kept[j]);
    td_storage_release(pool[j]);
  }
  td_chan_close(ping);
  td_chan_close(pong);
  td_close(c);
  return 0;
}

/* ---- latency: A, this process ---- */

typedef struct pair {
  td_client *c;
  uint64_t nbytes;
  int pooled;
  floor_page *fp;
  uint32_t seq; /* the floor's last value */
  td_chan *ping, *pong;
  td_view view;
  td_storage *pool[POOL], *kept[POOL];
  uint64_t npooled;
  pid_t pid;
} pair;

static void check_back(uint8_t got, uint8_t want, const char *what) {
  if (got != want)
    bench_die("%s: B sent back %u where %u was written", what, got, want);
}

/* One round trip of each kind; each returns it in ns, halved. */
static uint64_t futex_once(pair *p) {
  uint64_t t0 = bench_now_ns();
  uint32_t v = ++p->seq;
  atomic_store(&p->fp->ping, v);
  futex_wake(&p->fp->ping, 1);
  uint32_t w;
  while ((w = atomic_load(&p->fp->pong)) != v)
    futex_wait(&p->fp->pong, w);
  return (bench_now_ns() - t0) / 2;
}

static uint64_t chan_once(pair *p, uint8_t v) {
  td_client *c = p->c;
  td_storage *s;
  td_view view;
  uint64_t t0 = bench_now_ns();
  td_check(c, td_chan_loan(p->ping, -1, &s), "loan");
  set_first_byte(s, v);
  td_check(c, td_chan_send(p->ping, s, &p->view, -1), "send");
  td_check(c, td_chan_recv(p->pong, -1, &s, &view), "receive");
  uint8_t got = first_byte(s);
  td_storage_release(s);
  uint64_t t1 = bench_now_ns();
  check_back(got, v, "chan");
  return (t1 - t0) / 2;
}

/* The recorded round trip is the second: both ends spin by then. */
static uint64_t spin_once(pair *p, uint8_t v) {
  td_chan_set_spin(p->ping, SPIN_US);
  td_chan_set_spin(p->pong, SPIN_US);
  chan_once(p, v);
  uint64_t ns = chan_once(p, (uint8_t)(v ^ 0x80));
  td_chan_set_spin(p->ping, 0);
  td_chan_set_spin(p->pong, 0);
  return ns;
}

static uint64_t pooled_once(pair *p, uint8_t v) {
  td_client *c = p->c;
  td_storage *own = p->pool[p->npooled % POOL], *s;
  set_first_byte(own, v);
  uint64_t t0 = bench_now_ns();
  td_check(c, td_publish(c, PING, own, NULL), "publish");
  td_check(c, td_lookup(c, PONG, TD_TAKE | TD_RDONLY, -1, &s, NULL), "lookup");
  uint8_t got = first_byte(s);
  if (p->npooled < POOL)
    p->kept[p->npooled] = s; /* kept: B's pool stays mapped here */
  else
    td_storage_release(s);
  uint64_t t1 = bench_now_ns();
  p->npooled++;
  check_back(got, v, "pooled");
  return (t1 - t0) / 2;
}

static uint64_t once(pair *p, int kind, uint8_t v) {
  switch (kind) {
  case FUTEX:
    return futex_once(p);
  case CHAN:
    return chan_once(p, v);
  case SPIN:
    return spin_once(p, v);
  default:
    return pooled_once(p, v);
  }
}

static void pair_start(pair *p, td_client *c, const char *sock, uint64_t nbytes,
                       int pooled, floor_page *fp, int cpu) {
  memset(p, 0, sizeof(*p));
  p->c = c;
  p->nbytes = nbytes;
  p->pooled = pooled;
  p->fp = fp;
  atomic_store(&fp->ping, 0);
  atomic_store(&fp->pong, 0);
  p->view = bytes_view(nbytes);
  td_chan_opts o = {.slots = 1, .slot_bytes = nbytes, .flags = TD_CHAN_SEND};
  p->ping = chan_create(c, PING, &o);
  o.flags = TD_CHAN_RECV;
  p->pong = chan_create(c, PONG, &o);
  if (pooled)
    for (int j = 0; j < POOL; j++)
      td_check(c, td_storage_create(c, nbytes, &p->pool[j]), "create");
  pair_arg a = {sock, nbytes, pooled, cpu, fp};
  p->pid = bench_fork(partner, &a);
}

/* Runs round i's handoffs until the next is the floor's, then tells B to
 * stop through it; waits for B and frees everything. */
static void pair_stop(pair *p, uint64_t i) {
  for (int j = 0;; j++) {
    int k = kind_at(i, j);
    if (k == FUTEX)
      break;
    if (k != POOLED || p->pooled)
      once(p, k, 1);
  }
  atomic_store(&p->fp->ping, STOP);
  futex_wake(&p->fp->ping, 1);
  int st = bench_wait(p->pid);
  if (st != 0)
    bench_die("B exited with %d", st);
  for (int j = 0; j < POOL; j++) {
    td_storage_release(p->pool[j]);
    td_storage_release(p->kept[j]);
  }
  td_chan_close(p->ping);
  td_chan_close(p->pong);
}

/* ---- throughput ---- */

typedef struct tput_ctl {
  _Atomic uint32_t ready;
  _Alignas(64) _Atomic uint32_t go; /* a futex: 0 until the start */
  _Alignas(64) _Atomic uint32_t stop;
  _Alignas(64) _Atomic uint64_t count[TPUT_PAIRS];
} tput_ctl;

typedef struct tput_arg {
  const char *sock;
  const char *name;
  int send; /* a producer, else a consumer */
  int idx;  /* consumer: where its count goes */
  int cpu;
  tput_ctl *ctl;
} tput_arg;

/* A producer or a consumer of the throughput runs: handoffs until stop,
 * the consumer counting those it received before it. Timeouts of 20 ms
 * let both see stop while the ring is full or empty. */
static int tput_worker(void *arg) {
  const tput_arg *a = arg;
  bench_pin(a->cpu);
  td_client *c = bench_connect(a->sock);
  td_chan *ch;
  td_check(c,
           td_chan_open(c, a->name, a->send ? TD_CHAN_SEND : TD_CHAN_RECV,
                        10000, &ch),
           "open");
  td_view view = bytes_view(TPUT_BYTES);
  tput_ctl *t = a->ctl;
  atomic_fetch_add(&t->ready, 1);
  while (atomic_load(&t->go) == 0)
    futex_wait(&t->go, 0);
  uint64_t n = 0;
  uint8_t v = 1;
  while (!atomic_load(&t->stop)) {
    td_storage *s;
    int err;
    if (a->send) {
      err = td_chan_loan(ch, 20, &s);
      if (err == 0) {
        set_first_byte(s, v++);
        err = td_chan_send(ch, s, &view, 20);
        if (err < 0)
          td_storage_release(s);
      }
    } else {
      td_view sv;
      err = td_chan_recv(ch, 20, &s, &sv);
      if (err == 0) {
        (void)first_byte(s);
        td_storage_release(s);
        if (!atomic_load(&t->stop))
          n++;
      }
    }
    if (err < 0 && err != TD_ETIMEDOUT && !atomic_load(&t->stop))
      bench_die("%s: %s", a->send ? "producer" : "consumer", td_last_error(c));
  }
  if (!a->send)
    atomic_store(&t->count[a->idx], n);
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* One run of nchans channels (1 or TPUT_PAIRS) carrying TPUT_PAIRS
 * producer/consumer pairs. Returns handoffs per second. */
static double tput_run(td_client *c, const char *sock, int nchans, int cpu_prod,
                       int cpu_cons, tput_ctl *t) {
  memset(t, 0, sizeof(*t));
  char names[TPUT_PAIRS][32];
  td_chan *chans[TPUT_PAIRS];
  for (int i = 0; i < nchans; i++) {
    snprintf(names[i], sizeof(names[i]), "tput.%d", i);
    td_chan_opts o = {.capacity = TPUT_SLOTS / nchans,
                      .slots = TPUT_SLOTS / (uint32_t)nchans,
                      .slot_bytes = TPUT_BYTES};
    chans[i] = chan_create(c, names[i], &o);
  }
  pid_t pids[2 * TPUT_PAIRS];
  for (int i = 0; i < 2 * TPUT_PAIRS; i++) {
    int send = i < TPUT_PAIRS, pairno = i % TPUT_PAIRS;
    tput_arg a = {sock,   names[pairno % nchans],     send,
                  pairno, send ? cpu_prod : cpu_cons, t};
    pids[i] = bench_fork(tput_worker, &a);
  }
  uint64_t deadline = bench_now_ns() + 10000000000ull;
  while (atomic_load(&t->ready) < 2 * TPUT_PAIRS) {
    if (bench_now_ns() > deadline)
      bench_die("throughput: the workers did not open their ends in 10 s");
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  uint64_t t0 = bench_now_ns();
  atomic_store(&t->go, 1);
  futex_wake(&t->go, INT_MAX);
  double secs = TPUT_S * scale;
  struct timespec ts = {(time_t)secs,
                        (long)((secs - (double)(time_t)secs) * 1e9)};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
    ;
  atomic_store(&t->stop, 1);
  uint64_t t1 = bench_now_ns();
  for (int i = 0; i < 2 * TPUT_PAIRS; i++) {
    int st = bench_wait(pids[i]);
    if (st != 0)
      bench_die("throughput worker exited with %d", st);
  }
  for (int i = 0; i < nchans; i++)
    td_chan_close(chans[i]);
  uint64_t total = 0;
  for (int i = 0; i < TPUT_PAIRS; i++)
    total += atomic_load(&t->count[i]);
  return (double)total / ((double)(t1 - t0) / 1e9);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* ---- printing ---- */

/* Formats a / b as "1.23", or "-" when there is no b. */
static const char *ratio(uint64_t a, uint64_t b, char *buf, size_t len) {
  if (b == 0)
    snprintf(buf, len, "-");
  else
    snprintf(buf, len, "%.2f", (double)a / (double)b);
  return buf;
}

static double us(uint64_t ns) {
  return (double)ns / 1e3;
}

int main(int argc, char **argv) {
  bench_init("bench_chan");
  const char *sock = bench_socket(argc, argv);
  scale = bench_scale();
  int cpu_a;
  int cpu_b = bench_pin_producer(&cpu_a);
  td_client *c = bench_connect(sock);
  td_stat st;
  td_check(c, td_stat_get(c, &st), "stat");
  uint64_t base = st.storages;
  if (st.storages != 0 || st.keys != 0)
    fprintf(stderr,
            "bench_chan: warning: tensord already has %llu storage(s), "
            "%llu key(s)\n",
            (unsigned long long)st.storages, (unsigned long long)st.keys);
  floor_page *fp = bench_shared(sizeof(floor_page));

  /* ---- latency, size by size ---- */
  const budget b_small = {20, 200, 5000, 1.0}, b_big = {10, 100, 5000, 0.6};
  result res[NSIZES][NKINDS];
  int ran[NSIZES], pooled_ran[NSIZES];
  char why[NSIZES][160];
  bench_samples all_floor = {0};
  memset(res, 0, sizeof(res));
  for (int z = 0; z < NSIZES; z++) {
    uint64_t n = sizes[z];
    why[z][0] = '\0';
    ran[z] = fits(c, 2 * n, why[z], sizeof(why[z]));
    pooled_ran[z] =
        ran[z] && fits(c, (2 + 2 * POOL) * n, why[z], sizeof(why[z]));
    if (!ran[z])
      continue;
    const budget *b = n >= (256ull << 20) ? &b_big : &b_small;
    pair p;
    pair_start(&p, c, sock, n, pooled_ran[z], fp, cpu_b);
    bench_samples s[NKINDS];
    memset(s, 0, sizeof(s));
    uint64_t t_start = bench_now_ns();
    int i;
    for (i = 0; more(b, i, t_start); i++) {
      if (i == b->warmup)
        t_start = bench_now_ns();
      uint8_t v = (uint8_t)(i % 127 + 1);
      for (int j = 0; j < NKINDS; j++) {
        int k = kind_at((uint64_t)i, j);
        if (k == POOLED && !pooled_ran[z])
          continue;
        uint64_t ns = once(&p, k, v);
        if (i >= b->warmup) {
          bench_samples_add(&s[k], ns);
          if (k == FUTEX)
            bench_samples_add(&all_floor, ns);
        }
      }
    }
    pair_stop(&p, (uint64_t)i);
    for (int k = 0; k < NKINDS; k++) {
      result_of(&s[k], &res[z][k]);
      bench_samples_free(&s[k]);
    }
    wait_quiet(c, base, 20000);
  }
  result floor_all;
  result_of(&all_floor, &floor_all);
  bench_samples_free(&all_floor);

  /* ---- throughput, the layouts taking turns ---- */
  tput_ctl *tc = bench_shared(sizeof(tput_ctl));
  double tput[2][TPUT_RUNS];
  for (int r = 0; r < TPUT_RUNS; r++)
    for (int l = 0; l < 2; l++) {
      tput[l][r] = tput_run(c, sock, l == 0 ? 1 : TPUT_PAIRS, cpu_a, cpu_b, tc);
      wait_quiet(c, base, 10000);
    }

  /* ---- tables ---- */
  char sz[32], r1[32], r2[32];
  printf("\nbench_chan: handoffs between two processes, round trip / 2, "
         "microseconds\n");
  if (cpu_b >= 0)
    printf("(A on CPU %d, B on CPU %d, tensord unpinned; futex, chan, spin "
           "and pooled\ninterleaved round by round)\n",
           cpu_a, cpu_b);

  printf("\n1. the floor: a bare futex ping-pong (FUTEX_WAIT/FUTEX_WAKE on a "
         "shared page)\n");
  printf("\n  %-8s %6s %9s %9s\n", "", "n", "p50 us", "p99 us");
  printf("  %-8s %6zu %9.1f %9.1f\n", "futex", floor_all.n, us(floor_all.p50),
         us(floor_all.p99));

  printf("\n2. slot handoffs: loan, write a byte, send / receive, release; "
         "spin: spin_us = %d\n   on every end; /futex: over the floor of "
         "the same rounds\n",
         SPIN_US);
  printf("\n  %-8s %6s %9s %9s %9s %8s %9s %9s\n", "N", "n", "futex us",
         "p50 us", "p99 us", "/futex", "spin p50", "spin p99");
  for (int z = 0; z < NSIZES; z++) {
    bench_size(sizes[z], sz, sizeof(sz));
    if (!ran[z]) {
      printf("  %-8s skipped: %s\n", sz, why[z]);
      continue;
    }
    const result *f = &res[z][FUTEX], *ch = &res[z][CHAN], *sp = &res[z][SPIN];
    printf("  %-8s %6zu %9.1f %9.1f %9.1f %8s %9.2f %9.2f\n", sz, ch->n,
           us(f->p50), us(ch->p50), us(ch->p99),
           ratio(ch->p50, f->p50, r1, sizeof(r1)), us(sp->p50), us(sp->p99));
  }

  printf("\n3. the baseline: pooled publish/lookup (TD_TAKE) of the same "
         "sizes, both ways\n");
  printf("\n  %-8s %6s %9s %9s %12s %12s\n", "N", "n", "p50 us", "p99 us",
         "chan/pooled", "spin/pooled");
  for (int z = 0; z < NSIZES; z++) {
    bench_size(sizes[z], sz, sizeof(sz));
    if (!pooled_ran[z]) {
      printf("  %-8s skipped: %s\n", sz, why[z]);
      continue;
    }
    const result *po = &res[z][POOLED];
    printf("  %-8s %6zu %9.1f %9.1f %12s %12s\n", sz, po->n, us(po->p50),
           us(po->p99), ratio(res[z][CHAN].p50, po->p50, r1, sizeof(r1)),
           ratio(res[z][SPIN].p50, po->p50, r2, sizeof(r2)));
  }

  printf("\n4. throughput: %d producers (CPU %d) and %d consumers (CPU %d), "
         "%s slots,\n   %.1f s a run, the layouts taking turns\n",
         TPUT_PAIRS, cpu_a, TPUT_PAIRS, cpu_b,
         bench_size(TPUT_BYTES, sz, sizeof(sz)), TPUT_S * scale);
  printf("\n  %-28s %12s   %s\n", "layout", "handoffs/s", "(median; runs)");
  double med[2];
  for (int l = 0; l < 2; l++) {
    double sorted[TPUT_RUNS];
    memcpy(sorted, tput[l], sizeof(sorted));
    qsort(sorted, TPUT_RUNS, sizeof(double), cmp_double);
    med[l] = sorted[TPUT_RUNS / 2];
    char label[64];
    if (l == 0)
      snprintf(label, sizeof(label), "1 channel, %d+%d ends, %d slots",
               TPUT_PAIRS, TPUT_PAIRS, TPUT_SLOTS);
    else
      snprintf(label, sizeof(label), "%d channels, 1+1, %d slots each",
               TPUT_PAIRS, TPUT_SLOTS / TPUT_PAIRS);
    printf("  %-28s %12.0f   (", label, med[l]);
    for (int r = 0; r < TPUT_RUNS; r++)
      printf("%s%.0f", r ? " " : "", tput[l][r]);
    printf(")\n");
  }
  printf("  one channel / four channels: %.2f\n",
         med[1] > 0 ? med[0] / med[1] : 0.0);

  printf("\n  targets (reported, not enforced):\n");
  /* 4 KiB is sizes[0], 64 MiB sizes[4]. */
  if (ran[0] && ran[4]) {
    double x = (double)res[4][CHAN].p50 / (double)res[0][CHAN].p50;
    printf("    size-independence, chan p50 64 MiB <= 1.3x 4 KiB: %.1f vs "
           "%.1f us, %.2fx -> %s\n",
           us(res[4][CHAN].p50), us(res[0][CHAN].p50), x,
           x <= 1.3 ? "met" : "not met");
  } else {
    printf("    size-independence: n/a (4 KiB or 64 MiB skipped)\n");
  }
  double worst = 0, worst_spin = 0;
  int any = 0;
  printf("    chan p50 <= 1.5x futex floor:");
  for (int z = 0; z < NSIZES; z++) {
    if (!ran[z])
      continue;
    double x = (double)res[z][CHAN].p50 / (double)res[z][FUTEX].p50;
    printf(" %s %.2fx", bench_size(sizes[z], sz, sizeof(sz)), x);
    worst = x > worst ? x : worst;
    worst_spin =
        us(res[z][SPIN].p50) > worst_spin ? us(res[z][SPIN].p50) : worst_spin;
    any = 1;
  }
  printf(" -> %s\n", !any ? "n/a" : worst <= 1.5 ? "met" : "not met");
  printf("    spin p50 <= 2 us: worst %.2f us -> %s\n", worst_spin,
         !any                ? "n/a"
         : worst_spin <= 2.0 ? "met"
                             : "not met");
  td_close(c);
  return 0;
}

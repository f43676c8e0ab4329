/* bench_many.c: attaching a model published tensor by tensor, 1,000 keys,
 * with one td_lookup_many against 1,000 td_lookup calls (issue 23 §1:
 * "1,000 keys attached in < 20 ms on CPU").
 *
 * Set-up. The producer (this process) makes N = 1,000 CPU storages of one
 * size and publishes each under its own key, as a C user publishes a
 * model's tensors one key each.
 *
 * What is measured. A consumer process, with its own td_client, attaches
 * every key: the time from its first request until it holds, for all N
 * keys, a handle, its view and td_storage_data (so mappings that populate
 * have populated).
 *   lookup      N td_lookup calls (one round trip each): the baseline.
 *   many        one td_lookup_many of the N keys.
 * Then it releases every handle and waits for one more reply (td_stat_get)
 * so that the daemon has handled the releases: every round attaches from
 * nothing. The two are interleaved round by round after one warm-up round.
 *
 * Rows: 4 KiB storages, 2 MiB storages (populated at attach), 2 MiB with
 * TD_LAZY (mapped, not populated). Columns: p50 and p99 in ms (with fewer
 * than 100 rounds p99 is the maximum), and lookup's p50 over many's.
 *
 * Usage: bench_many SOCKET (or $TENSORD_SOCKET). */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 1000

typedef struct row {
  const char *name;
  size_t nbytes;
  unsigned flags;
} row;

static const row rows[] = {
    {"4 KiB", 4096, TD_RDONLY},
    {"2 MiB", 2u << 20, TD_RDONLY},
    {"2 MiB lazy", 2u << 20, TD_RDONLY | TD_LAZY},
};
#define NROWS (sizeof(rows) / sizeof(rows[0]))

static const char *sock;
static char keybuf[N][48];
static const char *keys[N];

/* What a consumer sends back: each round's times, lookup then many. */
typedef struct result {
  int rounds;
  uint64_t lookup_ns[1000], many_ns[1000];
} result;

static result *res; /* shared with the consumer */
static int consumer_cpu = -1;

static void detach(td_client *c, td_storage **s) {
  for (size_t i = 0; i < N; i++) {
    td_storage_release(s[i]);
    s[i] = NULL;
  }
  td_stat st;
  if (td_stat_get(c, &st) < 0)
    bench_die("stat: %s", td_last_error(c));
}

static uint64_t attach_lookup(td_client *c, unsigned flags, td_storage **s,
                              td_view *v) {
  uint64_t t0 = bench_now_ns();
  for (size_t i = 0; i < N; i++) {
    if (td_lookup(c, keys[i], flags, 0, &s[i], &v[i]) < 0)
      bench_die("lookup '%s': %s", keys[i], td_last_error(c));
    if (td_storage_data(s[i]) == NULL)
      bench_die("no data");
  }
  return bench_now_ns() - t0;
}

static uint64_t attach_many(td_client *c, unsigned flags, td_storage **s,
                            td_view *v) {
  uint64_t t0 = bench_now_ns();
  if (td_lookup_many(c, keys, N, flags, 0, s, v, NULL) < 0)
    bench_die("lookup_many: %s", td_last_error(c));
  for (size_t i = 0; i < N; i++)
    if (td_storage_data(s[i]) == NULL)
      bench_die("no data");
  return bench_now_ns() - t0;
}

static int consumer(void *arg) {
  const row *r = arg;
  bench_pin(consumer_cpu);
  td_client *c = bench_connect(sock);
  static td_storage *s[N];
  static td_view v[N];
  /* Warm-up: the first attach of each kind is not recorded. */
  attach_lookup(c, r->flags, s, v);
  detach(c, s);
  attach_many(c, r->flags, s, v);
  detach(c, s);
  uint64_t budget = (uint64_t)(3e9 * bench_scale()), t0 = bench_now_ns();
  int n = 0;
  while (n < 1000 && (n < 5 || bench_now_ns() - t0 < budget)) {
    res->lookup_ns[n] = attach_lookup(c, r->flags, s, v);
    detach(c, s);
    res->many_ns[n] = attach_many(c, r->flags, s, v);
    detach(c, s);
    n++;
  }
  res->rounds = n;
  td_close(c);
  return 0;
}

static double ms(uint64_t ns) {
  return (double)ns / 1e6;
}

int main(int argc, char **argv) {
  bench_init("bench_many");
  sock = bench_socket(argc, argv);
  int cpu_producer = -1;
  consumer_cpu = bench_pin_producer(&cpu_producer);
  res = bench_shared(sizeof(*res));
  td_client *c = bench_connect(sock);
  printf("\nbench_many: attaching %d keys, one CPU storage each, by a second "
         "process\n",
         N);
  printf("  %-11s %6s %10s %10s %10s %10s %8s\n", "storages", "rounds",
         "lookup p50", "lookup p99", "many p50", "many p99", "ratio");
  double many_4k = 0;
  for (size_t k = 0; k < NROWS; k++) {
    const row *r = &rows[k];
    static td_storage *made[N];
    for (size_t i = 0; i < N; i++) {
      snprintf(keybuf[i], sizeof(keybuf[i]), "bench_many/%zu/%04zu", r->nbytes,
               i);
      keys[i] = keybuf[i];
      td_create_opts o = {.nbytes = r->nbytes};
      if (td_storage_create_ex(c, &o, &made[i]) < 0)
        bench_die("create: %s", td_last_error(c));
      int64_t shape[1] = {(int64_t)(r->nbytes / 4)};
      td_view v;
      td_view_contiguous(TD_FLOAT32, 1, shape, &v);
      if (td_publish(c, keys[i], made[i], &v) < 0)
        bench_die("publish: %s", td_last_error(c));
    }
    memset(res, 0, sizeof(*res));
    if (bench_wait(bench_fork(consumer, (void *)r)) != 0)
      bench_die("the consumer failed");
    bench_samples a = {0}, b = {0};
    for (int i = 0; i < res->rounds; i++) {
      bench_samples_add(&a, res->lookup_ns[i]);
      bench_samples_add(&b, res->many_ns[i]);
    }
    uint64_t a50 = bench_pct(&a, 50), b50 = bench_pct(&b, 50);
    printf("  %-11s %6d %10.2f %10.2f %10.2f %10.2f %7.1fx\n", r->name,
           res->rounds, ms(a50), ms(bench_pct(&a, 99)), ms(b50),
           ms(bench_pct(&b, 99)), b50 ? (double)a50 / (double)b50 : 0);
    if (k == 0)
      many_4k = ms(b50);
    bench_samples_free(&a);
    bench_samples_free(&b);
    for (size_t i = 0; i < N; i++) {
      td_unpublish(c, keys[i]);
      td_storage_release(made[i]);
    }
  }
  printf("  times in ms; ratio: lookup p50 / many p50\n");
  printf("\n  target (reported, not enforced):\n");
  printf("    1,000 keys of 4 KiB attached with td_lookup_many < 20 ms: "
         "%.2f ms -> %s\n",
         many_4k, many_4k < 20 ? "met" : "NOT met");
  td_close(c);
  return 0;
}

/* bench_copy.c: td_copy's kernels against memcpy in the same run, and the
 * cost of one view operation.
 *
 * What is measured. Two 64 MiB buffers of float32 (4096 x 4096), touched
 * before any timing. Each copy runs REPS times (7 by default) and the median
 * time is reported as GB/s of bytes copied (64 MiB / time, 1 GB = 1e9 B).
 *   memcpy        glibc's memcpy of the 64 MiB: the baseline.
 *   contiguous    td__copy_raw of a contiguous view to a contiguous view (the
 *                 plan reduces it to the one memcpy).
 *   transposed    td__copy_raw from the transposed view (strides 1, 4096)
 *                 into a contiguous one: the cache-blocked tiles.
 *   rows          td__copy_raw of the left half of every row (a memcpy of
 *                 8 KiB per row), as GB/s of the 32 MiB moved.
 * td__copy_raw is what td_copy runs once it has checked both views against
 * their storages (a few hundred ns, not measured here), so no daemon is
 * needed. The view ops are timed in loops of 1,000,000 calls each, median of
 * 5 loops, as ns per call, on a 3-d float32 view.
 *
 * Usage: bench_copy [SOCKET] (the socket is ignored). $TD_BENCH_SCALE scales
 * the number of repetitions (at least 3 copies, 100,000 view calls). */
#include "bench.h"

#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define N 4096
#define BYTES ((size_t)N * N * sizeof(float))

static volatile int64_t sink;

static void *big(void) {
  void *p = mmap(NULL, BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    bench_die("mmap of %zu bytes failed", BYTES);
  memset(p, 1, BYTES); /* fault every page in now */
  return p;
}

typedef enum { MEMCPY, CONTIG, TRANSPOSED, ROWS, NKINDS } kind;
static const char *const names[NKINDS] = {"memcpy", "contiguous", "transposed",
                                          "rows (half)"};

/* Returns the median ns of reps copies of kind k from src to dst. */
static uint64_t time_copy(kind k, float *dst, float *src, int reps) {
  int64_t shape[2] = {N, N};
  td_view dv, sv;
  td_view_contiguous(TD_FLOAT32, 2, shape, &dv);
  sv = dv;
  if (k == TRANSPOSED)
    td_view_transpose(&sv, 0, 1);
  if (k == ROWS) {
    td_view_narrow(&dv, 1, 0, N / 2);
    td_view_narrow(&sv, 1, N / 2, N / 2);
  }
  bench_samples s = {0};
  for (int r = 0; r < reps + 1; r++) {
    uint64_t t0 = bench_now_ns();
    if (k == MEMCPY)
      memcpy(dst, src, BYTES);
    else if (td__copy_raw(dst, &dv, src, &sv, 0) < 0)
      bench_die("copy: %s", td_view_last_error());
    uint64_t t1 = bench_now_ns();
    if (r > 0) /* the first run warms caches and TLBs */
      bench_samples_add(&s, t1 - t0);
  }
  uint64_t med = bench_pct(&s, 50);
  bench_samples_free(&s);
  return med;
}

/* Checks that the transposed copy did transpose. */
static void check_transposed(const float *dst, const float *src) {
  for (int i = 0; i < N; i += 97)
    for (int j = 0; j < N; j += 89)
      if (dst[(size_t)i * N + j] != src[(size_t)j * N + i])
        bench_die("transposed copy is wrong at (%d, %d)", i, j);
}

typedef enum {
  V_TRANSPOSE,
  V_NARROW,
  V_SELECT,
  V_SLICE,
  V_UNSQUEEZE,
  V_EXPAND,
  V_RESHAPE,
  V_PERMUTE,
  V_REINTERPRET,
  V_CHECK,
  NVOPS
} vop;
static const char *const vnames[NVOPS] = {
    "transpose", "narrow",  "select",  "slice",       "unsqueeze",
    "expand",    "reshape", "permute", "reinterpret", "check"};

/* Returns the median ns per call of op over loops of n calls. */
static double time_view(vop op, long n) {
  int64_t shape[3] = {64, 32, 16};
  td_view base, v;
  td_view_contiguous(TD_FLOAT32, 3, shape, &base);
  int64_t flat[2] = {64, 512}, ex[4] = {8, 64, 32, 16};
  int32_t perm[3] = {2, 0, 1};
  bench_samples s = {0};
  for (int loop = 0; loop < 5; loop++) {
    int64_t acc = 0;
    uint64_t t0 = bench_now_ns();
    for (long i = 0; i < n; i++) {
      v = base;
      int err = 0;
      switch (op) {
      case V_TRANSPOSE:
        err = td_view_transpose(&v, 0, 2);
        break;
      case V_NARROW:
        err = td_view_narrow(&v, 1, i & 15, 16);
        break;
      case V_SELECT:
        err = td_view_select(&v, 0, i & 63);
        break;
      case V_SLICE:
        err = td_view_slice(&v, 2, 1, INT64_MAX, 2);
        break;
      case V_UNSQUEEZE:
        err = td_view_unsqueeze(&v, 1);
        break;
      case V_EXPAND:
        err = td_view_expand(&v, 4, ex);
        break;
      case V_RESHAPE:
        err = td_view_reshape(&v, 2, flat);
        break;
      case V_PERMUTE:
        err = td_view_permute(&v, perm);
        break;
      case V_REINTERPRET:
        err = td_view_reinterpret(&v, TD_BFLOAT16);
        break;
      case V_CHECK:
        err = td_view_check(&v, (size_t)1 << 20);
        break;
      default:
        break;
      }
      acc += err + v.offset + v.stride[0];
    }
    uint64_t t1 = bench_now_ns();
    sink = acc;
    bench_samples_add(&s, t1 - t0);
  }
  double med = (double)bench_pct(&s, 50) / (double)n;
  bench_samples_free(&s);
  return med;
}

int main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  bench_init("bench_copy");
  double scale = bench_scale();
  int reps = (int)(7 * scale);
  if (reps < 3)
    reps = 3;
  long calls = (long)(1000000 * scale);
  if (calls < 100000)
    calls = 100000;

  float *src = big(), *dst = big();
  for (size_t i = 0; i < (size_t)N * N; i++)
    src[i] = (float)i;
  double gbs[NKINDS];
  for (int k = 0; k < NKINDS; k++) {
    uint64_t ns = time_copy((kind)k, dst, src, reps);
    size_t moved = k == ROWS ? BYTES / 2 : BYTES;
    gbs[k] = (double)moved / (double)ns;
    if (k == TRANSPOSED)
      check_transposed(dst, src);
  }
  printf("\nbench_copy: 64 MiB float32 (4096 x 4096), median of %d copies "
         "after one warm-up\n",
         reps);
  printf("  %-12s %8s %8s\n", "copy", "GB/s", "x memcpy");
  for (int k = 0; k < NKINDS; k++)
    printf("  %-12s %8.2f %8.2f\n", names[k], gbs[k], gbs[k] / gbs[MEMCPY]);

  printf("\n  view ops on float32[64, 32, 16], median of 5 loops of %ld "
         "calls (view copied in each call)\n",
         calls);
  printf("  %-12s %8s\n", "op", "ns/call");
  double worst = 0;
  for (int o = 0; o < NVOPS; o++) {
    double ns = time_view((vop)o, calls);
    worst = ns > worst ? ns : worst;
    printf("  %-12s %8.1f\n", vnames[o], ns);
  }

  double rc = gbs[CONTIG] / gbs[MEMCPY], rt = gbs[TRANSPOSED] / gbs[MEMCPY];
  printf("\n  targets (reported, not enforced):\n");
  printf("    contiguous within 10%% of memcpy: %.2f -> %s\n", rc,
         rc >= 0.90 ? "met" : "MISSED");
  printf("    transposed >= 0.25 x memcpy: %.2f -> %s\n", rt,
         rt >= 0.25 ? "met" : "MISSED");
  printf("    a view op < 100 ns: slowest %.1f ns -> %s\n", worst,
         worst < 100 ? "met" : "MISSED");
  munmap(src, BYTES);
  munmap(dst, BYTES);
  return 0;
}

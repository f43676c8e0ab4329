/* bench_populate.c: what MAP_POPULATE buys a mapping of a shm segment, by
 * size, for pages that already exist and for fresh ones.
 *
 * What is measured. One op is what a libtensord handle costs the process
 * that gets it: mmap of the segment's fd, a touch of every byte, munmap.
 *   write   PROT_READ|PROT_WRITE, memset of every byte (the producer);
 *   read    PROT_READ, a sum over every 8-byte word (the consumer);
 *   map     PROT_READ, no touch at all: what populating costs a consumer
 *           that reads one element only (populate's worst case).
 * each made with and without MAP_POPULATE, the two interleaved round by
 * round, median of the rounds, in microseconds, and their ratio
 * (populate / plain: below 1 populate pays).
 * Two kinds of segment, made with shm_open + posix_fallocate as tensord
 * makes them:
 *   existing  pages that exist already: the segment was written once through
 *             another mapping (since unmapped) before the rounds; the case of
 *             a reader of a filled storage, and of a recycled segment.
 *   fresh     a new segment per op, fallocated but never touched (not
 *             timed); its first touch pays the page's zeroing as well.
 * For sizes 4 KiB .. 256 MiB. Needs no daemon.
 *
 * Usage: bench_populate [SOCKET] (the socket is ignored). $TD_BENCH_SCALE
 * scales the time each cell runs (at least 3 rounds each). */
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define NSIZES 9
static const size_t sizes[NSIZES] = {4u << 10,   16u << 10, 64u << 10,
                                     256u << 10, 1u << 20,  4u << 20,
                                     16u << 20,  64u << 20, 256u << 20};

enum op { OP_WRITE, OP_READ, OP_MAP, NOPS };
static const char *const op_name[NOPS] = {"write", "read", "map only"};

static volatile uint64_t sink;
static unsigned seq;

/* Returns the fd of a new shm object of n bytes, fallocated, its name
 * already unlinked. Dies on failure. */
static int segment(size_t n) {
  char name[64];
  snprintf(name, sizeof(name), "/tdbench.%d.%u", (int)getpid(), seq++);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    bench_die("shm_open(%s): %s", name, strerror(errno));
  shm_unlink(name);
  int err = posix_fallocate(fd, 0, (off_t)n);
  if (err != 0)
    bench_die("posix_fallocate(%zu): %s", n, strerror(err));
  return fd;
}

/* Maps fd (n bytes), does op, unmaps; returns the nanoseconds it took. */
static uint64_t one(int fd, size_t n, enum op op, int populate) {
  int prot = PROT_READ | (op == OP_WRITE ? PROT_WRITE : 0);
  uint64_t t0 = bench_now_ns();
  void *p =
      mmap(NULL, n, prot, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (p == MAP_FAILED)
    bench_die("mmap(%zu): %s", n, strerror(errno));
  if (op == OP_WRITE) {
    memset(p, (int)(seq & 0xff), n);
  } else if (op == OP_READ) {
    const uint64_t *w = p;
    uint64_t s = 0;
    for (size_t i = 0; i < n / 8; i++)
      s += w[i];
    sink += s;
  }
  munmap(p, n);
  return bench_now_ns() - t0;
}

int main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  bench_init("bench_populate");
  double budget = 0.4 * bench_scale(); /* seconds per size, op and kind */
  /* [existing/fresh][op][plain/populate][size] */
  double med[2][NOPS][2][NSIZES];
  int rounds_done[2][NSIZES];
  for (int z = 0; z < NSIZES; z++) {
    size_t n = sizes[z];
    /* existing pages: filled once through a mapping of their own */
    int efd = segment(n);
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, efd, 0);
    if (p == MAP_FAILED)
      bench_die("mmap(%zu): %s", n, strerror(errno));
    memset(p, 1, n);
    munmap(p, n);
    for (int kind = 0; kind < 2; kind++) {
      bench_samples s[NOPS][2];
      memset(s, 0, sizeof(s));
      uint64_t t_end = bench_now_ns() + (uint64_t)(budget * NOPS * 1e9);
      int r = 0;
      for (; r < 1000 && (r < 3 || bench_now_ns() < t_end); r++)
        for (int op = 0; op < NOPS; op++)
          for (int k = 0; k < 2; k++) {
            int pop = (r + k) % 2; /* alternate which goes first */
            int fd = kind == 0 ? efd : segment(n);
            bench_samples_add(&s[op][pop], one(fd, n, (enum op)op, pop));
            if (kind == 1)
              close(fd);
          }
      rounds_done[kind][z] = r;
      for (int op = 0; op < NOPS; op++)
        for (int pop = 0; pop < 2; pop++) {
          med[kind][op][pop][z] = (double)bench_pct(&s[op][pop], 50) / 1e3;
          bench_samples_free(&s[op][pop]);
        }
    }
    close(efd);
  }

  static const char *const kind_name[2] = {
      "existing pages (written once through another mapping)",
      "fresh pages (a new fallocated segment per op)"};
  for (int kind = 0; kind < 2; kind++) {
    printf("\nbench_populate: mmap + touch every byte + munmap, %s;\n"
           "  median us, plain | MAP_POPULATE | populate/plain\n\n",
           kind_name[kind]);
    printf("  %8s %6s", "size", "rounds");
    for (int op = 0; op < NOPS; op++)
      printf(" | %-26s", op_name[op]);
    printf("\n");
    for (int z = 0; z < NSIZES; z++) {
      char b[32];
      printf("  %8s %6d", bench_size(sizes[z], b, sizeof(b)),
             rounds_done[kind][z]);
      for (int op = 0; op < NOPS; op++) {
        double a = med[kind][op][0][z], c = med[kind][op][1][z];
        printf(" | %9.1f %9.1f %6.2f", a, c, a > 0 ? c / a : 0);
      }
      printf("\n");
    }
  }
  printf("\n  (map only: PROT_READ, no byte touched; the populate column is "
         "what a\n   consumer that reads one element pays for populating)\n");
  return 0;
}

/* bench.h: what the tensord benchmarks share: the clock, samples and their
 * percentiles, the socket path, forked workers and fixed-size pipe messages. */
#ifndef TD_BENCH_H
#define TD_BENCH_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* CLOCK_MONOTONIC in nanoseconds; one clock for every process of the
 * machine, so a time taken in one process can be subtracted from a time
 * taken in another. */
uint64_t bench_now_ns(void);

/* Prints "PROG: message" on stderr and exits 1 (_exit in a forked child, so
 * the parent's stdio buffers are not flushed twice). */
void bench_die(const char *fmt, ...)
    __attribute__((format(printf, 1, 2), noreturn));

/* Names the program in messages and marks this process as the parent. */
void bench_init(const char *prog);

/* Returns the socket path: argv[1], else $TENSORD_SOCKET; dies if neither. */
const char *bench_socket(int argc, char **argv);

/* Connects to tensord at sock, retrying for up to 10 s while the daemon is
 * still starting (ENOENT, ECONNREFUSED); dies on any other failure. Writes
 * the daemon's instance to $TD_BENCH_INSTANCE_FILE if that is set, so that
 * run.sh can find the daemon's segments should it have to kill it. */
td_client *bench_connect(const char *sock);

/* Scales every time budget: $TD_BENCH_SCALE (default 1; 0.1 for a smoke
 * run). */
double bench_scale(void);

/* A growing array of nanosecond samples. */
typedef struct bench_samples {
  uint64_t *v;
  size_t n, cap;
  int sorted;
} bench_samples;

void bench_samples_add(bench_samples *s, uint64_t ns);
/* Returns the p-th percentile (0 < p <= 100, nearest rank), 0 if empty.
 * Sorts s. */
uint64_t bench_pct(bench_samples *s, double p);
void bench_samples_free(bench_samples *s);

/* Forks a child that runs fn(arg) and _exits with its return value; the
 * child dies with its parent (PR_SET_PDEATHSIG). Flushes stdio first.
 * Returns the child's pid; dies if fork fails. */
pid_t bench_fork(int (*fn)(void *), void *arg);
/* Waits for pid; returns its exit status, or 128 + the signal that ended
 * it. */
int bench_wait(pid_t pid);
/* Waits (yielding the CPU) until pid is asleep, state S in /proc/pid/stat:
 * blocked in the receive it waits for next. Returns 0, or -1 after
 * timeout_ms. statfd is /proc/pid/stat opened once by the caller. */
int bench_wait_asleep(int statfd, int timeout_ms);
/* Opens /proc/pid/stat; dies on failure. */
int bench_open_stat(pid_t pid);

/* Memory shared with the children forked after this call; dies if none. */
void *bench_shared(size_t len);

/* Writes or reads exactly len bytes. bench_read_full returns 1 when it read
 * them, 0 at end of file before any byte; it dies on errors and short
 * reads, as bench_write_full does. */
void bench_write_full(int fd, const void *buf, size_t len);
int bench_read_full(int fd, void *buf, size_t len);

/* Pins this process (the producer) to the first CPU it may use and returns
 * the second, for consumers to bench_pin; -1 (no pinning) if it may use
 * only one. *producer gets the first, or -1. */
int bench_pin_producer(int *producer);
/* Pins this process to cpu (nothing if cpu < 0). */
void bench_pin(int cpu);

/* Sends the len bytes of buf over the Unix stream socket s, with fd (if
 * >= 0) attached by SCM_RIGHTS; dies on failure. */
void bench_send_fd(int s, const void *buf, size_t len, int fd);
/* Receives exactly len bytes from s into buf, and the fd that came with
 * them into *fd (-1 if none; close-on-exec). Returns 1, or 0 at end of
 * stream before any byte; dies on errors and short messages. */
int bench_recv_fd(int s, void *buf, size_t len, int *fd);

/* Formats n bytes as "4 KiB", "64 MiB", "1 GiB" (or "123 B"); returns buf. */
char *bench_size(uint64_t n, char *buf, size_t len);

/* Reads "Key:  N kB" from /proc/pid/status; returns bytes, or -1. */
int64_t bench_proc_status(pid_t pid, const char *key);
/* Reads "Key: N kB" from /proc/meminfo; returns bytes, or -1. */
int64_t bench_meminfo(const char *key);

#endif /* TD_BENCH_H */

/* bench_model.c: loading a safetensors checkpoint of 1 GiB into tensord
 * (td_model_load) against reading the same file from the page cache with
 * cat, interleaved round by round, and the attach of that checkpoint by a
 * reader (td_model_open) (issue 19 §1).
 *
 * Rows:
 *   cat        `cat FILE >/dev/null`, forked and exec'd, the file warm in
 *              the page cache: what reading it costs at all.
 *   load       td_model_load(TD_MODEL_FORCE, default threads): validation,
 *              the lock, one new storage per shard filled by splice, the 
 *              manifest and the keys; the previous version is dropped (no
 *              one holds it), so its segments go to the daemon's pool.
 *   load 1t    the same with one reading thread.
 *   attach     td_model_open(TD_RDONLY | TD_LAZY) + td_model_close, as a
 *              server worker attaches: lookups, the manifest parsed.
 *   attach ro  td_model_open(TD_RDONLY), its mappings populated.
 * Columns: p50 and p99 in ms (with fewer than 100 samples p99 is the
 * maximum), GB/s at the p50, and the p50's rate over cat's (loads).
 * Targets (issue 19): load >= 0.8x cat; attach <= 10 ms.
 *
 * The file (4 tensors, one shard, 1 GiB; $TD_BENCH_SCALE scales it, and
 * the rounds) is written under $TMPDIR (else /tmp) and removed, and the
 * model unloaded, whatever happens (atexit).
 *
 * Usage: bench_model SOCKET (or $TENSORD_SOCKET). */
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB (1024ull * 1024)

static char path[512];
static td_client *client;
static pid_t main_pid; /* cleanup runs there only */

static void cleanup(void) {
  if (client != NULL && getpid() == main_pid) {
    td_model_unload(client, "bench_model");
    td_close(client);
    client = NULL;
  }
  if (path[0] != '\0' && getpid() == main_pid)
    unlink(path);
}

/* Writes a safetensors file of 4 F32 tensors of n/4 bytes each. */
static uint64_t write_file(uint64_t n) {
  const char *tmp = getenv("TMPDIR");
  snprintf(path, sizeof(path), "%s/bench_model.%d.safetensors",
           tmp && *tmp ? tmp : "/tmp", (int)getpid());
  uint64_t each = n / 4 / 4; /* elements */
  char h[1024];
  int len = snprintf(h, sizeof(h), "{\"__metadata__\":{\"format\":\"pt\"}");
  for (int i = 0; i < 4; i++)
    len += snprintf(h + len, sizeof(h) - (size_t)len,
                    ",\"layer.%d.weight\":{\"dtype\":\"F32\",\"shape\":[%" PRIu64
                    "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                    i, each, (uint64_t)i * each * 4,
                    (uint64_t)(i + 1) * each * 4);
  len += snprintf(h + len, sizeof(h) - (size_t)len, "}");
  while ((8 + len) % 8 != 0)
    h[len++] = ' ';
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    bench_die("%s: %s", path, strerror(errno));
  uint8_t len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (uint8_t)((uint64_t)len >> (8 * i));
  bench_write_full(fd, len8, 8);
  bench_write_full(fd, h, (size_t)len);
  size_t chunk = 4 * MiB;
  uint8_t *buf = malloc(chunk);
  for (size_t i = 0; i < chunk; i++)
    buf[i] = (uint8_t)(i * 31 + i / 4093);
  uint64_t data = each * 4 * 4;
  for (uint64_t done = 0; done < data; done += chunk)
    bench_write_full(fd, buf, data - done < chunk ? data - done : chunk);
  free(buf);
  close(fd);
  return 8 + (uint64_t)len + data;
}

static uint64_t run_cat(void) {
  uint64_t t0 = bench_now_ns();
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (pid == 0) {
    int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    execlp("cat", "cat", path, (char *)NULL);
    _exit(127);
  }
  int st;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    bench_die("cat %s failed", path);
  return bench_now_ns() - t0;
}

static uint64_t run_load(unsigned threads) {
  td_load_opts o = {.flags = TD_MODEL_FORCE, .threads = threads};
  td_load_result r;
  uint64_t t0 = bench_now_ns();
  if (td_model_load(client, path, "bench_model", &o, &r) < 0)
    bench_die("load: %s", td_last_error(client));
  return bench_now_ns() - t0;
}

static uint64_t run_attach(unsigned flags) {
  td_model *m;
  uint64_t t0 = bench_now_ns();
  if (td_model_open(client, "bench_model", flags, 0, &m) < 0)
    bench_die("attach: %s", td_last_error(client));
  uint64_t t = bench_now_ns() - t0;
  td_model_close(m);
  return t;
}

static void row(const char *name, bench_samples *s, uint64_t bytes,
                double cat_gbs) {
  double p50 = (double)bench_pct(s, 50) / 1e6, p99 = (double)bench_pct(s, 99) / 1e6;
  if (bytes == 0) {
    printf("%-10s %10.3f %10.3f %10s %10s\n", name, p50, p99, "-", "-");
    return;
  }
  double gbs = (double)bytes / (p50 / 1e3) / 1e9;
  char ratio[32] = "-";
  if (cat_gbs > 0)
    snprintf(ratio, sizeof(ratio), "%.2fx", gbs / cat_gbs);
  printf("%-10s %10.3f %10.3f %10.2f %10s\n", name, p50, p99, gbs, ratio);
}

int main(int argc, char **argv) {
  bench_init("bench_model");
  main_pid = getpid();
  const char *sock = bench_socket(argc, argv);
  client = bench_connect(sock);
  atexit(cleanup);
  double scale = bench_scale();
  uint64_t n = (uint64_t)(1024 * MiB * (scale < 1 ? scale : 1));
  n = n < 16 * MiB ? 16 * MiB : n;
  int rounds = (int)(6 * scale);
  rounds = rounds < 3 ? 3 : rounds;
  uint64_t bytes = write_file(n);
  run_cat(); /* into the page cache */
  run_cat();
  run_load(0); /* version 1, and the pool primed */
  bench_samples cat = {0}, load = {0}, load1 = {0}, att = {0}, attro = {0};
  for (int i = 0; i < rounds; i++) {
    bench_samples_add(&cat, run_cat());
    bench_samples_add(&load, run_load(0));
    bench_samples_add(&load1, run_load(1));
  }
  for (int i = 0; i < 200 * (scale < 1 ? scale : 1) + 20; i++) {
    bench_samples_add(&att, run_attach(TD_RDONLY | TD_LAZY));
    bench_samples_add(&attro, run_attach(TD_RDONLY));
  }
  printf("bench_model: a %.0f MiB safetensors file (4 tensors, 1 shard), "
         "%d rounds, from the page cache\n",
         (double)bytes / MiB, rounds);
  printf("%-10s %10s %10s %10s %10s\n", "", "p50 ms", "p99 ms", "GB/s",
         "vs cat");
  double cat_gbs =
      (double)bytes / ((double)bench_pct(&cat, 50) / 1e9) / 1e9;
  row("cat", &cat, bytes, 0);
  row("load", &load, bytes, cat_gbs);
  row("load 1t", &load1, bytes, cat_gbs);
  row("attach", &att, 0, 0);
  row("attach ro", &attro, 0, 0);
  double ratio = (double)bench_pct(&cat, 50) / (double)bench_pct(&load, 50);
  double attach_ms = (double)bench_pct(&att, 50) / 1e6;
  printf("targets: load >= 0.8x cat: %.2fx %s; attach <= 10 ms: %.3f ms %s\n",
         ratio, ratio >= 0.8 ? "met" : "MISSED", attach_ms,
         attach_ms <= 10 ? "met" : "MISSED");
  bench_samples_free(&cat);
  bench_samples_free(&load);
  bench_samples_free(&load1);
  bench_samples_free(&att);
  bench_samples_free(&attro);
  return 0;
}

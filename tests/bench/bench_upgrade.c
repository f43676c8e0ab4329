/* bench_upgrade.c: the pause clients see while tensord hands itself over to
 * a new process (`tensord --upgrade`), with 10,000 storages live, against
 * the same clients' latency with no upgrade in the same run.
 *
 * What is measured. The bench starts a tensord of its own (an upgrade
 * replaces the daemon's process, so run.sh's daemon is left alone; the
 * socket run.sh passes is ignored). A holder process creates NSTORAGES
 * storages of 4 KiB and publishes each under a key, and keeps them. Eight
 * client processes then run td_lookup(key, TD_RDONLY, 0) of a random key
 * plus td_storage_release back to back, recording when each op started and
 * how long it took. The clients hold nothing between ops, so each op is the
 * full path: a round trip, an fd, a mapping. After a baseline second, the
 * bench runs ROUNDS upgrades, half a second apart: it starts `tensord
 * --upgrade` on the same socket and waits for the old process to exit.
 *   no upgrade      every op that ended before the first upgrade began
 *   during upgrade  every op that overlapped a handover: it was in flight
 *                   at some moment between the start of `tensord --upgrade`
 *                   and the exit of the old process
 *   pause           per upgrade, the longest op that overlapped it: what the
 *                   unluckiest client waited
 *   handover        per upgrade, from the exec of the new process to the exit
 *                   of the old one (start-up included: an upper bound of the
 *                   time clients are not served)
 * The target (issue 11): p99 during the upgrade under 50 ms at 10k storages.
 * Errors are counted, not tolerated: an upgrade must be invisible to
 * clients, so the bench fails if any op failed.
 *
 * Usage: bench_upgrade [SOCKET] (ignored). $TD_BENCH_SCALE scales the
 * number of storages (at least 1,000) and the baseline time. */
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NCLIENTS 8
#define ROUNDS 5
#define MAXOPS (1u << 18) /* samples kept per client */
#define KEYFMT "bench/upgrade/%06u"

typedef struct op {
  uint64_t start, end; /* bench_now_ns */
} op;

typedef struct shared {
  volatile int stop;
  unsigned nstorages;
  uint64_t errors[NCLIENTS];
  char first_error[NCLIENTS][160];
  uint32_t nops[NCLIENTS];
  op ops[NCLIENTS][MAXOPS];
} shared;

static shared *sh;
static char dir[64], sock[96], logpath[96];
static uint64_t capacity_arg = 256u << 20;

/* Starts tensord (plain, or --upgrade next to the running one); returns its
 * pid. Its stderr goes to the log, which the bench prints if it fails. */
static pid_t spawn_daemon(int upgrade) {
  char cap[32];
  snprintf(cap, sizeof(cap), "%llu", (unsigned long long)capacity_arg);
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* dies with the bench */
    int fd = open(logpath, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd >= 0)
      dup2(fd, 2);
    if (upgrade)
      execl(TD_DAEMON, "tensord", "--upgrade", "--socket", sock, "--log-level",
            "warn", "--capacity", cap, (char *)NULL);
    else
      execl(TD_DAEMON, "tensord", "--socket", sock, "--log-level", "warn",
            "--capacity", cap, (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", TD_DAEMON, strerror(errno));
    _exit(127);
  }
  return pid;
}

static void note_error(int idx, const char *what, int rc, td_client *c) {
  if (sh->errors[idx]++ == 0)
    snprintf(sh->first_error[idx], sizeof(sh->first_error[idx]), "%s: %s (%s)",
             what, td_strerror(rc), c != NULL ? td_last_error(c) : "");
}

typedef struct child_arg {
  int idx;
  int ready;      /* write end: one byte when set up */
  int go;         /* read end: one byte to start; end of file to end */
  int parents[3]; /* the parent's ends of the pipes, closed in the child */
} child_arg;

/* Closes the pipe ends the parent keeps, so that end of file on go comes
 * when the parent closes its end. */
static void close_parents(const child_arg *a) {
  for (int i = 0; i < 3; i++)
    if (a->parents[i] >= 0)
      close(a->parents[i]);
}

/* The holder: creates and publishes every storage, says so, and keeps
 * them until the parent closes its pipe. */
static int holder(void *p) {
  child_arg *a = p;
  close_parents(a);
  td_client *c = bench_connect(sock);
  td_storage **s = calloc(sh->nstorages, sizeof(*s));
  if (s == NULL)
    bench_die("holder: out of memory");
  char key[64];
  for (unsigned i = 0; i < sh->nstorages; i++) {
    int rc = td_storage_create(c, 4096, &s[i]);
    if (rc < 0)
      bench_die("holder: create %u: %s", i, td_last_error(c));
    snprintf(key, sizeof(key), KEYFMT, i);
    rc = td_publish(c, key, s[i], NULL);
    if (rc < 0)
      bench_die("holder: publish %s: %s", key, td_last_error(c));
  }
  char b = 1;
  bench_write_full(a->ready, &b, 1);
  while (read(a->go, &b, 1) > 0) /* end of file: the bench is done */
    ;
  for (unsigned i = 0; i < sh->nstorages; i++) {
    snprintf(key, sizeof(key), KEYFMT, i);
    td_unpublish(c, key);
    td_storage_release(s[i]);
  }
  td_close(c);
  free(s);
  return 0;
}

static int client(void *p) {
  child_arg *a = p;
  close_parents(a);
  td_client *c = bench_connect(sock);
  uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(a->idx + 1);
  char key[64], b = 1;
  bench_write_full(a->ready, &b, 1);
  if (read(a->go, &b, 1) != 1)
    return 0;
  while (!sh->stop) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    snprintf(key, sizeof(key), KEYFMT, (unsigned)(rng % sh->nstorages));
    td_storage *s = NULL;
    uint64_t t0 = bench_now_ns();
    int rc = td_lookup(c, key, TD_RDONLY, 0, &s, NULL);
    if (rc == 0)
      rc = td_storage_release(s);
    uint64_t t1 = bench_now_ns();
    if (rc < 0)
      note_error(a->idx, key, rc, c);
    uint32_t n = sh->nops[a->idx];
    if (n < MAXOPS) {
      sh->ops[a->idx][n] = (op){t0, t1};
      sh->nops[a->idx] = n + 1;
    }
  }
  td_close(c);
  return 0;
}

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
    ;
}

static void print_log(void) {
  FILE *f = fopen(logpath, "r");
  if (f == NULL)
    return;
  char line[512];
  int header = 0;
  while (fgets(line, sizeof(line), f) != NULL) {
    if (!header++)
      fprintf(stderr, "---- tensord's log ----\n");
    fputs(line, stderr);
  }
  fclose(f);
}

static char *ms(uint64_t ns, char *buf, size_t len) {
  if (ns < 1000000)
    snprintf(buf, len, "%.0f us", (double)ns / 1e3);
  else
    snprintf(buf, len, "%.1f ms", (double)ns / 1e6);
  return buf;
}

static void row(const char *name, bench_samples *s, const char *extra) {
  char a[32], b[32], c[32];
  printf("  %-16s %9zu %10s %10s %10s  %s\n", name, s->n,
         ms(bench_pct(s, 50), a, sizeof(a)), ms(bench_pct(s, 99), b, sizeof(b)),
         ms(bench_pct(s, 100), c, sizeof(c)), extra);
}

int main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  bench_init("bench_upgrade");
  double scale = bench_scale();
  unsigned nstorages = (unsigned)(10000 * (scale < 1 ? scale : 1));
  if (nstorages < 1000)
    nstorages = 1000;
  unsigned baseline_ms = (unsigned)(1000 * scale);
  if (baseline_ms < 200)
    baseline_ms = 200;
  sh = bench_shared(sizeof(*sh));
  sh->nstorages = nstorages;

  snprintf(dir, sizeof(dir), "/tmp/tensord-upgrade.XXXXXX");
  if (mkdtemp(dir) == NULL)
    bench_die("mkdtemp: %s", strerror(errno));
  snprintf(sock, sizeof(sock), "%s/tensord.sock", dir);
  snprintf(logpath, sizeof(logpath), "%s/tensord.log", dir);
  pid_t daemon = spawn_daemon(0);
  /* The bench's own instance file: run.sh's names run.sh's daemon. */
  char inst_path[96];
  snprintf(inst_path, sizeof(inst_path), "%s/instance", dir);
  setenv("TD_BENCH_INSTANCE_FILE", inst_path, 1);
  td_close(bench_connect(sock)); /* waits until it listens */
  unsetenv("TD_BENCH_INSTANCE_FILE");

  int ready[2], go[2];
  if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(go, O_CLOEXEC) < 0)
    bench_die("pipe: %s", strerror(errno));
  child_arg ha = {.idx = -1,
                  .ready = ready[1],
                  .go = go[0],
                  .parents = {ready[0], go[1], -1}};
  pid_t hpid = bench_fork(holder, &ha);
  char b;
  if (read(ready[0], &b, 1) != 1)
    bench_die("the holder died setting up (see above)");
  int cgo[2];
  if (pipe2(cgo, O_CLOEXEC) < 0)
    bench_die("pipe: %s", strerror(errno));
  pid_t cpid[NCLIENTS];
  child_arg ca[NCLIENTS];
  for (int i = 0; i < NCLIENTS; i++) {
    ca[i] = (child_arg){.idx = i,
                        .ready = ready[1],
                        .go = cgo[0],
                        .parents = {ready[0], go[1], cgo[1]}};
    cpid[i] = bench_fork(client, &ca[i]);
  }
  for (int i = 0; i < NCLIENTS; i++)
    if (read(ready[0], &b, 1) != 1)
      bench_die("a client died setting up (see above)");
  char bytes[NCLIENTS];
  memset(bytes, 1, sizeof(bytes));
  bench_write_full(cgo[1], bytes, sizeof(bytes));

  sleep_ms(baseline_ms);
  uint64_t t_up[ROUNDS][2];
  int failed = 0;
  for (int r = 0; r < ROUNDS; r++) {
    t_up[r][0] = bench_now_ns();
    pid_t next = spawn_daemon(1);
    int st;
    if (waitpid(daemon, &st, 0) < 0)
      bench_die("waitpid: %s", strerror(errno));
    t_up[r][1] = bench_now_ns();
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr,
              "bench_upgrade: the old tensord ended with status "
              "0x%x instead of handing over\n",
              st);
      failed = 1;
    }
    if (waitpid(next, &st, WNOHANG) == next) {
      fprintf(stderr,
              "bench_upgrade: tensord --upgrade exited (status "
              "0x%x) instead of taking over\n",
              st);
      print_log();
      bench_die("upgrade %d failed", r + 1);
    }
    daemon = next;
    sleep_ms(500);
  }
  sh->stop = 1;
  close(cgo[1]);
  for (int i = 0; i < NCLIENTS; i++)
    if (bench_wait(cpid[i]) != 0)
      failed = 1;
  close(go[1]);
  if (bench_wait(hpid) != 0)
    failed = 1;

  /* The daemon must be empty now: every storage released, every key gone. */
  td_client *c = bench_connect(sock);
  td_stat stat;
  if (td_stat_get(c, &stat) < 0)
    bench_die("stat: %s", td_last_error(c));
  td_close(c);
  if (stat.storages != 0 || stat.keys != 0) {
    fprintf(stderr,
            "bench_upgrade: %llu storages and %llu keys left after "
            "every client ended\n",
            (unsigned long long)stat.storages, (unsigned long long)stat.keys);
    failed = 1;
  }
  kill(daemon, SIGTERM);
  int st;
  waitpid(daemon, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    failed = 1;
  char cmd[160];
  snprintf(cmd, sizeof(cmd),
           "ls /dev/shm 2>/dev/null | grep -q '^tensord\\.%016llx\\.'",
           (unsigned long long)stat.instance);
  if (system(cmd) == 0) {
    fprintf(stderr, "bench_upgrade: segments left in /dev/shm\n");
    snprintf(cmd, sizeof(cmd), "rm -f /dev/shm/tensord.%016llx.*",
             (unsigned long long)stat.instance);
    if (system(cmd) != 0)
      failed = 1;
    failed = 1;
  }

  bench_samples base = {0}, during = {0}, pause = {0}, handover = {0};
  uint64_t errors = 0;
  for (int i = 0; i < NCLIENTS; i++) {
    if (sh->errors[i] > 0)
      fprintf(stderr, "bench_upgrade: client %d: %llu errors, the first: %s\n",
              i, (unsigned long long)sh->errors[i], sh->first_error[i]);
    errors += sh->errors[i];
  }
  for (int r = 0; r < ROUNDS; r++) {
    uint64_t longest = 0;
    for (int i = 0; i < NCLIENTS; i++)
      for (uint32_t k = 0; k < sh->nops[i]; k++) {
        op o = sh->ops[i][k];
        if (o.end < t_up[r][0] || o.start > t_up[r][1])
          continue;
        bench_samples_add(&during, o.end - o.start);
        if (o.end - o.start > longest)
          longest = o.end - o.start;
      }
    bench_samples_add(&pause, longest);
    bench_samples_add(&handover, t_up[r][1] - t_up[r][0]);
  }
  for (int i = 0; i < NCLIENTS; i++)
    for (uint32_t k = 0; k < sh->nops[i]; k++)
      if (sh->ops[i][k].end < t_up[0][0])
        bench_samples_add(&base, sh->ops[i][k].end - sh->ops[i][k].start);

  printf("live upgrade: %u storages of 4 KiB, each published under a key; "
         "%d clients doing lookup+release; %d upgrades\n",
         nstorages, NCLIENTS, ROUNDS);
  printf("  %-16s %9s %10s %10s %10s\n", "", "ops", "p50", "p99", "max");
  row("no upgrade", &base, "");
  char extra[96], a[32];
  snprintf(extra, sizeof(extra), "p99 %.1fx no upgrade; target p99 < 50 ms",
           (double)bench_pct(&during, 99) /
               (double)(bench_pct(&base, 99) ? bench_pct(&base, 99) : 1));
  row("during upgrade", &during, extra);
  snprintf(extra, sizeof(extra), "(longest op per upgrade)");
  row("pause", &pause, extra);
  row("handover", &handover, "(exec of the new tensord to exit of the old)");
  printf("  client errors: %llu; median pause %s\n", (unsigned long long)errors,
         ms(bench_pct(&pause, 50), a, sizeof(a)));
  bench_samples_free(&base);
  bench_samples_free(&during);
  bench_samples_free(&pause);
  bench_samples_free(&handover);
  if (errors > 0 || failed)
    print_log();
  unlink(logpath);
  unlink(inst_path);
  rmdir(dir);
  return errors > 0 || failed;
}

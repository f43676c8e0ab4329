/* bench_rss.c: tensord's resident memory per live storage with 100,000 live
 * storages, how fast they are created, and that they all go on release.
 *
 * What is measured. The daemon's VmRSS (from /proc/PID/status, PID from
 * td_stat_get) once every client has connected, and again with 100,000 live
 * storages of 4 KiB (one page, the least a segment takes in /dev/shm); the
 * difference over 100,000 is the daemon's bytes per live storage. The bytes
 * of the storages themselves are tmpfs pages the daemon never maps, so they
 * are not in its RSS; /dev/shm's use is printed beside it.
 *
 * A client maps every storage it holds, and Linux caps a process's mappings
 * at vm.max_map_count (65530 by default), so one process cannot hold 100,000:
 * the storages are created by as few client processes as that allows (2 by
 * default), one after the other, each with its own connection. Creates/s is
 * their count over the time the create loops took, against a baseline in
 * the same run: the same number of creates done without tensord
 * (shm_open + posix_fallocate + mmap + close of a 4 KiB segment, 20,000 of
 * them, then unlinked). Then every client releases every handle and the
 * program waits until tensord reports 0 storages and no segment of its
 * instance is left in /dev/shm.
 *
 * Usage: bench_rss SOCKET (or $TENSORD_SOCKET). */
#include "bench.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define TOTAL 100000u
#define NBYTES 4096u
#define RAW_COUNT 20000u
#define MAX_CHILDREN 16

/* What a child answers to each command. */
typedef struct reply {
  uint64_t ns;
  uint64_t count;
} reply;

typedef struct child_arg {
  const char *sock;
  uint32_t count;   /* storages to create */
  int cmd;          /* read end: 'c' create, 'r' release all, 'q' quit */
  int res;          /* write end: a reply per command, one first when ready */
  int cmd_w, res_r; /* the parent's ends, closed in the child */
} child_arg;

static int child(void *arg) {
  const child_arg *a = arg;
  close(a->cmd_w);
  close(a->res_r);
  td_client *c = bench_connect(a->sock);
  td_storage **s = calloc(a->count, sizeof(*s));
  if (s == NULL)
    bench_die("out of memory");
  uint32_t n = 0;
  reply r = {0, 0};
  bench_write_full(a->res, &r, sizeof(r));
  char cmd;
  while (bench_read_full(a->cmd, &cmd, 1) == 1) {
    uint64_t t0 = bench_now_ns();
    if (cmd == 'c') {
      for (; n < a->count; n++) {
        if (td_storage_create(c, NBYTES, &s[n]) < 0)
          bench_die("create %u of %u: %s", n + 1, a->count, td_last_error(c));
      }
    } else if (cmd == 'r') {
      for (uint32_t i = 0; i < n; i++)
        td_storage_release(s[i]);
      n = 0;
    } else {
      break;
    }
    r.ns = bench_now_ns() - t0;
    r.count = n;
    bench_write_full(a->res, &r, sizeof(r));
  }
  td_close(c);
  free(s);
  return 0;
}

/* Creates, maps and closes count segments without tensord; returns
 * creates/s. Unlinks them all afterwards, also when it fails. */
static double raw_creates(unsigned count) {
  void **maps = calloc(count, sizeof(*maps));
  if (maps == NULL)
    bench_die("out of memory");
  char name[64];
  unsigned n = 0;
  const char *fail = NULL;
  int err = 0;
  uint64_t t0 = bench_now_ns();
  for (; n < count; n++) {
    snprintf(name, sizeof(name), "/tdbench.%d.%u", (int)getpid(), n);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      fail = "shm_open";
      err = errno;
      break;
    }
    if ((err = posix_fallocate(fd, 0, NBYTES)) != 0) {
      fail = "posix_fallocate";
      close(fd);
      shm_unlink(name);
      break;
    }
    maps[n] = mmap(NULL, NBYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (maps[n] == MAP_FAILED) {
      fail = "mmap";
      err = errno;
      shm_unlink(name);
      break;
    }
  }
  uint64_t ns = bench_now_ns() - t0;
  for (unsigned i = 0; i < n; i++) {
    snprintf(name, sizeof(name), "/tdbench.%d.%u", (int)getpid(), i);
    shm_unlink(name);
    munmap(maps[i], NBYTES);
  }
  free(maps);
  if (fail != NULL)
    bench_die("raw create %u: %s: %s", n + 1, fail, strerror(err));
  return (double)count / ((double)ns / 1e9);
}

/* Segments of the daemon's instance in /dev/shm. */
static long segments(uint64_t instance) {
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "tensord.%016llx.",
           (unsigned long long)instance);
  size_t plen = strlen(prefix);
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return -1;
  long n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, plen) == 0)
      n++;
  closedir(d);
  return n;
}

static uint64_t shm_used(void) {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) < 0)
    return 0;
  return (uint64_t)(st.f_blocks - st.f_bfree) * st.f_frsize;
}

static long max_map_count(void) {
  FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
  long v = 65530;
  if (f != NULL) {
    if (fscanf(f, "%ld", &v) != 1)
      v = 65530;
    fclose(f);
  }
  return v;
}

static int64_t rss(pid_t pid, const char *key) {
  int64_t v = bench_proc_status(pid, key);
  if (v < 0)
    bench_die("cannot read %s of tensord (pid %d) from /proc", key, (int)pid);
  return v;
}

static void stat_or_die(td_client *c, td_stat *st) {
  if (td_stat_get(c, st) < 0)
    bench_die("stat: %s", td_last_error(c));
}

static double mib(int64_t b) {
  return (double)b / (1024.0 * 1024.0);
}

int main(int argc, char **argv) {
  bench_init("bench_rss");
  const char *sock = bench_socket(argc, argv);
  td_client *c = bench_connect(sock);
  td_stat st;
  stat_or_die(c, &st);
  pid_t dpid = st.pid;
  uint64_t instance = st.instance;
  uint64_t storages0 = st.storages;
  uint64_t need = (uint64_t)TOTAL * NBYTES;
  char a[32], b[32];
  if (st.capacity - st.bytes_used < need || st.shm_free < need) {
    printf("\nbench_rss: skipped: %u storages of %u bytes need %s; tensord's "
           "capacity has %s free, /dev/shm %s\n",
           TOTAL, NBYTES, bench_size(need, a, sizeof(a)),
           bench_size(st.capacity - st.bytes_used, b, sizeof(b)),
           bench_size(st.shm_free, b, sizeof(b)));
    td_close(c);
    return 0;
  }

  double raw = raw_creates(RAW_COUNT);

  /* Clients: as few as the mapping limit allows. */
  long per = max_map_count() - 2000;
  if (per < 1000)
    per = 1000;
  int nch = (int)((TOTAL + (unsigned long)per - 1) / (unsigned long)per);
  if (nch > MAX_CHILDREN)
    bench_die("vm.max_map_count is %ld: more than %d clients would be needed",
              max_map_count(), MAX_CHILDREN);
  pid_t pids[MAX_CHILDREN];
  int cmd[MAX_CHILDREN], res[MAX_CHILDREN];
  for (int i = 0; i < nch; i++) {
    int cp[2], rp[2];
    if (pipe2(cp, O_CLOEXEC) < 0 || pipe2(rp, O_CLOEXEC) < 0)
      bench_die("pipe: %s", strerror(errno));
    child_arg ca = {sock,  TOTAL / nch + ((unsigned)i < TOTAL % nch),
                    cp[0], rp[1],
                    cp[1], rp[0]};
    pids[i] = bench_fork(child, &ca);
    close(cp[0]);
    close(rp[1]);
    cmd[i] = cp[1];
    res[i] = rp[0];
  }
  reply r;
  for (int i = 0; i < nch; i++)
    if (bench_read_full(res[i], &r, sizeof(r)) != 1)
      bench_die("client %d failed to start", i);

  long segs0 = segments(instance);
  int64_t rss0 = rss(dpid, "VmRSS"), anon0 = rss(dpid, "RssAnon");
  uint64_t used0 = shm_used();

  uint64_t create_ns = 0, created = 0;
  for (int i = 0; i < nch; i++) {
    bench_write_full(cmd[i], "c", 1);
    if (bench_read_full(res[i], &r, sizeof(r)) != 1)
      bench_die("client %d failed while creating", i);
    create_ns += r.ns;
    created += r.count;
  }
  stat_or_die(c, &st);
  int64_t rss1 = rss(dpid, "VmRSS"), anon1 = rss(dpid, "RssAnon");
  uint64_t used1 = shm_used();
  uint64_t live = st.storages - storages0;
  long segs1 = segments(instance) - segs0;

  uint64_t t0 = bench_now_ns();
  for (int i = 0; i < nch; i++)
    bench_write_full(cmd[i], "r", 1);
  for (int i = 0; i < nch; i++)
    if (bench_read_full(res[i], &r, sizeof(r)) != 1)
      bench_die("client %d failed while releasing", i);
  uint64_t deadline = bench_now_ns() + 60ull * 1000000000u;
  do {
    stat_or_die(c, &st);
    if (st.storages == storages0)
      break;
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
  } while (bench_now_ns() < deadline);
  uint64_t release_ns = bench_now_ns() - t0;
  uint64_t left = st.storages - storages0;
  long segs2 = segments(instance) - segs0;
  int64_t rss2 = rss(dpid, "VmRSS");

  for (int i = 0; i < nch; i++) {
    bench_write_full(cmd[i], "q", 1);
    close(cmd[i]);
    int s = bench_wait(pids[i]);
    close(res[i]);
    if (s != 0)
      bench_die("client %d exited with %d", i, s);
  }
  td_close(c);

  double per_storage = (double)(rss1 - rss0) / (double)live;
  double creates = (double)created / ((double)create_ns / 1e9);
  printf("\nbench_rss: %llu live storages of %u bytes, created by %d client "
         "process(es) in turn\n(vm.max_map_count %ld caps one process's "
         "mappings)\n\n",
         (unsigned long long)live, NBYTES, nch, max_map_count());
  printf("  %-38s %12.1f MiB (RssAnon %.1f MiB)\n",
         "daemon VmRSS, clients "
         "connected",
         mib(rss0), mib(anon0));
  printf("  %-38s %12.1f MiB (RssAnon %.1f MiB)\n",
         "daemon VmRSS, storages "
         "live",
         mib(rss1), mib(anon1));
  printf("  %-38s %12.0f B   (RssAnon %.0f B)\n", "daemon RSS per live storage",
         per_storage, (double)(anon1 - anon0) / (double)live);
  printf("  %-38s %12.1f MiB (%llu segments in /dev/shm)\n",
         "/dev/shm used by them", mib((int64_t)(used1 - used0)),
         (unsigned long long)segs1);
  printf("  %-38s %12.0f /s\n", "creates via tensord", creates);
  printf("  %-38s %12.0f /s\n", "creates without tensord (baseline)", raw);
  printf("  %-38s %12.2f\n", "ratio tensord/baseline", creates / raw);
  printf("  %-38s %12.1f ms (%.0f releases/s)\n", "release all -> 0 storages",
         (double)release_ns / 1e6,
         (double)created / ((double)release_ns / 1e9));
  printf("  %-38s %12llu storages, %ld segments\n", "left after release",
         (unsigned long long)left, segs2);
  printf("  %-38s %12.1f MiB\n", "daemon VmRSS after release", mib(rss2));
  printf("\n  target (reported, not enforced):\n");
  printf("    daemon RSS <= 1 KiB per live storage: %.0f B -> %s\n",
         per_storage, per_storage <= 1024 ? "met" : "MISSED");
  if (live != TOTAL || left != 0 || segs2 != 0) {
    fprintf(stderr,
            "bench_rss: %llu storages were live (%u expected), %llu "
            "and %ld segments left after release\n",
            (unsigned long long)live, TOTAL, (unsigned long long)left, segs2);
    return 1;
  }
  return 0;
}

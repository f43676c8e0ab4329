/* bench.c: the helpers every tensord benchmark uses (see bench.h). */
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "bench";
static pid_t parent_pid;

void bench_init(const char *name) {
  prog = name;
  parent_pid = getpid();
  setvbuf(stdout, NULL, _IOLBF, 0);
}

uint64_t bench_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void bench_die(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "%s: ", prog);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  if (getpid() != parent_pid)
    _exit(1);
  exit(1);
}

const char *bench_socket(int argc, char **argv) {
  if (argc > 1)
    return argv[1];
  const char *s = getenv("TENSORD_SOCKET");
  if (s == NULL || *s == '\0')
    bench_die("usage: %s SOCKET (or set TENSORD_SOCKET)", prog);
  return s;
}

static void note_instance(td_client *c) {
  const char *path = getenv("TD_BENCH_INSTANCE_FILE");
  td_stat st;
  if (path == NULL || *path == '\0' || td_stat_get(c, &st) < 0)
    return;
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return;
  fprintf(f, "%016llx\n", (unsigned long long)st.instance);
  fclose(f);
}

td_client *bench_connect(const char *sock) {
  static int noted;
  td_client *c = NULL;
  uint64_t deadline = bench_now_ns() + 10ull * 1000000000u;
  for (;;) {
    int err = td_connect(sock, &c);
    if (err == 0)
      break;
    if ((err != TD_ENOENT && err != TD_ECONNREFUSED) ||
        bench_now_ns() > deadline)
      bench_die("connect: %s", td_last_error(NULL));
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  if (!noted && getpid() == parent_pid) {
    noted = 1;
    note_instance(c);
  }
  return c;
}

double bench_scale(void) {
  const char *s = getenv("TD_BENCH_SCALE");
  double v = s ? atof(s) : 1.0;
  return v > 0 ? v : 1.0;
}

void bench_samples_add(bench_samples *s, uint64_t ns) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 1024;
    uint64_t *v = realloc(s->v, cap * sizeof(*v));
    if (v == NULL)
      bench_die("out of memory");
    s->v = v;
    s->cap = cap;
  }
  s->v[s->n++] = ns;
  s->sorted = 0;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

uint64_t bench_pct(bench_samples *s, double p) {
  if (s->n == 0)
    return 0;
  if (!s->sorted) {
    qsort(s->v, s->n, sizeof(*s->v), cmp_u64);
    s->sorted = 1;
  }
  /* Nearest rank: the smallest sample with at least p% at or below it. */
  size_t rank = (size_t)((p / 100.0) * (double)s->n + 0.999999);
  if (rank < 1)
    rank = 1;
  if (rank > s->n)
    rank = s->n;
  return s->v[rank - 1];
}

void bench_samples_free(bench_samples *s) {
  free(s->v);
  memset(s, 0, sizeof(*s));
}

pid_t bench_fork(int (*fn)(void *), void *arg) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent_pid)
      _exit(1); /* the parent is already gone */
    int rc = fn(arg);
    fflush(NULL);
    _exit(rc);
  }
  return pid;
}

int bench_wait(pid_t pid) {
  int status;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR)
      return -1;
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

int bench_open_stat(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    bench_die("open %s: %s", path, strerror(errno));
  return fd;
}

int bench_wait_asleep(int statfd, int timeout_ms) {
  uint64_t deadline = bench_now_ns() + (uint64_t)timeout_ms * 1000000u;
  char buf[512];
  for (;;) {
    ssize_t n = pread(statfd, buf, sizeof(buf) - 1, 0);
    if (n > 0) {
      buf[n] = '\0';
      const char *p = strrchr(buf, ')'); /* comm may hold spaces */
      if (p != NULL && p[1] == ' ' && p[2] == 'S')
        return 0;
    }
    if (bench_now_ns() > deadline)
      return -1;
    sched_yield();
  }
}

void *bench_shared(size_t len) {
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED)
    bench_die("mmap of %zu shared bytes: %s", len, strerror(errno));
  return p;
}

void bench_write_full(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      bench_die("write: %s", n < 0 ? strerror(errno) : "wrote nothing");
    p += n;
    len -= (size_t)n;
  }
}

int bench_read_full(int fd, void *buf, size_t len) {
  char *p = buf;
  size_t got = 0;
  while (got < len) {
    ssize_t n = read(fd, p + got, len - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      bench_die("read: %s", strerror(errno));
    if (n == 0) {
      if (got == 0)
        return 0;
      bench_die("read: end of file after %zu of %zu bytes", got, len);
    }
    got += (size_t)n;
  }
  return 1;
}

char *bench_size(uint64_t n, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && n >= 1024 && n % 1024 == 0) {
    n /= 1024;
    u++;
  }
  snprintf(buf, len, "%llu %s", (unsigned long long)n, units[u]);
  return buf;
}

/* Finds "key:" at the start of a line of path and returns its number times
 * 1024 (the files say kB), or -1. */
static int64_t kb_field(const char *path, const char *key) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return -1;
  char line[256];
  size_t klen = strlen(key);
  int64_t v = -1;
  while (fgets(line, sizeof(line), f) != NULL) {
    if (strncmp(line, key, klen) == 0 && line[klen] == ':') {
      v = strtoll(line + klen + 1, NULL, 10) * 1024;
      break;
    }
  }
  fclose(f);
  return v;
}

int64_t bench_proc_status(pid_t pid, const char *key) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  return kb_field(path, key);
}

int64_t bench_meminfo(const char *key) {
  return kb_field("/proc/meminfo", key);
}

void bench_send_fd(int s, const void *buf, size_t len, int fd) {
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  struct iovec iov = {(void *)buf, len};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    memset(ctl.buf, 0, sizeof(ctl.buf));
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof(ctl.buf);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do
    n = sendmsg(s, &msg, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  if (n != (ssize_t)len)
    bench_die("sendmsg: %s", n < 0 ? strerror(errno) : "short");
}

int bench_recv_fd(int s, void *buf, size_t len, int *fd) {
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  struct iovec iov = {buf, len};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.buf;
  msg.msg_controllen = sizeof(ctl.buf);
  *fd = -1;
  ssize_t n;
  do
    n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n < 0)
    bench_die("recvmsg: %s", strerror(errno));
  if (n == 0)
    return 0;
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  if (c != NULL && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
    memcpy(fd, CMSG_DATA(c), sizeof(int));
  if ((size_t)n < len &&
      bench_read_full(s, (char *)buf + n, len - (size_t)n) != 1)
    bench_die("recvmsg: a short message");
  return 1;
}

void bench_pin(int cpu) {
  if (cpu < 0)
    return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

int bench_pin_producer(int *producer) {
  cpu_set_t set;
  *producer = -1;
  if (sched_getaffinity(0, sizeof(set), &set) < 0 || CPU_COUNT(&set) < 2)
    return -1;
  int a = -1, b = -1;
  for (int i = 0; i < CPU_SETSIZE && b < 0; i++) {
    if (!CPU_ISSET(i, &set))
      continue;
    if (a < 0)
      a = i;
    else
      b = i;
  }
  CPU_ZERO(&set);
  CPU_SET(a, &set);
  if (sched_setaffinity(0, sizeof(set), &set) < 0)
    return -1;
  *producer = a;
  return b;
}

/* harness.c: starts and stops a real tensord for integration tests. */
#include "harness.h"

#include "tensord.pb-c.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

int tdt_open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL)
    return -1;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* The daemons this test started and has not stopped or killed. Each test
 * runs in a process of its own, so this starts empty for every test. */
static tdt_daemon *live[16];
static int nlive;

static void track(tdt_daemon *d) {
  for (int i = 0; i < nlive; i++)
    if (live[i] == d)
      return;
  cr_assert_lt(nlive, 16, "a test may run at most 16 daemons at once");
  live[nlive++] = d;
}

static void untrack(tdt_daemon *d) {
  for (int i = 0; i < nlive; i++)
    if (live[i] == d) {
      memmove(&live[i], &live[i + 1], (size_t)(nlive - i - 1) * sizeof(*live));
      nlive--;
      return;
    }
}

/* TDT_TEST stops d after the test body has returned: d must not live in
 * the body's stack frame. The stack grows down from above this frame, so an
 * address a little above it is the stack. */
static void assert_not_on_stack(const tdt_daemon *d) {
  uintptr_t here = (uintptr_t)__builtin_frame_address(0);
  uintptr_t p = (uintptr_t)d;
  cr_assert(!(p > here && p - here < (64u << 20)),
            "tdt_start: the tdt_daemon is a local variable; make it static "
            "(TDT_TEST stops it after the body returns)");
}

void tdt_mkdtemp(char *dir) {
  snprintf(dir, 64, "/tmp/tensord-test.%s.XXXXXX", TDT_TAG);
  cr_assert_not_null(mkdtemp(dir), "mkdtemp(%s): %s", dir, strerror(errno));
}

void tdt_note_instance(uint64_t instance) {
  char path[64], line[20];
  snprintf(path, sizeof(path), "/tmp/tensord-test.%s.instances", TDT_TAG);
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0)
    return;
  int n =
      snprintf(line, sizeof(line), "%016llx\n", (unsigned long long)instance);
  if (write(fd, line, (size_t)n) != n)
    fprintf(stderr, "harness: %s: %s\n", path, strerror(errno));
  close(fd);
}

static void make_dir(tdt_daemon *d) {
  assert_not_on_stack(d);
  memset(d, 0, sizeof(*d));
  d->fds_before = tdt_open_fds();
  tdt_mkdtemp(d->dir);
  snprintf(d->sock, sizeof(d->sock), "%.60s/tensord.sock", d->dir);
  snprintf(d->log, sizeof(d->log), "%s/tensord.log", d->dir);
}

/* Opens the datagram socket tensord reports READY=1 on. */
static int notify_socket(const tdt_daemon *d, char *path, size_t len) {
  snprintf(path, len, "%.60s/notify.sock", d->dir);
  unlink(path); /* a previous tensord's, on a restart */
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", path);
  cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
            "notify socket: %s", strerror(errno));
  return fd;
}

static void dump_log(const tdt_daemon *d) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return;
  char line[1024];
  fprintf(stderr, "---- %s ----\n", d->log);
  while (fgets(line, sizeof(line), f))
    fputs(line, stderr);
  fclose(f);
}

/* Waits for READY=1 on nfd, then learns the instance. */
static void wait_ready(tdt_daemon *d, int nfd) {
  struct pollfd p = {nfd, POLLIN, 0};
  /* Under valgrind tensord starts tens of times slower. */
  int secs = getenv("TDT_DAEMON_WRAPPER") ? 120 : 10;
  int r = 0, status = 0;
  for (int waited = 0; r == 0 && waited < secs * 1000; waited += 100) {
    r = poll(&p, 1, 100);
    if (r == 0 && waitpid(d->pid, &status, WNOHANG) == d->pid) {
      d->pid = 0;
      dump_log(d);
      cr_assert_fail("tensord exited (status 0x%x) before READY=1", status);
    }
  }
  if (r != 1)
    dump_log(d);
  cr_assert_eq(r, 1, "tensord did not report READY=1 within %d s", secs);
  char buf[256] = "";
  ssize_t n = recv(nfd, buf, sizeof(buf) - 1, 0);
  cr_assert(n > 0 && strstr(buf, "READY=1") != NULL, "notify said '%s'", buf);
  close(nfd);
  td_client *c = tdt_connect(d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  d->instance = st.instance;
  tdt_note_instance(st.instance);
  td_close(c);
}

static void exec_daemon(const tdt_daemon *d, const char *notify,
                        const char *const *args, int inherited) {
  /* A test that crashes or times out takes its daemon with it: SIGTERM
   * makes it clean up its segments. */
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  int log = open(d->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0 || dup2(log, STDERR_FILENO) < 0)
    _exit(126);
  if (notify != NULL)
    setenv("NOTIFY_SOCKET", notify, 1);
  else
    unsetenv("NOTIFY_SOCKET");
  /* TDT_DAEMON_WRAPPER runs tensord under a tool, e.g. "valgrind
   * --leak-check=full --error-exitcode=1": its words come first. */
  const char *argv[64];
  int n = 0;
  char wrapper[512] = "";
  const char *w = getenv("TDT_DAEMON_WRAPPER");
  if (w != NULL)
    snprintf(wrapper, sizeof(wrapper), "%s", w);
  for (char *save, *t = strtok_r(wrapper, " ", &save); t && n < 24;
       t = strtok_r(NULL, " ", &save))
    argv[n++] = t;
  argv[n++] = TENSORD_BIN;
  if (!inherited) {
    argv[n++] = "--socket";
    argv[n++] = d->sock;
  }
  argv[n++] = "--log-level";
  argv[n++] = "debug";
  for (int i = 0; args && args[i] && n < 63; i++)
    argv[n++] = args[i];
  argv[n] = NULL;
  execvp(argv[0], (char *const *)argv);
  _exit(127);
}

void tdt_start(tdt_daemon *d, const char *const *args) {
  make_dir(d);
  char notify[100];
  int nfd = notify_socket(d, notify, sizeof(notify));
  d->pid = fork();
  cr_assert(d->pid >= 0);
  if (d->pid == 0)
    exec_daemon(d, notify, args, 0);
  track(d);
  wait_ready(d, nfd);
}

void tdt_restart(tdt_daemon *d, const char *const *args) {
  cr_assert_eq(d->pid, 0, "tdt_restart: tensord %d still runs", (int)d->pid);
  char notify[100];
  int nfd = notify_socket(d, notify, sizeof(notify));
  d->pid = fork();
  cr_assert(d->pid >= 0);
  if (d->pid == 0)
    exec_daemon(d, notify, args, 0);
  track(d);
  wait_ready(d, nfd);
}

pid_t tdt_spawn(const tdt_daemon *d, const char *const *args) {
  fflush(NULL);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    exec_daemon(d, NULL, args, 0);
  return pid;
}

void tdt_start_inherited(tdt_daemon *d) {
  make_dir(d);
  char notify[100];
  int nfd = notify_socket(d, notify, sizeof(notify));
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", d->sock);
  cr_assert(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
            listen(lfd, 16) == 0);
  d->pid = fork();
  cr_assert(d->pid >= 0);
  if (d->pid == 0) {
    if (dup2(lfd, 3) < 0) /* dup2 clears FD_CLOEXEC on fd 3 */
      _exit(126);
    char pid[32];
    snprintf(pid, sizeof(pid), "%d", (int)getpid());
    setenv("LISTEN_PID", pid, 1);
    setenv("LISTEN_FDS", "1", 1);
    exec_daemon(d, notify, NULL, 1);
  }
  close(lfd);
  d->inherited = 1;
  track(d);
  wait_ready(d, nfd);
}

static int count_prefix(const char *prefix) {
  DIR *dir = opendir("/dev/shm");
  cr_assert_not_null(dir);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL)
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0)
      n++;
  closedir(dir);
  return n;
}

int tdt_segments_of(uint64_t instance) {
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "tensord.%016llx.",
           (unsigned long long)instance);
  return count_prefix(prefix);
}

int tdt_segment_path(uint64_t instance, uint64_t id, char *path, size_t len) {
  /* "tensord.<instance>.<id>", and after it nothing, or a '-' and the
   * random tail that keeps the name unpredictable. */
  char name[64];
  int n = snprintf(name, sizeof(name), "tensord.%016llx.%llu",
                   (unsigned long long)instance, (unsigned long long)id);
  DIR *dir = opendir("/dev/shm");
  cr_assert_not_null(dir);
  int found = 0;
  struct dirent *e;
  while (!found && (e = readdir(dir)) != NULL) {
    if (strncmp(e->d_name, name, (size_t)n) == 0 &&
        (e->d_name[n] == '\0' || e->d_name[n] == '-')) {
      snprintf(path, len, "/dev/shm/%s", e->d_name);
      found = 1;
    }
  }
  closedir(dir);
  return found;
}

int tdt_pooled_of(uint64_t instance) {
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "tensord.%016llx-pool.",
           (unsigned long long)instance);
  return count_prefix(prefix);
}

int tdt_segments(const tdt_daemon *d) {
  return tdt_segments_of(d->instance);
}

int tdt_no_segments(const tdt_daemon *d) {
  return tdt_segments(d) == 0;
}

uint64_t tdt_storages(const tdt_daemon *d) {
  td_client *c = tdt_connect(d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  td_close(c);
  return st.storages;
}

int tdt_until(int (*pred)(const tdt_daemon *), const tdt_daemon *d,
              int timeout_ms) {
  struct timespec ts = {0, 2 * 1000 * 1000}, now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  int64_t end = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000 + timeout_ms;
  while (!pred(d)) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000 >= end)
      return pred(d);
    nanosleep(&ts, NULL);
  }
  return 1;
}

void tdt_rmdir(const char *dir) {
  if (dir[0] == '\0')
    return;
  DIR *dd = opendir(dir);
  struct dirent *e;
  char path[330];
  while (dd != NULL && (e = readdir(dd)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
    if (unlink(path) < 0 && errno == EISDIR)
      tdt_rmdir(path); /* a test's subdirectory, and what it holds */
  }
  if (dd != NULL)
    closedir(dd);
  rmdir(dir);
}

void tdt_stop(tdt_daemon *d) {
  cr_assert_gt(d->pid, 0, "tdt_stop: tensord is not running");
  cr_assert_eq(kill(d->pid, SIGTERM), 0, "kill(%d): %s", (int)d->pid,
               strerror(errno));
  tdt_stopped(d);
}

void tdt_stopped(tdt_daemon *d) {
  cr_assert_gt(d->pid, 0, "tdt_stopped: tensord was not running");
  int status = tdt_wait(d->pid);
  d->pid = 0;
  if (status != 0)
    dump_log(d);
  int left = tdt_segments(d);
  int pooled = tdt_pooled_of(d->instance);
  struct stat st;
  /* A socket systemd passes stays: only a socket tensord bound is its own
   * to remove. */
  int sock_left = !d->inherited && stat(d->sock, &st) == 0;
  int fds = tdt_open_fds();
  /* All is measured: remove what is left, then judge. */
  tdt_kill(d);
  cr_assert_eq(status, 0, "tensord exited with %d", status);
  cr_assert_eq(left, 0, "%d segment(s) of this tensord left in /dev/shm", left);
  cr_assert_eq(pooled, 0,
               "%d pooled segment(s) of this tensord left in "
               "/dev/shm",
               pooled);
  cr_assert_not(sock_left, "tensord left its socket %s", d->sock);
  cr_assert_eq(fds, d->fds_before, "the test leaked %d fd(s)",
               fds - d->fds_before);
}

void tdt_kill(tdt_daemon *d) {
  if (d->pid > 0) {
    kill(d->pid, SIGKILL);
    tdt_wait(d->pid);
    d->pid = 0;
  }
  tdt_unlink_segments(d->instance);
  tdt_rmdir(d->dir);
  untrack(d);
}

void tdt_stop_all(void) {
  while (nlive > 0) {
    tdt_daemon *d = live[nlive - 1];
    if (d->pid <= 0) {
      /* Stopped by the test itself, without tdt_stopped or tdt_kill: what
       * it left was never looked at. */
      tdt_kill(d);
      cr_assert_fail("the test stopped tensord (%s) without tdt_stopped or "
                     "tdt_kill",
                     d->sock);
    }
    tdt_stop(d);
  }
}

void tdt_cleanup(void) {
  while (nlive > 0)
    tdt_kill(live[nlive - 1]);
}

void tdt_unlink_segments(uint64_t instance) {
  char prefix[64], pool[64], path[320];
  snprintf(prefix, sizeof(prefix), "tensord.%016llx.",
           (unsigned long long)instance);
  snprintf(pool, sizeof(pool), "tensord.%016llx-pool.",
           (unsigned long long)instance);
  DIR *dir = opendir("/dev/shm");
  struct dirent *e;
  while (dir && (e = readdir(dir)) != NULL) {
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0 ||
        strncmp(e->d_name, pool, strlen(pool)) == 0) {
      snprintf(path, sizeof(path), "/dev/shm/%s", e->d_name);
      unlink(path);
    }
  }
  if (dir)
    closedir(dir);
}

td_client *tdt_connect(const tdt_daemon *d) {
  td_client *c = NULL;
  int err = td_connect(d->sock, &c);
  cr_assert_eq(err, 0, "td_connect(%s): %s", d->sock, td_last_error(NULL));
  return c;
}

int tdt_log_has(const tdt_daemon *d, const char *needle) {
  FILE *f = fopen(d->log, "r");
  if (f == NULL)
    return 0;
  char line[2048];
  int found = 0;
  while (!found && fgets(line, sizeof(line), f))
    found = strstr(line, needle) != NULL;
  fclose(f);
  return found;
}

/* Forks a child that dies with the test. A test that fails ends its
 * process at once: a child parked in pause() would outlive it, hold
 * ctest's output pipe open until ctest's timeout and keep its client
 * connected. So the child dies with the test (and if the test died before
 * the prctl, at once). Returns the pid, 0 in the child. */
static pid_t fork_tied(void) {
  fflush(NULL);
  pid_t parent = getpid();
  pid_t pid = fork();
  cr_assert(pid >= 0, "fork: %s", strerror(errno));
  if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent))
    _exit(125);
  return pid;
}

pid_t tdt_fork(int (*fn)(void *), void *arg) {
  pid_t pid = fork_tied();
  if (pid == 0)
    _exit(fn(arg));
  return pid;
}

/* The children tdt_fork_held forked and tdt_go has not let go: the write
 * end of the pipe each waits on, and what it sends. */
#define MAX_HELD 16
static struct {
  pid_t pid;
  int fd;
  void *arg;
  size_t size;
} held[MAX_HELD];

/* Reads exactly n bytes from fd into buf. Returns 0, or -1 at EOF or on an
 * error other than EINTR. */
static int read_all(int fd, void *buf, size_t n) {
  for (size_t got = 0; got < n;) {
    ssize_t k = read(fd, (char *)buf + got, n - got);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return -1;
    got += (size_t)k;
  }
  return 0;
}

pid_t tdt_fork_held(int (*fn)(void *), void *arg, size_t size) {
  int slot = 0;
  while (slot < MAX_HELD && held[slot].pid != 0)
    slot++;
  cr_assert_lt(slot, MAX_HELD, "more than %d children held", MAX_HELD);
  int pfd[2];
  /* Close-on-exec: a tensord started later must not hold it. */
  cr_assert_eq(pipe2(pfd, O_CLOEXEC), 0, "pipe2: %s", strerror(errno));
  pid_t pid = fork_tied();
  if (pid == 0) {
    close(pfd[1]);
    char go;
    /* EOF: the parent closed it without tdt_go (it failed): give up. */
    if (read_all(pfd[0], &go, 1) < 0 ||
        (size > 0 && read_all(pfd[0], arg, size) < 0))
      _exit(124);
    close(pfd[0]);
    _exit(fn(arg));
  }
  close(pfd[0]);
  held[slot].pid = pid;
  held[slot].fd = pfd[1];
  held[slot].arg = arg;
  held[slot].size = size;
  return pid;
}

pid_t tdt_go(pid_t pid) {
  int slot = 0;
  while (slot < MAX_HELD && held[slot].pid != pid)
    slot++;
  cr_assert_lt(slot, MAX_HELD, "pid %d is not held", (int)pid);
  int fd = held[slot].fd;
  /* One byte, then the argument: a pipe takes 64 KiB without a reader. */
  char go = 'g';
  cr_assert_eq(write(fd, &go, 1), 1, "tdt_go: %s", strerror(errno));
  const char *p = held[slot].arg;
  for (size_t put = 0; put < held[slot].size;) {
    ssize_t k = write(fd, p + put, held[slot].size - put);
    if (k < 0 && errno == EINTR)
      continue;
    cr_assert_gt(k, 0, "tdt_go: %s", strerror(errno));
    put += (size_t)k;
  }
  close(fd);
  held[slot].pid = 0;
  held[slot].fd = -1;
  return pid;
}

void tdt_preload(const char *lib) {
  static char *asan_was; /* ASAN_OPTIONS before, or NULL */
  static int preloading;
  if (lib == NULL) {
    if (!preloading)
      return;
    unsetenv("LD_PRELOAD");
    if (asan_was != NULL)
      setenv("ASAN_OPTIONS", asan_was, 1);
    else
      unsetenv("ASAN_OPTIONS");
    free(asan_was);
    asan_was = NULL;
    preloading = 0;
    return;
  }
  if (!preloading) {
    const char *was = getenv("ASAN_OPTIONS");
    asan_was = was != NULL ? strdup(was) : NULL;
    char asan[1024];
    snprintf(asan, sizeof(asan), "%s%sverify_asan_link_order=0", was ? was : "",
             was && *was ? ":" : "");
    setenv("ASAN_OPTIONS", asan, 1);
    preloading = 1;
  }
  setenv("LD_PRELOAD", lib, 1);
}

void tdt_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

int tdt_wait(pid_t pid) {
  int status;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR)
      return -1;
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

int tdt_raw_connect(const tdt_daemon *d, int hello) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", d->sock);
  cr_assert(fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
  if (hello) {
    Tensord__Hello h = TENSORD__HELLO__INIT;
    Tensord__Request r = TENSORD__REQUEST__INIT;
    h.version = TD_PROTOCOL_VERSION;
    r.seq = 1;
    r.body_case = TENSORD__REQUEST__BODY_HELLO;
    r.hello = &h;
    td__wire w;
    td__wire_init(&w, fd);
    uint8_t *p = td__wire_reserve(&w, tensord__request__get_packed_size(&r));
    tensord__request__pack(&r, p);
    td__wire_commit(&w, tensord__request__get_packed_size(&r), NULL, 0);
    cr_assert_eq(td__wire_flush(&w, 0), 0);
    td__frame f;
    int got;
    while ((got = td__wire_frame(&w, &f)) == 0)
      cr_assert(td__wire_recv(&w, 0) > 0, "no Hello reply");
    cr_assert_eq(got, 1);
    td__wire_consume(&w, &f);
    td__wire_free(&w);
  }
  return fd;
}

int tdt_create_cuda(td_client *c, int64_t index, size_t nbytes,
                    td_storage **s) {
  td_create_opts o = {0};
  o.nbytes = nbytes;
  o.device = TD_CUDA;
  o.device_index = index;
  return td_storage_create_ex(c, &o, s);
}

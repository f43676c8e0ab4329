/* syncshim.c: an LD_PRELOAD library for crash tests that makes tensord's
 * disk syncs slow, failing or forgetful on demand, with no hook in tensord.
 *
 * It intercepts fsync and fdatasync called by a thread other than the main
 * one (tensord's journal appends and compactions run on the libuv thread
 * pool; its loop thread is never held up) on a file whose path matches the
 * fnmatch(3) pattern $TDT_SYNC_MATCH (every file if unset; '*' matches
 * '/' too, so a star then "/journal.*" means any journal). The test drives
 * it with files:
 *   TDT_SYNC_GATE=PATH  while PATH exists, such a call waits before it
 *                       syncs; the first time one waits it creates
 *                       PATH.reached, so the test knows a sync is stuck.
 *   TDT_SYNC_FAIL=PATH  while PATH exists, such a call fails with EIO and
 *                       syncs nothing.
 *   TDT_SYNC_LOG=PATH   after each such call that succeeds, appends a line
 *                       "SIZE PATH": the file's length known to be on disk.
 *                       A test that truncates the file to its last logged
 *                       length after a SIGKILL sees what a power cut would
 *                       have left: nothing written after the last sync. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int fsync(int fd);
int fdatasync(int fd);

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void) {
  real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
}

static int exists(const char *path) {
  return path != NULL && path[0] != '\0' && access(path, F_OK) == 0;
}

/* Whether the call on fd is one the test steers; path gets fd's path. */
static int steered(int fd, char *path, size_t len) {
  if (syscall(SYS_gettid) == getpid())
    return 0;
  char link[64];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, len - 1);
  if (n < 0)
    return 0;
  path[n] = '\0';
  const char *match = getenv("TDT_SYNC_MATCH");
  return match == NULL || fnmatch(match, path, 0) == 0;
}

static void wait_at_gate(void) {
  const char *gate = getenv("TDT_SYNC_GATE");
  if (!exists(gate))
    return;
  char reached[PATH_MAX];
  snprintf(reached, sizeof(reached), "%s.reached", gate);
  int fd = open(reached, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd >= 0)
    close(fd);
  struct timespec ts = {0, 1000 * 1000};
  while (exists(gate))
    nanosleep(&ts, NULL);
}

static void log_synced(int fd, const char *path) {
  const char *log = getenv("TDT_SYNC_LOG");
  struct stat st;
  if (log == NULL || fstat(fd, &st) < 0)
    return;
  char line[PATH_MAX + 32];
  int n =
      snprintf(line, sizeof(line), "%lld %s\n", (long long)st.st_size, path);
  int lfd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (lfd < 0)
    return;
  if (write(lfd, line, (size_t)n) != n) /* one write: lines never mix */
    perror("syncshim: log");
  close(lfd);
}

static int intercept(int fd, int data_only) {
  pthread_once(&once, init);
  int (*real)(int) = data_only ? real_fdatasync : real_fsync;
  char path[PATH_MAX];
  if (!steered(fd, path, sizeof(path)))
    return real(fd);
  wait_at_gate();
  if (exists(getenv("TDT_SYNC_FAIL"))) {
    errno = EIO;
    return -1;
  }
  int r = real(fd);
  if (r == 0)
    log_synced(fd, path);
  return r;
}

int fsync(int fd) {
  return intercept(fd, 0);
}

int fdatasync(int fd) {
  return intercept(fd, 1);
}

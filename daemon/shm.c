/* shm.c: the CPU storage backend, POSIX shared memory objects in /dev/shm. */
#include "daemon.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

int td__shm_create(const char *name, uint64_t nbytes, char *msg, size_t len) {
  char hb[32];
  if (nbytes > (uint64_t)INT64_MAX)
    return td__msg(msg, len, TD_EINVAL, "size of %llu bytes is too large",
                   (unsigned long long)nbytes);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return td__msg(msg, len, -errno, "shm_open(%s): %s", name, strerror(errno));
  /* Reserve every page now, so that running out of /dev/shm is an error
   * here and never a SIGBUS in a client at first touch. */
  int err = posix_fallocate(fd, 0, (off_t)nbytes);
  if (err != 0) {
    close(fd);
    shm_unlink(name);
    uint64_t avail = 0, total = 0;
    td__shm_space(&avail, &total);
    char fb[32], tb[32];
    if (err == ENOSPC)
      return td__msg(msg, len, TD_ENOSPC,
                     "/dev/shm cannot hold %s (%llu bytes): %s free of %s",
                     td__human_bytes(nbytes, hb, sizeof(hb)),
                     (unsigned long long)nbytes,
                     td__human_bytes(avail, fb, sizeof(fb)),
                     td__human_bytes(total, tb, sizeof(tb)));
    return td__msg(msg, len, -err, "reserving %llu bytes in /dev/shm: %s",
                   (unsigned long long)nbytes, strerror(err));
  }
  return fd;
}

int td__shm_open(const char *name, int readonly) {
  int fd = shm_open(name, (readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC, 0);
  return fd < 0 ? -errno : fd;
}

void td__shm_unlink(const char *name) {
#ifdef TD_TEST_LEAK
  /* make leakcheck only (-DTD_TEST_LEAK=ON): a daemon that leaves every
   * freed segment in /dev/shm, which the integration tests must catch. */
  (void)name;
  return;
#endif
  if (shm_unlink(name) < 0 && errno != ENOENT)
    td__warn("shm_unlink(%s): %s", name, strerror(errno));
}

int td__shm_space(uint64_t *free_bytes, uint64_t *total_bytes) {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) < 0)
    return -errno;
  *free_bytes = (uint64_t)st.f_bavail * st.f_frsize;
  *total_bytes = (uint64_t)st.f_blocks * st.f_frsize;
  return 0;
}

int td__shm_unlink_prefix(const char *prefix) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return -errno;
  size_t plen = strlen(prefix);
  int n = 0;
  struct dirent *e;
  char name[300];
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, plen) != 0)
      continue;
    snprintf(name, sizeof(name), "/%s", e->d_name);
    td__shm_unlink(name);
    n++;
  }
  closedir(d);
  return n;
}

int td__shm_prefix(const char *name, char out[TD__PREFIX_MAX]) {
  const char *dot = strrchr(name, '.');
  size_t n = dot ? (size_t)(dot - name) + 1 : 0;
  if (n == 0 || n >= TD__PREFIX_MAX || strncmp(name, "/tensord.", 9) != 0)
    return TD_EINVAL;
  memcpy(out, name, n);
  out[n] = '\0';
  return 0;
}

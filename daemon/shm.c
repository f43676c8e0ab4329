/* shm.c: the CPU storage backend, POSIX shared memory objects in /dev/shm. */
#include "backend.h"
#include "common.h"
#include "log.h"

#include <dirent.h>
#include <stdio.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

static int shm_space(uint64_t *free_bytes, uint64_t *total_bytes);

static int shm_create(const char *name, uint64_t nbytes, char *msg,
                      size_t len) {
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
    shm_space(&avail, &total);
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

static int shm_open_export(const char *name, int readonly) {
  int fd = shm_open(name, (readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC, 0);
  return fd < 0 ? -errno : fd;
}

static void shm_unlink_name(const char *name) {
#ifdef TD_TEST_LEAK
  /* make leakcheck only (-DTD_TEST_LEAK=ON): a daemon that leaves every
   * freed segment in /dev/shm, which the integration tests must catch. */
  (void)name;
  return;
#endif
  if (shm_unlink(name) < 0 && errno != ENOENT)
    td__warn("shm_unlink(%s): %s", name, strerror(errno));
}

static int shm_space(uint64_t *free_bytes, uint64_t *total_bytes) {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) < 0)
    return -errno;
  *free_bytes = (uint64_t)st.f_bavail * st.f_frsize;
  *total_bytes = (uint64_t)st.f_blocks * st.f_frsize;
  return 0;
}

static int shm_unlink_prefix(const char *prefix, td__keep_fn keep, void *arg) {
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
    if (keep != NULL && keep(name, arg))
      continue;
    shm_unlink_name(name);
    n++;
  }
  closedir(d);
  return n;
}

static int shm_describe(const char *name, td__segment_desc *out) {
  int fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  struct stat sb;
  int err = fstat(fd, &sb) < 0 ? -errno : 0;
  close(fd);
  if (err < 0)
    return err;
  out->nbytes = (uint64_t)sb.st_size;
  snprintf(out->where, sizeof(out->where), "/dev/shm%s", name);
  return 0;
}

const td__backend td__shm_backend = {
    .name = "shm",
    .device = TD_CPU,
    .create = shm_create,
    .open = shm_open_export,
    .unlink = shm_unlink_name,
    .unlink_prefix = shm_unlink_prefix,
    .space = shm_space,
    .describe = shm_describe,
};

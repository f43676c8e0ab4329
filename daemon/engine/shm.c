/* shm.c: the CPU storage backend, POSIX shared memory objects in /dev/shm. */
#include "backend.h"
#include "common.h"
#include "log.h"

#include <dirent.h>
#include <stdio.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

static int shm_space(uint64_t *free_bytes, uint64_t *total_bytes);

/* Writes the message of a create that /dev/shm cannot hold to msg, naming
 * the request, what is free and the size of /dev/shm (a container's 64 MiB
 * says at once what went wrong). Returns TD_ENOSPC. */
static int no_space(uint64_t nbytes, char *msg, size_t len) {
  uint64_t avail = 0, total = 0;
  shm_space(&avail, &total);
  char hb[32], fb[32], tb[32];
  return td__msg(msg, len, TD_ENOSPC,
                 "/dev/shm cannot hold %s (%llu bytes): %s free of %s",
                 td__human_bytes(nbytes, hb, sizeof(hb)),
                 (unsigned long long)nbytes,
                 td__human_bytes(avail, fb, sizeof(fb)),
                 td__human_bytes(total, tb, sizeof(tb)));
}

static int shm_create(const char *name, uint64_t nbytes, char *msg,
                      size_t len) {
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
    if (err == ENOSPC)
      return no_space(nbytes, msg, len);
    return td__msg(msg, len, -err, "reserving %llu bytes in /dev/shm: %s",
                   (unsigned long long)nbytes, strerror(err));
  }
  return fd;
}

/* shm_open's names are files in /dev/shm: renaming one there renames the
 * object. */
static int shm_path(const char *name, char *buf, size_t len) {
  int n = snprintf(buf, len, "/dev/shm%s", name);
  return n < 0 || (size_t)n >= len ? TD_ENAMETOOLONG : 0;
}

/* Opens segment name (flags O_RDONLY or O_RDWR) and checks, on the file it
 * opened rather than by name (no race), that tensord made it: /dev/shm is
 * open to every local user, who may create a file under a name tensord
 * uses while tensord's is gone (a reboot, logind's RemoveIPC, a clean-up
 * by hand), so a name alone proves nothing. Ours is a regular file of
 * tensord's euid with no permission bit beyond 0600 (shm_create makes
 * segments 0600 and nothing changes that: a storage's mode is tensord's to
 * enforce, never the file's) and, if one_link, no other name. A symbolic
 * link is not followed, and a FIFO does not hold the open up (O_NONBLOCK,
 * which means nothing to a regular file). Returns the fd, which the caller
 * owns, with *sb filled; or a negative code with msg saying why: TD_EPERM
 * for a file that is not tensord's, else the open's or fstat's error. */
static int open_ours(const char *name, int flags, int one_link, struct stat *sb,
                     char *msg, size_t len) {
  char path[TD__SEGMENT_NAME_MAX + 16];
  if (shm_path(name, path, sizeof(path)) < 0)
    return td__msg(msg, len, TD_ENAMETOOLONG, "segment name %s is too long",
                   name);
  /* glibc passes the flags on to open(2) (and adds the last two itself). */
  int fd = shm_open(name, flags | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0)
    return td__msg(msg, len, -errno, "segment %s: %s", path, strerror(errno));
  int err;
  uid_t me = geteuid();
  if (fstat(fd, sb) < 0)
    err = td__msg(msg, len, -errno, "segment %s: fstat: %s", path,
                  strerror(errno));
  else if (!S_ISREG(sb->st_mode))
    err = td__msg(msg, len, TD_EPERM,
                  "segment %s is %s, not a regular file: not tensord's", path,
                  S_ISFIFO(sb->st_mode)   ? "a FIFO"
                  : S_ISDIR(sb->st_mode)  ? "a directory"
                  : S_ISSOCK(sb->st_mode) ? "a socket"
                                          : "a device");
  else if (sb->st_uid != me)
    err = td__msg(msg, len, TD_EPERM,
                  "segment %s is owned by uid %u, not tensord's uid %u: not "
                  "tensord's",
                  path, (unsigned)sb->st_uid, (unsigned)me);
  else if (sb->st_mode & 07777 & ~0600u)
    err = td__msg(msg, len, TD_EPERM,
                  "segment %s has mode %04o, where tensord makes every "
                  "segment 0600: not tensord's",
                  path, (unsigned)(sb->st_mode & 07777));
  else if (one_link && sb->st_nlink != 1)
    err = td__msg(msg, len, TD_EPERM,
                  "segment %s has %llu links, where tensord's have one: "
                  "another name reaches it",
                  path, (unsigned long long)sb->st_nlink);
  else
    return fd;
  close(fd);
  return err;
}

static int shm_open_export(const char *name, int readonly) {
  /* The name stays tensord's while it serves the storage (in sticky
   * /dev/shm only its uid or root can remove it); but if it went anyway,
   * a file planted in its place is never handed to a client. Another name
   * of the file (a hard link someone made where protected_hardlinks is
   * off) does not change its bytes, and does not deny the storage. */
  struct stat sb;
  char msg[160];
  int fd =
      open_ours(name, readonly ? O_RDONLY : O_RDWR, 0, &sb, msg, sizeof(msg));
  if (fd == TD_EPERM)
    td__error("%s; refusing to hand it out", msg);
  return fd;
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

static int shm_rename(const char *from, const char *to) {
  char a[TD__SEGMENT_NAME_MAX + 16], b[TD__SEGMENT_NAME_MAX + 16];
  if (shm_path(from, a, sizeof(a)) < 0 || shm_path(to, b, sizeof(b)) < 0)
    return TD_ENAMETOOLONG;
  /* Never over a file that is there: whoever made it (any local user may)
   * would lose it to us, and as root we would replace it silently. */
  return renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_NOREPLACE) < 0 ? -errno : 0;
}

static int shm_reuse(const char *from, const char *to, uint64_t nbytes,
                     int zero, char *msg, size_t len) {
  int err = shm_rename(from, to);
  if (err < 0) {
    /* Someone else's file under to: the caller may try another name. */
    if (!td__name_taken(err))
      shm_unlink_name(from);
    return td__msg(msg, len, err, "renaming pooled %s to %s: %s", from, to,
                   td_strerror(err));
  }
  int fd = shm_open(to, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    err = td__msg(msg, len, -errno, "shm_open(%s): %s", to, strerror(errno));
    goto unlink;
  }
  /* A client that held it read-write may have truncated the object, so
   * its size is read, not assumed. */
  struct stat sb;
  if (fstat(fd, &sb) < 0) {
    err = td__msg(msg, len, -errno, "fstat(%s): %s", to, strerror(errno));
    goto close;
  }
  if ((uint64_t)sb.st_size != nbytes && ftruncate(fd, (off_t)nbytes) < 0) {
    err = td__msg(msg, len, -errno, "truncating %s to %llu bytes: %s", to,
                  (unsigned long long)nbytes, strerror(errno));
    goto close;
  }
  int ferr =
      (uint64_t)sb.st_size < nbytes ? posix_fallocate(fd, 0, (off_t)nbytes) : 0;
  if (ferr == ENOSPC) {
    err = no_space(nbytes, msg, len);
    goto close;
  }
  if (ferr != 0) {
    err = td__msg(msg, len, -ferr, "reserving %llu bytes of %s: %s",
                  (unsigned long long)nbytes, to, strerror(ferr));
    goto close;
  }
  /* Zeroing: the pages are given back (a hole) and reserved again, which
   * the kernel zeroes as each is first touched, as for a fresh segment.
   * Measured against a memset through a populated mapping (bench_fill, this
   * VM): a 64 MiB zeroed handoff 238 -> 143 ms (uninit: 131 ms), a 1 GiB
   * zeroed create alone 1581 -> 115 ms; a caller that touches a few pages
   * pays for those only. */
  if (zero && (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                         (off_t)nbytes) < 0 ||
               (errno = posix_fallocate(fd, 0, (off_t)nbytes)) != 0)) {
    err = td__msg(msg, len, -errno, "zeroing %llu bytes of %s: %s",
                  (unsigned long long)nbytes, to, strerror(errno));
    goto close;
  }
  return fd;

close:
  close(fd);
unlink:
  shm_unlink_name(to);
  return err;
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

static int shm_describe(const char *name, td__segment_desc *out, char *msg,
                        size_t len) {
  struct stat sb;
  int fd = open_ours(name, O_RDONLY, 1, &sb, msg, len);
  if (fd < 0)
    return fd;
  close(fd);
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
    .rename = shm_rename,
    .reuse = shm_reuse,
    .unlink_prefix = shm_unlink_prefix,
    .space = shm_space,
    .describe = shm_describe,
};

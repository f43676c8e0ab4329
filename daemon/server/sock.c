/* sock.c: the daemon's Unix sockets (the clients', --metrics'): bound with
 * their mode from the start, in directories no one else could swap. */
#include "sock.h"

#include "common.h"
#include "log.h"

#include <errno.h>
#include <limits.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

const char *td__uid_name(uid_t uid, char *buf, size_t len) {
  const struct passwd *pw = getpwuid(uid);
  if (pw != NULL)
    snprintf(buf, len, "uid %u (%s)", (unsigned)uid, pw->pw_name);
  else
    snprintf(buf, len, "uid %u", (unsigned)uid);
  return buf;
}

/* Checks one directory on a socket's path: it must belong to tensord's user
 * or root, and be writable by no one else unless it is sticky (as /tmp is:
 * there others cannot remove or rename what is ours). Anyone else who owns
 * or may write it could replace the socket with their own: the main one, to
 * serve tensord's clients memory they control; --metrics', to answer its
 * scrapers. what says which directory it is, sock which socket and opt the
 * option that chose it. Returns 0 or TD_EACCES, after logging. */
static int check_dir(const char *dir, const char *what, const char *sock,
                     const char *opt) {
  struct stat st;
  char who[96], me[96], ok[128];
  if (geteuid() == 0)
    snprintf(ok, sizeof(ok), "root, tensord's user");
  else
    snprintf(ok, sizeof(ok), "tensord's %s or root",
             td__uid_name(geteuid(), me, sizeof(me)));
  if (lstat(dir, &st) == 0 && S_ISLNK(st.st_mode) && st.st_uid != 0 &&
      st.st_uid != geteuid()) {
    td__error("%s %s is a symbolic link owned by %s, not by %s: whoever owns "
              "it could point it elsewhere; refusing it (remove it, or "
              "choose another %s)",
              what, dir, td__uid_name(st.st_uid, who, sizeof(who)), ok, opt);
    return TD_EACCES;
  }
  if (stat(dir, &st) < 0) {
    int err = -errno;
    td__error("%s %s: %s", what, dir, strerror(errno));
    return err;
  }
  if (!S_ISDIR(st.st_mode)) {
    td__error("%s %s is not a directory", what, dir);
    return TD_EACCES;
  }
  if (st.st_uid != 0 && st.st_uid != geteuid()) {
    td__error("%s %s is owned by %s, not by %s: whoever owns it could "
              "replace the %s; refusing it (remove it, or choose "
              "another %s)",
              what, dir, td__uid_name(st.st_uid, who, sizeof(who)), ok, sock, opt);
    return TD_EACCES;
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX)) {
    td__error("%s %s, owned by %s, has mode %04o: others may write it and "
              "could replace the %s; refusing it (chmod go-w it, or "
              "choose another %s)",
              what, dir, td__uid_name(st.st_uid, who, sizeof(who)),
              (unsigned)(st.st_mode & 07777), sock, opt);
    return TD_EACCES;
  }
  return 0;
}

int td__socket_dir(const char *path, const char *sock, const char *opt) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  char what[64], above[64];
  snprintf(what, sizeof(what), "%s directory", sock);
  snprintf(above, sizeof(above), "directory above the %s", sock);
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL) /* relative to the working directory */
    snprintf(dir, sizeof(dir), ".");
  else if (slash == dir)
    dir[1] = '\0'; /* "/" */
  else
    *slash = '\0';
  if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
    int err = -errno;
    td__error("cannot create %s %s: %s", what, dir, strerror(errno));
    return err;
  }
  int err = check_dir(dir, what, sock, opt);
  if (err < 0)
    return err;
  char real[PATH_MAX];
  if (realpath(dir, real) == NULL) {
    err = -errno;
    td__error("%s %s: %s", what, dir, strerror(errno));
    return err;
  }
  for (char *end = strrchr(real, '/'); end != NULL; end = strrchr(real, '/')) {
    if (end == real) /* the root, last */
      return check_dir("/", above, sock, opt);
    *end = '\0';
    if ((err = check_dir(real, above, sock, opt)) < 0)
      return err;
  }
  return 0;
}

int td__socket_bind(const char *path, mode_t mode) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof(sa.sun_path))
    return TD_ENAMETOOLONG;
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  /* bind() makes the socket 0777 less the umask: with the umask that leaves
   * mode, the socket has its mode from the moment it exists, whatever the
   * umask was (under 022 others could not connect, lacking the write bit,
   * but the mode would say 0755), and no chmod follows the path after. */
  mode_t was = umask((mode_t)(~mode & 0777));
  int bound = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
  umask(was);
  if (bound < 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  return fd;
}

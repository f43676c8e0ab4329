/* bindshim.c: an LD_PRELOAD library for tests that records the mode a Unix
 * socket has at the moment bind(2) makes it, before the program can change
 * it (a chmod after bind leaves a window that a test could only hit by
 * luck). After each bind of an AF_UNIX socket to the path $TDT_BIND_WATCH
 * that succeeds, it appends a line "MODE\n" (the file's permission bits, in
 * octal, as lstat gives them) to the file $TDT_BIND_LOG. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static int (*real)(int, const struct sockaddr *, socklen_t);
  if (real == NULL)
    real = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT,
                                                                   "bind");
  int r = real(fd, addr, len);
  int saved = errno;
  const char *watch = getenv("TDT_BIND_WATCH");
  const char *log = getenv("TDT_BIND_LOG");
  if (r == 0 && watch != NULL && log != NULL && addr->sa_family == AF_UNIX &&
      strncmp(((const struct sockaddr_un *)addr)->sun_path, watch,
              sizeof(((struct sockaddr_un *)0)->sun_path)) == 0) {
    struct stat st;
    char line[32];
    int n = lstat(watch, &st) == 0 ? snprintf(line, sizeof(line), "%04o\n",
                                              (unsigned)(st.st_mode & 07777))
                                   : snprintf(line, sizeof(line), "missing\n");
    int lfd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (lfd >= 0) {
      if (write(lfd, line, (size_t)n) != n)
        (void)0; /* the test finds the line missing */
      close(lfd);
    }
  }
  errno = saved;
  return r;
}

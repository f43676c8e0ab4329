/* sockpath.c: the one rule for the default socket path. */
#include "tensord.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int td_default_socket_path(char *buf, size_t len) {
  const char *env = getenv("TENSORD_SOCKET");
  int n;
  if (env != NULL && env[0] != '\0') {
    n = snprintf(buf, len, "%s", env);
  } else {
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg != NULL && xdg[0] != '\0')
      n = snprintf(buf, len, "%s/tensord.sock", xdg);
    else
      n = snprintf(buf, len, "/tmp/tensord-%u/tensord.sock",
                   (unsigned)getuid());
  }
  if (n < 0 || (size_t)n >= len)
    return TD_ENAMETOOLONG;
  return 0;
}

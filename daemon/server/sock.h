/* sock.h: the daemon's Unix sockets: their directories checked, bound with
 * their mode. */
#ifndef TD_DAEMON_SOCK_H
#define TD_DAEMON_SOCK_H

#include <stddef.h>
#include <sys/types.h>

/* Makes the directory of path, a Unix socket tensord is about to bind, if
 * it is missing (mode 0700), then checks it and every directory above it:
 * each must belong to tensord's user or root and be writable by no one else
 * unless it is sticky, or whoever owns or may write it could replace the
 * socket. sock names the socket ("socket", "metrics socket") and opt the
 * option that chose it ("--socket", "--metrics"), for the messages. Returns
 * 0, or a negative code after logging why. */
int td__socket_dir(const char *path, const char *sock, const char *opt);
/* Returns a new Unix stream socket (non-blocking, close-on-exec) bound to
 * path, which has mode from the moment it exists (the umask is set around
 * bind: call it before the loop runs, while no other thread may look), or
 * -errno (TD_ENAMETOOLONG for a path too long) with nothing left open. The
 * caller owns the fd. */
int td__socket_bind(const char *path, mode_t mode);

/* Names uid for a message: "uid 1000 (alice)", or "uid 1000". */
const char *td__uid_name(uid_t uid, char *buf, size_t len);

#endif /* TD_DAEMON_SOCK_H */

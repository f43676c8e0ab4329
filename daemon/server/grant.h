/* grant.h: giving a connection a reference to a storage, and the reply that
 * carries it. */
#ifndef TD_DAEMON_GRANT_H
#define TD_DAEMON_GRANT_H

#include "conn.h"
#include "registry.h"

#include <stddef.h>
#include <stdint.h>

struct Tensord__StorageReply;

/* Checks that c may do what want (TD__MAY_*) asks of s; on refusal msg says
 * who owns s and who c is (what names the operation). 0 or TD_EACCES. */
int td__check_access(td__conn *c, const td__storage *s, int want,
                     const char *what, char *msg, size_t len);
/* Gives c one more reference of mode ro to s and, unless c already has the
 * storage in that mode (so its process has it mapped), a fresh fd in *fd
 * (-1 otherwise; always with force_fd). Checks c's permission (write too
 * if take; none if take is -1: the caller admitted c, as a channel's
 * receiver) and its storage limit first. On failure nothing changed and msg
 * says why. */
int td__grant(td__conn *c, td__storage *s, int ro, int take, int force_fd,
              int *fd, char *msg, size_t len);
/* Fills m (which points into s) for a reply about s with fd (or -1). */
void td__storage_reply(const td__storage *s, int ro, int fd,
                       struct Tensord__StorageReply *m);
/* Answers seq with s (dirty: a create's recycled bytes, for the client to
 * zero) and fd, if >= 0. Returns 0. */
int td__send_storage(td__conn *c, uint64_t seq, const td__storage *s, int ro,
                     int dirty, int fd);

#endif /* TD_DAEMON_GRANT_H */

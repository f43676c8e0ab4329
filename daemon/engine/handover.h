/* handover.h: the engine's share of a live upgrade: its storages with their
 * holders, pooled segments, scopes and keys as messages of
 * proto/handover.proto, and back. No sockets, no fds: the server moves the
 * messages and owns the connections, which the engine sees only as below. */
#ifndef TD_DAEMON_HANDOVER_H
#define TD_DAEMON_HANDOVER_H

#include "pool.h"
#include "registry.h"

#include "handover.pb-c.h"

#include <stddef.h>

/* A connection a handover carries, as the engine sees it. Both sides keep
 * them in an array by their number in the handover (Conn.index). */
typedef struct td__handover_conn {
  td__holdings *hold;
  void *owner;        /* what its scopes name as their owner */
  td__scope **scopes; /* its list of the scopes it opened (onext) */
  uint32_t *nscopes;  /* how many are in that list */
} td__handover_conn;

/* The engine's state in messages that point into it. */
typedef struct td__handover {
  Tensord__Handover__Storages storages; /* in id order */
  Tensord__Handover__Pool pool;
  Tensord__Handover__Scopes scopes;
  Tensord__Handover__Keys keys;
  void *mem; /* the lists */
} td__handover;

/* Describes r, p and the scopes of conns (n of them) in h, which stays
 * valid while they are unchanged; td__handover_take rebuilds each list in
 * its order. number(h) is the number of the connection that holds h (or
 * UINT32_MAX). Returns 0 (free h with td__handover_free), or TD_ENOMEM. */
int td__handover_save(const td__registry *r, const td__pool *p,
                      const td__handover_conn *conns, size_t n,
                      uint32_t (*number)(const td__holdings *h),
                      td__handover *h);
void td__handover_free(td__handover *h);

/* Rebuilds into r and p what m carries (Storages, Pool, Scopes or Keys, in
 * that order), its holders and scopes going to conns (n of them). Returns 0,
 * or a negative code with why in msg (TD_EPROTO for another packet); the
 * entries before the one refused stay. */
int td__handover_take(td__registry *r, td__pool *p,
                      const td__handover_conn *conns, size_t n,
                      const Tensord__Handover__Packet *m, char *msg,
                      size_t len);

#endif /* TD_DAEMON_HANDOVER_H */

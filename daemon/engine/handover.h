/* handover.h: the engine's share of a live upgrade: its storages with their
 * holders, pooled segments, scopes, keys and channels as messages of
 * proto/handover.proto, and back. No sockets: the server moves the messages
 * and owns the connections, which the engine sees only as below. The only
 * fds are the channels' rings, which the server sends and passes in. */
#ifndef TD_DAEMON_HANDOVER_H
#define TD_DAEMON_HANDOVER_H

#include "channel.h"
#include "pool.h"
#include "registry.h"

#include "handover.pb-c.h"

#include <stddef.h>

/* A connection a handover carries, as the engine sees it. Both sides keep
 * them in an array by their number in the handover (Conn.index). */
typedef struct td__handover_conn {
  td__holdings *hold;
  void *owner;        /* what its scopes and channel ends name as theirs */
  td__scope **scopes; /* its list of the scopes it opened (onext) */
  uint32_t *nscopes;  /* how many are in that list */
  td__chan_end **chan_ends; /* its list of channel ends (cnext) */
  uint32_t *nchan_ends;     /* how many are in that list */
} td__handover_conn;

/* The engine's state in messages that point into it. */
typedef struct td__handover {
  Tensord__Handover__Storages storages; /* in id order */
  Tensord__Handover__Pool pool;
  Tensord__Handover__Scopes scopes;
  Tensord__Handover__Keys keys;
  /* Channels (handover version 2): one packet each, to go with the fd of
   * its ring (chan_fds[i], the channel's own: send a copy); then the ends
   * of all, and, after the storages, their tickets. */
  Tensord__Handover__Channel **chans;
  int *chan_fds;
  size_t nchans;
  Tensord__Handover__ChanEnds ends;
  Tensord__Handover__ChanTickets tickets;
  void *mem;      /* the lists */
  void *chan_mem; /* the channels' */
} td__handover;

/* Describes r, p, the channels of cs (NULL: none) and the scopes of conns
 * (n of them) in h, which stays valid while they are unchanged;
 * td__handover_take rebuilds each list in its order. number(h) is the
 * number of the connection that holds h (or UINT32_MAX); it is never asked
 * about a channel's holdings. Returns 0 (free h with td__handover_free), or
 * TD_ENOMEM. */
int td__handover_save(const td__registry *r, const td__pool *p,
                      const td__chans *cs, const td__handover_conn *conns,
                      size_t n, uint32_t (*number)(const td__holdings *h),
                      td__handover *h);
void td__handover_free(td__handover *h);

/* Rebuilds channel m with fd, its ring (ownership taken, closed on
 * failure), into cs; its ends, tickets and references come after it.
 * Returns 0, or a negative code with why in msg. */
int td__handover_take_chan(td__chans *cs, const Tensord__Handover__Channel *m,
                           int fd, char *msg, size_t len);

/* Rebuilds into r, p and cs what m carries (ChanEnds after the channels;
 * Storages, whose holders may be channels; Pool; Scopes; Keys; ChanTickets;
 * in that order), its holders, scopes and ends going to conns (n of them).
 * Returns 0, or a negative code with why in msg (TD_EPROTO for another
 * packet); the entries before the one refused stay. */
int td__handover_take(td__registry *r, td__pool *p, td__chans *cs,
                      const td__handover_conn *conns, size_t n,
                      const Tensord__Handover__Packet *m, char *msg,
                      size_t len);

/* Once everything came: checks that every channel of cs has an open end
 * and holds exactly the references its slots and tickets call for. Returns
 * 0, or TD_EPROTO (or TD_ENOMEM) with why in msg. */
int td__handover_check(const td__chans *cs, char *msg, size_t len);

#endif /* TD_DAEMON_HANDOVER_H */

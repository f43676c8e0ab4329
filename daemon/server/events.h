/* events.h: what happens in the daemon, streamed to the connections that
 * watch it (tensorctl watch). */
#ifndef TD_DAEMON_EVENTS_H
#define TD_DAEMON_EVENTS_H

#include "conn.h"
#include "server.h"

#include <stddef.h>
#include <stdint.h>

/* Event types: the numbers of Event.Type on the wire. */
enum {
  TD__EV_CREATE = 1,
  TD__EV_PUBLISH = 2,
  TD__EV_TAKE = 3,
  TD__EV_UNPUBLISH = 4,
  TD__EV_FREE = 5,
  TD__EV_CONNECT = 6,
  TD__EV_DISCONNECT = 7,
  TD__EV_REFUSED = 8,
  TD__EV_LOOKUP = 9,
};

/* Unsent event bytes a watcher's output may hold; an event that would pass
 * it is dropped and counted for the watcher. */
#define TD__WATCH_OUT_MAX (256u * 1024)

/* One event, as its emitter knows it; nothing of it is kept. */
typedef struct td__event {
  int type;
  const td__storage *s; /* its id, nbytes and device; or NULL */
  const char *key;      /* len bytes, or NULL */
  size_t key_len;
  const td__conn *by;   /* who caused it; or NULL, then peer */
  const td__peer *peer; /* who caused it when by is NULL; or NULL */
  int code;             /* TD__EV_REFUSED */
  const char *message;  /* TD__EV_REFUSED */
} td__event;

void td__event_emit_slow(td__server *srv, const td__event *ev);

/* Sends ev to every watcher whose prefix it matches. Costs one comparison
 * when nobody watches (it is on every request's path). */
static inline void td__event_emit(td__server *srv, const td__event *ev) {
  if (srv->watchers != NULL)
    td__event_emit_slow(srv, ev);
}

/* Makes c a watcher of the events whose key begins with prefix (len bytes;
 * an empty prefix: every event), each sent as an Event with seq. Returns 0,
 * or TD_EBUSY if c watches already. */
int td__watch_start(td__conn *c, uint64_t seq, const uint8_t *prefix,
                    size_t len);
/* Takes c off the watchers, if it is one. */
void td__watch_stop(td__conn *c);

#endif /* TD_DAEMON_EVENTS_H */

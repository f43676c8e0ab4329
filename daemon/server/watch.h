/* watch.h: the daemon's events (engine/events.h) streamed to the
 * connections that watch them (tensorctl watch). */
#ifndef TD_DAEMON_WATCH_H
#define TD_DAEMON_WATCH_H

#include "events.h"
#include "server.h"

#include <stddef.h>
#include <stdint.h>

/* Unsent event bytes a watcher's output may hold; an event that would pass
 * it is dropped and counted for the watcher (watch.c). */
#define TD__WATCH_OUT_MAX (256u * 1024)

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

#endif /* TD_DAEMON_WATCH_H */

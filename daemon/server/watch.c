/* watch.c: the event stream: what happened, to each watcher whose prefix
 * matches, through a bounded share of its output (drops are counted). */
#include "watch.h"

#include "conn.h"
#include "list.h"
#include "log.h"

#include <string.h>

void td__event_emit_slow(td__server *srv, const td__event *ev) {
  /* Events are only queued (td__conn_queue never closes a watcher), so
   * none should happen while one is being sent; if one did, it is not
   * reported rather than sent from inside this loop. */
  if (srv->emitting)
    return;
  srv->emitting = 1;
  Tensord__Event e = TENSORD__EVENT__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  td__event_message(ev, &e);
  r.body_case = TENSORD__RESPONSE__BODY_EVENT;
  r.event = &e;
  for (td__conn *w = srv->watchers; w != NULL; w = w->wnext) {
    if (w->closing ||
        !td__event_matches(ev, w->watch_prefix, w->watch_prefix_len))
      continue;
    r.seq = w->watch_seq;
    e.dropped = w->watch_dropped;
    size_t len = tensord__response__get_packed_size(&r);
    if (td__wire_pending(&w->wire) + len > TD__WATCH_OUT_MAX) {
      w->watch_dropped++;
      continue;
    }
    if (td__conn_queue(w, &r) == 0)
      w->watch_dropped = 0;
    else
      w->watch_dropped++;
  }
  srv->emitting = 0;
}

int td__watch_start(td__conn *c, uint64_t seq, const uint8_t *prefix,
                    size_t len) {
  if (c->watching)
    return TD_EBUSY;
  td__server *srv = c->srv;
  if (len > 0) /* an empty prefix may come as NULL */
    memcpy(c->watch_prefix, prefix, len);
  c->watch_prefix_len = len;
  c->watch_seq = seq;
  c->watch_dropped = 0;
  c->watching = 1;
  TD__LIST_PUSH(&srv->watchers, c, wprev, wnext);
  td__info("client %d%s%s watches events%s%.*s%s", (int)c->hold.peer.pid,
           c->name[0] ? " " : "", c->name, len ? " under '" : "", (int)len,
           len ? (const char *)prefix : "", len ? "'" : "");
  return 0;
}

void td__watch_stop(td__conn *c) {
  if (!c->watching)
    return;
  TD__LIST_REMOVE(&c->srv->watchers, c, wprev, wnext);
  c->watching = 0;
  c->wprev = c->wnext = NULL;
}

/* events.h: what happens in the daemon, as values: what an event names and
 * who caused it, which watched prefixes it matches, and the Event message it
 * is on the wire. The server streams them to its watchers. */
#ifndef TD_DAEMON_EVENTS_H
#define TD_DAEMON_EVENTS_H

#include "registry.h"
#include "tensord.pb-c.h"

#include <stddef.h>
#include <string.h>

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

/* One event, as its emitter knows it; nothing of it is kept. */
typedef struct td__event {
  int type;
  const td__storage *s; /* its id, nbytes and device; or NULL */
  const char *key;      /* len bytes, or NULL */
  size_t key_len;
  const td__holdings *by; /* who caused it (its peer and name); or NULL */
  const td__peer *peer;   /* who caused it when by is NULL; or NULL */
  int code;               /* TD__EV_REFUSED */
  const char *message;    /* TD__EV_REFUSED */
} td__event;

/* The event of type about key k and the storage it names, caused by by. */
static inline td__event td__key_event(int type, const td__key *k,
                                      const td__holdings *by) {
  td__event ev = {.type = type, .s = k->storage, .by = by};
  ev.key = k->name;
  ev.key_len = k->len;
  return ev;
}
/* Returns 1 if ev passes a watcher's prefix (len bytes): its key begins
 * with it, or, with an empty prefix, anything (events without a key too);
 * else 0. Inline: it runs once per watcher for every event. */
static inline int td__event_matches(const td__event *ev, const char *prefix,
                                    size_t len) {
  return len == 0 || (ev->key != NULL && ev->key_len >= len &&
                      memcmp(ev->key, prefix, len) == 0);
}
/* Fills e, set to TENSORD__EVENT__INIT, from ev at this moment; e points
 * into ev's strings, which must outlive it. The seq and the drop count are
 * each watcher's. */
void td__event_message(const td__event *ev, Tensord__Event *e);

#endif /* TD_DAEMON_EVENTS_H */

/* drain.h: dropping what a gone client held a slice per loop turn, so that
 * a client that held many references stalls no other client. */
#ifndef TD_DAEMON_DRAIN_H
#define TD_DAEMON_DRAIN_H

#include "registry.h"

#include <stddef.h>
#include <stdint.h>

typedef struct td__server td__server;
typedef struct td__drain td__drain;

/* Storages whose references one loop turn drops, at most. Each may free
 * its storage (an unlink on the loop thread for small segments), so a
 * slice costs a few milliseconds at most: the most another client waits
 * behind a large clean-up. */
#define TD__DRAIN_SLICE 1024

/* Called once the last reference of a queued drain is dropped. */
typedef void (*td__drain_cb)(td__drain *d);

/* One holdings being dropped; embedded in its owner (the connection), which
 * must outlive it. */
struct td__drain {
  td__holdings *hold;
  td__drain_cb done;
  td__drain *next;   /* in srv->drains */
  size_t nstorages;  /* held at the start, for the log */
  uint64_t start_ms; /* loop time at the start */
};

/* Drops every reference h holds. At most TD__DRAIN_SLICE storages' worth
 * (or any number while tensord is stopping) are dropped now, and 0
 * returned; more are queued on d and dropped TD__DRAIN_SLICE per loop turn
 * after this one, and 1 returned: h (and whatever its refs point into)
 * must then stay until done(d) is called, which is the last use of d and
 * h. Until then h's references stay counted and listed as before. */
int td__drain_start(td__server *srv, td__drain *d, td__holdings *h,
                    td__drain_cb done);
/* Drops what every queued drain still holds, now, calling each done, and
 * closes the handle that drives them (tensord is stopping). */
void td__drain_stop(td__server *srv);

#endif /* TD_DAEMON_DRAIN_H */

/* drain.h: dropping what a gone client held a slice per loop turn, so that
 * a client that held many references stalls no other client. */
#ifndef TD_DAEMON_DRAIN_H
#define TD_DAEMON_DRAIN_H

#include "registry.h"

#include <stddef.h>
#include <stdint.h>

typedef struct td__server td__server;
typedef struct td__drain td__drain;

/* One loop turn drops references to TD__DRAIN_SLICE storages at most, and
 * stops early once TD__DRAIN_SLICE_NS have passed (checked every
 * TD__DRAIN_STEP): a reference alone costs well under a microsecond, but
 * one that frees its storage unlinks a segment on the loop thread, 5-20 us
 * here. So another client waits about 2 ms at most behind a clean-up,
 * however large, and one that frees nothing still goes 1024 per turn. */
#define TD__DRAIN_SLICE 1024
#define TD__DRAIN_STEP 64
#define TD__DRAIN_SLICE_NS 2000000

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

/* Drops every reference h holds. If one slice (see above; everything while
 * tensord is stopping) drops them all now, returns 0; else queues d, which
 * drops a slice per loop turn after this one, and returns 1: h (and whatever
 * its refs point into) must then stay until done(d) is called, which is the
 * last use of d and h. Until then h's references stay counted and listed as
 * before. */
int td__drain_start(td__server *srv, td__drain *d, td__holdings *h,
                    td__drain_cb done);
/* Drops what every queued drain still holds, now, calling each done, and
 * closes the handle that drives them (tensord is stopping). */
void td__drain_stop(td__server *srv);

#endif /* TD_DAEMON_DRAIN_H */

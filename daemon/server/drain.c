/* drain.c: dropping what a gone client held a slice per loop turn: the
 * connection closes at once, its references go over the next turns, and
 * other clients' requests are served between the slices. */
#include "drain.h"

#include "log.h"
#include "server.h"

/* Drops one slice of h (see drain.h). Returns the storages h still holds. */
static size_t slice(td__server *srv, td__holdings *h) {
  uint64_t t0 = uv_hrtime();
  size_t left, n = 0;
  /* At least one call, even for holdings with no reference left: it frees
   * their table. */
  do {
    left = td__holdings_clear_some(&srv->reg, h, TD__DRAIN_STEP);
    n += TD__DRAIN_STEP;
  } while (left > 0 && n < TD__DRAIN_SLICE &&
           uv_hrtime() - t0 < TD__DRAIN_SLICE_NS);
  return left;
}

/* Queues d last. */
static void drain_queue(td__server *srv, td__drain *d) {
  d->next = NULL;
  if (srv->drains_tail)
    srv->drains_tail->next = d;
  else
    srv->drains = d;
  srv->drains_tail = d;
}

/* Drops one slice of the first queued drain, then moves it to the back so
 * that several drains share the turns. */
static void drain_slice(td__server *srv) {
  td__drain *d = srv->drains;
  srv->drains = d->next;
  if (srv->drains == NULL)
    srv->drains_tail = NULL;
  if (slice(srv, d->hold) > 0) {
    drain_queue(srv, d);
    return;
  }
  srv->ndrains--;
  td__info("client %d: dropped the last of its references to %zu "
           "storage(s), over %llu ms",
           (int)d->hold->peer.pid, d->nstorages,
           (unsigned long long)(uv_now(srv->loop) - d->start_ms));
  d->done(d);
}

/* An idle handle keeps the loop polling without blocking while drains are
 * queued: one slice per turn, I/O in between. */
static void on_drain_idle(uv_idle_t *h) {
  td__server *srv = td__container_of(h, td__server, drain_idle);
  if (srv->drains != NULL)
    drain_slice(srv);
  if (srv->drains == NULL)
    uv_idle_stop(h);
}

int td__drain_start(td__server *srv, td__drain *d, td__holdings *h,
                    td__drain_cb done) {
  size_t n = h->refs.count;
  if (srv->stopping ? td__holdings_clear_some(&srv->reg, h, SIZE_MAX) == 0
                    : slice(srv, h) == 0)
    return 0;
  d->hold = h;
  d->done = done;
  d->nstorages = n;
  d->start_ms = uv_now(srv->loop);
  if (!srv->drain_ready) {
    uv_idle_init(srv->loop, &srv->drain_idle);
    srv->drain_ready = 1;
  }
  drain_queue(srv, d);
  srv->ndrains++;
  td__debug("client %d: references to %zu storage(s) left to drop, a slice "
            "per loop turn",
            (int)h->peer.pid, h->refs.count);
  uv_idle_start(&srv->drain_idle, on_drain_idle);
  return 1;
}

void td__drain_stop(td__server *srv) {
  while (srv->drains != NULL) {
    td__drain *d = srv->drains;
    td__holdings_clear_some(&srv->reg, d->hold, SIZE_MAX);
    drain_slice(srv); /* finds it empty: dequeues it and calls done */
  }
  if (srv->drain_ready) {
    srv->drain_ready = 0;
    uv_close((uv_handle_t *)&srv->drain_idle, NULL);
  }
}

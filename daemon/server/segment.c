/* segment.c: a storage's bytes from creation to unlink. Creating and
 * unlinking cost time that grows with bytes (reserving pages, freeing
 * them), so large segments are made and unlinked on the thread pool. */
#include "segment.h"

#include "common.h"
#include "events.h"
#include "log.h"
#include "watch.h"
#include "server.h"
#include "state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Segments up to this size are made and unlinked on the loop thread:
 * reserving their pages costs about as much as a hop to the thread pool. */
#define SYNC_BYTES_MAX (256u * 1024)

/* Unlinks the victims and the pooled segment req did not use, and frees
 * their entries. */
static void unlink_pooled(td__segment_req *req) {
  if (req->pooled != NULL) { /* out of the pool: its next is NULL */
    req->pooled->next = req->victims;
    req->victims = req->pooled;
  }
  for (td__pooled *v = req->victims, *next; v != NULL; v = next) {
    next = v->next;
    const td__backend *b = td__backend_for(v->device);
    if (b != NULL)
      b->unlink(v->name);
    free(v);
  }
  req->victims = req->pooled = NULL;
}

/* req->s's name was taken (req->fd says how, req->msg by whom) on the
 * tries-th name: gives s another, unless that was the last try. Returns 0,
 * or -1 with req->fd and req->msg saying why the create fails. Runs on the
 * thread pool: it touches only req and its storage, which no one else
 * sees until the create ends. */
static int another_name(td__segment_req *req, int tries) {
  td__storage *s = req->s;
  char prefix[TD__PREFIX_MAX];
  if (tries >= TD__NAME_TRIES || td__segment_prefix(s->name, prefix) < 0) {
    req->fd = td__msg(req->msg, sizeof(req->msg), req->fd,
                      "%d names for storage %llu were all taken in /dev/shm, "
                      "the last %s (%s): someone else is making files under "
                      "tensord's names",
                      tries, (unsigned long long)s->id, s->name,
                      td_strerror(req->fd));
    return -1;
  }
  td__warn("storage %llu: %s, which tensord did not make; trying another name",
           (unsigned long long)s->id, req->msg);
  int err =
      td__segment_name(s->name, prefix, s->id, req->msg, sizeof(req->msg));
  if (err < 0) {
    req->fd = err;
    return -1;
  }
  return 0;
}

/* Makes s's segment afresh: req->fd gets its fd, or -1 for memory that
 * travels without one (s->legacy), or a negative code with req->msg. */
static void make_fresh(td__segment_req *req, const td__backend *b) {
  td__storage *s = req->s;
  for (int tries = 1;; tries++) {
    if (b->create_on != NULL) {
      td__created out = {0};
      req->fd = b->create_on(s->name, s->uuid, s->nbytes, s->owner.uid, &out,
                             req->msg, sizeof(req->msg));
      if (req->fd >= 0) {
        s->alloc_size = out.alloc_size;
        s->alloc_id = out.alloc_id;
        req->reused = out.reused;
        if (out.legacy) { /* made, but no fd: create_finish knows by s */
          s->legacy = 1;
          memcpy(s->ipc_handle, out.ipc_handle, sizeof(s->ipc_handle));
          req->fd = -1;
        }
      }
    } else
      req->fd = b->create(s->name, s->nbytes, req->msg, sizeof(req->msg));
    if (req->fd != TD_EEXIST || another_name(req, tries) < 0)
      return;
  }
}

static void create_work(uv_work_t *w) {
  td__segment_req *req = td__container_of(w, td__segment_req, work);
  td__storage *s = req->s;
  td__pooled *e = req->pooled;
  req->pooled = NULL;
  unlink_pooled(req); /* the victims */
  const td__backend *b = td__backend_for(s->device);
  if (b == NULL) {
    req->fd = td__msg(req->msg, sizeof(req->msg), TD_ENODEV,
                      "no backend for device %d", (int)s->device);
    if (e != NULL) /* a pooled segment is of a device with a backend */
      free(e);
    return;
  }
  if (e != NULL) {
    for (int tries = 1;; tries++) {
      req->fd = b->reuse(e->name, s->name, s->nbytes, req->zero, req->msg,
                         sizeof(req->msg));
      if (!td__name_taken(req->fd)) /* reused, or nothing left */
        break;
      if (another_name(req, tries) < 0) {
        b->unlink(e->name); /* still pooled: a taken name leaves it */
        break;
      }
    }
    req->reused = req->fd >= 0;
    if (req->fd < 0) /* make a fresh one instead */
      td__warn("storage %llu: %s; making a fresh segment",
               (unsigned long long)s->id, req->msg);
    free(e);
    if (req->fd >= 0)
      return;
  }
  make_fresh(req, b);
}

static void create_after(uv_work_t *w, int status) {
  td__segment_req *req = td__container_of(w, td__segment_req, work);
  td__server *srv = req->srv;   /* cb frees req */
  if (status == UV_ECANCELED) { /* never ran */
    unlink_pooled(req);
    req->fd = td__msg(req->msg, sizeof(req->msg), TD_ECANCELED,
                      "cancelled: tensord is stopping");
  }
  req->cb(req);
  td__work_done(srv);
}

void td__segment_create(td__server *srv, td__segment_req *req, td__storage *s,
                        td__segment_cb cb) {
  req->srv = srv;
  req->s = s;
  req->fd = -1;
  req->reused = 0;
  req->msg[0] = '\0';
  req->cb = cb;
  /* Unlinking victims frees their pages: a cost that grows with bytes. A
   * device's driver is never called on the loop, whatever the size. */
  if (s->nbytes <= SYNC_BYTES_MAX && req->victims == NULL &&
      s->device == TD_CPU) {
    create_work(&req->work);
    cb(req);
    return;
  }
  int err = uv_queue_work(srv->loop, &req->work, create_work, create_after);
  if (err < 0) {
    unlink_pooled(req);
    req->fd = td__msg(req->msg, sizeof(req->msg), TD_ENOMEM,
                      "cannot queue work: %s", uv_strerror(err));
    cb(req);
    return;
  }
  srv->pending_work++;
}

int td__segment_open(const td__storage *s, int readonly) {
  const td__backend *b = td__backend_for(s->device);
  return b ? b->open(s->name, readonly) : TD_ENODEV;
}

/* Unlinks, gathered during a loop turn and run as one job; a large one (or
 * a device's) is a job of its own, a batch of one. */
#define UNLINK_BATCH 256

struct td__unlink_batch {
  uv_work_t work;
  td__server *srv;
  size_t n, max;
  struct {
    const td__backend *backend;
    int retire; /* backend->retire(name, uid) rather than unlink */
    uid_t uid;
    char name[TD__SEGMENT_NAME_MAX];
  } seg[];
};

static void batch_work(uv_work_t *w) {
  struct td__unlink_batch *u =
      td__container_of(w, struct td__unlink_batch, work);
  for (size_t i = 0; i < u->n; i++)
    if (u->seg[i].retire)
      u->seg[i].backend->retire(u->seg[i].name, u->seg[i].uid);
    else
      u->seg[i].backend->unlink(u->seg[i].name);
}

static void batch_after(uv_work_t *w, int status) {
  struct td__unlink_batch *u =
      td__container_of(w, struct td__unlink_batch, work);
  td__server *srv = u->srv;
  if (status < 0) /* cancelled: unlink here rather than leak */
    batch_work(w);
  free(u);
  td__work_done(srv);
}

/* Returns an empty batch for max segments, or NULL (no memory). */
static struct td__unlink_batch *batch_new(td__server *srv, size_t max) {
  struct td__unlink_batch *u = malloc(sizeof(*u) + max * sizeof(u->seg[0]));
  if (u != NULL) {
    u->srv = srv;
    u->n = 0;
    u->max = max;
  }
  return u;
}

static void batch_put(struct td__unlink_batch *u, const td__backend *b,
                      const char *name) {
  u->seg[u->n].backend = b;
  u->seg[u->n].retire = 0;
  snprintf(u->seg[u->n].name, sizeof(u->seg[u->n].name), "%s", name);
  u->n++;
}

/* Queues u on the thread pool, or runs it here if it cannot be, and frees
 * it then. */
static void batch_queue(td__server *srv, struct td__unlink_batch *u) {
  if (uv_queue_work(srv->loop, &u->work, batch_work, batch_after) == 0) {
    srv->pending_work++;
    return;
  }
  batch_work(&u->work);
  free(u);
}

void td__segment_unlink_flush(td__server *srv) {
  struct td__unlink_batch *u = srv->unlinks;
  srv->unlinks = NULL;
  if (u != NULL)
    batch_queue(srv, u);
}

static void on_unlink_check(uv_check_t *h) {
  td__server *srv = td__container_of(h, td__server, unlink_check);
  uv_check_stop(h);
  td__segment_unlink_flush(srv);
}

/* Adds name to the batch of this loop turn. Returns 0, or -1 if it cannot
 * (not serving, or no memory): the caller unlinks it at once. */
static int batch_add(td__server *srv, const td__backend *b, const char *name) {
  if (!srv->listening || srv->stopping)
    return -1;
  if (srv->unlinks == NULL) {
    if ((srv->unlinks = batch_new(srv, UNLINK_BATCH)) == NULL)
      return -1;
    uv_check_start(&srv->unlink_check, on_unlink_check);
  }
  batch_put(srv->unlinks, b, name);
  if (srv->unlinks->n == srv->unlinks->max)
    td__segment_unlink_flush(srv);
  return 0;
}

void td__segment_unlink(td__server *srv, td_device device, const char *name,
                        uint64_t nbytes) {
  const td__backend *b = td__backend_for(device);
  if (b == NULL) {
    td__error("segment %s: no backend for device %d to unlink it", name,
              (int)device);
    return;
  }
  /* A device's driver is never called on the loop: its unlinks are jobs. */
  int job = nbytes > SYNC_BYTES_MAX || device != TD_CPU;
  if (!job && batch_add(srv, b, name) == 0)
    return;
  /* Unlinking frees the pages when no client maps them any more: a cost that
   * grows with bytes, so large segments go to the thread pool. */
  struct td__unlink_batch *u = job ? batch_new(srv, 1) : NULL;
  if (u != NULL) {
    if (b->releasing != NULL)
      b->releasing(name);
    batch_put(u, b, name);
    batch_queue(srv, u);
  } else
    b->unlink(name);
}

/* Gives s's segment to its backend's own pool, on the thread pool, if the
 * backend has one and tensord serves on. Returns 1 if it did, else 0 (the
 * caller unlinks it). */
static int retire(td__server *srv, const td__storage *s) {
  const td__backend *b = td__backend_for(s->device);
  if (b == NULL || b->retire == NULL || !srv->listening || srv->stopping)
    return 0;
  struct td__unlink_batch *u = batch_new(srv, 1);
  if (u == NULL)
    return 0;
  if (b->releasing != NULL)
    b->releasing(s->name);
  batch_put(u, b, s->name);
  u->seg[0].retire = 1;
  u->seg[0].uid = s->owner.uid;
  batch_queue(srv, u);
  return 1;
}

void td__storage_gone(td__storage *s, void *arg) {
  td__server *srv = arg;
  /* Caused by the request being handled, if any; else (a connection's
   * close, a scope's end) named after the owner. */
  td__event ev = {.type = TD__EV_FREE,
                  .s = s,
                  .by = srv->current ? &srv->current->hold : NULL,
                  .peer = &s->owner};
  td__event_emit(srv, &ev);
  if (srv->keep_segments) { /* stopping with --state-dir: keys outlive us */
    free(s);
    return;
  }
  /* A key change not yet on disk may be what freed s, and the journal on
   * disk may still name it: the segment stays until the change is durable,
   * so that a crash now finds every segment the journal names. A foreign
   * segment is never pooled. A backend with a pool of its own (CUDA's)
   * keeps it there: its driver is called off the loop. */
  if (td__state_hold_unlink(srv->state, s) == 0 &&
      (s->foreign || !retire(srv, s)) &&
      (s->foreign ||
       !td__segment_pool(srv, s->device, s->name, s->nbytes, s->owner.uid))) {
    td__debug("storage %llu: last reference dropped; unlinking %s",
              (unsigned long long)s->id, s->name);
    td__segment_unlink(srv, s->device, s->name, s->nbytes);
  }
  free(s);
}

/* ---- the recycling pool ---- */

/* Unlinks the next-linked pooled segments list and frees their entries. */
static void evict(td__server *srv, td__pooled *list) {
  for (td__pooled *e = list, *next; e != NULL; e = next) {
    next = e->next;
    td__segment_unlink(srv, e->device, e->name, e->nbytes);
    free(e);
  }
}

/* Starts the ageing timer for the oldest pooled segment, if not running. */
static void pool_arm(td__server *srv) {
  td__pool *p = &srv->pool;
  if (!srv->listening || srv->stopping || p->oldest == NULL ||
      uv_is_active((uv_handle_t *)&srv->pool_timer))
    return;
  int64_t due = p->oldest->since_ms + p->idle_ms - td__now_ms();
  uv_timer_start(&srv->pool_timer, td__server_pool_tick,
                 due < 10 ? 10 : (uint64_t)due, 0);
}

void td__server_pool_tick(uv_timer_t *t) {
  td__server *srv = td__container_of(t, td__server, pool_timer);
  int64_t now = td__now_ms();
  td__pooled *idle = td__pool_idle(&srv->pool, now);
  for (td__pooled *e = idle; e != NULL; e = e->next)
    td__debug("pooled %s idle for %lld ms; unlinking it", e->name,
              (long long)(now - e->since_ms));
  evict(srv, idle);
  pool_arm(srv);
}

int td__segment_pool(td__server *srv, td_device device, const char *name,
                     uint64_t nbytes, uid_t uid) {
  td__pool *p = &srv->pool;
  td__pooled *gone = NULL;
  int ok =
      !srv->stopping && td__pool_admit(p, &srv->reg, device, nbytes, &gone);
  evict(srv, gone);
  td__pooled *e = ok ? calloc(1, sizeof(*e)) : NULL;
  if (e == NULL)
    return 0;
  /* A name someone else took (any local user may make files in /dev/shm)
   * is never replaced: another is drawn. */
  char msg[160];
  int err = TD_EEXIST;
  for (int tries = 0; td__name_taken(err) && tries < TD__NAME_TRIES; tries++) {
    if (tries > 0)
      td__warn("cannot pool %s as %s: %s, which tensord did not make; "
               "trying another name",
               name, e->name, td_strerror(err));
    err = td__pool_name(p, e->name, msg, sizeof(msg));
    if (err < 0) {
      td__warn("cannot pool %s: %s; unlinking it", name, msg);
      free(e);
      return 0;
    }
    err = td__backend_for(device)->rename(name, e->name);
  }
  if (err < 0) {
    td__warn("cannot pool %s as %s: %s; unlinking it", name, e->name,
             td_strerror(err));
    free(e);
    return 0;
  }
  e->uid = uid;
  e->device = device;
  e->nbytes = nbytes;
  e->since_ms = td__now_ms();
  td__pool_put(p, e);
  td__debug("%s pooled as %s (%llu segment(s), %llu bytes)", name, e->name,
            (unsigned long long)p->count, (unsigned long long)p->bytes);
  pool_arm(srv);
  return 1;
}

void td__pool_drain(td__server *srv) {
  td__pooled *e;
  while ((e = td__pool_pop(&srv->pool)) != NULL)
    evict(srv, e);
}

int td__segments_unlink_prefix(const char *prefix, td__keep_fn keep,
                               void *arg) {
  static const td_device devices[] = {TD_CPU, TD_CUDA};
  int total = 0;
  for (size_t i = 0; i < sizeof(devices) / sizeof(devices[0]); i++) {
    const td__backend *b = td__backend_for(devices[i]);
    if (b == NULL)
      continue;
    int n = b->unlink_prefix(prefix, keep, arg);
    if (n < 0)
      return n;
    total += n;
  }
  return total;
}

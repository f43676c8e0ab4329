/* segment.c: a storage's bytes from creation to unlink. Creating and
 * unlinking cost time that grows with bytes (reserving pages, freeing
 * them), so large segments are made and unlinked on the thread pool. */
#include "segment.h"

#include "common.h"
#include "log.h"
#include "server.h"
#include "state.h"

#include <stdio.h>
#include <stdlib.h>

/* Segments up to this size are made and unlinked on the loop thread:
 * reserving their pages costs about as much as a hop to the thread pool. */
#define SYNC_BYTES_MAX (256u * 1024)

static void create_work(uv_work_t *w) {
  td__segment_req *req = td__container_of(w, td__segment_req, work);
  const td__backend *b = td__backend_for(req->s->device);
  if (b == NULL) {
    req->fd = td__msg(req->msg, sizeof(req->msg), TD_ENODEV,
                      "no backend for device %d", (int)req->s->device);
    return;
  }
  req->fd = b->create(req->s->name, req->s->nbytes, req->msg, sizeof(req->msg));
}

static void create_after(uv_work_t *w, int status) {
  td__segment_req *req = td__container_of(w, td__segment_req, work);
  td__server *srv = req->srv; /* cb frees req */
  if (status == UV_ECANCELED) /* never ran */
    req->fd = td__msg(req->msg, sizeof(req->msg), TD_ECANCELED,
                      "cancelled: tensord is stopping");
  req->cb(req);
  td__work_done(srv);
}

void td__segment_create(td__server *srv, td__segment_req *req, td__storage *s,
                        td__segment_cb cb) {
  req->srv = srv;
  req->s = s;
  req->fd = -1;
  req->msg[0] = '\0';
  req->cb = cb;
  if (s->nbytes <= SYNC_BYTES_MAX) {
    create_work(&req->work);
    cb(req);
    return;
  }
  int err = uv_queue_work(srv->loop, &req->work, create_work, create_after);
  if (err < 0) {
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

typedef struct unlink_job {
  uv_work_t work;
  td__server *srv;
  const td__backend *backend;
  char name[TD__SEGMENT_NAME_MAX];
} unlink_job;

static void unlink_work(uv_work_t *w) {
  unlink_job *j = td__container_of(w, unlink_job, work);
  j->backend->unlink(j->name);
}

static void unlink_after(uv_work_t *w, int status) {
  unlink_job *j = td__container_of(w, unlink_job, work);
  td__server *srv = j->srv;
  if (status < 0) /* cancelled: unlink here rather than leak */
    j->backend->unlink(j->name);
  free(j);
  td__work_done(srv);
}

void td__segment_unlink(td__server *srv, td_device device, const char *name,
                        uint64_t nbytes) {
  const td__backend *b = td__backend_for(device);
  if (b == NULL) {
    td__error("segment %s: no backend for device %d to unlink it", name,
              (int)device);
    return;
  }
  /* Unlinking frees the pages when no client maps them any more: a cost that
   * grows with bytes, so large segments go to the thread pool. */
  unlink_job *j = NULL;
  if (nbytes > SYNC_BYTES_MAX && (j = malloc(sizeof(*j))) != NULL) {
    j->srv = srv;
    j->backend = b;
    snprintf(j->name, sizeof(j->name), "%s", name);
    if (uv_queue_work(srv->loop, &j->work, unlink_work, unlink_after) == 0) {
      srv->pending_work++;
      return;
    }
    free(j);
  }
  b->unlink(name);
}

void td__storage_gone(td__storage *s, void *arg) {
  td__server *srv = arg;
  if (srv->keep_segments) { /* stopping with --state-dir: keys outlive us */
    free(s);
    return;
  }
  td__debug("storage %llu: last reference dropped; unlinking %s",
            (unsigned long long)s->id, s->name);
  /* A key change not yet on disk may be what freed s, and the journal on
   * disk may still name it: the segment stays until the change is durable,
   * so that a crash now finds every segment the journal names. */
  if (td__state_hold_unlink(srv->state, s) == 0)
    td__segment_unlink(srv, s->device, s->name, s->nbytes);
  free(s);
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

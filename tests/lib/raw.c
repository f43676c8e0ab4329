/* raw.c: a hand-driven connection to tensord for tests. */
#include "raw.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

void tdt_raw_open(tdt_raw *r, const tdt_daemon *d) {
  memset(r, 0, sizeof(*r));
  r->fd = tdt_raw_connect(d, 1);
  td__wire_init(&r->w, r->fd);
  r->seq = 1;
}

void tdt_raw_close(tdt_raw *r) {
  if (r->fd < 0)
    return;
  td__wire_free(&r->w);
  close(r->fd);
  r->fd = -1;
}

uint64_t tdt_raw_queue(tdt_raw *r, Tensord__Request *q) {
  q->seq = ++r->seq;
  size_t n = tensord__request__get_packed_size(q);
  uint8_t *p = td__wire_reserve(&r->w, n);
  cr_assert_not_null(p, "a request of %zu bytes", n);
  tensord__request__pack(q, p);
  cr_assert_eq(td__wire_commit(&r->w, n, NULL, 0), 0);
  return q->seq;
}

void tdt_raw_flush(tdt_raw *r) {
  int err = td__wire_flush(&r->w, 0);
  cr_assert_eq(err, 0, "sending requests: %s", td_strerror(err));
}

Tensord__Response *tdt_raw_reply(tdt_raw *r, int timeout_ms) {
  return tdt_raw_reply_fd(r, timeout_ms, NULL);
}

Tensord__Response *tdt_raw_reply_fd(tdt_raw *r, int timeout_ms, int *fd) {
  if (fd != NULL)
    *fd = -1;
  for (;;) {
    td__frame f;
    int got = td__wire_frame(&r->w, &f);
    cr_assert_geq(got, 0, "a bad frame from tensord: %s", td_strerror(got));
    if (got == 1) {
      Tensord__Response *rep = tensord__response__unpack(NULL, f.len, f.data);
      if (fd != NULL && f.nfds > 0) {
        *fd = f.fds[0];
        f.fds[0] = -1;
      }
      td__close_fds(f.fds, f.nfds);
      td__wire_consume(&r->w, &f);
      cr_assert_not_null(rep, "a reply that does not decode");
      return rep;
    }
    if (r->eof)
      return NULL;
    struct pollfd p = {r->fd, POLLIN, 0};
    int n = poll(&p, 1, timeout_ms);
    if (n == 0)
      return NULL;
    cr_assert_eq(n, 1, "poll: %s", strerror(errno));
    ssize_t k = td__wire_recv(&r->w, MSG_DONTWAIT);
    if (k == TD_EAGAIN)
      continue;
    if (k <= 0) { /* end of stream, or reset by a daemon that hung up */
      r->eof = 1;
      continue;
    }
    /* fds whose frames are still to come stay queued in r->w */
  }
}

static uint64_t queue_body(tdt_raw *r, Tensord__Request *q) {
  return tdt_raw_queue(r, q);
}

uint64_t tdt_raw_create(tdt_raw *r, uint64_t nbytes) {
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.nbytes = nbytes;
  q.body_case = TENSORD__REQUEST__BODY_CREATE;
  q.create = &m;
  return queue_body(r, &q);
}

uint64_t tdt_raw_publish(tdt_raw *r, const char *key, uint64_t id,
                         int64_t offset) {
  Tensord__Publish m = TENSORD__PUBLISH__INIT;
  Tensord__View v = TENSORD__VIEW__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  int64_t shape = 1, stride = 1;
  v.dtype = TD_UINT8;
  v.n_shape = v.n_stride = 1;
  v.shape = &shape;
  v.stride = &stride;
  v.offset = offset;
  m.key.data = (uint8_t *)key;
  m.key.len = strlen(key);
  m.id = id;
  m.view = &v;
  q.body_case = TENSORD__REQUEST__BODY_PUBLISH;
  q.publish = &m;
  return queue_body(r, &q);
}

uint64_t tdt_raw_unpublish(tdt_raw *r, const char *key) {
  Tensord__Unpublish m = TENSORD__UNPUBLISH__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = strlen(key);
  q.body_case = TENSORD__REQUEST__BODY_UNPUBLISH;
  q.unpublish = &m;
  return queue_body(r, &q);
}

uint64_t tdt_raw_lookup(tdt_raw *r, const char *key, int take,
                        int32_t wait_ms) {
  Tensord__Lookup m = TENSORD__LOOKUP__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = strlen(key);
  m.readonly = !take;
  m.take = take;
  m.wait_ms = wait_ms;
  q.body_case = TENSORD__REQUEST__BODY_LOOKUP;
  q.lookup = &m;
  return queue_body(r, &q);
}

uint64_t tdt_raw_ping(tdt_raw *r) {
  Tensord__Ping m = TENSORD__PING__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  q.body_case = TENSORD__REQUEST__BODY_PING;
  q.ping = &m;
  return queue_body(r, &q);
}

uint64_t tdt_raw_create_now(tdt_raw *r, uint64_t nbytes) {
  uint64_t seq = tdt_raw_create(r, nbytes);
  tdt_raw_flush(r);
  Tensord__Response *rep = tdt_raw_reply(r, 10000);
  cr_assert_not_null(rep, "no reply to a create");
  cr_assert_eq(rep->seq, seq);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_STORAGE,
               "create of %llu bytes: %s", (unsigned long long)nbytes,
               rep->body_case == TENSORD__RESPONSE__BODY_ERROR
                   ? rep->error->message
                   : "not a StorageReply");
  uint64_t id = rep->storage->id;
  tensord__response__free_unpacked(rep, NULL);
  return id;
}

int tdt_raw_code(const Tensord__Response *rep) {
  return rep->body_case == TENSORD__RESPONSE__BODY_ERROR ? rep->error->code : 0;
}

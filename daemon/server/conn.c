/* conn.c: one client connection: reading frames, queueing replies with their
 * fds, back-pressure, and teardown. */
#include "conn.h"

#include "common.h"
#include "events.h"
#include "list.h"
#include "log.h"
#include "watch.h"
#include "server.h"

#include "tensord.pb-c.h"

#include <stdalign.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59
#endif

/* Past OUT_HIGH unsent bytes (or OUT_FDS_HIGH unsent fds) the daemon stops
 * reading the client's requests until its output drains below the low marks:
 * a client that does not read its replies stalls only itself. */
#define OUT_HIGH (4u << 20)
#define OUT_LOW (1u << 20)
#define OUT_FDS_HIGH 256
#define OUT_FDS_LOW 64
/* Past OUT_MAX unsent bytes the client is disconnected: a pause takes effect
 * only after a read batch, whose small requests may ask for large replies
 * (INFO, LIST), and waiting lookups or held replies come all at once. */
#define OUT_MAX (64u << 20)
/* recvmsg calls per wake-up, so that one busy client cannot starve others. */
#define READ_BUDGET 8

static void on_poll(uv_poll_t *h, int status, int events);

static void on_stall(uv_timer_t *t);

/* Whether c is in the middle of something only it can finish: a request
 * partly received, or replies it has not read. A watcher's unread events
 * do not count: they are bounded, and what does not fit is dropped. */
static int stalled(const td__conn *c) {
  return c->wire.in_len > c->wire.in_off ||
         (!c->watching && td__wire_pending(&c->wire) > 0);
}

/* Starts or stops the stall timer to match c's state. */
static void watch_stall(td__conn *c) {
  if (!stalled(c))
    uv_timer_stop(&c->stall);
  else if (!uv_is_active((uv_handle_t *)&c->stall))
    uv_timer_start(&c->stall, on_stall, c->srv->io_timeout_ms, 0);
}

static void on_stall(uv_timer_t *t) {
  td__conn *c = td__container_of(t, td__conn, stall);
  uint64_t idle = uv_now(c->srv->loop) - c->progress_ms;
  if (!stalled(c))
    return;
  if (idle < c->srv->io_timeout_ms) {
    uv_timer_start(t, on_stall, c->srv->io_timeout_ms - idle, 0);
    return;
  }
  /* Unread replies first: a client we stopped reading has part of a
   * request waiting too, through no fault of its own. */
  char why[128];
  if (td__wire_pending(&c->wire) > 0)
    snprintf(why, sizeof(why), "left %zu bytes of replies unread for %llu ms",
             td__wire_pending(&c->wire), (unsigned long long)idle);
  else
    snprintf(why, sizeof(why),
             "sent %zu bytes of a request and nothing for %llu ms",
             c->wire.in_len - c->wire.in_off, (unsigned long long)idle);
  td__warn("client %d: %s; disconnecting it", (int)c->hold.peer.pid, why);
  td__conn_close(c, why);
}

static void update_events(td__conn *c) {
  if (c->closing)
    return;
  size_t pending = td__wire_pending(&c->wire);
  unsigned nfds = c->wire.out_nfds;
  if (pending > OUT_MAX) {
    char why[96];
    snprintf(why, sizeof(why), "did not read %zu bytes of replies", pending);
    td__warn("client %d: %s; disconnecting it", (int)c->hold.peer.pid, why);
    td__conn_close(c, why);
    return;
  }
  watch_stall(c);
  if (c->paused && pending <= OUT_LOW && nfds <= OUT_FDS_LOW) {
    c->paused = 0;
    td__debug("client %d: output drained, reading again",
              (int)c->hold.peer.pid);
  } else if (!c->paused && (pending > OUT_HIGH || nfds > OUT_FDS_HIGH)) {
    c->paused = 1;
    td__debug("client %d: %zu bytes unread by the client, pausing its input",
              (int)c->hold.peer.pid, pending);
  }
  if (c->eof && pending == 0) {
    td__conn_close(c, "disconnected");
    return;
  }
  if (c->srv->quiesced) { /* a live upgrade: the socket waits as it is */
    td__conn_quiesce(c);
    return;
  }
  int ev =
      (c->paused || c->eof ? 0 : UV_READABLE) | (pending ? UV_WRITABLE : 0);
  if (ev == c->events)
    return;
  c->events = ev;
  if (ev)
    uv_poll_start(&c->poll, ev, on_poll);
  else
    uv_poll_stop(&c->poll);
}

/* Sends what the socket takes now. Returns 0, or a negative code after
 * closing the connection. */
static int flush(td__conn *c) {
  size_t before = td__wire_pending(&c->wire);
  int err = td__wire_flush(&c->wire, MSG_DONTWAIT);
  if (td__wire_pending(&c->wire) < before)
    c->progress_ms = uv_now(c->srv->loop);
  if (err == 0 || err == TD_EAGAIN)
    return 0;
  char why[96];
  snprintf(why, sizeof(why), "write failed: %s", td_strerror(err));
  td__conn_close(c, why);
  return err;
}

/* Commits a frame of len bytes reserved (and filled) in c's output, with
 * its nfds fds, and sends it unless a read batch is in progress. */
static int commit_fds(td__conn *c, size_t len, const int *fds, unsigned nfds) {
  int err = td__wire_commit(&c->wire, len, fds, nfds);
  if (err < 0) {
    td__conn_close(c, "out of memory queueing a reply");
    return err;
  }
  if (!c->in_batch) {
    err = flush(c);
    update_events(c);
  }
  return err;
}

static int commit(td__conn *c, size_t len, int fd) {
  return commit_fds(c, len, &fd, fd >= 0 ? 1 : 0);
}

/* Reserves room for a reply of len bytes; on failure closes fd and either
 * answers EMSGSIZE or hangs up. */
static uint8_t *reserve(td__conn *c, uint64_t seq, size_t len, int fd) {
  uint8_t *p = NULL;
  if (!c->closing && len <= TD__FRAME_MAX)
    p = td__wire_reserve(&c->wire, len);
  if (p != NULL)
    return p;
  if (fd >= 0)
    close(fd);
  if (c->closing)
    return NULL;
  if (len > TD__FRAME_MAX) { /* a bug if it happens: say so, keep going */
    td__error("client %d: reply of %zu bytes exceeds the frame limit",
              (int)c->hold.peer.pid, len);
    td__conn_error(c, seq, TD_EMSGSIZE,
                   "reply of %zu bytes exceeds the frame limit of %u", len,
                   TD__FRAME_MAX);
  } else {
    td__conn_close(c, "out of memory queueing a reply");
  }
  return NULL;
}

int td__conn_send(td__conn *c, Tensord__Response *r, int fd) {
  size_t len = tensord__response__get_packed_size(r);
  uint8_t *p = reserve(c, r->seq, len, fd);
  if (p == NULL)
    return TD_ECONNRESET;
  tensord__response__pack(r, p);
  return commit(c, len, fd);
}

int td__conn_send_fds(td__conn *c, Tensord__Response *r, const int *fds,
                      unsigned nfds) {
  size_t len = tensord__response__get_packed_size(r);
  uint8_t *p = reserve(c, r->seq, len, -1);
  if (p == NULL) {
    for (unsigned i = 0; i < nfds; i++)
      close(fds[i]);
    return TD_ECONNRESET;
  }
  tensord__response__pack(r, p);
  return commit_fds(c, len, fds, nfds);
}

int td__conn_queue(td__conn *c, Tensord__Response *r) {
  if (c->closing)
    return TD_ECONNRESET;
  size_t len = tensord__response__get_packed_size(r);
  uint8_t *p = len <= TD__FRAME_MAX ? td__wire_reserve(&c->wire, len) : NULL;
  if (p == NULL)
    return TD_ENOMEM;
  tensord__response__pack(r, p);
  int err = td__wire_commit(&c->wire, len, NULL, 0);
  if (err < 0)
    return err;
  /* The loop sends it once the socket is writable (or the read batch in
   * progress does, at its end). Nothing else changes: a watcher's output
   * neither pauses its input nor starts the stall timer. */
  if (!c->in_batch && !(c->events & UV_WRITABLE)) {
    c->events |= UV_WRITABLE;
    uv_poll_start(&c->poll, c->events, on_poll);
  }
  return 0;
}

int td__conn_send_frame(td__conn *c, const uint8_t *frame, size_t len, int fd) {
  uint8_t *p = reserve(c, 0, len, fd);
  if (p == NULL)
    return TD_ECONNRESET;
  memcpy(p, frame, len);
  return commit(c, len, fd);
}

static int send_error(td__conn *c, uint64_t seq, int code, const char *msg) {
  Tensord__Error e = TENSORD__ERROR__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  e.code = code;
  e.message = (char *)msg;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_ERROR;
  r.error = &e;
  td__metrics_error(&c->srv->metrics, code);
  td__debug("client %d: seq %llu: %s: %s", (int)c->hold.peer.pid,
            (unsigned long long)seq, td_err_name(code), msg);
  td__server *srv = c->srv;
  td__event ev = {
      .type = TD__EV_REFUSED, .by = &c->hold, .code = code, .message = msg};
  if (srv->current == c) {
    ev.key = srv->current_key;
    ev.key_len = srv->current_key_len;
  }
  td__event_emit(srv, &ev);
  return td__conn_send(c, &r, -1);
}

int td__conn_error(td__conn *c, uint64_t seq, int code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  send_error(c, seq, code, msg);
  return code;
}

/* Tells the client why, makes one attempt to send it, and hangs up. */
static void protocol_error(td__conn *c, uint64_t seq, int code, const char *fmt,
                           ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  td__warn("client %d: protocol error: %s; closing its connection",
           (int)c->hold.peer.pid, msg);
  c->in_batch = 1; /* queue only; flushed once below */
  send_error(c, seq, code, msg);
  if (!c->closing)
    td__wire_flush(&c->wire, MSG_DONTWAIT);
  td__conn_close(c, "protocol error");
}

/* Requests are decoded into one reused buffer: the loop handles one request
 * at a time, and nothing of a request outlives its handler (what must stay,
 * a key or a view, is copied). This takes malloc off the hot path. */
static struct {
  _Alignas(max_align_t) uint8_t buf[64 * 1024];
  size_t used;
} req_arena;

static void *req_alloc(void *data, size_t size) {
  size = (size + 15) & ~(size_t)15;
  if (size <= sizeof(req_arena.buf) - req_arena.used) {
    void *p = req_arena.buf + req_arena.used;
    req_arena.used += size;
    return p;
  }
  return malloc(size);
}

static void req_free(void *data, void *p) {
  uint8_t *b = p;
  if (b < req_arena.buf || b >= req_arena.buf + sizeof(req_arena.buf))
    free(p);
}

static ProtobufCAllocator req_allocator = {req_alloc, req_free, NULL};

/* Handles every complete frame in the input. Returns -1 once the connection
 * is closing. */
static int process_frames(td__conn *c) {
  td__frame f;
  int r;
  while ((r = td__wire_frame(&c->wire, &f)) == 1) {
    req_arena.used = 0;
    Tensord__Request *req =
        tensord__request__unpack(&req_allocator, f.len, f.data);
    size_t len = f.len;
    td__close_fds(f.fds, f.nfds);
    td__wire_consume(&c->wire, &f);
    if (req == NULL) {
      protocol_error(c, 0, TD_EPROTO,
                     "garbled frame: %zu bytes that do not decode as a "
                     "Request",
                     len);
      return -1;
    }
    td__server *srv = c->srv;
    int body = (int)req->body_case;
    td__metrics_request(&srv->metrics, body);
    c->nrequests++;
    /* Service time: a create the thread pool finishes counts from
     * create_finish, a lookup that waits for its key not at all. */
    uint32_t nwaiters = c->nwaiters;
    c->req_ns = uv_hrtime();
    c->req_timed = 0;
    int err = srv->hooks.dispatch(c, req);
    if (c->nwaiters > nwaiters)
      srv->metrics.lookup_waits++;
    else if (!c->req_timed)
      td__metrics_observe(&srv->metrics, uv_hrtime() - c->req_ns);
    tensord__request__free_unpacked(req, &req_allocator);
    if (c->closing)
      return -1;
    if (err < 0) { /* the handler has queued the Error: send it, hang up */
      td__warn("client %d: protocol error: %s; closing its connection",
               (int)c->hold.peer.pid, td_strerror(err));
      td__wire_flush(&c->wire, MSG_DONTWAIT);
      td__conn_close(c, "protocol error");
      return -1;
    }
  }
  if (r < 0) {
    const uint8_t *h = c->wire.in + c->wire.in_off;
    uint32_t len = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                   (uint32_t)h[3] << 24;
    if (r == TD_EMSGSIZE)
      protocol_error(c, 0, r, "frame of %u bytes exceeds the limit of %u", len,
                     TD__FRAME_MAX);
    else
      protocol_error(c, 0, r,
                     "garbled frame header %02x %02x %02x %02x %02x %02x %02x "
                     "%02x",
                     h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
    return -1;
  }
  return 0;
}

static void read_batch(td__conn *c) {
  c->in_batch = 1;
  for (int i = 0; i < READ_BUDGET && !c->paused; i++) {
    ssize_t n = td__wire_recv(&c->wire, MSG_DONTWAIT);
    if (c->wire.in_nfds > 0) {
      unsigned nfds = c->wire.in_nfds;
      td__close_fds(c->wire.in_fds, nfds);
      c->wire.in_nfds = 0;
      protocol_error(c, 0, TD_EPROTO,
                     "client sent %u file descriptor(s); tensord accepts none",
                     nfds);
      return;
    }
    if (n == TD_EAGAIN)
      break;
    if (n == 0) {
      /* End of stream is goodbye; but a client that only shut its write
       * side still gets the replies already due (bounded by the stall
       * timer). */
      if (td__wire_pending(&c->wire) == 0) {
        td__conn_close(c, "disconnected");
        return;
      }
      c->eof = 1;
      break;
    }
    if (n < 0) {
      char why[96];
      snprintf(why, sizeof(why), "read failed: %s", td_strerror((int)n));
      td__conn_close(c, why);
      return;
    }
    c->progress_ms = uv_now(c->srv->loop);
    if (process_frames(c) < 0)
      return;
    if (c->wire.short_read)
      break; /* the socket is drained; skip the recvmsg that says EAGAIN */
  }
  c->in_batch = 0;
  flush(c);
}

static void on_poll(uv_poll_t *h, int status, int events) {
  td__conn *c = td__container_of(h, td__conn, poll);
  if (status < 0) {
    char why[96];
    /* libuv reports POLLERR as UV_EBADF: on a Unix socket, a peer that
     * closed (or died) with data it had not read. */
    if (status == UV_EBADF)
      snprintf(why, sizeof(why),
               "connection reset (it closed with replies "
               "unread)");
    else
      snprintf(why, sizeof(why), "poll failed: %s", uv_strerror(status));
    td__conn_close(c, why);
    return;
  }
  if ((events & UV_WRITABLE) && flush(c) < 0)
    return;
  if (events & UV_READABLE)
    read_batch(c);
  update_events(c);
}

/* Sets h's supplementary groups to every one of the peer on fd, however
 * many (the kernel allows 65536). Returns 0 (no groups if the kernel has no
 * credentials for the socket) or TD_ENOMEM. */
static int peer_groups(int fd, td__holdings *h) {
  socklen_t len = 0;
  gid_t *g = NULL;
  int err = 0;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, NULL, &len) == 0)
    return 0; /* none */
  if (errno != ERANGE)
    err = errno;
  else if ((g = malloc(len)) == NULL)
    return TD_ENOMEM;
  else if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g, &len) < 0)
    err = errno;
  if (err != 0) {
    td__debug("client %d: no supplementary groups (%s); its primary group "
              "only counts",
              (int)h->peer.pid, strerror(err));
    free(g);
    return 0;
  }
  h->groups = g;
  h->ngroups = (int)(len / sizeof(gid_t));
  return 0;
}

/* Starts c's stall timer and puts it on srv's list of connections. */
static void conn_link(td__server *srv, td__conn *c) {
  uv_timer_init(srv->loop, &c->stall);
  c->nhandles = 2;
  c->progress_ms = uv_now(srv->loop);
  TD__LIST_PUSH(&srv->conns, c, prev, next);
  srv->nconns++;
}

int td__conn_accept(td__server *srv, int fd) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  td__conn *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    close(fd);
    return TD_ENOMEM;
  }
  td__peer peer = {cred.pid, cred.uid, cred.gid};
  c->srv = srv;
  td__wire_init(&c->wire, fd);
  td__holdings_init(&c->hold, &peer);
  c->hold.name = c->name;
  /* Supplementary groups, for the group bits of storages' modes: without
   * all of them the client would be refused what a group gives it. */
  int err = peer_groups(fd, &c->hold);
  if (err < 0) {
    td__error("client %d (uid %u): no memory for its supplementary groups; "
              "refusing it",
              (int)peer.pid, (unsigned)peer.uid);
    close(fd);
    free(c);
    return err;
  }
  err = uv_poll_init(srv->loop, &c->poll, fd);
  if (err < 0) {
    close(fd);
    free(c->hold.groups);
    free(c);
    return err;
  }
  conn_link(srv, c);
  srv->metrics.connects++;
  if (srv->max_clients && srv->nconns > srv->max_clients) {
    td__warn("refusing client %d (uid %u): %u clients connected, the most "
             "--max-clients allows",
             (int)peer.pid, (unsigned)peer.uid, srv->max_clients);
    c->in_batch = 1; /* queue the error, send it once, hang up */
    td__conn_error(c, 0, TD_EUSERS,
                   "tensord serves at most %u client(s) (--max-clients) and "
                   "has that many; try again later",
                   srv->max_clients);
    td__wire_flush(&c->wire, MSG_DONTWAIT);
    td__conn_close(c, "refused: too many clients");
    return 0;
  }
  update_events(c);
  td__info("client %d (uid %u) connected", (int)peer.pid, (unsigned)peer.uid);
  return 0;
}

td__conn *td__conn_adopt(td__server *srv, int fd, const td__peer *peer,
                         gid_t *groups, int ngroups) {
  td__conn *c = calloc(1, sizeof(*c));
  if (c == NULL || uv_poll_init(srv->loop, &c->poll, fd) < 0) {
    free(c);
    free(groups);
    close(fd);
    return NULL;
  }
  c->srv = srv;
  td__wire_init(&c->wire, fd);
  td__holdings_init(&c->hold, peer);
  c->hold.name = c->name;
  c->hold.groups = groups;
  c->hold.ngroups = ngroups;
  conn_link(srv, c);
  return c;
}

void td__conn_quiesce(td__conn *c) {
  if (c->closing)
    return;
  if (c->events != 0)
    uv_poll_stop(&c->poll);
  c->events = 0;
  uv_timer_stop(&c->stall);
}

void td__conn_resume(td__conn *c) {
  c->progress_ms = uv_now(c->srv->loop);
  update_events(c);
}

/* Frees c once its handles are closed and its references dropped. */
static void conn_unref(td__conn *c) {
  if (--c->nhandles > 0)
    return;
  free(c->hold.groups);
  free(c);
}

static void on_closed(uv_handle_t *h) {
  td__conn *c = h->data;
  if (h == (uv_handle_t *)&c->poll) { /* libuv no longer watches the fd */
    close(c->wire.fd);
    c->wire.fd = -1;
  }
  conn_unref(c);
}

static void on_drained(td__drain *d) {
  conn_unref(td__container_of(d, td__conn, drain));
}

void td__conn_close(td__conn *c, const char *why) {
  if (c->closing)
    return;
  c->closing = 1;
  td__server *srv = c->srv;
  srv->metrics.disconnects++;
  td__info("client %d%s%s: %s; dropping its %llu reference(s)",
           (int)c->hold.peer.pid, c->name[0] ? " " : "", c->name, why,
           (unsigned long long)c->hold.nrefs);
  td__watch_stop(c);
  if (c->hello) {
    td__event ev = {.type = TD__EV_DISCONNECT, .by = &c->hold, .message = why};
    td__event_emit(srv, &ev);
  }
  if (srv->current == c)
    srv->current = NULL; /* what its close frees was not its request's */
  srv->hooks.conn_gone(c);
  if (td__drain_start(srv, &c->drain, &c->hold, on_drained) > 0)
    c->nhandles++;
  td__wire_free(&c->wire);
  TD__LIST_REMOVE(&srv->conns, c, prev, next);
  srv->nconns--;
  c->poll.data = c->stall.data = c;
  uv_close((uv_handle_t *)&c->poll, on_closed);
  uv_close((uv_handle_t *)&c->stall, on_closed);
}

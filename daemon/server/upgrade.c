/* upgrade.c: live upgrade: the old daemon quiesces and sends everything it
 * serves over a private SOCK_SEQPACKET pair; the new one rebuilds it, and a
 * Ready / Commit / Started exchange decides which of the two serves on.
 *
 * Exactly one serves whatever dies when: the old side resumes on anything
 * but Started (EOF, an error, a refusal, --upgrade-timeout passing), and
 * exits on Started without touching a socket or a segment; the new side
 * sends Started before it polls anything, and on anything but Commit starts
 * normally instead (which finds the old socket stale if the old daemon died,
 * or live if it resumed). Past the deadline after Commit, the old side shuts
 * its receiving end first, so that a Started is either queued already or can
 * no longer be sent: a new side whose Started fails finds the old side's
 * Abort and exits. */
#include "upgrade.h"

#include "common.h"
#include "events.h"
#include "handover.h"
#include "log.h"
#include "ops.h"
#include "watch.h"
#include "metrics.h"
#include "registry.h"
#include "scrape.h"
#include "segment.h"
#include "start.h"
#include "state.h"
#include "waitq.h"

#include "handover.pb-c.h"
#include "tensord.pb-c.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* Fds per packet: SCM_RIGHTS carries at most 253. */
#define CHAN_FDS_MAX 250
/* The largest packet either side sends or takes; batches stop well short. */
#define CHAN_PACKET_MAX (192u * 1024)
#define BATCH_BYTES (48u * 1024)
#define CHUNK_BYTES (32u * 1024)

typedef Tensord__Handover__Packet Packet;

struct td__upgrade {
  td__server *srv;
  uv_check_t check; /* looks for quiet once a turn while quiescing */
  int check_ready;
  int fd;            /* our end of the handover channel, or -1 */
  td__conn *channel; /* the new tensord's own connection: not handed over */
  td__conn *asker;   /* tensorctl upgrade's: answered at the end */
  uint64_t asker_seq;
  uv_process_t *proc; /* the tensord spawned for the asker, or NULL */
  int child_pid;
  char binary[256]; /* what it runs, for messages */
  int new_pid;
  char new_version[64];
};

/* The test hook TENSORD_UPGRADE_STALL=<phase>: stop here so that a test can
 * SIGKILL this process at exactly this point of the handover. */
static void stall(const char *phase) {
  const char *e = getenv("TENSORD_UPGRADE_STALL");
  if (e == NULL || strcmp(e, phase) != 0)
    return;
  td__warn("upgrade: stopping at phase '%s' (TENSORD_UPGRADE_STALL)", phase);
  raise(SIGSTOP);
}

/* ---- the channel: one Packet per packet, fds in one stream ---- */

typedef struct chan {
  int fd;
  int timeout_ms;      /* each wait, at most; -1: none */
  int64_t deadline_ms; /* the whole exchange (now_ms), or 0: none */
  uint64_t limit_ms;   /* what set the deadline, for messages */
  int *fdq;            /* received, not yet taken */
  size_t fdq_off, fdq_len, fdq_cap;
  uint8_t *buf;
} chan;

/* CLOCK_MONOTONIC, in ms: the loop's time (uv_now) stands still while the
 * old side hands over. */
static int64_t now_ms(void) {
  return (int64_t)(uv_hrtime() / 1000000);
}

/* Sets ch up on fd, each wait timeout_ms at most (-1: none) and no deadline
 * (chan_deadline). Returns 0 or TD_ENOMEM. */
static int chan_init(chan *ch, int fd, int timeout_ms) {
  memset(ch, 0, sizeof(*ch));
  ch->fd = fd;
  ch->timeout_ms = timeout_ms;
  ch->buf = malloc(CHAN_PACKET_MAX);
  return ch->buf ? 0 : TD_ENOMEM;
}

/* From now on, every send and receive on ch ends by limit_ms from now. */
static void chan_deadline(chan *ch, uint64_t limit_ms) {
  ch->limit_ms = limit_ms;
  ch->deadline_ms =
      now_ms() + (int64_t)(limit_ms > INT32_MAX ? INT32_MAX : limit_ms);
}

/* Closes the fds received and not taken, and frees ch (not its socket). */
static void chan_free(chan *ch) {
  for (size_t i = ch->fdq_off; i < ch->fdq_len; i++)
    close(ch->fdq[i]);
  free(ch->fdq);
  free(ch->buf);
  ch->fdq = NULL;
  ch->buf = NULL;
  ch->fdq_off = ch->fdq_len = ch->fdq_cap = 0;
}

/* Waits for ev on the channel, until its deadline at most. Returns 0,
 * TD_ETIMEDOUT or TD_ECONNRESET. */
static int chan_wait(chan *ch, short ev) {
  struct pollfd p = {ch->fd, ev, 0};
  int n;
  do {
    int ms = ch->timeout_ms;
    if (ch->deadline_ms != 0) {
      int64_t left = ch->deadline_ms - now_ms();
      if (left <= 0)
        return TD_ETIMEDOUT;
      if (ms < 0 || left < ms)
        ms = (int)left;
    }
    n = poll(&p, 1, ms);
  } while (n < 0 && errno == EINTR);
  if (n == 0)
    return TD_ETIMEDOUT;
  if (n < 0)
    return -errno;
  if ((p.revents & ev) == 0)
    return TD_ECONNRESET;
  return 0;
}

static int send_raw(chan *ch, const uint8_t *buf, size_t len, const int *fds,
                    unsigned nfds) {
  union {
    char buf[CMSG_SPACE(sizeof(int) * CHAN_FDS_MAX)];
    struct cmsghdr align;
  } ctl;
  struct iovec iov = {(void *)buf, len};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    memset(ctl.buf, 0, sizeof(ctl.buf));
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  for (;;) {
    ssize_t n = sendmsg(ch->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0)
      return 0;
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN)
      return -errno;
    int err = chan_wait(ch, POLLOUT);
    if (err < 0)
      return err;
  }
}

/* Sends p with nfds fds (copies: the caller keeps its own), more than a
 * packet takes going ahead in Fds packets. Returns 0 or a negative code. */
static int chan_send(chan *ch, const Packet *p, const int *fds, size_t nfds) {
  while (nfds > CHAN_FDS_MAX) {
    Tensord__Handover__Fds f = TENSORD__HANDOVER__FDS__INIT;
    Packet fp = TENSORD__HANDOVER__PACKET__INIT;
    fp.body_case = TENSORD__HANDOVER__PACKET__BODY_FDS;
    fp.fds = &f;
    size_t n = tensord__handover__packet__pack(&fp, ch->buf);
    int err = send_raw(ch, ch->buf, n, fds, CHAN_FDS_MAX);
    if (err < 0)
      return err;
    fds += CHAN_FDS_MAX;
    nfds -= CHAN_FDS_MAX;
  }
  size_t len = tensord__handover__packet__get_packed_size(p);
  if (len > CHAN_PACKET_MAX)
    return TD_EMSGSIZE;
  tensord__handover__packet__pack(p, ch->buf);
  return send_raw(ch, ch->buf, len, fds, (unsigned)nfds);
}

/* Receives the next packet that is not only fds. Returns 0 with *out (free
 * it with tensord__handover__packet__free_unpacked), TD_ECONNRESET at end
 * of stream, TD_EPROTO for a truncated or garbled packet, or another
 * negative code. */
static int chan_recv(chan *ch, Packet **out) {
  for (;;) {
    union {
      char buf[CMSG_SPACE(sizeof(int) * CHAN_FDS_MAX)];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {ch->buf, CHAN_PACKET_MAX};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof(ctl.buf);
    ssize_t n = recvmsg(ch->fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && errno == EAGAIN) {
      int err = chan_wait(ch, POLLIN);
      if (err < 0)
        return err;
      continue;
    }
    if (n < 0)
      return -errno;
    int bad = (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) != 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
        continue;
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      if (ch->fdq_len + k > ch->fdq_cap) {
        size_t cap = ch->fdq_cap ? ch->fdq_cap * 2 : 256;
        while (cap < ch->fdq_len + k)
          cap *= 2;
        int *q = realloc(ch->fdq, cap * sizeof(int));
        if (q == NULL) {
          for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            close(fd);
          }
          bad = 1;
          continue;
        }
        ch->fdq = q;
        ch->fdq_cap = cap;
      }
      memcpy(ch->fdq + ch->fdq_len, CMSG_DATA(c), k * sizeof(int));
      ch->fdq_len += k;
    }
    if (bad)
      return TD_EPROTO;
    if (n == 0)
      return TD_ECONNRESET; /* SOCK_SEQPACKET: no empty packets are sent */
    Packet *p = tensord__handover__packet__unpack(NULL, (size_t)n, ch->buf);
    if (p == NULL || p->body_case == TENSORD__HANDOVER__PACKET__BODY__NOT_SET)
      return p ? (tensord__handover__packet__free_unpacked(p, NULL), TD_EPROTO)
               : TD_EPROTO;
    if (p->body_case == TENSORD__HANDOVER__PACKET__BODY_FDS) {
      tensord__handover__packet__free_unpacked(p, NULL);
      continue;
    }
    *out = p;
    return 0;
  }
}

/* Takes the next received fd. Returns it, or -1 if none came. */
static int chan_fd(chan *ch) {
  return ch->fdq_off < ch->fdq_len ? ch->fdq[ch->fdq_off++] : -1;
}

static int send_body(chan *ch, int body, void *m) {
  Packet p = TENSORD__HANDOVER__PACKET__INIT;
  p.body_case = body;
  p.begin = m; /* every member of the oneof is a pointer at the same place */
  return chan_send(ch, &p, NULL, 0);
}

/* ---- the old side ---- */

static int handed(const td__upgrade *u, const td__conn *c) {
  return c != u->channel && c != u->asker;
}

static uint32_t number_of(const td__holdings *h) {
  return td__container_of(h, td__conn, hold)->hindex;
}

/* Where a refusal's message goes (tensorctl upgrade) and who logs it. */
static void fail_asker(td__upgrade *u, int code, const char *msg) {
  if (u->asker != NULL) {
    td__conn_error(u->asker, u->asker_seq, code, "%s", msg);
    u->asker = NULL;
  }
}

static void upgrade_check_closed(uv_handle_t *h) {
  free(h->data);
}

static void upgrade_free(td__upgrade *u) {
  td__server *srv = u->srv;
  if (srv->upgrade == u)
    srv->upgrade = NULL;
  if (u->fd >= 0)
    close(u->fd);
  if (u->proc != NULL)
    u->proc->data = NULL; /* its exit only closes it now */
  if (u->check_ready) {
    u->check.data = u;
    uv_close((uv_handle_t *)&u->check, upgrade_check_closed);
  } else {
    free(u);
  }
}

/* Serves again exactly as before the quiesce. */
static void resume(td__server *srv) {
  if (!srv->quiesced)
    return;
  srv->quiesced = 0;
  td__server_accepting(srv, 1);
  for (td__conn *c = srv->conns, *next; c != NULL; c = next) {
    next = c->next;
    td__conn_resume(c);
  }
}

static int send_options(td__upgrade *u, chan *ch) {
  td__server *srv = u->srv;
  Tensord__Handover__Options o = TENSORD__HANDOVER__OPTIONS__INIT;
  o.capacity = srv->reg.capacity;
  o.quota = srv->reg.quota;
  o.max_clients = srv->max_clients;
  o.max_storages_per_client = srv->max_storages_per_client;
  o.max_waiters_per_client = srv->max_waiters_per_client;
  o.max_keys_per_uid = srv->max_keys_per_uid;
  o.io_timeout_ms = srv->io_timeout_ms;
  o.upgrade_timeout_ms = srv->upgrade_timeout_ms;
  o.recycle_bytes = srv->pool.limit;
  o.recycle_idle_ms = srv->pool.idle_ms;
  o.socket_path = srv->socket_path;
  o.own_socket = srv->own_socket;
  o.state_dir = srv->state_dir;
  o.instance = srv->instance;
  o.prefix = srv->prefix;
  char *prev[srv->nprev + 1];
  for (size_t i = 0; i < srv->nprev; i++)
    prev[i] = srv->prev[i];
  o.n_prev_prefixes = srv->nprev;
  o.prev_prefixes = prev;
  o.next_id = srv->reg.next_id;
  o.next_chan_id = srv->chans.next_id;
  o.start_ms = srv->start_ms;
  o.pool_next_seq = srv->pool.next_seq;
  o.pool_hits = srv->pool.hits;
  o.pool_misses = srv->pool.misses;
  o.run_path = srv->run_path;
  char *prefixes[srv->nprefixes + 1];
  for (size_t i = 0; i < srv->nprefixes; i++)
    prefixes[i] = srv->prefixes[i];
  o.n_prefixes = srv->nprefixes;
  o.prefixes = prefixes;
  const td__metrics *mt = &srv->metrics;
  uint64_t bounds[TD__METRIC_BUCKETS];
  memcpy(bounds, td__metric_bounds_ns, sizeof(bounds));
  Tensord__Handover__Counters k = TENSORD__HANDOVER__COUNTERS__INIT;
  k.n_requests = TD__METRIC_TYPES;
  k.requests = (uint64_t *)mt->requests;
  k.n_errors = TD__METRIC_CODES;
  k.errors = (uint64_t *)mt->errors;
  k.n_latency = TD__METRIC_BUCKETS + 1;
  k.latency = (uint64_t *)mt->latency;
  k.n_latency_bounds_ns = TD__METRIC_BUCKETS;
  k.latency_bounds_ns = bounds;
  k.latency_sum_ns = mt->latency_sum_ns;
  k.latency_count = mt->latency_count;
  k.lookup_waits = mt->lookup_waits;
  k.connects = mt->connects;
  k.disconnects = mt->disconnects;
  k.storages_created = mt->storages_created;
  k.bytes_created = mt->bytes_created;
  k.journal_syncs = mt->journal_syncs;
  k.scrapes = mt->scrapes;
  o.counters = &k;
  int fds[4] = {srv->listen_fd, -1, -1, -1};
  size_t nfds = 1;
  if (srv->state != NULL) {
    o.has_state = 1;
    td__state_handover(srv->state, &fds[1], &fds[2], &o.state_gen);
    nfds = 3;
  }
  const td__scrape *sc = &srv->scrape;
  uv_os_fd_t mfd = -1;
  if (sc->open && uv_fileno(&sc->listen.handle, &mfd) == 0) {
    o.has_metrics = 1;
    o.metrics_tcp = sc->tcp;
    o.metrics_path = (char *)sc->path;
    o.metrics_where = (char *)sc->where;
    o.metrics_timeout_ms = sc->timeout_ms;
    fds[nfds++] = mfd;
  }
  Packet p = TENSORD__HANDOVER__PACKET__INIT;
  p.body_case = TENSORD__HANDOVER__PACKET__BODY_OPTIONS;
  p.options = &o;
  return chan_send(ch, &p, fds, nfds);
}

static int send_bytes(chan *ch, uint32_t index, int output, const uint8_t *b,
                      size_t len) {
  while (len > 0) {
    size_t n = len < CHUNK_BYTES ? len : CHUNK_BYTES;
    Tensord__Handover__ConnBytes m = TENSORD__HANDOVER__CONN_BYTES__INIT;
    m.conn = index;
    m.output = output;
    m.data.data = (uint8_t *)b;
    m.data.len = n;
    int err = send_body(ch, TENSORD__HANDOVER__PACKET__BODY_CONN_BYTES, &m);
    if (err < 0)
      return err;
    b += n;
    len -= n;
  }
  return 0;
}

/* Sends c: its socket, identity, unparsed input, unsent output and the fds
 * that go with that output. */
static int send_conn(chan *ch, td__conn *c) {
  const td__wire *w = &c->wire;
  uint64_t base = w->out_pos + w->out_off;
  Tensord__Handover__Conn m = TENSORD__HANDOVER__CONN__INIT;
  m.index = c->hindex;
  m.hello = c->hello;
  m.name = c->name;
  m.pid = c->hold.peer.pid;
  m.uid = c->hold.peer.uid;
  m.gid = c->hold.peer.gid;
  m.eof = c->eof;
  m.requests = c->nrequests;
  m.watching = c->watching;
  m.watch_seq = c->watch_seq;
  m.watch_prefix.data = (uint8_t *)c->watch_prefix;
  m.watch_prefix.len = c->watch_prefix_len;
  m.watch_dropped = c->watch_dropped;
  m.input_len = w->in_len - w->in_off;
  m.output_len = w->out_len - w->out_off;
  m.fd_frontier = w->fd_frontier > base ? w->fd_frontier - base : 0;
  uint32_t groups[c->hold.ngroups + 1];
  for (int i = 0; i < c->hold.ngroups; i++)
    groups[i] = c->hold.groups[i];
  m.n_groups = (size_t)c->hold.ngroups;
  m.groups = groups;
  Tensord__Handover__QueuedFd q[w->out_nfds + 1];
  Tensord__Handover__QueuedFd *qp[w->out_nfds + 1];
  int fds[w->out_nfds + 1];
  fds[0] = w->fd;
  for (unsigned i = 0; i < w->out_nfds; i++) {
    tensord__handover__queued_fd__init(&q[i]);
    q[i].pos = w->out_fds[i].pos - base;
    q[i].end = w->out_fds[i].end - base;
    qp[i] = &q[i];
    fds[i + 1] = w->out_fds[i].fd;
  }
  m.n_out_fds = w->out_nfds;
  m.out_fds = qp;
  Packet p = TENSORD__HANDOVER__PACKET__INIT;
  p.body_case = TENSORD__HANDOVER__PACKET__BODY_CONN;
  p.conn = &m;
  int err = chan_send(ch, &p, fds, w->out_nfds + 1);
  if (err == 0)
    err = send_bytes(ch, c->hindex, 0, w->in + w->in_off, m.input_len);
  if (err == 0)
    err = send_bytes(ch, c->hindex, 1, w->out + w->out_off, m.output_len);
  return err;
}

/* Sends m, a message of one list (Storages, Pool, Scopes, Keys, Waiters), as
 * packets of type body, a new one after each BATCH_BYTES of entries. */
static int send_batches(chan *ch, int body, ProtobufCMessage *m) {
  const ProtobufCFieldDescriptor *f = &m->descriptor->fields[0];
  size_t *count = (size_t *)((char *)m + f->quantifier_offset);
  void ***list = (void ***)((char *)m + f->offset);
  size_t all = *count;
  void **first = *list;
  int err = 0;
  for (size_t i = 0, j; i < all && err == 0; i = j) {
    size_t bytes = 0;
    for (j = i; j < all && bytes < BATCH_BYTES; j++)
      bytes += protobuf_c_message_get_packed_size(first[j]);
    *count = j - i;
    *list = first + i;
    err = send_body(ch, body, m);
  }
  *count = all;
  *list = first;
  return err;
}

/* Adds a waiter to Waiters arg, whose pointers to its messages are followed
 * by room for one message per waiter of the server. */
static int put_waiter(void *arg, td__conn *c, const char *key, size_t len,
                      const td__lookup_args *a, int32_t wait_ms,
                      int64_t deadline_ms) {
  Tensord__Handover__Waiters *ws = arg;
  size_t cap = c->srv->waits.count, i = ws->n_waiters;
  if (!handed(c->srv->upgrade, c) || i == cap)
    return 0; /* refused earlier, or not counted: cannot happen */
  Tensord__Handover__Waiter *e =
      (Tensord__Handover__Waiter *)(ws->waiters + cap) + i;
  tensord__handover__waiter__init(e);
  e->conn = c->hindex;
  e->key.data = (uint8_t *)key;
  e->key.len = len;
  e->seq = a->seq;
  e->readonly = a->readonly;
  e->take = a->take;
  e->force_fd = a->force_fd;
  e->wait_ms = wait_ms;
  e->deadline_ms = deadline_ms;
  ws->waiters[ws->n_waiters++] = e;
  return 0;
}

/* Reads the new side's answer to what it was sent. Returns 0 if it is of
 * kind want (what names it); else a negative code, with why in msg:
 * TD_ETIMEDOUT once the channel's deadline has passed. */
static int expect(chan *ch, int want, const char *what, Packet **out, char *msg,
                  size_t len) {
  Packet *p = NULL;
  int err = chan_recv(ch, &p);
  if (err == TD_ETIMEDOUT) {
    snprintf(msg, len,
             "the new tensord sent no %s within --upgrade-timeout %llu ms",
             what, (unsigned long long)ch->limit_ms);
    return err;
  }
  if (err < 0) {
    snprintf(msg, len, "%s",
             err == TD_ECONNRESET ? "the new tensord closed the handover"
             : err == TD_EPROTO   ? "the new tensord sent a garbled packet"
                                  : td_strerror(err));
    return err;
  }
  if (p->body_case == TENSORD__HANDOVER__PACKET__BODY_REFUSE) {
    snprintf(msg, len, "%s", p->refuse->message);
    tensord__handover__packet__free_unpacked(p, NULL);
    return TD_EPROTONOSUPPORT;
  }
  if ((int)p->body_case != want) {
    snprintf(msg, len, "the new tensord sent packet type %d, not %s (%d)",
             (int)p->body_case, what, want);
    tensord__handover__packet__free_unpacked(p, NULL);
    return TD_EPROTO;
  }
  if (out != NULL)
    *out = p;
  else
    tensord__handover__packet__free_unpacked(p, NULL);
  return 0;
}

/* The CUDA storages srv has: none may be handed over. */
static uint64_t cuda_storages(const td__server *srv) {
  uint64_t n = 0;
  for (const td__storage *s = srv->reg.first; s != NULL; s = s->next)
    n += s->device != TD_CPU;
  return n;
}

/* Says why sending failed (err) in msg: what was being sent, or that the
 * deadline passed first. Returns err. */
static int send_failed(const chan *ch, int err, const char *what, char *msg,
                       size_t len) {
  if (err == TD_ETIMEDOUT)
    snprintf(msg, len,
             "the new tensord did not take %s within --upgrade-timeout %llu "
             "ms",
             what, (unsigned long long)ch->limit_ms);
  else
    snprintf(msg, len, "sending %s: %s", what, td_strerror(err));
  return err;
}

/* The whole handover, from the old side, on a quiet daemon, within
 * srv->upgrade_timeout_ms: it blocks the loop, and the clients wait. Returns
 * 0 once the new side has started (we must exit now), or a negative code
 * with why in msg (we serve on). */
static int hand_over(td__upgrade *u, char *msg, size_t msglen) {
  td__server *srv = u->srv;
  chan ch;
  td__handover_conn *hc = malloc((srv->nconns + 1) * sizeof(*hc));
  Tensord__Handover__Waiters ws = TENSORD__HANDOVER__WAITERS__INIT;
  int err = hc ? chan_init(&ch, u->fd, -1) : TD_ENOMEM;
  if (err < 0) {
    free(hc);
    snprintf(msg, msglen, "out of memory");
    return err;
  }
  stall("quiesced");
  /* Every step from here to Started, whatever the new side does or fails
   * to do: past the deadline we serve on. */
  chan_deadline(&ch, srv->upgrade_timeout_ms);
  /* may_upgrade counted those of the registry; a CUDA create that was on
   * the thread pool then has landed since. */
  uint64_t cuda = cuda_storages(srv);
  if (cuda > 0) {
    snprintf(msg, msglen,
             "%llu CUDA storages are live (made while the upgrade waited "
             "for creates in flight); upgrade them away first (a GPU "
             "allocation cannot be handed to another process)",
             (unsigned long long)cuda);
    err = TD_EBUSY;
    goto out;
  }
  Tensord__Handover__Begin b = TENSORD__HANDOVER__BEGIN__INIT;
  b.version = TD__HANDOVER_VERSION;
  b.min_version = TD__HANDOVER_MIN_VERSION;
  b.daemon_version = (char *)TD_VERSION_STRING;
  b.pid = (int32_t)getpid();
  Packet *p = NULL;
  err = send_body(&ch, TENSORD__HANDOVER__PACKET__BODY_BEGIN, &b);
  if (err < 0) {
    send_failed(&ch, err, "Begin", msg, msglen);
    goto out;
  }
  err = expect(&ch, TENSORD__HANDOVER__PACKET__BODY_ACCEPT, "Accept", &p, msg,
               msglen);
  if (err < 0)
    goto out;
  u->new_pid = p->accept->pid;
  snprintf(u->new_version, sizeof(u->new_version), "%s",
           p->accept->daemon_version);
  uint32_t version = p->accept->version;
  tensord__handover__packet__free_unpacked(p, NULL);
  if (version < TD__HANDOVER_MIN_VERSION || version > TD__HANDOVER_VERSION) {
    snprintf(msg, msglen,
             "the new tensord %s (pid %d) accepted handover version %u; this "
             "tensord speaks %u..%u",
             u->new_version, u->new_pid, (unsigned)version,
             TD__HANDOVER_MIN_VERSION, TD__HANDOVER_VERSION);
    err = TD_EPROTONOSUPPORT;
    goto out;
  }
  /* A successor that predates channels would drop them, and their
   * references with them: never hand them to it. */
  if (version < TD__HANDOVER_CHANNELS && srv->chans.n > 0) {
    snprintf(msg, msglen,
             "the new tensord %s (pid %d) speaks handover version %u, which "
             "does not carry channels, and %llu channel(s) are open: close "
             "them first, or upgrade to a tensord that speaks version %u",
             u->new_version, u->new_pid, (unsigned)version,
             (unsigned long long)srv->chans.n, TD__HANDOVER_CHANNELS);
    err = TD_EPROTONOSUPPORT;
    goto out;
  }
  td__info("upgrade: handing over to tensord %s (pid %d, handover version "
           "%u)",
           u->new_version, u->new_pid, (unsigned)version);

  Tensord__Handover__End end = TENSORD__HANDOVER__END__INIT;
  err = send_options(u, &ch);
  /* Connections last first: the new side prepends each to its list. */
  td__conn *tail = srv->conns;
  while (tail != NULL && tail->next != NULL)
    tail = tail->next;
  uint32_t index = 0;
  for (td__conn *c = tail; c != NULL && err == 0; c = c->prev) {
    c->hindex = UINT32_MAX;
    if (handed(u, c)) {
      hc[index] = (td__handover_conn){
          &c->hold, c, &c->scopes, &c->nscopes, &c->chan_ends, &c->nchan_ends};
      c->hindex = index++;
      err = send_conn(&ch, c);
    }
  }
  end.conns = index;
  td__handover h;
  if (err == 0 && (err = td__handover_save(&srv->reg, &srv->pool, &srv->chans,
                                           hc, index, number_of, &h)) == 0) {
    /* Each channel with its ring (a copy of the fd: the ends keep using
     * the ring throughout, and so does this daemon if it serves on). */
    for (size_t i = 0; i < h.nchans && err == 0; i++) {
      Packet cp = TENSORD__HANDOVER__PACKET__INIT;
      cp.body_case = TENSORD__HANDOVER__PACKET__BODY_CHANNEL;
      cp.channel = h.chans[i];
      err = chan_send(&ch, &cp, &h.chan_fds[i], 1);
    }
    /* Ends after the connections and channels they name; tickets after
     * the storages they name. */
    struct {
      int body;
      ProtobufCMessage *m;
    } lists[] = {
        {TENSORD__HANDOVER__PACKET__BODY_CHAN_ENDS, &h.ends.base},
        {TENSORD__HANDOVER__PACKET__BODY_STORAGES, &h.storages.base},
        {TENSORD__HANDOVER__PACKET__BODY_POOL, &h.pool.base},
        {TENSORD__HANDOVER__PACKET__BODY_SCOPES, &h.scopes.base},
        {TENSORD__HANDOVER__PACKET__BODY_KEYS, &h.keys.base},
        {TENSORD__HANDOVER__PACKET__BODY_CHAN_TICKETS, &h.tickets.base}};
    for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]) && err == 0; i++)
      err = send_batches(&ch, lists[i].body, lists[i].m);
    end.storages = h.storages.n_storages;
    end.pooled = h.pool.n_pooled;
    end.scopes = h.scopes.n_scopes;
    end.keys = h.keys.n_keys;
    end.channels = h.nchans;
    end.chan_ends = h.ends.n_ends;
    end.chan_tickets = h.tickets.n_tickets;
    td__handover_free(&h);
  }
  if (err == 0) {
    ws.waiters =
        malloc(srv->waits.count * (sizeof(void *) + sizeof(**ws.waiters)) + 1);
    err = ws.waiters ? td__waits_each(&srv->waits, put_waiter, &ws) : TD_ENOMEM;
    if (err == 0)
      err =
          send_batches(&ch, TENSORD__HANDOVER__PACKET__BODY_WAITERS, &ws.base);
    end.waiters = ws.n_waiters;
  }
  if (err == 0)
    err = send_body(&ch, TENSORD__HANDOVER__PACKET__BODY_END, &end);
  if (err < 0) {
    send_failed(&ch, err, "the state", msg, msglen);
    goto out;
  }
  stall("sent");
  err = expect(&ch, TENSORD__HANDOVER__PACKET__BODY_READY, "Ready", NULL, msg,
               msglen);
  if (err < 0)
    goto out;
  Tensord__Handover__Commit cm = TENSORD__HANDOVER__COMMIT__INIT;
  err = send_body(&ch, TENSORD__HANDOVER__PACKET__BODY_COMMIT, &cm);
  if (err < 0) {
    send_failed(&ch, err, "Commit", msg, msglen);
    goto out;
  }
  stall("committed");
  err = expect(&ch, TENSORD__HANDOVER__PACKET__BODY_STARTED, "Started", NULL,
               msg, msglen);
  if (err == TD_ETIMEDOUT) {
    /* A timeout alone cannot tell a slow new daemon from a dead one: it may
     * be sending Started now. Shutting our receiving side settles it in the
     * kernel: a Started queued before is read below, and one sent after
     * fails (EPIPE), so that its sender finds our Abort and does not serve. */
    shutdown(ch.fd, SHUT_RD);
    char late[256];
    if (expect(&ch, TENSORD__HANDOVER__PACKET__BODY_STARTED, "Started", NULL,
               late, sizeof(late)) == 0)
      err = 0; /* it made it: the new side serves */
  }
  if (err == 0)
    td__info("upgrade: tensord %s (pid %d) serves now: %llu client(s), %llu "
             "storage(s), %llu key(s), %llu waiter(s), %llu channel(s) "
             "handed over",
             u->new_version, u->new_pid, (unsigned long long)end.conns,
             (unsigned long long)end.storages, (unsigned long long)end.keys,
             (unsigned long long)end.waiters, (unsigned long long)end.channels);
out:
  if (err < 0) { /* so that the new side knows we live: best effort */
    Tensord__Handover__Abort ab = TENSORD__HANDOVER__ABORT__INIT;
    ab.message = msg;
    chan_deadline(&ch, 100);
    send_body(&ch, TENSORD__HANDOVER__PACKET__BODY_ABORT, &ab);
  }
  free(hc);
  free(ws.waiters);
  chan_free(&ch);
  return err;
}

/* Answers Upgrade request seq on c with fd (or -1), and the new tensord's
 * pid and version once it has taken over (0 and "" before). */
static void reply(const td__upgrade *u, td__conn *c, uint64_t seq, int fd) {
  Tensord__UpgradeReply m = TENSORD__UPGRADE_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  m.old_pid = (int32_t)getpid();
  m.new_pid = u->new_pid;
  m.old_version = (char *)TD_VERSION_STRING;
  m.new_version = (char *)u->new_version;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_UPGRADE;
  r.upgrade = &m;
  td__conn_send(c, &r, fd);
}

/* Answers tensorctl upgrade, as well as the socket takes it, and exits. */
static void exit_handed_over(td__upgrade *u) {
  td__conn *c = u->asker;
  if (c != NULL && !c->closing) {
    c->in_batch = 1; /* queue only */
    reply(u, c, u->asker_seq, -1);
    for (int i = 0; i < 100 && td__wire_pending(&c->wire) > 0; i++) {
      if (td__wire_flush(&c->wire, MSG_DONTWAIT) != TD_EAGAIN)
        break;
      struct pollfd pf = {c->wire.fd, POLLOUT, 0};
      poll(&pf, 1, 10);
    }
  }
  td__server_notify_pid("", u->new_pid);
  /* No shutdown(2), no unlink: the socket, the connections and the
   * segments are the new tensord's now. The lock on --state-dir is shared
   * with it (one open file), so it stays held. */
  _exit(0);
}

/* Once a loop turn while quiescing: hands over as soon as nothing is in
 * flight. */
static void on_quiet_check(uv_check_t *h) {
  td__upgrade *u = h->data;
  td__server *srv = u->srv;
  if (srv->pending_work > 0 || srv->drains != NULL || srv->unlinks != NULL ||
      !td__state_quiet(srv->state))
    return;
  uv_check_stop(h);
  char msg[512] = "";
  int err = hand_over(u, msg, sizeof(msg));
  if (err == 0)
    exit_handed_over(u);
  td__warn("upgrade: %s; serving on", msg);
  fail_asker(u,
             err == TD_EPROTONOSUPPORT || err == TD_EBUSY || err == TD_ETIMEDOUT
                 ? err
                 : TD_EIO,
             msg);
  upgrade_free(u);
  resume(srv);
}

/* Checks what the asker and the daemon's state allow. Returns 0, or the
 * refusal's code (its Error sent). */
static int may_upgrade(td__conn *c, uint64_t seq) {
  td__server *srv = c->srv;
  uid_t me = geteuid();
  /* One set up without a socket (td__server_init: the unit tests, the fuzz
   * targets) has nothing to hand over, and must never block on a pair. */
  if (!srv->listening)
    return td__conn_error(c, seq, TD_ENOSYS,
                          "upgrade: this tensord serves no socket of its own "
                          "to hand over");
  if (c->hold.peer.uid != me && c->hold.peer.uid != 0)
    return td__conn_error(c, seq, TD_EPERM,
                          "upgrade: client %d runs as uid %u; only tensord's "
                          "uid %u or root may upgrade it",
                          (int)c->hold.peer.pid, (unsigned)c->hold.peer.uid,
                          (unsigned)me);
  if (srv->stopping)
    return td__conn_error(c, seq, TD_ECANCELED, "upgrade: tensord is stopping");
  if (c->hold.nrefs > 0 || c->nwaiters > 0 || c->nscopes > 0 ||
      c->ncreates > 0 || c->nchan_ends > 0)
    return td__conn_error(c, seq, TD_EBUSY,
                          "upgrade: this connection holds %llu reference(s), "
                          "%u waiting lookup(s), %u scope(s) and %u channel "
                          "end(s); ask from one that holds nothing",
                          (unsigned long long)c->hold.nrefs, c->nwaiters,
                          c->nscopes, c->nchan_ends);
  uint64_t cuda = cuda_storages(srv);
  if (cuda > 0)
    return td__conn_error(c, seq, TD_EBUSY,
                          "upgrade: %llu CUDA storages are live; upgrade them "
                          "away first (a GPU allocation cannot be handed to "
                          "another process)",
                          (unsigned long long)cuda);
  return 0;
}

/* Returns argv without --upgrade, then extra, in an array to free (the
 * strings are argv's), or NULL. */
static char **without_upgrade(char *const *argv, char *extra) {
  size_t n = 0, j = 0;
  while (argv[n] != NULL)
    n++;
  char **args = calloc(n + 2, sizeof(char *));
  for (size_t i = 0; args != NULL && i < n; i++)
    if (strcmp(argv[i], "--upgrade") != 0)
      args[j++] = argv[i];
  if (args != NULL)
    args[j] = extra;
  return args;
}

static void on_proc_closed(uv_handle_t *h) {
  free(h);
}

static void on_child_exit(uv_process_t *p, int64_t status, int signum) {
  td__server *srv = p->data;
  td__upgrade *u = srv ? srv->upgrade : NULL;
  if (u != NULL && u->proc == p) {
    u->proc = NULL;
    if (u->fd < 0) { /* it never asked for the channel */
      char msg[512], how[64];
      if (signum)
        snprintf(how, sizeof(how), "was killed by signal %d", signum);
      else
        snprintf(how, sizeof(how), "exited with status %lld",
                 (long long)status);
      snprintf(msg, sizeof(msg),
               "the new tensord (pid %d, %s) %s before the handover began",
               u->child_pid, u->binary, how);
      td__warn("upgrade: %s; serving on", msg);
      fail_asker(u, TD_EIO, msg);
      upgrade_free(u);
    }
  }
  uv_close((uv_handle_t *)p, on_proc_closed);
}

/* tensorctl upgrade: starts the new tensord, which asks for the channel
 * itself; the asker is answered at the end. */
static int spawn_new(td__conn *c, uint64_t seq, const Tensord__Upgrade *m) {
  td__server *srv = c->srv;
  const char *binary = m->binary && m->binary[0] ? m->binary : srv->binary;
  if (binary == NULL || srv->argv == NULL)
    return td__conn_error(c, seq, TD_EINVAL,
                          "upgrade: this tensord does not know the binary it "
                          "was started from; give one (--binary)");
  char **args = without_upgrade(srv->argv, "--upgrade");
  td__upgrade *u = calloc(1, sizeof(*u));
  uv_process_t *p = calloc(1, sizeof(*p));
  if (args == NULL || u == NULL || p == NULL) {
    free(args);
    free(u);
    free(p);
    return td__conn_error(c, seq, TD_ENOMEM, "upgrade: out of memory");
  }
  uv_stdio_container_t stdio[3];
  for (int i = 0; i < 3; i++) {
    stdio[i].flags = UV_INHERIT_FD;
    stdio[i].data.fd = i;
  }
  uv_process_options_t po = {0};
  po.file = binary;
  po.args = args;
  po.exit_cb = on_child_exit;
  po.flags = UV_PROCESS_DETACHED;
  po.stdio_count = 3;
  po.stdio = stdio;
  p->data = srv;
  int err = uv_spawn(srv->loop, p, &po);
  free(args);
  if (err < 0) {
    uv_close((uv_handle_t *)p, on_proc_closed);
    free(u);
    return td__conn_error(c, seq, TD_ENOENT, "upgrade: cannot run %s: %s",
                          binary, uv_strerror(err));
  }
  u->srv = srv;
  u->fd = -1;
  u->asker = c;
  u->asker_seq = seq;
  u->proc = p;
  u->child_pid = p->pid;
  snprintf(u->binary, sizeof(u->binary), "%s", binary);
  srv->upgrade = u;
  td__info("upgrade: client %d asks for it; started %s as pid %d",
           (int)c->hold.peer.pid, binary, p->pid);
  return 0;
}

int td__upgrade_request(td__conn *c, uint64_t seq, const Tensord__Upgrade *m) {
  td__server *srv = c->srv;
  if (may_upgrade(c, seq) < 0)
    return 0;
  td__upgrade *u = srv->upgrade;
  if (m->spawn) {
    if (u != NULL)
      return td__conn_error(c, seq, TD_EBUSY,
                            "upgrade: one is in progress already");
    return spawn_new(c, seq, m);
  }
  if (u != NULL && (u->fd >= 0 || u->channel != NULL))
    return td__conn_error(c, seq, TD_EBUSY,
                          "upgrade: one is in progress already");
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
    return td__conn_error(c, seq, -errno, "upgrade: socketpair: %s",
                          strerror(errno));
  if (u == NULL) {
    u = calloc(1, sizeof(*u));
    if (u == NULL) {
      close(sv[0]);
      close(sv[1]);
      return td__conn_error(c, seq, TD_ENOMEM, "upgrade: out of memory");
    }
    u->srv = srv;
    srv->upgrade = u;
  }
  u->fd = sv[0];
  u->channel = c;
  uv_check_init(srv->loop, &u->check);
  u->check_ready = 1;
  u->check.data = u;
  td__info("upgrade: tensord pid %d (handover version %u) takes over; "
           "quiescing",
           (int)m->pid, m->handover_version);
  reply(u, c, seq, sv[1]);
  /* Nothing more is read or accepted: requests wait in the kernel's
   * buffers for whichever daemon serves next. */
  srv->quiesced = 1;
  td__server_accepting(srv, 0);
  for (td__conn *o = srv->conns; o != NULL; o = o->next)
    if (o != c)
      td__conn_quiesce(o);
  uv_check_start(&u->check, on_quiet_check);
  return 0;
}

int td__upgrade_asked(const td__conn *c) {
  const td__upgrade *u = c->srv->upgrade;
  return u != NULL && (u->asker == c || u->channel == c);
}

void td__upgrade_conn_gone(td__conn *c) {
  td__upgrade *u = c->srv->upgrade;
  if (u == NULL)
    return;
  if (u->asker == c)
    u->asker = NULL;
  if (u->channel == c)
    u->channel = NULL;
}

void td__upgrade_stop(td__server *srv) {
  td__upgrade *u = srv->upgrade;
  if (u == NULL)
    return;
  fail_asker(u, TD_ECANCELED, "tensord is stopping");
  upgrade_free(u);
  srv->quiesced = 0;
}

/* ---- the new side ---- */

/* What the new side has rebuilt so far. */
typedef struct taking {
  td__server *srv;
  chan ch;
  td__handover_conn *conns; /* each owner is the td__conn */
  uint64_t (*left)[2];      /* ConnBytes due per connection: input, output */
  size_t nconns, cap;
  int dirfd, lockfd;
  uint64_t state_gen;
  int has_state;
  int metrics_fd; /* --metrics's listening socket, or -1 */
  int metrics_tcp;
  char metrics_path[108], metrics_where[128];
  uint64_t metrics_timeout_ms;
  uint64_t chan_ends, chan_tickets; /* received (End checks them) */
  char msg[512];
} taking;

static int fail(taking *t, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(taking *t, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->msg, sizeof(t->msg), fmt, ap);
  va_end(ap);
  return code;
}

/* Copies arrays by index, as far as both sides have them; the histogram
 * only if its buckets have the same bounds here. */
static void take_counters(td__metrics *m,
                          const Tensord__Handover__Counters *k) {
  for (size_t i = 0; i < k->n_requests && i < TD__METRIC_TYPES; i++)
    m->requests[i] = k->requests[i];
  for (size_t i = 0; i < k->n_errors && i < TD__METRIC_CODES; i++)
    m->errors[i] = k->errors[i];
  if (k->n_latency_bounds_ns == TD__METRIC_BUCKETS &&
      k->n_latency == TD__METRIC_BUCKETS + 1 &&
      memcmp(k->latency_bounds_ns, td__metric_bounds_ns,
             sizeof(td__metric_bounds_ns)) == 0) {
    memcpy(m->latency, k->latency, sizeof(m->latency));
    m->latency_sum_ns = k->latency_sum_ns;
    m->latency_count = k->latency_count;
  }
  m->lookup_waits = k->lookup_waits;
  m->connects = k->connects;
  m->disconnects = k->disconnects;
  m->storages_created = k->storages_created;
  m->bytes_created = k->bytes_created;
  m->journal_syncs = k->journal_syncs;
  m->scrapes = k->scrapes;
}

static int take_options(taking *t, const Tensord__Handover__Options *o) {
  td__server *srv = t->srv;
  srv->listen_fd = chan_fd(&t->ch);
  if (srv->listen_fd < 0)
    return fail(t, TD_EPROTO, "Options came without the listening socket");
  if (o->has_state) {
    t->has_state = 1;
    t->dirfd = chan_fd(&t->ch);
    t->lockfd = chan_fd(&t->ch);
    t->state_gen = o->state_gen;
    if (t->lockfd < 0)
      return fail(t, TD_EPROTO, "Options came without the state directory");
  }
  if (o->has_metrics) {
    t->metrics_fd = chan_fd(&t->ch);
    if (t->metrics_fd < 0)
      return fail(t, TD_EPROTO, "Options came without the metrics socket");
  }
  td__registry_init(&srv->reg, o->capacity, td__storage_gone, srv);
  srv->reg.quota = o->quota;
  srv->reg.next_id = o->next_id;
  if (o->next_chan_id > 0) /* 0: from a tensord that predates channels */
    srv->chans.next_id = o->next_chan_id;
  srv->max_clients = o->max_clients;
  srv->max_storages_per_client = o->max_storages_per_client;
  srv->max_waiters_per_client = o->max_waiters_per_client;
  srv->max_keys_per_uid = o->max_keys_per_uid;
  srv->io_timeout_ms = o->io_timeout_ms;
  srv->upgrade_timeout_ms =
      o->upgrade_timeout_ms ? o->upgrade_timeout_ms : TD__UPGRADE_TIMEOUT_MS;
  snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", o->socket_path);
  srv->own_socket = o->own_socket;
  snprintf(srv->state_dir, sizeof(srv->state_dir), "%s", o->state_dir);
  snprintf(srv->run_path, sizeof(srv->run_path), "%s", o->run_path);
  srv->instance = o->instance;
  snprintf(srv->prefix, sizeof(srv->prefix), "%s", o->prefix);
  srv->start_ms = o->start_ms;
  td__pool_init(&srv->pool, o->recycle_bytes, o->recycle_idle_ms, o->instance);
  srv->pool.next_seq = o->pool_next_seq;
  srv->pool.hits = o->pool_hits;
  srv->pool.misses = o->pool_misses;
  if (o->n_prev_prefixes > 0) {
    srv->prev = calloc(o->n_prev_prefixes, sizeof(*srv->prev));
    if (srv->prev == NULL)
      return fail(t, TD_ENOMEM, "out of memory");
    for (size_t i = 0; i < o->n_prev_prefixes; i++)
      snprintf(srv->prev[i], sizeof(srv->prev[i]), "%s", o->prev_prefixes[i]);
    srv->nprev = o->n_prev_prefixes;
  }
  if (o->n_prefixes > 0) {
    srv->prefixes = calloc(o->n_prefixes, sizeof(*srv->prefixes));
    if (srv->prefixes == NULL)
      return fail(t, TD_ENOMEM, "out of memory");
    for (size_t i = 0; i < o->n_prefixes; i++)
      snprintf(srv->prefixes[i], sizeof(srv->prefixes[i]), "%s",
               o->prefixes[i]);
    srv->nprefixes = o->n_prefixes;
  }
  if (o->counters != NULL)
    take_counters(&srv->metrics, o->counters);
  if (o->has_metrics) {
    t->metrics_tcp = o->metrics_tcp;
    snprintf(t->metrics_path, sizeof(t->metrics_path), "%s", o->metrics_path);
    snprintf(t->metrics_where, sizeof(t->metrics_where), "%s",
             o->metrics_where);
    t->metrics_timeout_ms = o->metrics_timeout_ms;
  }
  return 0;
}

static int take_conn(taking *t, const Tensord__Handover__Conn *m) {
  td__server *srv = t->srv;
  if (m->index != t->nconns)
    return fail(t, TD_EPROTO, "connection %u came as number %zu", m->index,
                t->nconns);
  if (t->nconns == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    td__handover_conn *c = realloc(t->conns, cap * sizeof(*c));
    if (c != NULL)
      t->conns = c;
    uint64_t(*a)[2] = realloc(t->left, cap * sizeof(*a));
    if (a != NULL)
      t->left = a;
    if (c == NULL || a == NULL)
      return fail(t, TD_ENOMEM, "out of memory");
    t->cap = cap;
  }
  int fd = chan_fd(&t->ch);
  if (fd < 0)
    return fail(t, TD_EPROTO, "connection %u came without its socket",
                m->index);
  gid_t *groups = NULL;
  if (m->n_groups > 0) {
    groups = malloc(m->n_groups * sizeof(gid_t));
    if (groups == NULL) {
      close(fd);
      return fail(t, TD_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < m->n_groups; i++)
      groups[i] = m->groups[i];
  }
  td__peer peer = {m->pid, m->uid, m->gid};
  td__conn *c = td__conn_adopt(srv, fd, &peer, groups, (int)m->n_groups);
  if (c == NULL)
    return fail(t, TD_ENOMEM, "out of memory");
  c->hindex = m->index;
  c->hello = m->hello;
  c->eof = m->eof;
  snprintf(c->name, sizeof(c->name), "%s", m->name);
  c->nrequests = m->requests;
  if (m->watching) {
    if (m->watch_prefix.len > TD_KEY_MAX)
      return fail(t, TD_EPROTO, "connection %u watches a prefix of %zu bytes",
                  m->index, m->watch_prefix.len);
    td__watch_start(c, m->watch_seq, m->watch_prefix.data, m->watch_prefix.len);
    c->watch_dropped = m->watch_dropped;
  }
  t->conns[t->nconns] = (td__handover_conn){
      &c->hold, c, &c->scopes, &c->nscopes, &c->chan_ends, &c->nchan_ends};
  t->left[t->nconns][0] = m->input_len;
  t->left[t->nconns][1] = m->output_len;
  t->nconns++;
  td__wire *w = &c->wire;
  if (m->input_len > TD__FRAME_HDR + TD__FRAME_MAX ||
      m->output_len > ((uint64_t)1 << 32))
    return fail(t, TD_EPROTO, "connection %u: %llu bytes in, %llu out",
                m->index, (unsigned long long)m->input_len,
                (unsigned long long)m->output_len);
  w->in_cap = m->input_len > 65536 ? m->input_len : 65536;
  w->out_cap = m->output_len > 4096 ? m->output_len : 4096;
  w->in = malloc(w->in_cap);
  w->out = malloc(w->out_cap);
  w->out_fds = m->n_out_fds ? calloc(m->n_out_fds, sizeof(*w->out_fds)) : NULL;
  if (w->in == NULL || w->out == NULL || (m->n_out_fds && !w->out_fds))
    return fail(t, TD_ENOMEM, "out of memory");
  w->out_fds_cap = (unsigned)m->n_out_fds;
  for (size_t i = 0; i < m->n_out_fds; i++) {
    int ofd = chan_fd(&t->ch);
    if (ofd < 0)
      return fail(t, TD_EPROTO, "connection %u: its queued fds are missing",
                  m->index);
    w->out_fds[i].fd = ofd;
    w->out_fds[i].pos = m->out_fds[i]->pos;
    w->out_fds[i].end = m->out_fds[i]->end;
    w->out_nfds++;
  }
  w->fd_frontier = m->fd_frontier;
  return 0;
}

static int take_bytes(taking *t, const Tensord__Handover__ConnBytes *m) {
  if (m->conn >= t->nconns)
    return fail(t, TD_EPROTO, "bytes for connection %u of %zu", m->conn,
                t->nconns);
  uint64_t *left = &t->left[m->conn][m->output != 0];
  if (m->data.len > *left)
    return fail(t, TD_EPROTO, "connection %u: more bytes than announced",
                m->conn);
  td__wire *w = &((td__conn *)t->conns[m->conn].owner)->wire;
  if (m->output) {
    memcpy(w->out + w->out_len, m->data.data, m->data.len);
    w->out_len += m->data.len;
  } else {
    memcpy(w->in + w->in_len, m->data.data, m->data.len);
    w->in_len += m->data.len;
  }
  *left -= m->data.len;
  return 0;
}

static int take_waiters(taking *t, const Tensord__Handover__Waiters *b) {
  for (size_t i = 0; i < b->n_waiters; i++) {
    const Tensord__Handover__Waiter *m = b->waiters[i];
    if (m->conn >= t->nconns || m->key.len == 0 || m->key.len > TD_KEY_MAX)
      return fail(t, TD_EPROTO, "waiter of connection %u of %zu", m->conn,
                  t->nconns);
    td__lookup_args a = {m->seq, m->readonly, m->take, m->force_fd};
    int err =
        td__wait_restore(t->conns[m->conn].owner, (const char *)m->key.data,
                         m->key.len, &a, m->wait_ms, m->deadline_ms);
    if (err < 0)
      return fail(t, err, "waiter: %s", td_strerror(err));
  }
  return 0;
}

/* Checks what came against what End says was sent. */
static int take_end(taking *t, const Tensord__Handover__End *m) {
  td__server *srv = t->srv;
  for (size_t i = 0; i < t->nconns; i++)
    if (t->left[i][0] || t->left[i][1])
      return fail(t, TD_EPROTO, "connection %zu: bytes missing", i);
  for (const td__storage *s = srv->reg.first; s != NULL; s = s->next)
    if (s->refs == 0)
      return fail(t, TD_EPROTO, "storage %llu came with no reference",
                  (unsigned long long)s->id);
  if (m->conns != t->nconns || m->storages != srv->reg.storages.count ||
      m->keys != srv->reg.keys.count || m->waiters != srv->waits.count ||
      m->scopes != srv->reg.scopes.count || m->pooled != srv->pool.count)
    return fail(t, TD_EPROTO,
                "sent %llu connections, %llu storages, %llu keys, %llu "
                "waiters; rebuilt %zu, %zu, %zu, %llu",
                (unsigned long long)m->conns, (unsigned long long)m->storages,
                (unsigned long long)m->keys, (unsigned long long)m->waiters,
                t->nconns, srv->reg.storages.count, srv->reg.keys.count,
                (unsigned long long)srv->waits.count);
  if (m->channels != srv->chans.n || m->chan_ends != t->chan_ends ||
      m->chan_tickets != t->chan_tickets)
    return fail(
        t, TD_EPROTO,
        "sent %llu channels, %llu ends, %llu tickets; rebuilt %llu, "
        "%llu, %llu",
        (unsigned long long)m->channels, (unsigned long long)m->chan_ends,
        (unsigned long long)m->chan_tickets, (unsigned long long)srv->chans.n,
        (unsigned long long)t->chan_ends, (unsigned long long)t->chan_tickets);
  int err = td__handover_check(&srv->chans, t->msg, sizeof(t->msg));
  return err;
}

/* Receives and rebuilds everything up to End. Returns 0 or a negative code
 * with why in t->msg. */
static int take_all(taking *t) {
  for (;;) {
    Packet *p = NULL;
    int err = chan_recv(&t->ch, &p);
    if (err < 0)
      return fail(t, err, "receiving the state: %s", td_strerror(err));
    int done = 0;
    switch (p->body_case) {
    case TENSORD__HANDOVER__PACKET__BODY_OPTIONS:
      err = take_options(t, p->options);
      break;
    case TENSORD__HANDOVER__PACKET__BODY_CONN:
      err = take_conn(t, p->conn);
      break;
    case TENSORD__HANDOVER__PACKET__BODY_CONN_BYTES:
      err = take_bytes(t, p->conn_bytes);
      break;
    case TENSORD__HANDOVER__PACKET__BODY_WAITERS:
      err = take_waiters(t, p->waiters);
      break;
    case TENSORD__HANDOVER__PACKET__BODY_CHANNEL:
      err = td__handover_take_chan(&t->srv->chans, p->channel, chan_fd(&t->ch),
                                   t->msg, sizeof(t->msg));
      break;
    case TENSORD__HANDOVER__PACKET__BODY_END:
      err = take_end(t, p->end);
      done = 1;
      break;
    case TENSORD__HANDOVER__PACKET__BODY_ABORT:
      err = fail(t, TD_ECANCELED, "%s", p->abort->message);
      break;
    default: /* the engine's lists; it refuses any other packet */
      if (p->body_case == TENSORD__HANDOVER__PACKET__BODY_CHAN_ENDS)
        t->chan_ends += p->chan_ends->n_ends;
      if (p->body_case == TENSORD__HANDOVER__PACKET__BODY_CHAN_TICKETS)
        t->chan_tickets += p->chan_tickets->n_tickets;
      err = td__handover_take(&t->srv->reg, &t->srv->pool, &t->srv->chans,
                              t->conns, t->nconns, p, t->msg, sizeof(t->msg));
    }
    tensord__handover__packet__free_unpacked(p, NULL);
    if (err < 0 || done)
      return err;
  }
}

/* Sends req on w (blocking) and reads its Response. Returns 0 with *out
 * and its fd in *fd (or -1), or a negative code. */
static int rpc(td__wire *w, const Tensord__Request *req,
               Tensord__Response **out, int *fd) {
  size_t len = tensord__request__get_packed_size(req);
  uint8_t *b = td__wire_reserve(w, len);
  if (b == NULL)
    return TD_ENOMEM;
  tensord__request__pack(req, b);
  int err = td__wire_commit(w, len, NULL, 0);
  if (err == 0)
    err = td__wire_flush(w, 0);
  if (err < 0)
    return err;
  td__frame f;
  while ((err = td__wire_frame(w, &f)) == 0) {
    ssize_t n = td__wire_recv(w, 0);
    if (n == 0)
      return TD_ECONNRESET;
    if (n < 0)
      return (int)n;
  }
  if (err < 0)
    return err;
  *out = tensord__response__unpack(NULL, f.len, f.data);
  *fd = f.nfds > 0 ? f.fds[0] : -1;
  for (unsigned i = 1; i < f.nfds; i++)
    close(f.fds[i]);
  td__wire_consume(w, &f);
  if (*out == NULL) {
    if (*fd >= 0)
      close(*fd);
    return TD_EPROTO;
  }
  return 0;
}

/* Connects to the running daemon on path, checks it is ours, and asks it
 * for the handover channel. Returns the channel's fd, or a negative code
 * after printing why. */
static int ask(const char *path, uint32_t version, pid_t *old_pid) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof(sa.sun_path)) {
    fprintf(stderr, "tensord: --upgrade: socket path %s is too long\n", path);
    return TD_ENAMETOOLONG;
  }
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
    int err = -errno;
    fprintf(stderr,
            "tensord: --upgrade: no tensord serves %s (%s); start one "
            "without --upgrade\n",
            path, strerror(errno));
    if (fd >= 0)
      close(fd);
    return err;
  }
  struct ucred cred;
  socklen_t cl = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0) {
    int e = errno;
    fprintf(stderr, "tensord: --upgrade: who runs the daemon on %s: %s\n", path,
            strerror(e));
    close(fd);
    return -e;
  }
  if (cred.uid != geteuid() && cred.uid != 0) {
    fprintf(stderr,
            "tensord: --upgrade: the daemon on %s runs as uid %u, not as "
            "this uid %u or root; not asking it\n",
            path, (unsigned)cred.uid, (unsigned)geteuid());
    close(fd);
    return TD_EPERM;
  }
  struct timeval tv = {30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  td__wire w;
  td__wire_init(&w, fd);
  Tensord__Hello h = TENSORD__HELLO__INIT;
  Tensord__Upgrade up = TENSORD__UPGRADE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  Tensord__Response *r = NULL;
  h.version = TD_PROTOCOL_VERSION;
  h.client_name = "tensord --upgrade";
  req.seq = 1;
  req.body_case = TENSORD__REQUEST__BODY_HELLO;
  req.hello = &h;
  int cfd = -1;
  int err = rpc(&w, &req, &r, &cfd);
  if (err == 0 && r->body_case == TENSORD__RESPONSE__BODY_HELLO) {
    tensord__response__free_unpacked(r, NULL);
    r = NULL;
    if (cfd >= 0)
      close(cfd);
    up.handover_version = version;
    up.pid = (int32_t)getpid();
    req.seq = 2;
    req.body_case = TENSORD__REQUEST__BODY_UPGRADE;
    req.upgrade = &up;
    err = rpc(&w, &req, &r, &cfd);
  }
  if (err < 0) {
    fprintf(stderr, "tensord: --upgrade: talking to the daemon on %s: %s\n",
            path, td_strerror(err));
  } else if (r->body_case == TENSORD__RESPONSE__BODY_ERROR) {
    err = r->error->code < 0 ? r->error->code : TD_EPROTO;
    fprintf(stderr, "tensord: --upgrade: the daemon on %s refused: %s\n", path,
            r->error->message);
  } else if (r->body_case == TENSORD__RESPONSE__BODY_UPGRADE && cfd >= 0) {
    *old_pid = r->upgrade->old_pid;
  } else {
    err = TD_EPROTO;
    fprintf(stderr,
            "tensord: --upgrade: the daemon on %s does not know live "
            "upgrades (reply type %d)\n",
            path, (int)r->body_case);
  }
  if (r != NULL)
    tensord__response__free_unpacked(r, NULL);
  if (err < 0 && cfd >= 0)
    close(cfd);
  /* The connection itself served its purpose: the old daemon drops it. */
  td__wire_free(&w);
  close(fd);
  return err < 0 ? err : cfd;
}

/* The range of handover versions this process speaks: the build's, or N..N
 * with the test hook TENSORD_HANDOVER_VERSION=N. */
static void my_versions(uint32_t *lo, uint32_t *hi) {
  const char *e = getenv("TENSORD_HANDOVER_VERSION");
  *lo = TD__HANDOVER_MIN_VERSION;
  *hi = TD__HANDOVER_VERSION;
  if (e != NULL && *e != '\0') {
    char *end;
    unsigned long v = strtoul(e, &end, 10);
    if (*end == '\0' && v > 0 && v <= UINT32_MAX)
      *lo = *hi = (uint32_t)v;
  }
}

/* Waits until process pid has exited (its fds, the listening socket among
 * them, are closed then), 10 s at most. */
static void wait_gone(pid_t pid) {
  int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (pfd >= 0) {
    struct pollfd p = {pfd, POLLIN, 0};
    while (poll(&p, 1, 10000) < 0 && errno == EINTR)
      ;
    close(pfd);
    return;
  }
  /* No pidfd (before Linux 5.3): look at its state, a zombie being gone. */
  for (int i = 0; i < 1000 && errno != ESRCH; i++) {
    char path[64], st[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
      return;
    char *z = fgets(st, sizeof(st), f) ? strrchr(st, ')') : NULL;
    fclose(f);
    if (z == NULL || z[1] == '\0' || z[2] == 'Z' || z[2] == 'X')
      return;
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* Starts normally instead: this binary (the path resolved at start, else
 * /proc/self/exe) again, with argv without --upgrade. Every fd received is
 * close-on-exec. */
static void start_normally(const char *binary, char **argv, const char *why) {
  td__warn("upgrade: %s; starting normally instead", why);
  char **args = without_upgrade(argv, NULL);
  if (args != NULL)
    execv(binary ? binary : "/proc/self/exe", args);
  td__error("upgrade: cannot start normally: %s", strerror(errno));
  _exit(1);
}

/* The handover broke off before Commit, for err with why in t->msg. If the
 * old daemon died (end of stream), starts normally once it is gone, and
 * does not return; else (it gave up, or sent what this side cannot take,
 * and serves on) returns the exit status. */
static int broken_off(taking *t, char **argv, int err, pid_t old) {
  const char *binary = t->srv->binary;
  if (err == TD_ECONNRESET || err == TD_EPIPE) {
    char why[600];
    snprintf(why, sizeof(why), "the old daemon (pid %d) is gone (%s)", (int)old,
             t->msg);
    wait_gone(old);
    start_normally(binary, argv, why);
  }
  fprintf(stderr,
          "tensord: --upgrade: %s%s; the old daemon (pid %d) serves "
          "on\n",
          err == TD_ECANCELED ? "the old daemon gave the handover up: " : "",
          t->msg, (int)old);
  /* This process exits now: what it took only goes with it (the fds are its
   * own copies; the old daemon's segments and sockets stay untouched), but
   * the buffers of the taking itself go here, not lost with its frame. */
  chan_free(&t->ch);
  free(t->conns);
  free(t->left);
  return 1;
}

/* A send to the old daemon failed with err (what says what it was). Either
 * the old daemon gave the handover up, and its Abort, sent before it closed
 * its end, waits here, or it died. Returns TD_ECANCELED with the Abort's
 * reason in t->msg, or err with what failed. */
static int gave_up(taking *t, int err, const char *what) {
  Packet *p = NULL;
  while (chan_recv(&t->ch, &p) == 0) {
    int aborted = p->body_case == TENSORD__HANDOVER__PACKET__BODY_ABORT;
    if (aborted)
      fail(t, TD_ECANCELED, "%s", p->abort->message);
    tensord__handover__packet__free_unpacked(p, NULL);
    if (aborted)
      return TD_ECANCELED;
  }
  return fail(t, err, "%s: %s", what, td_strerror(err));
}

/* Receives the next packet into *p, of kind want (what names it). Returns
 * 0, or a negative code with why in t->msg: TD_ECANCELED for an Abort,
 * TD_EPROTO for another packet. */
static int await(taking *t, int want, const char *what, Packet **p) {
  int err = chan_recv(&t->ch, p);
  if (err < 0)
    return fail(t, err, "waiting for %s: %s", what, td_strerror(err));
  if ((int)(*p)->body_case == want)
    return 0;
  if ((*p)->body_case == TENSORD__HANDOVER__PACKET__BODY_ABORT)
    err = fail(t, TD_ECANCELED, "%s", (*p)->abort->message);
  else
    err = fail(t, TD_EPROTO, "packet type %d came where %s was due",
               (int)(*p)->body_case, what);
  tensord__handover__packet__free_unpacked(*p, NULL);
  return err;
}

int td__upgrade_start(td__server *srv, uv_loop_t *loop, const td__options *o,
                      char **argv) {
  char path[sizeof(srv->socket_path)];
  const char *sock = o->socket_path;
  if (sock == NULL) {
    if (td_default_socket_path(path, sizeof(path)) < 0) {
      fprintf(stderr, "tensord: default socket path too long\n");
      return 1;
    }
    sock = path;
  }
  uint32_t lo, hi;
  my_versions(&lo, &hi);
  pid_t old_pid = 0;
  int fd = ask(sock, hi, &old_pid);
  if (fd < 0)
    return 1;

  memset(srv, 0, sizeof(*srv));
  srv->loop = loop;
  srv->hooks = td__serving;
  srv->listen_fd = -1;
  srv->argv = o->argv;
  srv->binary = o->binary;
  td__waits_init(&srv->waits);
  td__chans_init(&srv->chans);
  taking t = {0};
  t.srv = srv;
  t.dirfd = t.lockfd = t.metrics_fd = -1;
  /* The old daemon waits for what it has in flight before it begins. */
  if (chan_init(&t.ch, fd, 600000) < 0) {
    fprintf(stderr, "tensord: --upgrade: out of memory\n");
    return 1;
  }
  Packet *p = NULL;
  int err = await(&t, TENSORD__HANDOVER__PACKET__BODY_BEGIN, "Begin", &p);
  if (err < 0)
    return broken_off(&t, argv, err, old_pid);
  const Tensord__Handover__Begin *b = p->begin;
  uint32_t v = b->version < hi ? b->version : hi;
  uint32_t need = b->min_version > lo ? b->min_version : lo;
  if (v < need) {
    Tensord__Handover__Refuse rf = TENSORD__HANDOVER__REFUSE__INIT;
    snprintf(t.msg, sizeof(t.msg),
             "handover version %u offered, this tensord speaks %u..%u",
             b->version, lo, hi);
    rf.message = t.msg;
    send_body(&t.ch, TENSORD__HANDOVER__PACKET__BODY_REFUSE, &rf);
    fprintf(stderr,
            "tensord: --upgrade: refused: %s (tensord %s, pid %d, serves "
            "on)\n",
            t.msg, b->daemon_version, (int)b->pid);
    tensord__handover__packet__free_unpacked(p, NULL);
    chan_free(&t.ch);
    return 1;
  }
  char old_version[64];
  snprintf(old_version, sizeof(old_version), "%s", b->daemon_version);
  tensord__handover__packet__free_unpacked(p, NULL);
  Tensord__Handover__Accept ac = TENSORD__HANDOVER__ACCEPT__INIT;
  ac.version = v;
  ac.daemon_version = (char *)TD_VERSION_STRING;
  ac.pid = (int32_t)getpid();
  err = send_body(&t.ch, TENSORD__HANDOVER__PACKET__BODY_ACCEPT, &ac);
  if (err == 0)
    err = take_all(&t);
  else
    err = gave_up(&t, err, "sending Accept");
  if (err < 0)
    return broken_off(&t, argv, err, old_pid);
  stall("received");
  Tensord__Handover__Ready rd = TENSORD__HANDOVER__READY__INIT;
  err = send_body(&t.ch, TENSORD__HANDOVER__PACKET__BODY_READY, &rd);
  stall("ready");
  if (err < 0)
    err = gave_up(&t, err, "sending Ready");
  else
    err = await(&t, TENSORD__HANDOVER__PACKET__BODY_COMMIT, "Commit", &p);
  if (err < 0)
    return broken_off(&t, argv, err, old_pid);
  tensord__handover__packet__free_unpacked(p, NULL);
  /* Committed: we serve, whatever becomes of the old daemon. It exits once
   * it reads Started; nothing is polled before. A SIGTERM or SIGINT from
   * now on must stop this daemon gracefully, not kill it by the default
   * action before its handlers are in place (td__server_listen): hold them
   * pending until then. */
  sigset_t stops, was;
  sigemptyset(&stops);
  sigaddset(&stops, SIGINT);
  sigaddset(&stops, SIGTERM);
  sigprocmask(SIG_BLOCK, &stops, &was);
  Tensord__Handover__Started sm = TENSORD__HANDOVER__STARTED__INIT;
  sm.pid = (int32_t)getpid();
  err = send_body(&t.ch, TENSORD__HANDOVER__PACKET__BODY_STARTED, &sm);
  /* Refused: the old daemon's deadline passed before it read Started, and
   * it serves on (upgrade.c's opening comment). If it died instead, we
   * serve, as if it had read it. */
  if (err < 0 && gave_up(&t, err, "sending Started") == TD_ECANCELED)
    return broken_off(&t, argv, TD_ECANCELED, old_pid);
  stall("started");
  chan_free(&t.ch);
  close(fd);

  uv_update_time(loop);
  td__server_listen(srv);
  sigprocmask(SIG_SETMASK, &was, NULL);
  if (srv->pool.count > 0)
    uv_timer_start(&srv->pool_timer, td__server_pool_tick, 10, 0);
  for (size_t i = 0; i < t.nconns; i++)
    td__conn_resume(t.conns[i].owner);
  free(t.conns);
  free(t.left);
  if (t.has_state)
    td__state_adopt(srv, srv->state_dir, t.dirfd, t.lockfd, t.state_gen);
  if (t.metrics_fd >= 0)
    td__scrape_adopt(&srv->scrape, srv, t.metrics_fd, t.metrics_tcp,
                     t.metrics_path, t.metrics_where, t.metrics_timeout_ms);
  td__info("tensord %s took over from tensord %s (pid %d) on %s: %llu "
           "client(s), %llu storage(s), %llu key(s), %llu waiter(s), %llu "
           "channel(s); instance %016llx, pid %d",
           TD_VERSION_STRING, old_version, old_pid, srv->socket_path,
           (unsigned long long)srv->nconns,
           (unsigned long long)srv->reg.storages.count,
           (unsigned long long)srv->reg.keys.count,
           (unsigned long long)srv->waits.count,
           (unsigned long long)srv->chans.n, (unsigned long long)srv->instance,
           (int)getpid());
  td__server_notify("READY=1");
  return 0;
}

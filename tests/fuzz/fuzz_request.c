/* fuzz_request.c: the libFuzzer target over tensord's request path: framing,
 * protobuf decoding, validation, the registry and the replies with their fds.
 *
 * Each input gets a fresh daemon (td__server_init: no listening socket) on
 * one libuv loop, and one or two clients on real Unix socket pairs adopted
 * with td__conn_accept; fuzz_input.h says how the input is laid out. The
 * client side writes its bytes, reads and checks every reply (each frame
 * decodes as a Response and carries exactly the fds it announces), then
 * shuts its side, and the daemon closes each connection at end of stream.
 * After that the harness checks what must hold once every client is gone:
 * each storage alive is held by keys only, no waiter, create or byte of
 * accounting is left over; then it stops the daemon and checks that no
 * segment of it is left in /dev/shm, no libuv handle is active and no fd
 * was leaked. The oracle (oracle.h) replays what the clients sent through a
 * model of the daemon and checks that every request got exactly the replies
 * it should, and that those the model says are valid succeeded. A failed
 * check aborts with a message, so libFuzzer reports it as a crash. Linked
 * with replay.c it is also a plain program (fuzz_replay) that ctest runs
 * over the seed corpus and the regressions. */
#include "common.h"
#include "log.h"
#include "segment.h"
#include "conn.h"
#include "start.h"
#include "fuzz_input.h"
#include "oracle.h"

#include "tensord.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);


#define NCONN 2
/* Loop turns without progress before the harness calls the daemon stuck. */
#define SPIN_MAX 200000
/* Most fds one recvmsg can bring: the daemon sends at most
 * TD__SEND_FDS_MAX; room for more shows a violation instead of losing it. */
#define RECV_FDS_MAX 64

/* The client side of one connection. */
typedef struct end {
  int fd;         /* our end of the socket pair; -1 once closed */
  int shut;       /* we sent end of stream */
  int eof;        /* the daemon closed its end and we read everything */
  int broken;     /* sends fail: the daemon hung up */
  int deaf;       /* we stopped reading replies (FZ_SEG_DEAF) */
  int muted;      /* we leave replies unread for now (FZ_SEG_MUTE) */
  td__conn *conn; /* the daemon's side; see conn_of() */
  uint8_t *buf;
  size_t len, cap;           /* reply bytes not yet parsed into frames */
  uint64_t fds_in;           /* fds received */
  uint64_t fds_told;         /* fds announced by the frames received */
  int fdq[2 * RECV_FDS_MAX]; /* received fds whose frames have not come */
  unsigned nfdq;
} end;

static uv_loop_t loop;
static td__server srv;
static end ends[NCONN];
static int nends;
static int devnull = -1;
static uint8_t hello[64];
static size_t hello_len;
static uint32_t serial;
static int verbose; /* TD_FUZZ_VERBOSE=1: print every reply */
/* The next scope token (see __wrap_getrandom); 0: between inputs. */
static uint64_t next_token;

/* Scope tokens: the daemon draws them with getrandom (ops.c), which the
 * build wraps (-Wl,--wrap=getrandom, in tensord's own objects only) so that
 * in an input they come as FZ_SCOPE_TOKEN(0), (1), ...: seeds and mutations
 * can then publish into the scopes they open. A token is the only 8-byte
 * draw: segment names' random tails come 32 to a draw (backend.c), from the
 * real getrandom. */
ssize_t __real_getrandom(void *buf, size_t len, unsigned flags);
ssize_t __wrap_getrandom(void *buf, size_t len, unsigned flags);
ssize_t __wrap_getrandom(void *buf, size_t len, unsigned flags) {
  if (next_token == 0 || len != sizeof(next_token))
    return __real_getrandom(buf, len, flags);
  memcpy(buf, &next_token, sizeof(next_token));
  next_token++;
  return (ssize_t)len;
}

/* Reports a broken invariant and aborts, after unlinking the daemon's
 * segments so that a crash leaves nothing in /dev/shm. */
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void die(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "fuzz_request: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  if (srv.prefix[0] == '/')
    td__segments_unlink_prefix(srv.prefix + 1, NULL, NULL);
  abort();
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL)
    die("opendir(/proc/self/fd): %s", strerror(errno));
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* Names of the daemon's segments still in /dev/shm; unlinks them. */
static int count_segments(void) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return 0;
  const char *prefix = srv.prefix + 1;
  size_t plen = strlen(prefix);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, plen) == 0) {
      fprintf(stderr, "fuzz_request: segment /dev/shm/%s left behind\n",
              e->d_name);
      n++;
    }
  }
  closedir(d);
  return n;
}

static uint32_t get_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

/* Packs r as a frame into buf (room for cap bytes); returns its size. */
static size_t frame(const Tensord__Request *r, uint8_t *buf, size_t cap) {
  size_t n = tensord__request__get_packed_size(r);
  if (n + TD__FRAME_HDR > cap)
    die("a %zu-byte request does not fit %zu bytes", n, cap);
  buf[0] = (uint8_t)n;
  buf[1] = (uint8_t)(n >> 8);
  buf[2] = (uint8_t)(n >> 16);
  buf[3] = (uint8_t)(n >> 24);
  buf[4] = 0;
  buf[5] = 0;
  buf[6] = 'T';
  buf[7] = 'D';
  tensord__request__pack(r, buf + TD__FRAME_HDR);
  return n + TD__FRAME_HDR;
}

/* ---- the client side: replies ---- */

/* Checks the fd a StorageReply came with: a read-only reference gets an
 * O_RDONLY file description, a read-write one O_RDWR, of the storage's
 * size. */
static void check_storage_fd(const Tensord__StorageReply *m, int fd) {
  int fl = fcntl(fd, F_GETFL);
  struct stat st;
  if (fl < 0 || fstat(fd, &st) < 0)
    die("the fd of storage %llu is not open: %s", (unsigned long long)m->id,
        strerror(errno));
  int want = m->readonly ? O_RDONLY : O_RDWR;
  if ((fl & O_ACCMODE) != want)
    die("storage %llu: a %s reference came with an fd open %s",
        (unsigned long long)m->id, m->readonly ? "read-only" : "read-write",
        (fl & O_ACCMODE) == O_RDONLY ? "O_RDONLY" : "for writing");
  if ((uint64_t)st.st_size != m->nbytes)
    die("storage %llu: the reply says %llu bytes, its fd has %lld",
        (unsigned long long)m->id, (unsigned long long)m->nbytes,
        (long long)st.st_size);
}

/* Checks one reply frame of client who: it decodes, has a body, and carries
 * an fd exactly when it says it does, the right fd for the reference. Hands
 * the reply to the oracle; closes fds. */
static void check_reply(int who, const uint8_t *p, size_t len, int *fds,
                        unsigned nfds) {
  Tensord__Response *r = tensord__response__unpack(NULL, len, p);
  if (r == NULL)
    die("the daemon sent %zu bytes that do not decode as a Response", len);
  unsigned want = 0;
  const Tensord__StorageReply *sr = NULL;
  switch (r->body_case) {
  case TENSORD__RESPONSE__BODY_STORAGE:
    sr = r->storage;
    break;
  case TENSORD__RESPONSE__BODY_LOOKUP:
    sr = r->lookup != NULL ? r->lookup->storage : NULL;
    if (sr == NULL)
      die("a LookupReply (seq %llu) without its storage",
          (unsigned long long)r->seq);
    break;
  case TENSORD__RESPONSE__BODY_LOOKUP_MANY: {
    /* One fd per item that says it has one, in item order. */
    const Tensord__LookupManyReply *lm = r->lookup_many;
    unsigned k = 0;
    for (size_t i = 0; i < lm->n_items; i++) {
      const Tensord__LookupManyItem *x = lm->items[i];
      const Tensord__StorageReply *m =
          x->lookup != NULL ? x->lookup->storage : NULL;
      if (x->code == 0 && m == NULL)
        die("a LookupManyItem (seq %llu) found without its storage",
            (unsigned long long)r->seq);
      if (x->code != 0 && x->lookup != NULL)
        die("a LookupManyItem (seq %llu) with both an error and a storage",
            (unsigned long long)r->seq);
      if (m == NULL || !m->fd)
        continue;
      if (k == nfds)
        die("a LookupManyReply (seq %llu) came with %u fd(s); its items "
            "announce more",
            (unsigned long long)r->seq, nfds);
      check_storage_fd(m, fds[k++]);
    }
    if (k != nfds)
      die("a LookupManyReply (seq %llu) came with %u fd(s); its items "
          "announce %u",
          (unsigned long long)r->seq, nfds, k);
    if (verbose)
      fprintf(stderr,
              "fuzz_request: client %d: seq %llu: lookup_many: items "
              "%u..%zu%s (%u fd(s))\n",
              who, (unsigned long long)r->seq, lm->first,
              lm->first + lm->n_items, lm->last ? ", last" : "", nfds);
    oracle_reply(who, r, len);
    for (unsigned i = 0; i < nfds; i++)
      close(fds[i]);
    return;
  }
  case TENSORD__RESPONSE__BODY__NOT_SET:
    die("the daemon sent a Response without a body (seq %llu)",
        (unsigned long long)r->seq);
    break;
  default:
    break;
  }
  if (verbose) {
    const ProtobufCFieldDescriptor *fd =
        protobuf_c_message_descriptor_get_field(&tensord__response__descriptor,
                                                (unsigned)r->body_case);
    if (r->body_case == TENSORD__RESPONSE__BODY_ERROR)
      fprintf(stderr, "fuzz_request: client %d: seq %llu: %s: %s\n", who,
              (unsigned long long)r->seq, td_err_name(r->error->code),
              r->error->message);
    else
      fprintf(stderr, "fuzz_request: client %d: seq %llu: %s%s\n", who,
              (unsigned long long)r->seq, fd ? fd->name : "?",
              nfds ? " (with an fd)" : "");
  }
  /* A ChanReply carries its ring: a sealed memfd. */
  want = (sr != NULL && sr->fd) || r->body_case == TENSORD__RESPONSE__BODY_CHAN;
  if (nfds != want)
    die("a Response (seq %llu, body %d) came with %u fd(s); it says %u",
        (unsigned long long)r->seq, (int)r->body_case, nfds, want);
  if (want && sr != NULL)
    check_storage_fd(sr, fds[0]);
  if (want && sr == NULL) { /* the ring: sealed at the size the reply says */
    struct stat st;
    int seals = fcntl(fds[0], F_GET_SEALS);
    if (fstat(fds[0], &st) < 0 || (uint64_t)st.st_size != r->chan->ring_size ||
        seals < 0 || !(seals & F_SEAL_SHRINK) || !(seals & F_SEAL_GROW))
      die("channel %llu: its ring's fd has %lld bytes (the reply says %llu) "
          "and seals 0x%x",
          (unsigned long long)r->chan->chan, (long long)st.st_size,
          (unsigned long long)r->chan->ring_size, (unsigned)seals);
  }
  oracle_reply(who, r, len);
  for (unsigned i = 0; i < nfds; i++)
    close(fds[i]);
}

/* Checks and drops every complete frame in e's buffer. */
static void parse_replies(end *e) {
  size_t off = 0;
  while (e->len - off >= TD__FRAME_HDR) {
    const uint8_t *h = e->buf + off;
    uint32_t n = get_le32(h);
    if (h[5] != 0 || h[6] != 'T' || h[7] != 'D' || n > TD__FRAME_MAX ||
        h[4] > TD__FRAME_MAX_FDS)
      die("the daemon sent a bad frame header %02x %02x %02x %02x %02x %02x "
          "%02x %02x",
          h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
    if (e->len - off < TD__FRAME_HDR + (size_t)n)
      break;
    e->fds_told += h[4];
    if (e->nfdq < h[4])
      die("a frame announcing %u fd(s) arrived before them (%llu received, "
          "%llu announced)",
          h[4], (unsigned long long)e->fds_in, (unsigned long long)e->fds_told);
    int fds[TD__FRAME_MAX_FDS];
    memcpy(fds, e->fdq, h[4] * sizeof(int));
    e->nfdq -= h[4];
    memmove(e->fdq, e->fdq + h[4], e->nfdq * sizeof(int));
    check_reply((int)(e - ends), h + TD__FRAME_HDR, n, fds, h[4]);
    off += TD__FRAME_HDR + n;
  }
  memmove(e->buf, e->buf + off, e->len - off);
  e->len -= off;
}

/* Reads whatever the daemon has sent on e, closing every fd that came. */
static void drain(end *e) {
  static uint8_t chunk[64 * 1024];
  while (e->fd >= 0 && !e->eof) {
    union {
      char buf[CMSG_SPACE(sizeof(int) * RECV_FDS_MAX)];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {chunk, sizeof(chunk)};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof(ctl.buf);
    ssize_t n = recvmsg(e->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN)
        return;
      if (errno == ECONNRESET) { /* it hung up on bytes it never read */
        e->eof = 1;
        return;
      }
      die("recvmsg: %s", strerror(errno));
    }
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
        continue;
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; i++) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (e->nfdq == sizeof(e->fdq) / sizeof(e->fdq[0]))
          die("%u fds received ahead of their frames", e->nfdq + 1);
        e->fdq[e->nfdq++] = fd;
        e->fds_in++;
      }
    }
    if (msg.msg_flags & MSG_CTRUNC)
      die("the daemon sent more than %d fds in one message", RECV_FDS_MAX);
    if (n == 0) {
      e->eof = 1;
      return;
    }
    if (e->len + (size_t)n > e->cap) {
      size_t cap = e->cap ? e->cap : 4096;
      while (cap < e->len + (size_t)n)
        cap *= 2;
      uint8_t *p = realloc(e->buf, cap);
      if (p == NULL)
        die("out of memory");
      e->buf = p;
      e->cap = cap;
    }
    memcpy(e->buf + e->len, chunk, (size_t)n);
    e->len += (size_t)n;
    parse_replies(e);
    /* Fds travel with or before their frame's first byte, and never more
     * than TD__SEND_FDS_MAX ahead of the frames that have fully arrived. */
    if (e->fds_in - e->fds_told > TD__SEND_FDS_MAX)
      die("%llu fd(s) received ahead of their frames (%llu received, %llu "
          "announced); the most is %d",
          (unsigned long long)(e->fds_in - e->fds_told),
          (unsigned long long)e->fds_in, (unsigned long long)e->fds_told,
          TD__SEND_FDS_MAX);
  }
}

/* One turn of the loop (blocking if asked), then every reply it produced,
 * except to muted clients. */
static void pump(int block) {
  uv_run(&loop, block ? UV_RUN_ONCE : UV_RUN_NOWAIT);
  for (int i = 0; i < nends; i++)
    if (!ends[i].muted)
      drain(&ends[i]);
}

/* e's connection in the daemon, or NULL once the daemon has dropped it. */
static td__conn *conn_of(const end *e) {
  for (td__conn *c = srv.conns; c != NULL; c = c->next)
    if (c == e->conn)
      return c;
  return NULL;
}

/* Whether the daemon is done with what e sent: it read every byte and sent
 * every reply, or (once we shut our side) it closed the connection; for a
 * muted client, it read every byte or stopped reading. Deaf and muted
 * clients do not see the daemon's close as end of stream; settle() judges
 * them by its count of connections. */
static int settled(const end *e) {
  if (e->fd < 0 || (e->eof && !e->deaf && !e->muted))
    return 1;
  if (e->shut)
    return e->deaf || e->muted;
  int unread = 0;
  if (ioctl(e->fd, SIOCOUTQ, &unread) < 0)
    die("ioctl(SIOCOUTQ): %s", strerror(errno));
  const td__conn *c = conn_of(e);
  if (e->muted)
    return unread == 0 || c == NULL || c->paused;
  /* Its replies sent too: the daemon drops what is unsent when it sees
   * end of stream. */
  return unread == 0 && (c == NULL || td__wire_pending(&c->wire) == 0);
}

/* Whether the daemon should still have e's connection, as far as e can
 * tell: until end of stream; for deaf and muted clients, until POLLHUP says
 * the daemon closed its end, or once we shut ours, not at all (the daemon
 * must then close it). */
static int connected(const end *e) {
  if (e->fd < 0)
    return 0;
  if (!e->deaf && !e->muted)
    return !e->eof;
  if (e->shut)
    return 0;
  struct pollfd p = {e->fd, POLLIN, 0};
  if (poll(&p, 1, 0) < 0)
    die("poll: %s", strerror(errno));
  return !(p.revents & POLLHUP);
}

/* Turns the loop until the daemon has handled everything sent so far,
 * thread-pool work included, and has noticed every client that left. */
static void settle(void) {
  for (long spins = 0;; spins++) {
    pump(srv.pending_work > 0);
    int done = srv.pending_work == 0;
    uint64_t live = 0;
    for (int i = 0; i < nends; i++) {
      done = done && settled(&ends[i]);
      live += connected(&ends[i]);
    }
    if (done && srv.nconns == live) {
      int gone[OR_ENDS] = {0};
      for (int i = 0; i < nends; i++) {
        const td__conn *c = conn_of(&ends[i]);
        gone[i] = c == NULL;
        if (c != NULL && c->paused && ends[i].muted)
          oracle_paused(i);
      }
      oracle_settled(gone);
      return;
    }
    if (spins > SPIN_MAX)
      die("the daemon makes no progress: %llu thread-pool job(s) pending, "
          "%llu connection(s) for %llu client(s)",
          (unsigned long long)srv.pending_work, (unsigned long long)srv.nconns,
          (unsigned long long)live);
  }
}

/* ---- the client side: requests ---- */

/* Sends len bytes on e (with an fd on the first byte if with_fd), turning
 * the loop while the socket is full. Stops if the daemon hangs up. */
static void send_bytes(end *e, const uint8_t *p, size_t len, int with_fd) {
  size_t off = 0;
  /* A deaf client reads end of stream early: only a failed send counts. */
  for (long spins = 0; off < len && !e->broken && !(e->eof && !e->deaf);
       spins++) {
    union {
      char buf[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {(void *)(p + off), len - off};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (with_fd) {
      memset(ctl.buf, 0, sizeof(ctl.buf));
      msg.msg_control = ctl.buf;
      msg.msg_controllen = sizeof(ctl.buf);
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(c), &devnull, sizeof(int));
    }
    ssize_t n = sendmsg(e->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EPIPE || errno == ECONNRESET) {
        e->broken = 1;
        return;
      }
      if (errno != EAGAIN)
        die("sendmsg: %s", strerror(errno));
      const td__conn *c = conn_of(e);
      if (e->muted && (c == NULL || c->paused))
        return; /* it stopped reading until we read: drop the rest */
      if (spins > SPIN_MAX)
        die("the daemon stopped reading a client's requests");
      pump(0);
      continue;
    }
    oracle_sent((int)(e - ends), p + off, (size_t)n, with_fd);
    off += (size_t)n;
    with_fd = 0;
  }
}

/* Stops reading replies (shutdown SHUT_RD): what is queued stays readable,
 * the daemon's next write fails with EPIPE, and it sees no end of stream
 * until we shut our write side too. */
static void deafen(end *e) {
  if (e->fd < 0 || e->deaf)
    return;
  if (shutdown(e->fd, SHUT_RD) < 0 && errno != ENOTCONN)
    die("shutdown(SHUT_RD): %s", strerror(errno));
  e->deaf = 1;
  oracle_deaf((int)(e - ends));
}

static void shut(end *e) {
  if (e->fd < 0 || e->shut)
    return;
  shutdown(e->fd, SHUT_WR); /* ENOTCONN if the daemon hung up: fine */
  e->shut = 1;
  oracle_shut((int)(e - ends));
}

/* Connects client i (who: a class of fuzz_input.h) with reads and writes
 * capped at max_io bytes (0: no cap). */
static void connect_end(int i, unsigned who, size_t max_io) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) <
      0)
    die("socketpair: %s", strerror(errno));
  end *e = &ends[i];
  memset(e, 0, sizeof(*e));
  e->fd = sv[0];
  td__conn *before = srv.conns;
  int err = td__conn_accept(&srv, sv[1]);
  if (err < 0)
    die("td__conn_accept: %s", td_strerror(err));
  if (srv.conns == before)
    return; /* refused (--max-clients): it is closing already */
  td__conn *c = srv.conns;
  e->conn = c;
  if (who != 0) {
    c->hold.peer.uid = fz_classes[who].uid;
    c->hold.peer.gid = fz_classes[who].gid;
    c->hold.ngroups = 0;
  }
  c->wire.max_io = max_io;
}

/* Closes our side of every connection. A connection the daemon dropped
 * with replies unsent (an error, or end of stream; see drain() for the fds)
 * may end in a partial frame, and with fds of frames that never came. */
static void close_ends(void) {
  for (int i = 0; i < nends; i++) {
    end *e = &ends[i];
    if (e->fds_in - e->fds_told > TD__SEND_FDS_MAX)
      die("client %d received %llu fd(s); its frames announce %llu", i,
          (unsigned long long)e->fds_in, (unsigned long long)e->fds_told);
    td__close_fds(e->fdq, e->nfdq);
    e->nfdq = 0;
    oracle_partial(i, e->len);
    close(e->fd);
    e->fd = -1;
    free(e->buf);
    e->buf = NULL;
  }
}

/* ---- what must hold between inputs ---- */

/* With every client gone, the only references left are keys'. */
static void check_registry(void) {
  const td__registry *r = &srv.reg;
  uint64_t n = 0, nkeys = 0, bytes = 0, nuids = 0;
  for (const td__storage *s = r->first; s != NULL; s = s->next) {
    uint32_t k = 0;
    for (const td__key *key = s->keys; key != NULL; key = key->snext, k++) {
      if (key->storage != s || td__key_find(r, key->name, key->len) != key)
        die("key '%s': not where the registry says", key->name);
      if (td__view_check_msg(&key->view, s->nbytes, NULL, 0) < 0)
        die("key '%s': its view reaches outside storage %llu", key->name,
            (unsigned long long)s->id);
    }
    /* What each uid owns, counted once per uid. */
    const td__storage *first = r->first;
    while (first->owner.uid != s->owner.uid)
      first = first->next;
    if (first == s) {
      uint64_t owned = 0;
      for (const td__storage *t = s; t != NULL; t = t->next)
        if (t->owner.uid == s->owner.uid)
          owned += t->nbytes;
      if (td__usage_of(r, s->owner.uid) != owned)
        die("uid %u owns %llu bytes of storages; its usage says %llu",
            (unsigned)s->owner.uid, (unsigned long long)owned,
            (unsigned long long)td__usage_of(r, s->owner.uid));
      nuids++;
    }
    if (s->holders != NULL)
      die("storage %llu: still has holders after every client left",
          (unsigned long long)s->id);
    if (k == 0)
      die("storage %llu: alive with %u reference(s), yet no key and no "
          "client holds it",
          (unsigned long long)s->id, s->refs);
    if (s->refs != k)
      die("storage %llu: %u reference(s) but %u key(s) and no holder",
          (unsigned long long)s->id, s->refs, k);
    if (td__storage_find(r, s->id) != s)
      die("storage %llu: in the list but not in the table",
          (unsigned long long)s->id);
    n++;
    nkeys += k;
    bytes += s->nbytes;
  }
  if (n != r->storages.count)
    die("%zu storage(s) in the table, %llu in the list", r->storages.count,
        (unsigned long long)n);
  if (nuids != r->usage.count)
    die("%zu uid(s) in the usage table, %llu own storages", r->usage.count,
        (unsigned long long)nuids);
  if (nkeys != r->keys.count)
    die("%zu key(s) in the table, %llu on storages", r->keys.count,
        (unsigned long long)nkeys);
  if (bytes != r->bytes_used || r->bytes_committed != r->bytes_used)
    die("accounting: %llu bytes in storages, bytes_used %llu, committed %llu",
        (unsigned long long)bytes, (unsigned long long)r->bytes_used,
        (unsigned long long)r->bytes_committed);
  if (r->nholdings != 0)
    die("%llu holding(s) left with no client",
        (unsigned long long)r->nholdings);
  if (srv.conns != NULL || srv.nconns != 0)
    die("%llu connection(s) left after every client hung up",
        (unsigned long long)srv.nconns);
  if (r->scopes.count != 0)
    die("%zu scope(s) left with no client", r->scopes.count);
  if (srv.waits.count != 0 || srv.waits.queues.count != 0)
    die("%llu waiter(s) in %zu queue(s) left with no client",
        (unsigned long long)srv.waits.count, srv.waits.queues.count);
}

static void print_handle(uv_handle_t *h, void *arg) {
  if (uv_is_active(h) || !uv_is_closing(h))
    fprintf(stderr, "fuzz_request: handle %p (%s)%s left\n", (void *)h,
            uv_handle_type_name(uv_handle_get_type(h)),
            uv_is_active(h) ? " active" : "");
}

/* Runs the loop until it has nothing left to do: thread-pool work and
 * closing handles finish; an active handle is a leak. */
static void run_to_idle(void) {
  for (long spins = 0; uv_loop_alive(&loop); spins++) {
    uv_run(&loop, srv.pending_work > 0 ? UV_RUN_ONCE : UV_RUN_NOWAIT);
    if (spins > 1000 && srv.pending_work == 0) {
      uv_walk(&loop, print_handle, NULL);
      die("the loop still has handles with every client gone");
    }
  }
}

/* Tells the oracle who the clients are and what limits the daemon has. */
static void start_oracle(const td__options *o, int n, int timeouts) {
  oracle_setup s = {0};
  s.nends = n;
  s.capacity = o->capacity;
  s.quota = o->quota;
  s.max_storages = o->max_storages_per_client;
  s.timeouts = timeouts;
  s.fail = die;
  s.verbose = verbose;
  for (int i = 0; i < n; i++) {
    const td__conn *c = ends[i].conn;
    if (c == NULL) {
      s.refused[i] = 1;
      continue;
    }
    s.peer[i].uid = c->hold.peer.uid;
    s.peer[i].gid = c->hold.peer.gid;
    if (c->hold.ngroups > OR_GROUPS_MAX) { /* the daemon holds them all */
      fprintf(stderr, "fuzz: a client in %d groups; the oracle holds %d\n",
              c->hold.ngroups, OR_GROUPS_MAX);
      abort();
    }
    s.peer[i].ngroups = c->hold.ngroups;
    if (c->hold.ngroups > 0) /* groups is NULL without any */
      memcpy(s.peer[i].groups, c->hold.groups,
             (size_t)c->hold.ngroups * sizeof(gid_t));
  }
  oracle_start(&s);
}

static void setup(void) {
  const char *level = getenv("TD_FUZZ_LOG");
  td__log_level = level ? td__log_level_parse(level) : TD_LOG_ERROR;
  if (td__log_level < 0)
    td__log_level = TD_LOG_ERROR;
  verbose = getenv("TD_FUZZ_VERBOSE") != NULL;
  signal(SIGPIPE, SIG_IGN);
  if (uv_loop_init(&loop) < 0)
    die("uv_loop_init failed");
  devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0)
    die("open(/dev/null): %s", strerror(errno));
  Tensord__Hello h = TENSORD__HELLO__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.client_name = "fuzz";
  r.seq = 1;
  r.body_case = TENSORD__REQUEST__BODY_HELLO;
  r.hello = &h;
  hello_len = frame(&r, hello, sizeof(hello));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int ready;
  if (!ready) {
    setup();
    ready = 1;
  }
  int fds_before = count_fds();
  if (verbose)
    fprintf(stderr, "fuzz_request: input of %zu bytes\n", size);
  uint8_t f0 = size > 0 ? data[0] : 0, f1 = size > 1 ? data[1] : 0;
  const uint8_t *p = data + (size < 2 ? size : 2);
  size_t left = size - (size_t)(p - data);

  td__options o = {0};
  o.capacity = FZ_CAPACITY;
  o.socket_mode = -1;
  if (f0 & FZ_LIMITS) {
    o.quota = FZ_QUOTA;
    o.max_storages_per_client = FZ_MAX_STORAGES;
  }
  if (f0 & FZ_ONECLIENT)
    o.max_clients = 1;
  if (f1 & FZ_IO_TIMEOUT)
    o.io_timeout_ms = 1;
  td__server_init(&srv, &loop, &o);
  /* Segment names this harness can recognise: f022, its pid, a serial. */
  srv.instance = 0xf022000000000000ull | (uint64_t)(getpid() & 0xffffff) << 24 |
                 (++serial & 0xffffff);
  snprintf(srv.prefix, sizeof(srv.prefix), "/tensord.%016llx.",
           (unsigned long long)srv.instance);
  next_token = FZ_SCOPE_TOKEN(0);

  int ticks = 0;
  nends = (f0 & FZ_MULTI) ? 2 : 1;
  size_t max_io = (f1 & FZ_IO_CAP) ? (size_t)1 << (f1 & 15) : 0;
  for (int i = 0; i < nends; i++)
    connect_end(i, (f0 >> (4 + 2 * i)) & 3, max_io);
  start_oracle(&o, nends, f1 & FZ_IO_TIMEOUT);
  if (f0 & FZ_HELLO) {
    for (int i = 0; i < nends; i++)
      send_bytes(&ends[i], hello, hello_len, 0);
    /* Handled before what follows: an fd sent next cannot reach the daemon
     * in the same read as a Hello. */
    settle();
  }

  if (!(f0 & FZ_MULTI)) {
    send_bytes(&ends[0], p, left, 0);
    settle(); /* creates on the thread pool finish before end of stream */
  } else {
    while (left >= 2) {
      uint8_t sel = p[0];
      size_t n = p[1] < left - 2 ? p[1] : left - 2;
      end *e = &ends[sel & FZ_SEG_CONN];
      if (!e->shut && n > 0) {
        if (sel & FZ_SEG_MUTE) {
          e->muted = 1;
          oracle_muted(sel & FZ_SEG_CONN);
        }
        send_bytes(e, p + 2, n, sel & FZ_SEG_FD);
        if (sel & FZ_SEG_DEAF)
          deafen(e);
        if ((sel & FZ_SEG_EOF) && !e->muted) /* a muted one: at the end */
          shut(e);
        settle();
        if ((sel & FZ_SEG_TICK) && (f1 & FZ_TICKS) && ticks++ < FZ_TICKS_MAX) {
          struct timespec ts = {0, 2 * 1000 * 1000};
          nanosleep(&ts, NULL);
          settle();
        }
      }
      p += 2 + n;
      left -= 2 + n;
    }
  }
  for (int i = 0; i < nends; i++)
    ends[i].muted = 0;
  settle(); /* every reply arrives */
  for (int i = 0; i < nends; i++)
    shut(&ends[i]);
  settle();
  close_ends();
  oracle_finish();
  run_to_idle(); /* the connections' handles finish closing */

  check_registry();
  td__server_stop(&srv);
  run_to_idle();
  next_token = 0;
  if (count_segments() > 0)
    die("the stopped daemon left segments in /dev/shm");
  int fds_after = count_fds();
  if (fds_after != fds_before)
    die("%d fd(s) open before the input, %d after", fds_before, fds_after);
  return 0;
}

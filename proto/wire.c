/* wire.c: length-prefixed frames and SCM_RIGHTS fd queues over a Unix stream
 * socket. */
#include "wire.h"

#include "tensord.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define IN_MIN_CAP (64u * 1024)
#define MAGIC0 'T'
#define MAGIC1 'D'

static void put_le32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

void td__close_fds(int *fds, unsigned n) {
  for (unsigned i = 0; i < n; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

void td__wire_init(td__wire *w, int fd) {
  memset(w, 0, sizeof(*w));
  w->fd = fd;
}

void td__wire_free(td__wire *w) {
  if (w == NULL)
    return;
  td__close_fds(w->in_fds, w->in_nfds);
  for (unsigned i = 0; i < w->out_nfds; i++)
    close(w->out_fds[i].fd);
  free(w->in);
  free(w->out);
  free(w->out_fds);
  w->in = w->out = NULL;
  w->out_fds = NULL;
  w->in_nfds = w->out_nfds = w->out_fds_cap = 0;
  w->in_off = w->in_len = w->in_cap = 0;
  w->out_off = w->out_len = w->out_cap = 0;
}

/* Bytes the head frame needs in all, or 0 if its header is incomplete. */
static size_t head_frame_size(const td__wire *w) {
  if (w->in_len - w->in_off < TD__FRAME_HDR)
    return 0;
  uint32_t len = get_le32(w->in + w->in_off);
  if (len > TD__FRAME_MAX)
    return TD__FRAME_HDR; /* td__wire_frame reports it */
  return TD__FRAME_HDR + (size_t)len;
}

/* Makes room for more input: compacts, then grows up to one whole frame. */
static int in_make_room(td__wire *w) {
  if (w->in_off > 0) {
    memmove(w->in, w->in + w->in_off, w->in_len - w->in_off);
    w->in_len -= w->in_off;
    w->in_off = 0;
  }
  size_t want = head_frame_size(w);
  if (want < IN_MIN_CAP)
    want = IN_MIN_CAP;
  if (w->in_len == w->in_cap && want <= w->in_cap)
    return 0; /* full of complete frames: the caller must consume first */
  if (want > w->in_cap) {
    uint8_t *p = realloc(w->in, want);
    if (p == NULL)
      return TD_ENOMEM;
    w->in = p;
    w->in_cap = want;
  }
  return 0;
}

ssize_t td__wire_recv(td__wire *w, int flags) {
  int err = in_make_room(w);
  if (err < 0)
    return err;
  size_t room = w->in_cap - w->in_len;
  if (room == 0)
    return TD_ENOMEM;
  if (w->max_io > 0 && room > w->max_io)
    room = w->max_io;

  union {
    char buf[CMSG_SPACE(sizeof(int) * TD__SEND_FDS_MAX)];
    struct cmsghdr align;
  } ctl;
  struct iovec iov = {w->in + w->in_len, room};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.buf;
  msg.msg_controllen = sizeof(ctl.buf);

  ssize_t n;
  do
    n = recvmsg(w->fd, &msg, MSG_CMSG_CLOEXEC | flags);
  while (n < 0 && errno == EINTR);
  if (n < 0)
    return errno == EWOULDBLOCK ? TD_EAGAIN : -errno;

  int overflow = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
      continue;
    size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(c);
    for (size_t i = 0; i < nfds; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof(int), sizeof(int));
      if (w->in_nfds < TD__FDQ_MAX) {
        w->in_fds[w->in_nfds++] = fd;
      } else {
        close(fd);
        overflow = 1;
      }
    }
  }
  w->in_len += (size_t)n;
  w->short_read = (size_t)n < room;
  if (overflow || (msg.msg_flags & MSG_CTRUNC))
    return TD_EPROTO;
  return n;
}

int td__wire_frame(td__wire *w, td__frame *f) {
  size_t avail = w->in_len - w->in_off;
  if (avail < TD__FRAME_HDR)
    return 0;
  const uint8_t *h = w->in + w->in_off;
  if (h[6] != MAGIC0 || h[7] != MAGIC1 || h[5] != 0)
    return TD_EPROTO;
  uint32_t len = get_le32(h);
  unsigned nfds = h[4];
  if (len > TD__FRAME_MAX)
    return TD_EMSGSIZE;
  if (nfds > TD__FRAME_MAX_FDS)
    return TD_EPROTO;
  if (avail < TD__FRAME_HDR + (size_t)len)
    return 0;
  if (w->in_nfds < nfds)
    return TD_EPROTO; /* fds travel with the frame's first byte */

  f->data = h + TD__FRAME_HDR;
  f->len = len;
  f->nfds = nfds;
  memcpy(f->fds, w->in_fds, nfds * sizeof(int));
  w->in_nfds -= nfds;
  memmove(w->in_fds, w->in_fds + nfds, w->in_nfds * sizeof(int));
  return 1;
}

void td__wire_consume(td__wire *w, const td__frame *f) {
  w->in_off += TD__FRAME_HDR + f->len;
  if (w->in_off == w->in_len)
    w->in_off = w->in_len = 0;
}

uint8_t *td__wire_reserve(td__wire *w, size_t len) {
  if (len > TD__FRAME_MAX)
    return NULL;
  size_t need = w->out_len + TD__FRAME_HDR + len;
  if (need > w->out_cap) {
    /* Reclaim what has been sent before growing. */
    if (w->out_off > 0) {
      memmove(w->out, w->out + w->out_off, w->out_len - w->out_off);
      w->out_pos += w->out_off;
      w->out_len -= w->out_off;
      w->out_off = 0;
      need = w->out_len + TD__FRAME_HDR + len;
    }
    if (need > w->out_cap) {
      size_t cap = w->out_cap ? w->out_cap : 4096;
      while (cap < need)
        cap *= 2;
      uint8_t *p = realloc(w->out, cap);
      if (p == NULL)
        return NULL;
      w->out = p;
      w->out_cap = cap;
    }
  }
  return w->out + w->out_len + TD__FRAME_HDR;
}

int td__wire_commit(td__wire *w, size_t len, const int *fds, unsigned nfds) {
  int err = 0;
  if (nfds > TD__FRAME_MAX_FDS || len > TD__FRAME_MAX) {
    err = TD_EMSGSIZE;
    goto close_fds;
  }
  if (w->out_nfds + nfds > w->out_fds_cap) {
    unsigned cap = w->out_fds_cap ? w->out_fds_cap * 2 : 8;
    while (cap < w->out_nfds + nfds)
      cap *= 2;
    td__wire_fd *p = realloc(w->out_fds, cap * sizeof(*p));
    if (p == NULL) {
      err = TD_ENOMEM;
      goto close_fds;
    }
    w->out_fds = p;
    w->out_fds_cap = cap;
  }
  uint8_t *h = w->out + w->out_len;
  put_le32(h, (uint32_t)len);
  h[4] = (uint8_t)nfds;
  h[5] = 0;
  h[6] = MAGIC0;
  h[7] = MAGIC1;
  for (unsigned i = 0; i < nfds; i++) {
    w->out_fds[w->out_nfds].fd = fds[i];
    w->out_fds[w->out_nfds].pos = w->out_pos + w->out_len;
    w->out_fds[w->out_nfds].end = w->out_pos + w->out_len + TD__FRAME_HDR + len;
    w->out_nfds++;
  }
  w->out_len += TD__FRAME_HDR + len;
  return 0;

close_fds:
  for (unsigned i = 0; i < nfds; i++)
    close(fds[i]);
  return err;
}

int td__wire_queue(td__wire *w, const void *payload, size_t len, const int *fds,
                   unsigned nfds) {
  uint8_t *p = td__wire_reserve(w, len);
  if (p == NULL) {
    for (unsigned i = 0; i < nfds; i++)
      close(fds[i]);
    return len > TD__FRAME_MAX ? TD_EMSGSIZE : TD_ENOMEM;
  }
  if (len > 0)
    memcpy(p, payload, len);
  return td__wire_commit(w, len, fds, nfds);
}

size_t td__wire_pending(const td__wire *w) {
  return w->out_len - w->out_off;
}

/* Chooses what the next sendmsg carries: how many queued fds (*nf) and how
 * many bytes. Fds go only with a send that starts at or before their
 * frame's first byte and covers it, and no new fds go while the bytes of
 * frames whose fds went earlier are still unsent: so the receiver never
 * holds more than TD__SEND_FDS_MAX fds of frames it has not received. */
static size_t plan_send(const td__wire *w, unsigned *nf) {
  uint64_t cur = w->out_pos + w->out_off;
  size_t len = w->out_len - w->out_off;
  *nf = 0;
  if (cur < w->fd_frontier)
    return (size_t)(w->fd_frontier - cur) < len ? (size_t)(w->fd_frontier - cur)
                                                : len;
  unsigned n = 0;
  while (n < w->out_nfds && w->out_fds[n].pos < cur + len)
    n++;
  if (n > TD__SEND_FDS_MAX) {
    n = TD__SEND_FDS_MAX; /* never split one frame's fds */
    while (n > 1 && w->out_fds[n].pos == w->out_fds[n - 1].pos)
      n--;
  }
  if (n < w->out_nfds && w->out_fds[n].pos < cur + len)
    len = (size_t)(w->out_fds[n].pos - cur); /* stop before unsent fds */
  *nf = n;
  return len;
}

int td__wire_flush(td__wire *w, int flags) {
  while (w->out_off < w->out_len) {
    unsigned nf;
    size_t len = plan_send(w, &nf);
    if (w->max_io > 0 && len > w->max_io)
      len = w->max_io;

    union {
      char buf[CMSG_SPACE(sizeof(int) * TD__SEND_FDS_MAX)];
      struct cmsghdr align;
    } ctl;
    struct iovec iov = {w->out + w->out_off, len};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nf > 0) {
      memset(ctl.buf, 0, sizeof(ctl.buf));
      msg.msg_control = ctl.buf;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nf);
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nf);
      unsigned char *data = CMSG_DATA(c);
      for (unsigned i = 0; i < nf; i++)
        memcpy(data + i * sizeof(int), &w->out_fds[i].fd, sizeof(int));
    }

    ssize_t n;
    do
      n = sendmsg(w->fd, &msg, MSG_NOSIGNAL | flags);
    while (n < 0 && errno == EINTR);
    if (n < 0)
      return errno == EWOULDBLOCK ? TD_EAGAIN : -errno;

    /* The fds went with the first byte; our copies are no longer needed. */
    if (nf > 0) {
      w->fd_frontier = w->out_fds[nf - 1].end;
      for (unsigned i = 0; i < nf; i++)
        close(w->out_fds[i].fd);
      w->out_nfds -= nf;
      memmove(w->out_fds, w->out_fds + nf, w->out_nfds * sizeof(*w->out_fds));
    }
    w->out_off += (size_t)n;
  }
  w->out_pos += w->out_len;
  w->out_off = w->out_len = 0;
  return 0;
}

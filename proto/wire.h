/* wire.h: framing and fd passing shared by tensord and libtensord. */
#ifndef TD_WIRE_H
#define TD_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* A frame is an 8-byte header then a protobuf payload:
 *   bytes 0-3  payload length, little endian, at most TD__FRAME_MAX
 *   byte  4    number of fds that travel with the frame (at most 4)
 *   byte  5    0 (reserved)
 *   bytes 6-7  magic "TD"
 * A frame's fds are sent with (or before) the frame's first byte, so they are
 * in the receiver's fd queue once the whole frame has arrived; and never
 * more than TD__SEND_FDS_MAX fds ahead of their frames. */
#define TD__FRAME_HDR 8
#define TD__FRAME_MAX (1u << 20)
#define TD__FRAME_MAX_FDS 4
#define TD__FDQ_MAX 64 /* received fds held waiting for their frames */
#define TD__SEND_FDS_MAX 28

typedef struct td__wire_fd {
  int fd;
  uint64_t pos, end; /* stream offsets of the frame the fd travels with */
} td__wire_fd;

/* One end of a connection: a byte queue and an fd queue each way. */
typedef struct td__wire {
  int fd;
  uint8_t *in;
  size_t in_off, in_len, in_cap; /* unparsed bytes are in[in_off, in_len) */
  int in_fds[TD__FDQ_MAX];
  unsigned in_nfds;
  uint8_t *out;
  size_t out_off, out_len, out_cap; /* unsent bytes are out[out_off, out_len) */
  uint64_t out_pos;                 /* stream offset of out[0] */
  td__wire_fd *out_fds;             /* in stream order */
  unsigned out_nfds, out_fds_cap;
  uint64_t fd_frontier; /* end of the last frame whose fds were sent */
  /* Test hooks: cap each recvmsg/sendmsg at this many bytes (0: none). */
  size_t max_io;
  int short_read; /* the last recv filled less than the room it had */
} td__wire;

typedef struct td__frame {
  const uint8_t *data;
  size_t len;
  int fds[TD__FRAME_MAX_FDS];
  unsigned nfds;
} td__frame;

void td__wire_init(td__wire *w, int fd);
/* Frees the buffers and closes every queued fd, sent or received. The socket
 * itself is not closed. */
void td__wire_free(td__wire *w);

/* One recvmsg (MSG_CMSG_CLOEXEC). Returns the bytes read (> 0), 0 at end of
 * stream, TD_EAGAIN if nothing is ready, TD_EPROTO if ancillary data was
 * truncated or too many fds are queued, or another negative code. Received
 * fds are queued even on error, and freed by td__wire_free. */
ssize_t td__wire_recv(td__wire *w, int flags);
/* Looks for a complete frame at the head of the input. Returns 1 and fills f
 * (payload and the frame's fds, which now belong to the caller) if one is
 * there, 0 if more bytes are needed, TD_EPROTO or TD_EMSGSIZE for a bad or
 * oversize header (detected before any allocation). f->data stays valid until
 * td__wire_consume. */
int td__wire_frame(td__wire *w, td__frame *f);
/* Drops the frame f returned by td__wire_frame from the input. */
void td__wire_consume(td__wire *w, const td__frame *f);

/* Appends a frame. Takes ownership of fds (closed once sent, or by
 * td__wire_free), also on failure. Returns 0, TD_EMSGSIZE or TD_ENOMEM. */
int td__wire_queue(td__wire *w, const void *payload, size_t len, const int *fds,
                   unsigned nfds);
/* Reserves room for a frame of len payload bytes and returns a pointer to
 * where the payload goes, or NULL (no memory or oversize); finish with
 * td__wire_commit. Lets protobuf-c pack straight into the output queue. */
uint8_t *td__wire_reserve(td__wire *w, size_t len);
int td__wire_commit(td__wire *w, size_t len, const int *fds, unsigned nfds);
/* Sends what it can (MSG_NOSIGNAL | flags). Returns 0 when everything is
 * sent, TD_EAGAIN when the socket is full, or a negative error. */
int td__wire_flush(td__wire *w, int flags);
/* Bytes waiting to be sent. */
size_t td__wire_pending(const td__wire *w);

void td__close_fds(int *fds, unsigned n);

#endif /* TD_WIRE_H */

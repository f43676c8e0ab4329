/* conn.h: one client connection: its socket and wire queues, what it holds,
 * and the requests it has in flight. */
#ifndef TD_DAEMON_CONN_H
#define TD_DAEMON_CONN_H

#include "drain.h"
#include "registry.h"
#include "wire.h"

#include <stdint.h>
#include <uv.h>

typedef struct td__server td__server;
typedef struct td__conn td__conn;
typedef struct td__create td__create; /* ops.c */
struct Tensord__Response;

struct td__conn {
  uv_poll_t poll;
  uv_timer_t stall; /* runs while a request is half-read or replies unsent */
  int nhandles;     /* handles not yet closed, and the drain of hold while it
                       runs: the last to end frees c */
  uint64_t progress_ms; /* loop time bytes last moved either way */
  td__server *srv;
  td__wire wire;
  td__holdings hold;
  td__drain drain; /* hold's references, dropped after the close */
  char name[64];
  int hello;    /* Hello done */
  int closing;  /* uv_close called */
  int in_batch; /* processing a read batch: flush once at its end */
  int paused;   /* not reading: output over the high-water mark */
  int eof;      /* the client shut its side: send what is due, then close */
  int events;   /* what poll watches now */
  struct td__wait *waiters;
  uint32_t nwaiters; /* in waiters: at most --max-waiters-per-client */
  td__create *creates;
  uint32_t ncreates;  /* in creates: they count as storages held */
  uint64_t nrequests; /* requests it has sent */
  uint64_t req_ns;    /* uv_hrtime when the request in hand arrived */
  int req_timed;      /* its handler times it (a create: create_finish) */
  struct td__chan_end *chan_ends; /* its ends of channels (chanops.c) */
  uint32_t nchan_ends;
  td__scope *scopes;  /* it opened and has not ended */
  uint32_t nscopes;
  /* Watching (watch.c): the connection takes no other request, its
   * events go with watch_seq, and those its output had no room for are
   * counted in watch_dropped until one is sent. Exempt from the io
   * timeout: its output is bounded (TD__WATCH_OUT_MAX) and it drops. */
  int watching;
  uint64_t watch_seq;
  uint64_t watch_dropped;
  size_t watch_prefix_len;
  char watch_prefix[TD_KEY_MAX];
  td__conn *wprev, *wnext; /* in srv->watchers */
  uint32_t hindex; /* its number in a live upgrade's handover */
  td__conn *prev, *next;
};

/* Takes ownership of fd (a connected socket). */
int td__conn_accept(td__server *srv, int fd);
/* Takes ownership of fd (a connected socket) and groups (malloc'd, ngroups
 * of them) for a connection a live upgrade hands over: c is set up like an
 * accepted one, but nothing is polled until td__conn_resume. Returns c, or
 * NULL (no memory) with fd and groups freed. */
td__conn *td__conn_adopt(td__server *srv, int fd, const td__peer *peer,
                         gid_t *groups, int ngroups);
/* Stops polling c and its stall timer (a live upgrade is quiescing);
 * whatever arrives waits in the kernel's buffers. */
void td__conn_quiesce(td__conn *c);
/* Polls c again as its state asks (after td__conn_quiesce or
 * td__conn_adopt). */
void td__conn_resume(td__conn *c);
/* Closes c: its socket at the end of this loop turn, its waiters and creates
 * in flight at once; what it holds is dropped now if little, else over the
 * next turns (drain.h), and c freed after that. */
void td__conn_close(td__conn *c, const char *why);
/* Queues r (with fd >= 0 attached, ownership taken) and flushes unless a
 * read batch is in progress. Returns 0, or a negative code if r was not
 * queued: the connection is closing (fd closed), or r would exceed the
 * frame limit (fd closed, an EMSGSIZE Error sent instead, the connection
 * kept). */
int td__conn_send(td__conn *c, struct Tensord__Response *r, int fd);
/* td__conn_send with nfds fds (at most TD__FRAME_MAX_FDS), all of whose
 * ownership it takes. */
int td__conn_send_fds(td__conn *c, struct Tensord__Response *r, const int *fds,
                      unsigned nfds);
/* Queues r (no fd) for a watcher c without sending it: the loop sends it
 * when c's socket is writable. Never closes c, so it may be called from the
 * middle of another connection's request. Returns 0, TD_ECONNRESET if c is
 * closing, or TD_ENOMEM (nothing queued). */
int td__conn_queue(td__conn *c, struct Tensord__Response *r);
/* Sends an Error reply for seq. Returns code. */
int td__conn_error(td__conn *c, uint64_t seq, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Queues an already packed Response (and fd >= 0, ownership taken). */
int td__conn_send_frame(td__conn *c, const uint8_t *frame, size_t len, int fd);

#endif /* TD_DAEMON_CONN_H */

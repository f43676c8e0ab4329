/* server.h: the daemon as a whole: its loop, listening socket, registry,
 * connections, options, and how it starts and stops. */
#ifndef TD_DAEMON_SERVER_H
#define TD_DAEMON_SERVER_H

#include "backend.h"
#include "conn.h"
#include "events.h"
#include "metrics.h"
#include "pool.h"
#include "registry.h"
#include "scrape.h"
#include "waitq.h"

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

/* Defaults of the limits that have one (see docs/security.md). */
#define TD__MAX_WAITERS_PER_CLIENT 4096
#define TD__MAX_KEYS_PER_UID 100000
/* The recycling pool holds at most this share of the capacity by default,
 * and a pooled segment idle this long goes. */
#define TD__RECYCLE_SHARE 4
#define TD__RECYCLE_IDLE_MS 30000
/* A live upgrade's handover, from Begin to Started, at most (upgrade.c):
 * the old daemon's clients wait that long for a successor that stalls. */
#define TD__UPGRADE_TIMEOUT_MS 10000

typedef struct td__state td__state;     /* state.c */
typedef struct td__upgrade td__upgrade; /* upgrade.c */

struct td__server {
  uv_loop_t *loop;
  td__registry reg;
  int listen_fd;
  int own_socket; /* we bound it: unlink at exit */
  uv_poll_t listen_poll;
  uv_timer_t accept_timer; /* retry after EMFILE */
  uv_signal_t sigint, sigterm;
  char socket_path[108];
  char state_dir[256]; /* "" without --state-dir */
  char run_path[120];  /* <socket>.instance: the prefixes of our segments */
  char (*prev)[TD__PREFIX_MAX]; /* prefixes the previous daemon recorded */
  size_t nprev;
  char prefix[TD__PREFIX_MAX]; /* shm name prefix of this instance */
  /* Every prefix our segments have, as recorded in run_path: prefix, the
   * pool's, then those of adopted segments (StatReply.prefixes). */
  char (*prefixes)[TD__PREFIX_MAX];
  size_t nprefixes;
  uint64_t instance;
  int64_t start_ms;
  int stopping; /* td__server_stop has begun */
  int stopped;  /* ... and finished: the registry and state are freed */
  td__conn *conns;
  uint64_t nconns; /* connected: closed ones still draining do not count */
  td__drain *drains, *drains_tail; /* closed clients' holdings: drain.c */
  uint64_t ndrains;
  uv_idle_t drain_idle;  /* drops a slice per turn while drains are queued */
  int drain_ready;       /* drain_idle is initialised */
  td__waits waits;       /* lookups waiting for keys */
  td__pool pool;         /* freed segments kept for reuse (segment.c) */
  uv_timer_t pool_timer; /* ages the pool out */
  struct td__unlink_batch *unlinks; /* small unlinks not yet queued */
  uv_check_t unlink_check;          /* queues them at the end of a turn */
  uint64_t pending_work; /* thread-pool jobs in flight: see td__work_done */
  td__state *state;      /* NULL without --state-dir */
  int keep_segments;     /* keyed segments stay: a stop with --state-dir, or a
                            start that failed after serving keys again */
  int listening;         /* the socket, timer and signal handles are set up */
  uint32_t max_clients;  /* 0: no limit */
  uint32_t max_storages_per_client;
  uint32_t max_waiters_per_client; /* lookups waiting at once */
  uint64_t max_keys_per_uid;       /* keys one uid has published */
  uint64_t io_timeout_ms; /* a half-sent request or unread replies, at most */
  td__metrics metrics;    /* counters: metrics.h */
  td__scrape scrape;      /* --metrics: scrape.h (scrape.open unset without) */
  td__conn *watchers;     /* connections that watch events (events.c) */
  int emitting;           /* an event is being sent to them */
  /* The connection whose request is being handled (td__dispatch), to name
   * who caused what a request sets off, and the key it names (len bytes, or
   * NULL); NULL between requests. */
  td__conn *current;
  const char *current_key;
  size_t current_key_len;
  int quiesced;           /* a live upgrade: nothing is polled */
  td__upgrade *upgrade;   /* the live upgrade in progress, or NULL */
  char *const *argv;      /* as started: a spawned upgrade reuses them */
  const char *binary;     /* the path started from, resolved at start */
  /* A live upgrade's handover, from Begin to Started, at most. */
  uint64_t upgrade_timeout_ms;
};

typedef struct td__options {
  const char *socket_path;
  uint64_t capacity; /* 0: half of /dev/shm */
  uint64_t quota;    /* per uid; 0: none */
  uint32_t max_clients;
  uint32_t max_storages_per_client;
  uint32_t max_waiters_per_client; /* 0: the default, 4096 */
  uint64_t max_keys_per_uid;       /* 0: the default, 100000 */
  uint64_t io_timeout_ms;          /* 0: the default, 30 s */
  uint64_t upgrade_timeout_ms;     /* 0: the default, 10 s */
  const char *socket_group;        /* chown the socket to this group */
  int socket_mode;                 /* the socket's mode; -1: 0600 */
  const char *state_dir;
  int recycle_set;          /* recycle_bytes was given (0 turns it off) */
  uint64_t recycle_bytes;   /* default: a quarter of the capacity */
  uint64_t recycle_idle_ms; /* 0: the default, 30 s */
  const char *metrics;      /* --metrics PATH|ADDR; NULL: none */
  char *const *argv;        /* the command line (tensorctl upgrade reuses it) */
  const char *binary;       /* the executable's path, resolved at start */
} td__options;

/* Makes the directory of path, a Unix socket tensord is about to bind, if
 * it is missing (mode 0700), then checks it and every directory above it:
 * each must belong to tensord's user or root and be writable by no one else
 * unless it is sticky, or whoever owns or may write it could replace the
 * socket. sock names the socket ("socket", "metrics socket") and opt the
 * option that chose it ("--socket", "--metrics"), for the messages. Returns
 * 0, or a negative code after logging why. */
int td__socket_dir(const char *path, const char *sock, const char *opt);
/* Returns a new Unix stream socket (non-blocking, close-on-exec) bound to
 * path, which has mode from the moment it exists (the umask is set around
 * bind: call it before the loop runs, while no other thread may look), or
 * -errno (TD_ENAMETOOLONG for a path too long) with nothing left open. The
 * caller owns the fd. */
int td__socket_bind(const char *path, mode_t mode);
/* Sets srv up without a socket: for tests and the fuzz target, which hand
 * it connections with td__conn_accept. */
void td__server_init(td__server *srv, uv_loop_t *loop, const td__options *o);
/* td__server_init, then listens (or adopts LISTEN_FDS), loads --state-dir
 * and signals readiness. */
int td__server_start(td__server *srv, uv_loop_t *loop, const td__options *o);
/* Polls the listening socket and sets up the timers, checks and signal
 * handlers of a serving daemon (td__server_start, or a live upgrade taking
 * over). */
void td__server_listen(td__server *srv);
/* Starts (on) or stops accepting new clients: a stop leaves them waiting in
 * the listening socket's backlog. */
void td__server_accepting(td__server *srv, int on);
/* Tells systemd (or whoever set NOTIFY_SOCKET) state, with MAINPID=<our
 * pid>. */
void td__server_notify(const char *state);
/* The same with MAINPID=pid: a live upgrade's old daemon names its
 * successor before it exits, so that systemd never sees the service's main
 * process gone (it reads notifications before SIGCHLD). state may be "". */
void td__server_notify_pid(const char *state, int pid);
/* After the loop has ended: without --state-dir, a last sweep of the
 * instance's segments; with it, nothing (the next start sweeps). */
void td__server_finish(td__server *srv);
/* Stops accepting and closes every client at once, dropping what they held
 * (and what closed clients still held, see drain.h) now. Then, once no job is
 * left on the thread pool (a journal sync or a compaction would use the
 * state, a create the registry), writes the final snapshot of --state-dir
 * and frees every storage: at once if none is in flight, else from the
 * td__work_done of the last one (srv->stopped says when). Storages that
 * keys name keep their segments with --state-dir; every other segment is
 * unlinked. */
void td__server_stop(td__server *srv);
/* Every thread-pool job's completion callback ends with this, after
 * whatever it queued in turn: it counts the job out of srv->pending_work
 * and finishes a stop that was waiting for it. */
void td__work_done(td__server *srv);

/* Unsent event bytes a watcher's output may hold; an event that would pass
 * it is dropped and counted for the watcher (events.c). */
#define TD__WATCH_OUT_MAX (256u * 1024)

void td__event_emit_slow(td__server *srv, const td__event *ev);
/* Sends ev to every watcher whose prefix it matches. Costs one comparison
 * when nobody watches (it is on every request's path). */
static inline void td__event_emit(td__server *srv, const td__event *ev) {
  if (srv->watchers != NULL)
    td__event_emit_slow(srv, ev);
}
/* Makes c a watcher of the events whose key begins with prefix (len bytes;
 * an empty prefix: every event), each sent as an Event with seq. Returns 0,
 * or TD_EBUSY if c watches already. */
int td__watch_start(td__conn *c, uint64_t seq, const uint8_t *prefix,
                    size_t len);
/* Takes c off the watchers, if it is one. */
void td__watch_stop(td__conn *c);

/* Queues c's lookup a of key (len bytes), new or handed over by a live
 * upgrade, behind the others for that key (ops.c). Unless the key comes
 * first, it is answered TD_ETIMEDOUT (after wait_ms, it says) at deadline_ms
 * (loop time, CLOCK_MONOTONIC ms, the same in every process; -1: never), at
 * once if that has passed. Returns 0, or TD_ENOMEM with nothing queued. */
int td__wait_restore(td__conn *c, const char *key, size_t len,
                     const td__lookup_args *a, int32_t wait_ms,
                     int64_t deadline_ms);
/* Calls fn for every waiter, each key's queue in arrival order, with its
 * connection, key, arguments, wait and deadline (as td__wait_restore takes
 * them). Stops at the first non-zero fn return and returns it, else 0. */
typedef int (*td__wait_each_fn)(void *arg, td__conn *c, const char *key,
                                size_t len, const td__lookup_args *a,
                                int32_t wait_ms, int64_t deadline_ms);
int td__waits_each(td__waits *ws, td__wait_each_fn fn, void *arg);

#endif /* TD_DAEMON_SERVER_H */

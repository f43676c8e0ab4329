/* server.h: the daemon's data: its loop, listening socket, registry,
 * connections and options, and the hooks through which connections and
 * thread-pool jobs reach the files above them (start.c starts and stops). */
#ifndef TD_DAEMON_SERVER_H
#define TD_DAEMON_SERVER_H

#include "backend.h"
#include "channel.h"
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
typedef struct td__conn td__conn;       /* conn.c */
typedef struct td__drain td__drain;     /* drain.c */
struct Tensord__Request;

/* What connections and thread-pool jobs call up into, set by
 * td__server_init (start.c): so that they include no header of the files
 * above them (tests/layers allows no circle of more than 3 files). */
typedef struct td__hooks {
  /* Handles one request (ops.c): 0, or a protocol error's code. */
  int (*dispatch)(td__conn *c, struct Tensord__Request *req);
  /* c is closing: its waiters, creates, held replies and part in an
   * upgrade are forgotten. */
  void (*conn_gone)(td__conn *c);
  /* The last thread-pool job a stop waited for is done. */
  void (*stopped)(td__server *srv);
} td__hooks;

struct td__server {
  uv_loop_t *loop;
  td__hooks hooks;
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
  td__chans chans;       /* channels (chanops.c) */
  uv_timer_t chan_timer; /* their repairs and checks (chanops.c) */
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
  td__conn *watchers;     /* connections that watch events (watch.c) */
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

/* Every thread-pool job's completion callback ends with this, after
 * whatever it queued in turn: it counts the job out of srv->pending_work
 * and finishes a stop that was waiting for it. */
static inline void td__work_done(td__server *srv) {
  srv->pending_work--;
  if (srv->stopping && !srv->stopped && srv->pending_work == 0)
    srv->hooks.stopped(srv);
}

#endif /* TD_DAEMON_SERVER_H */

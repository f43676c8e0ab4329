/* daemon.h: tensord's internal structures, shared by the daemon's files. */
#ifndef TD_DAEMON_H
#define TD_DAEMON_H

#include "htab.h"
#include "common.h"
#include "tensord.h"
#include "wire.h"

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

/* ---- log.c ---- */
enum { TD_LOG_ERROR, TD_LOG_WARN, TD_LOG_INFO, TD_LOG_DEBUG };
extern int td__log_level;
void td__log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define td__error(...) td__log(TD_LOG_ERROR, __VA_ARGS__)
#define td__warn(...) td__log(TD_LOG_WARN, __VA_ARGS__)
#define td__info(...)                                                          \
  do {                                                                         \
    if (td__log_level >= TD_LOG_INFO)                                          \
      td__log(TD_LOG_INFO, __VA_ARGS__);                                       \
  } while (0)
#define td__debug(...)                                                         \
  do {                                                                         \
    if (td__log_level >= TD_LOG_DEBUG)                                         \
      td__log(TD_LOG_DEBUG, __VA_ARGS__);                                      \
  } while (0)
int td__log_level_parse(const char *s);
int64_t td__now_ms(void); /* wall clock, ms since the epoch */
/* Formats n bytes as "1.5 GiB"; returns buf. */
char *td__human_bytes(uint64_t n, char *buf, size_t len);
/* Parses "64M", "1.5GiB", "4096"; returns 0 or TD_EINVAL. */
int td__parse_size(const char *s, uint64_t *out);

/* ---- registry.c: storages, references and keys; no I/O ---- */

/* Who holds references: one per connection. */
typedef struct td__peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
} td__peer;

typedef struct td__storage td__storage;
typedef struct td__key td__key;

/* A connection's references to one storage, by mode. */
typedef struct td__ref {
  td__hnode node; /* in td__holdings.refs, by storage id */
  td__storage *storage;
  const td__peer *peer;
  struct td__ref *sprev, *snext; /* in storage->holders */
  uint32_t rw, ro;
} td__ref;

#define TD__GROUPS_MAX 64

/* Everything one connection holds, and who it is. */
typedef struct td__holdings {
  td__htab refs;
  td__peer peer;
  uint64_t nrefs; /* sum of rw + ro over refs */
  int ngroups;    /* supplementary groups (SO_PEERGROUPS), at most 64 */
  gid_t groups[TD__GROUPS_MAX];
} td__holdings;

/* What an operation needs of a storage. */
#define TD__MAY_READ 04
#define TD__MAY_WRITE 02

struct td__storage {
  td__hnode node;           /* in registry.storages, by id */
  td__storage *prev, *next; /* registry list, in id order */
  uint64_t id;
  uint64_t nbytes;
  td_device device;
  uint32_t refs;  /* holders' references plus one per key */
  uint32_t mode;  /* rw bits for owner, group, other: 0600 by default */
  td__peer owner; /* the creator: pid, and the uid and gid that own it */
  int64_t created_ms;
  td__ref *holders;
  td__key *keys;
  char name[64]; /* the shm object's name, "/tensord.<instance>.<id>" */
};

struct td__key {
  td__hnode node; /* in registry.keys */
  td__storage *storage;
  td__key *sprev, *snext; /* in storage->keys */
  td_view view;
  int64_t published_ms;
  size_t len;
  char name[]; /* len bytes, NUL-terminated */
};

/* Called when a storage's last reference goes: the owner of the registry
 * releases the segment and frees s (the registry no longer knows it). */
typedef void (*td__storage_free_fn)(td__storage *s, void *arg);

typedef struct td__registry {
  td__htab storages;
  td__storage *first, *last;
  td__htab keys;
  td__htab usage; /* td__usage by uid */
  uint64_t next_id;
  uint64_t bytes_used;      /* live storages */
  uint64_t bytes_committed; /* live storages and creates in flight */
  uint64_t capacity;
  uint64_t quota;     /* most bytes one uid may own; 0: no quota */
  uint64_t nholdings; /* holdings with at least one reference */
  td__storage_free_fn free_fn;
  void *free_arg;
} td__registry;

void td__registry_init(td__registry *r, uint64_t capacity,
                       td__storage_free_fn fn, void *arg);
/* Charges a create of n bytes owned by uid against the capacity and uid's
 * quota. Returns 0, TD_ENOMEM (capacity) or TD_EDQUOT (quota), with the
 * figures in msg; nothing is charged on failure. force charges past the
 * limits (storages adopted at a restart). A storage inserted later
 * keeps the charge until it is freed; a create that fails gives it back
 * with td__credit. */
int td__charge(td__registry *r, uid_t uid, uint64_t n, int force, char *msg,
               size_t len);
void td__credit(td__registry *r, uid_t uid, uint64_t n);
/* Bytes uid owns now, creates in flight included. */
uint64_t td__usage_of(const td__registry *r, uid_t uid);
/* Frees every key; storages then left unreferenced go to free_fn. */
void td__registry_drop_keys(td__registry *r);
void td__registry_free(td__registry *r);
td__storage *td__storage_find(const td__registry *r, uint64_t id);
/* Registers s (id, nbytes, name set by the caller) with one read-write
 * reference held by h, or with none if h is NULL (the caller then publishes
 * a key on it at once). Returns 0 or TD_ENOMEM (nothing changed). */
int td__storage_insert(td__registry *r, td__storage *s, td__holdings *h);
/* First storage with id > after_id, in id order; NULL if none. */
td__storage *td__storage_after(const td__registry *r, uint64_t after_id);

void td__holdings_init(td__holdings *h, const td__peer *peer);
/* Drops every reference h holds (connection gone). */
void td__holdings_clear(td__registry *r, td__holdings *h);
td__ref *td__ref_find(const td__holdings *h, uint64_t id);
/* Adds one reference of mode ro to s for h. *had gets the references of that
 * mode h held before (so 0 means the process has no such mapping yet).
 * Returns 0 or TD_ENOMEM (nothing changed). */
int td__ref_add(td__registry *r, td__holdings *h, td__storage *s, int ro,
                uint32_t *had);
/* Drops count references of mode ro. Returns 0, or TD_ENOENT if h holds
 * fewer (nothing changed). May free the storage. */
int td__ref_drop(td__registry *r, td__holdings *h, uint64_t id, int ro,
                 uint32_t count);

/* Returns 0 if h may do what want asks (TD__MAY_READ, TD__MAY_WRITE) to s,
 * judged like a file: root may do anything; then the owner's bits if h is
 * the owner, the group's if h is in the owning group, else the others'.
 * Returns TD_EACCES otherwise. */
int td__may(const td__storage *s, const td__holdings *h, int want);
/* Formats who owns s and how ("mode 0640, owner uid 1000 gid 100"). */
char *td__describe_access(const td__storage *s, char *buf, size_t len);

td__key *td__key_find(const td__registry *r, const char *key, size_t len);
/* Names view of s key, replacing an existing key. Returns 0 or TD_ENOMEM. */
int td__key_publish(td__registry *r, const char *key, size_t len,
                    td__storage *s, const td_view *view, td__key **out);
/* Unnames k; drops its reference (which may free the storage). */
void td__key_remove(td__registry *r, td__key *k);
/* Checks a key: 1-255 bytes of UTF-8 without NUL. Returns 0 or TD_EINVAL
 * with the reason in msg. */
int td__key_validate(const char *key, size_t len, char *msg, size_t msglen);

/* ---- shm.c: the CPU backend ---- */
/* Creates the object name with mode 0600 and reserves nbytes of pages.
 * Returns an O_RDWR fd (>= 0) or a negative code with msg filled; nothing is
 * left behind on failure. Blocking: runs on the thread pool. */
int td__shm_create(const char *name, uint64_t nbytes, char *msg, size_t len);
/* Opens a new file description on an existing object. */
int td__shm_open(const char *name, int readonly);
void td__shm_unlink(const char *name);
/* Free and total bytes of /dev/shm. */
int td__shm_space(uint64_t *free_bytes, uint64_t *total_bytes);
/* Unlinks every object named prefix* (leftovers of this instance). */
int td__shm_unlink_prefix(const char *prefix);
/* Segment names are "/tensord.<instance>.<id>"; the prefix is the name up to
 * and including the last '.'. Returns 0, or TD_EINVAL for another name. */
#define TD__PREFIX_MAX 48
int td__shm_prefix(const char *name, char out[TD__PREFIX_MAX]);

/* ---- server.c and conn.c ---- */
typedef struct td__server td__server;
typedef struct td__conn td__conn;
typedef struct td__waiter td__waiter;
typedef struct td__create td__create;
typedef struct td__state td__state;

struct td__conn {
  uv_poll_t poll;
  uv_timer_t stall; /* runs while a request is half-read or replies unsent */
  int nhandles;     /* handles not yet closed; the last close frees c */
  uint64_t progress_ms; /* loop time bytes last moved either way */
  td__server *srv;
  td__wire wire;
  td__holdings hold;
  char name[64];
  int hello;    /* Hello done */
  int closing;  /* uv_close called */
  int in_batch; /* processing a read batch: flush once at its end */
  int paused;   /* not reading: output over the high-water mark */
  int eof;      /* the client shut its side: send what is due, then close */
  int events;   /* what poll watches now */
  td__waiter *waiters;
  td__create *creates;
  td__conn *prev, *next;
};

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
  uint64_t instance;
  int64_t start_ms;
  int stopping;
  td__conn *conns;
  uint64_t nconns;
  td__htab waitqs; /* key -> lookups waiting for it */
  uint64_t nwaiters;
  uint64_t pending_work; /* thread-pool jobs in flight */
  td__state *state;      /* NULL without --state-dir */
  int keep_segments;     /* stopping with --state-dir: keep keyed segments */
  int listening;         /* the socket, timer and signal handles are set up */
  uint32_t max_clients;  /* 0: no limit */
  uint32_t max_storages_per_client;
  uint64_t io_timeout_ms; /* a half-sent request or unread replies, at most */
};

typedef struct td__options {
  const char *socket_path;
  uint64_t capacity; /* 0: half of /dev/shm */
  uint64_t quota;    /* per uid; 0: none */
  uint32_t max_clients;
  uint32_t max_storages_per_client;
  uint64_t io_timeout_ms;   /* 0: the default, 30 s */
  const char *socket_group; /* chown the socket to this group */
  int socket_mode;          /* chmod the socket; -1: leave it */
  const char *state_dir;
} td__options;

/* Sets srv up without a socket: for tests and the fuzz target, which hand
 * it connections with td__conn_accept. */
void td__server_init(td__server *srv, uv_loop_t *loop, const td__options *o);
/* td__server_init, then listens (or adopts LISTEN_FDS), loads --state-dir
 * and signals readiness. */
int td__server_start(td__server *srv, uv_loop_t *loop, const td__options *o);
/* After the loop has ended: the final snapshot, or a last sweep of
 * segments. */
void td__server_finish(td__server *srv);
/* Stops accepting, closes every client and frees every storage. */
void td__server_stop(td__server *srv);
/* Takes ownership of fd (a connected socket). */
int td__conn_accept(td__server *srv, int fd);
void td__conn_close(td__conn *c, const char *why);
/* Queues r (with fd >= 0 attached, ownership taken) and flushes unless a
 * read batch is in progress. Returns 0 or a negative code (the connection is
 * then closing). */
struct Tensord__Response;
int td__conn_send(td__conn *c, struct Tensord__Response *r, int fd);
/* Sends an Error reply for seq. */
int td__conn_error(td__conn *c, uint64_t seq, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Queues an already packed Response (and fd >= 0, ownership taken). */
int td__conn_send_frame(td__conn *c, const uint8_t *frame, size_t len, int fd);

/* ---- state.c: --state-dir ---- */
/* Loads DIR (creating it), serves its keys again, unlinks unnamed segments
 * of the instances it records, and sets srv->state. */
int td__state_open(td__server *srv, const char *dir);
/* Records a key change, before the registry makes it (so that a segment
 * the change frees is held until the record is on disk); replies that
 * acknowledge it go through td__state_reply, which holds them until the
 * change is on disk. st may be NULL (no --state-dir): then nothing is
 * recorded or held. */
void td__state_put(td__state *st, const char *key, size_t len,
                   const td__storage *s, const td_view *view);
void td__state_del(td__state *st, const char *key, size_t len);
int td__state_reply(td__state *st, td__conn *c, struct Tensord__Response *r,
                    int fd);
void td__state_conn_gone(td__state *st, const td__conn *c);
/* Holds the unlink of a freed segment until every key change recorded so
 * far is on disk. Returns 1 if it did, 0 if the caller may unlink now (no
 * change pending, or st NULL). */
int td__state_hold_unlink(td__state *st, const char *name, uint64_t nbytes);
/* Writes a final snapshot and closes. NULL ok. */
void td__state_close(td__state *st);

/* ---- ops.c: requests ---- */
struct Tensord__Request;
/* Handles one request. Returns 0, or a negative code for a protocol error
 * (the caller closes the connection). */
int td__dispatch(td__conn *c, struct Tensord__Request *req);
/* Forgets c's waiters and pending creates (connection closing). */
void td__ops_conn_gone(td__conn *c);
/* Releases a storage whose last reference went (the registry's free_fn). */
void td__storage_gone(td__storage *s, void *arg);
/* Unlinks a segment, on the thread pool if it is large. */
void td__segment_unlink(td__server *srv, const char *name, uint64_t nbytes);

#endif /* TD_DAEMON_H */

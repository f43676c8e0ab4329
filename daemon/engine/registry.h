/* registry.h: storages, the references connections hold to them, and the
 * keys that name them. Pure bookkeeping: no I/O, no event loop, no backend;
 * the registry's owner is told (free_fn) when a storage's last reference
 * goes. */
#ifndef TD_DAEMON_REGISTRY_H
#define TD_DAEMON_REGISTRY_H

#include "htab.h"
#include "tensord.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Who holds references: one per connection. */
typedef struct td__peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
} td__peer;

typedef struct td__storage td__storage;
typedef struct td__key td__key;
typedef struct td__scope td__scope;

/* A connection's references to one storage, by mode. */
typedef struct td__ref {
  td__hnode node; /* in td__holdings.refs, by storage id */
  td__storage *storage;
  const td__peer *peer;
  struct td__ref *sprev, *snext; /* in storage->holders */
  uint32_t rw, ro;
} td__ref;

/* Everything one connection holds, and who it is. */
typedef struct td__holdings {
  td__htab refs;
  td__peer peer;
  uint64_t nrefs; /* sum of rw + ro over refs */
  /* Every supplementary group of the peer (SO_PEERGROUPS), in an array its
   * connection allocates and frees; the registry only reads it. */
  int ngroups;
  gid_t *groups;
  /* The client's name (its Hello), owned by its connection: "" before. */
  const char *name;
  /* The keys that carry an event this connection published (through
   * td__key_set_event): the event is this process's, and goes with it. */
  td__key *events;
} td__holdings;

/* The holdings a reference belongs to (its peer is theirs). */
static inline const td__holdings *td__ref_holdings(const td__ref *r) {
  return (const td__holdings *)((const char *)r->peer -
                                offsetof(td__holdings, peer));
}

/* What an operation needs of a storage. */
#define TD__MAY_READ 04
#define TD__MAY_WRITE 02

struct td__storage {
  td__hnode node;           /* in registry.storages, by id */
  td__storage *prev, *next; /* registry list, in id order */
  uint64_t id;
  uint64_t nbytes;
  td_device device;
  uint32_t refs; /* holders' references plus one per key */
  uint32_t mode; /* rw bits for owner, group, other: 0600 by default */
  /* An fd on it went to a process of another uid (which may map it after
   * it is freed), or it was adopted at a start (no one knows who maps
   * it): its segment is never recycled. */
  int foreign;
  int named;      /* a key has named it: a journal may record its segment */
  td__peer owner; /* the creator: pid, and the uid and gid that own it */
  int64_t created_ms;
  td__ref *holders;
  td__key *keys;
  /* The backend's name for the bytes (for shm, the object's name,
   * "/tensord.<instance>.<id>-<random tail>"); the registry only carries
   * it. */
  char name[64];
  /* TD_CUDA: the GPU's UUID, and the bytes its allocation really has
   * (nbytes rounded up to the granularity; set by the create). */
  uint8_t uuid[16];
  uint64_t alloc_size;
  /* TD_CUDA: the allocation's identity (td__created.alloc_id), which a
   * client's mapping cache knows a recycled allocation by. */
  uint64_t alloc_id;
  /* TD_CUDA on a GPU without POSIX-fd handles: no fd is ever sent; every
   * reply carries ipc_handle (a CUipcMemHandle), which a client opens once
   * per process. Set by the create. */
  int legacy;
  uint8_t ipc_handle[64];
};

struct td__key {
  td__hnode node; /* in registry.keys */
  td__storage *storage;
  uid_t uid; /* who published it: it counts against that uid's keys */
  td__key *sprev, *snext; /* in storage->keys */
  td_view view;
  int64_t published_ms;
  td__scope *scope; /* the scope it goes with, or NULL */
  /* A CUDA IPC event handle the publisher recorded after its writes, for
   * consumers to wait on (has_event); never journaled. It names an event
   * of the publisher's process (evby's), which no other can keep alive:
   * it goes from the key when that connection goes
   * (td__holdings_drop_events). */
  int has_event;
  uint8_t event[64];
  td__holdings *evby;
  td__key *eprev, *enext; /* in evby->events */
  td__key *cprev, *cnext; /* in scope->keys */
  size_t len;
  char name[]; /* len bytes, NUL-terminated */
};

/* A scope (td_scope_open): keys in flight that go when it ends. It belongs
 * to one connection (owner, opaque here), which ends it by closing it or
 * by going away. */
struct td__scope {
  td__hnode node; /* in registry.scopes, by token */
  uint64_t token;
  uid_t uid;   /* the owner's: who may publish into it (and root) */
  void *owner; /* the connection that opened it */
  td__key *keys;
  uint64_t nkeys;
  td__scope *oprev, *onext; /* in the owner's list */
};

/* Called when a storage's last reference goes: the owner of the registry
 * releases the segment and frees s (the registry no longer knows it). */
typedef void (*td__storage_free_fn)(td__storage *s, void *arg);

typedef struct td__registry {
  td__htab storages;
  td__storage *first, *last;
  td__htab keys;
  td__htab scopes; /* td__scope by token */
  td__htab usage;  /* td__usage by uid */
  uint64_t next_id;
  uint64_t bytes_used;      /* live storages */
  uint64_t bytes_committed; /* live storages and creates in flight */
  uint64_t capacity;
  uint64_t quota;     /* most bytes one uid may own; 0: no quota */
  uint64_t nholdings; /* holdings with at least one reference */
  td__storage_free_fn free_fn;
  void *free_arg;
} td__registry;

/* The bytes of s that count against the capacity and the quotas: a
 * device's storages count against their device's capacity instead. */
static inline uint64_t td__host_bytes(const td__storage *s) {
  return s->device == TD_CPU ? s->nbytes : 0;
}

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
/* Keys uid has published that are still there. */
uint64_t td__keys_of(const td__registry *r, uid_t uid);
/* Calls fn once per uid that owns bytes or has published keys, in no
 * particular order; fn must not change the registry. */
typedef void (*td__usage_fn)(uid_t uid, uint64_t bytes, uint64_t keys,
                             void *arg);
void td__usage_each(const td__registry *r, td__usage_fn fn, void *arg);
/* Frees every key; storages then left unreferenced go to free_fn. */
void td__registry_drop_keys(td__registry *r);
void td__registry_free(td__registry *r);
td__storage *td__storage_find(const td__registry *r, uint64_t id);
/* Registers s (id, nbytes, name set by the caller) with one read-write
 * reference held by h, or with none if h is NULL (the caller then publishes
 * a key on it at once). Returns 0 or TD_ENOMEM (nothing changed). */
int td__storage_insert(td__registry *r, td__storage *s, td__holdings *h);
/* Undoes td__storage_insert of s while it has no reference (inserted with
 * h NULL, its key not published): s is unregistered, but neither freed
 * nor credited. */
void td__storage_remove(td__registry *r, td__storage *s);
/* First storage with id > after_id, in id order; NULL if none. */
td__storage *td__storage_after(const td__registry *r, uint64_t after_id);

void td__holdings_init(td__holdings *h, const td__peer *peer);
/* Drops every reference h holds (connection gone), in time linear in their
 * number; storages left unreferenced go to free_fn. */
void td__holdings_clear(td__registry *r, td__holdings *h);
/* Drops h's references to at most max storages (whatever their counts),
 * the same way (and, at the first call, the events of
 * td__holdings_drop_events), for a caller that spreads a large clear over
 * several turns of its loop; a series of calls costs what one
 * td__holdings_clear would. Returns the storages h still holds: 0 once h is
 * empty (its table freed). Between calls h is consistent (listings show its
 * remaining references) and must outlive them: its refs point at h->peer. */
size_t td__holdings_clear_some(td__registry *r, td__holdings *h, size_t max);
td__ref *td__ref_find(const td__holdings *h, uint64_t id);
/* Adds one reference of mode ro to s for h. *had gets the references of that
 * mode h held before (so 0 means the process has no such mapping yet).
 * Returns 0, TD_ENOMEM, or TD_EOVERFLOW if s (or h's count of that mode)
 * has 2^32 - 1 references already; nothing changed on failure. */
int td__ref_add(td__registry *r, td__holdings *h, td__storage *s, int ro,
                uint32_t *had);
/* Gives h rw read-write and ro read-only references to s at once (a live
 * upgrade rebuilding what a connection held; h holds none of s yet).
 * Returns 0, TD_ENOMEM, or TD_EOVERFLOW if the counts do not fit; nothing
 * changed on failure. */
int td__ref_restore(td__registry *r, td__holdings *h, td__storage *s,
                    uint32_t rw, uint32_t ro);
/* Drops count references of mode ro. Returns 0, or TD_ENOENT if h holds
 * fewer (nothing changed). May free the storage. */
int td__ref_drop(td__registry *r, td__holdings *h, uint64_t id, int ro,
                 uint32_t count);

/* Returns 0 if h may do what want asks (TD__MAY_READ, TD__MAY_WRITE) to s,
 * judged like a file: root may do anything; then the owner's bits if h is
 * the owner, the group's if h is in the owning group, else the others'.
 * Returns TD_EACCES otherwise. */
int td__may(const td__storage *s, const td__holdings *h, int want);
/* td__may for anything owned by owner with mode (a channel). */
int td__may_mode(uint32_t mode, const td__peer *owner, const td__holdings *h,
                 int want);
/* Formats who owns s and how ("mode 0640, owner uid 1000 gid 100"). */
char *td__describe_access(const td__storage *s, char *buf, size_t len);

td__key *td__key_find(const td__registry *r, const char *key, size_t len);

/* A key change between td__key_prepare and td__key_commit or _abort. */
typedef struct td__key_prep {
  td__key *k; /* the key: an existing one, or a new one not yet linked */
  int fresh;  /* k is new */
  td__storage *s;
  uid_t uid;        /* the publisher */
  int usage_made;   /* uid's usage entry was made for this change */
  td__scope *scope; /* the key goes with this scope (a fresh key only) */
} td__key_prep;

/* First half of naming view of s key, published by uid (replacing the
 * storage an existing key names): makes every allocation and check the
 * change needs, so that td__key_commit cannot fail. Returns 0, TD_ENOMEM,
 * or TD_EOVERFLOW if s has 2^32 - 1 references; nothing changed on
 * failure. Follow it with td__key_commit or td__key_abort and no other use
 * of the registry in between (a new key is in the table already, naming
 * nothing yet). Limits on keys per uid are the caller's (td__keys_of). */
int td__key_prepare(td__registry *r, const char *key, size_t len,
                    td__storage *s, uid_t uid, td__key_prep *p);
/* Makes the change p prepared; the storage the key named before loses the
 * key's reference (which may free it). Returns the key. */
td__key *td__key_commit(td__registry *r, td__key_prep *p, const td_view *view);
/* Undoes td__key_prepare: nothing changed. */
void td__key_abort(td__registry *r, td__key_prep *p);
/* td__key_prepare, then td__key_commit. Returns 0 with the key in *out, or
 * td__key_prepare's error with nothing changed and *out untouched. */
int td__key_publish(td__registry *r, const char *key, size_t len,
                    td__storage *s, uid_t uid, const td_view *view,
                    td__key **out);
/* Unnames k; drops its reference (which may free the storage). */
void td__key_remove(td__registry *r, td__key *k);
/* Gives k the event handle ev (64 bytes), an event of by's process, in
 * place of any it had; by NULL keeps it with no publisher, so that nothing
 * drops it. td__key_commit (a republish) and td__key_remove drop a key's
 * event. */
void td__key_set_event(td__key *k, td__holdings *by, const uint8_t ev[64]);
/* Drops the event from every key that carries one h published (its
 * connection is going: its process's events go with it, and a consumer
 * that opened one after would use a destroyed event). Returns how many
 * keys lost theirs; the cost is a few stores per such key. */
size_t td__holdings_drop_events(td__holdings *h);

/* Registers a scope named token (non-zero, unused: the caller draws it at
 * random), owned by owner, a connection of uid. Returns 0, TD_EEXIST if
 * token is taken, or TD_ENOMEM; *out gets the scope. */
int td__scope_open(td__registry *r, uint64_t token, uid_t uid, void *owner,
                   td__scope **out);
td__scope *td__scope_find(const td__registry *r, uint64_t token);
/* Ends sc: unpublishes every key in it (which may free storages) and frees
 * it. Returns how many keys went. The owner unlinks sc from its list
 * first. */
uint64_t td__scope_close(td__registry *r, td__scope *sc);
/* Checks a key: 1-255 bytes of UTF-8 without NUL. Returns 0 or TD_EINVAL
 * with the reason in msg. */
int td__key_validate(const char *key, size_t len, char *msg, size_t msglen);

#endif /* TD_DAEMON_REGISTRY_H */

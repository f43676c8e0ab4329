/* waitq.h: lookups waiting for a key to be published, as plain data: one
 * queue per key in arrival order, and a list per owner (a connection, opaque
 * here). The server gives each waiter its timer and answers it. */
#ifndef TD_DAEMON_WAITQ_H
#define TD_DAEMON_WAITQ_H

#include "htab.h"
#include "registry.h"

#include <stddef.h>
#include <stdint.h>

/* Every waiting lookup of a server. */
typedef struct td__waits {
  td__htab queues; /* key -> its queue */
  uint64_t count;  /* waiters, all keys */
} td__waits;

/* What a lookup asked for, kept while it waits. */
typedef struct td__lookup_args {
  uint64_t seq;
  int readonly, take, force_fd;
} td__lookup_args;

/* One waiting lookup, embedded in its owner's bigger record (the server's
 * adds a timer). The caller sets the first five fields; the rest belong to
 * the queues. */
typedef struct td__wait {
  void *owner;            /* who waits */
  struct td__wait **list; /* the owner's list of its waiters */
  td__lookup_args args;
  int32_t wait_ms;     /* as asked: > 0, or -1 until the owner goes */
  int64_t deadline_ms; /* when it times out, in the server's clock; -1: never */
  const char *key;     /* what it waits for: len bytes, NUL-terminated */
  size_t len;
  struct td__waitq *q;            /* key's queue */
  struct td__wait *qprev, *qnext; /* in q */
  struct td__wait *oprev, *onext; /* in *list */
} td__wait;

/* Called with a waiter the queues have just let go of, which its owner
 * frees: woken, with the key to answer from; dropped, with NULL. */
typedef void (*td__wait_fn)(td__wait *w, td__key *k, void *arg);

void td__waits_init(td__waits *ws);
/* Frees the table; every waiter must be gone. */
void td__waits_free(td__waits *ws);
/* Queues w (its first five fields set) behind the other waiters of key (len
 * bytes), and in its owner's list. Returns 0, or TD_ENOMEM with nothing
 * queued. */
int td__wait_add(td__waits *ws, td__wait *w, const char *key, size_t len);
/* Takes w off its key's queue and its owner's list; the caller frees it. */
void td__wait_remove(td__waits *ws, td__wait *w);
/* Hands key k, just published in r, to its waiters in arrival order: each
 * is taken off the queues and given to fn with the key, until r no longer
 * has it (one of them took it). fn may add and remove waiters. */
void td__wait_wake(td__waits *ws, const td__registry *r, const td__key *k,
                   td__wait_fn fn, void *arg);
/* Calls fn for every waiter, each key's queue in arrival order, without
 * changing anything. Stops at the first non-zero return and returns it,
 * else 0. */
int td__waits_walk(const td__waits *ws, int (*fn)(void *arg, const td__wait *w),
                   void *arg);
/* Takes every waiter of the owner whose list is *list off the queues, each
 * then given to fn (the owner goes). */
void td__waits_drop(td__waits *ws, td__wait **list, td__wait_fn fn, void *arg);

#endif /* TD_DAEMON_WAITQ_H */

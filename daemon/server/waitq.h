/* waitq.h: lookups waiting for a key to be published: one queue per key, in
 * arrival order, each waiter with its timer. */
#ifndef TD_DAEMON_WAITQ_H
#define TD_DAEMON_WAITQ_H

#include "htab.h"
#include "registry.h"

#include <stddef.h>
#include <stdint.h>

typedef struct td__conn td__conn;
typedef struct td__server td__server;

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

/* Answers a waiting lookup now that k is published. */
typedef void (*td__wake_fn)(td__conn *c, const td__lookup_args *a, td__key *k);

void td__waits_init(td__waits *w);
/* Frees the table; every waiter must be gone (td__wait_conn_gone). */
void td__waits_free(td__waits *w);
/* Queues c's lookup a of key (len bytes) behind the others for that key.
 * After wait_ms (> 0; -1 waits until the connection goes) the lookup is
 * answered with TD_ETIMEDOUT. Returns 0, or TD_ENOMEM with nothing queued. */
int td__wait_add(td__conn *c, const char *key, size_t len,
                 const td__lookup_args *a, int32_t wait_ms);
/* Hands key k, just published, to its waiters in arrival order, each through
 * fn, until one of them takes the key. */
void td__wait_wake(td__server *srv, td__key *k, td__wake_fn fn);
/* td__wait_add for a lookup handed over by a live upgrade: it times out at
 * deadline_ms (loop time, CLOCK_MONOTONIC ms, the same in every process;
 * -1: never), at once if that has passed. Returns 0 or TD_ENOMEM. */
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
/* Drops every waiter of c (connection closing). */
void td__wait_conn_gone(td__conn *c);

#endif /* TD_DAEMON_WAITQ_H */

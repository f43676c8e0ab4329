/* ops.h: what each request does. */
#ifndef TD_DAEMON_OPS_H
#define TD_DAEMON_OPS_H

#include "conn.h"
#include "waitq.h"

struct Tensord__Request;

/* Handles one request. Returns 0, or a negative code for a protocol error
 * (the caller closes the connection). */
int td__dispatch(td__conn *c, struct Tensord__Request *req);
/* Forgets c's waiters and pending creates (connection closing). */
void td__ops_conn_gone(td__conn *c);

/* Queues c's lookup a of key (len bytes), new or handed over by a live
 * upgrade, behind the others for that key. Unless the key comes
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

#endif /* TD_DAEMON_OPS_H */

/* segment.h: a storage's bytes from creation to unlink, through its device's
 * backend: small segments on the loop, large ones on the thread pool, and
 * unlinks held back while the journal still names them. */
#ifndef TD_DAEMON_SEGMENT_H
#define TD_DAEMON_SEGMENT_H

#include "backend.h"
#include "pool.h"
#include "registry.h"

#include <stdint.h>
#include <uv.h>

typedef struct td__server td__server;
typedef struct td__segment_req td__segment_req;

/* Called once a create has finished, with req->fd the new segment's fd (the
 * callee owns it) or a negative code and req->msg saying why; or, when it
 * made memory that travels without an fd (req->s->legacy set), -1. */
typedef void (*td__segment_cb)(td__segment_req *req);

struct td__segment_req {
  uv_work_t work;
  td__server *srv;
  td__storage *s;
  td__pooled *pooled;  /* serve s from this pooled segment, or NULL */
  td__pooled *victims; /* pooled segments to unlink first (next-linked) */
  int zero;            /* the bytes must read as zeros */
  int reused;          /* out: the segment is req->pooled's */
  int fd;
  char msg[256];
  td__segment_cb cb;
};

/* Makes the segment of s (its name, nbytes and device set) and calls cb
 * exactly once: before returning for a small segment or on failure to
 * queue, from the loop later for a large one (a stop waits for it). req
 * must stay valid until cb. The segment comes from req->pooled if the
 * caller set it (falling back to a fresh one if that fails), zeroed if
 * req->zero; req->victims are unlinked before anything is made, so that
 * their space is free for it. td__segment_create owns and frees both. */
void td__segment_create(td__server *srv, td__segment_req *req, td__storage *s,
                        td__segment_cb cb);
/* Opens a new fd on s's segment for a client, read-only if readonly.
 * Returns the fd or a negative code. */
int td__segment_open(const td__storage *s, int readonly);
/* Unlinks segment name of nbytes on device off the loop: a large one in a
 * thread-pool job of its own, small ones in batches queued at the end of
 * the loop turn (a client that held 60,000 storages would otherwise spend
 * the loop's time in the kernel's unlink, 5-40 us each). While tensord is
 * not serving (not yet listening, or stopping) a small one is unlinked at
 * once. */
void td__segment_unlink(td__server *srv, td_device device, const char *name,
                        uint64_t nbytes);
/* Queues the batch of small unlinks gathered so far (the end of a loop
 * turn, or a stop, which then waits for it). */
void td__segment_unlink_flush(td__server *srv);
/* The registry's free_fn (arg is the server): s's last reference went, so
 * its segment is unlinked (once the journal no longer names it) and s
 * freed; but when a stop with --state-dir frees the registry
 * (srv->keep_segments), the segment stays for the next start. */
void td__storage_gone(td__storage *s, void *arg);
/* Puts segment name of nbytes on device, whose storage is gone, in the
 * recycling pool for uid, its owner, evicting older ones to keep the pool in
 * its bounds (td__pool_admit). The caller has checked that no other uid ever
 * had an fd on it (which may still map it). Returns 1 if it did, 0 if the
 * caller is to unlink it: tensord is stopping, or the pool refuses it. */
int td__segment_pool(td__server *srv, td_device device, const char *name,
                     uint64_t nbytes, uid_t uid);
/* Unlinks every pooled segment (a stop). */
void td__pool_drain(td__server *srv);
/* The pool's ageing timer: unlinks what was idle too long, and waits for
 * the next. */
void td__server_pool_tick(uv_timer_t *t);

/* Unlinks every segment of every backend under prefix (no leading '/'),
 * except those keep (if not NULL) keeps. Returns how many, or a negative
 * code. */
int td__segments_unlink_prefix(const char *prefix, td__keep_fn keep, void *arg);

#endif /* TD_DAEMON_SEGMENT_H */

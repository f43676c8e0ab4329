/* state.h: --state-dir: published keys journalled to disk, so that a restart
 * serves them again with the same bytes. */
#ifndef TD_DAEMON_STATE_H
#define TD_DAEMON_STATE_H

#include "conn.h"
#include "registry.h"
#include "server.h"

#include <stddef.h>

struct Tensord__Response;

/* Loads DIR (creating it), serves its keys again, unlinks unnamed segments
 * of the instances it records, and sets srv->state. Returns 0, or a
 * negative code (logged) with srv->state unset; if keys were served again
 * by then, srv->keep_segments is set, so that freeing the registry leaves
 * their segments in place. */
int td__state_open(td__server *srv, const char *dir);
/* Records a key change, before the registry makes it (so that a segment
 * the change frees is held until the record is on disk); replies that
 * acknowledge it go through td__state_reply, which holds them until the
 * change is on disk. Returns 0, or TD_ENOMEM if the record cannot even be
 * queued: then nothing is recorded, and the caller must not make the
 * change (its client gets TD_EIO). st may be NULL (no --state-dir): then
 * nothing is recorded or held, and 0 returned. */
int td__state_put(td__state *st, const char *key, size_t len,
                  const td__storage *s, uid_t publisher, const td_view *view);
int td__state_del(td__state *st, const char *key, size_t len);
int td__state_reply(td__state *st, td__conn *c, struct Tensord__Response *r,
                    int fd);
void td__state_conn_gone(td__state *st, const td__conn *c);
/* Holds the unlink of freed storage s's segment until every key change
 * recorded so far is on disk. Returns 1 if it did, 0 if the caller is to
 * unlink (or recycle) it now: no key ever named s, no change is pending,
 * st is NULL, or there is no memory to hold it (then a crash before the
 * sync drops the key that named s). */
int td__state_hold_unlink(td__state *st, const td__storage *s);
/* Returns 1 if st has nothing in flight: every key change on disk, no sync
 * or compaction running, no reply or unlink held. NULL: 1. */
int td__state_quiet(const td__state *st);
/* Sets the fds of st's directory and lock file (st keeps them) and the
 * journal generation being appended, for a live upgrade to hand over. */
void td__state_handover(const td__state *st, int *dirfd, int *lockfd,
                        uint64_t *gen);
/* A live upgrade taking DIR over from the old daemon, which appended
 * journal generation gen: takes ownership of dirfd and lockfd (the lock is
 * the old daemon's, shared), writes a fresh snapshot of the keys srv serves
 * and starts a new journal after it, without replaying anything, and sets
 * srv->state. Returns 0, or a negative code (logged) with srv->state unset
 * and both fds closed. */
int td__state_adopt(td__server *srv, const char *dir, int dirfd, int lockfd,
                    uint64_t gen);
/* Writes a final snapshot, unlinks the segments held for the journal, drops
 * the replies still held (their clients are gone) and frees st. Only with
 * no sync or compaction in flight: td__server_stop waits for them. NULL
 * ok. */
void td__state_close(td__state *st);

#endif /* TD_DAEMON_STATE_H */

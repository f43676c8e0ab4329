/* upgrade.h: live upgrade: a running tensord hands its listening socket,
 * clients, storages, keys, waiters and channels to a new tensord, which serves
 * on without a client noticing (docs/operations.md, "Live upgrade"). */
#ifndef TD_DAEMON_UPGRADE_H
#define TD_DAEMON_UPGRADE_H

#include "conn.h"
#include "server.h"

#include <stdint.h>
#include <uv.h>

/* The handover formats (proto/handover.proto) this tensord speaks: 1, and 2,
 * which adds channels. A handover at 1 (to a successor that predates
 * channels) goes through only while no channel is open. */
#define TD__HANDOVER_VERSION 2
#define TD__HANDOVER_MIN_VERSION 1
#define TD__HANDOVER_CHANNELS 2 /* the first that carries channels */

struct Tensord__Upgrade;

/* Handles an Upgrade request on c: refuses it (an Error reply), spawns the
 * new tensord (spawn set: the reply comes once the handover has committed or
 * failed), or answers with the handover channel and quiesces, handing over
 * once nothing is in flight. Returns 0. */
int td__upgrade_request(td__conn *c, uint64_t seq,
                        const struct Tensord__Upgrade *m);
/* Whether c asked for the upgrade in progress (tensorctl upgrade's
 * connection, or the new tensord's): it is not handed over, so it must take
 * nothing until it is answered. */
int td__upgrade_asked(const td__conn *c);
/* c is closing: an upgrade in progress forgets it. */
void td__upgrade_conn_gone(td__conn *c);
/* tensord is stopping: abandons an upgrade in progress (its asker gets an
 * Error) and leaves srv serving as before it began. */
void td__upgrade_stop(td__server *srv);
/* tensord --upgrade: asks the daemon on o's socket for the handover and
 * takes everything over. Returns 0 once srv serves (the caller runs the
 * loop), or the exit status after printing why to stderr (the old daemon
 * refused, or this tensord refused its handover version; the old daemon
 * serves on). If the handover breaks off before it commits, this process
 * starts normally instead: it re-executes argv without --upgrade, and does
 * not return. */
int td__upgrade_start(td__server *srv, uv_loop_t *loop, const td__options *o,
                      char **argv);

#endif /* TD_DAEMON_UPGRADE_H */

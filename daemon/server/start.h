/* start.h: tensord as a whole: starting (bound, inherited or handed over),
 * accepting clients, notifying systemd, stopping in order. */
#ifndef TD_DAEMON_START_H
#define TD_DAEMON_START_H

#include "server.h"

/* The hooks (server.h) of a daemon that serves: td__server_init sets them,
 * and a live upgrade's successor, which sets itself up. */
extern const td__hooks td__serving;

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

#endif /* TD_DAEMON_START_H */

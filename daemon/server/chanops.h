/* chanops.h: the channel requests, and channels' part in a connection's
 * end and in the server's start and stop. */
#ifndef TD_DAEMON_CHANOPS_H
#define TD_DAEMON_CHANOPS_H

#include "conn.h"

struct Tensord__Request;

/* Handles a Chan* request. Returns 0 (errors are answered). */
int td__chan_request(td__conn *c, struct Tensord__Request *req);
/* c is closing: its ends go, and what they had goes back to their channels
 * (a channel with no end left goes with its slots). */
void td__chans_conn_gone(td__conn *c);
/* Sets up (and runs, for channels a live upgrade brought), and closes, the
 * timer that repairs and checks rings. */
void td__chans_listen(td__server *srv);
void td__chans_close(td__server *srv);

#endif /* TD_DAEMON_CHANOPS_H */

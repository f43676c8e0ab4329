/* ops.h: what each request does. */
#ifndef TD_DAEMON_OPS_H
#define TD_DAEMON_OPS_H

#include "conn.h"

struct Tensord__Request;

/* Handles one request. Returns 0, or a negative code for a protocol error
 * (the caller closes the connection). */
int td__dispatch(td__conn *c, struct Tensord__Request *req);
/* Forgets c's waiters and pending creates (connection closing). */
void td__ops_conn_gone(td__conn *c);

#endif /* TD_DAEMON_OPS_H */

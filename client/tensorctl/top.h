/* top.h: tensorctl top, a live terminal view of tensord. */
#ifndef TD_CLIENT_TOP_H
#define TD_CLIENT_TOP_H

#include "tensord.h"

/* Redraws every interval_ms until q, Q, Ctrl-C or SIGTERM, on the
 * terminal's alternate screen; once: prints one plain frame (rates over
 * one interval) and returns, terminal or not. Returns 0, or a negative
 * code with its message printed (stdout not a terminal, tensord gone):
 * the terminal is restored either way. */
int td__top(td_client *c, int interval_ms, int once);

#endif /* TD_CLIENT_TOP_H */

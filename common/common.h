/* common.h: the private vocabulary that tensord and libtensord share: error
 * messages and the checks behind the view algebra. Depends on nothing of
 * ours but the public header. */
#ifndef TD_COMMON_H
#define TD_COMMON_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>

/* Formats fmt into msg (if not NULL and len > 0) and returns err. */
int td__msg(char *msg, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* td_view_check that also says why, naming the dimension and values. */
int td__view_check_msg(const td_view *v, size_t nbytes, char *msg, size_t len);

/* Formats fmt as this thread's td_view_last_error() and returns err. */
int td__view_fail(int err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif /* TD_COMMON_H */

/* common.h: the private vocabulary that tensord and libtensord share: error
 * messages and the checks behind the view algebra. Depends on nothing of
 * ours but the public header. */
#ifndef TD_COMMON_H
#define TD_COMMON_H

#include "tensord.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* Formats fmt into msg (if not NULL and len > 0) and returns err. */
int td__msg(char *msg, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The error channel (errors.c), behind td_last_error and
 * td_view_last_error. Every failing call of libtensord records its message
 * here, on the calling thread: as the thread's last failure of any call, and,
 * for a call on a client, as its last failure on that client (the client's
 * owner id). The daemon does not use it. */
#define TD__ERRMSG_MAX 1024 /* longest message kept, with its NUL */
#define TD__ERR_OWNERS 16   /* owners a thread remembers a failure of */
/* Returns a new owner id: never 0, never reused. */
uint64_t td__err_owner(void);
/* Records fmt as this thread's last failure and, when owner is not 0, as its
 * last failure on owner. Arguments may point at an earlier message. Returns
 * err. */
int td__fail(uint64_t owner, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int td__vfail(uint64_t owner, int err, const char *fmt, va_list ap);
/* Returns this thread's last failure on owner, or its last failure of any
 * call when owner is 0; "" if there is none. Valid until this thread's next
 * failure. */
const char *td__last_error(uint64_t owner);

/* td_view_check that also says why, naming the dimension and values. */
int td__view_check_msg(const td_view *v, size_t nbytes, char *msg, size_t len);

/* Records fmt as this thread's last failure (td__fail with no owner) and
 * returns err. */
int td__view_fail(int err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif /* TD_COMMON_H */

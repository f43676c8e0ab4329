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
 * for a call on a client, as its last failure on that client (the owner, the
 * client's address, which is compared but never dereferenced: so a thread
 * may ask after td_close). The daemon does not use it. */
#define TD__ERRMSG_MAX 1024 /* longest message kept, with its NUL */
#define TD__ERR_OWNERS 16   /* owners a thread remembers a failure of */
/* Records fmt as this thread's last failure and, when owner is not NULL, as
 * its last failure on owner. Arguments may point at an earlier message.
 * Returns err. */
int td__fail(const void *owner, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int td__vfail(const void *owner, int err, const char *fmt, va_list ap);
/* Returns this thread's last failure on owner, or its last failure of any
 * call when owner is NULL; "" if there is none. Valid until this thread's
 * next failure. */
const char *td__last_error(const void *owner);
/* Forgets this thread's failures on owner (a new client at an address an
 * old one had). */
void td__err_forget(const void *owner);

/* td_view_check that also says why, naming the dimension and values. */
int td__view_check_msg(const td_view *v, size_t nbytes, char *msg, size_t len);

/* Records fmt as this thread's last failure (td__fail with no owner) and
 * returns err. */
int td__view_fail(int err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Formats n bytes as "512 B", "1.5 GiB" (binary units, one decimal, up to
 * PiB) into buf; returns buf. */
char *td__human_bytes(uint64_t n, char *buf, size_t len);
/* Parses a GPU UUID as td_gpu_uuid_str writes it, "GPU-..." or "MIG-..."
 * (hex digits in either case), into out. Returns 0 for GPU-, 1 for MIG-,
 * -1 (out undefined) if s is neither. */
int td__uuid_parse(const char *s, uint8_t out[16]);
/* Parses "64M", "1.5GiB", "4096" (binary units K to T, an optional "iB" or
 * "B"); returns 0 or TD_EINVAL. */
int td__parse_size(const char *s, uint64_t *out);

#endif /* TD_COMMON_H */

/* errors.c: names and descriptions of the TD_E* codes, and messages. */
#include "common.h"

#include <stdarg.h>
#include <stdio.h>

const char *td_strerror(int err) {
  switch (err) {
  case 0:
    return "success";
#define XX(name, code, msg)                                                    \
  case code:                                                                   \
    return msg;
    TD_ERRNO_MAP(XX)
#undef XX
  }
  return "unknown error";
}

const char *td_err_name(int err) {
  switch (err) {
  case 0:
    return "OK";
#define XX(name, code, _)                                                      \
  case code:                                                                   \
    return #name;
    TD_ERRNO_MAP(XX)
#undef XX
  }
  return "EUNKNOWN";
}

int td__msg(char *msg, size_t len, int err, const char *fmt, ...) {
  if (msg != NULL && len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, len, fmt, ap);
    va_end(ap);
  }
  return err;
}

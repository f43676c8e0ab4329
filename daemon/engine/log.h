/* log.h: the daemon's log (stderr, with levels) and the formatting of sizes
 * and times its messages and options use. */
#ifndef TD_DAEMON_LOG_H
#define TD_DAEMON_LOG_H

#include "common.h" /* td__human_bytes */

#include <stddef.h>
#include <stdint.h>

enum { TD_LOG_ERROR, TD_LOG_WARN, TD_LOG_INFO, TD_LOG_DEBUG };
extern int td__log_level;
void td__log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define td__error(...) td__log(TD_LOG_ERROR, __VA_ARGS__)
#define td__warn(...) td__log(TD_LOG_WARN, __VA_ARGS__)
#define td__info(...)                                                          \
  do {                                                                         \
    if (td__log_level >= TD_LOG_INFO)                                          \
      td__log(TD_LOG_INFO, __VA_ARGS__);                                       \
  } while (0)
#define td__debug(...)                                                         \
  do {                                                                         \
    if (td__log_level >= TD_LOG_DEBUG)                                         \
      td__log(TD_LOG_DEBUG, __VA_ARGS__);                                      \
  } while (0)
int td__log_level_parse(const char *s);
int64_t td__now_ms(void); /* wall clock, ms since the epoch */

#endif /* TD_DAEMON_LOG_H */

/* log.c: one line per event on stderr, and the small formatting helpers the
 * daemon's messages share. */
#include "log.h"

#include "tensord.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int td__log_level = TD_LOG_INFO;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

int td__log_level_parse(const char *s) {
  for (int i = 0; i < 4; i++)
    if (strcmp(s, level_names[i]) == 0)
      return i;
  return TD_EINVAL;
}

void td__log(int level, const char *fmt, ...) {
  if (level > td__log_level)
    return;
  char line[1024];
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  localtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof(line),
                   "%02d:%02d:%02d.%03ld tensord[%d] %s: ", tm.tm_hour,
                   tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, (int)getpid(),
                   level_names[level]);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof(line))
    vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
  va_end(ap);
  /* One write per line, so lines of concurrent writers never interleave. */
  size_t len = strnlen(line, sizeof(line) - 2);
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}

int64_t td__now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

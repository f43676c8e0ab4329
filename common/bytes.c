/* bytes.c: byte counts as text, for the daemon's and the library's
 * messages, and sizes read from text (options, environment variables). */
#include "common.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

char *td__human_bytes(uint64_t n, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)n;
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", n);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
  return buf;
}

int td__parse_size(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || !(v >= 0) || isinf(v))
    return TD_EINVAL;
  while (isspace((unsigned char)*end))
    end++;
  double mult = 1;
  switch (toupper((unsigned char)*end)) {
  case '\0':
    break;
  case 'K':
    mult = 1024.0;
    break;
  case 'M':
    mult = 1024.0 * 1024;
    break;
  case 'G':
    mult = 1024.0 * 1024 * 1024;
    break;
  case 'T':
    mult = 1024.0 * 1024 * 1024 * 1024;
    break;
  case 'B':
    break;
  default:
    return TD_EINVAL;
  }
  if (*end != '\0' && toupper((unsigned char)*end) != 'B') {
    end++;
    if (*end == 'i' || *end == 'I')
      end++;
    if (*end == 'B' || *end == 'b')
      end++;
  } else if (*end != '\0') {
    end++;
  }
  if (*end != '\0')
    return TD_EINVAL;
  v *= mult;
  if (v >= 18446744073709551615.0)
    return TD_EINVAL;
  *out = (uint64_t)v;
  return 0;
}

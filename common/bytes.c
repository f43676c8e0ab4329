/* bytes.c: byte counts as text, for tensord's messages and tensorctl. */
#include "common.h"

#include <inttypes.h>
#include <stdio.h>

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

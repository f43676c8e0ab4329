/* uuid.c: GPU UUIDs as text, the way nvidia-smi -L and
 * CUDA_VISIBLE_DEVICES write them, and back. */
#include "common.h"

#include <stdio.h>
#include <string.h>

char *td_gpu_uuid_str(const uint8_t uuid[16], int mig, char *buf, size_t len) {
  const uint8_t *u = uuid;
  snprintf(buf, len,
           "%s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           mig ? "MIG" : "GPU", u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7],
           u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return buf;
}

int td__uuid_parse(const char *s, uint8_t out[16]) {
  int mig = strncmp(s, "MIG-", 4) == 0;
  if (!mig && strncmp(s, "GPU-", 4) != 0)
    return -1;
  /* 8-4-4-4-12 hex digits: dashes at these offsets of the 36 after the
   * prefix, and nothing after. */
  const char *p = s + 4;
  size_t n = 0;
  for (size_t i = 0; i < 36; i++) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (p[i] != '-')
        return -1;
      continue;
    }
    int v = p[i] >= '0' && p[i] <= '9'   ? p[i] - '0'
            : p[i] >= 'a' && p[i] <= 'f' ? p[i] - 'a' + 10
            : p[i] >= 'A' && p[i] <= 'F' ? p[i] - 'A' + 10
                                         : -1;
    if (v < 0)
      return -1;
    if (n % 2 == 0)
      out[n / 2] = (uint8_t)(v << 4);
    else
      out[n / 2] |= (uint8_t)v;
    n++;
  }
  return p[36] == '\0' ? mig : -1;
}

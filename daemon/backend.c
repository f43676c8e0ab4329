/* backend.c: which backend serves a device, and the segment naming rule
 * that every backend follows. */
#include "backend.h"

#include <string.h>

const td__backend *td__backend_for(td_device device) {
  switch (device) {
  case TD_CPU:
    return &td__shm_backend;
  case TD_CUDA:
    return &td__cuda_backend;
  default:
    return NULL;
  }
}

int td__segment_prefix_valid(const char *p) {
  size_t n = strlen(p);
  if (n <= 10 || n >= TD__PREFIX_MAX || strncmp(p, "/tensord.", 9) != 0 ||
      p[n - 1] != '.')
    return 0;
  for (size_t i = 9; i < n - 1; i++)
    if (p[i] == '/' || p[i] == '.')
      return 0;
  return 1;
}

int td__segment_prefix(const char *name, char out[TD__PREFIX_MAX]) {
  const char *dot = strrchr(name, '.');
  size_t n = dot ? (size_t)(dot - name) + 1 : 0;
  if (n == 0 || n >= TD__PREFIX_MAX || strncmp(name, "/tensord.", 9) != 0)
    return TD_EINVAL;
  memcpy(out, name, n);
  out[n] = '\0';
  return 0;
}

/* backend.c: which backend serves a device, and the segment naming rule
 * that every backend follows. */
#include "backend.h"

#include "common.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

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

/* Name tails, drawn from the kernel 32 at a time (one getrandom(2) per 32
 * names), by each thread that names segments for itself: the loop, and a
 * worker that retries a taken name. Kept only in tensord's memory, they
 * are as unforeseeable as if drawn one by one. */
#define TAILS_PER_DRAW 32
static _Thread_local uint64_t tails[TAILS_PER_DRAW];
static _Thread_local unsigned ntails;

/* Sets *tail to the next random tail. Returns 0, or a negative code with
 * errno's message in msg. */
static int next_tail(uint64_t *tail, char *msg, size_t len) {
  if (ntails == 0) {
    ssize_t n;
    /* 256 bytes come whole, and never block once the kernel's pool is
     * ready (it was: the instance id came from it at start). */
    while ((n = getrandom(tails, sizeof(tails), 0)) < 0 && errno == EINTR)
      ;
    if (n != (ssize_t)sizeof(tails))
      return td__msg(msg, len, n < 0 ? -errno : TD_EIO,
                     "naming a segment: getrandom: %s",
                     n < 0 ? strerror(errno) : "short read");
    ntails = TAILS_PER_DRAW;
  }
  *tail = tails[TAILS_PER_DRAW - ntails--];
  return 0;
}

int td__segment_name(char out[TD__SEGMENT_NAME_MAX], const char *prefix,
                     uint64_t seq, char *msg, size_t len) {
  uint64_t tail = 0;
  int err = next_tail(&tail, msg, len);
  if (err < 0)
    return err;
  char name[TD__SEGMENT_NAME_MAX];
  int k = snprintf(name, sizeof(name), "%s%llu-%016llx", prefix,
                   (unsigned long long)seq, (unsigned long long)tail);
  if (k < 0 || (size_t)k >= sizeof(name))
    return td__msg(msg, len, TD_ENAMETOOLONG,
                   "naming a segment: %s%llu and a 16-digit tail make more "
                   "than %d bytes",
                   prefix, (unsigned long long)seq, TD__SEGMENT_NAME_MAX - 1);
  memcpy(out, name, (size_t)k + 1);
  return 0;
}

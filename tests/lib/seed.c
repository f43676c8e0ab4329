/* seed.c: one seed per randomised test run, from TDT_SEED or the clock. */
#include "seed.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

uint64_t tdt_seed(const char *who) {
  const char *env = getenv("TDT_SEED");
  uint64_t seed;
  if (env != NULL && env[0] != '\0') {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(env, &end, 0);
    if (errno != 0 || *end != '\0' || env[0] == '-') {
      fprintf(stderr, "%s: TDT_SEED='%s' is not a seed: give a number "
              "(decimal or 0x hex)\n", who, env);
      exit(2);
    }
    seed = v;
    fprintf(stderr, "%s: seed %" PRIu64 " (from TDT_SEED)\n", who, seed);
    return seed;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  seed = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
  seed ^= (uint64_t)getpid() << 32;
  fprintf(stderr, "%s: seed %" PRIu64 " (TDT_SEED=%" PRIu64 " repeats it)\n",
          who, seed, seed);
  return seed;
}

/* randshim.c: an LD_PRELOAD library that makes tensord's random segment
 * names foreseeable on demand, so that a test can take them first, with no
 * hook in tensord.
 *
 * While the file $TDT_RANDOM_GATE exists, getrandom(3) fills each 8 bytes
 * of a buffer with one byte repeated: 0xa0 + k mod $TDT_RANDOM_CYCLE (4 if
 * unset; it must divide 32) in the k-th 8 bytes it hands out, counted from
 * 0 over every call and thread. Name tails tensord takes from such a
 * buffer in turn read "a0a0a0a0a0a0a0a0", "a1a1a1a1a1a1a1a1", ... round and
 * round (tensord draws tails 32 at a time: with a cycle that divides 32,
 * each thread's come round in step). Otherwise (before the test makes the
 * file: the instance id, drawn at start, stays random) it is the real
 * getrandom. */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

ssize_t getrandom(void *buf, size_t len, unsigned int flags) {
  static atomic_uint calls; /* 8-byte words handed out */
  const char *gate = getenv("TDT_RANDOM_GATE");
  if (gate != NULL && gate[0] != '\0' && access(gate, F_OK) == 0) {
    const char *c = getenv("TDT_RANDOM_CYCLE");
    unsigned n = c != NULL ? (unsigned)atoi(c) : 4;
    if (n == 0 || n > 16)
      n = 4;
    unsigned words = (unsigned)((len + 7) / 8);
    unsigned k = atomic_fetch_add(&calls, words);
    for (unsigned i = 0; i < words; i++) {
      size_t off = (size_t)i * 8;
      memset((char *)buf + off, 0xa0 + (int)((k + i) % n),
             len - off < 8 ? len - off : 8);
    }
    return (ssize_t)len;
  }
  ssize_t (*real)(void *, size_t, unsigned int) =
      (ssize_t(*)(void *, size_t, unsigned int))dlsym(RTLD_NEXT, "getrandom");
  if (real != NULL)
    return real(buf, len, flags);
  return syscall(SYS_getrandom, buf, len, flags);
}

/* oracle.h: fuzz_request's oracle: every request gets exactly one reply with
 * its seq, and a request that a model of the daemon says is valid succeeds.
 *
 * The harness reports what happened, in order: the bytes each client sent
 * (and where an fd went with them), each reply it read, the boundaries at
 * which it let the daemon settle (with which connections the daemon had
 * dropped by then), and what the clients did (shut, stopped reading).
 * oracle_finish() then replays the clients' byte streams through its own
 * framing and a model of the registry (which storages and keys exist, which
 * connection holds what, sizes, capacity, quota, limits), in the order the
 * daemon handled them, and fails (through the callback given to
 * oracle_start, which must not return) on:
 *   - a request answered twice, a reply whose seq no handled request has
 *     (requests after a protocol error are not handled), a missing reply;
 *   - a protocol error without its Error reply, or a connection kept open
 *     after one; a connection dropped with neither a protocol error nor end
 *     of stream;
 *   - a request the model says must succeed that fails, or a success reply
 *     that contradicts the model (another storage, size, view or fd rule).
 * Where the model cannot know an outcome (an invalid-looking key, timing, a
 * reply it cannot match) it learns the outcome from the reply; where it
 * cannot even learn it (a reply lost to a client that stopped reading) it
 * stops predicting for the rest of the input and only counts replies. */
#ifndef TD_FUZZ_ORACLE_H
#define TD_FUZZ_ORACLE_H

#include "tensord.pb-c.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define OR_ENDS 2
#define OR_GROUPS_MAX 64

typedef struct oracle_peer {
  uid_t uid;
  gid_t gid;
  int ngroups;
  gid_t groups[OR_GROUPS_MAX];
} oracle_peer;

typedef struct oracle_setup {
  int nends;
  uint64_t capacity;
  uint64_t quota;        /* per uid; 0: none */
  uint32_t max_storages; /* per client; 0: none */
  int timeouts;          /* --io-timeout short enough to drop clients */
  oracle_peer peer[OR_ENDS];
  int refused[OR_ENDS]; /* turned away at connect (--max-clients) */
  /* Reports a violation and does not return. */
  void (*fail)(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
  int verbose;
} oracle_setup;

/* Starts an input; forgets the last one. */
void oracle_start(const oracle_setup *s);
/* end sent n bytes; if fd, an fd went with the first of them. */
void oracle_sent(int end, const uint8_t *p, size_t n, int fd);
/* end read r (len bytes on the wire); the oracle keeps r and frees it. */
void oracle_reply(int end, Tensord__Response *r, size_t len);
void oracle_shut(int end); /* end shut its write side */
/* end leaves its replies unread for a while. */
void oracle_muted(int end);
/* The daemon stopped reading end, which leaves its replies unread: what
 * end sends from now on is handled after what the other end sends. */
void oracle_paused(int end);
void oracle_deaf(int end); /* end stopped reading replies for good */
/* The daemon has handled everything sent so far; gone[i] says whether it
 * has dropped end i's connection. */
void oracle_settled(const int gone[OR_ENDS]);
/* end's connection ended with len bytes of a reply frame unread. */
void oracle_partial(int end, size_t len);
/* Checks the input; frees what the oracle kept. */
void oracle_finish(void);

#endif /* TD_FUZZ_ORACLE_H */

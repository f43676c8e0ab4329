/* raw.h: a hand-driven connection to tensord, for tests that pipeline
 * requests, leave replies unread, or need to see every frame. */
#ifndef TD_TEST_RAW_H
#define TD_TEST_RAW_H

#include "harness.h"
#include "tensord.pb-c.h"
#include "wire.h"

#include <stdint.h>

typedef struct tdt_raw {
  int fd;
  td__wire w;
  uint64_t seq; /* of the last request queued */
  int eof;      /* the daemon hung up */
} tdt_raw;

/* Connects to d and says Hello (seq 1); asserts. */
void tdt_raw_open(tdt_raw *r, const tdt_daemon *d);
/* Closes the connection and frees what it holds. */
void tdt_raw_close(tdt_raw *r);
/* Queues q with the next seq, which it returns; nothing is sent yet. */
uint64_t tdt_raw_queue(tdt_raw *r, Tensord__Request *q);
/* Sends everything queued, blocking; asserts. */
void tdt_raw_flush(tdt_raw *r);
/* The next reply, waiting at most timeout_ms; NULL on timeout, or at end of
 * stream (r->eof set). Its fds are closed. Free it with
 * tensord__response__free_unpacked(reply, NULL). */
Tensord__Response *tdt_raw_reply(tdt_raw *r, int timeout_ms);
/* tdt_raw_reply, but the reply's first fd (if any, else -1) goes to *fd,
 * which the caller then owns. */
Tensord__Response *tdt_raw_reply_fd(tdt_raw *r, int timeout_ms, int *fd);

/* Request builders: queue one request and return its seq. */
uint64_t tdt_raw_create(tdt_raw *r, uint64_t nbytes);
uint64_t tdt_raw_publish(tdt_raw *r, const char *key, uint64_t id,
                         int64_t offset);
uint64_t tdt_raw_unpublish(tdt_raw *r, const char *key);
uint64_t tdt_raw_lookup(tdt_raw *r, const char *key, int take, int32_t wait_ms);
uint64_t tdt_raw_ping(tdt_raw *r);

/* Sends a Create of nbytes and returns the new storage's id; asserts. */
uint64_t tdt_raw_create_now(tdt_raw *r, uint64_t nbytes);
/* The error code of reply rep (0 if it is not an Error). */
int tdt_raw_code(const Tensord__Response *rep);

#endif /* TD_TEST_RAW_H */

/* pool.h: the recycling pool's bookkeeping. Segments whose storage is gone
 * wait here, under a pool name, for the next create of their owner uid, so
 * that it is served from pages that already exist. No I/O: the pool says
 * which must go, and segment.c renames, reuses and unlinks them. */
#ifndef TD_DAEMON_POOL_H
#define TD_DAEMON_POOL_H

#include "backend.h"
#include "registry.h"
#include "tensord.h"

#include <stdint.h>
#include <sys/types.h>

/* Smaller segments are cheap to make fresh (a few pages) and are never
 * pooled; the cap on entries bounds the search a create makes. */
#define TD__POOL_MIN_BYTES (64u * 1024)
#define TD__POOL_MAX_SEGMENTS 1024
/* A pooled segment serves a create of at least this fraction of its size
 * (the rest is truncated away): one of half the size still saves the
 * faults of the half it keeps. */
#define TD__POOL_FIT_RATIO 2

typedef struct td__pooled {
  struct td__pooled *prev, *next; /* oldest first */
  uid_t uid;                      /* whose bytes these are */
  td_device device;
  uint64_t nbytes;
  int64_t since_ms; /* when it was pooled */
  char name[TD__SEGMENT_NAME_MAX];
} td__pooled;

typedef struct td__pool {
  td__pooled *oldest, *newest;
  uint64_t count, bytes;
  uint64_t limit;  /* --recycle-bytes; 0: recycling is off */
  int64_t idle_ms; /* a segment pooled longer goes */
  uint64_t hits, misses;
  uint64_t next_seq;           /* of pool names */
  char prefix[TD__PREFIX_MAX]; /* "/tensord.<instance>-pool." */
} td__pool;

void td__pool_init(td__pool *p, uint64_t limit, int64_t idle_ms,
                   uint64_t instance);
/* Returns 1 if a freed segment of nbytes may be pooled at all: recycling is
 * on and the size is in range. */
int td__pool_wants(const td__pool *p, uint64_t nbytes);
/* Takes the pooled segment that best serves a create of nbytes by uid on
 * device: the smallest of at least nbytes and at most TD__POOL_FIT_RATIO
 * times that. Counts a hit, or a miss for a poolable size. Returns the
 * entry, no longer in the pool (the caller owns it), or NULL. */
td__pooled *td__pool_take(td__pool *p, uid_t uid, td_device device,
                          uint64_t nbytes);
/* Gives back an entry td__pool_take returned for a create that did not go
 * ahead: it is pooled again as it was and the hit is not counted. */
void td__pool_untake(td__pool *p, td__pooled *e);
/* Pools again, each where its age puts it, the next-linked entries that
 * td__pool_pop returned for a create that did not go ahead. */
void td__pool_restore(td__pool *p, td__pooled *list);
/* Adds e, its fields set, as the newest entry. */
void td__pool_put(td__pool *p, td__pooled *e);
/* Removes the oldest entry and returns it (the caller owns it), or NULL. */
td__pooled *td__pool_pop(td__pool *p);
/* Whether a freed segment of nbytes on device may be pooled, given r's
 * capacity: recycling is on, the size in range, its backend renames, and
 * once the oldest entries made room (the pool's bounds, and the capacity
 * beside what storages have committed) it fits. *evict gets those entries,
 * next-linked and out of the pool, for the caller to unlink; NULL if it
 * may not be pooled at all. Returns 1 if it may, else 0. */
int td__pool_admit(td__pool *p, const td__registry *r, td_device device,
                   uint64_t nbytes, td__pooled **evict);
/* Takes entries off, oldest first, until the pool fits in r's capacity
 * beside what storages have committed, and need more bytes fit in free plus
 * theirs: a create that would otherwise fail for space drains the pool
 * first. Returns them, next-linked, with their bytes in *freed. */
td__pooled *td__pool_make_room(td__pool *p, const td__registry *r,
                               uint64_t need, uint64_t free, uint64_t *freed);
/* Takes off the entries idle for idle_ms or longer at now_ms and returns
 * them, next-linked, oldest first. */
td__pooled *td__pool_idle(td__pool *p, int64_t now_ms);
/* Sets name to a fresh pool name, "<prefix><seq>-<random tail>"
 * (td__segment_name). Returns 0, or a negative code with msg filled. */
int td__pool_name(td__pool *p, char name[TD__SEGMENT_NAME_MAX], char *msg,
                  size_t len);

#endif /* TD_DAEMON_POOL_H */

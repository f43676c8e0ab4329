/* pool.c: the recycling pool's bookkeeping: a list of freed segments,
 * oldest first, searched by owner uid and size. */
#include "pool.h"

#include "list.h"

#include <stdio.h>
#include <string.h>

void td__pool_init(td__pool *p, uint64_t limit, int64_t idle_ms,
                   uint64_t instance) {
  memset(p, 0, sizeof(*p));
  p->limit = limit;
  p->idle_ms = idle_ms;
  snprintf(p->prefix, sizeof(p->prefix), "/tensord.%016llx-pool.",
           (unsigned long long)instance);
}

int td__pool_wants(const td__pool *p, uint64_t nbytes) {
  return p->limit > 0 && nbytes >= TD__POOL_MIN_BYTES && nbytes <= p->limit;
}

static void unlist(td__pool *p, td__pooled *e) {
  TD__LIST_REMOVE_TAIL(&p->oldest, &p->newest, e, prev, next);
  e->prev = e->next = NULL;
  p->count--;
  p->bytes -= e->nbytes;
}

td__pooled *td__pool_take(td__pool *p, uid_t uid, td_device device,
                          uint64_t nbytes) {
  if (!td__pool_wants(p, nbytes))
    return NULL;
  td__pooled *best = NULL;
  uint64_t most = nbytes > UINT64_MAX / TD__POOL_FIT_RATIO
                      ? UINT64_MAX
                      : nbytes * TD__POOL_FIT_RATIO;
  /* Newest first: of equal fits, the most recently used pages are the
   * likeliest to be warm. An exact fit ends the search. */
  for (td__pooled *e = p->newest; e != NULL; e = e->prev) {
    if (e->uid != uid || e->device != device || e->nbytes < nbytes ||
        e->nbytes > most)
      continue;
    if (best == NULL || e->nbytes < best->nbytes)
      best = e;
    if (e->nbytes == nbytes)
      break;
  }
  if (best == NULL) {
    p->misses++;
    return NULL;
  }
  unlist(p, best);
  p->hits++;
  return best;
}

static void insert_sorted(td__pool *p, td__pooled *e) {
  /* Back where its age puts it, so that ageing still goes oldest first. */
  td__pooled *after = p->newest;
  while (after != NULL && after->since_ms > e->since_ms)
    after = after->prev;
  e->prev = after;
  e->next = after ? after->next : p->oldest;
  if (e->next)
    e->next->prev = e;
  else
    p->newest = e;
  if (after)
    after->next = e;
  else
    p->oldest = e;
  p->count++;
  p->bytes += e->nbytes;
}

void td__pool_untake(td__pool *p, td__pooled *e) {
  p->hits--;
  insert_sorted(p, e);
}

void td__pool_restore(td__pool *p, td__pooled *list) {
  for (td__pooled *e = list, *next; e != NULL; e = next) {
    next = e->next;
    insert_sorted(p, e);
  }
}

void td__pool_put(td__pool *p, td__pooled *e) {
  TD__LIST_APPEND(&p->oldest, &p->newest, e, prev, next);
  p->count++;
  p->bytes += e->nbytes;
}

td__pooled *td__pool_pop(td__pool *p) {
  td__pooled *e = p->oldest;
  if (e != NULL)
    unlist(p, e);
  return e;
}

int td__pool_name(td__pool *p, char name[TD__SEGMENT_NAME_MAX], char *msg,
                  size_t len) {
  return td__segment_name(name, p->prefix, ++p->next_seq, msg, len);
}

/* pool.c: the recycling pool's bookkeeping: freed segments, oldest first,
 * searched by owner uid and size; and which must go, for room or for age. */
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

/* Pops the oldest entry onto the next-linked list whose end is *tail. */
static td__pooled **pop_to(td__pool *p, td__pooled **tail) {
  td__pooled *e = td__pool_pop(p);
  *tail = e;
  return &e->next;
}

int td__pool_admit(td__pool *p, const td__registry *r, td_device device,
                   uint64_t nbytes, td__pooled **evict) {
  const td__backend *b = td__backend_for(device);
  td__pooled **tail = evict;
  *evict = NULL;
  if (b == NULL || b->rename == NULL || !td__pool_wants(p, nbytes))
    return 0;
  /* The segment's charge is given back already: its bytes count here. */
  while (p->count > 0 &&
         (p->count >= TD__POOL_MAX_SEGMENTS || p->bytes + nbytes > p->limit ||
          r->bytes_committed + p->bytes + nbytes > r->capacity))
    tail = pop_to(p, tail);
  return r->bytes_committed + nbytes <= r->capacity;
}

td__pooled *td__pool_make_room(td__pool *p, const td__registry *r,
                               uint64_t need, uint64_t free, uint64_t *freed) {
  td__pooled *victims = NULL, **tail = &victims;
  *freed = 0;
  while (p->count > 0 && (r->bytes_committed + p->bytes > r->capacity ||
                          free + *freed < need)) {
    *freed += p->oldest->nbytes;
    tail = pop_to(p, tail);
  }
  return victims;
}

td__pooled *td__pool_idle(td__pool *p, int64_t now_ms) {
  td__pooled *idle = NULL, **tail = &idle;
  while (p->oldest != NULL && now_ms - p->oldest->since_ms >= p->idle_ms)
    tail = pop_to(p, tail);
  return idle;
}

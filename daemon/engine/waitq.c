/* waitq.c: lookups waiting for a key to be published: one queue per key, in
 * arrival order, each waiter also in its owner's list, so that a publish, a
 * timeout or a hang-up finds it at once. */
#include "waitq.h"

#include "list.h"

#include <stdlib.h>
#include <string.h>

typedef struct td__waitq {
  td__hnode node;
  td__wait *head, *tail;
  int busy; /* being walked by td__wait_wake: do not free */
  size_t len;
  char key[];
} waitq;

typedef struct key_ref {
  const char *key;
  size_t len;
} key_ref;

static int key_eq(const td__hnode *n, const void *key) {
  const waitq *q = td__container_of(n, waitq, node);
  const key_ref *k = key;
  return q->len == k->len && memcmp(q->key, k->key, k->len) == 0;
}

static waitq *waitq_find(const td__waits *ws, const char *key, size_t len) {
  key_ref k = {key, len};
  td__hnode *n =
      td__htab_find(&ws->queues, td__hash_bytes(key, len), key_eq, &k);
  return n ? td__container_of(n, waitq, node) : NULL;
}

static void waitq_free(td__waits *ws, waitq *q) {
  td__htab_remove(&ws->queues, &q->node);
  free(q);
}

void td__waits_init(td__waits *ws) {
  td__htab_init(&ws->queues);
  ws->count = 0;
}

void td__waits_free(td__waits *ws) {
  td__htab_free(&ws->queues);
}

int td__wait_add(td__waits *ws, td__wait *w, const char *key, size_t len) {
  waitq *q = waitq_find(ws, key, len);
  if (q == NULL) {
    q = calloc(1, sizeof(*q) + len + 1);
    if (q == NULL ||
        td__htab_insert(&ws->queues, &q->node, td__hash_bytes(key, len)) < 0) {
      free(q);
      return TD_ENOMEM;
    }
    memcpy(q->key, key, len);
    q->len = len;
  }
  w->q = q;
  w->key = q->key;
  w->len = q->len;
  TD__LIST_APPEND(&q->head, &q->tail, w, qprev, qnext);
  TD__LIST_PUSH(w->list, w, oprev, onext);
  ws->count++;
  return 0;
}

void td__wait_remove(td__waits *ws, td__wait *w) {
  waitq *q = w->q;
  TD__LIST_REMOVE_TAIL(&q->head, &q->tail, w, qprev, qnext);
  TD__LIST_REMOVE(w->list, w, oprev, onext);
  if (q->head == NULL && !q->busy)
    waitq_free(ws, q);
  w->q = NULL;
  ws->count--;
}

void td__wait_wake(td__waits *ws, const td__registry *r, const td__key *k,
                   td__wait_fn fn, void *arg) {
  waitq *q = waitq_find(ws, k->name, k->len);
  if (q == NULL)
    return;
  q->busy = 1;
  td__key *now;
  while (q->head != NULL && (now = td__key_find(r, q->key, q->len)) != NULL) {
    td__wait *w = q->head;
    td__wait_remove(ws, w);
    fn(w, now, arg);
  }
  q->busy = 0;
  if (q->head == NULL)
    waitq_free(ws, q);
}

int td__waits_walk(const td__waits *ws, int (*fn)(void *arg, const td__wait *w),
                   void *arg) {
  for (size_t i = 0; i < ws->queues.nbuckets; i++) {
    for (td__hnode *n = ws->queues.buckets[i]; n != NULL; n = n->next) {
      const waitq *q = td__container_of(n, waitq, node);
      for (const td__wait *w = q->head; w != NULL; w = w->qnext) {
        int err = fn(arg, w);
        if (err != 0)
          return err;
      }
    }
  }
  return 0;
}

void td__waits_drop(td__waits *ws, td__wait **list, td__wait_fn fn, void *arg) {
  while (*list != NULL) {
    td__wait *w = *list;
    td__wait_remove(ws, w);
    fn(w, NULL, arg);
  }
}

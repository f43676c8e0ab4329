/* waitq.c: lookups waiting for a key to be published: one queue per key, in
 * arrival order, each waiter with its timer and a place in its connection's
 * list, so that a publish, a timeout or a hang-up finds it at once. */
#include "waitq.h"

#include "conn.h"
#include "log.h"
#include "server.h"

#include <stdlib.h>
#include <string.h>

typedef struct waitq {
  td__hnode node;
  td__waiter *head, *tail;
  int busy; /* being walked by td__wait_wake: do not free */
  size_t len;
  char key[];
} waitq;

struct td__waiter {
  uv_timer_t timer;
  td__conn *conn;
  waitq *q;
  td__lookup_args args;
  int32_t wait_ms;
  int64_t deadline_ms;       /* loop time it times out at; -1: never */
  td__waiter *qprev, *qnext; /* in q */
  td__waiter *cprev, *cnext; /* in conn->waiters */
};

typedef struct key_ref {
  const char *key;
  size_t len;
} key_ref;

static int key_eq(const td__hnode *n, const void *key) {
  const waitq *q = td__container_of(n, waitq, node);
  const key_ref *k = key;
  return q->len == k->len && memcmp(q->key, k->key, k->len) == 0;
}

static waitq *waitq_find(td__waits *ws, const char *key, size_t len) {
  key_ref k = {key, len};
  td__hnode *n =
      td__htab_find(&ws->queues, td__hash_bytes(key, len), key_eq, &k);
  return n ? td__container_of(n, waitq, node) : NULL;
}

void td__waits_init(td__waits *ws) {
  td__htab_init(&ws->queues);
  ws->count = 0;
}

void td__waits_free(td__waits *ws) {
  td__htab_free(&ws->queues);
}

static void waiter_closed(uv_handle_t *h) {
  free(td__container_of((uv_timer_t *)h, td__waiter, timer));
}

/* Unlinks w from its queue and its connection and frees it (once its timer
 * has closed). */
static void waiter_free(td__waiter *w) {
  td__waits *ws = &w->conn->srv->waits;
  waitq *q = w->q;
  if (w->qprev)
    w->qprev->qnext = w->qnext;
  else
    q->head = w->qnext;
  if (w->qnext)
    w->qnext->qprev = w->qprev;
  else
    q->tail = w->qprev;
  if (w->cprev)
    w->cprev->cnext = w->cnext;
  else
    w->conn->waiters = w->cnext;
  if (w->cnext)
    w->cnext->cprev = w->cprev;
  w->conn->nwaiters--;
  if (q->head == NULL && !q->busy) {
    td__htab_remove(&ws->queues, &q->node);
    free(q);
  }
  ws->count--;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, waiter_closed);
}

static void on_wait_timeout(uv_timer_t *t) {
  td__waiter *w = td__container_of(t, td__waiter, timer);
  td__conn *c = w->conn;
  char key[TD_KEY_MAX + 1];
  size_t n = w->q->len < TD_KEY_MAX ? w->q->len : TD_KEY_MAX;
  memcpy(key, w->q->key, n);
  key[n] = '\0';
  uint64_t seq = w->args.seq;
  int32_t ms = w->wait_ms;
  waiter_free(w);
  td__conn_error(c, seq, TD_ETIMEDOUT, "key '%s': not published (waited %d ms)",
                 key, (int)ms);
}

int td__wait_add(td__conn *c, const char *key, size_t len,
                 const td__lookup_args *a, int32_t wait_ms) {
  int64_t deadline =
      wait_ms > 0 ? (int64_t)uv_now(c->srv->loop) + wait_ms : (int64_t)-1;
  return td__wait_restore(c, key, len, a, wait_ms, deadline);
}

int td__wait_restore(td__conn *c, const char *key, size_t len,
                     const td__lookup_args *a, int32_t wait_ms,
                     int64_t deadline_ms) {
  td__server *srv = c->srv;
  td__waits *ws = &srv->waits;
  waitq *q = waitq_find(ws, key, len);
  td__waiter *w = calloc(1, sizeof(*w));
  if (w == NULL)
    return TD_ENOMEM;
  if (q == NULL) {
    q = calloc(1, sizeof(*q) + len + 1);
    if (q == NULL ||
        td__htab_insert(&ws->queues, &q->node, td__hash_bytes(key, len)) < 0) {
      free(q);
      free(w);
      return TD_ENOMEM;
    }
    memcpy(q->key, key, len);
    q->len = len;
  }
  uv_timer_init(srv->loop, &w->timer);
  w->conn = c;
  w->q = q;
  w->args = *a;
  w->wait_ms = wait_ms;
  w->deadline_ms = deadline_ms;
  w->qprev = q->tail;
  if (q->tail)
    q->tail->qnext = w;
  else
    q->head = w;
  q->tail = w;
  w->cnext = c->waiters;
  if (c->waiters)
    c->waiters->cprev = w;
  c->waiters = w;
  c->nwaiters++;
  ws->count++;
  if (deadline_ms >= 0) {
    int64_t now = (int64_t)uv_now(srv->loop);
    uv_timer_start(&w->timer, on_wait_timeout,
                   deadline_ms > now ? (uint64_t)(deadline_ms - now) : 0, 0);
  }
  return 0;
}

int td__waits_each(td__waits *ws, td__wait_each_fn fn, void *arg) {
  for (size_t i = 0; i < ws->queues.nbuckets; i++) {
    for (td__hnode *n = ws->queues.buckets[i]; n != NULL; n = n->next) {
      const waitq *q = td__container_of(n, waitq, node);
      for (const td__waiter *w = q->head; w != NULL; w = w->qnext) {
        int r = fn(arg, w->conn, q->key, q->len, &w->args, w->wait_ms,
                   w->deadline_ms);
        if (r != 0)
          return r;
      }
    }
  }
  return 0;
}

void td__wait_wake(td__server *srv, td__key *k, td__wake_fn fn) {
  td__waits *ws = &srv->waits;
  waitq *q = waitq_find(ws, k->name, k->len);
  if (q == NULL)
    return;
  q->busy = 1;
  while (q->head != NULL) {
    k = td__key_find(&srv->reg, q->key, q->len);
    if (k == NULL)
      break; /* taken */
    td__waiter *w = q->head;
    td__conn *c = w->conn;
    td__lookup_args a = w->args;
    waiter_free(w);
    fn(c, &a, k);
  }
  q->busy = 0;
  if (q->head == NULL) {
    td__htab_remove(&ws->queues, &q->node);
    free(q);
  }
}

void td__wait_conn_gone(td__conn *c) {
  while (c->waiters != NULL)
    waiter_free(c->waiters);
}

/* ops.c: what each request does: create, open, release, publish, lookup
 * (with waiting and take), unpublish, and the introspection requests. */
#include "daemon.h"

#include "tensord.pb-c.h"
#include "viewmsg.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Storages up to this size are created on the loop thread: reserving their
 * pages costs about as much as a hop to the thread pool. Larger ones, whose
 * cost grows with bytes, are created and unlinked off the loop. */
#define SYNC_BYTES_MAX (256u * 1024)
#define LIST_LIMIT_DEFAULT 256
#define LIST_LIMIT_MAX 1024
#define LIST_KEYS_MAX 32   /* keys per storage in a LIST page */
#define INFO_KEYS_MAX 1024 /* keys in an INFO reply: fits a frame */
#define PAGE_BYTES_MAX (512u * 1024)

struct td__create {
  uv_work_t work;
  td__server *srv;
  td__conn *conn; /* NULL once the connection is gone */
  uint64_t seq;
  td__storage *s;
  int fd;
  char msg[256];
  td__create *prev, *next; /* in conn->creates */
};

typedef struct waitq {
  td__hnode node;
  td__waiter *head, *tail;
  int busy; /* being walked by wake_waiters: do not free */
  size_t len;
  char key[];
} waitq;

struct td__waiter {
  uv_timer_t timer;
  td__conn *conn;
  waitq *q;
  uint64_t seq;
  int32_t wait_ms;
  int readonly, take, force_fd;
  td__waiter *qprev, *qnext; /* in q */
  td__waiter *cprev, *cnext; /* in conn->waiters */
};

/* Answers seq with an argument error; the connection stays. Returns 0, so
 * handlers can `return reject(...)`. */
static int reject(td__conn *c, uint64_t seq, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int reject(td__conn *c, uint64_t seq, int code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  td__conn_error(c, seq, code, "%s", msg);
  return 0;
}

/* ---- references and replies ---- */

/* Checks that c may do what want asks of s; on refusal msg says who owns s
 * and who c is. */
static int check_access(td__conn *c, const td__storage *s, int want,
                        const char *what, char *msg, size_t len) {
  if (td__may(s, &c->hold, want) == 0)
    return 0;
  char acc[96];
  return td__msg(msg, len, TD_EACCES,
                 "%s: permission denied (%s; this client is uid %u gid %u)",
                 what, td__describe_access(s, acc, sizeof(acc)),
                 (unsigned)c->hold.peer.uid, (unsigned)c->hold.peer.gid);
}

/* Gives c one more reference of mode ro to s and, unless c already has the
 * storage in that mode (so its process has it mapped), a fresh fd in *fd.
 * Checks c's permission (write too if take) and its storage limit first. On
 * failure nothing changed and msg says why. */
static int grant(td__conn *c, td__storage *s, int ro, int take, int force_fd,
                 int *fd, char *msg, size_t len) {
  uint32_t had = 0;
  *fd = -1;
  int want = TD__MAY_READ | (ro && !take ? 0 : TD__MAY_WRITE);
  int err = check_access(c, s, want,
                         take ? "take"
                         : ro ? "read-only access"
                              : "read-write access",
                         msg, len);
  if (err < 0)
    return err;
  uint32_t max = c->srv->max_storages_per_client;
  if (max && c->hold.refs.count >= max && td__ref_find(&c->hold, s->id) == 0)
    return td__msg(msg, len, TD_EMFILE,
                   "this client holds %zu storages, the most "
                   "--max-storages-per-client allows",
                   c->hold.refs.count);
  err = td__ref_add(&c->srv->reg, &c->hold, s, ro, &had);
  if (err < 0)
    return td__msg(msg, len, err, "out of memory");
  if (had == 0 || force_fd) {
    *fd = td__shm_open(s->name, ro);
    if (*fd < 0) {
      err = *fd;
      *fd = -1;
      td__ref_drop(&c->srv->reg, &c->hold, s->id, ro, 1);
      if (err == TD_EMFILE || err == TD_ENFILE)
        td__error("client %d: cannot open %s: %s", (int)c->hold.peer.pid,
                  s->name, td_strerror(err));
      return td__msg(msg, len, err, "opening %s: %s", s->name,
                     td_strerror(err));
    }
  }
  return 0;
}

static void storage_reply(const td__storage *s, int ro, int fd,
                          Tensord__StorageReply *m) {
  tensord__storage_reply__init(m);
  m->id = s->id;
  m->nbytes = s->nbytes;
  m->device = (Tensord__Device)s->device;
  m->readonly = ro;
  m->fd = fd >= 0;
}

/* Acknowledges a key change, once it is durable (see state.c). */
static int send_ok(td__conn *c, uint64_t seq) {
  Tensord__Ok ok = TENSORD__OK__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_OK;
  r.ok = &ok;
  td__state_reply(c->srv->state, c, &r, -1);
  return 0;
}

static int send_storage(td__conn *c, uint64_t seq, const td__storage *s, int ro,
                        int fd) {
  Tensord__StorageReply m;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  storage_reply(s, ro, fd, &m);
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_STORAGE;
  r.storage = &m;
  td__conn_send(c, &r, fd);
  return 0;
}

/* ---- create ---- */

static void create_unlink_from_conn(td__create *cr) {
  if (cr->conn == NULL)
    return;
  if (cr->prev)
    cr->prev->next = cr->next;
  else
    cr->conn->creates = cr->next;
  if (cr->next)
    cr->next->prev = cr->prev;
  cr->conn = NULL;
}

/* Registers the new segment and answers; or cleans up if nobody waits. */
static void create_finish(td__create *cr) {
  td__server *srv = cr->srv;
  td__storage *s = cr->s;
  td__conn *c = cr->conn;
  create_unlink_from_conn(cr);

  if (cr->fd >= 0 && (c == NULL || srv->stopping)) {
    td__debug("storage %llu: creator left before it was ready; unlinking",
              (unsigned long long)s->id);
    close(cr->fd);
    td__shm_unlink(s->name);
    td__credit(&srv->reg, s->owner.uid, s->nbytes);
    free(s);
  } else if (cr->fd < 0) {
    if (c != NULL)
      td__conn_error(c, cr->seq, cr->fd, "create of %llu bytes: %s",
                     (unsigned long long)s->nbytes, cr->msg);
    td__credit(&srv->reg, s->owner.uid, s->nbytes);
    free(s);
  } else if (td__storage_insert(&srv->reg, s, &c->hold) < 0) {
    close(cr->fd);
    td__shm_unlink(s->name);
    td__credit(&srv->reg, s->owner.uid, s->nbytes);
    free(s);
    td__conn_error(c, cr->seq, TD_ENOMEM, "create: out of memory");
  } else {
    td__debug("client %d created storage %llu (%llu bytes)",
              (int)c->hold.peer.pid, (unsigned long long)s->id,
              (unsigned long long)s->nbytes);
    send_storage(c, cr->seq, s, 0, cr->fd);
  }
  free(cr);
}

static void create_work(uv_work_t *w) {
  td__create *cr = td__container_of(w, td__create, work);
  cr->fd = td__shm_create(cr->s->name, cr->s->nbytes, cr->msg, sizeof(cr->msg));
}

static void create_after(uv_work_t *w, int status) {
  td__create *cr = td__container_of(w, td__create, work);
  cr->srv->pending_work--;
  if (status == UV_ECANCELED) { /* never ran */
    cr->fd = TD_ECANCELED;
    snprintf(cr->msg, sizeof(cr->msg), "cancelled: tensord is stopping");
  }
  create_finish(cr);
}

static int op_create(td__conn *c, uint64_t seq, const Tensord__Create *m) {
  td__server *srv = c->srv;
  td__registry *reg = &srv->reg;
  char a[32], b[32], d[32];
  uint64_t n = m->nbytes;
  if (n == 0)
    return reject(c, seq, TD_EINVAL,
                  "create of 0 bytes: a storage needs at least one byte");
  if (m->device != TENSORD__DEVICE__DEVICE_CPU)
    return reject(c, seq, TD_ENODEV,
                  "create on device %d: this tensord has CPU storages only",
                  (int)m->device);
  if (m->mode & ~0666u)
    return reject(c, seq, TD_EINVAL,
                  "create with mode %04o: only read and write bits (0666) "
                  "may be set",
                  (unsigned)m->mode);
  if (srv->max_storages_per_client &&
      c->hold.refs.count >= srv->max_storages_per_client)
    return reject(c, seq, TD_EMFILE,
                  "create: this client holds %zu storages, the most "
                  "--max-storages-per-client allows",
                  c->hold.refs.count);
  /* The limits tensord sets first, then what /dev/shm can hold. */
  char msg[256];
  int err = td__charge(reg, c->hold.peer.uid, n, 0, msg, sizeof(msg));
  if (err < 0)
    return reject(c, seq, err, "create of %s", msg);
  uint64_t shm_free = 0, shm_total = 0;
  if (td__shm_space(&shm_free, &shm_total) == 0 && n > shm_free) {
    td__credit(reg, c->hold.peer.uid, n);
    return reject(
        c, seq, TD_ENOSPC,
        "create of %s (%llu bytes): /dev/shm has %s (%llu bytes) free of %s",
        td__human_bytes(n, a, sizeof(a)), (unsigned long long)n,
        td__human_bytes(shm_free, b, sizeof(b)), (unsigned long long)shm_free,
        td__human_bytes(shm_total, d, sizeof(d)));
  }

  td__create *cr = calloc(1, sizeof(*cr));
  td__storage *s = calloc(1, sizeof(*s));
  if (cr == NULL || s == NULL) {
    free(cr);
    free(s);
    td__credit(reg, c->hold.peer.uid, n);
    return reject(c, seq, TD_ENOMEM, "create: out of memory");
  }
  s->mode = m->mode ? m->mode : 0600;
  s->id = reg->next_id++;
  s->nbytes = n;
  s->device = TD_CPU;
  s->owner = c->hold.peer;
  s->created_ms = td__now_ms();
  snprintf(s->name, sizeof(s->name), "%s%llu", srv->prefix,
           (unsigned long long)s->id);
  cr->srv = srv;
  cr->conn = c;
  cr->seq = seq;
  cr->s = s;
  cr->fd = -1;
  cr->next = c->creates;
  if (c->creates)
    c->creates->prev = cr;
  c->creates = cr;

  if (n <= SYNC_BYTES_MAX) {
    create_work(&cr->work);
    create_finish(cr);
    return 0;
  }
  err = uv_queue_work(srv->loop, &cr->work, create_work, create_after);
  if (err < 0) {
    cr->fd = TD_ENOMEM;
    snprintf(cr->msg, sizeof(cr->msg), "cannot queue work: %s",
             uv_strerror(err));
    create_finish(cr);
    return 0;
  }
  srv->pending_work++;
  return 0;
}

/* ---- storage release ---- */

typedef struct unlink_job {
  uv_work_t work;
  td__server *srv;
  char name[64];
} unlink_job;

static void unlink_work(uv_work_t *w) {
  unlink_job *j = td__container_of(w, unlink_job, work);
  td__shm_unlink(j->name);
}

static void unlink_after(uv_work_t *w, int status) {
  unlink_job *j = td__container_of(w, unlink_job, work);
  if (status < 0) /* cancelled: unlink here rather than leak */
    td__shm_unlink(j->name);
  j->srv->pending_work--;
  free(j);
}

void td__segment_unlink(td__server *srv, const char *name, uint64_t nbytes) {
  /* Unlinking frees the pages when no client maps them any more: a cost that
   * grows with bytes, so large segments go to the thread pool. */
  unlink_job *j = NULL;
  if (nbytes > SYNC_BYTES_MAX && (j = malloc(sizeof(*j))) != NULL) {
    j->srv = srv;
    snprintf(j->name, sizeof(j->name), "%s", name);
    if (uv_queue_work(srv->loop, &j->work, unlink_work, unlink_after) == 0) {
      srv->pending_work++;
      return;
    }
    free(j);
  }
  td__shm_unlink(name);
}

void td__storage_gone(td__storage *s, void *arg) {
  td__server *srv = arg;
  if (srv->keep_segments) { /* stopping with --state-dir: keys outlive us */
    free(s);
    return;
  }
  td__debug("storage %llu: last reference dropped; unlinking %s",
            (unsigned long long)s->id, s->name);
  /* A key change not yet on disk may be what freed s, and the journal on
   * disk may still name it: the segment stays until the change is durable,
   * so that a crash now finds every segment the journal names. */
  if (td__state_hold_unlink(srv->state, s->name, s->nbytes) == 0)
    td__segment_unlink(srv, s->name, s->nbytes);
  free(s);
}

/* ---- open, release ---- */

static int op_open(td__conn *c, uint64_t seq, const Tensord__Open *m) {
  td__storage *s = td__storage_find(&c->srv->reg, m->id);
  if (s == NULL)
    return reject(c, seq, TD_ENOENT, "storage %llu: no such storage",
                  (unsigned long long)m->id);
  char msg[256];
  int fd;
  int err = grant(c, s, m->readonly, 0, m->force_fd, &fd, msg, sizeof(msg));
  if (err < 0)
    return reject(c, seq, err, "storage %llu: %s", (unsigned long long)m->id,
                  msg);
  return send_storage(c, seq, s, m->readonly, fd);
}

static int op_release(td__conn *c, const Tensord__Release *m) {
  uint32_t n = m->count ? m->count : 1;
  if (td__ref_drop(&c->srv->reg, &c->hold, m->id, m->readonly, n) < 0)
    td__warn("client %d: release of %u %s reference(s) to storage %llu that "
             "it does not hold; ignored",
             (int)c->hold.peer.pid, n, m->readonly ? "read-only" : "read-write",
             (unsigned long long)m->id);
  return 0;
}

/* ---- keys: publish, lookup with waiting, unpublish ---- */

static int key_eq(const td__hnode *n, const void *key) {
  const waitq *q = td__container_of(n, waitq, node);
  const ProtobufCBinaryData *k = key;
  return q->len == k->len && memcmp(q->key, k->data, k->len) == 0;
}

static waitq *waitq_find(td__server *srv, const ProtobufCBinaryData *key) {
  td__hnode *n = td__htab_find(
      &srv->waitqs, td__hash_bytes(key->data, key->len), key_eq, key);
  return n ? td__container_of(n, waitq, node) : NULL;
}

static void waiter_closed(uv_handle_t *h) {
  free(td__container_of((uv_timer_t *)h, td__waiter, timer));
}

/* Unlinks w from its queue and its connection and frees it. */
static void waiter_free(td__server *srv, td__waiter *w) {
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
  if (q->head == NULL && !q->busy) {
    td__htab_remove(&srv->waitqs, &q->node);
    free(q);
  }
  srv->nwaiters--;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, waiter_closed);
}

static char *key_str(const ProtobufCBinaryData *k, char *buf, size_t len) {
  size_t n = k->len < len - 1 ? k->len : len - 1;
  memcpy(buf, k->data, n);
  buf[n] = '\0';
  return buf;
}

/* Answers a lookup of k for c, taking the key if asked. */
static void answer_lookup(td__conn *c, uint64_t seq, td__key *k, int ro,
                          int take, int force_fd) {
  td__storage *s = k->storage;
  char msg[256];
  int fd;
  int err = grant(c, s, ro, take, force_fd, &fd, msg, sizeof(msg));
  if (err < 0) {
    td__conn_error(c, seq, err, "key '%s' (storage %llu): %s", k->name,
                   (unsigned long long)s->id, msg);
    return;
  }
  td_view view = k->view; /* outlives a take */
  Tensord__StorageReply sm;
  Tensord__View vm;
  Tensord__LookupReply lm = TENSORD__LOOKUP_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  storage_reply(s, ro, fd, &sm);
  td__view_to_msg(&view, &vm);
  lm.storage = &sm;
  lm.view = &vm;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_LOOKUP;
  r.lookup = &lm;
  if (!take) {
    td__conn_send(c, &r, fd);
    return;
  }
  td__debug("client %d took key '%s'", (int)c->hold.peer.pid, k->name);
  td__state_del(c->srv->state, k->name, k->len);
  td__key_remove(&c->srv->reg, k);
  td__state_reply(c->srv->state, c, &r, fd);
}

/* Hands a newly published key to the lookups waiting for it, in arrival
 * order, until one of them takes it. */
static void wake_waiters(td__server *srv, td__key *k) {
  ProtobufCBinaryData name = {k->len, (uint8_t *)k->name};
  waitq *q = waitq_find(srv, &name);
  if (q == NULL)
    return;
  q->busy = 1;
  while (q->head != NULL) {
    k = td__key_find(&srv->reg, q->key, q->len);
    if (k == NULL)
      break; /* taken */
    td__waiter *w = q->head;
    td__conn *c = w->conn;
    uint64_t seq = w->seq;
    int ro = w->readonly, take = w->take, force = w->force_fd;
    waiter_free(srv, w);
    answer_lookup(c, seq, k, ro, take, force);
  }
  q->busy = 0;
  if (q->head == NULL) {
    td__htab_remove(&srv->waitqs, &q->node);
    free(q);
  }
}

static void on_wait_timeout(uv_timer_t *t) {
  td__waiter *w = td__container_of(t, td__waiter, timer);
  td__conn *c = w->conn;
  char key[TD_KEY_MAX + 1];
  ProtobufCBinaryData name = {w->q->len, (uint8_t *)w->q->key};
  uint64_t seq = w->seq;
  int32_t ms = w->wait_ms;
  key_str(&name, key, sizeof(key));
  waiter_free(c->srv, w);
  td__conn_error(c, seq, TD_ETIMEDOUT, "key '%s': not published (waited %d ms)",
                 key, (int)ms);
}

static int check_key(td__conn *c, uint64_t seq, const ProtobufCBinaryData *k) {
  char msg[128];
  int err = td__key_validate((const char *)k->data, k->len, msg, sizeof(msg));
  if (err < 0)
    td__conn_error(c, seq, err, "bad key: %s", msg);
  return err;
}

static int op_lookup(td__conn *c, uint64_t seq, const Tensord__Lookup *m) {
  td__server *srv = c->srv;
  if (check_key(c, seq, &m->key) < 0)
    return 0;
  td__key *k = td__key_find(&srv->reg, (const char *)m->key.data, m->key.len);
  if (k != NULL) {
    answer_lookup(c, seq, k, m->readonly, m->take, m->force_fd);
    return 0;
  }
  char key[TD_KEY_MAX + 1];
  key_str(&m->key, key, sizeof(key));
  if (m->wait_ms == 0)
    return reject(c, seq, TD_ENOENT, "key '%s': not published", key);
  if (m->wait_ms < -1)
    return reject(c, seq, TD_EINVAL,
                  "key '%s': wait of %d ms (use -1 to wait forever)", key,
                  (int)m->wait_ms);

  waitq *q = waitq_find(srv, &m->key);
  td__waiter *w = calloc(1, sizeof(*w));
  if (w == NULL)
    return reject(c, seq, TD_ENOMEM, "lookup: out of memory");
  if (q == NULL) {
    q = calloc(1, sizeof(*q) + m->key.len + 1);
    if (q == NULL ||
        td__htab_insert(&srv->waitqs, &q->node,
                        td__hash_bytes(m->key.data, m->key.len)) < 0) {
      free(q);
      free(w);
      return reject(c, seq, TD_ENOMEM, "lookup: out of memory");
    }
    memcpy(q->key, m->key.data, m->key.len);
    q->len = m->key.len;
  }
  uv_timer_init(srv->loop, &w->timer);
  w->conn = c;
  w->q = q;
  w->seq = seq;
  w->wait_ms = m->wait_ms;
  w->readonly = m->readonly;
  w->take = m->take;
  w->force_fd = m->force_fd;
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
  srv->nwaiters++;
  if (m->wait_ms > 0)
    uv_timer_start(&w->timer, on_wait_timeout, (uint64_t)m->wait_ms, 0);
  td__debug("client %d waits for key '%s' (%d ms)", (int)c->hold.peer.pid, key,
            (int)m->wait_ms);
  return 0;
}

static int op_publish(td__conn *c, uint64_t seq, const Tensord__Publish *m) {
  td__registry *reg = &c->srv->reg;
  if (check_key(c, seq, &m->key) < 0)
    return 0;
  char key[TD_KEY_MAX + 1], msg[768];
  key_str(&m->key, key, sizeof(key));
  td__ref *ref = td__ref_find(&c->hold, m->id);
  if (ref == NULL || ref->rw == 0) {
    int code = td__storage_find(reg, m->id) ? TD_EACCES : TD_ENOENT;
    return reject(c, seq, code,
                  "publish '%s': storage %llu is not held read-write "
                  "by this client",
                  key, (unsigned long long)m->id);
  }
  td__storage *s = ref->storage;
  td_view v;
  if (m->view != NULL) {
    int err = td__view_from_msg(m->view, &v, msg, sizeof(msg));
    if (err == 0)
      err = td__view_check_msg(&v, s->nbytes, msg, sizeof(msg));
    if (err < 0)
      return reject(c, seq, err, "publish '%s': %s", key, msg);
  } else {
    int64_t shape = (int64_t)s->nbytes;
    td_view_contiguous(TD_UINT8, 1, &shape, &v);
  }
  td__key *k = td__key_find(reg, key, m->key.len);
  if (k != NULL && check_access(c, k->storage, TD__MAY_WRITE, "replacing it",
                                msg, sizeof(msg)) < 0)
    return reject(c, seq, TD_EACCES, "publish '%s' (storage %llu): %s", key,
                  (unsigned long long)k->storage->id, msg);
  td__state_put(c->srv->state, key, m->key.len, s, &v);
  if (td__key_publish(reg, key, m->key.len, s, &v, &k) < 0) {
    if (k == NULL) /* it was not there: take the record back */
      td__state_del(c->srv->state, key, m->key.len);
    else /* the old value stays */
      td__state_put(c->srv->state, key, m->key.len, k->storage, &k->view);
    return reject(c, seq, TD_ENOMEM, "publish '%s': out of memory", key);
  }
  td__debug("client %d published '%s' -> storage %llu", (int)c->hold.peer.pid,
            key, (unsigned long long)s->id);
  send_ok(c, seq);
  wake_waiters(c->srv, k);
  return 0;
}

static int op_unpublish(td__conn *c, uint64_t seq,
                        const Tensord__Unpublish *m) {
  if (check_key(c, seq, &m->key) < 0)
    return 0;
  td__key *k =
      td__key_find(&c->srv->reg, (const char *)m->key.data, m->key.len);
  char key[TD_KEY_MAX + 1];
  if (k == NULL)
    return reject(c, seq, TD_ENOENT, "key '%s': not published",
                  key_str(&m->key, key, sizeof(key)));
  char msg[256];
  if (check_access(c, k->storage, TD__MAY_WRITE, "unpublish", msg,
                   sizeof(msg)) < 0)
    return reject(c, seq, TD_EACCES, "key '%s' (storage %llu): %s", k->name,
                  (unsigned long long)k->storage->id, msg);
  td__state_del(c->srv->state, k->name, k->len);
  td__key_remove(&c->srv->reg, k);
  return send_ok(c, seq);
}

/* ---- introspection ---- */

/* Allocations of one reply, freed together after it is packed. */
typedef struct arena {
  void **ptrs;
  size_t n, cap;
} arena;

static void *arena_alloc(arena *a, size_t size) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 16;
    void **p = realloc(a->ptrs, cap * sizeof(*p));
    if (p == NULL)
      return NULL;
    a->ptrs = p;
    a->cap = cap;
  }
  void *p = calloc(1, size ? size : 1);
  if (p != NULL)
    a->ptrs[a->n++] = p;
  return p;
}

static void arena_free(arena *a) {
  for (size_t i = 0; i < a->n; i++)
    free(a->ptrs[i]);
  free(a->ptrs);
}

/* Describes s into m, with at most max_keys of its keys. */
static int storage_info(arena *a, const td__storage *s, size_t max_keys,
                        Tensord__StorageInfo *m) {
  tensord__storage_info__init(m);
  m->id = s->id;
  m->nbytes = s->nbytes;
  m->device = (Tensord__Device)s->device;
  m->refs = s->refs;
  m->owner_pid = s->owner.pid;
  m->owner_uid = s->owner.uid;
  m->owner_gid = s->owner.gid;
  m->mode = s->mode;
  m->created_unix_ms = s->created_ms;
  size_t nh = 0, nk = 0;
  for (const td__ref *r = s->holders; r; r = r->snext)
    nh++;
  for (const td__key *k = s->keys; k; k = k->snext)
    nk++;
  m->nkeys = (uint32_t)nk;
  if (nk > max_keys)
    nk = max_keys;
  Tensord__Holder *hs = arena_alloc(a, nh * sizeof(*hs));
  Tensord__Holder **hp = arena_alloc(a, nh * sizeof(*hp));
  ProtobufCBinaryData *ks = arena_alloc(a, nk * sizeof(*ks));
  if (hs == NULL || hp == NULL || ks == NULL)
    return TD_ENOMEM;
  size_t i = 0;
  for (const td__ref *r = s->holders; r; r = r->snext, i++) {
    tensord__holder__init(&hs[i]);
    hs[i].pid = r->peer->pid;
    hs[i].uid = r->peer->uid;
    hs[i].refs = r->rw + r->ro;
    hp[i] = &hs[i];
  }
  m->n_holders = nh;
  m->holders = hp;
  i = 0;
  for (const td__key *k = s->keys; k && i < nk; k = k->snext, i++) {
    ks[i].len = k->len;
    ks[i].data = (uint8_t *)k->name;
  }
  m->n_keys = nk;
  m->keys = ks;
  return 0;
}

static int op_list(td__conn *c, uint64_t seq, const Tensord__List *m) {
  size_t limit = m->limit ? m->limit : LIST_LIMIT_DEFAULT;
  if (limit > LIST_LIMIT_MAX)
    limit = LIST_LIMIT_MAX;
  arena a = {0};
  Tensord__ListReply lr = TENSORD__LIST_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  Tensord__StorageInfo *infos = arena_alloc(&a, limit * sizeof(*infos));
  Tensord__StorageInfo **ip = arena_alloc(&a, limit * sizeof(*ip));
  if (infos == NULL || ip == NULL)
    goto nomem;
  size_t n = 0, bytes = 0;
  const td__storage *s = td__storage_after(&c->srv->reg, m->after_id);
  for (; s != NULL && n < limit && bytes < PAGE_BYTES_MAX; s = s->next, n++) {
    if (storage_info(&a, s, LIST_KEYS_MAX, &infos[n]) < 0)
      goto nomem;
    ip[n] = &infos[n];
    bytes += tensord__storage_info__get_packed_size(&infos[n]) + 8;
    lr.next_after_id = s->id;
  }
  lr.n_storages = n;
  lr.storages = ip;
  lr.more = s != NULL;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_LIST;
  r.list = &lr;
  td__conn_send(c, &r, -1);
  arena_free(&a);
  return 0;
nomem:
  arena_free(&a);
  return reject(c, seq, TD_ENOMEM, "list: out of memory");
}

static int op_info(td__conn *c, uint64_t seq, const Tensord__Info *m) {
  td__registry *reg = &c->srv->reg;
  const td__storage *s = NULL;
  const td__key *named = NULL;
  char key[TD_KEY_MAX + 1];
  if (m->which_case == TENSORD__INFO__WHICH_KEY) {
    if (check_key(c, seq, &m->key) < 0)
      return 0;
    named = td__key_find(reg, (const char *)m->key.data, m->key.len);
    if (named == NULL)
      return reject(c, seq, TD_ENOENT, "key '%s': not published",
                    key_str(&m->key, key, sizeof(key)));
    s = named->storage;
  } else {
    s = td__storage_find(reg, m->id);
    if (s == NULL)
      return reject(c, seq, TD_ENOENT, "storage %llu: no such storage",
                    (unsigned long long)m->id);
  }
  arena a = {0};
  Tensord__StorageInfo si;
  Tensord__InfoReply ir = TENSORD__INFO_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  if (storage_info(&a, s, INFO_KEYS_MAX, &si) < 0)
    goto nomem;
  size_t nk = si.n_keys;
  Tensord__KeyInfo *ks = arena_alloc(&a, nk * sizeof(*ks));
  Tensord__KeyInfo **kp = arena_alloc(&a, nk * sizeof(*kp));
  Tensord__View *vs = arena_alloc(&a, nk * sizeof(*vs));
  if (ks == NULL || kp == NULL || vs == NULL)
    goto nomem;
  /* The key asked about comes first. */
  size_t i = 0;
  if (named != NULL) {
    tensord__key_info__init(&ks[0]);
    ks[0].key.len = named->len;
    ks[0].key.data = (uint8_t *)named->name;
    ks[0].id = s->id;
    td__view_to_msg(&named->view, &vs[0]);
    ks[0].view = &vs[0];
    ks[0].published_unix_ms = named->published_ms;
    kp[0] = &ks[0];
    i = 1;
  }
  for (const td__key *k = s->keys; k && i < nk; k = k->snext) {
    if (k == named)
      continue;
    tensord__key_info__init(&ks[i]);
    ks[i].key.len = k->len;
    ks[i].key.data = (uint8_t *)k->name;
    ks[i].id = s->id;
    td__view_to_msg(&k->view, &vs[i]);
    ks[i].view = &vs[i];
    ks[i].published_unix_ms = k->published_ms;
    kp[i] = &ks[i];
    i++;
  }
  ir.storage = &si;
  ir.n_keys = i;
  ir.keys = kp;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_INFO;
  r.info = &ir;
  td__conn_send(c, &r, -1);
  arena_free(&a);
  return 0;
nomem:
  arena_free(&a);
  return reject(c, seq, TD_ENOMEM, "info: out of memory");
}

static int op_stat(td__conn *c, uint64_t seq) {
  td__server *srv = c->srv;
  Tensord__StatReply st = TENSORD__STAT_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  uint64_t total = 0;
  st.storages = srv->reg.storages.count;
  st.bytes_used = srv->reg.bytes_used;
  st.capacity = srv->reg.capacity;
  td__shm_space(&st.shm_free, &total);
  st.clients = srv->nconns;
  st.keys = srv->reg.keys.count;
  st.waiters = srv->nwaiters;
  st.uptime_ms = td__now_ms() - srv->start_ms;
  st.pid = (int32_t)getpid();
  st.instance = srv->instance;
  st.quota = srv->reg.quota;
  st.max_clients = srv->max_clients;
  st.max_storages_per_client = srv->max_storages_per_client;
  st.state_dir = srv->state_dir;
  st.version = (char *)TD_VERSION_STRING;
  st.socket = srv->socket_path;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_STAT;
  r.stat = &st;
  td__conn_send(c, &r, -1);
  return 0;
}

static int op_ping(td__conn *c, uint64_t seq, const Tensord__Ping *m) {
  Tensord__Pong p = TENSORD__PONG__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  p.payload = m->payload;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_PONG;
  r.pong = &p;
  td__conn_send(c, &r, -1);
  return 0;
}

static int op_hello(td__conn *c, uint64_t seq, const Tensord__Hello *m) {
  if (c->hello)
    return td__conn_error(c, seq, TD_EPROTO, "Hello sent twice");
  if (m->version != TD_PROTOCOL_VERSION) {
    td__conn_error(c, seq, TD_EPROTONOSUPPORT,
                   "protocol version %u not supported: this tensord %s "
                   "speaks version %d",
                   m->version, TD_VERSION_STRING, TD_PROTOCOL_VERSION);
    return TD_EPROTONOSUPPORT;
  }
  size_t j = 0;
  for (const char *p = m->client_name; p && *p && j < sizeof(c->name) - 1; p++)
    c->name[j++] = (*p >= 0x20 && *p < 0x7f) ? *p : '?';
  c->name[j] = '\0';
  c->hello = 1;
  td__server *srv = c->srv;
  Tensord__HelloReply h = TENSORD__HELLO_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.server_version = (char *)TD_VERSION_STRING;
  h.instance = srv->instance;
  h.max_frame = TD__FRAME_MAX;
  h.max_key = TD_KEY_MAX;
  h.max_dims = TD_MAX_DIMS;
  h.capacity = srv->reg.capacity;
  h.pid = (int32_t)getpid();
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_HELLO;
  r.hello = &h;
  td__debug("client %d says hello as '%s'", (int)c->hold.peer.pid, c->name);
  td__conn_send(c, &r, -1);
  return 0;
}

int td__dispatch(td__conn *c, Tensord__Request *req) {
  uint64_t seq = req->seq;
  if (!c->hello && req->body_case != TENSORD__REQUEST__BODY_HELLO)
    return td__conn_error(c, seq, TD_EPROTO,
                          "the first request must be Hello (got request "
                          "type %d)",
                          (int)req->body_case);
  switch (req->body_case) {
  case TENSORD__REQUEST__BODY_HELLO:
    return op_hello(c, seq, req->hello);
  case TENSORD__REQUEST__BODY_CREATE:
    return op_create(c, seq, req->create);
  case TENSORD__REQUEST__BODY_OPEN:
    return op_open(c, seq, req->open);
  case TENSORD__REQUEST__BODY_RELEASE:
    return op_release(c, req->release);
  case TENSORD__REQUEST__BODY_PUBLISH:
    return op_publish(c, seq, req->publish);
  case TENSORD__REQUEST__BODY_LOOKUP:
    return op_lookup(c, seq, req->lookup);
  case TENSORD__REQUEST__BODY_UNPUBLISH:
    return op_unpublish(c, seq, req->unpublish);
  case TENSORD__REQUEST__BODY_LIST:
    return op_list(c, seq, req->list);
  case TENSORD__REQUEST__BODY_STAT:
    return op_stat(c, seq);
  case TENSORD__REQUEST__BODY_INFO:
    return op_info(c, seq, req->info);
  case TENSORD__REQUEST__BODY_PING:
    return op_ping(c, seq, req->ping);
  default:
    /* A newer client's operation: say so and keep the connection. */
    td__conn_error(c, seq, TD_ENOSYS,
                   "unknown operation: this tensord %s does not know the "
                   "request (or it has no body)",
                   TD_VERSION_STRING);
    return 0;
  }
}

void td__ops_conn_gone(td__conn *c) {
  while (c->waiters != NULL)
    waiter_free(c->srv, c->waiters);
  while (c->creates != NULL)
    create_unlink_from_conn(c->creates);
}

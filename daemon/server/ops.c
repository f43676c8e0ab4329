/* ops.c: what each request does: create, open, release, publish, lookup
 * (with waiting and take), unpublish, and the introspection requests. */
#include "ops.h"

#include "common.h"
#include "cudastore.h"
#include "chanops.h"
#include "events.h"
#include "grant.h"
#include "list.h"
#include "log.h"
#include "watch.h"
#include "metrics.h"
#include "segment.h"
#include "server.h"
#include "state.h"
#include "tensord.pb-c.h"
#include "upgrade.h"
#include "viewmsg.h"

#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#define LIST_LIMIT_DEFAULT 256
#define LIST_LIMIT_MAX 1024
#define LIST_KEYS_MAX 32   /* keys per storage in a LIST page */
#define INFO_KEYS_MAX 1024 /* keys in an INFO reply: fits a frame */
#define PAGE_BYTES_MAX (512u * 1024)
#define TD__STAT_DEVICES_MAX 64 /* GPUs in a STAT reply */

/* A create waiting for its segment. */
struct td__create {
  td__segment_req seg;
  td__conn *conn; /* NULL once the connection is gone */
  uint64_t seq;
  uint64_t start_ns;       /* when the request arrived: for the histogram */
  int client_zeroes;       /* the client zeroes a recycled segment itself */
  int gpu_dirty;           /* a GPU allocation the client is to zero */
  td__create *prev, *next; /* in conn->creates */
};

/* Answers seq with an argument error (td__conn_error's arguments); the
 * connection stays. It is 0, so handlers can `return reject(...)`. */
#define reject(...) (td__conn_error(__VA_ARGS__), 0)

/* ---- references and replies ---- */

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

/* ---- create ---- */

static void create_unlink_from_conn(td__create *cr) {
  if (cr->conn == NULL)
    return;
  TD__LIST_REMOVE(&cr->conn->creates, cr, prev, next);
  cr->conn->ncreates--;
  cr->conn = NULL;
}

/* Registers the new segment and answers; or cleans up if nobody waits. */
static void create_finish(td__segment_req *req) {
  td__create *cr = td__container_of(req, td__create, seg);
  td__server *srv = req->srv;
  td__storage *s = req->s;
  td__conn *c = cr->conn;
  int fd = req->fd;
  /* A legacy CUDA allocation is made with no fd (fd is -1). */
  int made = fd >= 0 || s->legacy;
  create_unlink_from_conn(cr);

  if (made && (c == NULL || srv->stopping)) {
    td__debug("storage %llu: creator left before it was ready; unlinking",
              (unsigned long long)s->id);
    if (fd >= 0)
      close(fd);
    td__segment_unlink(srv, s->device, s->name, s->nbytes);
    td__credit(&srv->reg, s->owner.uid, td__host_bytes(s));
    free(s);
  } else if (!made) {
    if (c != NULL)
      td__conn_error(c, cr->seq, fd, "create of %llu bytes: %s",
                     (unsigned long long)s->nbytes, req->msg);
    td__credit(&srv->reg, s->owner.uid, td__host_bytes(s));
    free(s);
  } else if (td__storage_insert(&srv->reg, s, &c->hold) < 0) {
    if (fd >= 0)
      close(fd);
    td__segment_unlink(srv, s->device, s->name, s->nbytes);
    td__credit(&srv->reg, s->owner.uid, td__host_bytes(s));
    free(s);
    td__conn_error(c, cr->seq, TD_ENOMEM, "create: out of memory");
  } else {
    srv->metrics.storages_created++;
    srv->metrics.bytes_created += s->nbytes;
    td__debug("client %d created storage %llu (%llu bytes)",
              (int)c->hold.peer.pid, (unsigned long long)s->id,
              (unsigned long long)s->nbytes);
    td__event ev = {.type = TD__EV_CREATE, .s = s, .by = &c->hold};
    td__event_emit(srv, &ev);
    td__send_storage(c, cr->seq, s, 0,
                     (cr->client_zeroes && req->reused) || cr->gpu_dirty, fd);
  }
  if (c != NULL)
    td__metrics_observe(&srv->metrics, uv_hrtime() - cr->start_ns);
  free(cr);
}

static int op_create(td__conn *c, uint64_t seq, const Tensord__Create *m) {
  td__server *srv = c->srv;
  td__registry *reg = &srv->reg;
  char a[32], b[32], d[32];
  uint64_t n = m->nbytes;
  if (n == 0)
    return reject(c, seq, TD_EINVAL,
                  "create of 0 bytes: a storage needs at least one byte");
  if (m->device != TENSORD__DEVICE__DEVICE_CPU &&
      m->device != TENSORD__DEVICE__DEVICE_CUDA)
    return reject(c, seq, TD_ENODEV,
                  "create on device %d: this tensord knows CPU and CUDA "
                  "storages only",
                  (int)m->device);
  int cuda = m->device == TENSORD__DEVICE__DEVICE_CUDA;
  if (cuda && m->device_uuid.len != 16)
    return reject(c, seq, TD_EINVAL,
                  "create on CUDA: the GPU's UUID has %zu bytes, not 16",
                  m->device_uuid.len);
  if (m->mode & ~0666u)
    return reject(c, seq, TD_EINVAL,
                  "create with mode %04o: only read and write bits (0666) "
                  "may be set",
                  (unsigned)m->mode);
  /* Creates in flight count: they are storages the client will hold. */
  if (srv->max_storages_per_client &&
      c->hold.refs.count + c->ncreates >= srv->max_storages_per_client)
    return reject(c, seq, TD_EMFILE,
                  "create: this client holds %zu storages and is creating "
                  "%u, the most --max-storages-per-client allows",
                  c->hold.refs.count, c->ncreates);
  /* A pooled segment of this uid serves it if one fits: its bytes are
   * counted already, so only the quota is charged. */
  uid_t uid = c->hold.peer.uid;
  td__pooled *pooled = cuda ? NULL : td__pool_take(&srv->pool, uid, TD_CPU, n);
  /* The limits tensord sets first, then what /dev/shm can hold. A GPU's
   * capacity is its backend's to check, off the loop. */
  char msg[256];
  int err = cuda ? 0 : td__charge(reg, uid, n, 0, msg, sizeof(msg));
  if (err < 0) {
    if (pooled)
      td__pool_untake(&srv->pool, pooled);
    return reject(c, seq, err, "create of %s", msg);
  }
  td__pooled *victims = NULL;
  if (pooled == NULL && !cuda) {
    /* Fresh pages: the pool gives way first if they would not fit. */
    uint64_t shm_free = 0, shm_total = 0, freed = 0;
    int known = td__backend_for(TD_CPU)->space(&shm_free, &shm_total) == 0;
    victims =
        td__pool_make_room(&srv->pool, reg, known ? n : 0, shm_free, &freed);
    if (known && n > shm_free + freed) {
      td__credit(reg, uid, n);
      td__pool_restore(&srv->pool, victims);
      /* The words of shm.c's no_space, which the docs quote: a user sees
       * one message whichever check refuses. */
      return reject(c, seq, TD_ENOSPC,
                    "/dev/shm cannot hold %s (%llu bytes): %s free of %s",
                    td__human_bytes(n, a, sizeof(a)), (unsigned long long)n,
                    td__human_bytes(shm_free + freed, b, sizeof(b)),
                    td__human_bytes(shm_total, d, sizeof(d)));
    }
  }

  /* A name no one can foresee (td__segment_name), for the id to come. */
  char name[TD__SEGMENT_NAME_MAX];
  err = td__segment_name(name, srv->prefix, reg->next_id, msg, sizeof(msg));
  td__create *cr = err < 0 ? NULL : calloc(1, sizeof(*cr));
  td__storage *s = err < 0 ? NULL : calloc(1, sizeof(*s));
  if (cr == NULL || s == NULL) {
    free(cr);
    free(s);
    td__credit(reg, uid, cuda ? 0 : n);
    if (pooled)
      td__pool_untake(&srv->pool, pooled);
    td__pool_restore(&srv->pool, victims);
    if (err < 0)
      return reject(c, seq, err, "create: %s", msg);
    return reject(c, seq, TD_ENOMEM, "create: out of memory");
  }
  s->mode = m->mode ? m->mode : 0600;
  s->id = reg->next_id++;
  s->nbytes = n;
  s->device = cuda ? TD_CUDA : TD_CPU;
  if (cuda)
    memcpy(s->uuid, m->device_uuid.data, 16);
  s->owner = c->hold.peer;
  s->created_ms = td__now_ms();
  memcpy(s->name, name, sizeof(name));
  cr->conn = c;
  cr->seq = seq;
  cr->start_ns = c->req_ns;
  c->req_timed = 1; /* create_finish, now or later */
  TD__LIST_PUSH(&c->creates, cr, prev, next);
  c->ncreates++;
  cr->seg.pooled = pooled;
  cr->seg.victims = victims;
  cr->client_zeroes = !m->uninitialized && m->client_zeroes;
  cr->seg.zero = !m->uninitialized && !m->client_zeroes;
  /* A fresh GPU allocation's bytes are whatever they were: the client,
   * which maps it anyway, zeroes it (a cuMemsetD8) unless told not to. */
  cr->gpu_dirty = cuda && !m->uninitialized;
  td__segment_create(srv, &cr->seg, s, create_finish);
  return 0;
}

/* ---- open, release ---- */

static int op_open(td__conn *c, uint64_t seq, const Tensord__Open *m) {
  td__storage *s = td__storage_find(&c->srv->reg, m->id);
  if (s == NULL)
    return reject(c, seq, TD_ENOENT, "storage %llu: no such storage",
                  (unsigned long long)m->id);
  char msg[256];
  int fd;
  int err = td__grant(c, s, m->readonly, 0, m->force_fd, &fd, msg, sizeof(msg));
  if (err < 0)
    return reject(c, seq, err, "storage %llu: %s", (unsigned long long)m->id,
                  msg);
  return td__send_storage(c, seq, s, m->readonly, 0, fd);
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

static char *key_str(const ProtobufCBinaryData *k, char *buf, size_t len) {
  size_t n = k->len < len - 1 ? k->len : len - 1;
  memcpy(buf, k->data, n);
  buf[n] = '\0';
  return buf;
}

/* Answers seq: its key change could not be recorded in --state-dir, so it
 * was not made. */
static void unrecorded(td__conn *c, uint64_t seq, const char *what,
                       const char *key) {
  td__conn_error(c, seq, TD_EIO,
                 "%s '%s': the change cannot be recorded in %s (out of "
                 "memory); nothing changed",
                 what, key, c->srv->state_dir);
}

/* Answers a lookup of k for c, taking the key if asked. */
static void answer_lookup(td__conn *c, const td__lookup_args *a, td__key *k) {
  uint64_t seq = a->seq;
  int ro = a->readonly, take = a->take;
  td__storage *s = k->storage;
  char msg[256];
  int fd;
  int err = td__grant(c, s, ro, take, a->force_fd, &fd, msg, sizeof(msg));
  if (err < 0) {
    td__conn_error(c, seq, err, "key '%s' (storage %llu): %s", k->name,
                   (unsigned long long)s->id, msg);
    return;
  }
  td_view view = k->view; /* outlives a take */
  uint8_t event[64];      /* and so does this */
  int has_event = k->has_event;
  memcpy(event, k->event, sizeof(event));
  Tensord__StorageReply sm;
  Tensord__View vm;
  Tensord__LookupReply lm = TENSORD__LOOKUP_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  td__storage_reply(s, ro, fd, &sm);
  td__view_to_msg(&view, &vm);
  lm.storage = &sm;
  lm.view = &vm;
  if (has_event) {
    lm.event_handle.data = event;
    lm.event_handle.len = sizeof(event);
  }
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_LOOKUP;
  r.lookup = &lm;
  td__event ev = td__key_event(take ? TD__EV_TAKE : TD__EV_LOOKUP, k, &c->hold);
  if (!take) {
    td__event_emit(c->srv, &ev);
    td__conn_send(c, &r, fd);
    return;
  }
  if (k->scope != NULL) { /* never journaled: nothing to record */
    td__debug("client %d took scoped key '%s'", (int)c->hold.peer.pid, k->name);
    td__event_emit(c->srv, &ev);
    td__key_remove(&c->srv->reg, k);
    td__conn_send(c, &r, fd);
    return;
  }
  if (td__state_del(c->srv->state, k->name, k->len) < 0) {
    /* Give back what grant gave: the key stays, as if never asked. */
    if (fd >= 0)
      close(fd);
    td__ref_drop(&c->srv->reg, &c->hold, s->id, ro, 1);
    unrecorded(c, seq, "take", k->name);
    return;
  }
  td__debug("client %d took key '%s'", (int)c->hold.peer.pid, k->name);
  td__event_emit(c->srv, &ev);
  td__key_remove(&c->srv->reg, k);
  td__state_reply(c->srv->state, c, &r, fd);
}

/* A waiting lookup and its timer. */
typedef struct waiter {
  td__wait w;
  uv_timer_t timer;
} waiter;

static void waiter_closed(uv_handle_t *h) {
  free(td__container_of((uv_timer_t *)h, waiter, timer));
}

/* Frees w, which the queues have let go of, once its timer has closed;
 * first answers it from k, if its key was published. */
static void waiter_done(td__wait *w, td__key *k, void *arg) {
  waiter *wt = td__container_of(w, waiter, w);
  td__conn *c = w->owner;
  td__lookup_args a = w->args;
  (void)arg;
  c->nwaiters--;
  uv_timer_stop(&wt->timer);
  uv_close((uv_handle_t *)&wt->timer, waiter_closed);
  if (k != NULL)
    answer_lookup(c, &a, k);
}

static void on_wait_timeout(uv_timer_t *t) {
  td__wait *w = &td__container_of(t, waiter, timer)->w;
  td__conn *c = w->owner;
  char key[TD_KEY_MAX + 1];
  snprintf(key, sizeof(key), "%.*s", (int)w->len, w->key);
  uint64_t seq = w->args.seq;
  int32_t ms = w->wait_ms;
  td__wait_remove(&c->srv->waits, w);
  waiter_done(w, NULL, NULL);
  td__conn_error(c, seq, TD_ETIMEDOUT, "key '%s': not published (waited %d ms)",
                 key, (int)ms);
}

int td__wait_restore(td__conn *c, const char *key, size_t len,
                     const td__lookup_args *a, int32_t wait_ms,
                     int64_t deadline_ms) {
  td__server *srv = c->srv;
  waiter *wt = calloc(1, sizeof(*wt));
  if (wt == NULL)
    return TD_ENOMEM;
  wt->w = (td__wait){.owner = c,
                     .list = &c->waiters,
                     .args = *a,
                     .wait_ms = wait_ms,
                     .deadline_ms = deadline_ms};
  if (td__wait_add(&srv->waits, &wt->w, key, len) < 0) {
    free(wt);
    return TD_ENOMEM;
  }
  c->nwaiters++;
  uv_timer_init(srv->loop, &wt->timer);
  if (deadline_ms >= 0) {
    int64_t now = (int64_t)uv_now(srv->loop);
    uv_timer_start(&wt->timer, on_wait_timeout,
                   deadline_ms > now ? (uint64_t)(deadline_ms - now) : 0, 0);
  }
  return 0;
}

typedef struct each_arg {
  td__wait_each_fn fn;
  void *arg;
} each_arg;

static int each_waiter(void *arg, const td__wait *w) {
  const each_arg *x = arg;
  return x->fn(x->arg, w->owner, w->key, w->len, &w->args, w->wait_ms,
               w->deadline_ms);
}

int td__waits_each(td__waits *ws, td__wait_each_fn fn, void *arg) {
  each_arg x = {fn, arg};
  return td__waits_walk(ws, each_waiter, &x);
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
  td__lookup_args a = {seq, m->readonly, m->take, m->force_fd};
  td__key *k = td__key_find(&srv->reg, (const char *)m->key.data, m->key.len);
  if (k != NULL) {
    answer_lookup(c, &a, k);
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
  if (c->nwaiters >= srv->max_waiters_per_client)
    return reject(c, seq, TD_EMFILE,
                  "key '%s': this client has %u lookups waiting, the most "
                  "--max-waiters-per-client allows",
                  key, c->nwaiters);
  int64_t deadline =
      m->wait_ms > 0 ? (int64_t)uv_now(srv->loop) + m->wait_ms : (int64_t)-1;
  if (td__wait_restore(c, (const char *)m->key.data, m->key.len, &a, m->wait_ms,
                       deadline) < 0)
    return reject(c, seq, TD_ENOMEM, "lookup: out of memory");
  td__debug("client %d waits for key '%s' (%d ms)", (int)c->hold.peer.pid, key,
            (int)m->wait_ms);
  return 0;
}

/* ---- many keys in one request ---- */

/* Items per LookupManyReply frame: each is at most about 1 KiB (a message
 * of up to 640 bytes, or a reply with a 16-dim view, a UUID, an IPC handle
 * and an event), so a frame stays far below TD__FRAME_MAX. */
#define MANY_ITEMS 256
#define MANY_MSG 640

/* One frame of a LookupMany reply in the making: what its items point to. */
typedef struct many_chunk {
  Tensord__LookupManyItem item[MANY_ITEMS];
  Tensord__LookupManyItem *itemp[MANY_ITEMS];
  Tensord__LookupReply lm[MANY_ITEMS];
  Tensord__StorageReply sm[MANY_ITEMS];
  Tensord__View vm[MANY_ITEMS];
  td_view view[MANY_ITEMS];
  char msg[MANY_ITEMS][MANY_MSG];
  int fds[TD__FRAME_MAX_FDS];
  unsigned nitems, nfds;
} many_chunk;

/* Answers keys[i] of a LookupMany into the chunk's next item. A key found
 * gets c one reference (td__grant: access, limits and counts exactly as a
 * Lookup's) and, when c did not hold the storage in that mode, an fd in the
 * chunk; any other key gets its own code and message. */
static void many_item(td__conn *c, many_chunk *ch, const ProtobufCBinaryData *k,
                      int ro) {
  unsigned j = ch->nitems++;
  Tensord__LookupManyItem *it = &ch->item[j];
  char *msg = ch->msg[j];
  char why[256], key[TD_KEY_MAX + 1];
  tensord__lookup_many_item__init(it);
  ch->itemp[j] = it;
  int err = td__key_validate((const char *)k->data, k->len, why, sizeof(why));
  if (err < 0) {
    it->code = err;
    snprintf(msg, MANY_MSG, "bad key: %s", why);
    it->message = msg;
    return;
  }
  key_str(k, key, sizeof(key));
  td__key *tk = td__key_find(&c->srv->reg, (const char *)k->data, k->len);
  if (tk == NULL) {
    it->code = TD_ENOENT;
    snprintf(msg, MANY_MSG, "key '%s': not published", key);
    it->message = msg;
    return;
  }
  td__storage *s = tk->storage;
  int fd = -1;
  err = td__grant(c, s, ro, 0, 0, &fd, why, sizeof(why));
  if (err < 0) {
    it->code = err;
    snprintf(msg, MANY_MSG, "key '%s' (storage %llu): %s", key,
             (unsigned long long)s->id, why);
    it->message = msg;
    return;
  }
  if (fd >= 0)
    ch->fds[ch->nfds++] = fd;
  ch->view[j] = tk->view;
  td__storage_reply(s, ro, fd, &ch->sm[j]);
  td__view_to_msg(&ch->view[j], &ch->vm[j]);
  tensord__lookup_reply__init(&ch->lm[j]);
  ch->lm[j].storage = &ch->sm[j];
  ch->lm[j].view = &ch->vm[j];
  if (tk->has_event) {
    ch->lm[j].event_handle.data = tk->event;
    ch->lm[j].event_handle.len = sizeof(tk->event);
  }
  it->lookup = &ch->lm[j];
  td__event ev = td__key_event(TD__EV_LOOKUP, tk, &c->hold);
  td__event_emit(c->srv, &ev);
}

/* Answers every key of m in this loop turn, so the reply is one instant's
 * registry; in frames of at most MANY_ITEMS items and TD__FRAME_MAX_FDS
 * fds. No frame is sent before its items are all granted, and a key's
 * storage stays alive by c's reference until its frame is read. */
static int op_lookup_many(td__conn *c, uint64_t seq,
                          const Tensord__LookupMany *m) {
  size_t n = m->n_keys;
  if (n == 0)
    return reject(c, seq, TD_EINVAL, "lookup_many: no keys");
  if (n > TD_LOOKUP_MANY_MAX)
    return reject(c, seq, TD_EINVAL,
                  "lookup_many of %zu keys: at most %d in one request", n,
                  TD_LOOKUP_MANY_MAX);
  many_chunk *ch = malloc(sizeof(*ch));
  if (ch == NULL)
    return reject(c, seq, TD_ENOMEM, "lookup_many: out of memory");
  Tensord__LookupManyReply rm;
  Tensord__Response r;
  for (size_t first = 0; first < n;) {
    ch->nitems = ch->nfds = 0;
    while (first + ch->nitems < n && ch->nitems < MANY_ITEMS &&
           ch->nfds < TD__FRAME_MAX_FDS)
      many_item(c, ch, &m->keys[first + ch->nitems], m->readonly);
    tensord__lookup_many_reply__init(&rm);
    rm.first = (uint32_t)first;
    rm.n_items = ch->nitems;
    rm.items = ch->itemp;
    first += ch->nitems;
    rm.last = first == n;
    tensord__response__init(&r);
    r.seq = seq;
    r.body_case = TENSORD__RESPONSE__BODY_LOOKUP_MANY;
    r.lookup_many = &rm;
    /* On failure the connection is closing: the fds are closed, and the
     * references go with its holdings. */
    if (td__conn_send_fds(c, &r, ch->fds, ch->nfds) < 0)
      break;
  }
  free(ch);
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
  if (m->event_handle.len != 0 && m->event_handle.len != 64)
    return reject(c, seq, TD_EINVAL,
                  "publish '%s': an event handle of %zu bytes, not 64 (a "
                  "CUipcEventHandle)",
                  key, m->event_handle.len);
  if (m->event_handle.len != 0 && s->device != TD_CUDA)
    return reject(c, seq, TD_EINVAL,
                  "publish '%s' with an event: storage %llu is not on a GPU",
                  key, (unsigned long long)s->id);
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
  td__scope *scope = NULL;
  if (m->scope != 0) {
    scope = td__scope_find(reg, m->scope);
    if (scope == NULL)
      return reject(c, seq, TD_ENOENT,
                    "publish '%s': scope %016llx has ended (or was never "
                    "opened)",
                    key, (unsigned long long)m->scope);
    if (scope->uid != c->hold.peer.uid && c->hold.peer.uid != 0)
      return reject(c, seq, TD_EACCES,
                    "publish '%s': scope %016llx belongs to uid %u, not to "
                    "uid %u",
                    key, (unsigned long long)m->scope, (unsigned)scope->uid,
                    (unsigned)c->hold.peer.uid);
    if (k != NULL)
      return reject(c, seq, TD_EEXIST,
                    "publish '%s' into scope %016llx: the key exists "
                    "(storage %llu); a scoped publish never replaces a key",
                    key, (unsigned long long)m->scope,
                    (unsigned long long)k->storage->id);
  }
  if (k != NULL && td__check_access(c, k->storage, TD__MAY_WRITE,
                                    "replacing it", msg, sizeof(msg)) < 0)
    return reject(c, seq, TD_EACCES, "publish '%s' (storage %llu): %s", key,
                  (unsigned long long)k->storage->id, msg);
  /* Keys outlive connections: they count against the uid that published
   * them, like bytes against --quota. */
  uid_t uid = c->hold.peer.uid;
  uint64_t nkeys = td__keys_of(reg, uid);
  if ((k == NULL || k->uid != uid) && nkeys >= c->srv->max_keys_per_uid)
    return reject(c, seq, TD_EDQUOT,
                  "publish '%s': uid %u has published %llu keys, the most "
                  "--max-keys-per-uid allows",
                  key, (unsigned)uid, (unsigned long long)nkeys);
  /* Whatever can fail comes before the record; the record comes before the
   * change (see td__state_put). */
  td__key_prep prep;
  int err = td__key_prepare(reg, key, m->key.len, s, uid, &prep);
  if (err == TD_EOVERFLOW)
    return reject(c, seq, err,
                  "publish '%s': storage %llu has %u references, the most "
                  "tensord can count",
                  key, (unsigned long long)s->id, s->refs);
  if (err < 0)
    return reject(c, seq, err, "publish '%s': out of memory", key);
  prep.scope = scope;
  /* A scoped key is never journaled: it does not outlive its scope. Nor is
   * a key of a GPU's storage, whose memory dies with the daemon: its record
   * says the key is gone, over whatever the journal said it was before. */
  if (scope == NULL &&
      (s->device == TD_CPU
           ? td__state_put(c->srv->state, key, m->key.len, s, uid, &v)
           : td__state_del(c->srv->state, key, m->key.len)) < 0) {
    td__key_abort(reg, &prep);
    unrecorded(c, seq, "publish", key);
    return 0;
  }
  k = td__key_commit(reg, &prep, &v);
  /* The event is this connection's process's: it goes from the key when
   * the connection does (td__ops_conn_gone). */
  if (m->event_handle.len == 64)
    td__key_set_event(k, &c->hold, m->event_handle.data);
  td__debug("client %d published '%s' -> storage %llu", (int)c->hold.peer.pid,
            key, (unsigned long long)s->id);
  td__event ev = td__key_event(TD__EV_PUBLISH, k, &c->hold);
  td__event_emit(c->srv, &ev);
  send_ok(c, seq);
  td__wait_wake(&c->srv->waits, &c->srv->reg, k, waiter_done, NULL);
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
  if (td__check_access(c, k->storage, TD__MAY_WRITE, "unpublish", msg,
                       sizeof(msg)) < 0)
    return reject(c, seq, TD_EACCES, "key '%s' (storage %llu): %s", k->name,
                  (unsigned long long)k->storage->id, msg);
  if (k->scope == NULL && td__state_del(c->srv->state, k->name, k->len) < 0) {
    unrecorded(c, seq, "unpublish", k->name);
    return 0;
  }
  td__event ev = td__key_event(TD__EV_UNPUBLISH, k, &c->hold);
  td__event_emit(c->srv, &ev);
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
  if (s->device == TD_CUDA) {
    m->device_uuid.data = (uint8_t *)s->uuid;
    m->device_uuid.len = 16;
    m->device_mig = td__cuda_is_mig(s->uuid);
  }
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
    hs[i].name = (char *)td__ref_holdings(r)->name;
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

/* Fills ki (and v, which it points to) with key k of storage id. */
static Tensord__KeyInfo *key_info(const td__key *k, uint64_t id,
                                  Tensord__KeyInfo *ki, Tensord__View *v) {
  tensord__key_info__init(ki);
  ki->key.len = k->len;
  ki->key.data = (uint8_t *)k->name;
  ki->id = id;
  td__view_to_msg(&k->view, v);
  ki->view = v;
  ki->published_unix_ms = k->published_ms;
  return ki;
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
    kp[i] = key_info(named, s->id, &ks[i], &vs[i]);
    i++;
  }
  for (const td__key *k = s->keys; k && i < nk; k = k->snext) {
    if (k != named) {
      kp[i] = key_info(k, s->id, &ks[i], &vs[i]);
      i++;
    }
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

/* The daemon's own memory: its resident set now (/proc/self/statm, in
 * pages) and what malloc has handed out and not got back (mallinfo2: in
 * arenas and in mmapped blocks). Either is 0 if it cannot be read. */
static void daemon_memory(uint64_t *rss, uint64_t *heap) {
  unsigned long long size = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "re");
  *rss = 0;
  if (f != NULL) {
    if (fscanf(f, "%llu %llu", &size, &resident) == 2)
      *rss = (uint64_t)resident * (uint64_t)sysconf(_SC_PAGESIZE);
    fclose(f);
  }
  struct mallinfo2 mi = mallinfo2();
  *heap = (uint64_t)mi.uordblks + (uint64_t)mi.hblkhd;
}

static int op_stat(td__conn *c, uint64_t seq) {
  td__server *srv = c->srv;
  Tensord__StatReply st = TENSORD__STAT_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  uint64_t total = 0;
  st.storages = srv->reg.storages.count;
  st.bytes_used = srv->reg.bytes_used;
  st.capacity = srv->reg.capacity;
  td__shm_backend.space(&st.shm_free, &total);
  st.clients = srv->nconns;
  st.keys = srv->reg.keys.count;
  st.waiters = srv->waits.count;
  st.uptime_ms = td__now_ms() - srv->start_ms;
  st.pid = (int32_t)getpid();
  st.instance = srv->instance;
  st.quota = srv->reg.quota;
  st.max_clients = srv->max_clients;
  st.max_storages_per_client = srv->max_storages_per_client;
  st.state_dir = srv->state_dir;
  st.pool_segments = srv->pool.count;
  st.pool_bytes = srv->pool.bytes;
  st.pool_limit = srv->pool.limit;
  st.pool_hits = srv->pool.hits;
  /* The GPUs: figures the CUDA backend keeps, no driver call. */
  td__cuda_stat cs[TD__STAT_DEVICES_MAX];
  Tensord__DeviceStat ds[TD__STAT_DEVICES_MAX];
  Tensord__DeviceStat *dp[TD__STAT_DEVICES_MAX];
  size_t nd = td__cuda_stats(cs, TD__STAT_DEVICES_MAX);
  if (nd > TD__STAT_DEVICES_MAX)
    nd = TD__STAT_DEVICES_MAX;
  for (size_t i = 0; i < nd; i++) {
    tensord__device_stat__init(&ds[i]);
    ds[i].device = TENSORD__DEVICE__DEVICE_CUDA;
    ds[i].uuid.data = cs[i].uuid;
    ds[i].uuid.len = 16;
    ds[i].bytes_used = cs[i].bytes_used;
    ds[i].capacity = cs[i].capacity;
    ds[i].storages = cs[i].storages;
    ds[i].pool_bytes = cs[i].pool_bytes;
    ds[i].pool_allocs = cs[i].pool_allocs;
    ds[i].index = cs[i].index;
    ds[i].mig = cs[i].mig;
    dp[i] = &ds[i];
  }
  st.n_devices = nd;
  st.devices = dp;
  st.pool_misses = srv->pool.misses;
  /* A handful: this instance's two and one per earlier instance whose
   * segments it adopted (none if memory is short: stat still answers). */
  char **pp = malloc(srv->nprefixes * sizeof(*pp) + 1);
  for (size_t i = 0; pp != NULL && i < srv->nprefixes; i++)
    pp[i] = srv->prefixes[i];
  st.n_prefixes = pp != NULL ? srv->nprefixes : 0;
  st.prefixes = pp;
  daemon_memory(&st.daemon_rss_bytes, &st.daemon_heap_bytes);
  st.version = (char *)TD_VERSION_STRING;
  st.socket = srv->socket_path;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_STAT;
  r.stat = &st;
  td__conn_send(c, &r, -1);
  free(pp);
  return 0;
}

/* ---- metrics ---- */

#define METRICS_CLIENTS_MAX 1024 /* clients in a MetricsReply */
#define METRICS_LARGEST_MAX 64   /* storages in a MetricsReply */
#define METRICS_KEYS_MAX 4       /* keys per storage there */

static int busier(const void *a, const void *b) {
  const td__conn *x = *(td__conn *const *)a, *y = *(td__conn *const *)b;
  return x->nrequests < y->nrequests ? 1 : x->nrequests > y->nrequests ? -1 : 0;
}

/* Bytes of the storages c holds. */
static uint64_t bytes_held(const td__conn *c) {
  uint64_t n = 0;
  const td__htab *t = &c->hold.refs;
  for (size_t b = 0; b < t->nbuckets; b++)
    for (const td__hnode *h = t->buckets[b]; h != NULL; h = h->next)
      n += td__container_of(h, td__ref, node)->storage->nbytes;
  return n;
}

static int op_metrics(td__conn *c, uint64_t seq, const Tensord__Metrics *m) {
  td__server *srv = c->srv;
  arena a = {0};
  char *text = NULL;
  Tensord__MetricsReply mr = TENSORD__METRICS_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  if (!m->no_text) {
    size_t len;
    text = td__metrics_render(srv, &len);
    if (text == NULL)
      goto nomem;
    mr.text = text;
  }
  mr.uptime_ms = td__now_ms() - srv->start_ms;
  mr.storages = srv->reg.storages.count;
  mr.bytes_used = srv->reg.bytes_used;
  mr.capacity = srv->reg.capacity;
  for (int i = 0; i < TD__METRIC_TYPES; i++)
    mr.requests += srv->metrics.requests[i];
  mr.nclients = srv->nconns;

  /* The busiest clients. */
  size_t n = 0;
  td__conn **cs = arena_alloc(&a, srv->nconns * sizeof(*cs));
  if (cs == NULL)
    goto nomem;
  for (td__conn *x = srv->conns; x != NULL && n < srv->nconns; x = x->next)
    cs[n++] = x;
  qsort(cs, n, sizeof(*cs), busier);
  if (n > METRICS_CLIENTS_MAX)
    n = METRICS_CLIENTS_MAX;
  Tensord__ClientStat *st = arena_alloc(&a, n * sizeof(*st));
  Tensord__ClientStat **sp = arena_alloc(&a, n * sizeof(*sp));
  if (st == NULL || sp == NULL)
    goto nomem;
  for (size_t i = 0; i < n; i++) {
    tensord__client_stat__init(&st[i]);
    st[i].pid = cs[i]->hold.peer.pid;
    st[i].uid = cs[i]->hold.peer.uid;
    st[i].name = cs[i]->name;
    st[i].requests = cs[i]->nrequests;
    st[i].refs = cs[i]->hold.nrefs;
    st[i].bytes_held = bytes_held(cs[i]);
    sp[i] = &st[i];
  }
  mr.n_clients = n;
  mr.clients = sp;

  /* The largest storages, kept sorted as the registry is walked. */
  size_t k =
      m->largest < METRICS_LARGEST_MAX ? m->largest : METRICS_LARGEST_MAX;
  const td__storage *top[METRICS_LARGEST_MAX];
  size_t nt = 0;
  for (const td__storage *s = srv->reg.first; s != NULL && k > 0; s = s->next) {
    if (nt == k && s->nbytes <= top[nt - 1]->nbytes)
      continue;
    size_t j = nt < k ? nt++ : nt - 1;
    for (; j > 0 && top[j - 1]->nbytes < s->nbytes; j--)
      top[j] = top[j - 1];
    top[j] = s;
  }
  Tensord__StorageInfo *infos = arena_alloc(&a, nt * sizeof(*infos));
  Tensord__StorageInfo **ip = arena_alloc(&a, nt * sizeof(*ip));
  if (infos == NULL || ip == NULL)
    goto nomem;
  for (size_t i = 0; i < nt; i++) {
    if (storage_info(&a, top[i], METRICS_KEYS_MAX, &infos[i]) < 0)
      goto nomem;
    ip[i] = &infos[i];
  }
  mr.n_largest = nt;
  mr.largest = ip;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_METRICS;
  r.metrics = &mr;
  td__conn_send(c, &r, -1);
  free(text);
  arena_free(&a);
  return 0;
nomem:
  free(text);
  arena_free(&a);
  return reject(c, seq, TD_ENOMEM, "metrics: out of memory");
}

/* Scopes this connection may have open at once. */
#define TD__SCOPES_PER_CONN 1024

static void scope_unlink_from_conn(td__conn *c, td__scope *sc);

static int send_scope(td__conn *c, uint64_t seq, uint64_t token,
                      uint64_t dropped) {
  Tensord__ScopeReply m = TENSORD__SCOPE_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  m.token = token;
  m.dropped = dropped;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_SCOPE;
  r.scope = &m;
  td__conn_send(c, &r, -1);
  return 0;
}

static int op_scope(td__conn *c, uint64_t seq, const Tensord__Scope *m) {
  td__registry *reg = &c->srv->reg;
  if (m->close) {
    td__scope *sc = td__scope_find(reg, m->token);
    if (sc == NULL || sc->owner != c)
      return reject(c, seq, TD_ENOENT,
                    "scope %016llx: not open on this connection (ended, or "
                    "another connection's)",
                    (unsigned long long)m->token);
    scope_unlink_from_conn(c, sc);
    uint64_t n = td__scope_close(reg, sc);
    td__debug("client %d closed scope %016llx: %llu key(s) dropped",
              (int)c->hold.peer.pid, (unsigned long long)m->token,
              (unsigned long long)n);
    return send_scope(c, seq, m->token, n);
  }
  if (c->nscopes >= TD__SCOPES_PER_CONN)
    return reject(c, seq, TD_EMFILE,
                  "scope: this connection has %u scopes open, the most "
                  "tensord allows (close some)",
                  c->nscopes);
  uint64_t token = 0;
  td__scope *sc = NULL;
  int err = TD_EEXIST;
  for (int tries = 0; err == TD_EEXIST && tries < 8; tries++) {
    if (getrandom(&token, sizeof(token), 0) != sizeof(token))
      token = td__hash_u64((uint64_t)td__now_ms() ^ (uint64_t)c->nscopes ^
                           (uint64_t)(uintptr_t)c ^ c->srv->instance);
    if (token != 0)
      err = td__scope_open(reg, token, c->hold.peer.uid, c, &sc);
  }
  if (err < 0)
    return reject(c, seq, TD_ENOMEM, "scope: %s",
                  err == TD_EEXIST ? "no unused token drawn in 8 tries"
                                   : "out of memory");
  TD__LIST_PUSH(&c->scopes, sc, oprev, onext);
  c->nscopes++;
  return send_scope(c, seq, token, 0);
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
  td__event ev = {.type = TD__EV_CONNECT, .by = &c->hold};
  td__event_emit(srv, &ev);
  td__conn_send(c, &r, -1);
  return 0;
}

static int op_watch(td__conn *c, uint64_t seq, const Tensord__Watch *m) {
  if (m->prefix.len > TD_KEY_MAX)
    return reject(c, seq, TD_EINVAL,
                  "watch: a prefix of %zu bytes; keys have at most %d",
                  m->prefix.len, TD_KEY_MAX);
  if (m->prefix.len > 0 && memchr(m->prefix.data, '\0', m->prefix.len))
    return reject(c, seq, TD_EINVAL,
                  "watch: the prefix holds a NUL byte, which no key has");
  td__watch_start(c, seq, m->prefix.data, m->prefix.len);
  Tensord__Ok ok = TENSORD__OK__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_OK;
  r.ok = &ok;
  td__conn_send(c, &r, -1);
  return 0;
}

/* The key req names, if any, for the events it sets off. */
static void request_key(const Tensord__Request *req, const char **key,
                        size_t *len) {
  const ProtobufCBinaryData *k = NULL;
  switch (req->body_case) {
  case TENSORD__REQUEST__BODY_PUBLISH:
    k = &req->publish->key;
    break;
  case TENSORD__REQUEST__BODY_LOOKUP:
    k = &req->lookup->key;
    break;
  case TENSORD__REQUEST__BODY_UNPUBLISH:
    k = &req->unpublish->key;
    break;
  case TENSORD__REQUEST__BODY_INFO:
    if (req->info->which_case == TENSORD__INFO__WHICH_KEY)
      k = &req->info->key;
    break;
  default:
    break;
  }
  *key = k != NULL ? (const char *)k->data : NULL;
  *len = k != NULL ? k->len : 0;
}

static int dispatch(td__conn *c, Tensord__Request *req);

int td__dispatch(td__conn *c, Tensord__Request *req) {
  td__server *srv = c->srv;
  srv->current = c;
  request_key(req, &srv->current_key, &srv->current_key_len);
  int err = dispatch(c, req);
  srv->current = NULL;
  srv->current_key = NULL;
  srv->current_key_len = 0;
  return err;
}

static int dispatch(td__conn *c, Tensord__Request *req) {
  uint64_t seq = req->seq;
  if (!c->hello && req->body_case != TENSORD__REQUEST__BODY_HELLO)
    return td__conn_error(c, seq, TD_EPROTO,
                          "the first request must be Hello (got request "
                          "type %d)",
                          (int)req->body_case);
  /* A watcher takes no other request; a second Hello is still a protocol
   * error, and a Release (never answered) still gives back what it held. */
  if (c->watching && req->body_case != TENSORD__REQUEST__BODY_HELLO &&
      req->body_case != TENSORD__REQUEST__BODY_RELEASE)
    return reject(c, seq, TD_EBUSY,
                  "this connection watches events (since seq %llu) and "
                  "takes no other request; open another connection",
                  (unsigned long long)c->watch_seq);
  /* Nor does a connection that asked for a live upgrade, until it is
   * answered: it is not handed over, so a storage, waiter or scope it took
   * now would make the handover fail (or be lost with it). */
  if (td__upgrade_asked(c) && req->body_case != TENSORD__REQUEST__BODY_HELLO &&
      req->body_case != TENSORD__REQUEST__BODY_RELEASE)
    return reject(c, seq, TD_EBUSY,
                  "upgrade: this connection asked for a live upgrade and "
                  "takes no other request until it is answered; open "
                  "another connection");
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
  case TENSORD__REQUEST__BODY_LOOKUP_MANY:
    return op_lookup_many(c, seq, req->lookup_many);
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
  case TENSORD__REQUEST__BODY_SCOPE:
    return op_scope(c, seq, req->scope);
  case TENSORD__REQUEST__BODY_METRICS:
    return op_metrics(c, seq, req->metrics);
  case TENSORD__REQUEST__BODY_WATCH:
    return op_watch(c, seq, req->watch);
  case TENSORD__REQUEST__BODY_UPGRADE:
    return td__upgrade_request(c, seq, req->upgrade);
  case TENSORD__REQUEST__BODY_CHAN_CREATE:
  case TENSORD__REQUEST__BODY_CHAN_OPEN:
  case TENSORD__REQUEST__BODY_CHAN_SLOT:
  case TENSORD__REQUEST__BODY_CHAN_CLOSE:
  case TENSORD__REQUEST__BODY_CHAN_PUT:
  case TENSORD__REQUEST__BODY_CHAN_TAKE:
  case TENSORD__REQUEST__BODY_CHAN_LIST:
    return td__chan_request(c, req);
  default:
    /* A newer client's operation: say so and keep the connection. */
    td__conn_error(c, seq, TD_ENOSYS,
                   "unknown operation: this tensord %s does not know the "
                   "request (or it has no body)",
                   TD_VERSION_STRING);
    return 0;
  }
}

static void scope_unlink_from_conn(td__conn *c, td__scope *sc) {
  TD__LIST_REMOVE(&c->scopes, sc, oprev, onext);
  c->nscopes--;
}

void td__ops_conn_gone(td__conn *c) {
  td__waits_drop(&c->srv->waits, &c->waiters, waiter_done, NULL);
  /* The events it published die with its process (or already did): a
   * consumer that looks up one of their keys from now on gets no event
   * rather than one whose use would be undefined (docs/cuda.md). */
  size_t nev = td__holdings_drop_events(&c->hold);
  if (nev > 0)
    td__debug("client %d gone: dropped its event from %zu key(s)",
              (int)c->hold.peer.pid, nev);
  while (c->creates != NULL)
    create_unlink_from_conn(c->creates);
  /* Its scopes end with it: keys still in flight to a process that never
   * took them go now. */
  while (c->scopes != NULL) {
    td__scope *sc = c->scopes;
    uint64_t token = sc->token; /* td__scope_close frees sc */
    scope_unlink_from_conn(c, sc);
    uint64_t n = td__scope_close(&c->srv->reg, sc);
    if (n > 0)
      td__debug("client %d gone: its scope %016llx dropped %llu key(s)",
                (int)c->hold.peer.pid, (unsigned long long)token,
                (unsigned long long)n);
  }
}

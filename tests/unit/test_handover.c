/* test_handover.c: daemon/engine/handover.c without a server: an engine's
 * state goes into the messages of a live upgrade, through protobuf-c's
 * packing, and back into a fresh registry, pool and set of channels,
 * unchanged. Segment names are made up: no segment is ever opened; the
 * channels' rings are real memfds, which both sides map. */
#include "handover.h"
#include "viewmsg.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define NCONNS 3

/* What a server's connection is to the engine: holdings, its scopes and
 * its channel ends. */
typedef struct conn {
  td__holdings hold;
  td__scope *scopes;
  uint32_t nscopes;
  td__chan_end *chan_ends;
  uint32_t nchan_ends;
  uint32_t index;
} conn;

/* One daemon's engine: the old one, or the one that takes over. */
typedef struct side {
  td__registry reg;
  td__pool pool;
  td__chans chans;
  conn conns[NCONNS];
  td__handover_conn hc[NCONNS];
} side;

static side old, new;

static const td__peer peers[NCONNS] = {
    {100, 1000, 1000}, {200, 1001, 1001}, {300, 1000, 100}};

static void free_storage(td__storage *s, void *arg) {
  (void)arg;
  free(s);
}

static uint32_t number(const td__holdings *h) {
  return td__container_of(h, conn, hold)->index;
}

static void side_init(side *d) {
  memset(d, 0, sizeof(*d));
  td__registry_init(&d->reg, 1ull << 40, free_storage, NULL);
  td__pool_init(&d->pool, 1ull << 30, 60000, 0x1234);
  td__chans_init(&d->chans);
  for (uint32_t i = 0; i < NCONNS; i++) {
    conn *c = &d->conns[i];
    td__holdings_init(&c->hold, &peers[i]);
    c->index = i;
    d->hc[i] = (td__handover_conn){
        &c->hold, c, &c->scopes, &c->nscopes, &c->chan_ends, &c->nchan_ends};
  }
}

static void side_free(side *d) {
  td__chans_free(&d->chans, &d->reg);
  for (int i = 0; i < NCONNS; i++)
    td__holdings_clear(&d->reg, &d->conns[i].hold);
  td__registry_free(&d->reg);
  for (td__pooled *e; (e = td__pool_pop(&d->pool)) != NULL;)
    free(e);
}

static void setup(void) {
  side_init(&old);
  side_init(&new);
}

static void teardown(void) {
  side_free(&old);
  side_free(&new);
}

TestSuite(handover, .init = setup, .fini = teardown, .timeout = 30);

/* Makes a storage as a create does, held once read-write by c (or by no
 * one, for a key to hold). */
static td__storage *make(side *d, conn *c, const td__peer *owner,
                         td_device device, uint64_t nbytes) {
  td__storage *s = calloc(1, sizeof(*s));
  cr_assert_not_null(s);
  s->id = d->reg.next_id++;
  s->nbytes = nbytes;
  s->device = device;
  s->mode = 0640;
  s->owner = *owner;
  s->created_ms = 1700000000000 + (int64_t)s->id;
  snprintf(s->name, sizeof(s->name), "/tensord.test.%llu-fake",
           (unsigned long long)s->id);
  cr_assert_eq(td__charge(&d->reg, owner->uid, td__host_bytes(s), 1, NULL, 0),
               0);
  cr_assert_eq(td__storage_insert(&d->reg, s, c ? &c->hold : NULL), 0);
  return s;
}

static void ref(side *d, int c, td__storage *s, int ro) {
  cr_assert_eq(td__ref_add(&d->reg, &d->conns[c].hold, s, ro, NULL), 0);
}

static td__key *publish(side *d, const char *name, td__storage *s,
                        const td_view *v, uid_t uid, td__scope *sc) {
  td__key_prep p;
  cr_assert_eq(td__key_prepare(&d->reg, name, strlen(name), s, uid, &p), 0);
  p.scope = sc;
  td__key *k = td__key_commit(&d->reg, &p, v);
  k->published_ms = 1700000001000 + (int64_t)strlen(name);
  return k;
}

static td__scope *scope(side *d, int c, uint64_t token) {
  conn *o = &d->conns[c];
  td__scope *sc = NULL;
  cr_assert_eq(td__scope_open(&d->reg, token, o->hold.peer.uid, o, &sc), 0);
  sc->onext = o->scopes;
  if (o->scopes != NULL)
    o->scopes->oprev = sc;
  o->scopes = sc;
  o->nscopes++;
  return sc;
}

static void pooled(side *d, const char *name, uid_t uid, uint64_t nbytes) {
  td__pooled *e = calloc(1, sizeof(*e));
  cr_assert_not_null(e);
  snprintf(e->name, sizeof(e->name), "%s", name);
  e->uid = uid;
  e->device = TD_CPU;
  e->nbytes = nbytes;
  e->since_ms = 1700000002000 + (int64_t)nbytes;
  td__pool_put(&d->pool, e);
}

/* The old daemon's state: storages of both devices and several sizes, held
 * read-write and read-only by several connections, keys with views (one in
 * each of two scopes, one with an event), an unheld storage only a key
 * keeps, and pooled segments. */
static void build_old(void) {
  int64_t shape2[2] = {16, 64}, shape1[1] = {4096};
  td_view v2, v1, vt;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape2, &v2), 0);
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape1, &v1), 0);
  vt = v2;
  cr_assert_eq(td_view_transpose(&vt, 0, 1), 0);
  vt.offset = 256;

  td__storage *a = make(&old, &old.conns[0], &peers[0], TD_CPU, 4096);
  td__storage *b = make(&old, &old.conns[0], &peers[0], TD_CPU, 1 << 20);
  ref(&old, 1, b, 1);
  ref(&old, 1, b, 1);
  ref(&old, 2, b, 0);
  ref(&old, 0, b, 1);
  td__storage *c = make(&old, &old.conns[2], &peers[2], TD_CUDA, 8 << 20);
  ref(&old, 2, c, 1);
  td__storage *d = make(&old, NULL, &peers[1], TD_CPU, 65536);
  a->foreign = 1;
  b->named = 1;
  d->mode = 0600;

  td__scope *s1 = scope(&old, 1, 0x1111);
  td__scope *s2 = scope(&old, 1, 0x2222);
  scope(&old, 0, 0x3333);
  publish(&old, "weights/a", a, &v1, 1000, NULL);
  publish(&old, "weights/b", b, &v2, 1000, NULL);
  publish(&old, "weights/b.t", b, &vt, 1001, NULL);
  uint8_t ev[64];
  memset(ev, 0xab, sizeof(ev));
  td__key *e = publish(&old, "tmp/x", c, &v2, 1000, s1);
  td__key_set_event(e, &old.conns[2].hold, ev); /* its publisher's */
  publish(&old, "tmp/y", d, &v1, 1001, s2);

  pooled(&old, "/tensord.0000000000001234-pool.1-fake", 1000, 1 << 20);
  pooled(&old, "/tensord.0000000000001234-pool.2-fake", 1001, 2 << 20);
}

/* Packs m as a packet of type body and unpacks it, as the channel would. */
static Tensord__Handover__Packet *through_wire(int body, void *m) {
  Tensord__Handover__Packet p = TENSORD__HANDOVER__PACKET__INIT;
  p.body_case = body;
  switch (body) {
  case TENSORD__HANDOVER__PACKET__BODY_STORAGES:
    p.storages = m;
    break;
  case TENSORD__HANDOVER__PACKET__BODY_POOL:
    p.pool = m;
    break;
  case TENSORD__HANDOVER__PACKET__BODY_SCOPES:
    p.scopes = m;
    break;
  case TENSORD__HANDOVER__PACKET__BODY_KEYS:
    p.keys = m;
    break;
  case TENSORD__HANDOVER__PACKET__BODY_CHANNEL:
    p.channel = m;
    break;
  case TENSORD__HANDOVER__PACKET__BODY_CHAN_ENDS:
    p.chan_ends = m;
    break;
  case TENSORD__HANDOVER__PACKET__BODY_CHAN_TICKETS:
    p.chan_tickets = m;
    break;
  default:
    p.end = m;
  }
  size_t len = tensord__handover__packet__get_packed_size(&p);
  uint8_t *buf = malloc(len + 1);
  cr_assert_not_null(buf);
  cr_assert_eq(tensord__handover__packet__pack(&p, buf), len);
  Tensord__Handover__Packet *q =
      tensord__handover__packet__unpack(NULL, len, buf);
  free(buf);
  cr_assert_not_null(q, "a packet of type %d does not unpack", body);
  return q;
}

/* Sends p through the wire and has the new side take it. Returns what
 * td__handover_take does, with its message in msg. */
static int take(int body, void *m, char *msg, size_t len) {
  Tensord__Handover__Packet *q = through_wire(body, m);
  msg[0] = '\0';
  int err = td__handover_take(&new.reg, &new.pool, &new.chans, new.hc, NCONNS,
                              q, msg, len);
  tensord__handover__packet__free_unpacked(q, NULL);
  return err;
}

/* Sends channel m with a copy of fd (as SCM_RIGHTS would) to the new side.
 * Returns what td__handover_take_chan does, with its message in msg. */
static int take_chan(Tensord__Handover__Channel *m, int fd, char *msg,
                     size_t len) {
  Tensord__Handover__Packet *q =
      through_wire(TENSORD__HANDOVER__PACKET__BODY_CHANNEL, m);
  msg[0] = '\0';
  int err = td__handover_take_chan(&new.chans, q->channel,
                                   fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1,
                                   msg, len);
  tensord__handover__packet__free_unpacked(q, NULL);
  return err;
}

/* Hands everything from old over to new, in the server's order. */
static void hand_over(void) {
  td__handover h;
  cr_assert_eq(td__handover_save(&old.reg, &old.pool, &old.chans, old.hc,
                                 NCONNS, number, &h),
               0);
  cr_assert_eq(h.storages.n_storages, old.reg.storages.count);
  cr_assert_eq(h.pool.n_pooled, old.pool.count);
  cr_assert_eq(h.scopes.n_scopes, old.reg.scopes.count);
  cr_assert_eq(h.keys.n_keys, old.reg.keys.count);
  cr_assert_eq(h.nchans, old.chans.n);
  char msg[512];
  for (size_t i = 0; i < h.nchans; i++)
    cr_assert_eq(take_chan(h.chans[i], h.chan_fds[i], msg, sizeof(msg)), 0,
                 "%s", msg);
  cr_assert_eq(take(TENSORD__HANDOVER__PACKET__BODY_CHAN_ENDS, &h.ends, msg,
                    sizeof(msg)),
               0, "%s", msg);
  cr_assert_eq(take(TENSORD__HANDOVER__PACKET__BODY_STORAGES, &h.storages, msg,
                    sizeof(msg)),
               0, "%s", msg);
  cr_assert_eq(
      take(TENSORD__HANDOVER__PACKET__BODY_POOL, &h.pool, msg, sizeof(msg)), 0,
      "%s", msg);
  cr_assert_eq(
      take(TENSORD__HANDOVER__PACKET__BODY_SCOPES, &h.scopes, msg, sizeof(msg)),
      0, "%s", msg);
  cr_assert_eq(
      take(TENSORD__HANDOVER__PACKET__BODY_KEYS, &h.keys, msg, sizeof(msg)), 0,
      "%s", msg);
  cr_assert_eq(take(TENSORD__HANDOVER__PACKET__BODY_CHAN_TICKETS, &h.tickets,
                    msg, sizeof(msg)),
               0, "%s", msg);
  cr_assert_eq(td__handover_check(&new.chans, msg, sizeof(msg)), 0, "%s", msg);
  td__handover_free(&h);
}

static void check_view(const td_view *a, const td_view *b, const char *key) {
  cr_assert_eq(a->dtype, b->dtype, "%s: dtype", key);
  cr_assert_eq(a->ndim, b->ndim, "%s: ndim", key);
  cr_assert_eq(a->offset, b->offset, "%s: offset", key);
  for (int i = 0; i < a->ndim; i++) {
    cr_assert_eq(a->shape[i], b->shape[i], "%s: shape[%d]", key, i);
    cr_assert_eq(a->stride[i], b->stride[i], "%s: stride[%d]", key, i);
  }
}

/* Who h are on side d: a connection's number, or a channel's id + 1000. */
static uint64_t holder(const side *d, const td__holdings *h) {
  for (size_t i = 0; i < d->chans.by_id.nbuckets; i++)
    for (td__hnode *n = d->chans.by_id.buckets[i]; n; n = n->next) {
      const td__chan *ch = td__container_of(n, td__chan, inode);
      if (h == &ch->hold)
        return 1000 + ch->id;
    }
  return number(h);
}

static void check_storage(const td__storage *a, const td__storage *b) {
  unsigned long long id = (unsigned long long)a->id;
  cr_assert_not_null(b, "storage %llu came back", id);
  cr_assert_eq(a->id, b->id);
  cr_assert_eq(a->nbytes, b->nbytes, "storage %llu: nbytes", id);
  cr_assert_eq(a->device, b->device, "storage %llu: device", id);
  cr_assert_eq(a->refs, b->refs, "storage %llu: %u refs, now %u", id, a->refs,
               b->refs);
  cr_assert_eq(a->mode, b->mode, "storage %llu: mode", id);
  cr_assert_eq(a->foreign, b->foreign, "storage %llu: foreign", id);
  cr_assert_eq(a->named, b->named, "storage %llu: named", id);
  cr_assert_eq(a->owner.pid, b->owner.pid, "storage %llu: owner pid", id);
  cr_assert_eq(a->owner.uid, b->owner.uid, "storage %llu: owner uid", id);
  cr_assert_eq(a->owner.gid, b->owner.gid, "storage %llu: owner gid", id);
  cr_assert_eq(a->created_ms, b->created_ms, "storage %llu: created", id);
  cr_assert_str_eq(a->name, b->name, "storage %llu: name", id);
  /* Holders in the same order, each of the same connection and counts. */
  const td__ref *x = a->holders, *y = b->holders;
  for (; x != NULL && y != NULL; x = x->snext, y = y->snext) {
    cr_assert_eq(holder(&old, td__ref_holdings(x)),
                 holder(&new, td__ref_holdings(y)),
                 "storage %llu: holders out of order", id);
    cr_assert_eq(x->rw, y->rw, "storage %llu: rw", id);
    cr_assert_eq(x->ro, y->ro, "storage %llu: ro", id);
  }
  cr_assert(x == NULL && y == NULL, "storage %llu: holders differ", id);
  /* Keys in the same order, with the same views and publishers. */
  const td__key *k = a->keys, *l = b->keys;
  for (; k != NULL && l != NULL; k = k->snext, l = l->snext) {
    cr_assert_str_eq(k->name, l->name, "storage %llu: keys out of order", id);
    cr_assert_eq(k->len, l->len);
    cr_assert_eq(td__key_find(&new.reg, k->name, k->len), l);
    check_view(&k->view, &l->view, k->name);
    cr_assert_eq(k->uid, l->uid, "%s: uid", k->name);
    cr_assert_eq(k->published_ms, l->published_ms, "%s: published", k->name);
    cr_assert_eq(k->has_event, l->has_event, "%s: event", k->name);
    cr_assert_eq(memcmp(k->event, l->event, sizeof(k->event)), 0);
    cr_assert_eq(k->evby == NULL, l->evby == NULL, "%s: event's publisher",
                 k->name);
    if (k->evby != NULL)
      cr_assert_eq(holder(&old, k->evby), holder(&new, l->evby),
                   "%s: event of another connection", k->name);
    cr_assert_eq(k->scope ? k->scope->token : 0, l->scope ? l->scope->token : 0,
                 "%s: scope", k->name);
  }
  cr_assert(k == NULL && l == NULL, "storage %llu: keys differ", id);
}

static void check_usage(uid_t uid) {
  cr_assert_eq(td__usage_of(&old.reg, uid), td__usage_of(&new.reg, uid),
               "uid %u: bytes", (unsigned)uid);
  cr_assert_eq(td__keys_of(&old.reg, uid), td__keys_of(&new.reg, uid),
               "uid %u: keys", (unsigned)uid);
}

Test(handover, rebuilds_the_state_it_describes) {
  build_old();
  new.reg.next_id = old.reg.next_id; /* Options' part: the server's */
  hand_over();

  cr_assert_eq(new.reg.storages.count, old.reg.storages.count);
  cr_assert_eq(new.reg.keys.count, old.reg.keys.count);
  cr_assert_eq(new.reg.scopes.count, old.reg.scopes.count);
  cr_assert_eq(new.reg.bytes_used, old.reg.bytes_used);
  cr_assert_eq(new.reg.bytes_committed, old.reg.bytes_committed);
  cr_assert_eq(new.reg.nholdings, old.reg.nholdings);
  const td__storage *s = old.reg.first, *t = new.reg.first;
  for (; s != NULL; s = s->next, t = t->next) {
    check_storage(s, t);
    cr_assert_eq(td__storage_find(&new.reg, s->id), t);
  }
  cr_assert_null(t);
  for (int i = 0; i < NCONNS; i++) {
    const conn *a = &old.conns[i], *b = &new.conns[i];
    cr_assert_eq(a->hold.nrefs, b->hold.nrefs, "connection %d: refs", i);
    cr_assert_eq(a->hold.refs.count, b->hold.refs.count);
    for (s = old.reg.first; s != NULL; s = s->next) {
      const td__ref *x = td__ref_find(&a->hold, s->id);
      const td__ref *y = td__ref_find(&b->hold, s->id);
      cr_assert_eq(x == NULL, y == NULL, "connection %d, storage %llu", i,
                   (unsigned long long)s->id);
      if (x != NULL)
        cr_assert(x->rw == y->rw && x->ro == y->ro);
    }
    /* Its scopes, in the same order, owned by the new connection. */
    cr_assert_eq(a->nscopes, b->nscopes, "connection %d: scopes", i);
    const td__scope *p = a->scopes, *q = b->scopes;
    for (; p != NULL && q != NULL; p = p->onext, q = q->onext) {
      cr_assert_eq(p->token, q->token, "connection %d: scopes out of order", i);
      cr_assert_eq(p->uid, q->uid);
      cr_assert_eq(p->nkeys, q->nkeys, "scope %llx: keys",
                   (unsigned long long)p->token);
      cr_assert_eq(q->owner, b);
      cr_assert_eq(td__scope_find(&new.reg, q->token), q);
    }
    cr_assert(p == NULL && q == NULL);
  }
  cr_assert_eq(new.pool.count, old.pool.count);
  cr_assert_eq(new.pool.bytes, old.pool.bytes);
  const td__pooled *e = old.pool.oldest, *f = new.pool.oldest;
  for (; e != NULL && f != NULL; e = e->next, f = f->next) {
    cr_assert_str_eq(e->name, f->name);
    cr_assert_eq(e->uid, f->uid);
    cr_assert_eq(e->device, f->device);
    cr_assert_eq(e->nbytes, f->nbytes);
    cr_assert_eq(e->since_ms, f->since_ms);
  }
  cr_assert(e == NULL && f == NULL);
  check_usage(1000);
  check_usage(1001);
  check_usage(0);
}

/* A key's event stays its publisher's across the upgrade, so the new
 * daemon drops it when that connection goes; an event whose publisher is
 * not handed over (the upgrade's asker) is not sent at all. */
Test(handover, an_event_goes_over_with_its_publishers_connection) {
  int64_t shape[1] = {4096};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape, &v), 0);
  td__storage *s = make(&old, &old.conns[0], &peers[0], TD_CUDA, 2 << 20);
  uint8_t ev[64];
  memset(ev, 0x5a, sizeof(ev));
  td__key_set_event(publish(&old, "ev/kept", s, &v, 1000, NULL),
                    &old.conns[1].hold, ev);
  td__key_set_event(publish(&old, "ev/ownerless", s, &v, 1000, NULL), NULL, ev);
  td__key_set_event(publish(&old, "ev/asker", s, &v, 1000, NULL),
                    &old.conns[2].hold, ev);
  old.conns[2].index = UINT32_MAX; /* holds nothing: not handed over */
  hand_over();
  td__key *k = td__key_find(&new.reg, "ev/kept", 7);
  cr_assert(k != NULL && k->has_event);
  cr_assert_eq(k->evby, &new.conns[1].hold);
  cr_assert_eq(memcmp(k->event, ev, sizeof(ev)), 0);
  k = td__key_find(&new.reg, "ev/ownerless", 12);
  cr_assert(k != NULL && k->has_event && k->evby == NULL);
  k = td__key_find(&new.reg, "ev/asker", 8);
  cr_assert(k != NULL && !k->has_event, "its publisher stays behind");
  cr_assert_eq(td__holdings_drop_events(&new.conns[1].hold), 1);
  cr_assert_not(td__key_find(&new.reg, "ev/kept", 7)->has_event);
}

Test(handover, an_empty_engine_hands_over_nothing) {
  hand_over();
  cr_assert_eq(new.reg.storages.count, 0);
  cr_assert_eq(new.reg.keys.count, 0);
  cr_assert_eq(new.pool.count, 0);
}

/* A key naming a storage that was not sent is refused, and takes nothing
 * with it. */
Test(handover, refuses_a_key_on_an_unknown_storage) {
  build_old();
  hand_over();
  uint64_t keys = new.reg.keys.count, refs = new.reg.first->refs;
  Tensord__View vm = TENSORD__VIEW__INIT;
  td__view_to_msg(&new.reg.first->keys->view, &vm);
  Tensord__Handover__Key k = TENSORD__HANDOVER__KEY__INIT;
  Tensord__Handover__Key *kp = &k;
  k.name.data = (uint8_t *)"stray";
  k.name.len = 5;
  k.storage = 999;
  k.view = &vm;
  Tensord__Handover__Keys b = TENSORD__HANDOVER__KEYS__INIT;
  b.n_keys = 1;
  b.keys = &kp;
  char msg[512];
  cr_assert_eq(take(TENSORD__HANDOVER__PACKET__BODY_KEYS, &b, msg, sizeof(msg)),
               TD_EPROTO);
  cr_assert_str_eq(msg, "key 0 of a batch: bad storage or view");
  cr_assert_eq(new.reg.keys.count, keys);
  cr_assert_null(td__key_find(&new.reg, "stray", 5));
  cr_assert_eq(new.reg.first->refs, refs);
}

/* A scope whose token is taken already is refused, and the connection's
 * list stays as it was. */
Test(handover, refuses_a_scope_sent_twice) {
  build_old();
  hand_over();
  Tensord__Handover__ScopeEntry e = TENSORD__HANDOVER__SCOPE_ENTRY__INIT;
  Tensord__Handover__ScopeEntry *ep = &e;
  e.token = 0x2222;
  e.uid = 1001;
  e.conn = 2;
  Tensord__Handover__Scopes b = TENSORD__HANDOVER__SCOPES__INIT;
  b.n_scopes = 1;
  b.scopes = &ep;
  char msg[512];
  cr_assert_eq(
      take(TENSORD__HANDOVER__PACKET__BODY_SCOPES, &b, msg, sizeof(msg)),
      TD_EEXIST);
  cr_assert_not_null(strstr(msg, "scope 0000000000002222: "), "%s", msg);
  cr_assert_eq(new.reg.scopes.count, old.reg.scopes.count);
  cr_assert_null(new.conns[2].scopes);
  cr_assert_eq(new.conns[2].nscopes, 0);
}

/* A holder that names a connection not handed over is refused with the
 * numbers involved. */
Test(handover, refuses_a_holder_of_an_unknown_connection) {
  Tensord__Handover__Holder h = TENSORD__HANDOVER__HOLDER__INIT;
  Tensord__Handover__Holder *hp = &h;
  h.conn = 7;
  h.rw = 1;
  Tensord__Handover__Storage s = TENSORD__HANDOVER__STORAGE__INIT;
  Tensord__Handover__Storage *sp = &s;
  s.id = 5;
  s.nbytes = 4096;
  s.name = "/tensord.test.5-fake";
  s.n_holders = 1;
  s.holders = &hp;
  Tensord__Handover__Storages b = TENSORD__HANDOVER__STORAGES__INIT;
  b.n_storages = 1;
  b.storages = &sp;
  char msg[512];
  cr_assert_eq(
      take(TENSORD__HANDOVER__PACKET__BODY_STORAGES, &b, msg, sizeof(msg)),
      TD_EPROTO);
  cr_assert_str_eq(msg, "storage 5: held by connection 7 of 3");
  for (int i = 0; i < NCONNS; i++)
    cr_assert_eq(new.conns[i].hold.nrefs, 0);
  /* The storage itself stays, unreferenced (the new daemon gives up and
   * exits): unregister it here. */
  td__storage *t = td__storage_find(&new.reg, 5);
  cr_assert_not_null(t);
  td__storage_remove(&new.reg, t);
  td__credit(&new.reg, t->owner.uid, td__host_bytes(t));
  free(t);
}

Test(handover, refuses_a_packet_that_is_not_the_engines) {
  Tensord__Handover__End e = TENSORD__HANDOVER__END__INIT;
  char msg[512];
  cr_assert_eq(take(TENSORD__HANDOVER__PACKET__BODY_END, &e, msg, sizeof(msg)),
               TD_EPROTO);
  cr_assert_str_eq(msg, "unexpected packet type 12");
}

/* ---- channels ---- */

/* An end of ch for connection c of d, linked as chanops.c links one. */
static td__chan_end *open_end(side *d, td__chan *ch, int c, unsigned flags) {
  conn *o = &d->conns[c];
  td__chan_end *e = NULL;
  cr_assert_eq(td__chan_end_add(ch, o, &o->hold, flags, &e), 0);
  e->cprev = NULL;
  e->cnext = o->chan_ends;
  if (o->chan_ends != NULL)
    o->chan_ends->cprev = e;
  o->chan_ends = e;
  o->nchan_ends++;
  return e;
}

/* Its connection went, as td__chans_conn_gone sees it, before a repair. */
static void end_dies(side *d, td__chan_end *e) {
  conn *o = e->conn;
  if (e->cprev != NULL)
    e->cprev->cnext = e->cnext;
  else
    o->chan_ends = e->cnext;
  if (e->cnext != NULL)
    e->cnext->cprev = e->cprev;
  o->nchan_ends--;
  cr_assert_eq(td__chan_end_remove(e, 1), 0);
  (void)d;
}

static td__chan *new_chan(side *d, const char *name, uint32_t capacity,
                          uint32_t nslots, uint64_t slot_bytes) {
  td__chan *ch = NULL;
  char msg[256];
  cr_assert_eq(td__chan_new(&d->chans, name, strlen(name), capacity, nslots,
                            slot_bytes, 0640, &peers[0], 1700000003000, &ch,
                            msg, sizeof(msg)),
               0, "%s", msg);
  ch->owner.pid = peers[0].pid;
  return ch;
}

static td__chan *chan_of_id(side *d, uint64_t id) {
  td__chan *ch = td__chan_by_id(&d->chans, id);
  cr_assert_not_null(ch, "channel %llu", (unsigned long long)id);
  return ch;
}

/* The old daemon's channels: one that came and went (ids go on after it);
 * "work" with 3 slots (one also held by its creator), a receiver, a sender
 * that put two storages, one of each mode, not yet taken, an end that left,
 * and a dead end with a slot on loan, awaiting its repair; "broken", slotless
 * and found corrupt. The ring holds a slot sent and not received. */
static void build_chans(void) {
  td__chan *gone = new_chan(&old, "gone", 4, 0, 0);
  td__chan_free(&old.chans, &old.reg, gone);

  td__chan *w = new_chan(&old, "work", 8, 3, 4096);
  td__storage *slot[3];
  for (uint32_t i = 0; i < 3; i++) {
    slot[i] = make(&old, &old.conns[0], &peers[0], TD_CPU, 4096);
    cr_assert_eq(td__chan_add_slot(&old.reg, w, i, slot[i]), 0);
  }
  cr_assert_eq(td__ref_drop(&old.reg, &old.conns[0].hold, slot[0]->id, 0, 1),
               0);
  cr_assert_eq(td__ref_drop(&old.reg, &old.conns[0].hold, slot[2]->id, 0, 1),
               0);
  td__chan_end *recv = open_end(&old, w, 0, TD_CHAN_RECV);
  td__chan_end *send = open_end(&old, w, 1, TD_CHAN_SEND);
  td__chan_end *left = open_end(&old, w, 2, TD_CHAN_SEND | TD_CHAN_RECV);
  td__chan_end *dead = open_end(&old, w, 2, TD_CHAN_SEND);
  td__chan_end_leave(left);
  (void)recv;

  td__storage *a = make(&old, &old.conns[1], &peers[1], TD_CPU, 8192);
  td__storage *b = make(&old, &old.conns[1], &peers[1], TD_CPU, 16384);
  uint64_t t;
  cr_assert_eq(td__chan_put(&old.reg, w, send->id, a, 0, &t), 0);
  cr_assert_eq(td__chan_put(&old.reg, w, send->id, b, 1, &t), 0);
  cr_assert_eq(td__chan_put(&old.reg, w, send->id, b, 1, &t), 0);
  td__chan_ticket_done(&old.reg, w, td__chan_ticket(w, t)); /* taken */

  char msg[256];
  uint32_t s1, s2;
  cr_assert_eq(td__ring_loan(&w->ring, send->id, -1, 0, &s1, msg, sizeof(msg)),
               0, "%s", msg);
  td__ring_entry e = {.kind = TD__CELL_SLOT, .slot = s1};
  int64_t shape[1] = {4096};
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape, &e.view), 0);
  cr_assert_eq(td__ring_push(&w->ring, send->id, &e, -1, 0, msg, sizeof(msg)),
               0, "%s", msg);
  cr_assert_eq(td__ring_loan(&w->ring, dead->id, -1, 0, &s2, msg, sizeof(msg)),
               0, "%s", msg);
  end_dies(&old, dead);

  td__chan *x = new_chan(&old, "broken", 4, 0, 0);
  open_end(&old, x, 2, TD_CHAN_RECV);
  td__chan_set_corrupt(x, "test: garbage in its ring");
}

static void check_chan(const td__chan *a) {
  td__chan *b = chan_of_id(&new, a->id);
  cr_assert_eq(td__chan_find(&new.chans, a->name, a->len), b);
  cr_assert_str_eq(b->name, a->name);
  cr_assert_str_eq(b->hold.name, a->hold.name);
  cr_assert_eq(b->capacity, a->capacity, "%s: capacity", a->name);
  cr_assert_eq(b->nslots, a->nslots);
  cr_assert_eq(b->slot_bytes, a->slot_bytes);
  for (uint32_t i = 0; i < a->nslots; i++)
    cr_assert_eq(b->slot_ids[i], a->slot_ids[i], "%s: slot %u", a->name, i);
  cr_assert_eq(b->mode, a->mode);
  cr_assert(b->owner.pid == a->owner.pid && b->owner.uid == a->owner.uid &&
            b->owner.gid == a->owner.gid);
  cr_assert_eq(b->created_ms, a->created_ms);
  cr_assert_eq(b->next_end, a->next_end, "%s: next end", a->name);
  cr_assert_eq(b->next_ticket, a->next_ticket);
  cr_assert_eq(b->had_senders, a->had_senders);
  cr_assert_eq(b->had_receivers, a->had_receivers);
  cr_assert_eq(b->senders, a->senders, "%s: senders", a->name);
  cr_assert_eq(b->receivers, a->receivers);
  cr_assert_eq(b->nends, a->nends);
  cr_assert_eq(b->corrupt, a->corrupt);
  cr_assert_str_eq(b->why, a->why);
  cr_assert_eq(b->repair_due, a->repair_due);
  /* Ends in the same order, each of the same connection (on the new side). */
  const td__chan_end *x = a->ends, *y = b->ends;
  for (; x != NULL && y != NULL; x = x->next, y = y->next) {
    cr_assert_eq(x->id, y->id, "%s: ends out of order", a->name);
    cr_assert_eq(x->flags, y->flags);
    cr_assert_eq(x->left, y->left, "%s: end %u: left", a->name, x->id);
    cr_assert_eq(x->dead, y->dead);
    cr_assert_eq(y->chan, b);
    if (x->dead) {
      cr_assert_null(y->conn);
      continue;
    }
    uint32_t i = ((const conn *)x->conn)->index;
    cr_assert_eq(y->conn, &new.conns[i], "%s: end %u", a->name, x->id);
    cr_assert_eq(y->hold, &new.conns[i].hold);
    int linked = 0;
    for (const td__chan_end *z = new.conns[i].chan_ends; z; z = z->cnext)
      linked += z == y;
    cr_assert_eq(linked, 1, "%s: end %u not in its connection's list", a->name,
                 x->id);
  }
  cr_assert(x == NULL && y == NULL, "%s: ends differ", a->name);
  /* Tickets, and the references they and the slots are. */
  cr_assert_eq(b->ntickets, a->ntickets);
  for (size_t i = 0; i < a->tickets.nbuckets; i++)
    for (td__hnode *n = a->tickets.buckets[i]; n; n = n->next) {
      const td__ticket *t = td__container_of(n, td__ticket, node);
      const td__ticket *u = td__chan_ticket(b, t->ticket);
      cr_assert_not_null(u, "%s: ticket %llu", a->name,
                         (unsigned long long)t->ticket);
      cr_assert(u->id == t->id && u->ro == t->ro && u->end == t->end);
    }
  cr_assert_eq(b->hold.nrefs, a->hold.nrefs, "%s: references", a->name);
  cr_assert_eq(b->hold.refs.count, a->hold.refs.count);
  /* The same ring: the same counts, and what one side writes the other
   * reads. */
  cr_assert_eq(b->ring.size, a->ring.size);
  td__ring_counts ca, cb;
  td__ring_count(&a->ring, &ca);
  td__ring_count(&b->ring, &cb);
  cr_assert_eq(memcmp(&ca, &cb, sizeof(ca)), 0, "%s: ring counts", a->name);
  atomic_fetch_add(&a->ring.hdr->hint, 7);
  cr_assert_eq(atomic_load(&b->ring.hdr->hint),
               atomic_load(&a->ring.hdr->hint));
}

Test(handover, rebuilds_channels_with_their_ends_tickets_and_ring) {
  build_old();
  build_chans();
  new.reg.next_id = old.reg.next_id;
  hand_over();
  cr_assert_eq(new.chans.n, old.chans.n);
  cr_assert_eq(new.chans.next_id, old.chans.next_id,
               "a new channel would take an id already given");
  for (size_t i = 0; i < old.chans.by_id.nbuckets; i++)
    for (td__hnode *n = old.chans.by_id.buckets[i]; n; n = n->next)
      check_chan(td__container_of(n, td__chan, inode));
  for (int i = 0; i < NCONNS; i++)
    cr_assert_eq(new.conns[i].nchan_ends, old.conns[i].nchan_ends,
                 "connection %d: channel ends", i);
  /* Storages, with the channels among their holders, in order. */
  const td__storage *s = old.reg.first, *t = new.reg.first;
  for (; s != NULL; s = s->next, t = t->next)
    check_storage(s, t);
  cr_assert_null(t);
  cr_assert_eq(new.reg.nholdings, old.reg.nholdings);
  check_usage(1000);
  check_usage(1001);

  /* The dead end's repair runs on the new side: its loan comes back. */
  td__chan *w = td__chan_find(&new.chans, "work", 4);
  td__ring_counts rc;
  td__ring_count(&w->ring, &rc);
  cr_assert_eq(rc.loaned, 1);
  cr_assert_eq(td__chan_repair(w), 1);
  td__ring_count(&w->ring, &rc);
  cr_assert_eq(rc.loaned, 0);
  cr_assert_eq(rc.queued, 1);
  for (const td__chan_end *x = w->ends; x != NULL; x = x->next)
    cr_assert(!x->dead, "end %u is still kept after the repair", x->id);
  /* The new side's ids go on from the old side's. */
  td__chan *c = new_chan(&new, "next", 4, 0, 0);
  cr_assert_eq(c->id, old.chans.next_id);
  td__chan_end *e = NULL;
  cr_assert_eq(td__chan_end_add(w, NULL, &new.conns[0].hold, TD_CHAN_RECV, &e),
               0);
  cr_assert_eq(e->id, td__chan_find(&old.chans, "work", 4)->next_end);
  cr_assert_eq(td__chan_end_remove(e, 0), 0);
}

/* A ring that is not what the channel says (another size, not sealed) is
 * refused, and no channel is left behind. */
Test(handover, refuses_a_ring_that_does_not_fit_its_channel) {
  build_chans();
  td__handover h;
  cr_assert_eq(td__handover_save(&old.reg, &old.pool, &old.chans, old.hc,
                                 NCONNS, number, &h),
               0);
  int fd = memfd_create("not-a-ring", MFD_CLOEXEC);
  cr_assert_geq(fd, 0);
  cr_assert_eq(ftruncate(fd, 4096), 0);
  char msg[512];
  cr_assert_eq(take_chan(h.chans[0], fd, msg, sizeof(msg)), TD_EPROTO);
  cr_assert_not_null(strstr(msg, "not of that size, or not sealed"), "%s", msg);
  cr_assert_eq(take_chan(h.chans[0], -1, msg, sizeof(msg)), TD_EPROTO);
  cr_assert_not_null(strstr(msg, "in no fd"), "%s", msg);
  cr_assert_eq(new.chans.n, 0);
  close(fd);
  /* The right ring, twice: the second is refused. */
  cr_assert_eq(take_chan(h.chans[0], h.chan_fds[0], msg, sizeof(msg)), 0, "%s",
               msg);
  cr_assert_eq(take_chan(h.chans[0], h.chan_fds[0], msg, sizeof(msg)),
               TD_EEXIST);
  cr_assert_eq(new.chans.n, 1);
  /* Alone, without its ends and references, it does not pass the check. */
  cr_assert_eq(td__handover_check(&new.chans, msg, sizeof(msg)), TD_EPROTO);
  cr_assert_not_null(strstr(msg, "came with no open end"), "%s", msg);
  td__handover_free(&h);
}

Test(handover, refuses_a_holder_of_an_unknown_channel) {
  Tensord__Handover__Holder hd = TENSORD__HANDOVER__HOLDER__INIT;
  Tensord__Handover__Holder *hp = &hd;
  hd.chan = 9;
  hd.rw = 1;
  Tensord__Handover__Storage s = TENSORD__HANDOVER__STORAGE__INIT;
  Tensord__Handover__Storage *sp = &s;
  s.id = 5;
  s.nbytes = 4096;
  s.name = "/tensord.test.5-fake";
  s.n_holders = 1;
  s.holders = &hp;
  Tensord__Handover__Storages b = TENSORD__HANDOVER__STORAGES__INIT;
  b.n_storages = 1;
  b.storages = &sp;
  char msg[512];
  cr_assert_eq(
      take(TENSORD__HANDOVER__PACKET__BODY_STORAGES, &b, msg, sizeof(msg)),
      TD_EPROTO);
  cr_assert_str_eq(msg, "storage 5: held by channel 9, which was not sent");
  td__storage *t = td__storage_find(&new.reg, 5);
  cr_assert_not_null(t);
  td__storage_remove(&new.reg, t);
  td__credit(&new.reg, t->owner.uid, td__host_bytes(t));
  free(t);
}

/* A channel holding a reference that neither a slot nor a ticket is fails
 * the check, naming the storage: it would never be dropped. */
Test(handover, check_finds_a_reference_no_slot_or_ticket_calls_for) {
  build_chans();
  hand_over();
  td__chan *w = td__chan_find(&new.chans, "work", 4);
  uint64_t id = w->slot_ids[1];
  td__storage *s = td__storage_find(&new.reg, id);
  cr_assert_eq(td__ref_add(&new.reg, &w->hold, s, 1, NULL), 0);
  char msg[512], want[128];
  cr_assert_eq(td__handover_check(&new.chans, msg, sizeof(msg)), TD_EPROTO);
  snprintf(want, sizeof(want),
           "storage %llu: its slots and tickets call for 1 read-write and 0 "
           "read-only reference(s), it holds 1 and 1",
           (unsigned long long)id);
  cr_assert_not_null(strstr(msg, want), "%s", msg);
  cr_assert_eq(td__ref_drop(&new.reg, &w->hold, id, 1, 1), 0);
  cr_assert_eq(td__handover_check(&new.chans, msg, sizeof(msg)), 0, "%s", msg);
}

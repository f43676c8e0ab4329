/* handover.c: the engine's state as the messages of a live upgrade, and
 * back (handover.h). */
#include "handover.h"

#include "common.h"
#include "list.h"
#include "viewmsg.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A channel's holdings, to tell them from a connection's among a
 * storage's holders. */
typedef struct chanhold {
  uintptr_t h;
  uint64_t id;
} chanhold;

static int chanhold_cmp(const void *a, const void *b) {
  uintptr_t x = ((const chanhold *)a)->h, y = ((const chanhold *)b)->h;
  return x < y ? -1 : x > y;
}

/* The id of the channel whose holdings h are (in the n of sorted), or 0. */
static uint64_t chan_of(const chanhold *sorted, size_t n,
                        const td__holdings *h) {
  chanhold k = {(uintptr_t)h, 0};
  const chanhold *f =
      n ? bsearch(&k, sorted, n, sizeof(k), chanhold_cmp) : NULL;
  return f ? f->id : 0;
}

#define EACH_CHAN(cs, ch)                                                      \
  for (size_t b_ = 0; (cs) != NULL && b_ < (cs)->by_id.nbuckets; b_++)         \
    for (td__hnode *n_ = (cs)->by_id.buckets[b_];                              \
         n_ != NULL && ((ch) = td__container_of(n_, td__chan, inode), 1);      \
         n_ = n_->next)

/* Describes the channels of cs in h (chan_mem), and points *held at their
 * holdings, sorted (in chan_mem too). Returns 0 or TD_ENOMEM. */
static int save_chans(const td__chans *cs,
                      uint32_t (*number)(const td__holdings *), td__handover *h,
                      chanhold **held) {
  size_t nc = cs ? cs->n : 0, ne = 0, nt = 0, i = 0;
  td__chan *ch;
  *held = NULL;
  EACH_CHAN(cs, ch) {
    for (const td__chan_end *e = ch->ends; e != NULL; e = e->next)
      ne++;
    nt += ch->ntickets;
  }
  void *mem = h->chan_mem =
      malloc(1 +
             nc * (sizeof(void *) + sizeof(Tensord__Handover__Channel) +
                   sizeof(int) + sizeof(chanhold)) +
             ne * (sizeof(void *) + sizeof(Tensord__Handover__ChanEnd)) +
             nt * (sizeof(void *) + sizeof(Tensord__Handover__ChanTicket)));
  if (mem == NULL)
    return TD_ENOMEM;
  /* Pointers first, then the messages (pointer-aligned), ints last. */
  Tensord__Handover__Channel **cp = mem;
  Tensord__Handover__Channel *ce = (void *)(cp + nc);
  Tensord__Handover__ChanEnd **ep = (void *)(ce + nc), *ee = (void *)(ep + ne);
  Tensord__Handover__ChanTicket **tp = (void *)(ee + ne);
  Tensord__Handover__ChanTicket *te = (void *)(tp + nt);
  chanhold *hs = (void *)(te + nt);
  int *fds = (void *)(hs + nc);
  h->chans = cp;
  h->chan_fds = fds;
  h->ends.ends = ep;
  h->tickets.tickets = tp;
  ne = nt = 0;
  EACH_CHAN(cs, ch) {
    Tensord__Handover__Channel *m = cp[i] = &ce[i];
    tensord__handover__channel__init(m);
    m->id = ch->id;
    m->name.data = (uint8_t *)ch->name;
    m->name.len = ch->len;
    m->capacity = ch->capacity;
    m->slot_bytes = ch->slot_bytes;
    m->n_slot_ids = ch->nslots;
    m->slot_ids = ch->slot_ids;
    m->mode = ch->mode;
    m->owner_pid = ch->owner.pid;
    m->owner_uid = ch->owner.uid;
    m->owner_gid = ch->owner.gid;
    m->created_ms = ch->created_ms;
    m->next_end = ch->next_end;
    m->next_ticket = ch->next_ticket;
    m->had_senders = ch->had_senders;
    m->had_receivers = ch->had_receivers;
    m->corrupt = ch->corrupt;
    m->why = ch->why;
    m->repair_due = ch->repair_due;
    fds[i] = ch->fd;
    hs[i] = (chanhold){(uintptr_t)&ch->hold, ch->id};
    /* Its ends last first: the new side prepends. */
    const td__chan_end *e = ch->ends;
    while (e != NULL && e->next != NULL)
      e = e->next;
    for (; e != NULL; e = e->prev, ne++) {
      Tensord__Handover__ChanEnd *x = ep[ne] = &ee[ne];
      tensord__handover__chan_end__init(x);
      x->chan = ch->id;
      x->id = e->id;
      x->flags = e->flags;
      x->left = e->left;
      x->dead = e->dead;
      x->conn = e->dead ? UINT32_MAX : number(e->hold);
    }
    for (size_t b = 0; b < ch->tickets.nbuckets; b++)
      for (const td__hnode *hn = ch->tickets.buckets[b]; hn; hn = hn->next) {
        const td__ticket *t = td__container_of(hn, td__ticket, node);
        Tensord__Handover__ChanTicket *x = tp[nt] = &te[nt];
        tensord__handover__chan_ticket__init(x);
        x->chan = ch->id;
        x->ticket = t->ticket;
        x->storage = t->id;
        x->ro = t->ro;
        x->end = t->end;
        nt++;
      }
    i++;
  }
  h->nchans = i;
  h->ends.n_ends = ne;
  h->tickets.n_tickets = nt;
  qsort(hs, i, sizeof(*hs), chanhold_cmp);
  *held = hs;
  return 0;
}

int td__handover_save(const td__registry *r, const td__pool *p,
                      const td__chans *cs, const td__handover_conn *conns,
                      size_t n, uint32_t (*number)(const td__holdings *h),
                      td__handover *h) {
  *h = (td__handover){TENSORD__HANDOVER__STORAGES__INIT,
                      TENSORD__HANDOVER__POOL__INIT,
                      TENSORD__HANDOVER__SCOPES__INIT,
                      TENSORD__HANDOVER__KEYS__INIT,
                      NULL,
                      NULL,
                      0,
                      TENSORD__HANDOVER__CHAN_ENDS__INIT,
                      TENSORD__HANDOVER__CHAN_TICKETS__INIT,
                      NULL,
                      NULL};
  chanhold *held;
  if (save_chans(cs, number, h, &held) < 0)
    return TD_ENOMEM;
  size_t ns = r->storages.count, nh = 0, np = p->count;
  size_t nc = r->scopes.count, nk = r->keys.count, i;
  for (const td__storage *s = r->first; s != NULL; s = s->next)
    for (const td__ref *ref = s->holders; ref != NULL; ref = ref->snext)
      nh++;
  /* One block, 1 byte more so that only no memory gives NULL: each list's
   * pointers, then its messages (pointer-aligned), the keys' views last. */
  Tensord__Handover__Storage **sp = h->mem =
      malloc(1 + ns * (sizeof(void *) + sizeof(Tensord__Handover__Storage)) +
             nh * (sizeof(void *) + sizeof(Tensord__Handover__Holder)) +
             np * (sizeof(void *) + sizeof(Tensord__Handover__Pooled)) +
             nc * (sizeof(void *) + sizeof(Tensord__Handover__ScopeEntry)) +
             nk * (sizeof(void *) + sizeof(Tensord__Handover__Key) +
                   sizeof(Tensord__View)));
  if (sp == NULL) {
    td__handover_free(h);
    return TD_ENOMEM;
  }
  Tensord__Handover__Storage *se = (void *)(sp + ns);
  Tensord__Handover__Holder **hp = (void *)(se + ns), *he = (void *)(hp + nh);
  Tensord__Handover__Pooled **pp = (void *)(he + nh), *pe = (void *)(pp + np);
  Tensord__Handover__ScopeEntry **cp = (void *)(pe + np);
  Tensord__Handover__ScopeEntry *ce = (void *)(cp + nc);
  Tensord__Handover__Key **kp = (void *)(ce + nc), *ke = (void *)(kp + nk);
  Tensord__View *ve = (void *)(ke + nk);

  h->storages.storages = sp;
  nh = i = 0;
  for (const td__storage *s = r->first; s != NULL; s = s->next, i++) {
    Tensord__Handover__Storage *e = sp[i] = &se[i];
    tensord__handover__storage__init(e);
    e->id = s->id;
    e->nbytes = s->nbytes;
    e->device = (Tensord__Device)s->device;
    e->refs = s->refs;
    e->mode = s->mode;
    e->foreign = s->foreign;
    e->named = s->named;
    e->owner_pid = s->owner.pid;
    e->owner_uid = s->owner.uid;
    e->owner_gid = s->owner.gid;
    e->created_ms = s->created_ms;
    e->name = (char *)s->name;
    /* Holders last first: the new side prepends, as td__ref_add does. */
    const td__ref *ref = s->holders;
    while (ref != NULL && ref->snext != NULL)
      ref = ref->snext;
    e->holders = hp + nh;
    for (; ref != NULL; ref = ref->sprev, nh++, e->n_holders++) {
      Tensord__Handover__Holder *m = hp[nh] = &he[nh];
      tensord__handover__holder__init(m);
      const td__holdings *hd = td__ref_holdings(ref);
      m->chan = chan_of(held, h->nchans, hd);
      m->conn = m->chan ? 0 : number(hd);
      m->rw = ref->rw;
      m->ro = ref->ro;
    }
  }
  h->storages.n_storages = i;

  h->pool.pooled = pp;
  i = 0;
  for (const td__pooled *x = p->oldest; x != NULL; x = x->next, i++) {
    pp[i] = &pe[i];
    tensord__handover__pooled__init(pp[i]);
    pp[i]->name = (char *)x->name;
    pp[i]->uid = x->uid;
    pp[i]->nbytes = x->nbytes;
    pp[i]->since_ms = x->since_ms;
  }
  h->pool.n_pooled = i;

  /* The last connection first (the order its server lists them in), each
   * one's scopes last first: the new side prepends. */
  h->scopes.scopes = cp;
  i = 0;
  for (size_t c = n; c-- > 0;) {
    const td__scope *sc = *conns[c].scopes;
    while (sc != NULL && sc->onext != NULL)
      sc = sc->onext;
    for (; sc != NULL && i < nc; sc = sc->oprev, i++) {
      cp[i] = &ce[i];
      tensord__handover__scope_entry__init(cp[i]);
      cp[i]->token = sc->token;
      cp[i]->uid = sc->uid;
      cp[i]->conn = (uint32_t)c;
    }
  }
  h->scopes.n_scopes = i;

  /* Each storage's keys last first: the new side prepends. */
  h->keys.keys = kp;
  i = 0;
  for (const td__storage *s = r->first; s != NULL; s = s->next) {
    const td__key *k = s->keys;
    while (k != NULL && k->snext != NULL)
      k = k->snext;
    for (; k != NULL && i < nk; k = k->sprev, i++) {
      Tensord__Handover__Key *e = kp[i] = &ke[i];
      tensord__handover__key__init(e);
      e->name.data = (uint8_t *)k->name;
      e->name.len = k->len;
      e->storage = s->id;
      td__view_to_msg(&k->view, &ve[i]);
      e->view = &ve[i];
      e->uid = k->uid;
      e->published_ms = k->published_ms;
      e->scope = k->scope ? k->scope->token : 0;
      /* The event goes with its publisher's connection: sent with its
       * number, or not at all if that connection is not handed over. */
      uint32_t by = k->evby != NULL ? number(k->evby) : UINT32_MAX;
      if (k->has_event && (k->evby == NULL || by != UINT32_MAX)) {
        e->event.data = (uint8_t *)k->event;
        e->event.len = sizeof(k->event);
        e->event_conn = k->evby != NULL ? by + 1 : 0;
      }
    }
  }
  h->keys.n_keys = i;
  return 0;
}

void td__handover_free(td__handover *h) {
  free(h->mem);
  free(h->chan_mem);
  h->mem = h->chan_mem = NULL;
}

static int take_storages(td__registry *r, td__chans *cs,
                         const td__handover_conn *conns, size_t n,
                         const Tensord__Handover__Storages *b, char *msg,
                         size_t len) {
  for (size_t i = 0; i < b->n_storages; i++) {
    const Tensord__Handover__Storage *m = b->storages[i];
    td__storage *s = calloc(1, sizeof(*s));
    if (s == NULL)
      return td__msg(msg, len, TD_ENOMEM, "out of memory");
    s->id = m->id;
    s->nbytes = m->nbytes;
    s->device = (td_device)m->device;
    s->mode = m->mode;
    s->foreign = m->foreign;
    s->named = m->named;
    s->owner.pid = m->owner_pid;
    s->owner.uid = m->owner_uid;
    s->owner.gid = m->owner_gid;
    s->created_ms = m->created_ms;
    snprintf(s->name, sizeof(s->name), "%s", m->name);
    td__charge(r, s->owner.uid, td__host_bytes(s), 1, NULL, 0);
    if (td__storage_insert(r, s, NULL) < 0) {
      td__credit(r, s->owner.uid, td__host_bytes(s));
      free(s);
      return td__msg(msg, len, TD_ENOMEM, "out of memory");
    }
    for (size_t j = 0; j < m->n_holders; j++) {
      const Tensord__Handover__Holder *h = m->holders[j];
      td__chan *ch = h->chan ? td__chan_by_id(cs, h->chan) : NULL;
      if (h->chan != 0 && ch == NULL)
        return td__msg(msg, len, TD_EPROTO,
                       "storage %llu: held by channel %llu, which was not "
                       "sent",
                       (unsigned long long)m->id, (unsigned long long)h->chan);
      if (ch == NULL && h->conn >= n)
        return td__msg(msg, len, TD_EPROTO,
                       "storage %llu: held by connection %u of %zu",
                       (unsigned long long)m->id, h->conn, n);
      int err = td__ref_restore(r, ch ? &ch->hold : conns[h->conn].hold, s,
                                h->rw, h->ro);
      if (err < 0)
        return td__msg(msg, len, err, "storage %llu: restoring references: %s",
                       (unsigned long long)m->id, td_strerror(err));
    }
  }
  return 0;
}

static int take_pool(td__pool *p, const Tensord__Handover__Pool *b, char *msg,
                     size_t len) {
  for (size_t i = 0; i < b->n_pooled; i++) {
    td__pooled *e = calloc(1, sizeof(*e));
    if (e == NULL)
      return td__msg(msg, len, TD_ENOMEM, "out of memory");
    snprintf(e->name, sizeof(e->name), "%s", b->pooled[i]->name);
    e->uid = b->pooled[i]->uid;
    e->device = TD_CPU;
    e->nbytes = b->pooled[i]->nbytes;
    e->since_ms = b->pooled[i]->since_ms;
    td__pool_put(p, e);
  }
  return 0;
}

static int take_scopes(td__registry *r, const td__handover_conn *conns,
                       size_t n, const Tensord__Handover__Scopes *b, char *msg,
                       size_t len) {
  for (size_t i = 0; i < b->n_scopes; i++) {
    const Tensord__Handover__ScopeEntry *m = b->scopes[i];
    if (m->conn >= n)
      return td__msg(msg, len, TD_EPROTO, "scope of connection %u of %zu",
                     m->conn, n);
    const td__handover_conn *c = &conns[m->conn];
    td__scope *sc = NULL;
    int err = td__scope_open(r, m->token, m->uid, c->owner, &sc);
    if (err < 0)
      return td__msg(msg, len, err, "scope %016llx: %s",
                     (unsigned long long)m->token, td_strerror(err));
    sc->onext = *c->scopes;
    if (*c->scopes != NULL)
      (*c->scopes)->oprev = sc;
    *c->scopes = sc;
    (*c->nscopes)++;
  }
  return 0;
}

static int take_keys(td__registry *r, const td__handover_conn *conns, size_t n,
                     const Tensord__Handover__Keys *b, char *msg, size_t len) {
  for (size_t i = 0; i < b->n_keys; i++) {
    const Tensord__Handover__Key *m = b->keys[i];
    td__storage *s = td__storage_find(r, m->storage);
    td_view v;
    char why[256];
    if (s == NULL || m->view == NULL || m->name.len == 0 ||
        m->name.len > TD_KEY_MAX ||
        td__view_from_msg(m->view, &v, why, sizeof(why)) < 0)
      return td__msg(msg, len, TD_EPROTO,
                     "key %zu of a batch: bad storage or view", i);
    td__scope *sc = NULL;
    if (m->scope != 0 && (sc = td__scope_find(r, m->scope)) == NULL)
      return td__msg(msg, len, TD_EPROTO,
                     "key in scope %016llx, which was not sent",
                     (unsigned long long)m->scope);
    if (m->event_conn > n)
      return td__msg(msg, len, TD_EPROTO, "key's event of connection %u of %zu",
                     m->event_conn - 1, n);
    td__key_prep p;
    int err = td__key_prepare(r, (const char *)m->name.data, m->name.len, s,
                              m->uid, &p);
    if (err < 0)
      return td__msg(msg, len, err, "key: %s", td_strerror(err));
    p.scope = sc;
    td__key *k = td__key_commit(r, &p, &v);
    k->published_ms = m->published_ms;
    if (m->event.len == sizeof(k->event))
      td__key_set_event(k, m->event_conn ? conns[m->event_conn - 1].hold : NULL,
                        m->event.data);
  }
  return 0;
}

int td__handover_take_chan(td__chans *cs, const Tensord__Handover__Channel *m,
                           int fd, char *msg, size_t len) {
  char why[256];
  if (m->name.len == 0 || m->name.len > TD_KEY_MAX ||
      memchr(m->name.data, '\0', m->name.len) != NULL ||
      m->n_slot_ids > TD_CHAN_SLOTS_MAX || (m->mode & ~0666u) != 0 ||
      m->next_end == 0 || m->next_end > TD__END_MAX + 1 ||
      m->next_ticket == 0) {
    if (fd >= 0)
      close(fd);
    return td__msg(msg, len, TD_EPROTO,
                   "channel %llu: bad name, slots, mode or counters",
                   (unsigned long long)m->id);
  }
  td__peer owner = {m->owner_pid, m->owner_uid, m->owner_gid};
  td__chan *ch;
  int err = td__chan_restore(cs, (const char *)m->name.data, m->name.len, m->id,
                             m->capacity, (uint32_t)m->n_slot_ids,
                             m->slot_bytes, m->mode, &owner, m->created_ms, fd,
                             &ch, why, sizeof(why));
  if (err < 0)
    return td__msg(msg, len, err, "%s", why);
  for (size_t i = 0; i < m->n_slot_ids; i++)
    ch->slot_ids[i] = m->slot_ids[i];
  ch->next_end = m->next_end;
  ch->next_ticket = m->next_ticket;
  ch->had_senders = m->had_senders;
  ch->had_receivers = m->had_receivers;
  ch->corrupt = m->corrupt;
  snprintf(ch->why, sizeof(ch->why), "%s", m->why);
  ch->repair_due = m->repair_due;
  return 0;
}

static int take_ends(td__chans *cs, const td__handover_conn *conns, size_t n,
                     const Tensord__Handover__ChanEnds *b, char *msg,
                     size_t len) {
  for (size_t i = 0; i < b->n_ends; i++) {
    const Tensord__Handover__ChanEnd *m = b->ends[i];
    td__chan *ch = td__chan_by_id(cs, m->chan);
    if (ch == NULL || (!m->dead && m->conn >= n))
      return td__msg(msg, len, TD_EPROTO,
                     "end %u of channel %llu (connection %u of %zu): no such "
                     "%s",
                     m->id, (unsigned long long)m->chan, m->conn, n,
                     ch ? "connection" : "channel");
    const td__handover_conn *c = m->dead ? NULL : &conns[m->conn];
    td__chan_end *e;
    int err = td__chan_end_restore(ch, m->id, m->flags, m->left, m->dead,
                                   c ? c->owner : NULL, c ? c->hold : NULL, &e);
    if (err < 0)
      return td__msg(msg, len, err, "channel '%s': end %u: %s", ch->name, m->id,
                     td_strerror(err));
    if (c != NULL) {
      TD__LIST_PUSH(c->chan_ends, e, cprev, cnext);
      (*c->nchan_ends)++;
    }
  }
  return 0;
}

static int take_tickets(td__chans *cs, const Tensord__Handover__ChanTickets *b,
                        char *msg, size_t len) {
  for (size_t i = 0; i < b->n_tickets; i++) {
    const Tensord__Handover__ChanTicket *m = b->tickets[i];
    td__chan *ch = td__chan_by_id(cs, m->chan);
    if (ch == NULL)
      return td__msg(msg, len, TD_EPROTO,
                     "ticket %llu of channel %llu, which was not sent",
                     (unsigned long long)m->ticket,
                     (unsigned long long)m->chan);
    int err = td__chan_ticket_restore(ch, m->ticket, m->storage, m->ro, m->end);
    if (err < 0)
      return td__msg(msg, len, err, "channel '%s': ticket %llu: %s", ch->name,
                     (unsigned long long)m->ticket, td_strerror(err));
  }
  return 0;
}

int td__handover_check(const td__chans *cs, char *msg, size_t len) {
  td__chan *ch;
  EACH_CHAN(cs, ch) {
    if (ch->nends == 0)
      return td__msg(msg, len, TD_EPROTO, "channel '%s' came with no open end",
                     ch->name);
    int err = td__chan_check_refs(ch, msg, len);
    if (err < 0)
      return err;
  }
  return 0;
}

int td__handover_take(td__registry *r, td__pool *p, td__chans *cs,
                      const td__handover_conn *conns, size_t n,
                      const Tensord__Handover__Packet *m, char *msg,
                      size_t len) {
  switch (m->body_case) {
  case TENSORD__HANDOVER__PACKET__BODY_CHAN_ENDS:
    return take_ends(cs, conns, n, m->chan_ends, msg, len);
  case TENSORD__HANDOVER__PACKET__BODY_CHAN_TICKETS:
    return take_tickets(cs, m->chan_tickets, msg, len);
  case TENSORD__HANDOVER__PACKET__BODY_STORAGES:
    return take_storages(r, cs, conns, n, m->storages, msg, len);
  case TENSORD__HANDOVER__PACKET__BODY_POOL:
    return take_pool(p, m->pool, msg, len);
  case TENSORD__HANDOVER__PACKET__BODY_SCOPES:
    return take_scopes(r, conns, n, m->scopes, msg, len);
  case TENSORD__HANDOVER__PACKET__BODY_KEYS:
    return take_keys(r, conns, n, m->keys, msg, len);
  default:
    return td__msg(msg, len, TD_EPROTO, "unexpected packet type %d",
                   (int)m->body_case);
  }
}

/* chanops.c: the channel requests (docs/channels.md), a connection's ends
 * going with it, and the timer that repairs rings after dead ends and looks
 * them over for garbage. The rules are the engine's (channel.h); this file
 * checks requests, moves references and answers. */
#include "chanops.h"

#include "channel.h"
#include "common.h"
#include "grant.h"
#include "list.h"
#include "log.h"
#include "segment.h"
#include "server.h"
#include "tensord.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Ends one connection may have open at once. */
#define ENDS_PER_CONN_MAX 1024
/* The timer's period while a repair waits for a ring's lock, and while
 * channels are merely open. */
#define REPAIR_RETRY_MS 1
#define CHECK_MS 200
/* What ChanList tells of each channel's ends, at most. */
#define LIST_ENDS_MAX 64

#define reject(...) (td__conn_error(__VA_ARGS__), 0)

static char *name_str(const ProtobufCBinaryData *n, char *buf, size_t len) {
  size_t k = n->len < len - 1 ? n->len : len - 1;
  if (k > 0) /* an empty bytes field may have no data at all */
    memcpy(buf, n->data, k);
  buf[k] = '\0';
  for (size_t i = 0; i < k; i++)
    if ((unsigned char)buf[i] < 0x20 || buf[i] == 0x7f)
      buf[i] = '?';
  return buf;
}

static const char *side_name(unsigned flags) {
  switch (flags) {
  case TD_CHAN_SEND:
    return "send";
  case TD_CHAN_RECV:
    return "receive";
  default:
    return "send and receive";
  }
}

/* ---- the timer ---- */

static void on_tick(uv_timer_t *t);

/* Runs the timer as the channels need: soon while a repair waits, slowly
 * while any channel is open, not at all without channels. */
static void arm(td__server *srv, int soon) {
  if (!srv->listening || srv->stopping)
    return;
  if (srv->chans.n == 0) {
    uv_timer_stop(&srv->chan_timer);
    return;
  }
  uint64_t ms = soon ? REPAIR_RETRY_MS : CHECK_MS;
  if (uv_is_active((uv_handle_t *)&srv->chan_timer) &&
      uv_timer_get_due_in(&srv->chan_timer) <= ms)
    return;
  uv_timer_start(&srv->chan_timer, on_tick, ms, 0);
}

static void on_tick(uv_timer_t *t) {
  td__server *srv = td__container_of(t, td__server, chan_timer);
  int soon = 0;
  for (size_t i = 0; i < srv->chans.by_id.nbuckets; i++) {
    for (td__hnode *n = srv->chans.by_id.buckets[i]; n; n = n->next) {
      td__chan *ch = td__container_of(n, td__chan, inode);
      if (ch->repair_due && td__chan_repair(ch) == TD_EBUSY)
        soon = 1;
      td__chan_check(ch);
    }
  }
  arm(srv, soon);
}

void td__chans_listen(td__server *srv) {
  uv_timer_init(srv->loop, &srv->chan_timer);
  /* Channels a live upgrade handed over are checked from now on, and the
   * ends that died before it are repaired after at once. */
  int soon = 0;
  for (size_t i = 0; i < srv->chans.by_id.nbuckets; i++)
    for (td__hnode *n = srv->chans.by_id.buckets[i]; n; n = n->next)
      soon |= td__container_of(n, td__chan, inode)->repair_due;
  arm(srv, soon);
}

void td__chans_close(td__server *srv) {
  uv_close((uv_handle_t *)&srv->chan_timer, NULL);
}

/* ---- ends ---- */

static void end_unlink(td__conn *c, td__chan_end *e) {
  TD__LIST_REMOVE(&c->chan_ends, e, cprev, cnext);
  c->nchan_ends--;
}

static void chan_destroy(td__server *srv, td__chan *ch) {
  td__debug("channel '%s' closed: no end is open", ch->name);
  td__chan_free(&srv->chans, &srv->reg, ch);
  arm(srv, 0);
}

/* The end of c that a request names, or NULL after answering seq. */
static td__chan_end *find_end(td__conn *c, uint64_t seq, uint64_t chan,
                              uint32_t end) {
  for (td__chan_end *e = c->chan_ends; e; e = e->cnext)
    if (e->id == end && e->chan->id == chan)
      return e;
  td__conn_error(c, seq, TD_ENOENT,
                 "channel %llu, end %u: not an end this client has open",
                 (unsigned long long)chan, (unsigned)end);
  return NULL;
}

/* Answers seq: ch is corrupt. */
static int corrupt_reply(td__conn *c, uint64_t seq, const td__chan *ch) {
  return reject(c, seq, TD_EPROTO, "channel '%s': %s; it is closed", ch->name,
                ch->why);
}

/* Answers seq with e's channel and the ring's fd. */
static int send_chan(td__conn *c, uint64_t seq, td__chan_end *e) {
  td__chan *ch = e->chan;
  int fd = dup(ch->fd);
  if (fd < 0)
    return reject(c, seq, TD_EMFILE, "channel '%s': dup of its ring: %s",
                  ch->name, strerror(errno));
  Tensord__ChanReply m = TENSORD__CHAN_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  m.chan = ch->id;
  m.end = e->id;
  m.capacity = ch->capacity;
  m.slot_bytes = ch->slot_bytes;
  m.ring_size = ch->ring.size;
  m.n_slots = ch->nslots;
  m.slots = ch->slot_ids;
  m.mode = ch->mode;
  m.owner_uid = ch->owner.uid;
  m.flags = e->flags;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_CHAN;
  r.chan = &m;
  td__conn_send(c, &r, fd);
  return 0;
}

static int add_end(td__conn *c, uint64_t seq, td__chan *ch, unsigned flags,
                   td__chan_end **out) {
  if (c->nchan_ends >= ENDS_PER_CONN_MAX) {
    td__conn_error(c, seq, TD_EMFILE,
                   "channel '%s': this client has %u channel ends open, the "
                   "most one may",
                   ch->name, (unsigned)c->nchan_ends);
    return TD_EMFILE;
  }
  int err = td__chan_end_add(ch, c, &c->hold, flags, out);
  if (err < 0) {
    td__conn_error(c, seq, err,
                   err == TD_EMFILE ? "channel '%s': it has %u ends open, the "
                                      "most a channel may"
                                    : "channel '%s': out of memory (%u ends)",
                   ch->name, (unsigned)ch->nends);
    return err;
  }
  TD__LIST_PUSH(&c->chan_ends, *out, cprev, cnext);
  c->nchan_ends++;
  return 0;
}

/* ---- requests ---- */

static int check_flags(td__conn *c, uint64_t seq, uint32_t flags,
                       unsigned *out) {
  if (flags & ~(TD_CHAN_SEND | TD_CHAN_RECV)) {
    td__conn_error(c, seq, TD_EINVAL,
                   "channel flags 0x%x: only TD_CHAN_SEND (0x1) and "
                   "TD_CHAN_RECV (0x2)",
                   (unsigned)flags);
    return TD_EINVAL;
  }
  *out = flags ? flags : TD_CHAN_SEND | TD_CHAN_RECV;
  return 0;
}

/* Checks that c may give id to a channel as a slot of slot_bytes. */
static td__storage *slot_storage(td__conn *c, uint64_t seq, const char *name,
                                 uint32_t i, uint64_t id, uint64_t slot_bytes) {
  td__storage *s = td__storage_find(&c->srv->reg, id);
  td__ref *ref = s ? td__ref_find(&c->hold, id) : NULL;
  if (s == NULL || ref == NULL || ref->rw == 0) {
    td__conn_error(c, seq, TD_ENOENT,
                   "channel '%s': slot %u, storage %llu: this client holds "
                   "no read-write reference to it",
                   name, (unsigned)i, (unsigned long long)id);
    return NULL;
  }
  if (s->owner.uid != c->hold.peer.uid || s->device != TD_CPU ||
      s->nbytes != slot_bytes) {
    td__conn_error(c, seq, TD_EINVAL,
                   "channel '%s': slot %u, storage %llu: a slot must be a CPU "
                   "storage of slot_bytes (%llu) that this client's uid (%u) "
                   "owns; it has %llu bytes on %s, owned by uid %u",
                   name, (unsigned)i, (unsigned long long)id,
                   (unsigned long long)slot_bytes, (unsigned)c->hold.peer.uid,
                   (unsigned long long)s->nbytes,
                   s->device == TD_CPU ? "the CPU" : "a GPU",
                   (unsigned)s->owner.uid);
    return NULL;
  }
  return s;
}

static int op_create(td__conn *c, uint64_t seq, const Tensord__ChanCreate *m) {
  td__server *srv = c->srv;
  char name[TD_KEY_MAX + 1], msg[256];
  name_str(&m->name, name, sizeof(name));
  int err = td__key_validate((const char *)m->name.data, m->name.len, msg,
                             sizeof(msg));
  if (err < 0)
    return reject(c, seq, err, "channel name: %s", msg);
  unsigned flags;
  if (check_flags(c, seq, m->flags, &flags) < 0)
    return 0;
  if (m->mode & ~0666u)
    return reject(c, seq, TD_EINVAL,
                  "channel '%s': mode %04o: only read and write bits (0666)",
                  name, (unsigned)m->mode);
  if (m->n_slots > TD_CHAN_SLOTS_MAX)
    return reject(c, seq, TD_EINVAL, "channel '%s': %zu slots, more than %u",
                  name, m->n_slots, TD_CHAN_SLOTS_MAX);
  td__storage **ss = calloc(m->n_slots + 1, sizeof(*ss));
  if (ss == NULL)
    return reject(c, seq, TD_ENOMEM, "channel '%s': out of memory", name);
  for (size_t i = 0; i < m->n_slots; i++) {
    ss[i] = slot_storage(c, seq, name, (uint32_t)i, m->slots[i], m->slot_bytes);
    for (size_t j = 0; ss[i] != NULL && j < i; j++)
      if (ss[j] == ss[i]) {
        ss[i] = NULL;
        td__conn_error(c, seq, TD_EINVAL,
                       "channel '%s': storage %llu is slot %zu and slot %zu",
                       name, (unsigned long long)m->slots[i], j, i);
      }
    if (ss[i] == NULL) {
      free(ss);
      return 0;
    }
  }
  if (c->nchan_ends >= ENDS_PER_CONN_MAX) {
    free(ss);
    return reject(c, seq, TD_EMFILE,
                  "channel '%s': this client has %u channel ends open, the "
                  "most one may",
                  name, (unsigned)c->nchan_ends);
  }
  td__chan *ch;
  err = td__chan_new(&srv->chans, (const char *)m->name.data, m->name.len,
                     m->capacity, (uint32_t)m->n_slots, m->slot_bytes,
                     m->mode ? m->mode : 0600, &c->hold.peer, td__now_ms(), &ch,
                     msg, sizeof(msg));
  if (err < 0) {
    free(ss);
    return reject(c, seq, err, "channel '%s': %s", name, msg);
  }
  ch->owner.pid = c->hold.peer.pid;
  for (uint32_t i = 0; i < ch->nslots && err == 0; i++)
    err = td__chan_add_slot(&srv->reg, ch, i, ss[i]);
  free(ss);
  td__chan_end *e = NULL;
  if (err < 0) {
    td__chan_free(&srv->chans, &srv->reg, ch);
    return reject(c, seq, err, "channel '%s': its slots: %s", name,
                  td_strerror(err));
  }
  if (add_end(c, seq, ch, flags, &e) < 0) {
    td__chan_free(&srv->chans, &srv->reg, ch);
    return 0;
  }
  td__debug("client %d made channel '%s' (%u entries, %u slots of %llu "
            "bytes, mode %04o)",
            (int)c->hold.peer.pid, name, (unsigned)ch->capacity,
            (unsigned)ch->nslots, (unsigned long long)ch->slot_bytes,
            (unsigned)ch->mode);
  arm(srv, 0);
  return send_chan(c, seq, e);
}

static int op_open(td__conn *c, uint64_t seq, const Tensord__ChanOpen *m) {
  char name[TD_KEY_MAX + 1], msg[128];
  name_str(&m->name, name, sizeof(name));
  int err = td__key_validate((const char *)m->name.data, m->name.len, msg,
                             sizeof(msg));
  if (err < 0)
    return reject(c, seq, err, "channel name: %s", msg);
  unsigned flags;
  if (check_flags(c, seq, m->flags, &flags) < 0)
    return 0;
  td__chan *ch =
      td__chan_find(&c->srv->chans, (const char *)m->name.data, m->name.len);
  if (ch == NULL)
    return reject(c, seq, TD_ENOENT, "channel '%s': no such channel", name);
  if (ch->corrupt)
    return corrupt_reply(c, seq, ch);
  if (td__chan_may(ch, &c->hold, flags) < 0)
    return reject(c, seq, TD_EACCES,
                  "channel '%s': permission denied to %s (mode %04o, owner "
                  "uid %u gid %u; this client is uid %u gid %u)",
                  name, side_name(flags), (unsigned)ch->mode,
                  (unsigned)ch->owner.uid, (unsigned)ch->owner.gid,
                  (unsigned)c->hold.peer.uid, (unsigned)c->hold.peer.gid);
  td__chan_end *e;
  if (add_end(c, seq, ch, flags, &e) < 0)
    return 0;
  return send_chan(c, seq, e);
}

static int op_slot(td__conn *c, uint64_t seq, const Tensord__ChanSlot *m) {
  td__chan_end *e = find_end(c, seq, m->chan, m->end);
  if (e == NULL)
    return 0;
  td__chan *ch = e->chan;
  if (m->index >= ch->nslots)
    return reject(c, seq, TD_EINVAL, "channel '%s': slot %u of %u", ch->name,
                  (unsigned)m->index, (unsigned)ch->nslots);
  td__storage *s = td__storage_find(&c->srv->reg, ch->slot_ids[m->index]);
  if (s == NULL) /* the channel holds it: never */
    return reject(c, seq, TD_ENOENT, "channel '%s': slot %u has gone",
                  ch->name, (unsigned)m->index);
  int ro = !(e->flags & TD_CHAN_SEND);
  int fd = td__segment_open(s, ro);
  if (fd < 0)
    return reject(c, seq, fd, "channel '%s': slot %u: opening %s: %s",
                  ch->name, (unsigned)m->index, s->name, td_strerror(fd));
  /* As for any fd (td__grant): pages another uid maps are never recycled. */
  if (c->hold.peer.uid != s->owner.uid)
    s->foreign = 1;
  return td__send_storage(c, seq, s, ro, 0, fd);
}

static void end_close(td__conn *c, td__chan_end *e, int final) {
  td__chan *ch = e->chan;
  if (!final) {
    td__chan_end_leave(e);
    return;
  }
  end_unlink(c, e);
  /* Its slots went back with its handles; a client that says otherwise
   * left some LOANED or HELD under an id no end has, which a repair frees. */
  ch->repair_due = 1;
  if (td__chan_end_remove(e, 0)) {
    chan_destroy(c->srv, ch);
    return;
  }
  if (td__chan_repair(ch) == TD_EBUSY)
    arm(c->srv, 1);
}

static int op_close(td__conn *c, const Tensord__ChanClose *m) {
  for (td__chan_end *e = c->chan_ends; e; e = e->cnext)
    if (e->id == m->end && e->chan->id == m->chan) {
      end_close(c, e, m->final);
      return 0;
    }
  td__warn("client %d: close of channel %llu end %u, which it does not have "
           "open; ignored",
           (int)c->hold.peer.pid, (unsigned long long)m->chan,
           (unsigned)m->end);
  return 0;
}

static int op_put(td__conn *c, uint64_t seq, const Tensord__ChanPut *m) {
  td__chan_end *e = find_end(c, seq, m->chan, m->end);
  if (e == NULL)
    return 0;
  td__chan *ch = e->chan;
  if (ch->corrupt)
    return corrupt_reply(c, seq, ch);
  if (!(e->flags & TD_CHAN_SEND) || e->left)
    return reject(c, seq, TD_EPERM, "channel '%s': end %u does not send",
                  ch->name, (unsigned)e->id);
  td__storage *s = td__storage_find(&c->srv->reg, m->id);
  td__ref *ref = s ? td__ref_find(&c->hold, m->id) : NULL;
  if (ref == NULL || (m->readonly ? ref->ro : ref->rw) == 0)
    return reject(c, seq, TD_ENOENT,
                  "channel '%s': storage %llu: this client holds no %s "
                  "reference to it to send",
                  ch->name, (unsigned long long)m->id,
                  m->readonly ? "read-only" : "read-write");
  uint64_t ticket;
  int err = td__chan_put(&c->srv->reg, ch, e->id, s, m->readonly, &ticket);
  if (err == TD_EAGAIN)
    return reject(c, seq, err,
                  "channel '%s': %llu storages sent and not received, the "
                  "most it holds (its capacity %u + %u)",
                  ch->name, (unsigned long long)ch->ntickets,
                  (unsigned)ch->capacity, TD__CHAN_ENDS_MAX);
  if (err < 0)
    return reject(c, seq, err, "channel '%s': storage %llu: %s", ch->name,
                  (unsigned long long)m->id, td_strerror(err));
  Tensord__ChanTicket tm = TENSORD__CHAN_TICKET__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  tm.ticket = ticket;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_CHAN_TICKET;
  r.chan_ticket = &tm;
  td__conn_send(c, &r, -1);
  return 0;
}

static int op_take(td__conn *c, uint64_t seq, const Tensord__ChanTake *m) {
  td__chan_end *e = find_end(c, seq, m->chan, m->end);
  if (e == NULL)
    return 0;
  td__chan *ch = e->chan;
  if (!(e->flags & TD_CHAN_RECV) && !m->cancel)
    return reject(c, seq, TD_EPERM, "channel '%s': end %u does not receive",
                  ch->name, (unsigned)e->id);
  td__ticket *t = td__chan_ticket(ch, m->ticket);
  if (t == NULL && !m->cancel) {
    /* Each ticket is pushed once, by the end that was given it, and taken
     * once: an entry under one that no storage waits under is garbage an
     * end wrote into the ring (a ticket made up, or an entry copied). */
    char why[160];
    snprintf(why, sizeof(why),
             "an entry of its ring names ticket %llu, under which no "
             "storage waits (taken already, or never given)",
             (unsigned long long)m->ticket);
    td__chan_set_corrupt(ch, why);
    return corrupt_reply(c, seq, ch);
  }
  if (t == NULL || (m->cancel && t->end != e->id))
    return reject(c, seq, TD_ENOENT,
                  "channel '%s': entry with ticket %llu: no storage waits "
                  "under it%s",
                  ch->name, (unsigned long long)m->ticket,
                  m->cancel ? " from this end"
                            : " (taken already, or garbage in the ring)");
  if (m->cancel) {
    td__chan_ticket_done(&c->srv->reg, ch, t);
    Tensord__Ok ok = TENSORD__OK__INIT;
    Tensord__Response r = TENSORD__RESPONSE__INIT;
    r.seq = seq;
    r.body_case = TENSORD__RESPONSE__BODY_OK;
    r.ok = &ok;
    td__conn_send(c, &r, -1);
    return 0;
  }
  td__storage *s = td__storage_find(&c->srv->reg, t->id);
  char msg[256];
  int fd, ro = t->ro;
  /* The channel's mode admitted this receiver: the storage's own mode is
   * not asked again (the sender chose to hand it over). */
  int err = td__grant(c, s, ro, -1, 0, &fd, msg, sizeof(msg));
  if (err < 0)
    return reject(c, seq, err, "channel '%s': storage %llu: %s", ch->name,
                  (unsigned long long)t->id, msg);
  td__chan_ticket_done(&c->srv->reg, ch, t);
  return td__send_storage(c, seq, s, ro, 0, fd);
}

/* ---- listing ---- */

static int op_list(td__conn *c, uint64_t seq) {
  td__server *srv = c->srv;
  size_t n = srv->chans.n, k = 0;
  Tensord__ChanInfo *infos = calloc(n + 1, sizeof(*infos));
  Tensord__ChanInfo **ptrs = calloc(n + 1, sizeof(*ptrs));
  Tensord__ChanEndInfo *ends = calloc(n * LIST_ENDS_MAX + 1, sizeof(*ends));
  Tensord__ChanEndInfo **eptrs = calloc(n * LIST_ENDS_MAX + 1, sizeof(*eptrs));
  uint32_t *loaned = calloc(LIST_ENDS_MAX, sizeof(*loaned));
  uint32_t *held = calloc(LIST_ENDS_MAX, sizeof(*held));
  if (!infos || !ptrs || !ends || !eptrs || !loaned || !held) {
    free(infos);
    free(ptrs);
    free(ends);
    free(eptrs);
    free(loaned);
    free(held);
    return reject(c, seq, TD_ENOMEM, "channel list: out of memory");
  }
  size_t ne = 0;
  for (size_t b = 0; b < srv->chans.by_id.nbuckets; b++) {
    for (td__hnode *hn = srv->chans.by_id.buckets[b]; hn; hn = hn->next) {
      td__chan *ch = td__container_of(hn, td__chan, inode);
      Tensord__ChanInfo *m = &infos[k];
      tensord__chan_info__init(m);
      td__ring_counts rc;
      td__ring_count(&ch->ring, &rc);
      m->name.data = (uint8_t *)ch->name;
      m->name.len = ch->len;
      m->id = ch->id;
      m->capacity = ch->capacity;
      m->depth = rc.depth;
      m->slots = ch->nslots;
      m->slots_free = rc.free;
      m->slots_loaned = rc.loaned;
      m->slots_queued = rc.queued;
      m->slots_held = rc.held;
      m->slot_bytes = ch->slot_bytes;
      m->senders = ch->senders;
      m->receivers = ch->receivers;
      m->mode = ch->mode;
      m->owner_uid = ch->owner.uid;
      m->owner_pid = ch->owner.pid;
      m->in_flight = ch->ntickets;
      m->corrupt = ch->corrupt;
      m->sent = rc.sent;
      m->received = rc.received;
      m->n_slot_ids = ch->nslots;
      m->slot_ids = ch->slot_ids;
      /* Who has which slots: the slot words name ends (read once each). */
      memset(loaned, 0, LIST_ENDS_MAX * sizeof(*loaned));
      memset(held, 0, LIST_ENDS_MAX * sizeof(*held));
      size_t first = ne, ie = 0;
      td__chan_end *shown[LIST_ENDS_MAX];
      for (td__chan_end *e = ch->ends; e && ie < LIST_ENDS_MAX; e = e->next)
        if (!e->dead)
          shown[ie++] = e;
      for (uint32_t i = 0; i < ch->nslots; i++) {
        uint64_t w = atomic_load_explicit(&ch->ring.slots[i],
                                          memory_order_relaxed);
        for (size_t j = 0; j < ie; j++)
          if (shown[j]->id == TD__SLOT_END(w)) {
            if (TD__SLOT_STATE(w) == TD__SLOT_LOANED)
              loaned[j]++;
            else if (TD__SLOT_STATE(w) == TD__SLOT_HELD)
              held[j]++;
          }
      }
      for (size_t j = 0; j < ie; j++) {
        Tensord__ChanEndInfo *em = &ends[ne];
        tensord__chan_end_info__init(em);
        em->end = shown[j]->id;
        em->pid = shown[j]->hold->peer.pid;
        em->uid = shown[j]->hold->peer.uid;
        em->name = (char *)(shown[j]->hold->name ? shown[j]->hold->name : "");
        em->flags = shown[j]->flags;
        em->left = shown[j]->left;
        em->loaned = loaned[j];
        em->held = held[j];
        eptrs[ne++] = em;
      }
      m->n_ends = ne - first;
      m->ends = &eptrs[first];
      ptrs[k++] = m;
    }
  }
  Tensord__ChanListReply lm = TENSORD__CHAN_LIST_REPLY__INIT;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  lm.n_chans = k;
  lm.chans = ptrs;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_CHAN_LIST;
  r.chan_list = &lm;
  td__conn_send(c, &r, -1);
  free(infos);
  free(ptrs);
  free(ends);
  free(eptrs);
  free(loaned);
  free(held);
  return 0;
}

int td__chan_request(td__conn *c, Tensord__Request *req) {
  uint64_t seq = req->seq;
  switch (req->body_case) {
  case TENSORD__REQUEST__BODY_CHAN_CREATE:
    return op_create(c, seq, req->chan_create);
  case TENSORD__REQUEST__BODY_CHAN_OPEN:
    return op_open(c, seq, req->chan_open);
  case TENSORD__REQUEST__BODY_CHAN_SLOT:
    return op_slot(c, seq, req->chan_slot);
  case TENSORD__REQUEST__BODY_CHAN_CLOSE:
    return op_close(c, req->chan_close);
  case TENSORD__REQUEST__BODY_CHAN_PUT:
    return op_put(c, seq, req->chan_put);
  case TENSORD__REQUEST__BODY_CHAN_TAKE:
    return op_take(c, seq, req->chan_take);
  case TENSORD__REQUEST__BODY_CHAN_LIST:
    return op_list(c, seq);
  default:
    return reject(c, seq, TD_ENOSYS, "not a channel request");
  }
}

void td__chans_conn_gone(td__conn *c) {
  td__server *srv = c->srv;
  int soon = 0;
  while (c->chan_ends != NULL) {
    td__chan_end *e = c->chan_ends;
    td__chan *ch = e->chan;
    end_unlink(c, e);
    if (td__chan_end_remove(e, 1)) {
      chan_destroy(srv, ch);
      continue;
    }
    /* What it had on loan or held goes back now, unless a live end holds
     * the ring's lock this instant: then on the timer, in a millisecond. */
    if (td__chan_repair(ch) == TD_EBUSY)
      soon = 1;
  }
  if (soon)
    arm(srv, 1);
}

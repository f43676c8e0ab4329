/* chan.c: channels (tensord.h, docs/channels.md): an end maps the ring and
 * every slot once, at open; from then on a slot's handoff is the ring's
 * business (common/chanring.c) and no request goes to tensord. A storage
 * that is not a slot moves through tensord: a ChanPut before its entry is
 * pushed and a ChanTake after it is popped. */
#include "internal.h"

#include "chanring.h"
#include "tensord.pb-c.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define CAPACITY_DEFAULT 64

struct td_chan {
  td_client *c;
  /* The user's (until td_chan_close) plus one per slot handle out: the
   * end stays (its mappings, its id in the slot words) until the last. */
  atomic_int refs;
  atomic_int closed; /* td_chan_close was called */
  uint64_t id;
  uint32_t end;
  unsigned flags;
  _Atomic uint32_t spin_us;
  td__ring ring;
  uint64_t *slot_ids;   /* ring.nslots */
  td__mapping **maps;   /* the end's mapping of each slot */
  uint32_t mode;
  uint32_t owner_uid;
  char name[TD_KEY_MAX + 1];
};

/* Records why a call on ch failed, naming the channel, and returns err. */
static int chan_fail(const td_chan *ch, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int chan_fail(const td_chan *ch, int err, const char *fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof(why), fmt, ap);
  va_end(ap);
  char name[TD_KEY_MAX + 1];
  td__printable(ch->name, name, sizeof(name));
  return td__fail(ch->c, err, "channel '%s': %s", name, why);
}

static int forked_fail(const td_chan *ch, const char *op) {
  return chan_fail(ch, TD_EFORKED,
                   "%s: this end was opened by the parent of a fork; open "
                   "the channel again in this process",
                   op);
}

/* ---- an end's life ---- */

static void end_free(td_chan *ch) {
  if (!td__client_forked(ch->c)) {
    Tensord__ChanClose m = TENSORD__CHAN_CLOSE__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    m.chan = ch->id;
    m.end = ch->end;
    m.final = 1;
    req.body_case = TENSORD__REQUEST__BODY_CHAN_CLOSE;
    req.chan_close = &m;
    td__send_oneway(ch->c, &req);
    for (uint32_t i = 0; i < ch->ring.nslots; i++)
      td__map_release(ch->maps[i]);
    if (ch->ring.hdr != NULL)
      munmap(ch->ring.hdr, ch->ring.size);
  }
  free(ch->maps);
  free(ch->slot_ids);
  td_client *c = ch->c;
  free(ch);
  td__client_unref(c);
}

static void chan_unref(td_chan *ch) {
  if (atomic_fetch_sub(&ch->refs, 1) == 1)
    end_free(ch);
}

void td__chan_slot_done(td_chan *ch, uint32_t slot, int give_back) {
  if (give_back && td__ring_free(&ch->ring, ch->end, slot) < 0)
    td__fail(NULL, TD_EPROTO, "channel '%s': slot %u was not this end's "
             "when released (someone wrote over the ring)",
             ch->name, (unsigned)slot);
  chan_unref(ch);
}

/* Maps the ring (fd, from the reply m) and every slot; sets ch up. */
static int attach(td_chan *ch, const Tensord__ChanReply *m, int fd) {
  ch->id = m->chan;
  ch->end = m->end;
  ch->flags = m->flags;
  ch->mode = m->mode;
  ch->owner_uid = m->owner_uid;
  size_t size = td__ring_size(m->capacity, (uint32_t)m->n_slots);
  struct stat st;
  if (fd < 0 || size == 0 || m->ring_size != size || fstat(fd, &st) < 0 ||
      (uint64_t)st.st_size != size) {
    if (fd >= 0)
      close(fd);
    return chan_fail(ch, TD_EPROTO,
                     "tensord sent a ring of %llu bytes for %u entries and "
                     "%zu slots (%zu bytes due)",
                     (unsigned long long)m->ring_size, (unsigned)m->capacity,
                     m->n_slots, size);
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (p == MAP_FAILED)
    return chan_fail(ch, -e, "mapping its ring (%zu bytes): %s", size,
                     strerror(e));
  td__ring_attach(&ch->ring, p, size, m->capacity, (uint32_t)m->n_slots,
                  m->slot_bytes);
  uint32_t n = ch->ring.nslots;
  ch->ring.nslots = 0; /* counts the slots mapped, for end_free */
  ch->slot_ids = calloc(n + 1, sizeof(*ch->slot_ids));
  ch->maps = calloc(n + 1, sizeof(*ch->maps));
  if (ch->slot_ids == NULL || ch->maps == NULL)
    return chan_fail(ch, TD_ENOMEM, "out of memory");
  int ro = !(ch->flags & TD_CHAN_SEND);
  for (uint32_t i = 0; i < n; i++) {
    Tensord__ChanSlot sm = TENSORD__CHAN_SLOT__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    sm.chan = ch->id;
    sm.end = ch->end;
    sm.index = i;
    req.body_case = TENSORD__REQUEST__BODY_CHAN_SLOT;
    req.chan_slot = &sm;
    Tensord__Response *r;
    int sfd = -1;
    int err = td__call(ch->c, &req, TENSORD__RESPONSE__BODY_STORAGE, &r, &sfd);
    if (err < 0)
      return err;
    uint64_t id = r->storage->id;
    err = r->storage->nbytes != m->slot_bytes || r->storage->id != m->slots[i]
              ? TD_EPROTO
              : td__map_acquire(td__client_instance(ch->c), id,
                                ro ? TD__MAP_RO : TD__MAP_RW, m->slot_bytes,
                                sfd, 0, &ch->maps[i]);
    if (err == TD_EPROTO && sfd >= 0)
      close(sfd);
    tensord__response__free_unpacked(r, NULL);
    if (err < 0)
      return chan_fail(ch, err, "mapping slot %u (storage %llu): %s",
                       (unsigned)i, (unsigned long long)id, td_strerror(err));
    ch->slot_ids[i] = id;
    ch->ring.nslots = i + 1;
  }
  return 0;
}

static td_chan *chan_new(td_client *c, const char *name) {
  td_chan *ch = calloc(1, sizeof(*ch));
  if (ch == NULL)
    return NULL;
  ch->c = c;
  atomic_init(&ch->refs, 1);
  snprintf(ch->name, sizeof(ch->name), "%s", name);
  td__client_ref(c);
  return ch;
}

/* Finishes an open or create from its reply: on failure the end is
 * closed (so that tensord forgets it) and nothing is left. */
static int finish(td_chan *ch, Tensord__Response *r, int fd, td_chan **out) {
  int err = attach(ch, r->chan, fd);
  tensord__response__free_unpacked(r, NULL);
  if (err < 0) {
    chan_unref(ch);
    return err;
  }
  *out = ch;
  return 0;
}

static int check_name(td_client *c, const char *op, const char *name) {
  size_t len = name ? strnlen(name, TD_KEY_MAX + 1) : 0;
  if (len == 0 || len > TD_KEY_MAX)
    return td__fail(c, TD_EINVAL,
                    "%s: a channel's name is 1 to %d bytes (got %s)", op,
                    TD_KEY_MAX, name ? "a longer one" : "NULL");
  return 0;
}

int td_chan_create(td_client *c, const char *name, const td_chan_opts *o,
                   td_chan **out) {
  *out = NULL;
  td_chan_opts d = {0};
  if (o == NULL)
    o = &d;
  int err = check_name(c, "channel create", name);
  if (err < 0)
    return err;
  for (size_t i = 0; i < sizeof(o->reserved) / sizeof(o->reserved[0]); i++)
    if (o->reserved[i] != 0 || o->reserved32 != 0)
      return td__fail(c, TD_EINVAL,
                      "channel '%s': reserved fields of td_chan_opts must be "
                      "zero (zero-initialise it)",
                      name);
  uint64_t cap = o->capacity ? o->capacity : CAPACITY_DEFAULT;
  if (cap > TD_CHAN_CAPACITY_MAX)
    return td__fail(c, TD_EINVAL,
                    "channel '%s': capacity %u entries, more than %u", name,
                    (unsigned)o->capacity, TD_CHAN_CAPACITY_MAX);
  uint32_t pow2 = 1;
  while (pow2 < cap)
    pow2 <<= 1;
  if (o->slots > TD_CHAN_SLOTS_MAX)
    return td__fail(c, TD_EINVAL, "channel '%s': %u slots, more than %u", name,
                    (unsigned)o->slots, TD_CHAN_SLOTS_MAX);
  if (o->slots > 0 && o->slot_bytes == 0)
    return td__fail(c, TD_EINVAL,
                    "channel '%s': %u slots of 0 bytes: give slot_bytes",
                    name, (unsigned)o->slots);
  if (o->slots == 0 && o->slot_bytes != 0)
    return td__fail(c, TD_EINVAL,
                    "channel '%s': slot_bytes %llu without slots", name,
                    (unsigned long long)o->slot_bytes);
  if (o->mode & ~0666u)
    return td__fail(c, TD_EINVAL,
                    "channel '%s': mode %04o: only read and write bits (0666)",
                    name, (unsigned)o->mode);
  if (o->flags & ~(TD_CHAN_SEND | TD_CHAN_RECV))
    return td__fail(c, TD_EINVAL,
                    "channel '%s': flags 0x%x: only TD_CHAN_SEND and "
                    "TD_CHAN_RECV",
                    name, (unsigned)o->flags);
  uint32_t mode = o->mode ? o->mode : 0600;
  /* The slots are made as any storage (zeroed, from the pool if it has
   * them), then given to the channel, which holds them from then on. */
  td_storage **ss = calloc(o->slots + 1, sizeof(*ss));
  uint64_t *ids = calloc(o->slots + 1, sizeof(*ids));
  if (ss == NULL || ids == NULL) {
    free(ss);
    free(ids);
    return td__fail(c, TD_ENOMEM, "out of memory");
  }
  for (uint32_t i = 0; i < o->slots && err == 0; i++) {
    td_create_opts co = {.nbytes = o->slot_bytes, .mode = mode};
    err = td_storage_create_ex(c, &co, &ss[i]);
    if (err == 0)
      ids[i] = td_storage_id(ss[i]);
  }
  Tensord__Response *r = NULL;
  int fd = -1;
  if (err == 0) {
    Tensord__ChanCreate m = TENSORD__CHAN_CREATE__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    m.name.data = (uint8_t *)name;
    m.name.len = strlen(name);
    m.capacity = pow2;
    m.n_slots = o->slots;
    m.slots = ids;
    m.slot_bytes = o->slot_bytes;
    m.mode = mode;
    m.flags = o->flags;
    req.body_case = TENSORD__REQUEST__BODY_CHAN_CREATE;
    req.chan_create = &m;
    err = td__call(c, &req, TENSORD__RESPONSE__BODY_CHAN, &r, &fd);
  }
  free(ids);
  td_chan *ch = NULL;
  if (err == 0 && (ch = chan_new(c, name)) == NULL) {
    tensord__response__free_unpacked(r, NULL);
    close(fd);
    err = td__fail(c, TD_ENOMEM, "out of memory");
  }
  if (err == 0) {
    atomic_store(&ch->spin_us, o->spin_us);
    err = finish(ch, r, fd, out);
  }
  /* The channel has its own reference to each slot; ours go now, after
   * the end has mapped them (the mappings are shared). */
  for (uint32_t i = 0; i < o->slots; i++)
    td_storage_release(ss[i]);
  free(ss);
  return err;
}

static int open_once(td_client *c, const char *name, unsigned flags,
                     Tensord__Response **r, int *fd) {
  Tensord__ChanOpen m = TENSORD__CHAN_OPEN__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.name.data = (uint8_t *)name;
  m.name.len = strlen(name);
  m.flags = flags;
  req.body_case = TENSORD__REQUEST__BODY_CHAN_OPEN;
  req.chan_open = &m;
  return td__call(c, &req, TENSORD__RESPONSE__BODY_CHAN, r, fd);
}

int td_chan_open(td_client *c, const char *name, unsigned flags, int timeout_ms,
                 td_chan **out) {
  *out = NULL;
  int err = check_name(c, "channel open", name);
  if (err < 0)
    return err;
  /* Not yet created: asked again, every 1 ms at first, then up to every
   * 20 ms, until the deadline. */
  int64_t deadline = td__ring_deadline(timeout_ms);
  long pause_us = 1000;
  Tensord__Response *r;
  int fd = -1;
  for (;;) {
    err = open_once(c, name, flags, &r, &fd);
    if (err != TD_ENOENT || timeout_ms == 0)
      break;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t left = deadline < 0 ? pause_us * 1000
                                : deadline - ((int64_t)now.tv_sec * 1000000000 +
                                              now.tv_nsec);
    if (left <= 0) {
      char n[TD_KEY_MAX + 1];
      return td__fail(c, TD_ETIMEDOUT,
                      "channel '%s': not created (waited %d ms)",
                      td__printable(name, n, sizeof(n)), timeout_ms);
    }
    if (left > pause_us * 1000)
      left = pause_us * 1000;
    struct timespec ts = {0, (long)left};
    nanosleep(&ts, NULL);
    if (pause_us < 20000)
      pause_us *= 2;
  }
  if (err < 0)
    return err;
  td_chan *ch = chan_new(c, name);
  if (ch == NULL) {
    tensord__response__free_unpacked(r, NULL);
    close(fd);
    return td__fail(c, TD_ENOMEM, "out of memory");
  }
  return finish(ch, r, fd, out);
}

void td_chan_set_spin(td_chan *ch, uint32_t spin_us) {
  atomic_store(&ch->spin_us, spin_us);
}

void td_chan_close(td_chan *ch) {
  if (ch == NULL || atomic_exchange(&ch->closed, 1))
    return;
  /* Handles out (slots on loan or received) keep the end; its side is
   * left now, so the other side learns of it. */
  if (atomic_load(&ch->refs) > 1 && !td__client_forked(ch->c)) {
    Tensord__ChanClose m = TENSORD__CHAN_CLOSE__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    m.chan = ch->id;
    m.end = ch->end;
    req.body_case = TENSORD__REQUEST__BODY_CHAN_CLOSE;
    req.chan_close = &m;
    td__send_oneway(ch->c, &req);
  }
  chan_unref(ch);
}

/* ---- handoffs ---- */

static int64_t spin_ns(const td_chan *ch) {
  return (int64_t)atomic_load(&((td_chan *)ch)->spin_us) * 1000;
}

/* The ring's failures, named. */
static int ring_fail(const td_chan *ch, int err, const char *op,
                     const char *msg, int timeout_ms) {
  if (err == TD_ETIMEDOUT)
    return chan_fail(ch, err, "%s: %s (waited %d ms)", op, msg, timeout_ms);
  return chan_fail(ch, err, "%s: %s", op, msg);
}

static int usable(const td_chan *ch, const char *op, unsigned side) {
  if (td__client_forked(ch->c))
    return forked_fail(ch, op);
  if (atomic_load(&((td_chan *)ch)->closed))
    return chan_fail(ch, TD_ENOTCONN, "%s: this end is closed", op);
  if (!(ch->flags & side))
    return chan_fail(ch, TD_EPERM, "%s: this end does not %s", op,
                     side == TD_CHAN_SEND ? "send" : "receive");
  return 0;
}

int td_chan_loan(td_chan *ch, int timeout_ms, td_storage **out) {
  *out = NULL;
  int err = usable(ch, "loan", TD_CHAN_SEND);
  if (err < 0)
    return err;
  char msg[256];
  uint32_t slot;
  err = td__ring_loan(&ch->ring, ch->end, td__ring_deadline(timeout_ms),
                      spin_ns(ch), &slot, msg, sizeof(msg));
  if (err < 0)
    return ring_fail(ch, err, "loan", msg, timeout_ms);
  atomic_fetch_add(&ch->refs, 1);
  err = td__storage_slot(ch->c, ch, slot, ch->slot_ids[slot],
                         ch->ring.slot_bytes, 0, out);
  if (err < 0)
    td__chan_slot_done(ch, slot, 1);
  return err;
}

/* Sends a storage that is not a slot of ch: the channel takes a reference
 * (ChanPut) for the entry, and the caller's goes once it is pushed. */
static int send_storage(td_chan *ch, td_storage *s, const td_view *v,
                        int timeout_ms) {
  Tensord__ChanPut m = TENSORD__CHAN_PUT__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.chan = ch->id;
  m.end = ch->end;
  m.id = td_storage_id(s);
  m.readonly = td_storage_is_readonly(s);
  req.body_case = TENSORD__REQUEST__BODY_CHAN_PUT;
  req.chan_put = &m;
  Tensord__Response *r;
  int err = td__call(ch->c, &req, TENSORD__RESPONSE__BODY_CHAN_TICKET, &r, NULL);
  if (err < 0)
    return err;
  td__ring_entry e = {.kind = TD__CELL_STORAGE, .ticket = r->chan_ticket->ticket,
                      .view = *v};
  tensord__response__free_unpacked(r, NULL);
  char msg[256];
  err = td__ring_push(&ch->ring, ch->end, &e, td__ring_deadline(timeout_ms),
                      spin_ns(ch), msg, sizeof(msg));
  if (err == 0) {
    td_storage_release(s);
    return 0;
  }
  /* Not pushed: the channel's reference goes back, the caller keeps s. */
  Tensord__ChanTake tm = TENSORD__CHAN_TAKE__INIT;
  tm.chan = ch->id;
  tm.end = ch->end;
  tm.ticket = e.ticket;
  tm.cancel = 1;
  req.body_case = TENSORD__REQUEST__BODY_CHAN_TAKE;
  req.chan_take = &tm;
  td__call(ch->c, &req, TENSORD__RESPONSE__BODY_OK, NULL, NULL);
  return ring_fail(ch, err, "send", msg, timeout_ms);
}

int td_chan_send(td_chan *ch, td_storage *s, const td_view *v, int timeout_ms) {
  int err = usable(ch, "send", TD_CHAN_SEND);
  if (err < 0)
    return err;
  if (s == NULL || v == NULL)
    return chan_fail(ch, TD_EINVAL, "send: no storage or no view");
  if (td_storage_client(s) != ch->c)
    return chan_fail(ch, TD_EINVAL,
                     "send: storage %llu belongs to another client (send on "
                     "a channel opened with the storage's client)",
                     (unsigned long long)td_storage_id(s));
  if (td_view_check(v, td_storage_nbytes(s)) < 0)
    return chan_fail(ch, td_view_check(v, td_storage_nbytes(s)),
                     "send: storage %llu: %s",
                     (unsigned long long)td_storage_id(s),
                     td_view_last_error());
  uint32_t slot;
  int refs;
  td_chan *owner = td__storage_chan(s, &slot, &refs);
  if (owner == NULL)
    return send_storage(ch, s, v, timeout_ms);
  if (owner != ch)
    return chan_fail(ch, TD_EINVAL,
                     "send: storage %llu is a slot of another channel end; "
                     "send it there, or copy it",
                     (unsigned long long)td_storage_id(s));
  if (refs != 1)
    return chan_fail(ch, TD_EBUSY,
                     "send: slot %u has %d handle references; sending hands "
                     "over the only one (release the others first)",
                     (unsigned)slot, refs);
  td__ring_entry e = {.kind = TD__CELL_SLOT, .slot = slot, .view = *v};
  char msg[256];
  err = td__ring_push(&ch->ring, ch->end, &e, td__ring_deadline(timeout_ms),
                      spin_ns(ch), msg, sizeof(msg));
  if (err < 0)
    return ring_fail(ch, err, "send", msg, timeout_ms);
  td__storage_forget(s);
  chan_unref(ch);
  return 0;
}

int td_chan_recv(td_chan *ch, int timeout_ms, td_storage **out, td_view *v) {
  *out = NULL;
  int err = usable(ch, "receive", TD_CHAN_RECV);
  if (err < 0)
    return err;
  char msg[256];
  td__ring_entry e;
  err = td__ring_pop(&ch->ring, ch->end, td__ring_deadline(timeout_ms),
                     spin_ns(ch), &e, msg, sizeof(msg));
  if (err < 0)
    return ring_fail(ch, err, "receive", msg, timeout_ms);
  if (e.kind == TD__CELL_SLOT) {
    atomic_fetch_add(&ch->refs, 1);
    err = td__storage_slot(ch->c, ch, e.slot, ch->slot_ids[e.slot],
                           ch->ring.slot_bytes, !(ch->flags & TD_CHAN_SEND),
                           out);
    if (err < 0) {
      td__chan_slot_done(ch, e.slot, 1);
      return err;
    }
    *v = e.view;
    return 0;
  }
  Tensord__ChanTake m = TENSORD__CHAN_TAKE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.chan = ch->id;
  m.end = ch->end;
  m.ticket = e.ticket;
  req.body_case = TENSORD__REQUEST__BODY_CHAN_TAKE;
  req.chan_take = &m;
  Tensord__Response *r;
  int fd = -1;
  err = td__call(ch->c, &req, TENSORD__RESPONSE__BODY_STORAGE, &r, &fd);
  if (err < 0)
    return err;
  td_storage *s;
  err = td__storage_from_reply(ch->c, r->storage, fd, &s);
  tensord__response__free_unpacked(r, NULL);
  if (err < 0)
    return err;
  if (td_view_check(&e.view, td_storage_nbytes(s)) < 0) {
    char why[256];
    snprintf(why, sizeof(why), "%s", td_view_last_error());
    uint64_t id = td_storage_id(s); /* named after s is released */
    td_storage_release(s);
    /* As any garbage the ring itself shows: closed for everyone (tensord
     * sees the flag at its next look). */
    td__ring_set_state(&ch->ring, TD__RING_CORRUPT, 0);
    return chan_fail(ch, TD_EPROTO,
                     "receive: the entry's view of storage %llu: %s (garbage "
                     "in the ring); it is closed",
                     (unsigned long long)id, why);
  }
  *out = s;
  *v = e.view;
  return 0;
}

/* ---- looking ---- */

int td_chan_stat(td_chan *ch, td_chan_info *out) {
  memset(out, 0, sizeof(*out));
  td__ring_counts rc;
  td__ring_count(&ch->ring, &rc);
  out->name = ch->name;
  out->id = ch->id;
  out->capacity = ch->ring.capacity;
  out->depth = rc.depth;
  out->slots = ch->ring.nslots;
  out->slots_free = rc.free;
  out->slots_loaned = rc.loaned;
  out->slots_queued = rc.queued;
  out->slots_held = rc.held;
  out->senders = atomic_load(&ch->ring.hdr->senders);
  out->receivers = atomic_load(&ch->ring.hdr->receivers);
  out->mode = ch->mode;
  out->slot_bytes = ch->ring.slot_bytes;
  out->owner_uid = ch->owner_uid;
  out->owner_pid = 0;
  out->corrupt = (atomic_load(&ch->ring.hdr->state) & TD__RING_CORRUPT) != 0;
  out->sent = rc.sent;
  out->received = rc.received;
  return 0;
}

int td_chan_list(td_client *c, td_chan_cb cb, void *arg) {
  Tensord__ChanList m = TENSORD__CHAN_LIST__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.body_case = TENSORD__REQUEST__BODY_CHAN_LIST;
  req.chan_list = &m;
  Tensord__Response *r;
  int err = td__call(c, &req, TENSORD__RESPONSE__BODY_CHAN_LIST, &r, NULL);
  if (err < 0)
    return err;
  int ret = 0;
  for (size_t i = 0; i < r->chan_list->n_chans && ret == 0; i++) {
    const Tensord__ChanInfo *m2 = r->chan_list->chans[i];
    char name[TD_KEY_MAX + 1];
    size_t n = m2->name.len < TD_KEY_MAX ? m2->name.len : TD_KEY_MAX;
    if (n > 0)
      memcpy(name, m2->name.data, n);
    name[n] = '\0';
    td_chan_info info = {0};
    info.name = name;
    info.id = m2->id;
    info.capacity = m2->capacity;
    info.depth = m2->depth;
    info.slots = m2->slots;
    info.slots_free = m2->slots_free;
    info.slots_loaned = m2->slots_loaned;
    info.slots_queued = m2->slots_queued;
    info.slots_held = m2->slots_held;
    info.senders = m2->senders;
    info.receivers = m2->receivers;
    info.mode = m2->mode;
    info.slot_bytes = m2->slot_bytes;
    info.owner_uid = m2->owner_uid;
    info.owner_pid = m2->owner_pid;
    info.in_flight = m2->in_flight;
    info.corrupt = m2->corrupt;
    info.sent = m2->sent;
    info.received = m2->received;
    td_chan_end_info ends[64];
    size_t ne = m2->n_ends < 64 ? m2->n_ends : 64;
    for (size_t j = 0; j < ne; j++) {
      const Tensord__ChanEndInfo *em = m2->ends[j];
      ends[j] = (td_chan_end_info){.end = em->end,
                                   .pid = em->pid,
                                   .uid = em->uid,
                                   .name = em->name ? em->name : "",
                                   .flags = em->flags,
                                   .left = em->left,
                                   .loaned = em->loaned,
                                   .held = em->held};
    }
    info.nends = ne;
    info.ends = ends;
    info.nslot_ids = m2->n_slot_ids;
    info.slot_ids = m2->slot_ids;
    ret = cb(&info, arg);
  }
  tensord__response__free_unpacked(r, NULL);
  return ret;
}

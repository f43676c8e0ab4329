/* channel.c: channels as the daemon keeps them (channel.h). */
#include "channel.h"

#include "common.h"
#include "list.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct namespan {
  const char *p;
  size_t len;
} namespan;

static int name_eq(const td__hnode *n, const void *key) {
  const td__chan *ch = td__container_of(n, td__chan, node);
  const namespan *k = key;
  return ch->len == k->len && memcmp(ch->name, k->p, k->len) == 0;
}

static int id_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, td__chan, inode)->id == *(const uint64_t *)key;
}

static int ticket_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, td__ticket, node)->ticket ==
         *(const uint64_t *)key;
}

void td__chans_init(td__chans *cs) {
  td__htab_init(&cs->by_name);
  td__htab_init(&cs->by_id);
  cs->next_id = 1;
  cs->n = 0;
}

void td__chans_free(td__chans *cs, td__registry *reg) {
  td__hnode *n;
  while ((n = td__htab_any(&cs->by_id)) != NULL)
    td__chan_free(cs, reg, td__container_of(n, td__chan, inode));
  td__htab_free(&cs->by_name);
  td__htab_free(&cs->by_id);
}

td__chan *td__chan_find(const td__chans *cs, const char *name, size_t len) {
  namespan k = {name, len};
  td__hnode *n =
      td__htab_find(&cs->by_name, td__hash_bytes(name, len), name_eq, &k);
  return n ? td__container_of(n, td__chan, node) : NULL;
}

td__chan *td__chan_by_id(const td__chans *cs, uint64_t id) {
  td__hnode *n = td__htab_find(&cs->by_id, td__hash_u64(id), id_eq, &id);
  return n ? td__container_of(n, td__chan, inode) : NULL;
}

/* The ring's memory: a memfd sealed at its size, so that no end can shrink
 * it under the others (a SIGBUS in whoever touches it next), mapped here.
 */
static int ring_make(td__chan *ch, size_t size, char *msg, size_t len) {
  int fd = memfd_create("tensord-chan", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return td__msg(msg, len, -errno, "memfd_create: %s", strerror(errno));
  int err = 0;
  if (ftruncate(fd, (off_t)size) < 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
    err = -errno;
    close(fd);
    return td__msg(msg, len, err, "sizing the ring's memfd to %zu bytes: %s",
                   size, strerror(-err));
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    err = -errno;
    close(fd);
    return td__msg(msg, len, err, "mapping the ring (%zu bytes): %s", size,
                   strerror(-err));
  }
  td__ring_attach(&ch->ring, p, size, ch->capacity, ch->nslots,
                  ch->slot_bytes);
  td__ring_format(&ch->ring);
  ch->fd = fd;
  return 0;
}

/* A channel with no ring yet, not in cs: its name, geometry, owner and
 * holdings ("chan:NAME"). Returns it, or NULL (no memory). */
static td__chan *chan_alloc(const char *name, size_t len, uint32_t capacity,
                            uint32_t nslots, uint64_t slot_bytes, uint32_t mode,
                            const td__peer *owner, int64_t now_ms) {
  td__chan *ch = calloc(1, sizeof(*ch) + len + 1);
  uint64_t *ids = calloc(nslots + 1, sizeof(*ids));
  if (ch == NULL || ids == NULL) {
    free(ch);
    free(ids);
    return NULL;
  }
  memcpy(ch->name, name, len);
  ch->len = len;
  ch->slot_ids = ids;
  ch->capacity = capacity;
  ch->nslots = nslots;
  ch->slot_bytes = slot_bytes;
  ch->mode = mode;
  ch->owner = *owner;
  ch->created_ms = now_ms;
  ch->next_end = 1;
  ch->next_ticket = 1;
  ch->fd = -1;
  td__htab_init(&ch->tickets);
  td__peer hp = {0, owner->uid, owner->gid};
  td__holdings_init(&ch->hold, &hp);
  snprintf(ch->hold_name, sizeof(ch->hold_name), "chan:%s", ch->name);
  ch->hold.name = ch->hold_name;
  return ch;
}

/* Frees ch as chan_alloc made it, with its ring if it has one (fd >= 0). */
static void chan_unalloc(td__chan *ch) {
  if (ch->fd >= 0) {
    munmap(ch->ring.hdr, ch->ring.size);
    close(ch->fd);
  }
  td__htab_free(&ch->tickets);
  free(ch->slot_ids);
  free(ch);
}

/* Puts ch in cs under its id. Returns 0, or TD_ENOMEM (cs unchanged). */
static int chan_insert(td__chans *cs, td__chan *ch) {
  if (td__htab_insert(&cs->by_name, &ch->node,
                      td__hash_bytes(ch->name, ch->len)) < 0)
    return TD_ENOMEM;
  if (td__htab_insert(&cs->by_id, &ch->inode, td__hash_u64(ch->id)) < 0) {
    td__htab_remove(&cs->by_name, &ch->node);
    return TD_ENOMEM;
  }
  cs->n++;
  return 0;
}

int td__chan_new(td__chans *cs, const char *name, size_t len, uint32_t capacity,
                 uint32_t nslots, uint64_t slot_bytes, uint32_t mode,
                 const td__peer *owner, int64_t now_ms, td__chan **out,
                 char *msg, size_t msglen) {
  if (td__chan_find(cs, name, len) != NULL)
    return td__msg(msg, msglen, TD_EEXIST, "a channel of that name is open");
  size_t size = td__ring_size(capacity, nslots);
  if (size == 0 || (nslots > 0 && slot_bytes == 0))
    return td__msg(msg, msglen, TD_EINVAL,
                   "capacity %u, %u slots of %llu bytes: the capacity must be "
                   "a power of two up to %u, the slots at most %u, of at "
                   "least one byte",
                   (unsigned)capacity, (unsigned)nslots,
                   (unsigned long long)slot_bytes, TD_CHAN_CAPACITY_MAX,
                   TD_CHAN_SLOTS_MAX);
  td__chan *ch =
      chan_alloc(name, len, capacity, nslots, slot_bytes, mode, owner, now_ms);
  if (ch == NULL)
    return td__msg(msg, msglen, TD_ENOMEM, "out of memory");
  int err = ring_make(ch, size, msg, msglen);
  if (err < 0) {
    chan_unalloc(ch);
    return err;
  }
  ch->id = cs->next_id;
  if (chan_insert(cs, ch) < 0) {
    chan_unalloc(ch);
    return td__msg(msg, msglen, TD_ENOMEM, "out of memory");
  }
  cs->next_id++;
  *out = ch;
  return 0;
}

int td__chan_restore(td__chans *cs, const char *name, size_t len, uint64_t id,
                     uint32_t capacity, uint32_t nslots, uint64_t slot_bytes,
                     uint32_t mode, const td__peer *owner, int64_t created_ms,
                     int fd, td__chan **out, char *msg, size_t msglen) {
  size_t size = td__ring_size(capacity, nslots);
  struct stat st;
  int seals = fd >= 0 ? fcntl(fd, F_GET_SEALS) : -1;
  const int need = F_SEAL_SHRINK | F_SEAL_GROW;
  if (fd < 0 || id == 0 || size == 0 || (nslots > 0 && slot_bytes == 0) ||
      fstat(fd, &st) < 0 || (uint64_t)st.st_size != size || seals < 0 ||
      (seals & need) != need) {
    if (fd >= 0)
      close(fd);
    return td__msg(msg, msglen, TD_EPROTO,
                   "channel %llu: a ring of %u entries and %u slots of %llu "
                   "bytes (%zu bytes due) in %s",
                   (unsigned long long)id, (unsigned)capacity, (unsigned)nslots,
                   (unsigned long long)slot_bytes, size,
                   fd < 0 ? "no fd" : "an fd not of that size, or not sealed");
  }
  if (td__chan_find(cs, name, len) != NULL || td__chan_by_id(cs, id) != NULL) {
    close(fd);
    return td__msg(msg, msglen, TD_EEXIST,
                   "channel %llu: its name or its id came twice",
                   (unsigned long long)id);
  }
  td__chan *ch = chan_alloc(name, len, capacity, nslots, slot_bytes, mode,
                            owner, created_ms);
  if (ch == NULL) {
    close(fd);
    return td__msg(msg, msglen, TD_ENOMEM, "out of memory");
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = -errno;
    close(fd);
    chan_unalloc(ch);
    return td__msg(msg, msglen, err, "channel %llu: mapping its ring: %s",
                   (unsigned long long)id, strerror(-err));
  }
  /* What the ends wrote stays as it is: they go on using it. */
  td__ring_attach(&ch->ring, p, size, capacity, nslots, slot_bytes);
  ch->fd = fd;
  ch->id = id;
  if (chan_insert(cs, ch) < 0) {
    chan_unalloc(ch);
    return td__msg(msg, msglen, TD_ENOMEM, "out of memory");
  }
  if (cs->next_id <= id)
    cs->next_id = id + 1;
  *out = ch;
  return 0;
}

int td__chan_add_slot(td__registry *reg, td__chan *ch, uint32_t index,
                      td__storage *s) {
  uint32_t had;
  int err = td__ref_add(reg, &ch->hold, s, 0, &had);
  if (err == 0)
    ch->slot_ids[index] = s->id;
  return err;
}

void td__chan_free(td__chans *cs, td__registry *reg, td__chan *ch) {
  td__ring_set_state(&ch->ring, TD__RING_CLOSED, 0);
  td__htab_remove(&cs->by_name, &ch->node);
  td__htab_remove(&cs->by_id, &ch->inode);
  cs->n--;
  td__hnode *n;
  while ((n = td__htab_any(&ch->tickets)) != NULL) {
    td__htab_remove(&ch->tickets, n);
    free(td__container_of(n, td__ticket, node));
  }
  td__holdings_clear(reg, &ch->hold);
  for (td__chan_end *e = ch->ends, *next; e; e = next) {
    next = e->next;
    free(e);
  }
  chan_unalloc(ch);
}

int td__chan_may(const td__chan *ch, const td__holdings *h, unsigned flags) {
  int want = (flags & TD_CHAN_SEND ? TD__MAY_WRITE : 0) |
             (flags & TD_CHAN_RECV ? TD__MAY_READ : 0);
  return td__may_mode(ch->mode, &ch->owner, h, want);
}

/* Tells the ring which sides have gone (came, and all left). */
static void sides_changed(td__chan *ch) {
  uint32_t set = 0, clear = 0;
  if (ch->had_senders && ch->senders == 0)
    set |= TD__RING_NO_SENDERS;
  else
    clear |= TD__RING_NO_SENDERS;
  if (ch->had_receivers && ch->receivers == 0)
    set |= TD__RING_NO_RECEIVERS;
  else
    clear |= TD__RING_NO_RECEIVERS;
  atomic_store(&ch->ring.hdr->senders, ch->senders);
  atomic_store(&ch->ring.hdr->receivers, ch->receivers);
  td__ring_set_state(&ch->ring, set, clear);
}

int td__chan_end_add(td__chan *ch, void *conn, const td__holdings *h,
                     unsigned flags, td__chan_end **out) {
  if (ch->nends >= TD__CHAN_ENDS_MAX)
    return TD_EMFILE;
  td__chan_end *e = calloc(1, sizeof(*e));
  if (e == NULL)
    return TD_ENOMEM;
  /* Ids never repeat within a channel (a dead end's may still be named in
   * a slot word): past TD__END_MAX the channel takes no more ends. */
  if (ch->next_end > TD__END_MAX) {
    free(e);
    return TD_EMFILE;
  }
  e->id = ch->next_end++;
  e->flags = flags;
  e->conn = conn;
  e->hold = h;
  e->chan = ch;
  TD__LIST_PUSH(&ch->ends, e, prev, next);
  ch->nends++;
  if (flags & TD_CHAN_SEND) {
    ch->senders++;
    ch->had_senders = 1;
  }
  if (flags & TD_CHAN_RECV) {
    ch->receivers++;
    ch->had_receivers = 1;
  }
  sides_changed(ch);
  *out = e;
  return 0;
}

void td__chan_end_leave(td__chan_end *e) {
  if (e->left)
    return;
  e->left = 1;
  td__chan *ch = e->chan;
  if (e->flags & TD_CHAN_SEND)
    ch->senders--;
  if (e->flags & TD_CHAN_RECV)
    ch->receivers--;
  sides_changed(ch);
}

int td__chan_end_remove(td__chan_end *e, int dead) {
  td__chan *ch = e->chan;
  td__chan_end_leave(e);
  ch->nends--;
  if (dead) {
    e->dead = 1;
    e->conn = NULL;
    e->hold = NULL;
    ch->repair_due = 1;
  } else {
    TD__LIST_REMOVE(&ch->ends, e, prev, next);
    free(e);
  }
  return ch->nends == 0;
}

td__chan_end *td__chan_end_find(const td__chan *ch, uint32_t id) {
  for (td__chan_end *e = ch->ends; e; e = e->next)
    if (e->id == id && !e->dead)
      return e;
  return NULL;
}

static int end_dead(uint32_t id, void *arg) {
  const td__chan *ch = arg;
  for (td__chan_end *e = ch->ends; e; e = e->next)
    if (e->id == id)
      return e->dead;
  /* An id no end has now: one that closed (its slots went back with its
   * handles) or garbage. Either way no one will give it back. */
  return id != 0 && id < ch->next_end;
}

void td__chan_set_corrupt(td__chan *ch, const char *why) {
  if (!ch->corrupt) {
    ch->corrupt = 1;
    snprintf(ch->why, sizeof(ch->why), "%s", why);
    td__warn("channel '%s': %s; closed for every end", ch->name, why);
  }
  td__ring_set_state(&ch->ring, TD__RING_CORRUPT, 0);
}

int td__chan_repair(td__chan *ch) {
  if (!ch->repair_due)
    return 0;
  char msg[200];
  /* A corrupt ring is not put right (its slots go back with the channel):
   * its lock may stay held by garbage for good, and a repair that waited
   * for it would run the timer every millisecond until the channel goes. */
  int n = ch->corrupt ? 0
                      : td__ring_repair(&ch->ring, end_dead, ch, msg,
                                        sizeof(msg));
  if (n == TD_EBUSY)
    return n;
  if (n == TD_EPROTO)
    td__chan_set_corrupt(ch, msg);
  for (td__chan_end *e = ch->ends, *next; e; e = next) {
    next = e->next;
    if (e->dead) {
      TD__LIST_REMOVE(&ch->ends, e, prev, next);
      free(e);
    }
  }
  ch->repair_due = 0;
  if (n > 0)
    td__debug("channel '%s': %d slot(s) of ends that died given back",
              ch->name, n);
  return n;
}

int td__chan_check(td__chan *ch) {
  uint32_t state = atomic_load(&ch->ring.hdr->state);
  if (ch->corrupt) {
    /* Closed for good, whatever an end writes over the flag since. */
    if (!(state & TD__RING_CORRUPT))
      td__ring_set_state(&ch->ring, TD__RING_CORRUPT, 0);
    return 0;
  }
  if (state & TD__RING_CORRUPT) {
    td__chan_set_corrupt(ch, "an end found its ring corrupt");
    return 1;
  }
  if (state & TD__RING_CLOSED) {
    td__chan_set_corrupt(ch, "its ring says tensord closed it, which it did "
                             "not");
    return 1;
  }
  /* tensord holds the lock only inside td__ring_repair, on this thread:
   * its id there now is garbage, as is an id no end has. */
  uint32_t holder = td__ring_lock_holder(&ch->ring);
  if (holder != 0) {
    int known = 0;
    for (td__chan_end *e = ch->ends; e && !known; e = e->next)
      known = e->id == holder;
    if (!known) {
      char why[96];
      snprintf(why, sizeof(why), "its lock is held by end %u, which no one is",
               (unsigned)holder);
      td__chan_set_corrupt(ch, why);
      return 1;
    }
  }
  return 0;
}

int td__chan_put(td__registry *reg, td__chan *ch, uint32_t end, td__storage *s,
                 int ro, uint64_t *ticket) {
  if (ch->ntickets >= (uint64_t)ch->capacity + TD__CHAN_ENDS_MAX)
    return TD_EAGAIN;
  td__ticket *t = calloc(1, sizeof(*t));
  if (t == NULL)
    return TD_ENOMEM;
  t->ticket = ch->next_ticket;
  t->id = s->id;
  t->ro = ro;
  t->end = end;
  if (td__htab_insert(&ch->tickets, &t->node, td__hash_u64(t->ticket)) < 0) {
    free(t);
    return TD_ENOMEM;
  }
  uint32_t had;
  int err = td__ref_add(reg, &ch->hold, s, ro, &had);
  if (err < 0) {
    td__htab_remove(&ch->tickets, &t->node);
    free(t);
    return err;
  }
  ch->next_ticket++;
  ch->ntickets++;
  *ticket = t->ticket;
  return 0;
}

td__ticket *td__chan_ticket(const td__chan *ch, uint64_t ticket) {
  td__hnode *n =
      td__htab_find(&ch->tickets, td__hash_u64(ticket), ticket_eq, &ticket);
  return n ? td__container_of(n, td__ticket, node) : NULL;
}

void td__chan_ticket_done(td__registry *reg, td__chan *ch, td__ticket *t) {
  td__htab_remove(&ch->tickets, &t->node);
  ch->ntickets--;
  uint64_t id = t->id;
  int ro = t->ro;
  free(t);
  td__ref_drop(reg, &ch->hold, id, ro, 1);
}

int td__chan_end_restore(td__chan *ch, uint32_t id, unsigned flags, int left,
                         int dead, void *conn, const td__holdings *h,
                         td__chan_end **out) {
  if (id == 0 || id >= ch->next_end || flags == 0 ||
      (flags & ~(TD_CHAN_SEND | TD_CHAN_RECV)) != 0 ||
      (!dead && (conn == NULL || h == NULL)))
    return TD_EPROTO;
  for (const td__chan_end *e = ch->ends; e; e = e->next)
    if (e->id == id)
      return TD_EEXIST;
  if (!dead && ch->nends >= TD__CHAN_ENDS_MAX)
    return TD_EMFILE;
  td__chan_end *e = calloc(1, sizeof(*e));
  if (e == NULL)
    return TD_ENOMEM;
  e->id = id;
  e->flags = flags;
  e->left = left || dead; /* a dead end left when it died */
  e->dead = dead;
  e->conn = dead ? NULL : conn;
  e->hold = dead ? NULL : h;
  e->chan = ch;
  TD__LIST_PUSH(&ch->ends, e, prev, next);
  if (!dead)
    ch->nends++;
  if (!e->left) {
    ch->senders += (flags & TD_CHAN_SEND) != 0;
    ch->receivers += (flags & TD_CHAN_RECV) != 0;
  }
  *out = e;
  return 0;
}

int td__chan_ticket_restore(td__chan *ch, uint64_t ticket, uint64_t id, int ro,
                            uint32_t end) {
  if (ticket == 0 || ticket >= ch->next_ticket || end == 0 ||
      end >= ch->next_end)
    return TD_EPROTO;
  if (td__chan_ticket(ch, ticket) != NULL)
    return TD_EEXIST;
  td__ticket *t = calloc(1, sizeof(*t));
  if (t == NULL)
    return TD_ENOMEM;
  t->ticket = ticket;
  t->id = id;
  t->ro = ro;
  t->end = end;
  if (td__htab_insert(&ch->tickets, &t->node, td__hash_u64(ticket)) < 0) {
    free(t);
    return TD_ENOMEM;
  }
  ch->ntickets++;
  return 0;
}

/* A reference the channel's state calls for: a slot's, or a ticket's. */
typedef struct need {
  uint64_t id;
  int ro;
} need;

static int need_cmp(const void *a, const void *b) {
  const need *x = a, *y = b;
  return x->id < y->id ? -1 : x->id > y->id;
}

int td__chan_check_refs(const td__chan *ch, char *msg, size_t len) {
  size_t n = ch->nslots + ch->ntickets, k = 0;
  need *v = malloc((n + 1) * sizeof(*v));
  if (v == NULL)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  for (uint32_t i = 0; i < ch->nslots; i++)
    v[k++] = (need){ch->slot_ids[i], 0};
  for (size_t b = 0; b < ch->tickets.nbuckets; b++)
    for (const td__hnode *hn = ch->tickets.buckets[b]; hn && k < n;
         hn = hn->next) {
      const td__ticket *t = td__container_of(hn, td__ticket, node);
      v[k++] = (need){t->id, t->ro};
    }
  qsort(v, k, sizeof(*v), need_cmp);
  size_t groups = 0;
  int err = 0;
  for (size_t i = 0, j; i < k && err == 0; i = j) {
    uint64_t rw = 0, ro = 0;
    for (j = i; j < k && v[j].id == v[i].id; j++) {
      if (v[j].ro)
        ro++;
      else
        rw++;
    }
    groups++;
    const td__ref *r = td__ref_find(&ch->hold, v[i].id);
    if (r == NULL || r->rw != rw || r->ro != ro)
      err =
          td__msg(msg, len, TD_EPROTO,
                  "channel '%s': storage %llu: its slots and tickets call "
                  "for %llu read-write and %llu read-only reference(s), it "
                  "holds %u and %u",
                  ch->name, (unsigned long long)v[i].id, (unsigned long long)rw,
                  (unsigned long long)ro, r ? r->rw : 0, r ? r->ro : 0);
  }
  if (err == 0 && groups != ch->hold.refs.count)
    err = td__msg(msg, len, TD_EPROTO,
                  "channel '%s': holds %zu storage(s), of which its slots and "
                  "tickets name %zu",
                  ch->name, (size_t)ch->hold.refs.count, groups);
  free(v);
  return err;
}

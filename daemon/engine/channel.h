/* channel.h: channels (docs/channels.md) as the daemon keeps them: each
 * one's ring (a sealed memfd it maps too), its ends, and the references it
 * holds (its slots, and storages sent and not yet received), and the rules
 * that keep those exact when an end dies or writes garbage. No event loop:
 * the server calls in on requests, on a connection's end, and on a timer
 * while a repair waits for the ring's lock. */
#ifndef TD_DAEMON_CHANNEL_H
#define TD_DAEMON_CHANNEL_H

#include "chanring.h"
#include "htab.h"
#include "registry.h"

#include <stddef.h>
#include <stdint.h>

typedef struct td__chan td__chan;

/* One end: a connection's open of a channel, on one side or both. */
typedef struct td__chan_end {
  uint32_t id;
  unsigned flags;            /* TD_CHAN_SEND | TD_CHAN_RECV */
  int left;                  /* it left its side; it still has slots out */
  int dead;                  /* its connection went: kept until a repair */
  void *conn;                /* the server's connection (opaque here) */
  const td__holdings *hold;  /* that connection's: pid, uid, name */
  td__chan *chan;
  struct td__chan_end *prev, *next;   /* in chan->ends */
  struct td__chan_end *cprev, *cnext; /* in its connection's list */
} td__chan_end;

struct td__chan {
  td__hnode node;  /* in td__chans.by_name */
  td__hnode inode; /* in td__chans.by_id */
  uint64_t id;
  td__holdings hold; /* the channel's references; its name is hold_name */
  char hold_name[TD_KEY_MAX + 8]; /* "chan:NAME", as tensorctl ls shows */
  uint32_t mode;
  td__peer owner; /* the creator */
  uint32_t capacity;
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t *slot_ids; /* nslots */
  int fd;             /* the ring's memfd */
  td__ring ring;      /* our mapping of it */
  td__chan_end *ends;
  uint32_t nends; /* live ones (not dead) */
  uint32_t next_end;
  uint32_t senders, receivers; /* ends on each side that have not left */
  int had_senders, had_receivers;
  td__htab tickets; /* td__ticket by ticket: storages put, not taken */
  uint64_t ntickets;
  uint64_t next_ticket;
  int corrupt;     /* closed: found corrupt (why) */
  char why[256];
  int repair_due;  /* dead ends wait in ends for td__chan_repair */
  int64_t created_ms;
  size_t len;
  char name[]; /* len bytes, NUL-terminated */
};

typedef struct td__chans {
  td__htab by_name;
  td__htab by_id;
  uint64_t next_id;
  uint64_t n;
} td__chans;

/* Bounds of a channel's daemon state. */
#define TD__CHAN_ENDS_MAX 4096 /* ends open on one channel at once */

void td__chans_init(td__chans *cs);
/* Frees every channel (td__chan_free). */
void td__chans_free(td__chans *cs, td__registry *reg);
td__chan *td__chan_find(const td__chans *cs, const char *name, size_t len);
td__chan *td__chan_by_id(const td__chans *cs, uint64_t id);

/* Makes channel name (len bytes, checked by the caller) with its ring of
 * capacity entries (a power of two) for nslots slots of slot_bytes, owned
 * by owner with mode. The slots are added next (td__chan_add_slot). Returns
 * 0, or TD_EEXIST, TD_EINVAL (geometry), TD_ENOMEM, or the memfd's error,
 * with msg; nothing is left on failure. */
int td__chan_new(td__chans *cs, const char *name, size_t len,
                 uint32_t capacity, uint32_t nslots, uint64_t slot_bytes,
                 uint32_t mode, const td__peer *owner, int64_t now_ms,
                 td__chan **out, char *msg, size_t msglen);
/* Rebuilds channel name with id, as a live upgrade hands it over, around
 * fd, the memfd of its ring that the old daemon made: sealed, of
 * td__ring_size of the geometry (checked). Maps it as the ends left it:
 * nothing in it is written. Takes ownership of fd. The caller sets the
 * rest (slot ids, counters, state), then restores its ends, tickets and
 * references. Returns 0, or TD_EPROTO (no fd, another size, not sealed),
 * TD_EEXIST (its name or id is taken), TD_ENOMEM, or mmap's error, with
 * msg; nothing is left on failure (fd closed). */
int td__chan_restore(td__chans *cs, const char *name, size_t len, uint64_t id,
                     uint32_t capacity, uint32_t nslots, uint64_t slot_bytes,
                     uint32_t mode, const td__peer *owner, int64_t created_ms,
                     int fd, td__chan **out, char *msg, size_t msglen);
/* Gives ch a read-write reference to s as slot index. Returns 0, or
 * td__ref_add's error. */
int td__chan_add_slot(td__registry *reg, td__chan *ch, uint32_t index,
                      td__storage *s);
/* Closes the ring for everyone, drops the channel's references (which may
 * free storages), and frees ch with its ends, which must have been taken
 * out of their connections' lists. */
void td__chan_free(td__chans *cs, td__registry *reg, td__chan *ch);

/* Whether the holdings h may open ch on the sides in flags (write for
 * sending, read for receiving, judged as for a storage). 0 or TD_EACCES. */
int td__chan_may(const td__chan *ch, const td__holdings *h, unsigned flags);

/* A new end of ch for conn. Returns 0, TD_EMFILE (TD__CHAN_ENDS_MAX) or
 * TD_ENOMEM. */
int td__chan_end_add(td__chan *ch, void *conn, const td__holdings *h,
                     unsigned flags, td__chan_end **out);
/* The end leaves its side (the other side sees TD_EPIPE when all of it
 * has). Idempotent. */
void td__chan_end_leave(td__chan_end *e);
/* The end is done: with dead (its connection went) it stays in ch->ends,
 * dead, until a repair gives back what it had; otherwise it is freed.
 * Returns 1 if ch has no live end left (the caller frees ch). */
int td__chan_end_remove(td__chan_end *e, int dead);
/* Puts an end as a live upgrade hands it over first in ch->ends (not in
 * its connection's list: the caller's): with dead, one kept for a repair,
 * without a connection; else conn's, on the sides in flags. Returns 0 with
 * the end in *out, or
 * TD_EPROTO (an id ch never gave, bad flags, no connection), TD_EEXIST (the
 * id is there), TD_EMFILE or TD_ENOMEM; ch is unchanged on failure. */
int td__chan_end_restore(td__chan *ch, uint32_t id, unsigned flags, int left,
                         int dead, void *conn, const td__holdings *h,
                         td__chan_end **out);
/* The end of ch with that id, or NULL. */
td__chan_end *td__chan_end_find(const td__chan *ch, uint32_t id);

/* Puts the ring right after its dead ends (td__ring_repair), then forgets
 * them; a corrupt channel's ring is left as it is. Returns the slots given
 * back, TD_EBUSY (a live end holds the lock: call again soon), or
 * TD_EPROTO (ch is now corrupt, why in ch->why). */
int td__chan_repair(td__chan *ch);
/* Looks at the ring for signs of garbage that no call noticed: the corrupt
 * flag an end set, the closed flag (which tensord sets only as it frees
 * ch), or a lock held by no end (tensord's own id included: it holds the
 * lock only inside a repair). Returns 1 if ch is found corrupt now
 * (ch->corrupt, ch->why set), else 0. On a channel already corrupt it sets
 * the ring's flag again if an end cleared it. */
int td__chan_check(td__chan *ch);
/* Marks ch corrupt with why: the ring's flag set, everyone woken. */
void td__chan_set_corrupt(td__chan *ch, const char *why);

/* A storage sent through ch: the channel's reference, by ticket. */
typedef struct td__ticket {
  td__hnode node;
  uint64_t ticket;
  uint64_t id;
  int ro;
  uint32_t end; /* who put it */
} td__ticket;

/* Gives ch a reference of mode ro to s for end, and a ticket for it.
 * Returns 0, TD_EAGAIN (capacity + TD__CHAN_ENDS_MAX tickets out already),
 * or td__ref_add's error. */
int td__chan_put(td__registry *reg, td__chan *ch, uint32_t end, td__storage *s,
                 int ro, uint64_t *ticket);
/* The ticket, or NULL. */
td__ticket *td__chan_ticket(const td__chan *ch, uint64_t ticket);
/* Gives ch a ticket as a live upgrade hands it over, without its reference
 * (that comes with the storage's holders). Returns 0, or TD_EPROTO (a ticket
 * or end ch never gave), TD_EEXIST, TD_ENOMEM; ch is unchanged on failure. */
int td__chan_ticket_restore(td__chan *ch, uint64_t ticket, uint64_t id, int ro,
                            uint32_t end);
/* Checks that ch holds exactly the references its slots (one read-write
 * each) and tickets (one of the ticket's mode each) call for, and no other.
 * Returns 0, or TD_EPROTO (or TD_ENOMEM) with msg. */
int td__chan_check_refs(const td__chan *ch, char *msg, size_t len);
/* Forgets t and drops ch's reference (the taker has added its own first).
 */
void td__chan_ticket_done(td__registry *reg, td__chan *ch, td__ticket *t);

#endif /* TD_DAEMON_CHANNEL_H */

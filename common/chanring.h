/* chanring.h: a channel's ring, in shared memory that the daemon makes (a
 * sealed memfd) and every end and the daemon map read-write.
 *
 * Every process that maps it may write anything into it, so nothing read
 * from it is trusted: each value is read once, into a local, and checked
 * before it is used; the geometry (capacity, slots, slot size) comes from
 * the daemon's reply, never from the ring. The worst garbage can do is
 * break this one channel: td__ring_* then return TD_EPROTO and mark it
 * corrupt.
 *
 * Layout: a header, the slot states, then the cells of the ring.
 * - The ring: cells[capacity] indexed by position % capacity; head (next
 *   to pop) and tail (next to push) grow forever. Pushes and pops take the
 *   lock, a word that names its holder (the end's id): a holder that dies
 *   is known by name, and the daemon repairs after it (td__ring_repair).
 * - A slot's state is one word: FREE, or LOANED / QUEUED / HELD with the
 *   end that has it. Loans and releases are compare-and-swaps without the
 *   lock; QUEUED changes only under the lock.
 * - Waiting: three counters (items, space, freed) that each push, pop and
 *   free bump, and a count of sleepers per counter; a waker calls
 *   FUTEX_WAKE only when someone sleeps.
 * - state: flags the daemon sets (a side has gone, the channel is closed
 *   or corrupt); it bumps every counter and wakes everyone when it does. */
#ifndef TD_COMMON_CHANRING_H
#define TD_COMMON_CHANRING_H

#include "tensord.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define TD__RING_MAGIC 0x314e414843445454ull /* "TTDCHAN1" */
#define TD__RING_VERSION 1u

/* The lock word: 0, or the holder's end id, with this bit when someone
 * sleeps on it. End ids are 1 .. TD__END_MAX; the daemon locks as
 * TD__END_DAEMON. */
#define TD__LOCK_SLEEPERS 0x80000000u
#define TD__END_MAX 0x3ffffffeu
#define TD__END_DAEMON 0x3fffffffu

/* Slot states: the low byte of the word; the end id is above it. */
enum { TD__SLOT_FREE = 0, TD__SLOT_LOANED = 1, TD__SLOT_QUEUED = 2, TD__SLOT_HELD = 3 };
#define TD__SLOT_WORD(state, end) ((uint64_t)(end) << 8 | (uint64_t)(state))
#define TD__SLOT_STATE(w) ((unsigned)((w)&0xff))
#define TD__SLOT_END(w) ((uint32_t)((w) >> 8))

/* What a cell carries. */
enum { TD__CELL_SLOT = 1, TD__CELL_STORAGE = 2 };

/* state flags (the daemon's). */
#define TD__RING_NO_SENDERS 0x1u   /* senders came and all left */
#define TD__RING_NO_RECEIVERS 0x2u /* receivers came and all left */
#define TD__RING_CORRUPT 0x4u      /* found corrupt: closed for everyone */
#define TD__RING_CLOSED 0x8u       /* the daemon closed it (it is going) */

typedef struct td__ring_cell {
  _Atomic uint32_t kind;
  _Atomic uint32_t slot;     /* TD__CELL_SLOT: its index */
  _Atomic uint64_t ticket;   /* TD__CELL_STORAGE: the daemon's ticket */
  _Atomic int32_t dtype;
  _Atomic int32_t ndim;
  _Atomic int64_t offset;
  _Atomic int64_t shape[TD_MAX_DIMS];
  _Atomic int64_t stride[TD_MAX_DIMS];
} td__ring_cell;

typedef struct td__ring_hdr {
  _Atomic uint64_t magic;
  _Atomic uint32_t version;
  _Atomic uint32_t capacity; /* informational: ends use the daemon's */
  _Atomic uint32_t nslots;
  _Atomic uint32_t state; /* TD__RING_* */
  _Atomic uint64_t slot_bytes;
  _Atomic uint32_t senders; /* ends open on each side (the daemon's) */
  _Atomic uint32_t receivers;
  _Alignas(64) _Atomic uint32_t lock;
  _Atomic uint64_t head; /* under the lock */
  _Atomic uint64_t tail;
  _Alignas(64) _Atomic uint32_t items; /* bumped per push: receivers sleep */
  _Atomic uint32_t items_sleepers;
  _Alignas(64) _Atomic uint32_t space; /* bumped per pop: senders sleep */
  _Atomic uint32_t space_sleepers;
  _Alignas(64) _Atomic uint32_t freed; /* bumped per slot freed: loaners */
  _Atomic uint32_t freed_sleepers;
  _Alignas(64) _Atomic uint32_t hint; /* unused: see td__ring.hint */
} td__ring_hdr;

/* A mapped ring, with the geometry the daemon gave (never the ring's). */
typedef struct td__ring {
  td__ring_hdr *hdr;
  _Atomic uint64_t *slots; /* nslots words */
  td__ring_cell *cells;    /* capacity cells */
  uint32_t capacity;       /* a power of two */
  uint32_t nslots;
  uint64_t slot_bytes;
  size_t size; /* bytes mapped */
  /* This end's: where its next loan looks first, the slot it loaned last
   * (whose pages its mapping has warm, in the TLB and the page tables;
   * the first write through a mapping costs more than the next). */
  _Atomic uint32_t hint;
} td__ring;

/* The bytes a ring of capacity cells and nslots slots needs (page
 * multiple). 0 if the geometry is out of bounds. */
size_t td__ring_size(uint32_t capacity, uint32_t nslots);
/* Points r at a mapping of size bytes (td__ring_size of the geometry).
 * Returns 0 or TD_EINVAL. */
int td__ring_attach(td__ring *r, void *base, size_t size, uint32_t capacity,
                    uint32_t nslots, uint64_t slot_bytes);
/* Writes a fresh header (the daemon, on the zeroed mapping). */
void td__ring_format(td__ring *r);

/* An entry: what a cell says, checked. */
typedef struct td__ring_entry {
  uint32_t kind;
  uint32_t slot;
  uint64_t ticket;
  td_view view;
} td__ring_entry;

/* Deadlines: CLOCK_MONOTONIC nanoseconds; -1: none (wait forever). */
int64_t td__ring_deadline(int timeout_ms);

/* Every call below that fails returns TD_ETIMEDOUT, TD_EPIPE (the side it
 * needs has gone), TD_ECANCELED (the daemon closed the channel), or
 * TD_EPROTO (the ring is corrupt: it is marked so, and why is in msg). */

/* Takes a FREE slot for end, waiting until deadline; spin_ns spins first. */
int td__ring_loan(td__ring *r, uint32_t end, int64_t deadline, int64_t spin_ns,
                  uint32_t *slot, char *msg, size_t len);
/* Pushes e (a slot end has on loan or holds, or a ticket), waiting while
 * full. */
int td__ring_push(td__ring *r, uint32_t end, const td__ring_entry *e,
                  int64_t deadline, int64_t spin_ns, char *msg, size_t len);
/* Pops the oldest entry, waiting while empty. A slot's entry leaves it HELD
 * by end. The view is checked against slot_bytes for a slot (a ticket's
 * view is checked by the caller, who learns the storage's size). */
int td__ring_pop(td__ring *r, uint32_t end, int64_t deadline, int64_t spin_ns,
                 td__ring_entry *e, char *msg, size_t len);
/* Gives back a slot end has on loan or holds. Returns 0, or TD_EPROTO if
 * it is not end's (someone wrote over it). */
int td__ring_free(td__ring *r, uint32_t end, uint32_t slot);

/* Counts, for listings: what the slot words and head/tail say now. */
typedef struct td__ring_counts {
  uint32_t depth, free, loaned, queued, held;
  uint64_t sent, received;
} td__ring_counts;
void td__ring_count(const td__ring *r, td__ring_counts *out);

/* The daemon's side. */
/* Sets flags (TD__RING_*) in state and wakes everyone. */
void td__ring_set_state(td__ring *r, uint32_t set, uint32_t clear);
/* Whether dead(end, arg) says end is gone. */
typedef int (*td__ring_dead_fn)(uint32_t end, void *arg);
/* Takes the lock if it is free or held by a dead end, and puts the ring
 * right after the dead: every slot a dead end had (on loan, held, or half
 * pushed or popped) is FREE again, every slot in the ring QUEUED. Returns
 * the slots freed (>= 0), TD_EBUSY if a live end holds the lock (try again
 * soon), or TD_EPROTO with msg if the ring is corrupt. */
int td__ring_repair(td__ring *r, td__ring_dead_fn dead, void *arg, char *msg,
                    size_t len);
/* The end that holds the lock, or 0. */
uint32_t td__ring_lock_holder(const td__ring *r);

#endif /* TD_COMMON_CHANRING_H */

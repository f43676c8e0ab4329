/* chanring.c: a channel's ring in shared memory (chanring.h). */
#include "chanring.h"

#include "common.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define RELAXED memory_order_relaxed
#define ld(p) atomic_load_explicit((p), RELAXED)
#define st(p, v) atomic_store_explicit((p), (v), RELAXED)

/* Tries at the lock before sleeping on it: a holder keeps it for tens of
 * nanoseconds. */
#define LOCK_SPINS 200

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t td__ring_deadline(int timeout_ms) {
  if (timeout_ms < 0)
    return -1;
  return now_ns() + (int64_t)timeout_ms * 1000000;
}

/* Sleeps while *w is val, until deadline (CLOCK_MONOTONIC, -1: none).
 * Returns 0 (woken, or *w was not val, or a signal), or TD_ETIMEDOUT. The
 * futex is a shared one: the ring is mapped by several processes. */
static int futex_wait(_Atomic uint32_t *w, uint32_t val, int64_t deadline) {
  long rc;
  if (deadline < 0) {
    rc = syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, NULL, NULL, 0);
  } else {
    if (now_ns() >= deadline)
      return TD_ETIMEDOUT;
    struct timespec ts = {(time_t)(deadline / 1000000000),
                          (long)(deadline % 1000000000)};
    rc = syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_BITSET, val, &ts, NULL,
                 FUTEX_BITSET_MATCH_ANY);
  }
  return rc < 0 && errno == ETIMEDOUT ? TD_ETIMEDOUT : 0;
}

static void futex_wake(_Atomic uint32_t *w, int n) {
  syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* ---- geometry ---- */

static size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

static size_t slots_off(void) {
  return round_up(sizeof(td__ring_hdr), 64);
}

static size_t cells_off(uint32_t nslots) {
  return slots_off() + round_up((size_t)nslots * sizeof(uint64_t), 64);
}

size_t td__ring_size(uint32_t capacity, uint32_t nslots) {
  if (capacity == 0 || capacity > TD_CHAN_CAPACITY_MAX ||
      (capacity & (capacity - 1)) != 0 || nslots > TD_CHAN_SLOTS_MAX)
    return 0;
  return round_up(cells_off(nslots) + (size_t)capacity * sizeof(td__ring_cell),
                  4096);
}

int td__ring_attach(td__ring *r, void *base, size_t size, uint32_t capacity,
                    uint32_t nslots, uint64_t slot_bytes) {
  size_t need = td__ring_size(capacity, nslots);
  if (need == 0 || size < need || (nslots > 0 && slot_bytes == 0))
    return TD_EINVAL;
  r->hdr = base;
  r->slots = (_Atomic uint64_t *)((char *)base + slots_off());
  r->cells = (td__ring_cell *)((char *)base + cells_off(nslots));
  r->capacity = capacity;
  r->nslots = nslots;
  r->slot_bytes = slot_bytes;
  r->size = size;
  atomic_init(&r->hint, 0);
  return 0;
}

void td__ring_format(td__ring *r) {
  td__ring_hdr *h = r->hdr;
  st(&h->version, TD__RING_VERSION);
  st(&h->capacity, r->capacity);
  st(&h->nslots, r->nslots);
  st(&h->slot_bytes, r->slot_bytes);
  atomic_store(&h->magic, TD__RING_MAGIC);
}

/* ---- the lock ---- */

static int gone(uint32_t state) {
  return (state & (TD__RING_CORRUPT | TD__RING_CLOSED)) != 0;
}

static int gone_code(uint32_t state) {
  return state & TD__RING_CORRUPT ? TD_EPROTO : TD_ECANCELED;
}

static int gone_msg(uint32_t state, char *msg, size_t len) {
  return td__msg(msg, len, gone_code(state),
                 state & TD__RING_CORRUPT
                     ? "its ring was found corrupt, and it is closed"
                     : "tensord has closed it");
}

/* Takes the lock as end, until deadline. Returns 0, TD_ETIMEDOUT, or the
 * channel's end (gone_code). */
static int lock(td__ring *r, uint32_t end, int64_t deadline, char *msg,
                size_t len) {
  _Atomic uint32_t *l = &r->hdr->lock;
  for (int i = 0; i < LOCK_SPINS; i++) {
    uint32_t z = 0;
    if (ld(l) == 0 && atomic_compare_exchange_weak_explicit(
                          l, &z, end, memory_order_acquire, RELAXED))
      return 0;
    cpu_relax();
  }
  for (;;) {
    uint32_t s = atomic_load(&r->hdr->state);
    if (gone(s))
      return gone_msg(s, msg, len);
    uint32_t v = atomic_load(l);
    if ((v & ~TD__LOCK_SLEEPERS) == 0) {
      /* Free: 0, or the sleepers bit alone (which no unlock leaves, but an
       * end may write; it names no holder that tensord could free it of).
       * Taken with the sleepers bit: others may still sleep on it. */
      if (atomic_compare_exchange_strong(l, &v, end | TD__LOCK_SLEEPERS))
        return 0;
      continue;
    }
    if (!(v & TD__LOCK_SLEEPERS) &&
        !atomic_compare_exchange_strong(l, &v, v | TD__LOCK_SLEEPERS))
      continue;
    if (futex_wait(l, v | TD__LOCK_SLEEPERS, deadline) == TD_ETIMEDOUT)
      return td__msg(msg, len, TD_ETIMEDOUT,
                     "its ring stayed locked by end %u",
                     (unsigned)(v & ~TD__LOCK_SLEEPERS));
  }
}

static void unlock(td__ring *r) {
  uint32_t v = atomic_exchange_explicit(&r->hdr->lock, 0, memory_order_release);
  if (v & TD__LOCK_SLEEPERS)
    futex_wake(&r->hdr->lock, 1);
}

uint32_t td__ring_lock_holder(const td__ring *r) {
  return atomic_load(&((td__ring *)r)->hdr->lock) & ~TD__LOCK_SLEEPERS;
}

/* Bumps a counter and wakes n of its sleepers, if any sleep. */
static void bump(_Atomic uint32_t *counter, _Atomic uint32_t *sleepers, int n) {
  atomic_fetch_add(counter, 1);
  if (atomic_load(sleepers) != 0)
    futex_wake(counter, n);
}

static void wake_all(td__ring *r) {
  td__ring_hdr *h = r->hdr;
  atomic_fetch_add(&h->items, 1);
  atomic_fetch_add(&h->space, 1);
  atomic_fetch_add(&h->freed, 1);
  futex_wake(&h->items, INT_MAX);
  futex_wake(&h->space, INT_MAX);
  futex_wake(&h->freed, INT_MAX);
  futex_wake(&h->lock, INT_MAX);
}

/* Marks the ring corrupt (lock held, released here) and wakes everyone.
 * Returns TD_EPROTO with msg. */
static int corrupt(td__ring *r, int locked, char *msg, size_t len,
                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int corrupt(td__ring *r, int locked, char *msg, size_t len,
                   const char *fmt, ...) {
  char why[200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof(why), fmt, ap);
  va_end(ap);
  atomic_fetch_or(&r->hdr->state, TD__RING_CORRUPT);
  if (locked)
    unlock(r);
  wake_all(r);
  return td__msg(msg, len, TD_EPROTO, "corrupt ring (%s); it is closed", why);
}

/* Waits for counter to move from seq (spinning spin_ns first), until
 * deadline. Returns 0 or TD_ETIMEDOUT. */
static int wait_for(_Atomic uint32_t *counter, _Atomic uint32_t *sleepers,
                    uint32_t seq, int64_t deadline, int64_t spin_ns) {
  if (spin_ns > 0) {
    int64_t until = now_ns() + spin_ns;
    for (unsigned i = 1;; i++) {
      if (atomic_load(counter) != seq)
        return 0;
      cpu_relax();
      if (i % 64 == 0 && now_ns() >= until)
        break;
    }
  }
  /* Counted as a sleeper before the last look, so a bump after that look
   * sees us and wakes us (both sides are sequentially consistent). */
  atomic_fetch_add(sleepers, 1);
  int err = 0;
  if (atomic_load(counter) == seq)
    err = futex_wait(counter, seq, deadline);
  atomic_fetch_sub(sleepers, 1);
  return err;
}

static int timed_out(char *msg, size_t len, const char *what) {
  return td__msg(msg, len, TD_ETIMEDOUT, "%s", what);
}

/* ---- the ends' operations ---- */

int td__ring_loan(td__ring *r, uint32_t end, int64_t deadline, int64_t spin_ns,
                  uint32_t *slot, char *msg, size_t len) {
  td__ring_hdr *h = r->hdr;
  if (r->nslots == 0)
    return td__msg(msg, len, TD_ENOENT, "it has no slots to loan");
  for (;;) {
    uint32_t s = atomic_load(&h->state);
    if (gone(s))
      return gone_msg(s, msg, len);
    if (s & TD__RING_NO_RECEIVERS)
      return td__msg(msg, len, TD_EPIPE, "every receiver has left");
    uint32_t seq = atomic_load(&h->freed);
    uint32_t start = ld(&r->hint) % r->nslots;
    for (uint32_t i = 0; i < r->nslots; i++) {
      uint32_t j = (start + i) % r->nslots;
      uint64_t w = 0;
      if (ld(&r->slots[j]) == 0 &&
          atomic_compare_exchange_strong(&r->slots[j], &w,
                                         TD__SLOT_WORD(TD__SLOT_LOANED, end))) {
        st(&r->hint, j);
        *slot = j;
        return 0;
      }
    }
    if (wait_for(&h->freed, &h->freed_sleepers, seq, deadline, spin_ns) < 0)
      return timed_out(msg, len, "no slot came free");
  }
}

static void write_cell(td__ring_cell *c, const td__ring_entry *e) {
  st(&c->kind, e->kind);
  st(&c->slot, e->slot);
  st(&c->ticket, e->ticket);
  st(&c->dtype, (int32_t)e->view.dtype);
  st(&c->ndim, e->view.ndim);
  st(&c->offset, e->view.offset);
  for (int i = 0; i < e->view.ndim && i < TD_MAX_DIMS; i++) {
    st(&c->shape[i], e->view.shape[i]);
    st(&c->stride[i], e->view.stride[i]);
  }
}

/* Reads a cell once into e and checks what can be checked without the
 * storage: kind, slot index, the view's form (and its extent for a slot).
 * Returns 0 or TD_EPROTO with why. */
static int read_cell(const td__ring *r, td__ring_cell *c, td__ring_entry *e,
                     char *why, size_t len) {
  memset(e, 0, sizeof(*e));
  e->kind = ld(&c->kind);
  e->slot = ld(&c->slot);
  e->ticket = ld(&c->ticket);
  e->view.dtype = (td_dtype)ld(&c->dtype);
  e->view.ndim = ld(&c->ndim);
  e->view.offset = ld(&c->offset);
  if (e->view.ndim < 0 || e->view.ndim > TD_MAX_DIMS)
    return td__msg(why, len, TD_EPROTO, "a view of %d dimensions",
                   (int)e->view.ndim);
  for (int i = 0; i < e->view.ndim; i++) {
    e->view.shape[i] = ld(&c->shape[i]);
    e->view.stride[i] = ld(&c->stride[i]);
  }
  if (e->kind == TD__CELL_SLOT) {
    if (e->slot >= r->nslots)
      return td__msg(why, len, TD_EPROTO, "slot %u of %u", (unsigned)e->slot,
                     (unsigned)r->nslots);
    if (td_view_check(&e->view, r->slot_bytes) < 0)
      return td__msg(why, len, TD_EPROTO, "a view of slot %u: %s",
                     (unsigned)e->slot, td_view_last_error());
    return 0;
  }
  if (e->kind == TD__CELL_STORAGE) {
    if (e->ticket == 0)
      return td__msg(why, len, TD_EPROTO, "ticket 0");
    return 0;
  }
  return td__msg(why, len, TD_EPROTO, "an entry of kind %u", (unsigned)e->kind);
}

int td__ring_push(td__ring *r, uint32_t end, const td__ring_entry *e,
                  int64_t deadline, int64_t spin_ns, char *msg, size_t len) {
  td__ring_hdr *h = r->hdr;
  if (e->kind == TD__CELL_SLOT && e->slot >= r->nslots)
    return td__msg(msg, len, TD_EINVAL, "slot %u of %u", (unsigned)e->slot,
                   (unsigned)r->nslots);
  for (;;) {
    int err = lock(r, end, deadline, msg, len);
    if (err < 0)
      return err;
    uint32_t s = atomic_load(&h->state);
    if (gone(s)) {
      unlock(r);
      return gone_msg(s, msg, len);
    }
    if (s & TD__RING_NO_RECEIVERS) {
      unlock(r);
      return td__msg(msg, len, TD_EPIPE, "every receiver has left");
    }
    uint64_t head = ld(&h->head), tail = ld(&h->tail);
    if (tail - head > r->capacity)
      return corrupt(r, 1, msg, len, "%llu entries in a ring of %u",
                     (unsigned long long)(tail - head), (unsigned)r->capacity);
    if (tail - head < r->capacity) {
      if (e->kind == TD__CELL_SLOT) {
        uint64_t w = ld(&r->slots[e->slot]);
        if (TD__SLOT_END(w) != end || (TD__SLOT_STATE(w) != TD__SLOT_LOANED &&
                                       TD__SLOT_STATE(w) != TD__SLOT_HELD))
          return corrupt(r, 1, msg, len,
                         "slot %u, on loan to end %u, reads 0x%llx",
                         (unsigned)e->slot, (unsigned)end,
                         (unsigned long long)w);
      }
      write_cell(&r->cells[tail & (r->capacity - 1)], e);
      /* QUEUED before the tail moves: an end that dies in between leaves
       * a QUEUED slot outside the ring, which the repair frees. */
      if (e->kind == TD__CELL_SLOT)
        st(&r->slots[e->slot], TD__SLOT_WORD(TD__SLOT_QUEUED, 0));
      st(&h->tail, tail + 1);
      unlock(r);
      bump(&h->items, &h->items_sleepers, 1);
      return 0;
    }
    uint32_t seq = atomic_load(&h->space);
    unlock(r);
    if (wait_for(&h->space, &h->space_sleepers, seq, deadline, spin_ns) < 0)
      return timed_out(msg, len, "its ring stayed full");
  }
}

int td__ring_pop(td__ring *r, uint32_t end, int64_t deadline, int64_t spin_ns,
                 td__ring_entry *e, char *msg, size_t len) {
  td__ring_hdr *h = r->hdr;
  for (;;) {
    /* Nothing to take: wait without the lock (a spinning receiver must not
     * take the lock from the sender it waits for). */
    uint32_t seq = atomic_load(&h->items);
    uint32_t s = atomic_load(&h->state);
    if (gone(s))
      return gone_msg(s, msg, len);
    if (ld(&h->head) == ld(&h->tail) && !(s & TD__RING_NO_SENDERS)) {
      if (wait_for(&h->items, &h->items_sleepers, seq, deadline, spin_ns) < 0)
        return timed_out(msg, len, "nothing came");
      continue;
    }
    int err = lock(r, end, deadline, msg, len);
    if (err < 0)
      return err;
    uint64_t head = ld(&h->head), tail = ld(&h->tail);
    if (tail - head > r->capacity)
      return corrupt(r, 1, msg, len, "%llu entries in a ring of %u",
                     (unsigned long long)(tail - head), (unsigned)r->capacity);
    if (head == tail) {
      s = atomic_load(&h->state);
      unlock(r);
      if (s & TD__RING_NO_SENDERS)
        return td__msg(msg, len, TD_EPIPE, "every sender has left");
      continue;
    }
    char why[160];
    if (read_cell(r, &r->cells[head & (r->capacity - 1)], e, why,
                  sizeof(why)) < 0)
      return corrupt(r, 1, msg, len, "entry %llu: %s", (unsigned long long)head,
                     why);
    if (e->kind == TD__CELL_SLOT) {
      uint64_t w = ld(&r->slots[e->slot]);
      if (TD__SLOT_STATE(w) != TD__SLOT_QUEUED)
        return corrupt(r, 1, msg, len,
                       "entry %llu names slot %u, which reads 0x%llx, not "
                       "queued",
                       (unsigned long long)head, (unsigned)e->slot,
                       (unsigned long long)w);
    }
    st(&h->head, head + 1);
    /* HELD after the head moves: see td__ring_push. */
    if (e->kind == TD__CELL_SLOT)
      st(&r->slots[e->slot], TD__SLOT_WORD(TD__SLOT_HELD, end));
    unlock(r);
    bump(&h->space, &h->space_sleepers, 1);
    return 0;
  }
}

int td__ring_free(td__ring *r, uint32_t end, uint32_t slot) {
  if (slot >= r->nslots)
    return TD_EINVAL;
  uint64_t w = ld(&r->slots[slot]);
  if (TD__SLOT_END(w) != end || (TD__SLOT_STATE(w) != TD__SLOT_LOANED &&
                                 TD__SLOT_STATE(w) != TD__SLOT_HELD) ||
      !atomic_compare_exchange_strong(&r->slots[slot], &w, 0))
    return TD_EPROTO;
  bump(&r->hdr->freed, &r->hdr->freed_sleepers, 1);
  return 0;
}

void td__ring_count(const td__ring *r, td__ring_counts *out) {
  td__ring_hdr *h = r->hdr;
  memset(out, 0, sizeof(*out));
  out->received = ld(&h->head);
  out->sent = ld(&h->tail);
  uint64_t d = out->sent - out->received;
  out->depth = d > r->capacity ? r->capacity : (uint32_t)d;
  for (uint32_t i = 0; i < r->nslots; i++) {
    switch (TD__SLOT_STATE(ld(&r->slots[i]))) {
    case TD__SLOT_FREE:
      out->free++;
      break;
    case TD__SLOT_LOANED:
      out->loaned++;
      break;
    case TD__SLOT_QUEUED:
      out->queued++;
      break;
    case TD__SLOT_HELD:
      out->held++;
      break;
    default:
      break;
    }
  }
}

/* ---- the daemon's side ---- */

void td__ring_set_state(td__ring *r, uint32_t set, uint32_t clear) {
  uint32_t s = atomic_load(&r->hdr->state), n;
  do
    n = (s | set) & ~clear;
  while (!atomic_compare_exchange_weak(&r->hdr->state, &s, n));
  wake_all(r);
}

int td__ring_repair(td__ring *r, td__ring_dead_fn dead, void *arg, char *msg,
                    size_t len) {
  td__ring_hdr *h = r->hdr;
  _Atomic uint32_t *l = &h->lock;
  uint32_t v = atomic_load(l);
  uint32_t holder = v & ~TD__LOCK_SLEEPERS;
  if (holder != 0 && (holder == TD__END_DAEMON || !dead(holder, arg)))
    return TD_EBUSY;
  if (!atomic_compare_exchange_strong(l, &v,
                                      TD__END_DAEMON | (v & TD__LOCK_SLEEPERS)))
    return TD_EBUSY;
  uint64_t head = ld(&h->head), tail = ld(&h->tail);
  if (tail - head > r->capacity)
    return corrupt(r, 1, msg, len, "%llu entries in a ring of %u",
                   (unsigned long long)(tail - head), (unsigned)r->capacity);
  uint8_t *in = calloc(r->nslots + 1, 1);
  if (in == NULL) {
    unlock(r);
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  }
  for (uint64_t p = head; p != tail; p++) {
    td__ring_cell *c = &r->cells[p & (r->capacity - 1)];
    uint32_t kind = ld(&c->kind), slot = ld(&c->slot);
    if (kind == TD__CELL_STORAGE)
      continue;
    if (kind != TD__CELL_SLOT || slot >= r->nslots || in[slot]) {
      free(in);
      return corrupt(r, 1, msg, len, "entry %llu: kind %u, slot %u",
                     (unsigned long long)p, (unsigned)kind, (unsigned)slot);
    }
    in[slot] = 1;
  }
  int freed = 0;
  for (uint32_t i = 0; i < r->nslots; i++) {
    uint64_t w = ld(&r->slots[i]);
    unsigned state = TD__SLOT_STATE(w);
    if (in[i]) {
      if (state != TD__SLOT_QUEUED)
        atomic_compare_exchange_strong(&r->slots[i], &w,
                                       TD__SLOT_WORD(TD__SLOT_QUEUED, 0));
    } else if (state == TD__SLOT_QUEUED ||
               ((state == TD__SLOT_LOANED || state == TD__SLOT_HELD) &&
                dead(TD__SLOT_END(w), arg))) {
      if (atomic_compare_exchange_strong(&r->slots[i], &w, 0))
        freed++;
    }
  }
  free(in);
  unlock(r);
  if (freed > 0) {
    atomic_fetch_add(&h->freed, 1);
    futex_wake(&h->freed, INT_MAX);
  }
  return freed;
}

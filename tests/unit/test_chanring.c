/* test_chanring.c: a channel's ring (common/chanring.c) in one process:
 * loans, pushes, pops and frees; waits that time out; the daemon's repair
 * after ends that died at every step of a push and a pop; and garbage
 * that must be caught before it is used. */
#include "chanring.h"

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#define CAP 4
#define SLOTS 3
#define SLOT_BYTES 4096

static td__ring r;
static void *mem;

static void setup(void) {
  size_t size = td__ring_size(CAP, SLOTS);
  cr_assert(size > 0);
  mem = aligned_alloc(4096, size);
  memset(mem, 0, size);
  cr_assert_eq(td__ring_attach(&r, mem, size, CAP, SLOTS, SLOT_BYTES), 0);
  td__ring_format(&r);
}

static void teardown(void) {
  free(mem);
}

TestSuite(chanring, .init = setup, .fini = teardown);

static td__ring_entry slot_entry(uint32_t slot, int64_t n) {
  td__ring_entry e = {.kind = TD__CELL_SLOT, .slot = slot};
  int64_t shape[1] = {n};
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape, &e.view), 0);
  return e;
}

static char msg[256];

static int dead_set[8];
static int is_dead(uint32_t end, void *arg) {
  (void)arg;
  return end < 8 && dead_set[end];
}

Test(chanring, geometry) {
  cr_assert_eq(td__ring_size(0, 1), 0);
  cr_assert_eq(td__ring_size(3, 1), 0); /* not a power of two */
  cr_assert_eq(td__ring_size(TD_CHAN_CAPACITY_MAX * 2, 1), 0);
  cr_assert_eq(td__ring_size(1, TD_CHAN_SLOTS_MAX + 1), 0);
  cr_assert_eq(td__ring_size(1, 0) % 4096, 0);
  td__ring x;
  cr_assert_eq(td__ring_attach(&x, mem, 100, CAP, SLOTS, SLOT_BYTES),
               TD_EINVAL);
  cr_assert_eq(td__ring_attach(&x, mem, td__ring_size(CAP, SLOTS), CAP, SLOTS,
                               0),
               TD_EINVAL);
}

Test(chanring, loan_push_pop_free) {
  uint32_t a, b, c, d;
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &a, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &b, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &c, msg, sizeof(msg)), 0);
  cr_assert(a != b && b != c && a != c);
  /* No slot left: a loan that may not wait times out at once. */
  cr_assert_eq(td__ring_loan(&r, 1, td__ring_deadline(0), 0, &d, msg,
                             sizeof(msg)),
               TD_ETIMEDOUT);
  td__ring_entry e = slot_entry(b, 100);
  cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), 0, "%s", msg);
  td__ring_counts n;
  td__ring_count(&r, &n);
  cr_assert_eq(n.depth, 1);
  cr_assert_eq(n.loaned, 2);
  cr_assert_eq(n.queued, 1);
  td__ring_entry got;
  cr_assert_eq(td__ring_pop(&r, 2, -1, 0, &got, msg, sizeof(msg)), 0, "%s",
               msg);
  cr_assert_eq(got.kind, TD__CELL_SLOT);
  cr_assert_eq(got.slot, b);
  cr_assert_eq(got.view.shape[0], 100);
  /* Held by end 2 now: only end 2 frees it. */
  cr_assert_eq(td__ring_free(&r, 1, b), TD_EPROTO);
  cr_assert_eq(td__ring_free(&r, 2, b), 0);
  cr_assert_eq(td__ring_free(&r, 2, b), TD_EPROTO); /* twice */
  cr_assert_eq(td__ring_free(&r, 1, a), 0);
  cr_assert_eq(td__ring_free(&r, 1, c), 0);
  td__ring_count(&r, &n);
  cr_assert_eq(n.free, SLOTS);
  cr_assert_eq(n.sent, 1);
  cr_assert_eq(n.received, 1);
  /* Empty: a pop that may not wait times out. */
  cr_assert_eq(td__ring_pop(&r, 2, td__ring_deadline(0), 0, &got, msg,
                            sizeof(msg)),
               TD_ETIMEDOUT);
  /* A short spin first, then the same. */
  cr_assert_eq(td__ring_pop(&r, 2, td__ring_deadline(2), 1000, &got, msg,
                            sizeof(msg)),
               TD_ETIMEDOUT);
}

Test(chanring, fifo_and_full) {
  for (uint64_t t = 1; t <= CAP; t++) {
    td__ring_entry e = {.kind = TD__CELL_STORAGE, .ticket = t};
    cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), 0);
  }
  td__ring_entry e = {.kind = TD__CELL_STORAGE, .ticket = 99};
  cr_assert_eq(td__ring_push(&r, 1, &e, td__ring_deadline(1), 0, msg,
                             sizeof(msg)),
               TD_ETIMEDOUT);
  for (uint64_t t = 1; t <= CAP; t++) {
    td__ring_entry got;
    cr_assert_eq(td__ring_pop(&r, 2, -1, 0, &got, msg, sizeof(msg)), 0);
    cr_assert_eq(got.ticket, t);
  }
}

Test(chanring, sides_gone) {
  td__ring_set_state(&r, TD__RING_NO_RECEIVERS, 0);
  uint32_t s;
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s, msg, sizeof(msg)), TD_EPIPE);
  td__ring_entry e = {.kind = TD__CELL_STORAGE, .ticket = 1};
  cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), TD_EPIPE);
  td__ring_set_state(&r, 0, TD__RING_NO_RECEIVERS);
  cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), 0);
  /* Senders gone: what is in the ring still comes, then EPIPE. */
  td__ring_set_state(&r, TD__RING_NO_SENDERS, 0);
  td__ring_entry got;
  cr_assert_eq(td__ring_pop(&r, 2, -1, 0, &got, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_pop(&r, 2, -1, 0, &got, msg, sizeof(msg)), TD_EPIPE);
  td__ring_set_state(&r, TD__RING_CLOSED, 0);
  cr_assert_eq(td__ring_pop(&r, 2, -1, 0, &got, msg, sizeof(msg)),
               TD_ECANCELED);
}

/* An end that dies while holding the lock mid-push: after the cell is
 * written and the slot marked queued, before the tail moves. The repair
 * takes the lock over and frees the slot; nothing half-pushed is seen. */
Test(chanring, repair_after_death_mid_push) {
  uint32_t s;
  cr_assert_eq(td__ring_loan(&r, 3, -1, 0, &s, msg, sizeof(msg)), 0);
  atomic_store(&r.hdr->lock, 3);
  td__ring_entry e = slot_entry(s, 10);
  atomic_store(&r.cells[0].kind, e.kind);
  atomic_store(&r.cells[0].slot, s);
  atomic_store(&r.slots[s], TD__SLOT_WORD(TD__SLOT_QUEUED, 0));
  /* Alive: the repair must wait for it. */
  memset(dead_set, 0, sizeof(dead_set));
  cr_assert_eq(td__ring_repair(&r, is_dead, NULL, msg, sizeof(msg)), TD_EBUSY);
  dead_set[3] = 1;
  cr_assert_eq(td__ring_repair(&r, is_dead, NULL, msg, sizeof(msg)), 1);
  cr_assert_eq(td__ring_lock_holder(&r), 0);
  td__ring_counts n;
  td__ring_count(&r, &n);
  cr_assert_eq(n.free, SLOTS);
  cr_assert_eq(n.depth, 0);
  /* The ring works on. */
  cr_assert_eq(td__ring_loan(&r, 4, -1, 0, &s, msg, sizeof(msg)), 0);
  e = slot_entry(s, 10);
  cr_assert_eq(td__ring_push(&r, 4, &e, -1, 0, msg, sizeof(msg)), 0);
}

/* Dies after the tail moved: the entry is in the ring and stays. */
Test(chanring, repair_keeps_what_was_pushed) {
  uint32_t s;
  cr_assert_eq(td__ring_loan(&r, 3, -1, 0, &s, msg, sizeof(msg)), 0);
  td__ring_entry e = slot_entry(s, 10);
  cr_assert_eq(td__ring_push(&r, 3, &e, -1, 0, msg, sizeof(msg)), 0);
  atomic_store(&r.hdr->lock, 3); /* and took the lock again, then died */
  memset(dead_set, 0, sizeof(dead_set));
  dead_set[3] = 1;
  cr_assert_eq(td__ring_repair(&r, is_dead, NULL, msg, sizeof(msg)), 0);
  td__ring_entry got;
  cr_assert_eq(td__ring_pop(&r, 4, -1, 0, &got, msg, sizeof(msg)), 0);
  cr_assert_eq(got.slot, s);
}

/* A receiver that dies after moving the head, before marking the slot
 * held; another that dies holding two received slots. */
Test(chanring, repair_after_dead_receivers) {
  uint32_t s1, s2, s3;
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s1, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s2, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s3, msg, sizeof(msg)), 0);
  td__ring_entry e1 = slot_entry(s1, 1), e2 = slot_entry(s2, 1),
                 e3 = slot_entry(s3, 1);
  cr_assert_eq(td__ring_push(&r, 1, &e1, -1, 0, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_push(&r, 1, &e2, -1, 0, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_push(&r, 1, &e3, -1, 0, msg, sizeof(msg)), 0);
  td__ring_entry got;
  cr_assert_eq(td__ring_pop(&r, 5, -1, 0, &got, msg, sizeof(msg)), 0);
  cr_assert_eq(td__ring_pop(&r, 5, -1, 0, &got, msg, sizeof(msg)), 0);
  /* End 6 takes the lock, moves the head, dies. */
  atomic_store(&r.hdr->lock, 6);
  atomic_store(&r.hdr->head, atomic_load(&r.hdr->head) + 1);
  memset(dead_set, 0, sizeof(dead_set));
  dead_set[5] = dead_set[6] = 1;
  cr_assert_eq(td__ring_repair(&r, is_dead, NULL, msg, sizeof(msg)), 3);
  td__ring_counts n;
  td__ring_count(&r, &n);
  cr_assert_eq(n.free, SLOTS);
  cr_assert_eq(n.depth, 0);
}

/* Garbage: each is caught before it is used, and closes the ring. */
static void expect_corrupt_pop(void) {
  td__ring_entry got;
  int err = td__ring_pop(&r, 2, td__ring_deadline(100), 0, &got, msg,
                         sizeof(msg));
  cr_assert_eq(err, TD_EPROTO, "%d: %s", err, msg);
  cr_assert(strstr(msg, "corrupt ring") != NULL, "%s", msg);
  cr_assert(atomic_load(&r.hdr->state) & TD__RING_CORRUPT);
  /* Everyone's next call says so too. */
  uint32_t s;
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s, msg, sizeof(msg)), TD_EPROTO);
}

static void push_one(void) {
  uint32_t s;
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s, msg, sizeof(msg)), 0);
  td__ring_entry e = slot_entry(s, 10);
  cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), 0);
}

Test(chanring, garbage_slot_index) {
  push_one();
  atomic_store(&r.cells[0].slot, 4096);
  expect_corrupt_pop();
}

Test(chanring, garbage_view_past_the_slot) {
  push_one();
  atomic_store(&r.cells[0].offset, SLOT_BYTES - 5);
  expect_corrupt_pop();
}

Test(chanring, garbage_ndim) {
  push_one();
  atomic_store(&r.cells[0].ndim, 1000);
  expect_corrupt_pop();
}

Test(chanring, garbage_kind) {
  push_one();
  atomic_store(&r.cells[0].kind, 77);
  expect_corrupt_pop();
}

Test(chanring, garbage_head_tail) {
  push_one();
  atomic_store(&r.hdr->tail, 1000000);
  expect_corrupt_pop();
}

Test(chanring, garbage_slot_state) {
  push_one();
  uint32_t s = atomic_load(&r.cells[0].slot);
  atomic_store(&r.slots[s], 0); /* "free" while in the ring */
  expect_corrupt_pop();
}

Test(chanring, garbage_ticket_zero) {
  td__ring_entry e = {.kind = TD__CELL_STORAGE, .ticket = 5};
  cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), 0);
  atomic_store(&r.cells[0].ticket, 0);
  expect_corrupt_pop();
}

/* A loaned slot someone else marked as theirs cannot be pushed. */
Test(chanring, garbage_stolen_loan) {
  uint32_t s;
  cr_assert_eq(td__ring_loan(&r, 1, -1, 0, &s, msg, sizeof(msg)), 0);
  atomic_store(&r.slots[s], TD__SLOT_WORD(TD__SLOT_LOANED, 9));
  td__ring_entry e = slot_entry(s, 10);
  cr_assert_eq(td__ring_push(&r, 1, &e, -1, 0, msg, sizeof(msg)), TD_EPROTO);
}

/* A repair that finds the ring corrupt says so and marks it. */
Test(chanring, repair_finds_garbage) {
  push_one();
  atomic_store(&r.cells[0].slot, 9999);
  memset(dead_set, 0, sizeof(dead_set));
  dead_set[1] = 1;
  cr_assert_eq(td__ring_repair(&r, is_dead, NULL, msg, sizeof(msg)),
               TD_EPROTO);
  cr_assert(atomic_load(&r.hdr->state) & TD__RING_CORRUPT);
  cr_assert_eq(td__ring_lock_holder(&r), 0);
}

/* A lock held by someone (alive) makes a waiting push time out, not
 * hang. */
Test(chanring, held_lock_times_out) {
  atomic_store(&r.hdr->lock, 7);
  td__ring_entry e = {.kind = TD__CELL_STORAGE, .ticket = 1};
  cr_assert_eq(td__ring_push(&r, 1, &e, td__ring_deadline(20), 0, msg,
                             sizeof(msg)),
               TD_ETIMEDOUT);
  cr_assert(strstr(msg, "locked by end 7") != NULL, "%s", msg);
}

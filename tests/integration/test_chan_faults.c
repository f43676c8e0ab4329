/* test_chan_faults.c: channels under faults: ends SIGKILLed at every step
 * (between loan and send, holding received slots, in the middle of a push
 * or a pop), garbage written into a ring by a process that may map it, ends
 * of other uids, and the references tensord keeps through all of it. */
#include "harness.h"
#include "seed.h"

#include "chanring.h"

#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <grp.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

TestSuite(chan_faults, .init = setup, .fini = tdt_cleanup, .timeout = 180);

#define SLOT_BYTES 4096
/* What a call may take past its own timeout on a loaded machine (the
 * suite at -j, ASan) before it counts as a hang. */
#define SLACK_MS 2000

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static td_view bytes_view(int64_t n) {
  td_view v = {0};
  int64_t shape[1] = {n};
  td_view_contiguous(TD_UINT8, 1, shape, &v);
  return v;
}

/* A slot's bytes for an entry tagged tag: the tag in the first 8, then a
 * pattern of it, so that a byte out of place is seen. */
static void fill(void *p, size_t n, uint64_t tag) {
  uint8_t *b = p;
  memcpy(b, &tag, sizeof(tag));
  for (size_t i = sizeof(tag); i < n; i++)
    b[i] = (uint8_t)(tag * 131 + i * 7);
}

static uint64_t tag_of(const td_storage *s) {
  uint64_t t;
  memcpy(&t, td_storage_data((td_storage *)s), sizeof(t));
  return t;
}

static int filled(const td_storage *s, uint64_t tag) {
  const uint8_t *b = td_storage_data((td_storage *)s);
  if (tag_of(s) != tag)
    return 0;
  for (size_t i = sizeof(tag); i < td_storage_nbytes(s); i++)
    if (b[i] != (uint8_t)(tag * 131 + i * 7))
      return 0;
  return 1;
}

/* ---- the ring, as a process that opened the channel maps it ---- */

/* The channel rings this process maps now: their start addresses. */
typedef struct ringmaps {
  int n;
  uintptr_t lo[64], hi[64];
} ringmaps;

static void rings_now(ringmaps *m) {
  m->n = 0;
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  while (f != NULL && fgets(line, sizeof(line), f) && m->n < 64) {
    unsigned long lo, hi;
    if (strstr(line, "/memfd:tensord-chan") == NULL ||
        sscanf(line, "%lx-%lx", &lo, &hi) != 2)
      continue;
    m->lo[m->n] = lo;
    m->hi[m->n++] = hi;
  }
  if (f != NULL)
    fclose(f);
}

/* Points r at the ring this process mapped since before was taken (the
 * channel it opened since: a fork's child also has its parent's), for a
 * channel of that geometry. Returns 0, or -1 unless exactly one is new. */
static int ring_since(const ringmaps *before, td__ring *r, uint32_t capacity,
                      uint32_t nslots) {
  ringmaps now;
  rings_now(&now);
  int found = -1, n = 0;
  for (int i = 0; i < now.n; i++) {
    int old = 0;
    for (int j = 0; j < before->n && !old; j++)
      old = before->lo[j] == now.lo[i];
    if (!old) {
      found = i;
      n++;
    }
  }
  if (n != 1)
    return -1;
  return td__ring_attach(r, (void *)now.lo[found],
                         now.hi[found] - now.lo[found], capacity, nslots,
                         SLOT_BYTES) == 0
             ? 0
             : -1;
}

/* Creates name as o says and maps its ring into r. */
static int create_ring(td_client *c, const char *name, const td_chan_opts *o,
                       td_chan **ch, td__ring *r) {
  ringmaps before;
  rings_now(&before);
  int err = td_chan_create(c, name, o, ch);
  if (err < 0)
    return err;
  return ring_since(&before, r, o->capacity, o->slots);
}

/* Opens name, a channel of that geometry, and maps its ring into r. */
static int open_ring(td_client *c, const char *name, unsigned flags,
                     uint32_t capacity, uint32_t nslots, td_chan **ch,
                     td__ring *r) {
  ringmaps before;
  rings_now(&before);
  int err = td_chan_open(c, name, flags, 5000, ch);
  if (err < 0)
    return err;
  return ring_since(&before, r, capacity, nslots);
}

/* ---- waiting for events ---- */

/* Counts of a channel (td_chan_stat) to wait for; -1: any. */
typedef struct counts {
  int free, loaned, queued, held, senders, receivers;
} counts;

static td_chan *poll_ch;
static counts poll_want;

static int counts_match(const tdt_daemon *unused) {
  (void)unused;
  td_chan_info i;
  td_chan_stat(poll_ch, &i);
  const counts *w = &poll_want;
  return (w->free < 0 || i.slots_free == (uint32_t)w->free) &&
         (w->loaned < 0 || i.slots_loaned == (uint32_t)w->loaned) &&
         (w->queued < 0 || i.slots_queued == (uint32_t)w->queued) &&
         (w->held < 0 || i.slots_held == (uint32_t)w->held) &&
         (w->senders < 0 || i.senders == (uint32_t)w->senders) &&
         (w->receivers < 0 || i.receivers == (uint32_t)w->receivers);
}

/* Waits until ch's counts read want; returns whether they came to. */
static int await_counts(td_chan *ch, counts want) {
  poll_ch = ch;
  poll_want = want;
  return tdt_until(counts_match, &d, 10000);
}

static _Atomic uint32_t *poll_word;
static uint32_t poll_mask;

static int word_set(const tdt_daemon *unused) {
  (void)unused;
  return (atomic_load(poll_word) & poll_mask) != 0;
}

/* Waits until *w has a bit of mask (a sleeper counted, a lock's sleepers
 * bit); returns whether it came. */
static int await_bits(_Atomic uint32_t *w, uint32_t mask) {
  poll_word = w;
  poll_mask = mask;
  return tdt_until(word_set, &d, 10000);
}

/* A receive on another thread, to be woken by what the test does. */
typedef struct blocked {
  pthread_t t;
  td_client *c;
  td_chan *ch;
  int timeout_ms;
  int err;
  int64_t ms;
  char msg[512];
} blocked;

static void *recv_blocked(void *p) {
  blocked *b = p;
  int64_t t0 = now_ms();
  td_storage *s = NULL;
  td_view v;
  b->err = td_chan_recv(b->ch, b->timeout_ms, &s, &v);
  b->ms = now_ms() - t0;
  snprintf(b->msg, sizeof(b->msg), "%s", b->err ? td_last_error(b->c) : "");
  td_storage_release(s);
  return NULL;
}

static void block_recv(blocked *b, td_client *c, td_chan *ch, int timeout_ms) {
  b->c = c;
  b->ch = ch;
  b->timeout_ms = timeout_ms;
  cr_assert_eq(pthread_create(&b->t, NULL, recv_blocked, b), 0);
}

/* ---- what the daemon lists ---- */

typedef struct listed {
  int found;
  td_chan_info info;
  size_t nends;
  td_chan_end_info ends[8];
  uint64_t slot_ids[8];
} listed;

static const char *list_name;

static int list_cb(const td_chan_info *info, void *arg) {
  listed *l = arg;
  if (strcmp(info->name, list_name) != 0)
    return 0;
  l->found = 1;
  l->info = *info;
  l->info.name = NULL;
  l->nends = info->nends < 8 ? info->nends : 8;
  for (size_t i = 0; i < l->nends; i++) {
    l->ends[i] = info->ends[i];
    l->ends[i].name = NULL;
  }
  for (size_t i = 0; i < info->nslot_ids && i < 8; i++)
    l->slot_ids[i] = info->slot_ids[i];
  l->info.ends = NULL;
  l->info.slot_ids = NULL;
  return 0;
}

/* What tensord lists of channel name (found 0 if none). */
static listed chan_listed(td_client *c, const char *name) {
  listed l = {0};
  list_name = name;
  int err = td_chan_list(c, list_cb, &l);
  if (err != 0)
    fprintf(stderr, "td_chan_list: %s\n", td_last_error(c));
  return l;
}

/* The end of pid in l, or NULL. */
static const td_chan_end_info *end_of(const listed *l, pid_t pid) {
  for (size_t i = 0; i < l->nends; i++)
    if (l->ends[i].pid == pid)
      return &l->ends[i];
  return NULL;
}

/* ---- children ---- */

/* What a sender child does. */
typedef struct sender_job {
  const char *name;
  uint64_t tag0;     /* the first entry's tag; the next ones count up */
  int n;             /* entries to send */
  int plain_every;   /* every k-th is a plain storage (0: only slots) */
  int loans;         /* slots to loan and write after, not to send */
  int die;           /* end by SIGKILL (else close and exit 0) */
  int park;          /* wait to be killed */
  const int *opened; /* a pipe: a byte written to it once open (or NULL) */
} sender_job;

static int sender(void *arg) {
  sender_job *j = arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, j->name, TD_CHAN_SEND, 5000, &ch), 0);
  if (j->opened != NULL)
    CHECK(write(j->opened[1], "o", 1) == 1);
  for (int i = 0; i < j->n; i++) {
    td_storage *s;
    if (j->plain_every && i % j->plain_every == j->plain_every - 1)
      CHECK_ERR(c, td_storage_create(c, SLOT_BYTES, &s), 0);
    else
      CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
    fill(td_storage_data(s), SLOT_BYTES, j->tag0 + (uint64_t)i);
    td_view v = bytes_view(SLOT_BYTES);
    CHECK_ERR(c, td_chan_send(ch, s, &v, 5000), 0);
  }
  for (int i = 0; i < j->loans; i++) {
    td_storage *s;
    CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
    fill(td_storage_data(s), SLOT_BYTES, 0xdead);
  }
  if (j->park)
    for (;;)
      pause();
  if (j->die)
    raise(SIGKILL);
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* Receives n entries tagged tag0.. in order into the main process's slots,
 * checking each byte. */
static void recv_tagged(td_client *c, td_chan *ch, uint64_t tag0, int n) {
  for (int i = 0; i < n; i++) {
    td_storage *s;
    td_view v;
    cr_assert_eq(td_chan_recv(ch, 5000, &s, &v), 0, "entry %d: %s", i,
                 td_last_error(c));
    cr_assert_eq(td_view_numel(&v), SLOT_BYTES);
    cr_assert(filled(s, tag0 + (uint64_t)i),
              "entry %d: tag %" PRIu64 " (want %" PRIu64
              "), or a byte out of place",
              i, tag_of(s), tag0 + (uint64_t)i);
    td_storage_release(s);
  }
}

/* ---- a process that dies ---- */

TDT_TEST(chan_faults, sigkill_between_loan_and_send) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8,
                    .slots = 4,
                    .slot_bytes = SLOT_BYTES,
                    .flags = TD_CHAN_RECV};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "loan", &o, &ch), 0, "%s", td_last_error(c));
  /* Two sent, two on loan and written when it dies. */
  sender_job a = {.name = "loan", .tag0 = 100, .n = 2, .loans = 2, .die = 1};
  cr_assert_eq(tdt_wait(tdt_fork(sender, &a)), 128 + SIGKILL);
  cr_assert(await_counts(ch, (counts){2, 0, 2, 0, 0, 1}),
            "its loans did not come back");
  listed l = chan_listed(c, "loan");
  cr_assert(l.found);
  cr_assert_eq(l.nends, 1, "the dead end is still listed");
  /* What it sent arrives, once each; then its side is gone. */
  recv_tagged(c, ch, 100, 2);
  td_storage *s;
  td_view v;
  cr_assert_eq(td_chan_recv(ch, 0, &s, &v), TD_EPIPE, "%s", td_last_error(c));
  /* The next sender has every slot, the two it had on loan among them. */
  sender_job b = {.name = "loan", .tag0 = 200, .n = 12};
  pid_t p = tdt_fork(sender, &b);
  cr_assert(await_counts(ch, (counts){-1, -1, -1, -1, 1, 1}));
  recv_tagged(c, ch, 200, 12);
  cr_assert_eq(td_chan_recv(ch, 5000, &s, &v), TD_EPIPE, "%s",
               td_last_error(c));
  cr_assert_eq(tdt_wait(p), 0);
  td_chan_info info;
  td_chan_stat(ch, &info);
  cr_assert_eq(info.slots_free, 4);
  cr_assert_eq(info.sent, 14);
  cr_assert_eq(info.received, 14);
  cr_assert_eq(tdt_storages(&d), 4);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* What a receiver child does. */
typedef struct receiver_job {
  const char *name;
  uint64_t tag0;
  int n;     /* entries to receive, tagged tag0.. in order */
  int keep;  /* the last `keep` of them held when it dies */
  int go_fd; /* read a byte from it before receiving (-1: no) */
  /* Dies only once the sender has loaned_then slots and sleeps in a loan
   * for one more (one this receiver holds). */
  int die_when_loaner_sleeps;
  int loaned_then;
} receiver_job;

static int receiver(void *arg) {
  receiver_job *j = arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  td__ring r;
  CHECK(open_ring(c, j->name, TD_CHAN_RECV, 8, 4, &ch, &r) == 0);
  char b;
  if (j->go_fd >= 0)
    CHECK(read(j->go_fd, &b, 1) == 1);
  td_storage *held[8];
  for (int i = 0; i < j->n; i++) {
    td_view v;
    CHECK_ERR(c, td_chan_recv(ch, 5000, &held[i], &v), 0);
    CHECK(td_storage_is_readonly(held[i]));
    CHECK(filled(held[i], j->tag0 + (uint64_t)i));
    if (i < j->n - j->keep)
      td_storage_release(held[i]);
  }
  if (j->die_when_loaner_sleeps) {
    /* The sender has every other slot on loan and sleeps for this one. */
    for (int64_t end = now_ms() + 10000;; tdt_sleep_ms(1)) {
      CHECK(now_ms() < end);
      td_chan_info i;
      td_chan_stat(ch, &i);
      if (i.slots_loaned == (uint32_t)j->loaned_then &&
          atomic_load(&r.hdr->freed_sleepers) > 0)
        break;
    }
  }
  raise(SIGKILL);
  return 1;
}

TDT_TEST(chan_faults, sigkill_holding_received_slots) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8,
                    .slots = 4,
                    .slot_bytes = SLOT_BYTES,
                    .flags = TD_CHAN_SEND};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "held", &o, &ch), 0, "%s", td_last_error(c));
  int go[2];
  cr_assert_eq(pipe(go), 0);
  /* b waits; a takes three and dies holding them. */
  receiver_job bj = {.name = "held",
                     .tag0 = 10,
                     .n = 4,
                     .keep = 1,
                     .go_fd = go[0],
                     .die_when_loaner_sleeps = 1,
                     .loaned_then = 3};
  pid_t b = tdt_fork(receiver, &bj);
  cr_assert(await_counts(ch, (counts){-1, -1, -1, -1, 1, 1}));
  receiver_job aj = {.name = "held", .tag0 = 0, .n = 3, .keep = 3, .go_fd = -1};
  pid_t a = tdt_fork(receiver, &aj);
  for (uint64_t i = 0; i < 3; i++) {
    td_storage *s;
    cr_assert_eq(td_chan_loan(ch, 5000, &s), 0, "%s", td_last_error(c));
    fill(td_storage_data(s), SLOT_BYTES, i);
    td_view v = bytes_view(SLOT_BYTES);
    cr_assert_eq(td_chan_send(ch, s, &v, 5000), 0, "%s", td_last_error(c));
  }
  cr_assert_eq(tdt_wait(a), 128 + SIGKILL);
  cr_assert(await_counts(ch, (counts){4, 0, 0, 0, 1, 1}),
            "the slots it held did not come back");
  /* b is still there: the four are ours to send, no EPIPE. */
  for (uint64_t i = 10; i < 14; i++) {
    td_storage *s;
    cr_assert_eq(td_chan_loan(ch, 0, &s), 0, "%s", td_last_error(c));
    fill(td_storage_data(s), SLOT_BYTES, i);
    td_view v = bytes_view(SLOT_BYTES);
    cr_assert_eq(td_chan_send(ch, s, &v, 5000), 0, "%s", td_last_error(c));
  }
  cr_assert_eq(write(go[1], "g", 1), 1);
  /* b gives three back and keeps one; we loan the three and sleep for the
   * fourth: b's death wakes us with EPIPE (no receiver is left). */
  td_storage *loans[3];
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_chan_loan(ch, 5000, &loans[i]), 0, "%s", td_last_error(c));
  td_storage *s;
  int64_t t0 = now_ms();
  cr_assert_eq(td_chan_loan(ch, 20000, &s), TD_EPIPE, "%s", td_last_error(c));
  cr_assert_lt(now_ms() - t0, 10000, "the loan was not woken");
  cr_assert(strstr(td_last_error(c), "channel 'held'") != NULL, "%s",
            td_last_error(c));
  cr_assert_eq(tdt_wait(b), 128 + SIGKILL);
  td_view v = bytes_view(SLOT_BYTES);
  cr_assert_eq(td_chan_send(ch, loans[0], &v, 1000), TD_EPIPE, "%s",
               td_last_error(c));
  for (int i = 0; i < 3; i++)
    td_storage_release(loans[i]);
  cr_assert(await_counts(ch, (counts){4, 0, 0, 0, 1, 0}));
  close(go[0]);
  close(go[1]);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

TDT_TEST(chan_faults, consumer_sees_epipe_when_the_last_sender_dies) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8,
                    .slots = 4,
                    .slot_bytes = SLOT_BYTES,
                    .flags = TD_CHAN_RECV};
  td_chan *ch;
  td__ring r;
  cr_assert_eq(create_ring(c, "two", &o, &ch, &r), 0, "%s", td_last_error(c));
  /* Each sends one, loans one more and waits to be killed. */
  sender_job j1 = {.name = "two", .tag0 = 1, .n = 1, .loans = 1, .park = 1};
  sender_job j2 = {.name = "two", .tag0 = 2, .n = 1, .loans = 1, .park = 1};
  pid_t p1 = tdt_fork(sender, &j1), p2 = tdt_fork(sender, &j2);
  uint64_t seen = 0;
  for (int i = 0; i < 2; i++) {
    td_storage *s;
    td_view v;
    cr_assert_eq(td_chan_recv(ch, 5000, &s, &v), 0, "%s", td_last_error(c));
    uint64_t t = tag_of(s);
    cr_assert((t == 1 || t == 2) && filled(s, t));
    seen |= 1u << t;
    td_storage_release(s);
  }
  cr_assert_eq(seen, 6);
  cr_assert(await_counts(ch, (counts){2, 2, 0, 0, 2, 1}));
  kill(p1, SIGKILL);
  cr_assert_eq(tdt_wait(p1), 128 + SIGKILL);
  cr_assert(await_counts(ch, (counts){3, 1, 0, 0, 1, 1}));
  /* One sender is left: nothing comes, but no EPIPE either. */
  td_storage *s;
  td_view v;
  cr_assert_eq(td_chan_recv(ch, 100, &s, &v), TD_ETIMEDOUT, "%s",
               td_last_error(c));
  /* Asleep in a receive when the last one dies: woken with EPIPE. */
  blocked b;
  block_recv(&b, c, ch, 20000);
  cr_assert(await_bits(&r.hdr->items_sleepers, ~0u));
  kill(p2, SIGKILL);
  cr_assert_eq(tdt_wait(p2), 128 + SIGKILL);
  pthread_join(b.t, NULL);
  cr_assert_eq(b.err, TD_EPIPE, "%s", b.msg);
  cr_assert_lt(b.ms, 10000, "the receive was not woken");
  cr_assert(strstr(b.msg, "channel 'two'") != NULL, "%s", b.msg);
  cr_assert(await_counts(ch, (counts){4, 0, 0, 0, 0, 1}));
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* ---- a process that dies in the middle of writing the ring ---- */

/* Where the writer stops: each is a step of td__ring_push (or pop) done,
 * the next not. */
enum torn {
  TORN_CELL,   /* the cell written; its slot still on loan */
  TORN_QUEUED, /* ... and the slot QUEUED; the tail not moved */
  TORN_PUSHED, /* ... and the tail moved; not unlocked, no one woken */
  TORN_POPPED, /* a pop: the head moved over an entry; its slot not HELD */
  TORN_N
};

typedef struct torn_job {
  const char *name;
  enum torn at;
  int ready_fd; /* written once the lock is ours and the ring half done */
} torn_job;

static void cell_write(td__ring_cell *cell, uint32_t slot, const td_view *v) {
  atomic_store(&cell->kind, TD__CELL_SLOT);
  atomic_store(&cell->slot, slot);
  atomic_store(&cell->ticket, 0);
  atomic_store(&cell->dtype, (int32_t)v->dtype);
  atomic_store(&cell->ndim, v->ndim);
  atomic_store(&cell->offset, v->offset);
  for (int i = 0; i < v->ndim; i++) {
    atomic_store(&cell->shape[i], v->shape[i]);
    atomic_store(&cell->stride[i], v->stride[i]);
  }
}

#define TORN_TAG 500

/* Sends TORN_TAG and +1, loans a slot and writes TORN_TAG + 2 into it, then
 * does by hand, as its end, the first steps of pushing it (or of popping
 * the first entry), and dies once someone sleeps on the lock it holds. */
static int torn_writer(void *arg) {
  torn_job *j = arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  td__ring r;
  unsigned flags = TD_CHAN_SEND | (j->at == TORN_POPPED ? TD_CHAN_RECV : 0);
  CHECK(open_ring(c, j->name, flags, 8, 4, &ch, &r) == 0);
  td_view v = bytes_view(SLOT_BYTES);
  for (uint64_t i = 0; i < 2; i++) {
    td_storage *s;
    CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
    fill(td_storage_data(s), SLOT_BYTES, TORN_TAG + i);
    CHECK_ERR(c, td_chan_send(ch, s, &v, 5000), 0);
  }
  td_storage *s;
  CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
  fill(td_storage_data(s), SLOT_BYTES, TORN_TAG + 2);
  /* Our end's id: the slot word of the slot we have on loan. */
  uint32_t slot = UINT32_MAX, end = 0;
  for (uint32_t i = 0; i < r.nslots; i++) {
    uint64_t w = atomic_load(&r.slots[i]);
    if (TD__SLOT_STATE(w) == TD__SLOT_LOANED) {
      CHECK(slot == UINT32_MAX);
      slot = i;
      end = TD__SLOT_END(w);
    }
  }
  CHECK(slot != UINT32_MAX && end != 0);
  uint32_t unlocked = 0;
  CHECK(atomic_compare_exchange_strong(&r.hdr->lock, &unlocked, end));
  uint64_t head = atomic_load(&r.hdr->head), tail = atomic_load(&r.hdr->tail);
  CHECK(tail - head == 2);
  if (j->at == TORN_POPPED) {
    atomic_store(&r.hdr->head, head + 1);
  } else {
    cell_write(&r.cells[tail & (r.capacity - 1)], slot, &v);
    if (j->at >= TORN_QUEUED)
      atomic_store(&r.slots[slot], TD__SLOT_WORD(TD__SLOT_QUEUED, 0));
    if (j->at >= TORN_PUSHED)
      atomic_store(&r.hdr->tail, tail + 1);
  }
  CHECK(write(j->ready_fd, "r", 1) == 1);
  CHECK(await_bits(&r.hdr->lock, TD__LOCK_SLEEPERS));
  raise(SIGKILL);
  return 1;
}

TDT_TEST(chan_faults, sigkill_in_the_middle_of_writing_the_ring) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  for (int at = 0; at < TORN_N; at++) {
    char name[32];
    snprintf(name, sizeof(name), "torn-%d", at);
    td_chan_opts o = {.capacity = 8,
                      .slots = 4,
                      .slot_bytes = SLOT_BYTES,
                      .flags = TD_CHAN_RECV};
    td_chan *ch;
    td__ring r;
    cr_assert_eq(create_ring(c, name, &o, &ch, &r), 0, "%s", td_last_error(c));
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    torn_job tj = {name, (enum torn)at, ready[1]};
    pid_t t = tdt_fork(torn_writer, &tj);
    char b;
    cr_assert_eq(read(ready[0], &b, 1), 1, "torn writer %d failed", at);
    /* A well-behaved sender comes while the ring is half written and
     * locked: it sleeps on the lock, which the writer waits for to die. */
    sender_job sj = {.name = name, .tag0 = 1000, .n = 10, .opened = ready};
    pid_t s = tdt_fork(sender, &sj);
    cr_assert_eq(read(ready[0], &b, 1), 1, "the sender failed");
    /* Everything pushed arrives once, in order, then EPIPE. */
    uint64_t want[16];
    int nwant = 0;
    if (at != TORN_POPPED)
      want[nwant++] = TORN_TAG;
    want[nwant++] = TORN_TAG + 1;
    if (at == TORN_PUSHED)
      want[nwant++] = TORN_TAG + 2;
    for (uint64_t i = 0; i < 10; i++)
      want[nwant++] = 1000 + i;
    for (int i = 0;; i++) {
      td_storage *st;
      td_view v;
      int err = td_chan_recv(ch, 5000, &st, &v);
      if (err == TD_EPIPE) {
        cr_assert_eq(i, nwant, "%s: %d entries, %d due", name, i, nwant);
        break;
      }
      cr_assert_eq(err, 0, "%s: entry %d: %s", name, i, td_last_error(c));
      cr_assert_lt(i, nwant, "%s: more entries than sent", name);
      cr_assert(filled(st, want[i]),
                "%s: entry %d: tag %" PRIu64 " (want %" PRIu64 ")", name, i,
                tag_of(st), want[i]);
      td_storage_release(st);
    }
    cr_assert_eq(tdt_wait(t), 128 + SIGKILL, "%s", name);
    cr_assert_eq(tdt_wait(s), 0, "%s", name);
    /* The daemon took the lock from the dead and gave it back; every slot
     * is free again. */
    cr_assert_eq(atomic_load(&r.hdr->lock), 0, "%s", name);
    cr_assert(await_counts(ch, (counts){4, 0, 0, 0, 0, 1}), "%s", name);
    listed l = chan_listed(c, name);
    cr_assert(l.found && !l.info.corrupt, "%s", name);
    close(ready[0]);
    close(ready[1]);
    td_chan_close(ch);
  }
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* ---- garbage in a ring ---- */

/* Counts shared by the garbage test's processes. */
typedef struct tally {
  _Atomic int stop; /* the clean pair may finish */
  _Atomic uint64_t clean_sent, clean_received;
  _Atomic uint64_t ok, eproto, etimedout, epipe, ecanceled;
  _Atomic uint64_t patterns[16];
  _Atomic int opened[256]; /* per round: its consumer and scribbler open */
} tally;

static tally *tl;

static uint64_t rnd(uint64_t *x) {
  /* splitmix64 */
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* A view of n_bytes or fewer chosen from x: a dtype, a shape and an
 * offset that fit. */
static td_view some_view(uint64_t *x, size_t nbytes) {
  static const td_dtype dts[] = {TD_UINT8, TD_FLOAT32, TD_INT64};
  td_dtype dt = dts[rnd(x) % 3];
  int64_t items = (int64_t)(nbytes / td_dtype_size(dt));
  int64_t off = (int64_t)(rnd(x) % 16);
  int64_t n = items - off - (int64_t)(rnd(x) % 8);
  int64_t shape[2] = {2, n / 2};
  td_view v;
  td_view_contiguous(dt, 2, shape, &v);
  v.offset = off;
  return v;
}

/* The outcome of a call on the garbage channel: allowed, named, in time.
 * Returns 0 to go on, 1 to stop (an error), -1 on a failed check. */
static int judge(td_client *c, const char *name, const char *op, int err,
                 int64_t ms, int timeout_ms) {
  if (ms > timeout_ms + SLACK_MS) {
    fprintf(stderr, "%s: %s took %lld ms (timeout %d): %s\n", name, op,
            (long long)ms, timeout_ms, err ? td_err_name(err) : "0");
    return -1;
  }
  switch (err) {
  case 0:
    atomic_fetch_add(&tl->ok, 1);
    return 0;
  case TD_ETIMEDOUT:
    atomic_fetch_add(&tl->etimedout, 1);
    return 1;
  case TD_EPIPE:
    atomic_fetch_add(&tl->epipe, 1);
    return 1;
  case TD_ECANCELED: /* the state word says closed: garbage, or tensord */
    atomic_fetch_add(&tl->ecanceled, 1);
    return 1;
  case TD_EPROTO: {
    char want[64];
    snprintf(want, sizeof(want), "channel '%s'", name);
    if (strstr(td_last_error(c), want) == NULL) {
      fprintf(stderr, "%s: %s: EPROTO that does not name it: %s\n", name, op,
              td_last_error(c));
      return -1;
    }
    atomic_fetch_add(&tl->eproto, 1);
    return 1;
  }
  default:
    fprintf(stderr, "%s: %s: %s: %s\n", name, op, td_err_name(err),
            td_last_error(c));
    return -1;
  }
}

#define JUNK_TIMEOUT_MS 150
#define JUNK_CAP 8
#define JUNK_SLOTS 4

typedef struct junk_job {
  char name[32];
  int round;
  uint64_t seed;
} junk_job;

/* Waits (10 s at most) for the round's consumer and scribbler to open: no
 * entry goes and no garbage comes before. */
static int all_opened(const junk_job *j) {
  for (int64_t end = now_ms() + 10000; now_ms() < end; tdt_sleep_ms(1))
    if (atomic_load(&tl->opened[j->round]) == 2)
      return 1;
  return 0;
}

/* Sends up to 40 entries (every fifth a plain storage) with views chosen
 * from the seed, until the first error. */
static int junk_producer(void *arg) {
  junk_job *j = arg;
  uint64_t x = j->seed ^ 0x5eed;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan_opts o = {.capacity = JUNK_CAP,
                    .slots = JUNK_SLOTS,
                    .slot_bytes = SLOT_BYTES,
                    .flags = TD_CHAN_SEND};
  td_chan *ch;
  CHECK_ERR(c, td_chan_create(c, j->name, &o, &ch), 0);
  CHECK(all_opened(j));
  for (int i = 0; i < 40; i++) {
    td_storage *s = NULL;
    int64_t t0 = now_ms();
    int err, plain = i % 5 == 4;
    if (plain)
      err = td_storage_create(c, SLOT_BYTES, &s);
    else
      err = td_chan_loan(ch, JUNK_TIMEOUT_MS, &s);
    int k = judge(c, j->name, "loan", err, now_ms() - t0, JUNK_TIMEOUT_MS);
    CHECK(k >= 0);
    if (k > 0)
      break;
    fill(td_storage_data(s), SLOT_BYTES, (uint64_t)i);
    td_view v = some_view(&x, SLOT_BYTES);
    t0 = now_ms();
    err = td_chan_send(ch, s, &v, JUNK_TIMEOUT_MS);
    k = judge(c, j->name, "send", err, now_ms() - t0, JUNK_TIMEOUT_MS);
    if (err != 0)
      td_storage_release(s);
    CHECK(k >= 0);
    if (k > 0)
      break;
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* Receives until the first error; each view must lie inside its storage,
 * which is read at both ends of the view. */
static int junk_consumer(void *arg) {
  junk_job *j = arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, j->name, TD_CHAN_RECV, 10000, &ch), 0);
  atomic_fetch_add(&tl->opened[j->round], 1);
  for (int i = 0; i < 200; i++) {
    td_storage *s;
    td_view v;
    int64_t t0 = now_ms();
    int err = td_chan_recv(ch, JUNK_TIMEOUT_MS, &s, &v);
    int k = judge(c, j->name, "receive", err, now_ms() - t0, JUNK_TIMEOUT_MS);
    CHECK(k >= 0);
    if (k > 0)
      break;
    CHECK(td_storage_nbytes(s) == SLOT_BYTES);
    CHECK_ERR(NULL, td_view_check(&v, td_storage_nbytes(s)), 0);
    int64_t last = v.offset;
    int empty = 0;
    for (int k2 = 0; k2 < v.ndim; k2++) {
      empty |= v.shape[k2] == 0;
      last += (v.shape[k2] - 1) * v.stride[k2];
    }
    const volatile uint8_t *p = td_storage_data(s);
    size_t isz = td_dtype_size(v.dtype);
    if (!empty) {
      (void)p[(size_t)v.offset * isz];
      (void)p[((size_t)last + 1) * isz - 1];
    }
    td_storage_release(s);
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* Garbage patterns. */
enum {
  G_ALL_FF,
  G_RANDOM_ALL,
  G_RANDOM_RANGE,
  G_HEAD_TAIL,
  G_SLOT_WORD,
  G_CELL_KIND,
  G_CELL_SLOT,
  G_CELL_NDIM,
  G_CELL_VIEW,
  G_STATE,
  G_LOCK,
  G_SLEEPERS,
  G_HEADER,
  G_ZERO_ALL,
  G_DUP_ENTRY,
  G_N
};

/* A cell that a pop will read: one between the head and the tail (the
 * head's if there is none), now and then any. */
static td__ring_cell *pending_cell(td__ring *r, uint64_t *x) {
  uint64_t head = atomic_load(&r->hdr->head);
  uint64_t n = atomic_load(&r->hdr->tail) - head;
  if (n == 0 || n > r->capacity || rnd(x) % 8 == 0)
    n = n == 0 ? 1 : r->capacity;
  return &r->cells[(head + rnd(x) % n) & (r->capacity - 1)];
}

static void scribble(td__ring *r, uint64_t *x, int pattern, uint32_t self) {
  uint8_t *base = (uint8_t *)r->hdr;
  td__ring_hdr *h = r->hdr;
  uint64_t k = rnd(x);
  switch (pattern) {
  case G_ALL_FF:
    memset(base, 0xff, r->size);
    break;
  case G_RANDOM_ALL:
    for (size_t i = 0; i < r->size; i++)
      base[i] = (uint8_t)rnd(x);
    break;
  case G_RANDOM_RANGE: {
    size_t a = rnd(x) % r->size, n = 1 + rnd(x) % 256;
    for (size_t i = a; i < a + n && i < r->size; i++)
      base[i] = (uint8_t)rnd(x);
    break;
  }
  case G_HEAD_TAIL: {
    uint64_t head = atomic_load(&h->head), tail = atomic_load(&h->tail);
    switch (k % 5) {
    case 0: /* more entries than the ring holds */
      atomic_store(&h->tail, head + r->capacity + 1 + rnd(x) % 1000);
      break;
    case 1: /* the tail behind the head */
      atomic_store(&h->tail, head - 1);
      break;
    case 2: /* a full ring of stale cells */
      atomic_store(&h->tail, head + r->capacity);
      break;
    case 3: /* anywhere, consistent */
      head = rnd(x);
      atomic_store(&h->head, head);
      atomic_store(&h->tail, head + rnd(x) % (r->capacity + 1));
      break;
    default: /* entries popped twice */
      atomic_store(&h->head, tail > 2 ? tail - 2 - rnd(x) % 3 : 0);
      break;
    }
    break;
  }
  case G_SLOT_WORD: {
    uint32_t i = (uint32_t)(rnd(x) % r->nslots);
    static const uint64_t words[] = {
        0,
        TD__SLOT_WORD(TD__SLOT_QUEUED, 0),
        TD__SLOT_WORD(TD__SLOT_LOANED, 1),
        TD__SLOT_WORD(TD__SLOT_HELD, 2),
        TD__SLOT_WORD(TD__SLOT_HELD, 0x3ffff000),
        TD__SLOT_WORD(7, 1),
        ~0ull,
    };
    uint64_t w = k % 8 == 7 ? rnd(x) : words[k % 8];
    if (k & 0x100) /* every slot */
      for (uint32_t s = 0; s < r->nslots; s++)
        atomic_store(&r->slots[s], w);
    else
      atomic_store(&r->slots[i], w);
    break;
  }
  case G_CELL_KIND: {
    td__ring_cell *cl = pending_cell(r, x);
    switch (k % 4) {
    case 0:
      atomic_store(&cl->kind, (uint32_t)rnd(x));
      break;
    case 1: /* a storage under a ticket no one gave */
      atomic_store(&cl->kind, TD__CELL_STORAGE);
      atomic_store(&cl->ticket, rnd(x) % 4 ? rnd(x) : 1 + rnd(x) % 64);
      break;
    case 2:
      atomic_store(&cl->kind, TD__CELL_STORAGE);
      atomic_store(&cl->ticket, 0);
      break;
    default:
      atomic_store(&cl->kind, TD__CELL_SLOT);
      break;
    }
    break;
  }
  case G_CELL_SLOT: {
    static const uint32_t slots[] = {
        JUNK_SLOTS, JUNK_SLOTS + 1, UINT32_MAX, 0x80000000u, 0, 1};
    td__ring_cell *cl = pending_cell(r, x);
    atomic_store(&cl->slot, k % 7 == 6 ? (uint32_t)rnd(x) : slots[k % 7 % 6]);
    break;
  }
  case G_CELL_NDIM: {
    static const int32_t nd[] = {-1, TD_MAX_DIMS + 1, INT32_MAX, INT32_MIN,
                                 0,  TD_MAX_DIMS};
    atomic_store(&pending_cell(r, x)->ndim, nd[k % 6]);
    break;
  }
  case G_CELL_VIEW: {
    static const int64_t vals[] = {INT64_MAX,  INT64_MIN,        -1,
                                   SLOT_BYTES, SLOT_BYTES + 1,   SLOT_BYTES / 2,
                                   1 << 30,    INT64_MAX / 2 + 1};
    td__ring_cell *cl = pending_cell(r, x);
    int dim = (int)(rnd(x) % TD_MAX_DIMS);
    int64_t val = vals[rnd(x) % 8];
    switch (k % 5) {
    case 0:
      atomic_store(&cl->shape[dim], val);
      break;
    case 1:
      atomic_store(&cl->stride[dim], val);
      break;
    case 2:
      atomic_store(&cl->offset, val);
      break;
    case 3:
      atomic_store(&cl->dtype, (int32_t)rnd(x));
      break;
    default: /* a view that only just passes the slot's end */
      atomic_store(&cl->dtype, TD_UINT8);
      atomic_store(&cl->ndim, 1);
      atomic_store(&cl->shape[0], SLOT_BYTES);
      atomic_store(&cl->stride[0], 1);
      atomic_store(&cl->offset, 1);
      break;
    }
    break;
  }
  case G_STATE: {
    static const uint32_t st[] = {0, TD__RING_CORRUPT, TD__RING_CLOSED,
                                  TD__RING_NO_SENDERS, TD__RING_NO_RECEIVERS};
    atomic_store(&h->state, k % 6 == 5 ? (uint32_t)rnd(x) : st[k % 6]);
    break;
  }
  case G_LOCK: {
    /* Ids no end has (tensord's own, one never given, the sleepers bit
     * alone, everything set), and our own, left held when we close. */
    static const uint32_t ids[] = {TD__END_DAEMON, 0x3ffff000u,
                                   TD__LOCK_SLEEPERS, ~0u,
                                   TD__LOCK_SLEEPERS | 0x12345u};
    uint32_t id = k % 6 == 5 ? self : ids[k % 6];
    atomic_store(&h->lock, id);
    break;
  }
  case G_SLEEPERS:
    atomic_store(&h->items_sleepers, (uint32_t)rnd(x));
    atomic_store(&h->space_sleepers, k & 1 ? 0 : (uint32_t)rnd(x));
    atomic_store(&h->freed_sleepers, (uint32_t)rnd(x));
    atomic_store(&h->items, (uint32_t)rnd(x));
    atomic_store(&h->space, (uint32_t)rnd(x));
    atomic_store(&h->freed, (uint32_t)rnd(x));
    break;
  case G_HEADER:
    atomic_store(&h->magic, rnd(x));
    atomic_store(&h->capacity, (uint32_t)rnd(x));
    atomic_store(&h->nslots, (uint32_t)rnd(x));
    atomic_store(&h->slot_bytes, rnd(x));
    atomic_store(&h->senders, (uint32_t)rnd(x));
    atomic_store(&h->receivers, (uint32_t)rnd(x));
    atomic_store(&h->hint, (uint32_t)rnd(x));
    break;
  case G_ZERO_ALL:
    memset(base, 0, r->size);
    break;
  default: { /* an entry twice: the head's cell copied over the next */
    uint64_t head = atomic_load(&h->head);
    td__ring_cell *a = &r->cells[head & (r->capacity - 1)];
    td__ring_cell *b = &r->cells[(head + 1) & (r->capacity - 1)];
    memcpy((void *)b, (void *)a, sizeof(*a));
    if (atomic_load(&h->tail) - head < 2)
      atomic_store(&h->tail, head + 2);
    break;
  }
  }
}

/* Opens the channel as a receiver that never receives, waits for a few
 * entries to go by, and scribbles over the ring. */
static int junk_scribbler(void *arg) {
  junk_job *j = arg;
  uint64_t x = j->seed;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  td__ring r;
  CHECK(open_ring(c, j->name, TD_CHAN_RECV, JUNK_CAP, JUNK_SLOTS, &ch, &r) ==
        0);
  listed l = chan_listed(c, j->name);
  const td_chan_end_info *me = end_of(&l, getpid());
  CHECK(me != NULL);
  /* Somewhere in the stream once the pair is there: after 0 to 11 entries
   * (or two seconds). */
  atomic_fetch_add(&tl->opened[j->round], 1);
  CHECK(all_opened(j));
  uint64_t after = rnd(&x) % 12;
  for (int64_t end = now_ms() + 2000;
       atomic_load(&r.hdr->tail) < after && now_ms() < end;)
    tdt_sleep_ms(1);
  int n = 1 + (int)(rnd(&x) % 3);
  for (int i = 0; i < n; i++) {
    int pattern = (int)(rnd(&x) % G_N);
    atomic_fetch_add(&tl->patterns[pattern], 1);
    scribble(&r, &x, pattern, me->end);
    if (i + 1 < n)
      tdt_sleep_ms((int)(rnd(&x) % 3)); /* let the pair run into it */
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* The clean pair: every byte of every entry right, in order. */
#define CLEAN_CAP 16

static td_view clean_view(uint64_t i) {
  td_view v = bytes_view(SLOT_BYTES - (int64_t)(i % 64));
  v.offset = (int64_t)(i % 64);
  return v;
}

static int clean_producer(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan_opts o = {.capacity = CLEAN_CAP,
                    .slots = 4,
                    .slot_bytes = SLOT_BYTES,
                    .flags = TD_CHAN_SEND};
  td_chan *ch;
  CHECK_ERR(c, td_chan_create(c, "clean", &o, &ch), 0);
  uint64_t i = 0;
  for (; !atomic_load(&tl->stop) || i < 100; i++) {
    td_storage *s;
    if (i % 3 == 2)
      CHECK_ERR(c, td_storage_create(c, SLOT_BYTES, &s), 0);
    else
      CHECK_ERR(c, td_chan_loan(ch, 10000, &s), 0);
    fill(td_storage_data(s), SLOT_BYTES, i);
    td_view v = clean_view(i);
    CHECK_ERR(c, td_chan_send(ch, s, &v, 10000), 0);
  }
  atomic_store(&tl->clean_sent, i);
  td_chan_close(ch);
  td_close(c);
  return 0;
}

static int clean_consumer(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, "clean", TD_CHAN_RECV, 10000, &ch), 0);
  for (uint64_t i = 0;; i++) {
    td_storage *s;
    td_view v;
    int err = td_chan_recv(ch, 10000, &s, &v);
    if (err == TD_EPIPE) {
      atomic_store(&tl->clean_received, i);
      break;
    }
    CHECK_ERR(c, err, 0);
    td_view want = clean_view(i);
    CHECK(v.dtype == want.dtype && v.ndim == 1 && v.offset == want.offset &&
          v.shape[0] == want.shape[0] && v.stride[0] == 1);
    CHECK(filled(s, i));
    td_storage_release(s);
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

#define JUNK_ROUNDS 128
#define JUNK_BATCH 4
_Static_assert(JUNK_ROUNDS <= 256, "tally.opened has a cell per round");

TDT_TEST(chan_faults, garbage_in_a_ring_stays_in_that_channel) {
  uint64_t seed = tdt_seed("chan_faults::garbage");
  tdt_start(&d, NULL);
  tl = mmap(NULL, sizeof(*tl), PROT_READ | PROT_WRITE,
            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  cr_assert(tl != MAP_FAILED);
  memset(tl, 0, sizeof(*tl));
  pid_t cp = tdt_fork(clean_producer, NULL);
  pid_t cc = tdt_fork(clean_consumer, NULL);
  static junk_job jobs[JUNK_BATCH];
  for (int r0 = 0; r0 < JUNK_ROUNDS; r0 += JUNK_BATCH) {
    pid_t kids[JUNK_BATCH][3];
    for (int k = 0; k < JUNK_BATCH; k++) {
      junk_job *j = &jobs[k];
      snprintf(j->name, sizeof(j->name), "junk-%d", r0 + k);
      j->round = r0 + k;
      j->seed = seed + (uint64_t)(r0 + k) * 0x9e3779b97f4a7c15ull;
      kids[k][0] = tdt_fork(junk_producer, j);
      kids[k][1] = tdt_fork(junk_consumer, j);
      kids[k][2] = tdt_fork(junk_scribbler, j);
    }
    for (int k = 0; k < JUNK_BATCH; k++)
      for (int i = 0; i < 3; i++)
        cr_assert_eq(tdt_wait(kids[k][i]), 0,
                     "round %d (seed %" PRIu64 "): %s failed", r0 + k, seed,
                     i == 0   ? "the producer"
                     : i == 1 ? "the consumer"
                              : "the scribbler");
    /* tensord is up and serves. */
    cr_assert_eq(kill(d.pid, 0), 0, "tensord died at round %d", r0);
    (void)tdt_storages(&d);
  }
  atomic_store(&tl->stop, 1);
  cr_assert_eq(tdt_wait(cp), 0, "the clean producer failed");
  cr_assert_eq(tdt_wait(cc), 0, "the clean consumer failed");
  cr_assert_gt(tl->clean_received, 100);
  cr_assert_eq(tl->clean_received, tl->clean_sent);
  fprintf(stderr,
          "garbage: %d rounds; well-behaved calls: %" PRIu64 " ok, %" PRIu64
          " EPROTO, %" PRIu64 " ETIMEDOUT, %" PRIu64 " EPIPE, %" PRIu64
          " ECANCELED; clean: %" PRIu64 " entries\n",
          JUNK_ROUNDS, tl->ok, tl->eproto, tl->etimedout, tl->epipe,
          tl->ecanceled, tl->clean_received);
  /* The garbage was seen, and named: by the ends and in tensord's log. */
  cr_assert_gt(tl->ok, 0);
  cr_assert_gt(tl->eproto, 0);
  cr_assert(tdt_log_has(&d, "channel 'junk-"));
  for (int p = 0; p < G_N; p++)
    cr_assert_gt(tl->patterns[p], 0, "pattern %d never ran", p);
  td_client *c = tdt_connect(&d);
  listed l = chan_listed(c, "clean");
  cr_assert(!l.found, "the clean channel is still open");
  td_close(c);
  cr_assert_eq(tdt_storages(&d), 0);
  munmap(tl, sizeof(*tl));
}

/* The lock held by no end (one never given, tensord's own, one with the
 * sleepers bit), or the closed flag that only tensord sets: tensord marks
 * the channel corrupt within its check period, and a receiver asleep on it
 * wakes with EPROTO. */
TDT_TEST(chan_faults, lock_held_by_no_end_marks_the_channel_corrupt) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  static const uint32_t ids[] = {0x3ffff000u, TD__END_DAEMON,
                                 TD__LOCK_SLEEPERS | 77u, 0};
  for (int k = 0; k < 4; k++) {
    char name[32];
    snprintf(name, sizeof(name), "stuck-%d", k);
    td_chan_opts o = {.capacity = 8,
                      .slots = 2,
                      .slot_bytes = SLOT_BYTES,
                      .flags = TD_CHAN_RECV};
    td_chan *ch;
    td__ring r;
    cr_assert_eq(create_ring(c, name, &o, &ch, &r), 0, "%s", td_last_error(c));
    blocked b;
    block_recv(&b, c, ch, 20000);
    cr_assert(await_bits(&r.hdr->items_sleepers, ~0u));
    int64_t t0 = now_ms();
    if (ids[k] != 0)
      atomic_store(&r.hdr->lock, ids[k]);
    else
      atomic_fetch_or(&r.hdr->state, TD__RING_CLOSED);
    pthread_join(b.t, NULL);
    cr_assert_eq(b.err, TD_EPROTO, "%s: %s", name, b.msg);
    cr_assert_lt(now_ms() - t0, 1000 + SLACK_MS,
                 "%s: not marked corrupt in time", name);
    char want[128];
    snprintf(want, sizeof(want), "channel '%s'", name);
    cr_assert(strstr(b.msg, want) != NULL, "%s", b.msg);
    listed l = chan_listed(c, name);
    cr_assert(l.found && l.info.corrupt, "%s", name);
    /* Closed for good: an end that clears the flag has it set again. */
    atomic_store(&r.hdr->state, 0);
    cr_assert(await_bits(&r.hdr->state, TD__RING_CORRUPT), "%s", name);
    snprintf(want, sizeof(want), "channel '%s': %s", name,
             ids[k] ? "its lock is held" : "its ring says tensord closed it");
    cr_assert(tdt_log_has(&d, want), "%s", want);
    td_chan *again;
    cr_assert_eq(td_chan_open(c, name, TD_CHAN_SEND, 0, &again), TD_EPROTO);
    cr_assert(strstr(td_last_error(c), "it is closed") != NULL, "%s",
              td_last_error(c));
    td_chan_close(ch);
  }
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* The sleepers bit alone is no holder: the next end takes the lock. */
TDT_TEST(chan_faults, lock_with_only_the_sleepers_bit_is_free) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8, .slots = 2, .slot_bytes = SLOT_BYTES};
  td_chan *ch;
  td__ring r;
  cr_assert_eq(create_ring(c, "bit", &o, &ch, &r), 0, "%s", td_last_error(c));
  atomic_store(&r.hdr->lock, TD__LOCK_SLEEPERS);
  td_storage *s;
  cr_assert_eq(td_chan_loan(ch, 1000, &s), 0, "%s", td_last_error(c));
  fill(td_storage_data(s), SLOT_BYTES, 9);
  td_view v = bytes_view(SLOT_BYTES);
  cr_assert_eq(td_chan_send(ch, s, &v, 1000), 0, "%s", td_last_error(c));
  cr_assert_eq(atomic_load(&r.hdr->lock), 0);
  recv_tagged(c, ch, 9, 1);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* ---- access ---- */

typedef struct who {
  uid_t uid;
  gid_t gid;
} who;

#define STRANGER ((who){4246, 4246})

static void need_root(void) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
}

typedef struct as_job {
  who w;
  int (*fn)(void *);
  void *arg;
} as_job;

static int as_child(void *p) {
  as_job *j = p;
  if (setgroups(0, NULL) < 0 || setgid(j->w.gid) < 0 || setuid(j->w.uid) < 0) {
    fprintf(stderr, "cannot become uid %u gid %u: %s\n", (unsigned)j->w.uid,
            (unsigned)j->w.gid, strerror(errno));
    return 2;
  }
  return j->fn(j->arg);
}

/* Runs fn(arg) as w in a child; returns its exit status. */
static int run_as(who w, int (*fn)(void *), void *arg) {
  as_job j = {w, fn, arg};
  return tdt_wait(tdt_fork(as_child, &j));
}

/* The permissions ("r--s") of the mapping that holds p. */
static int perms_of(const void *p, char perms[5]) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  int found = 0;
  while (f != NULL && !found && fgets(line, sizeof(line), f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) == 3 &&
        (uintptr_t)p >= lo && (uintptr_t)p < hi)
      found = 1;
  }
  if (f != NULL)
    fclose(f);
  return found ? 0 : -1;
}

/* Whether writing to p kills a child with SIGSEGV. */
static int write_faults(void *p) {
  pid_t pid = fork();
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL); /* not a sanitizer's report and exit */
    *(volatile uint8_t *)p = 1;
    _exit(0);
  }
  int st;
  return pid > 0 && waitpid(pid, &st, 0) == pid && WIFSIGNALED(st) &&
         WTERMSIG(st) == SIGSEGV;
}

typedef struct acl_job {
  const char *name;
  unsigned denied[3]; /* sides it may not open (0 ends the list) */
  unsigned allowed;   /* the side it may, then uses (0: none) */
  const char *mode;   /* "mode 0600", as the refusal must say */
  char paths[8][330]; /* the ring's fds elsewhere: none may be opened */
  int npaths;
} acl_job;

static int acl_child(void *arg) {
  acl_job *j = arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  for (int i = 0; i < 3 && j->denied[i]; i++) {
    CHECK_ERR(c, td_chan_open(c, j->name, j->denied[i], 0, &ch), TD_EACCES);
    CHECK_MSG(c, "permission denied");
    CHECK_MSG(c, j->mode);
  }
  /* Nor can the ring be had behind tensord's back. */
  for (int i = 0; i < j->npaths; i++) {
    int fd = open(j->paths[i], O_RDWR);
    if (fd >= 0)
      fprintf(stderr, "uid %u opened %s\n", (unsigned)getuid(), j->paths[i]);
    CHECK(fd < 0 && (errno == EACCES || errno == EPERM));
  }
  if (j->allowed == TD_CHAN_RECV) {
    CHECK_ERR(c, td_chan_open(c, j->name, TD_CHAN_RECV, 0, &ch), 0);
    td_storage *s;
    td_view v;
    CHECK_ERR(c, td_chan_recv(ch, 5000, &s, &v), 0);
    CHECK(filled(s, 42));
    CHECK(td_storage_is_readonly(s));
    char perms[5];
    CHECK(perms_of(td_storage_data(s), perms) == 0);
    CHECK(strcmp(perms, "r--s") == 0);
    CHECK(write_faults(td_storage_data(s)));
    CHECK_ERR(c, td_chan_loan(ch, 0, &s), TD_EPERM);
    td_storage_release(s);
    td_chan_close(ch);
  } else if (j->allowed == TD_CHAN_SEND) {
    CHECK_ERR(c, td_chan_open(c, j->name, TD_CHAN_SEND, 0, &ch), 0);
    td_storage *s;
    CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
    char perms[5];
    CHECK(perms_of(td_storage_data(s), perms) == 0);
    CHECK(strcmp(perms, "rw-s") == 0);
    fill(td_storage_data(s), SLOT_BYTES, 43);
    td_view v = bytes_view(SLOT_BYTES);
    CHECK_ERR(c, td_chan_send(ch, s, &v, 5000), 0);
    td_chan_close(ch);
  }
  td_close(c);
  return 0;
}

/* The paths of the ring memfds tensord has open (/proc/PID/fd/N). */
static int ring_fds(pid_t pid, acl_job *j) {
  char dir[64], path[330], link[256];
  snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
  DIR *dd = opendir(dir);
  struct dirent *e;
  while (dd != NULL && (e = readdir(dd)) != NULL && j->npaths < 8) {
    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n <= 0)
      continue;
    link[n] = '\0';
    if (strstr(link, "memfd:tensord-chan") != NULL)
      snprintf(j->paths[j->npaths++], sizeof(j->paths[0]), "%s", path);
  }
  if (dd != NULL)
    closedir(dd);
  return j->npaths;
}

TDT_TEST(chan_faults, another_uid_opens_only_what_the_mode_admits) {
  need_root();
  const char *args[] = {"--socket-mode", "0666", NULL};
  tdt_start(&d, args);
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  td_client *c = tdt_connect(&d);
  /* The owner is root; a member has its group. */
  who member = {4245, getegid()};
  static const struct {
    const char *name;
    uint32_t mode;
    unsigned flags; /* ours */
  } cs[] = {{"acl-600", 0600, TD_CHAN_SEND},
            {"acl-640", 0640, TD_CHAN_SEND},
            {"acl-604", 0604, TD_CHAN_SEND},
            {"acl-602", 0602, TD_CHAN_RECV}};
  td_chan *ch[4];
  for (int i = 0; i < 4; i++) {
    td_chan_opts o = {.capacity = 4,
                      .slots = 2,
                      .slot_bytes = SLOT_BYTES,
                      .mode = cs[i].mode,
                      .flags = cs[i].flags};
    cr_assert_eq(td_chan_create(c, cs[i].name, &o, &ch[i]), 0, "%s",
                 td_last_error(c));
    if (cs[i].flags == TD_CHAN_SEND) {
      td_storage *s;
      cr_assert_eq(td_chan_loan(ch[i], 0, &s), 0, "%s", td_last_error(c));
      fill(td_storage_data(s), SLOT_BYTES, 42);
      td_view v = bytes_view(SLOT_BYTES);
      cr_assert_eq(td_chan_send(ch[i], s, &v, 0), 0, "%s", td_last_error(c));
    }
  }
  static acl_job j;
  const unsigned both = TD_CHAN_SEND | TD_CHAN_RECV;
  /* 0600: neither side, for a stranger or a member. */
  j = (acl_job){.name = "acl-600",
                .denied = {TD_CHAN_SEND, TD_CHAN_RECV, both},
                .allowed = 0,
                .mode = "mode 0600"};
  cr_assert(ring_fds(d.pid, &j) >= 4);
  cr_assert_eq(run_as(STRANGER, acl_child, &j), 0);
  j = (acl_job){.name = "acl-600",
                .denied = {TD_CHAN_SEND, TD_CHAN_RECV, both},
                .allowed = 0,
                .mode = "mode 0600"};
  cr_assert_eq(run_as(member, acl_child, &j), 0);
  /* 0640: a member receives (read-only), never sends; a stranger neither. */
  j = (acl_job){.name = "acl-640",
                .denied = {TD_CHAN_SEND, both, 0},
                .allowed = TD_CHAN_RECV,
                .mode = "mode 0640"};
  cr_assert_eq(run_as(member, acl_child, &j), 0);
  j = (acl_job){.name = "acl-640",
                .denied = {TD_CHAN_RECV, TD_CHAN_SEND, 0},
                .allowed = 0,
                .mode = "mode 0640"};
  cr_assert_eq(run_as(STRANGER, acl_child, &j), 0);
  /* 0604: anyone receives, read-only; no one else sends. */
  j = (acl_job){.name = "acl-604",
                .denied = {TD_CHAN_SEND, both, 0},
                .allowed = TD_CHAN_RECV,
                .mode = "mode 0604"};
  cr_assert_eq(run_as(STRANGER, acl_child, &j), 0);
  /* 0602: the write bit admits a sender, and only a sender. */
  j = (acl_job){.name = "acl-602",
                .denied = {TD_CHAN_RECV, both, 0},
                .allowed = TD_CHAN_SEND,
                .mode = "mode 0602"};
  cr_assert_eq(run_as(STRANGER, acl_child, &j), 0);
  recv_tagged(c, ch[3], 43, 1);
  /* What the receivers took came back to the channels. */
  for (int i = 0; i < 4; i++) {
    cr_assert(await_counts(ch[i], (counts){i == 0 ? 1 : 2, 0, i == 0 ? 1 : 0, 0,
                                           -1, -1}),
              "%s", cs[i].name);
    td_chan_close(ch[i]);
  }
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* ---- references ---- */

typedef struct holders {
  int found;
  uint32_t refs;
  size_t n;
  td_holder h[8];
  char names[8][64];
} holders;

static int holders_cb(const td_storage_info *info, void *arg) {
  holders *hs = arg;
  hs->found = 1;
  hs->refs = info->refs;
  hs->n = info->nholders < 8 ? info->nholders : 8;
  for (size_t i = 0; i < hs->n; i++) {
    hs->h[i] = info->holders[i];
    snprintf(hs->names[i], sizeof(hs->names[i]), "%s",
             info->holders[i].name ? info->holders[i].name : "");
  }
  return 0;
}

static holders holders_of(td_client *c, uint64_t id) {
  holders hs = {0};
  td_info(c, id, NULL, holders_cb, NULL, &hs);
  return hs;
}

/* Asserts that storage id's only holder is the channel "chan:refs". */
#define assert_held_by_chan(c, id)                                             \
  do {                                                                         \
    holders hs_ = holders_of(c, id);                                           \
    cr_assert(hs_.found, "storage %" PRIu64 " has gone", (uint64_t)(id));      \
    cr_assert_eq(hs_.n, 1, "storage %" PRIu64 ": %zu holders", (uint64_t)(id), \
                 hs_.n);                                                       \
    cr_assert_str_eq(hs_.names[0], "chan:refs");                               \
    cr_assert_eq(hs_.h[0].refs, 1);                                            \
  } while (0)

/* Sends one plain storage and dies. */
static int plain_then_die(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, "refs", TD_CHAN_SEND, 5000, &ch), 0);
  td_storage *s;
  CHECK_ERR(c, td_storage_create(c, 2 * SLOT_BYTES, &s), 0);
  fill(td_storage_data(s), 2 * SLOT_BYTES, 7);
  td_view v = bytes_view(2 * SLOT_BYTES);
  CHECK_ERR(c, td_chan_send(ch, s, &v, 5000), 0);
  raise(SIGKILL);
  return 1;
}

typedef struct hold_job {
  int told[2]; /* it writes here once it holds both */
  int die[2];  /* it dies once this is readable */
} hold_job;

/* Receives the plain storage and the slot, holds them, and dies. */
static int receive_and_hold(void *arg) {
  hold_job *j = arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, "refs", TD_CHAN_RECV, 5000, &ch), 0);
  td_storage *p, *s;
  td_view v;
  CHECK_ERR(c, td_chan_recv(ch, 5000, &p, &v), 0);
  CHECK(td_storage_nbytes(p) == 2 * SLOT_BYTES && filled(p, 7));
  CHECK_ERR(c, td_chan_recv(ch, 5000, &s, &v), 0);
  CHECK(filled(s, 8));
  CHECK(write(j->told[1], "h", 1) == 1);
  char b;
  CHECK(read(j->die[0], &b, 1) == 1);
  raise(SIGKILL);
  return 1;
}

TDT_TEST(chan_faults, references_are_counted_and_named) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 4, .slots = 2, .slot_bytes = SLOT_BYTES};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "refs", &o, &ch), 0, "%s", td_last_error(c));
  listed l = chan_listed(c, "refs");
  cr_assert(l.found && l.info.nslot_ids == 2);
  /* The slots are the channel's, and only its. */
  for (int i = 0; i < 2; i++)
    assert_held_by_chan(c, l.slot_ids[i]);
  cr_assert_eq(tdt_storages(&d), 2);
  /* A plain storage sent, its sender dead, no one has received it: the
   * channel holds it. */
  cr_assert_eq(tdt_wait(tdt_fork(plain_then_die, NULL)), 128 + SIGKILL);
  cr_assert_eq(tdt_storages(&d), 3);
  l = chan_listed(c, "refs");
  cr_assert_eq(l.info.in_flight, 1);
  uint64_t plain = 0;
  for (uint64_t id = 1; id < 100 && plain == 0; id++)
    if (id != l.slot_ids[0] && id != l.slot_ids[1] && holders_of(c, id).found)
      plain = id;
  cr_assert_neq(plain, 0);
  assert_held_by_chan(c, plain);
  /* A slot on loan is ours, listed as such; sent, it is queued. */
  td_storage *s;
  cr_assert_eq(td_chan_loan(ch, 0, &s), 0, "%s", td_last_error(c));
  l = chan_listed(c, "refs");
  const td_chan_end_info *me = end_of(&l, getpid());
  cr_assert(me != NULL && me->loaned == 1 && me->held == 0);
  cr_assert_eq(l.info.slots_loaned, 1);
  fill(td_storage_data(s), SLOT_BYTES, 8);
  td_view v = bytes_view(SLOT_BYTES);
  cr_assert_eq(td_chan_send(ch, s, &v, 0), 0, "%s", td_last_error(c));
  l = chan_listed(c, "refs");
  cr_assert_eq(l.info.slots_queued, 1);
  cr_assert_eq(l.info.depth, 2);
  /* A receiver holds both: the plain storage is now its own reference, the
   * slot still the channel's, held by its end. */
  static hold_job hj;
  cr_assert_eq(pipe(hj.told), 0);
  cr_assert_eq(pipe(hj.die), 0);
  pid_t r = tdt_fork(receive_and_hold, &hj);
  char b;
  cr_assert_eq(read(hj.told[0], &b, 1), 1, "the receiver failed");
  holders hs = holders_of(c, plain);
  cr_assert(hs.found && hs.n == 1);
  cr_assert_eq(hs.h[0].pid, r);
  l = chan_listed(c, "refs");
  cr_assert_eq(l.info.in_flight, 0);
  cr_assert_eq(l.info.slots_held, 1);
  const td_chan_end_info *re = end_of(&l, r);
  cr_assert(re != NULL && re->held == 1 && re->loaned == 0);
  assert_held_by_chan(c, l.slot_ids[0]);
  assert_held_by_chan(c, l.slot_ids[1]);
  /* It dies: the plain storage goes with it, the slot comes back. */
  cr_assert_eq(write(hj.die[1], "d", 1), 1);
  cr_assert_eq(tdt_wait(r), 128 + SIGKILL);
  cr_assert(await_counts(ch, (counts){2, 0, 0, 0, 1, 1}));
  cr_assert_eq(tdt_storages(&d), 2);
  cr_assert(!holders_of(c, plain).found);
  for (int i = 0; i < 4; i++)
    close(i < 2 ? hj.told[i] : hj.die[i - 2]);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

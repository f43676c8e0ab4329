/* test_scopes.c: what the Python package of issue 9 relies on, across real
 * processes: copy-on-write mappings (TD_COW), which a process may write
 * without a fault and without anyone else seeing it, and scopes, whose keys
 * outlive their publisher and go with the connection that opened the
 * scope. Their journaling (--state-dir) is tested in test_durability.c. */
#include "harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

TestSuite(cow, .init = setup, .fini = tdt_cleanup, .timeout = 30);
TestSuite(scopes, .init = setup, .fini = tdt_cleanup, .timeout = 30);

#define KiB ((size_t)1024)
#define MiB (1024 * KiB)
#define PAGE ((size_t)4096)

/* ---- helpers ---- */

static uint8_t pat(size_t i, unsigned seed) {
  return (uint8_t)(i * 31 + seed + i / 4093);
}

static void fill(td_storage *s, unsigned seed) {
  uint8_t *p = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    p[i] = pat(i, seed);
}

/* Returns how many bytes of s differ from pattern seed. */
static size_t off_pattern(const td_storage *s, unsigned seed) {
  const uint8_t *p = td_storage_data(s);
  size_t bad = 0;
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    bad += p[i] != pat(i, seed);
  return bad;
}

/* Creates a storage of n bytes filled with pattern seed; asserts. */
static td_storage *make(td_client *c, size_t n, unsigned seed) {
  td_storage *s = NULL;
  cr_assert_eq(td_storage_create(c, n, &s), 0, "create of %zu: %s", n,
               td_last_error(c));
  fill(s, seed);
  return s;
}

static td_stat stat_of(td_client *c) {
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  return st;
}

/* Polls until tensord has n keys (a connection's end is handled when the
 * daemon sees it, not when td_close returns). */
static void keys_become(td_client *c, uint64_t n) {
  td_stat st = stat_of(c);
  for (int i = 0; i < 2500 && st.keys != n; i++) {
    tdt_sleep_ms(2);
    st = stat_of(c);
  }
  cr_assert_eq(st.keys, n, "tensord has %llu key(s), not %llu",
               (unsigned long long)st.keys, (unsigned long long)n);
}

static int want_segments;
static int segments_are(const tdt_daemon *dd) {
  return tdt_segments(dd) == want_segments;
}
static void segments_become(int n) {
  want_segments = n;
  cr_assert(tdt_until(segments_are, &d, 5000), "%d segment(s), not %d",
            tdt_segments(&d), n);
}

/* The references the connection of process pid holds on storage id (0 if
 * it is no holder). */
typedef struct holding {
  int32_t pid;
  uint32_t refs;
} holding;
static int holding_cb(const td_storage_info *info, void *arg) {
  holding *h = arg;
  for (size_t i = 0; i < info->nholders; i++)
    if (info->holders[i].pid == h->pid)
      h->refs = info->holders[i].refs;
  return 0;
}
static uint32_t refs_of(td_client *c, uint64_t id, pid_t pid) {
  holding h = {(int32_t)pid, 0};
  cr_assert_eq(td_info(c, id, NULL, holding_cb, NULL, &h), 0, "info %llu: %s",
               (unsigned long long)id, td_last_error(c));
  return h.refs;
}

/* Inside a child: connects to d; returns NULL after saying why. */
static td_client *child_connect(void) {
  td_client *c = NULL;
  if (td_connect(d.sock, &c) != 0)
    fprintf(stderr, "pid %d: td_connect: %s\n", (int)getpid(),
            td_last_error(NULL));
  return c;
}

/* Inside a child: the bytes of s from off for n bytes are pattern seed. */
static int child_pattern(const td_storage *s, size_t off, size_t n,
                         unsigned seed) {
  const uint8_t *p = td_storage_data(s);
  for (size_t i = off; i < off + n; i++)
    if (p[i] != pat(i, seed)) {
      fprintf(stderr, "byte %zu of storage %llu is 0x%02x, not 0x%02x\n", i,
              (unsigned long long)td_storage_id(s), p[i], pat(i, seed));
      return 0;
    }
  return 1;
}

/* Runs fn(arg) in a child and asserts it exited 0 (a fault shows as 128 +
 * SIGSEGV or SIGBUS). */
#define run_child(fn, arg)                                                     \
  do {                                                                         \
    int st_ = tdt_wait(tdt_fork(fn, arg));                                     \
    cr_assert_eq(st_, 0, "%s: child exited %d%s", #fn, st_,                    \
                 st_ == 128 + SIGSEGV || st_ == 128 + SIGBUS                   \
                     ? " (killed by a fault)"                                  \
                     : "");                                                    \
  } while (0)

/* ---- TD_COW ---- */

typedef struct cow_job {
  const char *key;
  uint64_t id;
  size_t n;
  unsigned seed;
} cow_job;

/* Writes through cow the bytes a test looks for: the first and last byte and
 * a whole page in the middle. Returns 1 if the writer sees them. */
static int scribble(td_storage *cow) {
  uint8_t *p = td_storage_data(cow);
  size_t n = td_storage_nbytes(cow), mid = n / 2 / PAGE * PAGE;
  size_t len = n - mid < PAGE ? n - mid : PAGE;
  p[0] = 0xee;
  p[n - 1] = 0xee;
  memset(p + mid, 0xee, len);
  return p[0] == 0xee && p[n - 1] == 0xee && p[mid] == 0xee &&
         p[mid + len - 1] == 0xee;
}

/* Whether s shows scribble's writes. */
static int scribbled(const td_storage *s) {
  const uint8_t *p = td_storage_data(s);
  size_t n = td_storage_nbytes(s);
  return p[0] == 0xee && p[n - 1] == 0xee && p[n / 2 / PAGE * PAGE] == 0xee;
}

/* Looks the key up TD_COW and writes through the mapping; a plain TD_RDONLY
 * lookup in the same process (its second read-only reference: the daemon
 * sends no fd) still sees the storage's bytes. */
static int cow_writer(void *arg) {
  const cow_job *j = arg;
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *cow = NULL, *ro = NULL;
  td_view v;
  CHECK_ERR(c, td_lookup(c, j->key, TD_COW, 0, &cow, &v), 0);
  CHECK(td_storage_is_readonly(cow) == 1);
  CHECK(td_storage_nbytes(cow) == j->n);
  CHECK(v.ndim == 1 && v.shape[0] == (int64_t)j->n);
  CHECK(child_pattern(cow, 0, j->n, j->seed));
  CHECK(scribble(cow));
  CHECK_ERR(c, td_lookup(c, j->key, TD_RDONLY, 0, &ro, NULL), 0);
  CHECK(td_storage_is_readonly(ro) == 1);
  CHECK(td_storage_data(ro) != td_storage_data(cow));
  CHECK(child_pattern(ro, 0, j->n, j->seed));
  CHECK(scribbled(cow)); /* and its own writes stay */
  td_storage_release(ro);
  td_storage_release(cow);
  td_close(c);
  return 0;
}

/* A plain read-only reader in another process sees the storage's bytes. */
static int ro_reader(void *arg) {
  const cow_job *j = arg;
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *ro = NULL;
  CHECK_ERR(c, td_lookup(c, j->key, TD_RDONLY, 0, &ro, NULL), 0);
  CHECK(child_pattern(ro, 0, j->n, j->seed));
  td_storage_release(ro);
  td_close(c);
  return 0;
}

/* A COW reader of another process writes; the owner's read-write mapping,
 * a plain reader of a third process, and the owner's own COW handle still
 * see the storage's bytes. */
static void cow_writes_stay_private(size_t n) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, n, 5);
  cr_assert_eq(td_publish(c, "cow/k", s, NULL), 0, "%s", td_last_error(c));
  cow_job j = {"cow/k", td_storage_id(s), n, 5};
  run_child(cow_writer, &j);
  cr_assert_eq(off_pattern(s, 5), 0, "the owner sees a COW reader's writes");
  run_child(ro_reader, &j);

  /* In the owner's process too: its own COW handle is a mapping apart. */
  td_storage *cow = NULL;
  cr_assert_eq(td_lookup(c, "cow/k", TD_COW, 0, &cow, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(td_storage_is_readonly(cow), 1);
  cr_assert_neq(td_storage_data(cow), td_storage_data(s));
  cr_assert(scribble(cow));
  cr_assert_eq(off_pattern(s, 5), 0, "the read-write mapping sees COW writes");
  run_child(ro_reader, &j);
  /* A page the COW handle never wrote shows the segment as it is now; one
   * it wrote keeps the process's copy. */
  uint8_t *w = td_storage_data(s);
  const uint8_t *r = td_storage_data(cow);
  size_t untouched = 2 * PAGE + 5;
  w[untouched] = 0x77;
  w[0] = 0x66;
  cr_assert_eq(r[untouched], 0x77,
               "a later write is not seen on a page the "
               "COW handle never wrote");
  cr_assert_eq(r[0], 0xee, "the owner's write replaced the COW copy");
  w[untouched] = pat(untouched, 5);
  w[0] = pat(0, 5);
  cr_assert_eq(td_storage_release(cow), 0);
  cr_assert_eq(td_unpublish(c, "cow/k"), 0);
  td_storage_release(s);
  td_close(c);
  segments_become(0);
}

TDT_TEST(cow, small_writes_through_a_cow_lookup_stay_in_the_writer) {
  cow_writes_stay_private(3 * PAGE + 100);
}

/* 4 MiB: populated at its first touch (MADV_POPULATE_READ), warm-sized. */
TDT_TEST(cow, big_writes_through_a_cow_lookup_stay_in_the_writer) {
  cow_writes_stay_private(4 * MiB);
}

/* td_storage_open with TD_COW and TD_COW | TD_RDONLY: one mapping for both
 * handles; it goes with the last, and a new one starts from the segment
 * again (a COW mapping is never kept warm, even at 2 MiB). */
static int cow_opener(void *arg) {
  const cow_job *j = arg;
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *a = NULL, *b = NULL;
  CHECK_ERR(c, td_storage_open(c, j->id, TD_COW, &a), 0);
  CHECK_ERR(c, td_storage_open(c, j->id, TD_COW | TD_RDONLY, &b), 0);
  CHECK(td_storage_is_readonly(a) == 1 && td_storage_is_readonly(b) == 1);
  CHECK(td_storage_data(a) == td_storage_data(b));
  CHECK(child_pattern(a, 0, j->n, j->seed));
  CHECK(scribble(a));
  CHECK(scribbled(b));
  td_storage_release(a);
  CHECK(scribbled(b)); /* b still holds the mapping */
  td_storage_release(b);
  CHECK_ERR(c, td_storage_open(c, j->id, TD_COW, &a), 0);
  CHECK(child_pattern(a, 0, j->n, j->seed));
  td_storage_release(a);
  td_close(c);
  return 0;
}

TDT_TEST(cow, open_with_cow_shares_one_mapping_never_kept_warm) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 2 * MiB, 9);
  cow_job j = {NULL, td_storage_id(s), 2 * MiB, 9};
  run_child(cow_opener, &j);
  cr_assert_eq(off_pattern(s, 9), 0);
  cr_assert_eq(refs_of(c, j.id, getpid()), 1, "only the creator's reference");
  cr_assert_eq(td_storage_release(s), 0);
  td_close(c);
  segments_become(0);
}

TDT_TEST(cow, flags_beyond_rdonly_take_cow_and_lazy_are_einval) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, PAGE, 1), *t = NULL;
  cr_assert_eq(td_publish(c, "cow/flags", s, NULL), 0);
  cr_assert_eq(td_storage_open(c, td_storage_id(s), TD_COW | 0x20, &t),
               TD_EINVAL);
  cr_assert_null(t);
  cr_assert_eq(td_storage_open(c, td_storage_id(s), TD_COW | TD_TAKE, &t),
               TD_EINVAL, "TD_TAKE is no open flag");
  cr_assert_eq(td_lookup(c, "cow/flags", TD_COW | 0x20, 0, &t, NULL),
               TD_EINVAL);
  cr_assert_null(t);
  /* TD_COW | TD_TAKE takes the key, read-only and private. */
  cr_assert_eq(td_lookup(c, "cow/flags", TD_COW | TD_TAKE, 0, &t, NULL), 0,
               "%s", td_last_error(c));
  cr_assert_eq(td_storage_is_readonly(t), 1);
  cr_assert(scribble(t));
  cr_assert_eq(off_pattern(s, 1), 0);
  td_storage *none = NULL;
  cr_assert_eq(td_lookup(c, "cow/flags", 0, 0, &none, NULL), TD_ENOENT,
               "the key was taken");
  td_storage_release(t);
  td_storage_release(s);
  td_close(c);
}

/* A TD_COW handle after a plain read-only one in the same process: the
 * daemon sends no fd for a second read-only reference, and the library
 * asks again for one to map privately (make_handle's retry); and the other
 * way round. The reference the retry borrows is given back. */
typedef struct retry_job {
  const char *key;
  uint64_t id;
  size_t n;
  int fd[2]; /* the child says "ready" then waits for the parent */
  int go[2];
} retry_job;

static int cow_after_ro(void *arg) {
  retry_job *j = arg;
  close(j->fd[0]);
  close(j->go[1]);
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *ro = NULL, *cow = NULL, *ro2 = NULL;
  CHECK_ERR(c, td_lookup(c, j->key, TD_RDONLY, 0, &ro, NULL), 0);
  CHECK_ERR(c, td_lookup(c, j->key, TD_COW, 0, &cow, NULL), 0);
  CHECK(td_storage_data(cow) != td_storage_data(ro));
  CHECK(child_pattern(cow, 0, j->n, 2));
  CHECK(scribble(cow));
  CHECK(child_pattern(ro, 0, j->n, 2));
  td_storage_release(ro);
  /* The COW handle alone now; a plain one again takes the same road. */
  CHECK_ERR(c, td_storage_open(c, j->id, TD_RDONLY, &ro2), 0);
  CHECK(child_pattern(ro2, 0, j->n, 2));
  CHECK(scribbled(cow));
  /* Two handles, two references: once the daemon has read the release of
   * the reference the retry borrowed (the ping's reply comes after it),
   * tell the parent, and wait for its check. */
  CHECK_ERR(c, td_ping(c, NULL), 0);
  char b = 'r';
  CHECK(write(j->fd[1], &b, 1) == 1);
  CHECK(read(j->go[0], &b, 1) == 1);
  td_storage_release(cow);
  td_storage_release(ro2);
  td_close(c);
  return 0;
}

TDT_TEST(cow, cow_and_plain_read_only_handles_in_one_process) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  size_t n = 1 * MiB;
  td_storage *s = make(c, n, 2);
  cr_assert_eq(td_publish(c, "cow/retry", s, NULL), 0);
  retry_job j = {"cow/retry", td_storage_id(s), n, {-1, -1}, {-1, -1}};
  cr_assert_eq(pipe(j.fd), 0);
  cr_assert_eq(pipe(j.go), 0);
  pid_t pid = tdt_fork(cow_after_ro, &j);
  close(j.fd[1]);
  close(j.go[0]);
  char b = 0;
  ssize_t got = read(j.fd[0], &b, 1);
  close(j.fd[0]);
  if (got != 1) {
    close(j.go[1]);
    cr_assert_fail("the child failed before its check (exit %d)",
                   tdt_wait(pid));
  }
  uint32_t refs = refs_of(c, j.id, pid);
  cr_assert_eq(write(j.go[1], "g", 1), 1);
  close(j.go[1]);
  int st = tdt_wait(pid);
  cr_assert_eq(st, 0, "child exited %d", st);
  cr_assert_eq(refs, 2, "the child holds %u reference(s) for its 2 handles",
               refs);
  cr_assert_eq(off_pattern(s, 2), 0);
  cr_assert_eq(td_unpublish(c, "cow/retry"), 0);
  /* The child's connection ends when the daemon reads its close. */
  for (int i = 0; i < 2500 && (refs = refs_of(c, j.id, pid)) != 0; i++)
    tdt_sleep_ms(2);
  cr_assert_eq(refs, 0, "the child's references went");
  td_storage_release(s);
  td_close(c);
  segments_become(0);
}

TDT_TEST(cow, publish_and_copy_into_a_cow_handle_are_eacces) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, PAGE, 4), *cow = NULL;
  cr_assert_eq(td_publish(c, "cow/ro", s, NULL), 0);
  cr_assert_eq(td_storage_open(c, td_storage_id(s), TD_COW, &cow), 0);
  cr_assert_eq(td_publish(c, "cow/again", cow, NULL), TD_EACCES);
  cr_assert(strstr(td_last_error(c), "read-only") != NULL, "%s",
            td_last_error(c));
  td_publish_opts o = {0};
  cr_assert_eq(td_publish_ex(c, "cow/again", cow, NULL, &o), TD_EACCES);
  td_view v;
  int64_t shape = (int64_t)PAGE;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, &shape, &v), 0);
  cr_assert_eq(td_copy(cow, &v, s, &v), TD_EACCES);
  cr_assert(strstr(td_view_last_error(), "read-only") != NULL, "%s",
            td_view_last_error());
  /* Reading from it is fine: it copies what this process sees. */
  cr_assert(scribble(cow));
  cr_assert_eq(td_copy(s, &v, cow, &v), 0, "%s", td_view_last_error());
  cr_assert(scribbled(s));
  td_storage *t;
  cr_assert_eq(td_lookup(c, "cow/again", 0, 0, &t, NULL), TD_ENOENT);
  td_storage_release(cow);
  td_storage_release(s);
  td_close(c);
}

/* A COW mapping holds the process's own writes, not the segment's bytes:
 * were it kept warm, the next storage recycled onto the same segment
 * (same inode, same size) would show them to a new COW handle. */
TDT_TEST(cow, a_recycled_segment_shows_its_new_bytes_to_a_new_cow_handle) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  size_t n = 2 * MiB;
  td_storage *s = make(c, n, 6), *cow = NULL;
  cr_assert_eq(td_publish(c, "cow/recycled", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "cow/recycled", TD_COW, 0, &cow, NULL), 0);
  memset(td_storage_data(cow), 0xee, n); /* every page private now */
  cr_assert_eq(td_storage_release(cow), 0);
  cr_assert_eq(td_unpublish(c, "cow/recycled"), 0);
  cr_assert_eq(td_storage_release(s), 0);
  td_stat st = stat_of(c);
  for (int i = 0; i < 2500 && st.pool_segments != 1; i++) {
    tdt_sleep_ms(2);
    st = stat_of(c);
  }
  cr_assert_eq(st.pool_segments, 1, "the freed segment was not pooled");
  uint64_t hits = st.pool_hits;

  s = make(c, n, 7);
  cr_assert_eq(stat_of(c).pool_hits, hits + 1, "not served from the pool");
  cr_assert_eq(td_publish(c, "cow/recycled", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "cow/recycled", TD_COW, 0, &cow, NULL), 0);
  cr_assert_eq(off_pattern(cow, 7), 0,
               "a new COW handle shows the old COW mapping's private pages");
  td_storage_release(cow);
  cr_assert_eq(td_unpublish(c, "cow/recycled"), 0);
  td_storage_release(s);
  td_close(c);
}

/* fork: the child inherits the COW mapping with the parent's private writes
 * made before the fork; its own writes stay its own; its release of the
 * inherited handle sends nothing; a COW handle of its own connection starts
 * from the segment's bytes. */
typedef struct fork_job {
  td_storage *inherited;
  const char *key;
  size_t n;
} fork_job;

static int cow_child(void *arg) {
  const fork_job *j = arg;
  uint8_t *p = td_storage_data(j->inherited);
  CHECK(p[0] == 0xaa); /* the parent's private write */
  CHECK(child_pattern(j->inherited, 1, j->n - 1, 8));
  p[1] = 0xbb; /* no fault: still a private mapping */
  CHECK(p[1] == 0xbb);
  CHECK(td_storage_release(j->inherited) == 0);
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *mine = NULL;
  CHECK_ERR(c, td_lookup(c, j->key, TD_COW, 0, &mine, NULL), 0);
  CHECK(child_pattern(mine, 0, j->n, 8));
  td_storage_release(mine);
  td_close(c);
  return 0;
}

TDT_TEST(cow, a_forked_child_inherits_the_cow_mapping) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  size_t n = 64 * KiB;
  td_storage *s = make(c, n, 8), *cow = NULL;
  cr_assert_eq(td_publish(c, "cow/fork", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "cow/fork", TD_COW, 0, &cow, NULL), 0);
  uint8_t *p = td_storage_data(cow);
  p[0] = 0xaa;
  fork_job j = {cow, "cow/fork", n};
  run_child(cow_child, &j);
  cr_assert_eq(p[0], 0xaa);
  cr_assert_eq(p[1], pat(1, 8), "the parent sees its child's private write");
  cr_assert_eq(off_pattern(s, 8), 0);
  cr_assert_eq(refs_of(c, td_storage_id(s), getpid()), 2,
               "the parent's references (its RW handle and COW handle) hold");
  td_storage_release(cow);
  cr_assert_eq(td_unpublish(c, "cow/fork"), 0);
  td_storage_release(s);
  td_close(c);
  segments_become(0);
}

/* ---- scopes ---- */

static uint64_t open_scope(td_client *c) {
  uint64_t t = 0;
  cr_assert_eq(td_scope_open(c, &t), 0, "scope open: %s", td_last_error(c));
  cr_assert_neq(t, 0, "a scope token is never 0");
  return t;
}

static void hex(char *buf, size_t len, uint64_t token) {
  snprintf(buf, len, "%016llx", (unsigned long long)token);
}

/* Publishes s under key into scope; asserts. */
static void publish_in(td_client *c, const char *key, td_storage *s,
                       uint64_t scope) {
  td_publish_opts o = {0};
  o.scope = scope;
  cr_assert_eq(td_publish_ex(c, key, s, NULL, &o), 0, "publish '%s': %s", key,
               td_last_error(c));
}

TDT_TEST(scopes, tokens_are_distinct_and_close_ends_each_once) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *c2 = tdt_connect(&d);
  enum { N = 16 };
  uint64_t t[N];
  for (int i = 0; i < N; i++) {
    t[i] = open_scope(i % 2 ? c2 : c);
    for (int k = 0; k < i; k++)
      cr_assert_neq(t[i], t[k], "scopes %d and %d share token %016llx", i, k,
                    (unsigned long long)t[i]);
  }
  for (int i = 0; i < N; i++) {
    uint64_t dropped = 99;
    td_client *o = i % 2 ? c2 : c;
    cr_assert_eq(td_scope_close(o, t[i], &dropped), 0, "%s", td_last_error(o));
    cr_assert_eq(dropped, 0);
    char h[20];
    hex(h, sizeof(h), t[i]);
    cr_assert_eq(td_scope_close(o, t[i], NULL), TD_ENOENT, "closed twice");
    cr_assert(strstr(td_last_error(o), h) != NULL, "'%s' names not %s",
              td_last_error(o), h);
  }
  cr_assert_eq(td_scope_close(c, 0, NULL), TD_ENOENT);
  td_close(c2);
  td_close(c);
}

/* A child publishes into the parent's scope and exits; another takes. */
typedef struct flight {
  const char *key;
  uint64_t scope;
  size_t n;
  unsigned seed;
  unsigned flags;
  int expect; /* td_publish_ex's result (publisher) */
} flight;

static int publisher(void *arg) {
  const flight *f = arg;
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *s = NULL;
  CHECK_ERR(c, td_storage_create(c, f->n, &s), 0);
  fill(s, f->seed);
  td_publish_opts o = {0};
  o.scope = f->scope;
  CHECK_ERR(c, td_publish_ex(c, f->key, s, NULL, &o), f->expect);
  td_storage_release(s);
  td_close(c);
  return 0;
}

/* Looks the key up with f->flags, waiting up to 10 s; exits 0 if it has
 * the publisher's bytes. */
static int receiver(void *arg) {
  const flight *f = arg;
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *s = NULL;
  CHECK_ERR(c, td_lookup(c, f->key, f->flags, 10000, &s, NULL), 0);
  CHECK(td_storage_nbytes(s) == f->n);
  CHECK(child_pattern(s, 0, f->n, f->seed));
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(scopes, a_key_in_flight_outlives_its_publisher_until_taken) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  uint64_t t = open_scope(c);
  flight f = {"scope/batch", t, 256 * KiB, 3, TD_TAKE, 0};
  run_child(publisher, &f); /* gone before anyone takes */
  cr_assert_eq(stat_of(c).keys, 1);
  cr_assert_eq(tdt_segments(&d), 1, "the key holds the storage");
  run_child(receiver, &f); /* another process takes it */
  td_storage *s;
  cr_assert_eq(td_lookup(c, "scope/batch", 0, 0, &s, NULL), TD_ENOENT,
               "taken, so gone");
  segments_become(0);
  uint64_t dropped = 99;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0, "%s", td_last_error(c));
  cr_assert_eq(dropped, 0, "nothing was left in the scope");
  td_close(c);
}

TDT_TEST(scopes, close_unpublishes_its_keys_and_frees_their_storages) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  uint64_t t = open_scope(c), other = open_scope(c);
  flight a = {"scope/a", t, 64 * KiB, 1, 0, 0};
  flight b = {"scope/b", t, PAGE, 2, 0, 0};
  flight o = {"scope/other", other, PAGE, 3, 0, 0};
  flight plain = {"plain", 0, PAGE, 4, 0, 0};
  run_child(publisher, &a);
  run_child(publisher, &b);
  run_child(publisher, &o);
  run_child(publisher, &plain);
  /* Lookups (not takes) leave a scoped key where it is. */
  run_child(receiver, &a);
  cr_assert_eq(stat_of(c).keys, 4);
  cr_assert_eq(tdt_segments(&d), 4);
  uint64_t dropped = 0;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0, "%s", td_last_error(c));
  cr_assert_eq(dropped, 2);
  cr_assert_eq(stat_of(c).keys, 2, "scope/a and scope/b went at once");
  segments_become(2);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "scope/a", 0, 0, &s, NULL), TD_ENOENT);
  cr_assert_eq(td_lookup(c, "scope/b", 0, 0, &s, NULL), TD_ENOENT);
  run_child(receiver, &o); /* another scope is untouched */
  run_child(receiver, &plain);
  /* A key unpublished before the end is not counted. */
  cr_assert_eq(td_unpublish(c, "scope/other"), 0);
  cr_assert_eq(td_scope_close(c, other, &dropped), 0);
  cr_assert_eq(dropped, 0);
  cr_assert_eq(td_unpublish(c, "plain"), 0);
  td_close(c);
  segments_become(0);
}

TDT_TEST(scopes, td_close_of_the_owner_drops_the_scopes_keys) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *owner = tdt_connect(&d);
  uint64_t t = open_scope(owner), t2 = open_scope(owner);
  td_storage *s = make(c, 128 * KiB, 1);
  publish_in(c, "scope/1", s, t);
  publish_in(c, "scope/2", s, t2);
  cr_assert_eq(td_publish(c, "plain", s, NULL), 0);
  td_storage_release(s);
  td_close(owner);
  keys_become(c, 1);
  td_storage *l;
  cr_assert_eq(td_lookup(c, "plain", TD_RDONLY, 0, &l, NULL), 0);
  cr_assert_eq(off_pattern(l, 1), 0);
  td_storage_release(l);
  cr_assert_eq(td_unpublish(c, "plain"), 0);
  segments_become(0);
  /* Ended with its connection: nobody can close or publish into it. */
  cr_assert_eq(td_scope_close(c, t, NULL), TD_ENOENT);
  td_close(c);
}

/* A scope owner that tells its token through a pipe, then waits to die. */
typedef struct owner_job {
  int tok[2];
  int hold[2];
} owner_job;

static int scope_owner(void *arg) {
  owner_job *j = arg;
  close(j->tok[0]);
  close(j->hold[1]);
  td_client *c = child_connect();
  CHECK(c != NULL);
  uint64_t t = 0;
  CHECK_ERR(c, td_scope_open(c, &t), 0);
  CHECK(write(j->tok[1], &t, sizeof(t)) == (ssize_t)sizeof(t));
  char b;
  (void)!read(j->hold[0], &b, 1); /* until killed, or the pipe closes */
  return 3;
}

/* Starts scope_owner in a child; returns its pid and its token. */
static pid_t start_owner(owner_job *j, uint64_t *token) {
  cr_assert_eq(pipe(j->tok), 0);
  cr_assert_eq(pipe(j->hold), 0);
  pid_t pid = tdt_fork(scope_owner, j);
  close(j->tok[1]);
  close(j->hold[0]);
  ssize_t got = read(j->tok[0], token, sizeof(*token));
  close(j->tok[0]);
  if (got != (ssize_t)sizeof(*token)) {
    close(j->hold[1]);
    cr_assert_fail("the scope owner said no token (exit %d)", tdt_wait(pid));
  }
  return pid;
}

TDT_TEST(scopes, a_sigkilled_owner_takes_the_scopes_keys_with_it) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  owner_job j;
  uint64_t t = 0;
  pid_t pid = start_owner(&j, &t);
  td_storage *s1 = make(c, 1 * MiB, 1), *s2 = make(c, PAGE, 2);
  publish_in(c, "scope/big", s1, t);
  publish_in(c, "scope/small", s2, t);
  td_storage_release(s1);
  td_storage_release(s2);
  cr_assert_eq(stat_of(c).keys, 2);
  cr_assert_eq(tdt_segments(&d), 2, "the keys hold both storages");
  cr_assert_eq(kill(pid, SIGKILL), 0);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  close(j.hold[1]);
  keys_become(c, 0);
  segments_become(0);
  td_close(c);
}

TDT_TEST(scopes, publish_into_an_ended_or_unknown_scope_is_enoent) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *gone = tdt_connect(&d);
  td_storage *s = make(c, PAGE, 1), *l;
  uint64_t closed = open_scope(c), of_gone = open_scope(gone);
  cr_assert_eq(td_scope_close(c, closed, NULL), 0);
  td_close(gone);
  const uint64_t tokens[] = {closed, of_gone, 0x0123456789abcdefull};
  td_publish_opts o = {0};
  for (size_t i = 0; i < 3; i++) {
    /* The owner's close lands when the daemon reads it: poll for it. */
    int err = TD_EINVAL;
    o.scope = tokens[i];
    for (int k = 0; k < 2500; k++) {
      err = td_publish_ex(c, "scope/late", s, NULL, &o);
      if (err != 0)
        break;
      cr_assert_eq(td_unpublish(c, "scope/late"), 0);
      tdt_sleep_ms(2);
    }
    cr_assert_eq(err, TD_ENOENT, "scope %zu: %s", i, td_last_error(c));
    char h[20];
    hex(h, sizeof(h), tokens[i]);
    cr_assert(strstr(td_last_error(c), h) != NULL, "'%s' names not %s",
              td_last_error(c), h);
    cr_assert(strstr(td_last_error(c), "scope/late") != NULL, "%s",
              td_last_error(c));
    cr_assert_eq(td_lookup(c, "scope/late", 0, 0, &l, NULL), TD_ENOENT);
  }
  cr_assert_eq(stat_of(c).keys, 0);
  td_storage_release(s);
  td_close(c);
}

/* A scoped publish never replaces a key, scoped or not: the key keeps its
 * storage and view. */
TDT_TEST(scopes, a_scoped_publish_over_an_existing_key_is_eexist) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  uint64_t t = open_scope(c);
  td_storage *s1 = make(c, PAGE, 1), *s2 = make(c, PAGE, 2), *l;
  td_view v1, got;
  int64_t shape = 16;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, &shape, &v1), 0);
  v1.offset = 4;
  cr_assert_eq(td_publish(c, "exists/plain", s1, &v1), 0);
  publish_in(c, "exists/scoped", s1, t);
  const char *keys[] = {"exists/plain", "exists/scoped"};
  char h[20];
  hex(h, sizeof(h), t);
  td_publish_opts o = {0};
  o.scope = t;
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(td_publish_ex(c, keys[i], s2, NULL, &o), TD_EEXIST, "%s",
                 keys[i]);
    cr_assert_str_eq(td_err_name(TD_EEXIST), "EEXIST");
    cr_assert(strstr(td_last_error(c), keys[i]) != NULL, "%s",
              td_last_error(c));
    cr_assert(strstr(td_last_error(c), h) != NULL, "%s", td_last_error(c));
    cr_assert_eq(td_lookup(c, keys[i], TD_RDONLY, 0, &l, &got), 0);
    cr_assert_eq(td_storage_id(l), td_storage_id(s1), "%s was replaced",
                 keys[i]);
    td_storage_release(l);
  }
  cr_assert_eq(got.ndim, 1);
  cr_assert_eq(td_lookup(c, "exists/plain", TD_RDONLY, 0, &l, &got), 0);
  cr_assert_eq(got.dtype, TD_FLOAT32);
  cr_assert_eq(got.offset, 4, "the view changed");
  td_storage_release(l);
  uint64_t dropped = 0;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0);
  cr_assert_eq(dropped, 1, "only exists/scoped was in the scope");
  cr_assert_eq(stat_of(c).keys, 1);
  cr_assert_eq(td_unpublish(c, "exists/plain"), 0);
  td_storage_release(s1);
  td_storage_release(s2);
  td_close(c);
  segments_become(0);
}

TDT_TEST(scopes, an_ordinary_publish_over_a_scoped_key_makes_it_ordinary) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  uint64_t t = open_scope(c);
  td_storage *s1 = make(c, PAGE, 1), *s2 = make(c, 2 * PAGE, 2), *l;
  publish_in(c, "becomes/plain", s1, t);
  publish_in(c, "stays/scoped", s1, t);
  cr_assert_eq(td_publish(c, "becomes/plain", s2, NULL), 0, "%s",
               td_last_error(c));
  uint64_t id2 = td_storage_id(s2);
  td_storage_release(s1);
  td_storage_release(s2);
  uint64_t dropped = 0;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0);
  cr_assert_eq(dropped, 1, "the replaced key left its scope");
  cr_assert_eq(td_lookup(c, "becomes/plain", TD_RDONLY, 0, &l, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(td_storage_id(l), id2);
  cr_assert_eq(off_pattern(l, 2), 0);
  td_storage_release(l);
  cr_assert_eq(td_lookup(c, "stays/scoped", 0, 0, &l, NULL), TD_ENOENT);
  segments_become(1);
  /* The same onto the same storage: the key leaves the scope too. */
  t = open_scope(c);
  cr_assert_eq(td_lookup(c, "becomes/plain", 0, 0, &l, NULL), 0);
  cr_assert_eq(td_unpublish(c, "becomes/plain"), 0);
  publish_in(c, "becomes/plain", l, t);
  cr_assert_eq(td_publish(c, "becomes/plain", l, NULL), 0);
  cr_assert_eq(td_scope_close(c, t, &dropped), 0);
  cr_assert_eq(dropped, 0);
  cr_assert_eq(stat_of(c).keys, 1);
  cr_assert_eq(td_unpublish(c, "becomes/plain"), 0);
  td_storage_release(l);
  td_close(c);
  segments_become(0);
}

TDT_TEST(scopes, closing_another_connections_scope_is_enoent) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *other = tdt_connect(&d);
  uint64_t t = open_scope(c);
  td_storage *s = make(c, PAGE, 1);
  publish_in(c, "mine", s, t);
  td_storage_release(s);
  cr_assert_eq(td_scope_close(other, t, NULL), TD_ENOENT);
  char h[20];
  hex(h, sizeof(h), t);
  cr_assert(strstr(td_last_error(other), h) != NULL, "%s",
            td_last_error(other));
  cr_assert(strstr(td_last_error(other), "another connection") != NULL, "%s",
            td_last_error(other));
  cr_assert_eq(stat_of(c).keys, 1, "the refused close dropped the key");
  /* Anyone of the uid may publish into it, and unpublish from it. */
  s = make(other, PAGE, 2);
  publish_in(other, "theirs", s, t);
  td_storage_release(s);
  uint64_t dropped = 0;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0, "%s", td_last_error(c));
  cr_assert_eq(dropped, 2);
  td_close(other);
  td_close(c);
  segments_become(0);
}

TDT_TEST(scopes, reserved_words_must_be_zero_and_null_opts_is_td_publish) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, PAGE, 1);
  uint64_t t = open_scope(c);
  for (int i = 0; i < 6; i++) {
    td_publish_opts o = {0};
    o.scope = i % 2 ? t : 0;
    o.reserved[i] = 1ull << (i * 9);
    cr_assert_eq(td_publish_ex(c, "reserved", s, NULL, &o), TD_EINVAL,
                 "reserved[%d]", i);
    char want[32];
    snprintf(want, sizeof(want), "reserved[%d]", i);
    cr_assert(strstr(td_last_error(c), want) != NULL, "'%s' names not %s",
              td_last_error(c), want);
  }
  cr_assert_eq(stat_of(c).keys, 0);
  cr_assert_eq(td_publish_ex(c, "null-opts", s, NULL, NULL), 0);
  td_publish_opts zero = {0};
  cr_assert_eq(td_publish_ex(c, "zero-opts", s, NULL, &zero), 0);
  /* Both ordinary: they replace, and they outlive the scope. */
  cr_assert_eq(td_publish_ex(c, "zero-opts", s, NULL, &zero), 0);
  uint64_t dropped = 9;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0);
  cr_assert_eq(dropped, 0);
  cr_assert_eq(stat_of(c).keys, 2);
  cr_assert_eq(td_unpublish(c, "null-opts"), 0);
  cr_assert_eq(td_unpublish(c, "zero-opts"), 0);
  td_storage_release(s);
  td_close(c);
}

static int waiters_are_n;
static int waiters_are(const tdt_daemon *dd) {
  td_client *c = tdt_connect(dd);
  td_stat st;
  int ok = td_stat_get(c, &st) == 0 && st.waiters == (uint64_t)waiters_are_n;
  td_close(c);
  return ok;
}

TDT_TEST(scopes, waiting_lookups_are_answered_by_a_scoped_publish) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  uint64_t t = open_scope(c);
  flight reader = {"wait/batch", t, 32 * KiB, 7, TD_RDONLY, 0};
  flight taker = {"wait/batch", t, 32 * KiB, 7, TD_TAKE, 0};
  pid_t r = tdt_fork(receiver, &reader);
  waiters_are_n = 1;
  cr_assert(tdt_until(waiters_are, &d, 10000), "the reader does not wait");
  pid_t k = tdt_fork(receiver, &taker);
  waiters_are_n = 2;
  cr_assert(tdt_until(waiters_are, &d, 10000), "the taker does not wait");
  run_child(publisher, &reader);
  cr_assert_eq(tdt_wait(r), 0, "the reader");
  cr_assert_eq(tdt_wait(k), 0, "the taker");
  cr_assert_eq(stat_of(c).keys, 0, "taken");
  segments_become(0);
  uint64_t dropped = 9;
  cr_assert_eq(td_scope_close(c, t, &dropped), 0);
  cr_assert_eq(dropped, 0);
  td_close(c);
}

TDT_TEST(scopes, at_most_1024_scopes_per_connection) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *c2 = tdt_connect(&d);
  enum { MAX = 1024 };
  static uint64_t t[MAX];
  for (int i = 0; i < MAX; i++)
    cr_assert_eq(td_scope_open(c, &t[i]), 0, "scope %d: %s", i,
                 td_last_error(c));
  uint64_t extra = 0;
  cr_assert_eq(td_scope_open(c, &extra), TD_EMFILE);
  cr_assert(strstr(td_last_error(c), "1024") != NULL, "%s", td_last_error(c));
  cr_assert_eq(td_scope_open(c2, &extra), 0, "the limit is per connection");
  cr_assert_eq(td_scope_close(c, t[100], NULL), 0);
  cr_assert_eq(td_scope_open(c, &t[100]), 0, "room again after a close: %s",
               td_last_error(c));
  td_storage *s = make(c, PAGE, 1);
  publish_in(c, "last", s, t[MAX - 1]);
  td_storage_release(s);
  td_close(c); /* ends all 1024 */
  keys_become(c2, 0);
  cr_assert_eq(td_scope_close(c2, extra, NULL), 0);
  td_close(c2);
  segments_become(0);
}

/* Opens a scope, publishes into it and an ordinary key, says so through
 * the pipe and waits to be killed, connected. */
static int stays_connected(void *arg) {
  int *fd = arg;
  /* Never outlive a test that failed before it killed us. */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  alarm(30);
  close(fd[0]);
  td_client *c = child_connect();
  CHECK(c != NULL);
  uint64_t t = 0;
  CHECK_ERR(c, td_scope_open(c, &t), 0);
  td_storage *s = NULL;
  CHECK_ERR(c, td_storage_create(c, 64 * KiB, &s), 0);
  td_publish_opts o = {0};
  o.scope = t;
  CHECK_ERR(c, td_publish_ex(c, "stop/scoped", s, NULL, &o), 0);
  CHECK_ERR(c, td_publish(c, "stop/plain", s, NULL), 0);
  CHECK(write(fd[1], "k", 1) == 1);
  close(fd[1]);
  for (;;)
    pause();
}

/* tensord stopping with a scope's owner still connected and keys in the
 * scope leaves nothing. */
TDT_TEST(scopes, a_stop_with_scopes_open_leaves_nothing) {
  tdt_start(&d, NULL);
  int fd[2];
  cr_assert_eq(pipe(fd), 0);
  pid_t pid = tdt_fork(stays_connected, fd);
  close(fd[1]);
  char b = 0;
  ssize_t got = read(fd[0], &b, 1);
  close(fd[0]);
  if (got != 1)
    cr_assert_fail("the client failed (exit %d)", tdt_wait(pid));
  td_client *c = tdt_connect(&d);
  cr_assert_eq(stat_of(c).keys, 2);
  td_close(c);
  tdt_stop(&d); /* asserts that no segment, fd or socket is left */
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
}

/* ---- scopes and uids (root only) ---- */

static void need_root(void) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
}

typedef struct as_job {
  uid_t uid;
  int (*fn)(void *);
  void *arg;
} as_job;

static int as_child(void *p) {
  as_job *j = p;
  if (setgroups(0, NULL) < 0 || setgid(j->uid) < 0 || setuid(j->uid) < 0) {
    fprintf(stderr, "cannot become uid %u: %s\n", (unsigned)j->uid,
            strerror(errno));
    return 2;
  }
  return j->fn(j->arg);
}

static pid_t fork_as(uid_t uid, int (*fn)(void *), void *arg) {
  as_job j = {uid, fn, arg};
  return tdt_fork(as_child, &j);
}

typedef struct uid_job {
  uint64_t scope;
  int expect;
  const char *key;
  const char *want; /* in the message, if expect is an error */
} uid_job;

static int publish_as(void *arg) {
  const uid_job *j = arg;
  td_client *c = child_connect();
  CHECK(c != NULL);
  td_storage *s = NULL;
  CHECK_ERR(c, td_storage_create(c, PAGE, &s), 0);
  td_publish_opts o = {0};
  o.scope = j->scope;
  CHECK_ERR(c, td_publish_ex(c, j->key, s, NULL, &o), j->expect);
  if (j->want != NULL)
    CHECK_MSG(c, j->want);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(scopes, only_the_owners_uid_and_root_publish_into_a_scope) {
  need_root();
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  td_client *c = tdt_connect(&d);
  uint64_t mine = open_scope(c);

  /* Root's scope: uid 4242 may not publish into it. */
  char want[64];
  snprintf(want, sizeof(want), "belongs to uid 0, not to uid 4242");
  uid_job refused = {mine, TD_EACCES, "uid/refused", want};
  int st = tdt_wait(fork_as(4242, publish_as, &refused));
  cr_assert_eq(st, 0, "uid 4242 publishing into root's scope: exit %d", st);
  cr_assert_eq(stat_of(c).keys, 0);

  /* A scope of uid 4242: root may, uid 4242's other processes may, uid
   * 4246 may not. */
  owner_job j;
  uint64_t theirs = 0;
  as_job aj = {4242, scope_owner, &j};
  cr_assert_eq(pipe(j.tok), 0);
  cr_assert_eq(pipe(j.hold), 0);
  pid_t owner = tdt_fork(as_child, &aj);
  close(j.tok[1]);
  close(j.hold[0]);
  ssize_t got = read(j.tok[0], &theirs, sizeof(theirs));
  close(j.tok[0]);
  if (got != (ssize_t)sizeof(theirs)) {
    close(j.hold[1]);
    cr_assert_fail("uid 4242's scope owner said no token (exit %d)",
                   tdt_wait(owner));
  }
  td_storage *s = make(c, PAGE, 1);
  publish_in(c, "uid/by-root", s, theirs);
  td_storage_release(s);
  uid_job same = {theirs, 0, "uid/by-4242", NULL};
  cr_assert_eq(tdt_wait(fork_as(4242, publish_as, &same)), 0);
  snprintf(want, sizeof(want), "belongs to uid 4242, not to uid 4246");
  uid_job stranger = {theirs, TD_EACCES, "uid/by-4246", want};
  cr_assert_eq(tdt_wait(fork_as(4246, publish_as, &stranger)), 0);
  cr_assert_eq(stat_of(c).keys, 2);

  /* The owner goes: both keys go with its scope. */
  cr_assert_eq(kill(owner, SIGKILL), 0);
  cr_assert_eq(tdt_wait(owner), 128 + SIGKILL);
  close(j.hold[1]);
  keys_become(c, 0);
  segments_become(0);
  cr_assert_eq(td_scope_close(c, mine, NULL), 0);
  td_close(c);
}

/* ---- TD_LAZY and td_client_instance ---- */

/* Returns the Rss, in KiB, of this process's mapping that holds addr. */
static long rss_kib(const void *addr) {
  FILE *f = fopen("/proc/self/smaps", "r");
  cr_assert_not_null(f);
  char line[512];
  int inside = 0;
  long rss = -1;
  uintptr_t a = (uintptr_t)addr;
  while (rss < 0 && fgets(line, sizeof(line), f) != NULL) {
    unsigned long lo, hi;
    char c;
    if (sscanf(line, "%lx-%lx %c", &lo, &hi, &c) == 3)
      inside = lo <= a && a < hi;
    else if (inside && strncmp(line, "Rss:", 4) == 0)
      rss = strtol(line + 4, NULL, 10);
  }
  fclose(f);
  cr_assert_geq(rss, 0, "no mapping holds %p", addr);
  return rss;
}

/* A lazy handle maps no page until one is touched; without TD_LAZY a
 * mapping this big is populated at the first td_storage_data. Read-only and
 * copy-on-write (the writer's read-write mapping here is another one). */
TDT_TEST(cow, lazy_maps_no_page_until_touched) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *w = make(c, 4 * MiB, 5);
  cr_assert_eq(td_publish(c, "lazy", w, NULL), 0, "%s", td_last_error(c));
  const unsigned modes[] = {TD_RDONLY, TD_COW};
  for (size_t i = 0; i < 2; i++) {
    td_storage *s = NULL;
    cr_assert_eq(td_lookup(c, "lazy", modes[i] | TD_LAZY, 0, &s, NULL), 0, "%s",
                 td_last_error(c));
    const uint8_t *p = td_storage_data(s);
    cr_assert_eq(rss_kib(p), 0, "mode 0x%x: lazy, yet %ld KiB mapped", modes[i],
                 rss_kib(p));
    cr_assert_eq(p[100 * PAGE], pat(100 * PAGE, 5));
    long touched = rss_kib(p);
    cr_assert(touched > 0 && touched < (long)(4 * MiB / KiB), "%ld KiB",
              touched);
    td_storage_release(s);
    cr_assert_eq(td_lookup(c, "lazy", modes[i], 0, &s, NULL), 0);
    p = td_storage_data(s);
    cr_assert_eq(rss_kib(p), (long)(4 * MiB / KiB), "mode 0x%x: populated",
                 modes[i]);
    td_storage_release(s);
  }
  /* td_storage_open too (copy-on-write: the idle read-only mapping this
   * process keeps while it holds w is populated already, and stays so). */
  td_storage *s = NULL, *s2 = NULL;
  cr_assert_eq(td_storage_open(c, td_storage_id(w), TD_COW | TD_LAZY, &s), 0,
               "%s", td_last_error(c));
  cr_assert_eq(rss_kib(td_storage_data(s)), 0);
  /* A handle without TD_LAZY on the same mapping gets the populate. */
  cr_assert_eq(td_storage_open(c, td_storage_id(w), TD_COW, &s2), 0);
  cr_assert_eq(td_storage_data(s2), td_storage_data(s));
  cr_assert_eq(rss_kib(td_storage_data(s)), (long)(4 * MiB / KiB));
  td_storage_release(s2);
  td_storage_release(s);
  cr_assert_eq(td_lookup(c, "lazy", 0x40, 0, &s, NULL), TD_EINVAL);
  td_storage_release(w);
  td_close(c);
}

TDT_TEST(scopes, client_instance_is_the_daemons) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *c2 = tdt_connect(&d);
  cr_assert_neq(td_client_instance(c), 0);
  cr_assert_eq(td_client_instance(c), stat_of(c).instance);
  cr_assert_eq(td_client_instance(c2), td_client_instance(c));
  cr_assert_eq(td_scope_open(c, NULL), TD_EINVAL);
  td_close(c);
  td_close(c2);
}

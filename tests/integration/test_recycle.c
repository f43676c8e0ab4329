/* test_recycle.c: the recycling pool. Freed segments serve later creates of
 * the same uid only, read as zeros unless TD_UNINIT was asked, stay in the
 * pool's bounds, give way to creates that need their space, age out, and
 * never outlive tensord. */
#include "harness.h"
#include "raw.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/types.h>
#include <unistd.h>
#include <signal.h>
#include <string.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

TestSuite(recycle, .init = setup, .fini = tdt_cleanup);

#define MiB (1024u * 1024)

static td_stat stat_of(td_client *c) {
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  return st;
}

static td_storage *make(td_client *c, size_t n, uint64_t flags) {
  td_create_opts o = {.nbytes = n, .flags = flags};
  td_storage *s = NULL;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "create of %zu: %s", n,
               td_last_error(c));
  return s;
}

/* Fills s with byte v and releases it. */
static void fill_release(td_storage *s, int v) {
  memset(td_storage_data(s), v, td_storage_nbytes(s));
  cr_assert_eq(td_storage_release(s), 0);
}

/* Returns the number of bytes of s that are not v. */
static size_t not_all(const td_storage *s, int v) {
  const uint8_t *p = td_storage_data(s);
  size_t bad = 0;
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    bad += p[i] != (uint8_t)v;
  return bad;
}

/* Polls c's stat until pool_segments is n (releases need no reply, and
 * other connections' land when they land). */
static td_stat pool_is(td_client *c, uint64_t n) {
  td_stat st = stat_of(c);
  for (int i = 0; i < 2500 && st.pool_segments != n; i++) {
    tdt_sleep_ms(2);
    st = stat_of(c);
  }
  cr_assert_eq(st.pool_segments, n, "pool has %llu segment(s), not %llu",
               (unsigned long long)st.pool_segments, (unsigned long long)n);
  return st;
}

/* Polls until /dev/shm holds n of the pool's files (segments the pool lets
 * go are unlinked on tensord's thread pool). Returns how many it holds. */
static int pooled_files(int n) {
  for (int i = 0; i < 2500 && tdt_pooled_of(d.instance) != n; i++)
    tdt_sleep_ms(2);
  return tdt_pooled_of(d.instance);
}

TDT_TEST(recycle, a_recycled_storage_reads_as_zeros, .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  fill_release(make(c, 4 * MiB, 0), 0xab);
  td_stat st = pool_is(c, 1);
  cr_assert_eq(st.pool_bytes, 4 * MiB);
  cr_assert_eq(tdt_pooled_of(d.instance), 1);
  cr_assert_eq(tdt_segments(&d), 0, "a pooled segment is not a storage's");
  cr_assert_eq(st.storages, 0);

  td_storage *s = make(c, 4 * MiB, 0);
  st = stat_of(c);
  cr_assert_eq(st.pool_hits, 1, "the create was not served from the pool");
  cr_assert_eq(st.pool_segments, 0);
  cr_assert_eq(not_all(s, 0), 0, "a recycled storage must read as zeros");
  cr_assert_eq(tdt_segments(&d), 1);
  cr_assert_eq(tdt_pooled_of(d.instance), 0);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(recycle, uninit_hands_the_pages_over_as_they_are, .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  fill_release(make(c, 2 * MiB, 0), 0x5c);
  pool_is(c, 1);
  td_storage *s = make(c, 2 * MiB, TD_UNINIT);
  cr_assert_eq(stat_of(c).pool_hits, 1);
  /* The proof that the pages were reused, not made afresh. */
  cr_assert_eq(not_all(s, 0x5c), 0, "TD_UNINIT should skip the zeroing");
  td_storage_release(s);
  /* A fresh segment is zero whatever the flag says. */
  td_storage *f = make(c, 3 * MiB, TD_UNINIT);
  cr_assert_eq(not_all(f, 0), 0);
  td_storage_release(f);
  td_close(c);
}

TDT_TEST(recycle, a_larger_segment_is_cut_to_size, .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  fill_release(make(c, 2 * MiB, 0), 0x11);
  pool_is(c, 1);
  size_t n = 3 * MiB / 2 + 12345;
  td_storage *s = make(c, n, 0);
  cr_assert_eq(stat_of(c).pool_hits, 1);
  cr_assert_eq(td_storage_nbytes(s), n);
  char path[128];
  cr_assert(tdt_segment_path(d.instance, td_storage_id(s), path, sizeof(path)));
  struct stat sb;
  cr_assert_eq(stat(path, &sb), 0, "%s: %s", path, strerror(errno));
  cr_assert_eq((uint64_t)sb.st_size, n, "segment of %lld bytes, not %zu",
               (long long)sb.st_size, n);
  cr_assert_eq(not_all(s, 0), 0);
  td_storage_release(s);
  /* Too small to serve a larger create, or too large (over twice) to serve
   * a small one. */
  td_stat st = pool_is(c, 1);
  uint64_t misses = st.pool_misses;
  td_storage *big = make(c, 4 * MiB, 0);
  td_storage *small = make(c, 256 * 1024, 0);
  st = stat_of(c);
  cr_assert_eq(st.pool_hits, 1);
  cr_assert_eq(st.pool_misses, misses + 2);
  td_storage_release(big);
  td_storage_release(small);
  td_close(c);
}

TDT_TEST(recycle, recycle_bytes_0_turns_it_off, .timeout = 30) {
  const char *args[] = {"--recycle-bytes", "0", NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  fill_release(make(c, 4 * MiB, 0), 1);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  td_stat st = stat_of(c);
  cr_assert_eq(st.pool_limit, 0);
  cr_assert_eq(st.pool_segments, 0);
  cr_assert_eq(tdt_pooled_of(d.instance), 0);
  td_storage *s = make(c, 4 * MiB, 0);
  st = stat_of(c);
  cr_assert_eq(st.pool_hits + st.pool_misses, 0, "no pool, no tries");
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(recycle, the_pool_stays_within_its_bounds, .timeout = 30) {
  const char *args[] = {"--recycle-bytes", "3MiB", NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *s[5];
  for (int i = 0; i < 5; i++)
    s[i] = make(c, MiB, 0);
  for (int i = 0; i < 5; i++)
    fill_release(s[i], i);
  td_stat st = pool_is(c, 3);
  cr_assert_eq(st.pool_bytes, 3 * MiB);
  cr_assert_eq(st.pool_limit, 3 * MiB);
  cr_assert_eq(pooled_files(3), 3);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  /* Larger than the whole pool: never pooled. Smaller than the least it
   * keeps: never pooled either. */
  fill_release(make(c, 4 * MiB, 0), 9);
  fill_release(make(c, 4096, 0), 9);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  st = pool_is(c, 3);
  cr_assert_eq(st.pool_bytes, 3 * MiB);
  td_close(c);
}

TDT_TEST(recycle, the_pool_gives_way_to_a_create_that_needs_room,
         .timeout = 30) {
  /* The pool counts against the capacity: a create that fits only once
   * the pool is gone must still succeed. */
  const char *args[] = {"--capacity", "8MiB", "--recycle-bytes", "8MiB", NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *a = make(c, 3 * MiB, 0), *b = make(c, 3 * MiB, 0);
  fill_release(a, 1);
  fill_release(b, 2);
  pool_is(c, 2);
  /* 7 MiB: no pooled segment serves it, and 6 MiB pooled + 7 MiB exceeds
   * the capacity of 8 MiB. */
  td_storage *big = make(c, 7 * MiB, 0);
  td_stat st = stat_of(c);
  cr_assert_eq(st.pool_segments, 0, "the pool must drain for the create");
  cr_assert_eq(st.bytes_used, 7 * MiB);
  cr_assert_eq(not_all(big, 0), 0);
  td_storage_release(big);
  /* Pooled bytes are never more than the capacity leaves. */
  st = pool_is(c, 1);
  cr_assert_leq(st.pool_bytes + st.bytes_used, st.capacity);
  td_close(c);
}

TDT_TEST(recycle, idle_segments_age_out, .timeout = 30) {
  const char *args[] = {"--recycle-idle", "200", NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  fill_release(make(c, MiB, 0), 3);
  /* Pooled, then gone 200 ms later (a slow machine may see only the
   * second: the log says the first happened). */
  pool_is(c, 0);
  cr_assert(tdt_log_has(&d, "pooled as"), "the segment was never pooled");
  cr_assert(tdt_log_has(&d, "ms; unlinking it"), "it was not aged out");
  cr_assert_eq(pooled_files(0), 0);
  td_close(c);
}

TDT_TEST(recycle, no_pooled_segment_outlives_a_restart, .timeout = 60) {
  char state[64];
  snprintf(state, sizeof(state), "/tmp/tensord-state.XXXXXX");
  cr_assert_not_null(mkdtemp(state));
  const char *args[] = {"--state-dir", state, NULL};
  tdt_start(&d, args);
  uint64_t first = d.instance;

  /* A crash leaves the pool in /dev/shm; the next start on the socket
   * unlinks it, and serves the key it kept. */
  td_client *c = tdt_connect(&d);
  td_storage *kept = make(c, MiB, 0);
  cr_assert_eq(td_publish(c, "kept", kept, NULL), 0, "%s", td_last_error(c));
  td_storage_release(kept);
  fill_release(make(c, 2 * MiB, 0), 7);
  pool_is(c, 1);
  td_close(c);
  kill(d.pid, SIGKILL);
  tdt_wait(d.pid);
  d.pid = 0;
  cr_assert_eq(tdt_pooled_of(first), 1, "SIGKILL leaves the pool behind");
  tdt_restart(&d, args);
  cr_assert_eq(tdt_pooled_of(first), 0, "the restart left the pool");
  cr_assert_eq(tdt_segments_of(first), 1, "the key's segment stays");

  /* A clean stop with --state-dir: the key stays, the pool goes. */
  c = tdt_connect(&d);
  fill_release(make(c, 2 * MiB, 0), 8);
  pool_is(c, 1);
  td_close(c);
  uint64_t second = d.instance;
  kill(d.pid, SIGTERM);
  cr_assert_eq(tdt_wait(d.pid), 0);
  d.pid = 0;
  cr_assert_eq(tdt_pooled_of(second), 0, "a stop left the pool");
  tdt_restart(&d, args);
  c = tdt_connect(&d);
  td_storage *s = NULL;
  cr_assert_eq(td_lookup(c, "kept", TD_TAKE, 0, &s, NULL), 0, "%s",
               td_last_error(c));
  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
  tdt_rmdir(state);
}

TDT_TEST(recycle, a_taken_key_recycles_its_segment_with_a_state_dir,
         .timeout = 30) {
  /* With --state-dir a taken key's segment waits for the journal's sync
   * before it may go, then goes to the pool, not to unlink: the data
   * loader's pattern under the systemd unit's options. */
  char state[64];
  snprintf(state, sizeof(state), "/tmp/tensord-state.XXXXXX");
  cr_assert_not_null(mkdtemp(state));
  const char *args[] = {"--state-dir", state, NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < 3; i++) {
    td_storage *s = make(c, 2 * MiB, TD_UNINIT);
    memset(td_storage_data(s), i + 1, 2 * MiB);
    cr_assert_eq(td_publish(c, "batch", s, NULL), 0, "%s", td_last_error(c));
    td_storage_release(s);
    td_storage *t = NULL;
    cr_assert_eq(td_lookup(c, "batch", TD_TAKE | TD_RDONLY, 0, &t, NULL), 0,
                 "%s", td_last_error(c));
    cr_assert_eq(not_all(t, i + 1), 0);
    td_storage_release(t);
    pool_is(c, 1);
  }
  cr_assert_eq(stat_of(c).pool_hits, 2,
               "the batches after the first were "
               "not served from the pool");
  td_close(c);
  tdt_stop(&d);
  tdt_rmdir(state);
}

/* ---- two uids ---- */

#define UID_A 4301
#define UID_B 4302

typedef struct job {
  uid_t uid;
  size_t n;
  uint64_t flags;
  int expect;          /* every byte of the new storage, or -1 */
  int fill;            /* then written to every byte, or -1 */
  const char *publish; /* then published under this key */
  uint32_t mode;       /* of the new storage; 0: 0644 */
  const char *peek;    /* or: this key is looked up read-only, released */
} job;

static int as_job(void *arg) {
  const job *j = arg;
  if (setgroups(0, NULL) < 0 || setgid(j->uid) < 0 || setuid(j->uid) < 0)
    return 2;
  td_client *c = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  td_storage *s = NULL;
  if (j->peek != NULL) {
    CHECK_ERR(c, td_lookup(c, j->peek, TD_RDONLY, 0, &s, NULL), 0);
  } else {
    td_create_opts o = {
        .nbytes = j->n, .flags = j->flags, .mode = j->mode ? j->mode : 0644};
    CHECK_ERR(c, td_storage_create_ex(c, &o, &s), 0);
    uint8_t *p = td_storage_data(s);
    for (size_t i = 0; j->expect >= 0 && i < j->n; i++)
      CHECK(p[i] == (uint8_t)j->expect);
    if (j->fill >= 0)
      memset(p, j->fill, j->n);
    if (j->publish != NULL)
      CHECK_ERR(c, td_publish(c, j->publish, s, NULL), 0);
  }
  td_storage_release(s);
  td_close(c);
  return 0;
}

static void run_job(job j) {
  int st = tdt_wait(tdt_fork(as_job, &j));
  cr_assert_eq(st, 0, "job as uid %u exited %d", (unsigned)j.uid, st);
}

static void start_shared(void) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
}

TDT_TEST(recycle, pages_never_cross_uids, .timeout = 30) {
  start_shared();
  td_client *c = tdt_connect(&d);
  run_job((job){.uid = UID_A, .n = MiB, .expect = 0, .fill = 0xa1});
  pool_is(c, 1);
  /* B asks for uninitialised bytes of the very size A's pooled segment has:
   * it must get fresh pages, never A's. */
  run_job((job){
      .uid = UID_B, .n = MiB, .flags = TD_UNINIT, .expect = 0, .fill = 0xb2});
  td_stat st = pool_is(c, 2);
  cr_assert_eq(st.pool_hits, 0, "a create of uid B was served A's pages");
  /* Each uid gets its own back. */
  run_job((job){
      .uid = UID_A, .n = MiB, .flags = TD_UNINIT, .expect = 0xa1, .fill = -1});
  run_job((job){
      .uid = UID_B, .n = MiB, .flags = TD_UNINIT, .expect = 0xb2, .fill = -1});
  st = stat_of(c);
  cr_assert_eq(st.pool_hits, 2);
  /* Root is a uid like any other here: it gets neither. */
  td_storage *s = make(c, MiB, TD_UNINIT);
  cr_assert_eq(not_all(s, 0), 0);
  cr_assert_eq(stat_of(c).pool_hits, 2);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(recycle, a_segment_another_uid_mapped_is_never_recycled,
         .timeout = 30) {
  start_shared();
  td_client *c = tdt_connect(&d);
  /* Without a foreign reader the segment is pooled ... */
  run_job((job){
      .uid = UID_A, .n = MiB, .expect = -1, .fill = 1, .publish = "mine"});
  cr_assert_eq(td_unpublish(c, "mine"), 0, "%s", td_last_error(c));
  pool_is(c, 1);
  /* ... but once uid B has mapped it (B may keep its mapping past its
   * release), it must not serve A's next storage, which B may not read. */
  run_job((job){.uid = UID_A,
                .n = 3 * MiB,
                .expect = -1,
                .fill = 2,
                .publish = "shared"});
  run_job((job){.uid = UID_B, .peek = "shared"});
  cr_assert_eq(td_unpublish(c, "shared"), 0, "%s", td_last_error(c));
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  td_stat st = pool_is(c, 1);
  cr_assert_eq(st.pool_bytes, MiB, "the segment B mapped was pooled");
  td_close(c);
}

/* A process that looked up as root, kept its mapping, and became uid B. */
typedef struct dropper {
  const uint8_t *map;
  size_t n;
  int go; /* read end: a byte comes once A has written its next storage */
} dropper;

static int drop_then_read(void *arg) {
  const dropper *dr = arg;
  CHECK(setgroups(0, NULL) == 0 && setresgid(UID_B, UID_B, UID_B) == 0 &&
        setresuid(UID_B, UID_B, UID_B) == 0);
  char b;
  CHECK(read(dr->go, &b, 1) == 1);
  size_t seen = 0;
  for (size_t i = 0; i < dr->n; i++)
    seen += dr->map[i] == 0x22;
  if (seen > 0)
    fprintf(stderr, "uid %d reads %zu byte(s) of uid %d's next storage\n",
            UID_B, seen, UID_A);
  return seen > 0;
}

TDT_TEST(recycle, a_segment_root_mapped_is_never_recycled_for_another_uid,
         .timeout = 30) {
  start_shared();
  td_client *c = tdt_connect(&d);
  run_job((job){.uid = UID_A,
                .n = MiB,
                .expect = -1,
                .fill = 0x11,
                .publish = "secret",
                .mode = 0600});
  /* A root process looks the key up and maps it, releases it (its mapping
   * stays), and hands the mapping to a process that drops root for uid B:
   * a privileged reader that drops its privileges. */
  tdt_raw r;
  tdt_raw_open(&r, &d);
  tdt_raw_lookup(&r, "secret", 0, 0);
  tdt_raw_flush(&r);
  int fd = -1;
  Tensord__Response *rep = tdt_raw_reply_fd(&r, 10000, &fd);
  cr_assert_not_null(rep);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_LOOKUP, "code %d",
               tdt_raw_code(rep));
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_geq(fd, 0);
  uint8_t *map = mmap(NULL, MiB, PROT_READ, MAP_SHARED, fd, 0);
  cr_assert_neq(map, MAP_FAILED);
  close(fd);
  tdt_raw_close(&r);
  int go[2];
  cr_assert_eq(pipe2(go, O_CLOEXEC), 0);
  dropper dr = {map, MiB, go[0]};
  pid_t pid = tdt_fork(drop_then_read, &dr);
  close(go[0]);
  munmap(map, MiB);

  /* The storage goes; uid A's next one of the same size must not get its
   * pages, which the process of uid B still maps. */
  cr_assert_eq(td_unpublish(c, "secret"), 0, "%s", td_last_error(c));
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  run_job((job){.uid = UID_A,
                .n = MiB,
                .flags = TD_UNINIT,
                .expect = -1,
                .fill = 0x22,
                .mode = 0600});
  cr_assert_eq(write(go[1], "g", 1), 1);
  close(go[1]);
  cr_assert_eq(tdt_wait(pid), 0,
               "the process that mapped uid %d's storage as root, then "
               "became uid %d, reads uid %d's next storage",
               UID_A, UID_B, UID_A);
  cr_assert_eq(stat_of(c).pool_hits, 0,
               "the segment root had mapped served uid %d's next create",
               UID_A);
  td_close(c);
}

/* ---- who zeroes ---- */

/* A Create over the wire; returns the reply, its fd in *fd. */
static Tensord__Response *raw_create(tdt_raw *r, uint64_t n, int uninit,
                                     int client_zeroes, int *fd) {
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.nbytes = n;
  m.uninitialized = uninit;
  m.client_zeroes = client_zeroes;
  q.body_case = TENSORD__REQUEST__BODY_CREATE;
  q.create = &m;
  tdt_raw_queue(r, &q);
  tdt_raw_flush(r);
  Tensord__Response *rep = tdt_raw_reply_fd(r, 10000, fd);
  cr_assert_not_null(rep);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_STORAGE, "code %d",
               tdt_raw_code(rep));
  cr_assert_geq(*fd, 0);
  return rep;
}

/* Maps fd (n bytes), checks that every byte is v, writes w into them all,
 * and closes it. */
static void check_and_fill(int fd, size_t n, int v, int w) {
  uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  cr_assert_neq(p, MAP_FAILED);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++)
    bad += p[i] != (uint8_t)v;
  cr_assert_eq(bad, 0, "%zu of %zu bytes are not 0x%02x", bad, n, v);
  memset(p, w, n);
  munmap(p, n);
  close(fd);
}

TDT_TEST(recycle, tensord_zeroes_unless_the_client_says_it_will,
         .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  fill_release(make(c, MiB, TD_UNINIT), 0x77);
  pool_is(c, 1);

  /* A client that says nothing (an older one): tensord zeroes. */
  tdt_raw r;
  tdt_raw_open(&r, &d);
  int fd;
  Tensord__Response *rep = raw_create(&r, MiB, 0, 0, &fd);
  cr_assert_not(rep->storage->dirty);
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_eq(stat_of(c).pool_hits, 1);
  check_and_fill(fd, MiB, 0, 0x55);
  tdt_raw_close(&r); /* its reference goes: pooled again */
  pool_is(c, 1);

  /* One that zeroes for itself is told to, and gets the bytes as they
   * were. */
  tdt_raw_open(&r, &d);
  rep = raw_create(&r, MiB, 0, 1, &fd);
  cr_assert(rep->storage->dirty, "a recycled segment must come dirty");
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_eq(stat_of(c).pool_hits, 2);
  check_and_fill(fd, MiB, 0x55, 0);
  /* A fresh segment is never dirty. */
  rep = raw_create(&r, 3 * MiB, 0, 1, &fd);
  cr_assert_not(rep->storage->dirty);
  tensord__response__free_unpacked(rep, NULL);
  check_and_fill(fd, 3 * MiB, 0, 0);
  tdt_raw_close(&r);
  td_close(c);
}

/* ---- warm mappings ---- */

/* Returns 1 if this process maps an address range that starts at p. */
static int mapped_at(const void *p) {
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert_not_null(f);
  char line[512];
  int found = 0;
  while (!found && fgets(line, sizeof(line), f) != NULL)
    found = strtoull(line, NULL, 16) == (uintptr_t)p;
  fclose(f);
  return found;
}

TDT_TEST(recycle, a_recycled_segment_reuses_the_processes_mapping,
         .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = make(c, 4 * MiB, 0);
  uint8_t *was = td_storage_data(s);
  fill_release(s, 0x3c);
  pool_is(c, 1);
  cr_assert(mapped_at(was), "the released mapping is kept, warm");
  /* The next storage of the same segment takes it back: same address, no
   * new mapping (and TD_UNINIT shows the bytes are the same pages). */
  s = make(c, 4 * MiB, TD_UNINIT);
  cr_assert_eq(stat_of(c).pool_hits, 1);
  cr_assert_eq(td_storage_data(s), was, "the warm mapping was not reused");
  cr_assert_eq(not_all(s, 0x3c), 0);
  fill_release(s, 0x3d);
  /* Zeroed: the same mapping again, zeroed by the library. */
  s = make(c, 4 * MiB, 0);
  cr_assert_eq(td_storage_data(s), was);
  cr_assert_eq(not_all(s, 0), 0);
  td_storage_release(s);
  /* A warm mapping lasts 5 s at most: the next acquire or release after
   * that unmaps it (a small handle's release here, which maps nothing new
   * that could land at the same address). */
  td_storage *small = make(c, 4096, 0);
  tdt_sleep_ms(5200);
  cr_assert(mapped_at(was));
  td_storage_release(small);
  cr_assert_not(mapped_at(was), "a warm mapping outlived its time");
  td_close(c);
}

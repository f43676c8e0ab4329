/* test_crash.c: crash safety: clients killed mid-way leak nothing, and a
 * tensord killed with SIGKILL (or stopped) and started again on the same
 * socket and --state-dir serves every acknowledged key with the same bytes,
 * while whatever no key names is unlinked. */
#include "harness.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;
static char state_dir[64]; /* "" when the test uses none */
/* Every instance the test ran, so that teardown can remove their segments
 * whatever happened. */
static uint64_t instances[8];
static int ninstances;

/* ---- /dev/shm ---- */

static int seg_exists(uint64_t instance, uint64_t id) {
  char path[128];
  return tdt_segment_path(instance, id, path, sizeof(path));
}

static void remember(uint64_t instance) {
  if (ninstances < 8)
    instances[ninstances++] = instance;
  tdt_note_instance(instance); /* for tests/check-clean.sh */
}

/* ---- the daemon: start, kill, restart ---- */

static void setup(void) {
  memset(&d, 0, sizeof(d));
  state_dir[0] = '\0';
  ninstances = 0;
}

static void rm_state_dir(void) {
  tdt_rmdir(state_dir);
  state_dir[0] = '\0';
}

/* Whatever the test left, it goes: the daemon, every segment of every
 * instance it ran, the state directory and the test directory. */
static void teardown(void) {
  if (d.pid > 0) {
    kill(d.pid, SIGKILL);
    tdt_wait(d.pid);
    d.pid = 0;
  }
  for (int i = 0; i < ninstances; i++)
    tdt_unlink_segments(instances[i]);
  rm_state_dir();
  if (d.dir[0] != '\0')
    tdt_kill(&d);
}

TestSuite(crash, .init = setup, .fini = teardown, .timeout = 60);

static void make_state_dir(void) {
  snprintf(state_dir, sizeof(state_dir), "/tmp/tensord-state.XXXXXX");
  cr_assert_not_null(mkdtemp(state_dir), "mkdtemp: %s", strerror(errno));
  /* tensord makes the directory itself if need be: give it a fresh path
   * inside ours. */
}

static void start(int with_state) {
  if (with_state) {
    make_state_dir();
    tdt_start(&d, (const char *const[]){"--state-dir", state_dir, NULL});
  } else {
    tdt_start(&d, NULL);
  }
  remember(d.instance);
}

/* SIGKILLs the daemon and reaps it. */
static void kill9(void) {
  cr_assert_eq(kill(d.pid, SIGKILL), 0);
  cr_assert_eq(tdt_wait(d.pid), 128 + SIGKILL);
  d.pid = 0;
}

/* SIGTERMs the daemon and asserts it exits 0. */
static void term(void) {
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  int st = tdt_wait(d.pid);
  d.pid = 0;
  cr_assert_eq(st, 0, "tensord exited %d", st);
}

/* Starts a new tensord on d's socket (and the state directory, if
 * with_state), logging to d's log, and waits until it serves. */
static void restart(int with_state) {
  uint64_t was = d.instance;
  if (with_state)
    tdt_restart(&d, (const char *const[]){"--state-dir", state_dir, NULL});
  else
    tdt_restart(&d, NULL);
  cr_assert_neq(d.instance, was, "a new instance");
  remember(d.instance);
}

static int count_named(const td_storage_info *info, void *arg) {
  *(uint64_t *)arg += info->nkeys_total > 0;
  return 0;
}

/* Ends a test: stops the daemon with SIGTERM and asserts what a clean stop
 * leaves: with --state-dir exactly the segments that keys name (the next
 * start serves them), without it none, whichever instance made them; no
 * socket; no fd leaked. What is left goes only after that (teardown). */
static void finish(void) {
  cr_assert_gt(d.pid, 0, "finish: the test's tensord is not running");
  uint64_t named = 0;
  if (state_dir[0] != '\0') {
    td_client *c = tdt_connect(&d);
    cr_assert_eq(td_list(c, count_named, &named), 0, "%s", td_last_error(c));
    td_close(c);
  }
  term();
  int left = 0;
  for (int i = 0; i < ninstances; i++)
    left += tdt_segments_of(instances[i]);
  struct stat sb;
  int sock_left = stat(d.sock, &sb) == 0;
  int fds = tdt_open_fds();
  cr_assert_eq((uint64_t)left, named,
               "a clean stop left %d segment(s) in /dev/shm; keys name %llu "
               "storage(s)%s",
               left, (unsigned long long)named,
               state_dir[0] ? "" : " (no --state-dir: nothing may stay)");
  cr_assert_not(sock_left, "tensord left its socket %s", d.sock);
  cr_assert_eq(fds, d.fds_before, "the test leaked %d fd(s)",
               fds - d.fds_before);
  teardown();
  memset(&d, 0, sizeof(d));
}

/* ---- storages and keys with known bytes and views ---- */

static const struct {
  size_t nbytes;
  unsigned seed;
  uint32_t mode;
} stor[] = {
    {4096, 1, 0600},
    {(1u << 20) + 3, 2, 0640}, /* large: made off the daemon's loop */
    {100, 3, 0644},
};
enum { NSTOR = 3, NKEYS = 5 };

static const struct {
  const char *key;
  int storage;
} keys[NKEYS] = {
    {"crash/a", 0},      {"crash/a.T", 0}, {"crash/b", 1},
    {"crash/b/part", 1}, {"crash/c", 2},
};

/* The view published under keys[i]. Returns 0 or a TD_E* code. */
static int key_view(int i, td_view *v) {
  int64_t shape[2] = {4, 3};
  int err;
  switch (i) {
  case 0:
    return td_view_contiguous(TD_FLOAT32, 2, shape, v);
  case 1:
    err = td_view_contiguous(TD_FLOAT32, 2, shape, v);
    return err ? err : td_view_transpose(v, 0, 1);
  case 2:
    shape[0] = (int64_t)stor[1].nbytes;
    return td_view_contiguous(TD_UINT8, 1, shape, v);
  case 3:
    shape[0] = 1000;
    err = td_view_contiguous(TD_UINT8, 1, shape, v);
    return err ? err : td_view_as_strided(v, 1, shape, (int64_t[]){1}, 7);
  default: {
    shape[0] = 3;
    shape[1] = 2;
    err = td_view_contiguous(TD_INT16, 2, shape, v);
    return err ? err : td_view_as_strided(v, 2, shape, (int64_t[]){1, 3}, 5);
  }
  }
}

static void fill(td_storage *s, unsigned seed) {
  uint8_t *p = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    p[i] = (uint8_t)(i * 37 + seed);
}

static int has_bytes(const td_storage *s, unsigned seed) {
  const uint8_t *p = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    if (p[i] != (uint8_t)(i * 37 + seed))
      return 0;
  return 1;
}

static int same_view(const td_view *a, const td_view *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim || a->offset != b->offset)
    return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i] || a->stride[i] != b->stride[i])
      return 0;
  return 1;
}

/* In a child: creates the storages, publishes the keys, and exits. */
static int publisher(void *arg) {
  (void)arg;
  td_client *c;
  if (td_connect(d.sock, &c) != 0) {
    fprintf(stderr, "connect: %s\n", td_last_error(NULL));
    return 1;
  }
  td_storage *s[NSTOR];
  for (int i = 0; i < NSTOR; i++) {
    td_create_opts o = {0};
    o.nbytes = stor[i].nbytes;
    o.mode = stor[i].mode;
    if (td_storage_create_ex(c, &o, &s[i]) != 0) {
      fprintf(stderr, "create: %s\n", td_last_error(c));
      return 1;
    }
    fill(s[i], stor[i].seed);
  }
  for (int i = 0; i < NKEYS; i++) {
    td_view v;
    CHECK(key_view(i, &v) == 0);
    if (td_publish(c, keys[i].key, s[keys[i].storage], &v) != 0) {
      fprintf(stderr, "publish %s: %s\n", keys[i].key, td_last_error(c));
      return 1;
    }
  }
  for (int i = 0; i < NSTOR; i++)
    td_storage_release(s[i]);
  td_close(c);
  return 0;
}

static void publish_all(void) {
  cr_assert_eq(tdt_wait(tdt_fork(publisher, NULL)), 0, "the publisher");
}

typedef struct info_got {
  td_storage_info info;
} info_got;

static int info_cb(const td_storage_info *info, void *arg) {
  info_got *g = arg;
  g->info = *info;
  g->info.holders = NULL;
  g->info.keys = NULL;
  return 0;
}

/* The ids (in this instance) of the storages the keys name. */
static void storage_ids(td_client *c, uint64_t ids[NSTOR]) {
  for (int i = 0; i < NKEYS; i++) {
    info_got g = {0};
    cr_assert_eq(td_info(c, 0, keys[i].key, info_cb, NULL, &g), 0, "%s",
                 td_last_error(c));
    ids[keys[i].storage] = g.info.id;
  }
}

/* Every key resolves to its storage's bytes, with its view, owner and mode. */
static void check_all_keys(td_client *c) {
  uint64_t ids[NSTOR] = {0};
  for (int i = 0; i < NKEYS; i++) {
    td_storage *s;
    td_view v, want;
    cr_assert_eq(td_lookup(c, keys[i].key, TD_RDONLY, 0, &s, &v), 0,
                 "key %s: %s", keys[i].key, td_last_error(c));
    int k = keys[i].storage;
    cr_assert_eq(td_storage_nbytes(s), stor[k].nbytes, "key %s", keys[i].key);
    cr_assert(has_bytes(s, stor[k].seed), "key %s: bytes differ", keys[i].key);
    cr_assert_eq(key_view(i, &want), 0);
    char a[256], b[256];
    cr_assert(same_view(&v, &want), "key %s: view %s, published %s",
              keys[i].key, td_view_format(&v, a, sizeof(a)),
              td_view_format(&want, b, sizeof(b)));
    /* Keys that named one storage still name one storage. */
    if (ids[k] == 0)
      ids[k] = td_storage_id(s);
    cr_assert_eq(td_storage_id(s), ids[k], "key %s", keys[i].key);
    info_got g = {0};
    cr_assert_eq(td_info(c, 0, keys[i].key, info_cb, NULL, &g), 0);
    cr_assert_eq(g.info.mode, stor[k].mode, "key %s: mode %04o", keys[i].key,
                 g.info.mode);
    cr_assert_eq(g.info.owner_uid, getuid());
    cr_assert_eq(g.info.owner_gid, getgid());
    td_storage_release(s);
  }
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, NKEYS);
}

static uint64_t n_storages_now(void) {
  return tdt_storages(&d);
}

/* ---- a) a client killed between create and publish ---- */

static int pipe_w = -1;

static int create_and_hang(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_storage *small, *big, *pub;
  CHECK(td_storage_create(c, 4096, &small) == 0);
  CHECK(td_storage_create(c, 8u << 20, &big) == 0);
  CHECK(td_storage_create(c, 4096, &pub) == 0);
  fill(small, 1);
  fill(big, 2);
  fill(pub, 3);
  CHECK(td_publish(c, "a/published", pub, NULL) == 0);
  uint64_t ids[3] = {td_storage_id(small), td_storage_id(big),
                     td_storage_id(pub)};
  CHECK(write(pipe_w, ids, sizeof(ids)) == (ssize_t)sizeof(ids));
  for (;;)
    pause(); /* killed here, before publishing small and big */
}

static int create_forever(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK(write(pipe_w, "x", 1) == 1);
  for (;;) {
    td_storage *s;
    CHECK(td_storage_create(c, 16u << 20, &s) == 0);
    /* Held, never published: the kill finds several of these, and maybe a
     * create in flight. */
  }
}

TDT_TEST(crash, client_killed_between_create_and_publish_leaks_nothing) {
  start(0);
  int p[2];
  cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
  pipe_w = p[1];
  pid_t pid = tdt_fork(create_and_hang, NULL);
  uint64_t ids[3];
  struct pollfd pf = {p[0], POLLIN, 0};
  cr_assert_eq(poll(&pf, 1, 10000), 1, "the child did not get that far");
  cr_assert_eq(read(p[0], ids, sizeof(ids)), (ssize_t)sizeof(ids));
  cr_assert_eq(n_storages_now(), 3);
  for (int i = 0; i < 3; i++)
    cr_assert(seg_exists(d.instance, ids[i]));
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  for (int i = 0; i < 2500 && n_storages_now() != 1; i++)
    tdt_sleep_ms(2);
  cr_assert_eq(n_storages_now(), 1, "only the published storage is left");
  for (int i = 0; i < 2500 && tdt_segments(&d) != 1; i++)
    tdt_sleep_ms(2);
  cr_assert_eq(tdt_segments(&d), 1, "the unpublished segments are unlinked");
  cr_assert_not(seg_exists(d.instance, ids[0]));
  cr_assert_not(seg_exists(d.instance, ids[1]));
  cr_assert(seg_exists(d.instance, ids[2]));
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "a/published", TD_RDONLY, 0, &s, NULL), 0);
  cr_assert(has_bytes(s, 3));
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "a/published"), 0);

  /* Again, killed at no particular point of a stream of large creates. */
  for (int round = 0; round < 3; round++) {
    pid = tdt_fork(create_forever, NULL);
    char x;
    cr_assert_eq(poll(&pf, 1, 10000), 1);
    cr_assert_eq(read(p[0], &x, 1), 1);
    tdt_sleep_ms(30 + 40 * round);
    kill(pid, SIGKILL);
    cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
    cr_assert(tdt_until(tdt_no_segments, &d, 10000), "round %d: %d segment(s)",
              round, tdt_segments(&d));
    td_stat st;
    for (int i = 0; i < 2500; i++) {
      cr_assert_eq(td_stat_get(c, &st), 0);
      if (st.storages == 0 && st.bytes_used == 0 && st.clients == 1)
        break;
      tdt_sleep_ms(2);
    }
    cr_assert_eq(st.storages, 0, "round %d", round);
    cr_assert_eq(st.bytes_used, 0, "round %d", round);
    cr_assert_eq(st.clients, 1, "round %d", round);
  }
  /* Nothing stays reserved against the capacity either. */
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(td_storage_create(c, 64u << 20, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  close(p[0]);
  close(p[1]);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
  memset(&d, 0, sizeof(d));
}

/* ---- b) a waiter killed while waiting ---- */

static int wait_forever(void *arg) {
  unsigned flags = *(const unsigned *)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_storage *s;
  td_lookup(c, "b/awaited", flags, flags & TD_TAKE ? -1 : 60000, &s, NULL);
  return 3; /* never gets here: killed */
}

static uint64_t want_waiters, want_clients;

static int waiters_are(const tdt_daemon *dd) {
  td_client *c = tdt_connect(dd);
  td_stat st;
  int ok = td_stat_get(c, &st) == 0 && st.waiters == want_waiters &&
           st.clients == want_clients + 1;
  td_close(c);
  return ok;
}

TDT_TEST(crash, waiter_killed_while_waiting_is_forgotten) {
  start(0);
  static const unsigned take = TD_TAKE, ro = TD_RDONLY;
  pid_t a = tdt_fork(wait_forever, (void *)&take);
  pid_t b = tdt_fork(wait_forever, (void *)&ro);
  want_waiters = 2;
  want_clients = 2;
  cr_assert(tdt_until(waiters_are, &d, 10000), "both wait");
  kill(a, SIGKILL);
  kill(b, SIGKILL);
  cr_assert_eq(tdt_wait(a), 128 + SIGKILL);
  cr_assert_eq(tdt_wait(b), 128 + SIGKILL);
  want_waiters = 0;
  want_clients = 0;
  cr_assert(tdt_until(waiters_are, &d, 10000), "the waiters are forgotten");
  /* Publishing the key now hands it to nobody: the dead taker took
   * nothing. */
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  fill(s, 4);
  cr_assert_eq(td_publish(c, "b/awaited", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "b/awaited", TD_RDONLY, 0, &t, NULL), 0, "%s",
               td_last_error(c));
  cr_assert(has_bytes(t, 4));
  td_storage_release(t);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.waiters, 0);
  cr_assert_eq(st.keys, 1);
  cr_assert_eq(td_unpublish(c, "b/awaited"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
  memset(&d, 0, sizeof(d));
}

/* ---- c) SIGKILL and a restart with the same --state-dir ---- */

TDT_TEST(crash, sigkill_and_restart_serve_every_key_again) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  uint64_t named[NSTOR];
  storage_ids(c, named);
  /* Held but not published, and published then unpublished: no key names
   * them at the kill. */
  td_storage *held, *gone, *mapped;
  cr_assert_eq(td_storage_create(c, 8192, &held), 0);
  fill(held, 9);
  cr_assert_eq(td_storage_create(c, 4096, &gone), 0);
  fill(gone, 10);
  cr_assert_eq(td_publish(c, "crash/gone", gone, NULL), 0);
  cr_assert_eq(td_unpublish(c, "crash/gone"), 0);
  /* A mapping the client has when the daemon dies. */
  cr_assert_eq(td_lookup(c, "crash/b", TD_RDONLY, 0, &mapped, NULL), 0);
  cr_assert(has_bytes(mapped, stor[1].seed));
  uint64_t held_id = td_storage_id(held), gone_id = td_storage_id(gone);
  cr_assert_eq(tdt_segments_of(inst1), NSTOR + 2);

  kill9();
  /* The kill unlinked nothing. */
  cr_assert_eq(tdt_segments_of(inst1), NSTOR + 2);
  /* The client notices on its next call; its mappings stay. */
  cr_assert_eq(td_ping(c, NULL), TD_ECONNRESET, "%s", td_last_error(c));
  td_storage *x;
  cr_assert_eq(td_storage_create(c, 64, &x), TD_ECONNRESET);
  cr_assert(has_bytes(mapped, stor[1].seed));
  cr_assert(has_bytes(held, 9));

  restart(1);
  cr_assert(tdt_log_has(&d, "serving 5 key(s)"), "see %s", d.log);
  /* Segments no key named are gone; those keys name are there, once. */
  cr_assert_not(seg_exists(inst1, held_id), "the held segment was unlinked");
  cr_assert_not(seg_exists(inst1, gone_id), "the unpublished one too");
  for (int i = 0; i < NSTOR; i++)
    cr_assert(seg_exists(inst1, named[i]), "storage %d is served", i);
  cr_assert_eq(tdt_segments_of(inst1), NSTOR);
  cr_assert_eq(tdt_segments_of(d.instance), 0, "nothing copied");
  /* The old client's mappings outlive even the unlink. */
  cr_assert(has_bytes(held, 9));
  cr_assert(has_bytes(mapped, stor[1].seed));
  cr_assert_eq(td_ping(c, NULL), TD_ECONNRESET, "still the dead connection");

  td_client *c2 = NULL;
  cr_assert_eq(td_connect(d.sock, &c2), 0, "%s", td_last_error(NULL));
  check_all_keys(c2);
  td_stat st;
  cr_assert_eq(td_stat_get(c2, &st), 0);
  cr_assert_eq(st.storages, NSTOR);
  cr_assert_str_eq(st.state_dir, state_dir);

  /* The restarted daemon works as usual: new storages, and an adopted
   * storage whose keys all go is unlinked. */
  cr_assert_eq(td_storage_create(c2, 4096, &x), 0, "%s", td_last_error(c2));
  cr_assert(seg_exists(d.instance, td_storage_id(x)));
  cr_assert_eq(td_publish(c2, "crash/new", x, NULL), 0);
  td_storage_release(x);
  cr_assert_eq(td_unpublish(c2, "crash/c"), 0);
  for (int i = 0; i < 2500 && seg_exists(inst1, named[2]); i++)
    tdt_sleep_ms(2);
  cr_assert_not(seg_exists(inst1, named[2]),
                "an adopted storage no key names any more is unlinked");

  td_storage_release(mapped);
  td_storage_release(held);
  td_storage_release(gone);
  td_close(c);
  td_close(c2);
  finish();
}

/* ---- d) clean shutdown with and without --state-dir ---- */

TDT_TEST(crash, clean_shutdown_with_state_dir_keeps_published_storages) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  uint64_t named[NSTOR];
  storage_ids(c, named);
  td_storage *held;
  cr_assert_eq(td_storage_create(c, 4096, &held), 0);
  uint64_t held_id = td_storage_id(held);

  term();
  cr_assert(tdt_log_has(&d, "kept 5 key(s) on 3 storage(s)"), "see %s", d.log);
  struct stat sb;
  cr_assert_neq(stat(d.sock, &sb), 0, "the socket is removed");
  for (int i = 0; i < NSTOR; i++)
    cr_assert(seg_exists(inst1, named[i]), "storage %d kept", i);
  cr_assert_not(seg_exists(inst1, held_id), "an unnamed storage is not kept");
  cr_assert_eq(tdt_segments_of(inst1), NSTOR);
  cr_assert_eq(td_ping(c, NULL), TD_ECONNRESET);
  td_storage_release(held);
  td_close(c);

  /* The next start serves them. */
  restart(1);
  c = tdt_connect(&d);
  check_all_keys(c);
  td_close(c);
  /* And so does the one after a second clean stop. */
  term();
  cr_assert_eq(tdt_segments_of(inst1), NSTOR);
  restart(1);
  c = tdt_connect(&d);
  check_all_keys(c);
  td_close(c);
  finish();
}

/* Whether td_stat_prefixes names prefix; asserts the call works. */
static int has_prefix(td_client *c, const char *fmt, uint64_t instance) {
  char want[TD_PREFIX_MAX], got[8][TD_PREFIX_MAX];
  size_t n;
  snprintf(want, sizeof(want), fmt, (unsigned long long)instance);
  cr_assert_eq(td_stat_prefixes(c, got, 8, &n), 0, "%s", td_last_error(c));
  for (size_t i = 0; i < n && i < 8; i++)
    if (strcmp(got[i], want) == 0)
      return 1;
  return 0;
}

/* Segments adopted at a restart keep the name an earlier instance gave them,
 * so stat lists that instance's prefix beside the new one's (a clean-up by
 * hand must spare both); storage ids are the new instance's, and none is
 * used twice in it. */
TDT_TEST(crash, stat_lists_the_prefixes_of_adopted_segments) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  cr_assert(has_prefix(c, "/tensord.%016llx.", inst1));
  cr_assert(has_prefix(c, "/tensord.%016llx-pool.", inst1));
  size_t n;
  cr_assert_eq(td_stat_prefixes(c, NULL, 0, &n), 0);
  cr_assert_eq(n, 2, "a fresh instance has its own and its pool's prefix");
  td_close(c);
  term();

  restart(1);
  c = tdt_connect(&d);
  cr_assert(has_prefix(c, "/tensord.%016llx.", d.instance));
  cr_assert(has_prefix(c, "/tensord.%016llx-pool.", d.instance));
  cr_assert(has_prefix(c, "/tensord.%016llx.", inst1),
            "the adopted segments' prefix is not listed");
  cr_assert_eq(td_stat_prefixes(c, NULL, 0, &n), 0);
  cr_assert_eq(n, 3);
  /* The ids of adopted storages are this instance's: a new storage gets
   * none of them. */
  uint64_t ids[NSTOR] = {0};
  storage_ids(c, ids);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  for (int i = 0; i < NSTOR; i++)
    cr_assert_neq(td_storage_id(s), ids[i], "id %llu used twice",
                  (unsigned long long)ids[i]);
  td_storage_release(s);
  td_close(c);
  finish();
}

TDT_TEST(crash, clean_shutdown_without_state_dir_unlinks_everything) {
  start(0);
  publish_all();
  td_client *c = tdt_connect(&d);
  td_storage *held;
  cr_assert_eq(td_storage_create(c, 4096, &held), 0);
  cr_assert_eq(tdt_segments(&d), NSTOR + 1);
  char run[160];
  snprintf(run, sizeof(run), "%s.instance", d.sock);
  struct stat sb;
  cr_assert_eq(stat(run, &sb), 0, "the instance is recorded in %s", run);
  term();
  cr_assert_eq(tdt_segments(&d), 0, "a clean stop unlinks every segment");
  cr_assert_neq(stat(run, &sb), 0, "and its instance record");
  td_storage_release(held);
  td_close(c);
  /* The next start on the socket has nothing to serve. */
  restart(0);
  c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "crash/a", TD_RDONLY, 0, &s, NULL), TD_ENOENT);
  cr_assert_eq(n_storages_now(), 0);
  td_close(c);
  finish();
}

/* ---- e) SIGKILL and restart without --state-dir ---- */

TDT_TEST(crash, restart_without_state_dir_unlinks_the_previous_leftovers) {
  start(0);
  publish_all();
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  td_storage *held;
  cr_assert_eq(td_storage_create(c, 4096, &held), 0);
  fill(held, 5);
  kill9();
  cr_assert_eq(tdt_segments_of(inst1), NSTOR + 1,
               "left in /dev/shm by the kill");
  cr_assert_eq(td_ping(c, NULL), TD_ECONNRESET);

  restart(0);
  cr_assert_eq(tdt_segments_of(inst1), 0, "the new tensord unlinked them");
  cr_assert(tdt_log_has(&d, "unlinked 4 segment(s) left by the previous"),
            "and said so; see %s", d.log);
  cr_assert(has_bytes(held, 5), "a mapping survives the unlink");
  td_client *c2 = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c2, "crash/a", TD_RDONLY, 0, &s, NULL), TD_ENOENT,
               "keys do not survive without --state-dir");
  td_stat st;
  cr_assert_eq(td_stat_get(c2, &st), 0);
  cr_assert_eq(st.storages, 0);
  cr_assert_eq(st.state_dir[0], '\0');
  td_close(c2);
  td_storage_release(held);
  td_close(c);
  /* A second kill and restart, from the restarted instance. */
  uint64_t inst2 = d.instance;
  c = tdt_connect(&d);
  cr_assert_eq(td_storage_create(c, 4096, &held), 0);
  kill9();
  td_close(c);
  td_storage_release(held);
  cr_assert_eq(tdt_segments_of(inst2), 1);
  restart(0);
  cr_assert_eq(tdt_segments_of(inst2), 0);
  finish();
}

/* <socket>.instance is only a hint: a line that is no segment prefix of a
 * daemon ("/tensord." alone would match every instance's segments) is
 * ignored, so a restart never unlinks what another daemon owns. */
TDT_TEST(crash, restart_ignores_recorded_prefixes_that_are_no_instance) {
  const char *bystander = "/tensord.feedfacefeedface.1";
  shm_unlink(bystander);
  int fd = shm_open(bystander, O_RDWR | O_CREAT | O_EXCL, 0600);
  cr_assert(fd >= 0, "shm_open(%s): %s", bystander, strerror(errno));
  close(fd);
  start(0);
  kill9();
  char run[160];
  snprintf(run, sizeof(run), "%s.instance", d.sock);
  FILE *f = fopen(run, "a");
  cr_assert_not_null(f);
  fputs("\n/tensord.\n/tensord.x/y.\n/tensord.feedface\n", f);
  cr_assert_eq(fclose(f), 0);
  restart(0);
  fd = shm_open(bystander, O_RDONLY, 0);
  int survived = fd >= 0;
  if (fd >= 0)
    close(fd);
  shm_unlink(bystander);
  cr_assert(survived,
            "the restart unlinked %s, which no recorded instance "
            "owns; see %s",
            bystander, d.log);
  finish();
}

/* ---- f) what was acknowledged before the kill stays done ---- */

TDT_TEST(crash, acknowledged_publish_take_and_unpublish_survive_sigkill) {
  start(1);
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  td_storage *s1, *s2, *s3, *t;
  cr_assert_eq(td_storage_create(c, 4096, &s1), 0);
  cr_assert_eq(td_storage_create(c, 4096, &s2), 0);
  cr_assert_eq(td_storage_create(c, 4096, &s3), 0);
  fill(s1, 11);
  fill(s2, 12);
  fill(s3, 13);
  uint64_t id1 = td_storage_id(s1);
  enum { N = 60 };
  char key[32];
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof(key), "f/%d", i);
    cr_assert_eq(td_publish(c, key, i % 2 ? s2 : s3, NULL), 0);
  }
  cr_assert_eq(td_publish(c, "f/taken", s1, NULL), 0);
  cr_assert_eq(td_publish(c, "f/replaced", s1, NULL), 0);
  cr_assert_eq(td_publish(c, "f/replaced", s3, NULL), 0);
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof(key), "f/%d", i);
    if (i % 3 == 0) {
      cr_assert_eq(td_lookup(c, key, TD_TAKE, 0, &t, NULL), 0);
      td_storage_release(t);
    } else if (i % 3 == 1) {
      cr_assert_eq(td_unpublish(c, key), 0);
    }
  }
  cr_assert_eq(td_lookup(c, "f/taken", TD_TAKE, 0, &t, NULL), 0);
  td_storage_release(t);
  /* The last acknowledged change, then the kill. */
  cr_assert_eq(td_publish(c, "f/last", s2, NULL), 0);
  kill9();
  td_storage_release(s1);
  td_storage_release(s2);
  td_storage_release(s3);
  td_close(c);

  restart(1);
  c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, N / 3 + 2, "%llu keys", (unsigned long long)st.keys);
  cr_assert_eq(st.storages, 2, "s2 and s3; nothing names s1");
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof(key), "f/%d", i);
    int err = td_lookup(c, key, TD_RDONLY, 0, &t, NULL);
    if (i % 3 != 2) {
      cr_assert_eq(err, TD_ENOENT, "key %s came back", key);
      continue;
    }
    cr_assert_eq(err, 0, "key %s: %s", key, td_last_error(c));
    cr_assert(has_bytes(t, i % 2 ? 12 : 13), "key %s", key);
    td_storage_release(t);
  }
  cr_assert_eq(td_lookup(c, "f/taken", TD_RDONLY, 0, &t, NULL), TD_ENOENT,
               "a take that was acknowledged stays taken");
  cr_assert_eq(td_lookup(c, "f/last", TD_RDONLY, 0, &t, NULL), 0,
               "a publish that was acknowledged is there");
  cr_assert(has_bytes(t, 12));
  td_storage_release(t);
  cr_assert_eq(td_lookup(c, "f/replaced", TD_RDONLY, 0, &t, NULL), 0);
  cr_assert(has_bytes(t, 13), "the replacement, not the first value");
  td_storage_release(t);
  cr_assert_not(seg_exists(inst1, id1), "s1's segment was unlinked");
  cr_assert_eq(tdt_segments_of(inst1), 2);
  td_close(c);
  finish();
}

/* ---- g) a journal cut short or followed by garbage ---- */

/* The path of the newest journal in the state directory. */
static void newest_journal(char *path, size_t len) {
  DIR *dir = opendir(state_dir);
  cr_assert_not_null(dir);
  unsigned long long best = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    unsigned long long g;
    char tail;
    if (sscanf(e->d_name, "journal.%llu%c", &g, &tail) == 1 && g > best)
      best = g;
  }
  closedir(dir);
  cr_assert_gt(best, 0, "no journal in %s", state_dir);
  snprintf(path, len, "%s/journal.%llu", state_dir, best);
}

static void append_bytes(const char *path, const void *buf, size_t len) {
  int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
  cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
  cr_assert_eq(write(fd, buf, len), (ssize_t)len);
  close(fd);
}

TDT_TEST(crash, garbage_after_the_journal_is_ignored_with_a_warning) {
  start(1);
  publish_all();
  kill9();
  char journal[128];
  newest_journal(journal, sizeof(journal));
  struct stat sb;
  cr_assert_eq(stat(journal, &sb), 0);
  cr_assert_gt(sb.st_size, 0, "the keys are in %s", journal);
  /* A plausible header with a wrong checksum, its payload, then noise. */
  uint8_t junk[64];
  memset(junk, 0xa5, sizeof(junk));
  junk[0] = 40;
  junk[1] = junk[2] = junk[3] = 0;
  append_bytes(journal, junk, 48);
  append_bytes(journal, "\xff\xff\xff\x7f torn", 9);

  restart(1);
  cr_assert(tdt_log_has(&d, "after the last whole record ignored"),
            "a warning about the tail; see %s", d.log);
  td_client *c = tdt_connect(&d);
  check_all_keys(c);
  td_close(c);

  /* Garbage in a journal at all (no whole record): also tolerated. */
  kill9();
  newest_journal(journal, sizeof(journal));
  append_bytes(journal, junk, 5);
  restart(1);
  c = tdt_connect(&d);
  check_all_keys(c);
  td_close(c);
  finish();
}

TDT_TEST(crash, torn_last_journal_record_loses_only_that_record) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  td_storage *last;
  cr_assert_eq(td_storage_create(c, 4096, &last), 0);
  fill(last, 20);
  cr_assert_eq(td_publish(c, "crash/last", last, NULL), 0);
  uint64_t last_id = td_storage_id(last);
  td_storage_release(last);
  td_close(c);
  kill9();
  char journal[128];
  newest_journal(journal, sizeof(journal));
  struct stat sb;
  cr_assert_eq(stat(journal, &sb), 0);
  /* Cut the last record (the put of crash/last) short, as a crash in the
   * middle of its write would. */
  cr_assert_eq(truncate(journal, sb.st_size - 3), 0);
  cr_assert(seg_exists(inst1, last_id));

  restart(1);
  cr_assert(tdt_log_has(&d, "after the last whole record ignored"), "see %s",
            d.log);
  c = tdt_connect(&d);
  check_all_keys(c);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "crash/last", TD_RDONLY, 0, &s, NULL), TD_ENOENT);
  cr_assert_not(seg_exists(inst1, last_id),
                "the segment of the lost key is unlinked");
  td_close(c);
  finish();
}

/* ---- more than one crash, and switching --state-dir on or off ---- */

TDT_TEST(crash, two_sigkills_in_a_row_keep_every_key) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  kill9();
  restart(1);
  uint64_t inst2 = d.instance;
  /* The second instance adds a key of its own and holds a storage no key
   * names when it dies too. */
  td_client *c = tdt_connect(&d);
  td_storage *mine, *held;
  cr_assert_eq(td_storage_create(c, 4096, &mine), 0);
  fill(mine, 30);
  cr_assert_eq(td_publish(c, "crash/second", mine, NULL), 0);
  cr_assert_eq(td_storage_create(c, 4096, &held), 0);
  uint64_t mine_id = td_storage_id(mine), held_id = td_storage_id(held);
  kill9();
  td_storage_release(mine);
  td_storage_release(held);
  td_close(c);

  restart(1);
  c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "crash/second", TD_RDONLY, 0, &s, NULL), 0, "%s",
               td_last_error(c));
  cr_assert(has_bytes(s, 30));
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "crash/second"), 0);
  check_all_keys(c);
  td_close(c);
  cr_assert_eq(tdt_segments_of(inst1), NSTOR, "the first instance's storages");
  cr_assert_not(seg_exists(inst2, held_id), "the unnamed one is unlinked");
  for (int i = 0; i < 2500 && seg_exists(inst2, mine_id); i++)
    tdt_sleep_ms(2);
  cr_assert_eq(tdt_segments_of(inst2), 0);
  finish();
}

TDT_TEST(crash, key_whose_segment_vanished_is_dropped_with_a_warning) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  td_client *c = tdt_connect(&d);
  uint64_t named[NSTOR];
  storage_ids(c, named);
  td_close(c);
  kill9();
  /* Someone removes a segment while tensord is down. */
  char path[128];
  cr_assert(tdt_segment_path(inst1, named[2], path, sizeof(path)));
  cr_assert_eq(unlink(path), 0, "%s: %s", path, strerror(errno));

  restart(1);
  cr_assert(tdt_log_has(&d, "key 'crash/c': segment"), "see %s", d.log);
  c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "crash/c", TD_RDONLY, 0, &s, NULL), TD_ENOENT);
  for (int i = 0; i < NKEYS; i++) {
    if (keys[i].storage == 2)
      continue;
    cr_assert_eq(td_lookup(c, keys[i].key, TD_RDONLY, 0, &s, NULL), 0,
                 "key %s: %s", keys[i].key, td_last_error(c));
    cr_assert(has_bytes(s, stor[keys[i].storage].seed));
    td_storage_release(s);
  }
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, NKEYS - 1);
  cr_assert_eq(st.storages, NSTOR - 1);
  td_close(c);
  finish();
}

TDT_TEST(crash, second_tensord_on_the_same_state_dir_is_refused) {
  start(1);
  char sock[108], log[128];
  snprintf(sock, sizeof(sock), "%.60s/other.sock", d.dir);
  snprintf(log, sizeof(log), "%.60s/other.log", d.dir);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || dup2(fd, STDERR_FILENO) < 0)
      _exit(126);
    unsetenv("NOTIFY_SOCKET");
    execl(TENSORD_BIN, TENSORD_BIN, "--socket", sock, "--state-dir", state_dir,
          (char *)NULL);
    _exit(127);
  }
  int st = tdt_wait(pid);
  char buf[2048] = "";
  FILE *f = fopen(log, "r");
  if (f) {
    buf[fread(buf, 1, sizeof(buf) - 1, f)] = '\0';
    fclose(f);
  }
  cr_assert_eq(st, 1, "the second tensord exited %d: %s", st, buf);
  cr_assert(strstr(buf, "another tensord uses it") != NULL, "stderr: %s", buf);
  struct stat sb;
  cr_assert_neq(stat(sock, &sb), 0, "it left no socket behind");
  /* The first one is undisturbed. */
  publish_all();
  td_client *c = tdt_connect(&d);
  check_all_keys(c);
  td_close(c);
  finish();
}

TDT_TEST(crash,
         restart_with_state_dir_after_a_crash_without_one_unlinks_leftovers) {
  start(0);
  publish_all();
  uint64_t inst1 = d.instance;
  kill9();
  cr_assert_eq(tdt_segments_of(inst1), NSTOR);
  /* The operator turns --state-dir on for the restart: it has no key that
   * names the old segments, so they are leftovers like any other. */
  make_state_dir();
  restart(1);
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, 0);
  td_close(c);
  cr_assert_eq(tdt_segments_of(inst1), 0,
               "%d segment(s) of the crashed instance (no --state-dir) are "
               "still in /dev/shm after a restart with --state-dir",
               tdt_segments_of(inst1));
  finish();
}

TDT_TEST(crash, restart_without_state_dir_after_crashes_with_one_unlinks_all) {
  start(1);
  publish_all();
  uint64_t inst1 = d.instance;
  kill9();
  restart(1); /* adopts inst1's segments */
  uint64_t inst2 = d.instance;
  kill9();
  cr_assert_eq(tdt_segments_of(inst1), NSTOR);
  /* Now without --state-dir: nothing will serve those keys, so every
   * segment the dead daemon had goes, whichever instance made it. */
  restart(0);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "crash/a", TD_RDONLY, 0, &s, NULL), TD_ENOENT);
  td_close(c);
  cr_assert_eq(tdt_segments_of(inst2), 0);
  cr_assert_eq(tdt_segments_of(inst1), 0,
               "%d segment(s) the previous tensord served (adopted from the "
               "one before it) are still in /dev/shm",
               tdt_segments_of(inst1));
  finish();
}

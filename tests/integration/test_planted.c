/* test_planted.c: other local users who plant files under tensord's names.
 * /dev/shm shows every name and size to everyone: a file planted where a
 * journaled segment went missing is never adopted at a restart, and names
 * taken ahead of tensord never block a create or replace the taker's
 * file. */
#include "harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A local user who has no access to tensord at all. */
#define PLANTER 4313

static tdt_daemon d;
static char state_dir[64];
static uint64_t first; /* the instance whose segments a restart adopts */
/* Files a test had PLANTER make under names tensord may use. */
#define SQUAT_MAX 160
static char squatted[SQUAT_MAX][96];
static int nsquatted;
static char gate_dir[64]; /* randshim's gate file lives here */

static void setup(void) {
  memset(&d, 0, sizeof(d));
  nsquatted = 0;
  state_dir[0] = gate_dir[0] = '\0';
  first = 0;
}

/* Whatever a failed test left goes: daemons, segments, planted files. */
static void teardown(void) {
  tdt_cleanup();
  if (first != 0)
    tdt_unlink_segments(first);
  for (int i = 0; i < nsquatted; i++)
    unlink(squatted[i]);
  if (state_dir[0] != '\0')
    tdt_rmdir(state_dir);
  if (gate_dir[0] != '\0')
    tdt_rmdir(gate_dir);
}

TestSuite(planted, .init = setup, .fini = teardown, .timeout = 60);

static void need_root(void) {
  if (geteuid() != 0)
    cr_skip_test("planting files as another uid needs root");
}

static int become_planter(void) {
  return setgroups(0, NULL) == 0 && setresgid(PLANTER, PLANTER, PLANTER) == 0 &&
         setresuid(PLANTER, PLANTER, PLANTER) == 0;
}

/* Makes file path of n bytes, each byte, with exactly mode. Returns 0, or
 * -1 with errno set. */
static int make_file(const char *path, size_t n, int byte, mode_t mode) {
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return -1;
  char buf[4096];
  memset(buf, byte, sizeof(buf));
  int ok = fchmod(fd, mode) == 0 && ftruncate(fd, (off_t)n) == 0;
  for (size_t off = 0; ok && off < n; off += sizeof(buf)) {
    size_t k = n - off < sizeof(buf) ? n - off : sizeof(buf);
    ok = pwrite(fd, buf, k, (off_t)off) == (ssize_t)k;
  }
  int err = errno;
  close(fd);
  errno = err;
  return ok ? 0 : -1;
}

/* ---- a restart adopts no planted file ---- */

#define N 8192

typedef struct plant {
  const char *path;
  int byte;
} plant;

static int plant_as_planter(void *arg) {
  const plant *p = arg;
  CHECK(become_planter());
  /* Readable and writable by all, so that the planter would read what a
   * storage's owner wrote next. */
  CHECK(make_file(p->path, N, p->byte, 0666) == 0);
  return 0;
}

static void stop_keeping_segments(void) {
  kill(d.pid, SIGTERM);
  cr_assert_eq(tdt_wait(d.pid), 0, "tensord did not stop cleanly; see %s",
               d.log);
  d.pid = 0;
}

TDT_TEST(planted, a_file_planted_at_a_journaled_name_is_not_adopted) {
  need_root();
  tdt_mkdtemp(state_dir);
  const char *const args[] = {"--state-dir", state_dir, NULL};
  tdt_start(&d, args);
  first = d.instance;
  static const char *const keys[] = {"kept", "planted/by-another-uid",
                                     "planted/group-readable",
                                     "planted/hard-linked"};
  char path[4][128];
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < 4; i++) {
    td_create_opts o = {.nbytes = N, .mode = 0644};
    td_storage *s = NULL;
    cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "%s", td_last_error(c));
    memset(td_storage_data(s), 0x11, N);
    cr_assert_eq(td_publish(c, keys[i], s, NULL), 0, "%s", td_last_error(c));
    cr_assert(
        tdt_segment_path(first, td_storage_id(s), path[i], sizeof(path[i])),
        "no segment of storage %llu in /dev/shm",
        (unsigned long long)td_storage_id(s));
    td_storage_release(s);
  }
  td_close(c);
  stop_keeping_segments();

  /* While tensord is down the segments go (a reboot, logind's RemoveIPC, a
   * clean-up by hand), and files appear under the same names and sizes. */
  for (int i = 1; i < 4; i++)
    cr_assert_eq(unlink(path[i]), 0, "%s: %s", path[i], strerror(errno));
  plant p = {path[1], 0xbb};
  cr_assert_eq(tdt_wait(tdt_fork(plant_as_planter, &p)), 0,
               "cannot plant %s as uid %d", path[1], PLANTER);
  /* tensord's own uid, but with bits for the group that it never sets. */
  cr_assert_eq(make_file(path[2], N, 0xcc, 0640), 0, "%s: %s", path[2],
               strerror(errno));
  /* A second name of a file that lives on under another one. */
  char extra[128];
  snprintf(extra, sizeof(extra), "/dev/shm/tensord.%016llx.planted",
           (unsigned long long)first);
  cr_assert_eq(make_file(extra, N, 0xdd, 0600), 0, "%s: %s", extra,
               strerror(errno));
  cr_assert_eq(link(extra, path[3]), 0, "link %s: %s", path[3],
               strerror(errno));

  tdt_restart(&d, args);
  c = tdt_connect(&d);
  td_storage *s = NULL;
  for (int i = 1; i < 4; i++)
    cr_assert_eq(td_lookup(c, keys[i], TD_RDONLY, 0, &s, NULL), TD_ENOENT,
                 "key '%s' is served from the file planted at %s", keys[i],
                 path[i]);
  cr_assert(tdt_log_has(&d, "is owned by uid 4313, not tensord's uid 0"),
            "no reason logged for %s; see %s", keys[1], d.log);
  cr_assert(tdt_log_has(&d, "has mode 0640"), "no reason logged for %s; see %s",
            keys[2], d.log);
  cr_assert(tdt_log_has(&d, "has 2 links"), "no reason logged for %s; see %s",
            keys[3], d.log);
  /* Nothing names them now: the start swept them with the rest. */
  cr_assert_eq(tdt_segments_of(first), 1,
               "planted files are left under tensord's names");

  /* The untouched key is served, with its bytes. */
  cr_assert_eq(td_lookup(c, "kept", TD_TAKE, 0, &s, NULL), 0, "%s",
               td_last_error(c));
  const uint8_t *b = td_storage_data(s);
  size_t bad = 0;
  for (size_t i = 0; i < N; i++)
    bad += b[i] != 0x11;
  cr_assert_eq(bad, 0, "%zu byte(s) of 'kept' changed across the restart", bad);
  td_storage_release(s);
  td_close(c);
  for (int i = 0; i < 2500 && tdt_segments_of(first) > 0; i++)
    tdt_sleep_ms(2);
  cr_assert_eq(tdt_segments_of(first), 0);
}

TDT_TEST(planted, a_fifo_or_a_symlink_at_a_journaled_name_is_not_adopted) {
  need_root();
  tdt_mkdtemp(state_dir);
  const char *const args[] = {"--state-dir", state_dir, NULL};
  tdt_start(&d, args);
  first = d.instance;
  static const char *const keys[] = {"planted/fifo", "planted/symlink"};
  char path[2][128];
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < 2; i++) {
    td_storage *s = NULL;
    cr_assert_eq(td_storage_create(c, N, &s), 0, "%s", td_last_error(c));
    cr_assert_eq(td_publish(c, keys[i], s, NULL), 0, "%s", td_last_error(c));
    cr_assert(
        tdt_segment_path(first, td_storage_id(s), path[i], sizeof(path[i])));
    td_storage_release(s);
  }
  td_close(c);
  stop_keeping_segments();

  /* A FIFO would hold up a start that opened it to read, for good. */
  cr_assert_eq(unlink(path[0]), 0, "%s: %s", path[0], strerror(errno));
  cr_assert_eq(mkfifo(path[0], 0600), 0, "%s: %s", path[0], strerror(errno));
  /* A link to a file of the right size and owner, elsewhere. */
  char target[128];
  snprintf(target, sizeof(target), "/dev/shm/tensord.%016llx.target",
           (unsigned long long)first);
  cr_assert_eq(make_file(target, N, 0xee, 0600), 0);
  cr_assert_eq(unlink(path[1]), 0, "%s: %s", path[1], strerror(errno));
  cr_assert_eq(symlink(target, path[1]), 0, "%s: %s", path[1], strerror(errno));

  tdt_restart(&d, args);
  c = tdt_connect(&d);
  td_storage *s = NULL;
  for (int i = 0; i < 2; i++)
    cr_assert_eq(td_lookup(c, keys[i], TD_RDONLY, 0, &s, NULL), TD_ENOENT,
                 "key '%s' is served from %s", keys[i], path[i]);
  cr_assert(tdt_log_has(&d, "is a FIFO, not a regular file"),
            "no reason logged for the FIFO; see %s", d.log);
  td_close(c);
  cr_assert_eq(tdt_segments_of(first), 0,
               "planted files are left under tensord's names");
}

/* ---- names taken ahead of tensord ---- */

/* Adds a name to take: "/dev/shm/tensord.<d's instance><what><n><tail>". */
static void squat_name(const char *what, int n, const char *tail) {
  cr_assert_lt(nsquatted, SQUAT_MAX);
  snprintf(squatted[nsquatted++], sizeof(squatted[0]),
           "/dev/shm/tensord.%016llx%s%d%s", (unsigned long long)d.instance,
           what, n, tail);
}

static int squat_as_planter(void *arg) {
  (void)arg;
  CHECK(become_planter());
  for (int i = 0; i < nsquatted; i++)
    CHECK(make_file(squatted[i], 0, 0, 0644) == 0);
  return 0;
}

/* PLANTER, a user with no access to tensord, makes an empty file, mode
 * 0644, under every name squat_name added. */
static void squat(void) {
  cr_assert_eq(tdt_wait(tdt_fork(squat_as_planter, NULL)), 0,
               "cannot make files in /dev/shm as uid %d", PLANTER);
}

/* Asserts every squatted file is as PLANTER made it (none was replaced, or
 * adopted and written), then removes them. */
static void squatted_intact(void) {
  for (int i = 0; i < nsquatted; i++) {
    struct stat sb;
    cr_assert_eq(stat(squatted[i], &sb), 0, "%s: %s", squatted[i],
                 strerror(errno));
    cr_assert(sb.st_uid == PLANTER && sb.st_size == 0,
              "%s was replaced (uid %u, %lld bytes)", squatted[i],
              (unsigned)sb.st_uid, (long long)sb.st_size);
  }
  for (; nsquatted > 0; nsquatted--)
    unlink(squatted[nsquatted - 1]);
}

static td_stat stat_of(td_client *c) {
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  return st;
}

/* Polls until the pool holds n segments (a release needs no reply). */
static void pool_is(td_client *c, uint64_t n) {
  td_stat st = stat_of(c);
  for (int i = 0; i < 2500 && st.pool_segments != n; i++) {
    tdt_sleep_ms(2);
    st = stat_of(c);
  }
  cr_assert_eq(st.pool_segments, n, "the pool holds %llu segment(s), not %llu",
               (unsigned long long)st.pool_segments, (unsigned long long)n);
}

static td_storage *make(td_client *c, size_t n) {
  td_create_opts o = {.nbytes = n};
  td_storage *s = NULL;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "create of %zu bytes: %s", n,
               td_last_error(c));
  const uint8_t *p = td_storage_data(s);
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(p[i], 0, "byte %zu of a new storage is 0x%02x", i, p[i]);
  return s;
}

/* Creates on the loop (small) and on the thread pool (large), then through
 * the recycling pool, and asserts each succeeds. */
static void creates_go_on(td_client *c) {
  td_storage *small[8], *large[2];
  for (int i = 0; i < 8; i++)
    small[i] = make(c, 4096);
  for (int i = 0; i < 2; i++)
    large[i] = make(c, 1 << 20);
  td_storage_release(large[0]); /* into the pool ... */
  pool_is(c, 1);
  uint64_t hits = stat_of(c).pool_hits;
  large[0] = make(c, 1 << 20); /* ... and out of it */
  cr_assert_eq(stat_of(c).pool_hits, hits + 1,
               "the pool did not serve the create");
  for (int i = 0; i < 8; i++)
    td_storage_release(small[i]);
  for (int i = 0; i < 2; i++)
    td_storage_release(large[i]);
}

TDT_TEST(planted, names_taken_ahead_of_tensord_do_not_block_creates) {
  need_root();
  tdt_start(&d, NULL);
  /* The instance shows in /dev/shm: take the names of the storages and of
   * the pool to come, as they would be if they followed from it. */
  for (int k = 1; k <= 40; k++) {
    squat_name(".", k, "");
    squat_name("-pool.", k, "");
  }
  squat();
  td_client *c = tdt_connect(&d);
  creates_go_on(c);
  td_close(c);
  squatted_intact();
}

/* ---- names taken all the same ---- */

/* The tails randshim makes tensord draw, over and over. */
#define TAILS 4
static const char *const tail[TAILS] = {
    "-a0a0a0a0a0a0a0a0", "-a1a1a1a1a1a1a1a1", "-a2a2a2a2a2a2a2a2",
    "-a3a3a3a3a3a3a3a3"};

/* Starts tensord under randshim, then makes its names foreseeable: each
 * draw gives the next of tail[], round and round. */
static void start_foreseeable(void) {
  tdt_mkdtemp(gate_dir);
  char gate[96], cycle[8];
  snprintf(gate, sizeof(gate), "%s/foreseeable", gate_dir);
  snprintf(cycle, sizeof(cycle), "%d", TAILS);
  tdt_preload(TDT_RANDSHIM);
  setenv("TDT_RANDOM_GATE", gate, 1);
  setenv("TDT_RANDOM_CYCLE", cycle, 1);
  tdt_start(&d, NULL);
  tdt_preload(NULL);
  unsetenv("TDT_RANDOM_GATE");
  /* Its instance is drawn: from now on, tensord's draws are foreseen. */
  int fd = open(gate, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  cr_assert_geq(fd, 0, "%s: %s", gate, strerror(errno));
  close(fd);
}

TDT_TEST(planted, a_name_taken_all_the_same_is_drawn_again) {
  need_root();
  start_foreseeable();
  /* Every name but one tail in four is taken, for the first storages and
   * pool entries: each create, and each rename into or out of the pool,
   * meets names taken until its draw comes round to the free tail. */
  for (int k = 1; k <= 24; k++) {
    for (int t = 0; t < TAILS - 1; t++) {
      squat_name(".", k, tail[t]);
      squat_name("-pool.", k, tail[t]);
    }
  }
  squat();
  td_client *c = tdt_connect(&d);
  creates_go_on(c);
  td_close(c);
  cr_assert(tdt_log_has(&d, "which tensord did not make; trying another name"),
            "no name was drawn again; see %s", d.log);
  squatted_intact();
}

TDT_TEST(planted, a_create_whose_every_name_is_taken_fails_naming_the_last) {
  need_root();
  start_foreseeable();
  for (int t = 0; t < TAILS; t++) {
    squat_name(".", 1, tail[t]); /* storage 1's every name */
    for (int k = 1; k <= 8; k++) /* and the pool's for 8 tries */
      squat_name("-pool.", k, tail[t]);
  }
  squat();
  td_client *c = tdt_connect(&d);
  td_create_opts o = {.nbytes = 1 << 20};
  td_storage *s = NULL;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), TD_EEXIST, "%s",
               td_last_error(c));
  char want[128];
  snprintf(want, sizeof(want),
           "8 names for storage 1 were all taken in /dev/shm, the last "
           "/tensord.%016llx.1-a",
           (unsigned long long)d.instance);
  cr_assert(strstr(td_last_error(c), want), "'%s' does not say '%s'",
            td_last_error(c), want);
  /* Storage 2's names are free. A segment whose every pool name is taken
   * is not pooled, but unlinked. */
  s = make(c, 1 << 20);
  td_storage_release(s);
  for (int i = 0; i < 2500 && tdt_segments(&d) > TAILS; i++)
    tdt_sleep_ms(2);
  cr_assert_eq(tdt_segments(&d), TAILS, "storage 2's segment is left");
  pool_is(c, 0);
  cr_assert(tdt_log_has(&d, "already exists; unlinking it"), "see %s", d.log);
  td_close(c);
  squatted_intact();
}

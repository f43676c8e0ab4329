/* test_planted.c: other local users who plant files under tensord's names.
 * /dev/shm shows every name and size to everyone: a file planted where a
 * journaled segment went missing is never adopted at a restart. */
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

static void setup(void) {
  memset(&d, 0, sizeof(d));
  state_dir[0] = '\0';
  first = 0;
}

/* Whatever a failed test left goes: daemons, segments, planted files. */
static void teardown(void) {
  tdt_cleanup();
  if (first != 0)
    tdt_unlink_segments(first);
  if (state_dir[0] != '\0')
    tdt_rmdir(state_dir);
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
    cr_assert(tdt_segment_path(first, td_storage_id(s), path[i],
                               sizeof(path[i])),
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
  cr_assert(tdt_log_has(&d, "has mode 0640"),
            "no reason logged for %s; see %s", keys[2], d.log);
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
  cr_assert_eq(bad, 0, "%zu byte(s) of 'kept' changed across the restart",
               bad);
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
    cr_assert(tdt_segment_path(first, td_storage_id(s), path[i],
                               sizeof(path[i])));
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
  cr_assert_eq(symlink(target, path[1]), 0, "%s: %s", path[1],
               strerror(errno));

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

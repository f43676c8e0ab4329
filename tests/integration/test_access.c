/* test_access.c: who may open, look up, take, unpublish and replace what:
 * storage modes, read-only mappings, and the socket's own access, checked
 * from forked clients that run as other users. */
#include "cli.h"
#include "harness.h"

#include "tensord.pb-c.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

/* A test that fails midway leaves no daemon, segment or directory. */
TestSuite(access, .init = setup, .fini = tdt_cleanup);

/* ---- identities ---- */

typedef struct who {
  uid_t uid;
  gid_t gid;
  int ngroups;
  gid_t groups[4];
} who;

/* Numeric ids that need no entry in /etc/passwd or /etc/group. */
#define OWNER ((who){4242, 4243, 0, {0}})
#define MEMBER_SUPPL ((who){4244, 4244, 1, {4243}}) /* 4243 as extra group */
#define MEMBER_PRIMARY ((who){4245, 4243, 0, {0}})  /* 4243 as its own gid */
#define STRANGER ((who){4246, 4246, 0, {0}})

static void need_root(void) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
}

/* Starts tensord with a socket every user may connect to: --socket-mode 0666
 * and a test directory others may enter. */
static void start_shared(const char *const *more) {
  const char *args[16] = {"--socket-mode", "0666"};
  int n = 2;
  for (int i = 0; more && more[i] && n < 15; i++)
    args[n++] = more[i];
  args[n] = NULL;
  tdt_start(&d, args);
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
}

typedef struct as_job {
  who w;
  int (*fn)(void *);
  void *arg;
} as_job;

static int as_child(void *p) {
  as_job *j = p;
  if (setgroups((size_t)j->w.ngroups, j->w.groups) < 0 ||
      setgid(j->w.gid) < 0 || setuid(j->w.uid) < 0) {
    fprintf(stderr, "cannot become uid %u gid %u: %s\n", (unsigned)j->w.uid,
            (unsigned)j->w.gid, strerror(errno));
    return 2;
  }
  return j->fn(j->arg);
}

/* Forks a child that becomes w and runs fn(arg); returns its pid. */
static pid_t spawn_as(who w, int (*fn)(void *), void *arg) {
  as_job j = {w, fn, arg};
  return tdt_fork(as_child, &j);
}

/* Runs fn(arg) as w in a child and asserts it succeeded. */
#define run_as(w, fn, arg)                                                     \
  do {                                                                         \
    who w_ = (w);                                                              \
    int st_ = tdt_wait(spawn_as(w_, fn, arg));                                 \
    cr_assert_eq(st_, 0, "%s as uid %u gid %u: child exited %d", #fn,          \
                 (unsigned)w_.uid, (unsigned)w_.gid, st_);                     \
  } while (0)

/* ---- checks inside a child ---- */

static int child_connect(td_client **c) {
  int err = td_connect(d.sock, c);
  if (err != 0)
    fprintf(stderr, "uid %u: td_connect: %s\n", (unsigned)getuid(),
            td_last_error(NULL));
  return err;
}

static int fill_pattern(td_storage *s, unsigned seed) {
  uint8_t *p = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    p[i] = (uint8_t)(i * 31 + seed);
  return 0;
}

static int has_pattern(const td_storage *s, unsigned seed) {
  const uint8_t *p = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    if (p[i] != (uint8_t)(i * 31 + seed))
      return 0;
  return 1;
}

/* ---- what the daemon says about a storage ---- */

typedef struct about {
  int found;
  td_storage_info info;
  int nkeys;
} about;

static int about_cb(const td_storage_info *info, void *arg) {
  about *a = arg;
  a->found = 1;
  a->info = *info;
  a->info.holders = NULL;
  a->info.keys = NULL;
  a->nkeys = (int)info->nkeys_total;
  return 0;
}

/* Describes the storage key names (id 0) or storage id; asserts it exists. */
static about describe(td_client *c, uint64_t id, const char *key) {
  about a = {0};
  int err = td_info(c, id, key, about_cb, NULL, &a);
  cr_assert_eq(err, 0, "info %s: %s", key ? key : "", td_last_error(c));
  cr_assert(a.found);
  return a;
}

/* ---- the default mode: owner only ---- */

static uint64_t sid; /* a storage the children try */
static const char *skey;

static int owner_publishes_private(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
  fill_pattern(s, 7);
  CHECK_ERR(c, td_publish(c, "private/owned", s, NULL), 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

static int stranger_is_refused(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s = NULL;
  char id[48], uid[32];
  snprintf(id, sizeof(id), "storage %llu", (unsigned long long)sid);
  snprintf(uid, sizeof(uid), "uid %u", (unsigned)getuid());
  CHECK(child_connect(&c) == 0);

  CHECK_ERR(c, td_storage_open(c, sid, TD_RDONLY, &s), TD_EACCES);
  CHECK(s == NULL);
  CHECK_MSG(c, id);
  CHECK_MSG(c, "read-only");
  CHECK_MSG(c, "0600");
  CHECK_MSG(c, uid);
  CHECK_ERR(c, td_storage_open(c, sid, 0, &s), TD_EACCES);
  CHECK_MSG(c, id);
  CHECK_MSG(c, "read-write");
  CHECK_MSG(c, "0600");
  CHECK_MSG(c, uid);

  td_view v;
  CHECK_ERR(c, td_lookup(c, skey, TD_RDONLY, 0, &s, &v), TD_EACCES);
  CHECK(s == NULL);
  CHECK_MSG(c, skey);
  CHECK_MSG(c, id);
  CHECK_MSG(c, "read-only");
  CHECK_MSG(c, "0600");
  CHECK_MSG(c, uid);
  CHECK_ERR(c, td_lookup(c, skey, 0, 0, &s, NULL), TD_EACCES);
  CHECK_MSG(c, "read-write");
  CHECK_ERR(c, td_lookup(c, skey, TD_TAKE, 0, &s, NULL), TD_EACCES);
  CHECK_MSG(c, "take");
  CHECK_MSG(c, skey);
  CHECK_ERR(c, td_unpublish(c, skey), TD_EACCES);
  CHECK_MSG(c, "unpublish");
  CHECK_MSG(c, skey);
  CHECK_MSG(c, uid);
  /* Waiting changes nothing: the key is there, the answer is no. */
  CHECK_ERR(c, td_lookup(c, skey, TD_RDONLY, 2000, &s, NULL), TD_EACCES);

  /* The connection is fine after the refusals. */
  CHECK_ERR(c, td_ping(c, NULL), 0);
  td_stat st;
  CHECK_ERR(c, td_stat_get(c, &st), 0);
  td_close(c);
  return 0;
}

static int owner_opens_its_own(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s, *t;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_lookup(c, "private/owned", 0, 0, &s, NULL), 0);
  CHECK(!td_storage_is_readonly(s));
  CHECK(has_pattern(s, 7));
  CHECK_ERR(c, td_storage_open(c, td_storage_id(s), TD_RDONLY, &t), 0);
  td_storage_release(t);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(access, default_mode_lets_only_the_owner_in, .timeout = 30) {
  need_root();
  start_shared(NULL);
  td_client *c = tdt_connect(&d);

  /* A storage of root's, mode 0600 by default. */
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  fill_pattern(s, 3);
  cr_assert_eq(td_publish(c, "private/root", s, NULL), 0);
  about a = describe(c, td_storage_id(s), NULL);
  cr_assert_eq(a.info.mode, 0600);
  cr_assert_eq(a.info.owner_uid, 0);
  sid = td_storage_id(s);
  skey = "private/root";
  run_as(STRANGER, stranger_is_refused, NULL);

  /* A storage of another user's: a third user is refused, its owner is
   * not. */
  run_as(OWNER, owner_publishes_private, NULL);
  a = describe(c, 0, "private/owned");
  cr_assert_eq(a.info.mode, 0600);
  cr_assert_eq(a.info.owner_uid, OWNER.uid);
  cr_assert_eq(a.info.owner_gid, OWNER.gid);
  sid = a.info.id;
  skey = "private/owned";
  run_as(STRANGER, stranger_is_refused, NULL);
  /* Same group as the owner, but mode 0600 has no group bits. */
  run_as(MEMBER_PRIMARY, stranger_is_refused, NULL);
  run_as(OWNER, owner_opens_its_own, NULL);

  /* The refusals changed nothing: both keys are there, unchanged. */
  a = describe(c, 0, "private/root");
  cr_assert_eq(a.info.refs, 2, "root's handle and the key");
  a = describe(c, 0, "private/owned");
  cr_assert_eq(a.info.refs, 1, "only the key");
  td_storage *t;
  cr_assert_eq(td_lookup(c, "private/owned", TD_RDONLY, 0, &t, NULL), 0);
  cr_assert(has_pattern(t, 7));
  td_storage_release(t);
  cr_assert(has_pattern(s, 3));

  cr_assert_eq(td_unpublish(c, "private/root"), 0);
  cr_assert_eq(td_unpublish(c, "private/owned"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- mode 0640: the group reads, nobody else ---- */

static int owner_publishes_0640(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s;
  CHECK(child_connect(&c) == 0);
  td_create_opts o = {0};
  o.nbytes = 8192;
  o.mode = 0640;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &s), 0);
  fill_pattern(s, 11);
  CHECK_ERR(c, td_publish(c, "grp/k", s, NULL), 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

static int member_reads_only(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s = NULL, *mine;
  char id[48];
  snprintf(id, sizeof(id), "storage %llu", (unsigned long long)sid);
  CHECK(child_connect(&c) == 0);

  /* Reading is allowed, by key and by id. */
  td_view v;
  CHECK_ERR(c, td_lookup(c, "grp/k", TD_RDONLY, 0, &s, &v), 0);
  CHECK(td_storage_is_readonly(s));
  CHECK(td_storage_id(s) == sid);
  CHECK(td_storage_nbytes(s) == 8192);
  CHECK(has_pattern(s, 11));
  td_storage_release(s);
  CHECK_ERR(c, td_storage_open(c, sid, TD_RDONLY, &s), 0);
  CHECK(has_pattern(s, 11));
  td_storage_release(s);

  /* Writing is not. */
  CHECK_ERR(c, td_storage_open(c, sid, 0, &s), TD_EACCES);
  CHECK_MSG(c, id);
  CHECK_MSG(c, "read-write");
  CHECK_MSG(c, "0640");
  CHECK_ERR(c, td_lookup(c, "grp/k", 0, 0, &s, NULL), TD_EACCES);
  CHECK_MSG(c, "grp/k");
  CHECK_MSG(c, "read-write");
  CHECK_ERR(c, td_lookup(c, "grp/k", TD_TAKE, 0, &s, NULL), TD_EACCES);
  CHECK_MSG(c, "take");
  CHECK_MSG(c, "grp/k");
  CHECK_ERR(c, td_lookup(c, "grp/k", TD_TAKE | TD_RDONLY, 0, &s, NULL),
            TD_EACCES);
  CHECK_MSG(c, "take");
  CHECK_ERR(c, td_unpublish(c, "grp/k"), TD_EACCES);
  CHECK_MSG(c, "unpublish");
  CHECK_MSG(c, "grp/k");
  CHECK_MSG(c, id);

  /* Replacing the key with a storage of its own is writing to it too. */
  CHECK_ERR(c, td_storage_create(c, 64, &mine), 0);
  CHECK_ERR(c, td_publish(c, "grp/k", mine, NULL), TD_EACCES);
  CHECK_MSG(c, "grp/k");
  CHECK_MSG(c, "replacing");
  CHECK_MSG(c, id);
  /* Its own keys are its own business. */
  char key[32];
  snprintf(key, sizeof(key), "grp/mine-%u", (unsigned)getuid());
  CHECK_ERR(c, td_publish(c, key, mine, NULL), 0);
  CHECK_ERR(c, td_unpublish(c, key), 0);
  td_storage_release(mine);

  /* Nothing of the key changed. */
  CHECK_ERR(c, td_lookup(c, "grp/k", TD_RDONLY, 0, &s, NULL), 0);
  CHECK(td_storage_id(s) == sid);
  CHECK(has_pattern(s, 11));
  td_storage_release(s);
  td_close(c);
  return 0;
}

static int stranger_cannot_read(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s = NULL;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_lookup(c, "grp/k", TD_RDONLY, 0, &s, NULL), TD_EACCES);
  CHECK_MSG(c, "0640");
  CHECK_MSG(c, "read-only");
  CHECK_ERR(c, td_storage_open(c, sid, TD_RDONLY, &s), TD_EACCES);
  CHECK(s == NULL);
  td_close(c);
  return 0;
}

static int owner_writes(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_lookup(c, "grp/k", 0, 0, &s, NULL), 0);
  CHECK(!td_storage_is_readonly(s));
  ((uint8_t *)td_storage_data(s))[0] = 0xee;
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(access, mode_0640_group_members_read_but_may_not_write,
         .timeout = 30) {
  need_root();
  start_shared(NULL);
  td_client *c = tdt_connect(&d);
  run_as(OWNER, owner_publishes_0640, NULL);
  about a = describe(c, 0, "grp/k");
  cr_assert_eq(a.info.mode, 0640);
  cr_assert_eq(a.info.owner_uid, OWNER.uid);
  cr_assert_eq(a.info.owner_gid, OWNER.gid);
  sid = a.info.id;

  run_as(MEMBER_SUPPL, member_reads_only, NULL);
  run_as(MEMBER_PRIMARY, member_reads_only, NULL);
  run_as(STRANGER, stranger_cannot_read, NULL);
  run_as(OWNER, owner_writes, NULL);

  /* Still published, still the owner's storage, written only by it. */
  a = describe(c, 0, "grp/k");
  cr_assert_eq(a.info.id, sid);
  cr_assert_eq(a.nkeys, 1);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "grp/k", TD_RDONLY, 0, &s, NULL), 0);
  const uint8_t *p = td_storage_data(s);
  cr_assert_eq(p[0], 0xee);
  cr_assert_eq(p[1], (uint8_t)(31 + 11));
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "grp/k"), 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- mode 0666: everyone writes ---- */

static int stranger_writes(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s, *t;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_storage_open(c, sid, 0, &s), 0);
  CHECK(!td_storage_is_readonly(s));
  memcpy(td_storage_data(s), "written by a stranger", 22);
  CHECK_ERR(c, td_lookup(c, "open/k", 0, 0, &t, NULL), 0);
  CHECK(!td_storage_is_readonly(t));
  td_storage_release(t);
  /* Take it and put it back: both need write, which 0666 gives. */
  CHECK_ERR(c, td_lookup(c, "open/k", TD_TAKE, 0, &t, NULL), 0);
  CHECK_ERR(c, td_lookup(c, "open/k", TD_RDONLY, 0, &t, NULL), TD_ENOENT);
  CHECK_ERR(c, td_publish(c, "open/k", s, NULL), 0);
  CHECK_ERR(c, td_publish(c, "open/k2", s, NULL), 0);
  CHECK_ERR(c, td_unpublish(c, "open/k2"), 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(access, mode_0666_lets_anyone_write, .timeout = 30) {
  need_root();
  start_shared(NULL);
  td_client *c = tdt_connect(&d);
  td_create_opts o = {0};
  o.nbytes = 4096;
  o.mode = 0666;
  td_storage *s;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "open/k", s, NULL), 0);
  sid = td_storage_id(s);
  run_as(STRANGER, stranger_writes, NULL);
  cr_assert_str_eq((const char *)td_storage_data(s), "written by a stranger");
  about a = describe(c, 0, "open/k");
  cr_assert_eq(a.info.id, sid);
  cr_assert_eq(a.info.mode, 0666);
  cr_assert_eq(a.info.owner_uid, 0, "the creator stays the owner");
  cr_assert_eq(td_unpublish(c, "open/k"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- root ---- */

static int owner_publishes_two(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
  fill_pattern(s, 5);
  CHECK_ERR(c, td_publish(c, "priv/a", s, NULL), 0);
  CHECK_ERR(c, td_publish(c, "priv/b", s, NULL), 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(access, root_may_do_anything_whatever_the_mode, .timeout = 30) {
  need_root();
  start_shared(NULL);
  td_client *c = tdt_connect(&d);
  run_as(OWNER, owner_publishes_two, NULL);
  about a = describe(c, 0, "priv/a");
  cr_assert_eq(a.info.mode, 0600);
  cr_assert_eq(a.info.owner_uid, OWNER.uid);
  uint64_t id = a.info.id;

  td_storage *s, *t, *mine;
  cr_assert_eq(td_lookup(c, "priv/a", 0, 0, &s, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_not(td_storage_is_readonly(s));
  cr_assert(has_pattern(s, 5));
  ((uint8_t *)td_storage_data(s))[0] = 0x42;
  cr_assert_eq(td_storage_open(c, id, 0, &t), 0, "%s", td_last_error(c));
  td_storage_release(t);
  cr_assert_eq(td_storage_open(c, id, TD_RDONLY, &t), 0);
  cr_assert_eq(((const uint8_t *)td_storage_data(t))[0], 0x42);
  td_storage_release(t);
  /* Replace, take and unpublish keys of a 0600 storage it does not own. */
  cr_assert_eq(td_storage_create(c, 64, &mine), 0);
  cr_assert_eq(td_publish(c, "priv/b", mine, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(td_lookup(c, "priv/a", TD_TAKE, 0, &t, NULL), 0, "%s",
               td_last_error(c));
  td_storage_release(t);
  cr_assert_eq(td_unpublish(c, "priv/b"), 0, "%s", td_last_error(c));
  td_storage_release(mine);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- waiting for a key one may not read ---- */

static int stranger_waits_to_take(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s = NULL;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_lookup(c, "late/k", TD_TAKE, 20000, &s, NULL), TD_EACCES);
  CHECK(s == NULL);
  CHECK_MSG(c, "late/k");
  CHECK_MSG(c, "take");
  td_close(c);
  return 0;
}

static int root_waits_to_take(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s = NULL;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_lookup(c, "late/k", TD_TAKE, 20000, &s, NULL), 0);
  CHECK(has_pattern(s, 9));
  td_storage_release(s);
  td_close(c);
  return 0;
}

static uint64_t want_waiters;

static int waiters_are(const tdt_daemon *dd) {
  td_client *c = tdt_connect(dd);
  td_stat st;
  int ok = td_stat_get(c, &st) == 0 && st.waiters == want_waiters;
  td_close(c);
  return ok;
}

TDT_TEST(access, refused_waiter_is_answered_and_the_next_one_served,
         .timeout = 30) {
  need_root();
  start_shared(NULL);
  /* First in line: a user who may not take it; second: root. */
  pid_t a = spawn_as(STRANGER, stranger_waits_to_take, NULL);
  want_waiters = 1;
  cr_assert(tdt_until(waiters_are, &d, 10000), "the stranger waits");
  pid_t b = tdt_fork(root_waits_to_take, NULL);
  want_waiters = 2;
  cr_assert(tdt_until(waiters_are, &d, 10000), "root waits too");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  fill_pattern(s, 9);
  cr_assert_eq(td_publish(c, "late/k", s, NULL), 0);
  cr_assert_eq(tdt_wait(a), 0, "the stranger got EACCES, not the key");
  cr_assert_eq(tdt_wait(b), 0, "root took the key");
  td_storage *t;
  cr_assert_eq(td_lookup(c, "late/k", 0, 0, &t, NULL), TD_ENOENT, "taken");
  want_waiters = 0;
  cr_assert(tdt_until(waiters_are, &d, 5000));
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- read-only means the kernel refuses writes ---- */

/* Sends an Open of id on a raw connection and returns the fd of the reply,
 * or -1 if the reply had none. */
static int raw_open_fd(int sock, uint64_t id, int readonly) {
  td__wire w;
  td__wire_init(&w, sock);
  Tensord__Open o = TENSORD__OPEN__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  o.id = id;
  o.readonly = readonly;
  o.force_fd = 1;
  req.seq = 2;
  req.body_case = TENSORD__REQUEST__BODY_OPEN;
  req.open = &o;
  size_t len = tensord__request__get_packed_size(&req);
  uint8_t *p = td__wire_reserve(&w, len);
  cr_assert_not_null(p);
  tensord__request__pack(&req, p);
  cr_assert_eq(td__wire_commit(&w, len, NULL, 0), 0);
  cr_assert_eq(td__wire_flush(&w, 0), 0);
  td__frame f;
  int got;
  while ((got = td__wire_frame(&w, &f)) == 0)
    cr_assert_gt(td__wire_recv(&w, 0), 0, "no reply to Open");
  cr_assert_eq(got, 1);
  Tensord__Response *r = tensord__response__unpack(NULL, f.len, f.data);
  cr_assert_not_null(r);
  cr_assert_eq(r->body_case, TENSORD__RESPONSE__BODY_STORAGE, "body %d: %s",
               (int)r->body_case,
               r->body_case == TENSORD__RESPONSE__BODY_ERROR ? r->error->message
                                                             : "");
  cr_assert_eq(r->storage->readonly, readonly);
  cr_assert_eq(f.nfds, 1);
  int fd = f.fds[0];
  tensord__response__free_unpacked(r, NULL);
  td__wire_consume(&w, &f);
  td__wire_free(&w);
  return fd;
}

TDT_TEST(access, read_only_handles_cannot_be_made_writable, .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  enum { N = 3 * 4096 };
  td_storage *s, *ro;
  cr_assert_eq(td_storage_create(c, N, &s), 0);
  fill_pattern(s, 1);
  cr_assert_eq(td_storage_open(c, td_storage_id(s), TD_RDONLY, &ro), 0);
  cr_assert(td_storage_is_readonly(ro));
  cr_assert_neq(td_storage_data(ro), td_storage_data(s),
                "a read-only handle has a mapping of its own");
  cr_assert(has_pattern(ro, 1));
  /* The read-write mapping may be made writable (it is); the read-only one
   * may not: its file description is O_RDONLY. */
  cr_assert_eq(mprotect(td_storage_data(s), N, PROT_READ | PROT_WRITE), 0);
  errno = 0;
  cr_assert_eq(mprotect(td_storage_data(ro), N, PROT_READ | PROT_WRITE), -1);
  cr_assert_eq(errno, EACCES, "mprotect: %s", strerror(errno));
  cr_assert(has_pattern(ro, 1));

  /* The fd itself, as tensord sends it. */
  int sock = tdt_raw_connect(&d, 1);
  int fd = raw_open_fd(sock, td_storage_id(s), 1);
  cr_assert_eq(fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  errno = 0;
  void *m = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  cr_assert_eq(m, MAP_FAILED, "mmap(PROT_WRITE) of a read-only fd");
  cr_assert_eq(errno, EACCES, "mmap: %s", strerror(errno));
  m = mmap(NULL, N, PROT_READ, MAP_SHARED, fd, 0);
  cr_assert_neq(m, MAP_FAILED, "mmap(PROT_READ): %s", strerror(errno));
  errno = 0;
  cr_assert_eq(mprotect(m, N, PROT_READ | PROT_WRITE), -1);
  cr_assert_eq(errno, EACCES);
  cr_assert_eq(((const uint8_t *)m)[N - 1], (uint8_t)((N - 1) * 31 + 1));
  munmap(m, N);
  close(fd);
  /* A read-write open gets a read-write fd. */
  fd = raw_open_fd(sock, td_storage_id(s), 0);
  cr_assert_eq(fcntl(fd, F_GETFL) & O_ACCMODE, O_RDWR);
  close(fd);
  close(sock);

  td_storage_release(ro);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

static char seg_path[128];

static int reader_cannot_write(void *arg) {
  (void)arg;
  td_client *c;
  td_storage *s = NULL;
  CHECK(child_connect(&c) == 0);
  /* 0644: others may read, not write. */
  CHECK_ERR(c, td_lookup(c, "ro/k", 0, 0, &s, NULL), TD_EACCES);
  CHECK_ERR(c, td_lookup(c, "ro/k", TD_RDONLY, 0, &s, NULL), 0);
  CHECK(td_storage_is_readonly(s));
  CHECK(has_pattern(s, 2));
  size_t n = td_storage_nbytes(s);
  errno = 0;
  CHECK(mprotect(td_storage_data(s), n, PROT_READ | PROT_WRITE) == -1);
  CHECK(errno == EACCES);
  /* Nor can it get a writable description some other way: the segment
   * belongs to tensord's user. */
  errno = 0;
  int fd = open(seg_path, O_RDWR | O_CLOEXEC);
  CHECK(fd < 0 && errno == EACCES);
  CHECK(has_pattern(s, 2));
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(access, read_only_reader_of_another_user_cannot_write, .timeout = 30) {
  need_root();
  start_shared(NULL);
  td_client *c = tdt_connect(&d);
  td_create_opts o = {0};
  o.nbytes = 8192;
  o.mode = 0644;
  td_storage *s;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "%s", td_last_error(c));
  fill_pattern(s, 2);
  cr_assert_eq(td_publish(c, "ro/k", s, NULL), 0);
  cr_assert(tdt_segment_path(d.instance, td_storage_id(s), seg_path,
                             sizeof(seg_path)));
  struct stat sb;
  cr_assert_eq(stat(seg_path, &sb), 0, "segment %s: %s", seg_path,
               strerror(errno));
  run_as(STRANGER, reader_cannot_write, NULL);
  cr_assert(has_pattern(s, 2));
  cr_assert_eq(td_unpublish(c, "ro/k"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- modes at create ---- */

TDT_TEST(access, create_with_bits_beyond_0666_is_einval, .timeout = 30) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  static const uint32_t bad[] = {0777, 0700, 0601, 0610, 01600, 04600, 0100000};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    td_create_opts o = {0};
    o.nbytes = 4096;
    o.mode = bad[i];
    td_storage *s = (td_storage *)1;
    cr_assert_eq(td_storage_create_ex(c, &o, &s), TD_EINVAL, "mode %04o: %s",
                 bad[i], td_last_error(c));
    cr_assert_null(s);
    char want[16];
    snprintf(want, sizeof(want), "%04o", bad[i]);
    cr_assert(strstr(td_last_error(c), want) != NULL,
              "mode %04o: message '%s' names the mode", bad[i],
              td_last_error(c));
  }
  cr_assert_eq(tdt_storages(&d), 0, "nothing was created");
  /* Allowed modes are kept as given; 0 means 0600. */
  static const uint32_t good[][2] = {{0, 0600},    {0600, 0600}, {0400, 0400},
                                     {0640, 0640}, {0666, 0666}, {0604, 0604},
                                     {0200, 0200}};
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    td_create_opts o = {0};
    o.nbytes = 64;
    o.mode = good[i][0];
    td_storage *s;
    cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "mode %04o: %s",
                 good[i][0], td_last_error(c));
    about a = describe(c, td_storage_id(s), NULL);
    cr_assert_eq(a.info.mode, good[i][1], "mode %04o became %04o", good[i][0],
                 a.info.mode);
    cr_assert_eq(a.info.owner_uid, getuid());
    cr_assert_eq(a.info.owner_gid, getgid());
    td_storage_release(s);
  }
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- tensorctl ls -l ---- */

/* Finds the ls -l row of storage id in out: its mode, owner and group. */
static int ls_row(const char *out, uint64_t id, char *mode, char *owner,
                  char *group) {
  const char *line = out;
  while (line && *line) {
    unsigned long long got;
    if (sscanf(line, "%15s %31s %31s %llu", mode, owner, group, &got) == 4 &&
        got == id)
      return 1;
    line = strchr(line, '\n');
    if (line)
      line++;
  }
  return 0;
}

TDT_TEST(access, tensorctl_ls_l_shows_mode_owner_and_group, .timeout = 30) {
  need_root();
  start_shared(NULL);
  td_client *c = tdt_connect(&d);
  run_as(OWNER, owner_publishes_0640, NULL);
  uint64_t theirs = describe(c, 0, "grp/k").info.id;
  td_create_opts o = {0};
  o.nbytes = 64;
  td_storage *mine, *open;
  cr_assert_eq(td_storage_create_ex(c, &o, &mine), 0);
  o.mode = 0666;
  cr_assert_eq(td_storage_create_ex(c, &o, &open), 0);

  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "ls",
                                    "-l", NULL},
              &r);
  tdt_expect_ok(&r, "ls -l");
  const char *out = r.out;
  cr_assert(strstr(out, "MODE") && strstr(out, "OWNER") && strstr(out, "GROUP"),
            "header: %s", out);
  char mode[16], owner[32], group[32];
  cr_assert(ls_row(out, theirs, mode, owner, group), "no row for %llu: %s",
            (unsigned long long)theirs, out);
  cr_assert_str_eq(mode, "-rw-r-----", "%s", out);
  cr_assert_str_eq(owner, "4242", "uid without a name shows as a number");
  cr_assert_str_eq(group, "4243");
  cr_assert(ls_row(out, td_storage_id(mine), mode, owner, group), "%s", out);
  cr_assert_str_eq(mode, "-rw-------", "%s", out);
  cr_assert_str_eq(owner, "root");
  cr_assert_str_eq(group, "root");
  cr_assert(ls_row(out, td_storage_id(open), mode, owner, group), "%s", out);
  cr_assert_str_eq(mode, "-rw-rw-rw-", "%s", out);

  /* Without -l there is no mode column. */
  tdt_run_free(&r);
  tdt_cli_run(
      (const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "ls", NULL}, &r);
  tdt_expect_ok(&r, "ls");
  cr_assert_null(strstr(r.out, "-rw-"), "%s", r.out);
  tdt_run_free(&r);

  td_storage_release(mine);
  td_storage_release(open);
  cr_assert_eq(td_unpublish(c, "grp/k"), 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- the socket ---- */

static int connects(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(child_connect(&c) == 0);
  CHECK_ERR(c, td_ping(c, NULL), 0);
  td_close(c);
  return 0;
}

static int cannot_connect(void *arg) {
  (void)arg;
  td_client *c = NULL;
  CHECK_ERR(NULL, td_connect(d.sock, &c), TD_EACCES);
  CHECK(c == NULL);
  return 0;
}

TDT_TEST(access, socket_group_and_mode_are_applied, .timeout = 30) {
  need_root();
  tdt_start(&d, (const char *const[]){"--socket-mode", "0660", "--socket-group",
                                      "4243", NULL});
  struct stat sb;
  cr_assert_eq(stat(d.sock, &sb), 0);
  cr_assert(S_ISSOCK(sb.st_mode));
  cr_assert_eq(sb.st_mode & 07777, 0660, "socket mode %04o",
               (unsigned)(sb.st_mode & 07777));
  cr_assert_eq(sb.st_gid, 4243, "socket group %u", (unsigned)sb.st_gid);
  cr_assert_eq(sb.st_uid, getuid());
  /* The directory no longer stands in the way: the socket decides. */
  cr_assert_eq(chmod(d.dir, 0755), 0);
  run_as(MEMBER_SUPPL, connects, NULL);
  run_as(MEMBER_PRIMARY, connects, NULL);
  run_as(STRANGER, cannot_connect, NULL);
  tdt_stop(&d);
}

/* The socket tensord binds is 0600 whatever the umask it starts under:
 * under umask 0 it would otherwise be 0777 and anyone could connect. */
TDT_TEST(access, default_socket_is_0600_whatever_the_umask, .timeout = 30) {
  need_root();
  mode_t was = umask(0);
  tdt_start(&d, NULL);
  umask(was);
  struct stat sb;
  cr_assert_eq(stat(d.sock, &sb), 0);
  cr_assert_eq(sb.st_mode & 07777, 0600, "socket mode %04o under umask 0",
               (unsigned)(sb.st_mode & 07777));
  cr_assert_eq(chmod(d.dir, 0755), 0);
  run_as(STRANGER, cannot_connect, NULL);
  tdt_stop(&d);
}

/* --socket-mode that lets others connect, in a directory they cannot
 * enter (the harness's is 0700): tensord warns, naming the directory and
 * its mode; --socket-group without a group write bit is warned of too. */
TDT_TEST(access, socket_mode_warns_of_a_directory_others_cannot_enter,
         .timeout = 30) {
  need_root();
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  char want[160];
  snprintf(want, sizeof(want), "but directory %s (mode 0700, owner uid 0",
           d.dir);
  cr_assert(tdt_log_has(&d, want), "no warning naming %s in %s", d.dir, d.log);
  tdt_stop(&d);
  tdt_start(&d, (const char *const[]){"--socket-group", "4243", NULL});
  cr_assert(tdt_log_has(&d, "--socket-group 4243: the socket's mode 0600 "
                            "gives the group no write bit"),
            "see %s", d.log);
  tdt_stop(&d);
}

/* The same --socket-mode in a directory others can enter: no warning. */
TDT_TEST(access, socket_mode_in_a_reachable_directory_is_not_warned_of,
         .timeout = 30) {
  need_root();
  tdt_start(&d, NULL);
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  cr_assert_eq(tdt_wait(d.pid), 0);
  d.pid = 0;
  cr_assert_eq(chmod(d.dir, 0755), 0);
  tdt_restart(&d, (const char *const[]){"--socket-mode", "0666",
                                        "--socket-group", "4243", NULL});
  cr_assert_not(tdt_log_has(&d, "does not let them reach it"), "see %s", d.log);
  cr_assert_not(tdt_log_has(&d, "gives the group no write bit"), "see %s",
                d.log);
  run_as(STRANGER, connects, NULL);
  tdt_stop(&d);
}

static int denied_names(void *arg) {
  const char *needle = arg;
  td_client *c = NULL;
  CHECK_ERR(NULL, td_connect(d.sock, &c), TD_EACCES);
  CHECK_MSG(NULL, needle);
  return 0;
}

/* A client refused at connect() is told what refused it: the first
 * directory it may not enter, else the socket's mode. */
TDT_TEST(access, permission_denied_names_the_directory_or_the_socket,
         .timeout = 30) {
  need_root();
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  char want[160];
  snprintf(want, sizeof(want),
           "Permission denied (directory %s is mode 0700, owner uid 0", d.dir);
  run_as(STRANGER, denied_names, want);
  tdt_stop(&d);

  tdt_start(&d, NULL);
  cr_assert_eq(chmod(d.dir, 0755), 0);
  run_as(STRANGER, denied_names,
         "Permission denied (the socket is mode 0600, owner uid 0");
  tdt_stop(&d);
}

TDT_TEST(access, socket_group_by_name_and_mode_0600, .timeout = 30) {
  need_root();
  struct group *g = getgrgid(0);
  if (g == NULL)
    cr_skip_test("group 0 has no name here");
  char name[64];
  snprintf(name, sizeof(name), "%s", g->gr_name);
  tdt_start(&d, (const char *const[]){"--socket-mode", "0600", "--socket-group",
                                      name, NULL});
  struct stat sb;
  cr_assert_eq(stat(d.sock, &sb), 0);
  cr_assert_eq(sb.st_mode & 07777, 0600);
  cr_assert_eq(sb.st_gid, 0);
  cr_assert_eq(chmod(d.dir, 0755), 0);
  run_as(MEMBER_SUPPL, cannot_connect, NULL);
  tdt_stop(&d);
}

TDT_TEST(access, unknown_socket_group_fails_to_start, .timeout = 30) {
  /* The group cannot exist: ':' is not allowed in group names. */
  char dir[64];
  tdt_mkdtemp(dir);
  char sock[108], log[128];
  snprintf(sock, sizeof(sock), "%s/s.sock", dir);
  snprintf(log, sizeof(log), "%s/log", dir);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || dup2(fd, STDERR_FILENO) < 0)
      _exit(126);
    unsetenv("NOTIFY_SOCKET");
    execl(TENSORD_BIN, TENSORD_BIN, "--socket", sock, "--socket-group",
          "nosuchgroup:x", (char *)NULL);
    _exit(127);
  }
  int st = tdt_wait(pid);
  char buf[1024] = "";
  FILE *f = fopen(log, "r");
  if (f) {
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = '\0';
    fclose(f);
  }
  struct stat sb;
  int sock_left = stat(sock, &sb) == 0;
  unlink(log);
  unlink(sock);
  char inst[140];
  snprintf(inst, sizeof(inst), "%s.instance", sock);
  unlink(inst);
  rmdir(dir);
  cr_assert_neq(st, 0, "tensord started with an unknown group");
  cr_assert(strstr(buf, "no such group") != NULL, "stderr: %s", buf);
  cr_assert_not(sock_left, "tensord left its socket");
}

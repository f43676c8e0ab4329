/* test_state.c: --state-dir in-process: a daemon set up with
 * td__server_init and td__state_open on a directory the test writes, one
 * client on a socket pair, and failures injected by wrapping functions at
 * link time (-Wl,--wrap; see tests/CMakeLists.txt), with no hook in the
 * daemon:
 *   realloc         fails while `refuse_allocs` is set;
 *   td__state_put,  set `refuse_allocs` around the real call when `starve`
 *   td__state_del   is set: the journal record finds no memory;
 *   td__key_publish fails with TD_ENOMEM for key `refuse_key` (state.c's
 *                   load is its only caller that the wrap reaches). */
#include "common.h"
#include "log.h"
#include "registry.h"
#include "segment.h"
#include "conn.h"
#include "start.h"
#include "state.h"
#include "tensord.pb-c.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- the wrapped functions ---- */

static int refuse_allocs; /* realloc fails while set */
static int refused;       /* reallocs refused so far */
static int starve;        /* the next record's append finds no memory */
static const char *refuse_key;

void *__real_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n) {
  if (refuse_allocs) {
    refused++;
    errno = ENOMEM;
    return NULL;
  }
  return __real_realloc(p, n);
}

int __real_td__state_put(td__state *st, const char *key, size_t len,
                         const td__storage *s, uid_t uid, const td_view *view);
int __wrap_td__state_put(td__state *st, const char *key, size_t len,
                         const td__storage *s, uid_t uid, const td_view *view);
int __wrap_td__state_put(td__state *st, const char *key, size_t len,
                         const td__storage *s, uid_t uid, const td_view *view) {
  refuse_allocs = starve;
  int err = __real_td__state_put(st, key, len, s, uid, view);
  refuse_allocs = starve = 0;
  return err;
}

int __real_td__state_del(td__state *st, const char *key, size_t len);
int __wrap_td__state_del(td__state *st, const char *key, size_t len);
int __wrap_td__state_del(td__state *st, const char *key, size_t len) {
  refuse_allocs = starve;
  int err = __real_td__state_del(st, key, len);
  refuse_allocs = starve = 0;
  return err;
}

int __real_td__key_publish(td__registry *r, const char *key, size_t len,
                           td__storage *s, uid_t uid, const td_view *view,
                           td__key **out);
int __wrap_td__key_publish(td__registry *r, const char *key, size_t len,
                           td__storage *s, uid_t uid, const td_view *view,
                           td__key **out);
int __wrap_td__key_publish(td__registry *r, const char *key, size_t len,
                           td__storage *s, uid_t uid, const td_view *view,
                           td__key **out) {
  if (refuse_key != NULL && strlen(refuse_key) == len &&
      memcmp(refuse_key, key, len) == 0)
    return TD_ENOMEM;
  return __real_td__key_publish(r, key, len, s, uid, view, out);
}

/* ---- an in-process daemon and its client ---- */

static uv_loop_t loop;
static td__server srv;
static char dir[64];
static int cfd = -1;
static td__wire cw;
static uint64_t seq;
static uint64_t prefixes_made[4]; /* instances whose segments to remove */
static int nprefixes;

/* Sets the daemon up on dir (which holds whatever the test wrote). */
static void daemon_up(void) {
  td__options o = {0};
  o.capacity = 1u << 30;
  o.socket_mode = -1;
  cr_assert_eq(uv_loop_init(&loop), 0);
  td__server_init(&srv, &loop, &o);
  if (nprefixes < 4)
    prefixes_made[nprefixes++] = srv.instance;
  snprintf(srv.state_dir, sizeof(srv.state_dir), "%s", dir);
  cr_assert_eq(td__state_open(&srv, dir), 0, "td__state_open(%s)", dir);
}

static void pump(int block) {
  uv_run(&loop, block && srv.pending_work > 0 ? UV_RUN_ONCE : UV_RUN_NOWAIT);
}

/* Runs the loop until nothing is left to do. */
static void run_to_idle(void) {
  for (int i = 0; i < 100000 && uv_loop_alive(&loop); i++)
    pump(1);
  cr_assert_not(uv_loop_alive(&loop), "the loop does not settle");
}

static void daemon_down(void) {
  if (cfd >= 0) {
    td__wire_free(&cw);
    close(cfd);
    cfd = -1;
    for (int i = 0; i < 1000 && srv.nconns > 0; i++)
      pump(0);
  }
  td__server_stop(&srv);
  run_to_idle();
  cr_assert_eq(uv_loop_close(&loop), 0);
}

static void client_up(void) {
  int sv[2];
  cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  cr_assert_eq(td__conn_accept(&srv, sv[1]), 0);
  cfd = sv[0];
  td__wire_init(&cw, cfd);
  seq = 0;
}

/* Sends q and returns the reply (fds closed); free it with
 * tensord__response__free_unpacked. */
static Tensord__Response *call(Tensord__Request *q) {
  q->seq = ++seq;
  size_t n = tensord__request__get_packed_size(q);
  uint8_t *p = td__wire_reserve(&cw, n);
  cr_assert_not_null(p);
  tensord__request__pack(q, p);
  cr_assert_eq(td__wire_commit(&cw, n, NULL, 0), 0);
  for (int i = 0; i < 100000; i++) {
    if (td__wire_pending(&cw) > 0)
      td__wire_flush(&cw, MSG_DONTWAIT);
    td__frame f;
    if (td__wire_frame(&cw, &f) == 1) {
      Tensord__Response *r = tensord__response__unpack(NULL, f.len, f.data);
      td__close_fds(f.fds, f.nfds);
      td__wire_consume(&cw, &f);
      cr_assert_not_null(r);
      cr_assert_eq(r->seq, q->seq);
      return r;
    }
    if (td__wire_recv(&cw, MSG_DONTWAIT) > 0)
      continue;
    pump(1);
  }
  cr_assert_fail("no reply to seq %llu", (unsigned long long)q->seq);
  return NULL;
}

/* The code of r (0 unless an Error); frees r. */
static int code_of(Tensord__Response *r) {
  int code = r->body_case == TENSORD__RESPONSE__BODY_ERROR ? r->error->code : 0;
  if (code != 0)
    cr_log_info("seq %llu: %s", (unsigned long long)r->seq, r->error->message);
  tensord__response__free_unpacked(r, NULL);
  return code;
}

static void hello(void) {
  Tensord__Hello h = TENSORD__HELLO__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  h.version = TD_PROTOCOL_VERSION;
  q.body_case = TENSORD__REQUEST__BODY_HELLO;
  q.hello = &h;
  cr_assert_eq(code_of(call(&q)), 0);
}

static uint64_t create(uint64_t nbytes) {
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.nbytes = nbytes;
  q.body_case = TENSORD__REQUEST__BODY_CREATE;
  q.create = &m;
  Tensord__Response *r = call(&q);
  cr_assert_eq(r->body_case, TENSORD__RESPONSE__BODY_STORAGE);
  uint64_t id = r->storage->id;
  tensord__response__free_unpacked(r, NULL);
  return id;
}

static int publish(const char *key, uint64_t id) {
  Tensord__Publish m = TENSORD__PUBLISH__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = strlen(key);
  m.id = id;
  q.body_case = TENSORD__REQUEST__BODY_PUBLISH;
  q.publish = &m;
  return code_of(call(&q));
}

static int unpublish(const char *key) {
  Tensord__Unpublish m = TENSORD__UNPUBLISH__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = strlen(key);
  q.body_case = TENSORD__REQUEST__BODY_UNPUBLISH;
  q.unpublish = &m;
  return code_of(call(&q));
}

static int take(const char *key) {
  Tensord__Lookup m = TENSORD__LOOKUP__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = strlen(key);
  m.take = 1;
  q.body_case = TENSORD__REQUEST__BODY_LOOKUP;
  q.lookup = &m;
  return code_of(call(&q));
}

/* The storage key names, or 0 if it is not published. */
static uint64_t named(const char *key) {
  td__key *k = td__key_find(&srv.reg, key, strlen(key));
  return k ? k->storage->id : 0;
}

/* ---- the suite ---- */

static void setup(void) {
  td__log_level = TD_LOG_ERROR;
  refuse_allocs = refused = starve = 0;
  refuse_key = NULL;
  nprefixes = 0;
  cfd = -1;
  snprintf(dir, sizeof(dir), "/tmp/tensord-ustate.XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void) {
  for (int i = 0; i < nprefixes; i++) {
    char prefix[48];
    snprintf(prefix, sizeof(prefix), "tensord.%016llx.",
             (unsigned long long)prefixes_made[i]);
    td__segments_unlink_prefix(prefix, NULL, NULL);
  }
  DIR *d = opendir(dir);
  struct dirent *e;
  char path[320];
  while (d && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
    unlink(path);
  }
  if (d)
    closedir(d);
  rmdir(dir);
}

TestSuite(state, .init = setup, .fini = teardown, .timeout = 30);

/* ---- a key change that cannot be recorded ---- */

Test(state, change_that_cannot_be_recorded_is_eio_and_not_made) {
  daemon_up();
  client_up();
  hello();
  uint64_t s1 = create(4096), s2 = create(4096);
  cr_assert_eq(publish("a", s1), 0);

  starve = 1;
  cr_assert_eq(publish("b", s1), TD_EIO, "a new key");
  cr_assert_gt(refused, 0, "the record's allocation was refused");
  cr_assert_eq(named("b"), 0, "and the key was not published");

  refused = 0;
  starve = 1;
  cr_assert_eq(publish("a", s2), TD_EIO, "a replaced key");
  cr_assert_gt(refused, 0);
  cr_assert_eq(named("a"), s1, "the key still names its storage");

  refused = 0;
  starve = 1;
  cr_assert_eq(unpublish("a"), TD_EIO);
  cr_assert_gt(refused, 0);
  cr_assert_eq(named("a"), s1, "the key is still published");

  td__conn *c = srv.conns;
  uint64_t refs = c->hold.nrefs;
  uint32_t srefs = td__storage_find(&srv.reg, s1)->refs;
  refused = 0;
  starve = 1;
  cr_assert_eq(take("a"), TD_EIO);
  cr_assert_gt(refused, 0);
  cr_assert_eq(named("a"), s1, "the key was not taken");
  cr_assert_eq(c->hold.nrefs, refs, "nor a reference given");
  cr_assert_eq(td__storage_find(&srv.reg, s1)->refs, srefs);

  /* With memory again, all of it works; and the journal says what the
   * clients were told. */
  cr_assert_eq(publish("c", s2), 0);
  cr_assert_eq(srv.reg.keys.count, 2);
  daemon_down();
  daemon_up();
  cr_assert_eq(srv.reg.keys.count, 2, "a restart serves 'a' and 'c' only");
  cr_assert_neq(named("a"), 0);
  cr_assert_neq(named("c"), 0);
  cr_assert_eq(named("b"), 0);
  cr_assert_neq(named("a"), named("c"), "on their own storages");
  daemon_down();
}

/* ---- serving keys again at a start ---- */

static int seg_exists(const char *name) {
  char path[96];
  struct stat sb;
  snprintf(path, sizeof(path), "/dev/shm%s", name);
  return stat(path, &sb) == 0;
}

Test(state, key_that_cannot_be_served_again_leaves_no_charge_or_storage) {
  daemon_up();
  client_up();
  hello();
  uint64_t s1 = create(4096), s2 = create(8192);
  cr_assert_eq(publish("keep", s1), 0);
  cr_assert_eq(publish("lose", s2), 0);
  char lost[64];
  snprintf(lost, sizeof(lost), "%s", td__storage_find(&srv.reg, s2)->name);
  daemon_down();
  cr_assert(seg_exists(lost), "a stop keeps keyed segments");

  /* The next start runs out of memory publishing 'lose' again. */
  refuse_key = "lose";
  daemon_up();
  cr_assert_eq(srv.reg.keys.count, 1);
  cr_assert_neq(named("keep"), 0);
  cr_assert_eq(named("lose"), 0);
  cr_assert_eq(srv.reg.storages.count, 1, "a storage nothing references");
  for (const td__storage *s = srv.reg.first; s; s = s->next)
    cr_assert_gt(s->refs, 0, "storage %llu has no reference",
                 (unsigned long long)s->id);
  cr_assert_eq(srv.reg.bytes_used, 4096);
  cr_assert_eq(srv.reg.bytes_committed, 4096,
               "the dropped key's 8192 bytes are still charged");
  cr_assert_eq(td__usage_of(&srv.reg, getuid()), 4096);
  cr_assert_not(seg_exists(lost), "nothing names it: it is swept");
  refuse_key = NULL;
  daemon_down();
}

Test(state, keys_count_against_their_publisher_after_a_restart) {
  daemon_up();
  client_up();
  hello();
  uint64_t s1 = create(4096);
  cr_assert_eq(publish("p/1", s1), 0);
  cr_assert_eq(publish("p/2", s1), 0);
  /* As if another uid had published p/2 (the client's uid is ours). */
  td__key *k = td__key_find(&srv.reg, "p/2", 3);
  cr_assert_eq(td__state_put(srv.state, "p/2", 3, k->storage, 4321, &k->view),
               0);
  cr_assert_eq(
      td__key_publish(&srv.reg, "p/2", 3, k->storage, 4321, &k->view, &k), 0);
  cr_assert_eq(publish("p/3", s1), 0); /* the record is on disk by now */
  daemon_down();
  daemon_up();
  cr_assert_eq(td__keys_of(&srv.reg, getuid()), 2);
  cr_assert_eq(td__keys_of(&srv.reg, 4321), 1);
  daemon_down();
}

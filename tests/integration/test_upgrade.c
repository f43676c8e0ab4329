/* test_upgrade.c: live upgrade: tensord --upgrade and tensorctl upgrade hand
 * every client, reference, key, scope, waiter and channel to a new tensord
 * without a client noticing; an incompatible handover version changes
 * nothing, nor does a successor that cannot carry the channels open; a
 * SIGKILL at any phase leaves exactly one daemon (or the --state-dir
 * recovery path); systemd learns the new MAINPID. */
#include "cli.h"
#include "harness.h"
#include "raw.h"

#include "handover.pb-c.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;
static char state_dir[64];
static uint64_t instances[8];
static int ninstances;

/* The bound on a wait for something that must happen (a daemon serving, a
 * segment going): it only ends a hang, and decides nothing on a machine
 * slowed by load. */
#define HANG_MS 30000

/* A wait of base ms, longer when tensord runs under a tool (valgrind). */
static int patience(int base) {
  return getenv("TDT_DAEMON_WRAPPER") ? base * 20 : base;
}

static void remember(uint64_t instance) {
  if (ninstances < 8)
    instances[ninstances++] = instance;
  tdt_note_instance(instance);
}

static void setup(void) {
  memset(&d, 0, sizeof(d));
  state_dir[0] = '\0';
  ninstances = 0;
  /* A tensord that tensorctl upgrade spawns is the old one's child; when
   * the old one exits it becomes ours, so that we can wait for it. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  unsetenv("TENSORD_UPGRADE_STALL");
  unsetenv("TENSORD_HANDOVER_VERSION");
}

static void teardown(void) {
  if (d.pid > 0) {
    kill(d.pid, SIGKILL);
    tdt_wait(d.pid);
    d.pid = 0;
  }
  for (int i = 0; i < ninstances; i++)
    tdt_unlink_segments(instances[i]);
  tdt_rmdir(state_dir);
  state_dir[0] = '\0';
  if (d.dir[0] != '\0')
    tdt_kill(&d);
}

TestSuite(upgrade, .init = setup, .fini = teardown, .timeout = 60);

/* ---- helpers ---- */

/* Runs argv, returns its exit status; its stdout (up to len - 1 bytes) in
 * out if not NULL. */
static int run(const char *const *argv, char *out, size_t len) {
  int p[2];
  cr_assert_eq(pipe(p), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    dup2(p[1], STDOUT_FILENO);
    close(p[0]);
    close(p[1]);
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(p[1]);
  size_t n = 0;
  ssize_t k;
  char sink[4096];
  while ((k = read(p[0], out && n < len - 1 ? out + n : sink,
                   out && n < len - 1 ? len - 1 - n : sizeof(sink))) > 0)
    if (out && n < len - 1)
      n += (size_t)k;
  close(p[0]);
  if (out)
    out[n] = '\0';
  return tdt_wait(pid);
}

/* tensorctl ls --json without what changes by itself: every "age_ms". */
static void ls_json(char *out, size_t len) {
  const char *argv[] = {TENSORCTL_BIN, "--socket", d.sock,
                        "ls",          "--json",   NULL};
  cr_assert_eq(run(argv, out, len), 0, "tensorctl ls failed");
  char *w = out;
  for (const char *r = out; *r;) {
    if (strncmp(r, "\"age_ms\":", 9) == 0) {
      r += 9;
      while (*r >= '0' && *r <= '9')
        r++;
      if (*r == ',')
        r++;
      continue;
    }
    *w++ = *r++;
  }
  *w = '\0';
}

/* The names of instance's segments in /dev/shm, sorted, one per line. */
static void segment_names(uint64_t instance, char *out, size_t len) {
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "tensord.%016llx.",
           (unsigned long long)instance);
  struct dirent **list;
  int n = scandir("/dev/shm", &list, NULL, alphasort);
  cr_assert(n >= 0);
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < n; i++) {
    if (strncmp(list[i]->d_name, prefix, strlen(prefix)) == 0)
      used += (size_t)snprintf(out + used, len - used, "%s\n", list[i]->d_name);
    free(list[i]);
  }
  free(list);
}

static int32_t serving_pid(void) {
  td_client *c;
  if (td_connect(d.sock, &c) < 0)
    return 0;
  td_stat st;
  int err = td_stat_get(c, &st);
  td_close(c);
  return err < 0 ? 0 : st.pid;
}

/* Waits until the daemon on d's socket is pid; returns whether it is. */
static int serves_as(pid_t pid, int timeout_ms) {
  for (int t = 0; t < timeout_ms; t += 20) {
    if (serving_pid() == pid)
      return 1;
    tdt_sleep_ms(20);
  }
  return serving_pid() == pid;
}

/* tensord --upgrade next to d's daemon (with args): asserts that the old
 * one exits 0 and the new one serves, with the same instance. */
static void upgrade_cli(const char *const *args) {
  const char *a[8] = {"--upgrade"};
  for (int i = 0; args && args[i] && i < 6; i++)
    a[i + 1] = args[i];
  pid_t old = d.pid;
  pid_t pid = tdt_spawn(&d, a);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  d.pid = pid;
  cr_assert(serves_as(pid, patience(HANG_MS)),
            "the new tensord %d does not serve", (int)pid);
}

/* tensorctl upgrade: the same, the new daemon spawned by the old one. */
static void upgrade_ctl(void) {
  pid_t old = d.pid;
  char out[256];
  const char *argv[] = {TENSORCTL_BIN, "--socket", d.sock, "upgrade", NULL};
  cr_assert_eq(run(argv, out, sizeof(out)), 0, "tensorctl upgrade failed");
  int a, b;
  cr_assert_eq(sscanf(out,
                      "tensord upgraded: pid %d (version %*[^)]) -> pid %d", &a,
                      &b),
               2, "tensorctl upgrade said '%s'", out);
  cr_assert_eq(a, old);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  d.pid = b;
  cr_assert(serves_as(b, patience(HANG_MS)),
            "the new tensord %d does not serve", b);
}

/* Copies d's log to stderr, for a failure that needs it. */
static void show_log(void) {
  FILE *f = fopen(d.log, "r");
  char line[1024];
  while (f != NULL && fgets(line, sizeof(line), f) != NULL)
    fputs(line, stderr);
  if (f != NULL)
    fclose(f);
}

static int alive(pid_t pid) {
  int status;
  return waitpid(pid, &status, WNOHANG) == 0;
}

/* Waits until pid (our child) has stopped itself (TENSORD_UPGRADE_STALL). */
static void wait_stopped(pid_t pid) {
  int status;
  cr_assert_eq(waitpid(pid, &status, WUNTRACED), pid);
  cr_assert(WIFSTOPPED(status), "tensord %d ended (0x%x) instead of stopping",
            (int)pid, status);
}

/* Waits until no segment of instance is left in /dev/shm. */
static int none_of(uint64_t instance) {
  for (int t = 0; t < patience(HANG_MS) && tdt_segments_of(instance) > 0;
       t += 10)
    tdt_sleep_ms(10);
  return tdt_segments_of(instance) == 0;
}

static void make_state_dir(void) {
  snprintf(state_dir, sizeof(state_dir), "/tmp/tensord-state.XXXXXX");
  cr_assert_not_null(mkdtemp(state_dir));
}

/* Waits until the daemon has read every byte sent on fd, one of its Unix
 * stream connections (SIOCOUTQ: what the peer has not read). The bound only
 * ends a hang. */
static void read_by_daemon(int fd) {
  int unread = 1;
  for (int t = 0; t < patience(HANG_MS) && unread > 0; t += 2) {
    cr_assert_eq(ioctl(fd, SIOCOUTQ, &unread), 0);
    if (unread > 0)
      tdt_sleep_ms(2);
  }
  cr_assert_eq(unread, 0, "the daemon does not read what was sent");
}

/* Waits until the daemon has n lookups waiting (stat, asked on c). */
static void waiters_are(td_client *c, uint64_t n) {
  td_stat st;
  for (int t = 0;; t += 5) {
    cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
    if (st.waiters == n || t >= patience(HANG_MS))
      break;
    tdt_sleep_ms(5);
  }
  cr_assert_eq(st.waiters, n, "%llu lookup(s) wait, not %llu",
               (unsigned long long)st.waiters, (unsigned long long)n);
}

/* ---- carry-over ---- */

TDT_TEST(upgrade, carries_everything_over) {
  tdt_start(&d, (const char *const[]){"--quota", "1G", "--max-clients", "77",
                                      "--max-storages-per-client", "99", NULL});
  remember(d.instance);
  td_client *a = tdt_connect(&d), *b = tdt_connect(&d);
  td_storage *s1, *s2, *s3, *ro, *sc;
  cr_assert_eq(td_storage_create(a, 4096, &s1), 0);
  cr_assert_eq(td_storage_create(a, 8192, &s2), 0);
  cr_assert_eq(td_storage_create(b, 100, &s3), 0);
  memset(td_storage_data(s1), 0x5a, 4096);
  cr_assert_eq(td_publish(a, "plain", s1, NULL), 0);
  td_view v;
  int64_t shape[2] = {32, 64};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), 0);
  cr_assert_eq(td_publish(a, "viewed", s2, &v), 0);
  cr_assert_eq(td_storage_open(b, td_storage_id(s1), TD_RDONLY, &ro), 0);
  uint64_t token;
  cr_assert_eq(td_scope_open(b, &token), 0);
  cr_assert_eq(td_storage_create(b, 64, &sc), 0);
  td_publish_opts po = {0};
  po.scope = token;
  cr_assert_eq(td_publish_ex(b, "scoped", sc, NULL, &po), 0);
  /* A waiting lookup, and a request half sent. */
  tdt_raw w, h;
  tdt_raw_open(&w, &d);
  uint64_t wseq = tdt_raw_lookup(&w, "later", 0, -1);
  tdt_raw_flush(&w);
  tdt_raw_open(&h, &d);
  uint64_t pseq = tdt_raw_ping(&h);
  size_t half = h.w.out_len / 2;
  cr_assert_eq(send(h.fd, h.w.out, half, 0), (ssize_t)half);
  /* The daemon has read both and registered the lookup. */
  read_by_daemon(h.fd);
  read_by_daemon(w.fd);
  waiters_are(a, 1);

  static char before[16384], after[16384], segs0[4096], segs1[4096];
  ls_json(before, sizeof(before));
  segment_names(d.instance, segs0, sizeof(segs0));
  uint64_t instance = d.instance;
  pid_t old = d.pid;
  upgrade_cli(NULL);
  cr_assert_not(alive(old));
  ls_json(after, sizeof(after));
  segment_names(instance, segs1, sizeof(segs1));
  cr_assert_str_eq(after, before, "ls before:\n%s\nafter:\n%s", before, after);
  cr_assert_str_eq(segs1, segs0);
  td_stat st;
  cr_assert_eq(td_stat_get(a, &st), 0, "stat: %s", td_last_error(a));
  cr_assert_eq(st.pid, d.pid);
  cr_assert_eq(st.instance, instance);
  cr_assert_eq(st.keys, 3);
  cr_assert_eq(st.waiters, 1);
  /* The limits in force, not the new command line's (which has none). */
  cr_assert_eq(st.quota, 1ull << 30);
  cr_assert_eq(st.max_clients, 77);
  cr_assert_eq(st.max_storages_per_client, 99);

  /* The half request completes; the waiter wakes on a key published now. */
  cr_assert_eq(send(h.fd, h.w.out + half, h.w.out_len - half, 0),
               (ssize_t)(h.w.out_len - half));
  h.w.out_off = h.w.out_len = 0;
  Tensord__Response *rep = tdt_raw_reply(&h, patience(HANG_MS));
  cr_assert_not_null(rep, "no Pong after the upgrade");
  cr_assert_eq(rep->seq, pseq);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_PONG);
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_eq(td_publish(b, "later", s3, NULL), 0, "%s", td_last_error(b));
  rep = tdt_raw_reply(&w, patience(HANG_MS));
  cr_assert_not_null(rep, "the waiter did not wake");
  cr_assert_eq(rep->seq, wseq);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_LOOKUP, "got %d",
               (int)rep->body_case);
  tensord__response__free_unpacked(rep, NULL);
  tdt_raw_close(&w);
  tdt_raw_close(&h);

  /* The handles made before serve on: the bytes, a lookup, a release. */
  td_storage *got;
  cr_assert_eq(td_lookup(b, "plain", TD_RDONLY, 0, &got, NULL), 0);
  cr_assert_eq(((unsigned char *)td_storage_data(got))[4095], 0x5a);
  td_view gv;
  td_storage *g2;
  cr_assert_eq(td_lookup(b, "viewed", 0, 0, &g2, &gv), 0);
  cr_assert_eq(gv.stride[0], 1);
  cr_assert_eq(td_storage_release(g2), 0);
  cr_assert_eq(td_storage_release(got), 0);
  cr_assert_eq(td_scope_close(b, token, NULL), 0);
  cr_assert_eq(td_unpublish(a, "plain"), 0);
  cr_assert_eq(td_unpublish(a, "viewed"), 0);
  cr_assert_eq(td_unpublish(b, "later"), 0);
  td_storage_release(sc);
  td_storage_release(ro);
  td_storage_release(s3);
  td_storage_release(s2);
  td_storage_release(s1);
  td_close(b);
  td_close(a);
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)), "segments left");
}

/* GET /metrics on the Unix socket at path; the whole reply in out. */
static void scrape(const char *path, char *out, size_t len) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0,
               "connect %s: %s", path, strerror(errno));
  const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  cr_assert_eq(send(fd, req, strlen(req), MSG_NOSIGNAL), (ssize_t)strlen(req));
  size_t n = 0;
  ssize_t k;
  while (n < len - 1 && (k = recv(fd, out + n, len - 1 - n, 0)) > 0)
    n += (size_t)k;
  out[n] = '\0';
  close(fd);
  cr_assert(strncmp(out, "HTTP/1.1 200", 12) == 0, "scrape said: %.80s", out);
}

/* The value of the sample named name (with its labels) in text. */
static uint64_t sample(const char *text, const char *name) {
  char want[160];
  snprintf(want, sizeof(want), "\n%s ", name);
  const char *at = strstr(text, want);
  cr_assert_not_null(at, "no sample %s", name);
  return strtoull(at + strlen(want), NULL, 10);
}

/* Waits for the watch's next event of type, skipping others. */
static void next_event(td_watch *w, td_event_type type, const char *key) {
  td_event ev;
  for (;;) {
    int err = td_watch_next(w, patience(HANG_MS), &ev);
    cr_assert_eq(err, 0, "watch: %s", td_strerror(err));
    if (ev.type == type && strcmp(ev.key, key) == 0)
      return;
  }
}

TDT_TEST(upgrade, carries_watchers_metrics_and_prefixes) {
  char msock[160];
  make_state_dir(); /* a directory teardown removes, for the endpoint */
  snprintf(msock, sizeof(msock), "%s/metrics.sock", state_dir);
  tdt_start(&d, (const char *const[]){"--metrics", msock, NULL});
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_watch *w;
  cr_assert_eq(td_watch_open(d.sock, "w/", &w), 0, "%s", td_last_error(NULL));
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "w/1", s, NULL), 0);
  next_event(w, TD_EVENT_PUBLISH, "w/1");
  char prefixes0[8][TD_PREFIX_MAX], prefixes1[8][TD_PREFIX_MAX];
  size_t np0, np1;
  cr_assert_eq(td_stat_prefixes(c, prefixes0, 8, &np0), 0);
  static char text0[65536], text1[65536];
  scrape(msock, text0, sizeof(text0));
  uint64_t publishes0 =
      sample(text0, "tensord_requests_total{type=\"publish\"}");
  uint64_t connects0 = sample(text0, "tensord_connections_total");
  cr_assert_geq(publishes0, 1);

  upgrade_cli(NULL);

  /* The watcher watches on, on the same connection. */
  cr_assert_eq(td_publish(c, "w/2", s, NULL), 0, "%s", td_last_error(c));
  next_event(w, TD_EVENT_PUBLISH, "w/2");
  /* The endpoint serves on at the same path, with counters that went on. */
  scrape(msock, text1, sizeof(text1));
  cr_assert_geq(sample(text1, "tensord_requests_total{type=\"publish\"}"),
                publishes0 + 1, "counters restarted:\n%s", text1);
  cr_assert_geq(sample(text1, "tensord_connections_total"), connects0);
  cr_assert_geq(sample(text1, "tensord_requests_total{type=\"upgrade\"}"), 1);
  cr_assert_eq(td_stat_prefixes(c, prefixes1, 8, &np1), 0);
  cr_assert_eq(np1, np0);
  for (size_t i = 0; i < np0 && i < 8; i++)
    cr_assert_str_eq(prefixes1[i], prefixes0[i]);

  td_watch_close(w);
  cr_assert_eq(td_unpublish(c, "w/1"), 0);
  cr_assert_eq(td_unpublish(c, "w/2"), 0);
  cr_assert_eq(td_storage_release(s), 0);
  td_close(c);
  tdt_stop(&d);
  cr_assert_neq(access(msock, F_OK), 0, "the endpoint's socket was left");
}

TDT_TEST(upgrade, works_with_a_socket_systemd_passed) {
  tdt_start_inherited(&d);
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  upgrade_cli(NULL);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "%s", td_last_error(c));
  cr_assert_eq(st.pid, d.pid);
  cr_assert_eq(td_storage_release(s), 0);
  td_close(c);
  /* tdt_stop checks that the inherited socket stays (it is systemd's). */
}

/* The number of fds process pid has open. */
static int fds_of(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  cr_assert_not_null(dir);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL)
    n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

/* The fds tensord has open once it has closed every connection but c's.
 * stat says when no other is left; libuv closes a connection's fd at the
 * end of the loop's turn that closed it, and the answer to a lookup that
 * times out comes from a timer, on a later turn (or after the closing
 * handles of the same one): once it is here, those fds are closed. No time
 * decides it; the bound only ends a hang. */
static int settled_fds(td_client *c) {
  td_stat st;
  for (int t = 0;; t += 10) {
    cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
    if (st.clients == 1 || t >= patience(HANG_MS))
      break;
    tdt_sleep_ms(10);
  }
  cr_assert_eq(st.clients, 1, "tensord still serves %llu other client(s)",
               (unsigned long long)st.clients - 1);
  td_storage *s = NULL;
  td_view v;
  cr_assert_eq(td_lookup(c, "settle/never", 0, 1, &s, &v), TD_ETIMEDOUT, "%s",
               td_last_error(c));
  return fds_of(d.pid);
}

TDT_TEST(upgrade, a_create_on_the_thread_pool_completes_across_it) {
  tdt_start(&d, NULL);
  remember(d.instance);
  tdt_raw r;
  tdt_raw_open(&r, &d);
  uint64_t seq = tdt_raw_create(&r, 64u << 20); /* past the loop's share */
  tdt_raw_flush(&r);
  upgrade_cli(NULL);
  int fd = -1;
  Tensord__Response *rep = tdt_raw_reply_fd(&r, patience(HANG_MS), &fd);
  cr_assert_not_null(rep, "the create was lost");
  cr_assert_eq(rep->seq, seq);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_STORAGE, "got %d",
               (int)rep->body_case);
  cr_assert_geq(fd, 0);
  tensord__response__free_unpacked(rep, NULL);
  close(fd);
  cr_assert_eq(tdt_storages(&d), 1);
  tdt_raw_close(&r);
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)));
}

/* A key's publication time comes over to the millisecond: not stamped anew,
 * not zero. */
static int key_time(const td_key_info *k, void *arg) {
  int64_t *out = arg;
  if (out[1] == 0) {
    out[0] = k->published_unix_ms;
    out[1] = 1;
  }
  return 0;
}

/* The publication time of key, as td_info gives it. */
static int64_t published(td_client *c, const char *key) {
  int64_t got[2] = {0, 0};
  cr_assert_eq(td_info(c, 0, key, NULL, key_time, got), 0, "info %s: %s", key,
               td_last_error(c));
  cr_assert_eq(got[1], 1, "info %s: no key", key);
  return got[0];
}

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Returns once the wall clock has passed ms: a time stamped from now on
 * differs from ms. (No verdict hangs on how long that takes.) */
static void after(int64_t ms) {
  while (wall_ms() <= ms)
    tdt_sleep_ms(1);
}

TDT_TEST(upgrade, keys_keep_their_publication_time) {
  tdt_start(&d, NULL);
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_storage_create(c, 4096, &t), 0);
  cr_assert_eq(td_publish(c, "first", s, NULL), 0);
  int64_t first = published(c, "first");
  after(first);
  cr_assert_eq(td_publish(c, "second", s, NULL), 0);
  cr_assert_eq(td_publish(c, "third", t, NULL), 0);
  int64_t second = published(c, "second"), third = published(c, "third");
  cr_assert_gt(first, 0);
  cr_assert_lt(first, second);
  after(third); /* an upgrade that stamped "now" would show */
  upgrade_cli(NULL);
  cr_assert_eq(published(c, "first"), first, "first: %lld, then %lld",
               (long long)first, (long long)published(c, "first"));
  cr_assert_eq(published(c, "second"), second, "second: %lld, then %lld",
               (long long)second, (long long)published(c, "second"));
  cr_assert_eq(published(c, "third"), third, "third: %lld, then %lld",
               (long long)third, (long long)published(c, "third"));
  cr_assert_eq(td_unpublish(c, "first"), 0);
  cr_assert_eq(td_unpublish(c, "second"), 0);
  cr_assert_eq(td_unpublish(c, "third"), 0);
  td_storage_release(t);
  td_storage_release(s);
  td_close(c);
}

/* ---- the recycling pool ---- */

#define POOL_UID_A 4311
#define POOL_UID_B 4312
#define MiB (1024u * 1024)

typedef struct pool_job {
  uid_t uid;
  int expect; /* every byte of its new 1 MiB storage (TD_UNINIT), or -1 */
  int fill;   /* then written to every byte before it goes */
} pool_job;

static int as_pool_job(void *arg) {
  const pool_job *j = arg;
  if (setgroups(0, NULL) < 0 || setgid(j->uid) < 0 || setuid(j->uid) < 0)
    return 2;
  td_client *c = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  td_create_opts o = {.nbytes = MiB, .flags = TD_UNINIT};
  td_storage *s = NULL;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &s), 0);
  const uint8_t *p = td_storage_data(s);
  for (size_t i = 0; j->expect >= 0 && i < MiB; i++)
    if (p[i] != (uint8_t)j->expect) {
      fprintf(stderr, "uid %u: byte %zu is 0x%02x, not 0x%02x\n",
              (unsigned)j->uid, i, p[i], j->expect);
      return 1;
    }
  memset(td_storage_data(s), j->fill, MiB);
  td_storage_release(s);
  td_close(c);
  return 0;
}

static void pool_job_run(pool_job j) {
  int st = tdt_wait(tdt_fork(as_pool_job, &j));
  cr_assert_eq(st, 0, "the job as uid %u exited %d", (unsigned)j.uid, st);
}

/* Waits until the pool holds n segments (a client's release, or its going,
 * lands when the daemon reads it); returns its stat. The bound only ends a
 * hang. */
static td_stat pool_holds(td_client *c, uint64_t n) {
  td_stat st;
  for (int t = 0;; t += 10) {
    cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
    if (st.pool_segments == n || t >= patience(HANG_MS))
      break;
    tdt_sleep_ms(10);
  }
  cr_assert_eq(st.pool_segments, n, "the pool holds %llu segment(s), not %llu",
               (unsigned long long)st.pool_segments, (unsigned long long)n);
  return st;
}

/* Pooled segments keep their owner across an upgrade: they serve that uid
 * again, and never another (root included). */
TDT_TEST(upgrade, pooled_segments_keep_their_uid) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  remember(d.instance);
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  td_client *c = tdt_connect(&d);
  pool_job_run((pool_job){.uid = POOL_UID_A, .expect = -1, .fill = 0xa1});
  pool_holds(c, 1);
  upgrade_cli(NULL);
  td_stat st = pool_holds(c, 1);
  uint64_t hits = st.pool_hits;
  /* Another uid asks for uninitialised bytes of that very size: fresh
   * pages, never A's. */
  pool_job_run((pool_job){.uid = POOL_UID_B, .expect = 0, .fill = 0xb2});
  st = pool_holds(c, 2);
  cr_assert_eq(st.pool_hits, hits, "uid %u was served a pooled segment",
               POOL_UID_B);
  /* Root is another uid too. */
  td_create_opts o = {.nbytes = MiB, .flags = TD_UNINIT};
  td_storage *s;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "%s", td_last_error(c));
  const uint8_t *p = td_storage_data(s);
  size_t foreign = 0;
  for (size_t i = 0; i < MiB; i++)
    foreign += p[i] != 0;
  cr_assert_eq(foreign, 0, "root was served %zu bytes of another uid's",
               foreign);
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.pool_hits, hits, "root was served a pooled segment");
  td_storage_release(s);
  /* A gets its own pages back. */
  pool_job_run((pool_job){.uid = POOL_UID_A, .expect = 0xa1, .fill = 0});
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.pool_hits, hits + 1,
               "uid %u's pooled segment did not serve it", POOL_UID_A);
  td_close(c);
}

/* ---- under load ---- */

#define LOADERS 64
#define WAITERS 8

typedef struct shared {
  atomic_int stop;
  atomic_long iters[LOADERS];
} shared;

static shared *sh;

static int loader(void *arg) {
  int i = (int)(intptr_t)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  char key[64];
  for (long n = 0; !atomic_load(&sh->stop); n++) {
    td_storage *s, *l, *t;
    snprintf(key, sizeof(key), "load/%d/%ld", i, n);
    CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
    ((char *)td_storage_data(s))[0] = (char)n;
    CHECK_ERR(c, td_publish(c, key, s, NULL), 0);
    CHECK_ERR(c, td_lookup(c, key, TD_RDONLY, 0, &l, NULL), 0);
    CHECK(((char *)td_storage_data(l))[0] == (char)n);
    CHECK_ERR(c, td_lookup(c, key, TD_TAKE, 0, &t, NULL), 0);
    CHECK_ERR(c, td_storage_release(t), 0);
    CHECK_ERR(c, td_storage_release(l), 0);
    CHECK_ERR(c, td_storage_release(s), 0);
    atomic_fetch_add(&sh->iters[i], 1);
  }
  td_close(c);
  return 0;
}

static int waiter(void *arg) {
  int i = (int)(intptr_t)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  char key[32];
  snprintf(key, sizeof(key), "wait/%d", i);
  td_storage *s;
  CHECK_ERR(c, td_lookup(c, key, TD_TAKE, -1, &s, NULL), 0);
  CHECK(((char *)td_storage_data(s))[0] == (char)i);
  CHECK_ERR(c, td_storage_release(s), 0);
  td_close(c);
  return 0;
}

static long min_iters(void) {
  long m = -1;
  for (int i = 0; i < LOADERS; i++) {
    long v = atomic_load(&sh->iters[i]);
    if (m < 0 || v < m)
      m = v;
  }
  return m;
}

static void wait_iters(long at_least) {
  for (int t = 0; t < patience(30000) && min_iters() < at_least; t += 10)
    tdt_sleep_ms(10);
  cr_assert_geq(min_iters(), at_least, "a loader is stuck");
}

static void under_load(int via_ctl) {
  tdt_start(&d, NULL);
  remember(d.instance);
  sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  cr_assert(sh != MAP_FAILED);
  memset(sh, 0, sizeof(*sh));
  pid_t pids[LOADERS + WAITERS];
  for (int i = 0; i < LOADERS; i++)
    pids[i] = tdt_fork(loader, (void *)(intptr_t)i);
  for (int i = 0; i < WAITERS; i++)
    pids[LOADERS + i] = tdt_fork(waiter, (void *)(intptr_t)i);
  wait_iters(2);
  if (via_ctl)
    upgrade_ctl();
  else
    upgrade_cli(NULL);
  long mark = min_iters();
  wait_iters(mark + 3); /* every loader served by the new daemon */
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < WAITERS; i++) {
    td_storage *s;
    char key[32];
    snprintf(key, sizeof(key), "wait/%d", i);
    cr_assert_eq(td_storage_create(c, 64, &s), 0);
    ((char *)td_storage_data(s))[0] = (char)i;
    cr_assert_eq(td_publish(c, key, s, NULL), 0, "%s", td_last_error(c));
    td_storage_release(s);
  }
  atomic_store(&sh->stop, 1);
  for (int i = 0; i < LOADERS + WAITERS; i++)
    cr_assert_eq(tdt_wait(pids[i]), 0, "client %d had errors", i);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)),
            "%d segment(s) left", tdt_segments(&d));
  cr_assert_eq(tdt_storages(&d), 0);
  munmap(sh, sizeof(*sh));
}

TDT_TEST(upgrade, under_load_with_tensord_upgrade, .timeout = 90) {
  under_load(0);
}

TDT_TEST(upgrade, under_load_with_tensorctl_upgrade, .timeout = 90) {
  under_load(1);
}

/* ---- version skew ---- */

TDT_TEST(upgrade, refuses_an_incompatible_handover_version) {
  tdt_start(&d, NULL);
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "k", s, NULL), 0);
  static char before[4096], after[4096];
  ls_json(before, sizeof(before));
  /* Measured with tensorctl's connection gone too, not while the daemon may
   * still hold it. */
  int fds = settled_fds(c);
  setenv("TENSORD_HANDOVER_VERSION", "999", 1);
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  unsetenv("TENSORD_HANDOVER_VERSION");
  cr_assert_neq(tdt_wait(pid), 0, "an incompatible tensord took over");
  cr_assert(tdt_log_has(&d, "handover version 2 offered, this tensord speaks "
                            "999..999"));
  cr_assert(alive(d.pid));
  cr_assert_eq(serving_pid(), d.pid);
  ls_json(after, sizeof(after));
  cr_assert_str_eq(after, before);
  /* The asker's connection and the channel are closed, and nothing else
   * was left open. (Under valgrind its own fds come and go.) */
  int now = settled_fds(c);
  if (getenv("TDT_DAEMON_WRAPPER") == NULL)
    cr_assert_eq(now, fds,
                 "the refused upgrade leaked fds in tensord: %d, then %d", fds,
                 now);
  td_storage *l;
  cr_assert_eq(td_lookup(c, "k", 0, 0, &l, NULL), 0);
  td_storage_release(l);
  cr_assert_eq(td_unpublish(c, "k"), 0);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(upgrade, tensorctl_upgrade_reports_a_successor_that_fails) {
  tdt_start(&d, NULL);
  remember(d.instance);
  char out[256];
  const char *argv[] = {TENSORCTL_BIN, "--socket",   d.sock, "upgrade",
                        "--binary",    "/bin/false", NULL};
  cr_assert_eq(run(argv, out, sizeof(out)), 1, "tensorctl said '%s'", out);
  cr_assert(tdt_log_has(&d, "exited with status 1 before the handover began"));
  cr_assert_eq(serving_pid(), d.pid);
  /* And a successor that refuses the handover version. */
  setenv("TENSORD_HANDOVER_VERSION", "999", 1);
  tdt_stop(&d);
  tdt_start(&d, NULL);
  unsetenv("TENSORD_HANDOVER_VERSION");
  remember(d.instance);
  const char *argv2[] = {TENSORCTL_BIN, "--socket", d.sock, "upgrade", NULL};
  cr_assert_eq(run(argv2, out, sizeof(out)), 1, "tensorctl said '%s'", out);
  cr_assert(tdt_log_has(&d, "this tensord speaks 999..999"));
  cr_assert_eq(serving_pid(), d.pid);
}

/* An option that ends the command line without its value is a usage error
 * that names it, not an argument the command "takes no" of. */
TDT_TEST(upgrade, tensorctl_options_without_their_value_are_usage_errors) {
  tdt_start(&d, NULL);
  remember(d.instance);
  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                    "upgrade", "--binary", NULL},
              &r);
  cr_expect_eq(r.status, 2, "tensorctl upgrade --binary: status %d", r.status);
  cr_expect(strstr(r.err, "tensorctl upgrade: --binary needs a PATH") != NULL,
            "%s", r.err);
  tdt_run_free(&r);
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "ls", "--socket", NULL}, &r);
  cr_expect_eq(r.status, 2, "tensorctl ls --socket: status %d", r.status);
  cr_expect(strstr(r.err, "tensorctl ls: --socket needs a PATH") != NULL, "%s",
            r.err);
  tdt_run_free(&r);
  cr_assert_eq(serving_pid(), d.pid, "tensorctl upgrade --binary upgraded");
}

TDT_TEST(upgrade, refuses_while_cuda_storages_are_live) {
#ifndef TDT_CUDA_DOUBLE
  cr_skip_test("built without the CUDA driver's test double");
#else
  setenv("TENSORD_CUDA_DRIVER", TDT_CUDA_DOUBLE, 1);
  tdt_start(&d, NULL);
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_create_opts o = {0};
  o.nbytes = 4096;
  o.device = TD_CUDA;
  td_storage *s;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "%s", td_last_error(c));
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  cr_assert_eq(tdt_wait(pid), 1, "a tensord took CUDA storages over");
  cr_assert(tdt_log_has(&d, "1 CUDA storages are live; upgrade them away"));
  cr_assert_eq(serving_pid(), d.pid);
  /* Once they are gone, the upgrade goes through. */
  cr_assert_eq(td_storage_release(s), 0);
  td_close(c);
  upgrade_cli(NULL);
  unsetenv("TENSORD_CUDA_DRIVER");
#endif
}

/* ---- SIGKILL at each phase ---- */

/* A key (durable with --state-dir) and an unnamed storage a client holds. */
typedef struct world {
  td_client *c;
  td_storage *keyed, *unnamed;
} world;

static void make_world(world *w) {
  w->c = tdt_connect(&d);
  cr_assert_eq(td_storage_create(w->c, 4096, &w->keyed), 0);
  memset(td_storage_data(w->keyed), 0x77, 4096);
  cr_assert_eq(td_publish(w->c, "durable", w->keyed, NULL), 0);
  cr_assert_eq(td_storage_create(w->c, 4096, &w->unnamed), 0);
}

/* A fresh client can create and look the key up on whatever serves now. */
static void check_serves(void) {
  td_client *c = tdt_connect(&d);
  td_storage *s, *l;
  cr_assert_eq(td_storage_create(c, 100, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_lookup(c, "durable", TD_RDONLY, 0, &l, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(((unsigned char *)td_storage_data(l))[1000], 0x77);
  td_storage_release(l);
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "durable"), 0);
  td_close(c);
}

static const char *const *state_args(void) {
  static const char *a[3];
  a[0] = "--state-dir";
  a[1] = state_dir;
  a[2] = NULL;
  return a;
}

/* The old daemon stops at phase and is killed there. */
static void kill_old_at(const char *phase, int new_serves_on) {
  make_state_dir();
  setenv("TENSORD_UPGRADE_STALL", phase, 1);
  tdt_start(&d, state_args());
  unsetenv("TENSORD_UPGRADE_STALL");
  remember(d.instance);
  uint64_t old_instance = d.instance;
  world w;
  make_world(&w);
  pid_t old = d.pid;
  pid_t pid = tdt_spawn(
      &d, (const char *const[]){"--upgrade", "--state-dir", state_dir, NULL});
  wait_stopped(old);
  kill(old, SIGKILL);
  tdt_wait(old);
  d.pid = pid;
  if (!serves_as(pid, patience(HANG_MS)))
    show_log();
  cr_assert(serves_as(pid, patience(0)),
            "tensord %d does not serve after the old "
            "one died at '%s'",
            (int)pid, phase);
  td_stat st;
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_stat_get(c, &st), 0);
  td_close(c);
  if (new_serves_on) {
    /* Committed: the new one serves everything, the client kept on. */
    cr_assert_eq(st.instance, old_instance);
    cr_assert_eq(td_storage_release(w.unnamed), 0, "%s", td_last_error(w.c));
  } else {
    /* The state-dir recovery path: a normal start, the key served again,
     * the unnamed segment swept. */
    d.instance = st.instance;
    remember(st.instance);
    cr_assert_neq(st.instance, old_instance);
    cr_assert_eq(tdt_segments_of(old_instance), 1,
                 "unnamed segments of the dead instance left");
    td_storage_release(w.unnamed);
  }
  td_storage_release(w.keyed);
  td_close(w.c);
  check_serves();
  cr_assert(alive(d.pid));
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)));
  cr_assert(none_of(old_instance));
}

/* The new daemon stops at phase and is killed there. */
static void kill_new_at(const char *phase) {
  make_state_dir();
  tdt_start(&d, state_args());
  remember(d.instance);
  world w;
  make_world(&w);
  static char before[4096], after[4096];
  ls_json(before, sizeof(before));
  setenv("TENSORD_UPGRADE_STALL", phase, 1);
  pid_t pid = tdt_spawn(
      &d, (const char *const[]){"--upgrade", "--state-dir", state_dir, NULL});
  unsetenv("TENSORD_UPGRADE_STALL");
  wait_stopped(pid);
  kill(pid, SIGKILL);
  tdt_wait(pid);
  if (strcmp(phase, "started") == 0) {
    /* After Started the new one was the daemon: the old one is gone, and
     * this is a crash, which a restart on the state dir recovers. */
    cr_assert_eq(tdt_wait(d.pid), 0);
    d.pid = 0;
    uint64_t old_instance = d.instance;
    tdt_restart(&d, state_args());
    remember(d.instance);
    td_storage_release(w.unnamed);
    td_storage_release(w.keyed);
    td_close(w.c);
    check_serves();
    cr_assert(none_of(old_instance));
    return;
  }
  /* Before Started the old one serves on, untouched. */
  cr_assert(serves_as(d.pid, patience(HANG_MS)),
            "the old tensord does not serve");
  ls_json(after, sizeof(after));
  cr_assert_str_eq(after, before);
  cr_assert_eq(td_storage_release(w.unnamed), 0, "%s", td_last_error(w.c));
  td_storage_release(w.keyed);
  td_close(w.c);
  check_serves();
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)));
}

TDT_TEST(upgrade, sigkill_old_when_quiesced) {
  kill_old_at("quiesced", 0);
}
TDT_TEST(upgrade, sigkill_old_when_sent) {
  kill_old_at("sent", 0);
}
TDT_TEST(upgrade, sigkill_old_when_committed) {
  kill_old_at("committed", 1);
}
TDT_TEST(upgrade, sigkill_new_when_received) {
  kill_new_at("received");
}
TDT_TEST(upgrade, sigkill_new_when_ready) {
  kill_new_at("ready");
}
TDT_TEST(upgrade, sigkill_new_when_started) {
  kill_new_at("started");
}

/* A SIGTERM that reaches the new daemon between Started and the moment its
 * handlers are in place stops it gracefully (exit 0, its storages freed),
 * as one at any other time would: not the signal's default action. */
TDT_TEST(upgrade, sigterm_right_after_started_stops_gracefully) {
  tdt_start(&d, NULL);
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  pid_t old = d.pid;
  setenv("TENSORD_UPGRADE_STALL", "started", 1);
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  unsetenv("TENSORD_UPGRADE_STALL");
  wait_stopped(pid);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  td_storage_release(s);
  td_close(c);
  d.pid = pid;
  kill(pid, SIGTERM); /* pending while it is stopped */
  kill(pid, SIGCONT);
  tdt_stopped(&d); /* exit 0, no segment, no socket left */
}

/* ---- --state-dir ---- */

TDT_TEST(upgrade, keys_survive_an_upgrade_then_a_restart) {
  make_state_dir();
  tdt_start(&d, state_args());
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  memset(td_storage_data(s), 0x77, 4096);
  cr_assert_eq(td_publish(c, "durable", s, NULL), 0);
  td_storage_release(s);
  upgrade_cli(state_args());
  /* A key published after the upgrade is journaled by the new daemon. */
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "after", s, NULL), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  kill(d.pid, SIGTERM);
  cr_assert_eq(tdt_wait(d.pid), 0);
  d.pid = 0;
  tdt_restart(&d, state_args());
  c = tdt_connect(&d);
  td_storage *l;
  cr_assert_eq(td_lookup(c, "after", 0, 0, &l, NULL), 0, "%s",
               td_last_error(c));
  td_storage_release(l);
  cr_assert_eq(td_unpublish(c, "after"), 0);
  td_close(c);
  check_serves();
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)));
}

/* ---- bad input ---- */

/* Asks d, on a raw connection r (opened here), for the handover as a new
 * tensord of this handover version would. Returns the handover channel d
 * answers with, which the caller drives in the new side's place; asserts. */
static int play_successor(tdt_raw *r) {
  tdt_raw_open(r, &d);
  Tensord__Upgrade m = TENSORD__UPGRADE__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.handover_version = 1;
  m.pid = getpid();
  q.body_case = TENSORD__REQUEST__BODY_UPGRADE;
  q.upgrade = &m;
  tdt_raw_queue(r, &q);
  tdt_raw_flush(r);
  int ch = -1;
  Tensord__Response *rep = tdt_raw_reply_fd(r, patience(HANG_MS), &ch);
  cr_assert_not_null(rep);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_UPGRADE);
  cr_assert_eq(rep->upgrade->old_pid, d.pid);
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_geq(ch, 0, "no handover channel");
  return ch;
}

TDT_TEST(upgrade, a_garbled_handover_packet_leaves_the_old_serving) {
  tdt_start(&d, NULL);
  remember(d.instance);
  tdt_raw r;
  int ch = play_successor(&r);
  char buf[4096];
  struct pollfd p = {ch, POLLIN, 0};
  cr_assert_eq(poll(&p, 1, patience(HANG_MS)), 1, "no Begin");
  cr_assert_gt(recv(ch, buf, sizeof(buf), 0), 0); /* Begin */
  memset(buf, 0xff, 64);
  cr_assert_eq(send(ch, buf, 64, 0), 64);
  /* The old side gives up (an Abort) and closes the channel. */
  ssize_t n = 1;
  for (int i = 0; i < 4 && n > 0; i++) {
    cr_assert_eq(poll(&p, 1, patience(HANG_MS)), 1);
    n = recv(ch, buf, sizeof(buf), 0);
  }
  cr_assert_eq(n, 0, "the old side went on");
  close(ch);
  tdt_raw_close(&r);
  cr_assert_eq(serving_pid(), d.pid);
  cr_assert(tdt_log_has(&d, "garbled"));
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 100, &s), 0);
  td_storage_release(s);
  td_close(c);
}

/* ---- a successor that stalls: --upgrade-timeout ---- */

/* The old daemon's --upgrade-timeout in a test that waits for it to pass:
 * base ms (longer under valgrind), short so that the test does not wait
 * long. */
static const char *deadline_arg(int base) {
  static char ms[16];
  snprintf(ms, sizeof(ms), "%d", patience(base));
  return ms;
}

/* Waits until pid, our child, stops (TENSORD_UPGRADE_STALL) or exits.
 * Returns 1 if it stopped, else 0 with its exit status in *status. */
static int stops_or_exits(pid_t pid, int *status) {
  int st;
  while (waitpid(pid, &st, WUNTRACED) < 0)
    cr_assert_eq(errno, EINTR, "waitpid %d: %s", (int)pid, strerror(errno));
  if (WIFSTOPPED(st))
    return 1;
  *status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return 0;
}

/* Whether the daemon on d's socket answers a Ping on a fresh connection
 * within the bound (which only ends a hang: a daemon stuck in a handover
 * never answers). */
static int answers_again(void) {
  tdt_raw r;
  tdt_raw_open(&r, &d);
  uint64_t seq = tdt_raw_ping(&r);
  tdt_raw_flush(&r);
  Tensord__Response *rep = tdt_raw_reply(&r, patience(HANG_MS));
  int ok = rep != NULL && rep->seq == seq &&
           rep->body_case == TENSORD__RESPONSE__BODY_PONG;
  if (rep != NULL)
    tensord__response__free_unpacked(rep, NULL);
  tdt_raw_close(&r);
  return ok;
}

/* A successor that takes the channel and says nothing: the old daemon gives
 * the handover up at the deadline, tells it why, and serves on as before,
 * with the fds it had. */
TDT_TEST(upgrade, a_silent_successor_is_given_up_at_the_deadline) {
  tdt_start(
      &d, (const char *const[]){"--upgrade-timeout", deadline_arg(300), NULL});
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "k", s, NULL), 0);
  static char before[4096], after[4096];
  ls_json(before, sizeof(before));
  int fds = settled_fds(c);
  tdt_raw r;
  int ch = play_successor(&r);
  /* Begin, then (we say nothing) an Abort naming the deadline, then the
   * channel's end. */
  static uint8_t buf[256 * 1024];
  char why[512] = "";
  int begun = 0;
  for (;;) {
    struct pollfd p = {ch, POLLIN, 0};
    cr_assert_eq(poll(&p, 1, patience(HANG_MS)), 1,
                 "the old daemon did not give the silent successor up");
    ssize_t n = recv(ch, buf, sizeof(buf), MSG_CMSG_CLOEXEC);
    if (n <= 0)
      break;
    Tensord__Handover__Packet *pk =
        tensord__handover__packet__unpack(NULL, (size_t)n, buf);
    cr_assert_not_null(pk);
    begun |= pk->body_case == TENSORD__HANDOVER__PACKET__BODY_BEGIN;
    if (pk->body_case == TENSORD__HANDOVER__PACKET__BODY_ABORT)
      snprintf(why, sizeof(why), "%s", pk->abort->message);
    tensord__handover__packet__free_unpacked(pk, NULL);
  }
  close(ch);
  tdt_raw_close(&r);
  cr_assert(begun, "no Begin");
  char want[128];
  snprintf(want, sizeof(want),
           "the new tensord sent no Accept within --upgrade-timeout %s ms",
           deadline_arg(300));
  cr_assert(strstr(why, want) != NULL, "Abort said '%s', not '%s'", why, want);
  cr_assert(tdt_log_has(&d, want));
  cr_assert(answers_again(), "the old daemon does not serve");
  ls_json(after, sizeof(after));
  cr_assert_str_eq(after, before);
  int now = settled_fds(c);
  if (getenv("TDT_DAEMON_WRAPPER") == NULL)
    cr_assert_eq(now, fds, "the given-up handover leaked fds: %d, then %d", fds,
                 now);
  td_storage *l;
  cr_assert_eq(td_lookup(c, "k", 0, 0, &l, NULL), 0, "%s", td_last_error(c));
  td_storage_release(l);
  cr_assert_eq(td_unpublish(c, "k"), 0);
  td_storage_release(s);
  td_close(c);
}

/* A tensord --upgrade that stops at phase (TENSORD_UPGRADE_STALL) while the
 * old daemon waits for it: the old one gives up at the deadline and serves
 * on, even after it sent Commit; the successor, let go on, learns that it
 * may not serve and exits 1. Exactly one daemon serves throughout. waited
 * lists what the old daemon may have waited for when it gave up (the first
 * is phase's; the second also if the successor reached phase only after
 * the deadline, on a machine too loaded for it). */
static void successor_stops_at(const char *phase, const char *const *waited) {
  const char *limit = deadline_arg(1000);
  make_state_dir();
  tdt_start(&d, (const char *const[]){"--upgrade-timeout", limit, "--state-dir",
                                      state_dir, NULL});
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "k", s, NULL), 0);
  static char before[4096], after[4096];
  ls_json(before, sizeof(before));
  int fds = settled_fds(c);
  setenv("TENSORD_UPGRADE_STALL", phase, 1);
  pid_t pid = tdt_spawn(
      &d, (const char *const[]){"--upgrade", "--state-dir", state_dir, NULL});
  unsetenv("TENSORD_UPGRADE_STALL");
  /* It stops at phase, or (the old daemon having given up even earlier)
   * has exited already: either way the old daemon serves again. */
  int status = -1;
  int stopped = stops_or_exits(pid, &status);
  cr_assert(answers_again(),
            "the old daemon did not give the successor up (stopped at '%s')",
            phase);
  cr_assert_eq(serving_pid(), d.pid);
  char want[160];
  snprintf(want, sizeof(want), "within --upgrade-timeout %s ms; serving on",
           limit);
  cr_assert(tdt_log_has(&d, want), "no '%s' in the log", want);
  if (stopped) {
    int named = 0;
    for (int i = 0; waited[i] != NULL && !named; i++) {
      snprintf(want, sizeof(want),
               "the new tensord sent no %s within --upgrade-timeout %s ms",
               waited[i], limit);
      named = tdt_log_has(&d, want);
      if (named && i > 0)
        cr_log_warn("the deadline passed before the successor reached '%s'",
                    phase);
    }
    cr_assert(named, "the old daemon gave up on neither %s nor %s", waited[0],
              waited[1] ? waited[1] : "-");
    /* Let go on, the successor finds the handover given up. */
    cr_assert_eq(kill(pid, SIGCONT), 0);
    status = tdt_wait(pid);
  } else {
    cr_log_warn("the deadline passed before the successor reached '%s'", phase);
  }
  cr_assert_eq(status, 1, "the successor exited %d, not 1", status);
  cr_assert(tdt_log_has(&d, "the old daemon gave the handover up"));
  cr_assert_eq(serving_pid(), d.pid);
  ls_json(after, sizeof(after));
  cr_assert_str_eq(after, before);
  int now = settled_fds(c);
  if (getenv("TDT_DAEMON_WRAPPER") == NULL)
    cr_assert_eq(now, fds, "the given-up handover leaked fds: %d, then %d", fds,
                 now);
  /* And it serves as before: the key, a new key (journaled), a create. */
  td_storage *l;
  cr_assert_eq(td_lookup(c, "k", 0, 0, &l, NULL), 0, "%s", td_last_error(c));
  td_storage_release(l);
  cr_assert_eq(td_publish(c, "k2", s, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(td_unpublish(c, "k2"), 0);
  cr_assert_eq(td_unpublish(c, "k"), 0);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(upgrade, a_successor_stopped_before_ready_is_given_up) {
  successor_stops_at("received", (const char *const[]){"Ready", NULL});
}

TDT_TEST(upgrade, a_successor_stopped_after_commit_is_given_up) {
  successor_stops_at("ready", (const char *const[]){"Started", "Ready", NULL});
}

/* The deadline never makes two daemons serve: a Started that came before
 * it is honoured after it. The old daemon stops right after Commit; the new
 * one says Started and serves; the old one, let go on well past its
 * deadline, exits as handed over. */
TDT_TEST(upgrade, a_started_sent_in_time_wins_past_the_deadline) {
  const char *limit = deadline_arg(1000);
  setenv("TENSORD_UPGRADE_STALL", "committed", 1);
  tdt_start(&d, (const char *const[]){"--upgrade-timeout", limit, NULL});
  unsetenv("TENSORD_UPGRADE_STALL");
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  pid_t old = d.pid;
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  /* The old daemon stops after Commit; unless, on a machine too loaded for
   * the deadline, it gave up before and serves on (the successor then
   * exits 1): no Commit to test. The bound only ends a hang. */
  int st = 0, stopped = 0, gone = 0;
  for (int t = 0; !stopped && !gone && t < patience(HANG_MS); t += 2) {
    stopped = waitpid(old, &st, WUNTRACED | WNOHANG) == old && WIFSTOPPED(st);
    gone = !stopped && waitpid(pid, &st, WNOHANG) == pid;
    if (!stopped && !gone)
      tdt_sleep_ms(2);
  }
  if (gone) {
    cr_assert_eq(serving_pid(), old);
    td_storage_release(s);
    td_close(c);
    cr_skip_test("the deadline of %s ms passed before Commit", limit);
  }
  cr_assert(stopped, "the old daemon neither stopped after Commit nor gave up");
  int64_t past = mono_ms() + atoi(limit);
  cr_assert(serves_as(pid, patience(HANG_MS)),
            "the new tensord does not serve");
  while (mono_ms() <= past)
    tdt_sleep_ms(1);
  cr_assert_eq(kill(old, SIGCONT), 0);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  d.pid = pid;
  cr_assert_eq(serving_pid(), pid);
  td_stat sst;
  cr_assert_eq(td_stat_get(c, &sst), 0, "%s", td_last_error(c));
  cr_assert_eq(sst.pid, pid);
  cr_assert_eq(td_storage_release(s), 0, "%s", td_last_error(c));
  td_close(c);
}

/* A waiting lookup whose deadline passes while the handover runs (the
 * new tensord stopped after taking everything, before Ready) is answered
 * once, by the new daemon, with ETIMEDOUT as soon as it serves. */
TDT_TEST(upgrade, a_waiter_whose_deadline_passes_during_it_times_out_once) {
  /* The successor stays stopped for a while: no deadline of the handover
   * may pass meanwhile. */
  tdt_start(&d, (const char *const[]){"--upgrade-timeout", "600000", NULL});
  remember(d.instance);
  tdt_raw w;
  tdt_raw_open(&w, &d);
  int wait_ms = patience(300);
  uint64_t seq = tdt_raw_lookup(&w, "never", 0, wait_ms);
  tdt_raw_flush(&w);
  td_client *c = tdt_connect(&d);
  waiters_are(c, 1);
  td_close(c);
  /* Its deadline is wait_ms after the daemon read it, before now. */
  int64_t deadline = mono_ms() + wait_ms;
  pid_t old = d.pid;
  setenv("TENSORD_UPGRADE_STALL", "received", 1);
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  unsetenv("TENSORD_UPGRADE_STALL");
  wait_stopped(pid);
  while (mono_ms() <= deadline)
    tdt_sleep_ms(1);
  cr_assert_null(tdt_raw_reply(&w, 0), "answered during the handover");
  cr_assert_eq(kill(pid, SIGCONT), 0);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  d.pid = pid;
  Tensord__Response *rep = tdt_raw_reply(&w, patience(HANG_MS));
  cr_assert_not_null(rep, "the waiter was lost");
  cr_assert_eq(rep->seq, seq);
  cr_assert_eq(tdt_raw_code(rep), TD_ETIMEDOUT, "got %d", tdt_raw_code(rep));
  tensord__response__free_unpacked(rep, NULL);
  /* Not answered twice: the next reply is a Ping's sent after it. */
  uint64_t pseq = tdt_raw_ping(&w);
  tdt_raw_flush(&w);
  rep = tdt_raw_reply(&w, patience(HANG_MS));
  cr_assert_not_null(rep, "no Pong");
  cr_assert_eq(rep->seq, pseq, "answered twice (seq %llu)",
               (unsigned long long)rep->seq);
  tensord__response__free_unpacked(rep, NULL);
  cr_assert(serves_as(pid, patience(HANG_MS)));
  tdt_raw_close(&w);
}

/* A CUDA create still on the thread pool when tensord --upgrade asks is
 * not among the storages the refusal counts; the handover must not carry
 * it once it completes (its GPU allocation dies with the old process).
 * This test plays the new tensord on the handover channel. */
TDT_TEST(upgrade, a_cuda_create_in_flight_is_not_handed_over) {
#ifndef TDT_CUDA_DOUBLE
  cr_skip_test("built without the CUDA driver's test double");
#else
  setenv("TENSORD_CUDA_DRIVER", TDT_CUDA_DOUBLE, 1);
  setenv("UV_THREADPOOL_SIZE", "1", 1);
  tdt_start(&d, NULL);
  unsetenv("UV_THREADPOOL_SIZE");
  remember(d.instance);
  tdt_raw a, b;
  tdt_raw_open(&a, &d);
  tdt_raw_open(&b, &d);
  Tensord__Create cm = TENSORD__CREATE__INIT;
  Tensord__Request cq = TENSORD__REQUEST__INIT;
  uint8_t uuid[16] = "tdcudadouble"; /* GPU 0 of the double */
  cm.nbytes = 4096;
  cm.device = TENSORD__DEVICE__DEVICE_CUDA;
  cm.device_uuid.data = uuid;
  cm.device_uuid.len = sizeof(uuid);
  cq.body_case = TENSORD__REQUEST__BODY_CREATE;
  cq.create = &cm;
  Tensord__Upgrade um = TENSORD__UPGRADE__INIT;
  Tensord__Request uq = TENSORD__REQUEST__INIT;
  um.handover_version = 1;
  um.pid = getpid();
  uq.body_case = TENSORD__REQUEST__BODY_UPGRADE;
  uq.upgrade = &um;
  /* One thread on the daemon's pool, busy zeroing a large create first:
   * the CUDA create waits behind it while the Upgrade is taken. */
  uint64_t bseq = tdt_raw_create(&a, 512u << 20);
  uint64_t cseq = tdt_raw_queue(&a, &cq);
  tdt_raw_flush(&a);
  int unread = 1;
  for (int t = 0; t < patience(HANG_MS) && unread > 0; t++) {
    cr_assert_eq(ioctl(a.fd, SIOCOUTQ, &unread), 0);
    if (unread > 0)
      tdt_sleep_ms(1);
  }
  cr_assert_eq(unread, 0, "the daemon does not read the creates");
  tdt_raw_queue(&b, &uq);
  tdt_raw_flush(&b);
  int ch = -1;
  Tensord__Response *rep = tdt_raw_reply_fd(&b, patience(HANG_MS), &ch);
  cr_assert_not_null(rep);
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_UPGRADE, "got %d",
               (int)rep->body_case);
  tensord__response__free_unpacked(rep, NULL);
  cr_assert_geq(ch, 0, "no handover channel");
  int carried = 0, aborted = 0;
  static uint8_t buf[256 * 1024];
  for (;;) {
    struct pollfd p = {ch, POLLIN, 0};
    cr_assert_eq(poll(&p, 1, patience(HANG_MS)), 1, "the old side is silent");
    ssize_t n = recv(ch, buf, sizeof(buf), MSG_CMSG_CLOEXEC);
    if (n <= 0)
      break;
    Tensord__Handover__Packet *pk =
        tensord__handover__packet__unpack(NULL, (size_t)n, buf);
    cr_assert_not_null(pk);
    int end = 0;
    if (pk->body_case == TENSORD__HANDOVER__PACKET__BODY_BEGIN) {
      Tensord__Handover__Accept ac = TENSORD__HANDOVER__ACCEPT__INIT;
      Tensord__Handover__Packet ap = TENSORD__HANDOVER__PACKET__INIT;
      ac.version = 1;
      ac.daemon_version = "test";
      ac.pid = getpid();
      ap.body_case = TENSORD__HANDOVER__PACKET__BODY_ACCEPT;
      ap.accept = &ac;
      uint8_t out[256];
      size_t len = tensord__handover__packet__pack(&ap, out);
      cr_assert_eq(send(ch, out, len, MSG_NOSIGNAL), (ssize_t)len);
    } else if (pk->body_case == TENSORD__HANDOVER__PACKET__BODY_STORAGES) {
      for (size_t i = 0; i < pk->storages->n_storages; i++)
        carried +=
            pk->storages->storages[i]->device == TENSORD__DEVICE__DEVICE_CUDA;
    } else if (pk->body_case == TENSORD__HANDOVER__PACKET__BODY_ABORT) {
      aborted = 1;
      cr_log_info("old side: %s", pk->abort->message);
    } else if (pk->body_case == TENSORD__HANDOVER__PACKET__BODY_END) {
      end = 1;
    }
    tensord__handover__packet__free_unpacked(pk, NULL);
    if (end)
      break;
  }
  close(ch); /* the old side, waiting for Ready, serves on */
  cr_assert_eq(carried, 0, "the handover carried %d CUDA storage(s)", carried);
  cr_assert(aborted, "the old side did not say why it gave up");
  cr_assert(tdt_log_has(&d, "CUDA storages are live"));
  for (int i = 0; i < 2; i++) {
    rep = tdt_raw_reply(&a, patience(HANG_MS));
    cr_assert_not_null(rep, "a create was lost");
    cr_assert(rep->seq == bseq || rep->seq == cseq);
    cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_STORAGE, "got %d",
                 (int)rep->body_case);
    tensord__response__free_unpacked(rep, NULL);
  }
  tdt_raw_close(&b);
  tdt_raw_close(&a);
  cr_assert_eq(serving_pid(), d.pid);
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)));
  unsetenv("TENSORD_CUDA_DRIVER");
#endif
}

/* What the connection that asked for tensorctl upgrade does until it is
 * answered is refused: that connection is not handed over, so a storage or
 * a waiter it took now would break the handover (or be lost). */
TDT_TEST(upgrade, the_asker_takes_nothing_until_it_is_answered) {
  tdt_start(&d, NULL);
  remember(d.instance);
  pid_t old = d.pid;
  tdt_raw r;
  tdt_raw_open(&r, &d);
  Tensord__Upgrade um = TENSORD__UPGRADE__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  um.spawn = 1;
  q.body_case = TENSORD__REQUEST__BODY_UPGRADE;
  q.upgrade = &um;
  /* In one write: the daemon reads all three before the new one asks. */
  uint64_t useq = tdt_raw_queue(&r, &q);
  uint64_t cseq = tdt_raw_create(&r, 4096);
  uint64_t lseq = tdt_raw_lookup(&r, "never", 0, -1);
  tdt_raw_flush(&r);
  int ccode = 1, lcode = 1, ucode = 1;
  int32_t new_pid = 0;
  while (ucode == 1) {
    Tensord__Response *rep = tdt_raw_reply(&r, patience(HANG_MS));
    cr_assert_not_null(rep, "no reply to the Upgrade (eof %d)", r.eof);
    if (rep->seq == cseq)
      ccode = tdt_raw_code(rep);
    else if (rep->seq == lseq)
      lcode = tdt_raw_code(rep);
    else if (rep->seq == useq) {
      ucode = tdt_raw_code(rep);
      if (rep->body_case == TENSORD__RESPONSE__BODY_UPGRADE)
        new_pid = rep->upgrade->new_pid;
      else
        cr_log_error("upgrade: %s", rep->error->message);
    }
    tensord__response__free_unpacked(rep, NULL);
  }
  cr_assert_eq(ccode, TD_EBUSY, "the asker's Create got %d", ccode);
  cr_assert_eq(lcode, TD_EBUSY, "the asker's Lookup got %d", lcode);
  cr_assert_eq(ucode, 0, "the upgrade failed (%d)", ucode);
  cr_assert_gt(new_pid, 0);
  tdt_raw_close(&r);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  d.pid = new_pid;
  cr_assert(serves_as(new_pid, patience(HANG_MS)), "tensord %d does not serve",
            (int)new_pid);
  cr_assert_eq(tdt_storages(&d), 0);
  td_stat st;
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_stat_get(c, &st), 0, "%s", td_last_error(c));
  cr_assert_eq(st.waiters, 0);
  td_close(c);
}

TDT_TEST(upgrade, refuses_another_uid) {
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  remember(d.instance);
  if (geteuid() != 0) {
    tdt_raw r;
    tdt_raw_open(&r, &d);
    tdt_raw_close(&r);
    cr_skip_test("needs root to run a client as another uid");
  }
  chmod(d.dir, 0755);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    if (setgid(65534) < 0 || setuid(65534) < 0)
      _exit(3);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d.sock);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
      _exit(4);
    tdt_raw r = {.fd = fd};
    td__wire_init(&r.w, fd);
    Tensord__Hello h = TENSORD__HELLO__INIT;
    Tensord__Request q = TENSORD__REQUEST__INIT;
    h.version = TD_PROTOCOL_VERSION;
    q.body_case = TENSORD__REQUEST__BODY_HELLO;
    q.hello = &h;
    tdt_raw_queue(&r, &q);
    Tensord__Upgrade m = TENSORD__UPGRADE__INIT;
    m.spawn = 1;
    q.body_case = TENSORD__REQUEST__BODY_UPGRADE;
    q.upgrade = &m;
    tdt_raw_queue(&r, &q);
    tdt_raw_flush(&r);
    Tensord__Response *rep = tdt_raw_reply(&r, patience(HANG_MS));
    if (rep == NULL)
      _exit(5);
    rep = tdt_raw_reply(&r, patience(HANG_MS));
    if (rep == NULL || tdt_raw_code(rep) != TD_EPERM ||
        strstr(rep->error->message, "uid 65534") == NULL)
      _exit(6);
    _exit(0);
  }
  cr_assert_eq(tdt_wait(pid), 0, "no EPERM naming the uid");
  cr_assert_eq(serving_pid(), d.pid);
}

/* ---- systemd ---- */

TDT_TEST(upgrade, tells_systemd_the_new_mainpid) {
  tdt_start(&d, NULL);
  remember(d.instance);
  /* The old daemon's NOTIFY_SOCKET is the harness's, which is done with
   * it: a socket of ours takes its path, and the new daemon's. */
  char path[100];
  snprintf(path, sizeof(path), "%.60s/notify.sock", d.dir);
  unlink(path);
  int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  cr_assert_eq(bind(nfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  pid_t old = d.pid;
  fflush(NULL);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    int log = open(d.log, O_WRONLY | O_APPEND | O_CLOEXEC);
    dup2(log, STDERR_FILENO);
    setenv("NOTIFY_SOCKET", path, 1);
    execl(TENSORD_BIN, TENSORD_BIN, "--socket", d.sock, "--upgrade", NULL);
    _exit(127);
  }
  cr_assert_eq(tdt_wait(old), 0);
  d.pid = pid;
  /* The old daemon names its successor before it exits (so that systemd
   * never sees the main process gone); the new one says it is ready. */
  char want[64];
  snprintf(want, sizeof(want), "MAINPID=%d", (int)pid);
  int from_old = 0, ready = 0;
  for (int i = 0; i < 2; i++) {
    struct pollfd p = {nfd, POLLIN, 0};
    cr_assert_eq(poll(&p, 1, patience(HANG_MS)), 1, "notification %d missing",
                 i + 1);
    char buf[256] = "";
    cr_assert_gt(recv(nfd, buf, sizeof(buf) - 1, 0), 0);
    cr_assert(strstr(buf, want) != NULL, "notify said '%s'", buf);
    if (strstr(buf, "READY=1") != NULL)
      ready++;
    else
      from_old++;
  }
  close(nfd);
  unlink(path);
  cr_assert_eq(ready, 1);
  cr_assert_eq(from_old, 1);
  cr_assert(serves_as(pid, patience(HANG_MS)));
}

/* ---- channels ---- */

typedef struct flow {
  atomic_int stop;       /* the producer stops and leaves */
  atomic_int slots_only; /* the producer sends no storage of its own ... */
  atomic_int slots_ack;  /* ... from now on */
  atomic_int held; /* the holder has its loans */
  atomic_int die;  /* the holder exits, its loans with it */
  atomic_long sent_slots, sent_plain, got_slots, got_plain;
} flow;

static flow *fl;

static td_view flow_view(void) {
  td_view v;
  int64_t shape[1] = {4096};
  td_view_contiguous(TD_UINT8, 1, shape, &v);
  return v;
}

/* Sends 1, 2, 3, ... on "flow": in slots, and every fourth in a storage of
 * its own (through the daemon) unless told to send slots only, until told to
 * stop. */
static int flow_producer(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, "flow", TD_CHAN_SEND, 5000, &ch), 0);
  td_view v = flow_view();
  for (uint64_t n = 1; !atomic_load(&fl->stop); n++) {
    td_storage *s;
    int only = atomic_load(&fl->slots_only);
    atomic_store(&fl->slots_ack, only);
    int plain = n % 4 == 0 && !only;
    if (plain)
      CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
    else
      CHECK_ERR(c, td_chan_loan(ch, patience(HANG_MS), &s), 0);
    uint64_t *p = td_storage_data(s);
    p[0] = n;
    p[1] = (uint64_t)plain;
    CHECK_ERR(c, td_chan_send(ch, s, &v, patience(HANG_MS)), 0);
    atomic_fetch_add(plain ? &fl->sent_plain : &fl->sent_slots, 1);
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* Receives from "flow", each number the next, until every sender left. */
static int flow_consumer(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, "flow", TD_CHAN_RECV, 5000, &ch), 0);
  uint64_t last = 0;
  for (;;) {
    td_storage *s;
    td_view v;
    int err = td_chan_recv(ch, patience(HANG_MS), &s, &v);
    if (err == TD_EPIPE)
      break;
    CHECK_ERR(c, err, 0);
    const uint64_t *p = td_storage_data(s);
    if (p[0] != last + 1)
      fprintf(stderr, "flow: got %llu after %llu\n", (unsigned long long)p[0],
              (unsigned long long)last);
    CHECK(p[0] == last + 1);
    last = p[0];
    atomic_fetch_add(p[1] ? &fl->got_plain : &fl->got_slots, 1);
    CHECK_ERR(c, td_storage_release(s), 0);
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

/* Loans two slots of "flow" and keeps them until told to die, which it
 * does without giving them back. */
static int flow_holder(void *arg) {
  (void)arg;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, "flow", TD_CHAN_SEND, 5000, &ch), 0);
  td_storage *s[2];
  for (int i = 0; i < 2; i++) {
    CHECK_ERR(c, td_chan_loan(ch, 5000, &s[i]), 0);
    memset(td_storage_data(s[i]), 0x33, 4096);
  }
  atomic_store(&fl->held, 1);
  while (!atomic_load(&fl->die))
    tdt_sleep_ms(5);
  _exit(0);
}

/* A channel as td_chan_list shows it, with its ends. */
typedef struct chan_seen {
  int found;
  td_chan_info info;
  td_chan_end_info ends[16];
  uint64_t slot_ids[16];
  char names[16][64];
} chan_seen;

static int see_chan(const td_chan_info *info, void *arg) {
  chan_seen *cs = arg;
  if (strcmp(info->name, "flow") != 0 && strcmp(info->name, "still") != 0 &&
      strcmp(info->name, "kept") != 0)
    return 0;
  cs->found++;
  cs->info = *info;
  cs->info.name = NULL;
  cs->info.ends = NULL;
  cs->info.slot_ids = NULL;
  for (size_t i = 0; i < info->nends && i < 16; i++) {
    cs->ends[i] = info->ends[i];
    snprintf(cs->names[i], sizeof(cs->names[i]), "%s", info->ends[i].name);
    cs->ends[i].name = NULL;
  }
  for (size_t i = 0; i < info->nslot_ids && i < 16; i++)
    cs->slot_ids[i] = info->slot_ids[i];
  return 0;
}

static chan_seen list_chan(td_client *c) {
  chan_seen cs;
  memset(&cs, 0, sizeof(cs));
  cr_assert_eq(td_chan_list(c, see_chan, &cs), 0, "%s", td_last_error(c));
  cr_assert_eq(cs.found, 1, "%d channel(s) listed", cs.found);
  return cs;
}

static int count_chan(const td_chan_info *info, void *arg) {
  (void)info;
  (*(size_t *)arg)++;
  return 0;
}

/* The channels tensord has. */
static size_t chan_count(td_client *c) {
  size_t n = 0;
  cr_assert_eq(td_chan_list(c, count_chan, &n), 0, "%s", td_last_error(c));
  return n;
}

/* Waits until tensord has chans channels and storages storages: a close on
 * another connection (or a process's exit) lands in its own time. */
static void wait_counts(td_client *c, size_t chans, uint64_t storages) {
  for (int t = 0; t < patience(HANG_MS); t += 5) {
    if (chan_count(c) == chans && tdt_storages(&d) == storages)
      return;
    tdt_sleep_ms(5);
  }
  cr_assert_eq(chan_count(c), chans, "%zu channel(s)", chan_count(c));
  cr_assert_eq(tdt_storages(&d), storages, "%llu storage(s)",
               (unsigned long long)tdt_storages(&d));
}

/* What must not change about a channel that flows: what it is, its slots,
 * and its ends (ids, processes, sides). */
static void same_chan(const chan_seen *a, const chan_seen *b) {
  cr_assert_eq(b->info.id, a->info.id, "the channel's id changed");
  cr_assert_eq(b->info.capacity, a->info.capacity);
  cr_assert_eq(b->info.slots, a->info.slots);
  cr_assert_eq(b->info.slot_bytes, a->info.slot_bytes);
  cr_assert_eq(b->info.mode, a->info.mode);
  cr_assert_eq(b->info.owner_uid, a->info.owner_uid);
  cr_assert_eq(b->info.owner_pid, a->info.owner_pid);
  cr_assert_eq(b->info.senders, a->info.senders);
  cr_assert_eq(b->info.receivers, a->info.receivers);
  cr_assert_eq(b->info.corrupt, a->info.corrupt);
  cr_assert_eq(b->info.nslot_ids, a->info.nslot_ids);
  for (size_t i = 0; i < a->info.nslot_ids && i < 16; i++)
    cr_assert_eq(b->slot_ids[i], a->slot_ids[i], "slot %zu", i);
  cr_assert_eq(b->info.nends, a->info.nends, "%zu ends, then %zu",
               a->info.nends, b->info.nends);
  for (size_t i = 0; i < a->info.nends && i < 16; i++) {
    cr_assert_eq(b->ends[i].end, a->ends[i].end, "end %zu", i);
    cr_assert_eq(b->ends[i].pid, a->ends[i].pid);
    cr_assert_eq(b->ends[i].uid, a->ends[i].uid);
    cr_assert_eq(b->ends[i].flags, a->ends[i].flags);
    cr_assert_eq(b->ends[i].left, a->ends[i].left);
    cr_assert_str_eq(b->names[i], a->names[i]);
  }
}

static void wait_flow(long slots, long plain) {
  for (int t = 0;
       t < patience(HANG_MS) && (atomic_load(&fl->got_slots) < slots ||
                                 atomic_load(&fl->got_plain) < plain);
       t += 5)
    tdt_sleep_ms(5);
  cr_assert_geq(atomic_load(&fl->got_slots), slots, "slots stopped flowing");
  cr_assert_geq(atomic_load(&fl->got_plain), plain,
                "storages stopped flowing through the daemon");
}

/* A producer and a consumer hand slots over (and storages through the
 * daemon) throughout an upgrade: slot handoffs go on while the old daemon
 * stands still in the middle of it, a storage sent then waits for the new
 * one; nothing is lost or doubled, the new daemon lists the same channel
 * with the same ends, takes a new end, gives back the slots of a process
 * that dies after it, and frees every slot with the channel's last end. */
TDT_TEST(upgrade, channels_flow_on_across_it, .timeout = 90) {
  setenv("TENSORD_UPGRADE_STALL", "quiesced", 1);
  tdt_start(&d, NULL);
  unsetenv("TENSORD_UPGRADE_STALL");
  remember(d.instance);
  fl = mmap(NULL, sizeof(*fl), PROT_READ | PROT_WRITE,
            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  cr_assert(fl != MAP_FAILED);
  memset(fl, 0, sizeof(*fl));
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 16, .slots = 6, .slot_bytes = 4096,
                    .flags = TD_CHAN_RECV};
  td_chan *mine;
  cr_assert_eq(td_chan_create(c, "flow", &o, &mine), 0, "%s",
               td_last_error(c));
  pid_t holder = tdt_fork(flow_holder, NULL);
  for (int t = 0; t < patience(HANG_MS) && !atomic_load(&fl->held); t += 5)
    tdt_sleep_ms(5);
  cr_assert(atomic_load(&fl->held), "the holder has no loans");
  pid_t cons = tdt_fork(flow_consumer, NULL);
  pid_t prod = tdt_fork(flow_producer, NULL);
  wait_flow(20, 5);
  chan_seen before = list_chan(c);
  cr_assert_eq(before.info.nends, 4);

  /* Slots only, every storage sent so far received: nothing in the ring
   * needs the daemon. */
  atomic_store(&fl->slots_only, 1);
  for (int t = 0; t < patience(HANG_MS) &&
                  (!atomic_load(&fl->slots_ack) ||
                   atomic_load(&fl->got_plain) < atomic_load(&fl->sent_plain));
       t += 5)
    tdt_sleep_ms(5);
  cr_assert(atomic_load(&fl->slots_ack), "the producer sends storages still");
  pid_t old = d.pid;
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  wait_stopped(old); /* quiesced: it serves no request */
  long slots = atomic_load(&fl->got_slots);
  wait_flow(slots + 100, 0);
  /* A storage sent now waits for whichever daemon serves next. */
  long plain = atomic_load(&fl->got_plain);
  atomic_store(&fl->slots_only, 0);
  tdt_sleep_ms(50);
  cr_assert_eq(atomic_load(&fl->got_plain), plain);
  kill(old, SIGCONT);
  cr_assert_eq(tdt_wait(old), 0, "the old tensord did not exit 0");
  d.pid = pid;
  cr_assert(serves_as(pid, patience(HANG_MS)),
            "the new tensord %d does not serve", (int)pid);
  slots = atomic_load(&fl->got_slots);
  wait_flow(slots + 40, plain + 10);
  chan_seen after = list_chan(c);
  same_chan(&before, &after);
  cr_assert(tdt_log_has(&d, "1 channel(s) handed over"));

  /* A new end opens it on the new daemon, with the next id. */
  td_client *c2 = tdt_connect(&d);
  td_chan *late;
  cr_assert_eq(td_chan_open(c2, "flow", TD_CHAN_RECV, 0, &late), 0, "%s",
               td_last_error(c2));
  chan_seen with = list_chan(c);
  cr_assert_eq(with.info.nends, 5);
  uint32_t top = 0;
  for (size_t i = 0; i < 4; i++)
    top = before.ends[i].end > top ? before.ends[i].end : top;
  int newest = 0;
  for (size_t i = 0; i < with.info.nends; i++)
    newest |= with.ends[i].end == top + 1;
  cr_assert(newest, "the new end's id is not %u", top + 1);
  td_chan_close(late);
  td_close(c2);

  /* The producer leaves; the holder's two loans are all that is out. */
  atomic_store(&fl->stop, 1);
  cr_assert_eq(tdt_wait(prod), 0, "the producer had errors");
  td_chan_info info;
  for (int t = 0; t < patience(HANG_MS); t += 5) {
    td_chan_stat(mine, &info);
    if (info.depth == 0 && info.slots_free == 4)
      break;
    tdt_sleep_ms(5);
  }
  cr_assert_eq(info.slots_loaned, 2, "%u slot(s) on loan", info.slots_loaned);
  cr_assert_eq(info.slots_free, 4);
  /* It dies (its connection the old daemon's): the new one gives them
   * back, and the consumer, its last sender gone, sees EPIPE. */
  atomic_store(&fl->die, 1);
  cr_assert_eq(tdt_wait(holder), 0);
  for (int t = 0; t < patience(HANG_MS); t += 5) {
    td_chan_stat(mine, &info);
    if (info.slots_free == 6)
      break;
    tdt_sleep_ms(5);
  }
  cr_assert_eq(info.slots_free, 6, "the dead holder's slots did not come back");
  cr_assert_eq(tdt_wait(cons), 0, "the consumer had errors");
  cr_assert_eq(atomic_load(&fl->got_slots), atomic_load(&fl->sent_slots));
  cr_assert_eq(atomic_load(&fl->got_plain), atomic_load(&fl->sent_plain));

  /* The channel goes with its last end, and its slots with it. */
  wait_counts(c, 1, 6);
  td_chan_close(mine);
  wait_counts(c, 0, 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)),
            "%d segment(s) left", tdt_segments(&d));
  munmap(fl, sizeof(*fl));
}

/* A channel at rest goes over exactly: depth, storages in flight (one of
 * each mode), a slot held by an end that left, counts, and the listing of
 * every storage with the channel among its holders. */
TDT_TEST(upgrade, a_channel_at_rest_goes_over_exactly) {
  tdt_start(&d, NULL);
  remember(d.instance);
  td_client *c = tdt_connect(&d), *c2 = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8, .slots = 3, .slot_bytes = 4096};
  td_chan *ch, *other;
  cr_assert_eq(td_chan_create(c, "still", &o, &ch), 0, "%s", td_last_error(c));
  cr_assert_eq(td_chan_open(c2, "still", 0, 0, &other), 0, "%s",
               td_last_error(c2));
  td_storage *kept;
  cr_assert_eq(td_chan_loan(other, 0, &kept), 0, "%s", td_last_error(c2));
  memset(td_storage_data(kept), 'K', 4096);
  td_chan_close(other); /* left, with a slot out */
  td_view v = flow_view();
  td_storage *s, *rw, *pub, *ro;
  cr_assert_eq(td_chan_loan(ch, 0, &s), 0, "%s", td_last_error(c));
  memset(td_storage_data(s), 'A', 4096);
  cr_assert_eq(td_chan_send(ch, s, &v, 0), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &rw), 0);
  memset(td_storage_data(rw), 'B', 4096);
  cr_assert_eq(td_chan_send(ch, rw, &v, 0), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c2, 4096, &pub), 0);
  memset(td_storage_data(pub), 'C', 4096);
  cr_assert_eq(td_publish(c2, "still/c", pub, NULL), 0);
  cr_assert_eq(td_lookup(c, "still/c", TD_RDONLY, 0, &ro, NULL), 0);
  cr_assert_eq(td_chan_send(ch, ro, &v, 0), 0, "%s", td_last_error(c));
  cr_assert_eq(td_unpublish(c2, "still/c"), 0);
  td_storage_release(pub);

  chan_seen before = list_chan(c);
  cr_assert_eq(before.info.depth, 3);
  cr_assert_eq(before.info.in_flight, 2);
  static char ls0[16384], ls1[16384];
  ls_json(ls0, sizeof(ls0));
  upgrade_cli(NULL);
  chan_seen after = list_chan(c);
  ls_json(ls1, sizeof(ls1));
  cr_assert_str_eq(ls1, ls0, "ls before:\n%s\nafter:\n%s", ls0, ls1);
  same_chan(&before, &after);
  cr_assert_eq(memcmp(&after.info, &before.info, sizeof(before.info)), 0,
               "the listing differs: depth %u/%u, in flight %llu/%llu, "
               "free %u/%u",
               before.info.depth, after.info.depth,
               (unsigned long long)before.info.in_flight,
               (unsigned long long)after.info.in_flight, before.info.slots_free,
               after.info.slots_free);
  for (size_t i = 0; i < before.info.nends; i++) {
    cr_assert_eq(after.ends[i].loaned, before.ends[i].loaned);
    cr_assert_eq(after.ends[i].held, before.ends[i].held);
  }

  /* What was in the ring comes out in order, from the new daemon. */
  const char want[3] = {'A', 'B', 'C'};
  for (int i = 0; i < 3; i++) {
    td_storage *g;
    td_view gv;
    cr_assert_eq(td_chan_recv(ch, 0, &g, &gv), 0, "%s", td_last_error(c));
    cr_assert_eq(((const char *)td_storage_data(g))[4095], want[i]);
    cr_assert_eq(td_storage_is_readonly(g), i == 2, "entry %d", i);
    td_storage_release(g);
  }
  cr_assert_eq(((const char *)td_storage_data(kept))[0], 'K');
  td_storage_release(kept); /* the left end's last handle: it goes */
  td_chan_close(ch);
  wait_counts(c, 0, 0);
  td_close(c2);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, patience(HANG_MS)));
}

/* A successor that speaks only handover version 1 (one from before
 * channels) would lose them: with one open, the upgrade fails and nothing
 * changes; with none, it goes through as before. */
TDT_TEST(upgrade, a_successor_without_channels_is_refused_while_one_is_open) {
  tdt_start(&d, NULL);
  remember(d.instance);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 4, .slots = 2, .slot_bytes = 4096};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "kept", &o, &ch), 0, "%s", td_last_error(c));
  td_storage *s;
  td_view v = flow_view();
  cr_assert_eq(td_chan_loan(ch, 0, &s), 0);
  memset(td_storage_data(s), 'k', 4096);
  cr_assert_eq(td_chan_send(ch, s, &v, 0), 0);
  static char before[8192], after[8192];
  ls_json(before, sizeof(before));
  chan_seen b = list_chan(c);
  setenv("TENSORD_HANDOVER_VERSION", "1", 1);
  pid_t pid = tdt_spawn(&d, (const char *const[]){"--upgrade", NULL});
  unsetenv("TENSORD_HANDOVER_VERSION");
  cr_assert_eq(tdt_wait(pid), 1, "a successor without channels took over");
  cr_assert(tdt_log_has(&d, "speaks handover version 1, which does not "
                            "carry channels, and 1 channel(s) are open"));
  cr_assert(alive(d.pid));
  cr_assert_eq(serving_pid(), d.pid);
  ls_json(after, sizeof(after));
  cr_assert_str_eq(after, before);
  chan_seen a = list_chan(c);
  same_chan(&b, &a);
  cr_assert_eq(a.info.depth, 1);
  td_storage *g;
  cr_assert_eq(td_chan_recv(ch, 0, &g, &v), 0, "%s", td_last_error(c));
  cr_assert_eq(((const char *)td_storage_data(g))[9], 'k');
  td_storage_release(g);
  td_chan_close(ch);
  wait_counts(c, 0, 0);
  /* No channel open: that successor takes over. */
  setenv("TENSORD_HANDOVER_VERSION", "1", 1);
  upgrade_cli(NULL);
  unsetenv("TENSORD_HANDOVER_VERSION");
  cr_assert_eq(chan_count(c), 0);
  td_close(c);
}

/* test_watch.c: the event stream (td_watch, tensorctl watch) against a real
 * tensord: each type in order with its fields, the prefix filter, JSON
 * lines, watchers that never read or leave mid-stream, many watchers, bad
 * input; and client names in ls/info, the daemon's memory in stat. */
#include "cli.h"
#include "harness.h"
#include "raw.h"

#include <criterion/criterion.h>
#include <ctype.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>

static tdt_daemon d;

static void setup(void) {
  /* A small quota, for a refusal; a short io timeout, which a watcher that
   * never reads must not trip. */
  static const char *const args[] = {"--quota", "64K", "--io-timeout", "300",
                                     NULL};
  tdt_start(&d, args);
}

TestSuite(watch, .init = setup, .fini = tdt_cleanup, .timeout = 60);

/* ---- helpers ---- */

static td_watch *watch_open(const char *prefix) {
  td_watch *w = NULL;
  int err = td_watch_open(d.sock, prefix, &w);
  cr_assert_eq(err, 0, "td_watch_open: %s", td_last_error(NULL));
  return w;
}

/* The next event of w caused by pid (others are skipped); asserts one
 * comes (the bound is generous: no timing is asserted). */
static void next_of(td_watch *w, pid_t pid, td_event *ev) {
  for (;;) {
    int err = td_watch_next(w, 10000, ev);
    cr_assert_eq(err, 0, "td_watch_next: %s: %s", td_err_name(err),
                 td_last_error(NULL));
    if (ev->pid == pid)
      return;
  }
}

static void expect_type(const td_event *ev, td_event_type type) {
  cr_assert_eq(ev->type, type, "event %s where %s was due (key '%s', %s)",
               td_event_type_name(ev->type), td_event_type_name(type), ev->key,
               ev->message);
  cr_assert_gt(ev->unix_ms, 0);
}

typedef struct pipeline_arg {
  const char *sock;
  int go; /* read end: the child starts at one byte */
} pipeline_arg;

/* A pipeline step named "loader": a refused lookup, a refused create over
 * the quota, then create, publish, take, and the releases that free the
 * storage. */
static int pipeline(void *p) {
  pipeline_arg *a = p;
  char ch;
  CHECK(read(a->go, &ch, 1) == 1);
  CHECK(prctl(PR_SET_NAME, "loader") == 0);
  td_client *c;
  td_storage *s, *t;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, "w/missing", 0, 0, &t, NULL), TD_ENOENT);
  CHECK_ERR(c, td_storage_create(c, 1 << 20, &s), TD_EDQUOT);
  CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
  CHECK_ERR(c, td_publish(c, "w/batch", s, NULL), 0);
  CHECK_ERR(c, td_lookup(c, "w/batch", TD_TAKE, 0, &t, NULL), 0);
  td_storage_release(t);
  td_storage_release(s);
  CHECK_ERR(c, td_ping(c, NULL), 0); /* the releases are sent */
  td_close(c);
  return 0;
}

/* ---- the events ---- */

TDT_TEST(watch, events_come_in_order_with_their_fields) {
  td_watch *w = watch_open(NULL);
  int go[2];
  cr_assert_eq(pipe2(go, O_CLOEXEC), 0);
  pipeline_arg a = {d.sock, go[0]};
  pid_t pid = tdt_fork(pipeline, &a);
  close(go[0]);
  cr_assert_eq(write(go[1], "g", 1), 1);
  close(go[1]);

  td_event ev;
  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_CONNECT);
  cr_expect_str_eq(ev.name, "loader");
  cr_expect_eq(ev.uid, getuid());

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_REFUSED);
  cr_expect_eq(ev.code, TD_ENOENT);
  cr_expect_str_eq(ev.key, "w/missing");
  cr_expect(strstr(ev.message, "w/missing") != NULL, "%s", ev.message);
  cr_expect_str_eq(ev.name, "loader");

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_REFUSED);
  cr_expect_eq(ev.code, TD_EDQUOT, "%s", td_err_name(ev.code));
  cr_expect(strstr(ev.message, "quota") != NULL, "%s", ev.message);

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_CREATE);
  uint64_t id = ev.id;
  cr_expect_gt(id, 0);
  cr_expect_eq(ev.nbytes, 4096);
  cr_expect_eq(ev.device, TD_CPU);
  cr_expect_str_eq(ev.key, "");

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_PUBLISH);
  cr_expect_str_eq(ev.key, "w/batch");
  cr_expect_eq(ev.id, id);
  cr_expect_eq(ev.nbytes, 4096);

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_TAKE);
  cr_expect_str_eq(ev.key, "w/batch");
  cr_expect_eq(ev.id, id);

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_FREE);
  cr_expect_eq(ev.id, id);
  cr_expect_eq(ev.nbytes, 4096);

  next_of(w, pid, &ev);
  expect_type(&ev, TD_EVENT_DISCONNECT);
  cr_expect_str_eq(ev.name, "loader");
  cr_expect_eq(ev.dropped, 0);
  cr_assert_eq(tdt_wait(pid), 0);
  td_watch_close(w);
}

TDT_TEST(watch, a_prefix_passes_only_events_of_keys_under_it) {
  td_watch *w = watch_open("a/");
  td_watch *all = watch_open("");
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  cr_assert_eq(td_publish(c, "b/1", s, NULL), 0);
  cr_assert_eq(td_publish(c, "a/1", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "b/none", 0, 0, &t, NULL), TD_ENOENT);
  cr_assert_eq(td_lookup(c, "a/none", 0, 0, &t, NULL), TD_ENOENT);
  cr_assert_eq(td_unpublish(c, "b/1"), 0);
  cr_assert_eq(td_unpublish(c, "a/1"), 0);
  td_storage_release(s);
  cr_assert_eq(td_lookup(c, "a/end", 0, 0, &t, NULL), TD_ENOENT);

  /* Under a/: the publish, the refused lookup, the unpublish, the end
   * marker; no create, free, connect or event of b/. */
  static const struct {
    td_event_type type;
    const char *key;
  } want[] = {{TD_EVENT_PUBLISH, "a/1"},
              {TD_EVENT_REFUSED, "a/none"},
              {TD_EVENT_UNPUBLISH, "a/1"},
              {TD_EVENT_REFUSED, "a/end"}};
  td_event ev;
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
    next_of(w, getpid(), &ev);
    expect_type(&ev, want[i].type);
    cr_expect_str_eq(ev.key, want[i].key);
  }
  /* The empty prefix passes everything, events without a key too. */
  int created = 0, b_events = 0, freed = 0;
  do {
    next_of(all, getpid(), &ev);
    created += ev.type == TD_EVENT_CREATE;
    freed += ev.type == TD_EVENT_FREE;
    b_events += strncmp(ev.key, "b/", 2) == 0;
  } while (strcmp(ev.key, "a/end") != 0);
  cr_expect_eq(created, 1);
  cr_expect_eq(freed, 1);
  cr_expect_eq(b_events, 3); /* publish, refused, unpublish */
  td_close(c);
  td_watch_close(w);
  td_watch_close(all);
}

/* ---- a watcher that does not keep up ---- */

static uint64_t raw_watch(tdt_raw *r, const char *prefix) {
  Tensord__Watch m = TENSORD__WATCH__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  m.prefix.data = (uint8_t *)prefix;
  m.prefix.len = strlen(prefix);
  q.body_case = TENSORD__REQUEST__BODY_WATCH;
  q.watch = &m;
  uint64_t seq = tdt_raw_queue(r, &q);
  tdt_raw_flush(r);
  Tensord__Response *rep = tdt_raw_reply(r, 10000);
  cr_assert_not_null(rep, "no answer to Watch");
  cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_OK,
               "Watch answered with body %d (code %d)", rep->body_case,
               tdt_raw_code(rep));
  cr_assert_eq(rep->seq, seq);
  tensord__response__free_unpacked(rep, NULL);
  return seq;
}

TDT_TEST(watch, a_watcher_that_never_reads_slows_no_one_and_learns_drops) {
  tdt_raw r;
  tdt_raw_open(&r, &d);
  uint64_t seq = raw_watch(&r, "");
  td_client *c = tdt_connect(&d);
  td_storage *t;
  /* 10,000 requests, each an event of some 200 bytes: far more than the
   * watcher's share of its output and its socket hold. */
  for (int i = 0; i < 10000; i++) {
    char key[96];
    snprintf(key, sizeof(key), "slow/%064d", i);
    int err = td_lookup(c, key, 0, 0, &t, NULL);
    cr_assert_eq(err, TD_ENOENT, "request %d: %s", i, td_last_error(c));
  }
  /* Past the io timeout (300 ms), which a watcher's unread events do not
   * count against: it is still connected. */
  usleep(600 * 1000);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "%s", td_last_error(c));
  cr_assert_eq(st.clients, 2, "the watcher was disconnected");

  /* Now it reads: what was queued, then, with the next event that fits,
   * how many were dropped. */
  uint64_t dropped = 0, events = 0;
  for (int round = 0; round < 200 && dropped == 0; round++) {
    Tensord__Response *rep = tdt_raw_reply(&r, 100);
    if (rep == NULL) {
      cr_assert(!r.eof, "the watcher was disconnected");
      cr_assert_eq(td_lookup(c, "slow/more", 0, 0, &t, NULL), TD_ENOENT);
      continue;
    }
    cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_EVENT);
    cr_assert_eq(rep->seq, seq, "an event carries the Watch's seq");
    dropped = rep->event->dropped;
    events++;
    round = 0;
    tensord__response__free_unpacked(rep, NULL);
  }
  cr_expect_gt(events, 0);
  cr_assert_gt(dropped, 0, "no event said how many were dropped");
  cr_expect_lt(events + dropped, 10000 + 10000, "%" PRIu64 " + %" PRIu64,
               events, dropped);
  tdt_raw_close(&r);
  td_close(c);
}

TDT_TEST(watch, a_watcher_that_leaves_mid_stream_stops_nothing) {
  tdt_raw gone;
  tdt_raw_open(&gone, &d);
  raw_watch(&gone, "");
  td_watch *w = watch_open("mid/");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  for (int i = 0; i < 600; i++) {
    if (i == 300)
      tdt_raw_close(&gone); /* with events unread */
    char key[32];
    snprintf(key, sizeof(key), "mid/%d", i % 10);
    cr_assert_eq(td_publish(c, key, s, NULL), 0, "%d: %s", i, td_last_error(c));
  }
  cr_assert_eq(td_unpublish(c, "mid/end"), TD_ENOENT);
  td_event ev;
  do
    next_of(w, getpid(), &ev);
  while (strcmp(ev.key, "mid/end") != 0);
  expect_type(&ev, TD_EVENT_REFUSED);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_expect_eq(st.clients, 2, "the watcher that left is gone");
  for (int i = 0; i < 10; i++) {
    char key[32];
    snprintf(key, sizeof(key), "mid/%d", i);
    cr_assert_eq(td_unpublish(c, key), 0);
  }
  td_storage_release(s);
  td_close(c);
  td_watch_close(w);
}

TDT_TEST(watch, many_watchers_each_get_every_event) {
  enum { N = 32 };
  td_watch *w[N];
  for (int i = 0; i < N; i++)
    w[i] = watch_open(i % 2 ? "many/" : NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 128, &s), 0);
  cr_assert_eq(td_publish(c, "many/k", s, NULL), 0);
  cr_assert_eq(td_unpublish(c, "many/k"), 0);
  for (int i = 0; i < N; i++) {
    td_event ev;
    do
      next_of(w[i], getpid(), &ev);
    while (ev.type != TD_EVENT_PUBLISH);
    cr_expect_str_eq(ev.key, "many/k");
    next_of(w[i], getpid(), &ev);
    expect_type(&ev, TD_EVENT_UNPUBLISH);
    cr_expect_eq(ev.dropped, 0);
  }
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_expect_eq(st.clients, N + 1);
  for (int i = 0; i < N; i++)
    td_watch_close(w[i]);
  td_storage_release(s);
  td_close(c);
}

/* ---- bad input ---- */

TDT_TEST(watch, a_watching_connection_refuses_other_requests_and_bad_prefixes) {
  tdt_raw r;
  tdt_raw_open(&r, &d);
  /* A prefix with a NUL, and one longer than any key. */
  Tensord__Watch m = TENSORD__WATCH__INIT;
  Tensord__Request q = TENSORD__REQUEST__INIT;
  uint8_t bad[300];
  memset(bad, 'k', sizeof(bad));
  q.body_case = TENSORD__REQUEST__BODY_WATCH;
  q.watch = &m;
  m.prefix.data = (uint8_t *)"a\0b";
  m.prefix.len = 3;
  tdt_raw_queue(&r, &q);
  m.prefix.data = bad;
  m.prefix.len = sizeof(bad);
  tdt_raw_queue(&r, &q);
  tdt_raw_flush(&r);
  for (int i = 0; i < 2; i++) {
    Tensord__Response *rep = tdt_raw_reply(&r, 10000);
    cr_assert_not_null(rep);
    cr_expect_eq(tdt_raw_code(rep), TD_EINVAL);
    tensord__response__free_unpacked(rep, NULL);
  }
  /* Watching: another request, or a second Watch, is refused (EBUSY); the
   * refusal of its own request reaches it as an event too. */
  uint64_t seq = raw_watch(&r, "");
  tdt_raw_ping(&r);
  tdt_raw_flush(&r);
  int busy = 0, refused_events = 0;
  while (busy == 0 || refused_events == 0) {
    Tensord__Response *rep = tdt_raw_reply(&r, 10000);
    cr_assert_not_null(rep, "no answer to a ping while watching");
    if (rep->body_case == TENSORD__RESPONSE__BODY_ERROR) {
      cr_expect_eq(tdt_raw_code(rep), TD_EBUSY);
      cr_expect(strstr(rep->error->message, "watches events") != NULL, "%s",
                rep->error->message);
      busy++;
    } else {
      cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_EVENT);
      cr_expect_eq(rep->seq, seq);
      cr_expect_eq(rep->event->type, TENSORD__EVENT__TYPE__REFUSED);
      refused_events++;
    }
    tensord__response__free_unpacked(rep, NULL);
  }
  tdt_raw_close(&r);

  /* The library refuses a prefix no key can have before it connects. */
  char longp[TD_KEY_MAX + 2];
  memset(longp, 'p', sizeof(longp) - 1);
  longp[sizeof(longp) - 1] = '\0';
  td_watch *w = (td_watch *)&r; /* to see it set to NULL */
  cr_expect_eq(td_watch_open(d.sock, longp, &w), TD_EINVAL);
  cr_expect_null(w);
  cr_expect(strstr(td_last_error(NULL), "prefix") != NULL, "%s",
            td_last_error(NULL));
  /* No daemon there. */
  char nowhere[128];
  snprintf(nowhere, sizeof(nowhere), "%s/none.sock", d.dir);
  cr_expect_lt(td_watch_open(nowhere, NULL, &w), 0);
  cr_expect_null(w);
}

TDT_TEST(watch, a_watch_ends_when_tensord_goes) {
  td_watch *w = watch_open(NULL);
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  td_event ev;
  int err;
  while ((err = td_watch_next(w, 10000, &ev)) == 0)
    ;
  cr_expect_eq(err, TD_ECONNRESET, "%s: %s", td_err_name(err),
               td_last_error(NULL));
  td_watch_close(w);
  tdt_stopped(&d);
}

/* ---- tensorctl watch ---- */

/* Makes refused lookups of key, on a client connected with name (NULL:
 * the default), until the tensorctl exits; returns what it wrote, malloc'd,
 * and its exit status in *status. */
static char *ctl_feed_as(tdt_child *cr, const char *key, const char *name,
                         int *status) {
  td_connect_opts o = {.name = name};
  td_client *c = NULL;
  cr_assert_eq(td_connect_ex(d.sock, &o, &c), 0, "%s", td_last_error(NULL));
  size_t cap = 1 << 16, len = 0;
  char *out = malloc(cap);
  cr_assert_not_null(out);
  int done = 0;
  for (int i = 0; i < 100000 && !done; i++) {
    td_storage *t;
    cr_assert_eq(td_lookup(c, key, 0, 0, &t, NULL), TD_ENOENT);
    struct pollfd p = {cr->out, POLLIN, 0};
    while (poll(&p, 1, 10) == 1) {
      if (len + 4097 > cap)
        cr_assert_not_null(out = realloc(out, cap *= 2));
      ssize_t k = read(cr->out, out + len, 4096);
      if (k <= 0) {
        done = 1;
        break;
      }
      len += (size_t)k;
    }
  }
  cr_assert(done, "tensorctl watch did not stop");
  out[len] = '\0';
  close(cr->out);
  close(cr->err);
  *status = tdt_wait(cr->pid);
  td_close(c);
  return out;
}

static char *ctl_feed(tdt_child *cr, const char *key, int *status) {
  return ctl_feed_as(cr, key, NULL, status);
}

TDT_TEST(watch, tensorctl_watch_prints_lines_and_json_lines) {
  tdt_child cr =
      tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                          "watch", "-n", "3", "cli/", NULL},
                    NULL);
  int status;
  char *out = ctl_feed(&cr, "cli/none", &status);
  cr_assert_eq(status, 0, "exit %d", status);
  int lines = 0;
  for (char *l = strtok(out, "\n"); l; l = strtok(NULL, "\n"), lines++) {
    /* 12:00:01.234 refused ENOENT key='cli/none' by pid N (test_watch): ... */
    cr_expect(isdigit((unsigned char)l[0]) && l[2] == ':' && l[8] == '.', "%s",
              l);
    cr_expect(strstr(l, " refused ENOENT key='cli/none' by pid ") != NULL, "%s",
              l);
    cr_expect(strstr(l, ": key 'cli/none': not published") != NULL, "%s", l);
  }
  cr_expect_eq(lines, 3);
  free(out);

  cr = tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                           "--json", "watch", "-n", "2", NULL},
                     NULL);
  out = ctl_feed(&cr, "cli/\"quoted\"", &status);
  cr_assert_eq(status, 0, "exit %d", status);
  lines = 0;
  for (char *l = strtok(out, "\n"); l; l = strtok(NULL, "\n"), lines++) {
    cr_expect_eq(l[0], '{', "%s", l);
    cr_expect_eq(l[strlen(l) - 1], '}', "%s", l);
    cr_expect(strstr(l, "\"type\":\"") != NULL, "%s", l);
    cr_expect(strstr(l, "\"unix_ms\":") != NULL, "%s", l);
    if (strstr(l, "\"type\":\"refused\"") != NULL) {
      cr_expect(strstr(l, "\"key\":\"cli/\\\"quoted\\\"\"") != NULL, "%s", l);
      cr_expect(strstr(l, "\"error\":\"ENOENT\"") != NULL, "%s", l);
    }
  }
  cr_expect_eq(lines, 2);
  free(out);
}

/* Events name the client by the name it connected with (td_connect_opts),
 * cleaned of control characters; tensorctl watch prints it, in text and in
 * JSON. */
TDT_TEST(watch, events_carry_the_name_a_client_connected_with) {
  td_watch *w = watch_open(NULL);
  td_connect_opts o = {.name = "train.py worker 1"};
  td_client *c = NULL;
  cr_assert_eq(td_connect_ex(d.sock, &o, &c), 0, "%s", td_last_error(NULL));
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  td_storage_release(s);
  td_close(c);
  td_event ev;
  next_of(w, getpid(), &ev);
  expect_type(&ev, TD_EVENT_CONNECT);
  cr_expect_str_eq(ev.name, "train.py worker 1");
  next_of(w, getpid(), &ev);
  expect_type(&ev, TD_EVENT_CREATE);
  cr_expect_str_eq(ev.name, "train.py worker 1");
  do
    next_of(w, getpid(), &ev);
  while (ev.type != TD_EVENT_DISCONNECT);
  cr_expect_str_eq(ev.name, "train.py worker 1");
  o.name = "x\033]0;t\007y";
  cr_assert_eq(td_connect_ex(d.sock, &o, &c), 0, "%s", td_last_error(NULL));
  next_of(w, getpid(), &ev);
  expect_type(&ev, TD_EVENT_CONNECT);
  cr_expect_str_eq(ev.name, "x?]0;t?y");
  td_close(c);
  td_watch_close(w);

  tdt_child cr =
      tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                          "watch", "-n", "2", "nm/", NULL},
                    NULL);
  int status;
  char *out = ctl_feed_as(&cr, "nm/none", "train.py worker 1", &status);
  cr_assert_eq(status, 0, "exit %d", status);
  char want[64];
  snprintf(want, sizeof(want),
           " by pid %d (train.py worker 1): ", (int)getpid());
  cr_expect(strstr(out, want) != NULL, "'%s' in:\n%s", want, out);
  free(out);
  cr = tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                           "--json", "watch", "-n", "2", "nm/",
                                           NULL},
                     NULL);
  out = ctl_feed_as(&cr, "nm/none", "x\033]0;t\007y", &status);
  cr_assert_eq(status, 0, "exit %d", status);
  cr_expect(strstr(out, "\"name\":\"x?]0;t?y\"") != NULL, "%s", out);
  cr_expect_null(strchr(out, '\033'), "%s", out);
  free(out);
}

TDT_TEST(watch, tensorctl_watch_stops_cleanly_on_sigint_and_a_closed_pipe) {
  tdt_child cr = tdt_cli_spawn(
      (const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "watch", NULL},
      NULL);
  /* Once it prints, it watches: then SIGINT ends it with status 0. */
  td_client *c = tdt_connect(&d);
  td_storage *t;
  char buf[4096];
  struct pollfd p = {cr.out, POLLIN, 0};
  for (int i = 0; i < 1000 && poll(&p, 1, 10) == 0; i++)
    cr_assert_eq(td_lookup(c, "sig/none", 0, 0, &t, NULL), TD_ENOENT);
  cr_assert_gt(read(cr.out, buf, sizeof(buf)), 0);
  kill(cr.pid, SIGINT);
  cr_expect_eq(tdt_wait(cr.pid), 0);
  close(cr.out);
  close(cr.err);

  /* A reader that goes (head -1): the next line it writes ends it, 0. */
  cr = tdt_cli_spawn(
      (const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "watch", NULL},
      NULL);
  p.fd = cr.out;
  for (int i = 0; i < 1000 && poll(&p, 1, 10) == 0; i++)
    cr_assert_eq(td_lookup(c, "pipe/none", 0, 0, &t, NULL), TD_ENOENT);
  close(cr.out);
  close(cr.err);
  int exited = 0;
  for (int i = 0; i < 100000 && !exited; i++) {
    cr_assert_eq(td_lookup(c, "pipe/none", 0, 0, &t, NULL), TD_ENOENT);
    int st;
    pid_t got = waitpid(cr.pid, &st, WNOHANG);
    if (got == cr.pid) {
      exited = 1;
      cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %#x", st);
    }
  }
  cr_assert(exited, "tensorctl watch did not stop on a closed pipe");
  td_close(c);
}

/* ---- names in ls and info, memory in stat ---- */

typedef struct names_seen {
  uint64_t id;
  pid_t pid;
  int found;
} names_seen;

static int find_holder(const td_storage_info *info, void *arg) {
  names_seen *n = arg;
  if (info->id != n->id)
    return 0;
  for (size_t i = 0; i < info->nholders; i++)
    if (info->holders[i].pid == n->pid &&
        strcmp(info->holders[i].name, "trainer") == 0)
      n->found++;
  return 0;
}

/* Runs tensorctl with args and returns its stdout (malloc'd); asserts it
 * exits 0. */
static char *ctl_output(const char *const *argv) {
  tdt_run_result r;
  tdt_cli_run(argv, &r);
  cr_assert_eq(r.status, 0, "tensorctl %s %s: exit %d; stderr: %s", argv[3],
               argv[4] ? argv[4] : "", r.status, r.err);
  return r.out;
}

TDT_TEST(watch, ls_and_info_name_the_holders) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  uint64_t id = td_storage_id(s);
  tdt_holder holding;
  tdt_holder_start(&holding, d.sock, id, "trainer");
  pid_t pid = holding.pid;

  names_seen n = {id, pid, 0};
  cr_assert_eq(td_list(c, find_holder, &n), 0);
  cr_expect_eq(n.found, 1, "td_list: holder %d named 'trainer'", (int)pid);
  n.found = 0;
  cr_assert_eq(td_info(c, id, NULL, find_holder, NULL, &n), 0);
  cr_expect_eq(n.found, 1, "td_info: holder %d named 'trainer'", (int)pid);

  char want[64], ids[32];
  snprintf(ids, sizeof(ids), "%" PRIu64, id);
  snprintf(want, sizeof(want), "%d (trainer)", (int)pid);
  char *out = ctl_output(
      (const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "ls", NULL});
  cr_expect(strstr(out, want) != NULL, "ls does not show '%s':\n%s", want, out);
  free(out);
  out = ctl_output((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                         "info", ids, NULL});
  snprintf(want, sizeof(want), "%d (trainer, uid", (int)pid);
  cr_expect(strstr(out, want) != NULL, "info does not show '%s':\n%s", want,
            out);
  free(out);
  out = ctl_output((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                         "--json", "ls", NULL});
  snprintf(want, sizeof(want), "{\"pid\":%d,", (int)pid);
  const char *h = strstr(out, want);
  cr_expect(h != NULL && strstr(h, "\"name\":\"trainer\"}") != NULL,
            "ls --json does not name holder %d:\n%s", (int)pid, out);
  free(out);
  out = ctl_output((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                         "--json", "info", ids, NULL});
  cr_expect(strstr(out, "\"name\":\"trainer\"") != NULL, "%s", out);
  free(out);

  tdt_holder_stop(&holding);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(watch, stat_shows_the_daemons_own_memory) {
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_expect_gt(st.daemon_rss_bytes, 0);
  /* daemon_heap_bytes is malloc's word (mallinfo2), which a sanitizer's
   * allocator leaves at 0: not asserted. */
  cr_expect_eq(st.reserved[0], 0);
  td_close(c);
  char *out = ctl_output(
      (const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "stat", NULL});
  cr_expect(strstr(out, "\nmemory    ") != NULL, "%s", out);
  cr_expect(strstr(out, " resident, ") != NULL, "%s", out);
  free(out);
  out = ctl_output((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                         "--json", "stat", NULL});
  const char *p = strstr(out, "\"daemon_rss_bytes\":");
  cr_assert_not_null(p, "%s", out);
  cr_expect_gt(strtoull(p + strlen("\"daemon_rss_bytes\":"), NULL, 10), 0);
  cr_expect(strstr(out, "\"daemon_heap_bytes\":") != NULL, "%s", out);
  free(out);
}

/* Runs tensorctl with argv and returns its exit status; its stderr goes to
 * err (NUL-terminated). */
static int ctl_status(const char *const *argv, char *err, size_t len) {
  tdt_run_result r;
  tdt_cli_run(argv, &r);
  snprintf(err, len, "%.*s", (int)len - 1, r.err);
  tdt_run_free(&r);
  return r.status;
}

TDT_TEST(watch, tensorctl_watch_refuses_bad_arguments) {
  char err[1024], nowhere[128];
  cr_expect_eq(
      ctl_status((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                       "watch", "-n", "0", NULL},
                 err, sizeof(err)),
      2);
  cr_expect(strstr(err, "-n needs a count") != NULL, "%s", err);
  cr_expect_eq(ctl_status((const char *const[]){TENSORCTL_BIN, "--socket",
                                                d.sock, "watch", "-n", NULL},
                          err, sizeof(err)),
               2);
  cr_expect_eq(
      ctl_status((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                       "watch", "a/", "b/", NULL},
                 err, sizeof(err)),
      2);
  cr_expect(strstr(err, "unexpected argument 'b/'") != NULL, "%s", err);
  snprintf(nowhere, sizeof(nowhere), "%s/none.sock", d.dir);
  cr_expect_eq(ctl_status((const char *const[]){TENSORCTL_BIN, "--socket",
                                                nowhere, "watch", NULL},
                          err, sizeof(err)),
               1);
  cr_expect(strstr(err, "tensorctl watch: cannot connect") != NULL, "%s", err);
}

/* test_limits.c: --capacity and /dev/shm limits, the command line, and the
 * listening socket (inherited, stale, taken). */
#include "harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

/* The daemon of a test; TDT_TEST stops it after the body. */
static tdt_daemon d;

/* A test that fails midway leaves no daemon, segment or directory. */
TestSuite(limits, .fini = tdt_cleanup);

/* ---- running a command ---- */

typedef struct run_result {
  int status; /* exit status, or 128 + signal */
  char out[8192];
  char err[8192];
} run_result;

/* Runs argv with stdout and stderr captured; kills it after timeout_ms. */
static void run(const char *const *argv, int timeout_ms, run_result *r) {
  int po[2], pe[2];
  cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
  cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    dup2(po[1], STDOUT_FILENO);
    dup2(pe[1], STDERR_FILENO);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_PID");
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(po[1]);
  close(pe[1]);
  memset(r, 0, sizeof(*r));
  size_t no = 0, ne = 0;
  struct pollfd p[2] = {{po[0], POLLIN, 0}, {pe[0], POLLIN, 0}};
  int open_ends = 2, waited = 0;
  while (open_ends > 0) {
    int n = poll(p, 2, 100);
    if (n == 0 && (waited += 100) >= timeout_ms) {
      kill(pid, SIGKILL);
      break;
    }
    for (int i = 0; i < 2; i++) {
      if (p[i].fd < 0 || !(p[i].revents & (POLLIN | POLLHUP)))
        continue;
      char *buf = i ? r->err : r->out;
      size_t *len = i ? &ne : &no;
      char tmp[4096];
      ssize_t k = read(p[i].fd, tmp, sizeof(tmp));
      if (k <= 0) {
        close(p[i].fd);
        p[i].fd = -1;
        open_ends--;
        continue;
      }
      size_t room = sizeof(r->out) - 1 - *len;
      size_t take = (size_t)k < room ? (size_t)k : room;
      memcpy(buf + *len, tmp, take);
      *len += take;
    }
  }
  for (int i = 0; i < 2; i++)
    if (p[i].fd >= 0)
      close(p[i].fd);
  r->status = tdt_wait(pid);
}

/* ---- capacity ---- */

TDT_TEST(limits, creates_past_capacity_get_enomem_naming_the_bytes, .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--capacity", "1M", NULL});
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.capacity, 1 << 20);
  td_storage *a, *b, *x;
  cr_assert_eq(td_storage_create(c, 700000, &a), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 400000, &x), TD_ENOMEM);
  cr_assert_null(x);
  const char *msg = td_last_error(c);
  cr_assert(strstr(msg, "(400000 bytes)") != NULL, "requested: '%s'", msg);
  cr_assert(strstr(msg, "(348576 bytes) free") != NULL, "free: '%s'", msg);
  /* Exactly what is left fits. */
  cr_assert_eq(td_storage_create(c, 348576, &b), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 1, &x), TD_ENOMEM);
  msg = td_last_error(c);
  cr_assert(strstr(msg, "(1 bytes)") && strstr(msg, "(0 bytes) free"), "'%s'",
            msg);
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.bytes_used, 1 << 20);
  cr_assert_eq(st.storages, 2);
  /* Releasing gives the bytes back. */
  td_storage_release(a);
  cr_assert_eq(td_storage_create(c, 400000, &x), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 300000, &a), 0, "%s", td_last_error(c));
  td_storage *y;
  cr_assert_eq(td_storage_create(c, 1, &y), TD_ENOMEM, "full again");
  td_storage_release(a);
  td_storage_release(x);
  td_storage_release(b);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

TDT_TEST(limits, create_larger_than_capacity_is_enomem, .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--capacity", "1M", NULL});
  td_client *c = tdt_connect(&d);
  td_storage *x;
  cr_assert_eq(td_storage_create(c, (2 << 20) + 5, &x), TD_ENOMEM);
  cr_assert(strstr(td_last_error(c), "(2097157 bytes)"), "'%s'",
            td_last_error(c));
  cr_assert_eq(td_storage_create(c, SIZE_MAX, &x), TD_ENOMEM,
               "no overflow in the capacity arithmetic");
  cr_assert_eq(td_storage_create(c, 1 << 20, &x), 0, "%s", td_last_error(c));
  td_storage_release(x);
  td_close(c);
  tdt_stop(&d);
}

typedef struct create_job {
  td_client *c;
  size_t n;
  int err;
  td_storage *s;
} create_job;

static void *create_thread(void *p) {
  create_job *j = p;
  j->err = td_storage_create(j->c, j->n, &j->s);
  return NULL;
}

TDT_TEST(limits, concurrent_creates_cannot_exceed_capacity, .timeout = 30) {
  tdt_start(&d, (const char *const[]){"--capacity", "1M", NULL});
  td_client *c = tdt_connect(&d);
  for (int round = 0; round < 5; round++) {
    create_job j[3];
    pthread_t t[3];
    for (int i = 0; i < 3; i++) {
      j[i] = (create_job){c, 400000, 0, NULL};
      cr_assert_eq(pthread_create(&t[i], NULL, create_thread, &j[i]), 0);
    }
    int ok = 0, full = 0;
    for (int i = 0; i < 3; i++) {
      pthread_join(t[i], NULL);
      ok += j[i].err == 0;
      full += j[i].err == TD_ENOMEM;
    }
    cr_assert_eq(ok, 2, "round %d: %d of 3 creates of 400000 bytes fit 1 MiB",
                 round, ok);
    cr_assert_eq(full, 1);
    for (int i = 0; i < 3; i++)
      td_storage_release(j[i].s);
  }
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

TDT_TEST(limits, create_that_dev_shm_cannot_hold_is_enospc, .timeout = 30) {
  struct statvfs sv;
  cr_assert_eq(statvfs("/dev/shm", &sv), 0);
  uint64_t total = (uint64_t)sv.f_blocks * sv.f_frsize;
  cr_assert_gt(total, 0);
  char cap[32];
  snprintf(cap, sizeof(cap), "%llu", (unsigned long long)total * 4);
  tdt_start(&d, (const char *const[]){"--capacity", cap, NULL});
  cr_assert(tdt_log_has(&d, "more than /dev/shm holds"),
            "tensord warns about a capacity /dev/shm cannot hold");
  td_client *c = tdt_connect(&d);
  td_storage *x;
  size_t n = (size_t)total + 1;
  cr_assert_eq(td_storage_create(c, n, &x), TD_ENOSPC, "%s", td_last_error(c));
  cr_assert_null(x);
  char want[48];
  snprintf(want, sizeof(want), "(%zu bytes)", n);
  cr_assert(strstr(td_last_error(c), "/dev/shm") != NULL, "'%s'",
            td_last_error(c));
  cr_assert(strstr(td_last_error(c), want) != NULL, "'%s'", td_last_error(c));
  cr_assert_eq(tdt_segments(&d), 0, "nothing left behind");
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.storages, 0);
  cr_assert_eq(st.bytes_used, 0);
  /* Nothing stays reserved: a small create still works. */
  cr_assert_eq(td_storage_create(c, 4096, &x), 0, "%s", td_last_error(c));
  td_storage_release(x);
  td_close(c);
  tdt_stop(&d);
}

/* ---- the socket ---- */

TDT_TEST(limits, inherited_socket_serves_clients, .timeout = 30) {
  tdt_start_inherited(&d);
  cr_assert(tdt_log_has(&d, "(inherited)"), "tensord says it adopted fd 3");
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_str_eq(st.socket, d.sock);
  td_storage *s, *t;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "inherited", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "inherited", TD_TAKE, 0, &t, NULL), 0);
  td_storage_release(t);
  td_storage_release(s);
  cr_assert_eq(td_ping(c, NULL), 0);
  td_close(c);
  /* tdt_stop, except that the socket belongs to whoever passed it (systemd
   * unlinks it, not tensord): check that tensord left it in place. */
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  cr_assert_eq(tdt_wait(d.pid), 0, "tensord exits 0");
  d.pid = 0;
  struct stat sb;
  cr_assert_eq(stat(d.sock, &sb), 0,
               "tensord must not unlink an inherited "
               "socket");
  cr_assert_eq(tdt_segments(&d), 0);
  unlink(d.sock);
  int fds = tdt_open_fds();
  tdt_kill(&d); /* removes the directory */
  cr_assert_eq(fds, d.fds_before, "the test leaked %d fd(s)",
               fds - d.fds_before);
}

static int wait_connectable(const char *path) {
  for (int i = 0; i < 5000; i++) {
    td_client *c;
    if (td_connect(path, &c) == 0) {
      td_close(c);
      return 1;
    }
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return 0;
}

/* Starts tensord on path without the harness; its stderr goes to log. */
static pid_t spawn_tensord(const char *path, const char *log) {
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || dup2(fd, STDERR_FILENO) < 0)
      _exit(126);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("LISTEN_FDS");
    execl(TENSORD_BIN, TENSORD_BIN, "--socket", path, "--log-level", "debug",
          (char *)NULL);
    _exit(127);
  }
  return pid;
}

TDT_TEST(limits, stale_socket_file_is_replaced, .timeout = 30) {
  int fds_before = tdt_open_fds();
  char dir[64];
  tdt_mkdtemp(dir);
  char path[108], log[128];
  snprintf(path, sizeof(path), "%s/stale.sock", dir);
  snprintf(log, sizeof(log), "%s/tensord.log", dir);
  /* A socket file nobody listens on: bound, then closed without unlink. */
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  close(fd);
  struct stat sb;
  cr_assert_eq(stat(path, &sb), 0);
  cr_assert(S_ISSOCK(sb.st_mode));
  td_client *c;
  cr_assert_eq(td_connect(path, &c), TD_ECONNREFUSED, "nobody listens yet");

  pid_t pid = spawn_tensord(path, log);
  int up = wait_connectable(path);
  if (!up)
    kill(pid, SIGKILL);
  cr_assert(up, "tensord did not start on a stale socket path");
  cr_assert_eq(td_connect(path, &c), 0);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  tdt_note_instance(st.instance); /* for tests/check-clean.sh */
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_ping(c, NULL), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert_eq(kill(pid, SIGTERM), 0);
  cr_assert_eq(tdt_wait(pid), 0, "tensord exits 0");
  cr_assert_neq(stat(path, &sb), 0, "tensord removed its socket");
  unlink(log);
  rmdir(dir);
  cr_assert_eq(tdt_open_fds(), fds_before);
}

TDT_TEST(limits, a_file_that_is_not_a_socket_is_left_alone, .timeout = 30) {
  char dir[64];
  tdt_mkdtemp(dir);
  char path[108];
  snprintf(path, sizeof(path), "%s/precious", dir);
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputs("keep me\n", f);
  fclose(f);
  run_result r;
  run((const char *const[]){TENSORD_BIN, "--socket", path, NULL}, 10000, &r);
  cr_assert_eq(r.status, 1, "exit %d; stderr: %s", r.status, r.err);
  cr_assert(strstr(r.err, "not a socket") != NULL, "stderr: %s", r.err);
  struct stat sb;
  cr_assert_eq(stat(path, &sb), 0);
  cr_assert(S_ISREG(sb.st_mode) && sb.st_size == 8, "the file is untouched");
  unlink(path);
  rmdir(dir);
}

TDT_TEST(limits, second_tensord_on_the_same_socket_exits_1, .timeout = 30) {
  tdt_start(&d, NULL);
  run_result r;
  run((const char *const[]){TENSORD_BIN, "--socket", d.sock, NULL}, 10000, &r);
  cr_assert_eq(r.status, 1, "exit %d; stderr: %s", r.status, r.err);
  cr_assert(strstr(r.err, "already listening") != NULL, "stderr: %s", r.err);
  cr_assert(strstr(r.err, d.sock) != NULL, "names the path: %s", r.err);
  /* The first one is undisturbed, socket and all. */
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_ping(c, NULL), 0);
  td_close(c);
  tdt_stop(&d);
}

TDT_TEST(limits, socket_path_too_long_exits_1, .timeout = 30) {
  char path[200];
  memset(path, 'p', sizeof(path));
  memcpy(path, "/tmp/", 5);
  path[sizeof(path) - 1] = '\0';
  run_result r;
  run((const char *const[]){TENSORD_BIN, "--socket", path, NULL}, 10000, &r);
  cr_assert_eq(r.status, 1, "exit %d; stderr: %s", r.status, r.err);
  cr_assert(strstr(r.err, "longer than") != NULL, "stderr: %s", r.err);
}

/* ---- the command line ---- */

TDT_TEST(limits, version_prints_and_exits_0, .timeout = 30) {
  run_result r;
  run((const char *const[]){TENSORD_BIN, "--version", NULL}, 10000, &r);
  cr_assert_eq(r.status, 0, "exit %d; stderr: %s", r.status, r.err);
  char want[64];
  snprintf(want, sizeof(want), "tensord %s (protocol %d)\n", TD_VERSION_STRING,
           TD_PROTOCOL_VERSION);
  cr_assert_str_eq(r.out, want);
}

TDT_TEST(limits, help_exits_0, .timeout = 30) {
  run_result r;
  run((const char *const[]){TENSORD_BIN, "--help", NULL}, 10000, &r);
  cr_assert_eq(r.status, 0);
  cr_assert(strstr(r.out, "--capacity") != NULL, "%s", r.out);
}

TDT_TEST(limits, bad_arguments_exit_2, .timeout = 30) {
  static const char *const cases[][4] = {
      {"--capacity", "lots", NULL},  {"--capacity", "0", NULL},
      {"--capacity", "-5G", NULL},   {"--capacity", "12Q", NULL},
      {"--log-level", "loud", NULL}, {"--no-such-option", NULL},
      {"unexpected", NULL},          {"--huge-pages", "maybe", NULL},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *argv[6] = {TENSORD_BIN};
    for (int j = 0; cases[i][j]; j++)
      argv[j + 1] = cases[i][j];
    run_result r;
    run(argv, 10000, &r);
    cr_assert_eq(r.status, 2, "tensord %s %s: exit %d; stderr: %s", cases[i][0],
                 cases[i][1] ? cases[i][1] : "", r.status, r.err);
    cr_assert_gt(strlen(r.err), 0, "tensord %s: says why on stderr",
                 cases[i][0]);
    cr_assert_eq(strlen(r.out), 0, "nothing on stdout");
  }
  run_result r;
  run((const char *const[]){TENSORD_BIN, "--capacity", "lots", NULL}, 10000,
      &r);
  cr_assert(strstr(r.err, "--capacity 'lots'") != NULL, "stderr: %s", r.err);
}

TDT_TEST(limits, capacity_sizes_parse, .timeout = 30) {
  static const struct {
    const char *arg;
    uint64_t bytes;
  } cases[] = {
      {"4096", 4096},       {"64K", 64 << 10},    {"512MiB", 512ull << 20},
      {"1.5G", 3ull << 29}, {"2GiB", 2ull << 30},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
      tdt_start(&d, (const char *const[]){"--capacity", cases[i].arg, NULL});
    td_client *c = tdt_connect(&d);
    td_stat st;
    cr_assert_eq(td_stat_get(c, &st), 0);
    cr_assert_eq(st.capacity, cases[i].bytes, "--capacity %s: %llu bytes",
                 cases[i].arg, (unsigned long long)st.capacity);
    td_close(c);
    tdt_stop(&d);
  }
}

/* One info line at start says what the host offers in huge pages (the
 * parsing is test_hugepages'); --huge-pages off says it did not look. */
TDT_TEST(limits, huge_pages_are_logged_at_start, .timeout = 30) {
  tdt_start(&d, NULL);
  cr_assert(tdt_log_has(&d, "huge pages: shmem THP '"));
  cr_assert(tdt_log_has(&d, "/dev/shm"));
  tdt_stop(&d);
  tdt_start(&d, (const char *const[]){"--huge-pages", "off", NULL});
  cr_assert(tdt_log_has(&d, "huge pages: not looked at (--huge-pages off)"));
  tdt_stop(&d);
  tdt_start(&d, (const char *const[]){"--huge-pages", "auto", NULL});
  cr_assert(tdt_log_has(&d, "huge pages: shmem THP '"));
  tdt_stop(&d);
}

/* ---- many clients ---- */

TDT_TEST(limits, a_thousand_clients_are_served_at_once, .timeout = 60) {
  enum { N = 1000 };
  tdt_start(&d, NULL);
  td_client **c = calloc(N, sizeof(*c));
  for (int i = 0; i < N; i++)
    c[i] = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c[0], &st), 0);
  cr_assert_eq(st.clients, N);
  td_storage *s;
  cr_assert_eq(td_storage_create(c[0], 64, &s), 0);
  for (int i = 0; i < N; i++) {
    td_storage *t;
    cr_assert_eq(td_storage_open(c[i], td_storage_id(s), TD_RDONLY, &t), 0,
                 "client %d: %s", i, td_last_error(c[i]));
    td_storage_release(t);
  }
  td_storage_release(s);
  for (int i = 0; i < N; i++)
    td_close(c[i]);
  free(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

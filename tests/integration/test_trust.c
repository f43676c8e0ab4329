/* test_trust.c: who may stand behind the socket. tensord refuses a socket
 * directory another user owns or may write (someone could squat it and
 * replace the socket), makes the default one 0700, and a client talks only
 * to a daemon of its own uid, of root, or of a uid it was told to trust. */
#include "harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

/* Numeric ids that need no entry in /etc/passwd. */
#define USER_A 4246 /* a client */
#define USER_B 4247 /* a daemon that is not root */

static void need_root(void) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
}

/* ---- a private directory and a daemon in it ---- */

typedef struct place {
  char dir[64];   /* /tmp/tensord-test.XXXXXX, root's */
  char sub[128];  /* where the socket goes */
  char sock[160]; /* sub/tensord.sock */
  char log[128];  /* dir/tensord.log */
  pid_t pid;      /* the daemon, if running */
} place;

static place pl;
static char dflt_dir[64]; /* a default socket directory a test made */

static void setup(void) {
  memset(&pl, 0, sizeof(pl));
  dflt_dir[0] = '\0';
}

/* Removes the daemon, if any, and every file and directory a test made. */
static void teardown(void) {
  if (pl.pid > 0) {
    kill(pl.pid, SIGKILL);
    tdt_wait(pl.pid);
  }
  char cmd[256];
  if (pl.dir[0] != '\0') {
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", pl.dir);
    if (system(cmd) != 0)
      fprintf(stderr, "could not remove %s\n", pl.dir);
  }
  if (dflt_dir[0] != '\0') {
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dflt_dir);
    if (system(cmd) != 0)
      fprintf(stderr, "could not remove %s\n", dflt_dir);
  }
}

TestSuite(trust, .init = setup, .fini = teardown, .timeout = 60);

/* Makes pl.dir and, inside it, sub (if not NULL) with mode and owner. */
static void make_place(const char *sub, mode_t mode, uid_t uid) {
  snprintf(pl.dir, sizeof(pl.dir), "/tmp/tensord-test.XXXXXX");
  cr_assert_not_null(mkdtemp(pl.dir), "mkdtemp: %s", strerror(errno));
  cr_assert_eq(chmod(pl.dir, 0755), 0);
  snprintf(pl.log, sizeof(pl.log), "%s/tensord.log", pl.dir);
  if (sub == NULL) {
    snprintf(pl.sub, sizeof(pl.sub), "%s", pl.dir);
  } else {
    snprintf(pl.sub, sizeof(pl.sub), "%s/%s", pl.dir, sub);
    cr_assert_eq(mkdir(pl.sub, 0700), 0, "%s: %s", pl.sub, strerror(errno));
    cr_assert_eq(chmod(pl.sub, mode), 0);
    cr_assert_eq(chown(pl.sub, uid, uid), 0);
  }
  snprintf(pl.sock, sizeof(pl.sock), "%s/tensord.sock", pl.sub);
}

/* Forks tensord as uid (its own group, no others) with its stderr in
 * pl.log and args after it; sock NULL: no --socket, and neither
 * TENSORD_SOCKET nor XDG_RUNTIME_DIR, so that it takes the default path.
 * notify (if not NULL) is its NOTIFY_SOCKET. Returns its pid. */
static pid_t spawn_daemon(uid_t uid, const char *sock, const char *const *args,
                          const char *notify) {
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid > 0)
    return pid;
  int fd = open(pl.log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0 || dup2(fd, STDERR_FILENO) < 0)
    _exit(126);
  if (setgroups(0, NULL) < 0 || setgid(uid) < 0 || setuid(uid) < 0)
    _exit(125);
  /* A test that dies takes its daemon with it (set after setuid, which
   * clears it). */
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() == 1)
    _exit(124);
  if (notify != NULL)
    setenv("NOTIFY_SOCKET", notify, 1);
  else
    unsetenv("NOTIFY_SOCKET");
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("TENSORD_SOCKET");
  unsetenv("XDG_RUNTIME_DIR");
  const char *argv[16] = {TENSORD_BIN, "--log-level", "debug"};
  int n = 3;
  if (sock != NULL) {
    argv[n++] = "--socket";
    argv[n++] = sock;
  }
  for (int i = 0; args && args[i] && n < 15; i++)
    argv[n++] = args[i];
  argv[n] = NULL;
  execv(TENSORD_BIN, (char *const *)argv);
  _exit(127);
}

/* Starts tensord as spawn_daemon does (pl.pid) and waits for its READY=1,
 * sent once it serves and handles SIGTERM, on a datagram socket in pl.dir
 * that a daemon of any uid may send to; asserts. */
static void start_daemon(uid_t uid, const char *sock, const char *const *args) {
  char path[100];
  snprintf(path, sizeof(path), "%.60s/notify.sock", pl.dir);
  int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  cr_assert(nfd >= 0 && bind(nfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
                chmod(path, 0666) == 0,
            "notify socket %s: %s", path, strerror(errno));
  pl.pid = spawn_daemon(uid, sock, args, path);
  struct pollfd p = {nfd, POLLIN, 0};
  int r = 0, st = 0;
  for (int waited = 0; r == 0 && waited < 10000; waited += 10) {
    r = poll(&p, 1, 10);
    if (r == 0 && waitpid(pl.pid, &st, WNOHANG) == pl.pid) {
      pl.pid = 0;
      break;
    }
  }
  char buf[256] = "";
  ssize_t n = r == 1 ? recv(nfd, buf, sizeof(buf) - 1, 0) : -1;
  close(nfd);
  unlink(path);
  cr_assert_neq(pl.pid, 0, "tensord exited (status 0x%x) before READY=1", st);
  cr_assert(n > 0 && strstr(buf, "READY=1") != NULL,
            "tensord did not say READY=1 within 10 s");
}

/* Waits up to 10 s for the daemon to exit by itself and returns its status;
 * kills it then and returns -1. */
static int wait_exit(void) {
  for (int waited = 0; waited < 10000; waited += 5) {
    int st;
    if (waitpid(pl.pid, &st, WNOHANG) == pl.pid) {
      pl.pid = 0;
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  kill(pl.pid, SIGKILL);
  tdt_wait(pl.pid);
  pl.pid = 0;
  return -1;
}

/* Stops the daemon: it exits 0 and removes its socket. */
static void stop_daemon(const char *sock) {
  cr_assert_eq(kill(pl.pid, SIGTERM), 0);
  int st = tdt_wait(pl.pid);
  pl.pid = 0;
  cr_assert_eq(st, 0, "tensord exited with %d", st);
  struct stat sb;
  cr_assert_neq(stat(sock, &sb), 0, "tensord left its socket %s", sock);
}

/* Runs tensord as root on pl.sock, expecting it to refuse to start: exit 1,
 * no socket, and a log that names each of needles. */
static void expect_refusal(const char *const *needles) {
  pl.pid = spawn_daemon(0, pl.sock, NULL, NULL);
  int st = wait_exit();
  char log[4096] = "";
  FILE *f = fopen(pl.log, "r");
  if (f != NULL) {
    size_t n = fread(log, 1, sizeof(log) - 1, f);
    log[n] = '\0';
    fclose(f);
  }
  cr_assert_eq(st, 1, "tensord %s: %s",
               st < 0 ? "started (killed after 10 s)" : "exited, not with 1",
               log);
  for (int i = 0; needles[i] != NULL; i++)
    cr_assert(strstr(log, needles[i]) != NULL, "log does not name '%s': %s",
              needles[i], log);
  struct stat sb;
  cr_assert_neq(lstat(pl.sock, &sb), 0, "tensord made a socket in %s", pl.sub);
}

/* ---- the daemon's side ---- */

/* A directory someone else made first (the squat on /tmp/tensord-<uid>):
 * tensord refuses it, naming it and its owner. */
TDT_TEST(trust, daemon_refuses_a_socket_directory_another_user_owns) {
  need_root();
  make_place("squatted", 0700, USER_A);
  expect_refusal((const char *const[]){pl.sub, "uid 4246", "owned by", NULL});
}

TDT_TEST(trust, daemon_refuses_a_socket_directory_others_may_write) {
  need_root();
  make_place("open", 0777, 0);
  expect_refusal((const char *const[]){pl.sub, "mode 0777", NULL});
}

TDT_TEST(trust, daemon_refuses_a_socket_directory_its_group_may_write) {
  need_root();
  make_place("group", 0770, 0);
  expect_refusal((const char *const[]){pl.sub, "mode 0770", NULL});
}

/* Whoever may write a directory above the socket's can rename the socket's
 * away and put their own in its place. */
TDT_TEST(trust, daemon_refuses_a_directory_above_that_others_may_write) {
  need_root();
  make_place("open", 0777, 0);
  char inner[160];
  snprintf(inner, sizeof(inner), "%s/inner", pl.sub);
  cr_assert_eq(mkdir(inner, 0700), 0);
  snprintf(pl.sock, sizeof(pl.sock), "%.140s/tensord.sock", inner);
  expect_refusal(
      (const char *const[]){pl.sub, "mode 0777", "above the socket", NULL});
}

/* A sticky directory others may write (as /tmp is) cannot have our socket
 * taken away: it is accepted. */
TDT_TEST(trust, daemon_accepts_a_sticky_socket_directory) {
  need_root();
  make_place("sticky", 01777, 0);
  start_daemon(0, pl.sock, NULL);
  stop_daemon(pl.sock);
}

/* Without $TENSORD_SOCKET and $XDG_RUNTIME_DIR the daemon makes
 * /tmp/tensord-<uid> itself, mode 0700; a client of that uid finds it there.
 * The uid is unused and unique to this test process, so the fixed path
 * cannot clash with anyone's, and the test removes it. */
static uid_t fresh_uid(int which) {
  return (uid_t)(300000 + (getpid() % 100000) * 2 + which);
}

typedef struct client_job {
  uid_t uid;
  const char *sock;  /* NULL: the default path */
  const char *trust; /* $TENSORD_TRUST_UID, or NULL */
  int want;          /* what td_connect must return */
  const char *needles[6];
} client_job;

/* In a child: becomes j->uid and connects; checks the result and the
 * message, and on success that the daemon answers. */
static int client_child(void *p) {
  const client_job *j = p;
  if (j->uid != 0 &&
      (setgroups(0, NULL) < 0 || setgid(j->uid) < 0 || setuid(j->uid) < 0))
    return 2;
  unsetenv("TENSORD_SOCKET");
  unsetenv("XDG_RUNTIME_DIR");
  if (j->trust != NULL)
    setenv("TENSORD_TRUST_UID", j->trust, 1);
  else
    unsetenv("TENSORD_TRUST_UID");
  td_client *c = NULL;
  CHECK_ERR(NULL, td_connect(j->sock, &c), j->want);
  for (int i = 0; j->needles[i] != NULL; i++)
    CHECK_MSG(NULL, j->needles[i]);
  if (c != NULL) {
    CHECK_ERR(c, td_ping(c, NULL), 0);
    td_close(c);
  }
  return 0;
}

static void run_client(client_job j) {
  int st = tdt_wait(tdt_fork(client_child, &j));
  cr_assert_eq(st, 0, "client as uid %u (trust '%s'): child exited %d",
               (unsigned)j.uid, j.trust ? j.trust : "", st);
}

TDT_TEST(trust, default_socket_directory_is_made_0700_by_its_user) {
  need_root();
  uid_t u = fresh_uid(0);
  snprintf(dflt_dir, sizeof(dflt_dir), "/tmp/tensord-%u", (unsigned)u);
  struct stat sb;
  cr_assert_neq(lstat(dflt_dir, &sb), 0, "%s exists already", dflt_dir);
  make_place(NULL, 0, 0);
  char sock[128];
  snprintf(sock, sizeof(sock), "%s/tensord.sock", dflt_dir);
  start_daemon(u, NULL, NULL);
  cr_assert_eq(lstat(dflt_dir, &sb), 0);
  cr_assert(S_ISDIR(sb.st_mode));
  cr_assert_eq(sb.st_mode & 07777, 0700, "mode %04o", sb.st_mode & 07777);
  cr_assert_eq(sb.st_uid, u, "owned by uid %u", (unsigned)sb.st_uid);
  run_client((client_job){u, NULL, NULL, 0, {NULL}});
  stop_daemon(sock);
}

/* The squat itself: another user made /tmp/tensord-<uid> first. */
TDT_TEST(trust, a_squatted_default_socket_directory_is_refused) {
  need_root();
  uid_t u = fresh_uid(1);
  snprintf(dflt_dir, sizeof(dflt_dir), "/tmp/tensord-%u", (unsigned)u);
  struct stat sb;
  cr_assert_neq(lstat(dflt_dir, &sb), 0, "%s exists already", dflt_dir);
  cr_assert_eq(mkdir(dflt_dir, 0777), 0);
  cr_assert_eq(chmod(dflt_dir, 0777), 0);
  cr_assert_eq(chown(dflt_dir, USER_A, USER_A), 0);
  make_place(NULL, 0, 0);
  pl.pid = spawn_daemon(u, NULL, NULL, NULL);
  int st = wait_exit();
  cr_assert_eq(st, 1, "tensord %s (%d)",
               st < 0 ? "started (killed after 10 s)" : "exited, not with 1",
               st);
  char sock[128];
  snprintf(sock, sizeof(sock), "%s/tensord.sock", dflt_dir);
  cr_assert_neq(lstat(sock, &sb), 0, "tensord bound %s", sock);
  FILE *f = fopen(pl.log, "r");
  char log[2048] = "";
  if (f != NULL) {
    log[fread(log, 1, sizeof(log) - 1, f)] = '\0';
    fclose(f);
  }
  cr_assert(strstr(log, dflt_dir) != NULL && strstr(log, "uid 4246") != NULL,
            "the log names neither the directory nor its owner: %s", log);
}

/* ---- the client's side ---- */

/* A daemon of uid B: clients of uid A and root refuse it, naming the
 * socket, its uid and pid and how to trust it; $TENSORD_TRUST_UID naming B
 * lets them in; a malformed list is refused; B itself needs nothing. */
TDT_TEST(trust, client_refuses_a_daemon_of_another_uid_unless_trusted) {
  need_root();
  make_place("b", 0755, USER_B);
  start_daemon(USER_B, pl.sock,
               (const char *const[]){"--socket-mode", "0666", NULL});
  char pid[32];
  snprintf(pid, sizeof(pid), "pid %d", (int)pl.pid);
  int fds = tdt_open_fds();
  run_client(
      (client_job){USER_A,
                   pl.sock,
                   NULL,
                   TD_EACCES,
                   {pl.sock, "uid 4247", pid, "TENSORD_TRUST_UID=4247", NULL}});
  run_client(
      (client_job){0, pl.sock, NULL, TD_EACCES, {pl.sock, "uid 4247", NULL}});
  run_client((client_job){USER_A, pl.sock, "1000,4247", 0, {NULL}});
  run_client((client_job){0, pl.sock, "4247", 0, {NULL}});
  run_client((client_job){USER_A, pl.sock, "4248", TD_EACCES, {pid, NULL}});
  run_client((client_job){USER_A,
                          pl.sock,
                          "42x7",
                          TD_EINVAL,
                          {"TENSORD_TRUST_UID", "'42x7'", NULL}});
  run_client((client_job){USER_A, pl.sock, "4247,", 0, {NULL}});
  run_client((client_job){USER_B, pl.sock, NULL, 0, {NULL}});
  /* And in this process: the refused connection leaves no fd behind. */
  td_client *c;
  unsetenv("TENSORD_TRUST_UID");
  cr_assert_eq(td_connect(pl.sock, &c), TD_EACCES);
  cr_assert_null(c);
  cr_assert_eq(tdt_open_fds(), fds, "a refused connection leaked an fd");
  stop_daemon(pl.sock);
}

/* Clients of other uids take a root daemon without being told. */
TDT_TEST(trust, clients_of_any_uid_accept_a_root_daemon) {
  need_root();
  make_place(NULL, 0, 0);
  start_daemon(0, pl.sock,
               (const char *const[]){"--socket-mode", "0666", NULL});
  run_client((client_job){USER_A, pl.sock, NULL, 0, {NULL}});
  run_client((client_job){USER_B, pl.sock, NULL, 0, {NULL}});
  stop_daemon(pl.sock);
}

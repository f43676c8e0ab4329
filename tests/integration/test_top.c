/* test_top.c: tensorctl top under a pseudo-terminal: it shows what tensord
 * holds, quits cleanly on q, Ctrl-C and SIGTERM (leaving the alternate
 * screen), survives a resize, says why without a terminal or a daemon. */
#include "cli.h"
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>

static tdt_daemon d;

TestSuite(top, .fini = tdt_cleanup, .timeout = 60);

#define ENTER "\033[?1049h"
#define LEAVE "\033[?1049l"

/* tensorctl top on a pty: its pid, the master's fd, and what it drew. */
typedef struct screen {
  pid_t pid;
  int fd;
  char buf[1 << 18];
  size_t len;
} screen;

static screen scr;

static void top_start(screen *s) {
  struct winsize ws = {.ws_row = 30, .ws_col = 100};
  memset(s, 0, sizeof(*s));
  fflush(NULL);
  s->pid = forkpty(&s->fd, NULL, NULL, &ws);
  cr_assert_geq(s->pid, 0, "forkpty: %s", strerror(errno));
  if (s->pid == 0) {
    unsetenv("TENSORD_SOCKET");
    execl(TENSORCTL_BIN, TENSORCTL_BIN, "--socket", d.sock, "top", "--interval",
          "100", (char *)NULL);
    _exit(127);
  }
  fcntl(s->fd, F_SETFD, FD_CLOEXEC);
}

/* Reads what top draws until needle shows after from (or, needle NULL,
 * until it closes the terminal); 15 s at most. Returns whether it did. */
static int top_read(screen *s, size_t from, const char *needle) {
  for (int waited = 0; waited < 15000;) {
    s->buf[s->len] = '\0';
    if (needle != NULL && strstr(s->buf + from, needle) != NULL)
      return 1;
    struct pollfd p = {s->fd, POLLIN, 0};
    int n = poll(&p, 1, 100);
    if (n == 0) {
      waited += 100;
      continue;
    }
    if (s->len + 4096 >= sizeof(s->buf)) /* keep the tail */
    {
      memmove(s->buf, s->buf + s->len / 2, s->len - s->len / 2);
      s->len -= s->len / 2;
      from = 0;
    }
    ssize_t k = read(s->fd, s->buf + s->len, sizeof(s->buf) - s->len - 1);
    if (k <= 0) /* EIO: the child is gone and the terminal with it */
      return needle == NULL;
    s->len += (size_t)k;
  }
  return 0;
}

/* Waits for top to end after it was told to; returns its exit status. */
static int top_end(screen *s) {
  cr_assert(top_read(s, 0, NULL), "top did not close its terminal");
  s->buf[s->len] = '\0';
  int st = tdt_wait(s->pid);
  close(s->fd);
  return st;
}

/* A storage with a key, for top to show. */
static td_client *c;
static td_storage *st;

static void make_storage(void) {
  c = tdt_connect(&d);
  cr_assert_eq(td_storage_create(c, 3 << 20, &st), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "top/visible", st, NULL), 0);
}

static void drop_storage(void) {
  td_storage_release(st);
  td_close(c);
}

static void shows_and_quits_on(const char *keys) {
  tdt_start(&d, NULL);
  make_storage();
  top_start(&scr);
  cr_assert(top_read(&scr, 0, "top/visible"),
            "top never showed the storage; it drew: %s", scr.buf);
  cr_assert_not_null(strstr(scr.buf, ENTER), "no alternate screen");
  cr_assert_not_null(strstr(scr.buf, "LARGEST STORAGES"));
  cr_assert_not_null(strstr(scr.buf, "3.0 MiB"));
  cr_assert_not_null(strstr(scr.buf, "BUSIEST CLIENTS"));
  cr_assert_not_null(strstr(scr.buf, "requests "));
  /* A resize redraws, and nothing breaks. */
  size_t mark = scr.len;
  struct winsize ws = {.ws_row = 12, .ws_col = 60};
  ioctl(scr.fd, TIOCSWINSZ, &ws);
  cr_assert(top_read(&scr, mark, "LARGEST STORAGES"), "no redraw");
  mark = scr.len;
  cr_assert_eq(write(scr.fd, keys, strlen(keys)), (ssize_t)strlen(keys));
  int status = top_end(&scr);
  cr_assert_eq(status, 0, "top exited %d after '%s'", status, keys);
  cr_assert_not_null(strstr(scr.buf + mark, LEAVE),
                     "the alternate screen was not left");
  drop_storage();
}

TDT_TEST(top, shows_storages_and_quits_on_q) {
  shows_and_quits_on("q");
}

TDT_TEST(top, quits_on_capital_q) {
  shows_and_quits_on("Q");
}

TDT_TEST(top, quits_on_ctrl_c) {
  shows_and_quits_on("\003");
}

TDT_TEST(top, quits_on_sigterm) {
  tdt_start(&d, NULL);
  top_start(&scr);
  cr_assert(top_read(&scr, 0, "BUSIEST CLIENTS"), "drew: %s", scr.buf);
  size_t mark = scr.len;
  kill(scr.pid, SIGTERM);
  cr_assert_eq(top_end(&scr), 0);
  cr_assert_not_null(strstr(scr.buf + mark, LEAVE));
}

TDT_TEST(top, says_why_when_tensord_goes) {
  tdt_start(&d, NULL);
  top_start(&scr);
  cr_assert(top_read(&scr, 0, "BUSIEST CLIENTS"), "drew: %s", scr.buf);
  size_t mark = scr.len;
  kill(d.pid, SIGTERM);
  int status = top_end(&scr);
  cr_assert_eq(status, 1, "top exited %d with tensord gone", status);
  char *leave = strstr(scr.buf + mark, LEAVE);
  cr_assert_not_null(leave, "the alternate screen was not left");
  cr_assert_not_null(strstr(leave, "tensorctl top: "),
                     "no message after the screen was left: %s", leave);
  tdt_stopped(&d);
}

TDT_TEST(top, needs_a_terminal_or_once) {
  tdt_start(&d, NULL);
  make_storage();
  /* A key may hold control characters: they must not reach the terminal. */
  td_storage *loud;
  cr_assert_eq(td_storage_create(c, 4 << 20, &loud), 0);
  cr_assert_eq(td_publish(c, "top/\033[31mred", loud, NULL), 0, "%s",
               td_last_error(c));
  tdt_run_result r;
  tdt_cli_run(
      (const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "top", NULL},
      &r);
  cr_assert_eq(r.status, 1);
  cr_assert_not_null(strstr(r.err, "stdout is not a terminal"), "%s", r.err);
  cr_assert_null(strstr(r.out, "\033["), "escape sequences on a pipe");
  cr_assert_null(strstr(r.err, "\033["), "escape sequences on stderr");
  tdt_run_free(&r);
  /* --once: one plain frame. */
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "top",
                                    "--once", "--interval", "50", NULL},
              &r);
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "top/visible"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "top/?[31mred"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "requests "), "%s", r.out);
  cr_assert_null(strstr(r.out, "\033["), "escape sequences on a pipe");
  cr_assert_null(strstr(r.err, "\033["), "escape sequences on stderr");
  tdt_run_free(&r);
  /* Bad intervals and options. */
  static const char *const bad[] = {"0", "abc", "-5", "99999999999"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "top",
                                      "--interval", bad[i], NULL},
                &r);
    cr_assert_eq(r.status, 2, "--interval %s: exit %d", bad[i], r.status);
    cr_assert_not_null(strstr(r.err, "--interval"), "%s", r.err);
    tdt_run_free(&r);
  }
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "top",
                                    "--interval", NULL},
              &r);
  cr_assert_eq(r.status, 2);
  tdt_run_free(&r);
  td_storage_release(loud);
  drop_storage();
}

/* The busiest clients are named by the name each connected with, whole
 * (the last column), control characters shown as '?'. */
TDT_TEST(top, clients_show_the_name_they_connected_with) {
  tdt_start(&d, NULL);
  make_storage(); /* c: the default name, the program's (test_top) */
  td_client *named[2];
  static const char *const names[2] = {"torch.distributed.run worker 11",
                                       "x\033]0;t\007y"};
  for (int i = 0; i < 2; i++) {
    td_connect_opts o = {.name = names[i]};
    cr_assert_eq(td_connect_ex(d.sock, &o, &named[i]), 0, "%s",
                 td_last_error(NULL));
  }
  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "top",
                                    "--once", "--interval", "50", NULL},
              &r);
  cr_assert_eq(r.status, 0, "%s", r.err);
  const char *busiest = strstr(r.out, "BUSIEST CLIENTS\n");
  cr_assert_not_null(busiest, "%s", r.out);
  cr_assert(strstr(busiest, "REQ/S") < strstr(busiest, "NAME"),
            "NAME is the last column: %s", busiest);
  char want[64];
  snprintf(want, sizeof(want), "  torch.distributed.run worker 11\n");
  cr_assert_not_null(strstr(busiest, want), "%s", r.out);
  cr_assert_not_null(strstr(busiest, "  x?]0;t?y\n"), "%s", r.out);
  cr_assert_not_null(strstr(busiest, "  test_top\n"), "%s", r.out);
  cr_assert_null(strchr(r.out, '\033'), "an escape on the pipe");
  tdt_run_free(&r);
  for (int i = 0; i < 2; i++)
    td_close(named[i]);
  drop_storage();
}

/* top.c: tensorctl top: the largest storages, the busiest clients and the
 * request rate, redrawn on the terminal's alternate screen until q or
 * Ctrl-C. Rates come from two samples of td_metrics_get. */
#include "top.h"

#include "clitext.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define ENTER_SCREEN "\033[?1049h\033[?25l"
#define LEAVE_SCREEN "\033[?25h\033[?1049l"
#define LARGEST_MAX 64

static volatile sig_atomic_t quit_signal; /* SIGINT or SIGTERM came */
static volatile sig_atomic_t resized;     /* SIGWINCH came */
static struct termios saved;              /* stdin's, to restore */
static int saved_valid;
static int screen_on; /* the alternate screen is entered */

static void on_signal(int sig) {
  if (sig == SIGWINCH)
    resized = 1;
  else
    quit_signal = sig;
}

/* Puts the terminal back as it was: idempotent, and safe from atexit. */
static void restore(void) {
  if (screen_on) {
    screen_on = 0;
    ssize_t n = write(STDOUT_FILENO, LEAVE_SCREEN, sizeof(LEAVE_SCREEN) - 1);
    (void)n;
  }
  if (saved_valid) {
    saved_valid = 0;
    tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved);
  }
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Uptime as ls's age, but "0m05s" under a minute, as the header has
 * always shown it. Returns buf. */
static char *uptime(int64_t ms, char *buf, size_t len) {
  if (ms < 60000) {
    snprintf(buf, len, "0m%02" PRId64 "s", ms < 0 ? 0 : ms / 1000);
    return buf;
  }
  return td__cli_age(ms, buf, len);
}

/* A client and its request rate between two samples. */
typedef struct row {
  const td_client_stat *c;
  double rate;
} row;

static int by_rate(const void *a, const void *b) {
  const row *x = a, *y = b;
  if (x->rate != y->rate)
    return x->rate < y->rate ? 1 : -1;
  return x->c->requests < y->c->requests   ? 1
         : x->c->requests > y->c->requests ? -1
                                           : 0;
}

/* Appends a line to the frame, cut to cols; counts it against rows. */
typedef struct frame {
  char *p;
  size_t len, cap;
  int cols, rows, lines;
  int tty;
} frame;

static void line(frame *f, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void line(frame *f, const char *fmt, ...) {
  if (f->tty && f->lines >= f->rows)
    return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (n < 0)
    return;
  if ((size_t)n >= sizeof(buf))
    n = sizeof(buf) - 1;
  if (f->tty && n > f->cols)
    n = f->cols;
  size_t need = f->len + (size_t)n + 8;
  if (need > f->cap) {
    size_t cap = need * 2;
    char *p = realloc(f->p, cap);
    if (p == NULL)
      return;
    f->p = p;
    f->cap = cap;
  }
  memcpy(f->p + f->len, buf, (size_t)n);
  f->len += (size_t)n;
  /* On the screen: clear the rest of the line; the last has no newline,
   * so that the screen does not scroll. */
  if (f->tty) {
    memcpy(f->p + f->len, "\033[K", 3);
    f->len += 3;
  }
  f->lines++;
  if (!f->tty || f->lines < f->rows)
    f->p[f->len++] = f->tty ? '\r' : '\n';
  if (f->tty && f->lines < f->rows)
    f->p[f->len++] = '\n';
}

/* Draws cur, with rates since prev (NULL: none yet) over dt_ms. */
static void draw(const td_metrics *cur, const td_metrics *prev, int64_t dt_ms,
                 int tty) {
  frame f = {NULL, 0, 0, 80, 24, 0, tty};
  struct winsize ws;
  if (tty && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 &&
      ws.ws_row > 0) {
    f.cols = ws.ws_col;
    f.rows = ws.ws_row;
  }
  char a[32], b[32], u[32], rate[32] = "-";
  double secs = dt_ms > 0 ? (double)dt_ms / 1000.0 : 0;
  if (prev != NULL && secs > 0)
    snprintf(rate, sizeof(rate), "%.1f",
             (double)(cur->requests - prev->requests) / secs);
  line(&f,
       "tensord up %s  clients %" PRIu64 "  storages %" PRIu64
       "  used %s / %s  requests %s/s",
       uptime(cur->uptime_ms, u, sizeof(u)), cur->clients_total, cur->storages,
       td__cli_bytes(cur->bytes_used, a, sizeof(a)),
       td__cli_bytes(cur->capacity, b, sizeof(b)), rate);
  line(&f, "%s", "");
  line(&f, "LARGEST STORAGES");
  line(&f, "%10s %10s %5s %5s %8s %8s  %s", "ID", "SIZE", "REFS", "KEYS",
       "OWNER", "PID", "KEY");
  /* Room for the clients too: split what the screen has. */
  size_t nl = cur->nlargest;
  if (tty) {
    int room = (f.rows - 4 - 3) / 2;
    if (room < 1)
      room = 1;
    if (nl > (size_t)room)
      nl = (size_t)room;
  }
  for (size_t i = 0; i < nl; i++) {
    const td_storage_info *s = &cur->largest[i];
    char key[256];
    line(&f, "%10" PRIu64 " %10s %5u %5zu %8u %8d  %s", s->id,
         td__cli_bytes(s->nbytes, a, sizeof(a)), s->refs, s->nkeys_total,
         s->owner_uid, s->owner_pid,
         td__cli_printable(s->nkeys > 0 ? s->keys[0] : "", key, sizeof(key)));
  }
  line(&f, "%s", "");
  line(&f, "BUSIEST CLIENTS");
  /* The name last and whole (up to TD_CLIENT_NAME_MAX): "train.py worker
   * 11" must not lose its number to a column. */
  line(&f, "%8s %9s %6s %10s  %s", "PID", "REQ/S", "REFS", "BYTES", "NAME");
  row *rows = calloc(cur->nclients ? cur->nclients : 1, sizeof(*rows));
  if (rows != NULL) {
    for (size_t i = 0; i < cur->nclients; i++) {
      const td_client_stat *c = &cur->clients[i];
      rows[i].c = c;
      rows[i].rate = -1; /* not in the previous sample */
      for (size_t j = 0; prev != NULL && j < prev->nclients; j++)
        if (prev->clients[j].pid == c->pid && secs > 0 &&
            prev->clients[j].requests <= c->requests) {
          rows[i].rate =
              (double)(c->requests - prev->clients[j].requests) / secs;
          break;
        }
    }
    qsort(rows, cur->nclients, sizeof(*rows), by_rate);
    for (size_t i = 0; i < cur->nclients; i++) {
      const td_client_stat *c = rows[i].c;
      char r[32] = "-";
      if (rows[i].rate >= 0)
        snprintf(r, sizeof(r), "%.1f", rows[i].rate);
      char name[sizeof(c->name)];
      line(&f, "%8d %9s %6" PRIu64 " %10s  %s", c->pid, r, c->refs,
           td__cli_bytes(c->bytes_held, a, sizeof(a)),
           c->name[0] ? td__cli_printable(c->name, name, sizeof(name)) : "-");
    }
    free(rows);
  }
  if (f.p == NULL)
    return;
  if (tty) {
    /* Home, the frame, then clear what an older, longer frame left. */
    fputs("\033[H", stdout);
    fwrite(f.p, 1, f.len, stdout);
    fputs("\033[J", stdout);
  } else {
    fwrite(f.p, 1, f.len, stdout);
  }
  fflush(stdout);
  free(f.p);
}

/* How many storages to ask for: what fits on the screen. */
static unsigned want_largest(int tty) {
  struct winsize ws;
  if (!tty)
    return 10;
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) < 0 || ws.ws_row == 0)
    return 10;
  unsigned n = ws.ws_row / 2;
  return n > LARGEST_MAX ? LARGEST_MAX : n;
}

/* Waits up to ms for a key or a signal. Returns 1 to quit, 0 otherwise. */
static int wait_input(int ms) {
  int64_t end = now_ms() + ms;
  for (;;) {
    if (quit_signal)
      return 1;
    if (resized)
      return 0;
    int64_t left = end - now_ms();
    if (left <= 0)
      return 0;
    struct pollfd p = {STDIN_FILENO, POLLIN, 0};
    int n = poll(&p, 1, (int)left);
    if (n < 0 && errno != EINTR)
      return 0;
    if (n > 0 && (p.revents & (POLLHUP | POLLERR | POLLNVAL)) &&
        !(p.revents & POLLIN))
      return 1; /* the terminal went away */
    if (n > 0 && (p.revents & POLLIN)) {
      char buf[64];
      ssize_t r = read(STDIN_FILENO, buf, sizeof(buf));
      if (r == 0)
        return 1;
      for (ssize_t i = 0; i < r; i++)
        if (buf[i] == 'q' || buf[i] == 'Q' || buf[i] == 0x03)
          return 1;
    }
  }
}

int td__top(td_client *c, int interval_ms, int once) {
  int tty = !once;
  if (tty && !isatty(STDOUT_FILENO)) {
    fprintf(stderr, "tensorctl top: stdout is not a terminal; use "
                    "'tensorctl top --once' for one plain frame\n");
    return TD_EINVAL;
  }
  td_metrics *prev = NULL, *cur = NULL;
  int64_t prev_ms = 0;
  int err = 0;
  if (tty) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal; /* no SA_RESTART: poll returns EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sigaction(SIGWINCH, &sa, NULL);
    atexit(restore);
    if (isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &saved) == 0) {
      struct termios raw = saved;
      raw.c_lflag &= ~(tcflag_t)(ECHO | ICANON);
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      saved_valid = 1;
      tcsetattr(STDIN_FILENO, TCSAFLUSH, &raw);
    }
    fputs(ENTER_SCREEN, stdout);
    fflush(stdout);
    screen_on = 1;
  }
  for (;;) {
    err = td_metrics_get(c, want_largest(tty), TD_METRICS_NO_TEXT, &cur);
    if (err < 0)
      break;
    int64_t t = now_ms();
    /* --once draws the second sample: a rate needs two. */
    if (!once || prev != NULL)
      draw(cur, prev, t - prev_ms, tty);
    int done = once && prev != NULL;
    td_metrics_free(prev);
    prev = cur;
    cur = NULL;
    prev_ms = t;
    if (done)
      break;
    if (once) {
      usleep((useconds_t)interval_ms * 1000);
      continue;
    }
    resized = 0;
    if (wait_input(interval_ms))
      break;
  }
  td_metrics_free(prev);
  restore();
  if (err < 0)
    fprintf(stderr, "tensorctl top: %s\n", td_last_error(c));
  return err;
}

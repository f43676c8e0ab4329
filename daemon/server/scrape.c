/* scrape.c: tensord --metrics PATH|ADDR: serves the metrics text (metrics.c)
 * over minimal HTTP/1.x, one request per connection, on a Unix socket or a
 * loopback TCP port. Everything runs on the loop through libuv's streams:
 * no fd travels here. */
#include "scrape.h"

#include "common.h"
#include "log.h"
#include "metrics.h"
#include "server.h"
#include "sock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* One scraper's connection: it sends a request head, gets one reply, and
 * is closed. */
struct td__scraper {
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } h;
  uv_timer_t timer; /* the whole exchange: sc->timeout_ms at most */
  uv_write_t write;
  uv_shutdown_t shutdown;
  td__scrape *sc;
  int nhandles; /* not yet closed: the last to close frees the scraper */
  int closing;
  int line;     /* its request line has come whole (a '\n' arrived) */
  int answered; /* the reply is queued: what comes now is discarded */
  char *reply;
  size_t len; /* bytes of head[] received */
  char head[TD__SCRAPE_HEAD_MAX];
  td__scraper *prev, *next;
};

static void scraper_closed(uv_handle_t *h) {
  td__scraper *s = h->data;
  if (--s->nhandles > 0)
    return;
  free(s->reply);
  free(s);
}

/* Closes s (once); a write in flight is cancelled. */
static void scraper_close(td__scraper *s) {
  if (s->closing)
    return;
  s->closing = 1;
  td__scrape *sc = s->sc;
  if (s->prev)
    s->prev->next = s->next;
  else
    sc->scrapers = s->next;
  if (s->next)
    s->next->prev = s->prev;
  sc->nscrapers--;
  s->h.handle.data = s->timer.data = s;
  uv_close(&s->h.handle, scraper_closed);
  uv_close((uv_handle_t *)&s->timer, scraper_closed);
}

static void on_timeout(uv_timer_t *t) {
  td__scraper *s = t->data;
  td__debug("metrics: a scraper on %s took more than %llu ms; closing it",
            s->sc->where, (unsigned long long)s->sc->timeout_ms);
  scraper_close(s);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  (void)status;
  scraper_close(req->data);
}

static void on_written(uv_write_t *req, int status) {
  td__scraper *s = req->data;
  if (s->closing)
    return;
  if (status < 0) {
    td__debug("metrics: writing to a scraper on %s: %s", s->sc->where,
              uv_strerror(status));
    scraper_close(s);
    return;
  }
  /* The reply is with the kernel: end our side, then close. */
  s->shutdown.data = s;
  if (uv_shutdown(&s->shutdown, &s->h.stream, on_shutdown) < 0)
    scraper_close(s);
}

/* Queues a reply of code with body (len bytes; HEAD: headers only). */
static void reply(td__scraper *s, int code, const char *reason,
                  const char *extra, const char *body, size_t len, int head) {
  char hdr[320];
  int n = snprintf(hdr, sizeof(hdr),
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: "
                   "%zu\r\nConnection: close\r\n%s\r\n",
                   code, reason,
                   code == 200 ? CONTENT_TYPE : "text/plain; charset=utf-8",
                   len, extra ? extra : "");
  size_t blen = head ? 0 : len;
  s->reply = malloc((size_t)n + blen);
  if (s->reply == NULL) {
    td__warn("metrics: out of memory answering a scraper on %s", s->sc->where);
    scraper_close(s);
    return;
  }
  memcpy(s->reply, hdr, (size_t)n);
  if (blen)
    memcpy(s->reply + n, body, blen);
  s->answered = 1;
  uv_buf_t b = uv_buf_init(s->reply, (unsigned)((size_t)n + blen));
  s->write.data = s;
  if (uv_write(&s->write, &s->h.stream, &b, 1, on_written) < 0)
    scraper_close(s);
}

static void error_reply(td__scraper *s, int code, const char *reason,
                        const char *extra, const char *why) {
  char body[256];
  int n = snprintf(body, sizeof(body), "%s\n", why);
  reply(s, code, reason, extra, body, (size_t)n, 0);
}

/* Answers the request head in s->head[0..s->len). */
static void answer(td__scraper *s, int complete) {
  if (!complete) {
    error_reply(s, 431, "Request Header Fields Too Large", NULL,
                "the request head exceeds 4096 bytes");
    return;
  }
  char *eol = memchr(s->head, '\n', s->len);
  *eol = '\0';
  if (eol > s->head && eol[-1] == '\r')
    eol[-1] = '\0';
  /* METHOD SP TARGET SP HTTP/1.x */
  char *method = s->head;
  char *target = strchr(method, ' ');
  char *version = target ? strchr(target + 1, ' ') : NULL;
  if (target == NULL || version == NULL ||
      strncmp(version + 1, "HTTP/1.", 7) != 0) {
    error_reply(s, 400, "Bad Request", NULL,
                "not an HTTP/1.x request line (GET /metrics HTTP/1.1)");
    return;
  }
  *target++ = '\0';
  *version = '\0';
  int head = strcmp(method, "HEAD") == 0;
  if (strcmp(method, "GET") != 0 && !head) {
    error_reply(s, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n",
                "only GET and HEAD are served");
    return;
  }
  target[strcspn(target, "?#")] = '\0';
  if (strcmp(target, "/metrics") != 0 && strcmp(target, "/") != 0) {
    error_reply(s, 404, "Not Found", NULL, "the metrics are at /metrics");
    return;
  }
  td__server *srv = s->sc->srv;
  srv->metrics.scrapes++; /* counted in the page it serves */
  size_t len = 0;
  char *text = td__metrics_render(srv, &len);
  if (text == NULL) {
    error_reply(s, 503, "Service Unavailable", NULL, "out of memory");
    return;
  }
  reply(s, 200, "OK", NULL, text, len, head);
  free(text);
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
  (void)hint;
  td__scraper *s = h->data;
  /* After the answer, whatever comes is read into head[] and dropped. */
  if (s->answered)
    *buf = uv_buf_init(s->head, sizeof(s->head));
  else
    *buf = uv_buf_init(s->head + s->len, (unsigned)(sizeof(s->head) - s->len));
}

/* Whether head[0..len) holds a whole request head (an empty line ends it). */
static int head_complete(const char *p, size_t len) {
  for (size_t i = 1; i < len; i++)
    if (p[i] == '\n' &&
        (p[i - 1] == '\n' || (i >= 2 && p[i - 1] == '\r' && p[i - 2] == '\n')))
      return 1;
  return 0;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf) {
  (void)buf;
  td__scraper *s = st->data;
  if (s->closing || n == 0)
    return;
  if (n < 0) {
    /* Gone, or done sending: a scraper that half-closes after its request
     * still gets the reply (on_written closes). */
    if (n == UV_EOF && s->answered)
      uv_read_stop(st);
    else
      scraper_close(s);
    return;
  }
  if (s->answered)
    return;
  if (!s->line && memchr(s->head + s->len, '\n', (size_t)n) != NULL)
    s->line = 1;
  s->len += (size_t)n;
  int complete = head_complete(s->head, s->len);
  if (complete || s->len == sizeof(s->head)) {
    answer(s, complete);
    return;
  }
}

/* How far s has come, for choosing whom a newcomer displaces: 0 has not
 * sent a whole request line (nothing yet, or part of one) and has no bytes
 * waiting to be read; 1 has sent its request line (its headers may still be
 * coming) or has bytes waiting; 2 is being answered, and is never closed for
 * a newcomer. */
static int progress(const td__scraper *s) {
  if (s->answered)
    return 2;
  if (s->line)
    return 1;
  /* What the kernel holds for it counts: its request may have come in the
   * same turn of the loop as the newcomers, before its read callback. */
  uv_os_fd_t fd;
  char b;
  if (uv_fileno(&s->h.handle, &fd) == 0 &&
      recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0)
    return 1;
  return 0;
}

/* The scraper to close so that newcomer may be served: the oldest of those
 * that have come least far (progress), none of them being answered.
 * Returns NULL when every other scraper is being answered. */
static td__scraper *displaced(td__scrape *sc, const td__scraper *newcomer) {
  td__scraper *victim = NULL;
  int least = 2;
  /* The list is newest first: the last of the least advanced is the
   * oldest. */
  for (td__scraper *s = sc->scrapers; s != NULL; s = s->next) {
    if (s == newcomer)
      continue;
    int p = progress(s);
    if (p <= least && p < 2) {
      victim = s;
      least = p;
    }
  }
  return victim;
}

/* Logs, once a minute at most (a crowd must not flood the log), what
 * sc->displaced and sc->refused counted since the last time. */
static void log_crowd(td__scrape *sc, uint64_t now) {
  if (sc->crowd_ms != 0 && now - sc->crowd_ms < 60000)
    return;
  if (sc->displaced > 0)
    td__warn("metrics: more than %u scrapers at once on %s: closed the "
             "oldest of those that had not sent a request, %llu time(s), to "
             "serve newcomers",
             TD__SCRAPERS_MAX, sc->where, (unsigned long long)sc->displaced);
  if (sc->refused > 0)
    td__warn("metrics: closed %llu new scraper(s) on %s: all %u served at "
             "once were being answered",
             (unsigned long long)sc->refused, sc->where, TD__SCRAPERS_MAX);
  sc->crowd_ms = now;
  sc->displaced = sc->refused = 0;
}

static void on_connection(uv_stream_t *server, int status) {
  td__scrape *sc = server->data;
  if (status < 0) {
    td__warn("metrics: accepting on %s: %s", sc->where, uv_strerror(status));
    return;
  }
  td__scraper *s = calloc(1, sizeof(*s));
  if (s == NULL) {
    td__warn("metrics: out of memory accepting a scraper on %s", sc->where);
    return; /* it stays in the backlog until the next try */
  }
  s->sc = sc;
  int err = sc->tcp ? uv_tcp_init(server->loop, &s->h.tcp)
                    : uv_pipe_init(server->loop, &s->h.pipe, 0);
  if (err < 0) {
    free(s);
    return;
  }
  uv_timer_init(server->loop, &s->timer);
  s->nhandles = 2;
  s->h.handle.data = s->timer.data = s;
  s->next = sc->scrapers;
  if (sc->scrapers)
    sc->scrapers->prev = s;
  sc->scrapers = s;
  sc->nscrapers++;
  err = uv_accept(server, &s->h.stream);
  if (err < 0) {
    scraper_close(s);
    return;
  }
  if (sc->nscrapers > TD__SCRAPERS_MAX) {
    /* A crowd that sends nothing must not lock scrapers out: the newcomer
     * takes the place of the oldest that has come least far, unless every
     * other one is being answered. */
    td__scraper *victim = displaced(sc, s);
    if (victim != NULL) {
      td__debug("metrics: closing a scraper on %s that has %s, to serve a "
                "new one (%u at most at once)",
                sc->where,
                victim->line ? "not finished its request"
                             : "not sent a request line",
                TD__SCRAPERS_MAX);
      sc->displaced++;
      scraper_close(victim);
    } else {
      sc->refused++;
      scraper_close(s);
    }
    log_crowd(sc, uv_now(server->loop));
    if (victim == NULL)
      return;
  }
  uv_timer_start(&s->timer, on_timeout, sc->timeout_ms, 0);
  if (uv_read_start(&s->h.stream, on_alloc, on_read) < 0)
    scraper_close(s);
}

int td__scrape_parse(const char *addr, struct sockaddr_storage *ss, char *msg,
                     size_t len) {
  char host[64];
  const char *colon;
  memset(ss, 0, sizeof(*ss));
  if (addr[0] == '[') {
    const char *end = strchr(addr, ']');
    if (end == NULL || end[1] != ':')
      return td__msg(msg, len, TD_EINVAL,
                     "--metrics %s: write an IPv6 address as [::1]:PORT", addr);
    snprintf(host, sizeof(host), "%.*s", (int)(end - addr - 1), addr + 1);
    colon = end + 1;
  } else {
    colon = strrchr(addr, ':');
    if (colon == NULL)
      return td__msg(msg, len, TD_EINVAL,
                     "--metrics %s: neither a path (with a '/') nor "
                     "HOST:PORT",
                     addr);
    snprintf(host, sizeof(host), "%.*s", (int)(colon - addr), addr);
    if (strchr(host, ':') != NULL)
      return td__msg(msg, len, TD_EINVAL,
                     "--metrics %s: write an IPv6 address as [::1]:PORT", addr);
  }
  char *end;
  errno = 0;
  unsigned long port = strtoul(colon + 1, &end, 10);
  if (colon[1] < '0' || colon[1] > '9' || *end != '\0' || errno != 0 ||
      port > 65535)
    return td__msg(msg, len, TD_EINVAL,
                   "--metrics %s: port '%s' is not a number from 0 to 65535",
                   addr, colon + 1);
  struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
  if (strcmp(host, "localhost") == 0)
    snprintf(host, sizeof(host), "127.0.0.1");
  if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
    if ((ntohl(v4->sin_addr.s_addr) >> 24) != 127)
      goto not_loopback;
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)port);
    return 0;
  }
  if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
    if (!IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr))
      goto not_loopback;
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)port);
    return 0;
  }
  return td__msg(msg, len, TD_EINVAL,
                 "--metrics %s: '%s' is not an IP address (use 127.0.0.1, "
                 "[::1] or localhost)",
                 addr, host);
not_loopback:
  return td__msg(msg, len, TD_EINVAL,
                 "--metrics %s: %s is not a loopback address; tensord serves "
                 "metrics on the loopback only (127.0.0.1, [::1] or "
                 "localhost) or on a Unix socket (a PATH with a '/')",
                 addr, host);
}

/* Removes a socket a dead tensord left at path; refuses a live one or
 * anything that is not a socket. */
static int clear_stale(const char *path) {
  struct stat st;
  if (lstat(path, &st) < 0)
    return errno == ENOENT ? 0 : -errno;
  if (!S_ISSOCK(st.st_mode)) {
    td__error("--metrics %s: exists and is not a socket; not replacing it",
              path);
    return TD_EEXIST;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
  int live = connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
  close(fd);
  if (live) {
    td__error("--metrics %s: something is already listening there", path);
    return TD_EEXIST;
  }
  unlink(path);
  return 0;
}

int td__scrape_open(td__scrape *sc, td__server *srv, const char *spec, int mode,
                    uint64_t timeout_ms) {
  memset(sc, 0, sizeof(*sc));
  sc->srv = srv;
  sc->timeout_ms = timeout_ms;
  int err;
  if (strchr(spec, '/') != NULL) {
    if (strlen(spec) >= sizeof(sc->path)) {
      td__error("--metrics %s: a socket path has at most %zu bytes", spec,
                sizeof(sc->path) - 1);
      return TD_ENAMETOOLONG;
    }
    /* As the main socket's: a directory someone else may write would let
     * them replace the socket (or, between a bind and a chmod, put a
     * symbolic link where it was). */
    err = td__socket_dir(spec, "metrics socket", "--metrics");
    if (err < 0)
      return err;
    err = clear_stale(spec);
    if (err < 0)
      return err;
    int fd = td__socket_bind(spec, (mode_t)(mode >= 0 ? mode : 0600));
    if (fd < 0) {
      td__error("--metrics %s: bind: %s", spec, strerror(-fd));
      return fd;
    }
    uv_pipe_init(srv->loop, &sc->listen.pipe, 0);
    sc->open = 1;
    snprintf(sc->path, sizeof(sc->path), "%s", spec);
    snprintf(sc->where, sizeof(sc->where), "%s", spec);
    err = uv_pipe_open(&sc->listen.pipe, fd);
    if (err < 0) {
      close(fd); /* not the handle's: it failed to take it */
      td__error("--metrics %s: %s", spec, uv_strerror(err));
      goto fail;
    }
  } else {
    struct sockaddr_storage ss;
    char msg[256];
    err = td__scrape_parse(spec, &ss, msg, sizeof(msg));
    if (err < 0) {
      td__error("%s", msg);
      return err;
    }
    sc->tcp = 1;
    uv_tcp_init(srv->loop, &sc->listen.tcp);
    sc->open = 1;
    err = uv_tcp_bind(&sc->listen.tcp, (struct sockaddr *)&ss, 0);
    int namelen = sizeof(ss);
    if (err == 0)
      err =
          uv_tcp_getsockname(&sc->listen.tcp, (struct sockaddr *)&ss, &namelen);
    if (err < 0) {
      td__error("--metrics %s: bind: %s", spec, uv_strerror(err));
      goto fail;
    }
    char ip[INET6_ADDRSTRLEN];
    if (ss.ss_family == AF_INET6) {
      struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
      inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof(ip));
      snprintf(sc->where, sizeof(sc->where), "[%s]:%u", ip,
               (unsigned)ntohs(v6->sin6_port));
    } else {
      struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
      inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof(ip));
      snprintf(sc->where, sizeof(sc->where), "%s:%u", ip,
               (unsigned)ntohs(v4->sin_port));
    }
  }
  sc->listen.handle.data = sc;
  err = uv_listen(&sc->listen.stream, TD__SCRAPERS_MAX, on_connection);
  if (err < 0) {
    td__error("--metrics %s: listen: %s", spec, uv_strerror(err));
    goto fail;
  }
  td__info("metrics on %s%s", sc->tcp ? "http://" : "", sc->where);
  return 0;

fail:
  td__scrape_close(sc);
  return err;
}

int td__scrape_adopt(td__scrape *sc, td__server *srv, int fd, int tcp,
                     const char *path, const char *where, uint64_t timeout_ms) {
  memset(sc, 0, sizeof(*sc));
  sc->srv = srv;
  sc->timeout_ms = timeout_ms;
  sc->tcp = tcp;
  snprintf(sc->where, sizeof(sc->where), "%s", where);
  int err;
  if (tcp) {
    uv_tcp_init(srv->loop, &sc->listen.tcp);
    err = uv_tcp_open(&sc->listen.tcp, fd);
  } else {
    uv_pipe_init(srv->loop, &sc->listen.pipe, 0);
    err = uv_pipe_open(&sc->listen.pipe, fd);
  }
  sc->open = 1;
  if (err < 0) {
    close(fd); /* not the handle's: it failed to take it */
    td__error("--metrics %s: taking the endpoint over: %s", where,
              uv_strerror(err));
    td__scrape_close(sc);
    return err;
  }
  sc->listen.handle.data = sc;
  err = uv_listen(&sc->listen.stream, TD__SCRAPERS_MAX, on_connection);
  if (err < 0) {
    td__error("--metrics %s: listen: %s", where, uv_strerror(err));
    td__scrape_close(sc);
    return err;
  }
  if (!tcp)
    snprintf(sc->path, sizeof(sc->path), "%s", path);
  td__info("metrics on %s%s (taken over)", tcp ? "http://" : "", sc->where);
  return 0;
}

void td__scrape_close(td__scrape *sc) {
  if (!sc->open)
    return;
  sc->open = 0;
  uv_close(&sc->listen.handle, NULL);
  if (sc->path[0] && unlink(sc->path) < 0 && errno != ENOENT)
    td__warn("unlink(%s): %s", sc->path, strerror(errno));
  while (sc->scrapers != NULL)
    scraper_close(sc->scrapers);
}

/* test_metrics.c: tensorctl metrics' text (well-formed, right, monotonic) and
 * tensord --metrics: HTTP over a Unix socket and a loopback TCP port, bad
 * requests, scrapers that stall, leave or never read, refused addresses. */
#include "cli.h"
#include "harness.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

static tdt_daemon d;

TestSuite(metrics, .fini = tdt_cleanup, .timeout = 60);

/* ---- the text format ---- */

/* One sample: its series (name and labels, as written) and value. */
typedef struct sample {
  char series[256];
  char family[128]; /* the # TYPE name it belongs to */
  char type[16];
  double value;
} sample;

typedef struct exposition {
  sample *s;
  size_t n;
} exposition;

static int name_char(int c, int first) {
  return isalpha(c) || c == '_' || c == ':' || (!first && isdigit(c));
}

/* Parses text, asserting every line is a # HELP, a # TYPE or a sample
 * "name{labels} value" of a family typed before it. */
static void parse(const char *text, exposition *e) {
  char types[128][128], kinds[128][16];
  size_t ntypes = 0, cap = 256;
  e->n = 0;
  e->s = malloc(cap * sizeof(*e->s));
  cr_assert_not_null(e->s);
  cr_assert(strlen(text) > 0 && text[strlen(text) - 1] == '\n',
            "the text ends with a newline");
  for (const char *p = text; *p;) {
    const char *eol = strchr(p, '\n');
    cr_assert_not_null(eol);
    char ln[1024];
    size_t len = (size_t)(eol - p);
    cr_assert_lt(len, sizeof(ln), "line too long");
    memcpy(ln, p, len);
    ln[len] = '\0';
    p = eol + 1;
    if (strncmp(ln, "# HELP ", 7) == 0)
      continue;
    if (strncmp(ln, "# TYPE ", 7) == 0) {
      char name[128], kind[16];
      cr_assert_eq(sscanf(ln + 7, "%127s %15s", name, kind), 2, "'%s'", ln);
      cr_assert(strcmp(kind, "counter") == 0 || strcmp(kind, "gauge") == 0 ||
                    strcmp(kind, "histogram") == 0,
                "'%s': unknown type", ln);
      for (size_t i = 0; i < ntypes; i++)
        cr_assert_neq(strcmp(types[i], name), 0, "'%s' typed twice", name);
      cr_assert_lt(ntypes, 128);
      snprintf(types[ntypes], sizeof(types[0]), "%s", name);
      snprintf(kinds[ntypes++], sizeof(kinds[0]), "%s", kind);
      continue;
    }
    cr_assert_neq(ln[0], '#', "'%s': a comment that is neither HELP nor TYPE",
                  ln);
    /* name */
    const char *q = ln;
    cr_assert(name_char((unsigned char)*q, 1), "'%s': bad metric name", ln);
    while (name_char((unsigned char)*q, 0))
      q++;
    char name[128];
    snprintf(name, sizeof(name), "%.*s", (int)(q - ln), ln);
    /* labels: name="value" with \\, \" and \n escapes */
    if (*q == '{') {
      q++;
      while (*q != '}') {
        cr_assert(name_char((unsigned char)*q, 1), "'%s': bad label", ln);
        while (name_char((unsigned char)*q, 0))
          q++;
        cr_assert(q[0] == '=' && q[1] == '"', "'%s': bad label", ln);
        q += 2;
        while (*q != '"') {
          cr_assert_neq(*q, '\0', "'%s': unterminated label value", ln);
          if (*q == '\\') {
            cr_assert(q[1] == '\\' || q[1] == '"' || q[1] == 'n',
                      "'%s': bad escape", ln);
            q++;
          }
          q++;
        }
        q++;
        if (*q == ',')
          q++;
        else
          cr_assert_eq(*q, '}', "'%s': bad label list", ln);
      }
      q++;
    }
    cr_assert_eq(*q, ' ', "'%s': no space before the value", ln);
    char *end;
    double v = strtod(q + 1, &end);
    cr_assert(end != q + 1 && *end == '\0', "'%s': bad value", ln);
    /* its family: the name, or a histogram's without the suffix */
    const char *kind = NULL;
    char fam[128] = "";
    for (size_t i = 0; i < ntypes && kind == NULL; i++) {
      size_t tl = strlen(types[i]);
      if (strcmp(types[i], name) == 0 || (strcmp(kinds[i], "histogram") == 0 &&
                                          strncmp(types[i], name, tl) == 0 &&
                                          (strcmp(name + tl, "_bucket") == 0 ||
                                           strcmp(name + tl, "_sum") == 0 ||
                                           strcmp(name + tl, "_count") == 0))) {
        kind = kinds[i];
        snprintf(fam, sizeof(fam), "%s", types[i]);
      }
    }
    cr_assert_not_null(kind, "'%s': no # TYPE before it", ln);
    cr_assert_eq(strncmp(name, "tensord_", 8), 0, "'%s': not tensord_*", ln);
    if (e->n == cap) {
      cap *= 2;
      e->s = realloc(e->s, cap * sizeof(*e->s));
      cr_assert_not_null(e->s);
    }
    sample *s = &e->s[e->n++];
    snprintf(s->series, sizeof(s->series), "%.*s", (int)(q - ln), ln);
    snprintf(s->family, sizeof(s->family), "%s", fam);
    snprintf(s->type, sizeof(s->type), "%s", kind);
    s->value = v;
  }
  cr_assert_gt(e->n, 20, "only %zu samples", e->n);
}

/* The value of series; asserts it is there. */
static double value(const exposition *e, const char *series) {
  for (size_t i = 0; i < e->n; i++)
    if (strcmp(e->s[i].series, series) == 0)
      return e->s[i].value;
  cr_assert_fail("no sample '%s'", series);
  return -1;
}

/* The histogram's buckets grow with le and the +Inf one is the count. */
static void check_histogram(const exposition *e, const char *name) {
  char prefix[160], count[160];
  snprintf(prefix, sizeof(prefix), "%s_bucket{le=\"", name);
  snprintf(count, sizeof(count), "%s_count", name);
  double last = -1, inf = -1;
  size_t n = 0;
  for (size_t i = 0; i < e->n; i++) {
    if (strncmp(e->s[i].series, prefix, strlen(prefix)) != 0)
      continue;
    cr_assert_geq(e->s[i].value, last, "%s: buckets not cumulative",
                  e->s[i].series);
    last = e->s[i].value;
    n++;
    if (strstr(e->s[i].series, "\"+Inf\"") != NULL)
      inf = e->s[i].value;
  }
  cr_assert_gt(n, 5, "%s: %zu buckets", name, n);
  cr_assert_eq(inf, last, "%s: +Inf is not the last bucket", name);
  cr_assert_eq(inf, value(e, count), "%s: +Inf bucket %g, count %g", name, inf,
               value(e, count));
}

/* Every counter and histogram series of a is in b, not smaller. */
static void check_monotonic(const exposition *a, const exposition *b) {
  size_t n = 0;
  for (size_t i = 0; i < a->n; i++) {
    if (strcmp(a->s[i].type, "gauge") == 0)
      continue;
    cr_assert_geq(value(b, a->s[i].series), a->s[i].value,
                  "%s went down: %g then %g", a->s[i].series, a->s[i].value,
                  value(b, a->s[i].series));
    n++;
  }
  cr_assert_gt(n, 10);
}

static void get_text(td_client *c, exposition *e) {
  td_metrics *m;
  cr_assert_eq(td_metrics_get(c, 0, 0, &m), 0, "%s", td_last_error(c));
  cr_assert_eq(strlen(m->text), m->text_len);
  parse(m->text, e);
  td_metrics_free(m);
}

TDT_TEST(metrics, text_is_well_formed_and_right) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  exposition a, b;
  get_text(c, &a);
  check_histogram(&a, "tensord_request_duration_seconds");
  cr_assert_eq(value(&a, "tensord_storages{device=\"cpu\"}"), 0);

  td_storage *s[3];
  size_t sizes[3] = {4096, 8192, 100000};
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_storage_create(c, sizes[i], &s[i]), 0, "%s",
                 td_last_error(c));
  cr_assert_eq(td_publish(c, "metrics/a", s[0], NULL), 0, "%s",
               td_last_error(c));
  /* Two error replies for ENOENT, one for EEXIST (a scoped publish never
   * replaces a key). */
  td_storage *none = NULL;
  td_view v;
  cr_assert_eq(td_lookup(c, "metrics/nothing", 0, 0, &none, &v), TD_ENOENT);
  cr_assert_eq(td_storage_open(c, 999999, 0, &none), TD_ENOENT);
  uint64_t scope;
  cr_assert_eq(td_scope_open(c, &scope), 0);
  td_publish_opts po = {.scope = scope};
  cr_assert_eq(td_publish_ex(c, "metrics/a", s[1], NULL, &po), TD_EEXIST, "%s",
               td_last_error(c));

  get_text(c, &b);
  check_histogram(&b, "tensord_request_duration_seconds");
  check_monotonic(&a, &b);
  cr_assert_eq(value(&b, "tensord_storages{device=\"cpu\"}"), 3);
  cr_assert_eq(value(&b, "tensord_storage_bytes{device=\"cpu\"}"),
               4096 + 8192 + 100000);
  cr_assert_eq(value(&b, "tensord_keys"), 1);
  cr_assert_eq(value(&b, "tensord_clients"), 1);
  cr_assert_eq(value(&b, "tensord_storages_created_total"), 3);
  cr_assert_eq(value(&b, "tensord_created_bytes_total"), 4096 + 8192 + 100000);
  cr_assert_eq(value(&b, "tensord_requests_total{type=\"create\"}") -
                   value(&a, "tensord_requests_total{type=\"create\"}"),
               3);
  cr_assert_eq(value(&b, "tensord_requests_total{type=\"publish\"}"), 2);
  cr_assert_eq(value(&b, "tensord_requests_total{type=\"metrics\"}"), 2);
  cr_assert_eq(value(&b, "tensord_errors_total{code=\"ENOENT\"}") -
                   value(&a, "tensord_errors_total{code=\"ENOENT\"}"),
               2);
  cr_assert_eq(value(&b, "tensord_errors_total{code=\"EEXIST\"}") -
                   value(&a, "tensord_errors_total{code=\"EEXIST\"}"),
               1);
  cr_assert_eq(value(&b, "tensord_errors_total{code=\"EINVAL\"}"), 0);
  /* Every reply so far was served at once: each request is in the
   * histogram but the second scrape's own. */
  double total = 0;
  for (size_t i = 0; i < b.n; i++)
    if (strncmp(b.s[i].series, "tensord_requests_total{", 23) == 0)
      total += b.s[i].value;
  cr_assert_eq(value(&b, "tensord_request_duration_seconds_count"), total - 1,
               "%g requests, %g in the histogram", total,
               value(&b, "tensord_request_duration_seconds_count"));
  cr_assert_eq(value(&b, "tensord_lookup_waits_total"), 0);
  char uid[64];
  snprintf(uid, sizeof(uid), "tensord_uid_bytes{uid=\"%u\"}",
           (unsigned)getuid());
  cr_assert_eq(value(&b, uid), 4096 + 8192 + 100000);

  /* A lookup that waits is counted apart, not as service time. */
  cr_assert_eq(td_lookup(c, "metrics/later", 0, 50, &none, &v), TD_ETIMEDOUT);
  exposition w;
  get_text(c, &w);
  check_monotonic(&b, &w);
  cr_assert_eq(value(&w, "tensord_lookup_waits_total"), 1);
  cr_assert_eq(value(&w, "tensord_request_duration_seconds_count"),
               value(&b, "tensord_request_duration_seconds_count") + 1,
               "the waiting lookup counted as service time");

  /* The structured figures top uses. */
  td_metrics *m;
  cr_assert_eq(td_metrics_get(c, 2, TD_METRICS_NO_TEXT, &m), 0);
  cr_assert_str_eq(m->text, "");
  cr_assert_eq(m->nlargest, 2);
  cr_assert_eq(m->largest[0].nbytes, 100000);
  cr_assert_eq(m->largest[1].nbytes, 8192);
  cr_assert_eq(m->nclients, 1);
  cr_assert_eq(m->clients[0].pid, getpid());
  cr_assert_eq(m->clients[0].bytes_held, 4096 + 8192 + 100000);
  cr_assert_geq(m->clients[0].requests, 10);
  cr_assert_eq(m->storages, 3);
  td_metrics_free(m);
  cr_assert_eq(td_metrics_get(c, 65, 0, &m), TD_EINVAL);
  cr_assert_null(m);

  free(a.s);
  free(b.s);
  free(w.s);
  for (int i = 0; i < 3; i++)
    td_storage_release(s[i]);
  td_close(c);
}

/* Per-client figures (td_metrics' clients, metrics --json, top) name each
 * client with the name it connected with. The Prometheus text has no
 * per-client series (pids and names would be unbounded label values), so
 * no name reaches it, however hostile. */
TDT_TEST(metrics, clients_are_named_and_names_stay_out_of_the_text) {
  tdt_start(&d, NULL);
  static const char *const names[2] = {"train.py worker 1",
                                       "q\"} 1\nevil{x=\"\\"};
  td_client *c[2];
  for (int i = 0; i < 2; i++) {
    td_connect_opts o = {.name = names[i]};
    cr_assert_eq(td_connect_ex(d.sock, &o, &c[i]), 0, "%s",
                 td_last_error(NULL));
  }
  td_metrics *m;
  cr_assert_eq(td_metrics_get(c[0], 0, 0, &m), 0, "%s", td_last_error(c[0]));
  cr_assert_eq(m->nclients, 2);
  int seen = 0;
  for (size_t i = 0; i < m->nclients; i++) {
    cr_assert_eq(m->clients[i].pid, getpid());
    if (strcmp(m->clients[i].name, "train.py worker 1") == 0)
      seen |= 1;
    if (strcmp(m->clients[i].name, "q\"} 1?evil{x=\"\\") == 0)
      seen |= 2;
  }
  cr_assert_eq(seen, 3, "both names listed");
  exposition e;
  parse(m->text, &e); /* asserts it is well formed */
  cr_assert_null(strstr(m->text, "worker"), "%s", m->text);
  cr_assert_null(strstr(m->text, "evil"), "%s", m->text);
  free(e.s);
  td_metrics_free(m);

  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "--json",
                                    "metrics", NULL},
              &r);
  tdt_expect_ok(&r, "metrics --json");
  tdt_expect_json_object(r.out);
  cr_assert_not_null(strstr(r.out, "\"name\":\"train.py worker 1\""), "%s",
                     r.out);
  cr_assert_not_null(strstr(r.out, "\"name\":\"q\\\"} 1?evil{x=\\\"\\\\\""),
                     "%s", r.out);
  tdt_run_free(&r);
  for (int i = 0; i < 2; i++)
    td_close(c[i]);
}

/* ---- the --metrics endpoint ---- */

static char msock[128];

static int connect_unix(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%.107s", path);
  cr_assert(fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
            "connect %s: %s", path, strerror(errno));
  return fd;
}

static int connect_tcp(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  cr_assert(fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
            "connect 127.0.0.1:%d: %s", port, strerror(errno));
  return fd;
}

static void send_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    cr_assert_gt(k, 0, "send: %s", strerror(errno));
    p += k;
    n -= (size_t)k;
  }
}

/* Reads until the daemon closes (20 s at most); returns a malloc'd
 * string. */
static char *read_all(int fd) {
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  cr_assert_not_null(buf);
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    cr_assert_gt(poll(&p, 1, 20000), 0,
                 "the daemon neither answered nor "
                 "closed");
    if (len + 4096 > cap) {
      cap *= 2;
      buf = realloc(buf, cap);
      cr_assert_not_null(buf);
    }
    ssize_t k = read(fd, buf + len, cap - len - 1);
    if (k <= 0)
      break;
    len += (size_t)k;
  }
  buf[len] = '\0';
  return buf;
}

/* Sends req on fd, reads the reply to the close, checks its status line,
 * headers and Content-Length, and returns its body (malloc'd, in *reply
 * as a whole). */
static const char *http(int fd, const char *req, int status, char **reply) {
  send_all(fd, req, strlen(req));
  char *r = read_all(fd);
  close(fd);
  char line[64];
  snprintf(line, sizeof(line), "HTTP/1.1 %d ", status);
  cr_assert_eq(strncmp(r, line, strlen(line)), 0, "asked '%.40s', got '%.80s'",
               req, r);
  char *body = strstr(r, "\r\n\r\n");
  cr_assert_not_null(body);
  body += 4;
  const char *cl = strstr(r, "\r\nContent-Length: ");
  cr_assert(cl != NULL && cl < body);
  cr_assert_eq(strtoul(cl + 18, NULL, 10), strlen(body),
               "Content-Length %lu, body of %zu bytes",
               strtoul(cl + 18, NULL, 10), strlen(body));
  *reply = r;
  return body;
}

/* http() for a reply whose body does not matter. */
static void expect_status(int fd, const char *req, int status) {
  char *r;
  http(fd, req, status, &r);
  free(r);
}

/* Whether the daemon has closed fd already: no waiting. Call it once what
 * closed fd must have happened (a reply that came after it). */
static int closed_now(int fd) {
  struct pollfd p = {fd, POLLIN, 0};
  char b;
  return poll(&p, 1, 0) == 1 && read(fd, &b, 1) <= 0;
}

static void start_unix(const char *const *extra) {
  const char *args[8] = {"--metrics", msock};
  size_t n = 2;
  for (; extra && *extra; extra++)
    args[n++] = *extra;
  args[n] = NULL;
  tdt_start(&d, args);
}

TDT_TEST(metrics, serves_http_on_a_unix_socket) {
  char dir[64];
  tdt_mkdtemp(dir); /* the socket goes in it */
  snprintf(msock, sizeof(msock), "%s/metrics.sock", dir);
  start_unix(NULL);
  struct stat st;
  cr_assert_eq(stat(msock, &st), 0);
  cr_assert(S_ISSOCK(st.st_mode));
  cr_assert_eq(st.st_mode & 0777, 0600, "mode %o", st.st_mode & 0777);

  char *r;
  const char *body = http(connect_unix(msock),
                          "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200, &r);
  cr_assert_not_null(strstr(r, "\r\nContent-Type: text/plain; version=0.0.4; "
                               "charset=utf-8\r\n"));
  exposition a, b;
  parse(body, &a);
  cr_assert_eq(value(&a, "tensord_scrapes_total"), 1);
  free(r);
  /* The same text as tensorctl's, counters no smaller. */
  td_client *c = tdt_connect(&d);
  get_text(c, &b);
  check_monotonic(&a, &b);
  td_close(c);
  free(a.s);
  free(b.s);

  /* "/", a query string, HTTP/1.0 and bare newlines are fine too. */
  expect_status(connect_unix(msock), "GET / HTTP/1.0\n\n", 200);
  expect_status(connect_unix(msock), "GET /metrics?x=1 HTTP/1.1\r\n\r\n", 200);
  /* HEAD: the headers alone. */
  int fd = connect_unix(msock);
  send_all(fd, "HEAD /metrics HTTP/1.1\r\n\r\n", 26);
  r = read_all(fd);
  close(fd);
  cr_assert_eq(strncmp(r, "HTTP/1.1 200 OK\r\n", 17), 0, "%.80s", r);
  cr_assert_str_eq(strstr(r, "\r\n\r\n"), "\r\n\r\n");
  free(r);
  /* Wrong path, wrong method, garbage, a head too long. */
  expect_status(connect_unix(msock), "GET /nope HTTP/1.1\r\n\r\n", 404);
  body = http(connect_unix(msock), "POST /metrics HTTP/1.1\r\n\r\n", 405, &r);
  cr_assert_not_null(strstr(r, "\r\nAllow: GET, HEAD\r\n"));
  free(r);
  expect_status(connect_unix(msock), "\x01\x02garbage\xff\r\n\r\n", 400);
  expect_status(connect_unix(msock), "GET /metrics SPDY/3\r\n\r\n", 400);
  char big[6000];
  memset(big, 'a', sizeof(big) - 1);
  big[sizeof(big) - 1] = '\0';
  memcpy(big, "GET /metrics HTTP/1.1\r\nX: ", 26);
  fd = connect_unix(msock);
  send(fd, big, strlen(big), MSG_NOSIGNAL); /* it may close before the end */
  r = read_all(fd);
  close(fd);
  cr_assert_eq(strncmp(r, "HTTP/1.1 431 ", 13), 0, "%.80s", r);
  free(r);

  tdt_stop(&d);
  cr_assert_neq(access(msock, F_OK), 0, "%s left behind", msock);
  tdt_rmdir(dir);
}

/* The port of d's TCP endpoint, started on port 0: tensord logs the one it
 * got. */
static int logged_port(void) {
  FILE *f = fopen(d.log, "r");
  cr_assert_not_null(f);
  char line[512];
  int port = 0;
  while (port == 0 && fgets(line, sizeof(line), f) != NULL) {
    const char *p = strstr(line, "metrics on http://127.0.0.1:");
    if (p != NULL)
      port = atoi(p + strlen("metrics on http://127.0.0.1:"));
  }
  fclose(f);
  cr_assert_gt(port, 0, "no port in the log");
  return port;
}

TDT_TEST(metrics, serves_http_on_a_loopback_port) {
  tdt_start(&d, (const char *const[]){"--metrics", "127.0.0.1:0", NULL});
  int port = logged_port();
  char *r;
  const char *body =
      http(connect_tcp(port),
           "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n", 200, &r);
  exposition e;
  parse(body, &e);
  cr_assert_eq(value(&e, "tensord_clients"), 0);
  free(e.s);
  free(r);
}

TDT_TEST(metrics, stalled_and_vanishing_scrapers_stall_nothing) {
  char dir[64];
  tdt_mkdtemp(dir); /* the socket goes in it */
  snprintf(msock, sizeof(msock), "%s/m.sock", dir);
  start_unix((const char *const[]){"--io-timeout", "300", NULL});
  /* Half a request, then gone. */
  int fd = connect_unix(msock);
  send_all(fd, "GET /metr", 9);
  close(fd);
  /* A full request, then gone before the reply. */
  fd = connect_unix(msock);
  send_all(fd, "GET /metrics HTTP/1.1\r\n\r\n", 25);
  close(fd);
  /* One that asks and never reads, with a tiny receive buffer; one that
   * never says anything. */
  int lazy = connect_unix(msock);
  int rcv = 1024;
  setsockopt(lazy, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv));
  send_all(lazy, "GET /metrics HTTP/1.1\r\n\r\n", 25);
  int mute = connect_unix(msock);
  /* Meanwhile clients and other scrapers are served. */
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  uint64_t rtt;
  cr_assert_eq(td_ping(c, &rtt), 0);
  expect_status(connect_unix(msock), "GET /metrics HTTP/1.1\r\n\r\n", 200);
  /* The silent one is closed once its time is up (--io-timeout). */
  free(read_all(mute));
  close(mute);
  close(lazy);
  /* More scrapers at once than it serves: the oldest idle ones make room
   * for each newcomer, so a scrape still gets through, and the daemon
   * stays. */
  int many[24];
  for (int i = 0; i < 24; i++)
    many[i] = connect_unix(msock);
  expect_status(connect_unix(msock), "GET /metrics HTTP/1.1\r\n\r\n", 200);
  /* 25 came, 16 are served: the first 9 were closed before that reply. */
  for (int i = 0; i < 24 + 1 - 16; i++)
    cr_assert(closed_now(many[i]), "idle scraper %d of 24 is still open", i);
  for (int i = 0; i < 24; i++)
    close(many[i]);
  cr_assert_eq(td_ping(c, &rtt), 0);
  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
  tdt_rmdir(dir);
}

/* A crowd of connections that say nothing, or half a request line, must not
 * lock scrapers out: each newcomer past the 16 served makes the oldest of
 * them close, and one that sent its request line is closed only after
 * every idle one. */
TDT_TEST(metrics, idle_scrapers_make_room_for_real_ones) {
  tdt_start(&d, (const char *const[]){"--metrics", "127.0.0.1:0", NULL});
  int port = logged_port();
  enum { ROUNDS = 4, IDLE = 16, HALF = 3, CROWD = IDLE + HALF };
  int crowd[ROUNDS][CROWD];
  int slow = -1;
  for (int r = 0; r < ROUNDS; r++) {
    if (r == ROUNDS - 1) {
      /* Past its request line, its headers still to come. */
      slow = connect_tcp(port);
      send_all(slow, "GET /metrics HTTP/1.1\r\n", 23);
    }
    for (int i = 0; i < CROWD; i++) {
      crowd[r][i] = connect_tcp(port);
      if (i >= IDLE)
        send_all(crowd[r][i], "GET /metr", 9);
    }
    /* A real scrape gets through, every time. */
    char *reply;
    http(connect_tcp(port), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200,
         &reply);
    free(reply);
    /* Its arrival closed the oldest of the crowd (accepted before it). */
    cr_assert(closed_now(crowd[0][0]),
              "round %d: the oldest idle scraper "
              "is still open",
              r);
  }
  /* The one past its request line outlived every idle one, and is served. */
  char *reply;
  http(slow, "Host: x\r\n\r\n", 200, &reply);
  free(reply);
  for (int r = 0; r < ROUNDS; r++)
    for (int i = 0; i < CROWD; i++)
      close(crowd[r][i]);
  cr_assert(tdt_log_has(&d, "closed the oldest"),
            "the log does not say why scrapers were closed");
}

/* ---- a Unix socket endpoint's place and mode ---- */

/* Waits until the tensord pid (spawned on d's log) has exited or serves
 * metrics on path; returns its exit status, or -1 if it serves (then it is
 * killed). The bound only ends a hang. */
static int exits_or_serves(pid_t pid, const char *path) {
  char serving[200];
  snprintf(serving, sizeof(serving), "metrics on %s", path);
  for (int t = 0; t < 30000; t += 10) {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (tdt_log_has(&d, serving)) {
      kill(pid, SIGTERM);
      tdt_wait(pid);
      return -1;
    }
    tdt_sleep_ms(10);
  }
  kill(pid, SIGKILL);
  tdt_wait(pid);
  cr_assert_fail("tensord %d neither exited nor served in 30 s", (int)pid);
  return -2;
}

/* As the main socket's, the endpoint's directory, and every one above it,
 * must be tensord's user's or root's and closed to others' writes unless
 * sticky: whoever may write it could put their own socket (or, between a
 * bind and a chmod, a symbolic link) in place of the endpoint. */
TDT_TEST(metrics, refuses_a_unix_endpoint_in_a_directory_others_may_write) {
  tdt_start(&d, NULL);
  char dir[160], path[200], other[160], want[400];
  snprintf(dir, sizeof(dir), "%s/open", d.dir);
  snprintf(path, sizeof(path), "%s/m.sock", dir);
  snprintf(other, sizeof(other), "%s/other.sock", d.dir);
  cr_assert_eq(mkdir(dir, 0700), 0);
  cr_assert_eq(chmod(dir, 0777), 0); /* not sticky */
  pid_t pid = tdt_spawn(
      &d, (const char *const[]){"--socket", other, "--metrics", path, NULL});
  cr_assert_eq(exits_or_serves(pid, path), 1,
               "tensord did not refuse --metrics in a directory of mode 0777");
  snprintf(want, sizeof(want), "metrics socket directory %s, owned by uid %u",
           dir, (unsigned)geteuid());
  cr_assert(tdt_log_has(&d, want), "no '%s' in the log", want);
  cr_assert(tdt_log_has(&d, "has mode 0777: others may write it and could "
                            "replace the metrics socket; refusing it (chmod "
                            "go-w it, or choose another --metrics)"));
  cr_assert_neq(access(path, F_OK), 0, "a socket was made in %s", dir);
  if (geteuid() == 0) {
    /* Another uid's directory, closed to everyone else. */
    cr_assert_eq(chmod(dir, 0700), 0);
    cr_assert_eq(chown(dir, 4246, 4246), 0);
    pid = tdt_spawn(
        &d, (const char *const[]){"--socket", other, "--metrics", path, NULL});
    cr_assert_eq(exits_or_serves(pid, path), 1,
                 "tensord did not refuse --metrics in uid 4246's directory");
    snprintf(want, sizeof(want),
             "metrics socket directory %s is owned by uid 4246, not by root, "
             "tensord's user: whoever owns it could replace the metrics "
             "socket",
             dir);
    cr_assert(tdt_log_has(&d, want), "no '%s' in the log", want);
    cr_assert_neq(access(path, F_OK), 0, "a socket was made in %s", dir);
  }
}

/* The endpoint's socket has its mode from the moment bind() makes it, not
 * from a chmod after: nobody who watches the directory ever finds it open
 * to others. bindshim records the mode right after the bind. */
TDT_TEST(metrics, a_unix_endpoint_has_its_mode_from_the_start) {
  static const char *const modes[][2] = {{NULL, "0600"}, {"0640", "0640"}};
  for (size_t i = 0; i < 2; i++) {
    char dir[64], log[128];
    tdt_mkdtemp(dir);
    snprintf(msock, sizeof(msock), "%s/m.sock", dir);
    snprintf(log, sizeof(log), "%s/bind.log", dir);
    tdt_preload(TDT_BINDSHIM);
    setenv("TDT_BIND_WATCH", msock, 1);
    setenv("TDT_BIND_LOG", log, 1);
    mode_t mask = umask(022); /* a bind alone would make it 0755 */
    if (modes[i][0] != NULL)
      start_unix((const char *const[]){"--socket-mode", modes[i][0], NULL});
    else
      start_unix(NULL);
    umask(mask);
    tdt_preload(NULL);
    unsetenv("TDT_BIND_WATCH");
    unsetenv("TDT_BIND_LOG");
    char line[32] = "";
    FILE *f = fopen(log, "r");
    cr_assert_not_null(f, "bindshim saw no bind of %s", msock);
    cr_assert_not_null(fgets(line, sizeof(line), f));
    fclose(f);
    line[strcspn(line, "\n")] = '\0';
    cr_assert_str_eq(line, modes[i][1],
                     "--socket-mode %s: the endpoint was mode %s as bind() "
                     "made it, not %s",
                     modes[i][0] ? modes[i][0] : "(none)", line, modes[i][1]);
    struct stat st;
    cr_assert_eq(stat(msock, &st), 0);
    cr_assert_eq(st.st_mode & 07777, strtoul(modes[i][1], NULL, 8));
    tdt_stop(&d);
    tdt_rmdir(dir);
  }
}

TDT_TEST(metrics, refuses_addresses_off_the_loopback) {
  tdt_start(&d, NULL);
  static const char *const bad[][2] = {
      {"0.0.0.0:9100", "0.0.0.0 is not a loopback address"},
      {"192.168.1.1:9100", "192.168.1.1 is not a loopback address"},
      {"[::]:9100", ":: is not a loopback address"},
      {"example.com:80", "'example.com' is not an IP address"},
      {"127.0.0.1:99999", "port '99999' is not a number"},
      {"127.0.0.1:65536", "port '65536' is not a number from 0 to 65535"},
      {"[::1]:65536", "port '65536' is not a number from 0 to 65535"},
      {"127.0.0.1:-1", "port '-1' is not a number"},
      {"127.0.0.1:http", "port 'http' is not a number"},
      {"127.0.0.1", "neither a path"},
      {"::1:9100", "write an IPv6 address as [::1]:PORT"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    pid_t pid =
        tdt_spawn(&d, (const char *const[]){"--metrics", bad[i][0], NULL});
    cr_assert_eq(tdt_wait(pid), 2, "--metrics %s was not refused", bad[i][0]);
    cr_assert(tdt_log_has(&d, bad[i][1]), "--metrics %s: no '%s' in the log",
              bad[i][0], bad[i][1]);
  }
  /* A path that is not a socket is left alone. */
  char path[160];
  snprintf(path, sizeof(path), "%s/file", d.dir);
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fclose(f);
  char other[160];
  snprintf(other, sizeof(other), "%s/other.sock", d.dir);
  pid_t pid = tdt_spawn(
      &d, (const char *const[]){"--socket", other, "--metrics", path, NULL});
  cr_assert_eq(tdt_wait(pid), 1);
  cr_assert(tdt_log_has(&d, "exists and is not a socket"));
  cr_assert_eq(access(path, F_OK), 0);
  unlink(path);
}

/* test_metrics.c: daemon/server/metrics.c: label values escaped as the text format
 * wants, cut short only between escapes; latency buckets take their upper
 * bound (le is inclusive) and the rest goes to +Inf; counters show in the
 * rendered text. */
#include "metrics.h"
#include "conn.h"
#include "start.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

Test(metrics, label_values_are_escaped) {
  char out[64];
  cr_assert_str_eq(td__metrics_label("plain/path.sock", out, sizeof(out)),
                   "plain/path.sock");
  cr_assert_str_eq(td__metrics_label("a\"b\\c\nd", out, sizeof(out)),
                   "a\\\"b\\\\c\\nd");
  /* Too long: cut before an escape that does not fit whole. */
  cr_assert_str_eq(td__metrics_label("ab\"cd", out, 5), "ab\\\"");
  cr_assert_str_eq(td__metrics_label("ab\"cd", out, 4), "ab");
  cr_assert_str_eq(td__metrics_label("abcdef", out, 4), "abc");
  cr_assert_str_eq(td__metrics_label("", out, 1), "");
}

Test(metrics, buckets_are_inclusive_and_inf_takes_the_rest) {
  static td__metrics m;
  memset(&m, 0, sizeof(m));
  td__metrics_observe(&m, 0);
  td__metrics_observe(&m, 10000); /* exactly 10 us: le="1e-05" */
  td__metrics_observe(&m, 10001);
  td__metrics_observe(&m, 2500000000ull);
  td__metrics_observe(&m, 2500000001ull);
  cr_assert_eq(m.latency[0], 2);
  cr_assert_eq(m.latency[1], 1);
  cr_assert_eq(m.latency[TD__METRIC_BUCKETS - 1], 1);
  cr_assert_eq(m.latency[TD__METRIC_BUCKETS], 1);
  cr_assert_eq(m.latency_count, 5);
  cr_assert_eq(m.latency_sum_ns, 10000 + 10001 + 5000000001ull);
  td__metrics_request(&m, 11);
  td__metrics_request(&m, 99); /* not a body this daemon knows */
  td__metrics_request(&m, -1);
  cr_assert_eq(m.requests[11], 1);
  cr_assert_eq(m.requests[0], 2);
  td__metrics_error(&m, TD_ENOENT);
  td__metrics_error(&m, -100000);
  td__metrics_error(&m, 5); /* not an error code */
  cr_assert_eq(m.errors[-TD_ENOENT], 1);
  cr_assert_eq(m.errors[0], 2);
}

static td__server srv;

Test(metrics, rendered_text_escapes_and_counts) {
  uv_loop_t loop;
  td__options o = {0};
  o.capacity = 1u << 20;
  o.socket_mode = -1;
  cr_assert_eq(uv_loop_init(&loop), 0);
  td__server_init(&srv, &loop, &o);
  snprintf(srv.socket_path, sizeof(srv.socket_path), "/tmp/a\"b\\c\nd.sock");
  td__metrics_observe(&srv.metrics, 30000);
  td__metrics_error(&srv.metrics, TD_EACCES);
  td__metrics_error(&srv.metrics, -100000);
  size_t len = 0;
  char *t = td__metrics_render(&srv, &len);
  cr_assert_not_null(t);
  cr_assert_eq(strlen(t), len);
  cr_assert_not_null(strstr(t, "socket=\"/tmp/a\\\"b\\\\c\\nd.sock\"} 1\n"),
                     "%s", t);
  cr_assert_not_null(
      strstr(t, "tensord_request_duration_seconds_bucket{le=\"2.5e-05\"} 0\n"));
  cr_assert_not_null(
      strstr(t, "tensord_request_duration_seconds_bucket{le=\"5e-05\"} 1\n"));
  cr_assert_not_null(
      strstr(t, "tensord_request_duration_seconds_bucket{le=\"+Inf\"} 1\n"));
  cr_assert_not_null(strstr(t, "tensord_request_duration_seconds_sum "
                               "0.000030000\n"));
  cr_assert_not_null(strstr(t, "tensord_errors_total{code=\"EACCES\"} 1\n"));
  cr_assert_not_null(strstr(t, "tensord_errors_total{code=\"other\"} 1\n"));
  cr_assert_not_null(strstr(t, "tensord_storages{device=\"cpu\"} 0\n"));
  /* Nothing but the one newline per line: the path's is escaped. */
  for (char *p = t; (p = strchr(p, '\n')) != NULL; p++)
    cr_assert(p[1] == '\0' || p[1] == '#' || p[1] == 't', "%.40s", p + 1);
  free(t);
  td__server_stop(&srv);
  while (uv_run(&loop, UV_RUN_NOWAIT) != 0)
    ;
  cr_assert_eq(uv_loop_close(&loop), 0);
}

/* --metrics ADDR's port: exactly 0 (any free port) to 65535, in decimal
 * digits and nothing else; the bound is where the parser says, not a
 * little past it (99999 alone would not tell). */
Test(metrics, scrape_ports_are_0_to_65535_exactly) {
  static const struct {
    const char *addr;
    int port; /* -1: refused */
  } cases[] = {
      {"127.0.0.1:65535", 65535},
      {"127.0.0.1:65536", -1},
      {"127.0.0.1:65534", 65534},
      {"[::1]:65535", 65535},
      {"[::1]:65536", -1},
      {"localhost:1", 1},
      {"127.0.0.1:0", 0}, /* any free port, as documented */
      {"127.0.0.1:00065535", 65535},
      {"127.0.0.1:99999", -1},
      {"127.0.0.1:4294967296", -1},
      {"127.0.0.1:18446744073709551616", -1},
      {"127.0.0.1:-1", -1},
      {"127.0.0.1:-0", -1},
      {"127.0.0.1:+80", -1},
      {"127.0.0.1: 80", -1},
      {"127.0.0.1:80 ", -1},
      {"127.0.0.1:0x50", -1},
      {"127.0.0.1:8o", -1},
      {"127.0.0.1:", -1},
      {"127.0.0.1:abc", -1},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    struct sockaddr_storage ss;
    char msg[256] = "";
    int err = td__scrape_parse(cases[i].addr, &ss, msg, sizeof(msg));
    if (cases[i].port < 0) {
      cr_expect_eq(err, TD_EINVAL, "--metrics %s was not refused",
                   cases[i].addr);
      cr_expect(strstr(msg, "is not a number from 0 to 65535") != NULL,
                "--metrics %s: '%s'", cases[i].addr, msg);
      continue;
    }
    cr_expect_eq(err, 0, "--metrics %s: %s", cases[i].addr, msg);
    in_port_t port = ss.ss_family == AF_INET6
                         ? ((struct sockaddr_in6 *)&ss)->sin6_port
                         : ((struct sockaddr_in *)&ss)->sin_port;
    cr_expect_eq(ntohs(port), cases[i].port, "--metrics %s: port %u",
                 cases[i].addr, (unsigned)ntohs(port));
  }
}

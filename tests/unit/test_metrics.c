/* test_metrics.c: daemon/metrics.c: label values escaped as the text format
 * wants, cut short only between escapes; latency buckets take their upper
 * bound (le is inclusive) and the rest goes to +Inf; counters show in the
 * rendered text. */
#include "metrics.h"
#include "server.h"

#include <criterion/criterion.h>
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

/* test_client.c: libtensord's contract with a caller: one error channel for
 * every failing call. */
#include "harness.h"

#include <criterion/criterion.h>
#include <dlpack/dlpack.h>
#include <string.h>

static tdt_daemon d;

/* Every test starts its own daemon and stops it at its end (so that
 * tdt_stop's checks count); a test that fails midway leaves nothing. */
static void setup(void) {
  memset(&d, 0, sizeof(d));
}

static void teardown(void) {
  if (d.pid > 0)
    tdt_kill(&d);
}

TestSuite(client, .init = setup, .fini = teardown, .timeout = 60);

#define HAS(s, needle)                                                         \
  cr_assert(strstr((s), (needle)) != NULL, "'%s' does not name '%s'", (s),     \
            (needle))

/* ---- one error channel ---- */

static int lookup_missing(td_client *c, const char *key) {
  td_storage *s;
  return td_lookup(c, key, 0, 0, &s, NULL);
}

/* A failure on one client leaves the message of another's in place, for
 * td_last_error(c); td_last_error(NULL) has the latest of all. */
Test(client, errors_of_two_clients_do_not_overwrite_each_other) {
  tdt_start(&d, NULL);
  td_client *a = tdt_connect(&d);
  td_client *b = tdt_connect(&d);
  cr_assert_eq(lookup_missing(a, "missing-on-a"), TD_ENOENT);
  cr_assert_eq(lookup_missing(b, "missing-on-b"), TD_ENOENT);
  HAS(td_last_error(a), "missing-on-a");
  HAS(td_last_error(b), "missing-on-b");
  HAS(td_last_error(NULL), "missing-on-b");
  /* Interleaved again, the other way round, and a success between. */
  cr_assert_eq(lookup_missing(b, "again-on-b"), TD_ENOENT);
  cr_assert_eq(td_ping(a, NULL), 0);
  cr_assert_eq(lookup_missing(a, "again-on-a"), TD_ENOENT);
  HAS(td_last_error(a), "again-on-a");
  HAS(td_last_error(b), "again-on-b");
  HAS(td_last_error(NULL), "again-on-a");
  td_close(a);
  td_close(b);
  tdt_stop(&d);
}

/* Sixteen clients that fail in turn each keep their own message. */
Test(client, sixteen_clients_keep_their_messages) {
  tdt_start(&d, NULL);
  td_client *c[16];
  char key[32];
  for (int i = 0; i < 16; i++) {
    c[i] = tdt_connect(&d);
    snprintf(key, sizeof(key), "missing-%d-", i);
    cr_assert_eq(lookup_missing(c[i], key), TD_ENOENT);
  }
  for (int i = 0; i < 16; i++) {
    snprintf(key, sizeof(key), "missing-%d-", i);
    HAS(td_last_error(c[i]), key);
    td_close(c[i]);
  }
  tdt_stop(&d);
}

static void noop_deleter(DLManagedTensor *m) {
  (void)m;
}

/* A view error and a client error are read the same way: whichever came
 * last is td_last_error(NULL) and td_view_last_error(); a call on c that
 * fails in the library's own checks (td_from_dlpack) is td_last_error(c)
 * too; and td_connect's and td_copy's failures are there as well. */
Test(client, view_and_client_errors_are_read_the_same_way) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);

  td_view v;
  int64_t shape[2] = {4, -3};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), TD_EINVAL);
  HAS(td_last_error(NULL), "negative size -3");
  HAS(td_view_last_error(), "negative size -3");

  cr_assert_eq(lookup_missing(c, "after-a-view-error"), TD_ENOENT);
  HAS(td_last_error(NULL), "after-a-view-error");
  HAS(td_view_last_error(), "after-a-view-error");
  HAS(td_last_error(c), "after-a-view-error");

  /* A view error after it: the client's own message stays. */
  shape[1] = 3;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_narrow(&v, 5, 0, 1), TD_EINVAL);
  HAS(td_last_error(NULL), "dim 5");
  HAS(td_last_error(c), "after-a-view-error");

  /* td_copy knows no client: td_last_error(NULL). */
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 48, &s), 0, "%s", td_last_error(c));
  td_view big;
  int64_t bshape[1] = {1000};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, bshape, &big), 0);
  cr_assert_eq(td_copy(s, &big, s, &big), TD_ERANGE);
  HAS(td_last_error(NULL), "copy");

  /* td_from_dlpack takes c: its own checks' failure is c's as well. */
  DLManagedTensor m;
  memset(&m, 0, sizeof(m));
  int64_t dshape[1] = {4};
  float data[4] = {0};
  m.dl_tensor.data = data;
  m.dl_tensor.device.device_type = kDLCPU;
  m.dl_tensor.ndim = 1;
  m.dl_tensor.shape = dshape;
  m.dl_tensor.dtype.code = kDLFloat;
  m.dl_tensor.dtype.bits = 32;
  m.dl_tensor.dtype.lanes = 4;
  m.deleter = noop_deleter;
  td_storage *out;
  cr_assert_eq(td_from_dlpack(c, &m, NULL, 0, &out), TD_EINVAL);
  HAS(td_last_error(NULL), "lanes");
  HAS(td_last_error(c), "lanes");

  /* td_connect has no client yet: td_last_error(NULL). */
  char nowhere[160];
  snprintf(nowhere, sizeof(nowhere), "%s/nobody.sock", d.dir);
  td_client *none;
  cr_assert_lt(td_connect(nowhere, &none), 0);
  HAS(td_last_error(NULL), "nobody.sock");
  HAS(td_last_error(c), "lanes");

  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
}

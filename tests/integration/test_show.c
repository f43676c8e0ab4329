/* test_show.c: tensorctl show against a real tensord: every dtype, NaN and
 * Inf counts, exact int64 extremes, index sub-views, strided and empty
 * views, sampling, --json, bad input, a storage freed while shown, and the
 * state dict reader it uses (td_state_dict_*). */
#include "cli.h"
#include "harness.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <string.h>

static tdt_daemon d;

static void setup(void) {
  tdt_start(&d, NULL);
}

TestSuite(show, .init = setup, .fini = tdt_cleanup, .timeout = 60);

/* ---- running tensorctl ---- */

/* Runs tensorctl --socket SOCK show args... (NULL-terminated). */
#define show(r, ...)                                                           \
  tdt_cli_collect(                                                             \
      tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,   \
                                          "show", __VA_ARGS__, NULL},          \
                    NULL),                                                     \
      r)

/* Asserts the output has line (a whole line). */
static void expect_line(const tdt_run_result *r, const char *line) {
  size_t n = strlen(line);
  for (const char *p = r->out; (p = strstr(p, line)) != NULL; p++)
    if ((p == r->out || p[-1] == '\n') && p[n] == '\n')
      return;
  cr_assert_fail("no line '%s' in:\n%s", line, r->out);
}

/* Asserts exit 1, nothing on stdout, and stderr saying needle. */
static void expect_error(const tdt_run_result *r, const char *needle) {
  cr_assert_eq(r->status, 1, "exit %d (stderr: %s)", r->status, r->err);
  cr_assert_eq(r->out_len, 0, "stdout on an error: %s", r->out);
  cr_assert(strstr(r->err, needle) != NULL, "stderr '%s' does not say '%s'",
            r->err, needle);
}

static void expect_has(const char *s, const char *needle) {
  cr_assert(strstr(s, needle) != NULL, "'%s' not in %.1500s", needle, s);
}

/* ---- fixtures ---- */

/* A storage holding bytes, published under key with view v (NULL: the
 * whole storage as uint8). Returns the handle; the key holds a reference
 * too. */
static td_storage *put(td_client *c, const char *key, const void *bytes,
                       size_t n, const td_view *v) {
  td_storage *s;
  cr_assert_eq(td_storage_create(c, n ? n : 1, &s), 0);
  memcpy(td_storage_data(s), bytes, n);
  cr_assert_eq(td_publish(c, key, s, v), 0, "%s", td_last_error(c));
  return s;
}

static td_view vec(td_dtype dt, int64_t n) {
  td_view v;
  cr_assert_eq(td_view_contiguous(dt, 1, &n, &v), 0);
  return v;
}

/* One dtype's case: its bytes, and what show must print for them. */
typedef struct dcase {
  td_dtype dtype;
  const void *bytes;
  int64_t n;
  const char *counts; /* the count line */
  const char *range;  /* the min/max line, or NULL (bool) */
  const char *values; /* numpy's repr, as numpy 1.24 prints it */
} dcase;

static const uint8_t b_bool[] = {1, 0, 1};
static const uint8_t b_u8[] = {0, 255, 7};
static const int8_t b_i8[] = {-128, 127, 0};
static const int16_t b_i16[] = {-32768, 5};
static const int32_t b_i32[] = {-1, 2147483647};
static const int64_t b_i64[] = {INT64_MIN, INT64_MAX, 0};
static const uint16_t b_u16[] = {65535, 1};
static const uint32_t b_u32[] = {4294967295u, 0};
static const uint64_t b_u64[] = {UINT64_MAX, 0};
/* float16: -1.23, 0.5, 2, NaN, +Inf, 0 */
static const uint16_t b_f16[] = {0xbcec, 0x3800, 0x4000, 0x7e00, 0x7c00, 0};
/* bfloat16: 1, 3.140625, +Inf */
static const uint16_t b_bf16[] = {0x3f80, 0x4049, 0x7f80};
static const float b_f32[] = {0.1f, 0.25f, -2};
static const double b_f64[] = {1.5, NAN, -INFINITY};
static const float b_c64[] = {1, 2, 3.5f, -4};
static const double b_c128[] = {NAN, 1, 0, 0};
/* e4m3fn: 1, 448 (the largest), NaN (its one pattern), -448 */
static const uint8_t b_e4[] = {0x38, 0x7e, 0x7f, 0xfe};
/* e5m2: 1, +Inf, -Inf, NaN */
static const uint8_t b_e5[] = {0x3c, 0x7c, 0xfc, 0x7d};

static const dcase cases[] = {
    {TD_BOOL, b_bool, 3, "count  3   true 2   false 1", NULL,
     "values array([ True, False,  True])"},
    {TD_UINT8, b_u8, 3, "count  3   zeros 1",
     "min    0   max 255   mean 87.3333   std 118.593",
     "values array([  0, 255,   7], dtype=uint8)"},
    {TD_INT8, b_i8, 3, "count  3   zeros 1",
     "min    -128   max 127   mean -0.333333   std 104.104",
     "values array([-128,  127,    0], dtype=int8)"},
    {TD_INT16, b_i16, 2, "count  2   zeros 0",
     "min    -32768   max 5   mean -16381.5   std 16386.5",
     "values array([-32768,      5], dtype=int16)"},
    {TD_INT32, b_i32, 2, "count  2   zeros 0",
     "min    -1   max 2147483647   mean 1.07374e+09   std 1.07374e+09",
     "values array([        -1, 2147483647], dtype=int32)"},
    {TD_INT64, b_i64, 3, "count  3   zeros 1",
     "min    -9223372036854775808   max 9223372036854775807   mean 0   std "
     "7.53085e+18",
     "values array([-9223372036854775808,  9223372036854775807,            "
     "        0])"},
    {TD_UINT16, b_u16, 2, "count  2   zeros 0",
     "min    1   max 65535   mean 32768   std 32767",
     "values array([65535,     1], dtype=uint16)"},
    {TD_UINT32, b_u32, 2, "count  2   zeros 1",
     "min    0   max 4294967295   mean 2.14748e+09   std 2.14748e+09",
     "values array([4294967295,          0], dtype=uint32)"},
    {TD_UINT64, b_u64, 2, "count  2   zeros 1",
     "min    0   max 18446744073709551615   mean 9.22337e+18   std "
     "9.22337e+18",
     "values array([18446744073709551615,                    0], "
     "dtype=uint64)"},
    {TD_FLOAT16, b_f16, 6, "count  6   zeros 1   nan 1   inf 1",
     "min    -1.23   max inf   mean inf   std nan",
     "values array([-1.23,  0.5 ,  2.  ,   nan,   inf,  0.  ], "
     "dtype=float16)"},
    {TD_BFLOAT16, b_bf16, 3, "count  3   zeros 0   nan 0   inf 1",
     "min    1   max inf   mean inf   std nan",
     "values array([1.  , 3.14,  inf], dtype=bfloat16)"},
    {TD_FLOAT32, b_f32, 3, "count  3   zeros 0   nan 0   inf 0",
     "min    -2   max 0.25   mean -0.55   std 1.02713",
     "values array([ 0.1 ,  0.25, -2.  ], dtype=float32)"},
    {TD_FLOAT64, b_f64, 3, "count  3   zeros 0   nan 1   inf 1",
     "min    -inf   max 1.5   mean -inf   std nan",
     "values array([ 1.5,  nan, -inf])"},
    {TD_COMPLEX64, b_c64, 2, "count  2   zeros 0   nan 0   inf 0",
     "mean   (2.25-1j)   std 3.25",
     "values array([1. +2.j, 3.5-4.j], dtype=complex64)"},
    {TD_COMPLEX128, b_c128, 2, "count  2   zeros 1   nan 1   inf 0",
     "mean   (0+0j)   std 0", "values array([nan+1.j,  0.+0.j])"},
    {TD_FLOAT8_E4M3FN, b_e4, 4, "count  4   zeros 0   nan 1   inf 0",
     "min    -448   max 448   mean 0.333333   std 365.791",
     "values array([   1.,  448.,   nan, -448.], dtype=float8_e4m3fn)"},
    {TD_FLOAT8_E5M2, b_e5, 4, "count  4   zeros 0   nan 1   inf 2",
     "min    -inf   max inf   mean nan   std nan",
     "values array([  1.,  inf, -inf,  nan], dtype=float8_e5m2)"},
};

/* ---- every dtype ---- */

TDT_TEST(show, every_dtype_decoded_counted_and_laid_out_as_numpy) {
  td_client *c = tdt_connect(&d);
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const dcase *k = &cases[i];
    const char *name = td_dtype_name(k->dtype);
    char key[64];
    snprintf(key, sizeof(key), "show/%s", name);
    td_view v = vec(k->dtype, k->n);
    td_storage *s =
        put(c, key, k->bytes, (size_t)k->n * td_dtype_size(k->dtype), &v);
    tdt_run_result r;
    show(&r, key);
    tdt_expect_ok(&r, key);
    char line[128];
    snprintf(line, sizeof(line), "key '%s' -> storage %" PRIu64 " (%zu B, cpu)",
             key, td_storage_id(s), td_storage_nbytes(s));
    expect_line(&r, line);
    snprintf(line, sizeof(line), "view   %s [%" PRId64 "] strides [1] offset 0",
             name, k->n);
    expect_line(&r, line);
    expect_line(&r, k->counts);
    if (k->range != NULL)
      expect_line(&r, k->range);
    expect_line(&r, k->values);
    tdt_run_free(&r);

    /* The same as JSON: well formed, NaN and Inf as strings. */
    show(&r, key, "--json");
    tdt_expect_ok(&r, key);
    tdt_expect_json_object(r.out);
    snprintf(line, sizeof(line), "\"dtype\":\"%s\"", name);
    expect_has(r.out, line);
    tdt_run_free(&r);
    cr_assert_eq(td_unpublish(c, key), 0);
    td_storage_release(s);
  }
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

TDT_TEST(show, json_carries_exact_ints_and_nonfinite_as_strings) {
  td_client *c = tdt_connect(&d);
  td_view v = vec(TD_INT64, 3);
  td_storage *s = put(c, "show/i64", b_i64, sizeof(b_i64), &v);
  tdt_run_result r;
  show(&r, "show/i64", "--json");
  tdt_expect_ok(&r, "--json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"min\":-9223372036854775808");
  expect_has(r.out, "\"max\":9223372036854775807");
  expect_has(r.out, "\"first\":[-9223372036854775808,9223372036854775807,0]");
  expect_has(r.out, "\"last\":[]");
  expect_has(r.out, "\"key\":\"show/i64\"");
  expect_has(r.out, "\"sampled\":false");
  tdt_run_free(&r);
  td_storage_release(s);

  v = vec(TD_FLOAT16, 6);
  s = put(c, "show/f16", b_f16, sizeof(b_f16), &v);
  show(&r, "--json", "show/f16");
  tdt_expect_ok(&r, "--json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"nan\":1,\"inf\":1");
  expect_has(r.out, "\"max\":\"inf\"");
  expect_has(r.out, "\"std\":\"nan\"");
  expect_has(r.out, "\"first\":[-1.23,0.5,2],\"last\":[\"nan\",\"inf\",0]");
  expect_has(r.out, "\"repr\":\"array([-1.23,  0.5 ,");
  tdt_run_free(&r);
  td_storage_release(s);

  v = vec(TD_COMPLEX64, 2);
  s = put(c, "show/c64", b_c64, sizeof(b_c64), &v);
  show(&r, "show/c64", "--json");
  tdt_expect_ok(&r, "--json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"first\":[[1,2],[3.5,-4]]");
  expect_has(r.out, "\"mean\":[2.25,-1]");
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, "show/i64"), 0);
  cr_assert_eq(td_unpublish(c, "show/f16"), 0);
  cr_assert_eq(td_unpublish(c, "show/c64"), 0);
  td_storage_release(s);
  td_close(c);
}

/* ---- views ---- */

TDT_TEST(show, index_sub_view_and_strided_views) {
  td_client *c = tdt_connect(&d);
  float x[24];
  for (int i = 0; i < 24; i++)
    x[i] = (float)i;
  int64_t shape[3] = {2, 3, 4};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 3, shape, &v), 0);
  td_storage *s = put(c, "show/cube", x, sizeof(x), &v);
  tdt_run_result r;
  show(&r, "show/cube", "[0, :, 2:5]");
  tdt_expect_ok(&r, "[0, :, 2:5]");
  expect_line(&r, "view   float32 [2, 3, 4] strides [12, 4, 1] offset 0");
  expect_line(&r, "index  [0, :, 2:5] -> float32 [3, 2] strides [4, 1] "
                  "offset 2");
  expect_line(&r, "count  6   zeros 0   nan 0   inf 0");
  expect_line(&r, "min    2   max 11   mean 6.5   std 3.30404");
  expect_line(&r, "values array([ 2.,  3.,  6.,  7., 10., 11.], "
                  "dtype=float32)");
  tdt_run_free(&r);

  show(&r, "show/cube", "[..., None, -1]");
  tdt_expect_ok(&r, "[..., None, -1]");
  expect_line(&r, "index  [..., None, -1] -> float32 [2, 3, 1] strides [12, "
                  "4, 4] offset 3");
  expect_line(&r, "values array([ 3.,  7., 11., 15., 19., 23.], "
                  "dtype=float32)");
  tdt_run_free(&r);

  /* A published transpose: elements in the view's order, not memory's. */
  int32_t y[6] = {0, 1, 2, 3, 4, 5};
  int64_t s23[2] = {2, 3};
  td_view t;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s23, &t), 0);
  cr_assert_eq(td_view_transpose(&t, 0, 1), 0);
  td_storage *s2 = put(c, "show/t", y, sizeof(y), &t);
  show(&r, "show/t");
  tdt_expect_ok(&r, "show/t");
  expect_line(&r, "view   int32 [3, 2] strides [1, 3] offset 0");
  expect_line(&r, "values array([0, 3, 1, 4, 2, 5], dtype=int32)");
  tdt_run_free(&r);
  show(&r, "show/t", "[1:, 1]");
  tdt_expect_ok(&r, "[1:, 1]");
  expect_line(&r, "values array([4, 5], dtype=int32)");
  tdt_run_free(&r);

  cr_assert_eq(td_unpublish(c, "show/cube"), 0);
  cr_assert_eq(td_unpublish(c, "show/t"), 0);
  td_storage_release(s);
  td_storage_release(s2);
  td_close(c);
}

TDT_TEST(show, zero_element_views) {
  td_client *c = tdt_connect(&d);
  int64_t shape[2] = {0, 3};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  td_storage *s = put(c, "show/empty", "", 0, &v);
  tdt_run_result r;
  show(&r, "show/empty");
  tdt_expect_ok(&r, "show/empty");
  expect_line(&r, "count  0   zeros 0   nan 0   inf 0");
  expect_line(&r, "min    -   max -   mean -   std -");
  expect_line(&r, "values array([], shape=(0, 3), dtype=float32)");
  tdt_run_free(&r);
  show(&r, "show/empty", "--json");
  tdt_expect_ok(&r, "--json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"min\":null,\"max\":null,\"mean\":null,\"std\":null");
  expect_has(r.out, "\"first\":[],\"last\":[]");
  tdt_run_free(&r);
  /* An index that empties a view that was not. */
  td_storage *s2 = put(c, "show/u8", b_u8, sizeof(b_u8), NULL);
  show(&r, "show/u8", "[3:]");
  tdt_expect_ok(&r, "[3:]");
  expect_line(&r, "count  0   zeros 0");
  expect_line(&r, "values array([], dtype=uint8)");
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, "show/empty"), 0);
  cr_assert_eq(td_unpublish(c, "show/u8"), 0);
  td_storage_release(s);
  td_storage_release(s2);
  td_close(c);
}

/* ---- ids, sampling ---- */

TDT_TEST(show, id_is_the_whole_storage_as_uint8_or_dtype) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 16, &s), 0);
  float f[4] = {1, 2, 3, 4};
  memcpy(td_storage_data(s), f, sizeof(f));
  char id[32], line[128];
  snprintf(id, sizeof(id), "%" PRIu64, td_storage_id(s));
  tdt_run_result r;
  show(&r, id);
  tdt_expect_ok(&r, id);
  snprintf(line, sizeof(line),
           "storage %s (16 B, cpu): the whole storage as uint8", id);
  expect_line(&r, line);
  expect_line(&r, "view   uint8 [16] strides [1] offset 0");
  expect_line(&r, "count  16   zeros 9"); /* 1.0f is 00 00 80 3f */
  tdt_run_free(&r);
  show(&r, id, "--dtype", "float32", "[1:]");
  tdt_expect_ok(&r, "--dtype");
  snprintf(line, sizeof(line),
           "storage %s (16 B, cpu): the whole storage as float32 (--dtype)",
           id);
  expect_line(&r, line);
  expect_line(&r, "view   float32 [4] strides [1] offset 0");
  expect_line(&r, "values array([2., 3., 4.], dtype=float32)");
  tdt_run_free(&r);
  show(&r, id, "--json");
  tdt_expect_ok(&r, "--json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"key\":null");
  expect_has(r.out, "\"whole_storage\":true");
  tdt_run_free(&r);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(show, sample_and_the_default_limit) {
  td_client *c = tdt_connect(&d);
  static int32_t x[1000];
  for (int i = 0; i < 1000; i++)
    x[i] = i;
  td_view v = vec(TD_INT32, 1000);
  td_storage *s = put(c, "show/seq", x, sizeof(x), &v);
  tdt_run_result r;
  show(&r, "show/seq", "--sample", "10");
  tdt_expect_ok(&r, "--sample 10");
  expect_line(&r, "count  10   zeros 1");
  expect_line(&r, "sampled 10 of 1000 elements, evenly spaced (--all reads "
                  "every one)");
  expect_line(&r, "min    0   max 900   mean 450   std 287.228");
  /* The values shown are the view's ends, not the sample's. */
  expect_line(&r, "values array([  0,   1,   2, ..., 997, 998, 999], "
                  "dtype=int32)");
  tdt_run_free(&r);
  show(&r, "show/seq", "--sample", "10", "--json");
  tdt_expect_ok(&r, "--sample --json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"total\":1000,\"count\":10,\"sampled\":true");
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, "show/seq"), 0);
  td_storage_release(s);

  /* Past TD__SHOW_LIMIT (64 Mi) elements show samples unless --all. */
  size_t n = ((size_t)1 << 26) + (1 << 20);
  cr_assert_eq(td_storage_create(c, n, &s), 0);
  char id[32], line[128];
  snprintf(id, sizeof(id), "%" PRIu64, td_storage_id(s));
  show(&r, id);
  tdt_expect_ok(&r, "a large storage");
  snprintf(line, sizeof(line),
           "sampled 67108864 of %zu elements, evenly spaced (--all reads "
           "every one)",
           n);
  expect_line(&r, line);
  expect_line(&r, "count  67108864   zeros 67108864");
  tdt_run_free(&r);
  show(&r, id, "--all");
  tdt_expect_ok(&r, "--all");
  snprintf(line, sizeof(line), "count  %zu   zeros %zu", n, n);
  expect_line(&r, line);
  cr_assert_null(strstr(r.out, "sampled"), "%s", r.out);
  tdt_run_free(&r);
  td_storage_release(s);
  td_close(c);
}

/* ---- bad input ---- */

TDT_TEST(show, unknown_keys_ids_and_bad_indices) {
  td_client *c = tdt_connect(&d);
  tdt_run_result r;
  show(&r, "show/nope");
  expect_error(&r, "tensorctl show: key 'show/nope': not published");
  tdt_run_free(&r);
  show(&r, "424242");
  expect_error(&r, "tensorctl show: storage 424242: no such storage");
  tdt_run_free(&r);
  show(&r, "99999999999999999999999");
  expect_error(&r, "no such storage");
  tdt_run_free(&r);

  float x[12] = {0};
  int64_t shape[2] = {4, 3};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  td_storage *s = put(c, "show/m", x, sizeof(x), &v);
  static const struct {
    const char *index, *says;
  } bad[] = {
      {"[0, 9]", "index '[0, 9]': dim 1: index 9 out of range for size 3"},
      {"[-5]", "index '[-5]': dim 0: index -5 out of range for size 4"},
      {"[0, 0, 0]", "3 indices for a view of 2 dims"},
      {"[0,,1]", "'' is not an int, a slice a:b:c, '...' or 'None'"},
      {"[x]", "'x' is not an int"},
      {"[::-1]", "dim 0: step -1 (steps must be 1 or more)"},
      {"[0", "no ']' to close the '['"},
      {"[..., ...]", "more than one '...'"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    show(&r, "show/m", bad[i].index);
    expect_error(&r, bad[i].says);
    tdt_run_free(&r);
  }
  show(&r, "show/m", "--dtype", "float64");
  expect_error(&r, "--dtype float64:");
  tdt_run_free(&r);

  /* Usage errors: exit 2. */
  static const char *const usage[][3] = {
      {NULL},
      {"show/m", "--sample", "0"},
      {"show/m", "--dtype", "float7"},
      {"show/m", "[0]", "extra"},
      {"show/m", "--bogus", NULL},
      {"show/m", "--sample", NULL},
  };
  for (size_t i = 0; i < sizeof(usage) / sizeof(usage[0]); i++) {
    tdt_cli_collect(
        tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                            "show", usage[i][0], usage[i][1],
                                            usage[i][2], NULL},
                      NULL),
        &r);
    cr_assert_eq(r.status, 2, "case %zu: exit %d (%s)", i, r.status, r.err);
    cr_assert_eq(r.out_len, 0);
    cr_assert_neq(r.err[0], '\0', "case %zu says why", i);
    tdt_run_free(&r);
  }
  /* show takes no reference it keeps and never the key. */
  cr_assert_eq(tdt_storages(&d), 1);
  td_storage *again;
  cr_assert_eq(td_lookup(c, "show/m", TD_RDONLY, 0, &again, NULL), 0);
  td_storage_release(again);
  cr_assert_eq(td_unpublish(c, "show/m"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* ---- state dicts (tensord.torch.publish_state_dict's blobs) ---- */

/* The manifest of a state dict as publish_state_dict lays it out: tensors
 * "enc.weight" (float32 [2, 3], region 0), "enc.tied" (its row 1: the same
 * region), "steps" (int64, 0-d, region 1), "mask" (bool [4], region 2), and
 * one whose name needs escaping; regions at bytes 1024, 1088, 1152. */
#define SD_MANIFEST                                                            \
  "{\"tensors\":{\"enc.weight\":{\"dtype\":\"float32\",\"shape\":[2,3],"       \
  "\"stride\":[3,1],\"storage_offset\":0,\"region\":0},\"enc.tied\":{"         \
  "\"dtype\":\"float32\",\"shape\":[3],\"stride\":[1],\"storage_offset\":3,"   \
  "\"region\":0},\"steps\":{\"dtype\":\"int64\",\"shape\":[],\"stride\":[],"   \
  "\"storage_offset\":0,\"region\":1},\"mask\":{\"dtype\":\"bool\",\"shape\":" \
  "[4],\"stride\":[1],\"storage_offset\":0,\"region\":2},\"odd "               \
  "\\\"q\\\\\\u00e9"                                                           \
  "\\u001b[2J\":{\"dtype\":\"uint8\",\"shape\":[1],\"stride\":[1],"            \
  "\"storage_offset\":0,\"region\":2}},\"regions\":[{\"offset\":1024,"         \
  "\"nbytes\":24},{\"offset\":1088,\"nbytes\":8},{\"offset\":1152,\"nbytes\":" \
  "4}"                                                                         \
  "]}"
#define SD_BYTES 1216

/* Writes a blob (header, manifest, the regions' values) at b, whose
 * manifest length field says ml (0: the manifest's own). */
static void sd_fill(uint8_t *b, const char *manifest, uint64_t ml) {
  size_t n = strlen(manifest);
  cr_assert_leq(16 + n, 1024, "the manifest fits before the regions");
  memset(b, 0, SD_BYTES);
  memcpy(b, "TDSTATE1", 8);
  if (ml == 0)
    ml = n;
  for (int i = 0; i < 8; i++)
    b[8 + i] = (uint8_t)(ml >> (8 * i));
  memcpy(b + 16, manifest, n);
  float w[6] = {0, 0.5f, 1, 1.5f, 2, 2.5f};
  memcpy(b + 1024, w, sizeof(w));
  int64_t steps = 42;
  memcpy(b + 1088, &steps, sizeof(steps));
  uint8_t mask[4] = {1, 0, 1, 1};
  memcpy(b + 1152, mask, sizeof(mask));
}

/* A storage of pre + SD_BYTES bytes with a blob at byte pre, published under
 * key as uint8[SD_BYTES] at offset pre (as publish_state_dict publishes,
 * with pre 0). */
static td_storage *put_sd(td_client *c, const char *key, const char *manifest,
                          uint64_t ml, size_t pre) {
  td_storage *s;
  cr_assert_eq(td_storage_create(c, pre + SD_BYTES, &s), 0);
  sd_fill((uint8_t *)td_storage_data(s) + pre, manifest, ml);
  int64_t n = SD_BYTES;
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, &n, &v), 0);
  v.offset = (int64_t)pre;
  cr_assert_eq(td_publish(c, key, s, &v), 0, "%s", td_last_error(c));
  return s;
}

/* Runs tensorctl --socket SOCK args... */
#define ctl(r, ...)                                                            \
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,         \
                                    __VA_ARGS__, NULL},                        \
              r)

TDT_TEST(show, a_state_dict_lists_its_tensors_and_shows_each) {
  td_client *c = tdt_connect(&d);
  td_storage *s = put_sd(c, "sd/m", SD_MANIFEST, 0, 0);
  tdt_run_result r;

  show(&r, "sd/m");
  tdt_expect_ok(&r, "show sd/m");
  expect_line(&r, "state dict: 5 tensors in 3 regions (tensorctl show sd/m "
                  "TENSOR [INDEX] shows one)");
  expect_line(&r, "NAME          DTYPE    SHAPE   BYTES");
  expect_line(&r, "enc.weight    float32  [2, 3]  24 B");
  expect_line(&r, "enc.tied      float32  [3]     12 B");
  expect_line(&r, "steps         int64    []      8 B");
  expect_line(&r, "mask          bool     [4]     4 B");
  /* Names are untrusted: no control character reaches the terminal. */
  expect_line(&r, "odd \"q\\\xc3\xa9?[2J  uint8    [1]     1 B");
  cr_assert_null(strstr(r.out, "values"), "no blob statistics: %s", r.out);
  tdt_run_free(&r);

  show(&r, "--json", "sd/m");
  tdt_expect_ok(&r, "show --json sd/m");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"key\":\"sd/m\"");
  expect_has(r.out, "\"state_dict\":{\"tensors\":[{\"name\":\"enc.weight\","
                    "\"dtype\":\"float32\",\"shape\":[2,3],\"stride\":[3,1],"
                    "\"storage_offset\":0,\"region\":0,\"nbytes\":24}");
  expect_has(r.out, "{\"name\":\"steps\",\"dtype\":\"int64\",\"shape\":[],"
                    "\"stride\":[],\"storage_offset\":0,\"region\":1,"
                    "\"nbytes\":8}");
  expect_has(r.out, "\"name\":\"odd \\\"q\\\\\xc3\xa9\\u001b[2J\"");
  expect_has(r.out, "\"regions\":[{\"offset\":1024,\"nbytes\":24},{\"offset\":"
                    "1088,\"nbytes\":8},{\"offset\":1152,\"nbytes\":4}]");
  tdt_run_free(&r);

  show(&r, "sd/m", "enc.weight");
  tdt_expect_ok(&r, "show sd/m enc.weight");
  expect_line(&r, "tensor 'enc.weight' of the state dict (region 0)");
  expect_line(&r, "view   float32 [2, 3] strides [3, 1] offset 256");
  expect_line(&r,
              "values array([0. , 0.5, 1. , 1.5, 2. , 2.5], dtype=float32)");
  tdt_run_free(&r);
  show(&r, "sd/m", "enc.weight", "[1, 1:]");
  tdt_expect_ok(&r, "show sd/m enc.weight [1, 1:]");
  expect_line(&r, "index  [1, 1:] -> float32 [2] strides [1] offset 260");
  expect_line(&r, "values array([2. , 2.5], dtype=float32)");
  tdt_run_free(&r);
  show(&r, "sd/m", "enc.tied");
  tdt_expect_ok(&r, "show sd/m enc.tied");
  expect_line(&r, "values array([1.5, 2. , 2.5], dtype=float32)");
  tdt_run_free(&r);
  show(&r, "sd/m", "steps");
  tdt_expect_ok(&r, "show sd/m steps");
  expect_line(&r, "values array(42)");
  tdt_run_free(&r);
  show(&r, "sd/m", "mask", "--json");
  tdt_expect_ok(&r, "show sd/m mask --json");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"key\":\"sd/m\",\"tensor\":\"mask\",\"region\":2,");
  expect_has(r.out, "\"first\":[true,false,true],\"last\":[true]");
  tdt_run_free(&r);
  show(&r, "sd/m", "enc.weight", "--dtype", "int32");
  tdt_expect_ok(&r, "show sd/m enc.weight --dtype int32");
  expect_line(&r, "view   int32 [2, 3] strides [3, 1] offset 256");
  tdt_run_free(&r);

  /* An unknown TENSOR says how to find the names. */
  show(&r, "sd/m", "enc.wieght");
  expect_error(&r, "key 'sd/m' holds a state dict with no tensor "
                   "'enc.wieght' (tensorctl show sd/m lists its 5 tensors;");
  tdt_run_free(&r);
  show(&r, "sd/m", "--dtype", "int32");
  expect_error(&r, "--dtype applies to one of its tensors");
  tdt_run_free(&r);

  /* info lists them too; its id still shows the raw bytes. */
  ctl(&r, "info", "sd/m");
  tdt_expect_ok(&r, "info sd/m");
  expect_line(&r, "  sd/m: uint8[1216] stride (1) offset 0");
  expect_line(&r, "    state dict: 5 tensors in 3 regions (tensorctl show "
                  "sd/m TENSOR shows one)");
  expect_line(&r, "    enc.weight    float32  [2, 3]  24 B");
  tdt_run_free(&r);
  ctl(&r, "--json", "info", "sd/m");
  tdt_expect_ok(&r, "info --json sd/m");
  tdt_expect_json_object(r.out);
  expect_has(r.out, "\"published_unix_ms\":");
  expect_has(r.out, ",\"state_dict\":{\"tensors\":[{\"name\":\"enc.weight\"");
  tdt_run_free(&r);
  char id[32];
  snprintf(id, sizeof(id), "%" PRIu64, td_storage_id(s));
  show(&r, id, "[0:6]");
  tdt_expect_ok(&r, "show ID [0:6]");
  expect_has(r.out, "the whole storage as uint8");
  expect_line(&r, "values array([84, 68, 83, 84, 65, 84], dtype=uint8)");
  tdt_run_free(&r);

  /* A blob published at an offset in its storage. */
  td_storage *at = put_sd(c, "sd/at", SD_MANIFEST, 0, 64);
  show(&r, "sd/at", "enc.tied");
  tdt_expect_ok(&r, "show sd/at enc.tied");
  expect_line(&r,
              "view   float32 [3] strides [1] offset 275"); /* (64+1024)/4+3 */
  expect_line(&r, "values array([1.5, 2. , 2.5], dtype=float32)");
  tdt_run_free(&r);
  /* ... at an offset that leaves float32 regions unaligned. */
  td_storage *odd = put_sd(c, "sd/odd", SD_MANIFEST, 0, 2);
  show(&r, "sd/odd", "enc.weight");
  expect_error(&r, "tensor 'enc.weight': its region 0 starts at byte 1026 of "
                   "the storage, not a multiple of float32's 4 bytes");
  tdt_run_free(&r);
  show(&r, "sd/odd", "mask");
  tdt_expect_ok(&r, "show sd/odd mask: bools are aligned anywhere");
  tdt_run_free(&r);

  const char *keys[] = {"sd/m", "sd/at", "sd/odd"};
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_unpublish(c, keys[i]), 0);
  td_storage_release(s);
  td_storage_release(at);
  td_storage_release(odd);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* A corrupt blob (bytes that begin like a state dict and lie after) is a
 * clear error for show, a line in info, and never a crash. */
TDT_TEST(show, a_corrupt_state_dict_is_a_clear_error) {
  td_client *c = tdt_connect(&d);
  static const char past[] =
      "{\"tensors\":{},\"regions\":[{\"offset\":1200,\"nbytes\":100}]}";
  static const char outside[] =
      "{\"tensors\":{\"w\":{\"dtype\":\"float32\",\"shape\":[100],\"stride\":"
      "[1],\"storage_offset\":0,\"region\":0}},\"regions\":[{\"offset\":1024,"
      "\"nbytes\":24}]}";
  static const char cut[] = "{\"tensors\":{\"w\":{\"dtype\":\"float3";
  td_storage *s[4] = {
      put_sd(c, "sd/past", past, 0, 0),
      put_sd(c, "sd/outside", outside, 0, 0),
      put_sd(c, "sd/cut", cut, 0, 0),
      put_sd(c, "sd/long", past, (uint64_t)1 << 40, 0),
  };
  static const char *const says[4] = {
      "region 0 (bytes 1200 + 100) reaches past the blob's 1216 bytes",
      "tensor 'w': float32 view of region 0 (24 bytes): ",
      "manifest byte 32: premature end of input near '\"float3'",
      "a manifest of 1099511627776 bytes in a blob of 1216",
  };
  static const char *const keys[4] = {"sd/past", "sd/outside", "sd/cut",
                                      "sd/long"};
  tdt_run_result r;
  for (int i = 0; i < 4; i++) {
    char want[256];
    snprintf(want, sizeof(want),
             "tensorctl show: key '%s': a corrupt state dict: %s", keys[i],
             says[i]);
    show(&r, keys[i]);
    expect_error(&r, want);
    snprintf(want, sizeof(want),
             "(tensorctl show %" PRIu64 " shows its raw bytes)\n",
             td_storage_id(s[i]));
    expect_has(r.err, want);
    tdt_run_free(&r);
    show(&r, keys[i], "w", "[0]");
    expect_error(&r, "a corrupt state dict: ");
    tdt_run_free(&r);
    ctl(&r, "info", keys[i]);
    tdt_expect_ok(&r, "info of a corrupt state dict");
    snprintf(want, sizeof(want), "    state dict, corrupt: %s", says[i]);
    expect_has(r.out, want);
    tdt_run_free(&r);
    ctl(&r, "--json", "info", keys[i]);
    tdt_expect_ok(&r, "info --json of a corrupt state dict");
    tdt_expect_json_object(r.out);
    expect_has(r.out, ",\"state_dict\":{\"error\":\"");
    tdt_run_free(&r);
    char id[32];
    snprintf(id, sizeof(id), "%" PRIu64, td_storage_id(s[i]));
    show(&r, id);
    tdt_expect_ok(&r, "show ID of a corrupt state dict: its raw bytes");
    tdt_run_free(&r);
    cr_assert_eq(td_unpublish(c, keys[i]), 0);
    td_storage_release(s[i]);
  }
  /* Bytes that are not a state dict at all stay a plain uint8 view. */
  td_storage *plain = put(c, "sd/plain", "TDSTAT", 6, NULL);
  show(&r, "sd/plain");
  tdt_expect_ok(&r, "show of 6 bytes");
  expect_has(r.out, "values array([84, 68, 83, 84, 65, 84], dtype=uint8)");
  tdt_run_free(&r);
  show(&r, "sd/plain", "[0]", "x");
  cr_assert_eq(r.status, 2, "a third argument for a plain view: %d (%s)",
               r.status, r.err);
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, "sd/plain"), 0);
  td_storage_release(plain);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* The public reader that show and info use (td_state_dict_*), on its own:
 * the same tensors, their views of the storage, and refusals that say
 * why. */
TDT_TEST(show, td_state_dict_reads_what_show_lists) {
  td_client *c = tdt_connect(&d);
  td_storage *s = put_sd(c, "sd/api", SD_MANIFEST, 0, 64);
  td_storage *l;
  td_view v, t;
  cr_assert_eq(td_lookup(c, "sd/api", TD_RDONLY, 0, &l, &v), 0);
  cr_assert(td_state_dict_is(NULL, &v), "a blob by its shape");
  cr_assert(td_state_dict_is(l, &v));
  td_state_dict *sd;
  cr_assert_eq(td_state_dict_parse(l, &v, &sd), 0, "%s", td_last_error(NULL));
  cr_assert_eq(td_state_dict_count(sd), 5);
  cr_assert_eq(td_state_dict_nregions(sd), 3);
  size_t i;
  td_state_dict_entry e;
  cr_assert_eq(td_state_dict_find(sd, "enc.tied", &i), 0);
  cr_assert_eq(i, 1, "the manifest's order");
  cr_assert_eq(td_state_dict_tensor(sd, i, &e), 0);
  cr_assert_str_eq(e.name, "enc.tied");
  cr_assert_str_eq(e.dtype_name, "float32");
  cr_assert_eq(e.dtype, TD_FLOAT32);
  cr_assert_eq(e.ndim, 1);
  cr_assert_eq(e.shape[0], 3);
  cr_assert_eq(e.stride[0], 1);
  cr_assert_eq(e.storage_offset, 3);
  cr_assert_eq(e.region, 0);
  cr_assert_eq(e.itemsize, 4);
  cr_assert_eq(e.nbytes, 12);
  cr_assert_eq(e.reserved[0] | e.reserved[3], 0);
  /* Its view of the storage: the blob at byte 64, region 0 at 1024 of it. */
  cr_assert_eq(td_state_dict_view(sd, i, &t), 0, "%s", td_last_error(NULL));
  cr_assert_eq(t.offset, (64 + 1024) / 4 + 3);
  cr_assert_eq(td_view_check(&t, td_storage_nbytes(l)), 0);
  cr_assert_eq(((const float *)td_storage_data(l))[t.offset], 1.5f);
  uint64_t off = 0, nb = 0;
  cr_assert_eq(td_state_dict_region(sd, 2, &off, &nb), 0);
  cr_assert_eq(off, 1152);
  cr_assert_eq(nb, 4);
  cr_assert_eq(td_state_dict_region(sd, 3, NULL, NULL), TD_ERANGE);
  cr_assert_eq(td_state_dict_tensor(sd, 5, &e), TD_ERANGE);
  cr_assert_eq(td_state_dict_view(sd, 5, &t), TD_ERANGE);
  cr_assert_eq(td_state_dict_find(sd, "nope", &i), TD_ENOENT);
  expect_has(td_last_error(NULL), "no tensor 'nope'");
  td_state_dict_free(sd);
  td_state_dict_free(NULL);

  /* No blob: too short, outside the storage, other bytes, corrupt. */
  td_view u = v;
  u.shape[0] = 15;
  cr_assert(!td_state_dict_is(NULL, &u), "shorter than the header");
  cr_assert_eq(td_state_dict_parse(l, &u, &sd), TD_EINVAL);
  cr_assert_null(sd);
  expect_has(td_last_error(NULL), "is not a blob");
  u = v;
  u.offset = 65;
  cr_assert(!td_state_dict_is(l, &u), "past the storage's end");
  cr_assert_eq(td_state_dict_parse(l, &u, &sd), TD_ERANGE);
  expect_has(td_last_error(NULL), "reaches byte 1281 of a storage of 1280");
  u.offset = 0;
  cr_assert(!td_state_dict_is(l, &u), "zeros, not the magic");
  cr_assert_eq(td_state_dict_parse(l, &u, &sd), TD_EINVAL);
  expect_has(td_last_error(NULL), "do not begin with 'TDSTATE1'");
  td_storage *cut = put_sd(c, "sd/cut", "{\"tensors\":{\"w", 0, 0);
  cr_assert(td_state_dict_is(cut, &v) == 0, "v reaches past cut's end");
  u.shape[0] = SD_BYTES;
  cr_assert(td_state_dict_is(cut, &u));
  cr_assert_eq(td_state_dict_parse(cut, &u, &sd), TD_EINVAL);
  expect_has(td_last_error(NULL), "manifest byte 14: premature end of input");
  cr_assert_eq(td_unpublish(c, "sd/cut"), 0);
  cr_assert_eq(td_unpublish(c, "sd/api"), 0);
  td_storage_release(cut);
  td_storage_release(l);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* ---- a storage freed while shown ---- */

/* In a forked child: creates 32 MiB of float32 ones, publishes them as
 * show/big and holds them until killed. */
static int creator(void *arg) {
  int ready = *(int *)arg;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK(td_storage_create(c, 32 << 20, &s) == 0);
  float *f = td_storage_data(s);
  for (size_t i = 0; i < (32u << 20) / sizeof(float); i++)
    f[i] = 1.0f;
  td_view v = {TD_FLOAT32, 1, {(32 << 20) / 4}, {1}, 0};
  CHECK(td_publish(c, "show/big", s, &v) == 0);
  CHECK(write(ready, "x", 1) == 1);
  for (;;)
    pause();
}

static int no_storages(const tdt_daemon *dd) {
  return tdt_storages(dd) == 0;
}

TDT_TEST(show, storage_freed_while_shown_is_read_whole_then_goes) {
  int ready[2];
  cr_assert_eq(pipe2(ready, O_CLOEXEC), 0);
  pid_t maker = tdt_fork(creator, &ready[1]);
  close(ready[1]);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "the creator published");
  close(ready[0]);

  /* tensorctl stops once it holds show/big; stall[0] is its signal,
   * stall[1] its wait. */
  int sig[2], hold[2];
  cr_assert_eq(pipe2(sig, O_CLOEXEC), 0);
  cr_assert_eq(pipe2(hold, O_CLOEXEC), 0);
  tdt_child ch_ =
      tdt_cli_spawn((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,
                                          "show", "show/big", NULL},
                    (const int[]){sig[1], hold[0]});
  close(sig[1]);
  close(hold[0]);
  cr_assert_eq(read(sig[0], &ch, 1), 1, "tensorctl holds the storage");
  close(sig[0]);

  /* Every other reference goes: the key, and the creator (killed). */
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_unpublish(c, "show/big"), 0);
  kill(maker, SIGKILL);
  cr_assert_eq(tdt_wait(maker), 128 + SIGKILL);
  td_close(c);
  cr_assert_eq(tdt_segments(&d), 1, "tensorctl's reference keeps it");

  close(hold[1]); /* go on reading */
  tdt_run_result r;
  tdt_cli_collect(ch_, &r);
  tdt_expect_ok(&r, "show/big");
  expect_line(&r, "count  8388608   zeros 0   nan 0   inf 0");
  expect_line(&r, "min    1   max 1   mean 1   std 0");
  tdt_run_free(&r);
  cr_assert(tdt_until(no_storages, &d, 5000), "freed once tensorctl is done");
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

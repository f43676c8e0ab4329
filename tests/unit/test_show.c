/* test_show.c: tensorctl show's pieces without a daemon: shortest decimals,
 * numpy's repr (expected strings taken from numpy 1.24), statistics,
 * sampling and Python indexing with bad input. */
#include "show.h"

#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

/* ---- shortest decimals ---- */

/* The float16 whose bits are b (the decoders: test_view.c). */
static double f16(uint16_t b) {
  double x = NAN;
  td_elem_to_double(TD_FLOAT16, &b, &x);
  return x;
}

static void expect_shortest(td_dtype dt, double x, const char *want) {
  char b[64];
  td__show_shortest(dt, x, b, sizeof(b));
  cr_assert_str_eq(b, want, "%s %.17g: '%s', want '%s'", td_dtype_name(dt), x,
                   b, want);
}

Test(shortest, uses_the_dtypes_own_precision) {
  expect_shortest(TD_FLOAT16, f16(0x2e66), "0.1");
  expect_shortest(TD_FLOAT32, (double)0.1f, "0.1");
  expect_shortest(TD_FLOAT64, 0.1, "0.1");
  expect_shortest(TD_FLOAT64, (double)0.1f, "0.10000000149011612");
  expect_shortest(TD_FLOAT16, 65504, "65504");
  expect_shortest(TD_FLOAT16, ldexp(1, -24), "6e-08");
  expect_shortest(TD_BFLOAT16, 3.140625, "3.14");
  expect_shortest(TD_FLOAT8_E4M3FN, 448, "448");
  expect_shortest(TD_FLOAT8_E4M3FN, ldexp(1, -9), "0.002");
  expect_shortest(TD_FLOAT8_E5M2, 57344, "57344");
  expect_shortest(TD_FLOAT16, f16(0x3555), "0.3333");
  expect_shortest(TD_FLOAT64, 1e-5, "1e-05");
  expect_shortest(TD_FLOAT64, 1.5e300, "1.5e+300");
  expect_shortest(TD_FLOAT64, -2, "-2");
  expect_shortest(TD_FLOAT64, -0.0, "-0");
  expect_shortest(TD_FLOAT64, NAN, "nan");
  expect_shortest(TD_FLOAT64, -INFINITY, "-inf");
}

/* ---- numpy's repr ---- */

static td_view vec(td_dtype dt, int64_t n) {
  td_view v;
  cr_assert_eq(td_view_contiguous(dt, 1, &n, &v), 0);
  return v;
}

static void expect_repr(const td_view *v, const void *base, const char *want) {
  char b[2048];
  td__show_repr(v, base, b, sizeof(b));
  cr_assert_str_eq(b, want, "\n got  %s\n want %s", b, want);
}

Test(repr, floats_as_numpy_lays_them_out) {
  double a[] = {-1.23, 0.5, 2., NAN};
  uint16_t h[4] = {0xbcec, 0x3800, 0x4000, 0x7e00}; /* float16 of a */
  td_view v = vec(TD_FLOAT16, 4);
  expect_repr(&v, h, "array([-1.23,  0.5 ,  2.  ,   nan], dtype=float16)");
  double b[] = {1e-5, -1.5, 100};
  v = vec(TD_FLOAT64, 3);
  expect_repr(&v, b, "array([ 1.0e-05, -1.5e+00,  1.0e+02])");
  double c[] = {1e-5, 1.5, NAN, -INFINITY};
  v = vec(TD_FLOAT64, 4);
  expect_repr(&v, c, "array([1.0e-05, 1.5e+00,     nan,    -inf])");
  float f[] = {0.1f, 0.2f, 3.14159f};
  v = vec(TD_FLOAT32, 3);
  expect_repr(&v, f, "array([0.1    , 0.2    , 3.14159], dtype=float32)");
  double z[] = {-0.0, 0.0};
  v = vec(TD_FLOAT64, 2);
  expect_repr(&v, z, "array([-0.,  0.])");
  double nn[] = {NAN, NAN};
  expect_repr(&v, nn, "array([nan, nan])");
  double ni[] = {-INFINITY, 1.5};
  expect_repr(&v, ni, "array([-inf,  1.5])");
  double big[] = {1e16, 1};
  expect_repr(&v, big, "array([1.e+16, 1.e+00])");
  uint16_t m[3] = {0x2e66, 0x3266, 0x7bff}; /* 0.1, 0.2, 65504 */
  v = vec(TD_FLOAT16, 3);
  expect_repr(&v, m, "array([1.00e-01, 2.00e-01, 6.55e+04], dtype=float16)");
  uint16_t mx[1] = {0x7bff};
  v = vec(TD_FLOAT16, 1);
  expect_repr(&v, mx, "array([65504.], dtype=float16)");
  (void)a;
}

/* numpy's default precision: at most 8 digits after the point (or after
 * the first digit, in scientific), rounded from the exact value. */
Test(repr, floats_stop_at_eight_digits_after_the_point) {
  float f[] = {-0.104766846f, 2.9438195f, 0.74072933f,
               3.6352563f,    0.3882146f, 0.08649683f};
  td_view v = vec(TD_FLOAT32, 6);
  expect_repr(&v, f,
              "array([-0.10476685,  2.9438195 ,  0.74072933,  3.6352563 ,  "
              "0.3882146 ,  0.08649683], dtype=float32)");
  v = vec(TD_FLOAT64, 2);
  double tie[] = {0x1p-9, 1.0}; /* 0.001953125: a tie, to even */
  expect_repr(&v, tie, "array([0.00195312, 1.        ])");
  double carry[] = {0.999999999, 2.0};
  expect_repr(&v, carry, "array([1., 2.])");
  double neg[] = {-0.999999999, 0.5};
  expect_repr(&v, neg, "array([-1. ,  0.5])");
  double sci[] = {1.234567891e-5, 1.0};
  expect_repr(&v, sci, "array([1.23456789e-05, 1.00000000e+00])");
  double sci_carry[] = {9.9999999999e5, 1e-3};
  expect_repr(&v, sci_carry, "array([1.e+06, 1.e-03])");
}

Test(repr, long_views_show_three_at_each_end) {
  static float r[2000];
  for (int i = 0; i < 2000; i++)
    r[i] = (float)i;
  td_view v = vec(TD_FLOAT32, 2000);
  expect_repr(&v, r,
              "array([0.000e+00, 1.000e+00, 2.000e+00, ..., 1.997e+03, "
              "1.998e+03, 1.999e+03], dtype=float32)");
}

Test(repr, complex_as_numpy_pairs) {
  double c[] = {1, 2, 3.5, -4, NAN, 1};
  td_view v = vec(TD_COMPLEX128, 3);
  expect_repr(&v, c, "array([1. +2.j, 3.5-4.j, nan+1.j])");
  float f[] = {1, 0, 2, -1.5f};
  v = vec(TD_COMPLEX64, 2);
  expect_repr(&v, f, "array([1.+0.j , 2.-1.5j], dtype=complex64)");
}

Test(repr, ints_and_bools) {
  uint8_t b[] = {1, 0};
  td_view v = vec(TD_BOOL, 2);
  expect_repr(&v, b, "array([ True, False])");
  int8_t i8[] = {1, -2, 44};
  v = vec(TD_INT8, 3);
  expect_repr(&v, i8, "array([ 1, -2, 44], dtype=int8)");
  uint64_t u[] = {1, UINT64_MAX};
  v = vec(TD_UINT64, 2);
  expect_repr(&v, u,
              "array([                   1, 18446744073709551615], "
              "dtype=uint64)");
  int64_t l[] = {INT64_MAX, INT64_MIN};
  v = vec(TD_INT64, 2);
  expect_repr(&v, l, "array([ 9223372036854775807, -9223372036854775808])");
}

Test(repr, float8_with_their_specials) {
  uint8_t e4[] = {0x38, 0x7e, 0x7f, 0xb8}; /* 1, 448, nan, -1 */
  td_view v = vec(TD_FLOAT8_E4M3FN, 4);
  expect_repr(&v, e4, "array([  1., 448.,  nan,  -1.], dtype=float8_e4m3fn)");
  uint8_t e5[] = {0x3c, 0x7c, 0xfc, 0x7d}; /* 1, inf, -inf, nan */
  v = vec(TD_FLOAT8_E5M2, 4);
  expect_repr(&v, e5, "array([  1.,  inf, -inf,  nan], dtype=float8_e5m2)");
}

Test(repr, empty_and_zero_d) {
  int64_t shape[2] = {0, 3};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  expect_repr(&v, "", "array([], shape=(0, 3), dtype=float32)");
  v = vec(TD_FLOAT32, 0);
  expect_repr(&v, "", "array([], dtype=float32)");
  uint16_t h = 0x3e00; /* 1.5 */
  cr_assert_eq(td_view_contiguous(TD_FLOAT16, 0, NULL, &v), 0);
  expect_repr(&v, &h, "array(1.5, dtype=float16)");
}

Test(repr, follows_strides) {
  int32_t a[6] = {0, 1, 2, 3, 4, 5};
  int64_t shape[2] = {2, 3};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), 0);
  expect_repr(&v, a, "array([0, 3, 1, 4, 2, 5], dtype=int32)");
}

/* ---- statistics ---- */

Test(stats, floats_leave_nan_out_and_count_inf) {
  double x[] = {1, 2, 3, 4, NAN, 0, -INFINITY};
  td_view v = vec(TD_FLOAT64, 4);
  td__show_stats st;
  cr_assert_eq(td__show_stats_read(&v, x, 0, &st), 0);
  cr_assert_eq(st.count, 4);
  cr_assert_eq(st.sampled, 0);
  cr_assert_eq(st.fmin, 1);
  cr_assert_eq(st.fmax, 4);
  cr_assert_float_eq(st.mean, 2.5, 1e-12);
  cr_assert_float_eq(td__show_std(&st), sqrt(1.25), 1e-12);
  v = vec(TD_FLOAT64, 7);
  cr_assert_eq(td__show_stats_read(&v, x, 0, &st), 0);
  cr_assert_eq(st.nan, 1);
  cr_assert_eq(st.inf, 1);
  cr_assert_eq(st.zeros, 1);
  cr_assert_eq(st.nvalues, 6);
  cr_assert_eq(st.fmin, -INFINITY);
}

Test(stats, int64_extremes_are_exact) {
  int64_t x[] = {INT64_MIN, 0, INT64_MAX, INT64_MAX - 1};
  td_view v = vec(TD_INT64, 4);
  td__show_stats st;
  cr_assert_eq(td__show_stats_read(&v, x, 0, &st), 0);
  cr_assert_eq(st.imin, INT64_MIN);
  cr_assert_eq(st.imax, INT64_MAX);
  cr_assert_eq(st.zeros, 1);
  uint64_t u[] = {UINT64_MAX, UINT64_MAX - 1, 7};
  v = vec(TD_UINT64, 3);
  cr_assert_eq(td__show_stats_read(&v, u, 0, &st), 0);
  cr_assert_eq(st.umin, 7);
  cr_assert_eq(st.umax, UINT64_MAX);
}

Test(stats, welford_stays_accurate_on_a_large_offset) {
  static double x[1000];
  for (int i = 0; i < 1000; i++)
    x[i] = 1e9 + (i % 2 ? 1 : -1);
  td_view v = vec(TD_FLOAT64, 1000);
  td__show_stats st;
  cr_assert_eq(td__show_stats_read(&v, x, 0, &st), 0);
  cr_assert_float_eq(td__show_std(&st), 1.0, 1e-9);
}

Test(stats, sample_reads_evenly_spaced_elements) {
  static int32_t x[100];
  for (int i = 0; i < 100; i++)
    x[i] = i;
  td_view v = vec(TD_INT32, 100);
  td__show_stats st;
  cr_assert_eq(td__show_stats_read(&v, x, 10, &st), 0);
  cr_assert_eq(st.count, 10);
  cr_assert_eq(st.total, 100);
  cr_assert(st.sampled);
  cr_assert_eq(st.imin, 0);
  cr_assert_eq(st.imax, 90);
  cr_assert_float_eq(st.mean, 45, 1e-9);
  cr_assert_eq(td__show_stats_read(&v, x, 1000, &st), 0);
  cr_assert_eq(st.count, 100, "a sample past the size reads all");
  cr_assert(!st.sampled);
}

Test(stats, bool_complex_and_empty) {
  uint8_t b[] = {1, 0, 1, 1};
  td_view v = vec(TD_BOOL, 4);
  td__show_stats st;
  cr_assert_eq(td__show_stats_read(&v, b, 0, &st), 0);
  cr_assert_eq(st.ntrue, 3);
  cr_assert_eq(st.zeros, 1);
  double c[] = {1, 1, 3, -1, NAN, 0, 0, 0};
  v = vec(TD_COMPLEX128, 4);
  cr_assert_eq(td__show_stats_read(&v, c, 0, &st), 0);
  cr_assert_eq(st.nan, 1);
  cr_assert_eq(st.zeros, 1);
  cr_assert_eq(st.nvalues, 3);
  cr_assert_float_eq(st.mean, 4.0 / 3, 1e-12);
  cr_assert_float_eq(st.mean_im, 0, 1e-12);
  v = vec(TD_FLOAT32, 0);
  cr_assert_eq(td__show_stats_read(&v, "", 0, &st), 0);
  cr_assert_eq(st.count, 0);
  cr_assert(isnan(td__show_std(&st)));
}

/* ---- indexing ---- */

static td_view cube(void) {
  int64_t shape[3] = {2, 3, 4};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 3, shape, &v), 0);
  return v;
}

static void expect_index(const char *expr, int32_t ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset) {
  td_view v = cube();
  char msg[256] = "";
  cr_assert_eq(td__show_index(&v, expr, msg, sizeof(msg)), 0, "%s: %s", expr,
               msg);
  cr_assert_eq(v.ndim, ndim, "%s: ndim %d", expr, v.ndim);
  for (int32_t i = 0; i < ndim; i++) {
    cr_assert_eq(v.shape[i], shape[i], "%s: shape[%d]", expr, i);
    if (stride != NULL)
      cr_assert_eq(v.stride[i], stride[i], "%s: stride[%d]", expr, i);
  }
  cr_assert_eq(v.offset, offset, "%s: offset %lld", expr, (long long)v.offset);
}

Test(index, python_syntax) {
  expect_index("[0, :, 2:5]", 2, (int64_t[]){3, 2}, (int64_t[]){4, 1}, 2);
  expect_index("[..., -1]", 2, (int64_t[]){2, 3}, (int64_t[]){12, 4}, 3);
  expect_index("[1, ...]", 2, (int64_t[]){3, 4}, (int64_t[]){4, 1}, 12);
  expect_index("[::2, 1:, ::3]", 3, (int64_t[]){1, 2, 2}, (int64_t[]){24, 4, 3},
               4);
  expect_index("[None, 1]", 3, (int64_t[]){1, 3, 4}, NULL, 12);
  expect_index("[-1, -1, -1]", 0, NULL, NULL, 23);
  expect_index("1", 2, (int64_t[]){3, 4}, (int64_t[]){4, 1}, 12);
  expect_index("[0,]", 2, (int64_t[]){3, 4}, NULL, 0);
  expect_index("[:, 5:9]", 3, (int64_t[]){2, 0, 4}, NULL, 0);
  expect_index("[ 1 , : , None ]", 3, (int64_t[]){3, 1, 4}, NULL, 12);
}

static void expect_bad(const char *expr, int code, const char *needle) {
  td_view v = cube(), before = v;
  char msg[256] = "";
  cr_assert_eq(td__show_index(&v, expr, msg, sizeof(msg)), code,
               "%s: want %s (%s)", expr, td_err_name(code), msg);
  cr_assert(strstr(msg, needle) != NULL, "%s: '%s' does not say '%s'", expr,
            msg, needle);
  cr_assert(memcmp(&v, &before, sizeof(v)) == 0, "%s: view changed", expr);
}

Test(index, bad_input_names_the_part) {
  expect_bad("[0, 9]", TD_ERANGE,
             "index '[0, 9]': dim 1: index 9 out of range for size 3");
  expect_bad("[..., -5]", TD_ERANGE, "dim 2: index -5 out of range for size 4");
  expect_bad("[0, 0, 0, 0]", TD_EINVAL, "4 indices for a view of 3 dims");
  expect_bad("[::-1]", TD_EINVAL, "dim 0: step -1 (steps must be 1 or more)");
  expect_bad("[::0]", TD_EINVAL, "step 0");
  expect_bad("[a]", TD_EINVAL, "'a' is not an int");
  expect_bad("[0", TD_EINVAL, "no ']'");
  expect_bad("[]", TD_EINVAL, "is not an int");
  expect_bad("[0,,1]", TD_EINVAL, "is not an int");
  expect_bad("[..., ...]", TD_EINVAL, "more than one '...'");
  expect_bad("[1:2:3:4]", TD_EINVAL, "'1:2:3:4'");
  expect_bad("[99999999999999999999]", TD_EINVAL, "is not an int");
  expect_bad("[1.5]", TD_EINVAL, "'1.5'");
  td_view z;
  char msg[256];
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 0, NULL, &z), 0);
  cr_assert_eq(td__show_index(&z, "[0]", msg, sizeof(msg)), TD_EINVAL);
  cr_assert(strstr(msg, "1 index for a view of 0 dims") != NULL, "%s", msg);
  cr_assert_eq(td__show_index(&z, "[..., None]", msg, sizeof(msg)), 0, "%s",
               msg);
  cr_assert_eq(z.ndim, 1, "a 0-d view takes '...' and None");
}

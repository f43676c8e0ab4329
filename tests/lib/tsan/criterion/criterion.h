/* criterion.h (ThreadSanitizer builds only): the part of Criterion's API
 * the multi-threaded tests use, over the small runner in runner.c. Criterion
 * itself cannot start under ThreadSanitizer: its inheritable arena is mapped
 * at fixed addresses TSan reserves for itself, and it aborts with "Could not
 * initialize inheritable arena" (Criterion issue #274). */
#ifndef TD_TSAN_CRITERION_H
#define TD_TSAN_CRITERION_H

#include <stdio.h>

struct tdc_suite {
  const char *name;
  void (*init)(void);
  void (*fini)(void);
  double timeout;
  struct tdc_suite *next;
};

struct tdc_test {
  const char *suite;
  const char *name;
  void (*fn)(void);
  void (*init)(void);
  void (*fini)(void);
  double timeout;
  int sentinel_; /* as in Criterion: lets a macro end the option list */
  struct tdc_test *next;
};

void tdc_add_suite(struct tdc_suite *s);
void tdc_add_test(struct tdc_test *t);
/* Reports a failed check; a fatal one ends the test (its fini still runs).
 * Checks run on the test's own thread. fmt starts with a space. */
void tdc_fail(int fatal, const char *file, int line, const char *expr,
              const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Ends the test as skipped. fmt starts with a space. */
void tdc_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)))
__attribute__((noreturn));

#define TestSuite(sname, ...)                                                  \
  static struct tdc_suite tdc_suite_##sname = {.name = #sname, __VA_ARGS__};   \
  __attribute__((constructor)) static void tdc_reg_suite_##sname(void) {       \
    tdc_add_suite(&tdc_suite_##sname);                                         \
  }

#define Test(sname, tname, ...) CR_TEST_BASE(sname, tname, __VA_ARGS__)
/* What Test expands to, under the name Criterion gives it (harness.h's
 * TDT_TEST builds on it). */
#define CR_TEST_BASE(sname, tname, ...)                                        \
  static void tdc_fn_##sname##_##tname(void);                                  \
  static struct tdc_test tdc_test_##sname##_##tname = {                        \
      .suite = #sname,                                                         \
      .name = #tname,                                                          \
      .fn = tdc_fn_##sname##_##tname,                                          \
      __VA_ARGS__};                                                            \
  __attribute__((constructor)) static void tdc_reg_##sname##_##tname(void) {   \
    tdc_add_test(&tdc_test_##sname##_##tname);                                 \
  }                                                                            \
  static void tdc_fn_##sname##_##tname(void)

/* The message, if any, is a string literal and its arguments; it gets a
 * leading space so that the format is never empty. */
#define tdc_check(fatal, cond, expr, ...)                                      \
  do {                                                                         \
    if (!(cond))                                                               \
      tdc_fail(fatal, __FILE__, __LINE__, expr, " " __VA_ARGS__);              \
  } while (0)

#define cr_assert(c, ...) tdc_check(1, (c), #c, __VA_ARGS__)
#define cr_expect(c, ...) tdc_check(0, (c), #c, __VA_ARGS__)
#define cr_assert_not(c, ...) tdc_check(1, !(c), "!(" #c ")", __VA_ARGS__)
#define cr_expect_not(c, ...) tdc_check(0, !(c), "!(" #c ")", __VA_ARGS__)
#define tdc_cmp(f, a, op, b, ...)                                              \
  tdc_check(f, (a)op(b), #a " " #op " " #b, __VA_ARGS__)
#define cr_assert_eq(a, b, ...) tdc_cmp(1, a, ==, b, __VA_ARGS__)
#define cr_expect_eq(a, b, ...) tdc_cmp(0, a, ==, b, __VA_ARGS__)
#define cr_assert_neq(a, b, ...) tdc_cmp(1, a, !=, b, __VA_ARGS__)
#define cr_expect_neq(a, b, ...) tdc_cmp(0, a, !=, b, __VA_ARGS__)
#define cr_assert_lt(a, b, ...) tdc_cmp(1, a, <, b, __VA_ARGS__)
#define cr_expect_lt(a, b, ...) tdc_cmp(0, a, <, b, __VA_ARGS__)
#define cr_assert_leq(a, b, ...) tdc_cmp(1, a, <=, b, __VA_ARGS__)
#define cr_expect_leq(a, b, ...) tdc_cmp(0, a, <=, b, __VA_ARGS__)
#define cr_assert_gt(a, b, ...) tdc_cmp(1, a, >, b, __VA_ARGS__)
#define cr_expect_gt(a, b, ...) tdc_cmp(0, a, >, b, __VA_ARGS__)
#define cr_assert_geq(a, b, ...) tdc_cmp(1, a, >=, b, __VA_ARGS__)
#define cr_expect_geq(a, b, ...) tdc_cmp(0, a, >=, b, __VA_ARGS__)
#define cr_assert_null(p, ...)                                                 \
  tdc_check(1, (p) == NULL, #p " is NULL", __VA_ARGS__)
#define cr_expect_null(p, ...)                                                 \
  tdc_check(0, (p) == NULL, #p " is NULL", __VA_ARGS__)
#define cr_assert_not_null(p, ...)                                             \
  tdc_check(1, (p) != NULL, #p " is not NULL", __VA_ARGS__)
#define cr_expect_not_null(p, ...)                                             \
  tdc_check(0, (p) != NULL, #p " is not NULL", __VA_ARGS__)
#define cr_assert_str_eq(a, b, ...)                                            \
  tdc_check(1, strcmp((a), (b)) == 0, #a " equals " #b, __VA_ARGS__)
#define cr_expect_str_eq(a, b, ...)                                            \
  tdc_check(0, strcmp((a), (b)) == 0, #a " equals " #b, __VA_ARGS__)
#define cr_assert_fail(...) tdc_check(1, 0, "failure", __VA_ARGS__)
#define cr_expect_fail(...) tdc_check(0, 0, "failure", __VA_ARGS__)
#define cr_skip_test(...) tdc_skip(" " __VA_ARGS__)

#endif /* TD_TSAN_CRITERION_H */

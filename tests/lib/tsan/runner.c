/* runner.c (ThreadSanitizer builds only): runs the tests registered through
 * the Criterion subset in criterion/criterion.h, each in a child process of
 * its own with its suite's init and fini and a time limit, like Criterion;
 * exits non-zero if any failed. Arguments: --filter SUITE/NAME (shell
 * pattern); Criterion's --jobs and --timeout are accepted and ignored. */
#include "criterion/criterion.h"

#include <fnmatch.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static struct tdc_suite *suites;
static struct tdc_test *tests;
static sigjmp_buf bail;
static int failed;

void tdc_add_suite(struct tdc_suite *s) {
  s->next = suites;
  suites = s;
}

void tdc_add_test(struct tdc_test *t) {
  t->next = tests;
  tests = t;
}

void tdc_fail(int fatal, const char *file, int line, const char *expr,
              const char *fmt, ...) {
  fprintf(stderr, "[----] %s:%d: %s failed: %s\n", file, line,
          fatal ? "assertion" : "expectation", expr);
  if (fmt[1] != '\0') {
    va_list ap;
    va_start(ap, fmt);
    fputs("[----]  ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
  }
  failed = 1;
  if (fatal)
    siglongjmp(bail, 1);
}

#define SKIPPED 77

void tdc_skip(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("[SKIP]", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(NULL);
  _exit(SKIPPED);
}

static struct tdc_suite *suite_of(const struct tdc_test *t) {
  for (struct tdc_suite *s = suites; s != NULL; s = s->next)
    if (strcmp(s->name, t->suite) == 0)
      return s;
  return NULL;
}

/* In the child: init, the test, fini (also after a fatal failure). */
static void run_child(const struct tdc_test *t, const struct tdc_suite *s) {
  void (*init)(void) = t->init ? t->init : s ? s->init : NULL;
  void (*fini)(void) = t->fini ? t->fini : s ? s->fini : NULL;
  if (sigsetjmp(bail, 0) == 0) {
    if (init)
      init();
    t->fn();
  }
  if (sigsetjmp(bail, 0) == 0 && fini)
    fini();
  fflush(NULL);
  exit(failed);
}

int main(int argc, char **argv) {
  const char *filter = "*";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--filter") == 0 && i + 1 < argc)
      filter = argv[++i];
    else if (strncmp(argv[i], "--filter=", 9) == 0)
      filter = argv[i] + 9;
  }
  int ran = 0, bad = 0;
  for (struct tdc_test *t = tests; t != NULL; t = t->next) {
    char full[256];
    snprintf(full, sizeof(full), "%s/%s", t->suite, t->name);
    if (fnmatch(filter, full, 0) != 0)
      continue;
    const struct tdc_suite *s = suite_of(t);
    double limit = t->timeout > 0        ? t->timeout
                   : s && s->timeout > 0 ? s->timeout
                                         : 60;
    fprintf(stderr, "[RUN ] %s::%s\n", t->suite, t->name);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return 2;
    }
    if (pid == 0) {
      alarm((unsigned)limit + 1);
      run_child(t, s);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0)
      ;
    ran++;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
      fprintf(stderr, "[PASS] %s::%s\n", t->suite, t->name);
    } else if (WIFEXITED(st) && WEXITSTATUS(st) == SKIPPED) {
      fprintf(stderr, "[SKIP] %s::%s\n", t->suite, t->name);
    } else {
      bad++;
      if (WIFSIGNALED(st))
        fprintf(stderr, "[FAIL] %s::%s: killed by signal %d%s\n", t->suite,
                t->name, WTERMSIG(st),
                WTERMSIG(st) == SIGALRM ? " (timed out)" : "");
      else
        fprintf(stderr, "[FAIL] %s::%s: exit %d\n", t->suite, t->name,
                WEXITSTATUS(st));
    }
  }
  fprintf(stderr, "[====] Synthesis: Tested: %d | Failing: %d\n", ran, bad);
  return bad ? 1 : 0;
}

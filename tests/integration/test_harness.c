/* test_harness.c: the harness's own promises, which every integration test
 * leans on. */
#include "harness.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>

TestSuite(harness, .timeout = 60);

typedef struct {
  int out;   /* the test's pipe: the child's pid */
  int ready; /* the dying test's pipe: the child is parked */
} orphan_arg;

static int write_pid_and_pause(void *p) {
  orphan_arg *a = p;
  pid_t self = getpid();
  if (write(a->out, &self, sizeof(self)) != (ssize_t)sizeof(self) ||
      write(a->ready, "r", 1) != 1)
    return 1;
  close(a->out);
  close(a->ready);
  for (;;)
    pause();
}

/* Stands for a test's process: forks a child with tdt_fork that parks in
 * pause(), as tests' holders do, then, once it is parked, dies as a failed
 * assertion ends a test, without reaping it. */
static int failing_test(void *p) {
  int q[2];
  if (pipe(q) < 0)
    return 2;
  orphan_arg a = {*(int *)p, q[1]};
  tdt_fork(write_pid_and_pause, &a);
  char x;
  if (read(q[0], &x, 1) != 1)
    return 2;
  _exit(1);
}

/* A test that fails while its children wait must not leave them behind:
 * they would hold ctest's output pipe open (the run hangs until ctest's
 * timeout) and keep their clients connected. This process adopts the
 * orphan (a subreaper), so its end can be awaited without any timing: a
 * child that outlives its parent hangs here until Criterion's timeout,
 * which fails the test. */
TDT_TEST(harness, a_forked_child_dies_with_the_test_that_made_it) {
  cr_assert_eq(prctl(PR_SET_CHILD_SUBREAPER, 1), 0, "%s", strerror(errno));
  int p[2];
  cr_assert_eq(pipe(p), 0);
  pid_t test = tdt_fork(failing_test, &p[1]);
  close(p[1]);
  pid_t child = 0;
  cr_assert_eq(read(p[0], &child, sizeof(child)), (ssize_t)sizeof(child));
  close(p[0]);
  cr_assert_eq(tdt_wait(test), 1);
  int status = 0;
  pid_t got;
  while ((got = waitpid(child, &status, 0)) < 0 && errno == EINTR)
    ;
  cr_assert_eq(got, child, "waitpid: %s", strerror(errno));
  cr_assert(WIFSIGNALED(status), "the orphan exited (status 0x%x)", status);
  cr_assert_eq(WTERMSIG(status), SIGKILL);
}

/* harness.h: a real tensord on a temporary socket, forked clients, and the
 * leak checks every integration test ends with. */
#ifndef TD_TEST_HARNESS_H
#define TD_TEST_HARNESS_H

#include "tensord.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct tdt_daemon {
  pid_t pid;
  char dir[64];   /* /tmp/tensord-test.<TDT_TAG>.XXXXXX */
  char sock[108]; /* dir/tensord.sock */
  char log[128];  /* dir/tensord.log: the daemon's stderr */
  uint64_t instance;
  int fds_before; /* the test process's open fds before the daemon */
  int inherited;  /* started with a socket passed as systemd does */
} tdt_daemon;

/* Starts tensord on a fresh socket with extra arguments (NULL-terminated, may
 * be NULL) and waits for its READY=1; asserts on failure. d must outlive the
 * test body (static storage): TDT_TEST stops it after the body returns. */
void tdt_start(tdt_daemon *d, const char *const *args);
/* Starts another tensord on d's socket, directory and log with args, once
 * d's own is gone without tdt_kill (which would remove them: SIGKILL and
 * tdt_wait, say), and waits for its READY=1 as tdt_start does; d gets its
 * pid and instance, and TDT_TEST stops it as it would d's first. */
void tdt_restart(tdt_daemon *d, const char *const *args);
/* Starts a tensord on d's socket and log with args and returns its pid at
 * once, waiting for nothing: for a start that is meant to fail. */
pid_t tdt_spawn(const tdt_daemon *d, const char *const *args);
/* Like tdt_start, but hands tensord an already listening socket the way
 * systemd does (LISTEN_FDS=1, LISTEN_PID, fd 3). */
void tdt_start_inherited(tdt_daemon *d);
/* Stops tensord with SIGTERM and asserts: it exits 0 (under make valgrind:
 * with no valgrind error), leaves none of its segments in /dev/shm, removes
 * its socket, and the test leaked no fd. Whatever it left is removed before
 * the assertions. */
void tdt_stop(tdt_daemon *d);
/* tdt_stop for a tensord the test has already sent SIGTERM: waits for it
 * and asserts the same. */
void tdt_stopped(tdt_daemon *d);
/* Kills tensord with SIGKILL (no checks); removes what it leaves. */
void tdt_kill(tdt_daemon *d);
/* Segments of a daemon instance's storages in /dev/shm now. */
int tdt_segments_of(uint64_t instance);
/* Sets path (len bytes) to the /dev/shm path of the segment of storage id
 * of instance, whatever tail its name has after the id. Returns 1, or 0 if
 * there is no such segment (path then unchanged). */
int tdt_segment_path(uint64_t instance, uint64_t id, char *path, size_t len);
/* Segments in its recycling pool ("tensord.<instance>-pool.<n>-<tail>"), which
 * tdt_stop also requires gone and tdt_kill removes. */
int tdt_pooled_of(uint64_t instance);
/* Removes the files in dir (a test's temporary directory; "" ok), the
 * empty directories among them, and dir itself. */
void tdt_rmdir(const char *dir);
/* Unlinks every segment of a daemon instance left in /dev/shm, pooled
 * ones too. */
void tdt_unlink_segments(uint64_t instance);

/* TDT_TEST(suite, name, options...) is Criterion's Test for integration
 * tests, the only form they may use. When the body returns, every tensord
 * the test started (tdt_start) and has not stopped or killed is stopped with
 * tdt_stop, inside the test, so a leak fails the test it belongs to.
 * Criterion ignores an assertion that fails in a .fini (it prints "Assertion
 * Failed" and counts the test as passed), so no check may live there. A body
 * that fails an assertion ends before that stop; the suite's .fini =
 * tdt_cleanup (or a teardown that calls it) kills what is left. */
#define TDT_TEST(...) TDT_TEST_(__VA_ARGS__, .sentinel_ = 0)
#define TDT_TEST_(Suite, Name, ...)                                            \
  static void tdt_body_##Suite##_##Name(void);                                 \
  CR_TEST_BASE(Suite, Name, __VA_ARGS__) {                                     \
    tdt_body_##Suite##_##Name();                                               \
    tdt_stop_all();                                                            \
  }                                                                            \
  static void tdt_body_##Suite##_##Name(void)

/* A plain Test in a file that uses the harness would skip those checks. */
#undef Test
#define Test(...)                                                              \
  _Static_assert(0, "integration tests are TDT_TEST(suite, name, ...), which " \
                    "checks the daemons they started (see harness.h)")

/* Stops, with tdt_stop, every tensord this test started and has not
 * stopped or killed, the last started first. TDT_TEST calls it. */
void tdt_stop_all(void);
/* For .fini: kills every tensord this test started and has not stopped or
 * killed, and removes what each left; asserts nothing. */
void tdt_cleanup(void);

/* Makes a temporary directory /tmp/tensord-test.<TDT_TAG>.XXXXXX in dir (64
 * bytes), which tests/check-clean.sh knows as this build's; asserts. */
void tdt_mkdtemp(char *dir);
/* Records that a tensord of this build's tests ran as instance, for
 * tests/check-clean.sh, which looks for its segments after the suite. The
 * harness records those it starts; a test that starts one itself calls it. */
void tdt_note_instance(uint64_t instance);

/* Makes the tensords this test starts next preload lib (LD_PRELOAD: a shim
 * of tests/lib), an ASan build's too, whose runtime insists on coming first
 * in the list (its check is turned off in ASAN_OPTIONS).
 * tdt_preload(NULL) restores LD_PRELOAD and ASAN_OPTIONS as they were. */
void tdt_preload(const char *lib);

/* Connects to d; asserts. */
td_client *tdt_connect(const tdt_daemon *d);
/* Creates nbytes on c's process's cuda:index (td_storage_create_ex).
 * Returns its result. */
int tdt_create_cuda(td_client *c, int64_t index, size_t nbytes, td_storage **s);
/* Segments of d's instance in /dev/shm now. */
int tdt_segments(const tdt_daemon *d);
/* Storages d has now (asserts the stat call works). */
uint64_t tdt_storages(const tdt_daemon *d);
/* Polls pred until it is true or timeout_ms passes (CLOCK_MONOTONIC);
 * returns pred's last. Only for conditions that must come true: the
 * deadline bounds a hang, so give it room for a loaded machine (the suite
 * at -j, ASan), and keep it well inside the test's Criterion timeout so a
 * failure ends the test, and its .fini cleans up, before Criterion kills
 * it. A "stays false" check needs an event to wait for instead. */
int tdt_until(int (*pred)(const tdt_daemon *), const tdt_daemon *d,
              int timeout_ms);
int tdt_no_segments(const tdt_daemon *d);
int tdt_open_fds(void);
/* Whether d's log contains needle. */
int tdt_log_has(const tdt_daemon *d, const char *needle);

/* Forks a child that runs fn(arg) and exits with its return value (0 for
 * success); returns the child's pid. The child is killed (SIGKILL) if the
 * test's process ends first, so a failing test leaves no child behind. Use
 * CHECK in fn, not cr_assert. */
pid_t tdt_fork(int (*fn)(void *), void *arg);
/* Forks as tdt_fork does, but the child waits before fn(arg) until the
 * parent calls tdt_go(pid). For CUDA: the driver allows a child of fork()
 * nothing once its parent has initialised CUDA, so a test whose peers use
 * CUDA forks them with this before its own first CUDA call and lets each go
 * when its turn comes. At tdt_go the child's *arg (size bytes; 0: as at the
 * fork) is overwritten with the parent's *arg as it is then, so a peer
 * sees what the parent filled in since (an id, a flag); a pointer in it
 * must still point to what the child inherited (a string literal, a
 * buffer filled before the fork). At most 16 children held at once. */
pid_t tdt_fork_held(int (*fn)(void *), void *arg, size_t size);
/* Lets pid, a child of tdt_fork_held, run; returns pid, for tdt_wait. */
pid_t tdt_go(pid_t pid);
/* Waits for pid; returns its exit status, or 128 + the signal that ended
 * it. */
int tdt_wait(pid_t pid);
/* Sleeps ms milliseconds (an interrupted sleep ends early). */
void tdt_sleep_ms(int ms);

/* Inside a forked child: on failure, say where and return 1. */
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: child check failed: %s\n", __FILE__, __LINE__,   \
              #cond);                                                          \
      return 1;                                                                \
    }                                                                          \
  } while (0)

/* Inside a forked child: the call returns code; on failure say what came
 * instead, with td_last_error(c), and return 1. */
#define CHECK_ERR(c, call, code)                                               \
  do {                                                                         \
    int e_ = (call);                                                           \
    if (e_ != (code)) {                                                        \
      fprintf(stderr, "%s:%d: %s: expected %s, got %s (%d): %s\n", __FILE__,   \
              __LINE__, #call, (code) ? td_err_name(code) : "0",               \
              e_ ? td_err_name(e_) : "0", e_, td_last_error(c));               \
      return 1;                                                                \
    }                                                                          \
  } while (0)

/* Inside a forked child: the last error of c names needle. */
#define CHECK_MSG(c, needle)                                                   \
  do {                                                                         \
    if (strstr(td_last_error(c), (needle)) == NULL) {                          \
      fprintf(stderr, "%s:%d: message '%s' does not name '%s'\n", __FILE__,    \
              __LINE__, td_last_error(c), (needle));                           \
      return 1;                                                                \
    }                                                                          \
  } while (0)

/* A raw connection that has said Hello, for sending hand-made frames. */
int tdt_raw_connect(const tdt_daemon *d, int hello);

#endif /* TD_TEST_HARNESS_H */

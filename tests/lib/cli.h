/* cli.h: running tensorctl from a test and capturing what it writes, a
 * well-formedness check for its --json documents, and a client holding a
 * storage for it to show. */
#ifndef TD_TEST_CLI_H
#define TD_TEST_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* What a finished run wrote, and how it ended. */
typedef struct tdt_run_result {
  int status; /* exit status, or 128 + signal */
  char *out;  /* stdout, NUL-terminated, malloc'd: tdt_run_free */
  size_t out_len;
  char err[8192]; /* stderr, NUL-terminated, cut at the size */
} tdt_run_result;

/* A started program: its pid and the read ends of its stdout and stderr. */
typedef struct tdt_child {
  pid_t pid;
  int out, err;
} tdt_child;

/* Starts argv (argv[0] a path) with stdout and stderr to pipes and
 * TENSORD_SOCKET unset, so that only --socket names the daemon. stall:
 * NULL, or two fds (the write end tensorctl signals on, the read end it
 * waits on) passed to it as TENSORCTL_TEST_STALL (client/tensorctl/show.c).
 * Asserts on failure. */
tdt_child tdt_cli_spawn(const char *const *argv, const int *stall);
/* Reads ch's stdout and stderr until both close, into *r, then waits for
 * it; kills it after 30 s without output. Closes ch's fds. */
void tdt_cli_collect(tdt_child ch, tdt_run_result *r);
/* tdt_cli_collect(tdt_cli_spawn(argv, NULL), r). */
void tdt_cli_run(const char *const *argv, tdt_run_result *r);
/* Frees r->out. */
void tdt_run_free(tdt_run_result *r);

/* Asserts the run exited 0 and wrote nothing on stderr; what names it. */
void tdt_expect_ok(const tdt_run_result *r, const char *what);

/* The end of the JSON value that starts at p (after leading white space),
 * or NULL if it is not one: strings with only JSON's escapes and no raw
 * control characters, numbers in JSON's grammar, nesting to 64. */
const char *tdt_json_value(const char *p);
/* Asserts s is exactly one JSON object and a newline. */
void tdt_expect_json_object(const char *s);

/* A forked client holding a storage read-only, for ls and info to show. */
typedef struct tdt_holder {
  pid_t pid;
  int done_w; /* closing it lets the child go */
} tdt_holder;

/* Forks a client of the tensord at sock that opens storage id read-only,
 * its process named name (NULL: the test's own name), and returns once it
 * holds it; asserts on failure. */
void tdt_holder_start(tdt_holder *h, const char *sock, uint64_t id,
                      const char *name);
/* tdt_holder_start, its process named comm (NULL: the test's own name),
 * connecting with td_connect_opts.name = connect_name (NULL: the
 * default). */
void tdt_holder_start_as(tdt_holder *h, const char *sock, uint64_t id,
                         const char *comm, const char *connect_name);
/* Lets h's child release the storage and go; asserts it exited 0. */
void tdt_holder_stop(tdt_holder *h);

#endif /* TD_TEST_CLI_H */

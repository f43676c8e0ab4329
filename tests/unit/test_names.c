/* test_names.c: the name a client connects with by default (client/name.c):
 * $TENSORD_CLIENT_NAME, the script of an interpreter, argv[0], comm. */
#include "internal.h"

#include <criterion/criterion.h>
#include <string.h>

/* The default name for comm and the arguments (NULL-terminated), with env
 * as $TENSORD_CLIENT_NAME (NULL: unset). */
static const char *name_of(const char *env, const char *comm,
                           const char *const *argv) {
  static char cmdline[1024], out[TD_CLIENT_NAME_MAX + 1];
  size_t n = 0;
  for (; *argv != NULL; argv++) {
    size_t k = strlen(*argv) + 1;
    cr_assert_lt(n + k, sizeof(cmdline));
    memcpy(cmdline + n, *argv, k);
    n += k;
  }
  td__client_default_name(env, comm, cmdline, n, out, sizeof(out));
  return out;
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

Test(names, a_python_script_is_named_by_its_base_name) {
  cr_assert_str_eq(name_of(NULL, "python3", ARGS("python3", "train.py")),
                   "train.py");
  cr_assert_str_eq(
      name_of(NULL, "python3",
              ARGS("/usr/bin/python3", "-u", "-W", "ignore", "-X", "dev",
                   "-Wdefault", "/home/me/job/train.py", "--epochs", "3")),
      "train.py");
  cr_assert_str_eq(name_of(NULL, "python3.11",
                           ARGS("python3.11", "-OO", "--", "-odd-name.py")),
                   "-odd-name.py");
  cr_assert_str_eq(name_of(NULL, "pypy3", ARGS("pypy3", "bench.py")),
                   "bench.py");
}

Test(names, python_m_is_named_by_the_module) {
  cr_assert_str_eq(
      name_of(NULL, "python3",
              ARGS("python3", "-m", "torch.distributed.run", "train.py")),
      "torch.distributed.run");
  cr_assert_str_eq(name_of(NULL, "python3", ARGS("python3", "-um", "pytest")),
                   "pytest");
  cr_assert_str_eq(name_of(NULL, "python3", ARGS("python3", "-mpytest", "-q")),
                   "pytest");
}

Test(names, a_program_on_the_command_line_keeps_the_interpreters_name) {
  cr_assert_str_eq(
      name_of(NULL, "python3", ARGS("python3", "-c", "import x", "train.py")),
      "python3");
  cr_assert_str_eq(name_of(NULL, "python3", ARGS("python3")), "python3");
  cr_assert_str_eq(name_of(NULL, "python3", ARGS("python3", "-", "a.py")),
                   "python3");
  cr_assert_str_eq(name_of(NULL, "perl", ARGS("perl", "-e", "1", "x.pl")),
                   "perl");
  cr_assert_str_eq(name_of(NULL, "node", ARGS("node", "-e", "1")), "node");
}

Test(names, other_interpreters) {
  cr_assert_str_eq(name_of(NULL, "perl", ARGS("/usr/bin/perl", "-w", "a.pl")),
                   "a.pl");
  cr_assert_str_eq(
      name_of(NULL, "node", ARGS("node", "-r", "ts-node/register", "srv.js")),
      "srv.js");
  cr_assert_str_eq(name_of(NULL, "node",
                           ARGS("node", "--require", "x", "--inspect", "s.js")),
                   "s.js");
  cr_assert_str_eq(name_of(NULL, "ruby", ARGS("ruby", "-I", "lib", "r.rb")),
                   "r.rb");
}

/* Not an interpreter ("pythonista" is not python): argv[0]'s base name,
 * which is not cut at 15 bytes as comm is. */
Test(names, other_programs_are_named_by_argv0) {
  cr_assert_str_eq(name_of(NULL, "loader", ARGS("./bin/loader", "x.py")),
                   "loader");
  cr_assert_str_eq(name_of(NULL, "pythonista", ARGS("pythonista", "x.py")),
                   "pythonista");
  cr_assert_str_eq(
      name_of(NULL, "test_client_lim", ARGS("/build/tests/test_client_limits")),
      "test_client_limits");
}

/* A process that renamed itself (prctl PR_SET_NAME), or a script run by
 * its shebang, whose comm is the script's name: comm it is. */
Test(names, a_comm_unlike_argv0_is_the_processs_own_choice) {
  cr_assert_str_eq(name_of(NULL, "trainer", ARGS("python3", "x.py")),
                   "trainer");
  cr_assert_str_eq(
      name_of(NULL, "train.py", ARGS("/usr/bin/python3", "./train.py")),
      "train.py");
  cr_assert_str_eq(name_of(NULL, "", ARGS("prog")), "prog");
  cr_assert_str_eq(name_of(NULL, "comm", ARGS("")), "comm");
  char out[TD_CLIENT_NAME_MAX + 1];
  td__client_default_name(NULL, "", NULL, 0, out, sizeof(out));
  cr_assert_str_eq(out, "libtensord");
  td__client_default_name(NULL, "kworker", NULL, 0, out, sizeof(out));
  cr_assert_str_eq(out, "kworker");
}

Test(names, the_environment_overrides_the_default) {
  cr_assert_str_eq(name_of("job 42", "python3", ARGS("python3", "train.py")),
                   "job 42");
  cr_assert_str_eq(name_of("", "python3", ARGS("python3", "train.py")),
                   "train.py", "an empty $TENSORD_CLIENT_NAME is unset");
}

/* A cmdline whose last argument has no NUL (cut at the buffer's end). */
Test(names, a_cut_cmdline_is_read_safely) {
  static const char cmd[] = "python3\0-u\0tra";
  char out[TD_CLIENT_NAME_MAX + 1];
  td__client_default_name(NULL, "python3", cmd, sizeof(cmd) - 1, out,
                          sizeof(out));
  cr_assert_str_eq(out, "tra");
  td__client_default_name(NULL, "python3", cmd, 8, out, sizeof(out));
  cr_assert_str_eq(out, "python3");
}

/* Names are cut at TD_CLIENT_NAME_MAX bytes and keep printable ASCII only,
 * as tensord shows them. */
Test(names, names_are_cut_and_cleaned) {
  char out[TD_CLIENT_NAME_MAX + 1], buf[8];
  char big[200];
  memset(big, 'x', sizeof(big) - 1);
  big[sizeof(big) - 1] = '\0';
  cr_assert_eq(td__client_name_clean(big, out, sizeof(out)),
               TD_CLIENT_NAME_MAX);
  cr_assert_eq(strlen(out), TD_CLIENT_NAME_MAX);
  td__client_name_clean("a\tb\033[2Jc\xc3\xa9\x7f", out, sizeof(out));
  cr_assert_str_eq(out, "a?b?[2Jc???");
  cr_assert_eq(td__client_name_clean("abcdefghij", buf, sizeof(buf)), 7);
  cr_assert_str_eq(buf, "abcdefg");
  td__client_name("given", out, sizeof(out));
  cr_assert_str_eq(out, "given");
  cr_assert_str_eq(name_of("\033]0;pwned\007", "x", ARGS("x")), "?]0;pwned?");
}

/* name.c: the name a client connects with: the caller's, else
 * $TENSORD_CLIENT_NAME, else the program's (the script of an interpreter). */
#include "internal.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Interpreters whose program is their first argument that is not an
 * option: a name is one of these, optionally followed by a version
 * ("python3", "python3.11", "perl5.36", "nodejs"). */
typedef enum { I_NONE, I_PYTHON, I_PERL, I_NODE, I_RUBY } interp;

static interp interp_of(const char *base) {
  static const struct {
    const char *prefix;
    interp kind;
  } known[] = {{"python", I_PYTHON}, {"pypy", I_PYTHON}, {"perl", I_PERL},
               {"nodejs", I_NODE},   {"node", I_NODE},   {"ruby", I_RUBY}};
  for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
    size_t n = strlen(known[i].prefix);
    if (strncmp(base, known[i].prefix, n) != 0)
      continue;
    const char *v = base + n;
    if (strspn(v, "0123456789.") == strlen(v))
      return known[i].kind;
  }
  return I_NONE;
}

/* Whether the option letter ch of kind takes a value (attached, or the
 * next argument). */
static int takes_value(interp kind, char ch) {
  switch (kind) {
  case I_PYTHON:
    return ch == 'W' || ch == 'X' || ch == 'Q';
  case I_NODE:
    return ch == 'r';
  case I_RUBY:
    return ch == 'I' || ch == 'r' || ch == 'C' || ch == 'E';
  default:
    return 0;
  }
}

/* Long options of kind that take the next argument as their value. */
static int long_takes_value(interp kind, const char *opt) {
  static const char *const python[] = {"--check-hash-based-pycs", NULL};
  static const char *const node[] = {"--require", "--import", "--loader",
                                     "--experimental-loader", NULL};
  const char *const *list = kind == I_PYTHON ? python
                            : kind == I_NODE ? node
                                             : NULL;
  for (; list != NULL && *list != NULL; list++)
    if (strcmp(opt, *list) == 0)
      return 1;
  return 0;
}

static const char *base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash != NULL && slash[1] != '\0' ? slash + 1 : path;
}

/* The program an interpreter runs, from its arguments args[0..n): the
 * script's base name, the module of python's -m; NULL for a program given
 * on the command line (-c, -e), read from stdin ("-") or not given. */
static const char *interp_program(interp kind, const char *const *args,
                                  size_t n) {
  for (size_t i = 0; i < n; i++) {
    const char *a = args[i];
    if (strcmp(a, "--") == 0)
      return i + 1 < n ? base_name(args[i + 1]) : NULL;
    if (a[0] != '-')
      return base_name(a);
    if (strcmp(a, "-") == 0)
      return NULL;
    if (a[1] == '-') { /* a long option */
      if (kind == I_NODE &&
          (strcmp(a, "--eval") == 0 || strcmp(a, "--print") == 0))
        return NULL;
      if (strchr(a, '=') == NULL && long_takes_value(kind, a))
        i++;
      continue;
    }
    /* Short options, maybe several in one ("-uB", "-Wignore", "-mfoo"). */
    for (const char *p = a + 1; *p != '\0'; p++) {
      if (kind == I_PYTHON && *p == 'm') {
        const char *mod = p[1] != '\0' ? p + 1 : i + 1 < n ? args[i + 1] : NULL;
        return mod != NULL && mod[0] != '\0' ? mod : NULL;
      }
      if ((kind == I_PYTHON && *p == 'c') ||
          ((kind == I_PERL || kind == I_RUBY) && (*p == 'e' || *p == 'E')) ||
          (kind == I_NODE && (*p == 'e' || *p == 'p')))
        return NULL;
      if (takes_value(kind, *p)) {
        if (p[1] == '\0')
          i++; /* the value is the next argument */
        break;
      }
    }
  }
  return NULL;
}

size_t td__client_name_clean(const char *in, char *out, size_t len) {
  size_t j = 0;
  if (len == 0)
    return 0;
  for (const unsigned char *p = (const unsigned char *)in;
       *p != '\0' && j < TD_CLIENT_NAME_MAX && j + 1 < len; p++)
    out[j++] = *p >= 0x20 && *p < 0x7f ? (char)*p : '?';
  out[j] = '\0';
  return j;
}

const char *td__printable(const char *s, char *buf, size_t len) {
  size_t j = 0;
  if (len == 0)
    return buf;
  for (; *s && j + 1 < len; s++)
    buf[j++] = ((unsigned char)*s < 0x20 || *s == 0x7f) ? '?' : *s;
  buf[j] = '\0';
  return buf;
}

void td__client_default_name(const char *env, const char *comm,
                             const char *cmdline, size_t cmdlen, char *buf,
                             size_t len) {
  if (env != NULL && env[0] != '\0') {
    td__client_name_clean(env, buf, len);
    return;
  }
  /* argv from the NUL-separated cmdline (a last argument without its NUL
   * counts too). */
  enum { ARGS_MAX = 64 };
  const char *args[ARGS_MAX];
  size_t nargs = 0;
  char *copy = NULL;
  if (cmdline != NULL && cmdlen > 0 && (copy = malloc(cmdlen + 1)) != NULL) {
    memcpy(copy, cmdline, cmdlen);
    copy[cmdlen] = '\0';
    for (size_t i = 0; i < cmdlen && nargs < ARGS_MAX;) {
      args[nargs++] = copy + i;
      i += strlen(copy + i) + 1;
    }
  }
  const char *name = NULL;
  const char *c = comm != NULL ? comm : "";
  if (nargs > 0 && args[0][0] != '\0') {
    const char *a0 = base_name(args[0]);
    /* comm is the executable's name cut at 15 bytes, unless the process
     * renamed itself (prctl PR_SET_NAME, a shebang script's own name):
     * then comm is the name it chose. */
    if (c[0] == '\0' || strncmp(a0, c, strlen(c)) == 0) {
      interp kind = interp_of(a0);
      if (kind != I_NONE)
        name = interp_program(kind, args + 1, nargs - 1);
      if (name == NULL)
        name = a0;
    }
  }
  if (name == NULL)
    name = c[0] != '\0' ? c : "libtensord";
  td__client_name_clean(name, buf, len);
  free(copy);
}

/* Reads at most cap bytes of path into buf; returns how many (0 on any
 * failure). */
static size_t read_proc(const char *path, char *buf, size_t cap) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return 0;
  size_t n = 0;
  while (n < cap) {
    ssize_t r = read(fd, buf + n, cap - n);
    if (r <= 0)
      break;
    n += (size_t)r;
  }
  close(fd);
  return n;
}

void td__client_name(const char *given, char *buf, size_t len) {
  if (given != NULL && given[0] != '\0') {
    td__client_name_clean(given, buf, len);
    return;
  }
  char comm[64], cmdline[4096];
  size_t nc = read_proc("/proc/self/comm", comm, sizeof(comm) - 1);
  comm[nc] = '\0';
  comm[strcspn(comm, "\n")] = '\0';
  size_t nl = read_proc("/proc/self/cmdline", cmdline, sizeof(cmdline));
  td__client_default_name(getenv("TENSORD_CLIENT_NAME"), comm, cmdline, nl, buf,
                          len);
}

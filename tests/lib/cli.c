/* cli.c: running tensorctl from a test and capturing what it writes, a
 * well-formedness check for its --json documents, and a client holding a
 * storage for it to show. */
#include "cli.h"

#include "harness.h"

#include <criterion/criterion.h>
#include <ctype.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

tdt_child tdt_cli_spawn(const char *const *argv, const int *stall) {
  int po[2], pe[2];
  cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
  cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    dup2(po[1], STDOUT_FILENO);
    dup2(pe[1], STDERR_FILENO);
    unsetenv("TENSORD_SOCKET");
    if (stall != NULL) {
      char env[32];
      fcntl(stall[0], F_SETFD, 0);
      fcntl(stall[1], F_SETFD, 0);
      snprintf(env, sizeof(env), "%d,%d", stall[0], stall[1]);
      setenv("TENSORCTL_TEST_STALL", env, 1);
    }
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(po[1]);
  close(pe[1]);
  return (tdt_child){pid, po[0], pe[0]};
}

void tdt_cli_collect(tdt_child ch, tdt_run_result *r) {
  memset(r, 0, sizeof(*r));
  size_t cap = 1 << 16, ne = 0;
  r->out = malloc(cap);
  cr_assert_not_null(r->out);
  struct pollfd p[2] = {{ch.out, POLLIN, 0}, {ch.err, POLLIN, 0}};
  int open_ends = 2, waited = 0;
  while (open_ends > 0) {
    int n = poll(p, 2, 100);
    if (n == 0 && (waited += 100) >= 30000) {
      kill(ch.pid, SIGKILL);
      break;
    }
    for (int i = 0; i < 2; i++) {
      if (p[i].fd < 0 || !(p[i].revents & (POLLIN | POLLHUP)))
        continue;
      char tmp[8192];
      ssize_t k = read(p[i].fd, tmp, sizeof(tmp));
      if (k <= 0) {
        close(p[i].fd);
        p[i].fd = -1;
        open_ends--;
        continue;
      }
      if (i == 0) {
        while (r->out_len + (size_t)k + 1 > cap) {
          cap *= 2;
          r->out = realloc(r->out, cap);
          cr_assert_not_null(r->out);
        }
        memcpy(r->out + r->out_len, tmp, (size_t)k);
        r->out_len += (size_t)k;
      } else {
        size_t take = sizeof(r->err) - 1 - ne;
        if ((size_t)k < take)
          take = (size_t)k;
        memcpy(r->err + ne, tmp, take);
        ne += take;
      }
    }
  }
  for (int i = 0; i < 2; i++)
    if (p[i].fd >= 0)
      close(p[i].fd);
  r->out[r->out_len] = '\0';
  r->status = tdt_wait(ch.pid);
}

void tdt_cli_run(const char *const *argv, tdt_run_result *r) {
  tdt_cli_collect(tdt_cli_spawn(argv, NULL), r);
}

void tdt_run_free(tdt_run_result *r) {
  free(r->out);
  r->out = NULL;
}

void tdt_expect_ok(const tdt_run_result *r, const char *what) {
  cr_assert_eq(r->status, 0, "tensorctl %s: exit %d; stderr: %s", what,
               r->status, r->err);
  cr_assert_eq(r->err[0], '\0', "tensorctl %s wrote to stderr: %s", what,
               r->err);
}

/* ---- a small JSON checker ---- */

static const char *json_ws(const char *p) {
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
    p++;
  return p;
}

static const char *json_string(const char *p) {
  if (*p++ != '"')
    return NULL;
  while (*p != '"') {
    if ((unsigned char)*p < 0x20)
      return NULL; /* raw control characters must be escaped */
    if (*p == '\\') {
      p++;
      if (*p == 'u') {
        for (int i = 1; i <= 4; i++)
          if (!isxdigit((unsigned char)p[i]))
            return NULL;
        p += 5;
        continue;
      }
      if (strchr("\"\\/bfnrt", *p) == NULL || *p == '\0')
        return NULL;
    }
    p++;
  }
  return p + 1;
}

static const char *json_number(const char *p) {
  if (*p == '-')
    p++;
  if (!isdigit((unsigned char)*p))
    return NULL;
  if (*p == '0' && isdigit((unsigned char)p[1]))
    return NULL;
  while (isdigit((unsigned char)*p))
    p++;
  if (*p == '.') {
    p++;
    if (!isdigit((unsigned char)*p))
      return NULL;
    while (isdigit((unsigned char)*p))
      p++;
  }
  if (*p == 'e' || *p == 'E') {
    p++;
    if (*p == '+' || *p == '-')
      p++;
    if (!isdigit((unsigned char)*p))
      return NULL;
    while (isdigit((unsigned char)*p))
      p++;
  }
  return p;
}

static const char *json_value(const char *p, int depth) {
  if (depth > 64)
    return NULL;
  p = json_ws(p);
  if (*p == '{' || *p == '[') {
    char close = *p == '{' ? '}' : ']';
    int object = *p == '{';
    p = json_ws(p + 1);
    if (*p == close)
      return p + 1;
    for (;;) {
      if (object) {
        p = json_string(json_ws(p));
        if (p == NULL)
          return NULL;
        p = json_ws(p);
        if (*p++ != ':')
          return NULL;
      }
      p = json_value(p, depth + 1);
      if (p == NULL)
        return NULL;
      p = json_ws(p);
      if (*p == close)
        return p + 1;
      if (*p++ != ',')
        return NULL;
    }
  }
  if (*p == '"')
    return json_string(p);
  if (strncmp(p, "true", 4) == 0)
    return p + 4;
  if (strncmp(p, "false", 5) == 0)
    return p + 5;
  if (strncmp(p, "null", 4) == 0)
    return p + 4;
  return json_number(p);
}

const char *tdt_json_value(const char *p) {
  return json_value(p, 0);
}

void tdt_expect_json_object(const char *s) {
  cr_assert_eq(s[0], '{', "not an object: %.300s", s);
  const char *end = json_value(s, 0);
  cr_assert_not_null(end, "invalid JSON: %.1000s", s);
  cr_assert_str_eq(end, "\n", "one document and a newline: %.200s", end);
}

/* ---- a holder ---- */

typedef struct holder_arg {
  const char *sock;
  uint64_t id;
  const char *name;
  const char *connect_name; /* td_connect_opts.name, or NULL */
  int ready;                /* write end: one byte once holding */
  int done;                 /* read end: EOF when the child may go */
  int parent[2];            /* the parent's ends of both pipes, closed here */
} holder_arg;

static int holder(void *p) {
  holder_arg *a = p;
  close(a->parent[0]);
  close(a->parent[1]);
  if (a->name != NULL)
    CHECK(prctl(PR_SET_NAME, a->name) == 0);
  td_client *c;
  td_storage *s;
  td_connect_opts o = {.name = a->connect_name};
  CHECK(td_connect_ex(a->sock, &o, &c) == 0);
  CHECK(td_storage_open(c, a->id, TD_RDONLY, &s) == 0);
  CHECK(write(a->ready, "x", 1) == 1);
  char ch;
  while (read(a->done, &ch, 1) > 0)
    ;
  td_storage_release(s);
  td_close(c);
  return 0;
}

void tdt_holder_start(tdt_holder *h, const char *sock, uint64_t id,
                      const char *name) {
  tdt_holder_start_as(h, sock, id, name, NULL);
}

void tdt_holder_start_as(tdt_holder *h, const char *sock, uint64_t id,
                         const char *comm, const char *connect_name) {
  int ready[2], done[2];
  cr_assert_eq(pipe2(ready, O_CLOEXEC), 0);
  cr_assert_eq(pipe2(done, O_CLOEXEC), 0);
  holder_arg a = {
      sock, id, comm, connect_name, ready[1], done[0], {ready[0], done[1]}};
  h->pid = tdt_fork(holder, &a);
  close(ready[1]);
  close(done[0]);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "the child holds storage %llu",
               (unsigned long long)id);
  close(ready[0]);
  h->done_w = done[1];
}

void tdt_holder_stop(tdt_holder *h) {
  close(h->done_w);
  cr_assert_eq(tdt_wait(h->pid), 0, "the holder of a storage failed");
}

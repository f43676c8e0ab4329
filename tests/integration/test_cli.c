/* test_cli.c: tensorctl against a real tensord: ls, stat, info, rm, ping,
 * their --json documents, exit statuses and messages. */
#include "cli.h"
#include "harness.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <string.h>

static tdt_daemon d;

static void setup(void) {
  tdt_start(&d, NULL);
}

TestSuite(cli, .init = setup, .fini = tdt_cleanup, .timeout = 60);

/* ---- running tensorctl ---- */

/* Runs tensorctl --socket SOCK args... (NULL-terminated). */
#define ctl(r, ...)                                                            \
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,         \
                                    __VA_ARGS__, NULL},                        \
              r)

/* The number after needle (e.g. "\"count\":"), or asserts. */
static uint64_t json_u64(const char *s, const char *needle) {
  const char *p = strstr(s, needle);
  cr_assert_not_null(p, "'%s' not in %.300s", needle, s);
  return strtoull(p + strlen(needle), NULL, 10);
}

static size_t count_of(const char *s, const char *needle) {
  size_t n = 0;
  for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle))
    n++;
  return n;
}

/* ---- fixtures ---- */

typedef struct scene {
  td_client *c;
  td_storage *s[3];
  uint64_t id[3];
  tdt_holder child;
} scene;

/* Three storages: 4 KiB; 1 MiB with keys cli/a and cli/b, held by a child
 * too; 10 bytes. */
static void scene_make(scene *sc) {
  sc->c = tdt_connect(&d);
  static const size_t sizes[3] = {4096, 1 << 20, 10};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(td_storage_create(sc->c, sizes[i], &sc->s[i]), 0);
    sc->id[i] = td_storage_id(sc->s[i]);
  }
  cr_assert_eq(td_publish(sc->c, "cli/a", sc->s[1], NULL), 0);
  cr_assert_eq(td_publish(sc->c, "cli/b", sc->s[1], NULL), 0);
  tdt_holder_start(&sc->child, d.sock, sc->id[1], NULL);
}

static void scene_free(scene *sc) {
  tdt_holder_stop(&sc->child);
  cr_assert_eq(td_unpublish(sc->c, "cli/a"), 0);
  cr_assert_eq(td_unpublish(sc->c, "cli/b"), 0);
  for (int i = 0; i < 3; i++)
    td_storage_release(sc->s[i]);
  td_close(sc->c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
}

/* Splits line into whitespace-separated tokens; returns their count. */
static int tokens(char *line, char **tok, int max) {
  int n = 0;
  for (char *t = strtok(line, " \t"); t && n < max; t = strtok(NULL, " \t"))
    tok[n++] = t;
  return n;
}

/* ---- ls ---- */

TDT_TEST(cli, ls_shows_a_row_per_storage_with_holders_and_keys) {
  scene sc;
  scene_make(&sc);
  tdt_run_result r;
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  char *lines[16];
  int n = 0;
  for (char *l = strtok(r.out, "\n"); l && n < 16; l = strtok(NULL, "\n"))
    lines[n++] = l;
  cr_assert_eq(n, 4, "a header and 3 rows, got %d lines", n);
  char *hdr = strdup(lines[0]);
  char *tok[16];
  int nt = tokens(hdr, tok, 16);
  static const char *const cols[] = {"ID",      "DEVICE", "SIZE", "REFS",
                                     "HOLDERS", "KEYS",   "AGE"};
  cr_assert_eq(nt, 7, "header: %s", lines[0]);
  for (int i = 0; i < 7; i++)
    cr_assert_str_eq(tok[i], cols[i], "header column %d", i);
  free(hdr);
  /* A holder is "PID (NAME)": the client's name from its Hello. */
  char parent[32], child[32];
  snprintf(parent, sizeof(parent), "%d (test_cli)", (int)getpid());
  snprintf(child, sizeof(child), "%d (test_cli)", (int)sc.child.pid);
  for (int i = 0; i < 3; i++) {
    char *row = lines[i + 1];
    if (i == 1) {
      cr_assert(strstr(row, parent) && strstr(row, child),
                "holders in '%s' name both pids (%s, %s)", row, parent, child);
    } else {
      const char *h = strstr(row, parent);
      cr_assert_not_null(h, "holder '%s' of row %d: %s", parent, i, row);
      h += strlen(parent);
      h += strspn(h, " ");
      cr_assert(h[0] == '-' && h[1] == ' ', "no keys on row %d: %s", i, row);
    }
    /* Without the names, the columns are whitespace-separated tokens. */
    for (char *q; (q = strstr(row, " (test_cli)")) != NULL;)
      memmove(q, q + 11, strlen(q + 11) + 1);
    int nr = tokens(row, tok, 16);
    cr_assert_geq(nr, 7, "row %d", i);
    cr_assert_eq(strtoull(tok[0], NULL, 10), sc.id[i], "rows sorted by id");
    cr_assert_str_eq(tok[1], "cpu");
    if (i == 1) {
      /* ID cpu 1.0 MiB REFS HOLDERS KEYS AGE */
      cr_assert_str_eq(tok[2], "1.0");
      cr_assert_str_eq(tok[3], "MiB");
      cr_assert_str_eq(tok[4], "4", "rw + ro holder + 2 keys");
      char pp[16], cp[16];
      snprintf(pp, sizeof(pp), "%d", (int)getpid());
      snprintf(cp, sizeof(cp), "%d", (int)sc.child.pid);
      cr_assert(strstr(tok[5], pp) && strstr(tok[5], cp),
                "holders '%s' name both pids (%s, %s)", tok[5], pp, cp);
      cr_assert(strstr(tok[6], "cli/a") && strstr(tok[6], "cli/b"), "keys '%s'",
                tok[6]);
    } else {
      cr_assert_str_eq(tok[4], "1", "refs of row %d", i);
      char pp[16];
      snprintf(pp, sizeof(pp), "%d", (int)getpid());
      cr_assert_str_eq(tok[5], pp, "holder of row %d", i);
      cr_assert_str_eq(tok[6], "-", "no keys on row %d", i);
    }
  }
  tdt_run_free(&r);
  scene_free(&sc);
}

TDT_TEST(cli, ls_sizes_are_human_readable) {
  td_client *c = tdt_connect(&d);
  td_storage *s[3];
  cr_assert_eq(td_storage_create(c, 10, &s[0]), 0);
  cr_assert_eq(td_storage_create(c, 4096, &s[1]), 0);
  cr_assert_eq(td_storage_create(c, 3 << 19, &s[2]), 0);
  tdt_run_result r;
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  cr_assert(strstr(r.out, " 10 B ") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, " 4.0 KiB ") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, " 1.5 MiB ") != NULL, "%s", r.out);
  tdt_run_free(&r);
  for (int i = 0; i < 3; i++)
    td_storage_release(s[i]);
  td_close(c);
}

TDT_TEST(cli, ls_of_nothing_says_so) {
  tdt_run_result r;
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  cr_assert_str_eq(r.out, "no storages\n");
  tdt_run_free(&r);
  ctl(&r, "ls", "--json");
  tdt_expect_ok(&r, "ls --json");
  tdt_expect_json_object(r.out);
  cr_assert_eq(json_u64(r.out, "\"count\":"), 0);
  cr_assert(strstr(r.out, "\"storages\":[]") != NULL, "%s", r.out);
  tdt_run_free(&r);
}

TDT_TEST(cli, ls_json_is_one_object_with_a_storages_array) {
  scene sc;
  scene_make(&sc);
  tdt_run_result r;
  ctl(&r, "ls", "--json");
  tdt_expect_ok(&r, "ls --json");
  tdt_expect_json_object(r.out);
  cr_assert_eq(count_of(r.out, "\n"), 1, "one line");
  cr_assert(strncmp(r.out, "{\"storages\":[", 13) == 0, "%.100s", r.out);
  cr_assert_eq(json_u64(r.out, "\"count\":"), 3);
  cr_assert_eq(count_of(r.out, "\"id\":"), 3);
  /* In id order. */
  const char *p = r.out;
  for (int i = 0; i < 3; i++) {
    char want[48];
    snprintf(want, sizeof(want), "{\"id\":%" PRIu64 ",", sc.id[i]);
    const char *q = strstr(p, want);
    cr_assert_not_null(q, "storage %" PRIu64 " listed after the previous",
                       sc.id[i]);
    p = q + 1;
  }
  /* The 1 MiB storage: its fields, holders and keys. */
  char want[128];
  snprintf(want, sizeof(want),
           "{\"id\":%" PRIu64 ",\"device\":\"cpu\","
           "\"nbytes\":1048576,\"refs\":4,",
           sc.id[1]);
  cr_assert(strstr(r.out, want) != NULL, "'%s' in %s", want, r.out);
  snprintf(want, sizeof(want), "\"owner_pid\":%d,", (int)getpid());
  cr_assert_eq(count_of(r.out, want), 3, "the test created all three");
  snprintf(want, sizeof(want),
           "{\"pid\":%d,\"uid\":%u,\"refs\":1,\"name\":\"test_cli\"}",
           (int)sc.child.pid, (unsigned)getuid());
  cr_assert(strstr(r.out, want) != NULL, "the child holder: %s", r.out);
  cr_assert(strstr(r.out, "\"keys\":[\"cli/b\",\"cli/a\"]") ||
                strstr(r.out, "\"keys\":[\"cli/a\",\"cli/b\"]"),
            "%s", r.out);
  cr_assert_eq(count_of(r.out, "\"nkeys\":2"), 1);
  cr_assert_eq(count_of(r.out, "\"nkeys\":0"), 2);
  cr_assert_eq(count_of(r.out, "\"created_unix_ms\":"), 3);
  cr_assert_eq(count_of(r.out, "\"age_ms\":"), 3);
  tdt_run_free(&r);
  /* --json may come before the command too. */
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--json", "--socket", d.sock,
                                    "ls", NULL},
              &r);
  tdt_expect_ok(&r, "--json ls");
  tdt_expect_json_object(r.out);
  tdt_run_free(&r);
  scene_free(&sc);
}

TDT_TEST(cli, json_escapes_keys) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 8, &s), 0);
  const char *key = "we\"ird\\key\twith\x01"
                    "ctl";
  cr_assert_eq(td_publish(c, key, s, NULL), 0, "%s", td_last_error(c));
  tdt_run_result r;
  ctl(&r, "ls", "--json");
  tdt_expect_ok(&r, "ls --json");
  tdt_expect_json_object(r.out);
  cr_assert(strstr(r.out, "\"we\\\"ird\\\\key\\u0009with\\u0001ctl\"") ||
                strstr(r.out, "\"we\\\"ird\\\\key\\twith\\u0001ctl\""),
            "%s", r.out);
  tdt_run_free(&r);
  ctl(&r, "info", key, "--json");
  tdt_expect_ok(&r, "info --json");
  tdt_expect_json_object(r.out);
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, key), 0);
  td_storage_release(s);
  td_close(c);
}

/* ---- stat ---- */

TDT_TEST(cli, stat_shows_totals) {
  scene sc;
  scene_make(&sc);
  tdt_run_result r;
  ctl(&r, "stat");
  tdt_expect_ok(&r, "stat");
  cr_assert(strstr(r.out, "storages  3\n") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "keys      2\n") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "waiters   0\n") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "clients   3\n") != NULL,
            "the test, the child and tensorctl: %s", r.out);
  char want[160];
  snprintf(want, sizeof(want), "socket    %s\n", d.sock);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "version   " TD_VERSION_STRING) != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "used      ") != NULL, "%s", r.out);
  /* The instance, and where its segments are (docs/operations.md). */
  snprintf(want, sizeof(want), "instance  %016llx\n",
           (unsigned long long)d.instance);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  snprintf(want, sizeof(want), "segments  /dev/shm/tensord.%016llx.*\n",
           (unsigned long long)d.instance);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  snprintf(want, sizeof(want), "          /dev/shm/tensord.%016llx-pool.*\n",
           (unsigned long long)d.instance);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  tdt_run_free(&r);
  scene_free(&sc);
}

TDT_TEST(cli, stat_json_is_one_object) {
  scene sc;
  scene_make(&sc);
  tdt_run_result r;
  ctl(&r, "stat", "--json");
  tdt_expect_ok(&r, "stat --json");
  tdt_expect_json_object(r.out);
  cr_assert_eq(json_u64(r.out, "\"storages\":"), 3);
  cr_assert_eq(json_u64(r.out, "\"bytes_used\":"), 4096 + (1 << 20) + 10);
  cr_assert_eq(json_u64(r.out, "\"keys\":"), 2);
  cr_assert_eq(json_u64(r.out, "\"waiters\":"), 0);
  cr_assert_eq(json_u64(r.out, "\"clients\":"), 3);
  cr_assert_gt(json_u64(r.out, "\"capacity\":"), 0);
  cr_assert_gt(json_u64(r.out, "\"shm_free\":"), 0);
  cr_assert_gt(json_u64(r.out, "\"pid\":"), 0);
  cr_assert(strstr(r.out, "\"version\":\"" TD_VERSION_STRING "\"") != NULL,
            "%s", r.out);
  char want[160];
  snprintf(want, sizeof(want), "\"socket\":\"%s\"", d.sock);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  snprintf(want, sizeof(want),
           "\"instance\":\"%016llx\",\"prefixes\":[\"/tensord.%016llx.\","
           "\"/tensord.%016llx-pool.\"]",
           (unsigned long long)d.instance, (unsigned long long)d.instance,
           (unsigned long long)d.instance);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  tdt_run_free(&r);
  scene_free(&sc);
}

TDT_TEST(cli, stat_shows_the_pool_and_ls_does_not) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 2 << 20, &s), 0);
  cr_assert_eq(td_storage_release(s), 0);
  td_stat st;
  for (int i = 0; i < 2500; i++) {
    cr_assert_eq(td_stat_get(c, &st), 0);
    if (st.pool_segments == 1)
      break;
    usleep(2000);
  }
  cr_assert_eq(st.pool_segments, 1);
  tdt_run_result r;
  ctl(&r, "stat");
  tdt_expect_ok(&r, "stat");
  cr_assert(strstr(r.out, "pool      1 segment(s), 2.0 MiB of ") != NULL, "%s",
            r.out);
  cr_assert(strstr(r.out, "0 hit(s), 1 miss(es)") != NULL, "%s", r.out);
  tdt_run_free(&r);
  ctl(&r, "stat", "--json");
  tdt_expect_ok(&r, "stat --json");
  tdt_expect_json_object(r.out);
  cr_assert_eq(json_u64(r.out, "\"segments\":"), 1);
  cr_assert_eq(json_u64(r.out, "\"bytes\":"), 2 << 20);
  cr_assert_eq(json_u64(r.out, "\"misses\":"), 1);
  cr_assert_gt(json_u64(r.out, "\"limit\":"), 0);
  tdt_run_free(&r);
  /* A pooled segment is not a storage. */
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  cr_assert_null(strstr(r.out, "MiB"), "ls lists a pooled segment: %s", r.out);
  tdt_run_free(&r);
  td_close(c);
}

/* ---- info ---- */

/* ---- client names ---- */

/* A name with control characters, quotes and more than TD_CLIENT_NAME_MAX
 * bytes, and what every listing must show of it: cut at 63 bytes, each
 * byte outside printable ASCII as '?'. */
#define HOSTILE                                                                \
  "evil\033[2J\"q\\\n\xc3\xa9-"                                                \
  "0123456789012345678901234567890123456789012345678901234567890123456789"
#define HOSTILE_SHOWN                                                          \
  "evil?[2J\"q\\???"                                                           \
  "-"                                                                          \
  "012345678901234567890123456789012345678901234567"
#define HOSTILE_JSON                                                           \
  "evil?[2J\\\"q\\\\???"                                                       \
  "-"                                                                          \
  "012345678901234567890123456789012345678901234567"

/* ls, info and their --json name each holder with the name it connected
 * with: one given (td_connect_opts.name), one from $TENSORD_CLIENT_NAME, the
 * default (the program, test_cli) and a hostile one, cleaned. */
TDT_TEST(cli, holders_show_the_name_each_client_connected_with) {
  _Static_assert(sizeof(HOSTILE_SHOWN) - 1 == TD_CLIENT_NAME_MAX, "63 bytes");
  td_client *c = tdt_connect(&d);
  cr_assert_str_eq(td_client_name(c), "test_cli", "the default: argv[0]");
  td_storage *s[2];
  uint64_t id[2];
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(td_storage_create(c, 4096, &s[i]), 0);
    id[i] = td_storage_id(s[i]);
  }
  tdt_holder given, wrapped, hostile;
  tdt_holder_start_as(&given, d.sock, id[0], NULL, "train.py worker 1");
  cr_assert_eq(setenv("TENSORD_CLIENT_NAME", "wrapped job 7", 1), 0);
  tdt_holder_start(&wrapped, d.sock, id[0], NULL);
  cr_assert_eq(unsetenv("TENSORD_CLIENT_NAME"), 0);
  tdt_holder_start_as(&hostile, d.sock, id[1], NULL, HOSTILE);

  char want[160], ids[32];
  tdt_run_result r;
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  snprintf(want, sizeof(want), "%d (train.py worker 1)", (int)given.pid);
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  snprintf(want, sizeof(want), "%d (wrapped job 7)", (int)wrapped.pid);
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  snprintf(want, sizeof(want), "%d (test_cli)", (int)getpid());
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  snprintf(want, sizeof(want), "%d (" HOSTILE_SHOWN ")", (int)hostile.pid);
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  cr_assert_null(strchr(r.out, '\033'), "an escape reached the terminal");
  tdt_run_free(&r);

  ctl(&r, "--json", "ls");
  tdt_expect_ok(&r, "ls --json");
  tdt_expect_json_object(r.out);
  snprintf(want, sizeof(want),
           "{\"pid\":%d,\"uid\":%u,\"refs\":1,\"name\":"
           "\"train.py worker 1\"}",
           (int)given.pid, (unsigned)getuid());
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  snprintf(want, sizeof(want), "\"name\":\"" HOSTILE_JSON "\"}");
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  tdt_run_free(&r);

  snprintf(ids, sizeof(ids), "%" PRIu64, id[0]);
  ctl(&r, "info", ids);
  tdt_expect_ok(&r, "info");
  snprintf(want, sizeof(want), "%d (train.py worker 1, uid", (int)given.pid);
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  snprintf(want, sizeof(want), "%d (wrapped job 7, uid", (int)wrapped.pid);
  cr_assert(strstr(r.out, want) != NULL, "'%s' in:\n%s", want, r.out);
  tdt_run_free(&r);
  snprintf(ids, sizeof(ids), "%" PRIu64, id[1]);
  ctl(&r, "--json", "info", ids);
  tdt_expect_ok(&r, "info --json");
  tdt_expect_json_object(r.out);
  cr_assert(strstr(r.out, "\"name\":\"" HOSTILE_JSON "\"") != NULL, "%s",
            r.out);
  tdt_run_free(&r);

  tdt_holder_stop(&hostile);
  tdt_holder_stop(&wrapped);
  tdt_holder_stop(&given);
  for (int i = 0; i < 2; i++)
    td_storage_release(s[i]);
  td_close(c);
}

/* td_connect_ex: reserved words must be zero; NULL options and a NULL or
 * empty name are td_connect's default. */
TDT_TEST(cli, connect_ex_checks_its_options) {
  td_connect_opts o = {0};
  td_client *c = NULL;
  o.reserved[3] = 1;
  cr_assert_eq(td_connect_ex(d.sock, &o, &c), TD_EINVAL);
  cr_assert_null(c);
  cr_assert(strstr(td_last_error(NULL), "reserved[3]") != NULL, "%s",
            td_last_error(NULL));
  o.reserved[3] = 0;
  o.name = "";
  cr_assert_eq(td_connect_ex(d.sock, &o, &c), 0, "%s", td_last_error(NULL));
  cr_assert_str_eq(td_client_name(c), "test_cli");
  td_close(c);
  cr_assert_eq(td_connect_ex(d.sock, NULL, &c), 0, "%s", td_last_error(NULL));
  cr_assert_str_eq(td_client_name(c), "test_cli");
  td_close(c);
  o.name = "a\tb";
  cr_assert_eq(td_connect_ex(d.sock, &o, &c), 0, "%s", td_last_error(NULL));
  cr_assert_str_eq(td_client_name(c), "a?b");
  td_close(c);
}

TDT_TEST(cli, info_key_shows_the_view) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 1024, &s), 0);
  int64_t shape[2] = {4, 3};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_publish(c, "weights", s, &v), 0);
  v.stride[0] = 1;
  v.stride[1] = 4;
  v.offset = 5;
  cr_assert_eq(td_publish(c, "weights.T", s, &v), 0);
  tdt_run_result r;
  ctl(&r, "info", "weights");
  tdt_expect_ok(&r, "info weights");
  char want[128];
  snprintf(want, sizeof(want), "storage   %" PRIu64 "\n", td_storage_id(s));
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "size      1.0 KiB (1024 bytes)\n") != NULL, "%s",
            r.out);
  cr_assert(strstr(r.out, "refs      3\n") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "keys      2\n") != NULL, "%s", r.out);
  const char *w = strstr(r.out, "  weights: float32[4, 3] stride (3, 1) "
                                "offset 0\n");
  const char *t = strstr(r.out, "  weights.T: float32[4, 3] stride (1, 4) "
                                "offset 5\n");
  cr_assert(w && t, "both views: %s", r.out);
  cr_assert_lt(w, t, "the asked-for key first");
  tdt_run_free(&r);

  ctl(&r, "info", "weights.T", "--json");
  tdt_expect_ok(&r, "info --json");
  tdt_expect_json_object(r.out);
  cr_assert(strncmp(r.out, "{\"storage\":{", 12) == 0, "%.80s", r.out);
  cr_assert(strstr(r.out, "\"views\":[{\"key\":\"weights.T\",\"view\":{\"dtype"
                          "\":\"float32\",\"shape\":[4,3],\"stride\":[1,4],"
                          "\"offset\":5}") != NULL,
            "%s", r.out);
  cr_assert(strstr(r.out,
                   "{\"key\":\"weights\",\"view\":{\"dtype\":\"float32"
                   "\",\"shape\":[4,3],\"stride\":[3,1],\"offset\":0}") != NULL,
            "%s", r.out);
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, "weights"), 0);
  cr_assert_eq(td_unpublish(c, "weights.T"), 0);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(cli, info_id_shows_the_storage_and_its_holders) {
  scene sc;
  scene_make(&sc);
  char id[32];
  snprintf(id, sizeof(id), "%" PRIu64, sc.id[1]);
  tdt_run_result r;
  ctl(&r, "info", id);
  tdt_expect_ok(&r, "info ID");
  char want[128];
  snprintf(want, sizeof(want), "storage   %s\n", id);
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "device    cpu\n") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "size      1.0 MiB (1048576 bytes)\n") != NULL, "%s",
            r.out);
  snprintf(want, sizeof(want), "owner     pid %d, uid %u (", (int)getpid(),
           (unsigned)getuid());
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  snprintf(want, sizeof(want), " %d (test_cli, uid %u, 1 ref)",
           (int)sc.child.pid, (unsigned)getuid());
  cr_assert(strstr(r.out, want) != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "  cli/a: uint8[1048576] stride (1) offset 0\n"),
            "%s", r.out);
  cr_assert(strstr(r.out, "  cli/b: uint8[1048576] stride (1) offset 0\n"),
            "%s", r.out);
  tdt_run_free(&r);
  ctl(&r, "info", id, "--json");
  tdt_expect_ok(&r, "info ID --json");
  tdt_expect_json_object(r.out);
  cr_assert_eq(count_of(r.out, "{\"key\":"), 2);
  tdt_run_free(&r);
  /* An id nobody has. */
  ctl(&r, "info", "999999");
  cr_assert_eq(r.status, 1, "stderr: %s", r.err);
  cr_assert(strstr(r.err, "999999") != NULL, "%s", r.err);
  cr_assert_eq(r.out_len, 0);
  tdt_run_free(&r);
  scene_free(&sc);
}

TDT_TEST(cli, info_of_a_key_made_of_digits_falls_back_to_the_key) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 16, &s), 0);
  cr_assert_eq(td_publish(c, "31337", s, NULL), 0);
  tdt_run_result r;
  ctl(&r, "info", "31337");
  tdt_expect_ok(&r, "info 31337");
  cr_assert(strstr(r.out, "  31337: uint8[16]") != NULL, "%s", r.out);
  tdt_run_free(&r);
  cr_assert_eq(td_unpublish(c, "31337"), 0);
  td_storage_release(s);
  td_close(c);
}

/* ---- rm ---- */

TDT_TEST(cli, rm_unpublishes_then_info_fails) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 16, &s), 0);
  cr_assert_eq(td_publish(c, "batch/7", s, NULL), 0);
  td_storage_release(s);
  tdt_run_result r;
  ctl(&r, "rm", "batch/7");
  tdt_expect_ok(&r, "rm");
  cr_assert_str_eq(r.out, "removed 'batch/7'\n");
  tdt_run_free(&r);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000),
            "the key held the last reference");
  ctl(&r, "info", "batch/7");
  cr_assert_eq(r.status, 1, "exit %d", r.status);
  cr_assert_eq(r.out_len, 0, "nothing on stdout: %s", r.out);
  cr_assert(strstr(r.err, "key 'batch/7': not published") != NULL, "stderr: %s",
            r.err);
  cr_assert_eq(count_of(r.err, "\n"), 1, "one line: %s", r.err);
  tdt_run_free(&r);
  ctl(&r, "rm", "batch/7");
  cr_assert_eq(r.status, 1);
  cr_assert(strstr(r.err, "tensorctl rm: key 'batch/7': not published"),
            "stderr: %s", r.err);
  tdt_run_free(&r);
  /* --json. */
  cr_assert_eq(td_storage_create(c, 16, &s), 0);
  cr_assert_eq(td_publish(c, "j", s, NULL), 0);
  td_storage_release(s);
  ctl(&r, "rm", "j", "--json");
  tdt_expect_ok(&r, "rm --json");
  cr_assert_str_eq(r.out, "{\"removed\":\"j\"}\n");
  tdt_run_free(&r);
  td_close(c);
}

/* ---- ping, usage, connection errors ---- */

TDT_TEST(cli, ping_answers) {
  tdt_run_result r;
  ctl(&r, "ping");
  tdt_expect_ok(&r, "ping");
  cr_assert(strncmp(r.out, "tensord answered in ", 20) == 0, "%s", r.out);
  tdt_run_free(&r);
  ctl(&r, "ping", "--json");
  tdt_expect_ok(&r, "ping --json");
  tdt_expect_json_object(r.out);
  cr_assert(strstr(r.out, "\"rtt_us\":") != NULL, "%s", r.out);
  tdt_run_free(&r);
}

TDT_TEST(cli, usage_errors_exit_2) {
  static const char *const cases[][3] = {
      {"frobnicate", NULL}, {"info", NULL},    {"rm", NULL},
      {"ls", "extra"},      {"ping", "extra"}, {"--bogus", "ls"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *argv[8] = {TENSORCTL_BIN, "--socket", d.sock};
    int n = 3;
    for (int j = 0; j < 2 && cases[i][j]; j++)
      argv[n++] = cases[i][j];
    tdt_run_result r;
    tdt_cli_run(argv, &r);
    cr_assert_eq(r.status, 2, "tensorctl %s %s: exit %d", cases[i][0],
                 cases[i][1] ? cases[i][1] : "", r.status);
    cr_assert_gt(strlen(r.err), 0, "says why");
    cr_assert_eq(r.out_len, 0);
    if (i == 0)
      cr_assert(strstr(r.err, "unknown command 'frobnicate'"), "%s", r.err);
    tdt_run_free(&r);
  }
  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, NULL}, &r);
  cr_assert_eq(r.status, 2, "no command");
  tdt_run_free(&r);
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--help", NULL}, &r);
  cr_assert_eq(r.status, 0);
  cr_assert(strstr(r.out, "usage: tensorctl") != NULL, "%s", r.out);
  tdt_run_free(&r);
}

/* Every subcommand answers -h and --help (anywhere among its arguments)
 * with its own usage on stdout and exit 0, and "help CMD" says the same;
 * none of them needs the daemon. "help" alone is tensorctl --help. */
TDT_TEST(cli, every_command_answers_help) {
  static const char *const cmds[] = {"ls",    "stat",   "info",    "show",
                                     "rm",    "ping",   "metrics", "top",
                                     "watch", "upgrade"};
  char nowhere[160];
  snprintf(nowhere, sizeof(nowhere), "%s/nobody-here.sock", d.dir);
  for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
    char want[64];
    snprintf(want, sizeof(want), "usage: tensorctl %s", cmds[i]);
    const char *const forms[][5] = {
        {cmds[i], "-h", NULL},
        {cmds[i], "--help", NULL},
        {"help", cmds[i], NULL},
        {cmds[i], "--json", "-h", NULL},
        {cmds[i], "some-arg", "--help", NULL},
    };
    for (size_t f = 0; f < sizeof(forms) / sizeof(forms[0]); f++) {
      const char *argv[10] = {TENSORCTL_BIN, "--socket", nowhere};
      int n = 3;
      for (int j = 0; forms[f][j] != NULL; j++)
        argv[n++] = forms[f][j];
      tdt_run_result r;
      tdt_cli_run(argv, &r);
      char what[128];
      snprintf(what, sizeof(what), "tensorctl %s %s %s", forms[f][0],
               forms[f][1], forms[f][2] ? forms[f][2] : "");
      cr_assert_eq(r.status, 0, "%s: exit %d, stderr: %s", what, r.status,
                   r.err);
      cr_assert_eq(r.err[0], '\0', "%s: stderr: %s", what, r.err);
      cr_assert(strncmp(r.out, want, strlen(want)) == 0,
                "%s: stdout begins with '%s': %s", what, want, r.out);
      tdt_run_free(&r);
    }
  }
  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "help", NULL}, &r);
  tdt_expect_ok(&r, "help");
  cr_assert(strncmp(r.out, "usage: tensorctl [", 18) == 0, "%s", r.out);
  tdt_run_free(&r);
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "help", "nosuch", NULL}, &r);
  cr_assert_eq(r.status, 2, "help nosuch: exit %d", r.status);
  cr_assert_eq(r.out_len, 0, "nothing on stdout: %s", r.out);
  cr_assert(strstr(r.err, "unknown command 'nosuch'") != NULL, "%s", r.err);
  tdt_run_free(&r);
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "help", "ls", "stat", NULL},
              &r);
  cr_assert_eq(r.status, 2, "help takes one command: exit %d", r.status);
  tdt_run_free(&r);
}

/* "--" ends the options: a key that looks like one can still be named. */
TDT_TEST(cli, double_dash_ends_the_options) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 8, &s), 0);
  cr_assert_eq(td_publish(c, "-h", s, NULL), 0);
  tdt_run_result r;
  ctl(&r, "info", "--", "-h");
  tdt_expect_ok(&r, "info -- -h");
  cr_assert(strstr(r.out, "  -h: uint8") != NULL, "%s", r.out);
  tdt_run_free(&r);
  ctl(&r, "rm", "--", "-h");
  tdt_expect_ok(&r, "rm -- -h");
  tdt_run_free(&r);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(cli, missing_socket_exits_1_and_asks_if_tensord_runs) {
  char path[160];
  snprintf(path, sizeof(path), "%s/nobody-here.sock", d.dir);
  static const char *const cmds[] = {"ls", "stat", "ping"};
  for (int i = 0; i < 3; i++) {
    tdt_run_result r;
    tdt_cli_run(
        (const char *const[]){TENSORCTL_BIN, "--socket", path, cmds[i], NULL},
        &r);
    cr_assert_eq(r.status, 1, "%s: exit %d", cmds[i], r.status);
    char want[200];
    snprintf(want, sizeof(want), "cannot connect to %s", path);
    cr_assert(strstr(r.err, want) != NULL, "stderr: %s", r.err);
    cr_assert(strstr(r.err, "(is tensord running?)") != NULL, "stderr: %s",
              r.err);
    cr_assert_eq(r.out_len, 0, "nothing on stdout: %s", r.out);
    tdt_run_free(&r);
  }
}

/* ---- many storages: paging ---- */

TDT_TEST(cli, ls_lists_1500_storages_across_pages, .timeout = 120) {
  enum { N = 1500 };
  td_client *c = tdt_connect(&d);
  td_storage **s = calloc(N, sizeof(*s));
  for (int i = 0; i < N; i++)
    cr_assert_eq(td_storage_create(c, 1, &s[i]), 0, "create %d: %s", i,
                 td_last_error(c));
  tdt_run_result r;
  ctl(&r, "ls", "--json");
  tdt_expect_ok(&r, "ls --json");
  tdt_expect_json_object(r.out);
  cr_assert_eq(json_u64(r.out, "\"count\":"), N);
  cr_assert_eq(count_of(r.out, "{\"id\":"), N);
  /* Every id, in order, once. */
  const char *p = r.out;
  for (int i = 0; i < N; i++) {
    char want[48];
    snprintf(want, sizeof(want), "{\"id\":%" PRIu64 ",", td_storage_id(s[i]));
    const char *q = strstr(p, want);
    cr_assert_not_null(q, "storage %" PRIu64 " missing or out of order",
                       td_storage_id(s[i]));
    p = q + 1;
  }
  tdt_run_free(&r);
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  cr_assert_eq(count_of(r.out, "\n"), N + 1, "a header and a row each");
  tdt_run_free(&r);
  /* With holes. */
  for (int i = 0; i < N; i += 3) {
    td_storage_release(s[i]);
    s[i] = NULL;
  }
  ctl(&r, "ls", "--json");
  tdt_expect_ok(&r, "ls --json");
  cr_assert_eq(json_u64(r.out, "\"count\":"), N - (N + 2) / 3);
  tdt_run_free(&r);
  for (int i = 0; i < N; i++)
    td_storage_release(s[i]);
  free(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 10000));
}

typedef struct page_walk {
  td_storage **s;
  uint64_t first;
  int n;
  uint64_t last;
  int ok;
} page_walk;

/* Releases each storage as it is listed, on the listing connection, so
 * that every page after the first starts after an id that is gone. */
static int release_as_listed(const td_storage_info *info, void *arg) {
  page_walk *w = arg;
  if (info->id <= w->last)
    w->ok = 0;
  w->last = info->id;
  uint64_t i = info->id - w->first;
  td_storage_release(w->s[i]);
  w->s[i] = NULL;
  w->n++;
  return 0;
}

TDT_TEST(cli, list_pages_continue_after_a_freed_cursor, .timeout = 120) {
  enum { N = 1100 };
  td_client *c = tdt_connect(&d);
  td_storage **s = calloc(N, sizeof(*s));
  for (int i = 0; i < N; i++)
    cr_assert_eq(td_storage_create(c, 1, &s[i]), 0);
  page_walk w = {s, td_storage_id(s[0]), 0, 0, 1};
  cr_assert_eq(td_storage_id(s[N - 1]) - w.first, N - 1, "consecutive ids");
  cr_assert_eq(td_list(c, release_as_listed, &w), 0, "%s", td_last_error(c));
  cr_assert(w.ok, "in id order");
  cr_assert_eq(w.n, N, "every storage listed once");
  free(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 10000));
}

/* ---- the library's introspection structures ---- */

static int check_aligned(const td_storage_info *s, void *arg) {
  int *bad = arg;
  if (s->nkeys > 0 && (uintptr_t)s->keys % _Alignof(const char *) != 0) {
    fprintf(stderr, "storage %" PRIu64 ": keys[] at %p\n", s->id,
            (const void *)s->keys);
    (*bad)++;
  }
  if (s->nholders > 0 && (uintptr_t)s->holders % _Alignof(td_holder) != 0)
    (*bad)++;
  for (size_t i = 0; i < s->nkeys; i++)
    if (s->keys[i] == NULL)
      (*bad)++;
  return 0;
}

/* Lists and describes storages from a child, so that a sanitizer's abort
 * takes only the child. Exits with the count of misaligned arrays. */
static int list_aligned(void *p) {
  td_client *c;
  CHECK(td_connect(p, &c) == 0);
  int bad = 0;
  CHECK(td_list(c, check_aligned, &bad) == 0);
  CHECK(td_info(c, 0, "one", check_aligned, NULL, &bad) == 0);
  td_close(c);
  return bad > 100 ? 100 : bad;
}

/* td_storage_info's holders[] and keys[] are arrays a caller may index:
 * each must be aligned for its type, whatever the count of holders. */
TDT_TEST(cli, storage_info_arrays_are_aligned) {
  scene sc; /* storage 2: two holders, two keys */
  scene_make(&sc);
  td_storage *one;
  cr_assert_eq(td_storage_create(sc.c, 8, &one), 0); /* one holder */
  cr_assert_eq(td_publish(sc.c, "one", one, NULL), 0);
  int st = tdt_wait(tdt_fork(list_aligned, d.sock));
  cr_assert_eq(td_unpublish(sc.c, "one"), 0);
  td_storage_release(one);
  scene_free(&sc);
  cr_assert_eq(st, 0,
               "td_list/td_info gave %d misaligned array(s) (one holder of 12 "
               "bytes, then the key pointers); > 100: killed by signal %d",
               st, st - 128);
}

TDT_TEST(cli, ls_says_how_many_keys_it_does_not_show) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 8, &s), 0);
  char key[128];
  for (int i = 0; i < 5; i++) {
    snprintf(key, sizeof(key), "%d-%0100d", i, 0); /* 102 bytes */
    cr_assert_eq(td_publish(c, key, s, NULL), 0);
  }
  tdt_run_result r;
  ctl(&r, "ls");
  tdt_expect_ok(&r, "ls");
  int shown = 0;
  for (int i = 0; i < 5; i++) {
    snprintf(key, sizeof(key), "%d-%0100d", i, 0);
    shown += strstr(r.out, key) != NULL;
  }
  const char *more = strstr(r.out, "(+");
  int hidden = more ? atoi(more + 2) : -1;
  char row[1024];
  snprintf(row, sizeof(row), "%s", r.out);
  tdt_run_free(&r);
  for (int i = 0; i < 5; i++) {
    snprintf(key, sizeof(key), "%d-%0100d", i, 0);
    cr_assert_eq(td_unpublish(c, key), 0);
  }
  td_storage_release(s);
  td_close(c);
  cr_assert_geq(hidden, 0, "the row says keys are missing: %s", row);
  cr_assert_eq(shown + hidden, 5,
               "%d keys shown whole and '(+%d more)', of 5: %s", shown, hidden,
               row);
}

TDT_TEST(cli, info_of_a_storage_with_many_long_keys_fits_one_reply) {
  enum { NKEYS = 1100 };
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 8, &s), 0);
  char key[256];
  memset(key, 'q', 250);
  key[250] = '\0';
  for (int i = 0; i < NKEYS; i++) {
    snprintf(key, 12, "%010d", i);
    key[10] = '/';
    cr_assert_eq(td_publish(c, key, s, NULL), 0, "%s", td_last_error(c));
  }
  snprintf(key, 12, "%010d", NKEYS - 1);
  key[10] = '/';
  tdt_run_result r;
  ctl(&r, "info", key);
  tdt_expect_ok(&r, "info");
  char want[32];
  snprintf(want, sizeof(want), "keys      %d\n", NKEYS);
  cr_assert(strstr(r.out, want) != NULL, "%.300s", r.out);
  size_t lines = count_of(r.out, ": uint8[8] stride (1) offset 0\n");
  cr_assert_gt(lines, 0);
  cr_assert_leq(lines, NKEYS);
  char first[300];
  snprintf(first, sizeof(first), "keys      %d\n  %s: ", NKEYS, key);
  cr_assert(strstr(r.out, first) != NULL, "the asked-for key first");
  tdt_run_free(&r);
  ctl(&r, "ls", "--json");
  tdt_expect_ok(&r, "ls --json");
  tdt_expect_json_object(r.out);
  snprintf(want, sizeof(want), "\"nkeys\":%d", NKEYS);
  cr_assert(strstr(r.out, want) != NULL, "%.300s", r.out);
  tdt_run_free(&r);
  td_storage_release(s);
  td_close(c);
  c = tdt_connect(&d);
  for (int i = 0; i < NKEYS; i++) {
    snprintf(key, 12, "%010d", i);
    key[10] = '/';
    cr_assert_eq(td_unpublish(c, key), 0);
  }
  td_close(c);
}

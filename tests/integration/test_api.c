/* test_api.c: libtensord as a program built against tensord.h sees it: the
 * reserved words of the ABI structs, and README.md's C example. */
#include "harness.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

static tdt_daemon d;

/* A test that fails midway leaves no daemon, segment or directory. */
static void setup(void) {
  memset(&d, 0, sizeof(d));
}

TestSuite(api, .init = setup, .fini = tdt_cleanup, .timeout = 30);

#define NRESERVED(s) (sizeof((s).reserved) / sizeof((s).reserved[0]))

/* ---- reserved words ---- */

/* A program built against a later tensord.h may set a field this library
 * does not know: it is refused, not ignored, and nothing is created. */
TDT_TEST(api, create_opts_with_a_reserved_word_set_is_einval) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_create_opts o = {0};
  for (size_t i = 0; i < NRESERVED(o); i++) {
    memset(&o, 0, sizeof(o));
    o.nbytes = 4096;
    o.reserved[i] = 1;
    td_storage *s = (td_storage *)1;
    cr_assert_eq(td_storage_create_ex(c, &o, &s), TD_EINVAL,
                 "reserved[%zu] set: %s", i, td_last_error(c));
    cr_assert_null(s);
    char want[32];
    snprintf(want, sizeof(want), "reserved[%zu]", i);
    cr_assert(strstr(td_last_error(c), want) != NULL, "message '%s' names %s",
              td_last_error(c), want);
  }
  cr_assert_eq(tdt_storages(&d), 0, "nothing was created");
  memset(&o, 0, sizeof(o));
  o.nbytes = 4096;
  td_storage *s;
  cr_assert_eq(td_storage_create_ex(c, &o, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

typedef struct seen {
  int storages, holders, keys;
} seen;

static void assert_zero(const uint64_t *w, size_t n, const char *what) {
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(w[i], 0, "%s.reserved[%zu] = 0x%llx, not zero", what, i,
                 (unsigned long long)w[i]);
}

static int storage_cb(const td_storage_info *info, void *arg) {
  seen *n = arg;
  n->storages++;
  assert_zero(info->reserved, NRESERVED(*info), "td_storage_info");
  for (size_t i = 0; i < info->nholders; i++, n->holders++)
    assert_zero(info->holders[i].reserved, NRESERVED(info->holders[i]),
                "td_holder");
  return 0;
}

static int key_cb(const td_key_info *info, void *arg) {
  seen *n = arg;
  n->keys++;
  assert_zero(info->reserved, NRESERVED(*info), "td_key_info");
  return 0;
}

/* What the library fills in has its reserved words zero, so a program can
 * later tell a field a newer library sets from one an older leaves out. */
TDT_TEST(api, results_have_zero_reserved_words) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_client *c2 = tdt_connect(&d);
  td_storage *s[3], *t[3];
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_storage_create(c, 4096, &s[i]), 0, "%s", td_last_error(c));
  for (int i = 0; i < 3; i++)
    cr_assert_eq(td_storage_open(c2, td_storage_id(s[i]), 0, &t[i]), 0, "%s",
                 td_last_error(c2));
  cr_assert_eq(td_publish(c, "api/a", s[0], NULL), 0, "%s", td_last_error(c));

  td_stat st;
  memset(&st, 0xa5, sizeof(st));
  cr_assert_eq(td_stat_get(c, &st), 0, "%s", td_last_error(c));
  assert_zero(st.reserved, NRESERVED(st), "td_stat");

  seen n = {0};
  cr_assert_eq(td_list(c, storage_cb, &n), 0, "%s", td_last_error(c));
  cr_assert_eq(n.storages, 3);
  cr_assert_eq(n.holders, 6, "each storage has two holders");
  memset(&n, 0, sizeof(n));
  cr_assert_eq(td_info(c, 0, "api/a", storage_cb, key_cb, &n), 0, "%s",
               td_last_error(c));
  cr_assert_eq(n.storages, 1);
  cr_assert_eq(n.keys, 1);

  cr_assert_eq(td_unpublish(c, "api/a"), 0, "%s", td_last_error(c));
  for (int i = 0; i < 3; i++) {
    td_storage_release(t[i]);
    td_storage_release(s[i]);
  }
  td_close(c2);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

/* ---- README.md ---- */

/* The README's C example, built from README.md as written, runs against a
 * daemon (found through $TENSORD_SOCKET, as td_connect(NULL) does), prints
 * the element it promises and leaves no storage behind. */
TDT_TEST(api, readme_c_example_runs) {
  tdt_start(&d, NULL);
  cr_assert_eq(setenv("TENSORD_SOCKET", d.sock, 1), 0);
  FILE *p = popen(README_EXAMPLE " 2>&1", "r");
  cr_assert_not_null(p, "popen %s", README_EXAMPLE);
  char out[1024];
  size_t n = fread(out, 1, sizeof(out) - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  unsetenv("TENSORD_SOCKET");
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "the README example failed (status 0x%x): %s", status, out);
  cr_assert_str_eq(out, "float32[1024, 1024] stride (1024, 1) offset 0: "
                        "[2][3] = 1025.5\n");
  cr_assert_eq(tdt_storages(&d), 0, "the example's storage is gone");
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  tdt_stop(&d);
}

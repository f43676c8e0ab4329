/* test_core.c: storages shared between real processes, references, and
 * release when a holder dies. */
#include "harness.h"

#include <criterion/criterion.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>

static tdt_daemon d;

static void setup(void) {
  tdt_start(&d, NULL);
}

TestSuite(core, .init = setup, .fini = tdt_cleanup, .timeout = 30);

typedef struct {
  const char *sock;
  const char *key;
  int ready; /* sleeper: written to once it holds the only reference */
} child_arg;

/* Looks the key up, checks the producer's bytes, writes its own, exits. */
static int consumer(void *p) {
  child_arg *a = p;
  td_client *c;
  td_storage *s;
  td_view v;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK(td_lookup(c, a->key, 0, 5000, &s, &v) == 0);
  CHECK(td_storage_nbytes(s) == 4096);
  unsigned char *b = td_storage_data(s);
  for (int i = 0; i < 4096; i++)
    CHECK(b[i] == (unsigned char)(i * 7));
  memset(b, 0xab, 4096);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(core, two_processes_see_each_others_writes) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  unsigned char *b = td_storage_data(s);
  for (int i = 0; i < 4096; i++)
    cr_assert_eq(b[i], 0, "a new storage is zeroed");
  for (int i = 0; i < 4096; i++)
    b[i] = (unsigned char)(i * 7);
  cr_assert_eq(td_publish(c, "shared/a", s, NULL), 0, "%s", td_last_error(c));
  child_arg a = {d.sock, "shared/a", -1};
  cr_assert_eq(tdt_wait(tdt_fork(consumer, &a)), 0);
  for (int i = 0; i < 4096; i++)
    cr_assert_eq(b[i], 0xab, "byte %d: the consumer's write is visible", i);
  cr_assert_eq(td_unpublish(c, "shared/a"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

static int sleeper(void *p) {
  child_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK(td_storage_create(c, 1 << 20, &s) == 0);
  CHECK(td_publish(c, a->key, s, NULL) == 0);
  CHECK(td_unpublish(c, a->key) == 0);
  CHECK(write(a->ready, "", 1) == 1);
  pause(); /* killed here, holding the only reference */
  return 0;
}

TDT_TEST(core, sigkill_of_holder_frees_its_segment) {
  int ready[2];
  cr_assert_eq(pipe(ready), 0);
  child_arg a = {d.sock, "doomed", ready[1]};
  pid_t pid = tdt_fork(sleeper, &a);
  close(ready[1]);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  /* Killed before tensord read its unpublish, the child would rightly
   * leave the key (and the storage) behind: wait for it to say so. */
  char b;
  cr_assert_eq(read(ready[0], &b, 1), 1, "the child failed before pause()");
  close(ready[0]);
  cr_assert_eq(tdt_storages(&d), 1);
  cr_assert_eq(tdt_segments(&d), 1);
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000),
            "the dead holder's segment left /dev/shm");
  cr_assert_eq(tdt_storages(&d), 0);
  cr_assert_eq(td_lookup(c, "doomed", 0, 0, &s, NULL), TD_ENOENT);
  td_close(c);
}

TDT_TEST(core, readonly_open_cannot_write) {
  td_client *c = tdt_connect(&d);
  td_storage *rw, *ro;
  cr_assert_eq(td_storage_create(c, 8192, &rw), 0);
  cr_assert_eq(td_storage_open(c, td_storage_id(rw), TD_RDONLY, &ro), 0, "%s",
               td_last_error(c));
  cr_assert(td_storage_is_readonly(ro));
  ((char *)td_storage_data(rw))[100] = 42;
  cr_assert_eq(((char *)td_storage_data(ro))[100], 42);
  /* The reader's pages are mapped read-only, and changing that fails. */
  cr_assert_eq(mprotect(td_storage_data(ro), 4096, PROT_READ | PROT_WRITE), -1);
  cr_assert_eq(errno, EACCES);
  td_storage_release(ro);
  td_storage_release(rw);
  td_close(c);
}

TDT_TEST(core, close_drops_every_reference) {
  td_client *c = tdt_connect(&d);
  td_storage *s[5];
  for (int i = 0; i < 5; i++)
    cr_assert_eq(td_storage_create(c, 4096 * (i + 1), &s[i]), 0);
  cr_assert_eq(tdt_segments(&d), 5);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
  /* Handles outlive their client: still mapped until released. */
  ((char *)td_storage_data(s[4]))[0] = 1;
  for (int i = 0; i < 5; i++)
    cr_assert_eq(td_storage_release(s[i]), 0);
}

TDT_TEST(core, a_key_keeps_its_storage_alive) {
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  int64_t shape[2] = {8, 4};
  td_view v, got;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_storage_create(c, 128, &s), 0);
  cr_assert_eq(td_publish(c, "weights/layer0", s, &v), 0);
  uint64_t id = td_storage_id(s);
  td_storage_release(s);
  cr_assert_eq(tdt_storages(&d), 1, "the key holds a reference");
  cr_assert_eq(td_lookup(c, "weights/layer0", TD_RDONLY, 0, &t, &got), 0);
  cr_assert_eq(td_storage_id(t), id);
  cr_assert_eq(memcmp(&got, &v, sizeof(v)), 0, "the published view");
  td_storage_release(t);
  cr_assert_eq(td_unpublish(c, "weights/layer0"), 0);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
  cr_assert_eq(td_unpublish(c, "weights/layer0"), TD_ENOENT);
  cr_assert(strstr(td_last_error(c), "weights/layer0") != NULL);
  td_close(c);
}

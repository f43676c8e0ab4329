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
  child_arg a = {d.sock, "shared/a"};
  cr_assert_eq(tdt_wait(tdt_fork(consumer, &a)), 0);
  for (int i = 0; i < 4096; i++)
    cr_assert_eq(b[i], 0xab, "byte %d: the consumer's write is visible", i);
  cr_assert_eq(td_unpublish(c, "shared/a"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

typedef struct {
  child_arg a;
  int ready; /* write end: one byte once the child holds the only ref */
} sleeper_arg;

static int sleeper(void *p) {
  sleeper_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->a.sock, &c) == 0);
  CHECK(td_storage_create(c, 1 << 20, &s) == 0);
  CHECK(td_publish(c, a->a.key, s, NULL) == 0);
  CHECK(td_unpublish(c, a->a.key) == 0);
  CHECK(write(a->ready, "r", 1) == 1);
  pause(); /* killed here, holding the only reference */
  return 0;
}

TDT_TEST(core, sigkill_of_holder_frees_its_segment) {
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  sleeper_arg a = {{d.sock, "doomed"}, pfd[1]};
  pid_t pid = tdt_fork(sleeper, &a);
  close(pfd[1]);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  /* Wait until the child holds its storage and no longer the key (killed
   * between publish and unpublish, it would leave the key holding it). */
  char x;
  cr_assert_eq(read(pfd[0], &x, 1), 1, "the child failed before pause()");
  close(pfd[0]);
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

/* Mappings of d's segments in this process, and how many of them are
 * writable. */
static int mapped_segments(int *writable) {
  char needle[64], line[512];
  snprintf(needle, sizeof(needle), "/dev/shm/tensord.%016llx.",
           (unsigned long long)d.instance);
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert_not_null(f);
  int n = 0, w = 0;
  while (fgets(line, sizeof(line), f)) {
    if (strstr(line, needle) == NULL)
      continue;
    n++;
    char perms[8] = "";
    sscanf(line, "%*s %7s", perms);
    w += perms[1] == 'w';
  }
  fclose(f);
  if (writable != NULL)
    *writable = w;
  return n;
}

/* Read-only handles on a storage the process holds read-write share one
 * read-only mapping, made once and kept while the read-write handle lives:
 * a loop of read-only opens and releases maps nothing. The read-only
 * mapping stays read-only, and the mappings still go with the process's
 * last handle on the storage. */
TDT_TEST(core, readonly_opens_while_holding_readwrite_map_once) {
  td_client *c = tdt_connect(&d);
  td_client *c2 = tdt_connect(&d);
  td_storage *rw, *ro;
  cr_assert_eq(td_storage_create(c, 64 * 1024, &rw), 0);
  uint64_t id = td_storage_id(rw);
  ((char *)td_storage_data(rw))[100] = 42;
  cr_assert_eq(td_storage_open(c, id, TD_RDONLY, &ro), 0, "%s",
               td_last_error(c));
  void *ro_addr = td_storage_data(ro);
  td_storage_release(ro);
  int w = -1;
  cr_assert_eq(mapped_segments(&w), 2,
               "the read-only mapping went with its handle while the "
               "storage is still held read-write");
  cr_assert_eq(w, 1);
  for (int i = 0; i < 50; i++) {
    /* From either client of the process: the mapping is the process's. */
    td_client *on = i % 2 ? c2 : c;
    cr_assert_eq(td_storage_open(on, id, TD_RDONLY, &ro), 0, "%s",
                 td_last_error(on));
    cr_assert_eq(td_storage_data(ro), ro_addr, "open %d mapped again", i);
    cr_assert_eq(((char *)td_storage_data(ro))[100], 42);
    cr_assert_eq(mprotect(ro_addr, 4096, PROT_READ | PROT_WRITE), -1);
    cr_assert_eq(errno, EACCES);
    td_storage_release(ro);
  }
  cr_assert_eq(mapped_segments(&w), 2);
  cr_assert_eq(w, 1);
  /* The last handle takes both mappings. */
  td_storage_release(rw);
  cr_assert_eq(mapped_segments(NULL), 0);

  /* A read-only handle that outlives the read-write one keeps only its
   * own, read-only mapping; no writable mapping stays idle. */
  cr_assert_eq(td_storage_create(c, 8192, &rw), 0);
  cr_assert_eq(td_publish(c, "core/ro-outlives", rw, NULL), 0);
  cr_assert_eq(td_storage_open(c2, td_storage_id(rw), TD_RDONLY, &ro), 0);
  td_storage_release(rw);
  cr_assert_eq(mapped_segments(&w), 1);
  cr_assert_eq(w, 0);
  cr_assert_eq(td_lookup(c, "core/ro-outlives", 0, 0, &rw, NULL), 0);
  td_storage_release(rw);
  cr_assert_eq(mapped_segments(&w), 1);
  cr_assert_eq(w, 0);
  td_storage_release(ro);
  cr_assert_eq(mapped_segments(NULL), 0);
  cr_assert_eq(td_unpublish(c, "core/ro-outlives"), 0);
  td_close(c2);
  td_close(c);
}

/* Resident kB of this process's mapping that starts at addr, or (addr
 * NULL) of its first mapping of one of d's segments: the pages it has
 * mapped, faulted or populated; -1 if there is no such mapping. */
static long mapping_rss_kb(const void *addr) {
  char line[512], needle[64];
  snprintf(needle, sizeof(needle), "/dev/shm/tensord.%016llx.",
           (unsigned long long)d.instance);
  FILE *f = fopen("/proc/self/smaps", "r");
  cr_assert_not_null(f);
  int in = 0;
  long rss = -1;
  while (fgets(line, sizeof(line), f)) {
    unsigned long start, end;
    if (sscanf(line, "%lx-%lx ", &start, &end) == 2) { /* a mapping's head */
      in = addr != NULL ? start == (unsigned long)addr
                        : strstr(line, needle) != NULL;
      continue;
    }
    if (in && sscanf(line, "Rss: %ld kB", &rss) == 1)
      break;
  }
  fclose(f);
  return rss;
}

/* Mappings from 16 KiB (read-write) and 256 KiB (read-only) up come with
 * every page mapped once their bytes are first asked for (td_storage_data),
 * smaller ones fault page by page. */
TDT_TEST(core, big_mappings_come_populated) {
  td_client *c = tdt_connect(&d);
  td_client *c2 = tdt_connect(&d);
  td_storage *big, *small, *mid, *ro_big, *ro_mid;
  cr_assert_eq(td_storage_create(c, 1 << 20, &big), 0);
  cr_assert_eq(mapping_rss_kb(NULL), 0,
               "populated before its bytes were "
               "asked for");
  cr_assert_eq(td_storage_create(c, 8192, &small), 0);
  cr_assert_eq(td_storage_create(c, 64 * 1024, &mid), 0);
  cr_assert_eq(mapping_rss_kb(td_storage_data(big)), 1024);
  cr_assert_eq(mapping_rss_kb(td_storage_data(mid)), 64);
  cr_assert_eq(mapping_rss_kb(td_storage_data(small)), 0);
  cr_assert_eq(td_storage_open(c2, td_storage_id(big), TD_RDONLY, &ro_big), 0);
  cr_assert_eq(td_storage_open(c2, td_storage_id(mid), TD_RDONLY, &ro_mid), 0);
  cr_assert_eq(mapping_rss_kb(td_storage_data(ro_big)), 1024);
  cr_assert_eq(mapping_rss_kb(td_storage_data(ro_mid)), 0);
  td_storage_release(ro_mid);
  td_storage_release(ro_big);
  td_storage_release(mid);
  td_storage_release(small);
  td_storage_release(big);
  td_close(c2);
  td_close(c);
}

/* TENSORD_POPULATE_MIN, read once per process (each test is one). */
TDT_TEST(core, populate_min_off_never_populates) {
  setenv("TENSORD_POPULATE_MIN", "off", 1);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 1 << 20, &s), 0);
  cr_assert_eq(mapping_rss_kb(td_storage_data(s)), 0);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(core, populate_min_zero_always_populates) {
  setenv("TENSORD_POPULATE_MIN", "0", 1);
  td_client *c = tdt_connect(&d);
  td_storage *s, *r;
  cr_assert_eq(td_storage_create(c, 8192, &s), 0);
  cr_assert_eq(mapping_rss_kb(td_storage_data(s)), 8);
  td_storage_release(s);
  setenv("TENSORD_POPULATE_MIN", "off", 1); /* read once: no effect now */
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_storage_open(c, td_storage_id(s), TD_RDONLY, &r), 0);
  cr_assert_eq(mapping_rss_kb(td_storage_data(r)), 4);
  td_storage_release(r);
  td_storage_release(s);
  td_close(c);
}

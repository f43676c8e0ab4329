/* test_cuda_models.c: models loaded onto a GPU (issue 19 §3) against a real
 * tensord and real forked processes, over the TEST DOUBLE of the driver
 * (tests/cuda/), which ctest names in TENSORD_CUDA_DRIVER for this test
 * only (label cuda-double). The double queues asynchronous copies until
 * their stream is synchronised and insists on pinned sources, and logs
 * each pinned allocation's size to TDCUDA_HOSTALLOC_LOG: so the tests see
 * a slot reused before its copy finished (wrong bytes), and the staging
 * bound. It proves the loader's bookkeeping, not GPU speed. */
#include "cli.h"
#include "harness.h"
#include "stfile.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MiB ((uint64_t)1 << 20)
#define GRAN (2 * MiB) /* the double's allocation granularity */

static tdt_daemon d;
static char dir[64];
static char hostlog[128];

static void setup(void) {
  if (getenv("TENSORD_CUDA_DRIVER") == NULL)
    cr_skip_test("TENSORD_CUDA_DRIVER is not set: run through ctest, which "
                 "names the driver's test double");
  memset(&d, 0, sizeof(d));
  tdt_mkdtemp(dir);
  snprintf(hostlog, sizeof(hostlog), "%s.hostalloc", dir);
  unlink(hostlog);
}

static void teardown(void) {
  tdt_cleanup();
  unsetenv("TENSORD_LOAD_STAGING");
  unsetenv("TDCUDA_HOSTALLOC_LOG");
  unsetenv("TDCUDA_MEM");
  unlink(hostlog);
  if (dir[0] != '\0')
    tdt_rmdir(dir);
}

TestSuite(cuda_models, .init = setup, .fini = teardown, .timeout = 60);

/* Three shards; the first holds more than a 1 MiB staging buffer, in
 * several slots, so slots are reused. */
static const tdt_st_tensor sh1[] = {{"a", "F32", 2, {768, 1024}},
                                    {"b", "I64", 1, {6}}};
static const tdt_st_tensor sh2[] = {{"c", "BF16", 1, {10}}};
static const tdt_st_tensor sh3[] = {{"d", "U8", 1, {(1 << 20) + 33}},
                                    {"e", "F64", 2, {3, 3}}};
static const char index_json[] =
    "{\"metadata\":{\"total_size\":1000},\"weight_map\":{"
    "\"e\":\"m-3.safetensors\",\"a\":\"m-1.safetensors\","
    "\"c\":\"m-2.safetensors\",\"b\":\"m-1.safetensors\","
    "\"d\":\"m-3.safetensors\"}}";
static const char *const files[] = {"m-1.safetensors", "m-2.safetensors",
                                    "m-3.safetensors"};

static void write_sharded(uint8_t marker) {
  char p[160];
  snprintf(p, sizeof(p), "%s/llm", dir);
  mkdir(p, 0700);
  snprintf(p, sizeof(p), "%s/llm/m-1.safetensors", dir);
  cr_assert_eq(tdt_st_write(p, sh1, 2, NULL, marker), 0);
  snprintf(p, sizeof(p), "%s/llm/m-2.safetensors", dir);
  cr_assert_eq(tdt_st_write(p, sh2, 1, NULL, marker), 0);
  snprintf(p, sizeof(p), "%s/llm/m-3.safetensors", dir);
  cr_assert_eq(tdt_st_write(p, sh3, 2, NULL, marker), 0);
  snprintf(p, sizeof(p), "%s/llm/model.safetensors.index.json", dir);
  cr_assert_eq(tdt_write_text(p, index_json), 0);
}

static uint64_t file_size(const char *file) {
  char p[160];
  struct stat sb;
  snprintf(p, sizeof(p), "%s/llm/%s", dir, file);
  return stat(p, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

/* The file's bytes (malloc'd), *n their count; NULL if unreadable. */
static uint8_t *file_bytes(const char *file, size_t *n) {
  char p[160];
  snprintf(p, sizeof(p), "%s/llm/%s", dir, file);
  return tdt_read_file(p, n);
}

typedef struct load_arg {
  const char *sock;
  const char *path;
  int64_t index;
  int want; /* the load's expected result */
} load_arg;

/* Loads the checkpoint onto cuda:index in a process of its own, which then
 * exits: the model outlives its loader. */
static int loader(void *arg) {
  load_arg *a = arg;
  td_client *c;
  CHECK(td_connect(a->sock, &c) == 0);
  td_load_opts o = {.device = TD_CUDA, .device_index = a->index, .threads = 3};
  td_load_result r;
  CHECK_ERR(c, td_model_load(c, a->path, "llm", &o, &r), a->want);
  if (a->want == 0)
    CHECK(r.shards == 3 && r.tensors == 5 && r.version >= 1);
  td_close(c);
  return 0;
}

static void load_in_child(int64_t index, int want) {
  char p[128];
  snprintf(p, sizeof(p), "%s/llm", dir);
  load_arg a = {d.sock, p, index, want};
  cr_assert_eq(tdt_wait(tdt_fork(loader, &a)), 0, "the loader failed");
}

/* Attaches "llm" and compares every byte of every shard, read back from
 * the device (td_copy into a CPU storage), with its file; and every
 * tensor's view with the manifest's. */
static int attacher(void *arg) {
  const char *sock = arg;
  td_client *c;
  CHECK(td_connect(sock, &c) == 0);
  td_model *m;
  CHECK_ERR(c, td_model_open(c, "llm", TD_RDONLY, 0, &m), 0);
  CHECK(td_model_count(m) == 5);
  CHECK(strstr(td_model_manifest(m), "\"device\":\"cuda\"") != NULL);
  CHECK(strstr(td_model_manifest(m), "\"device_uuid\":\"GPU-") != NULL);
  for (size_t i = 0; i < 3; i++) {
    td_storage *s;
    char key[64];
    snprintf(key, sizeof(key), "llm@1/%s", files[i]);
    CHECK_ERR(c, td_lookup(c, key, TD_RDONLY, 0, &s, NULL), 0);
    CHECK(td_storage_device(s) == TD_CUDA);
    size_t n;
    uint8_t *want = file_bytes(files[i], &n);
    CHECK(want != NULL && td_storage_nbytes(s) == n);
    td_storage *h;
    CHECK_ERR(c, td_storage_create(c, n, &h), 0);
    int64_t shape = (int64_t)n;
    td_view v;
    CHECK(td_view_contiguous(TD_UINT8, 1, &shape, &v) == 0);
    CHECK(td_copy(h, &v, s, &v) == 0);
    CHECK(memcmp(td_storage_data(h), want, n) == 0);
    free(want);
    td_storage_release(h);
    td_storage_release(s);
  }
  /* The tensors are views of their shard on the GPU. */
  td_storage *s;
  td_view v;
  CHECK_ERR(c, td_model_find(m, "d", &s, &v), 0);
  CHECK(td_storage_device(s) == TD_CUDA && v.dtype == TD_UINT8 &&
        v.shape[0] == (1 << 20) + 33);
  td_model_close(m);
  td_close(c);
  return 0;
}

/* The largest pinned allocation the double logged, 0 for none; *count
 * how many. */
static uint64_t largest_pinned(int *count) {
  FILE *f = fopen(hostlog, "r");
  uint64_t max = 0;
  unsigned long long n;
  *count = 0;
  if (f == NULL)
    return 0;
  while (fscanf(f, "%llu", &n) == 1) {
    (*count)++;
    if (n > max)
      max = n;
  }
  fclose(f);
  return max;
}

/* The daemon's storages on its GPU 0 and their bytes. */
static td_device_stat gpu0(td_client *c) {
  td_device_stat ds[4];
  size_t n = 0;
  cr_assert_eq(td_stat_devices(c, ds, 4, &n), 0, "%s", td_last_error(c));
  cr_assert_geq(n, 1, "the daemon lists no GPU");
  return ds[0];
}

static uint64_t rounded(uint64_t n) {
  return (n + GRAN - 1) / GRAN * GRAN;
}

TDT_TEST(cuda_models, loads_once_and_three_processes_attach_the_same_bytes) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded(3);
  setenv("TENSORD_LOAD_STAGING", "1M", 1);
  setenv("TDCUDA_HOSTALLOC_LOG", hostlog, 1);
  load_in_child(0, 0);
  /* Staging: pinned, bounded by the knob though shard 1 is 3 MiB. */
  int pins;
  uint64_t big = largest_pinned(&pins);
  cr_expect_eq(pins, 1, "%d pinned allocations", pins);
  cr_expect(big > 0 && big <= MiB, "pinned %llu bytes, bound 1 MiB",
            (unsigned long long)big);
  cr_assert_gt(file_size(files[0]), 3 * MiB);
  /* One device allocation per shard, each its file's size rounded. */
  td_device_stat g = gpu0(c);
  cr_expect_eq(g.storages, 3);
  uint64_t want = 0;
  for (size_t i = 0; i < 3; i++)
    want += rounded(file_size(files[i]));
  cr_expect_eq(g.bytes_used, want, "%llu bytes on the GPU, want %llu",
               (unsigned long long)g.bytes_used, (unsigned long long)want);
  /* Three processes attach (no load) and see every byte. */
  pid_t kids[3];
  for (int i = 0; i < 3; i++)
    kids[i] = tdt_fork(attacher, (void *)d.sock);
  for (int i = 0; i < 3; i++)
    cr_expect_eq(tdt_wait(kids[i]), 0, "attacher %d failed", i);
  /* The same source again, on the same GPU: unchanged, nothing made. */
  unlink(hostlog);
  load_in_child(0, 0);
  cr_expect_eq(largest_pinned(&pins), 0, "an unchanged load staged bytes");
  cr_expect_eq(gpu0(c).storages, 3);
  cr_assert_eq(td_model_unload(c, "llm"), 0, "%s", td_last_error(c));
  td_close(c);
}

TDT_TEST(cuda_models, default_staging_is_no_bigger_than_a_small_model) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded(4);
  setenv("TDCUDA_HOSTALLOC_LOG", hostlog, 1);
  load_in_child(0, 0);
  uint64_t total = 0;
  for (size_t i = 0; i < 3; i++)
    total += file_size(files[i]);
  int pins;
  uint64_t big = largest_pinned(&pins);
  cr_expect_eq(pins, 1);
  cr_expect(big > 0 && big <= (total + 4095) / 4096 * 4096,
            "pinned %llu bytes for a model of %llu", (unsigned long long)big,
            (unsigned long long)total);
  pid_t kid = tdt_fork(attacher, (void *)d.sock);
  cr_expect_eq(tdt_wait(kid), 0);
  td_close(c);
}

/* After a failed load nothing is left: no key, no storage, no device
 * memory. */
static void expect_nothing(td_client *c) {
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "%s", td_last_error(c));
  cr_expect_eq(st.keys, 0, "%llu keys left", (unsigned long long)st.keys);
  for (int i = 0; i < 200 && st.storages != 0; i++) {
    tdt_sleep_ms(10); /* releases need no reply */
    td_stat_get(c, &st);
  }
  cr_expect_eq(st.storages, 0, "%llu storages left",
               (unsigned long long)st.storages);
}

TDT_TEST(cuda_models, a_failed_load_leaves_nothing) {
  /* The daemon's GPU holds the first two shards (4 + 2 MiB), not the third. */
  setenv("TDCUDA_MEM", "6M", 1);
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded(5);
  load_in_child(0, TD_ENOMEM);
  expect_nothing(c);
  cr_expect_eq(gpu0(c).bytes_used, 0);
  /* No such GPU. */
  load_in_child(7, TD_ENODEV);
  expect_nothing(c);
  /* A staging bound that is no size. */
  setenv("TENSORD_LOAD_STAGING", "lots", 1);
  load_in_child(0, TD_EINVAL);
  expect_nothing(c);
  td_close(c);
}

TDT_TEST(cuda_models, a_cpu_model_loaded_onto_the_gpu_is_a_new_version) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded(6);
  char p[128];
  snprintf(p, sizeof(p), "%s/llm", dir);
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, "llm", NULL, &r), 0, "%s", td_last_error(c));
  cr_assert_eq(r.version, 1);
  /* The same source to the GPU is not "unchanged": version 2, on it. */
  load_in_child(0, 0);
  td_model *m;
  cr_assert_eq(td_model_open(c, "llm", TD_RDONLY, 0, &m), 0, "%s",
               td_last_error(c));
  cr_expect_eq(td_model_version(m), 2);
  td_storage *s;
  cr_assert_eq(td_model_find(m, "a", &s, NULL), 0);
  cr_expect_eq(td_storage_device(s), TD_CUDA);
  td_model_close(m);
  cr_expect_eq(gpu0(c).storages, 3);
  td_close(c);
}

#define CTL(r, ...)                                                            \
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,         \
                                    __VA_ARGS__, NULL},                        \
              r)

/* tensorctl load --device cuda:K, and save back from the GPU byte for
 * byte. */
TDT_TEST(cuda_models, tensorctl_loads_onto_a_gpu_and_saves_it_back) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded(8);
  char p[128], out[128], a[192], b[192];
  snprintf(p, sizeof(p), "%s/llm", dir);
  snprintf(out, sizeof(out), "%s/out", dir);
  tdt_run_result r;
  CTL(&r, "load", p, "--device", "cuda:1", "--quiet");
  tdt_expect_ok(&r, "tensorctl load --device cuda:1");
  tdt_run_free(&r);
  td_device_stat ds[4];
  size_t n = 0;
  cr_assert_eq(td_stat_devices(c, ds, 4, &n), 0, "%s", td_last_error(c));
  uint64_t on = 0;
  for (size_t i = 0; i < n && i < 4; i++)
    on += ds[i].index == 1 ? ds[i].storages : 0;
  cr_expect_eq(on, 3, "%llu storages on the daemon's cuda:1",
               (unsigned long long)on);
  CTL(&r, "load", p, "--device", "cuda:x");
  cr_expect_eq(r.status, 2);
  tdt_run_free(&r);
  CTL(&r, "save", "llm", out);
  tdt_expect_ok(&r, "tensorctl save of a CUDA model");
  tdt_run_free(&r);
  for (size_t i = 0; i < 3; i++) {
    snprintf(a, sizeof(a), "%s/%s", p, files[i]);
    snprintf(b, sizeof(b), "%s/%s", out, files[i]);
    cr_expect_eq(tdt_same_file(a, b), 1, "%s differs from %s", b, a);
    unlink(b);
  }
  snprintf(b, sizeof(b), "%s/model.safetensors.index.json", out);
  unlink(b);
  rmdir(out);
  td_close(c);
}

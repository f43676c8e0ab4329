/* test_models.c: models from safetensors checkpoints (issue 19 §1) against
 * a real tensord, from real processes: loads of a file and of a sharded
 * index byte for byte, versions and their atomic switch, the load lock,
 * orphans, nothing left by a failure, save round trips, unload; and
 * tensorctl load, save, unload, show and ls. */
#include "cli.h"
#include "harness.h"
#include "stfile.h"

#include <criterion/criterion.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static tdt_daemon d;
static char dir[64];

static void setup(void) {
  memset(&d, 0, sizeof(d));
  tdt_mkdtemp(dir);
}

static void teardown(void) {
  tdt_cleanup();
  tdt_rmdir(dir);
}

TestSuite(models, .init = setup, .fini = teardown, .timeout = 60);
TestSuite(models_cli, .init = setup, .fini = teardown, .timeout = 60);

/* The single-file checkpoint: every dtype safetensors and tensord share. */
static const tdt_st_tensor one[] = {
    {"model.embed.weight", "F32", 2, {16, 8}},
    {"model.layers.0.w", "BF16", 2, {8, 8}},
    {"model.layers.0.b", "F16", 1, {8}},
    {"model.norm", "F64", 1, {3}},
    {"ids", "I64", 1, {5}},
    {"i32", "I32", 2, {2, 3}},
    {"i16", "I16", 1, {7}},
    {"i8", "I8", 1, {9}},
    {"u8", "U8", 3, {2, 2, 2}},
    {"mask", "BOOL", 1, {4}},
    {"u16", "U16", 1, {3}},
    {"u32", "U32", 1, {3}},
    {"u64", "U64", 1, {2}},
    {"f8a", "F8_E4M3", 1, {5}},
    {"f8b", "F8_E5M2", 1, {5}},
    {"scalar", "F32", 0, {0}},
    {"empty", "F32", 2, {0, 4}},
};
#define NONE (sizeof(one) / sizeof(one[0]))

/* The sharded one: three shards, the tensors' order the weight_map's. */
static const tdt_st_tensor sh1[] = {{"a", "F32", 2, {32, 4}},
                                    {"b", "I64", 1, {6}}};
static const tdt_st_tensor sh2[] = {{"c", "BF16", 1, {10}}};
static const tdt_st_tensor sh3[] = {{"d", "U8", 1, {33}},
                                    {"e", "F64", 2, {3, 3}}};
static const char index_json[] =
    "{\"metadata\":{\"total_size\":1000},\"weight_map\":{"
    "\"e\":\"m-3.safetensors\",\"a\":\"m-1.safetensors\","
    "\"c\":\"m-2.safetensors\",\"b\":\"m-1.safetensors\","
    "\"d\":\"m-3.safetensors\"}}";

static void path_of(char *buf, size_t len, const char *file) {
  snprintf(buf, len, "%s/%s", dir, file);
}

/* Writes the single file as dir/file with marker. */
static void write_one(const char *file, uint8_t marker) {
  char p[128];
  path_of(p, sizeof(p), file);
  cr_assert_eq(tdt_st_write(p, one, NONE, "{\"format\":\"pt\"}", marker), 0);
}

/* Writes the sharded checkpoint into dir/sub with marker. */
static void write_sharded(const char *sub, uint8_t marker) {
  char p[160];
  snprintf(p, sizeof(p), "%s/%s", dir, sub);
  mkdir(p, 0700);
  snprintf(p, sizeof(p), "%s/%s/m-1.safetensors", dir, sub);
  cr_assert_eq(tdt_st_write(p, sh1, 2, NULL, marker), 0);
  snprintf(p, sizeof(p), "%s/%s/m-2.safetensors", dir, sub);
  cr_assert_eq(tdt_st_write(p, sh2, 1, NULL, marker), 0);
  snprintf(p, sizeof(p), "%s/%s/m-3.safetensors", dir, sub);
  cr_assert_eq(tdt_st_write(p, sh3, 2, NULL, marker), 0);
  snprintf(p, sizeof(p), "%s/%s/model.safetensors.index.json", dir, sub);
  cr_assert_eq(tdt_write_text(p, index_json), 0);
}

/* The index of tensor name in its shard's writing order, and that shard. */
static const tdt_st_tensor *shard_tensor(const char *name, size_t *i) {
  static const tdt_st_tensor *const shards[] = {sh1, sh2, sh3};
  static const size_t n[] = {2, 1, 2};
  for (size_t s = 0; s < 3; s++)
    for (size_t k = 0; k < n[s]; k++)
      if (strcmp(shards[s][k].name, name) == 0) {
        *i = k;
        return &shards[s][k];
      }
  return NULL;
}

/* Counts the bytes of m's tensors that differ from what the writer put
 * there with marker; sharded says which checkpoint m is. */
static size_t wrong_bytes(const td_model *m, int sharded, uint8_t marker) {
  size_t bad = 0;
  for (size_t t = 0; t < td_model_count(m); t++) {
    const char *name;
    td_storage *s;
    td_view v;
    if (td_model_tensor(m, t, &name, &s, &v) < 0)
      return SIZE_MAX;
    size_t i = t;
    if (sharded && shard_tensor(name, &i) == NULL)
      return SIZE_MAX;
    size_t item = td_dtype_size(v.dtype);
    int64_t numel = td_view_numel(&v);
    const uint8_t *p =
        (const uint8_t *)td_storage_data(s) + (size_t)v.offset * item;
    for (uint64_t j = 0; j < (uint64_t)numel * item; j++)
      bad += p[j] != tdt_st_byte(i, j, marker);
  }
  return bad;
}

static td_stat stat_of(td_client *c) {
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  return st;
}

static uint64_t want_storages, want_keys;
static td_client *poll_c;

static int at_baseline(const tdt_daemon *dd) {
  (void)dd;
  td_stat st;
  return td_stat_get(poll_c, &st) == 0 && st.storages == want_storages &&
         st.keys == want_keys;
}

/* Waits (releases need no reply) until tensord holds storages and keys. */
static void expect_holds(td_client *c, uint64_t storages, uint64_t keys) {
  poll_c = c;
  want_storages = storages;
  want_keys = keys;
  int ok = tdt_until(at_baseline, &d, 10000);
  td_stat st = stat_of(c);
  cr_assert(ok, "tensord holds %llu storages and %llu keys, not %llu and %llu",
            (unsigned long long)st.storages, (unsigned long long)st.keys,
            (unsigned long long)storages, (unsigned long long)keys);
}

/* ---- loads ---- */

TDT_TEST(models, loads_a_file_byte_for_byte) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_one("tiny.safetensors", 1);
  char p[128];
  path_of(p, sizeof(p), "tiny.safetensors");
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, NULL, NULL, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.version, 1);
  cr_expect_eq(r.tensors, NONE);
  cr_expect_eq(r.shards, 1);
  cr_expect_eq(r.unchanged, 0);
  struct stat sb;
  stat(p, &sb);
  cr_expect_eq(r.bytes, (uint64_t)sb.st_size);
  /* The manifest, a shard and a key per tensor. */
  expect_holds(c, 2, 2 + NONE);
  td_model *m;
  cr_assert_eq(td_model_open(c, "tiny", TD_RDONLY, 0, &m), 0, "%s",
               td_last_error(c));
  cr_expect_eq(td_model_version(m), 1);
  cr_assert_eq(td_model_count(m), NONE);
  for (size_t i = 0; i < NONE; i++) {
    const char *name;
    td_model_tensor(m, i, &name, NULL, NULL);
    cr_expect_str_eq(name, one[i].name); /* the header's order */
  }
  cr_expect_eq(wrong_bytes(m, 0, 1), 0);
  /* The shard storage is the file, verbatim. */
  td_storage *s;
  td_view v;
  cr_assert_eq(td_model_find(m, "model.norm", &s, &v), 0);
  cr_expect_eq(td_storage_nbytes(s), (size_t)sb.st_size);
  FILE *f = fopen(p, "rb");
  uint8_t *file = malloc((size_t)sb.st_size);
  cr_assert_eq(fread(file, 1, (size_t)sb.st_size, f), (size_t)sb.st_size);
  fclose(f);
  cr_expect_eq(memcmp(file, td_storage_data(s), (size_t)sb.st_size), 0);
  free(file);
  cr_expect_eq(v.dtype, TD_FLOAT64);
  cr_expect_eq(td_model_find(m, "nope", NULL, NULL), TD_ENOENT);
  cr_expect(strstr(td_model_manifest(m), "\"format\":\"pt\"") != NULL);
  /* Each tensor's key is its view of the shard. */
  td_storage *k;
  td_view kv;
  cr_assert_eq(td_lookup(c, "tiny/model.norm", TD_RDONLY, 0, &k, &kv), 0);
  cr_expect_eq(td_storage_id(k), td_storage_id(s));
  cr_expect_eq(memcmp(&kv, &v, sizeof(v)), 0);
  td_storage_release(k);
  cr_assert_eq(td_lookup(c, "tiny@1/tiny.safetensors", TD_RDONLY, 0, &k, NULL),
               0);
  td_storage_release(k);
  td_model_close(m);
  td_close(c);
}

/* A shard of several 16 MiB chunks, copied by 3 threads, by splice and
 * by the pread fallback: every byte lands where it belongs. */
static void load_chunks(const char *copy) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  static const tdt_st_tensor big[] = {{"w", "U8", 1, {(40 << 20) + 3}},
                                      {"b", "F32", 1, {1000}}};
  char p[128];
  path_of(p, sizeof(p), "big.safetensors");
  cr_assert_eq(tdt_st_write(p, big, 2, NULL, 7), 0);
  if (copy != NULL)
    setenv("TENSORD_LOAD_COPY", copy, 1);
  td_load_opts o = {.threads = 3};
  td_load_result r;
  int err = td_model_load(c, p, "big", &o, &r);
  unsetenv("TENSORD_LOAD_COPY");
  cr_assert_eq(err, 0, "%s", td_last_error(c));
  td_model *m;
  cr_assert_eq(td_model_open(c, "big", TD_RDONLY, 0, &m), 0, "%s",
               td_last_error(c));
  size_t bad = 0;
  for (size_t t = 0; t < td_model_count(m); t++) {
    const char *name;
    td_storage *s;
    td_view v;
    cr_assert_eq(td_model_tensor(m, t, &name, &s, &v), 0);
    size_t i = strcmp(name, "w") == 0 ? 0 : 1;
    size_t item = td_dtype_size(v.dtype);
    const uint8_t *q =
        (const uint8_t *)td_storage_data(s) + (size_t)v.offset * item;
    for (uint64_t j = 0; j < (uint64_t)td_view_numel(&v) * item; j++)
      bad += q[j] != tdt_st_byte(i, j, 7);
  }
  cr_expect_eq(bad, 0, "%zu bytes differ from the file", bad);
  td_model_close(m);
  cr_assert_eq(td_model_unload(c, "big"), 0, "%s", td_last_error(c));
  unlink(p);
  td_close(c);
}

TDT_TEST(models, loads_chunks_by_splice) {
  load_chunks(NULL);
}

TDT_TEST(models, loads_chunks_by_pread) {
  load_chunks("pread");
}

TDT_TEST(models, loads_a_sharded_index_byte_for_byte) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded("llm", 2);
  char p[128];
  path_of(p, sizeof(p), "llm");
  td_load_opts o = {.threads = 3};
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, "llm", &o, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.shards, 3);
  cr_expect_eq(r.tensors, 5);
  expect_holds(c, 4, 1 + 3 + 5);
  td_model *m;
  cr_assert_eq(td_model_open(c, "llm", TD_RDONLY | TD_LAZY, 0, &m), 0, "%s",
               td_last_error(c));
  static const char *const order[] = {"e", "a", "c", "b", "d"};
  for (size_t i = 0; i < 5; i++) {
    const char *name;
    td_model_tensor(m, i, &name, NULL, NULL);
    cr_expect_str_eq(name, order[i]);
  }
  cr_expect_eq(wrong_bytes(m, 1, 2), 0);
  cr_expect(strstr(td_model_manifest(m), "\"total_size\":1000") != NULL);
  td_model_close(m);
  td_close(c);
}

TDT_TEST(models, same_file_again_is_unchanged_and_force_makes_version_2) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_one("w.safetensors", 1);
  char p[128];
  path_of(p, sizeof(p), "w.safetensors");
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, "w", NULL, &r), 0, "%s", td_last_error(c));
  td_stat before = stat_of(c);
  cr_assert_eq(td_model_load(c, p, "w", NULL, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.unchanged, 1);
  cr_expect_eq(r.version, 1);
  cr_expect_eq(r.tensors, NONE);
  expect_holds(c, before.storages, before.keys);
  td_load_opts o = {.flags = TD_MODEL_FORCE};
  cr_assert_eq(td_model_load(c, p, "w", &o, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.unchanged, 0);
  cr_expect_eq(r.version, 2);
  /* Version 1 is gone (nobody held it): the same count of storages. */
  expect_holds(c, before.storages, before.keys);
  td_storage *s;
  cr_expect_eq(td_lookup(c, "w@1/w.safetensors", TD_RDONLY, 0, &s, NULL),
               TD_ENOENT);
  cr_assert_eq(td_lookup(c, "w@2/w.safetensors", TD_RDONLY, 0, &s, NULL), 0);
  td_storage_release(s);
  /* A changed file (its mtime) is a new version without --force. */
  tdt_sleep_ms(5);
  write_one("w.safetensors", 9);
  cr_assert_eq(td_model_load(c, p, "w", NULL, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.version, 3);
  td_model *m;
  cr_assert_eq(td_model_open(c, "w", TD_RDONLY, 0, &m), 0);
  cr_expect_eq(wrong_bytes(m, 0, 9), 0);
  td_model_close(m);
  td_close(c);
}

/* ---- the atomic switch ---- */

typedef struct reader_arg {
  const char *sock;
  atomic_int *stop;
  atomic_int *attaches;
} reader_arg;

/* Attaches "sw" in a loop until told to stop: every tensor of every attach
 * must carry the marker of the version attached (marker = version). */
static int reader(void *arg) {
  reader_arg *a = arg;
  td_client *c;
  CHECK(td_connect(a->sock, &c) == 0);
  uint64_t last = 0;
  while (!atomic_load(a->stop)) {
    td_model *m;
    int err = td_model_open(c, "sw", TD_RDONLY, 1000, &m);
    CHECK_ERR(c, err, 0);
    uint64_t v = td_model_version(m);
    CHECK(v >= last);
    last = v;
    size_t bad = wrong_bytes(m, 0, (uint8_t)v);
    if (bad != 0)
      fprintf(stderr, "version %llu: %zu bytes of another version\n",
              (unsigned long long)v, bad);
    CHECK(bad == 0);
    td_model_close(m);
    atomic_fetch_add(a->attaches, 1);
  }
  td_close(c);
  return 0;
}

TDT_TEST(models, readers_never_see_a_mix_of_versions) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  atomic_int *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  cr_assert_neq(shared, MAP_FAILED);
  atomic_init(&shared[0], 0);
  atomic_init(&shared[1], 0);
  char p[128];
  path_of(p, sizeof(p), "sw.safetensors");
  write_one("sw.safetensors", 1);
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, "sw", NULL, &r), 0, "%s", td_last_error(c));
  reader_arg a = {d.sock, &shared[0], &shared[1]};
  pid_t kids[2] = {tdt_fork(reader, &a), tdt_fork(reader, &a)};
  for (uint8_t v = 2; v <= 8; v++) {
    tdt_sleep_ms(20);
    write_one("sw.safetensors", v); /* a new mtime: a new version */
    cr_assert_eq(td_model_load(c, p, "sw", NULL, &r), 0, "%s",
                 td_last_error(c));
    cr_assert_eq(r.version, v);
  }
  tdt_sleep_ms(50);
  atomic_store(&shared[0], 1);
  cr_expect_eq(tdt_wait(kids[0]), 0);
  cr_expect_eq(tdt_wait(kids[1]), 0);
  cr_expect_gt(atomic_load(&shared[1]), 7, "only %d attaches",
               atomic_load(&shared[1]));
  /* Only version 8 is left once the readers are gone. */
  expect_holds(c, 2, 2 + NONE);
  munmap(shared, 4096);
  td_close(c);
}

typedef struct holder_arg {
  const char *sock;
  int ready_w, go_r;
} holder_arg;

/* Attaches "old" and holds it until told to let go. */
static int holder(void *arg) {
  holder_arg *h = arg;
  td_client *c;
  CHECK(td_connect(h->sock, &c) == 0);
  td_model *m;
  CHECK_ERR(c, td_model_open(c, "old", TD_RDONLY, 0, &m), 0);
  CHECK(td_model_version(m) == 1);
  char b = 1;
  CHECK(write(h->ready_w, &b, 1) == 1);
  CHECK(read(h->go_r, &b, 1) >= 0);
  CHECK(wrong_bytes(m, 0, 1) == 0); /* still version 1's bytes */
  td_model_close(m);
  td_close(c);
  return 0;
}

TDT_TEST(models, an_old_version_lives_until_its_last_holder_lets_go) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_one("old.safetensors", 1);
  char p[128];
  path_of(p, sizeof(p), "old.safetensors");
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, NULL, NULL, &r), 0, "%s", td_last_error(c));
  int ready[2], go[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(go), 0);
  holder_arg h = {d.sock, ready[1], go[0]};
  pid_t kid = tdt_fork(holder, &h);
  char b;
  cr_assert_eq(read(ready[0], &b, 1), 1);
  td_load_opts o = {.flags = TD_MODEL_FORCE};
  cr_assert_eq(td_model_load(c, p, NULL, &o, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.version, 2);
  /* Version 2's manifest and shard, and version 1's shard the child holds. */
  expect_holds(c, 3, 2 + NONE);
  cr_assert_eq(write(go[1], &b, 1), 1);
  cr_expect_eq(tdt_wait(kid), 0);
  expect_holds(c, 2, 2 + NONE);
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
  td_close(c);
}

/* ---- failures leave nothing ---- */

TDT_TEST(models, a_broken_checkpoint_leaves_no_key_and_no_storage) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  /* Something else in tensord, which must stay as it is. */
  td_storage *keep;
  cr_assert_eq(td_storage_create(c, 64, &keep), 0);
  cr_assert_eq(td_publish(c, "keep", keep, NULL), 0);
  write_one("ok.safetensors", 1);
  char ok[128];
  path_of(ok, sizeof(ok), "ok.safetensors");
  td_load_result r;
  cr_assert_eq(td_model_load(c, ok, "m", NULL, &r), 0);
  td_stat before = stat_of(c);
  static const struct {
    const char *file, *header, *fragment;
    uint64_t data;
    int code;
  } bads[] = {
      {"dtype.safetensors",
       "{\"w\":{\"dtype\":\"F4\",\"shape\":[1],\"data_offsets\":[0,1]}}   ",
       "dtype.safetensors: tensor 'w': dtype: unknown dtype 'F4'", 8,
       TD_EINVAL},
      {"cover.safetensors",
       "{\"lm_head.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_"
       "offsets\":[0,12]}}",
       "cover.safetensors: tensor 'lm_head.weight': data_offsets [0, 12] "
       "cover 12 bytes, F32[2, 3] needs 24",
       24, TD_EINVAL},
      {"json.safetensors", "{\"w\":", "json.safetensors: header byte", 0,
       TD_EINVAL},
  };
  char p[128];
  for (size_t i = 0; i < sizeof(bads) / sizeof(bads[0]); i++) {
    path_of(p, sizeof(p), bads[i].file);
    cr_assert_eq(tdt_st_write_raw(p, strlen(bads[i].header), bads[i].header,
                                  bads[i].data),
                 0);
    /* As a new model, and over the loaded one. */
    static const char *const names[] = {"fresh", "m"};
    for (int n = 0; n < 2; n++) {
      cr_expect_eq(td_model_load(c, p, names[n], NULL, &r), bads[i].code, "%s",
                   bads[i].file);
      cr_expect(strstr(td_last_error(c), bads[i].fragment) != NULL,
                "'%s' lacks '%s'", td_last_error(c), bads[i].fragment);
      expect_holds(c, before.storages, before.keys);
    }
  }
  /* An index naming a missing shard. */
  write_sharded("broken", 1);
  path_of(p, sizeof(p), "broken/m-2.safetensors");
  unlink(p);
  path_of(p, sizeof(p), "broken");
  cr_expect_eq(td_model_load(c, p, "m", NULL, &r), TD_ENOENT);
  cr_expect(strstr(td_last_error(c), "m-2.safetensors") != NULL, "%s",
            td_last_error(c));
  expect_holds(c, before.storages, before.keys);
  /* A name whose tensor keys would not fit, a name with '@', CUDA. */
  char longname[240];
  memset(longname, 'n', sizeof(longname) - 1);
  longname[sizeof(longname) - 1] = '\0';
  cr_expect_eq(td_model_load(c, ok, longname, NULL, &r), TD_ENAMETOOLONG);
  cr_expect(strstr(td_last_error(c), "tensor 'model.embed.weight'") != NULL,
            "%s", td_last_error(c));
  cr_expect_eq(td_model_load(c, ok, "a@b", NULL, &r), TD_EINVAL);
  /* A GPU where there is no driver (test_cuda_models loads onto the
   * driver's double): refused before anything is made. */
  setenv("TENSORD_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  td_load_opts o = {.device = TD_CUDA};
  cr_expect_eq(td_model_load(c, ok, "gpu", &o, &r), TD_ENODEV);
  cr_expect(strstr(td_last_error(c), "load to cuda:0") != NULL, "%s",
            td_last_error(c));
  unsetenv("TENSORD_CUDA_DRIVER");
  /* A key that is not a model is not overwritten. */
  cr_expect_eq(td_model_load(c, ok, "keep", NULL, &r), TD_EINVAL);
  cr_expect(strstr(td_last_error(c), "key 'keep' holds no model manifest") !=
                NULL,
            "%s", td_last_error(c));
  expect_holds(c, before.storages, before.keys);
  /* The model loaded before is untouched. */
  td_model *m;
  cr_assert_eq(td_model_open(c, "m", TD_RDONLY, 0, &m), 0);
  cr_expect_eq(td_model_version(m), 1);
  cr_expect_eq(wrong_bytes(m, 0, 1), 0);
  td_model_close(m);
  td_storage_release(keep);
  td_close(c);
}

typedef struct loader_arg {
  const char *sock, *path;
  int ready_w;
} loader_arg;

static void stall(const td_load_progress *p, void *arg) {
  (void)p;
  loader_arg *l = arg;
  char b = 1;
  if (write(l->ready_w, &b, 1) == 1)
    for (;;)
      pause(); /* killed here, mid-load */
}

static int stalled_loader(void *arg) {
  loader_arg *l = arg;
  td_client *c;
  CHECK(td_connect(l->sock, &c) == 0);
  td_load_opts o = {.threads = 1, .progress = stall, .progress_arg = l};
  td_load_result r;
  td_model_load(c, l->path, "k", &o, &r);
  return 1; /* never gets here */
}

TDT_TEST(models, a_loader_killed_mid_load_leaves_no_lock_and_orphans_go) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  /* 48 MiB: three chunks, so progress is called before the end. */
  char p[128];
  path_of(p, sizeof(p), "k.safetensors");
  static const tdt_st_tensor big[] = {{"w", "F32", 2, {3072, 4096}}};
  cr_assert_eq(tdt_st_write(p, big, 1, NULL, 4), 0);
  int ready[2];
  cr_assert_eq(pipe(ready), 0);
  loader_arg l = {d.sock, p, ready[1]};
  pid_t kid = tdt_fork(stalled_loader, &l);
  char b;
  cr_assert_eq(read(ready[0], &b, 1), 1);
  td_storage *s;
  cr_expect_eq(td_lookup(c, "k@loading", TD_RDONLY, 0, &s, NULL), 0);
  td_storage_release(s);
  td_load_result r;
  cr_expect_eq(td_model_load(c, p, "k", &(td_load_opts){.wait_ms = 0}, &r),
               TD_EBUSY);
  char pid[32];
  snprintf(pid, sizeof(pid), "pid %d", (int)kid);
  cr_expect(strstr(td_last_error(c), pid) != NULL, "%s", td_last_error(c));
  kill(kid, SIGKILL);
  tdt_wait(kid);
  /* The lock and the storage it was filling go with its connection. */
  expect_holds(c, 0, 0);
  /* Orphans of a loader that died between its shard keys and its manifest:
   * a shard key of version 5 and a tensor key on the same storage. */
  td_storage *orphan;
  cr_assert_eq(td_storage_create(c, 4096, &orphan), 0);
  cr_assert_eq(td_publish(c, "k@5/k.safetensors", orphan, NULL), 0);
  cr_assert_eq(td_publish(c, "k/ghost", orphan, NULL), 0);
  /* Not ours: another model's keys that only begin alike. */
  cr_assert_eq(td_publish(c, "kk@5/k.safetensors", orphan, NULL), 0);
  td_storage_release(orphan);
  cr_assert_eq(td_model_load(c, p, "k", NULL, &r), 0, "%s", td_last_error(c));
  cr_expect_eq(r.version, 1);
  cr_expect_eq(td_lookup(c, "k@5/k.safetensors", TD_RDONLY, 0, &s, NULL),
               TD_ENOENT);
  cr_expect_eq(td_lookup(c, "k/ghost", TD_RDONLY, 0, &s, NULL), TD_ENOENT);
  cr_assert_eq(td_lookup(c, "kk@5/k.safetensors", TD_RDONLY, 0, &s, NULL), 0);
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "kk@5/k.safetensors"), 0);
  expect_holds(c, 2, 3);
  close(ready[0]);
  close(ready[1]);
  td_close(c);
}

/* ---- one load per machine ---- */

typedef struct racer_arg {
  const char *sock, *path;
  int out_w;
} racer_arg;

static int racer(void *arg) {
  racer_arg *a = arg;
  td_client *c;
  CHECK(td_connect(a->sock, &c) == 0);
  td_load_opts o = {.wait_ms = -1};
  td_load_result r;
  CHECK_ERR(c, td_model_load(c, a->path, "race", &o, &r), 0);
  td_model *m;
  CHECK_ERR(c, td_model_open(c, "race", TD_RDONLY, 0, &m), 0);
  CHECK(wrong_bytes(m, 1, 3) == 0);
  uint64_t out[4] = {r.version, (uint64_t)r.unchanged, (uint64_t)r.waited,
                     td_model_version(m)};
  td_model_close(m);
  CHECK(write(a->out_w, out, sizeof(out)) == sizeof(out));
  td_close(c);
  return 0;
}

TDT_TEST(models, four_processes_loading_at_once_load_once) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded("race", 3);
  char p[128];
  path_of(p, sizeof(p), "race");
  int out[2];
  cr_assert_eq(pipe(out), 0);
  racer_arg a = {d.sock, p, out[1]};
  pid_t kids[4];
  for (int i = 0; i < 4; i++)
    kids[i] = tdt_fork(racer, &a);
  int loaded = 0;
  for (int i = 0; i < 4; i++) {
    uint64_t r[4];
    cr_assert_eq(read(out[0], r, sizeof(r)), (ssize_t)sizeof(r));
    cr_expect_eq(r[0], 1, "a racer got version %llu", (unsigned long long)r[0]);
    cr_expect_eq(r[3], 1);
    loaded += r[1] == 0;
    cr_expect(r[1] == 0 || r[1] == 1);
  }
  for (int i = 0; i < 4; i++)
    cr_expect_eq(tdt_wait(kids[i]), 0);
  cr_expect_eq(loaded, 1, "%d processes loaded", loaded);
  expect_holds(c, 4, 1 + 3 + 5);
  close(out[0]);
  close(out[1]);
  td_close(c);
}

/* ---- save and unload ---- */

TDT_TEST(models, save_writes_the_same_bytes_back) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_one("s.safetensors", 6);
  write_sharded("sh", 7);
  char p[128], q[128], out[128];
  path_of(p, sizeof(p), "s.safetensors");
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, "s", NULL, &r), 0, "%s", td_last_error(c));
  path_of(out, sizeof(out), "s-out.safetensors");
  cr_assert_eq(td_model_save(c, "s", out, 0), 0, "%s", td_last_error(c));
  cr_expect_eq(tdt_same_file(p, out), 1);
  path_of(p, sizeof(p), "sh");
  cr_assert_eq(td_model_load(c, p, "sh", NULL, &r), 0, "%s", td_last_error(c));
  path_of(out, sizeof(out), "sh-out");
  cr_assert_eq(td_model_save(c, "sh", out, 0), 0, "%s", td_last_error(c));
  static const char *const files[] = {"m-1.safetensors", "m-2.safetensors",
                                      "m-3.safetensors"};
  for (int i = 0; i < 3; i++) {
    snprintf(p, sizeof(p), "%s/sh/%s", dir, files[i]);
    snprintf(q, sizeof(q), "%s/sh-out/%s", dir, files[i]);
    cr_expect_eq(tdt_same_file(p, q), 1, "%s", files[i]);
  }
  /* The saved directory loads as the same model. */
  cr_assert_eq(td_model_load(c, out, "sh2", NULL, &r), 0, "%s",
               td_last_error(c));
  td_model *m;
  cr_assert_eq(td_model_open(c, "sh2", TD_RDONLY, 0, &m), 0);
  cr_expect_eq(td_model_count(m), 5);
  cr_expect_eq(wrong_bytes(m, 1, 7), 0);
  cr_expect(strstr(td_model_manifest(m), "\"total_size\":1000") != NULL);
  td_model_close(m);
  /* Nothing temporary is left beside the files. */
  snprintf(q, sizeof(q), "%s/sh-out/m-1.safetensors.tmp.%d", dir,
           (int)getpid());
  cr_expect_neq(access(q, F_OK), 0);
  td_close(c);
}

/* A publish_state_dict blob: TDSTATE1, the manifest's length, the JSON,
 * then region 0 (from byte 512): a float32 [2, 3] and its tie, and a
 * uint8 [4]. The strides of "w" are those given. */
static td_storage *state_dict(td_client *c, const char *stride) {
  char json[512];
  snprintf(json, sizeof(json),
           "{\"tensors\":{\"w\":{\"dtype\":\"float32\",\"shape\":[2,3],"
           "\"stride\":%s,\"storage_offset\":0,\"region\":0},"
           "\"tied\":{\"dtype\":\"float32\",\"shape\":[2,3],\"stride\":[3,1],"
           "\"storage_offset\":0,\"region\":0},"
           "\"u\":{\"dtype\":\"uint8\",\"shape\":[4],\"stride\":[1],"
           "\"storage_offset\":24,\"region\":0}},"
           "\"regions\":[{\"offset\":512,\"nbytes\":28}]}",
           stride);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 512 + 28, &s), 0);
  uint8_t *p = td_storage_data(s);
  uint64_t n = strlen(json);
  memcpy(p, "TDSTATE1", 8);
  for (int i = 0; i < 8; i++)
    p[8 + i] = (uint8_t)(n >> (8 * i));
  memcpy(p + 16, json, n);
  for (int i = 0; i < 28; i++)
    p[512 + i] = (uint8_t)(i * 3 + 1);
  return s;
}

TDT_TEST(models, save_writes_a_dense_state_dict_and_refuses_others) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s = state_dict(c, "[3,1]");
  cr_assert_eq(td_publish(c, "sd", s, NULL), 0);
  char out[128];
  path_of(out, sizeof(out), "sd.safetensors");
  cr_assert_eq(td_model_save(c, "sd", out, 0), 0, "%s", td_last_error(c));
  td_load_result r;
  cr_assert_eq(td_model_load(c, out, "sdm", NULL, &r), 0, "%s",
               td_last_error(c));
  cr_expect_eq(r.tensors, 3);
  td_model *m;
  cr_assert_eq(td_model_open(c, "sdm", TD_RDONLY, 0, &m), 0);
  static const char *const names[] = {"w", "tied", "u"};
  static const int at[] = {0, 0, 24};
  static const int len[] = {24, 24, 4};
  for (int i = 0; i < 3; i++) {
    td_storage *t;
    td_view v;
    cr_assert_eq(td_model_find(m, names[i], &t, &v), 0, "%s", names[i]);
    const uint8_t *b =
        (const uint8_t *)td_storage_data(t) + v.offset * td_dtype_size(v.dtype);
    for (int j = 0; j < len[i]; j++)
      cr_expect_eq(b[j], (uint8_t)((at[i] + j) * 3 + 1), "%s[%d]", names[i], j);
  }
  td_model_close(m);
  td_storage_release(s);
  /* A transposed view is not safetensors. */
  s = state_dict(c, "[1,2]");
  cr_assert_eq(td_publish(c, "sdt", s, NULL), 0);
  cr_expect_eq(td_model_save(c, "sdt", out, 0), TD_EINVAL);
  cr_expect(strstr(td_last_error(c), "tensor 'w' is not contiguous") != NULL,
            "%s", td_last_error(c));
  td_storage_release(s);
  /* Nor is a plain tensor a model. */
  cr_expect_eq(td_model_save(c, "sdm/u", out, 0), TD_EINVAL);
  cr_expect(strstr(td_last_error(c), "holds neither a model") != NULL);
  td_close(c);
}

TDT_TEST(models, unload_leaves_nothing) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  write_sharded("u", 1);
  char p[128];
  path_of(p, sizeof(p), "u");
  td_load_result r;
  cr_assert_eq(td_model_load(c, p, NULL, NULL, &r), 0, "%s", td_last_error(c));
  td_load_opts o = {.flags = TD_MODEL_FORCE};
  cr_assert_eq(td_model_load(c, p, NULL, &o, &r), 0, "%s", td_last_error(c));
  cr_assert_eq(td_model_unload(c, "u"), 0, "%s", td_last_error(c));
  expect_holds(c, 0, 0);
  cr_expect_eq(td_model_unload(c, "u"), TD_ENOENT);
  td_model *m;
  cr_expect_eq(td_model_open(c, "u", TD_RDONLY, 0, &m), TD_ENOENT);
  cr_expect_null(m);
  td_close(c);
}

/* ---- tensorctl ---- */

#define CTL(r, ...)                                                            \
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock,         \
                                    __VA_ARGS__, NULL},                        \
              r)

TDT_TEST(models_cli, load_save_unload_show_ls) {
  tdt_start(&d, NULL);
  write_one("cli.safetensors", 5);
  char p[128], out[128];
  path_of(p, sizeof(p), "cli.safetensors");
  tdt_run_result r;
  CTL(&r, "load", p, "--json", "--quiet");
  tdt_expect_ok(&r, "load --json");
  tdt_expect_json_object(r.out);
  cr_expect(strstr(r.out, "\"name\":\"cli\",\"version\":1,") != NULL, "%s",
            r.out);
  cr_expect(strstr(r.out, "\"unchanged\":false,\"waited\":false") != NULL);
  cr_expect(strstr(r.out, "\"shards\":1,") != NULL);
  cr_expect(strstr(r.out, "\"gb_per_s\":") != NULL);
  tdt_run_free(&r);
  CTL(&r, "load", p);
  tdt_expect_ok(&r, "load again");
  char want[256];
  snprintf(want, sizeof(want),
           "cli: version 1 already holds %s (same size and mtime); --force "
           "reloads\n",
           p);
  cr_expect_str_eq(r.out, want);
  tdt_run_free(&r);
  CTL(&r, "load", p, "--as", "named", "--force", "--mode", "0640");
  tdt_expect_ok(&r, "load --as");
  cr_expect(strncmp(r.out, "named: version 1, 17 tensors,", 29) == 0, "%s",
            r.out);
  tdt_run_free(&r);
  CTL(&r, "ls");
  tdt_expect_ok(&r, "ls");
  cr_expect(strstr(r.out, "cli@1/cli.safetensors") != NULL, "%s", r.out);
  cr_expect(strstr(r.out, "named/") != NULL, "%s", r.out);
  tdt_run_free(&r);
  CTL(&r, "show", "cli");
  tdt_expect_ok(&r, "show model");
  cr_expect(strstr(r.out, "model 'cli': version 1, 17 tensors, cpu") != NULL,
            "%s", r.out);
  cr_expect(strstr(r.out, "metadata format=pt") != NULL, "%s", r.out);
  cr_expect(strstr(r.out, "model.layers.0.w    BF16") != NULL, "%s", r.out);
  tdt_run_free(&r);
  CTL(&r, "show", "--json", "cli");
  tdt_expect_ok(&r, "show --json model");
  tdt_expect_json_object(r.out);
  cr_expect(strstr(r.out, "\"model\":{\"format\":1,") != NULL, "%s", r.out);
  tdt_run_free(&r);
  CTL(&r, "show", "cli/ids");
  tdt_expect_ok(&r, "show a tensor");
  cr_expect(strstr(r.out, "int64 [5]") != NULL, "%s", r.out);
  tdt_run_free(&r);
  path_of(out, sizeof(out), "cli-out.safetensors");
  CTL(&r, "save", "cli", out);
  tdt_expect_ok(&r, "save");
  cr_expect_eq(tdt_same_file(p, out), 1);
  tdt_run_free(&r);
  CTL(&r, "unload", "cli");
  tdt_expect_ok(&r, "unload");
  cr_expect_str_eq(r.out, "cli: unloaded\n");
  tdt_run_free(&r);
  CTL(&r, "unload", "--json", "named");
  tdt_expect_ok(&r, "unload --json");
  tdt_expect_json_object(r.out);
  tdt_run_free(&r);
  CTL(&r, "stat", "--json");
  cr_expect(strstr(r.out, "\"keys\":0") != NULL, "%s", r.out);
  tdt_run_free(&r);
}

TDT_TEST(models_cli, errors_exit_non_zero_with_the_message) {
  tdt_start(&d, NULL);
  char p[128];
  path_of(p, sizeof(p), "bad.safetensors");
  const char *h = "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":["
                  "0,4]}}";
  cr_assert_eq(tdt_st_write_raw(p, strlen(h), h, 8), 0);
  tdt_run_result r;
  CTL(&r, "load", p);
  cr_expect_eq(r.status, 1);
  cr_expect(strstr(r.err, "tensorctl load: bad.safetensors: tensor 'x': "
                          "data_offsets [0, 4] cover 4 bytes, F32[2] needs "
                          "8") != NULL,
            "%s", r.err);
  cr_expect_str_eq(r.out, "");
  tdt_run_free(&r);
  CTL(&r, "stat", "--json");
  cr_expect(strstr(r.out, "\"storages\":0") != NULL, "%s", r.out);
  tdt_run_free(&r);
  CTL(&r, "load", "--threads", "0", p);
  cr_expect_eq(r.status, 2);
  tdt_run_free(&r);
  setenv("TENSORD_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  CTL(&r, "load", p, "--device", "cuda:0", "--as", "g");
  unsetenv("TENSORD_CUDA_DRIVER");
  cr_expect_eq(r.status, 1);
  cr_expect(strstr(r.err, "load to cuda:0") != NULL, "%s", r.err);
  tdt_run_free(&r);
  CTL(&r, "save", "nothing");
  cr_expect_eq(r.status, 2);
  tdt_run_free(&r);
  CTL(&r, "unload", "nothing");
  cr_expect_eq(r.status, 1);
  cr_expect(strstr(r.err, "no model 'nothing'") != NULL, "%s", r.err);
  tdt_run_free(&r);
  static const char *const cmds[] = {"load", "save", "unload"};
  for (int i = 0; i < 3; i++) {
    CTL(&r, cmds[i], "--help");
    tdt_expect_ok(&r, cmds[i]);
    cr_expect(strncmp(r.out, "usage: tensorctl ", 17) == 0, "%s", r.out);
    tdt_run_free(&r);
  }
}

/* test_safetensors.c: safetensors checkpoints read from untrusted bytes
 * (client/safetensors.c): every rule of the format refused with a message
 * naming the file, the tensor and the field; good files of every dtype;
 * index jsons checked against their shards; jansson's memory bounded. */
#include "jsonmem.h"
#include "safetensors.h"
#include "stfile.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FILE_NAME "model-00002.safetensors"

/* header padded with spaces so that the data begins at a multiple of 8. */
static char *padded(const char *header) {
  size_t n = strlen(header), p = n;
  while ((8 + p) % 8 != 0)
    p++;
  char *h = malloc(p + 1);
  cr_assert_not_null(h);
  memcpy(h, header, n);
  memset(h + n, ' ', p - n);
  h[p] = '\0';
  return h;
}

/* Parses a file of header (padded) and data_len bytes of data; hlen 0: the
 * header's own length; file_size 0: the bytes' own. */
static int parse(const char *header, uint64_t hlen, uint64_t data_len,
                 uint64_t file_size, td__checkpoint *ck, char *msg,
                 size_t len) {
  char *h = padded(header);
  size_t n;
  uint8_t *p = tdt_st_raw(hlen ? hlen : strlen(h), h, data_len, &n);
  cr_assert_not_null(p);
  memset(ck, 0, sizeof(*ck));
  int err = td__st_parse_header(FILE_NAME, p, n, file_size ? file_size : n, 0,
                                ck, msg, len);
  free(p);
  free(h);
  return err;
}

typedef struct bad {
  const char *what, *header;
  uint64_t hlen, data_len, file_size;
  const char *fragment; /* the message must contain it */
} bad;

#define T(name, dt, shape, b, e)                                               \
  "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape                        \
  ",\"data_offsets\":[" #b "," #e "]}"

static const bad bads[] = {
    {"too short", "", 0, 0, 4, "too short for a safetensors file"},
    {"header past the file", "{}", 1000, 0, 0,
     FILE_NAME ": header length 1000 reaches past the file's"},
    {"header over 100 MB", "{}", 100000001, 0, 200000000,
     FILE_NAME ": header length 100000001 is over safetensors' limit of "
               "100000000 bytes"},
    {"not an object", "[1]", 0, 0, 0, FILE_NAME ": header: does not begin "
                                      "with '{'"},
    {"not JSON", "{\"a\":", 0, 0, 0, FILE_NAME ": header byte"},
    {"trailing garbage", "{} x", 0, 0, 0, FILE_NAME ": header byte"},
    {"duplicate name",
     "{" T("t", "U8", "[1]", 0, 1) "," T("t", "U8", "[1]", 1, 2) "}", 0, 2, 0,
     "duplicate object key"},
    {"metadata not an object", "{\"__metadata__\":[]}", 0, 0, 0,
     FILE_NAME ": __metadata__: an array, not an object of strings"},
    {"metadata value not a string", "{\"__metadata__\":{\"a\":1}}", 0, 0, 0,
     FILE_NAME ": __metadata__: 'a': an integer, not a string"},
    {"entry not an object", "{\"t\":1}", 0, 0, 0,
     FILE_NAME ": tensor 't': an integer, not an object"},
    {"unknown field",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}",
     0, 1, 0, FILE_NAME ": tensor 't': unknown field 'x'"},
    {"no dtype", "{\"t\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 0, 1, 0,
     FILE_NAME ": tensor 't': no 'dtype'"},
    {"no shape", "{\"t\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 0, 1, 0,
     FILE_NAME ": tensor 't': no 'shape'"},
    {"no data_offsets", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1]}}", 0, 1, 0,
     FILE_NAME ": tensor 't': no 'data_offsets'"},
    {"dtype not a string", "{" T("t", "U8", "[1]", 0, 1) ",\"u\":{\"dtype\":"
                           "4,\"shape\":[1],\"data_offsets\":[1,2]}}",
     0, 2, 0, FILE_NAME ": tensor 'u': dtype: an integer, not a string"},
    {"unknown dtype", "{" T("w.q", "Q4", "[1]", 0, 1) "}", 0, 1, 0,
     FILE_NAME ": tensor 'w.q': dtype: unknown dtype 'Q4'"},
    {"shape not an array", "{" T("t", "U8", "\"1\"", 0, 1) "}", 0, 1, 0,
     FILE_NAME ": tensor 't': shape: a string, not an array"},
    {"negative size", "{" T("t", "U8", "[2,-1]", 0, 1) "}", 0, 1, 0,
     FILE_NAME ": tensor 't': shape: -1 is negative"},
    {"size not an integer", "{" T("t", "U8", "[1.0]", 0, 1) "}", 0, 1, 0,
     FILE_NAME ": tensor 't': shape: a real number, not an integer"},
    {"more dims than views have",
     "{" T("t", "U8", "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", 0, 1) "}", 0, 1,
     0, FILE_NAME ": tensor 't': shape: 17 dims, tensord views have at most 16"},
    {"bytes past 2^63",
     "{" T("t", "F32", "[4611686018427387904,4]", 0, 1) "}", 0, 1, 0,
     FILE_NAME ": tensor 't': shape: F32[4611686018427387904, 4] has more "
               "than 2^63 bytes"},
    {"numel past 2^64",
     "{" T("t", "U8", "[4294967296,4294967296,2]", 0, 1) "}", 0, 1, 0,
     "has more than 2^63 bytes"},
    {"data_offsets not a pair", "{" T("t", "U8", "[1]", 0, 1) "}", 0, 1, 0,
     NULL}, /* good: the control */
    {"data_offsets of one item",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 0, 1, 0,
     FILE_NAME ": tensor 't': data_offsets: an array of other than 2 items, "
               "not [begin, end]"},
    {"data_offsets not integers",
     "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.5]}}", 0, 2,
     0, FILE_NAME ": tensor 't': data_offsets: a real number, not an integer"},
    {"negative offset", "{" T("t", "U8", "[1]", -1, 0) "}", 0, 1, 0,
     FILE_NAME ": tensor 't': data_offsets: -1 is negative"},
    {"end before begin", "{" T("t", "U8", "[0]", 8, 4) "}", 0, 8, 0,
     FILE_NAME ": tensor 't': data_offsets [8, 4] end before they begin"},
    {"past the data", "{" T("t", "F32", "[2,3]", 0, 24) "}", 0, 8, 0,
     FILE_NAME ": tensor 't': data_offsets [0, 24] reach past the data's 8 "
               "bytes"},
    {"covers too little", "{" T("lm_head.weight", "F32", "[2,3]", 0, 12) "}",
     0, 24, 0,
     "model-00002.safetensors: tensor 'lm_head.weight': data_offsets [0, 12] "
     "cover 12 bytes, F32[2, 3] needs 24"},
    {"covers too much", "{" T("t", "I16", "[3]", 0, 8) "}", 0, 8, 0,
     FILE_NAME ": tensor 't': data_offsets [0, 8] cover 8 bytes, I16[3] "
               "needs 6"},
    {"overlap",
     "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}", 0, 12,
     0, "data_offsets [" /* absolute */},
    {"misaligned", "{" T("t", "F32", "[1]", 2, 6) "}", 0, 8, 0,
     FILE_NAME ": tensor 't': data_offsets begin at byte"},
};

Test(safetensors, refuses_every_broken_rule_naming_file_tensor_field) {
  for (size_t i = 0; i < sizeof(bads) / sizeof(bads[0]); i++) {
    const bad *b = &bads[i];
    td__checkpoint ck;
    char msg[1024] = "";
    int err = parse(b->header, b->hlen, b->data_len, b->file_size, &ck, msg,
                    sizeof(msg));
    if (b->fragment == NULL) {
      cr_expect_eq(err, 0, "%s: %s", b->what, msg);
    } else {
      cr_expect_eq(err, TD_EINVAL, "%s: got %d (%s)", b->what, err, msg);
      cr_expect(strstr(msg, b->fragment) != NULL,
                "%s: message '%s' lacks '%s'", b->what, msg, b->fragment);
      cr_expect_eq(ck.ntensors, 0, "%s: tensors kept after a failure",
                   b->what);
    }
    td__ckpt_free(&ck);
  }
}

Test(safetensors, overlap_and_alignment_messages_name_both_sides) {
  td__checkpoint ck;
  char msg[1024];
  cr_assert_eq(parse("{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4,
                                                          12) "}",
                     0, 12, 0, &ck, msg, sizeof(msg)),
               TD_EINVAL);
  cr_expect(strstr(msg, FILE_NAME ": tensor 'b': data_offsets") != NULL &&
                strstr(msg, "overlap tensor 'a''s") != NULL,
            "%s", msg);
  cr_assert_eq(parse("{" T("t", "F32", "[1]", 2, 6) "}", 0, 8, 0, &ck, msg,
                     sizeof(msg)),
               TD_EINVAL);
  cr_expect(strstr(msg, "not a multiple of F32's 4 bytes (tensord views count "
                        "elements)") != NULL,
            "%s", msg);
  td__ckpt_free(&ck);
}

Test(safetensors, reads_every_dtype_and_metadata) {
  static const struct {
    const char *n;
    td_dtype d;
  } all[] = {{"F64", TD_FLOAT64},    {"F32", TD_FLOAT32},
             {"F16", TD_FLOAT16},    {"BF16", TD_BFLOAT16},
             {"I64", TD_INT64},      {"I32", TD_INT32},
             {"I16", TD_INT16},      {"I8", TD_INT8},
             {"U8", TD_UINT8},       {"BOOL", TD_BOOL},
             {"U16", TD_UINT16},     {"U32", TD_UINT32},
             {"U64", TD_UINT64},     {"F8_E4M3", TD_FLOAT8_E4M3FN},
             {"F8_E5M2", TD_FLOAT8_E5M2}};
  size_t n = sizeof(all) / sizeof(all[0]);
  char dir[] = "/tmp/tdt-st.XXXXXX", path[64];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof(path), "%s/all.safetensors", dir);
  tdt_st_tensor t[20];
  char names[16][16];
  for (size_t i = 0; i < n; i++) {
    snprintf(names[i], sizeof(names[i]), "t.%s", all[i].n);
    t[i] = (tdt_st_tensor){names[i], all[i].n, 2, {3, (int64_t)i + 1}};
    cr_assert_eq(td__st_dtype(all[i].n), all[i].d);
    cr_assert_str_eq(td__st_dtype_name(all[i].d), all[i].n);
  }
  t[n] = (tdt_st_tensor){"scalar", "F32", 0, {0}};
  t[n + 1] = (tdt_st_tensor){"empty", "F32", 2, {0, 5}};
  cr_assert_eq(tdt_st_write(path, t, n + 2, "{\"format\":\"pt\"}", 3), 0);
  td__checkpoint ck;
  char msg[1024];
  cr_assert_eq(td__ckpt_open(path, &ck, msg, sizeof(msg)), 0, "%s", msg);
  cr_assert_eq(ck.ntensors, n + 2);
  cr_assert_eq(ck.nshards, 1);
  cr_assert_eq(ck.is_index, 0);
  for (size_t i = 0; i < n; i++) {
    const td__st_tensor *x = &ck.tensors[i];
    cr_expect_str_eq(x->name, names[i]); /* the header's order */
    cr_expect_eq(x->dtype, all[i].d);
    cr_expect_eq(x->ndim, 2);
    cr_expect_eq(x->end - x->begin, 3 * (i + 1) * td_dtype_size(all[i].d));
    cr_expect_eq(x->begin % td_dtype_size(all[i].d), 0);
  }
  cr_expect_eq(ck.tensors[n].ndim, 0);
  cr_expect_eq(ck.tensors[n].end - ck.tensors[n].begin, 4);
  cr_expect_eq(ck.tensors[n + 1].end, ck.tensors[n + 1].begin);
  cr_expect_str_eq(json_string_value(json_object_get(ck.metadata, "format")),
                   "pt");
  cr_expect_eq(ck.bytes, ck.shards[0].size);
  td__ckpt_free(&ck);
  unlink(path);
  rmdir(dir);
}

Test(safetensors, a_hostile_header_costs_bounded_memory) {
  cr_assert(td__json_counting(), "jansson's defaults were replaced");
  /* {"a":[{},{},...]}: ~4 bytes of JSON per object, ~100 of tree. */
  size_t k = 200000;
  char *h = malloc(16 + 3 * k);
  size_t used = (size_t)sprintf(h, "{\"a\":[");
  for (size_t i = 0; i < k; i++)
    used += (size_t)sprintf(h + used, "%s{}", i ? "," : "");
  sprintf(h + used, "]}");
  size_t was = td__st_tree_max;
  td__st_tree_max = (size_t)4 << 20;
  td__checkpoint ck;
  char msg[1024];
  int err = parse(h, 0, 0, 0, &ck, msg, sizeof(msg));
  td__st_tree_max = was;
  free(h);
  cr_expect_eq(err, TD_EINVAL);
  cr_expect(strstr(msg, "takes more than 4 MiB to hold") != NULL, "%s", msg);
}

/* ---- index jsons and directories ---- */

static char dir[64];

static void mkdir_tmp(void) {
  snprintf(dir, sizeof(dir), "/tmp/tdt-st.XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void rm_tmp(void) {
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
  cr_assert_eq(system(cmd), 0);
}

static void put(const char *file, const tdt_st_tensor *t, size_t n) {
  char p[128];
  snprintf(p, sizeof(p), "%s/%s", dir, file);
  cr_assert_eq(tdt_st_write(p, t, n, NULL, 1), 0);
}

static void put_text(const char *file, const char *text) {
  char p[128];
  snprintf(p, sizeof(p), "%s/%s", dir, file);
  cr_assert_eq(tdt_write_text(p, text), 0);
}

/* td__ckpt_open of dir/file must fail with code and a message holding
 * fragment. */
static void refuses(const char *file, int code, const char *fragment) {
  char p[128], msg[1024] = "";
  snprintf(p, sizeof(p), "%s%s%s", dir, file ? "/" : "", file ? file : "");
  td__checkpoint ck;
  int err = td__ckpt_open(p, &ck, msg, sizeof(msg));
  cr_expect_eq(err, code, "%s: got %d (%s)", fragment, err, msg);
  cr_expect(strstr(msg, fragment) != NULL, "message '%s' lacks '%s'", msg,
            fragment);
  cr_expect_eq(ck.ntensors, 0);
  td__ckpt_free(&ck);
}

static const tdt_st_tensor s1[] = {{"a", "F32", 1, {4}}, {"b", "I64", 1, {2}}};
static const tdt_st_tensor s2[] = {{"c", "BF16", 1, {3}}};

TestSuite(index, .init = mkdir_tmp, .fini = rm_tmp);

Test(index, reads_shards_in_weight_map_order) {
  put("m-1.safetensors", s1, 2);
  put("m-2.safetensors", s2, 1);
  put_text(TD__ST_INDEX_NAME,
           "{\"metadata\":{\"total_size\":46},\"weight_map\":{\"c\":\"m-2."
           "safetensors\",\"a\":\"m-1.safetensors\",\"b\":\"m-1."
           "safetensors\"}}");
  td__checkpoint ck;
  char msg[1024];
  cr_assert_eq(td__ckpt_open(dir, &ck, msg, sizeof(msg)), 0, "%s", msg);
  cr_expect_eq(ck.is_index, 1);
  cr_expect_eq(ck.nshards, 2);
  cr_expect_str_eq(ck.shards[0].file, "m-2.safetensors");
  cr_expect_str_eq(ck.tensors[0].name, "c");
  cr_expect_str_eq(ck.tensors[1].name, "a");
  cr_expect_str_eq(ck.tensors[2].name, "b");
  cr_expect_eq(ck.tensors[1].shard, 1);
  cr_expect_eq(json_integer_value(json_object_get(ck.metadata, "total_size")),
               46);
  cr_expect(ck.shards[0].fd >= 0);
  td__ckpt_free(&ck);
}

Test(index, refuses_a_missing_shard) {
  put("m-1.safetensors", s1, 2);
  put_text("x.index.json",
           "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"b\":\"m-1."
           "safetensors\",\"c\":\"m-9.safetensors\"}}");
  refuses("x.index.json", TD_ENOENT, "m-9.safetensors: No such file");
}

Test(index, refuses_a_tensor_absent_from_its_shard) {
  put("m-1.safetensors", s1, 2);
  put("m-2.safetensors", s2, 1);
  put_text("x.index.json",
           "{\"weight_map\":{\"a\":\"m-1.safetensors\",\"b\":\"m-2."
           "safetensors\",\"c\":\"m-2.safetensors\"}}");
  refuses("x.index.json", TD_EINVAL,
          "x.index.json: weight_map: tensor 'b': its shard 'm-2.safetensors' "
          "has no tensor of that name");
}

Test(index, refuses_a_shard_tensor_not_in_the_weight_map) {
  put("m-1.safetensors", s1, 2);
  put_text("x.index.json", "{\"weight_map\":{\"a\":\"m-1.safetensors\"}}");
  refuses("x.index.json", TD_EINVAL,
          "m-1.safetensors: tensor 'b' is not in x.index.json's weight_map");
}

Test(index, refuses_shard_names_that_leave_the_directory) {
  put("m-1.safetensors", s1, 2);
  static const char *const names[] = {"../m-1.safetensors", "sub/m-1", ".",
                                      "..", ""};
  for (size_t i = 0; i < 5; i++) {
    char text[256], frag[128];
    snprintf(text, sizeof(text), "{\"weight_map\":{\"a\":\"%s\"}}", names[i]);
    put_text("x.index.json", text);
    snprintf(frag, sizeof(frag),
             "x.index.json: weight_map: tensor 'a': shard '%s' is not a "
             "plain file name",
             names[i]);
    refuses("x.index.json", TD_EINVAL, frag);
  }
}

Test(index, refuses_a_malformed_index) {
  put_text("x.index.json", "{\"metadata\":{}}");
  refuses("x.index.json", TD_EINVAL, "x.index.json: no 'weight_map'");
  put_text("x.index.json", "{\"weight_map\":[]}");
  refuses("x.index.json", TD_EINVAL,
          "x.index.json: weight_map: an array, not an object");
  put_text("x.index.json", "{\"weight_map\":{\"a\":3}}");
  refuses("x.index.json", TD_EINVAL,
          "x.index.json: weight_map: tensor 'a': an integer, not a file name");
  put_text("x.index.json", "{\"weight_map\":{\"a\":\"m\",\"a\":\"m\"}}");
  refuses("x.index.json", TD_EINVAL, "duplicate object key");
  put_text("x.index.json", "{\"weight_map\":{}}");
  refuses("x.index.json", TD_EINVAL, "weight_map names no tensor");
}

Test(index, a_directory_needs_an_index_or_exactly_one_file) {
  refuses(NULL, TD_ENOENT, "no model.safetensors.index.json and no "
                           ".safetensors file");
  put("one.safetensors", s1, 2);
  td__checkpoint ck;
  char msg[1024];
  cr_assert_eq(td__ckpt_open(dir, &ck, msg, sizeof(msg)), 0, "%s", msg);
  cr_expect(strstr(ck.path, "/one.safetensors") != NULL);
  td__ckpt_free(&ck);
  put("two.safetensors", s2, 1);
  refuses(NULL, TD_EINVAL, "2 .safetensors files");
}

Test(index, names_a_model_after_its_file_or_directory) {
  put("tiny-llm.safetensors", s1, 2);
  put_text(TD__ST_INDEX_NAME, "{}");
  char p[128], name[256], msg[256];
  snprintf(p, sizeof(p), "%s/tiny-llm.safetensors", dir);
  cr_assert_eq(td__ckpt_default_name(p, name, sizeof(name), msg, sizeof(msg)),
               0);
  cr_expect_str_eq(name, "tiny-llm");
  snprintf(p, sizeof(p), "%s/%s", dir, TD__ST_INDEX_NAME);
  cr_assert_eq(td__ckpt_default_name(p, name, sizeof(name), msg, sizeof(msg)),
               0);
  cr_expect_str_eq(name, strrchr(dir, '/') + 1);
  cr_assert_eq(td__ckpt_default_name(dir, name, sizeof(name), msg, sizeof(msg)),
               0);
  cr_expect_str_eq(name, strrchr(dir, '/') + 1);
}

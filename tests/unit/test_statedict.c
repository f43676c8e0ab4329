/* test_statedict.c: reading publish_state_dict's blobs (client/statedict.c)
 * from untrusted bytes: what a good blob says, and a clear error, never a
 * crash or a read outside the bytes, for every corruption. */
#include "statedict.h"

#include "seed.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A blob: the header, manifest, then room up to total bytes (the regions'
 * bytes, zero here unless set). Exactly total bytes of malloc'd memory, so
 * that a read past them is caught by the sanitizers' builds. */
static uint8_t *blob(const char *manifest, size_t total, size_t *n) {
  size_t ml = strlen(manifest);
  if (total < TD__SD_HEADER + ml)
    total = TD__SD_HEADER + ml;
  uint8_t *b = calloc(1, total);
  cr_assert_not_null(b);
  memcpy(b, TD__SD_MAGIC, 8);
  for (int i = 0; i < 8; i++)
    b[8 + i] = (uint8_t)((uint64_t)ml >> (8 * i));
  memcpy(b + TD__SD_HEADER, manifest, ml);
  *n = total;
  return b;
}

/* Parses manifest in a blob of total bytes; returns the error (0 if it
 * parsed) and the message in msg. */
static int parse_as(const char *manifest, size_t total, td__statedict *sd,
                    char *msg, size_t len) {
  size_t n;
  uint8_t *b = blob(manifest, total, &n);
  int err = td__statedict_parse(b, n, sd, msg, len);
  free(b);
  return err;
}

/* Asserts manifest is refused with a message containing want. */
static void refused(const char *manifest, size_t total, const char *want) {
  td__statedict sd;
  char msg[1024] = "";
  int err = parse_as(manifest, total, &sd, msg, sizeof(msg));
  cr_assert_eq(err, TD_EINVAL, "accepted (%d): %s", err, manifest);
  cr_assert(strstr(msg, want) != NULL, "'%s' not in '%s' (manifest %s)", want,
            msg, manifest);
  cr_assert_eq(sd.ntensors, 0);
  cr_assert_null(sd.tensors);
  td__statedict_free(&sd);
}

/* What publish_state_dict writes for {"w": float32 [2, 3] at region 0,
 * "t": its rows 1.. (tied), "b": int64 [4] at region 1}, regions at 256
 * and 320. */
#define GOOD                                                                   \
  "{\"tensors\":{\"w\":{\"dtype\":\"float32\",\"shape\":[2,3],\"stride\":[3,"  \
  "1],\"storage_offset\":0,\"region\":0},\"t\":{\"dtype\":\"float32\","        \
  "\"shape\":[1,3],\"stride\":[3,1],\"storage_offset\":3,\"region\":0},"       \
  "\"b\":{\"dtype\":\"int64\",\"shape\":[4],\"stride\":[1],\"storage_"         \
  "offset\":0,\"region\":1}},\"regions\":[{\"offset\":256,\"nbytes\":24},{"    \
  "\"offset\":320,\"nbytes\":32}]}"
#define GOOD_TOTAL 384

Test(statedict, a_good_blob_lists_its_tensors) {
  td__statedict sd;
  char msg[1024] = "";
  cr_assert_eq(parse_as(GOOD, GOOD_TOTAL, &sd, msg, sizeof(msg)), 0, "%s", msg);
  cr_assert_eq(sd.ntensors, 3);
  cr_assert_eq(sd.nregions, 2);
  cr_assert_str_eq(sd.tensors[0].name, "w", "in the manifest's order");
  cr_assert_str_eq(sd.tensors[1].name, "t");
  cr_assert_str_eq(sd.tensors[2].name, "b");
  const td__sd_tensor *w = td__statedict_find(&sd, "w");
  cr_assert_eq(w->dtype, TD_FLOAT32);
  cr_assert_eq(w->ndim, 2);
  cr_assert_eq(w->shape[1], 3);
  cr_assert_eq(w->nbytes, 24);
  const td__sd_tensor *b = td__statedict_find(&sd, "b");
  cr_assert_eq(b->dtype, TD_INT64);
  cr_assert_eq(b->nbytes, 32);
  cr_assert_eq(b->region, 1);
  cr_assert_null(td__statedict_find(&sd, "nope"));
  /* The views of the storage, the blob at byte 0 or 64 of it. */
  td_view v;
  cr_assert_eq(td__statedict_view(&sd, td__statedict_find(&sd, "t"), 0, &v, msg,
                                  sizeof(msg)),
               0, "%s", msg);
  cr_assert_eq(v.offset, 256 / 4 + 3);
  cr_assert_eq(v.dtype, TD_FLOAT32);
  cr_assert_eq(td__statedict_view(&sd, b, 64, &v, msg, sizeof(msg)), 0);
  cr_assert_eq(v.offset, (64 + 320) / 8);
  cr_assert_eq(td__statedict_view(&sd, b, 4, &v, msg, sizeof(msg)), TD_EINVAL,
               "a region not aligned to int64");
  cr_assert(strstr(msg, "not a multiple of int64's 8 bytes") != NULL, "%s",
            msg);
  td__statedict_free(&sd);
  td__statedict_free(&sd); /* idempotent */
  td__statedict_free(NULL);
}

/* Fields and keys this reader does not know are skipped (a later format
 * may add some), in any order, with any JSON white space; names may hold
 * any Unicode, escaped or not. */
Test(statedict, unknown_fields_order_and_escapes) {
  static const char m[] =
      " {\"version\": 2, \"regions\" : [ {\"nbytes\": 8, \"offset\": 64, "
      "\"crc\": [1, 2.5e3, {\"x\": null}]} ],\n\"tensors\":{\"caf\\u00e9."
      "\\ud83d\\ude00\\n\": {\"region\":0,\"storage_offset\":0,\"stride\":[],"
      "\"shape\":[],\"dtype\":\"float64\",\"requires_grad\":true}, "
      "\"na\xc3\xafve\": {\"dtype\":\"complex32\",\"shape\":[2],\"stride\":[1],"
      "\"storage_offset\":0,\"region\":0}, \"f8\": {\"dtype\":\"float8_e4m3fnuz"
      "\",\"shape\":[3],\"stride\":[1],\"storage_offset\":0,\"region\":0}}} \n";
  td__statedict sd;
  char msg[1024] = "";
  cr_assert_eq(parse_as(m, 128, &sd, msg, sizeof(msg)), 0, "%s", msg);
  cr_assert_eq(sd.ntensors, 3);
  cr_assert_str_eq(sd.tensors[0].name, "caf\xc3\xa9.\xf0\x9f\x98\x80\n");
  cr_assert_eq(sd.tensors[0].ndim, 0);
  cr_assert_eq(sd.tensors[0].nbytes, 8);
  /* complex32: no td_dtype, but its size is known: bytes listed. */
  cr_assert_eq(sd.tensors[1].dtype, TD_DTYPE_INVALID);
  cr_assert_eq(sd.tensors[1].nbytes, 8);
  td_view v;
  cr_assert_eq(td__statedict_view(&sd, &sd.tensors[1], 0, &v, msg, sizeof(msg)),
               TD_EINVAL);
  cr_assert(strstr(msg, "complex32, a dtype tensord does not read") != NULL,
            "%s", msg);
  /* A dtype nobody here knows: listed without bytes. */
  cr_assert_eq(sd.tensors[2].itemsize, 0);
  cr_assert_eq(sd.tensors[2].numel, 3);
  td__statedict_free(&sd);
}

Test(statedict, an_empty_state_dict) {
  td__statedict sd;
  char msg[256];
  cr_assert_eq(
      parse_as("{\"tensors\":{},\"regions\":[]}", 0, &sd, msg, sizeof(msg)), 0,
      "%s", msg);
  cr_assert_eq(sd.ntensors, 0);
  td__statedict_free(&sd);
}

/* publish_state_dict keeps a CUDA tensor's region on its GPU, in a storage
 * of its own: tensorctl cannot read it, and says so (TD_ENODEV, not a
 * corrupt blob), naming the region's key. A CPU region may say "cpu". */
Test(statedict, a_region_on_a_gpu_is_named_not_corrupt) {
  td__statedict sd;
  char msg[1024] = "";
  int err = parse_as(
      "{\"tensors\":{\"w\":{\"dtype\":\"uint8\",\"shape\":[4],"
      "\"stride\":[1],\"storage_offset\":0,\"region\":1}},\"regions\":["
      "{\"offset\":128,\"nbytes\":4,\"device\":\"cpu\"},"
      "{\"device\":\"cuda\",\"key\":\"m@7/r1\",\"storage_id\":8,"
      "\"nbytes\":4}]}",
      192, &sd, msg, sizeof(msg));
  cr_assert_eq(err, TD_ENODEV, "%d: %s", err, msg);
  cr_assert(strstr(msg, "region 1 lies on a GPU") != NULL, "%s", msg);
  cr_assert(strstr(msg, "'m@7/r1'") != NULL, "%s", msg);
  cr_assert_eq(sd.ntensors, 0);
  td__statedict_free(&sd);
}

Test(statedict, the_header_is_checked) {
  td__statedict sd;
  char msg[256];
  uint8_t b[64] = "TDSTATE2";
  cr_assert_eq(td__statedict_parse(b, sizeof(b), &sd, msg, sizeof(msg)),
               TD_EINVAL);
  cr_assert(strstr(msg, "do not begin with 'TDSTATE1'") != NULL, "%s", msg);
  cr_assert_eq(td__statedict_is("TDSTATE1", 8), 0, "no room for the length");
  memcpy(b, "TDSTATE1", 8);
  cr_assert(td__statedict_is(b, 16));
  /* A manifest longer than the blob, or than any blob may have. */
  memset(b + 8, 0xff, 8);
  cr_assert_eq(td__statedict_parse(b, sizeof(b), &sd, msg, sizeof(msg)),
               TD_EINVAL);
  cr_assert(strstr(msg, "a manifest of 18446744073709551615 bytes in a blob "
                        "of 64") != NULL,
            "%s", msg);
  memset(b + 8, 0, 8);
  b[8] = 49;
  cr_assert_eq(td__statedict_parse(b, sizeof(b), &sd, msg, sizeof(msg)),
               TD_EINVAL);
  cr_assert(strstr(msg, "a manifest of 49 bytes in a blob of 64") != NULL, "%s",
            msg);
  size_t big = (size_t)TD__SD_MANIFEST_MAX + 32;
  uint8_t *h = calloc(1, big);
  cr_assert_not_null(h);
  memcpy(h, "TDSTATE1", 8);
  uint64_t ml = TD__SD_MANIFEST_MAX + 1;
  for (int i = 0; i < 8; i++)
    h[8 + i] = (uint8_t)(ml >> (8 * i));
  cr_assert_eq(td__statedict_parse(h, big, &sd, msg, sizeof(msg)), TD_EINVAL);
  cr_assert(strstr(msg, "at most 268435456 are read") != NULL, "%s", msg);
  free(h);
}

/* Each way a manifest can lie, with the words that say so. */
Test(statedict, every_lie_is_named) {
  static const char *const cases[][2] = {
      {"", "manifest byte 0: '[' or '{' expected near end of file"},
      {"[]", "the manifest is an array, not an object"},
      {"{\"tensors\":{}}", "has no 'regions'"},
      {"{\"regions\":[]}", "has no 'tensors'"},
      {"{\"tensors\":{},\"regions\":[],\"tensors\":{}}",
       "manifest byte 36: duplicate object key near '\"tensors\"'"},
      {"{\"tensors\":{},\"regions\":[]}x",
       "manifest byte 28: end of file expected near 'x'"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":0}]}", "has no 'nbytes'"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":-1,\"nbytes\":0}]}",
       "region 0: offset: -1 is negative"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":1.5,\"nbytes\":0}]}",
       "region 0: offset: not an integer (a real number)"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":1e3,\"nbytes\":0}]}",
       "not an integer"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":01,\"nbytes\":0}]}",
       "manifest byte 36: invalid token near '0'"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":99999999999999999999,"
       "\"nbytes\":0}]}",
       "too big integer"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":0,\"nbytes\":0,\"offset\":1}"
       "]}",
       "duplicate object key near '\"offset\"'"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":40,\"nbytes\":100}]}",
       "region 0 (bytes 40 + 100) reaches past the blob's "},
      {"{\"tensors\":{},\"regions\":[{\"offset\":9223372036854775807,"
       "\"nbytes\":9223372036854775807}]}",
       "reaches past the blob"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[4],\"stride\":"
       "[1],\"storage_offset\":0}},\"regions\":[]}",
       "tensor 'a': no 'region'"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[4],\"stride\":"
       "[1],\"storage_offset\":0,\"region\":1}},\"regions\":[{\"offset\":0,"
       "\"nbytes\":16}]}",
       "tensor 'a': region 1, of 1 regions"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[5],\"stride\":"
       "[1],\"storage_offset\":0,\"region\":0}},\"regions\":[{\"offset\":0,"
       "\"nbytes\":16}]}",
       "tensor 'a': float32 view of region 0 (16 bytes)"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[2],\"stride\":"
       "[1],\"storage_offset\":3,\"region\":0}},\"regions\":[{\"offset\":0,"
       "\"nbytes\":16}]}",
       "tensor 'a': float32 view"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[2,2],\"stride\":"
       "[1],\"storage_offset\":0,\"region\":0}},\"regions\":[]}",
       "1 strides for 2 dims"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[1,1,1,1,1,1,1,1,"
       "1,1,1,1,1,1,1,1,1],\"stride\":[],\"storage_offset\":0,\"region\":0}},"
       "\"regions\":[]}",
       "shape: more than 16 dims"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"shape\":[-2],\"stride\":"
       "[1],\"storage_offset\":0,\"region\":0}},\"regions\":[]}",
       "tensor 'a': shape: -2 is negative"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"Float 32\",\"shape\":[],\"stride\":"
       "[],\"storage_offset\":0,\"region\":0}},\"regions\":[{\"offset\":0,"
       "\"nbytes\":4}]}",
       "tensor 'a': dtype 'Float 32'"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32float32float32float32xxxxx\","
       "\"shape\":[],\"stride\":[],\"storage_offset\":0,\"region\":0}},"
       "\"regions\":[]}",
       "a dtype name of 33 bytes"},
      {"{\"tensors\":{\"a\":{\"dtype\":7,\"shape\":[],\"stride\":[],"
       "\"storage_offset\":0,\"region\":0}},\"regions\":[]}",
       "tensor 'a': dtype: not a string (an integer)"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"float32\",\"dtype\":\"int8\"}},"
       "\"regions\":[]}",
       "duplicate object key near '\"dtype\"'"},
      {"{\"tensors\":{\"a\\u0000b\":{}},\"regions\":[]}",
       "NUL byte in object key not supported"},
      {"{\"tensors\":{\"a\\x\":{}},\"regions\":[]}",
       "invalid escape near '\"a\\x'"},
      {"{\"tensors\":{\"a\\u12\":{}},\"regions\":[]}",
       "invalid escape near '\"a\\u12\"'"},
      {"{\"tensors\":{\"a\xc3\":{}},\"regions\":[]}",
       "unable to decode byte 0xc3"},
      {"{\"tensors\":{\"\xed\xa0\x80\":{}},\"regions\":[]}",
       "unable to decode byte 0xed"},
      {"{\"tensors\":{\"\xc0\xaf\":{}},\"regions\":[]}",
       "unable to decode byte 0xc0"},
      {"{\"tensors\":{\"a\tb\":{}},\"regions\":[]}", "control character 0x9"},
      {"{\"tensors\":{\"abc", "premature end of input"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"uint8\",\"shape\":[1],\"stride\":[1],"
       "\"storage_offset\":0,\"region\":0},\"a\":{\"dtype\":\"uint8\",\"shape\""
       ":[1],\"stride\":[1],\"storage_offset\":0,\"region\":0}},\"regions\":[{"
       "\"offset\":0,\"nbytes\":1}]}",
       "duplicate object key near '\"a\"'"},
      {"{\"x\":tru,\"tensors\":{},\"regions\":[]}", "invalid token near 'tru'"},
      {"{\"x\":-,\"tensors\":{},\"regions\":[]}", "invalid token near '-'"},
      {"{\"x\":1.,\"tensors\":{},\"regions\":[]}", "invalid token near '1.'"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    refused(cases[i][0], 64, cases[i][1]);
}

/* Where a number is due, an integer: not a real, a boolean, a string or
 * null, whatever its value; where a string is due, no NUL in it. */
Test(statedict, numbers_must_be_integers_and_strings_hold_no_nul) {
  static const char *const cases[][2] = {
      {"{\"tensors\":{},\"regions\":[{\"offset\":1.0,\"nbytes\":0}]}",
       "region 0: offset: not an integer (a real number)"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":0,\"nbytes\":true}]}",
       "region 0: nbytes: not an integer (a boolean)"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":0,\"nbytes\":\"8\"}]}",
       "region 0: nbytes: not an integer (a string)"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":null,\"nbytes\":0}]}",
       "region 0: offset: not an integer (null)"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"uint8\",\"shape\":[false],"
       "\"stride\":[1],\"storage_offset\":0,\"region\":0}},\"regions\":[]}",
       "tensor 'a': shape: not an integer (a boolean)"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"uint8\",\"shape\":[1],"
       "\"stride\":1,\"storage_offset\":0,\"region\":0}},\"regions\":[]}",
       "tensor 'a': stride: not an array (an integer)"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"uint8\",\"shape\":[],"
       "\"stride\":[],\"storage_offset\":-1,\"region\":0}},\"regions\":[]}",
       "tensor 'a': storage_offset: -1 is negative"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"uint8\",\"shape\":[],"
       "\"stride\":[],\"storage_offset\":0,\"region\":262144}},"
       "\"regions\":[]}",
       "tensor 'a': region 262144: there are at most 262144"},
      {"{\"tensors\":{\"a\":[]},\"regions\":[]}",
       "tensor 'a': not an object (an array)"},
      {"{\"tensors\":[],\"regions\":[]}", "'tensors': not an object"},
      {"{\"tensors\":{},\"regions\":{}}", "'regions': not an array"},
      {"{\"tensors\":{},\"regions\":[7]}",
       "region 0: not an object (an integer)"},
      {"{\"tensors\":{},\"regions\":[{\"offset\":-9223372036854775809,"
       "\"nbytes\":0}]}",
       "too big negative integer"},
      {"{\"tensors\":{\"a\":{\"dtype\":\"int8\\u0000\",\"shape\":[],"
       "\"stride\":[],\"storage_offset\":0,\"region\":0}},\"regions\":[]}",
       "\\u0000 is not allowed"},
      /* Anywhere: an unknown field too. */
      {"{\"x\":\"\\u0000\",\"tensors\":{},\"regions\":[]}",
       "manifest byte 13: \\u0000 is not allowed"},
      {"{\"x\":1,\"x\":1,\"tensors\":{},\"regions\":[]}",
       "manifest byte 10: duplicate object key"},
      /* A lone surrogate (Python's json.dumps writes one for a str that
       * holds it) is not Unicode: refused, where the hand-written reader
       * had read it as U+FFFD. */
      {"{\"tensors\":{\"a\\ud800\":{}},\"regions\":[]}",
       "invalid Unicode '\\uD800'"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    refused(cases[i][0], 64, cases[i][1]);
}

/* Values nested in an unknown field are skipped up to jansson's
 * JSON_PARSER_MAX_DEPTH (2048), and refused past it. */
Test(statedict, nesting_is_bounded) {
  const int deep = 2049;
  char *m = malloc(2 * (size_t)deep + 64);
  cr_assert_not_null(m);
  for (int depth = 100; depth <= deep; depth += deep - 100) {
    size_t k = (size_t)sprintf(m, "{\"x\":");
    memset(m + k, '[', (size_t)depth);
    memset(m + k + depth, ']', (size_t)depth);
    strcpy(m + k + 2 * depth, ",\"tensors\":{},\"regions\":[]}");
    td__statedict sd;
    char msg[1024] = "";
    int err = parse_as(m, 0, &sd, msg, sizeof(msg));
    if (depth < deep)
      cr_assert_eq(err, 0, "%d deep: %s", depth, msg);
    else
      refused(m, 0, "maximum parsing depth reached");
    td__statedict_free(&sd);
  }
  free(m);
}

/* jansson's tree of a manifest takes at most td__sd_tree_max bytes: past
 * it the manifest is refused (a hostile one of "{}," takes ~80 times its
 * bytes), and the next parse has the whole bound again. */
Test(statedict, the_tree_is_bounded) {
  size_t items = 64 << 10, k = 0;
  char *m = malloc(3 * items + 64);
  cr_assert_not_null(m);
  k += (size_t)sprintf(m, "{\"x\":[");
  for (size_t i = 0; i < items; i++)
    k += (size_t)sprintf(m + k, "%s{}", i ? "," : "");
  strcpy(m + k, "],\"tensors\":{},\"regions\":[]}");
  td__statedict sd;
  char msg[1024] = "";
  cr_assert_eq(parse_as(m, 0, &sd, msg, sizeof(msg)), 0, "%s", msg);
  td__statedict_free(&sd);
  td__sd_tree_max = 1 << 20;
  refused(m, 0, "whose JSON takes more than 1 MiB to hold");
  refused(m, 0, "whose JSON takes more than 1 MiB to hold");
  cr_assert_eq(parse_as(GOOD, GOOD_TOTAL, &sd, msg, sizeof(msg)), 0, "%s", msg);
  cr_assert_eq(sd.ntensors, 3);
  td__statedict_free(&sd);
  td__sd_tree_max = TD__SD_TREE_MAX;
  free(m);
}

/* More tensors or regions than the bounds say, refused before any is read
 * (the values are not even entries). */
Test(statedict, counts_are_bounded) {
  size_t n = TD__SD_TENSORS_MAX + 1, k = 0;
  char *m = malloc(16 * n + 64);
  cr_assert_not_null(m);
  k += (size_t)sprintf(m, "{\"tensors\":{},\"regions\":[");
  for (size_t i = 0; i < TD__SD_REGIONS_MAX + 1; i++)
    k += (size_t)sprintf(m + k, "%s0", i ? "," : "");
  strcpy(m + k, "]}");
  refused(m, 0, "more than 262144 regions (262145)");
  k = (size_t)sprintf(m, "{\"regions\":[],\"tensors\":{");
  for (size_t i = 0; i < n; i++)
    k += (size_t)sprintf(m + k, "%s\"%zx\":0", i ? "," : "", i);
  strcpy(m + k, "}}");
  refused(m, 0, "more than 262144 tensors (262145)");
  free(m);
}

/* A tensor name past TD__SD_NAME_MAX bytes. */
Test(statedict, names_are_bounded) {
  size_t n = TD__SD_NAME_MAX + 1;
  char *m = malloc(n + 64);
  cr_assert_not_null(m);
  strcpy(m, "{\"tensors\":{\"");
  memset(m + strlen(m), 'x', n);
  strcpy(m + 13 + n, "\":{}},\"regions\":[]}");
  refused(m, 0, "a tensor name of more than 4096 bytes");
  free(m);
}

/* Every prefix of a good blob, and the good blob with each byte of its
 * header and manifest replaced by a few values and by random ones, parses
 * or is refused with a message; never a crash, never a read outside the
 * blob (each is an allocation of its own size: the sanitizer builds catch
 * a stray read). */
Test(statedict, no_corruption_crashes) {
  size_t n;
  uint8_t *good = blob(GOOD, GOOD_TOTAL, &n);
  td__statedict sd;
  char msg[1024];
  for (size_t k = 0; k <= n; k++) {
    uint8_t *b = malloc(k ? k : 1);
    memcpy(b, good, k);
    int err = td__statedict_parse(b, k, &sd, msg, sizeof(msg));
    cr_assert(err == 0 || err == TD_EINVAL, "prefix %zu: %d", k, err);
    if (err < 0)
      cr_assert_gt(strlen(msg), 0);
    td__statedict_free(&sd);
    free(b);
  }
  static const uint8_t values[] = {0,   '"', '\\', '{', '}',  '[',  ']', ',',
                                   ':', '9', '-',  'e', 0x80, 0xff, ' '};
  size_t end = TD__SD_HEADER + strlen(GOOD);
  unsigned seed = (unsigned)tdt_seed("statedict::no_corruption_crashes");
  for (size_t at = 0; at < end; at++)
    for (size_t v = 0; v < sizeof(values) + 4; v++) {
      uint8_t *b = malloc(n);
      memcpy(b, good, n);
      b[at] = v < sizeof(values) ? values[v] : (uint8_t)rand_r(&seed);
      int err = td__statedict_parse(b, n, &sd, msg, sizeof(msg));
      cr_assert(err == 0 || err == TD_EINVAL, "byte %zu = 0x%02x: %d", at,
                b[at], err);
      for (size_t i = 0; err == 0 && i < sd.ntensors; i++) {
        /* Whatever parsed lies inside the blob. */
        const td__sd_tensor *t = &sd.tensors[i];
        const td__sd_region *r = &sd.regions[t->region];
        cr_assert_leq(r->offset + r->nbytes, n);
        cr_assert_leq(t->nbytes, r->nbytes);
      }
      td__statedict_free(&sd);
      free(b);
    }
  free(good);
}

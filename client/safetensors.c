/* safetensors.c: safetensors checkpoints read and checked from untrusted
 * bytes with jansson (every rule of the format, each error naming the file,
 * the tensor and the field), and the headers td_model_save writes. */
#include "safetensors.h"

#include "internal.h"
#include "jsonmem.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

size_t td__st_tree_max = TD__ST_TREE_MAX;

static const struct {
  const char *name;
  td_dtype dtype;
} dtypes[] = {
    {"F64", TD_FLOAT64},     {"F32", TD_FLOAT32},
    {"F16", TD_FLOAT16},     {"BF16", TD_BFLOAT16},
    {"I64", TD_INT64},       {"I32", TD_INT32},
    {"I16", TD_INT16},       {"I8", TD_INT8},
    {"U8", TD_UINT8},        {"BOOL", TD_BOOL},
    {"U16", TD_UINT16},      {"U32", TD_UINT32},
    {"U64", TD_UINT64},      {"F8_E4M3", TD_FLOAT8_E4M3FN},
    {"F8_E5M2", TD_FLOAT8_E5M2},
};
#define NDTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

td_dtype td__st_dtype(const char *name) {
  for (size_t i = 0; i < NDTYPES; i++)
    if (strcmp(dtypes[i].name, name) == 0)
      return dtypes[i].dtype;
  return TD_DTYPE_INVALID;
}

const char *td__st_dtype_name(td_dtype dtype) {
  for (size_t i = 0; i < NDTYPES; i++)
    if (dtypes[i].dtype == dtype)
      return dtypes[i].name;
  return NULL;
}

#define kind td__json_kind

/* "[2, 3]" into buf. */
static const char *shape_text(const int64_t *shape, int32_t ndim, char *buf,
                              size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int32_t d = 0; d < ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%" PRId64,
                             d ? ", " : "", shape[d]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
  return buf;
}

/* Sets *out to v, an integer of at least 0. */
static int count(const char *file, const char *shown, const char *field,
                 const json_t *v, int64_t *out, char *msg, size_t len) {
  if (!json_is_integer(v))
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': %s: %s, not an integer", file, shown,
                   field, kind(v));
  json_int_t i = json_integer_value(v);
  if (i < 0)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': %s: %" JSON_INTEGER_FORMAT
                   " is negative",
                   file, shown, field, i);
  *out = (int64_t)i;
  return 0;
}

/* Reads one tensor's entry e into t (its begin and end relative to the
 * data region until the caller adds data_start). */
static int read_tensor(const char *file, const char *shown, json_t *e,
                       td__st_tensor *t, uint64_t data_len, char *msg,
                       size_t len) {
  if (!json_is_object(e))
    return td__msg(msg, len, TD_EINVAL, "%s: tensor '%s': %s, not an object",
                   file, shown, kind(e));
  const char *field;
  json_t *v;
  json_object_foreach(e, field, v) {
    if (strcmp(field, "dtype") != 0 && strcmp(field, "shape") != 0 &&
        strcmp(field, "data_offsets") != 0) {
      char f[64];
      return td__msg(msg, len, TD_EINVAL,
                     "%s: tensor '%s': unknown field '%s' (a tensor has "
                     "dtype, shape and data_offsets)",
                     file, shown, td__printable(field, f, sizeof(f)));
    }
  }
  static const char *const need[] = {"dtype", "shape", "data_offsets"};
  for (int i = 0; i < 3; i++)
    if (json_object_get(e, need[i]) == NULL)
      return td__msg(msg, len, TD_EINVAL, "%s: tensor '%s': no '%s'", file,
                     shown, need[i]);
  json_t *dt = json_object_get(e, "dtype");
  if (!json_is_string(dt))
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': dtype: %s, not a string", file, shown,
                   kind(dt));
  t->dtype = td__st_dtype(json_string_value(dt));
  if (t->dtype == TD_DTYPE_INVALID) {
    char d[40];
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': dtype: unknown dtype '%s' (known: F64 "
                   "F32 F16 BF16 I64 I32 I16 I8 U8 BOOL U16 U32 U64 F8_E4M3 "
                   "F8_E5M2)",
                   file, shown,
                   td__printable(json_string_value(dt), d, sizeof(d)));
  }
  const char *dn = td__st_dtype_name(t->dtype);
  size_t item = td_dtype_size(t->dtype);
  json_t *sh = json_object_get(e, "shape");
  if (!json_is_array(sh))
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': shape: %s, not an array", file, shown,
                   kind(sh));
  size_t nd = json_array_size(sh);
  if (nd > TD_MAX_DIMS)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': shape: %zu dims, tensord views have at "
                   "most %d",
                   file, shown, nd, TD_MAX_DIMS);
  t->ndim = (int32_t)nd;
  uint64_t numel = 1;
  int overflow = 0;
  for (size_t d = 0; d < nd; d++) {
    int err = count(file, shown, "shape", json_array_get(sh, d), &t->shape[d],
                    msg, len);
    if (err < 0)
      return err;
    overflow |= __builtin_mul_overflow(numel, (uint64_t)t->shape[d], &numel);
  }
  uint64_t need_bytes = 0;
  char st[400];
  if (overflow || __builtin_mul_overflow(numel, (uint64_t)item, &need_bytes) ||
      need_bytes > INT64_MAX)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': shape: %s%s has more than 2^63 bytes",
                   file, shown, dn,
                   shape_text(t->shape, t->ndim, st, sizeof(st)));
  json_t *off = json_object_get(e, "data_offsets");
  if (!json_is_array(off) || json_array_size(off) != 2)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': data_offsets: %s%s, not [begin, end]",
                   file, shown, kind(off),
                   json_is_array(off) ? " of other than 2 items" : "");
  int64_t b, en;
  int err;
  if ((err = count(file, shown, "data_offsets", json_array_get(off, 0), &b,
                   msg, len)) < 0 ||
      (err = count(file, shown, "data_offsets", json_array_get(off, 1), &en,
                   msg, len)) < 0)
    return err;
  if (b > en)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64
                   "] end before they begin",
                   file, shown, b, en);
  if ((uint64_t)en > data_len)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64
                   "] reach past the data's %" PRIu64 " bytes",
                   file, shown, b, en, data_len);
  if ((uint64_t)(en - b) != need_bytes)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64
                   "] cover %" PRId64 " bytes, %s%s needs %" PRIu64,
                   file, shown, b, en, en - b, dn,
                   shape_text(t->shape, t->ndim, st, sizeof(st)), need_bytes);
  t->begin = (uint64_t)b;
  t->end = (uint64_t)en;
  return 0;
}

/* Checks __metadata__: an object of strings. */
static int read_metadata(const char *file, json_t *m, char *msg, size_t len) {
  if (!json_is_object(m))
    return td__msg(msg, len, TD_EINVAL,
                   "%s: __metadata__: %s, not an object of strings", file,
                   kind(m));
  const char *k;
  json_t *v;
  json_object_foreach(m, k, v) {
    if (!json_is_string(v)) {
      char f[96];
      return td__msg(msg, len, TD_EINVAL,
                     "%s: __metadata__: '%s': %s, not a string", file,
                     td__printable(k, f, sizeof(f)), kind(v));
    }
  }
  return 0;
}

static int by_begin(const void *a, const void *b) {
  const td__st_tensor *x = *(const td__st_tensor *const *)a;
  const td__st_tensor *y = *(const td__st_tensor *const *)b;
  return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

/* Checks that no two of the n tensors at t (non-empty ones) overlap. */
static int check_overlaps(const char *file, td__st_tensor *t, size_t n,
                          char *msg, size_t len) {
  td__st_tensor **o = malloc((n ? n : 1) * sizeof(*o));
  if (o == NULL)
    return td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (t[i].end > t[i].begin)
      o[k++] = &t[i];
  qsort(o, k, sizeof(*o), by_begin);
  int err = 0;
  for (size_t i = 1; i < k && err == 0; i++)
    if (o[i]->begin < o[i - 1]->end) {
      char a[96], b[96];
      err = td__msg(msg, len, TD_EINVAL,
                    "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                    "] overlap tensor '%s''s [%" PRIu64 ", %" PRIu64 "]",
                    file, td__printable(o[i]->name, a, sizeof(a)),
                    o[i]->begin, o[i]->end,
                    td__printable(o[i - 1]->name, b, sizeof(b)),
                    o[i - 1]->begin, o[i - 1]->end);
    }
  free(o);
  return err;
}

/* Reads the header's tree into ck (tensors appended from index first). */
static int read_header(const char *file, json_t *root, uint64_t data_start,
                       uint64_t data_len, uint32_t shard, td__checkpoint *ck,
                       json_t **metadata, size_t *ntensors, char *msg,
                       size_t len) {
  if (!json_is_object(root))
    return td__msg(msg, len, TD_EINVAL, "%s: header: %s, not an object", file,
                   kind(root));
  size_t n = json_object_size(root);
  json_t *meta = json_object_get(root, "__metadata__");
  if (meta != NULL) {
    int err = read_metadata(file, meta, msg, len);
    if (err < 0)
      return err;
    n--;
  }
  size_t first = ck->ntensors;
  td__st_tensor *grown =
      realloc(ck->tensors, (first + n + 1) * sizeof(*ck->tensors));
  if (grown == NULL)
    return td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
  ck->tensors = grown;
  const char *name;
  json_t *e;
  int err = 0;
  json_object_foreach(root, name, e) {
    if (strcmp(name, "__metadata__") == 0)
      continue;
    char shown[128];
    td__printable(name, shown, sizeof(shown));
    td__st_tensor *t = &ck->tensors[ck->ntensors];
    memset(t, 0, sizeof(*t));
    if ((err = read_tensor(file, shown, e, t, data_len, msg, len)) < 0)
      break;
    t->begin += data_start;
    t->end += data_start;
    t->shard = shard;
    size_t item = td_dtype_size(t->dtype);
    if (t->begin % item != 0) {
      err = td__msg(msg, len, TD_EINVAL,
                    "%s: tensor '%s': data_offsets begin at byte %" PRIu64
                    " of the file, not a multiple of %s's %zu bytes "
                    "(tensord views count elements)",
                    file, shown, t->begin, td__st_dtype_name(t->dtype), item);
      break;
    }
    if ((t->name = strdup(name)) == NULL) {
      err = td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
      break;
    }
    ck->ntensors++;
  }
  if (err == 0)
    err = check_overlaps(file, &ck->tensors[first], ck->ntensors - first, msg,
                         len);
  if (err < 0) {
    for (size_t i = first; i < ck->ntensors; i++)
      free(ck->tensors[i].name);
    ck->ntensors = first;
    return err;
  }
  *metadata = meta != NULL ? json_incref(meta) : NULL;
  *ntensors = ck->ntensors - first;
  return 0;
}

/* The header length of a file's first 8 bytes (little-endian). */
static uint64_t le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

/* The parse of one header, shared by td__st_parse_header and the loader. */
static int parse_header(const char *file, const uint8_t *head, size_t head_len,
                        uint64_t file_size, uint32_t shard, td__checkpoint *ck,
                        uint64_t *hlen, json_t **metadata, size_t *ntensors,
                        char *msg, size_t len) {
  if (file_size < 8 || head_len < 8)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: %" PRIu64 " bytes, too short for a safetensors file "
                   "(8 bytes of header length first)",
                   file, file_size);
  uint64_t n = le64(head);
  if (n > file_size - 8)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: header length %" PRIu64 " reaches past the file's "
                   "%" PRIu64 " bytes",
                   file, n, file_size);
  if (n > TD__ST_HEADER_MAX)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: header length %" PRIu64 " is over safetensors' limit "
                   "of %" PRIu64 " bytes",
                   file, n, TD__ST_HEADER_MAX);
  if (head_len - 8 < n)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: header of %" PRIu64 " bytes, %zu read", file, n,
                   head_len - 8);
  if (n == 0 || head[8] != '{')
    return td__msg(msg, len, TD_EINVAL,
                   "%s: header: does not begin with '{' (not a JSON object)",
                   file);
  json_error_t e;
  int over;
  json_t *root = td__json_loadb_bounded((const char *)head + 8, (size_t)n,
                                        JSON_REJECT_DUPLICATES, td__st_tree_max,
                                        &e, &over);
  if (root == NULL) {
    if (over)
      return td__msg(msg, len, TD_EINVAL,
                     "%s: header: a JSON of %" PRIu64 " bytes that takes "
                     "more than %zu MiB to hold",
                     file, n, td__st_tree_max >> 20);
    if (json_error_code(&e) == json_error_out_of_memory)
      return td__msg(msg, len, TD_ENOMEM, "%s: header: out of memory", file);
    return td__msg(msg, len, TD_EINVAL, "%s: header byte %d: %s", file,
                   e.position, e.text);
  }
  int err = read_header(file, root, 8 + n, file_size - 8 - n, shard, ck,
                        metadata, ntensors, msg, len);
  json_decref(root);
  if (err == 0)
    *hlen = n;
  return err;
}

int td__st_parse_header(const char *file, const uint8_t *head, size_t head_len,
                        uint64_t file_size, uint32_t shard, td__checkpoint *ck,
                        char *msg, size_t len) {
  uint64_t hlen = 0;
  json_t *meta = NULL;
  size_t nt = 0;
  int err = parse_header(file, head, head_len, file_size, shard, ck, &hlen,
                         &meta, &nt, msg, len);
  if (err < 0)
    return err;
  if (shard < ck->nshards) {
    td__st_shard *s = &ck->shards[shard];
    s->header_len = hlen;
    json_decref(s->metadata);
    s->metadata = meta;
    s->ntensors = nt;
  } else {
    json_decref(meta);
  }
  return 0;
}

/* ---- checkpoints on disk ---- */

static int64_t mtime_ns(const struct stat *st) {
  return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
}

/* Opens dir/file, checks its header and fills ck->shards[i] (whose file is
 * set), appending its tensors to ck. */
static int open_shard(td__checkpoint *ck, uint32_t i, char *msg, size_t len) {
  td__st_shard *s = &ck->shards[i];
  char path[PATH_MAX];
  if ((size_t)snprintf(path, sizeof(path), "%s/%s", ck->dir, s->file) >=
      sizeof(path))
    return td__msg(msg, len, TD_ENAMETOOLONG, "%s/%s: path too long", ck->dir,
                   s->file);
  s->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (s->fd < 0) {
    int e = errno;
    return td__msg(msg, len, e == ENOENT ? TD_ENOENT : -e, "%s: %s%s", path,
                   strerror(e),
                   ck->is_index ? " (a shard the index json names)" : "");
  }
  struct stat st;
  if (fstat(s->fd, &st) < 0)
    return td__msg(msg, len, -errno, "%s: %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return td__msg(msg, len, TD_EINVAL, "%s: not a regular file", path);
  s->size = (uint64_t)st.st_size;
  s->mtime_ns = mtime_ns(&st);
  uint8_t b8[8];
  ssize_t r = pread(s->fd, b8, 8, 0);
  if (r < 0)
    return td__msg(msg, len, TD_EIO, "%s: %s", path, strerror(errno));
  if (r < 8)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: %" PRIu64 " bytes, too short for a safetensors file "
                   "(8 bytes of header length first)",
                   s->file, s->size);
  uint64_t n = le64(b8);
  if (n > s->size - 8 || n > TD__ST_HEADER_MAX) /* said by parse_header */
    return parse_header(s->file, b8, 8, s->size, i, ck, &s->header_len,
                        &s->metadata, &s->ntensors, msg, len);
  if ((s->head = malloc(8 + n)) == NULL)
    return td__msg(msg, len, TD_ENOMEM, "%s: out of memory for a header of "
                   "%" PRIu64 " bytes", s->file, n);
  size_t got = 0;
  while (got < 8 + n) {
    r = pread(s->fd, s->head + got, 8 + n - got, (off_t)got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return td__msg(msg, len, TD_EIO, "%s: reading its header: %s", path,
                     r < 0 ? strerror(errno) : "the file shrank");
    got += (size_t)r;
  }
  int err = parse_header(s->file, s->head, 8 + n, s->size, i, ck,
                         &s->header_len, &s->metadata, &s->ntensors, msg, len);
  ck->bytes += s->size;
  return err;
}

/* Whether name is a plain file name: no '/', not "." or "..", not empty. */
static int plain_name(const char *name) {
  return name[0] != '\0' && strchr(name, '/') == NULL &&
         strcmp(name, ".") != 0 && strcmp(name, "..") != 0;
}

static int ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), t = strlen(tail);
  return n >= t && strcmp(s + n - t, tail) == 0;
}

/* Reads the index json at ck->path into its shards (in the order of their
 * first tensor in weight_map) and *wm (a new reference). */
static int read_index(td__checkpoint *ck, json_t **wm, char *msg, size_t len) {
  const char *file = strrchr(ck->path, '/') + 1;
  int fd = open(ck->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return td__msg(msg, len, -errno, "%s: %s", ck->path, strerror(errno));
  char *buf = NULL;
  int err = 0;
  if (ck->size > TD__ST_HEADER_MAX) {
    err = td__msg(msg, len, TD_EINVAL,
                  "%s: %" PRIu64 " bytes, over the %" PRIu64 " read of an "
                  "index json",
                  file, ck->size, TD__ST_HEADER_MAX);
    goto out;
  }
  if ((buf = malloc(ck->size + 1)) == NULL) {
    err = td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
    goto out;
  }
  size_t got = 0;
  while (got < ck->size) {
    ssize_t r = pread(fd, buf + got, ck->size - got, (off_t)got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      err = td__msg(msg, len, TD_EIO, "%s: %s", ck->path,
                    r < 0 ? strerror(errno) : "the file shrank");
      goto out;
    }
    got += (size_t)r;
  }
  json_error_t e;
  int over;
  json_t *root = td__json_loadb_bounded(buf, got, JSON_REJECT_DUPLICATES,
                                        td__st_tree_max, &e, &over);
  if (root == NULL) {
    err = over ? td__msg(msg, len, TD_EINVAL,
                         "%s: a JSON that takes more than %zu MiB to hold",
                         file, td__st_tree_max >> 20)
               : td__msg(msg, len, TD_EINVAL, "%s: byte %d: %s", file,
                         e.position, e.text);
    goto out;
  }
  json_t *m = json_object_get(root, "metadata");
  json_t *w = json_object_get(root, "weight_map");
  if (!json_is_object(root))
    err = td__msg(msg, len, TD_EINVAL, "%s: %s, not an object", file,
                  kind(root));
  else if (w == NULL)
    err = td__msg(msg, len, TD_EINVAL, "%s: no 'weight_map'", file);
  else if (!json_is_object(w))
    err = td__msg(msg, len, TD_EINVAL, "%s: weight_map: %s, not an object",
                  file, kind(w));
  else if (m != NULL && !json_is_object(m))
    err = td__msg(msg, len, TD_EINVAL, "%s: metadata: %s, not an object",
                  file, kind(m));
  if (err < 0) {
    json_decref(root);
    goto out;
  }
  size_t n = json_object_size(w);
  if ((ck->shards = calloc(n ? n : 1, sizeof(*ck->shards))) == NULL) {
    json_decref(root);
    err = td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
    goto out;
  }
  const char *tname;
  json_t *v;
  json_object_foreach(w, tname, v) {
    char shown[128], f[128];
    td__printable(tname, shown, sizeof(shown));
    if (!json_is_string(v)) {
      err = td__msg(msg, len, TD_EINVAL,
                    "%s: weight_map: tensor '%s': %s, not a file name", file,
                    shown, kind(v));
      break;
    }
    const char *sf = json_string_value(v);
    if (!plain_name(sf)) {
      err = td__msg(msg, len, TD_EINVAL,
                    "%s: weight_map: tensor '%s': shard '%s' is not a plain "
                    "file name in the index's directory",
                    file, shown, td__printable(sf, f, sizeof(f)));
      break;
    }
    size_t i = 0;
    while (i < ck->nshards && strcmp(ck->shards[i].file, sf) != 0)
      i++;
    if (i == ck->nshards) {
      ck->shards[i].fd = -1;
      if ((ck->shards[i].file = strdup(sf)) == NULL) {
        err = td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
        break;
      }
      ck->nshards++;
    }
  }
  if (err == 0) {
    ck->metadata = m != NULL ? json_incref(m) : NULL;
    *wm = json_incref(w);
  }
  json_decref(root);
out:
  free(buf);
  close(fd);
  return err;
}

static const td__st_tensor *sort_base;

static int by_name(const void *a, const void *b) {
  return strcmp(sort_base[*(const size_t *)a].name,
                sort_base[*(const size_t *)b].name);
}

/* The index (into t, sorted by name through order) of name, or n. */
static size_t find_name(const td__st_tensor *t, const size_t *order, size_t n,
                        const char *name) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(t[order[mid]].name, name);
    if (c == 0)
      return order[mid];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return n;
}

/* Puts ck's tensors (parsed shard by shard) in weight_map's order and checks
 * that the index and the shards name the same tensors, each in its shard. */
static int match_index(td__checkpoint *ck, json_t *wm, char *msg, size_t len) {
  const char *file = strrchr(ck->path, '/') + 1;
  size_t n = ck->ntensors;
  td__st_tensor *sorted = calloc(n ? n : 1, sizeof(*sorted));
  char *used = calloc(n ? n : 1, 1);
  size_t *order = malloc((n ? n : 1) * sizeof(*order));
  int err = 0;
  if (sorted == NULL || used == NULL || order == NULL) {
    err = td__msg(msg, len, TD_ENOMEM, "%s: out of memory", file);
    goto out;
  }
  for (size_t j = 0; j < n; j++)
    order[j] = j;
  /* qsort takes no argument for its comparison: one sort at a time. */
  static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&sort_mu);
  sort_base = ck->tensors;
  qsort(order, n, sizeof(*order), by_name);
  pthread_mutex_unlock(&sort_mu);
  /* Two shards may hold a tensor of one name: a duplicate. */
  for (size_t j = 1; j < n; j++)
    if (strcmp(ck->tensors[order[j]].name, ck->tensors[order[j - 1]].name) ==
        0) {
      char shown[128], f[128], g[128];
      err = td__msg(
          msg, len, TD_EINVAL, "%s: tensor '%s' is in two shards, '%s' and '%s'",
          file, td__printable(ck->tensors[order[j]].name, shown,
                                  sizeof(shown)),
          td__printable(ck->shards[ck->tensors[order[j - 1]].shard].file,
                            f, sizeof(f)),
          td__printable(ck->shards[ck->tensors[order[j]].shard].file, g,
                            sizeof(g)));
      goto out;
    }
  size_t k = 0;
  const char *tname;
  json_t *v;
  json_object_foreach(wm, tname, v) {
    const char *sf = json_string_value(v);
    size_t j = find_name(ck->tensors, order, n, tname);
    char shown[128], f[128];
    td__printable(tname, shown, sizeof(shown));
    if (j == n || strcmp(ck->shards[ck->tensors[j].shard].file, sf) != 0) {
      err = td__msg(msg, len, TD_EINVAL,
                    "%s: weight_map: tensor '%s': its shard '%s' has no "
                    "tensor of that name",
                    file, shown, td__printable(sf, f, sizeof(f)));
      goto out;
    }
    used[j] = 1;
    sorted[k++] = ck->tensors[j];
  }
  for (size_t j = 0; j < n; j++)
    if (!used[j]) {
      char shown[128], f[128];
      err = td__msg(msg, len, TD_EINVAL,
                    "%s: tensor '%s' is not in %s's weight_map",
                    td__printable(ck->shards[ck->tensors[j].shard].file,
                                      f, sizeof(f)),
                    td__printable(ck->tensors[j].name, shown,
                                      sizeof(shown)),
                    file);
      goto out;
    }
  memcpy(ck->tensors, sorted, n * sizeof(*sorted));
out:
  free(sorted);
  free(used);
  free(order);
  return err;
}

/* Sets *found to the one entry of dir whose name ends in .safetensors.
 * Returns 0, or an error naming how many there are. */
static int find_single(const char *dir, char **found, char *msg, size_t len) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return td__msg(msg, len, -errno, "%s: %s", dir, strerror(errno));
  struct dirent *e;
  size_t n = 0;
  char first[256] = "", second[256] = "";
  while ((e = readdir(d)) != NULL) {
    if (!ends_with(e->d_name, ".safetensors"))
      continue;
    if (n == 0)
      snprintf(first, sizeof(first), "%s", e->d_name);
    else if (n == 1)
      snprintf(second, sizeof(second), "%s", e->d_name);
    n++;
  }
  closedir(d);
  if (n == 0)
    return td__msg(msg, len, TD_ENOENT,
                   "%s: no %s and no .safetensors file", dir,
                   TD__ST_INDEX_NAME);
  if (n > 1)
    return td__msg(msg, len, TD_EINVAL,
                   "%s: no %s, and %zu .safetensors files ('%s', '%s'%s): "
                   "name the file or the index",
                   dir, TD__ST_INDEX_NAME, n, first, second,
                   n > 2 ? ", ..." : "");
  if (asprintf(found, "%s/%s", dir, first) < 0)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  return 0;
}

int td__ckpt_open(const char *path, td__checkpoint *ck, char *msg,
                  size_t len) {
  memset(ck, 0, sizeof(*ck));
  char *real = realpath(path, NULL), *chosen = NULL;
  int err = 0;
  json_t *wm = NULL;
  if (real == NULL) {
    int e = errno;
    return td__msg(msg, len, e == ENOENT ? TD_ENOENT : -e, "%s: %s", path,
                   strerror(e));
  }
  struct stat st;
  if (stat(real, &st) < 0) {
    err = td__msg(msg, len, -errno, "%s: %s", real, strerror(errno));
    goto fail;
  }
  if (S_ISDIR(st.st_mode)) {
    char idx[PATH_MAX];
    snprintf(idx, sizeof(idx), "%s/%s", real, TD__ST_INDEX_NAME);
    if (access(idx, F_OK) == 0) {
      if ((chosen = strdup(idx)) == NULL) {
        err = td__msg(msg, len, TD_ENOMEM, "out of memory");
        goto fail;
      }
    } else if ((err = find_single(real, &chosen, msg, len)) < 0) {
      goto fail;
    }
    free(real);
    real = chosen;
    chosen = NULL;
    if (stat(real, &st) < 0) {
      err = td__msg(msg, len, -errno, "%s: %s", real, strerror(errno));
      goto fail;
    }
  }
  if (!S_ISREG(st.st_mode)) {
    err = td__msg(msg, len, TD_EINVAL, "%s: not a regular file", real);
    goto fail;
  }
  ck->path = real;
  real = NULL;
  if ((ck->dir = strdup(ck->path)) == NULL) {
    err = td__msg(msg, len, TD_ENOMEM, "out of memory");
    goto fail;
  }
  *strrchr(ck->dir, '/') = '\0';
  if (ck->dir[0] == '\0')
    strcpy(ck->dir, "/");
  ck->size = (uint64_t)st.st_size;
  ck->mtime_ns = mtime_ns(&st);
  ck->is_index = ends_with(ck->path, ".json");
  if (ck->is_index) {
    if ((err = read_index(ck, &wm, msg, len)) < 0)
      goto fail;
    if (ck->nshards == 0) {
      err = td__msg(msg, len, TD_EINVAL, "%s: weight_map names no tensor",
                    strrchr(ck->path, '/') + 1);
      goto fail;
    }
  } else {
    if ((ck->shards = calloc(1, sizeof(*ck->shards))) == NULL ||
        (ck->shards[0].file = strdup(strrchr(ck->path, '/') + 1)) == NULL) {
      err = td__msg(msg, len, TD_ENOMEM, "out of memory");
      goto fail;
    }
    ck->shards[0].fd = -1;
    ck->nshards = 1;
  }
  for (uint32_t i = 0; i < ck->nshards; i++)
    if ((err = open_shard(ck, i, msg, len)) < 0)
      goto fail;
  if (ck->is_index) {
    if ((err = match_index(ck, wm, msg, len)) < 0)
      goto fail;
  } else {
    ck->metadata = ck->shards[0].metadata != NULL
                       ? json_incref(ck->shards[0].metadata)
                       : NULL;
  }
  json_decref(wm);
  return 0;
fail:
  json_decref(wm);
  free(real);
  free(chosen);
  td__ckpt_free(ck);
  return err;
}

int td__ckpt_default_name(const char *path, char *buf, size_t len, char *msg,
                          size_t mlen) {
  char *real = realpath(path, NULL);
  if (real == NULL) {
    int e = errno;
    return td__msg(msg, mlen, e == ENOENT ? TD_ENOENT : -e, "%s: %s", path,
                   strerror(e));
  }
  struct stat st;
  int isdir = stat(real, &st) == 0 && S_ISDIR(st.st_mode);
  const char *suffix = ".safetensors";
  size_t rl = strlen(real), sl = strlen(suffix);
  if (!isdir && rl > sl && strcmp(real + rl - sl, suffix) == 0) {
    real[rl - sl] = '\0';
  } else if (!isdir) {
    char *slash = strrchr(real, '/');
    if (slash != NULL && slash != real)
      *slash = '\0';
  }
  const char *base = strrchr(real, '/');
  base = base != NULL ? base + 1 : real;
  int err = 0;
  if (base[0] == '\0' || (size_t)snprintf(buf, len, "%s", base) >= len)
    err = td__msg(msg, mlen, TD_EINVAL,
                  "%s: no model name to derive from it: give one", path);
  free(real);
  return err;
}

void td__ckpt_free(td__checkpoint *ck) {
  if (ck == NULL)
    return;
  for (size_t i = 0; i < ck->nshards; i++) {
    td__st_shard *s = &ck->shards[i];
    if (s->fd >= 0)
      close(s->fd);
    free(s->file);
    free(s->head);
    json_decref(s->metadata);
  }
  for (size_t i = 0; i < ck->ntensors; i++)
    free(ck->tensors[i].name);
  free(ck->shards);
  free(ck->tensors);
  json_decref(ck->metadata);
  free(ck->path);
  free(ck->dir);
  memset(ck, 0, sizeof(*ck));
}

/* ---- writing ---- */

char *td__st_header_build(const td__st_out *t, size_t n, json_t *metadata,
                          size_t *hlen) {
  json_t *root = json_object();
  char *text = NULL, *out = NULL;
  if (root == NULL)
    return NULL;
  if (metadata != NULL &&
      json_object_set(root, "__metadata__", metadata) < 0)
    goto done;
  for (size_t i = 0; i < n; i++) {
    json_t *shape = json_array();
    json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype",
                          td__st_dtype_name(t[i].dtype), "shape", shape,
                          "data_offsets", (json_int_t)t[i].begin,
                          (json_int_t)t[i].end);
    if (e == NULL)
      goto done;
    for (int32_t d = 0; d < t[i].ndim; d++)
      if (json_array_append_new(shape, json_integer(t[i].shape[d])) < 0) {
        json_decref(e);
        goto done;
      }
    if (json_object_set_new(root, t[i].name, e) < 0)
      goto done;
  }
  if ((text = json_dumps(root, JSON_COMPACT)) == NULL)
    goto done;
  size_t k = strlen(text), padded = k + (8 - (8 + k) % 8) % 8;
  if ((out = malloc(padded)) == NULL)
    goto done;
  memcpy(out, text, k);
  memset(out + k, ' ', padded - k);
  *hlen = padded;
done:
  free(text);
  json_decref(root);
  return out;
}

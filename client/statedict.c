/* statedict.c: the packed state dicts of tensord.torch.publish_state_dict,
 * parsed defensively from a storage's bytes for tensorctl info and show. */
#include "statedict.h"

#include "clitext.h"
#include "common.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int td__statedict_is(const void *p, size_t n) {
  return n >= TD__SD_HEADER &&
         memcmp(p, TD__SD_MAGIC, sizeof(TD__SD_MAGIC) - 1) == 0;
}

int td__statedict_blob_shaped(const td_view *v) {
  return v->dtype == TD_UINT8 && v->ndim == 1 && v->shape[0] >= TD__SD_HEADER &&
         v->stride[0] == 1;
}

/* ---- a JSON reader over untrusted bytes ---- */

/* Every read checks p < end; every failure names the byte offset in the
 * manifest. Strings must be UTF-8, numbers that matter integers. */
typedef struct jp {
  const unsigned char *start, *p, *end;
  char *msg;
  size_t len;
} jp;

#define JSON_DEPTH_MAX 64

static int jfail(jp *j, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int jfail(jp *j, const char *fmt, ...) {
  char what[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  return td__msg(j->msg, j->len, TD_EINVAL, "manifest byte %zu: %s",
                 (size_t)(j->p - j->start), what);
}

static void ws(jp *j) {
  while (j->p < j->end &&
         (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
    j->p++;
}

/* Skips white space and takes ch. */
static int take(jp *j, char ch) {
  ws(j);
  if (j->p >= j->end)
    return jfail(j, "the manifest ends where '%c' was due", ch);
  if (*j->p != (unsigned char)ch)
    return jfail(j, "'%c' where '%c' was due", *j->p, ch);
  j->p++;
  return 0;
}

/* Skips white space and takes ch if it comes next. Returns 1 if it did. */
static int maybe(jp *j, char ch) {
  ws(j);
  if (j->p < j->end && *j->p == (unsigned char)ch) {
    j->p++;
    return 1;
  }
  return 0;
}

static int hex4(jp *j, unsigned *out) {
  unsigned v = 0;
  if (j->end - j->p < 4)
    return jfail(j, "a \\u escape cut short");
  for (int i = 0; i < 4; i++) {
    unsigned char c = j->p[i];
    unsigned d = c >= '0' && c <= '9'   ? (unsigned)(c - '0')
                 : c >= 'a' && c <= 'f' ? (unsigned)(c - 'a' + 10)
                 : c >= 'A' && c <= 'F' ? (unsigned)(c - 'A' + 10)
                                        : 16u;
    if (d == 16)
      return jfail(j, "a \\u escape with '%c' in it", c);
    v = v * 16 + d;
  }
  j->p += 4;
  *out = v;
  return 0;
}

/* Appends the UTF-8 of cp to buf (cap bytes with the NUL), counting in *n
 * even past cap (so that the caller learns the whole length). */
static void put_utf8(char *buf, size_t cap, size_t *n, unsigned cp) {
  unsigned char u[4];
  size_t k;
  if (cp < 0x80) {
    u[0] = (unsigned char)cp;
    k = 1;
  } else if (cp < 0x800) {
    u[0] = (unsigned char)(0xc0 | cp >> 6);
    u[1] = (unsigned char)(0x80 | (cp & 0x3f));
    k = 2;
  } else if (cp < 0x10000) {
    u[0] = (unsigned char)(0xe0 | cp >> 12);
    u[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
    u[2] = (unsigned char)(0x80 | (cp & 0x3f));
    k = 3;
  } else {
    u[0] = (unsigned char)(0xf0 | cp >> 18);
    u[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3f));
    u[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
    u[3] = (unsigned char)(0x80 | (cp & 0x3f));
    k = 4;
  }
  for (size_t i = 0; i < k; i++, (*n)++)
    if (buf != NULL && *n + 1 < cap)
      buf[*n] = (char)u[i];
}

/* The length of the UTF-8 sequence at p (at most end - p bytes), or 0 if
 * it is not one (overlong, a surrogate, past U+10FFFF, cut short). */
static size_t utf8_len(const unsigned char *p, const unsigned char *end) {
  unsigned char c = p[0];
  size_t k = c >= 0xc2 && c <= 0xdf   ? 2
             : c >= 0xe0 && c <= 0xef ? 3
             : c >= 0xf0 && c <= 0xf4 ? 4
                                      : 0;
  if (k == 0 || (size_t)(end - p) < k)
    return 0;
  for (size_t i = 1; i < k; i++)
    if ((p[i] & 0xc0) != 0x80)
      return 0;
  if ((c == 0xe0 && p[1] < 0xa0) || (c == 0xed && p[1] > 0x9f) ||
      (c == 0xf0 && p[1] < 0x90) || (c == 0xf4 && p[1] > 0x8f))
    return 0;
  return k;
}

/* Reads a string (the opening quote next, after white space). Its decoded
 * bytes go to buf (cap bytes with the NUL; buf NULL: nowhere); *n gets its
 * whole decoded length (which may exceed cap - 1: the caller judges) and
 * *nul whether it holds a U+0000. Lone surrogates become U+FFFD, as
 * Python's json would keep them and no UTF-8 can. */
static int jstring(jp *j, char *buf, size_t cap, size_t *n, int *nul) {
  int err = take(j, '"');
  if (err < 0)
    return err;
  *n = 0;
  *nul = 0;
  for (;;) {
    if (j->p >= j->end)
      return jfail(j, "a string runs past the manifest's end");
    unsigned char c = *j->p;
    if (c == '"') {
      j->p++;
      break;
    }
    if (c < 0x20)
      return jfail(j, "a control character (0x%02x) in a string", c);
    if (c == '\\') {
      if (j->end - j->p < 2)
        return jfail(j, "an escape cut short");
      unsigned char e = j->p[1];
      j->p += 2;
      static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
      const char *at = e != '\0' ? strchr(from, e) : NULL;
      if (at != NULL) {
        put_utf8(buf, cap, n, (unsigned char)to[at - from]);
        continue;
      }
      if (e != 'u') {
        j->p--;
        return jfail(j, "an unknown escape '\\%c'", e);
      }
      unsigned cp;
      if ((err = hex4(j, &cp)) < 0)
        return err;
      if (cp >= 0xd800 && cp <= 0xdbff) {
        unsigned lo;
        if (j->end - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u') {
          const unsigned char *save = j->p;
          j->p += 2;
          if ((err = hex4(j, &lo)) < 0)
            return err;
          if (lo >= 0xdc00 && lo <= 0xdfff)
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          else {
            j->p = save; /* not its pair: read on its own */
            cp = 0xfffd;
          }
        } else {
          cp = 0xfffd;
        }
      } else if (cp >= 0xdc00 && cp <= 0xdfff) {
        cp = 0xfffd;
      }
      if (cp == 0)
        *nul = 1;
      put_utf8(buf, cap, n, cp);
      continue;
    }
    size_t k = 1;
    if (c >= 0x80 && (k = utf8_len(j->p, j->end)) == 0)
      return jfail(j, "a string that is not UTF-8 (byte 0x%02x)", c);
    for (size_t i = 0; i < k; i++, (*n)++)
      if (buf != NULL && *n + 1 < cap)
        buf[*n] = (char)j->p[i];
    j->p += k;
  }
  if (buf != NULL && cap > 0)
    buf[*n < cap ? *n : cap - 1] = '\0';
  return 0;
}

/* Reads a JSON number that must be an integer within int64. */
static int jint(jp *j, const char *what, int64_t *out) {
  ws(j);
  const unsigned char *s = j->p;
  int neg = j->p < j->end && *j->p == '-';
  if (neg)
    j->p++;
  if (j->p >= j->end || *j->p < '0' || *j->p > '9')
    return jfail(j, "%s: not an integer", what);
  uint64_t v = 0;
  const uint64_t lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    unsigned d = (unsigned)(*j->p - '0');
    if (v > (lim - d) / 10) {
      j->p = s;
      return jfail(j, "%s: past int64", what);
    }
    v = v * 10 + d;
    j->p++;
    if (v == 0 && j->p < j->end && *j->p >= '0' && *j->p <= '9')
      return jfail(j, "%s: a leading zero", what);
  }
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
    return jfail(j, "%s: not an integer", what);
  *out = neg ? (v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v)
             : (int64_t)v;
  return 0;
}

static int jint_nonneg(jp *j, const char *what, int64_t *out) {
  const unsigned char *s = j->p;
  int err = jint(j, what, out);
  if (err == 0 && *out < 0) {
    j->p = s;
    ws(j);
    return jfail(j, "%s: %" PRId64 " is negative", what, *out);
  }
  return err;
}

/* Skips any value, nested at most JSON_DEPTH_MAX deep. */
static int jskip(jp *j, int depth) {
  int err;
  size_t n;
  int nul;
  if (depth > JSON_DEPTH_MAX)
    return jfail(j, "nested more than %d deep", JSON_DEPTH_MAX);
  ws(j);
  if (j->p >= j->end)
    return jfail(j, "the manifest ends where a value was due");
  unsigned char c = *j->p;
  if (c == '{' || c == '[') {
    j->p++;
    char close = c == '{' ? '}' : ']';
    if (maybe(j, close))
      return 0;
    do {
      if (c == '{' && ((err = jstring(j, NULL, 0, &n, &nul)) < 0 ||
                       (err = take(j, ':')) < 0))
        return err;
      if ((err = jskip(j, depth + 1)) < 0)
        return err;
    } while (maybe(j, ','));
    return take(j, close);
  }
  if (c == '"')
    return jstring(j, NULL, 0, &n, &nul);
  static const char *const words[] = {"true", "false", "null"};
  for (int i = 0; i < 3; i++) {
    size_t k = strlen(words[i]);
    if ((size_t)(j->end - j->p) >= k && memcmp(j->p, words[i], k) == 0) {
      j->p += k;
      return 0;
    }
  }
  if (c == '-' || (c >= '0' && c <= '9')) { /* JSON's number grammar */
    const unsigned char *s = j->p;
    if (*j->p == '-')
      j->p++;
    size_t digits = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9')
      j->p++, digits++;
    if (digits == 0 || (digits > 1 && s[*s == '-'] == '0')) {
      j->p = s;
      return jfail(j, "a malformed number");
    }
    if (j->p < j->end && *j->p == '.') {
      j->p++;
      for (digits = 0; j->p < j->end && *j->p >= '0' && *j->p <= '9'; j->p++)
        digits++;
      if (digits == 0)
        return jfail(j, "a malformed number");
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
      j->p++;
      if (j->p < j->end && (*j->p == '+' || *j->p == '-'))
        j->p++;
      for (digits = 0; j->p < j->end && *j->p >= '0' && *j->p <= '9'; j->p++)
        digits++;
      if (digits == 0)
        return jfail(j, "a malformed number");
    }
    return 0;
  }
  return jfail(j, "'%c' where a value was due", c);
}

/* Reads an object's key into key (cap bytes); a longer one is read whole
 * and left as "" (no field of ours is long). */
static int jkey(jp *j, char *key, size_t cap) {
  size_t n;
  int nul;
  int err = jstring(j, key, cap, &n, &nul);
  if (err == 0 && (n >= cap || nul))
    key[0] = '\0';
  return err < 0 ? err : take(j, ':');
}

/* Reads an array of at most TD_MAX_DIMS non-negative integers. */
static int jdims(jp *j, const char *what, int64_t *out, int32_t *n) {
  int err = take(j, '[');
  if (err < 0)
    return err;
  *n = 0;
  if (maybe(j, ']'))
    return 0;
  do {
    if (*n == TD_MAX_DIMS)
      return jfail(j, "%s: more than %d dims", what, TD_MAX_DIMS);
    if ((err = jint_nonneg(j, what, &out[*n])) < 0)
      return err;
    (*n)++;
  } while (maybe(j, ','));
  return take(j, ']');
}

/* ---- the manifest ---- */

static int read_regions(jp *j, td__statedict *sd) {
  size_t cap = 0;
  int err = take(j, '[');
  if (err < 0)
    return err;
  if (maybe(j, ']'))
    return 0;
  do {
    if (sd->nregions == TD__SD_REGIONS_MAX)
      return jfail(j, "more than %u regions", TD__SD_REGIONS_MAX);
    if (sd->nregions == cap) {
      cap = cap ? cap * 2 : 16;
      td__sd_region *r = realloc(sd->regions, cap * sizeof(*r));
      if (r == NULL)
        return td__msg(j->msg, j->len, TD_ENOMEM, "out of memory");
      sd->regions = r;
    }
    td__sd_region *r = &sd->regions[sd->nregions];
    int64_t off = -1, nb = -1;
    if ((err = take(j, '{')) < 0)
      return err;
    if (!maybe(j, '}')) {
      do {
        char key[16];
        if ((err = jkey(j, key, sizeof(key))) < 0)
          return err;
        int64_t *to = strcmp(key, "offset") == 0   ? &off
                      : strcmp(key, "nbytes") == 0 ? &nb
                                                   : NULL;
        if (to != NULL && *to >= 0)
          return jfail(j, "region %zu: '%s' twice", sd->nregions, key);
        err = to != NULL ? jint_nonneg(j, key, to) : jskip(j, 2);
        if (err < 0)
          return err;
      } while (maybe(j, ','));
      if ((err = take(j, '}')) < 0)
        return err;
    }
    if (off < 0 || nb < 0)
      return jfail(j, "region %zu has no '%s'", sd->nregions,
                   off < 0 ? "offset" : "nbytes");
    r->offset = (uint64_t)off;
    r->nbytes = (uint64_t)nb;
    sd->nregions++;
  } while (maybe(j, ','));
  return take(j, ']');
}

enum { F_DTYPE = 1, F_SHAPE = 2, F_STRIDE = 4, F_OFFSET = 8, F_REGION = 16 };

/* Reads one tensor's entry (its name read already) into t. */
static int read_entry(jp *j, td__sd_tensor *t) {
  int err, seen = 0;
  int32_t nstride = 0;
  if ((err = take(j, '{')) < 0)
    return err;
  if (!maybe(j, '}')) {
    do {
      char key[24];
      if ((err = jkey(j, key, sizeof(key))) < 0)
        return err;
      int f = strcmp(key, "dtype") == 0            ? F_DTYPE
              : strcmp(key, "shape") == 0          ? F_SHAPE
              : strcmp(key, "stride") == 0         ? F_STRIDE
              : strcmp(key, "storage_offset") == 0 ? F_OFFSET
              : strcmp(key, "region") == 0         ? F_REGION
                                                   : 0;
      if (f & seen)
        return jfail(j, "'%s' twice", key);
      seen |= f;
      int64_t v;
      size_t n;
      int nul;
      switch (f) {
      case F_DTYPE:
        err = jstring(j, t->dtype_name, sizeof(t->dtype_name), &n, &nul);
        if (err == 0 && (n > TD__SD_DTYPE_MAX || nul || n == 0))
          return jfail(j, "a dtype name of %zu bytes", n);
        break;
      case F_SHAPE:
        err = jdims(j, "shape", t->shape, &t->ndim);
        break;
      case F_STRIDE:
        err = jdims(j, "stride", t->stride, &nstride);
        break;
      case F_OFFSET:
        err = jint_nonneg(j, "storage_offset", &t->storage_offset);
        break;
      case F_REGION:
        if ((err = jint_nonneg(j, "region", &v)) == 0 &&
            v >= TD__SD_REGIONS_MAX)
          return jfail(j, "region %" PRId64 ": there are at most %u", v,
                       TD__SD_REGIONS_MAX);
        t->region = (uint32_t)v;
        break;
      default:
        err = jskip(j, 3);
      }
      if (err < 0)
        return err;
    } while (maybe(j, ','));
    if ((err = take(j, '}')) < 0)
      return err;
  }
  static const char *const names[] = {"dtype", "shape", "stride",
                                      "storage_offset", "region"};
  for (int i = 0; i < 5; i++)
    if (!(seen & (1 << i)))
      return jfail(j, "no '%s'", names[i]);
  if (nstride != t->ndim)
    return jfail(j, "%d strides for %d dims", (int)nstride, (int)t->ndim);
  return 0;
}

static int read_tensors(jp *j, td__statedict *sd) {
  size_t cap = 0;
  int err = take(j, '{');
  if (err < 0)
    return err;
  if (maybe(j, '}'))
    return 0;
  char *name = malloc(TD__SD_NAME_MAX + 1);
  if (name == NULL)
    return td__msg(j->msg, j->len, TD_ENOMEM, "out of memory");
  do {
    if (sd->ntensors == TD__SD_TENSORS_MAX) {
      err = jfail(j, "more than %u tensors", TD__SD_TENSORS_MAX);
      break;
    }
    if (sd->ntensors == cap) {
      cap = cap ? cap * 2 : 16;
      td__sd_tensor *t = realloc(sd->tensors, cap * sizeof(*t));
      if (t == NULL) {
        err = td__msg(j->msg, j->len, TD_ENOMEM, "out of memory");
        break;
      }
      sd->tensors = t;
    }
    size_t n;
    int nul;
    if ((err = jstring(j, name, TD__SD_NAME_MAX + 1, &n, &nul)) < 0)
      break;
    if (n > TD__SD_NAME_MAX || nul) {
      err = jfail(j, "a tensor name %s",
                  nul ? "with a NUL in it" : "of more than 4096 bytes");
      break;
    }
    td__sd_tensor *t = &sd->tensors[sd->ntensors];
    memset(t, 0, sizeof(*t));
    if ((t->name = strdup(name)) == NULL) {
      err = td__msg(j->msg, j->len, TD_ENOMEM, "out of memory");
      break;
    }
    sd->ntensors++; /* freed with sd from here */
    if ((err = take(j, ':')) < 0 || (err = read_entry(j, t)) < 0) {
      char why[TD__ERRMSG_MAX], shown[96];
      snprintf(why, sizeof(why), "%s", j->msg);
      td__cli_printable(t->name, shown, sizeof(shown));
      err = td__msg(j->msg, j->len, err, "tensor '%s': %s", shown, why);
      break;
    }
  } while (maybe(j, ','));
  free(name);
  return err < 0 ? err : take(j, '}');
}

/* torch dtypes tensord has no td_dtype for, with their element sizes, so
 * that their bytes can be listed and checked. */
static size_t foreign_itemsize(const char *name) {
  static const struct {
    const char *name;
    size_t size;
  } known[] = {{"complex32", 4}, {"quint8", 1},   {"qint8", 1},
               {"qint32", 4},    {"quint4x2", 1}, {"quint2x4", 1}};
  for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
    if (strcmp(name, known[i].name) == 0)
      return known[i].size;
  return 0;
}

/* A dtype of the same size, for checking extents of foreign dtypes. */
static td_dtype proxy_of(size_t size) {
  return size == 1   ? TD_UINT8
         : size == 2 ? TD_INT16
         : size == 4 ? TD_INT32
         : size == 8 ? TD_INT64
                     : TD_DTYPE_INVALID;
}

static int by_name(const void *a, const void *b) {
  const td__sd_tensor *const *x = a, *const *y = b;
  return strcmp((*x)->name, (*y)->name);
}

/* Checks what the JSON alone could not: regions inside the blob, tensors
 * inside their regions, names unique. */
static int check(td__statedict *sd, size_t n, char *msg, size_t len) {
  for (size_t i = 0; i < sd->nregions; i++) {
    const td__sd_region *r = &sd->regions[i];
    if (r->offset > n || r->nbytes > n - r->offset)
      return td__msg(msg, len, TD_EINVAL,
                     "region %zu (bytes %" PRIu64 " + %" PRIu64
                     ") reaches past the blob's %zu bytes",
                     i, r->offset, r->nbytes, n);
  }
  for (size_t i = 0; i < sd->ntensors; i++) {
    td__sd_tensor *t = &sd->tensors[i];
    char shown[96], why[TD__ERRMSG_MAX];
    td__cli_printable(t->name, shown, sizeof(shown));
    if (t->region >= sd->nregions)
      return td__msg(msg, len, TD_EINVAL,
                     "tensor '%s': region %u, of %zu regions", shown, t->region,
                     sd->nregions);
    td_dtype dt = TD_DTYPE_INVALID;
    for (int d = 1; d < TD_DTYPE_COUNT_; d++)
      if (strcmp(t->dtype_name, td_dtype_name((td_dtype)d)) == 0)
        dt = (td_dtype)d;
    t->dtype = dt;
    t->itemsize = dt != TD_DTYPE_INVALID ? td_dtype_size(dt)
                                         : foreign_itemsize(t->dtype_name);
    if (t->itemsize == 0) {
      /* A dtype no one here knows the size of: listed, never read. */
      for (const char *p = t->dtype_name; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') ||
              *p == '_'))
          return td__msg(msg, len, TD_EINVAL, "tensor '%s': dtype '%.*s'",
                         shown, TD__SD_DTYPE_MAX, t->dtype_name);
      t->numel = 1;
      for (int32_t d = 0; d < t->ndim; d++)
        if (__builtin_mul_overflow(t->numel, t->shape[d], &t->numel))
          return td__msg(msg, len, TD_EINVAL,
                         "tensor '%s': more than 2^63 elements", shown);
      continue;
    }
    /* As load_state_dict takes it: the region cut to whole elements, the
     * view as_strided over it. */
    const td__sd_region *r = &sd->regions[t->region];
    td_view v = {.dtype = dt != TD_DTYPE_INVALID ? dt : proxy_of(t->itemsize),
                 .ndim = t->ndim,
                 .offset = t->storage_offset};
    memcpy(v.shape, t->shape, sizeof(v.shape));
    memcpy(v.stride, t->stride, sizeof(v.stride));
    uint64_t whole = r->nbytes / t->itemsize * t->itemsize;
    if (td__view_check_msg(&v, (size_t)whole, why, sizeof(why)) < 0)
      return td__msg(msg, len, TD_EINVAL,
                     "tensor '%s': %s view of region %u (%" PRIu64
                     " bytes): %s",
                     shown, t->dtype_name, t->region, r->nbytes, why);
    t->numel = td_view_numel(&v);
    if (__builtin_mul_overflow((uint64_t)t->numel, (uint64_t)t->itemsize,
                               &t->nbytes))
      return td__msg(msg, len, TD_EINVAL,
                     "tensor '%s': its bytes overflow 64 bits", shown);
  }
  if (sd->ntensors > 1) {
    const td__sd_tensor **order = malloc(sd->ntensors * sizeof(*order));
    if (order == NULL)
      return td__msg(msg, len, TD_ENOMEM, "out of memory");
    for (size_t i = 0; i < sd->ntensors; i++)
      order[i] = &sd->tensors[i];
    qsort(order, sd->ntensors, sizeof(*order), by_name);
    for (size_t i = 1; i < sd->ntensors; i++)
      if (strcmp(order[i - 1]->name, order[i]->name) == 0) {
        char shown[96];
        td__cli_printable(order[i]->name, shown, sizeof(shown));
        free(order);
        return td__msg(msg, len, TD_EINVAL, "tensor '%s' is listed twice",
                       shown);
      }
    free(order);
  }
  return 0;
}

int td__statedict_parse(const void *p, size_t n, td__statedict *sd, char *msg,
                        size_t len) {
  memset(sd, 0, sizeof(*sd));
  const unsigned char *b = p;
  if (!td__statedict_is(p, n))
    return td__msg(msg, len, TD_EINVAL,
                   "no state dict: %zu bytes that do not begin with '%s'", n,
                   TD__SD_MAGIC);
  uint64_t ml = 0;
  for (int i = 7; i >= 0; i--)
    ml = ml << 8 | b[8 + i];
  if (ml > n - TD__SD_HEADER)
    return td__msg(msg, len, TD_EINVAL,
                   "a manifest of %" PRIu64 " bytes in a blob of %zu", ml, n);
  if (ml > TD__SD_MANIFEST_MAX)
    return td__msg(msg, len, TD_EINVAL,
                   "a manifest of %" PRIu64 " bytes (at most %" PRIu64
                   " are read)",
                   ml, TD__SD_MANIFEST_MAX);
  sd->manifest_len = ml;
  jp j = {b + TD__SD_HEADER, b + TD__SD_HEADER, b + TD__SD_HEADER + ml, msg,
          len};
  int err = take(&j, '{'), got = 0;
  if (err == 0 && !maybe(&j, '}')) {
    do {
      char key[16];
      if ((err = jkey(&j, key, sizeof(key))) < 0)
        break;
      int which = strcmp(key, "tensors") == 0   ? 1
                  : strcmp(key, "regions") == 0 ? 2
                                                : 0;
      if (which & got) {
        err = jfail(&j, "'%s' twice", key);
        break;
      }
      got |= which;
      err = which == 1   ? read_tensors(&j, sd)
            : which == 2 ? read_regions(&j, sd)
                         : jskip(&j, 1);
      if (err < 0)
        break;
    } while (maybe(&j, ','));
    if (err == 0)
      err = take(&j, '}');
  }
  if (err == 0) {
    ws(&j);
    if (j.p != j.end)
      err = jfail(&j, "bytes after the manifest's end");
    else if (got != 3)
      err = td__msg(msg, len, TD_EINVAL, "the manifest has no '%s'",
                    got & 1 ? "regions" : "tensors");
    else
      err = check(sd, n, msg, len);
  }
  if (err < 0)
    td__statedict_free(sd);
  return err;
}

void td__statedict_free(td__statedict *sd) {
  if (sd == NULL)
    return;
  for (size_t i = 0; i < sd->ntensors; i++)
    free(sd->tensors[i].name);
  free(sd->tensors);
  free(sd->regions);
  memset(sd, 0, sizeof(*sd));
}

const td__sd_tensor *td__statedict_find(const td__statedict *sd,
                                        const char *name) {
  for (size_t i = 0; i < sd->ntensors; i++)
    if (strcmp(sd->tensors[i].name, name) == 0)
      return &sd->tensors[i];
  return NULL;
}

int td__statedict_view(const td__statedict *sd, const td__sd_tensor *t,
                       uint64_t blob_off, td_view *v, char *msg, size_t len) {
  char shown[96];
  td__cli_printable(t->name, shown, sizeof(shown));
  if (t->dtype == TD_DTYPE_INVALID)
    return td__msg(msg, len, TD_EINVAL,
                   "tensor '%s' is %s, a dtype tensord does not read", shown,
                   t->dtype_name);
  const td__sd_region *r = &sd->regions[t->region];
  uint64_t start;
  if (__builtin_add_overflow(blob_off, r->offset, &start) ||
      start % t->itemsize != 0 || start / t->itemsize > INT64_MAX)
    return td__msg(msg, len, TD_EINVAL,
                   "tensor '%s': its region %u starts at byte %" PRIu64
                   " of the storage, not a multiple of %s's %zu bytes",
                   shown, t->region, blob_off + r->offset, t->dtype_name,
                   t->itemsize);
  td_view out = {.dtype = t->dtype, .ndim = t->ndim};
  memcpy(out.shape, t->shape, sizeof(out.shape));
  memcpy(out.stride, t->stride, sizeof(out.stride));
  if (__builtin_add_overflow((int64_t)(start / t->itemsize), t->storage_offset,
                             &out.offset))
    return td__msg(msg, len, TD_EINVAL, "tensor '%s': offset past int64",
                   shown);
  *v = out;
  return 0;
}

/* ---- listings ---- */

/* "[16, 8]" into buf. */
static char *shape_text(const td__sd_tensor *t, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int32_t d = 0; d < t->ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%" PRId64,
                             d ? ", " : "", t->shape[d]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
  return buf;
}

/* Characters (UTF-8 code points) of s: what a column of it takes, but for
 * the rare wide ones. */
static int width(const char *s) {
  int n = 0;
  for (; *s; s++)
    n += ((unsigned char)*s & 0xc0) != 0x80;
  return n;
}

void td__statedict_print_text(const td__statedict *sd, const char *indent) {
  int wn = 4, wd = 5, ws_ = 5; /* NAME, DTYPE, SHAPE */
  char sh[400], name[TD__SD_NAME_MAX + 1], size[32];
  for (size_t i = 0; i < sd->ntensors; i++) {
    const td__sd_tensor *t = &sd->tensors[i];
    int n = width(t->name);
    wn = n > wn ? (n < 48 ? n : 48) : wn;
    n = (int)strlen(t->dtype_name);
    wd = n > wd ? n : wd;
    n = (int)strlen(shape_text(t, sh, sizeof(sh)));
    ws_ = n > ws_ ? (n < 32 ? n : 32) : ws_;
  }
  printf("%s%-*s  %-*s  %-*s  %s\n", indent, wn, "NAME", wd, "DTYPE", ws_,
         "SHAPE", "BYTES");
  for (size_t i = 0; i < sd->ntensors; i++) {
    const td__sd_tensor *t = &sd->tensors[i];
    td__cli_printable(t->name, name, sizeof(name));
    int pad = wn - width(name);
    printf("%s%s%*s  %-*s  %-*s  %s\n", indent, name, pad > 0 ? pad : 0, "", wd,
           t->dtype_name, ws_, shape_text(t, sh, sizeof(sh)),
           t->itemsize ? td__human_bytes(t->nbytes, size, sizeof(size)) : "?");
  }
}

void td__statedict_print_json(const td__statedict *sd) {
  printf("{\"tensors\":[");
  for (size_t i = 0; i < sd->ntensors; i++) {
    const td__sd_tensor *t = &sd->tensors[i];
    printf("%s{\"name\":", i ? "," : "");
    td__cli_json_str(t->name);
    printf(",\"dtype\":");
    td__cli_json_str(t->dtype_name);
    printf(",\"shape\":[");
    for (int32_t d = 0; d < t->ndim; d++)
      printf("%s%" PRId64, d ? "," : "", t->shape[d]);
    printf("],\"stride\":[");
    for (int32_t d = 0; d < t->ndim; d++)
      printf("%s%" PRId64, d ? "," : "", t->stride[d]);
    printf("],\"storage_offset\":%" PRId64 ",\"region\":%u,\"nbytes\":",
           t->storage_offset, t->region);
    if (t->itemsize)
      printf("%" PRIu64 "}", t->nbytes);
    else
      printf("null}");
  }
  printf("],\"regions\":[");
  for (size_t i = 0; i < sd->nregions; i++)
    printf("%s{\"offset\":%" PRIu64 ",\"nbytes\":%" PRIu64 "}", i ? "," : "",
           sd->regions[i].offset, sd->regions[i].nbytes);
  printf("]}");
}

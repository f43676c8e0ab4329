/* statedict.c: the packed state dicts of tensord.torch.publish_state_dict,
 * parsed defensively from a storage's bytes (the manifest with jansson) for
 * td_model_save and the public td_state_dict_* (tensorctl info and show). */
#include "statedict.h"

#include "internal.h"

#include <inttypes.h>
#include "jsonmem.h"

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

/* ---- the manifest, as jansson parses it ---- */

size_t td__sd_tree_max = TD__SD_TREE_MAX;

#define kind td__json_kind

/* Sets *out to v, which must be an integer of at least 0 (not a real, not
 * a boolean). Messages begin with where (the tensor or region, "" for
 * none) and what (the field). */
static int count(const json_t *v, const char *where, const char *what,
                 int64_t *out, char *msg, size_t len) {
  if (!json_is_integer(v))
    return td__msg(msg, len, TD_EINVAL, "%s%s: not an integer (%s)", where,
                   what, kind(v));
  json_int_t i = json_integer_value(v);
  if (i < 0)
    return td__msg(msg, len, TD_EINVAL,
                   "%s%s: %" JSON_INTEGER_FORMAT " is negative", where, what,
                   i);
  *out = (int64_t)i;
  return 0;
}

/* Reads an array of at most TD_MAX_DIMS counts into out, and *n. */
static int dims(const json_t *a, const char *where, const char *what,
                int64_t *out, int32_t *n, char *msg, size_t len) {
  if (!json_is_array(a))
    return td__msg(msg, len, TD_EINVAL, "%s%s: not an array (%s)", where, what,
                   kind(a));
  size_t k = json_array_size(a);
  if (k > TD_MAX_DIMS)
    return td__msg(msg, len, TD_EINVAL, "%s%s: more than %d dims (%zu)", where,
                   what, TD_MAX_DIMS, k);
  for (size_t i = 0; i < k; i++) {
    int err = count(json_array_get(a, i), where, what, &out[i], msg, len);
    if (err < 0)
      return err;
  }
  *n = (int32_t)k;
  return 0;
}

static int read_regions(const json_t *a, td__statedict *sd, char *msg,
                        size_t len) {
  if (!json_is_array(a))
    return td__msg(msg, len, TD_EINVAL, "'regions': not an array (%s)",
                   kind(a));
  size_t n = json_array_size(a);
  if (n > TD__SD_REGIONS_MAX)
    return td__msg(msg, len, TD_EINVAL, "more than %u regions (%zu)",
                   TD__SD_REGIONS_MAX, n);
  if (n > 0 && (sd->regions = calloc(n, sizeof(*sd->regions))) == NULL)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++) {
    const json_t *r = json_array_get(a, i);
    char where[32];
    snprintf(where, sizeof(where), "region %zu: ", i);
    if (!json_is_object(r))
      return td__msg(msg, len, TD_EINVAL, "%snot an object (%s)", where,
                     kind(r));
    const json_t *dev = json_object_get(r, "device");
    if (dev != NULL &&
        !(json_is_string(dev) && strcmp(json_string_value(dev), "cpu") == 0)) {
      const json_t *k = json_object_get(r, "key");
      return td__msg(msg, len, TD_ENODEV,
                     "region %zu lies on a GPU, in a storage of its own "
                     "(key '%s'): only tensord.torch.load_state_dict reads "
                     "GPU regions",
                     i, json_is_string(k) ? json_string_value(k) : "?");
    }
    const json_t *off = json_object_get(r, "offset");
    const json_t *nb = json_object_get(r, "nbytes");
    if (off == NULL || nb == NULL)
      return td__msg(msg, len, TD_EINVAL, "region %zu has no '%s'", i,
                     off == NULL ? "offset" : "nbytes");
    int64_t o = 0, b = 0; /* set by count() on success */
    int err;
    if ((err = count(off, where, "offset", &o, msg, len)) < 0 ||
        (err = count(nb, where, "nbytes", &b, msg, len)) < 0)
      return err;
    sd->regions[i] = (td__sd_region){(uint64_t)o, (uint64_t)b};
    sd->nregions++;
  }
  return 0;
}

/* Reads one tensor's entry e into t; where names the tensor. */
static int read_entry(const json_t *e, td__sd_tensor *t, const char *where,
                      char *msg, size_t len) {
  static const char *const names[] = {"dtype", "shape", "stride",
                                      "storage_offset", "region"};
  const json_t *f[5];
  if (!json_is_object(e))
    return td__msg(msg, len, TD_EINVAL, "%snot an object (%s)", where, kind(e));
  for (int i = 0; i < 5; i++)
    if ((f[i] = json_object_get(e, names[i])) == NULL)
      return td__msg(msg, len, TD_EINVAL, "%sno '%s'", where, names[i]);
  if (!json_is_string(f[0]))
    return td__msg(msg, len, TD_EINVAL, "%sdtype: not a string (%s)", where,
                   kind(f[0]));
  /* jansson refuses a NUL in a string (no JSON_ALLOW_NUL). */
  size_t dl = json_string_length(f[0]);
  if (dl == 0 || dl > TD__SD_DTYPE_MAX)
    return td__msg(msg, len, TD_EINVAL, "%sa dtype name of %zu bytes", where,
                   dl);
  memcpy(t->dtype_name, json_string_value(f[0]), dl);
  t->dtype_name[dl] = '\0';
  int32_t nstride = 0;
  int64_t region = 0;
  int err;
  if ((err = dims(f[1], where, "shape", t->shape, &t->ndim, msg, len)) < 0 ||
      (err = dims(f[2], where, "stride", t->stride, &nstride, msg, len)) < 0 ||
      (err = count(f[3], where, "storage_offset", &t->storage_offset, msg,
                   len)) < 0 ||
      (err = count(f[4], where, "region", &region, msg, len)) < 0)
    return err;
  if (region >= TD__SD_REGIONS_MAX)
    return td__msg(msg, len, TD_EINVAL,
                   "%sregion %" PRId64 ": there are at most %u", where, region,
                   TD__SD_REGIONS_MAX);
  t->region = (uint32_t)region;
  if (nstride != t->ndim)
    return td__msg(msg, len, TD_EINVAL, "%s%d strides for %d dims", where,
                   (int)nstride, (int)t->ndim);
  return 0;
}

/* Reads the tensors, in the manifest's order (jansson keeps it). Their
 * names are unique: the manifest's keys are, with JSON_REJECT_DUPLICATES,
 * and hold no NUL. */
static int read_tensors(json_t *o, td__statedict *sd, char *msg, size_t len) {
  if (!json_is_object(o))
    return td__msg(msg, len, TD_EINVAL, "'tensors': not an object (%s)",
                   kind(o));
  size_t n = json_object_size(o);
  if (n > TD__SD_TENSORS_MAX)
    return td__msg(msg, len, TD_EINVAL, "more than %u tensors (%zu)",
                   TD__SD_TENSORS_MAX, n);
  if (n > 0 && (sd->tensors = calloc(n, sizeof(*sd->tensors))) == NULL)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  const char *name;
  json_t *e;
  json_object_foreach(o, name, e) {
    size_t nl = strlen(name);
    if (nl > TD__SD_NAME_MAX)
      return td__msg(msg, len, TD_EINVAL,
                     "a tensor name of more than %d bytes (%zu)",
                     TD__SD_NAME_MAX, nl);
    td__sd_tensor *t = &sd->tensors[sd->ntensors];
    if ((t->name = strdup(name)) == NULL)
      return td__msg(msg, len, TD_ENOMEM, "out of memory");
    sd->ntensors++; /* freed with sd from here */
    char shown[96], where[128];
    td__printable(name, shown, sizeof(shown));
    snprintf(where, sizeof(where), "tensor '%s': ", shown);
    int err = read_entry(e, t, where, msg, len);
    if (err < 0)
      return err;
  }
  return 0;
}

/* Reads the manifest's tree into sd (unknown fields are skipped: a later
 * format may add some). */
static int read_manifest(json_t *root, td__statedict *sd, char *msg,
                         size_t len) {
  if (!json_is_object(root))
    return td__msg(msg, len, TD_EINVAL, "the manifest is %s, not an object",
                   kind(root));
  json_t *tensors = json_object_get(root, "tensors");
  json_t *regions = json_object_get(root, "regions");
  if (tensors == NULL || regions == NULL)
    return td__msg(msg, len, TD_EINVAL, "the manifest has no '%s'",
                   tensors == NULL ? "tensors" : "regions");
  int err = read_regions(regions, sd, msg, len);
  return err < 0 ? err : read_tensors(tensors, sd, msg, len);
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

/* Checks what the JSON alone could not: regions inside the blob, tensors
 * inside their regions. */
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
    td__printable(t->name, shown, sizeof(shown));
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
  /* Duplicate keys are refused, NUL in strings too (no JSON_ALLOW_NUL); so
   * are trailing bytes, bad UTF-8, integers past int64 and nesting past
   * JSON_PARSER_MAX_DEPTH (2048). */
  json_error_t e;
  int over;
  json_t *root =
      td__json_loadb_bounded((const char *)b + TD__SD_HEADER, (size_t)ml,
                             JSON_REJECT_DUPLICATES, td__sd_tree_max, &e, &over);
  int err;
  if (root != NULL)
    err = read_manifest(root, sd, msg, len);
  else if (over)
    err = td__msg(msg, len, TD_EINVAL,
                  "a manifest of %" PRIu64 " bytes whose JSON takes more "
                  "than %zu MiB to hold (at most that is spent on one)",
                  ml, td__sd_tree_max >> 20);
  else if (json_error_code(&e) == json_error_out_of_memory)
    err = td__msg(msg, len, TD_ENOMEM, "out of memory reading the manifest");
  else
    err = td__msg(msg, len, TD_EINVAL, "manifest byte %d: %s", e.position,
                  e.text);
  json_decref(root);
  if (err == 0)
    err = check(sd, n, msg, len);
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
  td__printable(t->name, shown, sizeof(shown));
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

/* ---- the public API (tensord.h): thin wrappers over the above ---- */

struct td_state_dict {
  td__statedict sd;
  uint64_t blob_off; /* the blob's first byte in its storage */
};

int td_state_dict_is(const td_storage *s, const td_view *v) {
  if (v == NULL || !td__statedict_blob_shaped(v))
    return 0;
  if (s == NULL)
    return 1;
  return td_storage_device(s) == TD_CPU &&
         td__view_check_msg(v, td_storage_nbytes(s), NULL, 0) == 0 &&
         td__statedict_is((const char *)td_storage_data(s) + v->offset,
                          (size_t)v->shape[0]);
}

int td_state_dict_parse(const td_storage *s, const td_view *v,
                        td_state_dict **out) {
  char msg[TD__ERRMSG_MAX], vb[512];
  int err;
  *out = NULL;
  if (s == NULL || v == NULL)
    return td__fail(NULL, TD_EINVAL, "state dict: storage or view is NULL");
  if (td_storage_device(s) != TD_CPU)
    return td__fail(NULL, TD_ENODEV,
                    "state dict: storage %" PRIu64 " is a GPU's",
                    td_storage_id(s));
  if ((err = td__view_check_msg(v, td_storage_nbytes(s), msg, sizeof(msg))) < 0)
    return td__fail(NULL, err, "state dict: %s", msg);
  if (!td__statedict_blob_shaped(v))
    return td__fail(NULL, TD_EINVAL,
                    "state dict: view %s is not a blob (one dense uint8 dim "
                    "of at least %d bytes)",
                    td_view_format(v, vb, sizeof(vb)), TD__SD_HEADER);
  td_state_dict *sd = calloc(1, sizeof(*sd));
  if (sd == NULL)
    return td__fail(NULL, TD_ENOMEM, "state dict: out of memory");
  err = td__statedict_parse((const char *)td_storage_data(s) + v->offset,
                            (size_t)v->shape[0], &sd->sd, msg, sizeof(msg));
  if (err < 0) {
    free(sd);
    return td__fail(NULL, err, "%s", msg);
  }
  sd->blob_off = (uint64_t)v->offset;
  *out = sd;
  return 0;
}

void td_state_dict_free(td_state_dict *sd) {
  if (sd == NULL)
    return;
  td__statedict_free(&sd->sd);
  free(sd);
}

size_t td_state_dict_count(const td_state_dict *sd) {
  return sd->sd.ntensors;
}

size_t td_state_dict_nregions(const td_state_dict *sd) {
  return sd->sd.nregions;
}

int td_state_dict_tensor(const td_state_dict *sd, size_t i,
                         td_state_dict_entry *out) {
  if (i >= sd->sd.ntensors)
    return td__fail(NULL, TD_ERANGE, "state dict: tensor %zu of %zu", i,
                    sd->sd.ntensors);
  const td__sd_tensor *t = &sd->sd.tensors[i];
  td_state_dict_entry e = {.name = t->name,
                           .dtype_name = t->dtype_name,
                           .dtype = t->dtype,
                           .ndim = t->ndim,
                           .storage_offset = t->storage_offset,
                           .region = t->region,
                           .itemsize = (uint32_t)t->itemsize,
                           .nbytes = t->nbytes};
  memcpy(e.shape, t->shape, sizeof(e.shape));
  memcpy(e.stride, t->stride, sizeof(e.stride));
  *out = e;
  return 0;
}

int td_state_dict_find(const td_state_dict *sd, const char *name, size_t *i) {
  char shown[96];
  const td__sd_tensor *t = td__statedict_find(&sd->sd, name);
  if (t == NULL)
    return td__fail(NULL, TD_ENOENT, "state dict: no tensor '%s'",
                    td__printable(name, shown, sizeof(shown)));
  *i = (size_t)(t - sd->sd.tensors);
  return 0;
}

int td_state_dict_region(const td_state_dict *sd, size_t i, uint64_t *offset,
                         uint64_t *nbytes) {
  if (i >= sd->sd.nregions)
    return td__fail(NULL, TD_ERANGE, "state dict: region %zu of %zu", i,
                    sd->sd.nregions);
  if (offset != NULL)
    *offset = sd->sd.regions[i].offset;
  if (nbytes != NULL)
    *nbytes = sd->sd.regions[i].nbytes;
  return 0;
}

int td_state_dict_view(const td_state_dict *sd, size_t i, td_view *v) {
  char msg[TD__ERRMSG_MAX];
  if (i >= sd->sd.ntensors)
    return td__fail(NULL, TD_ERANGE, "state dict: tensor %zu of %zu", i,
                    sd->sd.ntensors);
  int err = td__statedict_view(&sd->sd, &sd->sd.tensors[i], sd->blob_off, v,
                               msg, sizeof(msg));
  return err < 0 ? td__fail(NULL, err, "%s", msg) : 0;
}

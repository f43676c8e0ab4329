/* view.c: views (dtype, shape, strides, offset) over storages, checked so
 * that no view reaches a byte outside its storage, and the view algebra. */
#include "common.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* A failing view call records why in the error channel (errors.c). */
#define FAIL(...) td__fail(NULL, __VA_ARGS__)

/* Formats shape as "[2, 3]" into buf; returns buf. */
static char *fmt_shape(char *buf, size_t len, int32_t ndim,
                       const int64_t *shape) {
  size_t n = 0;
  buf[0] = '\0';
  for (int32_t i = 0; i <= ndim && n < len; i++) {
    int k = i == ndim ? snprintf(buf + n, len - n, "]")
                      : snprintf(buf + n, len - n, "%s%lld", i ? ", " : "[",
                                 (long long)shape[i]);
    n += k > 0 ? (size_t)k : 0;
  }
  return buf;
}

/* Sets *n to the number of elements of ndim sizes, each >= 0: 0 if any size
 * is 0, whatever the others, else their product. Returns 0, or -1 if that
 * product passes INT64_MAX; *n is then unchanged. */
static int count_elements(int32_t ndim, const int64_t *shape, int64_t *n) {
  int64_t all = 1;
  int over = 0;
  for (int32_t i = 0; i < ndim; i++) {
    if (shape[i] == 0) {
      *n = 0;
      return 0;
    }
    over |= __builtin_mul_overflow(all, shape[i], &all);
  }
  if (over)
    return -1;
  *n = all;
  return 0;
}

/* Returns 0 if a view of ndim sizes (each >= 0) has at most INT64_MAX
 * elements, else TD_EINVAL with the sizes in msg (if not NULL). */
static int count_fits(int32_t ndim, const int64_t *shape, char *msg,
                      size_t len) {
  int64_t n;
  if (count_elements(ndim, shape, &n) == 0)
    return 0;
  char sb[360];
  return td__msg(msg, len, TD_EINVAL,
                 "shape %s has more than INT64_MAX elements",
                 fmt_shape(sb, sizeof(sb), ndim, shape));
}

/* Returns 0 if v's fields are each in range and its element count fits
 * int64, else TD_EINVAL with the reason in msg (if not NULL). */
static int view_valid(const td_view *v, char *msg, size_t len) {
  if (td_dtype_size(v->dtype) == 0)
    return td__msg(msg, len, TD_EINVAL, "unknown dtype %d", (int)v->dtype);
  if (v->ndim < 0 || v->ndim > TD_MAX_DIMS)
    return td__msg(msg, len, TD_EINVAL, "ndim %d outside 0..%d", (int)v->ndim,
                   TD_MAX_DIMS);
  if (v->offset < 0)
    return td__msg(msg, len, TD_EINVAL, "negative offset %lld",
                   (long long)v->offset);
  for (int32_t i = 0; i < v->ndim; i++) {
    if (v->shape[i] < 0)
      return td__msg(msg, len, TD_EINVAL, "dim %d: negative size %lld", (int)i,
                     (long long)v->shape[i]);
    if (v->stride[i] < 0)
      return td__msg(msg, len, TD_EINVAL, "dim %d: negative stride %lld",
                     (int)i, (long long)v->stride[i]);
  }
  return count_fits(v->ndim, v->shape, msg, len);
}

const char *td_view_last_error(void) {
  return td__last_error(NULL);
}

int td__view_fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  td__vfail(NULL, err, fmt, ap);
  va_end(ap);
  return err;
}

/* Fills stride[0..ndim) with row-major strides for shape, each size 0
 * counted as 1 (what PyTorch gives an empty tensor). Returns 0, or -1 if a
 * stride overflows int64; stride is then partly written. */
static int dense_strides(int32_t ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;
  for (int32_t i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    if (i > 0 && __builtin_mul_overflow(s, shape[i] > 0 ? shape[i] : 1, &s))
      return -1;
  }
  return 0;
}

int td_view_contiguous(td_dtype dtype, int32_t ndim, const int64_t *shape,
                       td_view *out) {
  td_view v;
  memset(&v, 0, sizeof(v));
  v.dtype = dtype;
  v.ndim = ndim;
  if (td_dtype_size(dtype) == 0)
    return FAIL(TD_EINVAL, "contiguous: unknown dtype %d", (int)dtype);
  if (ndim < 0 || ndim > TD_MAX_DIMS)
    return FAIL(TD_EINVAL, "contiguous: ndim %d outside 0..%d", (int)ndim,
                TD_MAX_DIMS);
  if (ndim > 0 && shape == NULL)
    return FAIL(TD_EINVAL, "contiguous: shape is NULL for %d dims", (int)ndim);
  /* The product of the sizes, each 0 counted as 1: the outermost stride
   * and at least the element count. */
  int64_t all = 1, numel = 0, bytes;
  for (int32_t i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return FAIL(TD_EINVAL, "contiguous: dim %d: negative size %lld", (int)i,
                  (long long)shape[i]);
    if (__builtin_mul_overflow(all, shape[i] > 0 ? shape[i] : 1, &all))
      return FAIL(TD_EINVAL,
                  "contiguous: element count or stride overflows int64 "
                  "at dim %d of size %lld",
                  (int)i, (long long)shape[i]);
    v.shape[i] = shape[i];
  }
  count_elements(ndim, shape, &numel); /* <= all: fits */
  if (__builtin_mul_overflow(numel, (int64_t)td_dtype_size(dtype), &bytes))
    return FAIL(TD_EINVAL,
                "contiguous: %lld elements of %zu bytes pass INT64_MAX bytes",
                (long long)numel, td_dtype_size(dtype));
  dense_strides(ndim, shape, v.stride); /* cannot overflow: all fits */
  *out = v;
  return 0;
}

int64_t td_view_numel(const td_view *v) {
  char why[512];
  int err = view_valid(v, why, sizeof(why));
  if (err < 0)
    return FAIL(err, "numel: malformed view: %s", why);
  int64_t n = 0;
  count_elements(v->ndim, v->shape, &n); /* view_valid: fits */
  return n;
}

int td_view_check(const td_view *v, size_t nbytes) {
  char msg[TD__ERRMSG_MAX];
  int err = td__view_check_msg(v, nbytes, msg, sizeof(msg));
  return err < 0 ? td__fail(NULL, err, "%s", msg) : 0;
}

int td__view_check_msg(const td_view *v, size_t nbytes, char *msg, size_t len) {
  int err = view_valid(v, msg, len);
  if (err < 0)
    return err;
  int64_t itemsize = (int64_t)td_dtype_size(v->dtype);
  int64_t last = v->offset; /* element index of the farthest element */
  int empty = 0;
  for (int32_t i = 0; i < v->ndim; i++)
    if (v->shape[i] == 0)
      empty = 1;
  for (int32_t i = 0; i < v->ndim && !empty; i++) {
    int64_t span;
    if (__builtin_mul_overflow(v->shape[i] - 1, v->stride[i], &span) ||
        __builtin_add_overflow(last, span, &last))
      return td__msg(msg, len, TD_EINVAL,
                     "dim %d: size %lld times stride %lld overflows int64",
                     (int)i, (long long)v->shape[i], (long long)v->stride[i]);
  }
  /* An empty view touches no element; its start may sit at the end. */
  int64_t end;
  if (__builtin_add_overflow(last, empty ? 0 : 1, &end) ||
      __builtin_mul_overflow(end, itemsize, &end))
    return td__msg(msg, len, TD_EINVAL,
                   "extent of %lld elements of %lld bytes overflows int64",
                   (long long)last, (long long)itemsize);
#if SIZE_MAX < INT64_MAX
  if ((uint64_t)end > SIZE_MAX)
    return td__msg(msg, len, TD_EINVAL,
                   "extent of %lld bytes does not fit in size_t",
                   (long long)end);
#endif
  if ((uint64_t)end > (uint64_t)nbytes) {
    char vb[512];
    return td__msg(msg, len, TD_ERANGE,
                   "view %s reaches byte %lld of a storage of %zu bytes",
                   td_view_format(v, vb, sizeof(vb)), (long long)end, nbytes);
  }
  return 0;
}

char *td_view_format(const td_view *v, char *buf, size_t len) {
  size_t n = 0;
  const char *name = td_dtype_name(v->dtype);
#define OUT(...)                                                               \
  do {                                                                         \
    if (n < len) {                                                             \
      int k = snprintf(buf + n, len - n, __VA_ARGS__);                         \
      n += k > 0 ? (size_t)k : 0;                                              \
    }                                                                          \
  } while (0)
  if (len == 0)
    return buf;
  buf[0] = '\0';
  OUT("%s[", name ? name : "?");
  int32_t nd = v->ndim < 0 ? 0 : v->ndim > TD_MAX_DIMS ? TD_MAX_DIMS : v->ndim;
  for (int32_t i = 0; i < nd; i++)
    OUT("%s%lld", i ? ", " : "", (long long)v->shape[i]);
  OUT("] stride (");
  for (int32_t i = 0; i < nd; i++)
    OUT("%s%lld", i ? ", " : "", (long long)v->stride[i]);
  OUT(") offset %lld", (long long)v->offset);
#undef OUT
  return buf;
}

/* ---- the view algebra ---- */

/* Returns 0 if v is a well-formed view, else TD_EINVAL naming op. */
static int check_in(const td_view *v, const char *op) {
  if (v == NULL)
    return FAIL(TD_EINVAL, "%s: view is NULL", op);
  char why[512];
  int err = view_valid(v, why, sizeof(why));
  if (err < 0)
    return FAIL(err, "%s: malformed view: %s", op, why);
  return 0;
}

/* Maps dim (negative: from the end) into 0..n-1 for a view of ndim dims;
 * returns 0 or TD_EINVAL naming op. */
static int wrap_dim(const char *op, int32_t *dim, int32_t n, int32_t ndim) {
  if (n == 0)
    return FAIL(TD_EINVAL, "%s: a 0-d view has no dim %d", op, (int)*dim);
  if (*dim < -n || *dim >= n)
    return FAIL(TD_EINVAL,
                "%s: dim %d out of range for a %d-d view "
                "(expected %d..%d)",
                op, (int)*dim, (int)ndim, (int)-n, (int)(n - 1));
  if (*dim < 0)
    *dim += n;
  return 0;
}

/* Whether shape has a 0 in a dim other than skip. */
static int has_zero(const int64_t *shape, int32_t ndim, int32_t skip) {
  for (int32_t i = 0; i < ndim; i++)
    if (i != skip && shape[i] == 0)
      return 1;
  return 0;
}

/* Removes dim d of v, zeroing the slot it frees. */
static void drop_dim(td_view *v, int32_t d) {
  for (int32_t i = d; i + 1 < v->ndim; i++) {
    v->shape[i] = v->shape[i + 1];
    v->stride[i] = v->stride[i + 1];
  }
  v->ndim--;
  v->shape[v->ndim] = 0;
  v->stride[v->ndim] = 0;
}

/* The offset of a view that starts index elements into dim d of v and keeps
 * size elements there. An empty result keeps v's offset, so that it never
 * starts past the storage's end (PyTorch would move it; no element can tell).
 * Returns 0 or TD_EINVAL if the offset overflows. */
static int moved_offset(const td_view *v, const char *op, int32_t d,
                        int64_t index, int64_t size, int64_t *out) {
  int64_t off = v->offset, step;
  if (size > 0 && !has_zero(v->shape, v->ndim, d) &&
      (__builtin_mul_overflow(index, v->stride[d], &step) ||
       __builtin_add_overflow(off, step, &off)))
    return FAIL(TD_EINVAL,
                "%s: dim %d: offset %lld + %lld * stride %lld "
                "overflows int64",
                op, (int)d, (long long)v->offset, (long long)index,
                (long long)v->stride[d]);
  *out = off;
  return 0;
}

int td_view_is_contiguous(const td_view *v) {
  int err = check_in(v, "is_contiguous");
  if (err < 0)
    return err;
  if (has_zero(v->shape, v->ndim, -1))
    return 1;
  int64_t expected = 1;
  for (int32_t i = v->ndim - 1; i >= 0; i--) {
    if (v->shape[i] == 1)
      continue;
    if (v->stride[i] != expected)
      return 0;
    if (__builtin_mul_overflow(expected, v->shape[i], &expected))
      return 0;
  }
  return 1;
}

int td_view_transpose(td_view *v, int32_t d0, int32_t d1) {
  int err = check_in(v, "transpose");
  int32_t n = v != NULL && v->ndim > 0 ? v->ndim : 1;
  if (err < 0 || (err = wrap_dim("transpose", &d0, n, v->ndim)) < 0 ||
      (err = wrap_dim("transpose", &d1, n, v->ndim)) < 0)
    return err;
  if (v->ndim == 0 || d0 == d1)
    return 0;
  int64_t t = v->shape[d0];
  v->shape[d0] = v->shape[d1];
  v->shape[d1] = t;
  t = v->stride[d0];
  v->stride[d0] = v->stride[d1];
  v->stride[d1] = t;
  return 0;
}

int td_view_permute(td_view *v, const int32_t *dims) {
  int err = check_in(v, "permute");
  if (err < 0)
    return err;
  if (v->ndim > 0 && dims == NULL)
    return FAIL(TD_EINVAL, "permute: dims is NULL for a %d-d view",
                (int)v->ndim);
  int32_t at[TD_MAX_DIMS]; /* at[d]: where dim d was seen, or -1 */
  int32_t src[TD_MAX_DIMS];
  for (int32_t i = 0; i < v->ndim; i++)
    at[i] = -1;
  for (int32_t i = 0; i < v->ndim; i++) {
    int32_t d = dims[i];
    if ((err = wrap_dim("permute", &d, v->ndim, v->ndim)) < 0)
      return err;
    if (at[d] >= 0)
      return FAIL(TD_EINVAL,
                  "permute: dim %d appears twice (at positions %d "
                  "and %d)",
                  (int)d, (int)at[d], (int)i);
    at[d] = i;
    src[i] = d;
  }
  int64_t shape[TD_MAX_DIMS], stride[TD_MAX_DIMS];
  for (int32_t i = 0; i < v->ndim; i++) {
    shape[i] = v->shape[src[i]];
    stride[i] = v->stride[src[i]];
  }
  memcpy(v->shape, shape, (size_t)v->ndim * sizeof(int64_t));
  memcpy(v->stride, stride, (size_t)v->ndim * sizeof(int64_t));
  return 0;
}

int td_view_narrow(td_view *v, int32_t dim, int64_t start, int64_t len) {
  int err = check_in(v, "narrow");
  if (err < 0 || (err = wrap_dim("narrow", &dim, v->ndim, v->ndim)) < 0)
    return err;
  int64_t size = v->shape[dim];
  if (len < 0)
    return FAIL(TD_EINVAL, "narrow: dim %d: negative length %lld", (int)dim,
                (long long)len);
  if (start < -size || start > size)
    return FAIL(TD_ERANGE,
                "narrow: dim %d: start %lld outside %lld..%lld "
                "(the dim's size is %lld)",
                (int)dim, (long long)start, (long long)-size, (long long)size,
                (long long)size);
  if (start < 0)
    start += size;
  if (len > size - start)
    return FAIL(TD_ERANGE,
                "narrow: dim %d: start %lld + length %lld exceeds "
                "the dim's size %lld",
                (int)dim, (long long)start, (long long)len, (long long)size);
  int64_t off = 0;
  if ((err = moved_offset(v, "narrow", dim, start, len, &off)) < 0)
    return err;
  v->shape[dim] = len;
  v->offset = off;
  return 0;
}

int td_view_select(td_view *v, int32_t dim, int64_t index) {
  int err = check_in(v, "select");
  if (err < 0 || (err = wrap_dim("select", &dim, v->ndim, v->ndim)) < 0)
    return err;
  int64_t size = v->shape[dim];
  if (index < -size || index >= size)
    return FAIL(TD_ERANGE,
                "select: dim %d: index %lld out of range for "
                "size %lld",
                (int)dim, (long long)index, (long long)size);
  if (index < 0)
    index += size;
  int64_t off = 0;
  if ((err = moved_offset(v, "select", dim, index, 1, &off)) < 0)
    return err;
  v->offset = off;
  drop_dim(v, dim);
  return 0;
}

int td_view_slice(td_view *v, int32_t dim, int64_t start, int64_t stop,
                  int64_t step) {
  int err = check_in(v, "slice");
  if (err < 0 || (err = wrap_dim("slice", &dim, v->ndim, v->ndim)) < 0)
    return err;
  if (step < 1)
    return FAIL(TD_EINVAL, "slice: dim %d: step %lld (it must be 1 or more)",
                (int)dim, (long long)step);
  int64_t size = v->shape[dim];
  if (start < 0)
    start += size;
  if (stop < 0)
    stop += size;
  start = start < 0 ? 0 : start > size ? size : start;
  stop = stop < start ? start : stop > size ? size : stop;
  int64_t len = stop == start ? 0 : 1 + (stop - start - 1) / step;
  int64_t stride, off = 0;
  if (__builtin_mul_overflow(v->stride[dim], step, &stride))
    return FAIL(TD_EINVAL,
                "slice: dim %d: stride %lld times step %lld "
                "overflows int64",
                (int)dim, (long long)v->stride[dim], (long long)step);
  if ((err = moved_offset(v, "slice", dim, start, len, &off)) < 0)
    return err;
  v->shape[dim] = len;
  v->stride[dim] = stride;
  v->offset = off;
  return 0;
}

int td_view_unsqueeze(td_view *v, int32_t dim) {
  int err = check_in(v, "unsqueeze");
  if (err < 0 || (err = wrap_dim("unsqueeze", &dim, v->ndim + 1, v->ndim)) < 0)
    return err;
  if (v->ndim == TD_MAX_DIMS)
    return FAIL(TD_EINVAL,
                "unsqueeze: the view already has %d dims, the "
                "most a view may have",
                TD_MAX_DIMS);
  int64_t stride = 1;
  if (dim < v->ndim &&
      __builtin_mul_overflow(v->shape[dim], v->stride[dim], &stride))
    return FAIL(TD_EINVAL,
                "unsqueeze: dim %d: size %lld times stride %lld "
                "overflows int64",
                (int)dim, (long long)v->shape[dim], (long long)v->stride[dim]);
  for (int32_t i = v->ndim; i > dim; i--) {
    v->shape[i] = v->shape[i - 1];
    v->stride[i] = v->stride[i - 1];
  }
  v->shape[dim] = 1;
  v->stride[dim] = stride;
  v->ndim++;
  return 0;
}

int td_view_squeeze(td_view *v, int32_t dim) {
  int err = check_in(v, "squeeze");
  int32_t n = v != NULL && v->ndim > 0 ? v->ndim : 1;
  if (err < 0 || (err = wrap_dim("squeeze", &dim, n, v->ndim)) < 0)
    return err;
  if (v->ndim > 0 && v->shape[dim] == 1)
    drop_dim(v, dim);
  return 0;
}

int td_view_squeeze_all(td_view *v) {
  int err = check_in(v, "squeeze_all");
  if (err < 0)
    return err;
  for (int32_t i = v->ndim - 1; i >= 0; i--)
    if (v->shape[i] == 1)
      drop_dim(v, i);
  return 0;
}

int td_view_expand(td_view *v, int32_t ndim, const int64_t *shape) {
  int err = check_in(v, "expand");
  if (err < 0)
    return err;
  if (ndim < v->ndim || ndim > TD_MAX_DIMS)
    return FAIL(TD_EINVAL, "expand: %d sizes for a %d-d view (expected %d..%d)",
                (int)ndim, (int)v->ndim, (int)v->ndim, TD_MAX_DIMS);
  if (ndim > 0 && shape == NULL)
    return FAIL(TD_EINVAL, "expand: shape is NULL for %d dims", (int)ndim);
  int64_t es[TD_MAX_DIMS], est[TD_MAX_DIMS];
  for (int32_t i = ndim - 1; i >= 0; i--) {
    int32_t d = v->ndim - ndim + i; /* the dim of v, or < 0 for a new one */
    int64_t size = 1, stride = 0, target = shape[i];
    int ovf = 0;
    if (d >= 0) {
      size = v->shape[d];
      stride = v->stride[d];
    } else if (i + 1 < ndim) { /* as PyTorch: what a contiguous dim has */
      ovf = __builtin_mul_overflow(es[i + 1], est[i + 1], &stride);
    }
    if (target == -1) {
      if (d < 0)
        return FAIL(TD_EINVAL,
                    "expand: size -1 at dim %d, a new leading dim "
                    "(-1 keeps the size of an existing dim only)",
                    (int)i);
      target = size;
    } else if (target < 0) {
      return FAIL(TD_EINVAL, "expand: dim %d: invalid size %lld", (int)i,
                  (long long)target);
    }
    if (size != target) {
      if (size != 1)
        return FAIL(TD_EINVAL,
                    "expand: dim %d of size %lld cannot become "
                    "%lld (only a size-1 dim expands)",
                    (int)i, (long long)size, (long long)target);
      size = target;
      stride = 0;
      ovf = 0;
    }
    if (ovf)
      return FAIL(TD_EINVAL,
                  "expand: new dim %d: stride %lld * %lld "
                  "overflows int64",
                  (int)i, (long long)es[i + 1], (long long)est[i + 1]);
    es[i] = size;
    est[i] = stride;
  }
  char why[512];
  if (count_fits(ndim, es, why, sizeof(why)) < 0)
    return FAIL(TD_EINVAL, "expand: %s", why);
  memcpy(v->shape, es, (size_t)ndim * sizeof(int64_t));
  memcpy(v->stride, est, (size_t)ndim * sizeof(int64_t));
  v->ndim = ndim;
  return 0;
}

/* PyTorch's computeStride (aten/src/ATen/TensorUtils.cpp) for a view of
 * numel > 0 elements: splits v's dims into chunks that are contiguous with
 * each other and fills the new shape into the same chunks. Returns 0 with
 * stride filled in, 1 if no view of that shape exists, or TD_EINVAL if a
 * stride overflows. */
static int chunk_strides(const td_view *v, int32_t ndim, const int64_t *shape,
                         int64_t *stride) {
  int32_t view_d = ndim - 1;
  int64_t base = v->stride[v->ndim - 1]; /* stride of the chunk's last dim */
  int64_t tensor_numel = 1, view_numel = 1;
  for (int32_t d = v->ndim - 1; d >= 0; d--) {
    tensor_numel *= v->shape[d]; /* <= numel: cannot overflow */
    int64_t run;
    int boundary = d == 0;
    if (!boundary && v->shape[d - 1] != 1)
      boundary = __builtin_mul_overflow(tensor_numel, base, &run) ||
                 v->stride[d - 1] != run;
    if (!boundary)
      continue;
    while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
      if (__builtin_mul_overflow(view_numel, base, &stride[view_d]))
        return FAIL(TD_EINVAL,
                    "reshape: stride of new dim %d overflows "
                    "int64",
                    (int)view_d);
      if (__builtin_mul_overflow(view_numel, shape[view_d], &view_numel))
        return 1;
      view_d--;
    }
    if (view_numel != tensor_numel)
      return 1;
    if (d > 0) {
      base = v->stride[d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  return view_d == -1 ? 0 : 1;
}

int td_view_reshape(td_view *v, int32_t ndim, const int64_t *shape) {
  int err = check_in(v, "reshape");
  if (err < 0)
    return err;
  if (ndim < 0 || ndim > TD_MAX_DIMS)
    return FAIL(TD_EINVAL, "reshape: ndim %d outside 0..%d", (int)ndim,
                TD_MAX_DIMS);
  if (ndim > 0 && shape == NULL)
    return FAIL(TD_EINVAL, "reshape: shape is NULL for %d dims", (int)ndim);
  char sb[360];
  int64_t numel = 0;
  count_elements(v->ndim, v->shape, &numel); /* check_in: fits */
  /* infer_size: at most one -1, the others non-negative. newsize is the
   * product of the others: 0 if one is 0, whatever the rest. */
  int64_t ns[TD_MAX_DIMS], st[TD_MAX_DIMS];
  int32_t infer = -1;
  int64_t newsize = 1;
  int over = 0, zero = 0;
  for (int32_t i = 0; i < ndim; i++) {
    ns[i] = shape[i];
    if (shape[i] == -1) {
      if (infer >= 0)
        return FAIL(TD_EINVAL,
                    "reshape: only one dim can be inferred, but "
                    "dims %d and %d are -1",
                    (int)infer, (int)i);
      infer = i;
    } else if (shape[i] < 0) {
      return FAIL(TD_EINVAL, "reshape: dim %d: invalid size %lld", (int)i,
                  (long long)shape[i]);
    } else {
      zero |= shape[i] == 0;
      over |= __builtin_mul_overflow(newsize, shape[i], &newsize);
    }
  }
  if (zero)
    newsize = 0;
  else if (over)
    return FAIL(TD_EINVAL,
                "reshape: the element count of shape %s "
                "overflows int64",
                fmt_shape(sb, sizeof(sb), ndim, shape));
  if (numel == newsize || (infer >= 0 && newsize > 0 && numel % newsize == 0)) {
    if (infer >= 0) {
      if (newsize == 0)
        return FAIL(TD_EINVAL,
                    "reshape: cannot reshape a view of 0 elements "
                    "into shape %s: the size of -1 could be anything",
                    fmt_shape(sb, sizeof(sb), ndim, shape));
      ns[infer] = numel / newsize;
    }
  } else {
    return FAIL(TD_EINVAL,
                "reshape: shape %s is invalid for a view of %lld "
                "elements",
                fmt_shape(sb, sizeof(sb), ndim, shape), (long long)numel);
  }
  /* computeStride. */
  if (v->ndim == 0) {
    for (int32_t i = 0; i < ndim; i++)
      st[i] = 1;
  } else if (numel == 0) {
    int same = ndim == v->ndim;
    for (int32_t i = 0; same && i < ndim; i++)
      same = ns[i] == v->shape[i];
    if (same)
      memcpy(st, v->stride, (size_t)ndim * sizeof(int64_t));
    else if (dense_strides(ndim, ns, st) < 0)
      return FAIL(TD_EINVAL, "reshape: a stride of shape %s overflows int64",
                  fmt_shape(sb, sizeof(sb), ndim, ns));
  } else if ((err = chunk_strides(v, ndim, ns, st)) != 0) {
    if (err < 0)
      return err;
    char vb[360];
    return FAIL(TD_EINVAL,
                "reshape: %s cannot be viewed as shape %s without "
                "a copy: the dims it merges or splits are not contiguous "
                "with each other (td_copy it into a contiguous view first)",
                td_view_format(v, vb, sizeof(vb)),
                fmt_shape(sb, sizeof(sb), ndim, ns));
  }
  for (int32_t i = 0; i < TD_MAX_DIMS; i++) {
    v->shape[i] = i < ndim ? ns[i] : 0;
    v->stride[i] = i < ndim ? st[i] : 0;
  }
  v->ndim = ndim;
  return 0;
}

int td_view_as_strided(td_view *v, int32_t ndim, const int64_t *shape,
                       const int64_t *stride, int64_t offset) {
  int err = check_in(v, "as_strided");
  if (err < 0)
    return err;
  if (ndim < 0 || ndim > TD_MAX_DIMS)
    return FAIL(TD_EINVAL, "as_strided: ndim %d outside 0..%d", (int)ndim,
                TD_MAX_DIMS);
  if (ndim > 0 && (shape == NULL || stride == NULL))
    return FAIL(TD_EINVAL, "as_strided: shape or stride is NULL for %d dims",
                (int)ndim);
  td_view n;
  memset(&n, 0, sizeof(n));
  n.dtype = v->dtype;
  n.ndim = ndim;
  n.offset = offset;
  memcpy(n.shape, shape, (size_t)ndim * sizeof(int64_t));
  memcpy(n.stride, stride, (size_t)ndim * sizeof(int64_t));
  char why[512];
  /* Every extent fits in SIZE_MAX: only a malformed or overflowing view
   * fails here. */
  if (td__view_check_msg(&n, SIZE_MAX, why, sizeof(why)) < 0)
    return FAIL(TD_EINVAL, "as_strided: %s", why);
  *v = n;
  return 0;
}

int td_view_reinterpret(td_view *v, td_dtype dtype) {
  int err = check_in(v, "reinterpret");
  if (err < 0)
    return err;
  int64_t from = (int64_t)td_dtype_size(v->dtype);
  int64_t to = (int64_t)td_dtype_size(dtype);
  const char *fn = td_dtype_name(v->dtype), *tn = td_dtype_name(dtype);
  if (to == 0)
    return FAIL(TD_EINVAL, "reinterpret: unknown dtype %d", (int)dtype);
  if (from == to) {
    v->dtype = dtype;
    return 0;
  }
  if (v->ndim == 0)
    return FAIL(TD_EINVAL,
                "reinterpret: a 0-d view cannot be viewed as %s: "
                "the element sizes differ (%lld and %lld bytes)",
                tn, (long long)from, (long long)to);
  int32_t last = v->ndim - 1;
  if (v->stride[last] != 1)
    return FAIL(TD_EINVAL,
                "reinterpret: the last dim (%d) has stride %lld; "
                "it must be 1 to view %s as %s",
                (int)last, (long long)v->stride[last], fn, tn);
  int64_t st[TD_MAX_DIMS], size, off;
  if (from > to) {
    int64_t r = from / to;
    for (int32_t i = 0; i < last; i++)
      if (__builtin_mul_overflow(v->stride[i], r, &st[i]))
        return FAIL(TD_EINVAL,
                    "reinterpret: dim %d: stride %lld times %lld "
                    "overflows int64",
                    (int)i, (long long)v->stride[i], (long long)r);
    if (__builtin_mul_overflow(v->shape[last], r, &size) ||
        __builtin_mul_overflow(v->offset, r, &off))
      return FAIL(TD_EINVAL,
                  "reinterpret: size %lld or offset %lld times "
                  "%lld overflows int64",
                  (long long)v->shape[last], (long long)v->offset,
                  (long long)r);
  } else {
    int64_t r = to / from;
    if (v->shape[last] % r != 0)
      return FAIL(TD_EINVAL,
                  "reinterpret: the last dim (%d) has size %lld, "
                  "not divisible by %lld, to view %s as %s",
                  (int)last, (long long)v->shape[last], (long long)r, fn, tn);
    if (v->offset % r != 0)
      return FAIL(TD_EINVAL,
                  "reinterpret: offset %lld is not divisible by "
                  "%lld, to view %s as %s",
                  (long long)v->offset, (long long)r, fn, tn);
    for (int32_t i = 0; i < last; i++) {
      if (v->stride[i] % r != 0)
        return FAIL(TD_EINVAL,
                    "reinterpret: dim %d: stride %lld is not "
                    "divisible by %lld, to view %s as %s",
                    (int)i, (long long)v->stride[i], (long long)r, fn, tn);
      st[i] = v->stride[i] / r;
    }
    size = v->shape[last] / r;
    off = v->offset / r;
  }
  /* A smaller element multiplies the count: it must still fit. */
  int64_t ns[TD_MAX_DIMS];
  char why[512];
  memcpy(ns, v->shape, (size_t)last * sizeof(int64_t));
  ns[last] = size;
  if (count_fits(v->ndim, ns, why, sizeof(why)) < 0)
    return FAIL(TD_EINVAL, "reinterpret: as %s: %s", tn, why);
  memcpy(v->stride, st, (size_t)last * sizeof(int64_t));
  v->shape[last] = size;
  v->offset = off;
  v->dtype = dtype;
  return 0;
}

int td_view_offset_of(const td_view *v, const int64_t *index, int64_t *offset) {
  int err = check_in(v, "offset_of");
  if (err < 0)
    return err;
  if (v->ndim > 0 && index == NULL)
    return FAIL(TD_EINVAL, "offset_of: index is NULL for a %d-d view",
                (int)v->ndim);
  int64_t off = v->offset;
  for (int32_t i = 0; i < v->ndim; i++) {
    int64_t k = index[i], size = v->shape[i], step;
    if (k < -size || k >= size)
      return FAIL(TD_ERANGE,
                  "offset_of: dim %d: index %lld out of range for "
                  "size %lld",
                  (int)i, (long long)k, (long long)size);
    if (k < 0)
      k += size;
    if (__builtin_mul_overflow(k, v->stride[i], &step) ||
        __builtin_add_overflow(off, step, &off))
      return FAIL(TD_EINVAL, "offset_of: dim %d: offset overflows int64",
                  (int)i);
  }
  *offset = off;
  return 0;
}

/* view.c: views (dtype, shape, strides, offset) over storages, checked so
 * that no view reaches a byte outside its storage. */
#include "tensord.h"

#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Returns 0 if v's fields are each in range, else TD_EINVAL with the reason
 * in msg (if not NULL). */
static int view_valid(const td_view *v, char *msg, size_t len) {
  if (td_dtype_size(v->dtype) == 0)
    return td__msg(msg, len, TD_EINVAL, "unknown dtype %d", (int)v->dtype);
  if (v->ndim < 0 || v->ndim > TD_MAX_DIMS)
    return td__msg(msg, len, TD_EINVAL, "ndim %d outside 0..%d",
                   (int)v->ndim, TD_MAX_DIMS);
  if (v->offset < 0)
    return td__msg(msg, len, TD_EINVAL, "negative offset %lld",
                   (long long)v->offset);
  for (int32_t i = 0; i < v->ndim; i++) {
    if (v->shape[i] < 0)
      return td__msg(msg, len, TD_EINVAL, "dim %d: negative size %lld",
                     (int)i, (long long)v->shape[i]);
    if (v->stride[i] < 0)
      return td__msg(msg, len, TD_EINVAL, "dim %d: negative stride %lld",
                     (int)i, (long long)v->stride[i]);
  }
  return 0;
}

int td__msg(char *msg, size_t len, int err, const char *fmt, ...) {
  if (msg != NULL && len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, len, fmt, ap);
    va_end(ap);
  }
  return err;
}

int td_view_contiguous(td_dtype dtype, int32_t ndim, const int64_t *shape,
                       td_view *out) {
  td_view v;
  memset(&v, 0, sizeof(v));
  v.dtype = dtype;
  v.ndim = ndim;
  if (td_dtype_size(dtype) == 0 || ndim < 0 || ndim > TD_MAX_DIMS ||
      (ndim > 0 && shape == NULL))
    return TD_EINVAL;
  int64_t stride = 1;
  int zero = 0;
  for (int32_t i = ndim - 1; i >= 0; i--) {
    if (shape[i] < 0)
      return TD_EINVAL;
    v.shape[i] = shape[i];
    v.stride[i] = stride;
    if (shape[i] == 0)
      zero = 1;
    else if (!zero && __builtin_mul_overflow(stride, shape[i], &stride))
      return TD_EOVERFLOW;
  }
  /* Strides of an empty tensor are what PyTorch gives: products of the
   * sizes, with each 0 counted as 1. */
  if (zero) {
    stride = 1;
    for (int32_t i = ndim - 1; i >= 0; i--) {
      v.stride[i] = stride;
      int64_t s = shape[i] > 0 ? shape[i] : 1;
      if (__builtin_mul_overflow(stride, s, &stride))
        return TD_EOVERFLOW;
    }
  }
  *out = v;
  return 0;
}

int64_t td_view_numel(const td_view *v) {
  int err = view_valid(v, NULL, 0);
  if (err < 0)
    return err;
  int64_t n = 1;
  for (int32_t i = 0; i < v->ndim; i++)
    if (__builtin_mul_overflow(n, v->shape[i], &n))
      return TD_EOVERFLOW;
  return n;
}

int td_view_check(const td_view *v, size_t nbytes) {
  return td__view_check_msg(v, nbytes, NULL, 0);
}

int td__view_check_msg(const td_view *v, size_t nbytes, char *msg,
                       size_t len) {
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
      return td__msg(msg, len, TD_EOVERFLOW,
                     "dim %d: size %lld times stride %lld overflows int64",
                     (int)i, (long long)v->shape[i], (long long)v->stride[i]);
  }
  /* An empty view touches no element; its start may sit at the end. */
  int64_t end;
  if (__builtin_add_overflow(last, empty ? 0 : 1, &end) ||
      __builtin_mul_overflow(end, itemsize, &end))
    return td__msg(msg, len, TD_EOVERFLOW,
                   "extent of %lld elements of %lld bytes overflows int64",
                   (long long)last, (long long)itemsize);
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

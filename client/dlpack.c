/* dlpack.c: views of storages handed out as DLPack tensors without a copy,
 * and DLPack tensors copied into new storages (DLPack 0.6 ABI). */
#include "internal.h"

#include <dlpack/dlpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* kDLBool, which DLPack added after 0.6 (code 6, 8 bits). */
#define DL_BOOL_CODE 6

/* One allocation per exported tensor: the DLManagedTensor, the storage
 * reference it holds, and its shape and strides. */
typedef struct export_ctx {
  DLManagedTensor m;
  td_storage *s;
  int64_t shape[TD_MAX_DIMS];
  int64_t strides[TD_MAX_DIMS];
} export_ctx;

static void export_deleter(DLManagedTensor *m) {
  if (m == NULL)
    return;
  export_ctx *x = m->manager_ctx;
  td_storage_release(x->s);
  free(x);
}

/* Returns 0 and fills *out, or -1 if DLPack 0.6 has no code for t. */
static int to_dl_dtype(td_dtype t, DLDataType *out) {
  uint8_t code;
  switch (t) {
  case TD_BOOL: /* as PyTorch did before DLPack had a bool */
  case TD_UINT8:
  case TD_UINT16:
  case TD_UINT32:
  case TD_UINT64:
    code = kDLUInt;
    break;
  case TD_INT8:
  case TD_INT16:
  case TD_INT32:
  case TD_INT64:
    code = kDLInt;
    break;
  case TD_FLOAT16:
  case TD_FLOAT32:
  case TD_FLOAT64:
    code = kDLFloat;
    break;
  case TD_BFLOAT16:
    code = kDLBfloat;
    break;
  case TD_COMPLEX64:
  case TD_COMPLEX128:
    code = kDLComplex;
    break;
  default:
    return -1;
  }
  out->code = code;
  out->bits = (uint8_t)(td_dtype_size(t) * 8);
  out->lanes = 1;
  return 0;
}

/* Returns the dtype of t (lanes 1 is checked by the caller), or
 * TD_DTYPE_INVALID. */
static td_dtype from_dl_dtype(DLDataType t) {
  static const struct {
    uint8_t code, bits;
    td_dtype dtype;
  } map[] = {
      {kDLUInt, 8, TD_UINT8},         {kDLUInt, 16, TD_UINT16},
      {kDLUInt, 32, TD_UINT32},       {kDLUInt, 64, TD_UINT64},
      {kDLInt, 8, TD_INT8},           {kDLInt, 16, TD_INT16},
      {kDLInt, 32, TD_INT32},         {kDLInt, 64, TD_INT64},
      {kDLFloat, 16, TD_FLOAT16},     {kDLFloat, 32, TD_FLOAT32},
      {kDLFloat, 64, TD_FLOAT64},     {kDLBfloat, 16, TD_BFLOAT16},
      {kDLComplex, 64, TD_COMPLEX64}, {kDLComplex, 128, TD_COMPLEX128},
      {DL_BOOL_CODE, 8, TD_BOOL},
  };
  for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
    if (map[i].code == t.code && map[i].bits == t.bits)
      return map[i].dtype;
  return TD_DTYPE_INVALID;
}

int td_to_dlpack(td_storage *s, const td_view *v, DLManagedTensor **out) {
  if (out == NULL)
    return td__view_fail(TD_EINVAL, "to_dlpack: out is NULL");
  *out = NULL;
  if (s == NULL)
    return td__view_fail(TD_EINVAL, "to_dlpack: storage is NULL");
  unsigned long long id = (unsigned long long)td_storage_id(s);
  size_t nbytes = td_storage_nbytes(s);
  td_view whole;
  if (v == NULL) {
    int64_t n = (int64_t)nbytes;
    td_view_contiguous(TD_UINT8, 1, &n, &whole);
    v = &whole;
  }
  td_device device = td_storage_device(s);
  if (device != TD_CPU && device != TD_CUDA)
    return td__view_fail(TD_ENODEV,
                         "to_dlpack: storage %llu is on device %d, which "
                         "DLPack export does not know",
                         id, (int)device);
  char why[600];
  int err = td__view_check_msg(v, nbytes, why, sizeof(why));
  if (err < 0)
    return td__view_fail(err, "to_dlpack: storage %llu: %s", id, why);
  DLDataType dt;
  if (to_dl_dtype(v->dtype, &dt) < 0)
    return td__view_fail(TD_EINVAL,
                         "to_dlpack: DLPack 0.6 has no type for "
                         "%s; reinterpret the view as uint8 first",
                         td_dtype_name(v->dtype));
  export_ctx *x = calloc(1, sizeof(*x));
  if (x == NULL)
    return td__view_fail(TD_ENOMEM, "to_dlpack: out of memory");
  memcpy(x->shape, v->shape, (size_t)v->ndim * sizeof(int64_t));
  memcpy(x->strides, v->stride, (size_t)v->ndim * sizeof(int64_t));
  x->s = td_storage_retain(s);
  DLTensor *t = &x->m.dl_tensor;
  /* data at the first element, byte_offset 0: PyTorch (1.13 at least)
   * ignores byte_offset on import, and every consumer reads this right. The
   * product fits: the view passed td_view_check against nbytes. */
  t->data =
      (char *)td_storage_data(s) + (size_t)v->offset * td_dtype_size(v->dtype);
  /* A GPU's storage: the device pointer, on this process's ordinal of
   * that GPU (CUDA_VISIBLE_DEVICES applies), as torch and CuPy expect. */
  t->device.device_type = device == TD_CUDA ? kDLCUDA : kDLCPU;
  t->device.device_id = td_storage_device_index(s);
  t->ndim = v->ndim;
  t->dtype = dt;
  t->shape = x->shape;
  t->strides = x->strides;
  t->byte_offset = 0;
  x->m.manager_ctx = x;
  x->m.deleter = export_deleter;
  *out = &x->m;
  return 0;
}

/* Builds the view of t over t->data + t->byte_offset and checks it as
 * td_view_check does (at most INT64_MAX elements, an extent within int64),
 * and that the extent past byte_offset stays inside the address space.
 * Returns 0 or a code with td_view_last_error() set. */
static int source_view(const DLTensor *t, td_view *sv) {
  int dev = t->device.device_type;
  if (dev != kDLCPU && dev != kDLCUDAHost && dev != kDLROCMHost)
    return td__view_fail(TD_ENODEV,
                         "from_dlpack: device type %d is not "
                         "host memory (copy the tensor to the CPU first)",
                         dev);
  if (t->dtype.lanes != 1)
    return td__view_fail(TD_EINVAL,
                         "from_dlpack: %u lanes; only scalar "
                         "elements (lanes 1) are supported",
                         (unsigned)t->dtype.lanes);
  memset(sv, 0, sizeof(*sv));
  sv->dtype = from_dl_dtype(t->dtype);
  if (sv->dtype == TD_DTYPE_INVALID)
    return td__view_fail(TD_EINVAL,
                         "from_dlpack: unsupported type code %u "
                         "with %u bits",
                         (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
  if (t->ndim < 0 || t->ndim > TD_MAX_DIMS)
    return td__view_fail(TD_EINVAL, "from_dlpack: ndim %d outside 0..%d",
                         t->ndim, TD_MAX_DIMS);
  if (t->ndim > 0 && t->shape == NULL)
    return td__view_fail(TD_EINVAL, "from_dlpack: shape is NULL for %d dims",
                         t->ndim);
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0)
      return td__view_fail(TD_EINVAL,
                           "from_dlpack: dim %d: negative size "
                           "%lld",
                           i, (long long)t->shape[i]);
  char why[600];
  int err;
  sv->ndim = t->ndim;
  if (t->strides == NULL) { /* row-major */
    if ((err = td_view_contiguous(sv->dtype, t->ndim, t->shape, sv)) < 0) {
      snprintf(why, sizeof(why), "%s", td_view_last_error());
      return td__view_fail(err, "from_dlpack: %s", why);
    }
  } else {
    for (int i = 0; i < t->ndim; i++) {
      if (t->strides[i] < 0 && t->shape[i] > 1)
        return td__view_fail(TD_EINVAL,
                             "from_dlpack: dim %d: negative stride "
                             "%lld is not supported (make the tensor "
                             "contiguous first)",
                             i, (long long)t->strides[i]);
      sv->shape[i] = t->shape[i];
      sv->stride[i] = t->strides[i] < 0 ? 0 : t->strides[i];
    }
  }
  if ((err = td__view_check_msg(sv, SIZE_MAX, why, sizeof(why))) < 0)
    return td__view_fail(TD_EINVAL, "from_dlpack: %s", why);
  /* The last byte read, from data: byte_offset plus the extent. The extent
   * fits int64 (checked above); the sum must not wrap the address space. */
  int64_t end = 0, es = (int64_t)td_dtype_size(sv->dtype);
  if (td_view_numel(sv) > 0) {
    end = sv->offset + 1;
    for (int i = 0; i < sv->ndim; i++)
      end += (sv->shape[i] - 1) * sv->stride[i];
    end *= es;
  }
  uintptr_t room = UINTPTR_MAX - (uintptr_t)t->data;
  if (t->byte_offset > room || (uint64_t)end > room - t->byte_offset)
    return td__view_fail(TD_EINVAL,
                         "from_dlpack: data %p + byte_offset %llu + "
                         "%lld bytes of elements passes the end of the "
                         "address space",
                         t->data, (unsigned long long)t->byte_offset,
                         (long long)end);
  return 0;
}

/* td_from_dlpack without the deleter. */
static int import(td_client *c, const DLManagedTensor *src, const char *key,
                  unsigned flags, td_storage **out) {
  if (flags & ~TD_DLPACK_CONSUME)
    return td__view_fail(TD_EINVAL, "from_dlpack: unknown flags 0x%x", flags);
  if (c == NULL || src == NULL)
    return td__view_fail(TD_EINVAL, "from_dlpack: NULL %s",
                         c == NULL ? "client" : "tensor");
  if (key == NULL && out == NULL)
    return td__view_fail(TD_EINVAL, "from_dlpack: neither a key nor out: "
                                    "nothing would hold the new storage");
  /* The key's rule is td_publish's; checked first so that a bad key costs
   * no storage. */
  if (key != NULL &&
      (key[0] == '\0' || strnlen(key, TD_KEY_MAX + 1) > TD_KEY_MAX))
    return td__view_fail(TD_EINVAL,
                         "from_dlpack: key of %zu bytes (a key "
                         "has 1 to %d)",
                         strlen(key), TD_KEY_MAX);
  const DLTensor *t = &src->dl_tensor;
  td_view sv, dv;
  int err = source_view(t, &sv);
  if (err < 0)
    return err;
  int64_t numel = td_view_numel(&sv); /* source_view: fits int64 */
  if (numel > 0 && t->data == NULL)
    return td__view_fail(TD_EINVAL, "from_dlpack: data is NULL");
  /* The copy is contiguous: a stride-0 source may be far smaller. */
  char why[600];
  size_t es = td_dtype_size(sv.dtype), nbytes;
  if ((err = td_view_contiguous(sv.dtype, sv.ndim, sv.shape, &dv)) < 0) {
    snprintf(why, sizeof(why), "%s", td_view_last_error());
    return td__view_fail(err, "from_dlpack: no storage holds a copy: %s", why);
  }
  if (__builtin_mul_overflow((size_t)numel, es, &nbytes)) /* 32-bit size_t */
    return td__view_fail(TD_EINVAL,
                         "from_dlpack: a copy of %lld elements of %zu "
                         "bytes does not fit in size_t",
                         (long long)numel, es);
  /* The copy writes every byte (it is contiguous), so a recycled segment
   * need not be zeroed first; an empty tensor still takes one byte. */
  td_create_opts o = {.nbytes = nbytes > 0 ? nbytes : 1,
                      .flags = nbytes > 0 ? TD_UNINIT : 0};
  td_storage *s = NULL;
  if ((err = td_storage_create_ex(c, &o, &s)) < 0)
    return td__view_fail(err, "from_dlpack: %s", td_last_error(c));
  const char *base = (const char *)t->data + t->byte_offset;
  if ((err = td__copy_raw(td_storage_data(s), &dv, base, &sv, 0)) < 0)
    goto release;
  if (key != NULL && (err = td_publish(c, key, s, &dv)) < 0) {
    td__view_fail(err, "from_dlpack: %s", td_last_error(c));
    goto release;
  }
  if (out != NULL)
    *out = s;
  else
    td_storage_release(s);
  return 0;
release:
  td_storage_release(s);
  return err;
}

int td_from_dlpack(td_client *c, DLManagedTensor *src, const char *key,
                   unsigned flags, td_storage **out) {
  if (out != NULL)
    *out = NULL;
  int err = import(c, src, key, flags, out);
  if (err < 0)
    td__client_keep_error(c);
  if ((flags & TD_DLPACK_CONSUME) && src != NULL && src->deleter != NULL)
    src->deleter(src);
  return err;
}

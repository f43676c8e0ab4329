/* view_sure.h: the fuzz models' judgement of a view message: whether the
 * daemon surely accepts it for a storage of nbytes. The model says "sure"
 * only for views far from every limit (small sizes and strides, nothing
 * empty, no arithmetic near overflow), so that no rule about huge or empty
 * views can make it wrong; elsewhere it cannot tell. */
#ifndef TD_FUZZ_VIEW_SURE_H
#define TD_FUZZ_VIEW_SURE_H

#include "tensord.h"
#include "tensord.pb-c.h"

#include <string.h>

#define FZ_VIEW_DIM_MAX (1 << 20)
#define FZ_VIEW_OFFSET_MAX (1 << 30)
#define FZ_VIEW_NUMEL_MAX (1ll << 40)

/* Returns 1 and fills *v (the view as the daemon keeps it) if the daemon
 * surely accepts m for a storage of nbytes; 0 if the model cannot tell. A
 * missing m is the whole storage as bytes. */
static inline int fz_view_sure(const Tensord__View *m, uint64_t nbytes,
                               td_view *v) {
  memset(v, 0, sizeof(*v));
  if (m == NULL) {
    v->dtype = TD_UINT8;
    v->ndim = 1;
    v->shape[0] = (int64_t)nbytes;
    v->stride[0] = 1;
    return nbytes <= (uint64_t)INT64_MAX;
  }
  if (m->n_shape > TD_MAX_DIMS || m->n_stride != m->n_shape)
    return 0;
  v->dtype = (td_dtype)m->dtype;
  v->ndim = (int32_t)m->n_shape;
  v->offset = m->offset;
  int64_t size = (int64_t)td_dtype_size(v->dtype);
  if (size == 0 || m->offset < 0 || m->offset > FZ_VIEW_OFFSET_MAX)
    return 0;
  int64_t last = m->offset, numel = 1;
  for (size_t i = 0; i < m->n_shape; i++) {
    int64_t n = m->shape[i], st = m->stride[i];
    v->shape[i] = n;
    v->stride[i] = st;
    if (n < 1 || n > FZ_VIEW_DIM_MAX || st < 0 || st > FZ_VIEW_DIM_MAX)
      return 0;
    last += (n - 1) * st;
    numel *= n;
    if (numel > FZ_VIEW_NUMEL_MAX)
      return 0;
  }
  return (uint64_t)((last + 1) * size) <= nbytes;
}

/* Whether the view message m says what v says. */
static inline int fz_view_eq(const td_view *v, const Tensord__View *m) {
  if (m == NULL || m->dtype != (int32_t)v->dtype ||
      m->n_shape != (size_t)v->ndim || m->n_stride != (size_t)v->ndim ||
      m->offset != v->offset)
    return 0;
  for (int32_t i = 0; i < v->ndim; i++)
    if (m->shape[i] != v->shape[i] || m->stride[i] != v->stride[i])
      return 0;
  return 1;
}

#endif /* TD_FUZZ_VIEW_SURE_H */

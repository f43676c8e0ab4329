/* viewmsg.c: td_view to and from its wire message. */
#include "viewmsg.h"

#include "common.h"

#include <string.h>

int td__view_from_msg(const Tensord__View *m, td_view *v, char *msg,
                      size_t len) {
  if (m->n_shape > TD_MAX_DIMS)
    return td__msg(msg, len, TD_EINVAL, "view has %zu dims; at most %d",
                   m->n_shape, TD_MAX_DIMS);
  if (m->n_stride != m->n_shape)
    return td__msg(msg, len, TD_EINVAL, "view has %zu sizes but %zu strides",
                   m->n_shape, m->n_stride);
  memset(v, 0, sizeof(*v));
  v->dtype = (td_dtype)m->dtype;
  v->ndim = (int32_t)m->n_shape;
  for (size_t i = 0; i < m->n_shape; i++) {
    v->shape[i] = m->shape[i];
    v->stride[i] = m->stride[i];
  }
  v->offset = m->offset;
  return 0;
}

void td__view_to_msg(const td_view *v, Tensord__View *m) {
  tensord__view__init(m);
  m->dtype = v->dtype;
  m->n_shape = m->n_stride = (size_t)(v->ndim > 0 ? v->ndim : 0);
  m->shape = (int64_t *)v->shape;
  m->stride = (int64_t *)v->stride;
  m->offset = v->offset;
}

/* test_view.c: the view algebra against a reference that moves explicit
 * index maps instead of strides, PyTorch's view rules, dtype names, elements
 * decoded (td_elem_to_double), and bad input. */
#include "tensord.h"
#include "seed.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a seeded PRNG (splitmix64); the seed is in every failure ---- */

static uint64_t rng;
static uint64_t seed;

static void seed_rng(void) {
  seed = tdt_seed("test_view");
  rng = seed;
}

static uint64_t rnd(void) {
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static int64_t rr(int64_t lo, int64_t hi) {
  return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

#define MAX_NUMEL 4096

/* ---- the reference: a shape and every element's byte offset ---- */

typedef struct ref {
  int32_t ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t n;
  int64_t es;
  int64_t *off; /* byte offset of each element, in row-major index order */
} ref;

static void unravel(int64_t lin, int32_t nd, const int64_t *shape,
                    int64_t *idx) {
  for (int32_t i = nd - 1; i >= 0; i--) {
    idx[i] = lin % shape[i];
    lin /= shape[i];
  }
}

static int64_t ravel(int32_t nd, const int64_t *shape, const int64_t *idx) {
  int64_t lin = 0;
  for (int32_t i = 0; i < nd; i++)
    lin = lin * shape[i] + idx[i];
  return lin;
}

static int64_t count(int32_t nd, const int64_t *shape) {
  int64_t n = 1;
  for (int32_t i = 0; i < nd; i++)
    n *= shape[i];
  return n;
}

static void ref_free(ref *r) {
  free(r->off);
  r->off = NULL;
}

/* The naive reference: every index's offset from the view's fields. */
static void ref_from_view(const td_view *v, ref *r) {
  r->ndim = v->ndim;
  memcpy(r->shape, v->shape, sizeof(r->shape));
  r->n = count(v->ndim, v->shape);
  r->es = (int64_t)td_dtype_size(v->dtype);
  r->off = malloc((size_t)(r->n > 0 ? r->n : 1) * sizeof(int64_t));
  int64_t idx[TD_MAX_DIMS];
  for (int64_t j = 0; j < r->n; j++) {
    unravel(j, v->ndim, v->shape, idx);
    int64_t o = v->offset;
    for (int32_t i = 0; i < v->ndim; i++)
      o += idx[i] * v->stride[i];
    r->off[j] = o * r->es;
  }
}

/* How an op maps an index of its result back to an index of its input. */
typedef struct op {
  int kind;
  int32_t d0, d1;
  int32_t dims[TD_MAX_DIMS];
  int64_t a, b, c;
  int32_t nd;
  int64_t shape[TD_MAX_DIMS];
  int64_t stride[TD_MAX_DIMS];
  int64_t offset;
  td_dtype dtype;
} op;

enum {
  OP_TRANSPOSE,
  OP_PERMUTE,
  OP_NARROW,
  OP_SELECT,
  OP_SLICE,
  OP_UNSQUEEZE,
  OP_SQUEEZE,
  OP_SQUEEZE_ALL,
  OP_EXPAND,
  OP_RESHAPE,
  OP_AS_STRIDED,
  OP_REINTERPRET,
  OP_COUNT
};

static const char *op_names[OP_COUNT] = {
    "transpose", "permute",   "narrow",     "select",
    "slice",     "unsqueeze", "squeeze",    "squeeze_all",
    "expand",    "reshape",   "as_strided", "reinterpret"};

/* Makes out the result of o on in, with shape nd/shape, by moving indexes:
 * index map() of each result index. The op's args are already wrapped. */
static void ref_apply(const ref *in, const op *o, int32_t nd,
                      const int64_t *shape, int64_t es, ref *out) {
  out->ndim = nd;
  memset(out->shape, 0, sizeof(out->shape));
  memcpy(out->shape, shape, (size_t)nd * sizeof(int64_t));
  out->n = count(nd, shape);
  out->es = es;
  out->off = malloc((size_t)(out->n > 0 ? out->n : 1) * sizeof(int64_t));
  int64_t idx[TD_MAX_DIMS + 1], old[TD_MAX_DIMS + 1];
  for (int64_t j = 0; j < out->n; j++) {
    unravel(j, nd, shape, idx);
    int64_t sub = 0; /* byte within an element (reinterpret) */
    switch (o->kind) {
    case OP_TRANSPOSE:
      memcpy(old, idx, sizeof(idx));
      old[o->d0] = idx[o->d1];
      old[o->d1] = idx[o->d0];
      break;
    case OP_PERMUTE:
      for (int32_t i = 0; i < nd; i++)
        old[o->dims[i]] = idx[i];
      break;
    case OP_NARROW:
      memcpy(old, idx, sizeof(idx));
      old[o->d0] += o->a;
      break;
    case OP_SELECT:
      for (int32_t i = 0, k = 0; i < in->ndim; i++)
        old[i] = i == o->d0 ? o->a : idx[k++];
      break;
    case OP_SLICE:
      memcpy(old, idx, sizeof(idx));
      old[o->d0] = o->a + idx[o->d0] * o->c;
      break;
    case OP_EXPAND:
      for (int32_t i = 0; i < in->ndim; i++) {
        int32_t k = nd - in->ndim + i;
        old[i] = in->shape[i] == 1 ? 0 : idx[k];
      }
      break;
    case OP_REINTERPRET:
      memcpy(old, idx, sizeof(idx));
      if (in->es > es) { /* each old element is in->es / es new ones */
        old[nd - 1] = idx[nd - 1] / (in->es / es);
        sub = idx[nd - 1] % (in->es / es) * es;
      } else if (in->es < es) {
        old[nd - 1] = idx[nd - 1] * (es / in->es);
      }
      break;
    default: /* unsqueeze, squeeze, reshape: the order does not change */
      out->off[j] = in->off[j];
      continue;
    }
    out->off[j] = in->off[ravel(in->ndim, in->shape, old)] + sub;
  }
}

/* ---- checks of a result against the reference ---- */

#define FAILF(...)                                                             \
  cr_assert_fail("seed %" PRIu64 ", %s: %s", seed, ctx,                                 \
                 (snprintf(fb, sizeof(fb), __VA_ARGS__), fb))

static char ctx[1024];
static char fb[1024];

/* The byte a view must not pass, by brute force over its elements; an
 * empty view still needs its start inside. */
static int64_t brute_bound(const td_view *v, const ref *r) {
  if (r->n == 0)
    return v->offset * r->es;
  int64_t m = 0;
  for (int64_t j = 0; j < r->n; j++)
    if (r->off[j] > m)
      m = r->off[j];
  return m + r->es;
}

static void expect_matches(const td_view *v, const ref *r) {
  char vb[512];
  td_view_format(v, vb, sizeof(vb));
  if (v->ndim != r->ndim)
    FAILF("%s: ndim %d, reference %d", vb, v->ndim, r->ndim);
  for (int32_t i = 0; i < TD_MAX_DIMS; i++) {
    if (i < v->ndim && v->shape[i] != r->shape[i])
      FAILF("%s: dim %d has size %lld, reference %lld", vb, i,
            (long long)v->shape[i], (long long)r->shape[i]);
    if (i >= v->ndim && (v->shape[i] != 0 || v->stride[i] != 0))
      FAILF("%s: slot %d past ndim is not zero", vb, i);
  }
  if ((int64_t)td_dtype_size(v->dtype) != r->es)
    FAILF("%s: element size %zu, reference %lld", vb, td_dtype_size(v->dtype),
          (long long)r->es);
  if (td_view_numel(v) != r->n)
    FAILF("%s: numel %lld, reference %lld", vb, (long long)td_view_numel(v),
          (long long)r->n);
  int64_t idx[TD_MAX_DIMS];
  for (int64_t j = 0; j < r->n; j++) {
    unravel(j, v->ndim, v->shape, idx);
    int64_t naive = v->offset, got = -1;
    for (int32_t i = 0; i < v->ndim; i++)
      naive += idx[i] * v->stride[i];
    int err = td_view_offset_of(v, idx, &got);
    if (err != 0 || got * r->es != r->off[j] || naive * r->es != r->off[j])
      FAILF("%s: element %lld: offset_of %d/%lld, naive %lld, reference byte "
            "%lld",
            vb, (long long)j, err, (long long)got, (long long)naive,
            (long long)r->off[j]);
    /* The same index counted from the end. */
    if (v->ndim > 0 && (j & 7) == 0) {
      int64_t neg[TD_MAX_DIMS];
      for (int32_t i = 0; i < v->ndim; i++)
        neg[i] = idx[i] - v->shape[i];
      if (td_view_offset_of(v, neg, &got) != 0 || got != naive)
        FAILF("%s: element %lld by negative index", vb, (long long)j);
    }
  }
  /* td_view_check agrees with brute force, around the bound. */
  int64_t b = brute_bound(v, r);
  int64_t tries[3] = {b - 1, b, b + rr(1, 64)};
  for (int i = 0; i < 3; i++) {
    if (tries[i] < 0)
      continue;
    int want = tries[i] >= b ? 0 : TD_ERANGE;
    int got = td_view_check(v, (size_t)tries[i]);
    if (got != want)
      FAILF("%s: check against %lld bytes gave %d, brute force %d (bound "
            "%lld)",
            vb, (long long)tries[i], got, want, (long long)b);
  }
}

/* ---- random views and ops, with what each must do ---- */

static td_dtype random_dtype(void) {
  return (td_dtype)rr(1, TD_DTYPE_COUNT_ - 1);
}

/* A well-formed view of at most maxnd dims and MAX_NUMEL / 4 elements, with
 * zeroed slots past ndim. */
static void random_view(td_view *v, int32_t maxnd, int64_t maxsize) {
  memset(v, 0, sizeof(*v));
  v->dtype = random_dtype();
  v->ndim = (int32_t)rr(0, maxnd);
  int64_t n = 1;
  for (int32_t i = 0; i < v->ndim; i++) {
    int64_t s = rr(0, 12) == 0 ? 0 : rr(1, maxsize);
    if (n * s > MAX_NUMEL / 4)
      s = 1;
    v->shape[i] = s;
    n *= s > 0 ? s : 1;
  }
  int kind = (int)rr(0, 3);
  if (kind <= 1) { /* contiguous, or contiguous in a random dim order */
    int32_t order[TD_MAX_DIMS];
    for (int32_t i = 0; i < v->ndim; i++)
      order[i] = i;
    for (int32_t i = v->ndim - 1; kind == 1 && i > 0; i--) {
      int32_t k = (int32_t)rr(0, i), t = order[i];
      order[i] = order[k];
      order[k] = t;
    }
    int64_t s = 1;
    for (int32_t i = v->ndim - 1; i >= 0; i--) {
      v->stride[order[i]] = s;
      s *= v->shape[order[i]] > 0 ? v->shape[order[i]] : 1;
    }
  } else {
    for (int32_t i = 0; i < v->ndim; i++)
      v->stride[i] = rr(0, 3) == 0 ? 0 : rr(1, 12);
  }
  v->offset = rr(0, 3) == 0 ? 0 : rr(0, 20);
}

/* A dim for a view of n dims: mostly in range, sometimes not. */
static int32_t random_dim(int32_t n) {
  if (rr(0, 15) == 0)
    return (int32_t)(rr(0, 1) ? n + rr(0, 2) : -n - 1 - rr(0, 2));
  if (n == 0)
    return (int32_t)rr(-1, 0);
  return (int32_t)rr(-n, n - 1);
}

static int wrap(int32_t *d, int32_t n) {
  if (n == 0 || *d < -n || *d >= n)
    return -1;
  if (*d < 0)
    *d += n;
  return 0;
}

/* Whether a view of nd dims with shape exists over r's elements in the same
 * row-major order, by brute force: the strides are the offset steps of the
 * unit indexes; they must be non-negative and reproduce every element. */
static int brute_reshapable(const ref *r, int32_t nd, const int64_t *shape,
                            int64_t *stride) {
  int64_t idx[TD_MAX_DIMS];
  for (int32_t d = 0; d < nd; d++) {
    stride[d] = 0;
    if (shape[d] < 2)
      continue;
    memset(idx, 0, sizeof(idx));
    idx[d] = 1;
    stride[d] = r->off[ravel(nd, shape, idx)] - r->off[0];
    if (stride[d] < 0)
      return 0;
  }
  for (int64_t j = 0; j < r->n; j++) {
    unravel(j, nd, shape, idx);
    int64_t o = r->off[0];
    for (int32_t d = 0; d < nd; d++)
      o += idx[d] * stride[d];
    if (o != r->off[j])
      return 0;
  }
  return 1;
}

/* Draws a shape for reshape of n elements: factors of n in random dims,
 * size-1 dims, sometimes a -1, sometimes a wrong count. */
static int32_t random_reshape(int64_t n, int64_t *shape) {
  int32_t nd = (int32_t)rr(0, 5);
  int64_t left = n;
  for (int32_t i = 0; i < nd; i++) {
    int64_t s = 1;
    if (n == 0) {
      s = rr(0, 3);
    } else if (rr(0, 3) > 0) {
      for (int t = 0; t < 8; t++) {
        int64_t f = rr(1, 6);
        if (left % f == 0) {
          s = f;
          break;
        }
      }
    }
    shape[i] = s;
    if (n > 0)
      left /= s;
  }
  if (nd > 0 && n > 0)
    shape[rr(0, nd - 1)] *= left;
  else if (n > 0 && left != 1)
    nd = -1; /* caller draws again */
  if (nd > 0 && rr(0, 3) == 0)
    shape[rr(0, nd - 1)] = -1;
  if (nd > 0 && rr(0, 9) == 0)
    shape[rr(0, nd - 1)] += rr(-1, 1);
  if (nd > 1 && rr(0, 19) == 0)
    shape[0] = shape[1] = -1;
  return nd;
}

/* Draws an op for v, works out what it must return (*want) and, when that
 * is 0, the reference result. Returns 0, or -1 to skip (too many elements). */
static int draw_op(const td_view *v, const ref *r, op *o, int *want, ref *out) {
  memset(o, 0, sizeof(*o));
  o->kind = (int)rr(0, OP_COUNT - 1);
  int32_t n = v->ndim;
  int64_t es = r->es;
  int32_t nd = n;
  int64_t shape[TD_MAX_DIMS];
  memcpy(shape, v->shape, sizeof(shape));
  *want = 0;
  switch (o->kind) {
  case OP_TRANSPOSE: {
    o->d0 = random_dim(n);
    o->d1 = random_dim(n);
    int32_t a = o->d0, b = o->d1, m = n > 0 ? n : 1;
    if (a < -m || a >= m || b < -m || b >= m) {
      *want = TD_EINVAL;
      break;
    }
    if (n == 0) { /* a no-op */
      op ro = *o;
      ro.kind = OP_SQUEEZE_ALL;
      ref_apply(r, &ro, 0, shape, es, out);
      return 0;
    }
    wrap(&a, n);
    wrap(&b, n);
    shape[a] = v->shape[b];
    shape[b] = v->shape[a];
    op ro = *o;
    ro.d0 = a;
    ro.d1 = b;
    ref_apply(r, &ro, nd, shape, es, out);
    return 0;
  }
  case OP_PERMUTE: {
    for (int32_t i = 0; i < n; i++)
      o->dims[i] = i;
    for (int32_t i = n - 1; i > 0; i--) {
      int32_t k = (int32_t)rr(0, i), t = o->dims[i];
      o->dims[i] = o->dims[k];
      o->dims[k] = t;
    }
    for (int32_t i = 0; i < n; i++)
      if (rr(0, 1))
        o->dims[i] -= n;
    if (n > 1 && rr(0, 9) == 0)
      o->dims[0] = o->dims[1] < 0 ? o->dims[1] + n : o->dims[1] - n;
    if (n > 0 && rr(0, 19) == 0)
      o->dims[0] = n;
    op ro = *o;
    uint32_t seen = 0;
    for (int32_t i = 0; i < n; i++) {
      if (wrap(&ro.dims[i], n) < 0 || (seen & (1u << ro.dims[i]))) {
        *want = TD_EINVAL;
        break;
      }
      seen |= 1u << ro.dims[i];
      shape[i] = v->shape[ro.dims[i]];
    }
    if (*want == 0)
      ref_apply(r, &ro, nd, shape, es, out);
    return 0;
  }
  case OP_NARROW:
  case OP_SELECT:
  case OP_SLICE: {
    o->d0 = random_dim(n);
    int32_t d = o->d0;
    if (wrap(&d, n) < 0) {
      *want = TD_EINVAL;
      return 0;
    }
    int64_t size = v->shape[d];
    op ro = *o;
    ro.d0 = d;
    if (o->kind == OP_NARROW) {
      o->a = rr(-size - 1, size + 1);
      o->b = rr(0, 15) == 0 ? rr(-2, -1) : rr(0, size + 1);
      int64_t start = o->a;
      if (o->b < 0) {
        *want = TD_EINVAL;
      } else if (start < -size || start > size) {
        *want = TD_ERANGE;
      } else {
        if (start < 0)
          start += size;
        if (start + o->b > size)
          *want = TD_ERANGE;
      }
      ro.a = start;
      shape[d] = o->b;
    } else if (o->kind == OP_SELECT) {
      o->a = rr(-size - 1, size);
      if (o->a < -size || o->a >= size) {
        *want = TD_ERANGE;
        return 0;
      }
      ro.a = o->a < 0 ? o->a + size : o->a;
      for (int32_t i = d; i + 1 < n; i++)
        shape[i] = shape[i + 1];
      nd = n - 1;
    } else {
      o->a = rr(0, 5) == 0 ? INT64_MIN : rr(-size - 2, size + 2);
      o->b = rr(0, 5) == 0 ? INT64_MAX : rr(-size - 2, size + 2);
      o->c = rr(0, 15) == 0 ? rr(-1, 0) : rr(1, 4);
      if (o->c < 1) {
        *want = TD_EINVAL;
        return 0;
      }
      /* Python's slice.indices for a positive step. */
      int64_t start = o->a, stop = o->b;
      if (start < 0)
        start = start + size < 0 ? 0 : start + size;
      if (stop < 0)
        stop = stop + size < 0 ? 0 : stop + size;
      if (start > size)
        start = size;
      if (stop > size)
        stop = size;
      int64_t len = stop > start ? (stop - start + o->c - 1) / o->c : 0;
      ro.a = start;
      ro.c = o->c;
      shape[d] = len;
    }
    if (*want == 0)
      ref_apply(r, &ro, nd, shape, es, out);
    return 0;
  }
  case OP_UNSQUEEZE: {
    o->d0 = random_dim(n + 1);
    int32_t d = o->d0;
    if (wrap(&d, n + 1) < 0 || n == TD_MAX_DIMS) {
      *want = TD_EINVAL;
      return 0;
    }
    for (int32_t i = n; i > d; i--)
      shape[i] = shape[i - 1];
    shape[d] = 1;
    ref_apply(r, o, n + 1, shape, es, out);
    return 0;
  }
  case OP_SQUEEZE: {
    o->d0 = random_dim(n);
    int32_t d = o->d0;
    if (wrap(&d, n > 0 ? n : 1) < 0) {
      *want = TD_EINVAL;
      return 0;
    }
    if (n > 0 && v->shape[d] == 1) {
      for (int32_t i = d; i + 1 < n; i++)
        shape[i] = shape[i + 1];
      nd = n - 1;
    }
    ref_apply(r, o, nd, shape, es, out);
    return 0;
  }
  case OP_SQUEEZE_ALL:
    nd = 0;
    for (int32_t i = 0; i < n; i++)
      if (v->shape[i] != 1)
        shape[nd++] = v->shape[i];
    ref_apply(r, o, nd, shape, es, out);
    return 0;
  case OP_EXPAND: {
    o->nd = n + (int32_t)rr(0, 2);
    if (o->nd > TD_MAX_DIMS || rr(0, 19) == 0)
      o->nd = n - 1;
    if (o->nd < 0) {
      *want = TD_EINVAL;
      o->nd = -1;
      return 0;
    }
    int32_t lead = o->nd - n;
    for (int32_t i = 0; i < o->nd; i++) {
      if (i < lead) {
        o->shape[i] = rr(0, 15) == 0 ? -1 : rr(0, 9) == 0 ? 0 : rr(1, 3);
      } else {
        int64_t s = v->shape[i - lead];
        o->shape[i] = rr(0, 3) == 0 ? -1 : s == 1 ? rr(0, 3) : s;
        if (rr(0, 29) == 0)
          o->shape[i] = s + rr(1, 2);
      }
    }
    if (o->nd < n) {
      *want = TD_EINVAL;
      return 0;
    }
    for (int32_t i = 0; i < o->nd; i++) {
      int64_t t = o->shape[i];
      int64_t s = i < lead ? 1 : v->shape[i - lead];
      if (t == -1) {
        if (i < lead) {
          *want = TD_EINVAL;
          return 0;
        }
        t = s;
      }
      if (t != s && s != 1) {
        *want = TD_EINVAL;
        return 0;
      }
      shape[i] = t;
    }
    if (count(o->nd, shape) > MAX_NUMEL)
      return -1;
    ref_apply(r, o, o->nd, shape, es, out);
    return 0;
  }
  case OP_RESHAPE: {
    int64_t numel = r->n;
    do
      o->nd = random_reshape(numel, o->shape);
    while (o->nd < 0);
    int32_t infer = -1;
    int64_t newsize = 1;
    for (int32_t i = 0; i < o->nd; i++) {
      if (o->shape[i] == -1) {
        if (infer >= 0) {
          *want = TD_EINVAL;
          return 0;
        }
        infer = i;
      } else if (o->shape[i] < 0) {
        *want = TD_EINVAL;
        return 0;
      } else {
        newsize *= o->shape[i];
      }
      shape[i] = o->shape[i];
    }
    if (numel == newsize ||
        (infer >= 0 && newsize > 0 && numel % newsize == 0)) {
      if (infer >= 0) {
        if (newsize == 0) {
          *want = TD_EINVAL;
          return 0;
        }
        shape[infer] = numel / newsize;
      }
    } else {
      *want = TD_EINVAL;
      return 0;
    }
    int64_t st[TD_MAX_DIMS];
    if (numel > 0 && n > 0 && !brute_reshapable(r, o->nd, shape, st)) {
      *want = TD_EINVAL;
      return 0;
    }
    ref_apply(r, o, o->nd, shape, es, out);
    return 0;
  }
  case OP_AS_STRIDED: {
    td_view nv;
    random_view(&nv, 5, 4);
    nv.dtype = v->dtype;
    o->nd = nv.ndim;
    memcpy(o->shape, nv.shape, sizeof(o->shape));
    memcpy(o->stride, nv.stride, sizeof(o->stride));
    o->offset = nv.offset;
    if (o->nd > 0 && rr(0, 19) == 0) {
      o->stride[rr(0, o->nd - 1)] = -1;
      *want = TD_EINVAL;
      return 0;
    }
    if (rr(0, 29) == 0) {
      o->offset = -1;
      *want = TD_EINVAL;
      return 0;
    }
    ref_from_view(&nv, out);
    return 0;
  }
  case OP_REINTERPRET: {
    o->dtype = rr(0, 29) == 0 ? TD_DTYPE_COUNT_ : random_dtype();
    int64_t to = (int64_t)td_dtype_size(o->dtype);
    if (to == 0) {
      *want = TD_EINVAL;
      return 0;
    }
    if (to != es) {
      if (n == 0 || v->stride[n - 1] != 1) {
        *want = TD_EINVAL;
        return 0;
      }
      if (to > es) {
        int64_t q = to / es;
        int bad = v->shape[n - 1] % q != 0 || v->offset % q != 0;
        for (int32_t i = 0; i + 1 < n; i++)
          bad |= v->stride[i] % q != 0;
        if (bad) {
          *want = TD_EINVAL;
          return 0;
        }
        shape[n - 1] /= q;
      } else {
        shape[n - 1] *= es / to;
      }
    }
    if (count(n, shape) > MAX_NUMEL)
      return -1;
    ref_apply(r, o, n, shape, to, out);
    return 0;
  }
  }
  return 0;
}

static int call_op(td_view *v, const op *o) {
  switch (o->kind) {
  case OP_TRANSPOSE:
    return td_view_transpose(v, o->d0, o->d1);
  case OP_PERMUTE:
    return td_view_permute(v, o->dims);
  case OP_NARROW:
    return td_view_narrow(v, o->d0, o->a, o->b);
  case OP_SELECT:
    return td_view_select(v, o->d0, o->a);
  case OP_SLICE:
    return td_view_slice(v, o->d0, o->a, o->b, o->c);
  case OP_UNSQUEEZE:
    return td_view_unsqueeze(v, o->d0);
  case OP_SQUEEZE:
    return td_view_squeeze(v, o->d0);
  case OP_SQUEEZE_ALL:
    return td_view_squeeze_all(v);
  case OP_EXPAND:
    return td_view_expand(v, o->nd, o->shape);
  case OP_RESHAPE:
    return td_view_reshape(v, o->nd, o->shape);
  case OP_AS_STRIDED:
    return td_view_as_strided(v, o->nd, o->shape, o->stride, o->offset);
  case OP_REINTERPRET:
    return td_view_reinterpret(v, o->dtype);
  }
  return -1;
}

/* Runs chains of random ops from random views of at most maxnd dims. */
static void run_chains(int chains, int steps, int32_t maxnd, int64_t maxsize) {
  int done[OP_COUNT][2] = {{0}};
  for (int c = 0; c < chains; c++) {
    td_view v;
    ref r;
    random_view(&v, maxnd, maxsize);
    ref_from_view(&v, &r);
    char vb[512];
    snprintf(ctx, sizeof(ctx), "chain %d from %s", c,
             td_view_format(&v, vb, sizeof(vb)));
    expect_matches(&v, &r);
    int64_t limit = brute_bound(&v, &r); /* the storage it fits */
    for (int s = 0; s < steps; s++) {
      op o;
      int want;
      ref out = {0};
      if (draw_op(&v, &r, &o, &want, &out) < 0) {
        ref_free(&out);
        continue;
      }
      td_view before = v;
      int got = call_op(&v, &o);
      size_t len = strlen(ctx);
      snprintf(ctx + len, sizeof(ctx) - len, " -> %s", op_names[o.kind]);
      if (got != want)
        FAILF("%s returned %d (%s), expected %d: %s", op_names[o.kind], got,
              td_err_name(got), want, td_view_last_error());
      done[o.kind][got == 0]++;
      if (got < 0) {
        if (memcmp(&before, &v, sizeof(v)) != 0)
          FAILF("failed %s changed the view", op_names[o.kind]);
        if (strstr(td_view_last_error(), op_names[o.kind]) == NULL)
          FAILF("message '%s' does not name %s", td_view_last_error(),
                op_names[o.kind]);
        ref_free(&out);
        continue;
      }
      ref_free(&r);
      r = out;
      expect_matches(&v, &r);
      if (o.kind == OP_AS_STRIDED)
        limit = brute_bound(&v, &r);
      else if (td_view_check(&v, (size_t)limit) != 0)
        FAILF("%s made a view that no longer fits %lld bytes: %s",
              op_names[o.kind], (long long)limit, td_view_last_error());
      if (strlen(ctx) > 700) /* keep the tail of long chains */
        snprintf(ctx, sizeof(ctx), "chain %d ...", c);
    }
    ref_free(&r);
  }
  for (int k = 0; k < OP_COUNT; k++)
    cr_expect((done[k][0] > 0 || k == OP_SQUEEZE_ALL) && done[k][1] > 0,
              "seed %" PRIu64 ": %s ran %d times ok and %d times failing", seed,
              op_names[k], done[k][1], done[k][0]);
}

Test(view, random_chains_match_the_reference, .timeout = 120) {
  seed_rng();
  run_chains(10000, 12, 5, 5);
}

Test(view, random_chains_of_many_dims, .timeout = 120) {
  seed_rng();
  run_chains(2000, 16, TD_MAX_DIMS, 2);
}

Test(view, sixteen_dims) {
  seed_rng();
  int64_t shape[TD_MAX_DIMS];
  for (int i = 0; i < TD_MAX_DIMS; i++)
    shape[i] = i % 3 == 0 ? 2 : 1;
  td_view v, before;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, TD_MAX_DIMS, shape, &v), 0);
  before = v;
  cr_assert_eq(td_view_unsqueeze(&v, 0), TD_EINVAL);
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0);
  cr_assert(strstr(td_view_last_error(), "16") != NULL);
  int32_t dims[TD_MAX_DIMS];
  for (int i = 0; i < TD_MAX_DIMS; i++)
    dims[i] = TD_MAX_DIMS - 1 - i;
  cr_assert_eq(td_view_permute(&v, dims), 0);
  cr_assert_eq(v.stride[0], 1);
  cr_assert_eq(td_view_transpose(&v, -1, 0), 0);
  cr_assert_eq(td_view_reshape(&v, 1, (int64_t[]){-1}), TD_EINVAL,
               "a reversed view cannot be flattened");
  cr_assert_eq(td_view_permute(&v, dims), 0);
  cr_assert_eq(td_view_transpose(&v, -1, 0), 0);
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0, "back where it started");
  cr_assert_eq(td_view_reshape(&v, 1, (int64_t[]){-1}), 0);
  cr_assert_eq(v.shape[0], 64);
  cr_assert_eq(td_view_expand(&v, TD_MAX_DIMS,
                              (int64_t[TD_MAX_DIMS]){1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     1, 1, 1, 1, 1, 2, -1}),
               0);
  cr_assert_eq(v.ndim, TD_MAX_DIMS);
  cr_assert_eq(v.stride[14], 0);
  cr_assert_eq(td_view_check(&v, 256), 0);
}

Test(view, zero_dim_views) {
  td_view v, before;
  cr_assert_eq(td_view_contiguous(TD_FLOAT64, 0, NULL, &v), 0);
  v.offset = 3;
  before = v;
  cr_assert_eq(td_view_numel(&v), 1);
  cr_assert_eq(td_view_is_contiguous(&v), 1);
  cr_assert_eq(td_view_transpose(&v, 0, -1), 0, "a scalar has dim 0 and -1");
  cr_assert_eq(td_view_squeeze(&v, 0), 0);
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), TD_EINVAL);
  cr_assert_eq(td_view_narrow(&v, 0, 0, 1), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "0-d") != NULL, "%s",
            td_view_last_error());
  cr_assert_eq(td_view_select(&v, 0, 0), TD_EINVAL);
  cr_assert_eq(td_view_slice(&v, 0, 0, 1, 1), TD_EINVAL);
  cr_assert_eq(td_view_reinterpret(&v, TD_FLOAT32), TD_EINVAL);
  cr_assert_eq(td_view_reinterpret(&v, TD_INT64), 0);
  int64_t off = -1;
  cr_assert_eq(td_view_offset_of(&v, NULL, &off), 0);
  cr_assert_eq(off, 3);
  cr_assert_eq(td_view_unsqueeze(&v, -1), 0);
  cr_assert_eq(v.ndim, 1);
  cr_assert_eq(v.shape[0], 1);
  cr_assert_eq(v.stride[0], 1);
  cr_assert_eq(td_view_squeeze_all(&v), 0);
  cr_assert_eq(v.ndim, 0);
  cr_assert_eq(td_view_expand(&v, 2, (int64_t[]){3, 2}), 0);
  cr_assert_eq(v.stride[0], 0);
  cr_assert_eq(v.stride[1], 0);
  cr_assert_eq(td_view_check(&v, 32), 0, "all six elements are element 3");
  cr_assert_eq(td_view_check(&v, 31), TD_ERANGE);
  cr_assert_eq(td_view_reshape(&before, 3, (int64_t[]){1, -1, 1}), 0);
  cr_assert_eq(before.stride[0] + before.stride[1] + before.stride[2], 3);
}

Test(view, empty_views) {
  int64_t shape[3] = {4, 0, 3};
  td_view v, before;
  cr_assert_eq(td_view_contiguous(TD_INT16, 3, shape, &v), 0);
  cr_assert_eq(v.stride[0], 3, "PyTorch counts a 0 as 1 in strides");
  cr_assert_eq(v.stride[1], 3);
  cr_assert_eq(td_view_numel(&v), 0);
  cr_assert_eq(td_view_is_contiguous(&v), 1);
  cr_assert_eq(td_view_check(&v, 0), 0);
  before = v;
  cr_assert_eq(td_view_select(&v, 1, 0), TD_ERANGE);
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0);
  cr_assert_eq(td_view_narrow(&v, 0, 2, 2), 0);
  cr_assert_eq(v.offset, 0, "an empty result keeps its offset");
  cr_assert_eq(td_view_reshape(&v, 2, (int64_t[]){0, 5}), 0);
  cr_assert_eq(v.stride[0], 5);
  cr_assert_eq(v.stride[1], 1);
  cr_assert_eq(td_view_reshape(&v, 2, (int64_t[]){-1, 0}), TD_EINVAL,
               "-1 is ambiguous for 0 elements when another size is 0");
  cr_assert(strstr(td_view_last_error(), "could be anything") != NULL);
  cr_assert_eq(td_view_reshape(&v, 2, (int64_t[]){-1, 5}), 0);
  cr_assert_eq(v.shape[0], 0);
  /* A non-empty view narrowed to nothing at its end stays inside. */
  int64_t s1[1] = {3};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, s1, &v), 0);
  cr_assert_eq(td_view_slice(&v, 0, 0, INT64_MAX, 2), 0);
  cr_assert_eq(v.shape[0], 2);
  cr_assert_eq(td_view_narrow(&v, 0, 2, 0), 0);
  cr_assert_eq(td_view_check(&v, 12), 0);
}

/* ---- PyTorch's view rules, case by case ---- */

typedef struct reshape_case {
  const char *what;
  int32_t ndim;
  int64_t shape[4], stride[4];
  int32_t nnew;
  int64_t want[4];
  int ok;
  int64_t shape_out[4], stride_out[4];
} reshape_case;

/* Expected results worked out by hand with aten's infer_size and
 * computeStride (aten/src/ATen/TensorUtils.cpp), the code behind
 * torch.Tensor.view. */
static const reshape_case reshape_cases[] = {
    {"contiguous merge",
     3,
     {2, 3, 4},
     {12, 4, 1},
     2,
     {6, 4},
     1,
     {6, 4},
     {4, 1}},
    {"contiguous flatten", 3, {2, 3, 4}, {12, 4, 1}, 1, {-1}, 1, {24}, {1}},
    {"contiguous split with -1",
     3,
     {2, 3, 4},
     {12, 4, 1},
     3,
     {4, -1, 2},
     1,
     {4, 3, 2},
     {6, 2, 1}},
    {"transposed flatten", 2, {4, 3}, {1, 4}, 1, {12}, 0, {0}, {0}},
    {"transposed add size-1",
     2,
     {4, 3},
     {1, 4},
     3,
     {4, 3, 1},
     1,
     {4, 3, 1},
     {1, 4, 4}},
    {"transposed split dim 0",
     2,
     {4, 3},
     {1, 4},
     3,
     {2, 2, 3},
     1,
     {2, 2, 3},
     {2, 1, 4}},
    {"transposed same shape", 2, {4, 3}, {1, 4}, 2, {4, 3}, 1, {4, 3}, {1, 4}},
    {"transposed merge 3-d",
     3,
     {4, 2, 3},
     {1, 12, 4},
     2,
     {4, 6},
     1,
     {4, 6},
     {1, 4}},
    {"transposed merge wrong pair",
     3,
     {4, 2, 3},
     {1, 12, 4},
     2,
     {8, 3},
     0,
     {0},
     {0}},
    {"expanded flatten", 2, {2, 3}, {0, 1}, 1, {6}, 0, {0}, {0}},
    {"expanded add trailing 1",
     2,
     {2, 3},
     {0, 1},
     3,
     {2, 3, 1},
     1,
     {2, 3, 1},
     {0, 1, 1}},
    {"expanded add leading 1",
     2,
     {2, 3},
     {0, 1},
     3,
     {1, 2, 3},
     1,
     {1, 2, 3},
     {0, 0, 1}},
    {"expanded add middle 1",
     2,
     {2, 3},
     {0, 1},
     3,
     {2, 1, 3},
     1,
     {2, 1, 3},
     {0, 3, 1}},
    {"expanded split", 1, {4}, {0}, 2, {2, 2}, 1, {2, 2}, {0, 0}},
    {"narrowed columns flatten", 2, {4, 4}, {6, 1}, 1, {16}, 0, {0}, {0}},
    {"narrowed columns split rows",
     2,
     {4, 4},
     {6, 1},
     3,
     {2, 2, 4},
     1,
     {2, 2, 4},
     {12, 6, 1}},
    {"narrowed columns regroup", 2, {4, 3}, {6, 1}, 2, {2, 6}, 0, {0}, {0}},
    {"narrowed rows flatten", 2, {2, 6}, {6, 1}, 1, {12}, 1, {12}, {1}},
    {"size-1 dim with any stride",
     3,
     {3, 1, 4},
     {4, 100, 1},
     1,
     {12},
     1,
     {12},
     {1}},
    {"all size-1 to 0-d", 2, {1, 1}, {7, 9}, 0, {0}, 1, {0}, {0}},
    {"0-d to 1x1x1", 0, {0}, {0}, 3, {1, 1, 1}, 1, {1, 1, 1}, {1, 1, 1}},
    {"0-d to -1", 0, {0}, {0}, 1, {-1}, 1, {1}, {1}},
    {"empty, new shape", 2, {0, 3}, {3, 1}, 2, {3, 0}, 1, {3, 0}, {1, 1}},
    {"empty, same shape keeps strides",
     2,
     {2, 0},
     {5, 7},
     2,
     {2, 0},
     1,
     {2, 0},
     {5, 7}},
    {"empty, -1 inferred as 0",
     2,
     {0, 3},
     {3, 1},
     2,
     {-1, 3},
     1,
     {0, 3},
     {3, 1}},
    {"empty, -1 ambiguous", 2, {0, 3}, {3, 1}, 2, {-1, 0}, 0, {0}, {0}},
    {"wrong count", 2, {2, 3}, {3, 1}, 1, {4}, 0, {0}, {0}},
    {"two -1", 2, {2, 3}, {3, 1}, 2, {-1, -1}, 0, {0}, {0}},
    {"negative size", 2, {2, 3}, {3, 1}, 2, {-2, 3}, 0, {0}, {0}},
    {"-1 not dividing", 2, {2, 3}, {3, 1}, 2, {-1, 4}, 0, {0}, {0}},
};

Test(view, reshape_follows_pytorch_view_rules) {
  for (size_t i = 0; i < sizeof(reshape_cases) / sizeof(reshape_cases[0]);
       i++) {
    const reshape_case *c = &reshape_cases[i];
    td_view v, before;
    memset(&v, 0, sizeof(v));
    v.dtype = TD_FLOAT32;
    v.ndim = c->ndim;
    memcpy(v.shape, c->shape, (size_t)c->ndim * sizeof(int64_t));
    memcpy(v.stride, c->stride, (size_t)c->ndim * sizeof(int64_t));
    v.offset = 5;
    before = v;
    int err = td_view_reshape(&v, c->nnew, c->want);
    if (!c->ok) {
      cr_expect_eq(err, TD_EINVAL, "%s: got %d", c->what, err);
      cr_expect_eq(memcmp(&v, &before, sizeof(v)), 0, "%s: changed", c->what);
      cr_expect(strstr(td_view_last_error(), "reshape") != NULL, "%s: '%s'",
                c->what, td_view_last_error());
      continue;
    }
    cr_expect_eq(err, 0, "%s: %s", c->what, td_view_last_error());
    if (err != 0)
      continue;
    cr_expect_eq(v.ndim, c->nnew, "%s", c->what);
    cr_expect_eq(v.offset, 5, "%s: offset kept", c->what);
    for (int32_t d = 0; d < c->nnew; d++) {
      cr_expect_eq(v.shape[d], c->shape_out[d], "%s: size %d", c->what, d);
      cr_expect_eq(v.stride[d], c->stride_out[d], "%s: stride %d: %lld",
                   c->what, d, (long long)v.stride[d]);
    }
  }
}

/* ---- the other ops, case by case ---- */

Test(view, ops_match_pytorch_examples) {
  int64_t shape[2] = {6, 8};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), 0);
  cr_assert_eq(td_view_narrow(&v, 0, 2, 4), 0);
  char b[256];
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "float32[4, 6] stride (1, 8) offset 2");
  cr_assert_eq(td_view_is_contiguous(&v), 0);
  /* x[:, 1::2] */
  cr_assert_eq(td_view_slice(&v, -1, 1, INT64_MAX, 2), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "float32[4, 3] stride (1, 16) offset 10");
  /* x[-1] */
  cr_assert_eq(td_view_select(&v, 0, -1), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "float32[3] stride (16) offset 13");
  /* unsqueeze strides as PyTorch: size * stride of the dim it precedes */
  cr_assert_eq(td_view_unsqueeze(&v, 0), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "float32[1, 3] stride (48, 16) offset 13");
  cr_assert_eq(td_view_unsqueeze(&v, 2), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "float32[1, 3, 1] stride (48, 16, 1) offset 13");
  cr_assert_eq(td_view_squeeze(&v, 1), 0, "squeeze of a non-1 dim: no-op");
  cr_assert_eq(v.ndim, 3);
  cr_assert_eq(td_view_expand(&v, 4, (int64_t[]){5, 2, -1, 7}), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "float32[5, 2, 3, 7] stride (0, 0, 16, 0) offset 13");
  /* permute(2, 0, 1) of a contiguous [2, 3, 4] */
  int64_t s3[3] = {2, 3, 4};
  cr_assert_eq(td_view_contiguous(TD_INT8, 3, s3, &v), 0);
  cr_assert_eq(td_view_permute(&v, (int32_t[]){2, 0, -2}), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "int8[4, 2, 3] stride (1, 12, 4) offset 0");
  /* expand's new leading size-1 dim: stride = size * stride of the next */
  int64_t s1[1] = {3};
  cr_assert_eq(td_view_contiguous(TD_INT8, 1, s1, &v), 0);
  cr_assert_eq(td_view_expand(&v, 2, (int64_t[]){1, 3}), 0);
  cr_assert_eq(v.stride[0], 3);
}

Test(view, reinterpret_follows_view_dtype) {
  int64_t shape[2] = {3, 4};
  td_view v, before;
  char b[256];
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_narrow(&v, 0, 1, 2), 0);
  cr_assert_eq(td_view_reinterpret(&v, TD_BFLOAT16), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "bfloat16[2, 8] stride (8, 1) offset 8");
  cr_assert_eq(td_view_reinterpret(&v, TD_COMPLEX128), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "complex128[2, 1] stride (1, 1) offset 1");
  cr_assert_eq(td_view_reinterpret(&v, TD_UINT8), 0);
  cr_assert_str_eq(td_view_format(&v, b, sizeof(b)),
                   "uint8[2, 16] stride (16, 1) offset 16");
  cr_assert_eq(td_view_reinterpret(&v, TD_INT16), 0);
  cr_assert_eq(td_view_reinterpret(&v, TD_FLOAT16), 0, "same size");
  cr_assert_eq(v.dtype, TD_FLOAT16);
  /* Refusals. */
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_narrow(&v, 1, 1, 3), 0);
  before = v;
  cr_assert_eq(td_view_reinterpret(&v, TD_FLOAT64), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "size 3") != NULL, "%s",
            td_view_last_error());
  cr_assert_eq(td_view_narrow(&v, 1, 0, 2), 0);
  before = v; /* offset 1, size 2 */
  cr_assert_eq(td_view_reinterpret(&v, TD_FLOAT64), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "offset 1") != NULL, "%s",
            td_view_last_error());
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0);
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, (int64_t[]){3, 4}, &v), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), 0);
  before = v;
  cr_assert_eq(td_view_reinterpret(&v, TD_UINT8), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "stride 4") != NULL, "%s",
            td_view_last_error());
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0);
  cr_assert_eq(td_view_contiguous(TD_INT8, 2, (int64_t[]){3, 12}, &v), 0);
  cr_assert_eq(td_view_narrow(&v, 1, 0, 8), 0);
  before = v; /* row stride 12 is not divisible by 8 */
  cr_assert_eq(td_view_reinterpret(&v, TD_INT64), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "dim 0") != NULL, "%s",
            td_view_last_error());
  cr_assert_eq(td_view_reinterpret(&v, TD_DTYPE_INVALID), TD_EINVAL);
  cr_assert_eq(td_view_reinterpret(&v, (td_dtype)99), TD_EINVAL);
  cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0);
}

/* ---- bad input: the right code, a message, the view unchanged ---- */

/* Runs call on v, expecting code, a message holding needle, and v as it
 * was (before). */
#define BAD(call, code, needle)                                                \
  do {                                                                         \
    int e_ = (call);                                                           \
    cr_expect_eq(e_, code, "%s: got %d (%s)", #call, e_, td_err_name(e_));     \
    cr_expect(strstr(td_view_last_error(), needle) != NULL,                    \
              "%s: message '%s' lacks '%s'", #call, td_view_last_error(),      \
              needle);                                                         \
    cr_expect_eq(memcmp(&v, &before, sizeof(v)), 0, "%s changed the view",     \
                 #call);                                                       \
  } while (0)

Test(view, bad_input_is_refused_and_leaves_the_view) {
  int64_t shape[3] = {2, 3, 4};
  td_view v, before;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 3, shape, &v), 0);
  before = v;
  BAD(td_view_transpose(&v, 0, 3), TD_EINVAL,
      "transpose: dim 3 out of range for a 3-d view (expected -3..2)");
  BAD(td_view_transpose(&v, -4, 0), TD_EINVAL, "dim -4");
  BAD(td_view_permute(&v, (int32_t[]){0, 1, -3}), TD_EINVAL,
      "dim 0 appears twice");
  BAD(td_view_permute(&v, (int32_t[]){0, 1, 5}), TD_EINVAL, "dim 5");
  BAD(td_view_permute(&v, NULL), TD_EINVAL, "NULL");
  BAD(td_view_narrow(&v, 1, 0, -1), TD_EINVAL, "negative length -1");
  BAD(td_view_narrow(&v, 1, 4, 0), TD_ERANGE, "dim 1: start 4 outside -3..3");
  BAD(td_view_narrow(&v, 2, 2, 3), TD_ERANGE,
      "dim 2: start 2 + length 3 exceeds the dim's size 4");
  BAD(td_view_narrow(&v, 3, 0, 1), TD_EINVAL, "dim 3");
  BAD(td_view_select(&v, 1, 3), TD_ERANGE,
      "dim 1: index 3 out of range for size 3");
  BAD(td_view_select(&v, 1, -4), TD_ERANGE, "index -4");
  BAD(td_view_slice(&v, 0, 0, 2, 0), TD_EINVAL, "step 0");
  BAD(td_view_slice(&v, 0, 0, 2, -1), TD_EINVAL, "step -1");
  BAD(td_view_slice(&v, 0, 0, 2, INT64_MAX), TD_EINVAL, "overflows");
  BAD(td_view_unsqueeze(&v, 4), TD_EINVAL, "dim 4");
  BAD(td_view_squeeze(&v, -4), TD_EINVAL, "dim -4");
  BAD(td_view_expand(&v, 3, (int64_t[]){2, 6, 4}), TD_EINVAL,
      "dim 1 of size 3 cannot become 6");
  BAD(td_view_expand(&v, 2, (int64_t[]){3, 4}), TD_EINVAL, "2 sizes");
  BAD(td_view_expand(&v, 4, (int64_t[]){-1, 2, 3, 4}), TD_EINVAL,
      "size -1 at dim 0");
  BAD(td_view_expand(&v, 4, (int64_t[]){-2, 2, 3, 4}), TD_EINVAL,
      "invalid size -2");
  BAD(td_view_expand(&v, 17, shape), TD_EINVAL, "17 sizes");
  BAD(td_view_reshape(&v, 2, (int64_t[]){5, 5}), TD_EINVAL,
      "shape [5, 5] is invalid for a view of 24 elements");
  BAD(td_view_reshape(&v, 2, (int64_t[]){-1, -1}), TD_EINVAL,
      "only one dim can be inferred");
  BAD(td_view_reshape(&v, 2, (int64_t[]){-3, 8}), TD_EINVAL, "size -3");
  BAD(td_view_reshape(&v, 3, (int64_t[]){INT64_MAX, 2, 2}), TD_EINVAL,
      "overflows");
  BAD(td_view_reshape(&v, 17, shape), TD_EINVAL, "ndim 17");
  BAD(td_view_as_strided(&v, 1, (int64_t[]){2}, (int64_t[]){-1}, 0), TD_EINVAL,
      "negative stride -1");
  BAD(td_view_as_strided(&v, 1, (int64_t[]){-2}, (int64_t[]){1}, 0), TD_EINVAL,
      "negative size -2");
  BAD(td_view_as_strided(&v, 1, (int64_t[]){2}, (int64_t[]){1}, -1), TD_EINVAL,
      "negative offset -1");
  BAD(td_view_as_strided(&v, 2, (int64_t[]){3, 2},
                         (int64_t[]){INT64_MAX / 2, 1}, 0),
      TD_EINVAL, "overflows");
  BAD(td_view_as_strided(&v, 1, (int64_t[]){1}, (int64_t[]){1}, INT64_MAX / 2),
      TD_EINVAL, "overflows");
  BAD(td_view_as_strided(&v, 17, shape, shape, 0), TD_EINVAL, "ndim 17");
  BAD(td_view_reinterpret(&v, TD_DTYPE_INVALID), TD_EINVAL, "unknown dtype 0");
  BAD(td_view_reinterpret(&v, (td_dtype)99), TD_EINVAL, "unknown dtype 99");
  BAD(td_view_offset_of(&v, (int64_t[]){0, 3, 0}, &shape[0]), TD_ERANGE,
      "dim 1: index 3");
  cr_assert_eq(shape[0], 2, "offset_of left its output alone");
  td_view t = v;
  cr_assert_eq(td_view_transpose(&t, 0, 2), 0);
  cr_assert_eq(td_view_reshape(&t, 1, (int64_t[]){-1}), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "without a copy") != NULL, "%s",
            td_view_last_error());
}

Test(view, malformed_views_are_refused_by_every_op) {
  td_view bad;
  memset(&bad, 0, sizeof(bad));
  bad.dtype = TD_FLOAT32;
  bad.ndim = 2;
  bad.shape[0] = 2;
  bad.shape[1] = -1;
  bad.stride[0] = 1;
  bad.stride[1] = 1;
  td_view before = bad;
  int64_t i2[2] = {0, 0}, off = 77;
  int got[] = {
      td_view_is_contiguous(&bad),
      td_view_transpose(&bad, 0, 1),
      td_view_permute(&bad, (int32_t[]){1, 0}),
      td_view_narrow(&bad, 0, 0, 1),
      td_view_select(&bad, 0, 0),
      td_view_slice(&bad, 0, 0, 1, 1),
      td_view_unsqueeze(&bad, 0),
      td_view_squeeze(&bad, 0),
      td_view_squeeze_all(&bad),
      td_view_expand(&bad, 2, (int64_t[]){2, 1}),
      td_view_reshape(&bad, 1, (int64_t[]){-1}),
      td_view_as_strided(&bad, 1, (int64_t[]){1}, (int64_t[]){1}, 0),
      td_view_reinterpret(&bad, TD_INT32),
      td_view_offset_of(&bad, i2, &off),
      (int)td_view_numel(&bad),
      td_view_check(&bad, 1000),
  };
  for (size_t i = 0; i < sizeof(got) / sizeof(got[0]); i++)
    cr_expect_eq(got[i], TD_EINVAL, "op %zu: %d", i, got[i]);
  cr_assert_eq(memcmp(&bad, &before, sizeof(bad)), 0);
  cr_assert_eq(off, 77);
  cr_assert(strstr(td_view_last_error(), "negative size -1") != NULL, "%s",
            td_view_last_error());
  bad.shape[1] = 1;
  bad.ndim = 17;
  cr_assert_eq(td_view_transpose(&bad, 0, 1), TD_EINVAL);
  bad.ndim = 2;
  bad.dtype = (td_dtype)0;
  cr_assert_eq(td_view_transpose(&bad, 0, 1), TD_EINVAL);
  bad.dtype = TD_FLOAT32;
  bad.offset = -2;
  cr_assert_eq(td_view_transpose(&bad, 0, 1), TD_EINVAL);
  cr_assert_eq(td_view_transpose(NULL, 0, 1), TD_EINVAL);
}

Test(view, offset_of_and_overflow) {
  td_view v;
  int64_t shape[2] = {3, 5}, off = -1;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 2, shape, &v), 0);
  cr_assert_eq(td_view_offset_of(&v, (int64_t[]){2, 4}, &off), 0);
  cr_assert_eq(off, 14);
  cr_assert_eq(td_view_offset_of(&v, (int64_t[]){-1, -5}, &off), 0);
  cr_assert_eq(off, 10);
  off = 99;
  cr_assert_eq(td_view_offset_of(&v, (int64_t[]){3, 0}, &off), TD_ERANGE);
  cr_assert_eq(off, 99);
  cr_assert_eq(td_view_offset_of(&v, NULL, &off), TD_EINVAL);
  /* Arithmetic that overflows int64 is refused, not wrapped. */
  td_view h, before;
  memset(&h, 0, sizeof(h));
  h.dtype = TD_UINT8;
  h.ndim = 2;
  h.shape[0] = 4;
  h.shape[1] = 2;
  h.stride[0] = INT64_MAX / 2;
  h.stride[1] = 1;
  before = h;
  cr_assert_eq(td_view_check(&h, SIZE_MAX), TD_EINVAL);
  cr_assert_eq(td_view_select(&h, 0, 3), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "overflows") != NULL);
  cr_assert_eq(td_view_unsqueeze(&h, 0), TD_EINVAL);
  cr_assert_eq(td_view_reinterpret(&h, TD_UINT16), TD_EINVAL, "odd stride");
  h.stride[1] = 1;
  h.shape[1] = 1;
  cr_assert_eq(td_view_reinterpret(&h, TD_UINT8), 0);
  cr_assert_eq(memcmp(&h.shape[2], &before.shape[2], 8), 0);
  td_view w;
  int64_t s1[2] = {2, 2};
  cr_assert_eq(td_view_contiguous(TD_UINT16, 2, s1, &w), 0);
  w.stride[0] = INT64_MAX / 2 + 1;
  cr_assert_eq(td_view_reinterpret(&w, TD_UINT8), TD_EINVAL,
               "stride * 2 overflows");
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, (int64_t[]){INT64_MAX}, &w), 0);
  cr_assert_eq(td_view_contiguous(TD_UINT8, 2, (int64_t[]){INT64_MAX, 2}, &w),
               TD_EINVAL);
}

Test(view, is_contiguous_as_pytorch) {
  td_view v;
  int64_t shape[3] = {2, 1, 3};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 3, shape, &v), 0);
  cr_assert_eq(td_view_is_contiguous(&v), 1);
  v.stride[1] = 42; /* a size-1 dim's stride does not count */
  cr_assert_eq(td_view_is_contiguous(&v), 1);
  v.offset = 7; /* nor does the offset */
  cr_assert_eq(td_view_is_contiguous(&v), 1);
  cr_assert_eq(td_view_transpose(&v, 0, 2), 0);
  cr_assert_eq(td_view_is_contiguous(&v), 0);
  cr_assert_eq(td_view_expand(&v, 3, (int64_t[]){3, 1, 2}), 0);
  cr_assert_eq(td_view_is_contiguous(&v), 0);
}

/* ---- element counts past INT64_MAX ---- */

/* A view of dtype with the given sizes and strides, offset 0. */
static td_view raw_view(td_dtype dtype, int32_t nd, const int64_t *shape,
                        const int64_t *stride) {
  td_view v;
  memset(&v, 0, sizeof(v));
  v.dtype = dtype;
  v.ndim = nd;
  memcpy(v.shape, shape, (size_t)nd * sizeof(int64_t));
  memcpy(v.stride, stride, (size_t)nd * sizeof(int64_t));
  return v;
}

Test(view, element_counts_past_int64_are_refused) {
  /* expand of [1, 1, 1] to [2^62, 2^31, 5]: 5 * 2^93 elements over one
   * float32, as PyTorch refuses ("numel: integer multiplication overflow"). */
  td_view v, before;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 3, (int64_t[]){1, 1, 1}, &v), 0);
  before = v;
  BAD(td_view_expand(&v, 3, (int64_t[]){1LL << 62, 1LL << 31, 5}), TD_EINVAL,
      "[4611686018427387904, 2147483648, 5]");
  cr_expect(strstr(td_view_last_error(), "expand") != NULL, "%s",
            td_view_last_error());
  /* The last count that fits, and one more. */
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, (int64_t[]){1}, &v), 0);
  before = v;
  td_view w = v;
  cr_assert_eq(td_view_expand(&w, 2, (int64_t[]){3, 3074457345618258602}), 0,
               "%s", td_view_last_error());
  cr_assert_eq(td_view_numel(&w), INT64_MAX - 1);
  cr_assert_eq(td_view_check(&w, 4), 0, "%s", td_view_last_error());
  BAD(td_view_expand(&v, 2, (int64_t[]){3, 3074457345618258603}), TD_EINVAL,
      "3074457345618258603");

  /* [2^32, 2^32 + 4] with zero strides: one byte, 2^64 + 2^34 elements. */
  v = raw_view(TD_UINT8, 2, (int64_t[]){1LL << 32, (1LL << 32) + 4},
               (int64_t[]){0, 0});
  before = v;
  BAD(td_view_check(&v, 1), TD_EINVAL, "[4294967296, 4294967300]");
  BAD(td_view_check(&v, SIZE_MAX), TD_EINVAL, "INT64_MAX");
  BAD((int)td_view_numel(&v), TD_EINVAL, "numel");
  /* Such a view is malformed to every op, as a negative size is. */
  BAD(td_view_transpose(&v, 0, 1), TD_EINVAL, "transpose");
  BAD(td_view_narrow(&v, 0, 0, 1), TD_EINVAL, "[4294967296, 4294967300]");
  td_view t;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, (int64_t[]){1}, &t), 0);
  before = v = t;
  BAD(td_view_as_strided(&v, 2, (int64_t[]){1LL << 32, (1LL << 32) + 4},
                         (int64_t[]){0, 0}, 0),
      TD_EINVAL, "as_strided");

  /* reinterpret to a smaller element multiplies the count: complex128
   * [2^59, 2] stride (0, 1) is 2^60 elements, as uint8 [2^59, 32] 2^64. */
  v = raw_view(TD_COMPLEX128, 2, (int64_t[]){1LL << 59, 2}, (int64_t[]){0, 1});
  cr_assert_eq(td_view_check(&v, 32), 0, "%s", td_view_last_error());
  before = v;
  BAD(td_view_reinterpret(&v, TD_UINT8), TD_EINVAL, "[576460752303423488, 32]");
  cr_assert_eq(td_view_reinterpret(&v, TD_FLOAT64), 0, "%s",
               td_view_last_error());
  cr_assert_eq(td_view_numel(&v), 1LL << 61);

  /* A contiguous view whose bytes pass INT64_MAX can never be checked. */
  before = v;
  BAD(td_view_contiguous(TD_FLOAT64, 1, (int64_t[]){1LL << 60}, &v), TD_EINVAL,
      "1152921504606846976 elements of 8 bytes");
  cr_assert_eq(
      td_view_contiguous(TD_FLOAT64, 1, (int64_t[]){(1LL << 60) - 1}, &v), 0);

  /* An empty view has 0 elements, whatever its other sizes and their order. */
  v = raw_view(TD_UINT8, 3, (int64_t[]){1LL << 62, 2, 0}, (int64_t[]){0, 0, 0});
  cr_assert_eq(td_view_numel(&v), 0, "%s", td_view_last_error());
  cr_assert_eq(td_view_check(&v, 0), 0, "%s", td_view_last_error());
  v = raw_view(TD_UINT8, 3, (int64_t[]){0, 1LL << 62, 4}, (int64_t[]){0, 0, 0});
  cr_assert_eq(td_view_numel(&v), 0, "%s", td_view_last_error());
  cr_assert_eq(td_view_check(&v, 0), 0, "%s", td_view_last_error());
  cr_assert_eq(td_view_reshape(&v, 3, (int64_t[]){1LL << 62, 2, 0}), 0, "%s",
               td_view_last_error());
  cr_assert_eq(td_view_reshape(&v, 1, (int64_t[]){0}), 0, "%s",
               td_view_last_error());
  cr_assert_eq(td_view_numel(&v), 0);
}

/* 128-bit arithmetic, saturating far above int64, as an independent judge
 * of counts and extents. */
typedef __int128 wide;
#define WIDE_CAP ((wide)1 << 100)

static wide wmul(wide a, wide b) {
  if (a == 0 || b == 0)
    return 0;
  return a > WIDE_CAP / b ? WIDE_CAP : a * b;
}

static wide wide_numel(const td_view *v) {
  wide n = 1;
  for (int32_t i = 0; i < v->ndim; i++)
    n = wmul(n, v->shape[i]);
  return n;
}

/* The byte a view must not pass: its last element's end, or for an empty
 * view its start. */
static wide wide_end(const td_view *v) {
  wide last = v->offset;
  if (wide_numel(v) == 0)
    return wmul(last, (wide)td_dtype_size(v->dtype));
  for (int32_t i = 0; i < v->ndim; i++)
    last += wmul(v->shape[i] - 1, v->stride[i]);
  return wmul(last + 1, (wide)td_dtype_size(v->dtype));
}

/* Roughly log-uniform in [0, INT64_MAX]. */
static int64_t big(void) {
  int b = (int)rr(0, 63);
  return b == 63 ? (int64_t)(rnd() >> 1) : rr(0, (int64_t)1 << b);
}

/* A well-formed view whose sizes, strides and offset are anything from 0 to
 * INT64_MAX, zero strides common: counts and extents of any magnitude. */
static void huge_view(td_view *v, int32_t maxnd) {
  memset(v, 0, sizeof(*v));
  v->dtype = random_dtype();
  v->ndim = (int32_t)rr(0, maxnd);
  for (int32_t i = 0; i < v->ndim; i++) {
    int k = (int)rr(0, 9);
    v->shape[i] = k == 0 ? 0 : k < 3 ? rr(1, 4) : big();
    v->stride[i] = rr(0, 1) ? 0 : rr(0, 3) ? rr(1, 64) : big();
  }
  v->offset = rr(0, 3) ? 0 : rr(0, 1) ? rr(0, 64) : big();
}

/* What td_view_check(v, nbytes) must return, by wide arithmetic. */
static int wide_check(const td_view *v, wide nbytes) {
  if (wide_numel(v) > INT64_MAX || wide_end(v) > INT64_MAX)
    return TD_EINVAL;
  return wide_end(v) > nbytes ? TD_ERANGE : 0;
}

Test(view, counts_and_extents_agree_with_wide_arithmetic, .timeout = 60) {
  seed_rng();
  int seen[4] = {0}; /* passes; count over; extent over; out of storage */
  for (int k = 0; k < 200000; k++) {
    td_view v;
    huge_view(&v, k % 8 == 0 ? TD_MAX_DIMS : 4);
    char vb[512];
    td_view_format(&v, vb, sizeof(vb));
    wide n = wide_numel(&v), end = wide_end(&v);
    int64_t got = td_view_numel(&v);
    if (n > INT64_MAX)
      cr_assert_eq(got, TD_EINVAL,
                   "seed %u: %s: numel %lld of an overflowing "
                   "count",
                   seed, vb, (long long)got);
    else
      cr_assert_eq(got, (int64_t)n, "seed %u: %s: numel %lld, expected %lld",
                   seed, vb, (long long)got, (long long)n);
    wide tries[4] = {(wide)SIZE_MAX, end - 1, end, end + (wide)rr(1, 64)};
    for (int i = 0; i < 4; i++) {
      if (tries[i] < 0 || tries[i] > (wide)SIZE_MAX)
        continue;
      int want = wide_check(&v, tries[i]);
      int err = td_view_check(&v, (size_t)tries[i]);
      cr_assert_eq(err, want,
                   "seed %u: %s against %llu bytes: %d, expected "
                   "%d: %s",
                   seed, vb, (unsigned long long)tries[i], err, want,
                   td_view_last_error());
      /* The invariant: what passes has a count in int64 and an extent in
       * size_t, within the storage. */
      if (err == 0)
        cr_assert(n <= INT64_MAX && end <= tries[i] && end <= (wide)SIZE_MAX,
                  "seed %u: %s passed", seed, vb);
    }
    seen[n > INT64_MAX          ? 1
         : end > INT64_MAX      ? 2
         : wide_check(&v, 1024) ? 3
                                : 0]++;
  }
  for (int i = 0; i < 4; i++)
    cr_expect(seen[i] > 100, "seed %u: case %d seen %d times", seed, i,
              seen[i]);
}

/* Expected result of td_view_expand(v, nd, shape) by wide arithmetic: 0 and
 * *out, or TD_EINVAL. Only for shapes that PyTorch's rules accept. */
static int wide_expand(const td_view *v, int32_t nd, const int64_t *shape,
                       td_view *out) {
  *out = *v;
  out->ndim = nd;
  for (int32_t i = nd - 1; i >= 0; i--) {
    int32_t d = v->ndim - nd + i;
    int64_t size = d >= 0 ? v->shape[d] : 1, target = shape[i];
    wide stride = d >= 0       ? v->stride[d]
                  : i + 1 < nd ? wmul(out->shape[i + 1], out->stride[i + 1])
                               : 0;
    if (target == -1)
      target = size;
    if (size != target)
      stride = 0;
    if (stride > INT64_MAX)
      return TD_EINVAL;
    out->shape[i] = target;
    out->stride[i] = (int64_t)stride;
  }
  return wide_numel(out) > INT64_MAX ? TD_EINVAL : 0;
}

/* Every op, applied to a view that passes td_view_check, gives a view that
 * passes it too (against the same bytes, but for as_strided), so its count
 * fits int64: expand, reinterpret and as_strided refuse counts past it. */
Test(view, ops_on_huge_views_keep_counts_in_int64, .timeout = 60) {
  seed_rng();
  int expand_ok = 0, expand_refused = 0, reinterpret_refused = 0,
      as_strided_refused = 0, others = 0;
  for (int k = 0; k < 100000; k++) {
    td_view v;
    int kind = (int)rr(0, 5), err, want = 0;
    do {
      huge_view(&v, 6);
      if (kind == 2 && v.ndim > 0 && rr(0, 1)) {
        /* A view reinterpret accepts (the last dim dense) whose other
         * dims, stride 0, may hold any count up to INT64_MAX. */
        v.dtype = rr(0, 1) ? TD_COMPLEX128 : TD_INT64;
        for (int32_t i = 0; i + 1 < v.ndim; i++)
          v.stride[i] = 0;
        v.stride[v.ndim - 1] = 1;
        v.shape[v.ndim - 1] = rr(1, 4);
      }
    } while (td_view_check(&v, SIZE_MAX) != 0);
    wide limit = wide_end(&v);
    td_view before = v, want_v;
    char vb[512];
    td_view_format(&v, vb, sizeof(vb));
    const char *name;
    if (kind <= 1) { /* expand each size-1 dim, maybe add leading dims */
      int32_t nd = (int32_t)rr(v.ndim, v.ndim + 2 > 16 ? 16 : v.ndim + 2);
      int64_t shape[TD_MAX_DIMS];
      for (int32_t i = 0; i < nd; i++) {
        int32_t d = v.ndim - nd + i;
        if (d >= 0 && v.shape[d] != 1)
          shape[i] = rr(0, 1) ? -1 : v.shape[d];
        else
          shape[i] = rr(0, 2) == 0 ? 1 : rr(0, 1) ? rr(2, 8) : big();
      }
      name = "expand";
      want = wide_expand(&v, nd, shape, &want_v);
      err = td_view_expand(&v, nd, shape);
      if (err == 0 && want == 0)
        cr_assert_eq(memcmp(&v, &want_v, sizeof(v)), 0,
                     "seed %u: %s: expand to the wrong view", seed, vb);
      expand_ok += err == 0;
      expand_refused += err != 0;
    } else if (kind == 2) {
      name = "reinterpret";
      err = td_view_reinterpret(&v, random_dtype());
      want = err; /* the rules are tested elsewhere; here the invariant */
      reinterpret_refused +=
          err != 0 && strstr(td_view_last_error(), "INT64_MAX") != NULL;
    } else if (kind == 3) {
      td_view n;
      huge_view(&n, 6);
      n.dtype = v.dtype; /* as_strided keeps it */
      name = "as_strided";
      want = wide_check(&n, (wide)SIZE_MAX) == 0 ? 0 : TD_EINVAL;
      err = td_view_as_strided(&v, n.ndim, n.shape, n.stride, n.offset);
      as_strided_refused += err != 0 && wide_numel(&n) > INT64_MAX;
    } else {
      int32_t d = v.ndim > 0 ? (int32_t)rr(0, v.ndim - 1) : 0;
      name = "others";
      switch (kind) {
      case 4:
        err = td_view_unsqueeze(&v, d);
        break;
      default:
        err = v.ndim > 0 ? td_view_slice(&v, d, big(), big(), rr(1, 3))
                         : td_view_squeeze_all(&v);
      }
      want = err;
      others++;
    }
    cr_assert_eq(err, want, "seed %u: %s on %s: %d, expected %d: %s", seed,
                 name, vb, err, want, td_view_last_error());
    if (err != 0) {
      cr_assert_eq(memcmp(&v, &before, sizeof(v)), 0,
                   "seed %u: %s on %s "
                   "failed and changed the view",
                   seed, name, vb);
      continue;
    }
    char ab[512];
    td_view_format(&v, ab, sizeof(ab));
    cr_assert(wide_numel(&v) <= INT64_MAX && td_view_numel(&v) >= 0,
              "seed %u: %s made %s from %s: count past int64", seed, name, ab,
              vb);
    cr_assert_eq(td_view_check(&v, kind == 3 ? SIZE_MAX : (size_t)limit), 0,
                 "seed %u: %s made %s from %s: %s", seed, name, ab, vb,
                 td_view_last_error());
  }
  cr_expect(expand_ok > 100 && expand_refused > 100 &&
                reinterpret_refused > 20 && as_strided_refused > 100 &&
                others > 100,
            "seed %u: expand %d ok, %d refused; reinterpret %d and "
            "as_strided %d refused for the count; %d others",
            seed, expand_ok, expand_refused, reinterpret_refused,
            as_strided_refused, others);
}

/* ---- dtypes ---- */

Test(dtype, names_sizes_and_numpy_spellings) {
  for (int d = 1; d < TD_DTYPE_COUNT_; d++) {
    const char *n = td_dtype_name((td_dtype)d);
    cr_assert_not_null(n);
    cr_assert_eq((int)td_dtype_from_name(n), d, "%s", n);
    char torch[64];
    snprintf(torch, sizeof(torch), "torch.%s", n);
    cr_assert_eq((int)td_dtype_from_name(torch), d, "%s", torch);
  }
  struct {
    const char *name;
    td_dtype want;
    size_t size;
  } t[] = {
      {"<f4", TD_FLOAT32, 4},
      {"f4", TD_FLOAT32, 4},
      {"=f4", TD_FLOAT32, 4},
      {"f", TD_FLOAT32, 4},
      {"|u1", TD_UINT8, 1},
      {"B", TD_UINT8, 1},
      {"|b1", TD_BOOL, 1},
      {"?", TD_BOOL, 1},
      {"bool_", TD_BOOL, 1},
      {"<c8", TD_COMPLEX64, 8},
      {"<c16", TD_COMPLEX128, 16},
      {"D", TD_COMPLEX128, 16},
      {"<i8", TD_INT64, 8},
      {"q", TD_INT64, 8},
      {"<u2", TD_UINT16, 2},
      {"<f2", TD_FLOAT16, 2},
      {"e", TD_FLOAT16, 2},
      {"half", TD_FLOAT16, 2},
      {"double", TD_FLOAT64, 8},
      {"<f8", TD_FLOAT64, 8},
      {"|i1", TD_INT8, 1},
      {"<i2", TD_INT16, 2},
      {"<i4", TD_INT32, 4},
      {"<u4", TD_UINT32, 4},
      {"<u8", TD_UINT64, 8},
      {"long", TD_INT64, 8},
      {"bfloat16", TD_BFLOAT16, 2},
      {"float8_e4m3fn", TD_FLOAT8_E4M3FN, 1},
      {"float8_e5m2", TD_FLOAT8_E5M2, 1},
  };
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
    cr_expect_eq(td_dtype_from_name(t[i].name), t[i].want, "%s", t[i].name);
    cr_expect_eq(td_dtype_size(t[i].want), t[i].size, "%s", t[i].name);
  }
  const char *refused[] = {">f4",     "!f4",      ">i8",  "float", "int",
                           "cfloat",  "f3",       "<f16", "",      "torch.<f4",
                           "Float32", "float32 ", "<",    "<x"};
  for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
    cr_expect_eq(td_dtype_from_name(refused[i]), TD_DTYPE_INVALID, "'%s'",
                 refused[i]);
  cr_expect_eq(td_dtype_from_name(NULL), TD_DTYPE_INVALID);
  cr_expect_eq(td_dtype_size(TD_DTYPE_COUNT_), 0);
  cr_expect_null(td_dtype_name((td_dtype)-1));
}

/* With "torch." in front a name means what PyTorch means by it, even where
 * numpy means something else; without, such names are refused. */
Test(dtype, torch_names_mean_what_torch_means) {
  struct {
    const char *name;
    td_dtype want;
  } t[] = {
      {"torch.byte", TD_UINT8},
      {"torch.char", TD_INT8},
      {"torch.float", TD_FLOAT32},
      {"torch.int", TD_INT32},
      {"torch.cfloat", TD_COMPLEX64},
      {"torch.half", TD_FLOAT16},
      {"torch.long", TD_INT64},
      {"torch.short", TD_INT16},
      {"torch.double", TD_FLOAT64},
      {"torch.cdouble", TD_COMPLEX128},
      {"ubyte", TD_UINT8},
      {"byte", TD_DTYPE_INVALID},
      {"char", TD_DTYPE_INVALID},
  };
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
    cr_expect_eq(td_dtype_from_name(t[i].name), t[i].want, "%s: %d, not %d",
                 t[i].name, (int)td_dtype_from_name(t[i].name), (int)t[i].want);
}

/* ---- td_elem_to_double ---- */

/* The element of dt whose little-endian bytes are bits, decoded, at an odd
 * address (elements in a storage need not be aligned). */
static double elem(td_dtype dt, uint64_t bits) {
  uint8_t b[1 + 8];
  for (size_t i = 0; i < 8; i++)
    b[1 + i] = (uint8_t)(bits >> (8 * i));
  double x = -12345;
  int err = td_elem_to_double(dt, b + 1, &x);
  cr_assert_eq(err, 0, "%s 0x%" PRIx64 ": %s", td_dtype_name(dt), bits,
               td_view_last_error());
  return x;
}

Test(elem, float16_values_and_specials) {
  cr_assert_eq(elem(TD_FLOAT16, 0x3c00), 1.0);
  cr_assert_eq(elem(TD_FLOAT16, 0x7bff), 65504.0, "largest");
  cr_assert_eq(elem(TD_FLOAT16, 0x0001), 0x1p-24, "smallest subnormal");
  cr_assert_eq(elem(TD_FLOAT16, 0x03ff), 0x3ffp-24, "largest subnormal");
  cr_assert_eq(elem(TD_FLOAT16, 0x0400), 0x1p-14, "smallest normal");
  cr_assert_eq(elem(TD_FLOAT16, 0x3555), 0.333251953125);
  cr_assert_eq(elem(TD_FLOAT16, 0xc000), -2.0);
  cr_assert_eq(elem(TD_FLOAT16, 0x7c00), INFINITY);
  cr_assert_eq(elem(TD_FLOAT16, 0xfc00), -INFINITY);
  cr_assert(isnan(elem(TD_FLOAT16, 0x7e00)));
  cr_assert(isnan(elem(TD_FLOAT16, 0x7c01)));
  double z = elem(TD_FLOAT16, 0x8000);
  cr_assert(z == 0 && signbit(z), "0x8000 is -0");
}

Test(elem, bfloat16_is_the_top_of_a_float32) {
  cr_assert_eq(elem(TD_BFLOAT16, 0x3f80), 1.0);
  cr_assert_eq(elem(TD_BFLOAT16, 0x4049), 3.140625);
  cr_assert_eq(elem(TD_BFLOAT16, 0xc0a0), -5.0);
  cr_assert_eq(elem(TD_BFLOAT16, 0x7f80), INFINITY);
  cr_assert_eq(elem(TD_BFLOAT16, 0xff80), -INFINITY);
  cr_assert_eq(elem(TD_BFLOAT16, 0x0001), 0x1p-133, "smallest subnormal");
  cr_assert(isnan(elem(TD_BFLOAT16, 0x7fc0)));
}

Test(elem, float8_e4m3fn_has_no_inf_and_one_nan_per_sign) {
  cr_assert_eq(elem(TD_FLOAT8_E4M3FN, 0x38), 1.0);
  cr_assert_eq(elem(TD_FLOAT8_E4M3FN, 0x7e), 448.0, "largest");
  cr_assert_eq(elem(TD_FLOAT8_E4M3FN, 0xfe), -448.0);
  cr_assert_eq(elem(TD_FLOAT8_E4M3FN, 0x78), 256.0, "exp 15 is finite");
  cr_assert_eq(elem(TD_FLOAT8_E4M3FN, 0x01), 0x1p-9, "smallest subnormal");
  cr_assert_eq(elem(TD_FLOAT8_E4M3FN, 0x08), 0x1p-6, "smallest normal");
  cr_assert(isnan(elem(TD_FLOAT8_E4M3FN, 0x7f)));
  cr_assert(isnan(elem(TD_FLOAT8_E4M3FN, 0xff)));
  for (int b = 0; b < 256; b++)
    if ((b & 0x7f) != 0x7f)
      cr_assert(isfinite(elem(TD_FLOAT8_E4M3FN, (uint64_t)b)), "0x%02x finite",
                b);
}

Test(elem, float8_e5m2_is_ieee_like) {
  cr_assert_eq(elem(TD_FLOAT8_E5M2, 0x3c), 1.0);
  cr_assert_eq(elem(TD_FLOAT8_E5M2, 0x7b), 57344.0, "largest");
  cr_assert_eq(elem(TD_FLOAT8_E5M2, 0x01), 0x1p-16, "smallest subnormal");
  cr_assert_eq(elem(TD_FLOAT8_E5M2, 0xc0), -2.0);
  cr_assert_eq(elem(TD_FLOAT8_E5M2, 0x7c), INFINITY);
  cr_assert_eq(elem(TD_FLOAT8_E5M2, 0xfc), -INFINITY);
  cr_assert(isnan(elem(TD_FLOAT8_E5M2, 0x7d)));
  cr_assert(isnan(elem(TD_FLOAT8_E5M2, 0xff)));
}

Test(elem, wide_floats_ints_and_bool) {
  cr_assert_eq(elem(TD_FLOAT32, 0x3fc00000), 1.5);
  cr_assert_eq(elem(TD_FLOAT64, 0xc004000000000000), -2.5);
  cr_assert_eq(elem(TD_INT8, 0xff), -1.0);
  cr_assert_eq(elem(TD_UINT8, 0xff), 255.0);
  cr_assert_eq(elem(TD_INT16, 0x8000), -32768.0);
  cr_assert_eq(elem(TD_UINT16, 0xffff), 65535.0);
  cr_assert_eq(elem(TD_INT32, 0x80000000), -2147483648.0);
  cr_assert_eq(elem(TD_UINT32, 0xffffffff), 4294967295.0);
  cr_assert_eq(elem(TD_INT64, 0x8000000000000000), -0x1p63);
  cr_assert_eq(elem(TD_INT64, (1ull << 53) + 1), 0x1p53, "rounded");
  cr_assert_eq(elem(TD_UINT64, 0xffffffffffffffff), 0x1p64, "rounded");
  cr_assert_eq(elem(TD_BOOL, 0), 0.0);
  cr_assert_eq(elem(TD_BOOL, 1), 1.0);
  cr_assert_eq(elem(TD_BOOL, 0x80), 1.0, "any byte but 0 is true");
}

Test(elem, unknown_and_complex_dtypes_are_refused) {
  const uint8_t b[16] = {0};
  td_dtype bad[] = {TD_DTYPE_INVALID, TD_DTYPE_COUNT_, (td_dtype)-1};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    double x = 7;
    cr_assert_eq(td_elem_to_double(bad[i], b, &x), TD_EINVAL, "dtype %d",
                 (int)bad[i]);
    cr_assert_eq(x, 7, "*out unchanged");
    char want[64];
    snprintf(want, sizeof(want), "unknown dtype %d", (int)bad[i]);
    cr_assert(strstr(td_view_last_error(), want) != NULL, "'%s'",
              td_view_last_error());
  }
  double x = 7;
  cr_assert_eq(td_elem_to_double(TD_COMPLEX64, b, &x), TD_EINVAL);
  cr_assert_eq(x, 7);
  cr_assert(strstr(td_view_last_error(), "complex64") != NULL &&
                strstr(td_view_last_error(), "float32") != NULL,
            "'%s'", td_view_last_error());
  cr_assert_eq(td_elem_to_double(TD_COMPLEX128, b, &x), TD_EINVAL);
}

/* ---- td_view_check's reason ---- */

Test(view, check_names_the_view_and_the_bytes_it_reaches) {
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, (int64_t[]){4, 3}, &v), 0);
  v.offset = 2;
  cr_assert_eq(td_view_check(&v, 48), TD_ERANGE);
  cr_assert_str_eq(td_view_last_error(),
                   "view float32[4, 3] stride (3, 1) offset 2 reaches byte 56 "
                   "of a storage of 48 bytes");
  cr_assert_eq(td_view_check(&v, 56), 0);
  v.stride[1] = -1;
  cr_assert_eq(td_view_check(&v, 56), TD_EINVAL);
  cr_assert_str_eq(td_view_last_error(), "dim 1: negative stride -1");
}

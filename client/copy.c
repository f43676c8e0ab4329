/* copy.c: strided copies between views (td_copy) and the kernels behind
 * them: one memcpy, a memcpy per contiguous block, cache-blocked tiles for
 * transposes, and element by element for the rest. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <xmmintrin.h>
#endif

/* Tile edge of the transposing kernel, in elements: a tile row is 128 bytes
 * (two cache lines), a tile at most 16 KiB, so source and destination tiles
 * stay in L1 while a tile is turned. */
#define TILE_BYTES 128
/* Edge of a block of tiles, in elements. */
#define BLOCK 256

/* A copy reduced to its essentials: size-1 dims dropped, dims ordered by the
 * destination's strides (outermost first), neighbours that are contiguous
 * with each other in both views merged. Strides in bytes. */
typedef struct plan {
  int nd;
  int64_t size[TD_MAX_DIMS];
  int64_t ds[TD_MAX_DIMS];
  int64_t ss[TD_MAX_DIMS];
  size_t es;
  td__copy_path path;
  int tile; /* TILED: the dim walked fastest in the source */
} plan;

/* Fills p for dv and sv, which have the same dtype and shape. */
static void make_plan(const td_view *dv, const td_view *sv, plan *p) {
  memset(p, 0, sizeof(*p));
  p->es = td_dtype_size(dv->dtype);
  int64_t es = (int64_t)p->es;
  int n = 0;
  for (int32_t i = 0; i < dv->ndim; i++) {
    if (dv->shape[i] == 0) {
      p->path = TD__COPY_NONE;
      return;
    }
    if (dv->shape[i] == 1)
      continue;
    /* Insertion by destination stride, then source stride, descending. */
    int j = n++;
    int64_t d = dv->stride[i] * es, s = sv->stride[i] * es;
    while (j > 0 &&
           (p->ds[j - 1] < d || (p->ds[j - 1] == d && p->ss[j - 1] < s))) {
      p->size[j] = p->size[j - 1];
      p->ds[j] = p->ds[j - 1];
      p->ss[j] = p->ss[j - 1];
      j--;
    }
    p->size[j] = dv->shape[i];
    p->ds[j] = d;
    p->ss[j] = s;
  }
  /* Merge each dim into the one outside it where both views allow. A
   * source checked only for overflow (DLPack's) may have strides whose
   * size * stride passes int64: those dims do not merge. */
  int m = 0;
  for (int i = 0; i < n; i++) {
    int64_t dspan, sspan;
    if (m > 0 && !__builtin_mul_overflow(p->size[i], p->ds[i], &dspan) &&
        !__builtin_mul_overflow(p->size[i], p->ss[i], &sspan) &&
        p->ds[m - 1] == dspan && p->ss[m - 1] == sspan) {
      p->size[m - 1] *= p->size[i];
      p->ds[m - 1] = p->ds[i];
      p->ss[m - 1] = p->ss[i];
      continue;
    }
    p->size[m] = p->size[i];
    p->ds[m] = p->ds[i];
    p->ss[m] = p->ss[i];
    m++;
  }
  p->nd = m;
  if (m == 0) {
    p->path = TD__COPY_MEMCPY; /* one element */
    return;
  }
  int in = m - 1;
  if (p->ds[in] == es && p->ss[in] == es) {
    p->path = m == 1 ? TD__COPY_MEMCPY : TD__COPY_BLOCKS;
    return;
  }
  /* The source runs fastest along another dim: turn it in tiles. */
  int k = -1;
  for (int i = 0; i < in; i++)
    if (p->ss[i] < p->ss[in] && (k < 0 || p->ss[i] < p->ss[k]))
      k = i;
  p->tile = k;
  p->path = k >= 0 ? TD__COPY_TILED : TD__COPY_STRIDED;
}

td__copy_path td__copy_plan_path(const td_view *dv, const td_view *sv) {
  plan p;
  make_plan(dv, sv, &p);
  return p.path;
}

/* Copies n elements of es bytes, dst and src strides in bytes. The fixed
 * sizes let the compiler use one load and one store per element. */
static void strided_row(char *d, int64_t dstep, const char *s, int64_t sstep,
                        int64_t n, size_t es) {
#define ROW(k)                                                                 \
  for (int64_t i = 0; i < n; i++, d += dstep, s += sstep)                      \
    memcpy(d, s, k);                                                           \
  break
  switch (es) {
  case 1:
    ROW(1);
  case 2:
    ROW(2);
  case 4:
    ROW(4);
  case 8:
    ROW(8);
  case 16:
    ROW(16);
  default:
    for (int64_t i = 0; i < n; i++, d += dstep, s += sstep)
      memcpy(d, s, es);
  }
#undef ROW
}

#ifdef __SSE2__
/* A tile of 4-byte elements where d runs along a and s along b, both
 * contiguous: 4 x 4 blocks turned in SSE registers (moves and shuffles
 * only, so any bit pattern survives), the ragged edges element by element.
 * Element (b, a) is at d + b*db + a*4 and s + b*4 + a*sa. */
static void tile4(char *d, int64_t db, const char *s, int64_t sa, int64_t bn,
                  int64_t an) {
  int64_t a = 0;
  for (; a + 4 <= an; a += 4) {
    int64_t b = 0;
    for (; b + 4 <= bn; b += 4) {
      const char *sp = s + a * sa + b * 4;
      char *dp = d + b * db + a * 4;
      __m128 r0 = _mm_loadu_ps((const float *)sp);
      __m128 r1 = _mm_loadu_ps((const float *)(sp + sa));
      __m128 r2 = _mm_loadu_ps((const float *)(sp + 2 * sa));
      __m128 r3 = _mm_loadu_ps((const float *)(sp + 3 * sa));
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      _mm_storeu_ps((float *)dp, r0);
      _mm_storeu_ps((float *)(dp + db), r1);
      _mm_storeu_ps((float *)(dp + 2 * db), r2);
      _mm_storeu_ps((float *)(dp + 3 * db), r3);
    }
    for (; b < bn; b++)
      strided_row(d + b * db + a * 4, 4, s + a * sa + b * 4, sa, 4, 4);
  }
  for (; a < an; a++)
    strided_row(d + a * 4, db, s + a * sa, 4, bn, 4);
}
#endif

/* Copies an nb x na block, turning it in tiles: element (b, a) goes from
 * s + b*sb + a*sa to d + b*db + a*da, where d runs fastest along a and s
 * along b. Tiles of TILE_BYTES-wide rows go in blocks of BLOCK x BLOCK
 * elements, so that a block's source and destination rows stay in L2 and
 * its pages in the TLB while its tiles are turned. */
static void tiled(char *d, int64_t db, int64_t da, const char *s, int64_t sb,
                  int64_t sa, int64_t nb, int64_t na, size_t es) {
  int64_t e = (int64_t)es, t = TILE_BYTES / e;
  int vec = 0;
#ifdef __SSE2__
  vec = es == 4 && da == 4 && sb == 4;
  if (vec)
    t = 16; /* measured best for the 4 x 4 kernel */
#endif
  for (int64_t B0 = 0; B0 < nb; B0 += BLOCK) {
    int64_t bend = nb - B0 < BLOCK ? nb : B0 + BLOCK;
    for (int64_t A0 = 0; A0 < na; A0 += BLOCK) {
      int64_t aend = na - A0 < BLOCK ? na : A0 + BLOCK;
      for (int64_t b0 = B0; b0 < bend; b0 += t) {
        int64_t bn = bend - b0 < t ? bend - b0 : t;
        for (int64_t a0 = A0; a0 < aend; a0 += t) {
          int64_t an = aend - a0 < t ? aend - a0 : t;
          char *dt = d + b0 * db + a0 * da;
          const char *st = s + b0 * sb + a0 * sa;
#ifdef __SSE2__
          if (vec) {
            tile4(dt, db, st, sa, bn, an);
            continue;
          }
#endif
          for (int64_t b = 0; b < bn; b++)
            strided_row(dt + b * db, da, st + b * sb, sa, an, es);
        }
      }
    }
  }
}

/* Runs the plan for views dv of base d and sv of base s: the outer dims in
 * odometer order, the inner one or two by the plan's kernel. */
static void run(const plan *p, const td_view *dv, char *d, const td_view *sv,
                const char *s) {
  if (p->path == TD__COPY_NONE)
    return;
  d += dv->offset * (int64_t)p->es;
  s += sv->offset * (int64_t)p->es;
  if (p->nd == 0) {
    memcpy(d, s, p->es);
    return;
  }
  int in = p->nd - 1;
  int outer[TD_MAX_DIMS], no = 0;
  for (int i = 0; i < in; i++)
    if (p->path != TD__COPY_TILED || i != p->tile)
      outer[no++] = i;
  int64_t idx[TD_MAX_DIMS] = {0};
  size_t block = (size_t)p->size[in] * p->es;
  for (;;) {
    switch (p->path) {
    case TD__COPY_MEMCPY:
    case TD__COPY_BLOCKS:
      memcpy(d, s, block);
      break;
    case TD__COPY_TILED:
      tiled(d, p->ds[p->tile], p->ds[in], s, p->ss[p->tile], p->ss[in],
            p->size[p->tile], p->size[in], p->es);
      break;
    default:
      strided_row(d, p->ds[in], s, p->ss[in], p->size[in], p->es);
    }
    int j = no - 1;
    for (; j >= 0; j--) {
      int k = outer[j];
      if (++idx[j] < p->size[k]) {
        d += p->ds[k];
        s += p->ss[k];
        break;
      }
      idx[j] = 0;
      d -= (p->size[k] - 1) * p->ds[k];
      s -= (p->size[k] - 1) * p->ss[k];
    }
    if (j < 0)
      return;
  }
}

/* Byte range [*lo, *hi) that v (non-empty, checked) touches. */
static void extent(const td_view *v, int64_t *lo, int64_t *hi) {
  int64_t es = (int64_t)td_dtype_size(v->dtype), last = v->offset;
  for (int32_t i = 0; i < v->ndim; i++)
    last += (v->shape[i] - 1) * v->stride[i];
  *lo = v->offset * es;
  *hi = (last + 1) * es;
}

static int same_layout(const td_view *a, const td_view *b) {
  if (a->offset != b->offset)
    return 0;
  for (int32_t i = 0; i < a->ndim; i++)
    if (a->shape[i] > 1 && a->stride[i] != b->stride[i])
      return 0;
  return 1;
}

/* Checks that sv can be copied into dv: same dtype and shape, and no
 * element of dv named twice. Returns 1 if so, 0 if there is no element to
 * copy, or a negative code (reason in td_view_last_error). */
static int copy_check(const td_view *dv, const td_view *sv) {
  if (dv->dtype != sv->dtype)
    return td__view_fail(
        TD_EINVAL, "copy: destination is %s, source %s",
        td_dtype_name(dv->dtype) ? td_dtype_name(dv->dtype) : "?",
        td_dtype_name(sv->dtype) ? td_dtype_name(sv->dtype) : "?");
  if (dv->ndim != sv->ndim)
    return td__view_fail(TD_EINVAL,
                         "copy: destination has %d dims, source "
                         "%d",
                         (int)dv->ndim, (int)sv->ndim);
  for (int32_t i = 0; i < dv->ndim; i++)
    if (dv->shape[i] != sv->shape[i])
      return td__view_fail(TD_EINVAL,
                           "copy: dim %d: destination size %lld, "
                           "source size %lld",
                           (int)i, (long long)dv->shape[i],
                           (long long)sv->shape[i]);
  int64_t numel = td_view_numel(dv); /* checked views: at most INT64_MAX */
  if (numel < 0)
    return (int)numel;
  if (numel == 0)
    return 0;
  for (int32_t i = 0; i < dv->ndim; i++)
    if (dv->shape[i] > 1 && dv->stride[i] == 0)
      return td__view_fail(TD_EINVAL,
                           "copy: destination dim %d has stride "
                           "0 and size %lld: it names one element %lld times",
                           (int)i, (long long)dv->shape[i],
                           (long long)dv->shape[i]);
  return 1;
}

int td__copy_raw(void *dst, const td_view *dv, const void *src,
                 const td_view *sv, int alias) {
  int ok = copy_check(dv, sv);
  if (ok <= 0)
    return ok;
  int64_t numel = td_view_numel(dv);
  int64_t dlo, dhi, slo, shi;
  extent(dv, &dlo, &dhi);
  extent(sv, &slo, &shi);
  int overlap;
  if (alias)
    overlap = dlo < shi && slo < dhi;
  else
    overlap = (const char *)dst + dlo < (const char *)src + shi &&
              (const char *)src + slo < (const char *)dst + dhi;
  int same = same_layout(dv, sv);
  if (overlap && same && dst == src)
    return 0; /* every element onto itself */
  plan p;
  if (!overlap || same) {
    make_plan(dv, sv, &p);
    run(&p, dv, dst, sv, src);
    return 0;
  }
  /* Read the source whole first, then write. Views whose elements collide
   * (strides (1, 1)) may name far more elements than they span, so the
   * size of the buffer is checked. */
  size_t es = td_dtype_size(dv->dtype), bytes;
  char *tmp = NULL;
  if (__builtin_mul_overflow((size_t)numel, es, &bytes) ||
      (tmp = malloc(bytes)) == NULL)
    return td__view_fail(TD_ENOMEM,
                         "copy: no memory for a temporary buffer "
                         "of %lld elements of %zu bytes for overlapping "
                         "views",
                         (long long)numel, es);
  td_view tv; /* cannot fail: numel * es bytes were allocated */
  td_view_contiguous(dv->dtype, dv->ndim, dv->shape, &tv);
  make_plan(&tv, sv, &p);
  run(&p, &tv, tmp, sv, src);
  make_plan(dv, &tv, &p);
  run(&p, dv, dst, &tv, tmp);
  free(tmp);
  return 0;
}

/* The bytes v reaches, [*lo, *hi), in a view that passed td_view_check.
 * Returns 0 for a view of no element. */
static int view_span(const td_view *v, size_t *lo, size_t *hi) {
  size_t item = td_dtype_size(v->dtype);
  int64_t last = v->offset;
  for (int i = 0; i < v->ndim; i++) {
    if (v->shape[i] == 0)
      return 0;
    last += (v->shape[i] - 1) * v->stride[i];
  }
  *lo = (size_t)v->offset * item;
  *hi = ((size_t)last + 1) * item;
  return 1;
}

/* The span of v over s in host memory: s's mapping for a CPU storage; for a
 * device's, a buffer (*buf, the caller frees it) holding a copy of the span
 * if fetch. Sets *base so that base + the view's byte offsets reaches each
 * element. Returns 0 or a negative code (reason in td_view_last_error). */
static int host_span(const td_storage *s, size_t lo, size_t hi, int fetch,
                     char **base, char **buf) {
  *buf = NULL;
  td__cumap *m = td__storage_cumap(s);
  if (m == NULL) {
    *base = td_storage_data(s);
    return 0;
  }
  if ((*buf = malloc(hi - lo)) == NULL)
    return td__view_fail(TD_ENOMEM,
                         "copy: storage %llu: no memory to stage %zu bytes",
                         (unsigned long long)td_storage_id(s), hi - lo);
  char why[256];
  int err =
      fetch ? td__cumap_copy(m, 0, lo, *buf, hi - lo, why, sizeof(why)) : 0;
  if (err < 0) {
    free(*buf);
    *buf = NULL;
    return td__view_fail(err, "copy: storage %llu: %s",
                         (unsigned long long)td_storage_id(s), why);
  }
  *base = *buf - lo;
  return 0;
}

/* Where one side of a 2D copy starts: a byte offset into a device mapping,
 * or an address in host memory when m is NULL. */
static uintptr_t side_at(const td__cumap *m, const td_storage *s, int64_t off) {
  return m != NULL ? (uintptr_t)off : (uintptr_t)td_storage_data(s) + off;
}

/* Copies dv of dst from sv of src with one cuMemcpy2D per slab of rows,
 * where at least one side is a device's (dm, sm) and, if both, the same
 * device's. A row is the plan's innermost dim, which must be a contiguous
 * run in both views; the dim outside it gives the slab's height and pitches
 * when both its strides are at least a row; the remaining dims are walked
 * here. Returns 1 if the views do not have that form (nothing copied), else
 * 0 or a negative code with why filled. */
static int copy_rows(td__cumap *dm, td_storage *dst, const td_view *dv,
                     td__cumap *sm, const td_storage *src, const td_view *sv,
                     char *why, size_t len) {
  plan p;
  make_plan(dv, sv, &p);
  int64_t es = (int64_t)p.es;
  if (p.path == TD__COPY_NONE)
    return 0;
  int in = p.nd - 1;
  if (p.nd > 0 && (p.ds[in] != es || p.ss[in] != es))
    return 1; /* element-strided: not rows */
  size_t width = (size_t)(p.nd > 0 ? p.size[in] * es : es), height = 1;
  size_t dpitch = width, spitch = width;
  int no = in > 0 ? in : 0; /* dims walked here: 0 .. no - 1 */
  if (in > 0 && p.ds[in - 1] >= (int64_t)width &&
      p.ss[in - 1] >= (int64_t)width) {
    no = in - 1;
    height = (size_t)p.size[no];
    dpitch = (size_t)p.ds[no];
    spitch = (size_t)p.ss[no];
  }
  int64_t d = dv->offset * es, s = sv->offset * es;
  int64_t idx[TD_MAX_DIMS] = {0};
  td__cumap *m = dm != NULL ? dm : sm;
  for (;;) {
    int err =
        td__cumap_copy2d(dm, side_at(dm, dst, d), dpitch, sm,
                         side_at(sm, src, s), spitch, width, height, why, len);
    if (err < 0) {
      /* What was issued completes before the error is told. */
      char ignored[8];
      td__cumap_sync(m, ignored, sizeof(ignored));
      return err;
    }
    int j = no - 1;
    for (; j >= 0; j--) {
      if (++idx[j] < p.size[j]) {
        d += p.ds[j];
        s += p.ss[j];
        break;
      }
      idx[j] = 0;
      d -= (p.size[j] - 1) * p.ds[j];
      s -= (p.size[j] - 1) * p.ss[j];
    }
    if (j < 0) /* every slab issued: done when the stream is */
      return td__cumap_sync(m, why, len);
  }
}

/* Copies dv of dst from sv of src, two storages on one GPU whose views do
 * not overlap, with the copy kernel over the reduced plan. Returns 1 if
 * the kernel cannot run here (nothing copied), else 0 or a negative code
 * (reason in td_view_last_error). */
static int copy_kernel(td__cumap *dm, td_storage *dst, const td_view *dv,
                       td__cumap *sm, const td_storage *src,
                       const td_view *sv) {
  plan p;
  make_plan(dv, sv, &p);
  if (p.path == TD__COPY_NONE)
    return 0;
  char why[256];
  int64_t es = (int64_t)p.es;
  int err = td__cumap_kcopy(
      dm, (size_t)(dv->offset * es), sm, (size_t)(sv->offset * es), p.nd,
      p.size, p.ds, p.ss, p.es, td_view_numel(dv),
      p.path == TD__COPY_TILED ? p.tile : -1, why, sizeof(why));
  if (err < 0)
    return td__view_fail(err, "copy: storages %llu and %llu: %s",
                         (unsigned long long)td_storage_id(dst),
                         (unsigned long long)td_storage_id(src), why);
  return err;
}

/* td_copy where either side is a GPU's: a straight cuMemcpy when both views
 * are contiguous and the host side is a CPU storage; cuMemcpy2D slabs when
 * both views are runs of contiguous rows and they do not overlap (between
 * two GPU storages, only when both are on one GPU); the copy kernel for
 * other views between two storages on one GPU that do not overlap; one
 * cuMemcpyPeerAsync between dense views of one layout on two GPUs; else
 * through host copies of the spans the views reach (the destination's span
 * is fetched first, so that its bytes between the view's elements are
 * kept). See docs/cuda.md, "td_copy on GPUs". */
static int copy_device(td_storage *dst, const td_view *dv,
                       const td_storage *src, const td_view *sv, int alias) {
  int ok = copy_check(dv, sv);
  if (ok <= 0)
    return ok;
  size_t dlo, dhi, slo, shi;
  if (!view_span(dv, &dlo, &dhi) || !view_span(sv, &slo, &shi))
    return 0;
  td__cumap *dm = td__storage_cumap(dst), *sm = td__storage_cumap(src);
  char why[256];
  int err;
  if (dm == NULL || sm == NULL) {
    /* One side is host memory: if both views are dense and of one layout,
     * one copy in the driver. */
    td__copy_path p = td__copy_plan_path(dv, sv);
    if (p == TD__COPY_MEMCPY && dhi - dlo == shi - slo) {
      err = dm != NULL
                ? td__cumap_copy(dm, 1, dlo, (char *)td_storage_data(src) + slo,
                                 shi - slo, why, sizeof(why))
                : td__cumap_copy(sm, 0, slo, (char *)td_storage_data(dst) + dlo,
                                 dhi - dlo, why, sizeof(why));
      if (err < 0)
        return td__view_fail(err, "copy: storages %llu and %llu: %s",
                             (unsigned long long)td_storage_id(dst),
                             (unsigned long long)td_storage_id(src), why);
      return 0;
    }
  }
  int overlap = alias && dlo < shi && slo < dhi;
  int one_gpu =
      dm != NULL && sm != NULL && td__cumap_index(dm) == td__cumap_index(sm);
  if (!overlap && (dm == NULL || sm == NULL || one_gpu)) {
    err = copy_rows(dm, dst, dv, sm, src, sv, why, sizeof(why));
    /* A pitch the driver refuses (real GPUs cap it) leaves the copy to the
     * kernel or the staged path below, which rewrite every element. */
    if (err == 0)
      return 0;
    if (err < 0 && err != TD_EINVAL)
      return td__view_fail(err, "copy: storages %llu and %llu: %s",
                           (unsigned long long)td_storage_id(dst),
                           (unsigned long long)td_storage_id(src), why);
    /* Element-strided or transposed on one GPU: the kernel, where it can
     * run (else the staged path). */
    if (one_gpu && (err = copy_kernel(dm, dst, dv, sm, src, sv)) <= 0)
      return err;
  }
  if (dm != NULL && sm != NULL && !one_gpu &&
      td__copy_plan_path(dv, sv) == TD__COPY_MEMCPY && dhi - dlo == shi - slo) {
    /* Dense views of one layout on two GPUs: one peer copy, device to
     * device (the driver stages it itself where the GPUs have no P2P). */
    err = td__cumap_peer(dm, dlo, sm, slo, dhi - dlo, why, sizeof(why));
    if (err <= 0) {
      if (err < 0)
        return td__view_fail(err, "copy: storages %llu and %llu: %s",
                             (unsigned long long)td_storage_id(dst),
                             (unsigned long long)td_storage_id(src), why);
      return 0;
    }
  } else if (dm != NULL && sm != NULL && !one_gpu &&
             td__cumap_reach(dm, sm) > 0 &&
             (err = copy_kernel(dm, dst, dv, sm, src, sv)) <= 0) {
    /* Other views on two GPUs that reach each other: the kernel on the
     * destination's GPU, reading the source over the link (writes stay
     * local). Else staged below. */
    return err;
  }
  char *dbase, *dbuf, *sbase, *sbuf = NULL;
  if ((err = host_span(dst, dlo, dhi, 1, &dbase, &dbuf)) < 0)
    return err;
  if (alias && dbuf != NULL) {
    /* The same device storage: its staged copy serves as the source too,
     * when it holds the source's span; else a copy of its own. */
    if (slo >= dlo && shi <= dhi)
      sbase = dbase;
    else if ((err = host_span(src, slo, shi, 1, &sbase, &sbuf)) < 0)
      goto out;
  } else if ((err = host_span(src, slo, shi, 1, &sbase, &sbuf)) < 0) {
    goto out;
  }
  if ((err = td__copy_raw(dbase, dv, sbase, sv, alias)) < 0)
    goto out;
  if (dbuf != NULL &&
      (err = td__cumap_copy(dm, 1, dlo, dbuf, dhi - dlo, why, sizeof(why))) < 0)
    err = td__view_fail(err, "copy: storage %llu: %s",
                        (unsigned long long)td_storage_id(dst), why);
out:
  free(dbuf);
  free(sbuf);
  return err;
}

int td_copy(td_storage *dst, const td_view *dst_view, const td_storage *src,
            const td_view *src_view) {
  char why[600];
  int err;
  if (dst == NULL || src == NULL || dst_view == NULL || src_view == NULL)
    return td__view_fail(TD_EINVAL, "copy: NULL %s",
                         dst == NULL        ? "destination storage"
                         : src == NULL      ? "source storage"
                         : dst_view == NULL ? "destination view"
                                            : "source view");
  td_device dd = td_storage_device(dst), sd = td_storage_device(src);
  if ((dd != TD_CPU && dd != TD_CUDA) || (sd != TD_CPU && sd != TD_CUDA))
    return td__view_fail(TD_ENODEV,
                         "copy: storages %llu and %llu: only CPU and CUDA "
                         "storages can be copied here",
                         (unsigned long long)td_storage_id(dst),
                         (unsigned long long)td_storage_id(src));
  if ((err = td__view_check_msg(dst_view, td_storage_nbytes(dst), why,
                                sizeof(why))) < 0)
    return td__view_fail(err, "copy: destination (storage %llu): %s",
                         (unsigned long long)td_storage_id(dst), why);
  if ((err = td__view_check_msg(src_view, td_storage_nbytes(src), why,
                                sizeof(why))) < 0)
    return td__view_fail(err, "copy: source (storage %llu): %s",
                         (unsigned long long)td_storage_id(src), why);
  if (td_storage_is_readonly(dst))
    return td__view_fail(TD_EACCES,
                         "copy: destination storage %llu is open "
                         "read-only",
                         (unsigned long long)td_storage_id(dst));
  /* The same storage may be mapped twice (read-only and read-write): judge
   * overlap by storage id, not by address. */
  int alias = td_storage_id(dst) == td_storage_id(src);
  if (dd == TD_CUDA || sd == TD_CUDA)
    return copy_device(dst, dst_view, src, src_view, alias);
  return td__copy_raw(td_storage_data(dst), dst_view, td_storage_data(src),
                      src_view, alias);
}

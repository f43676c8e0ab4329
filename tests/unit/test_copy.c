/* test_copy.c: td__copy_raw, the kernel behind td_copy, against an
 * element-by-element reference on random layouts, overlapping and aliased
 * views, the path each layout takes, and bad input. */
#include "internal.h"
#include "seed.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static uint64_t rng;
static uint64_t seed;

static void seed_rng(void) {
  seed = tdt_seed("test_copy");
  rng = seed;
}

static uint64_t rnd(void) {
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int64_t rr(int64_t lo, int64_t hi) {
  return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

static const td_dtype dtypes[] = {TD_UINT8, TD_INT16, TD_FLOAT32, TD_FLOAT64,
                                  TD_COMPLEX128};

/* A view of shape laid out in a random dim order with random padding and
 * offset; broadcast (stride 0) dims only if may_broadcast. Returns the
 * bytes the view needs. */
static size_t random_layout(td_dtype dt, int32_t nd, const int64_t *shape,
                            int may_broadcast, td_view *v) {
  memset(v, 0, sizeof(*v));
  v->dtype = dt;
  v->ndim = nd;
  memcpy(v->shape, shape, (size_t)nd * sizeof(int64_t));
  int32_t order[TD_MAX_DIMS];
  for (int32_t i = 0; i < nd; i++)
    order[i] = i;
  int shuffle = rr(0, 2) == 0;
  for (int32_t i = nd - 1; shuffle && i > 0; i--) {
    int32_t k = (int32_t)rr(0, i), t = order[i];
    order[i] = order[k];
    order[k] = t;
  }
  int64_t s = rr(0, 4) == 0 ? rr(2, 3) : 1;
  for (int32_t i = nd - 1; i >= 0; i--) {
    int32_t d = order[i];
    v->stride[d] = s;
    s *= shape[d] + (rr(0, 4) == 0 ? rr(1, 3) : 0);
    if (may_broadcast && rr(0, 7) == 0)
      v->stride[d] = 0;
  }
  v->offset = rr(0, 3) == 0 ? rr(0, 9) : 0;
  int64_t last = v->offset;
  for (int32_t i = 0; i < nd; i++)
    if (shape[i] > 0)
      last += (shape[i] - 1) * v->stride[i];
  return (size_t)(last + 1) * td_dtype_size(dt) + (size_t)rr(0, 16);
}

static void fill(unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    p[i] = (unsigned char)rnd();
}

/* The reference: each element copied on its own, in index order, from a
 * snapshot of the source. */
static void reference(unsigned char *dst, const td_view *dv,
                      const unsigned char *src, const td_view *sv) {
  int64_t n = td_view_numel(dv), idx[TD_MAX_DIMS];
  size_t es = td_dtype_size(dv->dtype);
  for (int64_t j = 0; j < n; j++) {
    int64_t lin = j, doff, soff;
    for (int32_t i = dv->ndim - 1; i >= 0; i--) {
      idx[i] = lin % dv->shape[i];
      lin /= dv->shape[i];
    }
    td_view_offset_of(dv, idx, &doff);
    td_view_offset_of(sv, idx, &soff);
    memcpy(dst + doff * (int64_t)es, src + soff * (int64_t)es, es);
  }
}

static int32_t random_shape(int64_t *shape) {
  int32_t nd = (int32_t)rr(0, 5);
  int64_t n = 1;
  for (int32_t i = 0; i < nd; i++) {
    shape[i] = rr(0, 30) == 0 ? 0 : rr(1, 9);
    if (rr(0, 5) == 0)
      shape[i] = rr(20, 70);
    if (n * shape[i] > 20000)
      shape[i] = 1;
    n *= shape[i] > 0 ? shape[i] : 1;
  }
  return nd;
}

Test(copy, random_layouts_match_the_reference, .timeout = 120) {
  seed_rng();
  int paths[5] = {0};
  for (int iter = 0; iter < 3000; iter++) {
    int64_t shape[TD_MAX_DIMS];
    int32_t nd = random_shape(shape);
    td_dtype dt = dtypes[rr(0, 4)];
    td_view dv, sv;
    size_t dn = random_layout(dt, nd, shape, 0, &dv);
    size_t sn = random_layout(dt, nd, shape, 1, &sv);
    unsigned char *d = malloc(dn), *s = malloc(sn), *want = malloc(dn);
    fill(d, dn);
    fill(s, sn);
    memcpy(want, d, dn);
    reference(want, &dv, s, &sv);
    paths[td__copy_plan_path(&dv, &sv)]++;
    int err = td__copy_raw(d, &dv, s, &sv, 0);
    char a[512], b[512];
    cr_assert_eq(err, 0, "seed %" PRIu64 " iter %d: %s", seed, iter,
                 td_view_last_error());
    cr_assert_eq(memcmp(d, want, dn), 0, "seed %" PRIu64 " iter %d: %s <- %s (path %d)",
                 seed, iter, td_view_format(&dv, a, sizeof(a)),
                 td_view_format(&sv, b, sizeof(b)),
                 td__copy_plan_path(&dv, &sv));
    free(d);
    free(s);
    free(want);
  }
  for (int p = 1; p < 5; p++)
    cr_expect(paths[p] > 0, "seed %" PRIu64 ": path %d never taken", seed, p);
}

Test(copy, overlapping_views_of_one_buffer, .timeout = 120) {
  seed_rng();
  for (int iter = 0; iter < 2000; iter++) {
    int64_t shape[TD_MAX_DIMS];
    int32_t nd = random_shape(shape);
    td_dtype dt = dtypes[rr(0, 4)];
    td_view dv, sv;
    size_t dn = random_layout(dt, nd, shape, 0, &dv);
    size_t sn = random_layout(dt, nd, shape, 1, &sv);
    if (rr(0, 3) == 0) { /* the same layout, shifted by a few elements */
      sv = dv;
      sv.offset += rr(0, 3);
      sn = dn + 3 * td_dtype_size(dt);
    }
    size_t n = dn > sn ? dn : sn;
    unsigned char *buf = malloc(n), *snap = malloc(n), *want = malloc(n);
    fill(buf, n);
    memcpy(snap, buf, n);
    memcpy(want, buf, n);
    reference(want, &dv, snap, &sv);
    cr_assert_eq(td__copy_raw(buf, &dv, buf, &sv, 0), 0, "seed %" PRIu64 ": %s", seed,
                 td_view_last_error());
    char a[512], b[512];
    cr_assert_eq(memcmp(buf, want, n), 0, "seed %" PRIu64 " iter %d: %s <- %s", seed,
                 iter, td_view_format(&dv, a, sizeof(a)),
                 td_view_format(&sv, b, sizeof(b)));
    free(buf);
    free(snap);
    free(want);
  }
}

/* Two mappings of the same bytes, as a process gets when it opens one
 * storage read-only and read-write: overlap is judged by offsets. */
Test(copy, aliased_mappings_copy_as_if_read_first) {
  seed_rng();
  size_t n = 1 << 16;
  int fd = memfd_create("test_copy", MFD_CLOEXEC);
  cr_assert(fd >= 0);
  cr_assert_eq(ftruncate(fd, (off_t)n), 0);
  unsigned char *m1 = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  unsigned char *m2 = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  cr_assert(m1 != MAP_FAILED && m2 != MAP_FAILED && m1 != m2);
  unsigned char *snap = malloc(n), *want = malloc(n);
  for (int iter = 0; iter < 300; iter++) {
    int64_t shape[TD_MAX_DIMS];
    int32_t nd = random_shape(shape);
    td_dtype dt = dtypes[rr(0, 4)];
    td_view dv, sv;
    size_t dn = random_layout(dt, nd, shape, 0, &dv);
    size_t sn = random_layout(dt, nd, shape, 1, &sv);
    if (dn > n || sn > n)
      continue;
    if (rr(0, 1)) {
      sv = dv;
      sv.offset += rr(0, 2);
      if (dn + 2 * td_dtype_size(dt) > n)
        continue;
    }
    fill(m1, n);
    memcpy(snap, m1, n);
    memcpy(want, m1, n);
    reference(want, &dv, snap, &sv);
    cr_assert_eq(td__copy_raw(m1, &dv, m2, &sv, 1), 0);
    cr_assert_eq(memcmp(m2, want, n), 0, "seed %" PRIu64 " iter %d", seed, iter);
  }
  /* The classic: shift a row right by one element in place. */
  td_view a, b;
  int64_t len = 1000;
  cr_assert_eq(td_view_contiguous(TD_INT32, 1, &len, &a), 0);
  b = a;
  b.offset = 1;
  int32_t *p1 = (int32_t *)m1, *p2 = (int32_t *)m2;
  for (int i = 0; i < 1001; i++)
    p1[i] = i;
  cr_assert_eq(td__copy_raw(p2, &b, p1, &a, 1), 0);
  for (int i = 0; i < 1000; i++)
    cr_assert_eq(p1[i + 1], i, "element %d", i + 1);
  free(snap);
  free(want);
  munmap(m1, n);
  munmap(m2, n);
}

static void view2(td_view *v, td_dtype dt, int64_t r, int64_t c, int64_t rs,
                  int64_t cs, int64_t off) {
  memset(v, 0, sizeof(*v));
  v->dtype = dt;
  v->ndim = 2;
  v->shape[0] = r;
  v->shape[1] = c;
  v->stride[0] = rs;
  v->stride[1] = cs;
  v->offset = off;
}

Test(copy, each_layout_takes_its_path) {
  td_view d, s;
  view2(&d, TD_FLOAT32, 64, 64, 64, 1, 0);
  view2(&s, TD_FLOAT32, 64, 64, 64, 1, 7);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_MEMCPY,
               "contiguous to contiguous is one memcpy");
  view2(&d, TD_FLOAT32, 64, 64, 1, 64, 0);
  view2(&s, TD_FLOAT32, 64, 64, 1, 64, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_MEMCPY,
               "two views transposed alike are dense in the same order");
  view2(&d, TD_FLOAT32, 1, 64, 999, 1, 0);
  view2(&s, TD_FLOAT32, 1, 64, 3, 1, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_MEMCPY,
               "a size-1 dim's stride does not matter");
  view2(&d, TD_FLOAT32, 64, 32, 32, 1, 0);
  view2(&s, TD_FLOAT32, 64, 32, 64, 1, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_BLOCKS,
               "narrowed rows are a memcpy each");
  view2(&d, TD_FLOAT32, 64, 64, 64, 1, 0);
  view2(&s, TD_FLOAT32, 64, 64, 1, 64, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_TILED,
               "a transpose goes in tiles");
  view2(&d, TD_FLOAT32, 64, 32, 32, 1, 0);
  view2(&s, TD_FLOAT32, 64, 32, 64, 2, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_STRIDED);
  view2(&s, TD_FLOAT32, 64, 32, 0, 1, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_BLOCKS,
               "a broadcast row is copied a row at a time");
  view2(&d, TD_FLOAT32, 0, 32, 32, 1, 0);
  view2(&s, TD_FLOAT32, 0, 32, 32, 1, 0);
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_NONE);
}

Test(copy, transposes_of_every_size_and_edge) {
  td_dtype dts[] = {TD_UINT8, TD_INT16, TD_FLOAT32, TD_FLOAT64, TD_COMPLEX128};
  int64_t dims[][2] = {{1, 300}, {67, 133}, {128, 128}, {3, 257}, {200, 5}};
  for (size_t t = 0; t < 5; t++) {
    for (size_t k = 0; k < 5; k++) {
      int64_t r = dims[k][0], c = dims[k][1];
      size_t es = td_dtype_size(dts[t]), n = (size_t)(r * c) * es;
      td_view d, s;
      view2(&d, dts[t], r, c, c, 1, 0);
      view2(&s, dts[t], r, c, 1, r, 0);
      unsigned char *src = malloc(n), *dst = calloc(1, n), *want = calloc(1, n);
      fill(src, n);
      reference(want, &d, src, &s);
      cr_assert_eq(td__copy_raw(dst, &d, src, &s, 0), 0);
      cr_assert_eq(memcmp(dst, want, n), 0, "%s %lldx%lld",
                   td_dtype_name(dts[t]), (long long)r, (long long)c);
      free(src);
      free(dst);
      free(want);
    }
  }
}

Test(copy, bad_input_leaves_the_destination) {
  unsigned char d[256], s[256], before[256];
  memset(s, 1, sizeof(s));
  memset(d, 2, sizeof(d));
  memcpy(before, d, sizeof(d));
  td_view dv, sv;
  view2(&dv, TD_FLOAT32, 4, 4, 4, 1, 0);
  view2(&sv, TD_INT32, 4, 4, 4, 1, 0);
  cr_assert_eq(td__copy_raw(d, &dv, s, &sv, 0), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "float32") != NULL);
  view2(&sv, TD_FLOAT32, 4, 3, 4, 1, 0);
  cr_assert_eq(td__copy_raw(d, &dv, s, &sv, 0), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "dim 1") != NULL, "%s",
            td_view_last_error());
  sv.ndim = 1;
  cr_assert_eq(td__copy_raw(d, &dv, s, &sv, 0), TD_EINVAL);
  view2(&dv, TD_FLOAT32, 4, 4, 0, 1, 0);
  view2(&sv, TD_FLOAT32, 4, 4, 4, 1, 0);
  cr_assert_eq(td__copy_raw(d, &dv, s, &sv, 0), TD_EINVAL,
               "a destination that names an element twice");
  cr_assert(strstr(td_view_last_error(), "stride 0") != NULL);
  cr_assert_eq(memcmp(d, before, sizeof(d)), 0);
  /* The other way round is a broadcast, and fine. */
  view2(&dv, TD_FLOAT32, 4, 4, 4, 1, 0);
  view2(&sv, TD_FLOAT32, 4, 4, 0, 1, 0);
  cr_assert_eq(td__copy_raw(d, &dv, s, &sv, 0), 0);
  cr_assert_eq(d[0], 1);
}

/* Plans are made for views checked only for overflow (a DLPack source is
 * checked against SIZE_MAX): merging two dims must not overflow int64 in
 * size * stride (under UBSan this aborted). */
Test(copy, plans_for_huge_strides_do_not_overflow) {
  td_view d, s;
  /* Source dim 1 steps 2^62 bytes: merging it into dim 0 would compare
   * against 2 * 2^62. */
  view2(&d, TD_FLOAT64, 2, 2, 2, 1, 0);
  view2(&s, TD_FLOAT64, 2, 2, 1, 1LL << 59, 0);
  cr_assert_eq(td_view_check(&s, SIZE_MAX), 0, "%s", td_view_last_error());
  cr_assert_eq(td__copy_plan_path(&d, &s), TD__COPY_TILED);
  view2(&d, TD_FLOAT64, 2, 2, 1, 1LL << 59, 0);
  view2(&s, TD_FLOAT64, 2, 2, 2, 1, 0);
  cr_assert_eq(td_view_check(&d, SIZE_MAX), 0, "%s", td_view_last_error());
  cr_assert_neq(td__copy_plan_path(&d, &s), TD__COPY_MEMCPY);
}

/* test_views.c: views of one storage across processes, td_copy between real
 * storages, and DLPack out of and into tensord. */
#include "harness.h"

#include <criterion/criterion.h>
#include <dlpack/dlpack.h>
#include <string.h>
#include <time.h>

static tdt_daemon d;

static void setup(void) {
  tdt_start(&d, NULL);
}

TestSuite(views, .init = setup, .fini = tdt_cleanup, .timeout = 30);

/* ---- a transposed, narrowed view across processes ---- */

#define ROWS 6
#define COLS 8

typedef struct xarg {
  const char *sock;
  td_view published; /* what A published, to compare with B's lookup */
  int ready_w;       /* B -> A: B has read and set up its view */
  int written_r;     /* A -> B: A has written through its view */
  int unused[2];     /* the other ends, closed in B */
} xarg;

/* A's view: storage float32[6, 8] (element f holds f), transposed, rows 2..5
 * of the transpose: element (i, j) is storage element j * 8 + i + 2. */
static int64_t a_flat(int64_t i, int64_t j) {
  return j * COLS + i + 2;
}

/* Whether storage element f is in A's view. */
static int in_a(int64_t f) {
  return f % COLS >= 2 && f % COLS < 6;
}

static int reader(void *p) {
  xarg *a = p;
  close(a->unused[0]);
  close(a->unused[1]);
  td_client *c;
  td_storage *s;
  td_view v, mine;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK(td_lookup(c, "views/t", 0, 5000, &s, &v) == 0);
  CHECK(memcmp(&v, &a->published, sizeof(v)) == 0);
  const float *f = td_storage_data(s);
  /* The same logical values A sees. */
  for (int64_t i = 0; i < v.shape[0]; i++)
    for (int64_t j = 0; j < v.shape[1]; j++) {
      int64_t off;
      CHECK(td_view_offset_of(&v, (int64_t[]){i, j}, &off) == 0);
      CHECK(f[off] == (float)a_flat(i, j));
    }
  /* B's own view of the same bytes: every third element from 1. */
  int64_t n = ROWS * COLS;
  CHECK(td_view_contiguous(TD_FLOAT32, 1, &n, &mine) == 0);
  CHECK(td_view_slice(&mine, 0, 1, INT64_MAX, 3) == 0);
  CHECK(mine.shape[0] == 16);
  CHECK(write(a->ready_w, "r", 1) == 1);
  char b;
  CHECK(read(a->written_r, &b, 1) == 1);
  /* A negated everything in its view; B sees it through its own. */
  for (int64_t k = 0; k < mine.shape[0]; k++) {
    int64_t off, fl = 1 + 3 * k;
    CHECK(td_view_offset_of(&mine, &k, &off) == 0);
    CHECK(off == fl);
    CHECK(f[off] == (in_a(fl) ? -(float)fl : (float)fl));
  }
  /* And writes through it, for A to see through A's view. */
  float *w = td_storage_data(s);
  for (int64_t k = 0; k < mine.shape[0]; k++)
    w[mine.offset + k * mine.stride[0]] = 1000.0f + (float)k;
  td_storage_release(s);
  td_close(c);
  close(a->ready_w);
  close(a->written_r);
  return 0;
}

TDT_TEST(views, a_transposed_narrowed_view_reads_the_same_in_another_process) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, ROWS * COLS * sizeof(float), &s), 0);
  float *f = td_storage_data(s);
  for (int i = 0; i < ROWS * COLS; i++)
    f[i] = (float)i;
  td_view v;
  int64_t shape[2] = {ROWS, COLS};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), 0);
  cr_assert_eq(td_view_narrow(&v, 0, 2, 4), 0);
  cr_assert_eq(td_publish(c, "views/t", s, &v), 0, "%s", td_last_error(c));

  int ready[2], written[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(written), 0);
  xarg a = {d.sock, v, ready[1], written[0], {ready[0], written[1]}};
  pid_t pid = tdt_fork(reader, &a);
  close(ready[1]);
  close(written[0]);
  char b;
  cr_assert_eq(read(ready[0], &b, 1), 1, "B did not get ready");
  for (int64_t i = 0; i < v.shape[0]; i++)
    for (int64_t j = 0; j < v.shape[1]; j++) {
      int64_t off;
      cr_assert_eq(td_view_offset_of(&v, (int64_t[]){i, j}, &off), 0);
      f[off] = -f[off];
    }
  cr_assert_eq(write(written[1], "w", 1), 1);
  cr_assert_eq(tdt_wait(pid), 0, "B's checks");
  close(ready[0]);
  close(written[1]);
  /* B's writes, through A's view. */
  for (int64_t i = 0; i < v.shape[0]; i++)
    for (int64_t j = 0; j < v.shape[1]; j++) {
      int64_t off, fl = a_flat(i, j);
      cr_assert_eq(td_view_offset_of(&v, (int64_t[]){i, j}, &off), 0);
      float want = fl % 3 == 1 ? 1000.0f + (float)((fl - 1) / 3) : -(float)fl;
      cr_assert_eq(f[off], want, "(%lld, %lld)", (long long)i, (long long)j);
    }
  cr_assert_eq(td_unpublish(c, "views/t"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

/* ---- td_copy between storages ---- */

TDT_TEST(views, copy_materialises_a_transpose_and_respects_readonly) {
  td_client *c = tdt_connect(&d);
  td_storage *src, *dst, *ro;
  const int R = 37, C = 53;
  size_t nb = (size_t)R * C * sizeof(int32_t);
  cr_assert_eq(td_storage_create(c, nb, &src), 0);
  cr_assert_eq(td_storage_create(c, nb, &dst), 0);
  int32_t *sp = td_storage_data(src), *dp = td_storage_data(dst);
  for (int i = 0; i < R * C; i++)
    sp[i] = i;
  td_view sv, dv;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, (int64_t[]){R, C}, &sv), 0);
  cr_assert_eq(td_view_transpose(&sv, 0, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, (int64_t[]){C, R}, &dv), 0);
  cr_assert_eq(td_copy(dst, &dv, src, &sv), 0, "%s", td_view_last_error());
  for (int i = 0; i < C; i++)
    for (int j = 0; j < R; j++)
      cr_assert_eq(dp[i * R + j], j * C + i);

  /* A read-only handle is refused as a destination and left alone. */
  cr_assert_eq(td_storage_open(c, td_storage_id(dst), TD_RDONLY, &ro), 0);
  td_view whole;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, (int64_t[]){C, R}, &whole), 0);
  cr_assert_eq(td_copy(ro, &whole, src, &whole), TD_EACCES);
  cr_assert(strstr(td_view_last_error(), "read-only") != NULL, "%s",
            td_view_last_error());
  cr_assert_eq(dp[1], C, "unchanged");
  /* A view that reaches past its storage. */
  td_view big = whole;
  big.offset = 1;
  cr_assert_eq(td_copy(dst, &big, src, &whole), TD_ERANGE);
  cr_assert(strstr(td_view_last_error(), "destination") != NULL);
  cr_assert_eq(td_copy(dst, &whole, src, &big), TD_ERANGE);
  cr_assert(strstr(td_view_last_error(), "source") != NULL);

  /* The same storage through two mappings (read-only source, read-write
   * destination) shifted by one element: copied as if read first. */
  td_view head, tail;
  int64_t n = (int64_t)R * C - 1;
  cr_assert_eq(td_view_contiguous(TD_INT32, 1, &n, &head), 0);
  tail = head;
  tail.offset = 1;
  for (int i = 0; i < R * C; i++)
    dp[i] = i;
  cr_assert(td_storage_data(ro) != td_storage_data(dst));
  cr_assert_eq(td_copy(dst, &tail, ro, &head), 0, "%s", td_view_last_error());
  for (int i = 0; i < R * C - 1; i++)
    cr_assert_eq(dp[i + 1], i, "element %d", i + 1);
  td_storage_release(ro);
  td_storage_release(src);
  td_storage_release(dst);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

/* ---- DLPack ---- */

typedef struct find_arg {
  uint64_t id;
  int found;
} find_arg;

static int find_cb(const td_storage_info *info, void *p) {
  find_arg *f = p;
  if (info->id == f->id)
    f->found = 1;
  return 0;
}

/* Whether tensord lists storage id, asked on a connection of its own. */
static int listed(uint64_t id) {
  td_client *c = tdt_connect(&d);
  find_arg f = {id, 0};
  cr_assert_eq(td_list(c, find_cb, &f), 0);
  td_close(c);
  return f.found;
}

static int until_unlisted(uint64_t id, int timeout_ms) {
  struct timespec ts = {0, 2 * 1000 * 1000};
  for (int waited = 0; waited < timeout_ms; waited += 2) {
    if (!listed(id))
      return 1;
    nanosleep(&ts, NULL);
  }
  return !listed(id);
}

TDT_TEST(views, dlpack_round_trip_and_the_deleter_drops_the_reference) {
  td_client *c = tdt_connect(&d);
  td_storage *s, *copy, *got;
  cr_assert_eq(td_storage_create(c, 4 * 5 * sizeof(int32_t), &s), 0);
  uint64_t id = td_storage_id(s);
  int32_t *p = td_storage_data(s);
  for (int i = 0; i < 20; i++)
    p[i] = 100 + i;
  td_view v; /* int32[4, 5] transposed, rows 1..3: [3, 4] stride (1, 5) */
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, (int64_t[]){4, 5}, &v), 0);
  cr_assert_eq(td_view_transpose(&v, 0, 1), 0);
  cr_assert_eq(td_view_narrow(&v, 0, 1, 3), 0);
  DLManagedTensor *m;
  cr_assert_eq(td_to_dlpack(s, &v, &m), 0, "%s", td_view_last_error());
  DLTensor *t = &m->dl_tensor;
  cr_assert_eq(t->data, (char *)td_storage_data(s) + 4,
               "no copy: the mapping itself, at the first element");
  cr_assert_eq(t->byte_offset, 0);
  cr_assert_eq(t->device.device_type, kDLCPU);
  cr_assert_eq(t->ndim, 2);
  cr_assert_eq(t->shape[0], 3);
  cr_assert_eq(t->shape[1], 4);
  cr_assert_eq(t->strides[0], 1);
  cr_assert_eq(t->strides[1], 5);
  cr_assert_eq(t->dtype.code, kDLInt);
  cr_assert_eq(t->dtype.bits, 32);
  cr_assert_eq(t->dtype.lanes, 1);

  /* The tensor's reference keeps the storage after the caller's goes. */
  cr_assert_eq(td_storage_release(s), 0);
  cr_assert_eq(tdt_storages(&d), 1);
  const char *base = t->data;
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++) {
      int32_t x;
      memcpy(&x, base + (i * t->strides[0] + j * t->strides[1]) * 4, 4);
      cr_assert_eq(x, 100 + j * 5 + i + 1);
    }

  /* Back into tensord: one copy, contiguous, published. */
  cr_assert_eq(td_from_dlpack(c, m, "dl/copy", 0, &copy), 0, "%s",
               td_view_last_error());
  cr_assert_neq(td_storage_id(copy), id);
  td_view pv;
  cr_assert_eq(td_lookup(c, "dl/copy", TD_RDONLY, 0, &got, &pv), 0);
  cr_assert_eq(td_storage_id(got), td_storage_id(copy));
  char vb[128];
  cr_assert_str_eq(td_view_format(&pv, vb, sizeof(vb)),
                   "int32[3, 4] stride (4, 1) offset 0");
  const int32_t *q = td_storage_data(got);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++)
      cr_assert_eq(q[i * 4 + j], 100 + j * 5 + i + 1);
  td_storage_release(got);
  cr_assert_eq(tdt_storages(&d), 2);

  /* The deleter drops the last reference to the original. */
  cr_assert(listed(id));
  m->deleter(m);
  cr_assert(until_unlisted(id, 2000), "storage %llu still listed",
            (unsigned long long)id);
  cr_assert_eq(tdt_storages(&d), 1);
  cr_assert_eq(td_unpublish(c, "dl/copy"), 0);
  td_storage_release(copy);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

TDT_TEST(views, publish_refuses_a_view_of_more_than_int64_max_elements) {
  td_client *c = tdt_connect(&d);
  td_storage *s, *h = NULL;
  cr_assert_eq(td_storage_create(c, 1, &s), 0);
  /* One byte seen 2^64 + 2^34 times through zero strides. */
  td_view v;
  memset(&v, 0, sizeof(v));
  v.dtype = TD_UINT8;
  v.ndim = 2;
  v.shape[0] = 1LL << 32;
  v.shape[1] = (1LL << 32) + 4;
  cr_assert_eq(td_publish(c, "huge", s, &v), TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "[4294967296, 4294967300]") != NULL &&
                strstr(td_last_error(c), "INT64_MAX") != NULL,
            "'%s'", td_last_error(c));
  cr_assert_eq(td_lookup(c, "huge", 0, 0, &h, NULL), TD_ENOENT);
  /* As many as fit are fine. */
  v.shape[0] = 2;
  v.shape[1] = INT64_MAX / 2;
  cr_assert_eq(td_publish(c, "huge", s, &v), 0, "%s", td_last_error(c));
  td_view got;
  cr_assert_eq(td_lookup(c, "huge", TD_TAKE, 0, &h, &got), 0);
  cr_assert_eq(td_view_numel(&got), INT64_MAX - 1);
  td_storage_release(h);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

/* Views whose elements overlap (strides that are not 0 but collide) can
 * name far more elements than their bytes: the temporary buffer an
 * overlapping copy needs must be sized without wrapping. */
TDT_TEST(views, copy_refuses_what_no_buffer_can_hold) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  size_t n = 16 * 1024;
  cr_assert_eq(td_storage_create(c, n, &s), 0);
  unsigned char *bytes = td_storage_data(s);
  for (size_t i = 0; i < n; i++)
    bytes[i] = (unsigned char)i;
  /* complex128 [64]^10 with every stride 1: 2^60 elements of 16 bytes, over
   * 10 KiB. The source is the same shape one element on, so the two
   * overlap and take the path through a temporary of 2^64 bytes. */
  td_view dv, sv;
  memset(&dv, 0, sizeof(dv));
  dv.dtype = TD_COMPLEX128;
  dv.ndim = 10;
  for (int i = 0; i < 10; i++) {
    dv.shape[i] = 64;
    dv.stride[i] = 1;
  }
  sv = dv;
  sv.offset = 1;
  cr_assert_eq(td_view_check(&dv, n), 0, "%s", td_view_last_error());
  cr_assert_eq(td_view_check(&sv, n), 0, "%s", td_view_last_error());
  cr_assert_eq(td_copy(s, &dv, s, &sv), TD_ENOMEM);
  cr_assert(strstr(td_view_last_error(), "1152921504606846976") != NULL, "'%s'",
            td_view_last_error());
  for (size_t i = 0; i < n; i++)
    cr_assert_eq(bytes[i], (unsigned char)i, "byte %zu changed", i);
  /* A source of more than INT64_MAX elements is refused as such. */
  memset(&sv, 0, sizeof(sv));
  sv.dtype = TD_UINT8;
  sv.ndim = 2;
  sv.shape[0] = 1LL << 32;
  sv.shape[1] = (1LL << 32) + 4;
  dv = sv;
  cr_assert_eq(td_copy(s, &dv, s, &sv), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "INT64_MAX") != NULL, "'%s'",
            td_view_last_error());
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

/* A consumer that reads data and ignores byte_offset, as PyTorch 1.13 does
 * on import, still sees the view's own elements. */
TDT_TEST(views, dlpack_export_points_data_at_the_first_element) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, ROWS * COLS * sizeof(float), &s), 0);
  float *f = td_storage_data(s);
  for (int i = 0; i < ROWS * COLS; i++)
    f[i] = (float)i;
  td_view v, row, empty;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, (int64_t[]){ROWS, COLS}, &v),
               0);
  cr_assert_eq(td_view_narrow(&v, 0, 2, 3), 0); /* rows 2..4 */
  cr_assert_eq(td_view_narrow(&v, 1, 1, 6), 0); /* columns 1..6 */
  row = v;
  cr_assert_eq(td_view_select(&row, 0, 2), 0); /* row 4, columns 1..6 */
  empty = v;
  cr_assert_eq(td_view_narrow(&empty, 0, 3, 0), 0);
  DLManagedTensor *m;
  cr_assert_eq(td_to_dlpack(s, &v, &m), 0, "%s", td_view_last_error());
  DLTensor *t = &m->dl_tensor;
  cr_assert_eq(t->byte_offset, 0);
  cr_assert_eq(t->data, (char *)f + (2 * COLS + 1) * sizeof(float));
  cr_assert_eq(t->strides[0], COLS);
  cr_assert_eq(t->strides[1], 1);
  const float *p = t->data;
  for (int64_t i = 0; i < t->shape[0]; i++)
    for (int64_t j = 0; j < t->shape[1]; j++)
      cr_assert_eq(p[i * t->strides[0] + j * t->strides[1]],
                   (float)((2 + i) * COLS + 1 + j), "element (%lld, %lld)",
                   (long long)i, (long long)j);
  m->deleter(m);
  cr_assert_eq(td_to_dlpack(s, &row, &m), 0, "%s", td_view_last_error());
  cr_assert_eq(m->dl_tensor.byte_offset, 0);
  cr_assert_eq(*(const float *)m->dl_tensor.data, (float)(4 * COLS + 1));
  m->deleter(m);
  /* Uint8 bytes of the whole storage start at the mapping. */
  cr_assert_eq(td_to_dlpack(s, NULL, &m), 0);
  cr_assert_eq(m->dl_tensor.data, (void *)f);
  cr_assert_eq(m->dl_tensor.byte_offset, 0);
  m->deleter(m);
  /* An empty view still gets a pointer inside (or just past) the mapping. */
  cr_assert_eq(td_to_dlpack(s, &empty, &m), 0, "%s", td_view_last_error());
  cr_assert_eq(m->dl_tensor.shape[0], 0);
  cr_assert_eq(m->dl_tensor.byte_offset, 0);
  cr_assert_eq(m->dl_tensor.data,
               (char *)f + (size_t)empty.offset * sizeof(float));
  m->deleter(m);
  /* Imported back, data and byte_offset both count: both are honoured. */
  cr_assert_eq(td_to_dlpack(s, &v, &m), 0);
  m->dl_tensor.data = (char *)m->dl_tensor.data - 8;
  m->dl_tensor.byte_offset = 8;
  td_storage *copy;
  cr_assert_eq(td_from_dlpack(c, m, NULL, TD_DLPACK_CONSUME, &copy), 0, "%s",
               td_view_last_error());
  const float *q = td_storage_data(copy);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 6; j++)
      cr_assert_eq(q[i * 6 + j], (float)((2 + i) * COLS + 1 + j));
  td_storage_release(copy);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

/* An external tensor, as numpy or torch would hand one over. */
typedef struct ext {
  DLManagedTensor m;
  int64_t shape[2], strides[2];
  int deleted;
} ext;

static void ext_deleter(DLManagedTensor *m) {
  ((ext *)m->manager_ctx)->deleted++;
}

static void ext_init(ext *e, void *data, int64_t r, int64_t c,
                     const int64_t *strides, DLDataType dt) {
  memset(e, 0, sizeof(*e));
  e->shape[0] = r;
  e->shape[1] = c;
  e->m.dl_tensor.data = data;
  e->m.dl_tensor.device.device_type = kDLCPU;
  e->m.dl_tensor.ndim = 2;
  e->m.dl_tensor.dtype = dt;
  e->m.dl_tensor.shape = e->shape;
  if (strides != NULL) {
    e->strides[0] = strides[0];
    e->strides[1] = strides[1];
    e->m.dl_tensor.strides = e->strides;
  }
  e->m.manager_ctx = e;
  e->m.deleter = ext_deleter;
}

TDT_TEST(views, dlpack_import_of_strided_external_tensors) {
  td_client *c = tdt_connect(&d);
  double data[7 * 6];
  for (int i = 0; i < 42; i++)
    data[i] = i * 0.5;
  DLDataType f64 = {kDLFloat, 64, 1};
  ext e;
  /* [6, 7] seen through strides (1, 6): the transpose of a [7, 6]. */
  ext_init(&e, data, 6, 7, (int64_t[]){1, 6}, f64);
  td_storage *s;
  cr_assert_eq(td_from_dlpack(c, &e.m, NULL, 0, &s), 0, "%s",
               td_view_last_error());
  cr_assert_eq(e.deleted, 0, "the caller keeps the tensor");
  cr_assert_eq(td_storage_nbytes(s), 42 * sizeof(double));
  const double *q = td_storage_data(s);
  for (int i = 0; i < 6; i++)
    for (int j = 0; j < 7; j++)
      cr_assert_eq(q[i * 7 + j], data[i + j * 6]);
  td_storage_release(s);

  /* NULL strides: row-major; byte_offset honoured; TD_DLPACK_CONSUME. */
  ext_init(&e, data, 2, 3, NULL, f64);
  e.m.dl_tensor.byte_offset = 8 * sizeof(double);
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/ext", TD_DLPACK_CONSUME, NULL), 0,
               "%s", td_view_last_error());
  cr_assert_eq(e.deleted, 1);
  td_view v;
  cr_assert_eq(td_lookup(c, "dl/ext", TD_TAKE, 0, &s, &v), 0);
  cr_assert_eq(v.dtype, TD_FLOAT64);
  q = td_storage_data(s);
  for (int i = 0; i < 6; i++)
    cr_assert_eq(q[i], data[8 + i]);
  td_storage_release(s);

  /* bool (kDLBool of later DLPack) comes in as bool, goes out as uint8. */
  uint8_t flags[4] = {1, 0, 1, 1};
  ext_init(&e, flags, 2, 2, NULL, (DLDataType){6, 8, 1});
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/bool", 0, NULL), 0);
  cr_assert_eq(td_lookup(c, "dl/bool", TD_TAKE, 0, &s, &v), 0);
  cr_assert_eq(v.dtype, TD_BOOL);
  DLManagedTensor *m;
  cr_assert_eq(td_to_dlpack(s, &v, &m), 0);
  cr_assert_eq(m->dl_tensor.dtype.code, kDLUInt);
  cr_assert_eq(m->dl_tensor.dtype.bits, 8);
  m->deleter(m);
  /* float8 has no DLPack 0.6 code. */
  cr_assert_eq(td_view_reinterpret(&v, TD_FLOAT8_E5M2), 0);
  m = (DLManagedTensor *)&e;
  cr_assert_eq(td_to_dlpack(s, &v, &m), TD_EINVAL);
  cr_assert_null(m);
  cr_assert(strstr(td_view_last_error(), "float8_e5m2") != NULL);
  /* The whole storage as bytes. */
  cr_assert_eq(td_to_dlpack(s, NULL, &m), 0);
  cr_assert_eq(m->dl_tensor.ndim, 1);
  cr_assert_eq(m->dl_tensor.shape[0], 4);
  td_storage_release(s);
  m->deleter(m);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
}

static int no_storages(const tdt_daemon *dd) {
  return tdt_storages(dd) == 0;
}

TDT_TEST(views, dlpack_import_refuses_what_it_cannot_copy) {
  td_client *c = tdt_connect(&d);
  float data[16] = {0};
  ext e;
  td_storage *s = (td_storage *)&e;
  struct {
    const char *what;
    DLDataType dt;
    int device;
    int64_t stride0;
    int want;
    const char *needle;
  } cases[] = {
      {"a CUDA tensor", {kDLFloat, 32, 1}, kDLCUDA, 4, TD_ENODEV, "device"},
      {"vector lanes", {kDLFloat, 32, 2}, kDLCPU, 4, TD_EINVAL, "lanes"},
      {"8-bit float", {kDLFloat, 8, 1}, kDLCPU, 4, TD_EINVAL, "8 bits"},
      {"opaque handles",
       {kDLOpaqueHandle, 64, 1},
       kDLCPU,
       4,
       TD_EINVAL,
       "type code 3"},
      {"a negative stride",
       {kDLFloat, 32, 1},
       kDLCPU,
       -4,
       TD_EINVAL,
       "negative stride"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    ext_init(&e, data, 4, 4, (int64_t[]){cases[i].stride0, 1}, cases[i].dt);
    e.m.dl_tensor.device.device_type = cases[i].device;
    s = (td_storage *)&e;
    cr_expect_eq(td_from_dlpack(c, &e.m, "dl/bad", TD_DLPACK_CONSUME, &s),
                 cases[i].want, "%s", cases[i].what);
    cr_expect_null(s, "%s: *out is NULL on failure", cases[i].what);
    cr_expect_eq(e.deleted, 1, "%s: consumed even on failure", cases[i].what);
    cr_expect(strstr(td_view_last_error(), cases[i].needle) != NULL, "%s: '%s'",
              cases[i].what, td_view_last_error());
  }
  /* One double seen 2^61 times: 2^64 bytes once copied. It used to become a
   * 1-byte storage that the copy then ran past. */
  double one = 1.0;
  ext_init(&e, &one, 1LL << 31, 1LL << 30, (int64_t[]){0, 0},
           (DLDataType){kDLFloat, 64, 1});
  s = (td_storage *)&e;
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/bad", 0, &s), TD_EINVAL);
  cr_assert_null(s);
  cr_assert(strstr(td_view_last_error(), "2305843009213693952 elements") &&
                strstr(td_view_last_error(), "8 bytes"),
            "'%s'", td_view_last_error());
  /* 2^60 of them: 2^63 bytes, one past INT64_MAX. */
  e.shape[0] = 1LL << 30;
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/bad", 0, NULL), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "1152921504606846976") != NULL, "'%s'",
            td_view_last_error());
  /* More elements than int64 holds. */
  e.shape[0] = 1LL << 40;
  e.shape[1] = 1LL << 40;
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/bad", 0, NULL), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "INT64_MAX") != NULL, "'%s'",
            td_view_last_error());
  /* A byte_offset that wraps the address space round to valid memory. */
  ext_init(&e, &data[2], 2, 2, NULL, (DLDataType){kDLFloat, 32, 1});
  e.m.dl_tensor.byte_offset = UINT64_MAX - 7; /* data - 8 */
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/bad", 0, NULL), TD_EINVAL);
  cr_assert(strstr(td_view_last_error(), "byte_offset") != NULL, "'%s'",
            td_view_last_error());
  ext_init(&e, data, 4, 4, NULL, (DLDataType){kDLFloat, 32, 1});
  cr_assert_eq(td_from_dlpack(c, &e.m, NULL, 0, NULL), TD_EINVAL,
               "nothing would hold the storage");
  cr_assert_eq(td_from_dlpack(c, &e.m, "dl/bad", 0x8, NULL), TD_EINVAL);
  cr_assert_eq(td_from_dlpack(c, &e.m, "", 0, NULL), TD_EINVAL,
               "an empty key, refused by td_publish");
  cr_assert(strstr(td_view_last_error(), "key of 0 bytes") != NULL);
  cr_assert_eq(e.deleted, 0);
  cr_assert(tdt_until(no_storages, &d, 2000), "no storage left behind");
  td_storage *h = NULL;
  cr_assert_eq(td_lookup(c, "dl/bad", 0, 0, &h, NULL), TD_ENOENT);
  td_close(c);
}

/* test_cuda_copy.c: td_copy between GPU storages, over the driver's TEST
 * DOUBLE (tests/cuda/README.md): the copy kernel for element-strided views
 * on one GPU, its fall-backs (no module, TENSORD_CUDA_COPY_KERNEL=0, views
 * that overlap) and peer copies between two GPUs. The double's device
 * memory is host memory and it runs the kernel as host code, so these
 * tests prove the dispatch and the plan the kernel is given, never the
 * kernel's CUDA (tests/gpu/run.sh does, on a GPU). All CUDA work of a test
 * is done in the test's own process: nothing forked after it touched CUDA
 * uses CUDA. */
#include "harness.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static tdt_daemon d;
/* The double's TDCUDA_CALL_LOG for this test: "<pid> <call> [<what>]". */
static char call_log[64];

static void setup(void) {
  if (getenv("TENSORD_CUDA_DRIVER") == NULL)
    cr_skip_test("TENSORD_CUDA_DRIVER is not set: run through ctest, which "
                 "names the driver's test double");
}

static void teardown(void) {
  tdt_cleanup();
  if (call_log[0] != '\0') {
    unlink(call_log);
    call_log[0] = '\0';
  }
}

TestSuite(cuda_copy, .init = setup, .fini = teardown, .timeout = 60);

/* Starts tensord with the double's call log; env (NAME=VALUE, or NULL) is
 * set first, for the daemon and this process alike. */
static td_client *start(const char *env) {
  snprintf(call_log, sizeof(call_log), "/tmp/tdt-copylog.%d", (int)getpid());
  unlink(call_log);
  setenv("TDCUDA_CALL_LOG", call_log, 1);
  if (env != NULL)
    cr_assert_eq(putenv((char *)env), 0);
  tdt_start(&d, NULL);
  return tdt_connect(&d);
}

/* Lines of this process in the call log that begin with call. */
static int calls(const char *call) {
  FILE *f = fopen(call_log, "r");
  if (f == NULL)
    return 0;
  char line[256], want[128];
  snprintf(want, sizeof(want), "%d %s", (int)getpid(), call);
  size_t n = strlen(want);
  int count = 0;
  while (fgets(line, sizeof(line), f) != NULL)
    count += strncmp(line, want, n) == 0 &&
             (line[n] == '\n' || line[n] == ' ' || line[n] == '\0');
  fclose(f);
  return count;
}

/* Fills n bytes of s (a CPU storage, or a GPU's through the double, whose
 * device pointers are host addresses) from a seed. */
static void fill(td_storage *s, size_t n, unsigned seed) {
  unsigned char *p = td_storage_data(s);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245u + 12345u;
    p[i] = (unsigned char)(seed >> 16);
  }
}

/* A random view of shape[0..nd) over a contiguous base tensor of its own:
 * each dim stepped by 1..3, the dims permuted, an offset of a few
 * elements. Sets *nbytes to the storage it needs. */
static void random_view(td_dtype dt, int nd, const int64_t *shape, td_view *v,
                        size_t *nbytes) {
  int perm[TD_MAX_DIMS];
  for (int i = 0; i < nd; i++)
    perm[i] = i;
  for (int i = nd - 1; i > 0; i--) {
    int j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  /* The base's dim k holds view dim perm[k], stepped. */
  int64_t base[TD_MAX_DIMS], step[TD_MAX_DIMS], bstride[TD_MAX_DIMS];
  for (int k = 0; k < nd; k++) {
    step[k] = 1 + rand() % 3;
    base[k] = shape[perm[k]] * step[k] + rand() % 2;
  }
  int64_t st = 1;
  for (int k = nd - 1; k >= 0; k--) {
    bstride[k] = st;
    st *= base[k];
  }
  memset(v, 0, sizeof(*v));
  v->dtype = dt;
  v->ndim = nd;
  v->offset = rand() % 5;
  for (int k = 0; k < nd; k++) {
    v->shape[perm[k]] = shape[perm[k]];
    v->stride[perm[k]] = bstride[k] * step[k];
  }
  *nbytes = (size_t)(st + v->offset) * td_dtype_size(dt);
}

/* Copies sv of a GPU storage into dv of another on GPU dgpu (and on sgpu),
 * over a destination of junk, and checks the bytes of the whole
 * destination storage against td_copy of the same views between CPU
 * storages: the elements copied and everything else untouched. */
static void check_copy(td_client *c, int dgpu, const td_view *dv, size_t dn,
                       int sgpu, const td_view *sv, size_t sn, unsigned seed) {
  td_storage *hs, *ref, *gs, *gd;
  cr_assert_eq(td_storage_create(c, sn, &hs), 0);
  cr_assert_eq(td_storage_create(c, dn, &ref), 0);
  cr_assert_eq(tdt_create_cuda(c, sgpu, sn, &gs), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, dgpu, dn, &gd), 0, "%s", td_last_error(c));
  fill(hs, sn, seed);
  fill(gs, sn, seed);
  fill(ref, dn, ~seed);
  fill(gd, dn, ~seed);
  cr_assert_eq(td_copy(ref, dv, hs, sv), 0, "%s", td_view_last_error());
  cr_assert_eq(td_copy(gd, dv, gs, sv), 0, "seed %u: %s", seed,
               td_view_last_error());
  cr_assert_eq(memcmp(td_storage_data(gd), td_storage_data(ref), dn), 0,
               "seed %u: the GPU copy's bytes differ from a CPU copy's", seed);
  td_storage_release(hs);
  td_storage_release(ref);
  td_storage_release(gs);
  td_storage_release(gd);
}

/* n random element-strided copies on GPU 0 (transposes, permuted dims,
 * steps, offsets; 1, 2, 4 and 8-byte elements). */
static void random_copies(td_client *c, unsigned seed, int n) {
  static const td_dtype dts[] = {TD_UINT8, TD_INT16, TD_INT32, TD_INT64};
  srand(seed);
  for (int t = 0; t < n; t++) {
    int nd = 1 + rand() % 4;
    int64_t shape[TD_MAX_DIMS];
    for (int i = 0; i < nd; i++)
      shape[i] = 1 + rand() % 7;
    td_dtype dt = dts[t % 4];
    td_view sv, dv;
    size_t sn, dn;
    random_view(dt, nd, shape, &sv, &sn);
    random_view(dt, nd, shape, &dv, &dn);
    check_copy(c, 0, &dv, dn, 0, &sv, sn, seed + (unsigned)t);
  }
}

/* A 2D transpose of rows x cols int32s on GPU 0, checked. */
static void transpose(td_client *c, int64_t rows, int64_t cols) {
  int64_t s[2] = {rows, cols}, t[2] = {cols, rows};
  td_view sv, dv;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s, &sv), 0);
  cr_assert_eq(td_view_transpose(&sv, 0, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, t, &dv), 0);
  size_t n = (size_t)(rows * cols) * 4;
  check_copy(c, 0, &dv, n, 0, &sv, n, 7);
}

TDT_TEST(cuda_copy, kernel_copies_strided_views_on_one_gpu) {
  if (!TD_HAVE_KCOPY)
    cr_skip_test("built without nvcc (TD_HAVE_KCOPY=0): no kernel to "
                 "dispatch to; the fall-back tests still run");
  td_client *c = start(NULL);
  transpose(c, 37, 53);
  cr_assert_eq(calls("cuLaunchKernel td_copy_tiled"), 1,
               "a transpose on one GPU made %d launches of the tiled kernel, "
               "not 1",
               calls("cuLaunchKernel td_copy_tiled"));
  cr_assert_eq(calls("cuLaunchKernel"), 1);
  cr_assert_eq(calls("cuModuleLoadData"), 1);
  cr_assert_eq(calls("cuMemcpyDtoHAsync"), 0,
               "the transpose was staged through the host");
  random_copies(c, 20261206, 200);
  /* The module is loaded once per GPU, and every copy either a 2D copy or
   * a launch: nothing staged. */
  cr_assert_eq(calls("cuModuleLoadData"), 1);
  cr_assert_gt(calls("cuLaunchKernel"), 100);
  /* Both kernels: the tiled one for the copies whose source runs fastest
   * along another dim, the element walk for the rest. */
  cr_assert_gt(calls("cuLaunchKernel td_copy_tiled"), 10);
  cr_assert_gt(calls("cuLaunchKernel td_copy_strided"), 10);
  cr_assert_eq(calls("cuMemcpyDtoHAsync"), 0,
               "%d element-strided copies were staged through the host",
               calls("cuMemcpyDtoHAsync"));
  td_close(c);
}

/* The module goes with the library's last mapping on its GPU (an
 * application may keep the primary context alive, which would otherwise
 * hold every module ever loaded), and comes back with the next copy. */
TDT_TEST(cuda_copy, module_is_unloaded_with_the_last_mapping) {
  if (!TD_HAVE_KCOPY)
    cr_skip_test("built without nvcc (TD_HAVE_KCOPY=0): no module to load");
  /* No warm mappings: a released storage is unmapped at once. */
  td_client *c = start("TENSORD_CUDA_WARM_BYTES=off");
  transpose(c, 8, 9);
  cr_assert_eq(calls("cuModuleLoadData"), 1);
  cr_assert_eq(calls("cuModuleUnload"), 1,
               "the module outlived the GPU's last mapping");
  transpose(c, 9, 8);
  cr_assert_eq(calls("cuModuleLoadData"), 2);
  cr_assert_eq(calls("cuModuleUnload"), 2);
  cr_assert_eq(calls("cuLaunchKernel"), 2);
  td_close(c);
}

/* Views of one storage that do not overlap take the kernel; views that
 * overlap keep the staged path, which reads the source whole first. */
TDT_TEST(cuda_copy, overlapping_views_of_one_storage_are_staged) {
  td_client *c = start(NULL);
  td_storage *g, *h;
  cr_assert_eq(tdt_create_cuda(c, 0, 4096, &g), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  fill(g, 4096, 3);
  memcpy(td_storage_data(h), td_storage_data(g), 4096);
  int64_t s[2] = {16, 16};
  td_view sv, dv;
  /* The transpose of the first 1 KiB into the second. */
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s, &sv), 0);
  cr_assert_eq(td_view_transpose(&sv, 0, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s, &dv), 0);
  dv.offset = 256;
  cr_assert_eq(td_copy(g, &dv, g, &sv), 0, "%s", td_view_last_error());
  cr_assert_eq(td_copy(h, &dv, h, &sv), 0, "%s", td_view_last_error());
  cr_assert_eq(memcmp(td_storage_data(g), td_storage_data(h), 4096), 0);
  cr_assert_eq(calls("cuLaunchKernel"), TD_HAVE_KCOPY ? 1 : 0);
  /* In place: a transpose onto itself. */
  dv.offset = 0;
  int launched = calls("cuLaunchKernel");
  cr_assert_eq(td_copy(g, &dv, g, &sv), 0, "%s", td_view_last_error());
  cr_assert_eq(td_copy(h, &dv, h, &sv), 0, "%s", td_view_last_error());
  cr_assert_eq(memcmp(td_storage_data(g), td_storage_data(h), 4096), 0,
               "an in-place transpose on the GPU differs from the CPU's");
  cr_assert_eq(calls("cuLaunchKernel"), launched,
               "overlapping views went to the kernel");
  cr_assert_gt(calls("cuMemcpyDtoHAsync"), 0);
  td_storage_release(g);
  td_storage_release(h);
  td_close(c);
}

/* The checks the fall-back tests share: the same bytes, no launch, the
 * staged path's reads from the device. */
static void falls_back(td_client *c) {
  transpose(c, 19, 23);
  random_copies(c, 77, 40);
  cr_assert_eq(calls("cuLaunchKernel"), 0);
  cr_assert_gt(calls("cuMemcpyDtoHAsync"), 0,
               "the fall-back did not stage through the host");
}

/* A GPU the fatbin has no code for: the load fails once, remembered, and
 * every copy is staged as before, never an error. */
TDT_TEST(cuda_copy, no_binary_for_the_gpu_falls_back_to_staging) {
  td_client *c = start("TDCUDA_NO_MODULE=1");
  falls_back(c);
  cr_assert_eq(calls("cuModuleLoadData"), 0);
  td_close(c);
}

TDT_TEST(cuda_copy, switched_off_kernel_falls_back_to_staging) {
  td_client *c = start("TENSORD_CUDA_COPY_KERNEL=0");
  falls_back(c);
  cr_assert_eq(calls("cuModuleLoadData"), 0,
               "TENSORD_CUDA_COPY_KERNEL=0 still loaded the module");
  td_close(c);
}

/* Dense views of one layout on two GPUs: one cuMemcpyPeerAsync, whether
 * the GPUs have peer access or not (the driver stages it then). Other
 * views: where the GPUs reach each other, one launch of the kernel on the
 * destination's GPU, reading the source over the link; else staged. */
static void peer_copies(td_client *c, int peer) {
  int64_t n = 3000;
  td_view sv, dv;
  cr_assert_eq(td_view_contiguous(TD_INT32, 1, &n, &sv), 0);
  dv = sv;
  sv.offset = 5;
  dv.offset = 11;
  size_t bytes = (size_t)(n + 16) * 4;
  check_copy(c, 1, &dv, bytes, 0, &sv, bytes, 99);
  check_copy(c, 0, &dv, bytes, 1, &sv, bytes, 98);
  cr_assert_eq(calls("cuMemcpyPeerAsync"), 2);
  cr_assert_eq(calls("cuMemcpyDtoHAsync"), 0,
               "a dense copy between GPUs was staged through the host");
  /* Not dense: a transpose from cuda:0 into cuda:1, and every other
   * element back. */
  int64_t s[2] = {40, 30}, t[2] = {30, 40};
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s, &sv), 0);
  cr_assert_eq(td_view_transpose(&sv, 0, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, t, &dv), 0);
  check_copy(c, 1, &dv, 4800, 0, &sv, 4800, 97);
  int64_t m = 500;
  cr_assert_eq(td_view_contiguous(TD_INT32, 1, &m, &sv), 0);
  dv = sv;
  sv.stride[0] = 2;
  check_copy(c, 0, &dv, 2000, 1, &sv, 4000, 96);
  cr_assert_eq(calls("cuMemcpyPeerAsync"), 2);
  if (peer && TD_HAVE_KCOPY) {
    cr_assert_eq(calls("cuLaunchKernel td_copy_tiled"), 1);
    cr_assert_eq(calls("cuLaunchKernel td_copy_strided"), 1);
    cr_assert_eq(calls("cuMemcpyDtoHAsync"), 0,
                 "a copy between GPUs that reach each other was staged");
  } else {
    cr_assert_eq(calls("cuLaunchKernel"), 0);
    cr_assert_gt(calls("cuMemcpyDtoHAsync"), 0,
                 "GPUs without peer access: not staged through the host");
  }
}

TDT_TEST(cuda_copy, dense_copy_between_gpus_is_one_peer_copy) {
  td_client *c = start(NULL);
  peer_copies(c, 1);
  td_close(c);
}

TDT_TEST(cuda_copy, peer_copy_without_peer_access) {
  td_client *c = start("TDCUDA_NO_PEER=1");
  peer_copies(c, 0);
  td_close(c);
}

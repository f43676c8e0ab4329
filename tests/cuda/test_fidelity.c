/* test_fidelity.c: the driver behaviours tensord relies on, checked through
 * the driver API alone (device pointers are never dereferenced), so that one
 * file runs against the test double (test_cuda_fidelity, label cuda-double)
 * and against the real driver on a GPU (test_gpu_fidelity, label gpu;
 * skipped where no driver or no device is found). Where both pass, the
 * double imitates the driver on these points; the gpu build has not yet run
 * on a GPU (see tests/cuda/README.md). Each test forks before any driver
 * call, since the driver does not survive fork(). */
#include "cutest.h"

#include <sys/resource.h>

#define SKIPPED 77 /* a child's exit status: no driver or no device */

/* Loads the driver under test: the double when FIDELITY_DRIVER names it,
 * else libcuda.so.1. Returns NULL, with msg, where there is none. */
static const td__cu *load(char *msg, size_t len) {
#ifdef FIDELITY_DRIVER
  setenv(TD__CU_DRIVER_ENV, FIDELITY_DRIVER, 1);
#else
  unsetenv(TD__CU_DRIVER_ENV);
#endif
  return td__cu_load(msg, len);
}

static const td__cu *child_load(void) {
  const td__cu *cu = load(NULL, 0);
  if (cu == NULL)
    _exit(SKIPPED);
  return cu;
}

/* In the parent, after fork_child: the driver, or a skipped test (the child
 * is reaped first). */
static const td__cu *parent_load(int sock, pid_t child) {
  char msg[512] = "";
  const td__cu *cu = load(msg, sizeof msg);
  if (cu == NULL) {
    close(sock);
    wait_child(child);
    cr_skip_test("no CUDA device to test against: %s", msg);
  }
  return cu;
}

static size_t granularity(const td__cu *cu, int dev) {
  CUmemAllocationProp p = prop_for(dev, 1);
  size_t g = 0;
  if (cu->MemGetAllocationGranularity(
          &g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
      g == 0)
    abort();
  return g;
}

/* Checks through the driver that [p, p + n) holds only byte b. */
static int holds(const td__cu *cu, CUdeviceptr p, size_t n, unsigned char b) {
  unsigned char buf[4096];
  for (size_t off = 0; off < n; off += sizeof buf) {
    size_t k = n - off < sizeof buf ? n - off : sizeof buf;
    if (cu->MemcpyDtoH(buf, p + off, k) != CUDA_SUCCESS)
      return 0;
    for (size_t i = 0; i < k; i++)
      if (buf[i] != b)
        return 0;
  }
  return 1;
}

/* Creates 2 granules of byte b on device 0, mapped read-write here. */
static CUdeviceptr create_filled(const td__cu *cu, size_t size, unsigned char b,
                                 CUmemGenericAllocationHandle *h) {
  CUmemAllocationProp p = prop_for(0, 1);
  CU_OK(cu->MemCreate(h, size, &p, 0));
  CUdeviceptr v =
      map_handle(cu, *h, size, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  cr_assert_neq(v, 0);
  CU_OK(cu->MemsetD8(v, b, size));
  CU_OK(cu->CtxSynchronize());
  return v;
}

static int export_fd(const td__cu *cu, CUmemGenericAllocationHandle h) {
  int fd = -1;
  CU_OK(cu->MemExportToShareableHandle(
      &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  cr_assert_geq(fd, 0);
  return fd;
}

static CUdeviceptr child_import(const td__cu *cu, int sock, size_t size,
                                CUmemAccess_flags flags,
                                CUmemGenericAllocationHandle *h) {
  int fd = recv_fd(sock);
  CHILD_CHECK(fd >= 0);
  CHILD_OK(cu->MemImportFromShareableHandle(
      h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  CUdeviceptr v = map_handle(cu, *h, size, 0, flags);
  CHILD_CHECK(v != 0);
  return v;
}

static void expect_child_ok(pid_t pid) {
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: status %#x", st);
}

/* ---- writes seen both ways ---- */

static void rw_child(int sock) {
  const td__cu *cu = child_load();
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v =
      child_import(cu, sock, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, &h);
  CHILD_CHECK(holds(cu, v, size, 0xa5));
  CHILD_OK(cu->MemsetD8(v + size / 2, 0x5a, size / 2));
  CHILD_OK(cu->CtxSynchronize());
  send_byte(sock, 'w');
  CHILD_CHECK(recv_byte(sock) == 'p');
  unsigned char b[2];
  CHILD_OK(cu->MemcpyDtoH(b, v, 2));
  CHILD_CHECK(b[0] == 0x3c && b[1] == 0xa5);
  CHILD_OK(unmap(cu, v, size));
  CHILD_OK(cu->MemRelease(h));
}

Test(fidelity, two_processes_see_each_others_writes) {
  int sv[2];
  pid_t pid = fork_child(sv, rw_child);
  const td__cu *cu = parent_load(sv[0], pid);
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 0xa5, &h);
  int fd = export_fd(cu, h);
  cr_assert_eq(send_fd(sv[0], fd), 0);
  close(fd);
  cr_assert_eq(recv_byte(sv[0]), 'w');
  cr_expect(holds(cu, v + size / 2, size / 2, 0x5a), "the child's write");
  cr_expect(holds(cu, v, size / 2, 0xa5));
  CU_OK(cu->MemsetD8(v, 0x3c, 1));
  CU_OK(cu->CtxSynchronize());
  send_byte(sv[0], 'p');
  expect_child_ok(pid);
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
  close(sv[0]);
}

/* ---- read-only mappings ---- */

static void ro_child(int sock) {
  const struct rlimit no_core = {0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  const td__cu *cu = child_load();
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v =
      child_import(cu, sock, size, CU_MEM_ACCESS_FLAGS_PROT_READ, &h);
  CHILD_CHECK(holds(cu, v, size, 0xa5));
  unsigned char x = 0x77;
  CUresult r = cu->MemcpyHtoD(v, &x, 1);
  if (r == CUDA_SUCCESS)
    r = cu->CtxSynchronize();
  fprintf(stderr, "fidelity: a copy into a read-only mapping: %d\n", (int)r);
  CHILD_CHECK(r != CUDA_SUCCESS);
  send_byte(sock, 'r');
  /* A failed copy may leave the context unusable (the driver's errors can be
   * sticky): leave without cleaning up, the process's end does it. */
}

Test(fidelity, read_only_mapping_refuses_stores) {
  int sv[2];
  pid_t pid = fork_child(sv, ro_child);
  const td__cu *cu = parent_load(sv[0], pid);
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 0xa5, &h);
  int fd = export_fd(cu, h);
  cr_assert_eq(send_fd(sv[0], fd), 0);
  close(fd);
  cr_expect_eq(recv_byte(sv[0]), 'r', "the child's copy was refused");
  expect_child_ok(pid);
  cr_expect(holds(cu, v, size, 0xa5), "nothing written");
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
  close(sv[0]);
}

/* ---- a consumer outlives the creator ---- */

static void late_child(int sock) {
  const td__cu *cu = child_load();
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v =
      child_import(cu, sock, size, CU_MEM_ACCESS_FLAGS_PROT_READ, &h);
  CHILD_CHECK(holds(cu, v, size, 0x42));
  CHILD_OK(unmap(cu, v, size));
  CHILD_OK(cu->MemRelease(h));
}

Test(fidelity, exported_fd_keeps_memory_after_the_creator_lets_go) {
  int sv[2];
  pid_t pid = fork_child(sv, late_child);
  const td__cu *cu = parent_load(sv[0], pid);
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 0x42, &h);
  int fd = export_fd(cu, h);
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
  cr_assert_eq(send_fd(sv[0], fd), 0);
  close(fd);
  expect_child_ok(pid);
  close(sv[0]);
}

/* ---- granularity, capacity accounting, contexts ---- */

static const td__cu *load_or_skip(void) {
  char msg[512] = "";
  const td__cu *cu = load(msg, sizeof msg);
  if (cu == NULL)
    cr_skip_test("no CUDA device to test against: %s", msg);
  return cu;
}

Test(fidelity, sizes_off_the_granularity_are_invalid_value) {
  const td__cu *cu = load_or_skip();
  enter(cu, 0);
  size_t g = granularity(cu, 0);
  CUmemAllocationProp p = prop_for(0, 1);
  CUmemGenericAllocationHandle h;
  cr_expect_eq(cu->MemCreate(&h, g / 2, &p, 0), CUDA_ERROR_INVALID_VALUE);
  cr_expect_eq(cu->MemCreate(&h, g + g / 2, &p, 0), CUDA_ERROR_INVALID_VALUE);
}

Test(fidelity, release_gives_the_memory_back) {
  const td__cu *cu = load_or_skip();
  size_t free0, free1, free2, total;
  cr_expect_eq(cu->MemGetInfo(&free0, &total), CUDA_ERROR_INVALID_CONTEXT,
               "cuMemGetInfo needs a context");
  enter(cu, 0);
  size_t size = 16 * granularity(cu, 0);
  CU_OK(cu->MemGetInfo(&free0, &total));
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 1, &h);
  CU_OK(cu->MemGetInfo(&free1, &total));
  cr_expect_leq(free1 + size, free0, "free %zu before, %zu after %zu bytes",
                free0, free1, size);
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
  CU_OK(cu->MemGetInfo(&free2, &total));
  cr_expect_geq(free2, free1 + size, "free %zu, then %zu after release", free1,
                free2);
}

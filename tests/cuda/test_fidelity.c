/* test_fidelity.c: the driver behaviours tensord relies on, checked through
 * the driver API alone (device pointers are never dereferenced), so that one
 * file runs against the test double (test_cuda_fidelity, label cuda-double)
 * and against the real driver on a GPU (test_gpu_fidelity, label gpu;
 * skipped where no driver or no device is found). Where both pass, the
 * double imitates the driver on these points; the gpu build has not yet run
 * on a GPU (see tests/cuda/README.md). Each test forks before any driver
 * call, since the driver does not survive fork() (the last test checks
 * exactly that). */
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

/* ---- 2D copies (td_copy of views made of rows) ---- */

/* One 2D copy's description: rows of width bytes, each pitch apart. */
static CUDA_MEMCPY2D rows2d(size_t width, size_t height) {
  CUDA_MEMCPY2D c;
  memset(&c, 0, sizeof c);
  c.WidthInBytes = width;
  c.Height = height;
  return c;
}

Test(fidelity, memcpy2d_moves_rows_by_their_pitches) {
  const td__cu *cu = load_or_skip();
  enter(cu, 0);
  size_t size = granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 0, &h);
  unsigned char host[64], back[64];
  for (int i = 0; i < 64; i++)
    host[i] = (unsigned char)(i + 1);
  /* 3 rows of 5 bytes, 8 apart on the host, 16 apart on the device at
   * byte 3 of its row 1 (through X and Y). */
  CUDA_MEMCPY2D c = rows2d(5, 3);
  c.srcMemoryType = CU_MEMORYTYPE_HOST;
  c.srcHost = host;
  c.srcPitch = 8;
  c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  c.dstDevice = v;
  c.dstXInBytes = 3;
  c.dstY = 1;
  c.dstPitch = 16;
  CU_OK(cu->Memcpy2D(&c));
  CU_OK(cu->MemcpyDtoH(back, v, 64));
  for (int i = 0; i < 64; i++) {
    int row = i / 16 - 1, col = i % 16 - 3;
    unsigned char want =
        row >= 0 && row < 3 && col >= 0 && col < 5 ? host[row * 8 + col] : 0;
    cr_expect_eq(back[i], want, "device byte %d is %d, not %d", i, back[i],
                 want);
  }
  /* Device to device (rows 1..3, packed at 64: clear of the source rows, as
   * overlapping spans are undefined for the driver) and back to the host. */
  CUDA_MEMCPY2D dd = rows2d(5, 3);
  dd.srcMemoryType = dd.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  dd.srcDevice = v + 19;
  dd.srcPitch = 16;
  dd.dstDevice = v + 64;
  dd.dstPitch = 5;
  CU_OK(cu->Memcpy2D(&dd));
  CUDA_MEMCPY2D dh = rows2d(15, 1);
  dh.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  dh.srcDevice = v + 64;
  dh.srcPitch = 15;
  dh.dstMemoryType = CU_MEMORYTYPE_HOST;
  dh.dstHost = back;
  dh.dstPitch = 15;
  CU_OK(cu->Memcpy2D(&dh));
  for (int i = 0; i < 15; i++)
    cr_expect_eq(back[i], host[(i / 5) * 8 + i % 5], "byte %d is %d", i,
                 back[i]);
  /* A pitch under the width, with more than one row, is refused. */
  c.srcPitch = 4;
  cr_expect_neq(cu->Memcpy2D(&c), CUDA_SUCCESS);
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
}
/* ---- the legacy path: cuMemAlloc and IPC handles ---- */

static void ipc_child(int sock) {
  const td__cu *cu = child_load();
  enter(cu, 0);
  CUipcMemHandle h;
  CHILD_CHECK(read(sock, &h, sizeof h) == (ssize_t)sizeof h);
  size_t size = 2 * granularity(cu, 0);
  CUdeviceptr v;
  CHILD_OK(cu->IpcOpenMemHandle(&v, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CHILD_CHECK(holds(cu, v, size, 0xa5));
  CHILD_OK(cu->MemsetD8(v + size / 2, 0x5a, size / 2));
  CHILD_OK(cu->CtxSynchronize());
  CHILD_OK(cu->IpcCloseMemHandle(v));
  send_byte(sock, 'w');
}

Test(fidelity, legacy_ipc_handles_see_each_others_writes) {
  int sv[2];
  pid_t pid = fork_child(sv, ipc_child);
  const td__cu *cu = parent_load(sv[0], pid);
  enter(cu, 0);
  size_t size = 2 * granularity(cu, 0);
  CUdeviceptr v;
  CU_OK(cu->MemAlloc(&v, size));
  CU_OK(cu->MemsetD8(v, 0xa5, size));
  CU_OK(cu->CtxSynchronize());
  CUipcMemHandle h;
  CU_OK(cu->IpcGetMemHandle(&h, v));
  CUdeviceptr own;
  CUresult r =
      cu->IpcOpenMemHandle(&own, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  cr_expect_neq(r, CUDA_SUCCESS, "a process opened its own legacy handle");
  printf("fidelity: opening one's own legacy IPC handle: %d\n", (int)r);
  cr_assert_eq(write(sv[0], &h, sizeof h), (ssize_t)sizeof h);
  cr_assert_eq(recv_byte(sv[0]), 'w');
  expect_child_ok(pid);
  cr_expect(holds(cu, v + size / 2, size / 2, 0x5a), "the child's write");
  CU_OK(cu->MemFree(v));
  close(sv[0]);
}

/* ---- interprocess events ---- */

static void event_child(int sock) {
  const td__cu *cu = child_load();
  enter(cu, 0);
  CUipcEventHandle h;
  CHILD_CHECK(read(sock, &h, sizeof h) == (ssize_t)sizeof h);
  CUevent ev;
  CHILD_OK(cu->IpcOpenEventHandle(&ev, h));
  CHILD_OK(cu->StreamWaitEvent(CU_STREAM_LEGACY, ev, 0));
  CHILD_OK(cu->EventSynchronize(ev));
  CHILD_OK(cu->EventDestroy(ev));
  send_byte(sock, 'w');
}

Test(fidelity, interprocess_events_open_in_another_process) {
  int sv[2];
  pid_t pid = fork_child(sv, event_child);
  const td__cu *cu = parent_load(sv[0], pid);
  enter(cu, 0);
  CUevent ev;
  cr_expect_neq(cu->EventCreate(&ev, CU_EVENT_INTERPROCESS), CUDA_SUCCESS,
                "an interprocess event that times");
  CU_OK(cu->EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CU_OK(cu->EventRecord(ev, NULL));
  CUipcEventHandle h;
  CU_OK(cu->IpcGetEventHandle(&h, ev));
  cr_assert_eq(write(sv[0], &h, sizeof h), (ssize_t)sizeof h);
  cr_assert_eq(recv_byte(sv[0]), 'w');
  expect_child_ok(pid);
  CU_OK(cu->EventDestroy(ev));
  close(sv[0]);
}

/* ---- staged loads (td_model_load to a GPU) ---- */

/* Pinned memory, a non-blocking stream per slot, asynchronous copies that
 * land once their stream is synchronised, the slot then reused: what the
 * model loader's staging does. */
Test(fidelity, async_copies_from_pinned_slots_land_after_the_sync) {
  const td__cu *cu = load_or_skip();
  enter(cu, 0);
  size_t size = granularity(cu, 0), slot = size / 4;
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 0, &h);
  unsigned char *pin = NULL;
  CU_OK(cu->MemHostAlloc((void **)&pin, 2 * slot, 0));
  CUstream s[2];
  CU_OK(cu->StreamCreate(&s[0], CU_STREAM_NON_BLOCKING));
  CU_OK(cu->StreamCreate(&s[1], CU_STREAM_NON_BLOCKING));
  /* Four pieces through two slots, each slot synchronised before reuse. */
  for (size_t k = 0; k < 4; k++) {
    size_t i = k % 2;
    if (k >= 2)
      CU_OK(cu->StreamSynchronize(s[i]));
    memset(pin + i * slot, (int)(0x40 + k), slot);
    CU_OK(cu->MemcpyHtoDAsync(v + k * slot, pin + i * slot, slot, s[i]));
  }
  CU_OK(cu->StreamSynchronize(s[0]));
  CU_OK(cu->StreamSynchronize(s[1]));
  for (size_t k = 0; k < 4; k++)
    cr_expect(holds(cu, v + k * slot, slot, (unsigned char)(0x40 + k)),
              "piece %zu", k);
  CU_OK(cu->StreamDestroy(s[0]));
  CU_OK(cu->StreamDestroy(s[1]));
  CU_OK(cu->MemFreeHost(pin));
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
}

/* ---- stream capture ---- */

/* What libtensord does while a server's thread captures a CUDA graph in
 * GLOBAL mode on a blocking stream: a memset and copies both ways from
 * pageable memory on a non-blocking stream of its own, synchronised alone,
 * all allowed, and the capture intact; and what it must not do:
 * cuCtxSynchronize is refused and invalidates the capture. The codes the
 * driver gives are printed (the double's are a reading of the driver's
 * documentation, to be checked on a GPU). */
Test(fidelity, a_private_stream_works_during_another_threads_global_capture) {
  const td__cu *cu = load_or_skip();
  enter(cu, 0);
  size_t size = granularity(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = create_filled(cu, size, 0, &h);
#ifdef FIDELITY_DRIVER
  const char *lib = FIDELITY_DRIVER;
#else
  const char *lib = TD__CU_DRIVER_LIB;
#endif
  capturer k;
  pthread_t t;
  capture_start(&k, cu, lib, 0, CU_STREAM_CAPTURE_MODE_GLOBAL, &t);
  CUstream own;
  unsigned char src[256], back[256];
  memset(src, 0x5a, sizeof src);
  memset(back, 0, sizeof back);
  CUresult r[5];
  r[0] = cu->StreamCreate(&own, CU_STREAM_NON_BLOCKING);
  r[1] = cu->MemsetD8Async(v, 0x11, size, own);
  r[2] = cu->MemcpyHtoDAsync(v + 4096, src, sizeof src, own);
  r[3] = cu->MemcpyDtoHAsync(back, v + 4096 - 128, sizeof back, own);
  r[4] = cu->StreamSynchronize(own);
  CUresult ended = capture_end(&k, t);
  fprintf(stderr,
          "fidelity: during a GLOBAL capture elsewhere: cuStreamCreate %d, "
          "cuMemsetD8Async %d, cuMemcpyHtoDAsync %d, cuMemcpyDtoHAsync %d, "
          "cuStreamSynchronize %d; cuStreamEndCapture %d\n",
          r[0], r[1], r[2], r[3], r[4], ended);
  for (int i = 0; i < 5; i++)
    cr_expect_eq(r[i], CUDA_SUCCESS, "call %d during the capture: %d", i, r[i]);
  cr_expect_eq(ended, CUDA_SUCCESS, "the capture was invalidated");
  cr_expect(back[0] == 0x11 && back[127] == 0x11 && back[128] == 0x5a &&
                back[255] == 0x5a,
            "the stream's work, in order: %#x %#x", back[0], back[255]);
  if (r[0] == CUDA_SUCCESS)
    CU_OK(cu->StreamDestroy(own));

  capture_start(&k, cu, lib, 0, CU_STREAM_CAPTURE_MODE_GLOBAL, &t);
  CUresult sync = cu->CtxSynchronize();
  ended = capture_end(&k, t);
  fprintf(stderr,
          "fidelity: cuCtxSynchronize during a GLOBAL capture elsewhere: %d; "
          "cuStreamEndCapture %d\n",
          sync, ended);
  cr_expect_eq(sync, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  cr_expect_eq(ended, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CU_OK(unmap(cu, v, size));
  CU_OK(cu->MemRelease(h));
}

/* ---- fork after cuInit ---- */

/* The child of a process that initialised the driver: the driver allows
 * it nothing, cuInit included (the double's rule, tests/cuda/README.md;
 * libtensord's TD_EFORKED relies on it). */
static void forked_child(int sock) {
  const td__cu *cu = load(NULL, 0); /* the parent's table, inherited */
  CHILD_CHECK(cu != NULL);
  CHILD_CHECK(cu->Init(0) == CUDA_ERROR_NOT_INITIALIZED);
  int n = -1;
  CHILD_CHECK(cu->DeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED);
  CUcontext ctx;
  CHILD_CHECK(cu->DevicePrimaryCtxRetain(&ctx, 0) ==
              CUDA_ERROR_NOT_INITIALIZED);
  send_byte(sock, 'n');
}

Test(fidelity, a_child_forked_after_cuinit_is_not_initialized) {
  char msg[512] = "";
  const td__cu *cu = load(msg, sizeof msg);
  if (cu == NULL)
    cr_skip_test("no CUDA device to test against: %s", msg);
  enter(cu, 0);
  int sv[2];
  pid_t pid = fork_child(sv, forked_child);
  cr_expect_eq(recv_byte(sv[0]), 'n');
  expect_child_ok(pid);
  /* The parent's driver is unaffected. */
  int n = 0;
  CU_OK(cu->DeviceGetCount(&n));
  close(sv[0]);
}

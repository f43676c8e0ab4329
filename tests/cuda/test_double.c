/* test_double.c: the driver's test double keeps the driver's semantics where
 * tensord depends on them: an exported allocation is an fd another process
 * imports and maps (writes seen both ways), read-only access faults,
 * granularity and capacity are enforced, memory goes with its last handle or
 * mapping, calls without a context fail as the driver's do. The double is
 * not the driver (README.md): these tests are what makes it a fair stand-in
 * for the protocol and bookkeeping tests that use it. */
#include "cutest.h"
#include "kcopy.h"

#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static const td__cu *load(void) {
  setenv(TD__CU_DRIVER_ENV, TDCUDA_DOUBLE, 1);
  char msg[512] = "";
  const td__cu *cu = td__cu_load(msg, sizeof msg);
  if (cu == NULL) {
    fprintf(stderr, "td__cu_load: %s\n", msg);
    abort();
  }
  return cu;
}

/* 2 MiB on device dev (its context current), mapped read-write there;
 * its handle in *h. */
static CUdeviceptr alloc_on(const td__cu *cu, int dev,
                            CUmemGenericAllocationHandle *h) {
  CUmemAllocationProp p = prop_for(dev, 1);
  CU_OK(cu->MemCreate(h, 2 * MiB, &p, 0));
  CUdeviceptr d =
      map_handle(cu, *h, 2 * MiB, dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  cr_assert_neq(d, 0);
  return d;
}

/* Sets the 2 MiB mapping at d (of device own, read-write there) to let
 * device peer in with flags. */
static void let_in(const td__cu *cu, CUdeviceptr d, int own, int peer,
                   CUmemAccess_flags flags) {
  CUmemAccessDesc a[2];
  memset(a, 0, sizeof a);
  a[0].location.type = a[1].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a[0].location.id = own;
  a[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  a[1].location.id = peer;
  a[1].flags = flags;
  CU_OK(cu->MemSetAccess(d, 2 * MiB, a, 2));
}

/* ---- granularity ---- */

Test(double_semantics, granularity_reported_and_enforced) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 1);
  size_t g = 0;
  CU_OK(cu->MemGetAllocationGranularity(&g, &p,
                                        CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  cr_expect_eq(g, 2 * MiB);
  CU_OK(cu->MemGetAllocationGranularity(&g, &p,
                                        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  cr_expect_eq(g, 2 * MiB);

  CUmemGenericAllocationHandle h;
  cr_expect_eq(cu->MemCreate(&h, 1 * MiB, &p, 0), CUDA_ERROR_INVALID_VALUE);
  cr_expect_eq(cu->MemCreate(&h, 3 * MiB, &p, 0), CUDA_ERROR_INVALID_VALUE);
  cr_expect_eq(cu->MemCreate(&h, 0, &p, 0), CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr v;
  cr_expect_eq(cu->MemAddressReserve(&v, 1 * MiB, 0, 0, 0),
               CUDA_ERROR_INVALID_VALUE);

  CU_OK(cu->MemCreate(&h, 4 * MiB, &p, 0));
  /* An alignment of 0 promises nothing, and the double gives a range off
   * the granularity: mapping into it fails, as it may on a GPU. */
  CU_OK(cu->MemAddressReserve(&v, 8 * MiB, 0, 0, 0));
  cr_expect_neq(v % (2 * MiB), 0,
                "alignment 0 gave a granularity-aligned range");
  cr_expect_eq(cu->MemMap(v, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
  CU_OK(cu->MemAddressFree(v, 8 * MiB));
  CU_OK(cu->MemAddressReserve(&v, 8 * MiB, 2 * MiB, 0, 0));
  cr_expect_eq(v % (2 * MiB), 0, "reservations are granularity-aligned");
  cr_expect_eq(cu->MemMap(v, 1 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
  cr_expect_eq(cu->MemMap(v + 4096, 2 * MiB, 0, h, 0),
               CUDA_ERROR_INVALID_VALUE);
  cr_expect_eq(cu->MemMap(v, 6 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE,
               "larger than the allocation");
  cr_expect_eq(cu->MemMap(v + 8 * MiB, 2 * MiB, 0, h, 0),
               CUDA_ERROR_INVALID_VALUE, "outside the reservation");
  CU_OK(cu->MemMap(v, 4 * MiB, 0, h, 0));
  cr_expect_eq(cu->MemMap(v + 2 * MiB, 2 * MiB, 0, h, 0),
               CUDA_ERROR_ALREADY_MAPPED);
  cr_expect_eq(cu->MemUnmap(v, 2 * MiB), CUDA_ERROR_INVALID_VALUE,
               "half of a mapping");
  cr_expect_eq(cu->MemAddressFree(v, 8 * MiB), CUDA_ERROR_INVALID_VALUE,
               "still mapped");
  CU_OK(cu->MemUnmap(v, 4 * MiB));
  CU_OK(cu->MemAddressFree(v, 8 * MiB));
  CU_OK(cu->MemRelease(h));
  cr_expect_eq(cu->MemRelease(h), CUDA_ERROR_INVALID_VALUE, "released twice");
}

/* ---- capacity and release ---- */

Test(double_semantics, capacity_is_out_of_memory_and_release_frees) {
  setenv("TDCUDA_MEM", "8M", 1);
  const td__cu *cu = load();
  int fds = count_fds();
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 1);
  size_t free_, total;
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(total, 8 * MiB);
  cr_expect_eq(free_, 8 * MiB);

  CUmemGenericAllocationHandle a, b, c;
  CU_OK(cu->MemCreate(&a, 4 * MiB, &p, 0));
  CU_OK(cu->MemCreate(&b, 4 * MiB, &p, 0));
  cr_expect_eq(cu->MemCreate(&c, 2 * MiB, &p, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, 0);

  /* Each device has its own memory. */
  CUmemAllocationProp p1 = prop_for(1, 1);
  CU_OK(cu->MemCreate(&c, 8 * MiB, &p1, 0));
  enter(cu, 1);
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, 0);
  CU_OK(cu->MemRelease(c));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, 8 * MiB);
  CUcontext popped;
  CU_OK(cu->CtxPopCurrent(&popped));

  CU_OK(cu->MemRelease(a));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, 4 * MiB);
  CU_OK(cu->MemCreate(&c, 2 * MiB, &p, 0));
  CU_OK(cu->MemRelease(b));
  CU_OK(cu->MemRelease(c));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, 8 * MiB);
  cr_expect_eq(count_fds(), fds, "every memfd closed");
}

Test(double_semantics,
     memory_lives_while_mapped_and_the_fd_outlives_the_creator) {
  const td__cu *cu = load();
  int fds = count_fds();
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 1);
  size_t free0, free_, total;
  CU_OK(cu->MemGetInfo(&free0, &total));

  CUmemGenericAllocationHandle h;
  CU_OK(cu->MemCreate(&h, 2 * MiB, &p, 0));
  CUdeviceptr v =
      map_handle(cu, h, 2 * MiB, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  cr_assert_neq(v, 0);
  CU_OK(cu->MemsetD8(v, 0xa5, 2 * MiB));
  CU_OK(cu->StreamSynchronize(NULL)); /* a memset is asynchronous */
  int fd = -1;
  CU_OK(cu->MemExportToShareableHandle(
      &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  cr_assert_geq(fd, 0);

  /* Released but mapped: the memory stays, and stays counted. */
  CU_OK(cu->MemRelease(h));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, free0 - 2 * MiB);
  CU_OK(unmap(cu, v, 2 * MiB));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, free0, "the last mapping went: freed");

  /* The exported fd still holds the bytes, as a consumer outliving the
   * creator does. */
  CUmemGenericAllocationHandle h2;
  CU_OK(cu->MemImportFromShareableHandle(
      &h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  v = map_handle(cu, h2, 2 * MiB, 0, CU_MEM_ACCESS_FLAGS_PROT_READ);
  cr_assert_neq(v, 0);
  unsigned char buf[64];
  CU_OK(cu->MemcpyDtoH(buf, v + 2 * MiB - sizeof buf, sizeof buf));
  for (size_t i = 0; i < sizeof buf; i++)
    cr_assert_eq(buf[i], 0xa5);
  cr_expect_eq(cu->MemcpyHtoD(v, buf, 1), CUDA_ERROR_INVALID_VALUE,
               "a read-only mapping refuses a copy into it");
  cr_expect_eq(cu->MemsetD8(v, 0, 1), CUDA_ERROR_INVALID_VALUE);
  CU_OK(unmap(cu, v, 2 * MiB));
  CU_OK(cu->MemRelease(h2));
  cr_expect_eq(count_fds(), fds, "every memfd closed");
}

/* ---- contexts ---- */

Test(double_semantics, calls_without_a_context_are_invalid_context) {
  const td__cu *cu = load();
  CUmemAllocationProp p = prop_for(0, 1);
  size_t free_, total;
  CUmemGenericAllocationHandle h;
  CUdeviceptr v;
  CUcontext ctx;
  cr_expect_eq(cu->MemGetInfo(&free_, &total), CUDA_ERROR_INVALID_CONTEXT);
  cr_expect_eq(cu->MemCreate(&h, 2 * MiB, &p, 0), CUDA_ERROR_INVALID_CONTEXT);
  cr_expect_eq(cu->MemAddressReserve(&v, 2 * MiB, 0, 0, 0),
               CUDA_ERROR_INVALID_CONTEXT);
  cr_expect_eq(cu->CtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
  cr_expect_eq(cu->CtxPopCurrent(&ctx), CUDA_ERROR_INVALID_CONTEXT);

  /* Pushed, then popped: none again. */
  ctx = enter(cu, 0);
  CU_OK(cu->MemGetInfo(&free_, &total));
  CUcontext popped = NULL;
  CU_OK(cu->CtxPopCurrent(&popped));
  cr_expect_eq(popped, ctx);
  cr_expect_eq(cu->MemGetInfo(&free_, &total), CUDA_ERROR_INVALID_CONTEXT);

  /* Current but released: the primary context is gone. */
  CU_OK(cu->CtxPushCurrent(ctx));
  CU_OK(cu->DevicePrimaryCtxRelease(0));
  cr_expect_eq(cu->MemGetInfo(&free_, &total), CUDA_ERROR_INVALID_CONTEXT);
  cr_expect_eq(cu->DevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT,
               "released more often than retained");
  cr_expect_eq(cu->CtxPushCurrent(NULL), CUDA_ERROR_INVALID_CONTEXT);
}

/* ---- exports and imports ---- */

Test(double_semantics, exports_only_what_was_requested_imports_only_its_own) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 0);
  CUmemGenericAllocationHandle h, h2;
  CU_OK(cu->MemCreate(&h, 2 * MiB, &p, 0));
  int fd = -1;
  cr_expect_eq(cu->MemExportToShareableHandle(
                   &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               CUDA_ERROR_INVALID_VALUE, "created without POSIX fd handles");
  cr_expect_eq(fd, -1);
  CU_OK(cu->MemRelease(h));

  /* An fd that is no allocation of the driver's. */
  int pipefd[2];
  cr_assert_eq(pipe(pipefd), 0);
  cr_expect_eq(cu->MemImportFromShareableHandle(
                   &h2, (void *)(intptr_t)pipefd[0],
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               CUDA_ERROR_INVALID_VALUE);
  close(pipefd[0]);
  close(pipefd[1]);
  int other = memfd_create("not-the-driver", MFD_CLOEXEC);
  cr_assert_geq(other, 0);
  cr_assert_eq(ftruncate(other, 2 * MiB), 0);
  cr_expect_eq(cu->MemImportFromShareableHandle(
                   &h2, (void *)(intptr_t)other,
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               CUDA_ERROR_INVALID_VALUE);
  close(other);

  /* Imported in the process that made it: the same allocation. */
  p = prop_for(0, 1);
  size_t free0, free_, total;
  CU_OK(cu->MemGetInfo(&free0, &total));
  CU_OK(cu->MemCreate(&h, 2 * MiB, &p, 0));
  CU_OK(cu->MemExportToShareableHandle(
      &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CU_OK(cu->MemImportFromShareableHandle(
      &h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  cr_expect_neq(h, h2);
  CU_OK(cu->MemRelease(h));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, free0 - 2 * MiB, "the imported handle holds it");
  CU_OK(cu->MemRelease(h2));
  CU_OK(cu->MemGetInfo(&free_, &total));
  cr_expect_eq(free_, free0);
}

/* ---- two processes ---- */

#define SHARED (4 * MiB)

/* The consumer: imports the fd it is sent, sees the producer's 0xa5, writes
 * 0x5a over the second half, then checks the producer's 0x3c at offset 0. */
static void consumer_rw(int sock) {
  const td__cu *cu = load();
  enter(cu, 0);
  int fd = recv_fd(sock);
  CHILD_CHECK(fd >= 0);
  CUmemGenericAllocationHandle h;
  CHILD_OK(cu->MemImportFromShareableHandle(
      &h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  volatile unsigned char *b =
      (void *)map_handle(cu, h, SHARED, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  CHILD_CHECK(b != NULL);
  CHILD_CHECK(b[0] == 0xa5 && b[SHARED - 1] == 0xa5);
  memset((void *)(b + SHARED / 2), 0x5a, SHARED / 2);
  send_byte(sock, 'w');
  CHILD_CHECK(recv_byte(sock) == 'p');
  CHILD_CHECK(b[0] == 0x3c && b[1] == 0xa5);
  CHILD_OK(unmap(cu, (CUdeviceptr)b, SHARED));
  CHILD_OK(cu->MemRelease(h));
}

/* Creates SHARED bytes of 0xa5 on device 0, mapped here, and sends the
 * exported fd to sock. */
static CUdeviceptr produce(const td__cu *cu, int sock,
                           CUmemGenericAllocationHandle *h) {
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 1);
  CU_OK(cu->MemCreate(h, SHARED, &p, 0));
  CUdeviceptr v =
      map_handle(cu, *h, SHARED, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  cr_assert_neq(v, 0);
  CU_OK(cu->MemsetD8(v, 0xa5, SHARED));
  CU_OK(cu->StreamSynchronize(NULL)); /* before anyone reads it */
  int fd = -1;
  CU_OK(cu->MemExportToShareableHandle(
      &fd, *h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  cr_assert_eq(send_fd(sock, fd), 0);
  close(fd);
  return v;
}

Test(double_semantics, two_processes_see_each_others_writes) {
  int sv[2];
  pid_t pid = fork_child(sv, consumer_rw);
  const td__cu *cu = load();
  int fds = count_fds();
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = produce(cu, sv[0], &h);
  cr_assert_eq(recv_byte(sv[0]), 'w');
  unsigned char buf[16];
  CU_OK(cu->MemcpyDtoH(buf, v + SHARED - sizeof buf, sizeof buf));
  for (size_t i = 0; i < sizeof buf; i++)
    cr_expect_eq(buf[i], 0x5a, "the consumer's write, byte %zu", i);
  CU_OK(cu->MemsetD8(v, 0x3c, 1));
  CU_OK(cu->StreamSynchronize(NULL));
  send_byte(sv[0], 'p');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "consumer: status %#x", st);
  CU_OK(unmap(cu, v, SHARED));
  CU_OK(cu->MemRelease(h));
  cr_expect_eq(count_fds(), fds, "every memfd closed");
  close(sv[0]);
}

/* Maps the fd it is sent read-only: reads work, a copy into it is refused,
 * and a store faults. */
static void consumer_ro(int sock) {
  const struct rlimit no_core = {0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  signal(SIGSEGV, SIG_DFL);
  const td__cu *cu = load();
  enter(cu, 0);
  int fd = recv_fd(sock);
  CHILD_CHECK(fd >= 0);
  CUmemGenericAllocationHandle h;
  CHILD_OK(cu->MemImportFromShareableHandle(
      &h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  volatile unsigned char *b =
      (void *)map_handle(cu, h, SHARED, 0, CU_MEM_ACCESS_FLAGS_PROT_READ);
  CHILD_CHECK(b != NULL);
  CHILD_CHECK(b[0] == 0xa5 && b[SHARED - 1] == 0xa5);
  unsigned char x = 1;
  CHILD_CHECK(cu->MemcpyHtoD((CUdeviceptr)b, &x, 1) ==
              CUDA_ERROR_INVALID_VALUE);
  send_byte(sock, 'r');
  b[SHARED / 2] = 0x77; /* must kill this process */
  _exit(1);
}

Test(double_semantics, read_only_access_really_faults) {
  int sv[2];
  pid_t pid = fork_child(sv, consumer_ro);
  const td__cu *cu = load();
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = produce(cu, sv[0], &h);
  cr_expect_eq(recv_byte(sv[0]), 'r', "the consumer read the bytes");
  int st = wait_child(pid);
  cr_expect(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV,
            "the consumer's store: status %#x, not SIGSEGV", st);
  unsigned char got = 0;
  CU_OK(cu->MemcpyDtoH(&got, v + SHARED / 2, 1));
  cr_expect_eq(got, 0xa5, "nothing written");
  CU_OK(unmap(cu, v, SHARED));
  CU_OK(cu->MemRelease(h));
  close(sv[0]);
}

/* Sees physical device 1 only: device 0's allocation is out of its reach. */
static void consumer_hidden(int sock) {
  setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  const td__cu *cu = load();
  enter(cu, 0);
  int fd = recv_fd(sock);
  CHILD_CHECK(fd >= 0);
  CUmemGenericAllocationHandle h;
  CHILD_CHECK(
      cu->MemImportFromShareableHandle(
          &h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ==
      CUDA_ERROR_INVALID_DEVICE);
  close(fd);
  send_byte(sock, 'h');
}

Test(double_semantics, import_on_a_hidden_device_is_invalid_device) {
  int sv[2];
  pid_t pid = fork_child(sv, consumer_hidden);
  const td__cu *cu = load();
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = produce(cu, sv[0], &h);
  cr_expect_eq(recv_byte(sv[0]), 'h');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "consumer: status %#x", st);
  CU_OK(unmap(cu, v, SHARED));
  CU_OK(cu->MemRelease(h));
  close(sv[0]);
}

/* ---- a device without POSIX-fd handles (the legacy-IPC fallback's case) */

Test(double_semantics, no_posix_fd_devices_refuse_exportable_allocations) {
  setenv("TDCUDA_NO_POSIX_FD", "1", 1);
  const td__cu *cu = load();
  int v = -1;
  CU_OK(cu->DeviceGetAttribute(
      &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
  cr_expect_eq(v, 0);
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 1);
  CUmemGenericAllocationHandle h;
  cr_expect_eq(cu->MemCreate(&h, 2 * MiB, &p, 0), CUDA_ERROR_NOT_SUPPORTED);
  p = prop_for(0, 0);
  CU_OK(cu->MemCreate(&h, 2 * MiB, &p, 0));
  CU_OK(cu->MemRelease(h));
}

/* ---- legacy allocations and IPC handles ---- */

/* The consumer of a legacy handle: opens the 64 bytes it is sent, sees the
 * producer's 0xa5, writes 0x5a at the end; a second open in this process is
 * refused (stricter than the driver: README.md), a forged one too. */
static void consumer_ipc(int sock) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUipcMemHandle h;
  CHILD_CHECK(read(sock, &h, sizeof h) == (ssize_t)sizeof h);
  CUdeviceptr p, q;
  CHILD_CHECK(cu->IpcOpenMemHandle(&p, h, 0) == CUDA_ERROR_INVALID_VALUE);
  CHILD_OK(cu->IpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CHILD_CHECK(cu->IpcOpenMemHandle(&q, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) ==
              CUDA_ERROR_ALREADY_MAPPED);
  CUipcMemHandle forged = h;
  forged.reserved[20] ^= 1; /* the tag */
  CHILD_CHECK(
      cu->IpcOpenMemHandle(&q, forged, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) ==
      CUDA_ERROR_INVALID_HANDLE);
  unsigned char b[2];
  CHILD_OK(cu->MemcpyDtoH(b, p, 1));
  CHILD_CHECK(b[0] == 0xa5);
  CHILD_OK(cu->MemsetD8(p + SHARED - 1, 0x5a, 1));
  CHILD_OK(cu->StreamSynchronize(NULL));
  CHILD_CHECK(cu->MemFree(p) == CUDA_ERROR_INVALID_VALUE); /* not its own */
  CHILD_OK(cu->IpcCloseMemHandle(p));
  CHILD_CHECK(cu->IpcCloseMemHandle(p) == CUDA_ERROR_INVALID_VALUE);
  send_byte(sock, 'w');
}

Test(double_semantics, legacy_ipc_handles_open_in_another_process) {
  int sv[2];
  pid_t pid = fork_child(sv, consumer_ipc);
  const td__cu *cu = load();
  enter(cu, 0);
  int fds = count_fds();
  size_t free0, free1, total;
  CU_OK(cu->MemGetInfo(&free0, &total));
  CUdeviceptr v;
  CU_OK(cu->MemAlloc(&v, SHARED));
  CU_OK(cu->MemGetInfo(&free1, &total));
  cr_expect_eq(free1, free0 - SHARED);
  CU_OK(cu->MemsetD8(v, 0xa5, SHARED));
  CU_OK(cu->StreamSynchronize(NULL));
  CUipcMemHandle h;
  CU_OK(cu->IpcGetMemHandle(&h, v));
  cr_expect_eq(cu->IpcGetMemHandle(&h, v + 4096), CUDA_ERROR_INVALID_VALUE,
               "not the base of an allocation");
  CUdeviceptr own;
  cr_expect_eq(
      cu->IpcOpenMemHandle(&own, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
      CUDA_ERROR_INVALID_CONTEXT, "a process's own handle");
  cr_assert_eq(write(sv[0], &h, sizeof h), (ssize_t)sizeof h);
  cr_assert_eq(recv_byte(sv[0]), 'w');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "consumer: status %#x", st);
  unsigned char b;
  CU_OK(cu->MemcpyDtoH(&b, v + SHARED - 1, 1));
  cr_expect_eq(b, 0x5a, "the consumer's write");
  CU_OK(cu->MemFree(v));
  cr_expect_eq(cu->MemFree(v), CUDA_ERROR_INVALID_VALUE, "freed twice");
  CU_OK(cu->MemGetInfo(&free1, &total));
  cr_expect_eq(free1, free0, "cuMemFree gives the memory back");
  cr_expect_eq(count_fds(), fds, "the memfd closed");
  close(sv[0]);
}

/* A handle whose owner is gone names nothing. */
static void consumer_late(int sock) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUipcMemHandle h;
  CHILD_CHECK(read(sock, &h, sizeof h) == (ssize_t)sizeof h);
  CHILD_CHECK(recv_byte(sock) == 'f'); /* freed */
  CUdeviceptr p;
  CHILD_CHECK(cu->IpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) ==
              CUDA_ERROR_INVALID_HANDLE);
}

Test(double_semantics, a_freed_allocations_handle_opens_nothing) {
  int sv[2];
  pid_t pid = fork_child(sv, consumer_late);
  const td__cu *cu = load();
  enter(cu, 0);
  CUdeviceptr v;
  CU_OK(cu->MemAlloc(&v, SHARED));
  CUipcMemHandle h;
  CU_OK(cu->IpcGetMemHandle(&h, v));
  cr_assert_eq(write(sv[0], &h, sizeof h), (ssize_t)sizeof h);
  CU_OK(cu->MemFree(v));
  send_byte(sv[0], 'f');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "consumer: status %#x", st);
  close(sv[0]);
}

/* ---- events ---- */

static void consumer_event(int sock) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUipcEventHandle h;
  CHILD_CHECK(read(sock, &h, sizeof h) == (ssize_t)sizeof h);
  CUevent ev;
  CHILD_OK(cu->IpcOpenEventHandle(&ev, h));
  CHILD_OK(cu->EventSynchronize(ev));
  CHILD_OK(cu->StreamWaitEvent(CU_STREAM_LEGACY, ev, 0));
  CHILD_CHECK(cu->IpcGetEventHandle(&h, ev) == CUDA_ERROR_INVALID_VALUE);
  CHILD_OK(cu->EventDestroy(ev));
  CHILD_CHECK(cu->EventSynchronize(ev) == CUDA_ERROR_INVALID_HANDLE);
  CUipcEventHandle forged = h;
  forged.reserved[20] ^= 1; /* the tag */
  CHILD_CHECK(cu->IpcOpenEventHandle(&ev, forged) == CUDA_ERROR_INVALID_HANDLE);
  send_byte(sock, 'w');
}

Test(double_semantics, interprocess_events_open_in_another_process) {
  int sv[2];
  pid_t pid = fork_child(sv, consumer_event);
  const td__cu *cu = load();
  enter(cu, 0);
  int fds = count_fds();
  CUevent ev, plain;
  cr_expect_eq(cu->EventCreate(&ev, CU_EVENT_INTERPROCESS),
               CUDA_ERROR_INVALID_VALUE, "an interprocess event cannot time");
  CU_OK(cu->EventCreate(&plain, CU_EVENT_DISABLE_TIMING));
  CUipcEventHandle h;
  cr_expect_eq(cu->IpcGetEventHandle(&h, plain), CUDA_ERROR_INVALID_VALUE,
               "not an interprocess event");
  CU_OK(cu->EventDestroy(plain));
  CU_OK(cu->EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CU_OK(cu->EventRecord(ev, NULL));
  CU_OK(cu->IpcGetEventHandle(&h, ev));
  CUevent own;
  cr_expect_eq(cu->IpcOpenEventHandle(&own, h), CUDA_ERROR_INVALID_CONTEXT,
               "a process's own handle");
  cr_assert_eq(write(sv[0], &h, sizeof h), (ssize_t)sizeof h);
  cr_assert_eq(recv_byte(sv[0]), 'w');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "consumer: status %#x", st);
  CU_OK(cu->EventDestroy(ev));
  cr_expect_eq(count_fds(), fds, "the event's memfd closed");
  close(sv[0]);
}

/* What an importer does with the event it is sent, once its exporter says
 * 'd' (destroyed it, or exited): fork copies it to each child. */
static enum { USE_SYNC, USE_STREAM_WAIT, USE_OPEN } event_use;

/* Opens the event it is sent and waits on it (before the exporter lets go,
 * unless event_use is USE_OPEN), says 'o', and after 'd' uses it (or opens
 * it) again: undefined on a real driver, so the double aborts, its message
 * going to sock as stderr. */
static void importer_event(int sock) {
  const struct rlimit no_core = {0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  const td__cu *cu = load();
  enter(cu, 0);
  CUipcEventHandle h;
  CHILD_CHECK(read(sock, &h, sizeof h) == (ssize_t)sizeof h);
  CUevent ev = NULL;
  if (event_use != USE_OPEN) {
    CHILD_OK(cu->IpcOpenEventHandle(&ev, h));
    CHILD_OK(cu->EventSynchronize(ev));
    CHILD_OK(cu->StreamWaitEvent(CU_STREAM_LEGACY, ev, 0));
  }
  send_byte(sock, 'o');
  CHILD_CHECK(recv_byte(sock) == 'd');
  CHILD_CHECK(dup2(sock, STDERR_FILENO) == STDERR_FILENO);
  switch (event_use) {
  case USE_SYNC:
    cu->EventSynchronize(ev);
    break;
  case USE_STREAM_WAIT:
    cu->StreamWaitEvent(CU_STREAM_LEGACY, ev, 0);
    break;
  case USE_OPEN:
    cu->IpcOpenEventHandle(&ev, h);
    break;
  }
  _exit(0); /* not reached: the double aborted */
}

/* Checks that the importer on sock, told its event is gone, died of
 * SIGABRT saying call is undefined on a real driver because its exporter
 * did what (destroyed it / exited). */
static void importer_aborts(pid_t pid, int sock, const char *call,
                            const char *what) {
  send_byte(sock, 'd');
  char msg[512];
  ssize_t n = read(sock, msg, sizeof msg - 1);
  msg[n > 0 ? n : 0] = '\0';
  int st = wait_child(pid);
  cr_expect(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT,
            "%s after the exporter %s: status %#x, not SIGABRT", call, what,
            st);
  cr_expect(strstr(msg, call) != NULL &&
                strstr(msg, "undefined behaviour on a real driver") != NULL &&
                strstr(msg, what) != NULL,
            "the double's message: '%s'", msg);
  close(sock);
}

/* An event its exporter destroyed, used by a process that imported it
 * before (a wait on the host or a stream) or opened after: undefined on a
 * real driver, which may hang or read reused memory; the double aborts. */
Test(double_semantics, an_event_used_after_its_exporter_destroyed_it_aborts) {
  int sv[3][2];
  pid_t pid[3];
  for (int i = 0; i < 3; i++) {
    event_use = i == 0 ? USE_SYNC : i == 1 ? USE_STREAM_WAIT : USE_OPEN;
    pid[i] = fork_child(sv[i], importer_event);
  }
  const td__cu *cu = load();
  enter(cu, 0);
  CUevent ev;
  CU_OK(cu->EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CU_OK(cu->EventRecord(ev, NULL));
  CUipcEventHandle h;
  CU_OK(cu->IpcGetEventHandle(&h, ev));
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(write(sv[i][0], &h, sizeof h), (ssize_t)sizeof h);
    cr_assert_eq(recv_byte(sv[i][0]), 'o', "importer %d", i);
  }
  CU_OK(cu->EventDestroy(ev));
  importer_aborts(pid[0], sv[0][0], "cuEventSynchronize", "destroyed it");
  importer_aborts(pid[1], sv[1][0], "cuStreamWaitEvent", "destroyed it");
  importer_aborts(pid[2], sv[2][0], "cuIpcOpenEventHandle", "destroyed it");
}

/* Makes an interprocess event, sends its handle, and exits at 'x' without
 * destroying it: the process's end takes it. */
static void exporter_event(int sock) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUevent ev;
  CHILD_OK(
      cu->EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CHILD_OK(cu->EventRecord(ev, NULL));
  CUipcEventHandle h;
  CHILD_OK(cu->IpcGetEventHandle(&h, ev));
  CHILD_CHECK(write(sock, &h, sizeof h) == (ssize_t)sizeof h);
  CHILD_CHECK(recv_byte(sock) == 'x');
}

Test(double_semantics, an_event_whose_exporter_exited_aborts_its_users) {
  int ex[2], sv[2][2];
  pid_t pid[2];
  for (int i = 0; i < 2; i++) {
    event_use = i == 0 ? USE_SYNC : USE_OPEN;
    pid[i] = fork_child(sv[i], importer_event);
  }
  pid_t exporter = fork_child(ex, exporter_event);
  CUipcEventHandle h;
  cr_assert_eq(read(ex[0], &h, sizeof h), (ssize_t)sizeof h);
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(write(sv[i][0], &h, sizeof h), (ssize_t)sizeof h);
    cr_assert_eq(recv_byte(sv[i][0]), 'o', "importer %d", i);
  }
  send_byte(ex[0], 'x');
  int st = wait_child(exporter);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exporter: status %#x", st);
  close(ex[0]);
  importer_aborts(pid[0], sv[0][0], "cuEventSynchronize", "has exited");
  importer_aborts(pid[1], sv[1][0], "cuIpcOpenEventHandle", "has exited");
}

/* cuStreamWaitEvent takes the streams the driver does, the special handles
 * included, and no other value; TDCUDA_EVENT_LOG names each waiter. */
Test(double_semantics, stream_waits_take_only_streams_and_are_logged) {
  const td__cu *cu = load();
  enter(cu, 0);
  char log[] = "/tmp/tdcuda-event.XXXXXX";
  int lfd = mkstemp(log);
  cr_assert_geq(lfd, 0);
  close(lfd);
  setenv("TDCUDA_EVENT_LOG", log, 1);
  CUevent ev;
  CU_OK(cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CU_OK(cu->EventRecord(ev, NULL));
  CUstream s, gone;
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CU_OK(cu->StreamCreate(&gone, 0));
  CU_OK(cu->StreamDestroy(gone));
  CU_OK(cu->StreamWaitEvent(NULL, ev, 0));
  CU_OK(cu->StreamWaitEvent(CU_STREAM_LEGACY, ev, 0));
  CU_OK(cu->StreamWaitEvent(CU_STREAM_PER_THREAD, ev, 0));
  CU_OK(cu->StreamWaitEvent(s, ev, 0));
  cr_expect_eq(cu->StreamWaitEvent((CUstream)(uintptr_t)0x1234, ev, 0),
               CUDA_ERROR_INVALID_HANDLE);
  cr_expect_eq(cu->StreamWaitEvent(gone, ev, 0), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(cu->EventSynchronize(ev));
  unsetenv("TDCUDA_EVENT_LOG");
  char want[256], got[256] = "";
  snprintf(want, sizeof want,
           "wait 0x0\nwait 0x1\nwait 0x2\nwait 0x%llx\nsync\n",
           (unsigned long long)(uintptr_t)s);
  FILE *f = fopen(log, "r");
  size_t n = f != NULL ? fread(got, 1, sizeof got - 1, f) : 0;
  got[n] = '\0';
  if (f != NULL)
    fclose(f);
  unlink(log);
  cr_expect_str_eq(got, want);
  CU_OK(cu->StreamDestroy(s));
  CU_OK(cu->EventDestroy(ev));
}

/* ---- pinned memory, streams, asynchronous copies ---- */

/* An asynchronous copy lands at its stream's synchronisation, not before,
 * so a program that reuses its staging before then is caught; it reads
 * pinned memory only, which is freed only once no queued copy reads it. */
Test(double_semantics, async_copies_land_at_the_streams_sync) {
  const td__cu *cu = load();
  enter(cu, 0);
  char log[] = "/tmp/tdcuda-hostalloc.XXXXXX";
  int lfd = mkstemp(log);
  cr_assert_geq(lfd, 0);
  close(lfd);
  setenv("TDCUDA_HOSTALLOC_LOG", log, 1);
  uint8_t *pin = NULL;
  CU_OK(cu->MemHostAlloc((void **)&pin, 8192, 0));
  unsetenv("TDCUDA_HOSTALLOC_LOG");
  FILE *f = fopen(log, "r");
  unsigned long long logged = 0;
  cr_expect(f != NULL && fscanf(f, "%llu", &logged) == 1 && logged == 8192,
            "the log says %llu", logged);
  if (f != NULL)
    fclose(f);
  unlink(log);

  CUmemGenericAllocationHandle h;
  CUdeviceptr dev = alloc_on(cu, 0, &h);
  CU_OK(cu->MemsetD8(dev, 0, 2 * MiB)); /* fresh memory holds junk */
  CU_OK(cu->StreamSynchronize(NULL));
  CUstream s;
  cr_expect_eq(cu->StreamCreate(&s, 7), CUDA_ERROR_INVALID_VALUE);
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  memset(pin, 0xab, 4096);
  CU_OK(cu->MemcpyHtoDAsync(dev, pin, 4096, s));
  uint8_t back[4096];
  CU_OK(cu->MemcpyDtoH(back, dev, 4096));
  cr_expect_eq(back[0], 0, "the copy landed before the sync");
  /* The source is read at the sync: what is there then is copied. */
  memset(pin, 0xcd, 4096);
  cr_expect_eq(cu->MemFreeHost(pin), CUDA_ERROR_INVALID_VALUE,
               "freed while a queued copy reads it");
  CU_OK(cu->StreamSynchronize(s));
  CU_OK(cu->MemcpyDtoH(back, dev, 4096));
  cr_expect_eq(back[0], 0xcd);
  cr_expect_eq(back[4095], 0xcd);
  /* A pageable source is staged at the call: changing it afterwards
   * changes nothing, but the copy still lands only at the sync. */
  static uint8_t pageable[64];
  memset(pageable, 0x5e, sizeof pageable);
  CU_OK(cu->MemcpyHtoDAsync(dev + 8192, pageable, 64, s));
  memset(pageable, 0x77, sizeof pageable);
  CU_OK(cu->MemcpyDtoH(back, dev + 8192, 64));
  cr_expect_eq(back[0], 0, "a staged copy landed before the sync");
  CU_OK(cu->StreamSynchronize(s));
  CU_OK(cu->MemcpyDtoH(back, dev + 8192, 64));
  cr_expect_eq(back[0], 0x5e, "the bytes at the call, not 0x%02x", back[0]);
  /* A destroyed stream's copies are done first, as the driver does. */
  memset(pin, 0x11, 64);
  CU_OK(cu->MemcpyHtoDAsync(dev + 4096, pin, 64, s));
  CU_OK(cu->StreamDestroy(s));
  CU_OK(cu->MemcpyDtoH(back, dev + 4096, 64));
  cr_expect_eq(back[63], 0x11);
  cr_expect_eq(cu->StreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
  /* cuCtxSynchronize drains every stream. */
  CU_OK(cu->StreamCreate(&s, 0));
  memset(pin, 0x22, 64);
  CU_OK(cu->MemcpyHtoDAsync(dev, pin, 64, s));
  CU_OK(cu->CtxSynchronize());
  CU_OK(cu->MemcpyDtoH(back, dev, 64));
  cr_expect_eq(back[0], 0x22);
  CU_OK(cu->StreamDestroy(s));
  CU_OK(cu->MemFreeHost(pin));
  cr_expect_eq(cu->MemFreeHost(pin), CUDA_ERROR_INVALID_VALUE, "freed twice");
  CU_OK(unmap(cu, dev, 2 * MiB));
  CU_OK(cu->MemRelease(h));
}

/* ---- asynchronous work, as the driver runs it ---- */

/* A memset, a copy from pageable memory to the device and a device-to-device
 * copy return before the destination holds the bytes, on any stream, the
 * legacy one included: a reader that looks before the writer synchronised
 * sees the old bytes. (The double's device pointers are host addresses:
 * reading one directly is a reader that waits for nothing.) */
Test(double_semantics, device_writes_land_only_at_a_synchronisation) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr dev = alloc_on(cu, 0, &h);
  volatile uint8_t *raw = (volatile uint8_t *)dev;
  /* A fresh allocation's bytes are junk at its ends (the driver's are
   * unspecified), so that reading memory never written is caught. */
  cr_expect(raw[0] == 0xdb && raw[2 * MiB - 1] == 0xdb && raw[4096] == 0,
            "fresh: %#x %#x", raw[0], raw[2 * MiB - 1]);
  CU_OK(cu->MemsetD8(dev, 0, 2 * MiB));
  CU_OK(cu->StreamSynchronize(NULL));

  /* The legacy stream: cuMemsetD8 is asynchronous; a cuMemcpyDtoH waits
   * for the legacy stream's work before it reads. */
  CU_OK(cu->MemsetD8(dev, 0xa5, 4096));
  cr_expect_eq(raw[0], 0, "a memset landed before any synchronisation");
  uint8_t b[64];
  CU_OK(cu->MemcpyDtoH(b, dev, 1));
  cr_expect_eq(b[0], 0xa5, "cuMemcpyDtoH read before the memset ran");
  /* From pageable memory: staged at the call, landing later. */
  uint8_t src[64];
  memset(src, 0x3c, sizeof src);
  CU_OK(cu->MemcpyHtoD(dev, src, sizeof src));
  memset(src, 0, sizeof src); /* the staged bytes are already taken */
  cr_expect_eq(raw[0], 0xa5, "a pageable copy landed at once");
  CU_OK(cu->StreamSynchronize(NULL));
  cr_expect_eq(raw[0], 0x3c);
  cr_expect_eq(raw[63], 0x3c);

  /* A non-blocking stream: the legacy stream does not wait for it. */
  CUstream nb, bl;
  CU_OK(cu->StreamCreate(&nb, CU_STREAM_NON_BLOCKING));
  CU_OK(cu->StreamCreate(&bl, 0));
  CU_OK(cu->MemsetD8Async(dev, 0x11, 64, nb));
  CU_OK(cu->MemcpyDtoH(b, dev, 1));
  cr_expect_eq(b[0], 0x3c, "the legacy stream waited for a non-blocking one");
  CU_OK(cu->StreamSynchronize(nb));
  cr_expect_eq(raw[0], 0x11);
  /* A blocking stream: the legacy stream waits for it. */
  CU_OK(cu->MemsetD8Async(dev, 0x22, 64, bl));
  cr_expect_eq(raw[0], 0x11);
  CU_OK(cu->MemcpyDtoH(b, dev, 1));
  cr_expect_eq(b[0], 0x22, "the legacy stream did not wait for a blocking one");

  /* Device to device (cuMemcpy2DAsync): lands when an event recorded after
   * it is waited for. A copy to pageable host memory returns with the
   * bytes, after the stream's earlier work. */
  CU_OK(cu->MemsetD8Async(dev + 4096, 0x44, 64, nb));
  CUDA_MEMCPY2D c;
  memset(&c, 0, sizeof c);
  c.srcMemoryType = c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  c.srcDevice = dev + 4096;
  c.dstDevice = dev + 8192;
  c.srcPitch = c.dstPitch = c.WidthInBytes = 64;
  c.Height = 1;
  CU_OK(cu->Memcpy2DAsync(&c, nb));
  CUevent ev;
  CU_OK(cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CU_OK(cu->EventRecord(ev, nb));
  cr_expect_eq(raw[8192], 0, "a device-to-device copy landed at once");
  CU_OK(cu->EventSynchronize(ev));
  cr_expect_eq(raw[8192], 0x44);
  CU_OK(cu->EventDestroy(ev));
  CU_OK(cu->MemsetD8Async(dev + 8192, 0x55, 64, nb));
  CU_OK(cu->MemcpyDtoHAsync(b, dev + 8192, 64, nb));
  cr_expect_eq(b[63], 0x55, "a copy to pageable memory returned early");

  /* cuCtxSynchronize completes every stream. */
  CU_OK(cu->MemsetD8Async(dev, 0x66, 64, nb));
  CU_OK(cu->MemsetD8Async(dev + 64, 0x77, 64, bl));
  CU_OK(cu->CtxSynchronize());
  cr_expect(raw[0] == 0x66 && raw[64] == 0x77);

  /* Work whose memory was unmapped before it ran faults: an illegal
   * address, a sticky error that leaves the whole context unusable, for
   * every stream and every call, until the context is destroyed. */
  CU_OK(cu->MemsetD8Async(dev, 0x88, 64, nb));
  CU_OK(cu->StreamDestroy(bl));
  CU_OK(unmap(cu, dev, 2 * MiB));
  cr_expect_eq(cu->StreamSynchronize(nb), CUDA_ERROR_ILLEGAL_ADDRESS);
  cr_expect_eq(cu->StreamSynchronize(nb), CUDA_ERROR_ILLEGAL_ADDRESS);
  size_t fr, tot;
  cr_expect_eq(cu->MemGetInfo(&fr, &tot), CUDA_ERROR_ILLEGAL_ADDRESS);
  cr_expect_eq(cu->MemRelease(h), CUDA_ERROR_ILLEGAL_ADDRESS);
  cr_expect_eq(cu->StreamDestroy(nb), CUDA_ERROR_ILLEGAL_ADDRESS);
  CUcontext popped;
  CU_OK(cu->CtxPopCurrent(&popped));
  CU_OK(cu->DevicePrimaryCtxRelease(0));
  /* A new context works; the old one's streams went with it. */
  enter(cu, 0);
  CU_OK(cu->MemGetInfo(&fr, &tot));
  cr_expect_eq(cu->StreamSynchronize(nb), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(cu->MemRelease(h));
}

/* A fault injected by a test (tdcudaDoubleFault, a kernel of its own
 * writing out of bounds) or the N-th piece of work run
 * (TDCUDA_FAULT_AFTER) makes the context's error sticky. */
Test(double_semantics, sticky_errors_end_the_context) {
  setenv("TDCUDA_FAULT_AFTER", "2", 1);
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr dev = alloc_on(cu, 0, &h);
  CUmemAllocationProp p = prop_for(0, 1);
  CU_OK(cu->MemsetD8(dev, 1, 64));
  CU_OK(cu->CtxSynchronize()); /* the first piece of work runs */
  CU_OK(cu->MemsetD8(dev, 2, 64));
  cr_expect_eq(cu->CtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
  cr_expect_eq(cu->MemsetD8(dev, 3, 64), CUDA_ERROR_ILLEGAL_ADDRESS);
  CUmemGenericAllocationHandle h2;
  cr_expect_eq(cu->MemCreate(&h2, 2 * MiB, &p, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
  /* Another device's context is not touched. */
  enter(cu, 1);
  CU_OK(cu->MemGetInfo(&(size_t){0}, &(size_t){0}));
  CUcontext popped;
  CU_OK(cu->CtxPopCurrent(&popped));
  CU_OK(cu->DevicePrimaryCtxRelease(1));
  CU_OK(cu->CtxPopCurrent(&popped));
  CU_OK(cu->DevicePrimaryCtxRelease(0));
  enter(cu, 0);
  CU_OK(unmap(cu, dev, 2 * MiB));
  CU_OK(cu->MemRelease(h));
  /* The test's own fault. */
  void *lib = dlopen(TDCUDA_DOUBLE, RTLD_NOW | RTLD_NOLOAD);
  cr_assert_not_null(lib);
  CUresult (*fault)(void) = (CUresult(*)(void))dlsym(lib, "tdcudaDoubleFault");
  cr_assert_not_null(fault);
  CU_OK(fault());
  cr_expect_eq(cu->MemGetInfo(&(size_t){0}, &(size_t){0}),
               CUDA_ERROR_ILLEGAL_ADDRESS);
}

/* TDCUDA_SYNC=1 turns the deferral off: every call's work is done when it
 * returns. */
Test(double_semantics, tdcuda_sync_runs_work_at_once) {
  setenv("TDCUDA_SYNC", "1", 1);
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr dev = alloc_on(cu, 0, &h);
  CU_OK(cu->MemsetD8(dev, 0xa5, 64));
  cr_expect_eq(((volatile uint8_t *)dev)[63], 0xa5);
  CU_OK(unmap(cu, dev, 2 * MiB));
  CU_OK(cu->MemRelease(h));
  unsetenv("TDCUDA_SYNC");
}

/* ---- stream capture ---- */

/* While another thread captures in GLOBAL mode on a blocking stream: the
 * legacy stream is off limits (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), so is
 * cuCtxSynchronize and cuMemAlloc (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
 * and each such call invalidates the capture; work on a non-blocking stream
 * of one's own, synchronised by cuStreamSynchronize, is fine. */
Test(double_semantics, global_capture_forbids_unsafe_calls_elsewhere) {
  const td__cu *cu = load();
  capturer k;
  pthread_t t;
  capture_start(&k, cu, TDCUDA_DOUBLE, 0, CU_STREAM_CAPTURE_MODE_GLOBAL, &t);
  CUmemGenericAllocationHandle h;
  CUdeviceptr dev = alloc_on(cu, 0, &h);
  CUstream own;
  CU_OK(cu->StreamCreate(&own, CU_STREAM_NON_BLOCKING));
  uint8_t src[64], back[64];
  memset(src, 0x5a, sizeof src);
  CU_OK(cu->MemsetD8Async(dev, 0, 4096, own));
  CU_OK(cu->MemcpyHtoDAsync(dev, src, sizeof src, own));
  CU_OK(cu->MemcpyDtoHAsync(back, dev, sizeof back, own));
  CU_OK(cu->StreamSynchronize(own));
  cr_expect_eq(back[63], 0x5a);
  CU_OK(cu->StreamDestroy(own));
  /* So far the capture is intact; now the forbidden calls. */
  cr_expect_eq(cu->MemcpyHtoD(dev, src, 1), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  cr_expect_eq(cu->MemsetD8(dev, 0, 1), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  cr_expect_eq(cu->StreamSynchronize(NULL), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  cr_expect_eq(cu->CtxSynchronize(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  CUdeviceptr a;
  cr_expect_eq(cu->MemAlloc(&a, 4096), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  cr_expect_eq(capture_end(&k, t), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  /* The capture over, all of it works again. */
  CU_OK(cu->MemcpyHtoD(dev, src, 1));
  CU_OK(cu->CtxSynchronize());
  CU_OK(unmap(cu, dev, 2 * MiB));
  CU_OK(cu->MemRelease(h));
}

/* A capture that nothing disturbed ends well; synchronous calls are unsafe
 * in GLOBAL mode even when the capturing stream is non-blocking, and
 * allowed in another thread's THREAD_LOCAL capture; a capture ends in its
 * own thread (unless RELAXED) and never on the legacy stream. */
Test(double_semantics, capture_modes_and_their_rules) {
  const td__cu *cu = load();
  capturer k;
  pthread_t t;
  capture_start(&k, cu, TDCUDA_DOUBLE, CU_STREAM_NON_BLOCKING,
                CU_STREAM_CAPTURE_MODE_GLOBAL, &t);
  CUmemAllocationProp p = prop_for(0, 1);
  CUmemGenericAllocationHandle h;
  CU_OK(cu->MemCreate(&h, 2 * MiB, &p, 0));
  CUdeviceptr dev =
      map_handle(cu, h, 2 * MiB, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  uint8_t b[8];
  cr_expect_eq(cu->MemcpyDtoH(b, dev, 8),
               CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  cr_expect_eq(cu->StreamSynchronize(k.stream),
               CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
               "a capturing stream cannot be synchronised");
  cr_expect_eq(capture_end(&k, t), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

  capture_start(&k, cu, TDCUDA_DOUBLE, CU_STREAM_NON_BLOCKING,
                CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, &t);
  CU_OK(cu->MemcpyDtoH(b, dev, 8));
  CUstream own;
  CU_OK(cu->StreamCreate(&own, CU_STREAM_NON_BLOCKING));
  CU_OK(cu->MemsetD8Async(dev, 1, 8, own));
  CU_OK(cu->StreamSynchronize(own));
  CU_OK(cu->StreamDestroy(own));
  CU_OK(capture_end(&k, t));

  /* In this thread: the legacy stream cannot capture; a GLOBAL capture
   * forbids this thread's own synchronous calls too, and ends only here. */
  begin_capture_fn begin;
  end_capture_fn end;
  void *lib = dlopen(TDCUDA_DOUBLE, RTLD_NOW | RTLD_NOLOAD);
  *(void **)&begin = dlsym(lib, "cuStreamBeginCapture_v2");
  *(void **)&end = dlsym(lib, "cuStreamEndCapture");
  dlclose(lib);
  cr_expect_eq(begin(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL),
               CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  CUstream s;
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUgraph g;
  cr_expect_eq(end(s, &g), CUDA_ERROR_ILLEGAL_STATE, "not capturing");
  CU_OK(begin(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  CU_OK(cu->MemcpyDtoH(b, dev, 8)); /* RELAXED: allowed */
  /* Work issued on a capturing stream is captured, not run. */
  CU_OK(cu->MemsetD8Async(dev, 0xee, 8, s));
  CU_OK(end(s, &g));
  CU_OK(cu->CtxSynchronize());
  cr_expect_eq(((volatile uint8_t *)dev)[0], 1, "captured work ran");
  CU_OK(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  cr_expect_eq(cu->MemsetD8(dev, 0, 8), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  cr_expect_eq(end(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CU_OK(cu->StreamDestroy(s));
  CU_OK(unmap(cu, dev, 2 * MiB));
  CU_OK(cu->MemRelease(h));
}

/* ---- device-wide memory ---- */

/* With TDCUDA_STATE_DIR, a GPU's memory is shared by every process: what
 * another process holds is not free here, and comes back when it exits. */
Test(double_semantics, memory_is_the_devices_whoever_allocates_it) {
  char dir[] = "/tmp/tdcuda-state.XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  setenv("TDCUDA_STATE_DIR", dir, 1);
  setenv("TDCUDA_MEM", "8M", 1);
  int ready[2], done[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(done), 0);
  /* Forked before either process initialises the driver. */
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    const td__cu *cu = load();
    enter(cu, 0);
    CUmemAllocationProp p = prop_for(0, 0);
    CUmemGenericAllocationHandle h;
    CHILD_CHECK(cu->MemCreate(&h, 6 * MiB, &p, 0) == CUDA_SUCCESS);
    CHILD_CHECK(write(ready[1], "x", 1) == 1);
    char c;
    CHILD_CHECK(read(done[0], &c, 1) == 1);
    _exit(0); /* without freeing: the driver frees at exit */
  }
  char c;
  cr_assert_eq(read(ready[0], &c, 1), 1);
  const td__cu *cu = load();
  enter(cu, 0);
  size_t fr, tot;
  CU_OK(cu->MemGetInfo(&fr, &tot));
  cr_expect_eq(tot, 8 * MiB);
  cr_expect_eq(fr, 2 * MiB, "free %zu: the other process's 6 MiB not seen", fr);
  CUmemAllocationProp p = prop_for(0, 0);
  CUmemGenericAllocationHandle h;
  cr_expect_eq(cu->MemCreate(&h, 4 * MiB, &p, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CUdeviceptr legacy;
  cr_expect_eq(cu->MemAlloc(&legacy, 3 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
  /* Another device is not that one. */
  enter(cu, 1);
  CU_OK(cu->MemGetInfo(&fr, &tot));
  cr_expect_eq(fr, 8 * MiB);
  CUcontext popped;
  CU_OK(cu->CtxPopCurrent(&popped));
  CU_OK(cu->DevicePrimaryCtxRelease(1));
  cr_assert_eq(write(done[1], "x", 1), 1);
  int st;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  CU_OK(cu->MemGetInfo(&fr, &tot));
  cr_expect_eq(fr, 8 * MiB, "a dead process's memory was not freed");
  CU_OK(cu->MemCreate(&h, 4 * MiB, &p, 0));
  CU_OK(cu->MemGetInfo(&fr, &tot));
  cr_expect_eq(fr, 4 * MiB);
  CU_OK(cu->MemRelease(h));
  /* Nothing of this process is left in the directory once it freed all. */
  char path[64];
  snprintf(path, sizeof path, "%s/mem.0.%d", dir, (int)getpid());
  cr_expect_neq(access(path, F_OK), 0, "%s is left", path);
  snprintf(path, sizeof path, "%s/mem.0.lock", dir);
  unlink(path);
  snprintf(path, sizeof path, "%s/mem.1.lock", dir);
  unlink(path);
  cr_expect_eq(rmdir(dir), 0, "%s: %s", dir, strerror(errno));
}

/* ---- fork ---- */

/* The child of a process that initialised the driver: every call fails
 * CUDA_ERROR_NOT_INITIALIZED, cuInit too, whatever it inherited; only the
 * error strings answer. */
static void child_after_init(int sock) {
  const td__cu *cu = load(); /* the parent's table, inherited */
  CHILD_CHECK(cu->Init(0) == CUDA_ERROR_NOT_INITIALIZED);
  int n = -1;
  CHILD_CHECK(cu->DeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED);
  CHILD_CHECK(n == -1);
  CUcontext ctx = NULL;
  CHILD_CHECK(cu->DevicePrimaryCtxRetain(&ctx, 0) ==
              CUDA_ERROR_NOT_INITIALIZED);
  size_t fr = 0, total = 0;
  CHILD_CHECK(cu->MemGetInfo(&fr, &total) == CUDA_ERROR_NOT_INITIALIZED);
  /* The parent's mapping, inherited: neither unmapped nor released here. */
  uint64_t v = 0, h = 0;
  CHILD_CHECK(read(sock, &v, sizeof v) == sizeof v);
  CHILD_CHECK(read(sock, &h, sizeof h) == sizeof h);
  CHILD_CHECK(cu->MemUnmap((CUdeviceptr)v, 2 * MiB) ==
              CUDA_ERROR_NOT_INITIALIZED);
  CHILD_CHECK(cu->MemRelease((CUmemGenericAllocationHandle)h) ==
              CUDA_ERROR_NOT_INITIALIZED);
  CHILD_CHECK(cu->StreamSynchronize(NULL) == CUDA_ERROR_NOT_INITIALIZED);
  const char *name = NULL;
  CHILD_CHECK(cu->GetErrorName(CUDA_ERROR_NOT_INITIALIZED, &name) ==
                  CUDA_SUCCESS &&
              strcmp(name, "CUDA_ERROR_NOT_INITIALIZED") == 0);
  send_byte(sock, 'n');
}

Test(double_semantics, a_child_forked_after_cuinit_may_call_nothing) {
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemGenericAllocationHandle h;
  CUdeviceptr v = alloc_on(cu, 0, &h);
  int sv[2];
  pid_t pid = fork_child(sv, child_after_init);
  uint64_t vv = v, hh = h;
  cr_assert_eq(write(sv[0], &vv, sizeof vv), (ssize_t)sizeof vv);
  cr_assert_eq(write(sv[0], &hh, sizeof hh), (ssize_t)sizeof hh);
  cr_expect_eq(recv_byte(sv[0]), 'n');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: status %#x", st);
  /* The child's refusals changed nothing here. */
  CU_OK(cu->MemsetD8(v, 0x11, 2 * MiB));
  CU_OK(unmap(cu, v, 2 * MiB));
  CU_OK(cu->MemRelease(h));
  close(sv[0]);
}

/* Forked before its parent's first cuInit, and initialising after it: a
 * process of its own, as far as the driver knows. */
static void child_before_init(int sock) {
  CHILD_CHECK(recv_byte(sock) == 'i'); /* the parent has initialised */
  const td__cu *cu = load();
  enter(cu, 0);
  CUmemAllocationProp p = prop_for(0, 0);
  CUmemGenericAllocationHandle h;
  CHILD_OK(cu->MemCreate(&h, 2 * MiB, &p, 0));
  CUdeviceptr v =
      map_handle(cu, h, 2 * MiB, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  CHILD_CHECK(v != 0);
  CHILD_OK(cu->MemsetD8(v, 0x22, 2 * MiB));
  CHILD_OK(unmap(cu, v, 2 * MiB));
  CHILD_OK(cu->MemRelease(h));
  send_byte(sock, 'k');
}

Test(double_semantics, a_child_forked_before_cuinit_is_a_process_of_its_own) {
  int sv[2];
  pid_t pid = fork_child(sv, child_before_init);
  const td__cu *cu = load();
  int n = 0;
  CU_OK(cu->DeviceGetCount(&n));
  send_byte(sv[0], 'i');
  cr_expect_eq(recv_byte(sv[0]), 'k');
  int st = wait_child(pid);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: status %#x", st);
  close(sv[0]);
}

/* ---- the copy kernel and peer copies ---- */

/* An image the double takes for a fatbin: the magic nvcc's fatbins start
 * with, and nothing else. */
static const uint32_t fake_fatbin[4] = {0xBA55ED50u, 0, 0, 0};

/* cuLaunchKernel checks its configuration at the call, copies the
 * parameters then, and the copy runs only at the stream's synchronisation;
 * memory it reaches that is not mapped fails the stream, stickily, as a
 * fault in a kernel does. */
Test(double_semantics, copy_kernel_launch_is_checked_and_runs_at_the_sync) {
  const td__cu *cu = load();
  cr_assert_not_null(cu->ModuleLoadData);
  enter(cu, 0);
  CUmodule mod;
  CUfunction fn;
  static const char not_fatbin[16] = "\x7f"
                                     "ELF";
  cr_expect_eq(cu->ModuleLoadData(&mod, not_fatbin), CUDA_ERROR_INVALID_IMAGE);
  CU_OK(cu->ModuleLoadData(&mod, fake_fatbin));
  cr_expect_eq(cu->ModuleGetFunction(&fn, mod, "td_other"),
               CUDA_ERROR_NOT_FOUND);
  CU_OK(cu->ModuleGetFunction(&fn, mod, TD_KCOPY_NAME));

  CUmemGenericAllocationHandle h;
  CUdeviceptr dev = alloc_on(cu, 0, &h);
  CU_OK(cu->MemsetD8(dev, 0, 2 * MiB));
  CU_OK(cu->StreamSynchronize(NULL));
  /* A 4 x 8 int32 source at dev, its transpose into dev + 4096. */
  int32_t *src = (int32_t *)(uintptr_t)dev;
  int32_t *dst = (int32_t *)(uintptr_t)(dev + 4096);
  for (int i = 0; i < 32; i++)
    src[i] = i + 1;
  td_kcopy k;
  memset(&k, 0, sizeof k);
  k.nd = 2;
  k.es = 4;
  k.tile = -1; /* the element walk */
  k.numel = 32;
  k.dst = dev + 4096;
  k.src = dev;
  k.size[0] = 8; /* dst rows: src columns */
  k.size[1] = 4;
  k.ds[0] = 16;
  k.ds[1] = 4;
  k.ss[0] = 4;
  k.ss[1] = 32;
  void *args[] = {&k};
  CUstream s;
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  cr_expect_eq(cu->LaunchKernel(fn, 1, 1, 1, 1025, 1, 1, 0, s, args, NULL),
               CUDA_ERROR_INVALID_VALUE, "a block of 1025 threads");
  cr_expect_eq(cu->LaunchKernel(fn, 0, 1, 1, 256, 1, 1, 0, s, args, NULL),
               CUDA_ERROR_INVALID_VALUE, "an empty grid");
  cr_expect_eq(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 0, 0, s, args, NULL),
               CUDA_ERROR_INVALID_VALUE, "an empty block");
  cr_expect_eq(
      cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 48 * 1024 + 1, s, args, NULL),
      CUDA_ERROR_INVALID_VALUE, "more than 48 KiB of shared memory");
  cr_expect_eq(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, NULL, NULL),
               CUDA_ERROR_INVALID_VALUE, "no parameters");
  cr_expect_eq(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, args),
               CUDA_ERROR_INVALID_VALUE, "extra with kernelParams");
  cr_expect_eq(cu->LaunchKernel(NULL, 1, 1, 1, 256, 1, 1, 0, s, args, NULL),
               CUDA_ERROR_INVALID_HANDLE);
  cr_expect_eq(
      cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, (k.tile = 0, args), NULL),
      CUDA_ERROR_INVALID_VALUE, "a tile dim for the element walk");
  k.tile = -1;
  CU_OK(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL));
  /* The parameters were taken at the call. */
  k.numel = 0;
  cr_expect_eq(dst[1], 0, "the kernel ran before the stream's sync");
  CU_OK(cu->StreamSynchronize(s));
  for (int r = 0; r < 8; r++)
    for (int c = 0; c < 4; c++)
      cr_expect_eq(dst[r * 4 + c], src[c * 8 + r], "element (%d, %d)", r, c);

  /* The tiled kernel: the same transpose, its tile dim the one the source
   * runs fastest along (0), blocks of its shape only. */
  CUfunction tiled;
  CU_OK(cu->ModuleGetFunction(&tiled, mod, TD_KCOPY_TILED_NAME));
  memset(dst, 0, 32 * sizeof *dst);
  k.numel = 32;
  k.tile = 0;
  cr_expect_eq(cu->LaunchKernel(tiled, 1, 1, 1, 256, 1, 1, 0, s, args, NULL),
               CUDA_ERROR_INVALID_VALUE, "the tiled kernel's block is 32 x 8");
  k.tile = 1;
  cr_expect_eq(cu->LaunchKernel(tiled, 1, 1, 1, TD_KCOPY_TILE, TD_KCOPY_ROWS, 1,
                                0, s, args, NULL),
               CUDA_ERROR_INVALID_VALUE, "the innermost dim as the tile dim");
  k.tile = 0;
  k.es = 3;
  cr_expect_eq(cu->LaunchKernel(tiled, 1, 1, 1, TD_KCOPY_TILE, TD_KCOPY_ROWS, 1,
                                0, s, args, NULL),
               CUDA_ERROR_INVALID_VALUE, "3-byte elements, tiled");
  k.es = 4;
  CU_OK(cu->LaunchKernel(tiled, 1, 1, 1, TD_KCOPY_TILE, TD_KCOPY_ROWS, 1, 0, s,
                         args, NULL));
  CU_OK(cu->StreamSynchronize(s));
  for (int r = 0; r < 8; r++)
    for (int c = 0; c < 4; c++)
      cr_expect_eq(dst[r * 4 + c], src[c * 8 + r], "tiled: element (%d, %d)", r,
                   c);
  k.tile = -1;
  /* Past the end of the mapping: launched, then the stream fails. */
  k.numel = 32;
  k.dst = dev + 2 * MiB - 64;
  CU_OK(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL));
  cr_expect_eq(cu->StreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
  cr_expect_eq(cu->StreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS,
               "a fault in a kernel is sticky");
  CUcontext popped;
  CU_OK(cu->CtxPopCurrent(&popped));
  cr_expect_eq(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL),
               CUDA_ERROR_INVALID_CONTEXT);
  cr_expect_eq(cu->ModuleLoadData(&mod, fake_fatbin),
               CUDA_ERROR_INVALID_CONTEXT);
  /* The context is unusable until it is destroyed; a new one works. */
  CU_OK(cu->CtxPushCurrent(popped));
  cr_expect_eq(cu->StreamDestroy(s), CUDA_ERROR_ILLEGAL_ADDRESS);
  CU_OK(cu->CtxPopCurrent(&popped));
  CU_OK(cu->DevicePrimaryCtxRelease(0));
  enter(cu, 0);
  CU_OK(unmap(cu, dev, 2 * MiB));
  CU_OK(cu->MemRelease(h));
}

Test(double_semantics, no_module_refuses_every_image) {
  setenv("TDCUDA_NO_MODULE", "1", 1);
  const td__cu *cu = load();
  enter(cu, 0);
  CUmodule mod;
  cr_expect_eq(cu->ModuleLoadData(&mod, fake_fatbin),
               CUDA_ERROR_NO_BINARY_FOR_GPU);
}

/* Peer copies: each pointer in its context's device's memory, queued like
 * any device-to-device copy; peer access is reported between two devices
 * unless TDCUDA_NO_PEER=1, and never changes whether the copy works. */
static void peer_copy(int no_peer) {
  if (no_peer)
    setenv("TDCUDA_NO_PEER", "1", 1);
  const td__cu *cu = load();
  int can = -1;
  CU_OK(cu->DeviceCanAccessPeer(&can, 0, 1));
  cr_expect_eq(can, !no_peer);
  CU_OK(cu->DeviceCanAccessPeer(&can, 0, 0));
  cr_expect_eq(can, 0);
  CUmemGenericAllocationHandle h1, h0;
  CUcontext c1 = enter(cu, 1);
  CUdeviceptr d1 = alloc_on(cu, 1, &h1);
  CUcontext c0 = enter(cu, 0);
  CUdeviceptr d0 = alloc_on(cu, 0, &h0);
  cr_assert(d0 != 0 && d1 != 0);
  CU_OK(cu->MemsetD8(d1, 0, 4096));
  CU_OK(cu->MemsetD8(d0, 0x5a, 4096));
  CU_OK(cu->CtxSynchronize());
  CUstream s;
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  cr_expect_eq(cu->MemcpyPeerAsync(d1, c0, d0, c1, 4096, s),
               CUDA_ERROR_INVALID_VALUE, "pointers of the other contexts");
  const uint8_t *b1 = (const uint8_t *)(uintptr_t)d1;
  if (!no_peer) {
    /* GPUs that reach each other copy by DMA into the other's memory: a
     * VMM mapping must give the peer access first (below: else the copy
     * faults). */
    let_in(cu, d0, 0, 1, CU_MEM_ACCESS_FLAGS_PROT_READ);
    let_in(cu, d1, 1, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  }
  CU_OK(cu->MemcpyPeerAsync(d1, c1, d0, c0, 4096, s));
  cr_expect_eq(b1[0], 0, "the peer copy landed before the sync");
  CU_OK(cu->StreamSynchronize(s));
  cr_expect_eq(b1[0], 0x5a);
  cr_expect_eq(b1[4095], 0x5a);
  cu->StreamDestroy(s);
  CU_OK(unmap(cu, d0, 2 * MiB));
  CU_OK(unmap(cu, d1, 2 * MiB));
  CU_OK(cu->MemRelease(h0));
  CU_OK(cu->MemRelease(h1));
}

Test(double_semantics, peer_copies_check_their_devices_and_run_at_the_sync) {
  peer_copy(0);
}

Test(double_semantics, peer_copies_work_without_peer_access) {
  peer_copy(1);
}

/* Between GPUs that reach each other, a peer copy of VMM memory that did
 * not give the other device access faults when it runs, and the fault is
 * the context's, sticky. */
Test(double_semantics, a_peer_copy_without_peer_access_faults) {
  const td__cu *cu = load();
  CUmemGenericAllocationHandle h1, h0;
  CUcontext c1 = enter(cu, 1);
  CUdeviceptr d1 = alloc_on(cu, 1, &h1);
  CUcontext c0 = enter(cu, 0);
  CUdeviceptr d0 = alloc_on(cu, 0, &h0);
  CUstream s;
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CU_OK(cu->MemcpyPeerAsync(d1, c1, d0, c0, 4096, s)); /* issued */
  cr_expect_eq(cu->StreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
  cr_expect_eq(cu->MemsetD8(d0, 1, 64), CUDA_ERROR_ILLEGAL_ADDRESS,
               "the fault is the context's");
}

/* A kernel runs on its context's device: memory of another device's VMM
 * mapping that did not let it in faults it; once cuMemSetAccess names it,
 * the kernel reads the peer's memory. */
Test(double_semantics, a_kernel_reaches_a_peers_memory_only_when_let_in) {
  const td__cu *cu = load();
  CUmemGenericAllocationHandle h0, h1;
  enter(cu, 0);
  CUdeviceptr d0 = alloc_on(cu, 0, &h0);
  memset((void *)(uintptr_t)d0, 0x6b, 4096);
  enter(cu, 1);
  CUdeviceptr d1 = alloc_on(cu, 1, &h1);
  CUmodule mod;
  CUfunction fn;
  CU_OK(cu->ModuleLoadData(&mod, fake_fatbin));
  CU_OK(cu->ModuleGetFunction(&fn, mod, TD_KCOPY_NAME));
  td_kcopy k;
  memset(&k, 0, sizeof k);
  k.nd = 1;
  k.es = 1;
  k.tile = -1;
  k.numel = 4096;
  k.dst = d1;
  k.src = d0;
  k.size[0] = 4096;
  k.ds[0] = k.ss[0] = 1;
  void *args[] = {&k};
  CUstream s;
  CU_OK(cu->StreamCreate(&s, CU_STREAM_NON_BLOCKING));
  let_in(cu, d0, 0, 1, CU_MEM_ACCESS_FLAGS_PROT_READ); /* 1 may read d0 */
  CU_OK(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL));
  CU_OK(cu->StreamSynchronize(s));
  cr_expect_eq(((uint8_t *)(uintptr_t)d1)[4095], 0x6b);
  /* Taken back: the same launch faults, and the context is done. */
  let_in(cu, d0, 0, 1, CU_MEM_ACCESS_FLAGS_PROT_NONE);
  CU_OK(cu->LaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, args, NULL));
  cr_expect_eq(cu->StreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
}

/* cutest.h: helpers the CUDA tests share: the steps libtensord takes to
 * map an exported allocation, fds over a socket between two processes, as
 * tensord sends a storage, and a thread that captures a CUDA graph. Only
 * through the driver API (cuda/driver.h, and the capture entries looked up
 * in the driver loaded), so they serve the driver and its test double
 * alike. */
#ifndef TD_CUTEST_H
#define TD_CUTEST_H

#include "driver.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB ((size_t)1 << 20)

#define CU_OK(call)                                                            \
  do {                                                                         \
    CUresult r_ = (call);                                                      \
    cr_assert_eq(r_, CUDA_SUCCESS, "%s: %d", #call, (int)r_);                  \
  } while (0)

/* In a forked child, where Criterion's asserts do not report: exits with
 * line's number, after saying what failed. */
#define CHILD_OK(call)                                                         \
  do {                                                                         \
    CUresult r_ = (call);                                                      \
    if (r_ != CUDA_SUCCESS) {                                                  \
      fprintf(stderr, "child: %s: %d\n", #call, (int)r_);                      \
      _exit(__LINE__ % 250 + 2);                                               \
    }                                                                          \
  } while (0)
#define CHILD_CHECK(cond)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "child: %s is false\n", #cond);                          \
      _exit(__LINE__ % 250 + 2);                                               \
    }                                                                          \
  } while (0)

/* Makes device dev's primary context current on this thread. */
static inline CUcontext enter(const td__cu *cu, int dev) {
  CUcontext ctx = NULL;
  if (cu->DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cu->CtxPushCurrent(ctx) != CUDA_SUCCESS)
    abort();
  return ctx;
}

static inline CUmemAllocationProp prop_for(int dev, int exportable) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                      : CU_MEM_HANDLE_TYPE_NONE;
  return p;
}

/* Reserves size bytes, maps h there and sets access flags for device dev:
 * what libtensord does to open a storage. Returns the address or 0. */
static inline CUdeviceptr map_handle(const td__cu *cu,
                                     CUmemGenericAllocationHandle h,
                                     size_t size, int dev,
                                     CUmemAccess_flags flags) {
  CUdeviceptr p = 0;
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = dev;
  a.flags = flags;
  /* size is a multiple of the granularity, a power of two: its lowest set
   * bit is an alignment cuMemMap accepts (0 promises none). */
  if (cu->MemAddressReserve(&p, size, size & -size, 0, 0) != CUDA_SUCCESS)
    return 0;
  if (cu->MemMap(p, size, 0, h, 0) != CUDA_SUCCESS ||
      cu->MemSetAccess(p, size, &a, 1) != CUDA_SUCCESS) {
    cu->MemUnmap(p, size);
    cu->MemAddressFree(p, size);
    return 0;
  }
  return p;
}

static inline CUresult unmap(const td__cu *cu, CUdeviceptr p, size_t size) {
  CUresult r = cu->MemUnmap(p, size);
  return r != CUDA_SUCCESS ? r : cu->MemAddressFree(p, size);
}

static inline int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* ---- fds over a socket, as tensord sends a storage ---- */

static inline int send_fd(int sock, int fd) {
  char byte = 'f';
  struct iovec iov = {.iov_base = &byte, .iov_len = 1};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  memset(&u, 0, sizeof u);
  struct msghdr m = {.msg_iov = &iov,
                     .msg_iovlen = 1,
                     .msg_control = u.buf,
                     .msg_controllen = sizeof u.buf};
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  return sendmsg(sock, &m, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

static inline int recv_fd(int sock) {
  char byte;
  struct iovec iov = {.iov_base = &byte, .iov_len = 1};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr m = {.msg_iov = &iov,
                     .msg_iovlen = 1,
                     .msg_control = u.buf,
                     .msg_controllen = sizeof u.buf};
  if (recvmsg(sock, &m, MSG_CMSG_CLOEXEC) != 1 || (m.msg_flags & MSG_CTRUNC))
    return -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  if (c == NULL || c->cmsg_type != SCM_RIGHTS)
    return -1;
  int fd;
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

static inline void send_byte(int sock, char b) {
  if (write(sock, &b, 1) != 1)
    _exit(90);
}

static inline char recv_byte(int sock) {
  char b = 0;
  if (read(sock, &b, 1) != 1)
    return 0;
  return b;
}

/* Forks a child that will load the driver itself, after the fork: two
 * processes, two independent loads, as tensord and a client. */
static inline pid_t fork_child(int sv[2], void (*fn)(int sock)) {
  cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    close(sv[0]);
    fn(sv[1]);
    _exit(0);
  }
  close(sv[1]);
  return pid;
}

static inline int wait_child(pid_t pid) {
  int st = 0;
  while (waitpid(pid, &st, 0) < 0)
    ;
  return st;
}

/* ---- stream capture ---- */

typedef CUresult (*begin_capture_fn)(CUstream, CUstreamCaptureMode);
typedef CUresult (*end_capture_fn)(CUstream, CUgraph *);

/* A thread that captures a graph on a stream of its own, as a server's
 * thread would: begins in mode, lets the test's thread make its calls, ends,
 * and keeps what the end returned. The capture entries are not in td__cu
 * (tensord never captures): they are looked up in the loaded driver,
 * lib_path, by their versioned names. */
typedef struct {
  const td__cu *cu;
  CUcontext ctx;
  unsigned flags; /* the capturing stream's */
  CUstreamCaptureMode mode;
  begin_capture_fn begin;
  end_capture_fn end;
  CUstream stream;
  CUresult begun, ended;
  pthread_barrier_t go, done;
} capturer;

static inline void *capture_thread(void *arg) {
  capturer *k = arg;
  k->cu->CtxPushCurrent(k->ctx);
  k->cu->StreamCreate(&k->stream, k->flags);
  k->begun = k->begin(k->stream, k->mode);
  pthread_barrier_wait(&k->go);   /* capturing */
  pthread_barrier_wait(&k->done); /* the other thread's calls made */
  CUgraph g = (CUgraph)1;
  k->ended = k->end(k->stream, &g);
  k->cu->StreamDestroy(k->stream);
  CUcontext popped;
  k->cu->CtxPopCurrent(&popped);
  return NULL;
}

static inline void capture_start(capturer *k, const td__cu *cu,
                                 const char *lib_path, unsigned flags,
                                 CUstreamCaptureMode mode, pthread_t *t) {
  void *lib = dlopen(lib_path, RTLD_NOW | RTLD_NOLOAD);
  cr_assert_not_null(lib);
  memset(k, 0, sizeof *k);
  k->cu = cu;
  k->ctx = enter(cu, 0);
  k->flags = flags;
  k->mode = mode;
  *(void **)&k->begin = dlsym(lib, "cuStreamBeginCapture_v2");
  *(void **)&k->end = dlsym(lib, "cuStreamEndCapture");
  cr_assert(k->begin != NULL && k->end != NULL);
  dlclose(lib);
  pthread_barrier_init(&k->go, NULL, 2);
  pthread_barrier_init(&k->done, NULL, 2);
  cr_assert_eq(pthread_create(t, NULL, capture_thread, k), 0);
  pthread_barrier_wait(&k->go);
  CU_OK(k->begun);
}

static inline CUresult capture_end(capturer *k, pthread_t t) {
  pthread_barrier_wait(&k->done);
  pthread_join(t, NULL);
  pthread_barrier_destroy(&k->go);
  pthread_barrier_destroy(&k->done);
  return k->ended;
}

#endif /* TD_CUTEST_H */

/* test_cuda.c: CUDA storages end to end, a real tensord and real forked
 * processes, over the TEST DOUBLE of the driver (tests/cuda/), which ctest
 * names in TENSORD_CUDA_DRIVER for this test only (label cuda-double). The
 * double's device memory is host memory (a memfd per allocation, device
 * pointers are addresses in the process), so these tests prove the
 * protocol and the bookkeeping, not that tensord works on a GPU. */
#include "harness.h"

#include <criterion/criterion.h>
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <grp.h>
#include <dlpack/dlpack.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB ((size_t)1 << 20)
#define GRAN (2 * MiB) /* the double's allocation granularity */

static tdt_daemon d;

static void setup(void) {
  if (getenv("TENSORD_CUDA_DRIVER") == NULL)
    cr_skip_test("TENSORD_CUDA_DRIVER is not set: run through ctest, which "
                 "names the driver's test double");
}

/* A test with --state-dir: its directory, and the instance whose segments
 * a restart adopted, for teardown to remove if the test fails half-way. */
static char state_dir[64];
static uint64_t first_instance;
/* The double's log of cuMemcpy2D calls, while a test uses one. */
static char memcpy2d_log[64];
/* The double's TDCUDA_STATE_DIR, while a test shares a GPU's memory. */
static char mem_dir[64];
/* The double's logs of contexts and of calls, while a test reads one
 * (their formats below). */
static char ctx_log[64];
static char call_log[64];

static void teardown(void) {
  tdt_cleanup();
  if (first_instance != 0)
    tdt_unlink_segments(first_instance);
  if (state_dir[0] != '\0')
    tdt_rmdir(state_dir);
  if (memcpy2d_log[0] != '\0') {
    unlink(memcpy2d_log);
    memcpy2d_log[0] = '\0';
  }
  if (mem_dir[0] != '\0') {
    tdt_rmdir(mem_dir);
    mem_dir[0] = '\0';
  }
  if (ctx_log[0] != '\0')
    unlink(ctx_log);
  if (call_log[0] != '\0')
    unlink(call_log);
}

TestSuite(cuda, .init = setup, .fini = teardown, .timeout = 30);

static void start_with(const char *name, const char *value);

/* The daemon's figures for its GPU with uuid. Asserts it lists it. */
static td_device_stat gpu_stat(td_client *c, const uint8_t uuid[16]) {
  td_device_stat ds[8];
  size_t n = 0;
  cr_assert_eq(td_stat_devices(c, ds, 8, &n), 0, "%s", td_last_error(c));
  for (size_t i = 0; i < n && i < 8; i++)
    if (memcmp(ds[i].uuid, uuid, 16) == 0)
      return ds[i];
  cr_assert_fail("the daemon lists no GPU with the storage's UUID (%zu GPUs)",
                 n);
  return ds[0];
}

/* The GPU whose figures gpu_freed watches. */
static uint8_t freed_uuid[16];

/* Whether the daemon's GPU with freed_uuid holds no bytes and no storage.
 * A storage leaves the registry on the daemon's loop, and its allocation is
 * freed (and uncounted) after, on the thread pool: stat may count it a
 * moment longer, so tests wait for this before they judge the figures. */
static int gpu_freed(const tdt_daemon *dd) {
  td_client *c = tdt_connect(dd);
  td_device_stat g = gpu_stat(c, freed_uuid);
  td_close(c);
  return g.bytes_used == 0 && g.storages == 0;
}

/* ---- sharing ---- */

typedef struct {
  const char *sock;
  const char *key;
  unsigned flags;
  int ready; /* write end, or -1 */
} peer_arg;

/* Looks the key up, checks the parent's pattern, writes its own. */
static int peer_rw(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  td_view v;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, a->key, 0, 0, &s, &v), 0);
  CHECK(td_storage_device(s) == TD_CUDA);
  CHECK(td_storage_device_index(s) == 0);
  unsigned char *b = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i += 4099)
    CHECK(b[i] == (unsigned char)(i * 7 + 1));
  b[0] = 0xa5;
  b[td_storage_nbytes(s) - 1] = 0x5a;
  td_storage_release(s);
  td_close(c);
  return 0;
}

/* The peer of shared_both_ways, forked held (tdt_fork_held) before this
 * process's first CUDA call: the driver allows a child forked after it
 * nothing. */
static peer_arg rw_arg;

static pid_t hold_peer_rw(void) {
  rw_arg = (peer_arg){d.sock, "w", 0, -1};
  return tdt_fork_held(peer_rw, &rw_arg, 0);
}

/* The body both handle kinds share: s (n bytes, on a GPU, held by c) reads
 * as zeros, is published as "w", the peer (hold_peer_rw) writes it and
 * this process sees the writes; then c lets go of everything (c is closed)
 * and the GPU's bytes and storages are back to none. */
static void shared_both_ways(td_client *c, td_storage *s, size_t n,
                             pid_t peer) {
  cr_assert_eq(td_storage_device(s), TD_CUDA);
  cr_assert_eq(td_storage_nbytes(s), n);
  uint8_t uuid[16];
  cr_assert_eq(td_storage_device_uuid(s, uuid), 0);
  unsigned char *b = td_storage_data(s);
  cr_assert_not_null(b);
  /* Zeroed, as a CPU storage is, unless TD_UNINIT. */
  for (size_t i = 0; i < n; i += 4099)
    cr_assert_eq(b[i], 0, "byte %zu of a fresh storage is %u", i, b[i]);
  for (size_t i = 0; i < n; i += 4099)
    b[i] = (unsigned char)(i * 7 + 1);
  cr_assert_eq(td_publish(c, "w", s, NULL), 0, "%s", td_last_error(c));
  /* The allocation is the size rounded up to the granularity. */
  td_device_stat g = gpu_stat(c, uuid);
  cr_assert_eq(g.bytes_used, 6 * MiB);
  cr_assert_eq(g.storages, 1);

  cr_assert_eq(tdt_wait(tdt_go(peer)), 0);
  cr_assert_eq(b[0], 0xa5, "the other process's write is not seen here");
  cr_assert_eq(b[n - 1], 0x5a);

  cr_assert_eq(td_unpublish(c, "w"), 0);
  td_storage_release(s);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 2000));
  cr_assert_eq(tdt_storages(&d), 0);
  memcpy(freed_uuid, uuid, 16);
  tdt_until(gpu_freed, &d, 10000);
  c = tdt_connect(&d);
  g = gpu_stat(c, uuid);
  cr_assert_eq(g.bytes_used, 0, "%llu bytes still allocated",
               (unsigned long long)g.bytes_used);
  cr_assert_eq(g.storages, 0);
  td_close(c);
}

TDT_TEST(cuda, two_processes_share_the_same_device_memory) {
  tdt_start(&d, NULL);
  pid_t peer = hold_peer_rw();
  td_client *c = tdt_connect(&d);
  td_storage *s;
  size_t n = 4 * MiB + 1;
  cr_assert_eq(tdt_create_cuda(c, 0, n, &s), 0, "%s", td_last_error(c));
  shared_both_ways(c, s, n, peer);
}

static int peer_ro_write(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, a->key, a->flags, 0, &s, NULL), 0);
  CHECK(td_storage_is_readonly(s));
  volatile unsigned char *b = td_storage_data(s);
  CHECK(b[10] == 42); /* reading works */
  signal(SIGSEGV, SIG_DFL);
  b[10] = 1; /* the double maps read-only access PROT_READ: this faults */
  return 2;
}

TDT_TEST(cuda, readonly_lookup_maps_read_only) {
  tdt_start(&d, NULL);
  /* The peers are forked before this process's first CUDA call. */
  unsigned flags[] = {TD_RDONLY, TD_COW};
  peer_arg a[2];
  pid_t peer[2];
  for (size_t i = 0; i < 2; i++) {
    a[i] = (peer_arg){d.sock, "ro", flags[i], -1};
    peer[i] = tdt_fork_held(peer_ro_write, &a[i], 0);
  }
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  ((unsigned char *)td_storage_data(s))[10] = 42;
  cr_assert_eq(td_publish(c, "ro", s, NULL), 0);
  for (size_t i = 0; i < 2; i++) {
    cr_assert_eq(tdt_wait(tdt_go(peer[i])), 128 + SIGSEGV,
                 "a write through a read-only mapping (flags 0x%x) did not "
                 "fault",
                 flags[i]);
  }
  cr_assert_eq(((unsigned char *)td_storage_data(s))[10], 42);
  td_storage_release(s);
  td_close(c);
}

/* ---- references ---- */

static int holder(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, a->key, 0, 5000, &s, NULL), 0);
  CHECK(write(a->ready, "r", 1) == 1);
  pause(); /* killed here, holding the only reference */
  return 0;
}

TDT_TEST(cuda, sigkill_of_the_last_holder_frees_the_allocation) {
  tdt_start(&d, NULL);
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  peer_arg a = {d.sock, "held", 0, pfd[1]};
  pid_t pid = tdt_fork(holder, &a);
  close(pfd[1]);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 1, 3 * MiB, &s), 0, "%s", td_last_error(c));
  uint8_t uuid[16];
  cr_assert_eq(td_storage_device_uuid(s, uuid), 0);
  cr_assert_eq(td_publish(c, "held", s, NULL), 0);
  char x;
  cr_assert_eq(read(pfd[0], &x, 1), 1, "the holder failed before pause()");
  close(pfd[0]);
  /* The creator lets go: the holder's reference keeps it. */
  cr_assert_eq(td_unpublish(c, "held"), 0);
  td_storage_release(s);
  cr_assert_eq(tdt_storages(&d), 1);
  cr_assert_eq(gpu_stat(c, uuid).bytes_used, 4 * MiB);
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  memcpy(freed_uuid, uuid, 16);
  tdt_until(gpu_freed, &d, 10000);
  td_device_stat g = gpu_stat(c, uuid);
  cr_assert_eq(g.bytes_used, 0,
               "the dead holder's allocation is still there (%llu bytes)",
               (unsigned long long)g.bytes_used);
  cr_assert_eq(g.storages, 0);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

TDT_TEST(cuda, the_creator_may_go_first) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  ((unsigned char *)td_storage_data(s))[0] = 9;
  cr_assert_eq(td_publish(c, "k", s, NULL), 0);
  td_storage_release(s);
  td_close(c); /* the creator's connection goes; the key keeps the bytes */
  c = tdt_connect(&d);
  cr_assert_eq(td_lookup(c, "k", TD_RDONLY, 0, &t, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(((unsigned char *)td_storage_data(t))[0], 9);
  td_storage_release(t);
  cr_assert_eq(td_unpublish(c, "k"), 0);
  td_close(c);
}

TDT_TEST(cuda, the_daemon_touches_the_driver_at_its_first_cuda_create) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *h, *g;
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  td_device_stat ds[4];
  size_t n = 9;
  cr_assert_eq(td_stat_devices(c, ds, 4, &n), 0);
  cr_assert_eq(n, 0, "the daemon lists %zu GPUs before any CUDA create", n);
  cr_assert(!tdt_log_has(&d, "cuda: device"),
            "the daemon loaded the driver early");
  cr_assert_eq(tdt_create_cuda(c, 1, 4096, &g), 0, "%s", td_last_error(c));
  cr_assert_eq(td_stat_devices(c, ds, 4, &n), 0);
  cr_assert_eq(n, 2, "the double has 2 GPUs; the daemon lists %zu", n);
  cr_assert(tdt_log_has(&d, "cuda: device"));
  /* A context on the GPU used, none on the other. */
  cr_assert(tdt_log_has(&d, "cuda:1: context made"));
  cr_assert(!tdt_log_has(&d, "cuda:0: context made"));
  td_storage_release(g);
  td_storage_release(h);
  td_close(c);
}

/* The double's TDCUDA_CTX_LOG: "<pid> create|destroy <device>" lines. How
 * many of what the daemon wrote for device 0. */

static int ctx_events(const char *what) {
  FILE *f = fopen(ctx_log, "r");
  if (f == NULL)
    return 0;
  int pid, dev, n = 0;
  char w[16];
  while (fscanf(f, "%d %15s %d", &pid, w, &dev) == 3)
    n += pid == d.pid && dev == 0 && strcmp(w, what) == 0;
  fclose(f);
  return n;
}

static int ctx_destroyed_once(const tdt_daemon *dd) {
  (void)dd;
  return ctx_events("destroy") == 1;
}

/* tensord holds a GPU's context only while it has storages there: an
 * inference server alone on its GPU afterwards carries no tensord context
 * (memory, and the right to the GPU in EXCLUSIVE_PROCESS mode). */
TDT_TEST(cuda, the_daemon_holds_a_context_only_while_it_has_storages) {
  snprintf(ctx_log, sizeof(ctx_log), "/tmp/tdt-ctxlog.%d", (int)getpid());
  unlink(ctx_log);
  /* Pooled allocations are device memory too: they hold it until they
   * age out (--recycle-idle). */
  setenv("TDCUDA_CTX_LOG", ctx_log, 1);
  tdt_start(&d, (const char *const[]){"--recycle-idle", "300", NULL});
  unsetenv("TDCUDA_CTX_LOG");
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &t), 0, "%s", td_last_error(c));
  cr_assert_eq(ctx_events("create"), 1, "one context for both");
  cr_assert_eq(td_publish(c, "k", s, NULL), 0);
  td_storage_release(s);
  td_storage_release(t);
  cr_assert_eq(ctx_events("destroy"), 0, "the key's storage needs it");
  cr_assert_eq(td_unpublish(c, "k"), 0);
  cr_assert(tdt_until(ctx_destroyed_once, &d, 10000),
            "the daemon kept its context with no storage on the GPU");
  /* The next create makes one again. */
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(ctx_events("create"), 2);
  td_storage_release(s);
  td_close(c);
  tdt_until(tdt_no_segments, &d, 5000);
  unlink(ctx_log);
}

/* In EXCLUSIVE_PROCESS compute mode one process at a time may have a
 * context on the GPU: memory on it cannot be shared, and a tensord that
 * took a context would lock the server out. It refuses, and takes none. */
TDT_TEST(cuda, an_exclusive_process_gpu_is_left_to_its_one_process) {
  setenv("TDCUDA_COMPUTE_MODE", "exclusive_process", 1); /* both sides */
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_EBUSY);
  cr_assert(strstr(td_last_error(c), "EXCLUSIVE_PROCESS") != NULL &&
                strstr(td_last_error(c), "cuda:0") != NULL,
            "%s", td_last_error(c));
  /* This process, the GPU's one user, can have its context. */
  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW);
  cr_assert_not_null(lib);
  CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(lib, "cuInit");
  CUresult (*retain)(CUcontext *, CUdevice) =
      (CUresult(*)(CUcontext *, CUdevice))dlsym(lib,
                                                "cuDevicePrimaryCtxRetain");
  CUresult (*release)(CUdevice) =
      (CUresult(*)(CUdevice))dlsym(lib, "cuDevicePrimaryCtxRelease_v2");
  cr_assert(init && retain && release);
  CUcontext ctx;
  cr_assert_eq(init(0), CUDA_SUCCESS);
  cr_assert_eq(retain(&ctx, 0), CUDA_SUCCESS,
               "tensord took the exclusive GPU's context");
  /* Another GPU in the default mode would serve; here all are exclusive,
   * so the daemon still makes nothing, and says so again. */
  cr_assert_eq(tdt_create_cuda(c, 1, 1 * MiB, &s), TD_EBUSY);
  cr_assert_eq(release(0), CUDA_SUCCESS);
  unsetenv("TDCUDA_COMPUTE_MODE");
  td_close(c);
}

TDT_TEST(cuda, a_prohibited_gpu_is_named) {
  start_with("TDCUDA_COMPUTE_MODE", "prohibited");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "PROHIBITED") != NULL, "%s",
            td_last_error(c));
  td_close(c);
}

/* td_list callback: counts the storages that say they are on a MIG
 * instance. */
static int list_mig(const td_storage_info *i, void *arg) {
  if (i->device == TD_CUDA && i->device_mig)
    ++*(int *)arg;
  return 0;
}

/* A MIG instance (the double's TDCUDA_MIG=1): cuDeviceGetUuid_v2 gives the
 * instance's own UUID, which nvidia-smi -L and CUDA_VISIBLE_DEVICES write
 * MIG-...: tensord takes it so in --cuda-devices and --cuda-capacity, and
 * names it so in its messages, its stat and its listing. */
TDT_TEST(cuda, a_mig_instance_is_named_and_accepted_as_mig) {
  /* The double's instance on physical device 0: "tdcudamigins", 0. */
  const char *mig = "MIG-74646375-6461-6d69-6769-6e7300000000";
  char cap[64];
  snprintf(cap, sizeof(cap), "%s=4M", mig);
  const char *args[] = {"--cuda-devices", mig, "--cuda-capacity", cap, NULL};
  setenv("TDCUDA_MIG", "1", 1); /* the daemon's and this process's */
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 5 * MiB, &s), TD_ENOMEM);
  cr_assert(strstr(td_last_error(c), mig) != NULL &&
                strstr(td_last_error(c), "capacity") != NULL,
            "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  td_device_stat ds[4];
  size_t n;
  cr_assert_eq(td_stat_devices(c, ds, 4, &n), 0, "%s", td_last_error(c));
  cr_assert_eq(n, 1);
  cr_assert_eq(ds[0].mig, 1);
  cr_assert_eq(ds[0].capacity, 4 * MiB);
  char u[TD_UUID_STR_MAX];
  cr_assert_str_eq(td_gpu_uuid_str(ds[0].uuid, (int)ds[0].mig, u, sizeof(u)),
                   mig);
  cr_assert_eq(td_storage_device_uuid(s, ds[0].uuid), 0);
  cr_assert_str_eq(td_gpu_uuid_str(ds[0].uuid, 1, u, sizeof(u)), mig);
  /* The listing carries the flag with the storage. */
  int seen = 0;
  cr_assert_eq(td_list(c, list_mig, &seen), 0, "%s", td_last_error(c));
  cr_assert_eq(seen, 1);
  td_storage_release(s);
  td_close(c);
  unsetenv("TDCUDA_MIG");
}

/* The same instance by its digits under GPU-, as tensord printed it before
 * it told MIG instances apart, is the same device. */
TDT_TEST(cuda, a_mig_instance_is_also_taken_as_gpu_dash) {
  const char *args[] = {"--cuda-devices",
                        "GPU-74646375-6461-6d69-6769-6e7300000000", NULL};
  setenv("TDCUDA_MIG", "1", 1);
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  unsetenv("TDCUDA_MIG");
}

/* ---- limits and errors ---- */

TDT_TEST(cuda, capacity_is_per_device) {
  const char *args[] = {"--cuda-capacity", "0=8M", NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *s, *t, *u;
  cr_assert_eq(tdt_create_cuda(c, 0, 5 * MiB, &s), 0, "%s", td_last_error(c));
  /* 5 MiB took 6: 2 MiB left of 8. */
  cr_assert_eq(tdt_create_cuda(c, 0, 3 * MiB, &t), TD_ENOMEM);
  cr_assert_null(t);
  const char *e = td_last_error(c);
  cr_assert(strstr(e, "capacity") != NULL && strstr(e, "cuda:0") != NULL &&
                strstr(e, "2.0 MiB") != NULL,
            "the message names neither the capacity nor the device: %s", e);
  /* The other device has its own. */
  cr_assert_eq(tdt_create_cuda(c, 1, 3 * MiB, &u), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &t), 0, "%s", td_last_error(c));
  uint8_t uuid[16];
  cr_assert_eq(td_storage_device_uuid(s, uuid), 0);
  td_device_stat g = gpu_stat(c, uuid);
  cr_assert_eq(g.mig, 0, "a plain GPU called a MIG instance");
  cr_assert_eq(g.capacity, 8 * MiB);
  cr_assert_eq(g.bytes_used, 8 * MiB);
  td_storage_release(s);
  td_storage_release(t);
  td_storage_release(u);
  td_close(c);
}

TDT_TEST(cuda, cuda_devices_limits_what_tensord_touches) {
  const char *args[] = {"--cuda-devices", "1", NULL};
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "--cuda-devices") != NULL, "%s",
            td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 1, 1 * MiB, &s), 0, "%s", td_last_error(c));
  td_device_stat ds[4];
  size_t n;
  cr_assert_eq(td_stat_devices(c, ds, 4, &n), 0);
  cr_assert_eq(n, 1, "the daemon lists %zu GPUs, not only cuda:1", n);
  cr_assert_eq(ds[0].index, 1);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(cuda, no_device_of_that_ordinal) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 2, 1 * MiB, &s), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "cuda:2") != NULL, "%s", td_last_error(c));
  td_create_opts o = {.nbytes = 4096, .device_index = 1};
  cr_assert_eq(td_storage_create_ex(c, &o, &s), TD_EINVAL,
               "a CPU create with a device index");
  td_close(c);
}

TDT_TEST(cuda, without_a_driver_the_client_says_why) {
  tdt_start(&d, NULL);
  setenv("TENSORD_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "/nonexistent/libcuda.so.1") != NULL, "%s",
            td_last_error(c));
  /* CPU storages are unaffected. */
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  td_storage_release(s);
  td_close(c);
}

TDT_TEST(cuda, without_a_driver_the_daemon_says_why) {
  const char *drv = getenv("TENSORD_CUDA_DRIVER");
  char keep[4096];
  snprintf(keep, sizeof(keep), "%s", drv);
  setenv("TENSORD_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  tdt_start(&d, NULL);
  setenv("TENSORD_CUDA_DRIVER", keep, 1); /* the client has the double */
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "/nonexistent/libcuda.so.1") != NULL, "%s",
            td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  td_storage_release(s);
  td_close(c);
}

/* ---- the legacy path: a GPU without POSIX-fd handles ---- */

/* Starts the daemon with its double's GPUs unable to export POSIX fds: it
 * falls back to cuMemAlloc and legacy IPC handles. Clients' doubles are
 * normal (opening a legacy handle does not ask for POSIX fds). */
static void start_legacy(void) {
  setenv("TDCUDA_NO_POSIX_FD", "1", 1); /* the daemon's double only */
  tdt_start(&d, NULL);
  unsetenv("TDCUDA_NO_POSIX_FD");
}

/* How many fds process pid has open: those on the double's allocations
 * (its memfds, "/memfd:tdcuda-double.<device>...") if alloc, else the
 * others. */
static int fds_of(pid_t pid, int alloc) {
  char dir[64], path[320], link[256];
  snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
  DIR *dp = opendir(dir);
  cr_assert_not_null(dp, "%s: %s", dir, strerror(errno));
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
    ssize_t k = readlink(path, link, sizeof(link) - 1);
    if (k > 0) {
      link[k] = '\0';
      n += (strncmp(link, "/memfd:tdcuda-double.", 21) == 0) == alloc;
    }
  }
  closedir(dp);
  return n;
}

/* How many of the double's allocations the daemon holds. */
static int daemon_allocations(void) {
  return fds_of(d.pid, 1);
}

/* Whether the daemon has freed every allocation (cuMemFree runs on its
 * thread pool, after the figures drop). */
static int freed_all(const tdt_daemon *dd) {
  (void)dd;
  return daemon_allocations() == 0;
}

TDT_TEST(cuda, legacy_ipc_handles_share_device_memory_across_processes) {
  start_legacy();
  pid_t peer = hold_peer_rw();
  td_client *c = tdt_connect(&d);
  td_storage *s;
  size_t n = 4 * MiB + 1;
  int fds = fds_of(getpid(), 0);
  cr_assert_eq(tdt_create_cuda(c, 0, n, &s), 0, "%s", td_last_error(c));
  /* No fd travelled with the reply: the handle is in it. (The double's
   * open of it keeps a memfd here, as the driver keeps its device files.) */
  cr_assert_eq(fds_of(getpid(), 0), fds, "a legacy create left %d new fds here",
               fds_of(getpid(), 0) - fds);
  cr_assert_eq(fds_of(getpid(), 1), 1);
  cr_assert_eq(daemon_allocations(), 1);
  shared_both_ways(c, s, n, peer);
  /* cuMemFree'd: the daemon holds the allocation no more. */
  cr_assert(tdt_until(freed_all, &d, 10000), "%d allocation(s) left",
            daemon_allocations());
}

TDT_TEST(cuda, legacy_sigkill_of_the_last_holder_frees_the_allocation) {
  start_legacy();
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  peer_arg a = {d.sock, "held", 0, pfd[1]};
  pid_t pid = tdt_fork(holder, &a);
  close(pfd[1]);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 1, 3 * MiB, &s), 0, "%s", td_last_error(c));
  uint8_t uuid[16];
  cr_assert_eq(td_storage_device_uuid(s, uuid), 0);
  cr_assert_eq(td_publish(c, "held", s, NULL), 0);
  char x;
  cr_assert_eq(read(pfd[0], &x, 1), 1, "the holder failed before pause()");
  close(pfd[0]);
  cr_assert_eq(td_unpublish(c, "held"), 0);
  td_storage_release(s);
  cr_assert_eq(tdt_storages(&d), 1);
  cr_assert_eq(gpu_stat(c, uuid).bytes_used, 4 * MiB);
  cr_assert_eq(daemon_allocations(), 1);
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  memcpy(freed_uuid, uuid, 16);
  tdt_until(gpu_freed, &d, 10000);
  td_device_stat g = gpu_stat(c, uuid);
  cr_assert_eq(g.bytes_used, 0,
               "the dead holder's allocation is still there (%llu bytes)",
               (unsigned long long)g.bytes_used);
  cr_assert_eq(g.storages, 0);
  cr_assert_eq(tdt_storages(&d), 0);
  cr_assert(tdt_until(freed_all, &d, 10000), "the daemon did not cuMemFree it");
  td_close(c);
}

/* The double, stricter than the driver, refuses a second cuIpcOpenMemHandle
 * of one allocation in a process (CUDA_ERROR_ALREADY_MAPPED): a read-write
 * and a read-only handle of one storage only both map if libtensord opens
 * the handle once and shares it. */
TDT_TEST(cuda, legacy_handle_opens_once_per_process) {
  start_legacy();
  td_client *c = tdt_connect(&d);
  td_storage *s, *r, *r2;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "k", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "k", TD_RDONLY, 0, &r, NULL), 0, "%s",
               td_last_error(c));
  /* Two mappings (modes) in the cache, one open: the same pointer. And
   * read-only is not enforced on this path: the memory is the same. */
  cr_assert_eq(td_storage_data(r), td_storage_data(s));
  ((unsigned char *)td_storage_data(s))[5] = 55;
  td_storage_release(s); /* the read-only handle keeps the open */
  cr_assert_eq(((unsigned char *)td_storage_data(r))[5], 55);
  /* A second client in this process shares it too. */
  td_client *c2 = tdt_connect(&d);
  cr_assert_eq(td_lookup(c2, "k", 0, 0, &r2, NULL), 0, "%s", td_last_error(c2));
  cr_assert_eq(td_storage_data(r2), td_storage_data(r));
  td_storage_release(r2);
  td_close(c2);
  td_storage_release(r);
  /* The last handle closed it: a new one opens it again. */
  cr_assert_eq(td_lookup(c, "k", 0, 0, &s, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(((unsigned char *)td_storage_data(s))[5], 55);
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "k"), 0);
  td_close(c);
}

/* Starts the daemon with name=value in its environment only. */
static void start_with(const char *name, const char *value) {
  setenv(name, value, 1);
  tdt_start(&d, NULL);
  unsetenv(name);
}

/* On a daemon that takes the legacy path: a storage made with no fd
 * travelling, shared both ways, and freed when its holders go. */
static void legacy_round_trip(void) {
  pid_t peer = hold_peer_rw();
  td_client *c = tdt_connect(&d);
  td_storage *s;
  size_t n = 4 * MiB + 1;
  int fds = fds_of(getpid(), 0);
  cr_assert_eq(tdt_create_cuda(c, 0, n, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(fds_of(getpid(), 0), fds, "an fd travelled: not legacy");
  cr_assert_eq(daemon_allocations(), 1);
  shared_both_ways(c, s, n, peer);
  cr_assert(tdt_until(freed_all, &d, 10000), "%d allocation(s) left",
            daemon_allocations());
}

/* A GPU without virtual memory management (the cuMem* VMM calls all
 * CUDA_ERROR_NOT_SUPPORTED, cuMemGetAllocationGranularity included) is
 * served by the legacy path, never asked for a VMM granularity. */
TDT_TEST(cuda, legacy_ipc_on_a_gpu_without_vmm) {
  start_with("TDCUDA_NO_VMM", "1");
  legacy_round_trip();
}

/* TENSORD_CUDA_LEGACY=1 (a test switch, run by tests/gpu/run.sh too) makes
 * a daemon whose GPUs have VMM and POSIX fds take the legacy path. */
TDT_TEST(cuda, legacy_ipc_forced_by_the_test_switch) {
  start_with("TENSORD_CUDA_LEGACY", "1");
  legacy_round_trip();
}

/* cuInit's CUDA_ERROR_SYSTEM_NOT_READY (the driver's daemons still
 * starting, at boot) is not kept until a restart: a create a second later
 * tries again, and gets its storage. */
TDT_TEST(cuda, a_driver_not_yet_ready_is_tried_again) {
  start_with("TDCUDA_INIT_NOT_READY", "1");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "CUDA_ERROR_SYSTEM_NOT_READY") != NULL &&
                strstr(td_last_error(c), "still starting") != NULL,
            "%s", td_last_error(c));
  /* At once: the same answer, without hammering the driver. */
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), TD_ENODEV);
  usleep(1100 * 1000);
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
}

/* ---- UUIDs, not ordinals ---- */

static int make_on_1(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, tdt_create_cuda(c, 1, 1 * MiB, &s), 0);
  ((unsigned char *)td_storage_data(s))[7] = 77;
  CHECK_ERR(c, td_publish(c, a->key, s, NULL), 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(cuda, a_client_that_cannot_see_the_gpu_is_told_its_uuid) {
  tdt_start(&d, NULL);
  peer_arg a = {d.sock, "on1", 0, -1};
  cr_assert_eq(tdt_wait(tdt_fork(make_on_1, &a)), 0);
  setenv("CUDA_VISIBLE_DEVICES", "0", 1); /* before this process loads it */
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "on1", 0, 0, &s, NULL), TD_ENODEV);
  cr_assert(strstr(td_last_error(c), "GPU-") != NULL &&
                strstr(td_last_error(c), "cannot see") != NULL,
            "%s", td_last_error(c));
  cr_assert_eq(tdt_storages(&d), 1, "the refused lookup kept a reference");
  cr_assert_eq(td_unpublish(c, "on1"), 0);
  td_close(c);
  unsetenv("CUDA_VISIBLE_DEVICES");
}

TDT_TEST(cuda, a_gpu_is_mapped_by_uuid_whatever_its_ordinal_here) {
  tdt_start(&d, NULL);
  peer_arg a = {d.sock, "on1", 0, -1};
  cr_assert_eq(tdt_wait(tdt_fork(make_on_1, &a)), 0);
  setenv("CUDA_VISIBLE_DEVICES", "1", 1); /* the daemon's cuda:1 is our 0 */
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "on1", 0, 0, &s, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_device_index(s), 0);
  cr_assert_eq(((unsigned char *)td_storage_data(s))[7], 77);
  /* DLPack names this process's ordinal. */
  DLManagedTensor *t;
  cr_assert_eq(td_to_dlpack(s, NULL, &t), 0, "%s", td_view_last_error());
  cr_assert_eq(t->dl_tensor.device.device_type, kDLCUDA);
  cr_assert_eq(t->dl_tensor.device.device_id, 0);
  cr_assert_eq(t->dl_tensor.data, td_storage_data(s));
  cr_assert_eq(t->dl_tensor.shape[0], (int64_t)MiB);
  t->deleter(t);
  td_storage_release(s);
  cr_assert_eq(td_unpublish(c, "on1"), 0);
  td_close(c);
  unsetenv("CUDA_VISIBLE_DEVICES");
}

/* ---- tensorctl ---- */

/* Runs tensorctl with args on d's socket into out. Returns its status. */
static int ctl(const char *args, char *out, size_t len) {
  char cmd[512];
  snprintf(cmd, sizeof(cmd), "%s --socket %s %s", TENSORCTL_BIN, d.sock, args);
  FILE *f = popen(cmd, "r");
  cr_assert_not_null(f);
  size_t n = fread(out, 1, len - 1, f);
  out[n] = '\0';
  return pclose(f);
}

TDT_TEST(cuda, tensorctl_shows_the_device) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s, *h;
  cr_assert_eq(tdt_create_cuda(c, 1, 3 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  char out[8192];
  cr_assert_eq(ctl("ls", out, sizeof(out)), 0);
  cr_assert(strstr(out, " cuda:1 ") != NULL, "%s", out);
  cr_assert(strstr(out, " cpu ") != NULL, "%s", out);
  cr_assert_eq(ctl("stat", out, sizeof(out)), 0);
  cr_assert(strstr(out, "cuda:1") != NULL && strstr(out, "4.0 MiB") != NULL,
            "%s", out);
  cr_assert_eq(ctl("--json ls", out, sizeof(out)), 0);
  cr_assert(strstr(out, "\"device_uuid\":\"GPU-") != NULL, "%s", out);
  cr_assert_eq(ctl("--json stat", out, sizeof(out)), 0);
  cr_assert(strstr(out, "\"devices\":[{\"device\":\"cuda:") != NULL, "%s", out);
  td_storage_release(s);
  td_storage_release(h);
  td_close(c);
}

/* ---- --state-dir ---- */

TDT_TEST(cuda, keys_of_gpu_storages_do_not_outlive_the_daemon) {
  tdt_mkdtemp(state_dir);
  const char *args[] = {"--state-dir", state_dir, NULL};
  tdt_start(&d, args);
  first_instance = d.instance;
  td_client *c = tdt_connect(&d);
  td_storage *g, *h, *o;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &g), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  cr_assert_eq(td_storage_create(c, 4096, &o), 0);
  cr_assert_eq(td_publish(c, "gpu", g, NULL), 0);
  cr_assert_eq(td_publish(c, "cpu", h, NULL), 0);
  /* A CPU storage's key, then a GPU storage's under the same name: the
   * journal must not serve the CPU one again. */
  cr_assert_eq(td_publish(c, "x", o, NULL), 0);
  cr_assert_eq(td_publish(c, "x", g, NULL), 0);
  td_storage_release(g);
  td_storage_release(h);
  td_storage_release(o);
  td_close(c);
  cr_assert_eq(kill(d.pid, SIGKILL), 0);
  cr_assert_eq(tdt_wait(d.pid), 128 + SIGKILL);
  d.pid = 0;
  tdt_restart(&d, args);
  c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "cpu", 0, 0, &s, NULL), 0, "%s", td_last_error(c));
  td_storage_release(s);
  cr_assert_eq(td_lookup(c, "gpu", 0, 0, &s, NULL), TD_ENOENT);
  cr_assert_eq(td_lookup(c, "x", 0, 0, &s, NULL), TD_ENOENT,
               "the key came back as the CPU storage it named before");
  /* Not journaled at all: the restart found no record of them to drop. */
  cr_assert(tdt_log_has(&d, "serving 1 key(s) on 1 storage(s) again; 0 "
                            "dropped"),
            "the journal recorded a GPU storage's key");
  cr_assert_eq(td_unpublish(c, "cpu"), 0);
  td_close(c);
  tdt_stop(&d);
  /* The CPU storage the restart adopted kept its first name: gone too. */
  cr_assert_eq(tdt_segments_of(first_instance), 0);
  first_instance = 0;
  tdt_rmdir(state_dir);
  state_dir[0] = '\0';
}

/* ---- td_copy between host and device ---- */

TDT_TEST(cuda, copy_between_host_and_device) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *h, *g, *h2, *g2;
  int64_t shape[2] = {3, 4};
  td_view v, t;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, shape, &v), 0);
  cr_assert_eq(td_storage_create(c, 48, &h), 0);
  cr_assert_eq(td_storage_create(c, 48, &h2), 0);
  cr_assert_eq(tdt_create_cuda(c, 0, 48, &g), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 1, 48, &g2), 0, "%s", td_last_error(c));
  int32_t *hp = td_storage_data(h), *h2p = td_storage_data(h2);
  /* The double's device pointers are host addresses: read them to check. */
  int32_t *gp = td_storage_data(g), *g2p = td_storage_data(g2);
  for (int i = 0; i < 12; i++)
    hp[i] = i + 1;
  /* Dense to dense: one copy each way. */
  cr_assert_eq(td_copy(g, &v, h, &v), 0, "%s", td_view_last_error());
  for (int i = 0; i < 12; i++)
    cr_assert_eq(gp[i], i + 1);
  cr_assert_eq(td_copy(h2, &v, g, &v), 0, "%s", td_view_last_error());
  cr_assert_eq(memcmp(h2p, hp, 48), 0);
  /* A transpose into the other GPU's storage, staged through the host. */
  int64_t tshape[2] = {4, 3};
  td_view dst;
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, tshape, &dst), 0);
  t = v;
  cr_assert_eq(td_view_transpose(&t, 0, 1), 0);
  cr_assert_eq(td_copy(g2, &dst, g, &t), 0, "%s", td_view_last_error());
  for (int r = 0; r < 4; r++)
    for (int k = 0; k < 3; k++)
      cr_assert_eq(g2p[r * 3 + k], gp[k * 4 + r]);
  /* A strided destination keeps the bytes between its elements. */
  int64_t six = 6;
  td_view col, every2;
  cr_assert_eq(td_view_contiguous(TD_INT32, 1, &six, &col), 0);
  every2 = col;
  every2.stride[0] = 2;
  for (int i = 0; i < 12; i++)
    hp[i] = -1 - i;
  cr_assert_eq(td_copy(g, &every2, h, &col), 0, "%s", td_view_last_error());
  for (int i = 0; i < 12; i++)
    cr_assert_eq(gp[i], i % 2 ? i + 1 : -1 - i / 2, "element %d is %d", i,
                 gp[i]);
  /* Checks come first: shapes must agree, and a read-only destination is
   * refused. */
  cr_assert_eq(td_copy(g, &dst, h, &v), TD_EINVAL);
  td_storage *ro;
  cr_assert_eq(td_storage_open(c, td_storage_id(g), TD_RDONLY, &ro), 0);
  cr_assert_eq(td_copy(ro, &v, h, &v), TD_EACCES);
  td_storage_release(ro);
  td_storage_release(h);
  td_storage_release(h2);
  td_storage_release(g);
  td_storage_release(g2);
  td_close(c);
}

/* Lines in the double's cuMemcpy2D log (TDCUDA_MEMCPY2D_LOG): one a copy. */
static int copies2d(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 0;
  int n = 0, ch;
  while ((ch = fgetc(f)) != EOF)
    n += ch == '\n';
  fclose(f);
  return n;
}

/* Fills n int32s of s (a CPU storage, or a GPU's through the double, whose
 * device pointers are host addresses) with base + i. */
static void fill(td_storage *s, size_t n, int32_t base) {
  int32_t *p = td_storage_data(s);
  for (size_t i = 0; i < n; i++)
    p[i] = base + (int32_t)i;
}

/* Copies sv into dv H->D, D->H and D->D (one GPU), each over a destination
 * holding the same bytes as a CPU copy's, and checks each against td_copy of
 * the same views between CPU storages: the same bytes, the elements between
 * the views' ones kept. Asserts that each device copy made want cuMemcpy2D
 * calls (log names the double's record of them). */
static void check_rows(td_client *c, const td_view *dv, size_t dn,
                       const td_view *sv, size_t sn, const char *log,
                       int want) {
  td_storage *hs, *hd, *ref, *gs, *gd;
  cr_assert_eq(td_storage_create(c, sn * 4, &hs), 0);
  cr_assert_eq(td_storage_create(c, dn * 4, &hd), 0);
  cr_assert_eq(td_storage_create(c, dn * 4, &ref), 0);
  cr_assert_eq(tdt_create_cuda(c, 0, sn * 4, &gs), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 0, dn * 4, &gd), 0, "%s", td_last_error(c));
  fill(hs, sn, 1);
  fill(gs, sn, 1);
  fill(ref, dn, -1000);
  cr_assert_eq(td_copy(ref, dv, hs, sv), 0, "%s", td_view_last_error());
  const char *way[3] = {"host to device", "device to host", "device to device"};
  for (int k = 0; k < 3; k++) {
    td_storage *dst = k == 1 ? hd : gd, *src = k == 0 ? hs : gs;
    fill(dst, dn, -1000);
    int before = copies2d(log);
    cr_assert_eq(td_copy(dst, dv, src, sv), 0, "%s: %s", way[k],
                 td_view_last_error());
    cr_assert_eq(copies2d(log) - before, want, "%s: %d cuMemcpy2D, not %d",
                 way[k], copies2d(log) - before, want);
    cr_assert_eq(memcmp(td_storage_data(dst), td_storage_data(ref), dn * 4), 0,
                 "%s: the bytes differ from a CPU copy's", way[k]);
  }
  td_storage_release(hs);
  td_storage_release(hd);
  td_storage_release(ref);
  td_storage_release(gs);
  td_storage_release(gd);
}

TDT_TEST(cuda, copy_rows_on_the_device) {
  char *log = memcpy2d_log;
  strcpy(log, "/tmp/tdcuda-memcpy2d.XXXXXX");
  int fd = mkstemp(log);
  cr_assert_geq(fd, 0);
  close(fd);
  cr_assert_eq(setenv("TDCUDA_MEMCPY2D_LOG", log, 1), 0);
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_view sv, dv;
  /* 2D: rows 1..4, columns 2..6 of a 6 x 8 into rows 0..3, columns 1..5 of
   * a 5 x 6: one slab of 4 rows of 20 bytes. */
  int64_t s2[2] = {6, 8}, d2[2] = {5, 6};
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s2, &sv), 0);
  cr_assert_eq(td_view_slice(&sv, 0, 1, 5, 1), 0);
  cr_assert_eq(td_view_slice(&sv, 1, 2, 7, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, d2, &dv), 0);
  cr_assert_eq(td_view_slice(&dv, 0, 0, 4, 1), 0);
  cr_assert_eq(td_view_slice(&dv, 1, 1, 6, 1), 0);
  check_rows(c, &dv, 30, &sv, 48, log, 1);
  /* 3D, every other row of the source: a slab of 3 rows of 16 bytes for
   * each of the 3 outer indices. */
  int64_t s3[3] = {4, 5, 6}, d3[3] = {5, 4, 8};
  cr_assert_eq(td_view_contiguous(TD_INT32, 3, s3, &sv), 0);
  cr_assert_eq(td_view_slice(&sv, 0, 1, 4, 1), 0);
  cr_assert_eq(td_view_slice(&sv, 1, 0, 5, 2), 0);
  cr_assert_eq(td_view_slice(&sv, 2, 1, 5, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 3, d3, &dv), 0);
  cr_assert_eq(td_view_slice(&dv, 0, 0, 3, 1), 0);
  cr_assert_eq(td_view_slice(&dv, 1, 1, 4, 1), 0);
  cr_assert_eq(td_view_slice(&dv, 2, 2, 6, 1), 0);
  check_rows(c, &dv, 160, &sv, 120, log, 3);
  /* Inner dims that merge: whole rows of both make one run per outer
   * index, 2 x 48 bytes in one slab. */
  cr_assert_eq(td_view_contiguous(TD_INT32, 3, s3, &sv), 0);
  cr_assert_eq(td_view_slice(&sv, 0, 1, 4, 2), 0);
  cr_assert_eq(td_view_slice(&sv, 1, 1, 3, 1), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 3, s3, &dv), 0);
  cr_assert_eq(td_view_slice(&dv, 0, 0, 2, 1), 0);
  cr_assert_eq(td_view_slice(&dv, 1, 3, 5, 1), 0);
  check_rows(c, &dv, 120, &sv, 120, log, 1);
  /* Element-strided (every other column): staged through the host, no 2D
   * copy, same bytes. */
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s2, &sv), 0);
  cr_assert_eq(td_view_slice(&sv, 1, 0, 8, 2), 0);
  cr_assert_eq(td_view_contiguous(TD_INT32, 2, s2, &dv), 0);
  cr_assert_eq(td_view_slice(&dv, 1, 4, 8, 1), 0);
  check_rows(c, &dv, 48, &sv, 48, log, 0);
  td_close(c);
  tdt_stop(&d);
  unsetenv("TDCUDA_MEMCPY2D_LOG");
}

/* ---- td_copy and zeroing complete before they return ---- */

/* Looks the key up and checks that its bytes are 0, 1, 2, ... (mod 251),
 * reading the device memory directly (the double's device pointers are
 * host addresses), as a consumer on a GPU would read it right away. */
static int peer_sees_pattern(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, a->key, TD_RDONLY, 0, &s, NULL), 0);
  const volatile unsigned char *b = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s); i++)
    if (b[i] != (unsigned char)(i % 251)) {
      fprintf(stderr, "peer: %s byte %zu is %u, not %u\n", a->key, i, b[i],
              (unsigned)(i % 251));
      return 1;
    }
  td_storage_release(s);
  td_close(c);
  return 0;
}

/* td_copy into a GPU storage, then td_publish: the consumer must read the
 * copied bytes, so td_copy may return only when the device holds them (a
 * driver's cuMemcpyHtoD from pageable memory returns once the bytes are
 * staged, and a device-to-device copy at once). */
TDT_TEST(cuda, td_copy_to_a_gpu_is_done_when_it_returns) {
  tdt_start(&d, NULL);
  /* The consumers, forked before this process's first CUDA call. */
  peer_arg a = {d.sock, "copied", 0, -1}, a2 = {d.sock, "copied2", 0, -1};
  pid_t peer = tdt_fork_held(peer_sees_pattern, &a, 0);
  pid_t peer2 = tdt_fork_held(peer_sees_pattern, &a2, 0);
  td_client *c = tdt_connect(&d);
  td_storage *h, *g, *g2;
  size_t n = 3 * 4096;
  cr_assert_eq(td_storage_create(c, n, &h), 0);
  cr_assert_eq(tdt_create_cuda(c, 0, n, &g), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 0, n, &g2), 0, "%s", td_last_error(c));
  unsigned char *hp = td_storage_data(h);
  for (size_t i = 0; i < n; i++)
    hp[i] = (unsigned char)(i % 251);
  int64_t len = (int64_t)n, rows[2] = {3, 4096};
  td_view v, r;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, &len, &v), 0);
  cr_assert_eq(td_view_contiguous(TD_UINT8, 2, rows, &r), 0);
  /* Host to device, one copy. */
  cr_assert_eq(td_copy(g, &v, h, &v), 0, "%s", td_view_last_error());
  cr_assert_eq(td_publish(c, "copied", g, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_wait(tdt_go(peer)), 0,
               "td_copy host to device returned before the device held the "
               "bytes");
  /* Device to device, rows (cuMemcpy2D), on one GPU. */
  cr_assert_eq(td_copy(g2, &r, g, &r), 0, "%s", td_view_last_error());
  cr_assert_eq(td_publish(c, "copied2", g2, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_wait(tdt_go(peer2)), 0,
               "td_copy device to device returned before the device held "
               "the bytes");
  cr_assert_eq(td_unpublish(c, "copied"), 0);
  cr_assert_eq(td_unpublish(c, "copied2"), 0);
  td_storage_release(h);
  td_storage_release(g);
  td_storage_release(g2);
  td_close(c);
}

/* Looks the key up and exits 0 if its first and last bytes are zero, 2 if
 * they are the double's junk (a fresh allocation's unspecified bytes). */
static int peer_sees_zeros(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, a->key, TD_RDONLY, 0, &s, NULL), 0);
  const volatile unsigned char *b = td_storage_data(s);
  size_t n = td_storage_nbytes(s);
  int st = b[0] == 0 && b[n - 1] == 0 ? 0 : b[0] == 0xdb ? 2 : 1;
  td_storage_release(s);
  td_close(c);
  return st;
}

/* A new GPU storage reads as zeros in another process as soon as the create
 * returned and the key was published: the zeroing is done, not only
 * issued. A TD_UNINIT one shows the double's junk there, which is what an
 * unfinished zeroing would leave. */
TDT_TEST(cuda, a_new_gpu_storage_reads_as_zeros_elsewhere_at_once) {
  tdt_start(&d, NULL);
  /* The readers, forked before this process's first CUDA call. */
  peer_arg a = {d.sock, "zeroed", 0, -1}, a2 = {d.sock, "uninit", 0, -1};
  pid_t peer = tdt_fork_held(peer_sees_zeros, &a, 0);
  pid_t peer2 = tdt_fork_held(peer_sees_zeros, &a2, 0);
  td_client *c = tdt_connect(&d);
  td_storage *z, *u;
  cr_assert_eq(tdt_create_cuda(c, 0, 4 * MiB, &z), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "zeroed", z, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_wait(tdt_go(peer)), 0,
               "a zeroed storage is not zeros in another process");
  td_create_opts o = {0};
  o.nbytes = 4 * MiB;
  o.device = TD_CUDA;
  o.flags = TD_UNINIT;
  cr_assert_eq(td_storage_create_ex(c, &o, &u), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "uninit", u, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_wait(tdt_go(peer2)), 2,
               "an uninitialised storage does not show the double's junk");
  cr_assert_eq(td_unpublish(c, "zeroed"), 0);
  cr_assert_eq(td_unpublish(c, "uninit"), 0);
  td_storage_release(z);
  td_storage_release(u);
  td_close(c);
}

/* A server's thread capturing a CUDA graph in GLOBAL mode, the default of
 * cudaStreamBeginCapture and torch.cuda.graph, on a blocking stream. */
typedef struct {
  CUresult (*Retain)(CUcontext *, CUdevice);
  CUresult (*Push)(CUcontext);
  CUresult (*Pop)(CUcontext *);
  CUresult (*StreamCreate)(CUstream *, unsigned int);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*Begin)(CUstream, CUstreamCaptureMode);
  CUresult (*End)(CUstream, CUgraph *);
  CUresult begun, ended;
  pthread_barrier_t capturing, done;
} capturer;

static void *capture_thread(void *arg) {
  capturer *k = arg;
  CUcontext ctx, popped;
  CUstream s = NULL;
  k->begun = k->Retain(&ctx, 0);
  if (k->begun == CUDA_SUCCESS)
    k->begun = k->Push(ctx);
  if (k->begun == CUDA_SUCCESS)
    k->begun = k->StreamCreate(&s, 0);
  if (k->begun == CUDA_SUCCESS)
    k->begun = k->Begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
  pthread_barrier_wait(&k->capturing);
  pthread_barrier_wait(&k->done);
  if (k->begun == CUDA_SUCCESS) {
    CUgraph g;
    k->ended = k->End(s, &g);
    k->StreamDestroy(s);
    k->Pop(&popped);
  }
  return NULL;
}

/* While another thread of the process captures in GLOBAL mode, creating a
 * zeroed GPU storage, td_copy both ways and releasing work, and the capture
 * survives: libtensord uses neither the legacy stream nor cuCtxSynchronize
 * (which would fail, and invalidate the server's graph), only a stream of
 * its own. */
TDT_TEST(cuda, storages_work_while_another_thread_captures_a_graph) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *h, *g, *back;
  cr_assert_eq(td_storage_create(c, 8192, &h), 0);
  cr_assert_eq(td_storage_create(c, 8192, &back), 0);
  /* Loads the driver in this process and maps one storage first, so that
   * the capture is the only thing new below. */
  cr_assert_eq(tdt_create_cuda(c, 0, 4096, &g), 0, "%s", td_last_error(c));
  td_storage_release(g);

  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW);
  cr_assert_not_null(lib, "%s", dlerror());
  capturer k = {0};
  *(void **)&k.Retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&k.Push = dlsym(lib, "cuCtxPushCurrent_v2");
  *(void **)&k.Pop = dlsym(lib, "cuCtxPopCurrent_v2");
  *(void **)&k.StreamCreate = dlsym(lib, "cuStreamCreate");
  *(void **)&k.StreamDestroy = dlsym(lib, "cuStreamDestroy_v2");
  *(void **)&k.Begin = dlsym(lib, "cuStreamBeginCapture_v2");
  *(void **)&k.End = dlsym(lib, "cuStreamEndCapture");
  cr_assert(k.Retain && k.Push && k.Pop && k.StreamCreate && k.StreamDestroy &&
            k.Begin && k.End);
  pthread_barrier_init(&k.capturing, NULL, 2);
  pthread_barrier_init(&k.done, NULL, 2);
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, capture_thread, &k), 0);
  pthread_barrier_wait(&k.capturing);
  cr_assert_eq(k.begun, CUDA_SUCCESS, "cuStreamBeginCapture: %d", k.begun);

  int err = tdt_create_cuda(c, 0, 8192, &g);
  const char *why = err < 0 ? td_last_error(c) : "";
  int copied = -1, fetched = -1;
  if (err == 0) {
    unsigned char *hp = td_storage_data(h);
    for (size_t i = 0; i < 8192; i++)
      hp[i] = (unsigned char)(i % 251);
    int64_t n = 8192;
    td_view v;
    td_view_contiguous(TD_UINT8, 1, &n, &v);
    copied = td_copy(g, &v, h, &v);
    fetched = td_copy(back, &v, g, &v);
    td_storage_release(g);
  }
  pthread_barrier_wait(&k.done);
  pthread_join(t, NULL);
  pthread_barrier_destroy(&k.capturing);
  pthread_barrier_destroy(&k.done);
  cr_assert_eq(err, 0, "a zeroed create during a capture: %s", why);
  cr_assert_eq(copied, 0, "td_copy to the device during a capture: %s",
               td_view_last_error());
  cr_assert_eq(fetched, 0, "td_copy from the device during a capture: %s",
               td_view_last_error());
  cr_assert_eq(memcmp(td_storage_data(back), td_storage_data(h), 8192), 0);
  cr_assert_eq(k.ended, CUDA_SUCCESS,
               "the server's capture was invalidated (cuStreamEndCapture: "
               "%d)",
               k.ended);
  td_storage_release(h);
  td_storage_release(back);
  td_close(c);
}

/* ---- events: ordering a consumer after the producer's GPU work ---- */

/* The driver libtensord loaded (the double), for what only an application
 * does: make and record events. */
typedef struct {
  CUresult (*Retain)(CUcontext *, CUdevice);
  CUresult (*Push)(CUcontext);
  CUresult (*EventCreate)(CUevent *, unsigned int);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventDestroy)(CUevent);
} app_cu;

static app_cu app_driver(void) {
  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW);
  cr_assert_not_null(lib, "%s", dlerror());
  app_cu a;
  *(void **)&a.Retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&a.Push = dlsym(lib, "cuCtxPushCurrent_v2");
  *(void **)&a.EventCreate = dlsym(lib, "cuEventCreate");
  *(void **)&a.EventRecord = dlsym(lib, "cuEventRecord");
  *(void **)&a.EventDestroy = dlsym(lib, "cuEventDestroy_v2");
  cr_assert(a.Retain && a.Push && a.EventCreate && a.EventRecord &&
            a.EventDestroy);
  CUcontext ctx;
  cr_assert_eq(a.Retain(&ctx, 0), CUDA_SUCCESS);
  cr_assert_eq(a.Push(ctx), CUDA_SUCCESS);
  return a;
}

/* Waits on the key's event, on the host and on a stream, then reads. Exits
 * 3 if the waits fail; dies of SIGABRT where the double stops a use of an
 * event its exporter destroyed (undefined on a real driver). */
static int peer_wait(void *p) {
  peer_arg *a = p;
  td_client *c;
  td_storage *s;
  struct rlimit no_core = {0, 0}; /* an expected abort leaves no core */
  setrlimit(RLIMIT_CORE, &no_core);
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, a->key, TD_RDONLY, 0, &s, NULL), 0);
  int w1 = td_storage_wait(s, NULL);
  int w2 = td_storage_wait(s, CU_STREAM_LEGACY);
  if (w1 < 0 || w2 < 0) {
    fprintf(stderr, "peer: %s\n", td_last_error(c));
    CHECK(w1 < 0 && w2 < 0);
    CHECK(strstr(td_last_error(c), "cuIpcOpenEventHandle") != NULL);
    return 3;
  }
  CHECK(((unsigned char *)td_storage_data(s))[3] == 33);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(cuda, a_consumer_waits_on_the_event_published_with_the_key) {
  tdt_start(&d, NULL);
  /* The consumers, forked before this process's first CUDA call: one
   * while the event lives, one after its producer destroyed it. */
  peer_arg a = {d.sock, "ev", 0, -1};
  pid_t live = tdt_fork_held(peer_wait, &a, 0);
  pid_t late = tdt_fork_held(peer_wait, &a, 0);
  td_client *c = tdt_connect(&d);
  td_storage *s, *h;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  app_cu cu = app_driver();
  /* The producer's work, then its record. */
  ((unsigned char *)td_storage_data(s))[3] = 33;
  CUevent ev;
  cr_assert_eq(
      cu.EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
      CUDA_SUCCESS);
  cr_assert_eq(cu.EventRecord(ev, NULL), CUDA_SUCCESS);
  td_publish_opts o = {0};
  o.event = ev;
  cr_assert_eq(td_publish_ex(c, "ev", s, NULL, &o), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_wait(tdt_go(live)), 0);

  /* A key published without one: nothing to wait for. */
  cr_assert_eq(td_publish(c, "plain", s, NULL), 0);
  cr_assert_eq(td_lookup(c, "plain", TD_RDONLY, 0, &h, NULL), 0);
  cr_assert_eq(td_storage_wait(h, NULL), 0);
  td_storage_release(h);

  /* The handle names the producer's event, which the producer must keep
   * while the key names it and it stays connected: a consumer's open of a
   * destroyed one is undefined on a real driver, and the double stops it. */
  cr_assert_eq(cu.EventDestroy(ev), CUDA_SUCCESS);
  cr_assert_eq(tdt_wait(tdt_go(late)), 128 + SIGABRT);

  cr_assert_eq(td_unpublish(c, "ev"), 0);
  cr_assert_eq(td_unpublish(c, "plain"), 0);
  td_storage_release(s);
  td_close(c);
}

/* The driver opens no process's own event handle: a lookup in the
 * publishing process, on another client too, waits on the event itself. */
TDT_TEST(cuda, the_publishing_process_waits_on_its_own_event) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d), *c2 = tdt_connect(&d);
  td_storage *s, *h;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  app_cu cu = app_driver();
  CUevent ev;
  cr_assert_eq(
      cu.EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
      CUDA_SUCCESS);
  cr_assert_eq(cu.EventRecord(ev, NULL), CUDA_SUCCESS);
  td_publish_opts o = {0};
  o.event = ev;
  cr_assert_eq(td_publish_ex(c, "own", s, NULL, &o), 0, "%s", td_last_error(c));
  cr_assert_eq(td_lookup(c2, "own", TD_RDONLY, 0, &h, NULL), 0);
  cr_assert_eq(td_storage_wait(h, NULL), 0, "%s", td_last_error(c2));
  cr_assert_eq(td_storage_wait(h, CU_STREAM_LEGACY), 0, "%s",
               td_last_error(c2));
  td_storage_release(h);
  /* Waits used the event, not an open of it: it is still the caller's. */
  cr_assert_eq(cu.EventDestroy(ev), CUDA_SUCCESS);
  cr_assert_eq(td_unpublish(c, "own"), 0);
  td_storage_release(s);
  td_close(c2);
  td_close(c);
}

TDT_TEST(cuda, a_publish_with_an_event_needs_an_interprocess_one_on_a_gpu) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s, *h;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  app_cu cu = app_driver();
  CUevent ev;
  cr_assert_eq(cu.EventCreate(&ev, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  td_publish_opts o = {0};
  o.event = ev;
  cr_assert_eq(td_publish_ex(c, "ev", s, NULL, &o), TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "CU_EVENT_INTERPROCESS") != NULL, "%s",
            td_last_error(c));
  cr_assert_eq(cu.EventDestroy(ev), CUDA_SUCCESS);
  cr_assert_eq(
      cu.EventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
      CUDA_SUCCESS);
  o.event = ev;
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  cr_assert_eq(td_publish_ex(c, "ev", h, NULL, &o), TD_EINVAL);
  cr_assert(strstr(td_last_error(c), "not on a GPU") != NULL, "%s",
            td_last_error(c));
  td_storage_release(h);
  cr_assert_eq(td_lookup(c, "ev", 0, 0, &h, NULL), TD_ENOENT,
               "a refused publish published nothing");
  cr_assert_eq(cu.EventDestroy(ev), CUDA_SUCCESS);
  td_storage_release(s);
  td_close(c);
}

/* ---- events whose producer is gone ---- */

typedef struct {
  const char *sock;
  const char *keys[2]; /* published with the event; keys[1] may be NULL */
  int ready;           /* write end, or -1: exit once published */
} producer_arg;

/* A producer: writes a new CUDA storage, records an interprocess event
 * after the write, and publishes the storage with it under each key. Then
 * exits without a word (its event goes with the process), or, with ready,
 * says so and waits to be killed. */
static int producer(void *p) {
  producer_arg *a = p;
  td_client *c;
  td_storage *s;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, tdt_create_cuda(c, 0, 1 * MiB, &s), 0);
  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW);
  CHECK(lib != NULL);
  CUresult (*retain)(CUcontext *, CUdevice);
  CUresult (*push)(CUcontext);
  CUresult (*create)(CUevent *, unsigned int);
  CUresult (*record)(CUevent, CUstream);
  *(void **)&retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&push = dlsym(lib, "cuCtxPushCurrent_v2");
  *(void **)&create = dlsym(lib, "cuEventCreate");
  *(void **)&record = dlsym(lib, "cuEventRecord");
  CHECK(retain && push && create && record);
  CUcontext ctx;
  CHECK(retain(&ctx, 0) == CUDA_SUCCESS && push(ctx) == CUDA_SUCCESS);
  ((unsigned char *)td_storage_data(s))[3] = 33;
  CUevent ev;
  CHECK(create(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) ==
        CUDA_SUCCESS);
  CHECK(record(ev, NULL) == CUDA_SUCCESS);
  td_publish_opts o = {0};
  o.event = ev;
  for (int i = 0; i < 2 && a->keys[i] != NULL; i++)
    CHECK_ERR(c, td_publish_ex(c, a->keys[i], s, NULL, &o), 0);
  if (a->ready < 0)
    return 0;
  CHECK(write(a->ready, "r", 1) == 1);
  pause(); /* killed here */
  return 0;
}

/* What one line of the daemon's log must show before a test goes on. */
static char log_needle[128], log_needle2[64];

static int log_shows(const tdt_daemon *dd) {
  FILE *f = fopen(dd->log, "r");
  if (f == NULL)
    return 0;
  char line[2048];
  int found = 0;
  while (!found && fgets(line, sizeof(line), f))
    found =
        strstr(line, log_needle) != NULL && strstr(line, log_needle2) != NULL;
  fclose(f);
  return found;
}

/* Waits until the daemon has closed client pid's connection and dropped
 * its event from n keys (n 0: from none). */
static void until_events_dropped(pid_t pid, int n) {
  snprintf(log_needle, sizeof(log_needle), "client %d", (int)pid);
  snprintf(log_needle2, sizeof(log_needle2), "; dropping its ");
  cr_assert(tdt_until(log_shows, &d, 5000), "the daemon saw no close of %d",
            (int)pid);
  snprintf(log_needle, sizeof(log_needle),
           "client %d gone: dropped its event from %d key(s)", (int)pid, n);
  log_needle2[0] = '\0';
  if (n > 0)
    cr_assert(tdt_until(log_shows, &d, 5000), "no '%s' in the log", log_needle);
  else
    cr_assert_not(tdt_log_has(&d, "dropped its event"),
                  "an event was dropped that no key carried");
}

/* The consumer after its producer exited: the key is there, with no event
 * (the process that made it, and so the event, is gone): the waits return
 * 0 at once, and the bytes, written before the record, are there. Without
 * the daemon dropping the event, the consumer's open of it is undefined on
 * a real driver, and the double aborts it. */
TDT_TEST(cuda, an_event_goes_from_its_keys_when_its_producer_exits) {
  tdt_start(&d, NULL);
  producer_arg pa = {d.sock, {"ev/a", "ev/b"}, -1};
  pid_t pid = tdt_fork(producer, &pa);
  cr_assert_eq(tdt_wait(pid), 0);
  until_events_dropped(pid, 2);
  peer_arg a = {d.sock, "ev/a", 0, -1};
  cr_assert_eq(tdt_wait(tdt_fork(peer_wait, &a)), 0,
               "the consumer waited on an event whose exporter exited");
  a.key = "ev/b";
  cr_assert_eq(tdt_wait(tdt_fork(peer_wait, &a)), 0);
}

TDT_TEST(cuda, an_event_goes_from_its_key_when_its_producer_is_killed) {
  tdt_start(&d, NULL);
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  producer_arg pa = {d.sock, {"ev", NULL}, pfd[1]};
  pid_t pid = tdt_fork(producer, &pa);
  close(pfd[1]);
  char x;
  cr_assert_eq(read(pfd[0], &x, 1), 1, "the producer failed before pause()");
  close(pfd[0]);
  /* While the producer lives, its event is the key's: a consumer waits. */
  peer_arg a = {d.sock, "ev", 0, -1};
  cr_assert_eq(tdt_wait(tdt_fork(peer_wait, &a)), 0);
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  until_events_dropped(pid, 1);
  cr_assert_eq(tdt_wait(tdt_fork(peer_wait, &a)), 0,
               "the consumer waited on an event whose exporter was killed");
}

/* A key republished or unpublished no longer carries its old event, and
 * leaves its old publisher's list: that publisher's going drops nothing
 * (and touches no key that was freed). */
TDT_TEST(cuda, a_republish_or_unpublish_takes_the_event_off_the_key) {
  tdt_start(&d, NULL);
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  producer_arg pa = {d.sock, {"ev/a", "ev/b"}, pfd[1]};
  pid_t pid = tdt_fork(producer, &pa);
  close(pfd[1]);
  char x;
  cr_assert_eq(read(pfd[0], &x, 1), 1, "the producer failed before pause()");
  close(pfd[0]);
  td_client *c = tdt_connect(&d);
  td_storage *h;
  cr_assert_eq(td_unpublish(c, "ev/a"), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  cr_assert_eq(td_publish(c, "ev/b", h, NULL), 0, "%s", td_last_error(c));
  td_storage_release(h);
  kill(pid, SIGKILL);
  cr_assert_eq(tdt_wait(pid), 128 + SIGKILL);
  until_events_dropped(pid, 0);
  cr_assert_eq(td_lookup(c, "ev/b", TD_RDONLY, 0, &h, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(td_storage_device(h), TD_CPU);
  cr_assert_eq(td_storage_wait(h, NULL), 0);
  td_storage_release(h);
  cr_assert_eq(td_ping(c, NULL), 0, "the daemon serves on");
  td_close(c);
}

/* ---- many keys in one round trip (td_lookup_many) ---- */

#define MANY_GPU 8
#define MANY_VIEWS 50
#define MANY_KEYS (MANY_GPU + 2 + MANY_VIEWS)

static char many_buf[MANY_KEYS][32];
static const char *many_keys[MANY_KEYS];

/* Looks up the GPU storages g0.., the CPU storages c0 and c1 and the views
 * v0.. of g0 in one call: each has its bytes and view, read-only; and the
 * views share g0's mapping. */
static int many_child(void *p) {
  (void)p;
  td_client *c;
  CHECK(td_connect(d.sock, &c) == 0);
  static td_storage *s[MANY_KEYS];
  static td_view v[MANY_KEYS];
  int errs[MANY_KEYS];
  CHECK_ERR(
      c, td_lookup_many(c, many_keys, MANY_KEYS, TD_RDONLY, 0, s, v, errs), 0);
  for (size_t i = 0; i < MANY_KEYS; i++) {
    CHECK(errs[i] == 0 && td_storage_is_readonly(s[i]));
    const unsigned char *b = td_storage_data(s[i]);
    if (i < MANY_GPU) {
      CHECK(td_storage_device(s[i]) == TD_CUDA);
      CHECK(b[0] == i + 1 && b[td_storage_nbytes(s[i]) - 1] == i + 1);
    } else if (i < MANY_GPU + 2) {
      CHECK(td_storage_device(s[i]) == TD_CPU);
      CHECK(b[0] == 0xc0 + (i - MANY_GPU));
    } else {
      CHECK(td_storage_id(s[i]) == td_storage_id(s[0]));
      CHECK(td_storage_data(s[i]) == td_storage_data(s[0]));
      CHECK(v[i].offset == (int64_t)(i - MANY_GPU - 2));
    }
  }
  for (size_t i = 0; i < MANY_KEYS; i++)
    td_storage_release(s[i]);
  td_close(c);
  return 0;
}

/* Names the keys many_child looks up. */
static void many_names(void) {
  for (size_t i = 0; i < MANY_KEYS; i++) {
    if (i < MANY_GPU)
      snprintf(many_buf[i], sizeof(many_buf[i]), "g%zu", i);
    else if (i < MANY_GPU + 2)
      snprintf(many_buf[i], sizeof(many_buf[i]), "c%zu", i - MANY_GPU);
    else
      snprintf(many_buf[i], sizeof(many_buf[i]), "v%zu", i - MANY_GPU - 2);
    many_keys[i] = many_buf[i];
  }
}

/* Publishes the keys many_child looks up, runs it, and frees it all. The
 * child is forked, with the keys' names, before this process's first CUDA
 * call (the driver allows a child forked after it nothing). */
static void many_gpu_and_cpu(void) {
  many_names();
  pid_t peer = tdt_fork_held(many_child, NULL, 0);
  td_client *c = tdt_connect(&d);
  td_storage *s[MANY_GPU + 2];
  for (size_t i = 0; i < MANY_GPU + 2; i++) {
    int gpu = i < MANY_GPU;
    if (gpu)
      cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s[i]), 0, "%s",
                   td_last_error(c));
    else
      cr_assert_eq(td_storage_create(c, 4096, &s[i]), 0);
    memset(td_storage_data(s[i]), gpu ? (int)i + 1 : 0xc0 + (int)(i - MANY_GPU),
           td_storage_nbytes(s[i]));
    cr_assert_eq(td_publish(c, many_keys[i], s[i], NULL), 0, "%s",
                 td_last_error(c));
  }
  for (size_t j = 0; j < MANY_VIEWS; j++) {
    size_t i = MANY_GPU + 2 + j;
    int64_t shape[1] = {16};
    td_view v;
    cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape, &v), 0);
    v.offset = (int64_t)j;
    cr_assert_eq(td_publish(c, many_keys[i], s[0], &v), 0, "%s",
                 td_last_error(c));
  }
  cr_assert_eq(tdt_wait(tdt_go(peer)), 0);
  for (size_t i = 0; i < MANY_GPU + 2; i++)
    td_storage_release(s[i]);
  td_close(c);
}

TDT_TEST(cuda, lookup_many_attaches_gpu_and_cpu_keys_in_one_call) {
  tdt_start(&d, NULL);
  many_gpu_and_cpu();
}

/* Legacy handles travel in the items, with no fd. */
TDT_TEST(cuda, lookup_many_attaches_legacy_gpu_keys) {
  start_legacy();
  many_gpu_and_cpu();
}

/* ---- the recycling pool ---- */

/* The double's TDCUDA_CALL_LOG: "<pid> <call>" lines ("<pid> <call>
 * refused" for a call refused in a forked child). */

/* How many of pid's lines name call (NULL: any call). */
static int calls(pid_t pid, const char *call) {
  FILE *f = fopen(call_log, "r");
  if (f == NULL)
    return 0;
  /* A line at a time: some lines name more than a call
   * ("cuLaunchKernel td_copy_strided"). */
  int p, n = 0;
  char line[256], w[64];
  while (fgets(line, sizeof(line), f) != NULL)
    if (sscanf(line, "%d %63s", &p, w) == 2)
      n += p == (int)pid && (call == NULL || strcmp(w, call) == 0);
  fclose(f);
  return n;
}

/* Starts tensord with args and the double's call log. */
static void start_logged(const char *const *args) {
  snprintf(call_log, sizeof(call_log), "/tmp/tdt-calllog.%d", (int)getpid());
  unlink(call_log);
  setenv("TDCUDA_CALL_LOG", call_log, 1);
  tdt_start(&d, args);
}

static void end_logged(void) {
  unsetenv("TDCUDA_CALL_LOG");
  unlink(call_log);
}

/* The pool as the daemon counts it on this process's cuda:0. */
static uint8_t pool_uuid[16];
static uint64_t pool_want;

static td_device_stat pool_stat(const tdt_daemon *dd) {
  td_client *c = tdt_connect(dd);
  td_device_stat g = gpu_stat(c, pool_uuid);
  td_close(c);
  return g;
}

static int pool_has_want(const tdt_daemon *dd) {
  return pool_stat(dd).pool_allocs == pool_want;
}

/* Waits until the daemon's pool on pool_uuid holds n allocations. */
static void pool_is(uint64_t n) {
  pool_want = n;
  cr_assert(tdt_until(pool_has_want, &d, 10000),
            "the pool holds %llu allocation(s), not %llu",
            (unsigned long long)pool_stat(&d).pool_allocs,
            (unsigned long long)n);
}

TDT_TEST(cuda, a_pooled_create_and_attach_makes_no_allocation_and_no_import) {
  start_logged(NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 3 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_device_uuid(s, pool_uuid), 0);
  memset(td_storage_data(s), 0x5c, 3 * MiB); /* the double's memory is ours */
  td_storage_release(s);
  pool_is(1);
  td_device_stat g = pool_stat(&d);
  cr_assert_eq(g.pool_bytes, 4 * MiB);
  cr_assert_eq(g.bytes_used, 0);
  cr_assert_eq(g.storages, 0);
  int imports = calls(getpid(), "cuMemImportFromShareableHandle");
  cr_assert_eq(imports, 1);
  cr_assert_eq(calls(d.pid, "cuMemCreate"), 1);

  /* The same uid, GPU and rounded size: the pooled allocation serves it. */
  cr_assert_eq(tdt_create_cuda(c, 0, 4 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(calls(d.pid, "cuMemCreate"), 1, "the daemon made a fresh one");
  cr_assert_eq(calls(getpid(), "cuMemImportFromShareableHandle"), imports,
               "the client imported the recycled allocation again");
  /* Still zeroed, as a recycled CPU segment is (the client clears it). */
  const unsigned char *b = td_storage_data(s);
  for (size_t i = 0; i < 4 * MiB; i += 4093)
    cr_assert_eq(b[i], 0, "byte %zu of a recycled storage is %u", i, b[i]);
  g = pool_stat(&d);
  cr_assert_eq(g.pool_allocs, 0);
  cr_assert_eq(g.bytes_used, 4 * MiB);
  /* Another size is another class: a fresh allocation. */
  td_storage *t;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &t), 0, "%s", td_last_error(c));
  cr_assert_eq(calls(d.pid, "cuMemCreate"), 2);
  td_storage_release(t);
  td_storage_release(s);
  td_close(c);
  pool_is(2);
  end_logged();
}

TDT_TEST(cuda, pooled_bytes_count_against_the_capacity) {
  start_logged((const char *const[]){"--cuda-capacity", "0=8M",
                                     "--cuda-recycle-bytes", "8M", NULL});
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 4 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_device_uuid(s, pool_uuid), 0);
  td_storage_release(s);
  pool_is(1);
  /* 8 MiB fit only once the pooled 4 MiB give way. */
  cr_assert_eq(tdt_create_cuda(c, 0, 8 * MiB, &s), 0, "%s", td_last_error(c));
  td_device_stat g = pool_stat(&d);
  cr_assert_eq(g.pool_allocs, 0, "the pool kept its allocation");
  cr_assert_eq(g.bytes_used, 8 * MiB);
  cr_assert_eq(calls(d.pid, "cuMemRelease"), 1);
  /* A pooled allocation is charged: with 8 MiB pooled nothing else fits
   * beside a live storage, so 2 MiB more evicts it. */
  td_storage_release(s);
  pool_is(1);
  cr_assert_eq(pool_stat(&d).pool_bytes, 8 * MiB);
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  g = pool_stat(&d);
  cr_assert_eq(g.pool_bytes, 0);
  cr_assert_eq(g.bytes_used, 2 * MiB);
  td_storage_release(s);
  td_close(c);
  end_logged();
}

/* Whether the daemon has released release_want allocations. */
static int release_want;
static int released_want(const tdt_daemon *dd) {
  return calls(dd->pid, "cuMemRelease") == release_want;
}

TDT_TEST(cuda, pooled_allocations_age_out_and_none_outlive_tensord) {
  start_logged((const char *const[]){"--recycle-idle", "300", NULL});
  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_device_uuid(s, pool_uuid), 0);
  td_storage_release(s);
  pool_is(1);
  pool_is(0); /* aged out */
  /* The ager takes it out of the pool, then releases it: a moment after
   * the pool's figures say so. */
  release_want = 1;
  cr_assert(tdt_until(released_want, &d, 5000), "%d release(s), not 1",
            calls(d.pid, "cuMemRelease"));
  /* At the stop, everything pooled is released. */
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_create_cuda(c, 0, 4 * MiB, &t), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_storage_release(t);
  td_close(c);
  pool_is(2);
  pid_t pid = d.pid;
  tdt_stop(&d);
  cr_assert_eq(calls(pid, "cuMemCreate"), 3);
  cr_assert_eq(calls(pid, "cuMemRelease"), 3,
               "tensord exited holding pooled allocations");
  end_logged();
}

#define UID_A 4311
#define UID_B 4312

typedef struct pool_job {
  uid_t uid;
  unsigned flags;
  int fill;   /* written to every byte, or -1 */
  int expect; /* every byte read first, or -1 */
} pool_job;

/* As uid j->uid: creates 2 MiB on cuda:0 (never touched by the parent, so
 * the driver is fresh here), checks and fills it, releases it. */
static int as_uid(void *arg) {
  const pool_job *j = arg;
  if (setgroups(0, NULL) < 0 || setgid(j->uid) < 0 || setuid(j->uid) < 0)
    return 2;
  td_client *c = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  td_create_opts o = {0};
  o.nbytes = 2 * MiB;
  o.device = TD_CUDA;
  o.flags = j->flags;
  td_storage *s;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &s), 0);
  unsigned char *b = td_storage_data(s);
  for (size_t i = 0; j->expect >= 0 && i < 2 * MiB; i++)
    CHECK(b[i] == (unsigned char)j->expect);
  if (j->fill >= 0)
    memset(b, j->fill, 2 * MiB);
  td_storage_release(s);
  td_close(c);
  return 0;
}

static void run_as(pool_job j) {
  int st = tdt_wait(tdt_fork(as_uid, &j));
  cr_assert_eq(st, 0, "job as uid %u exited %d", (unsigned)j.uid, st);
}

TDT_TEST(cuda, pooled_device_memory_never_crosses_uids) {
  if (geteuid() != 0)
    cr_skip_test("switching identities needs root");
  start_logged((const char *const[]){"--socket-mode", "0666", NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  memcpy(pool_uuid, "tdcudadouble", 12); /* device 0's (tests/cuda/README) */
  memset(pool_uuid + 12, 0, 4);
  run_as((pool_job){.uid = UID_A, .fill = 0xa1, .expect = -1});
  pool_is(1);
  /* B asks for uninitialised bytes of the size A's pooled allocation has:
   * it must get a fresh one, never A's. */
  run_as(
      (pool_job){.uid = UID_B, .flags = TD_UNINIT, .fill = 0xb2, .expect = -1});
  cr_assert_eq(calls(d.pid, "cuMemCreate"), 2, "uid B was served A's memory");
  pool_is(2);
  /* Each gets its own back, as it left it (TD_UNINIT). */
  run_as(
      (pool_job){.uid = UID_A, .flags = TD_UNINIT, .fill = -1, .expect = 0xa1});
  run_as(
      (pool_job){.uid = UID_B, .flags = TD_UNINIT, .fill = -1, .expect = 0xb2});
  cr_assert_eq(calls(d.pid, "cuMemCreate"), 2);
  end_logged();
}

/* A client's warm mapping is known by the daemon instance, the allocation's
 * identity and the exported file: another daemon's allocation 1 is never
 * taken for it. */
TDT_TEST(cuda, a_warm_mapping_never_serves_another_daemons_allocation) {
  start_logged(NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  memset(td_storage_data(s), 0x77, 2 * MiB);
  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
  tdt_start(&d, NULL);
  c = tdt_connect(&d);
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(calls(getpid(), "cuMemImportFromShareableHandle"), 2,
               "the first daemon's mapping served the second's allocation");
  const unsigned char *b = td_storage_data(s);
  for (size_t i = 0; i < 2 * MiB; i += 4093)
    cr_assert_eq(b[i], 0);
  td_storage_release(s);
  td_close(c);
  end_logged();
}

/* ---- sticky errors ---- */

/* In a process of its own: maps a storage, then its context on cuda:0
 * faults (tdcudaDoubleFault: a kernel of the program's writing out of
 * bounds). Every later CUDA call of the library there fails TD_EIO, saying
 * that the context is unusable; releasing still gives the references back. */
static int faulting_client(void *p) {
  const char *sock = p;
  td_client *c;
  td_storage *s, *t;
  CHECK(td_connect(sock, &c) == 0);
  CHECK_ERR(c, tdt_create_cuda(c, 0, 2 * MiB, &s), 0);
  CHECK_ERR(c, td_publish(c, "pre-fault", s, NULL), 0);
  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW | RTLD_NOLOAD);
  CHECK(lib != NULL);
  CUresult (*get)(CUdevice *, int), (*retain)(CUcontext *, CUdevice),
      (*push)(CUcontext), (*pop)(CUcontext *), (*release)(CUdevice),
      (*fault)(void);
  *(void **)&get = dlsym(lib, "cuDeviceGet");
  *(void **)&retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&push = dlsym(lib, "cuCtxPushCurrent_v2");
  *(void **)&pop = dlsym(lib, "cuCtxPopCurrent_v2");
  *(void **)&release = dlsym(lib, "cuDevicePrimaryCtxRelease_v2");
  *(void **)&fault = dlsym(lib, "tdcudaDoubleFault");
  CHECK(get && retain && push && pop && release && fault);
  CUdevice dev;
  CUcontext ctx;
  CHECK(get(&dev, 0) == CUDA_SUCCESS);
  CHECK(retain(&ctx, dev) == CUDA_SUCCESS);
  CHECK(push(ctx) == CUDA_SUCCESS);
  CHECK(fault() == CUDA_SUCCESS);
  CHECK(pop(&ctx) == CUDA_SUCCESS);

  td_view v;
  CHECK(td_view_contiguous(TD_UINT8, 1, (int64_t[]){4096}, &v) == 0);
  td_storage *h;
  CHECK_ERR(c, td_storage_create(c, 4096, &h), 0);
  int err = td_copy(s, &v, h, &v);
  if (err != TD_EIO || strstr(td_view_last_error(), "unusable") == NULL ||
      strstr(td_view_last_error(), "CUDA_ERROR_ILLEGAL_ADDRESS") == NULL) {
    fprintf(stderr, "td_copy after the fault: %d: %s\n", err,
            td_view_last_error());
    return 1;
  }
  /* A new storage: the daemon makes it, this process cannot map it, and
   * the reference it was given goes back. */
  CHECK_ERR(c, tdt_create_cuda(c, 0, 2 * MiB, &t), TD_EIO);
  CHECK_MSG(c, "unusable");
  /* Another GPU's context is not this one. */
  CHECK_ERR(c, tdt_create_cuda(c, 1, 2 * MiB, &t), 0);
  td_storage_release(t);
  td_storage_release(h);
  td_storage_release(s);
  CHECK_ERR(c, td_unpublish(c, "pre-fault"), 0);
  td_close(c);
  release(dev);
  return 0;
}

/* A fault in one process's context ends that process's use of the GPU and
 * nothing else: its references come back, the daemon and other processes
 * go on using the same GPU. */
TDT_TEST(cuda, a_sticky_fault_in_one_process_leaves_the_others_working) {
  tdt_start(&d, NULL);
  /* Forked before this process touches CUDA, as the driver requires. */
  cr_assert_eq(tdt_wait(tdt_fork(faulting_client, (void *)d.sock)), 0);
  cr_assert_eq(tdt_storages(&d), 0, "the faulted process's storages stay");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, (int64_t[]){4096}, &v), 0);
  td_storage *h;
  cr_assert_eq(td_storage_create(c, 4096, &h), 0);
  memset(td_storage_data(h), 0x3d, 4096);
  cr_assert_eq(td_copy(s, &v, h, &v), 0, "%s", td_view_last_error());
  cr_assert_eq(((unsigned char *)td_storage_data(s))[4095], 0x3d);
  td_storage_release(h);
  td_storage_release(s);
  td_close(c);
}

/* ---- the GPU's memory is everyone's ---- */

typedef struct {
  size_t bytes;
  int ready;  /* write end: a byte once the memory is held */
  int done;   /* read end: its write end closed when it may exit */
  int done_w; /* that write end, which the hog closes at once */
} hog_arg;

/* Another program on the GPU: holds bytes of cuda:0 through the driver
 * itself, until told to go. */
static int gpu_hog(void *p) {
  hog_arg *a = p;
  close(a->done_w);
  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW);
  CHECK(lib != NULL);
  CUresult (*init)(unsigned), (*get)(CUdevice *, int),
      (*retain)(CUcontext *, CUdevice), (*push)(CUcontext),
      (*create)(CUmemGenericAllocationHandle *, size_t,
                const CUmemAllocationProp *, unsigned long long);
  *(void **)&init = dlsym(lib, "cuInit");
  *(void **)&get = dlsym(lib, "cuDeviceGet");
  *(void **)&retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&push = dlsym(lib, "cuCtxPushCurrent_v2");
  *(void **)&create = dlsym(lib, "cuMemCreate");
  CHECK(init && get && retain && push && create);
  CUdevice dev;
  CUcontext ctx;
  CHECK(init(0) == CUDA_SUCCESS && get(&dev, 0) == CUDA_SUCCESS);
  CHECK(retain(&ctx, dev) == CUDA_SUCCESS && push(ctx) == CUDA_SUCCESS);
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUmemGenericAllocationHandle h;
  CHECK(create(&h, a->bytes, &prop, 0) == CUDA_SUCCESS);
  CHECK(write(a->ready, "x", 1) == 1);
  char c;
  CHECK(read(a->done, &c, 1) == 0);
  return 0; /* the driver frees what it held */
}

/* A GPU that another program filled: tensord's create fails with the
 * driver's out-of-memory and says how the GPU's memory stands; its pool
 * gives way before a create fails; and the memory is tensord's again once
 * the other program exits. */
TDT_TEST(cuda, a_gpu_filled_by_another_program_is_out_of_memory_for_tensord) {
  snprintf(mem_dir, sizeof(mem_dir), "/tmp/tdt-gpumem.XXXXXX");
  cr_assert_not_null(mkdtemp(mem_dir));
  setenv("TDCUDA_STATE_DIR", mem_dir, 1);
  setenv("TDCUDA_MEM", "16M", 1);
  tdt_start(&d, NULL);
  int ready[2], done[2];
  cr_assert_eq(pipe(ready), 0);
  cr_assert_eq(pipe(done), 0);
  hog_arg a = {12 * MiB, ready[1], done[0], done[1]};
  pid_t hog = tdt_fork(gpu_hog, &a);
  close(ready[1]);
  close(done[0]);
  char ch;
  cr_assert_eq(read(ready[0], &ch, 1), 1, "the other program got no memory");

  td_client *c = tdt_connect(&d);
  td_storage *s, *t;
  cr_assert_eq(tdt_create_cuda(c, 0, 8 * MiB, &s), TD_ENOMEM);
  const char *m = td_last_error(c);
  cr_assert(strstr(m, "cuda:0 (GPU-") != NULL &&
                strstr(m, "CUDA_ERROR_OUT_OF_MEMORY") != NULL &&
                strstr(m, "4.0 MiB free of 16.0 MiB") != NULL &&
                strstr(m, "other processes hold the rest") != NULL,
            "message: %s", m);

  /* 2 MiB fits; released, it waits in the pool, where a 4 MiB storage
   * cannot use it and the GPU has no room beside it: the pool gives way. */
  cr_assert_eq(tdt_create_cuda(c, 0, 2 * MiB, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  cr_assert_eq(tdt_create_cuda(c, 0, 4 * MiB, &t), 0, "%s", td_last_error(c));
  cr_assert(tdt_log_has(&d, "released 1 pooled allocation(s)"));
  td_storage_release(t);

  close(done[1]);
  cr_assert_eq(tdt_wait(hog), 0);
  close(ready[0]);
  cr_assert_eq(tdt_create_cuda(c, 0, 14 * MiB, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  tdt_stop(&d);
  unsetenv("TDCUDA_STATE_DIR");
  unsetenv("TDCUDA_MEM");
}

/* A release and then a create at the capacity, back to back on one
 * connection: the release is queued to a thread ahead of the create, which
 * waits for its bytes rather than fail (with or without the pool). */
static void release_then_create(const char *const *args) {
  tdt_start(&d, args);
  td_client *c = tdt_connect(&d);
  td_storage *a, *b;
  cr_assert_eq(tdt_create_cuda(c, 0, 8 * MiB, &a), 0, "%s", td_last_error(c));
  for (int i = 0; i < 50; i++) {
    td_storage_release(a);
    /* Another size, so that the pool cannot serve it. */
    cr_assert_eq(tdt_create_cuda(c, 0, (size_t)(i % 2 ? 8 : 6) * MiB, &a), 0,
                 "round %d: %s", i, td_last_error(c));
  }
  cr_assert_eq(tdt_create_cuda(c, 0, 4 * MiB, &b), TD_ENOMEM,
               "the capacity is not full");
  td_storage_release(a);
  td_close(c);
}

TDT_TEST(cuda, a_create_waits_for_the_release_queued_before_it) {
  release_then_create((const char *const[]){
      "--cuda-capacity", "0=8M", "--cuda-recycle-bytes", "8M", NULL});
}

TDT_TEST(cuda, a_create_waits_for_the_release_queued_before_it_unpooled) {
  release_then_create((const char *const[]){"--cuda-capacity", "0=8M",
                                            "--cuda-recycle-bytes", "0", NULL});
}

/* ---- fork ---- */

typedef struct fork_arg {
  const char *sock;
  pid_t parent;
  td_storage *inherited; /* the parent's, mapped before the fork */
  td_client *pc;         /* the parent's client, holding it */
} fork_arg;

/* Whether msg names this process and its parent as a fork() child. */
static int names_the_fork(const char *msg, pid_t parent) {
  char self[64], par[64];
  snprintf(self, sizeof(self), "this process (pid %d)", (int)getpid());
  snprintf(par, sizeof(par), "fork() child of pid %d", (int)parent);
  return strstr(msg, self) != NULL && strstr(msg, par) != NULL &&
         strstr(msg, "initialised CUDA") != NULL;
}

/* In a child forked after its parent used CUDA: its own client attaches
 * and creates nothing on a GPU, with TD_EFORKED and a message naming both
 * processes; the storage and client it inherited are released without a
 * driver call; CPU storages still work. */
static int forked_child_may_not_use_cuda(void *p) {
  fork_arg *a = p;
  td_client *c;
  td_storage *s = NULL;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, "g", 0, 0, &s, NULL), TD_EFORKED);
  CHECK(s == NULL);
  CHECK(strstr(td_last_error(c), "CUDA storage ") != NULL);
  CHECK(names_the_fork(td_last_error(c), a->parent));
  CHECK_ERR(c, tdt_create_cuda(c, 0, 1 * MiB, &s), TD_EFORKED);
  CHECK(names_the_fork(td_last_error(c), a->parent));
  /* td_copy into the inherited mapping is refused too. */
  td_storage *h;
  CHECK_ERR(c, td_storage_create(c, 1 * MiB, &h), 0);
  memset(td_storage_data(h), 3, 1 * MiB);
  int64_t n = (int64_t)MiB;
  td_view v;
  CHECK(td_view_contiguous(TD_UINT8, 1, &n, &v) == 0);
  CHECK(td_copy(a->inherited, &v, h, &v) == TD_EFORKED);
  CHECK(names_the_fork(td_view_last_error(), a->parent));
  td_storage_release(h);
  /* Nothing asked of the daemon is left held. */
  td_storage *cpu;
  CHECK_ERR(c, td_lookup(c, "cpu", 0, 0, &cpu, NULL), 0);
  CHECK(((unsigned char *)td_storage_data(cpu))[0] == 8);
  td_storage_release(cpu);
  CHECK(td_storage_release(a->inherited) == 0);
  td_close(c);
  td_close(a->pc); /* the parent's: the child's copy of its socket only */
  return 0;
}

TDT_TEST(cuda,
         a_child_forked_after_cuda_use_is_refused_cuda_and_releases_quietly) {
  start_logged(NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s, *cpu;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  ((unsigned char *)td_storage_data(s))[0] = 7;
  cr_assert_eq(td_publish(c, "g", s, NULL), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_create(c, 64, &cpu), 0, "%s", td_last_error(c));
  ((unsigned char *)td_storage_data(cpu))[0] = 8;
  cr_assert_eq(td_publish(c, "cpu", cpu, NULL), 0, "%s", td_last_error(c));
  int before = calls(getpid(), NULL);
  cr_assert_gt(before, 0, "the double logged nothing of this process");
  fork_arg a = {d.sock, getpid(), s, c};
  pid_t pid = tdt_fork(forked_child_may_not_use_cuda, &a);
  cr_assert_eq(tdt_wait(pid), 0);
  cr_assert_eq(calls(pid, NULL), 0,
               "the forked child called the driver %d time(s)",
               calls(pid, NULL));
  /* The parent's storage and mapping are as they were. */
  cr_assert_eq(((unsigned char *)td_storage_data(s))[0], 7);
  cr_assert_eq(tdt_storages(&d), 2,
               "the child's refused lookup kept a "
               "reference, or its release dropped ours");
  cr_assert_eq(td_unpublish(c, "g"), 0);
  cr_assert_eq(td_unpublish(c, "cpu"), 0);
  td_storage_release(cpu);
  td_storage_release(s);
  td_close(c);
  end_logged();
}

/* The double refuses a forked child every call, cuInit included: what it
 * logs is what the child asked. */
static int child_asks_the_driver(void *p) {
  fork_arg *a = p;
  td_client *c;
  td_storage *s = NULL;
  CHECK(td_connect(a->sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, "g", 0, 0, &s, NULL), TD_EFORKED);
  td_close(c);
  /* The driver's answer, asked directly through the inherited library. */
  void *lib = dlopen(getenv("TENSORD_CUDA_DRIVER"), RTLD_NOW | RTLD_NOLOAD);
  CHECK(lib != NULL);
  CUresult (*init)(unsigned);
  *(void **)&init = dlsym(lib, "cuInit");
  CHECK(init != NULL && init(0) == CUDA_ERROR_NOT_INITIALIZED);
  dlclose(lib);
  return 0;
}

TDT_TEST(cuda, the_double_refuses_a_forked_child_as_the_driver_does) {
  start_logged(NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(tdt_create_cuda(c, 0, 1 * MiB, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_publish(c, "g", s, NULL), 0, "%s", td_last_error(c));
  fork_arg a = {d.sock, getpid(), NULL, NULL};
  pid_t pid = tdt_fork(child_asks_the_driver, &a);
  cr_assert_eq(tdt_wait(pid), 0);
  cr_assert_eq(calls(pid, "cuInit"), 1, "the refused cuInit is not logged");
  cr_assert_eq(calls(pid, NULL), 1,
               "libtensord called the driver in the "
               "child");
  cr_assert_eq(td_unpublish(c, "g"), 0);
  td_storage_release(s);
  td_close(c);
  end_logged();
}

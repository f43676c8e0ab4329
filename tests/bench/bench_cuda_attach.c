/* bench_cuda_attach.c: what it costs a process to attach a model's worth of
 * GPU tensors (issue 10: "attaching a 1,000-tensor state dict on a GPU in
 * under 100 ms"), and how much of it is the driver.
 *
 * Set-up. A producer process makes the tensors of a model-like state dict:
 * N = 1,000 bfloat16 tensors (--quick: 250) of mixed sizes, 4 KiB to 16 MiB,
 * about 1.1 GiB in all (--quick: about 290 MiB), laid out 256-byte aligned,
 * and publishes them three ways:
 *   (a) views   ONE CUDA storage holding every tensor, and one key per
 *               tensor: N published views of one storage.
 *   (b) packed  the same kind of storage under ONE key, plus a manifest (a
 *               small CPU storage under a second key: offset, dtype and
 *               shape of each tensor), as tensord.torch's publish_state_dict
 *               packs a state dict on the CPU.
 *   (c) separate  N CUDA storages, one per tensor, one key each (each
 *               rounded up to the device's 2 MiB granularity): the contrast.
 *
 * What is measured. A consumer process, with its own td_client, attaches
 * every tensor: the time from its first td_lookup until it holds, for all N
 * tensors, a device pointer and a checked view.
 *   (a) N lookups (TD_RDONLY) and td_storage_data of each;
 *   (b) 2 lookups (the storage, the manifest), then N td_view_contiguous +
 *       td_view_check from the manifest's records;
 *   (c) N lookups (TD_RDONLY) and td_storage_data of each.
 * Then it releases every handle (the last one unmaps) and waits for the reply
 * to one more request (td_stat_get), so that the daemon has handled the
 * releases, which libtensord sends without waiting: timed as "detach". So
 * every repetition attaches from nothing, with nothing queued before it. The
 * cases are interleaved round by round (a, b, c, a, b, c, ...) after one
 * warm-up round that is not recorded (one per pass: see "CPUs").
 *
 * Driver time. The consumer wraps the table of driver entry points that
 * libtensord calls (td__cu_load's, in this process): every call tensord makes
 * into the driver (import, reserve, map, set access, context push/pop, the
 * device look-up by UUID, and their undoing) adds its time to a counter. A
 * row's "driver" is that counter's share of the attach; "bookkeeping" is the
 * rest: round trips to tensord, the mapping cache, handles, views.
 *
 * The consumer retains cuda:0's primary context for the whole run, as
 * a process that computes on the GPU (PyTorch) does; otherwise the release of
 * its last mapping would destroy the context and each attach would pay its
 * creation again (a real driver's context costs 100s of ms). What loading
 * the driver, retaining that context and the process's first attach (the
 * warm-up) cost is printed once.
 *
 * CPUs. On this kind of VM a round trip costs a few us when tensord and the
 * consumer share a CPU (a context switch) and tens of us, varying from run
 * to run, when they do not (a wake-up of an idle vCPU), and unpinned
 * processes land either way; so tensord and the producer are pinned to one
 * CPU, and the consumer runs every round twice over: a pass on tensord's CPU,
 * then a pass on another (where the process may use two).
 *
 * Driver. With $TENSORD_CUDA_DRIVER unset, a child process tries the real
 * driver (libcuda.so.1, cuInit, at least one device); where none loads, the
 * bench sets TENSORD_CUDA_DRIVER to the driver's test double
 * (build/tests/cuda/libtdcuda_double.so) and TDCUDA_MEM to 8G (the double's
 * memory is sparse host memory: nothing is written, so little is used), and
 * says "DRIVER: test double". The double's "driver time" is its memfd dup,
 * mmap and mprotect: it proves the protocol and the bookkeeping, not what a
 * GPU's driver costs.
 *
 * Daemon. The driver must be chosen in the daemon's environment, so this
 * bench starts its own tensord (on a temporary socket, SIGTERM at the end)
 * and ignores the socket run.sh passes; nothing is forked after a process
 * has loaded the driver (CUDA's fork rule).
 *
 * Columns: p50 and p99 in ms over the recorded rounds (nearest rank; with
 * fewer than 100 rounds p99 is the maximum), the driver's p50 share, the
 * bookkeeping's p50, driver calls per attach, us per tensor, and p50 over
 * (b)'s p50.
 *
 * Usage: bench_cuda_attach [SOCKET] [--quick]. $TD_BENCH_SCALE scales the
 * number of rounds (30 by default, at least 3). */
#include "bench.h"

#include "driver.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXN 1000
#define MAXROUNDS 400
#define ALIGN 256
#define DTYPE TD_BFLOAT16
#define ESIZE 2
#define KEYS "bench/cuattach"
#define NPASSES 2

enum { CASE_A, CASE_B, CASE_C, NCASES };
static const char *const case_name[NCASES] = {"(a) views: N keys, 1 storage",
                                              "(b) packed: 1 key + manifest",
                                              "(c) separate: N storages"};

/* One tensor of the state dict, and its manifest record in (b). */
typedef struct tensor {
  uint64_t offset; /* bytes, in the packed storage */
  uint64_t nbytes;
  int32_t dtype, ndim;
  int64_t shape[2];
} tensor;

/* What the consumer measured, in memory shared with the parent. */
typedef struct results {
  char driver[200];
  int n, rounds;
  uint64_t total_bytes, packed_bytes, separate_bytes;
  uint64_t load_ns;                /* td__cu_load in the consumer */
  uint64_t ctx_ns;                 /* its cuDevicePrimaryCtxRetain */
  uint64_t first_ns, first_drv_ns; /* the warm-up (a) attach */
  uint64_t setup_ns[NCASES];       /* the producer's creates and publishes */
  int passes, cpu[NPASSES];        /* the consumer's CPU in each pass */
  int daemon_cpu;
  uint64_t attach[NPASSES][NCASES][MAXROUNDS], drv[NPASSES][NCASES][MAXROUNDS];
  uint64_t detach[NPASSES][NCASES][MAXROUNDS], ddrv[NPASSES][NCASES][MAXROUNDS];
  uint64_t calls[NCASES];
} results;

static results *res;
static tensor tensors[MAXN];
static int n_tensors;
static char sock[256];

/* ---- the state dict ---- */

/* A layer of ten tensors, 4 KiB .. 4 MiB (10.3 MiB); every tenth layer has a
 * 16 MiB one in place of its last. */
static const uint64_t layer[10] = {4u << 10,  4u << 10,   8u << 10, 16u << 10,
                                   64u << 10, 256u << 10, 1u << 20, 2u << 20,
                                   3u << 20,  4u << 20};

static uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

static void make_state_dict(int n) {
  uint64_t off = 0;
  n_tensors = n;
  for (int i = 0; i < n; i++) {
    tensor *t = &tensors[i];
    t->nbytes = layer[i % 10];
    if (i % 100 == 9)
      t->nbytes = 16u << 20;
    t->dtype = DTYPE;
    if (t->nbytes >= (1u << 20)) {
      t->ndim = 2;
      t->shape[1] = 1024;
      t->shape[0] = (int64_t)(t->nbytes / ESIZE / 1024);
    } else {
      t->ndim = 1;
      t->shape[0] = (int64_t)(t->nbytes / ESIZE);
      t->shape[1] = 0;
    }
    t->offset = off;
    off = align_up(off + t->nbytes, ALIGN);
  }
  res->n = n;
  res->packed_bytes = off;
  res->total_bytes = 0;
  res->separate_bytes = 0;
  for (int i = 0; i < n; i++) {
    res->total_bytes += tensors[i].nbytes;
    res->separate_bytes += align_up(tensors[i].nbytes, 2u << 20);
  }
}

static void view_of(const tensor *t, td_view *v) {
  if (td_view_contiguous((td_dtype)t->dtype, t->ndim, t->shape, v) < 0)
    bench_die("td_view_contiguous: %s", td_view_last_error());
  v->offset = (int64_t)(t->offset / ESIZE);
}

static void key_of(char *buf, size_t len, int c, int i) {
  snprintf(buf, len, KEYS "/%c/%04d", "abc"[c], i);
}

/* ---- timing the driver ---- */

static uint64_t drv_ns, drv_calls;
static td__cu orig;

#define TIMED(call)                                                            \
  do {                                                                         \
    uint64_t t0_ = bench_now_ns();                                             \
    CUresult r_ = (call);                                                      \
    drv_ns += bench_now_ns() - t0_;                                            \
    drv_calls++;                                                               \
    return r_;                                                                 \
  } while (0)

static CUresult w_DeviceGetCount(int *n) {
  TIMED(orig.DeviceGetCount(n));
}
static CUresult w_DeviceGet(CUdevice *d, int i) {
  TIMED(orig.DeviceGet(d, i));
}
static CUresult w_DeviceGetUuid(CUuuid *u, CUdevice d) {
  TIMED(orig.DeviceGetUuid(u, d));
}
static CUresult w_DevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  TIMED(orig.DevicePrimaryCtxRetain(c, d));
}
static CUresult w_DevicePrimaryCtxRelease(CUdevice d) {
  TIMED(orig.DevicePrimaryCtxRelease(d));
}
static CUresult w_CtxPushCurrent(CUcontext c) {
  TIMED(orig.CtxPushCurrent(c));
}
static CUresult w_CtxPopCurrent(CUcontext *c) {
  TIMED(orig.CtxPopCurrent(c));
}
static CUresult w_MemImportFromShareableHandle(CUmemGenericAllocationHandle *h,
                                               void *s,
                                               CUmemAllocationHandleType t) {
  TIMED(orig.MemImportFromShareableHandle(h, s, t));
}
static CUresult w_MemAddressReserve(CUdeviceptr *p, size_t n, size_t a,
                                    CUdeviceptr addr, unsigned long long f) {
  TIMED(orig.MemAddressReserve(p, n, a, addr, f));
}
static CUresult w_MemAddressFree(CUdeviceptr p, size_t n) {
  TIMED(orig.MemAddressFree(p, n));
}
static CUresult w_MemMap(CUdeviceptr p, size_t n, size_t o,
                         CUmemGenericAllocationHandle h, unsigned long long f) {
  TIMED(orig.MemMap(p, n, o, h, f));
}
static CUresult w_MemUnmap(CUdeviceptr p, size_t n) {
  TIMED(orig.MemUnmap(p, n));
}
static CUresult w_MemSetAccess(CUdeviceptr p, size_t n,
                               const CUmemAccessDesc *d, size_t k) {
  TIMED(orig.MemSetAccess(p, n, d, k));
}
static CUresult w_MemRelease(CUmemGenericAllocationHandle h) {
  TIMED(orig.MemRelease(h));
}

/* Loads the driver in this process and routes the calls libtensord makes
 * through the timed wrappers above. td__cu_load returns the one table of the
 * process (a static, non-const object in driver.c), which libtensord reads
 * at every call. */
static const td__cu *load_and_wrap(void) {
  char msg[256];
  uint64_t t0 = bench_now_ns();
  const td__cu *cu = td__cu_load(msg, sizeof(msg));
  res->load_ns = bench_now_ns() - t0;
  if (cu == NULL)
    bench_die("consumer: %s", msg);
  orig = *cu;
  td__cu *w = (td__cu *)cu;
  w->DeviceGetCount = w_DeviceGetCount;
  w->DeviceGet = w_DeviceGet;
  w->DeviceGetUuid = w_DeviceGetUuid;
  w->DevicePrimaryCtxRetain = w_DevicePrimaryCtxRetain;
  w->DevicePrimaryCtxRelease = w_DevicePrimaryCtxRelease;
  w->CtxPushCurrent = w_CtxPushCurrent;
  w->CtxPopCurrent = w_CtxPopCurrent;
  w->MemImportFromShareableHandle = w_MemImportFromShareableHandle;
  w->MemAddressReserve = w_MemAddressReserve;
  w->MemAddressFree = w_MemAddressFree;
  w->MemMap = w_MemMap;
  w->MemUnmap = w_MemUnmap;
  w->MemSetAccess = w_MemSetAccess;
  w->MemRelease = w_MemRelease;
  return cu;
}

/* ---- the producer ---- */

typedef struct proc_arg {
  int rd, wr; /* pipes to and from the other process */
} proc_arg;

static void wait_byte(int fd, const char *who) {
  char b;
  if (bench_read_full(fd, &b, 1) != 1)
    bench_die("%s: the other process ended early", who);
}

static void send_byte(int fd) {
  char b = 1;
  bench_write_full(fd, &b, 1);
}

static td_storage *create_cuda(td_client *c, uint64_t nbytes) {
  td_create_opts o;
  memset(&o, 0, sizeof(o));
  o.nbytes = nbytes;
  o.device = TD_CUDA;
  o.flags = TD_UNINIT; /* attach cost only: nothing reads the bytes */
  td_storage *s;
  int err = td_storage_create_ex(c, &o, &s);
  if (err < 0)
    bench_die("producer: create of %llu bytes on cuda:0: %s (%s)",
              (unsigned long long)nbytes, td_strerror(err), td_last_error(c));
  return s;
}

static void publish(td_client *c, const char *key, td_storage *s,
                    const td_view *v) {
  int err = td_publish(c, key, s, v);
  if (err < 0)
    bench_die("producer: publish %s: %s (%s)", key, td_strerror(err),
              td_last_error(c));
}

static int producer(void *arg) {
  const proc_arg *a = arg;
  td_client *c = bench_connect(sock);
  char key[64];
  td_view v;
  /* (a): one storage, a key per tensor. */
  uint64_t t0 = bench_now_ns();
  td_storage *sa = create_cuda(c, res->packed_bytes);
  for (int i = 0; i < n_tensors; i++) {
    view_of(&tensors[i], &v);
    key_of(key, sizeof(key), CASE_A, i);
    publish(c, key, sa, &v);
  }
  res->setup_ns[CASE_A] = bench_now_ns() - t0;
  /* (b): one storage under one key, and the manifest on the CPU. */
  t0 = bench_now_ns();
  td_storage *sb = create_cuda(c, res->packed_bytes);
  td_storage *m;
  int err = td_storage_create(c, sizeof(tensors[0]) * (size_t)n_tensors, &m);
  if (err < 0)
    bench_die("producer: manifest: %s (%s)", td_strerror(err),
              td_last_error(c));
  memcpy(td_storage_data(m), tensors, sizeof(tensors[0]) * (size_t)n_tensors);
  publish(c, KEYS "/b/manifest", m, NULL);
  publish(c, KEYS "/b/storage", sb, NULL);
  res->setup_ns[CASE_B] = bench_now_ns() - t0;
  /* (c): a storage per tensor. */
  td_storage **sc = calloc((size_t)n_tensors, sizeof(*sc));
  if (sc == NULL)
    bench_die("producer: out of memory");
  t0 = bench_now_ns();
  for (int i = 0; i < n_tensors; i++) {
    sc[i] = create_cuda(c, tensors[i].nbytes);
    view_of(&tensors[i], &v);
    v.offset = 0;
    key_of(key, sizeof(key), CASE_C, i);
    publish(c, key, sc[i], &v);
  }
  res->setup_ns[CASE_C] = bench_now_ns() - t0;

  send_byte(a->wr);             /* published */
  wait_byte(a->rd, "producer"); /* the consumer is done */
  for (int i = 0; i < n_tensors; i++) {
    key_of(key, sizeof(key), CASE_A, i);
    td_unpublish(c, key);
    key_of(key, sizeof(key), CASE_C, i);
    td_unpublish(c, key);
    td_storage_release(sc[i]);
  }
  td_unpublish(c, KEYS "/b/manifest");
  td_unpublish(c, KEYS "/b/storage");
  td_storage_release(sa);
  td_storage_release(sb);
  td_storage_release(m);
  free(sc);
  td_close(c);
  return 0;
}

/* ---- the consumer ---- */

static td_storage *handles[MAXN];
static uint8_t *ptrs[MAXN];
static td_view views[MAXN];

static td_storage *lookup(td_client *c, const char *key, td_view *v) {
  td_storage *s;
  int err = td_lookup(c, key, TD_RDONLY, 0, &s, v);
  if (err < 0)
    bench_die("consumer: lookup %s: %s (%s)", key, td_strerror(err),
              td_last_error(c));
  return s;
}

/* Attaches every tensor the way case k publishes them. Returns the number of
 * handles it holds. */
static int attach(td_client *c, int k) {
  char key[64];
  if (k == CASE_B) {
    td_view sv, mv;
    handles[0] = lookup(c, KEYS "/b/storage", &sv);
    handles[1] = lookup(c, KEYS "/b/manifest", &mv);
    uint8_t *base = td_storage_data(handles[0]);
    size_t nbytes = td_storage_nbytes(handles[0]);
    const tensor *rec = td_storage_data(handles[1]);
    if (td_storage_nbytes(handles[1]) < sizeof(*rec) * (size_t)n_tensors)
      bench_die("consumer: the manifest is too short");
    for (int i = 0; i < n_tensors; i++) {
      view_of(&rec[i], &views[i]);
      if (td_view_check(&views[i], nbytes) < 0)
        bench_die("consumer: manifest record %d: %s", i, td_view_last_error());
      ptrs[i] = base + views[i].offset * ESIZE;
    }
    return 2;
  }
  for (int i = 0; i < n_tensors; i++) {
    key_of(key, sizeof(key), k, i);
    handles[i] = lookup(c, key, &views[i]);
    ptrs[i] = (uint8_t *)td_storage_data(handles[i]) + views[i].offset * ESIZE;
  }
  return n_tensors;
}

/* What every attach must give: device pointers where the producer laid the
 * tensors out, in one storage for (a) and (b), in N for (c). Not timed. */
static void check(int k, int held) {
  for (int i = 0; i < n_tensors; i++) {
    if (ptrs[i] == NULL)
      bench_die("consumer: case %c: tensor %d has no device pointer", "abc"[k],
                i);
    if (views[i].shape[0] != tensors[i].shape[0])
      bench_die("consumer: case %c: tensor %d has the wrong shape", "abc"[k],
                i);
    if (k != CASE_C &&
        (uint64_t)(ptrs[i] - ptrs[0]) != tensors[i].offset - tensors[0].offset)
      bench_die("consumer: case %c: tensor %d is not at its offset", "abc"[k],
                i);
  }
  if (td_storage_device(handles[0]) != TD_CUDA)
    bench_die("consumer: case %c: not a CUDA storage", "abc"[k]);
  if (k == CASE_A &&
      td_storage_id(handles[held - 1]) != td_storage_id(handles[0]))
    bench_die("consumer: case a: the views are of different storages");
  if (k == CASE_C &&
      td_storage_id(handles[held - 1]) == td_storage_id(handles[0]))
    bench_die("consumer: case c: the tensors share a storage");
}

/* Releases every handle, then waits for a reply to a request sent after
 * them: td_storage_release sends its release without waiting, so without
 * the round trip the daemon's work on them would land in the next attach. */
static void detach(td_client *c, int held) {
  for (int i = 0; i < held; i++)
    td_storage_release(handles[i]);
  td_stat st;
  int err = td_stat_get(c, &st);
  if (err < 0)
    bench_die("consumer: stat: %s (%s)", td_strerror(err), td_last_error(c));
}

static int consumer(void *arg) {
  const proc_arg *a = arg;
  const td__cu *cu = load_and_wrap();
  /* Hold the primary context of the GPU the producer uses (cuda:0 in both
   * processes, which see the same devices), as a computing process does. */
  CUdevice dev;
  CUcontext ctx;
  uint64_t c0 = bench_now_ns();
  if (orig.DeviceGet(&dev, 0) != CUDA_SUCCESS ||
      orig.DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS)
    bench_die("consumer: no primary context on cuda:0");
  res->ctx_ns = bench_now_ns() - c0;
  (void)cu;
  td_client *c = bench_connect(sock);
  wait_byte(a->rd, "consumer"); /* published */

  for (int pass = 0; pass < res->passes; pass++) {
    bench_pin(res->cpu[pass]);
    for (int round = -1; round < res->rounds; round++) {
      for (int k = 0; k < NCASES; k++) {
        uint64_t d0 = drv_ns, n0 = drv_calls;
        uint64_t t0 = bench_now_ns();
        int held = attach(c, k);
        uint64_t t1 = bench_now_ns();
        uint64_t d1 = drv_ns;
        res->calls[k] = drv_calls - n0;
        check(k, held);
        uint64_t t2 = bench_now_ns();
        detach(c, held);
        uint64_t t3 = bench_now_ns();
        if (round < 0) {
          if (k == CASE_A && pass == 0) {
            res->first_ns = t1 - t0;
            res->first_drv_ns = d1 - d0;
          }
          continue;
        }
        res->attach[pass][k][round] = t1 - t0;
        res->drv[pass][k][round] = d1 - d0;
        res->detach[pass][k][round] = t3 - t2;
        res->ddrv[pass][k][round] = drv_ns - d1;
      }
    }
  }
  send_byte(a->wr);
  td_close(c);
  return 0;
}

/* ---- the driver and the daemon ---- */

/* In a child, so that this process never initialises a driver before it
 * forks: exits 0 if libcuda.so.1 loads, initialises and sees a device. */
static int probe_real_driver(void *arg) {
  (void)arg;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL)
    return 1;
  CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
  CUresult (*count)(int *) = (CUresult(*)(int *))dlsym(h, "cuDeviceGetCount");
  int n = 0;
  if (init == NULL || count == NULL || init(0) != CUDA_SUCCESS ||
      count(&n) != CUDA_SUCCESS || n < 1)
    return 1;
  return 0;
}

static void choose_driver(void) {
  const char *drv = getenv("TENSORD_CUDA_DRIVER");
  if (drv != NULL && *drv != '\0') {
    snprintf(res->driver, sizeof(res->driver), "%s (TENSORD_CUDA_DRIVER)%s",
             strcmp(drv, TDCUDA_DOUBLE) == 0 ? "test double" : drv,
             strcmp(drv, TDCUDA_DOUBLE) == 0 ? ": proves bookkeeping, not "
                                               "the driver"
                                             : "");
    return;
  }
  if (bench_wait(bench_fork(probe_real_driver, NULL)) == 0) {
    snprintf(res->driver, sizeof(res->driver), "libcuda.so.1 (a real GPU)");
    return;
  }
  setenv("TENSORD_CUDA_DRIVER", TDCUDA_DOUBLE, 1);
  setenv("TDCUDA_MEM", "8G", 0); /* sparse host memory: nothing is written */
  snprintf(res->driver, sizeof(res->driver),
           "test double (no libcuda.so.1 with a device here; %s, "
           "TDCUDA_MEM=%s): proves bookkeeping, not the driver",
           TDCUDA_DOUBLE, getenv("TDCUDA_MEM"));
}

static char dir[64];
static pid_t daemon_pid = -1;

static void start_daemon(void) {
  snprintf(dir, sizeof(dir), "/tmp/tensord-cuattach.XXXXXX");
  if (mkdtemp(dir) == NULL)
    bench_die("mkdtemp: %s", strerror(errno));
  snprintf(sock, sizeof(sock), "%s/tensord.sock", dir);
  char log[96];
  snprintf(log, sizeof(log), "%s/tensord.log", dir);
  fflush(NULL);
  daemon_pid = fork();
  if (daemon_pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (daemon_pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* dies with the bench */
    bench_pin(res->daemon_cpu);
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0)
      dup2(fd, 2);
    execl(TD_DAEMON, "tensord", "--socket", sock, "--log-level", "warn",
          (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", TD_DAEMON, strerror(errno));
    _exit(127);
  }
  /* The bench's own instance file: run.sh's names run.sh's daemon. */
  char inst[96];
  snprintf(inst, sizeof(inst), "%s/instance", dir);
  setenv("TD_BENCH_INSTANCE_FILE", inst, 1);
  td_close(bench_connect(sock)); /* waits until it listens */
  unsetenv("TD_BENCH_INSTANCE_FILE");
}

/* Stops the daemon (SIGTERM: it frees what it holds), prints its log if it
 * wrote one, removes any segment it left in /dev/shm and the directory.
 * Returns 0, or 1 if it had to be killed or left segments. */
static int stop_daemon(void) {
  int bad = 0;
  char path[128], line[256];
  kill(daemon_pid, SIGTERM);
  int st, i;
  for (i = 0; i < 100 && waitpid(daemon_pid, &st, WNOHANG) == 0; i++)
    usleep(100 * 1000);
  if (i == 100) {
    fprintf(stderr, "bench_cuda_attach: tensord ignored SIGTERM; killing it\n");
    kill(daemon_pid, SIGKILL);
    waitpid(daemon_pid, &st, 0);
    bad = 1;
  }
  snprintf(path, sizeof(path), "%s/instance", dir);
  FILE *f = fopen(path, "r");
  if (f != NULL) {
    char inst[32] = "";
    if (fgets(inst, sizeof(inst), f) != NULL) {
      inst[strcspn(inst, "\n")] = '\0';
      char cmd[160];
      snprintf(cmd, sizeof(cmd),
               "ls /dev/shm 2>/dev/null | grep -q '^tensord\\.%s\\.' && "
               "rm -f /dev/shm/tensord.%s.*",
               inst, inst);
      if (system(cmd) == 0) {
        fprintf(stderr, "bench_cuda_attach: tensord left segments in "
                        "/dev/shm; removed\n");
        bad = 1;
      }
    }
    fclose(f);
    unlink(path);
  }
  snprintf(path, sizeof(path), "%s/tensord.log", dir);
  f = fopen(path, "r");
  if (f != NULL) {
    int first = 1;
    while (fgets(line, sizeof(line), f) != NULL) {
      if (first)
        fprintf(stderr, "---- tensord's log (warnings and errors) ----\n");
      first = 0;
      fputs(line, stderr);
    }
    fclose(f);
    unlink(path);
  }
  rmdir(dir);
  return bad;
}

/* ---- the tables ---- */

/* The 1-minute load average, as /proc/loadavg says: how busy the machine
 * was, for whoever reads the numbers. */
static double loadavg(void) {
  double l = -1;
  FILE *f = fopen("/proc/loadavg", "r");
  if (f != NULL) {
    if (fscanf(f, "%lf", &l) != 1)
      l = -1;
    fclose(f);
  }
  return l;
}

static double ms(uint64_t ns) {
  return (double)ns / 1e6;
}

static void table(const char *title, uint64_t (*t)[MAXROUNDS],
                  uint64_t (*d)[MAXROUNDS], int with_calls) {
  int n = res->rounds;
  bench_samples s[NCASES], ds[NCASES];
  uint64_t p50[NCASES], p99[NCASES], d50[NCASES], b50[NCASES];
  for (int k = 0; k < NCASES; k++) {
    memset(&s[k], 0, sizeof(s[k]));
    memset(&ds[k], 0, sizeof(ds[k]));
    bench_samples bs = {0};
    for (int r = 0; r < n; r++) {
      bench_samples_add(&s[k], t[k][r]);
      bench_samples_add(&ds[k], d[k][r]);
      bench_samples_add(&bs, t[k][r] - d[k][r]);
    }
    p50[k] = bench_pct(&s[k], 50);
    p99[k] = bench_pct(&s[k], 99);
    d50[k] = bench_pct(&ds[k], 50);
    b50[k] = bench_pct(&bs, 50);
    bench_samples_free(&s[k]);
    bench_samples_free(&ds[k]);
    bench_samples_free(&bs);
  }
  printf("\n%s, %d tensors, %d rounds (ms)\n", title, res->n, n);
  printf("%-30s %9s %9s %9s %12s %8s %9s %8s\n", "case", "p50", "p99", "driver",
         "bookkeeping", with_calls ? "calls" : "", "us/tensor", "x (b)");
  for (int k = 0; k < NCASES; k++) {
    char calls[16] = "";
    if (with_calls)
      snprintf(calls, sizeof(calls), "%llu", (unsigned long long)res->calls[k]);
    printf("%-30s %9.2f %9.2f %9.2f %12.2f %8s %9.1f %8.2f\n", case_name[k],
           ms(p50[k]), ms(p99[k]), ms(d50[k]), ms(b50[k]), calls,
           (double)p50[k] / 1e3 / res->n,
           p50[CASE_B] ? (double)p50[k] / (double)p50[CASE_B] : 0.0);
  }
}

int main(int argc, char **argv) {
  bench_init("bench_cuda_attach");
  int quick = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0)
      quick = 1;
    else if (argv[i][0] == '-')
      bench_die("usage: bench_cuda_attach [SOCKET] [--quick]");
  } /* the socket is ignored: the bench runs its own tensord (above) */
  res = bench_shared(sizeof(*res));
  memset(res, 0, sizeof(*res));
  /* tensord and the producer on one CPU; the consumer on that CPU, then
   * (where there is one) on another: see "CPUs" above. */
  int other = bench_pin_producer(&res->daemon_cpu);
  res->passes = 1;
  res->cpu[0] = res->daemon_cpu;
  if (other >= 0) {
    res->cpu[1] = other;
    res->passes = 2;
  }
  int rounds = (int)(30 * bench_scale() + 0.5);
  res->rounds = rounds < 3 ? 3 : rounds > MAXROUNDS ? MAXROUNDS : rounds;
  make_state_dict(quick ? 250 : MAXN);

  choose_driver();
  printf("DRIVER: %s\n", res->driver);
  printf("state dict: %d bfloat16 tensors, 4 KiB .. 16 MiB, %.1f MiB; packed "
         "%.1f MiB, separate %.1f MiB (each rounded up to 2 MiB)\n",
         res->n, (double)res->total_bytes / (1 << 20),
         (double)res->packed_bytes / (1 << 20),
         (double)res->separate_bytes / (1 << 20));
  double load0 = loadavg();
  start_daemon();

  int p2c[2], c2p[2];
  if (pipe(p2c) != 0 || pipe(c2p) != 0)
    bench_die("pipe: %s", strerror(errno));
  proc_arg pa = {c2p[0], p2c[1]}, ca = {p2c[0], c2p[1]};
  pid_t prod = bench_fork(producer, &pa);
  pid_t cons = bench_fork(consumer, &ca);
  close(p2c[0]);
  close(p2c[1]);
  close(c2p[0]);
  close(c2p[1]);
  int sc = bench_wait(cons), sp = bench_wait(prod);
  int bad = stop_daemon();
  if (sc != 0 || sp != 0)
    bench_die("the %s failed (status %d)", sc ? "consumer" : "producer",
              sc ? sc : sp);

  printf("load average (1 min) %.2f before, %.2f after, on %ld CPU(s); "
         "tensord and the producer pinned to CPU %d\n",
         load0, loadavg(), sysconf(_SC_NPROCESSORS_ONLN), res->daemon_cpu);
  printf("producer set-up (create + publish): (a) %.1f ms, (b) %.1f ms, "
         "(c) %.1f ms\n",
         ms(res->setup_ns[CASE_A]), ms(res->setup_ns[CASE_B]),
         ms(res->setup_ns[CASE_C]));
  printf("consumer, once per process: driver load + cuInit %.1f ms, primary "
         "context %.1f ms; first attach (a) %.2f ms, of it driver %.2f ms\n",
         ms(res->load_ns), ms(res->ctx_ns), ms(res->first_ns),
         ms(res->first_drv_ns));
  for (int p = 0; p < res->passes; p++) {
    char title[200];
    const char *where = res->cpu[p] == res->daemon_cpu
                            ? "same CPU as tensord"
                            : "another CPU than tensord's";
    if (res->daemon_cpu < 0)
      where = "no CPU pinned";
    snprintf(title, sizeof(title),
             "attach (consumer on %s): lookups until every tensor has a "
             "device pointer and a view",
             where);
    table(title, res->attach[p], res->drv[p], 1);
    snprintf(title, sizeof(title),
             "detach (consumer on %s): release of every handle + 1 round "
             "trip",
             where);
    table(title, res->detach[p], res->ddrv[p], 0);
  }
  printf("\ntarget: a 1,000-tensor state dict attached in under 100 ms "
         "(issue 10)\n");
  return bad;
}

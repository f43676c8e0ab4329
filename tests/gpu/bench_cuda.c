/* bench_cuda.c: what a CUDA storage costs on a real GPU: create, export,
 * and import + map, by size, through tensord and through the bare driver;
 * and the bandwidth a consumer sees reading a producer's 1 GiB storage,
 * against the device's own copy bandwidth.
 *
 * Rows, for N = 2 MiB, 8 MiB, 32 MiB, 128 MiB, 512 MiB, 1 GiB, 4 GiB (sizes
 * the device cannot hold twice over are skipped with a note):
 *   cu create        cuMemCreate of N (rounded up to the granularity), POSIX
 *                    fd handle, pinned to device 0, in this process.
 *   cu export        cuMemExportToShareableHandle of that allocation.
 *   cu import+map    in another process (the consumer), the fd it got by
 *                    SCM_RIGHTS: cuMemImportFromShareableHandle,
 *                    cuMemAddressReserve, cuMemMap, cuMemSetAccess (read).
 *                    The floor under tensord's consumer side.
 *   td create        td_storage_create_ex(TD_CUDA, N) and the first
 *                    td_storage_data: the daemon's cuMemCreate and export,
 *                    the reply, this process's import + map, and its
 *                    zeroing of the bytes (cuMemsetD8 and a synchronise).
 *   td create uninit the same with TD_UNINIT: no zeroing.
 *   td create fresh  td create while every earlier one is still held, so
 *                    that none is recycled: the daemon's cuMemCreate and
 *                    export and this process's import + map every time.
 *   td create pooled td create right after the release of one of the same
 *                    size: the daemon's pool serves it (no cuMemCreate) and
 *                    this process's warm mapping (no import), zeroing
 *                    included; then "pooled/fresh", the ratio of the p50s.
 *                    (The td create rows above recycle in the same way
 *                    after their first round.)
 *   td open+map      the consumer's td_storage_open(id, TD_RDONLY) and
 *                    td_storage_data of a storage the producer holds, then
 *                    its release (the mapping goes with it, so each open
 *                    imports and maps again).
 * Columns: p50 and p99 in microseconds (nearest rank; with fewer than 100
 * samples p99 is the maximum).
 *
 * Handoff: 64 MiB created TD_UNINIT, published under a key, looked up and
 * mapped by the consumer, released; a CPU storage's against a CUDA one's,
 * both recycled by the daemon's pools, p50 and p99 of the whole round
 * trip, and the ratio of the p50s. Target: at most 2.
 *
 * Attach: the producer publishes 1,000 storages of 2 MiB under keys sd/<i>
 * (a model's state dict); the consumer looks every key up read-only, then
 * takes every device pointer, and releases them: the time of the lookups,
 * of the maps (where the library maps at the first td_storage_data) and
 * their sum, p50 of 5 rounds. The cu import+map row at 2 MiB, times 1,000,
 * is the driver's share of it; the rest is tensord's bookkeeping and
 * messages. Target: under 100 ms.
 *
 * Bandwidth: the producer creates a 1 GiB storage and fills it; the
 * consumer opens it read-only and times cuMemcpyDtoD from it into a buffer
 * of its own (cuMemAlloc), against cuMemcpyDtoD between two buffers of its
 * own: the device's copy bandwidth within one process. A storage shared by
 * tensord is the producer's device memory itself, mapped, so the target is
 * a ratio of at least 95% (zero copy). Printed, never asserted.
 *
 * Model load: a safetensors file of 1 GiB (one U8 tensor; 64 MiB on the
 * double), in the page cache, loaded onto cuda:0 with td_model_load
 * (TD_CUDA, --force each round: a pinned staging buffer of 256 MiB, reads
 * overlapped with the host-to-device copies), p50 of 3 rounds, in GB/s of
 * the file's bytes; against one plain cuMemcpyHtoD of the same bytes from a
 * pinned buffer (cuMemHostAlloc) into cuMemAlloc memory: the PCIe ceiling
 * a load that reads as fast as it copies would reach. Printed, never
 * asserted.
 *
 * td_copy on the GPU: a float32 transpose of 64 MiB (4096 x 4096; 4 MiB on
 * the double, which runs the kernel as host code) between two storages on
 * cuda:0, through the copy kernel and through the staged fall-back
 * (TENSORD_CUDA_COPY_KERNEL=0), against one cuMemcpy2D device to device of
 * the same bytes, dense (the device's copy bandwidth); and, with two GPUs
 * visible, td_copy of 64 MiB dense from cuda:0 to cuda:1 (one
 * cuMemcpyPeerAsync), with whether the driver reports peer access. GB/s of
 * the bytes copied at the p50 and the p99 time (nearest rank), and the
 * ratio of the p50 to cuMemcpy2D's. Targets (docs/cuda.md): the kernel at
 * least 50% of cuMemcpy2D on an H100; the peer copy near the link's
 * bandwidth. Printed, never asserted.
 *
 * CUDA does not survive fork(), so the consumer is forked before this
 * process touches the driver. Usage: bench_cuda SOCKET (or
 * $TENSORD_SOCKET). Without a GPU it says "no GPU: skipped" and exits 0.
 * With $TENSORD_CUDA_DRIVER naming the test double it runs the cost rows
 * over host memory, labelled as such (a smoke test of this program, not a
 * measurement), and skips the bandwidth (the double has no cuMemAlloc or
 * cuMemcpyDtoD). $TD_BENCH_SCALE scales the repetitions. */
#include "bench.h"
#include "gpu.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MiB ((uint64_t)1 << 20)
#define GiB ((uint64_t)1 << 30)

/* The stringized, macro-expanded name (cuMemcpyDtoD -> "cuMemcpyDtoD_v2"),
 * as the driver exports it. */
#define NAME_(x) #x
#define NAME(x) NAME_(x)

enum { OP_QUIT, OP_IMPORT, OP_OPEN, OP_BW, OP_ATTACH, OP_HANDOFF };

typedef struct msg {
  uint32_t op;
  uint32_t ok;
  uint64_t id, size, alloc;
  uint64_t ns;       /* OP_IMPORT, OP_OPEN: the time it took */
  uint64_t ns_map;   /* OP_ATTACH: ns of the lookups, ns_map of the maps */
  uint64_t ns_many;  /* OP_ATTACH: ns of one td_lookup_many and the maps */
  double gbs, local; /* OP_BW: GB/s from the storage, and within one process */
  char why[160];     /* ok == 0: what failed */
} msg;

static const char *sock;
static int on_double;

static void ck(const td__cu *cu, CUresult r, const char *what) {
  char e[256];
  if (r != CUDA_SUCCESS)
    bench_die("%s: %s", what, td__cu_strerror(cu, r, e, sizeof(e)));
}

static CUmemAllocationProp prop_of(CUdevice dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof(p));
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = (int)dev;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

/* ---- the consumer (a forked child) ---- */

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*dtod_fn)(CUdeviceptr, CUdeviceptr, size_t);

/* GB/s of reps copies of n bytes from src to dst (synchronised). */
static double copy_gbs(const td__cu *cu, dtod_fn dtod, CUdeviceptr dst,
                       CUdeviceptr src, size_t n, int reps) {
  ck(cu, dtod(dst, src, n), "cuMemcpyDtoD (warm-up)");
  ck(cu, cu->CtxSynchronize(), "cuCtxSynchronize");
  uint64_t t0 = bench_now_ns();
  for (int i = 0; i < reps; i++)
    ck(cu, dtod(dst, src, n), "cuMemcpyDtoD");
  ck(cu, cu->CtxSynchronize(), "cuCtxSynchronize");
  uint64_t dt = bench_now_ns() - t0;
  return (double)n * reps / (double)dt; /* bytes per ns = GB/s */
}

static void bandwidth(const td__cu *cu, td_client *c, msg *m) {
  const char *lib = getenv("TENSORD_CUDA_DRIVER");
  void *h = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  alloc_fn alloc = h ? (alloc_fn)dlsym(h, NAME(cuMemAlloc)) : NULL;
  free_fn mfree = h ? (free_fn)dlsym(h, NAME(cuMemFree)) : NULL;
  dtod_fn dtod = h ? (dtod_fn)dlsym(h, NAME(cuMemcpyDtoD)) : NULL;
  if (alloc == NULL || mfree == NULL || dtod == NULL) {
    snprintf(m->why, sizeof(m->why), "the driver has no %s, %s or %s",
             NAME(cuMemAlloc), NAME(cuMemFree), NAME(cuMemcpyDtoD));
    return;
  }
  td_storage *s = NULL;
  int e = td_storage_open(c, m->id, TD_RDONLY, &s);
  if (e < 0)
    bench_die("td_storage_open(%llu): %s", (unsigned long long)m->id,
              td_last_error(c));
  CUdeviceptr src = (CUdeviceptr)(uintptr_t)td_storage_data(s);
  size_t n = m->size;
  CUdeviceptr dst = 0, own = 0;
  ck(cu, alloc(&dst, n), "cuMemAlloc");
  ck(cu, alloc(&own, n), "cuMemAlloc");
  int reps = (int)(10 * bench_scale());
  reps = reps < 3 ? 3 : reps;
  /* Interleaved, so that both see the same clocks and load. */
  double a = 0, b = 0;
  for (int round = 0; round < 3; round++) {
    a += copy_gbs(cu, dtod, dst, src, n, reps);
    b += copy_gbs(cu, dtod, dst, own, n, reps);
  }
  m->gbs = a / 3;
  m->local = b / 3;
  m->ok = 1;
  mfree(own);
  mfree(dst);
  td_storage_release(s);
}

/* Looks up the m->id keys "sd/<i>" read-only (a state dict), then takes
 * every storage's device pointer (maps it, if the lookup did not); times
 * both, then releases them all. */
static void attach(td_client *c, msg *m) {
  size_t n = m->id;
  td_storage **s = calloc(n, sizeof(*s));
  if (s == NULL)
    bench_die("out of memory");
  char key[32];
  uint64_t t0 = bench_now_ns();
  for (size_t i = 0; i < n; i++) {
    snprintf(key, sizeof(key), "sd/%zu", i);
    if (td_lookup(c, key, TD_RDONLY, 0, &s[i], NULL) < 0)
      bench_die("td_lookup(%s): %s", key, td_last_error(c));
  }
  uint64_t t1 = bench_now_ns();
  for (size_t i = 0; i < n; i++)
    if (td_storage_data(s[i]) == NULL)
      bench_die("td_storage_data of sd/%zu: NULL", i);
  uint64_t t2 = bench_now_ns();
  for (size_t i = 0; i < n; i++)
    td_storage_release(s[i]);
  /* The same keys in one request (td_lookup_many), then every pointer. */
  char **keys = calloc(n, sizeof(*keys));
  if (keys == NULL)
    bench_die("out of memory");
  for (size_t i = 0; i < n; i++) {
    snprintf(key, sizeof(key), "sd/%zu", i);
    if ((keys[i] = strdup(key)) == NULL)
      bench_die("out of memory");
  }
  uint64_t t3 = bench_now_ns();
  if (td_lookup_many(c, (const char *const *)keys, n, TD_RDONLY, 0, s, NULL,
                     NULL) < 0)
    bench_die("td_lookup_many of %zu keys: %s", n, td_last_error(c));
  for (size_t i = 0; i < n; i++)
    if (td_storage_data(s[i]) == NULL)
      bench_die("td_storage_data of sd/%zu: NULL", i);
  uint64_t t4 = bench_now_ns();
  for (size_t i = 0; i < n; i++) {
    td_storage_release(s[i]);
    free(keys[i]);
  }
  free(keys);
  free(s);
  m->ns = t1 - t0;
  m->ns_map = t2 - t1;
  m->ns_many = t4 - t3;
  m->ok = 1;
}

static int consumer(void *arg) {
  int s = *(int *)arg;
  const td__cu *cu = gpu_enter(NULL, NULL);
  if (cu == NULL)
    bench_die("the consumer cannot use the driver");
  CUdevice dev = 0;
  ck(cu, cu->DeviceGet(&dev, 0), "cuDeviceGet");
  td_client *c = bench_connect(sock);
  msg m;
  int fd;
  while (bench_recv_fd(s, &m, sizeof(m), &fd)) {
    if (m.op == OP_QUIT)
      break;
    uint64_t t0 = bench_now_ns();
    if (m.op == OP_IMPORT) {
      CUmemGenericAllocationHandle h;
      CUdeviceptr p = 0;
      ck(cu,
         cu->MemImportFromShareableHandle(
             &h, (void *)(intptr_t)fd,
             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
         "cuMemImportFromShareableHandle");
      /* m.alloc is a multiple of the granularity (a power of two): its
       * lowest set bit is an alignment cuMemMap accepts. */
      ck(cu, cu->MemAddressReserve(&p, m.alloc, m.alloc & -m.alloc, 0, 0),
         "cuMemAddressReserve");
      ck(cu, cu->MemMap(p, m.alloc, 0, h, 0), "cuMemMap");
      CUmemAccessDesc a;
      memset(&a, 0, sizeof(a));
      a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      a.location.id = (int)dev;
      a.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
      ck(cu, cu->MemSetAccess(p, m.alloc, &a, 1), "cuMemSetAccess");
      m.ns = bench_now_ns() - t0;
      ck(cu, cu->MemUnmap(p, m.alloc), "cuMemUnmap");
      ck(cu, cu->MemAddressFree(p, m.alloc), "cuMemAddressFree");
      ck(cu, cu->MemRelease(h), "cuMemRelease");
      m.ok = 1;
    } else if (m.op == OP_OPEN) {
      td_storage *st = NULL;
      if (td_storage_open(c, m.id, TD_RDONLY, &st) < 0)
        bench_die("td_storage_open(%llu): %s", (unsigned long long)m.id,
                  td_last_error(c));
      if (td_storage_data(st) == NULL)
        bench_die("td_storage_data of storage %llu: NULL",
                  (unsigned long long)m.id);
      m.ns = bench_now_ns() - t0;
      td_storage_release(st);
      m.ok = 1;
    } else if (m.op == OP_BW) {
      bandwidth(cu, c, &m);
    } else if (m.op == OP_ATTACH) {
      attach(c, &m);
    } else if (m.op == OP_HANDOFF) {
      /* The consumer's half of a handoff: look the key up, map, let go. */
      td_storage *st = NULL;
      if (td_lookup(c, "handoff", TD_RDONLY, 0, &st, NULL) < 0)
        bench_die("td_lookup(handoff): %s", td_last_error(c));
      if (td_storage_data(st) == NULL)
        bench_die("td_storage_data of the handoff: NULL");
      td_storage_release(st);
      m.ok = 1;
    }
    if (fd >= 0)
      close(fd);
    bench_send_fd(s, &m, sizeof(m), -1);
  }
  td_close(c);
  return 0;
}

/* ---- the producer (this process) ---- */

static int peer; /* the socket to the consumer */

static msg ask(msg m, int fd) {
  bench_send_fd(peer, &m, sizeof(m), fd);
  if (!bench_recv_fd(peer, &m, sizeof(m), &fd))
    bench_die("the consumer died");
  return m;
}

static void row(const char *size, const char *what, bench_samples *s) {
  printf("%-9s %-17s %10.1f %10.1f %6zu\n", size, what, bench_pct(s, 50) / 1e3,
         bench_pct(s, 99) / 1e3, s->n);
  bench_samples_free(s);
}

/* Creates n bytes on cuda:0 (zeroed unless flags has TD_UNINIT) and takes
 * its device pointer; dies on failure. */
static td_storage *create(td_client *c, uint64_t n, uint64_t flags) {
  td_create_opts o;
  memset(&o, 0, sizeof(o));
  o.nbytes = n;
  o.device = TD_CUDA;
  o.device_index = 0;
  o.flags = flags;
  td_storage *s = NULL;
  if (td_storage_create_ex(c, &o, &s) < 0)
    bench_die("td_storage_create_ex(cuda:0, %llu bytes): %s",
              (unsigned long long)n, td_last_error(c));
  if (td_storage_data(s) == NULL)
    bench_die("td_storage_data of a new CUDA storage: NULL");
  return s;
}

/* Handoffs of 64 MiB, as a data loader hands a batch over: the producer
 * creates a storage (TD_UNINIT: it is about to fill it), publishes it
 * under a key, the consumer looks the key up, maps it and lets go, and the
 * producer unpublishes and releases it; timed from the create to the
 * consumer's answer. A CPU storage's against a CUDA one's, both recycled
 * (three rounds first, unmeasured: the daemon's pools and the processes'
 * warm mappings fill). Target: the CUDA p50 at most twice the CPU's. */
static void handoffs(td_client *c) {
  const uint64_t n = 64 * MiB;
  int reps = (int)(50 * bench_scale());
  reps = reps < 5 ? 5 : reps;
  bench_samples t[2] = {{0}, {0}};
  for (int dev = 0; dev < 2; dev++) {
    td_create_opts o;
    memset(&o, 0, sizeof(o));
    o.nbytes = n;
    o.device = dev ? TD_CUDA : TD_CPU;
    o.flags = TD_UNINIT;
    for (int i = -3; i < reps; i++) {
      uint64_t t0 = bench_now_ns();
      td_storage *s = NULL;
      if (td_storage_create_ex(c, &o, &s) < 0 || td_storage_data(s) == NULL ||
          td_publish(c, "handoff", s, NULL) < 0)
        bench_die("handoff on %s: %s", dev ? "cuda:0" : "the CPU",
                  td_last_error(c));
      msg m = {.op = OP_HANDOFF};
      m = ask(m, -1);
      if (i >= 0)
        bench_samples_add(&t[dev], bench_now_ns() - t0);
      td_unpublish(c, "handoff");
      td_storage_release(s);
    }
  }
  double cpu50 = bench_pct(&t[0], 50), gpu50 = bench_pct(&t[1], 50);
  printf("handoff 64 MiB (create uninit, publish, another process's lookup "
         "+ map, release)\n");
  row("64 MiB", "handoff cpu", &t[0]);
  row("64 MiB", "handoff cuda:0", &t[1]);
  printf("%-9s %-17s %10.2f (target: at most 2)\n", "64 MiB", "cuda/cpu",
         cpu50 > 0 ? gpu50 / cpu50 : 0);
  fflush(stdout);
}

/* Writes a safetensors file of one U8 tensor of n bytes (n a multiple of
 * 16 MiB) at path. Returns 0 or -1. */
static int write_model(const char *path, uint64_t n) {
  char h[128];
  int hl = snprintf(h, sizeof(h),
                    "{\"w\":{\"dtype\":\"U8\",\"shape\":[%llu],"
                    "\"data_offsets\":[0,%llu]}}",
                    (unsigned long long)n, (unsigned long long)n);
  while (hl % 8 != 0)
    h[hl++] = ' ';
  uint8_t len[8];
  for (int i = 0; i < 8; i++)
    len[i] = (uint8_t)((uint64_t)hl >> (8 * i));
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return -1;
  static uint8_t chunk[16 << 20];
  for (size_t i = 0; i < sizeof(chunk); i++)
    chunk[i] = (uint8_t)(i * 131 + 7);
  bench_write_full(fd, len, 8);
  bench_write_full(fd, h, (size_t)hl);
  for (uint64_t off = 0; off < n; off += sizeof(chunk))
    bench_write_full(fd, chunk, sizeof(chunk));
  return close(fd);
}

/* Reads path once, so that the load reads from the page cache. */
static void warm(const char *path) {
  static uint8_t buf[1 << 20];
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return;
  while (read(fd, buf, sizeof(buf)) > 0)
    ;
  close(fd);
}

/* The model-load row: td_model_load onto cuda:0 against a plain pinned
 * cuMemcpyHtoD of the same bytes. */
static void model_load(const td__cu *cu, td_client *c) {
  uint64_t n = on_double ? 64 * MiB : GiB;
  size_t fr = 0, total = 0;
  char b1[32];
  ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
  if (2 * n + 256 * MiB > fr) {
    printf("model load: skipped (%s free on the device)\n",
           bench_size(fr, b1, sizeof(b1)));
    return;
  }
  const char *tmp = getenv("TMPDIR");
  char path[512];
  snprintf(path, sizeof(path), "%s/bench_cuda_model.%d.safetensors",
           tmp && *tmp ? tmp : "/tmp", (int)getpid());
  if (write_model(path, n) < 0) {
    printf("model load: skipped (cannot write %s)\n", path);
    unlink(path);
    return;
  }
  warm(path);
  uint64_t fbytes = 0;
  bench_samples ld = {0};
  for (int round = 0; round < 3; round++) {
    td_load_opts o = {
        .device = TD_CUDA, .device_index = 0, .flags = TD_MODEL_FORCE};
    td_load_result r;
    uint64_t t0 = bench_now_ns();
    if (td_model_load(c, path, "bench_cuda_model", &o, &r) < 0)
      bench_die("td_model_load to cuda:0: %s", td_last_error(c));
    bench_samples_add(&ld, bench_now_ns() - t0);
    fbytes = r.bytes;
  }
  td_model_unload(c, "bench_cuda_model");
  double load_gbs = (double)fbytes / (double)bench_pct(&ld, 50);
  bench_samples_free(&ld);
  /* The ceiling: one copy from pinned memory, the same bytes. */
  void *pin = NULL;
  CUdeviceptr dst = 0;
  ck(cu, cu->MemHostAlloc(&pin, fbytes, 0), "cuMemHostAlloc");
  ck(cu, cu->MemAlloc(&dst, fbytes), "cuMemAlloc");
  memset(pin, 0x5a, fbytes);
  bench_samples cp = {0};
  for (int round = 0; round < 3; round++) {
    uint64_t t0 = bench_now_ns();
    ck(cu, cu->MemcpyHtoD(dst, pin, fbytes), "cuMemcpyHtoD");
    ck(cu, cu->CtxSynchronize(), "cuCtxSynchronize");
    bench_samples_add(&cp, bench_now_ns() - t0);
  }
  double copy_gbs = (double)fbytes / (double)bench_pct(&cp, 50);
  bench_samples_free(&cp);
  ck(cu, cu->MemFree(dst), "cuMemFree");
  ck(cu, cu->MemFreeHost(pin), "cuMemFreeHost");
  unlink(path);
  printf("model load %s onto cuda:0 (page cache, p50 of 3): %.2f GB/s; "
         "plain pinned cuMemcpyHtoD %.2f GB/s: %.0f%%%s\n",
         bench_size(fbytes, b1, sizeof(b1)), load_gbs, copy_gbs,
         100.0 * load_gbs / copy_gbs,
         on_double ? " (the test double: host memcpy, not a GPU)" : "");
  fflush(stdout);
}

/* One copy-row: GB/s of bytes at the p50 and p99 times of s, and the
 * p50's ratio to base (GB/s; 0: none). Returns the p50's GB/s. */
static double copy_row(const char *what, uint64_t bytes, bench_samples *s,
                       double base) {
  double g50 = (double)bytes / (double)bench_pct(s, 50);
  double g99 = (double)bytes / (double)bench_pct(s, 99);
  if (base > 0)
    printf("%-34s %9.2f %9.2f %6.2f %5zu\n", what, g50, g99, g50 / base, s->n);
  else
    printf("%-34s %9.2f %9.2f %6s %5zu\n", what, g50, g99, "-", s->n);
  bench_samples_free(s);
  return g50;
}

/* Creates n bytes on cuda:index; dies on failure. */
static td_storage *create_on(td_client *c, int index, uint64_t n) {
  td_create_opts o;
  memset(&o, 0, sizeof(o));
  o.nbytes = n;
  o.device = TD_CUDA;
  o.device_index = index;
  td_storage *s = NULL;
  if (td_storage_create_ex(c, &o, &s) < 0)
    bench_die("td_storage_create_ex(cuda:%d, %llu bytes): %s", index,
              (unsigned long long)n, td_last_error(c));
  if (td_storage_data(s) == NULL)
    bench_die("td_storage_data of a new CUDA storage: NULL");
  return s;
}

/* reps td_copy of dv from sv, timed one by one. */
static void time_copies(td_storage *dst, const td_view *dv, td_storage *src,
                        const td_view *sv, int reps, bench_samples *out) {
  if (td_copy(dst, dv, src, sv) < 0) /* warm-up: the module's load */
    bench_die("td_copy: %s", td_view_last_error());
  for (int i = 0; i < reps; i++) {
    uint64_t t0 = bench_now_ns();
    if (td_copy(dst, dv, src, sv) < 0)
      bench_die("td_copy: %s", td_view_last_error());
    bench_samples_add(out, bench_now_ns() - t0);
  }
}

/* The td_copy rows (see the top of the file). */
static void copy_rows(const td__cu *cu, td_client *c) {
  int64_t edge = on_double ? 1024 : 4096;
  uint64_t n = (uint64_t)(edge * edge) * 4;
  size_t fr = 0, total = 0;
  char b1[32];
  ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
  if (2 * n + 256 * MiB > fr) {
    printf("td_copy: skipped (%s free on the device)\n",
           bench_size(fr, b1, sizeof(b1)));
    return;
  }
  int reps = (int)((on_double ? 5 : 50) * bench_scale());
  reps = reps < 3 ? 3 : reps;
  td_storage *gs = create_on(c, 0, n), *gd = create_on(c, 0, n);
  int64_t shape[2] = {edge, edge};
  td_view sv, dv;
  if (td_view_contiguous(TD_FLOAT32, 2, shape, &sv) < 0 ||
      td_view_contiguous(TD_FLOAT32, 2, shape, &dv) < 0 ||
      td_view_transpose(&sv, 0, 1) < 0)
    bench_die("views: %s", td_view_last_error());
  /* The device's own bandwidth for the same bytes: one dense cuMemcpy2D,
   * device to device, 64 KiB rows. */
  CUDA_MEMCPY2D m2;
  memset(&m2, 0, sizeof(m2));
  m2.srcMemoryType = m2.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  m2.srcDevice = (CUdeviceptr)(uintptr_t)td_storage_data(gs);
  m2.dstDevice = (CUdeviceptr)(uintptr_t)td_storage_data(gd);
  m2.WidthInBytes = m2.srcPitch = m2.dstPitch = 64 * 1024;
  m2.Height = n / (64 * 1024);
  bench_samples dense = {0}, kern = {0}, staged = {0};
  ck(cu, cu->Memcpy2D(&m2), "cuMemcpy2D (warm-up)");
  ck(cu, cu->CtxSynchronize(), "cuCtxSynchronize");
  for (int i = 0; i < reps; i++) {
    uint64_t t0 = bench_now_ns();
    ck(cu, cu->Memcpy2D(&m2), "cuMemcpy2D");
    ck(cu, cu->CtxSynchronize(), "cuCtxSynchronize");
    bench_samples_add(&dense, bench_now_ns() - t0);
  }
  time_copies(gd, &dv, gs, &sv, reps, &kern);
  setenv("TENSORD_CUDA_COPY_KERNEL", "0", 1);
  int sreps = reps / 5 < 3 ? 3 : reps / 5; /* through the host: slow */
  time_copies(gd, &dv, gs, &sv, sreps, &staged);
  unsetenv("TENSORD_CUDA_COPY_KERNEL");
  printf("td_copy on the GPU, %s float32 (%lld x %lld)%s\n",
         bench_size(n, b1, sizeof(b1)), (long long)edge, (long long)edge,
         on_double ? " (the test double: host code, not a GPU)" : "");
  printf("%-34s %9s %9s %6s %5s\n", "what", "GB/s p50", "GB/s p99", "ratio",
         "n");
  double base = copy_row("cuMemcpy2D DtoD dense (same bytes)", n, &dense, 0);
  copy_row("td_copy transpose, kernel", n, &kern, base);
  copy_row("td_copy transpose, staged", n, &staged, base);
  td_storage_release(gd);
  /* Peer: dense from cuda:0 to cuda:1, where a second GPU is visible. */
  int ngpu = 0;
  ck(cu, cu->DeviceGetCount(&ngpu), "cuDeviceGetCount");
  if (ngpu < 2) {
    printf("td_copy peer cuda:0 -> cuda:1: skipped (one GPU visible)\n");
  } else {
    int can = -1;
    if (cu->DeviceCanAccessPeer != NULL)
      cu->DeviceCanAccessPeer(&can, 1, 0);
    td_storage *g1 = create_on(c, 1, n);
    td_view flat;
    int64_t all = edge * edge;
    if (td_view_contiguous(TD_FLOAT32, 1, &all, &flat) < 0)
      bench_die("views: %s", td_view_last_error());
    bench_samples pc = {0};
    time_copies(g1, &flat, gs, &flat, reps, &pc);
    char what[64];
    snprintf(what, sizeof(what), "td_copy peer 0->1 (P2P %s)",
             can < 0 ? "?"
             : can   ? "yes"
                     : "no");
    copy_row(what, n, &pc, base);
    td_storage_release(g1);
  }
  td_storage_release(gs);
  fflush(stdout);
}

int main(int argc, char **argv) {
  bench_init("bench_cuda");
  sock = bench_socket(argc, argv);
  const char *dbl = getenv("TENSORD_CUDA_DRIVER");
  on_double = dbl != NULL && *dbl != '\0';
  char why[512];
  if (!on_double && !gpu_probe(why, sizeof(why))) {
    printf("bench_cuda: no GPU: skipped (%s)\n", why);
    return 0;
  }
  int sp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
    bench_die("socketpair failed");
  pid_t cpid = bench_fork(consumer, &sp[1]);
  close(sp[1]);
  peer = sp[0];

  CUdevice dev = 0;
  const td__cu *cu = gpu_enter(NULL, &dev);
  if (cu == NULL)
    bench_die("cannot use the driver (see above)");
  char name[128] = "";
  cu->DeviceGetName(name, sizeof(name), dev);
  size_t fr = 0, total = 0;
  ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
  CUmemAllocationProp prop = prop_of(dev);
  size_t gran = 0;
  ck(cu,
     cu->MemGetAllocationGranularity(&gran, &prop,
                                     CU_MEM_ALLOC_GRANULARITY_MINIMUM),
     "cuMemGetAllocationGranularity");
  td_client *c = bench_connect(sock);
  if (on_double)
    printf("bench_cuda: TEST DOUBLE (%s): host memory, not a GPU; these "
           "numbers measure the program, not the driver\n",
           dbl);
  char b1[32], b2[32];
  printf("device 0: %s, %s total, %s free, granularity %s\n", name,
         bench_size(total, b1, sizeof(b1)), bench_size(fr, b2, sizeof(b2)),
         bench_size(gran, why, sizeof(why)));
  printf("%-9s %-17s %10s %10s %6s\n", "size", "what", "p50 us", "p99 us", "n");

  static const uint64_t sizes[] = {2 * MiB,   8 * MiB, 32 * MiB, 128 * MiB,
                                   512 * MiB, GiB,     4 * GiB};
  for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
    uint64_t n = sizes[k];
    char sz[32];
    bench_size(n, sz, sizeof(sz));
    ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
    if (2 * n + 256 * MiB > fr) {
      printf("%-9s (skipped: %s free on the device)\n", sz,
             bench_size(fr, b1, sizeof(b1)));
      continue;
    }
    int reps = n <= 128 * MiB ? 30 : n <= GiB ? 10 : 5;
    reps = (int)(reps * bench_scale());
    reps = reps < 3 ? 3 : reps;
    uint64_t alloc = (n + gran - 1) / gran * gran;
    bench_samples screate = {0}, sexport = {0}, simport = {0};
    for (int i = 0; i < reps; i++) {
      CUmemGenericAllocationHandle h;
      uint64_t t0 = bench_now_ns();
      ck(cu, cu->MemCreate(&h, alloc, &prop, 0), "cuMemCreate");
      uint64_t t1 = bench_now_ns();
      int fd = -1;
      ck(cu,
         cu->MemExportToShareableHandle(
             &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
         "cuMemExportToShareableHandle");
      uint64_t t2 = bench_now_ns();
      bench_samples_add(&screate, t1 - t0);
      bench_samples_add(&sexport, t2 - t1);
      msg m = {.op = OP_IMPORT, .size = n, .alloc = alloc};
      m = ask(m, fd);
      close(fd);
      bench_samples_add(&simport, m.ns);
      ck(cu, cu->MemRelease(h), "cuMemRelease");
    }
    row(sz, "cu create", &screate);
    row(sz, "cu export", &sexport);
    row(sz, "cu import+map", &simport);

    bench_samples tcreate = {0}, tuninit = {0}, topen = {0};
    for (int i = 0; i < reps; i++) {
      uint64_t t0 = bench_now_ns();
      td_storage *s = create(c, n, 0);
      bench_samples_add(&tcreate, bench_now_ns() - t0);
      msg m = {.op = OP_OPEN, .id = td_storage_id(s)};
      m = ask(m, -1);
      bench_samples_add(&topen, m.ns);
      td_storage_release(s);
    }
    for (int i = 0; i < reps; i++) {
      uint64_t t0 = bench_now_ns();
      td_storage *s = create(c, n, TD_UNINIT);
      bench_samples_add(&tuninit, bench_now_ns() - t0);
      td_storage_release(s);
    }
    row(sz, "td create", &tcreate);
    row(sz, "td create uninit", &tuninit);
    row(sz, "td open+map", &topen);

    /* Fresh against pooled: the fresh ones are all held at once, so only
     * as many as the device holds beside the rest. */
    ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
    int fresh_n = reps;
    if ((uint64_t)fresh_n * alloc + 256 * MiB > fr)
      fresh_n = fr > 256 * MiB ? (int)((fr - 256 * MiB) / alloc) : 0;
    if (fresh_n >= 3) {
      td_storage **held = calloc((size_t)fresh_n, sizeof(*held));
      if (held == NULL)
        bench_die("out of memory");
      bench_samples tfresh = {0}, tpooled = {0};
      for (int i = 0; i < fresh_n; i++) {
        uint64_t t0 = bench_now_ns();
        held[i] = create(c, n, 0);
        bench_samples_add(&tfresh, bench_now_ns() - t0);
      }
      for (int i = 0; i < fresh_n; i++)
        td_storage_release(held[i]);
      free(held);
      for (int i = 0; i < reps; i++) {
        uint64_t t0 = bench_now_ns();
        td_storage *s = create(c, n, 0);
        bench_samples_add(&tpooled, bench_now_ns() - t0);
        td_storage_release(s);
      }
      double f50 = bench_pct(&tfresh, 50), p50 = bench_pct(&tpooled, 50);
      row(sz, "td create fresh", &tfresh);
      row(sz, "td create pooled", &tpooled);
      printf("%-9s %-17s %10.2f\n", sz, "pooled/fresh",
             f50 > 0 ? p50 / f50 : 0);
    } else {
      printf("%-9s (fresh/pooled skipped: %s free on the device)\n", sz,
             bench_size(fr, b1, sizeof(b1)));
    }
    fflush(stdout);
  }

  handoffs(c);

  /* A state dict of 1,000 tensors of 2 MiB, each its own storage under
   * its own key: what attaching it costs another process (the issue's
   * target: under 100 ms). */
  ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
  size_t nsd = 1000;
  uint64_t each = 2 * MiB;
  if (nsd * each + 256 * MiB > fr)
    nsd = fr > 256 * MiB ? (fr - 256 * MiB) / each : 0;
  if (nsd < 10) {
    printf("attach: skipped (%s free on the device)\n",
           bench_size(fr, b1, sizeof(b1)));
  } else {
    td_storage **sd = calloc(nsd, sizeof(*sd));
    if (sd == NULL)
      bench_die("out of memory");
    char key[32];
    for (size_t i = 0; i < nsd; i++) {
      sd[i] = create(c, each, 0);
      snprintf(key, sizeof(key), "sd/%zu", i);
      if (td_publish(c, key, sd[i], NULL) < 0)
        bench_die("td_publish(%s): %s", key, td_last_error(c));
    }
    bench_samples lk = {0}, mp = {0}, all = {0}, many = {0};
    for (int round = 0; round < 5; round++) {
      msg m = {.op = OP_ATTACH, .id = nsd};
      m = ask(m, -1);
      bench_samples_add(&lk, m.ns);
      bench_samples_add(&mp, m.ns_map);
      bench_samples_add(&all, m.ns + m.ns_map);
      bench_samples_add(&many, m.ns_many);
    }
    printf("attach %zu x %s (5 rounds, p50): lookups %.1f ms, maps %.1f ms, "
           "total %.1f ms; td_lookup_many and maps %.1f ms (target: under "
           "100 ms for 1000)\n",
           nsd, bench_size(each, b1, sizeof(b1)), bench_pct(&lk, 50) / 1e6,
           bench_pct(&mp, 50) / 1e6, bench_pct(&all, 50) / 1e6,
           bench_pct(&many, 50) / 1e6);
    bench_samples_free(&lk);
    bench_samples_free(&mp);
    bench_samples_free(&all);
    bench_samples_free(&many);
    for (size_t i = 0; i < nsd; i++) {
      snprintf(key, sizeof(key), "sd/%zu", i);
      td_unpublish(c, key);
      td_storage_release(sd[i]);
    }
    free(sd);
  }
  fflush(stdout);

  /* Bandwidth of a consumer reading the producer's 1 GiB. */
  ck(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo");
  if (3 * GiB + 256 * MiB > fr) {
    printf("bandwidth: skipped (%s free on the device, 3 GiB needed)\n",
           bench_size(fr, b1, sizeof(b1)));
  } else {
    td_storage *s = create(c, GiB, 0);
    ck(cu, cu->MemsetD8((CUdeviceptr)(uintptr_t)td_storage_data(s), 0x3c, GiB),
       "cuMemsetD8");
    ck(cu, cu->CtxSynchronize(), "cuCtxSynchronize");
    msg m = {.op = OP_BW, .id = td_storage_id(s), .size = GiB};
    m = ask(m, -1);
    if (!m.ok)
      printf("bandwidth: skipped (%s)\n", m.why);
    else
      printf("bandwidth: consumer reading the producer's 1 GiB %.1f GB/s, "
             "device copy within one process %.1f GB/s: %.1f%% (target: "
             "95%% or more)\n",
             m.gbs, m.local, 100.0 * m.gbs / m.local);
    td_storage_release(s);
  }
  model_load(cu, c);
  copy_rows(cu, c);
  msg q = {.op = OP_QUIT};
  bench_send_fd(peer, &q, sizeof(q), -1);
  if (bench_wait(cpid) != 0)
    bench_die("the consumer failed");
  td_close(c);
  return 0;
}

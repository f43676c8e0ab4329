/* test_gpu.c: CUDA storages on a real GPU (ctest label gpu): device memory
 * one process writes is what another reads, read-only really is, memory
 * comes back when a holder dies, a consumer outlives the creator, and the
 * capacity is enforced, a model loaded onto the GPU is the files' bytes in
 * every attaching process. Every test skips, saying why, without a real
 * driver and a GPU, or when $TENSORD_CUDA_DRIVER names a stand-in (the
 * test double's tests are elsewhere: they prove the protocol, these the
 * driver).
 *
 * The test's own process never loads the driver (CUDA does not survive
 * fork): gpu_probe asks in a child, and every process that touches device
 * memory is a forked child, coordinated through pipes. The tests run one at
 * a time (--jobs 1), so the device memory one of them measures is not moved
 * by another. */
#include "gpu.h"
#include "harness.h"
#include "stfile.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;

TestSuite(gpu, .fini = tdt_cleanup, .timeout = 120);

#define MiB ((size_t)1 << 20)

static void need_gpu(void) {
  char why[512];
  if (!gpu_probe(why, sizeof(why)))
    cr_skip_test("no GPU: %s", why);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* ---- pipes between the test and its children ---- */

/* A pair of pipes: the test writes to->[1], the child reads to->[0]; the
 * child writes from->[1], the test reads from->[0]. Messages are uint64_t. */
typedef struct chan {
  int to[2], from[2];
} chan;

static void chan_open(chan *ch) {
  cr_assert(pipe(ch->to) == 0 && pipe(ch->from) == 0, "pipe: %s",
            strerror(errno));
}

static void chan_close(chan *ch) {
  for (int i = 0; i < 2; i++) {
    if (ch->to[i] >= 0)
      close(ch->to[i]);
    if (ch->from[i] >= 0)
      close(ch->from[i]);
    ch->to[i] = ch->from[i] = -1;
  }
}

static int put(int fd, uint64_t v) {
  return write(fd, &v, sizeof(v)) == (ssize_t)sizeof(v) ? 0 : -1;
}

/* Reads one message; returns 0, or -1 at end of file (the writer died). */
static int get(int fd, uint64_t *v) {
  ssize_t n;
  while ((n = read(fd, v, sizeof(*v))) < 0 && errno == EINTR)
    ;
  return n == (ssize_t)sizeof(*v) ? 0 : -1;
}

/* The test's side: sends v to the child. */
static void tell(chan *ch, uint64_t v) {
  cr_assert(put(ch->to[1], v) == 0, "write to a child: %s", strerror(errno));
}

/* The test's side: the next message of child pid, which must come within
 * 60 s. The test holds both ends of every pipe (a channel serves one child
 * after another), so a child's death shows as its exit, not as an end of
 * file: a child that fails before it speaks fails the test at once, with
 * its status, instead of leaving it to wait for the timeout. */
static uint64_t hear(chan *ch, pid_t pid, const char *what) {
  for (int waited = 0; waited < 60000; waited += 100) {
    /* Whether it has ended, looked at before the pipe (which it may have
     * written to just before), and without reaping it: tdt_wait does. */
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    int ended =
        waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        si.si_pid == pid;
    struct pollfd pfd = {.fd = ch->from[0], .events = POLLIN};
    if (poll(&pfd, 1, ended ? 0 : 100) > 0) {
      uint64_t v = 0;
      cr_assert(get(ch->from[0], &v) == 0, "reading from a child: %s",
                strerror(errno));
      return v;
    }
    if (ended)
      cr_assert_fail("the child (pid %d) ended before %s, %s %d (see its "
                     "stderr)",
                     (int)pid, what,
                     si.si_code == CLD_EXITED ? "exit status" : "signal",
                     si.si_status);
  }
  cr_assert_fail("no word from the child (pid %d) %s in 60 s", (int)pid, what);
  return 0;
}

/* ---- children ---- */

/* Called first in every child: it dies with the test (a holder that sleeps,
 * a reader left waiting on a pipe), so that a failed test leaves no process
 * holding a context on the GPU. */
static void die_with_parent(void) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
}

typedef struct role {
  chan *ch;
  const char *key;
  size_t nbytes;
  unsigned flags;
  unsigned char fill;
} role;

/* Connects and creates a storage of nbytes on cuda:0 (this process's
 * ordinal 0). */
static int create_cuda(td_client *c, size_t nbytes, td_storage **s) {
  td_create_opts o = {0};
  o.nbytes = nbytes;
  o.device = TD_CUDA;
  o.device_index = 0;
  return td_storage_create_ex(c, &o, s);
}

/* Fills the storage's device bytes with v and waits for the device. */
static int fill(const td__cu *cu, td_storage *s, unsigned char v) {
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)td_storage_data(s);
  return gpu_ok(cu, cu->MemsetD8(p, v, td_storage_nbytes(s)), "cuMemsetD8") &&
                 gpu_ok(cu, cu->CtxSynchronize(), "cuCtxSynchronize")
             ? 0
             : -1;
}

/* Whether every device byte of the storage is v (copied back in 1 MiB
 * pieces). */
static int all_are(const td__cu *cu, td_storage *s, unsigned char v) {
  static unsigned char buf[1 << 20];
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)td_storage_data(s);
  size_t n = td_storage_nbytes(s);
  for (size_t off = 0; off < n; off += sizeof(buf)) {
    size_t k = n - off < sizeof(buf) ? n - off : sizeof(buf);
    if (!gpu_ok(cu, cu->MemcpyDtoH(buf, p + off, k), "cuMemcpyDtoH"))
      return 0;
    for (size_t i = 0; i < k; i++)
      if (buf[i] != v) {
        fprintf(stderr, "byte %zu is 0x%02x, not 0x%02x\n", off + i, buf[i], v);
        return 0;
      }
  }
  return 1;
}

/* The producer: creates, fills with fill, publishes key and says so (1);
 * then waits for the word (any value), checks that the bytes are now
 * fill + 1 (the consumer's write) and says so (2). */
static int producer(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, create_cuda(c, r->nbytes, &s), 0);
  CHECK(td_storage_device(s) == TD_CUDA);
  CHECK(td_storage_device_index(s) == 0);
  uint8_t uuid[16];
  CHECK_ERR(c, td_storage_device_uuid(s, uuid), 0);
  const td__cu *cu = gpu_enter(uuid, NULL);
  CHECK(cu != NULL);
  CHECK(td_storage_data(s) != NULL);
  CHECK(fill(cu, s, r->fill) == 0);
  CHECK_ERR(c, td_publish(c, r->key, s, NULL), 0);
  CHECK(put(r->ch->from[1], 1) == 0);
  uint64_t v;
  CHECK(get(r->ch->to[0], &v) == 0);
  CHECK(all_are(cu, s, (unsigned char)(r->fill + 1)));
  CHECK(put(r->ch->from[1], 2) == 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

/* The consumer: looks key up with flags, checks that the bytes are fill,
 * writes fill + 1 and says so (1). */
static int consumer(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, r->key, r->flags, 10000, &s, NULL), 0);
  CHECK(td_storage_device(s) == TD_CUDA);
  uint8_t uuid[16];
  CHECK_ERR(c, td_storage_device_uuid(s, uuid), 0);
  const td__cu *cu = gpu_enter(uuid, NULL);
  CHECK(cu != NULL);
  CHECK(all_are(cu, s, r->fill));
  CHECK(fill(cu, s, (unsigned char)(r->fill + 1)) == 0);
  CHECK(put(r->ch->from[1], 1) == 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(gpu, two_processes_see_each_others_writes) {
  need_gpu();
  tdt_start(&d, NULL);
  chan ch;
  chan_open(&ch);
  role r = {.ch = &ch, .key = "w", .nbytes = 64 * MiB + 12345, .fill = 0x5a};
  pid_t p = tdt_fork(producer, &r);
  hear(&ch, p, "publishing");
  pid_t q = tdt_fork(consumer, &r); /* reads 0x5a, writes 0x5b */
  hear(&ch, q, "writing");
  cr_assert_eq(tdt_wait(q), 0, "the consumer failed (see its stderr)");
  tell(&ch, 1); /* the producer reads 0x5b */
  hear(&ch, p, "reading the consumer's write");
  cr_assert_eq(tdt_wait(p), 0, "the producer failed (see its stderr)");
  chan_close(&ch);
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_unpublish(c, "w"), 0);
  td_close(c);
  cr_assert_eq(tdt_storages(&d), 0);
}

/* Tries to write through a read-only handle: the memset or the synchronise
 * after it fails, or the process dies; either way the bytes must be as
 * they were. Exits 0 if the driver reported the write as done (the test
 * then finds out whether it landed), 3 if it refused it. */
static int ro_writer(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, r->key, TD_RDONLY, 10000, &s, NULL), 0);
  CHECK(td_storage_is_readonly(s) == 1);
  uint8_t uuid[16];
  CHECK_ERR(c, td_storage_device_uuid(s, uuid), 0);
  const td__cu *cu = gpu_enter(uuid, NULL);
  CHECK(cu != NULL);
  CHECK(all_are(cu, s, r->fill)); /* reading is allowed */
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)td_storage_data(s);
  CUresult w = cu->MemsetD8(p, 0xff, td_storage_nbytes(s));
  if (w == CUDA_SUCCESS)
    w = cu->CtxSynchronize();
  char e[256];
  fprintf(stderr, "write through a read-only mapping: %s\n",
          td__cu_strerror(cu, w, e, sizeof(e)));
  return w == CUDA_SUCCESS ? 0 : 3;
}

/* Checks that key's bytes are all fill, through a read-write lookup. */
static int checker(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, r->key, 0, 10000, &s, NULL), 0);
  uint8_t uuid[16];
  CHECK_ERR(c, td_storage_device_uuid(s, uuid), 0);
  const td__cu *cu = gpu_enter(uuid, NULL);
  CHECK(cu != NULL);
  CHECK(all_are(cu, s, r->fill));
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(gpu, readonly_open_cannot_write) {
  need_gpu();
  tdt_start(&d, NULL);
  chan ch;
  chan_open(&ch);
  role r = {.ch = &ch, .key = "ro", .nbytes = 4 * MiB, .fill = 0x11};
  pid_t p = tdt_fork(producer, &r);
  hear(&ch, p, "publishing");
  int st = tdt_wait(tdt_fork(ro_writer, &r));
  cr_log_info("read-only writer: exit %d (0: the driver reported success, "
              "3: it refused, >128: a signal)",
              st);
  cr_assert_neq(st, 1, "the read-only writer failed before its write");
  cr_assert_eq(tdt_wait(tdt_fork(checker, &r)), 0,
               "a write through a read-only handle reached the bytes");
  /* The producer waits for a consumer's write that never comes. */
  kill(p, SIGKILL);
  tdt_wait(p);
  chan_close(&ch);
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_unpublish(c, "ro"), 0);
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  cr_assert_eq(tdt_storages(&d), 0);
}

/* Says how much memory the device with ordinal 0 has free, as seen by a
 * fresh process with one context (its own, gone when it exits). */
static int free_reporter(void *arg) {
  die_with_parent();
  int *fd = arg;
  const td__cu *cu = gpu_enter(NULL, NULL);
  CHECK(cu != NULL);
  size_t fr = 0, total = 0;
  CHECK(gpu_ok(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo"));
  CHECK(put(*fd, fr) == 0);
  return 0;
}

static uint64_t device_free(void) {
  int p[2];
  cr_assert(pipe(p) == 0);
  pid_t pid = tdt_fork(free_reporter, &p[1]);
  close(p[1]);
  uint64_t fr = 0;
  int got = get(p[0], &fr);
  close(p[0]);
  cr_assert_eq(tdt_wait(pid), 0, "cuMemGetInfo failed (see stderr)");
  cr_assert_eq(got, 0);
  return fr;
}

/* The creator: creates nbytes on cuda:0, says its id, waits for the word,
 * then releases it and exits. */
static int creator(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, create_cuda(c, r->nbytes, &s), 0);
  CHECK(td_storage_data(s) != NULL);
  CHECK(put(r->ch->from[1], td_storage_id(s)) == 0);
  uint64_t v;
  CHECK(get(r->ch->to[0], &v) == 0);
  td_storage_release(s);
  td_close(c);
  return 0;
}

/* A holder: opens storage id (read from its pipe), maps it, says so, and
 * sleeps until it is killed. */
static int holder(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  uint64_t id;
  CHECK(get(r->ch->to[0], &id) == 0);
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, td_storage_open(c, id, 0, &s), 0);
  uint8_t uuid[16];
  CHECK_ERR(c, td_storage_device_uuid(s, uuid), 0);
  CHECK(gpu_enter(uuid, NULL) != NULL);
  CHECK(td_storage_data(s) != NULL);
  CHECK(put(r->ch->from[1], 1) == 0);
  for (;;)
    pause();
}

/* The bytes the daemon says it has allocated on all its GPUs. */
static uint64_t daemon_gpu_bytes(void) {
  td_client *c = tdt_connect(&d);
  td_device_stat g[16];
  size_t n = 0;
  cr_assert_eq(td_stat_devices(c, g, 16, &n), 0, "td_stat_devices: %s",
               td_last_error(c));
  uint64_t used = 0;
  for (size_t i = 0; i < n && i < 16; i++)
    used += g[i].bytes_used;
  td_close(c);
  return used;
}

/* Whether the device has at least want bytes free; polls for up to 10 s. */
static int free_again(uint64_t want, uint64_t *last) {
  for (int i = 0; i < 50; i++) {
    *last = device_free();
    if (*last >= want)
      return 1;
    sleep_ms(200);
  }
  return 0;
}

TDT_TEST(gpu, sigkill_of_a_holder_frees_the_memory) {
  need_gpu();
  /* No recycling pool: a freed allocation would wait there, device memory
   * still, and this test is about the driver giving the memory back. */
  tdt_start(&d, (const char *const[]){"--cuda-recycle-bytes", "0", NULL});
  /* The daemon's context first (made at its first CUDA create), so that
   * what follows measures the storage alone. */
  chan ch;
  chan_open(&ch);
  role w = {.ch = &ch, .nbytes = 2 * MiB};
  pid_t p = tdt_fork(creator, &w);
  hear(&ch, p, "creating the warm-up storage");
  tell(&ch, 1);
  cr_assert_eq(tdt_wait(p), 0);
  uint64_t before = device_free();

  /* 1 GiB, or a quarter of what is free on a small device. */
  size_t big = 1024 * MiB;
  if (before / 4 < big)
    big = (size_t)(before / 4) / (2 * MiB) * (2 * MiB);
  cr_assert_geq(big, 64 * MiB, "only %llu MiB free on the device",
                (unsigned long long)(before / MiB));
  role r = {.ch = &ch, .nbytes = big};
  p = tdt_fork(creator, &r);
  uint64_t id = hear(&ch, p, "creating");
  chan hc;
  chan_open(&hc);
  role h = {.ch = &hc};
  pid_t q = tdt_fork(holder, &h);
  tell(&hc, id);
  hear(&hc, q, "mapping");
  tell(&ch, 1); /* the creator releases and exits: the holder keeps it */
  cr_assert_eq(tdt_wait(p), 0, "the creator failed (see its stderr)");
  cr_assert_eq(tdt_storages(&d), 1);
  cr_assert_geq(daemon_gpu_bytes(), big);
  uint64_t during = device_free();
  cr_log_info("device free: %llu MiB before, %llu MiB while held",
              (unsigned long long)(before / MiB),
              (unsigned long long)(during / MiB));
  cr_assert(during + big / 2 < before,
            "a held storage of %zu MiB took only %llu MiB of device memory",
            big / MiB, (unsigned long long)((before - during) / MiB));

  kill(q, SIGKILL);
  cr_assert_eq(tdt_wait(q), 128 + SIGKILL);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  for (int i = 0; i < 50 && tdt_storages(&d) != 0; i++)
    sleep_ms(100);
  cr_assert_eq(tdt_storages(&d), 0, "the killed holder's storage is left");
  cr_assert_eq(daemon_gpu_bytes(), 0);
  uint64_t after = 0;
  /* Back to before, give or take 64 MiB of what others on the device do. */
  cr_assert(free_again(before - 64 * MiB, &after),
            "device free %llu MiB before, %llu MiB 10 s after the last "
            "holder was killed: the memory was not given back",
            (unsigned long long)(before / MiB),
            (unsigned long long)(after / MiB));
  chan_close(&hc);
  chan_close(&ch);
}

/* The consumer that outlives its creator: looks key up, says so (1), waits
 * for the word (the creator is dead by then), checks fill, writes and
 * checks fill + 1. */
static int survivor(void *arg) {
  die_with_parent();
  role *r = arg;
  td_client *c = NULL;
  td_storage *s = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, td_lookup(c, r->key, TD_TAKE, 10000, &s, NULL), 0);
  uint8_t uuid[16];
  CHECK_ERR(c, td_storage_device_uuid(s, uuid), 0);
  const td__cu *cu = gpu_enter(uuid, NULL);
  CHECK(cu != NULL);
  CHECK(td_storage_data(s) != NULL);
  CHECK(put(r->ch->from[1], 1) == 0);
  uint64_t v;
  CHECK(get(r->ch->to[0], &v) == 0);
  CHECK(all_are(cu, s, r->fill));
  CHECK(fill(cu, s, (unsigned char)(r->fill + 1)) == 0);
  CHECK(all_are(cu, s, (unsigned char)(r->fill + 1)));
  td_storage_release(s);
  td_close(c);
  return 0;
}

TDT_TEST(gpu, a_consumer_outlives_the_creator) {
  need_gpu();
  tdt_start(&d, NULL);
  chan ch;
  chan_open(&ch);
  role r = {.ch = &ch, .key = "weights", .nbytes = 32 * MiB, .fill = 0x42};
  pid_t p = tdt_fork(producer, &r);
  hear(&ch, p, "publishing");
  chan sc;
  chan_open(&sc);
  role s = {.ch = &sc, .key = "weights", .fill = 0x42};
  pid_t q = tdt_fork(survivor, &s);
  hear(&sc, q, "looking up");
  /* The exporting process dies while the importer still runs: the trap of
   * process-owned CUDA IPC that a daemon-owned allocation removes. */
  kill(p, SIGKILL);
  cr_assert_eq(tdt_wait(p), 128 + SIGKILL);
  tell(&sc, 1);
  cr_assert_eq(tdt_wait(q), 0,
               "the consumer failed after the creator died "
               "(see its stderr)");
  chan_close(&sc);
  chan_close(&ch);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  cr_assert_eq(tdt_storages(&d), 0);
}

/* Creates under --cuda-capacity 0=64M: 32 MiB fits, 48 MiB more does not
 * (TD_ENOMEM), 32 MiB more does; a device this process does not have is
 * TD_ENODEV naming it. */
static int over_capacity(void *arg) {
  die_with_parent();
  (void)arg;
  td_client *c = NULL;
  td_storage *a = NULL, *b = NULL, *x = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, create_cuda(c, 32 * MiB, &a), 0);
  CHECK_ERR(c, create_cuda(c, 48 * MiB, &x), TD_ENOMEM);
  fprintf(stderr, "over capacity: %s\n", td_last_error(c));
  CHECK_ERR(c, create_cuda(c, 32 * MiB, &b), 0);
  CHECK_ERR(c, create_cuda(c, 2 * MiB, &x), TD_ENOMEM);
  td_storage_release(a);
  CHECK_ERR(c, create_cuda(c, 2 * MiB, &x), 0);
  td_storage_release(x);
  td_storage_release(b);

  td_create_opts o = {0};
  o.nbytes = 2 * MiB;
  o.device = TD_CUDA;
  o.device_index = 4096;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &x), TD_ENODEV);
  fprintf(stderr, "no such device: %s\n", td_last_error(c));
  CHECK_MSG(c, "4096");
  td_close(c);
  return 0;
}

TDT_TEST(gpu, capacity_errors) {
  need_gpu();
  const char *args[] = {"--cuda-capacity", "0=64M", NULL};
  tdt_start(&d, args);
  cr_assert_eq(tdt_wait(tdt_fork(over_capacity, NULL)), 0,
               "see the child's stderr");
  cr_assert_eq(tdt_storages(&d), 0);
}

/* A create larger than the device's memory fails TD_ENOMEM (the default
 * capacity is below the device's total), not with a fault later. */
static int over_device(void *arg) {
  die_with_parent();
  (void)arg;
  const td__cu *cu = gpu_enter(NULL, NULL);
  CHECK(cu != NULL);
  size_t fr = 0, total = 0;
  CHECK(gpu_ok(cu, cu->MemGetInfo(&fr, &total), "cuMemGetInfo"));
  td_client *c = NULL;
  td_storage *x = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  CHECK_ERR(c, create_cuda(c, total + 2 * MiB, &x), TD_ENOMEM);
  fprintf(stderr, "larger than the device: %s\n", td_last_error(c));
  td_close(c);
  return 0;
}

TDT_TEST(gpu, larger_than_the_device_is_enomem) {
  need_gpu();
  tdt_start(&d, NULL);
  cr_assert_eq(tdt_wait(tdt_fork(over_device, NULL)), 0,
               "see the child's stderr");
  cr_assert_eq(tdt_storages(&d), 0);
}

/* ---- models loaded onto the GPU (issue 19 §3) ---- */

static char model_dir[64];
static const char *const model_files[] = {"m-1.safetensors", "m-2.safetensors",
                                          "m-3.safetensors"};

/* The file's bytes (malloc'd), *n their count; NULL if unreadable. */
static uint8_t *model_file(size_t i, size_t *n) {
  char p[160];
  snprintf(p, sizeof(p), "%s/%s", model_dir, model_files[i]);
  return tdt_read_file(p, n);
}

/* Loads the checkpoint onto cuda:0 through a 1 MiB staging buffer (the
 * first shard is 3 MiB: its slots are reused), then exits. */
static int model_loader(void *arg) {
  (void)arg;
  die_with_parent();
  td_client *c = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  setenv("TENSORD_LOAD_STAGING", "1M", 1);
  td_load_opts o = {.device = TD_CUDA, .device_index = 0, .threads = 3};
  td_load_result r;
  CHECK_ERR(c, td_model_load(c, model_dir, "gm", &o, &r), 0);
  CHECK(r.shards == 3 && r.tensors == 5);
  td_close(c);
  return 0;
}

/* Attaches the model and compares every byte of every shard, copied back
 * from the device, with its file. */
static int model_attacher(void *arg) {
  (void)arg;
  die_with_parent();
  td_client *c = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  td_model *m = NULL;
  CHECK_ERR(c, td_model_open(c, "gm", TD_RDONLY, 0, &m), 0);
  for (size_t i = 0; i < 3; i++) {
    char key[64];
    td_storage *s = NULL, *h = NULL;
    snprintf(key, sizeof(key), "gm@1/%s", model_files[i]);
    CHECK_ERR(c, td_lookup(c, key, TD_RDONLY, 0, &s, NULL), 0);
    CHECK(td_storage_device(s) == TD_CUDA);
    size_t n = 0;
    uint8_t *want = model_file(i, &n);
    CHECK(want != NULL && td_storage_nbytes(s) == n);
    CHECK_ERR(c, td_storage_create(c, n, &h), 0);
    int64_t shape = (int64_t)n;
    td_view v;
    CHECK(td_view_contiguous(TD_UINT8, 1, &shape, &v) == 0);
    CHECK(td_copy(h, &v, s, &v) == 0);
    CHECK(memcmp(td_storage_data(h), want, n) == 0);
    free(want);
    td_storage_release(h);
    td_storage_release(s);
  }
  td_model_close(m);
  td_close(c);
  return 0;
}

TDT_TEST(gpu, a_model_loaded_onto_the_gpu_is_its_files_in_every_process) {
  need_gpu();
  tdt_start(&d, NULL);
  tdt_mkdtemp(model_dir);
  static const tdt_st_tensor sh1[] = {{"a", "F32", 2, {768, 1024}},
                                      {"b", "I64", 1, {6}}};
  static const tdt_st_tensor sh2[] = {{"c", "BF16", 1, {10}}};
  static const tdt_st_tensor sh3[] = {{"d", "U8", 1, {(1 << 20) + 33}},
                                      {"e", "F64", 2, {3, 3}}};
  const tdt_st_tensor *sh[] = {sh1, sh2, sh3};
  size_t nt[] = {2, 1, 2};
  char p[160];
  for (size_t i = 0; i < 3; i++) {
    snprintf(p, sizeof(p), "%s/%s", model_dir, model_files[i]);
    cr_assert_eq(tdt_st_write(p, sh[i], nt[i], NULL, 9), 0);
  }
  snprintf(p, sizeof(p), "%s/model.safetensors.index.json", model_dir);
  cr_assert_eq(tdt_write_text(p, "{\"weight_map\":{"
                                 "\"a\":\"m-1.safetensors\","
                                 "\"b\":\"m-1.safetensors\","
                                 "\"c\":\"m-2.safetensors\","
                                 "\"d\":\"m-3.safetensors\","
                                 "\"e\":\"m-3.safetensors\"}}"),
               0);
  cr_assert_eq(tdt_wait(tdt_fork(model_loader, NULL)), 0,
               "the loader failed (see its stderr)");
  /* One allocation per shard, the loader gone. */
  cr_assert_eq(tdt_storages(&d), 4, "the manifest and 3 shards");
  td_client *c = tdt_connect(&d);
  td_device_stat g[16];
  size_t ng = 0;
  cr_assert_eq(td_stat_devices(c, g, 16, &ng), 0, "%s", td_last_error(c));
  uint64_t on_gpus = 0;
  for (size_t i = 0; i < ng && i < 16; i++)
    on_gpus += g[i].storages;
  cr_expect_eq(on_gpus, 3, "%llu storages on the GPUs for 3 shards",
               (unsigned long long)on_gpus);
  pid_t kids[3];
  for (int i = 0; i < 3; i++)
    kids[i] = tdt_fork(model_attacher, NULL);
  for (int i = 0; i < 3; i++)
    cr_expect_eq(tdt_wait(kids[i]), 0, "attacher %d failed (see its stderr)",
                 i);
  cr_assert_eq(td_model_unload(c, "gm"), 0, "%s", td_last_error(c));
  td_close(c);
  for (int i = 0; i < 50 && tdt_storages(&d) != 0; i++)
    sleep_ms(100);
  cr_expect_eq(tdt_storages(&d), 0);
  cr_expect_eq(daemon_gpu_bytes(), 0);
  tdt_rmdir(model_dir);
}

/* ---- td_copy on the GPU: the copy kernel and peer copies ---- */

/* Fills n bytes of CPU storage s from a seed. */
static void fill_host(td_storage *s, size_t n, unsigned seed) {
  unsigned char *p = td_storage_data(s);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245u + 12345u;
    p[i] = (unsigned char)(seed >> 16);
  }
}

/* Copies sv into dv between storages on cuda:sgpu and cuda:dgpu, both
 * filled from CPU storages first, reads the destination back and compares
 * it, whole, with td_copy of the same views between CPU storages. */
static int copy_matches_cpu(td_client *c, int dgpu, const td_view *dv,
                            size_t dn, int sgpu, const td_view *sv, size_t sn) {
  td_storage *hs, *hd, *ref, *gs, *gd;
  td_create_opts o = {0};
  o.device = TD_CUDA;
  CHECK_ERR(c, td_storage_create(c, sn, &hs), 0);
  CHECK_ERR(c, td_storage_create(c, dn, &hd), 0);
  CHECK_ERR(c, td_storage_create(c, dn, &ref), 0);
  o.nbytes = sn;
  o.device_index = sgpu;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &gs), 0);
  o.nbytes = dn;
  o.device_index = dgpu;
  CHECK_ERR(c, td_storage_create_ex(c, &o, &gd), 0);
  fill_host(hs, sn, 11);
  fill_host(ref, dn, 12);
  td_view whole_s, whole_d;
  int64_t ns = (int64_t)sn, nd = (int64_t)dn;
  CHECK(td_view_contiguous(TD_UINT8, 1, &ns, &whole_s) == 0);
  CHECK(td_view_contiguous(TD_UINT8, 1, &nd, &whole_d) == 0);
  CHECK(td_copy(gs, &whole_s, hs, &whole_s) == 0);
  CHECK(td_copy(gd, &whole_d, ref, &whole_d) == 0);
  CHECK(td_copy(ref, dv, hs, sv) == 0);
  if (td_copy(gd, dv, gs, sv) != 0) {
    fprintf(stderr, "td_copy on the GPU: %s\n", td_view_last_error());
    return 0;
  }
  CHECK(td_copy(hd, &whole_d, gd, &whole_d) == 0);
  int same = memcmp(td_storage_data(hd), td_storage_data(ref), dn) == 0;
  if (!same)
    fprintf(stderr,
            "td_copy cuda:%d -> cuda:%d: the bytes differ from a CPU "
            "copy's\n",
            sgpu, dgpu);
  td_storage_release(hs);
  td_storage_release(hd);
  td_storage_release(ref);
  td_storage_release(gs);
  td_storage_release(gd);
  return same;
}

/* Transposes and element-strided views of 1, 2, 4, 8 and 16-byte elements
 * on cuda:0, with the kernel and with it switched off; a dense and a
 * transposed copy to cuda:1 where there is one. In a child: the test's own
 * process never loads the driver. */
static int kernel_copier(void *arg) {
  (void)arg;
  die_with_parent();
  td_client *c = NULL;
  CHECK(td_connect(d.sock, &c) == 0);
  static const td_dtype dts[] = {TD_UINT8, TD_INT16, TD_FLOAT32, TD_INT64,
                                 TD_COMPLEX128};
  for (int off = 0; off < 2; off++) {
    if (off)
      setenv("TENSORD_CUDA_COPY_KERNEL", "0", 1);
    for (size_t k = 0; k < sizeof(dts) / sizeof(dts[0]); k++) {
      size_t es = td_dtype_size(dts[k]);
      int64_t s[3] = {37, 61, 3}, t[3] = {3, 61, 37};
      td_view sv, dv;
      CHECK(td_view_contiguous(dts[k], 3, s, &sv) == 0);
      CHECK(td_view_transpose(&sv, 0, 2) == 0);
      CHECK(td_view_contiguous(dts[k], 3, t, &dv) == 0);
      size_t n = (size_t)(37 * 61 * 3) * es;
      CHECK(copy_matches_cpu(c, 0, &dv, n, 0, &sv, n));
      /* Every other column into every third element, offset. */
      int64_t s2[2] = {50, 40};
      CHECK(td_view_contiguous(dts[k], 2, s2, &sv) == 0);
      CHECK(td_view_slice(&sv, 1, 1, 40, 2) == 0);
      dv = sv;
      dv.offset = 5;
      dv.stride[0] = 20 * 3;
      dv.stride[1] = 3;
      CHECK(copy_matches_cpu(c, 0, &dv, (size_t)(5 + 50 * 60) * es, 0, &sv,
                             (size_t)(50 * 40) * es));
    }
  }
  unsetenv("TENSORD_CUDA_COPY_KERNEL");
  td_view sv, dv;
  /* Many tiles, ragged at both edges, and more rows of tiles than one pass
   * of the grid: the tiled kernel's indexing. */
  int64_t odd[2] = {1000, 777}, oddt[2] = {777, 1000};
  CHECK(td_view_contiguous(TD_FLOAT32, 2, odd, &sv) == 0);
  CHECK(td_view_transpose(&sv, 0, 1) == 0);
  CHECK(td_view_contiguous(TD_FLOAT32, 2, oddt, &dv) == 0);
  CHECK(copy_matches_cpu(c, 0, &dv, (size_t)(1000 * 777) * 4, 0, &sv,
                         (size_t)(1000 * 777) * 4));
  int64_t big[2] = {1024, 768}, bigt[2] = {768, 1024};
  CHECK(td_view_contiguous(TD_FLOAT32, 2, big, &sv) == 0);
  dv = sv;
  size_t n = 1024 * 768 * 4;
  const td__cu *cu = gpu_enter(NULL, NULL);
  int ngpu = 0;
  if (cu != NULL)
    cu->DeviceGetCount(&ngpu);
  if (ngpu >= 2) {
    CHECK(copy_matches_cpu(c, 1, &dv, n, 0, &sv, n)); /* one peer copy */
    CHECK(td_view_transpose(&sv, 0, 1) == 0);
    CHECK(td_view_contiguous(TD_FLOAT32, 2, bigt, &dv) == 0);
    /* The kernel on cuda:1 where the GPUs reach each other, else staged. */
    CHECK(copy_matches_cpu(c, 1, &dv, n, 0, &sv, n));
  }
  td_close(c);
  return 0;
}

TDT_TEST(gpu, td_copy_kernel_and_peer_copies_match_the_cpu) {
  need_gpu();
  tdt_start(&d, NULL);
  cr_assert_eq(tdt_wait(tdt_fork(kernel_copier, NULL)), 0,
               "a GPU copy differs from the CPU's (see its stderr)");
}

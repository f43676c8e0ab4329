/* test_containers.c: a client in a mount namespace with a 1 MiB /dev/shm (a
 * container without --shm-size) moves 256 MiB both ways through a tensord
 * outside it, and a tensord inside such a namespace refuses what its
 * /dev/shm cannot hold with an error that names its size. */
#include "harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/statvfs.h>
#include <sys/stat.h>

#define BIG (256u << 20)    /* what crosses the namespace's boundary */
#define TINY_SHM (1u << 20) /* the namespace's /dev/shm */

static tdt_daemon d;

static void setup(void) {
  memset(&d, 0, sizeof(d));
}

TestSuite(containers, .init = setup, .fini = tdt_cleanup, .timeout = 120);

/* Moves the calling process into a mount namespace of its own whose
 * /dev/shm is a fresh tmpfs of TINY_SHM bytes, as a container without
 * --shm-size has (Docker's is 64 MiB; 1 MiB makes the point sharper). The
 * rest of the file system is shared (the socket under /tmp stays
 * reachable); the tmpfs goes with the namespace. Returns 0 or -errno. */
static int enter_tiny_shm(void) {
  if (unshare(CLONE_NEWNS) < 0)
    return -errno;
  /* Without this, the mount below would propagate back to the host's. */
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return -errno;
  char opts[32];
  snprintf(opts, sizeof(opts), "size=%u,mode=1777", TINY_SHM);
  if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
    return -errno;
  return 0;
}

static int probe(void *arg) {
  (void)arg;
  int err = enter_tiny_shm();
  if (err < 0)
    fprintf(stderr, "cannot make a mount namespace with a tiny /dev/shm: %s\n",
            strerror(-err));
  return err < 0 ? 77 : 0;
}

/* Skips the test where mount namespaces are not ours to make (not root, a
 * seccomp profile, a container without CAP_SYS_ADMIN). */
static void need_namespaces(void) {
  if (geteuid() != 0)
    cr_skip_test("a mount namespace with its own /dev/shm needs root");
  int st = tdt_wait(tdt_fork(probe, NULL));
  if (st == 77)
    cr_skip_test("unshare(CLONE_NEWNS) or mounting a tmpfs is not permitted "
                 "here");
  cr_assert_eq(st, 0, "the namespace probe exited %d", st);
}

/* The pattern word i of a storage filled with seed holds. */
static uint64_t word(size_t i, uint64_t seed) {
  return (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
}

static void fill(td_storage *s, uint64_t seed) {
  uint64_t *p = td_storage_data(s);
  for (size_t i = 0; i < td_storage_nbytes(s) / 8; i++)
    p[i] = word(i, seed);
}

/* Returns the index of the first word that is not the pattern's, or the
 * number of words if all are. */
static size_t first_bad(const td_storage *s, uint64_t seed) {
  const uint64_t *p = td_storage_data(s);
  size_t n = td_storage_nbytes(s) / 8;
  for (size_t i = 0; i < n; i++)
    if (p[i] != word(i, seed))
      return i;
  return n;
}

#define GUEST_SEED 0x6775657374ull /* what the guest writes */
#define HOST_SEED 0x686f7374ull    /* what the host writes */
#define BACK_SEED 0x6261636bull    /* what the guest writes over the host's */

/* The client in the container: proves its /dev/shm is tiny and that it
 * cannot make 256 MiB of shared memory there itself, then creates, fills
 * and publishes 256 MiB through the host's tensord, and rewrites the
 * host's 256 MiB once it has checked them. */
static int guest(void *arg) {
  (void)arg;
  CHECK(enter_tiny_shm() == 0);
  struct statvfs sv;
  CHECK(statvfs("/dev/shm", &sv) == 0);
  CHECK((uint64_t)sv.f_blocks * sv.f_frsize <= TINY_SHM);

  /* The control: its own /dev/shm cannot hold the storage. */
  char name[64];
  snprintf(name, sizeof(name), "/tdt-containers-control.%d", (int)getpid());
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  CHECK(fd >= 0);
  int ferr = posix_fallocate(fd, 0, BIG);
  close(fd);
  shm_unlink(name);
  CHECK(ferr == ENOSPC);

  td_client *c;
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  td_storage *s;
  CHECK_ERR(c, td_storage_create(c, BIG, &s), 0);
  fill(s, GUEST_SEED);
  CHECK_ERR(c, td_publish(c, "guest/out", s, NULL), 0);
  CHECK_ERR(c, td_storage_release(s), 0);

  td_storage *h;
  CHECK_ERR(c, td_lookup(c, "host/in", 0, 60000, &h, NULL), 0);
  CHECK(td_storage_nbytes(h) == BIG);
  CHECK(first_bad(h, HOST_SEED) == BIG / 8);
  fill(h, BACK_SEED);
  CHECK_ERR(c, td_storage_release(h), 0);
  /* Its tiny /dev/shm is as empty as before: the bytes were the host's. */
  CHECK(statvfs("/dev/shm", &sv) == 0);
  CHECK(sv.f_bfree == sv.f_blocks);
  td_close(c);
  return 0;
}

TDT_TEST(containers, client_with_tiny_shm_moves_256mib_both_ways) {
  need_namespaces();
  tdt_start(&d, NULL);
  pid_t pid = tdt_fork(guest, NULL);

  td_client *c = tdt_connect(&d);
  td_storage *h;
  cr_assert_eq(td_storage_create(c, BIG, &h), 0, "%s", td_last_error(c));
  fill(h, HOST_SEED);
  cr_assert_eq(td_publish(c, "host/in", h, NULL), 0, "%s", td_last_error(c));
  int st = tdt_wait(pid);
  cr_assert_eq(st, 0, "the client in the namespace exited %d", st);

  /* What the guest made, read on the host. */
  td_storage *g;
  cr_assert_eq(td_lookup(c, "guest/out", TD_RDONLY, 0, &g, NULL), 0, "%s",
               td_last_error(c));
  cr_assert_eq(td_storage_nbytes(g), BIG);
  size_t bad = first_bad(g, GUEST_SEED);
  cr_assert_eq(bad, BIG / 8, "the guest's storage differs at word %zu", bad);
  /* What the guest wrote over the host's storage. */
  bad = first_bad(h, BACK_SEED);
  cr_assert_eq(bad, BIG / 8,
               "the host's storage, rewritten by the guest, "
               "differs at word %zu",
               bad);

  /* The host's /dev/shm is the big one still: the guest's tmpfs went with
   * its namespace. */
  struct statvfs sv;
  cr_assert_eq(statvfs("/dev/shm", &sv), 0);
  cr_assert_gt((uint64_t)sv.f_blocks * sv.f_frsize, (uint64_t)TINY_SHM);

  cr_assert_eq(td_unpublish(c, "guest/out"), 0, "%s", td_last_error(c));
  cr_assert_eq(td_unpublish(c, "host/in"), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_release(g), 0);
  cr_assert_eq(td_storage_release(h), 0);
  td_close(c);
}

/* tensord itself in a namespace with a 1 MiB /dev/shm and a --capacity far
 * above it, so that the capacity check does not refuse first: a create of
 * 16 MiB fails with TD_ENOSPC and a message naming /dev/shm's size and what
 * is free, no SIGBUS anywhere, and the daemon goes on serving. The test's
 * own process enters the namespace, so that the harness's checks for
 * segments look where that tensord makes them. */
TDT_TEST(containers, daemon_with_tiny_shm_names_its_size) {
  need_namespaces();
  int err = enter_tiny_shm();
  cr_assert_eq(err, 0, "enter_tiny_shm: %s", strerror(-err));
  tdt_start(&d, (const char *const[]){"--capacity", "1G", NULL});
  cr_assert(tdt_log_has(&d, "more than /dev/shm holds (1.0 MiB)"),
            "no warning at start that --capacity is more than /dev/shm");

  td_client *c = tdt_connect(&d);
  td_storage *s = NULL;
  err = td_storage_create(c, 16u << 20, &s);
  cr_assert_eq(err, TD_ENOSPC, "create 16 MiB: %s (%d): %s",
               err ? td_err_name(err) : "0", err, td_last_error(c));
  const char *m = td_last_error(c);
  cr_assert(strstr(m, "/dev/shm") && strstr(m, "16.0 MiB") &&
                strstr(m, "of 1.0 MiB") && strstr(m, "free"),
            "message '%s' names neither the request nor /dev/shm's size and "
            "free space",
            m);
  /* The words the docs' tables quote, whichever check refused it. */
  cr_assert(strstr(m, "/dev/shm cannot hold 16.0 MiB (16777216 bytes): "),
            "message '%s' is not the one docs/containers.md quotes", m);

  /* It keeps serving: what fits is made and works. */
  cr_assert_eq(td_storage_create(c, 64u << 10, &s), 0, "%s", td_last_error(c));
  memset(td_storage_data(s), 0xab, 64u << 10);
  cr_assert_eq(td_storage_release(s), 0);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "%s", td_last_error(c));
  cr_assert_leq(st.shm_free, (uint64_t)TINY_SHM);
  td_close(c);
}

/* ---- user namespaces (rootless containers, userns-remap, hostUsers) ---- */

#define HOST_UID 4246 /* the container's root, seen from the host */

static int write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  ssize_t n = write(fd, text, strlen(text));
  int err = n == (ssize_t)strlen(text) ? 0 : -errno;
  close(fd);
  return err;
}

static int owner_of(const td_storage_info *info, void *arg) {
  *(uint32_t *)arg = info->owner_uid;
  return 0;
}

/* A process of host uid HOST_UID that becomes root in a user namespace of
 * its own, as in a rootless container: tensord (host root) is unmapped
 * there, so its uid reads as the overflow uid and the client refuses it,
 * saying why; TENSORD_TRUST_UID=65534 lets it in, and tensord sees the
 * client as HOST_UID, its uid in tensord's namespace. */
static int userns_guest(void *arg) {
  (void)arg;
  CHECK(setgroups(0, NULL) == 0 && setgid(HOST_UID) == 0 &&
        setuid(HOST_UID) == 0);
  /* A change of uid makes the process undumpable, which gives its /proc
   * files to root: it could not write its own maps. */
  CHECK(prctl(PR_SET_DUMPABLE, 1) == 0);
  if (unshare(CLONE_NEWUSER) < 0) {
    fprintf(stderr, "unshare(CLONE_NEWUSER): %s\n", strerror(errno));
    return 77;
  }
  char map[32];
  snprintf(map, sizeof(map), "0 %d 1\n", HOST_UID);
  CHECK(write_file("/proc/self/setgroups", "deny") == 0);
  CHECK(write_file("/proc/self/uid_map", map) == 0);
  CHECK(write_file("/proc/self/gid_map", map) == 0);
  CHECK(getuid() == 0 && geteuid() == 0);

  unsetenv("TENSORD_TRUST_UID");
  td_client *c = NULL;
  CHECK_ERR(NULL, td_connect(d.sock, &c), TD_EACCES);
  CHECK_MSG(NULL, "runs as uid 65534");
  CHECK_MSG(NULL, "overflow uid");

  setenv("TENSORD_TRUST_UID", "65534", 1);
  CHECK_ERR(NULL, td_connect(d.sock, &c), 0);
  td_storage *s;
  CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
  uint32_t owner = 0;
  CHECK_ERR(c, td_info(c, td_storage_id(s), NULL, owner_of, NULL, &owner), 0);
  CHECK(owner == HOST_UID); /* not 0, this process's uid here */
  CHECK_ERR(c, td_storage_release(s), 0);
  td_close(c);
  return 0;
}

TDT_TEST(containers, user_namespace_root_is_its_host_uid_to_tensord) {
  if (geteuid() != 0)
    cr_skip_test("becoming another host uid needs root");
  tdt_start(&d, (const char *const[]){"--socket-mode", "0666", NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0, "chmod %s: %s", d.dir, strerror(errno));
  int st = tdt_wait(tdt_fork(userns_guest, NULL));
  if (st == 77)
    cr_skip_test("user namespaces are not permitted here");
  cr_assert_eq(st, 0, "the client in the user namespace exited %d", st);
}

/* test_hugepages.c: the parsers of shmem_enabled, /proc/mounts and
 * /proc/meminfo that decide what the daemon logs and when libtensord
 * madvises huge pages. */
#include "hugepages.h"

#include <criterion/criterion.h>
#include <string.h>

Test(hugepages, sysfs_bracketed_word) {
  cr_expect_eq(
      td__thp_parse_sysfs("always within_size advise [never] deny force\n"),
      TD__THP_NEVER);
  cr_expect_eq(
      td__thp_parse_sysfs("always [within_size] advise never deny force\n"),
      TD__THP_WITHIN_SIZE);
  cr_expect_eq(td__thp_parse_sysfs("[always] advise never\n"), TD__THP_ALWAYS);
  cr_expect_eq(td__thp_parse_sysfs("always [advise] never\n"), TD__THP_ADVISE);
  cr_expect_eq(td__thp_parse_sysfs("always advise never deny [force]"),
               TD__THP_FORCE);
  cr_expect_eq(td__thp_parse_sysfs("always advise never [deny] force"),
               TD__THP_DENY);
}

Test(hugepages, sysfs_unreadable_or_garbled) {
  cr_expect_eq(td__thp_parse_sysfs(NULL), TD__THP_UNKNOWN);
  cr_expect_eq(td__thp_parse_sysfs(""), TD__THP_UNKNOWN);
  cr_expect_eq(td__thp_parse_sysfs("always advise never"), TD__THP_UNKNOWN);
  cr_expect_eq(td__thp_parse_sysfs("[never"), TD__THP_UNKNOWN);
  cr_expect_eq(td__thp_parse_sysfs("[sometimes] never"), TD__THP_UNKNOWN);
}

static const char *const mounts_plain =
    "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n"
    "tmpfs /dev/shm tmpfs rw,relatime,size=24683548k 0 0\n"
    "/dev/vda / ext4 rw,relatime 0 0\n";

Test(hugepages, mount_without_huge_is_never) {
  cr_expect_eq(td__thp_parse_mount(mounts_plain, "/dev/shm"), TD__THP_NEVER);
}

Test(hugepages, mount_huge_option) {
  cr_expect_eq(
      td__thp_parse_mount(
          "tmpfs /dev/shm tmpfs rw,huge=within_size,size=1g 0 0\n", "/dev/shm"),
      TD__THP_WITHIN_SIZE);
  cr_expect_eq(
      td__thp_parse_mount("tmpfs /dev/shm tmpfs rw,nosuid,huge=advise 0 0",
                          "/dev/shm"),
      TD__THP_ADVISE);
  cr_expect_eq(
      td__thp_parse_mount("shm /dev/shm tmpfs huge=always 0 0\n", "/dev/shm"),
      TD__THP_ALWAYS);
}

Test(hugepages, mount_matches_whole_directory) {
  /* /dev/shmem is not /dev/shm, and a mount elsewhere says nothing. */
  const char *m = "tmpfs /dev/shmem tmpfs rw,huge=always 0 0\n"
                  "tmpfs /run tmpfs rw,huge=always 0 0\n";
  cr_expect_eq(td__thp_parse_mount(m, "/dev/shm"), TD__THP_UNKNOWN);
  cr_expect_eq(td__thp_parse_mount(NULL, "/dev/shm"), TD__THP_UNKNOWN);
  cr_expect_eq(td__thp_parse_mount("", "/dev/shm"), TD__THP_UNKNOWN);
}

Test(hugepages, last_mount_over_a_directory_wins) {
  const char *m = "tmpfs /dev/shm tmpfs rw,huge=always 0 0\n"
                  "tmpfs /dev/shm tmpfs rw,size=1g 0 0\n";
  cr_expect_eq(td__thp_parse_mount(m, "/dev/shm"), TD__THP_NEVER);
  const char *n = "tmpfs /dev/shm tmpfs rw,huge=always 0 0\n"
                  "none /dev/shm ramfs rw 0 0\n";
  cr_expect_eq(td__thp_parse_mount(n, "/dev/shm"), TD__THP_UNKNOWN);
}

static const char *const meminfo_none = "MemTotal:       32874120 kB\n"
                                        "ShmemHugePages:        0 kB\n"
                                        "HugePages_Total:       0\n"
                                        "HugePages_Free:        0\n"
                                        "HugePages_Rsvd:        0\n"
                                        "Hugepagesize:       2048 kB\n";

Test(hugepages, this_hosts_kind_uses_small_pages) {
  td__huge_info h;
  td__huge_parse("always within_size advise [never] deny force\n", mounts_plain,
                 meminfo_none, &h);
  cr_expect_eq(h.shmem_enabled, TD__THP_NEVER);
  cr_expect_eq(h.devshm, TD__THP_NEVER);
  cr_expect_eq(h.effective, TD__THP_NEVER);
  cr_expect_eq(h.hugetlb_total, 0);
  cr_expect_eq(h.hugetlb_pagesize, 2048 * 1024);
  cr_expect_str_empty(h.hugetlbfs);
  char line[512];
  cr_expect_str_eq(td__huge_describe(&h, line, sizeof(line)),
                   "shmem THP 'never', /dev/shm huge=never, no hugetlbfs "
                   "pool: using 4 KiB pages");
}

Test(hugepages, sysfs_deny_and_force_override_the_mount) {
  td__huge_info h;
  td__huge_parse("always advise never [deny] force",
                 "tmpfs /dev/shm tmpfs rw,huge=always 0 0\n", NULL, &h);
  cr_expect_eq(h.devshm, TD__THP_ALWAYS);
  cr_expect_eq(h.effective, TD__THP_NEVER);
  td__huge_parse("always advise never deny [force]", mounts_plain, NULL, &h);
  cr_expect_eq(h.effective, TD__THP_ALWAYS);
}

Test(hugepages, mount_decides_otherwise) {
  /* The sysfs knob is the kernel's internal mount's (memfd, SysV); /dev/shm
   * follows its own huge= unless the knob says deny or force. */
  td__huge_info h;
  td__huge_parse("always [advise] never", "tmpfs /dev/shm tmpfs rw 0 0\n", NULL,
                 &h);
  cr_expect_eq(h.effective, TD__THP_NEVER);
  td__huge_parse("always advise [never]",
                 "tmpfs /dev/shm tmpfs rw,huge=advise 0 0\n", NULL, &h);
  cr_expect_eq(h.effective, TD__THP_ADVISE);
  char line[512];
  cr_expect_str_eq(td__huge_describe(&h, line, sizeof(line)),
                   "shmem THP 'never', /dev/shm huge=advise, no hugetlbfs "
                   "pool: clients madvise(MADV_HUGEPAGE) mappings of 2 MiB "
                   "and up");
}

Test(hugepages, hugetlbfs_pool_found_but_unused) {
  td__huge_info h;
  td__huge_parse(NULL,
                 "tmpfs /dev/shm tmpfs rw 0 0\n"
                 "hugetlbfs /dev/hugepages hugetlbfs rw,pagesize=1024M 0 0\n",
                 "HugePages_Total:      16\nHugePages_Free:       12\n"
                 "Hugepagesize:    1048576 kB\n",
                 &h);
  cr_expect_eq(h.shmem_enabled, TD__THP_UNKNOWN);
  cr_expect_eq(h.hugetlb_total, 16);
  cr_expect_eq(h.hugetlb_free, 12);
  cr_expect_eq(h.hugetlb_pagesize, 1ull << 30);
  cr_expect_str_eq(h.hugetlbfs, "/dev/hugepages");
  char line[512];
  cr_expect_str_eq(td__huge_describe(&h, line, sizeof(line)),
                   "shmem THP 'unknown', /dev/shm huge=never, hugetlbfs pool "
                   "of 16 x 1 GiB pages (12 free) at /dev/hugepages, found "
                   "but unused (no hugetlbfs backend): using 4 KiB pages");
}

Test(hugepages, probe_reads_this_host) {
  /* Whatever the host has, the probe fills a consistent answer. */
  td__huge_info h;
  td__huge_probe(&h);
  cr_expect(h.effective != TD__THP_UNKNOWN);
  char line[512];
  cr_expect(strlen(td__huge_describe(&h, line, sizeof(line))) > 0);
}

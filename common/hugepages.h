/* hugepages.h: what the host offers in huge pages for shm segments, read
 * from sysfs and /proc by the daemon (to log it) and libtensord (to madvise
 * where the host asks for it). */
#ifndef TD_COMMON_HUGEPAGES_H
#define TD_COMMON_HUGEPAGES_H

#include <stddef.h>
#include <stdint.h>

/* A transparent-huge-page policy for shmem: the bracketed word of
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled, or the huge= option of
 * a tmpfs mount. */
typedef enum {
  TD__THP_UNKNOWN = 0, /* unreadable, or no such mount */
  TD__THP_NEVER,
  TD__THP_ALWAYS,
  TD__THP_WITHIN_SIZE,
  TD__THP_ADVISE,
  TD__THP_DENY,  /* sysfs only: huge pages off on every mount */
  TD__THP_FORCE, /* sysfs only: huge pages on on every mount */
} td__thp;

typedef struct td__huge_info {
  td__thp shmem_enabled; /* the sysfs knob (the kernel's internal mount) */
  td__thp devshm;        /* /dev/shm's huge= (NEVER when it has none) */
  td__thp effective;     /* what /dev/shm's segments get: see td__huge_parse */
  uint64_t hugetlb_total, hugetlb_free; /* pages in the hugetlbfs pool */
  uint64_t hugetlb_pagesize;            /* bytes; 0 if unknown */
  char hugetlbfs[128];                  /* a hugetlbfs mount point, or "" */
} td__huge_info;

/* The name of a policy as the kernel writes it ("within_size"), or
 * "unknown". */
const char *td__thp_name(td__thp t);

/* Returns the bracketed word of a shmem_enabled text ("always within_size
 * advise [never] deny force"), TD__THP_UNKNOWN if there is none. */
td__thp td__thp_parse_sysfs(const char *text);

/* Returns the huge= option of the tmpfs mounted last at dir in a
 * /proc/mounts text: TD__THP_NEVER if it has none (tmpfs's default),
 * TD__THP_UNKNOWN if no tmpfs is mounted there. */
td__thp td__thp_parse_mount(const char *mounts, const char *dir);

/* Fills out from the texts of shmem_enabled, /proc/mounts and /proc/meminfo
 * (any may be NULL: unreadable). The effective policy of /dev/shm is the
 * sysfs knob where it overrides every mount (deny: NEVER; force: ALWAYS),
 * else /dev/shm's own huge=. Pure: reads nothing else. */
void td__huge_parse(const char *shmem_enabled, const char *mounts,
                    const char *meminfo, td__huge_info *out);

/* Reads the three files and td__huge_parse's them (all unknown if it
 * cannot allocate the 72 KiB it reads them into). */
void td__huge_probe(td__huge_info *out);

/* Writes one line saying what was found and what follows from it to buf
 * ("shmem THP 'never', /dev/shm huge=never, no hugetlbfs pool: using 4 KiB
 * pages"); returns buf. */
char *td__huge_describe(const td__huge_info *h, char *buf, size_t len);

#endif /* TD_COMMON_HUGEPAGES_H */

/* hugepages.c: reads what the host offers in huge pages for shm segments. */
#include "hugepages.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const struct {
  const char *name;
  td__thp thp;
} names[] = {
    {"never", TD__THP_NEVER},
    {"always", TD__THP_ALWAYS},
    {"within_size", TD__THP_WITHIN_SIZE},
    {"advise", TD__THP_ADVISE},
    {"deny", TD__THP_DENY},
    {"force", TD__THP_FORCE},
};

const char *td__thp_name(td__thp t) {
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (names[i].thp == t)
      return names[i].name;
  return "unknown";
}

/* Returns the policy named by the len bytes at s, TD__THP_UNKNOWN if none. */
static td__thp thp_of(const char *s, size_t len) {
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (strlen(names[i].name) == len && memcmp(names[i].name, s, len) == 0)
      return names[i].thp;
  return TD__THP_UNKNOWN;
}

td__thp td__thp_parse_sysfs(const char *text) {
  const char *open = text != NULL ? strchr(text, '[') : NULL;
  const char *close = open != NULL ? strchr(open, ']') : NULL;
  if (close == NULL)
    return TD__THP_UNKNOWN;
  return thp_of(open + 1, (size_t)(close - open - 1));
}

/* Copies the next space-separated field of the line at *p (which ends at
 * end) into f (len bytes, cut to fit) and moves *p past it; returns the
 * field's length, 0 when the line has no more. */
static size_t field(const char **p, const char *end, char *f, size_t len) {
  const char *s = *p;
  while (s < end && (*s == ' ' || *s == '\t'))
    s++;
  const char *e = s;
  while (e < end && *e != ' ' && *e != '\t')
    e++;
  size_t n = (size_t)(e - s);
  size_t c = n < len - 1 ? n : len - 1;
  memcpy(f, s, c);
  f[c] = '\0';
  *p = e;
  return n;
}

/* Calls fn for each line of a /proc/mounts text with its mount point, file
 * system type and options. */
static void each_mount(const char *mounts,
                       void (*fn)(const char *dir, const char *type,
                                  const char *opts, void *arg),
                       void *arg) {
  const char *p = mounts;
  while (p != NULL && *p != '\0') {
    const char *end = strchr(p, '\n');
    if (end == NULL)
      end = p + strlen(p);
    char dev[256], dir[256], type[64], opts[1024];
    const char *q = p;
    if (field(&q, end, dev, sizeof(dev)) > 0 &&
        field(&q, end, dir, sizeof(dir)) > 0 &&
        field(&q, end, type, sizeof(type)) > 0 &&
        field(&q, end, opts, sizeof(opts)) > 0)
      fn(dir, type, opts, arg);
    p = *end == '\n' ? end + 1 : end;
  }
}

typedef struct mount_q {
  const char *dir;
  td__thp thp;
} mount_q;

static void on_tmpfs(const char *dir, const char *type, const char *opts,
                     void *arg) {
  mount_q *q = arg;
  if (strcmp(dir, q->dir) != 0)
    return;
  /* A later mount over the same directory hides the earlier ones. */
  if (strcmp(type, "tmpfs") != 0) {
    q->thp = TD__THP_UNKNOWN;
    return;
  }
  q->thp = TD__THP_NEVER;
  for (const char *o = opts; o != NULL && *o != '\0';) {
    const char *comma = strchr(o, ',');
    size_t n = comma != NULL ? (size_t)(comma - o) : strlen(o);
    if (n > 5 && memcmp(o, "huge=", 5) == 0)
      q->thp = thp_of(o + 5, n - 5);
    o = comma != NULL ? comma + 1 : NULL;
  }
}

td__thp td__thp_parse_mount(const char *mounts, const char *dir) {
  mount_q q = {dir, TD__THP_UNKNOWN};
  each_mount(mounts, on_tmpfs, &q);
  return q.thp;
}

static void on_hugetlbfs(const char *dir, const char *type, const char *opts,
                         void *arg) {
  (void)opts;
  td__huge_info *h = arg;
  if (strcmp(type, "hugetlbfs") == 0 && h->hugetlbfs[0] == '\0')
    snprintf(h->hugetlbfs, sizeof(h->hugetlbfs), "%s", dir);
}

/* Returns the number after "key:" at the start of a line of a /proc/meminfo
 * text, times 1024 if the line says kB; 0 if there is no such line. */
static uint64_t meminfo_value(const char *meminfo, const char *key) {
  size_t klen = strlen(key);
  for (const char *p = meminfo; p != NULL && *p != '\0';) {
    if (strncmp(p, key, klen) == 0 && p[klen] == ':') {
      char *end;
      uint64_t v = strtoull(p + klen + 1, &end, 10);
      while (*end == ' ')
        end++;
      return strncmp(end, "kB", 2) == 0 ? v * 1024 : v;
    }
    p = strchr(p, '\n');
    if (p != NULL)
      p++;
  }
  return 0;
}

void td__huge_parse(const char *shmem_enabled, const char *mounts,
                    const char *meminfo, td__huge_info *out) {
  memset(out, 0, sizeof(*out));
  out->shmem_enabled = td__thp_parse_sysfs(shmem_enabled);
  out->devshm = td__thp_parse_mount(mounts, "/dev/shm");
  if (out->shmem_enabled == TD__THP_DENY)
    out->effective = TD__THP_NEVER;
  else if (out->shmem_enabled == TD__THP_FORCE)
    out->effective = TD__THP_ALWAYS;
  else if (out->devshm == TD__THP_UNKNOWN)
    out->effective = TD__THP_NEVER;
  else
    out->effective = out->devshm;
  each_mount(mounts, on_hugetlbfs, out);
  out->hugetlb_total = meminfo_value(meminfo, "HugePages_Total");
  out->hugetlb_free = meminfo_value(meminfo, "HugePages_Free");
  out->hugetlb_pagesize = meminfo_value(meminfo, "Hugepagesize");
}

/* Reads up to len - 1 bytes of path into buf; returns buf, or NULL if the
 * file cannot be read. */
static char *slurp(const char *path, char *buf, size_t len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return NULL;
  size_t n = 0;
  ssize_t r;
  while (n < len - 1 && (r = read(fd, buf + n, len - 1 - n)) > 0)
    n += (size_t)r;
  close(fd);
  buf[n] = '\0';
  return buf;
}

void td__huge_probe(td__huge_info *out) {
  enum { SYSFS = 256, MOUNTS = 65536, MEMINFO = 8192 };
  char *buf = malloc(SYSFS + MOUNTS + MEMINFO); /* the mount table is long */
  if (buf == NULL) {
    td__huge_parse(NULL, NULL, NULL, out);
    return;
  }
  td__huge_parse(
      slurp("/sys/kernel/mm/transparent_hugepage/shmem_enabled", buf, SYSFS),
      slurp("/proc/mounts", buf + SYSFS, MOUNTS),
      slurp("/proc/meminfo", buf + SYSFS + MOUNTS, MEMINFO), out);
  free(buf);
}

/* Writes n bytes as "2 MiB" or "1 GiB" into buf; returns buf. */
static char *page_size(uint64_t n, char *buf, size_t len) {
  if (n >= (1u << 30) && n % (1u << 30) == 0)
    snprintf(buf, len, "%llu GiB", (unsigned long long)(n >> 30));
  else if (n >= (1u << 20) && n % (1u << 20) == 0)
    snprintf(buf, len, "%llu MiB", (unsigned long long)(n >> 20));
  else
    snprintf(buf, len, "%llu KiB", (unsigned long long)(n >> 10));
  return buf;
}

char *td__huge_describe(const td__huge_info *h, char *buf, size_t len) {
  char devshm[48], pool[320], ps[32];
  if (h->devshm == TD__THP_UNKNOWN)
    snprintf(devshm, sizeof(devshm), "/dev/shm not a tmpfs");
  else
    snprintf(devshm, sizeof(devshm), "/dev/shm huge=%s",
             td__thp_name(h->devshm));
  page_size(h->hugetlb_pagesize, ps, sizeof(ps));
  if (h->hugetlb_total == 0)
    snprintf(pool, sizeof(pool), "no hugetlbfs pool");
  else
    snprintf(pool, sizeof(pool),
             "hugetlbfs pool of %llu x %s pages (%llu free)%s%s, found but "
             "unused (no hugetlbfs backend)",
             (unsigned long long)h->hugetlb_total, ps,
             (unsigned long long)h->hugetlb_free,
             h->hugetlbfs[0] ? " at " : ", not mounted", h->hugetlbfs);
  const char *use;
  switch (h->effective) {
  case TD__THP_ALWAYS:
  case TD__THP_WITHIN_SIZE:
    use = "segments get huge pages from the kernel";
    break;
  case TD__THP_ADVISE:
    use = "clients madvise(MADV_HUGEPAGE) mappings of 2 MiB and up";
    break;
  default:
    use = "using 4 KiB pages";
    break;
  }
  snprintf(buf, len, "shmem THP '%s', %s, %s: %s",
           td__thp_name(h->shmem_enabled), devshm, pool, use);
  return buf;
}

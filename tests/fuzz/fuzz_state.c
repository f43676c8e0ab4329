/* fuzz_state.c: the libFuzzer target over --state-dir loading: the snapshot
 * and journal parser, adoption of recorded segments, and the sweep of
 * unnamed ones (td__state_open in daemon/server/state.c).
 *
 * Each input (laid out as state_input.h says) becomes a state directory: a
 * snapshot and journals, and the segments their records name, some missing
 * or of the wrong size. A daemon set up with td__server_init (no socket)
 * loads it with td__state_open; a copy of the directory right after the
 * load, and the directory after a clean stop (its final snapshot), are each
 * loaded again. The harness checks:
 *   - the load succeeds, or fails with TD_EBUSY, touching nothing, while
 *     another process holds the directory's lock;
 *   - every adopted storage is consistent: its segment exists with its size,
 *     its references are exactly its keys, every key's view lies inside it,
 *     and the accounting adds up;
 *   - the keys served are those a model of the records says: the last put
 *     of each key not deleted since, read up to the first bad record of each
 *     file, whose segment exists with the recorded size, and whose key and
 *     view are valid (where the model cannot tell, either is accepted);
 *   - the sweep unlinks exactly the unadopted segments under well-formed
 *     recorded prefixes ("/tensord.<instance>."), and nothing else;
 *   - the directory as a crash right after the load would leave it, and the
 *     final snapshot of a clean stop, each loaded again, serve the same
 *     keys;
 *   - no fd is leaked, and (under ASan) nothing leaks.
 *
 * The daemon never touches the real /dev/shm here: this file defines
 * shm_open, shm_unlink and opendir (which the daemon's code calls) so that
 * segment names live in a private directory, and /dev/shm read by the sweep
 * is that directory. Names in the corpus are therefore fixed, and two runs
 * at once cannot collide. Linked with replay.c it is also a plain program
 * (fuzz_state_replay) that ctest runs over tests/fuzz/state_corpus. */
#include "common.h"
#include "log.h"
#include "conn.h"
#include "start.h"
#include "state.h"
#include "state_input.h"
#include "view_sure.h"

#include "tensord.pb-c.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The harness's segments besides those the records name: one whose name is
 * no tensord segment's, and one of another instance. */
#define OTHER_APP "/other-app.1"
#define BYSTANDER "/tensord.b5b5b5b5b5b5b5b5.1"
#define SEGS_MAX 64

static char base[PATH_MAX]; /* private: <base>/shm is /dev/shm, <base>/state */
static char shm_dir[PATH_MAX + 8];
static char state_dir[PATH_MAX + 8];
static char crash_dir[PATH_MAX + 8]; /* state_dir as a crash would leave it */
static uv_loop_t loop;
static td__server srv;
static uint32_t serial;
static int verbose;

static void remove_tree(const char *dir);

/* Reports a broken invariant and aborts, after removing the private
 * directory. */
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void die(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "fuzz_state: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  if (base[0] != '\0')
    remove_tree(base);
  abort();
}

/* ---- a private /dev/shm ---- */

/* Maps a POSIX shm name to its file in shm_dir, as glibc maps it to
 * /dev/shm: leading slashes go; the rest must be one path component.
 * Returns 0, or -1 with errno set. */
static int shm_path(const char *name, char *out, size_t len) {
  if (shm_dir[0] == '\0') {
    errno = EACCES; /* never the real /dev/shm */
    return -1;
  }
  while (*name == '/')
    name++;
  size_t n = strlen(name);
  if (n == 0 || n >= NAME_MAX || strchr(name, '/') != NULL ||
      strcmp(name, ".") == 0 || strcmp(name, "..") == 0) {
    errno = EINVAL;
    return -1;
  }
  snprintf(out, len, "%s/%s", shm_dir, name);
  return 0;
}

int shm_open(const char *name, int oflag, mode_t mode) {
  char path[PATH_MAX + 300];
  if (shm_path(name, path, sizeof(path)) < 0)
    return -1;
  return open(path, oflag | O_NOFOLLOW | O_CLOEXEC, mode);
}

int shm_unlink(const char *name) {
  char path[PATH_MAX + 300];
  if (shm_path(name, path, sizeof(path)) < 0)
    return -1;
  return unlink(path);
}

DIR *opendir(const char *name) {
  static DIR *(*real)(const char *);
  if (real == NULL)
    *(void **)&real = dlsym(RTLD_NEXT, "opendir");
  if (strcmp(name, "/dev/shm") == 0 && shm_dir[0] != '\0')
    name = shm_dir;
  return real(name);
}

static void remove_tree(const char *dir) {
  /* Only a directory of ours: /tmp/tensord-fuzz-state.<pid> could be
   * another user's symlink or directory. */
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0)
    return;
  DIR *d = NULL;
  if (fstat(fd, &st) < 0 || st.st_uid != geteuid() ||
      (d = fdopendir(fd)) == NULL) {
    close(fd);
    return;
  }
  struct dirent *e;
  char path[PATH_MAX + 300];
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
    if (e->d_type == DT_DIR)
      remove_tree(path);
    else
      unlink(path);
  }
  closedir(d);
  rmdir(dir);
}

/* The file segment name is, as shm_path maps it: names differing only in
 * leading slashes are one file. */
static const char *file_of(const char *name) {
  while (*name == '/')
    name++;
  return name;
}

/* Size of segment name in the private /dev/shm, or -1 if it is not there. */
static long long seg_size(const char *name) {
  char path[PATH_MAX + 300];
  struct stat st;
  if (shm_path(name, path, sizeof(path)) < 0 || stat(path, &st) < 0)
    return -1;
  return (long long)st.st_size;
}

/* Creates segment name of size bytes; returns 0, or -1 if it cannot be. */
static int seg_make(const char *name, uint64_t size) {
  if (size > (uint64_t)INT64_MAX)
    return -1;
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0)
    return -1;
  int err = ftruncate(fd, (off_t)size);
  close(fd);
  if (err < 0)
    shm_unlink(name);
  return err;
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL)
    die("opendir(/proc/self/fd): %s", strerror(errno));
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1;
}

/* ---- the model: what the records say ---- */

typedef struct seg {
  const char *name; /* in a record */
  uint64_t size;    /* of the first put that names it */
} seg;

/* What the load must do with one key. */
enum { K_NO, K_MUST, K_MAY };

typedef struct want {
  const Tensord__StateKey *m; /* its last put */
  int expect;
  const Tensord__StateKey *first; /* the put that adopted its segment */
} want;

typedef struct model {
  Tensord__StateRecord **recs; /* every decoded record, to free */
  size_t nrecs, caprecs;
  const Tensord__StateKey **puts; /* live puts in load order; NULL: deleted */
  size_t nputs, capputs;
  const char **prefixes;
  size_t nprefixes, capprefixes;
  uint64_t gen;
  seg segs[SEGS_MAX];
  size_t nsegs;
  want *wants;
  size_t nwants;
} model;

static void *grow(void *p, size_t *cap, size_t n, size_t size) {
  if (n < *cap)
    return p;
  size_t c = *cap ? *cap * 2 : 16;
  void *q = realloc(p, c * size);
  if (q == NULL)
    die("out of memory");
  *cap = c;
  return q;
}

#define PUSH(arr, n, cap)                                                      \
  ((arr) = grow((arr), &(cap), (n), sizeof(*(arr))), &(arr)[(n)++])

static int bytes_eq(const ProtobufCBinaryData *a,
                    const ProtobufCBinaryData *b) {
  return a->len == b->len &&
         (a->len == 0 || memcmp(a->data, b->data, a->len) == 0);
}

/* Replays one file's records as state.c must: up to the first record whose
 * length, CRC or payload is bad. */
static void model_file(model *m, const uint8_t *buf, size_t len) {
  size_t off = 0;
  while (len - off >= SF_REC_HDR) {
    uint32_t n = sf_get32(buf + off);
    if (n > SF_REC_MAX || len - off - SF_REC_HDR < n ||
        sf_crc32c(buf + off + SF_REC_HDR, n) != sf_get32(buf + off + 4))
      return;
    Tensord__StateRecord *r =
        tensord__state_record__unpack(NULL, n, buf + off + SF_REC_HDR);
    if (r == NULL)
      return;
    *PUSH(m->recs, m->nrecs, m->caprecs) = r;
    off += SF_REC_HDR + n;
    switch (r->body_case) {
    case TENSORD__STATE_RECORD__BODY_GENERATION:
      m->gen = r->generation;
      break;
    case TENSORD__STATE_RECORD__BODY_PREFIX:
      if (strlen(r->prefix) < 64)
        *PUSH(m->prefixes, m->nprefixes, m->capprefixes) = r->prefix;
      break;
    case TENSORD__STATE_RECORD__BODY_PUT: {
      size_t i = 0;
      while (i < m->nputs &&
             !(m->puts[i] && bytes_eq(&m->puts[i]->key, &r->put->key)))
        i++;
      if (i < m->nputs)
        m->puts[i] = r->put; /* a key keeps its place */
      else
        *PUSH(m->puts, m->nputs, m->capputs) = r->put;
      break;
    }
    case TENSORD__STATE_RECORD__BODY_DEL:
      for (size_t i = 0; i < m->nputs; i++)
        if (m->puts[i] && bytes_eq(&m->puts[i]->key, &r->del))
          m->puts[i] = NULL;
      break;
    default:
      break;
    }
  }
}

static void model_free(model *m) {
  for (size_t i = 0; i < m->nrecs; i++)
    tensord__state_record__free_unpacked(m->recs[i], NULL);
  free(m->recs);
  free(m->puts);
  free(m->prefixes);
  free(m->wants);
}

static seg *seg_find(model *m, const char *name) {
  for (size_t i = 0; i < m->nsegs; i++)
    if (strcmp(m->segs[i].name, name) == 0)
      return &m->segs[i];
  return NULL;
}

/* A key the daemon surely accepts (1: ASCII without NUL, 1-255 bytes),
 * surely refuses (-1), or may (0: other UTF-8 rules decide). */
static int key_judge(const ProtobufCBinaryData *k) {
  if (k->len == 0 || k->len > TD_KEY_MAX || memchr(k->data, 0, k->len))
    return -1;
  for (size_t i = 0; i < k->len; i++)
    if (k->data[i] >= 0x80)
      return 0;
  return 1;
}

/* A well-formed segment-name prefix, "/tensord.<instance>." (an instance
 * without '/' or '.', shorter than TD__PREFIX_MAX in all): what a daemon
 * records. Only segments under one of these may be swept. */
static int prefix_ok(const char *p) {
  size_t n = strlen(p);
  if (n <= 10 || n >= TD__PREFIX_MAX || strncmp(p, "/tensord.", 9) != 0 ||
      p[n - 1] != '.')
    return 0;
  return strcspn(p + 9, "/.") == n - 10;
}

/* Decides, in load order, what must become of each live put. A segment
 * shared by several keys is adopted by the first whose key and view are
 * valid; the others must record the same size. */
static void model_judge(model *m) {
  m->wants = calloc(m->nputs ? m->nputs : 1, sizeof(*m->wants));
  if (m->wants == NULL)
    die("out of memory");
  /* Per segment: 0 not adopted, 1 adopted by a sure put, 2 maybe. */
  int adopted[SEGS_MAX] = {0};
  const Tensord__StateKey *by[SEGS_MAX] = {0};
  for (size_t i = 0; i < m->nputs; i++) {
    const Tensord__StateKey *p = m->puts[i];
    if (p == NULL)
      continue;
    want *w = &m->wants[m->nwants++];
    w->m = p;
    int kj = key_judge(&p->key);
    td_view v;
    seg *s = seg_find(m, p->segment);
    int form = strncmp(p->segment, "/tensord.", 9) == 0 &&
               strlen(p->segment) < sizeof(((td__storage *)0)->name);
    long long size = seg_size(p->segment);
    if (kj < 0 || !form || p->view == NULL || size < 0) {
      w->expect = K_NO;
      continue;
    }
    if (s == NULL) { /* past SEGS_MAX: not followed */
      w->expect = K_MAY;
      continue;
    }
    int sure = kj > 0 && fz_view_sure(p->view, p->nbytes, &v);
    size_t si = (size_t)(s - m->segs);
    if (adopted[si] == 0 && (uint64_t)size != p->nbytes) {
      w->expect = K_NO; /* of another size */
      continue;
    }
    if (adopted[si] != 0 && by[si]->nbytes != p->nbytes) {
      w->expect = adopted[si] == 1 ? K_NO : K_MAY;
      continue; /* the record disagrees with the segment's size */
    }
    if (adopted[si] == 0) {
      adopted[si] = sure ? 1 : 2;
      by[si] = p;
    } else if (adopted[si] == 2 && sure) {
      /* an unsure put may have adopted it before: owner and mode unsure */
    }
    w->first = by[si];
    w->expect = sure && adopted[si] == 1 ? K_MUST : K_MAY;
  }
}

/* ---- checks ---- */

/* Every storage is consistent: its segment exists with its size, it is
 * referenced by its keys only, every key's view lies inside it; the
 * tables and the accounting agree. */
static void check_registry(const char *when) {
  const td__registry *r = &srv.reg;
  uint64_t n = 0, nkeys = 0, bytes = 0;
  for (const td__storage *s = r->first; s != NULL; s = s->next) {
    uint32_t k = 0;
    for (const td__key *key = s->keys; key != NULL; key = key->snext, k++) {
      char why[512];
      if (key->storage != s || td__key_find(r, key->name, key->len) != key)
        die("%s: key '%s' is not where the registry says", when, key->name);
      if (td__view_check_msg(&key->view, s->nbytes, why, sizeof(why)) < 0)
        die("%s: key '%s' on %s (%llu bytes): %s", when, key->name, s->name,
            (unsigned long long)s->nbytes, why);
    }
    if (k == 0 || s->refs != k || s->holders != NULL)
      die("%s: storage %llu (%s): %u reference(s), %u key(s)%s", when,
          (unsigned long long)s->id, s->name, s->refs, k,
          s->holders ? ", and holders" : "");
    long long size = seg_size(s->name);
    if (size < 0 || (uint64_t)size != s->nbytes)
      die("%s: storage %llu: segment %s %s (the storage says %llu bytes)", when,
          (unsigned long long)s->id, s->name,
          size < 0 ? "is gone" : "has another size",
          (unsigned long long)s->nbytes);
    for (const td__storage *t = r->first; t != s; t = t->next)
      if (strcmp(t->name, s->name) == 0)
        die("%s: storages %llu and %llu share segment %s", when,
            (unsigned long long)t->id, (unsigned long long)s->id, s->name);
    if (td__storage_find(r, s->id) != s)
      die("%s: storage %llu is in the list, not the table", when,
          (unsigned long long)s->id);
    n++;
    nkeys += k;
    bytes += s->nbytes;
  }
  if (n != r->storages.count || nkeys != r->keys.count)
    die("%s: %llu storage(s) and %llu key(s) listed, %zu and %zu in the "
        "tables",
        when, (unsigned long long)n, (unsigned long long)nkeys,
        r->storages.count, r->keys.count);
  if (bytes != r->bytes_used || bytes != r->bytes_committed)
    die("%s: storages hold %llu bytes; bytes_used %llu, committed %llu", when,
        (unsigned long long)bytes, (unsigned long long)r->bytes_used,
        (unsigned long long)r->bytes_committed);
  if (r->nholdings != 0 || srv.pending_work != 0)
    die("%s: %llu holding(s), %llu thread-pool job(s) after loading", when,
        (unsigned long long)r->nholdings, (unsigned long long)srv.pending_work);
}

/* The keys served are those the model says; each on the segment, size,
 * owner, mode and view its records give. */
static void check_keys(const model *m) {
  for (size_t i = 0; i < m->nwants; i++) {
    const want *w = &m->wants[i];
    const Tensord__StateKey *p = w->m;
    const td__key *k =
        td__key_find(&srv.reg, (const char *)p->key.data, p->key.len);
    char key[TD_KEY_MAX + 1];
    snprintf(key, sizeof(key), "%.*s", (int)p->key.len,
             (const char *)p->key.data);
    if (w->expect == K_MUST && k == NULL)
      die("key '%s' (segment %s, %llu bytes) must be served; it is not", key,
          p->segment, (unsigned long long)p->nbytes);
    if (w->expect == K_NO && k != NULL)
      die("key '%s' is served on %s, but its record (segment %s, %llu "
          "bytes) must be dropped",
          key, k->storage->name, p->segment, (unsigned long long)p->nbytes);
    if (k == NULL)
      continue;
    const td__storage *s = k->storage;
    if (strcmp(s->name, p->segment) != 0 || s->nbytes != p->nbytes ||
        k->published_ms != p->published_unix_ms ||
        !fz_view_eq(&k->view, p->view))
      die("key '%s' is served on %s (%llu bytes) with another segment, "
          "size, time or view than its record's (%s, %llu bytes)",
          key, s->name, (unsigned long long)s->nbytes, p->segment,
          (unsigned long long)p->nbytes);
    const Tensord__StateKey *f = w->first;
    if (w->expect == K_MUST &&
        (s->owner.uid != f->owner_uid || s->owner.gid != f->owner_gid ||
         s->mode != (f->mode & 0666)))
      die("key '%s': storage %s has owner %u:%u mode %04o; its first record "
          "says %u:%u %04o",
          key, s->name, (unsigned)s->owner.uid, (unsigned)s->owner.gid,
          (unsigned)s->mode, (unsigned)f->owner_uid, (unsigned)f->owner_gid,
          (unsigned)(f->mode & 0666));
  }
  for (const td__storage *s = srv.reg.first; s != NULL; s = s->next)
    for (const td__key *k = s->keys; k != NULL; k = k->snext) {
      size_t i = 0;
      while (i < m->nwants &&
             !(m->wants[i].m->key.len == k->len &&
               memcmp(m->wants[i].m->key.data, k->name, k->len) == 0))
        i++;
      if (i == m->nwants)
        die("key '%s' is served, yet no live record puts it", k->name);
    }
}

/* Whether segment name's file lies under a well-formed recorded prefix. */
static int swept(const model *m, const char *name) {
  for (size_t i = 0; i < m->nprefixes; i++)
    if (prefix_ok(m->prefixes[i]) && strncmp(file_of(name), m->prefixes[i] + 1,
                                             strlen(m->prefixes[i]) - 1) == 0)
      return 1;
  return 0;
}

/* Whether an adopted storage is segment name's file. */
static int served(const char *name) {
  for (const td__storage *s = srv.reg.first; s != NULL; s = s->next)
    if (strcmp(file_of(s->name), file_of(name)) == 0)
      return 1;
  return 0;
}

/* The sweep unlinked exactly the unadopted segments under well-formed
 * recorded prefixes. */
static void check_sweep(const model *m, const char *const *made, size_t n) {
  for (size_t i = 0; i < n; i++) {
    int gone = seg_size(made[i]) < 0;
    int adopted = served(made[i]);
    if (adopted && gone)
      die("segment %s is adopted, yet unlinked", made[i]);
    if (!adopted && !gone && swept(m, made[i]))
      die("segment %s, under a recorded prefix and named by no key, was not "
          "unlinked",
          made[i]);
    if (gone && !adopted && !swept(m, made[i]))
      die("segment %s was unlinked, though no well-formed recorded prefix "
          "covers it",
          made[i]);
  }
}

/* ---- one input ---- */

static void write_file(const char *name, const uint8_t *p, size_t len) {
  char path[PATH_MAX + 64];
  snprintf(path, sizeof(path), "%s/%s", state_dir, name);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    die("%s: %s", path, strerror(errno));
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0)
      die("writing %s: %s", path, strerror(errno));
    p += w;
    len -= (size_t)w;
  }
  close(fd);
}

/* Sets the daemon up afresh, with names of segments this harness knows. */
static void server_init(void) {
  td__options o = {0};
  o.capacity = 8u << 20;
  o.socket_mode = -1;
  td__server_init(&srv, &loop, &o);
  srv.instance = 0xf5a7000000000000ull | (uint64_t)(getpid() & 0xffffff) << 24 |
                 (++serial & 0xffffff);
  snprintf(srv.prefix, sizeof(srv.prefix), "/tensord.%016llx.",
           (unsigned long long)srv.instance);
}

static void server_stop(void) {
  td__server_stop(&srv);
  for (long spins = 0; uv_loop_alive(&loop); spins++) {
    uv_run(&loop, UV_RUN_ONCE);
    if (spins > 100000)
      die("the loop still has work after the daemon stopped");
  }
}

/* One served key, to compare two loads. */
typedef struct served_key {
  char name[TD_KEY_MAX + 1];
  size_t len;
  char segment[64];
  uint64_t nbytes;
  uid_t uid;
  gid_t gid;
  uint32_t mode;
  int64_t published_ms, created_ms;
  td_view view;
} served_key;

static served_key *snapshot_keys(size_t *n) {
  served_key *out = calloc(srv.reg.keys.count + 1, sizeof(*out));
  if (out == NULL)
    die("out of memory");
  size_t i = 0;
  for (const td__storage *s = srv.reg.first; s != NULL; s = s->next)
    for (const td__key *k = s->keys; k != NULL; k = k->snext, i++) {
      memcpy(out[i].name, k->name, k->len);
      out[i].len = k->len;
      snprintf(out[i].segment, sizeof(out[i].segment), "%s", s->name);
      out[i].nbytes = s->nbytes;
      out[i].uid = s->owner.uid;
      out[i].gid = s->owner.gid;
      out[i].mode = s->mode;
      out[i].published_ms = k->published_ms;
      out[i].created_ms = s->created_ms;
      out[i].view = k->view;
    }
  *n = i;
  return out;
}

/* Copies the files of state_dir but its lock into crash_dir: what a crash
 * now would leave. */
static void copy_state(void) {
  if (mkdir(crash_dir, 0700) < 0)
    die("mkdir %s: %s", crash_dir, strerror(errno));
  DIR *d = opendir(state_dir);
  if (d == NULL)
    die("opendir %s: %s", state_dir, strerror(errno));
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.' || strcmp(e->d_name, "lock") == 0)
      continue;
    char from[PATH_MAX + 300], to[PATH_MAX + 300];
    snprintf(from, sizeof(from), "%s/%s", state_dir, e->d_name);
    snprintf(to, sizeof(to), "%s/%s", crash_dir, e->d_name);
    int in = open(from, O_RDONLY | O_CLOEXEC);
    int out = open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (in < 0 || out < 0)
      die("copying %s: %s", from, strerror(errno));
    uint8_t buf[8192];
    ssize_t n;
    while ((n = read(in, buf, sizeof(buf))) > 0)
      if (write(out, buf, (size_t)n) != n)
        die("copying %s: %s", from, strerror(errno));
    close(in);
    close(out);
  }
  closedir(d);
}

/* Another load (what) serves what the first did. */
static void check_reload(const char *what, const served_key *before, size_t n) {
  if (srv.reg.keys.count != n)
    die("%s serves %zu key(s); the first load served %zu", what,
        srv.reg.keys.count, n);
  for (size_t i = 0; i < n; i++) {
    const served_key *b = &before[i];
    const td__key *k = td__key_find(&srv.reg, b->name, b->len);
    const td__storage *s = k ? k->storage : NULL;
    if (s == NULL || strcmp(s->name, b->segment) != 0 ||
        s->nbytes != b->nbytes || s->owner.uid != b->uid ||
        s->owner.gid != b->gid || s->mode != b->mode ||
        k->published_ms != b->published_ms || s->created_ms != b->created_ms ||
        memcmp(&k->view, &b->view, sizeof(td_view)) != 0)
      die("%s: key '%s' (segment %s) %s", what, b->name, b->segment,
          s ? "comes back changed" : "is gone");
  }
}

static void setup(void) {
  const char *level = getenv("TD_FUZZ_LOG");
  td__log_level = level ? td__log_level_parse(level) : -1;
  verbose = getenv("TD_FUZZ_VERBOSE") != NULL;
  signal(SIGPIPE, SIG_IGN);
  if (uv_loop_init(&loop) < 0)
    die("uv_loop_init failed");
  /* On tmpfs if there is one: the load fsyncs, which costs nothing there.
   * run.sh removes it if the fuzzer dies. */
  const char *root = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(base, sizeof(base), "%s/tensord-fuzz-state.%d", root, (int)getpid());
  remove_tree(base); /* a dead process's, with our pid */
  if (mkdir(base, 0700) < 0)
    die("mkdir %s: %s", base, strerror(errno));
  snprintf(shm_dir, sizeof(shm_dir), "%s/shm", base);
  snprintf(state_dir, sizeof(state_dir), "%s/state", base);
  snprintf(crash_dir, sizeof(crash_dir), "%s/crash", base);
}

static void cleanup(void) {
  if (base[0] != '\0')
    remove_tree(base);
}

/* replay.c, after the child that replayed has ended: a crash (a signal, an
 * ASan report) skips atexit, so the child's private directory goes here. */
void td_fuzz_replay_cleanup(pid_t child);
void td_fuzz_replay_cleanup(pid_t child) {
  static const char *const roots[] = {"/dev/shm", "/tmp"};
  char dir[PATH_MAX];
  for (size_t i = 0; i < sizeof(roots) / sizeof(roots[0]); i++) {
    snprintf(dir, sizeof(dir), "%s/tensord-fuzz-state.%d", roots[i],
             (int)child);
    remove_tree(dir);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int ready;
  if (!ready) {
    setup();
    atexit(cleanup);
    ready = 1;
  }
  /* tests/fuzz/crash_cleanup.sh: a crash with the private directory made,
   * as a bug the fuzzer finds would crash it. */
  if (getenv("TD_FUZZ_STATE_CRASH") != NULL)
    raise(SIGSEGV);
  int fds_before = count_fds();
  if (mkdir(shm_dir, 0700) < 0 || mkdir(state_dir, 0700) < 0)
    die("mkdir in %s: %s", base, strerror(errno));

  /* The files. */
  uint8_t hdr[SF_HDR] = {0};
  memcpy(hdr, data, size < SF_HDR ? size : SF_HDR);
  const uint8_t *p = data + (size < SF_HDR ? size : SF_HDR);
  size_t left = size - (size_t)(p - data);
  int nfiles = (hdr[0] & SF_SNAPSHOT ? 1 : 0) + SF_NJOURNALS(hdr[0]);
  uint8_t *fp[SF_FILES_MAX];
  size_t flen[SF_FILES_MAX];
  int nf = 0;
  for (; nf < nfiles; nf++) {
    size_t n = left;
    if (nf < nfiles - 1) {
      if (left < 2)
        break;
      n = (size_t)p[0] | (size_t)p[1] << 8;
      p += 2;
      left -= 2;
      if (n > left)
        n = left;
    }
    fp[nf] = malloc(n ? n : 1);
    if (fp[nf] == NULL)
      die("out of memory");
    memcpy(fp[nf], p, n);
    flen[nf] = n;
    if (hdr[0] & SF_SEAL)
      sf_seal(fp[nf], n);
    p += n;
    left -= n;
  }
  char names[SF_FILES_MAX][32];
  for (int i = 0; i < nf; i++) {
    int j = i - (hdr[0] & SF_SNAPSHOT ? 1 : 0);
    if (j < 0)
      snprintf(names[i], sizeof(names[i]), "snapshot");
    else
      snprintf(names[i], sizeof(names[i]), "journal.%u", hdr[3] + (unsigned)j);
    write_file(names[i], fp[i], flen[i]);
  }

  /* What the records say, read in the daemon's order: the snapshot, then
   * journal.<its generation> on while they exist. */
  model m = {0}, unread = {0};
  m.gen = 1;
  int have_snapshot = nf > 0 && (hdr[0] & SF_SNAPSHOT);
  int read[SF_FILES_MAX] = {0};
  if (have_snapshot)
    model_file(&m, fp[0], flen[0]);
  for (uint64_t g = m.gen;; g++) {
    int found = 0;
    for (int i = have_snapshot; i < nf && !found; i++)
      if (hdr[3] + (uint64_t)(i - have_snapshot) == g) {
        model_file(&m, fp[i], flen[i]);
        found = read[i] = 1;
      }
    if (!found)
      break;
  }
  /* Journals the load must not read: their segments exist all the same. */
  for (int i = have_snapshot; i < nf; i++)
    if (!read[i])
      model_file(&unread, fp[i], flen[i]);

  /* The segments: those puts name, in any record read, some missing or of
   * the wrong size; an orphan under each prefix; two bystanders. */
  const char *made[SEGS_MAX + 16 + 2];
  size_t nmade = 0;
  char orphans[16][80];
  for (size_t i = 0; i < m.nrecs + unread.nrecs && m.nsegs < SEGS_MAX; i++) {
    const Tensord__StateRecord *r =
        i < m.nrecs ? m.recs[i] : unread.recs[i - m.nrecs];
    if (r->body_case != TENSORD__STATE_RECORD__BODY_PUT ||
        seg_find(&m, r->put->segment) != NULL)
      continue;
    seg *s = &m.segs[m.nsegs];
    s->name = r->put->segment;
    s->size = r->put->nbytes;
    int resized = m.nsegs < 8 && (hdr[2] >> m.nsegs & 1);
    int absent = m.nsegs < 8 && (hdr[1] >> m.nsegs & 1);
    if (!absent && seg_make(s->name, s->size + (resized ? 1 : 0)) == 0)
      made[nmade++] = s->name;
    m.nsegs++;
  }
  for (size_t i = 0; i < m.nprefixes && i < 16 && (hdr[0] & SF_ORPHANS); i++) {
    snprintf(orphans[i], sizeof(orphans[i]), "%s%s", m.prefixes[i], SF_ORPHAN);
    if (prefix_ok(m.prefixes[i]) && seg_find(&m, orphans[i]) == NULL &&
        seg_make(orphans[i], 1) == 0)
      made[nmade++] = orphans[i];
  }
  if (seg_make(OTHER_APP, 1) == 0)
    made[nmade++] = OTHER_APP;
  if (seg_find(&m, BYSTANDER) == NULL && seg_make(BYSTANDER, 1) == 0)
    made[nmade++] = BYSTANDER;
  model_judge(&m);
  if (verbose)
    fprintf(stderr,
            "fuzz_state: %d file(s), %zu record(s), %zu live put(s), "
            "%zu prefix(es), %zu segment(s) made\n",
            nf, m.nrecs, m.nwants, m.nprefixes, nmade);

  /* Locked by another daemon: the load fails and changes nothing. */
  if (hdr[0] & SF_LOCKED) {
    char path[PATH_MAX + 16];
    snprintf(path, sizeof(path), "%s/lock", state_dir);
    int lock = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock < 0 || flock(lock, LOCK_EX | LOCK_NB) < 0)
      die("locking %s: %s", path, strerror(errno));
    server_init();
    int err = td__state_open(&srv, state_dir);
    if (err != TD_EBUSY || srv.state != NULL || srv.reg.storages.count != 0)
      die("loading a locked state directory: %s (%zu storage(s)); it must "
          "fail with EBUSY",
          err ? td_err_name(err) : "success", srv.reg.storages.count);
    for (size_t i = 0; i < nmade; i++)
      if (seg_size(made[i]) < 0)
        die("loading a locked state directory unlinked %s", made[i]);
    server_stop();
    close(lock);
  }

  /* The load. */
  server_init();
  int err = td__state_open(&srv, state_dir);
  if (err < 0)
    die("td__state_open: %s", td_strerror(err));
  check_registry("after loading");
  check_keys(&m);
  check_sweep(&m, made, nmade);
  size_t nkeys;
  served_key *keys = snapshot_keys(&nkeys);
  copy_state();
  server_stop();
  for (size_t i = 0; i < nkeys; i++)
    if (seg_size(keys[i].segment) < 0)
      die("stopping unlinked %s, which key '%s' names", keys[i].segment,
          keys[i].name);

  /* What a crash right after the load would have left: the same keys. */
  server_init();
  err = td__state_open(&srv, crash_dir);
  if (err < 0)
    die("td__state_open after a crash: %s", td_strerror(err));
  check_registry("after a crash");
  check_reload("loading the directory as a crash after the load leaves it",
               keys, nkeys);
  server_stop();

  /* The final snapshot, loaded again. */
  server_init();
  err = td__state_open(&srv, state_dir);
  if (err < 0)
    die("td__state_open of the final snapshot: %s", td_strerror(err));
  check_registry("after reloading");
  check_reload("reloading the final snapshot", keys, nkeys);
  server_stop();

  free(keys);
  model_free(&m);
  model_free(&unread);
  for (int i = 0; i < nf; i++)
    free(fp[i]);
  remove_tree(shm_dir);
  remove_tree(state_dir);
  remove_tree(crash_dir);
  int fds_after = count_fds();
  if (fds_after != fds_before)
    die("%d fd(s) open before the input, %d after", fds_before, fds_after);
  return 0;
}

/* model.c: models: safetensors checkpoints loaded into tensord storages
 * (one per shard, its bytes verbatim), their manifest the atomic switch
 * between versions, attached, saved and unloaded (docs/models.md). */
#include "internal.h"

#include "jsonmem.h"
#include "safetensors.h"
#include "statedict.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MF_MAGIC "TDMODEL1"
#define MF_HEADER 16                      /* the magic and the length */
#define MF_JSON_MAX ((uint64_t)256 << 20) /* bytes of a manifest's JSON */
#define MF_TREE_MAX ((size_t)1 << 30)     /* its tree, in memory */
#define LOCK_SUFFIX "@loading"
#define OPEN_TRIES 100 /* td_model_open's restarts before TD_EAGAIN */
/* Threads that read at once by default: one per online CPU, 2 to 8. What a
 * load costs is the kernel's copy into pages this process has not written
 * through yet (~0.55 GB/s per thread on the 2-vCPU VM of docs/models.md,
 * against ~9 GB/s through a mapping written once): 1 thread 1.7 s for
 * 1 GiB, 2 threads 1.1 s, 4 threads 1.05 s; more threads than CPUs gain
 * nothing. */
#define THREADS_MIN 2
#define THREADS_CAP 8
#define THREADS_MAX 64
#define CHUNK ((uint64_t)16 << 20) /* bytes one job copies at most */

/* Formats a key into buf (TD_KEY_MAX + 1 bytes). Returns 0, or -1 if it
 * does not fit (nothing is then published or unpublished under it). */
static int keyf(char *buf, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int keyf(char *buf, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, TD_KEY_MAX + 1, fmt, ap);
  va_end(ap);
  return n < 0 || n > TD_KEY_MAX ? -1 : 0;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- the manifest, read back from untrusted bytes ---- */

typedef struct mf_file {
  char *file;
  uint64_t size;
  int64_t mtime_ns;
} mf_file;

typedef struct mf_shard {
  char *file, *key;
  uint64_t nbytes;
} mf_shard;

typedef struct mf_tensor {
  char *name;
  uint32_t shard;
  td_view view; /* of its shard's storage */
} mf_tensor;

typedef struct manifest {
  uint64_t version;
  char *device; /* "cpu" or "cuda" */
  char *uuid;   /* a CUDA model's GPU, "GPU-..." (NULL for the CPU) */
  char *path;
  uint64_t size;
  int64_t mtime_ns;
  size_t nfiles, nshards, ntensors;
  mf_file *files;
  mf_shard *shards;
  mf_tensor *tensors;
  size_t *order; /* tensors by name, for lookups */
} manifest;

static void mf_free(manifest *m) {
  for (size_t i = 0; i < m->nfiles; i++)
    free(m->files[i].file);
  for (size_t i = 0; i < m->nshards; i++) {
    free(m->shards[i].file);
    free(m->shards[i].key);
  }
  for (size_t i = 0; i < m->ntensors; i++)
    free(m->tensors[i].name);
  free(m->files);
  free(m->shards);
  free(m->tensors);
  free(m->order);
  free(m->path);
  free(m->device);
  free(m->uuid);
  memset(m, 0, sizeof(*m));
}

/* A non-negative integer field. */
static int mf_u64(json_t *o, const char *field, uint64_t *out) {
  json_t *v = json_object_get(o, field);
  if (!json_is_integer(v) || json_integer_value(v) < 0)
    return -1;
  *out = (uint64_t)json_integer_value(v);
  return 0;
}

static char *mf_str(json_t *o, const char *field) {
  json_t *v = json_object_get(o, field);
  return json_is_string(v) ? strdup(json_string_value(v)) : NULL;
}

static const mf_tensor *name_base;
static pthread_mutex_t name_mu = PTHREAD_MUTEX_INITIALIZER;

static int by_name(const void *a, const void *b) {
  return strcmp(name_base[*(const size_t *)a].name,
                name_base[*(const size_t *)b].name);
}

/* The tensor of m called name, or NULL. */
static const mf_tensor *mf_find(const manifest *m, const char *name) {
  size_t lo = 0, hi = m->ntensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(m->tensors[m->order[mid]].name, name);
    if (c == 0)
      return &m->tensors[m->order[mid]];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

/* Reads the tree of model name's manifest into m, checking what a reader
 * relies on: each shard's key is name@version/<file>, each tensor a view
 * inside its shard, no name twice. Returns 0 or -1 with why filled. */
static int mf_read(json_t *root, const char *name, manifest *m, char *why,
                   size_t wl) {
  json_t *src = json_object_get(root, "source");
  json_t *files = json_object_get(src, "files");
  json_t *shards = json_object_get(root, "shards");
  json_t *tensors = json_object_get(root, "tensors");
  json_t *nm = json_object_get(root, "name");
  uint64_t format = 0;
  if (!json_is_object(root) || mf_u64(root, "format", &format) < 0 ||
      format != 1)
    return td__msg(why, wl, -1, "not format 1");
  if (!json_is_string(nm) || strcmp(json_string_value(nm), name) != 0)
    return td__msg(why, wl, -1, "the manifest of another name");
  if (mf_u64(root, "version", &m->version) < 0 || m->version == 0 ||
      !json_is_object(src) || !json_is_array(files) || !json_is_array(shards) ||
      !json_is_object(tensors) || (m->path = mf_str(src, "path")) == NULL ||
      mf_u64(src, "size", &m->size) < 0 ||
      mf_u64(src, "mtime_ns", (uint64_t *)&m->mtime_ns) < 0)
    return td__msg(why, wl, -1, "a field missing or of the wrong kind");
  /* A manifest before devices has none: the CPU. */
  json_t *dv = json_object_get(root, "device");
  m->device = strdup(json_is_string(dv) ? json_string_value(dv) : "cpu");
  if (json_object_get(root, "device_uuid") != NULL &&
      (m->uuid = mf_str(root, "device_uuid")) == NULL)
    return td__msg(why, wl, -1, "device_uuid is not a string");
  if (m->device == NULL)
    return td__msg(why, wl, -1, "out of memory");
  size_t nf = json_array_size(files), ns = json_array_size(shards),
         nt = json_object_size(tensors);
  m->files = calloc(nf ? nf : 1, sizeof(*m->files));
  m->shards = calloc(ns ? ns : 1, sizeof(*m->shards));
  m->tensors = calloc(nt ? nt : 1, sizeof(*m->tensors));
  m->order = calloc(nt ? nt : 1, sizeof(*m->order));
  if (!m->files || !m->shards || !m->tensors || !m->order)
    return td__msg(why, wl, -1, "out of memory");
  for (size_t i = 0; i < nf; i++) {
    json_t *f = json_array_get(files, i);
    mf_file *o = &m->files[m->nfiles];
    if ((o->file = mf_str(f, "file")) == NULL)
      return td__msg(why, wl, -1, "source file %zu has no name", i);
    m->nfiles++;
    if (mf_u64(f, "size", &o->size) < 0 ||
        mf_u64(f, "mtime_ns", (uint64_t *)&o->mtime_ns) < 0)
      return td__msg(why, wl, -1, "source file %zu", i);
  }
  char want[TD_KEY_MAX + 1];
  for (size_t i = 0; i < ns; i++) {
    json_t *f = json_array_get(shards, i);
    mf_shard *o = &m->shards[m->nshards];
    o->file = mf_str(f, "file");
    o->key = mf_str(f, "key");
    m->nshards++;
    if (o->file == NULL || o->key == NULL || mf_u64(f, "nbytes", &o->nbytes))
      return td__msg(why, wl, -1, "shard %zu", i);
    if (keyf(want, "%s@%" PRIu64 "/%s", name, m->version, o->file) < 0 ||
        strcmp(want, o->key) != 0 || strchr(o->file, '/') != NULL)
      return td__msg(why, wl, -1, "shard %zu's key is not %s@%" PRIu64 "/FILE",
                     i, name, m->version);
  }
  const char *tn;
  json_t *e;
  json_object_foreach(tensors, tn, e) {
    mf_tensor *t = &m->tensors[m->ntensors];
    if ((t->name = strdup(tn)) == NULL)
      return td__msg(why, wl, -1, "out of memory");
    m->order[m->ntensors] = m->ntensors;
    m->ntensors++;
    uint64_t shard, begin, end;
    json_t *dt = json_object_get(e, "dtype");
    json_t *sh = json_object_get(e, "shape");
    if (mf_u64(e, "shard", &shard) < 0 || shard >= m->nshards ||
        mf_u64(e, "begin", &begin) < 0 || mf_u64(e, "end", &end) < 0 ||
        !json_is_string(dt) || !json_is_array(sh) ||
        json_array_size(sh) > TD_MAX_DIMS)
      return td__msg(why, wl, -1, "tensor %zu", m->ntensors - 1);
    td_dtype dtype = td__st_dtype(json_string_value(dt));
    int64_t shape[TD_MAX_DIMS];
    int32_t nd = (int32_t)json_array_size(sh);
    for (int32_t d = 0; d < nd; d++) {
      json_t *x = json_array_get(sh, (size_t)d);
      if (!json_is_integer(x) || json_integer_value(x) < 0)
        return td__msg(why, wl, -1, "tensor %zu's shape", m->ntensors - 1);
      shape[d] = json_integer_value(x);
    }
    size_t item = td_dtype_size(dtype);
    if (item == 0 || begin % item != 0 || end < begin ||
        td_view_contiguous(dtype, nd, shape, &t->view) < 0 ||
        (uint64_t)td_view_numel(&t->view) * item != end - begin)
      return td__msg(why, wl, -1, "tensor %zu's dtype or offsets",
                     m->ntensors - 1);
    t->view.offset = (int64_t)(begin / item);
    t->shard = (uint32_t)shard;
    if (td_view_check(&t->view, m->shards[shard].nbytes) != 0)
      return td__msg(why, wl, -1, "tensor %zu reaches past its shard",
                     m->ntensors - 1);
  }
  pthread_mutex_lock(&name_mu);
  name_base = m->tensors;
  qsort(m->order, m->ntensors, sizeof(*m->order), by_name);
  pthread_mutex_unlock(&name_mu);
  return 0;
}

/* Parses the n bytes at p as model name's manifest. Returns 0, or TD_EINVAL
 * (or TD_ENOMEM) naming the key and what is wrong; m is then empty. */
static int mf_parse(const td_client *c, const char *name, const uint8_t *p,
                    size_t n, manifest *m) {
  memset(m, 0, sizeof(*m));
  char shown[TD_KEY_MAX + 1];
  td__printable(name, shown, sizeof(shown));
  if (n < MF_HEADER || memcmp(p, MF_MAGIC, 8) != 0)
    return td__fail(c, TD_EINVAL,
                    "key '%s' holds no model manifest (%zu bytes that do not "
                    "begin with %s): unpublish it, or load --as another name",
                    shown, n, MF_MAGIC);
  uint64_t l = 0;
  for (int i = 7; i >= 0; i--)
    l = l << 8 | p[8 + i];
  if (l > n - MF_HEADER || l > MF_JSON_MAX)
    return td__fail(c, TD_EINVAL,
                    "key '%s': a manifest of %" PRIu64 " bytes in %zu", shown,
                    l, n);
  json_error_t e;
  int over;
  json_t *root =
      td__json_loadb_bounded((const char *)p + MF_HEADER, l,
                             JSON_REJECT_DUPLICATES, MF_TREE_MAX, &e, &over);
  if (root == NULL)
    return td__fail(c, over ? TD_EINVAL : TD_EINVAL,
                    "key '%s': manifest byte %d: %s", shown, e.position,
                    over ? "too large to hold" : e.text);
  char why[256];
  int err = mf_read(root, name, m, why, sizeof(why));
  json_decref(root);
  if (err < 0) {
    mf_free(m);
    return td__fail(c, TD_EINVAL, "key '%s': a malformed model manifest: %s",
                    shown, why);
  }
  return 0;
}

/* Looks up model name's manifest (read-only, waiting timeout_ms) into *m;
 * *id (if not NULL) gets its storage's id and *text (if not NULL) a copy of
 * its JSON, the caller's to free. Returns 0, 1 if name is not published, or
 * a negative code. */
static int mf_get(td_client *c, const char *name, int timeout_ms, manifest *m,
                  uint64_t *id, char **text) {
  td_storage *s = NULL;
  td_view v;
  memset(m, 0, sizeof(*m));
  int err = td_lookup(c, name, TD_RDONLY, timeout_ms, &s, &v);
  if (err == TD_ENOENT || err == TD_ETIMEDOUT)
    return 1;
  if (err < 0)
    return err;
  char shown[TD_KEY_MAX + 1];
  td__printable(name, shown, sizeof(shown));
  if (td_storage_device(s) != TD_CPU || v.dtype != TD_UINT8 || v.ndim != 1 ||
      v.stride[0] != 1) {
    td_storage_release(s);
    return td__fail(
        c, TD_EINVAL,
        "key '%s' holds no model manifest (not a CPU uint8 vector): "
        "unpublish it, or load --as another name",
        shown);
  }
  const uint8_t *p = (const uint8_t *)td_storage_data(s) + v.offset;
  err = mf_parse(c, name, p, (size_t)v.shape[0], m);
  if (err == 0 && id != NULL)
    *id = td_storage_id(s);
  if (err == 0 && text != NULL) {
    size_t l = 0;
    for (int i = 7; i >= 0; i--)
      l = l << 8 | p[8 + i];
    if ((*text = strndup((const char *)p + MF_HEADER, l)) == NULL) {
      mf_free(m);
      err = td__fail(c, TD_ENOMEM, "model '%s': out of memory", shown);
    }
  }
  td_storage_release(s);
  return err;
}

/* ---- names and keys ---- */

/* Checks a model's name: a key without '@' whose lock key fits. */
static int check_name(const td_client *c, const char *name) {
  if (name == NULL || name[0] == '\0')
    return td__fail(c, TD_EINVAL, "model: the name is empty");
  size_t n = strnlen(name, TD_KEY_MAX + 1);
  char shown[TD_KEY_MAX + 1];
  td__printable(name, shown, sizeof(shown));
  if (n + sizeof(LOCK_SUFFIX) - 1 > TD_KEY_MAX)
    return td__fail(c, TD_ENAMETOOLONG,
                    "model '%.64s...': a name of %zu bytes: its keys "
                    "(NAME@loading) must fit %d",
                    shown, strlen(name), TD_KEY_MAX);
  if (strchr(name, '@') != NULL)
    return td__fail(
        c, TD_EINVAL,
        "model '%s': a name may not contain '@' (NAME@V/... are its "
        "shards' keys)",
        shown);
  return 0;
}

/* ---- the load lock: NAME@loading in a scope of this connection ---- */

typedef struct lock {
  uint64_t scope;
  td_storage *s;
} lock;

/* The pid named by the lock's bytes, or 0. */
static long holder_pid(td_client *c, const char *key) {
  td_storage *s = NULL;
  long pid = 0;
  if (td_lookup(c, key, TD_RDONLY, 0, &s, NULL) < 0)
    return 0;
  size_t n = td_storage_nbytes(s);
  if (td_storage_device(s) == TD_CPU && n <= 4096) {
    json_error_t e;
    int over;
    json_t *root =
        td__json_loadb_bounded(td_storage_data(s), n, 0, 1 << 20, &e, &over);
    json_t *p = json_object_get(root, "pid");
    if (json_is_integer(p))
      pid = (long)json_integer_value(p);
    json_decref(root);
  }
  td_storage_release(s);
  return pid;
}

static void lock_drop(td_client *c, lock *l) {
  if (l->scope != 0)
    td_scope_close(c, l->scope, NULL);
  td_storage_release(l->s);
  memset(l, 0, sizeof(*l));
}

/* Takes name's load lock, waiting up to wait_ms (-1: forever). *waited is
 * set if another held it first. Returns 0 or TD_EBUSY / TD_ETIMEDOUT naming
 * the holder, or another failure; l is empty on failure. */
static int lock_take(td_client *c, const char *name, const char *path,
                     int32_t wait_ms, lock *l, int *waited) {
  char key[TD_KEY_MAX + 1];
  keyf(key, "%s" LOCK_SUFFIX, name); /* check_name: it fits */
  memset(l, 0, sizeof(*l));
  int err = td_scope_open(c, &l->scope);
  if (err < 0) {
    l->scope = 0;
    return err;
  }
  json_t *j = json_pack("{s:I, s:s, s:I}", "pid", (json_int_t)getpid(), "path",
                        path ? path : "", "started_ms", (json_int_t)now_ms());
  char *text = j != NULL ? json_dumps(j, JSON_COMPACT) : NULL;
  json_decref(j);
  if (text == NULL) {
    lock_drop(c, l);
    return td__fail(c, TD_ENOMEM, "model lock: out of memory");
  }
  td_create_opts co = {.nbytes = strlen(text)};
  if ((err = td_storage_create_ex(c, &co, &l->s)) < 0) {
    free(text);
    lock_drop(c, l);
    return err;
  }
  memcpy(td_storage_data(l->s), text, strlen(text));
  free(text);
  td_publish_opts po = {.scope = l->scope};
  double start = mono_s();
  int sleep_ms = 10;
  for (;;) {
    err = td_publish_ex(c, key, l->s, NULL, &po);
    if (err != TD_EEXIST)
      break;
    double waited_ms = (mono_s() - start) * 1e3;
    if (wait_ms == 0 || (wait_ms > 0 && waited_ms >= wait_ms)) {
      long pid = holder_pid(c, key);
      char shown[TD_KEY_MAX + 1];
      td__printable(name, shown, sizeof(shown));
      err = td__fail(c, wait_ms == 0 ? TD_EBUSY : TD_ETIMEDOUT,
                     "model '%s' is being loaded by pid %ld (lock %s%s)%s",
                     shown, pid, shown, LOCK_SUFFIX,
                     wait_ms == 0 ? "" : ": waited for it too long");
      break;
    }
    *waited = 1;
    struct timespec ts = {0, (long)sleep_ms * 1000000};
    nanosleep(&ts, NULL);
    sleep_ms = sleep_ms < 50 ? sleep_ms + 10 : 50;
  }
  if (err < 0)
    lock_drop(c, l);
  return err;
}

/* ---- orphans: shard keys of versions no manifest names ---- */

typedef struct idlist {
  uint64_t *v;
  size_t n, cap;
} idlist;

static int idlist_add(idlist *l, uint64_t id) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 16;
    uint64_t *v = realloc(l->v, cap * sizeof(*v));
    if (v == NULL)
      return -1;
    l->v = v;
    l->cap = cap;
  }
  l->v[l->n++] = id;
  return 0;
}

/* Whether key is name@<digits>/...; *version gets the digits. */
static int is_shard_key(const char *key, const char *name, uint64_t *version) {
  size_t n = strlen(name);
  if (strncmp(key, name, n) != 0 || key[n] != '@')
    return 0;
  const char *p = key + n + 1;
  uint64_t v = 0;
  if (*p < '0' || *p > '9')
    return 0;
  for (; *p >= '0' && *p <= '9'; p++)
    v = v * 10 + (uint64_t)(*p - '0');
  *version = v;
  return *p == '/';
}

static int is_tensor_key(const char *key, const char *name) {
  size_t n = strlen(name);
  return strncmp(key, name, n) == 0 && key[n] == '/';
}

typedef struct sweep {
  const char *name;
  idlist ids;
  int oom;
} sweep;

static int sweep_list(const td_storage_info *s, void *arg) {
  sweep *w = arg;
  int take = s->nkeys_total > s->nkeys;
  uint64_t v;
  for (size_t i = 0; i < s->nkeys && !take; i++)
    take = is_shard_key(s->keys[i], w->name, &v) ||
           is_tensor_key(s->keys[i], w->name);
  if (take && idlist_add(&w->ids, s->id) < 0)
    w->oom = 1;
  return 0;
}

typedef struct keyset {
  char **v;
  size_t n, cap;
  uint64_t total;
} keyset;

static int keys_of(const td_storage_info *s, void *arg) {
  ((keyset *)arg)->total = s->nkeys_total;
  return 0;
}

static int key_of(const td_key_info *k, void *arg) {
  keyset *ks = arg;
  if (ks->n == ks->cap) {
    size_t cap = ks->cap ? 2 * ks->cap : 64;
    char **v = realloc(ks->v, cap * sizeof(*v));
    if (v == NULL)
      return TD_ENOMEM;
    ks->v = v;
    ks->cap = cap;
  }
  if ((ks->v[ks->n] = strdup(k->key)) == NULL)
    return TD_ENOMEM;
  ks->n++;
  return 0;
}

static void keyset_free(keyset *ks) {
  for (size_t i = 0; i < ks->n; i++)
    free(ks->v[i]);
  free(ks->v);
  memset(ks, 0, sizeof(*ks));
}

/* Unpublishes the keys of name (shard keys name@V/..., and the tensor keys
 * name/... beside them) on every storage that holds a shard key of a
 * version other than keep (0: any version). Such storages are left by a
 * loader that died, or are older versions being dropped. A storage shows
 * its newest 1024 keys to td_info, so one whose shard key is older than
 * that many of its tensor keys is found once those go (the loop below), or
 * not at all if none of the visible ones is a shard key: docs/models.md.
 * Sets *found to the storages swept. Returns 0 or a negative code. */
static int sweep_orphans(td_client *c, const char *name, uint64_t keep,
                         size_t *found) {
  sweep w = {.name = name};
  *found = 0;
  int err = td_list(c, sweep_list, &w);
  if (err == 0 && w.oom)
    err =
        td__fail(c, TD_ENOMEM, "model '%s': out of memory listing keys", name);
  for (size_t i = 0; i < w.ids.n && err == 0; i++) {
    for (int round = 0; round < 1024; round++) {
      keyset ks = {0};
      int e = td_info(c, w.ids.v[i], NULL, keys_of, key_of, &ks);
      if (e < 0) {
        keyset_free(&ks);
        if (e != TD_ENOENT)
          err = e;
        break;
      }
      int orphan = 0, current = 0;
      uint64_t v;
      for (size_t k = 0; k < ks.n; k++)
        if (is_shard_key(ks.v[k], name, &v)) {
          if (keep != 0 && v == keep)
            current = 1;
          else
            orphan = 1;
        }
      size_t gone = 0;
      if (orphan && !current) {
        for (size_t k = 0; k < ks.n && err == 0; k++)
          if (is_shard_key(ks.v[k], name, &v) || is_tensor_key(ks.v[k], name)) {
            e = td_unpublish(c, ks.v[k]);
            if (e < 0 && e != TD_ENOENT)
              err = e;
            gone++;
          }
        if (round == 0)
          (*found)++;
      }
      int more = orphan && !current && gone > 0 && ks.total > ks.n;
      keyset_free(&ks);
      if (!more)
        break;
    }
  }
  free(w.ids.v);
  return err;
}

/* ---- reading shards into storages ---- */

/* A load's target: the CPU, or a GPU by this process's ordinal and its
 * UUID (the ordinal is the loader's; readers find the GPU by the UUID). */
typedef struct target {
  int cuda;
  int64_t index;
  char uuid[48];    /* "GPU-..." for CUDA, else "" */
  uint64_t staging; /* CUDA: the pinned staging buffer's bound, bytes */
} target;

typedef struct load_ctx load_ctx;

/* Where a chunk of a shard goes: the seam for devices. The CPU sink copies
 * it into the storage's segment in the kernel; the GPU sink reads it into a
 * slot of a bounded pinned staging buffer and copies that to the device
 * asynchronously, the next read overlapping the copy. begin/end set up and
 * drain what a sink needs. */
typedef struct sink {
  int (*begin)(load_ctx *l, char *msg, size_t mlen);
  int (*chunk)(load_ctx *l, uint32_t shard, uint64_t off, uint64_t len,
               char *msg, size_t mlen);
  int (*end)(load_ctx *l, char *msg, size_t mlen);
} sink;

struct load_ctx {
  td__checkpoint *ck;
  td_storage **st; /* per shard */
  int *seg;        /* CPU: each storage's segment fd, or -1 */
  uint8_t **dst;   /* CPU: each storage's mapping, once a chunk needs it */
  const sink *sk;
  td__custage *stage; /* CUDA: the pinned staging slots */
  uint64_t staging;   /* CUDA: their bound, bytes */
  uint64_t njobs;
  atomic_uint_fast64_t next;
  atomic_uint_fast64_t bytes_done;
  atomic_uint_fast64_t *left; /* per shard: bytes still to read */
  atomic_uint shards_done;
  atomic_int err;
  pthread_mutex_t mu; /* msg, dst */
  char msg[TD__ERRMSG_MAX];
  /* jobs: shard by shard, CHUNK bytes each */
  uint64_t *first_job; /* per shard + 1 */
  td_load_progress_cb progress;
  void *progress_arg;
  double last_progress;
};

static int shrank(const td__st_shard *s, uint64_t off, char *msg, size_t mlen) {
  return td__msg(msg, mlen, TD_EAGAIN,
                 "%s: shrank while it was read (end of file at byte "
                 "%" PRIu64 " of %" PRIu64 ")",
                 s->file, off, s->size);
}

/* splice from the checkpoint into the segment through a pipe of this
 * chunk's own: page-cache pages into the pipe by reference, then copied
 * into the shared-memory pages in the kernel, at an explicit offset (the
 * segment's file position, shared with every holder of its description,
 * is never used). No page of the storage is faulted in from user space.
 * Returns 0, 1 if splice cannot serve these files (the caller falls back),
 * or a negative code with msg. *off and *len advance past what was
 * copied. */
static int cpu_splice(load_ctx *l, uint32_t shard, uint64_t *off, uint64_t *len,
                      char *msg, size_t mlen) {
  td__st_shard *s = &l->ck->shards[shard];
  int p[2];
  if (l->seg[shard] < 0 || pipe2(p, O_CLOEXEC) < 0)
    return 1;
  int cap = fcntl(p[1], F_SETPIPE_SZ, 1 << 20); /* the unprivileged max */
  if (cap < 0)
    cap = fcntl(p[1], F_GETPIPE_SZ);
  if (cap <= 0)
    cap = 65536;
  int rc = 0;
  while (rc == 0 && *len > 0) {
    loff_t in = (loff_t)*off;
    size_t want = *len < (uint64_t)cap ? (size_t)*len : (size_t)cap;
    ssize_t r = splice(s->fd, &in, p[1], NULL, want, SPLICE_F_MOVE);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
      rc = 1;
      break;
    }
    if (r < 0) {
      rc = td__msg(msg, mlen, TD_EIO, "%s: reading bytes %" PRIu64 "..: %s",
                   s->file, *off, strerror(errno));
      break;
    }
    if (r == 0) {
      rc = shrank(s, *off, msg, mlen);
      break;
    }
    /* The pipe now holds r bytes: all of them go, or the load fails (the
     * pipe cannot be emptied otherwise, so no fallback from here). */
    loff_t out = (loff_t)*off;
    for (size_t left = (size_t)r; left > 0;) {
      ssize_t w = splice(p[0], NULL, l->seg[shard], &out, left, SPLICE_F_MOVE);
      if (w < 0 && errno == EINTR)
        continue;
      if (w <= 0) {
        rc = td__msg(msg, mlen, w < 0 && errno == ENOSPC ? TD_ENOSPC : TD_EIO,
                     "%s: copying bytes %" PRIu64 ".. into its storage: %s",
                     s->file, (uint64_t)out,
                     w < 0 ? strerror(errno) : "nothing written");
        break;
      }
      left -= (size_t)w;
    }
    if (rc == 0) {
      *off += (uint64_t)r;
      *len -= (uint64_t)r;
    }
  }
  close(p[0]);
  close(p[1]);
  return rc;
}

static uint8_t *dst_of(load_ctx *l, uint32_t shard) {
  pthread_mutex_lock(&l->mu);
  if (l->dst[shard] == NULL)
    l->dst[shard] = td_storage_data(l->st[shard]);
  uint8_t *p = l->dst[shard];
  pthread_mutex_unlock(&l->mu);
  return p;
}

/* The CPU sink: splice into the segment; where that cannot serve, pread
 * into the storage's mapping. For 512 MiB from the page cache on this
 * 2-vCPU VM: splice (or sendfile, the same in the kernel) 0.15 s, pwrite
 * from a populated mapping of the file 0.35 s, pread into a populated
 * mapping 0.9 s, into a fresh one 1.8 s (first-touch faults), cat 0.08 s. */
static int cpu_chunk(load_ctx *l, uint32_t shard, uint64_t off, uint64_t len,
                     char *msg, size_t mlen) {
  td__st_shard *s = &l->ck->shards[shard];
  int rc = cpu_splice(l, shard, &off, &len, msg, mlen);
  if (rc <= 0)
    return rc;
  uint8_t *p = dst_of(l, shard) + off;
  while (len > 0) {
    ssize_t r = pread(s->fd, p, len, (off_t)off);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return td__msg(msg, mlen, TD_EIO, "%s: reading bytes %" PRIu64 "..: %s",
                     s->file, off, strerror(errno));
    if (r == 0)
      return shrank(s, off, msg, mlen);
    p += r;
    off += (uint64_t)r;
    len -= (uint64_t)r;
  }
  return 0;
}

static const sink cpu_sink = {NULL, cpu_chunk, NULL};

/* The GPU sink: each chunk is read, a slot at a time, into a slot of a
 * pinned staging buffer and copied to the shard's device storage
 * asynchronously on the slot's stream; the reader goes on to the next slot
 * while the copy runs, and a slot is read into again only once its copy is
 * done. The buffer holds at most l->staging bytes whatever the model. */
#define STAGING_MAX ((uint64_t)256 << 20)
#define STAGING_SLOTS 4 /* at least, where the bound allows */
#define STAGING_MIN ((uint64_t)4096)

static int gpu_begin(load_ctx *l, char *msg, size_t mlen) {
  uint64_t bound = l->staging;
  if (bound > l->ck->bytes)
    bound = (l->ck->bytes + STAGING_MIN - 1) / STAGING_MIN * STAGING_MIN;
  if (bound == 0)
    return 0; /* nothing to copy */
  if (bound < STAGING_MIN)
    bound = STAGING_MIN;
  uint64_t slot = bound / STAGING_SLOTS / STAGING_MIN * STAGING_MIN;
  if (slot < STAGING_MIN)
    slot = STAGING_MIN;
  if (slot > CHUNK)
    slot = CHUNK;
  unsigned n = (unsigned)(bound / slot);
  return td__custage_open(td__storage_cumap(l->st[0]), (size_t)slot, n,
                          &l->stage, msg, mlen);
}

static int gpu_chunk(load_ctx *l, uint32_t shard, uint64_t off, uint64_t len,
                     char *msg, size_t mlen) {
  td__st_shard *s = &l->ck->shards[shard];
  td__cumap *dst = td__storage_cumap(l->st[shard]);
  size_t cap = td__custage_slot(l->stage);
  while (len > 0) {
    unsigned slot;
    void *host;
    int err = td__custage_take(l->stage, &slot, &host, msg, mlen);
    if (err < 0)
      return err;
    size_t n = len < cap ? (size_t)len : cap, got = 0;
    while (got < n) {
      ssize_t r =
          pread(s->fd, (uint8_t *)host + got, n - got, (off_t)(off + got));
      if (r < 0 && errno == EINTR)
        continue;
      if (r <= 0) {
        td__custage_put(l->stage, slot, NULL, 0, 0, NULL, 0);
        if (r == 0)
          return shrank(s, off + got, msg, mlen);
        return td__msg(msg, mlen, TD_EIO, "%s: reading bytes %" PRIu64 "..: %s",
                       s->file, off + got, strerror(errno));
      }
      got += (size_t)r;
    }
    if ((err = td__custage_put(l->stage, slot, dst, (size_t)off, n, msg,
                               mlen)) < 0)
      return err;
    off += n;
    len -= n;
  }
  return 0;
}

/* Waits for every copy and frees the staging. */
static int gpu_end(load_ctx *l, char *msg, size_t mlen) {
  int err = td__custage_close(l->stage, msg, mlen);
  l->stage = NULL;
  return err;
}

static const sink gpu_sink = {gpu_begin, gpu_chunk, gpu_end};

/* The staging bound: TENSORD_LOAD_STAGING (a size as td__parse_size
 * reads it, at least 4 KiB), else 256 MiB; never above 256 MiB. Returns
 * 0, or TD_EINVAL with msg for a value that is no size. */
static int staging_bound(uint64_t *out, char *msg, size_t mlen) {
  const char *v = getenv("TENSORD_LOAD_STAGING");
  uint64_t n;
  *out = STAGING_MAX;
  if (v == NULL || v[0] == '\0')
    return 0;
  if (td__parse_size(v, &n) < 0 || n > STAGING_MAX)
    return td__msg(msg, mlen, TD_EINVAL,
                   "TENSORD_LOAD_STAGING='%s': a size in bytes (K, M, G "
                   "suffixes), at most 256M",
                   v);
  *out = n < STAGING_MIN ? STAGING_MIN : n;
  return 0;
}

/* Whether the first n bytes of shard i's storage are p's: 1 or 0, or a
 * negative code with msg when they cannot be read back. */
static int head_equal(load_ctx *l, size_t i, const uint8_t *p, size_t n,
                      char *msg, size_t mlen) {
  td__cumap *cm = td__storage_cumap(l->st[i]);
  uint8_t buf[16384];
  if (cm == NULL && l->seg[i] < 0)
    return memcmp(dst_of(l, (uint32_t)i), p, n) == 0;
  for (size_t off = 0; off < n;) {
    size_t want = n - off < sizeof(buf) ? n - off : sizeof(buf);
    if (cm != NULL) { /* read back from the device */
      int err = td__cumap_copy(cm, 0, off, buf, want, msg, mlen);
      if (err < 0)
        return err;
    } else {
      ssize_t r = pread(l->seg[i], buf, want, (off_t)off);
      if (r < 0 && errno == EINTR)
        continue;
      if (r <= 0)
        return td__msg(msg, mlen, TD_EIO,
                       "reading back %s's storage at byte %zu: %s",
                       l->ck->shards[i].file, off,
                       r < 0 ? strerror(errno) : "end of file");
      want = (size_t)r;
    }
    if (memcmp(buf, p + off, want) != 0)
      return 0;
    off += want;
  }
  return 1;
}

static void report(load_ctx *l, int final) {
  if (l->progress == NULL)
    return;
  double t = mono_s();
  if (!final && t - l->last_progress < 0.05)
    return;
  l->last_progress = t;
  td_load_progress p = {atomic_load(&l->bytes_done), l->ck->bytes,
                        atomic_load(&l->shards_done), (uint32_t)l->ck->nshards};
  l->progress(&p, l->progress_arg);
}

/* Reads jobs until none is left or one failed. The caller's thread reports
 * progress (main). */
static void work(load_ctx *l, int main) {
  char msg[TD__ERRMSG_MAX];
  for (;;) {
    if (atomic_load(&l->err) != 0)
      return;
    uint64_t j = atomic_fetch_add(&l->next, 1);
    if (j >= l->njobs)
      return;
    uint32_t s = 0;
    while (l->first_job[s + 1] <= j)
      s++;
    uint64_t off = (j - l->first_job[s]) * CHUNK;
    uint64_t size = l->ck->shards[s].size;
    uint64_t len = size - off < CHUNK ? size - off : CHUNK;
    int err = l->sk->chunk(l, s, off, len, msg, sizeof(msg));
    if (err < 0) {
      int zero = 0;
      if (atomic_compare_exchange_strong(&l->err, &zero, err)) {
        pthread_mutex_lock(&l->mu);
        snprintf(l->msg, sizeof(l->msg), "%s", msg);
        pthread_mutex_unlock(&l->mu);
      }
      return;
    }
    atomic_fetch_add(&l->bytes_done, len);
    if (atomic_fetch_sub(&l->left[s], len) == len)
      atomic_fetch_add(&l->shards_done, 1);
    if (main)
      report(l, 0);
  }
}

static void *worker(void *arg) {
  work(arg, 0);
  return NULL;
}

static unsigned default_threads(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < THREADS_MIN   ? THREADS_MIN
         : n > THREADS_CAP ? THREADS_CAP
                           : (unsigned)n;
}

/* Fills the storages of every shard of ck with the file's bytes, threads
 * at once, and checks that no file changed meanwhile. Returns 0 or a
 * negative code with the reason recorded for c. */
static int fill(td_client *c, td__checkpoint *ck, td_storage **st,
                unsigned threads, const td_load_opts *o, const target *tg) {
  int gpu = tg->cuda;
  load_ctx l = {.ck = ck, .st = st, .sk = gpu ? &gpu_sink : &cpu_sink};
  int err = 0;
  /* TENSORD_LOAD_COPY=pread: the fallback for every chunk (to compare, and
   * to test it where splice works). */
  const char *copy = getenv("TENSORD_LOAD_COPY");
  int by_pread = copy != NULL && strcmp(copy, "pread") == 0;
  pthread_t tids[THREADS_MAX];
  unsigned started = 0;
  pthread_mutex_init(&l.mu, NULL);
  l.dst = calloc(ck->nshards, sizeof(*l.dst));
  l.seg = malloc(ck->nshards * sizeof(*l.seg));
  l.left = calloc(ck->nshards, sizeof(*l.left));
  l.first_job = calloc(ck->nshards + 1, sizeof(*l.first_job));
  if (l.seg != NULL)
    for (size_t i = 0; i < ck->nshards; i++)
      l.seg[i] = -1;
  if (l.dst == NULL || l.seg == NULL || l.left == NULL || l.first_job == NULL) {
    err = td__fail(c, TD_ENOMEM, "load: out of memory");
    goto out;
  }
  for (size_t i = 0; i < ck->nshards; i++) {
    td__st_shard *s = &ck->shards[i];
    /* Without its fd, a shard is read into its mapping. */
    if (!gpu && !by_pread && td__storage_fd(st[i], &l.seg[i]) < 0)
      l.seg[i] = -1;
    atomic_init(&l.left[i], s->size);
    l.first_job[i + 1] = l.first_job[i] + (s->size + CHUNK - 1) / CHUNK;
    posix_fadvise(s->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    if (s->size == 0)
      atomic_fetch_add(&l.shards_done, 1);
  }
  l.njobs = l.first_job[ck->nshards];
  if (o != NULL) {
    l.progress = o->progress;
    l.progress_arg = o->progress_arg;
  }
  l.staging = tg->staging;
  if (l.sk->begin != NULL &&
      (err = l.sk->begin(&l, l.msg, sizeof(l.msg))) < 0) {
    td__fail(c, err, "load: %s", l.msg);
    goto out;
  }
  if (threads > l.njobs)
    threads = l.njobs ? (unsigned)l.njobs : 1;
  for (unsigned i = 1; i < threads; i++) {
    if (pthread_create(&tids[started], NULL, worker, &l) != 0)
      break; /* fewer threads: the work is still done */
    started++;
  }
  work(&l, 1);
  for (unsigned i = 0; i < started; i++)
    pthread_join(tids[i], NULL);
  if (l.sk->end != NULL) {
    char msg[TD__ERRMSG_MAX];
    int e = l.sk->end(&l, msg, sizeof(msg)), zero = 0;
    if (e < 0 && atomic_compare_exchange_strong(&l.err, &zero, e))
      snprintf(l.msg, sizeof(l.msg), "%s", msg);
  }
  if ((err = atomic_load(&l.err)) < 0) {
    td__fail(c, err, "load: %s", l.msg);
    goto out;
  }
  for (size_t i = 0; i < ck->nshards; i++) {
    td__st_shard *s = &ck->shards[i];
    struct stat sb;
    if (fstat(s->fd, &sb) < 0) {
      err = td__fail(c, TD_EIO, "load: %s: %s", s->file, strerror(errno));
      goto out;
    }
    int64_t mt = (int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec;
    int same = 0;
    if ((uint64_t)sb.st_size == s->size && mt == s->mtime_ns &&
        (same = head_equal(&l, i, s->head, 8 + s->header_len, l.msg,
                           sizeof(l.msg))) < 0) {
      err = td__fail(c, same, "load: %s", l.msg);
      goto out;
    }
    if (!same) {
      err =
          td__fail(c, TD_EAGAIN,
                   "load: %s changed while it was read (size %" PRIu64
                   " -> %lld, mtime %" PRId64 " -> %" PRId64 " ns): load again",
                   s->file, s->size, (long long)sb.st_size, s->mtime_ns, mt);
      goto out;
    }
  }
  report(&l, 1);
out:
  if (l.seg != NULL)
    for (size_t i = 0; i < ck->nshards; i++)
      if (l.seg[i] >= 0)
        close(l.seg[i]);
  free(l.seg);
  free(l.dst);
  free(l.left);
  free(l.first_job);
  pthread_mutex_destroy(&l.mu);
  return err;
}

/* ---- the manifest written ---- */

/* The manifest of ck as version v of name, as a new storage (mode). */
/* Writes u as the manifest keeps a GPU: GPU-xxxxxxxx-xxxx-xxxx-xxxx-
 * xxxxxxxxxxxx, a MIG instance's too (the text is compared, not shown). */
static void uuid_text(const uint8_t u[16], char *buf, size_t len) {
  td_gpu_uuid_str(u, 0, buf, len);
}

static int mf_make(td_client *c, const char *name, uint64_t v,
                   const td__checkpoint *ck, const target *tg, uint32_t mode,
                   td_storage **out) {
  json_t *files = json_array(), *shards = json_array(),
         *tensors = json_object();
  json_t *meta = ck->metadata ? json_incref(ck->metadata) : json_object();
  json_t *root = json_pack(
      "{s:i, s:s, s:I, s:s, s:i, s:I, s:{s:s, s:s, s:I, s:I, s:o}, s:o, "
      "s:o, s:o}",
      "format", 1, "name", name, "version", (json_int_t)v, "device",
      tg->cuda ? "cuda" : "cpu", "device_index", (json_int_t)tg->index,
      "loaded_ms", (json_int_t)now_ms(), "source", "path", ck->path, "kind",
      ck->is_index ? "index" : "file", "size", (json_int_t)ck->size, "mtime_ns",
      (json_int_t)ck->mtime_ns, "files", files, "metadata", meta, "shards",
      shards, "tensors", tensors);
  int err = 0;
  if (root != NULL && tg->cuda &&
      json_object_set_new(root, "device_uuid", json_string(tg->uuid)) < 0) {
    json_decref(root);
    root = NULL;
  }
  if (root == NULL) {
    /* json_pack took (and on failure freed) every "o" value. */
    return td__fail(c, TD_ENOMEM, "model '%s': out of memory for the manifest",
                    name);
  }
  char key[TD_KEY_MAX + 1];
  for (size_t i = 0; i < ck->nshards && err == 0; i++) {
    const td__st_shard *s = &ck->shards[i];
    keyf(key, "%s@%" PRIu64 "/%s", name, v, s->file); /* checked to fit */
    json_t *f =
        json_pack("{s:s, s:I, s:I}", "file", s->file, "size",
                  (json_int_t)s->size, "mtime_ns", (json_int_t)s->mtime_ns);
    json_t *sh = json_pack("{s:s, s:s, s:I, s:I}", "file", s->file, "key", key,
                           "nbytes", (json_int_t)s->size, "data_start",
                           (json_int_t)(8 + s->header_len));
    if (sh != NULL && s->metadata != NULL)
      json_object_set(sh, "metadata", s->metadata);
    if (json_array_append_new(files, f) < 0 ||
        json_array_append_new(shards, sh) < 0)
      err = TD_ENOMEM;
  }
  for (size_t i = 0; i < ck->ntensors && err == 0; i++) {
    const td__st_tensor *t = &ck->tensors[i];
    json_t *shape = json_array();
    for (int32_t d = 0; d < t->ndim && shape; d++)
      if (json_array_append_new(shape, json_integer(t->shape[d])) < 0)
        err = TD_ENOMEM;
    json_t *e =
        json_pack("{s:I, s:s, s:o, s:I, s:I}", "shard", (json_int_t)t->shard,
                  "dtype", td__st_dtype_name(t->dtype), "shape", shape, "begin",
                  (json_int_t)t->begin, "end", (json_int_t)t->end);
    if (json_object_set_new(tensors, t->name, e) < 0)
      err = TD_ENOMEM;
  }
  char *text = err == 0 ? json_dumps(root, JSON_COMPACT) : NULL;
  json_decref(root);
  if (text == NULL)
    return td__fail(c, TD_ENOMEM, "model '%s': out of memory for the manifest",
                    name);
  size_t n = strlen(text);
  td_create_opts co = {
      .nbytes = MF_HEADER + n, .mode = mode, .flags = TD_UNINIT};
  td_storage *s = NULL;
  if ((err = td_storage_create_ex(c, &co, &s)) < 0) {
    free(text);
    return err;
  }
  uint8_t *p = td_storage_data(s);
  memcpy(p, MF_MAGIC, 8);
  for (int i = 0; i < 8; i++)
    p[8 + i] = (uint8_t)((uint64_t)n >> (8 * i));
  memcpy(p + MF_HEADER, text, n);
  free(text);
  *out = s;
  return 0;
}

/* Whether m (NAME's manifest now) was loaded from ck as it is on disk. */
static int same_source(const manifest *m, const td__checkpoint *ck,
                       const target *tg) {
  if (strcmp(m->device, tg->cuda ? "cuda" : "cpu") != 0 ||
      (tg->cuda && (m->uuid == NULL || strcmp(m->uuid, tg->uuid) != 0)))
    return 0; /* another device: load it there */
  if (strcmp(m->path, ck->path) != 0 || m->size != ck->size ||
      m->mtime_ns != ck->mtime_ns || m->nfiles != ck->nshards)
    return 0;
  for (size_t i = 0; i < m->nfiles; i++)
    if (strcmp(m->files[i].file, ck->shards[i].file) != 0 ||
        m->files[i].size != ck->shards[i].size ||
        m->files[i].mtime_ns != ck->shards[i].mtime_ns)
      return 0;
  return 1;
}

/* ---- td_model_load ---- */

static int check_opts(const td_client *c, const td_load_opts *o) {
  if (o == NULL)
    return 0;
  for (size_t i = 0; i < sizeof(o->reserved) / sizeof(o->reserved[0]); i++)
    if (o->reserved[i] != 0)
      return td__fail(
          c, TD_EINVAL,
          "load with reserved[%zu] = 0x%llx: libtensord %s knows no "
          "such option",
          i, (unsigned long long)o->reserved[i], TD_VERSION_STRING);
  if (o->flags & ~TD_MODEL_FORCE)
    return td__fail(c, TD_EINVAL,
                    "load with flags 0x%x: only TD_MODEL_FORCE (0x%x)",
                    o->flags, TD_MODEL_FORCE);
  if (o->threads > THREADS_MAX)
    return td__fail(c, TD_EINVAL, "load with %u threads: at most %d",
                    o->threads, THREADS_MAX);
  if (o->wait_ms < -1)
    return td__fail(c, TD_EINVAL, "load with wait_ms %d: -1 (forever) or more",
                    (int)o->wait_ms);
  if (o->device != TD_CPU && o->device != TD_CUDA)
    return td__fail(c, TD_EINVAL, "load to device %d: TD_CPU or TD_CUDA",
                    (int)o->device);
  if (o->device == TD_CPU && o->device_index != 0)
    return td__fail(c, TD_EINVAL, "load to the CPU with device_index %lld",
                    (long long)o->device_index);
  return 0;
}

/* Checks that every key of version v of ck as name fits TD_KEY_MAX. */
static int check_keys(const td_client *c, const char *name, uint64_t v,
                      const td__checkpoint *ck) {
  size_t n = strlen(name);
  char shown[128];
  for (size_t i = 0; i < ck->ntensors; i++) {
    size_t k = n + 1 + strlen(ck->tensors[i].name);
    if (k > TD_KEY_MAX)
      return td__fail(c, TD_ENAMETOOLONG,
                      "model '%s': tensor '%s': its key %s/<tensor> would have "
                      "%zu bytes, over %d: choose a shorter name",
                      name,
                      td__printable(ck->tensors[i].name, shown, sizeof(shown)),
                      name, k, TD_KEY_MAX);
  }
  char vs[24];
  int vl = snprintf(vs, sizeof(vs), "%" PRIu64, v);
  for (size_t i = 0; i < ck->nshards; i++) {
    size_t k = n + 1 + (size_t)vl + 1 + strlen(ck->shards[i].file);
    if (k > TD_KEY_MAX)
      return td__fail(c, TD_ENAMETOOLONG,
                      "model '%s': shard '%s': its key %s@%s/<file> would have "
                      "%zu bytes, over %d: choose a shorter name",
                      name,
                      td__printable(ck->shards[i].file, shown, sizeof(shown)),
                      name, vs, k, TD_KEY_MAX);
  }
  return 0;
}

/* Publishes every tensor's key of ck (version storages st) as name/<t>.
 * Returns 0 or the first failure. */
static int publish_tensors(td_client *c, const char *name,
                           const td__checkpoint *ck, td_storage **st) {
  char key[TD_KEY_MAX + 1];
  for (size_t i = 0; i < ck->ntensors; i++) {
    const td__st_tensor *t = &ck->tensors[i];
    td_view v;
    td_view_contiguous(t->dtype, t->ndim, t->shape, &v);
    v.offset = (int64_t)(t->begin / td_dtype_size(t->dtype));
    keyf(key, "%s/%s", name, t->name); /* checked to fit */
    int err = td_publish(c, key, st[t->shard], &v);
    if (err < 0)
      return err;
  }
  return 0;
}

static int ck_has(const td__checkpoint *ck, const size_t *order,
                  const char *name) {
  size_t lo = 0, hi = ck->ntensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(ck->tensors[order[mid]].name, name);
    if (c == 0)
      return 1;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return 0;
}

static const td__st_tensor *ck_base;

static int ck_by_name(const void *a, const void *b) {
  return strcmp(ck_base[*(const size_t *)a].name,
                ck_base[*(const size_t *)b].name);
}

/* Unpublishes what version old of name had that ck (its successor) has not:
 * tensor keys of names ck lacks, and old's shard keys. Failures are
 * ignored: the next load's sweep takes what is left. */
static void drop_old(td_client *c, const char *name, const manifest *old,
                     const td__checkpoint *ck) {
  char key[TD_KEY_MAX + 1];
  size_t *order = NULL;
  if (ck != NULL) {
    order = malloc((ck->ntensors ? ck->ntensors : 1) * sizeof(*order));
    if (order != NULL) {
      for (size_t i = 0; i < ck->ntensors; i++)
        order[i] = i;
      pthread_mutex_lock(&name_mu);
      ck_base = ck->tensors;
      qsort(order, ck->ntensors, sizeof(*order), ck_by_name);
      pthread_mutex_unlock(&name_mu);
    }
  }
  for (size_t i = 0; i < old->ntensors; i++) {
    if (ck != NULL &&
        (order == NULL || ck_has(ck, order, old->tensors[i].name)))
      continue;
    if (keyf(key, "%s/%s", name, old->tensors[i].name) == 0)
      td_unpublish(c, key);
  }
  for (size_t i = 0; i < old->nshards; i++)
    td_unpublish(c, old->shards[i].key);
  free(order);
}

int td_model_default_name(const char *path, char *buf, size_t len) {
  char msg[TD__ERRMSG_MAX];
  if (path == NULL || buf == NULL)
    return td__fail(NULL, TD_EINVAL, "model name: path or buf is NULL");
  int err = td__ckpt_default_name(path, buf, len, msg, sizeof(msg));
  return err < 0 ? td__fail(NULL, err, "%s", msg) : 0;
}

int td_model_load(td_client *c, const char *path, const char *name,
                  const td_load_opts *o, td_load_result *out) {
  td_load_result res = {0};
  char derived[TD_KEY_MAX + 1];
  int err;
  if (path == NULL)
    return td__fail(c, TD_EINVAL, "load: path is NULL");
  if ((err = check_opts(c, o)) < 0)
    return err;
  if (name == NULL) {
    char msg[TD__ERRMSG_MAX];
    if ((err = td__ckpt_default_name(path, derived, sizeof(derived), msg,
                                     sizeof(msg))) < 0)
      return td__fail(c, err, "%s", msg);
    name = derived;
  }
  if ((err = check_name(c, name)) < 0)
    return err;
  target tg = {0};
  char msg[TD__ERRMSG_MAX];
  if (o != NULL && o->device == TD_CUDA) {
    uint8_t u[16];
    tg.cuda = 1;
    tg.index = o->device_index;
    if ((err = td__cu_resolve(o->device_index, u, msg, sizeof(msg))) < 0)
      return td__fail(c, err, "load to cuda:%lld: %s",
                      (long long)o->device_index, msg);
    uuid_text(u, tg.uuid, sizeof(tg.uuid));
    if ((err = staging_bound(&tg.staging, msg, sizeof(msg))) < 0)
      return td__fail(c, err, "load: %s", msg);
  }
  double t0 = mono_s();
  td__checkpoint ck;
  if ((err = td__ckpt_open(path, &ck, msg, sizeof(msg))) < 0)
    return td__fail(c, err, "%s", msg);
  /* The tensor keys, and the shard keys of version 1 (again below with
   * the version this load makes, before anything is made). */
  if ((err = check_keys(c, name, 1, &ck)) < 0)
    goto out_ck;
  lock lk;
  if ((err = lock_take(c, name, ck.path, o ? o->wait_ms : 0, &lk,
                       &res.waited)) < 0)
    goto out_ck;
  manifest cur;
  int none = mf_get(c, name, 0, &cur, NULL, NULL);
  if (none < 0) {
    err = none;
    goto out_lock;
  }
  if (!none && same_source(&cur, &ck, &tg) &&
      !(o != NULL && (o->flags & TD_MODEL_FORCE))) {
    res.version = cur.version;
    res.tensors = cur.ntensors;
    res.shards = (uint32_t)cur.nshards;
    for (size_t i = 0; i < cur.nshards; i++)
      res.bytes += cur.shards[i].nbytes;
    res.unchanged = 1;
    goto out_cur;
  }
  size_t swept;
  if ((err = sweep_orphans(c, name, none ? 0 : cur.version, &swept)) < 0)
    goto out_cur;
  uint64_t v = none ? 1 : cur.version + 1;
  if ((err = check_keys(c, name, v, &ck)) < 0)
    goto out_cur;
  td_storage **st = calloc(ck.nshards, sizeof(*st));
  size_t published = 0;
  char key[TD_KEY_MAX + 1];
  td_storage *ms = NULL;
  if (st == NULL) {
    err = td__fail(c, TD_ENOMEM, "load: out of memory");
    goto out_cur;
  }
  for (size_t i = 0; i < ck.nshards; i++) {
    td_create_opts co = {.nbytes = ck.shards[i].size,
                         .mode = o ? o->mode : 0,
                         .flags = TD_UNINIT,
                         .device = tg.cuda ? TD_CUDA : TD_CPU,
                         .device_index = tg.index};
    if ((err = td_storage_create_ex(c, &co, &st[i])) < 0) {
      td__fail(c, err, "load: a storage of %" PRIu64 " bytes for %s: %s",
               ck.shards[i].size, ck.shards[i].file, td_last_error(c));
      goto out_storages;
    }
  }
  unsigned threads = o && o->threads ? o->threads : default_threads();
  if ((err = fill(c, &ck, st, threads, o, &tg)) < 0)
    goto out_storages;
  for (; published < ck.nshards; published++) {
    keyf(key, "%s@%" PRIu64 "/%s", name, v, ck.shards[published].file);
    if ((err = td_publish(c, key, st[published], NULL)) < 0)
      goto out_unpublish;
  }
  if ((err = mf_make(c, name, v, &ck, &tg, o ? o->mode : 0, &ms)) < 0)
    goto out_unpublish;
  if ((err = td_publish(c, name, ms, NULL)) < 0)
    goto out_unpublish;
  /* The switch is made: from here NAME is version v. */
  err = publish_tensors(c, name, &ck, st);
  if (err < 0)
    td__fail(c, err,
             "model '%s': version %" PRIu64 " is in place, but a tensor "
             "key could not be published: %s",
             name, v, td_last_error(c));
  if (!none)
    drop_old(c, name, &cur, &ck);
  res.version = v;
  res.tensors = ck.ntensors;
  res.bytes = ck.bytes;
  res.shards = (uint32_t)ck.nshards;
  published = 0; /* keep them */
out_unpublish:
  for (size_t i = 0; i < published; i++) {
    keyf(key, "%s@%" PRIu64 "/%s", name, v, ck.shards[i].file);
    td_unpublish(c, key);
  }
out_storages:
  td_storage_release(ms);
  for (size_t i = 0; i < ck.nshards; i++)
    td_storage_release(st[i]);
  free(st);
out_cur:
  if (!none)
    mf_free(&cur);
out_lock:
  lock_drop(c, &lk);
out_ck:
  td__ckpt_free(&ck);
  res.seconds = mono_s() - t0;
  if (out != NULL && (err == 0 || res.version != 0))
    *out = res;
  return err;
}

/* ---- td_model_unload ---- */

int td_model_unload(td_client *c, const char *name) {
  int err = check_name(c, name);
  if (err < 0)
    return err;
  lock lk;
  int waited = 0;
  if ((err = lock_take(c, name, NULL, 0, &lk, &waited)) < 0)
    return err;
  manifest cur;
  int none = mf_get(c, name, 0, &cur, NULL, NULL);
  if (none < 0) {
    err = none;
    goto out;
  }
  if (!none) {
    /* The manifest first: from here no reader attaches it. */
    err = td_unpublish(c, name);
    if (err == 0 || err == TD_ENOENT) {
      drop_old(c, name, &cur, NULL);
      err = 0;
    }
    mf_free(&cur);
  }
  size_t swept = 0;
  if (err == 0)
    err = sweep_orphans(c, name, 0, &swept);
  if (err == 0 && none && swept == 0) {
    char shown[TD_KEY_MAX + 1];
    err = td__fail(c, TD_ENOENT, "unload: no model '%s'",
                   td__printable(name, shown, sizeof(shown)));
  }
out:
  lock_drop(c, &lk);
  return err;
}

/* ---- td_model_open ---- */

struct td_model {
  uint64_t version;
  manifest mf;
  char *text; /* the manifest's JSON */
  td_storage **st;
};

uint64_t td_model_version(const td_model *m) {
  return m->version;
}

size_t td_model_count(const td_model *m) {
  return m->mf.ntensors;
}

const char *td_model_manifest(const td_model *m) {
  return m->text;
}

int td_model_tensor(const td_model *m, size_t i, const char **name,
                    td_storage **s, td_view *v) {
  if (i >= m->mf.ntensors)
    return td__fail(NULL, TD_ERANGE, "model: tensor %zu of %zu", i,
                    m->mf.ntensors);
  const mf_tensor *t = &m->mf.tensors[i];
  if (name != NULL)
    *name = t->name;
  if (s != NULL)
    *s = m->st[t->shard];
  if (v != NULL)
    *v = t->view;
  return 0;
}

int td_model_find(const td_model *m, const char *name, td_storage **s,
                  td_view *v) {
  const mf_tensor *t = name != NULL ? mf_find(&m->mf, name) : NULL;
  if (t == NULL) {
    char shown[128];
    return td__fail(
        NULL, TD_ENOENT, "model: no tensor '%s' in version %" PRIu64,
        name ? td__printable(name, shown, sizeof(shown)) : "", m->version);
  }
  return td_model_tensor(m, (size_t)(t - m->mf.tensors), NULL, s, v);
}

void td_model_close(td_model *m) {
  if (m == NULL)
    return;
  for (size_t i = 0; i < m->mf.nshards; i++)
    td_storage_release(m->st[i]);
  free(m->st);
  free(m->text);
  mf_free(&m->mf);
  free(m);
}

static int id_of(const td_storage_info *s, void *arg) {
  *(uint64_t *)arg = s->id;
  return 0;
}

int td_model_open(td_client *c, const char *name, unsigned flags,
                  int timeout_ms, td_model **out) {
  *out = NULL;
  int err = check_name(c, name);
  if (err < 0)
    return err;
  if (flags & ~(TD_RDONLY | TD_COW | TD_LAZY))
    return td__fail(c, TD_EINVAL,
                    "open model: flags 0x%x: only TD_RDONLY, TD_COW, TD_LAZY",
                    flags);
  char shown[TD_KEY_MAX + 1];
  td__printable(name, shown, sizeof(shown));
  for (int attempt = 0; attempt < OPEN_TRIES; attempt++) {
    td_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
      return td__fail(c, TD_ENOMEM, "open model: out of memory");
    uint64_t mid = 0;
    int none =
        mf_get(c, name, attempt == 0 ? timeout_ms : 0, &m->mf, &mid, &m->text);
    if (none != 0) {
      free(m);
      if (none < 0)
        return none;
      return td__fail(
          c, timeout_ms != 0 && attempt == 0 ? TD_ETIMEDOUT : TD_ENOENT,
          "open model: no model '%s'%s", shown,
          timeout_ms != 0 && attempt == 0 ? " (timed out)" : "");
    }
    m->version = m->mf.version;
    m->st = calloc(m->mf.nshards ? m->mf.nshards : 1, sizeof(*m->st));
    if (m->st == NULL) {
      td_model_close(m);
      return td__fail(c, TD_ENOMEM, "open model: out of memory");
    }
    /* Every shard in one round trip; a shard gone means a newer version
     * replaced this one meanwhile: start again. */
    int gone = 0;
    size_t ns = m->mf.nshards;
    const char **keys = malloc((ns ? ns : 1) * sizeof(*keys));
    int *errs = malloc((ns ? ns : 1) * sizeof(*errs));
    if (keys == NULL || errs == NULL) {
      free(keys);
      free(errs);
      td_model_close(m);
      return td__fail(c, TD_ENOMEM, "open model: out of memory");
    }
    for (size_t i = 0; i < ns; i++)
      keys[i] = m->mf.shards[i].key;
    err = td_lookup_many(c, keys, ns, flags, 0, m->st, NULL, errs);
    for (size_t i = 0; i < ns; i++)
      gone = gone || errs[i] == TD_ENOENT;
    free(keys);
    free(errs);
    if (err < 0 && !gone) {
      td_model_close(m);
      return err;
    }
    for (size_t i = 0; i < ns && !gone; i++) {
      if (td_storage_nbytes(m->st[i]) != m->mf.shards[i].nbytes) {
        err = td__fail(c, TD_EINVAL,
                       "open model '%s': shard %s has %zu bytes, its manifest "
                       "says %" PRIu64,
                       shown, m->mf.shards[i].key, td_storage_nbytes(m->st[i]),
                       m->mf.shards[i].nbytes);
        td_model_close(m);
        return err;
      }
    }
    /* NAME still names the manifest read: no other version came between. */
    uint64_t now = 0;
    if (!gone && (err = td_info(c, 0, name, id_of, NULL, &now)) < 0 &&
        err != TD_ENOENT) {
      td_model_close(m);
      return err;
    }
    if (!gone && now == mid) {
      *out = m;
      return 0;
    }
    td_model_close(m);
  }
  return td__fail(c, TD_EAGAIN,
                  "open model: model '%s' kept changing (%d versions in a row "
                  "were replaced while attached)",
                  shown, OPEN_TRIES);
}

/* ---- td_model_save ---- */

/* Writes the parts (n of them) to path through a temporary file in its
 * directory, synced, then renamed. */
static int write_file(const td_client *c, const char *path,
                      const void *const *parts, const uint64_t *lens,
                      size_t n) {
  char tmp[PATH_MAX];
  if ((size_t)snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid()) >=
      sizeof(tmp))
    return td__fail(c, TD_ENAMETOOLONG, "save: %s: path too long", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return td__fail(c, -errno, "save: %s: %s", tmp, strerror(errno));
  int err = 0;
  for (size_t i = 0; i < n && err == 0; i++) {
    const uint8_t *p = parts[i];
    uint64_t left = lens[i];
    while (left > 0) {
      ssize_t w = write(fd, p, left < ((uint64_t)1 << 30) ? left : (1u << 30));
      if (w < 0 && errno == EINTR)
        continue;
      if (w < 0) {
        err = td__fail(c, -errno, "save: writing %s: %s", tmp, strerror(errno));
        break;
      }
      p += w;
      left -= (uint64_t)w;
    }
  }
  if (err == 0 && fsync(fd) < 0)
    err = td__fail(c, -errno, "save: syncing %s: %s", tmp, strerror(errno));
  if (close(fd) < 0 && err == 0)
    err = td__fail(c, -errno, "save: closing %s: %s", tmp, strerror(errno));
  if (err == 0 && rename(tmp, path) < 0)
    err = td__fail(c, -errno, "save: renaming %s to %s: %s", tmp, path,
                   strerror(errno));
  if (err < 0)
    unlink(tmp);
  return err;
}

static int is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Sets *p to shard i's bytes in host memory: its mapping for a CPU shard;
 * for a CUDA one a copy read back from the device, which *tofree then
 * owns (the whole shard at once: a save of a CUDA model needs host memory
 * for its largest shard). Returns 0 or a negative code recorded for c. */
static int shard_host(td_client *c, td_model *m, size_t i, const void **p,
                      void **tofree) {
  td__cumap *cm = td__storage_cumap(m->st[i]);
  *tofree = NULL;
  if (cm == NULL) {
    *p = td_storage_data(m->st[i]);
    return 0;
  }
  size_t n = td_storage_nbytes(m->st[i]);
  char msg[TD__ERRMSG_MAX];
  void *buf = malloc(n ? n : 1);
  if (buf == NULL)
    return td__fail(c, TD_ENOMEM,
                    "save: %zu bytes to read %s back from the "
                    "GPU: out of memory",
                    n, m->mf.shards[i].file);
  int err = td__cumap_copy(cm, 0, 0, buf, n, msg, sizeof(msg));
  if (err < 0) {
    free(buf);
    return td__fail(c, err, "save: reading %s back from the GPU: %s",
                    m->mf.shards[i].file, msg);
  }
  *p = buf;
  *tofree = buf;
  return 0;
}

static int save_model(td_client *c, const char *name, const char *out) {
  td_model *m = NULL;
  int err = td_model_open(c, name, TD_RDONLY | TD_LAZY, 0, &m);
  if (err < 0)
    return err;
  char path[PATH_MAX];
  size_t ns = m->mf.nshards;
  if (ns == 1) {
    if (is_dir(out))
      snprintf(path, sizeof(path), "%s/%s", out, m->mf.shards[0].file);
    else
      snprintf(path, sizeof(path), "%s", out);
    const void *part;
    void *tofree;
    uint64_t l = td_storage_nbytes(m->st[0]);
    if ((err = shard_host(c, m, 0, &part, &tofree)) == 0)
      err = write_file(c, path, &part, &l, 1);
    free(tofree);
    goto out;
  }
  if (mkdir(out, 0755) < 0 && errno != EEXIST) {
    err = td__fail(c, -errno, "save: %s: %s", out, strerror(errno));
    goto out;
  }
  if (!is_dir(out)) {
    err = td__fail(c, TD_EINVAL,
                   "save: %s is not a directory (model '%s' has %zu shards)",
                   out, name, ns);
    goto out;
  }
  for (size_t i = 0; i < ns && err == 0; i++) {
    snprintf(path, sizeof(path), "%s/%s", out, m->mf.shards[i].file);
    const void *part;
    void *tofree;
    uint64_t l = td_storage_nbytes(m->st[i]);
    if ((err = shard_host(c, m, i, &part, &tofree)) == 0)
      err = write_file(c, path, &part, &l, 1);
    free(tofree);
  }
  if (err < 0)
    goto out;
  /* The index json, from the manifest's metadata and tensors. */
  json_error_t e;
  int over;
  json_t *root = td__json_loadb_bounded(m->text, strlen(m->text), 0,
                                        MF_TREE_MAX, &e, &over);
  json_t *meta = json_object_get(root, "metadata");
  json_t *wm = json_object();
  for (size_t i = 0; i < m->mf.ntensors && wm; i++)
    json_object_set_new(wm, m->mf.tensors[i].name,
                        json_string(m->mf.shards[m->mf.tensors[i].shard].file));
  json_t *idx =
      json_pack("{s:O, s:o}", "metadata",
                json_is_object(meta) ? meta : json_object(), "weight_map", wm);
  char *text = idx ? json_dumps(idx, JSON_INDENT(2)) : NULL;
  json_decref(idx);
  json_decref(root);
  if (text == NULL) {
    err = td__fail(c, TD_ENOMEM, "save: out of memory for the index json");
    goto out;
  }
  snprintf(path, sizeof(path), "%s/%s", out, TD__ST_INDEX_NAME);
  const void *parts[2] = {text, "\n"};
  uint64_t lens[2] = {strlen(text), 1};
  err = write_file(c, path, parts, lens, 2);
  free(text);
out:
  td_model_close(m);
  return err;
}

static int by_itemsize(const void *a, const void *b) {
  const td__st_out *x = a, *y = b;
  size_t sx = td_dtype_size(x->dtype), sy = td_dtype_size(y->dtype);
  if (sx != sy)
    return sx > sy ? -1 : 1;
  return x->begin < y->begin ? -1 : x->begin > y->begin; /* keeps order */
}

/* Writes the state dict in s (view v) as one safetensors file at out. */
static int save_statedict(td_client *c, const char *key, td_storage *s,
                          const td_view *v, const char *out) {
  char msg[TD__ERRMSG_MAX], shown[128];
  const uint8_t *base = td_storage_data(s);
  td__statedict sd;
  int err = td__statedict_parse(base + v->offset, (size_t)v->shape[0], &sd, msg,
                                sizeof(msg));
  if (err < 0)
    return td__fail(c, err, "save: state dict '%s': %s", key, msg);
  td__st_out *t = calloc(sd.ntensors ? sd.ntensors : 1, sizeof(*t));
  const void **parts = calloc(sd.ntensors + 2, sizeof(*parts));
  uint64_t *lens = calloc(sd.ntensors + 2, sizeof(*lens));
  const uint8_t **src = calloc(sd.ntensors ? sd.ntensors : 1, sizeof(*src));
  char *header = NULL;
  if (t == NULL || parts == NULL || lens == NULL || src == NULL) {
    err = td__fail(c, TD_ENOMEM, "save: out of memory");
    goto out;
  }
  for (size_t i = 0; i < sd.ntensors; i++) {
    const td__sd_tensor *x = &sd.tensors[i];
    td__printable(x->name, shown, sizeof(shown));
    td_view tv;
    if (x->dtype == TD_DTYPE_INVALID || td__st_dtype_name(x->dtype) == NULL) {
      err = td__fail(c, TD_EINVAL,
                     "save: state dict '%s': tensor '%s' is %s, a dtype "
                     "safetensors has not",
                     key, shown, x->dtype_name);
      goto out;
    }
    if ((err = td__statedict_view(&sd, x, (uint64_t)v->offset, &tv, msg,
                                  sizeof(msg))) < 0) {
      td__fail(c, err, "save: state dict '%s': %s", key, msg);
      goto out;
    }
    if (td_view_is_contiguous(&tv) != 1) {
      char vb[256];
      err =
          td__fail(c, TD_EINVAL,
                   "save: state dict '%s': tensor '%s' is not contiguous (%s): "
                   "safetensors holds dense row-major tensors only; publish a "
                   ".contiguous() copy",
                   key, shown, td_view_format(&tv, vb, sizeof(vb)));
      goto out;
    }
    if (td_view_check(&tv, td_storage_nbytes(s)) != 0) {
      err = td__fail(
          c, TD_EINVAL,
          "save: state dict '%s': tensor '%s' reaches past its storage", key,
          shown);
      goto out;
    }
    size_t item = td_dtype_size(x->dtype);
    t[i] = (td__st_out){.name = x->name,
                        .dtype = x->dtype,
                        .ndim = x->ndim,
                        .shape = x->shape,
                        .begin = i,
                        .end = 0};
    src[i] = base + (uint64_t)tv.offset * item;
    lens[i] = (uint64_t)td_view_numel(&tv) * item; /* by index for now */
  }
  /* Widest elements first, so that with the header padded to 8 bytes every
   * tensor begins at a multiple of its size, and no gap between them: the
   * layout safetensors itself writes and checks. */
  qsort(t, sd.ntensors, sizeof(*t), by_itemsize);
  uint64_t off = 0;
  for (size_t i = 0; i < sd.ntensors; i++) {
    size_t orig = (size_t)t[i].begin;
    parts[i + 2] = src[orig];
    uint64_t n = lens[orig];
    t[i].begin = off;
    t[i].end = off + n;
    off += n;
  }
  for (size_t i = 0; i < sd.ntensors; i++)
    lens[i + 2] = t[i].end - t[i].begin;
  json_t *meta = json_pack("{s:s}", "format", "pt");
  size_t hlen = 0;
  header = td__st_header_build(t, sd.ntensors, meta, &hlen);
  json_decref(meta);
  if (header == NULL) {
    err = td__fail(c, TD_ENOMEM, "save: out of memory for the header");
    goto out;
  }
  uint8_t len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
  parts[0] = len8;
  lens[0] = 8;
  parts[1] = header;
  lens[1] = hlen;
  char path[PATH_MAX];
  if (is_dir(out))
    snprintf(path, sizeof(path), "%s/model.safetensors", out);
  else
    snprintf(path, sizeof(path), "%s", out);
  err = write_file(c, path, parts, lens, sd.ntensors + 2);
out:
  free(header);
  free(t);
  free(parts);
  free(lens);
  free(src);
  td__statedict_free(&sd);
  return err;
}

int td_model_save(td_client *c, const char *name, const char *out,
                  unsigned flags) {
  if (name == NULL || out == NULL)
    return td__fail(c, TD_EINVAL, "save: name or out is NULL");
  if (flags != 0)
    return td__fail(c, TD_EINVAL, "save: flags 0x%x: none are defined", flags);
  td_storage *s = NULL;
  td_view v;
  int err = td_lookup(c, name, TD_RDONLY | TD_LAZY, 0, &s, &v);
  if (err < 0)
    return err;
  char shown[TD_KEY_MAX + 1];
  td__printable(name, shown, sizeof(shown));
  const uint8_t *p = td_storage_data(s);
  int cpu = td_storage_device(s) == TD_CPU;
  if (cpu && v.dtype == TD_UINT8 && v.ndim == 1 && v.stride[0] == 1 &&
      v.shape[0] >= MF_HEADER && memcmp(p + v.offset, MF_MAGIC, 8) == 0) {
    td_storage_release(s);
    if (strchr(name, '@') != NULL)
      return td__fail(c, TD_EINVAL, "save: '%s' is no model name", shown);
    return save_model(c, name, out);
  }
  if (cpu && td__statedict_blob_shaped(&v) &&
      td__statedict_is(p + v.offset, (size_t)v.shape[0])) {
    err = save_statedict(c, shown, s, &v, out);
    td_storage_release(s);
    return err;
  }
  td_storage_release(s);
  return td__fail(c, TD_EINVAL,
                  "save: key '%s' holds neither a model (tensorctl load) nor a "
                  "state dict (tensord.torch.publish_state_dict)",
                  shown);
}

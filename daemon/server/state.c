/* state.c: published keys kept in --state-dir, so that a restart (after a
 * crash, or for an upgrade) serves every key again with the same bytes.
 *
 * The directory holds a snapshot (every key and the segment prefixes in
 * use, replaced atomically by rename) and a journal per generation
 * (journal.<N>, appended). Each key change is appended to the journal and
 * made durable (fdatasync, on the thread pool, many changes per sync) before
 * the client that made it is answered. */
#include "state.h"

#include "common.h"
#include "log.h"
#include "segment.h"
#include "tensord.pb-c.h"
#include "viewmsg.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define REC_HDR 8
#define REC_MAX (1u << 20)
/* Compact when the journal outgrows the snapshot this many times over. */
#define COMPACT_RATIO 4
#define COMPACT_MIN (4u << 20)
/* Keys serialised per loop turn while a snapshot is built: about 0.7 us
 * each here, so a slice holds the loop ~1.5 ms (100,000 keys at once held
 * it ~70 ms). */
#define COMPACT_SLICE_KEYS 2048

/* A reply that acknowledges a key change, held until the change is on
 * disk. */
typedef struct deferred {
  td__conn *conn; /* NULL once the connection is gone */
  uint64_t seq;
  uint64_t ticket;
  uint8_t *frame;
  size_t len;
  int fd;
  struct deferred *next;
} deferred;

/* A freed segment whose unlink waits for the journal. */
typedef struct held_unlink {
  uint64_t ticket;
  uint64_t nbytes;
  td_device device;
  uid_t owner; /* for the recycling pool, once the unlink is free to go */
  int foreign; /* ... which it never enters (td__storage.foreign) */
  char name[TD__SEGMENT_NAME_MAX];
  struct held_unlink *next;
} held_unlink;

struct td__state {
  td__server *srv;
  held_unlink *uhead, *utail;
  char dir[256];
  int dirfd, lockfd, jfd;
  uint64_t gen; /* the journal being appended is journal.<gen> */
  uint8_t *pending;
  size_t pending_len, pending_cap;
  uint64_t ticket;  /* of the last record appended */
  uint64_t durable; /* every record up to this ticket is on disk */
  int syncing;      /* a worker is writing records up to sync_ticket */
  uint64_t sync_ticket;
  uv_work_t work;
  uint8_t *wbuf;
  size_t wlen;
  int werr;
  deferred *dhead, *dtail;
  uint64_t journal_bytes, snapshot_bytes;
  int compacting;     /* a snapshot is being built, then written */
  struct snap *csnap; /* being built, a slice per loop turn */
  uv_idle_t *cidle;   /* drives the slices; freed by its close */
  uv_work_t cwork;
  uint8_t *cbuf; /* built: being written */
  size_t clen;
  uint64_t cgen;
  int cerr;
};

/* ---- records ---- */

static uint32_t crc32c(const uint8_t *p, size_t n) {
  static uint32_t table[256];
  if (table[1] == 0) {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++)
        c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      table[i] = c;
    }
  }
  uint32_t c = 0xffffffffu;
  while (n--)
    c = table[(c ^ *p++) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

/* Appends r, framed, to *buf. Returns 0 or TD_ENOMEM. */
static int append(uint8_t **buf, size_t *len, size_t *cap,
                  const Tensord__StateRecord *r) {
  size_t n = tensord__state_record__get_packed_size(r);
  if (*len + REC_HDR + n > *cap) {
    size_t c = *cap ? *cap : 4096;
    while (c < *len + REC_HDR + n)
      c *= 2;
    uint8_t *p = realloc(*buf, c);
    if (p == NULL)
      return TD_ENOMEM;
    *buf = p;
    *cap = c;
  }
  uint8_t *p = *buf + *len;
  tensord__state_record__pack(r, p + REC_HDR);
  put32(p, (uint32_t)n);
  put32(p + 4, crc32c(p + REC_HDR, n));
  *len += REC_HDR + n;
  return 0;
}

/* Fills m (and vm) with what brings key back: its storage, owner, view,
 * publisher. */
static void key_record(const char *key, size_t len, const td__storage *s,
                       uid_t publisher, const td_view *view,
                       int64_t published_ms, Tensord__StateKey *m,
                       Tensord__View *vm) {
  tensord__state_key__init(m);
  m->key.data = (uint8_t *)key;
  m->key.len = len;
  m->segment = (char *)s->name;
  m->nbytes = s->nbytes;
  m->owner_uid = s->owner.uid;
  m->owner_gid = s->owner.gid;
  m->owner_pid = s->owner.pid;
  m->mode = s->mode;
  m->created_unix_ms = s->created_ms;
  m->published_unix_ms = published_ms;
  m->publisher_uid = publisher;
  m->publisher_known = 1;
  td__view_to_msg(view, vm);
  m->view = vm;
}

/* A snapshot being serialised: the records so far, and how far the walk
 * over storages (in id order) has come. */
typedef struct snap {
  uint8_t *buf;
  size_t len, cap;
  uint64_t after; /* the storages up to this id are in buf */
  size_t nkeys;
  unsigned slices;
  char (*prefixes)[TD__PREFIX_MAX]; /* of adopted segments, seen so far */
  size_t nprefixes;
} snap;

static void snap_free(snap *sn) {
  if (sn == NULL)
    return;
  free(sn->buf);
  free(sn->prefixes);
  free(sn);
}

/* Starts a snapshot of generation gen: its generation and this instance's
 * prefix. Returns it, or NULL (no memory). */
static snap *snap_begin(td__server *srv, uint64_t gen) {
  snap *sn = calloc(1, sizeof(*sn));
  if (sn == NULL)
    return NULL;
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  r.body_case = TENSORD__STATE_RECORD__BODY_GENERATION;
  r.generation = gen;
  int err = append(&sn->buf, &sn->len, &sn->cap, &r);
  r.body_case = TENSORD__STATE_RECORD__BODY_PREFIX;
  r.prefix = srv->prefix;
  if (err == 0)
    err = append(&sn->buf, &sn->len, &sn->cap, &r);
  if (err < 0) {
    snap_free(sn);
    return NULL;
  }
  return sn;
}

/* Notes the prefix of s's segment if it is an adopted one not yet seen. */
static int snap_prefix(td__server *srv, snap *sn, const td__storage *s) {
  char p[TD__PREFIX_MAX];
  if (td__segment_prefix(s->name, p) < 0 || strcmp(p, srv->prefix) == 0)
    return 0;
  for (size_t i = 0; i < sn->nprefixes; i++)
    if (strcmp(sn->prefixes[i], p) == 0)
      return 0;
  char(*np)[TD__PREFIX_MAX] =
      realloc(sn->prefixes, (sn->nprefixes + 1) * sizeof(*np));
  if (np == NULL)
    return TD_ENOMEM;
  sn->prefixes = np;
  memcpy(sn->prefixes[sn->nprefixes++], p, sizeof(p));
  return 0;
}

/* Serialises the keys of the storages after sn->after, a whole storage at
 * a time, until at least max keys are in or no storage is left. Returns 1
 * when every storage is in (the prefixes of adopted segments then end the
 * snapshot), 0 if some are left, or TD_ENOMEM. */
static int snap_keys(td__server *srv, snap *sn, size_t max) {
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  size_t n = 0;
  sn->slices++;
  const td__storage *s = td__storage_after(&srv->reg, sn->after);
  for (; s != NULL && n < max; s = s->next) {
    if (s->keys != NULL && snap_prefix(srv, sn, s) < 0)
      return TD_ENOMEM;
    for (const td__key *k = s->keys; k != NULL; k = k->snext) {
      /* Never journaled, gone at a restart: scoped keys, and keys of a
       * GPU's storages (device memory dies with the daemon). */
      if (k->scope != NULL || s->device != TD_CPU)
        continue;
      n++;
      Tensord__StateKey m;
      Tensord__View vm;
      key_record(k->name, k->len, s, k->uid, &k->view, k->published_ms, &m,
                 &vm);
      r.body_case = TENSORD__STATE_RECORD__BODY_PUT;
      r.put = &m;
      if (append(&sn->buf, &sn->len, &sn->cap, &r) < 0)
        return TD_ENOMEM;
    }
    sn->after = s->id;
  }
  sn->nkeys += n;
  if (s != NULL)
    return 0;
  r.body_case = TENSORD__STATE_RECORD__BODY_PREFIX;
  for (size_t i = 0; i < sn->nprefixes; i++) {
    r.prefix = sn->prefixes[i];
    if (append(&sn->buf, &sn->len, &sn->cap, &r) < 0)
      return TD_ENOMEM;
  }
  return 1;
}

/* Serialises every key and the prefixes in use as a snapshot of generation
 * gen, at once. Returns 0 or TD_ENOMEM. */
static int snapshot_build(td__server *srv, uint64_t gen, uint8_t **out,
                          size_t *outlen) {
  snap *sn = snap_begin(srv, gen);
  if (sn == NULL || snap_keys(srv, sn, SIZE_MAX) < 0) {
    snap_free(sn);
    return TD_ENOMEM;
  }
  *out = sn->buf;
  *outlen = sn->len;
  sn->buf = NULL;
  snap_free(sn);
  return 0;
}

static int write_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      return -errno;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Replaces the snapshot with buf atomically and durably, then removes every
 * journal but gen's: older ones are in the snapshot, and any other (past a
 * gap a crash or damage left) was never replayed into it, so a later start
 * must not replay it either. Blocking. */
static int snapshot_write(int dirfd, const uint8_t *buf, size_t len,
                          uint64_t gen) {
  int fd = openat(dirfd, "snapshot.tmp",
                  O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return -errno;
  int err = write_all(fd, buf, len);
  if (err == 0 && fsync(fd) < 0)
    err = -errno;
  close(fd);
  if (err == 0 && renameat(dirfd, "snapshot.tmp", dirfd, "snapshot") < 0)
    err = -errno;
  if (err == 0 && fsync(dirfd) < 0)
    err = -errno;
  if (err < 0)
    return err;
  /* The snapshot and journal.<gen> are the state now. The dup shares
   * dirfd's offset, which an earlier listing left at the end: rewind. */
  DIR *d = fdopendir(dup(dirfd));
  if (d == NULL)
    return 0;
  rewinddir(d);
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    unsigned long long g;
    if (sscanf(e->d_name, "journal.%llu", &g) == 1 && g != gen)
      unlinkat(dirfd, e->d_name, 0);
  }
  closedir(d);
  return 0;
}

static int open_journal(td__state *st, uint64_t gen) {
  char name[48];
  snprintf(name, sizeof(name), "journal.%llu", (unsigned long long)gen);
  /* A new generation's journal starts empty: one left from before is
   * nothing this daemon recorded. */
  int fd = openat(st->dirfd, name,
                  O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0)
    return -errno;
  if (fsync(st->dirfd) < 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  if (st->jfd >= 0)
    close(st->jfd);
  st->jfd = fd;
  st->gen = gen;
  st->journal_bytes = 0;
  return 0;
}

/* ---- loading ---- */

/* Reads a whole file into *buf; a missing file is empty. */
static int slurp(int dirfd, const char *name, uint8_t **buf, size_t *len) {
  *buf = NULL;
  *len = 0;
  int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT ? 0 : -errno;
  struct stat sb;
  if (fstat(fd, &sb) < 0) {
    close(fd);
    return -errno;
  }
  uint8_t *p = malloc(sb.st_size > 0 ? (size_t)sb.st_size : 1);
  size_t n = 0;
  while (p != NULL && n < (size_t)sb.st_size) {
    ssize_t r = read(fd, p + n, (size_t)sb.st_size - n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    n += (size_t)r;
  }
  close(fd);
  if (p == NULL)
    return TD_ENOMEM;
  *buf = p;
  *len = n;
  return 1;
}

/* The last put of one live key, in the order keys were first put. */
typedef struct putent {
  td__hnode node;
  Tensord__StateRecord *r;
  struct putent *prev, *next;
} putent;

/* A segment adopted during the load, by name. */
typedef struct nameent {
  td__hnode node;
  td__storage *s;
} nameent;

/* What the records say, before any segment is looked at. */
typedef struct loaded {
  td__htab puts; /* putent by key */
  putent *first, *last;
  td__htab names; /* nameent by segment name */
  char (*prefixes)[64];
  size_t nprefixes;
  uint64_t gen;
  Tensord__StateRecord **all; /* every decoded record, to free */
  size_t nall, allcap;
} loaded;

static int put_eq(const td__hnode *n, const void *key) {
  const ProtobufCBinaryData *a =
      &td__container_of(n, putent, node)->r->put->key;
  const ProtobufCBinaryData *b = key;
  /* An empty key's data is NULL: no memcmp on it. */
  return a->len == b->len &&
         (a->len == 0 || memcmp(a->data, b->data, a->len) == 0);
}

static putent *find_put(const loaded *l, const ProtobufCBinaryData *key) {
  td__hnode *n =
      td__htab_find(&l->puts, td__hash_bytes(key->data, key->len), put_eq, key);
  return n ? td__container_of(n, putent, node) : NULL;
}

static int name_eq(const td__hnode *n, const void *key) {
  return strcmp(td__container_of(n, nameent, node)->s->name, key) == 0;
}

static td__storage *find_name(const loaded *l, const char *name) {
  td__hnode *n = td__htab_find(&l->names, td__hash_bytes(name, strlen(name)),
                               name_eq, name);
  return n ? td__container_of(n, nameent, node)->s : NULL;
}

static int keep(loaded *l, Tensord__StateRecord *r) {
  if (l->nall == l->allcap) {
    size_t cap = l->allcap ? l->allcap * 2 : 64;
    void *p = realloc(l->all, cap * sizeof(*l->all));
    if (p == NULL)
      return TD_ENOMEM;
    l->all = p;
    l->allcap = cap;
  }
  l->all[l->nall++] = r;
  return 0;
}

/* Applies the records in buf. Returns the bytes of whole, valid records: a
 * torn or corrupt tail (a crash mid-append) ends the replay there. */
static size_t replay(loaded *l, const uint8_t *buf, size_t len,
                     const char *name) {
  size_t off = 0;
  while (off + REC_HDR <= len) {
    uint32_t n = get32(buf + off);
    if (n > REC_MAX || off + REC_HDR + n > len ||
        crc32c(buf + off + REC_HDR, n) != get32(buf + off + 4))
      break;
    Tensord__StateRecord *r =
        tensord__state_record__unpack(NULL, n, buf + off + REC_HDR);
    if (r == NULL || keep(l, r) < 0) {
      if (r)
        tensord__state_record__free_unpacked(r, NULL);
      break;
    }
    off += REC_HDR + n;
    switch (r->body_case) {
    case TENSORD__STATE_RECORD__BODY_GENERATION:
      l->gen = r->generation;
      break;
    case TENSORD__STATE_RECORD__BODY_PREFIX:
      if (td__segment_prefix_valid(r->prefix)) {
        void *p = realloc(l->prefixes, (l->nprefixes + 1) * 64);
        if (p != NULL) {
          l->prefixes = p;
          snprintf(l->prefixes[l->nprefixes++], 64, "%s", r->prefix);
        }
      }
      break;
    case TENSORD__STATE_RECORD__BODY_PUT: {
      putent *e = find_put(l, &r->put->key);
      if (e != NULL) {
        e->r = r;
        break;
      }
      e = calloc(1, sizeof(*e));
      const ProtobufCBinaryData *k = &r->put->key;
      if (e == NULL || td__htab_insert(&l->puts, &e->node,
                                       td__hash_bytes(k->data, k->len)) < 0) {
        free(e);
        break;
      }
      e->r = r;
      e->prev = l->last;
      if (l->last)
        l->last->next = e;
      else
        l->first = e;
      l->last = e;
      break;
    }
    case TENSORD__STATE_RECORD__BODY_DEL: {
      putent *e = find_put(l, &r->del);
      if (e == NULL)
        break;
      td__htab_remove(&l->puts, &e->node);
      if (e->prev)
        e->prev->next = e->next;
      else
        l->first = e->next;
      if (e->next)
        e->next->prev = e->prev;
      else
        l->last = e->prev;
      free(e);
      break;
    }
    default:
      break;
    }
  }
  if (off < len)
    td__warn("state: %s: %zu byte(s) after the last whole record ignored "
             "(a write cut short by a crash)",
             name, len - off);
  return off;
}

static void loaded_free(loaded *l) {
  for (putent *e = l->first, *next; e; e = next) {
    next = e->next;
    free(e);
  }
  td__htab_free(&l->puts);
  for (size_t i = 0; i < l->names.nbuckets; i++) {
    for (td__hnode *n = l->names.buckets[i], *next; n; n = next) {
      next = n->next;
      free(td__container_of(n, nameent, node));
    }
  }
  td__htab_free(&l->names);
  for (size_t i = 0; i < l->nall; i++)
    tensord__state_record__free_unpacked(l->all[i], NULL);
  free(l->all);
  free(l->prefixes);
}

/* Serves the key recorded in m again: finds (or registers) its segment and
 * publishes the key. Returns 0, or a negative code with a warning: the
 * segment is gone or does not match, the record is malformed, or memory
 * ran out. The key is then dropped, and a segment registered for it alone
 * is unregistered again (and swept, as nothing names it), its charge
 * given back. */
static int adopt(td__server *srv, loaded *l, const Tensord__StateKey *m) {
  td__registry *reg = &srv->reg;
  char key[TD_KEY_MAX + 1], msg[256];
  size_t klen = m->key.len;
  if (td__key_validate((const char *)m->key.data, klen, msg, sizeof(msg)) < 0 ||
      strlen(m->segment) >= sizeof(((td__storage *)0)->name) ||
      strncmp(m->segment, "/tensord.", 9) != 0) {
    td__warn("state: a recorded key is malformed; dropped");
    return TD_EINVAL;
  }
  memcpy(key, m->key.data, klen);
  key[klen] = '\0';
  td_view v;
  if (m->view == NULL || td__view_from_msg(m->view, &v, msg, sizeof(msg)) < 0 ||
      td__view_check_msg(&v, m->nbytes, msg, sizeof(msg)) < 0) {
    td__warn("state: key '%s': recorded view is invalid; dropped", key);
    return TD_EINVAL;
  }
  td__storage *s = find_name(l, m->segment);
  nameent *ne = NULL;
  int err;
  if (s == NULL) {
    td__segment_desc d;
    err = td__backend_for(TD_CPU)->describe(m->segment, &d, msg, sizeof(msg));
    if (err == TD_ENOENT) {
      td__warn("state: key '%s': segment %s is gone (%s); dropped", key,
               m->segment, td_strerror(err));
      return err;
    }
    if (err < 0) { /* planted under its name, perhaps: never served */
      td__warn("state: key '%s': %s; dropped", key, msg);
      return err;
    }
    if (d.nbytes != m->nbytes) {
      td__warn("state: key '%s': segment %s is not %llu bytes; dropped", key,
               m->segment, (unsigned long long)m->nbytes);
      return TD_EINVAL;
    }
    s = calloc(1, sizeof(*s));
    ne = calloc(1, sizeof(*ne));
    if (s == NULL || ne == NULL) {
      free(s);
      free(ne);
      goto nomem;
    }
    s->id = reg->next_id++;
    s->nbytes = m->nbytes;
    s->device = TD_CPU;
    s->mode = m->mode & 0666;
    s->foreign = 1; /* mapped by whom before the restart, no one knows */
    s->owner.pid = m->owner_pid;
    s->owner.uid = m->owner_uid;
    s->owner.gid = m->owner_gid;
    s->created_ms = m->created_unix_ms;
    snprintf(s->name, sizeof(s->name), "%s", m->segment);
    ne->s = s;
    /* Past the limits: the storage existed before this start. */
    err = td__charge(reg, s->owner.uid, s->nbytes, 1, msg, sizeof(msg));
    if (err < 0)
      goto free_new;
    err = td__storage_insert(reg, s, NULL);
    if (err < 0)
      goto uncharge;
    /* The index is what keeps the sweep off the segment: it must hold. */
    err = td__htab_insert(&l->names, &ne->node,
                          td__hash_bytes(s->name, strlen(s->name)));
    if (err < 0)
      goto unregister;
  } else if (s->nbytes != m->nbytes) {
    /* The view was checked against the recorded size: it must be the
     * segment's. */
    td__warn("state: key '%s': segment %s is %llu bytes, not %llu; dropped",
             key, m->segment, (unsigned long long)s->nbytes,
             (unsigned long long)m->nbytes);
    return TD_EINVAL;
  }
  td__key *k;
  uid_t publisher = m->publisher_known ? m->publisher_uid : m->owner_uid;
  err = td__key_publish(reg, key, klen, s, publisher, &v, &k);
  if (err < 0) {
    if (ne != NULL) /* s was registered for this key alone */
      goto unindex;
    goto nomem;
  }
  k->published_ms = m->published_unix_ms;
  return 0;

unindex:
  td__htab_remove(&l->names, &ne->node);
unregister:
  td__storage_remove(reg, s);
uncharge:
  td__credit(reg, s->owner.uid, s->nbytes);
free_new:
  free(ne);
  free(s);
nomem:
  td__warn("state: key '%s': out of memory serving it again; dropped", key);
  return TD_ENOMEM;
}

static int adopted(const char *name, void *arg) {
  return find_name(arg, name) != NULL;
}

/* Unlinks every segment under the recorded prefixes that no key names. */
static int sweep(const loaded *l) {
  int n = 0;
  for (size_t i = 0; i < l->nprefixes; i++) {
    int k = td__segments_unlink_prefix(l->prefixes[i] + 1, adopted, (void *)l);
    if (k > 0)
      n += k;
  }
  return n;
}

/* Writes a snapshot of what srv serves as generation gen and opens the
 * journal that follows it, setting st->snapshot_bytes. Returns 0 or a
 * negative code. */
static int fresh_start(td__state *st, uint64_t gen) {
  uint8_t *sbuf = NULL;
  size_t snaplen = 0;
  int err = snapshot_build(st->srv, gen, &sbuf, &snaplen);
  if (err == 0)
    err = open_journal(st, gen);
  if (err == 0)
    err = snapshot_write(st->dirfd, sbuf, snaplen, gen);
  free(sbuf);
  if (err == 0)
    st->snapshot_bytes = snaplen;
  return err;
}

int td__state_open(td__server *srv, const char *dir) {
  td__state *st = calloc(1, sizeof(*st));
  if (st == NULL)
    return TD_ENOMEM;
  st->srv = srv;
  st->dirfd = st->lockfd = st->jfd = -1;
  snprintf(st->dir, sizeof(st->dir), "%s", dir);
  loaded l = {0};
  int err;
  if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
    err = -errno;
    td__error("--state-dir %s: cannot create it: %s", dir, strerror(errno));
    goto fail;
  }
  st->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (st->dirfd < 0) {
    err = -errno;
    td__error("--state-dir %s: %s", dir, strerror(errno));
    goto fail;
  }
  st->lockfd = openat(st->dirfd, "lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (st->lockfd < 0 || flock(st->lockfd, LOCK_EX | LOCK_NB) < 0) {
    err = st->lockfd < 0 || errno != EWOULDBLOCK ? -errno : TD_EBUSY;
    td__error("--state-dir %s: %s", dir,
              err == TD_EBUSY ? "another tensord uses it" : strerror(-err));
    goto fail;
  }

  /* The snapshot, then the journals from its generation on. */
  uint8_t *buf;
  size_t len;
  l.gen = 1;
  err = slurp(st->dirfd, "snapshot", &buf, &len);
  if (err < 0) {
    td__error("--state-dir %s: reading snapshot: %s", dir, strerror(-err));
    goto fail;
  }
  if (err > 0) {
    replay(&l, buf, len, "snapshot");
    free(buf);
  }
  uint64_t gen = l.gen;
  for (;; gen++) {
    char name[48];
    snprintf(name, sizeof(name), "journal.%llu", (unsigned long long)gen);
    err = slurp(st->dirfd, name, &buf, &len);
    if (err <= 0)
      break;
    replay(&l, buf, len, name);
    free(buf);
  }

  /* What the previous daemon on this socket recorded, in case it ran
   * without this state directory. */
  for (size_t i = 0; i < srv->nprev; i++) {
    void *p = realloc(l.prefixes, (l.nprefixes + 1) * 64);
    if (p == NULL)
      break;
    l.prefixes = p;
    snprintf(l.prefixes[l.nprefixes++], 64, "%s", srv->prev[i]);
  }
  size_t served = 0, dropped = 0;
  for (putent *e = l.first; e; e = e->next) {
    if (adopt(srv, &l, e->r->put) == 0)
      served++;
    else
      dropped++;
  }
  int swept = sweep(&l);
  td__info("state: %s: serving %zu key(s) on %llu storage(s) again; %zu "
           "dropped, %d unnamed segment(s) unlinked",
           dir, served, (unsigned long long)srv->reg.storages.count, dropped,
           swept);

  /* A fresh snapshot, and a new journal after it. */
  err = fresh_start(st, gen + 1);
  if (err < 0) {
    td__error("--state-dir %s: writing snapshot: %s", dir, td_strerror(err));
    goto fail;
  }
  loaded_free(&l);
  /* The replayed records were freed under the storages adopted after them:
   * give that memory back rather than keep it for the daemon's life. */
  malloc_trim(0);
  srv->state = st;
  return 0;

fail:
  /* The storages adopted so far go with the registry when the start fails:
   * their segments stay for the next start, which serves them. */
  if (srv->reg.storages.count > 0)
    srv->keep_segments = 1;
  loaded_free(&l);
  if (st->jfd >= 0)
    close(st->jfd);
  if (st->lockfd >= 0)
    close(st->lockfd);
  if (st->dirfd >= 0)
    close(st->dirfd);
  free(st);
  return err < 0 ? err : TD_EIO;
}

int td__state_adopt(td__server *srv, const char *dir, int dirfd, int lockfd,
                    uint64_t gen) {
  td__state *st = calloc(1, sizeof(*st));
  if (st == NULL) {
    close(dirfd);
    close(lockfd);
    return TD_ENOMEM;
  }
  st->srv = srv;
  st->dirfd = dirfd;
  st->lockfd = lockfd;
  st->jfd = -1;
  snprintf(st->dir, sizeof(st->dir), "%s", dir);
  int err = fresh_start(st, gen + 1);
  if (err < 0) {
    td__error("--state-dir %s: writing snapshot after the upgrade: %s; key "
              "changes are not kept from now on",
              dir, td_strerror(err));
    if (st->jfd >= 0)
      close(st->jfd);
    close(lockfd);
    close(dirfd);
    free(st);
    return err;
  }
  srv->state = st;
  return 0;
}

int td__state_quiet(const td__state *st) {
  return st == NULL ||
         (st->durable == st->ticket && !st->syncing && !st->compacting &&
          st->dhead == NULL && st->uhead == NULL && st->pending_len == 0);
}

void td__state_handover(const td__state *st, int *dirfd, int *lockfd,
                        uint64_t *gen) {
  *dirfd = st->dirfd;
  *lockfd = st->lockfd;
  *gen = st->gen;
}

/* ---- appending ---- */

static void sync_start(td__state *st);

int td__state_hold_unlink(td__state *st, const td__storage *s) {
  /* No key ever named s: no journal names its segment. */
  if (st == NULL || st->durable == st->ticket || !s->named)
    return 0;
  held_unlink *u = calloc(1, sizeof(*u));
  if (u == NULL)
    return 0; /* unlink now: a crash before the sync drops the key */
  u->ticket = st->ticket;
  u->nbytes = s->nbytes;
  u->device = s->device;
  u->owner = s->owner.uid;
  u->foreign = s->foreign;
  snprintf(u->name, sizeof(u->name), "%s", s->name);
  if (st->utail)
    st->utail->next = u;
  else
    st->uhead = u;
  st->utail = u;
  return 1;
}

/* Recycles or unlinks the held segments whose key changes are on disk (all
 * if all). */
static void release_unlinks(td__state *st, int all) {
  while (st->uhead != NULL && (all || st->uhead->ticket <= st->durable)) {
    held_unlink *u = st->uhead;
    st->uhead = u->next;
    if (st->uhead == NULL)
      st->utail = NULL;
    if (u->foreign ||
        !td__segment_pool(st->srv, u->device, u->name, u->nbytes, u->owner))
      td__segment_unlink(st->srv, u->device, u->name, u->nbytes);
    free(u);
  }
}

/* Sends the held replies whose changes are on disk now, or, if the write
 * failed (err), tells their clients so. */
static void deliver(td__state *st, int err) {
  while (st->dhead != NULL && st->dhead->ticket <= st->durable) {
    deferred *d = st->dhead;
    st->dhead = d->next;
    if (st->dhead == NULL)
      st->dtail = NULL;
    if (d->conn != NULL && err == 0) {
      td__conn_send_frame(d->conn, d->frame, d->len, d->fd);
    } else {
      if (d->fd >= 0)
        close(d->fd);
      if (d->conn != NULL)
        td__conn_error(d->conn, d->seq, TD_EIO,
                       "the change is made but recording it in %s failed "
                       "(%s): it may not survive a restart",
                       st->dir, td_strerror(err));
    }
    free(d->frame);
    free(d);
  }
}

static void sync_work(uv_work_t *w) {
  td__state *st = td__container_of(w, td__state, work);
  st->werr = write_all(st->jfd, st->wbuf, st->wlen);
  if (st->werr == 0 && fdatasync(st->jfd) < 0)
    st->werr = -errno;
}

static void compact_start(td__state *st);

/* A sync has ended with err: its changes are as durable as they will get.
 * Answers their clients, unlinks the segments they freed, and starts what
 * comes next (unless tensord is stopping: the final snapshot has it all). */
static void sync_done(td__state *st, int err) {
  td__server *srv = st->srv;
  st->syncing = 0;
  srv->metrics.journal_syncs++;
  if (err < 0)
    td__error("state: appending to %s/journal.%llu: %s", st->dir,
              (unsigned long long)st->gen, td_strerror(err));
  st->journal_bytes += st->wlen;
  st->durable = st->sync_ticket;
  free(st->wbuf);
  st->wbuf = NULL;
  deliver(st, err);
  release_unlinks(st, 0);
  if (srv->stopping)
    return;
  if (err < 0 && !st->compacting) {
    /* What the failed write or sync left in the journal is unknown (the
     * kernel may drop the pages of a failed write-back), and replay stops
     * at the first bad record: a change appended behind it would be lost
     * however well it synced. So the next changes go to a new journal,
     * after a snapshot of now. */
    compact_start(st);
    if (!st->compacting)
      td__error("state: cannot start a new journal in %s after that error; "
                "changes go on in journal.%llu",
                st->dir, (unsigned long long)st->gen);
  }
  if (st->pending_len > 0)
    sync_start(st);
  else if (!st->compacting && st->journal_bytes > COMPACT_MIN &&
           st->journal_bytes > COMPACT_RATIO * st->snapshot_bytes)
    compact_start(st);
}

static void sync_after(uv_work_t *w, int status) {
  td__state *st = td__container_of(w, td__state, work);
  td__server *srv = st->srv;
  sync_done(st, status < 0 ? TD_ECANCELED : st->werr);
  td__work_done(srv); /* may close st: the last use */
}

/* Hands the pending records to a worker unless one is busy. */
static void sync_start(td__state *st) {
  if (st->syncing || st->pending_len == 0 || st->compacting)
    return;
  st->wbuf = st->pending;
  st->wlen = st->pending_len;
  st->sync_ticket = st->ticket;
  st->pending = NULL;
  st->pending_len = st->pending_cap = 0;
  st->syncing = 1;
  if (uv_queue_work(st->srv->loop, &st->work, sync_work, sync_after) < 0) {
    sync_done(st, TD_ENOMEM);
    return;
  }
  st->srv->pending_work++;
}

static int log_record(td__state *st, const Tensord__StateRecord *r) {
  if (append(&st->pending, &st->pending_len, &st->pending_cap, r) < 0) {
    td__error("state: out of memory recording a key change; refusing it");
    return TD_ENOMEM;
  }
  st->ticket++;
  sync_start(st);
  return 0;
}

int td__state_put(td__state *st, const char *key, size_t len,
                  const td__storage *s, uid_t publisher, const td_view *view) {
  if (st == NULL)
    return 0;
  Tensord__StateKey m;
  Tensord__View vm;
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  key_record(key, len, s, publisher, view, td__now_ms(), &m, &vm);
  r.body_case = TENSORD__STATE_RECORD__BODY_PUT;
  r.put = &m;
  return log_record(st, &r);
}

int td__state_del(td__state *st, const char *key, size_t len) {
  if (st == NULL)
    return 0;
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  r.body_case = TENSORD__STATE_RECORD__BODY_DEL;
  r.del.data = (uint8_t *)key;
  r.del.len = len;
  return log_record(st, &r);
}

int td__state_reply(td__state *st, td__conn *c, Tensord__Response *r, int fd) {
  if (st == NULL || st->durable == st->ticket)
    return td__conn_send(c, r, fd);
  deferred *d = calloc(1, sizeof(*d));
  size_t len = tensord__response__get_packed_size(r);
  uint8_t *frame = malloc(len ? len : 1);
  if (d == NULL || frame == NULL) {
    free(d);
    free(frame);
    if (fd >= 0)
      close(fd);
    return td__conn_error(c, r->seq, TD_ENOMEM, "out of memory");
  }
  tensord__response__pack(r, frame);
  d->conn = c;
  d->seq = r->seq;
  d->ticket = st->ticket;
  d->frame = frame;
  d->len = len;
  d->fd = fd;
  if (st->dtail)
    st->dtail->next = d;
  else
    st->dhead = d;
  st->dtail = d;
  return 0;
}

void td__state_conn_gone(td__state *st, const td__conn *c) {
  if (st == NULL)
    return;
  for (deferred *d = st->dhead; d; d = d->next) {
    if (d->conn == c) {
      d->conn = NULL;
      if (d->fd >= 0)
        close(d->fd);
      d->fd = -1;
    }
  }
}

/* ---- compaction ---- */

static void compact_work(uv_work_t *w) {
  td__state *st = td__container_of(w, td__state, cwork);
  st->cerr = snapshot_write(st->dirfd, st->cbuf, st->clen, st->cgen);
}

static void compact_after(uv_work_t *w, int status) {
  td__state *st = td__container_of(w, td__state, cwork);
  td__server *srv = st->srv;
  st->compacting = 0;
  if (status < 0 || st->cerr < 0)
    td__error("state: compacting into %s/snapshot: %s", st->dir,
              td_strerror(status < 0 ? TD_ECANCELED : st->cerr));
  else {
    st->snapshot_bytes = st->clen;
    td__debug("state: compacted into snapshot generation %llu (%zu bytes)",
              (unsigned long long)st->cgen, st->clen);
  }
  free(st->cbuf);
  st->cbuf = NULL;
  if (!srv->stopping)
    sync_start(st);
  td__work_done(srv); /* may close st: the last use */
}

static void on_compact_idle(uv_idle_t *h);

static void free_handle(uv_handle_t *h) {
  free(h);
}

/* Ends the build of the snapshot: stops the slices, frees what is left. */
static void compact_build_end(td__state *st) {
  if (st->cidle != NULL)
    uv_idle_stop(st->cidle);
  snap_free(st->csnap);
  st->csnap = NULL;
}

/* Serialises one slice of the snapshot; once it is whole, writes it on the
 * thread pool. */
static void compact_slice(td__state *st) {
  td__server *srv = st->srv;
  int done = snap_keys(srv, st->csnap, COMPACT_SLICE_KEYS);
  if (done == 0) {
    if (st->cidle == NULL && (st->cidle = malloc(sizeof(*st->cidle))) != NULL) {
      uv_idle_init(srv->loop, st->cidle);
      st->cidle->data = st;
    }
    if (st->cidle != NULL) {
      uv_idle_start(st->cidle, on_compact_idle);
      return;
    }
    done = snap_keys(srv, st->csnap, SIZE_MAX); /* no handle: all now */
  }
  if (done < 0) {
    td__error("state: no memory to build a snapshot in %s; journal.%llu "
              "goes on growing",
              st->dir, (unsigned long long)st->gen);
    compact_build_end(st);
    st->compacting = 0;
    sync_start(st);
    return;
  }
  if (st->csnap->slices > 1)
    td__debug("state: snapshot generation %llu: %zu key(s), built over %u "
              "loop turns",
              (unsigned long long)st->cgen, st->csnap->nkeys,
              st->csnap->slices);
  st->cbuf = st->csnap->buf;
  st->clen = st->csnap->len;
  st->csnap->buf = NULL;
  compact_build_end(st);
  if (uv_queue_work(srv->loop, &st->cwork, compact_work, compact_after) < 0) {
    free(st->cbuf);
    st->cbuf = NULL;
    st->compacting = 0;
    sync_start(st);
    return;
  }
  srv->pending_work++;
}

static void on_compact_idle(uv_idle_t *h) {
  compact_slice(h->data);
}

/* Writes a snapshot on the thread pool, built a slice of keys per loop
 * turn; changes from now on go to the next journal. Runs only between
 * syncs, and no sync runs until the snapshot is written. The snapshot is
 * fuzzy: a key that changes while it is built may be in it before or after
 * the change, and the next journal has the change either way; a replay
 * applies records by key, last one wins, so snapshot then journal is the
 * state of the end. */
static void compact_start(td__state *st) {
  uint64_t gen = st->gen + 1;
  snap *sn = snap_begin(st->srv, gen);
  if (sn == NULL)
    return;
  if (open_journal(st, gen) < 0) {
    snap_free(sn);
    return;
  }
  st->csnap = sn;
  st->cgen = gen;
  st->compacting = 1;
  td__debug("state: compacting %llu journal bytes into a snapshot",
            (unsigned long long)st->journal_bytes);
  compact_slice(st);
}

void td__state_close(td__state *st) {
  if (st == NULL)
    return;
  /* A snapshot half built is replaced by the final one. */
  compact_build_end(st);
  if (st->cidle != NULL)
    uv_close((uv_handle_t *)st->cidle, free_handle);
  /* Everything in memory, in one snapshot: the next start replays nothing. */
  uint8_t *buf;
  size_t len;
  uint64_t gen = st->gen + 1;
  if (snapshot_build(st->srv, gen, &buf, &len) == 0) {
    int err = open_journal(st, gen);
    if (err == 0)
      err = snapshot_write(st->dirfd, buf, len, gen);
    if (err < 0)
      td__error("state: final snapshot in %s: %s", st->dir, td_strerror(err));
    free(buf);
  }
  /* The snapshot names none of the held segments. */
  release_unlinks(st, 1);
  for (deferred *d = st->dhead, *next; d; d = next) { /* clients are gone */
    next = d->next;
    if (d->fd >= 0)
      close(d->fd);
    free(d->frame);
    free(d);
  }
  free(st->pending);
  if (st->jfd >= 0)
    close(st->jfd);
  close(st->lockfd);
  close(st->dirfd);
  free(st);
}

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
#include "journal.h"
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
  td__snap *csnap;    /* being built, a slice per loop turn */
  uv_idle_t *cidle;   /* drives the slices; freed by its close */
  uv_work_t cwork;
  uint8_t *cbuf; /* built: being written */
  size_t clen;
  uint64_t cgen;
  int cerr;
};


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


/* Serves the key recorded in m again: finds (or registers) its segment and
 * publishes the key. Returns 0, or a negative code with a warning: the
 * segment is gone or does not match, the record is malformed, or memory
 * ran out. The key is then dropped, and a segment registered for it alone
 * is unregistered again (and swept, as nothing names it), its charge
 * given back. */
static int adopt(td__server *srv, td__loaded *l, const Tensord__StateKey *m) {
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
  td__storage *s = td__loaded_name(l, m->segment);
  td__nameent *ne = NULL;
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
  return td__loaded_name(arg, name) != NULL;
}

/* Unlinks every segment under the recorded prefixes that no key names. */
static int sweep(const td__loaded *l) {
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
  int err = td__snapshot_build(&st->srv->reg, st->srv->prefix, gen, &sbuf, &snaplen);
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
  td__loaded l = {0};
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
    td__replay(&l, buf, len, "snapshot");
    free(buf);
  }
  uint64_t gen = l.gen;
  for (;; gen++) {
    char name[48];
    snprintf(name, sizeof(name), "journal.%llu", (unsigned long long)gen);
    err = slurp(st->dirfd, name, &buf, &len);
    if (err <= 0)
      break;
    td__replay(&l, buf, len, name);
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
  for (td__putent *e = l.first; e; e = e->next) {
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
  td__loaded_free(&l);
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
  td__loaded_free(&l);
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
  if (td__rec_append(&st->pending, &st->pending_len, &st->pending_cap, r) < 0) {
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
  td__rec_key(key, len, s, publisher, view, td__now_ms(), &m, &vm);
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
  td__snap_free(st->csnap);
  st->csnap = NULL;
}

/* Serialises one slice of the snapshot; once it is whole, writes it on the
 * thread pool. */
static void compact_slice(td__state *st) {
  td__server *srv = st->srv;
  int done = td__snap_keys(&srv->reg, srv->prefix, st->csnap, COMPACT_SLICE_KEYS);
  if (done == 0) {
    if (st->cidle == NULL && (st->cidle = malloc(sizeof(*st->cidle))) != NULL) {
      uv_idle_init(srv->loop, st->cidle);
      st->cidle->data = st;
    }
    if (st->cidle != NULL) {
      uv_idle_start(st->cidle, on_compact_idle);
      return;
    }
    done = td__snap_keys(&srv->reg, srv->prefix, st->csnap, SIZE_MAX); /* no handle: all now */
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
  td__snap *sn = td__snap_begin(st->srv->prefix, gen);
  if (sn == NULL)
    return;
  if (open_journal(st, gen) < 0) {
    td__snap_free(sn);
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
  if (td__snapshot_build(&st->srv->reg, st->srv->prefix, gen, &buf, &len) == 0) {
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

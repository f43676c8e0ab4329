/* client.c: libtensord's connection to tensord: requests and replies matched
 * by seq so any number of threads can share one client, storage handles, and
 * the key operations.
 *
 * Two locks. mu guards the client's state (calls waiting for replies, the
 * reader's role, the held handles, broken and why) and is never held across
 * a system call that can block. smu guards the output queue and is held
 * while a sender blocks in sendmsg: so a thread that is sending never keeps
 * the reader from handing replies over, and the daemon, which stops reading
 * a client that leaves its replies unread, always gets them read. Lock
 * order: smu, then mu. */
#include "internal.h"

#include "htab.h"

#include "tensord.pb-c.h"
#include "viewmsg.h"
#include "wire.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* Releases queued behind a request at most (see release_handle). */
#define DEFER_MAX 64

/* Frames of a streaming reply (and so at most PARTS_MAX * 4 fds) queued
 * for a caller that another thread reads for: past this the other readers
 * wait until the caller has mapped some, so that no thread reads a reply
 * into more fds than the process may hold. */
#define PARTS_MAX 4

/* A frame of a reply that comes in several (a LookupMany's), queued for
 * its caller with its fds. */
typedef struct part {
  Tensord__Response *resp;
  int fds[TD__FRAME_MAX_FDS];
  unsigned nfds;
  struct part *next;
} part;

/* A call waiting for the reply with its seq. A streaming call's frames are
 * queued in parts (nparts of them) for its owner thread until the one that
 * ends the reply (done); owner_waits while that thread waits for another
 * reader, when it cannot be draining them. */
typedef struct pending {
  uint64_t seq;
  int done;
  Tensord__Response *resp;
  int fd;
  int stream;
  part *head, **tail;
  unsigned nparts;
  int owner_waits;
  pthread_t owner;
  struct pending *next;
} pending;

struct td_client {
  pthread_mutex_t mu; /* the state below, except where it says smu */
  pthread_cond_t cv;
  pthread_mutex_t smu; /* the wire's output half and deferred */
  atomic_int refs;     /* the user's (until td_close) plus one per handle */
  int closed;          /* td_close was called */
  int broken; /* the connection failed: every call now fails with err */
  int err;
  int reader;    /* a thread is reading replies for everyone */
  td__wire wire; /* input half: the reader's; output half: smu's */
  uint64_t next_seq;
  pending *pending;
  uint64_t instance;
  int32_t daemon_pid;
  int why_code; /* the daemon's last word on the connection (seq 0) */
  char why[512];
  td__htab held;     /* handles per (storage, mode), for release_handle */
  unsigned deferred; /* releases queued, not yet sent (smu) */
  pid_t pid;         /* the process that connected; set once */
  char path[108];    /* set once */
  char name[TD_CLIENT_NAME_MAX + 1]; /* its Hello's client_name; set once */
};

struct td_storage {
  td_client *c;
  atomic_int refs;
  uint64_t id;
  size_t nbytes;
  td_device device;
  int readonly; /* the reference is read-only (TD_RDONLY or TD_COW) */
  int cow;      /* and mapped copy-on-write (TD_COW) */
  td__mapping *map;
  int device_index; /* TD_CUDA: the GPU's ordinal in this process */
  uint8_t uuid[16]; /* TD_CUDA: the GPU's UUID */
  /* From a lookup of a key published with an event: its IPC handle. */
  int has_event;
  uint8_t event[64];
  /* A slot of a channel (chan.c): the channel holds the reference; the
   * handle's release gives the slot back to the ring, and sends nothing. */
  td_chan *chan;
  uint32_t slot;
};

/* Handles this connection holds, per storage and mode. */
typedef struct held {
  td__hnode node;
  uint64_t key; /* id << 1 | readonly */
  uint32_t n;
} held;

/* ---- errors ---- */

/* Records why a call on c (NULL: on no client) failed, in the one error
 * channel (common/errors.c), and returns err. */
static int fail(const td_client *c, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(const td_client *c, int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  td__vfail(c, err, fmt, ap);
  va_end(ap);
  return err;
}

const char *td_last_error(const td_client *c) {
  return td__last_error(c); /* compares c, never reads it */
}

void td__client_keep_error(const td_client *c) {
  if (c != NULL)
    td__fail(c, 0, "%s", td__last_error(NULL));
}

/* This process's pid, cached so that the checks below cost no system call
 * (getpid() is one since glibc 2.25, about 1 us on a VM, and a channel's
 * slot handoff made four of them per hop). The cache is a page that fork()
 * gives the child zeroed (MADV_WIPEONFORK), however the child was forked:
 * a child finds 0 and asks the kernel again. Without MADV_WIPEONFORK
 * (Linux before 4.14) every call asks. */
static _Atomic pid_t *pid_cache;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;

static void pid_cache_init(void) {
#ifdef MADV_WIPEONFORK
  long page = sysconf(_SC_PAGESIZE);
  void *p = mmap(NULL, (size_t)page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return;
  if (madvise(p, (size_t)page, MADV_WIPEONFORK) < 0) {
    munmap(p, (size_t)page);
    return;
  }
  pid_cache = p;
#endif
}

static pid_t self_pid(void) {
  pthread_once(&pid_once, pid_cache_init);
  if (pid_cache == NULL)
    return getpid();
  pid_t pid = atomic_load_explicit(pid_cache, memory_order_relaxed);
  if (pid == 0) {
    pid = getpid();
    atomic_store_explicit(pid_cache, pid, memory_order_relaxed);
  }
  return pid;
}

/* Whether this process is a child forked after c connected: c's socket and
 * locks are its parent's, and the child must not touch them. */
static int forked(const td_client *c) {
  return c->pid != self_pid();
}

static int fail_forked(const td_client *c, const char *op) {
  return fail(c, TD_EFORKED,
              "%s: this client was connected by process %d and is used in "
              "process %d, a child forked since: its connection is the "
              "parent's; call td_connect again in this process",
              op, (int)c->pid, (int)getpid());
}

/* ---- the connection ---- */

static void client_unref(td_client *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1)
    return;
  /* In a forked child the memory stays: its locks and queues may have been
   * mid-change in another of the parent's threads. td_close closed the
   * child's copy of the socket. */
  if (forked(c))
    return;
  /* Its storages are gone: no recycled allocation comes back through it,
   * and with the process's last client of that daemon, none at all. */
  if (c->instance != 0)
    td__cumap_client_leave(c->instance);
  if (c->wire.fd >= 0)
    close(c->wire.fd);
  td__wire_free(&c->wire);
  for (size_t i = 0; i < c->held.nbuckets; i++) {
    for (td__hnode *n = c->held.buckets[i], *next; n; n = next) {
      next = n->next;
      free(td__container_of(n, held, node));
    }
  }
  td__htab_free(&c->held);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->smu);
  pthread_cond_destroy(&c->cv);
  free(c);
}

/* Marks the connection failed, shuts its socket down and wakes every
 * waiting call. The shutdown wakes a thread blocked sending or reading (a
 * reader first reads what is queued, which may say why the daemon hung up)
 * and makes the daemon drop our references now. Locked. */
static void set_broken(td_client *c, int err) {
  if (c->broken)
    return;
  c->broken = 1;
  c->err = err;
  shutdown(c->wire.fd, SHUT_RDWR);
  pthread_cond_broadcast(&c->cv);
}

/* Packs r into the output queue and, if flush, sends everything queued,
 * blocking while the socket is full. Takes smu, and mu only briefly to mark
 * the connection broken: so a send that blocks (the daemon reads no more
 * until we read its replies) never stops the reader. Returns 0, TD_EMSGSIZE
 * or TD_ENOMEM (nothing queued), or TD_ECONNRESET. */
static int send_request(td_client *c, Tensord__Request *r, int flush) {
  size_t len = tensord__request__get_packed_size(r);
  int err = 0;
  pthread_mutex_lock(&c->smu);
  uint8_t *p = td__wire_reserve(&c->wire, len);
  if (p == NULL) {
    err = len > TD__FRAME_MAX ? TD_EMSGSIZE : TD_ENOMEM;
    goto unlock;
  }
  tensord__request__pack(r, p);
  err = td__wire_commit(&c->wire, len, NULL, 0);
  if (err < 0)
    goto unlock;
  if (!flush && ++c->deferred < DEFER_MAX)
    goto unlock;
  c->deferred = 0;
  if (td__wire_flush(&c->wire, 0) < 0) { /* with any deferred releases */
    /* The stream may end in part of a frame: it is of no more use. */
    err = TD_ECONNRESET;
    pthread_mutex_lock(&c->mu);
    set_broken(c, TD_ECONNRESET);
    pthread_mutex_unlock(&c->mu);
  }
unlock:
  pthread_mutex_unlock(&c->smu);
  return err;
}

/* Reads until one whole reply frame has arrived and hands it, with its fds
 * (*nfds of them), to its caller. Called by the one reader, unlocked;
 * returns 0 or a connection error. */
static int read_reply(td_client *c, Tensord__Response **resp, int *fds,
                      unsigned *nfds) {
  for (;;) {
    td__frame f;
    int r = td__wire_frame(&c->wire, &f);
    if (r < 0)
      return r;
    if (r == 1) {
      *resp = tensord__response__unpack(NULL, f.len, f.data);
      memcpy(fds, f.fds, f.nfds * sizeof(int));
      *nfds = f.nfds;
      td__wire_consume(&c->wire, &f);
      if (*resp == NULL) {
        td__close_fds(fds, *nfds);
        *nfds = 0;
        return TD_EPROTO;
      }
      return 0;
    }
    ssize_t n = td__wire_recv(&c->wire, 0);
    if (n == 0)
      return TD_ECONNRESET;
    if (n < 0)
      return (int)n == TD_EPROTO ? TD_EPROTO : TD_ECONNRESET;
  }
}

/* The daemon may have said why it hung up before we noticed (a send that
 * failed): read what it left, without blocking. Locked, no reader active:
 * the input half is ours. */
static void read_why(td_client *c) {
  for (int i = 0; i < 64 && c->why[0] == '\0'; i++) {
    td__frame f;
    int r = td__wire_frame(&c->wire, &f);
    if (r < 0)
      return;
    if (r == 0) {
      if (td__wire_recv(&c->wire, MSG_DONTWAIT) <= 0)
        return;
      continue;
    }
    Tensord__Response *resp = tensord__response__unpack(NULL, f.len, f.data);
    td__close_fds(f.fds, f.nfds);
    td__wire_consume(&c->wire, &f);
    if (resp != NULL && resp->seq == 0 &&
        resp->body_case == TENSORD__RESPONSE__BODY_ERROR) {
      c->why_code = resp->error->code < 0 ? resp->error->code : TD_EPROTO;
      snprintf(c->why, sizeof(c->why), "%s", resp->error->message);
      c->err = c->why_code;
    }
    if (resp != NULL)
      tensord__response__free_unpacked(resp, NULL);
  }
}

/* Hands r (with its fds) to the call waiting for it. Locked. */
static void deliver(td_client *c, Tensord__Response *r, int *fds,
                    unsigned nfds) {
  pending *q = c->pending;
  while (q != NULL && q->seq != r->seq)
    q = q->next;
  if (q != NULL && q->stream) {
    part *pt = malloc(sizeof(*pt));
    if (pt == NULL) { /* the reply cannot be followed: give up on c */
      td__close_fds(fds, nfds);
      tensord__response__free_unpacked(r, NULL);
      set_broken(c, TD_ENOMEM);
      return;
    }
    pt->resp = r;
    memcpy(pt->fds, fds, nfds * sizeof(int));
    pt->nfds = nfds;
    pt->next = NULL;
    *q->tail = pt;
    q->tail = &pt->next;
    q->nparts++;
    q->owner_waits = 0; /* woken by this frame, it is free to take it */
    /* An Error ends the reply as surely as its last frame. */
    q->done = r->body_case != TENSORD__RESPONSE__BODY_LOOKUP_MANY ||
              r->lookup_many->last;
  } else if (q != NULL) {
    q->resp = r;
    q->fd = nfds > 0 ? fds[0] : -1;
    if (nfds > 1)
      td__close_fds(fds + 1, nfds - 1);
    q->done = 1;
  } else if (r->seq == 0 && r->body_case == TENSORD__RESPONSE__BODY_ERROR) {
    /* About the connection itself (a protocol error, too many clients):
     * the daemon hangs up next, and every call fails with this. */
    c->why_code = r->error->code < 0 ? r->error->code : TD_EPROTO;
    snprintf(c->why, sizeof(c->why), "%s", r->error->message);
    tensord__response__free_unpacked(r, NULL);
    td__close_fds(fds, nfds);
  } else { /* nobody asked: drop it */
    tensord__response__free_unpacked(r, NULL);
    td__close_fds(fds, nfds);
  }
}

/* Whether another thread's streaming call has PARTS_MAX frames queued
 * while that thread is free to map them: then reading more would only pile
 * up fds. Locked. */
static int backlogged(td_client *c) {
  for (pending *q = c->pending; q != NULL; q = q->next)
    if (q->stream && q->nparts >= PARTS_MAX && !q->owner_waits &&
        !pthread_equal(q->owner, pthread_self()))
      return 1;
  return 0;
}

/* Marks (w 1) or unmarks the streaming calls of this thread as waiting
 * for another reader, waking the other waiters if that changes what they
 * may do. Locked. */
static void mark_waiting(td_client *c, int w) {
  for (pending *q = c->pending; q != NULL; q = q->next)
    if (q->stream && pthread_equal(q->owner, pthread_self())) {
      q->owner_waits = w;
      if (w && q->nparts >= PARTS_MAX)
        pthread_cond_broadcast(&c->cv);
    }
}

/* Makes progress for the calls waiting on c: reads one reply frame and
 * hands it out if no other thread is reading, else waits until the reader
 * has handed one out. A thread that would read waits instead while another
 * thread's streaming reply is backlogged (that thread wakes it as it takes
 * its frames); a thread waiting here never holds the others back with its
 * own, so two callers cannot wait for each other. Locked (the lock is
 * dropped while reading); on a connection error c is broken. */
static void pump(td_client *c) {
  if (c->reader || backlogged(c)) {
    mark_waiting(c, 1);
    pthread_cond_wait(&c->cv, &c->mu);
    mark_waiting(c, 0);
    return;
  }
  c->reader = 1;
  pthread_mutex_unlock(&c->mu);
  Tensord__Response *r = NULL;
  int fds[TD__FRAME_MAX_FDS];
  unsigned nfds = 0;
  int rerr = read_reply(c, &r, fds, &nfds);
  pthread_mutex_lock(&c->mu);
  c->reader = 0;
  if (rerr < 0)
    set_broken(c, c->why_code         ? c->why_code
                  : rerr == TD_EPROTO ? TD_EPROTO
                                      : TD_ECONNRESET);
  else
    deliver(c, r, fds, nfds);
  pthread_cond_broadcast(&c->cv); /* a reply, or the reader's role is free */
}

/* Takes p off c's calls and frees the parts nobody took. Locked. */
static void pending_unlink(td_client *c, pending *p) {
  pending **pp = &c->pending;
  while (*pp != p)
    pp = &(*pp)->next;
  *pp = p->next;
  while (p->head != NULL) {
    part *pt = p->head;
    p->head = pt->next;
    td__close_fds(pt->fds, pt->nfds);
    tensord__response__free_unpacked(pt->resp, NULL);
    free(pt);
  }
}

static const char *body_name(int body) {
  switch (body) {
  case TENSORD__REQUEST__BODY_HELLO:
    return "hello";
  case TENSORD__REQUEST__BODY_CREATE:
    return "create";
  case TENSORD__REQUEST__BODY_OPEN:
    return "open";
  case TENSORD__REQUEST__BODY_PUBLISH:
    return "publish";
  case TENSORD__REQUEST__BODY_LOOKUP:
    return "lookup";
  case TENSORD__REQUEST__BODY_UNPUBLISH:
    return "unpublish";
  case TENSORD__REQUEST__BODY_LIST:
    return "list";
  case TENSORD__REQUEST__BODY_STAT:
    return "stat";
  case TENSORD__REQUEST__BODY_INFO:
    return "info";
  case TENSORD__REQUEST__BODY_PING:
    return "ping";
  case TENSORD__REQUEST__BODY_WATCH:
    return "watch";
  case TENSORD__REQUEST__BODY_UPGRADE:
    return "upgrade";
  }
  return "request";
}

/* Sends req and waits for its reply. On success *resp is the reply (free it
 * with tensord__response__free_unpacked) and *fd the fd it carried, or -1.
 * An Error reply becomes its code, with the daemon's message kept for
 * td_last_error. */
static int call_held(td_client *c, Tensord__Request *req,
                     Tensord__Response **resp, int *fd) {
  pending p = {0};
  p.fd = -1;
  p.tail = &p.head;
  const char *op = body_name(req->body_case);
  char why[sizeof(c->why)] = "";
  int err = 0, closed = 0;
  pthread_mutex_lock(&c->mu);
  if (c->closed) {
    pthread_mutex_unlock(&c->mu);
    return fail(c, TD_ENOTCONN, "%s: client is closed", op);
  }
  if (c->broken) {
    err = c->err;
    goto broken;
  }
  req->seq = p.seq = ++c->next_seq;
  p.next = c->pending;
  c->pending = &p;
  pthread_mutex_unlock(&c->mu);
  err = send_request(c, req, 1);
  pthread_mutex_lock(&c->mu);
  while (err == 0 && !p.done && !c->broken)
    pump(c);
  pending_unlink(c, &p);
  if (p.done || err == TD_ENOMEM || err == TD_EMSGSIZE)
    goto unlock; /* a reply, or a request that never left */
  err = c->err;
broken:
  /* The reader may be about to read why the daemon hung up; the connection
   * is shut down, so it stops at the end of what is queued. */
  while (c->reader)
    pthread_cond_wait(&c->cv, &c->mu);
  if (!c->closed)
    read_why(c);
  if (c->why_code && !c->closed)
    err = c->why_code;
unlock:
  if (err < 0) { /* copied while locked: the reader may write why */
    snprintf(why, sizeof(why), "%s", c->why);
    closed = c->closed;
  }
  pthread_mutex_unlock(&c->mu);
  if (err < 0 && closed)
    return fail(c, err, "%s: client was closed (td_close) during the call", op);
  if (err < 0 && why[0] != '\0')
    return fail(c, err, "%s: tensord closed the connection: %s", op, why);
  if (err < 0 && (err == TD_ENOMEM || err == TD_EMSGSIZE))
    return fail(c, err, "%s: cannot queue a request of %zu bytes: %s", op,
                tensord__request__get_packed_size(req), td_strerror(err));
  if (err < 0)
    return fail(c, err, "%s: connection to tensord at %s lost (%s)", op,
                c->path, td_strerror(err));
  if (p.resp->body_case == TENSORD__RESPONSE__BODY_ERROR) {
    err = p.resp->error->code < 0 ? p.resp->error->code : TD_EPROTO;
    fail(c, err, "%s", p.resp->error->message);
    tensord__response__free_unpacked(p.resp, NULL);
    if (p.fd >= 0)
      close(p.fd);
    return err;
  }
  *resp = p.resp;
  if (fd != NULL)
    *fd = p.fd;
  else if (p.fd >= 0)
    close(p.fd);
  return 0;
}

/* call_held, with a reference on c for its duration: a td_close from
 * another thread wakes the call (with an error) but cannot free c under it.
 * In a forked child it touches nothing of c but its pid. The reply must
 * have the body `body`: on success it is *resp, the caller's to free, or
 * freed here when resp is NULL. On failure nothing is left to free. */
static int call(td_client *c, Tensord__Request *req, int body,
                Tensord__Response **resp, int *fd) {
  if (forked(c))
    return fail_forked(c, body_name(req->body_case));
  Tensord__Response *r;
  int rfd = -1;
  atomic_fetch_add(&c->refs, 1);
  int err = call_held(c, req, &r, fd != NULL ? &rfd : NULL);
  client_unref(c);
  if (err < 0)
    return err;
  if ((int)r->body_case != body) {
    int got = r->body_case;
    tensord__response__free_unpacked(r, NULL);
    if (rfd >= 0)
      close(rfd);
    return fail(c, TD_EPROTO, "tensord answered with body %d where %d was due",
                got, body);
  }
  if (fd != NULL)
    *fd = rfd;
  if (resp != NULL)
    *resp = r;
  else
    tensord__response__free_unpacked(r, NULL);
  return 0;
}

/* Parses $TENSORD_TRUST_UID (uids separated by commas) and says whether uid
 * is among them. Returns 1, 0, or TD_EINVAL for a malformed list, with the
 * reason recorded. */
static int trusted_by_env(uid_t uid) {
  const char *env = getenv("TENSORD_TRUST_UID");
  if (env == NULL)
    return 0;
  for (const char *p = env; *p != '\0';) {
    size_t n = strcspn(p, ",");
    char *end = (char *)p;
    unsigned long v = 0;
    errno = 0;
    if (p[0] >= '0' && p[0] <= '9')
      v = strtoul(p, &end, 10);
    if (n == 0 || end != p + n || errno != 0 || v != (uid_t)v)
      return fail(NULL, TD_EINVAL,
                  "TENSORD_TRUST_UID='%s': '%.*s' is not a uid (give "
                  "numeric uids separated by commas)",
                  env, (int)n, p);
    if ((uid_t)v == uid)
      return 1;
    p += n;
    if (*p == ',')
      p++;
  }
  return 0;
}

/* Checks who listens at path, before anything is sent to it: a daemon of
 * this process's (effective) uid, of root, or of a uid in
 * $TENSORD_TRUST_UID. Anyone else could have bound the socket first (a
 * squatted directory) and would hand us memory they control. Returns 0, or
 * TD_EACCES (or the getsockopt error) with the reason recorded. */
static int check_peer(int fd, const char *path) {
  struct ucred cr;
  socklen_t len = sizeof(cr);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0)
    return fail(NULL, -errno, "%s: cannot learn who listens there: %s", path,
                strerror(errno));
  uid_t me = geteuid();
  if (cr.uid == me || cr.uid == 0)
    return 0;
  int ok = trusted_by_env(cr.uid);
  if (ok != 0)
    return ok < 0 ? ok : 0;
  /* The uid a user namespace shows for one it does not map: a daemon
   * outside a rootless container, say. */
  unsigned overflow = 65534;
  FILE *f = fopen("/proc/sys/kernel/overflowuid", "re");
  if (f != NULL) {
    if (fscanf(f, "%u", &overflow) != 1)
      overflow = 65534;
    fclose(f);
  }
  return fail(NULL, TD_EACCES,
              "refusing the daemon at %s: it runs as uid %u (pid %d), and "
              "this process trusts only its own uid (%u), root and the uids "
              "in $TENSORD_TRUST_UID; if you trust uid %u, set "
              "TENSORD_TRUST_UID=%u%s",
              path, (unsigned)cr.uid, (int)cr.pid, (unsigned)me,
              (unsigned)cr.uid, (unsigned)cr.uid,
              cr.uid == overflow
                  ? " (this uid is the overflow uid: the daemon's uid has "
                    "no mapping in this process's user namespace; see "
                    "docs/containers.md)"
                  : "");
}

/* Explains a connect() to path that failed with EACCES: writes to buf the
 * first directory on the path, from the root down, that this process may
 * not search, with its mode and owner, or else the socket's own mode and
 * owners (connecting needs its write bit); "" if neither stat works. */
static void why_denied(const char *path, char *buf, size_t len) {
  char at[108];
  struct stat st;
  buf[0] = '\0';
  size_t n = strlen(path);
  for (size_t i = 0; i < n; i++) {
    if (path[i] != '/')
      continue;
    snprintf(at, sizeof(at), "%.*s", i == 0 ? 1 : (int)i, path);
    if (faccessat(AT_FDCWD, at, X_OK, AT_EACCESS) == 0 || errno != EACCES)
      continue;
    if (stat(at, &st) == 0)
      snprintf(buf, len,
               " (directory %s is mode %04o, owner uid %u, group %u: this "
               "process, uid %u, may not enter it)",
               at, (unsigned)(st.st_mode & 07777), (unsigned)st.st_uid,
               (unsigned)st.st_gid, (unsigned)geteuid());
    return;
  }
  if (stat(path, &st) == 0)
    snprintf(buf, len,
             " (the socket is mode %04o, owner uid %u, group %u: this "
             "process, uid %u, may not write it)",
             (unsigned)(st.st_mode & 07777), (unsigned)st.st_uid,
             (unsigned)st.st_gid, (unsigned)geteuid());
}

int td_connect(const char *socket_path, td_client **out) {
  return td_connect_ex(socket_path, NULL, out);
}

int td_connect_ex(const char *socket_path, const td_connect_opts *o,
                  td_client **out) {
  char path[108];
  *out = NULL;
  if (o != NULL)
    for (size_t i = 0; i < sizeof(o->reserved) / sizeof(o->reserved[0]); i++)
      if (o->reserved[i] != 0)
        return fail(NULL, TD_EINVAL,
                    "connect with reserved[%zu] = 0x%llx: libtensord %s "
                    "knows no such option",
                    i, (unsigned long long)o->reserved[i], TD_VERSION_STRING);
  if (socket_path == NULL) {
    if (td_default_socket_path(path, sizeof(path)) < 0)
      return fail(NULL, TD_ENAMETOOLONG, "default socket path too long");
  } else if (snprintf(path, sizeof(path), "%s", socket_path) >=
             (int)sizeof(path)) {
    return fail(NULL, TD_ENAMETOOLONG,
                "socket path '%s' is longer than %zu "
                "bytes",
                socket_path, sizeof(path) - 1);
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return fail(NULL, -errno, "socket: %s", strerror(errno));
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  memcpy(sa.sun_path, path, sizeof(path));
  if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
    int e = errno;
    close(fd);
    char why[320] = "";
    if (e == EACCES)
      why_denied(path, why, sizeof(why));
    return fail(
        NULL, -e, "cannot connect to %s: %s%s%s", path, strerror(e),
        e == ENOENT || e == ECONNREFUSED ? " (is tensord running?)" : "", why);
  }
  int err = check_peer(fd, path);
  if (err < 0) {
    close(fd);
    return err;
  }
  td_client *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    close(fd);
    return fail(NULL, TD_ENOMEM, "out of memory");
  }
  td__htab_init(&c->held);
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->smu, NULL);
  pthread_cond_init(&c->cv, NULL);
  atomic_init(&c->refs, 1);
  td__wire_init(&c->wire, fd);
  c->pid = getpid();
  td__err_forget(c);
  memcpy(c->path, path, sizeof(path));

  td__client_name(o != NULL ? o->name : NULL, c->name, sizeof(c->name));
  Tensord__Hello h = TENSORD__HELLO__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  h.version = TD_PROTOCOL_VERSION;
  h.client_name = c->name;
  req.body_case = TENSORD__REQUEST__BODY_HELLO;
  req.hello = &h;
  Tensord__Response *r;
  err = call(c, &req, TENSORD__RESPONSE__BODY_HELLO, &r, NULL);
  if (err < 0) {
    char why[TD__ERRMSG_MAX];
    snprintf(why, sizeof(why), "%s", td_last_error(c));
    fail(NULL, err, "%s: %s", path, why);
    client_unref(c);
    return err;
  }
  c->instance = r->hello->instance;
  c->daemon_pid = r->hello->pid;
  if (c->instance != 0)
    td__cumap_client_join(c->instance);
  tensord__response__free_unpacked(r, NULL);
  *out = c;
  return 0;
}

void td_close(td_client *c) {
  if (c == NULL)
    return;
  if (forked(c)) {
    /* The child's copy of its parent's socket: closing it leaves the
     * parent's connection alone, where shutdown would end it. */
    if (c->wire.fd >= 0)
      close(c->wire.fd);
    c->wire.fd = -1;
    client_unref(c);
    return;
  }
  pthread_mutex_lock(&c->mu);
  c->closed = 1;
  set_broken(c, TD_ENOTCONN);
  /* The daemon sees end-of-stream now and drops every reference we held;
   * a thread blocked reading, or sending (mu is never held across a send),
   * wakes with an error. A connection broken earlier is shut already. */
  shutdown(c->wire.fd, SHUT_RDWR);
  pthread_mutex_unlock(&c->mu);
  client_unref(c);
}

/* ---- storages ---- */

/* Sends a release of count references (a message with no reply); with
 * flush 0 it may wait in the queue for the next request. */
static void send_release(td_client *c, uint64_t id, int ro, uint32_t count,
                         int flush) {
  Tensord__Release m = TENSORD__RELEASE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.id = id;
  m.readonly = ro;
  m.count = count;
  req.body_case = TENSORD__REQUEST__BODY_RELEASE;
  req.release = &m;
  pthread_mutex_lock(&c->mu);
  int broken = c->broken;
  pthread_mutex_unlock(&c->mu);
  if (broken)
    return;
  if (send_request(c, &req, flush) == TD_ENOMEM) {
    /* A release we cannot send would pin the storage: hang up instead, so
     * that the daemon drops everything this client held. */
    pthread_mutex_lock(&c->mu);
    set_broken(c, TD_ENOMEM);
    pthread_mutex_unlock(&c->mu);
  }
}

static int held_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, held, node)->key == *(const uint64_t *)key;
}

/* Counts one more handle. Locked. Returns 0 or TD_ENOMEM. */
static int held_add(td_client *c, uint64_t id, int ro) {
  uint64_t key = id << 1 | (uint64_t)(ro != 0);
  td__hnode *n = td__htab_find(&c->held, td__hash_u64(key), held_eq, &key);
  if (n != NULL) {
    td__container_of(n, held, node)->n++;
    return 0;
  }
  held *h = calloc(1, sizeof(*h));
  if (h == NULL)
    return TD_ENOMEM;
  h->key = key;
  h->n = 1;
  if (td__htab_insert(&c->held, &h->node, td__hash_u64(key)) < 0) {
    free(h);
    return TD_ENOMEM;
  }
  return 0;
}

/* Counts one handle less; returns how many remain. Locked. */
static uint32_t held_drop(td_client *c, uint64_t id, int ro) {
  uint64_t key = id << 1 | (uint64_t)(ro != 0);
  td__hnode *n = td__htab_find(&c->held, td__hash_u64(key), held_eq, &key);
  if (n == NULL)
    return 0;
  held *h = td__container_of(n, held, node);
  if (--h->n > 0)
    return h->n;
  td__htab_remove(&c->held, n);
  free(h);
  return 0;
}

/* Releases one handle's reference. While the connection holds another
 * handle on the same storage and mode, the daemon's count cannot reach zero
 * by this release, so it rides with the next request instead of costing a
 * message of its own (at most DEFER_MAX wait). The release of the
 * connection's last handle is sent at once: the storage may go, and the
 * daemon must know the process no longer has it mapped. */
static void release_handle(td_client *c, uint64_t id, int ro) {
  pthread_mutex_lock(&c->mu);
  uint32_t left = held_drop(c, id, ro);
  pthread_mutex_unlock(&c->mu);
  send_release(c, id, ro, 1, left == 0);
}

static int open_call(td_client *c, uint64_t id, int ro, int force_fd,
                     Tensord__Response **r, int *fd) {
  Tensord__Open m = TENSORD__OPEN__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.id = id;
  m.readonly = ro;
  m.force_fd = force_fd;
  req.body_case = TENSORD__REQUEST__BODY_OPEN;
  req.open = &m;
  return call(c, &req, TENSORD__RESPONSE__BODY_STORAGE, r, fd);
}

/* Makes a handle for the reference the daemon just gave us (m, with fd or
 * -1), mapped copy-on-write if cow (and m is read-only). On failure the
 * reference is released. */
static int make_handle(td_client *c, const Tensord__StorageReply *m, int fd,
                       unsigned flags, td_storage **out) {
  int cow = (flags & TD_COW) != 0, lazy = (flags & TD_LAZY) != 0;
  int cuda = m->device == TENSORD__DEVICE__DEVICE_CUDA;
  /* Device memory has no copy-on-write: TD_COW maps it read-only. */
  cow = cow && m->readonly && !cuda;
  int legacy =
      cuda && m->handle == TENSORD__CUDA_HANDLE__CUDA_HANDLE_LEGACY_IPC;
  if (cuda &&
      (m->device_uuid.len != 16 ||
       (m->handle != TENSORD__CUDA_HANDLE__CUDA_HANDLE_POSIX_FD && !legacy) ||
       (legacy && m->ipc_handle.len != 64))) {
    if (fd >= 0)
      close(fd);
    send_release(c, m->id, m->readonly, 1, 1);
    return fail(c, TD_ENOSYS,
                "storage %llu: a CUDA handle of kind %d, which this "
                "libtensord cannot map",
                (unsigned long long)m->id, (int)m->handle);
  }
  int mode = m->readonly ? (cow ? TD__MAP_COW : TD__MAP_RO) : TD__MAP_RW;
  td_storage *s = calloc(1, sizeof(*s));
  if (s == NULL) {
    if (fd >= 0)
      close(fd);
    send_release(c, m->id, m->readonly, 1, 1);
    return fail(c, TD_ENOMEM, "out of memory");
  }
  char why[512] = "";
  int err =
      cuda ? td__map_acquire_cuda(c->instance, m->id, mode, m->device_uuid.data,
                                  m->alloc_size, m->alloc_id, fd,
                                  legacy ? m->ipc_handle.data : NULL, &s->map,
                                  why, sizeof(why))
           : td__map_acquire(c->instance, m->id, mode, m->nbytes, fd, lazy,
                             &s->map);
  if (err == TD_ENOENT) {
    /* Our last mapping went with another thread's release after the daemon
     * saw our reference: ask for an fd with a second reference, then give
     * that one back. */
    Tensord__Response *r;
    int fd2 = -1;
    err = open_call(c, m->id, m->readonly, 1, &r, &fd2);
    if (err == 0) {
      err = cuda ? td__map_acquire_cuda(c->instance, m->id, mode,
                                        m->device_uuid.data, m->alloc_size,
                                        m->alloc_id, fd2, NULL, &s->map, why,
                                        sizeof(why))
                 : td__map_acquire(c->instance, m->id, mode, m->nbytes, fd2,
                                   lazy, &s->map);
      tensord__response__free_unpacked(r, NULL);
      send_release(c, m->id, m->readonly, 1, 1);
    }
  }
  if (err < 0) {
    free(s);
    send_release(c, m->id, m->readonly, 1, 1);
    if (err == TD_EFORKED) /* not the mapping's fault: the process's */
      return fail(c, err, "CUDA storage %llu: %s", (unsigned long long)m->id,
                  why);
    return fail(c, err, "storage %llu: cannot map %llu bytes: %s",
                (unsigned long long)m->id, (unsigned long long)m->nbytes,
                why[0] ? why : td_strerror(err));
  }
  if (cuda) {
    memcpy(s->uuid, m->device_uuid.data, 16);
    s->device_index = td__cumap_index(td__map_cumap(s->map));
  }
  s->c = c;
  atomic_init(&s->refs, 1);
  s->id = m->id;
  s->nbytes = (size_t)m->nbytes;
  s->device = (td_device)m->device;
  s->readonly = m->readonly;
  s->cow = cow;
  pthread_mutex_lock(&c->mu);
  err = held_add(c, m->id, m->readonly);
  pthread_mutex_unlock(&c->mu);
  if (err < 0) {
    td__map_release(s->map);
    free(s);
    send_release(c, m->id, m->readonly, 1, 1);
    return fail(c, err, "out of memory");
  }
  atomic_fetch_add(&c->refs, 1);
  *out = s;
  return 0;
}

int td_storage_create(td_client *c, size_t nbytes, td_storage **out) {
  td_create_opts o = {.nbytes = nbytes}; /* mode 0600, TD_CPU */
  return td_storage_create_ex(c, &o, out);
}

int td_storage_create_ex(td_client *c, const td_create_opts *o,
                         td_storage **out) {
  *out = NULL;
  if (o->nbytes == 0)
    return fail(c, TD_EINVAL,
                "create of 0 bytes: a storage needs at least one byte");
  if (o->mode & ~0666u)
    return fail(c, TD_EINVAL,
                "create with mode %04o: only read and write bits (0666) may "
                "be set",
                (unsigned)o->mode);
  if (o->device != TD_CPU && o->device != TD_CUDA)
    return fail(c, TD_EINVAL, "create on device %d: TD_CPU or TD_CUDA",
                (int)o->device);
  if (o->device == TD_CPU && o->device_index != 0)
    return fail(c, TD_EINVAL,
                "create on the CPU with device_index %lld: it must be 0",
                (long long)o->device_index);
  for (size_t i = 0; i < sizeof(o->reserved) / sizeof(o->reserved[0]); i++)
    if (o->reserved[i] != 0)
      return fail(c, TD_EINVAL,
                  "create with reserved[%zu] = 0x%llx: libtensord %s knows no "
                  "option there (zero-initialise td_create_opts)",
                  i, (unsigned long long)o->reserved[i], TD_VERSION_STRING);
  if (o->flags & ~(uint64_t)TD_UNINIT)
    return fail(c, TD_EINVAL,
                "create with flags 0x%llx: only TD_UNINIT (0x%x) is a create "
                "flag",
                (unsigned long long)o->flags, TD_UNINIT);
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.nbytes = o->nbytes;
  m.mode = o->mode;
  m.device = (Tensord__Device)o->device;
  uint8_t uuid[16];
  if (o->device == TD_CUDA) {
    char why[512];
    int e = td__cu_resolve(o->device_index, uuid, why, sizeof(why));
    if (e < 0)
      return fail(c, e, "create of %zu bytes on cuda:%lld: %s", o->nbytes,
                  (long long)o->device_index, why);
    m.device_uuid.data = uuid;
    m.device_uuid.len = 16;
  }
  m.uninitialized = (o->flags & TD_UNINIT) != 0;
  m.client_zeroes = !m.uninitialized;
  req.body_case = TENSORD__REQUEST__BODY_CREATE;
  req.create = &m;
  Tensord__Response *r;
  int fd = -1;
  int err = call(c, &req, TENSORD__RESPONSE__BODY_STORAGE, &r, &fd);
  if (err < 0)
    return err;
  int dirty = r->storage->dirty;
  err = make_handle(c, r->storage, fd, 0, out);
  tensord__response__free_unpacked(r, NULL);
  /* A recycled segment comes as its owner left it: zeroed here, through
   * this process's mapping, often still warm from the storage that had it
   * before (a memset of pages mapped already), before anyone sees it. */
  if (err == 0 && dirty) {
    td__cumap *cm = td__map_cumap((*out)->map);
    char why[256];
    if (cm == NULL) {
      memset(td_storage_data(*out), 0, td_storage_nbytes(*out));
    } else if ((err = td__cumap_zero(cm, td_storage_nbytes(*out), why,
                                     sizeof(why))) < 0) {
      td_storage_release(*out);
      *out = NULL;
      return fail(c, err, "create of %zu bytes on cuda:%lld: %s", o->nbytes,
                  (long long)o->device_index, why);
    }
  }
  return err;
}

int td_storage_open(td_client *c, uint64_t id, unsigned flags,
                    td_storage **out) {
  *out = NULL;
  if (flags & ~(TD_RDONLY | TD_COW | TD_LAZY))
    return fail(c, TD_EINVAL, "open: unknown flags 0x%x", flags);
  Tensord__Response *r;
  int fd = -1;
  int err = open_call(c, id, (flags & (TD_RDONLY | TD_COW)) != 0, 0, &r, &fd);
  if (err < 0)
    return err;
  err = make_handle(c, r->storage, fd, flags, out);
  tensord__response__free_unpacked(r, NULL);
  return err;
}

td_storage *td_storage_retain(td_storage *s) {
  atomic_fetch_add(&s->refs, 1);
  return s;
}

int td_storage_release(td_storage *s) {
  if (s == NULL)
    return 0;
  if (atomic_fetch_sub(&s->refs, 1) != 1)
    return 0;
  if (s->chan != NULL) {
    td_chan *ch = s->chan;
    uint32_t slot = s->slot;
    int child = forked(s->c);
    td__map_release(s->map);
    client_unref(s->c);
    free(s);
    /* A forked child's copy of a parent's slot is not its to give back. */
    td__chan_slot_done(ch, slot, !child);
    return 0;
  }
  if (forked(s->c)) {
    /* A handle from before fork(): its reference is the parent's, and so
     * is the mapping cache it counts in. Free the handle; the inherited
     * mapping stays until this process exits or execs. */
    client_unref(s->c);
    free(s);
    return 0;
  }
  td__map_release(s->map);
  release_handle(s->c, s->id, s->readonly);
  client_unref(s->c);
  free(s);
  return 0;
}

uint64_t td_storage_id(const td_storage *s) {
  return s->id;
}
size_t td_storage_nbytes(const td_storage *s) {
  return s->nbytes;
}
void *td_storage_data(const td_storage *s) {
  return td__map_addr(s->map);
}
td_device td_storage_device(const td_storage *s) {
  return s->device;
}
td__cumap *td__storage_cumap(const td_storage *s) {
  return s->device == TD_CUDA ? td__map_cumap(s->map) : NULL;
}
int td__storage_fd(td_storage *s, int *fd) {
  *fd = -1;
  if (s->device != TD_CPU)
    return fail(s->c, TD_EINVAL, "storage %llu is not in host memory",
                (unsigned long long)s->id);
  Tensord__Response *r;
  int err = open_call(s->c, s->id, s->readonly, 1, &r, fd);
  if (err < 0)
    return err;
  tensord__response__free_unpacked(r, NULL);
  /* s still holds its own reference: this release never frees it. */
  send_release(s->c, s->id, s->readonly, 1, 0);
  if (*fd < 0)
    return fail(s->c, TD_EPROTO, "storage %llu: the daemon sent no fd",
                (unsigned long long)s->id);
  return 0;
}
int td_storage_device_index(const td_storage *s) {
  return s->device == TD_CUDA ? s->device_index : 0;
}
int td_storage_device_uuid(const td_storage *s, uint8_t uuid[16]) {
  if (s->device != TD_CUDA)
    return fail(s->c, TD_EINVAL, "storage %llu is not on a GPU",
                (unsigned long long)s->id);
  memcpy(uuid, s->uuid, 16);
  return 0;
}
int td_storage_wait(td_storage *s, void *stream) {
  if (!s->has_event)
    return 0;
  char msg[512];
  int err = td__cuevent_wait(s->uuid, s->event, stream, msg, sizeof(msg));
  if (err < 0)
    return fail(s->c, err, "storage %llu: waiting on its publisher's event: %s",
                (unsigned long long)s->id, msg);
  return 0;
}
int td_storage_is_readonly(const td_storage *s) {
  return s->readonly;
}
/* ---- for chan.c ---- */

int td__call(td_client *c, Tensord__Request *req, int body,
             Tensord__Response **resp, int *fd) {
  return call(c, req, body, resp, fd);
}

int td__send_oneway(td_client *c, Tensord__Request *req) {
  if (forked(c))
    return fail_forked(c, body_name(req->body_case));
  pthread_mutex_lock(&c->mu);
  int bad = c->broken || c->closed;
  pthread_mutex_unlock(&c->mu);
  if (bad)
    return TD_ECONNRESET;
  req->seq = 0;
  return send_request(c, req, 1);
}

void td__client_ref(td_client *c) {
  atomic_fetch_add(&c->refs, 1);
}

void td__client_unref(td_client *c) {
  client_unref(c);
}

int td__client_forked(const td_client *c) {
  return forked(c);
}

uint64_t td__client_instance(const td_client *c) {
  return c->instance;
}

int td__storage_from_reply(td_client *c, const Tensord__StorageReply *m, int fd,
                           td_storage **out) {
  return make_handle(c, m, fd, 0, out);
}

int td__storage_slot(td_client *c, td_chan *ch, uint32_t slot, uint64_t id,
                     size_t nbytes, int ro, td_storage **out) {
  td_storage *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return fail(c, TD_ENOMEM, "out of memory");
  int err = td__map_acquire(c->instance, id, ro ? TD__MAP_RO : TD__MAP_RW,
                            nbytes, -1, 0, &s->map);
  if (err < 0) {
    free(s);
    return fail(c, err, "slot %u (storage %llu): not mapped by this end",
                (unsigned)slot, (unsigned long long)id);
  }
  s->c = c;
  atomic_init(&s->refs, 1);
  s->id = id;
  s->nbytes = nbytes;
  s->device = TD_CPU;
  s->readonly = ro;
  s->chan = ch;
  s->slot = slot;
  atomic_fetch_add(&c->refs, 1);
  *out = s;
  return 0;
}

td_chan *td__storage_chan(const td_storage *s, uint32_t *slot, int *refs) {
  if (slot != NULL)
    *slot = s->slot;
  if (refs != NULL)
    *refs = atomic_load(&((td_storage *)s)->refs);
  return s->chan;
}

void td__storage_forget(td_storage *s) {
  td__map_release(s->map);
  client_unref(s->c);
  free(s);
}

td_client *td_storage_client(const td_storage *s) {
  return s->c;
}

uint64_t td_client_instance(const td_client *c) {
  return c->instance;
}

const char *td_client_name(const td_client *c) {
  return c->name;
}

/* ---- keys ---- */

/* Checks key here, so that a bad one never reaches the wire. */
static int check_key(td_client *c, const char *op, const char *key,
                     size_t *len) {
  if (key == NULL)
    return fail(c, TD_EINVAL, "%s: key is NULL", op);
  size_t n = strnlen(key, TD_KEY_MAX + 1);
  *len = n;
  if (n == 0)
    return fail(c, TD_EINVAL, "%s: empty key", op);
  if (n > TD_KEY_MAX)
    return fail(c, TD_EINVAL, "%s: key of %zu bytes is longer than %d", op,
                strlen(key), TD_KEY_MAX);
  return 0;
}

int td_publish(td_client *c, const char *key, const td_storage *s,
               const td_view *v) {
  return td_publish_ex(c, key, s, v, NULL);
}

int td_publish_ex(td_client *c, const char *key, const td_storage *s,
                  const td_view *v, const td_publish_opts *o) {
  size_t len = 0;
  int err = check_key(c, "publish", key, &len);
  if (err < 0)
    return err;
  if (s == NULL)
    return fail(c, TD_EINVAL, "publish '%s': storage is NULL", key);
  if (s->c != c && s->c->instance != c->instance)
    return fail(c, TD_EINVAL,
                "publish '%s': storage %llu belongs to tensord instance "
                "%016llx, and this client's daemon is instance %016llx "
                "(storage ids are per daemon): copy it into a storage of "
                "this client's",
                key, (unsigned long long)s->id,
                (unsigned long long)s->c->instance,
                (unsigned long long)c->instance);
  if (s->c != c)
    return fail(c, TD_EINVAL,
                "publish '%s': storage %llu belongs to another "
                "client (td_storage_open it on this one)",
                key, (unsigned long long)s->id);
  if (s->readonly)
    return fail(c, TD_EACCES, "publish '%s': storage %llu is open read-only",
                key, (unsigned long long)s->id);
  if (o != NULL)
    for (size_t i = 0; i < sizeof(o->reserved) / sizeof(o->reserved[0]); i++)
      if (o->reserved[i] != 0)
        return fail(c, TD_EINVAL,
                    "publish '%s' with reserved[%zu] = 0x%llx: libtensord %s "
                    "knows no option there (zero-initialise td_publish_opts)",
                    key, i, (unsigned long long)o->reserved[i],
                    TD_VERSION_STRING);
  char msg[768];
  if (v != NULL &&
      (err = td__view_check_msg(v, s->nbytes, msg, sizeof(msg))) < 0)
    return fail(c, err, "publish '%s': %s", key, msg);
  uint8_t event[64];
  if (o != NULL && o->event != NULL) {
    if (s->device != TD_CUDA)
      return fail(c, TD_EINVAL,
                  "publish '%s' with an event: storage %llu is not on a GPU",
                  key, (unsigned long long)s->id);
    if ((err = td__cuevent_export(o->event, event, msg, sizeof(msg))) < 0)
      return fail(c, err, "publish '%s' with an event: %s", key, msg);
  }
  Tensord__Publish m = TENSORD__PUBLISH__INIT;
  if (o != NULL && o->event != NULL) {
    m.event_handle.data = event;
    m.event_handle.len = sizeof(event);
  }
  Tensord__View vm;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = len;
  m.id = s->id;
  m.scope = o != NULL ? o->scope : 0;
  if (v != NULL) {
    td__view_to_msg(v, &vm);
    m.view = &vm;
  }
  req.body_case = TENSORD__REQUEST__BODY_PUBLISH;
  req.publish = &m;
  return call(c, &req, TENSORD__RESPONSE__BODY_OK, NULL, NULL);
}

int td_lookup(td_client *c, const char *key, unsigned flags, int timeout_ms,
              td_storage **s, td_view *v) {
  *s = NULL;
  size_t len = 0;
  int err = check_key(c, "lookup", key, &len);
  if (err < 0)
    return err;
  if (flags & ~(TD_RDONLY | TD_TAKE | TD_COW | TD_LAZY))
    return fail(c, TD_EINVAL, "lookup '%s': unknown flags 0x%x", key, flags);
  if (timeout_ms < -1)
    return fail(c, TD_EINVAL,
                "lookup '%s': timeout of %d ms (use -1 to wait "
                "forever)",
                key, timeout_ms);
  Tensord__Lookup m = TENSORD__LOOKUP__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = len;
  m.readonly = (flags & (TD_RDONLY | TD_COW)) != 0;
  m.take = (flags & TD_TAKE) != 0;
  m.wait_ms = timeout_ms;
  req.body_case = TENSORD__REQUEST__BODY_LOOKUP;
  req.lookup = &m;
  Tensord__Response *r;
  int fd = -1;
  err = call(c, &req, TENSORD__RESPONSE__BODY_LOOKUP, &r, &fd);
  if (err < 0)
    return err;
  Tensord__LookupReply *lr = r->lookup;
  char msg[128];
  td_view view;
  if (lr->storage == NULL || lr->view == NULL ||
      td__view_from_msg(lr->view, &view, msg, sizeof(msg)) < 0) {
    if (fd >= 0)
      close(fd);
    if (lr->storage != NULL)
      send_release(c, lr->storage->id, lr->storage->readonly, 1, 1);
    tensord__response__free_unpacked(r, NULL);
    return fail(c, TD_EPROTO, "lookup '%s': malformed reply", key);
  }
  err = make_handle(c, lr->storage, fd, flags, s);
  if (err == 0 && (*s)->device == TD_CUDA && lr->event_handle.len == 64) {
    (*s)->has_event = 1;
    memcpy((*s)->event, lr->event_handle.data, 64);
  }
  tensord__response__free_unpacked(r, NULL);
  if (err == 0 && v != NULL)
    *v = view;
  return err;
}

/* ---- many keys in one round trip ---- */

/* Keys' bytes in one LookupMany request at most: with their framing, a
 * request stays well under the frame limit (a bigger batch is split). */
#define MANY_REQ_BYTES (768u * 1024)

/* Starts a call whose reply comes in several frames: registers p (filled
 * here) and sends req. Returns 0, or a negative code with the reason
 * recorded (p is then unregistered). */
static int stream_begin(td_client *c, Tensord__Request *req, pending *p,
                        const char *op) {
  memset(p, 0, sizeof(*p));
  p->fd = -1;
  p->stream = 1;
  p->tail = &p->head;
  p->owner = pthread_self();
  pthread_mutex_lock(&c->mu);
  if (c->closed || c->broken) {
    int err = c->closed ? TD_ENOTCONN : c->why_code ? c->why_code : c->err;
    pthread_mutex_unlock(&c->mu);
    return fail(c, err, "%s: %s", op,
                err == TD_ENOTCONN ? "client is closed"
                                   : "the connection to tensord failed");
  }
  req->seq = p->seq = ++c->next_seq;
  p->next = c->pending;
  c->pending = p;
  pthread_mutex_unlock(&c->mu);
  int err = send_request(c, req, 1);
  if (err == 0)
    return 0;
  pthread_mutex_lock(&c->mu);
  pending_unlink(c, p);
  pthread_mutex_unlock(&c->mu);
  return fail(c, err, "%s: cannot send a request of %zu bytes: %s", op,
              tensord__request__get_packed_size(req), td_strerror(err));
}

/* The next frame of p's reply: 1 with *out (the caller frees it and owns
 * its fds), 0 after the last, or the connection's error with the reason
 * recorded. */
static int stream_next(td_client *c, pending *p, part **out, const char *op) {
  pthread_mutex_lock(&c->mu);
  while (p->head == NULL && !p->done && !c->broken)
    pump(c);
  part *pt = p->head;
  if (pt != NULL) {
    p->head = pt->next;
    if (p->head == NULL)
      p->tail = &p->head;
    if (p->nparts-- == PARTS_MAX) /* readers waiting on us may go on */
      pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    *out = pt;
    return 1;
  }
  int err = p->done ? 0 : c->why_code ? c->why_code : c->err;
  int closed = c->closed;
  pthread_mutex_unlock(&c->mu);
  if (err == 0)
    return 0;
  if (closed)
    return fail(c, err, "%s: client was closed (td_close) during the call", op);
  return fail(c, err, "%s: connection to tensord at %s lost (%s)", op, c->path,
              td_strerror(err));
}

/* Ends p's call, closing the fds of frames it did not take (and of any
 * still to come) and waking the readers its queue held back. */
static void stream_end(td_client *c, pending *p) {
  pthread_mutex_lock(&c->mu);
  pending_unlink(c, p);
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void part_free(part *pt) {
  td__close_fds(pt->fds, pt->nfds);
  tensord__response__free_unpacked(pt->resp, NULL);
  free(pt);
}

/* Where td_lookup_many keeps each key's outcome until it returns. */
typedef struct many_ctx {
  td_client *c;
  const char *const *keys;
  unsigned flags;
  td_storage **out;
  td_view *views;
  int *errs;
  int first_err; /* the first failing key's code, its index and why */
  size_t first_i;
  char first_msg[512];
} many_ctx;

static void many_fail(many_ctx *x, size_t i, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void many_fail(many_ctx *x, size_t i, int code, const char *fmt, ...) {
  x->errs[i] = code;
  if (x->first_err != 0 && x->first_i < i)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(x->first_msg, sizeof(x->first_msg), fmt, ap);
  va_end(ap);
  x->first_err = code;
  x->first_i = i;
}

/* Makes the handles of one reply frame's items, for keys [lo, hi) of this
 * request; *next is the index the frame must begin at, moved past it.
 * Consumes the frame's fds. Returns 0, or TD_EPROTO for a frame that does
 * not follow (its keys are failed by the caller). */
static int many_part(many_ctx *x, part *pt, size_t lo, size_t hi,
                     size_t *next) {
  td_client *c = x->c;
  const Tensord__LookupManyReply *rm = pt->resp->lookup_many;
  if (rm == NULL || lo + rm->first != *next || rm->n_items > hi - *next)
    return TD_EPROTO;
  unsigned fdi = 0;
  for (size_t j = 0; j < rm->n_items; j++) {
    size_t i = (*next)++;
    const Tensord__LookupManyItem *it = rm->items[j];
    const Tensord__LookupReply *lr = it->lookup;
    const char *key = x->keys[i];
    if (it->code != 0 && strnlen(key, TD_KEY_MAX + 1) > TD_KEY_MAX) {
      /* Sent cut short (see many_request): say how long it really is. */
      many_fail(x, i, TD_EINVAL,
                "key of %zu bytes (keys[%zu]) is longer than %d", strlen(key),
                i, TD_KEY_MAX);
      continue;
    }
    if (it->code != 0) {
      many_fail(x, i, it->code < 0 ? it->code : TD_EPROTO, "%s", it->message);
      continue;
    }
    char msg[128];
    td_view view;
    int fd = -1;
    if (lr != NULL && lr->storage != NULL && lr->storage->fd) {
      if (fdi == pt->nfds) { /* promised an fd it did not send */
        send_release(c, lr->storage->id, lr->storage->readonly, 1, 1);
        many_fail(x, i, TD_EPROTO, "key '%s': malformed reply", key);
        continue;
      }
      fd = pt->fds[fdi];
      pt->fds[fdi++] = -1;
    }
    if (lr == NULL || lr->storage == NULL || lr->view == NULL ||
        td__view_from_msg(lr->view, &view, msg, sizeof(msg)) < 0) {
      if (fd >= 0)
        close(fd);
      if (lr != NULL && lr->storage != NULL)
        send_release(c, lr->storage->id, lr->storage->readonly, 1, 1);
      many_fail(x, i, TD_EPROTO, "key '%s': malformed reply", key);
      continue;
    }
    int err = make_handle(c, lr->storage, fd, x->flags, &x->out[i]);
    if (err < 0) {
      many_fail(x, i, err, "key '%s': %s", key, td_last_error(c));
      continue;
    }
    td_storage *s = x->out[i];
    if (s->device == TD_CUDA && lr->event_handle.len == 64) {
      s->has_event = 1;
      memcpy(s->event, lr->event_handle.data, 64);
    }
    if (x->views != NULL)
      x->views[i] = view;
  }
  return 0;
}

/* Looks up keys [lo, hi) in one LookupMany request. Keys it cannot answer
 * (the connection failed, the daemon refused the request) fail with that
 * code. */
static void many_request(many_ctx *x, size_t lo, size_t hi) {
  td_client *c = x->c;
  size_t n = hi - lo;
  ProtobufCBinaryData *kb = malloc(n * sizeof(*kb));
  if (kb == NULL) {
    for (size_t i = lo; i < hi; i++)
      many_fail(x, i, TD_ENOMEM, "lookup_many: out of memory");
    return;
  }
  /* A key longer than TD_KEY_MAX goes cut to TD_KEY_MAX + 1 bytes: the
   * daemon fails it alone, where the whole key might not fit a frame. */
  for (size_t i = 0; i < n; i++) {
    kb[i].data = (uint8_t *)x->keys[lo + i];
    kb[i].len = strnlen(x->keys[lo + i], TD_KEY_MAX + 1);
  }
  Tensord__LookupMany m = TENSORD__LOOKUP_MANY__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.n_keys = n;
  m.keys = kb;
  m.readonly = (x->flags & (TD_RDONLY | TD_COW)) != 0;
  req.body_case = TENSORD__REQUEST__BODY_LOOKUP_MANY;
  req.lookup_many = &m;
  pending p;
  size_t next = lo;
  int err = stream_begin(c, &req, &p, "lookup_many");
  free(kb);
  if (err < 0)
    goto fail_rest;
  part *pt = NULL;
  while ((err = stream_next(c, &p, &pt, "lookup_many")) == 1) {
    Tensord__Response *r = pt->resp;
    if (r->body_case == TENSORD__RESPONSE__BODY_ERROR) {
      err = r->error->code < 0 ? r->error->code : TD_EPROTO;
      fail(c, err, "%s", r->error->message);
    } else if (r->body_case != TENSORD__RESPONSE__BODY_LOOKUP_MANY ||
               many_part(x, pt, lo, hi, &next) < 0) {
      err = fail(c, TD_EPROTO,
                 "lookup_many: tensord answered key %zu of %zu out of turn",
                 next - lo, n);
    }
    part_free(pt);
    if (err < 0)
      break;
  }
  stream_end(c, &p);
  if (err == 0 && next < hi)
    err =
        fail(c, TD_EPROTO, "lookup_many: the reply ended after %zu of %zu keys",
             next - lo, n);
fail_rest:
  if (err < 0) {
    char why[384];
    snprintf(why, sizeof(why), "%s", td_last_error(c));
    for (size_t i = next; i < hi; i++)
      many_fail(x, i, err, "key '%s': %s", x->keys[i], why);
  }
}

static int64_t mono_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int td_lookup_many(td_client *c, const char *const *keys, size_t n,
                   unsigned flags, int timeout_ms, td_storage **out,
                   td_view *views, int *errs) {
  int err = 0;
  if (out != NULL)
    for (size_t i = 0; i < n && i <= TD_LOOKUP_MANY_MAX; i++)
      out[i] = NULL;
  if (n == 0)
    return 0;
  if (out == NULL || keys == NULL)
    err = fail(c, TD_EINVAL, "lookup_many: %s is NULL",
               out == NULL ? "out" : "keys");
  else if (n > TD_LOOKUP_MANY_MAX)
    err = fail(c, TD_EINVAL,
               "lookup_many of %zu keys: at most %d (TD_LOOKUP_MANY_MAX) in "
               "one call",
               n, TD_LOOKUP_MANY_MAX);
  else if (flags & ~(TD_RDONLY | TD_COW | TD_LAZY))
    err = fail(c, TD_EINVAL,
               "lookup_many: flags 0x%x (TD_RDONLY, TD_COW and TD_LAZY only; "
               "take keys one by one with td_lookup)",
               flags);
  else if (timeout_ms < -1)
    err = fail(c, TD_EINVAL,
               "lookup_many: timeout of %d ms (use -1 to wait forever)",
               timeout_ms);
  for (size_t i = 0; err == 0 && i < n; i++)
    if (keys[i] == NULL)
      err = fail(c, TD_EINVAL, "lookup_many: keys[%zu] is NULL", i);
  if (err == 0 && forked(c))
    err = fail_forked(c, "lookup_many");
  if (err < 0) {
    if (errs != NULL)
      for (size_t i = 0; i < n && i <= TD_LOOKUP_MANY_MAX; i++)
        errs[i] = err;
    return err;
  }

  int64_t start = mono_ms();
  many_ctx x = {.c = c,
                .keys = keys,
                .flags = flags,
                .out = out,
                .views = views,
                .errs = errs};
  if (errs == NULL && (x.errs = malloc(n * sizeof(int))) == NULL)
    return fail(c, TD_ENOMEM, "lookup_many: out of memory");
  memset(x.errs, 0, n * sizeof(int));
  atomic_fetch_add(&c->refs, 1);
  /* One request, unless the keys are too many bytes for one frame. */
  for (size_t lo = 0, hi; lo < n; lo = hi) {
    size_t bytes = 0;
    for (hi = lo; hi < n; hi++) {
      size_t len = strnlen(keys[hi], TD_KEY_MAX + 1) + 4;
      if (hi > lo && bytes + len > MANY_REQ_BYTES)
        break;
      bytes += len;
    }
    many_request(&x, lo, hi);
  }
  /* Keys not published yet: wait for each in turn, within one deadline. */
  for (size_t i = 0; timeout_ms != 0 && i < n; i++) {
    if (x.errs[i] != TD_ENOENT)
      continue;
    int64_t left = timeout_ms < 0 ? -1 : start + timeout_ms - mono_ms();
    if (timeout_ms > 0 && left <= 0) {
      many_fail(&x, i, TD_ETIMEDOUT, "key '%s': not published (waited %d ms)",
                keys[i], timeout_ms);
      continue;
    }
    int e = td_lookup(c, keys[i], flags, (int)left, &out[i],
                      views != NULL ? &views[i] : NULL);
    x.errs[i] = e;
    if (e < 0)
      many_fail(&x, i, e, "%s", td_last_error(c));
    else if (x.first_err != 0 && x.first_i == i)
      x.first_err = 0; /* found after all: the first failure is later */
  }
  if (x.first_err == 0) { /* waits may have cleared it: look again */
    for (size_t i = 0; i < n; i++)
      if (x.errs[i] < 0) {
        x.first_err = x.errs[i];
        x.first_i = i;
        snprintf(x.first_msg, sizeof(x.first_msg), "key '%s': %s", keys[i],
                 td_strerror(x.errs[i]));
        break;
      }
  }
  client_unref(c);
  if (x.first_err == 0) {
    if (errs == NULL)
      free(x.errs);
    return 0;
  }
  size_t nfailed = 0;
  for (size_t i = 0; i < n; i++)
    nfailed += x.errs[i] < 0;
  if (errs == NULL) { /* all or nothing */
    for (size_t i = 0; i < n; i++) {
      td_storage_release(out[i]);
      out[i] = NULL;
    }
    free(x.errs);
  }
  return fail(c, x.first_err, "lookup_many: %s (%zu of %zu keys failed%s)",
              x.first_msg, nfailed, n, errs == NULL ? "; none was kept" : "");
}

int td_unpublish(td_client *c, const char *key) {
  size_t len = 0;
  int err = check_key(c, "unpublish", key, &len);
  if (err < 0)
    return err;
  Tensord__Unpublish m = TENSORD__UNPUBLISH__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = len;
  req.body_case = TENSORD__REQUEST__BODY_UNPUBLISH;
  req.unpublish = &m;
  return call(c, &req, TENSORD__RESPONSE__BODY_OK, NULL, NULL);
}

static int scope_call(td_client *c, int close, uint64_t token,
                      Tensord__Response **r) {
  Tensord__Scope m = TENSORD__SCOPE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.close = close;
  m.token = token;
  req.body_case = TENSORD__REQUEST__BODY_SCOPE;
  req.scope = &m;
  return call(c, &req, TENSORD__RESPONSE__BODY_SCOPE, r, NULL);
}

int td_scope_open(td_client *c, uint64_t *token) {
  if (token == NULL)
    return fail(c, TD_EINVAL, "scope_open: token is NULL");
  Tensord__Response *r;
  int err = scope_call(c, 0, 0, &r);
  if (err < 0)
    return err;
  *token = r->scope->token;
  tensord__response__free_unpacked(r, NULL);
  return 0;
}

int td_scope_close(td_client *c, uint64_t token, uint64_t *dropped) {
  Tensord__Response *r;
  int err = scope_call(c, 1, token, &r);
  if (err < 0)
    return err;
  if (dropped != NULL)
    *dropped = r->scope->dropped;
  tensord__response__free_unpacked(r, NULL);
  return 0;
}

int td_ping(td_client *c, uint64_t *rtt_ns) {
  struct timespec t0, t1;
  Tensord__Ping m = TENSORD__PING__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.body_case = TENSORD__REQUEST__BODY_PING;
  req.ping = &m;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int err = call(c, &req, TENSORD__RESPONSE__BODY_PONG, NULL, NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (err == 0 && rtt_ns != NULL)
    *rtt_ns = (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000u +
              (uint64_t)(t1.tv_nsec - t0.tv_nsec);
  return err;
}

int td_upgrade(td_client *c, const char *binary, td_upgrade_info *out) {
  Tensord__Upgrade m = TENSORD__UPGRADE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.spawn = 1;
  m.binary = (char *)(binary ? binary : "");
  req.body_case = TENSORD__REQUEST__BODY_UPGRADE;
  req.upgrade = &m;
  Tensord__Response *r;
  int fd = -1;
  int err = call(c, &req, TENSORD__RESPONSE__BODY_UPGRADE, &r, &fd);
  if (err < 0)
    return err;
  if (fd >= 0)
    close(fd);
  if (out != NULL) {
    memset(out, 0, sizeof(*out));
    out->old_pid = r->upgrade->old_pid;
    out->new_pid = r->upgrade->new_pid;
    snprintf(out->old_version, sizeof(out->old_version), "%s",
             r->upgrade->old_version);
    snprintf(out->new_version, sizeof(out->new_version), "%s",
             r->upgrade->new_version);
  }
  tensord__response__free_unpacked(r, NULL);
  return 0;
}

/* ---- introspection ---- */

/* Converts m into a td_storage_info whose arrays live in one allocation
 * (*mem, freed by the caller). */
static int info_from_msg(const Tensord__StorageInfo *m, td_storage_info *out,
                         void **mem) {
  /* Key pointers, then holders, then key bytes and holders' names: each
   * part aligned. */
  size_t size = m->n_keys * sizeof(char *) + m->n_holders * sizeof(td_holder);
  for (size_t i = 0; i < m->n_keys; i++)
    size += m->keys[i].len + 1;
  for (size_t i = 0; i < m->n_holders; i++)
    size += strlen(m->holders[i]->name) + 1;
  char *p = malloc(size ? size : 1);
  if (p == NULL)
    return TD_ENOMEM;
  *mem = p;
  const char **ks = (const char **)p;
  p += m->n_keys * sizeof(char *);
  td_holder *hs = (td_holder *)p;
  p += m->n_holders * sizeof(td_holder);
  for (size_t i = 0; i < m->n_holders; i++) {
    memset(&hs[i], 0, sizeof(hs[i]));
    hs[i].pid = m->holders[i]->pid;
    hs[i].uid = m->holders[i]->uid;
    hs[i].refs = m->holders[i]->refs;
  }
  for (size_t i = 0; i < m->n_keys; i++) {
    memcpy(p, m->keys[i].data, m->keys[i].len);
    p[m->keys[i].len] = '\0';
    ks[i] = p;
    p += m->keys[i].len + 1;
  }
  for (size_t i = 0; i < m->n_holders; i++) {
    size_t n = strlen(m->holders[i]->name) + 1;
    memcpy(p, m->holders[i]->name, n);
    hs[i].name = p;
    p += n;
  }
  memset(out, 0, sizeof(*out));
  out->id = m->id;
  out->nbytes = m->nbytes;
  out->device = (td_device)m->device;
  out->refs = m->refs;
  out->owner_pid = m->owner_pid;
  out->owner_uid = m->owner_uid;
  out->owner_gid = m->owner_gid;
  out->mode = m->mode;
  out->created_unix_ms = m->created_unix_ms;
  out->nholders = m->n_holders;
  out->holders = hs;
  out->nkeys = m->n_keys;
  out->nkeys_total = m->nkeys > m->n_keys ? m->nkeys : m->n_keys;
  out->keys = ks;
  if (m->device_uuid.len == 16)
    memcpy(out->device_uuid, m->device_uuid.data, 16);
  out->device_mig = m->device_mig;
  return 0;
}

int td_list(td_client *c, td_list_cb cb, void *arg) {
  uint64_t after = 0;
  for (;;) {
    Tensord__List m = TENSORD__LIST__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    m.after_id = after;
    req.body_case = TENSORD__REQUEST__BODY_LIST;
    req.list = &m;
    Tensord__Response *r;
    int err = call(c, &req, TENSORD__RESPONSE__BODY_LIST, &r, NULL);
    if (err < 0)
      return err;
    Tensord__ListReply *lr = r->list;
    int ret = 0;
    for (size_t i = 0; i < lr->n_storages && ret == 0; i++) {
      td_storage_info info;
      void *mem;
      if (info_from_msg(lr->storages[i], &info, &mem) < 0) {
        ret = fail(c, TD_ENOMEM, "list: out of memory");
        break;
      }
      ret = cb(&info, arg);
      free(mem);
    }
    int more = lr->more && lr->n_storages > 0;
    after = lr->next_after_id;
    tensord__response__free_unpacked(r, NULL);
    if (ret != 0 || !more)
      return ret;
  }
}

/* Asks for a StatReply; *r is the caller's to free. */
static int stat_call(td_client *c, Tensord__Response **r) {
  Tensord__Stat m = TENSORD__STAT__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.body_case = TENSORD__REQUEST__BODY_STAT;
  req.stat = &m;
  return call(c, &req, TENSORD__RESPONSE__BODY_STAT, r, NULL);
}

int td__client_watch(td_client *c, const char *prefix, size_t len,
                     td__wire **wire, uint64_t *seq) {
  Tensord__Watch m = TENSORD__WATCH__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.prefix.data = (uint8_t *)prefix;
  m.prefix.len = len;
  req.body_case = TENSORD__REQUEST__BODY_WATCH;
  req.watch = &m;
  int err = call(c, &req, TENSORD__RESPONSE__BODY_OK, NULL, NULL);
  if (err < 0)
    return err;
  *wire = &c->wire;
  *seq = req.seq;
  return 0;
}

int td_stat_get(td_client *c, td_stat *out) {
  Tensord__Response *r;
  int err = stat_call(c, &r);
  if (err < 0)
    return err;
  const Tensord__StatReply *st = r->stat;
  memset(out, 0, sizeof(*out));
  out->storages = st->storages;
  out->bytes_used = st->bytes_used;
  out->capacity = st->capacity;
  out->shm_free = st->shm_free;
  out->clients = st->clients;
  out->keys = st->keys;
  out->waiters = st->waiters;
  out->uptime_ms = st->uptime_ms;
  out->pid = st->pid;
  out->instance = st->instance;
  out->quota = st->quota;
  out->pool_segments = st->pool_segments;
  out->pool_bytes = st->pool_bytes;
  out->pool_limit = st->pool_limit;
  out->pool_hits = st->pool_hits;
  out->pool_misses = st->pool_misses;
  out->daemon_rss_bytes = st->daemon_rss_bytes;
  out->daemon_heap_bytes = st->daemon_heap_bytes;
  out->max_clients = st->max_clients;
  out->max_storages_per_client = st->max_storages_per_client;
  snprintf(out->state_dir, sizeof(out->state_dir), "%s", st->state_dir);
  snprintf(out->version, sizeof(out->version), "%s", st->version);
  snprintf(out->socket, sizeof(out->socket), "%s", st->socket);
  tensord__response__free_unpacked(r, NULL);
  return 0;
}

int td_stat_devices(td_client *c, td_device_stat *out, size_t max, size_t *n) {
  *n = 0;
  Tensord__Response *r;
  int err = stat_call(c, &r);
  if (err < 0)
    return err;
  const Tensord__StatReply *st = r->stat;
  for (size_t i = 0; i < st->n_devices && i < max; i++) {
    const Tensord__DeviceStat *d = st->devices[i];
    memset(&out[i], 0, sizeof(out[i]));
    out[i].device = (td_device)d->device;
    out[i].index = d->index;
    if (d->uuid.len == 16)
      memcpy(out[i].uuid, d->uuid.data, 16);
    out[i].bytes_used = d->bytes_used;
    out[i].capacity = d->capacity;
    out[i].storages = d->storages;
    out[i].mig = d->mig;
    out[i].pool_bytes = d->pool_bytes;
    out[i].pool_allocs = d->pool_allocs;
  }
  *n = st->n_devices;
  tensord__response__free_unpacked(r, NULL);
  return 0;
}

int td_stat_prefixes(td_client *c, char (*out)[TD_PREFIX_MAX], size_t max,
                     size_t *n) {
  *n = 0;
  Tensord__Response *r;
  int err = stat_call(c, &r);
  if (err < 0)
    return err;
  const Tensord__StatReply *st = r->stat;
  for (size_t i = 0; i < st->n_prefixes && i < max; i++)
    snprintf(out[i], TD_PREFIX_MAX, "%s", st->prefixes[i]);
  *n = st->n_prefixes;
  tensord__response__free_unpacked(r, NULL);
  return 0;
}

/* A td_metrics and the memory its largest[] entries point into. */
typedef struct metrics_mem {
  td_metrics m;
  void **infos; /* one allocation per largest[] entry (info_from_msg) */
} metrics_mem;

void td_metrics_free(td_metrics *m) {
  if (m == NULL)
    return;
  metrics_mem *mm = (metrics_mem *)m;
  for (size_t i = 0; i < m->nlargest; i++)
    free(mm->infos[i]);
  free(mm->infos);
  free(m->largest);
  free(m->clients);
  free(m->text);
  free(mm);
}

int td_metrics_get(td_client *c, unsigned largest, unsigned flags,
                   td_metrics **out) {
  *out = NULL;
  if (flags & ~TD_METRICS_NO_TEXT)
    return fail(c, TD_EINVAL, "metrics: unknown flags 0x%x",
                flags & ~TD_METRICS_NO_TEXT);
  if (largest > 64)
    return fail(c, TD_EINVAL, "metrics: %u largest storages asked, 64 at most",
                largest);
  Tensord__Metrics m = TENSORD__METRICS__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.largest = largest;
  m.no_text = (flags & TD_METRICS_NO_TEXT) != 0;
  req.body_case = TENSORD__REQUEST__BODY_METRICS;
  req.metrics = &m;
  Tensord__Response *r;
  int err = call(c, &req, TENSORD__RESPONSE__BODY_METRICS, &r, NULL);
  if (err < 0)
    return err;
  const Tensord__MetricsReply *mr = r->metrics;
  metrics_mem *mm = calloc(1, sizeof(*mm));
  const char *text = mr->text ? mr->text : "";
  size_t tlen = strlen(text);
  if (mm == NULL)
    goto nomem;
  td_metrics *o = &mm->m;
  o->text = malloc(tlen + 1);
  o->clients = calloc(mr->n_clients ? mr->n_clients : 1, sizeof(*o->clients));
  o->largest = calloc(mr->n_largest ? mr->n_largest : 1, sizeof(*o->largest));
  mm->infos = calloc(mr->n_largest ? mr->n_largest : 1, sizeof(void *));
  if (o->text == NULL || o->clients == NULL || o->largest == NULL ||
      mm->infos == NULL)
    goto nomem;
  memcpy(o->text, text, tlen + 1);
  o->text_len = tlen;
  o->requests = mr->requests;
  o->uptime_ms = mr->uptime_ms;
  o->storages = mr->storages;
  o->bytes_used = mr->bytes_used;
  o->capacity = mr->capacity;
  o->clients_total = mr->nclients;
  for (size_t i = 0; i < mr->n_clients; i++) {
    const Tensord__ClientStat *cs = mr->clients[i];
    td_client_stat *d = &o->clients[i];
    d->pid = cs->pid;
    d->uid = cs->uid;
    snprintf(d->name, sizeof(d->name), "%s", cs->name ? cs->name : "");
    d->requests = cs->requests;
    d->refs = cs->refs;
    d->bytes_held = cs->bytes_held;
  }
  o->nclients = mr->n_clients;
  for (size_t i = 0; i < mr->n_largest; i++) {
    if (info_from_msg(mr->largest[i], &o->largest[i], &mm->infos[i]) < 0)
      goto nomem;
    o->nlargest = i + 1;
  }
  tensord__response__free_unpacked(r, NULL);
  *out = o;
  return 0;
nomem:
  td_metrics_free(mm ? &mm->m : NULL);
  tensord__response__free_unpacked(r, NULL);
  return fail(c, TD_ENOMEM, "metrics: out of memory");
}

int td_info(td_client *c, uint64_t id, const char *key, td_list_cb scb,
            td_key_cb kcb, void *arg) {
  Tensord__Info m = TENSORD__INFO__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  size_t len = 0;
  if ((key == NULL) == (id == 0))
    return fail(c, TD_EINVAL,
                "info: give exactly one of a storage id and a "
                "key");
  if (key != NULL) {
    int err = check_key(c, "info", key, &len);
    if (err < 0)
      return err;
    m.which_case = TENSORD__INFO__WHICH_KEY;
    m.key.data = (uint8_t *)key;
    m.key.len = len;
  } else {
    m.which_case = TENSORD__INFO__WHICH_ID;
    m.id = id;
  }
  req.body_case = TENSORD__REQUEST__BODY_INFO;
  req.info = &m;
  Tensord__Response *r;
  int err = call(c, &req, TENSORD__RESPONSE__BODY_INFO, &r, NULL);
  if (err < 0)
    return err;
  const Tensord__InfoReply *ir = r->info;
  int ret = 0;
  if (ir->storage != NULL && scb != NULL) {
    td_storage_info info;
    void *mem;
    if (info_from_msg(ir->storage, &info, &mem) < 0) {
      ret = fail(c, TD_ENOMEM, "info: out of memory");
    } else {
      ret = scb(&info, arg);
      free(mem);
    }
  }
  for (size_t i = 0; i < ir->n_keys && ret == 0 && kcb != NULL; i++) {
    const Tensord__KeyInfo *k = ir->keys[i];
    char name[TD_KEY_MAX + 1];
    size_t n = k->key.len < TD_KEY_MAX ? k->key.len : TD_KEY_MAX;
    memcpy(name, k->key.data, n);
    name[n] = '\0';
    td_key_info ki = {
        .key = name, .id = k->id, .published_unix_ms = k->published_unix_ms};
    char msg[128];
    if (k->view != NULL)
      td__view_from_msg(k->view, &ki.view, msg, sizeof(msg));
    ret = kcb(&ki, arg);
  }
  tensord__response__free_unpacked(r, NULL);
  return ret;
}

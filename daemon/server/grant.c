/* grant.c: giving a connection a reference to a storage, and the reply
 * that carries it (ops.c and chanops.c both answer with storages). */
#include "grant.h"

#include "common.h"
#include "log.h"
#include "segment.h"
#include "server.h"
#include "tensord.pb-c.h"

#include <stdio.h>

/* Checks that c may do what want asks of s; on refusal msg says who owns s
 * and who c is. */
int td__check_access(td__conn *c, const td__storage *s, int want,
                     const char *what, char *msg, size_t len) {
  if (td__may(s, &c->hold, want) == 0)
    return 0;
  char acc[96];
  return td__msg(msg, len, TD_EACCES,
                 "%s: permission denied (%s; this client is uid %u gid %u)",
                 what, td__describe_access(s, acc, sizeof(acc)),
                 (unsigned)c->hold.peer.uid, (unsigned)c->hold.peer.gid);
}

/* Gives c one more reference of mode ro to s and, unless c already has the
 * storage in that mode (so its process has it mapped), a fresh fd in *fd.
 * Checks c's permission (write too if take) and its storage limit first. On
 * failure nothing changed and msg says why. */
int td__grant(td__conn *c, td__storage *s, int ro, int take, int force_fd,
              int *fd, char *msg, size_t len) {
  uint32_t had = 0;
  *fd = -1;
  int want = TD__MAY_READ | (ro && !take ? 0 : TD__MAY_WRITE);
  int err = take < 0 ? 0
                     : td__check_access(c, s, want,
                                        take ? "take"
                                        : ro ? "read-only access"
                                             : "read-write access",
                                        msg, len);
  if (err < 0)
    return err;
  uint32_t max = c->srv->max_storages_per_client;
  if (max && c->hold.refs.count + c->ncreates >= max &&
      td__ref_find(&c->hold, s->id) == 0)
    return td__msg(msg, len, TD_EMFILE,
                   "this client holds %zu storages and is creating %u, the "
                   "most --max-storages-per-client allows",
                   c->hold.refs.count, c->ncreates);
  err = td__ref_add(&c->srv->reg, &c->hold, s, ro, &had);
  if (err == TD_EOVERFLOW)
    return td__msg(msg, len, err,
                   "it has %u references, the most tensord can count", s->refs);
  if (err < 0)
    return td__msg(msg, len, err, "out of memory");
  /* A legacy CUDA IPC handle travels in the reply: there is no fd. */
  if ((had == 0 || force_fd) && !s->legacy) {
    *fd = td__segment_open(s, ro);
    if (*fd < 0) {
      err = *fd;
      *fd = -1;
      td__ref_drop(&c->srv->reg, &c->hold, s->id, ro, 1);
      if (err == TD_EMFILE || err == TD_ENFILE)
        td__error("client %d: cannot open %s: %s", (int)c->hold.peer.pid,
                  s->name, td_strerror(err));
      return td__msg(msg, len, err, "opening %s: %s", s->name,
                     td_strerror(err));
    }
    /* That process may keep its mapping past its release: the pages must
     * never serve another storage of the owner, which it might not be
     * allowed to read. Root's processes count too: root reads everything,
     * but a process may map as root and then drop to another uid
     * (setresuid), keeping the mapping. Only the owner's own uid does not
     * count (for a root owner, root's). SO_PEERCRED names the euid at
     * connect: a process that can switch between the owner's uid and
     * another (a saved set-user-ID) may look up as the owner at any time
     * anyway. */
    if (c->hold.peer.uid != s->owner.uid)
      s->foreign = 1;
  }
  return 0;
}

void td__storage_reply(const td__storage *s, int ro, int fd,
                       Tensord__StorageReply *m) {
  tensord__storage_reply__init(m);
  m->id = s->id;
  m->nbytes = s->nbytes;
  m->device = (Tensord__Device)s->device;
  m->readonly = ro;
  m->fd = fd >= 0;
  if (s->device == TD_CUDA) {
    m->device_uuid.data = (uint8_t *)s->uuid;
    m->device_uuid.len = 16;
    m->alloc_size = s->alloc_size;
    m->alloc_id = s->alloc_id;
    m->handle = TENSORD__CUDA_HANDLE__CUDA_HANDLE_POSIX_FD;
    if (s->legacy) {
      m->handle = TENSORD__CUDA_HANDLE__CUDA_HANDLE_LEGACY_IPC;
      m->ipc_handle.data = (uint8_t *)s->ipc_handle;
      m->ipc_handle.len = sizeof(s->ipc_handle);
    }
  }
}

/* Answers seq with s (dirty: a create's recycled bytes, for the client to
 * zero) and fd, if >= 0. */
int td__send_storage(td__conn *c, uint64_t seq, const td__storage *s, int ro,
                     int dirty, int fd) {
  Tensord__StorageReply m;
  Tensord__Response r = TENSORD__RESPONSE__INIT;
  td__storage_reply(s, ro, fd, &m);
  m.dirty = dirty;
  r.seq = seq;
  r.body_case = TENSORD__RESPONSE__BODY_STORAGE;
  r.storage = &m;
  td__conn_send(c, &r, fd);
  return 0;
}

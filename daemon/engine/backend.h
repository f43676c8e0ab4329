/* backend.h: the storage backend seam. A backend makes, exports and frees
 * the bytes of storages on one device; the registry, references, keys and
 * access control know nothing of it. POSIX shared memory (shm.c) is the CPU
 * backend; a CUDA backend plugs in beside it.
 *
 * create and unlink cost time that grows with bytes: segment.c runs them
 * on the thread pool for large segments, on the loop for small ones. The
 * other calls cost about a system call per segment and run on the loop
 * (unlink_prefix and describe only at start and stop). */
#ifndef TD_DAEMON_BACKEND_H
#define TD_DAEMON_BACKEND_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Segment names are "/tensord.<instance>.<id>-<tail>" on every backend, so
 * that one prefix names everything an instance made; the tail is 16 random
 * hex digits, so that no one who sees the prefix in /dev/shm can take the
 * next name first. Names from before the tail ("/tensord.<instance>.<id>")
 * live on in journals and are served as they are. */
#define TD__SEGMENT_NAME_MAX 64
#define TD__PREFIX_MAX 48
/* A create or rename that finds its name taken tries this many names in
 * all: each is 2^-64 likely to be guessed, so a second miss means someone
 * took the names on purpose. */
#define TD__NAME_TRIES 8

/* What a backend knows of one segment. */
typedef struct td__segment_desc {
  uint64_t nbytes;
  char where[96]; /* for people: "/dev/shm/tensord.1a2b.7" */
} td__segment_desc;

/* What td__backend.create_on made. */
typedef struct td__created {
  uint64_t alloc_size;
  int legacy;             /* no fd: ipc_handle names the memory */
  uint8_t ipc_handle[64]; /* a CUipcMemHandle */
  /* The allocation's identity: never the same for two allocations of one
   * daemon, and the same when a pooled allocation serves this create. */
  uint64_t alloc_id;
  int reused; /* served from the backend's own pool: the bytes are old */
} td__created;

/* Decides, for td__backend.unlink_prefix, whether segment name stays. */
typedef int (*td__keep_fn)(const char *name, void *arg);

typedef struct td__backend {
  const char *name; /* "shm" */
  td_device device;
  /* Makes segment name of nbytes, readable and writable by the daemon's user
   * only, with every page reserved. Returns a read-write fd (>= 0) the
   * caller owns, or a negative code with msg filled (TD_EEXIST: a file of
   * that name is there, and stays); nothing is left behind on failure. */
  int (*create)(const char *name, uint64_t nbytes, char *msg, size_t len);
  /* Makes segment name of nbytes on the device whose UUID is uuid (a GPU),
   * for backends of devices that come in several (NULL for the CPU's, and
   * create then unused), for uid: an allocation uid freed may serve it
   * (out->reused set), never another uid's. Sets out->alloc_size to the bytes
   * really allocated (nbytes rounded up to the device's granularity). Returns a
   * read-write fd the caller owns; or, for memory exported without an fd (a
   * legacy CUDA IPC handle, out->legacy set and out->ipc_handle filled), 0 and
   * no fd; or a negative code with msg filled; nothing is left behind on
   * failure. */
  int (*create_on)(const char *name, const uint8_t uuid[16], uint64_t nbytes,
                   uid_t uid, struct td__created *out, char *msg, size_t len);
  /* Opens a new fd on an existing segment for export to a client: read-only
   * (the kernel refuses writable mappings) if readonly. Returns the fd or a
   * negative code. */
  int (*open)(const char *name, int readonly);
  /* Frees the segment's name; its bytes go when no process maps them. A
   * segment already gone is not an error. */
  void (*unlink)(const char *name);
  /* Notes that name's unlink or retire is queued (called on the loop just
   * before), so that a create that would not fit beside it waits for its
   * bytes rather than fail; unlink and retire end the note. NULL: the
   * backend makes no such wait. */
  void (*releasing)(const char *name);
  /* Frees segment name, whose bytes no uid but uid has been given, as
   * unlink does, or keeps them in the backend's own pool for a later
   * create_on by uid (NULL: the backend has no pool of its own). Calls the
   * driver: runs on the thread pool. */
  void (*retire)(const char *name, uid_t uid);
  /* Gives segment from the name to, bytes and all: how a freed segment
   * enters the recycling pool. A file under to is never replaced. Returns 0
   * or a negative code (from unchanged): td__name_taken for a to that is
   * someone else's. */
  int (*rename)(const char *from, const char *to);
  /* Serves a create of nbytes from the pooled segment from: renames it
   * to, sets its size to nbytes (freeing a tail, reserving pages that are
   * missing) and, if zero, makes every byte read as zero again.
   * Returns a read-write fd the caller owns, or a negative code with msg
   * filled: if td__name_taken, to is someone else's and from is as it was;
   * on any other failure neither from nor to is left behind. */
  int (*reuse)(const char *from, const char *to, uint64_t nbytes, int zero,
               char *msg, size_t len);
  /* Unlinks every segment whose name (without the leading '/') starts with
   * prefix, except those keep (if not NULL) says to keep. Returns how many
   * it tried to unlink (a failure is logged), or a negative code if it
   * cannot list the segments. */
  int (*unlink_prefix)(const char *prefix, td__keep_fn keep, void *arg);
  /* Sets the bytes the backend has free and in all. Returns 0, or a
   * negative code with both unchanged. */
  int (*space)(uint64_t *free_bytes, uint64_t *total_bytes);
  /* Describes an existing segment that this daemon's uid made, for a
   * start that adopts segments by name: anyone may have made a file under
   * that name since, so only a regular file of the daemon's euid, with no
   * permission bits beyond 0600 and no other name, is one. Returns 0, or a
   * negative code with msg filled: TD_ENOENT if there is none of that name,
   * TD_EPERM for a file that is not the daemon's. */
  int (*describe)(const char *name, td__segment_desc *out, char *msg,
                  size_t len);
} td__backend;

extern const td__backend td__shm_backend;
/* CUDA VMM allocations (cudastore.c); without TENSORD_CUDA, one whose create
 * fails with TD_ENODEV. */
extern const td__backend td__cuda_backend;

/* Returns the backend of device, or NULL if this tensord has none for it. */
const td__backend *td__backend_for(td_device device);

/* Returns 1 if p is a prefix of the names a daemon gives its segments,
 * "/tensord.<instance>.", and 0 for anything else (empty, "/tensord.",
 * another program's names): whatever lies under a prefix a daemon recorded
 * may be unlinked at a later start, so only these are ever trusted. */
int td__segment_prefix_valid(const char *p);
/* Sets out to name's prefix: the name up to and including its last '.'.
 * Returns 0, or TD_EINVAL for a name that is not a segment's. */
int td__segment_prefix(const char *name, char out[TD__PREFIX_MAX]);
/* Sets out to a fresh segment name: prefix, seq, '-' and 16 hex digits
 * from getrandom(2) (one call per 32 names and thread: it may run on the
 * loop). Thread-safe. Returns 0, or a negative code with msg filled and out
 * unchanged: TD_ENAMETOOLONG if the name would not fit, or getrandom's
 * error. */
int td__segment_name(char out[TD__SEGMENT_NAME_MAX], const char *prefix,
                     uint64_t seq, char *msg, size_t len);
/* Returns 1 if err, from a create or rename of a segment, says its new name
 * is someone else's: a file is there (TD_EEXIST), or the sticky bit of
 * /dev/shm keeps a rename off it (TD_EPERM). */
static inline int td__name_taken(int err) {
  return err == TD_EEXIST || err == TD_EPERM;
}

#endif /* TD_DAEMON_BACKEND_H */

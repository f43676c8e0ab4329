/* internal.h: libtensord's private declarations. */
#ifndef TD_CLIENT_INTERNAL_H
#define TD_CLIENT_INTERNAL_H

#include "common.h"

#include <stddef.h>
#include <stdint.h>

/* copy.c: the kernel behind td_copy. Copies every element of sv at src to
 * the same index of dv at dst. Both views must have passed td_view_check
 * against their buffers. alias says that dst and src may be two mappings of
 * the same bytes (the same storage mapped twice), so that overlap is judged
 * by offsets rather than addresses. Overlapping views that are not the same
 * layout are copied through a temporary buffer. Returns 0, TD_EINVAL (dtype
 * or shape differ, or dv names an element twice through a stride 0) or
 * TD_ENOMEM, with the reason in td_view_last_error(); dst is unchanged on
 * failure. */
int td__copy_raw(void *dst, const td_view *dv, const void *src,
                 const td_view *sv, int alias);

/* How td__copy_raw copies a pair of layouts (for tests and benchmarks). */
typedef enum {
  TD__COPY_NONE = 0,    /* no element */
  TD__COPY_MEMCPY = 1,  /* one memcpy: both dense in the same order */
  TD__COPY_BLOCKS = 2,  /* a memcpy per contiguous inner block */
  TD__COPY_TILED = 3,   /* a transpose, in cache-sized 2-D tiles */
  TD__COPY_STRIDED = 4, /* element by element */
} td__copy_path;
/* Returns the path td__copy_raw takes for dv and sv (same dtype and shape),
 * before any overlap is considered. */
td__copy_path td__copy_plan_path(const td_view *dv, const td_view *sv);

/* client.c: records this thread's last failure of any call as its last
 * failure on c too (for calls on c that fail in code that knows no client,
 * such as td_from_dlpack's checks). NULL ok. */
void td__client_keep_error(const td_client *c);

/* name.c: the name a client connects with (td_connect_opts.name). */
/* Copies at most TD_CLIENT_NAME_MAX bytes of in into out (len bytes, with
 * its NUL), each byte outside 0x20..0x7e as '?', as tensord shows names.
 * Returns the length written. */
size_t td__client_name_clean(const char *in, char *out, size_t len);
/* Copies s into buf (len bytes, cut short if too small) with each control
 * character (below 0x20, and 0x7f) as '?', so that a name from untrusted
 * bytes (a tensor's, a file's) cannot drive the terminal its message is
 * printed on; other bytes (UTF-8) stay. Returns buf. */
const char *td__printable(const char *s, char *buf, size_t len);
/* The default name (tensord.h's rule) from what the process's environment
 * and /proc say: env ($TENSORD_CLIENT_NAME, NULL if unset), comm
 * (/proc/self/comm without its newline) and cmdline (cmdlen bytes of
 * /proc/self/cmdline, NUL-separated). Writes it, cleaned, into buf. */
void td__client_default_name(const char *env, const char *comm,
                             const char *cmdline, size_t cmdlen, char *buf,
                             size_t len);
/* given, cleaned, if not NULL nor "", else this process's default name. */
void td__client_name(const char *given, char *buf, size_t len);

/* client.c: turns c into a watcher (docs/protocol.md): sends Watch with
 * prefix (len bytes) and waits for its Ok. Returns 0 with *wire the
 * connection's wire and *seq the Watch's seq, from which the caller alone
 * reads the events (c takes no other call); or a negative code with the
 * reason recorded for c. */
struct td__wire;
int td__client_watch(td_client *c, const char *prefix, size_t len,
                     struct td__wire **wire, uint64_t *seq);

/* cache.c: the process's mappings, one per (daemon, storage, mode). */
typedef struct td__mapping td__mapping;
/* Mapping modes: shared read-write, shared read-only, and private
 * copy-on-write over a read-only fd (TD_COW). */
enum { TD__MAP_RW = 0, TD__MAP_RO = 1, TD__MAP_COW = 2 };
/* Finds the process's mapping of the storage in mode, or maps fd (nbytes)
 * if there is none (never to be populated if lazy: TD_LAZY). Adds one
 * handle to it. Always closes fd (when >= 0).
 * Returns 0, TD_ENOENT if there is no mapping and fd is -1, or the mmap
 * error. */
int td__map_acquire(uint64_t instance, uint64_t id, int mode, size_t nbytes,
                    int fd, int lazy, td__mapping **out);
/* Drops one handle; the last unmaps. NULL ok. */
void td__map_release(td__mapping *m);
/* Returns the mapping's address; the first call populates it if it is at
 * or above the populate threshold of its mode (see cache.c). */
void *td__map_addr(td__mapping *m);
/* Mappings the process has now (for tests). */
size_t td__map_count(void);

/* cumap.c: CUDA storages in this process. */
typedef struct td__cumap td__cumap;
/* Sets uuid to the UUID of this process's CUDA device index. Returns 0, or
 * TD_ENODEV (no driver, no such device) with msg saying why. */
int td__cu_resolve(int64_t index, uint8_t uuid[16], char *msg, size_t len);
/* Maps the exported VMM allocation fd (of size bytes) on the GPU with that
 * UUID, read-only if ro, in its primary context; or takes back the warm
 * mapping of the same allocation (alloc_id of daemon instance, not 0, and
 * the same exported file as fd) that td__cumap_close kept. Does not close
 * fd. Returns 0, or TD_ENODEV naming the UUID if this process cannot see
 * that GPU, or the driver's failure, with msg saying why. */
int td__cumap_open(uint64_t instance, uint64_t alloc_id, const uint8_t uuid[16],
                   int fd, uint64_t size, int ro, td__cumap **out, char *msg,
                   size_t len);
/* Counts a client of daemon instance in this process, and its end (after
 * its last storage): with the last, the warm mappings (td__cumap_close
 * kept) of that daemon's allocations are unmapped, since none can come
 * back without a connection. */
void td__cumap_client_join(uint64_t instance);
void td__cumap_client_leave(uint64_t instance);
/* The device pointer. */
/* Opens the legacy IPC handle (a CUipcMemHandle) of size bytes on the GPU
 * with that UUID, or shares this process's open of it: a legacy handle
 * opens once per process, and its last td__cumap_close closes it. The
 * memory is read-write whatever the reference (the driver has no
 * read-only open). Returns 0 or a negative code with msg filled. */
int td__cumap_open_ipc(const uint8_t uuid[16], const uint8_t handle[64],
                       uint64_t size, td__cumap **out, char *msg, size_t len);
void *td__cumap_addr(const td__cumap *m);
/* Writes the IPC handle of event (a CUevent: CU_EVENT_INTERPROCESS |
 * CU_EVENT_DISABLE_TIMING) into out, and remembers it for
 * td__cuevent_wait in this process. Returns 0 or a negative code with msg
 * filled. */
int td__cuevent_export(void *event, uint8_t out[64], char *msg, size_t len);
/* Opens the IPC event handle in the primary context of the GPU with that
 * UUID and makes stream wait for it (cuStreamWaitEvent), or with stream
 * NULL blocks until it completes (cuEventSynchronize); destroys its open.
 * A handle this process exported (which the driver will not open here)
 * waits on the exported event itself. Returns 0 or a negative code with
 * msg filled. */
int td__cuevent_wait(const uint8_t uuid[16], const uint8_t handle[64],
                     void *stream, char *msg, size_t len);
/* The GPU's ordinal in this process. */
int td__cumap_index(const td__cumap *m);
/* Zeroes the first nbytes on the library's stream and waits for it.
 * Returns 0 or a negative code with msg filled. */
int td__cumap_zero(td__cumap *m, size_t nbytes, char *msg, size_t len);
/* Copies n bytes between host and the device memory at off bytes into m:
 * to the device if to_device, else from it, on the library's private
 * stream for m's GPU, and returns when the destination holds the bytes
 * (the stream synchronised). Returns 0 or the driver's failure with msg
 * filled. */
int td__cumap_copy(td__cumap *m, int to_device, size_t off, void *host,
                   size_t n, char *msg, size_t len);
/* Issues a copy of height rows of width bytes in one cuMemcpy2DAsync on the
 * library's stream: row i from src + i * spitch to dst + i * dpitch, where
 * a side with a mapping (dm, sm) is device memory at that many bytes into
 * it and a side without (NULL) is host memory at that address. At least
 * one of dm, sm is not NULL, and both are on one GPU; the context is dm's
 * if it has one, else sm's. The copy is done only after td__cumap_sync of
 * either. Returns 0 or the driver's failure with msg filled. */
int td__cumap_copy2d(td__cumap *dm, uintptr_t dst, size_t dpitch, td__cumap *sm,
                     uintptr_t src, size_t spitch, size_t width, size_t height,
                     char *msg, size_t len);
/* Waits for the work the library issued on m's GPU. Returns 0 or the
 * driver's failure with msg filled. */
int td__cumap_sync(td__cumap *m, char *msg, size_t len);
/* Copies numel elements of es bytes between two mappings on one GPU with
 * the copy kernel (cuda/kernels/copy.cu), on the library's stream, and
 * waits for it: the plan's nd dims (outermost first, at most TD_MAX_DIMS)
 * of size[] elements, ds[] and ss[] bytes apart in dm and sm, from doff and
 * soff bytes into them. Returns 0; 1 if the kernel cannot run here (built
 * without nvcc, TENSORD_CUDA_COPY_KERNEL=0, a driver without modules, no
 * binary for this GPU: remembered per GPU), nothing done, for the caller's
 * fall-back; or TD_EIO with msg naming the driver's reason (a launch that
 * failed, a fault in the kernel). */
int td__cumap_kcopy(td__cumap *dm, size_t doff, td__cumap *sm, size_t soff,
                    int nd, const int64_t *size, const int64_t *ds,
                    const int64_t *ss, size_t es, int64_t numel, int tile,
                    char *msg, size_t len);
/* 1 if dm's GPU and sm's (two different GPUs) reach each other (NVLink,
 * PCIe P2P: cuDeviceCanAccessPeer) and each mapping now lets the other GPU
 * in (cuMemSetAccess, made once per mapping and GPU), so that a kernel on
 * either GPU may read and write both; 0 if they do not reach each other;
 * -1 if they do but the grant was refused (or this is a forked child):
 * the caller stages instead. */
int td__cumap_reach(td__cumap *dm, td__cumap *sm);
/* Copies n bytes from soff bytes into sm to doff bytes into dm, mappings on
 * two different GPUs, with cuMemcpyPeerAsync on dm's library stream, and
 * waits for it. Returns 0; 1 if the driver lacks the call or refuses it
 * when issued (nothing done: the caller stages the copy instead); or a
 * negative code with msg filled (the copy failed on the device). */
int td__cumap_peer(td__cumap *dm, size_t doff, td__cumap *sm, size_t soff,
                   size_t n, char *msg, size_t len);
/* Waits for the library's work on m's GPU, then unmaps and frees m. NULL
 * ok. */
void td__cumap_close(td__cumap *m);
/* A pinned host staging buffer of nslots slots of slot bytes, each with a
 * stream of its own, in m's context: for copying to CUDA storages on m's
 * GPU asynchronously (the model loader). Thread-safe: any thread may take
 * and put slots. Returns 0 or a negative code with msg filled; *out is
 * NULL on failure and nothing is left. */
typedef struct td__custage td__custage;
int td__custage_open(td__cumap *m, size_t slot, unsigned nslots,
                     td__custage **out, char *msg, size_t len);
size_t td__custage_slot(const td__custage *g);
/* Takes a free slot, waiting for one, and for the copy last issued from it
 * to complete; *host is its memory (td__custage_slot bytes). Returns 0, or
 * the driver's failure of that copy with msg filled (the slot is put back
 * then). */
int td__custage_take(td__custage *g, unsigned *slot, void **host, char *msg,
                     size_t len);
/* Issues the copy of the slot's first n bytes to off bytes into dst on the
 * slot's stream (none if dst is NULL) and gives the slot back, whatever
 * happens. Returns 0 or the driver's failure with msg filled. */
int td__custage_put(td__custage *g, unsigned slot, td__cumap *dst, size_t off,
                    size_t n, char *msg, size_t len);
/* Waits for every copy issued, then frees the streams and the buffer. NULL
 * ok. Returns 0 or the first failed copy's code with msg filled. */
int td__custage_close(td__custage *g, char *msg, size_t len);
/* client.c: the CUDA mapping of a storage handle, or NULL for a CPU one. */
td__cumap *td__storage_cumap(const struct td_storage *s);
/* client.c: a file descriptor of a CPU storage's segment, for writing it
 * without mapping it (the loader's splice). The caller closes it. Costs
 * one round trip: the daemon sends the fd with a second reference, which
 * goes back with the next request. Returns 0 or a negative code (recorded
 * for s's client). */
int td__storage_fd(struct td_storage *s, int *fd);

/* cache.c: td__map_acquire for a CUDA storage: finds the process's mapping
 * of it in mode (TD__MAP_RW or _RO), or maps fd (an exported allocation of
 * alloc_size bytes on the GPU with that UUID). Adds one handle to it.
 * With ipc_handle (64 bytes: a legacy allocation), opens that instead of
 * an fd (td__cumap_open_ipc). Always closes fd (when >= 0). Returns 0,
 * TD_ENOENT if there is no mapping and neither fd nor ipc_handle, or
 * td__cumap_open's failure with msg filled. */
int td__map_acquire_cuda(uint64_t instance, uint64_t id, int mode,
                         const uint8_t uuid[16], uint64_t alloc_size,
                         uint64_t alloc_id, int fd, const uint8_t *ipc_handle,
                         td__mapping **out, char *msg, size_t len);
/* The mapping's CUDA side, or NULL for a CPU storage's. */
td__cumap *td__map_cumap(const td__mapping *m);

/* client.c, for chan.c. */
struct Tensord__Request;
struct Tensord__Response;
struct Tensord__StorageReply;
/* Sends req and waits for a reply with body `body` (client.c's call). */
int td__call(td_client *c, struct Tensord__Request *req, int body,
             struct Tensord__Response **resp, int *fd);
/* Sends req (seq 0), which has no reply. Returns 0 or a negative code. */
int td__send_oneway(td_client *c, struct Tensord__Request *req);
int td__client_forked(const td_client *c);
/* A reference on c's memory (not its connection), as a handle has. */
void td__client_ref(td_client *c);
void td__client_unref(td_client *c);
uint64_t td__client_instance(const td_client *c);
/* A handle for the reference the daemon just gave (m, with fd or -1); on
 * failure the reference is released. */
int td__storage_from_reply(td_client *c, const struct Tensord__StorageReply *m,
                           int fd, td_storage **out);
/* A handle on slot of ch (storage id, mapped by the end already, in mode
 * ro): no reference of the connection, see td__chan_slot_done. */
int td__storage_slot(td_client *c, td_chan *ch, uint32_t slot, uint64_t id,
                     size_t nbytes, int ro, td_storage **out);
/* The channel s is a slot of (NULL if none), its index and the handle's
 * references. */
td_chan *td__storage_chan(const td_storage *s, uint32_t *slot, int *refs);
/* Frees a slot handle that was sent: no slot goes back. */
void td__storage_forget(td_storage *s);
/* chan.c: a slot handle of ch went; give_back: the slot is free again. */
void td__chan_slot_done(td_chan *ch, uint32_t slot, int give_back);

#endif /* TD_CLIENT_INTERNAL_H */

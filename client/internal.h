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
 * UUID, read-only if ro, in its primary context. Does not close fd.
 * Returns 0, or TD_ENODEV naming the UUID if this process cannot see that
 * GPU, or the driver's failure, with msg saying why. */
int td__cumap_open(const uint8_t uuid[16], int fd, uint64_t size, int ro,
                   td__cumap **out, char *msg, size_t len);
/* The device pointer. */
void *td__cumap_addr(const td__cumap *m);
/* The GPU's ordinal in this process. */
int td__cumap_index(const td__cumap *m);
/* Zeroes the first nbytes and waits for it. Returns 0 or a negative code
 * with msg filled. */
int td__cumap_zero(td__cumap *m, size_t nbytes, char *msg, size_t len);
/* Copies n bytes between host and the device memory at off bytes into m:
 * to the device if to_device, else from it; synchronous. Returns 0 or the
 * driver's failure with msg filled. */
int td__cumap_copy(td__cumap *m, int to_device, size_t off, void *host,
                   size_t n, char *msg, size_t len);
/* Unmaps and frees m. NULL ok. */
void td__cumap_close(td__cumap *m);
/* client.c: the CUDA mapping of a storage handle, or NULL for a CPU one. */
td__cumap *td__storage_cumap(const struct td_storage *s);

/* cache.c: td__map_acquire for a CUDA storage: finds the process's mapping
 * of it in mode (TD__MAP_RW or _RO), or maps fd (an exported allocation of
 * alloc_size bytes on the GPU with that UUID). Adds one handle to it.
 * Always closes fd (when >= 0). Returns 0, TD_ENOENT if there is no
 * mapping and fd is -1, or td__cumap_open's failure with msg filled. */
int td__map_acquire_cuda(uint64_t instance, uint64_t id, int mode,
                         const uint8_t uuid[16], uint64_t alloc_size, int fd,
                         td__mapping **out, char *msg, size_t len);
/* The mapping's CUDA side, or NULL for a CPU storage's. */
td__cumap *td__map_cumap(const td__mapping *m);

#endif /* TD_CLIENT_INTERNAL_H */

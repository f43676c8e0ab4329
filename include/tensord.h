/* tensord.h: the public API of libtensord, the tensord client library. */
#ifndef TENSORD_H
#define TENSORD_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Everything declared here, and only that, is exported from libtensord.so:
 * the library is built with -fvisibility=hidden. */
#pragma GCC visibility push(default)

/* The version of this header. These three lines are the one place the
 * version is written: CMake reads them for the project, the library's file
 * name, tensord.pc and the CMake package. */
#define TD_VERSION_MAJOR 0
#define TD_VERSION_MINOR 1
#define TD_VERSION_PATCH 0
/* 0xMMmmpp: one byte each for major, minor and patch, as libuv's. */
#define TD_VERSION_HEX                                                         \
  ((TD_VERSION_MAJOR << 16) | (TD_VERSION_MINOR << 8) | TD_VERSION_PATCH)
#define TD__STR(v) #v
#define TD__XSTR(v) TD__STR(v)
#define TD_VERSION_STRING                                                      \
  TD__XSTR(TD_VERSION_MAJOR)                                                   \
  "." TD__XSTR(TD_VERSION_MINOR) "." TD__XSTR(TD_VERSION_PATCH)

/* Returns the version of the libtensord a program runs with, as
 * TD_VERSION_HEX; compare it with the TD_VERSION_HEX the program was built
 * against. */
unsigned int td_version(void);
/* Returns the same as "major.minor.patch" (TD_VERSION_STRING); static. */
const char *td_version_string(void);

/* ABI. A program built against this header runs with any later libtensord
 * of the same major version (the major version is the SONAME's: .so.0).
 * To keep that promise:
 * - functions are only added; one that changes or goes takes a new major
 *   version, and with it a new SONAME;
 * - enums (td_errno, td_dtype, td_device) and flags only ever get new
 *   values, and existing values never change: expect codes you do not know
 *   (td_strerror and td_err_name name any code). TD_DTYPE_COUNT_ grows.
 * - the structs below that end in reserved[] keep their size and layout:
 *   td_create_opts, td_publish_opts, td_connect_opts, td_holder,
 *   td_storage_info, td_key_info, td_stat, td_device_stat, td_client_stat,
 *   td_metrics, td_event and td_state_dict_entry. A new field takes the
 *   place of reserved words.
 *   In what you pass in (td_create_opts, td_publish_opts, td_connect_opts)
 *   zero keeps the old behaviour, so "zero-initialise, then set" keeps
 *   working, and a library that does not know a field refuses it non-zero
 *   with TD_EINVAL rather than ignore it; in what the library fills in,
 *   reserved words are zero.
 * - td_view is fixed: its layout never changes.
 * The wire protocol is versioned apart (TD_PROTOCOL_VERSION). */

/* Wire protocol version spoken by this library; the daemon refuses others. */
#define TD_PROTOCOL_VERSION 1

#define TD_MAX_DIMS 16 /* most dimensions a view may have */
#define TD_KEY_MAX 255 /* longest key, in bytes */

/* Errors. Every int-returning call returns 0 (or a count) on success and one
 * of these negative codes on failure. Where an errno fits, the code equals
 * -errno, as in libuv; codes no errno fits are -4001 and below. */
#define TD_ERRNO_MAP(XX)                                                       \
  XX(EINVAL, -EINVAL, "invalid argument")                                      \
  XX(ERANGE, -ERANGE, "view reaches outside its storage")                      \
  XX(ENOENT, -ENOENT, "no such storage or key")                                \
  XX(ETIMEDOUT, -ETIMEDOUT, "timed out")                                       \
  XX(ENOMEM, -ENOMEM, "not enough memory or over capacity")                    \
  XX(ENOSPC, -ENOSPC, "no space left in shared memory")                        \
  XX(EACCES, -EACCES, "permission denied")                                     \
  XX(EPERM, -EPERM, "operation not permitted")                                 \
  XX(ECONNRESET, -ECONNRESET, "connection reset by tensord")                   \
  XX(EPIPE, -EPIPE, "the peer closed the connection")                          \
  XX(ECONNREFUSED, -ECONNREFUSED, "connection refused")                        \
  XX(ENOTCONN, -ENOTCONN, "client is closed")                                  \
  XX(EPROTO, -EPROTO, "protocol error")                                        \
  XX(EPROTONOSUPPORT, -EPROTONOSUPPORT, "protocol version not supported")      \
  XX(ENOSYS, -ENOSYS, "operation not supported")                               \
  XX(EMSGSIZE, -EMSGSIZE, "message too long")                                  \
  XX(EOVERFLOW, -EOVERFLOW, "value too large")                                 \
  XX(EAGAIN, -EAGAIN, "resource temporarily unavailable")                      \
  XX(EBADF, -EBADF, "bad file descriptor")                                     \
  XX(EMFILE, -EMFILE, "too many open files")                                   \
  XX(ENFILE, -ENFILE, "too many open files in system")                         \
  XX(EDQUOT, -EDQUOT, "quota exceeded")                                        \
  XX(EUSERS, -EUSERS, "too many clients")                                      \
  XX(EBUSY, -EBUSY, "resource busy")                                           \
  XX(ENODEV, -ENODEV, "no such device")                                        \
  XX(EIO, -EIO, "i/o error")                                                   \
  XX(ECANCELED, -ECANCELED, "operation canceled")                              \
  XX(ENAMETOOLONG, -ENAMETOOLONG, "name too long")                             \
  XX(EEXIST, -EEXIST, "already exists")                                        \
  XX(EFORKED, -4001,                                                           \
     "used in a fork() child: its parent's client, channel or CUDA")

typedef enum {
#define XX(name, code, _) TD_##name = code,
  TD_ERRNO_MAP(XX)
#undef XX
} td_errno;

/* Returns a short description of err; never NULL, also for unknown codes. */
const char *td_strerror(int err);
/* Returns the name of err ("EINVAL"); never NULL, also for unknown codes. */
const char *td_err_name(int err);

/* Element types, named as in PyTorch. The numbers travel on the wire and
 * never change; 0 is no dtype. */
typedef enum {
  TD_DTYPE_INVALID = 0,
  TD_BOOL = 1,
  TD_UINT8 = 2,
  TD_INT8 = 3,
  TD_INT16 = 4,
  TD_INT32 = 5,
  TD_INT64 = 6,
  TD_FLOAT16 = 7,
  TD_BFLOAT16 = 8,
  TD_FLOAT32 = 9,
  TD_FLOAT64 = 10,
  TD_COMPLEX64 = 11,
  TD_COMPLEX128 = 12,
  TD_UINT16 = 13,
  TD_UINT32 = 14,
  TD_UINT64 = 15,
  TD_FLOAT8_E4M3FN = 16,
  TD_FLOAT8_E5M2 = 17,
  TD_DTYPE_COUNT_
} td_dtype;

/* Returns the size of one element in bytes, or 0 for an unknown dtype. */
size_t td_dtype_size(td_dtype dtype);
/* Returns PyTorch's name ("float32"), or NULL for an unknown dtype. */
const char *td_dtype_name(td_dtype dtype);
/* Parses a PyTorch or numpy spelling; returns TD_DTYPE_INVALID if unknown. */
td_dtype td_dtype_from_name(const char *name);
/* Sets *out to the value of the element of dtype at elem (native
 * little-endian bytes, as a storage holds them; no alignment needed): exact
 * for every float dtype (float16, bfloat16 and the float8s included, NaN
 * and infinities as they are; float8_e4m3fn has no infinity, its largest
 * value is 448) and for integers up to 2^53, larger ones rounded to the
 * nearest double; bool is 0 or 1 (any byte but 0 is 1). Returns 0, or
 * TD_EINVAL for an unknown dtype and for a complex one (decode each part
 * as a float32 or float64); *out is unchanged on failure. */
int td_elem_to_double(td_dtype dtype, const void *elem, double *out);

/* Where a storage's bytes live. */
typedef enum { TD_CPU = 0, TD_CUDA = 1 } td_device;

/* A view interprets the bytes of a storage, exactly as a PyTorch tensor does
 * its UntypedStorage: strides and offset count elements, not bytes. A view is
 * plain metadata; nothing here touches bytes. */
typedef struct td_view {
  td_dtype dtype;
  int32_t ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t stride[TD_MAX_DIMS];
  int64_t offset;
} td_view;

/* Fills *out with a contiguous (row-major) view of shape at offset 0.
 * Returns TD_EINVAL for a bad dtype, ndim or negative size, or a stride, an
 * element count or a byte count (elements times their size) past INT64_MAX;
 * *out is unchanged on failure. */
int td_view_contiguous(td_dtype dtype, int32_t ndim, const int64_t *shape,
                       td_view *out);
/* Returns 0 if every element of v lies inside a storage of nbytes bytes,
 * TD_ERANGE if some element does not, and TD_EINVAL if v is malformed (bad
 * dtype or ndim, negative size, stride or offset, more than INT64_MAX
 * elements, which stride-0 dims allow in a few bytes) or its extent
 * overflows int64. A view that passes has a td_view_numel that fits int64
 * and a byte extent that fits size_t. */
int td_view_check(const td_view *v, size_t nbytes);
/* Returns the number of elements of v (1 for a 0-d view, 0 if any size is
 * 0, whatever the others), or TD_EINVAL if v is malformed, which includes a
 * count past INT64_MAX. */
int64_t td_view_numel(const td_view *v);
/* Formats v as "float32[4, 3] stride (3, 1) offset 0" into buf; returns buf. */
char *td_view_format(const td_view *v, char *buf, size_t len);

/* ---- view algebra (docs/views.md) ---- */
/* Every operation below is pure metadata over one td_view, with PyTorch's
 * rules and names. Each returns 0 or a negative TD_E* code and leaves *v
 * unchanged on failure: TD_EINVAL for a malformed view, a dim out of range,
 * a negative size, a step below 1, a reshape or expand PyTorch would refuse
 * and arithmetic that overflows int64; TD_ERANGE for an index or range that
 * falls outside its dimension. A dim may be negative, counting from the end
 * (-1 is the last). Ops never widen what a view reaches: applied to a view
 * that passes td_view_check(v, n), every op but td_view_as_strided gives one
 * that passes it too. No op makes a view of more than INT64_MAX elements
 * (expand, reinterpret and as_strided refuse one with TD_EINVAL), and every
 * op refuses such a view as malformed. */

struct td_client;
struct td_storage;

/* Returns the message of this thread's last failed call of any kind: the
 * same as td_last_error(NULL) (see "Errors" below), kept under this name for
 * the view algebra, whose messages name the operation, the dimension and the
 * values. "" if no call failed yet; a later success does not clear it. */
const char *td_view_last_error(void);

/* Returns 1 if v is contiguous in PyTorch's sense (row-major; the strides of
 * size-1 dims and of empty views do not matter; the offset does not count),
 * 0 if not, TD_EINVAL if v is malformed. */
int td_view_is_contiguous(const td_view *v);
/* Swaps dims d0 and d1. A 0-d view accepts dims 0 and -1 and stays as is. */
int td_view_transpose(td_view *v, int32_t d0, int32_t d1);
/* Reorders the dims: dim i of the result is dim dims[i] of v. dims has
 * v->ndim entries, each dim exactly once (NULL ok for a 0-d view). */
int td_view_permute(td_view *v, const int32_t *dims);
/* Keeps [start, start + len) of dim. start may be negative (counted from the
 * end, as in PyTorch); start + len must not pass the size. */
int td_view_narrow(td_view *v, int32_t dim, int64_t start, int64_t len);
/* Keeps index (negative: from the end) of dim and drops the dim. */
int td_view_select(td_view *v, int32_t dim, int64_t index);
/* Python's v[start:stop:step] on dim, step >= 1. As in PyTorch, negative
 * start and stop count from the end and both are then clamped to
 * [0, size], so no range is out of bounds: pass 0 and INT64_MAX for the
 * whole dim. */
int td_view_slice(td_view *v, int32_t dim, int64_t start, int64_t stop,
                  int64_t step);
/* Inserts a size-1 dim at position dim (-ndim-1 .. ndim). */
int td_view_unsqueeze(td_view *v, int32_t dim);
/* Drops dim if its size is 1; leaves v as is (and returns 0) if it is not,
 * as PyTorch does. A 0-d view accepts dims 0 and -1. */
int td_view_squeeze(td_view *v, int32_t dim);
/* Drops every size-1 dim. */
int td_view_squeeze_all(td_view *v);
/* Broadcasts v to shape (ndim >= v->ndim; new dims are added in front): a
 * size-1 dim may take any size and gets stride 0; -1 keeps an existing
 * dim's size; any other size must equal the dim's own. */
int td_view_expand(td_view *v, int32_t ndim, const int64_t *shape);
/* Gives v the shape (one entry may be -1, inferred) without moving a byte:
 * succeeds exactly when PyTorch's Tensor.view(shape) would, with the same
 * strides, and fails with TD_EINVAL where a copy would be needed. */
int td_view_reshape(td_view *v, int32_t ndim, const int64_t *shape);
/* Replaces shape, strides and offset, keeping the dtype. Checks only that
 * they are well formed (non-negative, at most INT64_MAX elements, no int64
 * overflow in the extent): it cannot know the storage, so whatever reads or
 * writes through the result (td_publish, td_copy, td_to_dlpack) checks it
 * against the storage. */
int td_view_as_strided(td_view *v, int32_t ndim, const int64_t *shape,
                       const int64_t *stride, int64_t offset);
/* Looks at the same bytes as dtype, as Tensor.view(dtype): with an element
 * of the same size only the dtype changes; otherwise v must have a dim, its
 * last dim stride 1, and (when the element grows) the last size, the offset
 * and the other strides divisible by the size ratio. */
int td_view_reinterpret(td_view *v, td_dtype dtype);
/* Sets *offset to the element offset (in elements of v's dtype, from the
 * start of the storage) of the element at index[0..ndim) (negative: from
 * the end; NULL ok for a 0-d view). *offset is unchanged on failure. */
int td_view_offset_of(const td_view *v, const int64_t *index, int64_t *offset);
/* ---- end of view algebra ---- */

/* ---- copies and DLPack (docs/views.md) ---- */
/* Unlike the view algebra, these reach storage bytes: td_copy reads and
 * writes them, td_to_dlpack hands out a pointer into a storage's mapping
 * together with a reference to the storage, and td_from_dlpack asks the
 * daemon for a new storage, copies into it and may publish it. Each checks
 * every view against its storage before it touches a byte, and leaves the
 * reason of a failure in td_view_last_error(). */

/* Copies every element of src_view in src to the same index of dst_view in
 * dst: same dtype and shape, both checked against their storages (TD_ERANGE).
 * Refuses a read-only dst (TD_EACCES) and a dst view that names one element
 * twice (a stride-0 dim, TD_EINVAL). Views of the same storage that overlap
 * are copied through a temporary buffer of numel * itemsize bytes (TD_ENOMEM
 * if it cannot be had), so the result is as if src had been read whole
 * first. Contiguous runs are copied with memcpy, a transpose in
 * cache-sized tiles. Either storage may be a GPU's (TD_CUDA): two dense
 * views of one layout, one on the CPU, are one synchronous cuMemcpy; any
 * other pair goes through host copies of the bytes the views span (the
 * destination's fetched first, so that bytes between its elements stay).
 * Other devices get TD_ENODEV. Every check comes before the first write, so
 * dst is unchanged on failure (but for a driver failure in the middle of a
 * copy to a GPU); the reason is in td_view_last_error(). */
int td_copy(struct td_storage *dst, const td_view *dst_view,
            const struct td_storage *src, const td_view *src_view);

/* DLPack (DLPack 0.6 ABI). Include <dlpack/dlpack.h> to use the result;
 * tensord.h itself needs only this declaration. */
struct DLManagedTensor;

/* Exports view v of s (v NULL: the whole storage as uint8[nbytes]) as a new
 * DLManagedTensor without copying: data points at the view's first element
 * (the storage's mapping plus offset times the element size, so page
 * aligned only at offset 0) and byte_offset is 0, as PyTorch exports
 * (PyTorch 1.13 ignores byte_offset on import); strides explicit in
 * elements, device kDLCPU (kDLCUDA with this process's ordinal of the GPU
 * for a TD_CUDA storage, data its device pointer). The tensor holds its own
 * reference to s (taken with td_storage_retain), so it outlives
 * td_storage_release of the caller's handle; its deleter drops that reference
 * and frees the tensor, and must be called exactly once by whoever consumes it.
 * bool travels as kDLUInt of 8 bits (DLPack 0.6 has no bool); float8 dtypes
 * have no DLPack 0.6 code and get TD_EINVAL (reinterpret them as uint8 first).
 * A read-only storage is exported too; writing through the tensor then faults.
 * Returns TD_ERANGE if v does not fit s, TD_ENOMEM; *out is NULL on failure. */
int td_to_dlpack(struct td_storage *s, const td_view *v,
                 struct DLManagedTensor **out);

/* td_from_dlpack: call src's deleter once the copy is made (also on
 * failure, as if ownership passed to td_from_dlpack). */
#define TD_DLPACK_CONSUME 0x100u

/* Copies the CPU tensor src, whose first element is at data + byte_offset
 * (both are honoured; any non-negative strides; NULL strides: row-major),
 * into a new storage that c asks the daemon for, one copy, as a contiguous
 * view, and publishes it under key if key is not NULL. *out (if not NULL) gets
 * the new storage handle; with out NULL only the key keeps the storage alive.
 * src is only read: the caller keeps it and calls its deleter when done,
 * unless flags has TD_DLPACK_CONSUME. kDLUInt/kDLInt/kDLFloat/kDLBfloat/
 * kDLComplex of the sizes tensord has, and code 6 (kDLBool of later DLPack)
 * of 8 bits, with lanes 1; others are TD_EINVAL. Devices other than kDLCPU
 * (and the host-memory kDLCUDAHost, kDLROCMHost) get TD_ENODEV. A tensor of
 * more than INT64_MAX elements, one whose contiguous copy needs more than
 * INT64_MAX bytes (a stride-0 source may be tiny) and one whose bytes would
 * run past the end of the address space are TD_EINVAL, before any storage
 * is made. The reason of a failure is in td_view_last_error(); where the
 * daemon refused, it is also in td_last_error(c). Nothing is left behind on
 * failure. */
int td_from_dlpack(struct td_client *c, struct DLManagedTensor *src,
                   const char *key, unsigned flags, struct td_storage **out);
/* ---- end of copies and DLPack ---- */

/* Clients and storages. */
typedef struct td_client td_client;
typedef struct td_storage td_storage;

/* Errors, one channel. Every call that fails returns its TD_E* code and
 * records a message, naming the cause and the values, for the calling
 * thread: td_last_error(NULL) returns this thread's last failure of any
 * call (a view op, td_copy, DLPack, td_connect, any call on any client), and
 * td_last_error(c) its last failure of a call on c (one taking c as an
 * argument, td_from_dlpack included), which a failure on another client does
 * not overwrite. Other threads never change what a thread reads. A success
 * clears nothing, so read the message right after the call that failed; it
 * stays valid until this thread's next failure. A thread keeps its last
 * failure on each of the 16 clients it most recently failed on.
 * td_last_error(c) does not read c, so a thread may still ask why its call
 * failed after another thread's td_close(c).
 *
 * Threads. A td_client may be shared by any number of threads: calls on it
 * are matched to their replies, so they may overlap, and a thread waiting
 * for a slow reply (a lookup that waits) holds up no other. td_close(c) may
 * be called while other threads are inside calls on c: they return
 * TD_ENOTCONN at once; no call on c may begin after td_close returns.
 * Storage handles may be used and released from any thread.
 *
 * Ownership. td_connect gives the caller the client, to end with td_close.
 * A call that makes a handle (create, open, lookup) gives the caller one
 * reference on it, to drop with td_storage_release; td_storage_retain adds
 * one (for each holder that must outlive the caller's, such as a DLPack
 * deleter), and the handle goes with its last reference. A handle keeps its
 * client's memory alive, not its connection: after td_close its mapping
 * stays readable and writable until it is released, but the daemon has
 * dropped the reference and frees the storage unless a key or another
 * process holds it.
 *
 * Fork. A child of fork() inherits the parent's mappings, and they stay
 * valid and shared (writes are seen by everyone mapping the storage; a
 * TD_COW mapping stays private, the child's copy of the parent's); it
 * does not inherit the parent's references, nor its connections. A call in
 * the child on a client connected by the parent fails with TD_EFORKED
 * without touching the parent's connection; the child connects again with
 * td_connect. In the child, td_storage_release of a handle made before the
 * fork frees the handle and sends nothing (the parent's reference is
 * untouched; the inherited mapping stays until the child exits or execs),
 * and td_close of an inherited client closes the child's copy of the socket
 * only. The client's socket is close-on-exec. CUDA does not survive fork():
 * once the process has initialised the driver (mapped or created a CUDA
 * storage), the driver allows a child nothing, so in the child every CUDA
 * operation (attach, create, td_copy with a CUDA side, td_storage_wait, a
 * model load onto a GPU) fails with TD_EFORKED, even on the child's own
 * client, and releasing an inherited CUDA storage calls no driver. Fork
 * before the first CUDA call, or spawn. */

#define TD_RDONLY 0x1u /* open or look up for reading only */
#define TD_TAKE 0x2u   /* lookup: unpublish the key atomically */
/* td_create_opts.flags: the caller writes every byte before it reads any
 * (the torch.empty / malloc contract), so the bytes need not be zero; a
 * storage served from tensord's recycling pool then keeps whatever its
 * owner uid last wrote there. Without it a create reads as zeros. */
#define TD_UNINIT 0x4u
/* td_storage_open, td_lookup: a read-only reference (TD_COW implies
 * TD_RDONLY: the daemon sends an O_RDONLY descriptor) mapped copy-on-write
 * (MAP_PRIVATE). The process may write through the mapping without a fault:
 * each page it writes becomes a private copy, seen by no other process and
 * by no other mode's mapping, and lost when the mapping goes. The shared
 * pages stay as they are; the kernel still refuses writes to them. For
 * bindings whose arrays cannot be marked read-only (PyTorch's tensors):
 * a stray write changes only the writer's copy instead of killing it with
 * SIGSEGV. td_storage_is_readonly is 1 for such a handle, and td_copy and
 * td_publish refuse it like any read-only handle. Handles of one storage
 * opened TD_COW in one process share one mapping (a write through one is
 * seen through the others); it is never kept warm (see docs/design.md). */
#define TD_COW 0x8u
/* td_storage_open, td_lookup: map without populating: each page is mapped
 * when first touched, instead of all of them at the first td_storage_data
 * (see "Mappings" in docs/design.md). For a process that attaches far more
 * than it reads soon (weights it serves, a state dict with many tensors):
 * attaching costs no time that grows with the size. Handles of one storage
 * in one mode share a mapping: a later handle without TD_LAZY populates the
 * mapping a lazy one made, and TD_LAZY does not undo a populate done. */
#define TD_LAZY 0x10u

/* Returns the socket path the daemon, the library and tensorctl agree on:
 * $TENSORD_SOCKET, else $XDG_RUNTIME_DIR/tensord.sock, else
 * /tmp/tensord-<uid>/tensord.sock. Writes at most len bytes into buf.
 * Returns 0, or TD_ENAMETOOLONG if the path does not fit in len bytes. */
int td_default_socket_path(char *buf, size_t len);

/* Connects to tensord at socket_path (NULL: the default path) and says Hello.
 * Before sending anything it checks who listens there (SO_PEERCRED): a
 * daemon running as this process's effective uid, as root, or as a uid
 * listed in $TENSORD_TRUST_UID (numeric uids separated by commas); any other
 * is refused with TD_EACCES, naming the socket, the daemon's uid and pid and
 * how to trust it (docs/security.md). A malformed $TENSORD_TRUST_UID is
 * TD_EINVAL. On success *out is a client usable from any thread. On failure
 * *out is NULL and td_last_error(NULL) names the cause. */
int td_connect(const char *socket_path, td_client **out);

/* Client names. A client connects with a name that operators see wherever
 * it is listed: the holders of tensorctl ls and info, the clients of top and
 * metrics --json, the events of watch. At most TD_CLIENT_NAME_MAX bytes of
 * printable ASCII travel (a longer name is cut there; every other byte
 * becomes '?', as tensord shows any byte outside 0x20..0x7e). */
#define TD_CLIENT_NAME_MAX 63

/* How td_connect_ex connects. Zero-initialise, then set. */
typedef struct td_connect_opts {
  /* The client's name, e.g. "train.py worker 1". NULL or "": the default,
   * which is $TENSORD_CLIENT_NAME if set and not empty (for wrappers and
   * launchers to name what they start), else the program's name: for an
   * interpreter (python*, pypy*, perl*, node*, ruby*) the script's base
   * name ("python3 -u train.py" -> "train.py") or the module of -m
   * ("python3 -m torch.distributed.run" -> "torch.distributed.run"); for
   * any other program the base name of argv[0]; and where the process
   * renamed itself (its /proc/self/comm no longer begins like argv[0]) that
   * name, the comm. td_connect uses the default. */
  const char *name;
  uint64_t reserved[7]; /* zero (see ABI above); non-zero is TD_EINVAL */
} td_connect_opts;
/* td_connect with options; o NULL is td_connect. */
int td_connect_ex(const char *socket_path, const td_connect_opts *o,
                  td_client **out);
/* Returns the name c connected with, as tensord shows it (cut and with '?'
 * for other bytes, as above). Valid as long as c. */
const char *td_client_name(const td_client *c);
/* Closes the connection; the daemon drops every reference this client held.
 * Calls other threads are making on c return TD_ENOTCONN at once. Storage
 * handles made by c stay mapped until they are released. NULL ok. */
void td_close(td_client *c);
/* Returns the instance of the daemon c is connected to: a random 64-bit
 * number drawn at each start of tensord (td_stat's instance). Storage ids
 * are per instance: compare instances before using an id learnt through
 * another client. */
uint64_t td_client_instance(const td_client *c);
/* Returns this thread's last failure of a call on c, or of any call when c
 * is NULL (see "Errors" above); "" if none. */
const char *td_last_error(const td_client *c);

/* Creates a storage of nbytes bytes on the CPU, mapped read-write, zeroed,
 * that only its owner (this process's uid) may open: mode 0600. */
int td_storage_create(td_client *c, size_t nbytes, td_storage **out);

/* How td_storage_create_ex makes a storage. Zero-initialise, then set. */
typedef struct td_create_opts {
  size_t nbytes;
  /* Who may open it, as a file's read and write bits for owner, group and
   * other (0666 at most; execute bits are refused). 0 means 0600. The owner
   * is the creating process's uid and gid. Root may open anything. */
  uint32_t mode;
  td_device device; /* TD_CPU, or TD_CUDA (docs/cuda.md) */
  uint64_t flags;   /* TD_UNINIT or 0; other bits are TD_EINVAL */
  /* TD_CUDA: the GPU, as this process numbers it (CUDA_VISIBLE_DEVICES
   * applies); the daemon is told its UUID. TD_CPU: must be 0. */
  int64_t device_index;
  uint64_t reserved[4]; /* zero (see ABI above); non-zero is TD_EINVAL */
} td_create_opts;
int td_storage_create_ex(td_client *c, const td_create_opts *o,
                         td_storage **out);
/* Takes a new reference to storage id; flags: TD_RDONLY maps it read-only
 * (the kernel refuses writes), TD_COW read-only and copy-on-write, TD_LAZY
 * without populating (above); any other bit is TD_EINVAL. */
int td_storage_open(td_client *c, uint64_t id, unsigned flags,
                    td_storage **out);
/* Takes one more reference on the same handle, for a holder that must outlive
 * the caller's (a DLPack deleter, a binding's object). Returns s. */
td_storage *td_storage_retain(td_storage *s);
/* Drops one reference of s; the last drops the daemon's reference and unmaps
 * when the process holds no other handle on the storage (in a forked child,
 * see "Fork" above). Returns 0. NULL ok. */
int td_storage_release(td_storage *s);
uint64_t td_storage_id(const td_storage *s);
size_t td_storage_nbytes(const td_storage *s);
/* The storage's bytes in this process: the mapping for TD_CPU, the device
 * pointer (a CUdeviceptr) for TD_CUDA. */
void *td_storage_data(const td_storage *s);
td_device td_storage_device(const td_storage *s);
/* The ordinal of the storage's GPU in this process (CUDA_VISIBLE_DEVICES
 * applies), or 0 for a CPU storage. */
int td_storage_device_index(const td_storage *s);
/* Copies the 16-byte UUID of the storage's GPU into uuid. Returns 0, or
 * TD_EINVAL for a CPU storage. */
int td_storage_device_uuid(const td_storage *s, uint8_t uuid[16]);
/* Writes a GPU's UUID as nvidia-smi -L and CUDA_VISIBLE_DEVICES name it:
 * "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", or "MIG-..." for a MIG
 * instance (mig non-zero: td_storage_info.device_mig, td_device_stat.mig).
 * buf of TD_UUID_STR_MAX bytes takes it whole. Returns buf. */
#define TD_UUID_STR_MAX 41
char *td_gpu_uuid_str(const uint8_t uuid[16], int mig, char *buf, size_t len);
/* Orders this process after the GPU work the key's publisher recorded in
 * the event it published with (td_publish_opts.event): with stream (a
 * CUstream of this process on the storage's GPU) the stream waits for it
 * (cuStreamWaitEvent: returns at once, work queued after on that stream
 * runs after the producer's); with stream NULL the calling thread blocks
 * until that work is done (cuEventSynchronize). To make the legacy default
 * stream wait, pass CU_STREAM_LEGACY. Returns 0 at once when there is
 * nothing to wait for: a handle not from td_lookup, a key published
 * without an event, a CPU storage. Opens the event (cuIpcOpenEventHandle)
 * for each call; on a key this process published (the driver opens no
 * process's own handle) it waits on the event it published with, which
 * must still exist, as for any waiter. Returns 0, or
 * TD_ENODEV / TD_EINVAL / TD_EIO with the driver's reason. */
int td_storage_wait(td_storage *s, void *stream);
int td_storage_is_readonly(const td_storage *s);
/* Returns the client a storage handle was made by. */
td_client *td_storage_client(const td_storage *s);

/* Publishes a view of s under key (replacing any previous value). v NULL
 * publishes the whole storage as uint8[nbytes]. The key holds its own
 * reference until it is unpublished or replaced. s must be a handle made by
 * c: another client's is TD_EINVAL (td_storage_open its id on c, if c's
 * daemon is the same instance: ids are per daemon). */
int td_publish(td_client *c, const char *key, const td_storage *s,
               const td_view *v);
/* Looks key up; waits up to timeout_ms for it to be published (0: do not
 * wait; -1: wait forever). flags: TD_RDONLY, TD_TAKE, TD_COW, TD_LAZY (any
 * other bit is TD_EINVAL). On success *s is a new handle and *v (if not NULL)
 * the published view. */
int td_lookup(td_client *c, const char *key, unsigned flags, int timeout_ms,
              td_storage **s, td_view *v);

/* The most keys one td_lookup_many call may name. */
#define TD_LOOKUP_MANY_MAX 65536
/* Looks up n keys in one round trip: what attaching a model published
 * tensor by tensor ("model/layers.0.wq", ...) wants, where n td_lookup
 * calls would cost n round trips. An array of keys rather than a prefix:
 * the caller knows the names it needs (a model's parameter list), gets
 * them back in its own order, and never picks up a stray key that happens
 * to share the prefix (use td_watch or tensorctl ls to discover keys).
 *
 * Each key is answered as td_lookup(c, keys[i], flags, 0, ...) would be,
 * all at one instant of the daemon's registry: out[i] is a new handle (and
 * views[i], if views is not NULL, the published view), with access,
 * limits and references exactly as for td_lookup; a storage named by
 * several keys (a checkpoint shard whose tensors are views of it) is
 * mapped once. flags: TD_RDONLY, TD_COW, TD_LAZY (TD_TAKE and any other
 * bit are TD_EINVAL).
 *
 * Errors per key. With errs not NULL, a key that cannot be looked up
 * fails alone: errs[i] is its code (0 for a key found), out[i] NULL, and
 * the others are looked up; the call returns 0 if every key was found,
 * else the code of the first key that was not, with td_last_error naming
 * that key, its cause and how many keys failed. With errs NULL the call is
 * all or nothing: if any key fails, every handle it made is released,
 * every out[i] is NULL, and the first key's failure is returned.
 *
 * Waiting. timeout_ms 0 answers at once (a key not published is
 * TD_ENOENT). Otherwise keys not published at the first answer are waited
 * for, one after another, until timeout_ms (-1: forever) has passed since
 * the call began; a key still missing then is TD_ETIMEDOUT. Only keys that
 * were missing cost more round trips.
 *
 * n 0 returns 0 at once; n above TD_LOOKUP_MANY_MAX, keys or out NULL, or a
 * NULL keys[i] are TD_EINVAL for the whole call (every out[i] NULL, each
 * errs[i] that code; of an n too large, only the first TD_LOOKUP_MANY_MAX
 * + 1 entries are written). A failure of the connection fails every key
 * not yet answered. Keys of more bytes than one request may carry (about
 * 768 KiB) go in as many requests as they need, one after another.
 * Thread-safe as every call on c; a reply's fds are mapped and closed as
 * they arrive (another thread reading c's replies holds back while a few
 * of its frames wait), so n is not bounded by the process's fd limit. */
int td_lookup_many(td_client *c, const char *const *keys, size_t n,
                   unsigned flags, int timeout_ms, td_storage **out,
                   td_view *views, int *errs);
int td_unpublish(td_client *c, const char *key);

/* Scopes: keys in flight from one process to another, which must survive
 * their publisher but not the process meant to receive them (a worker's
 * batch on its way to the training process, a tensor in a
 * torch.multiprocessing queue). A scope belongs to the connection that
 * opened it and ends when that connection calls td_scope_close or closes,
 * however it closes (a SIGKILL included). A key published into a scope
 * (td_publish_ex) is an ordinary key while it lasts (lookup, wait, take,
 * unpublish, listings), but it is never written to a --state-dir journal,
 * and when its scope ends the daemon unpublishes it, dropping its reference.
 * Replacing a scoped key with td_publish makes it an ordinary key. */

/* Opens a scope owned by c; *token gets its name, 64 random bits, to hand
 * to the processes that will publish into it (they must run as c's uid, or
 * as root). Returns 0, TD_EMFILE past the daemon's scopes per connection. */
int td_scope_open(td_client *c, uint64_t *token);
/* Ends scope token, which c must own (TD_ENOENT if it does not, or if it has
 * ended): every key still in it is unpublished. *dropped (if not NULL) gets
 * how many. */
int td_scope_close(td_client *c, uint64_t token, uint64_t *dropped);

/* How td_publish_ex publishes. Zero-initialise, then set. */
typedef struct td_publish_opts {
  /* A td_scope_open token: the key goes when the scope ends, and the
   * publish refuses with TD_EEXIST to replace a key that exists already
   * (one-shot keys must not clobber others). TD_ENOENT if the scope has
   * ended, TD_EACCES if its owner runs as another uid. 0: an ordinary key
   * (td_publish). */
  uint64_t scope;
  /* A CUevent made with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING and
   * recorded (cuEventRecord) on the stream that wrote the storage, after
   * its last write: its IPC handle (cuIpcGetEventHandle) travels with the
   * key, and a consumer that looks the key up waits on it with
   * td_storage_wait. Only for a CUDA storage (TD_EINVAL otherwise). The
   * handle names the event, not one recording of it: record it again only
   * when consumers may see the new work. NULL: no event (the producer
   * synchronised before publishing). */
  void *event;
  uint64_t reserved[6]; /* zero (see ABI above); non-zero is TD_EINVAL */
} td_publish_opts;
/* td_publish with options; o NULL is td_publish. */
int td_publish_ex(td_client *c, const char *key, const td_storage *s,
                  const td_view *v, const td_publish_opts *o);
/* Round trip to the daemon; *rtt_ns (if not NULL) gets the time it took. */
int td_ping(td_client *c, uint64_t *rtt_ns);

/* What a live upgrade did (td_upgrade). */
typedef struct td_upgrade_info {
  int32_t old_pid, new_pid;
  char old_version[32], new_version[32];
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_upgrade_info;
/* Asks the daemon to upgrade itself live: it starts binary (NULL: the path
 * it was started from) with its own arguments plus --upgrade, hands every
 * client, storage, key and waiter to it, and exits. Returns once the new
 * daemon serves, with *out (if not NULL) filled; or the error that stopped
 * it (the old daemon then serves on; td_last_error says why). Only the
 * daemon's uid or root may ask (TD_EPERM); the connection must hold
 * nothing (TD_EBUSY). This connection is closed by the old daemon's exit:
 * close c afterwards. */
int td_upgrade(td_client *c, const char *binary, td_upgrade_info *out);

/* Introspection, as used by tensorctl. */
typedef struct td_holder {
  int32_t pid;
  uint32_t uid;
  uint32_t refs; /* references this process's connection holds */
  /* The name the client connected with (its Hello; libtensord's rule is
   * td_connect_opts.name's), printable ASCII; "" if none. Valid as long as
   * the td_storage_info. */
  const char *name;
  uint64_t reserved[1]; /* zero (see ABI above) */
} td_holder;

typedef struct td_storage_info {
  uint64_t id;
  uint64_t nbytes;
  td_device device;
  uint32_t refs; /* every reference: holders' and keys' */
  int32_t owner_pid;
  uint32_t owner_uid;
  uint32_t owner_gid;
  uint32_t mode; /* rw bits for owner, group, other */
  int64_t created_unix_ms;
  size_t nholders;
  const td_holder *holders;
  size_t nkeys;       /* keys listed in keys[] */
  size_t nkeys_total; /* keys naming the storage (LIST shows 32 at most) */
  const char *const *keys;
  uint8_t device_uuid[16]; /* TD_CUDA: the GPU's UUID; zeros for TD_CPU */
  uint32_t device_mig;     /* 1: the GPU is a MIG instance (td_gpu_uuid_str) */
  uint32_t reserved32;     /* zero */
  uint64_t reserved[5];    /* zero (see ABI above) */
} td_storage_info;

typedef struct td_key_info {
  const char *key;
  uint64_t id;
  td_view view;
  int64_t published_unix_ms;
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_key_info;

typedef struct td_stat {
  uint64_t storages;
  uint64_t bytes_used;
  uint64_t capacity;
  uint64_t shm_free; /* free bytes in /dev/shm as the daemon sees them */
  uint64_t clients;
  uint64_t keys;
  uint64_t waiters;
  int64_t uptime_ms;
  int32_t pid;
  uint64_t instance; /* segments: /dev/shm/tensord.<instance, %016x>.<id>-... */
  uint64_t quota;    /* bytes per uid; 0: none */
  uint32_t max_clients;
  uint32_t max_storages_per_client;
  char state_dir[256]; /* "": keys do not survive a restart */
  char version[32];
  char socket[256];
  /* The recycling pool (docs/design.md): freed segments kept for the next
   * create of their owner uid. They are not storages (no id, not listed)
   * and count against the capacity, not against any quota. */
  uint64_t pool_segments;
  uint64_t pool_bytes;
  uint64_t pool_limit;  /* --recycle-bytes; 0: recycling is off */
  uint64_t pool_hits;   /* creates served from the pool */
  uint64_t pool_misses; /* creates of a poolable size it could not serve */
  /* The daemon's own memory: its resident set (/proc/self/statm) and the
   * bytes malloc has handed it (mallinfo2; 0 where malloc does not say, as
   * under a sanitizer); both 0 from a daemon that does not say. Storages'
   * bytes are in neither unless the daemon maps them. */
  uint64_t daemon_rss_bytes;
  uint64_t daemon_heap_bytes;
  uint64_t reserved[1]; /* zero (see ABI above) */
} td_stat;

/* Called once per live storage, in id order; a non-zero return stops the
 * listing and td_list returns it. info is valid during the call only. */
typedef int (*td_list_cb)(const td_storage_info *info, void *arg);
int td_list(td_client *c, td_list_cb cb, void *arg);
int td_stat_get(td_client *c, td_stat *out);
/* What the daemon holds on one GPU (td_stat_devices). */
typedef struct td_device_stat {
  td_device device;    /* TD_CUDA */
  int32_t index;       /* the daemon's ordinal of the GPU */
  uint8_t uuid[16];    /* the GPU's UUID */
  uint64_t bytes_used; /* allocated: sizes rounded up to the granularity */
  uint64_t capacity;   /* --cuda-capacity, or the device's total memory */
  uint64_t storages;
  uint32_t mig;        /* 1: a MIG instance (td_gpu_uuid_str) */
  uint32_t reserved32; /* zero */
  /* Freed allocations the daemon keeps for its uid's next create of that
   * size (--cuda-recycle-bytes), counted against capacity too. */
  uint64_t pool_bytes;
  uint64_t pool_allocs;
  uint64_t reserved[1]; /* zero (see ABI above) */
} td_device_stat;
/* Fills out[0..max) with the daemon's GPUs, in its ordinal order, and sets
 * *n to how many it has (which may exceed max). A daemon lists GPUs once its
 * CUDA driver is loaded (its first CUDA create). */
int td_stat_devices(td_client *c, td_device_stat *out, size_t max, size_t *n);
#define TD_PREFIX_MAX 64 /* bytes of a segment name prefix, with its NUL */
/* Fills out[0..max) with the name prefixes of the daemon's segments in
 * /dev/shm, as "/tensord.<hex>." (its own instance's and its recycling
 * pool's first, then those of the segments it adopted from earlier instances
 * through --state-dir, which keep the names they were made with), and sets
 * *n to how many it has (which may exceed max; out may be NULL when max is
 * 0). A segment under one of these is live: removing it by hand destroys
 * data (docs/operations.md). */
int td_stat_prefixes(td_client *c, char (*out)[TD_PREFIX_MAX], size_t max,
                     size_t *n);
/* Describes one storage (by id) and every key that names it. Exactly one of
 * id (non-zero) and key (non-NULL) selects it. Callbacks as for td_list;
 * keys get kcb (may be NULL). */
typedef int (*td_key_cb)(const td_key_info *info, void *arg);
int td_info(td_client *c, uint64_t id, const char *key, td_list_cb scb,
            td_key_cb kcb, void *arg);

/* One connected client, as td_metrics_get describes it. */
typedef struct td_client_stat {
  int32_t pid;
  uint32_t uid;
  char name[64];        /* the name it connected with (printable ASCII) */
  uint64_t requests;    /* requests it has sent */
  uint64_t refs;        /* references it holds */
  uint64_t bytes_held;  /* bytes of the storages it holds */
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_client_stat;

/* The daemon's metrics (td_metrics_get; free with td_metrics_free). */
typedef struct td_metrics {
  char *text; /* Prometheus text exposition format 0.0.4 ("" when
                 TD_METRICS_NO_TEXT), what tensord --metrics serves */
  size_t text_len;
  uint64_t requests; /* requests served since the start, all clients */
  int64_t uptime_ms;
  uint64_t storages; /* CPU storages, as td_stat */
  uint64_t bytes_used;
  uint64_t capacity;
  uint64_t clients_total; /* connected clients */
  size_t nclients;        /* in clients[]: at most 1024, busiest first */
  td_client_stat *clients;
  size_t nlargest;          /* in largest[], largest first */
  td_storage_info *largest; /* as td_list gives them, at most 4 keys each */
  uint64_t reserved[8];     /* zero (see ABI above) */
} td_metrics;

#define TD_METRICS_NO_TEXT 1u /* leave text empty: only the figures */

/* Asks tensord for its metrics and the largest storages, at most largest
 * (0 to 64) of them. On success *out is the caller's to free with
 * td_metrics_free; on failure *out is NULL. */
int td_metrics_get(td_client *c, unsigned largest, unsigned flags,
                   td_metrics **out);
/* Frees m and everything it points to. NULL ok. */
void td_metrics_free(td_metrics *m);
/* ---- models: safetensors checkpoints (docs/models.md) ---- */
/* A model NAME is a checkpoint (one .safetensors file, or the shards a
 * *.index.json names) loaded into tensord once per machine: one storage per
 * shard holding the shard file's bytes verbatim (so each is itself a valid
 * safetensors file, published as NAME@V/<shard file>), each tensor a view
 * of its shard (published as NAME/<tensor>), and the manifest at NAME
 * (docs/models.md gives its format), the one key readers attach through.
 * Loading NAME again makes version V + 1 and switches to it atomically: a
 * reader that attaches NAME (td_model_open) gets every tensor of one
 * version, never a mix; an old version lives while anyone holds one of its
 * storages. Every call below is safe from any thread (each on its own
 * client or sharing one); jansson's memory for a checkpoint's untrusted
 * headers is bounded per parse (docs/models.md says how). */

/* td_load_opts.flags: load even if NAME already holds this source. */
#define TD_MODEL_FORCE 0x1u

/* How far a load is. */
typedef struct td_load_progress {
  uint64_t bytes_done, bytes_total;
  uint32_t shards_done, shards_total;
} td_load_progress;
/* Called from the thread that called td_model_load, at most every ~50 ms
 * while it reads and once at the end. */
typedef void (*td_load_progress_cb)(const td_load_progress *p, void *arg);

/* How td_model_load loads. Zero-initialise, then set. */
typedef struct td_load_opts {
  td_device device;     /* TD_CPU (default) or TD_CUDA */
  int64_t device_index; /* TD_CUDA: the GPU, as this process numbers it */
  uint32_t mode;    /* the storages' mode, as td_create_opts.mode; 0: 0600 */
  uint32_t flags;   /* TD_MODEL_FORCE */
  uint32_t threads; /* parallel readers, 1 to 64; 0: one per CPU, 2 to 8 */
  /* Another process is loading NAME: wait this long for it (ms); -1:
   * forever; 0: TD_EBUSY at once, naming its pid. */
  int32_t wait_ms;
  td_load_progress_cb progress; /* NULL: none */
  void *progress_arg;
  uint64_t reserved[4]; /* zero (see ABI above); non-zero is TD_EINVAL */
} td_load_opts;

/* What td_model_load did. */
typedef struct td_load_result {
  uint64_t version; /* NAME's version now */
  uint64_t tensors, bytes;
  uint32_t shards;
  int unchanged;  /* NAME already held this source: nothing was loaded */
  int waited;     /* another process held NAME's load lock first */
  double seconds; /* wall time of the reads and the publishes */
} td_load_result;

/* Loads the checkpoint at path into tensord as model name: path is a
 * .safetensors file, a *.index.json, or a directory holding
 * model.safetensors.index.json (first) or exactly one .safetensors file.
 * name NULL derives one from path: a file's stem ("model.safetensors" ->
 * "model"), else (an index json, a directory) the directory's name. name
 * must be a valid key without '@', and every key derived from it (with
 * each tensor's and shard's name) must fit TD_KEY_MAX. o and out may be
 * NULL.
 * Everything is checked before anything is made (every rule of the
 * safetensors format; docs/models.md): a failure names the file, the
 * tensor and the field, returns TD_EINVAL (TD_ENOENT for a missing file),
 * and leaves nothing in tensord, no key and no storage. Then it takes
 * NAME's load lock (NAME@loading, held by this connection: a loader that
 * dies releases it), waiting as o->wait_ms says (TD_EBUSY, TD_ETIMEDOUT);
 * if NAME already holds this source (the same path, and each file's size
 * and mtime) and TD_MODEL_FORCE is not set, it does nothing and says so in
 * out->unchanged. Else it copies every shard straight into a new storage
 * (spliced into its segment, no buffer; o->threads at once), checks that
 * no file changed while read (TD_EAGAIN), publishes the shards, switches
 * NAME to the new version, publishes the tensors' keys and unpublishes the
 * old version's.
 * A failure before the switch leaves nothing; one after it (a tensor key
 * that could not be published) returns the error with NAME switched.
 * With o->device TD_CUDA each shard is one daemon-owned CUDA storage on
 * this process's GPU o->device_index (TD_ENODEV: no driver, no such GPU,
 * checked before anything is made): the shards are read into a pinned
 * host staging buffer of at most 256 MiB whatever the model (less for a
 * smaller model; $TENSORD_LOAD_STAGING sets a lower bound, e.g. "64M",
 * TD_EINVAL if it is no size) and copied to the device asynchronously,
 * each slot's copy overlapping the next read; the header bytes are read
 * back from the device for the final check. The manifest records device
 * "cuda", the loader's device_index and the GPU's device_uuid; a source
 * already loaded on another device (or GPU) is loaded again there as a new
 * version. td_model_open then attaches the same device memory in every
 * process (td_storage_data is a device pointer; TD_LAZY changes nothing,
 * TD_COW maps read-only as TD_RDONLY does). */
int td_model_load(td_client *c, const char *path, const char *name,
                  const td_load_opts *o, td_load_result *out);

/* The name td_model_load gives a model loaded from path without one, into
 * buf (len bytes; TD_KEY_MAX + 1 is enough): a file's stem, else the
 * directory's name (as td_model_load says). Looks at path (whether it is a
 * directory) but reads no file. Returns 0, or TD_ENOENT (no such path) or
 * TD_EINVAL (no name fits buf) with the reason for td_last_error(NULL). */
int td_model_default_name(const char *path, char *buf, size_t len);

/* Writes model name as safetensors: with one shard out is the file (or,
 * if out is a directory, out/<shard file>); with several out is a
 * directory (made if missing) of the shard files and
 * model.safetensors.index.json. Shards are written verbatim (their bytes
 * as loaded). name may also be a key of tensord.torch.publish_state_dict
 * whose tensors are dense (contiguous, of a dtype safetensors has): out is
 * then one file, each name its own copy of its bytes (tied tensors
 * included); any other is refused with TD_EINVAL naming the tensor. Each
 * file is written to a temporary name in its directory, synced and
 * renamed, so out is whole or as it was. flags: 0. */
int td_model_save(td_client *c, const char *name, const char *out,
                  unsigned flags);

/* Unpublishes the manifest, the tensor keys and the shard keys of every
 * version of name (storages go when their last holder lets go). Takes the
 * load lock: TD_EBUSY, naming its pid, while a load of name runs;
 * TD_ENOENT if there is no such model. */
int td_model_unload(td_client *c, const char *name);

/* One version of a model, attached. */
typedef struct td_model td_model;
/* Attaches model name: the manifest at name (waiting up to timeout_ms for
 * it, as td_lookup), then each shard's storage with flags (TD_RDONLY,
 * TD_COW, TD_LAZY, as td_lookup). Every tensor is of one version: where a
 * newer version replaced this one meanwhile it starts again (TD_EAGAIN
 * "kept changing" after 100 tries). The manifest is checked as untrusted
 * bytes (TD_EINVAL if it is no model's). On success *out is the caller's,
 * to td_model_close; on failure it is NULL. */
int td_model_open(td_client *c, const char *name, unsigned flags,
                  int timeout_ms, td_model **out);
uint64_t td_model_version(const td_model *m);
/* The number of tensors. */
size_t td_model_count(const td_model *m);
/* The i-th tensor (the checkpoint's order): its name, its storage
 * (borrowed: valid while m is open; td_storage_retain to keep it longer)
 * and its view. Any of name, s, v may be NULL. TD_ERANGE if i is past the
 * count. */
int td_model_tensor(const td_model *m, size_t i, const char **name,
                    td_storage **s, td_view *v);
/* The tensor called name, as td_model_tensor; TD_ENOENT if none. */
int td_model_find(const td_model *m, const char *name, td_storage **s,
                  td_view *v);
/* The manifest's JSON text (valid while m is open). */
const char *td_model_manifest(const td_model *m);
/* Releases m's storages and frees it. NULL ok. */
void td_model_close(td_model *m);
/* ---- end of models ---- */

/* ---- state dicts (tensord.torch.publish_state_dict; docs/python.md) ---- */
/* publish_state_dict publishes a PyTorch state dict under one key as a
 * blob: a view uint8[n], one dense dim, whose bytes are TD_STATE_DICT_MAGIC,
 * the manifest's length (little-endian u64), the manifest (JSON: each
 * tensor's dtype, shape, strides, storage offset and region; each region's
 * offset and size in bytes) and the regions' bytes. These read one in C,
 * as tensorctl info and show do, checking every byte of it as untrusted
 * (at most 2^18 tensors and regions, 256 MiB of manifest, 1 GiB for its
 * JSON while it is read). A parsed td_state_dict is read-only: any number
 * of threads may read it at once. */
#define TD_STATE_DICT_MAGIC "TDSTATE1"
#define TD_STATE_DICT_NAME_MAX 4096 /* longest tensor name, in bytes */

typedef struct td_state_dict td_state_dict;

/* Returns 1 if view v of storage s could hold a state dict: v is one dense
 * uint8 dim of at least 16 bytes and, unless s is NULL, lies inside s, a
 * CPU storage, where its bytes begin with TD_STATE_DICT_MAGIC; else 0.
 * With s NULL it judges by v alone: whether s is worth mapping to look. */
int td_state_dict_is(const td_storage *s, const td_view *v);
/* Parses the blob that view v of storage s holds and checks all of it:
 * every count, length, offset and size against the blob, every region
 * inside it and every tensor of a dtype tensord has inside its region (as
 * load_state_dict takes it); the manifest must be JSON (UTF-8) without
 * duplicate keys, NUL in strings or integers past int64; unknown fields
 * are skipped. Returns 0 with *out the caller's, to td_state_dict_free; or
 * TD_EINVAL (v holds no state dict or a corrupt one), TD_ERANGE (v does
 * not fit s), TD_ENODEV (s is a GPU's, or a region lies on a GPU, in a
 * storage of its own: only Python's load_state_dict reads those) or
 * TD_ENOMEM, with the reason for td_last_error(NULL) naming the tensor or
 * region and the field; *out is NULL on failure. sd holds no reference to
 * s: keep s while you read the tensors' bytes. */
int td_state_dict_parse(const td_storage *s, const td_view *v,
                        td_state_dict **out);
/* Frees sd. NULL ok. */
void td_state_dict_free(td_state_dict *sd);
/* The number of tensors, and of regions. */
size_t td_state_dict_count(const td_state_dict *sd);
size_t td_state_dict_nregions(const td_state_dict *sd);

/* One tensor, as the manifest describes it (td_state_dict_tensor). */
typedef struct td_state_dict_entry {
  const char *name;       /* UTF-8, no NUL; valid while sd is */
  const char *dtype_name; /* PyTorch's, also of a dtype tensord has not
                             ("qint8"); valid while sd is */
  td_dtype dtype;         /* TD_DTYPE_INVALID for such a dtype */
  int32_t ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t stride[TD_MAX_DIMS]; /* in elements */
  int64_t storage_offset;      /* in elements, from its region's start */
  uint32_t region;             /* the index of its region */
  uint32_t itemsize;    /* bytes of one element; 0 where they are not known */
  uint64_t nbytes;      /* elements times itemsize */
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_state_dict_entry;

/* Fills *out with tensor i (the manifest's order). Returns 0, or TD_ERANGE
 * if i is past the count. */
int td_state_dict_tensor(const td_state_dict *sd, size_t i,
                         td_state_dict_entry *out);
/* Sets *i to the index of the tensor called name. Returns 0, or TD_ENOENT
 * if there is none. */
int td_state_dict_find(const td_state_dict *sd, const char *name, size_t *i);
/* Sets *offset and *nbytes (either may be NULL) to where region i lies, in
 * bytes from the blob's start. Returns 0, or TD_ERANGE if i is past the
 * count. */
int td_state_dict_region(const td_state_dict *sd, size_t i, uint64_t *offset,
                         uint64_t *nbytes);
/* Sets *v to tensor i's view of the storage the blob was parsed from, as
 * load_state_dict makes it (it passes td_view_check against that storage).
 * Returns 0, or TD_ERANGE if i is past the count, or TD_EINVAL for a dtype
 * tensord does not read or a region not aligned to its dtype, with the
 * reason for td_last_error(NULL); *v is unchanged on failure. */
int td_state_dict_view(const td_state_dict *sd, size_t i, td_view *v);
/* ---- end of state dicts ---- */

/* ---- events (tensorctl watch; docs/protocol.md) ---- */
/* A watch is a connection of its own that receives what happens in the
 * daemon as it happens, for debugging a pipeline. The daemon never waits for
 * a watcher: a watcher that reads too slowly loses events, and the next one
 * it gets says how many (dropped). */

/* What happened. Values never change; expect ones you do not know. */
typedef enum {
  TD_EVENT_CREATE = 1,     /* a storage was made: id, nbytes, device */
  TD_EVENT_PUBLISH = 2,    /* key now names storage id */
  TD_EVENT_TAKE = 3,       /* a lookup took key (unpublished it) */
  TD_EVENT_UNPUBLISH = 4,  /* key was unpublished */
  TD_EVENT_FREE = 5,       /* storage id's last reference went */
  TD_EVENT_CONNECT = 6,    /* a client said Hello */
  TD_EVENT_DISCONNECT = 7, /* a client went; message says why */
  TD_EVENT_REFUSED = 8,    /* a request failed: code, message */
  TD_EVENT_LOOKUP = 9,     /* a lookup (not a take) got key */
} td_event_type;

/* One event. Fields that do not apply to its type are 0 or "". Strings are
 * valid until the next td_watch_next or td_watch_close. */
typedef struct td_event {
  td_event_type type;
  int32_t pid;  /* the client that caused it (FREE: see docs/cli.md) */
  uint32_t uid; /* its uid */
  int32_t code; /* REFUSED: the negative TD_E* code */
  int64_t unix_ms;
  uint64_t id; /* the storage */
  uint64_t nbytes;
  td_device device;
  const char *key;      /* the key, or "" */
  const char *name;     /* the client's name (its Hello), or "" */
  const char *message;  /* REFUSED: the daemon's message; DISCONNECT: why */
  uint64_t dropped;     /* events lost before this one (watcher too slow) */
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_event;

typedef struct td_watch td_watch;

/* Connects to tensord at socket_path (NULL: the default path, with
 * td_connect's checks) and watches the events whose key begins with prefix
 * (NULL or "": every event, those without a key too; with a prefix, only
 * events that name a key). On failure *out is NULL and td_last_error(NULL)
 * names the cause. A watch is used by one thread at a time. */
int td_watch_open(const char *socket_path, const char *prefix, td_watch **out);
/* Waits up to timeout_ms (-1: forever) for the next event and fills *ev.
 * Returns 0, TD_ETIMEDOUT if none came, TD_EAGAIN if a signal interrupted
 * the wait (call again, or stop), TD_ECONNRESET once tensord has gone, or
 * TD_EPROTO for a frame that is not an event. */
int td_watch_next(td_watch *w, int timeout_ms, td_event *ev);
/* The socket, for poll(): readable when td_watch_next may have an event. */
int td_watch_fd(const td_watch *w);
/* Ends the watch and frees w. NULL ok. */
void td_watch_close(td_watch *w);
/* "create", "publish", ...; "unknown" for a value this library does not
 * know. Never NULL. */
const char *td_event_type_name(int type);

/* Channels (docs/channels.md): a named, bounded FIFO of storages, each with
 * its view, from the processes that send to the processes that receive,
 * carried by a ring in shared memory that every end maps, with futex
 * wake-ups. A channel may own slots: storages of slot_bytes each, made at
 * create, that every end maps once at open. A producer loans a free slot,
 * writes it and sends it; a consumer receives it and, when it releases the
 * handle (td_storage_release), the slot is free again. Sending a slot moves
 * an index and a view through the ring: no socket, no fd, no daemon call.
 * Any other storage may be sent too: its reference moves to the channel
 * and on to the receiver through tensord (two round trips), still counted.
 *
 * A channel is a holder: the slots, and the storages sent and not yet
 * received, are references of the channel, and tensorctl ls shows them as
 * "chan:NAME". A channel lives while any end is open; the last close (or
 * the last holder dying) frees it with its slots. A process that dies gives
 * back every slot it had on loan or received, and drops what it held.
 *
 * Access is by mode, like a storage's: the write bit admits senders, the
 * read bit receivers (0600 by default: the creator's uid only). Slots are
 * mapped read-write by ends that send, read-only by ends that only
 * receive. A td_chan may be used from several threads at once. */
typedef struct td_chan td_chan;

#define TD_CHAN_SEND 0x1u           /* this end sends (loan, send) */
#define TD_CHAN_RECV 0x2u           /* this end receives */
#define TD_CHAN_CAPACITY_MAX 65536u /* entries a ring holds, at most */
#define TD_CHAN_SLOTS_MAX 1024u     /* slots a channel owns, at most */

typedef struct td_chan_opts {
  uint32_t capacity;   /* entries the ring holds (0: 64; rounded up to a
                          power of two) */
  uint32_t slots;      /* slots the channel owns (0: none) */
  uint64_t slot_bytes; /* each slot's size (> 0 with slots) */
  uint32_t mode;       /* rw bits for owner, group, other: 0 means 0600 */
  uint32_t flags;      /* the creator's side: TD_CHAN_SEND, TD_CHAN_RECV, or
                          both (0 means both) */
  uint32_t spin_us;    /* this end spins this long before it sleeps */
  uint32_t reserved32;
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_chan_opts;

/* Creates the channel name (a key's rules: 1-255 bytes of UTF-8 without
 * NUL; channels and keys are separate names) and opens its first end.
 * TD_EEXIST if a channel of that name is open. The slots are storages of
 * the creator, counted against its capacity and quota. */
int td_chan_create(td_client *c, const char *name, const td_chan_opts *o,
                   td_chan **out);
/* Opens an end of the channel name on the side(s) flags asks
 * (TD_CHAN_SEND and/or TD_CHAN_RECV; 0 means both), waiting up to
 * timeout_ms (-1: forever, 0: not at all) for it to be created. TD_ENOENT
 * (timeout 0) or TD_ETIMEDOUT if it is not; TD_EACCES if its mode does not
 * admit this process on that side. */
int td_chan_open(td_client *c, const char *name, unsigned flags, int timeout_ms,
                 td_chan **out);
/* Sets how long this end spins on the ring before sleeping on a futex, in
 * microseconds (0: never spins). For consumers that must see a handoff
 * within a microsecond and may burn a CPU for it. */
void td_chan_set_spin(td_chan *ch, uint32_t spin_us);
/* Loans a free slot, mapped read-write, waiting up to timeout_ms for one.
 * Send it, or release it to give it back. TD_ENOENT if the channel has no
 * slots, TD_EPERM if this end does not send, TD_ETIMEDOUT, TD_EPIPE once
 * every receiver has left. */
int td_chan_loan(td_chan *ch, int timeout_ms, td_storage **out);
/* Sends view v of s, waiting up to timeout_ms while the ring is full. On
 * success the caller's reference (s) is the channel's: do not release it.
 * On failure the caller still owns s. A slot of this channel travels as an
 * index; any other storage travels through tensord (the reference moves).
 * v is checked against s (TD_ERANGE). TD_EPIPE once every receiver has
 * left; TD_ETIMEDOUT; TD_EPROTO if the ring is corrupt (the channel is
 * then closed for everyone, named in the message). */
int td_chan_send(td_chan *ch, td_storage *s, const td_view *v, int timeout_ms);
/* Receives the oldest entry, waiting up to timeout_ms: the caller gets a
 * reference (*out, to release) and its view (*v). A slot comes mapped
 * read-only unless this end also sends. TD_EPIPE once the ring is empty and
 * every sender has left; TD_ETIMEDOUT; TD_EPROTO if the ring is corrupt. */
int td_chan_recv(td_chan *ch, int timeout_ms, td_storage **out, td_view *v);
/* Leaves the channel: the other side sees TD_EPIPE once all of this side
 * have left. Handles the end loaned or received stay valid until released
 * (the slots go back then). NULL ok. */
void td_chan_close(td_chan *ch);

/* An end of a channel, as tensord lists it. */
typedef struct td_chan_end_info {
  uint32_t end;
  int32_t pid;
  uint32_t uid;
  const char *name; /* the client's name (td_connect_opts.name) */
  uint32_t flags;   /* TD_CHAN_SEND | TD_CHAN_RECV */
  int left;         /* it closed, and still has slots out */
  uint32_t loaned;  /* slots it has on loan, and received */
  uint32_t held;
  uint64_t reserved[2]; /* zero (see ABI above) */
} td_chan_end_info;

/* A channel as one end sees it (td_chan_stat), or as tensord lists it
 * (td_chan_list: with its ends, 64 at most, and its slots' storage ids). */
typedef struct td_chan_info {
  const char *name; /* valid as long as the td_chan / during the callback */
  uint64_t id;
  uint32_t capacity;   /* entries */
  uint32_t depth;      /* entries in the ring now */
  uint32_t slots;      /* slots in all */
  uint32_t slots_free; /* ... free, on loan, in the ring, held by receivers */
  uint32_t slots_loaned;
  uint32_t slots_queued;
  uint32_t slots_held;
  uint32_t senders; /* ends open on each side now */
  uint32_t receivers;
  uint32_t mode;
  uint64_t slot_bytes;
  uint32_t owner_uid;
  int32_t owner_pid;
  uint64_t in_flight; /* storages sent (not slots) that no one received yet */
  int corrupt;        /* closed: its ring was found corrupt */
  uint32_t reserved32;
  uint64_t sent; /* entries pushed and popped since it was created */
  uint64_t received;
  size_t nends; /* td_chan_list only */
  const td_chan_end_info *ends;
  size_t nslot_ids;
  const uint64_t *slot_ids;
  uint64_t reserved[4]; /* zero (see ABI above) */
} td_chan_info;

/* What ch's ring says now (read from shared memory, without tensord). */
int td_chan_stat(td_chan *ch, td_chan_info *out);
/* Calls cb once per channel tensord has (as tensorctl ls shows them); a
 * non-zero return from cb stops the listing and is returned. */
typedef int (*td_chan_cb)(const td_chan_info *info, void *arg);
int td_chan_list(td_client *c, td_chan_cb cb, void *arg);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif /* TENSORD_H */

/* statedict.h: the packed state dicts of tensord.torch.publish_state_dict,
 * read from untrusted bytes for td_model_save and td_state_dict_parse
 * (docs/python.md gives the format). Private to libtensord and its tests. */
#ifndef TD_CLIENT_STATEDICT_H
#define TD_CLIENT_STATEDICT_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>

/* The format: TD__SD_MAGIC, the manifest's length n (little-endian u64),
 * then n bytes of JSON: {"tensors": {NAME: {"dtype", "shape", "stride",
 * "storage_offset", "region"}}, "regions": [{"offset", "nbytes"}]}, offsets
 * and sizes in bytes from the start of the blob, shape, strides and
 * storage_offset in elements of the dtype from the start of the region. */
#define TD__SD_MAGIC TD_STATE_DICT_MAGIC
#define TD__SD_HEADER 16 /* the magic and the manifest's length */

/* Bounds on what a manifest may hold, whatever the blob's size: reading a
 * corrupt one costs at most this much memory and time. */
#define TD__SD_MANIFEST_MAX ((uint64_t)256 << 20) /* bytes of JSON */
#define TD__SD_TENSORS_MAX (1u << 18) /* ~350 bytes each in memory */
#define TD__SD_REGIONS_MAX (1u << 18)
#define TD__SD_NAME_MAX TD_STATE_DICT_NAME_MAX /* bytes of a name (UTF-8) */
#define TD__SD_DTYPE_MAX 31  /* bytes of a dtype's name */
/* Bytes the manifest's JSON tree (jansson's) may take while it is read: a
 * manifest within the bounds above takes at most ~700 MiB (2^18 tensors of
 * 16 dims and 2^18 regions), a hostile one up to 80 times its bytes. */
#define TD__SD_TREE_MAX ((size_t)1 << 30)

/* The bound on the tree in force, TD__SD_TREE_MAX; tests lower it. */
extern size_t td__sd_tree_max;

typedef struct td__sd_tensor {
  char *name; /* UTF-8, no NUL inside */
  char dtype_name[TD__SD_DTYPE_MAX + 1];
  td_dtype dtype;  /* TD_DTYPE_INVALID: one tensord does not have */
  size_t itemsize; /* 0 if not known */
  int32_t ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t stride[TD_MAX_DIMS];
  int64_t storage_offset; /* elements, from its region's start */
  uint32_t region;
  int64_t numel;
  uint64_t nbytes; /* numel * itemsize; 0 if the itemsize is not known */
} td__sd_tensor;

typedef struct td__sd_region {
  uint64_t offset, nbytes; /* bytes, from the blob's start */
} td__sd_region;

typedef struct td__statedict {
  size_t ntensors, nregions;
  td__sd_tensor *tensors; /* in the manifest's order */
  td__sd_region *regions;
  uint64_t manifest_len;
} td__statedict;

/* Whether the n bytes at p begin with TD__SD_MAGIC (and have room for the
 * header): what a blob of publish_state_dict looks like. */
int td__statedict_is(const void *p, size_t n);

/* Whether view v could hold such a blob: one dense uint8 dim of at least
 * the header's bytes, as publish_state_dict publishes its storage. */
int td__statedict_blob_shaped(const td_view *v);

/* Parses the n bytes at p (a blob, as published) into *sd, checking every
 * count, length, offset and size against n and the bounds above, every
 * region against the blob and every tensor of a known dtype against its
 * region (as load_state_dict would take it). The manifest must be JSON
 * (RFC 8259, UTF-8) without duplicate keys, a NUL in a string or an integer
 * past int64; unknown fields are skipped. Returns 0, or TD_EINVAL (a
 * corrupt blob), TD_ENODEV (a region on a GPU, in a storage of its own:
 * python.md, "State dicts on a GPU") or TD_ENOMEM with msg saying what is
 * wrong where (a
 * syntax error: the manifest's byte); *sd is then empty
 * (td__statedict_free is still safe). The JSON tree's memory is bounded by
 * td__sd_tree_max (jsonmem.h: thread-safe). */
int td__statedict_parse(const void *p, size_t n, td__statedict *sd, char *msg,
                        size_t len);

/* Frees what sd holds and empties it. NULL ok. */
void td__statedict_free(td__statedict *sd);

/* The tensor named name, or NULL. */
const td__sd_tensor *td__statedict_find(const td__statedict *sd,
                                        const char *name);

/* Sets *v to tensor t's view of the storage whose byte blob_off begins the
 * blob (its published view's offset). Returns 0, or TD_EINVAL with msg (a
 * dtype tensord does not read, a region not aligned to the dtype, offsets
 * past int64); *v is unchanged on failure. */
int td__statedict_view(const td__statedict *sd, const td__sd_tensor *t,
                       uint64_t blob_off, td_view *v, char *msg, size_t len);

#endif /* TD_CLIENT_STATEDICT_H */

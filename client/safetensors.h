/* safetensors.h: safetensors checkpoints (a file, or shards named by an
 * index json) read and checked from untrusted bytes, every rule of the
 * format; and the headers td_model_save writes. Private to libtensord and
 * its tests. */
#ifndef TD_CLIENT_SAFETENSORS_H
#define TD_CLIENT_SAFETENSORS_H

#include "tensord.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* The longest header read, as safetensors' own (100 MB). */
#define TD__ST_HEADER_MAX ((uint64_t)100000000)
/* Bytes a header's or an index's JSON tree may take while read (jsonmem.h):
 * ~20 times what a real header of 100 MB needs at most. */
#define TD__ST_TREE_MAX ((size_t)1 << 30)
/* The bound in force, TD__ST_TREE_MAX; tests lower it. */
extern size_t td__st_tree_max;

/* The index json of a sharded checkpoint, as a directory is searched. */
#define TD__ST_INDEX_NAME "model.safetensors.index.json"

/* safetensors' dtype name ("F32") as a td_dtype; TD_DTYPE_INVALID if the
 * name is not one tensord has. */
td_dtype td__st_dtype(const char *name);
/* The safetensors name of dtype, or NULL if safetensors has none. */
const char *td__st_dtype_name(td_dtype dtype);

typedef struct td__st_tensor {
  char *name;     /* UTF-8, no NUL inside */
  td_dtype dtype;
  int32_t ndim;
  int64_t shape[TD_MAX_DIMS];
  uint64_t begin, end; /* bytes from the start of the FILE (8 + header +
                          data_offsets), so of the shard's storage */
  uint32_t shard;
} td__st_tensor;

typedef struct td__st_shard {
  char *file;          /* its name in the checkpoint's directory */
  uint64_t size;       /* the file's bytes */
  int64_t mtime_ns;
  uint64_t header_len; /* N: the JSON's bytes */
  uint8_t *head;       /* the first 8 + N bytes, as checked */
  json_t *metadata;    /* its __metadata__ (an object), or NULL */
  size_t ntensors;
  int fd;              /* open for the load; -1 once closed */
} td__st_shard;

typedef struct td__checkpoint {
  char *path;     /* the file or index json, resolved (realpath) */
  char *dir;      /* its directory */
  int is_index;   /* path is an index json */
  uint64_t size;  /* path's bytes and mtime */
  int64_t mtime_ns;
  json_t *metadata; /* the file's __metadata__ or the index's "metadata" */
  size_t nshards;
  td__st_shard *shards;
  size_t ntensors;
  td__st_tensor *tensors; /* the checkpoint's order: the index's
                             weight_map's, else the header's */
  uint64_t bytes;         /* of every shard */
} td__checkpoint;

/* Checks the first head_len bytes of a safetensors file of file_size bytes
 * named file (for messages): the header length (within the file, at most
 * TD__ST_HEADER_MAX), then the header, which must be all in head (head_len
 * >= 8 + N; the data need not be), as one JSON object of tensors and an
 * optional __metadata__ (string to string), with every rule of the format:
 * known dtypes, shapes of non-negative sizes whose bytes fit 63 bits,
 * data_offsets inside the data region covering exactly numel * itemsize
 * bytes, no two tensors overlapping, no duplicate name, no unknown field;
 * and tensord's own: at most TD_MAX_DIMS dims, each tensor's first byte (in
 * the file) a multiple of its itemsize. On success appends the tensors to
 * ck->tensors in the header's order with shard index shard, and sets the
 * shard's header_len, metadata (a new reference) and ntensors; returns 0.
 * On failure returns TD_EINVAL (or TD_ENOMEM) with msg naming the file, the
 * tensor and the field; ck's tensors then are as before. */
int td__st_parse_header(const char *file, const uint8_t *head, size_t head_len,
                        uint64_t file_size, uint32_t shard, td__checkpoint *ck,
                        char *msg, size_t len);

/* Opens the checkpoint at path (a .safetensors file, an index json, or a
 * directory holding model.safetensors.index.json, else exactly one
 * .safetensors file) and checks all of it: the index (weight_map naming
 * plain file names of this directory), every shard's header, and that the
 * index and the shards name the same tensors. Reads only the headers; the
 * shards are left open (fd) for the load. Returns 0, or a negative code
 * with msg naming the file, the tensor and the field; *ck is then empty. */
int td__ckpt_open(const char *path, td__checkpoint *ck, char *msg, size_t len);
/* The name of a model loaded from path when none is given, into buf (len
 * bytes): a file's stem ("model.safetensors" -> "model"), else (an index
 * json, a directory) the directory's name. Returns 0, or a negative code
 * with msg. */
int td__ckpt_default_name(const char *path, char *buf, size_t len, char *msg,
                          size_t mlen);
/* Closes the shards' fds and frees what ck holds. NULL ok. */
void td__ckpt_free(td__checkpoint *ck);

/* Builds a safetensors header for n tensors (names, dtypes, shapes and
 * data_offsets [begin, end) in bytes from the data's start) and metadata
 * (an object of strings, or NULL), padded with spaces so that 8 + its
 * length is a multiple of 8. Returns it (malloc'd, not NUL-terminated) with
 * *hlen its length, or NULL (out of memory, or a tensor's name not UTF-8). */
typedef struct td__st_out {
  const char *name;
  td_dtype dtype;
  int32_t ndim;
  const int64_t *shape;
  uint64_t begin, end;
} td__st_out;
char *td__st_header_build(const td__st_out *t, size_t n, json_t *metadata,
                          size_t *hlen);

#endif /* TD_CLIENT_SAFETENSORS_H */

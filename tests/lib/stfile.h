/* stfile.h: safetensors checkpoints written by the tests: good files of
 * every dtype whose bytes carry a marker, hand-made headers, index jsons. */
#ifndef TD_TEST_STFILE_H
#define TD_TEST_STFILE_H

#include <stddef.h>
#include <stdint.h>

/* One tensor to write: its name, safetensors dtype ("F32") and shape. */
typedef struct tdt_st_tensor {
  const char *name;
  const char *dtype;
  int ndim;
  int64_t shape[4];
} tdt_st_tensor;

/* The element size of a safetensors dtype name, 0 if unknown. */
size_t tdt_st_itemsize(const char *dtype);
/* The byte j of tensor i of a file written with marker. */
uint8_t tdt_st_byte(size_t i, uint64_t j, uint8_t marker);
/* Writes a valid safetensors file of the n tensors at path, each tensor's
 * bytes tdt_st_byte(i, j, marker), laid out widest dtype first with no
 * gap, the header padded to 8 bytes; metadata is the JSON of __metadata__
 * or NULL. Returns 0, or -1 with errno. */
int tdt_st_write(const char *path, const tdt_st_tensor *t, size_t n,
                 const char *metadata, uint8_t marker);
/* The bytes of the file at path (malloc'd), *n their count; NULL with
 * errno if it cannot be read whole. */
uint8_t *tdt_read_file(const char *path, size_t *n);
/* Writes 8 bytes of header length (hlen, whatever header's size is), the
 * header text, then data_len bytes of 0x5a: for malformed files. */
int tdt_st_write_raw(const char *path, uint64_t hlen, const char *header,
                     uint64_t data_len);
/* The same file as bytes in memory (malloc'd, *len its size). */
uint8_t *tdt_st_raw(uint64_t hlen, const char *header, uint64_t data_len,
                    size_t *len);
/* Writes text to path. Returns 0 or -1. */
int tdt_write_text(const char *path, const char *text);
/* Whether the files at a and b hold the same bytes (1), differ (0), or
 * could not be read (-1). */
int tdt_same_file(const char *a, const char *b);

#endif /* TD_TEST_STFILE_H */

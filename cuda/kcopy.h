/* kcopy.h: the parameters of the copy kernel (kernels/copy.cu), one struct
 * passed by value, shared by the C that launches it (client/cumap.c), the
 * CUDA that runs it and the test double that emulates it: all three must
 * agree on its layout byte for byte. */
#ifndef TD_CUDA_KCOPY_H
#define TD_CUDA_KCOPY_H

#include <stdint.h>

/* TD_MAX_DIMS, repeated so that nvcc needs no other header of ours. */
#define TD_KCOPY_MAX_DIMS 16

/* The kernels' names in the module, as cuModuleGetFunction looks them up:
 * the element walk, for any plan; and the tiled one, for a plan whose
 * source runs fastest along another dim than the destination (a
 * transpose), which turns TD_KCOPY_TILE x TD_KCOPY_TILE tiles in shared
 * memory so that both its reads and its writes are coalesced. */
#define TD_KCOPY_NAME "td_copy_strided"
#define TD_KCOPY_TILED_NAME "td_copy_tiled"
/* The tiled kernel's tile edge and its block: TD_KCOPY_TILE x
 * TD_KCOPY_ROWS threads, each moving TD_KCOPY_TILE / TD_KCOPY_ROWS
 * elements of a tile. */
#define TD_KCOPY_TILE 32
#define TD_KCOPY_ROWS 8

/* A strided copy of numel elements of es bytes: element (i0, .., i(nd-1))
 * goes from src + sum(ik * ss[k]) to dst + sum(ik * ds[k]); dim nd - 1 is
 * the fastest in the linear index, so consecutive threads write along the
 * destination's innermost dim. Strides in bytes, non-negative; dst and src
 * already offset to the views' first elements. For the tiled kernel, tile
 * is the dim (below nd - 1) along which the source runs fastest; -1 for
 * the element walk. */
typedef struct td_kcopy {
  int32_t nd;
  int32_t es;
  int32_t tile;
  int32_t reserved; /* 0 */
  int64_t numel;
  uint64_t dst;
  uint64_t src;
  int64_t size[TD_KCOPY_MAX_DIMS];
  int64_t ds[TD_KCOPY_MAX_DIMS];
  int64_t ss[TD_KCOPY_MAX_DIMS];
} td_kcopy;

#endif /* TD_CUDA_KCOPY_H */

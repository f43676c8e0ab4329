/* copy.cu: the copy kernel behind td_copy of element-strided views on one
 * GPU (client/copy.c dispatches, client/cumap.c launches). Built by nvcc
 * into a fatbin embedded in libtensord when the toolkit is present, loaded
 * with cuModuleLoadData; the parameters are cuda/kcopy.h's struct. */
#include "../kcopy.h"

/* Moves one element of ES bytes with one load and one store of a type that
 * size (the caller's strides keep such elements aligned: a view's offset
 * and strides are in elements, and device memory is at least 256-byte
 * aligned). */
template <int ES, typename T>
__device__ __forceinline__ void move(char *d, const char *s) {
  *reinterpret_cast<T *>(d) = *reinterpret_cast<const T *>(s);
}

/* The walk, with the index arithmetic in I: 32-bit division is a few
 * instructions where 64-bit is a long emulated sequence, and a copy of
 * fewer than 2^32 elements (nearly all) needs no more. */
template <int ES, typename T, typename I>
__device__ void walk(const td_kcopy &p) {
  char *dst = reinterpret_cast<char *>(p.dst);
  const char *src = reinterpret_cast<const char *>(p.src);
  I numel = (I)p.numel;
  I step = (I)gridDim.x * blockDim.x;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += step) {
    /* The multi-index, innermost dim fastest: consecutive threads write
     * consecutive elements of the destination's innermost dim. */
    I rest = i;
    int64_t doff = 0, soff = 0;
    for (int k = p.nd - 1; k >= 0; k--) {
      I n = (I)p.size[k];
      I ik = rest % n;
      rest /= n;
      doff += (int64_t)ik * p.ds[k];
      soff += (int64_t)ik * p.ss[k];
    }
    if (ES > 0) {
      move<ES, T>(dst + doff, src + soff);
    } else {
      for (int b = 0; b < p.es; b++)
        dst[doff + b] = src[soff + b];
    }
  }
}

template <typename I> __device__ void dispatch(const td_kcopy &p) {
  switch (p.es) {
  case 1:
    walk<1, uint8_t, I>(p);
    break;
  case 2:
    walk<2, uint16_t, I>(p);
    break;
  case 4:
    walk<4, uint32_t, I>(p);
    break;
  case 8:
    walk<8, uint64_t, I>(p);
    break;
  case 16:
    walk<16, uint4, I>(p);
    break;
  default:
    walk<0, uint8_t, I>(p);
  }
}

/* One tile of the tiled kernel: the elements (b, a) for b in [b0, b0 +
 * TILE) along the source's fastest dim and a in [a0, a0 + TILE) along the
 * destination's, read with threadIdx.x along b (coalesced in the source),
 * kept in shared memory, written with threadIdx.x along a (coalesced in the
 * destination). The row of TILE + 1 keeps the column reads off one bank. */
template <typename T>
__device__ void tile_move(T (*t)[TD_KCOPY_TILE + 1], char *dst,
                          const char *src, int64_t na, int64_t nb, int64_t a0,
                          int64_t b0, int64_t dsa, int64_t dsb, int64_t ssa,
                          int64_t ssb) {
  for (int j = threadIdx.y; j < TD_KCOPY_TILE; j += TD_KCOPY_ROWS) {
    int64_t a = a0 + j, b = b0 + threadIdx.x;
    if (a < na && b < nb)
      t[j][threadIdx.x] =
          *reinterpret_cast<const T *>(src + a * ssa + b * ssb);
  }
  __syncthreads();
  for (int j = threadIdx.y; j < TD_KCOPY_TILE; j += TD_KCOPY_ROWS) {
    int64_t b = b0 + j, a = a0 + threadIdx.x;
    if (a < na && b < nb)
      *reinterpret_cast<T *>(dst + a * dsa + b * dsb) = t[threadIdx.x][j];
  }
  __syncthreads();
}

/* The tiled walk: tiles of (tile dim, innermost dim) over grid x and y,
 * every combination of the other dims over grid z, each grid-stride. */
template <typename T>
__device__ void tiled(const td_kcopy &p, unsigned char *raw) {
  T(*t)[TD_KCOPY_TILE + 1] = reinterpret_cast<T(*)[TD_KCOPY_TILE + 1]>(raw);
  int in = p.nd - 1, k = p.tile;
  int64_t na = p.size[in], nb = p.size[k];
  int64_t nouter = p.numel / (na * nb);
  for (int64_t o = blockIdx.z; o < nouter; o += gridDim.z) {
    int64_t rest = o, doff = 0, soff = 0;
    for (int d = p.nd - 1; d >= 0; d--) {
      if (d == in || d == k)
        continue;
      int64_t id = rest % p.size[d];
      rest /= p.size[d];
      doff += id * p.ds[d];
      soff += id * p.ss[d];
    }
    char *dst = reinterpret_cast<char *>(p.dst) + doff;
    const char *src = reinterpret_cast<const char *>(p.src) + soff;
    for (int64_t b0 = (int64_t)blockIdx.y * TD_KCOPY_TILE; b0 < nb;
         b0 += (int64_t)gridDim.y * TD_KCOPY_TILE)
      for (int64_t a0 = (int64_t)blockIdx.x * TD_KCOPY_TILE; a0 < na;
           a0 += (int64_t)gridDim.x * TD_KCOPY_TILE)
        tile_move<T>(t, dst, src, na, nb, a0, b0, p.ds[in], p.ds[k],
                     p.ss[in], p.ss[k]);
  }
}

/* One shared tile, sized for the largest element, for every element size
 * (a __shared__ array per instantiation would take all five at once); at
 * most 64 registers a thread, so that four blocks fit on a multiprocessor. */
extern "C" __global__ void
__launch_bounds__(TD_KCOPY_TILE *TD_KCOPY_ROWS, 4)
    td_copy_tiled(const td_kcopy p) {
  __shared__ __align__(16) unsigned char
      raw[TD_KCOPY_TILE * (TD_KCOPY_TILE + 1) * 16];
  switch (p.es) { /* the launcher sends only these sizes */
  case 1:
    tiled<uint8_t>(p, raw);
    break;
  case 2:
    tiled<uint16_t>(p, raw);
    break;
  case 4:
    tiled<uint32_t>(p, raw);
    break;
  case 8:
    tiled<uint64_t>(p, raw);
    break;
  case 16:
    tiled<uint4>(p, raw);
    break;
  }
}

extern "C" __global__ void td_copy_strided(const td_kcopy p) {
  /* The last index a thread reaches is below numel + the grid's size. */
  if (p.numel + (int64_t)gridDim.x * blockDim.x <= (int64_t)UINT32_MAX)
    dispatch<uint32_t>(p);
  else
    dispatch<int64_t>(p);
}

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

extern "C" __global__ void td_copy_strided(const td_kcopy p) {
  /* The last index a thread reaches is below numel + the grid's size. */
  if (p.numel + (int64_t)gridDim.x * blockDim.x <= (int64_t)UINT32_MAX)
    dispatch<uint32_t>(p);
  else
    dispatch<int64_t>(p);
}

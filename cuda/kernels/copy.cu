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

template <int ES, typename T>
__device__ void walk(const td_kcopy &p) {
  char *dst = reinterpret_cast<char *>(p.dst);
  const char *src = reinterpret_cast<const char *>(p.src);
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
       i < p.numel; i += step) {
    /* The multi-index, innermost dim fastest: consecutive threads write
     * consecutive elements of the destination's innermost dim. */
    int64_t rest = i, doff = 0, soff = 0;
    for (int k = p.nd - 1; k >= 0; k--) {
      int64_t n = p.size[k];
      int64_t ik = rest % n;
      rest /= n;
      doff += ik * p.ds[k];
      soff += ik * p.ss[k];
    }
    if (ES > 0) {
      move<ES, T>(dst + doff, src + soff);
    } else {
      for (int b = 0; b < p.es; b++)
        dst[doff + b] = src[soff + b];
    }
  }
}

extern "C" __global__ void td_copy_strided(const td_kcopy p) {
  switch (p.es) {
  case 1:
    walk<1, uint8_t>(p);
    break;
  case 2:
    walk<2, uint16_t>(p);
    break;
  case 4:
    walk<4, uint32_t>(p);
    break;
  case 8:
    walk<8, uint64_t>(p);
    break;
  case 16:
    walk<16, uint4>(p);
    break;
  default:
    walk<0, uint8_t>(p);
  }
}

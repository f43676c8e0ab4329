/* dtype.c: element types, their sizes and their names. */
#include "tensord.h"

#include <string.h>

static const struct {
  size_t size;
  const char *name;
} dtypes[TD_DTYPE_COUNT_] = {
    [TD_BOOL] = {1, "bool"},
    [TD_UINT8] = {1, "uint8"},
    [TD_INT8] = {1, "int8"},
    [TD_INT16] = {2, "int16"},
    [TD_INT32] = {4, "int32"},
    [TD_INT64] = {8, "int64"},
    [TD_FLOAT16] = {2, "float16"},
    [TD_BFLOAT16] = {2, "bfloat16"},
    [TD_FLOAT32] = {4, "float32"},
    [TD_FLOAT64] = {8, "float64"},
    [TD_COMPLEX64] = {8, "complex64"},
    [TD_COMPLEX128] = {16, "complex128"},
    [TD_UINT16] = {2, "uint16"},
    [TD_UINT32] = {4, "uint32"},
    [TD_UINT64] = {8, "uint64"},
    [TD_FLOAT8_E4M3FN] = {1, "float8_e4m3fn"},
    [TD_FLOAT8_E5M2] = {1, "float8_e5m2"},
};

size_t td_dtype_size(td_dtype dtype) {
  if ((int)dtype <= 0 || dtype >= TD_DTYPE_COUNT_)
    return 0;
  return dtypes[dtype].size;
}

const char *td_dtype_name(td_dtype dtype) {
  if ((int)dtype <= 0 || dtype >= TD_DTYPE_COUNT_)
    return NULL;
  return dtypes[dtype].name;
}

td_dtype td_dtype_from_name(const char *name) {
  if (name == NULL)
    return TD_DTYPE_INVALID;
  for (int d = 1; d < TD_DTYPE_COUNT_; d++)
    if (strcmp(name, dtypes[d].name) == 0)
      return (td_dtype)d;
  return TD_DTYPE_INVALID;
}

/* dtype.c: element types, their sizes and their names. */
#include "common.h"

#include <math.h>
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

typedef struct alias {
  const char *name;
  td_dtype dtype;
} alias;

/* Other names the two worlds use for the same types. Names on which PyTorch
 * and numpy disagree ("float", "int", "cfloat", "byte") are left out on
 * purpose: they are accepted only after "torch." (torch_aliases). */
static const alias aliases[] = {
    {"bool_", TD_BOOL},     {"half", TD_FLOAT16},
    {"double", TD_FLOAT64}, {"short", TD_INT16},
    {"long", TD_INT64},     {"cdouble", TD_COMPLEX128},
    {"single", TD_FLOAT32}, {"csingle", TD_COMPLEX64},
    {"ubyte", TD_UINT8},    {"ushort", TD_UINT16},
    {"longlong", TD_INT64}, {"ulonglong", TD_UINT64},
    {"intc", TD_INT32},     {"uintc", TD_UINT32},
};

/* PyTorch's names for what numpy calls otherwise (torch.byte is uint8,
 * np.byte int8), taken only with "torch." in front. */
static const alias torch_aliases[] = {
    {"float", TD_FLOAT32}, {"int", TD_INT32}, {"cfloat", TD_COMPLEX64},
    {"byte", TD_UINT8},    {"char", TD_INT8},
};

/* Returns the dtype name has in table t of n entries, or TD_DTYPE_INVALID. */
static td_dtype find_alias(const alias *t, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(name, t[i].name) == 0)
      return t[i].dtype;
  return TD_DTYPE_INVALID;
}

/* numpy's one-letter type codes (np.dtype(t).char) on an LP64 Linux. */
static td_dtype from_char(char c) {
  switch (c) {
  case '?':
    return TD_BOOL;
  case 'b':
    return TD_INT8;
  case 'B':
    return TD_UINT8;
  case 'h':
    return TD_INT16;
  case 'H':
    return TD_UINT16;
  case 'i':
    return TD_INT32;
  case 'I':
    return TD_UINT32;
  case 'l':
  case 'q':
    return TD_INT64;
  case 'L':
  case 'Q':
    return TD_UINT64;
  case 'e':
    return TD_FLOAT16;
  case 'f':
    return TD_FLOAT32;
  case 'd':
    return TD_FLOAT64;
  case 'F':
    return TD_COMPLEX64;
  case 'D':
    return TD_COMPLEX128;
  }
  return TD_DTYPE_INVALID;
}

/* numpy's array-protocol strings without the byte order: kind letter and
 * size in bytes ("f4", "u1", "b1", "c16"). */
static td_dtype from_typestr(const char *s) {
  static const struct {
    const char *str;
    td_dtype dtype;
  } t[] = {
      {"b1", TD_BOOL},      {"u1", TD_UINT8},       {"u2", TD_UINT16},
      {"u4", TD_UINT32},    {"u8", TD_UINT64},      {"i1", TD_INT8},
      {"i2", TD_INT16},     {"i4", TD_INT32},       {"i8", TD_INT64},
      {"f2", TD_FLOAT16},   {"f4", TD_FLOAT32},     {"f8", TD_FLOAT64},
      {"c8", TD_COMPLEX64}, {"c16", TD_COMPLEX128},
  };
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
    if (strcmp(s, t[i].str) == 0)
      return t[i].dtype;
  if (s[0] != '\0' && s[1] == '\0')
    return from_char(s[0]);
  return TD_DTYPE_INVALID;
}

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

/* Accepts PyTorch's names, with or without "torch." in front ("float32",
 * "torch.bfloat16", "half"; "torch.float", "torch.int", "torch.cfloat",
 * "torch.byte" and "torch.char" only with it), numpy's names ("float64",
 * "bool_"), and numpy's type strings: a code or a kind and size ("f",
 * "f4"), optionally after a byte order of '<' (little-endian), '=' (native)
 * or '|' (not applicable). Storages hold native little-endian bytes, so
 * big-endian spellings ('>' and '!') are refused. */
td_dtype td_dtype_from_name(const char *name) {
  if (name == NULL || name[0] == '\0')
    return TD_DTYPE_INVALID;
  int torch = strncmp(name, "torch.", 6) == 0;
  if (torch)
    name += 6;
  for (int d = 1; d < TD_DTYPE_COUNT_; d++)
    if (strcmp(name, dtypes[d].name) == 0)
      return (td_dtype)d;
  td_dtype d = find_alias(aliases, sizeof(aliases) / sizeof(aliases[0]), name);
  if (d != TD_DTYPE_INVALID)
    return d;
  if (torch)
    return find_alias(torch_aliases,
                      sizeof(torch_aliases) / sizeof(torch_aliases[0]), name);
  if (name[0] == '<' || name[0] == '=' || name[0] == '|')
    name++;
  return from_typestr(name);
}

/* Returns 2^e for -1022 <= e <= 1023, without libm. */
static double pow2(int e) {
  uint64_t u = (uint64_t)(e + 1023) << 52;
  double d;
  memcpy(&d, &u, sizeof(d));
  return d;
}

/* Returns the value of a binary float of 1 sign, ebits exponent and mbits
 * mantissa bits with the given bias. ieee: the all-ones exponent holds
 * infinities (mantissa 0) and NaNs, as in IEEE 754; otherwise only the
 * all-ones exponent and mantissa is NaN (the "fn" formats). */
static double small_float(uint32_t bits, int ebits, int mbits, int bias,
                          int ieee) {
  uint32_t mmask = (1u << mbits) - 1, emax = (1u << ebits) - 1;
  uint32_t e = (bits >> mbits) & emax, m = bits & mmask;
  double sign = (bits >> (ebits + mbits)) & 1 ? -1.0 : 1.0;
  if (e == emax && (ieee || m == mmask)) {
    if (ieee && m == 0)
      return sign * INFINITY;
    return sign > 0 ? NAN : -NAN;
  }
  if (e == 0) /* zero and subnormals */
    return sign * (double)m * pow2(1 - bias - mbits);
  return sign * (double)(m | (1u << mbits)) * pow2((int)e - bias - mbits);
}

/* The value of the element of a real dtype at p (td_elem_to_double). */
static double decode(td_dtype dtype, const void *p) {
  union {
    uint8_t u8;
    int8_t i8;
    uint16_t u16;
    int16_t i16;
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
  } x;
  memcpy(&x, p, td_dtype_size(dtype)); /* elements need not be aligned */
  switch (dtype) {
  case TD_BOOL:
    return x.u8 != 0;
  case TD_UINT8:
    return x.u8;
  case TD_INT8:
    return x.i8;
  case TD_UINT16:
    return x.u16;
  case TD_INT16:
    return x.i16;
  case TD_UINT32:
    return x.u32;
  case TD_INT32:
    return x.i32;
  case TD_UINT64:
    return (double)x.u64;
  case TD_INT64:
    return (double)x.i64;
  case TD_FLOAT16:
    return small_float(x.u16, 5, 10, 15, 1);
  case TD_BFLOAT16: /* the top half of a float32 */
    x.u32 = (uint32_t)x.u16 << 16;
    return x.f32;
  case TD_FLOAT8_E4M3FN:
    return small_float(x.u8, 4, 3, 7, 0);
  case TD_FLOAT8_E5M2: /* float16's top byte */
    return small_float(x.u8, 5, 2, 15, 1);
  case TD_FLOAT32:
    return x.f32;
  default:
    return x.f64;
  }
}

int td_elem_to_double(td_dtype dtype, const void *elem, double *out) {
  if (td_dtype_size(dtype) == 0)
    return td__fail(NULL, TD_EINVAL, "elem_to_double: unknown dtype %d",
                    (int)dtype);
  if (dtype == TD_COMPLEX64 || dtype == TD_COMPLEX128)
    return td__fail(
        NULL, TD_EINVAL, "elem_to_double: %s has two parts: decode each as %s",
        td_dtype_name(dtype), dtype == TD_COMPLEX64 ? "float32" : "float64");
  *out = decode(dtype, elem);
  return 0;
}

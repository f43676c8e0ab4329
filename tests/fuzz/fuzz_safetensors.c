/* fuzz_safetensors.c: the safetensors header parser (client/safetensors.c)
 * over arbitrary bytes taken as a whole file. Whatever it accepts must
 * hold what the loader relies on; whatever it refuses must say why and
 * keep nothing. The JSON tree's memory is bounded lower than in use, so
 * that the fuzzer's own memory limit is never what stops an input. */
#include "safetensors.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ORACLE(cond)                                                           \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  td__st_tree_max = (size_t)64 << 20;
  td__checkpoint ck;
  memset(&ck, 0, sizeof(ck));
  char msg[1024] = "";
  int err = td__st_parse_header("fuzz.safetensors", data, size, size, 0, &ck,
                                msg, sizeof(msg));
  if (err < 0) {
    ORACLE(err == TD_EINVAL || err == TD_ENOMEM);
    ORACLE(strncmp(msg, "fuzz.safetensors: ", 18) == 0);
    ORACLE(ck.ntensors == 0);
  } else {
    ORACLE(err == 0 && size >= 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
      hlen = hlen << 8 | data[i];
    for (size_t i = 0; i < ck.ntensors; i++) {
      const td__st_tensor *t = &ck.tensors[i];
      size_t item = td_dtype_size(t->dtype);
      ORACLE(item != 0 && t->ndim >= 0 && t->ndim <= TD_MAX_DIMS);
      ORACLE(t->begin >= 8 + hlen && t->begin <= t->end && t->end <= size);
      ORACLE(t->begin % item == 0);
      td_view v;
      ORACLE(td_view_contiguous(t->dtype, t->ndim, t->shape, &v) == 0);
      v.offset = (int64_t)(t->begin / item);
      ORACLE(td_view_check(&v, size) == 0);
      ORACLE((uint64_t)td_view_numel(&v) * item == t->end - t->begin);
      for (size_t j = 0; j < i; j++) {
        const td__st_tensor *u = &ck.tensors[j];
        ORACLE(strcmp(u->name, t->name) != 0);
        ORACLE(u->end <= t->begin || t->end <= u->begin ||
               u->begin == u->end || t->begin == t->end);
      }
    }
  }
  td__ckpt_free(&ck);
  return 0;
}

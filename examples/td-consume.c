/* td-consume.c: waits for a key, maps its storage read-only, prints it. */
#include "tensord.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  const char *key = argc > 1 ? argv[1] : "demo/matrix";
  unsigned flags = TD_RDONLY;
  if (argc > 2 && strcmp(argv[2], "--take") == 0)
    flags |= TD_TAKE;
  td_client *c;
  td_storage *s;
  td_view v;
  if (td_connect(NULL, &c) < 0) {
    fprintf(stderr, "td-consume: %s\n", td_last_error(NULL));
    return 1;
  }
  if (td_lookup(c, key, flags, 10000, &s, &v) < 0) {
    fprintf(stderr, "td-consume: %s\n", td_last_error(c));
    return 1;
  }
  char vb[256];
  printf("'%s' -> storage %llu: %s\n", key,
         (unsigned long long)td_storage_id(s),
         td_view_format(&v, vb, sizeof(vb)));
  if (v.dtype == TD_FLOAT32 && v.ndim == 2) {
    const float *x = (const float *)td_storage_data(s) + v.offset;
    for (int64_t i = 0; i < v.shape[0]; i++) {
      for (int64_t j = 0; j < v.shape[1]; j++)
        printf(" %6.2f", x[i * v.stride[0] + j * v.stride[1]]);
      printf("\n");
    }
  }
  td_storage_release(s);
  td_close(c);
  return 0;
}

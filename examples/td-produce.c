/* td-produce.c: creates a float32 matrix in shared memory, fills it, and
 * publishes it under a key; then exits, the key keeping the storage alive. */
#include "tensord.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  const char *key = argc > 1 ? argv[1] : "demo/matrix";
  int64_t shape[2] = {4, 3};
  td_client *c;
  td_storage *s;
  td_view v;
  if (td_connect(NULL, &c) < 0) {
    fprintf(stderr, "td-produce: %s\n", td_last_error(NULL));
    return 1;
  }
  int err = td_view_contiguous(TD_FLOAT32, 2, shape, &v);
  if (err == 0)
    err = td_storage_create(c, (size_t)(4 * 3) * sizeof(float), &s);
  if (err < 0) {
    fprintf(stderr, "td-produce: %s\n", td_last_error(c));
    return 1;
  }
  float *x = td_storage_data(s);
  for (int i = 0; i < 12; i++)
    x[i] = (float)i * 0.5f;
  if (td_publish(c, key, s, &v) < 0) {
    fprintf(stderr, "td-produce: %s\n", td_last_error(c));
    return 1;
  }
  printf("published storage %llu as '%s': float32[4, 3]\n",
         (unsigned long long)td_storage_id(s), key);
  /* The key holds its own reference: the storage outlives this process. */
  td_storage_release(s);
  td_close(c);
  return 0;
}

/* jsonmem.c: jansson's memory, bounded per parse of untrusted JSON. */
#include "jsonmem.h"

#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* A tree takes 10 to 80 times its JSON's bytes, so a hostile document of
 * "{}," could otherwise take ~80 bytes for every 3 it has. The counts are
 * per thread and the functions pass other threads' allocations (and this
 * thread's outside a parse) straight to malloc and free; sizes come from
 * malloc_usable_size, not from a header of ours, so a value allocated
 * before, after or elsewhere may be freed by either. */
static _Thread_local int tree_counting, tree_over;
static _Thread_local size_t tree_bytes, tree_max;

static void *tree_malloc(size_t n) {
  if (!tree_counting)
    return malloc(n);
  if (tree_bytes >= tree_max || n > tree_max - tree_bytes) {
    tree_over = 1;
    return NULL;
  }
  void *p = malloc(n);
  if (p != NULL)
    tree_bytes += malloc_usable_size(p);
  return p;
}

static void tree_free(void *p) {
  if (p != NULL && tree_counting) {
    size_t u = malloc_usable_size(p);
    tree_bytes -= u < tree_bytes ? u : tree_bytes;
  }
  free(p);
}

static pthread_once_t install_once = PTHREAD_ONCE_INIT;
static int installed;

/* Installs the counting functions if jansson still has its defaults. A
 * thread of the program that uses jansson meanwhile is unharmed: both sets
 * allocate with malloc and free with free. */
static void install(void) {
  json_malloc_t m;
  json_free_t f;
  json_get_alloc_funcs(&m, &f);
  if (m == malloc && f == free) {
    json_set_alloc_funcs(tree_malloc, tree_free);
    installed = 1;
  }
}

int td__json_counting(void) {
  pthread_once(&install_once, install);
  return installed;
}

/* An upper bound on the bytes jansson's tree of the n bytes at p takes:
 * every value costs at most ~160 bytes (an object with its hashtable;
 * strings their bytes besides), and each value but the first follows a
 * '[', ',' or ':' outside strings. */
static size_t estimate(const char *p, size_t n) {
  size_t values = 1;
  int in_str = 0;
  for (size_t i = 0; i < n; i++) {
    char ch = p[i];
    if (in_str) {
      if (ch == '\\')
        i++;
      else if (ch == '"')
        in_str = 0;
    } else if (ch == '"') {
      in_str = 1;
    } else if (ch == '[' || ch == ',' || ch == ':') {
      values++;
    }
  }
  return values * 160 + n;
}

json_t *td__json_loadb_bounded(const char *p, size_t n, size_t flags,
                               size_t max, json_error_t *e, int *over) {
  *over = 0;
  if (!td__json_counting()) {
    if (estimate(p, n) > max) {
      memset(e, 0, sizeof(*e));
      *over = 1;
      return NULL;
    }
    return json_loadb(p, n, flags, e);
  }
  tree_counting = 1;
  tree_over = 0;
  tree_bytes = 0;
  tree_max = max;
  json_t *root = json_loadb(p, n, flags, e);
  tree_counting = 0;
  *over = root == NULL && tree_over;
  return root;
}

const char *td__json_kind(const json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT:
    return "an object";
  case JSON_ARRAY:
    return "an array";
  case JSON_STRING:
    return "a string";
  case JSON_INTEGER:
    return "an integer";
  case JSON_REAL:
    return "a real number";
  case JSON_TRUE:
  case JSON_FALSE:
    return "a boolean";
  default:
    return "null";
  }
}

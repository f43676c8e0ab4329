/* stfile.c: safetensors checkpoints written by the tests. */
#include "stfile.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t tdt_st_itemsize(const char *d) {
  static const struct {
    const char *n;
    size_t s;
  } k[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},    {"I64", 8},
           {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},      {"BOOL", 1},
           {"U16", 2}, {"U32", 4}, {"U64", 8}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++)
    if (strcmp(k[i].n, d) == 0)
      return k[i].s;
  return 0;
}

uint8_t tdt_st_byte(size_t i, uint64_t j, uint8_t marker) {
  return (uint8_t)(marker * 37 + i * 11 + j * 7 + j / 251);
}

static uint64_t nbytes_of(const tdt_st_tensor *t) {
  uint64_t n = tdt_st_itemsize(t->dtype);
  for (int d = 0; d < t->ndim; d++)
    n *= (uint64_t)t->shape[d];
  return n;
}

static int write_all(FILE *f, const void *p, size_t n) {
  return fwrite(p, 1, n, f) == n ? 0 : -1;
}

int tdt_st_write(const char *path, const tdt_st_tensor *t, size_t n,
                 const char *metadata, uint8_t marker) {
  size_t *order = calloc(n ? n : 1, sizeof(*order));
  uint64_t *begin = calloc(n ? n : 1, sizeof(*begin));
  size_t cap = 4096 + n * 256 + (metadata ? strlen(metadata) : 0);
  char *h = malloc(cap + 8);
  if (order == NULL || begin == NULL || h == NULL)
    return -1;
  size_t k = 0;
  for (size_t s = 8; s >= 1; s /= 2)
    for (size_t i = 0; i < n; i++)
      if (tdt_st_itemsize(t[i].dtype) == s)
        order[k++] = i;
  uint64_t off = 0;
  for (size_t o = 0; o < k; o++) {
    begin[order[o]] = off;
    off += nbytes_of(&t[order[o]]);
  }
  size_t used = (size_t)snprintf(h, cap, "{");
  if (metadata != NULL)
    used += (size_t)snprintf(h + used, cap - used, "\"__metadata__\":%s%s",
                             metadata, n ? "," : "");
  for (size_t i = 0; i < n; i++) {
    used += (size_t)snprintf(h + used, cap - used,
                             "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                             i ? "," : "", t[i].name, t[i].dtype);
    for (int d = 0; d < t[i].ndim; d++)
      used += (size_t)snprintf(h + used, cap - used, "%s%" PRId64, d ? "," : "",
                               t[i].shape[d]);
    used += (size_t)snprintf(h + used, cap - used,
                             "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                             begin[i], begin[i] + nbytes_of(&t[i]));
  }
  used += (size_t)snprintf(h + used, cap - used, "}");
  while ((8 + used) % 8 != 0)
    h[used++] = ' ';
  FILE *f = fopen(path, "wb");
  int err = f == NULL ? -1 : 0;
  uint8_t len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (uint8_t)((uint64_t)used >> (8 * i));
  if (err == 0)
    err = write_all(f, len8, 8) | write_all(f, h, used);
  uint8_t buf[4096];
  for (size_t o = 0; o < k && err == 0; o++) {
    size_t i = order[o];
    uint64_t nb = nbytes_of(&t[i]);
    for (uint64_t j = 0; j < nb && err == 0;) {
      size_t m = 0;
      for (; m < sizeof(buf) && j < nb; m++, j++)
        buf[m] = tdt_st_byte(i, j, marker);
      err = write_all(f, buf, m);
    }
  }
  if (f != NULL && fclose(f) != 0)
    err = -1;
  free(order);
  free(begin);
  free(h);
  return err;
}

uint8_t *tdt_st_raw(uint64_t hlen, const char *header, uint64_t data_len,
                    size_t *len) {
  size_t hl = strlen(header);
  uint8_t *p = malloc(8 + hl + data_len + 1);
  if (p == NULL)
    return NULL;
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(hlen >> (8 * i));
  memcpy(p + 8, header, hl);
  memset(p + 8 + hl, 0x5a, data_len);
  *len = 8 + hl + data_len;
  return p;
}

int tdt_st_write_raw(const char *path, uint64_t hlen, const char *header,
                     uint64_t data_len) {
  size_t n;
  uint8_t *p = tdt_st_raw(hlen, header, data_len, &n);
  FILE *f = p ? fopen(path, "wb") : NULL;
  int err = f == NULL ? -1 : write_all(f, p, n);
  if (f != NULL && fclose(f) != 0)
    err = -1;
  free(p);
  return err;
}

int tdt_write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  int err = f == NULL ? -1 : write_all(f, text, strlen(text));
  if (f != NULL && fclose(f) != 0)
    err = -1;
  return err;
}

int tdt_same_file(const char *a, const char *b) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int same = fa && fb ? 1 : -1;
  while (same == 1) {
    int x = fgetc(fa), y = fgetc(fb);
    if (x != y)
      same = 0;
    if (x == EOF || y == EOF)
      break;
  }
  if (fa)
    fclose(fa);
  if (fb)
    fclose(fb);
  return same;
}

uint8_t *tdt_read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return NULL;
  uint8_t *b = NULL;
  long len;
  if (fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 &&
      fseek(f, 0, SEEK_SET) == 0) {
    *n = (size_t)len;
    b = malloc(*n ? *n : 1);
    if (b != NULL && fread(b, 1, *n, f) != *n) {
      free(b);
      b = NULL;
      errno = EIO;
    }
  }
  fclose(f);
  return b;
}

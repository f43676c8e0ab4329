/* clitext.c: the text tensorctl's commands print: messages, sizes, ages,
 * JSON strings and views, and the test for a storage id. */
#include "clitext.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>

int td__cli_msg(char *msg, size_t len, int err, const char *fmt, ...) {
  if (msg != NULL && len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, len, fmt, ap);
    va_end(ap);
  }
  return err;
}

char *td__cli_bytes(uint64_t n, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)n;
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", n);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
  return buf;
}

char *td__cli_age(int64_t ms, char *buf, size_t len) {
  int64_t s = ms < 0 ? 0 : ms / 1000;
  if (s < 60)
    snprintf(buf, len, "%" PRId64 "s", s);
  else if (s < 3600)
    snprintf(buf, len, "%" PRId64 "m%02" PRId64 "s", s / 60, s % 60);
  else if (s < 86400)
    snprintf(buf, len, "%" PRId64 "h%02" PRId64 "m", s / 3600, s / 60 % 60);
  else
    snprintf(buf, len, "%" PRId64 "d%02" PRId64 "h", s / 86400, s / 3600 % 24);
  return buf;
}

void td__cli_json_str(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      printf("\\%c", *p);
    else if (*p < 0x20 || *p == 0x7f)
      printf("\\u%04x", *p);
    else
      putchar(*p);
  }
  putchar('"');
}

const char *td__cli_printable(const char *s, char *buf, size_t len) {
  size_t j = 0;
  if (len == 0)
    return buf;
  for (; *s && j + 1 < len; s++)
    buf[j++] = ((unsigned char)*s < 0x20 || *s == 0x7f) ? '?' : *s;
  buf[j] = '\0';
  return buf;
}

void td__cli_json_view(const td_view *v) {
  const char *name = td_dtype_name(v->dtype);
  printf("{\"dtype\":\"%s\",\"shape\":[", name ? name : "?");
  for (int32_t i = 0; i < v->ndim; i++)
    printf("%s%" PRId64, i ? "," : "", v->shape[i]);
  printf("],\"stride\":[");
  for (int32_t i = 0; i < v->ndim; i++)
    printf("%s%" PRId64, i ? "," : "", v->stride[i]);
  printf("],\"offset\":%" PRId64 "}", v->offset);
}

int td__cli_is_digits(const char *s) {
  if (*s == '\0')
    return 0;
  for (; *s; s++)
    if (!isdigit((unsigned char)*s))
      return 0;
  return 1;
}

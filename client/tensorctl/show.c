/* show.c: tensorctl show: a view's elements, their statistics and numpy's
 * repr of them, read through a read-only mapping (docs/cli.md). */
#include "show.h"

#include "clitext.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- elements ---- */

typedef enum { K_BOOL, K_INT, K_UINT, K_FLOAT, K_COMPLEX } kind;

static kind kind_of(td_dtype dt) {
  switch (dt) {
  case TD_BOOL:
    return K_BOOL;
  case TD_INT8:
  case TD_INT16:
  case TD_INT32:
  case TD_INT64:
    return K_INT;
  case TD_UINT8:
  case TD_UINT16:
  case TD_UINT32:
  case TD_UINT64:
    return K_UINT;
  case TD_COMPLEX64:
  case TD_COMPLEX128:
    return K_COMPLEX;
  default:
    return K_FLOAT;
  }
}

/* The dtype of one component of dt: a complex's float, else dt. */
static td_dtype part_dtype(td_dtype dt) {
  return dt == TD_COMPLEX64    ? TD_FLOAT32
         : dt == TD_COMPLEX128 ? TD_FLOAT64
                               : dt;
}

static int64_t load_int(td_dtype dt, const uint8_t *p) {
  switch (dt) {
  case TD_INT8:
    return (int8_t)p[0];
  case TD_INT16: {
    int16_t x;
    memcpy(&x, p, sizeof(x));
    return x;
  }
  case TD_INT32: {
    int32_t x;
    memcpy(&x, p, sizeof(x));
    return x;
  }
  default: {
    int64_t x;
    memcpy(&x, p, sizeof(x));
    return x;
  }
  }
}

static uint64_t load_uint(td_dtype dt, const uint8_t *p) {
  switch (dt) {
  case TD_BOOL:
  case TD_UINT8:
    return p[0];
  case TD_UINT16: {
    uint16_t x;
    memcpy(&x, p, sizeof(x));
    return x;
  }
  case TD_UINT32: {
    uint32_t x;
    memcpy(&x, p, sizeof(x));
    return x;
  }
  default: {
    uint64_t x;
    memcpy(&x, p, sizeof(x));
    return x;
  }
  }
}

/* Decodes a float element (or a complex's component: pass part_dtype). */
static double load_float(td_dtype dt, const uint8_t *p) {
  double x = NAN;
  td_elem_to_double(dt, p, &x);
  return x;
}

/* Returns the address of the element at flat (row-major) index flat. */
static const uint8_t *elem_at(const td_view *v, const uint8_t *base,
                              int64_t flat) {
  int64_t off = v->offset;
  for (int32_t d = v->ndim - 1; d >= 0; d--) {
    off += flat % v->shape[d] * v->stride[d];
    flat /= v->shape[d];
  }
  return base + (size_t)off * td_dtype_size(v->dtype);
}

/* ---- the index ---- */

typedef enum { IX_INT, IX_SLICE, IX_ELLIPSIS, IX_NONE } ix_kind;

typedef struct ix {
  ix_kind kind;
  int64_t v[3]; /* int; or slice start, stop, step */
  int has[3];   /* which slice parts were given */
} ix;

/* Parses the int in s[0..n) (spaces around allowed) into *out. Returns 0,
 * or -1 if it is not an int64. */
static int parse_int(const char *s, size_t n, int64_t *out) {
  char buf[64];
  while (n > 0 && isspace((unsigned char)*s))
    s++, n--;
  while (n > 0 && isspace((unsigned char)s[n - 1]))
    n--;
  if (n == 0 || n >= sizeof(buf))
    return -1;
  memcpy(buf, s, n);
  buf[n] = '\0';
  for (size_t i = 0; i < n; i++)
    if (!isdigit((unsigned char)buf[i]) && !(i == 0 && buf[i] == '-') &&
        !(i == 0 && buf[i] == '+'))
      return -1;
  errno = 0;
  char *end;
  long long x = strtoll(buf, &end, 10);
  if (errno != 0 || *end != '\0' || end == buf)
    return -1;
  *out = x;
  return 0;
}

/* Parses one comma-separated item s[0..n). Returns 0 or -1. */
static int parse_item(const char *s, size_t n, ix *it) {
  while (n > 0 && isspace((unsigned char)*s))
    s++, n--;
  while (n > 0 && isspace((unsigned char)s[n - 1]))
    n--;
  memset(it, 0, sizeof(*it));
  if (n == 3 && memcmp(s, "...", 3) == 0) {
    it->kind = IX_ELLIPSIS;
    return 0;
  }
  if (n == 4 && memcmp(s, "None", 4) == 0) {
    it->kind = IX_NONE;
    return 0;
  }
  if (memchr(s, ':', n) == NULL) {
    it->kind = IX_INT;
    return parse_int(s, n, &it->v[0]);
  }
  it->kind = IX_SLICE;
  int part = 0;
  size_t start = 0;
  for (size_t i = 0; i <= n; i++) {
    if (i < n && s[i] != ':')
      continue;
    if (part == 3)
      return -1; /* a:b:c:d */
    const char *p = s + start;
    size_t k = i - start;
    while (k > 0 && isspace((unsigned char)*p))
      p++, k--;
    if (k > 0) {
      if (parse_int(p, k, &it->v[part]) < 0)
        return -1;
      it->has[part] = 1;
    }
    part++;
    start = i + 1;
  }
  return 0;
}

int td__show_index(td_view *v, const char *expr, char *msg, size_t len) {
  ix items[2 * TD_MAX_DIMS + 2];
  size_t nitems = 0;
  const char *s = expr;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)*s))
    s++, n--;
  while (n > 0 && isspace((unsigned char)s[n - 1]))
    n--;
  if (n > 0 && s[0] == '[') {
    if (s[n - 1] != ']')
      return td__cli_msg(msg, len, TD_EINVAL,
                         "index '%s': no ']' to close the '['", expr);
    s++;
    n -= 2;
  }
  size_t start = 0;
  for (size_t i = 0; i <= n; i++) {
    if (i < n && s[i] != ',')
      continue;
    size_t k = i - start;
    int blank = 1;
    for (size_t j = start; j < i; j++)
      blank &= isspace((unsigned char)s[j]) != 0;
    if (blank && i == n && nitems > 0)
      break; /* "[0,]": Python's trailing comma */
    if (nitems == sizeof(items) / sizeof(items[0]))
      return td__cli_msg(msg, len, TD_EINVAL, "index '%s': too many items",
                         expr);
    if (blank || parse_item(s + start, k, &items[nitems]) < 0)
      return td__cli_msg(msg, len, TD_EINVAL,
                         "index '%s': '%.*s' is not an int, a slice a:b:c, "
                         "'...' or 'None'",
                         expr, (int)k, s + start);
    nitems++;
    start = i + 1;
  }
  int consuming = 0, ellipses = 0;
  for (size_t i = 0; i < nitems; i++) {
    consuming += items[i].kind == IX_INT || items[i].kind == IX_SLICE;
    ellipses += items[i].kind == IX_ELLIPSIS;
  }
  if (ellipses > 1)
    return td__cli_msg(msg, len, TD_EINVAL, "index '%s': more than one '...'",
                       expr);
  if (consuming > v->ndim)
    return td__cli_msg(msg, len, TD_EINVAL,
                       "index '%s': %d %s for a view of %d dim%s", expr,
                       consuming, consuming == 1 ? "index" : "indices",
                       (int)v->ndim, v->ndim == 1 ? "" : "s");
  td_view w = *v;
  int32_t d = 0, orig = 0; /* dim in w; dim in v */
  for (size_t i = 0; i < nitems; i++) {
    const ix *it = &items[i];
    int err = 0;
    switch (it->kind) {
    case IX_INT: {
      int64_t size = w.shape[d];
      if (it->v[0] < -size || it->v[0] >= size)
        return td__cli_msg(msg, len, TD_ERANGE,
                           "index '%s': dim %d: index %" PRId64
                           " out of range for size %" PRId64,
                           expr, (int)orig, it->v[0], size);
      err = td_view_select(&w, d, it->v[0]);
      orig++;
      break;
    }
    case IX_SLICE: {
      int64_t step = it->has[2] ? it->v[2] : 1;
      if (step < 1)
        return td__cli_msg(msg, len, TD_EINVAL,
                           "index '%s': dim %d: step %" PRId64
                           " (steps must be 1 or more)",
                           expr, (int)orig, step);
      err = td_view_slice(&w, d, it->has[0] ? it->v[0] : 0,
                          it->has[1] ? it->v[1] : INT64_MAX, step);
      d++, orig++;
      break;
    }
    case IX_NONE:
      err = td_view_unsqueeze(&w, d);
      d++;
      break;
    case IX_ELLIPSIS:
      d += v->ndim - consuming;
      orig += v->ndim - consuming;
      break;
    }
    if (err < 0)
      return td__cli_msg(msg, len, err, "index '%s': %s", expr,
                         td_view_last_error());
  }
  *v = w;
  return 0;
}

/* ---- statistics ---- */

static void welford(double x, uint64_t n, double *mean, double *m2) {
  double dx = x - *mean;
  *mean += dx / (double)n;
  *m2 += dx * (x - *mean);
}

static void add_float(td__show_stats *st, double x) {
  if (isnan(x)) {
    st->nan++;
    return;
  }
  st->zeros += x == 0;
  if (st->nvalues == 0 || x < st->fmin)
    st->fmin = x;
  if (st->nvalues == 0 || x > st->fmax)
    st->fmax = x;
  st->nvalues++;
  if (isinf(x)) { /* kept out of Welford's sums, which it would poison */
    st->inf++;
    *(x > 0 ? &st->pinf : &st->ninf) += 1;
    return;
  }
  welford(x, st->nvalues - st->inf, &st->mean, &st->m2);
}

static void add(td__show_stats *st, td_dtype dt, const uint8_t *p) {
  switch (kind_of(dt)) {
  case K_BOOL: {
    int b = p[0] != 0;
    st->ntrue += (uint64_t)b;
    st->zeros += (uint64_t)!b;
    welford(b, ++st->nvalues, &st->mean, &st->m2);
    break;
  }
  case K_INT: {
    int64_t x = load_int(dt, p);
    st->zeros += x == 0;
    if (st->nvalues == 0 || x < st->imin)
      st->imin = x;
    if (st->nvalues == 0 || x > st->imax)
      st->imax = x;
    welford((double)x, ++st->nvalues, &st->mean, &st->m2);
    break;
  }
  case K_UINT: {
    uint64_t x = load_uint(dt, p);
    st->zeros += x == 0;
    if (st->nvalues == 0 || x < st->umin)
      st->umin = x;
    if (st->nvalues == 0 || x > st->umax)
      st->umax = x;
    welford((double)x, ++st->nvalues, &st->mean, &st->m2);
    break;
  }
  case K_FLOAT:
    add_float(st, load_float(dt, p));
    break;
  case K_COMPLEX: {
    td_dtype pd = part_dtype(dt);
    double re = load_float(pd, p), im = load_float(pd, p + td_dtype_size(pd));
    if (isnan(re) || isnan(im)) {
      st->nan++;
      break;
    }
    st->inf += isinf(re) || isinf(im);
    st->zeros += re == 0 && im == 0;
    st->nvalues++;
    welford(re, st->nvalues, &st->mean, &st->m2);
    welford(im, st->nvalues, &st->mean_im, &st->m2_im);
    break;
  }
  }
}

int td__show_stats_read(const td_view *v, const void *base, int64_t sample,
                        td__show_stats *st) {
  memset(st, 0, sizeof(*st));
  int64_t total = td_view_numel(v);
  if (total < 0)
    return (int)total;
  int64_t n = total;
  if (sample > 0 && sample < total)
    n = sample;
  else if (sample == 0 && total > TD__SHOW_LIMIT)
    n = TD__SHOW_LIMIT;
  st->total = total;
  st->count = n;
  st->sampled = n < total;
  const uint8_t *b = base;
  size_t isz = td_dtype_size(v->dtype);
  if (st->sampled) {
    for (int64_t i = 0; i < n; i++)
      add(st, v->dtype, elem_at(v, b, (int64_t)((__int128)i * total / n)));
    return 0;
  }
  /* Every element, in order: an odometer over the dims. */
  int64_t idx[TD_MAX_DIMS] = {0};
  int64_t off = v->offset;
  for (int64_t k = 0; k < n; k++) {
    add(st, v->dtype, b + (size_t)off * isz);
    for (int32_t d = v->ndim - 1; d >= 0; d--) {
      if (++idx[d] < v->shape[d]) {
        off += v->stride[d];
        break;
      }
      off -= (v->shape[d] - 1) * v->stride[d];
      idx[d] = 0;
    }
  }
  return 0;
}

double td__show_mean(const td__show_stats *st) {
  if (st->nvalues == 0 || (st->pinf && st->ninf))
    return NAN;
  if (st->pinf || st->ninf)
    return st->pinf ? INFINITY : -INFINITY;
  return st->mean;
}

double td__show_std(const td__show_stats *st) {
  if (st->nvalues == 0 || st->pinf || st->ninf)
    return NAN;
  return sqrt((st->m2 + st->m2_im) / (double)st->nvalues);
}

/* ---- shortest decimals ---- */

/* Bits of precision (the leading one included) and least normal exponent
 * of a float dtype. */
static void float_format(td_dtype dt, int *prec, int *emin) {
  switch (dt) {
  case TD_FLOAT16:
    *prec = 11, *emin = -14;
    break;
  case TD_BFLOAT16:
    *prec = 8, *emin = -126;
    break;
  case TD_FLOAT8_E4M3FN:
    *prec = 4, *emin = -6;
    break;
  case TD_FLOAT8_E5M2:
    *prec = 3, *emin = -14;
    break;
  case TD_FLOAT32:
    *prec = 24, *emin = -126;
    break;
  default:
    *prec = 53, *emin = -1022;
    break;
  }
}

/* Whether y, read from a decimal, rounds to ax (finite, >= 0) in dt. */
static int reads_back(td_dtype dt, double ax, double y) {
  if (dt == TD_FLOAT64)
    return y == ax;
  if (dt == TD_FLOAT32)
    return (float)y == (float)ax;
  int prec, emin, e = 0;
  float_format(dt, &prec, &emin);
  frexp(ax, &e);
  int lead = ax == 0 || e - 1 < emin ? emin : e - 1;
  double ulp = ldexp(1, lead - (prec - 1)), down = ulp;
  if (ax == ldexp(1, lead) && lead > emin)
    down = ulp / 2; /* the gap below a power of two is half */
  double lo = ax - down / 2, hi = ax + ulp / 2;
  if (y > lo && y < hi)
    return 1;
  /* A tie goes to the even mantissa. */
  return (y == lo || y == hi) && fmod(ax / ulp, 2) == 0;
}

/* Sets dig to the shortest digits (no trailing zeros, "0" for zero) that
 * read back as ax (finite, >= 0) in dt, and *exp10 to the power of ten of
 * the first: ax ~ 0.d1d2... * 10^(exp10 + 1). */
static void shortest_digits(td_dtype dt, double ax, char dig[24], int *exp10) {
  char tmp[40];
  for (int p = 1; p <= 17; p++) {
    snprintf(tmp, sizeof(tmp), "%.*e", p - 1, ax);
    if (reads_back(dt, ax, strtod(tmp, NULL)))
      break;
  }
  size_t n = 0;
  const char *q = tmp;
  for (; *q && *q != 'e'; q++)
    if (isdigit((unsigned char)*q))
      dig[n++] = *q;
  while (n > 1 && dig[n - 1] == '0')
    n--;
  dig[n] = '\0';
  *exp10 = *q == 'e' ? atoi(q + 1) : 0;
}

/* Writes ax (finite, >= 0) positionally: the integer part into ip (exact
 * when ax is a whole number below 1e16, as numpy writes one), the
 * fraction's digits (maybe none) into fp. */
static void positional(const char *dig, int e, double ax, char ip[40],
                       char fp[40]) {
  int nd = (int)strlen(dig);
  if (e < 0) {
    snprintf(ip, 40, "0");
    snprintf(fp, 40, "%.*s%s", -e - 1 < 30 ? -e - 1 : 30,
             "000000000000000000000000000000", dig);
  } else if (e + 1 >= nd) {
    if (ax < 1e16)
      snprintf(ip, 40, "%.0f", ax);
    else
      snprintf(ip, 40, "%s%.*s", dig, e + 1 - nd,
               "0000000000000000000000000000000");
    fp[0] = '\0';
  } else {
    snprintf(ip, 40, "%.*s", e + 1, dig);
    snprintf(fp, 40, "%s", dig + e + 1);
  }
}

char *td__show_shortest(td_dtype dtype, double x, char *buf, size_t len) {
  if (isnan(x)) {
    snprintf(buf, len, "nan");
    return buf;
  }
  if (isinf(x)) {
    snprintf(buf, len, "%sinf", x < 0 ? "-" : "");
    return buf;
  }
  char dig[24], ip[40], fp[40];
  int e;
  double ax = fabs(x);
  shortest_digits(part_dtype(dtype), ax, dig, &e);
  const char *sign = signbit(x) ? "-" : "";
  if (ax != 0 && (ax < 1e-4 || ax >= 1e16)) {
    snprintf(buf, len, "%s%c%s%se%c%02d", sign, dig[0], dig[1] ? "." : "",
             dig + 1, e < 0 ? '-' : '+', abs(e));
    return buf;
  }
  positional(dig, e, ax, ip, fp);
  snprintf(buf, len, "%s%s%s%s", sign, ip, fp[0] ? "." : "", fp);
  return buf;
}

/* ---- numpy's layout of an array's floats ---- */

#define SHOW_EDGE 3 /* elements shown at each end of a long view */
#define SHOW_MAX (2 * SHOW_EDGE)

/* One numpy FloatingFormat: positional or scientific for every element,
 * the width of the part before the point and of the part after it. */
typedef struct ffmt {
  td_dtype dt;
  int sci, plus;
  int pad_l, pad_r, frac_digits, exp_digits;
} ffmt;

#define SHOW_PRECISION 8 /* numpy's default: digits after the point */

/* Sets dig and *exp10 as shortest_digits does, but rounded (from the exact
 * value, ties to even, as numpy's Dragon4 with a cutoff) to at most
 * SHOW_PRECISION digits after the point: positional when sci is 0, after the
 * first digit when it is 1. Leaves them unchanged when they fit. */
static void cut_digits(int sci, double ax, char dig[24], int *exp10) {
  int nd = (int)strlen(dig);
  int frac = sci ? nd - 1 : nd - 1 - *exp10;
  if (frac <= SHOW_PRECISION)
    return;
  char tmp[400];
  size_t n = 0;
  const char *q;
  if (sci) {
    snprintf(tmp, sizeof(tmp), "%.*e", SHOW_PRECISION, ax);
  } else {
    snprintf(tmp, sizeof(tmp), "%.*f", SHOW_PRECISION, ax);
    /* The decimal exponent of the rounded value: its first non-zero digit. */
    const char *dot = strchr(tmp, '.');
    const char *first = tmp;
    while (*first == '0' || *first == '.')
      first++;
    if (*first == '\0') { /* rounded to zero */
      snprintf(dig, 24, "0");
      *exp10 = 0;
      return;
    }
    *exp10 = first < dot ? (int)(dot - first) - 1 : -(int)(first - dot);
    for (q = first; *q && n < 23; q++)
      if (isdigit((unsigned char)*q))
        dig[n++] = *q;
    goto trim;
  }
  for (q = tmp; *q && *q != 'e' && n < 23; q++)
    if (isdigit((unsigned char)*q))
      dig[n++] = *q;
  q = strchr(tmp, 'e');
  *exp10 = q ? atoi(q + 1) : 0;
trim:
  while (n > 1 && dig[n - 1] == '0')
    n--;
  dig[n] = '\0';
}

/* A finite value split for layout: sign and integer part, fraction, and
 * (scientific) exponent. */
static void split(const ffmt *f, double x, char ip[48], char fp[40],
                  int *exp10) {
  char dig[24], body[40];
  double ax = fabs(x);
  shortest_digits(f->dt, ax, dig, exp10);
  cut_digits(f->sci, ax, dig, exp10);
  const char *sign = signbit(x) ? "-" : f->plus ? "+" : "";
  if (f->sci) {
    snprintf(ip, 48, "%s%c", sign, dig[0]);
    snprintf(fp, 40, "%s", dig + 1);
    return;
  }
  positional(dig, *exp10, ax, body, fp);
  snprintf(ip, 48, "%s%s", sign, body);
}

/* Chooses the format numpy would for the n values xs of dtype dt. */
static void ffmt_fill(ffmt *f, td_dtype dt, const double *xs, int n, int plus) {
  memset(f, 0, sizeof(*f));
  f->dt = part_dtype(dt);
  f->plus = plus;
  double mx = 0, mn = 0;
  int any = 0, nan = 0, neginf = 0, inf = 0;
  for (int i = 0; i < n; i++) {
    if (isnan(xs[i])) {
      nan = 1;
      continue;
    }
    if (isinf(xs[i])) {
      inf = 1;
      neginf |= xs[i] < 0;
      continue;
    }
    double a = fabs(xs[i]);
    if (a == 0)
      continue;
    mx = !any || a > mx ? a : mx;
    mn = !any || a < mn ? a : mn;
    any = 1;
  }
  f->sci = any && (mx >= 1e8 || mn < 1e-4 || mx / mn > 1e3);
  f->exp_digits = 2;
  int finite = 0;
  for (int i = 0; i < n; i++) {
    if (!isfinite(xs[i]))
      continue;
    char ip[48], fp[40];
    int e;
    split(f, xs[i], ip, fp, &e);
    finite = 1;
    int l = (int)strlen(ip), r = (int)strlen(fp);
    f->pad_l = l > f->pad_l ? l : f->pad_l;
    f->frac_digits = r > f->frac_digits ? r : f->frac_digits;
    int ed = abs(e) >= 100 ? 3 : 2;
    f->exp_digits = ed > f->exp_digits ? ed : f->exp_digits;
  }
  /* The part after the point: digits, and in scientific "e+XX". */
  f->pad_r = f->frac_digits + (f->sci && finite ? 2 + f->exp_digits : 0);
  int nanlen = 3 + plus, inflen = 3 + (plus || neginf);
  if (nan && nanlen - (f->pad_r + 1) > f->pad_l)
    f->pad_l = nanlen - (f->pad_r + 1);
  if (inf && inflen - (f->pad_r + 1) > f->pad_l)
    f->pad_l = inflen - (f->pad_r + 1);
}

/* Writes x in format f into out (64 bytes): pad_l + 1 + pad_r wide. */
static void ffmt_one(const ffmt *f, double x, char out[96]) {
  char buf[192]; /* lengths past 96 are cut: widths here stay far below */
  int width = f->pad_l + 1 + f->pad_r;
  if (!isfinite(x)) {
    const char *s = isnan(x)  ? (f->plus ? "+nan" : "nan")
                    : x < 0   ? "-inf"
                    : f->plus ? "+inf"
                              : "inf";
    snprintf(out, 96, "%*s", width, s);
    return;
  }
  char ip[48], fp[40];
  int e;
  split(f, x, ip, fp, &e);
  if (f->sci)
    snprintf(buf, sizeof(buf), "%*s.%s%.*se%c%0*d", f->pad_l, ip, fp,
             f->frac_digits - (int)strlen(fp), "0000000000000000000000",
             e < 0 ? '-' : '+', f->exp_digits, abs(e));
  else
    snprintf(buf, sizeof(buf), "%*s.%-*s", f->pad_l, ip, f->pad_r, fp);
  snprintf(out, 96, "%.95s", buf);
}

/* ---- the repr ---- */

/* Whether numpy's repr of an array of dt names its dtype. */
static int repr_names_dtype(td_dtype dt) {
  return dt != TD_FLOAT64 && dt != TD_INT64 && dt != TD_BOOL &&
         dt != TD_COMPLEX128;
}

/* Appends to buf (len) at *used, cutting short. */
static void put(char *buf, size_t len, size_t *used, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t len, size_t *used, const char *fmt, ...) {
  if (*used >= len)
    return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf + *used, len - *used, fmt, ap);
  va_end(ap);
  if (k > 0)
    *used = *used + (size_t)k < len ? *used + (size_t)k : len - 1;
}

/* The flat indices shown: all up to SHOW_MAX, else the ends. Returns how
 * many; *gap is the position "..." goes before (or -1). */
static int shown(int64_t total, int64_t idx[SHOW_MAX], int *gap) {
  *gap = -1;
  if (total <= SHOW_MAX) {
    for (int64_t i = 0; i < total; i++)
      idx[i] = i;
    return (int)total;
  }
  for (int i = 0; i < SHOW_EDGE; i++) {
    idx[i] = i;
    idx[SHOW_EDGE + i] = total - SHOW_EDGE + i;
  }
  *gap = SHOW_EDGE;
  return SHOW_MAX;
}

char *td__show_repr(const td_view *v, const void *base, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  int64_t total = td_view_numel(v);
  const char *dn = td_dtype_name(v->dtype);
  if (total < 0 || dn == NULL) {
    snprintf(buf, len, "array(?)");
    return buf;
  }
  if (total == 0) {
    put(buf, len, &used, "array([], ");
    if (v->ndim != 1) {
      put(buf, len, &used, "shape=(");
      for (int32_t d = 0; d < v->ndim; d++)
        put(buf, len, &used, "%s%" PRId64, d ? ", " : "", v->shape[d]);
      put(buf, len, &used, "%s), ", v->ndim == 1 ? "," : "");
    }
    put(buf, len, &used, "dtype=%s)", dn);
    return buf;
  }
  int64_t idx[SHOW_MAX];
  int gap, n = shown(total, idx, &gap);
  const uint8_t *p[SHOW_MAX];
  for (int i = 0; i < n; i++)
    p[i] = elem_at(v, base, idx[i]);
  char items[SHOW_MAX][200];
  kind k = kind_of(v->dtype);
  if (k == K_FLOAT || k == K_COMPLEX) {
    td_dtype pd = part_dtype(v->dtype);
    double re[SHOW_MAX], im[SHOW_MAX];
    for (int i = 0; i < n; i++) {
      re[i] = load_float(pd, p[i]);
      im[i] = k == K_COMPLEX ? load_float(pd, p[i] + td_dtype_size(pd)) : 0;
    }
    ffmt fr, fi;
    ffmt_fill(&fr, pd, re, n, 0);
    if (k == K_COMPLEX)
      ffmt_fill(&fi, pd, im, n, 1);
    for (int i = 0; i < n; i++) {
      char a[96], b[96];
      ffmt_one(&fr, re[i], a);
      if (k == K_FLOAT) {
        snprintf(items[i], sizeof(items[i]), "%s", a);
        continue;
      }
      /* numpy: the imaginary part's padding goes after the 'j'. */
      ffmt_one(&fi, im[i], b);
      size_t bl = strlen(b), sp = bl;
      while (sp > 0 && b[sp - 1] == ' ')
        sp--;
      snprintf(items[i], sizeof(items[i]), "%s%.*sj%*s", a, (int)sp, b,
               (int)(bl - sp), "");
    }
  } else {
    int w = 0;
    for (int i = 0; i < n; i++) {
      if (k == K_BOOL)
        snprintf(items[i], sizeof(items[i]), "%s", p[i][0] ? "True" : "False");
      else if (k == K_INT)
        snprintf(items[i], sizeof(items[i]), "%" PRId64,
                 load_int(v->dtype, p[i]));
      else
        snprintf(items[i], sizeof(items[i]), "%" PRIu64,
                 load_uint(v->dtype, p[i]));
      int l = (int)strlen(items[i]);
      w = l > w ? l : w;
    }
    for (int i = 0; i < n; i++) { /* right-align: w is the longest */
      int l = (int)strlen(items[i]);
      memmove(items[i] + (w - l), items[i], (size_t)l + 1);
      memset(items[i], ' ', (size_t)(w - l));
    }
  }
  if (v->ndim == 0) {
    /* numpy writes a 0-d array's one element unpadded. */
    const char *s = items[0];
    while (*s == ' ')
      s++;
    put(buf, len, &used, "array(%s", s);
  } else {
    put(buf, len, &used, "array([");
    for (int i = 0; i < n; i++)
      put(buf, len, &used, "%s%s%s", i ? ", " : "", i == gap ? "..., " : "",
          items[i]);
    put(buf, len, &used, "]");
  }
  if (repr_names_dtype(v->dtype))
    put(buf, len, &used, ", dtype=%s", dn);
  put(buf, len, &used, ")");
  return buf;
}

/* ---- tensorctl show ---- */

typedef struct show_opts {
  const char *socket;
  int json;
  int64_t sample; /* 0: default; -1: --all; N: --sample N */
  td_dtype dtype; /* --dtype, or TD_DTYPE_INVALID */
  const char *target;
  const char *index; /* the second argument: INDEX, or a state dict's TENSOR */
  const char *third; /* a state dict's TENSOR's INDEX */
} show_opts;

/* A float for a JSON document: a number, or "nan", "inf", "-inf" as
 * strings (JSON has no such numbers). */
static void json_float(td_dtype dt, double x) {
  char b[64];
  td__show_shortest(dt, x, b, sizeof(b));
  if (isfinite(x))
    fputs(b, stdout);
  else
    printf("\"%s\"", b);
}

/* "float16 [64, 3] strides [3, 1] offset 0" */
static void text_view(const td_view *v) {
  printf("%s [", td_dtype_name(v->dtype));
  for (int32_t i = 0; i < v->ndim; i++)
    printf("%s%" PRId64, i ? ", " : "", v->shape[i]);
  printf("] strides [");
  for (int32_t i = 0; i < v->ndim; i++)
    printf("%s%" PRId64, i ? ", " : "", v->stride[i]);
  printf("] offset %" PRId64 "\n", v->offset);
}

/* One element, for the JSON "first" and "last" lists. */
static void json_elem(const td_view *v, const uint8_t *p) {
  switch (kind_of(v->dtype)) {
  case K_BOOL:
    printf("%s", p[0] ? "true" : "false");
    break;
  case K_INT:
    printf("%" PRId64, load_int(v->dtype, p));
    break;
  case K_UINT:
    printf("%" PRIu64, load_uint(v->dtype, p));
    break;
  case K_FLOAT:
    json_float(v->dtype, load_float(v->dtype, p));
    break;
  case K_COMPLEX: {
    td_dtype pd = part_dtype(v->dtype);
    putchar('[');
    json_float(pd, load_float(pd, p));
    putchar(',');
    json_float(pd, load_float(pd, p + td_dtype_size(pd)));
    putchar(']');
    break;
  }
  }
}

static void print_json(const char *key, const td_state_dict_entry *tensor,
                       const td_storage *s, int whole, const td_view *src,
                       const char *index, const td_view *v, const void *base,
                       const td__show_stats *st) {
  printf("{\"key\":");
  if (key != NULL)
    td__cli_json_str(key);
  else
    printf("null");
  if (tensor != NULL) {
    printf(",\"tensor\":");
    td__cli_json_str(tensor->name);
    printf(",\"region\":%u", tensor->region);
  }
  printf(",\"storage\":{\"id\":%" PRIu64 ",\"nbytes\":%zu,\"device\":\"cpu\"}"
         ",\"whole_storage\":%s,\"source_view\":",
         td_storage_id(s), td_storage_nbytes(s), whole ? "true" : "false");
  td__cli_json_view(src);
  printf(",\"index\":");
  if (index != NULL)
    td__cli_json_str(index);
  else
    printf("null");
  printf(",\"view\":");
  td__cli_json_view(v);
  printf(",\"total\":%" PRId64 ",\"count\":%" PRId64 ",\"sampled\":%s",
         st->total, st->count, st->sampled ? "true" : "false");
  printf(",\"stats\":{\"zeros\":%" PRIu64, st->zeros);
  kind k = kind_of(v->dtype);
  td_dtype pd = part_dtype(v->dtype);
  if (k == K_FLOAT || k == K_COMPLEX)
    printf(",\"nan\":%" PRIu64 ",\"inf\":%" PRIu64, st->nan, st->inf);
  if (k == K_BOOL)
    printf(",\"true\":%" PRIu64 ",\"false\":%" PRIu64, st->ntrue, st->zeros);
  if (k != K_COMPLEX && k != K_BOOL) {
    printf(",\"min\":");
    if (st->nvalues == 0)
      printf("null");
    else if (k == K_INT)
      printf("%" PRId64, st->imin);
    else if (k == K_UINT)
      printf("%" PRIu64, st->umin);
    else
      json_float(v->dtype, st->fmin);
    printf(",\"max\":");
    if (st->nvalues == 0)
      printf("null");
    else if (k == K_INT)
      printf("%" PRId64, st->imax);
    else if (k == K_UINT)
      printf("%" PRIu64, st->umax);
    else
      json_float(v->dtype, st->fmax);
  }
  printf(",\"mean\":");
  if (st->nvalues == 0) {
    printf("null");
  } else if (k == K_COMPLEX) {
    putchar('[');
    json_float(TD_FLOAT64, st->mean);
    putchar(',');
    json_float(TD_FLOAT64, st->mean_im);
    putchar(']');
  } else {
    json_float(TD_FLOAT64, td__show_mean(st));
  }
  printf(",\"std\":");
  if (st->nvalues == 0)
    printf("null");
  else
    json_float(TD_FLOAT64, td__show_std(st));
  (void)pd;
  /* first: the first 3 elements; last: the last 3 of those after them. */
  int64_t nf = st->total < SHOW_EDGE ? st->total : SHOW_EDGE;
  int64_t nl = st->total - nf < SHOW_EDGE ? st->total - nf : SHOW_EDGE;
  printf("},\"first\":[");
  for (int64_t i = 0; i < nf; i++) {
    if (i)
      putchar(',');
    json_elem(v, elem_at(v, base, i));
  }
  printf("],\"last\":[");
  for (int64_t i = st->total - nl; i < st->total; i++) {
    if (i > st->total - nl)
      putchar(',');
    json_elem(v, elem_at(v, base, i));
  }
  char repr[2048];
  printf("],\"repr\":");
  td__cli_json_str(td__show_repr(v, base, repr, sizeof(repr)));
  printf("}\n");
}

/* A mean or std for text: %.6g, with "nan" and "inf" spelt alike
 * everywhere (printf may write "-nan"). */
static const char *g6(double x, char *buf, size_t len) {
  if (isnan(x))
    snprintf(buf, len, "nan");
  else
    snprintf(buf, len, "%.6g", x);
  return buf;
}

/* A statistic of a float view for text: shortest in the dtype. */
static const char *ftext(td_dtype dt, double x, char *buf, size_t len) {
  return td__show_shortest(dt, x, buf, len);
}

static void print_text(const td_view *v, const void *base,
                       const td__show_stats *st) {
  kind k = kind_of(v->dtype);
  char a[64], b[64], c[64];
  printf("count  %" PRId64, st->count);
  if (k == K_BOOL)
    printf("   true %" PRIu64 "   false %" PRIu64 "\n", st->ntrue, st->zeros);
  else if (k == K_INT || k == K_UINT)
    printf("   zeros %" PRIu64 "\n", st->zeros);
  else
    printf("   zeros %" PRIu64 "   nan %" PRIu64 "   inf %" PRIu64 "\n",
           st->zeros, st->nan, st->inf);
  if (st->sampled)
    printf("sampled %" PRId64 " of %" PRId64
           " elements, evenly spaced (--all reads every one)\n",
           st->count, st->total);
  if (k == K_BOOL) {
    /* nothing more: the counts say it all */
  } else if (st->nvalues == 0) {
    printf("min    -   max -   mean -   std -\n");
  } else if (k == K_COMPLEX) {
    printf("mean   (%s%s%sj)   std %s\n", g6(st->mean, a, sizeof(a)),
           signbit(st->mean_im) || isnan(st->mean_im) ? "" : "+",
           g6(st->mean_im, b, sizeof(b)), g6(td__show_std(st), c, sizeof(c)));
  } else {
    if (k == K_INT)
      printf("min    %" PRId64 "   max %" PRId64, st->imin, st->imax);
    else if (k == K_UINT)
      printf("min    %" PRIu64 "   max %" PRIu64, st->umin, st->umax);
    else
      printf("min    %s   max %s", ftext(v->dtype, st->fmin, a, sizeof(a)),
             ftext(v->dtype, st->fmax, b, sizeof(b)));
    printf("   mean %s   std %s\n", g6(td__show_mean(st), a, sizeof(a)),
           g6(td__show_std(st), b, sizeof(b)));
  }
  char repr[2048];
  printf("values %s\n", td__show_repr(v, base, repr, sizeof(repr)));
}

/* For the tests only: with TENSORCTL_TEST_STALL="W,R" (two inherited fds),
 * once show holds the storage it writes a byte to W and waits for EOF on R,
 * so that a test can free the storage's other references meanwhile. */
static void test_stall(void) {
  const char *e = getenv("TENSORCTL_TEST_STALL");
  int w, r;
  if (e == NULL || sscanf(e, "%d,%d", &w, &r) != 2)
    return;
  char ch;
  if (write(w, "x", 1) != 1) {
    /* the test is gone: go on */
  }
  close(w);
  while (read(r, &ch, 1) > 0)
    ;
  close(r);
}

void td__show_usage(FILE *f) {
  fprintf(f, "usage: tensorctl show [--json] [--sample N | --all] "
             "[--dtype DTYPE] [--socket PATH] KEY|ID [INDEX]\n"
             "       tensorctl show [options] KEY [TENSOR [INDEX]]  (a state "
             "dict)\n"
             "\n"
             "A view's statistics and its first and last elements, as numpy\n"
             "writes them. KEY is looked up read-only without waiting; ID\n"
             "shows the whole storage as uint8 (or --dtype).\n"
             "A KEY published by tensord.torch.publish_state_dict lists its\n"
             "tensors (name, dtype, shape, bytes); with TENSOR, show shows\n"
             "that tensor (and INDEX indexes it). Its ID shows the raw bytes.\n"
             "A model's NAME (tensorctl load) shows its manifest: version,\n"
             "source, metadata, shards and a table of its tensors; NAME/TENSOR\n"
             "shows one tensor (a key of its own).\n"
             "\n"
             "  INDEX          Python's, e.g. '[0, :, 2:5]', '[..., -1]', "
             "'[::2, None]'\n"
             "  --sample N     read N elements, evenly spaced (default: all "
             "up to\n"
             "                 64 Mi elements, a sample of 64 Mi past that)\n"
             "  --all          read every element, whatever the size\n"
             "  --dtype DTYPE  see the view's bytes as DTYPE "
             "(Tensor.view(dtype))\n"
             "  --json         one JSON document (see docs/cli.md)\n"
             "  --             what follows is KEY|ID and INDEX, even if it "
             "begins\n"
             "                 with '--'\n");
}

/* Parses show's arguments into *o. Returns 0, or 2 (usage, said). */
static int parse_args(int argc, char **argv, show_opts *o) {
  int dashdash = 0; /* after "--", only KEY|ID and INDEX */
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (dashdash) {
      /* an argument, below */
    } else if (strcmp(a, "--") == 0) {
      dashdash = 1;
      continue;
    } else if (strcmp(a, "--json") == 0) {
      o->json = 1;
      continue;
    } else if (strcmp(a, "--all") == 0) {
      o->sample = -1;
      continue;
    } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      td__show_usage(stdout);
      exit(0);
    } else if (strcmp(a, "--socket") == 0 || strcmp(a, "--sample") == 0 ||
               strcmp(a, "--dtype") == 0) {
      if (i + 1 >= argc) {
        fprintf(stderr, "tensorctl show: %s needs a value\n", a);
        return 2;
      }
      const char *val = argv[++i];
      if (a[2] == 's' && a[3] == 'o') {
        o->socket = val;
      } else if (a[2] == 's') {
        int64_t n;
        if (parse_int(val, strlen(val), &n) < 0 || n < 1) {
          fprintf(stderr,
                  "tensorctl show: --sample '%s': not a count of 1 or more\n",
                  val);
          return 2;
        }
        o->sample = n;
      } else {
        o->dtype = td_dtype_from_name(val);
        if (o->dtype == TD_DTYPE_INVALID) {
          fprintf(stderr, "tensorctl show: --dtype '%s': unknown dtype\n", val);
          return 2;
        }
      }
      continue;
    } else if (a[0] == '-' && a[1] == '-') {
      fprintf(stderr, "tensorctl show: unknown option '%s'\n", a);
      return 2;
    }
    if (o->target == NULL) {
      o->target = a;
    } else if (o->index == NULL) {
      o->index = a;
    } else if (o->third == NULL) {
      o->third = a; /* a state dict's TENSOR INDEX, else refused below */
    } else {
      fprintf(stderr, "tensorctl show: unexpected argument '%s'\n", a);
      return 2;
    }
  }
  if (o->target == NULL) {
    fprintf(stderr, "tensorctl show: needs a KEY or an ID\n");
    td__show_usage(stderr);
    return 2;
  }
  return 0;
}

/* Takes a read-only reference to o->target (an id, else a key) without
 * waiting, and sets *v to the published view (a key; checked against the
 * storage, --dtype not applied) or the whole storage (an id, as --dtype
 * says), *whole to whether it is the latter. Returns 0, or a TD_E* code
 * with the reason in msg. */
static int resolve(td_client *c, const show_opts *o, td_storage **s, td_view *v,
                   int *whole, const char **key, char *msg, size_t len) {
  const unsigned flags = TD_RDONLY | TD_LAZY;
  int err = TD_ENOENT;
  *whole = 0;
  *key = o->target;
  if (td__cli_is_digits(o->target)) {
    errno = 0;
    uint64_t id = strtoull(o->target, NULL, 10);
    err = errno == 0 ? td_storage_open(c, id, flags, s) : TD_ENOENT;
    if (err == 0) {
      *whole = 1;
      *key = NULL;
    } else if (err == TD_ENOENT) { /* maybe a key made of digits */
      err = td_lookup(c, o->target, flags, 0, s, v);
      if (err == TD_ENOENT)
        return td__cli_msg(msg, len, err,
                           "storage %s: no such storage (and no key '%s')",
                           o->target, o->target);
    }
  } else {
    err = td_lookup(c, o->target, flags, 0, s, v);
  }
  if (err < 0)
    return td__cli_msg(msg, len, err, "%s", td_last_error(c));
  if (td_storage_device(*s) != TD_CPU) {
    err = td__cli_msg(msg, len, TD_ENODEV,
                      "storage %" PRIu64 " is a GPU's: show reads CPU "
                      "storages only",
                      td_storage_id(*s));
    goto fail;
  }
  if (*whole) {
    td_dtype dt = o->dtype != TD_DTYPE_INVALID ? o->dtype : TD_UINT8;
    int64_t n = (int64_t)(td_storage_nbytes(*s) / td_dtype_size(dt));
    if ((err = td_view_contiguous(dt, 1, &n, v)) < 0) {
      td__cli_msg(msg, len, err, "%s", td_view_last_error());
      goto fail;
    }
  }
  /* A key's view is checked before its bytes are read (to see whether it
   * is a state dict), and --dtype applies after (resolve_key). */
  if ((err = td_view_check(v, td_storage_nbytes(*s))) < 0) {
    td__cli_msg(msg, len, err, "%s", td_view_last_error());
    goto fail;
  }
  return 0;
fail:
  td_storage_release(*s);
  *s = NULL;
  return err;
}

/* What show does with a key that holds a state dict: lists its tensors
 * (o->index NULL), or sets *v to tensor o->index's view (--dtype applied),
 * *index to the INDEX after it and *tensor to it, to be shown as any view.
 * *sd is parsed here and the caller's to free. Returns 0 with *listed 1 when
 * it listed, 0 to show *v, or a TD_E* code with msg. */
static int state_dict(const show_opts *o, const td_storage *s, td_view *v,
                      td_state_dict **sd, td_state_dict_entry *tensor,
                      const char **index, int *listed, char *msg, size_t len) {
  char key[TD_KEY_MAX + 1], name[128];
  size_t i;
  td__cli_printable(o->target, key, sizeof(key));
  int err = td_state_dict_parse(s, v, sd);
  if (err == TD_ENODEV)
    return td__cli_msg(msg, len, err, "key '%s' holds a state dict whose %s",
                       key, td_last_error(NULL));
  if (err < 0)
    return td__cli_msg(
        msg, len, err,
        "key '%s': a corrupt state dict: %s (tensorctl show %" PRIu64
        " shows its raw bytes)",
        key, td_last_error(NULL), td_storage_id(s));
  *listed = o->index == NULL;
  if (*listed) {
    if (o->dtype != TD_DTYPE_INVALID)
      return td__cli_msg(msg, len, TD_EINVAL,
                         "key '%s' holds a state dict: --dtype applies to one "
                         "of its tensors (tensorctl show %s TENSOR --dtype %s)",
                         key, key, td_dtype_name(o->dtype));
    return 0;
  }
  size_t n = td_state_dict_count(*sd);
  if (td_state_dict_find(*sd, o->index, &i) < 0)
    return td__cli_msg(
        msg, len, TD_ENOENT,
        "key '%s' holds a state dict with no tensor '%s' "
        "(tensorctl show %s lists its %zu tensor%s; tensorctl show "
        "%" PRIu64 " [INDEX] shows its raw bytes)",
        key, td__cli_printable(o->index, name, sizeof(name)), key, n,
        n == 1 ? "" : "s", td_storage_id(s));
  td_state_dict_tensor(*sd, i, tensor);
  td_view t;
  if ((err = td_state_dict_view(*sd, i, &t)) < 0)
    return td__cli_msg(msg, len, err, "%s", td_last_error(NULL));
  if (o->dtype != TD_DTYPE_INVALID &&
      (err = td_view_reinterpret(&t, o->dtype)) < 0)
    return td__cli_msg(msg, len, err, "--dtype %s: %s", td_dtype_name(o->dtype),
                       td_view_last_error());
  if ((err = td_view_check(&t, td_storage_nbytes(s))) < 0)
    return td__cli_msg(msg, len, err, "%s", td_view_last_error());
  *v = t;
  *index = o->third;
  return 0;
}

static void print_listing(const char *key, const td_storage *s,
                          const td_view *src, const td_state_dict *sd,
                          int json) {
  if (json) {
    printf("{\"key\":");
    td__cli_json_str(key);
    printf(",\"storage\":{\"id\":%" PRIu64 ",\"nbytes\":%zu,\"device\":\"cpu\"}"
           ",\"whole_storage\":false,\"source_view\":",
           td_storage_id(s), td_storage_nbytes(s));
    td__cli_json_view(src);
    printf(",\"state_dict\":");
    td__show_sd_json(sd);
    printf("}\n");
    return;
  }
  char hs[32], kb[TD_KEY_MAX + 1];
  td__cli_printable(key, kb, sizeof(kb));
  printf("key '%s' -> storage %" PRIu64 " (%s, cpu)\n", kb, td_storage_id(s),
         td__cli_bytes(td_storage_nbytes(s), hs, sizeof(hs)));
  printf("view   ");
  text_view(src);
  size_t nt = td_state_dict_count(sd), nr = td_state_dict_nregions(sd);
  printf("state dict: %zu tensor%s in %zu region%s (tensorctl show %s TENSOR "
         "[INDEX] shows one)\n",
         nt, nt == 1 ? "" : "s", nr, nr == 1 ? "" : "s", kb);
  td__show_sd_text(sd, "");
}

/* "[16, 8]" into buf. */
static char *shape_text(const td_state_dict_entry *t, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int32_t d = 0; d < t->ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%" PRId64,
                             d ? ", " : "", t->shape[d]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
  return buf;
}

/* Characters (UTF-8 code points) of s: what a column of it takes, but for
 * the rare wide ones. */
static int width(const char *s) {
  int n = 0;
  for (; *s; s++)
    n += ((unsigned char)*s & 0xc0) != 0x80;
  return n;
}

void td__show_sd_text(const td_state_dict *sd, const char *indent) {
  int wn = 4, wd = 5, ws_ = 5; /* NAME, DTYPE, SHAPE */
  char sh[400], name[TD_STATE_DICT_NAME_MAX + 1], size[32];
  td_state_dict_entry t;
  size_t nt = td_state_dict_count(sd);
  for (size_t i = 0; i < nt && td_state_dict_tensor(sd, i, &t) == 0; i++) {
    int n = width(t.name);
    wn = n > wn ? (n < 48 ? n : 48) : wn;
    n = (int)strlen(t.dtype_name);
    wd = n > wd ? n : wd;
    n = (int)strlen(shape_text(&t, sh, sizeof(sh)));
    ws_ = n > ws_ ? (n < 32 ? n : 32) : ws_;
  }
  printf("%s%-*s  %-*s  %-*s  %s\n", indent, wn, "NAME", wd, "DTYPE", ws_,
         "SHAPE", "BYTES");
  for (size_t i = 0; i < nt && td_state_dict_tensor(sd, i, &t) == 0; i++) {
    td__cli_printable(t.name, name, sizeof(name));
    int pad = wn - width(name);
    printf("%s%s%*s  %-*s  %-*s  %s\n", indent, name, pad > 0 ? pad : 0, "", wd,
           t.dtype_name, ws_, shape_text(&t, sh, sizeof(sh)),
           t.itemsize ? td__cli_bytes(t.nbytes, size, sizeof(size)) : "?");
  }
}

void td__show_sd_json(const td_state_dict *sd) {
  td_state_dict_entry t;
  uint64_t off, nbytes;
  size_t nt = td_state_dict_count(sd), nr = td_state_dict_nregions(sd);
  printf("{\"tensors\":[");
  for (size_t i = 0; i < nt && td_state_dict_tensor(sd, i, &t) == 0; i++) {
    printf("%s{\"name\":", i ? "," : "");
    td__cli_json_str(t.name);
    printf(",\"dtype\":");
    td__cli_json_str(t.dtype_name);
    printf(",\"shape\":[");
    for (int32_t d = 0; d < t.ndim; d++)
      printf("%s%" PRId64, d ? "," : "", t.shape[d]);
    printf("],\"stride\":[");
    for (int32_t d = 0; d < t.ndim; d++)
      printf("%s%" PRId64, d ? "," : "", t.stride[d]);
    printf("],\"storage_offset\":%" PRId64 ",\"region\":%u,\"nbytes\":",
           t.storage_offset, t.region);
    if (t.itemsize)
      printf("%" PRIu64 "}", t.nbytes);
    else
      printf("null}");
  }
  printf("],\"regions\":[");
  for (size_t i = 0; i < nr && td_state_dict_region(sd, i, &off, &nbytes) == 0;
       i++)
    printf("%s{\"offset\":%" PRIu64 ",\"nbytes\":%" PRIu64 "}", i ? "," : "",
           off, nbytes);
  printf("]}");
}

/* Whether v (a key's, checked against its storage at base) is a model's
 * manifest (tensorctl load). */
static int is_model(const td_view *v, const uint8_t *base) {
  return v->dtype == TD_UINT8 && v->ndim == 1 && v->stride[0] == 1 &&
         v->shape[0] >= 16 && memcmp(base + v->offset, "TDMODEL1", 8) == 0;
}

static int64_t jint(json_t *o, const char *k) {
  json_t *v = json_object_get(o, k);
  return json_is_integer(v) ? (int64_t)json_integer_value(v) : 0;
}

static const char *jstr(json_t *o, const char *k) {
  json_t *v = json_object_get(o, k);
  return json_is_string(v) ? json_string_value(v) : "";
}

/* Shows model key: attached with td_model_open (which checks the manifest
 * as untrusted bytes), its manifest as JSON or as text. Returns 0, or a
 * TD_E* code with msg. */
static int show_model(td_client *c, const char *key, int json, char *msg,
                      size_t len) {
  td_model *m = NULL;
  char kb[TD_KEY_MAX + 1], b1[160], b2[160], hs[32];
  td__cli_printable(key, kb, sizeof(kb));
  int err = td_model_open(c, key, TD_RDONLY | TD_LAZY, 0, &m);
  if (err < 0)
    return td__cli_msg(msg, len, err, "%s", td_last_error(c));
  const char *text = td_model_manifest(m);
  if (json) {
    printf("{\"key\":");
    td__cli_json_str(key);
    printf(",\"model\":%s}\n", text);
    td_model_close(m);
    return 0;
  }
  /* td_model_open checked this text, within its bound on memory. */
  json_error_t e;
  json_t *root = json_loads(text, 0, &e);
  json_t *src = json_object_get(root, "source");
  json_t *shards = json_object_get(root, "shards");
  json_t *meta = json_object_get(root, "metadata");
  printf("model '%s': version %" PRIu64 ", %zu tensors, %s\n", kb,
         td_model_version(m), td_model_count(m), jstr(root, "device"));
  uint64_t total = 0;
  for (size_t i = 0; i < json_array_size(shards); i++)
    total += (uint64_t)jint(json_array_get(shards, i), "nbytes");
  time_t t = (time_t)(jint(root, "loaded_ms") / 1000);
  struct tm tm;
  char when[64] = "?";
  if (localtime_r(&t, &tm) != NULL)
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
  printf("loaded   %s\n", when);
  printf("source   %s (%s, %s)\n",
         td__cli_printable(jstr(src, "path"), b1, sizeof(b1)),
         jstr(src, "kind"),
         td__cli_bytes((uint64_t)jint(src, "size"), hs, sizeof(hs)));
  const char *mk;
  json_t *mv;
  printf("metadata");
  if (json_object_size(meta) == 0)
    printf(" (none)");
  json_object_foreach(meta, mk, mv) {
    char *dump = json_is_string(mv) ? NULL : json_dumps(mv, JSON_ENCODE_ANY);
    printf(" %s=%s", td__cli_printable(mk, b1, sizeof(b1)),
           td__cli_printable(dump ? dump : json_string_value(mv), b2,
                             sizeof(b2)));
    free(dump);
  }
  printf("\nshards   %zu, %s\n", json_array_size(shards),
         td__cli_bytes(total, hs, sizeof(hs)));
  for (size_t i = 0; i < json_array_size(shards); i++) {
    json_t *sh = json_array_get(shards, i);
    printf("  %-3zu %s  %s\n", i,
           td__cli_printable(jstr(sh, "key"), b1, sizeof(b1)),
           td__cli_bytes((uint64_t)jint(sh, "nbytes"), hs, sizeof(hs)));
  }
  int wn = 4;
  for (size_t i = 0; i < td_model_count(m); i++) {
    const char *n;
    td_model_tensor(m, i, &n, NULL, NULL);
    int l = (int)strlen(n);
    wn = l > wn ? (l < 48 ? l : 48) : wn;
  }
  printf("%-*s  %-8s  %-20s  %-10s  %s\n", wn, "NAME", "DTYPE", "SHAPE",
         "BYTES", "SHARD");
  json_t *tensors = json_object_get(root, "tensors");
  for (size_t i = 0; i < td_model_count(m); i++) {
    const char *n;
    td_view v;
    td_model_tensor(m, i, &n, NULL, &v);
    json_t *te = json_object_get(tensors, n);
    char shape[128];
    size_t used = (size_t)snprintf(shape, sizeof(shape), "[");
    for (int32_t d = 0; d < v.ndim && used < sizeof(shape); d++)
      used += (size_t)snprintf(shape + used, sizeof(shape) - used,
                               "%s%" PRId64, d ? ", " : "", v.shape[d]);
    if (used < sizeof(shape))
      snprintf(shape + used, sizeof(shape) - used, "]");
    printf("%-*s  %-8s  %-20s  %-10s  %" PRId64 "\n", wn,
           td__cli_printable(n, b1, sizeof(b1)), jstr(te, "dtype"), shape,
           td__cli_bytes((uint64_t)(jint(te, "end") - jint(te, "begin")), hs,
                         sizeof(hs)),
           jint(te, "shard"));
  }
  json_decref(root);
  td_model_close(m);
  return 0;
}

int td__show_main(const char *socket, int json, int argc, char **argv) {
  show_opts o = {socket, json, 0, TD_DTYPE_INVALID, NULL, NULL, NULL};
  int rc = parse_args(argc, argv, &o);
  if (rc != 0)
    return rc;
  char msg[TD__CLI_MSG_MAX];
  td_client *c = NULL;
  td_storage *s = NULL;
  td_state_dict *sd = NULL;
  td_state_dict_entry te;
  const td_state_dict_entry *tensor = NULL;
  if (td_connect(o.socket, &c) < 0) {
    fprintf(stderr, "tensorctl: %s\n", td_last_error(NULL));
    return 1;
  }
  td_view src, v;
  int whole;
  const char *key, *index = o.index;
  int err = resolve(c, &o, &s, &src, &whole, &key, msg, sizeof(msg));
  if (err < 0)
    goto fail;
  /* The handle keeps the mapping, and so the bytes, alive whatever other
   * processes do with the storage until it is released. */
  test_stall();
  const void *base = td_storage_data(s);
  if (!whole && o.index == NULL && o.dtype == TD_DTYPE_INVALID &&
      is_model(&src, base)) {
    if ((err = show_model(c, key, o.json, msg, sizeof(msg))) < 0)
      goto fail;
    goto done;
  }
  if (!whole && td_state_dict_is(s, &src)) {
    int listed = 0;
    if ((err = state_dict(&o, s, &src, &sd, &te, &index, &listed, msg,
                          sizeof(msg))) < 0)
      goto fail;
    if (listed) {
      print_listing(key, s, &src, sd, o.json);
      goto done;
    }
    tensor = &te;
  } else if (o.third != NULL) {
    td_state_dict_free(sd);
    td_storage_release(s);
    td_close(c);
    fprintf(stderr,
            "tensorctl show: unexpected argument '%s' (a third one is an "
            "INDEX after a state dict's TENSOR)\n",
            o.third);
    return 2;
  } else if (!whole && o.dtype != TD_DTYPE_INVALID &&
             (err = td_view_reinterpret(&src, o.dtype)) < 0) {
    td__cli_msg(msg, sizeof(msg), err, "--dtype %s: %s", td_dtype_name(o.dtype),
                td_view_last_error());
    goto fail;
  }
  v = src;
  if (index != NULL && (err = td__show_index(&v, index, msg, sizeof(msg))) < 0)
    goto fail;
  td__show_stats st;
  if ((err = td__show_stats_read(&v, base, o.sample, &st)) < 0) {
    td__cli_msg(msg, sizeof(msg), err, "%s", td_view_last_error());
    goto fail;
  }
  if (o.json) {
    print_json(key, tensor, s, whole, &src, index, &v, base, &st);
  } else {
    char hs[32], kb[TD_KEY_MAX + 1];
    td__cli_bytes(td_storage_nbytes(s), hs, sizeof(hs));
    if (whole)
      printf("storage %" PRIu64 " (%s, cpu): the whole storage as %s%s\n",
             td_storage_id(s), hs, td_dtype_name(src.dtype),
             o.dtype != TD_DTYPE_INVALID ? " (--dtype)" : "");
    else
      printf("key '%s' -> storage %" PRIu64 " (%s, cpu)\n",
             td__cli_printable(key, kb, sizeof(kb)), td_storage_id(s), hs);
    if (tensor != NULL) {
      char name[TD_STATE_DICT_NAME_MAX + 1];
      printf("tensor '%s' of the state dict (region %u)\n",
             td__cli_printable(tensor->name, name, sizeof(name)),
             tensor->region);
    }
    printf("view   ");
    text_view(&src);
    if (index != NULL) {
      printf("index  %s -> ", index);
      text_view(&v);
    }
    print_text(&v, base, &st);
  }
done:
  td_state_dict_free(sd);
  td_storage_release(s);
  td_close(c);
  return 0;
fail:
  fprintf(stderr, "tensorctl show: %s\n", msg);
  td_state_dict_free(sd);
  td_storage_release(s);
  td_close(c);
  return 1;
}

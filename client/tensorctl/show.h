/* show.h: tensorctl show: Python indexing, statistics and numpy-style
 * formatting over a view of a mapped storage (docs/cli.md). Private to
 * tensorctl and its unit test. */
#ifndef TD_SHOW_H
#define TD_SHOW_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Elements read without --all or --sample: more are sampled evenly. */
#define TD__SHOW_LIMIT ((int64_t)1 << 26) /* 64 Mi */

/* Applies a Python index ("[0, :, 2:5]", "[..., None, -1]", "[::2]"; the
 * brackets may be left out) to *v with libtensord's view algebra: ints
 * (negative from the end) select, a:b:c slices (c >= 1) narrow, ... stands
 * for as many ':' as the view has dims left, None inserts a size-1 dim.
 * Returns 0, or TD_EINVAL (syntax, too many indices, bad step) or TD_ERANGE
 * (an int out of range) with msg naming the index, the dim and the values;
 * *v is unchanged on failure. */
int td__show_index(td_view *v, const char *expr, char *msg, size_t len);

/* Statistics of the elements of a view. Floats (and complex components)
 * leave NaN out of min, max, mean and std, as numpy's nan* functions do;
 * infinities count in, as there: the mean is +-inf (NaN with both signs),
 * the std NaN. std is the population one (ddof 0). */
typedef struct td__show_stats {
  int64_t total;         /* elements of the view */
  int64_t count;         /* elements read: total, or the sample's size */
  int sampled;           /* count < total */
  uint64_t zeros;        /* == 0 (complex: both parts) */
  uint64_t nan;          /* floats, complex: NaN (complex: either part) */
  uint64_t inf;          /* floats, complex: infinite, not NaN (either part) */
  uint64_t pinf, ninf;   /* floats: +inf and -inf (kept out of mean, m2) */
  uint64_t ntrue;        /* bool: elements that are true */
  uint64_t nvalues;      /* elements in min, max, mean, std (not NaN) */
  int64_t imin, imax;    /* signed ints, exact */
  uint64_t umin, umax;   /* unsigned ints, exact */
  double fmin, fmax;     /* floats */
  double mean, m2;       /* Welford's running mean and sum of squares */
  double mean_im, m2_im; /* complex: the imaginary part's */
} td__show_stats;

/* Reads the elements of v (checked against the storage by the caller) at
 * base, the storage's mapping: every one if sample is 0 and the view has at
 * most TD__SHOW_LIMIT, or sample < 0 (--all); otherwise an even strided
 * sample of sample (or TD__SHOW_LIMIT) elements: flat index i * total / n
 * for i in [0, n). Fills *st; returns 0, or TD_EINVAL for a bad view. */
int td__show_stats_read(const td_view *v, const void *base, int64_t sample,
                        td__show_stats *st);
/* Mean of the values counted (complex: the real part's); NaN if there are
 * none. */
double td__show_mean(const td__show_stats *st);
/* Population standard deviation of the values counted (complex: of the
 * distance to the mean, as numpy's std); NaN if there are none. */
double td__show_std(const td__show_stats *st);

/* Writes into buf (len bytes, cut short if too small) the shortest decimal
 * that reads back as x in dtype's own precision ("0.1" for float16's
 * 0.0999755859375), as printf's %g lays it out ("1e-05", "448", "nan",
 * "-inf"). dtype: a float dtype, or complex64/128 for a component. Returns
 * buf. */
char *td__show_shortest(td_dtype dtype, double x, char *buf, size_t len);

/* Writes numpy's repr of the view's elements in flat (row-major) order into
 * buf: all of them up to 6, else the first 3, "..." and the last 3, laid
 * out as numpy lays out an array's elements (one format for all, aligned,
 * positional or scientific by numpy's rule), "dtype=" when numpy would
 * write it: "array([-1.23,  0.5 ,  2.  ], dtype=float16)". A 0-d view is
 * "array(1.5, dtype=float16)". Returns buf. */
char *td__show_repr(const td_view *v, const void *base, char *buf, size_t len);

/* Writes the tensors of a state dict as a table to stdout, each line after
 * indent: NAME, DTYPE, SHAPE, BYTES (names with control characters shown
 * as '?'). */
void td__show_sd_text(const td_state_dict *sd, const char *indent);
/* Writes {"tensors": [{"name", "dtype", "shape", "stride",
 * "storage_offset", "region", "nbytes"}], "regions": [{"offset", "nbytes"}]}
 * to stdout ("nbytes" null where the dtype's size is not known). */
void td__show_sd_json(const td_state_dict *sd);

/* Writes show's usage (tensorctl show --help) to f. */
void td__show_usage(FILE *f);

/* tensorctl show: argv[0] is "show", options and arguments follow. socket
 * and json are what tensorctl's own options said. Returns the exit status:
 * 0, 1 (error, named on stderr) or 2 (usage). */
int td__show_main(const char *socket, int json, int argc, char **argv);

#endif /* TD_SHOW_H */

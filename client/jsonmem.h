/* jsonmem.h: parsing untrusted JSON with jansson, its tree's memory
 * bounded per parse. Private to libtensord (and tensorctl, its tests). */
#ifndef TD_CLIENT_JSONMEM_H
#define TD_CLIENT_JSONMEM_H

#include <jansson.h>
#include <stddef.h>

/* Parses the n bytes at p as one JSON value with json_loadb(flags), counting
 * what jansson allocates for it on this thread against max bytes. Returns
 * the tree (json_decref it), or NULL with *e filled and *over set to 1 when
 * it was the bound that stopped it (else 0). Thread-safe: the counts are
 * per thread.
 *
 * The count needs jansson's allocation functions, which are process-wide.
 * The first call installs counting ones (which pass every allocation
 * straight to malloc and free, counting only inside this call on this
 * thread) once, and only if the process still has jansson's defaults
 * (malloc and free): a program that set its own must keep them, since
 * memory its functions allocated would otherwise be freed by ours. In that
 * case the bound is kept by an estimate made before parsing instead (the
 * JSON's values times what jansson spends on one at most), which refuses
 * the same hostile inputs, but also a few legitimate ones close to max. */
json_t *td__json_loadb_bounded(const char *p, size_t n, size_t flags,
                               size_t max, json_error_t *e, int *over);

/* Whether the counting functions are installed (for tests). */
int td__json_counting(void);

/* What v is, for messages: "an object", "a string", ... */
const char *td__json_kind(const json_t *v);

#endif /* TD_CLIENT_JSONMEM_H */

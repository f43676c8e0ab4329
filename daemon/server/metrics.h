/* metrics.h: the daemon's counters, and their Prometheus text. */
#ifndef TD_DAEMON_METRICS_H
#define TD_DAEMON_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef struct td__server td__server;

/* Request bodies are counted by their field number in Request (10 to 24
 * now); 0 counts requests without a body this tensord knows. */
#define TD__METRIC_TYPES 32
/* Errors are counted by -code; 0 counts codes past the table. */
#define TD__METRIC_CODES 256
/* Upper bounds of the latency histogram's buckets, in nanoseconds; a last
 * bucket (+Inf) takes the rest. */
#define TD__METRIC_BUCKETS 17
extern const uint64_t td__metric_bounds_ns[TD__METRIC_BUCKETS];

/* Counters only ever grow, and change only on the loop thread: counting is
 * an increment, with no lock and no allocation. */
typedef struct td__metrics {
  uint64_t requests[TD__METRIC_TYPES];
  uint64_t errors[TD__METRIC_CODES];
  uint64_t latency[TD__METRIC_BUCKETS + 1]; /* per bucket, not cumulative */
  uint64_t latency_sum_ns;
  uint64_t latency_count;
  uint64_t lookup_waits;     /* lookups that waited: not in the histogram */
  uint64_t connects;         /* clients accepted */
  uint64_t disconnects;      /* clients closed */
  uint64_t storages_created; /* creates that succeeded */
  uint64_t bytes_created;    /* their bytes */
  uint64_t journal_syncs;    /* --state-dir journal syncs ended */
  uint64_t scrapes;          /* --metrics requests answered 200 */
} td__metrics;

static inline void td__metrics_request(td__metrics *m, int body) {
  m->requests[body > 0 && body < TD__METRIC_TYPES ? body : 0]++;
}

static inline void td__metrics_error(td__metrics *m, int code) {
  m->errors[code < 0 && code > -TD__METRIC_CODES ? -code : 0]++;
}

/* Counts a request served in ns nanoseconds. */
static inline void td__metrics_observe(td__metrics *m, uint64_t ns) {
  int i = 0;
  while (i < TD__METRIC_BUCKETS && ns > td__metric_bounds_ns[i])
    i++;
  m->latency[i]++;
  m->latency_sum_ns += ns;
  m->latency_count++;
}

/* Renders srv's metrics in the Prometheus text exposition format 0.0.4.
 * Returns a NUL-terminated string the caller frees, its length in *len, or
 * NULL when out of memory. */
char *td__metrics_render(td__server *srv, size_t *len);

/* Writes s into out (of size cap) as a label value: backslash, double
 * quote and newline escaped. Returns out; a value that does not fit is
 * cut short, never in the middle of an escape. */
char *td__metrics_label(const char *s, char *out, size_t cap);

#endif /* TD_DAEMON_METRICS_H */

/* metrics.c: the Prometheus text of the daemon's counters and gauges, which
 * tensorctl metrics prints and --metrics serves. */
#include "metrics.h"

#include "common.h"
#include "cudastore.h"
#include "log.h"
#include "server.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 10 us to 2.5 s, in the 1-2.5-5 steps Prometheus clients use. */
const uint64_t td__metric_bounds_ns[TD__METRIC_BUCKETS] = {
    10000,     25000,     50000,     100000,     250000,    500000,
    1000000,   2500000,   5000000,   10000000,   25000000,  50000000,
    100000000, 250000000, 500000000, 1000000000, 2500000000};
/* The same bounds as Prometheus writes them: exact, whatever the float
 * formatting. */
static const char *const bound_text[TD__METRIC_BUCKETS] = {
    "1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005",
    "0.001", "0.0025",  "0.005", "0.01",   "0.025",   "0.05",
    "0.1",   "0.25",    "0.5",   "1",      "2.5"};

/* Request bodies by field number in Request (proto/tensord.proto). */
static const char *const type_name[TD__METRIC_TYPES] = {
    [0] = "unknown",  [10] = "hello",   [11] = "create", [12] = "open",
    [13] = "release", [14] = "publish", [15] = "lookup", [16] = "unpublish",
    [17] = "list",    [18] = "stat",    [19] = "info",   [20] = "ping",
    [21] = "scope",   [22] = "metrics", [23] = "watch",  [24] = "upgrade",
};

static const struct {
  const char *name;
  int code;
} codes[] = {
#define XX(name, code, _) {#name, code},
    TD_ERRNO_MAP(XX)
#undef XX
};

/* A growing string; oom once an append failed (then it stays as it was). */
typedef struct text {
  char *p;
  size_t len, cap;
  int oom;
} text;

static void put(text *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void put(text *t, const char *fmt, ...) {
  if (t->oom)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->p + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->oom = 1;
      return;
    }
    if ((size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap * 2 > t->len + (size_t)n + 1 ? t->cap * 2
                                                     : t->len + (size_t)n + 1;
    char *p = realloc(t->p, cap);
    if (p == NULL) {
      t->oom = 1;
      return;
    }
    t->p = p;
    t->cap = cap;
  }
}

char *td__metrics_label(const char *s, char *out, size_t cap) {
  size_t j = 0;
  for (; *s; s++) {
    int esc = *s == '\\' || *s == '"' || *s == '\n';
    if (j + 1 + (size_t)esc >= cap)
      break;
    if (esc)
      out[j++] = '\\';
    out[j++] = *s == '\n' ? 'n' : *s;
  }
  out[j] = '\0';
  return out;
}

/* The # HELP and # TYPE lines of a family. */
static void family(text *t, const char *name, const char *type,
                   const char *help) {
  put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(text *t, const char *name, const char *help, uint64_t v) {
  family(t, name, "gauge", help);
  put(t, "%s %llu\n", name, (unsigned long long)v);
}

static void counter(text *t, const char *name, const char *help, uint64_t v) {
  family(t, name, "counter", help);
  put(t, "%s %llu\n", name, (unsigned long long)v);
}

typedef struct uid_rows {
  text *t;
  int keys; /* the keys column, else the bytes */
} uid_rows;

static void uid_row(uid_t uid, uint64_t bytes, uint64_t keys, void *arg) {
  uid_rows *r = arg;
  if (r->keys)
    put(r->t, "tensord_uid_keys{uid=\"%u\"} %llu\n", (unsigned)uid,
        (unsigned long long)keys);
  else
    put(r->t, "tensord_uid_bytes{uid=\"%u\"} %llu\n", (unsigned)uid,
        (unsigned long long)bytes);
}

#define STAT_DEVICES_MAX 64

char *td__metrics_render(td__server *srv, size_t *len) {
  const td__metrics *m = &srv->metrics;
  text t = {NULL, 0, 0, 0};
  t.p = malloc(16384);
  if (t.p == NULL)
    return NULL;
  t.cap = 16384;
  t.p[0] = '\0';
  char lab[2 * 256 + 1];

  family(&t, "tensord_build_info", "gauge",
         "Always 1; the labels name the version and the socket.");
  put(&t, "tensord_build_info{version=\"%s\",socket=\"%s\"} 1\n",
      TD_VERSION_STRING, td__metrics_label(srv->socket_path, lab, sizeof(lab)));
  family(&t, "tensord_uptime_seconds", "gauge",
         "Seconds since tensord started.");
  put(&t, "tensord_uptime_seconds %.3f\n",
      (double)(td__now_ms() - srv->start_ms) / 1000.0);

  /* Storages and bytes per device: the CPU's, then each GPU's. */
  td__cuda_stat cs[STAT_DEVICES_MAX];
  size_t nd = td__cuda_stats(cs, STAT_DEVICES_MAX);
  if (nd > STAT_DEVICES_MAX)
    nd = STAT_DEVICES_MAX;
  family(&t, "tensord_storages", "gauge", "Live storages, by device.");
  put(&t, "tensord_storages{device=\"cpu\"} %llu\n",
      (unsigned long long)srv->reg.storages.count);
  for (size_t i = 0; i < nd; i++)
    put(&t, "tensord_storages{device=\"cuda:%d\"} %llu\n", cs[i].index,
        (unsigned long long)cs[i].storages);
  family(&t, "tensord_storage_bytes", "gauge",
         "Bytes of live storages, by device (GPUs: allocated, rounded up to "
         "the granularity).");
  put(&t, "tensord_storage_bytes{device=\"cpu\"} %llu\n",
      (unsigned long long)srv->reg.bytes_used);
  for (size_t i = 0; i < nd; i++)
    put(&t, "tensord_storage_bytes{device=\"cuda:%d\"} %llu\n", cs[i].index,
        (unsigned long long)cs[i].bytes_used);
  family(&t, "tensord_capacity_bytes", "gauge",
         "Most bytes of live storages, by device (0: not known yet).");
  put(&t, "tensord_capacity_bytes{device=\"cpu\"} %llu\n",
      (unsigned long long)srv->reg.capacity);
  for (size_t i = 0; i < nd; i++)
    put(&t, "tensord_capacity_bytes{device=\"cuda:%d\"} %llu\n", cs[i].index,
        (unsigned long long)cs[i].capacity);
  if (nd > 0) {
    family(&t, "tensord_cuda_pool_bytes", "gauge",
           "Bytes of freed GPU allocations kept for reuse, by device "
           "(counted against its capacity).");
    for (size_t i = 0; i < nd; i++)
      put(&t, "tensord_cuda_pool_bytes{device=\"cuda:%d\"} %llu\n", cs[i].index,
          (unsigned long long)cs[i].pool_bytes);
    family(&t, "tensord_cuda_pool_allocations", "gauge",
           "Freed GPU allocations kept for reuse, by device.");
    for (size_t i = 0; i < nd; i++)
      put(&t, "tensord_cuda_pool_allocations{device=\"cuda:%d\"} %llu\n",
          cs[i].index, (unsigned long long)cs[i].pool_allocs);
    family(&t, "tensord_cuda_pool_hits_total", "counter",
           "GPU creates served from the pool, by device.");
    for (size_t i = 0; i < nd; i++)
      put(&t, "tensord_cuda_pool_hits_total{device=\"cuda:%d\"} %llu\n",
          cs[i].index, (unsigned long long)cs[i].pool_hits);
    family(&t, "tensord_cuda_pool_misses_total", "counter",
           "GPU creates the pool could not serve, by device.");
    for (size_t i = 0; i < nd; i++)
      put(&t, "tensord_cuda_pool_misses_total{device=\"cuda:%d\"} %llu\n",
          cs[i].index, (unsigned long long)cs[i].pool_misses);
  }

  gauge(&t, "tensord_keys", "Published keys.", srv->reg.keys.count);
  gauge(&t, "tensord_clients", "Connected clients.", srv->nconns);
  gauge(&t, "tensord_waiters", "Lookups waiting for a key.", srv->waits.count);
  counter(&t, "tensord_connections_total", "Clients accepted.", m->connects);
  counter(&t, "tensord_disconnections_total", "Clients closed.",
          m->disconnects);
  counter(&t, "tensord_storages_created_total", "Creates that succeeded.",
          m->storages_created);
  counter(&t, "tensord_created_bytes_total", "Bytes of the storages created.",
          m->bytes_created);

  family(&t, "tensord_requests_total", "counter",
         "Requests received, by type.");
  for (int i = 0; i < TD__METRIC_TYPES; i++)
    if (type_name[i] != NULL)
      put(&t, "tensord_requests_total{type=\"%s\"} %llu\n", type_name[i],
          (unsigned long long)m->requests[i]);
  family(&t, "tensord_errors_total", "counter",
         "Error replies, by code (TD_E* without the TD_).");
  for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++)
    if (codes[i].code > -TD__METRIC_CODES)
      put(&t, "tensord_errors_total{code=\"%s\"} %llu\n", codes[i].name,
          (unsigned long long)m->errors[-codes[i].code]);
  if (m->errors[0] > 0)
    put(&t, "tensord_errors_total{code=\"other\"} %llu\n",
        (unsigned long long)m->errors[0]);

  family(&t, "tensord_request_duration_seconds", "histogram",
         "Time from a request's arrival to its reply's queueing (lookups "
         "that wait for their key are left out: see "
         "tensord_lookup_waits_total).");
  uint64_t cum = 0;
  for (int i = 0; i < TD__METRIC_BUCKETS; i++) {
    cum += m->latency[i];
    put(&t, "tensord_request_duration_seconds_bucket{le=\"%s\"} %llu\n",
        bound_text[i], (unsigned long long)cum);
  }
  cum += m->latency[TD__METRIC_BUCKETS];
  put(&t, "tensord_request_duration_seconds_bucket{le=\"+Inf\"} %llu\n",
      (unsigned long long)cum);
  put(&t, "tensord_request_duration_seconds_sum %.9f\n",
      (double)m->latency_sum_ns / 1e9);
  put(&t, "tensord_request_duration_seconds_count %llu\n",
      (unsigned long long)m->latency_count);
  counter(&t, "tensord_lookup_waits_total",
          "Lookups that waited for their key to be published.",
          m->lookup_waits);

  gauge(&t, "tensord_pool_segments", "Freed segments kept for reuse.",
        srv->pool.count);
  gauge(&t, "tensord_pool_bytes", "Bytes of the pooled segments.",
        srv->pool.bytes);
  gauge(&t, "tensord_pool_limit_bytes",
        "Most bytes the pool keeps (--recycle-bytes; 0: recycling is off).",
        srv->pool.limit);
  counter(&t, "tensord_pool_hits_total", "Creates served from the pool.",
          srv->pool.hits);
  counter(&t, "tensord_pool_misses_total",
          "Creates of a size the pool keeps that it could not serve.",
          srv->pool.misses);

  gauge(&t, "tensord_quota_bytes", "Most bytes one uid may own (0: none).",
        srv->reg.quota);
  uid_rows rows = {&t, 0};
  family(&t, "tensord_uid_bytes", "gauge",
         "Bytes a uid owns, creates in flight included: its quota use.");
  td__usage_each(&srv->reg, uid_row, &rows);
  rows.keys = 1;
  family(&t, "tensord_uid_keys", "gauge",
         "Keys a uid has published (--max-keys-per-uid).");
  td__usage_each(&srv->reg, uid_row, &rows);

  counter(&t, "tensord_journal_syncs_total",
          "Journal syncs of --state-dir ended (0 without it).",
          m->journal_syncs);
  counter(&t, "tensord_scrapes_total",
          "Metrics pages served by the --metrics endpoint.", m->scrapes);
  if (t.oom) {
    free(t.p);
    return NULL;
  }
  *len = t.len;
  return t.p;
}

/* cudastore.h: the CUDA storage backend's settings and per-device figures. The
 * backend itself is td__cuda_backend (backend.h). */
#ifndef TD_DAEMON_CUDASTORE_H
#define TD_DAEMON_CUDASTORE_H

#include <stddef.h>
#include <stdint.h>

/* Sets which GPUs tensord may touch (--cuda-devices: a comma list of
 * ordinals or UUIDs, "GPU-..." or "MIG-..." as nvidia-smi -L prints them;
 * NULL: all) and
 * their capacities (--cuda-capacity, "K=SIZE" entries given so far, K an
 * ordinal or a UUID). Checks the syntax only: nothing touches the driver
 * until the first CUDA create. Returns 0, or TD_EINVAL with msg saying
 * what is wrong. Call before serving. */
int td__cuda_configure(const char *devices, const char *const *capacities,
                       size_t ncapacities, char *msg, size_t len);

/* Sets the recycling pool's bounds: per GPU, up to bytes (if set; else a
 * quarter of its capacity; 0 turns it off) of freed allocations, each kept
 * at most idle_ms (> 0; else the default, 30 s). Call before serving. */
void td__cuda_configure_pool(int set, uint64_t bytes, int64_t idle_ms);
/* Releases every pooled allocation and pools nothing more: for the stop.
 * Calls the driver. */
void td__cuda_pool_drain(void);

/* One GPU as the daemon sees it. */
typedef struct td__cuda_stat {
  int index; /* the daemon's ordinal */
  uint8_t uuid[16];
  int mig;             /* a MIG instance: its UUID reads MIG-... */
  uint64_t bytes_used; /* storages' allocations, granularity-rounded */
  uint64_t capacity;   /* 0: not known yet (no storage made on it yet) */
  uint64_t storages;
  /* Freed allocations kept for reuse: counted against the capacity beside
   * bytes_used. */
  uint64_t pool_bytes, pool_allocs;
  uint64_t pool_limit; /* 0: off or not known yet */
  uint64_t pool_hits, pool_misses;
} td__cuda_stat;

/* Copies up to max GPUs tensord may use into out. Returns how many there are
 * (0 before the driver is loaded, or without one). Makes no driver call: it
 * runs on the loop. */
size_t td__cuda_stats(td__cuda_stat *out, size_t max);

/* 1 if uuid is one of the daemon's MIG instances (0 before the driver is
 * loaded, or without one). No driver call. */
int td__cuda_is_mig(const uint8_t uuid[16]);

#endif /* TD_DAEMON_CUDASTORE_H */

/* gpu.h: what the real-GPU tests and benchmark share: finding out, without
 * touching CUDA in the calling process, whether a real driver and a GPU are
 * there, and the context a forked child needs before it copies.
 *
 * CUDA does not survive fork(): a child may not use a driver its parent
 * initialised. So the processes that fork (the tests' main process, the
 * benchmark's) ask in a child of their own, and only forked children load
 * the driver and work with device memory. */
#ifndef TD_TEST_GPU_H
#define TD_TEST_GPU_H

#include "driver.h" /* cuda/: td__cu_load and the entry table */

#include <stddef.h>

/* Whether this process may run the real-GPU checks. Asks in a forked child:
 * skipped when $TENSORD_CUDA_DRIVER names a driver (the test double proves
 * the protocol, not the GPU), when td__cu_load fails (no libcuda.so.1, no
 * device) or when the driver sees no device. Returns 1 when a GPU is there;
 * 0 with why in msg otherwise. Never loads the driver in the caller. */
int gpu_probe(char *msg, size_t len);

/* The exit status of a real-GPU test binary that found no GPU (gpumain.c):
 * ctest's SKIP_RETURN_CODE for those tests. */
#define GPU_SKIPPED 77

/* In a child that will use the driver: loads it, retains the primary
 * context of the device with uuid (NULL: ordinal 0) and makes it current on
 * this thread. Returns the table, or NULL with why on stderr. *dev gets the
 * device (may be NULL). */
const td__cu *gpu_enter(const unsigned char *uuid, CUdevice *dev);

/* Prints "what: CUDA_ERROR_... (...)" on stderr when r is not CUDA_SUCCESS;
 * returns whether it was. */
int gpu_ok(const td__cu *cu, CUresult r, const char *what);

#endif /* TD_TEST_GPU_H */

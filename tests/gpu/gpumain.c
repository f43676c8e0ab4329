/* gpumain.c: main() of the real-GPU test binaries, which ctest must report
 * as skipped, not passed, where there is no GPU. */
#include "gpu.h"

#include <criterion/criterion.h>
#include <stdio.h>

/* Runs Criterion as its own main() does, once gpu_probe has found a GPU.
 * Where it finds none (or $TENSORD_CUDA_DRIVER names a stand-in), says why
 * and exits GPU_SKIPPED without running a test: these binaries' tests all
 * need the real driver, and a run that skipped each of them would otherwise
 * count as passed. */
int main(int argc, char *argv[]) {
  struct criterion_test_set *tests = criterion_initialize();
  int result = 0;
  if (criterion_handle_args(argc, argv, true)) {
    char why[512];
    if (gpu_probe(why, sizeof(why))) {
      result = !criterion_run_all_tests(tests);
    } else {
      printf("%s: no GPU, every test skipped: %s\n", argv[0], why);
      result = GPU_SKIPPED;
    }
  }
  criterion_finalize(tests);
  return result;
}

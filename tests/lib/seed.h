/* seed.h: the seed of a randomised test run, printed and fixed by TDT_SEED,
 * so that every failure reproduces. */
#ifndef TD_TEST_SEED_H
#define TD_TEST_SEED_H

#include <stdint.h>

/* Returns $TDT_SEED if it is set (decimal, or hex with 0x), else a seed from
 * the clock and the pid, and says on stderr, in one line that names who,
 * which seed it is and how to repeat it. Exits 2 if TDT_SEED is not a
 * number. */
uint64_t tdt_seed(const char *who);

#endif /* TD_TEST_SEED_H */

/* Counter-based and sequential random numbers.
 *
 * ps_rng_* are pure functions of (seed, stream, counter): the value at a
 * global parameter index is the same whichever process computes it, so the
 * initial model does not depend on how it is sharded, and a dropout mask can
 * be recomputed from its step. */
#ifndef PS_COMMON_RNG_H
#define PS_COMMON_RNG_H

#include <stdint.h>

/* 64 well-mixed bits from (seed, stream, counter). */
uint64_t ps_rng_u64(uint64_t seed, uint64_t stream, uint64_t counter);
/* Uniform in [0, 1) with 24 bits of precision. */
float ps_rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter);
/* Standard normal (Box-Muller over two counters derived from counter). */
float ps_rng_normal(uint64_t seed, uint64_t stream, uint64_t counter);

/* Sequential generator (for shuffling), seeded deterministically. */
typedef struct {
  uint64_t s[4];
} ps_rand;
void ps_rand_seed(ps_rand *r, uint64_t seed);
uint64_t ps_rand_next(ps_rand *r);
/* Uniform integer in [0, n), n > 0, without modulo bias. */
uint64_t ps_rand_below(ps_rand *r, uint64_t n);
/* Fisher-Yates shuffle of idx[0..n). */
void ps_rand_shuffle_u32(ps_rand *r, uint32_t *idx, uint32_t n);

#endif

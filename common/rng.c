#include "rng.h"

#include <math.h>

#include "util.h"

/* A counter-based generator: a strong 64-bit mixer (the splitmix64
 * finalizer, applied twice with different keys) over (seed, stream,
 * counter). Statistically good enough for initialization, dropout and
 * synthetic data, and stateless: any index is computed in O(1). */
static inline uint64_t mix64(uint64_t z) { return ps_splitmix64(z); }

uint64_t ps_rng_u64(uint64_t seed, uint64_t stream, uint64_t counter) {
  uint64_t k = mix64(seed + 0x9e3779b97f4a7c15ULL * (stream + 1));
  return mix64(k ^ mix64(counter + 0x632be59bd9b4e019ULL));
}

float ps_rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter) {
  return (float)(ps_rng_u64(seed, stream, counter) >> 40) * (1.0f / 16777216.0f);
}

float ps_rng_normal(uint64_t seed, uint64_t stream, uint64_t counter) {
  uint64_t r = ps_rng_u64(seed, stream ^ 0x5bd1e995ULL, counter);
  double u1 = ((double)(r >> 11) + 1.0) * (1.0 / 9007199254740993.0); /* (0, 1] */
  double u2 = (double)(ps_rng_u64(seed, stream ^ 0x1b873593ULL, counter) >> 11) *
              (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* xoshiro256** seeded through splitmix64. */
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void ps_rand_seed(ps_rand *r, uint64_t seed) {
  uint64_t z = seed;
  for (int i = 0; i < 4; i++) {
    z += 0x9e3779b97f4a7c15ULL;
    r->s[i] = mix64(z);
  }
}

uint64_t ps_rand_next(ps_rand *r) {
  uint64_t *s = r->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

uint64_t ps_rand_below(ps_rand *r, uint64_t n) {
  /* Rejection sampling: discard the top partial range to avoid bias. */
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do {
    x = ps_rand_next(r);
  } while (x >= limit);
  return x % n;
}

void ps_rand_shuffle_u32(ps_rand *r, uint32_t *idx, uint32_t n) {
  for (uint32_t i = n; i > 1; i--) {
    uint32_t j = (uint32_t)ps_rand_below(r, i);
    uint32_t t = idx[i - 1];
    idx[i - 1] = idx[j];
    idx[j] = t;
  }
}

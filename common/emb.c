/* Embedding tables' placement and initial values (see emb.h). */
#include "emb.h"

#include <stdlib.h>
#include <string.h>

#include "rng.h"
#include "util.h"

static uint64_t mix64(uint64_t z) { return ps_splitmix64(z); }

int ps_table_name_ok(const char *name) {
  size_t n = strlen(name);
  if (n == 0 || n > 31) return 0;
  for (size_t i = 0; i < n; i++) {
    char c = name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '_' || c == '.' || c == '-'))
      return 0;
  }
  return 1;
}

uint64_t ps_table_key(const char *name) {
  /* FNV-1a, then mixed: a fixed function of the bytes. */
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ULL;
  }
  return mix64(h);
}

/* A balanced Feistel network over 2*h bits (h <= 32), 4 rounds. Each half
 * fits 32 bits, so the round function is 32-bit arithmetic (the round's
 * key xored in, then the "lowbias32" mixer: two odd multipliers and
 * xor-shifts), which AVX2 computes for 8 ids at once (feistel_avx2):
 * placing a request's 10,000 ids takes tens of microseconds, where a
 * 64-bit mixer per round took 0.2 ms. */
typedef struct {
  uint32_t k[4];
  uint32_t mask; /* the low h bits */
  int h;
} feistel_keys;

static feistel_keys keys_of(uint64_t key, int h) {
  feistel_keys f;
  /* The key is mixed already (ps_table_key): a multiply apiece makes the
   * rounds' keys differ, cheaply enough for one id at a time. */
  for (int i = 0; i < 4; i++)
    f.k[i] = (uint32_t)(((key + 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1)) *
                         0xbf58476d1ce4e5b9ULL) >> 32);
  f.h = h;
  f.mask = h >= 32 ? 0xffffffffu : (1u << h) - 1u;
  return f;
}

static inline uint32_t fround(uint32_t r, uint32_t k) {
  uint32_t x = r ^ k;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

static uint64_t feistel(const feistel_keys *f, uint64_t x, int inverse) {
  uint32_t l = (uint32_t)(x >> f->h) & f->mask, r = (uint32_t)x & f->mask;
  if (!inverse) {
    for (int round = 0; round < 4; round++) {
      const uint32_t t = r;
      r = l ^ (fround(r, f->k[round]) & f->mask);
      l = t;
    }
  } else {
    for (int round = 3; round >= 0; round--) {
      const uint32_t t = l;
      l = r ^ (fround(t, f->k[round]) & f->mask);
      r = t;
    }
  }
  return ((uint64_t)l << f->h) | r;
}

/* Half the bits of the smallest power of 4 >= n (at least 1): the h in
 * [1, 32] for which n - 1 < 4^h, from the bit length of n - 1 (a count of
 * leading zeros, not a loop: every placement computes it). */
static int half_bits(uint64_t n) {
  const uint64_t m = n - 1;
  const int bits = m ? 64 - __builtin_clzll(m) : 0;
  const int h = (bits + 1) / 2;
  return h < 1 ? 1 : h;
}

/* Cycle-walking: the network permutes [0, 4^h); following it from x until
 * a value below n is found stays a permutation of [0, n). The domain is
 * below 4n, so the expected walk is under 4 steps. */
static uint64_t walk(const feistel_keys *f, uint64_t n, uint64_t x, int inverse) {
  do {
    x = feistel(f, x, inverse);
  } while (x >= n);
  return x;
}

uint64_t ps_perm_forward(uint64_t key, uint64_t n, uint64_t x) {
  if (n <= 1) return 0;
  const feistel_keys f = keys_of(key, half_bits(n));
  return walk(&f, n, x, 0);
}

uint64_t ps_perm_inverse(uint64_t key, uint64_t n, uint64_t y) {
  if (n <= 1) return 0;
  const feistel_keys f = keys_of(key, half_bits(n));
  return walk(&f, n, y, 1);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PS_HAVE_PERM_AVX2 1

__attribute__((target("avx2"))) static inline __m256i fround8(__m256i r, __m256i k) {
  __m256i x = _mm256_xor_si256(r, k);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* The halves of 4 values (each below 4^h) as 32-bit lanes in the low 128
 * bits: the high halves (hi = 1) or the low ones. */
__attribute__((target("avx2"))) static inline __m256i halves4(__m256i v, __m128i hc,
                                                              __m256i mask64, int hi) {
  const __m256i lows = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  return _mm256_permutevar8x32_epi32(_mm256_and_si256(hi ? _mm256_srl_epi64(v, hc) : v, mask64),
                                     lows);
}

/* One pass of the network over x[0, m) (m a multiple of 8, each x below
 * 4^h) into y: the values feistel(f, x, 0) gives, 8 at a time. */
__attribute__((target("avx2"))) static void feistel_avx2(const feistel_keys *f,
                                                         const uint64_t *x, uint64_t *y,
                                                         size_t m) {
  const __m128i hc = _mm_cvtsi32_si128(f->h);
  const __m256i mask32 = _mm256_set1_epi32((int)f->mask);
  const __m256i mask64 = _mm256_set1_epi64x((long long)f->mask);
  __m256i k[4];
  for (int i = 0; i < 4; i++) k[i] = _mm256_set1_epi32((int)f->k[i]);
  for (size_t i = 0; i < m; i += 8) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(x + i));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(x + i + 4));
    __m256i l = _mm256_permute2x128_si256(halves4(a, hc, mask64, 1), halves4(b, hc, mask64, 1),
                                          0x20);
    __m256i r = _mm256_permute2x128_si256(halves4(a, hc, mask64, 0), halves4(b, hc, mask64, 0),
                                          0x20);
    for (int round = 0; round < 4; round++) {
      const __m256i t = r;
      r = _mm256_xor_si256(l, _mm256_and_si256(fround8(r, k[round]), mask32));
      l = t;
    }
    const __m256i l0 = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(l));
    const __m256i l1 = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(l, 1));
    const __m256i r0 = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(r));
    const __m256i r1 = _mm256_cvtepu32_epi64(_mm256_extracti128_si256(r, 1));
    _mm256_storeu_si256((__m256i *)(void *)(y + i),
                        _mm256_or_si256(_mm256_sll_epi64(l0, hc), r0));
    _mm256_storeu_si256((__m256i *)(void *)(y + i + 4),
                        _mm256_or_si256(_mm256_sll_epi64(l1, hc), r1));
  }
}

/* Chosen once, at the first call, by what the CPU says it has
 * (PS_NO_AVX2=1 takes the portable path, for comparing the two). */
static int use_avx2(void) {
  static int known = -1; /* a benign race: every thread computes the same */
  int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
  if (k < 0) {
    __builtin_cpu_init();
    k = __builtin_cpu_supports("avx2") && !getenv("PS_NO_AVX2");
    __atomic_store_n(&known, k, __ATOMIC_RELAXED);
  }
  return k;
}
#else
#define PS_HAVE_PERM_AVX2 0
#endif

void ps_perm_forward_many(uint64_t key, uint64_t n, const uint64_t *x, uint64_t *y,
                          size_t count) {
  if (n <= 1) {
    memset(y, 0, count * sizeof *y);
    return;
  }
  const feistel_keys f = keys_of(key, half_bits(n));
  size_t i = 0;
#if PS_HAVE_PERM_AVX2
  if (use_avx2()) {
    /* The walk's further steps 8 at a time too: the values still outside
     * [0, n) gathered, stepped, put back, until none is left (a table of
     * rows just above a power of 4 walks almost 3 steps per id). */
    enum { CHUNK = 512 };
    uint64_t wv[CHUNK];
    uint32_t at[CHUNK];
    i = count / 8 * 8;
    for (size_t c = 0; c < i; c += CHUNK) {
      const size_t m = i - c < CHUNK ? i - c : CHUNK;
      feistel_avx2(&f, x + c, y + c, m);
      size_t k = 0;
      for (size_t j = 0; j < m; j++) { /* branch-free: about half leave */
        at[k] = (uint32_t)j;
        k += y[c + j] >= n;
      }
      while (k >= 8) {
        for (size_t j = 0; j < k; j++) wv[j] = y[c + at[j]];
        const size_t k8 = k / 8 * 8;
        feistel_avx2(&f, wv, wv, k8);
        size_t left = 0;
        for (size_t j = 0; j < k8; j++) {
          y[c + at[j]] = wv[j];
          at[left] = at[j];
          left += wv[j] >= n;
        }
        for (size_t j = k8; j < k; j++) at[left++] = at[j];
        k = left;
      }
      for (size_t j = 0; j < k; j++) y[c + at[j]] = walk(&f, n, y[c + at[j]], 0);
    }
  }
#endif
  for (; i < count; i++) y[i] = walk(&f, n, x[i], 0);
}

int ps_table_place(const ps_table_spec *t, int S, uint64_t id, uint64_t *local) {
  if (S <= 1) {
    *local = t->rows ? ps_perm_forward(t->key, t->rows, id) : id;
    return 0;
  }
  if (t->rows == 0) {
    *local = id;
    return (int)(mix64(id ^ t->key) % (uint64_t)S);
  }
  uint64_t p = ps_perm_forward(t->key, t->rows, id);
  *local = p / (uint64_t)S;
  return (int)(p % (uint64_t)S);
}

void ps_table_place_many(const ps_table_spec *t, int S, const uint64_t *ids, size_t n, int *shard,
                         uint64_t *local) {
  if (t->rows == 0) {
    for (size_t i = 0; i < n; i++) {
      const uint64_t id = ids[i];
      if (shard) shard[i] = S <= 1 ? 0 : (int)(mix64(id ^ t->key) % (uint64_t)S);
      local[i] = id;
    }
    return;
  }
  ps_perm_forward_many(t->key, t->rows, ids, local, n);
  if (S <= 1) {
    if (shard) memset(shard, 0, n * sizeof *shard);
    return;
  }
  const uint64_t s64 = (uint64_t)S;
#ifdef __SIZEOF_INT128__
  /* p / S for p below 2^32 as a multiplication (exact for every 32-bit p
   * and S >= 2), a 64-bit division only above. */
  const uint64_t magic = UINT64_MAX / s64 + 1;
  for (size_t i = 0; i < n; i++) {
    const uint64_t p = local[i];
    const uint64_t q = p >> 32 ? p / s64 : (uint64_t)(((unsigned __int128)magic * p) >> 64);
    if (shard) shard[i] = (int)(p - q * s64);
    local[i] = q;
  }
#else
  for (size_t i = 0; i < n; i++) {
    const uint64_t p = local[i];
    if (shard) shard[i] = (int)(p % s64);
    local[i] = p / s64;
  }
#endif
}

uint64_t ps_table_shard_rows(const ps_table_spec *t, int S, int s) {
  if (t->rows == 0) return 0;
  if (S <= 1) return t->rows;
  uint64_t q = t->rows / (uint64_t)S, r = t->rows % (uint64_t)S;
  return q + ((uint64_t)s < r ? 1 : 0);
}

uint64_t ps_table_local_id(const ps_table_spec *t, int S, int s, uint64_t local) {
  if (t->rows == 0) return local;
  uint64_t p = S <= 1 ? local : local * (uint64_t)S + (uint64_t)s;
  return ps_perm_inverse(t->key, t->rows, p);
}

void ps_table_init_row(const ps_table_spec *t, uint64_t seed, uint64_t id, float *out) {
  /* The stream is the table's key and the row id mixed: every row of every
   * table draws its own sequence, counters 0..dim-1. */
  uint64_t stream = mix64(t->key ^ mix64(id + 0x632be59bd9b4e019ULL));
  for (int j = 0; j < t->dim; j++) {
    switch (t->init) {
      case PS_TABLE_INIT_NORMAL:
        out[j] = t->init_scale * ps_rng_normal(seed, stream, (uint64_t)j);
        break;
      case PS_TABLE_INIT_ZEROS:
        out[j] = 0.0f;
        break;
      default:
        out[j] = t->init_scale * (2.0f * ps_rng_uniform(seed, stream, (uint64_t)j) - 1.0f);
        break;
    }
  }
}

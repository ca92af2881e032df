/* Embedding tables' placement and initial values (see emb.h). */
#include "emb.h"

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

/* A balanced Feistel network over 2*half bits, 4 rounds. */
static uint64_t feistel(uint64_t key, int half, uint64_t x, int inverse) {
  const uint64_t mask = (half >= 32) ? 0xffffffffULL : ((1ULL << half) - 1);
  uint64_t l = (x >> half) & mask, r = x & mask;
  if (!inverse) {
    for (int round = 0; round < 4; round++) {
      uint64_t f = mix64(r ^ (key + 0x9e3779b97f4a7c15ULL * (uint64_t)(round + 1))) & mask;
      uint64_t t = r;
      r = l ^ f;
      l = t;
    }
  } else {
    for (int round = 3; round >= 0; round--) {
      uint64_t t = l;
      uint64_t f = mix64(t ^ (key + 0x9e3779b97f4a7c15ULL * (uint64_t)(round + 1))) & mask;
      l = r ^ f;
      r = t;
    }
  }
  return (l << half) | r;
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

uint64_t ps_perm_forward(uint64_t key, uint64_t n, uint64_t x) {
  if (n <= 1) return 0;
  int h = half_bits(n);
  /* Cycle-walking: the network permutes [0, 4^h); following it from x
   * until a value below n is found stays a permutation of [0, n). The
   * domain is below 4n, so the expected walk is under 4 steps. */
  do {
    x = feistel(key, h, x, 0);
  } while (x >= n);
  return x;
}

uint64_t ps_perm_inverse(uint64_t key, uint64_t n, uint64_t y) {
  if (n <= 1) return 0;
  int h = half_bits(n);
  do {
    y = feistel(key, h, y, 1);
  } while (y >= n);
  return y;
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

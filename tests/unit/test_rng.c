/* Tests of common/rng.c: determinism, range, rough distribution. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rng.h"
#include "check.h"

static void test_counter_based(void) {
  CHECK(ps_rng_u64(1, 2, 3) == ps_rng_u64(1, 2, 3));
  CHECK(ps_rng_u64(1, 2, 3) != ps_rng_u64(1, 2, 4));
  CHECK(ps_rng_u64(1, 2, 3) != ps_rng_u64(1, 3, 3));
  CHECK(ps_rng_u64(1, 2, 3) != ps_rng_u64(2, 2, 3));
  double sum = 0, sq = 0;
  float lo = 1, hi = 0;
  enum { N = 200000 };
  for (int i = 0; i < N; i++) {
    float u = ps_rng_uniform(7, 0, (uint64_t)i);
    sum += u;
    sq += (double)u * u;
    if (u < lo) lo = u;
    if (u > hi) hi = u;
  }
  CHECK(lo >= 0.0f && hi < 1.0f);
  /* mean 1/2 and variance 1/12; 5 sigma of the estimate is ~0.003 */
  CHECK_NEAR(sum / N, 0.5, 0.003, 0);
  CHECK_NEAR(sq / N - (sum / N) * (sum / N), 1.0 / 12, 0.002, 0);
  double ns = 0, nsq = 0;
  for (int i = 0; i < N; i++) {
    double z = ps_rng_normal(7, 1, (uint64_t)i);
    ns += z;
    nsq += z * z;
  }
  CHECK_NEAR(ns / N, 0.0, 0.012, 0);
  CHECK_NEAR(nsq / N, 1.0, 0.02, 0);
}

static void test_shuffle(void) {
  enum { N = 1000 };
  uint32_t a[N], b[N];
  for (uint32_t i = 0; i < N; i++) a[i] = b[i] = i;
  ps_rand r1, r2;
  ps_rand_seed(&r1, 5);
  ps_rand_seed(&r2, 5);
  ps_rand_shuffle_u32(&r1, a, N);
  ps_rand_shuffle_u32(&r2, b, N);
  CHECK(memcmp(a, b, sizeof a) == 0); /* same seed, same order */
  int seen[N] = {0}, moved = 0;
  for (int i = 0; i < N; i++) {
    seen[a[i]]++;
    moved += a[i] != (uint32_t)i;
  }
  int perm = 1;
  for (int i = 0; i < N; i++) perm &= seen[i] == 1;
  CHECK(perm);
  CHECK(moved > N / 2);
  for (int i = 0; i < 1000; i++) CHECK(ps_rand_below(&r1, 3) < 3);
}

int main(void) {
  RUN(test_counter_based);
  RUN(test_shuffle);
  return check_summary();
}

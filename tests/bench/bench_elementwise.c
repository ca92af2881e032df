/* Per-op time of the cpu backend's elementwise and pooling ops on the
 * quickstart CNN's largest activation, conv1's output (64, 32, 28, 28):
 * relu forward and backward, max pooling 2x2 forward and backward, as the
 * worker calls them (distinct input and output buffers).
 *
 *   bench_elementwise [--threads N] [--reps N]
 *
 * Prints the median over --reps (default 50) of each op, in ms, then the
 * same as one JSON line for scripts (tests/bench/build_types.sh builds it
 * once per build type). Threads as ps-worker's --threads (default 2). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../kernels/ops.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rand_state = 88172645463325252ULL;

static float rand_signed(void) { /* [-1, 1): random signs, as after a conv */
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (float)((double)(rand_state >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median_ms(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return 1e3 * (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

enum { OP_RELU_FWD, OP_RELU_BWD, OP_POOL_FWD, OP_POOL_BWD, NOPS };
static const char *op_names[NOPS] = {"relu_forward", "relu_backward", "maxpool_forward",
                                     "maxpool_backward"};

int main(int argc, char **argv) {
  int threads = 2, reps = 50;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = atoi(argv[++i]);
    } else {
      fprintf(stderr, "usage: bench_elementwise [--threads N] [--reps N]\n");
      return 2;
    }
  }
  if (reps < 1 || threads < 0) {
    fprintf(stderr, "bench_elementwise: --reps must be >= 1 and --threads >= 0\n");
    return 2;
  }
  ps_pool_shape pool = {.n = 64, .c = 32, .h = 28, .w = 28, .size = 2, .stride = 2};
  ps_pool_shape_finish(&pool);
  const size_t n = (size_t)pool.n * pool.c * pool.h * pool.w;
  const size_t n_pooled = (size_t)pool.n * pool.c * pool.oh * pool.ow;
  ps_ops *ops = ps_ops_cpu_create(threads);
  float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
  float *dy = malloc(n * sizeof(float)), *dx = malloc(n * sizeof(float));
  float *pooled = malloc(n_pooled * sizeof(float)), *dpooled = malloc(n_pooled * sizeof(float));
  int32_t *argmax = malloc(n_pooled * sizeof(int32_t));
  double *t[NOPS];
  int have_all = ops && x && y && dy && dx && pooled && dpooled && argmax;
  for (int o = 0; o < NOPS; o++) {
    t[o] = malloc((size_t)reps * sizeof(double));
    have_all &= t[o] != NULL;
  }
  if (!have_all) {
    fprintf(stderr, "bench_elementwise: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < n; i++) x[i] = rand_signed(), dy[i] = rand_signed();
  for (size_t i = 0; i < n_pooled; i++) dpooled[i] = rand_signed();

  for (int r = -2; r < reps; r++) { /* two warm-up rounds */
    double t0 = now_s();
    ops->relu_forward(ops->ctx, n, x, y);
    double t1 = now_s();
    ops->relu_backward(ops->ctx, n, y, dy, dx);
    double t2 = now_s();
    ops->maxpool_forward(ops->ctx, &pool, y, pooled, argmax);
    double t3 = now_s();
    ops->maxpool_backward(ops->ctx, &pool, dpooled, argmax, dx);
    double t4 = now_s();
    if (r < 0) continue;
    t[OP_RELU_FWD][r] = t1 - t0, t[OP_RELU_BWD][r] = t2 - t1;
    t[OP_POOL_FWD][r] = t3 - t2, t[OP_POOL_BWD][r] = t4 - t3;
  }
  double ms[NOPS];
  for (int o = 0; o < NOPS; o++) {
    ms[o] = median_ms(t[o], reps);
    printf("%-17s %7.3f ms\n", op_names[o], ms[o]);
  }
  printf("{\"threads\": %d, \"reps\": %d", threads, reps);
  for (int o = 0; o < NOPS; o++) printf(", \"%s_ms\": %.4f", op_names[o], ms[o]);
  printf("}\n");

  for (int o = 0; o < NOPS; o++) free(t[o]);
  free(x), free(y), free(dy), free(dx), free(pooled), free(dpooled), free(argmax);
  ops->destroy(ops);
  return 0;
}

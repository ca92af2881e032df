/* Examples per second of one training step (forward + backward + the
 * gradient combination) of the quickstart CNN with R replicas against
 * R = 1, one BLAS thread each, batch 64, random inputs.
 *
 *   bench_replicas [--rounds N] [--steps N] [--replicas R] [--batch N] [--diag] [job.json]
 *
 * Rounds are interleaved (R=1 then R, then R then R=1, ...) so that a
 * neighbour's load on the shared machine hits both alike; the ratio printed
 * is the median of the per-round ratios. --diag also times what bounds the
 * speed-up: one model on a half batch, R bare threads each running a model
 * on its slice (no combination, no barrier), and the gradient sum alone. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../common/job.h"
#include "../../common/util.h"
#include "../../kernels/ops.h"
#include "../../worker/model.h"
#include "../../worker/replicas.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rand_state = 88172645463325252ULL;

static float rand_unit(void) {
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (float)((double)(rand_state >> 11) * (1.0 / 9007199254740992.0));
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
  const ps_model_spec *spec;
  size_t P, in_size;
  int batch;
  float *params, *x, *grads;
  uint8_t *y;
} bench_data;

/* Examples per second of `steps` steps of r. */
static double time_replicas(ps_replicas *r, const bench_data *d, int steps) {
  double t0 = now_s();
  for (int s = 0; s < steps; s++)
    ps_replicas_train_step(r, d->params, d->x, d->y, d->batch, 1, (uint64_t)s, d->grads, NULL);
  return (double)steps * d->batch / (now_s() - t0);
}

/* ---- diagnostics ---- */

typedef struct {
  const bench_data *d;
  ps_model *model;
  float *grads;
  int first, n, steps;
} bare_thread;

static void *bare_main(void *arg) {
  bare_thread *t = arg;
  for (int s = 0; s < t->steps; s++)
    ps_model_train_step(t->model, t->d->params, t->d->x + (size_t)t->first * t->d->in_size,
                        t->d->y + t->first, t->n, 1, (uint64_t)s, t->grads, NULL);
  return NULL;
}

/* R threads, each running its own model on its slice, nothing shared:
 * the speed-up the machine allows. Examples per second of the whole batch. */
static double time_bare(const bench_data *d, int R, int steps) {
  char err[PS_ERRLEN];
  bare_thread t[16];
  ps_ops *ops[16];
  pthread_t tid[16];
  int first = 0;
  for (int i = 0; i < R; i++) {
    ops[i] = ps_ops_cpu_create(1);
    t[i] = (bare_thread){.d = d, .first = first, .n = d->batch / R + (i < d->batch % R),
                         .steps = steps};
    first += t[i].n;
    t[i].model = ps_model_create(d->spec, ops[i], t[i].n, err);
    t[i].grads = malloc(d->P * sizeof(float));
    bare_main(&(bare_thread){.d = d, .model = t[i].model, .grads = t[i].grads,
                             .first = t[i].first, .n = t[i].n, .steps = 1});
  }
  double t0 = now_s();
  for (int i = 0; i < R; i++) pthread_create(&tid[i], NULL, bare_main, &t[i]);
  for (int i = 0; i < R; i++) pthread_join(tid[i], NULL);
  double rate = (double)steps * d->batch / (now_s() - t0);
  for (int i = 0; i < R; i++) {
    ps_model_destroy(t[i].model);
    ops[i]->destroy(ops[i]);
    free(t[i].grads);
  }
  return rate;
}

/* Seconds per step of one model on n examples in this thread. */
static double time_model(const bench_data *d, int n, int steps) {
  char err[PS_ERRLEN];
  ps_ops *ops = ps_ops_cpu_create(1);
  ps_model *m = ps_model_create(d->spec, ops, n, err);
  ps_model_train_step(m, d->params, d->x, d->y, n, 1, 0, d->grads, NULL);
  double t0 = now_s();
  for (int s = 0; s < steps; s++)
    ps_model_train_step(m, d->params, d->x, d->y, n, 1, (uint64_t)s, d->grads, NULL);
  double per = (now_s() - t0) / steps;
  ps_model_destroy(m);
  ops->destroy(ops);
  return per;
}

/* Seconds of one pass that combines R gradients of P floats in one thread,
 * the way the replicas do (d = w0*d + w1*g1 + ...), over all of P: an upper
 * bound on what R threads spend on it, each on 1/R. */
static double time_sum(size_t P, int R, int reps) {
  float *g[16];
  for (int i = 0; i < R; i++) {
    g[i] = malloc(P * sizeof(float));
    for (size_t k = 0; k < P; k++) g[i][k] = rand_unit();
  }
  double t0 = now_s();
  for (int rep = 0; rep < reps; rep++) {
    for (size_t k = 0; k < P; k++) g[0][k] *= 0.5f;
    for (int i = 1; i < R; i++)
      for (size_t k = 0; k < P; k++) g[0][k] += 0.5f * g[i][k];
  }
  double per = (now_s() - t0) / reps;
  volatile float sink = g[0][P / 2];
  (void)sink;
  for (int i = 0; i < R; i++) free(g[i]);
  return per;
}

int main(int argc, char **argv) {
  int rounds = 7, steps = 20, R = 2, batch = 64, diag = 0;
  char job_path[1024];
  {
    const char *self = __FILE__, *tail = "tests/bench/bench_replicas.c";
    size_t n = strlen(self), t = strlen(tail);
    size_t root = n >= t && strcmp(self + n - t, tail) == 0 ? n - t : 0;
    snprintf(job_path, sizeof job_path, "%.*sdeploy/jobs/fashion_mnist_cnn.json", (int)root,
             self);
  }
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
      steps = atoi(argv[++i]);
    else if (strcmp(argv[i], "--replicas") == 0 && i + 1 < argc)
      R = atoi(argv[++i]);
    else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
      batch = atoi(argv[++i]);
    else if (strcmp(argv[i], "--diag") == 0)
      diag = 1;
    else if (argv[i][0] != '-')
      snprintf(job_path, sizeof job_path, "%s", argv[i]);
    else {
      fprintf(stderr,
              "usage: %s [--rounds N] [--steps N] [--replicas R] [--batch N] [--diag] "
              "[job.json]\n",
              argv[0]);
      return 2;
    }
  }
  if (rounds < 1 || rounds > 1000 || steps < 1 || R < 2 || R > 16 || batch < R) {
    fprintf(stderr, "bench_replicas: need rounds in [1, 1000], steps >= 1, R in [2, 16], "
                    "batch >= R\n");
    return 2;
  }

  char err[PS_ERRLEN];
  ps_job job;
  if (ps_job_load(job_path, &job, NULL, err) != 0) {
    fprintf(stderr, "bench_replicas: %s\n", err);
    return 1;
  }
  const ps_model_spec *spec = &job.model;
  bench_data d = {.spec = spec, .P = spec->n_params, .batch = batch,
                  .in_size = (size_t)spec->in_c * spec->in_h * spec->in_w};
  d.params = malloc(d.P * sizeof(float));
  d.grads = malloc(d.P * sizeof(float));
  d.x = malloc((size_t)batch * d.in_size * sizeof(float));
  d.y = malloc((size_t)batch);
  if (!d.params || !d.grads || !d.x || !d.y) {
    fprintf(stderr, "bench_replicas: out of memory\n");
    return 1;
  }
  ps_model_init_params(spec, job.seed, 0, d.P, d.params);
  for (size_t i = 0; i < (size_t)batch * d.in_size; i++) d.x[i] = rand_unit();
  for (int i = 0; i < batch; i++) d.y[i] = (uint8_t)(rand_unit() * (float)spec->classes);

  ps_replicas *one = ps_replicas_create(spec, 1, batch, err);
  ps_replicas *many = one ? ps_replicas_create(spec, R, batch, err) : NULL;
  if (!one || !many) {
    fprintf(stderr, "bench_replicas: %s\n", err);
    return 1;
  }
  char desc[512];
  ps_model_spec_describe(spec, desc, sizeof desc);
  printf("model: %s\nbatch %d, %d rounds of %d steps, one BLAS thread per replica\n", desc, batch,
         rounds, steps);
  /* Warm-up: page in activations, wake the threads. */
  time_replicas(one, &d, 2);
  time_replicas(many, &d, 2);

  double *r1 = calloc((size_t)rounds, sizeof *r1), *rn = calloc((size_t)rounds, sizeof *rn);
  double *ratio = calloc((size_t)rounds, sizeof *ratio);
  for (int k = 0; k < rounds; k++) {
    if (k % 2 == 0) {
      r1[k] = time_replicas(one, &d, steps);
      rn[k] = time_replicas(many, &d, steps);
    } else {
      rn[k] = time_replicas(many, &d, steps);
      r1[k] = time_replicas(one, &d, steps);
    }
    ratio[k] = rn[k] / r1[k];
    printf("round %d: R=1 %7.1f ex/s   R=%d %7.1f ex/s   ratio %.3f\n", k + 1, r1[k], R, rn[k],
           ratio[k]);
    fflush(stdout);
  }
  double m1 = median(r1, rounds), mn = median(rn, rounds), mr = median(ratio, rounds);
  printf("median: R=1 %.1f ex/s, R=%d %.1f ex/s, ratio R=%d/R=1 %.3f\n", m1, R, mn, R, mr);

  if (diag) {
    const int half = (batch + R - 1) / R;
    double t_full = 0, t_part = 0, bare = 0, one_rate = 0;
    for (int k = 0; k < 3; k++) {
      t_full += time_model(&d, batch, steps) / 3;
      t_part += time_model(&d, half, steps) / 3;
      bare += time_bare(&d, R, steps) / 3;
      one_rate += time_replicas(one, &d, steps) / 3;
    }
    double t_sum = time_sum(d.P, R, 20);
    printf("diag: one model, %d examples: %.2f ms/step; %d examples: %.2f ms/step (x%.3f of "
           "the full batch's time, ideal %.3f)\n",
           batch, t_full * 1e3, half, t_part * 1e3, t_part / t_full, (double)half / batch);
    printf("diag: %d bare threads, one model each, no combination: %.1f ex/s, x%.3f of R=1\n", R,
           bare, bare / one_rate);
    printf("diag: combining %d gradients of %zu floats in one thread: %.3f ms (%.1f%% of an R=1 "
           "step)\n",
           R, d.P, t_sum * 1e3, 100.0 * t_sum / t_full);
  }

  ps_replicas_destroy(many);
  ps_replicas_destroy(one);
  free(r1);
  free(rn);
  free(ratio);
  free(d.params);
  free(d.grads);
  free(d.x);
  free(d.y);
  return 0;
}

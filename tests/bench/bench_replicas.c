/* Examples per second of one training step (forward + backward + the
 * gradient combination) of the quickstart CNN with R replicas against
 * R = 1, one BLAS thread each, batch 64, random inputs.
 *
 *   bench_replicas [--rounds N] [--steps N] [--replicas R] [--batch N]
 *                  [--wait S] [--diag] [job.json]
 *
 * Each round times R=1, R, and "bare" (R threads, each running its own
 * model on its slice with no combination and no barrier: what R cores give
 * at that moment) in an order rotated every round, so that drift hits all
 * three alike. The machine is shared: each round first waits (up to --wait
 * seconds) for the other processes to go quiet and reports the share of
 * the CPUs they used during it; the ratio to read is the median over the
 * quiet rounds, next to bare's. --diag also times one model on a 1/R batch
 * (the per-example cost of smaller batches) and the gradient sum alone. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "../../common/job.h"
#include "../../common/util.h"
#include "../../kernels/ops.h"
#include "worker/model/model.h"
#include "worker/model/replicas.h"

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

/* ---- the rest of the machine ----
 *
 * The machine is shared, and a neighbour's build or test on one of the two
 * cores halves what R = 2 can get. So each run also measures how busy the
 * other processes kept the CPUs (from /proc/stat, less this process's own
 * CPU time), and each round first waits, up to a limit, for a quiet moment. */

typedef struct {
  double wall, cpu;               /* seconds: ours */
  unsigned long long busy, total; /* jiffies, all CPUs */
} usage_mark;

static void read_proc_stat(unsigned long long *busy, unsigned long long *total) {
  *busy = *total = 0;
  FILE *f = fopen("/proc/stat", "r");
  if (!f) return;
  unsigned long long v[8] = {0};
  if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
             &v[5], &v[6], &v[7]) == 8) {
    *busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]; /* all but idle and iowait */
    *total = *busy + v[3] + v[4];
  }
  fclose(f);
}

static usage_mark mark(void) {
  usage_mark m;
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  m.cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
          ru.ru_stime.tv_usec * 1e-6;
  read_proc_stat(&m.busy, &m.total);
  m.wall = now_s();
  return m;
}

/* The share of all CPUs that other processes used between a and b, in
 * [0, 1]; 0 when /proc/stat cannot be read. */
static double others_share(const usage_mark *a, const usage_mark *b) {
  if (b->total <= a->total) return 0.0;
  const double tick = (double)sysconf(_SC_CLK_TCK);
  double other = (double)(b->busy - a->busy) / tick - (b->cpu - a->cpu);
  double share = other / ((double)(b->total - a->total) / tick);
  return share < 0 ? 0 : share > 1 ? 1 : share;
}

/* Waits until other processes use less than QUIET_SHARE of the machine
 * over 0.3 s, or max_s have passed. */
#define QUIET_SHARE 0.05
static void wait_for_quiet(double max_s) {
  const double start = now_s();
  do {
    usage_mark a = mark();
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    usage_mark b = mark();
    if (others_share(&a, &b) < QUIET_SHARE) return;
  } while (now_s() - start < max_s);
}

typedef struct {
  double rate;       /* examples per second */
  double cpu_per_ex; /* our CPU seconds per example */
  double others;     /* the share of the machine others used meanwhile */
} run_result;

/* `steps` steps of r. */
static run_result time_replicas(ps_replicas *r, const bench_data *d, int steps) {
  usage_mark a = mark();
  for (int s = 0; s < steps; s++)
    ps_replicas_train_step(r, d->params, d->x, d->y, d->batch, 1, (uint64_t)s, d->grads, NULL);
  usage_mark b = mark();
  const double ex = (double)steps * d->batch;
  return (run_result){.rate = ex / (b.wall - a.wall),
                      .cpu_per_ex = (b.cpu - a.cpu) / ex,
                      .others = others_share(&a, &b)};
}

/* ---- the machine's own ceiling ----
 *
 * R bare threads, each running its own model on its slice of the batch,
 * nothing shared, no combination, no barrier: what R cores give right now.
 * Timed in every round next to the replicas, because how much a second
 * core gives on this (virtual, shared) machine changes from minute to
 * minute. */

typedef struct {
  const bench_data *d;
  ps_ops *ops;
  ps_model *model;
  float *grads;
  int first, n, steps;
} bare_thread;

typedef struct {
  int R;
  bare_thread t[16];
} bare_set;

static void *bare_main(void *arg) {
  bare_thread *t = arg;
  for (int s = 0; s < t->steps; s++)
    ps_model_train_step(t->model, t->d->params, t->d->x + (size_t)t->first * t->d->in_size,
                        t->d->y + t->first, t->n, 1, (uint64_t)s, t->grads, NULL);
  return NULL;
}

static int bare_create(bare_set *b, const bench_data *d, int R) {
  char err[PS_ERRLEN];
  memset(b, 0, sizeof *b);
  b->R = R;
  int first = 0;
  for (int i = 0; i < R; i++) {
    bare_thread *t = &b->t[i];
    *t = (bare_thread){.d = d, .first = first, .n = d->batch / R + (i < d->batch % R)};
    first += t->n;
    t->ops = ps_ops_cpu_create(1);
    t->model = t->ops ? ps_model_create(d->spec, t->ops, t->n, err) : NULL;
    t->grads = malloc(d->P * sizeof(float));
    if (!t->model || !t->grads) return -1;
  }
  return 0;
}

static void bare_destroy(bare_set *b) {
  for (int i = 0; i < b->R; i++) {
    ps_model_destroy(b->t[i].model);
    if (b->t[i].ops) b->t[i].ops->destroy(b->t[i].ops);
    free(b->t[i].grads);
  }
}

static run_result time_bare(bare_set *b, int steps) {
  pthread_t tid[16];
  usage_mark m0 = mark();
  for (int i = 0; i < b->R; i++) {
    b->t[i].steps = steps;
    pthread_create(&tid[i], NULL, bare_main, &b->t[i]);
  }
  for (int i = 0; i < b->R; i++) pthread_join(tid[i], NULL);
  usage_mark m1 = mark();
  const double ex = (double)steps * b->t[0].d->batch;
  return (run_result){.rate = ex / (m1.wall - m0.wall),
                      .cpu_per_ex = (m1.cpu - m0.cpu) / ex,
                      .others = others_share(&m0, &m1)};
}

/* ---- diagnostics ---- */

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
  int rounds = 9, steps = 20, R = 2, batch = 64, diag = 0;
  double wait_s = 20.0;
  char job_path[1024];
  {
    const char *self = __FILE__, *tail = "tests/bench/bench_replicas.c";
    size_t n = strlen(self), t = strlen(tail);
    size_t root = n >= t && strcmp(self + n - t, tail) == 0 ? n - t : 0;
    snprintf(job_path, sizeof job_path, "%.*sdeploy/jobs/fashion_mnist_cnn.json", (int)root, self);
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
    else if (strcmp(argv[i], "--wait") == 0 && i + 1 < argc)
      wait_s = atof(argv[++i]);
    else if (strcmp(argv[i], "--diag") == 0)
      diag = 1;
    else if (argv[i][0] != '-')
      snprintf(job_path, sizeof job_path, "%s", argv[i]);
    else {
      fprintf(stderr,
              "usage: %s [--rounds N] [--steps N] [--replicas R] [--batch N] [--wait S] "
              "[--diag] [job.json]\n",
              argv[0]);
      return 2;
    }
  }
  if (rounds < 1 || rounds > 1000 || steps < 1 || R < 2 || R > 16 || batch < R) {
    fprintf(stderr,
            "bench_replicas: need rounds in [1, 1000], steps >= 1, R in [2, 16], "
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
  bench_data d = {.spec = spec,
                  .P = spec->n_params,
                  .batch = batch,
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
  bare_set bare;
  if (bare_create(&bare, &d, R) != 0) {
    fprintf(stderr, "bench_replicas: out of memory\n");
    return 1;
  }
  char desc[512];
  ps_model_spec_describe(spec, desc, sizeof desc);
  printf(
      "model: %s\nbatch %d, %d rounds of %d steps, one BLAS thread per replica\n"
      "bare: %d threads, one model each on its slice, no combination (the machine's "
      "ceiling now)\n",
      desc, batch, rounds, steps, R);
  /* Warm-up: page in activations, wake the threads. */
  time_replicas(one, &d, 2);
  time_replicas(many, &d, 2);
  time_bare(&bare, 2);

  double *ratio = calloc((size_t)rounds, sizeof *ratio);
  double *bare_ratio = calloc((size_t)rounds, sizeof *bare_ratio);
  double *q_ratio = calloc((size_t)rounds, sizeof *q_ratio);
  double *q_bare = calloc((size_t)rounds, sizeof *q_bare);
  double *q_r1 = calloc((size_t)rounds, sizeof *q_r1), *q_rn = calloc((size_t)rounds, sizeof *q_rn);
  double cpu1 = 0, cpun = 0;
  int quiet = 0;
  for (int k = 0; k < rounds; k++) {
    wait_for_quiet(wait_s);
    run_result res[3]; /* R=1, R, bare; run in an order rotated every round */
    for (int j = 0; j < 3; j++) {
      const int which = (j + k) % 3;
      res[which] = which == 0   ? time_replicas(one, &d, steps)
                   : which == 1 ? time_replicas(many, &d, steps)
                                : time_bare(&bare, steps);
    }
    ratio[k] = res[1].rate / res[0].rate;
    bare_ratio[k] = res[2].rate / res[0].rate;
    double others = 0;
    for (int j = 0; j < 3; j++)
      if (res[j].others > others) others = res[j].others;
    const int calm = others < QUIET_SHARE;
    if (calm) {
      q_ratio[quiet] = ratio[k];
      q_bare[quiet] = bare_ratio[k];
      q_r1[quiet] = res[0].rate;
      q_rn[quiet] = res[1].rate;
      quiet++;
      cpu1 += res[0].cpu_per_ex;
      cpun += res[1].cpu_per_ex;
    }
    printf(
        "round %2d: R=1 %6.1f ex/s  R=%d %6.1f ex/s  ratio %.3f  (bare x%.3f)  others up to "
        "%2.0f%%%s\n",
        k + 1, res[0].rate, R, res[1].rate, ratio[k], bare_ratio[k], 100 * others,
        calm ? "" : ": not quiet");
    fflush(stdout);
  }
  printf("median of all %d rounds: ratio R=%d/R=1 %.3f (bare x%.3f)\n", rounds, R,
         median(ratio, rounds), median(bare_ratio, rounds));
  if (quiet > 0) {
    printf(
        "median of the %d quiet rounds (others < %.0f%% of the CPUs): R=1 %.1f ex/s, R=%d "
        "%.1f ex/s, ratio R=%d/R=1 %.3f (bare x%.3f); CPU time per example R=1 %.3f ms, "
        "R=%d %.3f ms\n",
        quiet, 100 * QUIET_SHARE, median(q_r1, quiet), R, median(q_rn, quiet), R,
        median(q_ratio, quiet), median(q_bare, quiet), 1e3 * cpu1 / quiet, R, 1e3 * cpun / quiet);
  } else {
    printf("no quiet round: other processes were busy throughout\n");
  }

  if (diag) {
    /* Medians of 3, each after a wait for quiet. */
    const int part = (batch + R - 1) / R;
    double t_full[3], t_part[3];
    for (int k = 0; k < 3; k++) {
      wait_for_quiet(wait_s);
      t_full[k] = time_model(&d, batch, steps);
      t_part[k] = time_model(&d, part, steps);
    }
    const double tf = median(t_full, 3), tp = median(t_part, 3);
    double t_sum = time_sum(d.P, R, 20);
    printf(
        "diag: one model, %d examples: %.2f ms/step; %d examples: %.2f ms/step (x%.3f of "
        "the full batch's time, ideal %.3f): R=%d can reach at most x%.2f\n",
        batch, tf * 1e3, part, tp * 1e3, tp / tf, (double)part / batch, R, tf / tp);
    printf(
        "diag: combining %d gradients of %zu floats in one thread: %.3f ms (%.1f%% of an R=1 "
        "step)\n",
        R, d.P, t_sum * 1e3, 100.0 * t_sum / tf);
  }

  bare_destroy(&bare);
  ps_replicas_destroy(many);
  ps_replicas_destroy(one);
  free(ratio);
  free(bare_ratio);
  free(q_ratio);
  free(q_bare);
  free(q_r1);
  free(q_rn);
  free(d.params);
  free(d.grads);
  free(d.x);
  free(d.y);
  return 0;
}

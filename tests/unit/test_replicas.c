/* Mirrored replicas (worker/model/replicas.h) against one model
 * (ps_model_train_step on a one-thread CPU backend) on the same batch.
 *
 * Tolerances. R == 1, and any split in which only replica 0 has examples,
 * must match bit for bit: it is the same computation. For R > 1 without
 * dropout the only difference is the order of float32 summation: each
 * parameter's gradient is a sum over examples (and over output pixels for
 * a convolution: up to 64*14*14 terms for the quickstart CNN's second
 * conv), which R == 1 accumulates over the whole batch and R > 1 over
 * each slice, the slices then combined with weights n_r/n (exact for
 * powers of two, one rounding each otherwise). Such a reordering changes a sum of K terms by about
 * sqrt(K) * 2^-24 of the size of the terms, and cancellation can make a
 * gradient entry much smaller than its terms, so the bound is taken
 * relative to the largest entry of the same tensor:
 *   |got - want| <= 1e-5 * max|want over the tensor| + 1e-5 * |want|.
 * The largest error seen on these shapes is 3.5e-7 of the tensor's
 * largest entry (printed with TEST_REPLICAS_VERBOSE=1), a factor of about
 * 30 below the bound, which leaves room for other CPUs' sgemm kernels;
 * a wrong weight, a missing or doubled slice, or a wrong slice offset
 * gives errors of the order of the entries themselves. The loss is a mean
 * of per-example losses computed the same way on either side; only the
 * averaging differs: 1e-6 relative. */
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/job.h"
#include "../../common/model_spec.h"
#include "../../common/util.h"
#include "../../kernels/ops.h"
#include "worker/data/data.h"
#include "worker/model/model.h"
#include "worker/model/replicas.h"
#include "check.h"
#ifdef PS_WITH_CUDA
#include "../../kernels/cuda/cuda_device.h"
#endif

static int verbose;

/* See the header comment. */
#define GRAD_TOL 1e-5

/* ---- helpers ---- */

/* Test data from a local xorshift, independent of the code under test. */
static uint64_t rand_state = 88172645463325252ULL;

static float rand_unit(void) { /* [0, 1) */
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (float)((double)(rand_state >> 11) * (1.0 / 9007199254740992.0));
}

/* A path under the source tree: this file's path minus its own tail, so
 * that the test finds the job files from CTest's build directory (absolute
 * __FILE__) and from the repository root (relative __FILE__); or under
 * $PS_SOURCE_DIR when set (a copy of the tree elsewhere, as on a GPU
 * machine that runs a bundled build). */
static void source_path(const char *rel, char *out, size_t len) {
  const char *env = getenv("PS_SOURCE_DIR");
  if (env && *env) {
    snprintf(out, len, "%s/%s", env, rel);
    return;
  }
  const char *self = __FILE__, *tail = "tests/unit/test_replicas.c";
  size_t n = strlen(self), t = strlen(tail);
  size_t root = n >= t && strcmp(self + n - t, tail) == 0 ? n - t : 0;
  snprintf(out, len, "%.*s%s", (int)root, self, rel);
}

/* The model of a job file under the source tree. */
static int load_model(const char *rel, ps_model_spec *spec, ps_job *job_out) {
  char path[1024], err[PS_ERRLEN];
  ps_job job;
  source_path(rel, path, sizeof path);
  int rc = ps_job_load(path, &job, NULL, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc != 0) return rc;
  *spec = job.model;
  if (job_out) *job_out = job;
  return 0;
}

/* The same spec with every dropout rate 0: R > 1 then computes the same
 * function as R == 1. */
static ps_model_spec without_dropout(const ps_model_spec *spec) {
  ps_model_spec s = *spec;
  for (int i = 0; i < s.n_layers; i++)
    if (s.layers[i].type == PS_LAYER_DROPOUT) s.layers[i].rate = 0.0f;
  return s;
}

typedef struct {
  const ps_model_spec *spec;
  size_t P, in_size;
  float *params, *x; /* (P), (max_n, in_size) */
  uint8_t *y;        /* (max_n) */
} problem;

static problem make_problem(const ps_model_spec *spec, int max_n, uint64_t seed) {
  problem p = {
      .spec = spec, .P = spec->n_params, .in_size = (size_t)spec->in_c * spec->in_h * spec->in_w};
  p.params = malloc(p.P * sizeof(float));
  p.x = malloc((size_t)max_n * p.in_size * sizeof(float));
  p.y = malloc((size_t)max_n);
  ps_model_init_params(spec, seed, 0, p.P, p.params);
  for (size_t i = 0; i < (size_t)max_n * p.in_size; i++) p.x[i] = rand_unit();
  for (int i = 0; i < max_n; i++) p.y[i] = (uint8_t)(rand_unit() * (float)spec->classes);
  return p;
}

static void free_problem(problem *p) {
  free(p->params);
  free(p->x);
  free(p->y);
}

typedef struct {
  float loss;
  int correct;
  float *grads; /* (P), malloc'd */
} step_result;

/* The reference: ps_model_train_step on a fresh one-thread backend. */
static step_result reference_step(const problem *p, int n, uint64_t seed, uint64_t step) {
  char err[PS_ERRLEN];
  step_result out = {.grads = malloc(p->P * sizeof(float))};
  ps_ops *ops = ps_ops_cpu_create(1);
  ps_model *m = ps_model_create(p->spec, ops, n > 0 ? n : 1, err);
  CHECK_MSG(m != NULL, "%s", err);
  out.loss = ps_model_train_step(m, p->params, p->x, p->y, n, seed, step, out.grads, &out.correct);
  ps_model_destroy(m);
  ops->destroy(ops);
  return out;
}

static step_result replicas_step(ps_replicas *r, const problem *p, int n, uint64_t seed,
                                 uint64_t step) {
  step_result out = {.grads = malloc(p->P * sizeof(float))};
  /* NaN first: a part of the gradient left unwritten fails the comparison. */
  for (size_t i = 0; i < p->P; i++) out.grads[i] = NAN;
  out.loss =
      ps_replicas_train_step(r, p->params, p->x, p->y, n, seed, step, out.grads, &out.correct);
  return out;
}

/* Per parameter tensor, the bound of the header comment; one CHECK per
 * tensor, reporting the first element out of bounds. */
static void check_grads_close(const char *what, const ps_model_spec *spec, const float *got,
                              const float *want) {
  double worst = 0.0; /* the largest error over its tensor's largest entry */
  for (int l = 0; l < spec->n_layers; l++) {
    const ps_layer *L = &spec->layers[l];
    const size_t off[2] = {L->w_off, L->b_off}, cnt[2] = {L->w_count, L->b_count};
    for (int t = 0; t < 2; t++) {
      if (cnt[t] == 0) continue;
      double scale = 0.0;
      for (size_t i = off[t]; i < off[t] + cnt[t]; i++)
        if (fabs(want[i]) > scale) scale = fabs(want[i]);
      size_t bad = 0, first_bad = 0;
      for (size_t i = off[t]; i < off[t] + cnt[t]; i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= GRAD_TOL * scale + GRAD_TOL * fabs(want[i]))) {
          if (bad++ == 0) first_bad = i;
        }
        if (scale > 0 && err / scale > worst) worst = err / scale;
      }
      CHECK_MSG(bad == 0, "%s %s.%s: %zu of %zu off, first [%zu] got %.9g want %.9g", what, L->name,
                t ? "b" : "w", bad, cnt[t], first_bad, (double)got[first_bad],
                (double)want[first_bad]);
    }
  }
  if (verbose) printf("  %-28s max |err| / max |grad of its tensor| = %.3g\n", what, worst);
}

static void check_same_step(const char *what, const ps_model_spec *spec, const step_result *got,
                            const step_result *want) {
  CHECK_NEAR(got->loss, want->loss, 0.0, 1e-6);
  CHECK_MSG(got->correct == want->correct, "%s: correct %d, want %d", what, got->correct,
            want->correct);
  check_grads_close(what, spec, got->grads, want->grads);
}

static int bitwise_equal(const step_result *a, const step_result *b, size_t P) {
  return memcmp(&a->loss, &b->loss, sizeof a->loss) == 0 && a->correct == b->correct &&
         memcmp(a->grads, b->grads, P * sizeof(float)) == 0;
}

/* Threads of this process (Linux: entries of /proc/self/task); -1 if that
 * cannot be read. */
static int thread_count(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* ---- tests ---- */

/* R == 1 is ps_model_train_step bit for bit, dropout included. */
static void test_one_replica_is_the_model(void) {
  ps_model_spec spec;
  if (load_model("tests/integration/jobs/synthetic.json", &spec, NULL) != 0) return;
  char err[PS_ERRLEN];
  problem p = make_problem(&spec, 32, 3);
  ps_replicas *r = ps_replicas_create(&spec, 1, 32, err);
  CHECK_MSG(r != NULL, "%s", err);
  if (!r) return;
  CHECK(ps_replicas_count(r) == 1);
  const int sizes[] = {32, 17, 1};
  for (int k = 0; k < 3; k++) {
    step_result want = reference_step(&p, sizes[k], 11, 5 + (uint64_t)k);
    step_result got = replicas_step(r, &p, sizes[k], 11, 5 + (uint64_t)k);
    CHECK_MSG(bitwise_equal(&got, &want, p.P), "n=%d: R=1 differs from ps_model_train_step",
              sizes[k]);
    free(want.grads);
    free(got.grads);
  }
  ps_replicas_destroy(r);
  free_problem(&p);
}

/* R = 2 and 3 against R = 1 on the same batch, without dropout, on the
 * synthetic job's model and on the quickstart CNN. */
static void test_replicas_match_one(void) {
  const char *files[] = {"tests/integration/jobs/synthetic.json",
                         "deploy/jobs/fashion_mnist_cnn.json"};
  for (int f = 0; f < 2; f++) {
    ps_model_spec loaded;
    if (load_model(files[f], &loaded, NULL) != 0) continue;
    ps_model_spec spec = without_dropout(&loaded);
    const int n = f == 0 ? 48 : 64;
    problem p = make_problem(&spec, n, 21);
    step_result want = reference_step(&p, n, 1, 9);
    for (int R = 2; R <= 3; R++) {
      char err[PS_ERRLEN], what[96];
      ps_replicas *r = ps_replicas_create(&spec, R, n, err);
      CHECK_MSG(r != NULL, "%s", err);
      if (!r) continue;
      snprintf(what, sizeof what, "%s R=%d n=%d", f == 0 ? "synthetic" : "fmnist-cnn", R, n);
      step_result got = replicas_step(r, &p, n, 1, 9);
      check_same_step(what, &spec, &got, &want);
      free(got.grads);
      ps_replicas_destroy(r);
    }
    free(want.grads);
    free_problem(&p);
  }
}

/* Batches that do not divide evenly, and batches smaller than R. */
static void test_odd_batches(void) {
  ps_model_spec loaded;
  if (load_model("tests/integration/jobs/synthetic.json", &loaded, NULL) != 0) return;
  ps_model_spec spec = without_dropout(&loaded);
  problem p = make_problem(&spec, 32, 5);
  const struct { int R, n; } cases[] = {{2, 1}, {3, 7}, {3, 2}, {3, 1}, {2, 31}, {4, 6}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const int R = cases[c].R, n = cases[c].n;
    char err[PS_ERRLEN], what[64];
    snprintf(what, sizeof what, "R=%d n=%d", R, n);
    ps_replicas *r = ps_replicas_create(&spec, R, 32, err);
    CHECK_MSG(r != NULL, "%s", err);
    if (!r) continue;
    step_result want = reference_step(&p, n, 2, 4);
    step_result got = replicas_step(r, &p, n, 2, 4);
    check_same_step(what, &spec, &got, &want);
    if (n == 1) {
      /* Only replica 0 has an example; the empty ones add nothing, not
       * even a rounding. */
      CHECK_MSG(bitwise_equal(&got, &want, p.P), "%s: not bit for bit", what);
    }
    free(want.grads);
    free(got.grads);
    ps_replicas_destroy(r);
  }
  free_problem(&p);
}

/* The replicas' step rebuilt by hand: slice i (count[i] examples from
 * first[i]) through its own ps_model_train_step with stream step*R + i,
 * its gradient in g[i] (P floats, malloc'd), and the slices' gradients
 * weighted by count[i]/n in the returned array (malloc'd); *loss the
 * example-weighted sum of the slices' losses, *correct their count. */
static float *by_hand_slices(const ps_model_spec *spec, const problem *p, int R, const int *first,
                             const int *count, int n, uint64_t seed, uint64_t step, float **g,
                             double *loss, int *correct) {
  char err[PS_ERRLEN];
  int most = 1;
  for (int i = 0; i < R; i++) most = count[i] > most ? count[i] : most;
  ps_ops *ops = ps_ops_cpu_create(1);
  ps_model *m = ps_model_create(spec, ops, most, err);
  CHECK_MSG(m != NULL, "%s", err);
  *loss = 0.0;
  *correct = 0;
  for (int i = 0; i < R; i++) {
    g[i] = calloc(p->P, sizeof(float));
    int c = 0;
    if (m)
      *loss += (double)ps_model_train_step(m, p->params, p->x + (size_t)first[i] * p->in_size,
                                           p->y + first[i], count[i], seed,
                                           step * (uint64_t)R + (uint64_t)i, g[i], &c) *
               count[i];
    *correct += c;
  }
  float *want = malloc(p->P * sizeof(float));
  for (size_t k = 0; k < p->P; k++) {
    want[k] = ((float)count[0] / (float)n) * g[0][k];
    for (int i = 1; i < R; i++) want[k] += ((float)count[i] / (float)n) * g[i][k];
  }
  ps_model_destroy(m);
  ops->destroy(ops);
  return want;
}

/* How many of got[0..P) differ from want beyond float rounding of the same
 * products and sums (one FMA or two roundings). */
static size_t count_off(const float *got, const float *want, size_t P) {
  size_t bad = 0;
  for (size_t k = 0; k < P; k++)
    if (!(fabsf(got[k] - want[k]) <= 1e-7f + 1e-6f * fabsf(want[k]))) bad++;
  return bad;
}

/* With dropout, replica i runs ps_model_train_step on its slice with
 * stream step*R + i, and the gradient is w_0 g_0 + w_1 g_1 + ...: rebuilt
 * here by hand from separate models. */
static void test_dropout_streams(void) {
  ps_model_spec spec;
  if (load_model("tests/integration/jobs/synthetic.json", &spec, NULL) != 0) return;
  const int R = 3, n = 20; /* slices of 7, 7, 6 */
  const int first[3] = {0, 7, 14}, count[3] = {7, 7, 6};
  const uint64_t seed = 77, step = 12;
  problem p = make_problem(&spec, n, 8);
  /* The same examples in every slice, so that only the masks tell the
   * replicas apart. */
  for (int i = 7; i < n; i++) {
    memcpy(p.x + (size_t)i * p.in_size, p.x + (size_t)(i % 7) * p.in_size,
           p.in_size * sizeof(float));
    p.y[i] = p.y[i % 7];
  }
  char err[PS_ERRLEN];
  float *g[3];
  double loss;
  int correct;
  float *want = by_hand_slices(&spec, &p, R, first, count, n, seed, step, g, &loss, &correct);
  /* Replicas 0 and 1 saw the same examples: only their masks differ. */
  CHECK(memcmp(g[0], g[1], p.P * sizeof(float)) != 0);

  ps_replicas *r = ps_replicas_create(&spec, R, 32, err);
  CHECK_MSG(r != NULL, "%s", err);
  if (r) {
    step_result got = replicas_step(r, &p, n, seed, step);
    CHECK_NEAR(got.loss, loss / n, 0.0, 1e-6);
    CHECK(got.correct == correct);
    /* The same products and sums in the same order: equal up to how the
     * compiler rounds a*b+c (one FMA or two roundings). */
    const size_t bad = count_off(got.grads, want, p.P);
    CHECK_MSG(bad == 0, "%zu of %zu gradient values differ from the by-hand sum", bad, p.P);
    /* Deterministic: the same step again gives the same bits; another
     * step draws other masks. */
    step_result again = replicas_step(r, &p, n, seed, step);
    CHECK(bitwise_equal(&again, &got, p.P));
    step_result other = replicas_step(r, &p, n, seed, step + 1);
    CHECK(memcmp(other.grads, got.grads, p.P * sizeof(float)) != 0);
    free(got.grads);
    free(again.grads);
    free(other.grads);
    ps_replicas_destroy(r);
  }
  for (int i = 0; i < R; i++) free(g[i]);
  free(want);
  free_problem(&p);
}

/* Batchnorm: each replica normalizes its own slice, so the gradient is
 * the slices' weighted sum as with dropout, and the pushed statistics (in
 * the moving statistics' places) are the slices' means and variances
 * weighted by their sizes; the by-hand sum from separate models. */
static void test_batchnorm_slices(void) {
  ps_model_spec spec;
  if (load_model("tests/integration/jobs/batchnorm.json", &spec, NULL) != 0) return;
  const int R = 2, n = 20; /* slices of 10 and 10 */
  const int first[2] = {0, 10}, count[2] = {10, 10};
  problem p = make_problem(&spec, n, 31);
  char err[PS_ERRLEN];
  float *g[2];
  double loss;
  int correct;
  float *want = by_hand_slices(&spec, &p, R, first, count, n, 3, 5, g, &loss, &correct);
  ps_replicas *r = ps_replicas_create(&spec, R, 32, err);
  CHECK_MSG(r != NULL, "%s", err);
  if (r) {
    step_result got = replicas_step(r, &p, n, 3, 5);
    const size_t bad = count_off(got.grads, want, p.P);
    CHECK_MSG(bad == 0, "%zu of %zu values differ from the slices' weighted sum", bad, p.P);
    /* The statistics differ between the slices, and the push carries their mean. */
    const ps_layer *bn = &spec.layers[1];
    CHECK(bn->type == PS_LAYER_BATCHNORM);
    CHECK(g[0][bn->s_off] != g[1][bn->s_off]);
    CHECK_NEAR(got.grads[bn->s_off], 0.5 * ((double)g[0][bn->s_off] + g[1][bn->s_off]), 0.0,
               1e-6);
    free(got.grads);
    ps_replicas_destroy(r);
  }
  for (int i = 0; i < R; i++) free(g[i]);
  free(want);
  free_problem(&p);
}

/* One replicas object over many steps of different sizes: the threads are
 * reused, and every step still matches its reference. */
static void test_repeated_steps(void) {
  ps_model_spec loaded;
  if (load_model("tests/integration/jobs/synthetic.json", &loaded, NULL) != 0) return;
  ps_model_spec spec = without_dropout(&loaded);
  problem p = make_problem(&spec, 40, 13);
  char err[PS_ERRLEN];
  ps_replicas *r = ps_replicas_create(&spec, 3, 40, err);
  CHECK_MSG(r != NULL, "%s", err);
  if (!r) return;
  step_result first = replicas_step(r, &p, 40, 0, 0);
  for (int s = 0; s < 30; s++) {
    const int n = s % 5 == 4 ? 40 : 1 + (s * 7) % 40;
    step_result got = replicas_step(r, &p, n, 0, (uint64_t)s);
    step_result want = reference_step(&p, n, 0, (uint64_t)s);
    char what[64];
    snprintf(what, sizeof what, "step %d n=%d", s, n);
    check_same_step(what, &spec, &got, &want);
    if (n == 40) CHECK_MSG(bitwise_equal(&got, &first, p.P), "%s: differs from step 0", what);
    free(got.grads);
    free(want.grads);
  }
  free(first.grads);
  ps_replicas_destroy(r);
  free_problem(&p);
}

/* create starts R threads, destroy joins them; bad arguments and batch
 * sizes are refused. */
static void test_lifecycle_and_errors(void) {
  ps_model_spec spec;
  if (load_model("tests/integration/jobs/synthetic.json", &spec, NULL) != 0) return;
  char err[PS_ERRLEN];
  /* Threads joined by earlier tests can stay listed in /proc/self/task for
   * a moment (the kernel wakes the joiner before it removes the task):
   * count once the number has held still for 50 ms, waiting at most 2 s. */
  int before = thread_count();
  for (int i = 0, still = 0; i < 200 && still < 5; i++) {
    ps_sleep_ms(10);
    const int now = thread_count();
    still = now == before ? still + 1 : 0;
    before = now;
  }
  ps_replicas *r = ps_replicas_create(&spec, 4, 16, err);
  CHECK_MSG(r != NULL, "%s", err);
  if (!r) return;
  if (before >= 0) {
    CHECK_MSG(thread_count() == before + 4, "threads %d, want %d", thread_count(), before + 4);
  }
  problem p = make_problem(&spec, 17, 1);
  float *grads = malloc(p.P * sizeof(float));
  for (size_t i = 0; i < p.P; i++) grads[i] = 1.5f;
  int correct = -1;
  /* Too many examples: NAN, grads unaltered. */
  float loss = ps_replicas_train_step(r, p.params, p.x, p.y, 17, 0, 0, grads, &correct);
  CHECK(isnan(loss));
  CHECK(grads[0] == 1.5f && grads[p.P - 1] == 1.5f);
  loss = ps_replicas_train_step(r, p.params, p.x, p.y, -1, 0, 0, grads, &correct);
  CHECK(isnan(loss));
  /* No examples: a zero gradient. */
  loss = ps_replicas_train_step(r, p.params, p.x, p.y, 0, 0, 0, grads, &correct);
  CHECK(loss == 0.0f && correct == 0);
  size_t nonzero = 0;
  for (size_t i = 0; i < p.P; i++) nonzero += grads[i] != 0.0f;
  CHECK(nonzero == 0);
  /* correct may be NULL. */
  loss = ps_replicas_train_step(r, p.params, p.x, p.y, 16, 0, 0, grads, NULL);
  CHECK(isfinite(loss) && loss > 0.0f);
  ps_replicas_destroy(r);
  if (before >= 0) {
    /* As above: the joined threads may stay listed a moment. */
    for (int i = 0; i < 200 && thread_count() != before; i++) ps_sleep_ms(10);
    CHECK_MSG(thread_count() == before, "threads %d, want %d", thread_count(), before);
  }
  ps_replicas_destroy(NULL);

  err[0] = '\0';
  CHECK(ps_replicas_create(&spec, 0, 16, err) == NULL);
  CHECK(strstr(err, "R >= 1") != NULL);
  CHECK(ps_replicas_create(&spec, 2, 0, err) == NULL);
  CHECK(ps_replicas_create(NULL, 2, 16, err) == NULL);
  free(grads);
  free_problem(&p);
}

/* Test accuracy after `steps` steps of plain SGD with R replicas on the
 * synthetic job's data set, dropout on. */
static double train_synthetic(const ps_job *job, const ps_dataset *train, const ps_dataset *test,
                              int R, int steps, float lr) {
  const ps_model_spec *spec = &job->model;
  const size_t P = spec->n_params, in_size = (size_t)train->c * train->h * train->w;
  const int batch = job->batch_size;
  char err[PS_ERRLEN];
  float *params = malloc(P * sizeof(float)), *grads = malloc(P * sizeof(float));
  ps_model_init_params(spec, job->seed, 0, P, params);
  ps_replicas *r = ps_replicas_create(spec, R, batch, err);
  CHECK_MSG(r != NULL, "%s", err);
  double acc = -1.0;
  if (r) {
    int finite = 1;
    for (int s = 0; s < steps; s++) {
      const int start = (s * batch) % (train->n - batch + 1);
      float loss =
          ps_replicas_train_step(r, params, train->images + (size_t)start * in_size,
                                 train->labels + start, batch, job->seed, (uint64_t)s, grads, NULL);
      if (!isfinite(loss)) finite = 0;
      for (size_t i = 0; i < P; i++) params[i] -= lr * grads[i];
    }
    CHECK(finite);
    ps_replicas_destroy(r);
    ps_ops *ops = ps_ops_cpu_create(1);
    ps_model *eval = ps_model_create(spec, ops, 256, err);
    CHECK_MSG(eval != NULL, "%s", err);
    if (eval) {
      int correct = 0;
      ps_model_evaluate(eval, params, test->images, test->labels, test->n, &correct);
      acc = (double)correct / test->n;
      ps_model_destroy(eval);
    }
    ops->destroy(ops);
  }
  free(params);
  free(grads);
  return acc;
}

static void test_training_converges(void) {
  ps_job job;
  ps_model_spec spec;
  if (load_model("tests/integration/jobs/synthetic.json", &spec, &job) != 0) return;
  ps_dataset train, test;
  CHECK(ps_dataset_synthetic(job.synthetic_train, spec.in_c, spec.in_h, spec.in_w, spec.classes,
                             job.seed, 0, &train) == 0);
  CHECK(ps_dataset_synthetic(job.synthetic_test, spec.in_c, spec.in_h, spec.in_w, spec.classes,
                             job.seed, 1, &test) == 0);
  const int steps = 300;
  const float lr = 0.05f;
  /* No steps: chance level, so reaching the threshold means learning. */
  double acc0 = train_synthetic(&job, &train, &test, 2, 0, lr);
  CHECK_MSG(acc0 < 0.5, "untrained test accuracy %.4f", acc0);
  double acc1 = train_synthetic(&job, &train, &test, 1, steps, lr);
  double acc2 = train_synthetic(&job, &train, &test, 2, steps, lr);
  if (verbose)
    printf("  test accuracy: untrained %.4f; after %d SGD steps R=1 %.4f, R=2 %.4f\n", acc0, steps,
           acc1, acc2);
  CHECK_MSG(acc1 >= 0.9, "R=1 test accuracy %.4f", acc1);
  CHECK_MSG(acc2 >= 0.9, "R=2 test accuracy %.4f", acc2);
  ps_dataset_free(&train);
  ps_dataset_free(&test);
}

/* Replicas whose backends hold their memory apart from the host (here the
 * emulated device of kernels/emu, which checks every pointer): each
 * copies the parameters in and its gradient out, and the sum is the host
 * sum of the cpu replicas, so the results equal theirs bit for bit, with
 * dropout, odd batches and batches smaller than R. */
static void test_device_replicas(void) {
  ps_model_spec spec;
  if (load_model("tests/integration/jobs/synthetic.json", &spec, NULL) != 0) return;
  problem p = make_problem(&spec, 32, 17);
  const struct { int R, n; } cases[] = {{1, 32}, {2, 32}, {3, 31}, {3, 2}, {2, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const int R = cases[c].R, n = cases[c].n;
    char err[PS_ERRLEN], what[64];
    snprintf(what, sizeof what, "emulated device R=%d n=%d", R, n);
    ps_replicas *cpu = ps_replicas_create(&spec, R, 32, err);
    ps_replicas *dev = ps_replicas_create_for(&spec, R, 32, "emu", err);
    CHECK_MSG(cpu && dev, "%s: %s", what, err);
    if (cpu && dev) {
      CHECK(!ps_replicas_on_device(cpu) && ps_replicas_on_device(dev) && !ps_replicas_nccl(dev));
      for (uint64_t step = 0; step < 2; step++) {
        step_result want = replicas_step(cpu, &p, n, 3, step);
        step_result got = replicas_step(dev, &p, n, 3, step);
        CHECK_MSG(bitwise_equal(&got, &want, p.P), "%s step %d: differs from the cpu replicas",
                  what, (int)step);
        free(want.grads);
        free(got.grads);
      }
    }
    ps_replicas_destroy(cpu);
    ps_replicas_destroy(dev);
  }
  /* A backend that cannot be made: NULL and the factory's message. */
  char err[PS_ERRLEN] = "";
  CHECK(ps_replicas_create_with(&spec, 2, 8, NULL, NULL, err) == NULL && err[0]);
  err[0] = '\0';
  CHECK(ps_replicas_create_for(&spec, 2, 8, "tpu", err) == NULL && strstr(err, "tpu"));
  free_problem(&p);
}

/* On the GPUs (one replica per GPU, NCCL when there are several): against
 * one model on the cpu, within the tolerance of the CUDA parity test's
 * end-to-end check. Skipped (and said so) without a device. */
static void test_cuda_replicas(void) {
#ifdef PS_WITH_CUDA
  char why[128] = "";
  const int devices = ps_cuda_device_count(why);
  if (devices == 0) {
    printf("SKIPPED: replicas on cuda: no CUDA device (%s)\n", why);
    return;
  }
  ps_model_spec loaded;
  if (load_model("tests/integration/jobs/synthetic.json", &loaded, NULL) != 0) return;
  ps_model_spec spec = without_dropout(&loaded);
  problem p = make_problem(&spec, 48, 29);
  step_result want = reference_step(&p, 48, 1, 2);
  const int Rs[] = {1, 2, devices > 2 ? devices : 3};
  for (int k = 0; k < 3; k++) {
    char err[PS_ERRLEN];
    ps_replicas *r = ps_replicas_create_cuda(&spec, Rs[k], 48, err);
    CHECK_MSG(r != NULL, "R=%d: %s", Rs[k], err);
    if (!r) continue;
    CHECK(ps_replicas_on_device(r));
    step_result got = replicas_step(r, &p, 48, 1, 2);
    double worst = 0.0, scale = 0.0;
    for (size_t j = 0; j < p.P; j++) {
      double d = fabs((double)got.grads[j] - want.grads[j]);
      if (d > worst) worst = d;
      if (fabs((double)want.grads[j]) > scale) scale = fabs((double)want.grads[j]);
    }
    printf("replicas on cuda: R=%d (%d device(s), %s): largest difference %.3g of %.3g\n",
           Rs[k], devices, ps_replicas_nccl(r) ? "NCCL" : "host sum", worst, scale);
    /* The path each R must take: more replicas than GPUs (always so for R
     * = 3 on one or two GPUs, and R = 2 on one) sum through host memory; one
     * per GPU uses NCCL when the build has it. */
    if (Rs[k] == 1 || Rs[k] > devices)
      CHECK_MSG(!ps_replicas_nccl(r), "R=%d on %d device(s) should sum through the host", Rs[k],
                devices);
#ifdef PS_WITH_NCCL
    else
      CHECK_MSG(ps_replicas_nccl(r), "R=%d on %d devices should sum with NCCL", Rs[k], devices);
#endif
    CHECK_MSG(worst <= 1e-3 * scale, "R=%d: gradient off by %.3g (largest entry %.3g)", Rs[k],
              worst, scale);
    CHECK_NEAR(got.loss, want.loss, 1e-6, 1e-4);
    free(got.grads);
    ps_replicas_destroy(r);
  }
  free(want.grads);
  free_problem(&p);
#else
  printf("SKIPPED: replicas on cuda: built without CUDA (WITH_CUDA=OFF)\n");
#endif
}

int main(void) {
  verbose = getenv("TEST_REPLICAS_VERBOSE") != NULL;
  RUN(test_one_replica_is_the_model);
  RUN(test_replicas_match_one);
  RUN(test_odd_batches);
  RUN(test_dropout_streams);
  RUN(test_batchnorm_slices);
  RUN(test_repeated_steps);
  RUN(test_lifecycle_and_errors);
  RUN(test_training_converges);
  RUN(test_device_replicas);
  RUN(test_cuda_replicas);
  return check_summary();
}

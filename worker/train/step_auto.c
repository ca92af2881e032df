/* --pipeline auto on a device: the plain and the pipelined step both run on
 * the first steps, in alternating blocks after a few warm-up steps, and the
 * faster is kept for the rest of the run. They give the same parameters
 * bit for bit (the pipeline test compares them), so the choice changes the
 * time alone; the pipeline is kept only when it is faster by more than
 * AUTO_MARGIN, so that auto is never slower than off by more than what
 * the trial costs. Which is faster depends on the model and the cluster: the
 * pipeline hides the wire behind the first layers, but the plain step can
 * replay a recorded graph (on a small model, one launch instead of dozens)
 * and a pipelined step cannot. */
#include <stdlib.h>

#include "common/util.h"
#include "worker/train/step.h"

enum {
  AUTO_WARM = 5,   /* plain steps first (plans, a recorded graph, caches) */
  AUTO_BLOCK = 4,  /* steps of one kind in a row */
  AUTO_ROUNDS = 3, /* blocks of each kind */
  AUTO_TRIAL = AUTO_WARM + 2 * AUTO_BLOCK * AUTO_ROUNDS,
};
#define AUTO_MARGIN 0.03

typedef struct {
  ps_worker *w;
  void *plain, *pipe; /* the two kinds' states */
  int chosen;         /* -1 while trying; else 0 plain, 1 pipeline */
  int64_t runs;       /* steps run */
  double times[2][AUTO_BLOCK * AUTO_ROUNDS];
  int n[2];
} auto_state;

static int auto_begin(ps_worker *w, void **state, char *err) {
  auto_state *a = calloc(1, sizeof *a);
  if (!a) return ps_seterr(err, -1, "out of memory");
  a->w = w;
  a->chosen = -1;
  if (ps_step_plain.begin(w, &a->plain, err) != 0) {
    free(a);
    return -1;
  }
  if (ps_step_pipeline.begin(w, &a->pipe, err) != 0) {
    ps_step_plain.end(a->plain, 0, err);
    free(a);
    return -1;
  }
  PS_INFO("pipeline auto: the plain and the pipelined step are timed on steps %d to %d; the "
          "faster goes on", AUTO_WARM + 1, AUTO_TRIAL);
  *state = a;
  return 0;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return a < b ? -1 : a > b;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n ? v[n / 2] : 0.0;
}

/* Which kind this step of the trial runs: plain while warming up, then
 * blocks of pipeline and plain in turn. */
static int trial_kind(int64_t run) {
  if (run < AUTO_WARM) return 0;
  return ((run - AUTO_WARM) / AUTO_BLOCK) % 2 == 0;
}

static void decide(auto_state *a) {
  double plain = median(a->times[0], a->n[0]), pipe = median(a->times[1], a->n[1]);
  a->chosen = pipe < plain * (1.0 - AUTO_MARGIN);
  PS_INFO("pipeline auto: a step took %.2f ms plain, %.2f ms pipelined (medians of %d): %s",
          plain * 1e3, pipe * 1e3, a->n[0],
          a->chosen ? "the pipelined step goes on" : "the plain step goes on");
}

static int auto_run(void *state, int64_t step, const ps_batch *b, ps_step_result *r, char *err) {
  auto_state *a = state;
  int kind = a->chosen >= 0 ? a->chosen : trial_kind(a->runs);
  int rc = kind ? ps_step_pipeline.run(a->pipe, step, b, r, err)
                : ps_step_plain.run(a->plain, step, b, r, err);
  if (rc != 0 || r->job_done) return rc;
  if (a->chosen < 0) {
    if (a->runs >= AUTO_WARM && a->n[kind] < AUTO_BLOCK * AUTO_ROUNDS)
      a->times[kind][a->n[kind]++] = r->pull_s + r->compute_s + r->push_s;
    if (a->runs + 1 == AUTO_TRIAL) decide(a);
  }
  a->runs++;
  return 0;
}

static int auto_end(void *state, int ok, char *err) {
  auto_state *a = state;
  int rc = ps_step_pipeline.end(a->pipe, ok, err);
  if (ps_step_plain.end(a->plain, ok, err) != 0) rc = -1;
  free(a);
  return rc;
}

const ps_step_kind ps_step_auto = {
    .name = "auto", .begin = auto_begin, .run = auto_run, .end = auto_end};

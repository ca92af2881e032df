/* The compute of a step (one model or mirrored replicas) and the choice of
 * the step kind (see step.h). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#include "common/rng.h"
#include "common/util.h"
#include "worker/train/step.h"

const ps_step_kind *ps_step_choose(ps_worker *w) {
  if (w->o.local) return &ps_step_local;
  int overlap = w->o.overlap;
  if (w->rows) {
    /* A step's rows are its batch's: the pull waits for the batch. */
    if (overlap || w->o.pipeline == PS_PIPELINE_ON)
      PS_INFO("%s: off with embedding layers (each step pulls its batch's rows)",
              overlap ? "overlap" : "pipeline");
    return &ps_step_plain;
  }
  if (overlap && w->job.mode_kind == PS_MODE_SYNC) {
    /* A sync step's pull waits for the step this worker pushed: nothing to overlap. */
    PS_INFO("overlap: off in sync mode");
    overlap = 0;
  }
  if (overlap) return &ps_step_overlap;
  /* Replicas compute a whole step at a time, so they take the plain step.
   * auto: on the cpu plain, since the shards applying early pushes would
   * compete with the backward pass for the cores when they share the host
   * (measured: no gain, up to 7% loss with 4 local shards on 2 cores); on
   * a device both are timed on the first steps and the faster is kept
   * (step_auto.c: a small model's replayed graph can beat the pipeline). */
  if (w->reps) return &ps_step_plain;
  if (w->o.pipeline == PS_PIPELINE_ON) return &ps_step_pipeline;
  if (w->o.pipeline == PS_PIPELINE_AUTO && !w->ops->host_memory) return &ps_step_auto;
  return &ps_step_plain;
}

uint64_t ps_step_stream(const ps_worker *w, int64_t step) {
  return (uint64_t)step * 1024 + (uint64_t)w->rank;
}

int ps_step_check_loss(int64_t step, float loss, char *err) {
  if (isfinite(loss)) return 0;
  snprintf(err, PS_ERRLEN,
           "step %" PRId64 ": the loss is %f; the gradient is not pushed. Lower the learning rate.",
           step, (double)loss);
  return -1;
}

static void mark_forward(void *user) {
  ps_ops *o = ((ps_worker *)user)->ops;
  o->mark(o->ctx, PS_MARK_FORWARD);
}

/* The backward pass's last call (lo == 0): the whole gradient is written. */
static void grads_out(void *user, size_t lo) {
  ps_worker *w = user;
  ps_ops *o = w->ops;
  if (lo != 0) return;
  const int marks = o->mark && o->marks_read;
  if (marks) o->mark(o->ctx, PS_MARK_BACKWARD);
  if (w->dgrads != w->grads)
    o->to_host(o->ctx, w->grads, w->dgrads, w->job.model.n_params * sizeof(float));
  if (marks) o->mark(o->ctx, PS_MARK_D2H);
}

float ps_compute_step(ps_worker *w, int64_t step, const ps_batch *b, int *correct) {
  uint64_t stream = ps_step_stream(w, step);
  float loss;
  if (w->reps) { /* host memory in and out; each replica copies what it needs */
    loss = ps_replicas_train_step(w->reps, w->params, b->x, b->y, b->n, w->job.seed ^ 0xd0d0,
                                  stream, w->grads, correct);
  } else {
    /* ps_model_train_step in its stages, with the backend's marks between
     * them (the same ops in the same order). */
    ps_ops *o = w->ops;
    const int marks = o->mark && o->marks_read;
    if (marks) o->mark(o->ctx, PS_MARK_BEGIN);
    if (w->dparams != w->params) ps_model_params_to_device(w->model, w->dparams, w->params);
    ps_model_step_begin(w->model, b->x, b->y, b->n, w->job.seed ^ 0xd0d0, stream);
    if (marks) o->mark(o->ctx, PS_MARK_H2D);
    if (w->o.cuda_graphs == 0 &&
        ps_model_graph_step(w->model, w->dparams, w->dgrads, marks ? mark_forward : NULL, w)) {
      grads_out(w, 0);
      loss = ps_model_step_loss(w->model);
      if (correct) *correct = ps_model_step_correct(w->model);
    } else {
      ps_model_step_forward(w->model, w->dparams, w->job.model.n_params);
      if (marks) o->mark(o->ctx, PS_MARK_FORWARD);
      /* The gradient's copy is queued behind the backward pass, before the
       * loss and count are read (which waits), so nothing waits in between. */
      loss = ps_model_step_backward(w->model, w->dparams, w->dgrads, grads_out, w, correct);
    }
    o->sync(o->ctx);
    w->phase_ok = 0;
    if (marks) {
      double ms[PS_MARKS];
      o->marks_read(o->ctx, ms, PS_MARKS);
      /* Every mark recorded, in order: a mark the backend did not record
       * reads -1, and a phase made from it would be nonsense (negative). */
      w->phase_ok = ms[PS_MARK_BEGIN] >= 0;
      for (int i = 0; i < 4; i++) {
        w->phase_ms[i] = ms[i + 1] - ms[i];
        if (ms[i + 1] < 0 || w->phase_ms[i] < 0) w->phase_ok = 0;
      }
    }
  }
  int delay = ps_step_straggle_ms(w, step); /* an artificial straggler */
  if (delay > 0) ps_sleep_ms(delay);
  w->straggled_ms += delay;
  return loss;
}

int ps_step_straggle_ms(const ps_worker *w, int64_t step) {
  const ps_worker_opts *o = &w->o;
  if (o->straggle_kind == PS_STRAGGLE_NONE) return 0;
  if (o->straggle_kind == PS_STRAGGLE_FIXED) return (int)(o->straggle_a + 0.5);
  /* 53 bits of (the job's seed, this worker, the step) in [0, 1) */
  double u = (double)(ps_rng_u64(w->job.seed, 0x57a661eull, ps_step_stream(w, step)) >> 11) *
             (1.0 / 9007199254740992.0);
  double ms = o->straggle_kind == PS_STRAGGLE_UNIFORM
                  ? o->straggle_a + (o->straggle_b - o->straggle_a) * u
                  : -o->straggle_a * log1p(-u);
  if (o->straggle_kind == PS_STRAGGLE_EXP && ms > 100 * o->straggle_a) ms = 100 * o->straggle_a;
  return (int)(ms + 0.5);
}

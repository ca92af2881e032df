/* The local step (--local): no servers; the job's optimizer runs in this
 * process on the parameters it initialised. The baseline the benchmarks
 * compare a cluster with. */
#include <stdlib.h>

#include "common/optim.h"
#include "common/util.h"
#include "worker/train/step.h"

typedef struct {
  ps_worker *w;
  const ps_optimizer *opt;
  float **slots;
  ps_moving_range moving[PS_MAX_MOVING_RANGES]; /* averaged in, as on a shard */
  int n_moving;
} local_state;

static void local_free(local_state *s) {
  if (s->slots) {
    for (int k = 0; k < s->opt->n_slots; k++) ps_free(s->slots[k]);
    free(s->slots);
  }
  free(s);
}

static int local_begin(ps_worker *w, void **state, char *err) {
  const size_t P = w->job.model.n_params;
  local_state *s = calloc(1, sizeof *s);
  if (!s) return ps_seterr(err, -1, "out of memory");
  s->w = w;
  s->opt = ps_optimizer_find(w->job.optim.name);
  s->slots = calloc((size_t)(s->opt->n_slots + 1), sizeof(float *));
  if (!s->slots) {
    local_free(s);
    return ps_seterr(err, -1, "out of memory");
  }
  for (int k = 0; k < s->opt->n_slots; k++) {
    s->slots[k] = ps_alloc(P * sizeof(float));
    if (!s->slots[k]) {
      local_free(s);
      return ps_seterr(err, -1, "out of memory");
    }
    float init = s->opt->slot_init(&w->job.optim, k);
    for (size_t i = 0; i < P; i++) s->slots[k][i] = init;
  }
  ps_model_init_params(&w->job.model, w->job.seed, 0, P, w->params);
  s->n_moving = ps_model_moving_ranges(&w->job.model, s->moving);
  PS_INFO("local mode: no servers; optimizer %s lr %g in this process", w->job.optim.name,
          (double)w->job.optim.lr);
  *state = s;
  return 0;
}

static int local_run(void *state, int64_t step, const ps_batch *b, ps_step_result *r, char *err) {
  local_state *s = state;
  ps_worker *w = s->w;
  double tb = ps_now_s();
  r->loss = ps_compute_step(w, step, b, &r->correct);
  double tc = ps_now_s();
  if (ps_step_check_loss(step, r->loss, err) != 0) return -1;
  ps_optim_apply_ranges(s->opt, &w->job.optim, (uint64_t)step + 1, w->job.optim.lr, w->params,
                        s->slots, w->grads, w->job.model.n_params, 0, s->moving, s->n_moving);
  r->applied = 1;
  r->compute_s = tc - tb;
  r->push_s = ps_now_s() - tc;
  return 0;
}

static int local_end(void *state, int ok, char *err) {
  (void)ok, (void)err;
  local_free(state);
  return 0;
}

const ps_step_kind ps_step_local = {
    .name = "local", .begin = local_begin, .run = local_run, .end = local_end};

/* The plain step: pull every shard, compute, push every shard, one after
 * the other. */
#include "common/util.h"
#include "worker/train/step.h"

static int plain_begin(ps_worker *w, void **state, char *err) {
  (void)err;
  *state = w;
  return 0;
}

static int plain_run(void *state, int64_t step, const ps_batch *b, ps_step_result *r, char *err) {
  ps_worker *w = state;
  double ta = ps_now_s();
  /* The batch's embedding rows go with this step's pull and push. */
  if (w->rows && ps_worker_rows_prepare(w, w->rows, b->ids, b->n, err) != 0) return -1;
  if (ps_worker_pull(w, err) != 0) return -1;
  if (ps_worker_sync_steps_done(w)) {
    r->job_done = 1;
    return 0;
  }
  double tb = ps_now_s();
  r->loss = ps_compute_step(w, step, b, &r->correct);
  double tc = ps_now_s();
  if (ps_step_check_loss(step, r->loss, err) != 0) return -1;
  if (ps_client_push_begin(w->client, w->versions, (uint64_t)step, b->n, b->tag) != 0) {
    snprintf(err, PS_ERRLEN, "a push is still in flight");
    return -1;
  }
  if (ps_worker_push_end(w, err) != 0) return -1;
  r->pushed = r->count_dropped = r->applied = 1;
  r->res = w->push_res;
  r->pull_s = tb - ta;
  r->compute_s = tc - tb;
  r->push_s = ps_now_s() - tc;
  return 0;
}

static int plain_end(void *state, int ok, char *err) {
  (void)state, (void)ok, (void)err;
  return 0;
}

const ps_step_kind ps_step_plain = {
    .name = "plain", .begin = plain_begin, .run = plain_run, .end = plain_end};

/* The pipelined step: pull, compute and push of one step overlap, shard by
 * shard, in the training thread (ps_model_step_* and the client's
 * ps_client_pull_ex/push_shard):
 *  - as each shard's reply lands in the pinned host buffer, its range is
 *    copied to the device on the copy queue, and every layer whose
 *    parameters have all arrived is queued forward; the device computes the
 *    first layers while later shards are still on the wire;
 *  - the backward pass is queued in one go; as a layer's gradient is
 *    written, the shards whose ranges are complete get copied back on the
 *    copy queue, and each shard's push starts as soon as its copy has
 *    landed, while the device goes on with earlier layers.
 * The gradient and the parameters are those of the plain step, bit for bit
 * (the integration test `pipeline` compares them). On the cpu backend the
 * copies are nothing and the ops are done on return, so what overlaps is
 * the pushes of the last layers' shards with the backward pass of the
 * first ones (the shards apply while the worker computes). */
#include <inttypes.h>
#include <stdlib.h>

#include "common/util.h"
#include "worker/train/step.h"

typedef struct {
  ps_worker *w;
  const ps_batch *b;
  uint64_t stream;
  int attempt;
  uint64_t *tickets; /* per shard: its gradient's copy to the host */
  int to_copy;       /* shards >= to_copy have been copied (or queued) */
  int to_push;       /* shards >= to_push have been pushed */
  int backward_done; /* the backward pass has been queued whole */
  uint64_t early;    /* pushes started before it had */
  double forward_s;  /* time in the forward pass while pulling */
  /* over the run */
  uint64_t early_pushes, all_pushes;
} pipe_state;

static int pipe_begin(ps_worker *w, void **state, char *err) {
  pipe_state *p = calloc(1, sizeof *p);
  if (p) p->tickets = calloc((size_t)w->nshards, sizeof *p->tickets);
  if (!p || !p->tickets) {
    free(p);
    return ps_seterr(err, -1, "out of memory");
  }
  p->w = w;
  PS_INFO("pipeline: each shard's parameters go to the compute as they arrive, and its "
          "gradient out as soon as it is computed");
  *state = p;
  return 0;
}

static void start_forward(pipe_state *p) {
  ps_worker *w = p->w;
  ps_model_step_begin(w->model, p->b->x, p->b->y, p->b->n, w->job.seed ^ 0xd0d0, p->stream);
}

static void pull_ready(void *user, int attempt, int shard, size_t avail) {
  pipe_state *p = user;
  ps_worker *w = p->w;
  if (shard < 0) {
    /* The pull starts over: so does the forward pass, once the copies and
     * ops that read the earlier attempt's parameters are done (before the
     * new attempt writes over them). */
    PS_INFO("pipeline: the pull starts over (attempt %d); so does the step's forward pass",
            attempt + 1);
    w->ops->sync(w->ops->ctx);
    start_forward(p);
    p->attempt = attempt;
    return;
  }
  if (w->dparams != w->params) {
    size_t off, cnt;
    ps_client_shard_range(w->client, shard, &off, &cnt);
    w->ops->to_device_async(w->ops->ctx, w->dparams + off, w->params + off, cnt * sizeof(float));
  }
  double t0 = ps_now_s();
  ps_model_step_forward(w->model, w->dparams, avail);
  p->forward_s += ps_now_s() - t0;
}

static int op_pull(void *ctx, char *err) {
  pipe_state *p = ctx;
  ps_worker *w = p->w;
  w->ops->sync(w->ops->ctx); /* nothing queued may still read dparams */
  start_forward(p);
  p->attempt = 0;
  p->forward_s = 0;
  return ps_client_pull_ex(w->client, w->params, w->versions,
                           w->job.mode_kind == PS_MODE_SYNC ? w->min_versions : NULL, pull_ready,
                           p, err);
}

/* Starts the pushes of the shards whose gradients have landed on the host,
 * from the last shard down; wait: wait for each copy rather than stop at
 * the first one still in flight. A push that cannot start now is started
 * (and its failure reported) by ps_client_push_end. */
static void push_landed(pipe_state *p, int wait) {
  ps_worker *w = p->w;
  char err[PS_ERRLEN];
  while (p->to_push > p->to_copy) {
    int s = p->to_push - 1;
    if (wait)
      w->ops->ticket_wait(w->ops->ctx, p->tickets[s]);
    else if (!w->ops->ticket_done(w->ops->ctx, p->tickets[s]))
      return;
    /* Early: the backward pass is still being queued, or (on a device)
     * still computing: the first layers' gradient, copied back last, has
     * not landed. */
    int running = !p->backward_done || !w->ops->ticket_done(w->ops->ctx, p->tickets[0]);
    if (ps_client_push_shard(w->client, s, w->grads, err) == 0 && running) p->early++;
    p->to_push = s;
  }
}

/* The backward pass has written grads[lo, P). */
static void grads_ready(void *user, size_t lo) {
  pipe_state *p = user;
  ps_worker *w = p->w;
  if (lo == 0) p->backward_done = 1;
  while (p->to_copy > 0) {
    int s = p->to_copy - 1;
    size_t off, cnt;
    ps_client_shard_range(w->client, s, &off, &cnt);
    if (off < lo) break;
    p->tickets[s] = w->dgrads != w->grads
                        ? w->ops->to_host_async(w->ops->ctx, w->grads + off, w->dgrads + off,
                                                cnt * sizeof(float))
                        : 0;
    p->to_copy = s;
  }
  push_landed(p, 0);
}

static int pipe_run(void *state, int64_t step, const ps_batch *b, ps_step_result *r, char *err) {
  pipe_state *p = state;
  ps_worker *w = p->w;
  const size_t P = w->job.model.n_params;
  p->b = b;
  p->stream = ps_step_stream(w, step);
  p->to_copy = p->to_push = w->nshards;
  p->backward_done = 0;
  p->early = 0;
  double ta = ps_now_s();
  if (ps_worker_retry(w, "Pull", op_pull, p, err) != 0) return -1;
  if (ps_worker_sync_steps_done(w)) {
    ps_model_step_forward(w->model, w->dparams, P); /* the forward pass begun in the pull ends */
    r->job_done = 1;
    return 0;
  }
  double tb = ps_now_s();
  /* An artificial straggler: here, before the first push can start, so
   * that every shard's gradient is late (and, as in the plain step, after
   * a sync pull was granted). */
  int delay = ps_step_straggle_ms(w, step);
  if (delay > 0) ps_sleep_ms(delay);
  w->straggled_ms += delay;
  ps_model_step_forward(w->model, w->dparams, P); /* done already: every shard arrived */
  r->loss = ps_model_step_loss(w->model);
  if (ps_step_check_loss(step, r->loss, err) != 0) return -1;
  if (ps_client_push_begin(w->client, w->versions, (uint64_t)step, b->n, b->tag) != 0) {
    snprintf(err, PS_ERRLEN, "a push is still in flight");
    return -1;
  }
  /* The whole backward pass is queued before anything waits; then each
   * shard's push starts as its gradient lands, while the device still
   * computes the earlier layers; the arg-max count, which waits for the
   * device, comes last. */
  ps_model_step_backward(w->model, w->dparams, w->dgrads, grads_ready, p, NULL);
  push_landed(p, 1);
  r->correct = ps_model_step_correct(w->model);
  p->early_pushes += p->early;
  p->all_pushes += (uint64_t)w->nshards;
  double tc = ps_now_s();
  if (ps_worker_push_end(w, err) != 0) return -1;
  r->pushed = r->count_dropped = r->applied = 1;
  r->res = w->push_res;
  /* The forward pass ran inside the pull: its time counts as compute. */
  tb -= p->forward_s;
  r->pull_s = tb - ta;
  r->compute_s = tc - tb;
  r->push_s = ps_now_s() - tc;
  return 0;
}

static int pipe_end(void *state, int ok, char *err) {
  (void)ok, (void)err;
  pipe_state *p = state;
  if (p->all_pushes)
    PS_INFO("pipeline: %" PRIu64 " of %" PRIu64 " shard pushes started while the backward pass "
            "was still running", p->early_pushes, p->all_pushes);
  free(p->tickets);
  free(p);
  return 0;
}

const ps_step_kind ps_step_pipeline = {
    .name = "pipeline", .begin = pipe_begin, .run = pipe_run, .end = pipe_end};

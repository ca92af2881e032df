/* One training step, as each kind does it. The training loop (train.c)
 * asks the data source for a batch, runs the step of the kind chosen once
 * at the start, records what it says, and evaluates on schedule; the kinds
 * differ only in how pull, compute and push are arranged:
 *
 *   plain     pull, compute, push, one after the other   step_plain.c
 *   pipeline  the three overlap shard by shard            step_pipeline.c
 *   overlap   push and pull of step t on a second thread
 *             while step t+1 computes                     step_overlap.c
 *   local     no servers: the optimizer runs here         step_local.c
 *   auto      plain and pipeline timed on the first
 *             steps, the faster kept (--pipeline auto
 *             on a device)                                step_auto.c
 *
 * How a step computes (one model, or mirrored replicas summed before the
 * push) is the compute's business (compute.c), so replicas go with plain,
 * overlap and local steps alike. */
#ifndef PS_WORKER_STEP_H
#define PS_WORKER_STEP_H

#include <stdint.h>

#include "worker/train/worker.h"

/* What one step did, for the progress lines and the data source. */
typedef struct {
  float loss;
  int correct;
  double pull_s, compute_s, push_s; /* where the step's time went */
  int pushed;            /* res holds the shards' answers to a push */
  int count_dropped;     /* ... and its dropped gradients count (sync) */
  ps_push_result res;
  int applied;           /* this batch's gradient is applied by every shard */
  int job_done;          /* sync: the pull found the job's steps applied; nothing
                            was computed or pushed, and the loop stops */
} ps_step_result;

typedef struct {
  const char *name;
  /* Sets the kind up (buffers, threads, the first pull where the kind
   * needs one); *state is the kind's. 0, or -1 with a message in err
   * (nothing left to end). */
  int (*begin)(ps_worker *w, void **state, char *err);
  /* Step `step` on batch b. 0, or -1 with a message in err: the loop
   * stops. */
  int (*run)(void *state, int64_t step, const ps_batch *b, ps_step_result *r, char *err);
  /* Points w->params and w->versions at parameters that may be
   * evaluated now (NULL: they always may be). */
  void (*eval_params)(void *state);
  /* Finishes what is still in flight,
   * puts w's buffers back as setup made them, frees the state. ok: the
   * loop ended without an error. 0, or -1 with a message in err. */
  int (*end)(void *state, int ok, char *err);
} ps_step_kind;

/* Counts a training step of n examples in epoch for the metrics endpoint
 * (worker_prom.c; nothing without one). */
void ps_worker_prom_step(ps_worker *w, const ps_step_result *r, int n, int epoch);

extern const ps_step_kind ps_step_plain, ps_step_pipeline, ps_step_overlap, ps_step_local,
    ps_step_auto;

/* The kind for this worker's options, job and backend (logging why when
 * a choice was overruled). */
const ps_step_kind *ps_step_choose(ps_worker *w);

/* The compute of one step: forward and backward on b with w->params into
 * w->grads (host memory in and out: copies to and from the backend are
 * made here), through the replicas when there are several; then
 * --straggle-ms. Returns the loss; *correct the right answers. */
float ps_compute_step(ps_worker *w, int64_t step, const ps_batch *b, int *correct);

/* The artificial straggler's delay of a step in ms (--straggle,
 * --straggle-ms): drawn from the job's seed, the worker's rank and the
 * step, so a run's delays are the same when it is run again. */
int ps_step_straggle_ms(const ps_worker *w, int64_t step);

/* The dropout stream of a step: the same on every kind. */
uint64_t ps_step_stream(const ps_worker *w, int64_t step);

/* 0 when loss is finite; else -1 with the message that stops training. */
int ps_step_check_loss(int64_t step, float loss, char *err);

#endif

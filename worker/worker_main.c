/* ps-worker: pulls the parameters, computes gradients on its share of the
 * data, pushes them to the shards; the chief also evaluates the test split.
 *
 * Threads: the main thread runs the training loop (pull, compute, push);
 * a second thread runs a libuv loop that owns the heartbeat timer (the
 * blocking heartbeat calls run on libuv's work queue), SIGINT/SIGTERM (the
 * loop stops after the current step and the worker leaves cleanly); the
 * batcher fills batches on a third. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "../common/cluster.h"
#include "../common/job.h"
#include "../common/metrics.h"
#include "../common/optim.h"
#include "../common/rng.h"
#include "../common/rpc.h"
#include "../common/util.h"
#include "../kernels/ops.h"
#include "data.h"
#include "device.h"
#include "model.h"
#include "ps_client.h"
#include "replicas.h"
#ifdef PS_WITH_CUDA
#include "../kernels/cuda/ops_cuda.h"
#endif

typedef struct {
  /* options */
  const char *ps_addr, *job_path, *metrics_path, *data_dir, *host, *save_path, *device;
  int index, num_workers, chief, local, threads, timeout_ms, epochs, straggle_ms;
  int replicas, per_replica_batch;
  int evaluator, max_evals, idle_evals; /* the evaluator role */
  int overlap;  /* async/ssp: push and pull on a second thread while computing */
  int pipeline; /* pull, compute and push of a step overlap shard by shard */
  ps_replicas *reps;
  int64_t max_steps;
  double log_interval, eval_interval, retry_s;
  /* state */
  ps_job job;
  ps_client *client;
  ps_ops *ops;
  ps_model *model, *eval_model;
  ps_dataset train, test;
  ps_batcher *batcher;
  ps_metrics *metrics;
  float *params, *grads;   /* host: what is pulled and pushed */
  float *dparams, *dgrads; /* the backend's copies (the same buffers on the cpu) */
  uint64_t *versions;     /* per shard: the version pulled */
  uint64_t *min_versions; /* per shard: sync mode waits for the step pushed */
  /* the last push's answers */
  ps_push_result push_res;
  int rank;
  /* local mode: the optimizer runs here */
  const ps_optimizer *opt;
  float **slots;
  /* shared with the loop thread */
  atomic_int stop;
  atomic_uint_fast64_t step;
  uv_loop_t loop;
  uv_thread_t loop_thread;
  uv_timer_t hb_timer;
  uv_signal_t sigint, sigterm;
  uv_async_t quit;
  uv_work_t hb_work;
  int hb_busy;
} worker;

/* ---------------- loop thread: heartbeats and signals ---------------- */

static void hb_run(uv_work_t *req) {
  worker *w = req->data;
  char err[PS_ERRLEN];
  if (ps_client_heartbeat(w->client, atomic_load(&w->step), err) != 0)
    PS_WARN("heartbeat: %s", err);
}

static void hb_done(uv_work_t *req, int status) {
  worker *w = req->data;
  w->hb_busy = 0;
}

static void on_hb_timer(uv_timer_t *t) {
  worker *w = t->data;
  if (w->hb_busy || !w->client) return; /* the previous one is still out */
  w->hb_busy = 1;
  w->hb_work.data = w;
  uv_queue_work(&w->loop, &w->hb_work, hb_run, hb_done);
}

static void on_signal(uv_signal_t *s, int signum) {
  worker *w = s->data;
  if (atomic_exchange(&w->stop, 1) == 0)
    PS_INFO("%s: finishing the current step, then leaving", signum == SIGINT ? "SIGINT" : "SIGTERM");
  else
    PS_INFO("second signal: still finishing the current step");
}

static void on_quit(uv_async_t *a) {
  worker *w = a->data;
  uv_timer_stop(&w->hb_timer);
  uv_close((uv_handle_t *)&w->hb_timer, NULL);
  uv_close((uv_handle_t *)&w->sigint, NULL);
  uv_close((uv_handle_t *)&w->sigterm, NULL);
  uv_close((uv_handle_t *)&w->quit, NULL);
}

static void loop_main(void *arg) {
  worker *w = arg;
  uv_run(&w->loop, UV_RUN_DEFAULT);
}

static int start_loop(worker *w) {
  uv_loop_init(&w->loop);
  uv_timer_init(&w->loop, &w->hb_timer);
  w->hb_timer.data = w;
  uv_signal_init(&w->loop, &w->sigint);
  w->sigint.data = w;
  uv_signal_start(&w->sigint, on_signal, SIGINT);
  uv_signal_init(&w->loop, &w->sigterm);
  w->sigterm.data = w;
  uv_signal_start(&w->sigterm, on_signal, SIGTERM);
  uv_async_init(&w->loop, &w->quit, on_quit);
  w->quit.data = w;
  if (!w->local) {
    int period = ps_client_heartbeat_timeout_ms(w->client) / 3;
    if (period < 50) period = 50;
    uv_timer_start(&w->hb_timer, on_hb_timer, (uint64_t)period, (uint64_t)period);
  }
  return uv_thread_create(&w->loop_thread, loop_main, w);
}

static void stop_loop(worker *w) {
  uv_async_send(&w->quit);
  uv_thread_join(&w->loop_thread);
  uv_loop_close(&w->loop);
}

/* ---------------- training ---------------- */

/* Retries op() with exponential backoff and jitter while the servers are
 * unreachable, for at most retry_s seconds. */
static int with_retry_ctx(worker *w, const char *what, int (*op)(void *, char *), void *ctx,
                          char *err) {
  /* Unreachable servers, and shards that gave up holding a pull back. */
  double deadline = ps_now_s() + w->retry_s;
  int64_t backoff = 100;
  ps_rand r;
  ps_rand_seed(&r, (uint64_t)getpid() ^ (uint64_t)ps_now_ms());
  for (int attempt = 0;; attempt++) {
    int rc = op(ctx, err);
    if (rc == 0 || (rc != PS_EUNAVAIL && rc != PS_ETIMEDOUT) || atomic_load(&w->stop)) return rc;
    if (ps_now_s() + backoff / 1000.0 > deadline) return rc;
    int64_t sleep = backoff / 2 + (int64_t)ps_rand_below(&r, (uint64_t)backoff / 2 + 1);
    PS_WARN("%s failed (%s); retrying in %" PRId64 " ms", what, err, sleep);
    ps_sleep_ms(sleep);
    if (backoff < 5000) backoff *= 2;
  }
}

/* Retries op(w) (an op_* below, which takes the worker as its context). */
static int with_retry(worker *w, const char *what, int (*op)(void *, char *), char *err) {
  return with_retry_ctx(w, what, op, w, err);
}

static int op_pull(void *ctx, char *err) {
  worker *w = ctx;
  return ps_client_pull(w->client, w->params, w->versions,
                        w->job.mode_kind == PS_MODE_SYNC ? w->min_versions : NULL, err);
}

/* The end of a push round started with ps_client_push_begin: a retry
 * pushes only the shards that have not applied the gradient. */
static int op_push(void *ctx, char *err) {
  worker *w = ctx;
  int rc = ps_client_push_end(w->client, w->grads, &w->push_res, err);
  /* sync: the next pull waits for the step this gradient was for (or, if
   * it was dropped, for the step that went on without it: already done). */
  if (rc == 0)
    for (int s = 0; s < ps_client_num_shards(w->client); s++)
      w->min_versions[s] = w->versions[s] + 1;
  return rc;
}

static double evaluate(worker *w, int64_t step, double t0, float *loss_out) {
  int correct = 0;
  if (w->dparams != w->params) ps_model_params_to_device(w->model, w->dparams, w->params);
  float loss = ps_model_evaluate(w->eval_model, w->dparams, w->test.images, w->test.labels,
                                 w->test.n, &correct);
  double acc = w->test.n ? (double)correct / w->test.n : 0.0;
  if (loss_out) *loss_out = loss;
  if (w->metrics) {
    json_t *rec = json_pack("{s:i,s:I,s:I,s:f,s:f,s:f,s:i}", "worker", w->rank, "step",
                            (json_int_t)step, "updates", (json_int_t)(w->local ? (uint64_t)step : w->versions[0]),
                            "test_accuracy", acc, "test_loss", (double)loss,
                            "elapsed_s", ps_now_s() - t0, "test_examples", w->test.n);
    ps_metrics_write(w->metrics, rec);
    json_decref(rec);
  }
  return acc;
}

/* Writes the parameters as raw little-endian float32, fsynced. */
static int save_params(worker *w, const char *path) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    PS_ERROR("cannot write '%s': %s", path, strerror(errno));
    return 1;
  }
  size_t P = w->job.model.n_params;
  int bad = fwrite(w->params, sizeof(float), P, f) != P;
  bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
  bad |= fclose(f) != 0;
  if (bad) {
    PS_ERROR("cannot write '%s'", path);
    return 1;
  }
  PS_INFO("wrote the %zu parameters to %s", P, path);
  return 0;
}

/* The batcher's chunk source in lease mode: asks shard 0 for the next
 * chunk, waiting while every chunk left is leased to someone else. */
static int lease_source(void *user, uint64_t *begin, uint32_t *count, uint64_t *tag, int *epoch) {
  worker *w = user;
  char err[PS_ERRLEN];
  double give_up = ps_now_s() + w->retry_s;
  int64_t backoff = 50;
  while (!atomic_load(&w->stop)) {
    ps_client_lease l;
    int rc = ps_client_lease_call(w->client, 0, 1, (uint64_t)w->train.n, &l, err);
    if (rc == 0 && l.status == 0) {
      *begin = l.begin;
      *count = l.count;
      *tag = l.lease_id;
      *epoch = l.epoch;
      return 0;
    }
    if (rc == 0 && l.status == 2) return 1; /* the last epoch is done */
    if (rc != 0) {
      if ((rc != PS_EUNAVAIL && rc != PS_ETIMEDOUT) || ps_now_s() > give_up) {
        PS_ERROR("%s", err);
        return -1;
      }
      PS_WARN("%s; retrying", err);
    } else {
      give_up = ps_now_s() + w->retry_s; /* waiting for others' chunks is progress */
    }
    ps_sleep_ms(backoff);
    if (backoff < 1000) backoff *= 2;
  }
  return 1;
}

/* The host side of what is pulled and pushed: pinned memory when the
 * backend is a GPU, so that its copies run at full speed and
 * asynchronously; plain aligned memory otherwise. */
#ifdef PS_WITH_CUDA
static int on_cuda(const worker *w) { return w->ops && strcmp(w->ops->name, "cuda") == 0; }
#endif

static float *host_buffer(worker *w, size_t bytes) {
#ifdef PS_WITH_CUDA
  if (on_cuda(w)) {
    void *p = NULL;
    if (ps_cuda_host_alloc(&p, bytes) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
  }
#endif
  return ps_alloc(bytes);
}

static void host_buffer_free(worker *w, float *p) {
  if (!p) return;
#ifdef PS_WITH_CUDA
  if (on_cuda(w)) {
    ps_cuda_host_free(p);
    return;
  }
#endif
  ps_free(p);
}

/* ---------------- overlap: communication beside compute ---------------- */

/* One round of communication, run on the comm thread while the training
 * thread computes the next step: push a gradient, report a finished lease,
 * pull fresh parameters into the buffer the last step computed from. */
typedef struct {
  worker *w;
  /* in */
  const float *grads;
  const uint64_t *base_versions;
  uint64_t step;
  int batch;
  uint64_t lease_tag; /* a chunk finished with this push, or 0 */
  float *pull_into;
  uint64_t *pull_versions;
  /* out */
  int rc;
  char err[PS_ERRLEN];
  ps_push_result res;
  int lease_counted, lease_reported;
} comm_job;

typedef struct {
  uv_thread_t thread;
  uv_mutex_t mu;
  uv_cond_t cv;
  comm_job *job; /* the job to run, or NULL */
  int busy, quit;
} comm_thread;

static int comm_push(void *ctx, char *err) {
  comm_job *j = ctx;
  return ps_client_push_end(j->w->client, j->grads, &j->res, err);
}

static int comm_pull(void *ctx, char *err) {
  comm_job *j = ctx;
  return ps_client_pull(j->w->client, j->pull_into, j->pull_versions, NULL, err);
}

static void comm_run(comm_job *j) {
  worker *w = j->w;
  j->err[0] = '\0';
  j->rc = ps_client_push_begin(w->client, j->base_versions, j->step, j->batch);
  if (j->rc != 0) snprintf(j->err, sizeof j->err, "a push is still in flight");
  if (j->rc == 0) j->rc = with_retry_ctx(w, "Push", comm_push, j, j->err);
  if (j->rc == 0 && j->lease_tag) {
    ps_client_lease l;
    j->lease_reported = 1;
    j->lease_counted = ps_client_lease_call(w->client, j->lease_tag, 0, 0, &l, j->err) == 0 &&
                       l.completed_counted;
  }
  if (j->rc == 0) j->rc = with_retry_ctx(w, "Pull", comm_pull, j, j->err);
}

static void comm_main(void *arg) {
  comm_thread *c = arg;
  uv_mutex_lock(&c->mu);
  for (;;) {
    while (!c->job && !c->quit) uv_cond_wait(&c->cv, &c->mu);
    if (c->quit) break;
    comm_job *j = c->job;
    uv_mutex_unlock(&c->mu);
    comm_run(j);
    uv_mutex_lock(&c->mu);
    c->job = NULL;
    c->busy = 0;
    uv_cond_broadcast(&c->cv);
  }
  uv_mutex_unlock(&c->mu);
}

static void comm_start_job(comm_thread *c, comm_job *j) {
  uv_mutex_lock(&c->mu);
  c->job = j;
  c->busy = 1;
  uv_cond_broadcast(&c->cv);
  uv_mutex_unlock(&c->mu);
}

static void comm_wait(comm_thread *c) {
  uv_mutex_lock(&c->mu);
  while (c->busy) uv_cond_wait(&c->cv, &c->mu);
  uv_mutex_unlock(&c->mu);
}

static void comm_stop(comm_thread *c) {
  comm_wait(c);
  uv_mutex_lock(&c->mu);
  c->quit = 1;
  uv_cond_broadcast(&c->cv);
  uv_mutex_unlock(&c->mu);
  uv_thread_join(&c->thread);
  uv_cond_destroy(&c->cv);
  uv_mutex_destroy(&c->mu);
}

/* ---------------- the pipelined step ----------------
 *
 * Pull, compute and push of one step overlap, shard by shard, in the
 * training thread (ps_model_step_* and ps_client_pull_ex/push_shard):
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
typedef struct {
  worker *w;
  ps_batch *b;
  uint64_t stream;
  int attempt;
  int nshards;
  uint64_t *tickets; /* per shard: its gradient's copy to the host */
  int to_copy;       /* shards >= to_copy have been copied (or queued) */
  int to_push;       /* shards >= to_push have been pushed */
  int backward_done;  /* the backward pass has been queued whole */
  uint64_t early;     /* pushes started before it had */
  double forward_s;   /* time in the forward pass while pulling */
} pipe_step;

static void pipe_begin(pipe_step *p) {
  worker *w = p->w;
  ps_model_step_begin(w->model, p->b->x, p->b->y, p->b->n, w->job.seed ^ 0xd0d0, p->stream);
}

static void pipe_pull_ready(void *user, int attempt, int shard, size_t avail) {
  pipe_step *p = user;
  worker *w = p->w;
  if (shard < 0) {
    /* The pull starts over: so does the forward pass, once the copies and
     * ops that read the earlier attempt's parameters are done (before the
     * new attempt writes over them). */
    PS_INFO("pipeline: the pull starts over (attempt %d); so does the step's forward pass",
            attempt + 1);
    w->ops->sync(w->ops->ctx);
    pipe_begin(p);
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

static int op_pull_pipelined(void *ctx, char *err) {
  pipe_step *p = ctx;
  worker *w = p->w;
  w->ops->sync(w->ops->ctx); /* nothing queued may still read dparams */
  pipe_begin(p);
  p->attempt = 0;
  p->forward_s = 0;
  return ps_client_pull_ex(w->client, w->params, w->versions,
                           w->job.mode_kind == PS_MODE_SYNC ? w->min_versions : NULL,
                           pipe_pull_ready, p, err);
}

/* Starts the pushes of the shards whose gradients have landed on the host,
 * from the last shard down; wait: wait for each copy rather than stop at
 * the first one still in flight. A push that cannot start now is started
 * (and its failure reported) by ps_client_push_end. */
static void pipe_push_landed(pipe_step *p, int wait) {
  worker *w = p->w;
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
static void pipe_grads_ready(void *user, size_t lo) {
  pipe_step *p = user;
  worker *w = p->w;
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
  pipe_push_landed(p, 0);
}

/* Adds what the shards said of one push to the interval's counts. */
static void count_push(const ps_push_result *r, int nshards, uint64_t *stale_sum,
                       uint64_t *stale_n, uint64_t *stale_max, uint64_t *dropped) {
  *stale_sum += r->staleness_sum;
  *stale_n += (uint64_t)nshards;
  if (r->staleness_max > *stale_max) *stale_max = r->staleness_max;
  if (dropped) *dropped += r->dropped > 0;
}

static int train(worker *w) {
  char err[PS_ERRLEN];
  const size_t P = w->job.model.n_params;
  const int batch = w->job.batch_size;
  int leased = w->client && w->job.lease_chunk > 0;
  int64_t total;
  if (leased) {
    /* The data comes chunk by chunk from shard 0 until its last epoch. */
    total = w->max_steps > 0 ? w->max_steps : INT64_MAX;
    PS_INFO("training: data leased from shard 0 in chunks of %d examples, %d epoch(s) over "
            "the %d examples for the whole cluster, batch %d",
            w->job.lease_chunk, w->job.epochs, w->train.n, batch);
  } else {
    int epoch_size = ps_batcher_epoch_size(w->batcher);
    int64_t steps_per_epoch = (epoch_size + batch - 1) / batch;
    total = steps_per_epoch * w->epochs;
    if (w->max_steps > 0 && w->max_steps < total) total = w->max_steps;
    PS_INFO("training: %d examples in this worker's share, %" PRId64 " steps per epoch, %" PRId64
            " steps, batch %d",
            epoch_size, steps_per_epoch, total, batch);
  }
  uint64_t chunks_done = 0, chunks_lost = 0;

  /* Overlap: two parameter buffers (one computed from, one being pulled
   * into) and two gradient buffers (one written, one being pushed). Step t
   * computes from the parameters pulled while step t-1 computed, so its
   * gradient is one version staler than without overlap. */
  int overlap = w->overlap && !w->local && w->client;
  if (overlap && w->job.mode_kind == PS_MODE_SYNC) {
    /* A sync step's pull waits for the step this worker pushed: nothing to overlap. */
    PS_INFO("overlap: off in sync mode");
    overlap = 0;
  }
  /* The pipelined step: the plain step (not local, overlap or replicas),
   * unless --pipeline off. */
  /* auto: on where the compute leaves the host's cores free (a GPU); on
   * the cpu the shards applying early pushes would compete with the
   * backward pass for the cores when they share the host (measured: no
   * gain, up to 7% loss with 4 local shards on 2 cores). */
  int want_pipeline = w->pipeline < 0 ? !w->ops->host_memory : w->pipeline;
  int pipelined = want_pipeline && !w->local && w->client && !overlap && !w->reps;
  int nshards = w->client ? ps_client_num_shards(w->client) : 0;
  uint64_t *tickets = NULL, early_pushes = 0, all_pushes = 0;
  if (pipelined) {
    tickets = calloc((size_t)nshards, sizeof *tickets);
    if (!tickets) {
      PS_ERROR("out of memory");
      return 1;
    }
    PS_INFO("pipeline: each shard's parameters go to the compute as they arrive, and its "
            "gradient out as soon as it is computed");
  }
  comm_thread comm;
  comm_job jobs[2];
  float *pbuf[2] = {w->params, NULL}, *gbuf[2] = {w->grads, NULL};
  uint64_t *vbuf[2] = {w->versions, NULL};
  int job_pending = 0;
  if (overlap) {
    size_t ns = (size_t)nshards;
    pbuf[1] = host_buffer(w, P * sizeof(float));
    gbuf[1] = host_buffer(w, P * sizeof(float));
    vbuf[1] = calloc(ns, sizeof(uint64_t));
    memset(&comm, 0, sizeof comm);
    int ok = pbuf[1] && gbuf[1] && vbuf[1];
    if (ok && uv_mutex_init(&comm.mu) == 0) {
      if (uv_cond_init(&comm.cv) == 0) {
        if (uv_thread_create(&comm.thread, comm_main, &comm) != 0) {
          uv_cond_destroy(&comm.cv);
          uv_mutex_destroy(&comm.mu);
          ok = 0;
        }
      } else {
        uv_mutex_destroy(&comm.mu);
        ok = 0;
      }
    } else {
      ok = 0;
    }
    if (!ok) snprintf(err, sizeof err, "cannot set up the communication thread");
    int started = ok;
    if (ok && with_retry(w, "Pull", op_pull, err) != 0) ok = 0; /* into pbuf[0] */
    if (!ok) {
      PS_ERROR("%s", err);
      if (started) comm_stop(&comm);
      host_buffer_free(w, pbuf[1]);
      host_buffer_free(w, gbuf[1]);
      free(vbuf[1]);
      return 1;
    }
    memcpy(pbuf[1], pbuf[0], P * sizeof(float));
    memcpy(vbuf[1], vbuf[0], ns * sizeof(uint64_t));
    PS_INFO("overlap: pushes and pulls run beside compute (one version staler)");
  }

  double t0 = ps_now_s(), last_log = t0, last_eval = t0;
  double sum_loss = 0, t_pull = 0, t_push = 0, t_comp = 0;
  int64_t n_ex = 0, n_correct = 0, n_steps = 0, total_ex = 0;
  uint64_t stale_sum = 0, stale_n = 0, stale_max = 0, dropped = 0;
  int rc = 0;
  int64_t step = 0;
  for (; step < total && !atomic_load(&w->stop); step++) {
    ps_batch *b = NULL;
    if (ps_batcher_next(w->batcher, &b) != 0) {
      PS_ERROR("the input pipeline failed");
      rc = 1;
      break;
    }
    if (b->n == 0) { /* leases: no more data */
      ps_batcher_release(w->batcher, b);
      break;
    }
    int cur = (int)(step & 1);
    if (overlap) {
      w->params = pbuf[cur];
      w->grads = gbuf[cur];
      w->versions = vbuf[cur];
      if (w->ops->host_memory) {
        w->dparams = w->params;
        w->dgrads = w->grads;
      }
    }
    double ta = ps_now_s(), tb, tc, td;
    uint64_t stream = (uint64_t)step * 1024 + (uint64_t)w->rank;
    int correct = 0;
    float loss;
    if (pipelined) {
      pipe_step p = {.w = w, .b = b, .stream = stream, .nshards = nshards, .tickets = tickets,
                     .to_copy = nshards, .to_push = nshards};
      if (with_retry_ctx(w, "Pull", op_pull_pipelined, &p, err) != 0) {
        PS_ERROR("%s", err);
        ps_batcher_release(w->batcher, b);
        rc = 1;
        break;
      }
      tb = ps_now_s();
      /* An artificial straggler: here, before the first push can start, so
       * that every shard's gradient is late (and, as in the plain step,
       * after a sync pull was granted). */
      if (w->straggle_ms > 0) ps_sleep_ms(w->straggle_ms);
      ps_model_step_forward(w->model, w->dparams, P); /* done already: every shard arrived */
      loss = ps_model_step_loss(w->model);
      if (!isfinite(loss)) {
        PS_ERROR("step %" PRId64 ": the loss is %f; the gradient is not pushed. Lower the "
                 "learning rate.", step, (double)loss);
        ps_batcher_release(w->batcher, b);
        rc = 1;
        break;
      }
      if (ps_client_push_begin(w->client, w->versions, (uint64_t)step, b->n) != 0) {
        PS_ERROR("a push is still in flight");
        ps_batcher_release(w->batcher, b);
        rc = 1;
        break;
      }
      /* The whole backward pass is queued before anything waits; then each
       * shard's push starts as its gradient lands, while the device still
       * computes the earlier layers; the arg-max count, which waits for the
       * device, comes last. */
      ps_model_step_backward(w->model, w->dparams, w->dgrads, pipe_grads_ready, &p, NULL);
      pipe_push_landed(&p, 1);
      correct = ps_model_step_correct(w->model);
      early_pushes += p.early;
      all_pushes += (uint64_t)nshards;
      tc = ps_now_s();
      if (with_retry(w, "Push", op_push, err) != 0) {
        PS_ERROR("%s", err);
        ps_batcher_release(w->batcher, b);
        rc = 1;
        break;
      }
      count_push(&w->push_res, nshards, &stale_sum, &stale_n, &stale_max, &dropped);
      td = ps_now_s();
      /* The forward pass ran inside the pull: its time counts as compute. */
      tb -= p.forward_s;
    } else {
      if (!w->local && !overlap && with_retry(w, "Pull", op_pull, err) != 0) {
        PS_ERROR("%s", err);
        ps_batcher_release(w->batcher, b);
        rc = 1;
        break;
      }
      tb = ps_now_s();
      if (w->reps) { /* host memory in and out; each replica copies what it needs */
        loss = ps_replicas_train_step(w->reps, w->params, b->x, b->y, b->n, w->job.seed ^ 0xd0d0,
                                      stream, w->grads, &correct);
      } else {
        if (w->dparams != w->params) ps_model_params_to_device(w->model, w->dparams, w->params);
        loss = ps_model_train_step(w->model, w->dparams, b->x, b->y, b->n, w->job.seed ^ 0xd0d0,
                                   stream, w->dgrads, &correct);
        if (w->dgrads != w->grads) ps_model_params_to_host(w->model, w->grads, w->dgrads);
      }
      if (w->straggle_ms > 0) ps_sleep_ms(w->straggle_ms); /* an artificial straggler */
      tc = ps_now_s();
      if (!isfinite(loss)) {
        PS_ERROR("step %" PRId64 ": the loss is %f; the gradient is not pushed. Lower the "
                 "learning rate.", step, (double)loss);
        ps_batcher_release(w->batcher, b);
        rc = 1;
        break;
      }
      if (w->local) {
        w->opt->apply(&w->job.optim, (uint64_t)step + 1, w->job.optim.lr, w->params, w->slots,
                      w->grads, P);
      } else if (overlap) {
        /* Wait for the previous round (it filled the other parameter buffer,
         * which the next step computes from), then start this step's. */
        if (job_pending) {
          comm_wait(&comm);
          job_pending = 0;
          comm_job *pj = &jobs[1 - cur];
          if (pj->rc != 0) {
            PS_ERROR("%s", pj->err);
            ps_batcher_release(w->batcher, b);
            rc = 1;
            break;
          }
          count_push(&pj->res, nshards, &stale_sum, &stale_n, &stale_max, NULL);
          if (pj->lease_reported) {
            if (pj->lease_counted) chunks_done++;
            else chunks_lost++;
          }
        }
        comm_job *j = &jobs[cur];
        memset(j, 0, sizeof *j);
        j->w = w;
        j->grads = gbuf[cur];
        j->base_versions = vbuf[cur];
        j->step = (uint64_t)step;
        j->batch = b->n;
        j->lease_tag = leased && b->last_in_chunk ? b->tag : 0;
        j->pull_into = pbuf[cur]; /* computed from; free now */
        j->pull_versions = vbuf[cur];
        comm_start_job(&comm, j);
        job_pending = 1;
      } else {
        int brc = ps_client_push_begin(w->client, w->versions, (uint64_t)step, b->n);
        if (brc != 0) snprintf(err, sizeof err, "a push is still in flight");
        if (brc != 0 || with_retry(w, "Push", op_push, err) != 0) {
          PS_ERROR("%s", err);
          ps_batcher_release(w->batcher, b);
          rc = 1;
          break;
        }
        count_push(&w->push_res, nshards, &stale_sum, &stale_n, &stale_max, &dropped);
      }
      td = ps_now_s();
    }
    t_pull += tb - ta;
    t_comp += tc - tb;
    t_push += td - tc;
    sum_loss += (double)loss * b->n;
    n_ex += b->n;
    total_ex += b->n;
    n_correct += correct;
    n_steps++;
    int epoch = b->epoch;
    if (leased && b->last_in_chunk && !overlap) {
      /* Every example of the chunk went into a pushed gradient. */
      ps_client_lease l;
      err[0] = '\0';
      if (ps_client_lease_call(w->client, b->tag, 0, 0, &l, err) == 0 && l.completed_counted) {
        chunks_done++;
      } else {
        chunks_lost++;
        PS_WARN("chunk of lease %" PRIx64 " finished but not counted (%s)", b->tag,
                err[0] ? err : "the lease had expired and went to another worker");
        err[0] = '\0';
      }
    }
    ps_batcher_release(w->batcher, b);
    atomic_store(&w->step, (uint64_t)step + 1);

    double now = ps_now_s();
    if (now - last_log >= w->log_interval || step + 1 == total) {
      double dt = now - last_log;
      double eps = n_ex / (dt > 0 ? dt : 1e-9);
      double smean = stale_n ? (double)stale_sum / stale_n : 0.0;
      char drop_note[48] = "";
      if (w->job.mode_kind == PS_MODE_SYNC)
        snprintf(drop_note, sizeof drop_note, " | %" PRIu64 " dropped", dropped);
      char of_total[32] = "";
      if (total != INT64_MAX) snprintf(of_total, sizeof of_total, "/%" PRId64, total);
      PS_INFO("step %" PRId64 "%s epoch %d | loss %.4f acc %.3f | %.0f ex/s | "
              "staleness %.2f max %" PRIu64 "%s | pull %.1f compute %.1f push %.1f ms/step",
              step + 1, of_total, epoch, sum_loss / n_ex, (double)n_correct / n_ex, eps, smean,
              stale_max, drop_note, 1e3 * t_pull / n_steps, 1e3 * t_comp / n_steps,
              1e3 * t_push / n_steps);
      if (w->metrics) {
        json_t *rec = json_pack(
            "{s:i,s:I,s:i,s:f,s:f,s:f,s:f,s:I,s:I,s:f,s:f,s:f}", "worker", w->rank, "step",
            (json_int_t)(step + 1), "epoch", epoch, "loss", sum_loss / n_ex, "train_accuracy",
            (double)n_correct / n_ex, "examples_per_sec", eps, "staleness_mean", smean,
            "staleness_max", (json_int_t)stale_max, "dropped", (json_int_t)dropped,
            "pull_ms", 1e3 * t_pull / n_steps,
            "compute_ms", 1e3 * t_comp / n_steps, "push_ms", 1e3 * t_push / n_steps);
        ps_metrics_write(w->metrics, rec);
        json_decref(rec);
      }
      last_log = now;
      sum_loss = t_pull = t_push = t_comp = 0;
      n_ex = n_correct = n_steps = 0;
      stale_sum = stale_n = stale_max = dropped = 0;
    }
    if (w->chief && w->eval_interval > 0 && now - last_eval >= w->eval_interval &&
        step + 1 < total) {
      float tl;
      if (overlap) { /* the buffer the comm thread is not writing */
        w->params = pbuf[1 - cur];
        w->versions = vbuf[1 - cur];
      }
      double acc = evaluate(w, step + 1, t0, &tl);
      PS_INFO("step %" PRId64 ": test accuracy %.4f, test loss %.4f (%d examples)", step + 1, acc,
              (double)tl, w->test.n);
      last_eval = ps_now_s();
    }
  }
  if (overlap) {
    if (job_pending) {
      comm_wait(&comm);
      comm_job *pj = &jobs[(step - 1) & 1];
      if (pj->rc != 0 && rc == 0) {
        PS_ERROR("%s", pj->err);
        rc = 1;
      }
      if (pj->lease_reported) {
        if (pj->lease_counted) chunks_done++;
        else chunks_lost++;
      }
    }
    comm_stop(&comm);
    /* Back to the first buffers (freed by main); the others go now. */
    w->params = pbuf[0];
    w->grads = gbuf[0];
    w->versions = vbuf[0];
    if (w->ops->host_memory) {
      w->dparams = w->params;
      w->dgrads = w->grads;
    }
    host_buffer_free(w, pbuf[1]);
    host_buffer_free(w, gbuf[1]);
    free(vbuf[1]);
  }
  free(tickets);
  double elapsed = ps_now_s() - t0;
  if (pipelined && all_pushes)
    PS_INFO("pipeline: %" PRIu64 " of %" PRIu64 " shard pushes started while the backward pass "
            "was still running", early_pushes, all_pushes);
  if (rc == 0) {
    if (leased)
      PS_INFO("leases: %" PRIu64 " chunk(s) done and counted, %" PRIu64 " not counted", chunks_done,
              chunks_lost);
    printf("trained %" PRId64 " steps, %" PRId64 " examples in %.1f s: %.0f examples/s\n", step,
           total_ex, elapsed, total_ex / (elapsed > 0 ? elapsed : 1e-9));
    if (w->chief || w->save_path) {
      if (!w->local && with_retry(w, "Pull", op_pull, err) != 0) {
        PS_ERROR("final pull: %s", err);
        return 1;
      }
    }
    if (w->save_path && save_params(w, w->save_path) != 0) return 1;
    if (w->chief) {
      float tl;
      double acc = evaluate(w, step, t0, &tl);
      printf("final test accuracy %.4f (test loss %.4f, %d examples)\n", acc, (double)tl,
             w->test.n);
    }
    fflush(stdout);
  }
  return rc;
}

/* The evaluator role (TensorFlow's `evaluator` task): pulls the current
 * parameters every eval interval and evaluates the test split; pushes
 * nothing and is not counted among the training workers. Stops on a
 * signal, after --max-evals, or once the parameters have stopped changing
 * for --idle-evals evaluations after they started to (training is over). */
static int evaluate_loop(worker *w) {
  char err[PS_ERRLEN];
  double t0 = ps_now_s();
  double interval = w->eval_interval > 0 ? w->eval_interval : 10.0;
  uint64_t last = UINT64_MAX;
  int idle = 0, n = 0, moved = 0;
  double acc = 0;
  float tl = 0;
  PS_INFO("evaluator: every %.1f s on %d test examples", interval, w->test.n);
  while (!atomic_load(&w->stop)) {
    if (with_retry(w, "Pull", op_pull, err) != 0) {
      PS_ERROR("%s", err);
      return 1;
    }
    uint64_t v = 0;
    for (int s = 0; s < ps_client_num_shards(w->client); s++) v += w->versions[s];
    acc = evaluate(w, (int64_t)n, t0, &tl);
    n++;
    PS_INFO("evaluation %d: shard versions sum to %" PRIu64 ": test accuracy %.4f, test loss %.4f",
            n, v, acc, (double)tl);
    if (last != UINT64_MAX && v == last) {
      idle++;
    } else {
      moved |= last != UINT64_MAX;
      idle = 0;
    }
    last = v;
    if (w->max_evals > 0 && n >= w->max_evals) break;
    if (moved && idle >= w->idle_evals) {
      PS_INFO("evaluator: no update in %d evaluations: training is over", idle);
      break;
    }
    for (double waited = 0; waited < interval && !atomic_load(&w->stop); waited += 0.1)
      ps_sleep_ms(100);
  }
  printf("final test accuracy %.4f (test loss %.4f, %d examples, evaluation %d)\n", acc,
         (double)tl, w->test.n, n);
  fflush(stdout);
  return 0;
}

/* ---------------- set-up ---------------- */

static void usage(FILE *f) {
  fprintf(f,
          "Usage: ps-worker --ps HOST:PORT[,...] [options]\n"
          "       ps-worker (with TF_CONFIG set, task type worker or chief) [options]\n"
          "       ps-worker --local --job FILE [options]\n"
          "\n"
          "Trains the job served by the ps-server processes: pulls the parameters,\n"
          "computes gradients on this worker's share of the data, pushes them.\n"
          "\n"
          "  --ps LIST            a server address (the first of the list is contacted;\n"
          "                       the job and all shard addresses come from shard 0)\n"
          "  --index N            this worker's task index: its share of the data is\n"
          "                       every example i with i %% num_workers == N\n"
          "                       (default: the order in which it registered)\n"
          "  --num-workers N      how many workers share the data (default: from\n"
          "                       TF_CONFIG's worker and chief lists, else 1)\n"
          "  --chief              evaluate the test split (default: TF_CONFIG type chief,\n"
          "                       or index 0 without TF_CONFIG)\n"
          "  --evaluator          evaluate only: pull the parameters every eval interval and\n"
          "                       evaluate the test split, push nothing (TF_CONFIG task\n"
          "                       type evaluator does the same)\n"
          "  --max-evals N        evaluator: stop after N evaluations (default: no limit)\n"
          "  --idle-evals K       evaluator: stop once the parameters did not change for K\n"
          "                       evaluations after they started to (default 3)\n"
          "  --local              train in this process, no servers (needs --job)\n"
          "  --job FILE           job file, for --local\n"
          "  --epochs N           passes over this worker's share (default: the job's)\n"
          "  --max-steps N        stop after N steps (default: the job's, 0 = no limit)\n"
          "  --data-dir DIR       where the IDX files are (default: the job's)\n"
          "  --device D           cpu, cuda or cuda:N (default: cuda when this build has the\n"
          "                       CUDA backend and a GPU is present, else cpu); emu: the cpu\n"
          "                       ops on emulated device memory, which runs a GPU worker's\n"
          "                       code paths (copies, pipeline, replicas) where there is no\n"
          "                       GPU, for checking; slower than cpu\n"
          "  --threads N          compute threads (default: the number of cores)\n"
          "  --replicas R         R mirrored replicas of the model, one per thread on the\n"
          "                       cpu, one per GPU on cuda (replica i on GPU i %% count):\n"
          "                       the batch is split across them and their gradients\n"
          "                       summed (NCCL across GPUs) before one push per shard\n"
          "                       (default 1)\n"
          "  --per-replica-batch N  batch per replica; the global batch is N*R (default:\n"
          "                       the job's batch_size is the global batch)\n"
          "  --eval-interval SEC  seconds between evaluations by the chief (default: the\n"
          "                       job's eval_interval_s; 0 = only at the end)\n"
          "  --log-interval SEC   seconds between progress lines (default 5)\n"
          "  --metrics FILE       append JSON Lines records (loss, examples/s, staleness,\n"
          "                       test accuracy)\n"
          "  --timeout-ms MS      deadline of each call to a server (default 30000)\n"
          "  --retry-s SEC        how long to retry unreachable servers (default 60)\n"
          "  --host NAME          name reported to the servers (default: hostname)\n"
          "  --save-params FILE   at the end, write the parameters there (raw float32)\n"
          "  --overlap            async/ssp: push and pull on a second thread while the next\n"
          "                       step computes (hides the servers' time; gradients are one\n"
          "                       version staler)\n"
          "  --pipeline MODE      on, off or auto: overlap one step's pull, compute and push\n"
          "                       shard by shard: the first layers compute while later\n"
          "                       shards arrive, and a shard's gradient goes out while\n"
          "                       earlier layers compute (default auto: on for a GPU, off\n"
          "                       on the cpu; the same results either way)\n"
          "  --straggle-ms N      sleep N ms in every step: an artificial straggler, for\n"
          "                       comparing consistency modes\n"
          "  --log-level LEVEL    debug, info, warn or error (default info)\n"
          "  --help               this text\n");
}

static int parse_int(const char *flag, const char *s, long lo, long hi, long *out) {
  char *end = NULL;
  long v = strtol(s, &end, 10);
  if (!*s || *end || v < lo || v > hi) {
    fprintf(stderr, "ps-worker: %s wants an integer in [%ld, %ld], not '%s'\n", flag, lo, hi, s);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_secs(const char *flag, const char *s, double *out) {
  char *end = NULL;
  double v = strtod(s, &end);
  if (!*s || *end || !(v >= 0) || !isfinite(v)) {
    fprintf(stderr, "ps-worker: %s wants seconds >= 0, not '%s'\n", flag, s);
    return -1;
  }
  *out = v;
  return 0;
}

int main(int argc, char **argv) {
  static worker w;
  w.index = -1;
  w.num_workers = 0;
  w.chief = -1;
  w.epochs = -1;
  w.max_steps = -1;
  w.log_interval = 5.0;
  w.eval_interval = -1;
  w.timeout_ms = 30000;
  w.retry_s = 60;
  w.idle_evals = 3;
  w.pipeline = -1; /* auto */
  w.threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (w.threads < 1) w.threads = 1;
  int level = PS_LOG_INFO;
  static const struct option opts[] = {
      {"ps", required_argument, 0, 'p'},          {"index", required_argument, 0, 'i'},
      {"num-workers", required_argument, 0, 'n'}, {"chief", no_argument, 0, 'c'},
      {"local", no_argument, 0, 'L'},             {"job", required_argument, 0, 'j'},
      {"epochs", required_argument, 0, 'e'},      {"max-steps", required_argument, 0, 's'},
      {"data-dir", required_argument, 0, 'd'},    {"threads", required_argument, 0, 't'},
      {"eval-interval", required_argument, 0, 'E'}, {"log-interval", required_argument, 0, 'l'},
      {"metrics", required_argument, 0, 'm'},     {"timeout-ms", required_argument, 0, 'T'},
      {"retry-s", required_argument, 0, 'r'},     {"host", required_argument, 0, 'H'},
      {"straggle-ms", required_argument, 0, 'S'}, {"save-params", required_argument, 0, 'P'},
      {"device", required_argument, 0, 'D'},      {"replicas", required_argument, 0, 'R'},
      {"evaluator", no_argument, 0, 'V'},         {"overlap", no_argument, 0, 'O'},         {"max-evals", required_argument, 0, 'X'},
      {"idle-evals", required_argument, 0, 'I'},  {"pipeline", required_argument, 0, 'Q'},
      {"per-replica-batch", required_argument, 0, 'B'},
      {"log-level", required_argument, 0, 'v'},   {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  int c;
  long v;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 'p': w.ps_addr = optarg; break;
      case 'i': if (parse_int("--index", optarg, 0, 100000, &v)) return 2; w.index = (int)v; break;
      case 'n':
        if (parse_int("--num-workers", optarg, 1, 100000, &v)) return 2;
        w.num_workers = (int)v;
        break;
      case 'c': w.chief = 1; break;
      case 'L': w.local = 1; break;
      case 'j': w.job_path = optarg; break;
      case 'e': if (parse_int("--epochs", optarg, 1, 1000000, &v)) return 2; w.epochs = (int)v; break;
      case 's': if (parse_int("--max-steps", optarg, 0, 1L << 40, &v)) return 2; w.max_steps = v; break;
      case 'd': w.data_dir = optarg; break;
      case 't': if (parse_int("--threads", optarg, 0, 256, &v)) return 2; w.threads = (int)v; break;
      case 'E': if (parse_secs("--eval-interval", optarg, &w.eval_interval)) return 2; break;
      case 'l':
        if (parse_secs("--log-interval", optarg, &w.log_interval)) return 2;
        break;
      case 'm': w.metrics_path = optarg; break;
      case 'T':
        if (parse_int("--timeout-ms", optarg, 1, 3600000, &v)) return 2;
        w.timeout_ms = (int)v;
        break;
      case 'r': if (parse_secs("--retry-s", optarg, &w.retry_s)) return 2; break;
      case 'H': w.host = optarg; break;
      case 'P': w.save_path = optarg; break;
      case 'D': w.device = optarg; break;
      case 'V': w.evaluator = 1; break;
      case 'O': w.overlap = 1; break;
      case 'Q':
        if (strcmp(optarg, "on") != 0 && strcmp(optarg, "off") != 0 && strcmp(optarg, "auto") != 0) {
          fprintf(stderr, "ps-worker: --pipeline wants on, off or auto, not '%s'\n", optarg);
          return 2;
        }
        w.pipeline = strcmp(optarg, "auto") == 0 ? -1 : strcmp(optarg, "on") == 0;
        break;
      case 'X': if (parse_int("--max-evals", optarg, 1, 1L << 30, &v)) return 2; w.max_evals = (int)v; break;
      case 'I': if (parse_int("--idle-evals", optarg, 1, 1L << 30, &v)) return 2; w.idle_evals = (int)v; break;
      case 'R': if (parse_int("--replicas", optarg, 1, 256, &v)) return 2; w.replicas = (int)v; break;
      case 'B':
        if (parse_int("--per-replica-batch", optarg, 1, 65536, &v)) return 2;
        w.per_replica_batch = (int)v;
        break;
      case 'S':
        if (parse_int("--straggle-ms", optarg, 0, 3600000, &v)) return 2;
        w.straggle_ms = (int)v;
        break;
      case 'v':
        level = ps_log_level_parse(optarg);
        if (level < 0) {
          fprintf(stderr, "ps-worker: --log-level wants debug, info, warn or error\n");
          return 2;
        }
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "ps-worker: unexpected argument '%s' (see --help)\n", argv[optind]);
    return 2;
  }

  char err[PS_ERRLEN];
  static ps_cluster cluster;
  int have_tf = 0;
  if (!w.local && !w.ps_addr) {
    const char *tf = getenv("TF_CONFIG");
    if (!tf) {
      fprintf(stderr, "ps-worker: give --ps HOST:PORT, set TF_CONFIG, or use --local --job FILE "
                      "(see --help)\n");
      return 2;
    }
    if (ps_cluster_from_tf_config(tf, &cluster, err) != 0) {
      fprintf(stderr, "ps-worker: TF_CONFIG: %s\n", err);
      return 2;
    }
    if (!strcmp(cluster.task_type, "evaluator")) {
      w.evaluator = 1;
    } else if (strcmp(cluster.task_type, "worker") != 0 &&
               strcmp(cluster.task_type, "chief") != 0) {
      fprintf(stderr, "ps-worker: TF_CONFIG names task type '%s'; ps-worker runs 'worker', "
                      "'chief' or 'evaluator'\n", cluster.task_type);
      return 2;
    }
    if (cluster.n_ps == 0) {
      fprintf(stderr, "ps-worker: TF_CONFIG has no ps addresses\n");
      return 2;
    }
    have_tf = 1;
    w.ps_addr = cluster.ps[0];
    /* The chief counts as task 0 and the workers follow it, as in TF. */
    int is_chief = !strcmp(cluster.task_type, "chief");
    if (w.index < 0) w.index = is_chief ? 0 : cluster.task_index + cluster.n_chief;
    if (w.num_workers == 0) w.num_workers = cluster.n_workers + cluster.n_chief;
    if (w.chief < 0) w.chief = is_chief || (cluster.n_chief == 0 && cluster.task_index == 0);
  }
  if (w.evaluator) {
    w.chief = 1; /* loads the test split and evaluates */
    if (w.index < 0) w.index = 0;
  }
  if (w.local && !w.job_path) {
    fprintf(stderr, "ps-worker: --local needs --job FILE\n");
    return 2;
  }
  if (w.ps_addr) {
    /* Only the first address of a list is needed. */
    static char first[PS_ADDR_LEN];
    snprintf(first, sizeof first, "%s", w.ps_addr);
    char *comma = strchr(first, ',');
    if (comma) *comma = '\0';
    char host[PS_ADDR_LEN];
    int port;
    if (ps_parse_hostport(first, host, sizeof host, &port) != 0 || port == 0) {
      fprintf(stderr, "ps-worker: '%s' is not a server address HOST:PORT\n", first);
      return 2;
    }
    w.ps_addr = first;
  }
  char hostname[64] = "localhost";
  gethostname(hostname, sizeof hostname - 1);
  if (!w.host) w.host = hostname;
  ps_log_init("ps-worker", level);

  /* The device first: the first log line says where this worker computes. */
  char device_desc[256];
  w.ops = ps_device_open(w.device, w.threads, device_desc, sizeof device_desc, err);
  if (!w.ops) {
    fprintf(stderr, "ps-worker: --device %s: %s\n", w.device ? w.device : "auto", err);
    return 2;
  }
  PS_INFO("device: %s", device_desc);

  char *job_text = NULL;
  rpc_global_init();
  if (w.local) {
    if (ps_job_load(w.job_path, &w.job, &job_text, err) != 0) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return 2;
    }
    w.rank = w.index >= 0 ? w.index : 0;
    if (w.chief < 0) w.chief = 1;
  } else {
    ps_client_opts co = {.host = w.host,
                         .role = w.evaluator ? "evaluator" : w.chief == 1 ? "chief" : "worker",
                         .task_index = w.index,
                         .timeout_ms = w.timeout_ms,
                         .connect_timeout_ms = (int)(w.retry_s * 1000)};
    w.client = ps_client_connect(w.ps_addr, &co, err);
    if (!w.client) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return 1;
    }
    if (ps_job_parse(ps_client_job_json(w.client), &w.job, err) != 0) {
      fprintf(stderr, "ps-worker: the job from %s does not parse: %s\n", w.ps_addr, err);
      return 1;
    }
    if (ps_client_param_count(w.client) != w.job.model.n_params) {
      fprintf(stderr, "ps-worker: the servers hold %zu values, the job's model has %zu\n",
              ps_client_param_count(w.client), w.job.model.n_params);
      return 1;
    }
    w.rank = w.index >= 0 ? w.index : ps_client_rank(w.client);
    if (w.job.mode_kind != PS_MODE_ASYNC) ps_client_set_wait_ms(w.client, w.job.wait_timeout_ms);
    if (w.chief < 0) w.chief = !have_tf && w.rank == 0;
    PS_INFO("registered as worker %016" PRIx64 " (rank %d) with %d shards of job '%s', mode %s",
            ps_client_worker_id(w.client), w.rank, ps_client_num_shards(w.client), w.job.job_id,
            w.job.mode);
  }
  if (w.num_workers == 0) w.num_workers = 1;
  /* With data leases the share of the data is decided by shard 0. */
  if (w.rank >= w.num_workers && !(w.client && w.job.lease_chunk > 0) && !w.evaluator) {
    fprintf(stderr, "ps-worker: index %d but only %d workers share the data (--num-workers)\n",
            w.rank, w.num_workers);
    return 2;
  }
  if (w.replicas < 1) w.replicas = 1;
  if (w.per_replica_batch > 0) {
    int global = w.per_replica_batch * w.replicas;
    PS_INFO("batch: %d per replica x %d replica(s) = global batch %d (the job says %d)",
            w.per_replica_batch, w.replicas, global, w.job.batch_size);
    w.job.batch_size = global;
  } else if (w.replicas > 1) {
    PS_INFO("batch: global batch %d split over %d replicas (about %d each)", w.job.batch_size,
            w.replicas, (w.job.batch_size + w.replicas - 1) / w.replicas);
  }
  if (w.epochs < 0) w.epochs = w.job.epochs;
  if (w.max_steps < 0) w.max_steps = w.job.max_steps;
  if (w.eval_interval < 0) w.eval_interval = w.job.eval_interval_s;

  /* Data */
  const ps_model_spec *spec = &w.job.model;
  double tl = ps_now_s();
  int rc;
  if (!strcmp(w.job.dataset, "synthetic")) {
    rc = ps_dataset_synthetic(w.job.synthetic_train, spec->in_c, spec->in_h, spec->in_w,
                              spec->classes, w.job.seed, 0, &w.train);
    if (rc == 0)
      rc = ps_dataset_synthetic(w.job.synthetic_test, spec->in_c, spec->in_h, spec->in_w,
                                spec->classes, w.job.seed, 1, &w.test);
    if (rc != 0) snprintf(err, sizeof err, "cannot make the synthetic data set");
  } else {
    const char *dir = w.data_dir ? w.data_dir : w.job.data_dir;
    rc = ps_dataset_load_named(w.job.dataset, dir, 1, &w.train, err);
    if (rc == 0 && w.chief) rc = ps_dataset_load_named(w.job.dataset, dir, 0, &w.test, err);
  }
  if (rc != 0) {
    fprintf(stderr, "ps-worker: %s\n", err);
    return 1;
  }
  if (w.train.c != spec->in_c || w.train.h != spec->in_h || w.train.w != spec->in_w ||
      w.train.classes != spec->classes) {
    fprintf(stderr, "ps-worker: the data set has examples %dx%dx%d in %d classes; the model wants "
                    "%dx%dx%d in %d\n",
            w.train.c, w.train.h, w.train.w, w.train.classes, spec->in_c, spec->in_h, spec->in_w,
            spec->classes);
    return 1;
  }
  PS_INFO("data: %s, %d train / %d test examples (%.1f s to load)", w.job.dataset, w.train.n,
          w.test.n, ps_now_s() - tl);

  /* Compute */

  w.model = ps_model_create(spec, w.ops, w.job.batch_size, err);
  if (w.replicas > 1) {
    w.reps = ps_replicas_create_for(spec, w.replicas, w.job.batch_size, w.ops->name, err);
    if (w.reps)
      PS_INFO("replicas: %d, %s", w.replicas,
              !ps_replicas_on_device(w.reps) ? "one per cpu thread, summed in host memory"
              : ps_replicas_nccl(w.reps)     ? "one per GPU, summed on the GPUs with NCCL"
                                             : "on devices, summed in host memory");
    if (!w.reps) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return 1;
    }
  }
  w.eval_model = w.chief ? ps_model_create(spec, w.ops, 500, err) : NULL;
  const size_t P = spec->n_params;
  w.params = host_buffer(&w, P * sizeof(float));
  w.grads = host_buffer(&w, P * sizeof(float));
  w.versions = calloc(w.client ? (size_t)ps_client_num_shards(w.client) : 1, sizeof(uint64_t));
  w.min_versions = calloc(w.client ? (size_t)ps_client_num_shards(w.client) : 1, sizeof(uint64_t));
  w.dparams = w.params;
  w.dgrads = w.grads;
  if (w.model && !w.ops->host_memory) {
    w.dparams = ps_model_alloc_params(w.model);
    w.dgrads = ps_model_alloc_params(w.model);
  }
  if (!w.model || (w.chief && !w.eval_model) || !w.params || !w.grads || !w.versions ||
      !w.min_versions || !w.dparams || !w.dgrads) {
    fprintf(stderr, "ps-worker: %s\n", err[0] ? err : "out of memory");
    return 1;
  }
  char desc[512];
  ps_model_spec_describe(spec, desc, sizeof desc);
  PS_INFO("model: %s; device %s%s", desc, device_desc,
          w.chief ? "; chief: evaluates the test split" : "");
  if (w.local) {
    w.opt = ps_optimizer_find(w.job.optim.name);
    w.slots = calloc((size_t)(w.opt->n_slots + 1), sizeof(float *));
    for (int k = 0; k < w.opt->n_slots; k++) {
      w.slots[k] = ps_alloc(P * sizeof(float));
      if (!w.slots[k]) {
        fprintf(stderr, "ps-worker: out of memory\n");
        return 1;
      }
      float init = w.opt->slot_init(&w.job.optim, k);
      for (size_t i = 0; i < P; i++) w.slots[k][i] = init;
    }
    ps_model_init_params(spec, w.job.seed, 0, P, w.params);
    PS_INFO("local mode: no servers; optimizer %s lr %g in this process", w.job.optim.name,
            (double)w.job.optim.lr);
  }
  if (w.metrics_path) {
    w.metrics = ps_metrics_open(w.metrics_path, err);
    if (!w.metrics) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return 2;
    }
  }
  if (w.evaluator && w.local) {
    fprintf(stderr, "ps-worker: --evaluator evaluates what servers hold; it needs --ps, not "
                    "--local\n");
    return 2;
  }
  if (w.evaluator)
    w.batcher = NULL; /* trains nothing */
  else if (w.client && w.job.lease_chunk > 0)
    w.batcher = ps_batcher_create_source(&w.train, w.job.batch_size, w.job.seed, 4, lease_source,
                                         &w);
  else
    w.batcher = ps_batcher_create_ordered(&w.train, w.job.batch_size, w.rank, w.num_workers,
                                          w.job.seed, 4, w.job.shuffle);
  if (!w.batcher && !w.evaluator) {
    fprintf(stderr, "ps-worker: cannot start the input pipeline\n");
    return 1;
  }
  if (start_loop(&w) != 0) {
    fprintf(stderr, "ps-worker: cannot start the event loop thread\n");
    return 1;
  }

  int result = w.evaluator ? evaluate_loop(&w) : train(&w);

  stop_loop(&w);
  if (w.client) {
    ps_client_leave(w.client);
    ps_client_destroy(w.client);
  }
  ps_batcher_destroy(w.batcher);
  ps_replicas_destroy(w.reps);
  if (w.model && w.dparams != w.params) ps_model_free_params(w.model, w.dparams);
  if (w.model && w.dgrads != w.grads) ps_model_free_params(w.model, w.dgrads);
  ps_model_destroy(w.model);
  ps_model_destroy(w.eval_model);
  host_buffer_free(&w, w.params); /* before the backend they may belong to */
  host_buffer_free(&w, w.grads);
  if (w.ops) w.ops->destroy(w.ops);
  if (w.slots) {
    for (int k = 0; k < w.opt->n_slots; k++) ps_free(w.slots[k]);
    free(w.slots);
  }
  free(w.versions);
  free(w.min_versions);
  ps_dataset_free(&w.train);
  ps_dataset_free(&w.test);
  ps_metrics_close(w.metrics);
  free(job_text);
  rpc_global_shutdown();
  return result;
}

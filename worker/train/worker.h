/* One ps-worker process: the context every part of the worker reads
 * (ps_worker, its parts built by ps_worker_setup in worker/main/setup.c),
 * and what worker/train offers: the training loop and the evaluation
 * (train.c, evaluate.c), the embedding rows (emb_rows.c), the Prometheus
 * endpoint (worker_prom.c), and the helpers the step kinds share
 * (worker.c: retries, pull, the end of a push, host buffers).
 *
 * Layers: worker/main (the process) calls down into worker/train, which
 * calls down into worker/client, worker/model and worker/data (peers that
 * do not call each other), which call kernels/ and common/. Nothing here
 * calls worker/main: what the process does is declared in
 * worker/main/setup.h and worker/main/loop.h.
 *
 * Threads: the training thread runs the loop (train.c) and the steps
 * (step_*.c); the loop thread (worker/main/loop.c) owns the heartbeat
 * timer and the signals; the input pipeline fills batches on a third
 * (source.c); the overlapped step has a communication thread of its own. */
#ifndef PS_WORKER_WORKER_H
#define PS_WORKER_WORKER_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "common/job.h"
#include "common/metrics.h"
#include "common/tbevents.h"
#include "kernels/ops.h"
#include "worker/data/data.h"
#include "worker/model/model.h"
#include "worker/client/ps_client.h"
#include "worker/model/replicas.h"
#include "worker/train/source.h"
#include "worker/main/worker_options.h"

/* The process's exit codes, for whoever runs it (a supervisor restarts on
 * 1 and 3, not on 2: see deploy/systemd/). --help's footer and the README
 * list them. */
enum {
  PS_WORKER_EXIT_DONE = 0,        /* the data or the steps are done, the evaluator saw training
                                   * end, or SIGINT/SIGTERM: left the servers */
  PS_WORKER_EXIT_ERROR = 1,       /* an error in the job or the data, a request a server
                                   * refused, or no memory */
  PS_WORKER_EXIT_USAGE = 2,       /* a bad command line: a flag, TF_CONFIG, or a file or
                                   * device a flag names */
  PS_WORKER_EXIT_UNREACHABLE = 3, /* the servers did not answer for --retry-s seconds:
                                   * starting again later may succeed */
};

/* Examples per forward pass of the chief's evaluation (its model's batch;
 * an embedding model's test rows are pulled this many examples at a time). */
#define PS_EVAL_BATCH 500

/* Seconds without a finished step before the worker says what it waits for. */
#define PS_WORKER_STALL_S 30

typedef struct ps_worker_rows ps_worker_rows;

typedef struct ps_worker {
  ps_worker_opts o; /* resolved: epochs, max_steps, eval_interval from the job */
  ps_job job;       /* batch_size is the global batch */
  char *job_text;
  int rank;         /* this worker's index in the data (and in metrics) */
  ps_security sec;   /* TLS and the token (not with --local) */
  ps_client *client; /* NULL with --local */
  int nshards;       /* 0 with --local */
  ps_ops *ops;
  char device_desc[256];
  /* The last compute's phases on the backend's clock (ops->mark), ms:
   * parameters and batch in, forward, backward, gradients out; valid when
   * phase_ok (a backend that keeps marks, one model, no replicas). */
  double phase_ms[4];
  int phase_ok;
  int64_t straggled_ms; /* --straggle: the delays slept so far */
  ps_precision precision; /* --precision (ps_ops.set_precision) */
  ps_model *model, *eval_model; /* eval_model: the chief's, for the test split */
  /* Embedding models: the rows of the training steps and of the
   * evaluations (NULL without embedding layers). */
  ps_worker_rows *rows, *eval_rows;
  double eval_auc, eval_acc; /* the last evaluation's (AUC: binary models) */
  char eval_err[PS_ERRLEN];  /* why the last evaluation failed ("" when it did not) */
  ps_replicas *reps;            /* NULL with one replica */
  ps_dataset train, test;
  int train_share; /* train holds this worker's static share only (rank of num_workers) */
  ps_source *source;            /* NULL for the evaluator */
  ps_metrics *metrics;
  ps_tb *tb;                    /* --tensorboard: the chief's and the evaluator's */
  struct ps_worker_mon *mon;    /* --metrics-port (worker_prom.c) */
  /* What is pulled and pushed: host buffers (pinned on a GPU), and the
   * backend's copies (the same buffers when the backend computes in host
   * memory). The overlapped step swaps them between its two sets. */
  float *params, *grads;
  float *dparams, *dgrads;
  uint64_t *versions;     /* per shard: the version pulled */
  uint64_t *min_versions; /* per shard: sync mode waits for the step pushed */
  /* sync with a known number of steps: the shards' version at which the
   * job's steps are all applied (the run's start version plus the steps
   * of this worker's share); 0: none. A worker whose gradients were
   * dropped as late stops there too, rather than making the steps it
   * missed alone once the others have finished. */
  uint64_t sync_end_version;
  ps_push_result push_res; /* the last push's answers */
  /* The first give-up on servers that did not answer for --retry-s (any
   * thread sets it once; read after the threads are joined): the process
   * exits PS_WORKER_EXIT_UNREACHABLE with this as its last line. */
  atomic_int gave_up;
  char gave_up_msg[2 * PS_ERRLEN];
  /* A signal stopped ps_worker_retry while the servers did not answer:
   * the step that failed so is not an error. */
  atomic_int retry_stopped;
  /* shared with the loop thread */
  atomic_int stop;
  atomic_uint_fast64_t step;
  struct {
    uv_loop_t loop;
    uv_thread_t thread;
    uv_timer_t hb_timer;
    uv_timer_t idle_timer; /* watches for the worker starting or stopping to wait for data */
    atomic_int idle_said;  /* what the last heartbeat said */
    uv_timer_t stall_timer; /* says when no step finishes for PS_WORKER_STALL_S */
    uint64_t stall_step;
    int64_t stall_since;
    uv_signal_t sigint, sigterm;
    uv_async_t quit;
    uv_work_t hb_work;
    int hb_busy, running;
    /* The input pipeline, once built: the loop starts as soon as the
     * worker registers (heartbeats cover loading the data and building
     * the model), before the source exists. */
    _Atomic(ps_source *) source;
  } ev;
} ps_worker;

/* ---------------- train.c, evaluate.c ---------------- */

/* Training: steps until the data or max_steps is done or a signal came;
 * then the final pull, --save-params and the chief's final evaluation.
 * Returns the exit code. */
int ps_worker_train(ps_worker *w);

/* The evaluator role: evaluates what the servers hold every eval interval
 * until training is over. Returns the exit code. */
int ps_worker_evaluator_run(ps_worker *w);

/* Evaluates w->params on the test split; writes a metrics record. Returns
 * the accuracy; *loss_out (may be NULL) the mean loss. */
double ps_worker_evaluate(ps_worker *w, int64_t step, double t0, float *loss_out);

/* ---------------- emb_rows.c ---------------- */

/* The rows of model m's embedding layers for batches of up to max_batch
 * examples (with grads: and buffers for their gradients). NULL when the
 * model has no embedding layer (err empty) or, with a message, when out
 * of memory. */
ps_worker_rows *ps_worker_rows_create(ps_worker *w, ps_model *m, int max_batch, int grads,
                                      char *err);
void ps_worker_rows_destroy(ps_worker *w, ps_worker_rows *r);
/* For a batch's ids (n examples): each layer's plan (ids modulo a bounded
 * table's rows), the client's rows for the next pull and push, and the
 * model's rows. 0, or a code with a message. */
int ps_worker_rows_prepare(ps_worker *w, ps_worker_rows *r, const uint64_t *ids, int n,
                           char *err);

/* The name of what ps_worker_evaluate returns: "AUC" for a binary model,
 * else "accuracy". */
const char *ps_worker_metric(const ps_worker *w);

/* ---------------- worker_prom.c ---------------- */

/* Starts the Prometheus endpoint when --metrics-port is given (logs
 * where). 0, or the process's exit code with the message printed (a
 * token file that cannot be read, an address that cannot be bound). */
int ps_worker_prom_start(ps_worker *w);
/* Records an evaluation's test accuracy and loss. */
void ps_worker_prom_eval(ps_worker *w, double accuracy, double loss);
void ps_worker_prom_stop(ps_worker *w);

/* ---------------- worker.c: the helpers the steps share ---------------- */

/* --tensorboard (w->tb set): one Event at step of n scalars. The first
 * write that fails is logged as a warning; the later ones write nothing. */
void ps_worker_tb_write(ps_worker *w, int64_t step, int n, const char *const *tags,
                        const float *values);

/* Records that the servers did not answer for waited_s seconds (err says
 * which): the exit code (ps_worker_exit_code, worker/main/setup.h) becomes
 * PS_WORKER_EXIT_UNREACHABLE. The first record counts; any thread. */
void ps_worker_note_gave_up(ps_worker *w, double waited_s, const char *err);

/* Retries op(ctx, err) with exponential backoff and jitter while the
 * servers are unreachable (or a shard gave up holding a pull back), for
 * --retry-s seconds (the last attempt at the deadline; then w->gave_up is
 * set), and not after a signal (then w->retry_stopped is). Returns op's
 * last code. Any thread. */
typedef int (*ps_worker_op)(void *ctx, char *err);
int ps_worker_retry(ps_worker *w, const char *what, ps_worker_op op, void *ctx, char *err);

/* What a failure with err (of a step, or a pull) ends in: the exit code
 * PS_WORKER_EXIT_DONE when a signal stopped a retry in it (err logged as a
 * warning: the worker stops as after any signal), else
 * PS_WORKER_EXIT_ERROR (err logged as an error). For failures seen before
 * anything but a signal can set w->stop: before the step kind's end. */
int ps_worker_failure(ps_worker *w, const char *err);

/* Pulls every shard into w->params and w->versions, retrying; in sync
 * mode each shard answers once the step this worker pushed is applied. */
int ps_worker_pull(ps_worker *w, char *err);

/* sync: the pull just made shows every shard at w->sync_end_version or
 * past it (the job's steps are applied): the step stops there, with
 * nothing computed or pushed. */
int ps_worker_sync_steps_done(const ps_worker *w);

/* Ends the push round started with ps_client_push_begin (from w->grads),
 * retrying only the shards that have not applied it; the answers go to
 * w->push_res and the next sync pull waits for the step pushed. */
int ps_worker_push_end(ps_worker *w, char *err);

/* Host memory for what crosses to the servers: pinned when the backend is
 * a GPU (fast, asynchronous copies), plain aligned memory otherwise; NULL
 * when it cannot be had. */
float *ps_worker_host_buffer(ps_worker *w, size_t bytes);
void ps_worker_host_buffer_free(ps_worker *w, float *p);

#endif

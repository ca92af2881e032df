/* The helpers the step kinds, the training loop and the evaluation share
 * (see worker.h): TensorBoard scalars, the retry of calls the servers did
 * not answer and what a failure ends in, the pull and the end of a push,
 * and the host buffers of what crosses to the servers. They sit here, in
 * worker/train, because the steps call them; the process's set-up
 * (worker/main/setup.c) calls them too, downwards. */
#include "worker/train/worker.h"

#include <inttypes.h>
#include <stdio.h>
#include <unistd.h>

#include "common/rng.h"
#include "common/util.h"

void ps_worker_tb_write(ps_worker *w, int64_t step, int n, const char *const *tags,
                        const float *values) {
  char err[PS_ERRLEN];
  int rc = ps_tb_scalars(w->tb, step, n, tags, values, err);
  if (rc != 0 && rc != PS_ESTATE) PS_WARN("--tensorboard: %s; no more TensorBoard events", err);
}

/* Records the first give-up on servers that did not answer (see
 * ps_worker_exit_code); the later ones are the same outage. */
void ps_worker_note_gave_up(ps_worker *w, double waited_s, const char *err) {
  int expected = 0;
  if (!atomic_compare_exchange_strong(&w->gave_up, &expected, 1)) return;
  snprintf(w->gave_up_msg, sizeof w->gave_up_msg,
           "gave up after %.0f s without an answer (--retry-s %g): %s", waited_s, w->o.retry_s,
           err);
}

int ps_worker_retry(ps_worker *w, const char *what, ps_worker_op op, void *ctx, char *err) {
  /* Unreachable servers, and shards that gave up holding a pull back. */
  double start = ps_now_s(), deadline = start + w->o.retry_s;
  int64_t backoff = 100;
  ps_rand r;
  ps_rand_seed(&r, (uint64_t)getpid() ^ (uint64_t)ps_now_ms());
  int rc;
  for (;;) {
    rc = op(ctx, err);
    if (rc == 0 || (rc != PS_EUNAVAIL && rc != PS_ETIMEDOUT)) return rc;
    if (atomic_load(&w->stop)) break;
    double left_ms = (deadline - ps_now_s()) * 1000;
    if (left_ms <= 0) {
      ps_worker_note_gave_up(w, ps_now_s() - start, err);
      return rc;
    }
    /* The last attempt comes at the deadline, so that a server back just
     * before it is found. */
    int64_t sleep = backoff / 2 + (int64_t)ps_rand_below(&r, (uint64_t)backoff / 2 + 1);
    if (sleep > left_ms) sleep = (int64_t)left_ms + 1;
    PS_WARN("%s failed (%s); retrying in %" PRId64 " ms", what, err, sleep);
    /* In slices, so that a signal is heard within 100 ms. */
    for (int64_t slept = 0; slept < sleep && !atomic_load(&w->stop); slept += 100)
      ps_sleep_ms(sleep - slept < 100 ? sleep - slept : 100);
    if (atomic_load(&w->stop)) break;
    if (backoff < 5000) backoff *= 2;
  }
  atomic_store(&w->retry_stopped, 1);
  return rc;
}

int ps_worker_failure(ps_worker *w, const char *err) {
  if (atomic_load(&w->retry_stopped)) {
    PS_WARN("%s; stopped by a signal while retrying", err);
    return PS_WORKER_EXIT_DONE;
  }
  PS_ERROR("%s", err);
  return PS_WORKER_EXIT_ERROR;
}

static int op_pull(void *ctx, char *err) {
  ps_worker *w = ctx;
  return ps_client_pull(w->client, w->params, w->versions,
                        w->job.mode_kind == PS_MODE_SYNC ? w->min_versions : NULL, err);
}

int ps_worker_pull(ps_worker *w, char *err) { return ps_worker_retry(w, "Pull", op_pull, w, err); }

int ps_worker_sync_steps_done(const ps_worker *w) {
  if (w->sync_end_version == 0) return 0;
  for (int s = 0; s < w->nshards; s++)
    if (w->versions[s] < w->sync_end_version) return 0;
  return 1;
}

static int op_push(void *ctx, char *err) {
  ps_worker *w = ctx;
  int rc = ps_client_push_end(w->client, w->grads, &w->push_res, err);
  /* sync: the next pull waits for the step this gradient was for (or, if
   * it was dropped, for the step that went on without it: already done). */
  if (rc == 0)
    for (int s = 0; s < w->nshards; s++) w->min_versions[s] = w->versions[s] + 1;
  return rc;
}

int ps_worker_push_end(ps_worker *w, char *err) {
  return ps_worker_retry(w, "Push", op_push, w, err);
}

float *ps_worker_host_buffer(ps_worker *w, size_t bytes) {
  if (w->ops && w->ops->host_alloc) return w->ops->host_alloc(w->ops->ctx, bytes);
  return ps_alloc(bytes);
}

void ps_worker_host_buffer_free(ps_worker *w, float *p) {
  if (!p) return;
  if (w->ops && w->ops->host_free)
    w->ops->host_free(w->ops->ctx, p);
  else
    ps_free(p);
}

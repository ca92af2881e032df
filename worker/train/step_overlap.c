/* The overlapped step (--overlap, async and ssp): the push of step t's
 * gradient and the pull of fresh parameters run on a communication thread
 * while step t+1 computes.
 *
 * Two parameter buffers (one computed from, one being pulled into) and two
 * gradient buffers (one written, one being pushed). Step t computes from
 * the parameters pulled while step t-1 computed, so its gradient is one
 * version staler than without overlap. */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/train/step.h"

/* One round of communication, run on the comm thread while the training
 * thread computes the next step: push a gradient, report a finished lease,
 * pull fresh parameters into the buffer the last step computed from. */
typedef struct {
  ps_worker *w;
  /* in */
  const float *grads;
  const uint64_t *base_versions;
  uint64_t step;
  int batch;
  uint64_t lease;     /* the lease the batch was drawn from, or 0 */
  uint64_t lease_tag; /* a chunk finished with this push, or 0 */
  float *pull_into;
  uint64_t *pull_versions;
  /* out */
  int rc;
  char err[PS_ERRLEN];
  ps_push_result res;
} comm_job;

typedef struct {
  ps_worker *w;
  float *pbuf[2], *gbuf[2];
  uint64_t *vbuf[2];
  comm_job jobs[2];
  int cur;           /* the parity of the step that ran last */
  comm_job *pending; /* the job out on the comm thread, or NULL */
  /* the comm thread */
  uv_thread_t thread;
  uv_mutex_t mu;
  uv_cond_t cv;
  comm_job *job; /* the job to run, or NULL */
  int busy, quit, started;
} overlap_state;

static int comm_push(void *ctx, char *err) {
  comm_job *j = ctx;
  return ps_client_push_end(j->w->client, j->grads, &j->res, err);
}

static int comm_pull(void *ctx, char *err) {
  comm_job *j = ctx;
  return ps_client_pull(j->w->client, j->pull_into, j->pull_versions, NULL, err);
}

static void comm_run(comm_job *j) {
  ps_worker *w = j->w;
  j->err[0] = '\0';
  j->rc = ps_client_push_begin(w->client, j->base_versions, j->step, j->batch, j->lease);
  if (j->rc != 0) snprintf(j->err, sizeof j->err, "a push is still in flight");
  if (j->rc == 0) j->rc = ps_worker_retry(w, "Push", comm_push, j, j->err);
  if (j->rc == 0 && j->lease_tag) ps_source_chunk_done(w->source, j->lease_tag);
  if (j->rc == 0) j->rc = ps_worker_retry(w, "Pull", comm_pull, j, j->err);
}

static void comm_main(void *arg) {
  overlap_state *c = arg;
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

static void comm_start_job(overlap_state *c, comm_job *j) {
  uv_mutex_lock(&c->mu);
  c->job = j;
  c->busy = 1;
  uv_cond_broadcast(&c->cv);
  uv_mutex_unlock(&c->mu);
}

static void comm_wait(overlap_state *c) {
  uv_mutex_lock(&c->mu);
  while (c->busy) uv_cond_wait(&c->cv, &c->mu);
  uv_mutex_unlock(&c->mu);
}

static int comm_start(overlap_state *c) {
  if (uv_mutex_init(&c->mu) != 0) return -1;
  if (uv_cond_init(&c->cv) != 0) {
    uv_mutex_destroy(&c->mu);
    return -1;
  }
  if (uv_thread_create(&c->thread, comm_main, c) != 0) {
    uv_cond_destroy(&c->cv);
    uv_mutex_destroy(&c->mu);
    return -1;
  }
  c->started = 1;
  return 0;
}

static void comm_stop(overlap_state *c) {
  if (!c->started) return;
  comm_wait(c);
  uv_mutex_lock(&c->mu);
  c->quit = 1;
  uv_cond_broadcast(&c->cv);
  uv_mutex_unlock(&c->mu);
  uv_thread_join(&c->thread);
  uv_cond_destroy(&c->cv);
  uv_mutex_destroy(&c->mu);
  c->started = 0;
}

/* Points the worker at buffer set i. */
static void use_set(overlap_state *s, int i) {
  ps_worker *w = s->w;
  w->params = s->pbuf[i];
  w->grads = s->gbuf[i];
  w->versions = s->vbuf[i];
  if (w->ops->host_memory) {
    w->dparams = w->params;
    w->dgrads = w->grads;
  }
}

/* Stops the thread, puts the first buffers back (the worker's own),
 * frees the second set and the state. */
static void overlap_free(overlap_state *s) {
  comm_stop(s);
  use_set(s, 0);
  ps_worker_host_buffer_free(s->w, s->pbuf[1]);
  ps_worker_host_buffer_free(s->w, s->gbuf[1]);
  free(s->vbuf[1]);
  free(s);
}

static int overlap_begin(ps_worker *w, void **state, char *err) {
  const size_t P = w->job.model.n_params;
  overlap_state *s = calloc(1, sizeof *s);
  if (!s) return ps_seterr(err, -1, "out of memory");
  s->w = w;
  s->pbuf[0] = w->params;
  s->gbuf[0] = w->grads;
  s->vbuf[0] = w->versions;
  s->pbuf[1] = ps_worker_host_buffer(w, P * sizeof(float));
  s->gbuf[1] = ps_worker_host_buffer(w, P * sizeof(float));
  s->vbuf[1] = calloc((size_t)w->nshards, sizeof(uint64_t));
  if (!s->pbuf[1] || !s->gbuf[1] || !s->vbuf[1] || comm_start(s) != 0) {
    overlap_free(s);
    return ps_seterr(err, -1, "cannot set up the communication thread");
  }
  if (ps_worker_pull(w, err) != 0) { /* into pbuf[0] */
    overlap_free(s);
    return -1;
  }
  memcpy(s->pbuf[1], s->pbuf[0], P * sizeof(float));
  memcpy(s->vbuf[1], s->vbuf[0], (size_t)w->nshards * sizeof(uint64_t));
  PS_INFO("overlap: pushes and pulls run beside compute (one version staler)");
  *state = s;
  return 0;
}

static int overlap_run(void *state, int64_t step, const ps_batch *b, ps_step_result *r,
                       char *err) {
  overlap_state *s = state;
  ps_worker *w = s->w;
  int cur = (int)(step & 1);
  s->cur = cur;
  use_set(s, cur);
  double tb = ps_now_s();
  r->loss = ps_compute_step(w, step, b, &r->correct);
  double tc = ps_now_s();
  if (ps_step_check_loss(step, r->loss, err) != 0) return -1;
  /* Wait for the previous round (it filled the other parameter buffer,
   * which the next step computes from), then start this step's. */
  if (s->pending) {
    comm_wait(s);
    comm_job *pj = s->pending;
    s->pending = NULL;
    if (pj->rc != 0) {
      snprintf(err, PS_ERRLEN, "%s", pj->err);
      return -1;
    }
    r->pushed = 1; /* the previous step's push */
    r->res = pj->res;
  }
  comm_job *j = &s->jobs[cur];
  memset(j, 0, sizeof *j);
  j->w = w;
  j->grads = s->gbuf[cur];
  j->base_versions = s->vbuf[cur];
  j->step = (uint64_t)step;
  j->batch = b->n;
  j->lease = b->tag;
  j->lease_tag = b->last_in_chunk ? b->tag : 0;
  j->pull_into = s->pbuf[cur]; /* computed from; free now */
  j->pull_versions = s->vbuf[cur];
  comm_start_job(s, j);
  s->pending = j;
  r->compute_s = tc - tb;
  r->push_s = ps_now_s() - tc;
  return 0;
}

/* The buffer the comm thread is not writing (and, in host memory, the
 * evaluation computes from it in place: a copy into the current set would
 * race with the pull into it). */
static void overlap_eval_params(void *state) {
  overlap_state *s = state;
  use_set(s, 1 - s->cur);
}

static int overlap_end(void *state, int ok, char *err) {
  overlap_state *s = state;
  int rc = 0;
  /* After a failed step the job out is the one of the step before it
   * (s->pending, not jobs[s->cur]): its push and pull end before the
   * buffers they use are freed, without retrying for --retry-s first
   * (nothing goes on after an error: the tear-down stops the rest). */
  if (s->pending) {
    if (!ok) atomic_store(&s->w->stop, 1);
    comm_wait(s);
    comm_job *pj = s->pending;
    s->pending = NULL;
    if (pj->rc != 0 && ok) {
      snprintf(err, PS_ERRLEN, "%s", pj->err);
      rc = -1;
    }
  }
  overlap_free(s);
  return rc;
}

const ps_step_kind ps_step_overlap = {.name = "overlap",
                                      .begin = overlap_begin,
                                      .run = overlap_run,
                                      .eval_params = overlap_eval_params,
                                      .end = overlap_end};

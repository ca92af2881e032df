#include "replicas.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../common/util.h"
#include "../kernels/ops.h"
#include "model.h"

/* Range boundaries of the gradient sum are rounded to this many floats (64
 * bytes) so that two threads never write the same cache line. */
#define SUM_ALIGN ((size_t)16)

/* The sum works through its range this many floats at a time, so that the
 * destination stays in L1 while every replica's gradient is added to it. */
#define SUM_CHUNK ((size_t)2048)

typedef struct {
  ps_replicas *owner;
  int index;
  ps_ops *ops;     /* ps_ops_cpu_create(1): computes in this replica's thread */
  ps_model *model; /* activations for ceil(max_batch / R) examples */
  float *grads;    /* (P) own gradient; replica 0 writes into the caller's instead */
  pthread_t tid;
  /* This step's slice and results, set by the caller before the wake-up
   * and read back after the last thread is done (both under mu). */
  int first, n;
  float weight; /* n / batch n */
  float loss;
  int correct;
} replica;

struct ps_replicas {
  ps_model_spec spec;
  int R, max_batch;
  size_t P, in_size; /* parameters; floats per example */
  replica *reps;     /* (R) */
  int started;       /* threads running */

  /* A step: the caller publishes it and bumps generation under mu; each
   * thread computes its replica, waits at the `computed` barrier until all
   * have, sums its range of the gradient, and the last to finish signals
   * `done`. */
  pthread_mutex_t mu;
  pthread_cond_t wake, computed, done;
  unsigned long generation;
  int computing; /* threads still computing this step */
  int running;   /* threads still in this step */
  int stop;
  const float *params, *x;
  const uint8_t *y;
  uint64_t seed, step;
  float *grads; /* the caller's (P); replica 0's gradient, then the sum */
};

/* ---- the gradient sum ----
 *
 * Blocks of 8 floats in a local array, as in kernels/cpu/ops_cpu.c: GCC at
 * -O2 vectorizes these and not the plain loops (which need alias checks). */
enum { BLOCK = 8 };

/* d[i] *= w */
static void scale_floats(float *d, size_t n, float w) {
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK];
    memcpy(v, d + i, sizeof v);
    for (int k = 0; k < BLOCK; k++) v[k] *= w;
    memcpy(d + i, v, sizeof v);
  }
  for (; i < n; i++) d[i] *= w;
}

/* d[i] += w * s[i] */
static void axpy_floats(float *d, const float *s, size_t n, float w) {
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK], a[BLOCK];
    memcpy(v, d + i, sizeof v);
    memcpy(a, s + i, sizeof a);
    for (int k = 0; k < BLOCK; k++) v[k] += w * a[k];
    memcpy(d + i, v, sizeof v);
  }
  for (; i < n; i++) d[i] += w * s[i];
}

/* [*begin, *end): thread t's share of P values, boundaries on SUM_ALIGN. */
static void sum_range(size_t P, int t, int R, size_t *begin, size_t *end) {
  size_t b = P * (size_t)t / (size_t)R, e = P * (size_t)(t + 1) / (size_t)R;
  b -= b % SUM_ALIGN;
  e = t == R - 1 ? P : e - e % SUM_ALIGN;
  *begin = b;
  *end = e;
}

/* grads[b:e) = w_0 * grads[b:e) + w_1 * g_1[b:e) + ... in replica order,
 * over the replicas that had examples (replica 0 always has, see
 * slice_batch). With one such replica its weight is 1 and nothing is done. */
static void sum_gradients(ps_replicas *r, size_t b, size_t e) {
  const float w0 = r->reps[0].weight;
  for (size_t c = b; c < e; c += SUM_CHUNK) {
    const size_t len = e - c < SUM_CHUNK ? e - c : SUM_CHUNK;
    float *d = r->grads + c;
    if (w0 != 1.0f) scale_floats(d, len, w0);
    for (int i = 1; i < r->R; i++)
      if (r->reps[i].n > 0) axpy_floats(d, r->reps[i].grads + c, len, r->reps[i].weight);
  }
}

/* ---- the threads ---- */

static void compute_replica(ps_replicas *r, replica *rp) {
  rp->loss = 0.0f;
  rp->correct = 0;
  if (rp->n == 0) return;
  float *g = rp->index == 0 ? r->grads : rp->grads;
  /* Dropout stream step*R + index: R == 1 keeps ps_model_train_step's. */
  const uint64_t stream = r->step * (uint64_t)r->R + (uint64_t)rp->index;
  rp->loss = ps_model_train_step(rp->model, r->params, r->x + (size_t)rp->first * r->in_size,
                                 r->y + rp->first, rp->n, r->seed, stream, g, &rp->correct);
}

static void *replica_main(void *arg) {
  replica *rp = arg;
  ps_replicas *r = rp->owner;
  unsigned long seen = 0;
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (!r->stop && r->generation == seen) pthread_cond_wait(&r->wake, &r->mu);
    if (r->stop) break;
    seen = r->generation;
    pthread_mutex_unlock(&r->mu);

    compute_replica(r, rp);

    /* Every gradient must be complete before any range is summed. The
     * count is reset only by the next step, which cannot begin before this
     * thread has passed the barrier and finished. */
    pthread_mutex_lock(&r->mu);
    if (--r->computing == 0)
      pthread_cond_broadcast(&r->computed);
    else
      while (r->computing > 0) pthread_cond_wait(&r->computed, &r->mu);
    pthread_mutex_unlock(&r->mu);

    if (r->R > 1) {
      size_t b, e;
      sum_range(r->P, rp->index, r->R, &b, &e);
      sum_gradients(r, b, e);
    }

    pthread_mutex_lock(&r->mu);
    if (--r->running == 0) pthread_cond_signal(&r->done);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

/* ---- create, destroy ---- */

static void free_replicas(ps_replicas *r) {
  if (r->started > 0) {
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < r->started; i++) pthread_join(r->reps[i].tid, NULL);
  }
  if (r->reps) {
    for (int i = 0; i < r->R; i++) {
      replica *rp = &r->reps[i];
      ps_model_destroy(rp->model);
      if (rp->ops) rp->ops->destroy(rp->ops);
      ps_free(rp->grads);
    }
    free(r->reps);
  }
  pthread_cond_destroy(&r->done);
  pthread_cond_destroy(&r->computed);
  pthread_cond_destroy(&r->wake);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

ps_replicas *ps_replicas_create(const ps_model_spec *spec, int R, int max_batch, char *err) {
  if (!spec || R < 1 || max_batch < 1) {
    ps_seterr(err, PS_EINVAL,
              "replicas: need a spec, R >= 1 and max_batch >= 1 (got R=%d, "
              "max_batch=%d)",
              R, max_batch);
    return NULL;
  }
  ps_replicas *r = calloc(1, sizeof *r);
  if (!r) {
    ps_seterr(err, PS_ENOMEM, "out of memory creating %d replicas", R);
    return NULL;
  }
  /* The primitives first, so that free_replicas may destroy them. */
  int inited = 0;
  if (pthread_mutex_init(&r->mu, NULL) == 0) {
    inited = 1;
    if (pthread_cond_init(&r->wake, NULL) == 0) {
      inited = 2;
      if (pthread_cond_init(&r->computed, NULL) == 0) {
        inited = 3;
        if (pthread_cond_init(&r->done, NULL) == 0) inited = 4;
      }
    }
  }
  if (inited < 4) {
    if (inited > 2) pthread_cond_destroy(&r->computed);
    if (inited > 1) pthread_cond_destroy(&r->wake);
    if (inited > 0) pthread_mutex_destroy(&r->mu);
    free(r);
    ps_seterr(err, PS_ENOMEM, "replicas: cannot create a mutex or condition variable");
    return NULL;
  }
  r->spec = *spec;
  r->R = R;
  r->max_batch = max_batch;
  r->P = spec->n_params;
  r->in_size = (size_t)spec->in_c * spec->in_h * spec->in_w;
  r->reps = calloc((size_t)R, sizeof *r->reps);
  if (!r->reps) goto oom;
  const int per_replica = (max_batch + R - 1) / R;
  for (int i = 0; i < R; i++) {
    replica *rp = &r->reps[i];
    rp->owner = r;
    rp->index = i;
    /* One compute thread: this replica's own. This also sets OpenBLAS to
     * one thread, process-wide (see replicas.h). */
    rp->ops = ps_ops_cpu_create(1);
    if (!rp->ops) goto oom;
    rp->model = ps_model_create(&r->spec, rp->ops, per_replica, err);
    if (!rp->model) {
      free_replicas(r);
      return NULL; /* err says why */
    }
    if (i > 0) {
      rp->grads = ps_alloc((r->P ? r->P : 1) * sizeof(float));
      if (!rp->grads) goto oom;
    }
  }
  for (int i = 0; i < R; i++) {
    if (pthread_create(&r->reps[i].tid, NULL, replica_main, &r->reps[i]) != 0) {
      free_replicas(r); /* joins the ones already started */
      ps_seterr(err, PS_ENOMEM, "replicas: cannot start thread %d of %d", i + 1, R);
      return NULL;
    }
    r->started = i + 1;
  }
  return r;
oom:
  free_replicas(r);
  ps_seterr(err, PS_ENOMEM, "out of memory creating %d replicas for batch %d", R, max_batch);
  return NULL;
}

void ps_replicas_destroy(ps_replicas *r) {
  if (r) free_replicas(r);
}

int ps_replicas_count(const ps_replicas *r) { return r->R; }

/* ---- a step ---- */

/* Replica i gets examples [first, first + n_i): n/R each, and one more for
 * the first n % R, so replica 0 has examples whenever the batch has. */
static void slice_batch(ps_replicas *r, int n) {
  const int base = n / r->R, extra = n % r->R;
  int first = 0;
  for (int i = 0; i < r->R; i++) {
    replica *rp = &r->reps[i];
    rp->first = first;
    rp->n = base + (i < extra);
    rp->weight = (float)rp->n / (float)n;
    first += rp->n;
  }
}

float ps_replicas_train_step(ps_replicas *r, const float *params, const float *x, const uint8_t *y,
                             int n, uint64_t seed, uint64_t step, float *grads, int *correct) {
  if (n < 0 || n > r->max_batch) return NAN;
  if (n == 0) {
    memset(grads, 0, r->P * sizeof(float));
    if (correct) *correct = 0;
    return 0.0f;
  }
  pthread_mutex_lock(&r->mu);
  slice_batch(r, n);
  r->params = params;
  r->x = x;
  r->y = y;
  r->seed = seed;
  r->step = step;
  r->grads = grads;
  r->computing = r->R;
  r->running = r->R;
  r->generation++;
  pthread_cond_broadcast(&r->wake);
  while (r->running > 0) pthread_cond_wait(&r->done, &r->mu);
  pthread_mutex_unlock(&r->mu);

  if (r->R == 1) {
    if (correct) *correct = r->reps[0].correct;
    return r->reps[0].loss;
  }
  /* The mean over the batch of the slices' means, weighted by their sizes. */
  double loss = 0.0;
  int right = 0;
  for (int i = 0; i < r->R; i++) {
    loss += (double)r->reps[i].loss * r->reps[i].n;
    right += r->reps[i].correct;
  }
  if (correct) *correct = right;
  return (float)(loss / n);
}

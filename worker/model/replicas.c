#include "worker/model/replicas.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/ops.h"
#include "kernels/emu/ops_emu.h"
#include "worker/model/model.h"
#ifdef PS_WITH_CUDA
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/nccl_comm.h"
#include "kernels/cuda/ops_cuda.h"
#endif

/* Range boundaries of the gradient sum are rounded to this many floats (64
 * bytes) so that two threads never write the same cache line. */
#define SUM_ALIGN ((size_t)16)

/* The sum works through its range this many floats at a time, so that the
 * destination stays in L1 while every replica's gradient is added to it. */
#define SUM_CHUNK ((size_t)2048)

typedef struct {
  ps_replicas *owner;
  int index;
  ps_ops *ops;     /* this replica's own backend (cpu: computes in this replica's thread) */
  ps_model *model; /* activations for ceil(max_batch / R) examples */
  float *grads;    /* (P) own gradient, host memory; replica 0 writes into the caller's */
  /* Backends whose memory is not host memory: the parameters and the
   * gradient in it (P floats each), and zeros to send when the replica has
   * no examples in a step summed by NCCL. */
  float *d_params, *d_grads, *zeros;
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
  int device;   /* the replicas' backends hold their memory apart from the host */
  void *nccl;   /* ps_nccl: the device sum (NULL: through host memory) */
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

#ifdef PS_WITH_CUDA
/* The device sum (NCCL, one replica per GPU): every replica's parameters
 * come from replica 0's copy, every gradient is weighted on its device,
 * and the sum lands in replica 0's, which goes to the caller. */
static void compute_replica_nccl(ps_replicas *r, replica *rp, uint64_t stream) {
  ps_ops *o = rp->ops;
  const size_t bytes = r->P * sizeof(float);
  if (rp->index == 0) o->to_device(o->ctx, rp->d_params, r->params, bytes);
  ps_nccl_broadcast(r->nccl, rp->index, o, rp->d_params, r->P);
  const float *send = rp->zeros; /* a replica without examples adds nothing */
  if (rp->n > 0) {
    rp->loss = ps_model_train_step(rp->model, rp->d_params, r->x + (size_t)rp->first * r->in_size,
                                   r->y + rp->first, rp->n, r->seed, stream, rp->d_grads,
                                   &rp->correct);
    o->scale(o->ctx, r->P, rp->weight, rp->d_grads);
    send = rp->d_grads;
  }
  ps_nccl_reduce_sum(r->nccl, rp->index, o, send, rp->d_grads, r->P);
  if (rp->index == 0) o->to_host(o->ctx, r->grads, rp->d_grads, bytes);
  o->sync(o->ctx);
}
#endif

static void compute_replica(ps_replicas *r, replica *rp) {
  rp->loss = 0.0f;
  rp->correct = 0;
  /* Dropout stream step*R + index: R == 1 keeps ps_model_train_step's. */
  const uint64_t stream = r->step * (uint64_t)r->R + (uint64_t)rp->index;
#ifdef PS_WITH_CUDA
  if (r->nccl) {
    compute_replica_nccl(r, rp, stream);
    return;
  }
#endif
  if (rp->n == 0) return;
  float *g = rp->index == 0 ? r->grads : rp->grads;
  const float *x = r->x + (size_t)rp->first * r->in_size;
  if (!r->device) {
    rp->loss = ps_model_train_step(rp->model, r->params, x, r->y + rp->first, rp->n, r->seed,
                                   stream, g, &rp->correct);
    return;
  }
  /* On a device, summed through host memory: parameters in, gradient out. */
  ps_model_params_to_device(rp->model, rp->d_params, r->params);
  rp->loss = ps_model_train_step(rp->model, rp->d_params, x, r->y + rp->first, rp->n, r->seed,
                                 stream, rp->d_grads, &rp->correct);
  ps_model_params_to_host(rp->model, g, rp->d_grads);
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

    if (r->R > 1 && !r->nccl) {
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
#ifdef PS_WITH_CUDA
  ps_nccl_destroy(r->nccl);
#endif
  if (r->reps) {
    for (int i = 0; i < r->R; i++) {
      replica *rp = &r->reps[i];
      if (rp->model) {
        ps_model_free_params(rp->model, rp->d_params);
        ps_model_free_params(rp->model, rp->d_grads);
        ps_model_free_params(rp->model, rp->zeros);
      }
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

/* One compute thread: the replica's own. This also sets OpenBLAS to one
 * thread, process-wide (see replicas.h). */
static ps_ops *cpu_backend(int i, void *user, char *err) {
  (void)user;
  ps_ops *o = ps_ops_cpu_create(1);
  if (!o) ps_seterr(err, PS_ENOMEM, "replica %d: cannot create a cpu backend", i);
  return o;
}

ps_replicas *ps_replicas_create(const ps_model_spec *spec, int R, int max_batch, char *err) {
  return ps_replicas_create_with(spec, R, max_batch, cpu_backend, NULL, err);
}

ps_replicas *ps_replicas_create_with(const ps_model_spec *spec, int R, int max_batch,
                                     ps_replica_backend_fn make, void *user, char *err) {
  if (!spec || R < 1 || max_batch < 1 || !make) {
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
    rp->ops = make(i, user, err);
    if (!rp->ops) {
      free_replicas(r);
      return NULL; /* err says why */
    }
    rp->model = ps_model_create(&r->spec, rp->ops, per_replica, err);
    if (!rp->model) {
      free_replicas(r);
      return NULL; /* err says why */
    }
    if (i > 0) {
      rp->grads = ps_alloc((r->P ? r->P : 1) * sizeof(float));
      if (!rp->grads) goto oom;
    }
    if (!rp->ops->host_memory) {
      r->device = 1;
      rp->d_params = ps_model_alloc_params(rp->model);
      rp->d_grads = ps_model_alloc_params(rp->model);
      if (!rp->d_params || !rp->d_grads) goto oom;
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

int ps_replicas_on_device(const ps_replicas *r) { return r->device; }

static ps_ops *emu_backend(int i, void *user, char *err) {
  (void)user;
  ps_ops *o = ps_ops_emu_create(1);
  if (!o) ps_seterr(err, PS_ENOMEM, "replica %d: cannot create an emulated device", i);
  return o;
}

ps_replicas *ps_replicas_create_for(const ps_model_spec *spec, int R, int max_batch,
                                    const char *backend, char *err) {
  if (backend && strcmp(backend, "cuda") == 0)
    return ps_replicas_create_cuda(spec, R, max_batch, err);
  if (backend && strcmp(backend, "emu") == 0)
    return ps_replicas_create_with(spec, R, max_batch, emu_backend, NULL, err);
  if (!backend || strcmp(backend, "cpu") == 0) return ps_replicas_create(spec, R, max_batch, err);
  ps_seterr(err, PS_EINVAL, "replicas: no backend '%s' (cpu, cuda or emu)", backend);
  return NULL;
}

int ps_replicas_nccl(const ps_replicas *r) { return r->nccl != NULL; }

int ps_replicas_set_precision(ps_replicas *r, ps_precision p, char *err) {
  for (int i = 0; i < r->R; i++) {
    ps_ops *o = r->reps[i].ops;
    if (!o->set_precision) {
      if (p == PS_PRECISION_FP32) continue;
      return ps_seterr(err, PS_EINVAL, "replica %d: the %s backend computes in fp32 only", i,
                       o->name);
    }
    int rc = o->set_precision(o->ctx, p, err);
    if (rc != 0) return rc;
  }
  return 0;
}

#ifdef PS_WITH_CUDA
typedef struct {
  int ndev;
} cuda_make_ctx;

static ps_ops *cuda_backend(int i, void *user, char *err) {
  const cuda_make_ctx *c = user;
  return ps_ops_cuda_create(i % c->ndev, err);
}

ps_replicas *ps_replicas_create_cuda(const ps_model_spec *spec, int R, int max_batch, char *err) {
  char why[128] = "";
  cuda_make_ctx c = {ps_cuda_device_count(why)};
  if (c.ndev == 0) {
    ps_seterr(err, PS_EINVAL, "replicas on cuda: no CUDA device (%s)", why);
    return NULL;
  }
  ps_replicas *r = ps_replicas_create_with(spec, R, max_batch, cuda_backend, &c, err);
  if (!r || R == 1 || R > c.ndev || R > 256) return r; /* several on a GPU: through the host */
  int devices[256];
  for (int i = 0; i < R; i++) devices[i] = i;
  char nerr[PS_ERRLEN] = "";
  ps_nccl *g = ps_nccl_create(R, devices, nerr);
  if (!g) {
    PS_WARN("replicas: %s; the gradients are summed through host memory", nerr);
    return r;
  }
  for (int i = 0; i < R; i++) {
    replica *rp = &r->reps[i];
    rp->zeros = ps_model_alloc_params(rp->model); /* zeroed by alloc */
    if (!rp->zeros) {
      ps_nccl_destroy(g);
      PS_WARN("replicas: out of device memory for NCCL's zeros; summing through host memory");
      return r;
    }
  }
  r->nccl = g; /* the threads read it at the next step (under the step's mutex) */
  return r;
}
#else
ps_replicas *ps_replicas_create_cuda(const ps_model_spec *spec, int R, int max_batch, char *err) {
  (void)spec, (void)R, (void)max_batch;
  ps_seterr(err, PS_EINVAL, "this ps-worker was built without CUDA (WITH_CUDA=OFF)");
  return NULL;
}
#endif

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

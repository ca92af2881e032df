/* The optimizers of ps/optim.h, one table entry each.
 *
 * The apply functions are the hot path of a push: a straight loop over a
 * contiguous run of floats. Everything that is per call (bias corrections,
 * 1 - beta) is computed before the loop, and the arrays are restrict so
 * that the compiler may vectorize without alias checks. The loops run in
 * blocks of PS_OPTIM_BLOCK values: at -O2 GCC (its "very cheap" cost model)
 * only vectorizes a loop whose trip count it knows, so each block is a
 * constant-count loop and the short tail runs the same body.
 *
 * sqrtf: with the default -fmath-errno GCC keeps sqrtf scalar (it may have
 * to set errno), so adagrad and adam vectorize only under -fno-math-errno,
 * which makes an adam push about twice as fast (3.3M values: 7 ms instead
 * of 13-17 ms on the 2-core machine). */
#include "optim.h"

#include <math.h>
#include <string.h>

#define PS_OPTIM_BLOCK 16

static float zero_slot_init(const ps_optim_config *cfg, int slot) {
  (void)cfg;
  (void)slot;
  return 0.0f;
}

/* Each optimizer's arithmetic lives in one *_run function with restrict
 * parameters (which GCC honours, unlike restrict locals); its apply calls it
 * on full blocks (inlined with a constant n, hence vectorized) and once more
 * on the tail. */

/* ---- sgd: p -= lr*g ---- */

static inline void sgd_run(float *restrict p, const ps_ufloat *restrict g, size_t n, float lr) {
  for (size_t j = 0; j < n; j++) p[j] -= lr * g[j];
}

static void sgd_apply(const ps_optim_config *cfg, uint64_t t, float lr, float *param,
                      float **slots, const ps_ufloat *grad, size_t n) {
  (void)cfg;
  (void)t;
  (void)slots;
  size_t i = 0;
  for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
    sgd_run(param + i, grad + i, PS_OPTIM_BLOCK, lr);
  sgd_run(param + i, grad + i, n - i, lr);
}

/* ---- momentum: v = mu*v + g; p -= lr*v (nesterov: p -= lr*(g + mu*v)) ---- */

static inline void momentum_run(float *restrict p, float *restrict v, const ps_ufloat *restrict g,
                                size_t n, float lr, float mu) {
  for (size_t j = 0; j < n; j++) {
    v[j] = mu * v[j] + g[j];
    p[j] -= lr * v[j];
  }
}

static inline void nesterov_run(float *restrict p, float *restrict v, const ps_ufloat *restrict g,
                                size_t n, float lr, float mu) {
  for (size_t j = 0; j < n; j++) {
    v[j] = mu * v[j] + g[j];
    p[j] -= lr * (g[j] + mu * v[j]);
  }
}

static void momentum_apply(const ps_optim_config *cfg, uint64_t t, float lr, float *param,
                           float **slots, const ps_ufloat *grad, size_t n) {
  (void)t;
  float *vel = slots[0];
  const float mu = cfg->momentum;
  /* Two bodies rather than a branch inside one, so that each stays a plain
   * vectorizable loop. */
  if (cfg->nesterov) {
    size_t i = 0;
    for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
      nesterov_run(param + i, vel + i, grad + i, PS_OPTIM_BLOCK, lr, mu);
    nesterov_run(param + i, vel + i, grad + i, n - i, lr, mu);
  } else {
    size_t i = 0;
    for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
      momentum_run(param + i, vel + i, grad + i, PS_OPTIM_BLOCK, lr, mu);
    momentum_run(param + i, vel + i, grad + i, n - i, lr, mu);
  }
}

/* ---- adagrad: a += g*g; p -= lr*g / (sqrt(a) + eps) ---- */

static float adagrad_slot_init(const ps_optim_config *cfg, int slot) {
  (void)slot;
  return cfg->initial_accumulator;
}

static inline void adagrad_run(float *restrict p, float *restrict a, const ps_ufloat *restrict g,
                               size_t n, float lr, float eps) {
  for (size_t j = 0; j < n; j++) {
    a[j] += g[j] * g[j];
    p[j] -= lr * g[j] / (sqrtf(a[j]) + eps);
  }
}

static void adagrad_apply(const ps_optim_config *cfg, uint64_t t, float lr, float *param,
                          float **slots, const ps_ufloat *grad, size_t n) {
  (void)t;
  float *acc = slots[0];
  const float eps = cfg->eps;
  size_t i = 0;
  for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
    adagrad_run(param + i, acc + i, grad + i, PS_OPTIM_BLOCK, lr, eps);
  adagrad_run(param + i, acc + i, grad + i, n - i, lr, eps);
}

/* ---- adam ----
 * m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
 * p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
 * The bias corrections are computed once per call in double: in float,
 * 1 - b2^t for b2 = 0.999 loses most of its digits at small t. */

typedef struct {
  float b1, b2, one_b1, one_b2, eps;
  float step;    /* lr / (1 - b1^t) */
  float inv_bc2; /* 1 / (1 - b2^t) */
} adam_consts;

static inline void adam_run(float *restrict p, float *restrict m, float *restrict v,
                            const ps_ufloat *restrict g, size_t n, adam_consts k) {
  for (size_t j = 0; j < n; j++) {
    m[j] = k.b1 * m[j] + k.one_b1 * g[j];
    v[j] = k.b2 * v[j] + k.one_b2 * g[j] * g[j];
    p[j] -= k.step * m[j] / (sqrtf(v[j] * k.inv_bc2) + k.eps);
  }
}

static void adam_apply(const ps_optim_config *cfg, uint64_t t, float lr, float *param,
                       float **slots, const ps_ufloat *grad, size_t n) {
  float *mom = slots[0], *var = slots[1];
  /* t counts from 1; a caller passing 0 would divide by zero below. */
  const double td = (double)(t ? t : 1);
  const double bc1 = 1.0 - pow((double)cfg->beta1, td);
  const double bc2 = 1.0 - pow((double)cfg->beta2, td);
  const adam_consts k = {
      .b1 = cfg->beta1,
      .b2 = cfg->beta2,
      .one_b1 = 1.0f - cfg->beta1,
      .one_b2 = 1.0f - cfg->beta2,
      .eps = cfg->eps,
      .step = (float)((double)lr / bc1),
      .inv_bc2 = (float)(1.0 / bc2),
  };
  size_t i = 0;
  for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
    adam_run(param + i, mom + i, var + i, grad + i, PS_OPTIM_BLOCK, k);
  adam_run(param + i, mom + i, var + i, grad + i, n - i, k);
}

static const ps_optimizer optimizers[] = {
    {"sgd", 0, zero_slot_init, sgd_apply},
    {"momentum", 1, zero_slot_init, momentum_apply},
    {"adagrad", 1, adagrad_slot_init, adagrad_apply},
    {"adam", 2, zero_slot_init, adam_apply},
};

const ps_optimizer *ps_optimizer_find(const char *name) {
  if (!name) return NULL;
  for (size_t i = 0; i < sizeof optimizers / sizeof optimizers[0]; i++)
    if (strcmp(optimizers[i].name, name) == 0) return &optimizers[i];
  return NULL;
}

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
 * of 13-17 ms on the 2-core machine).
 *
 * Bounds: each optimizer's *_bound says, from bounds on what goes in, how
 * large anything its apply computes can get. Each float operation rounds
 * by a factor of at most 1 + 2^-24 (plus 2^-149 near zero); up() adds
 * 2^-20 and 2^-100 to every bound, well above what the few operations
 * behind one value can add. A shard that finds every bound within FLT_MAX
 * knows the update stays finite without looking at it. */
#include "optim.h"

#include <math.h>
#include <string.h>

#define PS_OPTIM_BLOCK 16

static double up(double x) { return x * (1.0 + 0x1p-20) + 0x1p-100; }
static double max2(double a, double b) { return a > b ? a : b; }

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

static void sgd_bound(const ps_optim_config *cfg, uint64_t t, float lr, double g,
                      ps_optim_bounds *b) {
  (void)cfg;
  (void)t;
  b->param = up(b->param + (double)lr * g);
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

static void momentum_bound(const ps_optim_config *cfg, uint64_t t, float lr, double g,
                           ps_optim_bounds *b) {
  (void)t;
  const double mu = fabs((double)cfg->momentum);
  const double v = up(mu * b->slot[0] + g);
  if (cfg->nesterov) {
    const double step = up(g + mu * v); /* g + mu*v */
    b->param = max2(up(b->param + (double)lr * step), step);
  } else {
    b->param = up(b->param + (double)lr * v);
  }
  b->slot[0] = v;
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

/* |g| / (sqrt(a + g*g) + eps) is at most 1 while g*g is a normal float
 * (|g| >= 2^-63); below that it is at most 2^-63 / eps. The accumulator
 * must not be negative (sqrt) and eps must be positive (a may be 0). */
static void adagrad_bound(const ps_optim_config *cfg, uint64_t t, float lr, double g,
                          ps_optim_bounds *b) {
  (void)t;
  const double eps = (double)cfg->eps;
  const double a = up(b->slot[0] + g * g);
  const double ratio = up(max2(1.0, (g < 0x1p-63 ? g : 0x1p-63) / eps));
  b->param = max2(up(b->param + (double)lr * ratio), up((double)lr * g)); /* lr*g: intermediate */
  if (!(eps > 0.0) || !(b->slot_nonneg & 1u)) b->param = INFINITY;
  b->slot[0] = a;
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

static adam_consts adam_setup(const ps_optim_config *cfg, uint64_t t, float lr) {
  /* t counts from 1; a caller passing 0 would divide by zero below. */
  const double td = (double)(t ? t : 1);
  const double bc1 = 1.0 - pow((double)cfg->beta1, td);
  const double bc2 = 1.0 - pow((double)cfg->beta2, td);
  return (adam_consts){
      .b1 = cfg->beta1,
      .b2 = cfg->beta2,
      .one_b1 = 1.0f - cfg->beta1,
      .one_b2 = 1.0f - cfg->beta2,
      .eps = cfg->eps,
      .step = (float)((double)lr / bc1),
      .inv_bc2 = (float)(1.0 / bc2),
  };
}

static void adam_apply(const ps_optim_config *cfg, uint64_t t, float lr, float *param,
                       float **slots, const ps_ufloat *grad, size_t n) {
  float *mom = slots[0], *var = slots[1];
  const adam_consts k = adam_setup(cfg, t, lr);
  size_t i = 0;
  for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
    adam_run(param + i, mom + i, var + i, grad + i, PS_OPTIM_BLOCK, k);
  adam_run(param + i, mom + i, var + i, grad + i, n - i, k);
}

/* With b1, b2 in [0, 1) (the shard checks them; no promise otherwise):
 * |m| grows by at most |g|, v by g*g, and the step is at most step*|m| /
 * eps. v*inv_bc2 is an intermediate; v must not be negative (sqrt). */
static void adam_bound(const ps_optim_config *cfg, uint64_t t, float lr, double g,
                       ps_optim_bounds *b) {
  const adam_consts k = adam_setup(cfg, t, lr);
  const double m = up((double)k.b1 * b->slot[0] + g);
  const double v = up((double)k.b2 * b->slot[1] + g * g);
  const double scaled_v = up(v * (double)k.inv_bc2), step_m = up((double)k.step * m);
  b->param = max2(up(b->param + step_m / (double)k.eps), max2(scaled_v, step_m));
  if (!(k.b1 >= 0.0f && k.b1 < 1.0f && k.b2 >= 0.0f && k.b2 < 1.0f && k.eps > 0.0f) ||
      !(b->slot_nonneg & 2u))
    b->param = INFINITY;
  b->slot[0] = m;
  b->slot[1] = v;
}

static const ps_optimizer optimizers[] = {
    {"sgd", 0, zero_slot_init, sgd_apply, sgd_bound},
    {"momentum", 1, zero_slot_init, momentum_apply, momentum_bound},
    {"adagrad", 1, adagrad_slot_init, adagrad_apply, adagrad_bound},
    {"adam", 2, zero_slot_init, adam_apply, adam_bound},
};

const ps_optimizer *ps_optimizer_find(const char *name) {
  if (!name) return NULL;
  for (size_t i = 0; i < sizeof optimizers / sizeof optimizers[0]; i++)
    if (strcmp(optimizers[i].name, name) == 0) return &optimizers[i];
  return NULL;
}

/* ---- moving statistics ---- */

static inline void moving_run(float *restrict p, const ps_ufloat *restrict g, size_t n, float mu,
                              float one_minus_mu) {
  for (size_t j = 0; j < n; j++) p[j] = mu * p[j] + one_minus_mu * g[j];
}

void ps_moving_average(float momentum, float *param, const ps_ufloat *grad, size_t n) {
  const float rest = 1.0f - momentum;
  size_t i = 0;
  for (; i + PS_OPTIM_BLOCK <= n; i += PS_OPTIM_BLOCK)
    moving_run(param + i, grad + i, PS_OPTIM_BLOCK, momentum, rest);
  moving_run(param + i, grad + i, n - i, momentum, rest);
}

void ps_optim_apply_ranges(const ps_optimizer *opt, const ps_optim_config *cfg, uint64_t t,
                           float lr, float *param, float **slots, const ps_ufloat *grad, size_t n,
                           size_t first, const ps_moving_range *mr, int n_mr) {
  size_t pos = 0; /* from param[0] */
  for (int r = 0; r < n_mr && pos < n; r++) {
    const size_t lo = mr[r].off, hi = mr[r].off + mr[r].count;
    if (hi <= first + pos) continue;
    if (lo >= first + n) break;
    /* Trained values before the range, then the range's own. */
    const size_t start = lo > first + pos ? lo - first : pos;
    if (start > pos) {
      float *sl[PS_OPTIM_MAX_SLOTS];
      for (int k = 0; k < opt->n_slots; k++) sl[k] = slots[k] + pos;
      opt->apply(cfg, t, lr, param + pos, sl, grad + pos, start - pos);
    }
    const size_t stop = hi - first < n ? hi - first : n;
    ps_moving_average(mr[r].momentum, param + start, grad + start, stop - start);
    pos = stop;
  }
  if (pos < n) {
    float *sl[PS_OPTIM_MAX_SLOTS];
    for (int k = 0; k < opt->n_slots; k++) sl[k] = slots[k] + pos;
    opt->apply(cfg, t, lr, param + pos, sl, grad + pos, n - pos);
  }
}

void ps_moving_bound(double g, const ps_optim_bounds *before, ps_optim_bounds *b) {
  b->param = max2(b->param, up(max2(before->param, g)));
}

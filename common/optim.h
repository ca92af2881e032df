/* Optimizers (applied on a shard, or in ps-worker --local): a small table of functions each.
 *
 * Every optimizer keeps `n_slots` float slots per parameter (zeroed at
 * start, except where init_slots says otherwise) and updates a contiguous
 * run of parameters from a gradient of the mean loss.
 *
 *   sgd:      p -= lr*g
 *   momentum: v = mu*v + g;  p -= lr*v              (nesterov: p -= lr*(g + mu*v))
 *   adagrad:  a += g*g;      p -= lr*g / (sqrt(a) + eps), a starts at initial_accumulator
 *   adam:     m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
 *             p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
 * t is the 1-based count of updates applied to the shard (its version+1).
 * grad may sit at any address (it is read in place from gRPC's slices). */
#ifndef PS_COMMON_OPTIM_H
#define PS_COMMON_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"
#include "util.h"

/* What a shard knows of its state without reading it: upper bounds on the
 * magnitude of the parameters and of each slot, and which slots hold no
 * negative value (bit k: slot k). The bound functions below carry them
 * through an update, so that an update that cannot overflow is known to be
 * safe before it starts. */
#define PS_OPTIM_MAX_SLOTS 4
typedef struct {
  double param;                    /* >= max |param| */
  double slot[PS_OPTIM_MAX_SLOTS]; /* >= max |slot k| */
  unsigned slot_nonneg;            /* bit k: every value of slot k is >= 0 (or -0) */
} ps_optim_bounds;

typedef struct {
  const char *name;
  int n_slots;
  /* Initial value of slot i (0 for all but adagrad's accumulator). */
  float (*slot_init)(const ps_optim_config *cfg, int slot);
  /* Applies one update to param[0..n) with slots[k][0..n). */
  void (*apply)(const ps_optim_config *cfg, uint64_t t, float lr, float *param, float **slots,
                const ps_ufloat *grad, size_t n);
  /* Carries bounds through apply(cfg, t, lr, ...) with a gradient whose
   * values are at most g in magnitude: b holds bounds on the values before,
   * and receives bounds on the values after, each also above every
   * intermediate value apply computes for them, float rounding included.
   * A bound above FLT_MAX (or NaN) says the update might overflow (or make a
   * NaN, where a slot's sign is not known): only then must the caller look
   * at the results. slot_nonneg is left as it is (apply keeps it true). */
  void (*bound)(const ps_optim_config *cfg, uint64_t t, float lr, double g, ps_optim_bounds *b);
} ps_optimizer;

/* The optimizer of that name, or NULL. */
const ps_optimizer *ps_optimizer_find(const char *name);

/* param[i] = momentum * param[i] + (1 - momentum) * grad[i] for i < n: how
 * a moving statistic (batchnorm's mean and variance) takes a pushed batch
 * statistic in, in place of the optimizer. */
void ps_moving_average(float momentum, float *param, const ps_ufloat *grad, size_t n);

/* One update of param[0..n), which are the global indices [first,
 * first + n): opt->apply, except on the parts inside the moving ranges
 * mr[0..n_mr) (in layout order, disjoint), which ps_moving_average updates
 * (their slots stay as they are). slots[k] point at the slots of param[0]. */
void ps_optim_apply_ranges(const ps_optimizer *opt, const ps_optim_config *cfg, uint64_t t,
                           float lr, float *param, float **slots, const ps_ufloat *grad, size_t n,
                           size_t first, const ps_moving_range *mr, int n_mr);

/* Bounds after an update of ps_optim_apply_ranges: b as opt->bound left
 * it, raised to cover the moving values, each an average of a value below
 * before->param and a gradient value below g. */
void ps_moving_bound(double g, const ps_optim_bounds *before, ps_optim_bounds *b);

#endif

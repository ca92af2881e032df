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

typedef struct {
  const char *name;
  int n_slots;
  /* Initial value of slot i (0 for all but adagrad's accumulator). */
  float (*slot_init)(const ps_optim_config *cfg, int slot);
  /* Applies one update to param[0..n) with slots[k][0..n). */
  void (*apply)(const ps_optim_config *cfg, uint64_t t, float lr, float *param, float **slots,
                const ps_ufloat *grad, size_t n);
} ps_optimizer;

/* The optimizer of that name, or NULL. */
const ps_optimizer *ps_optimizer_find(const char *name);

#endif

/* A model built from a spec on a compute backend: forward, backward, and
 * evaluation over the flat parameter vector.
 *
 * Activations, gradients of activations and scratch space are allocated
 * once for max_batch examples and reused every step. The parameter vector
 * and the gradient vector are the caller's (P floats each, laid out as
 * ps_model_spec says), so a pulled vector is used as it is and the gradient
 * is pushed as it is. */
#ifndef PS_WORKER_MODEL_H
#define PS_WORKER_MODEL_H

#include <stdint.h>

#include "../common/model_spec.h"
#include "../kernels/ops.h"

typedef struct ps_model ps_model;

/* NULL with a message on failure (allocation). ops is borrowed. */
ps_model *ps_model_create(const ps_model_spec *spec, ps_ops *ops, int max_batch, char *err);
void ps_model_destroy(ps_model *m);

/* One training step on n <= max_batch examples x (n, c*h*w), labels y:
 * forward with dropout drawn from (seed, step), backward, and the gradient
 * of the mean loss written to grads (P floats, overwritten). Returns the
 * mean loss; *correct (may be NULL) receives the number of examples whose
 * arg-max matched the label. */
float ps_model_train_step(ps_model *m, const float *params, const float *x, const uint8_t *y,
                          int n, uint64_t seed, uint64_t step, float *grads, int *correct);

/* Forward only, without dropout, over any number of examples (processed in
 * chunks of max_batch). Returns the mean loss; *correct as above. */
float ps_model_evaluate(ps_model *m, const float *params, const float *x, const uint8_t *y,
                        int n, int *correct);

#endif

/* A model built from a spec on a compute backend: forward, backward, and
 * evaluation over the flat parameter vector.
 *
 * Memory. Activations, gradients of activations, masks, argmax, scratch
 * space and the probabilities are the backend's memory (ops->alloc: host
 * memory on the cpu backend, device memory on cuda), allocated once for
 * max_batch examples and reused every step. The parameter vector and the
 * gradient vector are the caller's (P floats each, laid out as
 * ps_model_spec says) and are BACKEND memory too: on the cpu backend any
 * host buffer (a pulled vector is used as it is and the gradient is pushed
 * as it is); on cuda, device buffers, from ps_model_alloc_params (or
 * ops->alloc), filled and read with ps_model_params_to_device and
 * ps_model_params_to_host. The examples x and labels y are always HOST
 * memory (a batch from the data pipeline): on a backend whose memory is not
 * host memory the model copies them into buffers of its own; on the cpu
 * backend it reads them in place, with no copy.
 *
 * Threads: one call at a time per model, and per backend (models sharing a
 * backend share its thread). */
#ifndef PS_WORKER_MODEL_H
#define PS_WORKER_MODEL_H

#include <stdint.h>

#include "common/model_spec.h"
#include "kernels/emb_plan.h"
#include "kernels/ops.h"

typedef struct ps_model ps_model;

/* NULL with a message on failure (allocation, host or backend). ops is
 * borrowed and must outlive the model. */
ps_model *ps_model_create(const ps_model_spec *spec, ps_ops *ops, int max_batch, char *err);
void ps_model_destroy(ps_model *m);

/* One training step on n <= max_batch examples x (n, c*h*w) with labels y
 * (both host memory, read before the call returns): forward with dropout
 * drawn from (seed, step), backward, and the gradient of the mean loss
 * written to grads (P floats of backend memory, overwritten) from params
 * (P floats of backend memory). Batchnorm layers normalize with the
 * batch's statistics and write its mean and variance into grads where
 * their moving statistics are (the shard averages them in). Returns the
 * mean loss; *correct (may be NULL) receives the number of examples whose
 * arg-max matched the label.
 * On cuda the gradient may still be in flight on return: read it with
 * ps_model_params_to_host (or ops->to_host then ops->sync), which waits. */
float ps_model_train_step(ps_model *m, const float *params, const float *x, const uint8_t *y,
                          int n, uint64_t seed, uint64_t step, float *grads, int *correct);

/* The same step in stages, so that the parameters can arrive and the
 * gradient leave in ranges of the flat vector while the backend computes
 * (the worker's pipelined step: a shard's range is copied to the device and
 * the layers it completes run forward while later shards are still being
 * pulled, and a shard's gradient is copied back and pushed while the
 * backward pass goes on through earlier layers). The result is that of
 * ps_model_train_step, bit for bit: the same ops run in the same order.
 *
 * begin: starts a step on n examples (host memory, as above, but read by
 * the copy queue until backward returns, so unchanged until then; ideally
 * ops->host_alloc's memory; the previous step must have been waited for). forward: runs forward every layer not yet run whose
 * parameters lie in params[0, avail) (backend memory), stopping at the
 * first that does not, and the loss once all have run; call it again as
 * avail grows. backward: runs what forward left, then the backward pass,
 * writing grads; after each layer with parameters, ready(user, lo) (ready
 * may be NULL) says that grads[lo, P) are written, in the backend's order:
 * an ops->to_host_async of that range called from ready sees them. The
 * last call has lo == 0. Returns the mean loss; *correct as above. */
void ps_model_step_begin(ps_model *m, const float *x, const uint8_t *y, int n, uint64_t seed,
                         uint64_t step);
void ps_model_step_forward(ps_model *m, const float *params, size_t avail);
/* The mean loss of the step once forward has run every layer (NAN before).
 * On a backend with softmax_xent_stats it waits for the forward pass. */
float ps_model_step_loss(ps_model *m);
float ps_model_step_backward(ps_model *m, const float *params, float *grads,
                             void (*ready)(void *user, size_t lo), void *user, int *correct);
/* CUDA Graphs. After ps_model_step_begin, on a backend with graphs: runs
 * the step's forward pass, loss and backward pass into grads by launching
 * the recording of an earlier step of the same batch size, parameters and
 * gradients (the memory's contents differ, the pointers do not), recording
 * it first when the previous step had that shape; between(user) (may be
 * NULL) is called between forward and backward, while recording, for
 * marks. Returns 1 when the step has run so (then read the results with
 * ps_model_step_loss and ps_model_step_correct), 0 when the caller is to
 * run it with step_forward and step_backward (no graphs on this backend, a
 * model with dropout, the first step of a shape, or a recording that
 * failed: then never again). */
int ps_model_graph_step(ps_model *m, const float *params, float *grads, void (*between)(void *),
                        void *user);
/* Whether the step can be a graph on this backend and model; if not, why
 * (in why, may be NULL). */
int ps_model_graph_able(const ps_model *m, char *why, size_t why_len);

/* The number of the step's examples whose arg-max matched the label (what
 * *correct receives above). It reads the probabilities back, so it waits
 * for the backend to finish what was queued: a caller with copies to wait
 * for (and pushes to start as they land) passes correct == NULL to
 * backward and asks here afterwards. */
int ps_model_step_correct(ps_model *m);

/* Forward only, without dropout and with batchnorm's moving statistics
 * (from params), over any number of examples x, y (host
 * memory; processed in chunks of max_batch) with params (backend memory).
 * Returns the mean loss; *correct as above. */
float ps_model_evaluate(ps_model *m, const float *params, const float *x, const uint8_t *y,
                        int n, int *correct);

/* As ps_model_evaluate; probs (may be NULL; host memory, n * classes
 * floats) receives each example's probabilities (a binary model's: of the
 * label 1). A model with embedding layers evaluates at most max_batch
 * examples per call, those whose rows were set (ps_model_set_rows). */
float ps_model_evaluate_probs(ps_model *m, const float *params, const float *x, const uint8_t *y,
                              int n, int *correct, float *probs);

/* Embedding layers (model_spec.h). Their rows are not in the flat vector:
 * before each step (and each evaluation call) the caller de-duplicates the
 * batch's ids per layer (ps_model_emb_plan), fetches the plan's rows (the
 * servers' rows of plan->uniq, in that order) and hands them over with
 * ps_model_set_rows; the step's backward pass writes the rows' gradients
 * (of the mean loss, as the flat gradient) into drows, host memory,
 * complete once the step has been waited for (ps_model_params_to_host, or
 * ops->sync).
 *
 * The number of embedding layers, and the k-th one (layer order; NULL
 * past the last). */
int ps_model_n_embeddings(const ps_model *m);
const ps_layer *ps_model_embedding(const ps_model *m, int k);
/* Builds plan for layer k from ids (n examples of the model's n_ids ids
 * each, host memory): the ids of the layer's fields, taken modulo rows
 * when rows > 0 (a bounded table), in bags as its pooling says. 0, or
 * PS_EINVAL / PS_ENOMEM with a message (emb_plan.h). */
int ps_model_emb_plan(ps_model *m, int k, const uint64_t *ids, int n, uint64_t rows,
                      ps_emb_plan *plan, char *err);
/* The rows (plan->u * dim floats, host memory) of the next step or
 * evaluation of layer k, and where their gradients go (same size; may be
 * NULL for an evaluation). The plan and both buffers must stay until the
 * step has been waited for. */
void ps_model_set_rows(ps_model *m, int k, const ps_emb_plan *plan, const float *rows,
                       float *drows);

/* P floats of the model's backend memory, zeroed, for a parameter or a
 * gradient vector; NULL when out of memory. Freed with ps_model_free_params
 * (NULL is fine) while the model's backend exists. */
float *ps_model_alloc_params(ps_model *m);
void ps_model_free_params(ps_model *m, float *p);

/* Copies the P floats of a parameter or gradient vector between host
 * memory and the model's backend memory; complete on return (it waits for
 * the steps queued before it). On the cpu backend a plain copy, and nothing
 * when the two pointers are the same buffer. */
void ps_model_params_to_device(ps_model *m, float *dst, const float *src_host);
void ps_model_params_to_host(ps_model *m, float *dst_host, const float *src);

/* The backend the model computes on (borrowed at creation). */
ps_ops *ps_model_ops(const ps_model *m);

#endif

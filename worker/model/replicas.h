/* Mirrored replicas inside one worker: R copies of the model, each on its
 * own thread with its own backend (a CPU backend, or a GPU: see
 * ps_replicas_create_cuda), activations and gradient buffer
 * (replica 0's is the caller's grads, which it overwrites anyway), run on
 * contiguous slices of one batch; their gradients are combined into the
 * gradient of the whole batch's mean loss before the push.
 *
 * Threads. R persistent threads, started by ps_replicas_create, wait for a
 * step; the caller of ps_replicas_train_step sleeps until all are done.
 * Each replica's backend is ps_ops_cpu_create(1): it computes in its own
 * thread, and OpenBLAS is set (process-wide) to one thread, so R sgemm
 * calls run at once, each in the thread that makes it. Debian's OpenBLAS
 * (0.3.21, the pthread variant, libopenblas0-pthread) allows that: with one
 * BLAS thread an sgemm runs in its caller on a work buffer from OpenBLAS's
 * thread-safe allocator (4 threads x 200 concurrent sgemms gave the serial
 * result bit for bit). With more BLAS threads its threaded gemm driver
 * holds a process-wide lock, so concurrent calls would run one at a time
 * (measured: 2 callers with 2 BLAS threads got no more GFLOP/s than 1), and
 * its idle threads spin for a while after each call. So nothing else in the
 * process should turn OpenBLAS's threads back up while replicas compute.
 *
 * One ps_replicas is driven by one thread at a time. */
#ifndef PS_WORKER_REPLICAS_H
#define PS_WORKER_REPLICAS_H

#include <stdint.h>

#include "common/model_spec.h"
#include "kernels/ops.h"

typedef struct ps_replicas ps_replicas;

/* R >= 1 replicas of the model for batches of up to max_batch >= 1 examples
 * (each replica holds activations for ceil(max_batch / R) of them). NULL
 * with a message in err (may be NULL) on a bad argument or when memory or a
 * thread cannot be had; nothing is left running then. spec is copied. */
ps_replicas *ps_replicas_create(const ps_model_spec *spec, int R, int max_batch, char *err);

/* Replica i's backend (a new one each call: the replica owns it and
 * destroys it); NULL with a message in err. */
typedef ps_ops *(*ps_replica_backend_fn)(int i, void *user, char *err);

/* R replicas on backends from make. Replicas whose backend's memory is not
 * host memory keep parameters and gradient on it: each step copies the
 * caller's parameters in and its gradient out, and the gradients are summed
 * in host memory as on the cpu. */
ps_replicas *ps_replicas_create_with(const ps_model_spec *spec, int R, int max_batch,
                                     ps_replica_backend_fn make, void *user, char *err);

/* R replicas on the CUDA devices, replica i on device i % (devices
 * visible). With 1 < R <= devices (one replica per GPU) and NCCL built in,
 * replica 0's parameters are broadcast to the others with NCCL and the
 * weighted gradients summed onto replica 0 with an NCCL reduce, so only one
 * vector crosses to the host each way; otherwise (or when NCCL cannot set
 * up, which is logged) every replica copies in and out and the sum is in
 * host memory. NULL with a message without a device or without CUDA. */
ps_replicas *ps_replicas_create_cuda(const ps_model_spec *spec, int R, int max_batch, char *err);

/* Every replica's backend computes its convolutions and dense layers at p
 * (ps_ops.set_precision). 0, or an error code with a message. */
int ps_replicas_set_precision(ps_replicas *r, ps_precision p, char *err);

/* R replicas on the kind of backend named (a backend's ops->name): "cpu"
 * (ps_replicas_create), "cuda" (ps_replicas_create_cuda) or "emu" (the
 * emulated device of kernels/emu, one one-thread backend per replica). */
ps_replicas *ps_replicas_create_for(const ps_model_spec *spec, int R, int max_batch,
                                    const char *backend, char *err);

/* Whether the replicas compute on a device (their memory is not host
 * memory), and whether NCCL sums their gradients. */
int ps_replicas_on_device(const ps_replicas *r);
int ps_replicas_nccl(const ps_replicas *r);

/* Stops and joins the threads and frees everything. NULL is a no-op. */
void ps_replicas_destroy(ps_replicas *r);

/* The number of replicas. */
int ps_replicas_count(const ps_replicas *r);

/* The contract of ps_model_train_step: one training step on n examples
 * x (n, c*h*w) with labels y; grads (P floats, overwritten) receives the
 * gradient of the mean loss over the n examples; returns the mean loss;
 * *correct (may be NULL) receives the number of examples classified right.
 *
 * The batch is cut into R contiguous slices whose sizes differ by at most
 * one, the first n % R one larger (a replica with no examples does
 * nothing); replica r runs ps_model_train_step on its slice with dropout
 * stream step*R + r (deterministic, and distinct across replicas and
 * steps), and the result is sum_r (n_r/n) * grad_r, each thread summing a
 * contiguous 1/R of the P values. With R == 1 this is ps_model_train_step
 * itself, bit for bit. With R > 1 and no dropout the result equals R == 1's
 * up to the order of float summation; with dropout the masks differ.
 *
 * n == 0: grads are zeroed, *correct = 0, and 0 is returned. n < 0 or
 * n > max_batch: NAN is returned and grads are unaltered. */
float ps_replicas_train_step(ps_replicas *r, const float *params, const float *x, const uint8_t *y,
                             int n, uint64_t seed, uint64_t step, float *grads, int *correct);

#endif

/* The CUDA backend of kernels/ops.h, and the device memory helpers a caller
 * of it needs. Built only with WITH_CUDA (the library ps_kernels_cuda).
 *
 * Every pointer handed to an op of this backend is a DEVICE pointer
 * (activations, parameters, gradients, labels, masks, argmax), with the same
 * shapes and the same meaning as for the CPU backend. Ops are queued on the
 * backend's own stream and return before the device is done, except
 * softmax_xent_forward, which returns the loss and so waits for it. The
 * results are those of the CPU backend: bit for bit for relu, dropout (the
 * same mask from ps_rng_uniform), max pooling (the same int32 argmax, ties to
 * the first in row-major order), average pooling (the same sums in the same
 * order), the embedding ops and copy_cols (the same sums in the same order,
 * without atomics) and the softmax and logistic gradients given the same
 * probabilities; the logistic loss's probabilities and sum within 1e-6
 * (double arithmetic on both, the sum in a fixed tree); within
 * float rounding for the reductions (convolution, dense, softmax, loss),
 * which sum in another order (see the test for the tolerances); batch
 * normalization sums in double like the CPU (in a fixed tree rather than
 * in order), so its statistics and outputs agree to the last bit or two,
 * and it stays float32 at every set_precision. tests/unit/test_cuda_parity.c checks all of it.
 *
 * Convolution: the backend keeps its own workspace, so conv2d_workspace
 * answers 0 and the `work` argument is ignored (NULL is fine). It chooses the
 * cuDNN algorithms for the shape there (and on the first call with a new
 * shape otherwise), so calling it for every layer at start-up moves that
 * work out of the first step.
 *
 * Alignment: device buffers from ps_cuda_alloc (256-byte aligned) can be
 * used anywhere. Parameters and gradients may sit at any float offset of
 * one flat vector: a convolution whose weights are not 16-byte aligned
 * works on an aligned copy (one small device-to-device copy). Activations go
 * to cuDNN as they are: keep them 16-byte aligned (a ps_cuda_alloc'd buffer,
 * or an example offset into one when an example is a multiple of 4 floats).
 *
 * Max pooling: argmax may be NULL in maxpool_forward (evaluation); the
 * backward pass needs the argmax of its forward pass, from either backend.
 *
 * Errors: a failed CUDA, cuBLAS or cuDNN call inside an op prints the call,
 * file, line and error and aborts (see cuda_check.h); the ops have no error
 * return, and a half-done step must not be pushed. Creation and allocation
 * return errors the caller can act on.
 *
 * Memory members of the table (ops->alloc, free, to_device, to_host, copy,
 * sync; host_memory is 0): alloc is cudaMalloc on the backend's device,
 * zeroed before it returns, NULL when the device is out of memory (any other
 * failure aborts); free waits for the backend's stream first; the copies
 * are queued on the stream in order with the ops, like ps_cuda_memcpy_*
 * below (pageable host memory is fine; pinned memory from
 * ps_cuda_host_alloc makes them truly asynchronous); sync waits for the
 * stream. Code above the backend uses these and runs on either backend;
 * the ps_cuda_* helpers below remain for code that is CUDA-only.
 *
 * Copies beside compute (to_device_async, to_host_async, ticket_done,
 * ticket_wait): a second stream of the backend's, ordered against the
 * compute stream with events (an h2d is waited for by the ops queued after
 * it; a d2h waits for the ops queued before it); tickets are events from a
 * ring of 64, and a ticket whose event was recorded again since is waited
 * for through the later copy, which is never too short. sync and free wait
 * for both streams. scale is a kernel on the compute stream.
 *
 * Threads: as for the CPU backend, one op at a time per backend. Any thread
 * may call it: each op makes the backend's device current first. */
#ifndef PS_KERNELS_CUDA_OPS_CUDA_H
#define PS_KERNELS_CUDA_OPS_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../ops.h" /* C declarations, without a guard of their own */

/* The backend on CUDA device `device` (0-based): a stream, a cuDNN and a
 * cuBLAS handle of its own; `device` is also made current on the calling
 * thread. NULL on failure, with a message in err (NULL or PS_ERRLEN bytes):
 * no driver or device, a device index out of range, a handle that cannot be
 * created, out of memory. Nothing is left allocated then. Freed with
 * ops->destroy(ops), which waits for the backend's queued work first. */
ps_ops *ps_ops_cuda_create(int device, char *err);

/* The name of CUDA device `device` ("NVIDIA H100 80GB HBM3") into name
 * (len bytes, NUL-terminated, truncated if need be), and its memory in
 * bytes into *total_bytes (either may be NULL). 0, or PS_EINVAL (name ""
 * and 0 bytes) when there is no such device or no driver. */
int ps_cuda_device_name(int device, char *name, size_t len, size_t *total_bytes);

/* Makes the backend's device current on the calling thread, so that
 * ps_cuda_alloc and ps_cuda_host_alloc allocate there (a replica thread
 * calls this once before allocating its buffers). */
void ps_cuda_make_current(ps_ops *ops);

/* The backend's compute stream (a cudaStream_t), for libraries that queue
 * work in order with its ops (NCCL), and its device index. */
void *ps_cuda_stream(ps_ops *ops);
int ps_cuda_device_of(ps_ops *ops);

/* What the backend chose for a convolution shape it has planned (conv2d_workspace or a
 * first forward/backward): the cuDNN algorithm of each direction (forward, backward data,
 * backward filter), whether its descriptor's math type is FMA (float32 products, no TF32
 * tensor cores), and whether the choice is the first kind wanted (FMA and deterministic).
 * 0, or -1 when no plan for s exists. For tests: the intended choices are asserted, so a
 * silent fallback to TF32 or a non-deterministic algorithm shows. */
typedef struct {
  int algo[3];
  int fma[3];
  int tensor_op[3]; /* the math type lets tensor cores run (tf32, bf16) */
  int deterministic[3];
} ps_cuda_conv_info;
int ps_cuda_conv_choice(ps_ops *ops, const ps_conv_shape *s, ps_cuda_conv_info *out);

/* Device memory on the calling thread's current device. *p = NULL and 0
 * for bytes == 0; PS_ENOMEM (and *p = NULL) when the device is out of
 * memory, which leaves the device usable. Any other failure aborts. */
int ps_cuda_alloc(void **p, size_t bytes);
/* Frees what ps_cuda_alloc gave (NULL is fine). Waits for the device to
 * finish the work queued on it first, as cudaFree does. */
void ps_cuda_free(void *p);

/* Pinned (page-locked) host memory, usable by every device; copies from
 * and to it are truly asynchronous. PS_ENOMEM on failure, *p = NULL. */
int ps_cuda_host_alloc(void **p, size_t bytes);
void ps_cuda_host_free(void *p);

/* Copies queued on the backend's stream, in order with its ops: a copy to
 * the device is seen by the ops queued after it, a copy from the device sees
 * the ops queued before it. They return at once (for pageable host memory
 * the driver may wait); the host buffer must stay valid and, for h2d,
 * unchanged until ps_cuda_sync returns. Read the result of a d2h copy only
 * after ps_cuda_sync. */
void ps_cuda_memcpy_h2d(ps_ops *ops, void *dst_dev, const void *src_host, size_t bytes);
void ps_cuda_memcpy_d2h(ps_ops *ops, void *dst_host, const void *src_dev, size_t bytes);
void ps_cuda_memcpy_d2d(ps_ops *ops, void *dst_dev, const void *src_dev, size_t bytes);
/* Zeroes bytes of device memory, queued like the copies. */
void ps_cuda_memset_zero(ps_ops *ops, void *dst_dev, size_t bytes);
/* Waits until everything queued on the backend's stream is done. */
void ps_cuda_sync(ps_ops *ops);

#ifdef __cplusplus
}
#endif

#endif

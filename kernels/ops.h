/* The compute backend interface: one table of functions per device.
 *
 * Layouts: activations NCHW (N examples, C channels, H rows, W columns),
 * float32, contiguous. conv2d weights (OC, IC*KH*KW) in (ic, kh, kw) order,
 * dense weights (OUT, IN): y = x W^T + b. Backward functions overwrite
 * (never accumulate into) their outputs; a NULL dx means "not needed" (the
 * first layer). The cpu backend is the reference; the cuda backend has the
 * same signatures with device pointers and its own stream in ctx. */
#ifndef PS_KERNELS_OPS_H
#define PS_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  int n, c, h, w;     /* input */
  int oc, kh, kw;     /* filters and kernel size */
  int stride, pad;    /* same in both dimensions */
  int oh, ow;         /* output: (h + 2*pad - kh)/stride + 1 */
} ps_conv_shape;

typedef struct {
  int n, c, h, w; /* input */
  int size, stride;
  int oh, ow; /* (h - size)/stride + 1 */
} ps_pool_shape;

/* The marks of a step's phases (ps_ops.mark). */
enum {
  PS_MARK_BEGIN,    /* before the parameters are copied in */
  PS_MARK_H2D,      /* parameters (and batch) in */
  PS_MARK_FORWARD,  /* forward pass, loss */
  PS_MARK_BACKWARD, /* backward pass */
  PS_MARK_D2H,      /* gradients out */
  PS_MARKS
};

/* The arithmetic of convolutions and dense layers (ps_ops.set_precision). */
typedef enum {
  PS_PRECISION_FP32, /* float32 products and sums: the reference's results, within rounding */
  PS_PRECISION_TF32, /* tensor cores: each product's inputs rounded to 10 bits of mantissa */
  PS_PRECISION_BF16  /* inputs as bfloat16 (8 bits of mantissa), sums and outputs float32 */
} ps_precision;

/* "fp32", "tf32", "bf16"; parse: 0, or -1 for another name. */
const char *ps_precision_name(ps_precision p);
int ps_precision_parse(const char *name, ps_precision *out);

typedef struct ps_ops ps_ops;
struct ps_ops {
  const char *name; /* "cpu", "cuda" */
  void *ctx;        /* backend state (threads, handles, stream) */

  /* Scratch floats conv2d_forward/backward need for this shape. */
  size_t (*conv2d_workspace)(void *ctx, const ps_conv_shape *s);
  /* y (n, oc, oh, ow) = conv(x (n, c, h, w), w) + b */
  void (*conv2d_forward)(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                         const float *b, float *y, float *work);
  /* dw, db from x and dy; dx (may be NULL) from w and dy. */
  void (*conv2d_backward)(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                          const float *dy, float *dx, float *dw, float *db, float *work);

  /* y (n, c, oh, ow); argmax (same size) records the flat input index of
   * each maximum within its (n, c) plane. */
  void (*maxpool_forward)(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                          int32_t *argmax);
  void (*maxpool_backward)(void *ctx, const ps_pool_shape *s, const float *dy,
                           const int32_t *argmax, float *dx);

  /* y (n, c, oh, ow): the mean of each size x size window of x (no padding,
   * so every window has size*size taps), summed from 0 in row-major tap
   * order and divided by size*size. backward: dx zeroed, then each
   * window's dy / (size*size) added to its taps, windows in (oh, ow) order
   * (overlapping windows, stride < size, add into the same taps). */
  void (*avgpool_forward)(void *ctx, const ps_pool_shape *s, const float *x, float *y);
  void (*avgpool_backward)(void *ctx, const ps_pool_shape *s, const float *dy, float *dx);

  /* y (n, c): the mean of each (h, w) plane of x (n, c, h, w), summed from
   * 0 in row-major order and divided by h*w. backward: every value of
   * plane (n, c) of dx is dy (n, c) / (h*w). */
  void (*global_avgpool_forward)(void *ctx, int n, int c, int h, int w, const float *x, float *y);
  void (*global_avgpool_backward)(void *ctx, int n, int c, int h, int w, const float *dy,
                                  float *dx);

  /* Batch normalization of x (n, c, hw): channel k's statistics run over
   * its n*hw values (hw = h*w; 1 after dense). y must not be x.
   * forward_train: mean[k] and var[k] (biased: divided by m = n*hw) of
   * the batch, invstd[k] = 1 / sqrt(var[k] + eps), and
   * y = gamma[k] * (x - mean[k]) * invstd[k] + beta[k]. The host backends
   * sum in double, so their results agree to the last bit or two.
   * forward_infer: the same y from the given (moving) mean and var.
   * backward, from forward_train's x, mean and invstd: with
   * xhat = (x - mean) * invstd, dbeta[k] = sum dy, dgamma[k] = sum dy *
   * xhat, and (unless dx is NULL) dx = gamma * invstd * (dy - dbeta / m -
   * xhat * dgamma / m). */
  void (*batchnorm_forward_train)(void *ctx, int n, int c, int hw, float eps, const float *x,
                                  const float *gamma, const float *beta, float *y, float *mean,
                                  float *var, float *invstd);
  void (*batchnorm_forward_infer)(void *ctx, int n, int c, int hw, float eps, const float *x,
                                  const float *gamma, const float *beta, const float *mean,
                                  const float *var, float *y);
  void (*batchnorm_backward)(void *ctx, int n, int c, int hw, const float *x, const float *dy,
                             const float *gamma, const float *mean, const float *invstd,
                             float *dx, float *dgamma, float *dbeta);

  /* y (n, out) = x (n, in) W^T + b */
  void (*dense_forward)(void *ctx, int n, int in, int out, const float *x, const float *w,
                        const float *b, float *y);
  void (*dense_backward)(void *ctx, int n, int in, int out, const float *x, const float *w,
                         const float *dy, float *dx, float *dw, float *db);

  void (*relu_forward)(void *ctx, size_t n, const float *x, float *y);
  /* dx = dy where y > 0, else 0 (y is the forward output). */
  void (*relu_backward)(void *ctx, size_t n, const float *y, const float *dy, float *dx);

  /* y[i] = a[i] + b[i] for i < n (a residual connection's sum, and its
   * gradient summed over two consumers); y may be a or b. */
  void (*add)(void *ctx, size_t n, const float *a, const float *b, float *y);

  /* Inverted dropout: keep with probability 1-rate, scale kept by
   * 1/(1-rate). mask[i] = scale or 0, drawn from
   * ps_rng_uniform(seed, stream, i) so a step can be replayed. */
  void (*dropout_forward)(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                          const float *x, float *y, float *mask);
  /* A base the dropout streams start from, kept on the device: from now
   * on dropout_forward(stream) draws from stream base + stream, the base
   * read when the op runs, not when it is recorded (graph_begin), so that a
   * step recorded once replays with each step's own masks. Call it outside
   * a recording. NULL: dropout_forward's stream is used as given (and a
   * model with dropout is not recorded). */
  void (*set_rng_step)(void *ctx, uint64_t base);
  void (*dropout_backward)(void *ctx, size_t n, const float *mask, const float *dy, float *dx);

  /* probs (n, k) = softmax(logits); returns mean cross-entropy over the n
   * examples of labels (values in [0, k)). */
  float (*softmax_xent_forward)(void *ctx, int n, int k, const float *logits,
                                const uint8_t *labels, float *probs);
  /* dlogits = (probs - onehot(labels)) / n: gradient of the mean loss. */
  void (*softmax_xent_backward)(void *ctx, int n, int k, const float *probs,
                                const uint8_t *labels, float *dlogits);

  void (*destroy)(ps_ops *ops);

  /* ---- memory ----
   * Every pointer the ops above take is the backend's memory: host memory
   * on the cpu backend, device memory on cuda. Code above the backend
   * allocates, copies and waits through these members, never with
   * cudaMalloc or memcpy of its own, so it runs on either. Copies are in
   * order with the ops: a copy in is seen by the ops called after it, a
   * copy out sees the ops called before it. */

  /* bytes of backend memory, zeroed on return (bytes == 0 still gives a
   * valid pointer). NULL when the backend is out of memory. */
  void *(*alloc)(void *ctx, size_t bytes);
  /* Frees what alloc gave (NULL is fine), once the ops that may still
   * read or write it are done. */
  void (*free)(void *ctx, void *p);
  /* Host memory to backend memory. src_host must stay valid and unchanged
   * until sync returns (it may be read later than the call). */
  void (*to_device)(void *ctx, void *dst, const void *src_host, size_t bytes);
  /* Backend memory to host memory. dst_host holds the bytes once sync
   * returns (at once on the cpu backend). */
  void (*to_host)(void *ctx, void *dst_host, const void *src, size_t bytes);
  /* Backend memory to backend memory (no overlap, or dst == src). */
  void (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
  /* Waits until every op and copy called so far (on both queues, see
   * below) is done. */
  void (*sync)(void *ctx);
  /* 1 when the backend's memory is host memory (the cpu backend): host
   * buffers may then be handed to the ops as they are, without copies. */
  int host_memory;

  /* ---- copies beside compute ----
   * A second queue that carries copies while the ops compute (the cuda
   * backend's copy stream). On the cpu backend these are the plain copies
   * above, done on return (nothing when dst == src), and every ticket is
   * done at once.
   *
   * to_device_async: host to backend memory on the copy queue. The ops
   * called after it wait for this copy (and only for it), so it may run
   * while the ops called before it still compute: dst must be memory that
   * no op queued before it reads or writes. src_host must stay unchanged
   * until sync returns.
   * to_host_async: backend to host memory, of what the ops called before
   * it wrote, on the copy queue (the ops called after it do not wait for
   * it). Returns a ticket for ticket_done and ticket_wait (0: nothing
   * queued, always done). dst_host holds the bytes once the ticket is
   * done.
   * ticket_done: 1 when the ticket's copy has landed; never waits.
   * ticket_wait: waits until it has. */
  void (*to_device_async)(void *ctx, void *dst, const void *src_host, size_t bytes);
  uint64_t (*to_host_async)(void *ctx, void *dst_host, const void *src, size_t bytes);
  int (*ticket_done)(void *ctx, uint64_t ticket);
  void (*ticket_wait)(void *ctx, uint64_t ticket);

  /* x[i] *= alpha for i < n (backend memory), in order with the ops. */
  void (*scale)(void *ctx, size_t n, float alpha, float *x);

  /* softmax_xent_forward's probabilities, and what the step reports,
   * without waiting for the device: stats (backend memory, 2 doubles)
   * receives [0] the sum over the n examples of the cross-entropy (NaN if
   * a label is outside [0, k)), so that the mean is (float)(stats[0] / n)
   * exactly as softmax_xent_forward returns it, and [1] how many examples'
   * first largest probability is at their label. Read once, at the end of
   * a step, with the gradients. NULL: the model uses softmax_xent_forward
   * and counts on the host from the probabilities. */
  void (*softmax_xent_stats)(void *ctx, int n, int k, const float *logits, const uint8_t *labels,
                             float *probs, double *stats);

  /* Host memory the copy queue reads and writes at full speed: page-locked
   * on cuda (an asynchronous copy from other host memory waits for a
   * staging copy), plain aligned memory on the cpu backend; zeroed. For
   * batches, and for what is pulled and pushed. NULL when it cannot be had
   * (host_free(NULL) is fine). Any thread may call them. */
  void *(*host_alloc)(void *ctx, size_t bytes);
  void (*host_free)(void *ctx, void *p);

  /* Where a step's time goes on the backend's own clock: mark(i) records
   * the moment everything queued before it is done (a CUDA event on cuda;
   * the host clock on the cpu backend, whose ops are done on return);
   * marks_read, after a sync, writes ms[i] = milliseconds from mark
   * PS_MARK_BEGIN to mark i for i < n (negative for a mark not recorded
   * since the last read) and forgets them. NULL: not kept. */
  void (*mark)(void *ctx, int i);
  void (*marks_read)(void *ctx, double *ms, int n);

  /* The precision of the convolutions and dense layers from now on (the
   * element-wise ops, the loss and the optimizer stay float32; parameters
   * and gradients are float32 in and out). 0, or an error code with a
   * message in err when the backend or its device cannot (nothing changes
   * then). NULL: float32 only. */
  int (*set_precision)(void *ctx, ps_precision p, char *err);

  /* Replaying a step's ops (CUDA Graphs). graph_begin: the ops called next
   * are recorded, not run (copies and waits must stay outside); graph_end:
   * the recording becomes the backend's graph (replacing the one before);
   * graph_launch: runs it, with the pointers, shapes and scalars it was
   * recorded with (the memory's contents may differ), in order with the
   * ops. 0, or an error code: a recording that failed ran nothing, so the
   * caller runs the ops plainly. mark may be called while recording. NULL:
   * no graphs. */
  int (*graph_begin)(void *ctx);
  int (*graph_end)(void *ctx);
  int (*graph_launch)(void *ctx);

  /* ---- embedding (click-through-rate) models ----
   * A batch's ids for one field, de-duplicated on the host by
   * ps_emb_plan_build (kernels/emb_plan.h), give u unique rows, read as
   * rows (u, dim), and the int32 arrays of the plan: offsets (n+1, the
   * bags' CSR: bag e is positions [offsets[e], offsets[e+1]), offsets[0]
   * = 0, non-decreasing), idx (offsets[n]: each position's row, in [0,
   * u)), and the reverse CSR rev_off (u+1) and rev_ex (rev_off[u]: the
   * examples of each row's positions, in increasing position order). All
   * of them backend memory. Sums are float32, from 0.0f, in the order
   * stated, each product and each sum rounded on its own (no fused
   * multiply-add) and no atomics: every backend gives the same bits, every
   * run. Under mean pooling (mean nonzero) a bag of m > 0 positions is
   * scaled by s = 1.0f / (float)m (one rounded division), its sum times s
   * forward and each dy times s backward. NULL: the backend has no
   * embedding ops. */

  /* y (n, dim): row e = the sum over the bag's positions j, in increasing
   * j, of rows[idx[j]]; times s when mean. An empty bag gives zeros. */
  void (*embedding_bag_forward)(void *ctx, int n, int dim, const int32_t *offsets,
                                const int32_t *idx, int mean, const float *rows, float *y);
  /* drows (u, dim), overwritten: row r = the sum over k in [rev_off[r],
   * rev_off[r+1]), in increasing k, of dy[rev_ex[k]] (n, dim), each times
   * the s of example rev_ex[k]'s bag (from offsets) when mean. A row with
   * no entries gets zeros. */
  void (*embedding_bag_backward)(void *ctx, int n, int dim, const int32_t *offsets, int u,
                                 const int32_t *rev_off, const int32_t *rev_ex, int mean,
                                 const float *dy, float *drows);
  /* dst[i*dst_stride + c] = src[i*src_stride + c] for i < n, c < width:
   * columns of one matrix into columns of another (the concatenation of
   * features, and the split of its gradient). Strides >= width; src and
   * dst do not overlap. */
  void (*copy_cols)(void *ctx, int n, int width, const float *src, int src_stride, float *dst,
                    int dst_stride);
  /* The logistic loss of n logits x against labels y (0 or 1), without
   * waiting for the device: probs[i] = sigmoid(x) and the loss max(x, 0) -
   * x*y + log1p(exp(-|x|)), both computed in double from the float x (no
   * overflow, no log(0): finite for any finite x), probs rounded to float.
   * stats (backend memory, 2 doubles) receives [0] the sum of the n losses
   * (the host backends in example order; others in a fixed order, within
   * 1e-6 relative of it), so that the mean loss is stats[0] / n, and [1]
   * how many examples have (probs[i] >= 0.5f) == (y >= 0.5f). n = 0 gives
   * {0, 0}. A NaN logit gives a NaN loss. */
  void (*sigmoid_xent_forward)(void *ctx, int n, const float *logits, const float *labels,
                               float *probs, double *stats);
  /* dlogits[i] = (probs[i] - labels[i]) * (1.0f / (float)n), in float (two
   * roundings): the gradient of the mean loss. */
  void (*sigmoid_xent_backward)(void *ctx, int n, const float *probs, const float *labels,
                                float *dlogits);
  /* Factorization-machine interaction of f vectors of d values per
   * example (x: (n, f, d)), the bi-interaction pooling of NFM: y (n, d),
   * y[e][k] = 0.5 * (s^2 - q) with s = sum over j of x[e][j][k] and q the
   * sum of their squares, both summed in float in increasing j (the same
   * order on every backend). Its sum over k is the FM's pairwise term
   * sum_{i<j} <x_i, x_j>. */
  void (*fm_forward)(void *ctx, int n, int f, int d, const float *x, float *y);
  /* dx[e][j][k] = dy[e][k] * (s - x[e][j][k]), s as above. */
  void (*fm_backward)(void *ctx, int n, int f, int d, const float *x, const float *dy,
                      float *dx);
};

/* The CPU backend. threads > 0: the backend splits every op over that many
 * threads of its own (the caller and threads-1 workers) and sets OpenBLAS
 * to one thread for the whole process, so each part's sgemm runs in the
 * thread that calls it; results depend only on the inputs and the thread
 * count. threads == 0 leaves OpenBLAS's threading as it is. One backend is
 * used by one thread at a time. Element-wise ops may run in place; maxpool
 * picks the first maximum in row-major order; dropout keeps a value when
 * ps_rng_uniform(seed, stream, i) >= rate. Its memory is host memory
 * (host_memory = 1; alloc is ps_alloc, copies are memcpy, sync returns at
 * once). NULL when memory or a thread cannot be had. */
ps_ops *ps_ops_cpu_create(int threads);

/* The softmax and cross-entropy of the host backends (cpu, dnnl), so that
 * they agree bit for bit: probs = softmax(logits) per row, the returned sum
 * of the n losses (NaN when a label is outside [0, k)); the examples whose
 * first largest probability is at the label; dlogits = (probs -
 * onehot(labels)) / n. */
double ps_xent_host_forward(int n, int k, const float *logits, const uint8_t *labels,
                            float *probs);
int ps_xent_host_correct(int n, int k, const float *probs, const uint8_t *labels);
void ps_xent_host_backward(int n, int k, const float *probs, const uint8_t *labels,
                           float *dlogits);

/* Batch normalization on the host (the cpu and dnnl backends): the ops'
 * arithmetic (see batchnorm_forward_train) over the channel blocks
 * [kb0, kb1) of an activation held with channel blocks of blk (1: NCHW;
 * 8, 16: (n, c/blk, hw, blk)); blk divides c, blk <= 16. y is computed in
 * float as (x - mean) * (gamma * invstd) + beta. */
void ps_bn_host_train(int n, int c, int hw, int blk, int kb0, int kb1, float eps, const float *x,
                      const float *gamma, const float *beta, float *y, float *mean, float *var,
                      float *invstd);
void ps_bn_host_infer(int n, int c, int hw, int blk, int kb0, int kb1, float eps, const float *x,
                      const float *gamma, const float *beta, const float *mean, const float *var,
                      float *y);
void ps_bn_host_backward(int n, int c, int hw, int blk, int kb0, int kb1, const float *x,
                         const float *dy, const float *gamma, const float *mean,
                         const float *invstd, float *dx, float *dgamma, float *dbeta);

/* The embedding and logistic-loss ops on the host (the cpu and dnnl
 * backends, each splitting them over its threads), with the arithmetic of
 * the ops above, so that the host backends agree bit for bit.
 * bag_forward: rows e0 <= e < e1 of embedding_bag_forward's y;
 * bag_backward: rows r0 <= r < r1 of embedding_bag_backward's drows;
 * sigmoid_xent_forward: probs, and stats[0], stats[1] as the op's (host
 * memory); sigmoid_xent_backward: the op's dlogits. */
void ps_emb_host_bag_forward(int dim, const int32_t *offsets, const int32_t *idx, int mean,
                             const float *rows, float *y, int e0, int e1);
void ps_emb_host_bag_backward(int dim, const int32_t *offsets, const int32_t *rev_off,
                              const int32_t *rev_ex, int mean, const float *dy, float *drows,
                              int r0, int r1);
void ps_sigmoid_xent_host_forward(int n, const float *logits, const float *labels, float *probs,
                                  double *stats);
void ps_sigmoid_xent_host_backward(int n, const float *probs, const float *labels, float *dlogits);
/* fm_forward and fm_backward on the examples [e0, e1). */
void ps_fm_host_forward(int f, int d, const float *x, float *y, int e0, int e1);
void ps_fm_host_backward(int f, int d, const float *x, const float *dy, float *dx, int e0, int e1);

/* Fills conv output size from the other fields. */
void ps_conv_shape_finish(ps_conv_shape *s);
void ps_pool_shape_finish(ps_pool_shape *s);

#endif

/* The CPU backend: the reference implementation of kernels/ops.h.
 *
 * Convolution is im2col + one OpenBLAS sgemm over a whole chunk of the
 * batch, dense layers are one sgemm each, and everything else is a plain
 * loop. The big sgemm calls are where the time goes; the loops around them
 * are arranged to pass over memory as few times as possible. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rng.h"
#include "../ops.h"

/* Upper bound on the scratch floats one convolution chunk uses. A batch
 * whose columns would need more is processed a chunk of examples at a time,
 * so the workspace stays bounded for any batch size, while the quickstart
 * CNN at batch 64 (4.4M floats for its second conv) still runs as one sgemm
 * per pass. */
#ifndef CONV_CHUNK_FLOATS
#define CONV_CHUNK_FLOATS ((size_t)256 << 10)
#endif

typedef struct {
  ps_ops ops; /* ops.ctx points back at this struct */
  int threads;
} cpu_backend;

/* ---- loops over float arrays ----
 *
 * These work in blocks of BLOCK floats copied into a local array,
 * transformed there and copied back. GCC at -O2 vectorizes only loops that
 * need no runtime checks (for aliasing, for the trip count), and a block
 * like this needs none; written as plain loops they stay scalar, and the
 * max/select ones compile to a branch per element that the random signs of
 * activations mispredict half the time (6x slower, measured). Working on a
 * local copy also keeps them correct when the output is the input. */
enum { BLOCK = 8 };

/* dst[i] = src[i] + bias */
static void add_scalar(float *dst, const float *src, size_t n, float bias) {
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK];
    memcpy(v, src + i, sizeof v);
    for (int k = 0; k < BLOCK; k++) v[k] += bias;
    memcpy(dst + i, v, sizeof v);
  }
  for (; i < n; i++) dst[i] = src[i] + bias;
}

/* dst[i] += src[i] */
static void add_into(float *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK], d[BLOCK];
    memcpy(v, src + i, sizeof v);
    memcpy(d, dst + i, sizeof d);
    for (int k = 0; k < BLOCK; k++) d[k] += v[k];
    memcpy(dst + i, d, sizeof d);
  }
  for (; i < n; i++) dst[i] += src[i];
}

/* The sum of a[0..n), in BLOCK partial sums so the adds do not wait on
 * each other. */
static float sum_floats(const float *a, size_t n) {
  float part[BLOCK] = {0};
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK];
    memcpy(v, a + i, sizeof v);
    for (int k = 0; k < BLOCK; k++) part[k] += v[k];
  }
  float sum = 0.0f;
  for (int k = 0; k < BLOCK; k++) sum += part[k];
  for (; i < n; i++) sum += a[i];
  return sum;
}

/* ---- convolution ---- */

/* Rows of the column matrix: one per (ic, kh, kw), the weights' order. */
static size_t conv_rows(const ps_conv_shape *s) { return (size_t)s->c * s->kh * s->kw; }

static size_t conv_out_plane(const ps_conv_shape *s) { return (size_t)s->oh * s->ow; }

/* Examples per chunk: all of them when their columns fit under
 * CONV_CHUNK_FLOATS, else as many as fit (at least one). */
static int conv_chunk(const ps_conv_shape *s) {
  size_t per_example = (conv_rows(s) + (size_t)s->oc) * conv_out_plane(s);
  size_t fit = per_example ? CONV_CHUNK_FLOATS / per_example : (size_t)s->n;
  if (fit < 1) fit = 1;
  return fit < (size_t)s->n ? (int)fit : s->n;
}

/* For kernel offset k, the outputs o in [*lo, *hi) whose input position
 * o*stride - pad + k lies inside [0, in); the others read padding. */
static void conv_valid_range(int in, int out, int k, int stride, int pad, int *lo, int *hi) {
  int first = pad - k; /* o*stride must reach this for the position to be >= 0 */
  int last = in - 1 + pad - k;
  *lo = first > 0 ? (first + stride - 1) / stride : 0;
  *hi = last >= 0 ? last / stride + 1 : 0;
  if (*hi > out) *hi = out;
  if (*lo > *hi) *lo = *hi;
}

/* col (C*KH*KW, m*OH*OW) from x (m, C, H, W): column i*OH*OW + oh*OW + ow
 * holds the input patch under output pixel (oh, ow) of example i, with
 * zeros where the patch hangs over the padding. Example-major outer loops
 * keep each input plane in L1 while its KH*KW rows are written. */
static void im2col(const ps_conv_shape *s, int m, const float *x, float *col) {
  const int stride = s->stride, pad = s->pad, ow_n = s->ow;
  const size_t plane = (size_t)s->h * s->w, ohw = conv_out_plane(s);
  const size_t ld = (size_t)m * ohw; /* row stride of col */
  for (int i = 0; i < m; i++) {
    for (int c = 0; c < s->c; c++) {
      const float *xp = x + ((size_t)i * s->c + c) * plane; /* (H, W) */
      for (int kh = 0; kh < s->kh; kh++) {
        int oh_lo, oh_hi;
        conv_valid_range(s->h, s->oh, kh, stride, pad, &oh_lo, &oh_hi);
        for (int kw = 0; kw < s->kw; kw++) {
          int ow_lo, ow_hi;
          conv_valid_range(s->w, ow_n, kw, stride, pad, &ow_lo, &ow_hi);
          size_t row = ((size_t)c * s->kh + kh) * s->kw + kw;
          float *dst = col + row * ld + (size_t)i * ohw; /* (OH, OW) */
          for (int oh = 0; oh < s->oh; oh++) {
            float *d = dst + (size_t)oh * ow_n;
            if (oh < oh_lo || oh >= oh_hi) {
              memset(d, 0, (size_t)ow_n * sizeof(float));
              continue;
            }
            const float *src = xp + (size_t)(oh * stride - pad + kh) * s->w - pad + kw;
            for (int ow = 0; ow < ow_lo; ow++) d[ow] = 0.0f;
            if (stride == 1) {
              memcpy(d + ow_lo, src + ow_lo, (size_t)(ow_hi - ow_lo) * sizeof(float));
            } else {
              for (int ow = ow_lo; ow < ow_hi; ow++) d[ow] = src[(size_t)ow * stride];
            }
            for (int ow = ow_hi; ow < ow_n; ow++) d[ow] = 0.0f;
          }
        }
      }
    }
  }
}

/* dx (m, C, H, W) = the sum, over the column entries that im2col copied from
 * each input position, of dcol (C*KH*KW, m*OH*OW); entries that came from
 * padding are dropped. dx is overwritten. */
static void col2im(const ps_conv_shape *s, int m, const float *dcol, float *dx) {
  const int stride = s->stride, pad = s->pad, ow_n = s->ow;
  const size_t plane = (size_t)s->h * s->w, ohw = conv_out_plane(s);
  const size_t ld = (size_t)m * ohw;
  memset(dx, 0, (size_t)m * s->c * plane * sizeof(float));
  for (int i = 0; i < m; i++) {
    for (int c = 0; c < s->c; c++) {
      float *dxp = dx + ((size_t)i * s->c + c) * plane; /* (H, W) */
      for (int kh = 0; kh < s->kh; kh++) {
        int oh_lo, oh_hi;
        conv_valid_range(s->h, s->oh, kh, stride, pad, &oh_lo, &oh_hi);
        for (int kw = 0; kw < s->kw; kw++) {
          int ow_lo, ow_hi;
          conv_valid_range(s->w, ow_n, kw, stride, pad, &ow_lo, &ow_hi);
          size_t row = ((size_t)c * s->kh + kh) * s->kw + kw;
          const float *src = dcol + row * ld + (size_t)i * ohw; /* (OH, OW) */
          for (int oh = oh_lo; oh < oh_hi; oh++) {
            const float *d = src + (size_t)oh * ow_n;
            float *dst = dxp + (size_t)(oh * stride - pad + kh) * s->w - pad + kw;
            if (stride == 1) {
              add_into(dst + ow_lo, d + ow_lo, (size_t)(ow_hi - ow_lo));
            } else {
              for (int ow = ow_lo; ow < ow_hi; ow++) dst[(size_t)ow * stride] += d[ow];
            }
          }
        }
      }
    }
  }
}

/* Forward and backward both need the columns and one (OC, m*OH*OW) matrix
 * per chunk; the backward's column gradient reuses the columns' space. */
static size_t cpu_conv2d_workspace(void *ctx, const ps_conv_shape *s) {
  (void)ctx;
  return (size_t)conv_chunk(s) * (conv_rows(s) + (size_t)s->oc) * conv_out_plane(s);
}

static void cpu_conv2d_forward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                               const float *b, float *y, float *work) {
  (void)ctx;
  const int nb = conv_chunk(s);
  const size_t rows = conv_rows(s), ohw = conv_out_plane(s);
  const size_t in_example = (size_t)s->c * s->h * s->w, out_example = (size_t)s->oc * ohw;
  for (int n0 = 0; n0 < s->n; n0 += nb) {
    const int m = s->n - n0 < nb ? s->n - n0 : nb;
    const size_t ld = (size_t)m * ohw;
    float *col = work;             /* (C*KH*KW, m*OH*OW) */
    float *out = work + rows * ld; /* (OC, m*OH*OW) */
    im2col(s, m, x + n0 * in_example, col);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s->oc, (int)ld, (int)rows, 1.0f, w,
                (int)rows, col, (int)ld, 0.0f, out, (int)ld);
    /* out is channel-major over the chunk; y wants example-major. The bias
     * is added in this one copy instead of in a pass of its own. */
    for (int i = 0; i < m; i++) {
      float *yi = y + (size_t)(n0 + i) * out_example; /* (OC, OH*OW) */
      for (int oc = 0; oc < s->oc; oc++) {
        add_scalar(yi + oc * ohw, out + oc * ld + i * ohw, ohw, b[oc]);
      }
    }
  }
}

static void cpu_conv2d_backward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                                const float *dy, float *dx, float *dw, float *db, float *work) {
  (void)ctx;
  const int nb = conv_chunk(s);
  const size_t rows = conv_rows(s), ohw = conv_out_plane(s);
  const size_t in_example = (size_t)s->c * s->h * s->w, out_example = (size_t)s->oc * ohw;
  memset(db, 0, (size_t)s->oc * sizeof(float));
  if (s->n == 0) memset(dw, 0, (size_t)s->oc * rows * sizeof(float));
  for (int n0 = 0; n0 < s->n; n0 += nb) {
    const int m = s->n - n0 < nb ? s->n - n0 : nb;
    const size_t ld = (size_t)m * ohw;
    float *col = work;             /* (C*KH*KW, m*OH*OW); later dcol */
    float *dyt = work + rows * ld; /* (OC, m*OH*OW) */
    /* The forward's columns are not kept (work is shared scratch), so they
     * are rebuilt; that is one cheap pass next to the two sgemms. */
    im2col(s, m, x + n0 * in_example, col);
    /* dy channel-major, so dW is one sgemm over every column of the chunk;
     * db is summed in the same pass. */
    for (int i = 0; i < m; i++) {
      const float *dyi = dy + (size_t)(n0 + i) * out_example; /* (OC, OH*OW) */
      for (int oc = 0; oc < s->oc; oc++) {
        const float *src = dyi + oc * ohw;
        memcpy(dyt + oc * ld + i * ohw, src, ohw * sizeof(float));
        db[oc] += sum_floats(src, ohw);
      }
    }
    /* dW (OC, C*KH*KW) (+)= dyt (OC, m*OH*OW) col^T; the first chunk
     * overwrites, later chunks accumulate. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s->oc, (int)rows, (int)ld, 1.0f, dyt,
                (int)ld, col, (int)ld, n0 == 0 ? 0.0f : 1.0f, dw, (int)rows);
    if (dx) {
      /* dcol (C*KH*KW, m*OH*OW) = W^T dyt, written over the columns, which
       * are no longer needed. */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)rows, (int)ld, s->oc, 1.0f, w,
                  (int)rows, dyt, (int)ld, 0.0f, col, (int)ld);
      col2im(s, m, col, dx + n0 * in_example);
    }
  }
}

/* ---- max pooling ---- */

static void cpu_maxpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                                int32_t *argmax) {
  (void)ctx;
  const size_t in_plane = (size_t)s->h * s->w, out_plane = (size_t)s->oh * s->ow;
  const size_t planes = (size_t)s->n * s->c;
  for (size_t p = 0; p < planes; p++) {
    const float *xp = x + p * in_plane; /* (H, W) */
    float *yp = y + p * out_plane;      /* (OH, OW) */
    int32_t *ap = argmax + p * out_plane;
    for (int oh = 0; oh < s->oh; oh++) {
      for (int ow = 0; ow < s->ow; ow++) {
        /* Ties keep the first in row-major order. Selects, not an if:
         * after a relu, which input wins is a coin toss for the branch
         * predictor. */
        int best = oh * s->stride * s->w + ow * s->stride;
        float best_v = xp[best];
        for (int kh = 0; kh < s->size; kh++) {
          const int row = (oh * s->stride + kh) * s->w + ow * s->stride;
          for (int kw = 0; kw < s->size; kw++) {
            float v = xp[row + kw];
            int better = v > best_v;
            best = better ? row + kw : best;
            best_v = better ? v : best_v;
          }
        }
        yp[oh * s->ow + ow] = best_v;
        ap[oh * s->ow + ow] = best;
      }
    }
  }
}

/* Overlapping windows (stride < size) can pick the same input, so the
 * gradient is accumulated into a zeroed dx rather than assigned. */
static void cpu_maxpool_backward(void *ctx, const ps_pool_shape *s, const float *dy,
                                 const int32_t *argmax, float *dx) {
  (void)ctx;
  const size_t in_plane = (size_t)s->h * s->w, out_plane = (size_t)s->oh * s->ow;
  const size_t planes = (size_t)s->n * s->c;
  memset(dx, 0, planes * in_plane * sizeof(float));
  for (size_t p = 0; p < planes; p++) {
    float *dxp = dx + p * in_plane;
    const float *dyp = dy + p * out_plane;
    const int32_t *ap = argmax + p * out_plane;
    for (size_t o = 0; o < out_plane; o++) dxp[ap[o]] += dyp[o];
  }
}

/* ---- dense ---- */

static void cpu_dense_forward(void *ctx, int n, int in, int out, const float *x, const float *w,
                              const float *b, float *y) {
  (void)ctx;
  if (n == 0 || out == 0) return;
  for (int i = 0; i < n; i++) memcpy(y + (size_t)i * out, b, (size_t)out * sizeof(float));
  if (in == 0) return;
  /* y (n, out) += x (n, in) W^T, W (out, in) */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 1.0f, y,
              out);
}

static void cpu_dense_backward(void *ctx, int n, int in, int out, const float *x, const float *w,
                               const float *dy, float *dx, float *dw, float *db) {
  (void)ctx;
  memset(db, 0, (size_t)out * sizeof(float));
  if (n == 0 || in == 0 || out == 0) {
    memset(dw, 0, (size_t)out * in * sizeof(float));
    if (dx) memset(dx, 0, (size_t)n * in * sizeof(float));
    return;
  }
  for (int i = 0; i < n; i++) {
    const float *dyi = dy + (size_t)i * out;
    for (int j = 0; j < out; j++) db[j] += dyi[j];
  }
  /* dW (out, in) = dy^T (out, n) x (n, in) */
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.0f, dy, out, x, in, 0.0f, dw,
              in);
  /* dx (n, in) = dy (n, out) W (out, in) */
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.0f, dy, out, w, in, 0.0f,
                dx, in);
}

/* ---- elementwise ---- */

/* In blocks, see add_scalar; y may be x. */
static void cpu_relu_forward(void *ctx, size_t n, const float *x, float *y) {
  (void)ctx;
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK];
    memcpy(v, x + i, sizeof v);
    for (int k = 0; k < BLOCK; k++) v[k] = v[k] > 0.0f ? v[k] : 0.0f;
    memcpy(y + i, v, sizeof v);
  }
  for (; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

/* In blocks, see add_scalar; dx may be dy. */
static void cpu_relu_backward(void *ctx, size_t n, const float *y, const float *dy, float *dx) {
  (void)ctx;
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float v[BLOCK], g[BLOCK];
    memcpy(v, y + i, sizeof v);
    memcpy(g, dy + i, sizeof g);
    for (int k = 0; k < BLOCK; k++) g[k] = v[k] > 0.0f ? g[k] : 0.0f;
    memcpy(dx + i, g, sizeof g);
  }
  for (; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* A rate >= 1 drops everything (no infinite scale); a rate <= 0 keeps
 * everything with scale 1. */
static void cpu_dropout_forward(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                                const float *x, float *y, float *mask) {
  (void)ctx;
  const float scale = rate >= 1.0f ? 0.0f : rate <= 0.0f ? 1.0f : 1.0f / (1.0f - rate);
  for (size_t i = 0; i < n; i++) {
    mask[i] = ps_rng_uniform(seed, stream, i) >= rate ? scale : 0.0f;
    y[i] = x[i] * mask[i];
  }
}

static void cpu_dropout_backward(void *ctx, size_t n, const float *mask, const float *dy,
                                 float *dx) {
  (void)ctx;
  size_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    float m[BLOCK], g[BLOCK];
    memcpy(m, mask + i, sizeof m);
    memcpy(g, dy + i, sizeof g);
    for (int k = 0; k < BLOCK; k++) g[k] *= m[k];
    memcpy(dx + i, g, sizeof g);
  }
  for (; i < n; i++) dx[i] = dy[i] * mask[i];
}

/* ---- softmax + cross-entropy ---- */

/* Each row is shifted by its maximum before exp, so large logits cannot
 * overflow, and the loss is taken from the log-sum-exp rather than from
 * log(prob), which would be -inf for a probability that underflowed. A
 * label outside [0, k) makes the returned loss NaN instead of reading out of
 * bounds. */
static float cpu_softmax_xent_forward(void *ctx, int n, int k, const float *logits,
                                      const uint8_t *labels, float *probs) {
  (void)ctx;
  if (n == 0) return 0.0f;
  double total = 0.0;
  int bad_label = 0;
  for (int i = 0; i < n; i++) {
    const float *l = logits + (size_t)i * k; /* (k) */
    float *p = probs + (size_t)i * k;
    float max = l[0];
    for (int j = 1; j < k; j++) max = l[j] > max ? l[j] : max;
    double sum = 0.0;
    for (int j = 0; j < k; j++) {
      p[j] = expf(l[j] - max);
      sum += p[j];
    }
    const float inv = (float)(1.0 / sum);
    for (int j = 0; j < k; j++) p[j] *= inv;
    if (labels[i] >= k) {
      bad_label = 1;
      continue;
    }
    total += log(sum) - (double)(l[labels[i]] - max);
  }
  return bad_label ? NAN : (float)(total / n);
}

static void cpu_softmax_xent_backward(void *ctx, int n, int k, const float *probs,
                                      const uint8_t *labels, float *dlogits) {
  (void)ctx;
  const float inv_n = n ? 1.0f / (float)n : 0.0f;
  for (int i = 0; i < n; i++) {
    const float *p = probs + (size_t)i * k;
    float *d = dlogits + (size_t)i * k;
    for (int j = 0; j < k; j++) d[j] = p[j] * inv_n;
    if (labels[i] < k) d[labels[i]] -= inv_n;
  }
}

/* ---- the table ---- */

static void cpu_destroy(ps_ops *ops) { free(ops ? ops->ctx : NULL); }

/* threads > 0 sets OpenBLAS's thread count, which is process-wide: the last
 * backend created decides it for all of them. */
ps_ops *ps_ops_cpu_create(int threads) {
  cpu_backend *be = calloc(1, sizeof *be);
  if (!be) return NULL;
  be->threads = threads;
  if (threads > 0) openblas_set_num_threads(threads);
  be->ops = (ps_ops){
      .name = "cpu",
      .ctx = be,
      .conv2d_workspace = cpu_conv2d_workspace,
      .conv2d_forward = cpu_conv2d_forward,
      .conv2d_backward = cpu_conv2d_backward,
      .maxpool_forward = cpu_maxpool_forward,
      .maxpool_backward = cpu_maxpool_backward,
      .dense_forward = cpu_dense_forward,
      .dense_backward = cpu_dense_backward,
      .relu_forward = cpu_relu_forward,
      .relu_backward = cpu_relu_backward,
      .dropout_forward = cpu_dropout_forward,
      .dropout_backward = cpu_dropout_backward,
      .softmax_xent_forward = cpu_softmax_xent_forward,
      .softmax_xent_backward = cpu_softmax_xent_backward,
      .destroy = cpu_destroy,
  };
  return &be->ops;
}

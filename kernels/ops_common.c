/* Shape helpers and names shared by every backend. */
#include "ops.h"

#include <math.h>
#include <string.h>

static const char *const PRECISION_NAMES[] = {
    [PS_PRECISION_FP32] = "fp32", [PS_PRECISION_TF32] = "tf32", [PS_PRECISION_BF16] = "bf16"};

const char *ps_precision_name(ps_precision p) {
  return p >= PS_PRECISION_FP32 && p <= PS_PRECISION_BF16 ? PRECISION_NAMES[p] : "unknown";
}

int ps_precision_parse(const char *name, ps_precision *out) {
  for (int p = PS_PRECISION_FP32; name && p <= PS_PRECISION_BF16; p++)
    if (strcmp(name, PRECISION_NAMES[p]) == 0) {
      *out = (ps_precision)p;
      return 0;
    }
  return -1;
}

/* Number of output positions of a window of `size` moved by `stride` over
 * `in` positions (padding already included in `in`); 0 where the window
 * does not fit or the stride is not positive. Integer division in C
 * truncates toward zero, so (in - size) / stride + 1 alone would give 1
 * instead of 0 for a window one wider than the input. */
static int window_count(int in, int size, int stride) {
  if (stride < 1 || size < 1 || in < size) return 0;
  return (in - size) / stride + 1;
}

/* Fills oh, ow from the other fields. A shape whose kernel does not fit
 * (or whose stride is < 1) gets oh = ow = 0, which callers reject. */
void ps_conv_shape_finish(ps_conv_shape *s) {
  s->oh = window_count(s->h + 2 * s->pad, s->kh, s->stride);
  s->ow = window_count(s->w + 2 * s->pad, s->kw, s->stride);
}

/* Fills oh, ow from the other fields; 0 where the window does not fit. */
void ps_pool_shape_finish(ps_pool_shape *s) {
  s->oh = window_count(s->h, s->size, s->stride);
  s->ow = window_count(s->w, s->size, s->stride);
}

/* ---- softmax + cross-entropy on the host (the cpu backends') ---- */

/* Each row is shifted by its maximum before exp, so large logits cannot
 * overflow, and the loss is taken from the log-sum-exp rather than from
 * log(prob), which would be -inf for a probability that underflowed. A
 * label outside [0, k) makes the sum NaN instead of reading out of bounds. */
double ps_xent_host_forward(int n, int k, const float *logits, const uint8_t *labels,
                            float *probs) {
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
  return bad_label ? NAN : total;
}

int ps_xent_host_correct(int n, int k, const float *probs, const uint8_t *labels) {
  int correct = 0;
  for (int i = 0; k > 0 && i < n; i++) {
    const float *p = probs + (size_t)i * k;
    int best = 0;
    for (int j = 1; j < k; j++)
      if (p[j] > p[best]) best = j;
    correct += best == labels[i];
  }
  return correct;
}

void ps_xent_host_backward(int n, int k, const float *probs, const uint8_t *labels,
                           float *dlogits) {
  const float inv_n = n ? 1.0f / (float)n : 0.0f;
  for (int i = 0; i < n; i++) {
    const float *p = probs + (size_t)i * k;
    float *d = dlogits + (size_t)i * k;
    for (int j = 0; j < k; j++) d[j] = p[j] * inv_n;
    if (labels[i] < k) d[labels[i]] -= inv_n;
  }
}

/* ---- batch normalization on the host ----
 *
 * Element (i, channel kb*blk + l, j) of an activation held with channel
 * blocks of blk sits at ((i * (c/blk) + kb) * hw + j) * blk + l (blk 1:
 * NCHW). Each block of channels is one pass over its values, and every
 * channel's sums run over i, then j, in double, whatever the block: the
 * cpu and dnnl backends agree bit for bit. */

#define BN_MAX_BLK 16

/* The bodies are inlined with blk a constant for the common blocks (1, 8,
 * 16; ps_bn_host_* below): the per-channel sums then stay in registers and
 * the lanes of a block vectorize, about 3x faster for NCHW than a loop of
 * unknown length over sums in memory. The same operations in the same
 * order either way (no reassociation), so the same bits. */
#define BN_INLINE static inline __attribute__((always_inline))

static size_t bn_at(int c, int hw, int blk, int i, int kb) {
  return ((size_t)i * (size_t)(c / blk) + (size_t)kb) * (size_t)hw * (size_t)blk;
}

BN_INLINE void bn_train(int n, int c, int hw, int blk, int kb0, int kb1, float eps, const float *x,
                        const float *gamma, const float *beta, float *y, float *mean, float *var,
                        float *invstd) {
  const double m = (double)n * hw;
  for (int kb = kb0; kb < kb1; kb++) {
    double sum[BN_MAX_BLK] = {0}, sq[BN_MAX_BLK] = {0}, mu[BN_MAX_BLK];
    for (int i = 0; i < n; i++) {
      const float *xp = x + bn_at(c, hw, blk, i, kb);
      for (size_t j = 0; j < (size_t)hw; j++)
        for (int l = 0; l < blk; l++) sum[l] += xp[j * blk + l];
    }
    for (int l = 0; l < blk; l++) mu[l] = m > 0 ? sum[l] / m : 0.0;
    for (int i = 0; i < n; i++) {
      const float *xp = x + bn_at(c, hw, blk, i, kb);
      for (size_t j = 0; j < (size_t)hw; j++)
        for (int l = 0; l < blk; l++) {
          const double d = xp[j * blk + l] - mu[l];
          sq[l] += d * d;
        }
    }
    float mf[BN_MAX_BLK], scale[BN_MAX_BLK], shift[BN_MAX_BLK];
    for (int l = 0; l < blk; l++) {
      const int k = kb * blk + l;
      const double v = m > 0 ? sq[l] / m : 0.0;
      mean[k] = mf[l] = (float)mu[l];
      var[k] = (float)v;
      invstd[k] = (float)(1.0 / sqrt(v + (double)eps));
      scale[l] = gamma[k] * invstd[k];
      shift[l] = beta[k];
    }
    for (int i = 0; i < n; i++) {
      const size_t at = bn_at(c, hw, blk, i, kb);
      for (size_t j = 0; j < (size_t)hw; j++)
        for (int l = 0; l < blk; l++)
          y[at + j * blk + l] = (x[at + j * blk + l] - mf[l]) * scale[l] + shift[l];
    }
  }
}

BN_INLINE void bn_infer(int n, int c, int hw, int blk, int kb0, int kb1, float eps, const float *x,
                        const float *gamma, const float *beta, const float *mean, const float *var,
                        float *y) {
  for (int kb = kb0; kb < kb1; kb++) {
    float mf[BN_MAX_BLK], scale[BN_MAX_BLK], shift[BN_MAX_BLK];
    for (int l = 0; l < blk; l++) {
      const int k = kb * blk + l;
      mf[l] = mean[k];
      scale[l] = gamma[k] * (float)(1.0 / sqrt((double)var[k] + (double)eps));
      shift[l] = beta[k];
    }
    for (int i = 0; i < n; i++) {
      const size_t at = bn_at(c, hw, blk, i, kb);
      for (size_t j = 0; j < (size_t)hw; j++)
        for (int l = 0; l < blk; l++)
          y[at + j * blk + l] = (x[at + j * blk + l] - mf[l]) * scale[l] + shift[l];
    }
  }
}

BN_INLINE void bn_backward(int n, int c, int hw, int blk, int kb0, int kb1, const float *x,
                           const float *dy, const float *gamma, const float *mean,
                           const float *invstd, float *dx, float *dgamma, float *dbeta) {
  const double m = (double)n * hw;
  for (int kb = kb0; kb < kb1; kb++) {
    double sd[BN_MAX_BLK] = {0}, sdx[BN_MAX_BLK] = {0};
    float mf[BN_MAX_BLK], is[BN_MAX_BLK];
    for (int l = 0; l < blk; l++) {
      mf[l] = mean[kb * blk + l];
      is[l] = invstd[kb * blk + l];
    }
    for (int i = 0; i < n; i++) {
      const size_t at = bn_at(c, hw, blk, i, kb);
      for (size_t j = 0; j < (size_t)hw; j++)
        for (int l = 0; l < blk; l++) {
          const double g = dy[at + j * blk + l];
          sd[l] += g;
          sdx[l] += g * (double)((x[at + j * blk + l] - mf[l]) * is[l]);
        }
    }
    float a[BN_MAX_BLK], b[BN_MAX_BLK], q[BN_MAX_BLK];
    for (int l = 0; l < blk; l++) {
      const int k = kb * blk + l;
      dbeta[k] = (float)sd[l];
      dgamma[k] = (float)sdx[l];
      a[l] = gamma[k] * is[l];
      b[l] = m > 0 ? (float)(sd[l] / m) : 0.0f;
      q[l] = m > 0 ? (float)(sdx[l] / m) : 0.0f;
    }
    if (!dx) continue;
    for (int i = 0; i < n; i++) {
      const size_t at = bn_at(c, hw, blk, i, kb);
      for (size_t j = 0; j < (size_t)hw; j++)
        for (int l = 0; l < blk; l++) {
          const float xh = (x[at + j * blk + l] - mf[l]) * is[l];
          dx[at + j * blk + l] = a[l] * (dy[at + j * blk + l] - b[l] - xh * q[l]);
        }
    }
  }
}

void ps_bn_host_train(int n, int c, int hw, int blk, int kb0, int kb1, float eps, const float *x,
                      const float *gamma, const float *beta, float *y, float *mean, float *var,
                      float *invstd) {
  if (blk == 1)
    bn_train(n, c, hw, 1, kb0, kb1, eps, x, gamma, beta, y, mean, var, invstd);
  else if (blk == 8)
    bn_train(n, c, hw, 8, kb0, kb1, eps, x, gamma, beta, y, mean, var, invstd);
  else if (blk == 16)
    bn_train(n, c, hw, 16, kb0, kb1, eps, x, gamma, beta, y, mean, var, invstd);
  else
    bn_train(n, c, hw, blk, kb0, kb1, eps, x, gamma, beta, y, mean, var, invstd);
}

void ps_bn_host_infer(int n, int c, int hw, int blk, int kb0, int kb1, float eps, const float *x,
                      const float *gamma, const float *beta, const float *mean, const float *var,
                      float *y) {
  if (blk == 1)
    bn_infer(n, c, hw, 1, kb0, kb1, eps, x, gamma, beta, mean, var, y);
  else if (blk == 8)
    bn_infer(n, c, hw, 8, kb0, kb1, eps, x, gamma, beta, mean, var, y);
  else if (blk == 16)
    bn_infer(n, c, hw, 16, kb0, kb1, eps, x, gamma, beta, mean, var, y);
  else
    bn_infer(n, c, hw, blk, kb0, kb1, eps, x, gamma, beta, mean, var, y);
}

void ps_bn_host_backward(int n, int c, int hw, int blk, int kb0, int kb1, const float *x,
                         const float *dy, const float *gamma, const float *mean,
                         const float *invstd, float *dx, float *dgamma, float *dbeta) {
  if (blk == 1)
    bn_backward(n, c, hw, 1, kb0, kb1, x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
  else if (blk == 8)
    bn_backward(n, c, hw, 8, kb0, kb1, x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
  else if (blk == 16)
    bn_backward(n, c, hw, 16, kb0, kb1, x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
  else
    bn_backward(n, c, hw, blk, kb0, kb1, x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
}

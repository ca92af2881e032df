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

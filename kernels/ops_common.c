/* Shape helpers and names shared by every backend. */
#include "ops.h"

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

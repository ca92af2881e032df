/* The CUDA backend against the CPU reference (kernels/cpu), op by op on
 * random inputs of several shapes (forward and backward), then 20 SGD steps
 * of the quickstart CNN on both from the same initial parameters.
 *
 * Without a CUDA device it prints "SKIPPED: no CUDA device (<why>)" and
 * exits 77, which CTest is told means skipped (SKIP_RETURN_CODE 77). With
 * PS_PARITY_SELFTEST=1 and no device, a second CPU backend (2 threads, host
 * memory) stands in for the CUDA one, so that this harness itself can be
 * run and checked on a machine without a GPU.
 *
 * Tolerances: |got - want| <= atol + rtol*|want| per element, and why.
 *  - Bit for bit: relu, dropout (mask, output, gradient; the mask is also
 *    checked against ps_rng_uniform itself), max pooling (y, int32 argmax,
 *    dx: comparisons, and the same adds in the same order), average and
 *    global average pooling (the same sums in the same order), the softmax
 *    gradient from the same probabilities (the same two roundings), and
 *    the convolution run twice (the backend picks deterministic algorithms).
 *  - Convolution: rtol 1e-3, atol 1e-4 * max|want| of the array. cuDNN may
 *    pick an FFT or Winograd algorithm, whose error scales with the array's
 *    magnitude rather than each element's: an output near zero by
 *    cancellation carries an absolute error of the size of the largest.
 *    Plain float32 sums of the K <= 6300 terms here are ~1e-6 relative;
 *    an indexing mistake is O(1).
 *  - Dense: rtol 1e-4, atol 1e-5 * max|want|: the same sums in another order
 *    (cuBLAS may split K), no transform algorithms. db: rtol 1e-6, as both
 *    sum the rows in the same order.
 *  - Softmax probabilities: rtol 1e-4, atol 1e-7. cuDNN may use the fast
 *    exp, whose error grows with |x| (about 2 + 1.2|x| ulp, 1e-5 at
 *    |x| = 80); tiny probabilities may be flushed to zero. The loss (our own
 *    kernel, accurate expf, double sums): rtol 1e-5, atol 1e-7.
 *  - Batch normalization: statistics and their gradient sums rtol 1e-6,
 *    y and dx rtol 1e-5 (see test_batchnorm); a CNN step with it as
 *    test_avg_cnn_step (test_bn_cnn_step).
 *  - fm_forward and fm_backward (test_fm): bit for bit.
 *  - Embeddings (embedding_bag_forward and _backward) and copy_cols: bit
 *    for bit (the same float sums in the same order, no fused
 *    multiply-add, no atomics). The logistic loss (sigmoid_xent): the
 *    probabilities and their gradient rtol 1e-6 (double arithmetic
 *    rounded to float on both; the last bit of exp may differ), the
 *    gradient from the same probabilities bit for bit, the loss sum rtol
 *    1e-6 (a fixed tree of double sums against the CPU's in-order one),
 *    the count of right predictions exactly. See test_embedding_bag.
 *  - End to end: see test_cnn_trajectory.
 *  - tf32 and bf16 (ps_ops.set_precision, when the device has the tensor
 *    cores): convolutions and dense layers again, with the inputs of each
 *    product rounded to 10 (tf32) or 8 (bf16) bits of mantissa, about 5e-4
 *    and 4e-3 relative per product, plus the rounding of bf16 outputs;
 *    sums of K random-signed terms then err by a few times that relative to
 *    the largest output: atol 5e-3 (tf32) and 2e-2 (bf16) of max|want|,
 *    rtol 1e-2 and 5e-2. A wrong index or transpose is still O(1). */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/model_spec.h"
#include "../../common/rng.h"
#include "../../common/util.h"
#include "../../kernels/cuda/cuda_device.h"
#include "../../kernels/cuda/ops_cuda.h"
#include "../../kernels/emb_plan.h"
#include "../../kernels/ops.h"
#include "check.h"

/* ---- the two sides ---- */

typedef struct {
  const char *name;
  ps_ops *ops;
  int on_device; /* buffers in CUDA device memory */
} side;

static side ref; /* the CPU backend, host memory: the reference */
static ps_precision precision = PS_PRECISION_FP32; /* dut's convolutions and dense layers */

/* The tolerance of a sum of products at the current precision: fp32's as
 * given, tf32's and bf16's as the header says. */
static double tol_atol(double fp32) {
  return precision == PS_PRECISION_TF32 ? 5e-3 : precision == PS_PRECISION_BF16 ? 2e-2 : fp32;
}
static double tol_rtol(double fp32) {
  return precision == PS_PRECISION_TF32 ? 1e-2 : precision == PS_PRECISION_BF16 ? 5e-2 : fp32;
}
static side dut; /* under test: the CUDA backend (or a second CPU backend, self-test) */

static void die(const char *what) {
  fprintf(stderr, "test_cuda_parity: %s\n", what);
  abort();
}

static void *host_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 16);
  if (!p) die("out of host memory");
  return p;
}

/* Every buffer is a real pointer, even for an empty array. */
static void *s_alloc(const side *s, size_t bytes) {
  if (bytes == 0) bytes = 16;
  if (!s->on_device) return host_alloc(bytes);
  void *p = NULL;
  if (ps_cuda_alloc(&p, bytes) != 0) die("out of device memory");
  return p;
}

static void s_free(const side *s, void *p) {
  if (s->on_device)
    ps_cuda_free(p);
  else
    free(p);
}

/* Host to side, complete on return. */
static void s_put(const side *s, void *dst, const void *src, size_t bytes) {
  if (!s->on_device) {
    if (bytes) memcpy(dst, src, bytes);
    return;
  }
  ps_cuda_memcpy_h2d(s->ops, dst, src, bytes);
  ps_cuda_sync(s->ops);
}

/* Side to host, complete on return (after everything queued before). */
static void s_get(const side *s, void *dst, const void *src, size_t bytes) {
  if (!s->on_device) {
    if (bytes) memcpy(dst, src, bytes);
    return;
  }
  ps_cuda_memcpy_d2h(s->ops, dst, src, bytes);
  ps_cuda_sync(s->ops);
}

static void *s_upload(const side *s, const void *host, size_t bytes) {
  void *p = s_alloc(s, bytes);
  s_put(s, p, host, bytes);
  return p;
}

/* Outputs are prefilled with NaN, so that a backend that reads (accumulates
 * into) an output it should overwrite, or skips part of it, fails. */
static float *nan_floats(size_t n) {
  float *a = host_alloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = NAN;
  return a;
}

static float *s_nans(const side *s, size_t n) {
  float *h = nan_floats(n);
  float *p = s_upload(s, h, n * sizeof(float));
  free(h);
  return p;
}

static void *s_fetch(const side *s, const void *p, size_t bytes) {
  void *h = host_alloc(bytes);
  s_get(s, h, p, bytes);
  return h;
}

/* ---- data and comparisons ---- */

/* A local xorshift, so that the inputs do not depend on the code under
 * test. */
static uint64_t rand_state = 0x2545f4914f6cdd1dULL;

static double rand_unit(void) { /* [0, 1) */
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (double)(rand_state >> 11) * (1.0 / 9007199254740992.0);
}

static float *uniform_floats(size_t n, float lo, float hi) {
  float *a = host_alloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = lo + (hi - lo) * (float)rand_unit();
  return a;
}

static double max_abs(const float *a, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; i++)
    if (isfinite(a[i]) && fabs(a[i]) > m) m = fabs(a[i]);
  return m;
}

/* One CHECK per array; NaN matches only NaN. */
static void check_close(const char *what, const float *got, const float *want, size_t n,
                        double atol, double rtol) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    const double g = got[i], w = want[i];
    const int ok = (isnan(g) && isnan(w)) || fabs(g - w) <= atol + rtol * fabs(w);
    if (!ok && bad++ == 0) first = i;
  }
  CHECK_MSG(bad == 0,
            "%s: %zu of %zu differ (atol %.3g, rtol %.3g); first at %zu: got %.9g, want %.9g", what,
            bad, n, atol, rtol, first, bad ? (double)got[first] : 0.0,
            bad ? (double)want[first] : 0.0);
}

/* atol relative to the largest |want| of the array. */
static void check_scaled(const char *what, const float *got, const float *want, size_t n,
                         double atol_of_max, double rtol) {
  check_close(what, got, want, n, atol_of_max * max_abs(want, n), rtol);
}

/* Bit for bit, over n 4-byte elements (floats or int32). */
static void check_bits(const char *what, const void *got, const void *want, size_t n) {
  const uint32_t *g = got, *w = want;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (g[i] != w[i] && bad++ == 0) first = i;
  CHECK_MSG(bad == 0, "%s: %zu of %zu differ bitwise; first at %zu: got 0x%08x, want 0x%08x", what,
            bad, n, first, bad ? (unsigned)g[first] : 0u, bad ? (unsigned)w[first] : 0u);
}

/* ||got - want|| / ||want|| (0 when both are zero). */
static double rel_l2(const float *got, const float *want, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double d = (double)got[i] - want[i];
    num += d * d;
    den += (double)want[i] * want[i];
  }
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* ---- convolution ---- */

typedef struct {
  int n, c, h, w, oc, kh, kw, stride, pad;
} conv_case;

static const conv_case conv_cases[] = {
    {2, 3, 7, 9, 4, 3, 3, 1, 1},     /* odd sizes, "same" padding */
    {1, 3, 7, 9, 4, 3, 3, 1, 1},     /* the same with a smaller batch: a second plan */
    {3, 2, 8, 8, 5, 5, 5, 2, 2},     /* 5x5, stride 2 */
    {1, 1, 28, 28, 8, 3, 3, 1, 0},   /* "valid", one input channel */
    {4, 16, 14, 14, 32, 3, 3, 1, 1}, /* K = 144 */
    {2, 3, 5, 6, 2, 1, 1, 1, 0},     /* 1x1 */
    {2, 4, 9, 7, 3, 2, 2, 3, 0},     /* stride > kernel: inputs no window reads */
    {2, 3, 6, 8, 4, 3, 1, 1, 1},     /* a non-square kernel */
    {32, 32, 14, 14, 64, 3, 3, 1, 1}, /* the quickstart CNN's second conv, batch 32 */
    {64, 1, 28, 28, 32, 3, 3, 1, 1},  /* its first conv at its batch, 64 */
    {64, 32, 14, 14, 64, 3, 3, 1, 1}, /* its second conv at batch 64 */
    {48, 8, 9, 9, 16, 3, 3, 2, 1},    /* a batch above 32 that is no power of two, stride 2 */
};

/* off: the weights, bias and their gradients start `off` floats into their
 * buffers, as inside one flat parameter vector (1: not 16-byte aligned). */
static void conv_one(const conv_case *k, int off) {
  ps_conv_shape s = {.n = k->n, .c = k->c, .h = k->h, .w = k->w, .oc = k->oc, .kh = k->kh,
                     .kw = k->kw, .stride = k->stride, .pad = k->pad};
  ps_conv_shape_finish(&s);
  char what[160];
  const size_t nx = (size_t)s.n * s.c * s.h * s.w, ny = (size_t)s.n * s.oc * s.oh * s.ow;
  const size_t nw = (size_t)s.oc * s.c * s.kh * s.kw, nb = (size_t)s.oc;
  float *x = uniform_floats(nx, -1, 1), *w = uniform_floats(nw, -1, 1);
  float *b = uniform_floats(nb, -1, 1), *dy = uniform_floats(ny, -1, 1);

  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx), *dw_ref = nan_floats(nw),
        *db_ref = nan_floats(nb);
  float *work = host_alloc(ref.ops->conv2d_workspace(ref.ops->ctx, &s) * sizeof(float));
  ref.ops->conv2d_forward(ref.ops->ctx, &s, x, w, b, y_ref, work);
  ref.ops->conv2d_backward(ref.ops->ctx, &s, x, w, dy, dx_ref, dw_ref, db_ref, work);
  free(work);

  const size_t fl = sizeof(float);
  float *d_x = s_upload(&dut, x, nx * fl), *d_dy = s_upload(&dut, dy, ny * fl);
  float *d_wbuf = s_nans(&dut, nw + (size_t)off), *d_bbuf = s_nans(&dut, nb + (size_t)off);
  float *d_dwbuf = s_nans(&dut, nw + (size_t)off), *d_dbbuf = s_nans(&dut, nb + (size_t)off);
  float *d_w = d_wbuf + off, *d_b = d_bbuf + off, *d_dw = d_dwbuf + off, *d_db = d_dbbuf + off;
  s_put(&dut, d_w, w, nw * fl);
  s_put(&dut, d_b, b, nb * fl);
  float *d_y = s_nans(&dut, ny), *d_dx = s_nans(&dut, nx);
  float *d_work = s_alloc(&dut, dut.ops->conv2d_workspace(dut.ops->ctx, &s) * fl);
  dut.ops->conv2d_forward(dut.ops->ctx, &s, d_x, d_w, d_b, d_y, d_work);
  dut.ops->conv2d_backward(dut.ops->ctx, &s, d_x, d_w, d_dy, d_dx, d_dw, d_db, d_work);
  float *y = s_fetch(&dut, d_y, ny * fl), *dx = s_fetch(&dut, d_dx, nx * fl);
  float *dw = s_fetch(&dut, d_dw, nw * fl), *db = s_fetch(&dut, d_db, nb * fl);

#define CONV_WHAT(name)                                                                        \
  (snprintf(what, sizeof what, "conv %s n%d c%d %dx%d oc%d k%dx%d s%d p%d off%d", name, s.n, s.c, \
            s.h, s.w, s.oc, s.kh, s.kw, s.stride, s.pad, off),                                  \
   what)
  check_scaled(CONV_WHAT("y"), y, y_ref, ny, tol_atol(1e-4), tol_rtol(1e-3));
  check_scaled(CONV_WHAT("dx"), dx, dx_ref, nx, tol_atol(1e-4), tol_rtol(1e-3));
  check_scaled(CONV_WHAT("dw"), dw, dw_ref, nw, tol_atol(1e-4), tol_rtol(1e-3));
  check_scaled(CONV_WHAT("db"), db, db_ref, nb, 1e-4, 1e-3);

  /* Again, without dx: the same bits (deterministic algorithms), and the
   * buffers outside [off, off + count) untouched. */
  float *d_y2 = s_nans(&dut, ny), *d_dw2 = s_nans(&dut, nw + (size_t)off),
        *d_db2 = s_nans(&dut, nb + (size_t)off);
  dut.ops->conv2d_forward(dut.ops->ctx, &s, d_x, d_w, d_b, d_y2, d_work);
  dut.ops->conv2d_backward(dut.ops->ctx, &s, d_x, d_w, d_dy, NULL, d_dw2 + off, d_db2 + off,
                           d_work);
  float *y2 = s_fetch(&dut, d_y2, ny * fl);
  float *dw2 = s_fetch(&dut, d_dw2, (nw + (size_t)off) * fl);
  float *db2 = s_fetch(&dut, d_db2, (nb + (size_t)off) * fl);
  check_bits(CONV_WHAT("y again"), y2, y, ny);
  check_bits(CONV_WHAT("dw without dx"), dw2 + off, dw, nw);
  check_bits(CONV_WHAT("db without dx"), db2 + off, db, nb);
  /* The intended choices: FMA math (float32 products, never TF32 tensor
   * cores) and deterministic algorithms, in every direction; tensor-core
   * math at tf32 and bf16. */
  if (strcmp(dut.ops->name, "cuda") == 0) {
    ps_cuda_conv_info info;
    CHECK_MSG(ps_cuda_conv_choice(dut.ops, &s, &info) == 0, "%s", CONV_WHAT("no plan"));
    static const char *dir[3] = {"forward", "backward data", "backward filter"};
    for (int d = 0; d < 3; d++) {
      if (precision != PS_PRECISION_FP32)
        CHECK_MSG(info.tensor_op[d], "%s: %s algorithm %d without tensor-core math at %s",
                  CONV_WHAT("math"), dir[d], info.algo[d], ps_precision_name(precision));
      else
        CHECK_MSG(info.fma[d], "%s: %s algorithm %d without FMA math (TF32?)", CONV_WHAT("math"),
                  dir[d], info.algo[d]);
      CHECK_MSG(info.deterministic[d], "%s: %s algorithm %d is not the deterministic FMA kind",
                CONV_WHAT("algorithm"), dir[d], info.algo[d]);
    }
  }
  CHECK_MSG(off == 0 || (isnan(dw2[0]) && isnan(db2[0])), "%s", CONV_WHAT("wrote before dw/db"));
#undef CONV_WHAT

  free(x), free(w), free(b), free(dy), free(y_ref), free(dx_ref), free(dw_ref), free(db_ref);
  free(y), free(dx), free(dw), free(db), free(y2), free(dw2), free(db2);
  float *dev[] = {d_x, d_dy, d_wbuf, d_bbuf, d_dwbuf, d_dbbuf, d_y, d_dx, d_work, d_y2, d_dw2,
                  d_db2};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) s_free(&dut, dev[i]);
}

static void test_conv2d(void) {
  for (size_t i = 0; i < sizeof conv_cases / sizeof conv_cases[0]; i++)
    for (int off = 0; off < 2; off++) conv_one(&conv_cases[i], off);
}

/* An empty batch: nothing to compute, and the gradients are zero. */
static void test_conv2d_empty_batch(void) {
  ps_conv_shape s = {.n = 0, .c = 3, .h = 5, .w = 5, .oc = 2, .kh = 3, .kw = 3, .stride = 1,
                     .pad = 1};
  ps_conv_shape_finish(&s);
  const size_t nw = (size_t)s.oc * s.c * s.kh * s.kw, nb = (size_t)s.oc;
  float *w = uniform_floats(nw, -1, 1), *b = uniform_floats(nb, -1, 1);
  float *dw_ref = nan_floats(nw), *db_ref = nan_floats(nb);
  float *work = host_alloc(ref.ops->conv2d_workspace(ref.ops->ctx, &s) * sizeof(float));
  float *x = nan_floats(1), *dy = nan_floats(1), *y = nan_floats(1);
  ref.ops->conv2d_forward(ref.ops->ctx, &s, x, w, b, y, work);
  ref.ops->conv2d_backward(ref.ops->ctx, &s, x, w, dy, NULL, dw_ref, db_ref, work);
  float *d_w = s_upload(&dut, w, nw * sizeof(float)), *d_b = s_upload(&dut, b, nb * sizeof(float));
  float *d_dw = s_nans(&dut, nw), *d_db = s_nans(&dut, nb), *d_any = s_nans(&dut, 1);
  float *d_work = s_alloc(&dut, dut.ops->conv2d_workspace(dut.ops->ctx, &s) * sizeof(float));
  dut.ops->conv2d_forward(dut.ops->ctx, &s, d_any, d_w, d_b, d_any, d_work);
  dut.ops->conv2d_backward(dut.ops->ctx, &s, d_any, d_w, d_any, NULL, d_dw, d_db, d_work);
  float *dw = s_fetch(&dut, d_dw, nw * sizeof(float));
  float *db = s_fetch(&dut, d_db, nb * sizeof(float));
  check_bits("conv n=0 dw", dw, dw_ref, nw);
  check_bits("conv n=0 db", db, db_ref, nb);
  CHECK(dw[0] == 0.0f && db[0] == 0.0f);
  free(w), free(b), free(dw_ref), free(db_ref), free(work), free(x), free(dy), free(y), free(dw),
      free(db);
  s_free(&dut, d_w), s_free(&dut, d_b), s_free(&dut, d_dw), s_free(&dut, d_db),
      s_free(&dut, d_any), s_free(&dut, d_work);
}

/* ---- max pooling ---- */

typedef struct {
  int n, c, h, w, size, stride;
} pool_case;

static const pool_case pool_cases[] = {
    {2, 3, 8, 8, 2, 2},   /* the common window */
    {1, 2, 7, 9, 3, 2},   /* overlapping windows, odd sizes */
    {3, 4, 6, 6, 2, 1},   /* stride 1: most inputs in four windows */
    {2, 5, 5, 5, 2, 2},   /* a last row and column no window covers */
    {1, 1, 1, 1, 1, 1},   /* one value */
    {2, 3, 10, 10, 3, 3}, /* 3x3 windows */
    {32, 32, 28, 28, 2, 2}, /* the quickstart CNN's first pool, batch 32 */
};

/* Inputs on a coarse grid (ties are common, and must go to the same tap),
 * with NaNs in some cases (a NaN first tap stays, a later one never wins). */
static void pool_one(const pool_case *k, int with_nan) {
  ps_pool_shape s = {.n = k->n, .c = k->c, .h = k->h, .w = k->w, .size = k->size,
                     .stride = k->stride};
  ps_pool_shape_finish(&s);
  char what[128];
  const size_t nx = (size_t)s.n * s.c * s.h * s.w, ny = (size_t)s.n * s.c * s.oh * s.ow;
  float *x = uniform_floats(nx, 0, 1);
  for (size_t i = 0; i < nx; i++) x[i] = floorf(x[i] * 5.0f) * 0.25f - 0.5f;
  if (with_nan) {
    x[0] = NAN;
    x[nx / 2] = NAN;
    x[nx - 1] = NAN;
  }
  float *dy = uniform_floats(ny, -1, 1);
  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx);
  int32_t *am_ref = host_alloc(ny * sizeof(int32_t));
  ref.ops->maxpool_forward(ref.ops->ctx, &s, x, y_ref, am_ref);
  ref.ops->maxpool_backward(ref.ops->ctx, &s, dy, am_ref, dx_ref);

  float *d_x = s_upload(&dut, x, nx * sizeof(float));
  float *d_dy = s_upload(&dut, dy, ny * sizeof(float));
  float *d_y = s_nans(&dut, ny), *d_dx = s_nans(&dut, nx), *d_dx2 = s_nans(&dut, nx);
  int32_t *d_am = s_alloc(&dut, ny * sizeof(int32_t));
  int32_t *d_am_ref = s_upload(&dut, am_ref, ny * sizeof(int32_t));
  dut.ops->maxpool_forward(dut.ops->ctx, &s, d_x, d_y, d_am);
  dut.ops->maxpool_backward(dut.ops->ctx, &s, d_dy, d_am, d_dx);
  dut.ops->maxpool_backward(dut.ops->ctx, &s, d_dy, d_am_ref, d_dx2);
  float *y = s_fetch(&dut, d_y, ny * sizeof(float)), *dx = s_fetch(&dut, d_dx, nx * sizeof(float));
  float *dx2 = s_fetch(&dut, d_dx2, nx * sizeof(float));
  int32_t *am = s_fetch(&dut, d_am, ny * sizeof(int32_t));

#define POOL_WHAT(name)                                                                   \
  (snprintf(what, sizeof what, "maxpool %s n%d c%d %dx%d size%d stride%d%s", name, s.n, s.c, \
            s.h, s.w, s.size, s.stride, with_nan ? " nan" : ""),                          \
   what)
  check_bits(POOL_WHAT("y"), y, y_ref, ny);
  check_bits(POOL_WHAT("argmax"), am, am_ref, ny);
  check_bits(POOL_WHAT("dx"), dx, dx_ref, nx);
  check_bits(POOL_WHAT("dx from the cpu argmax"), dx2, dx_ref, nx);
#undef POOL_WHAT

  free(x), free(dy), free(y_ref), free(dx_ref), free(am_ref), free(y), free(dx), free(dx2),
      free(am);
  s_free(&dut, d_x), s_free(&dut, d_dy), s_free(&dut, d_y), s_free(&dut, d_dx),
      s_free(&dut, d_dx2), s_free(&dut, d_am), s_free(&dut, d_am_ref);
}

static void test_maxpool(void) {
  for (size_t i = 0; i < sizeof pool_cases / sizeof pool_cases[0]; i++) {
    pool_one(&pool_cases[i], 0);
    pool_one(&pool_cases[i], 1);
  }
}

/* ---- average pooling ----
 *
 * Bit for bit: the kernels add the CPU's terms in the CPU's order (the
 * gradient gathers each input's windows in increasing output index). */

static void avgpool_one(const pool_case *k) {
  ps_pool_shape s = {
      .n = k->n, .c = k->c, .h = k->h, .w = k->w, .size = k->size, .stride = k->stride};
  ps_pool_shape_finish(&s);
  char what[128];
  const size_t nx = (size_t)s.n * s.c * s.h * s.w, ny = (size_t)s.n * s.c * s.oh * s.ow;
  const size_t planes = (size_t)s.n * s.c;
  float *x = uniform_floats(nx, -1, 1), *dy = uniform_floats(ny, -1, 1);
  float *gdy = uniform_floats(planes, -1, 1);
  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx);
  float *gy_ref = nan_floats(planes), *gdx_ref = nan_floats(nx);
  ref.ops->avgpool_forward(ref.ops->ctx, &s, x, y_ref);
  ref.ops->avgpool_backward(ref.ops->ctx, &s, dy, dx_ref);
  ref.ops->global_avgpool_forward(ref.ops->ctx, s.n, s.c, s.h, s.w, x, gy_ref);
  ref.ops->global_avgpool_backward(ref.ops->ctx, s.n, s.c, s.h, s.w, gdy, gdx_ref);

  float *d_x = s_upload(&dut, x, nx * sizeof(float));
  float *d_dy = s_upload(&dut, dy, ny * sizeof(float));
  float *d_gdy = s_upload(&dut, gdy, planes * sizeof(float));
  float *d_y = s_nans(&dut, ny), *d_dx = s_nans(&dut, nx);
  float *d_gy = s_nans(&dut, planes), *d_gdx = s_nans(&dut, nx);
  dut.ops->avgpool_forward(dut.ops->ctx, &s, d_x, d_y);
  dut.ops->avgpool_backward(dut.ops->ctx, &s, d_dy, d_dx);
  dut.ops->global_avgpool_forward(dut.ops->ctx, s.n, s.c, s.h, s.w, d_x, d_gy);
  dut.ops->global_avgpool_backward(dut.ops->ctx, s.n, s.c, s.h, s.w, d_gdy, d_gdx);
  float *y = s_fetch(&dut, d_y, ny * sizeof(float)), *dx = s_fetch(&dut, d_dx, nx * sizeof(float));
  float *gy = s_fetch(&dut, d_gy, planes * sizeof(float));
  float *gdx = s_fetch(&dut, d_gdx, nx * sizeof(float));

#define AVG_WHAT(name)                                                                       \
  (snprintf(what, sizeof what, "%s n%d c%d %dx%d size%d stride%d", name, s.n, s.c, s.h, s.w, \
            s.size, s.stride),                                                               \
   what)
  check_bits(AVG_WHAT("avgpool y"), y, y_ref, ny);
  check_bits(AVG_WHAT("avgpool dx"), dx, dx_ref, nx);
  check_bits(AVG_WHAT("global_avgpool y"), gy, gy_ref, planes);
  check_bits(AVG_WHAT("global_avgpool dx"), gdx, gdx_ref, nx);
#undef AVG_WHAT

  float *hosts[] = {x, dy, gdy, y_ref, dx_ref, gy_ref, gdx_ref, y, dx, gy, gdx};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) free(hosts[i]);
  float *devs[] = {d_x, d_dy, d_gdy, d_y, d_dx, d_gy, d_gdx};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) s_free(&dut, devs[i]);
}

static void test_avgpool(void) {
  for (size_t i = 0; i < sizeof pool_cases / sizeof pool_cases[0]; i++) avgpool_one(&pool_cases[i]);
}

/* ---- dense ---- */

typedef struct {
  int n, in, out;
} dense_case;

static const dense_case dense_cases[] = {
    {1, 1, 1},     {3, 5, 7},   {7, 33, 1},   {64, 3136, 128}, {64, 128, 10},
    {2, 1000, 300}, {5, 0, 3}, /* no input features: y = b */
    {0, 4, 3},                 /* an empty batch */
};

static void dense_one(const dense_case *k, int off) {
  const int n = k->n, in = k->in, out = k->out;
  char what[128];
  const size_t nx = (size_t)n * in, ny = (size_t)n * out, nw = (size_t)out * in, nb = (size_t)out;
  const size_t fl = sizeof(float);
  float *x = uniform_floats(nx, -1, 1), *w = uniform_floats(nw, -1, 1);
  float *b = uniform_floats(nb, -1, 1), *dy = uniform_floats(ny, -1, 1);
  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx), *dw_ref = nan_floats(nw),
        *db_ref = nan_floats(nb);
  ref.ops->dense_forward(ref.ops->ctx, n, in, out, x, w, b, y_ref);
  ref.ops->dense_backward(ref.ops->ctx, n, in, out, x, w, dy, dx_ref, dw_ref, db_ref);

  float *d_x = s_upload(&dut, x, nx * fl), *d_dy = s_upload(&dut, dy, ny * fl);
  float *d_wbuf = s_nans(&dut, nw + (size_t)off), *d_bbuf = s_nans(&dut, nb + (size_t)off);
  float *d_dwbuf = s_nans(&dut, nw + (size_t)off), *d_dbbuf = s_nans(&dut, nb + (size_t)off);
  float *d_w = d_wbuf + off, *d_b = d_bbuf + off, *d_dw = d_dwbuf + off, *d_db = d_dbbuf + off;
  s_put(&dut, d_w, w, nw * fl);
  s_put(&dut, d_b, b, nb * fl);
  float *d_y = s_nans(&dut, ny), *d_dx = s_nans(&dut, nx);
  dut.ops->dense_forward(dut.ops->ctx, n, in, out, d_x, d_w, d_b, d_y);
  dut.ops->dense_backward(dut.ops->ctx, n, in, out, d_x, d_w, d_dy, d_dx, d_dw, d_db);
  float *y = s_fetch(&dut, d_y, ny * fl), *dx = s_fetch(&dut, d_dx, nx * fl);
  float *dw = s_fetch(&dut, d_dw, nw * fl), *db = s_fetch(&dut, d_db, nb * fl);
  /* Without dx: the same dW and db, bit for bit, written at the same
   * offset (cuBLAS chooses its kernel by the pointers' alignment too: dW
   * at another alignment may be summed in another order). */
  float *d_dw2buf = s_nans(&dut, nw + (size_t)off), *d_db2buf = s_nans(&dut, nb + (size_t)off);
  float *d_dw2 = d_dw2buf + off, *d_db2 = d_db2buf + off;
  dut.ops->dense_backward(dut.ops->ctx, n, in, out, d_x, d_w, d_dy, NULL, d_dw2, d_db2);
  float *dw2 = s_fetch(&dut, d_dw2, nw * fl), *db2 = s_fetch(&dut, d_db2, nb * fl);

#define DENSE_WHAT(name) \
  (snprintf(what, sizeof what, "dense %s n%d in%d out%d off%d", name, n, in, out, off), what)
  check_scaled(DENSE_WHAT("y"), y, y_ref, ny, tol_atol(1e-5), tol_rtol(1e-4));
  check_scaled(DENSE_WHAT("dx"), dx, dx_ref, nx, tol_atol(1e-5), tol_rtol(1e-4));
  check_scaled(DENSE_WHAT("dw"), dw, dw_ref, nw, tol_atol(1e-5), tol_rtol(1e-4));
  check_close(DENSE_WHAT("db"), db, db_ref, nb, 0.0, 1e-6);
  check_bits(DENSE_WHAT("dw without dx"), dw2, dw, nw);
  check_bits(DENSE_WHAT("db without dx"), db2, db, nb);
#undef DENSE_WHAT

  free(x), free(w), free(b), free(dy), free(y_ref), free(dx_ref), free(dw_ref), free(db_ref);
  free(y), free(dx), free(dw), free(db), free(dw2), free(db2);
  float *dev[] = {d_x, d_dy, d_wbuf, d_bbuf, d_dwbuf, d_dbbuf, d_y, d_dx, d_dw2, d_db2};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) s_free(&dut, dev[i]);
}

static void test_dense(void) {
  for (size_t i = 0; i < sizeof dense_cases / sizeof dense_cases[0]; i++)
    for (int off = 0; off < 2; off++) dense_one(&dense_cases[i], off);
}

/* ---- batch normalization ----
 *
 * Both sides sum each channel's n*hw values in double (the CPU in order,
 * the CUDA kernels in a fixed tree), so the statistics agree to the last
 * bit or two: mean, var, invstd, dgamma and dbeta within rtol 1e-6 (atol
 * 1e-6 of the array's largest, for a mean or a sum near zero by
 * cancellation). y and dx are then the same float formulas: with equal
 * statistics equal, unless the host's compiler fuses a multiply-add
 * (-march=native); an ulp of a statistic moves an element by about an ulp
 * of the largest term: atol 1e-5 of max|want|, rtol 1e-5. A wrong channel
 * or stride is O(1). backward and infer are given the reference's
 * statistics, so that each op is checked on its own. */

typedef struct {
  int n, c, hw;
  float eps;
  float lo, hi; /* x in [lo, hi) */
} bn_case;

static const bn_case bn_cases[] = {
    {2, 3, 49, 1e-3f, -1, 1},    /* after a 7x7 conv, odd channel count */
    {1, 5, 7, 1e-3f, 2, 4},      /* one example: statistics over hw only; mean far from 0 */
    {64, 128, 1, 1e-3f, -1, 1},  /* after dense: hw = 1 */
    {7, 33, 1, 1e-5f, -3, 1},    /* dense, odd sizes, the smallest epsilon */
    {1, 4, 1, 1e-3f, -1, 1},     /* m = 1: var 0, xhat 0, y = beta, dx = 0 */
    {2500, 3, 1, 1e-3f, -1, 1},  /* more examples than a block has threads */
    {3, 2, 1500, 1e-3f, -2, 2},  /* a plane larger than a block */
    {32, 32, 196, 1e-3f, -1, 1}, /* 14x14 planes at batch 32 */
    {4, 16, 1024, 1e-5f, 0, 1},  /* 32x32 planes: m = 4096 per channel */
    {0, 3, 5, 1e-3f, -1, 1},     /* an empty batch: statistics 0, 0, 1/sqrt(eps); no y */
};

static void bn_one(const bn_case *k) {
  const int n = k->n, c = k->c, hw = k->hw;
  char what[128];
  const size_t nx = (size_t)n * c * hw, nc = (size_t)c, fl = sizeof(float);
  float *x = uniform_floats(nx, k->lo, k->hi), *dy = uniform_floats(nx, -1, 1);
  /* Channel 0 constant where it has values: var 0 exactly, xhat 0. */
  if (c > 1)
    for (int i = 0; i < n; i++)
      for (int j = 0; j < hw; j++) x[(size_t)i * c * hw + j] = 0.75f;
  float *gamma = uniform_floats(nc, 0.5f, 1.5f), *beta = uniform_floats(nc, -0.5f, 0.5f);
  float *mmean = uniform_floats(nc, -0.5f, 0.5f), *mvar = uniform_floats(nc, 0.0f, 2.0f);

  float *y_ref = nan_floats(nx), *mean_ref = nan_floats(nc), *var_ref = nan_floats(nc),
        *is_ref = nan_floats(nc), *yi_ref = nan_floats(nx), *dx_ref = nan_floats(nx),
        *dg_ref = nan_floats(nc), *db_ref = nan_floats(nc);
  ps_ops *r = ref.ops;
  r->batchnorm_forward_train(r->ctx, n, c, hw, k->eps, x, gamma, beta, y_ref, mean_ref, var_ref,
                             is_ref);
  r->batchnorm_forward_infer(r->ctx, n, c, hw, k->eps, x, gamma, beta, mmean, mvar, yi_ref);
  r->batchnorm_backward(r->ctx, n, c, hw, x, dy, gamma, mean_ref, is_ref, dx_ref, dg_ref, db_ref);

  ps_ops *o = dut.ops;
  float *d_x = s_upload(&dut, x, nx * fl), *d_dy = s_upload(&dut, dy, nx * fl);
  float *d_gamma = s_upload(&dut, gamma, nc * fl), *d_beta = s_upload(&dut, beta, nc * fl);
  float *d_mmean = s_upload(&dut, mmean, nc * fl), *d_mvar = s_upload(&dut, mvar, nc * fl);
  float *d_mean_ref = s_upload(&dut, mean_ref, nc * fl),
        *d_is_ref = s_upload(&dut, is_ref, nc * fl);
  float *d_y = s_nans(&dut, nx), *d_mean = s_nans(&dut, nc), *d_var = s_nans(&dut, nc),
        *d_is = s_nans(&dut, nc), *d_yi = s_nans(&dut, nx), *d_dx = s_nans(&dut, nx),
        *d_dg = s_nans(&dut, nc), *d_db = s_nans(&dut, nc), *d_y2 = s_nans(&dut, nx),
        *d_dg2 = s_nans(&dut, nc), *d_db2 = s_nans(&dut, nc);
  o->batchnorm_forward_train(o->ctx, n, c, hw, k->eps, d_x, d_gamma, d_beta, d_y, d_mean, d_var,
                             d_is);
  o->batchnorm_forward_infer(o->ctx, n, c, hw, k->eps, d_x, d_gamma, d_beta, d_mmean, d_mvar, d_yi);
  o->batchnorm_backward(o->ctx, n, c, hw, d_x, d_dy, d_gamma, d_mean_ref, d_is_ref, d_dx, d_dg,
                        d_db);
  /* Again: forward into another y (the same bits: a fixed order), and
   * backward without dx (the same dgamma, dbeta). */
  o->batchnorm_forward_train(o->ctx, n, c, hw, k->eps, d_x, d_gamma, d_beta, d_y2, d_mean, d_var,
                             d_is);
  o->batchnorm_backward(o->ctx, n, c, hw, d_x, d_dy, d_gamma, d_mean_ref, d_is_ref, NULL, d_dg2,
                        d_db2);
  float *y = s_fetch(&dut, d_y, nx * fl), *mean = s_fetch(&dut, d_mean, nc * fl);
  float *var = s_fetch(&dut, d_var, nc * fl), *is = s_fetch(&dut, d_is, nc * fl);
  float *yi = s_fetch(&dut, d_yi, nx * fl), *dx = s_fetch(&dut, d_dx, nx * fl);
  float *dg = s_fetch(&dut, d_dg, nc * fl), *db = s_fetch(&dut, d_db, nc * fl);
  float *y2 = s_fetch(&dut, d_y2, nx * fl), *dg2 = s_fetch(&dut, d_dg2, nc * fl);
  float *db2 = s_fetch(&dut, d_db2, nc * fl);

#define BN_WHAT(name)                                                                              \
  (snprintf(what, sizeof what, "batchnorm %s n%d c%d hw%d eps%g", name, n, c, hw, (double)k->eps), \
   what)
  check_scaled(BN_WHAT("mean"), mean, mean_ref, nc, 1e-6, 1e-6);
  check_scaled(BN_WHAT("var"), var, var_ref, nc, 1e-6, 1e-6);
  check_close(BN_WHAT("invstd"), is, is_ref, nc, 0.0, 1e-6);
  check_scaled(BN_WHAT("y"), y, y_ref, nx, 1e-5, 1e-5);
  check_scaled(BN_WHAT("y infer"), yi, yi_ref, nx, 1e-5, 1e-5);
  check_scaled(BN_WHAT("dgamma"), dg, dg_ref, nc, 1e-6, 1e-6);
  check_scaled(BN_WHAT("dbeta"), db, db_ref, nc, 1e-6, 1e-6);
  check_scaled(BN_WHAT("dx"), dx, dx_ref, nx, 1e-5, 1e-5);
  check_bits(BN_WHAT("y again"), y2, y, nx);
  check_bits(BN_WHAT("dgamma without dx"), dg2, dg, nc);
  check_bits(BN_WHAT("dbeta without dx"), db2, db, nc);
  /* The contract itself, beyond agreeing with the reference: a biased
   * variance (m = 1 and a constant channel give 0, not NaN or inf), and
   * invstd from it. */
  if (n * hw == 1 || n == 0)
    for (int j = 0; j < c; j++)
      CHECK_MSG(var[j] == 0.0f, "%s: %g", BN_WHAT("var of m <= 1"), var[j]);
  if (c > 1 && n > 0)
    CHECK_MSG(var[0] == 0.0f, "%s: %g", BN_WHAT("var of a constant channel"), var[0]);
  for (int j = 0; j < c; j++) {
    const double want = 1.0 / sqrt((double)var[j] + (double)k->eps);
    CHECK_MSG(fabs(is[j] - want) <= 1e-6 * want, "%s: channel %d: %.9g, want %.9g",
              BN_WHAT("invstd of var"), j, (double)is[j], want);
  }
#undef BN_WHAT

  float *hosts[] = {x,      dy,     gamma,  beta,   mmean,  mvar, y_ref, mean_ref, var_ref,
                    is_ref, yi_ref, dx_ref, dg_ref, db_ref, y,    mean,  var,      is,
                    yi,     dx,     dg,     db,     y2,     dg2,  db2};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) free(hosts[i]);
  float *devs[] = {d_x,      d_dy, d_gamma, d_beta, d_mmean, d_mvar, d_mean_ref,
                   d_is_ref, d_y,  d_mean,  d_var,  d_is,    d_yi,   d_dx,
                   d_dg,     d_db, d_y2,    d_dg2,  d_db2};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) s_free(&dut, devs[i]);
}

static void test_batchnorm(void) {
  for (size_t i = 0; i < sizeof bn_cases / sizeof bn_cases[0]; i++) bn_one(&bn_cases[i]);
}

/* ---- relu ---- */

static void test_relu(void) {
  static const size_t sizes[] = {1, 7, 1000, 100003};
  char what[96];
  for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
    const size_t n = sizes[t], bytes = n * sizeof(float);
    float *x = uniform_floats(n, -1, 1), *dy = uniform_floats(n, -1, 1);
    /* The edges of "> 0": zeros of both signs, NaN, infinities. */
    for (size_t i = 0; i < n; i++) {
      if (i % 97 == 3) x[i] = 0.0f;
      if (i % 89 == 5) x[i] = -0.0f;
      if (i % 83 == 7) x[i] = NAN;
      if (i % 79 == 9) x[i] = INFINITY;
      if (i % 73 == 11) x[i] = -INFINITY;
    }
    float *y_ref = nan_floats(n), *dx_ref = nan_floats(n);
    ref.ops->relu_forward(ref.ops->ctx, n, x, y_ref);
    ref.ops->relu_backward(ref.ops->ctx, n, y_ref, dy, dx_ref);

    float *d_x = s_upload(&dut, x, bytes), *d_dy = s_upload(&dut, dy, bytes);
    float *d_y = s_nans(&dut, n), *d_dx = s_nans(&dut, n);
    dut.ops->relu_forward(dut.ops->ctx, n, d_x, d_y);
    dut.ops->relu_backward(dut.ops->ctx, n, d_y, d_dy, d_dx);
    float *y = s_fetch(&dut, d_y, bytes), *dx = s_fetch(&dut, d_dx, bytes);
    /* In place, as the worker may call them. */
    dut.ops->relu_forward(dut.ops->ctx, n, d_x, d_x);
    dut.ops->relu_backward(dut.ops->ctx, n, d_y, d_dy, d_dy);
    float *y_in = s_fetch(&dut, d_x, bytes), *dx_in = s_fetch(&dut, d_dy, bytes);

    snprintf(what, sizeof what, "relu y n%zu", n);
    check_bits(what, y, y_ref, n);
    snprintf(what, sizeof what, "relu dx n%zu", n);
    check_bits(what, dx, dx_ref, n);
    snprintf(what, sizeof what, "relu y in place n%zu", n);
    check_bits(what, y_in, y_ref, n);
    snprintf(what, sizeof what, "relu dx in place n%zu", n);
    check_bits(what, dx_in, dx_ref, n);

    free(x), free(dy), free(y_ref), free(dx_ref), free(y), free(dx), free(y_in), free(dx_in);
    s_free(&dut, d_x), s_free(&dut, d_dy), s_free(&dut, d_y), s_free(&dut, d_dx);
  }
}

/* ---- add ---- */

/* One rounding per element, as the reference's a[i] + b[i]: bit for bit
 * (signed zeros and infinities too), into a buffer of its own and in place
 * over either input. */
static void test_add(void) {
  static const size_t sizes[] = {1, 7, 1000, 100003};
  char what[96];
  for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
    const size_t n = sizes[t], bytes = n * sizeof(float);
    float *a = uniform_floats(n, -1, 1), *b = uniform_floats(n, -1, 1);
    for (size_t i = 0; i < n; i++) {
      if (i % 97 == 3) a[i] = -0.0f, b[i] = -0.0f;
      if (i % 89 == 5) a[i] = INFINITY;
    } /* no NaN: a GPU's sum with one is the canonical NaN, not the input's bits */
    float *want = nan_floats(n);
    ref.ops->add(ref.ops->ctx, n, a, b, want);
    float *d_a = s_upload(&dut, a, bytes), *d_b = s_upload(&dut, b, bytes);
    float *d_y = s_nans(&dut, n);
    dut.ops->add(dut.ops->ctx, n, d_a, d_b, d_y);
    float *y = s_fetch(&dut, d_y, bytes);
    dut.ops->add(dut.ops->ctx, n, d_a, d_b, d_a);
    float *y_a = s_fetch(&dut, d_a, bytes);
    s_free(&dut, d_a);
    d_a = s_upload(&dut, a, bytes);
    dut.ops->add(dut.ops->ctx, n, d_a, d_b, d_b);
    float *y_b = s_fetch(&dut, d_b, bytes);
    snprintf(what, sizeof what, "add n%zu", n);
    check_bits(what, y, want, n);
    snprintf(what, sizeof what, "add in place over a n%zu", n);
    check_bits(what, y_a, want, n);
    snprintf(what, sizeof what, "add in place over b n%zu", n);
    check_bits(what, y_b, want, n);
    free(a), free(b), free(want), free(y), free(y_a), free(y_b);
    s_free(&dut, d_a), s_free(&dut, d_b), s_free(&dut, d_y);
  }
}

/* ---- scale ---- */

static void test_scale(void) {
  static const size_t sizes[] = {1, 1000, 100003};
  static const float alphas[] = {0.25f, -3.0f, 1.0f / 3.0f};
  char what[96];
  for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
    const size_t n = sizes[t], bytes = n * sizeof(float);
    float *x = uniform_floats(n, -5, 5);
    float *want = host_alloc(bytes);
    memcpy(want, x, bytes);
    ref.ops->scale(ref.ops->ctx, n, alphas[t], want);
    float *d_x = s_upload(&dut, x, bytes);
    dut.ops->scale(dut.ops->ctx, n, alphas[t], d_x);
    float *got = s_fetch(&dut, d_x, bytes);
    snprintf(what, sizeof what, "scale n%zu by %g", n, (double)alphas[t]);
    check_bits(what, got, want, n); /* one rounded product each */
    free(x), free(want), free(got);
    s_free(&dut, d_x);
  }
}

/* ---- copies beside compute ----
 * The pipelined step's pattern, many times over: pieces of a vector go in
 * with to_device_async, an op reads each piece after it (and must see it),
 * pieces come back with to_host_async after an op wrote them, and the host
 * waits on tickets, more of them than the backend keeps events for. */

/* Host memory for the copies: pinned on the device side, so that they are
 * truly asynchronous. */
static void *s_host_alloc(const side *s, size_t bytes) {
  if (!s->on_device) return host_alloc(bytes);
  void *p = NULL;
  if (ps_cuda_host_alloc(&p, bytes) != 0) die("out of pinned host memory");
  return p;
}

static void s_host_free(const side *s, void *p) {
  if (s->on_device)
    ps_cuda_host_free(p);
  else
    free(p);
}

static void test_async_copies(void) {
  enum { PIECES = 150, PIECE = 4099 }; /* more tickets than the 64 events */
  const size_t n = (size_t)PIECES * PIECE, bytes = n * sizeof(float);
  float *src = s_host_alloc(&dut, bytes), *back = s_host_alloc(&dut, bytes);
  float *x = uniform_floats(n, -1, 1);
  memcpy(src, x, bytes);
  for (size_t i = 0; i < n; i++) back[i] = NAN;
  float *d = s_nans(&dut, n);
  uint64_t *tickets = host_alloc(PIECES * sizeof(uint64_t));
  for (int k = 0; k < PIECES; k++) {
    float *dp = d + (size_t)k * PIECE;
    dut.ops->to_device_async(dut.ops->ctx, dp, src + (size_t)k * PIECE, PIECE * sizeof(float));
    dut.ops->relu_forward(dut.ops->ctx, PIECE, dp, dp); /* must read the piece just copied */
    dut.ops->scale(dut.ops->ctx, PIECE, 2.0f, dp);
    tickets[k] =
        dut.ops->to_host_async(dut.ops->ctx, back + (size_t)k * PIECE, dp, PIECE * sizeof(float));
    CHECK(dut.on_device ? tickets[k] != 0 : tickets[k] == 0);
  }
  /* Waiting in reverse order, on tickets whose events were recorded again
   * since, must still wait long enough. */
  int bad = 0;
  for (int k = PIECES - 1; k >= 0; k--) {
    dut.ops->ticket_wait(dut.ops->ctx, tickets[k]);
    CHECK(dut.ops->ticket_done(dut.ops->ctx, tickets[k]));
    for (size_t i = 0; i < PIECE; i++) {
      const size_t j = (size_t)k * PIECE + i;
      const float want = x[j] > 0.0f ? 2.0f * x[j] : 0.0f;
      bad += memcmp(&back[j], &want, sizeof want) != 0;
    }
  }
  CHECK_MSG(bad == 0, "async copies: %d of %zu values wrong", bad, n);
  CHECK(dut.ops->ticket_done(dut.ops->ctx, 0));
  dut.ops->sync(dut.ops->ctx);
  free(x), free(tickets);
  s_free(&dut, d);
  s_host_free(&dut, src), s_host_free(&dut, back);
}

/* ---- dropout ---- */

typedef struct {
  size_t n;
  float rate;
  uint64_t seed, stream;
} dropout_case;

static void test_dropout(void) {
  static const dropout_case cases[] = {
      {1, 0.5f, 1, 0},
      {1000, 0.25f, 42, 7},
      {100003, 0.5f, 1, 3 * PS_MAX_LAYERS + 9}, /* step 3, layer 9 */
      {4097, 0.0f, 5, 1},                       /* keep all, scale 1 */
      {4097, 1.0f, 5, 1},                       /* drop all */
      {513, 0.9f, UINT64_MAX, UINT64_MAX - 1},  /* the wrap-around of (stream + 1) */
  };
  char what[96];
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const dropout_case *k = &cases[t];
    const size_t n = k->n, bytes = n * sizeof(float);
    float *x = uniform_floats(n, -1, 1), *dy = uniform_floats(n, -1, 1);
    float *y_ref = nan_floats(n), *m_ref = nan_floats(n), *dx_ref = nan_floats(n);
    ref.ops->dropout_forward(ref.ops->ctx, n, k->rate, k->seed, k->stream, x, y_ref, m_ref);
    ref.ops->dropout_backward(ref.ops->ctx, n, m_ref, dy, dx_ref);

    float *d_x = s_upload(&dut, x, bytes), *d_dy = s_upload(&dut, dy, bytes);
    float *d_y = s_nans(&dut, n), *d_m = s_nans(&dut, n), *d_dx = s_nans(&dut, n);
    dut.ops->dropout_forward(dut.ops->ctx, n, k->rate, k->seed, k->stream, d_x, d_y, d_m);
    dut.ops->dropout_backward(dut.ops->ctx, n, d_m, d_dy, d_dx);
    float *y = s_fetch(&dut, d_y, bytes), *m = s_fetch(&dut, d_m, bytes);
    float *dx = s_fetch(&dut, d_dx, bytes);

    /* The mask as ops.h defines it, from ps_rng_uniform directly. */
    const float rate = k->rate;
    const float scale = rate >= 1.0f ? 0.0f : rate <= 0.0f ? 1.0f : 1.0f / (1.0f - rate);
    float *m_want = host_alloc(bytes);
    for (size_t i = 0; i < n; i++)
      m_want[i] = ps_rng_uniform(k->seed, k->stream, i) >= rate ? scale : 0.0f;

    snprintf(what, sizeof what, "dropout mask vs ps_rng_uniform n%zu rate%g", n, (double)rate);
    check_bits(what, m, m_want, n);
    snprintf(what, sizeof what, "dropout mask n%zu rate%g", n, (double)rate);
    check_bits(what, m, m_ref, n);
    snprintf(what, sizeof what, "dropout y n%zu rate%g", n, (double)rate);
    check_bits(what, y, y_ref, n);
    snprintf(what, sizeof what, "dropout dx n%zu rate%g", n, (double)rate);
    check_bits(what, dx, dx_ref, n);

    /* The stream's base kept on the device (set_rng_step), and a graph
     * recorded under one base and replayed under another: the mask of the
     * base of the replay. */
    const uint64_t base = k->stream / 2, rest = k->stream - base;
    float *d_m2 = s_nans(&dut, n), *m2 = NULL;
    dut.ops->set_rng_step(dut.ops->ctx, base);
    dut.ops->dropout_forward(dut.ops->ctx, n, k->rate, k->seed, rest, d_x, d_y, d_m2);
    m2 = s_fetch(&dut, d_m2, bytes);
    snprintf(what, sizeof what, "dropout mask with base %" PRIu64 " n%zu rate%g", base, n,
             (double)rate);
    check_bits(what, m2, m_want, n);
    free(m2);
    dut.ops->set_rng_step(dut.ops->ctx, 12345);
    CHECK(dut.ops->graph_begin(dut.ops->ctx) == 0);
    dut.ops->dropout_forward(dut.ops->ctx, n, k->rate, k->seed, rest, d_x, d_y, d_m2);
    CHECK(dut.ops->graph_end(dut.ops->ctx) == 0);
    dut.ops->set_rng_step(dut.ops->ctx, base);
    CHECK(dut.ops->graph_launch(dut.ops->ctx) == 0);
    m2 = s_fetch(&dut, d_m2, bytes);
    snprintf(what, sizeof what, "dropout mask replayed with base %" PRIu64 " n%zu rate%g", base,
             n, (double)rate);
    check_bits(what, m2, m_want, n);
    dut.ops->set_rng_step(dut.ops->ctx, 0);
    free(m2);
    s_free(&dut, d_m2);

    free(x), free(dy), free(y_ref), free(m_ref), free(dx_ref), free(y), free(m), free(dx),
        free(m_want);
    s_free(&dut, d_x), s_free(&dut, d_dy), s_free(&dut, d_y), s_free(&dut, d_m),
        s_free(&dut, d_dx);
  }
}

/* ---- softmax + cross-entropy ---- */

typedef struct {
  int n, k;
  float scale; /* logits in [-scale, scale] */
  int bad_label; /* one label set to k: the loss is NaN on both */
} xent_case;

static void test_softmax_xent(void) {
  static const xent_case cases[] = {
      {1, 1, 1, 0},   {3, 10, 1, 0},  {64, 10, 3, 0}, {17, 1000, 5, 0},
      {5, 3, 80, 0}, /* large logits: exp would overflow unshifted */
      {4, 256, 1, 0}, {6, 10, 1, 1},
  };
  char what[96];
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const xent_case *c = &cases[t];
    const int n = c->n, k = c->k;
    const size_t nl = (size_t)n * k, bytes = nl * sizeof(float);
    float *logits = uniform_floats(nl, -c->scale, c->scale);
    uint8_t *labels = host_alloc((size_t)n);
    for (int i = 0; i < n; i++) labels[i] = (uint8_t)(rand_unit() * k);
    if (c->bad_label) labels[n / 2] = (uint8_t)k;

    float *p_ref = nan_floats(nl), *d_ref = nan_floats(nl);
    const float loss_ref = ref.ops->softmax_xent_forward(ref.ops->ctx, n, k, logits, labels, p_ref);
    ref.ops->softmax_xent_backward(ref.ops->ctx, n, k, p_ref, labels, d_ref);

    float *d_logits = s_upload(&dut, logits, bytes);
    uint8_t *d_labels = s_upload(&dut, labels, (size_t)n);
    float *d_p = s_nans(&dut, nl), *d_d = s_nans(&dut, nl), *d_d2 = s_nans(&dut, nl);
    float *d_p_ref = s_upload(&dut, p_ref, bytes);
    const float loss = dut.ops->softmax_xent_forward(dut.ops->ctx, n, k, d_logits, d_labels, d_p);
    dut.ops->softmax_xent_backward(dut.ops->ctx, n, k, d_p, d_labels, d_d);
    dut.ops->softmax_xent_backward(dut.ops->ctx, n, k, d_p_ref, d_labels, d_d2);
    float *p = s_fetch(&dut, d_p, bytes), *d = s_fetch(&dut, d_d, bytes);
    float *d2 = s_fetch(&dut, d_d2, bytes);

    snprintf(what, sizeof what, "softmax loss n%d k%d scale%g", n, k, (double)c->scale);
    if (c->bad_label)
      CHECK_MSG(isnan(loss) && isnan(loss_ref), "%s: a bad label gives %g and %g, want NaN", what,
                (double)loss, (double)loss_ref);
    else
      CHECK_MSG(fabs((double)loss - loss_ref) <= 1e-7 + 1e-5 * fabs((double)loss_ref),
                "%s: got %.9g, want %.9g", what, (double)loss, (double)loss_ref);
    snprintf(what, sizeof what, "softmax probs n%d k%d scale%g", n, k, (double)c->scale);
    check_close(what, p, p_ref, nl, 1e-7, 1e-4);
    snprintf(what, sizeof what, "softmax dlogits n%d k%d scale%g", n, k, (double)c->scale);
    check_close(what, d, d_ref, nl, 1e-7, 1e-4);
    snprintf(what, sizeof what, "softmax dlogits from the cpu probs n%d k%d", n, k);
    check_bits(what, d2, d_ref, nl);

    /* Without a wait: the loss sum and the arg-max count, read once. */
    double st_ref[2], st[2];
    float *p_ref2 = nan_floats(nl);
    ref.ops->softmax_xent_stats(ref.ops->ctx, n, k, logits, labels, p_ref2, st_ref);
    double *d_st = dut.ops->alloc(dut.ops->ctx, sizeof st);
    dut.ops->softmax_xent_stats(dut.ops->ctx, n, k, d_logits, d_labels, d_p, d_st);
    dut.ops->to_host(dut.ops->ctx, st, d_st, sizeof st);
    dut.ops->sync(dut.ops->ctx);
    snprintf(what, sizeof what, "softmax stats n%d k%d scale%g", n, k, (double)c->scale);
    if (c->bad_label)
      CHECK_MSG(isnan(st[0]) && isnan(st_ref[0]), "%s: a bad label gives %g and %g, want NaN",
                what, st[0], st_ref[0]);
    else
      CHECK_MSG(fabs(st[0] - st_ref[0]) <= 1e-7 * n + 1e-5 * fabs(st_ref[0]),
                "%s: loss sum %.9g, want %.9g", what, st[0], st_ref[0]);
    CHECK_MSG(st[1] == st_ref[1], "%s: %g correct, the cpu %g", what, st[1], st_ref[1]);
    dut.ops->free(dut.ops->ctx, d_st);
    free(p_ref2);

    free(logits), free(labels), free(p_ref), free(d_ref), free(p), free(d), free(d2);
    s_free(&dut, d_logits), s_free(&dut, d_labels), s_free(&dut, d_p), s_free(&dut, d_d),
        s_free(&dut, d_d2), s_free(&dut, d_p_ref);
  }
  /* An empty batch: loss 0 on both. */
  float any = 0.0f;
  uint8_t label = 0;
  float *d_any = s_nans(&dut, 1);
  CHECK(ref.ops->softmax_xent_forward(ref.ops->ctx, 0, 10, &any, &label, &any) == 0.0f);
  CHECK(dut.ops->softmax_xent_forward(dut.ops->ctx, 0, 10, d_any, (const uint8_t *)d_any, d_any) ==
        0.0f);
  s_free(&dut, d_any);
}

/* ---- embeddings and the logistic loss ----
 * The batch's ids de-duplicated by ps_emb_plan_build on the host, then the
 * ops on both sides from the same plan. embedding_bag_forward and
 * _backward, and copy_cols: bit for bit (the same float sums in the same
 * order, no fused multiply-add, no atomics; ops.h). The cases cover empty
 * bags, duplicates, widths below, at and above a warp, and a hot id in
 * every example (one long serial sum per column on the GPU). */

typedef struct {
  int n, dim, max_bag, pool;
  int hot; /* every bag also holds id 0 */
} emb_case;

static const emb_case emb_cases[] = {
    {1, 1, 1, 1, 0},      {9, 3, 4, 6, 0},        {64, 16, 0, 10, 0}, /* all bags empty */
    {257, 33, 7, 400, 0}, {1000, 8, 30, 5000, 1}, {4096, 64, 26, 100000, 1}, {300, 128, 3, 50, 0},
};

static void emb_one(const emb_case *k, int mean) {
  char what[128];
  const int n = k->n, dim = k->dim;
  int32_t *offsets = host_alloc(((size_t)n + 1) * sizeof(int32_t));
  offsets[0] = 0;
  for (int e = 0; e < n; e++)
    offsets[e + 1] = offsets[e] + (int32_t)(rand_unit() * (k->max_bag + 1)) + (k->hot ? 1 : 0);
  const int32_t total = offsets[n];
  uint64_t *ids = host_alloc((size_t)total * sizeof(uint64_t));
  for (int e = 0; e < n; e++)
    for (int32_t j = offsets[e]; j < offsets[e + 1]; j++)
      ids[j] = k->hot && j == offsets[e] ? 0 : 1 + (uint64_t)(rand_unit() * k->pool);
  ps_emb_plan plan = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  if (ps_emb_plan_build(&plan, ids, offsets, n, err) != 0) die(err);
  const int u = plan.u;
  const size_t ny = (size_t)n * dim, nr = (size_t)u * dim;
  float *rows = uniform_floats(nr, -1, 1), *dy = uniform_floats(ny, -1, 1);
  float *y_ref = nan_floats(ny), *dr_ref = nan_floats(nr);
  ref.ops->embedding_bag_forward(ref.ops->ctx, n, dim, offsets, plan.idx, mean, rows, y_ref);
  ref.ops->embedding_bag_backward(ref.ops->ctx, n, dim, offsets, u, plan.rev_off, plan.rev_ex, mean,
                                  dy, dr_ref);

  int32_t *d_off = s_upload(&dut, offsets, ((size_t)n + 1) * sizeof(int32_t));
  int32_t *d_idx = s_upload(&dut, plan.idx, (size_t)total * sizeof(int32_t));
  int32_t *d_roff = s_upload(&dut, plan.rev_off, ((size_t)u + 1) * sizeof(int32_t));
  int32_t *d_rex = s_upload(&dut, plan.rev_ex, (size_t)total * sizeof(int32_t));
  float *d_rows = s_upload(&dut, rows, nr * sizeof(float));
  float *d_dy = s_upload(&dut, dy, ny * sizeof(float));
  float *d_y = s_nans(&dut, ny), *d_dr = s_nans(&dut, nr);
  dut.ops->embedding_bag_forward(dut.ops->ctx, n, dim, d_off, d_idx, mean, d_rows, d_y);
  dut.ops->embedding_bag_backward(dut.ops->ctx, n, dim, d_off, u, d_roff, d_rex, mean, d_dy, d_dr);
  float *y = s_fetch(&dut, d_y, ny * sizeof(float)), *dr = s_fetch(&dut, d_dr, nr * sizeof(float));

  snprintf(what, sizeof what, "embedding_bag_forward n%d dim%d u%d %s", n, dim, u,
           mean ? "mean" : "sum");
  check_bits(what, y, y_ref, ny);
  snprintf(what, sizeof what, "embedding_bag_backward n%d dim%d u%d %s", n, dim, u,
           mean ? "mean" : "sum");
  check_bits(what, dr, dr_ref, nr);

  free(offsets), free(ids), free(rows), free(dy), free(y_ref), free(dr_ref), free(y), free(dr);
  s_free(&dut, d_off), s_free(&dut, d_idx), s_free(&dut, d_roff), s_free(&dut, d_rex);
  s_free(&dut, d_rows), s_free(&dut, d_dy), s_free(&dut, d_y), s_free(&dut, d_dr);
  ps_emb_plan_free(&plan);
}

static void test_embedding_bag(void) {
  for (size_t i = 0; i < sizeof emb_cases / sizeof emb_cases[0]; i++) {
    emb_one(&emb_cases[i], 0);
    emb_one(&emb_cases[i], 1);
  }
}

/* Columns [at, at + width) of an (n, wide) matrix into the columns [to,
 * to + width) of an (n, wide2) one prefilled with NaN: the copied columns
 * bit for bit, the others still NaN on both. */
static void test_copy_cols(void) {
  static const int cases[][5] = {
      /* n, width, wide, at, to */
      {1, 1, 1, 0, 0},
      {37, 3, 10, 4, 2},
      {1000, 16, 80, 64, 0},
      {4096, 13, 39, 26, 13},
  };
  char what[96];
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const int n = cases[t][0], width = cases[t][1], wide = cases[t][2], at = cases[t][3];
    const int to = cases[t][4], wide2 = to + width + 3;
    const size_t ns = (size_t)n * wide, nd = (size_t)n * wide2;
    float *src = uniform_floats(ns, -1, 1), *want = nan_floats(nd);
    ref.ops->copy_cols(ref.ops->ctx, n, width, src + at, wide, want + to, wide2);
    float *d_src = s_upload(&dut, src, ns * sizeof(float)), *d_dst = s_nans(&dut, nd);
    dut.ops->copy_cols(dut.ops->ctx, n, width, d_src + at, wide, d_dst + to, wide2);
    float *got = s_fetch(&dut, d_dst, nd * sizeof(float));
    snprintf(what, sizeof what, "copy_cols n%d width%d", n, width);
    check_bits(what, got, want, nd);
    free(src), free(want), free(got);
    s_free(&dut, d_src), s_free(&dut, d_dst);
  }
}

/* The factorization-machine interaction (fm_forward, fm_backward): the
 * same float sums in the same order on both sides, so bit for bit. */
static void test_fm(void) {
  static const int cases[][3] = {
      /* n, fields, dim */
      {1, 2, 1},
      {37, 26, 8},
      {512, 26, 16},
      {3, 100, 5},
  };
  char what[96];
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const int n = cases[t][0], f = cases[t][1], d = cases[t][2];
    const size_t nx = (size_t)n * f * d, ny = (size_t)n * d;
    float *x = uniform_floats(nx, -1, 1), *dy = uniform_floats(ny, -1, 1);
    float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx);
    ref.ops->fm_forward(ref.ops->ctx, n, f, d, x, y_ref);
    ref.ops->fm_backward(ref.ops->ctx, n, f, d, x, dy, dx_ref);
    float *d_x = s_upload(&dut, x, nx * sizeof(float)), *d_dy = s_upload(&dut, dy, ny * sizeof(float));
    float *d_y = s_nans(&dut, ny), *d_dx = s_nans(&dut, nx);
    dut.ops->fm_forward(dut.ops->ctx, n, f, d, d_x, d_y);
    dut.ops->fm_backward(dut.ops->ctx, n, f, d, d_x, d_dy, d_dx);
    float *y = s_fetch(&dut, d_y, ny * sizeof(float)), *dx = s_fetch(&dut, d_dx, nx * sizeof(float));
    snprintf(what, sizeof what, "fm_forward n%d f%d d%d", n, f, d);
    check_bits(what, y, y_ref, ny);
    snprintf(what, sizeof what, "fm_backward n%d f%d d%d", n, f, d);
    check_bits(what, dx, dx_ref, nx);
    free(x), free(dy), free(y_ref), free(dx_ref), free(y), free(dx);
    s_free(&dut, d_x), s_free(&dut, d_dy), s_free(&dut, d_y), s_free(&dut, d_dx);
  }
}

/* The logistic loss. Probabilities: both sides compute them in double and
 * round to float, so they agree but for the last bit of the double exp
 * (rtol 1e-6, atol 1e-30 for the tiny ones of x near -100). The loss sum:
 * each loss in double, summed in a fixed tree rather than in order: rtol
 * 1e-6 as ops.h promises (1e-15 expected). The count of right predictions
 * exactly (no logit is within 1e-6 of 0). The gradient from the CPU's
 * probabilities bit for bit (two roundings each), from its own within the
 * probabilities' tolerance. */
static void test_sigmoid_xent(void) {
  static const int sizes[] = {1, 7, 256, 1000, 65537};
  char what[96];
  for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
    const int n = sizes[t];
    const size_t bytes = (size_t)n * sizeof(float);
    float *logits = uniform_floats((size_t)n, -8, 8), *labels = host_alloc(bytes);
    for (int i = 0; i < n; i++) {
      labels[i] = rand_unit() < 0.5 ? 0.0f : 1.0f;
      if (i % 101 == 5) logits[i] = i % 2 ? 100.0f : -100.0f;
      if (fabsf(logits[i]) < 1e-6f) logits[i] = 0.5f;
    }
    float *p_ref = nan_floats((size_t)n), *g_ref = nan_floats((size_t)n);
    double st_ref[2] = {NAN, NAN};
    ref.ops->sigmoid_xent_forward(ref.ops->ctx, n, logits, labels, p_ref, st_ref);
    ref.ops->sigmoid_xent_backward(ref.ops->ctx, n, p_ref, labels, g_ref);

    float *d_x = s_upload(&dut, logits, bytes), *d_y = s_upload(&dut, labels, bytes);
    float *d_p = s_nans(&dut, (size_t)n), *d_g = s_nans(&dut, (size_t)n);
    float *d_g2 = s_nans(&dut, (size_t)n), *d_p_ref = s_upload(&dut, p_ref, bytes);
    const double nan2[2] = {NAN, NAN};
    double *d_st = s_upload(&dut, nan2, sizeof nan2);
    dut.ops->sigmoid_xent_forward(dut.ops->ctx, n, d_x, d_y, d_p, d_st);
    dut.ops->sigmoid_xent_backward(dut.ops->ctx, n, d_p, d_y, d_g);
    dut.ops->sigmoid_xent_backward(dut.ops->ctx, n, d_p_ref, d_y, d_g2);
    float *p = s_fetch(&dut, d_p, bytes), *g = s_fetch(&dut, d_g, bytes);
    float *g2 = s_fetch(&dut, d_g2, bytes);
    double st[2];
    s_get(&dut, st, d_st, sizeof st);

    snprintf(what, sizeof what, "sigmoid probs n%d", n);
    check_close(what, p, p_ref, (size_t)n, 1e-30, 1e-6);
    snprintf(what, sizeof what, "sigmoid dlogits n%d", n);
    check_close(what, g, g_ref, (size_t)n, 1e-30, 1e-6);
    snprintf(what, sizeof what, "sigmoid dlogits from the cpu probs n%d", n);
    check_bits(what, g2, g_ref, (size_t)n);
    CHECK_MSG(isfinite(st[0]) && fabs(st[0] - st_ref[0]) <= 1e-6 * fabs(st_ref[0]),
              "sigmoid loss sum n%d: %.17g, the cpu %.17g", n, st[0], st_ref[0]);
    CHECK_MSG(st[1] == st_ref[1], "sigmoid right n%d: %g, the cpu %g", n, st[1], st_ref[1]);

    free(logits), free(labels), free(p_ref), free(g_ref), free(p), free(g), free(g2);
    s_free(&dut, d_x), s_free(&dut, d_y), s_free(&dut, d_p), s_free(&dut, d_g);
    s_free(&dut, d_g2), s_free(&dut, d_p_ref), s_free(&dut, d_st);
  }
  /* An empty batch: {0, 0} on both. */
  double st[2], st_ref[2] = {NAN, NAN};
  const double nan2[2] = {NAN, NAN};
  float any = 0.0f;
  float *d_any = s_nans(&dut, 1);
  double *d_st = s_upload(&dut, nan2, sizeof nan2);
  ref.ops->sigmoid_xent_forward(ref.ops->ctx, 0, &any, &any, &any, st_ref);
  dut.ops->sigmoid_xent_forward(dut.ops->ctx, 0, d_any, d_any, d_any, d_st);
  s_get(&dut, st, d_st, sizeof st);
  CHECK(st_ref[0] == 0.0 && st_ref[1] == 0.0 && st[0] == 0.0 && st[1] == 0.0);
  s_free(&dut, d_any), s_free(&dut, d_st);
}

/* ---- the memory helpers (CUDA only) ---- */

/* Not inlined: compute-sanitizer's memcheck reports the refused allocation
 * below as an API error, and tests/gpu/sanitizer_report.py knows it for the
 * expected one by this function's frame in its backtrace. */
__attribute__((noinline)) static void test_memory_helpers(void) {
  void *p = (void *)1;
  CHECK(ps_cuda_alloc(&p, 0) == 0 && p == NULL);
  /* Out of device memory is an error code, not an abort, and the device
   * goes on working. */
  p = (void *)1;
  CHECK(ps_cuda_alloc(&p, (size_t)1 << 60) == PS_ENOMEM && p == NULL);

  enum { N = 4099 };
  float *h = NULL, *back = NULL;
  CHECK(ps_cuda_host_alloc((void **)&h, N * sizeof(float)) == 0 && h != NULL);
  CHECK(ps_cuda_host_alloc((void **)&back, N * sizeof(float)) == 0 && back != NULL);
  if (!h || !back) return;
  for (int i = 0; i < N; i++) h[i] = (float)i - 7.5f;
  float *a = NULL, *b = NULL;
  CHECK(ps_cuda_alloc((void **)&a, N * sizeof(float)) == 0);
  CHECK(ps_cuda_alloc((void **)&b, N * sizeof(float)) == 0);
  ps_cuda_make_current(dut.ops);
  ps_cuda_memcpy_h2d(dut.ops, a, h, N * sizeof(float));
  ps_cuda_memcpy_d2d(dut.ops, b, a, N * sizeof(float));
  dut.ops->relu_forward(dut.ops->ctx, N, b, b); /* ordered after the copies */
  ps_cuda_memcpy_d2h(dut.ops, back, b, N * sizeof(float));
  ps_cuda_sync(dut.ops);
  int ok = 1;
  for (int i = 0; i < N; i++) ok &= back[i] == (h[i] > 0.0f ? h[i] : 0.0f);
  CHECK_MSG(ok, "h2d, d2d, relu, d2h in stream order");
  ps_cuda_memset_zero(dut.ops, b, N * sizeof(float));
  ps_cuda_memcpy_d2h(dut.ops, back, b, N * sizeof(float));
  ps_cuda_sync(dut.ops);
  ok = 1;
  for (int i = 0; i < N; i++) ok &= back[i] == 0.0f;
  CHECK_MSG(ok, "memset_zero");
  ps_cuda_free(a);
  ps_cuda_free(b);
  ps_cuda_free(NULL);
  ps_cuda_host_free(h);
  ps_cuda_host_free(back);
  ps_cuda_host_free(NULL);

  /* A device index that does not exist: NULL and a message. */
  char err[PS_ERRLEN] = "";
  CHECK(ps_ops_cuda_create(1 << 20, err) == NULL && err[0] != '\0');
}

/* ---- end to end: the quickstart CNN, 20 SGD steps on both ---- */

/* deploy/jobs/fashion_mnist_cnn.json's model, with a dropout layer so that
 * the masks take part. */
static const char *CNN_JSON =
    "{\"input\": [1, 28, 28], \"classes\": 10, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 32, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"relu\"}, {\"type\": \"maxpool\", \"size\": 2},"
    "{\"type\": \"conv2d\", \"filters\": 64, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"relu\"}, {\"type\": \"maxpool\", \"size\": 2},"
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 128}, {\"type\": \"relu\"},"
    "{\"type\": \"dropout\", \"rate\": 0.25},"
    "{\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}";

enum { CNN_BATCH = 32, CNN_STEPS = 20, CNN_BATCHES = 4 };
static const float CNN_LR = 0.02f;

/* A model on one side, as worker/model/model.c builds it (which is host-only):
 * per-layer outputs, argmax and masks, gradient ping-pong buffers. */
typedef struct {
  const side *sd;
  const ps_model_spec *spec;
  int batch;
  float *params, *grads, *x, *work, *ga, *gb, *probs; /* side memory */
  uint8_t *y;
  float *out[PS_MAX_LAYERS], *mask[PS_MAX_LAYERS];
  const float *in[PS_MAX_LAYERS]; /* each layer's input, set by the forward pass */
  int32_t *argmax[PS_MAX_LAYERS];
  float *bn[PS_MAX_LAYERS]; /* batchnorm: the batch's mean, var, invstd (3 x C) */
  /* conv2d and dense without a bias (b_count 0): a zero bias, and a place
   * for its gradient that nobody reads (as worker/model/model.c) */
  float *zero_bias, *db_sink;
  ps_conv_shape conv[PS_MAX_LAYERS];
  ps_pool_shape pool[PS_MAX_LAYERS];
} net;

static size_t in_size(const ps_layer *L) { return (size_t)L->in_c * L->in_h * L->in_w; }
static size_t out_size(const ps_layer *L) { return (size_t)L->out_c * L->out_h * L->out_w; }

static void net_init(net *m, const side *sd, const ps_model_spec *spec, int batch) {
  memset(m, 0, sizeof *m);
  m->sd = sd, m->spec = spec, m->batch = batch;
  ps_ops *o = sd->ops;
  size_t work = 0, largest = (size_t)spec->in_c * spec->in_h * spec->in_w, no_bias = 1;
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    const size_t n_out = out_size(L) * (size_t)batch;
    if (out_size(L) > largest) largest = out_size(L);
    if (L->type == PS_LAYER_CONV2D) {
      m->conv[i] = (ps_conv_shape){.n = batch, .c = L->in_c, .h = L->in_h, .w = L->in_w,
                                   .oc = L->filters, .kh = L->kernel, .kw = L->kernel,
                                   .stride = L->stride, .pad = L->pad};
      ps_conv_shape_finish(&m->conv[i]);
      const size_t ws = o->conv2d_workspace(o->ctx, &m->conv[i]);
      if (ws > work) work = ws;
    } else if (L->type == PS_LAYER_MAXPOOL || L->type == PS_LAYER_AVGPOOL) {
      m->pool[i] = (ps_pool_shape){.n = batch, .c = L->in_c, .h = L->in_h, .w = L->in_w,
                                   .size = L->pool, .stride = L->pool_stride};
      ps_pool_shape_finish(&m->pool[i]);
      if (L->type == PS_LAYER_MAXPOOL) m->argmax[i] = s_alloc(sd, n_out * sizeof(int32_t));
    } else if (L->type == PS_LAYER_DROPOUT) {
      m->mask[i] = s_alloc(sd, n_out * sizeof(float));
    } else if (L->type == PS_LAYER_BATCHNORM) {
      m->bn[i] = s_alloc(sd, 3 * (size_t)L->in_c * sizeof(float));
    }
    if ((L->type == PS_LAYER_CONV2D || L->type == PS_LAYER_DENSE) && L->b_count == 0 &&
        (size_t)L->out_c > no_bias)
      no_bias = (size_t)L->out_c;
    if (L->type != PS_LAYER_FLATTEN && L->type != PS_LAYER_SOFTMAX_XENT)
      m->out[i] = s_alloc(sd, n_out * sizeof(float));
  }
  m->work = s_alloc(sd, work * sizeof(float));
  float *zeros = host_alloc(no_bias * sizeof(float));
  memset(zeros, 0, no_bias * sizeof(float));
  m->zero_bias = s_upload(sd, zeros, no_bias * sizeof(float));
  m->db_sink = s_alloc(sd, no_bias * sizeof(float));
  free(zeros);
  m->ga = s_alloc(sd, largest * (size_t)batch * sizeof(float));
  m->gb = s_alloc(sd, largest * (size_t)batch * sizeof(float));
  m->probs = s_alloc(sd, (size_t)spec->classes * batch * sizeof(float));
  m->params = s_alloc(sd, spec->n_params * sizeof(float));
  m->grads = s_alloc(sd, spec->n_params * sizeof(float));
  m->x = s_alloc(sd, (size_t)spec->in_c * spec->in_h * spec->in_w * batch * sizeof(float));
  m->y = s_alloc(sd, (size_t)batch);
}

static void net_free(net *m) {
  for (int i = 0; i < m->spec->n_layers; i++) {
    if (m->out[i]) s_free(m->sd, m->out[i]);
    if (m->mask[i]) s_free(m->sd, m->mask[i]);
    if (m->argmax[i]) s_free(m->sd, m->argmax[i]);
    if (m->bn[i]) s_free(m->sd, m->bn[i]);
  }
  void *bufs[] = {m->work,  m->ga, m->gb, m->probs,     m->params,
                  m->grads, m->x,  m->y,  m->zero_bias, m->db_sink};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) s_free(m->sd, bufs[i]);
}

/* Layer L's bias in params (the zero one when it has none), and where its
 * bias gradient goes in grads. */
static const float *net_bias(const net *m, const ps_layer *L, const float *p) {
  return L->b_count ? p + L->b_off : m->zero_bias;
}

static float *net_bias_grad(const net *m, const ps_layer *L, float *g) {
  return L->b_count ? g + L->b_off : m->db_sink;
}

/* One training step on the host's params, batch and labels: the mean loss,
 * and the gradient into grads_host (P floats). Dropout masks from (seed,
 * step), as the worker draws them. */
static float net_step(net *m, const float *params_host, const float *x_host,
                      const uint8_t *y_host, uint64_t seed, uint64_t step, float *grads_host) {
  const ps_model_spec *spec = m->spec;
  ps_ops *o = m->sd->ops;
  const int n = m->batch;
  s_put(m->sd, m->params, params_host, spec->n_params * sizeof(float));
  s_put(m->sd, m->x, x_host, (size_t)spec->in_c * spec->in_h * spec->in_w * n * sizeof(float));
  s_put(m->sd, m->y, y_host, (size_t)n);
  const float *p = m->params, *act = m->x;
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    const size_t n_out = out_size(L) * (size_t)n;
    m->in[i] = act;
    switch (L->type) {
      case PS_LAYER_CONV2D:
        o->conv2d_forward(o->ctx, &m->conv[i], act, p + L->w_off, net_bias(m, L, p), m->out[i],
                          m->work);
        break;
      case PS_LAYER_MAXPOOL:
        o->maxpool_forward(o->ctx, &m->pool[i], act, m->out[i], m->argmax[i]);
        break;
      case PS_LAYER_AVGPOOL: o->avgpool_forward(o->ctx, &m->pool[i], act, m->out[i]); break;
      case PS_LAYER_GLOBAL_AVGPOOL:
        o->global_avgpool_forward(o->ctx, n, L->in_c, L->in_h, L->in_w, act, m->out[i]);
        break;
      case PS_LAYER_DENSE:
        o->dense_forward(o->ctx, n, (int)in_size(L), L->units, act, p + L->w_off, net_bias(m, L, p),
                         m->out[i]);
        break;
      case PS_LAYER_BATCHNORM: { /* training: the batch's statistics, kept for backward */
        const int c = L->in_c;
        o->batchnorm_forward_train(o->ctx, n, c, L->in_h * L->in_w, L->epsilon, act, p + L->w_off,
                                   p + L->b_off, m->out[i], m->bn[i], m->bn[i] + c,
                                   m->bn[i] + 2 * c);
        break;
      }
      case PS_LAYER_RELU:
        o->relu_forward(o->ctx, n_out, act, m->out[i]);
        break;
      case PS_LAYER_DROPOUT:
        o->dropout_forward(o->ctx, n_out, L->rate, seed, step * PS_MAX_LAYERS + (uint64_t)i, act,
                           m->out[i], m->mask[i]);
        break;
      default: /* the embedding models' layers: not in these chains (test_fm, test_embedding_bag) */
        break;
      case PS_LAYER_FLATTEN:
      case PS_LAYER_SOFTMAX_XENT:
      case PS_LAYER_ADD: /* none in the chains here (residual models: test_model.c) */
        break;
    }
    if (m->out[i]) act = m->out[i];
  }
  const int k = spec->classes;
  const float loss = o->softmax_xent_forward(o->ctx, n, k, act, m->y, m->probs);
  float *dy = m->ga, *dx = m->gb;
  o->softmax_xent_backward(o->ctx, n, k, m->probs, m->y, dy);
  for (int i = spec->n_layers - 1; i >= 0; i--) {
    const ps_layer *L = &spec->layers[i];
    if (L->type == PS_LAYER_SOFTMAX_XENT || L->type == PS_LAYER_FLATTEN) continue;
    const int first = m->in[i] == m->x; /* no gradient for the batch itself */
    float *dxp = first ? NULL : dx;
    const size_t n_out = out_size(L) * (size_t)n;
    float *g = m->grads;
    switch (L->type) {
      case PS_LAYER_CONV2D:
        o->conv2d_backward(o->ctx, &m->conv[i], m->in[i], p + L->w_off, dy, dxp, g + L->w_off,
                           net_bias_grad(m, L, g), m->work);
        break;
      case PS_LAYER_MAXPOOL:
        if (dxp) o->maxpool_backward(o->ctx, &m->pool[i], dy, m->argmax[i], dxp);
        break;
      case PS_LAYER_AVGPOOL:
        if (dxp) o->avgpool_backward(o->ctx, &m->pool[i], dy, dxp);
        break;
      case PS_LAYER_GLOBAL_AVGPOOL:
        if (dxp) o->global_avgpool_backward(o->ctx, n, L->in_c, L->in_h, L->in_w, dy, dxp);
        break;
      case PS_LAYER_DENSE:
        o->dense_backward(o->ctx, n, (int)in_size(L), L->units, m->in[i], p + L->w_off, dy, dxp,
                          g + L->w_off, net_bias_grad(m, L, g));
        break;
      case PS_LAYER_BATCHNORM: {
        const int c = L->in_c;
        o->batchnorm_backward(o->ctx, n, c, L->in_h * L->in_w, m->in[i], dy, p + L->w_off, m->bn[i],
                              m->bn[i] + 2 * c, dxp, g + L->w_off, g + L->b_off);
        /* The moving statistics' places carry the batch's mean and
         * variance, as the worker pushes them. */
        o->copy(o->ctx, g + L->s_off, m->bn[i], 2 * (size_t)c * sizeof(float));
        break;
      }
      case PS_LAYER_RELU:
        if (dxp) o->relu_backward(o->ctx, n_out, m->out[i], dy, dxp);
        break;
      case PS_LAYER_DROPOUT:
        if (dxp) o->dropout_backward(o->ctx, n_out, m->mask[i], dy, dxp);
        break;
      default:
        break;
    }
    if (first) break;
    float *t = dy;
    dy = dx;
    dx = t;
  }
  s_get(m->sd, grads_host, m->grads, spec->n_params * sizeof(float));
  return loss;
}

/* Learnable synthetic images: class c lights a 6x6 block whose place
 * depends on c, over noise everywhere (no two patches alike, so no exact
 * ties in the pooling that rounding could break differently). */
static void cnn_data(float *x, uint8_t *y, int n) {
  for (int i = 0; i < n; i++) {
    const int c = (int)(rand_unit() * 10);
    y[i] = (uint8_t)c;
    float *img = x + (size_t)i * 28 * 28;
    for (int j = 0; j < 28 * 28; j++) img[j] = 0.3f * (float)rand_unit();
    const int r0 = 2 + (c % 5) * 5, c0 = 4 + (c / 5) * 12;
    for (int r = r0; r < r0 + 6; r++)
      for (int q = c0; q < c0 + 6; q++) img[r * 28 + q] += 0.7f;
  }
}

/* Tolerances. Step 0 runs both sides on the same parameters and batch, so
 * the loss differs by float rounding only: rtol 1e-5. Its gradient is
 * compared per tensor in relative L2 norm, <= 5e-2: a relu or pooling
 * decision within rounding of a tie (an activation within ~1e-7 of 0 in a
 * window of zeros; rare, by our estimate about once in a hundred steps at
 * this size) sends one position's gradient elsewhere, which moves a conv
 * layer's gradient by about 1/sqrt(positions) ~ 1.3e-2 of its norm; a layout
 * or indexing mistake moves it by O(1). Later steps start from parameters that have drifted apart by
 * what those differences fed through SGD; the losses must stay within rtol
 * 1e-3. lr 0.02 keeps the run out of the chaotic regime: measured on the
 * CPU (self-test), multiplying one side's gradients by 1 + 1e-3 * noise at
 * every step moved the losses apart by at most 4e-4 relative, and by 3e-7
 * with 1e-4 noise, while the CUDA and CPU gradients differ by ~1e-6 (at
 * lr 0.05 the same 1e-4 noise gave 2.5e-3). Both must also learn: the mean
 * of the last five losses below 0.8 of the first (2.5 -> 0.46 on the CPU). */
static void test_cnn_trajectory(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  if (ps_model_spec_parse(CNN_JSON, &spec, err) != 0) {
    CHECK_MSG(0, "spec: %s", err);
    return;
  }
  const size_t P = spec.n_params, in = (size_t)28 * 28;
  float *params0 = host_alloc(P * sizeof(float));
  ps_model_init_params(&spec, 7, 0, P, params0);
  float *xs = host_alloc((size_t)CNN_BATCHES * CNN_BATCH * in * sizeof(float));
  uint8_t *ys = host_alloc((size_t)CNN_BATCHES * CNN_BATCH);
  cnn_data(xs, ys, CNN_BATCHES * CNN_BATCH);

  const side *sides[2] = {&ref, &dut};
  float loss[2][CNN_STEPS];
  float *grads0[2];
  for (int s = 0; s < 2; s++) {
    net m;
    net_init(&m, sides[s], &spec, CNN_BATCH);
    float *params = host_alloc(P * sizeof(float)), *grads = host_alloc(P * sizeof(float));
    memcpy(params, params0, P * sizeof(float));
    for (int t = 0; t < CNN_STEPS; t++) {
      const int b = t % CNN_BATCHES;
      loss[s][t] = net_step(&m, params, xs + (size_t)b * CNN_BATCH * in, ys + b * CNN_BATCH, 11,
                            (uint64_t)t, grads);
      if (t == 0) {
        grads0[s] = host_alloc(P * sizeof(float));
        memcpy(grads0[s], grads, P * sizeof(float));
      }
      for (size_t j = 0; j < P; j++) params[j] -= CNN_LR * grads[j];
    }
    net_free(&m);
    free(params), free(grads);
  }

  printf("quickstart CNN, batch %d, SGD lr %g: loss per step (%s, %s)\n", CNN_BATCH,
         (double)CNN_LR, ref.name, dut.name);
  double worst = 0.0;
  for (int t = 0; t < CNN_STEPS; t++) {
    const double rel = fabs((double)loss[1][t] - loss[0][t]) / fabs((double)loss[0][t]);
    if (rel > worst) worst = rel;
    printf("  step %2d  %.7f  %.7f  rel diff %.2e\n", t, (double)loss[0][t], (double)loss[1][t],
           rel);
    CHECK_MSG(isfinite(loss[1][t]) && rel <= (t == 0 ? 1e-5 : 1e-3), "step %d: loss %.9g vs %.9g",
              t, (double)loss[1][t], (double)loss[0][t]);
  }
  printf("  worst relative loss difference %.2e\n", worst);
  for (int i = 0; i < spec.n_layers; i++) {
    const ps_layer *L = &spec.layers[i];
    if (!L->w_count) continue;
    const double ew = rel_l2(grads0[1] + L->w_off, grads0[0] + L->w_off, L->w_count);
    const double eb = rel_l2(grads0[1] + L->b_off, grads0[0] + L->b_off, L->b_count);
    printf("  step 0 gradient of %s: relative L2 difference w %.2e, b %.2e\n", L->name, ew, eb);
    CHECK_MSG(ew <= 5e-2 && eb <= 5e-2, "%s: step 0 gradients differ: w %.3g, b %.3g", L->name,
              ew, eb);
  }
  for (int s = 0; s < 2; s++) {
    double last = 0.0;
    for (int t = CNN_STEPS - 5; t < CNN_STEPS; t++) last += loss[s][t] / 5.0;
    CHECK_MSG(last < 0.8 * loss[s][0], "%s does not learn: %.4f then %.4f", sides[s]->name,
              (double)loss[s][0], last);
  }
  free(params0), free(xs), free(ys), free(grads0[0]), free(grads0[1]);
}

/* A CNN with both average poolings: one step on both sides from the same
 * parameters and batch. The loss within float rounding (rtol 1e-5, as step
 * 0 above); each parameter gradient within 1e-3 relative L2: averages
 * have no ties to break differently, so only the convolutions' and dense
 * layers' sums differ, by ~1e-6, and a relu decision within rounding of 0
 * (rare) moves one position's gradient. */
static const char *AVG_CNN_JSON =
    "{\"input\": [1, 28, 28], \"classes\": 10, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 16, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"relu\"}, {\"type\": \"avgpool\", \"size\": 2},"
    "{\"type\": \"conv2d\", \"filters\": 32, \"kernel\": 3, \"stride\": 2},"
    "{\"type\": \"relu\"}, {\"type\": \"avgpool\", \"size\": 3, \"stride\": 1},"
    "{\"type\": \"global_avgpool\"}, {\"type\": \"flatten\"},"
    "{\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}";

/* One training step of spec from params on both sides, on the same batch
 * of CNN_BATCH examples: the loss within rtol 1e-5 and each layer's
 * gradients (weights, biases) within 1e-3 relative L2, batchnorm's batch
 * statistics (in the moving statistics' places) within 1e-4. what names
 * the model in the messages. */
static void cnn_step_both(const char *what, const ps_model_spec *spec, const float *params) {
  const size_t P = spec->n_params, in = (size_t)28 * 28;
  float *x = host_alloc((size_t)CNN_BATCH * in * sizeof(float));
  uint8_t *y = host_alloc(CNN_BATCH);
  cnn_data(x, y, CNN_BATCH);
  const side *sides[2] = {&ref, &dut};
  float loss[2], *grads[2];
  for (int s = 0; s < 2; s++) {
    net m;
    net_init(&m, sides[s], spec, CNN_BATCH);
    grads[s] = host_alloc(P * sizeof(float));
    loss[s] = net_step(&m, params, x, y, 3, 0, grads[s]);
    net_free(&m);
  }
  const double rel = fabs((double)loss[1] - loss[0]) / fabs((double)loss[0]);
  CHECK_MSG(isfinite(loss[1]) && rel <= 1e-5, "%s: loss %.9g vs %.9g", what, (double)loss[1],
            (double)loss[0]);
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    if (!L->w_count) continue;
    const double ew = rel_l2(grads[1] + L->w_off, grads[0] + L->w_off, L->w_count);
    const double eb = rel_l2(grads[1] + L->b_off, grads[0] + L->b_off, L->b_count);
    CHECK_MSG(ew <= 1e-3 && eb <= 1e-3, "%s %s: gradients differ: w %.3g, b %.3g", what, L->name,
              ew, eb);
    if (L->type == PS_LAYER_BATCHNORM) {
      const double es = rel_l2(grads[1] + L->s_off, grads[0] + L->s_off, L->s_count);
      CHECK_MSG(es <= 1e-4, "%s %s: batch statistics differ: %.3g", what, L->name, es);
    }
  }
  free(x), free(y), free(grads[0]), free(grads[1]);
}

static void test_avg_cnn_step(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  if (ps_model_spec_parse(AVG_CNN_JSON, &spec, err) != 0) {
    CHECK_MSG(0, "spec: %s", err);
    return;
  }
  float *params = host_alloc(spec.n_params * sizeof(float));
  ps_model_init_params(&spec, 5, 0, spec.n_params, params);
  cnn_step_both("avgpool CNN", &spec, params);
  free(params);
}

/* A CNN with batch normalization after convolutions and a dense layer
 * without biases: one training step on both sides from the same parameters
 * and batch, checked as test_avg_cnn_step (loss rtol 1e-5; each gradient,
 * gamma's and beta's too, within 1e-3 relative L2), and the batch
 * statistics each side puts in the moving statistics' places (means and
 * variances of the layers' inputs, which carry the convolutions' ~1e-6
 * differences) within 1e-4 relative L2. Average pooling again, so that no
 * tie is broken differently. */
static const char *BN_CNN_JSON =
    "{\"input\": [1, 28, 28], \"classes\": 10, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 8, \"kernel\": 3, \"padding\": \"same\", "
    "\"bias\": false},"
    "{\"type\": \"batchnorm\"}, {\"type\": \"relu\"}, {\"type\": \"avgpool\", \"size\": 2},"
    "{\"type\": \"conv2d\", \"filters\": 12, \"kernel\": 3, \"stride\": 2, \"bias\": false},"
    "{\"type\": \"batchnorm\", \"epsilon\": 1e-5}, {\"type\": \"relu\"},"
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 24, \"bias\": false},"
    "{\"type\": \"batchnorm\", \"momentum\": 0.9}, {\"type\": \"relu\"},"
    "{\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}";

static void test_bn_cnn_step(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  if (ps_model_spec_parse(BN_CNN_JSON, &spec, err) != 0) {
    CHECK_MSG(0, "spec: %s", err);
    return;
  }
  float *params = host_alloc(spec.n_params * sizeof(float));
  ps_model_init_params(&spec, 9, 0, spec.n_params, params);
  /* gamma and beta away from their initial 1 and 0, so that a mix-up of
   * the two (or of channels) shows. */
  for (int i = 0; i < spec.n_layers; i++) {
    const ps_layer *L = &spec.layers[i];
    if (L->type != PS_LAYER_BATCHNORM) continue;
    for (size_t j = 0; j < L->w_count; j++) params[L->w_off + j] = 0.5f + (float)rand_unit();
    for (size_t j = 0; j < L->b_count; j++) params[L->b_off + j] = (float)rand_unit() - 0.5f;
  }
  cnn_step_both("batchnorm CNN", &spec, params);
  free(params);
}

int main(void) {
  char why[128] = "";
  const int devices = ps_cuda_device_count(why);
  const char *selftest = getenv("PS_PARITY_SELFTEST");
  const int self = devices == 0 && selftest && strcmp(selftest, "1") == 0;
  if (devices == 0 && !self) {
    printf("SKIPPED: no CUDA device (%s)\n", why);
    return 77;
  }
  ref = (side){.name = "cpu", .ops = ps_ops_cpu_create(0)};
  if (self) {
    printf("no CUDA device (%s): self-test, a 2-thread cpu backend in place of cuda\n", why);
    dut = (side){.name = "cpu2", .ops = ps_ops_cpu_create(2)};
  } else {
    char err[PS_ERRLEN] = "";
    dut = (side){.name = "cuda", .ops = ps_ops_cuda_create(0, err), .on_device = 1};
    if (!dut.ops) {
      fprintf(stderr, "ps_ops_cuda_create: %s\n", err);
      return 1;
    }
  }
  if (!ref.ops || !dut.ops) die("cannot create a backend");

  RUN(test_relu);
  RUN(test_add);
  RUN(test_scale);
  RUN(test_async_copies);
  RUN(test_dropout);
  RUN(test_maxpool);
  RUN(test_avgpool);
  RUN(test_dense);
  RUN(test_batchnorm);
  RUN(test_softmax_xent);
  RUN(test_conv2d);
  RUN(test_conv2d_empty_batch);
  RUN(test_embedding_bag);
  RUN(test_copy_cols);
  RUN(test_fm);
  RUN(test_sigmoid_xent);
  if (dut.on_device) RUN(test_memory_helpers);
  RUN(test_cnn_trajectory);
  RUN(test_avg_cnn_step);
  RUN(test_bn_cnn_step);

  /* tf32 and bf16, where the device has them: the sums of products again. */
  for (int p = PS_PRECISION_TF32; p <= PS_PRECISION_BF16; p++) {
    char err[PS_ERRLEN] = "";
    if (!dut.ops->set_precision) {
      printf("%s: no set_precision: tf32 and bf16 not tested\n", dut.name);
      break;
    }
    if (dut.ops->set_precision(dut.ops->ctx, (ps_precision)p, err) != 0) {
      printf("%s: not tested: %s\n", ps_precision_name((ps_precision)p), err);
      continue;
    }
    precision = (ps_precision)p;
    printf("precision %s:\n", ps_precision_name(precision));
    RUN(test_dense);
    RUN(test_conv2d);
    RUN(test_batchnorm); /* stays float32: the same tolerances */
  }
  if (precision != PS_PRECISION_FP32) {
    char err[PS_ERRLEN] = "";
    CHECK_MSG(dut.ops->set_precision(dut.ops->ctx, PS_PRECISION_FP32, err) == 0, "fp32: %s", err);
    precision = PS_PRECISION_FP32;
  }

  dut.ops->destroy(dut.ops);
  ref.ops->destroy(ref.ops);
  return check_summary();
}

/* The oneDNN backend (kernels/dnnl) against the CPU reference (kernels/cpu),
 * op by op on random inputs of several shapes, forward and backward; then
 * the layers of a CNN chained through the backend's own buffers, where
 * activations stay in oneDNN's blocked layouts between ops; then its
 * memory members on such buffers. Built without oneDNN it prints
 * "SKIPPED: built without oneDNN" and exits 77 (skipped for CTest).
 *
 * Every op is checked twice: on plain host arrays (malloc: always NCHW)
 * and, for conv and pooling, on buffers from the backend's alloc, whose
 * results are read back with to_host (which delivers NCHW).
 *
 * Tolerances: |got - want| <= atol + rtol*|want| per element.
 *  - Bit for bit: relu (also in place), dropout (mask against
 *    ps_rng_uniform itself, output, gradient), scale, max pooling (y, the
 *    int32 argmax, dx: comparisons, and the same adds in the same order per
 *    plane), average pooling (the same sums in the same order per lane),
 *    batch normalization (both run ps_bn_host_*, whose per-channel sums
 *    are in double in the same order for every block), the softmax (the
 *    reference's arithmetic).
 *  - Convolution and dense: the same products summed in another order
 *    (oneDNN blocks the reductions over channels, taps and examples
 *    differently from im2col + sgemm; dense layers are sgemm on other
 *    parts when the team sizes differ). A float32 sum of K terms of size
 *    up to M carries a rounding error of about 2^-24 * sqrt(K) * M for
 *    either order (2^-24 * K * M at worst); here K <= 12544 (the batch-64
 *    weight gradient: 64 examples x 196 pixels) and M <= max|want| of the
 *    array, so the difference of the two is below 2^-24 * 112 * 2 ~ 1.3e-5
 *    of max|want| typically. We allow atol = 1e-4 * max|want| (an element
 *    near zero by cancellation carries the absolute error of the large
 *    partial sums) and rtol 1e-4; a layout or indexing mistake is O(1)
 *    relative. Measured: at most 4e-6 of max|want|. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rng.h"
#include "../../kernels/ops.h"
#include "check.h"
#ifdef PS_HAVE_DNNL
#include "../../kernels/dnnl/ops_dnnl.h"
#endif


#ifdef PS_HAVE_DNNL /* everything up to main */

#define CONV_ATOL_OF_MAX 1e-4
#define CONV_RTOL 1e-4

static ps_ops *ref; /* the reference, one thread */
static ps_ops *dut; /* under test */

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 16);
  if (!p) {
    fprintf(stderr, "test_dnnl_parity: out of memory\n");
    abort();
  }
  return p;
}

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
  float *a = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = lo + (hi - lo) * (float)rand_unit();
  return a;
}

/* Outputs are prefilled with NaN, so that an op that reads (accumulates
 * into) an output it should overwrite, or skips part of it, fails. */
static float *nan_floats(size_t n) {
  float *a = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = NAN;
  return a;
}

/* Backend memory (dut's alloc) holding a copy of host, or NaNs. */
static float *dut_upload(const float *host, size_t n) {
  float *p = dut->alloc(dut->ctx, n * sizeof(float));
  if (!p) abort();
  dut->to_device(dut->ctx, p, host, n * sizeof(float));
  return p;
}

static float *dut_nans(size_t n) {
  float *h = nan_floats(n);
  float *p = dut_upload(h, n);
  free(h);
  return p;
}

/* n floats of backend memory, as NCHW on the host. */
static float *dut_fetch(const float *p, size_t n) {
  float *h = xmalloc(n * sizeof(float));
  dut->to_host(dut->ctx, h, p, n * sizeof(float));
  dut->sync(dut->ctx);
  return h;
}

static double max_abs(const float *a, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; i++)
    if (isfinite(a[i]) && fabs(a[i]) > m) m = fabs(a[i]);
  return m;
}

/* The largest |got - want| / max|want| seen in the rounding checks. */
static double worst_seen;

/* One CHECK per array; NaN matches only NaN. */
static void check_close(const char *what, const float *got, const float *want, size_t n,
                        double atol, double rtol) {
  size_t bad = 0, first = 0;
  const double scale = max_abs(want, n);
  for (size_t i = 0; i < n; i++) {
    const double g = got[i], w = want[i];
    const int ok = (isnan(g) && isnan(w)) || fabs(g - w) <= atol + rtol * fabs(w);
    if (!ok && bad++ == 0) first = i;
    if (ok && !isnan(g) && scale > 0 && fabs(g - w) / scale > worst_seen)
      worst_seen = fabs(g - w) / scale;
  }
  CHECK_MSG(bad == 0,
            "%s: %zu of %zu differ (atol %.3g, rtol %.3g); first at %zu: got %.9g, want %.9g", what,
            bad, n, atol, rtol, first, bad ? (double)got[first] : 0.0,
            bad ? (double)want[first] : 0.0);
}

static void check_rounding(const char *what, const float *got, const float *want, size_t n) {
  check_close(what, got, want, n, CONV_ATOL_OF_MAX * max_abs(want, n), CONV_RTOL);
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

/* ---- convolution ---- */

typedef struct {
  int n, c, h, w, oc, kh, kw, stride, pad;
} conv_case;

static const conv_case conv_cases[] = {
    {2, 3, 7, 9, 4, 3, 3, 1, 1},      /* odd sizes, "same" padding */
    {1, 3, 7, 9, 4, 3, 3, 1, 1},      /* batch 1: a second primitive */
    {3, 2, 8, 8, 5, 5, 5, 2, 2},      /* 5x5, stride 2 */
    {1, 1, 28, 28, 8, 3, 3, 1, 0},    /* "valid", one input channel, nChw8c output */
    {4, 16, 14, 14, 32, 3, 3, 1, 1},  /* blocked input and output */
    {2, 3, 5, 6, 2, 1, 1, 1, 0},      /* 1x1 */
    {2, 4, 9, 7, 3, 2, 2, 3, 0},      /* stride > kernel: inputs no window reads */
    {2, 3, 6, 8, 4, 3, 1, 1, 1},      /* a non-square kernel */
    {3, 16, 9, 11, 16, 3, 3, 2, 0},   /* stride 2, "valid", odd sizes, blocked */
    {64, 1, 28, 28, 32, 3, 3, 1, 1},  /* the quickstart CNN's first conv at batch 64 */
    {64, 32, 14, 14, 64, 3, 3, 1, 1}, /* its second conv */
    {48, 8, 9, 9, 16, 3, 3, 2, 1},    /* a batch above 32, no power of two, stride 2 */
    {33, 24, 7, 7, 40, 3, 3, 1, 1},   /* channels in blocks of 8 only */
};

/* The reference's outputs for one case. */
typedef struct {
  float *y, *dx, *dw, *db;
} conv_out;

static void conv_ref(const ps_conv_shape *s, const float *x, const float *w, const float *b,
                     const float *dy, conv_out *o) {
  const size_t nx = (size_t)s->n * s->c * s->h * s->w, ny = (size_t)s->n * s->oc * s->oh * s->ow;
  o->y = nan_floats(ny), o->dx = nan_floats(nx);
  o->dw = nan_floats((size_t)s->oc * s->c * s->kh * s->kw), o->db = nan_floats((size_t)s->oc);
  float *work = xmalloc(ref->conv2d_workspace(ref->ctx, s) * sizeof(float));
  ref->conv2d_forward(ref->ctx, s, x, w, b, o->y, work);
  ref->conv2d_backward(ref->ctx, s, x, w, dy, o->dx, o->dw, o->db, work);
  free(work);
}

static void conv_out_free(conv_out *o) { free(o->y), free(o->dx), free(o->dw), free(o->db); }

/* off: the weights, bias and their gradients start `off` floats into their
 * buffers, as inside one flat parameter vector (1: not aligned). */
static void conv_one(const conv_case *k, int off) {
  ps_conv_shape s = {.n = k->n, .c = k->c, .h = k->h, .w = k->w, .oc = k->oc, .kh = k->kh,
                     .kw = k->kw, .stride = k->stride, .pad = k->pad};
  ps_conv_shape_finish(&s);
  char what[160];
  const size_t nx = (size_t)s.n * s.c * s.h * s.w, ny = (size_t)s.n * s.oc * s.oh * s.ow;
  const size_t nw = (size_t)s.oc * s.c * s.kh * s.kw, nb = (size_t)s.oc;
  float *x = uniform_floats(nx, -1, 1), *w = uniform_floats(nw, -1, 1);
  float *b = uniform_floats(nb, -1, 1), *dy = uniform_floats(ny, -1, 1);
  conv_out want;
  conv_ref(&s, x, w, b, dy, &want);

#define CONV_WHAT(name)                                                                         \
  (snprintf(what, sizeof what, "conv %s n%d c%d %dx%d oc%d k%dx%d s%d p%d off%d", name, s.n, s.c, \
            s.h, s.w, s.oc, s.kh, s.kw, s.stride, s.pad, off),                                   \
   what)
  float *work = xmalloc((dut->conv2d_workspace(dut->ctx, &s) + 1) * sizeof(float));
  float *wbuf = nan_floats(nw + 1), *bbuf = nan_floats(nb + 1), *dwbuf = nan_floats(nw + 1),
        *dbbuf = nan_floats(nb + 1);
  memcpy(wbuf + off, w, nw * sizeof(float));
  memcpy(bbuf + off, b, nb * sizeof(float));

  /* Host arrays: NCHW in and out. */
  float *y = nan_floats(ny), *dx = nan_floats(nx);
  dut->conv2d_forward(dut->ctx, &s, x, wbuf + off, bbuf + off, y, work);
  dut->conv2d_backward(dut->ctx, &s, x, wbuf + off, dy, dx, dwbuf + off, dbbuf + off, work);
  check_rounding(CONV_WHAT("y"), y, want.y, ny);
  check_rounding(CONV_WHAT("dx"), dx, want.dx, nx);
  check_rounding(CONV_WHAT("dw"), dwbuf + off, want.dw, nw);
  check_rounding(CONV_WHAT("db"), dbbuf + off, want.db, nb);
  CHECK_MSG(off == 0 || (isnan(dwbuf[0]) && isnan(dbbuf[0])), "%s",
            CONV_WHAT("wrote before dw/db"));
  CHECK_MSG(isnan(dwbuf[nw]) || off == 1, "%s", CONV_WHAT("wrote after dw"));

  /* The backend's buffers (blocked where the channels allow), and without
   * dx: the same dw and db. */
  float *d_x = dut_upload(x, nx), *d_dy = dut_upload(dy, ny), *d_y = dut_nans(ny),
        *d_dx = dut_nans(nx);
  float *dw2 = nan_floats(nw), *db2 = nan_floats(nb);
  dut->conv2d_forward(dut->ctx, &s, d_x, wbuf + off, bbuf + off, d_y, work);
  dut->conv2d_backward(dut->ctx, &s, d_x, wbuf + off, d_dy, d_dx, dw2, db2, work);
  float *y2 = dut_fetch(d_y, ny), *dx2 = dut_fetch(d_dx, nx);
  check_rounding(CONV_WHAT("y in backend memory"), y2, want.y, ny);
  check_rounding(CONV_WHAT("dx in backend memory"), dx2, want.dx, nx);
  check_bits(CONV_WHAT("dw in backend memory"), dw2, dwbuf + off, nw);
  check_bits(CONV_WHAT("db in backend memory"), db2, dbbuf + off, nb);
  float *dw3 = nan_floats(nw), *db3 = nan_floats(nb);
  dut->conv2d_backward(dut->ctx, &s, d_x, wbuf + off, d_dy, NULL, dw3, db3, work);
  check_bits(CONV_WHAT("dw without dx"), dw3, dw2, nw);
  check_bits(CONV_WHAT("db without dx"), db3, db2, nb);
  /* Again: the same bits (deterministic for a shape and a team size). */
  float *y3 = nan_floats(ny);
  dut->conv2d_forward(dut->ctx, &s, x, wbuf + off, bbuf + off, y3, work);
  check_bits(CONV_WHAT("y again"), y3, y, ny);
#undef CONV_WHAT

  float *hosts[] = {x, w, b, dy, work, wbuf, bbuf, dwbuf, dbbuf, y, dx, dw2, db2, y2, dx2, dw3, db3,
                    y3};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) free(hosts[i]);
  float *devs[] = {d_x, d_dy, d_y, d_dx};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) dut->free(dut->ctx, devs[i]);
  conv_out_free(&want);
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
  float *w = uniform_floats(54, -1, 1), *b = uniform_floats(2, -1, 1);
  float *dw = nan_floats(54), *db = nan_floats(2), *any = nan_floats(1);
  dut->conv2d_forward(dut->ctx, &s, any, w, b, any, NULL);
  dut->conv2d_backward(dut->ctx, &s, any, w, any, NULL, dw, db, NULL);
  int zero = 1;
  for (int i = 0; i < 54; i++) zero &= dw[i] == 0.0f;
  CHECK_MSG(zero && db[0] == 0.0f && db[1] == 0.0f, "conv n=0: gradients not zero");
  CHECK(isnan(any[0]));
  free(w), free(b), free(dw), free(db), free(any);
}

/* ---- max pooling ---- */

typedef struct {
  int n, c, h, w, size, stride;
} pool_case;

static const pool_case pool_cases[] = {
    {2, 3, 8, 8, 2, 2},     /* the common window */
    {1, 2, 7, 9, 3, 2},     /* overlapping windows, odd sizes */
    {3, 4, 6, 6, 2, 1},     /* stride 1: most inputs in four windows */
    {2, 5, 5, 5, 2, 2},     /* a last row and column no window covers */
    {1, 1, 1, 1, 1, 1},     /* one value */
    {2, 16, 10, 10, 3, 3},  /* 3x3 windows, 16 channels */
    {3, 16, 7, 9, 3, 2},    /* overlapping windows on 16 channels */
    {2, 8, 9, 9, 2, 2},     /* 8 channels, odd sizes */
    {64, 32, 28, 28, 2, 2}, /* the quickstart CNN's first pool */
};

/* Inputs on a coarse grid (ties are common, and must go to the same tap),
 * with NaNs in some cases (a NaN first tap stays, a later one never wins).
 * in_backend: x, y, argmax, dy and dx in the backend's buffers; x is then
 * written by a convolution with a 1x1 identity kernel when the channels
 * allow, so that pooling reads (and writes) blocked layouts. */
static void pool_one(const pool_case *k, int with_nan, int in_backend) {
  ps_pool_shape s = {.n = k->n, .c = k->c, .h = k->h, .w = k->w, .size = k->size,
                     .stride = k->stride};
  ps_pool_shape_finish(&s);
  char what[160];
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
  int32_t *am_ref = xmalloc(ny * sizeof(int32_t));
  ref->maxpool_forward(ref->ctx, &s, x, y_ref, am_ref);
  ref->maxpool_backward(ref->ctx, &s, dy, am_ref, dx_ref);

  float *y, *dx;
  int32_t *am = NULL;
  if (!in_backend) {
    y = nan_floats(ny), dx = nan_floats(nx);
    am = xmalloc(ny * sizeof(int32_t));
    dut->maxpool_forward(dut->ctx, &s, x, y, am);
    dut->maxpool_backward(dut->ctx, &s, dy, am, dx);
  } else {
    float *d_x = dut_nans(nx), *d_y = dut_nans(ny), *d_dx = dut_nans(nx);
    float *d_dy = dut_upload(dy, ny);
    int32_t *d_am = dut->alloc(dut->ctx, ny * sizeof(int32_t));
    /* x through an identity convolution (1x1, weight 1, bias 0): exact. */
    ps_conv_shape cs = {.n = s.n, .c = s.c, .h = s.h, .w = s.w, .oc = s.c, .kh = 1, .kw = 1,
                        .stride = 1, .pad = 0};
    ps_conv_shape_finish(&cs);
    float *eye = calloc((size_t)s.c * s.c + s.c, sizeof(float));
    for (int c = 0; c < s.c; c++) eye[(size_t)c * s.c + c] = 1.0f;
    if (with_nan) {
      dut->to_device(dut->ctx, d_x, x, nx * sizeof(float)); /* NaN * 0 would spread */
    } else {
      float *d_x0 = dut_upload(x, nx);
      dut->conv2d_forward(dut->ctx, &cs, d_x0, eye, eye + (size_t)s.c * s.c, d_x, NULL);
      dut->free(dut->ctx, d_x0);
    }
    dut->maxpool_forward(dut->ctx, &s, d_x, d_y, d_am);
    /* dy through the identity too, so that it arrives blocked. */
    float *d_dy2 = dut_nans(ny);
    ps_conv_shape ds = cs;
    ds.h = s.oh, ds.w = s.ow;
    ps_conv_shape_finish(&ds);
    dut->conv2d_forward(dut->ctx, &ds, d_dy, eye, eye + (size_t)s.c * s.c, d_dy2, NULL);
    dut->maxpool_backward(dut->ctx, &s, d_dy2, d_am, d_dx);
    y = dut_fetch(d_y, ny), dx = dut_fetch(d_dx, nx);
    /* And from a plain dy in backend memory (as dense's dx arrives). */
    float *d_dx2 = dut_nans(nx);
    dut->maxpool_backward(dut->ctx, &s, d_dy, d_am, d_dx2);
    float *dx2 = dut_fetch(d_dx2, nx);
    snprintf(what, sizeof what, "maxpool dx from plain dy n%d c%d %dx%d size%d stride%d%s", s.n,
             s.c, s.h, s.w, s.size, s.stride, with_nan ? " nan" : "");
    check_bits(what, dx2, dx_ref, nx);
    free(eye), free(dx2);
    float *devs[] = {d_x, d_y, d_dx, d_dy, d_dy2, d_dx2};
    for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) dut->free(dut->ctx, devs[i]);
    dut->free(dut->ctx, d_am);
  }

#define POOL_WHAT(name)                                                                     \
  (snprintf(what, sizeof what, "maxpool %s n%d c%d %dx%d size%d stride%d%s%s", name, s.n, s.c, \
            s.h, s.w, s.size, s.stride, with_nan ? " nan" : "",                             \
            in_backend ? " in backend memory" : ""),                                        \
   what)
  check_bits(POOL_WHAT("y"), y, y_ref, ny);
  if (am) check_bits(POOL_WHAT("argmax"), am, am_ref, ny);
  check_bits(POOL_WHAT("dx"), dx, dx_ref, nx);
  if (am) {
    /* From the reference's argmax: the same gradient. */
    float *dx2 = nan_floats(nx);
    dut->maxpool_backward(dut->ctx, &s, dy, am_ref, dx2);
    check_bits(POOL_WHAT("dx from the reference's argmax"), dx2, dx_ref, nx);
    free(dx2);
  }
#undef POOL_WHAT
  free(x), free(dy), free(y_ref), free(dx_ref), free(am_ref), free(y), free(dx), free(am);
}

static void test_maxpool(void) {
  for (size_t i = 0; i < sizeof pool_cases / sizeof pool_cases[0]; i++)
    for (int nan = 0; nan < 2; nan++)
      for (int in_backend = 0; in_backend < 2; in_backend++)
        pool_one(&pool_cases[i], nan, in_backend);
}

/* ---- average pooling ----
 *
 * Bit for bit: the backend's loops add the reference's terms in the
 * reference's order, per lane in blocked layouts. The cases of max
 * pooling, with x (and dy) in backend memory written by an identity
 * convolution, so that they arrive blocked where the channels allow. */

/* x (n, c, h, w) host floats into a new backend buffer through a 1x1
 * identity convolution: blocked when c is a multiple of 8, values exact. */
static float *dut_identity(const float *x, int n, int c, int h, int w) {
  ps_conv_shape cs = {
      .n = n, .c = c, .h = h, .w = w, .oc = c, .kh = 1, .kw = 1, .stride = 1, .pad = 0};
  ps_conv_shape_finish(&cs);
  const size_t nx = (size_t)n * c * h * w;
  float *eye = calloc((size_t)c * c + c, sizeof(float));
  for (int i = 0; i < c; i++) eye[(size_t)i * c + i] = 1.0f;
  float *d_x0 = dut_upload(x, nx), *d_x = dut_nans(nx);
  dut->conv2d_forward(dut->ctx, &cs, d_x0, eye, eye + (size_t)c * c, d_x, NULL);
  dut->free(dut->ctx, d_x0);
  free(eye);
  return d_x;
}

static void avgpool_one(const pool_case *k, int in_backend) {
  ps_pool_shape s = {
      .n = k->n, .c = k->c, .h = k->h, .w = k->w, .size = k->size, .stride = k->stride};
  ps_pool_shape_finish(&s);
  char what[160];
  const size_t nx = (size_t)s.n * s.c * s.h * s.w, ny = (size_t)s.n * s.c * s.oh * s.ow;
  float *x = uniform_floats(nx, -1, 1), *dy = uniform_floats(ny, -1, 1);
  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx);
  ref->avgpool_forward(ref->ctx, &s, x, y_ref);
  ref->avgpool_backward(ref->ctx, &s, dy, dx_ref);
#define AVG_WHAT(name)                                                                            \
  (snprintf(what, sizeof what, "avgpool %s n%d c%d %dx%d size%d stride%d%s", name, s.n, s.c, s.h, \
            s.w, s.size, s.stride, in_backend ? " in backend memory" : ""),                       \
   what)
  if (!in_backend) {
    float *y = nan_floats(ny), *dx = nan_floats(nx);
    dut->avgpool_forward(dut->ctx, &s, x, y);
    dut->avgpool_backward(dut->ctx, &s, dy, dx);
    check_bits(AVG_WHAT("y"), y, y_ref, ny);
    check_bits(AVG_WHAT("dx"), dx, dx_ref, nx);
    free(y), free(dx);
  } else {
    float *d_x = dut_identity(x, s.n, s.c, s.h, s.w), *d_y = dut_nans(ny);
    dut->avgpool_forward(dut->ctx, &s, d_x, d_y);
    float *d_dy = dut_identity(dy, s.n, s.c, s.oh, s.ow), *d_dx = dut_nans(nx);
    dut->avgpool_backward(dut->ctx, &s, d_dy, d_dx);
    float *y = dut_fetch(d_y, ny), *dx = dut_fetch(d_dx, nx);
    check_bits(AVG_WHAT("y"), y, y_ref, ny);
    check_bits(AVG_WHAT("dx from blocked dy"), dx, dx_ref, nx);
    /* From a plain dy in backend memory (as dense's dx arrives), and into
     * host memory. */
    float *d_dy_plain = dut_upload(dy, ny), *d_dx2 = dut_nans(nx), *dx3 = nan_floats(nx);
    dut->avgpool_backward(dut->ctx, &s, d_dy_plain, d_dx2);
    float *dx2 = dut_fetch(d_dx2, nx);
    check_bits(AVG_WHAT("dx from plain dy"), dx2, dx_ref, nx);
    dut->avgpool_backward(dut->ctx, &s, d_dy, dx3);
    check_bits(AVG_WHAT("dx into host memory"), dx3, dx_ref, nx);
    float *devs[] = {d_x, d_y, d_dy, d_dx, d_dy_plain, d_dx2};
    for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) dut->free(dut->ctx, devs[i]);
    free(y), free(dx), free(dx2), free(dx3);
  }
#undef AVG_WHAT
  free(x), free(dy), free(y_ref), free(dx_ref);
}

static void global_avgpool_one(const pool_case *k, int in_backend) {
  const int n = k->n, c = k->c, h = k->h, w = k->w;
  char what[160];
  const size_t nx = (size_t)n * c * h * w, ny = (size_t)n * c;
  float *x = uniform_floats(nx, -1, 1), *dy = uniform_floats(ny, -1, 1);
  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx);
  ref->global_avgpool_forward(ref->ctx, n, c, h, w, x, y_ref);
  ref->global_avgpool_backward(ref->ctx, n, c, h, w, dy, dx_ref);
#define GAP_WHAT(name)                                                                \
  (snprintf(what, sizeof what, "global_avgpool %s n%d c%d %dx%d%s", name, n, c, h, w, \
            in_backend ? " in backend memory" : ""),                                  \
   what)
  float *y, *dx;
  if (!in_backend) {
    y = nan_floats(ny), dx = nan_floats(nx);
    dut->global_avgpool_forward(dut->ctx, n, c, h, w, x, y);
    dut->global_avgpool_backward(dut->ctx, n, c, h, w, dy, dx);
  } else {
    float *d_x = dut_identity(x, n, c, h, w), *d_y = dut_nans(ny);
    float *d_dy = dut_upload(dy, ny), *d_dx = dut_nans(nx);
    dut->global_avgpool_forward(dut->ctx, n, c, h, w, d_x, d_y);
    dut->global_avgpool_backward(dut->ctx, n, c, h, w, d_dy, d_dx);
    y = dut_fetch(d_y, ny), dx = dut_fetch(d_dx, nx);
    dut->free(dut->ctx, d_x), dut->free(dut->ctx, d_y);
    dut->free(dut->ctx, d_dy), dut->free(dut->ctx, d_dx);
  }
  check_bits(GAP_WHAT("y"), y, y_ref, ny);
  check_bits(GAP_WHAT("dx"), dx, dx_ref, nx);
#undef GAP_WHAT
  free(x), free(dy), free(y_ref), free(dx_ref), free(y), free(dx);
}

static void test_avgpool(void) {
  for (size_t i = 0; i < sizeof pool_cases / sizeof pool_cases[0]; i++)
    for (int in_backend = 0; in_backend < 2; in_backend++) {
      avgpool_one(&pool_cases[i], in_backend);
      global_avgpool_one(&pool_cases[i], in_backend);
    }
}

/* ---- batch normalization ----
 *
 * Bit for bit: both backends run ps_bn_host_* (kernels/ops_common.c), whose
 * sums are in double over each channel's values in the same order (i, then
 * j) whatever the channel block, and whose float arithmetic per element is
 * the same expression; the oneDNN backend only picks the block (the one x
 * is held in; for hw 1, where every block is NCHW's bytes, the widest that
 * divides c) and which thread takes which block. So there is no rounding
 * to allow: any difference is a layout or indexing mistake. In backend
 * memory x and dy are written by an identity convolution (blocked when the
 * channels allow) and the reference runs on the values read back. */

typedef struct {
  int n, c, h, w;
} bn_case;

static const bn_case bn_cases[] = {
    {4, 16, 7, 5},    /* blocked: 16 on AVX-512, 8 on AVX2 */
    {3, 8, 6, 6},     /* one block of 8 */
    {2, 12, 5, 5},    /* channels not a multiple of 8: NCHW */
    {1, 24, 4, 3},    /* batch 1, blocks of 8 only */
    {64, 32, 14, 14}, /* blocked, large enough for the team to split */
    {8, 20, 30, 30},  /* NCHW, split */
    {37, 100, 1, 1},  /* hw 1 (after dense): blocks of 10 over NCHW */
    {64, 128, 1, 1},  /* hw 1, channels in blocks of 16 */
    {1, 7, 1, 1},     /* batch 1 and hw 1: one value per channel, variance 0 */
    {5, 13, 1, 1},    /* hw 1, a prime channel count: NCHW */
};

/* The reference's outputs on x and dy: train (y, mean, var, invstd),
 * infer from the given moving statistics (yi), backward from train's
 * statistics (dx, dgamma, dbeta). */
typedef struct {
  float *y, *mean, *var, *invstd, *yi, *dx, *dg, *db;
} bn_out;

static void bn_ref(int n, int c, int hw, float eps, const float *x, const float *dy,
                   const float *gamma, const float *beta, const float *mmean, const float *mvar,
                   bn_out *o) {
  const size_t nx = (size_t)n * c * hw;
  o->y = nan_floats(nx), o->yi = nan_floats(nx), o->dx = nan_floats(nx);
  o->mean = nan_floats(c), o->var = nan_floats(c), o->invstd = nan_floats(c);
  o->dg = nan_floats(c), o->db = nan_floats(c);
  ref->batchnorm_forward_train(ref->ctx, n, c, hw, eps, x, gamma, beta, o->y, o->mean, o->var,
                               o->invstd);
  ref->batchnorm_forward_infer(ref->ctx, n, c, hw, eps, x, gamma, beta, mmean, mvar, o->yi);
  ref->batchnorm_backward(ref->ctx, n, c, hw, x, dy, gamma, o->mean, o->invstd, o->dx, o->dg,
                          o->db);
}

static void bn_out_free(bn_out *o) {
  free(o->y), free(o->mean), free(o->var), free(o->invstd);
  free(o->yi), free(o->dx), free(o->dg), free(o->db);
}

/* Whether the backend buffer p (nx floats) is held blocked: its bytes as
 * they are differ from the NCHW ones to_host delivers. */
static int dut_held_blocked(const float *p, size_t nx) {
  float *plain = dut_fetch(p, nx);
  const int differ = memcmp(plain, p, nx * sizeof(float)) != 0;
  free(plain);
  return differ;
}

static void bn_one(const bn_case *k) {
  const int n = k->n, c = k->c, h = k->h, w = k->w, hw = h * w;
  const size_t nx = (size_t)n * c * hw;
  const float eps = 1e-3f;
  char what[160];
  /* A mean away from 0, and scales that are not 1. */
  float *x0 = uniform_floats(nx, -1, 3), *dy0 = uniform_floats(nx, -1, 1);
  float *gamma = uniform_floats(c, 0.5f, 1.5f), *beta = uniform_floats(c, -1, 1);
  float *mmean = uniform_floats(c, -0.5f, 1.5f), *mvar = uniform_floats(c, 0.5f, 2);
  /* Held blocked in backend memory (a convolution's output of c channels,
   * hw > 1: with hw 1 every layout has NCHW's bytes). */
  const int blocked = c % 8 == 0 && hw > 1;
#define BN_WHAT(name, where) \
  (snprintf(what, sizeof what, "batchnorm %s n%d c%d %dx%d%s", name, n, c, h, w, where), what)

  /* Host arrays: NCHW in and out. */
  bn_out want;
  bn_ref(n, c, hw, eps, x0, dy0, gamma, beta, mmean, mvar, &want);
  {
    bn_out got;
    got.y = nan_floats(nx), got.yi = nan_floats(nx), got.dx = nan_floats(nx);
    got.mean = nan_floats(c), got.var = nan_floats(c), got.invstd = nan_floats(c);
    got.dg = nan_floats(c), got.db = nan_floats(c);
    dut->batchnorm_forward_train(dut->ctx, n, c, hw, eps, x0, gamma, beta, got.y, got.mean, got.var,
                                 got.invstd);
    dut->batchnorm_forward_infer(dut->ctx, n, c, hw, eps, x0, gamma, beta, mmean, mvar, got.yi);
    dut->batchnorm_backward(dut->ctx, n, c, hw, x0, dy0, gamma, want.mean, want.invstd, got.dx,
                            got.dg, got.db);
    check_bits(BN_WHAT("train y", ""), got.y, want.y, nx);
    check_bits(BN_WHAT("train mean", ""), got.mean, want.mean, c);
    check_bits(BN_WHAT("train var", ""), got.var, want.var, c);
    check_bits(BN_WHAT("train invstd", ""), got.invstd, want.invstd, c);
    check_bits(BN_WHAT("infer y", ""), got.yi, want.yi, nx);
    check_bits(BN_WHAT("dx", ""), got.dx, want.dx, nx);
    check_bits(BN_WHAT("dgamma", ""), got.dg, want.dg, c);
    check_bits(BN_WHAT("dbeta", ""), got.db, want.db, c);
    /* Without dx: the same parameter gradients. */
    float *dg2 = nan_floats(c), *db2 = nan_floats(c);
    dut->batchnorm_backward(dut->ctx, n, c, hw, x0, dy0, gamma, want.mean, want.invstd, NULL, dg2,
                            db2);
    check_bits(BN_WHAT("dgamma without dx", ""), dg2, want.dg, c);
    check_bits(BN_WHAT("dbeta without dx", ""), db2, want.db, c);
    free(dg2), free(db2);
    bn_out_free(&got);
  }
  bn_out_free(&want);

  /* The backend's buffers: x and dy blocked where the channels allow, the
   * statistics in one buffer (as a layer's state vector), and the reference
   * on the values read back. */
  float *d_x = dut_identity(x0, n, c, h, w), *d_dy = dut_identity(dy0, n, c, h, w);
  float *x = dut_fetch(d_x, nx), *dy = dut_fetch(d_dy, nx);
  bn_ref(n, c, hw, eps, x, dy, gamma, beta, mmean, mvar, &want);
  CHECK_MSG(dut_held_blocked(d_x, nx) == blocked, "%s",
            BN_WHAT(blocked ? "x not blocked" : "x blocked", ""));
  const char *mem = " in backend memory";
  float *d_y = dut_nans(nx), *d_stats = dut_nans(3 * (size_t)c);
  dut->batchnorm_forward_train(dut->ctx, n, c, hw, eps, d_x, gamma, beta, d_y, d_stats, d_stats + c,
                               d_stats + 2 * (size_t)c);
  float *y = dut_fetch(d_y, nx), *stats = dut_fetch(d_stats, 3 * (size_t)c);
  check_bits(BN_WHAT("train y", mem), y, want.y, nx);
  check_bits(BN_WHAT("train mean", mem), stats, want.mean, c);
  check_bits(BN_WHAT("train var", mem), stats + c, want.var, c);
  check_bits(BN_WHAT("train invstd", mem), stats + 2 * (size_t)c, want.invstd, c);
  CHECK_MSG(dut_held_blocked(d_y, nx) == blocked, "%s", BN_WHAT("y not in x's layout", mem));
  /* y keeps x's (n, c, h, w), so that a pooling after it reads it as it
   * is: a 1x1 average pooling (exact) leaves y blocked and gives its bits. */
  ps_pool_shape ps = {.n = n, .c = c, .h = h, .w = w, .size = 1, .stride = 1};
  ps_pool_shape_finish(&ps);
  float *d_p = dut_nans(nx);
  dut->avgpool_forward(dut->ctx, &ps, d_y, d_p);
  float *pooled = dut_fetch(d_p, nx);
  check_bits(BN_WHAT("y read by the next op", mem), pooled, want.y, nx);
  CHECK_MSG(dut_held_blocked(d_y, nx) == blocked, "%s", BN_WHAT("y made NCHW by the next op", mem));

  float *d_yi = dut_nans(nx);
  dut->batchnorm_forward_infer(dut->ctx, n, c, hw, eps, d_x, gamma, beta, mmean, mvar, d_yi);
  float *yi = dut_fetch(d_yi, nx);
  check_bits(BN_WHAT("infer y", mem), yi, want.yi, nx);
  CHECK_MSG(dut_held_blocked(d_yi, nx) == blocked, "%s", BN_WHAT("infer y not in x's layout", mem));

  /* Backward from dy held as x is, from a plain dy (as dense's dx
   * arrives), without dx, and into host memory. */
  float *d_dx = dut_nans(nx), *d_dy_plain = dut_upload(dy, nx), *d_dx2 = dut_nans(nx);
  float *dg = nan_floats(c), *db = nan_floats(c);
  dut->batchnorm_backward(dut->ctx, n, c, hw, d_x, d_dy, gamma, want.mean, want.invstd, d_dx, dg,
                          db);
  float *dx = dut_fetch(d_dx, nx);
  check_bits(BN_WHAT("dx", mem), dx, want.dx, nx);
  check_bits(BN_WHAT("dgamma", mem), dg, want.dg, c);
  check_bits(BN_WHAT("dbeta", mem), db, want.db, c);
  CHECK_MSG(dut_held_blocked(d_dx, nx) == blocked, "%s", BN_WHAT("dx not in x's layout", mem));
  float *dg2 = nan_floats(c), *db2 = nan_floats(c);
  dut->batchnorm_backward(dut->ctx, n, c, hw, d_x, d_dy_plain, gamma, want.mean, want.invstd, d_dx2,
                          dg2, db2);
  float *dx2 = dut_fetch(d_dx2, nx);
  check_bits(BN_WHAT("dx from plain dy", mem), dx2, want.dx, nx);
  check_bits(BN_WHAT("dgamma from plain dy", mem), dg2, want.dg, c);
  check_bits(BN_WHAT("dbeta from plain dy", mem), db2, want.db, c);
  float *dg3 = nan_floats(c), *db3 = nan_floats(c);
  dut->batchnorm_backward(dut->ctx, n, c, hw, d_x, d_dy, gamma, want.mean, want.invstd, NULL, dg3,
                          db3);
  check_bits(BN_WHAT("dgamma without dx", mem), dg3, want.dg, c);
  check_bits(BN_WHAT("dbeta without dx", mem), db3, want.db, c);
  float *dx3 = nan_floats(nx), *dg4 = nan_floats(c), *db4 = nan_floats(c);
  dut->batchnorm_backward(dut->ctx, n, c, hw, d_x, d_dy, gamma, want.mean, want.invstd, dx3, dg4,
                          db4);
  check_bits(BN_WHAT("dx into host memory", mem), dx3, want.dx, nx);
  check_bits(BN_WHAT("dgamma with dx in host memory", mem), dg4, want.dg, c);
  CHECK_MSG(dut_held_blocked(d_x, nx) == blocked, "%s",
            BN_WHAT("x changed layout in backward", mem));

  /* Last (x is made NCHW for it): y into host memory. */
  float *y2 = nan_floats(nx), *st2 = nan_floats(3 * (size_t)c);
  dut->batchnorm_forward_train(dut->ctx, n, c, hw, eps, d_x, gamma, beta, y2, st2, st2 + c,
                               st2 + 2 * (size_t)c);
  check_bits(BN_WHAT("train y into host memory", mem), y2, want.y, nx);
  check_bits(BN_WHAT("train statistics, y in host memory", mem), st2, stats, 3 * (size_t)c);
  float *x2 = dut_fetch(d_x, nx);
  check_bits(BN_WHAT("x after y into host memory", mem), x2, x, nx);
#undef BN_WHAT
  float *hosts[] = {x0, dy0, gamma, beta, mmean, mvar, x,   dy,  y,   stats, pooled, yi,  dg,
                    db, dx,  dg2,   db2,  dx2,   dg3,  db3, dx3, dg4, db4,   y2,     st2, x2};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) free(hosts[i]);
  float *devs[] = {d_x, d_dy, d_y, d_stats, d_p, d_yi, d_dx, d_dy_plain, d_dx2};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) dut->free(dut->ctx, devs[i]);
  bn_out_free(&want);
}

/* An empty batch: the reference's statistics (mean and variance 0) and
 * zero gradients, nothing else written. */
static void test_batchnorm_empty_batch(void) {
  const int c = 16;
  float *gamma = uniform_floats(c, 0.5f, 1.5f), *beta = uniform_floats(c, -1, 1);
  float *any = nan_floats(1);
  float *st_ref = nan_floats(3 * c), *st = nan_floats(3 * c);
  float *g_ref = nan_floats(2 * c), *g = nan_floats(2 * c);
  ref->batchnorm_forward_train(ref->ctx, 0, c, 9, 1e-3f, any, gamma, beta, any, st_ref, st_ref + c,
                               st_ref + 2 * c);
  dut->batchnorm_forward_train(dut->ctx, 0, c, 9, 1e-3f, any, gamma, beta, any, st, st + c,
                               st + 2 * c);
  check_bits("batchnorm n0: statistics", st, st_ref, 3 * c);
  dut->batchnorm_forward_infer(dut->ctx, 0, c, 9, 1e-3f, any, gamma, beta, st, st + c, any);
  ref->batchnorm_backward(ref->ctx, 0, c, 9, any, any, gamma, st_ref, st_ref + 2 * c, any, g_ref,
                          g_ref + c);
  dut->batchnorm_backward(dut->ctx, 0, c, 9, any, any, gamma, st, st + 2 * c, any, g, g + c);
  check_bits("batchnorm n0: gradients", g, g_ref, 2 * c);
  CHECK(isnan(any[0]));
  free(gamma), free(beta), free(any), free(st_ref), free(st), free(g_ref), free(g);
}

static void test_batchnorm(void) {
  for (size_t i = 0; i < sizeof bn_cases / sizeof bn_cases[0]; i++) bn_one(&bn_cases[i]);
}

/* ---- dense ---- */

typedef struct {
  int n, in, out;
} dense_case;

static const dense_case dense_cases[] = {
    {1, 1, 1},       {3, 5, 7},      {7, 33, 1}, {64, 3136, 128}, {64, 128, 10},
    {2, 1000, 300},  {5, 0, 3}, /* no input features: y = b */
    {0, 4, 3},                  /* an empty batch */
    {37, 100, 13},
};

static void dense_one(const dense_case *k, int off) {
  const int n = k->n, in = k->in, out = k->out;
  char what[128];
  const size_t nx = (size_t)n * in, ny = (size_t)n * out, nw = (size_t)out * in, nb = (size_t)out;
  float *x = uniform_floats(nx, -1, 1), *wbuf = uniform_floats(nw + 1, -1, 1);
  float *bbuf = uniform_floats(nb + 1, -1, 1), *dy = uniform_floats(ny, -1, 1);
  const float *w = wbuf + off, *b = bbuf + off;
  float *y_ref = nan_floats(ny), *dx_ref = nan_floats(nx), *dw_ref = nan_floats(nw),
        *db_ref = nan_floats(nb);
  ref->dense_forward(ref->ctx, n, in, out, x, w, b, y_ref);
  ref->dense_backward(ref->ctx, n, in, out, x, w, dy, dx_ref, dw_ref, db_ref);

  float *y = nan_floats(ny), *dx = nan_floats(nx), *dwbuf = nan_floats(nw + 1),
        *dbbuf = nan_floats(nb + 1);
  dut->dense_forward(dut->ctx, n, in, out, x, w, b, y);
  dut->dense_backward(dut->ctx, n, in, out, x, w, dy, dx, dwbuf + off, dbbuf + off);
  float *dw2 = nan_floats(nw), *db2 = nan_floats(nb);
  dut->dense_backward(dut->ctx, n, in, out, x, w, dy, NULL, dw2, db2);

#define DENSE_WHAT(name) \
  (snprintf(what, sizeof what, "dense %s n%d in%d out%d off%d", name, n, in, out, off), what)
  check_rounding(DENSE_WHAT("y"), y, y_ref, ny);
  check_rounding(DENSE_WHAT("dx"), dx, dx_ref, nx);
  check_rounding(DENSE_WHAT("dw"), dwbuf + off, dw_ref, nw);
  check_rounding(DENSE_WHAT("db"), dbbuf + off, db_ref, nb);
  check_bits(DENSE_WHAT("dw without dx"), dw2, dwbuf + off, nw);
  check_bits(DENSE_WHAT("db without dx"), db2, dbbuf + off, nb);
  CHECK_MSG(off == 0 || (isnan(dwbuf[0]) && isnan(dbbuf[0])), "%s",
            DENSE_WHAT("wrote before dw/db"));
#undef DENSE_WHAT
  float *all[] = {x, wbuf, bbuf, dy, y_ref, dx_ref, dw_ref, db_ref, y, dx, dwbuf, dbbuf, dw2, db2};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static void test_dense(void) {
  for (size_t i = 0; i < sizeof dense_cases / sizeof dense_cases[0]; i++)
    for (int off = 0; off < 2; off++) dense_one(&dense_cases[i], off);
}

/* ---- element-wise ---- */

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
    ref->relu_forward(ref->ctx, n, x, y_ref);
    ref->relu_backward(ref->ctx, n, y_ref, dy, dx_ref);
    float *y = nan_floats(n), *dx = nan_floats(n);
    dut->relu_forward(dut->ctx, n, x, y);
    dut->relu_backward(dut->ctx, n, y, dy, dx);
    snprintf(what, sizeof what, "relu y n%zu", n);
    check_bits(what, y, y_ref, n);
    snprintf(what, sizeof what, "relu dx n%zu", n);
    check_bits(what, dx, dx_ref, n);
    /* In place, as the worker may call them. */
    float *xi = xmalloc(bytes), *dyi = xmalloc(bytes);
    memcpy(xi, x, bytes), memcpy(dyi, dy, bytes);
    dut->relu_forward(dut->ctx, n, xi, xi);
    dut->relu_backward(dut->ctx, n, y, dyi, dyi);
    snprintf(what, sizeof what, "relu y in place n%zu", n);
    check_bits(what, xi, y_ref, n);
    snprintf(what, sizeof what, "relu dx in place n%zu", n);
    check_bits(what, dyi, dx_ref, n);
    free(x), free(dy), free(y_ref), free(dx_ref), free(y), free(dx), free(xi), free(dyi);
  }
}

/* y = a + b on host memory (the reference's bits, in place too), then on
 * backend buffers held blocked (a 1x1 identity convolution's outputs, of
 * 16 and 8 channels) and NCHW in every pairing: the sum as NCHW is the
 * reference's, and an op after it reads it right whatever layout it left. */
static void test_add(void) {
  static const size_t sizes[] = {1, 7, 1000, 100003};
  char what[96];
  for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
    const size_t n = sizes[t], bytes = n * sizeof(float);
    float *a = uniform_floats(n, -1, 1), *b = uniform_floats(n, -1, 1);
    float *want = nan_floats(n), *got = nan_floats(n), *ai = xmalloc(bytes);
    ref->add(ref->ctx, n, a, b, want);
    dut->add(dut->ctx, n, a, b, got);
    snprintf(what, sizeof what, "add n%zu", n);
    check_bits(what, got, want, n);
    memcpy(ai, a, bytes);
    dut->add(dut->ctx, n, ai, b, ai);
    snprintf(what, sizeof what, "add in place n%zu", n);
    check_bits(what, ai, want, n);
    free(a), free(b), free(want), free(got), free(ai);
  }
  static const int chans[] = {16, 8};
  for (size_t t = 0; t < sizeof chans / sizeof chans[0]; t++) {
    const int N = 2, C = chans[t], H = 5, W = 3;
    const size_t n = (size_t)N * C * H * W;
    float *xa = uniform_floats(n, -1, 1), *xb = uniform_floats(n, -1, 1);
    float *want = nan_floats(n), *want_relu = nan_floats(n);
    ref->add(ref->ctx, n, xa, xb, want);
    ref->relu_forward(ref->ctx, n, want, want_relu);
    /* a, b: 0 NCHW, 1 blocked; out: 0 a buffer of its own, 1 over a, 2
     * over b. */
    for (int pa = 0; pa < 2; pa++)
      for (int pb = 0; pb < 2; pb++)
        for (int out = 0; out < 3; out++) {
          float *d_a = pa ? dut_identity(xa, N, C, H, W) : dut_upload(xa, n);
          float *d_b = pb ? dut_identity(xb, N, C, H, W) : dut_upload(xb, n);
          float *d_y = out == 0 ? dut_nans(n) : out == 1 ? d_a : d_b;
          float *d_r = dut_nans(n);
          dut->add(dut->ctx, n, d_a, d_b, d_y);
          dut->relu_forward(dut->ctx, n, d_y, d_r);
          float *got = dut_fetch(d_y, n), *got_relu = dut_fetch(d_r, n);
          snprintf(what, sizeof what, "add c%d a %s b %s into %s", C, pa ? "blocked" : "nchw",
                   pb ? "blocked" : "nchw",
                   out == 0   ? "y"
                   : out == 1 ? "a"
                              : "b");
          check_bits(what, got, want, n);
          snprintf(what, sizeof what, "relu after add c%d a %s b %s into %s", C,
                   pa ? "blocked" : "nchw", pb ? "blocked" : "nchw",
                   out == 0   ? "y"
                   : out == 1 ? "a"
                              : "b");
          check_bits(what, got_relu, want_relu, n);
          free(got), free(got_relu);
          if (out == 0) dut->free(dut->ctx, d_y);
          dut->free(dut->ctx, d_a), dut->free(dut->ctx, d_b), dut->free(dut->ctx, d_r);
        }
    free(xa), free(xb), free(want), free(want_relu);
  }
}

static void test_scale(void) {
  static const size_t sizes[] = {1, 1000, 100003};
  static const float alphas[] = {0.25f, -3.0f, 1.0f / 3.0f};
  char what[96];
  for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
    const size_t n = sizes[t], bytes = n * sizeof(float);
    float *x = uniform_floats(n, -5, 5), *want = xmalloc(bytes), *got = xmalloc(bytes);
    memcpy(want, x, bytes), memcpy(got, x, bytes);
    ref->scale(ref->ctx, n, alphas[t], want);
    dut->scale(dut->ctx, n, alphas[t], got);
    snprintf(what, sizeof what, "scale n%zu by %g", n, (double)alphas[t]);
    check_bits(what, got, want, n);
    free(x), free(want), free(got);
  }
}

typedef struct {
  size_t n;
  float rate;
  uint64_t seed, stream;
} dropout_case;

static void test_dropout(void) {
  static const dropout_case cases[] = {
      {1, 0.5f, 1, 0},
      {1000, 0.25f, 42, 7},
      {100003, 0.5f, 1, 3 * 32 + 9},
      {4097, 0.0f, 5, 1},                      /* keep all, scale 1 */
      {4097, 1.0f, 5, 1},                      /* drop all */
      {513, 0.9f, UINT64_MAX, UINT64_MAX - 1}, /* the wrap-around of (stream + 1) */
  };
  char what[96];
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const dropout_case *k = &cases[t];
    const size_t n = k->n;
    float *x = uniform_floats(n, -1, 1), *dy = uniform_floats(n, -1, 1);
    float *y_ref = nan_floats(n), *m_ref = nan_floats(n), *dx_ref = nan_floats(n);
    ref->dropout_forward(ref->ctx, n, k->rate, k->seed, k->stream, x, y_ref, m_ref);
    ref->dropout_backward(ref->ctx, n, m_ref, dy, dx_ref);
    float *y = nan_floats(n), *m = nan_floats(n), *dx = nan_floats(n);
    dut->dropout_forward(dut->ctx, n, k->rate, k->seed, k->stream, x, y, m);
    dut->dropout_backward(dut->ctx, n, m, dy, dx);
    const float rate = k->rate;
    const float scale = rate >= 1.0f ? 0.0f : rate <= 0.0f ? 1.0f : 1.0f / (1.0f - rate);
    float *m_want = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
      m_want[i] = ps_rng_uniform(k->seed, k->stream, i) >= rate ? scale : 0.0f;
    snprintf(what, sizeof what, "dropout mask vs ps_rng_uniform n%zu rate%g", n, (double)rate);
    check_bits(what, m, m_want, n);
    snprintf(what, sizeof what, "dropout y n%zu rate%g", n, (double)rate);
    check_bits(what, y, y_ref, n);
    snprintf(what, sizeof what, "dropout dx n%zu rate%g", n, (double)rate);
    check_bits(what, dx, dx_ref, n);
    free(x), free(dy), free(y_ref), free(m_ref), free(dx_ref), free(y), free(m), free(dx),
        free(m_want);
  }
}

static void test_softmax_xent(void) {
  static const struct {
    int n, k;
    float scale;
    int bad_label;
  } cases[] = {{1, 1, 1, 0}, {3, 10, 1, 0}, {64, 10, 3, 0}, {17, 1000, 5, 0},
               {5, 3, 80, 0}, {6, 10, 1, 1}};
  char what[96];
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    const int n = cases[t].n, k = cases[t].k;
    const size_t nl = (size_t)n * k;
    float *logits = uniform_floats(nl, -cases[t].scale, cases[t].scale);
    uint8_t *labels = xmalloc((size_t)n);
    for (int i = 0; i < n; i++) labels[i] = (uint8_t)(rand_unit() * k);
    if (cases[t].bad_label) labels[n / 2] = (uint8_t)k;
    float *p_ref = nan_floats(nl), *d_ref = nan_floats(nl), *p = nan_floats(nl),
          *d = nan_floats(nl), *p2 = nan_floats(nl);
    const float loss_ref = ref->softmax_xent_forward(ref->ctx, n, k, logits, labels, p_ref);
    ref->softmax_xent_backward(ref->ctx, n, k, p_ref, labels, d_ref);
    const float loss = dut->softmax_xent_forward(dut->ctx, n, k, logits, labels, p);
    dut->softmax_xent_backward(dut->ctx, n, k, p, labels, d);
    snprintf(what, sizeof what, "softmax loss n%d k%d", n, k);
    CHECK_MSG(memcmp(&loss, &loss_ref, sizeof loss) == 0 || (isnan(loss) && isnan(loss_ref)),
              "%s: got %.9g, want %.9g", what, (double)loss, (double)loss_ref);
    snprintf(what, sizeof what, "softmax probs n%d k%d", n, k);
    check_bits(what, p, p_ref, nl);
    snprintf(what, sizeof what, "softmax dlogits n%d k%d", n, k);
    check_bits(what, d, d_ref, nl);
    if (dut->softmax_xent_stats && ref->softmax_xent_stats) {
      double st[2] = {-1, -1}, st_ref[2] = {-2, -2};
      ref->softmax_xent_stats(ref->ctx, n, k, logits, labels, p_ref, st_ref);
      dut->softmax_xent_stats(dut->ctx, n, k, logits, labels, p2, st);
      snprintf(what, sizeof what, "softmax stats n%d k%d", n, k);
      CHECK_MSG((st[0] == st_ref[0] || (isnan(st[0]) && isnan(st_ref[0]))) && st[1] == st_ref[1],
                "%s: %g %g, want %g %g", what, st[0], st[1], st_ref[0], st_ref[1]);
      check_bits(what, p2, p_ref, nl);
    }
    free(logits), free(labels), free(p_ref), free(d_ref), free(p), free(d), free(p2);
  }
  float any = 0.0f;
  uint8_t label = 0;
  CHECK(dut->softmax_xent_forward(dut->ctx, 0, 10, &any, &label, &any) == 0.0f);
}

/* ---- a CNN's layers through the backend's buffers ----
 *
 * conv(c_in -> c1) -> relu -> maxpool 2 -> conv(c1 -> c2) -> relu ->
 * maxpool 2 -> flatten -> dense(out) -> (dy) and back (with `avg`: avgpool
 * 2 for the first pooling, global_avgpool for the second), as worker/model/model.c
 * calls them: every activation and gradient in a buffer of the backend's
 * alloc (so held blocked between ops where the channels allow), the
 * gradient buffers used in turn for several layers, and the first layer
 * without dx. The outputs are read back with to_host and compared with
 * the reference on host arrays. */
typedef struct {
  int n, c_in, hw, c1, c2, out, pad;
  int avg; /* avgpool and global_avgpool for the two poolings */
} chain_case;

static const chain_case chain_cases[] = {
    {64, 1, 28, 32, 64, 128, 1, 0}, /* the quickstart CNN */
    {5, 3, 13, 16, 8, 10, 0, 0},    /* "valid", odd sizes: 16 then 8 channels */
    {1, 2, 12, 8, 24, 7, 1, 0},     /* batch 1, blocks of 8 */
    {3, 1, 10, 4, 6, 5, 1, 0},      /* channels that fit no block: NCHW throughout */
    {5, 3, 13, 16, 8, 10, 0, 1},    /* average pooling: 16 then 8 channels */
    {2, 1, 12, 8, 32, 7, 1, 1},     /* blocks of 8, then 16 */
    {3, 1, 10, 4, 6, 5, 1, 1},      /* NCHW throughout */
};

enum { CHAIN_LAYERS = 8 };

typedef struct {
  ps_conv_shape conv[2];
  ps_pool_shape pool[2];
  size_t size[CHAIN_LAYERS]; /* output floats of each layer (flatten: pool 2's) */
  size_t nx, largest;
  size_t w_off[3], b_off[3], n_params;
  int dense_in;
} chain_shapes;

static void chain_shapes_init(const chain_case *k, chain_shapes *cs) {
  memset(cs, 0, sizeof *cs);
  cs->conv[0] = (ps_conv_shape){.n = k->n, .c = k->c_in, .h = k->hw, .w = k->hw, .oc = k->c1,
                                .kh = 3, .kw = 3, .stride = 1, .pad = k->pad};
  ps_conv_shape_finish(&cs->conv[0]);
  cs->pool[0] = (ps_pool_shape){.n = k->n, .c = k->c1, .h = cs->conv[0].oh, .w = cs->conv[0].ow,
                                .size = 2, .stride = 2};
  ps_pool_shape_finish(&cs->pool[0]);
  cs->conv[1] = (ps_conv_shape){.n = k->n, .c = k->c1, .h = cs->pool[0].oh, .w = cs->pool[0].ow,
                                .oc = k->c2, .kh = 3, .kw = 3, .stride = 1, .pad = k->pad};
  ps_conv_shape_finish(&cs->conv[1]);
  cs->pool[1] = (ps_pool_shape){.n = k->n, .c = k->c2, .h = cs->conv[1].oh, .w = cs->conv[1].ow,
                                .size = 2, .stride = 2};
  ps_pool_shape_finish(&cs->pool[1]);
  if (k->avg) cs->pool[1].oh = cs->pool[1].ow = 1; /* global: the whole plane */
  const size_t n = (size_t)k->n;
  cs->nx = n * k->c_in * k->hw * k->hw;
  cs->size[0] = cs->size[1] = n * k->c1 * cs->conv[0].oh * cs->conv[0].ow;
  cs->size[2] = n * k->c1 * cs->pool[0].oh * cs->pool[0].ow;
  cs->size[3] = cs->size[4] = n * k->c2 * cs->conv[1].oh * cs->conv[1].ow;
  cs->size[5] = cs->size[6] = n * k->c2 * cs->pool[1].oh * cs->pool[1].ow;
  cs->size[7] = n * k->out;
  cs->dense_in = k->c2 * cs->pool[1].oh * cs->pool[1].ow;
  cs->largest = cs->nx;
  for (int i = 0; i < CHAIN_LAYERS; i++)
    if (cs->size[i] > cs->largest) cs->largest = cs->size[i];
  size_t p = 0;
  const size_t wn[3] = {(size_t)k->c1 * k->c_in * 9, (size_t)k->c2 * k->c1 * 9,
                        (size_t)k->out * cs->dense_in};
  const size_t bn[3] = {(size_t)k->c1, (size_t)k->c2, (size_t)k->out};
  for (int l = 0; l < 3; l++) {
    cs->w_off[l] = p, p += wn[l];
    cs->b_off[l] = p, p += bn[l];
  }
  cs->n_params = p;
}

/* One side's run: alloc'd with `alloc_on` (the backend, or malloc when
 * NULL). Returns the activations of every layer, the gradient of every
 * layer's input but the first, and the parameter gradient, all on the host
 * (NCHW). */
typedef struct {
  float *act[CHAIN_LAYERS];
  float *grad_in[CHAIN_LAYERS]; /* the gradient each layer's backward wrote */
  float *grads;
  float *conv1_raw; /* conv 1's output buffer as the backend left it */
} chain_result;

static float *side_alloc(ps_ops *o, int on_backend, size_t n) {
  if (!on_backend) return nan_floats(n);
  float *p = o->alloc(o->ctx, n * sizeof(float));
  if (!p) abort();
  return p;
}

static float *side_fetch(ps_ops *o, int on_backend, const float *p, size_t n) {
  float *h = xmalloc(n * sizeof(float));
  if (on_backend) {
    o->to_host(o->ctx, h, p, n * sizeof(float));
  } else {
    memcpy(h, p, n * sizeof(float));
  }
  return h;
}

static void chain_run(ps_ops *o, int on_backend, const chain_case *k, const chain_shapes *cs,
                      const float *x, const float *params, const float *dy_last,
                      chain_result *r) {
  memset(r, 0, sizeof *r);
  float *out[CHAIN_LAYERS];
  int32_t *am[2];
  for (int i = 0; i < CHAIN_LAYERS; i++) out[i] = side_alloc(o, on_backend, cs->size[i]);
  for (int i = 0; i < 2; i++) {
    size_t n = cs->size[i == 0 ? 2 : 5];
    am[i] = on_backend ? o->alloc(o->ctx, n * sizeof(int32_t)) : xmalloc(n * sizeof(int32_t));
  }
  float *ga = side_alloc(o, on_backend, cs->largest), *gb = side_alloc(o, on_backend, cs->largest);
  float *grads = nan_floats(cs->n_params);
  size_t ws = o->conv2d_workspace(o->ctx, &cs->conv[0]);
  if (o->conv2d_workspace(o->ctx, &cs->conv[1]) > ws) ws = o->conv2d_workspace(o->ctx, &cs->conv[1]);
  float *work = side_alloc(o, on_backend, ws + 1);
  const float *p = params;
  /* forward */
  o->conv2d_forward(o->ctx, &cs->conv[0], x, p + cs->w_off[0], p + cs->b_off[0], out[0], work);
  o->relu_forward(o->ctx, cs->size[1], out[0], out[1]);
  if (k->avg)
    o->avgpool_forward(o->ctx, &cs->pool[0], out[1], out[2]);
  else
    o->maxpool_forward(o->ctx, &cs->pool[0], out[1], out[2], am[0]);
  o->conv2d_forward(o->ctx, &cs->conv[1], out[2], p + cs->w_off[1], p + cs->b_off[1], out[3],
                    work);
  o->relu_forward(o->ctx, cs->size[4], out[3], out[4]);
  if (k->avg)
    o->global_avgpool_forward(o->ctx, k->n, k->c2, cs->pool[1].h, cs->pool[1].w, out[4], out[5]);
  else
    o->maxpool_forward(o->ctx, &cs->pool[1], out[4], out[5], am[1]);
  /* flatten: out[5] as (n, dense_in); out[6] is unused (flatten has none) */
  o->dense_forward(o->ctx, k->n, cs->dense_in, k->out, out[5], p + cs->w_off[2],
                   p + cs->b_off[2], out[7]);
  if (on_backend) r->conv1_raw = side_fetch(o, 0, out[0], cs->size[0]);
  /* backward, through the two gradient buffers in turn */
  float *dy = ga, *dx = gb, *t;
  if (on_backend)
    o->to_device(o->ctx, dy, dy_last, cs->size[7] * sizeof(float));
  else
    memcpy(dy, dy_last, cs->size[7] * sizeof(float));
  o->dense_backward(o->ctx, k->n, cs->dense_in, k->out, out[5], p + cs->w_off[2], dy, dx,
                    grads + cs->w_off[2], grads + cs->b_off[2]);
  r->grad_in[7] = side_fetch(o, on_backend, dx, cs->size[5]);
  t = dy, dy = dx, dx = t;
  if (k->avg)
    o->global_avgpool_backward(o->ctx, k->n, k->c2, cs->pool[1].h, cs->pool[1].w, dy, dx);
  else
    o->maxpool_backward(o->ctx, &cs->pool[1], dy, am[1], dx);
  r->grad_in[5] = side_fetch(o, on_backend, dx, cs->size[4]);
  t = dy, dy = dx, dx = t;
  o->relu_backward(o->ctx, cs->size[4], out[4], dy, dx);
  r->grad_in[4] = side_fetch(o, on_backend, dx, cs->size[3]);
  t = dy, dy = dx, dx = t;
  o->conv2d_backward(o->ctx, &cs->conv[1], out[2], p + cs->w_off[1], dy, dx, grads + cs->w_off[1],
                     grads + cs->b_off[1], work);
  r->grad_in[3] = side_fetch(o, on_backend, dx, cs->size[2]);
  t = dy, dy = dx, dx = t;
  if (k->avg)
    o->avgpool_backward(o->ctx, &cs->pool[0], dy, dx);
  else
    o->maxpool_backward(o->ctx, &cs->pool[0], dy, am[0], dx);
  r->grad_in[2] = side_fetch(o, on_backend, dx, cs->size[1]);
  t = dy, dy = dx, dx = t;
  o->relu_backward(o->ctx, cs->size[1], out[1], dy, dx);
  r->grad_in[1] = side_fetch(o, on_backend, dx, cs->size[0]);
  t = dy, dy = dx, dx = t;
  o->conv2d_backward(o->ctx, &cs->conv[0], x, p + cs->w_off[0], dy, NULL, grads + cs->w_off[0],
                     grads + cs->b_off[0], work);
  for (int i = 0; i < CHAIN_LAYERS; i++)
    if (i != 6) r->act[i] = side_fetch(o, on_backend, out[i], cs->size[i]);
  r->grads = grads;
  for (int i = 0; i < CHAIN_LAYERS; i++) {
    if (on_backend)
      o->free(o->ctx, out[i]);
    else
      free(out[i]);
  }
  for (int i = 0; i < 2; i++) {
    if (on_backend)
      o->free(o->ctx, am[i]);
    else
      free(am[i]);
  }
  if (on_backend) {
    o->free(o->ctx, ga), o->free(o->ctx, gb), o->free(o->ctx, work);
  } else {
    free(ga), free(gb), free(work);
  }
}

static void chain_result_free(chain_result *r) {
  for (int i = 0; i < CHAIN_LAYERS; i++) free(r->act[i]), free(r->grad_in[i]);
  free(r->grads), free(r->conv1_raw);
}

static void chain_one(const chain_case *k) {
  chain_shapes cs;
  chain_shapes_init(k, &cs);
  char what[160];
  float *x = uniform_floats(cs.nx, 0, 1);
  /* Small weights (fan-in scaled), so activations stay O(1). */
  float *params = uniform_floats(cs.n_params, -0.3f, 0.3f);
  float *dy = uniform_floats(cs.size[7], -1, 1);
  chain_result want, got;
  chain_run(ref, 0, k, &cs, x, params, dy, &want);
  chain_run(dut, 1, k, &cs, x, params, dy, &got);
  static const char *names[CHAIN_LAYERS] = {"conv1", "relu1", "pool1", "conv2",
                                            "relu2", "pool2", "",      "dense"};
#define CHAIN_WHAT(name, layer)                                                              \
  (snprintf(what, sizeof what, "chain n%d c%d %dx%d -> %d -> %d -> %d pad%d%s: %s %s", k->n, \
            k->c_in, k->hw, k->hw, k->c1, k->c2, k->out, k->pad, k->avg ? " avg" : "",       \
            names[layer], name),                                                             \
   what)
  /* A relu or pooling decision within rounding of a tie would move a value
   * from one place to another; the inputs are continuous random, where
   * that has probability ~1e-6 per decision: none here. */
  for (int i = 0; i < CHAIN_LAYERS; i++) {
    if (i == 6) continue;
    check_rounding(CHAIN_WHAT("output", i), got.act[i], want.act[i], cs.size[i]);
  }
  const int grad_layers[] = {7, 5, 4, 3, 2, 1};
  const size_t grad_sizes[] = {cs.size[5], cs.size[4], cs.size[3], cs.size[2], cs.size[1],
                               cs.size[0]};
  for (int j = 0; j < 6; j++)
    check_rounding(CHAIN_WHAT("dx", grad_layers[j]), got.grad_in[grad_layers[j]],
                   want.grad_in[grad_layers[j]], grad_sizes[j]);
  const int layer_of[3] = {0, 3, 7};
  const size_t wn[3] = {cs.b_off[0] - cs.w_off[0], cs.b_off[1] - cs.w_off[1],
                        cs.b_off[2] - cs.w_off[2]};
  for (int l = 0; l < 3; l++) {
    check_rounding(CHAIN_WHAT("dw", layer_of[l]), got.grads + cs.w_off[l],
                   want.grads + cs.w_off[l], wn[l]);
    const size_t bn = (l < 2 ? cs.w_off[l + 1] : cs.n_params) - cs.b_off[l];
    check_rounding(CHAIN_WHAT("db", layer_of[l]), got.grads + cs.b_off[l],
                   want.grads + cs.b_off[l], bn);
  }
  /* The chain did run blocked where the channels allow: conv 1's output
   * buffer, read as it is, is not NCHW (to_host turned it into NCHW). */
  if (k->c1 % 8 == 0) {
    const int same = memcmp(got.conv1_raw, got.act[0], cs.size[0] * sizeof(float)) == 0;
    CHECK_MSG(!same, "%s", CHAIN_WHAT("held in NCHW, not blocked", 0));
  }
#undef CHAIN_WHAT
  chain_result_free(&want);
  chain_result_free(&got);
  free(x), free(params), free(dy);
}

static void test_chain(void) {
  for (size_t i = 0; i < sizeof chain_cases / sizeof chain_cases[0]; i++)
    chain_one(&chain_cases[i]);
}

/* ---- memory members on blocked buffers ---- */

static void test_memory(void) {
  /* alloc zeroes; an empty allocation is a pointer. */
  float *z = dut->alloc(dut->ctx, 100 * sizeof(float));
  void *empty = dut->alloc(dut->ctx, 0);
  CHECK(z && empty);
  int zero = 1;
  for (int i = 0; z && i < 100; i++) zero &= z[i] == 0.0f;
  CHECK(zero);
  dut->free(dut->ctx, z), dut->free(dut->ctx, empty), dut->free(dut->ctx, NULL);

  /* A convolution's blocked output (16 channels), then every way out. */
  ps_conv_shape s = {.n = 3, .c = 2, .h = 5, .w = 6, .oc = 16, .kh = 3, .kw = 3, .stride = 1,
                     .pad = 1};
  ps_conv_shape_finish(&s);
  const size_t nx = (size_t)s.n * s.c * s.h * s.w, ny = (size_t)s.n * s.oc * s.oh * s.ow;
  float *x = uniform_floats(nx, -1, 1), *w = uniform_floats((size_t)s.oc * s.c * 9, -1, 1);
  float *b = uniform_floats((size_t)s.oc, -1, 1), *want = nan_floats(ny);
  float *work = xmalloc(ref->conv2d_workspace(ref->ctx, &s) * sizeof(float) + 4);
  ref->conv2d_forward(ref->ctx, &s, x, w, b, want, work);
  float *d_y = dut_nans(ny);
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  float *got = dut_fetch(d_y, ny);
  check_rounding("memory: to_host of a blocked buffer", got, want, ny);

  /* A part of it: NCHW floats from the middle. */
  float part[50];
  dut->to_host(dut->ctx, part, d_y + 100, sizeof part);
  check_bits("memory: to_host of part of a blocked buffer", part, got + 100, 50);

  /* copy into another buffer of ours, and into the middle of one. */
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  float *d_c = dut_nans(ny);
  dut->copy(dut->ctx, d_c, d_y, ny * sizeof(float));
  float *c = dut_fetch(d_c, ny);
  check_bits("memory: copy of a blocked buffer", c, got, ny);
  float *d_big = dut_nans(ny + 7);
  dut->copy(dut->ctx, d_big + 7, d_y, ny * sizeof(float));
  float *big = dut_fetch(d_big, ny + 7);
  check_bits("memory: copy of a blocked buffer to an offset", big + 7, got, ny);
  CHECK(isnan(big[0]) && isnan(big[6]));

  /* to_device over part of a blocked buffer keeps the rest. */
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  const float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  dut->to_device(dut->ctx, d_y + 40, ones, sizeof ones);
  float *patched = dut_fetch(d_y, ny);
  memcpy(got + 40, ones, sizeof ones);
  check_bits("memory: to_device into part of a blocked buffer", patched, got, ny);

  /* NCHW floats written at the start of a blocked buffer (as the softmax's
   * gradient lands in a gradient buffer), then more of them: the rest keeps
   * its values, read in part (within what was written, and across it) and
   * whole. */
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  float *before = dut_fetch(d_y, ny);
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  const float probs[6] = {0.5f, 0.25f, 0.25f, 0.125f, 0.375f, 0.5f};
  const uint8_t labels[2] = {1, 2};
  dut->softmax_xent_backward(dut->ctx, 2, 3, probs, labels, d_y); /* 6 floats */
  float head[6], want_head[6];
  ref->softmax_xent_backward(ref->ctx, 2, 3, probs, labels, want_head);
  dut->to_host(dut->ctx, head, d_y, sizeof head);
  check_bits("memory: prefix written into a blocked buffer", head, want_head, 6);
  dut->to_device(dut->ctx, d_y, ones, sizeof ones); /* 8 floats: a longer prefix */
  float across[12];
  dut->to_host(dut->ctx, across, d_y + 4, sizeof across);
  memcpy(before, ones, sizeof ones);
  check_bits("memory: read across a prefix", across, before + 4, 12);
  float *after = dut_fetch(d_y, ny);
  check_bits("memory: the rest of a blocked buffer after a prefix", after, before, ny);
  free(before), free(after);

  /* scale of a whole blocked buffer, and relu in place on it. */
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  float *fresh = dut_fetch(d_y, ny);
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  dut->scale(dut->ctx, ny, 0.5f, d_y);
  dut->relu_forward(dut->ctx, ny, d_y, d_y);
  float *scaled = dut_fetch(d_y, ny);
  for (size_t i = 0; i < ny; i++) fresh[i] = fresh[i] * 0.5f > 0.0f ? fresh[i] * 0.5f : 0.0f;
  check_bits("memory: scale and relu in place on a blocked buffer", scaled, fresh, ny);

  /* Dropout reads a blocked input in NCHW order (the mask's indices). */
  dut->conv2d_forward(dut->ctx, &s, x, w, b, d_y, NULL);
  float *m = nan_floats(ny), *yd = nan_floats(ny), *m_ref = nan_floats(ny), *yd_ref = nan_floats(ny);
  dut->dropout_forward(dut->ctx, ny, 0.5f, 9, 4, d_y, yd, m);
  float *plain = dut_fetch(d_y, ny);
  ref->dropout_forward(ref->ctx, ny, 0.5f, 9, 4, plain, yd_ref, m_ref);
  check_bits("memory: dropout of a blocked buffer", yd, yd_ref, ny);
  check_bits("memory: dropout mask of a blocked buffer", m, m_ref, ny);

  float *hosts[] = {x, w, b, want, work, got, c, big, patched, fresh, scaled, m, yd, m_ref, yd_ref,
                    plain};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) free(hosts[i]);
  dut->free(dut->ctx, d_y), dut->free(dut->ctx, d_c), dut->free(dut->ctx, d_big);
}

#endif /* PS_HAVE_DNNL */

int main(void) {
#ifndef PS_HAVE_DNNL
  printf("SKIPPED: built without oneDNN (kernels/dnnl needs libdnnl-dev; see CMake's output)\n");
  return 77;
#else
  ref = ps_ops_cpu_create(1);
  /* Teams of 2 and 1, in the blocks this CPU's kernels take; where that is
   * 16 (AVX-512), a third pass in blocks of 8 (AVX2's). */
  int team[3] = {2, 1, 0}, passes = 2;
  for (int t = 0; t < passes; t++) {
    if (t == 2) setenv("PS_DNNL_BLOCK", "8", 1);
    dut = ps_ops_dnnl_create(team[t]);
    if (!ref || !dut) {
      fprintf(stderr, "test_dnnl_parity: cannot create a backend\n");
      return 1;
    }
    if (t == 0 && ps_ops_dnnl_block(dut) == 16) team[passes++] = 2;
    fprintf(stderr, "-- oneDNN backend, %d thread%s, channel blocks of %d\n", team[t],
            team[t] > 1 ? "s" : "", ps_ops_dnnl_block(dut));
    RUN(test_relu);
    RUN(test_add);
    RUN(test_scale);
    RUN(test_dropout);
    RUN(test_softmax_xent);
    RUN(test_maxpool);
    RUN(test_avgpool);
    RUN(test_batchnorm);
    RUN(test_batchnorm_empty_batch);
    RUN(test_dense);
    RUN(test_conv2d);
    RUN(test_conv2d_empty_batch);
    RUN(test_chain);
    RUN(test_memory);
    /* Every convolution above (the quickstart CNN's among them) ran on a
     * JIT kernel, none on oneDNN's reference loops. */
    char first[160];
    int refs = ps_ops_dnnl_ref_impls(dut, first, sizeof first);
    CHECK_MSG(refs == 0, "%d primitive(s) on oneDNN's reference implementation, the first: %s",
              refs, first);
    dut->destroy(dut);
  }
  ref->destroy(ref);
  printf("largest rounding difference: %.3g of the array's largest magnitude\n", worst_seen);
  return check_summary();
#endif
}

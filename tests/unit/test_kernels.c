/* The CPU backend against naive reference loops written here, in double,
 * on odd shapes, with one thread and with its own threads; then a timing
 * print (not a check) of the quickstart CNN at batch 64:
 *
 *   OPENBLAS_NUM_THREADS=2 PS_TEST_THREADS=2 build/test_kernels
 *
 * prints ms per op and examples/s, once for threads = 0 (the caller plus
 * OpenBLAS's threads) and once for the backend's own PS_TEST_THREADS.
 *
 * Tolerances: the backend accumulates in float32, the references in
 * double. With inputs in [-1, 1], a sum of K products carries an error of
 * about sqrt(K) * 2^-24 times the size of its terms, so atol = rtol = 1e-4
 * leaves two orders of magnitude over the K <= 300 sums of these shapes,
 * while an indexing mistake shows up as an O(1) error. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../common/rng.h"
#include "../../kernels/ops.h"
#include "check.h"

static ps_ops *ops;

/* ---- helpers ---- */

/* Test data from a local xorshift, so the inputs do not depend on the code
 * under test elsewhere in the tree. */
static uint64_t rand_state = 88172645463325252ULL;

static double rand_unit(void) { /* [0, 1) */
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (double)(rand_state >> 11) * (1.0 / 9007199254740992.0);
}

static void fill_uniform(float *a, size_t n, float lo, float hi) {
  for (size_t i = 0; i < n; i++) a[i] = lo + (hi - lo) * (float)rand_unit();
}

/* Outputs are prefilled with NaN so that a backend that reads (accumulates
 * into) an output it should overwrite fails the comparison. */
static float *alloc_nan(size_t n) {
  float *a = malloc((n ? n : 1) * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = NAN;
  return a;
}

static float *alloc_uniform(size_t n, float lo, float hi) {
  float *a = malloc((n ? n : 1) * sizeof(float));
  fill_uniform(a, n, lo, hi);
  return a;
}

static double *alloc_zero_d(size_t n) { return calloc(n ? n : 1, sizeof(double)); }

/* One CHECK per array: the first element outside atol + rtol*|want| is
 * reported (NaN fails), with how many elements failed. */
static void check_close(const char *what, const float *got, const double *want, size_t n,
                        double atol, double rtol) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - want[i]);
    if (!(err <= atol + rtol * fabs(want[i]))) {
      if (!bad) first = i;
      bad++;
    }
  }
  CHECK_MSG(bad == 0, "%s: %zu of %zu differ; first at %zu: got %.9g, want %.9g", what, bad, n,
            first, bad ? (double)got[first] : 0.0, bad ? want[first] : 0.0);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- shape helpers ---- */

static void test_shape_finish(void) {
  ps_conv_shape c = {.h = 28, .w = 28, .kh = 3, .kw = 3, .stride = 1, .pad = 1};
  ps_conv_shape_finish(&c);
  CHECK(c.oh == 28 && c.ow == 28);
  c = (ps_conv_shape){.h = 7, .w = 6, .kh = 3, .kw = 2, .stride = 2, .pad = 1};
  ps_conv_shape_finish(&c);
  CHECK(c.oh == 4 && c.ow == 4);
  c = (ps_conv_shape){.h = 7, .w = 8, .kh = 3, .kw = 3, .stride = 2, .pad = 0};
  ps_conv_shape_finish(&c);
  CHECK(c.oh == 3 && c.ow == 3);
  /* A kernel one wider than the input: no output, not (-1)/2 + 1 = 1. */
  c = (ps_conv_shape){.h = 2, .w = 5, .kh = 3, .kw = 3, .stride = 2, .pad = 0};
  ps_conv_shape_finish(&c);
  CHECK(c.oh == 0 && c.ow == 2);
  c = (ps_conv_shape){.h = 5, .w = 5, .kh = 3, .kw = 3, .stride = 0, .pad = 0};
  ps_conv_shape_finish(&c);
  CHECK(c.oh == 0 && c.ow == 0);

  ps_pool_shape p = {.h = 28, .w = 28, .size = 2, .stride = 2};
  ps_pool_shape_finish(&p);
  CHECK(p.oh == 14 && p.ow == 14);
  p = (ps_pool_shape){.h = 7, .w = 6, .size = 3, .stride = 2};
  ps_pool_shape_finish(&p);
  CHECK(p.oh == 3 && p.ow == 2);
  p = (ps_pool_shape){.h = 1, .w = 4, .size = 2, .stride = 2};
  ps_pool_shape_finish(&p);
  CHECK(p.oh == 0 && p.ow == 2);
}

/* ---- convolution ---- */

/* Input position (ih, iw) under output (oh, ow) and kernel tap (kh, kw), or
 * -1 where it falls in the padding. */
static long conv_tap(const ps_conv_shape *s, int oh, int ow, int kh, int kw) {
  int ih = oh * s->stride - s->pad + kh, iw = ow * s->stride - s->pad + kw;
  if (ih < 0 || ih >= s->h || iw < 0 || iw >= s->w) return -1;
  return (long)ih * s->w + iw;
}

/* Direct convolution: y (n, oc, oh, ow). */
static void ref_conv_forward(const ps_conv_shape *s, const float *x, const float *w,
                             const float *b, double *y) {
  const size_t plane = (size_t)s->h * s->w, taps = (size_t)s->kh * s->kw;
  for (int n = 0; n < s->n; n++)
    for (int oc = 0; oc < s->oc; oc++)
      for (int oh = 0; oh < s->oh; oh++)
        for (int ow = 0; ow < s->ow; ow++) {
          double acc = b[oc];
          for (int c = 0; c < s->c; c++)
            for (int kh = 0; kh < s->kh; kh++)
              for (int kw = 0; kw < s->kw; kw++) {
                long at = conv_tap(s, oh, ow, kh, kw);
                if (at < 0) continue;
                acc += (double)x[((size_t)n * s->c + c) * plane + at] *
                       w[((size_t)oc * s->c + c) * taps + kh * s->kw + kw];
              }
          y[(((size_t)n * s->oc + oc) * s->oh + oh) * s->ow + ow] = acc;
        }
}

/* The same loops with every product's gradient sent back to its inputs. */
static void ref_conv_backward(const ps_conv_shape *s, const float *x, const float *w,
                              const float *dy, double *dx, double *dw, double *db) {
  const size_t plane = (size_t)s->h * s->w, taps = (size_t)s->kh * s->kw;
  for (int n = 0; n < s->n; n++)
    for (int oc = 0; oc < s->oc; oc++)
      for (int oh = 0; oh < s->oh; oh++)
        for (int ow = 0; ow < s->ow; ow++) {
          double g = dy[(((size_t)n * s->oc + oc) * s->oh + oh) * s->ow + ow];
          db[oc] += g;
          for (int c = 0; c < s->c; c++)
            for (int kh = 0; kh < s->kh; kh++)
              for (int kw = 0; kw < s->kw; kw++) {
                long at = conv_tap(s, oh, ow, kh, kw);
                if (at < 0) continue;
                size_t xi = ((size_t)n * s->c + c) * plane + at;
                size_t wi = ((size_t)oc * s->c + c) * taps + kh * s->kw + kw;
                dw[wi] += g * x[xi];
                dx[xi] += g * w[wi];
              }
        }
}

/* Forward and backward (with and without dx) of one shape against the
 * references, with a workspace of exactly conv2d_workspace floats so that
 * ASan catches the backend writing past what it asked for. */
static void check_conv(int n, int c, int h, int w, int oc, int kh, int kw, int stride, int pad,
                       double tol) {
  ps_conv_shape s = {.n = n, .c = c, .h = h, .w = w, .oc = oc, .kh = kh, .kw = kw,
                     .stride = stride, .pad = pad};
  ps_conv_shape_finish(&s);
  CHECK(s.oh > 0 && s.ow > 0);
  const size_t xn = (size_t)n * c * h * w, wn = (size_t)oc * c * kh * kw;
  const size_t yn = (size_t)n * oc * s.oh * s.ow;
  char what[160];
  snprintf(what, sizeof what, "conv n=%d c=%d %dx%d oc=%d k=%dx%d s=%d p=%d", n, c, h, w, oc, kh,
           kw, stride, pad);

  size_t ws = ops->conv2d_workspace(ops->ctx, &s);
  float *work = malloc((ws ? ws : 1) * sizeof(float));
  float *x = alloc_uniform(xn, -1, 1), *wt = alloc_uniform(wn, -1, 1);
  float *b = alloc_uniform((size_t)oc, -1, 1), *dy = alloc_uniform(yn, -1, 1);
  float *y = alloc_nan(yn), *dx = alloc_nan(xn), *dw = alloc_nan(wn), *db = alloc_nan(oc);
  double *ry = alloc_zero_d(yn), *rdx = alloc_zero_d(xn), *rdw = alloc_zero_d(wn);
  double *rdb = alloc_zero_d(oc);

  ref_conv_forward(&s, x, wt, b, ry);
  ref_conv_backward(&s, x, wt, dy, rdx, rdw, rdb);

  ops->conv2d_forward(ops->ctx, &s, x, wt, b, y, work);
  char sub[200];
  snprintf(sub, sizeof sub, "%s: y", what);
  check_close(sub, y, ry, yn, tol, tol);

  ops->conv2d_backward(ops->ctx, &s, x, wt, dy, dx, dw, db, work);
  snprintf(sub, sizeof sub, "%s: dx", what);
  check_close(sub, dx, rdx, xn, tol, tol);
  snprintf(sub, sizeof sub, "%s: dw", what);
  check_close(sub, dw, rdw, wn, tol, tol);
  snprintf(sub, sizeof sub, "%s: db", what);
  check_close(sub, db, rdb, (size_t)oc, tol, tol);

  /* The first layer passes dx = NULL; dw and db must not change. */
  for (size_t i = 0; i < wn; i++) dw[i] = NAN;
  for (int i = 0; i < oc; i++) db[i] = NAN;
  ops->conv2d_backward(ops->ctx, &s, x, wt, dy, NULL, dw, db, work);
  snprintf(sub, sizeof sub, "%s: dw (dx NULL)", what);
  check_close(sub, dw, rdw, wn, tol, tol);
  snprintf(sub, sizeof sub, "%s: db (dx NULL)", what);
  check_close(sub, db, rdb, (size_t)oc, tol, tol);

  free(work), free(x), free(wt), free(b), free(dy), free(y), free(dx), free(dw), free(db);
  free(ry), free(rdx), free(rdw), free(rdb);
}

static void test_conv_small(void) {
  check_conv(1, 1, 5, 7, 2, 3, 3, 1, 0, 1e-4);  /* n=1, one channel */
  check_conv(3, 3, 7, 6, 5, 3, 2, 2, 1, 1e-4);  /* non-square kernel, stride 2 */
  check_conv(3, 5, 6, 9, 3, 3, 3, 1, 1, 1e-4);  /* same padding */
  check_conv(1, 3, 8, 5, 1, 2, 2, 2, 0, 1e-4);  /* even windows, one filter */
  check_conv(3, 1, 4, 4, 4, 5, 5, 2, 1, 1e-4);  /* kernel wider than the input */
  check_conv(3, 5, 3, 4, 3, 1, 1, 1, 0, 1e-4);  /* 1x1 */
  check_conv(2, 2, 7, 8, 3, 3, 3, 3, 2, 1e-4);  /* whole rows of padding */
  check_conv(3, 3, 9, 1, 2, 3, 1, 1, 1, 1e-4);  /* a single column */
  check_conv(2, 2, 6, 7, 3, 5, 5, 1, 2, 1e-4);  /* same padding, wider kernel */
  check_conv(2, 3, 4, 5, 2, 1, 3, 1, 1, 1e-4);  /* same width, rows of padding */
}

/* A batch whose columns do not fit in one chunk, so the backend goes
 * through it a few examples at a time and accumulates dW across chunks;
 * the workspace being smaller than the whole batch's columns shows that
 * the path was taken. dW sums 13*32*32 products, hence the looser atol. */
static void test_conv_chunked(void) {
  ps_conv_shape s = {.n = 13, .c = 8, .h = 32, .w = 32, .oc = 16, .kh = 3, .kw = 3,
                     .stride = 1, .pad = 1};
  ps_conv_shape_finish(&s);
  size_t whole = (size_t)s.n * ((size_t)s.c * s.kh * s.kw + s.oc) * s.oh * s.ow;
  size_t ws = ops->conv2d_workspace(ops->ctx, &s);
  CHECK_MSG(ws < whole, "workspace %zu floats, whole batch %zu: not chunked, enlarge the shape",
            ws, whole);
  check_conv(13, 8, 32, 32, 16, 3, 3, 1, 1, 1e-3);
}

/* Smaller batches must not need more scratch than larger ones: the worker
 * sizes the workspace once for its largest batch. */
static void test_conv_workspace_monotone(void) {
  ps_conv_shape s = {.c = 32, .h = 14, .w = 14, .oc = 64, .kh = 3, .kw = 3, .stride = 1,
                     .pad = 1};
  ps_conv_shape_finish(&s);
  size_t prev = 0;
  int ok = 1;
  for (int n = 1; n <= 256; n++) {
    s.n = n;
    size_t ws = ops->conv2d_workspace(ops->ctx, &s);
    if (ws < prev) ok = 0;
    prev = ws;
  }
  CHECK(ok);
}

/* ---- max pooling ---- */

static void check_maxpool(int n, int c, int h, int w, int size, int stride) {
  ps_pool_shape s = {.n = n, .c = c, .h = h, .w = w, .size = size, .stride = stride};
  ps_pool_shape_finish(&s);
  CHECK(s.oh > 0 && s.ow > 0);
  const size_t planes = (size_t)n * c, in_plane = (size_t)h * w;
  const size_t out_plane = (size_t)s.oh * s.ow, xn = planes * in_plane, yn = planes * out_plane;
  char what[120];
  snprintf(what, sizeof what, "maxpool n=%d c=%d %dx%d size=%d stride=%d", n, c, h, w, size,
           stride);

  float *x = alloc_uniform(xn, -1, 1), *dy = alloc_uniform(yn, -1, 1);
  float *y = alloc_nan(yn), *dx = alloc_nan(xn);
  int32_t *arg = malloc(yn * sizeof(int32_t));
  double *ry = alloc_zero_d(yn), *rdx = alloc_zero_d(xn);

  for (size_t p = 0; p < planes; p++)
    for (int oh = 0; oh < s.oh; oh++)
      for (int ow = 0; ow < s.ow; ow++) {
        size_t best = (size_t)oh * stride * w + (size_t)ow * stride;
        for (int kh = 0; kh < size; kh++)
          for (int kw = 0; kw < size; kw++) {
            size_t at = (size_t)(oh * stride + kh) * w + (size_t)(ow * stride + kw);
            if (x[p * in_plane + at] > x[p * in_plane + best]) best = at;
          }
        ry[p * out_plane + (size_t)oh * s.ow + ow] = x[p * in_plane + best];
        rdx[p * in_plane + best] += dy[p * out_plane + (size_t)oh * s.ow + ow];
      }

  ops->maxpool_forward(ops->ctx, &s, x, y, arg);
  char sub[160];
  snprintf(sub, sizeof sub, "%s: y", what);
  check_close(sub, y, ry, yn, 0, 0);
  /* argmax: inside its own window and pointing at the maximum. */
  int arg_ok = 1;
  for (size_t p = 0; p < planes; p++)
    for (int oh = 0; oh < s.oh; oh++)
      for (int ow = 0; ow < s.ow; ow++) {
        int32_t a = arg[p * out_plane + (size_t)oh * s.ow + ow];
        int ih = a / w, iw = a % w;
        if (a < 0 || ih < oh * stride || ih >= oh * stride + size || iw < ow * stride ||
            iw >= ow * stride + size || x[p * in_plane + a] != y[p * out_plane + oh * s.ow + ow])
          arg_ok = 0;
      }
  CHECK_MSG(arg_ok, "%s: argmax", what);

  ops->maxpool_backward(ops->ctx, &s, dy, arg, dx);
  snprintf(sub, sizeof sub, "%s: dx", what);
  check_close(sub, dx, rdx, xn, 1e-6, 1e-6);

  free(x), free(dy), free(y), free(dx), free(arg), free(ry), free(rdx);
}

static void test_maxpool(void) {
  check_maxpool(3, 5, 7, 5, 2, 2); /* odd sizes: last row/column dropped */
  check_maxpool(1, 3, 6, 9, 3, 2); /* overlapping windows */
  check_maxpool(3, 1, 4, 4, 2, 1); /* stride 1: most inputs in 4 windows */
  check_maxpool(1, 1, 2, 2, 2, 2); /* one window */
  check_maxpool(3, 8, 40, 37, 2, 2); /* 35520 inputs: big enough to be split */
  check_maxpool(2, 7, 41, 39, 3, 2); /* and overlapping */
}

/* Equal values: any index in the window is a maximum, but it must be one. */
static void test_maxpool_ties(void) {
  ps_pool_shape s = {.n = 1, .c = 2, .h = 4, .w = 4, .size = 2, .stride = 2};
  ps_pool_shape_finish(&s);
  float x[32], y[8];
  int32_t arg[8];
  for (int i = 0; i < 32; i++) x[i] = 0.5f;
  ops->maxpool_forward(ops->ctx, &s, x, y, arg);
  int ok = 1;
  for (int p = 0; p < 2; p++)
    for (int o = 0; o < 4; o++) {
      int a = arg[p * 4 + o], oh = o / 2, ow = o % 2;
      if (y[p * 4 + o] != 0.5f || a / 4 / 2 != oh || a % 4 / 2 != ow) ok = 0;
    }
  CHECK(ok);
}

/* 2x2 windows with stride 2 on rows of 4 windows (all in the vectorized
 * part), 14 (the quickstart's first pooling: 12 + 2 one at a time) and 7
 * (its second: 4 + 3), against the reference; then, bit for bit on rows
 * of 14 windows: ties (the first in row-major order wins; +0 does not
 * beat an earlier -0), a NaN first tap (no later tap compares greater),
 * and a -0 gradient, which the zeroed plane plus dy makes +0 at its tap. */
static void test_maxpool_pairs(void) {
  check_maxpool(2, 3, 8, 8, 2, 2);
  check_maxpool(2, 3, 28, 28, 2, 2);
  check_maxpool(2, 3, 14, 14, 2, 2);

  ps_pool_shape s = {.n = 1, .c = 1, .h = 2, .w = 28, .size = 2, .stride = 2};
  ps_pool_shape_finish(&s);
  enum { W = 28, OW = 14 };
  /* Windows (tl, tr, bl, br), and which of them must win: 0 tl ... 3 br. */
  enum { KINDS = 6 };
  const float pattern[KINDS][4] = {
      {0.5f, 0.5f, 0.5f, 0.5f},     /* all equal: tl */
      {-0.0f, 0.0f, 0.0f, -0.0f},   /* +0 is not greater than -0: tl */
      {1.0f, 2.0f, 2.0f, 1.0f},     /* tie of tr and bl: tr */
      {1.0f, 1.0f, 3.0f, 3.0f},     /* tie of bl and br: bl */
      {-1.0f, -3.0f, -1.0f, -0.5f}, /* br */
      {NAN, 1.0f, 2.0f, 3.0f},      /* nothing compares greater than NaN: tl */
  };
  const int want_tap[KINDS] = {0, 0, 1, 2, 3, 0};
  float x[2 * W], y[OW], dy[OW], dx[2 * W];
  int32_t arg[OW];
  for (int ow = 0; ow < OW; ow++) {
    const float *t = pattern[ow % KINDS];
    x[2 * ow] = t[0], x[2 * ow + 1] = t[1], x[W + 2 * ow] = t[2], x[W + 2 * ow + 1] = t[3];
    dy[ow] = ow % 2 ? -0.0f : (float)ow;
  }
  ops->maxpool_forward(ops->ctx, &s, x, y, arg);
  int ok = 1;
  for (int ow = 0; ow < OW; ow++) {
    const int tap = want_tap[ow % KINDS], at = 2 * ow + (tap & 1) + (tap >> 1) * W;
    ok &= arg[ow] == at && memcmp(&y[ow], &x[at], sizeof(float)) == 0;
  }
  CHECK_MSG(ok, "2x2 pooling: first maximum, bit for bit");
  ops->maxpool_backward(ops->ctx, &s, dy, arg, dx);
  ok = 1;
  for (int i = 0; i < 2 * W; i++) {
    const int ow = i % W / 2;
    const float want = i == arg[ow] ? 0.0f + dy[ow] : 0.0f;
    ok &= memcmp(&dx[i], &want, sizeof(float)) == 0;
  }
  CHECK_MSG(ok, "2x2 pooling gradient: dy at the maximum, +0 elsewhere and for a -0 dy");
}

/* ---- average pooling ----
 *
 * Against double loops: the mean of each window (atol covers the float32
 * sum of at most 9 taps of [-1, 1]), and backward each window's dy / taps
 * added to every tap it covers. */

static void check_avgpool(int n, int c, int h, int w, int size, int stride) {
  char what[96];
  snprintf(what, sizeof what, "avgpool n=%d c=%d %dx%d size=%d stride=%d", n, c, h, w, size,
           stride);
  ps_pool_shape s = {.n = n, .c = c, .h = h, .w = w, .size = size, .stride = stride};
  ps_pool_shape_finish(&s);
  const size_t planes = (size_t)n * c, in_plane = (size_t)h * w;
  const size_t out_plane = (size_t)s.oh * s.ow, xn = planes * in_plane, yn = planes * out_plane;
  float *x = alloc_uniform(xn, -1, 1), *dy = alloc_uniform(yn, -1, 1);
  float *y = alloc_nan(yn), *dx = alloc_nan(xn);
  double *ry = alloc_zero_d(yn), *rdx = alloc_zero_d(xn);
  const double taps = (double)size * size;
  for (size_t p = 0; p < planes; p++)
    for (int oh = 0; oh < s.oh; oh++)
      for (int ow = 0; ow < s.ow; ow++) {
        const size_t o = p * out_plane + (size_t)oh * s.ow + ow;
        double sum = 0.0;
        for (int kh = 0; kh < size; kh++)
          for (int kw = 0; kw < size; kw++) {
            const size_t at = p * in_plane + (size_t)(oh * stride + kh) * w + (ow * stride + kw);
            sum += x[at];
            rdx[at] += dy[o] / taps;
          }
        ry[o] = sum / taps;
      }
  ops->avgpool_forward(ops->ctx, &s, x, y);
  char sub[160];
  snprintf(sub, sizeof sub, "%s: y", what);
  check_close(sub, y, ry, yn, 1e-6, 1e-6);
  ops->avgpool_backward(ops->ctx, &s, dy, dx);
  snprintf(sub, sizeof sub, "%s: dx", what);
  check_close(sub, dx, rdx, xn, 1e-6, 1e-6);
  free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
}

static void test_avgpool(void) {
  check_avgpool(3, 5, 7, 5, 2, 2);   /* odd sizes: last row/column dropped */
  check_avgpool(1, 3, 6, 9, 3, 2);   /* overlapping windows */
  check_avgpool(3, 1, 4, 4, 2, 1);   /* stride 1: most inputs in 4 windows */
  check_avgpool(1, 1, 2, 2, 2, 2);   /* one window */
  check_avgpool(2, 2, 5, 7, 1, 1);   /* 1x1: the identity */
  check_avgpool(3, 8, 40, 37, 2, 2); /* 35520 inputs: big enough to be split */
  check_avgpool(2, 7, 41, 39, 3, 2); /* and overlapping */
}

static void check_global_avgpool(int n, int c, int h, int w) {
  char what[96];
  snprintf(what, sizeof what, "global_avgpool n=%d c=%d %dx%d", n, c, h, w);
  const size_t planes = (size_t)n * c, plane = (size_t)h * w, xn = planes * plane;
  float *x = alloc_uniform(xn, -1, 1), *dy = alloc_uniform(planes, -1, 1);
  float *y = alloc_nan(planes), *dx = alloc_nan(xn);
  double *ry = alloc_zero_d(planes), *rdx = alloc_zero_d(xn);
  for (size_t p = 0; p < planes; p++) {
    double sum = 0.0;
    for (size_t i = 0; i < plane; i++) {
      sum += x[p * plane + i];
      rdx[p * plane + i] = dy[p] / (double)plane;
    }
    ry[p] = sum / (double)plane;
  }
  ops->global_avgpool_forward(ops->ctx, n, c, h, w, x, y);
  char sub[160];
  snprintf(sub, sizeof sub, "%s: y", what);
  /* A float32 sum of up to 1681 terms of [-1, 1]: sqrt(K) 2^-24 K / K. */
  check_close(sub, y, ry, planes, 1e-5, 1e-5);
  ops->global_avgpool_backward(ops->ctx, n, c, h, w, dy, dx);
  snprintf(sub, sizeof sub, "%s: dx", what);
  check_close(sub, dx, rdx, xn, 1e-6, 1e-6);
  free(x), free(dy), free(y), free(dx), free(ry), free(rdx);
}

static void test_global_avgpool(void) {
  check_global_avgpool(3, 5, 7, 5);
  check_global_avgpool(2, 3, 1, 1);    /* 1x1: the identity */
  check_global_avgpool(1, 1, 1, 9);    /* one row */
  check_global_avgpool(4, 16, 41, 41); /* 107584 inputs: split */
}

/* The arithmetic every backend repeats (ops.h), bit for bit on a plane:
 * the taps summed from 0 in row-major order, then divided; the gradient of
 * overlapping windows added into a zeroed plane in (oh, ow) order. */
static void test_avgpool_order(void) {
  ps_pool_shape s = {.n = 1, .c = 1, .h = 5, .w = 5, .size = 3, .stride = 1};
  ps_pool_shape_finish(&s);
  float x[25], y[9], dy[9], dx[25], want_dx[25] = {0};
  fill_uniform(x, 25, -1, 1);
  fill_uniform(dy, 9, -1, 1);
  x[0] = -0.0f; /* a sum from +0 */
  ops->avgpool_forward(ops->ctx, &s, x, y);
  ops->avgpool_backward(ops->ctx, &s, dy, dx);
  int ok = 1;
  for (int oh = 0; oh < 3; oh++)
    for (int ow = 0; ow < 3; ow++) {
      float sum = 0.0f;
      const float g = dy[oh * 3 + ow] / 9.0f;
      for (int kh = 0; kh < 3; kh++)
        for (int kw = 0; kw < 3; kw++) {
          sum += x[(oh + kh) * 5 + ow + kw];
          want_dx[(oh + kh) * 5 + ow + kw] += g;
        }
      const float want = sum / 9.0f;
      ok &= memcmp(&y[oh * 3 + ow], &want, sizeof want) == 0;
    }
  CHECK_MSG(ok, "avgpool: the sum's order, bit for bit");
  CHECK_MSG(memcmp(dx, want_dx, sizeof dx) == 0, "avgpool gradient: the adds' order, bit for bit");
}

/* ---- dense ---- */

static void check_dense(int n, int in, int out) {
  char what[80];
  snprintf(what, sizeof what, "dense n=%d in=%d out=%d", n, in, out);
  const size_t xn = (size_t)n * in, wn = (size_t)out * in, yn = (size_t)n * out;
  float *x = alloc_uniform(xn, -1, 1), *w = alloc_uniform(wn, -1, 1);
  float *b = alloc_uniform(out, -1, 1), *dy = alloc_uniform(yn, -1, 1);
  float *y = alloc_nan(yn), *dx = alloc_nan(xn), *dw = alloc_nan(wn), *db = alloc_nan(out);
  double *ry = alloc_zero_d(yn), *rdx = alloc_zero_d(xn), *rdw = alloc_zero_d(wn);
  double *rdb = alloc_zero_d(out);

  for (int i = 0; i < n; i++)
    for (int j = 0; j < out; j++) {
      double acc = b[j], g = dy[(size_t)i * out + j];
      for (int k = 0; k < in; k++) {
        acc += (double)x[(size_t)i * in + k] * w[(size_t)j * in + k];
        rdw[(size_t)j * in + k] += g * x[(size_t)i * in + k];
        rdx[(size_t)i * in + k] += g * w[(size_t)j * in + k];
      }
      ry[(size_t)i * out + j] = acc;
      rdb[j] += g;
    }

  char sub[140];
  ops->dense_forward(ops->ctx, n, in, out, x, w, b, y);
  snprintf(sub, sizeof sub, "%s: y", what);
  check_close(sub, y, ry, yn, 1e-4, 1e-4);
  ops->dense_backward(ops->ctx, n, in, out, x, w, dy, dx, dw, db);
  snprintf(sub, sizeof sub, "%s: dx", what);
  check_close(sub, dx, rdx, xn, 1e-4, 1e-4);
  snprintf(sub, sizeof sub, "%s: dw", what);
  check_close(sub, dw, rdw, wn, 1e-4, 1e-4);
  snprintf(sub, sizeof sub, "%s: db", what);
  check_close(sub, db, rdb, out, 1e-4, 1e-4);

  for (size_t i = 0; i < wn; i++) dw[i] = NAN;
  ops->dense_backward(ops->ctx, n, in, out, x, w, dy, NULL, dw, db);
  snprintf(sub, sizeof sub, "%s: dw (dx NULL)", what);
  check_close(sub, dw, rdw, wn, 1e-4, 1e-4);

  free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db);
  free(ry), free(rdx), free(rdw), free(rdb);
}

static void test_dense(void) {
  check_dense(1, 1, 1);
  check_dense(3, 5, 7);
  check_dense(5, 33, 10);
  check_dense(1, 300, 3);
  check_dense(64, 300, 71); /* 1.4M multiply-adds: big enough to be split */
}

/* ---- elementwise ---- */

/* The edge values repeated over 21 elements: the backend's blocked main
 * loop and its tail both see them. */
static void test_relu(void) {
  const float edge[] = {-2.0f, -0.0f, 0.0f, 1e-30f, 3.5f, -1e-30f, 7.0f};
  enum { N = 21 };
  const size_t n = N;
  float x[N], y[N], dy[N], dx[N];
  for (size_t i = 0; i < n; i++) x[i] = edge[i % 7], dy[i] = (float)(i + 1);
  ops->relu_forward(ops->ctx, n, x, y);
  int ok = 1;
  for (size_t i = 0; i < n; i++) ok &= y[i] == (x[i] > 0 ? x[i] : 0.0f);
  CHECK(ok);
  ops->relu_backward(ops->ctx, n, y, dy, dx);
  ok = 1;
  for (size_t i = 0; i < n; i++) ok &= dx[i] == (x[i] > 0 ? dy[i] : 0.0f);
  CHECK(ok);
}

/* Random signs over an array big enough to be split into parts. */
static void test_relu_large(void) {
  enum { N = 100003 };
  float *x = alloc_uniform(N, -1, 1), *y = alloc_nan(N), *dy = alloc_uniform(N, -1, 1);
  float *dx = alloc_nan(N);
  ops->relu_forward(ops->ctx, N, x, y);
  ops->relu_backward(ops->ctx, N, y, dy, dx);
  int ok = 1;
  for (size_t i = 0; i < N; i++) {
    ok &= y[i] == (x[i] > 0 ? x[i] : 0.0f);
    ok &= dx[i] == (x[i] > 0 ? dy[i] : 0.0f);
  }
  CHECK(ok);
  /* In place, as a model may run it. */
  ops->relu_forward(ops->ctx, N, x, x);
  ok = 1;
  for (size_t i = 0; i < N; i++) ok &= x[i] == y[i];
  CHECK(ok);
  free(x), free(y), free(dy), free(dx);
}

/* y = a + b, rounded once per element as float: small (the main loop and
 * its tail, signed zeros and infinities) and split into parts. */
static void test_add(void) {
  const float ea[] = {1.0f, -0.0f, 0.0f, 1e30f, -3.5f, INFINITY, 0.1f};
  const float eb[] = {2.0f, -0.0f, -0.0f, 1e30f, 3.5f, 1.0f, 0.2f};
  enum { N = 21 };
  float a[N], b[N], y[N];
  for (size_t i = 0; i < N; i++) a[i] = ea[i % 7], b[i] = eb[i % 7];
  ops->add(ops->ctx, N, a, b, y);
  int ok = 1;
  for (size_t i = 0; i < N; i++) {
    const float want = a[i] + b[i];
    ok &= memcmp(&y[i], &want, sizeof want) == 0; /* -0 + -0 is -0, -0 + 0 is +0 */
  }
  CHECK(ok);
  enum { L = 100003 };
  float *la = alloc_uniform(L, -1, 1), *lb = alloc_uniform(L, -1, 1), *ly = alloc_nan(L);
  ops->add(ops->ctx, L, la, lb, ly);
  ok = 1;
  for (size_t i = 0; i < L; i++) ok &= ly[i] == la[i] + lb[i];
  CHECK(ok);
  free(la), free(lb), free(ly);
}

/* The ops of two inputs: relu's and dropout's backward, add. */
typedef void (*backward_op)(void *ctx, size_t n, const float *a, const float *b, float *out);

/* op in place over a, then over b, gives bit for bit what it writes to an
 * array of its own (ops.h: element-wise ops may run in place). */
static void check_in_place(const char *name, backward_op op, const float *a, const float *b,
                           size_t n) {
  float *want = alloc_nan(n), *buf = alloc_nan(n);
  op(ops->ctx, n, a, b, want);
  memcpy(buf, a, n * sizeof(float));
  op(ops->ctx, n, buf, b, buf);
  CHECK_MSG(memcmp(buf, want, n * sizeof(float)) == 0, "%s in place over its first input", name);
  memcpy(buf, b, n * sizeof(float));
  op(ops->ctx, n, a, buf, buf);
  CHECK_MSG(memcmp(buf, want, n * sizeof(float)) == 0, "%s in place over its second input", name);
  free(want), free(buf);
}

/* Over a size that is no multiple of any block or tile and is split into
 * parts. */
static void test_backward_in_place(void) {
  enum { N = 100003 };
  float *y = alloc_uniform(N, -1, 1), *dy = alloc_uniform(N, -1, 1), *mask = alloc_uniform(N, 0, 2);
  check_in_place("relu_backward", ops->relu_backward, y, dy, N);
  check_in_place("dropout_backward", ops->dropout_backward, mask, dy, N);
  check_in_place("add", ops->add, y, dy, N);
  free(y), free(dy), free(mask);
}

static void test_dropout(void) {
  enum { N = 40000 }; /* big enough to be split */
  const float rate = 0.3f, scale = 1.0f / (1.0f - rate);
  float *x = alloc_uniform(N, -1, 1), *y = alloc_nan(N), *mask = alloc_nan(N);
  float *y2 = alloc_nan(N), *mask2 = alloc_nan(N), *dy = alloc_uniform(N, -1, 1);
  float *dx = alloc_nan(N);

  ops->dropout_forward(ops->ctx, N, rate, 42, 7, x, y, mask);
  size_t kept = 0;
  int ok = 1;
  for (size_t i = 0; i < N; i++) {
    float want = ps_rng_uniform(42, 7, i) >= rate ? scale : 0.0f;
    ok &= mask[i] == want && y[i] == x[i] * want;
    kept += mask[i] != 0.0f;
  }
  CHECK_MSG(ok, "mask follows ps_rng_uniform(seed, stream, i) >= rate");
  /* Kept fraction ~ Binomial(N, 0.7)/N: sd 0.0032, so 0.02 is 6 sd. */
  CHECK_NEAR((double)kept / N, 1.0 - rate, 0.02, 0);

  /* The same (seed, stream) replays the same mask; another stream does not. */
  ops->dropout_forward(ops->ctx, N, rate, 42, 7, x, y2, mask2);
  CHECK(memcmp(mask, mask2, N * sizeof(float)) == 0);
  ops->dropout_forward(ops->ctx, N, rate, 42, 8, x, y2, mask2);
  CHECK(memcmp(mask, mask2, N * sizeof(float)) != 0);

  ops->dropout_backward(ops->ctx, N, mask, dy, dx);
  ok = 1;
  for (size_t i = 0; i < N; i++) ok &= dx[i] == dy[i] * mask[i];
  CHECK(ok);

  /* rate 0 is the identity; rate 1 drops everything (no infinite scale). */
  ops->dropout_forward(ops->ctx, N, 0.0f, 1, 1, x, y2, mask2);
  CHECK(memcmp(x, y2, N * sizeof(float)) == 0);
  ops->dropout_forward(ops->ctx, N, 1.0f, 1, 1, x, y2, mask2);
  ok = 1;
  for (size_t i = 0; i < N; i++) ok &= y2[i] == 0.0f && mask2[i] == 0.0f;
  CHECK(ok);

  free(x), free(y), free(mask), free(y2), free(mask2), free(dy), free(dx);
}

/* ---- softmax + cross-entropy ---- */

static void test_softmax_xent(void) {
  enum { N = 3, K = 5 };
  float logits[N * K], probs[N * K], dl[N * K];
  const uint8_t labels[N] = {4, 0, 2};
  fill_uniform(logits, N * K, -3, 3);
  double rp[N * K], rdl[N * K], loss = 0;
  for (int i = 0; i < N; i++) {
    double sum = 0;
    for (int j = 0; j < K; j++) sum += exp((double)logits[i * K + j]);
    for (int j = 0; j < K; j++) {
      rp[i * K + j] = exp((double)logits[i * K + j]) / sum;
      rdl[i * K + j] = (rp[i * K + j] - (j == labels[i])) / N;
    }
    loss -= log(rp[i * K + labels[i]]) / N;
  }
  float got = ops->softmax_xent_forward(ops->ctx, N, K, logits, labels, probs);
  CHECK_NEAR(got, loss, 1e-6, 1e-6);
  check_close("softmax probs", probs, rp, N * K, 1e-6, 1e-6);
  ops->softmax_xent_backward(ops->ctx, N, K, probs, labels, dl);
  check_close("softmax dlogits", dl, rdl, N * K, 1e-6, 1e-6);

  /* Logits far apart: no overflow, and the loss of a label whose
   * probability underflows to 0 is its finite log-sum-exp value. */
  float big[6] = {1000.0f, 0.0f, -1000.0f, 0.0f, 0.0f, 0.0f};
  const uint8_t lab[2] = {2, 1};
  got = ops->softmax_xent_forward(ops->ctx, 2, 3, big, lab, probs);
  CHECK_NEAR(got, (2000.0 + log(3.0)) / 2, 1e-3, 1e-6);
  CHECK(probs[0] == 1.0f && probs[1] == 0.0f && probs[2] == 0.0f);
  CHECK_NEAR(probs[3], 1.0 / 3, 1e-7, 0);

  /* A label outside [0, k) is reported as a NaN loss, not read past. */
  const uint8_t bad[2] = {3, 1};
  CHECK(isnan(ops->softmax_xent_forward(ops->ctx, 2, 3, big, bad, probs)));

  /* The same without a wait: the loss sum and the arg-max count, whose ties
   * go to the first class (rows 1 and 2 below). */
  CHECK(ops->softmax_xent_stats != NULL);
  if (!ops->softmax_xent_stats) return;
  double stats[2] = {-1, -1};
  float p2[N * K];
  ops->softmax_xent_stats(ops->ctx, N, K, logits, labels, p2, stats);
  CHECK((float)(stats[0] / N) == ops->softmax_xent_forward(ops->ctx, N, K, logits, labels, probs));
  CHECK(memcmp(p2, probs, sizeof p2) == 0);
  int want = 0;
  for (int i = 0; i < N; i++) {
    int best = 0;
    for (int j = 1; j < K; j++)
      if (rp[i * K + j] > rp[i * K + best]) best = j;
    want += best == labels[i];
  }
  CHECK_MSG(stats[1] == want, "stats: %g correct, want %d", stats[1], want);
  float tie[9] = {2, 2, 0, 1, 3, 3, 5, 0, 0};
  const uint8_t tl[3] = {1, 1, 0}; /* ties: class 0 wins, 1 wins; then 0 is right */
  ops->softmax_xent_stats(ops->ctx, 3, 3, tie, tl, p2, stats);
  CHECK_MSG(stats[1] == 2, "ties: %g correct, want 2", stats[1]);
  ops->softmax_xent_stats(ops->ctx, 2, 3, big, bad, p2, stats);
  CHECK(isnan(stats[0]));
  ops->softmax_xent_stats(ops->ctx, 0, 3, big, bad, p2, stats);
  CHECK(stats[0] == 0.0 && stats[1] == 0.0);
}

/* ---- timing ---- */

/* The quickstart CNN at batch 64, forward and backward through the backend
 * as the worker runs it, plus an Adam step over all parameters (which the
 * PS does, but PyTorch's reference number includes it). Printed, never
 * asserted: the time depends on the machine and on what else runs. */
enum { B = 64 };
enum {
  T_CONV1_FWD, T_CONV2_FWD, T_POOL_FWD, T_RELU_FWD, T_DENSE_FWD, T_SOFTMAX, T_DENSE_BWD,
  T_RELU_BWD, T_POOL_BWD, T_CONV2_BWD, T_CONV1_BWD, T_ADAM, T_TOTAL, NTIMERS
};
static const char *timer_names[NTIMERS] = {
    "conv1 fwd", "conv2 fwd", "pool fwd", "relu fwd", "dense fwd", "softmax",
    "dense bwd", "relu bwd", "pool bwd", "conv2 bwd", "conv1 bwd", "adam", "total"};
static double timers[NTIMERS];

#define TIMED(slot, call)              \
  do {                                 \
    double t0_ = now_s();              \
    call;                              \
    timers[slot] += now_s() - t0_;     \
  } while (0)

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void adam_step(size_t n, float *p, const float *g, float *m, float *v, int t) {
  const float b1 = 0.9f, b2 = 0.999f, lr = 1e-3f, eps = 1e-8f;
  const float c1 = 1.0f / (1.0f - powf(b1, (float)t)), c2 = 1.0f / (1.0f - powf(b2, (float)t));
  for (size_t i = 0; i < n; i++) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= lr * (m[i] * c1) / (sqrtf(v[i] * c2) + eps);
  }
}

static void test_timing_quickstart_cnn(void) {
  ps_conv_shape c1 = {.n = B, .c = 1, .h = 28, .w = 28, .oc = 32, .kh = 3, .kw = 3,
                      .stride = 1, .pad = 1};
  ps_conv_shape c2 = {.n = B, .c = 32, .h = 14, .w = 14, .oc = 64, .kh = 3, .kw = 3,
                      .stride = 1, .pad = 1};
  ps_pool_shape p1 = {.n = B, .c = 32, .h = 28, .w = 28, .size = 2, .stride = 2};
  ps_pool_shape p2 = {.n = B, .c = 64, .h = 14, .w = 14, .size = 2, .stride = 2};
  ps_conv_shape_finish(&c1), ps_conv_shape_finish(&c2);
  ps_pool_shape_finish(&p1), ps_pool_shape_finish(&p2);
  const int D1 = 64 * 7 * 7, H = 128, K = 10;

  /* Parameters and gradients, each one allocation carved into layers. */
  const size_t nw1 = 32 * 9, nw2 = 64 * 32 * 9, nw3 = (size_t)H * D1, nw4 = (size_t)K * H;
  const size_t np = nw1 + 32 + nw2 + 64 + nw3 + H + nw4 + K;
  float *params = malloc(np * sizeof(float)), *grads = alloc_nan(np);
  float *adam_m = calloc(np, sizeof(float)), *adam_v = calloc(np, sizeof(float));
  float *w1 = params, *b1 = w1 + nw1, *w2 = b1 + 32, *b2 = w2 + nw2, *w3 = b2 + 64;
  float *b3 = w3 + nw3, *w4 = b3 + H, *b4 = w4 + nw4;
  float *gw1 = grads, *gb1 = gw1 + nw1, *gw2 = gb1 + 32, *gb2 = gw2 + nw2, *gw3 = gb2 + 64;
  float *gb3 = gw3 + nw3, *gw4 = gb3 + H, *gb4 = gw4 + nw4;
  /* He-uniform weights keep activations O(1) (no denormals to slow things). */
  fill_uniform(w1, nw1, -sqrtf(6.0f / 9), sqrtf(6.0f / 9));
  fill_uniform(w2, nw2, -sqrtf(6.0f / 288), sqrtf(6.0f / 288));
  fill_uniform(w3, nw3, -sqrtf(6.0f / D1), sqrtf(6.0f / D1));
  fill_uniform(w4, nw4, -sqrtf(6.0f / H), sqrtf(6.0f / H));
  memset(b1, 0, 32 * sizeof(float)), memset(b2, 0, 64 * sizeof(float));
  memset(b3, 0, H * sizeof(float)), memset(b4, 0, K * sizeof(float));

  const size_t n_a1 = (size_t)B * 32 * 28 * 28, n_p1 = (size_t)B * 32 * 14 * 14;
  const size_t n_a2 = (size_t)B * 64 * 14 * 14, n_p2 = (size_t)B * D1;
  float *x = alloc_uniform((size_t)B * 28 * 28, 0, 1); /* (B, 1, 28, 28) */
  uint8_t labels[B];
  for (int i = 0; i < B; i++) labels[i] = (uint8_t)(i % K);
  float *a1 = malloc(n_a1 * sizeof(float));      /* (B, 32, 28, 28) conv1, then relu */
  float *p1o = malloc(n_p1 * sizeof(float));     /* (B, 32, 14, 14) */
  int32_t *arg1 = malloc(n_p1 * sizeof(int32_t));
  float *a2 = malloc(n_a2 * sizeof(float));      /* (B, 64, 14, 14) */
  float *p2o = malloc(n_p2 * sizeof(float));     /* (B, 3136) */
  int32_t *arg2 = malloc(n_p2 * sizeof(int32_t));
  float *h1 = malloc((size_t)B * H * sizeof(float)); /* (B, 128) */
  float *logits = malloc((size_t)B * K * sizeof(float)); /* (B, 10) */
  float *probs = malloc((size_t)B * K * sizeof(float));
  /* Gradients of activations, in two buffers used in turn. */
  float *g_a = malloc(n_a1 * sizeof(float)), *g_b = malloc(n_a1 * sizeof(float));
  size_t ws1 = ops->conv2d_workspace(ops->ctx, &c1), ws2 = ops->conv2d_workspace(ops->ctx, &c2);
  float *work = malloc((ws1 > ws2 ? ws1 : ws2) * sizeof(float));

  /* Steps until 2 s have passed (at least 3, at most MAX_STEPS) after 2
   * warm-up steps. */
  enum { MAX_STEPS = 50 };
  double step_s[MAX_STEPS], fwdbwd_s[MAX_STEPS];
  memset(timers, 0, sizeof timers);
  int iters = 0, warmup = 2;
  double start = 0;
  for (int it = 0;; it++) {
    if (it == warmup) {
      memset(timers, 0, sizeof timers);
      start = now_s();
    }
    if (it >= warmup) {
      iters = it - warmup;
      if (iters >= MAX_STEPS || (iters >= 3 && now_s() - start > 2.0)) break;
    }
    double t_step = now_s(), adam_before = timers[T_ADAM];
    TIMED(T_CONV1_FWD, ops->conv2d_forward(ops->ctx, &c1, x, w1, b1, a1, work));
    TIMED(T_RELU_FWD, ops->relu_forward(ops->ctx, n_a1, a1, a1));
    TIMED(T_POOL_FWD, ops->maxpool_forward(ops->ctx, &p1, a1, p1o, arg1));
    TIMED(T_CONV2_FWD, ops->conv2d_forward(ops->ctx, &c2, p1o, w2, b2, a2, work));
    TIMED(T_RELU_FWD, ops->relu_forward(ops->ctx, n_a2, a2, a2));
    TIMED(T_POOL_FWD, ops->maxpool_forward(ops->ctx, &p2, a2, p2o, arg2));
    TIMED(T_DENSE_FWD, ops->dense_forward(ops->ctx, B, D1, H, p2o, w3, b3, h1));
    TIMED(T_RELU_FWD, ops->relu_forward(ops->ctx, (size_t)B * H, h1, h1));
    TIMED(T_DENSE_FWD, ops->dense_forward(ops->ctx, B, H, K, h1, w4, b4, logits));
    TIMED(T_SOFTMAX, ops->softmax_xent_forward(ops->ctx, B, K, logits, labels, probs));

    TIMED(T_SOFTMAX, ops->softmax_xent_backward(ops->ctx, B, K, probs, labels, g_a));
    TIMED(T_DENSE_BWD, ops->dense_backward(ops->ctx, B, H, K, h1, w4, g_a, g_b, gw4, gb4));
    TIMED(T_RELU_BWD, ops->relu_backward(ops->ctx, (size_t)B * H, h1, g_b, g_b));
    TIMED(T_DENSE_BWD, ops->dense_backward(ops->ctx, B, D1, H, p2o, w3, g_b, g_a, gw3, gb3));
    TIMED(T_POOL_BWD, ops->maxpool_backward(ops->ctx, &p2, g_a, arg2, g_b));
    TIMED(T_RELU_BWD, ops->relu_backward(ops->ctx, n_a2, a2, g_b, g_b));
    TIMED(T_CONV2_BWD, ops->conv2d_backward(ops->ctx, &c2, p1o, w2, g_b, g_a, gw2, gb2, work));
    TIMED(T_POOL_BWD, ops->maxpool_backward(ops->ctx, &p1, g_a, arg1, g_b));
    TIMED(T_RELU_BWD, ops->relu_backward(ops->ctx, n_a1, a1, g_b, g_b));
    TIMED(T_CONV1_BWD, ops->conv2d_backward(ops->ctx, &c1, x, w1, g_b, NULL, gw1, gb1, work));
    TIMED(T_ADAM, adam_step(np, params, grads, adam_m, adam_v, it + 1));
    double took = now_s() - t_step;
    timers[T_TOTAL] += took;
    if (it >= warmup) {
      step_s[iters] = took;
      fwdbwd_s[iters] = took - (timers[T_ADAM] - adam_before);
    }
  }

  int finite = 1;
  for (size_t i = 0; i < np; i++) finite &= isfinite(grads[i]) != 0;
  CHECK_MSG(finite, "gradients of the timed CNN are finite");

  /* Medians, and the best step: on a shared machine the mean mostly
   * measures the neighbours. */
  qsort(step_s, iters, sizeof(double), cmp_double);
  qsort(fwdbwd_s, iters, sizeof(double), cmp_double);
  printf("quickstart CNN, batch %d, %d steps, OPENBLAS_NUM_THREADS=%s; mean per op:\n", B,
         iters, getenv("OPENBLAS_NUM_THREADS") ? getenv("OPENBLAS_NUM_THREADS") : "(unset)");
  for (int t = 0; t < T_TOTAL; t++)
    printf("  %-10s %7.2f ms\n", timer_names[t], 1e3 * timers[t] / iters);
  printf("  fwd+bwd:      median %6.2f ms/step = %5.0f examples/s (best %5.0f)\n",
         1e3 * fwdbwd_s[iters / 2], B / fwdbwd_s[iters / 2], B / fwdbwd_s[0]);
  printf("  fwd+bwd+adam: median %6.2f ms/step = %5.0f examples/s (best %5.0f)\n",
         1e3 * step_s[iters / 2], B / step_s[iters / 2], B / step_s[0]);

  free(params), free(grads), free(adam_m), free(adam_v), free(x), free(a1), free(p1o);
  free(arg1), free(a2), free(p2o), free(arg2), free(h1), free(logits), free(probs), free(g_a);
  free(g_b), free(work);
}

/* The correctness tests, on one backend. */
static void run_tests(int threads) {
  ops = ps_ops_cpu_create(threads);
  CHECK_MSG(ops != NULL, "ps_ops_cpu_create(%d)", threads);
  if (!ops) return;
  fprintf(stderr, "-- cpu backend, threads = %d\n", threads);
  CHECK(strcmp(ops->name, "cpu") == 0);
  RUN(test_shape_finish);
  RUN(test_conv_small);
  RUN(test_conv_chunked);
  RUN(test_conv_workspace_monotone);
  RUN(test_maxpool);
  RUN(test_maxpool_ties);
  RUN(test_maxpool_pairs);
  RUN(test_avgpool);
  RUN(test_global_avgpool);
  RUN(test_avgpool_order);
  RUN(test_dense);
  RUN(test_relu);
  RUN(test_relu_large);
  RUN(test_add);
  RUN(test_backward_in_place);
  RUN(test_dropout);
  RUN(test_softmax_xent);
  ops->destroy(ops);
}

static void run_timing(int threads) {
  ops = ps_ops_cpu_create(threads);
  CHECK_MSG(ops != NULL, "ps_ops_cpu_create(%d)", threads);
  if (!ops) return;
  printf("cpu backend, threads = %d:\n", threads);
  RUN(test_timing_quickstart_cnn);
  ops->destroy(ops);
}

/* Backends: threads = 0 (one thread, OpenBLAS's own threading), then 3 (own
 * threads; 3 splits the odd shapes unevenly and leaves some parts empty
 * where n = 1), then the timing with as many as PS_TEST_THREADS says
 * (default 2, the target machine's cores). Everything with threads = 0 goes
 * first: a threads > 0 backend sets OpenBLAS to one thread for the rest of
 * the process. */
int main(void) {
  run_tests(0);
  run_timing(0);
  run_tests(3);
  const char *env = getenv("PS_TEST_THREADS");
  run_timing(env ? atoi(env) : 2);
  return check_summary();
}

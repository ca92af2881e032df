/* Finite-difference gradient checks: every layer's backward against its
 * own forward, on a CPU backend (one thread, and two): the reference
 * (kernels/cpu) with no argument, the oneDNN backend (kernels/dnnl) with
 * the argument "dnnl", which exits 77 (skipped) in a build without it.
 *
 * The loss is L = sum(y * r) for a fixed random r, summed in double, so
 * dL/dy = r, which is fed to the backward as dy (r is drawn as floats, so
 * dy is exactly r). Each input, weight and bias in turn is moved by +-eps
 * and (L+ - L-) / (x+ - x-) is compared with the analytic gradient, using
 * the perturbation as actually stored in float.
 *
 * Tolerance: |numeric - analytic| <= THR * max(|numeric|, |analytic|, 1)
 * with THR = 1e-3. Conv, dense, dropout and average pooling are linear in
 * each input, weight and bias, and pooling and relu are too away from their kinks (the
 * inputs are drawn to keep every kink more than eps away), so central
 * differences are exact but for the float32 rounding of the outputs that
 * the moved value touches: about 2^-24 * |y| * sqrt(outputs touched) /
 * (2 eps). Linear layers use eps = 0.1 (1e-5 at most, measured), relu and
 * pooling 0.01 (their outputs move one at a time). For softmax-cross-entropy,
 * eps = 0.01 gives a truncation error eps^2 * |L'''| / 6 and a rounding
 * error of the float loss 2^-24 * L / (2 eps), both ~1e-5 (measured). THR
 * is 50x or more above all of them, while a wrong index or a missing term
 * is an error of order 0.1 to 1. Batchnorm is not linear in x (every x of
 * a channel moves its mean and variance, so all the channel's outputs):
 * eps = 0.01 keeps the truncation error (eps^2 times a third derivative of
 * order 1 for inputs of spread ~0.6) and the rounding of the channel's
 * outputs (2^-24 * sqrt(m) / (2 eps)) both near 1e-5. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/ops.h"
#include "check.h"
#ifdef PS_HAVE_DNNL
#include "../../kernels/dnnl/ops_dnnl.h"
#endif

#define THR 1e-3
#define EPS_LINEAR 0.1f /* conv, dense, dropout, average pooling */
#define EPS_KINK 0.01f  /* relu, maxpool, softmax */
#define EPS_BN 0.01f    /* batchnorm's x (gamma and beta are linear: EPS_LINEAR) */

static ps_ops *ops;

/* ---- helpers ---- */

static uint64_t rand_state = 0x2545F4914F6CDD1DULL;

static double rand_unit(void) { /* [0, 1) */
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (double)(rand_state >> 11) * (1.0 / 9007199254740992.0);
}

static float *alloc_uniform(size_t n, float lo, float hi) {
  float *a = malloc((n ? n : 1) * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = lo + (hi - lo) * (float)rand_unit();
  return a;
}

/* Values at least 0.1 from 0 with random signs: relu's kink stays more
 * than EPS_KINK away. */
static float *alloc_off_zero(size_t n) {
  float *a = alloc_uniform(n, 0.1f, 1.0f);
  for (size_t i = 0; i < n; i++)
    if (rand_unit() < 0.5) a[i] = -a[i];
  return a;
}

/* Distinct values 0.05 apart, shuffled: no window of a max pool has two
 * inputs within 2*EPS_KINK of each other, so the argmax never flips. */
static float *alloc_distinct(size_t n) {
  float *a = malloc((n ? n : 1) * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = 0.05f * (float)i - 0.025f * (float)n;
  for (size_t i = n; i > 1; i--) {
    size_t k = (size_t)(rand_unit() * (double)i);
    float t = a[i - 1];
    a[i - 1] = a[k];
    a[k] = t;
  }
  return a;
}

static double dot(const float *y, const float *r, size_t n) {
  double sum = 0.0;
  for (size_t i = 0; i < n; i++) sum += (double)y[i] * r[i];
  return sum;
}

/* A layer under test: its forward at the current inputs, reduced to L. */
typedef double (*loss_fn)(void *layer);

/* Compares analytic[i] with the central difference of loss over param[i]
 * +- eps, for every i < n; one CHECK naming the worst element. */
static void gradcheck(const char *what, float *param, size_t n, const float *analytic,
                      loss_fn loss, void *layer, float eps) {
  size_t bad = 0, worst = 0;
  double worst_err = -1, worst_num = 0;
  for (size_t i = 0; i < n; i++) {
    const float saved = param[i];
    const float up = saved + eps, down = saved - eps;
    param[i] = up;
    double l_up = loss(layer);
    param[i] = down;
    double l_down = loss(layer);
    param[i] = saved;
    double num = (l_up - l_down) / ((double)up - (double)down);
    double a = analytic[i];
    double scale = fmax(fmax(fabs(num), fabs(a)), 1.0);
    double err = fabs(num - a) / scale;
    if (!(err <= THR)) bad++;
    if (!(err <= worst_err)) {
      worst_err = err, worst = i, worst_num = num;
    }
  }
  CHECK_MSG(bad == 0, "%s: %zu of %zu gradients off; worst [%zu]: numeric %.7g, analytic %.7g",
            what, bad, n, worst, worst_num, n ? (double)analytic[worst] : 0.0);
}

/* ---- conv2d ---- */

typedef struct {
  ps_conv_shape s;
  float *x, *w, *b, *y, *r, *work;
} conv_layer;

static double conv_loss(void *p) {
  conv_layer *l = p;
  ops->conv2d_forward(ops->ctx, &l->s, l->x, l->w, l->b, l->y, l->work);
  return dot(l->y, l->r, (size_t)l->s.n * l->s.oc * l->s.oh * l->s.ow);
}

static void check_conv(int n, int c, int h, int w, int oc, int kh, int kw, int stride, int pad) {
  conv_layer l = {.s = {.n = n, .c = c, .h = h, .w = w, .oc = oc, .kh = kh, .kw = kw,
                        .stride = stride, .pad = pad}};
  ps_conv_shape_finish(&l.s);
  const size_t xn = (size_t)n * c * h * w, wn = (size_t)oc * c * kh * kw;
  const size_t yn = (size_t)n * oc * l.s.oh * l.s.ow;
  l.x = alloc_uniform(xn, -1, 1), l.w = alloc_uniform(wn, -1, 1);
  l.b = alloc_uniform(oc, -1, 1), l.r = alloc_uniform(yn, -1, 1);
  l.y = malloc(yn * sizeof(float));
  size_t ws = ops->conv2d_workspace(ops->ctx, &l.s);
  l.work = malloc((ws ? ws : 1) * sizeof(float));
  float *dx = malloc(xn * sizeof(float)), *dw = malloc(wn * sizeof(float));
  float *db = malloc(oc * sizeof(float));
  ops->conv2d_backward(ops->ctx, &l.s, l.x, l.w, l.r, dx, dw, db, l.work);

  char what[120];
  int len = snprintf(what, sizeof what, "conv n=%d c=%d %dx%d oc=%d k=%dx%d s=%d p=%d", n, c, h,
                     w, oc, kh, kw, stride, pad);
  snprintf(what + len, sizeof what - len, ": dx");
  gradcheck(what, l.x, xn, dx, conv_loss, &l, EPS_LINEAR);
  snprintf(what + len, sizeof what - len, ": dw");
  gradcheck(what, l.w, wn, dw, conv_loss, &l, EPS_LINEAR);
  snprintf(what + len, sizeof what - len, ": db");
  gradcheck(what, l.b, oc, db, conv_loss, &l, EPS_LINEAR);

  free(l.x), free(l.w), free(l.b), free(l.r), free(l.y), free(l.work);
  free(dx), free(dw), free(db);
}

static void test_conv(void) {
  check_conv(2, 3, 5, 6, 4, 3, 3, 1, 0); /* stride 1, pad 0 */
  check_conv(3, 1, 5, 5, 2, 3, 3, 1, 1); /* stride 1, pad 1 */
  check_conv(1, 3, 6, 7, 2, 2, 3, 2, 0); /* stride 2, pad 0, non-square kernel */
  check_conv(2, 2, 7, 5, 3, 3, 3, 2, 1); /* stride 2, pad 1 */
}

/* ---- maxpool ---- */

typedef struct {
  ps_pool_shape s;
  float *x, *y, *r;
  int32_t *argmax;
} pool_layer;

static double pool_loss(void *p) {
  pool_layer *l = p;
  ops->maxpool_forward(ops->ctx, &l->s, l->x, l->y, l->argmax);
  return dot(l->y, l->r, (size_t)l->s.n * l->s.c * l->s.oh * l->s.ow);
}

static void check_maxpool(int n, int c, int h, int w, int size, int stride) {
  pool_layer l = {.s = {.n = n, .c = c, .h = h, .w = w, .size = size, .stride = stride}};
  ps_pool_shape_finish(&l.s);
  const size_t xn = (size_t)n * c * h * w, yn = (size_t)n * c * l.s.oh * l.s.ow;
  l.x = alloc_distinct(xn), l.r = alloc_uniform(yn, -1, 1);
  l.y = malloc(yn * sizeof(float));
  l.argmax = malloc(yn * sizeof(int32_t));
  float *dx = malloc(xn * sizeof(float));
  pool_loss(&l); /* argmax at the unperturbed input */
  ops->maxpool_backward(ops->ctx, &l.s, l.r, l.argmax, dx);

  char what[100];
  snprintf(what, sizeof what, "maxpool n=%d c=%d %dx%d size=%d stride=%d: dx", n, c, h, w, size,
           stride);
  gradcheck(what, l.x, xn, dx, pool_loss, &l, EPS_KINK);
  free(l.x), free(l.r), free(l.y), free(l.argmax), free(dx);
}

static void test_maxpool(void) {
  check_maxpool(2, 3, 6, 5, 2, 2); /* odd width: a column no window reads */
  check_maxpool(1, 2, 7, 7, 3, 2); /* overlapping windows */
}

/* ---- average pooling ----
 *
 * Linear in x: EPS_LINEAR, any inputs. */

static double avgpool_loss(void *p) {
  pool_layer *l = p;
  ops->avgpool_forward(ops->ctx, &l->s, l->x, l->y);
  return dot(l->y, l->r, (size_t)l->s.n * l->s.c * l->s.oh * l->s.ow);
}

static void check_avgpool(int n, int c, int h, int w, int size, int stride) {
  pool_layer l = {.s = {.n = n, .c = c, .h = h, .w = w, .size = size, .stride = stride}};
  ps_pool_shape_finish(&l.s);
  const size_t xn = (size_t)n * c * h * w, yn = (size_t)n * c * l.s.oh * l.s.ow;
  l.x = alloc_uniform(xn, -1, 1), l.r = alloc_uniform(yn, -1, 1);
  l.y = malloc(yn * sizeof(float));
  float *dx = malloc(xn * sizeof(float));
  ops->avgpool_backward(ops->ctx, &l.s, l.r, dx);

  char what[100];
  snprintf(what, sizeof what, "avgpool n=%d c=%d %dx%d size=%d stride=%d: dx", n, c, h, w, size,
           stride);
  gradcheck(what, l.x, xn, dx, avgpool_loss, &l, EPS_LINEAR);
  free(l.x), free(l.r), free(l.y), free(dx);
}

static double global_avgpool_loss(void *p) {
  pool_layer *l = p;
  ops->global_avgpool_forward(ops->ctx, l->s.n, l->s.c, l->s.h, l->s.w, l->x, l->y);
  return dot(l->y, l->r, (size_t)l->s.n * l->s.c);
}

static void check_global_avgpool(int n, int c, int h, int w) {
  pool_layer l = {.s = {.n = n, .c = c, .h = h, .w = w}};
  const size_t xn = (size_t)n * c * h * w, yn = (size_t)n * c;
  l.x = alloc_uniform(xn, -1, 1), l.r = alloc_uniform(yn, -1, 1);
  l.y = malloc(yn * sizeof(float));
  float *dx = malloc(xn * sizeof(float));
  ops->global_avgpool_backward(ops->ctx, n, c, h, w, l.r, dx);

  char what[100];
  snprintf(what, sizeof what, "global_avgpool n=%d c=%d %dx%d: dx", n, c, h, w);
  gradcheck(what, l.x, xn, dx, global_avgpool_loss, &l, EPS_LINEAR);
  free(l.x), free(l.r), free(l.y), free(dx);
}

static void test_avgpool(void) {
  check_avgpool(2, 3, 6, 5, 2, 2); /* odd width: a column no window reads */
  check_avgpool(1, 2, 7, 7, 3, 2); /* overlapping windows */
  check_avgpool(2, 2, 5, 4, 2, 1); /* stride 1 */
  check_global_avgpool(2, 3, 5, 4);
  check_global_avgpool(3, 2, 1, 1);
}

/* ---- batch normalization ---- */

typedef struct {
  int n, c, hw;
  float eps;
  float *x, *gamma, *beta, *y, *r, *mean, *var, *invstd;
} bn_layer;

static double bn_loss(void *p) {
  bn_layer *l = p;
  ops->batchnorm_forward_train(ops->ctx, l->n, l->c, l->hw, l->eps, l->x, l->gamma, l->beta, l->y,
                               l->mean, l->var, l->invstd);
  return dot(l->y, l->r, (size_t)l->n * l->c * l->hw);
}

static void check_batchnorm(int n, int c, int hw, float eps) {
  bn_layer l = {.n = n, .c = c, .hw = hw, .eps = eps};
  const size_t xn = (size_t)n * c * hw;
  l.x = alloc_uniform(xn, -1, 1), l.r = alloc_uniform(xn, -1, 1);
  l.gamma = alloc_uniform(c, 0.5f, 1.5f), l.beta = alloc_uniform(c, -1, 1);
  l.y = malloc(xn * sizeof(float));
  l.mean = malloc(c * sizeof(float)), l.var = malloc(c * sizeof(float));
  l.invstd = malloc(c * sizeof(float));
  float *dx = malloc(xn * sizeof(float)), *dg = malloc(c * sizeof(float));
  float *db = malloc(c * sizeof(float)), *y2 = malloc(xn * sizeof(float));
  bn_loss(&l);
  ops->batchnorm_backward(ops->ctx, n, c, hw, l.x, l.r, l.gamma, l.mean, l.invstd, dx, dg, db);

  char what[100];
  int len = snprintf(what, sizeof what, "batchnorm n=%d c=%d hw=%d", n, c, hw);
  /* The statistics are the batch's: mean and biased variance. */
  double worst = 0;
  for (int k = 0; k < c; k++) {
    double s = 0, q = 0;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < hw; j++) s += l.x[((size_t)i * c + k) * hw + j];
    const double mu = s / ((double)n * hw);
    for (int i = 0; i < n; i++)
      for (int j = 0; j < hw; j++) {
        const double d = l.x[((size_t)i * c + k) * hw + j] - mu;
        q += d * d;
      }
    const double v = q / ((double)n * hw);
    worst = fmax(worst, fabs(l.mean[k] - mu) + fabs(l.var[k] - v) +
                            fabs(l.invstd[k] - 1.0 / sqrt(v + eps)) / (1.0 / sqrt(v + eps)));
  }
  CHECK_MSG(worst < 1e-6, "%s: batch mean, variance and invstd off by %g", what, worst);
  /* Inference from the batch's own statistics gives the training output. */
  ops->batchnorm_forward_infer(ops->ctx, n, c, hw, eps, l.x, l.gamma, l.beta, l.mean, l.var, y2);
  double dmax = 0;
  for (size_t i = 0; i < xn; i++) dmax = fmax(dmax, fabs((double)y2[i] - l.y[i]));
  CHECK_MSG(dmax < 1e-5, "%s: inference with the batch's statistics differs by %g", what, dmax);
  snprintf(what + len, sizeof what - len, ": dx");
  gradcheck(what, l.x, xn, dx, bn_loss, &l, EPS_BN);
  snprintf(what + len, sizeof what - len, ": dgamma");
  gradcheck(what, l.gamma, c, dg, bn_loss, &l, EPS_LINEAR);
  snprintf(what + len, sizeof what - len, ": dbeta");
  gradcheck(what, l.beta, c, db, bn_loss, &l, EPS_LINEAR);
  /* dx NULL: the parameters' gradients alone, the same. */
  float *dg2 = malloc(c * sizeof(float)), *db2 = malloc(c * sizeof(float));
  ops->batchnorm_backward(ops->ctx, n, c, hw, l.x, l.r, l.gamma, l.mean, l.invstd, NULL, dg2,
                          db2);
  CHECK_MSG(memcmp(dg, dg2, c * sizeof(float)) == 0 && memcmp(db, db2, c * sizeof(float)) == 0,
            "batchnorm n=%d c=%d hw=%d: dgamma/dbeta differ when dx is NULL", n, c, hw);
  free(l.x), free(l.r), free(l.gamma), free(l.beta), free(l.y), free(l.mean), free(l.var);
  free(l.invstd), free(dx), free(dg), free(db), free(y2), free(dg2), free(db2);
}

static void test_batchnorm(void) {
  check_batchnorm(4, 3, 10, 1e-3f);  /* after a convolution */
  check_batchnorm(16, 5, 1, 1e-3f);  /* after dense: hw = 1 */
  check_batchnorm(2, 16, 9, 1e-5f);  /* 16 channels, the smallest epsilon */
  check_batchnorm(1, 2, 12, 0.1f);   /* one example: the plane alone */
}

/* ---- dense ---- */

typedef struct {
  int n, in, out;
  float *x, *w, *b, *y, *r;
} dense_layer;

static double dense_loss(void *p) {
  dense_layer *l = p;
  ops->dense_forward(ops->ctx, l->n, l->in, l->out, l->x, l->w, l->b, l->y);
  return dot(l->y, l->r, (size_t)l->n * l->out);
}

static void check_dense(int n, int in, int out) {
  dense_layer l = {.n = n, .in = in, .out = out};
  l.x = alloc_uniform((size_t)n * in, -1, 1), l.w = alloc_uniform((size_t)out * in, -1, 1);
  l.b = alloc_uniform(out, -1, 1), l.r = alloc_uniform((size_t)n * out, -1, 1);
  l.y = malloc((size_t)n * out * sizeof(float));
  float *dx = malloc((size_t)n * in * sizeof(float));
  float *dw = malloc((size_t)out * in * sizeof(float)), *db = malloc(out * sizeof(float));
  ops->dense_backward(ops->ctx, n, in, out, l.x, l.w, l.r, dx, dw, db);

  char what[80];
  int len = snprintf(what, sizeof what, "dense n=%d in=%d out=%d", n, in, out);
  snprintf(what + len, sizeof what - len, ": dx");
  gradcheck(what, l.x, (size_t)n * in, dx, dense_loss, &l, EPS_LINEAR);
  snprintf(what + len, sizeof what - len, ": dw");
  gradcheck(what, l.w, (size_t)out * in, dw, dense_loss, &l, EPS_LINEAR);
  snprintf(what + len, sizeof what - len, ": db");
  gradcheck(what, l.b, out, db, dense_loss, &l, EPS_LINEAR);
  free(l.x), free(l.w), free(l.b), free(l.r), free(l.y), free(dx), free(dw), free(db);
}

static void test_dense(void) {
  check_dense(3, 7, 5);
  check_dense(1, 4, 1);
}

/* ---- relu and dropout ---- */

typedef struct {
  size_t n;
  float *x, *y, *r, *mask;
  float rate;
} map_layer;

static double relu_loss(void *p) {
  map_layer *l = p;
  ops->relu_forward(ops->ctx, l->n, l->x, l->y);
  return dot(l->y, l->r, l->n);
}

/* The same (seed, stream) every time: the mask is fixed, as in a replayed
 * step. */
static double dropout_loss(void *p) {
  map_layer *l = p;
  ops->dropout_forward(ops->ctx, l->n, l->rate, 1234, 5, l->x, l->y, l->mask);
  return dot(l->y, l->r, l->n);
}

static void test_relu(void) {
  map_layer l = {.n = 67};
  l.x = alloc_off_zero(l.n), l.r = alloc_uniform(l.n, -1, 1);
  l.y = malloc(l.n * sizeof(float));
  float *dx = malloc(l.n * sizeof(float));
  relu_loss(&l);
  ops->relu_backward(ops->ctx, l.n, l.y, l.r, dx);
  gradcheck("relu: dx", l.x, l.n, dx, relu_loss, &l, EPS_KINK);
  free(l.x), free(l.r), free(l.y), free(dx);
}

static void test_dropout(void) {
  map_layer l = {.n = 67, .rate = 0.4f};
  l.x = alloc_uniform(l.n, -1, 1), l.r = alloc_uniform(l.n, -1, 1);
  l.y = malloc(l.n * sizeof(float)), l.mask = malloc(l.n * sizeof(float));
  float *dx = malloc(l.n * sizeof(float));
  dropout_loss(&l);
  ops->dropout_backward(ops->ctx, l.n, l.mask, l.r, dx);
  gradcheck("dropout: dx", l.x, l.n, dx, dropout_loss, &l, EPS_LINEAR);
  free(l.x), free(l.r), free(l.y), free(l.mask), free(dx);
}

/* ---- softmax + cross-entropy ---- */

typedef struct {
  int n, k;
  float *logits, *probs;
  const uint8_t *labels;
} xent_layer;

/* L is the layer's own loss here (the mean cross-entropy), not sum(y*r). */
static double xent_loss(void *p) {
  xent_layer *l = p;
  return ops->softmax_xent_forward(ops->ctx, l->n, l->k, l->logits, l->labels, l->probs);
}

static void test_softmax_xent(void) {
  const uint8_t labels[4] = {2, 0, 4, 2};
  xent_layer l = {.n = 4, .k = 5, .labels = labels};
  l.logits = alloc_uniform(20, -2, 2), l.probs = malloc(20 * sizeof(float));
  float *dl = malloc(20 * sizeof(float));
  xent_loss(&l);
  ops->softmax_xent_backward(ops->ctx, l.n, l.k, l.probs, labels, dl);
  gradcheck("softmax_xent: dlogits", l.logits, 20, dl, xent_loss, &l, EPS_KINK);
  free(l.logits), free(l.probs), free(dl);
}

typedef ps_ops *(*backend_create)(int threads);

static void run_all(const char *name, backend_create create, int threads) {
  ops = create(threads);
  CHECK_MSG(ops != NULL, "%s backend with %d threads", name, threads);
  if (!ops) return;
  fprintf(stderr, "-- %s backend, threads = %d\n", name, threads);
  RUN(test_conv);
  RUN(test_maxpool);
  RUN(test_avgpool);
  RUN(test_dense);
  RUN(test_batchnorm);
  RUN(test_relu);
  RUN(test_dropout);
  RUN(test_softmax_xent);
  ops->destroy(ops);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "dnnl") == 0) {
#ifdef PS_HAVE_DNNL
    run_all("oneDNN", ps_ops_dnnl_create, 1);
    run_all("oneDNN", ps_ops_dnnl_create, 2);
    return check_summary();
#else
    printf("SKIPPED: built without oneDNN\n");
    return 77;
#endif
  }
  if (argc > 1) {
    fprintf(stderr, "usage: test_gradcheck [dnnl]\n");
    return 2;
  }
  run_all("cpu", ps_ops_cpu_create, 0);
  run_all("cpu", ps_ops_cpu_create, 2);
  return check_summary();
}

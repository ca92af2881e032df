/* worker/model/model.h on the CPU backend, its device path on a emulated device,
 * and the device chooser (worker/model/device.h).
 *
 *  - Gradient: ps_model_train_step's gradient of every parameter of three
 *    small models (one starting with a convolution, one with flatten, one
 *    with average and global average pooling) is
 *    compared with central differences of the loss (ps_model_evaluate),
 *    dropout off, eps = 1e-3. The loss is a float32 of about 2.3, rounded
 *    to 2^-24 of that in each evaluation and moved by the rounding of the
 *    activations the parameter touches: about 1.5e-4 in the quotient at
 *    worst. A larger eps does not help: a conv weight moves every output
 *    of its filter, and with eps = 1e-2 a few relu and pooling decisions
 *    flip (measured: 2.5e-2 relative error on the conv weights, against
 *    8e-4 at 1e-3; the dense layers 2e-4 either way). So per parameter
 *    |numeric - analytic| <= 3e-4 + 1e-2 * |analytic|; a parameter past it
 *    is measured again at eps/3 and eps/9 (a kink within +-eps is then
 *    usually outside the interval; measured on the residual model: 16 of
 *    468 past the bound at 1e-3, each within it at 3.3e-4 or 1.1e-4), with
 *    up to 2% of the parameters allowed past it still, and the relative L2
 *    error over the whole vector <= 3e-3. A wrong buffer, layer input,
 *    ping-pong order or gradient sum gives errors of the order of the
 *    gradient itself, at every eps.
 *    The residual and branching models check gradients summed over
 *    several consumers (an output read by two layers, through flatten too)
 *    and add with the batch as an input.
 *    The batchnorm model's loss is the training step's (batch statistics),
 *    its moving statistics left out (they carry the batch's statistics,
 *    checked on their own: test_batchnorm_statistics).
 *  - Evaluate: the mean loss and correct count of train_step without
 *    dropout, bit for bit, in one chunk and in several (max_batch < n);
 *    dropout is off in evaluation.
 *  - Dropout: a step replays bit for bit from (seed, step); another step
 *    draws other masks.
 *  - Learning: 30 SGD steps on learnable data bring the loss below half; a
 *    CNN with average and global average pooling learns the synthetic set
 *    to well above chance.
 *  - The device path (the code for backends whose memory is not host
 *    memory) runs here on the emulated device (kernels/emu): the CPU ops
 *    behind a table with host_memory = 0 that aborts unless every pointer
 *    given to an op lies, with its whole extent, inside a block from its
 *    alloc (so a host pointer or a short buffer is caught), and unless
 *    copies host->device and back go the right way; copies to the host
 *    land late, as on a stream. Its steps must equal the CPU backend's bit
 *    for bit (the same kernels on the same values), and every block must
 *    be freed.
 *  - Out of memory: the emulated device's alloc fails at every call in turn; the
 *    model must report it and free what it had.
 *  - The device chooser: "cpu", "auto" (the cpu without a device), "cuda"
 *    (an error without one: the build or the device), malformed names.
 *  - With a CUDA device only: train_step and evaluate on cuda against the
 *    cpu (tolerances of tests/unit/test_cuda_parity.c's trajectory: loss
 *    1e-5 relative, gradient 5e-2 relative L2 per tensor); otherwise that
 *    part prints a SKIPPED line. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/model_spec.h"
#include "../../common/util.h"
#include "../../kernels/ops.h"
#include "worker/data/data.h"
#include "worker/model/device.h"
#include "worker/model/model.h"
#include "check.h"
#ifdef PS_WITH_CUDA
#include "../../kernels/cuda/cuda_device.h"
#endif

/* ---- helpers ---- */

/* A local xorshift, independent of the code under test. */
static uint64_t rand_state = 0x9e3779b97f4a7c15ULL;

static float rand_unit(void) { /* [0, 1) */
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return (float)((double)(rand_state >> 11) * (1.0 / 9007199254740992.0));
}

static void *xalloc(size_t bytes) {
  void *p = calloc(1, bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "test_model: out of memory\n");
    abort();
  }
  return p;
}

/* conv -> relu -> maxpool -> flatten -> dense -> relu -> dropout -> dense. */
static int conv_spec(float rate, ps_model_spec *spec) {
  char json[1024], err[PS_ERRLEN];
  snprintf(json, sizeof json,
           "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
           "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\"},"
           "{\"type\": \"relu\"}, {\"type\": \"maxpool\", \"size\": 2},"
           "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 8}, {\"type\": \"relu\"},"
           "{\"type\": \"dropout\", \"rate\": %g},"
           "{\"type\": \"dense\", \"units\": 3}, {\"type\": \"softmax_xent\"}]}",
           (double)rate);
  int rc = ps_model_spec_parse(json, spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  return rc;
}

/* conv -> avgpool -> conv -> global_avgpool -> flatten -> dense: both
 * average poolings, the second feeding a dense layer. No relu: the
 * poolings divide the gradients behind them by 4 and 9, and a relu kink
 * that eps moves across (see the header) then errs by as much as the
 * gradient itself; without one the model is linear up to the softmax. */
static int avg_spec(ps_model_spec *spec) {
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"avgpool\", \"size\": 2},"
      "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"global_avgpool\"}, {\"type\": \"flatten\"},"
      "{\"type\": \"dense\", \"units\": 3}, {\"type\": \"softmax_xent\"}]}",
      spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  return rc;
}

/* flatten first: the first layer with an output is a dense one. */
static int dense_spec(ps_model_spec *spec) {
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [1, 3, 4], \"classes\": 4, \"layers\": ["
      "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 6}, {\"type\": \"relu\"},"
      "{\"type\": \"dropout\", \"rate\": 0}, {\"type\": \"dense\", \"units\": 4},"
      "{\"type\": \"softmax_xent\"}]}",
      spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  return rc;
}

/* A residual block: conv -> relu -> conv(same) -> add(with the first
 * conv's output) -> relu -> flatten -> dense. The first conv's output has
 * two consumers (its gradient is summed), the add's shortcut input is not
 * the layer before it. */
static int res_spec(ps_model_spec *spec) {
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\", "
      "\"name\": \"stem\"},"
      "{\"type\": \"relu\"},"
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"add\", \"inputs\": [\"conv2d_1\", \"stem\"]},"
      "{\"type\": \"relu\"}, {\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 3},"
      "{\"type\": \"softmax_xent\"}]}",
      spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  return rc;
}

/* Branches everywhere: a conv reading the batch beside the layer before
 * it, an add of three with the batch itself, a flatten read by two dense
 * layers (two consumers through flatten, which has no buffer) and an add
 * of their outputs, one of which is not the layer before it. */
static int branch_spec(ps_model_spec *spec) {
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 2, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"relu\", \"name\": \"r0\"},"
      "{\"type\": \"conv2d\", \"filters\": 2, \"kernel\": 3, \"padding\": \"same\", "
      "\"inputs\": [\"input\"]},"
      "{\"type\": \"add\", \"inputs\": [\"r0\", \"conv2d_1\", \"input\"]},"
      "{\"type\": \"avgpool\", \"size\": 2}, {\"type\": \"flatten\"},"
      "{\"type\": \"dense\", \"units\": 3, \"name\": \"d0\"},"
      "{\"type\": \"dense\", \"units\": 3, \"inputs\": [\"flatten_0\"]},"
      "{\"type\": \"add\", \"inputs\": [\"d0\", \"dense_1\"]},"
      "{\"type\": \"softmax_xent\"}]}",
      spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  return rc;
}

/* Batch normalization after bias-less convolutions, inside a residual
 * block, and after a dense layer. */
static int bn_spec(ps_model_spec *spec) {
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\", "
      "\"bias\": false},"
      "{\"type\": \"batchnorm\"}, {\"type\": \"relu\", \"name\": \"stem\"},"
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\", "
      "\"bias\": false},"
      "{\"type\": \"batchnorm\", \"momentum\": 0.5},"
      "{\"type\": \"add\", \"inputs\": [\"batchnorm_1\", \"stem\"]},"
      "{\"type\": \"relu\"}, {\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 5},"
      "{\"type\": \"batchnorm\"}, {\"type\": \"dense\", \"units\": 3},"
      "{\"type\": \"softmax_xent\"}]}",
      spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  return rc;
}

static size_t example_size(const ps_model_spec *spec) {
  return (size_t)spec->in_c * spec->in_h * spec->in_w;
}

/* Initial parameters, with biases moved off zero so that they matter. */
static float *make_params(const ps_model_spec *spec, uint64_t seed) {
  float *p = xalloc(spec->n_params * sizeof(float));
  ps_model_init_params(spec, seed, 0, spec->n_params, p);
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    for (size_t j = 0; j < L->b_count; j++) p[L->b_off + j] = 0.2f * (rand_unit() - 0.5f);
  }
  return p;
}

/* n random examples in [-1, 1) with random labels. */
static void make_batch(const ps_model_spec *spec, int n, float **x, uint8_t **y) {
  const size_t in = example_size(spec);
  *x = xalloc((size_t)n * in * sizeof(float));
  *y = xalloc((size_t)n);
  for (size_t i = 0; i < (size_t)n * in; i++) (*x)[i] = 2.0f * rand_unit() - 1.0f;
  for (int i = 0; i < n; i++) (*y)[i] = (uint8_t)(rand_unit() * (float)spec->classes);
}

/* Learnable examples: class c adds +1 on the inputs i with i % classes ==
 * c, over noise. */
static void make_learnable(const ps_model_spec *spec, int n, float **x, uint8_t **y) {
  const size_t in = example_size(spec);
  make_batch(spec, n, x, y);
  for (int i = 0; i < n; i++)
    for (size_t j = 0; j < in; j++) {
      float *v = *x + (size_t)i * in + j;
      *v = 0.3f * *v + ((int)(j % (size_t)spec->classes) == (*y)[i] ? 1.0f : 0.0f);
    }
}

static int same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

static double rel_l2(const float *got, const float *want, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double d = (double)got[i] - want[i];
    num += d * d;
    den += (double)want[i] * want[i];
  }
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* ---- gradient against finite differences ---- */

/* See the header comment. */
#define FD_EPS 1e-3f
#define FD_ATOL 3e-4
#define FD_RTOL 1e-2
#define FD_MAX_OUTLIERS 0.02 /* fraction of the parameters */
#define FD_MAX_REL_L2 3e-3

static void gradcheck_spec(const char *what, const ps_model_spec *spec) {
  char err[PS_ERRLEN];
  ps_ops *ops = ps_ops_cpu_create(1);
  CHECK(ops != NULL);
  if (!ops) return;
  const int n = 8;
  ps_model *m = ps_model_create(spec, ops, 10, err);
  CHECK_MSG(m != NULL, "%s", err);
  if (!m) {
    ops->destroy(ops);
    return;
  }
  const size_t P = spec->n_params;
  float *params = make_params(spec, 3), *grads = xalloc(P * sizeof(float));
  float *numeric = xalloc(P * sizeof(float));
  float *x;
  uint8_t *y;
  make_batch(spec, n, &x, &y);
  for (size_t j = 0; j < P; j++) grads[j] = NAN; /* must be overwritten */
  const float loss = ps_model_train_step(m, params, x, y, n, 5, 0, grads, NULL);
  CHECK(isfinite(loss));
  /* With batchnorm the loss is the training one (the batch's statistics;
   * evaluation uses the moving ones), and the moving statistics are no
   * derivatives: the pushed batch statistics, checked elsewhere. */
  ps_moving_range mr[PS_MAX_MOVING_RANGES];
  const int n_mr = ps_model_moving_ranges(spec, mr);
  float *scratch = xalloc(P * sizeof(float));
  size_t outliers = 0;
  double worst = 0.0;
  for (size_t j = 0; j < P; j++) {
    int moving = 0;
    for (int r = 0; r < n_mr; r++) moving |= j >= mr[r].off && j < mr[r].off + mr[r].count;
    if (moving) {
      numeric[j] = grads[j];
      continue;
    }
    double diff = 0.0;
    for (float eps = FD_EPS; eps >= FD_EPS / 9; eps /= 3) {
      const float saved = params[j];
      params[j] = saved + eps;
      const float up = params[j];
      const double l_up = n_mr ? ps_model_train_step(m, params, x, y, n, 5, 0, scratch, NULL)
                               : ps_model_evaluate(m, params, x, y, n, NULL);
      params[j] = saved - eps;
      const float down = params[j];
      const double l_down = n_mr ? ps_model_train_step(m, params, x, y, n, 5, 0, scratch, NULL)
                                 : ps_model_evaluate(m, params, x, y, n, NULL);
      params[j] = saved;
      numeric[j] = (float)((l_up - l_down) / ((double)up - down));
      diff = fabs((double)numeric[j] - grads[j]);
      if (diff <= FD_ATOL + FD_RTOL * fabs(grads[j])) break;
    }
    if (!(diff <= FD_ATOL + FD_RTOL * fabs(grads[j]))) outliers++;
    if (diff > worst) worst = diff;
  }
  const double rel = rel_l2(grads, numeric, P);
  printf("%s: P=%zu, loss %.6f, gradient vs central differences: relative L2 %.2e, "
         "largest difference %.2e, %zu outside the per-parameter bound\n",
         what, P, (double)loss, rel, worst, outliers);
  CHECK_MSG(rel <= FD_MAX_REL_L2, "%s: relative L2 %.3g", what, rel);
  CHECK_MSG((double)outliers <= FD_MAX_OUTLIERS * (double)P, "%s: %zu of %zu parameters off", what,
            outliers, P);
  free(params), free(grads), free(numeric), free(x), free(y), free(scratch);
  ps_model_destroy(m);
  ops->destroy(ops);
}

static void test_gradient_conv(void) {
  ps_model_spec spec;
  if (conv_spec(0.0f, &spec) == 0) gradcheck_spec("conv model", &spec);
}

static void test_gradient_flatten_first(void) {
  ps_model_spec spec;
  if (dense_spec(&spec) == 0) gradcheck_spec("flatten-first model", &spec);
}

static void test_gradient_avgpool(void) {
  ps_model_spec spec;
  if (avg_spec(&spec) == 0) gradcheck_spec("average pooling model", &spec);
}

static void test_gradient_residual(void) {
  ps_model_spec spec;
  if (res_spec(&spec) == 0) gradcheck_spec("residual model", &spec);
  if (branch_spec(&spec) == 0) gradcheck_spec("branching model", &spec);
}

static void test_gradient_batchnorm(void) {
  ps_model_spec spec;
  if (bn_spec(&spec) == 0) gradcheck_spec("batchnorm model", &spec);
}

/* A training step writes the batch's mean and (biased) variance where the
 * moving statistics are; evaluation normalizes with the moving statistics
 * of the parameters: given the batch's own, it computes the training
 * step's loss. */
static void test_batchnorm_statistics(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 3, 3], \"classes\": 3, \"layers\": ["
      "{\"type\": \"batchnorm\"}, {\"type\": \"flatten\"},"
      "{\"type\": \"dense\", \"units\": 3}, {\"type\": \"softmax_xent\"}]}",
      &spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  ps_ops *ops = ps_ops_cpu_create(2);
  ps_model *m = ps_model_create(&spec, ops, 16, err);
  CHECK_MSG(m != NULL, "%s", err);
  if (!m) {
    ops->destroy(ops);
    return;
  }
  const int n = 16;
  const ps_layer *bn = &spec.layers[0];
  float *params = make_params(&spec, 4), *grads = xalloc(spec.n_params * sizeof(float));
  float *x;
  uint8_t *y;
  make_learnable(&spec, n, &x, &y);
  for (int k = 0; k < 2; k++) params[bn->w_off + k] = 1.5f - (float)k, params[bn->b_off + k] = 0.3f;
  const float l_train = ps_model_train_step(m, params, x, y, n, 1, 0, grads, NULL);
  int ok = 1;
  for (int k = 0; k < 2; k++) {
    double s = 0, q = 0;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < 9; j++) s += x[(size_t)i * 18 + (size_t)k * 9 + j];
    const double mu = s / (n * 9);
    for (int i = 0; i < n; i++)
      for (int j = 0; j < 9; j++) {
        const double d = x[(size_t)i * 18 + (size_t)k * 9 + j] - mu;
        q += d * d;
      }
    ok &= fabs(grads[bn->s_off + k] - mu) < 1e-6 && fabs(grads[bn->s_off + 2 + k] - q / (n * 9)) < 1e-6;
  }
  CHECK_MSG(ok, "the batch's statistics in the moving statistics' places");
  /* The initial moving statistics (0, 1) give another loss; the batch's the same. */
  const float l_init = ps_model_evaluate(m, params, x, y, n, NULL);
  CHECK(fabsf(l_init - l_train) > 1e-3f);
  memcpy(params + bn->s_off, grads + bn->s_off, 4 * sizeof(float));
  const float l_eval = ps_model_evaluate(m, params, x, y, n, NULL);
  CHECK_MSG(fabsf(l_eval - l_train) < 1e-5f, "train %.7g, evaluation with its statistics %.7g",
            (double)l_train, (double)l_eval);
  free(params), free(grads), free(x), free(y);
  ps_model_destroy(m);
  ops->destroy(ops);
}

/* A chain written with every name and input spelled out is the same
 * model: the same loss and gradient, bit for bit. */
static void test_chain_spelled_out(void) {
  ps_model_spec plain, spelled;
  char err[PS_ERRLEN];
  if (conv_spec(0.0f, &plain) != 0) return;
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\", "
      "\"name\": \"c\", \"inputs\": [\"input\"]},"
      "{\"type\": \"relu\", \"inputs\": [\"c\"]},"
      "{\"type\": \"maxpool\", \"size\": 2, \"inputs\": [\"relu_0\"]},"
      "{\"type\": \"flatten\", \"name\": \"f\"},"
      "{\"type\": \"dense\", \"units\": 8, \"inputs\": [\"f\"]}, {\"type\": \"relu\"},"
      "{\"type\": \"dropout\", \"rate\": 0},"
      "{\"type\": \"dense\", \"units\": 3}, {\"type\": \"softmax_xent\", "
      "\"inputs\": [\"dense_1\"]}]}",
      &spelled, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(spelled.n_params == plain.n_params);
  ps_ops *ops = ps_ops_cpu_create(1);
  CHECK(ops != NULL);
  if (!ops) return;
  ps_model *a = ps_model_create(&plain, ops, 6, err), *b = ps_model_create(&spelled, ops, 6, err);
  CHECK_MSG(a && b, "%s", err);
  if (a && b) {
    const size_t P = plain.n_params;
    float *params = make_params(&plain, 9), *ga = xalloc(P * sizeof(float));
    float *gb = xalloc(P * sizeof(float));
    float *x;
    uint8_t *y;
    make_batch(&plain, 6, &x, &y);
    const float la = ps_model_train_step(a, params, x, y, 6, 1, 0, ga, NULL);
    const float lb = ps_model_train_step(b, params, x, y, 6, 1, 0, gb, NULL);
    CHECK(same_bits(&la, &lb, sizeof la) && same_bits(ga, gb, P * sizeof(float)));
    free(params), free(ga), free(gb), free(x), free(y);
  }
  ps_model_destroy(a);
  ps_model_destroy(b);
  ops->destroy(ops);
}

/* ---- evaluate against train_step ---- */

static void test_evaluate_matches_train_step(void) {
  ps_model_spec spec, spec_drop;
  char err[PS_ERRLEN];
  if (conv_spec(0.0f, &spec) != 0 || conv_spec(0.5f, &spec_drop) != 0) return;
  ps_ops *ops = ps_ops_cpu_create(2);
  CHECK(ops != NULL);
  if (!ops) return;
  const int n = 10, chunk = 4;
  ps_model *whole = ps_model_create(&spec, ops, n, err);
  ps_model *chunked = ps_model_create(&spec, ops, chunk, err);
  ps_model *drop = ps_model_create(&spec_drop, ops, chunk, err);
  CHECK_MSG(whole && chunked && drop, "%s", err);
  if (!whole || !chunked || !drop) goto out;
  const size_t P = spec.n_params, in = example_size(&spec);
  float *params = make_params(&spec, 9), *grads = xalloc(P * sizeof(float));
  float *x;
  uint8_t *y;
  make_batch(&spec, n, &x, &y);

  /* One chunk: the same forward pass and the same loss. */
  int c_train = -1, c_eval = -1;
  const float l_train = ps_model_train_step(whole, params, x, y, n, 1, 2, grads, &c_train);
  const float l_eval = ps_model_evaluate(whole, params, x, y, n, &c_eval);
  CHECK_MSG(same_bits(&l_train, &l_eval, sizeof(float)), "train %.9g eval %.9g", (double)l_train,
            (double)l_eval);
  CHECK(c_train == c_eval && c_eval >= 0 && c_eval <= n);

  /* Chunks of 4, 4, 2: the mean of the chunks' losses weighted by size. */
  double sum = 0.0;
  int c_sum = 0;
  for (int start = 0; start < n; start += chunk) {
    const int b = n - start < chunk ? n - start : chunk;
    int c = 0;
    const float l = ps_model_train_step(chunked, params, x + (size_t)start * in, y + start, b, 1,
                                        2, grads, &c);
    sum += (double)l * b;
    c_sum += c;
  }
  const float l_mean = (float)(sum / n);
  int c_chunked = -1;
  const float l_chunked = ps_model_evaluate(chunked, params, x, y, n, &c_chunked);
  CHECK_MSG(same_bits(&l_mean, &l_chunked, sizeof(float)), "chunks %.9g eval %.9g",
            (double)l_mean, (double)l_chunked);
  CHECK(c_chunked == c_sum);
  CHECK_NEAR(l_chunked, l_eval, 0.0, 1e-6);

  /* Dropout is off in evaluation (the spec differs only in the rate, so P
   * and the layout are the same), and on in training. */
  int c_drop = -1;
  const float l_drop = ps_model_evaluate(drop, params, x, y, n, &c_drop);
  CHECK(same_bits(&l_drop, &l_chunked, sizeof(float)) && c_drop == c_chunked);
  const float l_drop_train = ps_model_train_step(drop, params, x, y, chunk, 1, 2, grads, NULL);
  const float l_plain_train = ps_model_train_step(chunked, params, x, y, chunk, 1, 2, grads, NULL);
  CHECK(l_drop_train != l_plain_train);
  CHECK(ps_model_evaluate(whole, params, x, y, 0, &c_eval) == 0.0f && c_eval == 0);
  free(params), free(grads), free(x), free(y);
out:
  ps_model_destroy(whole);
  ps_model_destroy(chunked);
  ps_model_destroy(drop);
  ops->destroy(ops);
}

/* ---- dropout streams ---- */

static void test_dropout_replay(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  if (conv_spec(0.5f, &spec) != 0) return;
  ps_ops *ops = ps_ops_cpu_create(1);
  ps_model *m = ops ? ps_model_create(&spec, ops, 8, err) : NULL;
  CHECK(m != NULL);
  if (m) {
    const size_t P = spec.n_params;
    float *params = make_params(&spec, 4);
    float *g1 = xalloc(P * sizeof(float)), *g2 = xalloc(P * sizeof(float));
    float *g3 = xalloc(P * sizeof(float));
    float *x;
    uint8_t *y;
    make_batch(&spec, 8, &x, &y);
    const float l1 = ps_model_train_step(m, params, x, y, 8, 77, 3, g1, NULL);
    const float l3 = ps_model_train_step(m, params, x, y, 8, 77, 4, g3, NULL);
    const float l2 = ps_model_train_step(m, params, x, y, 8, 77, 3, g2, NULL);
    CHECK(same_bits(&l1, &l2, sizeof l1) && same_bits(g1, g2, P * sizeof(float)));
    CHECK(!same_bits(g1, g3, P * sizeof(float)) && l1 != l3);
    free(params), free(g1), free(g2), free(g3), free(x), free(y);
  }
  ps_model_destroy(m);
  if (ops) ops->destroy(ops);
}

/* ---- a few SGD steps ---- */

static void test_sgd_lowers_loss(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  if (conv_spec(0.25f, &spec) != 0) return;
  ps_ops *ops = ps_ops_cpu_create(2);
  const int n = 24, steps = 30;
  ps_model *m = ops ? ps_model_create(&spec, ops, n, err) : NULL;
  CHECK(m != NULL);
  if (m) {
    const size_t P = spec.n_params;
    float *params = make_params(&spec, 11), *grads = xalloc(P * sizeof(float));
    float *x;
    uint8_t *y;
    make_learnable(&spec, n, &x, &y);
    int c0 = 0, c1 = 0;
    const float before = ps_model_evaluate(m, params, x, y, n, &c0);
    for (int t = 0; t < steps; t++) {
      const float l = ps_model_train_step(m, params, x, y, n, 1, (uint64_t)t, grads, NULL);
      CHECK(isfinite(l));
      for (size_t j = 0; j < P; j++) params[j] -= 0.1f * grads[j];
    }
    const float after = ps_model_evaluate(m, params, x, y, n, &c1);
    printf("SGD, %d steps: loss %.4f -> %.4f, correct %d -> %d of %d\n", steps, (double)before,
           (double)after, c0, c1, n);
    CHECK_MSG(after < 0.5f * before, "loss %.4f -> %.4f", (double)before, (double)after);
    CHECK(c1 > c0);
    free(params), free(grads), free(x), free(y);
  }
  ps_model_destroy(m);
  if (ops) ops->destroy(ops);
}

/* A small CNN with both average poolings learns the synthetic set
 * (worker/data/data.h: a random template per class plus noise) on the CPU
 * backend: momentum SGD over 3 epochs of 1024 examples, then the test
 * split's accuracy well above chance (1/4). The second convolution (4x4,
 * "valid") sees most of the 6x6 map, so the plane its 3x3 outputs are
 * averaged over keeps what tells the templates apart (with a 3x3 "same"
 * one, global pooling of the whole 6x6 map reached only 0.47 after 3
 * epochs). Measured: 0.963; the bound is 0.6, so that only a model that
 * does not learn, not an unlucky seed, fails. */
static void test_synthetic_avgpool(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN];
  int rc = ps_model_spec_parse(
      "{\"input\": [1, 12, 12], \"classes\": 4, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 8, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"relu\"}, {\"type\": \"avgpool\", \"size\": 2},"
      "{\"type\": \"conv2d\", \"filters\": 16, \"kernel\": 4}, {\"type\": \"relu\"},"
      "{\"type\": \"global_avgpool\"},"
      "{\"type\": \"dense\", \"units\": 4}, {\"type\": \"softmax_xent\"}]}",
      &spec, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  ps_dataset train, test;
  CHECK(ps_dataset_synthetic(1024, 1, 12, 12, 4, 7, 0, &train) == 0);
  CHECK(ps_dataset_synthetic(512, 1, 12, 12, 4, 7, 1, &test) == 0);
  ps_ops *ops = ps_ops_cpu_create(2);
  const int batch = 32, epochs = 3;
  ps_model *m = ops ? ps_model_create(&spec, ops, batch, err) : NULL;
  CHECK_MSG(m != NULL, "%s", err);
  if (m) {
    const size_t P = spec.n_params, in = example_size(&spec);
    float *params = xalloc(P * sizeof(float)), *grads = xalloc(P * sizeof(float));
    float *velocity = xalloc(P * sizeof(float));
    ps_model_init_params(&spec, 7, 0, P, params);
    memset(velocity, 0, P * sizeof(float));
    int c0 = 0, c1 = 0;
    const float before = ps_model_evaluate(m, params, test.images, test.labels, test.n, &c0);
    uint64_t step = 0;
    for (int e = 0; e < epochs; e++)
      for (int b = 0; b + batch <= train.n; b += batch, step++) {
        const float l = ps_model_train_step(m, params, train.images + (size_t)b * in,
                                            train.labels + b, batch, 1, step, grads, NULL);
        CHECK(isfinite(l));
        for (size_t j = 0; j < P; j++) {
          velocity[j] = 0.9f * velocity[j] + grads[j];
          params[j] -= 0.05f * velocity[j];
        }
      }
    const float after = ps_model_evaluate(m, params, test.images, test.labels, test.n, &c1);
    const double acc = (double)c1 / test.n;
    printf(
        "synthetic set, avgpool + global_avgpool, %d epochs: test loss %.4f -> %.4f, "
        "accuracy %.3f -> %.3f\n",
        epochs, (double)before, (double)after, (double)c0 / test.n, acc);
    CHECK_MSG(acc >= 0.6, "test accuracy %.3f after %d epochs (chance 0.25)", acc, epochs);
    free(params), free(grads), free(velocity);
  }
  ps_model_destroy(m);
  if (ops) ops->destroy(ops);
  ps_dataset_free(&train);
  ps_dataset_free(&test);
}

#include "../../kernels/emu/ops_emu.h"

/* The emulated device's counts (kernels/emu): alloc calls so far, blocks
 * allocated now, copies to the host not landed. */
static ps_emu_counts emu_counts(const ps_ops *o) {
  ps_emu_counts c;
  ps_ops_emu_counts(o, &c);
  return c;
}

/* Train steps (with and without dropout, full and partial batches) and
 * evaluations in several chunks on the emulated device, against the CPU backend
 * itself: bit for bit. */
static void device_path_case(const char *what, const ps_model_spec *spec) {
  char err[PS_ERRLEN];
  ps_ops *cpu = ps_ops_cpu_create(1);
  CHECK(cpu != NULL);
  if (!cpu) return;
  ps_ops *emu = ps_ops_emu_create(1);
  CHECK(emu != NULL);
  if (!emu) {
    cpu->destroy(cpu);
    return;
  }
  const int max_batch = 6, n_eval = 15;
  ps_model *host = ps_model_create(spec, cpu, max_batch, err);
  ps_model *dev = ps_model_create(spec, emu, max_batch, err);
  CHECK_MSG(host && dev, "%s", err);
  if (host && dev) {
    CHECK(ps_model_ops(dev) == emu && ps_model_ops(host) == cpu);
    const size_t P = spec->n_params;
    float *params = make_params(spec, 21);
    float *g_host = xalloc(P * sizeof(float)), *g_back = xalloc(P * sizeof(float));
    float *d_params = ps_model_alloc_params(dev), *d_grads = ps_model_alloc_params(dev);
    CHECK(d_params && d_grads);
    if (d_params && d_grads) {
      /* alloc_params is zeroed; the round trip is exact. */
      ps_model_params_to_host(dev, g_back, d_params);
      int zero = 1;
      for (size_t j = 0; j < P; j++) zero &= g_back[j] == 0.0f;
      CHECK(zero);
      ps_model_params_to_device(dev, d_params, params);
      ps_model_params_to_host(dev, g_back, d_params);
      CHECK(same_bits(g_back, params, P * sizeof(float)));

      float *x;
      uint8_t *y;
      make_batch(spec, n_eval, &x, &y);
      const int sizes[] = {max_batch, 3, 1};
      for (int t = 0; t < 3; t++) {
        int c_host = -1, c_dev = -2;
        const float l_host =
            ps_model_train_step(host, params, x, y, sizes[t], 13, (uint64_t)t, g_host, &c_host);
        const float l_dev =
            ps_model_train_step(dev, d_params, x, y, sizes[t], 13, (uint64_t)t, d_grads, &c_dev);
        ps_model_params_to_host(dev, g_back, d_grads);
        CHECK_MSG(same_bits(&l_host, &l_dev, sizeof(float)) && c_host == c_dev,
                  "%s step %d: loss %.9g vs %.9g, correct %d vs %d", what, t, (double)l_dev,
                  (double)l_host, c_dev, c_host);
        CHECK_MSG(same_bits(g_back, g_host, P * sizeof(float)), "%s step %d: gradients differ",
                  what, t);
      }
      int c_host = -1, c_dev = -2;
      const float e_host = ps_model_evaluate(host, params, x, y, n_eval, &c_host);
      const float e_dev = ps_model_evaluate(dev, d_params, x, y, n_eval, &c_dev);
      CHECK_MSG(same_bits(&e_host, &e_dev, sizeof(float)) && c_host == c_dev,
                "%s evaluate: %.9g vs %.9g, correct %d vs %d", what, (double)e_dev,
                (double)e_host, c_dev, c_host);
      free(x), free(y);
    }
    ps_model_free_params(dev, d_params);
    ps_model_free_params(dev, d_grads);
    free(params), free(g_host), free(g_back);
  }
  ps_model_destroy(host);
  ps_model_destroy(dev);
  CHECK_MSG(emu_counts(emu).blocks == 0, "%s: %d device blocks not freed", what,
            emu_counts(emu).blocks);
  emu->destroy(emu);
  cpu->destroy(cpu);
}

/* The staged step (ps_model_step_*) as the pipelined worker drives it:
 * the parameters arrive in `pieces` ranges (copied to the backend with
 * to_device_async as each lands; what has not arrived is NaN, so a layer
 * run too early poisons the loss), and each ready(lo) sends grads[lo, sent)
 * back with to_host_async into a NaN-filled host buffer. Loss, correct
 * count and gradient equal ps_model_train_step's on the CPU bit for bit;
 * the ranges said ready hold their final values when said; the last says
 * lo == 0. */
typedef struct {
  ps_ops *ops;
  float *grads_dev, *grads_host;
  const float *want; /* the final gradient */
  size_t P, sent;    /* grads[sent, P) have been sent back */
  uint64_t tickets[64];
  int n_tickets, calls, bad_order, early_wrong, last_lo_zero;
  int direct; /* the backend's memory can be read here, and its ops are done on return */
} staged_ready;

static void staged_on_ready(void *user, size_t lo) {
  staged_ready *r = user;
  r->calls++;
  r->last_lo_zero = lo == 0;
  if (lo >= r->sent) {
    r->bad_order += lo > r->sent;
    return;
  }
  /* The cpu backend and the emulated device run an op before returning: the range
   * said ready already holds its final bytes. */
  if (r->direct && !same_bits(r->grads_dev + lo, r->want + lo, (r->sent - lo) * sizeof(float)))
    r->early_wrong++;
  if (r->grads_dev != r->grads_host && r->n_tickets < 64)
    r->tickets[r->n_tickets++] = r->ops->to_host_async(
        r->ops->ctx, r->grads_host + lo, r->grads_dev + lo, (r->sent - lo) * sizeof(float));
  r->sent = lo;
}

/* dev == NULL: on the cpu backend (on_emu 0) or the emulated device (1), against
 * the cpu backend's plain step. dev (a real device; on_emu 1): against the
 * plain step on dev itself, since the staged step runs the same ops in the
 * same order. */
static void staged_case(const char *what, const ps_model_spec *spec, int on_emu, int pieces,
                        ps_ops *dev) {
  char err[PS_ERRLEN];
  ps_ops *cpu = ps_ops_cpu_create(1);
  CHECK(cpu != NULL);
  if (!cpu) return;
  ps_ops *emu = dev || !on_emu ? NULL : ps_ops_emu_create(1);
  ps_ops *ops = dev ? dev : on_emu ? emu : cpu;
  CHECK(ops != NULL);
  if (!ops) {
    cpu->destroy(cpu);
    return;
  }
  const int n = 5;
  ps_model *ref = ps_model_create(spec, dev ? dev : cpu, n, err);
  ps_model *m = ps_model_create(spec, ops, n, err);
  CHECK_MSG(ref && m, "%s", err);
  const size_t P = spec->n_params;
  float *params = make_params(spec, 33), *want = xalloc(P * sizeof(float));
  float *d_params = m ? ps_model_alloc_params(m) : NULL;
  float *d_grads = m ? ps_model_alloc_params(m) : NULL;
  float *host_grads = on_emu ? xalloc(P * sizeof(float)) : d_grads;
  float *host_params = on_emu ? xalloc(P * sizeof(float)) : d_params;
  if (ref && m && d_params && d_grads) {
    float *x;
    uint8_t *y;
    make_batch(spec, n, &x, &y);
    int c_want = -1, c_got = -2;
    float l_want;
    if (dev) {
      ps_model_params_to_device(m, d_params, params);
      l_want = ps_model_train_step(ref, d_params, x, y, n, 7, 3, d_grads, &c_want);
      ps_model_params_to_host(m, want, d_grads);
    } else {
      l_want = ps_model_train_step(ref, params, x, y, n, 7, 3, want, &c_want);
    }
    /* Nothing has arrived: NaN everywhere, on both sides. */
    for (size_t j = 0; j < P; j++) host_params[j] = host_grads[j] = NAN;
    if (on_emu) {
      ps_model_params_to_device(m, d_params, host_params);
      ps_model_params_to_device(m, d_grads, host_grads);
    }
    ps_model_step_begin(m, x, y, n, 7, 3);
    CHECK(isnan(ps_model_step_loss(m)));
    size_t avail = 0;
    for (int k = 1; k <= pieces; k++) {
      size_t end = P * (size_t)k / (size_t)pieces;
      memcpy(host_params + avail, params + avail, (end - avail) * sizeof(float));
      ops->to_device_async(ops->ctx, d_params + avail, host_params + avail,
                           (end - avail) * sizeof(float));
      avail = end;
      ps_model_step_forward(m, d_params, avail);
      if (k < pieces) CHECK(isnan(ps_model_step_loss(m)) || end == P);
    }
    CHECK_MSG(same_bits(&l_want, &(float){ps_model_step_loss(m)}, sizeof(float)),
              "%s: loss after forward %.9g, want %.9g", what, (double)ps_model_step_loss(m),
              (double)l_want);
    staged_ready r = {.ops = ops, .grads_dev = d_grads, .grads_host = host_grads, .want = want,
                      .P = P, .sent = P, .direct = dev == NULL};
    const float l_got = ps_model_step_backward(m, d_params, d_grads, staged_on_ready, &r, &c_got);
    CHECK_MSG(same_bits(&l_want, &l_got, sizeof(float)) && c_want == c_got,
              "%s: loss %.9g vs %.9g, correct %d vs %d", what, (double)l_got, (double)l_want,
              c_got, c_want);
    CHECK_MSG(r.calls >= 2 && r.last_lo_zero && r.bad_order == 0 && r.sent == 0,
              "%s: %d ready calls, last lo 0: %d, %d out of order, %zu not sent", what, r.calls,
              r.last_lo_zero, r.bad_order, r.sent);
    CHECK_MSG(r.early_wrong == 0, "%s: %d ranges said ready before they were", what,
              r.early_wrong);
    CHECK(r.n_tickets == (on_emu ? r.calls : 0)); /* one per range sent; none on the cpu */
    for (int t = 0; t < r.n_tickets; t++) {
      ops->ticket_wait(ops->ctx, r.tickets[t]);
      CHECK(ops->ticket_done(ops->ctx, r.tickets[t]));
    }
    CHECK_MSG(same_bits(host_grads, want, P * sizeof(float)), "%s: gradients differ", what);
    free(x), free(y);
  }
  if (on_emu) free(host_grads), free(host_params);
  if (m) ps_model_free_params(m, d_params), ps_model_free_params(m, d_grads);
  free(params), free(want);
  ps_model_destroy(ref);
  ps_model_destroy(m);
  if (emu) {
    CHECK_MSG(emu_counts(emu).pending == 0 && emu_counts(emu).blocks == 0,
              "%s: %d copies not landed, %d blocks not freed", what, emu_counts(emu).pending,
              emu_counts(emu).blocks);
    emu->destroy(emu);
  }
  cpu->destroy(cpu);
}

static void test_staged_step(void) {
  ps_model_spec conv, dense;
  const int pieces[] = {1, 2, 3, 7};
  for (int on_emu = 0; on_emu <= 1; on_emu++)
    for (int k = 0; k < 4; k++) {
      char what[96];
      if (conv_spec(0.5f, &conv) == 0) {
        snprintf(what, sizeof what, "conv, dropout, %s, %d pieces", on_emu ? "device" : "cpu",
                 pieces[k]);
        staged_case(what, &conv, on_emu, pieces[k], NULL);
      }
      if (dense_spec(&dense) == 0) {
        snprintf(what, sizeof what, "flatten-first, %s, %d pieces", on_emu ? "device" : "cpu",
                 pieces[k]);
        staged_case(what, &dense, on_emu, pieces[k], NULL);
      }
      if (branch_spec(&dense) == 0) {
        snprintf(what, sizeof what, "branching, %s, %d pieces", on_emu ? "device" : "cpu",
                 pieces[k]);
        staged_case(what, &dense, on_emu, pieces[k], NULL);
      }
      if (bn_spec(&dense) == 0) {
        snprintf(what, sizeof what, "batchnorm, %s, %d pieces", on_emu ? "device" : "cpu",
                 pieces[k]);
        staged_case(what, &dense, on_emu, pieces[k], NULL);
      }
    }
}

/* The emulated device's asynchronous copies land only when waited for; tickets
 * say so; the cpu backend's land at once. */
static void test_async_copies(void) {
  ps_ops *cpu = ps_ops_cpu_create(1);
  CHECK(cpu != NULL);
  if (!cpu) return;
  ps_ops *e = ps_ops_emu_create(1);
  CHECK(e != NULL);
  if (!e) {
    cpu->destroy(cpu);
    return;
  }
  float *d = e->alloc(e->ctx, 8 * sizeof(float));
  float src[8] = {1, -2, 3, -4, 5, -6, 7, -8}, back[8] = {0};
  e->to_device_async(e->ctx, d, src, sizeof src);
  e->relu_forward(e->ctx, 8, d, d);
  e->scale(e->ctx, 8, 0.5f, d);
  uint64_t t = e->to_host_async(e->ctx, back, d, sizeof back);
  CHECK(t != 0 && back[0] == 0.0f);
  e->relu_forward(e->ctx, 8, d, d); /* after the copy: not in it */
  CHECK(!e->ticket_done(e->ctx, t) && back[0] == 0.0f);
  e->ticket_wait(e->ctx, t);
  CHECK(e->ticket_done(e->ctx, t));
  const float want[8] = {0.5f, 0, 1.5f, 0, 2.5f, 0, 3.5f, 0};
  CHECK(same_bits(back, want, sizeof want));
  e->free(e->ctx, d);
  CHECK(emu_counts(e).blocks == 0 && emu_counts(e).pending == 0);
  e->destroy(e);
  /* The cpu backend: done at once, ticket 0. */
  float h[4] = {1, 2, 3, 4}, o[4] = {0};
  cpu->to_device_async(cpu->ctx, o, h, sizeof h);
  CHECK(same_bits(o, h, sizeof h));
  cpu->scale(cpu->ctx, 4, -2.0f, o);
  float r[4] = {0};
  CHECK(cpu->to_host_async(cpu->ctx, r, o, sizeof o) == 0 && cpu->ticket_done(cpu->ctx, 0));
  cpu->ticket_wait(cpu->ctx, 0);
  CHECK(r[0] == -2.0f && r[3] == -8.0f);
  cpu->destroy(cpu);
}

static void test_device_path(void) {
  ps_model_spec conv, dense;
  if (conv_spec(0.5f, &conv) == 0) device_path_case("conv model, dropout 0.5", &conv);
  if (conv_spec(0.0f, &conv) == 0) device_path_case("conv model, dropout 0", &conv);
  if (dense_spec(&dense) == 0) device_path_case("flatten-first model", &dense);
  if (avg_spec(&dense) == 0) device_path_case("average pooling model", &dense);
  if (res_spec(&dense) == 0) device_path_case("residual model", &dense);
  if (branch_spec(&dense) == 0) device_path_case("branching model", &dense);
  if (bn_spec(&dense) == 0) device_path_case("batchnorm model", &dense);
}

/* Every allocation of ps_model_create fails in turn (on the emulated device, which
 * has the most of them): NULL, a message, nothing left allocated. */
static void test_out_of_memory(void) {
  ps_model_spec spec;
  if (conv_spec(0.5f, &spec) != 0) return;
  ps_ops *cpu = ps_ops_cpu_create(1);
  CHECK(cpu != NULL);
  if (!cpu) return;
  int failures = 0;
  for (int at = 0; at < 100; at++) {
    ps_ops *e = ps_ops_emu_create(1);
    if (!e) break;
    ps_ops_emu_fail_alloc_at(e, at);
    char err[PS_ERRLEN] = "";
    ps_model *m = ps_model_create(&spec, e, 8, err);
    int done = m != NULL;
    if (m) { /* every allocation has had its turn */
      CHECK(emu_counts(e).allocs == at);
      ps_model_destroy(m);
      CHECK(emu_counts(e).blocks == 0);
    } else {
      failures++;
      CHECK_MSG(strstr(err, "out of") != NULL, "at %d: '%s'", at, err);
      CHECK_MSG(emu_counts(e).blocks == 0, "at %d: %d blocks left", at, emu_counts(e).blocks);
    }
    e->destroy(e);
    if (done) break;
  }
  CHECK(failures > 5);
  /* The helpers report it too. */
  ps_ops *e = ps_ops_emu_create(1);
  char err[PS_ERRLEN];
  ps_model *m = e ? ps_model_create(&spec, e, 8, err) : NULL;
  CHECK(m != NULL);
  if (m) {
    ps_ops_emu_fail_alloc_at(e, emu_counts(e).allocs);
    CHECK(ps_model_alloc_params(m) == NULL);
    ps_model_destroy(m);
  }
  if (e) {
    CHECK(emu_counts(e).blocks == 0);
    e->destroy(e);
  }
  cpu->destroy(cpu);
}

/* ---- the memory members of the CPU backend ---- */

static void test_cpu_memory_members(void) {
  ps_ops *o = ps_ops_cpu_create(1);
  CHECK(o != NULL);
  if (!o) return;
  CHECK(o->host_memory == 1);
  float *a = o->alloc(o->ctx, 100 * sizeof(float)), *b = o->alloc(o->ctx, 100 * sizeof(float));
  void *empty = o->alloc(o->ctx, 0);
  CHECK(a && b && empty);
  if (a && b) {
    int zero = 1;
    for (int i = 0; i < 100; i++) zero &= a[i] == 0.0f;
    CHECK(zero);
    float src[100], back[100];
    for (int i = 0; i < 100; i++) src[i] = (float)i * 0.5f;
    o->to_device(o->ctx, a, src, sizeof src);
    o->copy(o->ctx, b, a, sizeof src);
    o->copy(o->ctx, b, b, sizeof src); /* dst == src: nothing */
    o->to_host(o->ctx, back, b, sizeof back);
    o->sync(o->ctx);
    CHECK(memcmp(back, src, sizeof src) == 0);
  }
  o->free(o->ctx, a);
  o->free(o->ctx, b);
  o->free(o->ctx, empty);
  o->free(o->ctx, NULL);
  o->destroy(o);
}

/* ---- the device chooser ---- */

static int cuda_devices(char *why) {
#ifdef PS_WITH_CUDA
  return ps_cuda_device_count(why);
#else
  snprintf(why, 128, "built without CUDA");
  return 0;
#endif
}

static void test_device_cpu(void) {
  char desc[256], err[PS_ERRLEN];
  /* "cpu" is oneDNN's backend in a build that has it (the description
   * names it and its version), else the reference; "cpu-ref" is always
   * the reference. */
  const struct {
    const char *spec;
    int threads;
    const char *desc;
  } cases[] = {
#ifdef PS_HAVE_DNNL
      {"cpu", 2, "cpu (2 threads, oneDNN "},
      {"cpu", 1, "cpu (1 thread, oneDNN "},
      {"cpu", 0, "cpu (OpenMP default threads, oneDNN "},
#else
      {"cpu", 2, "cpu (2 threads)"},
      {"cpu", 1, "cpu (1 thread)"},
      {"cpu", 0, "cpu (OpenBLAS default threads)"},
#endif
      {"cpu-ref", 2, "cpu-ref (2 threads)"},
      {"cpu-ref", 1, "cpu-ref (1 thread)"},
      {"cpu-ref", 0, "cpu-ref (OpenBLAS default threads)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ps_ops *o = ps_device_open(cases[i].spec, cases[i].threads, desc, sizeof desc, err);
    CHECK_MSG(o != NULL, "%s", err);
    if (!o) continue;
    CHECK(strcmp(o->name, "cpu") == 0 && o->host_memory == 1);
    CHECK_MSG(strncmp(desc, cases[i].desc, strlen(cases[i].desc)) == 0, "'%s'", desc);
    o->destroy(o);
  }
  /* desc and err may be NULL. */
  ps_ops *o = ps_device_open("cpu", 1, NULL, 0, NULL);
  CHECK(o != NULL);
  if (o) o->destroy(o);
  CHECK(ps_device_open("gpu", 1, NULL, 0, NULL) == NULL);
  /* A short desc is truncated, not overrun. */
  char tiny[6];
  o = ps_device_open("cpu", 2, tiny, sizeof tiny, err);
  CHECK(o != NULL && strcmp(tiny, "cpu (") == 0);
  if (o) o->destroy(o);
}

static void test_device_auto(void) {
  char desc[256], err[PS_ERRLEN], why[128] = "";
  const int devices = cuda_devices(why);
  const char *specs[] = {"auto", NULL};
  for (int i = 0; i < 2; i++) {
    ps_ops *o = ps_device_open(specs[i], 2, desc, sizeof desc, err);
    CHECK_MSG(o != NULL, "%s", err);
    if (!o) continue;
    printf("device %s: %s\n", specs[i] ? specs[i] : "(null)", desc);
    if (devices > 0) {
      CHECK(strcmp(o->name, "cuda") == 0 && strncmp(desc, "cuda:0 (", 8) == 0);
    } else {
      CHECK(strcmp(o->name, "cpu") == 0 && strncmp(desc, "cpu (2 threads", 14) == 0);
    }
    o->destroy(o);
  }
}

static void test_device_cuda(void) {
  char desc[256] = "x", err[PS_ERRLEN] = "", why[128] = "";
  const int devices = cuda_devices(why);
  ps_ops *o = ps_device_open("cuda", 2, desc, sizeof desc, err);
  if (devices == 0) {
    CHECK(o == NULL);
    printf("device cuda: %s\n", err);
#ifdef PS_WITH_CUDA
    CHECK_MSG(strncmp(err, "no CUDA device: ", 16) == 0, "'%s'", err);
#else
    CHECK_MSG(strcmp(err, "this ps-worker was built without CUDA (WITH_CUDA=OFF)") == 0, "'%s'",
              err);
#endif
    CHECK(desc[0] == '\0');
    /* cuda:N is well formed and fails the same way. */
    char err2[PS_ERRLEN] = "";
    CHECK(ps_device_open("cuda:0", 2, NULL, 0, err2) == NULL && strcmp(err, err2) == 0);
    return;
  }
  CHECK_MSG(o != NULL, "%s", err);
  if (o) {
    printf("device cuda: %s\n", desc);
    CHECK(strcmp(o->name, "cuda") == 0 && o->host_memory == 0);
    CHECK(strncmp(desc, "cuda:0 (", 8) == 0);
    o->destroy(o);
  }
  char spec[32], want[64];
  snprintf(spec, sizeof spec, "cuda:%d", devices - 1);
  o = ps_device_open(spec, 2, desc, sizeof desc, err);
  CHECK_MSG(o != NULL, "%s: %s", spec, err);
  if (o) o->destroy(o);
  snprintf(spec, sizeof spec, "cuda:%d", devices);
  CHECK(ps_device_open(spec, 2, desc, sizeof desc, err) == NULL);
  snprintf(want, sizeof want, "%s but only %d device", spec, devices);
  CHECK_MSG(strncmp(err, want, strlen(want)) == 0, "'%s'", err);
}

static void test_device_malformed(void) {
  const char *bad[] = {"gpu", "cuda:x", "cuda:", "cuda:-1", "cuda:1x", "cuda:+1", "cuda0",
                       "CPU", "", "cpu ", "cpu-", "cpu-reference", "cuda:99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char desc[64] = "x", err[PS_ERRLEN] = "";
    ps_ops *o = ps_device_open(bad[i], 1, desc, sizeof desc, err);
    CHECK_MSG(o == NULL, "'%s' accepted", bad[i]);
    if (o) o->destroy(o);
    CHECK_MSG(strstr(err, "bad device") != NULL, "'%s': '%s'", bad[i], err);
    CHECK(desc[0] == '\0');
  }
}

/* ---- CPU against CUDA, with a device ---- */

static void test_cuda_against_cpu(void) {
  char why[128] = "";
  if (cuda_devices(why) == 0) {
    printf("SKIPPED: train_step on cuda against the cpu: no CUDA device (%s)\n", why);
    return;
  }
  ps_model_spec spec;
  char err[PS_ERRLEN], desc[256];
  if (conv_spec(0.25f, &spec) != 0) return;
  ps_ops *cpu = ps_ops_cpu_create(1);
  ps_ops *gpu = ps_device_open("cuda:0", 0, desc, sizeof desc, err);
  CHECK_MSG(cpu && gpu, "%s", err);
  ps_model *mc = cpu ? ps_model_create(&spec, cpu, 16, err) : NULL;
  ps_model *mg = gpu ? ps_model_create(&spec, gpu, 16, err) : NULL;
  CHECK_MSG(mc && mg, "%s", err);
  if (mc && mg) {
    const size_t P = spec.n_params;
    float *params = make_params(&spec, 5), *g_cpu = xalloc(P * sizeof(float));
    float *g_gpu = xalloc(P * sizeof(float));
    float *d_params = ps_model_alloc_params(mg), *d_grads = ps_model_alloc_params(mg);
    CHECK(d_params && d_grads);
    float *x;
    uint8_t *y;
    make_batch(&spec, 40, &x, &y);
    if (d_params && d_grads) {
      ps_model_params_to_device(mg, d_params, params);
      int cc = 0, cg = 0;
      const float lc = ps_model_train_step(mc, params, x, y, 16, 3, 1, g_cpu, &cc);
      const float lg = ps_model_train_step(mg, d_params, x, y, 16, 3, 1, d_grads, &cg);
      ps_model_params_to_host(mg, g_gpu, d_grads);
      printf("cpu vs %s: loss %.7f vs %.7f, correct %d vs %d\n", desc, (double)lc, (double)lg,
             cc, cg);
      CHECK_NEAR(lg, lc, 1e-7, 1e-5);
      CHECK(abs(cc - cg) <= 1);
      for (int i = 0; i < spec.n_layers; i++) {
        const ps_layer *L = &spec.layers[i];
        if (!L->w_count) continue;
        const double ew = rel_l2(g_gpu + L->w_off, g_cpu + L->w_off, L->w_count);
        const double eb = rel_l2(g_gpu + L->b_off, g_cpu + L->b_off, L->b_count);
        CHECK_MSG(ew <= 5e-2 && eb <= 5e-2, "%s: w %.3g, b %.3g", L->name, ew, eb);
      }
      const float ec = ps_model_evaluate(mc, params, x, y, 40, &cc);
      const float eg = ps_model_evaluate(mg, d_params, x, y, 40, &cg);
      CHECK_NEAR(eg, ec, 1e-7, 1e-5);
      CHECK(abs(cc - cg) <= 1);
    }
    ps_model_free_params(mg, d_params);
    ps_model_free_params(mg, d_grads);
    free(params), free(g_cpu), free(g_gpu), free(x), free(y);
  }
  ps_model_destroy(mc);
  ps_model_destroy(mg);
  /* The staged step with copies beside compute, against the plain step on
   * the device: bit for bit. */
  if (gpu) staged_case("conv, dropout, cuda, 3 pieces", &spec, 1, 3, gpu);
  if (cpu) cpu->destroy(cpu);
  if (gpu) gpu->destroy(gpu);
}

int main(void) {
  RUN(test_cpu_memory_members);
  RUN(test_gradient_conv);
  RUN(test_gradient_flatten_first);
  RUN(test_gradient_avgpool);
  RUN(test_gradient_residual);
  RUN(test_gradient_batchnorm);
  RUN(test_batchnorm_statistics);
  RUN(test_chain_spelled_out);
  RUN(test_evaluate_matches_train_step);
  RUN(test_dropout_replay);
  RUN(test_sgd_lowers_loss);
  RUN(test_synthetic_avgpool);
  RUN(test_device_path);
  RUN(test_staged_step);
  RUN(test_async_copies);
  RUN(test_out_of_memory);
  RUN(test_device_cpu);
  RUN(test_device_auto);
  RUN(test_device_cuda);
  RUN(test_device_malformed);
  RUN(test_cuda_against_cpu);
  return check_summary();
}

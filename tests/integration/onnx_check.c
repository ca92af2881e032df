/* ps-worker's own predictions, for comparison with an exported model (the
 * onnx_export case of run_tests.sh; tools/onnx_compare.py runs the ONNX
 * file in onnxruntime on the same examples).
 *
 *   onnx_check --job FILE (--checkpoints DIR | --params FILE) --out DIR
 *              [--data-dir DIR] [--limit N]
 *
 * Loads the job and its parameters (the newest usable checkpoint set, as
 * ps-export reads it, or a `ps-worker --save-params` file), runs the
 * model's forward pass without dropout on the cpu reference backend over
 * the job's test split, and writes DIR/input.npy (N, C, H, W),
 * DIR/labels.npy (N) and DIR/probs.npy (N, classes), float32. batchnorm
 * runs as at inference (batchnorm_forward_infer, the moving mean and
 * variance), what ONNX's BatchNormalization and Keras's predict compute;
 * a conv2d or dense without a bias adds zeros.
 *
 * The forward pass is the worker's layer by layer (worker/model/model.c's
 * forward_layer with training off) through the same ops table, since the
 * model does not hand out its probabilities; so that the two cannot drift
 * apart, the mean loss and the number of examples classified right are
 * then computed once more by ps_model_evaluate (what ps-worker reports as
 * its test accuracy) on the same batches, and must agree: the count
 * exactly, the loss within 1e-6 relative. Exit 0, or 1 with a message. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../../common/job.h"
#include "../../common/util.h"
#include "../../kernels/ops.h"
#include "ps/ckpt/checkpoint.h"
#include "worker/data/data.h"
#include "worker/model/model.h"

#define BATCH 128

typedef struct {
  const char *job, *ckpt_dir, *params_file, *out_dir, *data_dir;
  int limit;
} check_opts;

static int die(const char *what) {
  fprintf(stderr, "onnx_check: %s\n", what);
  return 1;
}

/* The P parameters of the job into params: from the checkpoint set or the
 * raw little-endian float32 file. */
static int load_params(const check_opts *o, const ps_job *job, float *params, char *err) {
  const size_t P = job->model.n_params;
  if (o->ckpt_dir) {
    ps_ckpt_source src = {.dir = o->ckpt_dir, .job_id = job->job_id, .P = P};
    ps_ckpt_restored got;
    int rc = ps_ckpt_load_range(&src, 0, P, params, NULL, 0, 0, &got, err);
    if (rc == 0) {
      free(got.cut);
      printf("onnx_check: parameters from the %d-shard checkpoints in %s (version %llu)\n",
             got.num_shards, o->ckpt_dir, (unsigned long long)got.version);
    }
    return rc;
  }
  char *bytes = NULL;
  size_t len = 0;
  int rc = ps_read_file(o->params_file, &bytes, &len, err);
  if (rc) return rc;
  if (len != P * sizeof(float))
    rc = ps_seterr(err, PS_EINVAL, "%s holds %zu bytes, the job's %zu parameters %zu",
                   o->params_file, len, P, P * sizeof(float));
  else
    memcpy(params, bytes, len);
  free(bytes);
  if (rc == 0) printf("onnx_check: parameters from %s\n", o->params_file);
  return rc;
}

/* The job's test split. */
static int load_test(const check_opts *o, const ps_job *job, ps_dataset *ds, char *err) {
  const ps_model_spec *s = &job->model;
  if (!strcmp(job->dataset, "synthetic")) {
    if (ps_dataset_synthetic(job->synthetic_test, s->in_c, s->in_h, s->in_w, s->classes, job->seed,
                             1, ds) != 0)
      return ps_seterr(err, PS_ENOMEM, "cannot make the synthetic test split");
    return 0;
  }
  return ps_dataset_load_named(job->dataset, o->data_dir ? o->data_dir : job->data_dir, 0, ds, err);
}

/* The forward pass on ops for up to BATCH examples: a buffer per layer
 * (worker/model/model.c's layout) and the convolutions' scratch space. */
typedef struct {
  ps_ops *ops;
  const ps_model_spec *spec;
  float **out;      /* per layer: (BATCH, out_c*out_h*out_w) */
  int32_t **argmax; /* per maxpool layer: as out */
  float *work;
  float *zeros; /* the bias of the layers without one: the kernels always add one */
} forward_pass;

static ps_conv_shape conv_shape(const ps_layer *L, int n) {
  ps_conv_shape cs = {.n = n,
                      .c = L->in_c,
                      .h = L->in_h,
                      .w = L->in_w,
                      .oc = L->filters,
                      .kh = L->kernel,
                      .kw = L->kernel,
                      .stride = L->stride,
                      .pad = L->pad};
  ps_conv_shape_finish(&cs);
  return cs;
}

static void forward_free(forward_pass *f) {
  for (int i = 0; i < f->spec->n_layers; i++) {
    if (f->out) ps_free(f->out[i]);
    if (f->argmax) ps_free(f->argmax[i]);
  }
  free(f->out);
  free(f->argmax);
  ps_free(f->work);
  ps_free(f->zeros);
}

/* 0, or -1 when out of memory (f freed). */
static int forward_init(forward_pass *f, ps_ops *ops, const ps_model_spec *spec) {
  *f = (forward_pass){.ops = ops, .spec = spec};
  f->out = calloc((size_t)spec->n_layers, sizeof *f->out);
  f->argmax = calloc((size_t)spec->n_layers, sizeof *f->argmax);
  int ok = f->out && f->argmax;
  size_t work = 1, zeros = 1;
  for (int i = 0; ok && i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    if (L->type == PS_LAYER_CONV2D && (size_t)L->filters > zeros) zeros = (size_t)L->filters;
    if (L->type == PS_LAYER_DENSE && (size_t)L->units > zeros) zeros = (size_t)L->units;
    const size_t n_out = (size_t)L->out_c * L->out_h * L->out_w * BATCH;
    ok = (f->out[i] = ps_alloc(n_out * sizeof(float))) != NULL;
    if (ok && L->type == PS_LAYER_MAXPOOL)
      ok = (f->argmax[i] = ps_alloc(n_out * sizeof(int32_t))) != NULL;
    if (L->type == PS_LAYER_CONV2D) {
      ps_conv_shape cs = conv_shape(L, BATCH);
      size_t ws = ops->conv2d_workspace(ops->ctx, &cs);
      if (ws > work) work = ws;
    }
  }
  if (ok) ok = (f->work = ps_alloc(work * sizeof(float))) != NULL;
  if (ok) ok = (f->zeros = ps_alloc(zeros * sizeof(float))) != NULL;
  if (ok) memset(f->zeros, 0, zeros * sizeof(float));
  if (!ok) forward_free(f);
  return ok ? 0 : -1;
}

/* Forward without dropout over n <= BATCH examples x into probs (n,
 * classes), layer by layer as worker/model/model.c runs it; returns the mean
 * loss over the labels y. */
static float forward_run(forward_pass *f, const float *params, const float *x, const uint8_t *y,
                         int n, float *probs) {
  ps_ops *ops = f->ops;
  const float *outs[PS_MAX_LAYERS]; /* each layer's output (flatten: its input's) */
  for (int i = 0; i < f->spec->n_layers; i++) {
    const ps_layer *L = &f->spec->layers[i];
    const size_t n_out = (size_t)L->out_c * L->out_h * L->out_w * (size_t)n;
    const float *in = L->inputs[0] < 0 ? x : outs[L->inputs[0]];
    float *out = f->out[i];
    outs[i] = out;
    const float *bias = L->b_count ? params + L->b_off : f->zeros;
    switch (L->type) {
      case PS_LAYER_CONV2D: {
        ps_conv_shape cs = conv_shape(L, n);
        ops->conv2d_forward(ops->ctx, &cs, in, params + L->w_off, bias, out, f->work);
        break;
      }
      case PS_LAYER_MAXPOOL: {
        ps_pool_shape ps = {.n = n,
                            .c = L->in_c,
                            .h = L->in_h,
                            .w = L->in_w,
                            .size = L->pool,
                            .stride = L->pool_stride};
        ps_pool_shape_finish(&ps);
        ops->maxpool_forward(ops->ctx, &ps, in, out, f->argmax[i]);
        break;
      }
      case PS_LAYER_AVGPOOL: {
        ps_pool_shape ps = {.n = n,
                            .c = L->in_c,
                            .h = L->in_h,
                            .w = L->in_w,
                            .size = L->pool,
                            .stride = L->pool_stride};
        ps_pool_shape_finish(&ps);
        ops->avgpool_forward(ops->ctx, &ps, in, out);
        break;
      }
      case PS_LAYER_GLOBAL_AVGPOOL:
        ops->global_avgpool_forward(ops->ctx, n, L->in_c, L->in_h, L->in_w, in, out);
        break;
      case PS_LAYER_DENSE:
        ops->dense_forward(ops->ctx, n, L->in_c * L->in_h * L->in_w, L->units, in,
                           params + L->w_off, bias, out);
        break;
      case PS_LAYER_BATCHNORM: {
        /* Channels of (C, H, W); after dense or flatten the features, each
         * its own channel (H = W = 1). */
        const float *moving = params + L->s_off;
        ops->batchnorm_forward_infer(ops->ctx, n, L->in_c, L->in_h * L->in_w, L->epsilon, in,
                                     params + L->w_off, params + L->b_off, moving,
                                     moving + L->in_c, out);
        break;
      }
      case PS_LAYER_RELU: ops->relu_forward(ops->ctx, n_out, in, out); break;
      case PS_LAYER_DROPOUT: ops->copy(ops->ctx, out, in, n_out * sizeof(float)); break;
      case PS_LAYER_ADD:
        ops->add(ops->ctx, n_out, in, L->inputs[1] < 0 ? x : outs[L->inputs[1]], out);
        for (int a = 2; a < L->n_inputs; a++)
          ops->add(ops->ctx, n_out, out, L->inputs[a] < 0 ? x : outs[L->inputs[a]], out);
        break;
      case PS_LAYER_FLATTEN: outs[i] = in; break; /* NCHW is already (N, C*H*W) */
      case PS_LAYER_SOFTMAX_XENT:
        return ops->softmax_xent_forward(ops->ctx, n, f->spec->classes, in, y, probs);
      case PS_LAYER_EMBEDDING:
      case PS_LAYER_CONCAT:
      case PS_LAYER_FM:
      case PS_LAYER_SIGMOID_XENT:
        return NAN; /* no ONNX form: ps-export refuses these models */
    }
  }
  return NAN; /* a spec always ends in softmax_xent */
}

/* probs (n, classes) of the n examples of ds, by forward_run; the loss and
 * the count classified right once more by ps_model_evaluate, which must
 * agree. 0, or 1 with a message. */
static int predict(forward_pass *f, ps_model *model, const float *params, const ps_dataset *ds,
                   int n, float *probs) {
  const int k = f->spec->classes;
  const size_t in_size = (size_t)ds->c * ds->h * ds->w;
  double loss_sum = 0.0, model_loss_sum = 0.0;
  int right = 0, model_right = 0;
  for (int start = 0; start < n; start += BATCH) {
    const int b = n - start < BATCH ? n - start : BATCH;
    const float *x = ds->images + (size_t)start * in_size;
    const uint8_t *y = ds->labels + start;
    float *p = probs + (size_t)start * k;
    loss_sum += (double)forward_run(f, params, x, y, b, p) * b;
    for (int i = 0; i < b; i++) {
      int best = 0;
      for (int j = 1; j < k; j++)
        if (p[(size_t)i * k + j] > p[(size_t)i * k + best]) best = j;
      right += best == y[i];
    }
    int c = 0;
    model_loss_sum += (double)ps_model_evaluate(model, params, x, y, b, &c) * b;
    model_right += c;
  }
  const double loss = loss_sum / n, model_loss = model_loss_sum / n;
  printf(
      "onnx_check: %d test examples: accuracy %.4f, mean loss %.6f; ps_model_evaluate: "
      "accuracy %.4f, mean loss %.6f\n",
      n, (double)right / n, loss, (double)model_right / n, model_loss);
  if (right != model_right || !(fabs(loss - model_loss) <= 1e-6 * fmax(1.0, fabs(model_loss))))
    return die("this forward pass and ps_model_evaluate disagree");
  return 0;
}

static int write_npy(const char *dir, const char *name, const float *data, const size_t *shape,
                     int ndim, char *err) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return ps_npy_write(path, data, shape, ndim, err);
}

static int parse_args(int argc, char **argv, check_opts *o) {
  static const struct option opts[] = {{"job", required_argument, 0, 'j'},
                                       {"checkpoints", required_argument, 0, 'c'},
                                       {"params", required_argument, 0, 'p'},
                                       {"out", required_argument, 0, 'o'},
                                       {"data-dir", required_argument, 0, 'd'},
                                       {"limit", required_argument, 0, 'l'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case 'j': o->job = optarg; break;
      case 'c': o->ckpt_dir = optarg; break;
      case 'p': o->params_file = optarg; break;
      case 'o': o->out_dir = optarg; break;
      case 'd': o->data_dir = optarg; break;
      case 'l': o->limit = atoi(optarg); break;
      default: return -1;
    }
  }
  if (!o->job || !o->out_dir || !o->ckpt_dir == !o->params_file || optind < argc) return -1;
  return 0;
}

/* input.npy, labels.npy and probs.npy of n examples of ds into dir. */
static int write_outputs(const char *dir, const ps_dataset *ds, int n, int k, const float *probs,
                         char *err) {
  float *labels = ps_alloc((size_t)n * sizeof(float));
  if (!labels) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (int i = 0; i < n; i++) labels[i] = ds->labels[i];
  mkdir(dir, 0777);
  const size_t in_shape[4] = {(size_t)n, (size_t)ds->c, (size_t)ds->h, (size_t)ds->w};
  const size_t p_shape[2] = {(size_t)n, (size_t)k}, y_shape[1] = {(size_t)n};
  int rc = write_npy(dir, "input.npy", ds->images, in_shape, 4, err);
  if (!rc) rc = write_npy(dir, "labels.npy", labels, y_shape, 1, err);
  if (!rc) rc = write_npy(dir, "probs.npy", probs, p_shape, 2, err);
  ps_free(labels);
  return rc;
}

int main(int argc, char **argv) {
  check_opts o = {0};
  if (parse_args(argc, argv, &o) != 0) {
    fprintf(stderr,
            "usage: onnx_check --job FILE (--checkpoints DIR | --params FILE) --out DIR "
            "[--data-dir DIR] [--limit N]\n");
    return 2;
  }
  ps_log_init("onnx_check", PS_LOG_WARN);
  char err[PS_ERRLEN] = "";
  ps_job *job = calloc(1, sizeof *job);
  if (!job) return die("out of memory");
  int rc = ps_job_load(o.job, job, NULL, err);
  const ps_model_spec *spec = &job->model;
  float *params = rc ? NULL : ps_alloc(spec->n_params * sizeof(float));
  if (!rc && !params) rc = ps_seterr(err, PS_ENOMEM, "out of memory");
  if (!rc) rc = load_params(&o, job, params, err);
  ps_dataset test = {0};
  if (!rc) rc = load_test(&o, job, &test, err);
  if (!rc && test.n == 0) rc = ps_seterr(err, PS_EINVAL, "the test split is empty");
  const int n = o.limit > 0 && o.limit < test.n ? o.limit : test.n;
  float *probs = rc ? NULL : ps_alloc((size_t)n * spec->classes * sizeof(float));
  if (!rc && !probs) rc = ps_seterr(err, PS_ENOMEM, "out of memory");
  ps_ops *ops = rc ? NULL : ps_ops_cpu_create(1);
  if (!rc && !ops) rc = ps_seterr(err, PS_ENOMEM, "cannot create the cpu backend");
  ps_model *model = rc ? NULL : ps_model_create(spec, ops, BATCH, err);
  if (!rc && !model) rc = PS_ENOMEM;
  forward_pass f;
  int have_f = !rc && forward_init(&f, ops, spec) == 0;
  if (!rc && !have_f) rc = ps_seterr(err, PS_ENOMEM, "out of memory");

  if (rc) rc = die(err);
  if (!rc) rc = predict(&f, model, params, &test, n, probs);
  if (!rc && write_outputs(o.out_dir, &test, n, spec->classes, probs, err)) rc = die(err);

  if (have_f) forward_free(&f);
  ps_model_destroy(model);
  if (ops) ops->destroy(ops);
  ps_free(probs);
  ps_dataset_free(&test);
  ps_free(params);
  free(job);
  return rc ? 1 : 0;
}

/* The model on a compute backend (see model.h).
 *
 * Every buffer the ops touch comes from ops->alloc, so the same code runs
 * on the cpu backend (host memory) and on cuda (device memory). The one
 * difference between the two is where the batch and the probabilities are:
 * on the cpu backend the ops read the caller's x and y and the model reads
 * its own probabilities in place, exactly as before the backends could
 * differ; elsewhere the batch is copied in (x_dev, y_dev) and the
 * probabilities out (probs_host) each step, k*n floats for the arg-max
 * count.
 *
 * A backend with softmax_xent_stats computes the loss and the arg-max
 * count where the probabilities are, and the step reads those two numbers
 * once, when it ends: nothing waits for the device in the middle of a step
 * and no probabilities are copied. */
#include "worker/model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/emb_plan.h"

/* Per-layer buffers. Every layer has its own output so that backward can
 * read what forward produced (relu reads its output, conv reads its
 * input, which is an earlier layer's output).
 *
 * Gradients. Most outputs are read by one layer, the next to run backward
 * after it (a chain): their gradients take turns in the two buffers grad_a
 * and grad_b, the consumer writing its dx into the one its dy is not in.
 * An output read by several layers (the start of a residual block), or by
 * one that runs backward earlier than next (the shortcut into an add),
 * has a gradient buffer of its own, grad_acc: the first consumer's
 * contribution is written there, the others' added to it. */
typedef struct {
  ps_conv_shape conv;
  ps_pool_shape pool;
  /* The layers whose buffers hold the inputs (-1: the batch): the spec's
   * inputs with flatten, which has no buffer, looked through. */
  int src[PS_MAX_LAYER_INPUTS];
  float *out;      /* (max_batch, out_c*out_h*out_w) */
  float *grad_acc; /* the output's own gradient buffer (see above), or NULL */
  int32_t *argmax; /* maxpool: same size as out */
  float *mask;     /* dropout: same size as out */
  float *bn;       /* batchnorm: the batch's mean, variance and invstd (3 x C) */
  /* fm with "sum": its dim components (max_batch, dim) and their gradient,
   * summed by a dense op with weights of ones (dim; fm_dw its unused
   * weight gradient): the ops of every backend, no kernel of its own */
  float *fm_parts, *fm_dparts, *fm_ones, *fm_dw;
  size_t in_size, out_size; /* per example */
  /* Parameters: the layer reads [p_lo, p_hi) of the flat vector (empty
   * when p_lo == p_hi), and needs [0, need) to have arrived in a staged
   * step (the most any layer up to this one reads). */
  size_t p_lo, p_hi, need;
  /* In backward: where the output's gradient is, once every consumer has
   * run, and how many have. */
  float *dy;
  int contributions;
  /* embedding: bags per example and ids per bag; the fixed offsets of
   * max_batch examples' bags; the step's plan and rows (set by
   * ps_model_set_rows; host memory) and, off a host-memory backend, their
   * copies (capacity: every position a distinct row). */
  int bags_per_ex, bag_size;
  int32_t *offsets;
  const ps_emb_plan *plan;
  const float *rows_host;
  float *drows_host;
  int32_t *idx_dev, *rev_off_dev, *rev_ex_dev;
  float *rows_dev, *drows_dev;
  /* ps_model_emb_plan's scratch (host): the bags' ids and their offsets */
  uint64_t *gather;
  int32_t *gather_off;
} layer_state;

struct ps_model {
  ps_model_spec spec;
  ps_ops *ops;
  int max_batch;
  size_t in_size;    /* floats per example */
  layer_state *ls;   /* buffers: backend memory */
  float *work;       /* conv scratch, the largest any conv layer needs */
  float *grad_a;     /* gradient ping-pong buffers, largest activation */
  float *grad_b;
  float *probs;      /* (max_batch, classes) */
  /* Layers without a bias: a zero bias to add, and where their bias
   * gradient goes (NULL when every layer has one). */
  float *zero_bias, *db_sink;
  /* A binary model (sigmoid_xent): the labels as floats, where the ops
   * read them (backend memory), and the host copy they come from. */
  int binary;
  float *labels_f, *labels_host;
  int n_emb;                /* embedding layers */
  int emb_layer[PS_MAX_LAYERS]; /* their indices, in layer order */
  /* Only when !ops->host_memory (else NULL): */
  float *x_dev;      /* (max_batch, in_size): the batch, copied in */
  uint8_t *y_dev;    /* (max_batch): its labels */
  float *probs_host; /* (max_batch, classes), host memory: probs copied out */
  double *stats;     /* ops->softmax_xent_stats: backend memory, 2 doubles */
  double *stats_host; /* where they are read to: ops->host_alloc's (pinned on a GPU) */
  /* ps_model_graph_step: the step recorded as the backend's graph, for n
   * examples from these parameters into these gradients; warm_*: the
   * shape of the last step run plainly (a recording follows one). */
  struct {
    int ready, off, n, warm_n;
    const float *params, *warm_params;
    float *grads;
  } graph;
  /* The staged step in progress (ps_model_step_*). */
  struct {
    const float *x;       /* the ops' copy of the batch */
    const uint8_t *y;     /* the ops' copy of the labels */
    const uint8_t *y_host;
    int n, next_layer, done;
    uint64_t seed, step;
    float loss;
    int correct;
    int pending; /* stats queued, not yet read */
  } st;
};

static size_t layer_size(int c, int h, int w) { return (size_t)c * h * w; }

static void *backend_alloc(ps_model *m, size_t bytes) { return m->ops->alloc(m->ops->ctx, bytes); }

static void backend_free(ps_model *m, void *p) {
  if (p) m->ops->free(m->ops->ctx, p);
}

/* Host memory the backend copies from and to fastest (page-locked on a
 * GPU). */
static void *host_alloc(ps_model *m, size_t bytes) {
  return m->ops->host_alloc ? m->ops->host_alloc(m->ops->ctx, bytes) : ps_alloc(bytes);
}

static void host_free(ps_model *m, void *p) {
  if (!p) return;
  if (m->ops->host_alloc && m->ops->host_free)
    m->ops->host_free(m->ops->ctx, p);
  else
    ps_free(p);
}

/* Embedding layer i's buffers: the bags' offsets for max_batch examples
 * (fixed: every example has bags_per_ex bags of bag_size ids), the
 * gather scratch, and off a host-memory backend the copies of a plan and
 * its rows. 0, or -1 when out of memory. */
static int emb_create(ps_model *m, int i) {
  const ps_layer *L = &m->spec.layers[i];
  layer_state *s = &m->ls[i];
  const int f = L->field_hi - L->field_lo;
  s->bags_per_ex = L->pooling == PS_POOL_NONE ? f : 1;
  s->bag_size = L->pooling == PS_POOL_NONE ? 1 : f;
  const size_t bags = (size_t)m->max_batch * s->bags_per_ex, pos = (size_t)m->max_batch * f;
  if (pos > INT32_MAX) return -1;
  m->emb_layer[m->n_emb++] = i;
  s->gather = malloc(pos * sizeof *s->gather);
  s->gather_off = malloc((bags + 1) * sizeof *s->gather_off);
  s->offsets = backend_alloc(m, (bags + 1) * sizeof(int32_t));
  if (!s->gather || !s->gather_off || !s->offsets) return -1;
  for (size_t b = 0; b <= bags; b++) s->gather_off[b] = (int32_t)(b * (size_t)s->bag_size);
  m->ops->to_device(m->ops->ctx, s->offsets, s->gather_off, (bags + 1) * sizeof(int32_t));
  m->ops->sync(m->ops->ctx);
  if (m->ops->host_memory) return 0;
  s->idx_dev = backend_alloc(m, pos * sizeof(int32_t));
  s->rev_off_dev = backend_alloc(m, (pos + 1) * sizeof(int32_t));
  s->rev_ex_dev = backend_alloc(m, pos * sizeof(int32_t));
  s->rows_dev = backend_alloc(m, pos * (size_t)L->emb_dim * sizeof(float));
  s->drows_dev = backend_alloc(m, pos * (size_t)L->emb_dim * sizeof(float));
  return s->idx_dev && s->rev_off_dev && s->rev_ex_dev && s->rows_dev && s->drows_dev ? 0 : -1;
}

/* The layer whose buffer holds layer j's output (-1: the batch): j, or for
 * flatten, which passes its input on as it is, what its input's is. */
static int buffer_layer(const ps_model_spec *spec, int j) {
  while (j >= 0 && spec->layers[j].type == PS_LAYER_FLATTEN) j = spec->layers[j].inputs[0];
  return j;
}

/* Which outputs need a gradient buffer of their own (see layer_state):
 * consumed by more than one input slot, or by a layer with another between
 * (flatten aside, which does nothing backward). Fills src too. 0, or -1
 * when out of memory. */
static int plan_gradients(ps_model *m) {
  const ps_model_spec *spec = &m->spec;
  int consumers[PS_MAX_LAYERS] = {0}, consumer[PS_MAX_LAYERS];
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    if (L->n_inputs == 0) m->ls[i].src[0] = -1; /* embedding: reads the ids */
    for (int a = 0; a < L->n_inputs; a++) {
      int j = m->ls[i].src[a] = buffer_layer(spec, L->inputs[a]);
      if (j < 0 || L->type == PS_LAYER_FLATTEN) continue;
      consumers[j]++;
      consumer[j] = i;
    }
  }
  for (int j = 0; j < spec->n_layers; j++) {
    if (consumers[j] == 0) continue;
    int own = consumers[j] > 1;
    for (int k = j + 1; !own && k < consumer[j]; k++)
      own = spec->layers[k].type != PS_LAYER_FLATTEN;
    if (!own) continue;
    m->ls[j].grad_acc = backend_alloc(m, m->ls[j].out_size * (size_t)m->max_batch * sizeof(float));
    if (!m->ls[j].grad_acc) return -1;
  }
  return 0;
}

ps_model *ps_model_create(const ps_model_spec *spec, ps_ops *ops, int max_batch, char *err) {
  ps_model *m = calloc(1, sizeof *m);
  if (!m) {
    ps_seterr(err, PS_ENOMEM, "out of memory creating the model");
    return NULL;
  }
  m->spec = *spec;
  m->ops = ops;
  m->max_batch = max_batch;
  m->in_size = layer_size(spec->in_c, spec->in_h, spec->in_w);
  m->ls = calloc((size_t)spec->n_layers, sizeof *m->ls);
  if (!m->ls) goto oom;
  size_t work = 0, largest = m->in_size, no_bias = 0;
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    layer_state *s = &m->ls[i];
    s->in_size = layer_size(L->in_c, L->in_h, L->in_w);
    s->out_size = layer_size(L->out_c, L->out_h, L->out_w);
    if (s->out_size > largest) largest = s->out_size;
    size_t n_out = s->out_size * (size_t)max_batch;
    if (L->type == PS_LAYER_CONV2D) {
      s->conv = (ps_conv_shape){.n = max_batch, .c = L->in_c, .h = L->in_h, .w = L->in_w,
                                .oc = L->filters, .kh = L->kernel, .kw = L->kernel,
                                .stride = L->stride, .pad = L->pad};
      ps_conv_shape_finish(&s->conv);
      size_t ws = ops->conv2d_workspace(ops->ctx, &s->conv);
      if (ws > work) work = ws;
    } else if (L->type == PS_LAYER_MAXPOOL || L->type == PS_LAYER_AVGPOOL) {
      s->pool = (ps_pool_shape){.n = max_batch, .c = L->in_c, .h = L->in_h, .w = L->in_w,
                                .size = L->pool, .stride = L->pool_stride};
      ps_pool_shape_finish(&s->pool);
      if (L->type == PS_LAYER_MAXPOOL && !(s->argmax = backend_alloc(m, n_out * sizeof(int32_t))))
        goto oom;
    } else if (L->type == PS_LAYER_DROPOUT) {
      s->mask = backend_alloc(m, n_out * sizeof(float));
      if (!s->mask) goto oom;
    } else if (L->type == PS_LAYER_BATCHNORM) {
      s->bn = backend_alloc(m, 3 * (size_t)L->in_c * sizeof(float));
      if (!s->bn) goto oom;
    } else if (L->type == PS_LAYER_EMBEDDING) {
      if (emb_create(m, i)) goto oom;
    } else if (L->type == PS_LAYER_FM && L->fm_sum) {
      const size_t d = (size_t)L->in_h;
      s->fm_parts = backend_alloc(m, d * (size_t)max_batch * sizeof(float));
      s->fm_dparts = backend_alloc(m, d * (size_t)max_batch * sizeof(float));
      s->fm_ones = backend_alloc(m, d * sizeof(float));
      s->fm_dw = backend_alloc(m, d * sizeof(float));
      float *ones = malloc(d * sizeof(float));
      if (!s->fm_parts || !s->fm_dparts || !s->fm_ones || !s->fm_dw || !ones) {
        free(ones);
        goto oom;
      }
      for (size_t k = 0; k < d; k++) ones[k] = 1.0f;
      ops->to_device(ops->ctx, s->fm_ones, ones, d * sizeof(float));
      free(ones);
      if (no_bias < 1) no_bias = 1; /* its dense op's zero bias and bias gradient */
    }
    if ((L->type == PS_LAYER_CONV2D || L->type == PS_LAYER_DENSE) && L->b_count == 0 &&
        (size_t)L->out_c > no_bias)
      no_bias = (size_t)L->out_c;
    if (L->type != PS_LAYER_FLATTEN && L->type != PS_LAYER_SOFTMAX_XENT &&
        L->type != PS_LAYER_SIGMOID_XENT) {
      s->out = backend_alloc(m, n_out * sizeof(float));
      if (!s->out) goto oom;
    }
    ps_layer_param_range(L, &s->p_lo, &s->p_hi);
    s->need = i > 0 && m->ls[i - 1].need > s->p_hi ? m->ls[i - 1].need : s->p_hi;
    if (s->p_hi > s->p_lo && i > 0 && s->p_lo < m->ls[i - 1].need) {
      ps_model_destroy(m);
      ps_seterr(err, PS_EINVAL, "layer %d's parameters start before an earlier layer's end", i);
      return NULL;
    }
  }
  if (plan_gradients(m)) goto oom;
  const size_t n_probs = (size_t)spec->classes * (size_t)max_batch;
  m->work = backend_alloc(m, (work ? work : 1) * sizeof(float));
  m->grad_a = backend_alloc(m, largest * (size_t)max_batch * sizeof(float));
  m->grad_b = backend_alloc(m, largest * (size_t)max_batch * sizeof(float));
  m->probs = backend_alloc(m, n_probs * sizeof(float));
  if (!m->work || !m->grad_a || !m->grad_b || !m->probs) goto oom;
  if (no_bias) {
    m->zero_bias = backend_alloc(m, no_bias * sizeof(float)); /* zeroed by alloc */
    m->db_sink = backend_alloc(m, no_bias * sizeof(float));
    if (!m->zero_bias || !m->db_sink) goto oom;
  }
  m->binary = spec->layers[spec->n_layers - 1].type == PS_LAYER_SIGMOID_XENT;
  const int stats = ops->softmax_xent_stats || m->binary;
  if (stats && !(m->stats = backend_alloc(m, 2 * sizeof(double)))) goto oom;
  if (m->binary) {
    m->labels_f = backend_alloc(m, (size_t)max_batch * sizeof(float));
    m->labels_host = ops->host_memory ? m->labels_f : host_alloc(m, (size_t)max_batch * sizeof(float));
    if (!m->labels_f || !m->labels_host) goto oom;
  }
  if (stats && !ops->host_memory) {
    m->stats_host = host_alloc(m, 2 * sizeof(double));
    if (!m->stats_host) goto oom;
  }
  if (!ops->host_memory) {
    m->x_dev = backend_alloc(m, m->in_size * (size_t)max_batch * sizeof(float));
    m->y_dev = backend_alloc(m, (size_t)max_batch);
    m->probs_host = ps_alloc(n_probs * sizeof(float));
    if (!m->x_dev || !m->y_dev || !m->probs_host) goto oom;
  }
  return m;
oom:
  ps_model_destroy(m);
  ps_seterr(err, PS_ENOMEM, "out of %s memory allocating activations for batch %d",
            ops->host_memory ? "host" : ops->name, max_batch);
  return NULL;
}

void ps_model_destroy(ps_model *m) {
  if (!m) return;
  if (m->labels_host != m->labels_f) host_free(m, m->labels_host);
  backend_free(m, m->labels_f);
  if (m->ls) {
    for (int i = 0; i < m->spec.n_layers; i++) {
      layer_state *s = &m->ls[i];
      backend_free(m, s->offsets);
      backend_free(m, s->idx_dev);
      backend_free(m, s->rev_off_dev);
      backend_free(m, s->rev_ex_dev);
      backend_free(m, s->rows_dev);
      backend_free(m, s->drows_dev);
      free(s->gather);
      free(s->gather_off);
      backend_free(m, m->ls[i].out);
      backend_free(m, m->ls[i].argmax);
      backend_free(m, m->ls[i].mask);
      backend_free(m, m->ls[i].bn);
      backend_free(m, m->ls[i].fm_parts);
      backend_free(m, m->ls[i].fm_dparts);
      backend_free(m, m->ls[i].fm_ones);
      backend_free(m, m->ls[i].fm_dw);
      backend_free(m, m->ls[i].grad_acc);
    }
    free(m->ls);
  }
  backend_free(m, m->work);
  backend_free(m, m->grad_a);
  backend_free(m, m->grad_b);
  backend_free(m, m->probs);
  backend_free(m, m->zero_bias);
  backend_free(m, m->db_sink);
  backend_free(m, m->stats);
  host_free(m, m->stats_host);
  backend_free(m, m->x_dev);
  backend_free(m, m->y_dev);
  ps_free(m->probs_host);
  free(m);
}

/* Input a of layer i: an earlier layer's output, or the batch x. */
static const float *layer_input(const ps_model *m, int i, int a, const float *x) {
  const int j = m->ls[i].src[a];
  return j < 0 ? x : m->ls[j].out;
}

/* The values per example of layer i's input a. */
static int input_width(const ps_model *m, int i, int a) {
  const int j = m->spec.layers[i].inputs[a];
  if (j < 0) return (int)m->in_size;
  const ps_layer *S = &m->spec.layers[j];
  return S->out_c * S->out_h * S->out_w;
}

/* Layer L's bias in params (a zero one when it has none), and where its
 * bias gradient goes in grads. */
static const float *bias_of(const ps_model *m, const ps_layer *L, const float *params) {
  return L->b_count ? params + L->b_off : m->zero_bias;
}

static float *bias_grad_of(const ps_model *m, const ps_layer *L, float *grads) {
  return L->b_count ? grads + L->b_off : m->db_sink;
}

/* A dropout layer that drops anything. */
static int has_dropout(const ps_model *m) {
  for (int i = 0; i < m->spec.n_layers; i++)
    if (m->spec.layers[i].type == PS_LAYER_DROPOUT && m->spec.layers[i].rate > 0.0f) return 1;
  return 0;
}

/* Runs layer i forward on n examples of the batch x (backend memory);
 * returns the layer's output (its input for flatten; NULL for the loss
 * layer, which the caller handles). training: dropout active with masks
 * from (seed, step, layer). */
static const float *forward_layer(ps_model *m, int i, const float *params, const float *x, int n,
                                  int training, uint64_t seed, uint64_t step) {
  ps_ops *o = m->ops;
  const ps_layer *L = &m->spec.layers[i];
  layer_state *s = &m->ls[i];
  size_t n_out = s->out_size * (size_t)n;
  const float *in = layer_input(m, i, 0, x);
  switch (L->type) {
    case PS_LAYER_CONV2D: {
      ps_conv_shape cs = s->conv;
      cs.n = n;
      o->conv2d_forward(o->ctx, &cs, in, params + L->w_off, bias_of(m, L, params), s->out,
                        m->work);
      return s->out;
    }
    case PS_LAYER_MAXPOOL: {
      ps_pool_shape ps = s->pool;
      ps.n = n;
      o->maxpool_forward(o->ctx, &ps, in, s->out, s->argmax);
      return s->out;
    }
    case PS_LAYER_AVGPOOL: {
      ps_pool_shape ps = s->pool;
      ps.n = n;
      o->avgpool_forward(o->ctx, &ps, in, s->out);
      return s->out;
    }
    case PS_LAYER_GLOBAL_AVGPOOL:
      o->global_avgpool_forward(o->ctx, n, L->in_c, L->in_h, L->in_w, in, s->out);
      return s->out;
    case PS_LAYER_DENSE:
      o->dense_forward(o->ctx, n, (int)s->in_size, L->units, in, params + L->w_off,
                       bias_of(m, L, params), s->out);
      return s->out;
    case PS_LAYER_BATCHNORM: {
      const int c = L->in_c, hw = L->in_h * L->in_w;
      /* Training: the batch's statistics (kept for backward, and pushed);
       * otherwise the moving ones from the parameters. */
      if (training)
        o->batchnorm_forward_train(o->ctx, n, c, hw, L->epsilon, in, params + L->w_off,
                                   params + L->b_off, s->out, s->bn, s->bn + c, s->bn + 2 * c);
      else
        o->batchnorm_forward_infer(o->ctx, n, c, hw, L->epsilon, in, params + L->w_off,
                                   params + L->b_off, params + L->s_off, params + L->s_off + c,
                                   s->out);
      return s->out;
    }
    case PS_LAYER_RELU:
      o->relu_forward(o->ctx, n_out, in, s->out);
      return s->out;
    case PS_LAYER_DROPOUT:
      if (training && L->rate > 0.0f) {
        /* One stream per (step, layer): a step can be replayed exactly. A
         * backend that keeps the step's base on its device (set at the
         * step's beginning) adds it when the op runs, so that a recorded
         * step replays with each step's own masks. */
        const uint64_t stream = o->set_rng_step ? (uint64_t)i : step * PS_MAX_LAYERS + (uint64_t)i;
        o->dropout_forward(o->ctx, n_out, L->rate, seed, stream, in, s->out, s->mask);
      } else {
        o->copy(o->ctx, s->out, in, n_out * sizeof(float));
      }
      return s->out;
    case PS_LAYER_ADD:
      o->add(o->ctx, n_out, in, layer_input(m, i, 1, x), s->out);
      for (int a = 2; a < L->n_inputs; a++)
        o->add(o->ctx, n_out, s->out, layer_input(m, i, a, x), s->out);
      return s->out;
    case PS_LAYER_EMBEDDING: {
      /* The plan's rows, gathered and pooled per bag. */
      const int mean = L->pooling == PS_POOL_MEAN;
      o->embedding_bag_forward(o->ctx, n * s->bags_per_ex, L->emb_dim, s->offsets,
                               o->host_memory ? s->plan->idx : s->idx_dev, mean,
                               o->host_memory ? s->rows_host : s->rows_dev, s->out);
      return s->out;
    }
    case PS_LAYER_CONCAT: {
      int col = 0;
      for (int a = 0; a < L->n_inputs; a++) {
        const int width = input_width(m, i, a);
        o->copy_cols(o->ctx, n, width, layer_input(m, i, a, x), width, s->out + col,
                     (int)s->out_size);
        col += width;
      }
      return s->out;
    }
    case PS_LAYER_FM:
      if (L->fm_sum) {
        o->fm_forward(o->ctx, n, L->in_c, L->in_h, in, s->fm_parts);
        o->dense_forward(o->ctx, n, L->in_h, 1, s->fm_parts, s->fm_ones, m->zero_bias, s->out);
      } else {
        o->fm_forward(o->ctx, n, L->in_c, L->in_h, in, s->out);
      }
      return s->out;
    case PS_LAYER_FLATTEN:
      return in; /* NCHW is already (N, C*H*W) in memory */
    case PS_LAYER_SOFTMAX_XENT:
    case PS_LAYER_SIGMOID_XENT:
      return NULL;
  }
  return in;
}

/* The loss layer's input: the logits, once forward has run. */
static const float *logits_of(const ps_model *m, const float *x) {
  return layer_input(m, m->spec.n_layers - 1, 0, x);
}

/* Runs the layers before the loss on n examples x (backend memory);
 * returns the logits. */
static const float *forward(ps_model *m, const float *params, const float *x, int n,
                            int training, uint64_t seed, uint64_t step) {
  for (int i = 0; i < m->spec.n_layers; i++)
    if (!forward_layer(m, i, params, x, n, training, seed, step)) break;
  return logits_of(m, x);
}

static void labels_in(ps_model *m, const uint8_t *y, int n, int async);

/* The batch x, y (host memory) where the ops can read it: in place on a
 * host-memory backend, else copied into the model's buffers (n <= max_batch
 * examples). */
static void batch_in(ps_model *m, const float *x, const uint8_t *y, int n, const float **x_ops,
                     const uint8_t **y_ops) {
  ps_ops *o = m->ops;
  labels_in(m, y, n, 0);
  if (o->host_memory) {
    *x_ops = x;
    *y_ops = y;
    return;
  }
  o->to_device(o->ctx, m->x_dev, x, m->in_size * (size_t)n * sizeof(float));
  o->to_device(o->ctx, m->y_dev, y, (size_t)n);
  *x_ops = m->x_dev;
  *y_ops = m->y_dev;
}

/* A binary model's labels as floats where the ops read them (async: on
 * the copy queue, as ps_model_step_begin's copies). */
static void labels_in(ps_model *m, const uint8_t *y, int n, int async) {
  if (!m->binary) return;
  for (int i = 0; i < n; i++) m->labels_host[i] = y[i] ? 1.0f : 0.0f;
  ps_ops *o = m->ops;
  if (o->host_memory) return;
  if (async)
    o->to_device_async(o->ctx, m->labels_f, m->labels_host, (size_t)n * sizeof(float));
  else
    o->to_device(o->ctx, m->labels_f, m->labels_host, (size_t)n * sizeof(float));
}

/* The rows and plans of the embedding layers where the ops read them: off
 * a host-memory backend, copied (n examples). */
static void emb_in(ps_model *m) {
  ps_ops *o = m->ops;
  if (o->host_memory) return;
  for (int k = 0; k < m->n_emb; k++) {
    const int i = m->emb_layer[k];
    layer_state *s = &m->ls[i];
    const ps_emb_plan *p = s->plan;
    const size_t dim = (size_t)m->spec.layers[i].emb_dim;
    o->to_device(o->ctx, s->idx_dev, p->idx, (size_t)p->total * sizeof(int32_t));
    o->to_device(o->ctx, s->rev_off_dev, p->rev_off, ((size_t)p->u + 1) * sizeof(int32_t));
    o->to_device(o->ctx, s->rev_ex_dev, p->rev_ex, (size_t)p->total * sizeof(int32_t));
    o->to_device(o->ctx, s->rows_dev, s->rows_host, (size_t)p->u * dim * sizeof(float));
  }
}

/* The probabilities of the last n examples, readable on the host. */
static const float *probs_out(ps_model *m, int n) {
  ps_ops *o = m->ops;
  if (o->host_memory) return m->probs;
  o->to_host(o->ctx, m->probs_host, m->probs, (size_t)m->spec.classes * (size_t)n * sizeof(float));
  o->sync(o->ctx);
  return m->probs_host;
}

/* y is host memory. */
static int count_correct(const float *probs, const uint8_t *y, int n, int k) {
  int correct = 0;
  for (int i = 0; i < n; i++) {
    const float *p = probs + (size_t)i * k;
    int best = 0;
    for (int j = 1; j < k; j++)
      if (p[j] > p[best]) best = j;
    correct += best == y[i];
  }
  return correct;
}

/* The loss and arg-max count of n examples that softmax_xent_stats queued:
 * waits for the backend. */
static float stats_read(ps_model *m, int n, int *correct) {
  ps_ops *o = m->ops;
  double s[2];
  if (o->host_memory) {
    memcpy(s, m->stats, sizeof s);
  } else {
    o->to_host(o->ctx, m->stats_host, m->stats, sizeof s);
    o->sync(o->ctx);
    memcpy(s, m->stats_host, sizeof s);
  }
  *correct = (int)s[1];
  return n > 0 ? (float)(s[0] / n) : 0.0f;
}

/* The step's loss and count, once (the first caller that needs them). */
static void step_stats(ps_model *m) {
  if (!m->st.pending) return;
  m->st.loss = stats_read(m, m->st.n, &m->st.correct);
  m->st.pending = 0;
}

void ps_model_step_begin(ps_model *m, const float *x, const uint8_t *y, int n, uint64_t seed,
                         uint64_t step) {
  memset(&m->st, 0, sizeof m->st);
  m->st.y_host = y;
  m->st.n = n;
  m->st.seed = seed;
  m->st.step = step;
  ps_ops *o = m->ops;
  if (o->set_rng_step && has_dropout(m)) o->set_rng_step(o->ctx, step * PS_MAX_LAYERS);
  emb_in(m);
  if (o->host_memory) {
    batch_in(m, x, y, n, &m->st.x, &m->st.y);
  } else {
    labels_in(m, y, n, 1);
    /* On the copy queue: the previous step has been waited for, so no op
     * still reads x_dev or y_dev, and the ops below wait for these copies
     * only. From a batcher slot in ops->host_alloc's memory (page-locked
     * on a GPU) they need no staging. */
    o->to_device_async(o->ctx, m->x_dev, x, m->in_size * (size_t)n * sizeof(float));
    o->to_device_async(o->ctx, m->y_dev, y, (size_t)n);
    m->st.x = m->x_dev;
    m->st.y = m->y_dev;
  }
}

void ps_model_step_forward(ps_model *m, const float *params, size_t avail) {
  if (m->st.done) return;
  ps_ops *o = m->ops;
  for (; m->st.next_layer < m->spec.n_layers; m->st.next_layer++) {
    int i = m->st.next_layer;
    if (m->ls[i].need > avail) return; /* its parameters have not all arrived */
    if (!forward_layer(m, i, params, m->st.x, m->st.n, 1, m->st.seed, m->st.step)) break;
  }
  const float *logits = logits_of(m, m->st.x);
  if (m->binary) {
    o->sigmoid_xent_forward(o->ctx, m->st.n, logits, m->labels_f, m->probs, m->stats);
    m->st.pending = 1;
  } else if (o->softmax_xent_stats) {
    o->softmax_xent_stats(o->ctx, m->st.n, m->spec.classes, logits, m->st.y, m->probs, m->stats);
    m->st.pending = 1;
  } else {
    m->st.loss =
        o->softmax_xent_forward(o->ctx, m->st.n, m->spec.classes, logits, m->st.y, m->probs);
  }
  m->st.done = 1;
}

static void backward_pass(ps_model *m, const float *params, float *grads,
                          void (*ready)(void *user, size_t lo), void *user);

int ps_model_graph_able(const ps_model *m, char *why, size_t why_len) {
  const ps_ops *o = m->ops;
  const char *no = NULL;
  if (!o->graph_begin || !o->graph_end || !o->graph_launch)
    no = "the backend has no graphs";
  else if (!o->softmax_xent_stats && !m->binary)
    no = "the backend reads the loss back inside the step";
  else if (m->n_emb)
    no = "the embedding rows differ in number every step";
  if (!no && has_dropout(m) && !o->set_rng_step)
    no = "dropout draws new masks every step, and the backend cannot replay them";
  if (why && why_len) snprintf(why, why_len, "%s", no ? no : "");
  return no == NULL;
}

int ps_model_graph_step(ps_model *m, const float *params, float *grads, void (*between)(void *),
                        void *user) {
  ps_ops *o = m->ops;
  if (m->graph.off || m->st.done || m->st.next_layer != 0) return 0;
  if (!ps_model_graph_able(m, NULL, 0)) {
    m->graph.off = 1;
    return 0;
  }
  const int n = m->st.n;
  if (m->graph.ready) {
    /* A different batch size (an epoch's last batch) runs plainly and
     * keeps the recording for the next full one. */
    if (n != m->graph.n || params != m->graph.params || grads != m->graph.grads) return 0;
    if (o->graph_launch(o->ctx) != 0) {
      m->graph.off = 1;
      return 0;
    }
  } else {
    /* The first step of a shape runs plainly: the backend makes its plans
     * and buffers then, and nothing is allocated while recording. */
    if (n != m->graph.warm_n || params != m->graph.warm_params) {
      m->graph.warm_n = n;
      m->graph.warm_params = params;
      return 0;
    }
    if (o->graph_begin(o->ctx) != 0) {
      m->graph.off = 1;
      return 0;
    }
    ps_model_step_forward(m, params, m->spec.n_params);
    if (between) between(user);
    backward_pass(m, params, grads, NULL, NULL);
    if (o->graph_end(o->ctx) != 0 || o->graph_launch(o->ctx) != 0) {
      /* Nothing ran: the step starts again, plainly, and stays so. */
      PS_WARN("cuda graphs: the step could not be recorded; it runs op by op");
      m->graph.off = 1;
      m->st.done = m->st.pending = 0;
      m->st.next_layer = 0;
      return 0;
    }
    m->graph.ready = 1;
    m->graph.n = n;
    m->graph.params = params;
    m->graph.grads = grads;
    PS_INFO("cuda graphs: the step of %d examples is recorded once and replayed", n);
  }
  m->st.done = 1;
  m->st.pending = 1; /* the graph wrote the loss and count into stats */
  m->st.next_layer = m->spec.n_layers;
  return 1;
}

float ps_model_step_loss(ps_model *m) {
  if (!m->st.done) return NAN;
  step_stats(m);
  return m->st.loss;
}

/* Where layer i's dx for input a goes, with dy (NULL for the loss layer)
 * where layer i's gradient is: NULL when no gradient is wanted (the
 * batch); the input's own buffer for its first contribution; else the
 * ping-pong buffer dy is not in, which then holds the input's gradient
 * (one consumer) or a later contribution that contribution_done adds. */
static float *contribution_target(ps_model *m, int i, int a, const float *dy) {
  const int j = m->ls[i].src[a];
  if (j < 0) return NULL;
  layer_state *t = &m->ls[j];
  if (t->grad_acc && t->contributions == 0) return t->grad_acc;
  return dy == m->grad_a ? m->grad_b : m->grad_a;
}

/* The dx written at dst (contribution_target's) is in: recorded as the
 * input's gradient, or added to its own buffer. */
static void contribution_done(ps_model *m, int i, int a, float *dst) {
  const int j = m->ls[i].src[a];
  if (j < 0) return;
  layer_state *t = &m->ls[j];
  if (t->grad_acc && dst != t->grad_acc) {
    ps_ops *o = m->ops;
    o->add(o->ctx, t->out_size * (size_t)m->st.n, t->grad_acc, dst, t->grad_acc);
  }
  t->dy = t->grad_acc ? t->grad_acc : dst;
  t->contributions++;
}

/* add's backward: its gradient dy is each input's contribution as it is. */
static void add_backward(ps_model *m, int i, float *dy) {
  ps_ops *o = m->ops;
  for (int a = 0; a < m->spec.layers[i].n_inputs; a++) {
    const int j = m->ls[i].src[a];
    if (j < 0) continue;
    layer_state *t = &m->ls[j];
    if (t->grad_acc && t->contributions == 0)
      o->copy(o->ctx, t->grad_acc, dy, t->out_size * (size_t)m->st.n * sizeof(float));
    else if (t->grad_acc)
      o->add(o->ctx, t->out_size * (size_t)m->st.n, t->grad_acc, dy, t->grad_acc);
    t->dy = t->grad_acc ? t->grad_acc : dy;
    t->contributions++;
  }
}

/* The backward pass of the step whose forward has run: queued, nothing
 * read back. The layers run in reverse list order, so every consumer of
 * an output has run before its producer. */
static void backward_pass(ps_model *m, const float *params, float *grads,
                          void (*ready)(void *user, size_t lo), void *user) {
  ps_ops *o = m->ops;
  const int k = m->spec.classes, n = m->st.n, last = m->spec.n_layers - 1;
  const float *x = m->st.x;
  const uint8_t *y = m->st.y;
  for (int i = 0; i <= last; i++) {
    m->ls[i].dy = NULL;
    m->ls[i].contributions = 0;
  }
  float *dlogits = contribution_target(m, last, 0, NULL);
  if (m->binary)
    o->sigmoid_xent_backward(o->ctx, n, m->probs, m->labels_f, dlogits);
  else
    o->softmax_xent_backward(o->ctx, n, k, m->probs, y, dlogits);
  contribution_done(m, last, 0, dlogits);
  size_t lo = m->spec.n_params; /* grads[lo, P) are written */
  for (int i = last - 1; i >= 0; i--) {
    const ps_layer *L = &m->spec.layers[i];
    layer_state *s = &m->ls[i];
    if (L->type == PS_LAYER_FLATTEN) continue;
    float *dy = s->dy;
    if (L->type == PS_LAYER_ADD) {
      add_backward(m, i, dy);
      continue;
    }
    if (L->type == PS_LAYER_CONCAT) {
      int col = 0;
      for (int a = 0; a < L->n_inputs; a++) {
        const int width = input_width(m, i, a);
        float *dxa = contribution_target(m, i, a, dy);
        if (dxa) {
          o->copy_cols(o->ctx, n, width, dy + col, (int)s->out_size, dxa, width);
          contribution_done(m, i, a, dxa);
        }
        col += width;
      }
      continue;
    }
    if (L->type == PS_LAYER_EMBEDDING) {
      /* The rows' gradients, for the push (host memory once the step has
       * been waited for). */
      const ps_emb_plan *p = s->plan;
      const int mean = L->pooling == PS_POOL_MEAN;
      float *drows = o->host_memory ? s->drows_host : s->drows_dev;
      o->embedding_bag_backward(o->ctx, n * s->bags_per_ex, L->emb_dim, s->offsets, p->u,
                                o->host_memory ? p->rev_off : s->rev_off_dev,
                                o->host_memory ? p->rev_ex : s->rev_ex_dev, mean, dy, drows);
      if (!o->host_memory)
        o->to_host(o->ctx, s->drows_host, s->drows_dev,
                   (size_t)p->u * (size_t)L->emb_dim * sizeof(float));
      continue;
    }
    const float *in = layer_input(m, i, 0, x);
    float *dxp = contribution_target(m, i, 0, dy);
    size_t n_out = s->out_size * (size_t)n;
    switch (L->type) {
      case PS_LAYER_CONV2D: {
        ps_conv_shape cs = s->conv;
        cs.n = n;
        o->conv2d_backward(o->ctx, &cs, in, params + L->w_off, dy, dxp, grads + L->w_off,
                           bias_grad_of(m, L, grads), m->work);
        break;
      }
      case PS_LAYER_MAXPOOL: {
        ps_pool_shape ps = s->pool;
        ps.n = n;
        if (dxp) o->maxpool_backward(o->ctx, &ps, dy, s->argmax, dxp);
        break;
      }
      case PS_LAYER_AVGPOOL: {
        ps_pool_shape ps = s->pool;
        ps.n = n;
        if (dxp) o->avgpool_backward(o->ctx, &ps, dy, dxp);
        break;
      }
      case PS_LAYER_GLOBAL_AVGPOOL:
        if (dxp) o->global_avgpool_backward(o->ctx, n, L->in_c, L->in_h, L->in_w, dy, dxp);
        break;
      case PS_LAYER_DENSE:
        o->dense_backward(o->ctx, n, (int)s->in_size, L->units, in, params + L->w_off, dy, dxp,
                          grads + L->w_off, bias_grad_of(m, L, grads));
        break;
      case PS_LAYER_BATCHNORM: {
        const int c = L->in_c, hw = L->in_h * L->in_w;
        o->batchnorm_backward(o->ctx, n, c, hw, in, dy, params + L->w_off, s->bn, s->bn + 2 * c,
                              dxp, grads + L->w_off, grads + L->b_off);
        /* The moving statistics' places carry the batch's mean and
         * variance, which the shard averages in (ps_model_moving_ranges). */
        o->copy(o->ctx, grads + L->s_off, s->bn, 2 * (size_t)c * sizeof(float));
        break;
      }
      case PS_LAYER_RELU:
        if (dxp) o->relu_backward(o->ctx, n_out, s->out, dy, dxp);
        break;
      case PS_LAYER_FM:
        if (dxp && L->fm_sum) {
          /* Each component's gradient is the sum's. */
          o->dense_backward(o->ctx, n, L->in_h, 1, s->fm_parts, s->fm_ones, dy, s->fm_dparts,
                            s->fm_dw, m->db_sink);
          o->fm_backward(o->ctx, n, L->in_c, L->in_h, in, s->fm_dparts, dxp);
        } else if (dxp) {
          o->fm_backward(o->ctx, n, L->in_c, L->in_h, in, dy, dxp);
        }
        break;
      case PS_LAYER_DROPOUT:
        if (dxp) {
          if (L->rate > 0.0f)
            o->dropout_backward(o->ctx, n_out, s->mask, dy, dxp);
          else
            o->copy(o->ctx, dxp, dy, n_out * sizeof(float));
        }
        break;
      default:
        break;
    }
    contribution_done(m, i, 0, dxp);
    if (s->p_hi > s->p_lo && s->p_lo < lo) {
      lo = s->p_lo;
      /* The layers' parameters are laid out in layer order (checked at
       * creation), so everything from here up is written. */
      if (ready && lo > 0) ready(user, lo);
    }
  }
  if (ready) ready(user, 0);
}

float ps_model_step_backward(ps_model *m, const float *params, float *grads,
                             void (*ready)(void *user, size_t lo), void *user, int *correct) {
  ps_model_step_forward(m, params, m->spec.n_params); /* whatever has not run yet */
  backward_pass(m, params, grads, ready, user);
  /* The loss and the arg-max count are read back after the whole backward
   * pass is queued, so the device is not left idle meanwhile. */
  if (correct) *correct = ps_model_step_correct(m);
  step_stats(m);
  return m->st.loss;
}

int ps_model_step_correct(ps_model *m) {
  if (!m->st.done) return 0;
  if (m->ops->softmax_xent_stats || m->binary) {
    step_stats(m);
    return m->st.correct;
  }
  return count_correct(probs_out(m, m->st.n), m->st.y_host, m->st.n, m->spec.classes);
}

float ps_model_train_step(ps_model *m, const float *params, const float *x, const uint8_t *y,
                          int n, uint64_t seed, uint64_t step, float *grads, int *correct) {
  ps_model_step_begin(m, x, y, n, seed, step);
  ps_model_step_forward(m, params, m->spec.n_params);
  return ps_model_step_backward(m, params, grads, NULL, NULL, correct);
}

float ps_model_evaluate(ps_model *m, const float *params, const float *x, const uint8_t *y,
                        int n, int *correct) {
  return ps_model_evaluate_probs(m, params, x, y, n, correct, NULL);
}

float ps_model_evaluate_probs(ps_model *m, const float *params, const float *x, const uint8_t *y,
                              int n, int *correct, float *probs) {
  ps_ops *o = m->ops;
  const int k = m->spec.classes;
  double loss_sum = 0.0;
  int right = 0;
  if (m->n_emb && n > m->max_batch) n = m->max_batch; /* the rows set are for these */
  emb_in(m);
  for (int start = 0; start < n; start += m->max_batch) {
    int b = n - start < m->max_batch ? n - start : m->max_batch;
    const float *xb;
    const uint8_t *yb;
    batch_in(m, x + (size_t)start * m->in_size, y + start, b, &xb, &yb);
    const float *logits = forward(m, params, xb, b, 0, 0, 0);
    if (m->binary) {
      o->sigmoid_xent_forward(o->ctx, b, logits, m->labels_f, m->probs, m->stats);
      int c;
      loss_sum += (double)stats_read(m, b, &c) * b;
      right += c;
    }
    if (probs) {
      const size_t bytes = (size_t)k * (size_t)b * sizeof(float);
      if (o->host_memory) {
        memcpy(probs + (size_t)start * k, m->probs, bytes);
      } else {
        o->to_host(o->ctx, probs + (size_t)start * k, m->probs, bytes);
        o->sync(o->ctx);
      }
    }
    if (m->binary) continue;
    if (o->softmax_xent_stats) {
      o->softmax_xent_stats(o->ctx, b, k, logits, yb, m->probs, m->stats);
      int c;
      loss_sum += (double)stats_read(m, b, &c) * b;
      right += c;
      continue;
    }
    loss_sum += (double)o->softmax_xent_forward(o->ctx, b, k, logits, yb, m->probs) * b;
    if (correct) right += count_correct(probs_out(m, b), y + start, b, k);
  }
  if (correct) *correct = right;
  return n > 0 ? (float)(loss_sum / n) : 0.0f;
}

float *ps_model_alloc_params(ps_model *m) {
  return backend_alloc(m, m->spec.n_params * sizeof(float));
}

void ps_model_free_params(ps_model *m, float *p) { backend_free(m, p); }

void ps_model_params_to_device(ps_model *m, float *dst, const float *src_host) {
  ps_ops *o = m->ops;
  o->to_device(o->ctx, dst, src_host, m->spec.n_params * sizeof(float));
  o->sync(o->ctx);
}

void ps_model_params_to_host(ps_model *m, float *dst_host, const float *src) {
  ps_ops *o = m->ops;
  o->to_host(o->ctx, dst_host, src, m->spec.n_params * sizeof(float));
  o->sync(o->ctx);
}

ps_ops *ps_model_ops(const ps_model *m) { return m->ops; }

int ps_model_n_embeddings(const ps_model *m) { return m->n_emb; }

const ps_layer *ps_model_embedding(const ps_model *m, int k) {
  return k >= 0 && k < m->n_emb ? &m->spec.layers[m->emb_layer[k]] : NULL;
}

int ps_model_emb_plan(ps_model *m, int k, const uint64_t *ids, int n, uint64_t rows,
                      ps_emb_plan *plan, char *err) {
  if (k < 0 || k >= m->n_emb || n < 0 || n > m->max_batch)
    return ps_seterr(err, PS_EINVAL, "embedding plan: layer %d of %d, %d examples (at most %d)", k,
                     m->n_emb, n, m->max_batch);
  const ps_layer *L = &m->spec.layers[m->emb_layer[k]];
  layer_state *s = &m->ls[m->emb_layer[k]];
  const int f = L->field_hi - L->field_lo, n_ids = m->spec.n_ids;
  uint64_t *g = s->gather;
  for (int e = 0; e < n; e++) {
    const uint64_t *src = ids + (size_t)e * n_ids + L->field_lo;
    if (rows)
      for (int j = 0; j < f; j++) *g++ = src[j] % rows;
    else
      for (int j = 0; j < f; j++) *g++ = src[j];
  }
  return ps_emb_plan_build(plan, s->gather, s->gather_off, n * s->bags_per_ex, err);
}

void ps_model_set_rows(ps_model *m, int k, const ps_emb_plan *plan, const float *rows,
                       float *drows) {
  if (k < 0 || k >= m->n_emb) return;
  layer_state *s = &m->ls[m->emb_layer[k]];
  s->plan = plan;
  s->rows_host = rows;
  s->drows_host = drows;
}

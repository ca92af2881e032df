/* The model as an ONNX file (see export_onnx.h).
 *
 * Each layer type has an emit function in emitters[]: it appends the
 * layer's nodes and initializers to the graph, reading the graph's current
 * tensor (set to the layer's first input before the call) and moving it on
 * to the layer's output, which is recorded per layer so that a later layer
 * (an add, a branch) can read any earlier output. A layer type without a
 * row is refused by name before anything is written; a new layer type
 * is one emit function and one row.
 *
 * The messages are built in an arena freed at once; initializers point at
 * the caller's parameters (raw_data is little-endian float32, which is this
 * host's layout: util.h refuses big-endian hosts), so nothing is copied
 * until the model is packed, straight into the file through a buffer. */
#include "tools/export/export_onnx.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_file.h"
#include "common/util.h"
#include "proto/onnx.pb-c.h"

#define ONNX_IR_VERSION 7 /* the IR version of operator set 13 */
#define ONNX_OPSET 13
#define ONNX_PRODUCER "ps"
#define ONNX_INPUT "input"
#define ONNX_OUTPUT "probabilities"
#define ONNX_BATCH "N" /* the symbolic batch dimension */
/* The most nodes, initializers and attributes one layer may add: its own
 * node and a reshaping node before it, each with an initializer or two;
 * batchnorm's node has four (scale, bias, mean, variance). */
#define ONNX_NODES_PER_LAYER 2
#define ONNX_INITS_PER_LAYER 4
/* add: an Unsqueeze (and its axes) per input, and one Add fewer than the
 * inputs. */
#define ONNX_NODES_PER_ADD (2 * PS_MAX_LAYER_INPUTS - 1)
#define ONNX_INITS_PER_ADD PS_MAX_LAYER_INPUTS
#define ONNX_ATTRS_PER_NODE 4
/* protobuf's limit on a message; past it a model needs ONNX's external
 * data, which this exporter does not write. */
#define ONNX_MAX_BYTES ((size_t)INT32_MAX)

/* ---------------------------------------------------------------- arena */

typedef struct arena_block {
  struct arena_block *next;
  size_t used, cap;
  max_align_t data[];
} arena_block;

/* The graph being built: nodes and initializers in order, the tensor the
 * next layer reads and its rank, and the arena every message lives in. */
typedef struct {
  arena_block *blocks;
  int oom;
  int full; /* an emit function added more than the per-layer room (a bug) */
  Onnx__NodeProto **nodes;
  size_t n_nodes, cap_nodes;
  Onnx__TensorProto **inits;
  size_t n_inits, cap_inits;
  const ps_model_spec *spec;
  const float *params;
  const char *cur; /* the tensor the next layer reads */
  int rank;        /* its rank: 4 (N, C, H, W) or 2 (N, features) */
  /* Each layer's output tensor and its rank, once emitted. */
  const char *out[PS_MAX_LAYERS];
  int out_rank[PS_MAX_LAYERS];
} onnx_graph;

/* bytes of zeroed memory that lives as long as the graph; NULL (and
 * g->oom set) when out of memory. */
static void *g_alloc(onnx_graph *g, size_t bytes) {
  const size_t align = sizeof(max_align_t);
  if (bytes > SIZE_MAX - align) {
    g->oom = 1;
    return NULL;
  }
  bytes = (bytes + align - 1) / align * align;
  arena_block *b = g->blocks;
  if (!b || b->cap - b->used < bytes) {
    size_t cap = bytes > 16384 ? bytes : 16384;
    b = calloc(1, sizeof *b + cap);
    if (!b) {
      g->oom = 1;
      return NULL;
    }
    b->cap = cap;
    b->next = g->blocks;
    g->blocks = b;
  }
  void *p = (char *)b->data + b->used;
  b->used += bytes;
  return p;
}

static char *g_strf(onnx_graph *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static char *g_strf(onnx_graph *g, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) {
    g->oom = 1;
    return NULL;
  }
  char *s = g_alloc(g, (size_t)n + 1);
  if (!s) return NULL;
  va_start(ap, fmt);
  vsnprintf(s, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return s;
}

static void g_free(onnx_graph *g) {
  while (g->blocks) {
    arena_block *next = g->blocks->next;
    free(g->blocks);
    g->blocks = next;
  }
}

/* ---------------------------------------------------------------- pieces */

/* A node op(inputs...) -> output named name, appended to the graph; NULL
 * when out of memory. Inputs and output are copied. */
static Onnx__NodeProto *node_add(onnx_graph *g, const char *op, const char *name,
                                 const char *output, int n_in, const char *const *inputs) {
  if (g->n_nodes == g->cap_nodes) {
    g->full = 1;
    return NULL;
  }
  Onnx__NodeProto *n = g_alloc(g, sizeof *n);
  char **in = g_alloc(g, (size_t)n_in * sizeof *in);
  char **out = g_alloc(g, sizeof *out);
  Onnx__AttributeProto **attrs = g_alloc(g, ONNX_ATTRS_PER_NODE * sizeof *attrs);
  if (!n || !in || !out || !attrs) return NULL;
  onnx__node_proto__init(n);
  for (int i = 0; i < n_in; i++)
    if (!(in[i] = g_strf(g, "%s", inputs[i]))) return NULL;
  if (!(out[0] = g_strf(g, "%s", output))) return NULL;
  n->input = in;
  n->n_input = (size_t)n_in;
  n->output = out;
  n->n_output = 1;
  n->name = g_strf(g, "%s", name);
  n->op_type = g_strf(g, "%s", op);
  n->attribute = attrs;
  if (!n->name || !n->op_type) return NULL;
  g->nodes[g->n_nodes++] = n;
  return n;
}

/* A new attribute `name` of node n, its value still to be set; NULL when
 * the node has no room or memory is out. */
static Onnx__AttributeProto *node_attr_new(onnx_graph *g, Onnx__NodeProto *n, const char *name) {
  if (n->n_attribute == ONNX_ATTRS_PER_NODE) {
    g->full = 1;
    return NULL;
  }
  Onnx__AttributeProto *a = g_alloc(g, sizeof *a);
  if (!a) return NULL;
  onnx__attribute_proto__init(a);
  if (!(a->name = g_strf(g, "%s", name))) return NULL;
  a->has_type = 1;
  n->attribute[n->n_attribute++] = a;
  return a;
}

/* An attribute of node n: one integer (count 0, v[0]) or a list of count
 * integers. 0, or PS_ENOMEM. */
static int node_attr_ints(onnx_graph *g, Onnx__NodeProto *n, const char *name, const int64_t *v,
                          size_t count) {
  Onnx__AttributeProto *a = node_attr_new(g, n, name);
  if (!a) return PS_ENOMEM;
  if (count == 0) {
    a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT;
    a->has_i = 1;
    a->i = v[0];
  } else {
    a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS;
    if (!(a->ints = g_alloc(g, count * sizeof *a->ints))) return PS_ENOMEM;
    memcpy(a->ints, v, count * sizeof *v);
    a->n_ints = count;
  }
  return 0;
}

static int node_attr_int(onnx_graph *g, Onnx__NodeProto *n, const char *name, int64_t v) {
  return node_attr_ints(g, n, name, &v, 0);
}

/* A FLOAT attribute of node n. 0, or PS_ENOMEM. */
static int node_attr_float(onnx_graph *g, Onnx__NodeProto *n, const char *name, float v) {
  Onnx__AttributeProto *a = node_attr_new(g, n, name);
  if (!a) return PS_ENOMEM;
  a->type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT;
  a->has_f = 1;
  a->f = v;
  return 0;
}

/* An initializer: a tensor of type dtype and shape dims[0..ndim) whose
 * values are the bytes raw[0..bytes) (not copied: they must outlive the
 * graph). Returns its name, or NULL when out of memory. */
static const char *init_add(onnx_graph *g, const char *name, int32_t dtype, const int64_t *dims,
                            size_t ndim, const void *raw, size_t bytes) {
  if (g->n_inits == g->cap_inits) {
    g->full = 1;
    return NULL;
  }
  Onnx__TensorProto *t = g_alloc(g, sizeof *t);
  int64_t *d = g_alloc(g, ndim * sizeof *d);
  if (!t || !d) return NULL;
  onnx__tensor_proto__init(t);
  memcpy(d, dims, ndim * sizeof *d);
  t->dims = d;
  t->n_dims = ndim;
  t->has_data_type = 1;
  t->data_type = dtype;
  t->has_raw_data = 1;
  t->raw_data.len = bytes;
  t->raw_data.data = (uint8_t *)(uintptr_t)raw; /* only read, by the packer */
  if (!(t->name = g_strf(g, "%s", name))) return NULL;
  g->inits[g->n_inits++] = t;
  return t->name;
}

/* The initializer "<layer>.<what>": count parameters from the flat vector
 * at off, with shape dims[0..ndim), which must hold count values and lie
 * inside the vector. NULL with a message (PS_EINVAL in *rc) or on OOM. */
static const char *init_param(onnx_graph *g, const ps_layer *L, const char *what,
                              const int64_t *dims, size_t ndim, size_t off, size_t count, int *rc,
                              char *err) {
  size_t prod = 1;
  for (size_t i = 0; i < ndim; i++) prod *= (size_t)dims[i];
  const size_t P = g->spec->n_params;
  if (prod != count || off > P || count > P - off) {
    *rc = ps_seterr(err, PS_EINVAL,
                    "%s.%s: %zu values at %zu in a vector of %zu, the shape holds %zu", L->name,
                    what, count, off, P, prod);
    return NULL;
  }
  char name[sizeof L->name + 8];
  snprintf(name, sizeof name, "%s.%s", L->name, what);
  const char *s = init_add(g, name, ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT, dims, ndim,
                           g->params + off, count * sizeof(float));
  if (!s) *rc = PS_ENOMEM;
  return s;
}

/* The graph's current tensor as (N, features) for L: a Flatten when it is
 * 4-D. 0 or PS_ENOMEM. */
static int to_rank2(onnx_graph *g, const ps_layer *L) {
  if (g->rank == 2) return 0;
  char name[sizeof L->name + 16], out[sizeof L->name + 16];
  snprintf(name, sizeof name, "%s.flatten", L->name);
  snprintf(out, sizeof out, "%s.in", L->name);
  Onnx__NodeProto *n = node_add(g, "Flatten", name, out, 1, &g->cur);
  if (!n || node_attr_int(g, n, "axis", 1)) return PS_ENOMEM;
  g->cur = n->output[0];
  g->rank = 2;
  return 0;
}

/* The 2-D tensor `tensor` (N, features) as (N, features, 1, 1), the
 * spec's reading of it, by an Unsqueeze of axes 2 and 3 whose names start
 * with prefix. The new tensor's name, or NULL when out of memory. */
static const char *unsqueeze_to_rank4(onnx_graph *g, const char *tensor, const char *prefix) {
  static const int64_t axes[2] = {2, 3}; /* little-endian int64 on this host */
  static const int64_t axes_dims[1] = {2};
  char name[sizeof((ps_layer *)0)->name + 40], out[sizeof name]; /* prefix: name + 16 */
  snprintf(name, sizeof name, "%s.axes", prefix);
  const char *in[2] = {tensor, init_add(g, name, ONNX__TENSOR_PROTO__DATA_TYPE__INT64, axes_dims, 1,
                                        axes, sizeof axes)};
  if (!in[1]) return NULL;
  snprintf(name, sizeof name, "%s.unsqueeze", prefix);
  snprintf(out, sizeof out, "%s.in", prefix);
  Onnx__NodeProto *n = node_add(g, "Unsqueeze", name, out, 2, in);
  return n ? n->output[0] : NULL;
}

/* The graph's current tensor as (N, C, H, W) for L: after a flatten or a
 * dense layer it is (N, features), which the model spec reads as
 * (features, 1, 1) per example. */
static int to_rank4(onnx_graph *g, const ps_layer *L) {
  if (g->rank == 4) return 0;
  const char *t = unsqueeze_to_rank4(g, g->cur, L->name);
  if (!t) return PS_ENOMEM;
  g->cur = t;
  g->rank = 4;
  return 0;
}

/* The output tensor of layer j (-1: the model input) and its rank. */
static const char *layer_tensor(const onnx_graph *g, int j, int *rank) {
  *rank = j < 0 ? 4 : g->out_rank[j];
  return j < 0 ? ONNX_INPUT : g->out[j];
}

/* ---------------------------------------------------------------- layers */

/* Appends layer L's nodes; 0, or a PS_E* code with a message. */
typedef int (*emit_fn)(onnx_graph *g, const ps_layer *L, char *err);

static int emit_conv2d(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = to_rank4(g, L);
  if (rc) return rc;
  const int64_t k = L->kernel, s = L->stride, p = L->pad;
  const int64_t wdims[4] = {L->filters, L->in_c, k, k}, bdims[1] = {L->filters};
  const char *in[3] = {g->cur, NULL, NULL};
  if (!(in[1] = init_param(g, L, "w", wdims, 4, L->w_off, L->w_count, &rc, err))) return rc;
  /* Without a bias ("bias": false) Conv takes no B, its optional input. */
  if (L->b_count && !(in[2] = init_param(g, L, "b", bdims, 1, L->b_off, L->b_count, &rc, err)))
    return rc;
  Onnx__NodeProto *n = node_add(g, "Conv", L->name, L->name, L->b_count ? 3 : 2, in);
  /* Explicit pads [H begin, W begin, H end, W end]: "same" is k/2 on every
   * side, as the kernels pad, at any stride; ONNX's auto_pad SAME_* pads
   * only what its output size needs, which with a stride can be less and
   * lopsided. */
  const int64_t kernel[2] = {k, k}, strides[2] = {s, s}, pads[4] = {p, p, p, p};
  if (!n || node_attr_ints(g, n, "kernel_shape", kernel, 2) ||
      node_attr_ints(g, n, "strides", strides, 2) || node_attr_ints(g, n, "pads", pads, 4))
    return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

static int emit_maxpool(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = to_rank4(g, L);
  if (rc) return rc;
  /* No padding, and the floor of (h - size) / stride + 1 windows: ONNX's
   * defaults (pads 0, ceil_mode 0). */
  const int64_t kernel[2] = {L->pool, L->pool}, strides[2] = {L->pool_stride, L->pool_stride};
  Onnx__NodeProto *n = node_add(g, "MaxPool", L->name, L->name, 1, &g->cur);
  if (!n || node_attr_ints(g, n, "kernel_shape", kernel, 2) ||
      node_attr_ints(g, n, "strides", strides, 2))
    return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

/* The windows of maxpool; no padding, so count_include_pad (0, said
 * anyway) changes nothing: every window averages size*size values. */
static int emit_avgpool(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = to_rank4(g, L);
  if (rc) return rc;
  const int64_t kernel[2] = {L->pool, L->pool}, strides[2] = {L->pool_stride, L->pool_stride};
  Onnx__NodeProto *n = node_add(g, "AveragePool", L->name, L->name, 1, &g->cur);
  if (!n || node_attr_ints(g, n, "kernel_shape", kernel, 2) ||
      node_attr_ints(g, n, "strides", strides, 2) || node_attr_int(g, n, "count_include_pad", 0))
    return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

/* (N, C, H, W) -> (N, C, 1, 1), the spec's C x 1 x 1. */
static int emit_global_avgpool(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = to_rank4(g, L);
  if (rc) return rc;
  Onnx__NodeProto *n = node_add(g, "GlobalAveragePool", L->name, L->name, 1, &g->cur);
  if (!n) return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

static int emit_dense(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = to_rank2(g, L);
  if (rc) return rc;
  const int64_t in_features = (int64_t)L->in_c * L->in_h * L->in_w;
  const int64_t wdims[2] = {L->units, in_features}, bdims[1] = {L->units};
  const char *in[3] = {g->cur, NULL, NULL};
  if (!(in[1] = init_param(g, L, "w", wdims, 2, L->w_off, L->w_count, &rc, err))) return rc;
  /* Gemm's C is optional since operator set 11: none without a bias. */
  if (L->b_count && !(in[2] = init_param(g, L, "b", bdims, 1, L->b_off, L->b_count, &rc, err)))
    return rc;
  /* y = x W^T + b with W (OUT, IN), as the kernels compute it. */
  Onnx__NodeProto *n = node_add(g, "Gemm", L->name, L->name, L->b_count ? 3 : 2, in);
  if (!n || node_attr_int(g, n, "transB", 1)) return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

/* Inference with the moving statistics: BatchNormalization (version 9 in
 * operator set 13) normalizes axis 1, the channels of (N, C, H, W) and the
 * features of (N, C), the spec's channels either way (a 2-D tensor is the
 * spec's (C, 1, 1)), so the tensor keeps its rank. y = scale * (x - mean)
 * / sqrt(var + epsilon) + B, as batchnorm_forward_infer computes it. */
static int emit_batchnorm(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = 0;
  const size_t c = L->w_count;
  const int64_t dims[1] = {(int64_t)c};
  if (L->b_count != c || L->s_count != 2 * c)
    return ps_seterr(err, PS_EINVAL, "%s: batchnorm with %zu gamma, %zu beta and %zu moving "
                     "values", L->name, L->w_count, L->b_count, L->s_count);
  const char *in[5] = {g->cur, NULL, NULL, NULL, NULL};
  if (!(in[1] = init_param(g, L, "gamma", dims, 1, L->w_off, c, &rc, err)) ||
      !(in[2] = init_param(g, L, "beta", dims, 1, L->b_off, c, &rc, err)) ||
      !(in[3] = init_param(g, L, "moving_mean", dims, 1, L->s_off, c, &rc, err)) ||
      !(in[4] = init_param(g, L, "moving_variance", dims, 1, L->s_off + c, c, &rc, err)))
    return rc;
  Onnx__NodeProto *n = node_add(g, "BatchNormalization", L->name, L->name, 5, in);
  /* momentum only documents how the moving statistics were averaged
   * (ONNX's convention is Keras's and the spec's). */
  if (!n || node_attr_float(g, n, "epsilon", L->epsilon) ||
      node_attr_float(g, n, "momentum", L->momentum))
    return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

static int emit_relu(onnx_graph *g, const ps_layer *L, char *err) {
  Onnx__NodeProto *n = node_add(g, "Relu", L->name, L->name, 1, &g->cur);
  if (!n) return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

/* Inverted dropout scales while training, so inference is the identity:
 * no node. */
static int emit_dropout(onnx_graph *g, const ps_layer *L, char *err) { return 0; }

/* NCHW is already (N, C*H*W) in memory, the order ONNX's Flatten keeps; a
 * 2-D tensor stays as it is. */
static int emit_flatten(onnx_graph *g, const ps_layer *L, char *err) {
  if (g->rank == 2) return 0;
  Onnx__NodeProto *n = node_add(g, "Flatten", L->name, L->name, 1, &g->cur);
  if (!n || node_attr_int(g, n, "axis", 1)) return PS_ENOMEM;
  g->cur = n->output[0];
  g->rank = 2;
  return 0;
}

/* Inputs of one shape in the spec, but a dense layer's (N, features) and
 * a pooling's (N, C, 1, 1) differ in rank: then all are made 4-D. More
 * than two are summed left to right, as the kernels sum them. */
static int emit_add(onnx_graph *g, const ps_layer *L, char *err) {
  const char *in[PS_MAX_LAYER_INPUTS] = {NULL};
  int ranks[PS_MAX_LAYER_INPUTS] = {0}, rank = 2;
  for (int a = 0; a < L->n_inputs; a++) {
    in[a] = layer_tensor(g, L->inputs[a], &ranks[a]);
    if (ranks[a] == 4) rank = 4;
  }
  for (int a = 0; a < L->n_inputs; a++) {
    if (ranks[a] == rank) continue;
    char prefix[sizeof L->name + 16]; /* the name, ".in" and a digit */
    snprintf(prefix, sizeof prefix, "%.31s.in%d", L->name, a % PS_MAX_LAYER_INPUTS);
    if (!(in[a] = unsqueeze_to_rank4(g, in[a], prefix))) return PS_ENOMEM;
  }
  const char *sum = in[0];
  for (int a = 1; a < L->n_inputs; a++) {
    char name[sizeof L->name + 16];
    if (a + 1 < L->n_inputs)
      snprintf(name, sizeof name, "%.31s.sum%d", L->name, a % PS_MAX_LAYER_INPUTS);
    else
      snprintf(name, sizeof name, "%s", L->name);
    const char *pair[2] = {sum, in[a]};
    Onnx__NodeProto *n = node_add(g, "Add", name, name, 2, pair);
    if (!n) return PS_ENOMEM;
    sum = n->output[0];
  }
  g->cur = sum;
  g->rank = rank;
  return 0;
}

/* The loss layer's forward half at inference: the probabilities. */
static int emit_softmax_xent(onnx_graph *g, const ps_layer *L, char *err) {
  int rc = to_rank2(g, L);
  if (rc) return rc;
  Onnx__NodeProto *n = node_add(g, "Softmax", L->name, ONNX_OUTPUT, 1, &g->cur);
  if (!n || node_attr_int(g, n, "axis", 1)) return PS_ENOMEM;
  g->cur = n->output[0];
  return 0;
}

static const struct {
  ps_layer_type type;
  emit_fn emit;
} emitters[] = {
    {PS_LAYER_CONV2D, emit_conv2d},
    {PS_LAYER_MAXPOOL, emit_maxpool},
    {PS_LAYER_DENSE, emit_dense},
    {PS_LAYER_RELU, emit_relu},
    {PS_LAYER_DROPOUT, emit_dropout},
    {PS_LAYER_FLATTEN, emit_flatten},
    {PS_LAYER_SOFTMAX_XENT, emit_softmax_xent},
    {PS_LAYER_AVGPOOL, emit_avgpool},
    {PS_LAYER_GLOBAL_AVGPOOL, emit_global_avgpool},
    {PS_LAYER_ADD, emit_add},
    {PS_LAYER_BATCHNORM, emit_batchnorm},
};

static emit_fn emitter_of(ps_layer_type type) {
  for (size_t i = 0; i < sizeof emitters / sizeof emitters[0]; i++)
    if (emitters[i].type == type) return emitters[i].emit;
  return NULL;
}

int ps_onnx_check_spec(const ps_model_spec *spec, char *err) {
  if (spec->flat)
    return ps_seterr(err, PS_EINVAL,
                     "the job's model is a flat vector of %zu parameters with no layers (its "
                     "workers compute it): there is no graph to export to ONNX; use --format npy",
                     spec->n_params);
  for (int i = 0; i < spec->n_layers; i++)
    if (!emitter_of(spec->layers[i].type))
      return ps_seterr(err, PS_EINVAL,
                       "layer %d (%s) has no ONNX form in this version of ps-export: the model "
                       "cannot be exported to ONNX",
                       i, spec->layers[i].name);
  if (spec->n_layers == 0 || spec->layers[spec->n_layers - 1].type != PS_LAYER_SOFTMAX_XENT)
    return ps_seterr(err, PS_EINVAL, "the model does not end in softmax_xent: no probabilities");
  /* Tensors are named after the layers: a layer's output by its name, its
   * parameters and helper tensors "<name>.<what>", the graph's output
   * ONNX_OUTPUT. A name that repeats one of those would join two tensors. */
  for (int i = 0; i < spec->n_layers; i++) {
    const char *a = spec->layers[i].name;
    if (strcmp(a, ONNX_OUTPUT) == 0 && i + 1 < spec->n_layers)
      return ps_seterr(err, PS_EINVAL,
                       "layer %d is named '%s', the name of the ONNX graph's output: rename it to "
                       "export the model",
                       i, a);
    for (int j = 0; j < spec->n_layers; j++) {
      const char *b = spec->layers[j].name;
      const size_t nb = strlen(b);
      if (j != i && strncmp(a, b, nb) == 0 && a[nb] == '.')
        return ps_seterr(err, PS_EINVAL,
                         "layer %d is named '%s', which ONNX tensors of layer '%s' (named "
                         "'%s.<what>') could have: rename it to export the model",
                         i, a, b, b);
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- model */

/* name: float32 tensor of shape dims[0..ndim), a negative size being the
 * symbolic batch dimension. NULL when out of memory. */
static Onnx__ValueInfoProto *tensor_info(onnx_graph *g, const char *name, const int64_t *dims,
                                         size_t ndim) {
  Onnx__ValueInfoProto *v = g_alloc(g, sizeof *v);
  Onnx__TypeProto *type = g_alloc(g, sizeof *type);
  Onnx__TypeProto__Tensor *tt = g_alloc(g, sizeof *tt);
  Onnx__TensorShapeProto *shape = g_alloc(g, sizeof *shape);
  Onnx__TensorShapeProto__Dimension **dim = g_alloc(g, ndim * sizeof *dim);
  if (!v || !type || !tt || !shape || !dim) return NULL;
  onnx__value_info_proto__init(v);
  onnx__type_proto__init(type);
  onnx__type_proto__tensor__init(tt);
  onnx__tensor_shape_proto__init(shape);
  for (size_t i = 0; i < ndim; i++) {
    Onnx__TensorShapeProto__Dimension *d = g_alloc(g, sizeof *d);
    if (!d) return NULL;
    onnx__tensor_shape_proto__dimension__init(d);
    if (dims[i] < 0) {
      d->value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_PARAM;
      if (!(d->dim_param = g_strf(g, "%s", ONNX_BATCH))) return NULL;
    } else {
      d->value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
      d->dim_value = dims[i];
    }
    dim[i] = d;
  }
  shape->dim = dim;
  shape->n_dim = ndim;
  tt->has_elem_type = 1;
  tt->elem_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
  tt->shape = shape;
  type->value_case = ONNX__TYPE_PROTO__VALUE_TENSOR_TYPE;
  type->tensor_type = tt;
  v->type = type;
  if (!(v->name = g_strf(g, "%s", name))) return NULL;
  return v;
}

static Onnx__StringStringEntryProto *meta_entry(onnx_graph *g, const char *key, const char *value) {
  Onnx__StringStringEntryProto *e = value ? g_alloc(g, sizeof *e) : NULL;
  if (!e) return NULL;
  onnx__string_string_entry_proto__init(e);
  e->key = g_strf(g, "%s", key);
  e->value = g_strf(g, "%s", value);
  return e->key && e->value ? e : NULL;
}

/* The nodes and initializers of every layer of g->spec, in order, from the
 * input to the probabilities. 0, or a PS_E* code with a message. */
static int emit_layers(onnx_graph *g, char *err) {
  const ps_model_spec *spec = g->spec;
  g->cap_nodes = g->cap_inits = 0;
  for (int i = 0; i < spec->n_layers; i++) {
    const int add = spec->layers[i].type == PS_LAYER_ADD;
    g->cap_nodes += add ? ONNX_NODES_PER_ADD : ONNX_NODES_PER_LAYER;
    g->cap_inits += add ? ONNX_INITS_PER_ADD : ONNX_INITS_PER_LAYER;
  }
  g->nodes = g_alloc(g, g->cap_nodes * sizeof *g->nodes);
  g->inits = g_alloc(g, g->cap_inits * sizeof *g->inits);
  if (!g->nodes || !g->inits) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    g->cur = layer_tensor(g, L->inputs[0], &g->rank);
    int rc = emitter_of(L->type)(g, L, err);
    if (g->full)
      return ps_seterr(err, PS_EINVAL,
                       "%s: its emit function adds more nodes, initializers or attributes than "
                       "ONNX_*_PER_LAYER leave room for",
                       L->name);
    if (rc) {
      if (rc == PS_ENOMEM || g->oom)
        return ps_seterr(err, PS_ENOMEM, "out of memory building the graph at %s", L->name);
      return rc;
    }
    if (g->oom) return ps_seterr(err, PS_ENOMEM, "out of memory building the graph at %s", L->name);
    g->out[i] = g->cur;
    g->out_rank[i] = g->rank;
  }
  return 0;
}

/* Fills model (and its graph) from spec and params. 0, or a PS_E* code
 * with a message. */
static int build_model(onnx_graph *g, const ps_onnx_meta *meta, Onnx__ModelProto *model,
                       char *err) {
  const ps_model_spec *spec = g->spec;
  int rc = ps_onnx_check_spec(spec, err);
  if (rc == 0) rc = emit_layers(g, err);
  if (rc) return rc;
  Onnx__GraphProto *graph = g_alloc(g, sizeof *graph);
  Onnx__ValueInfoProto **ins = g_alloc(g, sizeof *ins), **outs = g_alloc(g, sizeof *outs);
  Onnx__OperatorSetIdProto *opset = g_alloc(g, sizeof *opset);
  Onnx__OperatorSetIdProto **opsets = g_alloc(g, sizeof *opsets);
  Onnx__StringStringEntryProto **props = g_alloc(g, 4 * sizeof *props);
  if (!graph || !ins || !outs || !opset || !opsets || !props)
    return ps_seterr(err, PS_ENOMEM, "out of memory");
  const int64_t in_dims[4] = {-1, spec->in_c, spec->in_h, spec->in_w};
  const int64_t out_dims[2] = {-1, spec->classes};
  ins[0] = tensor_info(g, ONNX_INPUT, in_dims, 4);
  outs[0] = tensor_info(g, ONNX_OUTPUT, out_dims, 2);
  onnx__graph_proto__init(graph);
  graph->name = g_strf(g, "%s", meta && meta->job_id ? meta->job_id : "model");
  graph->node = g->nodes;
  graph->n_node = g->n_nodes;
  graph->initializer = g->inits;
  graph->n_initializer = g->n_inits;
  graph->input = ins;
  graph->n_input = 1;
  graph->output = outs;
  graph->n_output = 1;

  onnx__operator_set_id_proto__init(opset);
  opset->has_version = 1;
  opset->version = ONNX_OPSET;
  opsets[0] = opset;

  onnx__model_proto__init(model);
  model->has_ir_version = 1;
  model->ir_version = ONNX_IR_VERSION;
  model->opset_import = opsets;
  model->n_opset_import = 1;
  model->producer_name = ONNX_PRODUCER;
  if (meta && meta->producer_version)
    model->producer_version = g_strf(g, "%s", meta->producer_version);
  model->graph = graph;
  char desc[512];
  ps_model_spec_describe(spec, desc, sizeof desc);
  size_t n_props = 0;
  props[n_props++] = meta_entry(g, "model", desc);
  if (meta && meta->job_id) props[n_props++] = meta_entry(g, "job_id", meta->job_id);
  if (meta && meta->num_shards > 0) {
    props[n_props++] =
        meta_entry(g, "checkpoint_version", g_strf(g, "%llu", (unsigned long long)meta->version));
    props[n_props++] = meta_entry(g, "checkpoint_shards", g_strf(g, "%d", meta->num_shards));
  }
  for (size_t i = 0; i < n_props; i++)
    if (!props[i]) g->oom = 1;
  model->metadata_props = props;
  model->n_metadata_props = n_props;
  if (g->oom || !ins[0] || !outs[0] || !graph->name)
    return ps_seterr(err, PS_ENOMEM, "out of memory building the model");
  return 0;
}

/* ---------------------------------------------------------------- file */

/* protobuf-c's output as a buffered writer into an atomically replaced
 * file: small pieces (tags, names) are gathered, large ones (raw_data) go
 * straight through; a failure is kept by the file and reported at commit. */
typedef struct {
  ProtobufCBuffer base; /* first: protobuf-c passes &base */
  ps_atomic_file *file;
  size_t used;
  uint8_t buf[1 << 16];
} file_sink;

static void sink_flush(file_sink *s) {
  if (s->used) ps_atomic_write(s->file, s->buf, s->used);
  s->used = 0;
}

static void sink_append(ProtobufCBuffer *b, size_t len, const uint8_t *data) {
  file_sink *s = (file_sink *)b;
  if (len > sizeof s->buf - s->used) {
    sink_flush(s);
    if (len >= sizeof s->buf) {
      ps_atomic_write(s->file, data, len);
      return;
    }
  }
  memcpy(s->buf + s->used, data, len);
  s->used += len;
}

/* Packs model into a temporary file next to path, then renames it over
 * path. On error path is as it was and the temporary file is gone. */
static int write_model(const Onnx__ModelProto *model, const char *path, uint64_t *bytes,
                       char *err) {
  struct stat st;
  if (path[0] && stat(path, &st) == 0 && S_ISDIR(st.st_mode))
    return ps_seterr(err, PS_EINVAL,
                     "'%.200s' is a directory: --format onnx writes one file; name it (e.g. "
                     "%.200s/model.onnx)",
                     path, path);
  ps_atomic_file f;
  int rc = ps_atomic_open(&f, path, err);
  if (rc) return rc;
  file_sink *sink = calloc(1, sizeof *sink);
  if (!sink) {
    ps_atomic_abort(&f);
    return ps_seterr(err, PS_ENOMEM, "out of memory");
  }
  sink->base.append = sink_append;
  sink->file = &f;
  size_t packed = protobuf_c_message_pack_to_buffer(&model->base, &sink->base);
  sink_flush(sink);
  free(sink);
  rc = ps_atomic_commit(&f, err);
  if (rc == 0 && bytes) *bytes = packed;
  return rc;
}

int ps_onnx_export(const ps_model_spec *spec, const float *params, const ps_onnx_meta *meta,
                   const char *path, uint64_t *bytes, char *err) {
  if (!spec || !path || (spec->n_params > 0 && !params))
    return ps_seterr(err, PS_EINVAL, "onnx: no model, parameters or path given");
  onnx_graph g = {.spec = spec, .params = params};
  Onnx__ModelProto model;
  int rc = build_model(&g, meta, &model, err);
  if (rc == 0) {
    size_t size = protobuf_c_message_get_packed_size(&model.base);
    if (size > ONNX_MAX_BYTES)
      rc = ps_seterr(err, PS_EINVAL,
                     "the model would take %zu bytes, past protobuf's 2 GiB limit on an ONNX "
                     "file (external data is not written)",
                     size);
  }
  if (rc == 0) rc = write_model(&model, path, bytes, err);
  g_free(&g);
  return rc;
}

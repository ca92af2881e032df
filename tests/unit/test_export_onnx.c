/* The ONNX export (tools/export/export_onnx.c), read back with the same generated
 * decoder: the model's header, the graph's input and output with the
 * symbolic batch, the node sequence and attributes of every layer type
 * (conv "same" and "valid" with strides, maxpool, avgpool, global_avgpool,
 * the Flatten before a dense layer on a 4-D tensor and the Unsqueeze before
 * a conv or a global pooling after a dense layer, no Dropout), initializers
 * holding the parameters' bytes at the layout's offsets; residual models'
 * Add nodes reading earlier layers' tensors by name (a 2-D and a 4-D input
 * made 4-D, three inputs summed left to right); batchnorm as
 * BatchNormalization (epsilon, momentum; gamma, beta, moving mean and
 * variance as initializers) on 4-D and 2-D tensors, and conv2d and dense
 * without a bias as Conv and Gemm of two inputs; and refusals that
 * leave nothing behind: a layer type without an ONNX form, a directory as
 * the path, a missing directory. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "common/model_spec.h"
#include "common/util.h"
#include "proto/onnx.pb-c.h"
#include "tools/export/export_onnx.h"

static char g_dir[64];

static const char *k_model =
    "{\"input\": [2, 9, 9], \"classes\": 3, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 5, \"stride\": 2, \"padding\": \"same\"},"
    "{\"type\": \"relu\"},"
    "{\"type\": \"maxpool\", \"size\": 2, \"stride\": 1},"
    "{\"type\": \"dense\", \"units\": 6},"
    "{\"type\": \"conv2d\", \"filters\": 5, \"kernel\": 1, \"padding\": \"valid\"},"
    "{\"type\": \"flatten\"},"
    "{\"type\": \"dropout\", \"rate\": 0.5},"
    "{\"type\": \"dense\", \"units\": 3},"
    "{\"type\": \"softmax_xent\"}]}";

static Onnx__ModelProto *read_model(const char *path) {
  char *bytes = NULL;
  size_t len = 0;
  char err[PS_ERRLEN];
  if (ps_read_file(path, &bytes, &len, err) != 0) {
    fprintf(stderr, "%s\n", err);
    return NULL;
  }
  Onnx__ModelProto *m = onnx__model_proto__unpack(NULL, len, (const uint8_t *)bytes);
  free(bytes);
  return m;
}

static const Onnx__AttributeProto *attr(const Onnx__NodeProto *n, const char *name) {
  for (size_t i = 0; i < n->n_attribute; i++)
    if (!strcmp(n->attribute[i]->name, name)) return n->attribute[i];
  return NULL;
}

/* The INTS attribute name of n equals want[0..count). */
static int ints_are(const Onnx__NodeProto *n, const char *name, const int64_t *want, size_t count) {
  const Onnx__AttributeProto *a = attr(n, name);
  if (!a || a->type != ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS || a->n_ints != count) return 0;
  return memcmp(a->ints, want, count * sizeof *want) == 0;
}

static int int_is(const Onnx__NodeProto *n, const char *name, int64_t want) {
  const Onnx__AttributeProto *a = attr(n, name);
  return a && a->type == ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT && a->has_i && a->i == want;
}

static const Onnx__TensorProto *init_named(const Onnx__GraphProto *g, const char *name) {
  for (size_t i = 0; i < g->n_initializer; i++)
    if (!strcmp(g->initializer[i]->name, name)) return g->initializer[i];
  return NULL;
}

/* The initializer name holds params[off, off+count) with shape dims. */
static void check_param(const Onnx__GraphProto *g, const char *name, const float *params,
                        size_t off, size_t count, const int64_t *dims, size_t ndim) {
  const Onnx__TensorProto *t = init_named(g, name);
  CHECK_MSG(t != NULL, "no initializer %s", name);
  if (!t) return;
  CHECK(t->data_type == ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT);
  CHECK(t->n_dims == ndim && memcmp(t->dims, dims, ndim * sizeof *dims) == 0);
  CHECK(t->has_raw_data && t->raw_data.len == count * sizeof(float));
  CHECK(t->n_float_data == 0);
  CHECK_MSG(t->raw_data.len == count * sizeof(float) &&
                memcmp(t->raw_data.data, params + off, t->raw_data.len) == 0,
            "%s: other values", name);
}

static int dim_is(const Onnx__ValueInfoProto *v, size_t i, int64_t value, const char *param) {
  const Onnx__TensorShapeProto *s = v->type->tensor_type->shape;
  if (i >= s->n_dim) return 0;
  const Onnx__TensorShapeProto__Dimension *d = s->dim[i];
  if (param)
    return d->value_case == ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_PARAM &&
           !strcmp(d->dim_param, param);
  return d->value_case == ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE &&
         d->dim_value == value;
}

/* g's nodes are of the types ops[0..n) in that order. */
static void check_op_types(const Onnx__GraphProto *g, const char *const *ops, size_t n) {
  CHECK_MSG(g->n_node == n, "%zu nodes", g->n_node);
  for (size_t i = 0; i < g->n_node && i < n; i++)
    CHECK_MSG(!strcmp(g->node[i]->op_type, ops[i]), "node %zu is %s, not %s", i,
              g->node[i]->op_type, ops[i]);
}

/* Each node (but the first) reads first what the one before wrote. */
static void check_chain(const Onnx__GraphProto *g) {
  for (size_t i = 1; i < g->n_node; i++)
    CHECK_MSG(!strcmp(g->node[i]->input[0], g->node[i - 1]->output[0]), "node %zu's input", i);
}

/* Nothing but the names in keep[] is in g_dir. */
static int dir_holds_only(const char *const *keep, int n_keep) {
  DIR *d = opendir(g_dir);
  if (!d) return 0;
  int ok = 1;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    int known = 0;
    for (int i = 0; i < n_keep; i++) known |= !strcmp(de->d_name, keep[i]);
    if (!known) {
      fprintf(stderr, "left in %s: %s\n", g_dir, de->d_name);
      ok = 0;
    }
  }
  closedir(d);
  return ok;
}

static void test_graph(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN] = "";
  CHECK_MSG(ps_model_spec_parse(k_model, &spec, err) == 0, "%s", err);
  float *params = malloc(spec.n_params * sizeof(float));
  for (size_t i = 0; i < spec.n_params; i++) params[i] = (float)i * 0.001f - 1.0f;
  char path[128];
  snprintf(path, sizeof path, "%s/model.onnx", g_dir);
  ps_onnx_meta meta = {
      .producer_version = "0.1.0", .job_id = "job-x", .version = 42, .num_shards = 2};
  uint64_t bytes = 0;
  CHECK_MSG(ps_onnx_export(&spec, params, &meta, path, &bytes, err) == 0, "%s", err);
  struct stat st;
  CHECK(stat(path, &st) == 0 && (uint64_t)st.st_size == bytes);
  Onnx__ModelProto *m = read_model(path);
  CHECK(m != NULL);
  if (!m) {
    free(params);
    return;
  }
  CHECK(m->has_ir_version && m->ir_version == 7);
  CHECK(m->n_opset_import == 1 && m->opset_import[0]->version == 13 &&
        (!m->opset_import[0]->domain || !m->opset_import[0]->domain[0]));
  CHECK(m->producer_name && !strcmp(m->producer_name, "ps"));
  CHECK(m->producer_version && !strcmp(m->producer_version, "0.1.0"));
  int saw_version = 0;
  for (size_t i = 0; i < m->n_metadata_props; i++)
    saw_version |= !strcmp(m->metadata_props[i]->key, "checkpoint_version") &&
                   !strcmp(m->metadata_props[i]->value, "42");
  CHECK(saw_version);

  const Onnx__GraphProto *g = m->graph;
  CHECK(g->n_input == 1 && !strcmp(g->input[0]->name, "input"));
  CHECK(g->input[0]->type->tensor_type->elem_type == ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT);
  CHECK(dim_is(g->input[0], 0, 0, "N") && dim_is(g->input[0], 1, 2, NULL) &&
        dim_is(g->input[0], 2, 9, NULL) && dim_is(g->input[0], 3, 9, NULL));
  CHECK(g->n_output == 1 && !strcmp(g->output[0]->name, "probabilities"));
  CHECK(dim_is(g->output[0], 0, 0, "N") && dim_is(g->output[0], 1, 3, NULL));

  static const char *const ops[] = {"Conv",      "Relu", "MaxPool", "Flatten", "Gemm",
                                    "Unsqueeze", "Conv", "Flatten", "Gemm",    "Softmax"};
  const size_t n_ops = sizeof ops / sizeof ops[0];
  check_op_types(g, ops, n_ops);
  /* Each node reads what the one before wrote. */
  CHECK(!strcmp(g->node[0]->input[0], "input"));
  check_chain(g);
  if (g->n_node == n_ops) {
    const int64_t k5[2] = {5, 5}, s2[2] = {2, 2}, p2[4] = {2, 2, 2, 2};
    CHECK(ints_are(g->node[0], "kernel_shape", k5, 2) && ints_are(g->node[0], "strides", s2, 2) &&
          ints_are(g->node[0], "pads", p2, 4));
    const int64_t k2[2] = {2, 2}, s1[2] = {1, 1}, p0[4] = {0, 0, 0, 0}, k1[2] = {1, 1};
    CHECK(ints_are(g->node[2], "kernel_shape", k2, 2) && ints_are(g->node[2], "strides", s1, 2));
    CHECK(int_is(g->node[3], "axis", 1) && int_is(g->node[4], "transB", 1));
    CHECK(g->node[5]->n_input == 2);
    const Onnx__TensorProto *axes = init_named(g, g->node[5]->input[1]);
    const int64_t want_axes[2] = {2, 3};
    CHECK(axes && axes->data_type == ONNX__TENSOR_PROTO__DATA_TYPE__INT64 &&
          axes->raw_data.len == sizeof want_axes &&
          !memcmp(axes->raw_data.data, want_axes, sizeof want_axes));
    CHECK(ints_are(g->node[6], "kernel_shape", k1, 2) && ints_are(g->node[6], "pads", p0, 4));
    CHECK(int_is(g->node[9], "axis", 1) && !strcmp(g->node[9]->output[0], "probabilities"));
  }
  const ps_layer *L = spec.layers;
  const int64_t c0w[4] = {4, 2, 5, 5}, c0b[1] = {4};
  check_param(g, "conv2d_0.w", params, L[0].w_off, L[0].w_count, c0w, 4);
  check_param(g, "conv2d_0.b", params, L[0].b_off, L[0].b_count, c0b, 1);
  const int64_t d0w[2] = {6, 4 * 4 * 4}, d0b[1] = {6};
  check_param(g, "dense_0.w", params, L[3].w_off, L[3].w_count, d0w, 2);
  check_param(g, "dense_0.b", params, L[3].b_off, L[3].b_count, d0b, 1);
  const int64_t c1w[4] = {5, 6, 1, 1}, d1w[2] = {3, 5}, d1b[1] = {3};
  check_param(g, "conv2d_1.w", params, L[4].w_off, L[4].w_count, c1w, 4);
  check_param(g, "dense_1.w", params, L[7].w_off, L[7].w_count, d1w, 2);
  check_param(g, "dense_1.b", params, L[7].b_off, L[7].b_count, d1b, 1);
  onnx__model_proto__free_unpacked(m, NULL);
  const char *const keep[] = {"model.onnx"};
  CHECK(dir_holds_only(keep, 1));
  free(params);
}

/* Average pooling: AveragePool with its window, strides and
 * count_include_pad 0; GlobalAveragePool on a 4-D tensor and, after a
 * dense layer, on its Unsqueeze; its (N, C, 1, 1) output flattened before
 * the dense layer that reads it. */
/* The model of spec_json with parameters i * 0.01 - 0.5, exported as
 * g_dir/file, read back and removed (NULL, with a failed check, when any
 * step fails). */
static Onnx__ModelProto *export_model(const char *spec_json, const char *file, ps_model_spec *spec,
                                      float **params) {
  char err[PS_ERRLEN] = "", path[128];
  *params = NULL;
  CHECK_MSG(ps_model_spec_parse(spec_json, spec, err) == 0, "%s", err);
  float *p = malloc(spec->n_params * sizeof(float));
  for (size_t i = 0; i < spec->n_params; i++) p[i] = (float)i * 0.01f - 0.5f;
  snprintf(path, sizeof path, "%s/%s", g_dir, file);
  CHECK_MSG(ps_onnx_check_spec(spec, err) == 0, "%s", err);
  CHECK_MSG(ps_onnx_export(spec, p, NULL, path, NULL, err) == 0, "%s", err);
  Onnx__ModelProto *m = read_model(path);
  unlink(path);
  CHECK(m != NULL);
  if (!m) {
    free(p);
    return NULL;
  }
  *params = p;
  return m;
}

static const char *k_pool_model =
    "{\"input\": [3, 10, 10], \"classes\": 3, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"avgpool\", \"size\": 3, \"stride\": 2},"
    "{\"type\": \"global_avgpool\"},"
    "{\"type\": \"dense\", \"units\": 5},"
    "{\"type\": \"global_avgpool\"},"
    "{\"type\": \"flatten\"},"
    "{\"type\": \"dense\", \"units\": 3},"
    "{\"type\": \"softmax_xent\"}]}";

static void test_pooling_graph(void) {
  ps_model_spec spec;
  float *params;
  Onnx__ModelProto *m = export_model(k_pool_model, "pool.onnx", &spec, &params);
  if (!m) return;
  const Onnx__GraphProto *g = m->graph;
  static const char *const ops[] = {"Conv", "AveragePool", "GlobalAveragePool", "Flatten",
                                    "Gemm", "Unsqueeze",   "GlobalAveragePool", "Flatten",
                                    "Gemm", "Softmax"};
  const size_t n_ops = sizeof ops / sizeof ops[0];
  check_op_types(g, ops, n_ops);
  check_chain(g);
  if (g->n_node == n_ops) {
    const int64_t k3[2] = {3, 3}, s2[2] = {2, 2};
    CHECK(!strcmp(g->node[1]->name, "avgpool_0"));
    CHECK(ints_are(g->node[1], "kernel_shape", k3, 2) && ints_are(g->node[1], "strides", s2, 2));
    CHECK(int_is(g->node[1], "count_include_pad", 0));
    CHECK(!attr(g->node[1], "pads") && !attr(g->node[1], "ceil_mode"));
    CHECK(!strcmp(g->node[2]->name, "global_avgpool_0") && g->node[2]->n_attribute == 0);
    CHECK(int_is(g->node[3], "axis", 1) && int_is(g->node[4], "transB", 1));
    CHECK(!strcmp(g->node[6]->name, "global_avgpool_1") && g->node[6]->n_attribute == 0);
    CHECK(!strcmp(g->node[7]->name, "flatten_0") && int_is(g->node[7], "axis", 1));
  }
  /* The dense layer after global pooling reads its 4 channels. */
  const ps_layer *L = spec.layers;
  const int64_t d0w[2] = {5, 4}, d1w[2] = {3, 5};
  check_param(g, "dense_0.w", params, L[3].w_off, L[3].w_count, d0w, 2);
  check_param(g, "dense_1.w", params, L[6].w_off, L[6].w_count, d1w, 2);
  onnx__model_proto__free_unpacked(m, NULL);
  free(params);
}

/* Add reads any earlier layer's tensor: a residual block; a dense output
 * (N, 2) added to a global pooling's (N, 2, 1, 1) (the dense one
 * unsqueezed); three inputs through a dropout (no node), two of them 2-D. */
static const char *k_res_model =
    "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 2, \"kernel\": 3, \"padding\": \"same\", "
    "\"name\": \"stem\"},"
    "{\"type\": \"relu\"},"
    "{\"type\": \"conv2d\", \"filters\": 2, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"add\", \"inputs\": [\"conv2d_1\", \"stem\"]},"
    "{\"type\": \"global_avgpool\"}, {\"type\": \"flatten\"},"
    "{\"type\": \"dense\", \"units\": 2},"
    "{\"type\": \"add\", \"inputs\": [\"dense_0\", \"global_avgpool_0\"]},"
    "{\"type\": \"dropout\", \"rate\": 0.5},"
    "{\"type\": \"add\", \"inputs\": [\"dropout_0\", \"flatten_0\", \"dense_0\"]},"
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 3},"
    "{\"type\": \"softmax_xent\"}]}";

static void test_residual_graph(void) {
  ps_model_spec spec;
  float *params;
  Onnx__ModelProto *m = export_model(k_res_model, "res.onnx", &spec, &params);
  if (!m) return;
  const Onnx__GraphProto *g = m->graph;
  static const char *const ops[] = {
      "Conv", "Relu",      "Conv", "Add",       "GlobalAveragePool", "Flatten",
      "Gemm", "Unsqueeze", "Add",  "Unsqueeze", "Unsqueeze",         "Add",
      "Add",  "Flatten",   "Gemm", "Softmax"};
  const size_t n_ops = sizeof ops / sizeof ops[0];
  check_op_types(g, ops, n_ops);
  /* (node, input) -> the tensor it must read. */
  static const struct {
    int node, input;
    const char *tensor;
  } reads[] = {
      {0, 0, "input"},         {1, 0, "stem"},         {2, 0, "relu_0"},
      {3, 0, "conv2d_1"},      {3, 1, "stem"},         {4, 0, "add_0"},
      {7, 0, "dense_0"},       {8, 0, "add_1.in0.in"}, {8, 1, "global_avgpool_0"},
      {9, 0, "flatten_0"},     {10, 0, "dense_0"},     {11, 0, "add_1"},
      {11, 1, "add_2.in1.in"}, {12, 0, "add_2.sum1"},  {12, 1, "add_2.in2.in"},
      {13, 0, "add_2"},
  };
  if (g->n_node == n_ops) {
    for (size_t i = 0; i < sizeof reads / sizeof reads[0]; i++) {
      const Onnx__NodeProto *n = g->node[reads[i].node];
      CHECK_MSG(
          (size_t)reads[i].input < n->n_input && !strcmp(n->input[reads[i].input], reads[i].tensor),
          "node %d input %d is %s, not %s", reads[i].node, reads[i].input,
          (size_t)reads[i].input < n->n_input ? n->input[reads[i].input] : "(none)",
          reads[i].tensor);
    }
    CHECK(g->node[3]->n_input == 2 && !strcmp(g->node[3]->output[0], "add_0"));
    CHECK(!strcmp(g->node[12]->name, "add_2") && !strcmp(g->node[12]->output[0], "add_2"));
    CHECK(!strcmp(g->node[15]->output[0], "probabilities"));
  }
  onnx__model_proto__free_unpacked(m, NULL);
  free(params);
}

/* Float attribute name of n is want. */
static int float_is(const Onnx__NodeProto *n, const char *name, float want) {
  const Onnx__AttributeProto *a = attr(n, name);
  return a && a->type == ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT && a->has_f && a->f == want;
}

/* Batch normalization after a bias-less conv (4-D), after a global
 * pooling ((N, C, 1, 1)), after a bias-less dense layer (2-D) and after a
 * flatten (2-D, a feature per channel); nothing reshapes around it. */
static const char *k_bn_model =
    "{\"input\": [2, 6, 6], \"classes\": 3, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": \"same\", "
    "\"bias\": false},"
    "{\"type\": \"batchnorm\", \"momentum\": 0.9, \"epsilon\": 0.0001},"
    "{\"type\": \"relu\"},"
    "{\"type\": \"maxpool\", \"size\": 2},"
    "{\"type\": \"flatten\"},"
    "{\"type\": \"batchnorm\"},"
    "{\"type\": \"dense\", \"units\": 5, \"bias\": false},"
    "{\"type\": \"batchnorm\", \"name\": \"bn_dense\"},"
    "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 1, \"padding\": \"valid\"},"
    "{\"type\": \"global_avgpool\"},"
    "{\"type\": \"batchnorm\", \"epsilon\": 0.5},"
    "{\"type\": \"dense\", \"units\": 3},"
    "{\"type\": \"softmax_xent\"}]}";

static void test_batchnorm_graph(void) {
  ps_model_spec spec;
  float *params;
  Onnx__ModelProto *m = export_model(k_bn_model, "bn.onnx", &spec, &params);
  if (!m) return;
  const Onnx__GraphProto *g = m->graph;
  static const char *const ops[] = {
      "Conv",      "BatchNormalization", "Relu", "MaxPool",           "Flatten",
      "BatchNormalization", "Gemm",      "BatchNormalization", "Unsqueeze",
      "Conv",      "GlobalAveragePool",  "BatchNormalization", "Flatten", "Gemm", "Softmax"};
  const size_t n_ops = sizeof ops / sizeof ops[0];
  check_op_types(g, ops, n_ops);
  check_chain(g);
  const ps_layer *L = spec.layers;
  if (g->n_node == n_ops) {
    /* Bias-less Conv and Gemm: no B, no C; the others keep theirs. */
    CHECK(g->node[0]->n_input == 2 && !strcmp(g->node[0]->input[1], "conv2d_0.w"));
    CHECK(g->node[6]->n_input == 2 && !strcmp(g->node[6]->input[1], "dense_0.w"));
    CHECK(int_is(g->node[6], "transB", 1));
    CHECK(g->node[9]->n_input == 3 && !strcmp(g->node[9]->input[2], "conv2d_1.b"));
    CHECK(g->node[13]->n_input == 3 && !strcmp(g->node[13]->input[2], "dense_1.b"));
    CHECK(!init_named(g, "conv2d_0.b") && !init_named(g, "dense_0.b"));
    static const struct {
      int node;
      const char *name;
      float epsilon, momentum;
    } bns[] = {{1, "batchnorm_0", 1e-4f, 0.9f},
               {5, "batchnorm_1", 1e-3f, 0.99f},
               {7, "bn_dense", 1e-3f, 0.99f},
               {11, "batchnorm_3", 0.5f, 0.99f}};
    for (size_t b = 0; b < sizeof bns / sizeof bns[0]; b++) {
      const Onnx__NodeProto *n = g->node[bns[b].node];
      CHECK_MSG(!strcmp(n->name, bns[b].name) && !strcmp(n->output[0], bns[b].name), "%s",
                n->name);
      CHECK_MSG(float_is(n, "epsilon", bns[b].epsilon) && float_is(n, "momentum", bns[b].momentum),
                "%s: epsilon or momentum", n->name);
      static const char *const what[4] = {"gamma", "beta", "moving_mean", "moving_variance"};
      CHECK(n->n_input == 5);
      for (size_t k = 0; k < 4 && n->n_input == 5; k++) {
        char want[64];
        snprintf(want, sizeof want, "%s.%s", bns[b].name, what[k]);
        CHECK_MSG(!strcmp(n->input[1 + k], want), "%s input %zu: %s", n->name, 1 + k,
                  n->input[1 + k]);
      }
    }
  }
  /* Each batchnorm's four vectors at the layout's offsets. */
  static const int bn_layers[] = {1, 5, 7, 10};
  for (size_t b = 0; b < sizeof bn_layers / sizeof bn_layers[0]; b++) {
    const ps_layer *B = &L[bn_layers[b]];
    const size_t c = B->w_count;
    const int64_t dims[1] = {(int64_t)c};
    char name[64];
    snprintf(name, sizeof name, "%s.gamma", B->name);
    check_param(g, name, params, B->w_off, c, dims, 1);
    snprintf(name, sizeof name, "%s.beta", B->name);
    check_param(g, name, params, B->b_off, c, dims, 1);
    snprintf(name, sizeof name, "%s.moving_mean", B->name);
    check_param(g, name, params, B->s_off, c, dims, 1);
    snprintf(name, sizeof name, "%s.moving_variance", B->name);
    check_param(g, name, params, B->s_off + c, c, dims, 1);
  }
  /* The flatten's 4*3*3 features are its batchnorm's channels. */
  CHECK(L[5].w_count == 36 && L[10].w_count == 3);
  onnx__model_proto__free_unpacked(m, NULL);
  free(params);
}

static void test_refusals(void) {
  ps_model_spec spec;
  char err[PS_ERRLEN] = "", path[128];
  CHECK(ps_model_spec_parse(k_model, &spec, err) == 0);
  float *params = calloc(spec.n_params, sizeof(float));
  snprintf(path, sizeof path, "%s/model.onnx", g_dir);
  char *before = NULL;
  size_t before_len = 0;
  CHECK(ps_read_file(path, &before, &before_len, err) == 0);

  /* A layer type the exporter has no row for (a type a later version
   * adds): refused by name, the file untouched. */
  ps_model_spec odd = spec;
  odd.layers[2].type = (ps_layer_type)99;
  CHECK(ps_onnx_check_spec(&odd, err) == PS_EINVAL && strstr(err, "maxpool_0"));
  CHECK(ps_onnx_export(&odd, params, NULL, path, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "layer 2 (maxpool_0) has no ONNX form"), "%s", err);

  /* Layer names that ONNX tensor names would repeat: the graph's output,
   * or another layer's "<name>.<what>" (its parameters, helpers). */
  odd = spec;
  snprintf(odd.layers[1].name, sizeof odd.layers[1].name, "probabilities");
  CHECK(ps_onnx_export(&odd, params, NULL, path, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "layer 1 is named 'probabilities', the name of the ONNX graph's output"),
            "%s", err);
  odd = spec;
  snprintf(odd.layers[1].name, sizeof odd.layers[1].name, "conv2d_0.w");
  CHECK(strcmp(spec.layers[0].name, "conv2d_0") == 0);
  CHECK(ps_onnx_export(&odd, params, NULL, path, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "which ONNX tensors of layer 'conv2d_0'"), "%s", err);

  CHECK(ps_onnx_export(&spec, params, NULL, g_dir, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "is a directory"), "%s", err);
  char missing[160];
  snprintf(missing, sizeof missing, "%s/missing/model.onnx", g_dir);
  CHECK(ps_onnx_export(&spec, params, NULL, missing, NULL, err) == PS_EIO);
  CHECK_MSG(strstr(err, "No such file or directory"), "%s", err);

  char *after = NULL;
  size_t after_len = 0;
  CHECK(ps_read_file(path, &after, &after_len, err) == 0);
  CHECK(before && after && before_len == after_len && !memcmp(before, after, after_len));
  const char *const keep[] = {"model.onnx"};
  CHECK(dir_holds_only(keep, 1));
  free(before);
  free(after);
  free(params);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "/tmp/ps-test-onnx.XXXXXX");
  if (!mkdtemp(g_dir)) {
    perror("mkdtemp");
    return 1;
  }
  ps_log_init("test_export_onnx", PS_LOG_WARN);
  RUN(test_graph);
  RUN(test_pooling_graph);
  RUN(test_residual_graph);
  RUN(test_batchnorm_graph);
  RUN(test_refusals);
  char path[128];
  snprintf(path, sizeof path, "%s/model.onnx", g_dir);
  unlink(path);
  rmdir(g_dir);
  return check_summary();
}

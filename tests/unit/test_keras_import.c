/* Keras model JSON into model specs: the fixtures written by real tf_keras
 * and Keras 3 (tests/fixtures/keras, made by make_fixtures.py there) and
 * hand-made edge cases. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/keras.h"
#include "../../common/model_spec.h"
#include "../../common/util.h"
#include "check.h"

#ifndef KERAS_FIXTURES
#define KERAS_FIXTURES "tests/fixtures/keras"
#endif

/* Translates a fixture; returns the spec (or NULL, with err). */
static json_t *import_file(const char *name, char *notes, size_t notes_len, char *err) {
  char path[512], *text = NULL;
  snprintf(path, sizeof path, "%s/%s", KERAS_FIXTURES, name);
  if (ps_read_file(path, &text, NULL, err)) return NULL;
  void *spec = NULL;
  int rc = ps_keras_to_spec(text, &spec, notes, notes_len, err);
  free(text);
  return rc ? NULL : spec;
}

static json_t *import_text(const char *text, char *err) {
  void *spec = NULL;
  return ps_keras_to_spec(text, &spec, NULL, 0, err) ? NULL : spec;
}

/* The spec's layers as "type(...)" words, from ps_model_spec_describe. */
static int describe(json_t *spec, char *buf, size_t len) {
  ps_model_spec *ms = calloc(1, sizeof *ms);
  char err[PS_ERRLEN];
  int rc = ps_model_spec_from_json(spec, ms, err);
  if (rc == 0) ps_model_spec_describe(ms, buf, len);
  else snprintf(buf, len, "refused: %s", err);
  free(ms);
  return rc;
}

static void check_sequential_cnn(const char *prefix) {
  char name[64], err[PS_ERRLEN], notes[512], desc[512];
  snprintf(name, sizeof name, "%s_sequential_cnn.json", prefix);
  json_t *spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (!spec) return;
  CHECK(describe(spec, desc, sizeof desc) == 0);
  /* Keras counts 421,642 parameters for this model. */
  CHECK_MSG(!strcmp(desc, "conv2d(32,3x3) relu maxpool(2) conv2d(64,3x3) relu maxpool(2) "
                          "flatten dense(128) relu dropout(0.25) dense(10) softmax_xent(10) "
                          "P=421642"),
            "%s: %s", name, desc);
  json_t *in = json_object_get(spec, "input");
  CHECK(json_array_size(in) == 3 && json_integer_value(json_array_get(in, 0)) == 1 &&
        json_integer_value(json_array_get(in, 1)) == 28 &&
        json_integer_value(json_array_get(in, 2)) == 28);
  CHECK(json_integer_value(json_object_get(spec, "classes")) == 10);
  CHECK_MSG(notes[0] == '\0', "%s: notes '%s' for a softmax output", name, notes);
  json_decref(spec);
}

static void check_functional_chain(const char *prefix) {
  char name[64], err[PS_ERRLEN], notes[512], desc[512];
  snprintf(name, sizeof name, "%s_functional_chain.json", prefix);
  json_t *spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (!spec) return;
  CHECK(describe(spec, desc, sizeof desc) == 0);
  /* Keras: 160 + 4640 + 330 = 5130 parameters; 28 -> 13 (valid, stride 2)
   * -> 13 (same) -> 6 (average pool) -> 1 (global). */
  CHECK_MSG(!strcmp(desc, "conv2d(16,3x3,s2,valid) relu conv2d(32,3x3) relu avgpool(2) "
                          "global_avgpool dense(10) softmax_xent(10) P=5130"),
            "%s: %s", name, desc);
  CHECK_MSG(strstr(notes, "'logits' gives logits") != NULL, "%s: notes '%s'", name, notes);
  json_decref(spec);
}

/* A branch and an Add: the spec names the layers and the add reads both. */
static void check_residual(const char *prefix) {
  char name[64], err[PS_ERRLEN], notes[512], desc[512];
  snprintf(name, sizeof name, "%s_residual.json", prefix);
  json_t *spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (!spec) return;
  CHECK(describe(spec, desc, sizeof desc) == 0);
  /* Keras: 224 + 584 + 90 = 898 parameters. */
  CHECK_MSG(!strcmp(desc, "conv2d(8,3x3) relu conv2d(8,3x3) relu add(stem.relu,branch_relu) "
                          "global_avgpool dense(10) softmax_xent(10) P=898"),
            "%s: %s", name, desc);
  json_t *add = json_array_get(json_object_get(spec, "layers"), 4);
  CHECK(!strcmp(json_string_value(json_object_get(add, "type")), "add") &&
        json_array_size(json_object_get(add, "inputs")) == 2);
  json_decref(spec);
}

/* The spec's layer called name. */
static json_t *layer_named(json_t *spec, const char *name) {
  size_t i;
  json_t *l;
  json_array_foreach(json_object_get(spec, "layers"), i, l) {
    const char *n = json_string_value(json_object_get(l, "name"));
    if (n && !strcmp(n, name)) return l;
  }
  return NULL;
}

/* Layer name is a batchnorm with this momentum and epsilon (as floats:
 * the spec keeps them so). */
static int is_batchnorm(json_t *spec, const char *name, double momentum, double epsilon) {
  json_t *l = layer_named(spec, name);
  return l && !strcmp(json_string_value(json_object_get(l, "type")), "batchnorm") &&
         (float)json_number_value(json_object_get(l, "momentum")) == (float)momentum &&
         (float)json_number_value(json_object_get(l, "epsilon")) == (float)epsilon;
}

/* Batch normalization: bias-less Conv2D and Dense layers say "bias":
 * false; BatchNormalization becomes batchnorm with Keras's momentum and
 * epsilon, after a convolution, a Flatten, a global pooling and a Dense
 * layer, and in a residual block. Keras's parameter counts include the
 * moving mean and variance, as P does. */
static void check_batchnorm_fixtures(const char *prefix) {
  char name[64], err[PS_ERRLEN], notes[512], desc[1024];
  json_t *spec;
  snprintf(name, sizeof name, "%s_conv_bn.json", prefix);
  spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (spec) {
    CHECK(describe(spec, desc, sizeof desc) == 0);
    /* Keras: 216 + 32 + 4608 + 64 + 85 = 5005. */
    CHECK_MSG(!strcmp(desc, "conv2d(8,3x3,nobias) batchnorm relu maxpool(2) flatten "
                            "dense(16,nobias) batchnorm relu dense(5) softmax_xent(5) P=5005"),
              "%s: %s", name, desc);
    CHECK(json_is_false(json_object_get(layer_named(spec, "conv"), "bias")));
    CHECK(json_is_false(json_object_get(layer_named(spec, "fc"), "bias")));
    CHECK(json_object_get(layer_named(spec, "out"), "bias") == NULL);
    CHECK_MSG(is_batchnorm(spec, "conv_bn", 0.9, 1e-5), "%s: conv_bn", name);
    CHECK_MSG(is_batchnorm(spec, "fc_bn", 0.99, 1e-3), "%s: fc_bn", name);
    json_decref(spec);
  }
  snprintf(name, sizeof name, "%s_dense_bn.json", prefix);
  spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (spec) {
    CHECK(describe(spec, desc, sizeof desc) == 0);
    /* Keras: 16 + 60 + 48 + 39 = 163. */
    CHECK_MSG(!strcmp(desc, "global_avgpool batchnorm dense(12) batchnorm relu dense(3) "
                            "softmax_xent(3) P=163"),
              "%s: %s", name, desc);
    CHECK(is_batchnorm(spec, "pool_bn", 0.99, 1e-3) && is_batchnorm(spec, "hidden_bn", 0.99, 1e-3));
    json_decref(spec);
  }
  snprintf(name, sizeof name, "%s_resblock_bn.json", prefix);
  spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (spec) {
    CHECK(describe(spec, desc, sizeof desc) == 0);
    /* Keras: 216 + 32 + 1152 + 64 + 128 + 2304 + 64 + 64 + 170 = 4194;
     * the branch and the shortcut are interleaved as Keras lists them. */
    CHECK_MSG(!strcmp(desc, "conv2d(8,3x3,nobias) batchnorm relu conv2d(16,3x3,nobias) batchnorm "
                            "relu conv2d(16,1x1,nobias)<-stem_relu conv2d(16,3x3,nobias)<-b1_relu "
                            "batchnorm<-proj batchnorm<-b2 add(proj_bn,b2_bn) relu global_avgpool "
                            "dense(10) softmax_xent(10) P=4194"),
              "%s: %s", name, desc);
    json_decref(spec);
  }
  snprintf(name, sizeof name, "%s_residual_bn.json", prefix);
  spec = import_file(name, notes, sizeof notes, err);
  CHECK_MSG(spec != NULL, "%s: %s", name, err);
  if (spec) {
    CHECK(describe(spec, desc, sizeof desc) == 0);
    /* Keras: 432 + 64 + 2320 + 170 = 2986. */
    CHECK_MSG(strstr(desc, "conv2d(16,3x3,nobias) batchnorm relu conv2d(16,3x3) relu add(") &&
                  strstr(desc, "global_avgpool dense(10) softmax_xent(10) P=2986"),
              "%s: %s", name, desc);
    json_decref(spec);
  }
}

static void check_refused(const char *file, const char *want1, const char *want2) {
  char err[PS_ERRLEN] = "", notes[256];
  json_t *spec = import_file(file, notes, sizeof notes, err);
  CHECK_MSG(spec == NULL, "%s was translated", file);
  json_decref(spec);
  CHECK_MSG(strstr(err, want1) && strstr(err, want2), "%s: '%s' lacks '%s' / '%s'", file, err,
            want1, want2);
}

static void check_fixtures(void) {
  static const char *const prefixes[] = {"tf2", "k3"};
  for (int i = 0; i < 2; i++) {
    const char *p = prefixes[i];
    char f[64];
    check_sequential_cnn(p);
    check_functional_chain(p);
    check_residual(p);
    snprintf(f, sizeof f, "%s_dilated.json", p);
    check_refused(f, "(Conv2D)", "dilation_rate (2, 2)");
    snprintf(f, sizeof f, "%s_sigmoid.json", p);
    check_refused(f, "(Dense)", "activation 'sigmoid'");
    snprintf(f, sizeof f, "%s_uneven_same.json", p);
    check_refused(f, "(Conv2D)", "pads 0 before and 1 after");
    check_batchnorm_fixtures(p);
    snprintf(f, sizeof f, "%s_bn_axis.json", p);
    check_refused(f, "(BatchNormalization): axis 1 of a 4-D",
                  "only the channel axis (-1 or 3) is supported");
  }
}

/* A Sequential model as tf_keras writes it, around one layer. */
static json_t *seq_with(const char *layers_json, char *err) {
  char text[4096];
  snprintf(text, sizeof text,
           "{\"class_name\": \"Sequential\", \"config\": {\"name\": \"m\", \"layers\": ["
           "{\"class_name\": \"InputLayer\", \"config\": {\"batch_input_shape\": [null, 8, 8, 2],"
           " \"name\": \"in\"}}, %s]}}",
           layers_json);
  return import_text(text, err);
}

#define DENSE_OUT                                                                  \
  "{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, {\"class_name\": " \
  "\"Dense\", \"config\": {\"name\": \"out\", \"units\": 3, \"activation\": \"softmax\"}}"

static void check_edges(void) {
  char err[PS_ERRLEN] = "", desc[512];
  json_t *s;
  /* The minimal model; channels-last [8, 8, 2] becomes [2, 8, 8]. */
  s = seq_with(DENSE_OUT, err);
  CHECK_MSG(s != NULL, "%s", err);
  if (s) {
    CHECK(describe(s, desc, sizeof desc) == 0);
    CHECK_MSG(!strcmp(desc, "flatten dense(3) softmax_xent(3) P=387"), "%s", desc);
    json_t *in = json_object_get(s, "input");
    CHECK(json_integer_value(json_array_get(in, 0)) == 2);
    json_decref(s);
  }
  /* A Sequential model without an InputLayer: the first layer's shape. */
  s = import_text("{\"class_name\": \"Sequential\", \"config\": {\"layers\": ["
                  "{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\", "
                  "\"batch_input_shape\": [null, 4, 4, 1]}}, "
                  "{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 2}}]}}",
                  err);
  CHECK_MSG(s != NULL, "%s", err);
  json_decref(s);
  /* A softmax as its own layer, and ReLU/Activation layers. */
  s = seq_with("{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "
               "\"kernel_size\": [3, 3], \"strides\": [1, 1], \"padding\": \"same\"}}, "
               "{\"class_name\": \"ReLU\", \"config\": {\"name\": \"r\", \"max_value\": null, "
               "\"negative_slope\": 0.0, \"threshold\": 0.0}}, "
               "{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, "
               "{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 3}}, "
               "{\"class_name\": \"Softmax\", \"config\": {\"name\": \"s\", \"axis\": -1}}",
               err);
  CHECK_MSG(s != NULL, "%s", err);
  if (s) {
    CHECK(describe(s, desc, sizeof desc) == 0);
    CHECK_MSG(!strcmp(desc, "conv2d(4,3x3) relu flatten dense(3) softmax_xent(3) P=847"), "%s",
              desc);
    json_decref(s);
  }
  /* Bias-less Conv2D and Dense layers; BatchNormalization with tf_keras's
   * axis list and Keras 3's int, after a convolution and after a Flatten. */
  s = seq_with("{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "
               "\"kernel_size\": [3, 3], \"padding\": \"same\", \"use_bias\": false}}, "
               "{\"class_name\": \"BatchNormalization\", \"config\": {\"name\": \"b\", "
               "\"axis\": [3], \"momentum\": 0.5, \"epsilon\": 0.01, \"center\": true, "
               "\"scale\": true, \"gamma_regularizer\": null}}, "
               "{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, "
               "{\"class_name\": \"BatchNormalization\", \"config\": {\"name\": \"fb\", "
               "\"axis\": -1}}, "
               "{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 3, "
               "\"use_bias\": false}}",
               err);
  CHECK_MSG(s != NULL, "%s", err);
  if (s) {
    CHECK(describe(s, desc, sizeof desc) == 0);
    /* conv 72, batchnorms 4*4 and 4*256, dense 768 */
    CHECK_MSG(!strcmp(desc, "conv2d(4,3x3,nobias) batchnorm flatten batchnorm dense(3,nobias) "
                            "softmax_xent(3) P=1880"),
              "%s", desc);
    CHECK(is_batchnorm(s, "b", 0.5, 0.01) && is_batchnorm(s, "fb", 0.99, 0.001));
    json_decref(s);
  }
#define BN(cfg)                                                                         \
  "{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "              \
  "\"kernel_size\": [3, 3]}}, {\"class_name\": \"BatchNormalization\", \"config\": {\"name\": " \
  "\"bn\"" cfg "}}, " DENSE_OUT
  /* Each refusal names the layer and the reason. */
  struct {
    const char *layers, *want;
  } bad[] = {
      {"{\"class_name\": \"LSTM\", \"config\": {\"name\": \"l\"}}, " DENSE_OUT,
       "layer 'l' (LSTM): unsupported layer type"},
      {"{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "
       "\"kernel_size\": [3, 5]}}, " DENSE_OUT,
       "kernel 3x5"},
      {"{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "
       "\"kernel_size\": [3, 3], \"data_format\": \"channels_first\"}}, " DENSE_OUT,
       "data_format 'channels_first'"},
      {"{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "
       "\"kernel_size\": [2, 2], \"padding\": \"same\"}}, " DENSE_OUT,
       "pads 0 before and 1 after"},
      {"{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 4, "
       "\"kernel_size\": [3, 3], \"kernel_regularizer\": {\"class_name\": \"L2\"}}}, " DENSE_OUT,
       "kernel_regularizer is set"},
      {"{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 3}}",
       "Dense on a 8x8x2 input"},
      {"{\"class_name\": \"MaxPooling2D\", \"config\": {\"name\": \"p\", \"pool_size\": [3, 3], "
       "\"padding\": \"same\"}}, " DENSE_OUT,
       "padding 'same' pads"},
      {"{\"class_name\": \"ReLU\", \"config\": {\"name\": \"r\", \"negative_slope\": 0.1}}, " DENSE_OUT,
       "leaky"},
      {DENSE_OUT ", {\"class_name\": \"Dense\", \"config\": {\"name\": \"e\", \"units\": 2}}",
       "after the softmax"},
      {"{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}",
       "it must end with a Dense layer"},
      {"{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, {\"class_name\": \"Dense\", "
       "\"config\": {\"name\": \"one\", \"units\": 1, \"activation\": \"sigmoid\"}}",
       "activation 'sigmoid'"},
      {"{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, {\"class_name\": \"Dense\", "
       "\"config\": {\"name\": \"one\", \"units\": 1}}",
       "has 1 unit"},
      {"{\"class_name\": \"Dropout\", \"config\": {\"name\": \"x\", \"rate\": 1.5}}, " DENSE_OUT,
       "'rate' is not a number in [0, 1)"},
      {"{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 3, \"trainable\": "
       "false}}",
       "frozen"},
      /* BatchNormalization the spec cannot hold. */
      {BN(", \"axis\": 2"), "layer 'bn' (BatchNormalization): axis 2 of a 4-D"},
      {BN(", \"axis\": [1, 2]"), "'axis' is not one integer"},
      {DENSE_OUT ", {\"class_name\": \"BatchNormalization\", \"config\": {\"name\": \"bn\"}}",
       "after the softmax"},
      {"{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, {\"class_name\": "
       "\"Dense\", \"config\": {\"name\": \"d\", \"units\": 3}}, {\"class_name\": "
       "\"BatchNormalization\", \"config\": {\"name\": \"bn\"}}",
       "ends with 'bn' (BatchNormalization): it must end with a Dense layer"},
      {"{\"class_name\": \"Flatten\", \"config\": {\"name\": \"f\"}}, {\"class_name\": "
       "\"BatchNormalization\", \"config\": {\"name\": \"bn\", \"axis\": 3}}, " DENSE_OUT,
       "axis 3 of a 2-D (batch, features) input: only the channel axis (-1 or 1)"},
      {BN(", \"scale\": false"), "layer 'bn' (BatchNormalization): scale false (no gamma)"},
      {BN(", \"center\": false"), "layer 'bn' (BatchNormalization): center false (no beta)"},
      {BN(", \"epsilon\": 1e-6"), "layer 'bn' (BatchNormalization): epsilon 1e-06 is below 1e-05"},
      {BN(", \"epsilon\": 0"), "'epsilon' is not a number in (0, 1]"},
      {BN(", \"momentum\": 1.0"), "'momentum' is not a number in [0, 1)"},
      {BN(", \"renorm\": true"), "renorm true (batch renormalization): not supported"},
      {BN(", \"virtual_batch_size\": 8"), "virtual_batch_size is set"},
      {BN(", \"gamma_regularizer\": {\"class_name\": \"L2\"}"), "gamma_regularizer is set"},
      {BN(", \"trainable\": false"), "layer 'bn' (BatchNormalization): trainable false"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    err[0] = '\0';
    s = seq_with(bad[i].layers, err);
    CHECK_MSG(s == NULL && strstr(err, bad[i].want), "case %zu: '%s' lacks '%s'", i, err,
              bad[i].want);
    json_decref(s);
  }
  /* Not a model at all. */
  const char *not_models[][2] = {
      {"[1, 2]", "not an object"},
      {"{\"class_name\": \"Sequential\"}", "no 'class_name' and 'config'"},
      {"{\"class_name\": \"Sequential\", \"config\": {\"layers\": []}}", "no 'layers'"},
      {"{\"class_name\": \"Custom\", \"config\": {\"layers\": [1]}}", "Sequential and functional"},
      {"{\"class_name\": \"Sequential\", \"config\": {\"layers\": [7]}}", "layer 0 has no"},
      {"{\"a\": 1, \"a\": 2}", "not JSON"},
      {"{", "not JSON"},
  };
  for (size_t i = 0; i < sizeof not_models / sizeof not_models[0]; i++) {
    err[0] = '\0';
    s = import_text(not_models[i][0], err);
    CHECK_MSG(s == NULL && strstr(err, not_models[i][1]), "'%s': '%s'", not_models[i][0], err);
    json_decref(s);
  }
  /* A functional model whose layer is called twice, and one that is not a
   * chain (the second layer reads the input, not the first layer). */
  const char *fn_bad[][2] = {
      {"{\"class_name\": \"Functional\", \"config\": {\"layers\": ["
       "{\"class_name\": \"InputLayer\", \"name\": \"i\", \"config\": {\"batch_input_shape\": "
       "[null, 4, 4, 1]}, \"inbound_nodes\": []},"
       "{\"class_name\": \"Flatten\", \"name\": \"f\", \"config\": {}, \"inbound_nodes\": "
       "[[[\"i\", 0, 0, {}]], [[\"i\", 0, 0, {}]]]}],"
       "\"input_layers\": [[\"i\", 0, 0]], \"output_layers\": [[\"f\", 0, 0]]}}",
       "called 2 times"},
      {"{\"class_name\": \"Functional\", \"config\": {\"layers\": ["
       "{\"class_name\": \"InputLayer\", \"name\": \"i\", \"config\": {\"batch_input_shape\": "
       "[null, 4, 4, 1]}, \"inbound_nodes\": []},"
       "{\"class_name\": \"Flatten\", \"name\": \"f\", \"config\": {}, \"inbound_nodes\": "
       "[[[\"i\", 0, 0, {}]]]},"
       "{\"class_name\": \"Flatten\", \"name\": \"g\", \"config\": {}, \"inbound_nodes\": "
       "[[[\"d\", 0, 0, {}]]]},"
       "{\"class_name\": \"Dense\", \"name\": \"d\", \"config\": {\"units\": 2}, "
       "\"inbound_nodes\": [[[\"g\", 0, 0, {}]]]}],"
       "\"input_layers\": [[\"i\", 0, 0]], \"output_layers\": [[\"d\", 0, 0]]}}",
       "takes 'd', which is not an earlier layer"},
      {"{\"class_name\": \"Functional\", \"config\": {\"layers\": ["
       "{\"class_name\": \"InputLayer\", \"name\": \"i\", \"config\": {\"batch_input_shape\": "
       "[null, 4, 4, 1]}, \"inbound_nodes\": []}],"
       "\"input_layers\": [[\"i\", 0, 0], [\"j\", 0, 0]], \"output_layers\": [[\"i\", 0, 0]]}}",
       "2 inputs: one only"},
  };
  for (size_t i = 0; i < sizeof fn_bad / sizeof fn_bad[0]; i++) {
    err[0] = '\0';
    s = import_text(fn_bad[i][0], err);
    CHECK_MSG(s == NULL && strstr(err, fn_bad[i][1]), "functional %zu: '%s'", i, err);
    json_decref(s);
  }
}

/* Keras's weights into the flat parameter vector: conv kernels from (KH,
 * KW, IC, OC), dense kernels from (IN, OUT) with a Flatten's (h, w, c)
 * feature order turned into (c, h, w). */
static void check_weights(void) {
  const char *model =
      "{\"class_name\": \"Sequential\", \"config\": {\"layers\": ["
      "{\"class_name\": \"InputLayer\", \"config\": {\"batch_input_shape\": [null, 4, 3, 2]}},"
      "{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 2, "
      "\"kernel_size\": [3, 3], \"padding\": \"same\"}},"
      "{\"class_name\": \"Flatten\", \"config\": {}},"
      "{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 3, "
      "\"activation\": \"softmax\"}}]}}";
  char err[PS_ERRLEN] = "";
  void *specv = NULL;
  ps_model_spec *spec = calloc(1, sizeof *spec);
  CHECK(ps_keras_to_spec(model, &specv, NULL, 0, err) == 0);
  CHECK(ps_model_spec_from_json(specv, spec, err) == 0);
  json_decref(specv);
  /* conv 2*2*9 + 2 = 38, dense 3*24 + 3 = 75 */
  CHECK(spec->n_params == 113);
  float kc[3 * 3 * 2 * 2], bc[2] = {0.5f, -0.5f}, kd[24 * 3], bd[3] = {7, 8, 9};
  for (int i = 0; i < 36; i++) kc[i] = (float)i;  /* index (kh, kw, ic, oc) */
  for (int i = 0; i < 72; i++) kd[i] = (float)i;  /* index (in, out) */
  ps_keras_tensor t[4] = {{kc, 4, {3, 3, 2, 2}}, {bc, 1, {2}}, {kd, 2, {24, 3}}, {bd, 1, {3}}};
  float *params = calloc(spec->n_params, sizeof(float));
  int rc = ps_keras_weights(model, spec, t, 4, params, err);
  CHECK_MSG(rc == 0, "%s", err);
  const ps_layer *c = &spec->layers[0], *d = &spec->layers[2];
  CHECK(c->type == PS_LAYER_CONV2D && d->type == PS_LAYER_DENSE);
  /* conv: ours (oc=1, ic=0, kh=2, kw=1) is Keras (kh=2, kw=1, ic=0, oc=1):
   * ((2*3 + 1)*2 + 0)*2 + 1 = 29. */
  CHECK(params[c->w_off + ((1 * 2 + 0) * 3 + 2) * 3 + 1] == 29.0f);
  /* ours (oc=0, ic=1, kh=0, kw=2): Keras ((0*3 + 2)*2 + 1)*2 + 0 = 10. */
  CHECK(params[c->w_off + ((0 * 2 + 1) * 3 + 0) * 3 + 2] == 10.0f);
  CHECK(params[c->b_off] == 0.5f && params[c->b_off + 1] == -0.5f);
  /* dense: our input 19 is (c=1, h=2, w=1) of the 2x4x3 conv output; in
   * Keras's (h, w, c) order it is (2*3 + 1)*2 + 1 = 15; unit 2: 15*3 + 2. */
  CHECK(params[d->w_off + 2 * 24 + 19] == 47.0f);
  /* our input 0 (c=0, h=0, w=0) is Keras's 0; our input 12 (c=1, h=0,
   * w=0) is Keras's 1. */
  CHECK(params[d->w_off + 0 * 24 + 0] == 0.0f);
  CHECK(params[d->w_off + 1 * 24 + 12] == 4.0f);
  CHECK(params[d->b_off + 2] == 9.0f);
  /* A wrong count or shape is refused, naming what was wanted. */
  CHECK(ps_keras_weights(model, spec, t, 3, params, err) == PS_EINVAL &&
        strstr(err, "3 weight arrays for a model with 2 layers with weights: 4 wanted"));
  ps_keras_tensor bad[4];
  memcpy(bad, t, sizeof bad);
  bad[0].shape[2] = 1;
  CHECK(ps_keras_weights(model, spec, bad, 4, params, err) == PS_EINVAL &&
        strstr(err, "arrays 0 and 1 ((3, 3, 1, 2), (2,)) are not the kernel (3, 3, 2, 2)"));
  memcpy(bad, t, sizeof bad);
  bad[2].shape[0] = 3;
  bad[2].shape[1] = 24;
  CHECK(ps_keras_weights(model, spec, bad, 4, params, err) == PS_EINVAL &&
        strstr(err, "not the kernel (24, 3)"));
  /* A spec that is not the Keras model's. */
  ps_model_spec *other = calloc(1, sizeof *other);
  CHECK(ps_model_spec_parse("{\"input\": [2, 4, 3], \"classes\": 3, \"layers\": ["
                            "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 3}, "
                            "{\"type\": \"softmax_xent\"}]}",
                            other, err) == 0);
  CHECK(ps_keras_weights(model, other, t, 4, params, err) == PS_EINVAL &&
        strstr(err, "but 'dense_0' in the job's model"));
  free(other);
  free(params);
  free(spec);
}

/* Bias-less layers take their kernel alone; BatchNormalization's gamma,
 * beta, moving_mean and moving_variance go to w, b and the two halves of
 * s, reordered from (h, w, c) to (c, h, w) after a Flatten like a Dense
 * layer's inputs. A negative moving variance, a missing array and a job
 * whose epsilon differs are refused, naming the layer. */
static void check_batchnorm_weights(void) {
  const char *model =
      "{\"class_name\": \"Sequential\", \"config\": {\"layers\": ["
      "{\"class_name\": \"InputLayer\", \"config\": {\"batch_input_shape\": [null, 2, 3, 1]}},"
      "{\"class_name\": \"Conv2D\", \"config\": {\"name\": \"c\", \"filters\": 2, "
      "\"kernel_size\": [1, 1], \"use_bias\": false}},"
      "{\"class_name\": \"BatchNormalization\", \"config\": {\"name\": \"cb\", \"axis\": [3]}},"
      "{\"class_name\": \"Flatten\", \"config\": {}},"
      "{\"class_name\": \"BatchNormalization\", \"config\": {\"name\": \"fb\", "
      "\"epsilon\": 0.01}},"
      "{\"class_name\": \"Dense\", \"config\": {\"name\": \"d\", \"units\": 2, "
      "\"use_bias\": false, \"activation\": \"softmax\"}}]}}";
  char err[PS_ERRLEN] = "";
  void *specv = NULL;
  ps_model_spec *spec = calloc(1, sizeof *spec);
  CHECK(ps_keras_to_spec(model, &specv, NULL, 0, err) == 0);
  CHECK_MSG(ps_model_spec_from_json(specv, spec, err) == 0, "%s", err);
  json_decref(specv);
  /* conv 2, cb 4*2, fb 4*12, dense 12*2 */
  CHECK_MSG(spec->n_params == 82, "P=%zu", spec->n_params);
  const ps_layer *c = &spec->layers[0], *cb = &spec->layers[1], *fb = &spec->layers[3],
                 *d = &spec->layers[4];
  CHECK(c->b_count == 0 && cb->type == PS_LAYER_BATCHNORM && fb->type == PS_LAYER_BATCHNORM &&
        d->b_count == 0 && fb->w_count == 12);
  float kc[2] = {3, 4}, cg[2] = {1.5f, 2.5f}, cbeta[2] = {-1, 1}, cm[2] = {0.25f, -0.25f},
        cv[2] = {2, 0.5f}, fg[12], fbeta[12], fm[12], fv[12], kd[24];
  for (int i = 0; i < 12; i++) {
    /* Keras feature i of the 2x3x2 (h, w, c) flattening */
    fg[i] = 100.0f + (float)i;
    fbeta[i] = 200.0f + (float)i;
    fm[i] = 300.0f + (float)i;
    fv[i] = 400.0f + (float)i;
  }
  for (int i = 0; i < 24; i++) kd[i] = (float)i;
  ps_keras_tensor t[10] = {{kc, 4, {1, 1, 1, 2}}, {cg, 1, {2}},  {cbeta, 1, {2}}, {cm, 1, {2}},
                           {cv, 1, {2}},          {fg, 1, {12}}, {fbeta, 1, {12}}, {fm, 1, {12}},
                           {fv, 1, {12}},         {kd, 2, {12, 2}}};
  float *params = calloc(spec->n_params, sizeof(float));
  int rc = ps_keras_weights(model, spec, t, 10, params, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(params[c->w_off] == 3.0f && params[c->w_off + 1] == 4.0f);
  CHECK(params[cb->w_off + 1] == 2.5f && params[cb->b_off] == -1.0f);
  CHECK(params[cb->s_off] == 0.25f && params[cb->s_off + 1] == -0.25f);
  CHECK(params[cb->s_off + 2] == 2.0f && params[cb->s_off + 3] == 0.5f);
  /* Our feature 7 is (c=1, h=0, w=1): Keras's (0*3 + 1)*2 + 1 = 3. */
  CHECK(params[fb->w_off + 7] == 103.0f && params[fb->b_off + 7] == 203.0f);
  CHECK(params[fb->s_off + 7] == 303.0f && params[fb->s_off + 12 + 7] == 403.0f);
  /* Our feature 2 is (c=0, h=0, w=2): Keras's 4. */
  CHECK(params[fb->s_off + 12 + 2] == 404.0f);
  CHECK(params[d->w_off + 1 * 12 + 7] == kd[3 * 2 + 1]);
  CHECK(spec->layers[3].epsilon == 0.01f);
  /* Refusals. */
  CHECK(ps_keras_weights(model, spec, t, 9, params, err) == PS_EINVAL &&
        strstr(err, "9 weight arrays for a model with 4 layers with weights: 10 wanted") &&
        strstr(err, "moving_variance per BatchNormalization"));
  cv[1] = -0.5f;
  CHECK(ps_keras_weights(model, spec, t, 10, params, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "array 4, the moving_variance of 'cb', holds -0.5 at 1: a variance "
                        "cannot be negative"),
            "%s", err);
  cv[1] = 0.5f;
  ps_keras_tensor bad[10];
  memcpy(bad, t, sizeof bad);
  bad[7].shape[0] = 11;
  CHECK(ps_keras_weights(model, spec, bad, 10, params, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "array 7 (11,) is not the moving_mean (12,) of 'fb'"), "%s", err);
  memcpy(bad, t, sizeof bad);
  bad[9].shape[1] = 3;
  CHECK(ps_keras_weights(model, spec, bad, 10, params, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "array 9 (12, 3) is not the kernel (12, 2) of 'd' (use_bias false"), "%s",
            err);
  /* A job whose batchnorm has another epsilon computes something else. */
  ps_model_spec *other = malloc(sizeof *other);
  memcpy(other, spec, sizeof *other);
  other->layers[3].epsilon = 0.001f;
  CHECK(ps_keras_weights(model, other, t, 10, params, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "'fb', has epsilon 0.001 in the job's model but 0.01 in Keras"), "%s",
            err);
  /* ... and one whose conv2d has a bias is another model. */
  memcpy(other, spec, sizeof *other);
  other->layers[0].b_count = 2;
  CHECK(ps_keras_weights(model, other, t, 10, params, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "conv2d(2, 1x1, no bias) in Keras but 'c'"), "%s", err);
  free(other);
  free(params);
  free(spec);
}

int main(void) {
  check_fixtures();
  check_edges();
  check_weights();
  check_batchnorm_weights();
  return check_summary();
}

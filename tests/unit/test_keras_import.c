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
    snprintf(f, sizeof f, "%s_residual_bn.json", p);
    check_refused(f, "(Conv2D)", "use_bias false");
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
       "\"kernel_size\": [3, 3], \"use_bias\": false}}, " DENSE_OUT,
       "use_bias false"},
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

int main(void) {
  check_fixtures();
  check_edges();
  check_weights();
  return check_summary();
}

/* Keras model JSON to model spec; see keras.h. */
#include "keras.h"

#include <ctype.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "model_spec.h"
#include "util.h"

#define MAX_KERAS_LAYERS 512

typedef struct {
  const char *cls;    /* class_name */
  const char *name;   /* the layer's name */
  json_t *cfg;        /* config */
  int n_in;           /* inbound tensors of its one call (0 for an input) */
  const char *in[PS_MAX_LAYER_INPUTS]; /* the layers they come from (the first ones) */
  int n_calls;        /* how many times the layer is called */
  int src[PS_MAX_LAYER_INPUTS]; /* the indices of the layers in[] names */
} klayer;

/* A layer with weights, in the order of Keras's model.get_weights(). */
enum { KW_CONV2D, KW_DENSE, KW_BATCHNORM };
typedef struct {
  int kind;           /* KW_* */
  int bias;           /* Conv2D, Dense: use_bias (a bias array follows the kernel) */
  int k, ic, oc;      /* Conv2D: kernel, input channels, filters */
  int in, units;      /* Dense: input features, units */
  int c;              /* BatchNormalization: the values normalized (channels or features) */
  float momentum, epsilon; /* BatchNormalization */
  /* Dense or BatchNormalization after a Flatten of an (fh, fw, fc) input:
   * its features come in Keras's (h, w, c) order; 0 if none. */
  int fh, fw, fc;
  const char *name;
} kweights;

/* How many arrays of model.get_weights() the layer holds. */
static int kw_arrays(const kweights *kw) { return kw->kind == KW_BATCHNORM ? 4 : 1 + kw->bias; }

/* What a Keras layer's output is here: the spec layer holding it ("input"
 * for the model's input) and its shape. */
typedef struct {
  char spec[32];
  int c, h, w, flat, fh, fw, fc;
} kout;

typedef struct {
  json_t *layers; /* the spec's "layers" */
  char prev[32];     /* the spec layer emitted last ("input" before any) */
  char pending[32];  /* the input the next emitted layer must name, or "" */
  int emitted;       /* spec layers emitted for the current Keras layer */
  int n_names;       /* spec layers named so far */
  kweights *plan; /* NULL: not wanted */
  int n_plan;
  int fh, fw, fc; /* the spatial shape the current flat features came from */
  int c, h, w;    /* the current activation, channels first */
  int flat;       /* after Flatten, GlobalAveragePooling2D or Dense */
  int have_dense, after_dense, dense_units, softmax;
  const char *last_name, *last_cls, *dense_name;
  const char *dense_act; /* the last Dense's activation */
  char *notes;
  size_t notes_len;
} xlate;

static int lerr(char *err, const klayer *L, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int lerr(char *err, const klayer *L, const char *fmt, ...) {
  char what[PS_ERRLEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return ps_seterr(err, PS_EINVAL, "keras: layer '%.48s' (%.32s): %.160s", L->name, L->cls, what);
}

static void note(xlate *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(xlate *x, const char *fmt, ...) {
  if (!x->notes || x->notes_len == 0) return;
  size_t used = strlen(x->notes);
  if (used + 1 >= x->notes_len) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(x->notes + used, x->notes_len - used, fmt, ap);
  va_end(ap);
  used = strlen(x->notes);
  if (used + 1 < x->notes_len) {
    x->notes[used] = '\n';
    x->notes[used + 1] = '\0';
  }
}

static const char *str_field(json_t *obj, const char *key) {
  json_t *v = json_object_get(obj, key);
  return json_is_string(v) ? json_string_value(v) : NULL;
}

static int is_null(json_t *obj, const char *key) {
  json_t *v = json_object_get(obj, key);
  return v == NULL || json_is_null(v);
}

/* An int, or a pair [a, b] (Keras writes tuples as lists). */
static int int_pair(json_t *cfg, const char *key, int *a, int *b) {
  json_t *v = json_object_get(cfg, key);
  if (json_is_integer(v)) {
    *a = *b = (int)json_integer_value(v);
    return 0;
  }
  if (json_is_array(v) && json_array_size(v) == 2 && json_is_integer(json_array_get(v, 0)) &&
      json_is_integer(json_array_get(v, 1))) {
    *a = (int)json_integer_value(json_array_get(v, 0));
    *b = (int)json_integer_value(json_array_get(v, 1));
    return 0;
  }
  return -1;
}

/* The layer a Keras 3 tensor reference ({"class_name": "__keras_tensor__",
 * "config": {"keras_history": [name, node, index]}}) or a tf_keras one
 * ([name, node, index, kwargs]) comes from; NULL if it is neither. */
static const char *tensor_source(json_t *t) {
  if (json_is_array(t) && json_array_size(t) >= 3 && json_is_string(json_array_get(t, 0)))
    return json_string_value(json_array_get(t, 0));
  if (json_is_object(t)) {
    json_t *h = json_object_get(json_object_get(t, "config"), "keras_history");
    if (json_is_array(h) && json_array_size(h) >= 1 && json_is_string(json_array_get(h, 0)))
      return json_string_value(json_array_get(h, 0));
  }
  return NULL;
}

static void add_input(klayer *L, const char *src) {
  if (L->n_in < PS_MAX_LAYER_INPUTS) L->in[L->n_in] = src;
  L->n_in++;
}

/* The inputs of a functional model's layer from its inbound_nodes. */
static int read_inbound(klayer *L, json_t *nodes, char *err) {
  if (nodes == NULL || json_is_null(nodes)) return 0;
  if (!json_is_array(nodes)) return lerr(err, L, "'inbound_nodes' is not a list");
  L->n_calls = (int)json_array_size(nodes);
  if (L->n_calls > 1)
    return lerr(err, L, "called %d times: shared layers are not supported", L->n_calls);
  if (L->n_calls == 0) return 0;
  json_t *node = json_array_get(nodes, 0);
  json_t *args = node;
  if (json_is_object(node)) { /* Keras 3: {"args": [tensor or [tensors]], "kwargs": {}} */
    args = json_object_get(node, "args");
    if (!json_is_array(args) || json_array_size(args) == 0)
      return lerr(err, L, "an inbound node without 'args'");
    json_t *first = json_array_get(args, 0);
    if (json_is_array(first)) args = first;
    else if (json_array_size(args) > 1)
      return lerr(err, L, "called with %zu positional arguments", json_array_size(args));
  }
  if (!json_is_array(args)) return lerr(err, L, "an inbound node is not a list");
  size_t i;
  json_t *t;
  json_array_foreach(args, i, t) {
    const char *src = tensor_source(t);
    if (!src) return lerr(err, L, "inbound tensor %zu names no layer", i);
    add_input(L, src);
  }
  return 0;
}

/* [null, H, W, C] into the current shape. */
static int set_input_shape(xlate *x, const klayer *L, json_t *shape, char *err) {
  if (!json_is_array(shape)) return lerr(err, L, "no input shape");
  size_t n = json_array_size(shape);
  if (n != 4)
    return lerr(err, L,
                "input shape of %zu dimensions: images (batch, height, width, channels) only",
                n);
  int d[3];
  for (size_t i = 1; i < 4; i++) {
    json_t *v = json_array_get(shape, i);
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 65536)
      return lerr(err, L, "input dimension %zu is not a positive size (sizes must be fixed)", i);
    d[i - 1] = (int)json_integer_value(v);
  }
  x->h = d[0];
  x->w = d[1];
  x->c = d[2];
  x->flat = 0;
  return 0;
}

static json_t *input_shape_of(json_t *cfg) {
  json_t *s = json_object_get(cfg, "batch_input_shape");
  if (!s) s = json_object_get(cfg, "batch_shape");
  return s;
}

static int check_channels_last(const klayer *L, char *err) {
  const char *df = str_field(L->cfg, "data_format");
  if (df && strcmp(df, "channels_last") != 0)
    return lerr(err, L, "data_format '%.24s': only channels_last is supported", df);
  return 0;
}

static int check_plain(const klayer *L, char *err) {
  json_t *tr = json_object_get(L->cfg, "trainable");
  if (json_is_false(tr)) return lerr(err, L, "trainable false: frozen layers are not supported");
  static const char *const regs[] = {"kernel_regularizer", "bias_regularizer",
                                     "activity_regularizer", "kernel_constraint",
                                     "bias_constraint"};
  for (size_t i = 0; i < sizeof regs / sizeof regs[0]; i++)
    if (!is_null(L->cfg, regs[i])) return lerr(err, L, "%s is set: not supported", regs[i]);
  return 0;
}

/* Appends a spec layer for Keras layer L, named after it (its first spec
 * layer takes L's name, e.g. "conv2d_1", the next ones a suffix, e.g.
 * "conv2d_1.relu"; a name too long for the spec becomes "k<N>"), reading
 * x->pending when the input is not the layer emitted before. */
static int emit(xlate *x, const klayer *L, json_t *layer, char *err) {
  char name[32];
  const char *type = layer ? json_string_value(json_object_get(layer, "type")) : NULL;
  int n = x->emitted ? snprintf(name, sizeof name, "%s.%s", L->name, type ? type : "x")
                     : snprintf(name, sizeof name, "%s", L->name);
  int usable = n > 0 && (size_t)n < sizeof name && strcmp(name, "input") != 0;
  for (int i = 0; usable && name[i]; i++)
    usable = isalnum((unsigned char)name[i]) || strchr("_.-", name[i]) != NULL;
  if (!usable) snprintf(name, sizeof name, "k%d", x->n_names);
  x->n_names++;
  if (!layer || json_object_set_new(layer, "name", json_string(name)) ||
      (x->pending[0] &&
       json_object_set_new(layer, "inputs", json_pack("[s]", x->pending))) ||
      json_array_append_new(x->layers, layer))
    return ps_seterr(err, PS_ENOMEM, "keras: out of memory at layer '%.48s'", L->name);
  x->pending[0] = '\0';
  x->emitted++;
  snprintf(x->prev, sizeof x->prev, "%s", name);
  return 0;
}

/* An activation (of a layer or an Activation layer). */
static int activation(xlate *x, const klayer *L, const char *act, char *err) {
  if (!act || !strcmp(act, "linear")) return 0;
  if (!strcmp(act, "relu")) return emit(x, L, json_pack("{s:s}", "type", "relu"), err);
  if (!strcmp(act, "softmax")) {
    x->softmax = 1;
    return 0;
  }
  return lerr(err, L, "activation '%.32s' is not supported (relu, softmax and linear are)", act);
}

/* Keras's "same" padding of one dimension: the output size and the padding
 * before and after (TensorFlow puts an odd extra one after). */
static void same_padding(int in, int k, int s, int *out, int *before, int *after) {
  *out = (in + s - 1) / s;
  int total = (*out - 1) * s + k - in;
  if (total < 0) total = 0;
  *before = total / 2;
  *after = total - *before;
}

static int conv2d(xlate *x, const klayer *L, char *err) {
  int rc, kh, kw, sh, sw, dh = 1, dw = 1;
  if ((rc = check_channels_last(L, err)) || (rc = check_plain(L, err))) return rc;
  if (x->flat) return lerr(err, L, "a convolution after Flatten or Dense");
  json_t *f = json_object_get(L->cfg, "filters");
  if (!json_is_integer(f) || json_integer_value(f) < 1 || json_integer_value(f) > 65536)
    return lerr(err, L, "'filters' is not a positive integer");
  if (int_pair(L->cfg, "kernel_size", &kh, &kw)) return lerr(err, L, "no 'kernel_size'");
  if (kh != kw) return lerr(err, L, "kernel %dx%d: only square kernels are supported", kh, kw);
  if (int_pair(L->cfg, "strides", &sh, &sw)) sh = sw = 1;
  if (sh != sw || sh < 1) return lerr(err, L, "strides (%d, %d): equal strides only", sh, sw);
  if (json_object_get(L->cfg, "dilation_rate") && int_pair(L->cfg, "dilation_rate", &dh, &dw))
    return lerr(err, L, "bad 'dilation_rate'");
  if (dh != 1 || dw != 1) return lerr(err, L, "dilation_rate (%d, %d): not supported", dh, dw);
  json_t *g = json_object_get(L->cfg, "groups");
  if (g && !(json_is_integer(g) && json_integer_value(g) == 1))
    return lerr(err, L, "groups other than 1: not supported");
  /* Without a bias (as before a BatchNormalization) the spec says "bias": false. */
  const int bias = !json_is_false(json_object_get(L->cfg, "use_bias"));
  const char *pad = str_field(L->cfg, "padding");
  if (!pad) pad = "valid";
  int oh, ow;
  if (!strcmp(pad, "valid")) {
    if (x->h < kh || x->w < kw)
      return lerr(err, L, "kernel %d larger than its %dx%d input", kh, x->h, x->w);
    oh = (x->h - kh) / sh + 1;
    ow = (x->w - kw) / sw + 1;
  } else if (!strcmp(pad, "same")) {
    int bh, ah, bw, aw;
    same_padding(x->h, kh, sh, &oh, &bh, &ah);
    same_padding(x->w, kw, sw, &ow, &bw, &aw);
    /* Here "same" pads kernel/2 on every side. */
    if (bh != kh / 2 || ah != kh / 2 || bw != kw / 2 || aw != kw / 2)
      return lerr(err, L,
                  "padding 'same' on a %dx%d input pads %d before and %d after here (kernel %d, "
                  "stride %d): only even padding is supported; use 'valid' or another size",
                  x->h, x->w, bh, ah, kh, sh);
  } else {
    return lerr(err, L, "padding '%.16s' is not supported", pad);
  }
  json_t *layer = json_pack("{s:s,s:I,s:i,s:i,s:s}", "type", "conv2d", "filters",
                            json_integer_value(f), "kernel", kh, "stride", sh, "padding", pad);
  if (layer && !bias && json_object_set_new(layer, "bias", json_false())) {
    json_decref(layer);
    layer = NULL;
  }
  if ((rc = emit(x, L, layer, err))) return rc;
  if (x->plan && x->n_plan < MAX_KERAS_LAYERS)
    x->plan[x->n_plan++] = (kweights){.kind = KW_CONV2D, .bias = bias, .k = kh, .ic = x->c,
                                      .oc = (int)json_integer_value(f), .name = L->name};
  x->c = (int)json_integer_value(f);
  x->h = oh;
  x->w = ow;
  x->after_dense = 1;
  return activation(x, L, str_field(L->cfg, "activation"), err);
}

static int dense(xlate *x, const klayer *L, char *err) {
  int rc;
  if ((rc = check_plain(L, err))) return rc;
  if (!x->flat && (x->h > 1 || x->w > 1))
    return lerr(err, L,
                "Dense on a %dx%dx%d input acts on each position: put Flatten or "
                "GlobalAveragePooling2D before it",
                x->h, x->w, x->c);
  json_t *u = json_object_get(L->cfg, "units");
  if (!json_is_integer(u) || json_integer_value(u) < 1 || json_integer_value(u) > (1 << 24))
    return lerr(err, L, "'units' is not a positive integer");
  const int bias = !json_is_false(json_object_get(L->cfg, "use_bias"));
  json_t *layer = json_pack("{s:s,s:I}", "type", "dense", "units", json_integer_value(u));
  if (layer && !bias && json_object_set_new(layer, "bias", json_false())) {
    json_decref(layer);
    layer = NULL;
  }
  if ((rc = emit(x, L, layer, err))) return rc;
  if (x->plan && x->n_plan < MAX_KERAS_LAYERS) {
    kweights kw = {.kind = KW_DENSE, .bias = bias, .in = x->c * x->h * x->w,
                   .units = (int)json_integer_value(u), .name = L->name};
    if (x->flat && x->fh * x->fw > 1) {
      kw.fh = x->fh;
      kw.fw = x->fw;
      kw.fc = x->fc;
    }
    x->plan[x->n_plan++] = kw;
  }
  x->c = (int)json_integer_value(u);
  x->h = x->w = 1;
  x->fh = x->fw = x->fc = 0;
  x->flat = 1;
  x->have_dense = 1;
  x->after_dense = 0;
  x->dense_units = x->c;
  x->dense_name = L->name;
  x->dense_act = str_field(L->cfg, "activation");
  return activation(x, L, x->dense_act, err);
}

static int pooling(xlate *x, const klayer *L, const char *type, char *err) {
  int rc, ph, pw, sh, sw;
  if ((rc = check_channels_last(L, err))) return rc;
  if (x->flat) return lerr(err, L, "pooling after Flatten or Dense");
  if (int_pair(L->cfg, "pool_size", &ph, &pw)) return lerr(err, L, "no 'pool_size'");
  if (ph != pw || ph < 1) return lerr(err, L, "pool %dx%d: only square windows are supported", ph, pw);
  if (is_null(L->cfg, "strides")) sh = sw = ph;
  else if (int_pair(L->cfg, "strides", &sh, &sw)) return lerr(err, L, "bad 'strides'");
  if (sh != sw || sh < 1) return lerr(err, L, "strides (%d, %d): equal strides only", sh, sw);
  if (x->h < ph || x->w < pw) return lerr(err, L, "window %d larger than its %dx%d input", ph, x->h, x->w);
  const char *pad = str_field(L->cfg, "padding");
  if (pad && !strcmp(pad, "same")) {
    int o, b, a, o2, b2, a2;
    same_padding(x->h, ph, sh, &o, &b, &a);
    same_padding(x->w, pw, sw, &o2, &b2, &a2);
    if (a + b + a2 + b2 != 0)
      return lerr(err, L, "padding 'same' pads this %dx%d input: only unpadded pooling is "
                  "supported", x->h, x->w);
  } else if (pad && strcmp(pad, "valid") != 0) {
    return lerr(err, L, "padding '%.16s' is not supported", pad);
  }
  if ((rc = emit(x, L, json_pack("{s:s,s:i,s:i}", "type", type, "size", ph, "stride", sh), err)))
    return rc;
  x->h = (x->h - ph) / sh + 1;
  x->w = (x->w - pw) / sw + 1;
  x->after_dense = 1;
  return 0;
}

/* The smallest epsilon the model spec takes (model_spec.h; cuDNN's). */
#define MIN_BN_EPSILON 1e-5

/* BatchNormalization over the channel axis (or, after Flatten, Dense or
 * GlobalAveragePooling2D, each feature): the spec's batchnorm, with Keras's
 * momentum and epsilon. What the spec cannot hold (another axis, no gamma
 * or beta, renormalization, a tiny epsilon) is refused rather than
 * approximated, since the imported weights would compute something else. */
static int batchnorm(xlate *x, const klayer *L, char *err) {
  int rc;
  if ((rc = check_plain(L, err))) return rc;
  static const char *const regs[] = {"beta_regularizer", "gamma_regularizer", "beta_constraint",
                                     "gamma_constraint"};
  for (size_t i = 0; i < sizeof regs / sizeof regs[0]; i++)
    if (!is_null(L->cfg, regs[i])) return lerr(err, L, "%s is set: not supported", regs[i]);
  /* Keras 3 writes the axis as an int, tf_keras as a list of one, made
   * non-negative; Keras's default is -1. */
  json_t *ax = json_object_get(L->cfg, "axis");
  if (json_is_array(ax) && json_array_size(ax) == 1) ax = json_array_get(ax, 0);
  if (ax && !json_is_integer(ax))
    return lerr(err, L, "'axis' is not one integer: only the channel axis is supported");
  const long long axis = ax ? json_integer_value(ax) : -1, last = x->flat ? 1 : 3;
  if (axis != -1 && axis != last)
    return lerr(err, L,
                "axis %lld of a %s input: only the channel axis (-1 or %lld) is supported", axis,
                x->flat ? "2-D (batch, features)" : "4-D (batch, height, width, channels)", last);
  if (json_is_false(json_object_get(L->cfg, "scale")))
    return lerr(err, L, "scale false (no gamma): not supported, every batchnorm here has gamma");
  if (json_is_false(json_object_get(L->cfg, "center")))
    return lerr(err, L, "center false (no beta): not supported, every batchnorm here has beta");
  if (json_is_true(json_object_get(L->cfg, "renorm")))
    return lerr(err, L, "renorm true (batch renormalization): not supported");
  if (!is_null(L->cfg, "virtual_batch_size"))
    return lerr(err, L, "virtual_batch_size is set: not supported");
  if (!is_null(L->cfg, "adjustment")) return lerr(err, L, "adjustment is set: not supported");
  json_t *m = json_object_get(L->cfg, "momentum"), *e = json_object_get(L->cfg, "epsilon");
  const double momentum = m ? (json_is_number(m) ? json_number_value(m) : -1.0) : 0.99;
  const double epsilon = e ? (json_is_number(e) ? json_number_value(e) : -1.0) : 1e-3;
  if (!(momentum >= 0.0 && momentum < 1.0))
    return lerr(err, L, "'momentum' is not a number in [0, 1)");
  if (!(epsilon > 0.0 && epsilon <= 1.0))
    return lerr(err, L, "'epsilon' is not a number in (0, 1]");
  if (epsilon < MIN_BN_EPSILON)
    return lerr(err, L,
                "epsilon %g is below %g, the smallest every backend here takes (cuDNN's "
                "minimum): not supported; retrain with epsilon >= %g",
                epsilon, MIN_BN_EPSILON, MIN_BN_EPSILON);
  if (json_is_true(json_object_get(L->cfg, "synchronized")))
    note(x,
         "keras: '%s': synchronized batch normalization: each worker here normalizes over its "
         "own batch",
         L->name);
  if ((rc = emit(x, L,
                 json_pack("{s:s,s:f,s:f}", "type", "batchnorm", "momentum", momentum, "epsilon",
                           epsilon),
                 err)))
    return rc;
  if (x->plan && x->n_plan < MAX_KERAS_LAYERS) {
    kweights kw = {.kind = KW_BATCHNORM, .c = x->c, .momentum = (float)momentum,
                   .epsilon = (float)epsilon, .name = L->name};
    if (x->flat && x->fh * x->fw > 1) {
      kw.fh = x->fh;
      kw.fw = x->fw;
      kw.fc = x->fc;
    }
    x->plan[x->n_plan++] = kw;
  }
  /* The shape, and a Flatten's feature order, stay as they are. */
  x->after_dense = 1;
  return 0;
}

static int one_layer(xlate *x, const klayer *L, int first, char *err) {
  int rc;
  const char *c = L->cls;
  if (x->softmax)
    return lerr(err, L, "a layer after the softmax: the softmax must be the model's output");
  if (!strcmp(c, "InputLayer")) {
    if (!first) return lerr(err, L, "an input that is not the first layer");
    return set_input_shape(x, L, input_shape_of(L->cfg), err);
  }
  if (first) {
    /* A Sequential model built without an InputLayer: its first layer holds
     * the input shape. */
    json_t *s = input_shape_of(L->cfg);
    if (!s) return lerr(err, L, "the first layer gives no input shape");
    if ((rc = set_input_shape(x, L, s, err))) return rc;
  }
  if (!strcmp(c, "Conv2D")) return conv2d(x, L, err);
  if (!strcmp(c, "Dense")) return dense(x, L, err);
  if (!strcmp(c, "MaxPooling2D")) return pooling(x, L, "maxpool", err);
  if (!strcmp(c, "AveragePooling2D")) return pooling(x, L, "avgpool", err);
  if (!strcmp(c, "GlobalAveragePooling2D")) {
    if ((rc = check_channels_last(L, err))) return rc;
    if (x->flat) return lerr(err, L, "pooling after Flatten or Dense");
    if ((rc = emit(x, L, json_pack("{s:s}", "type", "global_avgpool"), err))) return rc;
    x->h = x->w = 1;
    x->flat = 1;
    x->after_dense = 1;
    return 0;
  }
  if (!strcmp(c, "Flatten")) {
    if ((rc = check_channels_last(L, err))) return rc;
    if ((rc = emit(x, L, json_pack("{s:s}", "type", "flatten"), err))) return rc;
    if (!x->flat) {
      x->fh = x->h;
      x->fw = x->w;
      x->fc = x->c;
      x->c *= x->h * x->w;
      x->h = x->w = 1;
    }
    x->flat = 1;
    x->after_dense = 1;
    return 0;
  }
  if (!strcmp(c, "Dropout")) {
    json_t *r = json_object_get(L->cfg, "rate");
    if (!json_is_number(r) || json_number_value(r) < 0 || json_number_value(r) >= 1)
      return lerr(err, L, "'rate' is not a number in [0, 1)");
    if (!is_null(L->cfg, "noise_shape")) return lerr(err, L, "noise_shape is not supported");
    x->after_dense = 1;
    if (json_number_value(r) == 0) return 0;
    return emit(x, L, json_pack("{s:s,s:f}", "type", "dropout", "rate", json_number_value(r)),
                err);
  }
  if (!strcmp(c, "Activation")) {
    const char *act = str_field(L->cfg, "activation");
    if (act && strcmp(act, "linear") && strcmp(act, "softmax")) x->after_dense = 1;
    return activation(x, L, act, err);
  }
  if (!strcmp(c, "ReLU")) {
    json_t *ns = json_object_get(L->cfg, "negative_slope");
    json_t *th = json_object_get(L->cfg, "threshold");
    if (!is_null(L->cfg, "max_value")) return lerr(err, L, "max_value is not supported");
    if ((ns && !(json_is_number(ns) && json_number_value(ns) == 0)) ||
        (th && !(json_is_number(th) && json_number_value(th) == 0)))
      return lerr(err, L, "a leaky or thresholded ReLU is not supported");
    x->after_dense = 1;
    return emit(x, L, json_pack("{s:s}", "type", "relu"), err);
  }
  if (!strcmp(c, "Softmax")) {
    json_t *ax = json_object_get(L->cfg, "axis");
    if (ax && !(json_is_integer(ax) && json_integer_value(ax) == -1) &&
        !(json_is_array(ax) && json_array_size(ax) == 1 &&
          json_integer_value(json_array_get(ax, 0)) == -1))
      return lerr(err, L, "a softmax over another axis than the last");
    x->softmax = 1;
    return 0;
  }
  if (!strcmp(c, "BatchNormalization")) return batchnorm(x, L, err);
  return lerr(err, L,
              "unsupported layer type (supported: InputLayer, Conv2D, Dense, MaxPooling2D, "
              "AveragePooling2D, GlobalAveragePooling2D, Flatten, Dropout, Activation, ReLU, "
              "Softmax, Add, BatchNormalization)");
}

/* A functional model's single input or output layer: [name, 0, 0] or
 * [[name, 0, 0]]. */
static const char *io_layer(json_t *v, const char *what, char *err) {
  if (json_is_array(v) && json_array_size(v) == 1 && json_is_array(json_array_get(v, 0)))
    v = json_array_get(v, 0);
  else if (json_is_array(v) && json_array_size(v) > 1 && json_is_array(json_array_get(v, 0))) {
    ps_seterr(err, PS_EINVAL, "keras: a model with %zu %s: one only", json_array_size(v), what);
    return NULL;
  }
  if (json_is_array(v) && json_array_size(v) >= 1 && json_is_string(json_array_get(v, 0)))
    return json_string_value(json_array_get(v, 0));
  ps_seterr(err, PS_EINVAL, "keras: the model's %s are not given", what);
  return NULL;
}

static int translate(json_t *root, klayer *ls, json_t *spec, xlate *x, char *err) {
  if (!json_is_object(root))
    return ps_seterr(err, PS_EINVAL, "keras: not a model: the JSON is not an object");
  const char *cls = str_field(root, "class_name");
  json_t *cfg = json_object_get(root, "config");
  if (!cls || !json_is_object(cfg))
    return ps_seterr(err, PS_EINVAL,
                     "keras: not a model: no 'class_name' and 'config' (write it with "
                     "model.to_json())");
  int functional = !strcmp(cls, "Functional") || !strcmp(cls, "Model");
  if (!functional && strcmp(cls, "Sequential") != 0)
    return ps_seterr(err, PS_EINVAL,
                     "keras: a '%.32s' model: Sequential and functional models only", cls);
  json_t *layers = json_object_get(cfg, "layers");
  if (!json_is_array(layers) || json_array_size(layers) == 0)
    return ps_seterr(err, PS_EINVAL, "keras: the model has no 'layers'");
  size_t n = json_array_size(layers);
  if (n > MAX_KERAS_LAYERS)
    return ps_seterr(err, PS_EINVAL, "keras: %zu layers: at most %d", n, MAX_KERAS_LAYERS);
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    json_t *e = json_array_get(layers, i);
    klayer *L = &ls[i];
    memset(L, 0, sizeof *L);
    L->cls = str_field(e, "class_name");
    L->cfg = json_object_get(e, "config");
    if (!L->cls || !json_is_object(L->cfg))
      return ps_seterr(err, PS_EINVAL, "keras: layer %zu has no 'class_name' and 'config'", i);
    L->name = str_field(e, "name");
    if (!L->name) L->name = str_field(L->cfg, "name");
    if (!L->name) L->name = "?";
    if (!strcmp(L->cls, "Sequential") || !strcmp(L->cls, "Functional") ||
        !strcmp(L->cls, "Model"))
      return lerr(err, L, "a model inside the model: not supported");
    if (functional && (rc = read_inbound(L, json_object_get(e, "inbound_nodes"), err)))
      return rc;
  }
  if (functional) {
    const char *in = io_layer(json_object_get(cfg, "input_layers"), "inputs", err);
    if (!in) return PS_EINVAL;
    const char *out = io_layer(json_object_get(cfg, "output_layers"), "outputs", err);
    if (!out) return PS_EINVAL;
    if (strcmp(ls[0].name, in) != 0 || strcmp(ls[0].cls, "InputLayer") != 0)
      return ps_seterr(err, PS_EINVAL, "keras: the input '%.48s' is not the first layer", in);
    /* Layers come in an order that runs them (each after its inputs). */
    for (size_t i = 1; i < n; i++) {
      klayer *L = &ls[i];
      if (L->n_in == 0) return lerr(err, L, "takes no input");
      if (L->n_in > PS_MAX_LAYER_INPUTS)
        return lerr(err, L, "takes %d inputs: at most %d", L->n_in, PS_MAX_LAYER_INPUTS);
      if (L->n_in > 1 && strcmp(L->cls, "Add") != 0)
        return lerr(err, L, "takes %d inputs: only Add takes more than one", L->n_in);
      for (int a = 0; a < L->n_in; a++) {
        size_t j = 0;
        while (j < i && strcmp(ls[j].name, L->in[a]) != 0) j++;
        if (j == i) return lerr(err, L, "takes '%.48s', which is not an earlier layer", L->in[a]);
        L->src[a] = (int)j;
      }
    }
    if (strcmp(ls[n - 1].name, out) != 0)
      return ps_seterr(err, PS_EINVAL, "keras: the output '%.48s' is not the last layer", out);
  } else {
    for (size_t i = 1; i < n; i++) {
      ls[i].n_in = 1;
      ls[i].src[0] = (int)i - 1;
    }
  }
  x->layers = json_array(); /* the caller releases it */
  if (!x->layers) return ps_seterr(err, PS_ENOMEM, "keras: out of memory");
  int in_c = 0, in_h = 0, in_w = 0;
  rc = 0;
  kout *outs = calloc(n, sizeof *outs);
  if (!outs) return ps_seterr(err, PS_ENOMEM, "keras: out of memory");
  snprintf(x->prev, sizeof x->prev, "input");
  for (size_t i = 0; i < n && rc == 0; i++) {
    klayer *L = &ls[i];
    x->emitted = 0;
    x->pending[0] = '\0';
    if (i > 0) {
      /* The current shape is the (first) input's. */
      const kout *o = &outs[L->src[0]];
      x->c = o->c, x->h = o->h, x->w = o->w, x->flat = o->flat;
      x->fh = o->fh, x->fw = o->fw, x->fc = o->fc;
      if (strcmp(o->spec, x->prev) != 0) snprintf(x->pending, sizeof x->pending, "%s", o->spec);
    }
    if (i > 0 && !strcmp(L->cls, "Add")) {
      json_t *ins = json_array();
      for (int a = 0; a < L->n_in && rc == 0; a++) {
        const kout *o = &outs[L->src[a]];
        if (o->c * o->h * o->w != x->c * x->h * x->w || o->h != x->h || o->w != x->w)
          rc = lerr(err, L, "adds a %dx%dx%d to a %dx%dx%d", o->h, o->w, o->c, x->h, x->w, x->c);
        else if (!ins || json_array_append_new(ins, json_string(o->spec)))
          rc = ps_seterr(err, PS_ENOMEM, "keras: out of memory");
      }
      if (x->softmax) rc = lerr(err, L, "a layer after the softmax");
      x->pending[0] = '\0';
      json_t *layer = json_pack("{s:s}", "type", "add");
      if (rc == 0 && (!layer || json_object_set(layer, "inputs", ins)))
        rc = ps_seterr(err, PS_ENOMEM, "keras: out of memory");
      json_decref(ins);
      if (rc == 0) rc = emit(x, L, layer, err);
      else json_decref(layer);
      x->after_dense = 1;
    } else {
      rc = one_layer(x, L, i == 0, err);
    }
    if (rc) break;
    if (i == 0) {
      in_c = x->c;
      in_h = x->h;
      in_w = x->w;
    }
    kout *o = &outs[i];
    snprintf(o->spec, sizeof o->spec, "%s",
             i == 0 ? "input" : x->emitted ? x->prev : outs[L->src[0]].spec);
    o->c = x->c, o->h = x->h, o->w = x->w, o->flat = x->flat;
    o->fh = x->fh, o->fw = x->fw, o->fc = x->fc;
    x->last_name = L->name;
    x->last_cls = L->cls;
  }
  free(outs);
  if (rc) return rc;
  if (!x->have_dense || x->after_dense)
    return ps_seterr(err, PS_EINVAL,
                     "keras: the model ends with '%.48s' (%.32s): it must end with a Dense layer "
                     "giving the class scores (and a softmax, or logits)",
                     x->last_name, x->last_cls);
  if (x->dense_units < 2)
    return ps_seterr(err, PS_EINVAL,
                     "keras: the output '%.48s' has %d unit: classification over 2 or more "
                     "classes only",
                     x->dense_name, x->dense_units);
  if (!x->softmax)
    note(x, "keras: the output '%s' gives logits: trained with softmax cross-entropy",
         x->dense_name);
  if (json_array_append_new(x->layers, json_pack("{s:s}", "type", "softmax_xent")) ||
      json_object_set_new(spec, "input", json_pack("[i,i,i]", in_c, in_h, in_w)) ||
      json_object_set_new(spec, "classes", json_integer(x->dense_units)) ||
      json_object_set(spec, "layers", x->layers))
    return ps_seterr(err, PS_ENOMEM, "keras: out of memory");
  return 0;
}

/* The spec, and with plan (MAX_KERAS_LAYERS entries) the layers with
 * weights. The layer names in plan point into the parsed JSON, which is
 * released here: they are set to NULL. */
static int keras_translate(const char *keras_json, json_t **spec_out, kweights *plan, int *n_plan,
                           char *notes, size_t notes_len, char *err) {
  *spec_out = NULL;
  if (notes && notes_len) notes[0] = '\0';
  json_error_t je;
  json_t *root = json_loads(keras_json, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return ps_seterr(err, PS_EINVAL, "keras: not JSON: %.120s (line %d, column %d)", je.text,
                     je.line, je.column);
  klayer *ls = calloc(MAX_KERAS_LAYERS, sizeof *ls);
  json_t *spec = json_object();
  xlate x = {.notes = notes, .notes_len = notes_len, .plan = plan};
  int rc = (!ls || !spec) ? ps_seterr(err, PS_ENOMEM, "keras: out of memory")
                          : translate(root, ls, spec, &x, err);
  for (int i = 0; i < x.n_plan; i++) plan[i].name = NULL;
  if (n_plan) *n_plan = x.n_plan;
  free(ls);
  json_decref(x.layers);
  json_decref(root);
  if (rc) {
    json_decref(spec);
    return rc;
  }
  *spec_out = spec;
  return 0;
}

int ps_keras_to_spec(const char *keras_json, void **spec_out, char *notes, size_t notes_len,
                     char *err) {
  json_t *spec = NULL;
  int rc = keras_translate(keras_json, &spec, NULL, NULL, notes, notes_len, err);
  *spec_out = spec;
  return rc;
}

static int shape_is(const ps_keras_tensor *t, int ndim, int64_t a, int64_t b, int64_t c, int64_t d) {
  const int64_t want[4] = {a, b, c, d};
  if (t->ndim != ndim) return 0;
  for (int i = 0; i < ndim; i++)
    if (t->shape[i] != want[i]) return 0;
  return 1;
}

static void shape_str(const ps_keras_tensor *t, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "(");
  for (int i = 0; i < t->ndim && i < 4 && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (used < len) snprintf(buf + used, len - used, t->ndim == 1 ? ",)" : ")");
}

/* Keras's index of our feature `in` (c, h, w order) of a layer after a
 * Flatten of an (fh, fw, fc) input, where Keras has (h, w, c); the same
 * index without one. */
static int keras_feature(const kweights *kw, int in) {
  if (!kw->fh) return in;
  int c = in / (kw->fh * kw->fw), hw = in % (kw->fh * kw->fw);
  return hw * kw->fc + c;
}

static int is_weighted(const ps_layer *L) {
  return L->type == PS_LAYER_CONV2D || L->type == PS_LAYER_DENSE ||
         L->type == PS_LAYER_BATCHNORM;
}

/* Conv2D: arrays t[0] (kernel) and, with a bias, t[1] into L. */
static int conv_weights(const kweights *kw, const ps_layer *L, int p, int a,
                        const ps_keras_tensor *t, float *params, char *err) {
  if (L->type != PS_LAYER_CONV2D || L->filters != kw->oc || L->kernel != kw->k ||
      L->in_c != kw->ic || (L->b_count > 0) != kw->bias)
    return ps_seterr(err, PS_EINVAL, "keras: weighted layer %d is a conv2d(%d, %dx%d%s) in "
                     "Keras but '%.32s' in the job's model", p, kw->oc, kw->k, kw->k,
                     kw->bias ? "" : ", no bias", L->name);
  char ks[64], bs[64] = "";
  shape_str(&t[0], ks, sizeof ks);
  if (kw->bias) shape_str(&t[1], bs, sizeof bs);
  if (!shape_is(&t[0], 4, kw->k, kw->k, kw->ic, kw->oc) ||
      (kw->bias && !shape_is(&t[1], 1, kw->oc, 0, 0, 0))) {
    if (kw->bias)
      return ps_seterr(err, PS_EINVAL, "keras: arrays %d and %d (%s, %s) are not the kernel "
                       "(%d, %d, %d, %d) and bias (%d,) of '%.32s'", a, a + 1, ks, bs, kw->k,
                       kw->k, kw->ic, kw->oc, kw->oc, L->name);
    return ps_seterr(err, PS_EINVAL, "keras: array %d %s is not the kernel (%d, %d, %d, %d) of "
                     "'%.32s' (use_bias false: no bias array)", a, ks, kw->k, kw->k, kw->ic,
                     kw->oc, L->name);
  }
  /* Keras (KH, KW, IC, OC); here (OC, IC, KH, KW). */
  float *w = params + L->w_off;
  for (int o = 0; o < kw->oc; o++)
    for (int c = 0; c < kw->ic; c++)
      for (int i = 0; i < kw->k; i++)
        for (int j = 0; j < kw->k; j++)
          w[(((size_t)o * kw->ic + c) * kw->k + i) * kw->k + j] =
              t[0].data[(((size_t)i * kw->k + j) * kw->ic + c) * kw->oc + o];
  if (kw->bias) memcpy(params + L->b_off, t[1].data, (size_t)kw->oc * sizeof(float));
  return 0;
}

/* Dense: arrays t[0] (kernel) and, with a bias, t[1] into L. */
static int dense_weights(const kweights *kw, const ps_layer *L, int p, int a,
                         const ps_keras_tensor *t, float *params, char *err) {
  if (L->type != PS_LAYER_DENSE || L->units != kw->units ||
      (size_t)L->in_c * L->in_h * L->in_w != (size_t)kw->in || (L->b_count > 0) != kw->bias)
    return ps_seterr(err, PS_EINVAL, "keras: weighted layer %d is a dense(%d%s) of %d inputs in "
                     "Keras but '%.32s' in the job's model", p, kw->units,
                     kw->bias ? "" : ", no bias", kw->in, L->name);
  char ks[64], bs[64] = "";
  shape_str(&t[0], ks, sizeof ks);
  if (kw->bias) shape_str(&t[1], bs, sizeof bs);
  if (!shape_is(&t[0], 2, kw->in, kw->units, 0, 0) ||
      (kw->bias && !shape_is(&t[1], 1, kw->units, 0, 0, 0))) {
    if (kw->bias)
      return ps_seterr(err, PS_EINVAL, "keras: arrays %d and %d (%s, %s) are not the kernel "
                       "(%d, %d) and bias (%d,) of '%.32s'", a, a + 1, ks, bs, kw->in,
                       kw->units, kw->units, L->name);
    return ps_seterr(err, PS_EINVAL, "keras: array %d %s is not the kernel (%d, %d) of '%.32s' "
                     "(use_bias false: no bias array)", a, ks, kw->in, kw->units, L->name);
  }
  /* Keras (IN, OUT) over features in (h, w, c) order after a Flatten;
   * here (OUT, IN) over (c, h, w). */
  float *w = params + L->w_off;
  for (int in = 0; in < kw->in; in++) {
    const int kin = keras_feature(kw, in);
    for (int o = 0; o < kw->units; o++)
      w[(size_t)o * kw->in + in] = t[0].data[(size_t)kin * kw->units + o];
  }
  if (kw->bias) memcpy(params + L->b_off, t[1].data, (size_t)kw->units * sizeof(float));
  return 0;
}

/* BatchNormalization: arrays t[0..4) (gamma, beta, moving_mean,
 * moving_variance, Keras's order) into L's gamma, beta and s (mean then
 * variance), each reordered like a Dense layer's inputs after a Flatten. */
static int batchnorm_weights(const kweights *kw, const ps_layer *L, int p, int a,
                             const ps_keras_tensor *t, float *params, char *err) {
  if (L->type != PS_LAYER_BATCHNORM || L->w_count != (size_t)kw->c)
    return ps_seterr(err, PS_EINVAL, "keras: weighted layer %d is a batchnorm of %d values in "
                     "Keras but '%.32s' in the job's model", p, kw->c, L->name);
  /* epsilon is part of the function the weights were trained for (the
   * momentum only of how training averages, which a job may change). The
   * spec holds it as a float, as the translation wrote it. */
  if (L->epsilon != kw->epsilon)
    return ps_seterr(err, PS_EINVAL, "keras: weighted layer %d, '%.32s', has epsilon %g in the "
                     "job's model but %g in Keras", p, L->name, (double)L->epsilon,
                     (double)kw->epsilon);
  static const char *const what[4] = {"gamma", "beta", "moving_mean", "moving_variance"};
  for (int i = 0; i < 4; i++) {
    if (!shape_is(&t[i], 1, kw->c, 0, 0, 0)) {
      char s[64];
      shape_str(&t[i], s, sizeof s);
      return ps_seterr(err, PS_EINVAL, "keras: array %d %s is not the %s (%d,) of '%.32s' "
                       "(arrays %d to %d: gamma, beta, moving_mean, moving_variance)", a + i, s,
                       what[i], kw->c, L->name, a, a + 3);
    }
  }
  const float *var = t[3].data;
  for (int k = 0; k < kw->c; k++)
    if (var[k] < 0.0f)
      return ps_seterr(err, PS_EINVAL, "keras: array %d, the moving_variance of '%.32s', holds "
                       "%g at %d: a variance cannot be negative", a + 3, L->name,
                       (double)var[k], k);
  float *dst[4] = {params + L->w_off, params + L->b_off, params + L->s_off,
                   params + L->s_off + (size_t)kw->c};
  for (int i = 0; i < 4; i++)
    for (int k = 0; k < kw->c; k++) dst[i][k] = t[i].data[keras_feature(kw, k)];
  return 0;
}

int ps_keras_weights(const char *keras_json, const ps_model_spec *spec,
                     const ps_keras_tensor *tensors, int n_tensors, float *params, char *err) {
  kweights *plan = calloc(MAX_KERAS_LAYERS, sizeof *plan);
  if (!plan) return ps_seterr(err, PS_ENOMEM, "keras: out of memory");
  json_t *kspec = NULL;
  int n_plan = 0;
  int rc = keras_translate(keras_json, &kspec, plan, &n_plan, NULL, 0, err);
  json_decref(kspec);
  if (rc) {
    free(plan);
    return rc;
  }
  int wanted = 0;
  for (int p = 0; p < n_plan; p++) wanted += kw_arrays(&plan[p]);
  if (n_tensors != wanted) {
    free(plan);
    return ps_seterr(err, PS_EINVAL,
                     "keras: %d weight arrays for a model with %d layers with weights: %d wanted "
                     "(in the order of model.get_weights(): a kernel, and a bias unless "
                     "use_bias is false, per Conv2D and Dense; gamma, beta, moving_mean and "
                     "moving_variance per BatchNormalization)",
                     n_tensors, n_plan, wanted);
  }
  /* The spec's conv2d, dense and batchnorm layers, in order, are the
   * plan's. */
  int li = 0, a = 0;
  for (int p = 0; p < n_plan && rc == 0; p++) {
    const kweights *kw = &plan[p];
    while (li < spec->n_layers && !is_weighted(&spec->layers[li])) li++;
    if (li == spec->n_layers) {
      rc = ps_seterr(err, PS_EINVAL, "keras: the job's model has fewer layers with weights (%d) "
                     "than the Keras model", p);
      break;
    }
    const ps_layer *L = &spec->layers[li++];
    switch (kw->kind) {
      case KW_CONV2D: rc = conv_weights(kw, L, p, a, tensors + a, params, err); break;
      case KW_DENSE: rc = dense_weights(kw, L, p, a, tensors + a, params, err); break;
      default: rc = batchnorm_weights(kw, L, p, a, tensors + a, params, err); break;
    }
    a += kw_arrays(kw);
  }
  if (rc == 0) {
    while (li < spec->n_layers && !is_weighted(&spec->layers[li])) li++;
    if (li < spec->n_layers)
      rc = ps_seterr(err, PS_EINVAL, "keras: the job's model has more layers with weights than "
                     "the Keras model ('%.32s' has none)", spec->layers[li].name);
  }
  free(plan);
  return rc;
}

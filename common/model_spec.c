/* Model spec: JSON layer list -> shapes -> flat parameter layout.
 *
 * Every process (servers and workers) derives P, the offsets and the initial
 * values from the same JSON, so this file is the single place where those
 * rules live. Parsing is strict: an unknown key is much more likely a typo
 * ("filter" for "filters") than an extension, and silently ignoring it would
 * train a different model from the one the user wrote. */
#include "model_spec.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "rng.h"
#include "util.h"

/* P must fit a signed 32-bit count: the wire and the kernels index tensors
 * with int in places, and 2^31 floats (8 GiB) is far beyond what this system
 * is meant to shard anyway. Activations per example use the same bound. */
#define MAX_PARAMS ((size_t)INT32_MAX)
#define MAX_ACT ((size_t)INT32_MAX)

/* Labels travel as uint8, so at most 256 classes. */
#define MAX_CLASSES 256

typedef struct {
  ps_layer_type type;
  const char *name;
  const char *keys; /* allowed keys, comma-separated, for lookup and messages */
} layer_kind;

/* Every layer also takes "name" and "inputs" (listed last). */
static const layer_kind kinds[] = {
    {PS_LAYER_CONV2D, "conv2d", "type, filters, kernel, stride, padding, bias, name, inputs"},
    {PS_LAYER_MAXPOOL, "maxpool", "type, size, stride, name, inputs"},
    {PS_LAYER_DENSE, "dense", "type, units, bias, name, inputs"},
    {PS_LAYER_RELU, "relu", "type, name, inputs"},
    {PS_LAYER_DROPOUT, "dropout", "type, rate, name, inputs"},
    {PS_LAYER_FLATTEN, "flatten", "type, name, inputs"},
    {PS_LAYER_SOFTMAX_XENT, "softmax_xent", "type, name, inputs"},
    {PS_LAYER_AVGPOOL, "avgpool", "type, size, stride, name, inputs"},
    {PS_LAYER_GLOBAL_AVGPOOL, "global_avgpool", "type, name, inputs"},
    {PS_LAYER_ADD, "add", "type, name, inputs"},
    {PS_LAYER_BATCHNORM, "batchnorm", "type, momentum, epsilon, name, inputs"},
    {PS_LAYER_EMBEDDING, "embedding", "type, table, dim, fields, pooling, name"},
    {PS_LAYER_CONCAT, "concat", "type, name, inputs"},
    {PS_LAYER_SIGMOID_XENT, "sigmoid_xent", "type, name, inputs"},
    {PS_LAYER_FM, "fm", "type, sum, name, inputs"},
};
#define N_KINDS (sizeof kinds / sizeof kinds[0])

static const char *kind_name(ps_layer_type t) {
  for (size_t i = 0; i < N_KINDS; i++)
    if (kinds[i].type == t) return kinds[i].name;
  return "?";
}

/* Is `key` one of the comma-and-space separated names in `list`? */
static int key_in_list(const char *key, const char *list) {
  size_t klen = strlen(key);
  const char *p = list;
  while (*p) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n == klen && memcmp(p, key, n) == 0) return 1;
    if (!e) break;
    p = e + 1;
    while (*p == ' ') p++;
  }
  return 0;
}

/* a*b into *out if it does not exceed limit; 0 on success, -1 on overflow. */
static int mul_within(size_t a, size_t b, size_t limit, size_t *out) {
  if (a != 0 && b > limit / a) return -1;
  *out = a * b;
  return 0;
}

/* Reads a required or optional positive integer field (1..INT_MAX).
 * Returns 1 if present and valid, 0 if absent, PS_EINVAL (with message) if
 * present but not a positive integer. `where` prefixes the message. */
static int get_pos_int(json_t *obj, const char *key, const char *where, int *out, char *err) {
  json_t *v = json_object_get(obj, key);
  if (!v) return 0;
  if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > INT_MAX)
    return ps_seterr(err, PS_EINVAL, "%s: '%s' must be a positive integer", where, key);
  *out = (int)json_integer_value(v);
  return 1;
}

static int require_pos_int(json_t *obj, const char *key, const char *where, int *out, char *err) {
  int rc = get_pos_int(obj, key, where, out, err);
  if (rc == 0)
    return ps_seterr(err, PS_EINVAL, "%s: '%s' is required (a positive integer)", where, key);
  return rc < 0 ? rc : 0;
}

/* An optional boolean field (absent: dflt) into *out as 1 or 0; PS_EINVAL
 * for anything else. */
static int get_flag(json_t *obj, const char *key, int dflt, const char *where, int *out,
                    char *err) {
  json_t *v = json_object_get(obj, key);
  *out = dflt;
  if (!v) return 0;
  if (!json_is_boolean(v))
    return ps_seterr(err, PS_EINVAL, "%s: '%s' must be true or false", where, key);
  *out = json_is_true(v);
  return 0;
}

/* An optional number field in [lo, hi) (hi_closed: [lo, hi]) into *out
 * (left as it is when absent); PS_EINVAL naming the field otherwise. */
static int get_number_in(json_t *obj, const char *key, double lo, double hi, int hi_closed,
                         const char *where, float *out, char *err) {
  json_t *v = json_object_get(obj, key);
  if (!v) return 0;
  double d = json_is_number(v) ? json_number_value(v) : NAN;
  if (!(d >= lo && (hi_closed ? d <= hi : d < hi)))
    return ps_seterr(err, PS_EINVAL, "%s: '%s' must be a number in [%g, %g%c", where, key, lo, hi,
                     hi_closed ? ']' : ')');
  *out = (float)d;
  return 0;
}

static int check_keys(json_t *obj, const char *allowed, const char *where, char *err) {
  const char *key;
  json_t *v;
  json_object_foreach(obj, key, v) {
    if (!key_in_list(key, allowed))
      return ps_seterr(err, PS_EINVAL, "%s: unknown field '%s' (known: %s)", where, key, allowed);
  }
  return 0;
}

/* Each infer_* reads its layer's fields and sets the output shape and the
 * parameter counts; L->in_* is already set. PS_EINVAL with a message. */
static int infer_conv2d(ps_layer *L, json_t *obj, const char *where, char *err) {
  int rc;
  if ((rc = require_pos_int(obj, "filters", where, &L->filters, err))) return rc;
  if ((rc = require_pos_int(obj, "kernel", where, &L->kernel, err))) return rc;
  L->stride = 1;
  if ((rc = get_pos_int(obj, "stride", where, &L->stride, err)) < 0) return rc;
  L->pad = 0;
  json_t *pv = json_object_get(obj, "padding");
  if (pv) {
    const char *p = json_string_value(pv);
    if (!p || (strcmp(p, "same") != 0 && strcmp(p, "valid") != 0))
      return ps_seterr(err, PS_EINVAL, "%s: 'padding' must be \"same\" or \"valid\"", where);
    if (strcmp(p, "same") == 0) {
      /* Symmetric padding k/2 only reproduces the input size for odd k;
       * even k would need asymmetric padding, which the kernels lack. */
      if (L->kernel % 2 == 0)
        return ps_seterr(err, PS_EINVAL, "%s: 'padding' \"same\" needs an odd 'kernel' (got %d)",
                         where, L->kernel);
      L->pad = L->kernel / 2;
    }
  }
  /* In 64 bits: in_h + 2*pad may exceed INT_MAX; the output never does,
   * since 2*pad <= kernel-1. */
  long long ph = (long long)L->in_h + 2LL * L->pad, pw = (long long)L->in_w + 2LL * L->pad;
  if (L->kernel > ph || L->kernel > pw)
    return ps_seterr(err, PS_EINVAL,
                     "%s: 'kernel' %d is larger than the padded input %lldx%lld (input %dx%d, "
                     "pad %d)",
                     where, L->kernel, ph, pw, L->in_h, L->in_w, L->pad);
  L->out_c = L->filters;
  L->out_h = (int)((ph - L->kernel) / L->stride + 1);
  L->out_w = (int)((pw - L->kernel) / L->stride + 1);
  size_t kk, fan_in;
  if (mul_within((size_t)L->kernel, (size_t)L->kernel, MAX_PARAMS, &kk) ||
      mul_within((size_t)L->in_c, kk, MAX_PARAMS, &fan_in) ||
      mul_within(fan_in, (size_t)L->filters, MAX_PARAMS, &L->w_count))
    return ps_seterr(err, PS_EINVAL, "%s: too many weights (more than %zu)", where, MAX_PARAMS);
  int bias;
  if ((rc = get_flag(obj, "bias", 1, where, &bias, err))) return rc;
  L->b_count = bias ? (size_t)L->filters : 0;
  return 0;
}

/* maxpool and avgpool: the same window rules. */
static int infer_pool(ps_layer *L, json_t *obj, const char *where, char *err) {
  int rc;
  if ((rc = require_pos_int(obj, "size", where, &L->pool, err))) return rc;
  L->pool_stride = L->pool;
  if ((rc = get_pos_int(obj, "stride", where, &L->pool_stride, err)) < 0) return rc;
  if (L->pool > L->in_h || L->pool > L->in_w)
    return ps_seterr(err, PS_EINVAL, "%s: 'size' %d is larger than the input %dx%d", where, L->pool,
                     L->in_h, L->in_w);
  L->out_c = L->in_c;
  L->out_h = (L->in_h - L->pool) / L->pool_stride + 1;
  L->out_w = (L->in_w - L->pool) / L->pool_stride + 1;
  return 0;
}

static int infer_dense(ps_layer *L, json_t *obj, const char *where, char *err) {
  int rc;
  if ((rc = require_pos_int(obj, "units", where, &L->units, err))) return rc;
  /* A dense layer reads its input as a flat vector whatever its shape; NCHW
   * activations are contiguous per example, so no copy is implied. */
  L->in_c = L->in_c * L->in_h * L->in_w; /* fits: activations checked <= MAX_ACT */
  L->in_h = L->in_w = 1;
  L->out_c = L->units;
  L->out_h = L->out_w = 1;
  if (mul_within((size_t)L->in_c, (size_t)L->units, MAX_PARAMS, &L->w_count))
    return ps_seterr(err, PS_EINVAL, "%s: too many weights (more than %zu)", where, MAX_PARAMS);
  int bias;
  if ((rc = get_flag(obj, "bias", 1, where, &bias, err))) return rc;
  L->b_count = bias ? (size_t)L->units : 0;
  return 0;
}

/* The smallest epsilon: cuDNN's CUDNN_BN_MIN_EPSILON, so that every
 * backend takes every spec. */
#define MIN_BN_EPSILON 1e-5

static int infer_batchnorm(ps_layer *L, json_t *obj, const char *where, char *err) {
  int rc;
  L->momentum = 0.99f;
  L->epsilon = 1e-3f;
  if ((rc = get_number_in(obj, "momentum", 0.0, 1.0, 0, where, &L->momentum, err))) return rc;
  if ((rc = get_number_in(obj, "epsilon", MIN_BN_EPSILON, 1.0, 1, where, &L->epsilon, err)))
    return rc;
  L->out_c = L->in_c, L->out_h = L->in_h, L->out_w = L->in_w;
  L->w_count = L->b_count = (size_t)L->in_c;
  L->s_count = 2 * (size_t)L->in_c;
  return 0;
}

static int infer_dropout(ps_layer *L, json_t *obj, const char *where, char *err) {
  json_t *v = json_object_get(obj, "rate");
  if (!v) return ps_seterr(err, PS_EINVAL, "%s: 'rate' is required (a number in [0, 1))", where);
  double r = json_is_number(v) ? json_number_value(v) : -1.0;
  if (!json_is_number(v) || !(r >= 0.0 && r < 1.0))
    return ps_seterr(err, PS_EINVAL, "%s: 'rate' must be a number in [0, 1)", where);
  L->rate = (float)r;
  L->out_c = L->in_c, L->out_h = L->in_h, L->out_w = L->in_w;
  return 0;
}

/* The name layer j of the JSON list gets: its "name", or the generated
 * "<type>_<k>" for the k-th layer of its type (counting named ones too, so
 * naming a layer leaves the others' names as they were). Into buf; "" when
 * the layer is malformed (reported when the parse reaches it). */
static void json_layer_name(json_t *layers, size_t j, char *buf, size_t len) {
  json_t *obj = json_array_get(layers, j);
  buf[0] = '\0';
  const char *name = json_string_value(json_object_get(obj, "name"));
  if (name) {
    snprintf(buf, len, "%s", name);
    return;
  }
  const char *type = json_string_value(json_object_get(obj, "type"));
  if (!type) return;
  int k = 0;
  for (size_t i = 0; i < j; i++) {
    const char *t = json_string_value(json_object_get(json_array_get(layers, i), "type"));
    k += t && strcmp(t, type) == 0;
  }
  snprintf(buf, len, "%s_%d", type, k);
}

/* embedding: table, dim, fields [from, to) of the model's n_ids, pooling. */
static int infer_embedding(ps_layer *L, json_t *obj, int n_ids, const char *where, char *err) {
  const char *table = json_string_value(json_object_get(obj, "table"));
  if (!table || !*table || strlen(table) >= sizeof L->table)
    return ps_seterr(err, PS_EINVAL,
                     "%s: 'table' is required (the name of one of the job's \"embeddings\")",
                     where);
  snprintf(L->table, sizeof L->table, "%s", table);
  L->table_index = -1;
  int rc = require_pos_int(obj, "dim", where, &L->emb_dim, err);
  if (rc) return rc;
  if (n_ids < 1)
    return ps_seterr(err, PS_EINVAL,
                     "%s: the model has no ids (set the model's \"ids\" to the categorical "
                     "fields per example)",
                     where);
  L->field_lo = 0, L->field_hi = n_ids;
  json_t *f = json_object_get(obj, "fields");
  if (f) {
    json_t *a = json_array_get(f, 0), *b = json_array_get(f, 1);
    if (!json_is_array(f) || json_array_size(f) != 2 || !json_is_integer(a) ||
        !json_is_integer(b) || json_integer_value(a) < 0 ||
        json_integer_value(b) <= json_integer_value(a) || json_integer_value(b) > n_ids)
      return ps_seterr(err, PS_EINVAL,
                       "%s: 'fields' must be [from, to) with 0 <= from < to <= %d (the model's "
                       "ids)",
                       where, n_ids);
    L->field_lo = (int)json_integer_value(a), L->field_hi = (int)json_integer_value(b);
  }
  const char *pool = json_string_value(json_object_get(obj, "pooling"));
  if (json_object_get(obj, "pooling") && !pool)
    return ps_seterr(err, PS_EINVAL, "%s: 'pooling' must be \"none\", \"sum\" or \"mean\"",
                     where);
  if (!pool || strcmp(pool, "none") == 0)
    L->pooling = PS_POOL_NONE;
  else if (strcmp(pool, "sum") == 0)
    L->pooling = PS_POOL_SUM;
  else if (strcmp(pool, "mean") == 0)
    L->pooling = PS_POOL_MEAN;
  else
    return ps_seterr(err, PS_EINVAL,
                     "%s: unknown pooling '%.20s' (\"none\", \"sum\" or \"mean\")", where,
                     pool);
  size_t width;
  if (mul_within((size_t)L->emb_dim, (size_t)(L->field_hi - L->field_lo), MAX_ACT, &width))
    return ps_seterr(err, PS_EINVAL, "%s: output has more than %zu values per example", where,
                     MAX_ACT);
  if (L->pooling == PS_POOL_NONE) /* a row per field */
    L->out_c = L->field_hi - L->field_lo, L->out_h = L->emb_dim, L->out_w = 1;
  else
    L->out_c = L->emb_dim, L->out_h = L->out_w = 1;
  return 0;
}

/* concat: the inputs' values per example, one after the other. */
static int infer_concat(const ps_model_spec *spec, ps_layer *L, char *err, const char *where);

/* Sets L->name for layer i: the spec's "name", checked, or the generated
 * one; either must differ from the earlier layers' names and from "input". */
static int parse_name(json_t *layers, size_t i, ps_model_spec *out, const char *where, char *err) {
  ps_layer *L = &out->layers[i];
  json_t *v = json_object_get(json_array_get(layers, i), "name");
  if (v) {
    const char *name = json_string_value(v);
    size_t len = name ? strlen(name) : 0;
    if (!name || len == 0 || len >= sizeof L->name ||
        strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-") != len)
      return ps_seterr(err, PS_EINVAL,
                       "%s: 'name' must be a string of 1 to %zu characters from [A-Za-z0-9_.-]",
                       where, sizeof L->name - 1);
  }
  json_layer_name(layers, i, L->name, sizeof L->name);
  if (strcmp(L->name, "input") == 0)
    return ps_seterr(err, PS_EINVAL, "%s: the name 'input' is the model input's", where);
  for (size_t j = 0; j < i; j++)
    if (strcmp(out->layers[j].name, L->name) == 0)
      return ps_seterr(err, PS_EINVAL, "%s: duplicate name '%s' (layer %zu has it too)", where,
                       L->name, j);
  return 0;
}

/* Sets L->n_inputs and L->inputs for layer i from its "inputs" (names of
 * earlier layers, or "input"), by default the previous layer. */
static int parse_inputs(json_t *layers, size_t i, ps_model_spec *out, const char *where,
                        char *err) {
  ps_layer *L = &out->layers[i];
  json_t *v = json_object_get(json_array_get(layers, i), "inputs");
  const int is_add = L->type == PS_LAYER_ADD || L->type == PS_LAYER_CONCAT;
  if (L->type == PS_LAYER_EMBEDDING) { /* reads the ids, no layer */
    L->n_inputs = 0;
    return 0;
  }
  if (!v) {
    if (is_add)
      return ps_seterr(err, PS_EINVAL,
                       "%s: 'inputs' is required (the names of 2 to %d earlier layers)", where,
                       PS_MAX_LAYER_INPUTS);
    L->n_inputs = 1;
    L->inputs[0] = (int)i - 1; /* the first layer: -1, the model input */
    return 0;
  }
  size_t m = json_is_array(v) ? json_array_size(v) : 0;
  if (is_add && (m < 2 || m > PS_MAX_LAYER_INPUTS))
    return ps_seterr(err, PS_EINVAL, "%s: 'inputs' must be an array of 2 to %d layer names", where,
                     PS_MAX_LAYER_INPUTS);
  if (!is_add && m != 1)
    return ps_seterr(err, PS_EINVAL,
                     "%s: 'inputs' must be an array of one layer name (only add and concat "
                     "take more)",
                     where);
  for (size_t a = 0; a < m; a++) {
    const char *name = json_string_value(json_array_get(v, a));
    if (!name) return ps_seterr(err, PS_EINVAL, "%s: 'inputs'[%zu] must be a string", where, a);
    int idx = -2;
    if (strcmp(name, "input") == 0) idx = -1;
    for (size_t j = 0; idx == -2 && j < i; j++)
      if (strcmp(out->layers[j].name, name) == 0) idx = (int)j;
    if (idx == -2) {
      /* Say why: a later layer's name (the list is the order the layers
       * run in), or none at all. */
      for (size_t j = i; j < json_array_size(layers); j++) {
        char later[sizeof L->name];
        json_layer_name(layers, j, later, sizeof later);
        if (strcmp(later, name) == 0)
          return ps_seterr(err, PS_EINVAL,
                           "%s: 'inputs' names '%.40s', which is %s (a layer reads only the "
                           "outputs of layers before it)",
                           where, name, j == i ? "this layer" : "a later layer");
      }
      return ps_seterr(err, PS_EINVAL, "%s: 'inputs' names '%.40s', which is no earlier layer",
                       where, name);
    }
    L->inputs[a] = idx;
  }
  L->n_inputs = (int)m;
  return 0;
}

/* The output shape of layer idx (-1: the model input) and its name. */
static const char *output_shape(const ps_model_spec *spec, int idx, int *c, int *h, int *w) {
  if (idx < 0) {
    *c = spec->in_c, *h = spec->in_h, *w = spec->in_w;
    return "input";
  }
  const ps_layer *L = &spec->layers[idx];
  *c = L->out_c, *h = L->out_h, *w = L->out_w;
  return L->name;
}

/* add: every input the shape of the first. */
static int check_add_shapes(const ps_model_spec *spec, const ps_layer *L, const char *where,
                            char *err) {
  int c0, h0, w0;
  const char *first = output_shape(spec, L->inputs[0], &c0, &h0, &w0);
  for (int a = 1; a < L->n_inputs; a++) {
    int c, h, w;
    const char *name = output_shape(spec, L->inputs[a], &c, &h, &w);
    if (c != c0 || h != h0 || w != w0)
      return ps_seterr(err, PS_EINVAL,
                       "%s: inputs '%s' (%dx%dx%d) and '%s' (%dx%dx%d) differ in shape", where,
                       first, c0, h0, w0, name, c, h, w);
  }
  return 0;
}

static int infer_concat(const ps_model_spec *spec, ps_layer *L, char *err, const char *where) {
  size_t total = 0;
  for (int a = 0; a < L->n_inputs; a++) {
    int c, h, w;
    output_shape(spec, L->inputs[a], &c, &h, &w);
    total += (size_t)c * h * w; /* each <= MAX_ACT, at most 4 */
  }
  if (total > MAX_ACT)
    return ps_seterr(err, PS_EINVAL, "%s: output has more than %zu values per example", where,
                     MAX_ACT);
  L->out_c = (int)total, L->out_h = L->out_w = 1;
  return 0;
}

static int parse_input(json_t *root, ps_model_spec *out, char *err) {
  json_t *in = json_object_get(root, "input");
  if (!in) return ps_seterr(err, PS_EINVAL, "model: 'input' is required ([C, H, W])");
  int dims[3];
  if (!json_is_array(in) || json_array_size(in) != 3)
    return ps_seterr(err, PS_EINVAL, "model: 'input' must be an array [C, H, W]");
  for (size_t i = 0; i < 3; i++) {
    json_t *d = json_array_get(in, i);
    if (!json_is_integer(d) || json_integer_value(d) < 1 || json_integer_value(d) > INT_MAX)
      return ps_seterr(err, PS_EINVAL, "model: 'input'[%zu] must be a positive integer ([C, H, W])",
                       i);
    dims[i] = (int)json_integer_value(d);
  }
  size_t hw, chw;
  if (mul_within((size_t)dims[1], (size_t)dims[2], MAX_ACT, &hw) ||
      mul_within((size_t)dims[0], hw, MAX_ACT, &chw))
    return ps_seterr(err, PS_EINVAL, "model: 'input' has more than %zu values per example",
                     MAX_ACT);
  out->in_c = dims[0], out->in_h = dims[1], out->in_w = dims[2];
  return 0;
}

/* 'ids': the categorical ids per example (0 when absent). */
static int parse_ids(json_t *root, ps_model_spec *out, char *err) {
  json_t *ids = json_object_get(root, "ids");
  if (ids && (!json_is_integer(ids) || json_integer_value(ids) < 0 ||
              json_integer_value(ids) > PS_MAX_IDS))
    return ps_seterr(err, PS_EINVAL,
                     "model: 'ids' must be an integer in 0..%d (categorical ids per example)",
                     PS_MAX_IDS);
  out->n_ids = ids ? (int)json_integer_value(ids) : 0;
  return 0;
}

/* 'classes': 2..MAX_CLASSES, or 1 for a binary model. */
static int parse_classes(json_t *root, ps_model_spec *out, char *err) {
  json_t *cl = json_object_get(root, "classes");
  if (!cl)
    return ps_seterr(err, PS_EINVAL,
                     "model: 'classes' is required (an integer in 2..%d, or 1 for a binary "
                     "model ending in sigmoid_xent)",
                     MAX_CLASSES);
  if (!json_is_integer(cl) || json_integer_value(cl) < 1 || json_integer_value(cl) > MAX_CLASSES)
    return ps_seterr(err, PS_EINVAL,
                     "model: 'classes' must be an integer in 1..%d (labels are 8-bit; 1: a "
                     "binary model ending in sigmoid_xent)",
                     MAX_CLASSES);
  out->classes = (int)json_integer_value(cl);
  return 0;
}

/* 'layers': a non-empty array of at most PS_MAX_LAYERS, into *layers. */
static int get_layer_list(json_t *root, json_t **layers, char *err) {
  *layers = json_object_get(root, "layers");
  if (!json_is_array(*layers) || json_array_size(*layers) == 0)
    return ps_seterr(err, PS_EINVAL, "model: 'layers' must be a non-empty array");
  if (json_array_size(*layers) > PS_MAX_LAYERS)
    return ps_seterr(err, PS_EINVAL, "model: %zu layers, at most %d are supported",
                     json_array_size(*layers), PS_MAX_LAYERS);
  return 0;
}

/* The entry of kinds[] that layer i (obj) names in its 'type', into *k. */
static int find_layer_kind(json_t *obj, size_t i, size_t *k, char *err) {
  if (!json_is_object(obj)) return ps_seterr(err, PS_EINVAL, "layer %zu: must be a JSON object", i);
  const char *type = json_string_value(json_object_get(obj, "type"));
  if (!type) return ps_seterr(err, PS_EINVAL, "layer %zu: 'type' is required (a string)", i);
  *k = 0;
  while (*k < N_KINDS && strcmp(kinds[*k].name, type) != 0) (*k)++;
  if (*k == N_KINDS)
    return ps_seterr(err, PS_EINVAL,
                     "layer %zu: unknown type '%.40s' (known: conv2d, maxpool, avgpool, "
                     "global_avgpool, dense, batchnorm, relu, dropout, flatten, add, "
                     "embedding, concat, fm, softmax_xent, sigmoid_xent)",
                     i, type);
  return 0;
}

/* fm: reads an unpooled embedding of 2 or more fields, [fields, dim, 1]. */
static int infer_fm(const ps_model_spec *spec, ps_layer *L, json_t *obj, const char *where,
                    char *err) {
  int c = L->in_c, h = L->in_h, w = L->in_w;
  if (L->inputs[0] < 0 || spec->layers[L->inputs[0]].type != PS_LAYER_EMBEDDING ||
      spec->layers[L->inputs[0]].pooling != PS_POOL_NONE || w != 1 || c < 2)
    return ps_seterr(err, PS_EINVAL,
                     "%s: input is %dx%dx%d; fm reads [fields >= 2, dim, 1]: an embedding "
                     "layer with pooling \"none\" over 2 or more fields",
                     where, c, h, w);
  int rc = get_flag(obj, "sum", 0, where, &L->fm_sum, err);
  L->out_c = L->fm_sum ? 1 : h, L->out_h = L->out_w = 1;
  return rc;
}

/* sigmoid_xent: the last layer of a binary model, on one logit. */
static int infer_sigmoid_xent(const ps_model_spec *spec, ps_layer *L, int last, const char *where,
                              char *err) {
  int c = L->in_c, h = L->in_h, w = L->in_w;
  if (!last) return ps_seterr(err, PS_EINVAL, "%s: must be the last layer", where);
  if (spec->classes != 1)
    return ps_seterr(err, PS_EINVAL,
                     "%s: a binary loss, but 'classes' is %d (set it to 1; labels 0 and 1)", where,
                     spec->classes);
  if ((size_t)c * h * w != 1)
    return ps_seterr(err, PS_EINVAL, "%s: input has %zu features (one logit expected)", where,
                     (size_t)c * h * w);
  L->out_c = c, L->out_h = h, L->out_w = w;
  return 0;
}

/* softmax_xent: the last layer, on one logit per class. */
static int infer_softmax_xent(const ps_model_spec *spec, ps_layer *L, int last, const char *where,
                              char *err) {
  int c = L->in_c, h = L->in_h, w = L->in_w;
  if (!last) return ps_seterr(err, PS_EINVAL, "%s: must be the last layer", where);
  if (spec->classes < 2)
    return ps_seterr(err, PS_EINVAL, "%s: 'classes' is 1 (a binary model ends in sigmoid_xent)",
                     where);
  if ((size_t)c * h * w != (size_t)spec->classes)
    return ps_seterr(err, PS_EINVAL, "%s: input has %zu features but 'classes' is %d", where,
                     (size_t)c * h * w, spec->classes);
  L->out_c = c, L->out_h = h, L->out_w = w;
  return 0;
}

/* Layer L's output shape (and its parameter counts) from its input shape
 * (L->in_*) and its keys in obj; last: it is the model's last layer. */
static int infer_layer(const ps_model_spec *spec, ps_layer *L, json_t *obj, int last,
                       const char *where, char *err) {
  int c = L->in_c, h = L->in_h, w = L->in_w;
  int rc = 0;
  switch (L->type) {
    case PS_LAYER_CONV2D: rc = infer_conv2d(L, obj, where, err); break;
    case PS_LAYER_MAXPOOL:
    case PS_LAYER_AVGPOOL: rc = infer_pool(L, obj, where, err); break;
    case PS_LAYER_GLOBAL_AVGPOOL: L->out_c = c, L->out_h = L->out_w = 1; break;
    case PS_LAYER_DENSE: rc = infer_dense(L, obj, where, err); break;
    case PS_LAYER_DROPOUT: rc = infer_dropout(L, obj, where, err); break;
    case PS_LAYER_BATCHNORM: rc = infer_batchnorm(L, obj, where, err); break;
    case PS_LAYER_RELU: L->out_c = c, L->out_h = h, L->out_w = w; break;
    case PS_LAYER_ADD:
      rc = check_add_shapes(spec, L, where, err);
      L->out_c = c, L->out_h = h, L->out_w = w;
      break;
    case PS_LAYER_FLATTEN:
      L->out_c = c * h * w; /* fits: activations checked <= MAX_ACT */
      L->out_h = L->out_w = 1;
      break;
    case PS_LAYER_EMBEDDING: rc = infer_embedding(L, obj, spec->n_ids, where, err); break;
    case PS_LAYER_CONCAT: rc = infer_concat(spec, L, err, where); break;
    case PS_LAYER_FM: rc = infer_fm(spec, L, obj, where, err); break;
    case PS_LAYER_SIGMOID_XENT: rc = infer_sigmoid_xent(spec, L, last, where, err); break;
    case PS_LAYER_SOFTMAX_XENT: rc = infer_softmax_xent(spec, L, last, where, err); break;
  }
  return rc;
}

/* Layer L's output within MAX_ACT values per example, and its parameters
 * placed at *off in the flat vector (*off moves past them). */
static int place_layer(ps_layer *L, size_t *off, const char *where, char *err) {
  size_t act;
  if (mul_within((size_t)L->out_c, (size_t)L->out_h, MAX_ACT, &act) ||
      mul_within(act, (size_t)L->out_w, MAX_ACT, &act))
    return ps_seterr(err, PS_EINVAL, "%s: output has more than %zu values per example", where,
                     MAX_ACT);
  if (L->w_count) {
    /* The counts are <= MAX_PARAMS each, so the sums below cannot wrap. */
    if (L->w_count + L->b_count + L->s_count > MAX_PARAMS - *off)
      return ps_seterr(err, PS_EINVAL, "%s: the model has more than %zu parameters", where,
                       MAX_PARAMS);
    L->w_off = *off;
    L->b_off = *off + L->w_count;
    L->s_off = L->b_off + L->b_count;
    *off += L->w_count + L->b_count + L->s_count;
  }
  return 0;
}

/* Layer i of layers into out->layers[i]: its kind, keys, name and inputs,
 * its shapes, and its parameters placed at *off. */
static int parse_layer(json_t *layers, size_t i, ps_model_spec *out, size_t *off, char *err) {
  json_t *obj = json_array_get(layers, i);
  ps_layer *L = &out->layers[i];
  char where[64];
  size_t k;
  int rc;
  if ((rc = find_layer_kind(obj, i, &k, err))) return rc;
  snprintf(where, sizeof where, "layer %zu (%s)", i, kinds[k].name);
  if ((rc = check_keys(obj, kinds[k].keys, where, err))) return rc;

  L->type = kinds[k].type;
  const char *given = json_string_value(json_object_get(obj, "name"));
  if (given) snprintf(where, sizeof where, "layer %zu (%s '%.31s')", i, kinds[k].name, given);
  if ((rc = parse_name(layers, i, out, where, err))) return rc;
  if ((rc = parse_inputs(layers, i, out, where, err))) return rc;
  int c = 0, h = 1, w = 1;
  if (L->n_inputs > 0) output_shape(out, L->inputs[0], &c, &h, &w);
  L->in_c = c, L->in_h = h, L->in_w = w;
  int last = i + 1 == json_array_size(layers);
  if ((rc = infer_layer(out, L, obj, last, where, err))) return rc;
  return place_layer(L, off, where, err);
}

/* The model ends in its loss: softmax_xent or sigmoid_xent. */
static int check_ends_in_loss(const ps_model_spec *spec, size_t n, char *err) {
  if (spec->layers[n - 1].type != PS_LAYER_SOFTMAX_XENT &&
      spec->layers[n - 1].type != PS_LAYER_SIGMOID_XENT)
    return ps_seterr(err, PS_EINVAL,
                     "model: the last layer must be softmax_xent or sigmoid_xent (layer %zu is "
                     "%s)",
                     n - 1, kind_name(spec->layers[n - 1].type));
  return 0;
}

/* Two layers on one table would send its ids twice in one request. */
static int check_one_layer_per_table(const ps_model_spec *spec, size_t n, char *err) {
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < i; j++)
      if (spec->layers[i].type == PS_LAYER_EMBEDDING &&
          spec->layers[j].type == PS_LAYER_EMBEDDING &&
          strcmp(spec->layers[i].table, spec->layers[j].table) == 0)
        return ps_seterr(err, PS_EINVAL,
                         "layer %zu (%s): table '%s' is read by layer %zu (%s) already (one "
                         "embedding layer per table; one layer may read several fields)",
                         i, spec->layers[i].name, spec->layers[i].table, j, spec->layers[j].name);
  return 0;
}

/* An output nothing reads would leave its layer's gradient unset. */
static int check_every_output_read(const ps_model_spec *spec, size_t n, char *err) {
  for (size_t i = 0; i + 1 < n; i++) {
    int read = 0;
    for (size_t j = i + 1; !read && j < n; j++)
      for (int a = 0; a < spec->layers[j].n_inputs; a++)
        read |= spec->layers[j].inputs[a] == (int)i;
    if (!read)
      return ps_seterr(err, PS_EINVAL,
                       "layer %zu (%s): no later layer reads its output (every layer but the "
                       "last must feed one)",
                       i, spec->layers[i].name);
  }
  return 0;
}

/* ---- flat models: {"params": P} ---- */

/* An initializer: "zeros", {"constant": v}, {"uniform": a} or {"normal":
 * s}, a and s finite and >= 0. PS_EINVAL naming `where` otherwise. */
static int parse_flat_init(json_t *v, const char *where, ps_flat_init *out, char *err) {
  static const char *const forms =
      "\"zeros\", {\"constant\": v}, {\"uniform\": a} or {\"normal\": s}";
  if (json_is_string(v) && strcmp(json_string_value(v), "zeros") == 0) {
    *out = (ps_flat_init){PS_INIT_ZEROS, 0.0f};
    return 0;
  }
  static const struct {
    const char *key;
    int kind, nonneg;
  } inits[] = {{"constant", PS_INIT_CONSTANT, 0},
               {"uniform", PS_INIT_UNIFORM, 1},
               {"normal", PS_INIT_NORMAL, 1}};
  if (json_is_object(v) && json_object_size(v) == 1) {
    for (size_t k = 0; k < sizeof inits / sizeof inits[0]; k++) {
      json_t *x = json_object_get(v, inits[k].key);
      if (!x) continue;
      double d = json_is_number(x) ? json_number_value(x) : NAN;
      if (!isfinite(d) || fabs(d) > 1e30 || (inits[k].nonneg && d < 0))
        return ps_seterr(err, PS_EINVAL, "%s: '%s' must be a finite number%s", where, inits[k].key,
                         inits[k].nonneg ? " >= 0" : "");
      *out = (ps_flat_init){inits[k].kind, (float)d};
      return 0;
    }
  }
  return ps_seterr(err, PS_EINVAL, "%s must be %s", where, forms);
}

/* Tensor i of a flat model's "tensors" at *off (which moves past it). */
static int parse_flat_tensor(json_t *obj, size_t i, ps_model_spec *out, size_t *off, char *err) {
  char where[80];
  snprintf(where, sizeof where, "model: tensors[%zu]", i);
  if (!json_is_object(obj))
    return ps_seterr(err, PS_EINVAL, "%s must be an object {\"name\", \"shape\", \"init\"}", where);
  int rc = check_keys(obj, "name, shape, init", where, err);
  if (rc) return rc;
  ps_flat_tensor *t = &out->tensors[i];
  const char *name = json_string_value(json_object_get(obj, "name"));
  size_t len = name ? strlen(name) : 0;
  if (!name || len == 0 || len >= sizeof t->name ||
      strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-") != len)
    return ps_seterr(err, PS_EINVAL,
                     "%s: 'name' is required: 1 to %zu characters from [A-Za-z0-9_.-]", where,
                     sizeof t->name - 1);
  snprintf(t->name, sizeof t->name, "%s", name);
  snprintf(where, sizeof where, "model: tensor '%s'", t->name);
  for (size_t j = 0; j < i; j++)
    if (strcmp(out->tensors[j].name, t->name) == 0)
      return ps_seterr(err, PS_EINVAL, "%s: the name is given twice (tensors %zu and %zu)", where,
                       j, i);
  json_t *shape = json_object_get(obj, "shape");
  size_t nd = json_is_array(shape) ? json_array_size(shape) : 0;
  if (nd < 1 || nd > PS_FLAT_MAX_DIMS)
    return ps_seterr(err, PS_EINVAL, "%s: 'shape' must be a list of 1 to %d positive integers",
                     where, PS_FLAT_MAX_DIMS);
  size_t count = 1;
  for (size_t d = 0; d < nd; d++) {
    json_t *x = json_array_get(shape, d);
    if (!json_is_integer(x) || json_integer_value(x) < 1 || json_integer_value(x) > INT32_MAX ||
        mul_within(count, (size_t)json_integer_value(x), MAX_PARAMS, &count))
      return ps_seterr(err, PS_EINVAL,
                       "%s: 'shape'[%zu] must be a positive integer (and the tensor at most %zu "
                       "values)",
                       where, d, MAX_PARAMS);
    t->shape[d] = (int32_t)json_integer_value(x);
  }
  t->ndim = (int)nd;
  t->off = *off;
  t->count = count;
  t->init = out->flat_init;
  json_t *init = json_object_get(obj, "init");
  if (init && (rc = parse_flat_init(init, where, &t->init, err))) return rc;
  if (count > out->n_params - *off)
    return ps_seterr(err, PS_EINVAL,
                     "%s: the tensors hold more than 'params' (%zu) values: [%zu, %zu) ends "
                     "past it",
                     where, out->n_params, *off, *off + count);
  *off += count;
  return 0;
}

/* A flat model: "params", and optionally "init" and "tensors". */
static int parse_flat(json_t *root, ps_model_spec *out, char *err) {
  int rc =
      check_keys(root, "params, init, tensors", "model (flat: a parameter count, no layers)", err);
  if (rc) return rc;
  json_t *p = json_object_get(root, "params");
  if (!json_is_integer(p) || json_integer_value(p) < 1 ||
      (unsigned long long)json_integer_value(p) > MAX_PARAMS)
    return ps_seterr(err, PS_EINVAL, "model: 'params' must be an integer in 1..%zu", MAX_PARAMS);
  out->flat = 1;
  out->n_params = (size_t)json_integer_value(p);
  out->flat_init = (ps_flat_init){PS_INIT_ZEROS, 0.0f};
  json_t *init = json_object_get(root, "init");
  if (init && (rc = parse_flat_init(init, "model: 'init'", &out->flat_init, err))) return rc;
  json_t *tensors = json_object_get(root, "tensors");
  if (!tensors) return 0;
  size_t n = json_is_array(tensors) ? json_array_size(tensors) : 0;
  if (n < 1 || n > PS_FLAT_MAX_TENSORS)
    return ps_seterr(err, PS_EINVAL,
                     "model: 'tensors' must be a list of 1 to %d tensors {\"name\", \"shape\"}",
                     PS_FLAT_MAX_TENSORS);
  size_t off = 0;
  for (size_t i = 0; i < n; i++)
    if ((rc = parse_flat_tensor(json_array_get(tensors, i), i, out, &off, err))) return rc;
  out->n_tensors = (int)n;
  if (off != out->n_params)
    return ps_seterr(err, PS_EINVAL,
                     "model: the tensors hold %zu values but 'params' is %zu: they must tile the "
                     "vector",
                     off, out->n_params);
  return 0;
}

int ps_model_spec_from_json(const void *json_obj, ps_model_spec *out, char *err) {
  json_t *root = (json_t *)json_obj;
  memset(out, 0, sizeof *out);
  if (!json_is_object(root)) return ps_seterr(err, PS_EINVAL, "model: must be a JSON object");
  if (json_object_get(root, "params")) return parse_flat(root, out, err);
  int rc;
  json_t *layers;
  if ((rc = check_keys(root, "input, ids, classes, layers", "model", err))) return rc;
  if ((rc = parse_input(root, out, err))) return rc;
  if ((rc = parse_ids(root, out, err))) return rc;
  if ((rc = parse_classes(root, out, err))) return rc;
  if ((rc = get_layer_list(root, &layers, err))) return rc;

  size_t off = 0;
  size_t n = json_array_size(layers);
  for (size_t i = 0; i < n; i++)
    if ((rc = parse_layer(layers, i, out, &off, err))) return rc;
  if ((rc = check_ends_in_loss(out, n, err))) return rc;
  if ((rc = check_one_layer_per_table(out, n, err))) return rc;
  if ((rc = check_every_output_read(out, n, err))) return rc;
  if (off == 0)
    return ps_seterr(err, PS_EINVAL, "model: no layer has parameters (add conv2d or dense)");
  out->n_layers = (int)n;
  out->n_params = off;
  return 0;
}

int ps_model_spec_parse(const char *json_text, ps_model_spec *out, char *err) {
  json_error_t jerr;
  json_t *root = json_loads(json_text ? json_text : "", JSON_REJECT_DUPLICATES, &jerr);
  if (!root)
    return ps_seterr(err, PS_EINVAL, "model: JSON syntax error at line %d, column %d: %s",
                     jerr.line, jerr.column, jerr.text);
  int rc = ps_model_spec_from_json(root, out, err);
  json_decref(root);
  return rc;
}

/* Weight init limit of layer i: He-uniform when a relu follows, directly
 * or after a batchnorm (keeps the activation variance through the
 * rectifier), Glorot-uniform otherwise. */
static float init_limit(const ps_model_spec *spec, int i) {
  const ps_layer *L = &spec->layers[i];
  double fan_in, fan_out;
  if (L->type == PS_LAYER_CONV2D) {
    double kk = (double)L->kernel * L->kernel;
    fan_in = L->in_c * kk;
    fan_out = L->filters * kk;
  } else {
    fan_in = (double)L->in_c * L->in_h * L->in_w;
    fan_out = L->units;
  }
  int next = i + 1;
  if (next < spec->n_layers && spec->layers[next].type == PS_LAYER_BATCHNORM) next++;
  int relu_next = next < spec->n_layers && spec->layers[next].type == PS_LAYER_RELU;
  return (float)(relu_next ? sqrt(6.0 / fan_in) : sqrt(6.0 / (fan_in + fan_out)));
}

/* Fills out[pos - begin ..] for the global indices [pos, min(stop, end))
 * with value; returns where it stopped. */
static size_t fill_const(float *out, size_t begin, size_t pos, size_t stop, size_t end,
                         float value) {
  if (stop > end) stop = end;
  for (size_t g = pos; g < stop; g++) out[g - begin] = value;
  return stop > pos ? stop : pos;
}

/* Fills out[pos - begin ..] for the global indices [pos, min(stop, end))
 * with init's values; returns where it stopped. */
static size_t fill_init(float *out, size_t begin, size_t pos, size_t stop, size_t end,
                        const ps_flat_init *init, uint64_t seed) {
  if (init->kind == PS_INIT_ZEROS || init->kind == PS_INIT_CONSTANT)
    return fill_const(out, begin, pos, stop, end, init->kind == PS_INIT_ZEROS ? 0.0f : init->value);
  if (stop > end) stop = end;
  const float a = init->value;
  if (init->kind == PS_INIT_UNIFORM)
    for (size_t g = pos; g < stop; g++)
      out[g - begin] = (2.0f * ps_rng_uniform(seed, 0, g) - 1.0f) * a;
  else
    for (size_t g = pos; g < stop; g++) out[g - begin] = ps_rng_normal(seed, 0, g) * a;
  return stop > pos ? stop : pos;
}

/* A flat model's initial values of [begin, end): each tensor's init, or
 * the model's where it names none. */
static void init_flat(const ps_model_spec *spec, uint64_t seed, size_t begin, size_t end,
                      float *out) {
  size_t pos = begin;
  for (int i = 0; i < spec->n_tensors && pos < end; i++) {
    const ps_flat_tensor *t = &spec->tensors[i];
    if (t->off + t->count <= pos) continue;
    pos = fill_init(out, begin, pos, t->off + t->count, end, &t->init, seed);
  }
  if (pos < end) fill_init(out, begin, pos, end, end, &spec->flat_init, seed);
}

void ps_model_init_params(const ps_model_spec *spec, uint64_t seed, size_t begin, size_t end,
                          float *out) {
  if (end <= begin) return;
  if (spec->flat) {
    init_flat(spec, seed, begin, end, out);
    return;
  }
  /* Walk the tensors in layout order, skipping those before the window in
   * O(layers), then fill each overlap with one tight loop. Tensors tile
   * [0, P) exactly; anything past P (a caller bug) is zero. */
  size_t pos = begin;
  for (int i = 0; i < spec->n_layers && pos < end; i++) {
    const ps_layer *L = &spec->layers[i];
    if (L->w_count == 0) continue;
    size_t lo, hi;
    ps_layer_param_range(L, &lo, &hi);
    if (hi <= pos) continue;
    const size_t w_end = L->w_off + L->w_count, b_end = L->b_off + L->b_count;
    if (L->type == PS_LAYER_BATCHNORM) {
      /* gamma 1, beta 0, moving mean 0, moving variance 1 */
      pos = fill_const(out, begin, pos, w_end, end, 1.0f);
      pos = fill_const(out, begin, pos, L->s_off + L->s_count / 2, end, 0.0f);
      pos = fill_const(out, begin, pos, hi, end, 1.0f);
      continue;
    }
    if (pos < w_end) {
      float limit = init_limit(spec, i);
      size_t stop = w_end < end ? w_end : end;
      for (size_t g = pos; g < stop; g++)
        out[g - begin] = (2.0f * ps_rng_uniform(seed, 0, g) - 1.0f) * limit;
      pos = stop;
    }
    pos = fill_const(out, begin, pos, b_end, end, 0.0f);
  }
  if (pos < end) memset(out + (pos - begin), 0, (end - pos) * sizeof *out);
}

void ps_layer_param_range(const ps_layer *L, size_t *lo, size_t *hi) {
  if (L->w_count == 0) {
    *lo = *hi = 0;
    return;
  }
  *lo = L->w_off;
  *hi = L->w_off + L->w_count + L->b_count + L->s_count;
}

int ps_model_moving_ranges(const ps_model_spec *spec, ps_moving_range *out) {
  int n = 0;
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    if (L->type != PS_LAYER_BATCHNORM) continue;
    const size_t c = L->s_count / 2;
    out[n++] = (ps_moving_range){L->s_off, c, L->momentum, 0};
    out[n++] = (ps_moving_range){L->s_off + c, c, L->momentum, 1};
  }
  return n;
}

void ps_shard_range(size_t P, int S, int s, size_t *begin, size_t *end) {
  if (S <= 0 || s < 0 || s >= S) {
    *begin = *end = 0;
    return;
  }
  /* floor(P*s/S) without forming P*s, which could wrap for huge P. */
  size_t q = P / (size_t)S, r = P % (size_t)S;
  size_t b = q * (size_t)s + r * (size_t)s / (size_t)S;
  size_t e = q * (size_t)(s + 1) + r * (size_t)(s + 1) / (size_t)S;
  /* 16 floats = 64 bytes: shard boundaries fall on cache lines. */
  *begin = b & ~(size_t)15;
  *end = s == S - 1 ? P : e & ~(size_t)15;
}

void ps_model_spec_describe(const ps_model_spec *spec, char *buf, size_t len) {
  if (!buf || len == 0) return;
  size_t used = 0;
  buf[0] = '\0';
#define APPEND(...)                                                          \
  do {                                                                       \
    if (used < len) {                                                        \
      int n_ = snprintf(buf + used, len - used, __VA_ARGS__);                \
      if (n_ > 0) used += (size_t)n_ < len - used ? (size_t)n_ : len - used; \
    }                                                                        \
  } while (0)
  if (spec->flat) {
    if (spec->n_tensors)
      APPEND("flat(%d tensors, no layers) ", spec->n_tensors);
    else
      APPEND("flat(no layers) ");
  }
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    switch (L->type) {
      case PS_LAYER_CONV2D:
        APPEND("conv2d(%d,%dx%d", L->filters, L->kernel, L->kernel);
        if (L->stride != 1) APPEND(",s%d", L->stride);
        /* The quickstart's "same" convolutions print bare, as in the
         * header's example; a padding-free one is marked. */
        if (L->pad == 0 && L->kernel > 1) APPEND(",valid");
        if (!L->b_count) APPEND(",nobias");
        APPEND(") ");
        break;
      case PS_LAYER_MAXPOOL:
      case PS_LAYER_AVGPOOL:
        if (L->pool_stride != L->pool)
          APPEND("%s(%d,s%d) ", kind_name(L->type), L->pool, L->pool_stride);
        else
          APPEND("%s(%d) ", kind_name(L->type), L->pool);
        break;
      case PS_LAYER_DENSE:
        APPEND("dense(%d%s) ", L->units, L->b_count ? "" : ",nobias");
        break;
      case PS_LAYER_BATCHNORM:
        APPEND("batchnorm ");
        break;
      case PS_LAYER_DROPOUT:
        APPEND("dropout(%g) ", (double)L->rate);
        break;
      case PS_LAYER_SOFTMAX_XENT:
        APPEND("softmax_xent(%d) ", spec->classes);
        break;
      case PS_LAYER_EMBEDDING:
        APPEND("embedding(%s,%d,f%d-%d%s) ", L->table, L->emb_dim, L->field_lo, L->field_hi,
               L->pooling == PS_POOL_SUM ? ",sum" : L->pooling == PS_POOL_MEAN ? ",mean" : "");
        break;
      case PS_LAYER_FM:
        APPEND("fm%s ", L->fm_sum ? "(sum)" : "");
        break;
      case PS_LAYER_CONCAT:
      case PS_LAYER_ADD:
        APPEND("%s(", kind_name(L->type));
        for (int a = 0; a < L->n_inputs; a++)
          APPEND("%s%s", a ? "," : "",
                 L->inputs[a] < 0 ? "input" : spec->layers[L->inputs[a]].name);
        APPEND(") ");
        break;
      default:
        APPEND("%s ", kind_name(L->type));
        break;
    }
    /* Reading other than the previous layer's output: which one, after the
     * layer's word (add lists its inputs in its own parentheses). */
    if (L->type != PS_LAYER_ADD && L->type != PS_LAYER_CONCAT && L->n_inputs == 1 && L->inputs[0] != i - 1 && used < len &&
        used > 0 && buf[used - 1] == ' ') {
      const int j = L->inputs[0];
      used--;
      APPEND("<-%s ", j < 0 ? "input" : spec->layers[j].name);
    }
  }
  APPEND("P=%zu", spec->n_params);
#undef APPEND
}

/* Model spec (a Keras-like JSON layer list), shape inference, the layout of
 * the flat parameter vector, its initial values, and the sharding of it.
 *
 * Shared by ps-server and ps-worker so that both agree on P, on every
 * tensor's offset and on the initial values.
 *
 * JSON form:
 *   {"input": [C, H, W], "classes": 10,
 *    "layers": [
 *      {"type": "conv2d", "filters": 32, "kernel": 3, "stride": 1, "padding": "same"},
 *      {"type": "relu"}, {"type": "maxpool", "size": 2, "stride": 2},
 *      {"type": "avgpool", "size": 2, "stride": 2},
 *      {"type": "global_avgpool"},
 *      {"type": "batchnorm", "momentum": 0.99, "epsilon": 0.001},
 *      {"type": "flatten"}, {"type": "dense", "units": 128},
 *      {"type": "dropout", "rate": 0.25}, {"type": "dense", "units": 10},
 *      {"type": "softmax_xent"}]}
 * Every layer may carry "name" (unique, [A-Za-z0-9_.-]; default the
 * generated "conv2d_0", "relu_1", ...) and "inputs", a list of names of
 * EARLIER layers ("input" is the model input) it reads; without it a layer
 * reads the previous layer's output (the first layer: the model input), so
 * a plain chain needs neither. {"type": "add", "inputs": ["a", "b"]} sums
 * 2 to PS_MAX_LAYER_INPUTS outputs of one shape (a residual connection);
 * every other type reads exactly one.
 * The last layer must be softmax_xent over `classes` values, or, for a
 * binary model ("classes": 1, labels 0 and 1), sigmoid_xent over one
 * logit (the logistic loss; evaluation reports ROC AUC too).
 *
 * Embedding models (click-through prediction): "ids": F says each example
 * carries F categorical 64-bit ids beside its "input" features (e.g.
 * Criteo's 26 categorical fields beside its 13 dense ones, input [13, 1,
 * 1]).
 *   {"type": "embedding", "table": "cat", "dim": 16, "fields": [0, 26],
 *    "pooling": "none"}
 * reads no layer: it looks up the ids of fields [from, to) (default all
 * F) in the job's embedding table "table" (whose "dim" must be this dim),
 * and gives, per example, with "pooling" "none" (the default) each
 * field's row one after the other (shape [to - from, dim, 1]), with "sum"
 * or "mean" the sum or mean of those rows ([dim, 1, 1]: a bag of ids). Its
 * parameters live on the servers, not in the flat vector. A job's table
 * is read by at most one embedding layer.
 *   {"type": "concat", "inputs": ["input", "emb"]}
 * joins 2 to PS_MAX_LAYER_INPUTS outputs, each taken flat (c*h*w values),
 * into one feature vector, in the order listed.
 *   {"type": "fm", "inputs": ["emb"]}
 * the factorization machine's pairwise interactions of an [F, D, 1] input
 * (an embedding layer's rows, pooling "none"): D values per example, the
 * bi-interaction pooling 0.5 * ((sum_f v_f)^2 - sum_f v_f^2) per
 * component, whose sum is sum_{f<g} <v_f, v_g>. Pooling has no
 * padding: maxpool and avgpool give floor((h - size) / stride) + 1 rows
 * (stride defaults to size), avgpool the mean of each size x size window;
 * global_avgpool gives C x 1 x 1, the mean of each channel's H x W plane.
 *
 * conv2d and dense take "bias": false (default true) for layers without a
 * bias vector (a conv2d followed by batchnorm needs none).
 *
 * batchnorm normalizes each channel (each feature after dense or flatten)
 * over the batch and the H x W plane: in training y = gamma * (x - mean) /
 * sqrt(var + epsilon) + beta with the batch's mean and (biased) variance;
 * in evaluation and export with the moving mean and variance. It holds
 * gamma (starts at 1) and beta (0), trained by the optimizer, and the
 * moving mean (0) and variance (1), which are not: a worker pushes its
 * batch's statistics in their places and the shard folds them in as
 * moving = momentum * moving + (1 - momentum) * pushed (Keras's rule and
 * defaults: momentum 0.99, epsilon 0.001; epsilon >= 1e-5).
 *
 * A flat model: the parameter count alone, no layers, for workers that
 * compute the model themselves (Python workers, python/psclient): the
 * servers initialize, shard, update, checkpoint, replicate and export it
 * as any other; ps-worker has nothing to compute for it.
 *   {"params": 421642}                          every value 0
 *   {"params": 7850, "init": {"uniform": 0.01}} one initializer for all
 *   {"params": 42, "init": "zeros", "tensors": [
 *      {"name": "fc.weight", "shape": [4, 10], "init": {"uniform": 0.3}},
 *      {"name": "fc.bias", "shape": [2]}]}
 * "init" is "zeros", {"constant": v}, {"uniform": a} (U(-a, a)) or
 * {"normal": s} (N(0, s^2)), drawn per global index from the job's seed
 * (ps_rng_uniform / ps_rng_normal), so the values do not depend on the
 * shards. "tensors" (optional) names ranges of the vector in order, each
 * with its shape (1 to PS_FLAT_MAX_DIMS dimensions) and optionally its
 * own init (default: the model's); their sizes must add up to "params".
 * Workers read them as named ranges.
 */
#ifndef PS_COMMON_MODEL_SPEC_H
#define PS_COMMON_MODEL_SPEC_H

#include <stddef.h>
#include <stdint.h>

#define PS_MAX_LAYERS 64
#define PS_MAX_LAYER_INPUTS 4
#define PS_MAX_IDS 1024 /* categorical ids per example */

typedef enum {
  PS_LAYER_CONV2D,
  PS_LAYER_MAXPOOL,
  PS_LAYER_DENSE,
  PS_LAYER_RELU,
  PS_LAYER_DROPOUT,
  PS_LAYER_FLATTEN,
  PS_LAYER_SOFTMAX_XENT,
  PS_LAYER_AVGPOOL,
  PS_LAYER_GLOBAL_AVGPOOL,
  PS_LAYER_ADD,
  PS_LAYER_BATCHNORM,
  PS_LAYER_EMBEDDING,
  PS_LAYER_CONCAT,
  PS_LAYER_SIGMOID_XENT,
  PS_LAYER_FM,
} ps_layer_type;

/* embedding's pooling */
enum { PS_POOL_NONE = 0, PS_POOL_SUM = 1, PS_POOL_MEAN = 2 };

typedef struct {
  ps_layer_type type;
  char name[32];         /* "conv2d_0", "dense_1", ..., or the spec's "name" */
  /* The layers whose outputs this one reads (-1: the model input), all
   * earlier in the list; one except for add. */
  int n_inputs;
  int inputs[PS_MAX_LAYER_INPUTS];
  int in_c, in_h, in_w;  /* input shape per example (dense: in_c features, h=w=1) */
  int out_c, out_h, out_w;
  /* conv2d */
  int filters, kernel, stride, pad; /* pad = kernel/2 for "same", 0 for "valid" */
  /* maxpool, avgpool (global_avgpool: neither, its window is the input) */
  int pool, pool_stride;
  /* dense */
  int units;
  /* dropout */
  float rate;
  /* batchnorm */
  float momentum, epsilon;
  /* embedding: the table (its name; its index in the job's "embeddings",
   * -1 until the job resolves it), the rows' dim, the id fields [field_lo,
   * field_hi) it reads, and pooling (PS_POOL_*) */
  char table[32];
  int table_index;
  int emb_dim, field_lo, field_hi, pooling;
  /* fm: 1 when its output is the pairwise term itself (the sum over the
   * dim components: one value), 0 for the dim components */
  int fm_sum;
  /* parameters in the flat vector, in this order; count 0 when the layer
   * has none.
   * conv2d:    w (filters, in_c*kernel*kernel), b (filters; 0 without bias)
   * dense:     w (units, in_c*in_h*in_w),        b (units; 0 without bias)
   * batchnorm: w gamma (C), b beta (C), s the moving mean (C) then the
   *            moving variance (C): s is not trained but averaged (see
   *            ps_model_moving_ranges). */
  size_t w_off, w_count;
  size_t b_off, b_count;
  size_t s_off, s_count;
} ps_layer;

/* A flat model's initializers (ps_flat_init.kind). */
enum { PS_INIT_ZEROS = 0, PS_INIT_CONSTANT = 1, PS_INIT_UNIFORM = 2, PS_INIT_NORMAL = 3 };
typedef struct {
  int kind;    /* PS_INIT_* */
  float value; /* constant: the value; uniform: the bound a of U(-a, a); normal: the std */
} ps_flat_init;

#define PS_FLAT_MAX_TENSORS 256
#define PS_FLAT_MAX_DIMS 6
/* A named range of a flat model: [off, off + count), count the product
 * of shape[0 .. ndim). */
typedef struct {
  char name[48];
  size_t off, count;
  int ndim;
  int32_t shape[PS_FLAT_MAX_DIMS];
  ps_flat_init init;
} ps_flat_tensor;

typedef struct {
  int in_c, in_h, in_w;
  int n_ids;   /* categorical ids per example ("ids"; 0: none) */
  int classes; /* 1: a binary model (sigmoid_xent) */
  int n_layers;
  ps_layer layers[PS_MAX_LAYERS];
  size_t n_params; /* P */
  /* A flat model ({"params": P}): no layers (n_layers 0, no input or
   * classes); its initializer and its named ranges, if any. */
  int flat;
  ps_flat_init flat_init;
  int n_tensors;
  ps_flat_tensor tensors[PS_FLAT_MAX_TENSORS];
} ps_model_spec;

/* Parses the spec from JSON text (layers, or a flat model). On error
 * returns PS_EINVAL with a message naming the layer (or tensor) and the
 * field; *out is then unspecified. */
int ps_model_spec_parse(const char *json_text, ps_model_spec *out, char *err);

/* Same, from a jansson object (json_t *), to parse a spec inside a job. */
int ps_model_spec_from_json(const void *json_obj, ps_model_spec *out, char *err);

/* Initial values of the global parameter indices [begin, end) into
 * out[0 .. end-begin). Weights: He-uniform for layers followed by relu
 * (or by batchnorm and relu), Glorot-uniform otherwise, drawn from
 * ps_rng_uniform(seed, 0, index); biases: zero; batchnorm: gamma 1, beta
 * 0, moving mean 0, moving variance 1. A flat model: each tensor's (or
 * the model's) init. The result depends only on (spec, seed, index). */
void ps_model_init_params(const ps_model_spec *spec, uint64_t seed, size_t begin, size_t end,
                          float *out);

/* [*lo, *hi): all of layer L's parameters (w, b and s); empty (lo == hi)
 * when it has none. */
void ps_layer_param_range(const ps_layer *L, size_t *lo, size_t *hi);

/* The parameters that a push does not train but averages in (batchnorm's
 * moving mean and variance): [off, off + count) with the layer's momentum,
 * nonneg when the pushed values must not be negative (a variance). */
typedef struct {
  size_t off, count;
  float momentum;
  int nonneg;
} ps_moving_range;
#define PS_MAX_MOVING_RANGES (2 * PS_MAX_LAYERS)

/* Fills out[] (room for PS_MAX_MOVING_RANGES) with the model's moving
 * ranges in layout order; returns how many. */
int ps_model_moving_ranges(const ps_model_spec *spec, ps_moving_range *out);

/* The range of shard s of S over P values: [P*s/S, P*(s+1)/S) with both
 * ends rounded down to a multiple of 16 values (64 bytes), the last end P. */
void ps_shard_range(size_t P, int S, int s, size_t *begin, size_t *end);

/* One-line description, e.g. "conv2d(32,3x3) relu maxpool(2) ... P=421642"
 * (avgpool(2), avgpool(3,s2) and global_avgpool alike). A layer that reads
 * other than the previous layer says which it reads by name:
 * "add(conv2d_1,relu_0)", "conv2d(8,3x3)<-input". */
void ps_model_spec_describe(const ps_model_spec *spec, char *buf, size_t len);

#endif

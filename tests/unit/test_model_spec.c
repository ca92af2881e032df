/* Model spec: shapes, layout, errors, initial values and sharding. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/model_spec.h"
#include "common/util.h"
#include "tests/unit/check.h"

static const char *QUICKSTART =
    "{\"input\": [1, 28, 28], \"classes\": 10, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 32, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"relu\"},"
    "{\"type\": \"maxpool\", \"size\": 2},"
    "{\"type\": \"conv2d\", \"filters\": 64, \"kernel\": 3, \"padding\": \"same\"},"
    "{\"type\": \"relu\"},"
    "{\"type\": \"maxpool\", \"size\": 2},"
    "{\"type\": \"flatten\"},"
    "{\"type\": \"dense\", \"units\": 128},"
    "{\"type\": \"relu\"},"
    "{\"type\": \"dense\", \"units\": 10},"
    "{\"type\": \"softmax_xent\"}]}";

static void test_quickstart_layout(void) {
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  int rc = ps_model_spec_parse(QUICKSTART, &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(m.in_c == 1 && m.in_h == 28 && m.in_w == 28 && m.classes == 10);
  CHECK(m.n_layers == 11);
  /* By hand: conv 32*1*9+32, conv 64*32*9+64, dense 128*(64*7*7)+128,
   * dense 10*128+10. */
  CHECK(m.n_params == 320 + 18496 + 401536 + 1290);
  CHECK(m.n_params == 421642);

  const ps_layer *L = m.layers;
  CHECK(strcmp(L[0].name, "conv2d_0") == 0);
  CHECK(strcmp(L[1].name, "relu_0") == 0);
  CHECK(strcmp(L[2].name, "maxpool_0") == 0);
  CHECK(strcmp(L[3].name, "conv2d_1") == 0);
  CHECK(strcmp(L[6].name, "flatten_0") == 0);
  CHECK(strcmp(L[7].name, "dense_0") == 0);
  CHECK(strcmp(L[8].name, "relu_2") == 0);
  CHECK(strcmp(L[9].name, "dense_1") == 0);
  CHECK(strcmp(L[10].name, "softmax_xent_0") == 0);

  CHECK(L[0].pad == 1 && L[0].stride == 1 && L[0].out_c == 32 && L[0].out_h == 28 &&
        L[0].out_w == 28);
  CHECK(L[0].w_off == 0 && L[0].w_count == 288 && L[0].b_off == 288 && L[0].b_count == 32);
  CHECK(L[2].pool == 2 && L[2].pool_stride == 2 && L[2].out_h == 14 && L[2].out_c == 32);
  CHECK(L[3].in_c == 32 && L[3].in_h == 14);
  CHECK(L[3].w_off == 320 && L[3].w_count == 18432 && L[3].b_off == 18752 && L[3].b_count == 64);
  CHECK(L[5].out_c == 64 && L[5].out_h == 7 && L[5].out_w == 7);
  CHECK(L[6].out_c == 3136 && L[6].out_h == 1 && L[6].out_w == 1);
  CHECK(L[7].in_c == 3136 && L[7].in_h == 1 && L[7].units == 128);
  CHECK(L[7].w_off == 18816 && L[7].w_count == 401408 && L[7].b_off == 420224 &&
        L[7].b_count == 128);
  CHECK(L[9].w_off == 420352 && L[9].w_count == 1280 && L[9].b_off == 421632 && L[9].b_count == 10);
  CHECK(L[9].b_off + L[9].b_count == m.n_params);
  for (int i = 0; i < m.n_layers; i++)
    if (L[i].type != PS_LAYER_CONV2D && L[i].type != PS_LAYER_DENSE)
      CHECK(L[i].w_count == 0 && L[i].b_count == 0);

  char desc[256];
  ps_model_spec_describe(&m, desc, sizeof desc);
  CHECK_MSG(strstr(desc, "conv2d(32,3x3) relu maxpool(2)") == desc, "%s", desc);
  CHECK_MSG(strstr(desc, "dense(128)") != NULL, "%s", desc);
  CHECK_MSG(strstr(desc, "P=421642") != NULL, "%s", desc);
  /* A short buffer is truncated, never overrun. */
  char tiny[12];
  memset(tiny, 'x', sizeof tiny);
  ps_model_spec_describe(&m, tiny, 8);
  CHECK(strlen(tiny) == 7 && tiny[8] == 'x');
}

static void test_shapes(void) {
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  /* Default padding is valid; stride 2 "same" halves (rounding up);
   * maxpool with its own stride; dense straight after a conv reads it flat;
   * dropout keeps the shape. */
  int rc = ps_model_spec_parse(
      "{\"input\": [3, 15, 15], \"classes\": 5, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3},"
      "{\"type\": \"conv2d\", \"filters\": 6, \"kernel\": 5, \"stride\": 2, \"padding\": "
      "\"same\"},"
      "{\"type\": \"maxpool\", \"size\": 3, \"stride\": 2},"
      "{\"type\": \"dropout\", \"rate\": 0.25},"
      "{\"type\": \"dense\", \"units\": 5},"
      "{\"type\": \"softmax_xent\"}]}",
      &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(m.layers[0].pad == 0 && m.layers[0].out_h == 13 && m.layers[0].w_count == 4 * 3 * 9);
  CHECK(m.layers[1].pad == 2 && m.layers[1].out_h == 7 && m.layers[1].out_w == 7);
  CHECK(m.layers[2].out_h == 3 && m.layers[2].out_c == 6);
  CHECK(m.layers[3].out_c == 6 && m.layers[3].out_h == 3 && m.layers[3].rate == 0.25f);
  CHECK(m.layers[4].in_c == 54 && m.layers[4].in_h == 1 && m.layers[4].w_count == 5 * 54);
  CHECK(m.n_params == 4 * 27 + 4 + 6 * 4 * 25 + 6 + 5 * 54 + 5);

  /* The same through a jansson object, as the job parser does. */
  json_t *root = json_loads(
      "{\"input\": [2, 1, 1], \"classes\": 3, \"layers\": ["
      "{\"type\": \"dense\", \"units\": 3},"
      "{\"type\": \"softmax_xent\"}]}",
      0, NULL);
  CHECK(root != NULL);
  rc = ps_model_spec_from_json(root, &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(m.n_params == 9 && m.n_layers == 2);
  json_decref(root);
}

/* avgpool: maxpool's window rules (stride defaults to size, no padding,
 * floor((h - size) / stride) + 1); global_avgpool: C x 1 x 1, read by a
 * dense layer as C features, with or without a flatten between. Neither
 * has parameters; the enum values of the older types are unchanged. */
static void test_pooling_layers(void) {
  CHECK(PS_LAYER_CONV2D == 0 && PS_LAYER_MAXPOOL == 1 && PS_LAYER_SOFTMAX_XENT == 6);
  CHECK(PS_LAYER_AVGPOOL == 7 && PS_LAYER_GLOBAL_AVGPOOL == 8);
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  int rc = ps_model_spec_parse(
      "{\"input\": [3, 15, 13], \"classes\": 5, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"avgpool\", \"size\": 2},"
      "{\"type\": \"avgpool\", \"size\": 3, \"stride\": 2},"
      "{\"type\": \"conv2d\", \"filters\": 6, \"kernel\": 1},"
      "{\"type\": \"global_avgpool\"},"
      "{\"type\": \"dense\", \"units\": 5},"
      "{\"type\": \"softmax_xent\"}]}",
      &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  const ps_layer *L = m.layers;
  CHECK(L[1].type == PS_LAYER_AVGPOOL && strcmp(L[1].name, "avgpool_0") == 0);
  CHECK(L[1].pool == 2 && L[1].pool_stride == 2);
  CHECK(L[1].out_c == 4 && L[1].out_h == 7 && L[1].out_w == 6); /* 15x13 -> 7x6 */
  CHECK(strcmp(L[2].name, "avgpool_1") == 0 && L[2].pool == 3 && L[2].pool_stride == 2);
  CHECK(L[2].out_h == 3 && L[2].out_w == 2); /* (7-3)/2+1, (6-3)/2+1 */
  CHECK(L[3].in_h == 3 && L[3].in_w == 2 && L[3].out_c == 6);
  CHECK(L[4].type == PS_LAYER_GLOBAL_AVGPOOL && strcmp(L[4].name, "global_avgpool_0") == 0);
  CHECK(L[4].in_c == 6 && L[4].in_h == 3 && L[4].in_w == 2);
  CHECK(L[4].out_c == 6 && L[4].out_h == 1 && L[4].out_w == 1);
  CHECK(L[5].in_c == 6 && L[5].w_count == 5 * 6);
  for (int i = 1; i < 5; i++)
    if (i != 3) CHECK(L[i].w_count == 0 && L[i].b_count == 0);
  CHECK(m.n_params == 4 * 27 + 4 + 6 * 4 + 6 + 5 * 6 + 5);
  char desc[256];
  ps_model_spec_describe(&m, desc, sizeof desc);
  CHECK_MSG(strstr(desc,
                   "conv2d(4,3x3) avgpool(2) avgpool(3,s2) conv2d(6,1x1) global_avgpool "
                   "dense(5) softmax_xent(5) P=") == desc,
            "%s", desc);

  /* A flatten after global average pooling, and global pooling of a 1x1
   * input (the identity). */
  rc = ps_model_spec_parse(
      "{\"input\": [2, 4, 4], \"classes\": 3, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 8, \"kernel\": 4},"
      "{\"type\": \"global_avgpool\"}, {\"type\": \"flatten\"},"
      "{\"type\": \"dense\", \"units\": 3}, {\"type\": \"softmax_xent\"}]}",
      &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(m.layers[0].out_h == 1 && m.layers[1].out_c == 8 && m.layers[1].out_h == 1);
  CHECK(m.layers[2].out_c == 8 && m.layers[3].in_c == 8 && m.layers[3].w_count == 24);
}

/* Parses text, expects PS_EINVAL and a message containing want. */
static void expect_error(const char *text, const char *want) {
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  int rc = ps_model_spec_parse(text, &m, err);
  CHECK_MSG(rc == PS_EINVAL, "rc %d for %s", rc, text);
  CHECK_MSG(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

#define HEAD "{\"input\": [1, 8, 8], \"classes\": 10, \"layers\": ["
#define TAIL \
  "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}"

static void test_errors(void) {
  /* Each shape rule, with the message that names layer and field. */
  expect_error(HEAD "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 9}," TAIL,
               "layer 0 (conv2d): 'kernel' 9 is larger than");
  expect_error(HEAD
               "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 4, \"padding\": "
               "\"same\"}," TAIL,
               "layer 0 (conv2d): 'padding' \"same\" needs an odd 'kernel'");
  expect_error(HEAD
               "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": "
               "\"full\"}," TAIL,
               "'padding' must be");
  expect_error(HEAD "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 10}]}",
               "the last layer must be softmax_xent or sigmoid_xent (layer 1 is dense)");
  expect_error(HEAD
               "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 12},"
               "{\"type\": \"softmax_xent\"}]}",
               "layer 2 (softmax_xent): input has 12 features but 'classes' is 10");
  expect_error(HEAD "{\"type\": \"conv3d\", \"filters\": 4}," TAIL,
               "layer 0: unknown type 'conv3d'");
  expect_error(HEAD "{\"type\": \"conv2d\", \"filter\": 4, \"kernel\": 3}," TAIL,
               "layer 0 (conv2d): unknown field 'filter'");
  expect_error(HEAD
               "{\"type\": \"relu\"}, {\"type\": \"relu\"}, {\"type\": \"flatten\"},"
               "{\"type\": \"dense\", \"units\": -5}, {\"type\": \"softmax_xent\"}]}",
               "layer 3 (dense): 'units' must be a positive integer");
  expect_error(HEAD
               "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 2.5},"
               "{\"type\": \"softmax_xent\"}]}",
               "layer 1 (dense): 'units' must be a positive integer");
  expect_error(HEAD
               "{\"type\": \"flatten\"}, {\"type\": \"dense\"}, {\"type\": \"softmax_xent\"}]}",
               "layer 1 (dense): 'units' is required");
  expect_error(HEAD "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"stride\": 0}," TAIL,
               "layer 0 (conv2d): 'stride' must be a positive integer");
  expect_error(HEAD "{\"type\": \"maxpool\", \"size\": 9}," TAIL,
               "layer 0 (maxpool): 'size' 9 is larger than the input 8x8");
  expect_error(HEAD "{\"type\": \"avgpool\", \"size\": 9}," TAIL,
               "layer 0 (avgpool): 'size' 9 is larger than the input 8x8");
  expect_error(HEAD "{\"type\": \"avgpool\"}," TAIL, "layer 0 (avgpool): 'size' is required");
  expect_error(HEAD "{\"type\": \"avgpool\", \"size\": 2, \"stride\": 0}," TAIL,
               "layer 0 (avgpool): 'stride' must be a positive integer");
  expect_error(HEAD "{\"type\": \"avgpool\", \"size\": 2, \"padding\": \"same\"}," TAIL,
               "layer 0 (avgpool): unknown field 'padding' (known: type, size, stride, name, "
               "inputs)");
  expect_error(HEAD "{\"type\": \"global_avgpool\", \"size\": 2}," TAIL,
               "layer 0 (global_avgpool): unknown field 'size' (known: type, name, inputs)");
  expect_error(HEAD "{\"type\": \"avgpooling\"}," TAIL,
               "unknown type 'avgpooling' (known: conv2d, maxpool, avgpool, global_avgpool,");
  expect_error(HEAD "{\"type\": \"dropout\", \"rate\": 1.0}," TAIL,
               "layer 0 (dropout): 'rate' must be a number in [0, 1)");
  expect_error(HEAD "{\"type\": \"dropout\"}," TAIL, "layer 0 (dropout): 'rate' is required");
  expect_error(HEAD "{\"type\": \"softmax_xent\"}," TAIL,
               "layer 0 (softmax_xent): must be the last layer");
  expect_error(HEAD "{\"units\": 3}," TAIL, "layer 0: 'type' is required");
  expect_error(HEAD "3," TAIL, "layer 0: must be a JSON object");
  expect_error("{\"classes\": 10, \"layers\": [" TAIL, "'input' is required");
  expect_error("{\"input\": [1, 8], \"classes\": 10, \"layers\": [" TAIL,
               "'input' must be an array [C, H, W]");
  expect_error("{\"input\": [1, 0, 8], \"classes\": 10, \"layers\": [" TAIL, "'input'[1]");
  expect_error("{\"input\": [1, 8, 8], \"layers\": [" TAIL, "'classes' is required");
  expect_error("{\"input\": [1, 8, 8], \"classes\": 1000, \"layers\": [" TAIL,
               "'classes' must be an integer in 1..256");
  expect_error("{\"input\": [1, 8, 8], \"classes\": 10, \"layers\": []}",
               "'layers' must be a non-empty array");
  expect_error("{\"input\": [1, 8, 8], \"classes\": 10, \"layer\": []}",
               "model: unknown field 'layer'");
  expect_error(
      "{\"input\": [10, 1, 1], \"classes\": 10, \"layers\": [{\"type\": "
      "\"softmax_xent\"}]}",
      "no layer has parameters");
  expect_error(HEAD "{\"type\": \"flatten\"}, {\"type\": \"flatten\", \"type\": \"relu\"}]}",
               "JSON syntax error at line 1");
  expect_error("{\"input\": [1, 8, 8], ", "JSON syntax error at line 1, column");

  /* Absurd sizes: P beyond 2^31 values, a huge activation, too many layers. */
  expect_error(
      "{\"input\": [1, 1000, 1000], \"classes\": 10, \"layers\": ["
      "{\"type\": \"dense\", \"units\": 100000}, {\"type\": \"dense\", \"units\": 10},"
      "{\"type\": \"softmax_xent\"}]}",
      "layer 0 (dense): too many weights");
  expect_error(
      "{\"input\": [1, 1000, 1000], \"classes\": 10, \"layers\": ["
      "{\"type\": \"dense\", \"units\": 2000}, {\"type\": \"dense\", \"units\": 100000},"
      "{\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}",
      "layer 1 (dense): the model has more than 2147483647 parameters");
  expect_error("{\"input\": [65536, 65536, 65536], \"classes\": 10, \"layers\": [" TAIL,
               "'input' has more than");
  expect_error(
      "{\"input\": [1, 40000, 40000], \"classes\": 10, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 1000, \"kernel\": 1}," TAIL,
      "layer 0 (conv2d): output has more than");
  char big[4096] = HEAD;
  for (int i = 0; i < PS_MAX_LAYERS; i++) strcat(big, "{\"type\": \"relu\"},");
  strcat(big, TAIL);
  expect_error(big, "at most 64 are supported");
}

static void test_init_params(void) {
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  CHECK(ps_model_spec_parse(QUICKSTART, &m, err) == 0);
  size_t P = m.n_params;
  float *full = malloc(P * sizeof *full), *part = malloc(P * sizeof *part);
  CHECK(full && part);
  if (!full || !part) return;
  ps_model_init_params(&m, 42, 0, P, full);

  /* Sharded initialization is bit-identical to the whole vector. */
  const int shard_counts[] = {1, 2, 3, 7};
  for (int k = 0; k < 4; k++) {
    int S = shard_counts[k];
    memset(part, 0xff, P * sizeof *part);
    for (int s = 0; s < S; s++) {
      size_t b, e;
      ps_shard_range(P, S, s, &b, &e);
      ps_model_init_params(&m, 42, b, e, part + b);
    }
    CHECK_MSG(memcmp(full, part, P * sizeof *full) == 0, "S=%d", S);
  }
  /* Windows that start and end inside tensors and cross several. */
  const size_t windows[][2] = {{280, 330},       {287, 289},       {300, 18900},
                               {420200, 421642}, {421641, 421642}, {5, 5}};
  for (int k = 0; k < 6; k++) {
    size_t b = windows[k][0], e = windows[k][1];
    ps_model_init_params(&m, 42, b, e, part);
    CHECK_MSG(memcmp(full + b, part, (e - b) * sizeof *full) == 0, "[%zu, %zu)", b, e);
  }

  /* Biases zero; weights within their limit and spread over it: He
   * (followed by relu) for the first three, Glorot for the logits layer. */
  const int wl[] = {0, 3, 7, 9};
  const double limits[] = {sqrt(6.0 / 9), sqrt(6.0 / 288), sqrt(6.0 / 3136),
                           sqrt(6.0 / (128 + 10))};
  for (int k = 0; k < 4; k++) {
    const ps_layer *L = &m.layers[wl[k]];
    double sum = 0, maxabs = 0;
    for (size_t i = L->w_off; i < L->w_off + L->w_count; i++) {
      sum += full[i];
      if (fabs(full[i]) > maxabs) maxabs = fabs(full[i]);
    }
    CHECK_MSG(maxabs <= limits[k] * (1 + 1e-6), "%s max %g limit %g", L->name, maxabs, limits[k]);
    CHECK_MSG(maxabs >= limits[k] * 0.9, "%s max %g limit %g", L->name, maxabs, limits[k]);
    /* Uniform on [-1, 1] has sd 0.577: 6 standard errors of the mean, and
     * at least 0.05 for the small layers. */
    double mean = sum / (double)L->w_count / limits[k];
    double tol = fmax(0.05, 6 * 0.577 / sqrt((double)L->w_count));
    CHECK_MSG(fabs(mean) <= tol, "%s mean/limit %g", L->name, mean);
    int zeros = 0;
    for (size_t i = L->b_off; i < L->b_off + L->b_count; i++) zeros += full[i] == 0.0f;
    CHECK((size_t)zeros == L->b_count);
  }

  /* The values depend on the seed. */
  ps_model_init_params(&m, 43, 0, 1000, part);
  CHECK(memcmp(full, part, 1000 * sizeof *full) != 0);
  free(full);
  free(part);
}

static void test_shard_range(void) {
  const size_t Ps[] = {0, 1, 15, 16, 17, 100, 421642, 1000003};
  const int Ss[] = {1, 2, 3, 5, 7, 8, 16, 64, 100};
  for (size_t pi = 0; pi < sizeof Ps / sizeof *Ps; pi++) {
    for (size_t si = 0; si < sizeof Ss / sizeof *Ss; si++) {
      size_t P = Ps[pi];
      int S = Ss[si];
      size_t prev_end = 0, b, e;
      int ok = 1;
      for (int s = 0; s < S; s++) {
        ps_shard_range(P, S, s, &b, &e);
        ok &= b == prev_end && b <= e;
        if (s < S - 1) ok &= e % 16 == 0;
        /* Balanced: at most one alignment unit more than an even split. */
        ok &= e - b <= P / (size_t)S + 1 + 16;
        prev_end = e;
      }
      ok &= prev_end == P;
      CHECK_MSG(ok, "P=%zu S=%d", P, S);
    }
  }
  size_t b, e;
  ps_shard_range(421642, 2, 0, &b, &e);
  CHECK(b == 0 && e == 210816);
  ps_shard_range(421642, 2, 1, &b, &e);
  CHECK(b == 210816 && e == 421642);
  /* Out-of-range arguments give an empty range. */
  ps_shard_range(100, 2, 2, &b, &e);
  CHECK(b == 0 && e == 0);
  ps_shard_range(100, 0, 0, &b, &e);
  CHECK(b == 0 && e == 0);
}

/* A residual block: conv -> relu -> conv(same) -> add(with the first
 * conv's output) -> relu -> flatten -> dense -> softmax_xent. */
#define RESIDUAL                                                                         \
  "{\"input\": [1, 8, 8], \"classes\": 10, \"layers\": ["                                \
  "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": \"same\"},"        \
  "{\"type\": \"relu\"},"                                                                \
  "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"padding\": \"same\","         \
  " \"name\": \"branch\"},"                                                              \
  "{\"type\": \"add\", \"inputs\": [\"branch\", \"conv2d_0\"]},"                         \
  "{\"type\": \"relu\"}, {\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 10}," \
  "{\"type\": \"softmax_xent\"}]}"

static void test_residual(void) {
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  int rc = ps_model_spec_parse(RESIDUAL, &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  const ps_layer *L = m.layers;
  CHECK(m.n_layers == 8);
  /* Names: the given one, and the generated ones as if it had none. */
  CHECK(strcmp(L[0].name, "conv2d_0") == 0 && strcmp(L[2].name, "branch") == 0);
  CHECK(strcmp(L[3].name, "add_0") == 0 && strcmp(L[4].name, "relu_1") == 0);
  /* Inputs: by default the previous layer, the model input for the first. */
  CHECK(L[0].n_inputs == 1 && L[0].inputs[0] == -1);
  CHECK(L[1].n_inputs == 1 && L[1].inputs[0] == 0);
  CHECK(L[3].type == PS_LAYER_ADD && L[3].n_inputs == 2 && L[3].inputs[0] == 2 &&
        L[3].inputs[1] == 0);
  CHECK(L[3].in_c == 4 && L[3].out_c == 4 && L[3].out_h == 8 && L[3].out_w == 8);
  CHECK(L[3].w_count == 0 && L[3].b_count == 0);
  CHECK(L[6].in_c == 4 * 8 * 8);
  CHECK(m.n_params == (4 * 9 + 4) + (4 * 4 * 9 + 4) + (10 * 256 + 10));
  char desc[256];
  ps_model_spec_describe(&m, desc, sizeof desc);
  CHECK_MSG(strstr(desc,
                   "conv2d(4,3x3) relu conv2d(4,3x3) add(branch,conv2d_0) relu flatten "
                   "dense(10) softmax_xent(10) P=") == desc,
            "%s", desc);

  /* A branch: a layer reading an earlier output than the previous one,
   * and "input" for the batch itself; add of three. */
  rc = ps_model_spec_parse(
      HEAD
      "{\"type\": \"relu\", \"name\": \"r\"},"
      "{\"type\": \"avgpool\", \"size\": 1, \"inputs\": [\"input\"]},"
      "{\"type\": \"add\", \"inputs\": [\"r\", \"avgpool_0\", \"input\"]}," TAIL,
      &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(m.layers[1].inputs[0] == -1 && m.layers[2].n_inputs == 3 && m.layers[2].inputs[2] == -1);
  ps_model_spec_describe(&m, desc, sizeof desc);
  CHECK_MSG(strstr(desc, "relu avgpool(1)<-input add(r,avgpool_0,input) flatten") == desc, "%s",
            desc);
}

static void test_residual_errors(void) {
  expect_error(HEAD "{\"type\": \"relu\", \"inputs\": [\"nope\"]}," TAIL,
               "layer 0 (relu): 'inputs' names 'nope', which is no earlier layer");
  expect_error(HEAD "{\"type\": \"relu\", \"inputs\": [\"relu_1\"]}, {\"type\": \"relu\"}," TAIL,
               "layer 0 (relu): 'inputs' names 'relu_1', which is a later layer");
  expect_error(HEAD "{\"type\": \"relu\", \"name\": \"me\", \"inputs\": [\"me\"]}," TAIL,
               "layer 0 (relu 'me'): 'inputs' names 'me', which is this layer");
  expect_error(HEAD
               "{\"type\": \"conv2d\", \"filters\": 2, \"kernel\": 3},"
               "{\"type\": \"add\", \"inputs\": [\"conv2d_0\", \"input\"]}," TAIL,
               "layer 1 (add): inputs 'conv2d_0' (2x6x6) and 'input' (1x8x8) differ in shape");
  expect_error(HEAD
               "{\"type\": \"relu\", \"name\": \"a\"},"
               "{\"type\": \"relu\", \"name\": \"a\"}," TAIL,
               "layer 1 (relu 'a'): duplicate name 'a' (layer 0 has it too)");
  /* A given name that a later generated one repeats. */
  expect_error(HEAD "{\"type\": \"relu\", \"name\": \"relu_1\"}, {\"type\": \"relu\"}," TAIL,
               "layer 1 (relu): duplicate name 'relu_1'");
  expect_error(HEAD "{\"type\": \"relu\", \"name\": \"input\"}," TAIL,
               "the name 'input' is the model input's");
  expect_error(HEAD "{\"type\": \"relu\", \"name\": \"a b\"}," TAIL,
               "layer 0 (relu 'a b'): 'name' must be a string of 1 to 31 characters from "
               "[A-Za-z0-9_.-]");
  expect_error(HEAD "{\"type\": \"relu\", \"name\": \"\"}," TAIL, "'name' must be a string");
  expect_error(HEAD "{\"type\": \"add\"}," TAIL,
               "layer 0 (add): 'inputs' is required (the names of 2 to 4 earlier layers)");
  expect_error(HEAD "{\"type\": \"add\", \"inputs\": [\"input\"]}," TAIL,
               "layer 0 (add): 'inputs' must be an array of 2 to 4 layer names");
  expect_error(HEAD
               "{\"type\": \"relu\"},"
               "{\"type\": \"relu\", \"inputs\": [\"input\", \"relu_0\"]}," TAIL,
               "layer 1 (relu): 'inputs' must be an array of one layer name (only add and concat take more)");
  expect_error(HEAD "{\"type\": \"relu\", \"inputs\": \"input\"}," TAIL,
               "'inputs' must be an array of one layer name");
  expect_error(HEAD "{\"type\": \"relu\", \"inputs\": [3]}," TAIL,
               "layer 0 (relu): 'inputs'[0] must be a string");
  /* A dead branch: an output nothing reads. */
  expect_error(HEAD "{\"type\": \"relu\"}, {\"type\": \"relu\", \"inputs\": [\"input\"]}," TAIL,
               "layer 0 (relu_0): no later layer reads its output");
  /* softmax_xent stays last, and may read an earlier layer. */
  expect_error(HEAD
               "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 10},"
               "{\"type\": \"softmax_xent\"}, {\"type\": \"add\", \"inputs\": "
               "[\"dense_0\", \"dense_0\"]}]}",
               "layer 2 (softmax_xent): must be the last layer");
}

/* batchnorm: layout (gamma, beta, moving mean, moving variance), initial
 * values, the moving ranges, bias-less layers, and the errors. */
static void test_batchnorm(void) {
  ps_model_spec m;
  char err[PS_ERRLEN] = "";
  int rc = ps_model_spec_parse(HEAD
                               "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, "
                               "\"padding\": \"same\", \"bias\": false},"
                               "{\"type\": \"batchnorm\"}, {\"type\": \"relu\"},"
                               "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 6},"
                               "{\"type\": \"batchnorm\", \"momentum\": 0.9, \"epsilon\": 1e-5},"
                               "{\"type\": \"dense\", \"units\": 10, \"bias\": true},"
                               "{\"type\": \"softmax_xent\"}]}",
                               &m, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  const ps_layer *L = m.layers;
  /* conv: 4*9 weights, no bias; batchnorm over 4 channels of 8x8 */
  CHECK(L[0].w_count == 36 && L[0].b_count == 0 && L[0].s_count == 0);
  CHECK(L[1].type == PS_LAYER_BATCHNORM && strcmp(L[1].name, "batchnorm_0") == 0);
  CHECK(L[1].out_c == 4 && L[1].out_h == 8 && L[1].out_w == 8);
  CHECK(L[1].w_off == 36 && L[1].w_count == 4 && L[1].b_off == 40 && L[1].b_count == 4);
  CHECK(L[1].s_off == 44 && L[1].s_count == 8);
  CHECK(fabsf(L[1].momentum - 0.99f) < 1e-7f && fabsf(L[1].epsilon - 1e-3f) < 1e-9f);
  /* dense(6) reads 256 features; its batchnorm has 6 channels */
  CHECK(L[4].w_off == 52 && L[4].w_count == 6 * 256 && L[4].b_count == 6);
  CHECK(L[5].w_count == 6 && L[5].s_count == 12 && L[5].in_c == 6 && L[5].in_h == 1);
  CHECK(fabsf(L[5].momentum - 0.9f) < 1e-7f && fabsf(L[5].epsilon - 1e-5f) < 1e-12f);
  CHECK(m.n_params == 36 + 16 + 6 * 256 + 6 + 24 + 10 * 6 + 10);
  size_t lo, hi;
  ps_layer_param_range(&L[1], &lo, &hi);
  CHECK(lo == 36 && hi == 52);
  ps_layer_param_range(&L[2], &lo, &hi);
  CHECK(lo == hi);

  ps_moving_range mr[PS_MAX_MOVING_RANGES];
  int n = ps_model_moving_ranges(&m, mr);
  CHECK(n == 4);
  CHECK(mr[0].off == 44 && mr[0].count == 4 && !mr[0].nonneg && mr[0].momentum == L[1].momentum);
  CHECK(mr[1].off == 48 && mr[1].count == 4 && mr[1].nonneg);
  CHECK(mr[2].off == L[5].s_off && mr[2].count == 6 && !mr[2].nonneg);
  CHECK(mr[3].off == L[5].s_off + 6 && mr[3].count == 6 && mr[3].nonneg);

  /* gamma 1, beta 0, mean 0, variance 1, whatever window is asked for */
  float *all = malloc(m.n_params * sizeof(float));
  ps_model_init_params(&m, 3, 0, m.n_params, all);
  int ok = 1;
  for (int k = 0; k < 4; k++)
    ok &= all[36 + k] == 1.0f && all[40 + k] == 0.0f && all[44 + k] == 0.0f && all[48 + k] == 1.0f;
  CHECK_MSG(ok, "batchnorm's initial gamma, beta, mean, variance");
  float part[7];
  ps_model_init_params(&m, 3, 43, 50, part);
  CHECK(memcmp(part, all + 43, sizeof part) == 0);
  free(all);

  char d[256];
  ps_model_spec_describe(&m, d, sizeof d);
  CHECK_MSG(strstr(d, "conv2d(4,3x3,nobias) batchnorm relu") != NULL, "%s", d);

  expect_error(HEAD "{\"type\": \"batchnorm\", \"momentum\": 1}," TAIL,
               "layer 0 (batchnorm): 'momentum' must be a number in [0, 1)");
  expect_error(HEAD "{\"type\": \"batchnorm\", \"epsilon\": 1e-6}," TAIL,
               "layer 0 (batchnorm): 'epsilon' must be a number in [1e-05, 1]");
  expect_error(HEAD "{\"type\": \"batchnorm\", \"epsilon\": \"small\"}," TAIL,
               "'epsilon' must be a number");
  expect_error(HEAD "{\"type\": \"batchnorm\", \"axis\": 1}," TAIL,
               "layer 0 (batchnorm): unknown field 'axis' (known: type, momentum, epsilon");
  expect_error(HEAD "{\"type\": \"conv2d\", \"filters\": 2, \"kernel\": 3, \"bias\": 0}," TAIL,
               "layer 0 (conv2d): 'bias' must be true or false");
}

int main(void) {
  RUN(test_quickstart_layout);
  RUN(test_shapes);
  RUN(test_pooling_layers);
  RUN(test_errors);
  RUN(test_residual);
  RUN(test_residual_errors);
  RUN(test_batchnorm);
  RUN(test_init_params);
  RUN(test_shard_range);
  return check_summary();
}

/* Embedding models end to end through ps_model (worker/model/model.c): the
 * model spec's embedding, concat and sigmoid_xent layers, on the cpu
 * backend (rows read in place) and the emulated device (rows, plans and
 * labels copied in, row gradients copied out), and oneDNN where built.
 *
 *  - forward: the probabilities against a reference written out here
 *    (each field's row gathered, pooled as the layer says, joined with the
 *    dense features, two dense layers, the logistic function);
 *  - backward: every row gradient and a spread of dense parameters
 *    against central differences of the model's own mean loss;
 *  - the spec's errors for embedding models. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/model_spec.h"
#include "../../kernels/emu/ops_emu.h"
#include "worker/model/model.h"
#include "check.h"
#ifdef PS_HAVE_DNNL
#include "../../kernels/dnnl/ops_dnnl.h"
#endif

static const char *SPEC =
    "{\"input\": [3, 1, 1], \"ids\": 4, \"classes\": 1, \"layers\": ["
    " {\"type\": \"embedding\", \"name\": \"ea\", \"table\": \"a\", \"dim\": 3, \"fields\": [0, 2]},"
    " {\"type\": \"embedding\", \"name\": \"eb\", \"table\": \"b\", \"dim\": 2, \"fields\": [1, 4],"
    "  \"pooling\": \"mean\"},"
    " {\"type\": \"embedding\", \"name\": \"ec\", \"table\": \"c\", \"dim\": 2, \"pooling\": \"sum\"},"
    " {\"type\": \"concat\", \"name\": \"c1\", \"inputs\": [\"input\", \"ea\", \"eb\"]},"
    " {\"type\": \"fm\", \"name\": \"fm\", \"inputs\": [\"ea\"]},"
    " {\"type\": \"concat\", \"inputs\": [\"c1\", \"ec\", \"fm\"]},"
    " {\"type\": \"dense\", \"units\": 4},"
    " {\"type\": \"dense\", \"units\": 1},"
    " {\"type\": \"sigmoid_xent\"}]}";
/* The same with the fm's pairwise term summed to one value. */
static char SPEC_SUM[1024];

#define N 7
#define NIDS 4
#define K 3 /* embedding layers */

static uint64_t rs = 0x9E3779B97F4A7C15ULL;
static double unit(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return (double)(rs >> 11) * (1.0 / 9007199254740992.0);
}

typedef struct {
  ps_emb_plan plan[K];
  float *rows[K], *drows[K];
  int dim[K];
} emb_set;

/* The reference forward: probabilities of the N examples. */
static void reference(const ps_model_spec *sp, const float *params, const float *x,
                      const uint64_t *ids, emb_set *e, double *prob) {
  for (int i = 0; i < N; i++) {
    double feat[64];
    int f = 0;
    for (int c = 0; c < 3; c++) feat[f++] = x[i * 3 + c];
    for (int k = 0; k < K; k++) {
      const ps_layer *L = &sp->layers[k];
      const int width = L->pooling == PS_POOL_NONE ? (L->field_hi - L->field_lo) * L->emb_dim
                                                   : L->emb_dim;
      double acc[16] = {0};
      for (int j = L->field_lo; j < L->field_hi; j++) {
        uint64_t id = ids[i * NIDS + j];
        int r = 0;
        while (e->plan[k].uniq[r] != id) r++;
        for (int d = 0; d < L->emb_dim; d++) {
          double v = e->rows[k][r * L->emb_dim + d];
          if (L->pooling == PS_POOL_NONE)
            acc[(j - L->field_lo) * L->emb_dim + d] = v;
          else
            acc[d] += v;
        }
      }
      for (int d = 0; d < width; d++)
        feat[f++] = L->pooling == PS_POOL_MEAN ? acc[d] / (L->field_hi - L->field_lo) : acc[d];
    }
    { /* fm of ea: 0.5 * ((sum_f v)^2 - sum_f v^2) per component */
      const ps_layer *L = &sp->layers[0];
      const int nf = L->field_hi - L->field_lo;
      for (int d = 0; d < L->emb_dim; d++) {
        double s = 0, q = 0;
        for (int j = 0; j < nf; j++) {
          double v = feat[3 + j * L->emb_dim + d];
          s += v;
          q += v * v;
        }
        if (sp->layers[4].fm_sum && d > 0)
          feat[f - 1] += 0.5 * (s * s - q);
        else
          feat[f++] = 0.5 * (s * s - q);
      }
    }
    const ps_layer *D1 = &sp->layers[6], *D2 = &sp->layers[7];
    double h[4];
    for (int u = 0; u < 4; u++) {
      h[u] = params[D1->b_off + u];
      for (int q = 0; q < f; q++) h[u] += params[D1->w_off + u * f + q] * feat[q];
    }
    double z = params[D2->b_off];
    for (int u = 0; u < 4; u++) z += params[D2->w_off + u] * h[u];
    prob[i] = 1.0 / (1.0 + exp(-z));
  }
}

static double loss_of(ps_model *m, const float *params, const float *x, const uint8_t *y) {
  return ps_model_evaluate_probs(m, params, x, y, N, NULL, NULL);
}

static void run_backend(ps_ops *ops, const char *name, const char *spec) {
  char err[512];
  ps_model_spec sp;
  CHECK(ps_model_spec_parse(spec, &sp, err) == 0);
  for (int k = 0; k < K; k++) sp.layers[k].table_index = k;
  ps_model *m = ps_model_create(&sp, ops, N, err);
  CHECK_MSG(m != NULL, "%s: %s", name, err);
  if (!m) return;
  CHECK(ps_model_n_embeddings(m) == K);
  const size_t P = sp.n_params;
  float *params_h = malloc(P * sizeof(float)), *grads_h = malloc(P * sizeof(float));
  ps_model_init_params(&sp, 5, 0, P, params_h);
  for (size_t i = 0; i < P; i++) params_h[i] += 0.3f * (float)(unit() - 0.5); /* biases too */
  float *params = ps_model_alloc_params(m), *grads = ps_model_alloc_params(m);
  ps_model_params_to_device(m, params, params_h);
  float x[N * 3];
  uint8_t y[N];
  uint64_t ids[N * NIDS];
  for (int i = 0; i < N * 3; i++) x[i] = (float)(unit() * 2 - 1);
  for (int i = 0; i < N; i++) y[i] = unit() < 0.5;
  /* Few distinct ids, large values: repeats within a bag and a batch. */
  for (int i = 0; i < N * NIDS; i++) ids[i] = UINT64_C(1) << 40 | (uint64_t)(unit() * 5);
  emb_set e;
  memset(&e, 0, sizeof e);
  for (int k = 0; k < K; k++) {
    e.dim[k] = sp.layers[k].emb_dim;
    CHECK(ps_model_emb_plan(m, k, ids, N, 0, &e.plan[k], err) == 0);
    size_t cnt = (size_t)e.plan[k].u * e.dim[k];
    e.rows[k] = malloc(cnt * sizeof(float));
    e.drows[k] = malloc(cnt * sizeof(float));
    for (size_t i = 0; i < cnt; i++) e.rows[k][i] = (float)(unit() * 2 - 1);
    ps_model_set_rows(m, k, &e.plan[k], e.rows[k], e.drows[k]);
  }
  /* A bounded table's ids are taken modulo its rows. */
  {
    ps_emb_plan q = PS_EMB_PLAN_INIT;
    CHECK(ps_model_emb_plan(m, 0, ids, N, 3, &q, err) == 0);
    int ok = q.u >= 1 && q.u <= 3;
    for (int r = 0; r < q.u; r++) ok &= q.uniq[r] < 3;
    CHECK_MSG(ok, "%s: ids modulo 3 give %d rows", name, q.u);
    ps_emb_plan_free(&q);
  }

  /* Forward against the reference. */
  float probs[N];
  int correct = -1;
  float loss = ps_model_evaluate_probs(m, params, x, y, N, &correct, probs);
  double ref[N], ref_loss = 0;
  int ref_correct = 0;
  reference(&sp, params_h, x, ids, &e, ref);
  for (int i = 0; i < N; i++) {
    CHECK_NEAR(probs[i], ref[i], 1e-5, 1e-4);
    ref_loss += y[i] ? -log(ref[i]) : -log(1 - ref[i]);
    ref_correct += (ref[i] >= 0.5) == (y[i] == 1);
  }
  CHECK_NEAR(loss, ref_loss / N, 1e-5, 1e-4);
  CHECK(correct == ref_correct);

  /* Backward: the step's gradients against central differences. */
  float step_loss = ps_model_train_step(m, params, x, y, N, 1, 1, grads, NULL);
  ps_model_params_to_host(m, grads_h, grads); /* waits: drows are in */
  CHECK_NEAR(step_loss, loss, 1e-6, 1e-5);
  const float eps = 1e-2f;
  int bad = 0, checked = 0;
  for (int k = 0; k < K; k++) {
    size_t cnt = (size_t)e.plan[k].u * e.dim[k];
    for (size_t i = 0; i < cnt; i++) {
      float keep = e.rows[k][i];
      e.rows[k][i] = keep + eps;
      double lp = loss_of(m, params, x, y);
      e.rows[k][i] = keep - eps;
      double lm = loss_of(m, params, x, y);
      e.rows[k][i] = keep;
      double num = (lp - lm) / (2.0 * eps), ana = e.drows[k][i];
      checked++;
      if (fabs(num - ana) > 2e-3 * fmax(fmax(fabs(num), fabs(ana)), 0.05)) {
        if (bad++ < 5)
          fprintf(stderr, "%s: table %d value %zu: numeric %.6g, analytic %.6g\n", name, k, i,
                  num, ana);
      }
    }
  }
  for (size_t p = 0; p < P; p += 7) {
    float keep = params_h[p];
    params_h[p] = keep + eps;
    ps_model_params_to_device(m, params, params_h);
    double lp = loss_of(m, params, x, y);
    params_h[p] = keep - eps;
    ps_model_params_to_device(m, params, params_h);
    double lm = loss_of(m, params, x, y);
    params_h[p] = keep;
    double num = (lp - lm) / (2.0 * eps), ana = grads_h[p];
    checked++;
    if (fabs(num - ana) > 2e-3 * fmax(fmax(fabs(num), fabs(ana)), 0.05)) {
      if (bad++ < 10)
        fprintf(stderr, "%s: parameter %zu: numeric %.6g, analytic %.6g\n", name, p, num, ana);
    }
  }
  ps_model_params_to_device(m, params, params_h);
  CHECK_MSG(bad == 0, "%s: %d of %d gradients differ from central differences", name, bad,
            checked);
  for (int k = 0; k < K; k++) {
    ps_emb_plan_free(&e.plan[k]);
    free(e.rows[k]);
    free(e.drows[k]);
  }
  ps_model_free_params(m, params);
  ps_model_free_params(m, grads);
  ps_model_destroy(m);
  free(params_h);
  free(grads_h);
}

static void expect_error(const char *spec, const char *what) {
  char err[512];
  ps_model_spec sp;
  int rc = ps_model_spec_parse(spec, &sp, err);
  CHECK_MSG(rc != 0 && strstr(err, what), "spec %s: rc %d, '%s' (wanted '%s')", spec, rc, err,
            what);
}

static void spec_errors(void) {
  expect_error("{\"input\": [2,1,1], \"classes\": 1, \"layers\": [{\"type\": \"embedding\", "
               "\"table\": \"t\", \"dim\": 4}, {\"type\": \"dense\", \"units\": 1}, "
               "{\"type\": \"sigmoid_xent\"}]}",
               "the model has no ids");
  expect_error("{\"input\": [2,1,1], \"ids\": 3, \"classes\": 1, \"layers\": [{\"type\": "
               "\"embedding\", \"table\": \"t\", \"dim\": 4, \"fields\": [2, 5]}, {\"type\": "
               "\"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "'fields' must be [from, to)");
  expect_error("{\"input\": [2,1,1], \"ids\": 3, \"classes\": 1, \"layers\": [{\"type\": "
               "\"embedding\", \"table\": \"t\", \"dim\": 4, \"pooling\": \"max\"}, {\"type\": "
               "\"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "unknown pooling 'max'");
  expect_error("{\"input\": [2,1,1], \"ids\": 3, \"classes\": 1, \"layers\": [{\"type\": "
               "\"dense\", \"units\": 2}, {\"type\": \"sigmoid_xent\"}]}",
               "one logit expected");
  expect_error("{\"input\": [2,1,1], \"classes\": 2, \"layers\": [{\"type\": \"dense\", "
               "\"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "set it to 1");
  expect_error("{\"input\": [2,1,1], \"classes\": 1, \"layers\": [{\"type\": \"dense\", "
               "\"units\": 1}, {\"type\": \"softmax_xent\"}]}",
               "a binary model ends in sigmoid_xent");
  expect_error("{\"input\": [2,1,1], \"ids\": 2, \"classes\": 1, \"layers\": ["
               "{\"type\": \"embedding\", \"name\": \"a\", \"table\": \"t\", \"dim\": 2},"
               "{\"type\": \"embedding\", \"name\": \"b\", \"table\": \"t\", \"dim\": 2},"
               "{\"type\": \"concat\", \"inputs\": [\"a\", \"b\"]},"
               "{\"type\": \"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "is read by layer 0");
  expect_error("{\"input\": [2,1,1], \"ids\": 2, \"classes\": 1, \"layers\": ["
               "{\"type\": \"embedding\", \"table\": \"t\", \"dim\": 2, \"inputs\": [\"input\"]},"
               "{\"type\": \"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "unknown field 'inputs'");
  expect_error("{\"input\": [2,1,1], \"ids\": 2, \"classes\": 1, \"layers\": ["
               "{\"type\": \"concat\", \"inputs\": [\"input\"]},"
               "{\"type\": \"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "'inputs' must be an array of 2 to");
  /* A good one describes itself. */
  ps_model_spec sp;
  char err[512], desc[256];
  CHECK(ps_model_spec_parse(SPEC, &sp, err) == 0);
  ps_model_spec_describe(&sp, desc, sizeof desc);
  CHECK_MSG(strstr(desc, "embedding(a,3,f0-2)") && strstr(desc, "embedding(b,2,f1-4,mean)") &&
                strstr(desc, "concat(c1,ec,fm)") && strstr(desc, "fm<-ea") &&
                strstr(desc, "sigmoid_xent"),
            "%s", desc);
  CHECK(sp.layers[0].out_c == 2 && sp.layers[0].out_h == 3);
  CHECK(sp.layers[5].out_c == 3 + 6 + 2 + 2 + 3);
  CHECK(ps_model_spec_parse(SPEC_SUM, &sp, err) == 0);
  ps_model_spec_describe(&sp, desc, sizeof desc);
  CHECK_MSG(strstr(desc, "fm(sum)<-ea") && sp.layers[4].out_c == 1 &&
                sp.layers[5].out_c == 3 + 6 + 2 + 2 + 1,
            "%s", desc);
  expect_error("{\"input\": [2,1,1], \"ids\": 2, \"classes\": 1, \"layers\": ["
               "{\"type\": \"embedding\", \"table\": \"t\", \"dim\": 2},"
               "{\"type\": \"fm\", \"sum\": 1}, {\"type\": \"dense\", \"units\": 1}, "
               "{\"type\": \"sigmoid_xent\"}]}",
               "'sum' must be true or false");
  expect_error("{\"input\": [2,1,1], \"ids\": 2, \"classes\": 1, \"layers\": ["
               "{\"type\": \"embedding\", \"table\": \"t\", \"dim\": 2, \"pooling\": \"sum\"},"
               "{\"type\": \"fm\"}, {\"type\": \"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}",
               "fm reads [fields >= 2, dim, 1]");
}

int main(void) {
  const char *at = strstr(SPEC, "{\"type\": \"fm\"");
  snprintf(SPEC_SUM, sizeof SPEC_SUM, "%.*s{\"type\": \"fm\", \"sum\": true%s", (int)(at - SPEC),
           SPEC, at + strlen("{\"type\": \"fm\""));
  spec_errors();
  const char *specs[2] = {SPEC, SPEC_SUM}, *names[2] = {"", " (fm sum)"};
  for (int v = 0; v < 2; v++) {
    char name[32];
    ps_ops *cpu = ps_ops_cpu_create(1);
    snprintf(name, sizeof name, "cpu%s", names[v]);
    run_backend(cpu, name, specs[v]);
    cpu->destroy(cpu);
    ps_ops *emu = ps_ops_emu_create(1);
    snprintf(name, sizeof name, "emu%s", names[v]);
    run_backend(emu, name, specs[v]);
    emu->destroy(emu);
#ifdef PS_HAVE_DNNL
    ps_ops *dnnl = ps_ops_dnnl_create(1);
    if (dnnl) {
      snprintf(name, sizeof name, "dnnl%s", names[v]);
      run_backend(dnnl, name, specs[v]);
      dnnl->destroy(dnnl);
    }
#endif
  }
  return check_summary();
}

/* Evaluation on the test split: the chief's, during and after training,
 * and the evaluator role's loop. */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/auc.h"
#include "common/util.h"
#include "worker/train/worker.h"

const char *ps_worker_metric(const ps_worker *w) {
  return w->job.model.classes == 1 ? "AUC" : "accuracy";
}

/* A model with embedding layers: the test split in chunks of the
 * evaluation model's batch, each chunk's rows pulled (with the dense
 * values) before it is evaluated. Returns the mean loss; *correct;
 * probs (n floats, may be NULL) each example's probability. */
static int evaluate_rows(ps_worker *w, int *correct, float *probs, float *loss, char *err) {
  const ps_dataset *t = &w->test;
  const size_t in = (size_t)t->c * t->h * t->w;
  double loss_sum = 0;
  int right = 0;
  for (int start = 0; start < t->n; start += PS_EVAL_BATCH) {
    const int b = t->n - start < PS_EVAL_BATCH ? t->n - start : PS_EVAL_BATCH;
    if (ps_worker_rows_prepare(w, w->eval_rows, t->ids + (size_t)start * t->n_ids, b, err) ||
        ps_worker_pull(w, err))
      return -1;
    if (w->dparams != w->params) ps_model_params_to_device(w->model, w->dparams, w->params);
    int c = 0;
    loss_sum += (double)ps_model_evaluate_probs(w->eval_model, w->dparams, t->images + start * in,
                                                t->labels + start, b, &c,
                                                probs ? probs + start : NULL) *
                b;
    right += c;
  }
  *correct = right;
  *loss = t->n ? (float)(loss_sum / t->n) : 0.0f;
  /* The training steps set their own rows again. */
  return ps_client_set_rows(w->client, NULL, 0, err);
}

double ps_worker_evaluate(ps_worker *w, int64_t step, double t0, float *loss_out) {
  int correct = 0;
  const int binary = w->job.model.classes == 1;
  w->eval_err[0] = '\0';
  float *probs = binary ? malloc((size_t)(w->test.n ? w->test.n : 1) * sizeof(float)) : NULL;
  float loss;
  char err[PS_ERRLEN];
  if (w->eval_rows) {
    if (!probs || evaluate_rows(w, &correct, probs, &loss, err) != 0) {
      snprintf(w->eval_err, sizeof w->eval_err, "%s", probs ? err : "out of memory");
      PS_WARN("evaluation: %s", w->eval_err);
      free(probs);
      if (loss_out) *loss_out = NAN;
      return NAN;
    }
  } else {
    if (w->dparams != w->params) ps_model_params_to_device(w->model, w->dparams, w->params);
    loss = ps_model_evaluate_probs(w->eval_model, w->dparams, w->test.images, w->test.labels,
                                   w->test.n, &correct, probs);
  }
  double acc = w->test.n ? (double)correct / w->test.n : 0.0;
  w->eval_acc = acc;
  w->eval_auc = NAN;
  if (binary && probs) {
    float *lab = malloc((size_t)(w->test.n ? w->test.n : 1) * sizeof(float));
    if (lab) {
      for (int i = 0; i < w->test.n; i++) lab[i] = w->test.labels[i] ? 1.0f : 0.0f;
      w->eval_auc = ps_auc(probs, lab, (size_t)w->test.n);
      free(lab);
    }
  }
  free(probs);
  if (loss_out) *loss_out = loss;
  ps_worker_prom_eval(w, acc, loss);
  if (w->metrics) {
    uint64_t updates = w->o.local ? (uint64_t)step : w->versions[0];
    json_t *rec = json_pack("{s:i,s:I,s:I,s:f,s:f,s:f,s:i}", "worker", w->rank, "step",
                            (json_int_t)step, "updates", (json_int_t)updates, "test_accuracy", acc,
                            "test_loss", (double)loss, "elapsed_s", ps_now_s() - t0,
                            "test_examples", w->test.n);
    if (rec && binary && isfinite(w->eval_auc))
      json_object_set_new(rec, "test_auc", json_real(w->eval_auc));
    ps_metrics_write(w->metrics, rec);
    json_decref(rec);
  }
  if (w->tb) {
    static const char *const tags[] = {"test/loss", "test/accuracy", "test/auc"};
    const float vals[] = {loss, (float)acc, (float)w->eval_auc};
    ps_worker_tb_write(w, step, binary ? 3 : 2, tags, vals);
  }
  return binary ? w->eval_auc : acc;
}

/* The evaluator role (TensorFlow's `evaluator` task): pulls the current
 * parameters every eval interval and evaluates the test split; pushes
 * nothing and is not counted among the training workers. Stops on a
 * signal, after --max-evals, or once the parameters have stopped changing
 * for --idle-evals evaluations after they started to (training is over). */
int ps_worker_evaluator_run(ps_worker *w) {
  char err[PS_ERRLEN];
  double t0 = ps_now_s();
  double interval = w->o.eval_interval > 0 ? w->o.eval_interval : 10.0;
  uint64_t last = UINT64_MAX;
  int idle = 0, n = 0, moved = 0;
  double acc = 0;
  float tl = 0;
  PS_INFO("evaluator: every %.1f s on %d test examples", interval, w->test.n);
  while (!atomic_load(&w->stop)) {
    if (ps_worker_pull(w, err) != 0) {
      int rc = ps_worker_failure(w, err);
      if (rc != PS_WORKER_EXIT_DONE) return rc;
      break;
    }
    uint64_t v = 0;
    for (int s = 0; s < w->nshards; s++) v += w->versions[s];
    acc = ps_worker_evaluate(w, (int64_t)n, t0, &tl);
    n++;
    PS_INFO("evaluation %d: shard versions sum to %" PRIu64 ": test %s %.4f, test loss %.4f", n,
            v, ps_worker_metric(w), acc, (double)tl);
    if (last != UINT64_MAX && v == last) {
      idle++;
    } else {
      moved |= last != UINT64_MAX;
      idle = 0;
    }
    last = v;
    if (w->o.max_evals > 0 && n >= w->o.max_evals) break;
    if (moved && idle >= w->o.idle_evals) {
      PS_INFO("evaluator: no update in %d evaluations: training is over", idle);
      break;
    }
    for (double waited = 0; waited < interval && !atomic_load(&w->stop); waited += 0.1)
      ps_sleep_ms(100);
  }
  printf("final test %s %.4f (test loss %.4f, %d examples, evaluation %d)\n", ps_worker_metric(w),
         acc, (double)tl, w->test.n, n);
  fflush(stdout);
  return PS_WORKER_EXIT_DONE;
}

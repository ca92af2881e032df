/* Evaluation on the test split: the chief's, during and after training,
 * and the evaluator role's loop. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>

#include "../common/util.h"
#include "worker.h"

double ps_worker_evaluate(ps_worker *w, int64_t step, double t0, float *loss_out) {
  int correct = 0;
  if (w->dparams != w->params) ps_model_params_to_device(w->model, w->dparams, w->params);
  float loss = ps_model_evaluate(w->eval_model, w->dparams, w->test.images, w->test.labels,
                                 w->test.n, &correct);
  double acc = w->test.n ? (double)correct / w->test.n : 0.0;
  if (loss_out) *loss_out = loss;
  ps_worker_prom_eval(w, acc, loss);
  if (w->metrics) {
    uint64_t updates = w->o.local ? (uint64_t)step : w->versions[0];
    json_t *rec = json_pack("{s:i,s:I,s:I,s:f,s:f,s:f,s:i}", "worker", w->rank, "step",
                            (json_int_t)step, "updates", (json_int_t)updates, "test_accuracy", acc,
                            "test_loss", (double)loss, "elapsed_s", ps_now_s() - t0,
                            "test_examples", w->test.n);
    ps_metrics_write(w->metrics, rec);
    json_decref(rec);
  }
  if (w->tb) {
    static const char *const tags[] = {"test/loss", "test/accuracy"};
    const float vals[] = {loss, (float)acc};
    ps_worker_tb_write(w, step, 2, tags, vals);
  }
  return acc;
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
    PS_INFO("evaluation %d: shard versions sum to %" PRIu64 ": test accuracy %.4f, test loss %.4f",
            n, v, acc, (double)tl);
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
  printf("final test accuracy %.4f (test loss %.4f, %d examples, evaluation %d)\n", acc,
         (double)tl, w->test.n, n);
  fflush(stdout);
  return PS_WORKER_EXIT_DONE;
}

/* ps-worker: pulls the parameters, computes gradients on its share of the
 * data, pushes them to the shards; the chief also evaluates the test split.
 * The parts are in worker/train/worker.h, built in setup.c; the flags in
 * worker_options.c. */
#include "common/rpc.h"
#include "common/util.h"
#include "worker/main/setup.h"
#include "worker/train/worker.h"

int main(int argc, char **argv) {
  ps_malloc_tune();
  static ps_worker w;
  int rc = ps_worker_opts_parse(&w.o, argc, argv);
  if (rc == 1) return PS_WORKER_EXIT_DONE; /* --help */
  if (rc != 0) return ps_worker_exit_code(&w, PS_WORKER_EXIT_USAGE);
  ps_log_init("ps-worker", w.o.log_level);
  rpc_global_init();
  rc = ps_worker_setup(&w);
  if (rc == 0) rc = w.o.evaluator ? ps_worker_evaluator_run(&w) : ps_worker_train(&w);
  ps_worker_teardown(&w);
  rpc_global_shutdown();
  return ps_worker_exit_code(&w, rc);
}

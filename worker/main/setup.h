/* The worker process's set-up and tear-down (setup.c): building the parts
 * of a ps_worker (worker/train/worker.h) from its options, freeing them,
 * and the exit code the process ends with. Only worker/main calls these. */
#ifndef PS_WORKER_SETUP_H
#define PS_WORKER_SETUP_H

#include "worker/train/worker.h"

/* Builds the parts from the options: the device, the job (from the
 * servers, or the file with --local), the data, the models, the buffers,
 * metrics and the data source. Returns 0, or the process's exit code with
 * the message printed (PS_WORKER_EXIT_UNREACHABLE: kept for the last
 * line); what was built is freed by ps_worker_teardown either way. */
int ps_worker_setup(ps_worker *w);

/* Stops the threads in order (the data source's before the client it
 * uses), leaves the servers, frees everything. Safe on a partial setup. */
void ps_worker_teardown(ps_worker *w);

/* The process's exit code for rc, what the set-up or the run returned
 * (PS_WORKER_EXIT_ERROR after a retry gave up becomes
 * PS_WORKER_EXIT_UNREACHABLE), with a last line on stderr that says what
 * it means (none for PS_WORKER_EXIT_DONE). Call it last, after the
 * tear-down. */
int ps_worker_exit_code(ps_worker *w, int rc);

#endif

/* The worker's loop thread (loop.c): a libuv loop with the heartbeat
 * timer, the watches for idling and stalls, and SIGINT/SIGTERM. Its state
 * is ps_worker.ev (worker/train/worker.h). Only worker/main calls these. */
#ifndef PS_WORKER_LOOP_H
#define PS_WORKER_LOOP_H

#include "worker/train/worker.h"

/* The loop thread: heartbeats (not with --local) and SIGINT/SIGTERM,
 * which set w->stop. Started as soon as the worker has registered, so
 * that the shards hear from it while it loads the data and builds the
 * model. 0, or -1 when the thread cannot start. */
int ps_worker_loop_start(ps_worker *w);
/* w->source is built: heartbeats name its leases and idling, and the
 * stall watch begins. */
void ps_worker_loop_attach_source(ps_worker *w);
void ps_worker_loop_stop(ps_worker *w);

#endif

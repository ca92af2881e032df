/* Pulls that wait on the server (ssp: for the slowest worker; sync: for
 * the step to be applied), the sync step that releases them, and the
 * progress watchdog. Calls pull.c, ps/ckpt's gate, ps/repl, ps/core. */
#ifndef PS_PS_RPC_SYNC_H
#define PS_PS_RPC_SYNC_H

#include <stddef.h>
#include <stdint.h>

#include "ps/core/server.h"

/* What ps_waits_add did with a pull (besides PS_ENOTFOUND and PS_ENOMEM). */
enum {
  PS_PULL_NOW = 0,   /* it may be answered now: the caller serves it */
  PS_PULL_WAITS = 1, /* it waits in the list; ps_waits_recheck answers it */
  PS_PULL_LOST = 2,  /* sync: the step it waits for lacks the worker's round (lost) */
};

/* Decides, under wait_mu, whether the worker's pull may be answered now
 * (async: always; ssp: the worker is at most ssp_k steps ahead of the
 * slowest; sync: the shard's version has reached min_version) and queues it
 * to wait otherwise (the call then belongs to the list, with a deadline of
 * wait_timeout_ms). The worker's pulls still waiting (a client has one out
 * per shard: those were given up) are answered CANCELLED. push_round: the
 * worker's last push round this shard answered, as it says (sync: a pull
 * for the next step when the shard has not taken that round, because it
 * restarted from a checkpoint written before it, would wait forever: it
 * gets PS_PULL_LOST, and the worker pushes the round again). Returns
 * PS_PULL_NOW, PS_PULL_WAITS or PS_PULL_LOST; PS_ENOTFOUND when the worker is not
 * registered, PS_ERANGE when twice the job's max_workers pulls wait already, PS_ENOMEM when the waiter cannot be allocated: in
 * those cases nothing is queued and the caller answers the call. rows (may
 * be NULL): the pull's embedding rows, which the waiter owns once it
 * returns PS_PULL_WAITS (the caller keeps them otherwise). */
int ps_waits_add(ps_server *sv, rpc_call *call, uint64_t worker, uint64_t min_version,
                 uint64_t push_round, size_t offset, size_t count, ps_rows_req *rows);

/* Answers the waiting pulls that may go now, fails those past their
 * deadline (ABORTED) or whose worker is gone (NOT_FOUND). Called after
 * anything that can release a pull (an update, a worker leaving or timed
 * out) and by the sweep timer. Never fails. */
void ps_waits_recheck(ps_server *sv);

/* Fails every waiting pull at once with status and "shard N: why" (a sync
 * step that can never be applied). Never fails. */
void ps_waits_fail_all(ps_server *sv, int status, const char *why);

/* Seconds without an update, while workers train, before a shard says
 * what it waits for. */
#define PS_SERVER_STALL_S 30

/* The progress watchdog, on the loop's sweep timer: when the shard's
 * version has not moved for PS_SERVER_STALL_S while workers train, logs
 * (once per period) what it waits for: a sync step's missing gradients,
 * pulls held for the slowest ssp worker, or no pushes at all. */
void ps_sync_watch(ps_server *sv);

/* Frees the waiters still in the list without answering them: at shutdown,
 * after rpc_server_shutdown has cancelled their calls. */
void ps_waits_free(ps_server *sv);

/* sync: applies the current step if enough gradients are in (the quorum:
 * live workers - backup_workers, once min_workers have registered);
 * releases the pulls waiting for it. A failure to apply is logged and
 * leaves the step pending. */
void ps_sync_try_step(ps_server *sv);

#endif

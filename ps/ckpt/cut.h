/* Checkpoint sets: every shard writes its state at one cut that shard 0
 * chooses (see cut.c for the protocol). Pushes and sync steps pass its
 * gate; what it holds goes back to the server through its hooks. Calls
 * capture.c, the file formats, ps/core and ps/state. */
#ifndef PS_PS_CKPT_CUT_H
#define PS_PS_CKPT_CUT_H

#include "common/rpc.h"
#include "ps/core/server.h"

/* Complete sets shard 0 remembers (the most --keep-checkpoints can keep). */
#define PS_CUT_MAX_KEEP 64
/* A shard held this long by a set that does not come goes on without it. */
#define PS_CUT_HOLD_S 5.0
/* Deadlines of shard 0's calls: PREPARE and ABORT; CUT (the file written). */
#define PS_CUT_CALL_MS 5000
#define PS_CUT_WRITE_MS 120000

/* Sets up checkpoint sets (after the loop is initialized); restored_set is
 * the set the shard was restored from (0: none). PS_ENOMEM. */
int ps_cut_init(ps_server *sv, uint64_t restored_set);
/* The gate of an async or ssp push, before it is applied: 0, apply it now
 * and call ps_cut_leave after; 1, held by a cut (it is applied and
 * answered when the cut is taken); PS_ENOMEM (not held: the caller
 * answers). Without sets: 0. */
int ps_cut_push_enter(ps_server *sv, const ps_push_args *a);
/* The gate of a sync step: 0, apply it and call ps_cut_leave after; 1,
 * held (the step is tried again when the cut is taken). */
int ps_cut_step_enter(ps_server *sv);
void ps_cut_leave(ps_server *sv);
/* The Checkpoint RPC (request: a Ps__CheckpointRequest). */
void ps_cut_handle(ps_server *sv, rpc_call *call, const void *request);
/* On the sweep timer: a cut met by workers leaving is taken; a shard held
 * longer than PS_CUT_HOLD_S goes on. */
void ps_cut_watch(ps_server *sv);
/* Shard 0, on the checkpoint timer: starts a set on the work queue unless
 * one is under way. 1 when started. */
int ps_cut_coordinate(ps_server *sv);
/* Shard 0's replica that became the primary: a set at once (any thread),
 * whose PREPARE gives up a set the old primary left held on the shards
 * (ps_server_ckpt_on_timer starts it at its next tick); kicked says
 * whether one is due, and clears it. */
void ps_cut_kick(ps_server *sv);
int ps_cut_kicked(ps_server *sv);
/* After a restore: the workers' push rounds in the restored cut record
 * (async, ssp) go to the membership table, so that a worker that registers
 * again and resends a round the checkpoint holds is answered without it
 * being applied again. PS_EINVAL for a malformed record, PS_ENOMEM. */
int ps_cut_seed_rounds(ps_server *sv, const void *record, size_t len);
/* The cut record of this shard's state now, for a file written alone. */
int ps_cut_record_now(ps_server *sv, void **out, size_t *len);
/* The newest set this shard wrote, and its version there (0 0: none). */
void ps_cut_set_info(ps_server *sv, uint64_t *set, uint64_t *version);
/* Shutdown, with the loop stopped: drain first runs the loop (the RPC
 * server still up) until a set under way is over, at most max_s seconds,
 * and starts no new one; close (after the RPC server is down) forgets the
 * held calls and closes the loop's handle; free releases the rest after
 * the last uv_run. */
void ps_cut_drain(ps_server *sv, double max_s);
void ps_cut_close(ps_server *sv);
void ps_cut_free(ps_server *sv);

#endif

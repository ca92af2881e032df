/* The copy of a shard's state that a checkpoint writes (parameters,
 * optimizer slots, embedding rows, shard 0's data leases), taken at one
 * version. Calls the file formats and ps/state. */
#ifndef PS_PS_CKPT_CAPTURE_H
#define PS_PS_CKPT_CAPTURE_H

#include "ps/ckpt/checkpoint.h"
#include "ps/core/server.h"

/* The copy of the shard's state a checkpoint writes (and shard 0's data
 * leases), taken now; free it with ps_ckpt_state_free. PS_ENOMEM. */
int ps_ckpt_capture(ps_server *sv, ps_ckpt *ck);
void ps_ckpt_state_free(ps_ckpt *ck);

/* A checkpoint file this shard wrote (rc 0) or failed to write: counted
 * for Status and the metrics endpoint. */
void ps_ckpt_note_written(ps_server *sv, int rc);

#endif

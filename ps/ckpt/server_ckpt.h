/* When ps-server checkpoints (shard 0's timer starts a set), the file a
 * server writes alone at shutdown, and the restore at start. Calls cut.c,
 * capture.c, the file formats, ps/repl (is this the primary?). */
#ifndef PS_PS_CKPT_SERVER_CKPT_H
#define PS_PS_CKPT_SERVER_CKPT_H

#include <uv.h>

#include "ps/core/server.h"

/* Removes this shard's temporary checkpoint files that a process killed
 * while writing left in sv->ckpt_dir, then restores the shard from the
 * newest valid checkpoints of the job there (whatever number of shards
 * wrote them), and shard 0's data leases with them. 0 also when there is none (a fresh start); an error
 * code with a message in err (PS_ERRLEN bytes) when there are some but none
 * is usable, or no memory: the shard then keeps its initial parameters
 * (but for a lease state that cannot be read, where the parameters are
 * already restored). */
int ps_server_ckpt_restore(ps_server *sv, char *err);

/* Writes a checkpoint of the shard now, on the calling thread, keeping the
 * newest ckpt_keep. Returns 0, or an error code (logged); the shard is
 * unchanged either way. */
int ps_server_ckpt_write_now(ps_server *sv);

/* The checkpoint timer's callback (t->data is the server), every second:
 * on shard 0, when a checkpoint is due (by time or by updates), it starts
 * a set across all shards (cut.c). Failures are logged. */
void ps_server_ckpt_on_timer(uv_timer_t *t);

#endif

/* Answering a Pull: the shard's snapshot sent without a copy (or in the
 * job's 16-bit encoding), and a pull of embedding rows beside the dense
 * range at one version. Used by the Pull handler and by the pulls that
 * waited (sync.c). Calls ps/core and ps/state. */
#ifndef PS_PS_RPC_PULL_H
#define PS_PS_RPC_PULL_H

#include <stddef.h>
#include <stdint.h>

#include "ps/core/server.h"

/* Answers a pull with the current snapshot of [offset, offset + count),
 * sent without a copy; in a job with a 16-bit "wire", encoded into a fresh
 * buffer (one copy, half the bytes), a parameter beyond the format's range
 * becoming Inf, which workers refuse (logged once). When the shard refuses the pull (a range outside
 * it, or no memory for a partial copy) the call is answered OUT_OF_RANGE
 * with the shard's message; no memory to encode the reply,
 * RESOURCE_EXHAUSTED. The call is answered in every case; the shard's
 * values are unchanged (a granted pull is counted). */
void ps_pull_serve(ps_server *sv, rpc_call *call, size_t offset, size_t count);
/* The snapshot's values in the job's 16-bit encoding, kept with it (NULL:
 * out of memory); a parameter beyond the format's range goes out as Inf,
 * which the shard says once. */
const uint16_t *ps_pull_encode_snapshot(ps_server *sv, ps_snapshot *snap);
/* Sends a Pull's answer, counting its bytes (Status's pull_bytes). */
void ps_pull_reply(ps_server *sv, rpc_call *call, rpc_msg *out);

/* Answers a pull of the rows and (count > 0) the dense range at one
 * version; takes rows (freed). */
void ps_pull_serve_rows(ps_server *sv, rpc_call *call, size_t offset, size_t count,
                        ps_rows_req *rows);

#endif

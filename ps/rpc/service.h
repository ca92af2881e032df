/* The RPC handlers of ps-server (Register, Heartbeat, Leave, Pull, Push,
 * Status, Lease, and the servers' Checkpoint, Replicate and Vote) behind
 * one dispatcher. Calls ps/rpc/sync.c and pull.c, and every part below. */
#ifndef PS_PS_RPC_SERVICE_H
#define PS_PS_RPC_SERVICE_H

#include "ps/core/server.h"

/* Registers the ParameterServer methods (Register, Heartbeat, Leave, Pull,
 * Push, Status, Lease) on rpc, answered against sv; call it before
 * rpc_server_start. A method rpc_server_add_method refuses (no memory) is
 * not reported: it stays unregistered and its calls are answered
 * UNIMPLEMENTED. */
void ps_service_register(ps_server *sv, rpc_server *rpc);

/* Applies a push (async, ssp: to the shard; sync: to the step's sum) and
 * answers it, keeping the answer under its request id; a refused push is
 * answered with the cause and its id forgotten. Used by the Push handler
 * and, through the server's apply_push hook, for the pushes a checkpoint
 * cut held. */
void ps_service_apply_push(ps_server *sv, const ps_push_args *a);

#endif

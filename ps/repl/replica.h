/* Replicated shards: each shard served by R replicas (the job's
 * replicas_per_shard), one primary and R-1 backups, with fail-over.
 *
 * Primary-backup, not a chain: the primary sends every update to all
 * backups at once, so a push waits one round trip whatever R is (a chain
 * waits R-1 in a row), and the primary alone knows which replica has what,
 * which is what fail-over and catch-up need.
 *
 * The protocol (proto/ps.proto, "Replicated shards"):
 * - A configuration (term, primary, members) is granted by a majority of
 *   ALL the job's servers (shards x R), each voter persisting (fsync) its
 *   promise and what it accepted before it answers: Paxos's two phases,
 *   one instance per term. A candidate must be a member of the newest
 *   configuration a majority reports, so it holds every acknowledged
 *   update; it refuses the old term's updates from the moment it wins (it
 *   acknowledged nothing it does not hold until then).
 * - The primary applies an update (a push, a sync step, a registration, a
 *   leave, an idle flag, shard 0's Lease calls and lease renewals and
 *   expiries, with its clock) to its state and to its log, under one lock
 *   so that the log has the order of application, and answers the worker
 *   only when every member of its configuration applied it. A deposed
 *   primary cannot acknowledge: a member that took its place refuses its
 *   term.
 * - A backup applies the entries in order after checking that the
 *   position before them (the term that made the last update, its
 *   sequence number) is its own; any other position, and a replica that
 *   has just started, takes a snapshot of the primary's whole state
 *   (parameters, slots, version, the workers and their recent answers,
 *   shard 0's lease table, a sync step's sum so far). A replayed call
 *   whose answer differs from the primary's means the states diverged: a
 *   snapshot mends it.
 * - A backup that hears nothing for the lease runs for primary (the
 *   replicas after the silent one in turn, a heartbeat apart; one that a
 *   member further ahead can replace lets it run first, a few times at
 *   most; one that restarted since it last took the state runs only when
 *   every member says it restarted too); a primary that hears nothing from
 *   a member for the lease replaces its configuration by one without it (a
 *   vote), and adds a replica that caught up (counted for acknowledgements
 *   first, voted in once it holds every update acknowledged).
 * - A replica that is not the primary answers workers UNAVAILABLE naming
 *   the primary it knows (PS_REDIRECT_FMT); the workers move there and
 *   resend unacknowledged pushes with their request ids.
 * Votes live in the checkpoint directory, which R > 1 requires. */
#ifndef PS_PS_REPLICA_H
#define PS_PS_REPLICA_H

#include <stddef.h>
#include <stdint.h>

#include "common/rpc.h"
#include "ps/core/update.h"

struct ps_server;
struct ProtobufCMessage;

typedef struct ps_replica ps_replica;


/* Sets up replication for a server whose job has replicas_per_shard R > 1
 * (sv->replica, sv->server_index and the address list set): reads (or
 * creates) this server's vote file in dir. 0, or PS_EINVAL / PS_EIO /
 * PS_ENOMEM with a message. */
int ps_replica_init(struct ps_server *sv, const char *dir, char *err);
/* Starts the threads (the manager, one sender per other replica); after
 * the RPC server started. */
int ps_replica_start(struct ps_server *sv, char *err);
/* Stops the threads and answers the calls still waiting for the backups
 * UNAVAILABLE (the workers resend elsewhere); before the RPC server stops.
 * Safe without ps_replica_start. */
void ps_replica_stop(struct ps_server *sv);
void ps_replica_free(struct ps_server *sv);

/* The primary's ordering lock. lock: 0 when this server is the primary
 * (the lock then held: apply the update, ps_replica_append it, unlock);
 * PS_ESTATE when it is not (nothing held: ps_replica_redirect the call).
 * Without replication (sv->repl NULL): 0, and unlock does nothing. */
int ps_replica_lock(struct ps_server *sv);
void ps_replica_unlock(struct ps_server *sv);
/* With the lock held, after the update was applied (ps_update_apply):
 * logs the same record for the backups, which apply it with the same
 * function. call (may be NULL) is answered with reply (packed here) once
 * every member has it; rid != 0: the worker's request (kind rec_kind) was
 * staged in the membership table and is settled with that answer then.
 * PS_ENOMEM: nothing logged (the caller fails the call; the update stays
 * applied here, which a backup's snapshot then carries). */
int ps_replica_append(struct ps_server *sv, const ps_update *u, rpc_call *call,
                      const struct ProtobufCMessage *reply, int rec_kind, uint64_t rid);
/* The primary changed its state without logging it (out of memory, a
 * call that failed halfway): every backup takes the whole state next. */
void ps_replica_diverged(struct ps_server *sv);
/* Answers a worker's call UNAVAILABLE naming the primary this replica
 * knows. */
void ps_replica_redirect(struct ps_server *sv, rpc_call *call, const char *method);
/* 1 when this server is its shard's primary now (always without
 * replication). */
int ps_replica_is_primary(struct ps_server *sv);
/* This server's reign as its shard's primary: a number that changes each
 * time it becomes the primary, 0 while it is not (always 1 without
 * replication). A checkpoint set is taken only in the reign that prepared
 * it (ps/ckpt/cut.c): a replica deposed since holds the new primary's
 * state, not the cut's. */
uint64_t ps_replica_reign(struct ps_server *sv);
/* The address of replica r of this server's shard. */
const char *ps_replica_addr(struct ps_server *sv, int r);
/* The primary this replica knows (-1: none). */
int ps_replica_known_primary(struct ps_server *sv);

/* The Replicate and Vote RPCs (requests decoded and token-checked by the
 * service). */
void ps_replica_handle_replicate(struct ps_server *sv, rpc_call *call, const void *request);
void ps_replica_handle_vote(struct ps_server *sv, rpc_call *call, const void *request);

/* The largest request a replica of this shard may receive (a snapshot or
 * a batch of updates). */
size_t ps_replica_max_request(struct ps_server *sv);

/* This replica's view for Status. */
typedef struct {
  int replica;
  const char *role;
  uint64_t term, seq, seq_term;
  int primary;
  int fresh;
  uint32_t members[8];
  int n_members;
  uint32_t in_sync[8]; /* the primary: members streaming from it, itself included */
  int n_in_sync;
  uint64_t acked; /* updates it answered as a primary, since it started */
} ps_replica_view;
void ps_replica_view_get(struct ps_server *sv, ps_replica_view *v);

#endif

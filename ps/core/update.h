/* Updates: every change a worker's call (or a timer) makes to a shard's
 * state, as one record, and the one function that applies it.
 *
 * The RPC layer (ps/rpc) decodes a call and builds a ps_update; a
 * replicated shard's primary applies it and hands the same record to its
 * log (ps/repl), whose backups turn each entry back into a ps_update and
 * apply it with the same function; a checkpoint cut (ps/ckpt) holds a
 * push's record and gives it back to the server when the cut is taken.
 * Nothing here answers a call: the caller does, with what the result
 * says. Calls: ps/state and common/ only. */
#ifndef PS_CORE_UPDATE_H
#define PS_CORE_UPDATE_H

#include <stddef.h>
#include <stdint.h>

#include "common/rpc.h"
#include "common/util.h"
#include "proto/ps.pb-c.h"
#include "ps/state/leases.h"

struct ps_server;
struct ps_rows_req;

/* The most leases of a returning worker a Register names that are read:
 * it holds the job's max_per_worker (2) and the one it completes, and names
 * the refused completions it keeps (at most 64 of this epoch and the one
 * before). */
#define PS_HELD_NAMED 96

/* The leases a Register (or its REGISTER entry) names, into held (room for
 * PS_HELD_NAMED: the rest are not read). Returns how many. */
size_t ps_update_held_from_msg(Ps__HeldLease *const *msgs, size_t n, ps_lease_held *held);

/* What an update does; the values are the replication log's entry kinds
 * (proto/ps.proto, ReplicaEntry.Kind), so that a record and an entry name
 * their kind alike. */
typedef enum {
  PS_UPDATE_PUSH = PS__REPLICA_ENTRY__KIND__PUSH,           /* a gradient (and its rows) */
  PS_UPDATE_SYNC_STEP = PS__REPLICA_ENTRY__KIND__SYNC_STEP, /* sync: the step's sum applied */
  PS_UPDATE_LEASE = PS__REPLICA_ENTRY__KIND__LEASE,         /* shard 0: a Lease call */
  PS_UPDATE_LEASE_RENEW = PS__REPLICA_ENTRY__KIND__LEASE_RENEW,   /* a heartbeat's renewal */
  PS_UPDATE_LEASE_EXPIRE = PS__REPLICA_ENTRY__KIND__LEASE_EXPIRE, /* the sweep's expiry */
  PS_UPDATE_REGISTER = PS__REPLICA_ENTRY__KIND__REGISTER, /* a worker, with the id and
                                                           * session its primary gave it */
  PS_UPDATE_LEAVE = PS__REPLICA_ENTRY__KIND__LEAVE,       /* a worker left or was dropped */
  PS_UPDATE_IDLE = PS__REPLICA_ENTRY__KIND__IDLE,         /* a worker's idle flag */
} ps_update_kind;

/* One update. The pointers are borrowed: whoever keeps the record longer
 * than the call (the replication log, a cut's held push) copies what they
 * point at. */
typedef struct ps_update {
  int kind; /* ps_update_kind */
  uint64_t worker, request_id, base_version, offset, count, step;
  const char *host, *role; /* REGISTER */
  int task_index;
  const uint8_t *session; /* REGISTER: PS_SESSION_LEN bytes */
  int reader, idle;
  const ps_segview *gradient; /* PUSH: the dense values, then the rows' */
  const struct ps_rows_req *rows; /* PUSH: its embedding rows, or NULL */
  /* shard 0's data leases */
  int64_t now_ms, timeout_ms; /* the primary's clock, which a backup replays */
  uint64_t complete_lease, dataset_size;
  int want_next, names_leases;
  const uint64_t *leases; /* LEASE_RENEW: the leases the worker names */
  size_t n_leases;
  const uint64_t *done_chunks; /* REGISTER: chunks a returning worker finished */
  size_t n_done;
  const ps_lease_held *held; /* REGISTER: the leases a returning worker holds */
  size_t n_held;
  uint64_t trained; /* LEASE: examples the worker trained of the lease it completes */
  uint64_t lease_id; /* PUSH: the lease its examples were drawn from (0: none) */
  uint32_t batch;    /* PUSH: its examples */
  int quorum, result; /* SYNC_STEP: the quorum, and (in the log) what applying it gave */
  int divisor;        /* SYNC_STEP: what the sum is divided by (0: the gradients in it) */
} ps_update;

/* What applying an update gave. */
typedef struct {
  uint64_t version;   /* PUSH, SYNC_STEP: the shard's version after it */
  uint64_t staleness; /* PUSH (async, ssp) */
  int dropped;        /* PUSH (sync): a late gradient, dropped */
  int have;           /* PUSH (sync): gradients in the step so far */
  int step;           /* SYNC_STEP: 1 applied, 0 not yet (too few gradients), < 0 the
                       * shard's error (PS_EINVAL: it would make the model non-finite) */
  int changed;        /* IDLE: the flag changed; LEASE_EXPIRE: leases expired */
  int rpc_status;     /* on error: the status to fail the call with */
  Ps__LeaseResponse lease; /* LEASE: the answer (initialize it with PS__LEASE_RESPONSE__INIT) */
} ps_update_result;

/* Applies u to sv's state: the one way every update is applied, whether
 * it came from a worker's call, a timer, a cut that held it, or a backup's
 * replay of its primary's log. replay: a backup's (no log lines or
 * metrics for what its primary says already). Returns 0 and fills *res;
 * on error an error code with a message in err (PS_ERRLEN) and
 * res->rpc_status, and the state is unchanged (a Lease's completion
 * counted before its grant failed aside: the caller marks a replicated
 * state diverged then). SYNC_STEP returns 0 whatever the step gave: see
 * res->step. A PUSH's worker has its round and its push counted. */
int ps_update_apply(struct ps_server *sv, const ps_update *u, int replay, ps_update_result *res,
                    char *err);

/* A worker registering again names the chunks shard 0 acknowledged as
 * done and the leases it holds: what the lease table lacks (lost with a
 * restart) is taken back, or recorded in the epoch's record
 * (ps_leases_rejoin). Nothing without a lease table. quiet: no log lines
 * (a backup's replay). */
void ps_update_rejoin(struct ps_server *sv, uint64_t worker, const uint64_t *done, size_t n_done,
                      const ps_lease_held *held, size_t n_held, int quiet);

/* Gives the data leases a departed worker held back to the pool (logged).
 * Nothing when the shard has no lease table or the worker held none. */
void ps_update_release_leases(struct ps_server *sv, uint64_t worker);

/* A worker's push as the RPC layer applies it: the update and the call it
 * answers (rec_kind: the method's request-id kind in the membership
 * table). A checkpoint cut holds such pushes and hands them back to the
 * server's apply_push hook. */
typedef struct {
  rpc_call *call;
  int rec_kind;
  ps_update u;
} ps_push_args;

#endif

/* A worker's connection to the shards: registration, parallel sharded pull
 * and push, heartbeats, leave.
 *
 * Pull and push talk to every shard at once (one call in flight per shard)
 * and wait for all. They are called from one thread (the training loop);
 * heartbeat may be called from another thread at the same time. */
#ifndef PS_WORKER_PS_CLIENT_H
#define PS_WORKER_PS_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/auth.h"
#include "common/half.h"
#include "common/model_spec.h"
#include "common/rpc.h"

typedef struct ps_client ps_client;

typedef struct {
  const char *host;  /* this worker's host name, for the servers' logs */
  const char *role;  /* "worker" or "chief" */
  int task_index;    /* -1 when unknown */
  int timeout_ms;    /* deadline of each call; default 30000 */
  int connect_timeout_ms; /* how long to wait for the first server; default 60000 */
  const ps_token *token;  /* the job's token, carried by every request (NULL: none) */
  const rpc_tls *tls;     /* NULL: plaintext */
  /* Replicated shards: how long a call to a shard keeps trying the shard's
   * other replicas (its primary failed or moved) after its first failure
   * before it fails as without replicas; default 15000. */
  int failover_ms;
  /* Connections of this client's own (rpc_channel_opts.own_connection):
   * for many clients in one process that stand for separate workers. */
  int own_connections;
} ps_client_opts;

/* Registers with the server at addr (any shard: one that is not shard 0
 * sends the worker on to shard 0), receives the job and the shard list,
 * then registers with every shard; each shard's answer holds the session
 * secret that this worker's later requests to it carry. NULL with a
 * message on failure.
 *
 * Replicated shards (the job's replicas_per_shard R > 1): each shard has R
 * servers, of which only the primary answers workers. The client keeps a
 * channel to every replica and the one it believes primary; a call that a
 * replica refuses (naming the primary it knows) or that finds no server
 * goes to the named replica, else the next, and is sent again (a Push or a
 * Lease with the same request id) for up to failover_ms. With R = 1
 * nothing of this happens. */
ps_client *ps_client_connect(const char *addr, const ps_client_opts *opts, char *err);

/* One shard's Status over ch, the request signed with token (no
 * registration needed): the answer, freed with
 * ps__status_response__free_unpacked; or NULL with the gRPC code in *code
 * (RPC_OK: a reply that does not parse) and the reason in why. */
struct Ps__StatusResponse *ps_status_call(rpc_queue *q, rpc_channel *ch, const ps_token *token,
                                          int timeout_ms, int *code, char *why);
void ps_client_destroy(ps_client *c);

const char *ps_client_job_json(const ps_client *c);
uint64_t ps_client_worker_id(const ps_client *c);
int ps_client_rank(const ps_client *c);
/* The version shard 0's run began at when this worker first registered
 * (0, or a restored checkpoint's): a sync job's steps count from it. */
uint64_t ps_client_start_version(const ps_client *c);
int ps_client_num_shards(const ps_client *c);
size_t ps_client_param_count(const ps_client *c);
int ps_client_heartbeat_timeout_ms(const ps_client *c);

/* Pulls every shard's range into params (P floats) and its version into
 * versions[shard]. min_versions (may be NULL): shard s answers only once
 * its version is at least min_versions[s] (sync mode). On error returns a
 * negative code with a message naming the shard (PS_ETIMEDOUT when a shard
 * gave up waiting); params may then hold a mix of old and new ranges. */
int ps_client_pull(ps_client *c, float *params, uint64_t *versions,
                   const uint64_t *min_versions, char *err);

/* ps_client_pull, telling as the shards arrive: ready(user, attempt, s,
 * avail) is called (on the calling thread) once shard s's range is in
 * params, so that params[0, avail) has arrived (shards are read in order).
 * attempt counts from 0; the pull starts over when a shard had forgotten
 * this worker (which registers again): ready(user, attempt, -1, 0) says so
 * before anything of the new attempt is written into params, and what
 * arrived before is then read again. Nothing is said about the shards
 * after one that failed. */
typedef void (*ps_pull_ready_fn)(void *user, int attempt, int shard, size_t avail);
int ps_client_pull_ex(ps_client *c, float *params, uint64_t *versions,
                      const uint64_t *min_versions, ps_pull_ready_fn ready, void *user,
                      char *err);

/* Shard s's range of the flat vector: [off, off + cnt). The ranges tile
 * [0, P) in shard order. */
void ps_client_shard_range(const ps_client *c, int s, size_t *off, size_t *cnt);

/* How long a shard may hold a pull back (the job's wait_timeout_ms in ssp
 * and sync modes): added to the pull's deadline. */
void ps_client_set_wait_ms(ps_client *c, int wait_ms);

/* How tensor values travel: the job's "wire" (fp32 until set). With bf16
 * or fp16 a pull decodes each shard's 16-bit values into the caller's
 * floats, refusing (PS_EPROTO, with a message) a value that arrives as Inf
 * or NaN; a push encodes each shard's slice once per round, adding first
 * what rounding lost in the pushes before (error feedback: the client
 * keeps that residual, P floats, and a 16-bit copy of the gradient that
 * gRPC sends without a further copy), and refuses (PS_EINVAL) a value that
 * would go out as Inf or NaN. A retry of a round sends the bytes encoded
 * at its first attempt (the residual takes each gradient once); a round
 * given up loses its gradient, as with fp32, and its rounding error stays
 * in the residual. Returns PS_ESTATE while a push is in flight, PS_ENOMEM
 * (nothing changed) without memory. */
int ps_client_set_wire(ps_client *c, ps_wire wire, char *err);
ps_wire ps_client_wire(const ps_client *c);
/* The model's moving statistics (ps_model_moving_ranges: batchnorm's
 * batch mean and variance ride in the gradient there). On a 16-bit wire
 * they are pushed rounded but without error feedback: a statistic's
 * rounding error carried into the next batch's would bias it, and could
 * take a variance of 0 below zero, which the shard refuses. mr is copied;
 * at most PS_MAX_MOVING_RANGES. */
void ps_client_set_moving(ps_client *c, const ps_moving_range *mr, int n);
/* The residual (P floats; NULL with fp32), for tests. */
const float *ps_client_residual(const ps_client *c);

/* Embedding rows (common/emb.h) that the pulls and pushes carry beside
 * the dense ranges, one section per table: the batch's distinct ids (a
 * request names each once), where a pull writes their rows (n * dim
 * floats, in the ids' order) and where a push reads their gradients. The
 * client places each id on its shard and sends each shard its ids in the
 * same Pull or Push as its dense range, so that a shard applies a push's
 * rows and dense values as one update, and a pull's rows and dense values
 * are of one version. The buffers must outlive the rounds that use them. */
typedef struct {
  int table;           /* index in the job's "embeddings" */
  const uint64_t *ids;
  size_t n;
  float *values;       /* pull: written */
  const float *grads;  /* push: read */
} ps_client_rows;

/* Sets the rows of the next pulls and pushes (until set again; n_sec 0:
 * none). PS_EINVAL for a table that is not the job's or named twice,
 * PS_ERANGE for an id beyond a bounded table's rows or more rows for one
 * shard than the job's max_rows_per_request, PS_ESTATE while a push is in
 * flight, PS_ENOMEM; after an error other than PS_ESTATE no rows are set.
 * On a 16-bit wire the rows' gradients are
 * rounded without error feedback. */
int ps_client_set_rows(ps_client *c, const ps_client_rows *secs, int n_sec, char *err);

typedef struct {
  uint64_t staleness_sum; /* over the shards */
  uint64_t staleness_max;
  int dropped;            /* shards that dropped the gradient (sync: late) */
} ps_push_result;

/* Pushes each shard its slice of grads (P floats) with the version it was
 * computed from. grads must not change until the call returns. res (may be
 * NULL) receives what the shards said: staleness and dropped gradients.
 * The same as push_begin then push_end, below. */
int ps_client_push(ps_client *c, const float *grads, const uint64_t *versions, uint64_t step,
                   int batch_size, ps_push_result *res, char *err);

/* The same push in parts, so that a shard's slice can go out as soon as
 * it is ready (while the rest of the gradient is still being computed):
 *   begin: a new round with the versions the gradient was computed from
 *     (PS_EINVAL while the last round still has calls in flight), and the
 *     lease its batch_size examples were drawn from (0: none), which shard
 *     0 counts (what a worker that leaves or dies trained of a chunk is in
 *     the records) and a registration again names;
 *   push_shard: starts shard s's call with its slice of grads (nothing if
 *     it was started or done already this round);
 *   push_end: starts the shards not started yet, waits for all, registers
 *     again with a shard that forgot this worker and pushes it once more.
 *     On an error the shards that failed stay pending and those that
 *     applied the gradient are done: calling push_end again (a retry)
 *     pushes only the pending ones, so no shard applies a gradient twice.
 * grads must not change from the first push_shard until push_end returns,
 * and with a pull that waits (min_versions: sync) until that pull returns:
 * a shard that restarted from a checkpoint written before the round has
 * lost it, and the pull pushes it the round again (the same bytes; the
 * rows as they were gathered, also when the next rows are set already).
 * pending: the shards of the round not done yet. */
int ps_client_push_begin(ps_client *c, const uint64_t *versions, uint64_t step, int batch_size,
                         uint64_t lease_id);
int ps_client_push_shard(ps_client *c, int s, const float *grads, char *err);
int ps_client_push_end(ps_client *c, const float *grads, ps_push_result *res, char *err);
int ps_client_push_pending(const ps_client *c);

/* What a heartbeat says besides the step (see ps_source_heartbeat_state). */
typedef struct {
  const uint64_t *leases; /* the leases this worker holds (names_leases) */
  int n_leases;
  int names_leases;       /* shard 0 renews the named leases only */
  int idle;               /* waiting for data: not counted in steps and clocks */
} ps_client_hb_state;

/* Heartbeat to every shard (state may be NULL); a shard that no longer
 * knows this worker is registered with again. */
int ps_client_heartbeat(ps_client *c, uint64_t step, const ps_client_hb_state *state, char *err);

typedef struct {
  int status;         /* 0 granted, 1 wait and ask again, 2 no more data */
  uint64_t lease_id;
  int epoch;
  uint32_t chunk;
  uint64_t begin;
  uint32_t count;
  int completed_counted; /* the finished lease was counted */
} ps_client_lease;

/* Data leases from shard 0: reports a finished lease (complete_id != 0)
 * and/or asks for the next chunk (want_next). Thread-safe (its own queue).
 * A shard 0 that forgot this worker is registered with again. The client
 * keeps the chunks of the current epoch whose completion shard 0 counted
 * (the newest few thousand) and names them whenever it registers again with
 * shard 0 (from any call), so that a shard 0 restarted from a checkpoint
 * that lost them counts them as redone. */
int ps_client_lease_call(ps_client *c, uint64_t complete_id, int want_next,
                         uint64_t dataset_size, ps_client_lease *out, char *err);

/* Leaves every shard (best effort). */
void ps_client_leave(ps_client *c);

#endif

/* ps-server's RPC handlers (Register, Heartbeat, Leave, Pull, Push, Status,
 * Lease): each decodes its request, checks the header and answers. They run
 * on gRPC's server threads, against the thread-safe shard and membership.
 * Each handler that changes the state builds an update (ps/core/update.h)
 * and applies it with ps_update_apply; a replicated shard's primary does
 * so under its ordering lock and hands the same record to its log. Pulls
 * that must wait are handed to sync.c, and answered by pull.c. Also the
 * table that registers the methods on the RPC server. */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/auth.h"
#include "common/crc32c.h"
#include "common/half.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "ps/ckpt/cut.h"
#include "ps/core/rows.h"
#include "ps/core/update.h"
#include "ps/repl/replica.h"
#include "ps/rpc/pull.h"
#include "ps/rpc/service.h"
#include "ps/rpc/sync.h"

/* One call, decoded and checked, as a handler sees it. */
typedef struct {
  ps_server *sv;
  rpc_call *call;
  const ProtobufCMessage *msg; /* the method's request message */
  const ps_segview *req;       /* the request's bytes */
  const ps_segview *tensor;    /* its field 15 (empty when absent) */
  int reader;                  /* the caller holds the read-only token or session only */
  int kind;                    /* which method (its request ids are its own) */
} request;

/* Decodes a request; on failure answers INVALID_ARGUMENT and returns NULL.
 * *tensor views field 15 (empty when absent); *tsegs must be freed. */
static ProtobufCMessage *decode_request(rpc_call *call, const ps_segview *req,
                                        const ProtobufCMessageDescriptor *desc, ps_seg **tsegs,
                                        ps_segview *tensor) {
  int max = req->nsegs > 0 ? req->nsegs : 1;
  *tsegs = malloc((size_t)max * sizeof(ps_seg));
  if (!*tsegs) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
  }
  char err[PS_ERRLEN];
  ProtobufCMessage *m = wire_decode(desc, req, *tsegs, max, tensor, err);
  if (!m) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT, "malformed %s: %s", desc->short_name, err);
    free(*tsegs);
    *tsegs = NULL;
  }
  return m;
}

/* What a caller proved in its header. */
enum { CALLER_NONE = 0, CALLER_READER = 1, CALLER_MEMBER = 2 };

/* Which token the header carries: CALLER_MEMBER (the job token, or any
 * header when the server has no token), CALLER_READER (the read-only
 * token) or CALLER_NONE. Compared in constant time. */
static int caller_token(const ps_server *sv, const Ps__RequestHeader *h) {
  if (!sv->sec.token.len) return CALLER_MEMBER;
  const ProtobufCBinaryData *t = &h->token;
  if (ps_ct_equal(t->data, t->len, sv->sec.token.bytes, sv->sec.token.len)) return CALLER_MEMBER;
  if (sv->sec.read_token.len &&
      ps_ct_equal(t->data, t->len, sv->sec.read_token.bytes, sv->sec.read_token.len))
    return CALLER_READER;
  return CALLER_NONE;
}

/* Checks protocol version and token; need_worker: also the job id, and
 * that the caller is a worker registered here with this shard's session
 * secret for it (it is marked seen). *reader: the caller holds only the
 * read-only token or session. Answers the call and returns -1 on failure;
 * nothing changes then. */
static int check_header(ps_server *sv, rpc_call *call, const Ps__RequestHeader *h,
                        const char *method, int need_worker, uint64_t step, int *reader) {
  if (!h) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT, "%s request has no header", method);
    return -1;
  }
  if (h->protocol_version != PS_PROTOCOL_VERSION) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "protocol version mismatch: client speaks version %u, shard %d speaks %u",
                  h->protocol_version, sv->index, PS_PROTOCOL_VERSION);
    return -1;
  }
  int who = caller_token(sv, h);
  if (who == CALLER_NONE) {
    rpc_call_fail(call, RPC_UNAUTHENTICATED,
                  "%s: the request does not carry this job's token (give the worker the servers' "
                  "--token-file)",
                  method);
    return -1;
  }
  *reader = who == CALLER_READER;
  const char *jid = h->job_id ? h->job_id : "";
  if (need_worker && strcmp(jid, sv->job.job_id) != 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "job id mismatch: client is in job '%s', shard %d serves job '%s'", jid,
                  sv->index, sv->job.job_id);
    return -1;
  }
  if (!need_worker) return 0;
  int session_reader = 0;
  int rc = ps_membership_authorize(sv->members, h->worker_id, h->session.data, h->session.len,
                                   &session_reader);
  if (rc == PS_OK) rc = ps_membership_touch(sv->members, h->worker_id, step, ps_now_ms());
  if (rc == PS_ENOTFOUND) {
    rpc_call_fail(call, RPC_NOT_FOUND,
                  "worker %016" PRIx64
                  " is not registered with shard %d (never registered, left, or silent for "
                  "more than %d ms): register again",
                  h->worker_id, sv->index, sv->job.heartbeat_timeout_ms);
    return -1;
  }
  if (rc != PS_OK) {
    rpc_call_fail(call, RPC_UNAUTHENTICATED,
                  "%s: wrong session secret for worker %016" PRIx64 " on shard %d", method,
                  h->worker_id, sv->index);
    return -1;
  }
  *reader |= session_reader;
  return 0;
}


/* A mutation the worker may retry (Push, Lease) with request id rid != 0:
 * answers a repeat from the worker's recent requests and returns 1 (the
 * caller applies nothing); returns 0 when the request is new (it is then
 * pending: finish it with reply_recorded or forget_request). */
static int answer_repeat(const request *q, uint64_t worker, uint64_t rid, const char *method) {
  if (rid == 0) return 0;
  uint8_t reply[PS_REPLY_MAX];
  size_t len = 0;
  int rc = ps_membership_request_begin(q->sv->members, worker, q->kind, rid, reply, sizeof reply,
                                       &len);
  if (rc == PS_REQUEST_ANSWERED) {
    PS_DEBUG("%s %" PRIu64 " of worker %016" PRIx64 " again: answered as the first time, "
             "nothing applied", method, rid, worker);
    rpc_msg out = {.nseg = 1};
    out.seg[0] = (rpc_seg){.ptr = reply, .len = len}; /* copied */
    rpc_call_reply(q->call, &out);
    return 1;
  }
  if (rc == PS_REQUEST_PENDING) {
    /* A replicated shard's primary names itself: the worker asks it
     * again rather than another replica. */
    if (q->sv->repl)
      rpc_call_fail(q->call, RPC_UNAVAILABLE,
                    "%s %" PRIu64 " of this worker is still being applied by shard %d: ask "
                    "again" PS_REDIRECT_FMT,
                    method, rid, q->sv->index, q->sv->replica);
    else
      rpc_call_fail(q->call, RPC_UNAVAILABLE,
                    "%s %" PRIu64 " of this worker is still being applied by shard %d: ask again",
                    method, rid, q->sv->index);
    return 1;
  }
  return 0; /* new (or the worker is gone: the handler finds out) */
}

/* Answers m and keeps it as request rid's answer (rid 0: just answers). */
static void reply_recorded(const request *q, uint64_t worker, uint64_t rid,
                           const ProtobufCMessage *m) {
  if (rid) {
    uint8_t buf[PS_REPLY_MAX];
    size_t len = protobuf_c_message_get_packed_size(m);
    if (len <= sizeof buf) protobuf_c_message_pack(m, buf);
    ps_membership_request_end(q->sv->members, worker, q->kind, rid, buf,
                              len <= sizeof buf ? len : 0);
  }
  wire_reply(q->call, m);
}

/* A request rid that was refused: a retry may try it again. */
static void forget_request(const request *q, uint64_t worker, uint64_t rid) {
  if (rid) ps_membership_request_end(q->sv->members, worker, q->kind, rid, NULL, 0);
}


/* The replicas of every shard, for a Register answer (R > 1). */
static void fill_replicas(ps_server *sv, Ps__RegisterResponse *resp, char **all) {
  if (!sv->repl) return;
  int n = sv->cluster.n_ps * sv->job.replicas_per_shard;
  for (int i = 0; i < n; i++) all[i] = sv->replica_addrs[i];
  resp->n_replicas = (size_t)n;
  resp->replicas = all;
  resp->replicas_per_shard = (uint32_t)sv->job.replicas_per_shard;
}

/* A worker's first Register reached a replica that is not the primary:
 * it is sent on as a shard other than 0 sends it, to shard 0's primary
 * when this replica knows it (else to shard 0's first replica, and the
 * worker tries the replicas in turn). */
static void first_contact_elsewhere(ps_server *sv, rpc_call *call) {
  Ps__RegisterResponse resp = PS__REGISTER_RESPONSE__INIT;
  char *shards[PS_MAX_TASKS], *all[PS_MAX_TASKS];
  for (int i = 0; i < sv->cluster.n_ps; i++) shards[i] = sv->cluster.ps[i];
  int p = ps_replica_known_primary(sv);
  if (sv->index == 0 && p >= 0) shards[0] = (char *)ps_replica_addr(sv, p);
  resp.n_shards = (size_t)sv->cluster.n_ps;
  resp.shards = shards;
  resp.shard_index = (uint32_t)sv->index;
  resp.param_count = sv->job.model.n_params;
  resp.job_id = sv->job.job_id;
  fill_replicas(sv, &resp, all);
  wire_reply(call, &resp.base);
}

static void handle_register(const request *q) {
  ps_server *sv = q->sv;
  rpc_call *call = q->call;
  const Ps__RegisterRequest *r = (const Ps__RegisterRequest *)q->msg;
  const char *role = r->role ? r->role : "";
  if (q->reader && strcmp(role, "evaluator") != 0) {
    rpc_call_fail(call, RPC_PERMISSION_DENIED,
                  "the read-only token registers evaluators only, not role '%s'", role);
    return;
  }
  uint64_t id = r->header->worker_id;
  const char *jid = r->header->job_id ? r->header->job_id : "";
  if (id != 0 && strcmp(jid, sv->job.job_id) != 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "job id mismatch: worker %016" PRIx64 " is in job '%s', shard %d serves job '%s'",
                  id, jid, sv->index, sv->job.job_id);
    return;
  }
  Ps__RegisterResponse resp = PS__REGISTER_RESPONSE__INIT;
  char *shards[PS_MAX_TASKS], *all[PS_MAX_TASKS];
  for (int i = 0; i < sv->cluster.n_ps; i++) shards[i] = sv->cluster.ps[i];
  fill_replicas(sv, &resp, all);
  resp.n_shards = (size_t)sv->cluster.n_ps;
  resp.shards = shards;
  resp.shard_index = (uint32_t)sv->index;
  resp.param_count = sv->job.model.n_params;
  resp.range_offset = ps_shard_begin(sv->shard);
  resp.range_count = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  resp.heartbeat_timeout_ms = (uint32_t)sv->job.heartbeat_timeout_ms;
  resp.start_version = sv->start_version;
  resp.job_id = sv->job.job_id;
  if (id == 0 && sv->index != 0) {
    /* Ids come from shard 0: send the worker there. */
    wire_reply(call, &resp.base);
    return;
  }
  uint64_t new_id = 0;
  int rank = 0;
  uint8_t session[PS_SESSION_LEN];
  ps_member_cred cred = {.session = r->header->session.data,
                         .session_len = r->header->session.len,
                         .reader = q->reader};
  /* A replicated shard's primary holds its ordering lock from the join to
   * the log entry (answered when every replica has it). */
  if (ps_replica_lock(sv) != 0) {
    ps_replica_redirect(sv, call, "Register");
    return;
  }
  int rc = ps_membership_join(sv->members, id, r->host ? r->host : "", role, r->task_index,
                              ps_now_ms(), &cred, &new_id, &rank, session);
  if (rc != 0) ps_replica_unlock(sv);
  if (rc == PS_ESTATE) {
    /* A worker of that id is registered here and the caller cannot show
     * its session: another client, or a reply that was lost (the record
     * then times out and the worker registers afresh). */
    rpc_call_fail(call, RPC_ALREADY_EXISTS,
                  "worker %016" PRIx64 " is registered with shard %d already, and the request "
                  "does not carry its session secret",
                  id, sv->index);
    return;
  }
  if (rc == PS_ERANGE) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED,
                  "shard %d holds %d registrations, the job's max_workers: none taken until one "
                  "leaves or times out",
                  sv->index, sv->job.max_workers);
    return;
  }
  if (rc != 0) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "cannot register worker: %s", ps_strerror(rc));
    return;
  }
  PS_INFO("worker %016" PRIx64 " registered (host %s, role %s, task %d, rank %d); %d live",
          new_id, r->host ? r->host : "?", r->role ? r->role : "?", r->task_index, rank,
          ps_membership_count(sv->members));
  /* A worker registering again says what it did under the leases of an
   * earlier life of shard 0 (at most PS_HELD_NAMED of its leases are read:
   * it holds a few). */
  ps_lease_held held[PS_HELD_NAMED];
  const int returning = id != 0 && !q->reader;
  size_t n_held = returning ? ps_update_held_from_msg(r->held_leases, r->n_held_leases, held) : 0;
  if (returning && (r->n_done_chunks > 0 || n_held > 0))
    ps_update_rejoin(sv, new_id, r->done_chunks, r->n_done_chunks, held, n_held, 0);
  resp.worker_id = new_id;
  resp.worker_rank = (uint32_t)rank;
  resp.session = (ProtobufCBinaryData){.len = PS_SESSION_LEN, .data = session};
  resp.job_json = sv->job_text;
  if (sv->repl) {
    int reader = 0;
    ps_membership_authorize(sv->members, new_id, session, PS_SESSION_LEN, &reader);
    ps_update u = {.kind = PS_UPDATE_REGISTER,
                   .worker = new_id,
                   .host = r->host,
                   .role = role,
                   .task_index = r->task_index,
                   .session = session,
                   .reader = reader,
                   .done_chunks = returning ? r->done_chunks : NULL,
                   .n_done = returning ? r->n_done_chunks : 0,
                   .held = held,
                   .n_held = n_held};
    if (ps_replica_append(sv, &u, call, &resp.base, 0, 0) != PS_OK)
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "shard %d: out of memory", sv->index);
    ps_replica_unlock(sv);
    if (sv->job.mode_kind == PS_MODE_SYNC) ps_sync_try_step(sv);
    return;
  }
  wire_reply(call, &resp.base);
  if (sv->job.mode_kind == PS_MODE_SYNC) ps_sync_try_step(sv);
}

/* The worker's idle flag, logged for the backups when it changed. 1 when
 * it changed. */
static int set_idle(ps_server *sv, uint64_t wid, int idle) {
  if (ps_replica_lock(sv) != 0) return 0;
  ps_update u = {.kind = PS_UPDATE_IDLE, .worker = wid, .idle = idle};
  ps_update_result res = {0};
  char err[PS_ERRLEN];
  ps_update_apply(sv, &u, 0, &res, err);
  if (res.changed && sv->repl)
    ps_replica_append(sv, &u, NULL, NULL, 0, 0); /* no memory: a snapshot carries it */
  ps_replica_unlock(sv);
  return res.changed;
}

static void handle_heartbeat(const request *q) {
  ps_server *sv = q->sv;
  rpc_call *call = q->call;
  const Ps__HeartbeatRequest *r = (const Ps__HeartbeatRequest *)q->msg;
  const uint64_t wid = r->header->worker_id;
  if (ps_replica_lock(sv) == 0) { /* a replicated shard 0 logs the renewal */
    pthread_mutex_lock(&sv->lease_mu);
    const int leasing = sv->leases != NULL;
    pthread_mutex_unlock(&sv->lease_mu);
    if (leasing) {
      ps_update u = {.kind = PS_UPDATE_LEASE_RENEW,
                     .worker = wid,
                     .now_ms = ps_now_ms(),
                     .leases = r->leases,
                     .n_leases = r->n_leases,
                     .names_leases = r->names_leases};
      ps_update_result res = {0};
      char err[PS_ERRLEN];
      ps_update_apply(sv, &u, 0, &res, err);
      if (sv->repl)
        ps_replica_append(sv, &u, NULL, NULL, 0, 0); /* no memory: it diverged, a snapshot mends */
    }
    ps_replica_unlock(sv);
  }
  if (set_idle(sv, wid, r->idle) == 1) {
    PS_INFO("worker %016" PRIx64 " %s; %d training", wid,
            r->idle ? "waits for data: the others go on without it" : "has data again",
            ps_membership_count(sv->members));
    /* One fewer (or one more) to wait for: a smaller quorum, a new
     * slowest clock. */
    if (sv->job.mode_kind == PS_MODE_SYNC) ps_sync_try_step(sv);
    ps_waits_recheck(sv);
  }
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  Ps__HeartbeatResponse resp = PS__HEARTBEAT_RESPONSE__INIT;
  resp.version = st.version;
  wire_reply(call, &resp.base);
}

static void handle_leave(const request *q) {
  ps_server *sv = q->sv;
  rpc_call *call = q->call;
  const Ps__LeaveRequest *r = (const Ps__LeaveRequest *)q->msg;
  /* A replicated shard's primary removes the worker and logs it under its
   * ordering lock, and answers once every replica has it. */
  if (ps_replica_lock(sv) != 0) {
    ps_replica_redirect(sv, call, "Leave");
    return;
  }
  ps_update u = {.kind = PS_UPDATE_LEAVE, .worker = r->header->worker_id};
  ps_update_result res = {0};
  char err[PS_ERRLEN];
  ps_update_apply(sv, &u, 0, &res, err);
  PS_INFO("worker %016" PRIx64 " left; %d live", r->header->worker_id,
          ps_membership_count(sv->members));
  Ps__LeaveResponse resp = PS__LEAVE_RESPONSE__INIT;
  if (!sv->repl)
    wire_reply(call, &resp.base);
  else if (ps_replica_append(sv, &u, call, &resp.base, 0, 0) != PS_OK)
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "shard %d: out of memory", sv->index);
  ps_replica_unlock(sv);
  /* One fewer worker: a smaller quorum, or a new slowest clock. */
  if (sv->job.mode_kind == PS_MODE_SYNC) ps_sync_try_step(sv);
  ps_waits_recheck(sv);
}

static void handle_pull(const request *q) {
  ps_server *sv = q->sv;
  rpc_call *call = q->call;
  const Ps__PullRequest *r = (const Ps__PullRequest *)q->msg;
  /* A range that can never be served is refused before it could wait. */
  size_t begin = ps_shard_begin(sv->shard), end = ps_shard_end(sv->shard);
  ps_rows_req *rows = NULL;
  char err[PS_ERRLEN];
  int rrc = ps_rows_from_msg(sv, r->rows, r->n_rows, &rows, err);
  if (rrc != 0) {
    rpc_call_fail(call, rrc == PS_ENOMEM   ? RPC_RESOURCE_EXHAUSTED
                        : rrc == PS_ERANGE ? RPC_OUT_OF_RANGE
                                           : RPC_INVALID_ARGUMENT,
                  "Pull: %s", err);
    return;
  }
  if (r->count == 0 && end > begin && !rows) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT, "Pull of 0 values (shard %d holds [%zu, %zu))",
                  sv->index, begin, end);
    return;
  }
  if (r->offset < begin || r->offset > end || r->count > end - r->offset) {
    ps_rows_free(rows);
    rpc_call_fail(call, RPC_OUT_OF_RANGE,
                  "Pull of [%" PRIu64 ", +%" PRIu64 ") is outside shard %d's range [%zu, %zu)",
                  r->offset, r->count, sv->index, begin, end);
    return;
  }
  int rc = ps_waits_add(sv, call, r->header->worker_id, r->min_version, r->push_round, r->offset,
                        r->count, rows);
  if (rc != PS_PULL_NOW && rc != PS_PULL_WAITS) ps_rows_free(rows);
  if (rc == PS_PULL_NOW && rows)
    ps_pull_serve_rows(sv, call, r->offset, r->count, rows);
  else if (rc == PS_PULL_NOW)
    ps_pull_serve(sv, call, r->offset, r->count);
  else if (rc == PS_ENOTFOUND)
    rpc_call_fail(call, RPC_NOT_FOUND, "worker %016" PRIx64 " is not registered with shard %d",
                  r->header->worker_id, sv->index);
  else if (rc == PS_PULL_LOST)
    rpc_call_fail(call, RPC_DATA_LOSS,
                  "shard %d has not taken push round %" PRIu64 " of worker %016" PRIx64
                  " (it restarted from a checkpoint written before it), so step %" PRIu64
                  " cannot be made without it: push the round again",
                  sv->index, r->push_round, r->header->worker_id, r->min_version);
  else if (rc == PS_ERANGE)
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED,
                  "shard %d: %d pulls wait already (twice the job's max_workers)", sv->index,
                  2 * sv->job.max_workers);
  else if (rc == PS_ENOMEM)
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
}

/* The one path of a push on this shard: the update applied (async, ssp:
 * to the shard; sync: to the step's sum) with ps_update_apply, then
 * answered and kept under its request id. A replicated shard's primary
 * applies it under its ordering lock and hands the same record to its log,
 * which answers the call once every replica has it. */
void ps_service_apply_push(ps_server *sv, const ps_push_args *a) {
  const request q = {.sv = sv, .call = a->call, .kind = a->rec_kind};
  const ps_update *u = &a->u;
  const uint64_t wid = u->worker;
  char err[PS_ERRLEN];
  if (ps_replica_lock(sv) != 0) {
    forget_request(&q, wid, u->request_id);
    ps_replica_redirect(sv, a->call, "Push");
    return;
  }
  double t0 = ps_now_s();
  ps_update_result res = {0};
  int rc = ps_update_apply(sv, u, 0, &res, err);
  if (rc != 0) {
    ps_replica_unlock(sv);
    PS_WARN("push from worker %016" PRIx64 " refused: %s", wid, err);
    forget_request(&q, wid, u->request_id);
    rpc_call_fail(a->call, res.rpc_status, "%s", err);
    return;
  }
  if (res.dropped)
    PS_DEBUG("dropped a late gradient of step %" PRIu64 " from worker %016" PRIx64
             " (step %" PRIu64 " is under way)",
             u->base_version, wid, res.version);
  PS_DEBUG("push of %" PRIu64 " values (step %" PRIu64 ", base version %" PRIu64
           ") from worker %016" PRIx64 " in %d slices: %s in %.2f ms (%d in this step)",
           u->count, u->step, u->base_version, wid, u->gradient->nsegs,
           res.dropped ? "dropped" : "taken", (ps_now_s() - t0) * 1e3, res.have);
  Ps__PushResponse resp = PS__PUSH_RESPONSE__INIT;
  resp.version = res.version;
  resp.staleness = res.staleness;
  resp.dropped = res.dropped;
  if (!sv->repl) {
    reply_recorded(&q, wid, u->request_id, &resp.base);
  } else if (ps_replica_append(sv, u, a->call, &resp.base, a->rec_kind, u->request_id) != PS_OK) {
    forget_request(&q, wid, u->request_id);
    rpc_call_fail(a->call, RPC_RESOURCE_EXHAUSTED,
                  "shard %d: out of memory logging a push for the backups", sv->index);
  }
  ps_replica_unlock(sv);
  if (sv->job.mode_kind == PS_MODE_SYNC)
    ps_sync_try_step(sv);
  else if (sv->job.mode_kind == PS_MODE_SSP)
    ps_waits_recheck(sv); /* a clock moved */
}

static void handle_push(const request *q) {
  const Ps__PushRequest *r = (const Ps__PushRequest *)q->msg;
  const uint64_t wid = r->header->worker_id;
  if (answer_repeat(q, wid, r->request_id, "Push")) return;
  /* A round at or before the last one applied here, no longer among the
   * recent answers (a checkpoint restored after it was applied): applied
   * already, answered as such. */
  uint64_t last = 0;
  if (r->request_id && ps_membership_round(q->sv->members, wid, &last) == PS_OK &&
      r->request_id <= last) {
    PS_INFO("push round %" PRIu64 " of worker %016" PRIx64 " again: applied before (round %" PRIu64
            " is the last here); nothing applied",
            r->request_id, wid, last);
    ps_shard_stats st;
    ps_shard_stats_get(q->sv->shard, &st);
    Ps__PushResponse resp = PS__PUSH_RESPONSE__INIT;
    resp.version = st.version;
    reply_recorded(q, wid, r->request_id, &resp.base);
    return;
  }
  ps_rows_req *rows = NULL;
  char err[PS_ERRLEN];
  int rrc = ps_rows_from_msg(q->sv, r->rows, r->n_rows, &rows, err);
  if (rrc != 0) {
    PS_WARN("push from worker %016" PRIx64 " refused: %s", wid, err);
    forget_request(q, wid, r->request_id);
    rpc_call_fail(q->call, rrc == PS_ENOMEM   ? RPC_RESOURCE_EXHAUSTED
                           : rrc == PS_ERANGE ? RPC_OUT_OF_RANGE
                                              : RPC_INVALID_ARGUMENT,
                  "%s", err);
    return;
  }
  ps_push_args a = {.call = q->call,
                    .rec_kind = q->kind,
                    .u = {.kind = PS_UPDATE_PUSH,
                          .worker = wid,
                          .request_id = r->request_id,
                          .base_version = r->base_version,
                          .offset = r->offset,
                          .count = r->count,
                          .step = r->step,
                          .gradient = q->tensor,
                          .rows = rows,
                          .lease_id = r->lease_id,
                          .batch = r->batch_size}};
  /* Under sync only steps wait for a checkpoint cut; async and ssp
   * pushes pass its gate (or wait there, answered later). */
  if (q->sv->job.mode_kind == PS_MODE_SYNC) {
    ps_service_apply_push(q->sv, &a);
    ps_rows_free(rows);
    return;
  }
  int gate = ps_cut_push_enter(q->sv, &a);
  if (gate == 1) { /* held (with copies of the bytes and rows): answered when the cut is taken */
    ps_rows_free(rows);
    return;
  }
  if (gate < 0) {
    ps_rows_free(rows);
    forget_request(q, wid, r->request_id);
    rpc_call_fail(q->call, RPC_RESOURCE_EXHAUSTED,
                  "shard %d: out of memory holding a push during a checkpoint", q->sv->index);
    return;
  }
  ps_service_apply_push(q->sv, &a);
  ps_rows_free(rows);
  ps_cut_leave(q->sv);
}

static void handle_checkpoint(const request *q) {
  const Ps__CheckpointRequest *r = (const Ps__CheckpointRequest *)q->msg;
  const char *jid = r->header->job_id ? r->header->job_id : "";
  if (strcmp(jid, q->sv->job.job_id) != 0) {
    rpc_call_fail(q->call, RPC_FAILED_PRECONDITION,
                  "job id mismatch: caller is in job '%s', shard %d serves job '%s'", jid,
                  q->sv->index, q->sv->job.job_id);
    return;
  }
  ps_cut_handle(q->sv, q->call, r);
}

/* Server to server: the caller must be in this job (the job token, which
 * the dispatch checked, and the job id). */
static int same_job(const request *q, const Ps__RequestHeader *h, const char *method) {
  const char *jid = h->job_id ? h->job_id : "";
  if (strcmp(jid, q->sv->job.job_id) == 0) return 1;
  rpc_call_fail(q->call, RPC_FAILED_PRECONDITION,
                "%s: job id mismatch: caller is in job '%s', shard %d serves job '%s'", method, jid,
                q->sv->index, q->sv->job.job_id);
  return 0;
}

static void handle_replicate(const request *q) {
  const Ps__ReplicateRequest *r = (const Ps__ReplicateRequest *)q->msg;
  if (same_job(q, r->header, "Replicate")) ps_replica_handle_replicate(q->sv, q->call, r);
}

static void handle_vote(const request *q) {
  const Ps__VoteRequest *r = (const Ps__VoteRequest *)q->msg;
  if (same_job(q, r->header, "Vote")) ps_replica_handle_vote(q->sv, q->call, r);
}

/* A CRC of the shard's state (parameters, slots, version, tables' rows): replicas at one
 * position share it. 0 when out of memory. */
static uint32_t state_crc(ps_server *sv) {
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  int ns = ps_shard_n_slots(sv->shard);
  float *buf = malloc((n ? n : 1) * sizeof(float) * (size_t)(1 + ns));
  if (!buf) return 0;
  float *slots[8];
  for (int k = 0; k < ns && k < 8; k++) slots[k] = buf + n * (size_t)(1 + k);
  uint64_t version = 0;
  ps_shard_export_state(sv->shard, buf, slots, &version);
  uint32_t crc = ps_crc32c(0, buf, n * sizeof(float) * (size_t)(1 + ns));
  crc = ps_crc32c(crc, &version, sizeof version);
  free(buf);
  /* Each table's rows (their own order-independent checksum). */
  for (int t = 0; t < sv->n_tables; t++) {
    ps_table_read_lock(sv->tables[t]);
    uint32_t tc = ps_table_crc(sv->tables[t]);
    ps_table_unlock(sv->tables[t]);
    crc = ps_crc32c(crc, &tc, sizeof tc);
  }
  return crc;
}

static void handle_status(const request *q) {
  ps_server *sv = q->sv;
  rpc_call *call = q->call;
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  Ps__StatusResponse resp = PS__STATUS_RESPONSE__INIT;
  resp.shard_index = (uint32_t)sv->index;
  resp.num_shards = (uint32_t)sv->cluster.n_ps;
  resp.range_offset = ps_shard_begin(sv->shard);
  resp.range_count = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  resp.version = st.version;
  resp.pushes = st.pushes;
  resp.pulls = st.pulls;
  resp.rejected = st.rejected;
  resp.staleness_mean = st.staleness_mean;
  resp.staleness_max = st.staleness_max;
  resp.n_staleness_hist = PS_STALENESS_BUCKETS;
  resp.staleness_hist = st.staleness_hist;
  resp.workers_dropped = ps_membership_dropped_total(sv->members);
  resp.job_id = sv->job.job_id;
  resp.mode = sv->job.mode;
  resp.uptime_s = ps_now_s() - sv->start_s;
  resp.cpu_seconds = ps_cpu_s();
  resp.dropped = st.dropped;
  resp.sync_short_steps = st.sync_short_steps;
  resp.step_time_ms = st.step_time_ms;
  resp.sync_pending = (uint32_t)st.sync_pending;
  resp.backup_workers = (uint32_t)sv->job.backup_workers;
  resp.live_workers = (uint32_t)ps_membership_count(sv->members);
  pthread_mutex_lock(&sv->wait_mu);
  resp.waits = sv->waits;
  resp.waiting_now = (uint32_t)sv->n_waiting;
  resp.ssp_max_lead = sv->ssp_max_lead;
  uint64_t done = sv->waits - (uint64_t)sv->n_waiting;
  resp.wait_ms_mean = done ? sv->wait_ms_total / (double)done : 0.0;
  pthread_mutex_unlock(&sv->wait_mu);
  Ps__LeaseEpoch le[1 + PS_LEASE_HISTORY], *lep[1 + PS_LEASE_HISTORY];
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *lt = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (lt) {
    ps_lease_stats ls;
    ps_leases_stats(lt, &ls);
    int ne = 0;
    for (int i = -1; i < ls.n_history; i++) {
      const ps_lease_epoch_record *e = i < 0 ? &ls.current : &ls.history[i];
      if (i < 0 && ls.finished) continue; /* nothing under way */
      ps__lease_epoch__init(&le[ne]);
      le[ne].epoch = e->epoch;
      le[ne].finished = e->finished;
      le[ne].chunks = e->chunks;
      le[ne].chunks_completed = e->chunks_completed;
      le[ne].chunks_once = e->chunks_once;
      le[ne].examples_completed = e->examples_completed;
      le[ne].examples_handed_out = e->examples_handed_out;
      le[ne].examples_rehanded = e->examples_rehanded;
      le[ne].reclaims = e->reclaims;
      le[ne].examples_redone = e->examples_redone;
      le[ne].examples_recovered = e->examples_recovered;
      le[ne].examples_wasted = e->examples_wasted;
      le[ne].examples_abandoned = e->examples_abandoned;
      lep[ne] = &le[ne];
      ne++;
    }
    resp.n_lease_epochs = (size_t)ne;
    resp.lease_epochs = lep;
  }
  ps_cut_set_info(sv, &resp.checkpoint_set, &resp.checkpoint_set_version);
  resp.wire = (char *)ps_wire_name(sv->job.wire);
  resp.push_bytes = atomic_load(&sv->push_bytes);
  resp.pull_bytes = atomic_load(&sv->pull_bytes);
  ps_replica_view rv;
  ps_replica_view_get(sv, &rv);
  if (sv->repl) {
    resp.replica = (uint32_t)rv.replica;
    resp.replica_role = (char *)rv.role;
    resp.replica_term = rv.term;
    resp.replica_primary = rv.primary;
    resp.replica_seq = rv.seq;
    resp.replica_seq_term = rv.seq_term;
    resp.replica_fresh = rv.fresh;
    resp.replica_acked = rv.acked;
    resp.n_replica_in_sync = (size_t)rv.n_in_sync;
    resp.replica_in_sync = rv.in_sync;
    resp.n_replica_members = (size_t)rv.n_members;
    resp.replica_members = rv.members;
  }
  resp.state_crc = state_crc(sv);
  Ps__TableStatus tstore[PS_MAX_TABLES];
  Ps__TableStatus *tptrs[PS_MAX_TABLES];
  ps_rows_status(sv, &resp, tstore, tptrs);
  const int MAXW = sv->job.max_workers;
  ps_member *mem = calloc(MAXW, sizeof *mem);
  Ps__WorkerInfo *wi = calloc(MAXW, sizeof *wi);
  Ps__WorkerInfo **wp = calloc(MAXW, sizeof *wp);
  enum { HELD = 8 };
  uint64_t *held = calloc((size_t)MAXW * HELD, sizeof *held);
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *leases = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (!mem || !wi || !wp || !held) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    int n = ps_membership_list(sv->members, mem, MAXW);
    int64_t now = ps_now_ms();
    for (int i = 0; i < n; i++) {
      ps__worker_info__init(&wi[i]);
      wi[i].worker_id = mem[i].id & 0xffffffff00000000u; /* not in full: ids name workers */
      wi[i].host = mem[i].host;
      wi[i].role = mem[i].role;
      wi[i].task_index = mem[i].task_index;
      wi[i].step = mem[i].step;
      wi[i].pushes = mem[i].pushes;
      wi[i].ms_since_seen = (uint64_t)(now - mem[i].last_seen_ms);
      wi[i].clock = mem[i].clock;
      wi[i].idle = mem[i].idle;
      if (leases) {
        ps_lease got[HELD];
        int k = ps_leases_held(leases, mem[i].id, got, HELD);
        if (k > HELD) k = HELD;
        for (int j = 0; j < k; j++) held[(size_t)i * HELD + (size_t)j] = got[j].lease_id;
        wi[i].n_leases = (size_t)(k > 0 ? k : 0);
        wi[i].leases = &held[(size_t)i * HELD];
      }
      wp[i] = &wi[i];
    }
    resp.n_workers = (size_t)n;
    resp.workers = wp;
    wire_reply(call, &resp.base);
  }
  free(mem);
  free(wi);
  free(wp);
  free(held);
}



static void handle_lease(const request *q) {
  ps_server *sv = q->sv;
  rpc_call *call = q->call;
  const Ps__LeaseRequest *r = (const Ps__LeaseRequest *)q->msg;
  if (sv->index != 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION, "data leases come from shard 0, this is shard %d",
                  sv->index);
    return;
  }
  if (sv->job.lease_chunk <= 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "job '%s' does not lease its data (lease_chunk is 0)", sv->job.job_id);
    return;
  }
  uint64_t wid = r->header->worker_id;
  /* A retry of a Lease whose answer was lost gets the same chunk, not a
   * second one that nobody would ever work on. */
  if (answer_repeat(q, wid, r->request_id, "Lease")) return;
  /* A replicated shard 0's primary changes the table and logs the call for
   * its backups under one lock (they replay it with the same clock). */
  if (ps_replica_lock(sv) != 0) {
    forget_request(q, wid, r->request_id);
    ps_replica_redirect(sv, call, "Lease");
    return;
  }
  ps_update u = {.kind = PS_UPDATE_LEASE,
                 .worker = wid,
                 .request_id = r->request_id,
                 .now_ms = ps_now_ms(),
                 .complete_lease = r->complete_lease,
                 .trained = r->trained_examples,
                 .want_next = r->want_next,
                 .dataset_size = r->dataset_size};
  ps_update_result res = {.lease = PS__LEASE_RESPONSE__INIT};
  char err[PS_ERRLEN];
  if (ps_update_apply(sv, &u, 0, &res, err) != 0) {
    if (sv->repl) ps_replica_diverged(sv); /* a completion may have counted */
    ps_replica_unlock(sv);
    forget_request(q, wid, r->request_id);
    rpc_call_fail(call, res.rpc_status, "%s", err);
    return;
  }
  if (sv->repl) {
    if (ps_replica_append(sv, &u, call, &res.lease.base, q->kind, r->request_id) != PS_OK) {
      forget_request(q, wid, r->request_id);
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "shard 0: out of memory");
    }
    ps_replica_unlock(sv);
    return;
  }
  reply_recorded(q, wid, r->request_id, &res.lease.base);
}


/* The methods: what each needs of its caller, and its handler. */
struct ps_method {
  const char *path;
  const ProtobufCMessageDescriptor *desc;
  const char *name;
  /* The caller must be a registered worker of this job (it is marked
   * seen); heartbeat: its step is recorded too. */
  int need_worker, heartbeat;
  /* It changes the model or the data's progress: not for readers. */
  int writes;
  /* Its request (Push) or answer (Pull) carries values in field 15: the
   * header's encoding must be the job's. */
  int tensor;
  void (*handle)(const request *q);
};

static const ps_method methods[PS_SERVICE_METHODS] = {
    {"/ps.ParameterServer/Register", &ps__register_request__descriptor, "Register", 0, 0, 0, 0,
     handle_register},
    {"/ps.ParameterServer/Heartbeat", &ps__heartbeat_request__descriptor, "Heartbeat", 1, 1, 0, 0,
     handle_heartbeat},
    {"/ps.ParameterServer/Leave", &ps__leave_request__descriptor, "Leave", 1, 0, 0, 0,
     handle_leave},
    {"/ps.ParameterServer/Pull", &ps__pull_request__descriptor, "Pull", 1, 0, 0, 1, handle_pull},
    {"/ps.ParameterServer/Push", &ps__push_request__descriptor, "Push", 1, 0, 1, 1, handle_push},
    {"/ps.ParameterServer/Status", &ps__status_request__descriptor, "Status", 0, 0, 0, 0,
     handle_status},
    {"/ps.ParameterServer/Lease", &ps__lease_request__descriptor, "Lease", 1, 0, 1, 0,
     handle_lease},
    {"/ps.ParameterServer/Checkpoint", &ps__checkpoint_request__descriptor, "Checkpoint", 0, 0, 1,
     0, handle_checkpoint},
    {"/ps.ParameterServer/Replicate", &ps__replicate_request__descriptor, "Replicate", 0, 0, 1, 0,
     handle_replicate},
    {"/ps.ParameterServer/Vote", &ps__vote_request__descriptor, "Vote", 0, 0, 1, 0, handle_vote},
};

/* Every call: decode the request, check its header (and the worker, where
 * the method needs one), run the method's handler, free the request. */
static void dispatch(rpc_call *call, const ps_segview *req, void *user) {
  const ps_method_binding *b = user;
  const ps_method *m = b->method;
  if (m->handle == handle_push) atomic_fetch_add(&b->sv->push_bytes, req->total);
  ps_seg *tsegs;
  ps_segview tensor;
  ProtobufCMessage *msg = decode_request(call, req, m->desc, &tsegs, &tensor);
  if (!msg) return;
  /* Every request message has its header in field 1. */
  const ProtobufCFieldDescriptor *hf = protobuf_c_message_descriptor_get_field(m->desc, 1);
  const Ps__RequestHeader *h = *(Ps__RequestHeader *const *)((const char *)msg + hf->offset);
  uint64_t step = m->heartbeat ? ((const Ps__HeartbeatRequest *)msg)->step
                  : m->need_worker ? UINT64_MAX : 0;
  int reader = 0;
  if (b->sv->repl && (m->need_worker || m->handle == handle_register ||
                      m->handle == handle_checkpoint) &&
      !ps_replica_is_primary(b->sv)) {
    /* Workers (and checkpoint sets) talk to the primary alone. A worker's
     * first Register learns where it is. */
    if (m->handle == handle_register && h && h->worker_id == 0)
      first_contact_elsewhere(b->sv, call);
    else
      ps_replica_redirect(b->sv, call, m->name);
  } else if (check_header(b->sv, call, h, m->name, m->need_worker, step, &reader) != 0) {
    /* answered */
  } else if (m->writes && reader) {
    rpc_call_fail(call, RPC_PERMISSION_DENIED,
                  "%s: this client registered as an evaluator or with the read-only token; it "
                  "may not change the model or take data",
                  m->name);
  } else if (m->tensor && (int)h->encoding != (int)b->sv->job.wire) {
    /* Values read in the wrong encoding would be garbage of the right
     * length, or the wrong length: neither is worth a try. */
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "%s: the request says tensor values travel as %s (encoding %d), but job '%s' "
                  "sends and takes them as %s (its job file's \"wire\")",
                  m->name, ps_wire_name((int)h->encoding), (int)h->encoding, b->sv->job.job_id,
                  ps_wire_name(b->sv->job.wire));
  } else {
    request q = {.sv = b->sv, .call = call, .msg = msg, .req = req, .tensor = &tensor,
                 .reader = reader, .kind = (int)(m - methods)};
    m->handle(&q);
  }
  protobuf_c_message_free_unpacked(msg, NULL);
  free(tsegs);
}

void ps_service_register(ps_server *sv, rpc_server *rpc) {
  for (int i = 0; i < PS_SERVICE_METHODS; i++) {
    sv->methods[i] = (ps_method_binding){.sv = sv, .method = &methods[i]};
    rpc_server_add_method(rpc, methods[i].path, dispatch, &sv->methods[i]);
  }
}

/* ps-server: one shard of the model's parameters.
 *
 * Threads: gRPC's completion queue is served by a pool of threads (the
 * handlers below run there, against the thread-safe shard and membership);
 * the main thread runs a libuv loop that owns the timers (dropping silent
 * workers, progress lines and metrics) and the signals (SIGINT/SIGTERM stop
 * the server cleanly). */
#include <getopt.h>
#include <pthread.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "../common/cluster.h"
#include "../common/job.h"
#include "../common/metrics.h"
#include "../common/rpc.h"
#include "../common/util.h"
#include "../common/wire.h"
#include "checkpoint.h"
#include "leases.h"
#include "membership.h"
#include "proto/ps.pb-c.h"
#include "shard.h"

/* A pull that waits on the server (ssp: for the slowest worker to catch
 * up; sync: for the step to be applied). */
typedef struct waiter {
  rpc_call *call;
  uint64_t worker, min_version;
  size_t offset, count;
  int64_t since_ms, deadline_ms;
  struct waiter *next;
} waiter;

typedef struct {
  ps_job job;
  char *job_text;
  ps_cluster cluster;
  int index;
  ps_shard *shard;
  ps_membership *members;
  rpc_server *rpc;
  ps_metrics *metrics;
  double start_s;
  double log_interval_s;
  uv_loop_t loop;
  uv_timer_t sweep_timer, report_timer;
  uv_signal_t sigint, sigterm;
  /* pulls waiting (ssp, sync) and what they waited */
  pthread_mutex_t wait_mu;
  waiter *waiters;
  int n_waiting;
  uint64_t waits;
  double wait_ms_total;
  uint64_t ssp_max_lead;
  int sync_started; /* sync: min_workers have registered once */
  /* data leases (shard 0, when the job has lease_chunk): made at the first
   * Lease request, which says how many examples the data set has */
  pthread_mutex_t lease_mu;
  ps_leases *leases;
  /* checkpoints */
  const char *ckpt_dir;
  double ckpt_secs;        /* write every this many seconds (0: not by time) */
  uint64_t ckpt_updates;   /* ... or every this many updates (0: not by count) */
  int ckpt_keep;
  int ckpt_busy;           /* a write is under way on the work queue */
  double ckpt_last_s;
  uint64_t ckpt_last_version;
  uv_timer_t ckpt_timer;
  uv_work_t ckpt_work;
  ps_ckpt ckpt_state;      /* the copy being written */
  int ckpt_rc;
  char ckpt_path[PS_CKPT_PATHLEN], ckpt_err[PS_ERRLEN];
  /* for rates in progress lines */
  uint64_t last_pushes, last_pulls;
  double last_report_s;
} server;

/* ---------------- request handling (server threads) ---------------- */

static void recheck_waiters(server *sv);
static void sync_try_step(server *sv);
static void release_leases(server *sv, uint64_t worker);

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

/* Checks protocol version and job id. need_worker: the worker must be
 * registered here (it is marked seen). Answers the call and returns -1 on
 * failure. */
static int check_header(server *sv, rpc_call *call, const Ps__RequestHeader *h,
                        const char *method, int need_worker, uint64_t step) {
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
  const char *jid = h->job_id ? h->job_id : "";
  if (need_worker && strcmp(jid, sv->job.job_id) != 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "job id mismatch: client is in job '%s', shard %d serves job '%s'", jid,
                  sv->index, sv->job.job_id);
    return -1;
  }
  if (need_worker &&
      ps_membership_touch(sv->members, h->worker_id, step, ps_now_ms()) == PS_ENOTFOUND) {
    rpc_call_fail(call, RPC_NOT_FOUND,
                  "worker %016" PRIx64
                  " is not registered with shard %d (never registered, left, or silent for "
                  "more than %d ms): register again",
                  h->worker_id, sv->index, sv->job.heartbeat_timeout_ms);
    return -1;
  }
  return 0;
}

static void reply_small(rpc_call *call, const ProtobufCMessage *m) {
  rpc_msg out;
  if (wire_encode(m, NULL, 0, NULL, NULL, &out) != 0) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
    return;
  }
  rpc_call_reply(call, &out);
}

static void handle_register(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__RegisterRequest *r = (Ps__RegisterRequest *)decode_request(
      call, req, &ps__register_request__descriptor, &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Register", 0, 0) != 0) goto done;
  uint64_t id = r->header->worker_id;
  const char *jid = r->header->job_id ? r->header->job_id : "";
  if (id != 0 && strcmp(jid, sv->job.job_id) != 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "job id mismatch: worker %016" PRIx64 " is in job '%s', shard %d serves job '%s'",
                  id, jid, sv->index, sv->job.job_id);
    goto done;
  }
  Ps__RegisterResponse resp = PS__REGISTER_RESPONSE__INIT;
  char *shards[PS_MAX_TASKS];
  for (int i = 0; i < sv->cluster.n_ps; i++) shards[i] = sv->cluster.ps[i];
  resp.n_shards = (size_t)sv->cluster.n_ps;
  resp.shards = shards;
  resp.shard_index = (uint32_t)sv->index;
  resp.param_count = sv->job.model.n_params;
  resp.range_offset = ps_shard_begin(sv->shard);
  resp.range_count = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  resp.heartbeat_timeout_ms = (uint32_t)sv->job.heartbeat_timeout_ms;
  resp.job_id = sv->job.job_id;
  if (id == 0 && sv->index != 0) {
    /* Ids come from shard 0: send the worker there. */
    reply_small(call, &resp.base);
    goto done;
  }
  uint64_t new_id = 0;
  int rank = 0;
  int rc = ps_membership_add(sv->members, id, r->host ? r->host : "", r->role ? r->role : "",
                             r->task_index, ps_now_ms(), &new_id, &rank);
  if (rc != 0) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "cannot register worker: %s", ps_strerror(rc));
    goto done;
  }
  PS_INFO("worker %016" PRIx64 " registered (host %s, role %s, task %d, rank %d); %d live",
          new_id, r->host ? r->host : "?", r->role ? r->role : "?", r->task_index, rank,
          ps_membership_count(sv->members));
  resp.worker_id = new_id;
  resp.worker_rank = (uint32_t)rank;
  resp.job_json = sv->job_text;
  reply_small(call, &resp.base);
  if (sv->job.mode_kind == PS_MODE_SYNC) sync_try_step(sv);
done:
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

static void handle_heartbeat(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__HeartbeatRequest *r = (Ps__HeartbeatRequest *)decode_request(
      call, req, &ps__heartbeat_request__descriptor, &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Heartbeat", 1, r->step) == 0) {
    pthread_mutex_lock(&sv->lease_mu);
    if (sv->leases) ps_leases_renew(sv->leases, r->header->worker_id, ps_now_ms());
    pthread_mutex_unlock(&sv->lease_mu);
    ps_shard_stats st;
    ps_shard_stats_get(sv->shard, &st);
    Ps__HeartbeatResponse resp = PS__HEARTBEAT_RESPONSE__INIT;
    resp.version = st.version;
    reply_small(call, &resp.base);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

static void handle_leave(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__LeaveRequest *r = (Ps__LeaveRequest *)decode_request(
      call, req, &ps__leave_request__descriptor, &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Leave", 1, UINT64_MAX) == 0) {
    ps_membership_remove(sv->members, r->header->worker_id);
    release_leases(sv, r->header->worker_id);
    PS_INFO("worker %016" PRIx64 " left; %d live", r->header->worker_id,
            ps_membership_count(sv->members));
    Ps__LeaveResponse resp = PS__LEAVE_RESPONSE__INIT;
    reply_small(call, &resp.base);
    /* One fewer worker: a smaller quorum, or a new slowest clock. */
    if (sv->job.mode_kind == PS_MODE_SYNC) sync_try_step(sv);
    recheck_waiters(sv);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

static void release_snapshot(void *user) { ps_snapshot_unref(user); }

/* Answers a pull with the current snapshot, sent without a copy. */
static void serve_pull(server *sv, rpc_call *call, size_t offset, size_t count) {
  char err[PS_ERRLEN];
  ps_snapshot *snap = ps_shard_pull(sv->shard, offset, count, err);
  if (!snap) {
    rpc_call_fail(call, RPC_OUT_OF_RANGE, "%s", err);
    return;
  }
  Ps__PullResponse resp = PS__PULL_RESPONSE__INIT;
  resp.version = snap->version;
  resp.offset = snap->begin;
  resp.count = snap->count;
  rpc_msg out;
  /* gRPC drops the reference when it has sent the values. */
  if (wire_encode(&resp.base, snap->values, snap->count * sizeof(float), release_snapshot, snap,
                  &out) != 0) {
    ps_snapshot_unref(snap);
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
    return;
  }
  rpc_call_reply(call, &out);
}

/* May the worker's pull be answered now? Called with wait_mu held.
 * *known is 0 when the worker is no longer registered. */
static int pull_ready(server *sv, uint64_t worker, uint64_t min_version, int *known) {
  *known = 1;
  switch (sv->job.mode_kind) {
    case PS_MODE_SSP: {
      uint64_t clock = 0, lo = 0;
      if (ps_membership_clock(sv->members, worker, &clock, &lo) != 0) {
        *known = 0;
        return 0;
      }
      uint64_t lead = clock - lo;
      if (lead > (uint64_t)sv->job.ssp_k) return 0;
      /* The servers' own record that the bound held at every grant. */
      if (lead > sv->ssp_max_lead) sv->ssp_max_lead = lead;
      return 1;
    }
    case PS_MODE_SYNC: {
      ps_shard_stats st;
      ps_shard_stats_get(sv->shard, &st);
      return st.version >= min_version;
    }
    default:
      return 1;
  }
}

/* Answers the waiting pulls that may go now, fails those past their
 * deadline or whose worker is gone. Called after anything that can
 * release a pull (an update, a worker leaving or timed out) and by the
 * timer. */
static void recheck_waiters(server *sv) {
  int64_t now = ps_now_ms();
  waiter *go = NULL, *fail = NULL, *gone = NULL;
  pthread_mutex_lock(&sv->wait_mu);
  for (waiter **pp = &sv->waiters; *pp;) {
    waiter *w = *pp;
    int known = 1;
    waiter **dest = NULL;
    if (pull_ready(sv, w->worker, w->min_version, &known))
      dest = &go;
    else if (!known)
      dest = &gone;
    else if (now >= w->deadline_ms)
      dest = &fail;
    if (dest) {
      *pp = w->next;
      w->next = *dest;
      *dest = w;
      sv->n_waiting--;
      sv->wait_ms_total += (double)(now - w->since_ms);
    } else {
      pp = &w->next;
    }
  }
  pthread_mutex_unlock(&sv->wait_mu);
  while (go) {
    waiter *w = go;
    go = w->next;
    serve_pull(sv, w->call, w->offset, w->count);
    free(w);
  }
  while (gone) {
    waiter *w = gone;
    gone = w->next;
    rpc_call_fail(w->call, RPC_NOT_FOUND,
                  "worker %016" PRIx64 " was dropped by shard %d while its pull waited: register "
                  "again",
                  w->worker, sv->index);
    free(w);
  }
  while (fail) {
    waiter *w = fail;
    fail = w->next;
    ps_shard_stats st;
    ps_shard_stats_get(sv->shard, &st);
    if (sv->job.mode_kind == PS_MODE_SYNC)
      rpc_call_fail(w->call, RPC_ABORTED,
                    "shard %d: waited %" PRId64 " ms for step %" PRIu64
                    " to be applied; %d of %d gradients are in (live workers %d, backup %d)",
                    sv->index, now - w->since_ms, w->min_version - 1, st.sync_pending,
                    ps_membership_count(sv->members) - sv->job.backup_workers,
                    ps_membership_count(sv->members), sv->job.backup_workers);
    else
      rpc_call_fail(w->call, RPC_ABORTED,
                    "shard %d: waited %" PRId64 " ms for the slowest worker to come within %d "
                    "steps of worker %016" PRIx64,
                    sv->index, now - w->since_ms, sv->job.ssp_k, w->worker);
    free(w);
  }
}

static void handle_pull(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__PullRequest *r = (Ps__PullRequest *)decode_request(call, req, &ps__pull_request__descriptor,
                                                         &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Pull", 1, UINT64_MAX) == 0) {
    int known = 1, ready;
    waiter *w = NULL;
    pthread_mutex_lock(&sv->wait_mu);
    ready = pull_ready(sv, r->header->worker_id, r->min_version, &known);
    if (!ready && known) {
      w = calloc(1, sizeof *w);
      if (w) {
        w->call = call;
        w->worker = r->header->worker_id;
        w->min_version = r->min_version;
        w->offset = r->offset;
        w->count = r->count;
        w->since_ms = ps_now_ms();
        w->deadline_ms = w->since_ms + sv->job.wait_timeout_ms;
        w->next = sv->waiters;
        sv->waiters = w;
        sv->n_waiting++;
        sv->waits++;
      }
    }
    pthread_mutex_unlock(&sv->wait_mu);
    if (ready)
      serve_pull(sv, call, r->offset, r->count);
    else if (!known)
      rpc_call_fail(call, RPC_NOT_FOUND, "worker %016" PRIx64 " is not registered with shard %d",
                    r->header->worker_id, sv->index);
    else if (!w)
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

/* sync: applies the current step if enough gradients are in; releases the
 * pulls waiting for it. */
static void sync_try_step(server *sv) {
  int live = ps_membership_count(sv->members);
  /* Steps start once the job's min_workers are in, so that the first to
   * register does not run the first steps alone; after that the quorum
   * follows the live workers (a dead one does not hold the others). */
  pthread_mutex_lock(&sv->wait_mu);
  if (!sv->sync_started && live >= sv->job.min_workers) {
    sv->sync_started = 1;
    PS_INFO("sync: %d workers registered (min_workers %d): steps begin", live,
            sv->job.min_workers);
  }
  int started = sv->sync_started;
  pthread_mutex_unlock(&sv->wait_mu);
  if (!started) return;
  int quorum = live - sv->job.backup_workers;
  char err[PS_ERRLEN];
  uint64_t v = 0;
  int rc = ps_shard_sync_try_apply(sv->shard, quorum < 1 ? 1 : quorum, &v, err);
  if (rc < 0) PS_ERROR("cannot apply the step: %s", err);
  if (rc == 1) {
    PS_DEBUG("sync: step applied (quorum %d of %d live): version %" PRIu64, quorum, live, v);
    recheck_waiters(sv);
  }
}

static void handle_push(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__PushRequest *r = (Ps__PushRequest *)decode_request(call, req, &ps__push_request__descriptor,
                                                         &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Push", 1, UINT64_MAX) == 0) {
    char err[PS_ERRLEN];
    uint64_t version = 0, staleness = 0;
    double t0 = ps_now_s();
    int dropped = 0, have = 0, rc;
    if (sv->job.mode_kind == PS_MODE_SYNC) {
      rc = ps_shard_sync_add(sv->shard, r->header->worker_id, r->base_version, r->offset,
                             r->count, &tensor, &dropped, &have, err);
      if (rc == 0) {
        ps_shard_stats st;
        ps_shard_stats_get(sv->shard, &st);
        version = st.version;
        if (dropped)
          PS_DEBUG("dropped a late gradient of step %" PRIu64 " from worker %016" PRIx64
                   " (step %" PRIu64 " is under way)",
                   r->base_version, r->header->worker_id, version);
      }
    } else {
      rc = ps_shard_push(sv->shard, r->base_version, r->offset, r->count, &tensor, &version,
                         &staleness, err);
    }
    PS_DEBUG("push of %" PRIu64 " values (step %" PRIu64 ", base version %" PRIu64
             ") from worker %016" PRIx64 " in %d slices: %s in %.2f ms (%d in this step)",
             r->count, r->step, r->base_version, r->header->worker_id, req->nsegs,
             dropped ? "dropped" : "taken", (ps_now_s() - t0) * 1e3, have);
    if (rc != 0) {
      PS_WARN("push from worker %016" PRIx64 " refused: %s", r->header->worker_id, err);
      rpc_call_fail(call, rc == PS_ERANGE ? RPC_OUT_OF_RANGE : RPC_INVALID_ARGUMENT, "%s", err);
    } else {
      ps_membership_note_push(sv->members, r->header->worker_id, r->step, ps_now_ms());
      Ps__PushResponse resp = PS__PUSH_RESPONSE__INIT;
      resp.version = version;
      resp.staleness = staleness;
      resp.dropped = dropped;
      reply_small(call, &resp.base);
      if (sv->job.mode_kind == PS_MODE_SYNC)
        sync_try_step(sv);
      else if (sv->job.mode_kind == PS_MODE_SSP)
        recheck_waiters(sv); /* a clock moved */
    }
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

static void handle_status(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__StatusRequest *r = (Ps__StatusRequest *)decode_request(
      call, req, &ps__status_request__descriptor, &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Status", 0, 0) == 0) {
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
    resp.dropped = st.dropped;
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
        lep[ne] = &le[ne];
        ne++;
      }
      resp.n_lease_epochs = (size_t)ne;
      resp.lease_epochs = lep;
    }
    enum { MAXW = 1024 };
    ps_member *mem = calloc(MAXW, sizeof *mem);
    Ps__WorkerInfo *wi = calloc(MAXW, sizeof *wi);
    Ps__WorkerInfo **wp = calloc(MAXW, sizeof *wp);
    if (!mem || !wi || !wp) {
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    } else {
      int n = ps_membership_list(sv->members, mem, MAXW);
      int64_t now = ps_now_ms();
      for (int i = 0; i < n; i++) {
        ps__worker_info__init(&wi[i]);
        wi[i].worker_id = mem[i].id;
        wi[i].host = mem[i].host;
        wi[i].role = mem[i].role;
        wi[i].task_index = mem[i].task_index;
        wi[i].step = mem[i].step;
        wi[i].pushes = mem[i].pushes;
        wi[i].ms_since_seen = (uint64_t)(now - mem[i].last_seen_ms);
        wi[i].clock = mem[i].clock;
        wp[i] = &wi[i];
      }
      resp.n_workers = (size_t)n;
      resp.workers = wp;
      reply_small(call, &resp.base);
    }
    free(mem);
    free(wi);
    free(wp);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

static void handle_lease(rpc_call *call, const ps_segview *req, void *user) {
  server *sv = user;
  ps_seg *tsegs;
  ps_segview tensor;
  Ps__LeaseRequest *r = (Ps__LeaseRequest *)decode_request(
      call, req, &ps__lease_request__descriptor, &tsegs, &tensor);
  if (!r) return;
  if (check_header(sv, call, r->header, "Lease", 1, UINT64_MAX) != 0) goto done;
  if (sv->index != 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION, "data leases come from shard 0, this is shard %d",
                  sv->index);
    goto done;
  }
  if (sv->job.lease_chunk <= 0) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "job '%s' does not lease its data (lease_chunk is 0)", sv->job.job_id);
    goto done;
  }
  pthread_mutex_lock(&sv->lease_mu);
  if (!sv->leases && r->dataset_size > 0) {
    ps_lease_config cfg = {.n_examples = r->dataset_size,
                           .chunk_size = (uint32_t)sv->job.lease_chunk,
                           .epochs = (uint32_t)sv->job.epochs,
                           .seed = sv->job.seed,
                           .max_per_worker = 2};
    char err[PS_ERRLEN];
    sv->leases = ps_leases_create(&cfg, err);
    if (!sv->leases) {
      pthread_mutex_unlock(&sv->lease_mu);
      rpc_call_fail(call, RPC_INVALID_ARGUMENT, "cannot lease %" PRIu64 " examples: %s",
                    r->dataset_size, err);
      goto done;
    }
    PS_INFO("leases: %" PRIu64 " examples in chunks of %d, %d epoch(s)", r->dataset_size,
            sv->job.lease_chunk, sv->job.epochs);
  }
  ps_leases *t = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (!t) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT, "the first Lease request must give dataset_size");
    goto done;
  }
  ps_lease_stats st;
  ps_leases_stats(t, &st);
  if (r->dataset_size && r->dataset_size != st.config.n_examples) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "this worker's data set has %" PRIu64 " training examples, the lease table %" PRIu64,
                  r->dataset_size, st.config.n_examples);
    goto done;
  }
  uint64_t wid = r->header->worker_id;
  int64_t now = ps_now_ms();
  Ps__LeaseResponse resp = PS__LEASE_RESPONSE__INIT;
  if (r->complete_lease) {
    int rc = ps_leases_complete(t, wid, r->complete_lease, now);
    resp.completed_counted = rc == PS_OK;
    if (rc != PS_OK)
      PS_INFO("lease %" PRIx64 " of worker %016" PRIx64 " finished but not counted: %s",
              r->complete_lease, wid, ps_leases_strerror(rc));
  }
  resp.status = 1;
  if (r->want_next) {
    ps_lease l;
    int rc = ps_leases_acquire(t, wid, now, &l);
    if (rc == PS_OK) {
      resp.status = 0;
      resp.lease_id = l.lease_id;
      resp.epoch = l.epoch;
      resp.chunk = l.chunk;
      resp.begin = l.begin;
      resp.count = l.count;
    } else if (rc == PS_LEASE_FINISHED) {
      resp.status = 2;
    } else if (rc < 0) {
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "lease: %s", ps_leases_strerror(rc));
      goto done;
    } /* WAIT and FULL: ask again later */
  }
  reply_small(call, &resp.base);
done:
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(tsegs);
}

/* Gives the data a departed worker held back to the others. */
static void release_leases(server *sv, uint64_t worker) {
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *t = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (!t) return;
  int n = ps_leases_release_worker(t, worker);
  if (n > 0) PS_INFO("leases: %d chunk(s) of worker %016" PRIx64 " back in the pool", n, worker);
}

/* ---------------- the loop (main thread) ---------------- */

static void on_sweep(uv_timer_t *t) {
  server *sv = t->data;
  uint64_t dropped[64];
  int n = ps_membership_sweep(sv->members, ps_now_ms(), sv->job.heartbeat_timeout_ms, dropped, 64);
  for (int i = 0; i < n && i < 64; i++) {
    PS_WARN("worker %016" PRIx64 " silent for more than %d ms: dropped; %d live", dropped[i],
            sv->job.heartbeat_timeout_ms, ps_membership_count(sv->members));
    release_leases(sv, dropped[i]);
  }
  pthread_mutex_lock(&sv->lease_mu);
  if (sv->leases) {
    int e = ps_leases_expire(sv->leases, ps_now_ms(), 2 * (int64_t)sv->job.heartbeat_timeout_ms);
    if (e > 0) PS_WARN("leases: %d chunk(s) not renewed in time: back in the pool", e);
  }
  pthread_mutex_unlock(&sv->lease_mu);
  if (n > 0 && sv->job.mode_kind == PS_MODE_SYNC) sync_try_step(sv);
  recheck_waiters(sv); /* deadlines, and pulls the dropped workers held back */
}

static void on_report(uv_timer_t *t) {
  server *sv = t->data;
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  double now = ps_now_s(), dt = now - sv->last_report_s;
  if (dt <= 0) dt = 1e-9;
  double push_rate = (double)(st.pushes - sv->last_pushes) / dt;
  double pull_rate = (double)(st.pulls - sv->last_pulls) / dt;
  int live = ps_membership_count(sv->members);
  if (st.pushes != sv->last_pushes || st.pulls != sv->last_pulls)
    PS_INFO("version %" PRIu64 " | %.1f pushes/s %.1f pulls/s | staleness mean %.2f max %" PRIu64
            " | %d workers | %" PRIu64 " refused | %" PRIu64 " dropped | %.1f ms/step",
            st.version, push_rate, pull_rate, st.staleness_mean, st.staleness_max, live,
            st.rejected, st.dropped, st.step_time_ms);
  if (sv->metrics) {
    json_t *rec = json_object();
    json_object_set_new(rec, "shard", json_integer(sv->index));
    json_object_set_new(rec, "version", json_integer((json_int_t)st.version));
    json_object_set_new(rec, "pushes", json_integer((json_int_t)st.pushes));
    json_object_set_new(rec, "pulls", json_integer((json_int_t)st.pulls));
    json_object_set_new(rec, "rejected", json_integer((json_int_t)st.rejected));
    json_object_set_new(rec, "pushes_per_sec", json_real(push_rate));
    json_object_set_new(rec, "staleness_mean", json_real(st.staleness_mean));
    json_object_set_new(rec, "staleness_max", json_integer((json_int_t)st.staleness_max));
    json_t *hist = json_array();
    int last = PS_STALENESS_BUCKETS - 1;
    while (last > 0 && st.staleness_hist[last] == 0) last--;
    for (int i = 0; i <= last; i++)
      json_array_append_new(hist, json_integer((json_int_t)st.staleness_hist[i]));
    json_object_set_new(rec, "staleness_hist", hist);
    json_object_set_new(rec, "workers", json_integer(live));
    json_object_set_new(rec, "dropped", json_integer((json_int_t)st.dropped));
    json_object_set_new(rec, "step_time_ms", json_real(st.step_time_ms));
    pthread_mutex_lock(&sv->wait_mu);
    uint64_t done = sv->waits - (uint64_t)sv->n_waiting;
    json_object_set_new(rec, "waits", json_integer((json_int_t)sv->waits));
    json_object_set_new(rec, "wait_ms_mean", json_real(done ? sv->wait_ms_total / (double)done : 0));
    json_object_set_new(rec, "ssp_max_lead", json_integer((json_int_t)sv->ssp_max_lead));
    pthread_mutex_unlock(&sv->wait_mu);
    ps_metrics_write(sv->metrics, rec);
    json_decref(rec);
  }
  sv->last_pushes = st.pushes;
  sv->last_pulls = st.pulls;
  sv->last_report_s = now;
}

static void on_signal(uv_signal_t *s, int signum) {
  server *sv = s->data;
  PS_INFO("%s: stopping", signum == SIGINT ? "SIGINT" : "SIGTERM");
  uv_stop(&sv->loop);
}

/* ---------------- checkpoints ---------------- */

/* A consistent copy of the shard's state, ready for ps_ckpt_write; the
 * arrays are freed by ckpt_state_free. */
static int ckpt_capture(server *sv, ps_ckpt *ck) {
  memset(ck, 0, sizeof *ck);
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  ck->n_slots = ps_shard_n_slots(sv->shard);
  ck->params = ps_alloc((n ? n : 1) * sizeof(float));
  int ok = ck->params != NULL;
  for (int k = 0; k < ck->n_slots; k++) {
    ck->slots[k] = ps_alloc((n ? n : 1) * sizeof(float));
    ok = ok && ck->slots[k];
  }
  if (!ok) return PS_ENOMEM;
  ps_shard_export_state(sv->shard, ck->params, ck->slots, &ck->meta.version);
  ck->meta.index = sv->index;
  ck->meta.num_shards = sv->cluster.n_ps;
  ck->meta.P = sv->job.model.n_params;
  ck->meta.begin = ps_shard_begin(sv->shard);
  ck->meta.end = ps_shard_end(sv->shard);
  snprintf(ck->meta.optimizer, sizeof ck->meta.optimizer, "%s", ps_shard_optimizer(sv->shard));
  snprintf(ck->meta.job_id, sizeof ck->meta.job_id, "%s", sv->job.job_id);
  /* Shard 0 keeps the data-lease state with its parameters. */
  pthread_mutex_lock(&sv->lease_mu);
  int rc = sv->leases ? ps_leases_save(sv->leases, &ck->extra, &ck->extra_len) : PS_OK;
  pthread_mutex_unlock(&sv->lease_mu);
  return rc;
}

static void ckpt_state_free(ps_ckpt *ck) {
  ps_free(ck->params);
  for (int k = 0; k < PS_CKPT_MAX_SLOTS; k++) ps_free(ck->slots[k]);
  free(ck->extra);
  memset(ck, 0, sizeof *ck);
}

/* Writes a checkpoint now, on the calling thread. */
static int ckpt_write_now(server *sv) {
  ps_ckpt ck;
  char path[PS_CKPT_PATHLEN], err[PS_ERRLEN];
  double t0 = ps_now_s();
  int rc = ckpt_capture(sv, &ck);
  if (rc == 0) rc = ps_ckpt_write(sv->ckpt_dir, &ck, sv->ckpt_keep, path, err);
  else snprintf(err, sizeof err, "out of memory for the checkpoint's copy");
  if (rc == 0)
    PS_INFO("checkpoint: version %" PRIu64 " written to %s (%.0f ms)", ck.meta.version, path,
            (ps_now_s() - t0) * 1e3);
  else
    PS_ERROR("checkpoint failed: %s", err);
  ckpt_state_free(&ck);
  return rc;
}

static void ckpt_run(uv_work_t *req) {
  server *sv = req->data;
  sv->ckpt_rc = ps_ckpt_write(sv->ckpt_dir, &sv->ckpt_state, sv->ckpt_keep, sv->ckpt_path,
                              sv->ckpt_err);
}

static void ckpt_done(uv_work_t *req, int status) {
  server *sv = req->data;
  if (sv->ckpt_rc == 0)
    PS_INFO("checkpoint: version %" PRIu64 " written to %s", sv->ckpt_state.meta.version,
            sv->ckpt_path);
  else
    PS_ERROR("checkpoint failed: %s", sv->ckpt_err);
  ckpt_state_free(&sv->ckpt_state);
  sv->ckpt_busy = 0;
}

/* Every second: is a checkpoint due (by time or by updates)? The copy is
 * taken here (a few memcpy), the writing and fsyncs run on the work queue
 * so that the loop never blocks on the disk. */
static void on_ckpt_timer(uv_timer_t *t) {
  server *sv = t->data;
  if (sv->ckpt_busy) return;
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  double now = ps_now_s();
  int due = (sv->ckpt_secs > 0 && now - sv->ckpt_last_s >= sv->ckpt_secs) ||
            (sv->ckpt_updates > 0 && st.version - sv->ckpt_last_version >= sv->ckpt_updates);
  if (!due || st.version == sv->ckpt_last_version) return;
  if (ckpt_capture(sv, &sv->ckpt_state) != 0) {
    PS_ERROR("checkpoint: out of memory for the copy");
    ckpt_state_free(&sv->ckpt_state);
    return;
  }
  sv->ckpt_busy = 1;
  sv->ckpt_last_s = now;
  sv->ckpt_last_version = sv->ckpt_state.meta.version;
  sv->ckpt_work.data = sv;
  uv_queue_work(&sv->loop, &sv->ckpt_work, ckpt_run, ckpt_done);
}

/* Restores the shard from the newest valid checkpoints of the job in the
 * directory (whatever number of shards wrote them). 0 also when there is
 * none (a fresh start); an error when there are some but none is usable. */
static int ckpt_restore(server *sv, char *err) {
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  int n_slots = ps_shard_n_slots(sv->shard);
  float *params = ps_alloc((n ? n : 1) * sizeof(float));
  float *slots[PS_CKPT_MAX_SLOTS] = {0};
  int ok = params != NULL;
  for (int k = 0; k < n_slots; k++) ok = ok && (slots[k] = ps_alloc((n ? n : 1) * sizeof(float)));
  int rc = PS_ENOMEM;
  if (!ok) {
    snprintf(err, PS_ERRLEN, "out of memory restoring the checkpoint");
  } else {
    ps_ckpt_source src = {.dir = sv->ckpt_dir,
                          .job_id = sv->job.job_id,
                          .P = sv->job.model.n_params,
                          .optimizer = ps_shard_optimizer(sv->shard)};
    ps_ckpt_restored got;
    rc = ps_ckpt_load_range(&src, ps_shard_begin(sv->shard), ps_shard_end(sv->shard), params,
                            slots, n_slots, sv->index == 0, &got, err);
    if (rc == PS_ENOTFOUND) {
      PS_INFO("checkpoint: none of job '%s' in %s: starting from the initial parameters",
              sv->job.job_id, sv->ckpt_dir);
      rc = 0;
    } else if (rc == 0) {
      ps_shard_restore_state(sv->shard, params, slots, got.version);
      sv->ckpt_last_version = got.version;
      PS_INFO("checkpoint: restored [%zu, %zu) at version %" PRIu64 " from %d file(s) written by "
              "%d shard(s)",
              ps_shard_begin(sv->shard), ps_shard_end(sv->shard), got.version, got.files_used,
              got.num_shards);
      if (got.extra && sv->job.lease_chunk > 0) {
        sv->leases = ps_leases_load(got.extra, got.extra_len, err);
        if (!sv->leases) {
          free(got.extra);
          rc = PS_EINVAL;
          goto out;
        }
        ps_lease_stats ls;
        ps_leases_stats(sv->leases, &ls);
        PS_INFO("checkpoint: data leases restored: epoch %u, %u of %u chunks done (leases "
                "outstanding at the checkpoint go back to the pool)",
                ls.epoch, ls.chunks_done, ls.chunks);
      }
      free(got.extra);
    }
  }
out:
  ps_free(params);
  for (int k = 0; k < PS_CKPT_MAX_SLOTS; k++) ps_free(slots[k]);
  return rc;
}

/* ---------------- status client ---------------- */

static int print_status(const char *addr, int timeout_ms) {
  char err[PS_ERRLEN];
  rpc_global_init();
  rpc_channel *ch = rpc_channel_create(addr, NULL, err);
  rpc_queue *q = rpc_queue_create();
  int rc = 1;
  if (!ch || !q) {
    fprintf(stderr, "ps-server: %s\n", ch ? "cannot create a queue" : err);
    goto out;
  }
  Ps__RequestHeader h = PS__REQUEST_HEADER__INIT;
  h.protocol_version = PS_PROTOCOL_VERSION;
  h.job_id = "";
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  rpc_msg msg;
  if (wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) != 0) goto out;
  uint8_t *buf = NULL;
  size_t len = 0;
  int st = rpc_call_sync(q, ch, "/ps.ParameterServer/Status", &msg, timeout_ms, 1, &buf, &len, err);
  if (st != RPC_OK) {
    fprintf(stderr, "ps-server: Status from %s: %s: %s\n", addr, rpc_status_name(st), err);
    goto out;
  }
  Ps__StatusResponse *r = ps__status_response__unpack(NULL, len, buf);
  free(buf);
  if (!r) {
    fprintf(stderr, "ps-server: malformed Status reply from %s\n", addr);
    goto out;
  }
  json_t *o = json_object();
  json_object_set_new(o, "shard", json_integer(r->shard_index));
  json_object_set_new(o, "num_shards", json_integer(r->num_shards));
  json_object_set_new(o, "job_id", json_string(r->job_id ? r->job_id : ""));
  json_object_set_new(o, "mode", json_string(r->mode ? r->mode : ""));
  json_object_set_new(o, "range", json_pack("[I,I]", (json_int_t)r->range_offset,
                                            (json_int_t)(r->range_offset + r->range_count)));
  json_object_set_new(o, "version", json_integer((json_int_t)r->version));
  json_object_set_new(o, "pushes", json_integer((json_int_t)r->pushes));
  json_object_set_new(o, "pulls", json_integer((json_int_t)r->pulls));
  json_object_set_new(o, "rejected", json_integer((json_int_t)r->rejected));
  json_object_set_new(o, "staleness_mean", json_real(r->staleness_mean));
  json_object_set_new(o, "staleness_max", json_integer((json_int_t)r->staleness_max));
  json_t *hist = json_array();
  for (size_t i = 0; i < r->n_staleness_hist; i++)
    json_array_append_new(hist, json_integer((json_int_t)r->staleness_hist[i]));
  json_object_set_new(o, "staleness_hist", hist);
  json_object_set_new(o, "workers_dropped", json_integer((json_int_t)r->workers_dropped));
  json_object_set_new(o, "live_workers", json_integer(r->live_workers));
  json_object_set_new(o, "dropped", json_integer((json_int_t)r->dropped));
  json_object_set_new(o, "waits", json_integer((json_int_t)r->waits));
  json_object_set_new(o, "wait_ms_mean", json_real(r->wait_ms_mean));
  json_object_set_new(o, "waiting_now", json_integer(r->waiting_now));
  json_object_set_new(o, "step_time_ms", json_real(r->step_time_ms));
  json_object_set_new(o, "ssp_max_lead", json_integer((json_int_t)r->ssp_max_lead));
  json_object_set_new(o, "backup_workers", json_integer(r->backup_workers));
  json_object_set_new(o, "sync_pending", json_integer(r->sync_pending));
  json_object_set_new(o, "uptime_s", json_real(r->uptime_s));
  json_t *ws = json_array();
  for (size_t i = 0; i < r->n_workers; i++) {
    Ps__WorkerInfo *w = r->workers[i];
    char id[32];
    snprintf(id, sizeof id, "%016" PRIx64, w->worker_id);
    json_array_append_new(
        ws, json_pack("{s:s,s:s,s:s,s:i,s:I,s:I,s:I,s:I}", "id", id, "host",
                      w->host ? w->host : "", "role", w->role ? w->role : "", "task_index",
                      w->task_index, "step", (json_int_t)w->step, "pushes", (json_int_t)w->pushes,
                      "clock", (json_int_t)w->clock, "ms_since_seen",
                      (json_int_t)w->ms_since_seen));
  }
  json_object_set_new(o, "workers", ws);
  json_t *eps = json_array();
  for (size_t i = 0; i < r->n_lease_epochs; i++) {
    Ps__LeaseEpoch *e = r->lease_epochs[i];
    json_array_append_new(
        eps, json_pack("{s:i,s:b,s:i,s:i,s:i,s:I,s:I,s:I,s:I}", "epoch", (int)e->epoch, "finished",
                       (int)e->finished, "chunks", (int)e->chunks, "chunks_completed",
                       (int)e->chunks_completed, "chunks_once", (int)e->chunks_once,
                       "examples_completed", (json_int_t)e->examples_completed,
                       "examples_handed_out", (json_int_t)e->examples_handed_out,
                       "examples_rehanded", (json_int_t)e->examples_rehanded, "reclaims",
                       (json_int_t)e->reclaims));
  }
  json_object_set_new(o, "lease_epochs", eps);
  char *text = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
  printf("%s\n", text);
  free(text);
  json_decref(o);
  ps__status_response__free_unpacked(r, NULL);
  rc = 0;
out:
  if (q) rpc_queue_destroy(q);
  if (ch) rpc_channel_destroy(ch);
  rpc_global_shutdown();
  return rc;
}

/* ---------------- main ---------------- */

static void usage(FILE *f) {
  fprintf(f,
          "Usage: ps-server --job FILE (--ps HOST:PORT,... --index N | TF_CONFIG) [options]\n"
          "       ps-server --status HOST:PORT\n"
          "\n"
          "Serves shard N of the model's parameters to ps-worker processes.\n"
          "\n"
          "  --job FILE           job file (JSON: model, optimizer, data set, ...)\n"
          "  --ps LIST            addresses of all shards, comma-separated, in shard order\n"
          "  --index N            which shard this process is (0-based)\n"
          "                       (without --ps/--index: TF_CONFIG, task type \"ps\")\n"
          "  --listen ADDR        address to bind (default: this shard's entry in the list;\n"
          "                       use 0.0.0.0:PORT to accept connections on every interface)\n"
          "  --threads N          threads serving requests (default 2)\n"
          "  --checkpoint-dir DIR restore from the newest valid checkpoints there at start\n"
          "                       (any number of shards may have written them), write\n"
          "                       checkpoints there while running and on SIGTERM/SIGINT\n"
          "  --checkpoint-secs N  write one every N seconds (default 30; 0: not by time)\n"
          "  --checkpoint-updates N  ... or every N updates (default 0: not by count)\n"
          "  --keep-checkpoints K keep the newest K of this shard (default 3)\n"
          "  --metrics FILE       append JSON Lines metrics (version, pushes, staleness)\n"
          "  --log-interval SEC   seconds between progress lines and metrics (default 5)\n"
          "  --log-level LEVEL    debug, info, warn or error (default info)\n"
          "  --status ADDR        print the Status of the shard at ADDR as JSON and exit\n"
          "  --help               this text\n");
}

int main(int argc, char **argv) {
  const char *job_path = NULL, *ps_list = NULL, *listen_addr = NULL, *metrics_path = NULL;
  const char *status_addr = NULL;
  int index = -1, threads = 2, level = PS_LOG_INFO;
  double log_interval = 5.0, ckpt_secs = 30.0;
  const char *ckpt_dir = NULL;
  uint64_t ckpt_updates = 0;
  int ckpt_keep = 3;
  static const struct option opts[] = {
      {"job", required_argument, 0, 'j'},       {"ps", required_argument, 0, 'p'},
      {"index", required_argument, 0, 'i'},     {"listen", required_argument, 0, 'l'},
      {"threads", required_argument, 0, 't'},   {"metrics", required_argument, 0, 'm'},
      {"log-interval", required_argument, 0, 'L'}, {"log-level", required_argument, 0, 'v'},
      {"status", required_argument, 0, 's'},    {"help", no_argument, 0, 'h'},
      {"checkpoint-dir", required_argument, 0, 'C'}, {"checkpoint-secs", required_argument, 0, 'T'},
      {"checkpoint-updates", required_argument, 0, 'U'},
      {"keep-checkpoints", required_argument, 0, 'K'},
      {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    char *end = NULL;
    switch (c) {
      case 'j': job_path = optarg; break;
      case 'p': ps_list = optarg; break;
      case 'i':
        index = (int)strtol(optarg, &end, 10);
        if (*end || index < 0) {
          fprintf(stderr, "ps-server: --index wants a shard number >= 0, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'l': listen_addr = optarg; break;
      case 't':
        threads = (int)strtol(optarg, &end, 10);
        if (*end || threads < 1 || threads > 64) {
          fprintf(stderr, "ps-server: --threads wants 1..64, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'm': metrics_path = optarg; break;
      case 'L':
        log_interval = strtod(optarg, &end);
        if (*end || !(log_interval > 0)) {
          fprintf(stderr, "ps-server: --log-interval wants seconds > 0, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'v':
        level = ps_log_level_parse(optarg);
        if (level < 0) {
          fprintf(stderr, "ps-server: --log-level wants debug, info, warn or error\n");
          return 2;
        }
        break;
      case 's': status_addr = optarg; break;
      case 'C': ckpt_dir = optarg; break;
      case 'T':
        ckpt_secs = strtod(optarg, &end);
        if (*end || !(ckpt_secs >= 0)) {
          fprintf(stderr, "ps-server: --checkpoint-secs wants seconds >= 0, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'U': {
        long long u = strtoll(optarg, &end, 10);
        if (*end || u < 0) {
          fprintf(stderr, "ps-server: --checkpoint-updates wants a count >= 0, not '%s'\n",
                  optarg);
          return 2;
        }
        ckpt_updates = (uint64_t)u;
        break;
      }
      case 'K':
        ckpt_keep = (int)strtol(optarg, &end, 10);
        if (*end || ckpt_keep < 1 || ckpt_keep > 1000) {
          fprintf(stderr, "ps-server: --keep-checkpoints wants 1..1000, not '%s'\n", optarg);
          return 2;
        }
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "ps-server: unexpected argument '%s' (see --help)\n", argv[optind]);
    return 2;
  }
  if (status_addr) return print_status(status_addr, 10000);

  static server sv;
  char err[PS_ERRLEN];
  if (!job_path) {
    fprintf(stderr, "ps-server: --job FILE is required (see --help)\n");
    return 2;
  }
  if (ps_list) {
    if (ps_cluster_parse_ps_list(ps_list, &sv.cluster, err) != 0) {
      fprintf(stderr, "ps-server: --ps: %s\n", err);
      return 2;
    }
    if (index < 0) {
      fprintf(stderr, "ps-server: --index is required with --ps\n");
      return 2;
    }
  } else if (getenv("TF_CONFIG")) {
    if (ps_cluster_from_tf_config(getenv("TF_CONFIG"), &sv.cluster, err) != 0) {
      fprintf(stderr, "ps-server: TF_CONFIG: %s\n", err);
      return 2;
    }
    if (strcmp(sv.cluster.task_type, "ps") != 0) {
      fprintf(stderr, "ps-server: TF_CONFIG names task type '%s'; ps-server runs task type 'ps'\n",
              sv.cluster.task_type);
      return 2;
    }
    if (index < 0) index = sv.cluster.task_index;
  } else {
    fprintf(stderr, "ps-server: give --ps LIST --index N, or set TF_CONFIG (see --help)\n");
    return 2;
  }
  if (index >= sv.cluster.n_ps) {
    fprintf(stderr, "ps-server: index %d is outside the %d shards given\n", index,
            sv.cluster.n_ps);
    return 2;
  }
  sv.index = index;
  char prog[32];
  snprintf(prog, sizeof prog, "ps-server[%d]", index);
  ps_log_init(prog, level);

  if (ps_job_load(job_path, &sv.job, &sv.job_text, err) != 0) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 2;
  }
  sv.shard = ps_shard_create(&sv.job, index, sv.cluster.n_ps, err);
  if (!sv.shard) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  sv.members = ps_membership_create();
  pthread_mutex_init(&sv.wait_mu, NULL);
  pthread_mutex_init(&sv.lease_mu, NULL);
  if (metrics_path) {
    sv.metrics = ps_metrics_open(metrics_path, err);
    if (!sv.metrics) {
      fprintf(stderr, "ps-server: %s\n", err);
      return 2;
    }
  }
  char desc[512];
  ps_model_spec_describe(&sv.job.model, desc, sizeof desc);
  PS_INFO("job '%s': %s", sv.job.job_id, desc);
  if (ckpt_dir) {
    sv.ckpt_dir = ckpt_dir;
    sv.ckpt_secs = ckpt_secs;
    sv.ckpt_updates = ckpt_updates;
    sv.ckpt_keep = ckpt_keep;
    if (ckpt_restore(&sv, err) != 0) {
      fprintf(stderr, "ps-server: %s\n", err);
      return 1;
    }
  }
  PS_INFO("shard %d of %d holds [%zu, %zu) (%zu values, %.1f MB), optimizer %s lr %g, mode %s",
          index, sv.cluster.n_ps, ps_shard_begin(sv.shard), ps_shard_end(sv.shard),
          ps_shard_end(sv.shard) - ps_shard_begin(sv.shard),
          (ps_shard_end(sv.shard) - ps_shard_begin(sv.shard)) * 4.0 / 1e6, sv.job.optim.name,
          (double)sv.job.optim.lr, sv.job.mode);

  /* libuv first: its loop and signal handlers do not use gRPC. */
  uv_loop_init(&sv.loop);
  rpc_global_init();
  const char *addr = listen_addr ? listen_addr : sv.cluster.ps[index];
  rpc_server_opts so = {.threads = threads};
  int port = 0;
  sv.rpc = rpc_server_create(addr, &so, &port, err);
  if (!sv.rpc) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Register", handle_register, &sv);
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Heartbeat", handle_heartbeat, &sv);
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Leave", handle_leave, &sv);
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Pull", handle_pull, &sv);
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Push", handle_push, &sv);
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Status", handle_status, &sv);
  rpc_server_add_method(sv.rpc, "/ps.ParameterServer/Lease", handle_lease, &sv);
  if (rpc_server_start(sv.rpc, err) != 0) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  sv.start_s = sv.last_report_s = ps_now_s();
  sv.log_interval_s = log_interval;
  PS_INFO("listening on %s (port %d), %d threads", addr, port, threads);

  uv_timer_init(&sv.loop, &sv.sweep_timer);
  sv.sweep_timer.data = &sv;
  int sweep_ms = sv.job.heartbeat_timeout_ms / 4 > 0 ? sv.job.heartbeat_timeout_ms / 4 : 1;
  uv_timer_start(&sv.sweep_timer, on_sweep, (uint64_t)sweep_ms, (uint64_t)sweep_ms);
  uv_timer_init(&sv.loop, &sv.report_timer);
  sv.report_timer.data = &sv;
  uint64_t rep_ms = (uint64_t)(log_interval * 1000);
  uv_timer_start(&sv.report_timer, on_report, rep_ms, rep_ms);
  if (sv.ckpt_dir) {
    uv_timer_init(&sv.loop, &sv.ckpt_timer);
    sv.ckpt_timer.data = &sv;
    sv.ckpt_last_s = ps_now_s();
    uv_timer_start(&sv.ckpt_timer, on_ckpt_timer, 1000, 1000);
  }
  uv_signal_init(&sv.loop, &sv.sigint);
  sv.sigint.data = &sv;
  uv_signal_start(&sv.sigint, on_signal, SIGINT);
  uv_signal_init(&sv.loop, &sv.sigterm);
  sv.sigterm.data = &sv;
  uv_signal_start(&sv.sigterm, on_signal, SIGTERM);

  uv_run(&sv.loop, UV_RUN_DEFAULT);

  on_report(&sv.report_timer);
  rpc_server_shutdown(sv.rpc); /* answers the waiting pulls CANCELLED */
  rpc_server_destroy(sv.rpc);
  while (sv.waiters) {
    waiter *w = sv.waiters;
    sv.waiters = w->next;
    free(w);
  }
  uv_close((uv_handle_t *)&sv.sweep_timer, NULL);
  uv_close((uv_handle_t *)&sv.report_timer, NULL);
  uv_close((uv_handle_t *)&sv.sigint, NULL);
  uv_close((uv_handle_t *)&sv.sigterm, NULL);
  if (sv.ckpt_dir) uv_close((uv_handle_t *)&sv.ckpt_timer, NULL);
  uv_run(&sv.loop, UV_RUN_DEFAULT); /* also finishes a checkpoint under way */
  /* No more updates can come: the final checkpoint holds everything applied. */
  int exit_code = 0;
  if (sv.ckpt_dir && ckpt_write_now(&sv) != 0) exit_code = 1;
  uv_loop_close(&sv.loop);
  ps_shard_destroy(sv.shard);
  ps_leases_destroy(sv.leases);
  ps_membership_destroy(sv.members);
  ps_metrics_close(sv.metrics);
  free(sv.job_text);
  rpc_global_shutdown();
  PS_INFO("stopped");
  return exit_code;
}

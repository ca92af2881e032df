/* Updates (update.h): each kind applied to the shard's state, the same
 * way for a worker's call, a timer, a cut's held push and a backup's
 * replay of its primary's log. */
#include "ps/core/update.h"

#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/core/rows.h"
#include "ps/core/server.h"

static void record_epoch(ps_server *sv, ps_leases *t, uint32_t epoch);

size_t ps_update_held_from_msg(Ps__HeldLease *const *msgs, size_t n, ps_lease_held *held) {
  size_t k = 0;
  for (size_t i = 0; i < n && k < PS_HELD_NAMED; i++) {
    const Ps__HeldLease *h = msgs[i];
    held[k++] = (ps_lease_held){.lease_id = h->lease_id,
                                .epoch = h->epoch,
                                .chunk = h->chunk,
                                .finished = h->finished,
                                .trained = h->trained,
                                .refused = h->refused};
  }
  return k;
}

/* A worker registering again names what it did under leases of shard 0's
 * earlier life (its acknowledged completions, the leases it holds): what
 * the restored table lacks is taken back or recorded (ps_leases_rejoin). */
void ps_update_rejoin(ps_server *sv, uint64_t worker, const uint64_t *done, size_t n_done,
                      const ps_lease_held *held, size_t n_held, int quiet) {
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *t = sv->index == 0 ? sv->leases : NULL;
  ps_lease_rejoin r = {0};
  if (t) {
    /* An honest worker names a chunk once per epoch, or a few times
     * (done again after a restart), and holds a few leases: no more names
     * than the table has chunks are looked at. */
    ps_lease_stats st;
    ps_leases_stats(t, &st);
    if (n_done > st.chunks) n_done = st.chunks;
    if (n_held > st.chunks) n_held = st.chunks;
    ps_leases_rejoin(t, worker, done, n_done, held, n_held, ps_now_ms(), &r);
    ps_lease_stats after; /* a chunk taken as done may end the epoch */
    ps_leases_stats(t, &after);
    if (!quiet && (after.epoch != st.epoch || after.finished != st.finished))
      record_epoch(sv, t, st.epoch);
  }
  pthread_mutex_unlock(&sv->lease_mu);
  if (quiet) return;
  if (r.accepted > 0 || r.adopted > 0)
    PS_INFO("worker %016" PRIx64 " registered again: %d chunk(s) (%" PRIu64
            " examples) it finished under this shard's earlier life taken as done, %d lease(s) "
            "it holds taken back",
            worker, r.accepted, r.examples_accepted, r.adopted);
  if (r.redone > 0)
    PS_INFO("worker %016" PRIx64 " registered again: %d chunk(s) (%" PRIu64
            " examples) it completed were lost with this shard's restart and went to other "
            "workers: trained again",
            worker, r.redone, r.examples_redone);
}

/* An epoch of leases just finished: its summary goes to the log and the
 * metrics file, which keep every epoch of a long run (Status keeps the
 * last few). */
static void record_epoch(ps_server *sv, ps_leases *t, uint32_t epoch) {
  ps_lease_epoch_record e;
  if (ps_leases_epoch_record(t, epoch, &e, NULL, 0) < 0) return;
  PS_INFO("leases: epoch %u done in %.1f s: %u chunks, %u completed once, %" PRIu64
          " examples completed, %" PRIu64 " handed out (%" PRIu64 " again after %" PRIu64
          " reclaims), %" PRIu64 " redone after a restart lost their completion, %" PRIu64
          " recovered after a restart, %" PRIu64 " trained under leases not counted, %" PRIu64
          " pushed under leases taken back",
          e.epoch, e.end_ms >= 0 && e.start_ms >= 0 ? (double)(e.end_ms - e.start_ms) / 1e3 : 0.0,
          e.chunks, e.chunks_once, e.examples_completed, e.examples_handed_out, e.examples_rehanded,
          e.reclaims, e.examples_redone, e.examples_recovered, e.examples_wasted,
          e.examples_abandoned);
  if (!sv->metrics) return;
  json_t *rec = json_pack(
      "{s:i,s:i,s:i,s:i,s:i,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "shard", sv->index, "lease_epoch",
      (int)e.epoch, "chunks", (int)e.chunks, "chunks_completed", (int)e.chunks_completed,
      "chunks_once", (int)e.chunks_once, "examples_completed", (json_int_t)e.examples_completed,
      "examples_handed_out", (json_int_t)e.examples_handed_out, "examples_rehanded",
      (json_int_t)e.examples_rehanded, "reclaims", (json_int_t)e.reclaims, "examples_redone",
      (json_int_t)e.examples_redone, "examples_recovered", (json_int_t)e.examples_recovered,
      "examples_wasted", (json_int_t)e.examples_wasted, "examples_abandoned",
      (json_int_t)e.examples_abandoned);
  ps_metrics_write(sv->metrics, rec);
  json_decref(rec);
}

/* Shard 0's Lease call on its table, at time now: makes the table at the
 * first call (dataset_size), counts a completed lease, grants the next;
 * resp gets the answer. RPC_OK, or the status to fail the call with and a
 * message in err. quiet: no log lines or metrics (a backup's replay). */
static int lease_step(ps_server *sv, uint64_t wid, uint64_t dataset_size, uint64_t complete_lease,
                      uint64_t trained, int want_next, int64_t now, Ps__LeaseResponse *resp,
                      int quiet, char *err) {
  pthread_mutex_lock(&sv->lease_mu);
  if (!sv->leases && dataset_size > 0) {
    /* The first lease id from the call's clock (the primary's, which a
     * replicated shard 0's backups replay): every replica hands out the
     * same ids, and a worker's lease is known to the replica that takes
     * over. Seconds in the high half, as a table restored later starts. */
    const uint64_t first = now > 0 ? (uint64_t)(now / 1000) << 32 : 1;
    ps_lease_config cfg = {.n_examples = dataset_size,
                           .chunk_size = (uint32_t)sv->job.lease_chunk,
                           .epochs = (uint32_t)sv->job.epochs,
                           .seed = sv->job.seed,
                           .max_per_worker = 2,
                           .first_id = first};
    char why[PS_ERRLEN];
    sv->leases = ps_leases_create(&cfg, why);
    if (!sv->leases) {
      pthread_mutex_unlock(&sv->lease_mu);
      snprintf(err, PS_ERRLEN, "cannot lease %" PRIu64 " examples: %.180s", dataset_size, why);
      return RPC_INVALID_ARGUMENT;
    }
    if (!quiet)
      PS_INFO("leases: %" PRIu64 " examples in chunks of %d, %d epoch(s)", dataset_size,
              sv->job.lease_chunk, sv->job.epochs);
  }
  ps_leases *t = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (!t) {
    snprintf(err, PS_ERRLEN, "the first Lease request must give dataset_size");
    return RPC_INVALID_ARGUMENT;
  }
  ps_lease_stats st;
  ps_leases_stats(t, &st);
  if (dataset_size && dataset_size != st.config.n_examples) {
    snprintf(err, PS_ERRLEN,
             "this worker's data set has %" PRIu64 " training examples, the lease table %" PRIu64,
             dataset_size, st.config.n_examples);
    return RPC_FAILED_PRECONDITION;
  }
  if (complete_lease) {
    /* Under lease_mu, so that the epoch a completion finishes is recorded
     * once. */
    pthread_mutex_lock(&sv->lease_mu);
    ps_lease_stats before;
    ps_leases_stats(t, &before);
    int rc = ps_leases_complete(t, wid, complete_lease, now);
    /* Not counted: what the worker trained of it is trained again (or was
     * already) by another, which the record says. */
    if (rc != PS_OK) ps_leases_note_refused(t, wid, complete_lease, trained);
    ps_lease_stats after;
    ps_leases_stats(t, &after);
    if (!quiet && (after.epoch != before.epoch || after.finished != before.finished))
      record_epoch(sv, t, before.epoch);
    pthread_mutex_unlock(&sv->lease_mu);
    resp->completed_counted = rc == PS_OK;
    if (rc != PS_OK && !quiet)
      PS_INFO("lease %" PRIx64 " of worker %016" PRIx64 " finished but not counted: %s",
              complete_lease, wid, ps_leases_strerror(rc));
  }
  resp->status = 1;
  if (want_next) {
    ps_lease l;
    int rc = ps_leases_acquire(t, wid, now, &l);
    if (rc == PS_OK) {
      resp->status = 0;
      resp->lease_id = l.lease_id;
      resp->epoch = l.epoch;
      resp->chunk = l.chunk;
      resp->begin = l.begin;
      resp->count = l.count;
    } else if (rc == PS_LEASE_FINISHED) {
      resp->status = 2;
    } else if (rc < 0) {
      snprintf(err, PS_ERRLEN, "lease: %s", ps_leases_strerror(rc));
      return RPC_RESOURCE_EXHAUSTED;
    } /* WAIT and FULL: ask again later */
  }
  return RPC_OK;
}

/* Gives the data a departed worker held back to the others. */
void ps_update_release_leases(ps_server *sv, uint64_t worker) {
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *t = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (!t) return;
  int n = ps_leases_release_worker(t, worker);
  if (n > 0) PS_INFO("leases: %d chunk(s) of worker %016" PRIx64 " back in the pool", n, worker);
}

/* A push: applied to the shard (async, ssp; with its rows as one update)
 * or added to the current step's sum (sync); the worker's round and push
 * counted. */
static int apply_push(ps_server *sv, const ps_update *u, ps_update_result *res, char *err) {
  int rc;
  if (sv->job.mode_kind == PS_MODE_SYNC) {
    rc = ps_rows_sync_add(sv, u->rows, u->worker, u->base_version, u->offset, u->count,
                          u->gradient, &res->dropped, &res->have, err);
    if (rc == 0) {
      ps_shard_stats st;
      ps_shard_stats_get(sv->shard, &st);
      res->version = st.version;
    }
  } else if (u->rows) {
    rc = ps_rows_push(sv, u->rows, u->base_version, u->offset, u->count, u->gradient,
                      &res->version, &res->staleness, err);
  } else {
    rc = ps_shard_push(sv->shard, u->base_version, u->offset, u->count, u->gradient,
                       &res->version, &res->staleness, err);
  }
  if (rc != 0) {
    res->rpc_status = rc == PS_ERANGE ? RPC_OUT_OF_RANGE : RPC_INVALID_ARGUMENT;
    return rc;
  }
  ps_membership_note_round(sv->members, u->worker, u->request_id);
  ps_membership_note_push(sv->members, u->worker, u->step, ps_now_ms());
  if (u->lease_id && sv->index == 0) { /* what the worker trained of its lease */
    pthread_mutex_lock(&sv->lease_mu);
    ps_leases *t = sv->leases;
    pthread_mutex_unlock(&sv->lease_mu);
    if (t) ps_leases_note_pushed(t, u->worker, u->lease_id, u->batch);
  }
  return 0;
}

/* A heartbeat's renewal of the worker's leases (the ones it names), or the
 * sweep's expiry of those not renewed in time. */
static int apply_lease_clock(ps_server *sv, const ps_update *u, ps_update_result *res) {
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *t = sv->leases;
  if (t && u->kind == PS_UPDATE_LEASE_EXPIRE)
    res->changed = ps_leases_expire(t, u->now_ms, u->timeout_ms);
  else if (t && u->names_leases)
    ps_leases_renew_named(t, u->worker, u->leases, u->n_leases, u->now_ms);
  else if (t)
    ps_leases_renew(t, u->worker, u->now_ms);
  pthread_mutex_unlock(&sv->lease_mu);
  return 0;
}

int ps_update_apply(ps_server *sv, const ps_update *u, int replay, ps_update_result *res,
                    char *err) {
  res->rpc_status = RPC_OK;
  switch (u->kind) {
    case PS_UPDATE_PUSH:
      return apply_push(sv, u, res, err);
    case PS_UPDATE_SYNC_STEP:
      res->step = ps_shard_sync_try_apply(sv->shard, u->quorum, u->divisor, &res->version, err);
      return 0;
    case PS_UPDATE_LEASE: {
      int st = lease_step(sv, u->worker, u->dataset_size, u->complete_lease, u->trained, u->want_next,
                          u->now_ms, &res->lease, replay, err);
      if (st == RPC_OK) return 0;
      res->rpc_status = st;
      return PS_EINVAL;
    }
    case PS_UPDATE_LEASE_RENEW:
    case PS_UPDATE_LEASE_EXPIRE:
      return apply_lease_clock(sv, u, res);
    case PS_UPDATE_REGISTER:
      if (!u->session ||
          ps_membership_install(sv->members, u->worker, u->host ? u->host : "",
                                u->role ? u->role : "", u->task_index, ps_now_ms(), u->session,
                                u->reader, NULL) != PS_OK) {
        snprintf(err, PS_ERRLEN, "worker %016" PRIx64 " cannot be installed", u->worker);
        res->rpc_status = RPC_RESOURCE_EXHAUSTED;
        return PS_ESTATE;
      }
      if (u->n_done || u->n_held)
        ps_update_rejoin(sv, u->worker, u->done_chunks, u->n_done, u->held, u->n_held, replay);
      return 0;
    case PS_UPDATE_LEAVE:
      ps_membership_remove(sv->members, u->worker);
      ps_update_release_leases(sv, u->worker);
      return 0;
    case PS_UPDATE_IDLE:
      res->changed = ps_membership_set_idle(sv->members, u->worker, u->idle) == 1;
      return 0;
    default:
      snprintf(err, PS_ERRLEN, "an update of unknown kind %d", u->kind);
      res->rpc_status = RPC_INVALID_ARGUMENT;
      return PS_EINVAL;
  }
}

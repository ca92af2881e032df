/* ps-server's pulls that wait on the server (ssp: for the slowest worker to
 * catch up; sync: for the step to be applied): the list of waiters behind
 * wait_mu, the test of whether a pull may go, answering or failing the
 * waiters, and the sync step that releases them. */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>

#include "proto/ps.pb-c.h"
#include "ps/rpc/sync.h"
#include "ps/ckpt/cut.h"
#include "ps/core/rows.h"
#include "ps/core/update.h"
#include "ps/repl/replica.h"
#include "ps/rpc/pull.h"

const double ps_wait_bounds[PS_WAIT_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                0.1,   0.25,   0.5,   1,    2.5,   10};

/* A pull that waited ms milliseconds, counted under wait_mu (Status and
 * the metrics endpoint read the histogram). */
static void note_wait(ps_server *sv, int64_t ms) {
  double s = (double)ms / 1e3;
  int i = 0;
  while (i < PS_WAIT_BUCKETS && s > ps_wait_bounds[i]) i++;
  sv->wait_hist[i]++;
  sv->wait_ms_total += (double)ms;
}

/* A pull that waits on the server (ssp: for the slowest worker to catch
 * up; sync: for the step to be applied). */
struct ps_waiter {
  rpc_call *call;
  uint64_t worker, min_version;
  size_t offset, count;
  ps_rows_req *rows; /* the embedding rows asked for (owned), or NULL */
  int64_t since_ms, deadline_ms;
  struct ps_waiter *next;
};

/* May the worker's pull be answered now? Called with wait_mu held.
 * *known is 0 when the worker is no longer registered. */
static int pull_ready(ps_server *sv, uint64_t worker, uint64_t min_version, int *known) {
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
      /* A step further than the next one can never come: this shard went
       * back (restored from a checkpoint) after the worker pulled from it.
       * The worker goes on from what the shard holds. */
      if (min_version > st.version + 1) {
        PS_INFO("worker %016" PRIx64 " waits for version %" PRIu64 ", this shard is at %" PRIu64
                " (restored from a checkpoint): it gets version %" PRIu64,
                worker, min_version, st.version, st.version);
        return 1;
      }
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
void ps_waits_recheck(ps_server *sv) {
  int64_t now = ps_now_ms();
  ps_waiter *go = NULL, *fail = NULL, *gone = NULL;
  pthread_mutex_lock(&sv->wait_mu);
  for (ps_waiter **pp = &sv->waiters; *pp;) {
    ps_waiter *w = *pp;
    int known = 1;
    ps_waiter **dest = NULL;
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
      note_wait(sv, now - w->since_ms);
    } else {
      pp = &w->next;
    }
  }
  pthread_mutex_unlock(&sv->wait_mu);
  while (go) {
    ps_waiter *w = go;
    go = w->next;
    if (w->rows)
      ps_pull_serve_rows(sv, w->call, w->offset, w->count, w->rows);
    else
      ps_pull_serve(sv, w->call, w->offset, w->count);
    free(w);
  }
  while (gone) {
    ps_waiter *w = gone;
    gone = w->next;
    rpc_call_fail(w->call, RPC_NOT_FOUND,
                  "worker %016" PRIx64 " was dropped by shard %d while its pull waited: register "
                  "again",
                  w->worker, sv->index);
    ps_rows_free(w->rows);
    free(w);
  }
  while (fail) {
    ps_waiter *w = fail;
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
    ps_rows_free(w->rows);
    free(w);
  }
}

int ps_waits_add(ps_server *sv, rpc_call *call, uint64_t worker, uint64_t min_version,
                 uint64_t push_round, size_t offset, size_t count, ps_rows_req *rows) {
  int known = 1, ready, lost = 0;
  ps_waiter *w = NULL, *superseded = NULL;
  pthread_mutex_lock(&sv->wait_mu);
  ready = pull_ready(sv, worker, min_version, &known);
  /* sync: the pull waits for the step of the worker's round (pushes come
   * before their pulls, and a round is noted as it is taken); a shard that
   * has not noted it lost it with a restart, and the step would never
   * come. */
  uint64_t last = 0;
  if (!ready && known && sv->job.mode_kind == PS_MODE_SYNC && push_round != 0 &&
      ps_membership_round(sv->members, worker, &last) == PS_OK && last < push_round)
    lost = 1;
  /* A worker has one pull out per shard: a new one means that the client
   * gave up on those still waiting here (its deadline passed, or it was
   * cancelled: the server is not told), and they are answered now rather
   * than held to their deadlines, where they would keep the worker's place
   * and, with a few retries, fill the list. */
  if (known) {
    int64_t now = ps_now_ms();
    for (ps_waiter **pp = &sv->waiters; *pp;) {
      ps_waiter *old = *pp;
      if (old->worker != worker) {
        pp = &old->next;
        continue;
      }
      *pp = old->next;
      old->next = superseded;
      superseded = old;
      sv->n_waiting--;
      note_wait(sv, now - old->since_ms);
    }
  }
  /* More waiting than twice the registrations allowed (workers dropped
   * while their pulls wait, and new ones registered) is refused. */
  int full = !ready && known && !lost && sv->n_waiting >= 2 * sv->job.max_workers;
  if (!ready && known && !lost && !full) {
    w = calloc(1, sizeof *w);
    if (w) {
      w->call = call;
      w->worker = worker;
      w->min_version = min_version;
      w->offset = offset;
      w->count = count;
      w->rows = rows;
      w->since_ms = ps_now_ms();
      w->deadline_ms = w->since_ms + sv->job.wait_timeout_ms;
      w->next = sv->waiters;
      sv->waiters = w;
      sv->n_waiting++;
      sv->waits++;
    }
  }
  pthread_mutex_unlock(&sv->wait_mu);
  while (superseded) {
    ps_waiter *old = superseded;
    superseded = old->next;
    rpc_call_fail(old->call, RPC_CANCELLED,
                  "shard %d: a newer pull of worker %016" PRIx64 " replaces this one", sv->index,
                  worker);
    ps_rows_free(old->rows);
    free(old);
  }
  if (ready) return PS_PULL_NOW;
  if (!known) return PS_ENOTFOUND;
  if (lost) return PS_PULL_LOST;
  if (full) return PS_ERANGE;
  return w ? PS_PULL_WAITS : PS_ENOMEM;
}

void ps_waits_fail_all(ps_server *sv, int status, const char *why) {
  pthread_mutex_lock(&sv->wait_mu);
  ps_waiter *all = sv->waiters;
  int64_t now = ps_now_ms();
  for (ps_waiter *w = all; w; w = w->next) note_wait(sv, now - w->since_ms);
  sv->waiters = NULL;
  sv->n_waiting = 0;
  pthread_mutex_unlock(&sv->wait_mu);
  while (all) {
    ps_waiter *w = all;
    all = w->next;
    rpc_call_fail(w->call, status, "shard %d: %s", sv->index, why);
    ps_rows_free(w->rows);
    free(w);
  }
}

void ps_sync_watch(ps_server *sv) {
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  double now = ps_now_s();
  int live = ps_membership_count(sv->members);
  if (st.version != sv->watch_version || live == 0 || sv->watch_since_s == 0) {
    sv->watch_version = st.version;
    sv->watch_since_s = now;
    return;
  }
  if (now - sv->watch_since_s < PS_SERVER_STALL_S || now - sv->watch_warned_s < PS_SERVER_STALL_S)
    return;
  sv->watch_warned_s = now;
  pthread_mutex_lock(&sv->wait_mu);
  int waiting = sv->n_waiting;
  pthread_mutex_unlock(&sv->wait_mu);
  char what[PS_ERRLEN];
  pthread_mutex_lock(&sv->wait_mu);
  int started = sv->sync_started;
  pthread_mutex_unlock(&sv->wait_mu);
  if (sv->job.mode_kind == PS_MODE_SYNC && !started)
    snprintf(what, sizeof what,
             "steps have not begun: %d of the job's min_workers %d have registered", live,
             sv->job.min_workers);
  else if (sv->job.mode_kind == PS_MODE_SYNC)
    snprintf(what, sizeof what,
             "step %" PRIu64 " has %d of the %d gradients it needs (live workers %d, backup %d); "
             "%d pull(s) wait for it",
             st.version + 1, st.sync_pending, live - sv->job.backup_workers, live,
             sv->job.backup_workers, waiting);
  else if (sv->job.mode_kind == PS_MODE_SSP)
    snprintf(what, sizeof what, "%d pull(s) wait for the slowest worker to come within %d steps",
             waiting, sv->job.ssp_k);
  else
    snprintf(what, sizeof what, "no worker has pushed");
  PS_WARN("no update for %.0f s with %d worker(s) training: %s (ps-server --status lists the "
          "workers, their steps and leases)",
          now - sv->watch_since_s, live, what);
}

void ps_waits_free(ps_server *sv) {
  while (sv->waiters) {
    ps_waiter *w = sv->waiters;
    sv->waiters = w->next;
    ps_rows_free(w->rows);
    free(w);
  }
}

/* sync: applies the current step if enough gradients are in; releases the
 * pulls waiting for it. */
void ps_sync_try_step(ps_server *sv) {
  int idle = 0;
  int live = ps_membership_count_both(sv->members, &idle);
  /* Steps start once the job's min_workers are in, so that the first to
   * register does not run the first steps alone; after that the quorum
   * follows the live workers (a dead one does not hold the others). */
  pthread_mutex_lock(&sv->wait_mu);
  if (!sv->sync_started && live >= sv->job.min_workers) {
    sv->sync_started = 1;
    PS_INFO("sync: %d workers registered (min_workers %d): steps %s", live, sv->job.min_workers,
            sv->sync_resume_ms ? "resume" : "begin");
  } else if (!sv->sync_started && sv->sync_resume_ms && live > 0 &&
             ps_now_ms() >= sv->sync_resume_ms) {
    sv->sync_started = 1;
    PS_WARN("sync: %d of the job's min_workers %d registered again within a heartbeat timeout "
            "of the restore: steps resume with them",
            live, sv->job.min_workers);
  }
  int started = sv->sync_started;
  pthread_mutex_unlock(&sv->wait_mu);
  if (!started) return;
  int quorum = live - sv->job.backup_workers;
  char err[PS_ERRLEN];
  uint64_t v = 0;
  /* A checkpoint cut holds steps past its version (cut.c tries again). */
  if (ps_cut_step_enter(sv)) return;
  /* A replicated shard's primary applies the step under its ordering lock
   * and logs it with its quorum; a backup waits for that. */
  if (ps_replica_lock(sv) != 0) {
    ps_cut_leave(sv);
    return;
  }
  if (quorum < 1) quorum = 1;
  /* Workers that wait for data (an epoch's last chunks are leased to
   * others) are not waited for, but the step is still theirs: its sum is
   * divided by them too, so that the last steps of an epoch, made by fewer
   * workers, move the model no further per example than the others (at
   * 16 workers they had made 14 more steps and cost 0.07 of accuracy). */
  int divisor = live + idle - sv->job.backup_workers;
  if (divisor < quorum) divisor = quorum;
  ps_update u = {.kind = PS_UPDATE_SYNC_STEP, .quorum = quorum, .divisor = divisor};
  ps_update_result res = {0};
  ps_update_apply(sv, &u, 0, &res, err);
  int rc = res.step;
  v = res.version;
  if (sv->repl && (rc == 1 || rc == PS_EINVAL)) {
    u.result = rc;
    if (ps_replica_append(sv, &u, NULL, NULL, 0, 0) != PS_OK) ps_replica_diverged(sv);
  }
  ps_replica_unlock(sv);
  ps_cut_leave(sv);
  if (rc < 0) PS_ERROR("cannot apply the step: %s", err);
  /* A step that can never be applied (it would make the model non-finite)
   * would hold every pull waiting for it until its deadline, and then
   * again at each retry: they are told at once, and the workers stop with
   * the cause. */
  if (rc == PS_EINVAL) ps_waits_fail_all(sv, RPC_FAILED_PRECONDITION, err);
  if (rc == 1) {
    PS_DEBUG("sync: step applied (quorum %d of %d live, divided by %d): version %" PRIu64, quorum,
             live, divisor, v);
    ps_waits_recheck(sv);
  }
}

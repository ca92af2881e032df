/* Checkpoint sets: every shard writes its state at one cut that shard 0
 * chooses, so that a restore never combines moments.
 *
 * The cut. Each worker pushes in rounds (one request id per round, sent
 * to every shard at once, the next round only after every shard answered
 * the last), so "what a shard has applied" is, per worker, the id of its
 * last round applied there. Shard 0 takes a set in three calls to every
 * shard (itself included, over the same RPC):
 *
 *   PREPARE  the shard holds every update from now on (pushes are kept,
 *            unanswered; a sync step is not applied) and answers, per
 *            worker, its last round applied (under sync: its version).
 *   CUT      the point: per worker the largest round any shard had applied
 *            (sync: the largest version). The shard applies what it still
 *            lacks up to that point (pushes of those rounds are let
 *            through, later ones stay held), and when every worker of the
 *            cut is there (or has gone, or has a later round held: its
 *            round at the cut was then answered here already; one the
 *            shard did not know at the PREPARE, registering again after a
 *            restart, is waited for), it copies
 *            its state, lets the held updates go on, and writes the copy on
 *            the loop's work queue; the CUT is answered once the file is on
 *            disk.
 *   ABORT    the shard lets the held updates go on and writes nothing.
 *
 * A shard held longer than PS_CUT_HOLD_S by a PREPARE or a CUT that cannot
 * be met goes on by itself (the set is then incomplete and never used). A
 * set is complete when every shard answered its CUT, or when every shard
 * has a file of it (each PREPARE answer lists the sets the shard has: so a
 * new coordinator learns the sets an earlier one cut). Each CUT names the
 * K - 1 newest complete sets (at least one; --keep-checkpoints K), so that
 * each shard deletes its files of the older others and the newest complete
 * set stays whole until a newer one is complete. A set abandoned after its
 * CUT went out may be on some shards: the next CUT names every set the
 * PREPARE answers show incomplete (abandoned_sets), whichever coordinator
 * cut it (this one, shard 0's deposed primary, or its process before a
 * restart: their memory is not needed), and each shard deletes its files
 * of them before it writes, unless every shard has a file of the set by
 * then. A set some shards lack when every shard accepted a PREPARE never
 * completes: a shard's primary is writing none then (a PREPARE is refused
 * while one is) and takes no older set's CUT any more, and a replica
 * deposed since it prepared a set gives the set up before taking its copy
 * (its state is then the new primary's, not the cut's). Each PREPARE and
 * CUT names the term of shard 0's primary; a shard refuses one of a lower
 * term than it has seen (a deposed primary's), so a deposed primary
 * deletes nothing.
 *
 * Threads: the gate functions run on gRPC's threads, the watch and the
 * writes on the loop (main thread) and its work queue, the coordination on
 * the work queue. Everything shared is under cut->mu. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "ps/ckpt/cut.h"
#include "ps/ckpt/capture.h"
#include "ps/ckpt/checkpoint.h"
#include "ps/repl/replica.h"
#include "ps/core/rows.h"

enum { CUT_NONE = 0, CUT_HOLD = 1, CUT_TAKING = 2 };

/* A push held while a cut is taken, with its own copy of the gradient. */
typedef struct held_push {
  ps_push_args a;
  ps_seg seg;
  ps_segview view;
  float *grad;
  struct held_push *next;
} held_push;

struct ps_cut {
  pthread_mutex_t mu;
  pthread_cond_t quiet; /* in_apply fell to 0 */
  int phase;
  uint64_t set_id;
  double since_s;
  int in_apply;          /* updates being applied now, let through the gate */
  uint64_t *cut_worker;  /* the cut: (n_cut) workers and their rounds */
  uint64_t *cut_round;
  int n_cut;
  uint64_t cut_version;  /* sync */
  uint64_t *known;       /* the workers this shard reported at the PREPARE */
  int n_known;
  held_push *held, *held_last;
  int n_held;
  rpc_call *call; /* the CUT call, answered when the file is written */
  uint64_t reign; /* this replica's reign as the primary at the PREPARE (ps_replica_reign) */
  uint64_t keep_sets[PS_CUT_MAX_KEEP];
  int n_keep, drop_other;
  int behind; /* most workers the cut waited for at once (rounds on their way here) */
  /* The copy taken at the cut, handed to the loop for writing. */
  int ready, writing;
  ps_ckpt state;
  uv_async_t wake;
  uv_work_t work;
  int rc;
  char path[PS_CKPT_PATHLEN], err[PS_ERRLEN];
  uint64_t last_set, last_set_version; /* the newest set this shard wrote */
  /* Shard 0: the coordination. */
  int coordinating;
  atomic_int kick; /* a set is due at once (ps_cut_kick) */
  int stopping; /* no new set: the server stops */
  uv_work_t coord_work;
  rpc_channel *ch[PS_MAX_TASKS]; /* per server (shard x replica) */
  int cur[PS_MAX_TASKS];         /* per shard: the replica believed primary */
  uint64_t complete[PS_CUT_MAX_KEEP]; /* the newest complete sets, newest first */
  int n_complete;
  uint64_t next_set;
  uint64_t coord_term; /* the highest term of shard 0's primary a coordinator named */
};

/* ------------------------------------------------------------ cut records */

/* The cut record of a file: what the shard had applied, as bytes that are
 * equal on every shard that applied the same updates. u64 mode (1: sync),
 * u64 version (sync; else 0), u64 n, then n (worker, round) pairs sorted
 * by worker; little-endian. */
static int record_encode(int sync, uint64_t version, const uint64_t *w, const uint64_t *r, int n,
                         void **out, size_t *len) {
  size_t bytes = 24 + (size_t)n * 16;
  uint8_t *b = malloc(bytes);
  if (!b) return PS_ENOMEM;
  ps_put_le64(b, (uint64_t)sync);
  ps_put_le64(b + 8, sync ? version : 0);
  ps_put_le64(b + 16, (uint64_t)n);
  /* Sorted by worker: insertion into the output, n is small. */
  int *order = malloc((size_t)(n ? n : 1) * sizeof *order);
  if (!order) {
    free(b);
    return PS_ENOMEM;
  }
  for (int i = 0; i < n; i++) {
    int j = i;
    while (j > 0 && w[order[j - 1]] > w[i]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = i;
  }
  for (int i = 0; i < n; i++) {
    ps_put_le64(b + 24 + (size_t)i * 16, w[order[i]]);
    ps_put_le64(b + 24 + (size_t)i * 16 + 8, sync ? 0 : r[order[i]]);
  }
  free(order);
  *out = b;
  *len = bytes;
  return PS_OK;
}

/* The workers that may push (readers cannot) and the last round each had
 * applied here: *ids and *rounds are malloc'd arrays of the count returned
 * (freed by the caller), or PS_ENOMEM with nothing allocated. */
static int pushers(ps_server *sv, uint64_t **ids, uint64_t **rounds) {
  int cap = sv->job.max_workers + 16;
  ps_member *m = malloc((size_t)cap * sizeof *m);
  uint64_t *w = malloc((size_t)cap * sizeof *w), *r = malloc((size_t)cap * sizeof *r);
  if (!m || !w || !r) {
    free(m);
    free(w);
    free(r);
    return PS_ENOMEM;
  }
  int n = ps_membership_list(sv->members, m, cap), k = 0;
  for (int i = 0; i < n; i++)
    if (!m[i].reader) {
      w[k] = m[i].id;
      r[k++] = m[i].round;
    }
  free(m);
  *ids = w;
  *rounds = r;
  return k;
}

/* The record of what this shard has applied now, for a file written alone
 * (a stop, or the only shard's timer): the same bytes on every shard when
 * no update is in flight. */
int ps_cut_record_now(ps_server *sv, void **out, size_t *len) {
  int sync = sv->job.mode_kind == PS_MODE_SYNC;
  uint64_t *w = NULL, *r = NULL;
  int k = pushers(sv, &w, &r);
  if (k < 0) return k;
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  int rc = record_encode(sync, st.version, w, r, sync ? 0 : k, out, len);
  free(w);
  free(r);
  return rc;
}

int ps_cut_seed_rounds(ps_server *sv, const void *record, size_t len) {
  const uint8_t *b = record;
  if (!b || len < 24) return PS_EINVAL;
  uint64_t sync = ps_get_le64(b), n = ps_get_le64(b + 16);
  if (n > (len - 24) / 16 || len != 24 + n * 16) return PS_EINVAL;
  if (sync || n == 0) return PS_OK;
  uint64_t *ids = malloc(n * sizeof *ids), *rounds = malloc(n * sizeof *rounds);
  int rc = PS_ENOMEM;
  if (ids && rounds) {
    for (uint64_t i = 0; i < n; i++) {
      ids[i] = ps_get_le64(b + 24 + i * 16);
      rounds[i] = ps_get_le64(b + 24 + i * 16 + 8);
    }
    rc = ps_membership_seed_rounds(sv->members, ids, rounds, (int)n);
    if (rc == PS_OK)
      PS_INFO("checkpoint: the push rounds of %" PRIu64 " worker(s) restored: a push of a round "
              "the checkpoint holds is answered, not applied again",
              n);
  }
  free(ids);
  free(rounds);
  return rc;
}

/* ------------------------------------------------------------ the gate */

static int cut_round_of(const ps_cut *c, uint64_t worker, uint64_t *round) {
  for (int i = 0; i < c->n_cut; i++)
    if (c->cut_worker[i] == worker) {
      *round = c->cut_round[i];
      return 1;
    }
  return 0;
}

static void held_free(held_push *h) {
  if (!h) return;
  ps_free(h->grad);
  ps_rows_free((ps_rows_req *)(uintptr_t)h->a.u.rows);
  free(h);
}

/* Keeps a push (with a copy of its gradient) to be applied after the cut. */
static int hold(ps_cut *c, const ps_push_args *a) {
  held_push *h = calloc(1, sizeof *h);
  if (!h) return PS_ENOMEM;
  h->a = *a;
  size_t bytes = a->u.gradient->total;
  h->grad = ps_alloc(bytes ? bytes : 1);
  if (!h->grad) {
    free(h);
    return PS_ENOMEM;
  }
  size_t at = 0;
  for (int i = 0; i < a->u.gradient->nsegs; i++) {
    memcpy((uint8_t *)h->grad + at, a->u.gradient->segs[i].ptr, a->u.gradient->segs[i].len);
    at += a->u.gradient->segs[i].len;
  }
  h->seg = (ps_seg){.ptr = (const uint8_t *)h->grad, .len = bytes};
  h->view = (ps_segview){.segs = &h->seg, .nsegs = 1, .total = bytes};
  h->a.u.gradient = &h->view;
  if (a->u.rows && !(h->a.u.rows = ps_rows_dup(a->u.rows))) {
    ps_free(h->grad);
    free(h);
    return PS_ENOMEM;
  }
  if (c->held_last)
    c->held_last->next = h;
  else
    c->held = h;
  c->held_last = h;
  c->n_held++;
  return PS_OK;
}

int ps_cut_push_enter(ps_server *sv, const ps_push_args *a) {
  ps_cut *c = sv->cut;
  if (!c) return 0;
  pthread_mutex_lock(&c->mu);
  int held = 0;
  uint64_t at;
  if (c->phase == CUT_HOLD || (c->phase == CUT_TAKING && sv->job.mode_kind != PS_MODE_SYNC &&
                               !(cut_round_of(c, a->u.worker, &at) && a->u.request_id <= at)))
    held = 1;
  int rc = 0;
  if (held)
    rc = hold(c, a) == PS_OK ? 1 : PS_ENOMEM;
  else
    c->in_apply++;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int ps_cut_step_enter(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (!c) return 0;
  ps_shard_stats st;
  pthread_mutex_lock(&c->mu);
  int held = c->phase == CUT_HOLD;
  if (c->phase == CUT_TAKING) {
    ps_shard_stats_get(sv->shard, &st);
    held = st.version >= c->cut_version;
  }
  if (!held) c->in_apply++;
  pthread_mutex_unlock(&c->mu);
  return held;
}

static void try_take(ps_server *sv);

void ps_cut_leave(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  if (--c->in_apply == 0) pthread_cond_broadcast(&c->quiet);
  int taking = c->phase == CUT_TAKING;
  pthread_mutex_unlock(&c->mu);
  if (taking) try_take(sv);
}

/* ------------------------------------------------------------ the cut */

/* Lets the held updates go on (phase back to NONE): the pushes are applied
 * in the order they came and answered; a sync step that waited is tried.
 * Called without the lock. */
static void release(ps_server *sv, held_push *list) {
  int n = 0;
  while (list) {
    held_push *next = list->next;
    sv->hooks.apply_push(sv, &list->a);
    held_free(list);
    list = next;
    n++;
  }
  if (n) PS_DEBUG("checkpoint set: %d held push(es) applied", n);
  if (sv->job.mode_kind == PS_MODE_SYNC) sv->hooks.sync_step(sv);
}

/* Ends the phase under the lock: returns the held list for release(). */
static held_push *end_phase_locked(ps_cut *c) {
  held_push *list = c->held;
  c->held = c->held_last = NULL;
  c->n_held = 0;
  c->phase = CUT_NONE;
  free(c->cut_worker);
  free(c->cut_round);
  free(c->known);
  c->cut_worker = c->cut_round = c->known = NULL;
  c->n_cut = c->n_known = 0;
  return list;
}

/* Is every worker of the cut there? Under the lock. *missed: the shard is
 * past the cut (sync), which cannot be met. */
static int cut_met(ps_server *sv, ps_cut *c, int *missed) {
  *missed = 0;
  if (c->in_apply > 0) return 0;
  int missing = 0;
  if (sv->job.mode_kind == PS_MODE_SYNC) {
    ps_shard_stats st;
    ps_shard_stats_get(sv->shard, &st);
    *missed = st.version > c->cut_version;
    return st.version == c->cut_version;
  }
  for (int i = 0; i < c->n_cut; i++) {
    uint64_t r = 0;
    if (ps_membership_round(sv->members, c->cut_worker[i], &r) != PS_OK) {
      /* Gone since the PREPARE (left, or dropped): its rounds will not
       * come. One this shard did not know then (registering again after
       * a restart) is waited for, unless the cut has none of its rounds. */
      int was_known = 0;
      for (int k = 0; k < c->n_known && !was_known; k++) was_known = c->known[k] == c->cut_worker[i];
      if (was_known || c->cut_round[i] == 0) continue;
    }
    if (r >= c->cut_round[i]) continue;
    int later = 0; /* a later round held: the one at the cut was answered here already */
    for (held_push *h = c->held; h && !later; h = h->next)
      later = h->a.u.worker == c->cut_worker[i] && h->a.u.request_id > c->cut_round[i];
    if (!later) missing++;
  }
  /* Rounds still on their way here (sent before the PREPARE, applied
   * elsewhere): said in the log once the cut is taken. */
  if (missing > c->behind) c->behind = missing;
  return missing == 0;
}

/* A replica that is no longer the primary that prepared the set under
 * way gives it up, unless its copy is taken already (the write goes on):
 * since it was deposed it applies the new primary's updates, past the cut
 * and not held, and may have taken the new primary's whole state, so a
 * copy now would not be the cut's; and shard 0 counts on a set that a
 * shard's primary lacks when it accepts a newer PREPARE never being
 * written. reign: ps_replica_reign, read without the lock. 1 when the set
 * was given up. */
static int give_up_deposed(ps_server *sv, uint64_t reign) {
  ps_cut *c = sv->cut;
  pthread_mutex_lock(&c->mu);
  if (c->phase == CUT_NONE || c->reign == reign) {
    pthread_mutex_unlock(&c->mu);
    return 0;
  }
  uint64_t id = c->set_id;
  int taking = c->phase == CUT_TAKING, n_held = c->n_held;
  rpc_call *call = c->call;
  c->call = NULL;
  held_push *list = end_phase_locked(c);
  pthread_mutex_unlock(&c->mu);
  PS_WARN("checkpoint set %" PRIu64 ": this replica is no longer the shard's primary that %s "
          "it: given up (%d held push(es) go on)",
          id, taking ? "took the CUT of" : "prepared", n_held);
  if (call)
    rpc_call_fail(call, RPC_ABORTED,
                  "shard %d: the replica that took the CUT of set %" PRIu64
                  " is no longer the shard's primary",
                  sv->index, id);
  release(sv, list);
  return 1;
}

/* When the cut is met: copies the state, lets the held updates go on and
 * wakes the loop to write the copy. A cut that can no longer be met fails
 * the CUT call, and so does a replica deposed since the PREPARE. */
static void try_take(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (give_up_deposed(sv, ps_replica_reign(sv))) return;
  pthread_mutex_lock(&c->mu);
  int missed = 0;
  if (c->phase != CUT_TAKING || !cut_met(sv, c, &missed)) {
    held_push *list = NULL;
    rpc_call *call = NULL;
    uint64_t id = c->set_id;
    if (missed) {
      call = c->call;
      c->call = NULL;
      list = end_phase_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    if (call) {
      PS_WARN("checkpoint set %" PRIu64 ": this shard is past the cut's version", id);
      rpc_call_fail(call, RPC_ABORTED, "shard %d is past the cut's version", sv->index);
    }
    if (list || missed) release(sv, list);
    return;
  }
  ps_ckpt *ck = &c->state;
  int rc = ps_ckpt_capture(sv, ck);
  if (rc == PS_OK) {
    ck->meta.set_id = c->set_id;
    rc = record_encode(sv->job.mode_kind == PS_MODE_SYNC, ck->meta.version, c->cut_worker,
                       c->cut_round, c->n_cut, &ck->cut, &ck->cut_len);
  }
  rpc_call *call = NULL;
  if (rc == PS_OK) {
    c->ready = 1;
  } else {
    ps_ckpt_state_free(ck);
    call = c->call;
    c->call = NULL;
  }
  uint64_t id = c->set_id;
  int behind = c->behind;
  double waited_ms = (ps_now_s() - c->since_s) * 1e3;
  held_push *list = end_phase_locked(c);
  pthread_mutex_unlock(&c->mu);
  if (!call && behind > 0)
    PS_INFO("checkpoint set %" PRIu64 ": %d worker round(s) of the cut were still on their way "
            "here; applied first (%.0f ms)",
            id, behind, waited_ms);
  if (call) {
    PS_ERROR("checkpoint set %" PRIu64 ": out of memory for the copy", id);
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "shard %d: out of memory for the copy",
                  sv->index);
  } else {
    uv_async_send(&c->wake);
  }
  release(sv, list);
}

/* ------------------------------------------------------------ writing */

static void write_run(uv_work_t *w) {
  ps_server *sv = w->data;
  ps_cut *c = sv->cut;
  c->rc = ps_ckpt_write(sv->ckpt_dir, &c->state, 0, c->path, c->err);
  if (c->rc == PS_OK && c->n_keep > 0) {
    int deleted = 0;
    char err[PS_ERRLEN];
    if (ps_ckpt_prune_sets(sv->ckpt_dir, sv->index, sv->cluster.n_ps, sv->job.job_id,
                           c->keep_sets, c->n_keep, c->state.meta.set_id, c->drop_other, &deleted,
                           err) != PS_OK)
      PS_WARN("checkpoint: %s", err);
    else if (deleted)
      PS_DEBUG("checkpoint: %d old file(s) deleted", deleted);
  }
}

static void write_done(uv_work_t *w, int status) {
  (void)status;
  ps_server *sv = w->data;
  ps_cut *c = sv->cut;
  pthread_mutex_lock(&c->mu);
  rpc_call *call = c->call;
  c->call = NULL;
  c->writing = 0;
  uint64_t id = c->state.meta.set_id, version = c->state.meta.version;
  if (c->rc == PS_OK) {
    c->last_set = id;
    c->last_set_version = version;
  }
  pthread_mutex_unlock(&c->mu);
  ps_ckpt_note_written(sv, c->rc);
  if (c->rc == PS_OK) {
    PS_INFO("checkpoint set %" PRIu64 ": version %" PRIu64 " written to %s", id, version, c->path);
    sv->ckpt_last_version = version;
  } else {
    PS_ERROR("checkpoint set %" PRIu64 " failed: %s", id, c->err);
  }
  if (call) {
    if (c->rc == PS_OK) {
      Ps__CheckpointResponse resp = PS__CHECKPOINT_RESPONSE__INIT;
      resp.version = version;
      resp.file = c->path;
      wire_reply(call, &resp.base);
    } else {
      rpc_call_fail(call, RPC_INTERNAL, "shard %d: %s", sv->index, c->err);
    }
  }
  ps_ckpt_state_free(&c->state);
}

/* The loop: a copy is ready to be written. */
static void on_wake(uv_async_t *a) {
  ps_server *sv = a->data;
  ps_cut *c = sv->cut;
  pthread_mutex_lock(&c->mu);
  int go = c->ready && !c->writing;
  if (go) {
    c->ready = 0;
    c->writing = 1;
  }
  pthread_mutex_unlock(&c->mu);
  if (!go) return;
  c->work.data = sv;
  uv_queue_work(&sv->loop, &c->work, write_run, write_done);
}

/* ------------------------------------------------------------ the RPC */

static void answer_prepare(ps_server *sv, rpc_call *call, uint64_t set_id) {
  ps_cut *c = sv->cut;
  uint64_t reign = ps_replica_reign(sv); /* the service let only a primary's PREPARE through */
  pthread_mutex_lock(&c->mu);
  if (c->phase != CUT_NONE && !c->ready && !c->writing && c->set_id < set_id) {
    /* A newer set while an older one is held or being taken here: shard
     * 0's primary moved, and the one that began the older set is gone (or
     * deposed: its CUT is refused from now on). Held, that set would stall
     * the shard until PS_CUT_HOLD_S; it is given up at once. */
    uint64_t old = c->set_id;
    rpc_call *pending = c->call;
    c->call = NULL;
    held_push *list = end_phase_locked(c);
    pthread_mutex_unlock(&c->mu);
    PS_INFO("checkpoint set %" PRIu64 " given up for the newer set %" PRIu64, old, set_id);
    if (pending) rpc_call_fail(pending, RPC_ABORTED, "set %" PRIu64 " given up for set %" PRIu64,
                               old, set_id);
    release(sv, list);
    pthread_mutex_lock(&c->mu);
  }
  if (c->phase != CUT_NONE || c->ready || c->writing) {
    uint64_t busy = c->set_id;
    pthread_mutex_unlock(&c->mu);
    rpc_call_fail(call, RPC_UNAVAILABLE, "shard %d is taking checkpoint set %" PRIu64, sv->index,
                  busy);
    return;
  }
  c->phase = CUT_HOLD;
  c->set_id = set_id;
  c->reign = reign;
  c->since_s = ps_now_s();
  /* Updates let through before the hold finish first: what is read below
   * is then all that was applied. */
  while (c->in_apply > 0) pthread_cond_wait(&c->quiet, &c->mu);
  uint64_t *ids = NULL, *rounds = NULL;
  int k = pushers(sv, &ids, &rounds);
  Ps__WorkerRound *wr = k >= 0 ? malloc((size_t)(k ? k : 1) * sizeof *wr) : NULL;
  Ps__WorkerRound **wrp = k >= 0 ? malloc((size_t)(k ? k : 1) * sizeof *wrp) : NULL;
  held_push *list = NULL;
  if (!wr || !wrp) {
    list = end_phase_locked(c); /* nothing was held yet but what came meanwhile */
  } else {
    for (int i = 0; i < k; i++) {
      ps__worker_round__init(&wr[i]);
      wr[i].worker_id = ids[i];
      wr[i].round = rounds[i];
      wrp[i] = &wr[i];
    }
    c->known = ids; /* the workers known at the PREPARE (cut_met) */
    c->n_known = k;
    ids = NULL;
  }
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  pthread_mutex_unlock(&c->mu);
  /* The sets this shard has a file of, listed once the hold is taken: no
   * write of this shard's is under way then (a PREPARE is refused while
   * one is) and none begins before this set's CUT, so the list is exact
   * until then. Shard 0 takes a set every shard has as complete, and one
   * some shards lack as never to be complete. */
  uint64_t on_disk[PS_CUT_MAX_KEEP];
  int n_on_disk = 0;
  char lerr[PS_ERRLEN];
  if (wr && wrp && ps_ckpt_list_sets(sv->ckpt_dir, sv->index, sv->cluster.n_ps, sv->job.job_id,
                                     on_disk, PS_CUT_MAX_KEEP, &n_on_disk, lerr) != PS_OK) {
    PS_WARN("checkpoint set %" PRIu64 ": %s", set_id, lerr);
    n_on_disk = 0;
  }
  if (!wr || !wrp) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "shard %d: out of memory", sv->index);
    release(sv, list);
  } else {
    Ps__CheckpointResponse resp = PS__CHECKPOINT_RESPONSE__INIT;
    resp.version = st.version;
    resp.n_applied = (size_t)k;
    resp.applied = wrp;
    resp.n_sets_on_disk = (size_t)n_on_disk;
    resp.sets_on_disk = on_disk;
    wire_reply(call, &resp.base);
  }
  free(ids);
  free(rounds);
  free(wr);
  free(wrp);
}

/* The files of the sets a CUT names as never to be complete
 * (abandoned_sets), but not of a set it names to keep, nor of its own set,
 * nor of a set every shard has a file of by now (a write that a replica
 * deposed meanwhile had begun as the primary may still land: that set is
 * complete, and shard 0 learns so at its next PREPARE). Only for a CUT of
 * a current coordinator (coordinator_current) whose PREPARE this shard
 * holds. */
static void drop_sets(ps_server *sv, const Ps__CheckpointRequest *r) {
  if (r->n_abandoned_sets == 0) return;
  int n_drop = r->n_abandoned_sets > PS_CUT_MAX_KEEP ? PS_CUT_MAX_KEEP : (int)r->n_abandoned_sets;
  int n_keep = r->n_keep_sets > PS_CUT_MAX_KEEP ? PS_CUT_MAX_KEEP : (int)r->n_keep_sets;
  int deleted = 0, whole = 0;
  char err[PS_ERRLEN];
  if (ps_ckpt_drop_sets(sv->ckpt_dir, sv->index, sv->cluster.n_ps, sv->job.job_id,
                        r->abandoned_sets, n_drop, r->keep_sets, n_keep, r->set_id, &deleted,
                        &whole, err) != PS_OK)
    PS_WARN("checkpoint set %" PRIu64 ": %s", r->set_id, err);
  else if (deleted)
    PS_INFO("checkpoint set %" PRIu64 ": deleted %d file(s) of set(s) that will not be complete",
            r->set_id, deleted);
  if (whole)
    PS_INFO("checkpoint set %" PRIu64 ": %d set(s) named as never to be complete are whole on "
            "disk now: kept",
            r->set_id, whole);
}

static void start_cut(ps_server *sv, rpc_call *call, const Ps__CheckpointRequest *r) {
  ps_cut *c = sv->cut;
  size_t n = r->n_cut;
  uint64_t *w = malloc((n ? n : 1) * sizeof *w), *rd = malloc((n ? n : 1) * sizeof *rd);
  if (!w || !rd) {
    free(w);
    free(rd);
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "shard %d: out of memory", sv->index);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    w[i] = r->cut[i]->worker_id;
    rd[i] = r->cut[i]->round;
  }
  /* The sets shard 0 named as never to be complete go first, before this
   * set is written (so that the directory holds at most the kept sets and
   * this one), while the shard holds the PREPARE: it writes nothing then. */
  pthread_mutex_lock(&c->mu);
  int prepared = c->phase == CUT_HOLD && c->set_id == r->set_id;
  pthread_mutex_unlock(&c->mu);
  if (prepared) drop_sets(sv, r);
  pthread_mutex_lock(&c->mu);
  if (c->phase != CUT_HOLD || c->set_id != r->set_id) {
    int phase = c->phase;
    uint64_t id = c->set_id;
    pthread_mutex_unlock(&c->mu);
    free(w);
    free(rd);
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "shard %d is not prepared for set %" PRIu64 " (%s %" PRIu64 ")", sv->index,
                  r->set_id, phase == CUT_NONE ? "no set under way; the last" : "under way:", id);
    return;
  }
  c->phase = CUT_TAKING;
  c->since_s = ps_now_s();
  c->cut_worker = w;
  c->cut_round = rd;
  c->n_cut = (int)n;
  c->cut_version = r->cut_version;
  c->call = call;
  c->n_keep = 0;
  for (size_t i = 0; i < r->n_keep_sets && c->n_keep < PS_CUT_MAX_KEEP; i++)
    c->keep_sets[c->n_keep++] = r->keep_sets[i];
  c->drop_other = r->drop_other_layouts;
  c->behind = 0;
  /* The pushes held since the PREPARE that the cut includes go now, in the
   * order they came (counted as being applied, so that nothing is copied
   * before they are in); later ones stay held, and the gate lets through
   * what is still on its way. */
  held_push *go = NULL, *go_last = NULL, *keep = NULL, *keep_last = NULL;
  int n_go = 0;
  for (held_push *h = c->held, *next; h; h = next) {
    next = h->next;
    h->next = NULL;
    uint64_t at;
    int in_cut = cut_round_of(c, h->a.u.worker, &at) && h->a.u.request_id <= at;
    held_push **head = in_cut ? &go : &keep, **last = in_cut ? &go_last : &keep_last;
    if (*last)
      (*last)->next = h;
    else
      *head = h;
    *last = h;
    n_go += in_cut;
  }
  c->held = keep;
  c->held_last = keep_last;
  c->n_held -= n_go;
  c->in_apply += n_go;
  pthread_mutex_unlock(&c->mu);
  while (go) {
    held_push *next = go->next;
    sv->hooks.apply_push(sv, &go->a);
    held_free(go);
    go = next;
    ps_cut_leave(sv);
  }
  if (sv->job.mode_kind == PS_MODE_SYNC) sv->hooks.sync_step(sv);
  try_take(sv);
}

static void abort_set(ps_server *sv, rpc_call *call, uint64_t set_id) {
  ps_cut *c = sv->cut;
  pthread_mutex_lock(&c->mu);
  held_push *list = NULL;
  rpc_call *pending = NULL;
  if (c->phase != CUT_NONE && c->set_id == set_id) {
    pending = c->call;
    c->call = NULL;
    list = end_phase_locked(c);
  }
  pthread_mutex_unlock(&c->mu);
  if (pending) rpc_call_fail(pending, RPC_ABORTED, "set %" PRIu64 " aborted", set_id);
  release(sv, list);
  Ps__CheckpointResponse resp = PS__CHECKPOINT_RESPONSE__INIT;
  wire_reply(call, &resp.base);
}

/* A PREPARE or CUT from shard 0's deposed primary (a lower term than one
 * seen) is refused: it does not know the sets its successor began (it
 * would give them up here) nor the state its successor holds. 1 when the
 * call may go on. */
static int coordinator_current(ps_server *sv, rpc_call *call, const Ps__CheckpointRequest *r) {
  ps_cut *c = sv->cut;
  pthread_mutex_lock(&c->mu);
  uint64_t seen = c->coord_term;
  if (r->coordinator_term > seen) c->coord_term = r->coordinator_term;
  pthread_mutex_unlock(&c->mu);
  if (r->coordinator_term >= seen) return 1;
  rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                "shard %d: checkpoint set %" PRIu64 " comes from a deposed primary of shard 0 "
                "(its term %" PRIu64 ", term %" PRIu64 " seen)",
                sv->index, r->set_id, r->coordinator_term, seen);
  return 0;
}

void ps_cut_handle(ps_server *sv, rpc_call *call, const void *request) {
  const Ps__CheckpointRequest *r = request;
  if (!sv->cut || !sv->ckpt_dir) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION,
                  "shard %d writes no checkpoints (started without --checkpoint-dir)", sv->index);
    return;
  }
  if (r->set_id == 0) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT, "checkpoint set id 0 is not a set");
    return;
  }
  if (r->phase != PS__CHECKPOINT_REQUEST__PHASE__ABORT && !coordinator_current(sv, call, r))
    return;
  switch (r->phase) {
    case PS__CHECKPOINT_REQUEST__PHASE__PREPARE: answer_prepare(sv, call, r->set_id); break;
    case PS__CHECKPOINT_REQUEST__PHASE__CUT: start_cut(sv, call, r); break;
    case PS__CHECKPOINT_REQUEST__PHASE__ABORT: abort_set(sv, call, r->set_id); break;
    default:
      rpc_call_fail(call, RPC_INVALID_ARGUMENT, "unknown checkpoint phase %d", (int)r->phase);
  }
}

/* ------------------------------------------------------------ watch */

void ps_cut_watch(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (!c) return;
  if (give_up_deposed(sv, ps_replica_reign(sv))) return; /* held pushes go elsewhere at once */
  pthread_mutex_lock(&c->mu);
  int phase = c->phase;
  double held_s = ps_now_s() - c->since_s;
  pthread_mutex_unlock(&c->mu);
  if (phase == CUT_TAKING) try_take(sv); /* workers that left no longer count */
  if (phase == CUT_NONE || held_s < PS_CUT_HOLD_S) return;
  pthread_mutex_lock(&c->mu);
  held_push *list = NULL;
  rpc_call *call = NULL;
  uint64_t id = c->set_id;
  int n_held = c->n_held;
  if (c->phase != CUT_NONE && ps_now_s() - c->since_s >= PS_CUT_HOLD_S) {
    call = c->call;
    c->call = NULL;
    list = end_phase_locked(c);
    phase = -1;
  }
  pthread_mutex_unlock(&c->mu);
  if (phase != -1) return;
  PS_WARN("checkpoint set %" PRIu64 ": held for %.0f s without %s: going on without it (%d "
          "held push(es) applied now)",
          id, held_s, call ? "meeting the cut" : "a cut from shard 0", n_held);
  if (call) rpc_call_fail(call, RPC_ABORTED, "shard %d could not meet the cut", sv->index);
  release(sv, list);
}

/* ------------------------------------------------------------ shard 0 */

/* The channel to replica r of shard s (r 0 without replication), made at
 * the first call; NULL with the error logged. */
static rpc_channel *shard_channel(ps_server *sv, int s, int r) {
  ps_cut *c = sv->cut;
  int R = sv->repl ? sv->job.replicas_per_shard : 1;
  int v = s * R + r;
  if (!c->ch[v]) {
    char err[PS_ERRLEN];
    rpc_channel_opts co = {.tls = ps_security_tls(&sv->sec)};
    const char *addr = sv->repl ? sv->replica_addrs[v] : sv->cluster.ps[s];
    c->ch[v] = rpc_channel_create(addr, &co, err);
    if (!c->ch[v]) PS_ERROR("checkpoint sets: no channel to shard %d (%s): %s", s, addr, err);
  }
  return c->ch[v];
}

/* One call to every shard at once; answers decoded into resp[s] (NULL on
 * failure, with the status and message in st[s], why[s]). With replicated
 * shards the call goes to each shard's primary: a replica that is not
 * answers UNAVAILABLE naming the one it knows, and the call goes there (or
 * to the next replica) again, a few times at most. */
static void fan_out(ps_server *sv, Ps__CheckpointRequest *req, int timeout_ms,
                    Ps__CheckpointResponse **resp, int *st, char (*why)[PS_ERRLEN]) {
  ps_cut *c = sv->cut;
  int S = sv->cluster.n_ps;
  int R = sv->repl ? sv->job.replicas_per_shard : 1;
  rpc_queue *q = rpc_queue_create();
  for (int s = 0; s < S; s++) {
    resp[s] = NULL;
    st[s] = RPC_UNAVAILABLE;
    snprintf(why[s], PS_ERRLEN, "not called");
  }
  /* This server is its own shard's primary (it coordinates). */
  if (sv->repl) c->cur[sv->index] = sv->replica;
  int electing = 0;
  for (int round = 0; round <= (R > 1 ? R + 1 : 0); round++) {
    rpc_request *calls[PS_MAX_TASKS] = {0};
    int any = 0;
    /* Replicated shards: a call to a replica that is down fails at once
     * (not waiting for it to come back, which may be never: at a stop,
     * for the CUT's long deadline), and the next round asks the replica
     * named, or the next, at once; after half a lease (an election's
     * time) only when a replica said it knows no primary. */
    if (round > 0) {
      pthread_mutex_lock(&c->mu);
      int stopping = c->stopping;
      pthread_mutex_unlock(&c->mu);
      if (stopping) break;
      if (electing) ps_sleep_ms(sv->job.replica_lease_ms / 2);
      electing = 0;
    }
    for (int s = 0; s < S; s++) {
      if (round > 0 && st[s] != RPC_UNAVAILABLE) continue;
      rpc_msg msg;
      if (!q || wire_encode(&req->base, NULL, 0, NULL, NULL, &msg) != 0) {
        snprintf(why[s], PS_ERRLEN, "out of memory");
        continue;
      }
      rpc_channel *ch = shard_channel(sv, s, c->cur[s]);
      if (!ch) {
        rpc_msg_release(&msg);
        continue;
      }
      calls[s] = rpc_start(q, ch, "/ps.ParameterServer/Checkpoint", &msg, timeout_ms, R <= 1,
                           why[s]);
      any = 1;
    }
    if (!any) break;
    for (int s = 0; s < S; s++) {
      if (!calls[s]) continue;
      ps_segview view;
      st[s] = rpc_wait(calls[s], why[s], &view);
      if (st[s] == RPC_OK) {
        ps_seg *segs = malloc((size_t)(view.nsegs > 0 ? view.nsegs : 1) * sizeof *segs);
        ps_segview tensor;
        char err[PS_ERRLEN] = "out of memory";
        resp[s] = segs ? (Ps__CheckpointResponse *)wire_decode(
                             &ps__checkpoint_response__descriptor, &view, segs,
                             view.nsegs > 0 ? view.nsegs : 1, &tensor, err)
                       : NULL;
        free(segs);
        if (!resp[s]) {
          st[s] = RPC_INTERNAL;
          snprintf(why[s], PS_ERRLEN, "malformed answer: %.200s", err);
        }
      } else if (st[s] == RPC_UNAVAILABLE && R > 1) {
        int to = ps_redirect_parse(why[s]);
        if (to == -1) electing = 1;
        c->cur[s] = to >= 0 && to < R && to != c->cur[s] ? to : (c->cur[s] + 1) % R;
      }
      rpc_request_free(calls[s]);
    }
    if (R <= 1) break;
  }
  if (q) rpc_queue_destroy(q);
}

/* A set known complete, into the newest-first list of them (once). */
static void note_complete(ps_cut *c, uint64_t id) {
  int at = 0;
  while (at < c->n_complete && c->complete[at] > id) at++;
  if (at < c->n_complete && c->complete[at] == id) return;
  if (at >= PS_CUT_MAX_KEEP) return;
  int last = c->n_complete < PS_CUT_MAX_KEEP ? c->n_complete : PS_CUT_MAX_KEEP - 1;
  for (int i = last; i > at; i--) c->complete[i] = c->complete[i - 1];
  c->complete[at] = id;
  if (c->n_complete < PS_CUT_MAX_KEEP) c->n_complete++;
}

/* The sets every shard has a file of (the PREPARE answers) are complete: a
 * restore would take them. A coordinator that did not cut them (shard 0's
 * new primary, or shard 0 restarted) learns them here, so that the newest
 * of them is never pruned for a set it does not know. */
static void note_whole_sets(ps_cut *c, Ps__CheckpointResponse **resp, int S) {
  for (size_t i = 0; S > 0 && i < resp[0]->n_sets_on_disk; i++) {
    uint64_t id = resp[0]->sets_on_disk[i];
    int everywhere = 1;
    for (int s = 1; s < S && everywhere; s++) {
      int has = 0;
      for (size_t j = 0; j < resp[s]->n_sets_on_disk && !has; j++)
        has = resp[s]->sets_on_disk[j] == id;
      everywhere = has;
    }
    if (everywhere) note_complete(c, id);
  }
}

/* The sets the next CUT names for deletion (ps_ckpt_sets_to_drop), from the
 * PREPARE answers: every set some shards have and others lack, whoever
 * cut it (this coordinator, or one before it: shard 0's deposed primary,
 * or its process before a restart). */
static int sets_to_drop(ps_cut *c, Ps__CheckpointResponse **resp, int S, uint64_t *drop) {
  const uint64_t *on_disk[PS_MAX_TASKS] = {0};
  size_t n_on_disk[PS_MAX_TASKS] = {0};
  for (int s = 0; s < S; s++) {
    on_disk[s] = resp[s]->sets_on_disk;
    n_on_disk[s] = resp[s]->n_sets_on_disk;
  }
  return ps_ckpt_sets_to_drop(on_disk, n_on_disk, S, c->complete, c->n_complete, drop,
                              PS_CUT_MAX_KEEP);
}

static void free_answers(Ps__CheckpointResponse **resp, int S) {
  for (int s = 0; s < S; s++)
    if (resp[s]) protobuf_c_message_free_unpacked(&resp[s]->base, NULL);
}

static void coord_run(uv_work_t *w) {
  ps_server *sv = w->data;
  ps_cut *c = sv->cut;
  int S = sv->cluster.n_ps;
  double t0 = ps_now_s();
  uint64_t id = (uint64_t)(ps_wall_s() * 1000.0);
  if (id < c->next_set) id = c->next_set;
  c->next_set = id + 1;

  Ps__RequestHeader h = PS__REQUEST_HEADER__INIT;
  h.protocol_version = PS_PROTOCOL_VERSION;
  h.job_id = sv->job.job_id;
  h.token = (ProtobufCBinaryData){.len = sv->sec.token.len, .data = sv->sec.token.bytes};
  Ps__CheckpointRequest req = PS__CHECKPOINT_REQUEST__INIT;
  req.header = &h;
  req.set_id = id;
  req.phase = PS__CHECKPOINT_REQUEST__PHASE__PREPARE;
  if (sv->repl) {
    ps_replica_view v;
    ps_replica_view_get(sv, &v);
    req.coordinator_term = v.term;
  }
  Ps__CheckpointResponse *resp[PS_MAX_TASKS];
  int st[PS_MAX_TASKS];
  static char why[PS_MAX_TASKS][PS_ERRLEN];
  fan_out(sv, &req, PS_CUT_CALL_MS, resp, st, why);
  int bad = -1;
  for (int s = 0; s < S && bad < 0; s++)
    if (st[s] != RPC_OK) bad = s;

  /* The cut: every worker any shard knows, each at the largest round any
   * shard applied; under sync the largest version. */
  Ps__WorkerRound *cut = NULL, **cutp = NULL;
  size_t n_cut = 0;
  uint64_t cut_version = 0;
  if (bad < 0) {
    size_t total = 0;
    for (int s = 0; s < S; s++) total += resp[s]->n_applied;
    cut = malloc((total ? total : 1) * sizeof *cut);
    cutp = malloc((total ? total : 1) * sizeof *cutp);
    for (int s = 0; s < S; s++)
      if (resp[s]->version > cut_version) cut_version = resp[s]->version;
    for (int s = 0; cut && cutp && s < S; s++)
      for (size_t j = 0; j < resp[s]->n_applied; j++) {
        const Ps__WorkerRound *wr = resp[s]->applied[j];
        size_t i = 0;
        while (i < n_cut && cut[i].worker_id != wr->worker_id) i++;
        if (i == n_cut) {
          ps__worker_round__init(&cut[n_cut]);
          cut[n_cut].worker_id = wr->worker_id;
          cutp[n_cut] = &cut[n_cut];
          n_cut++;
        }
        if (wr->round > cut[i].round) cut[i].round = wr->round;
      }
    if (!cut || !cutp) {
      bad = 0;
      snprintf(why[0], PS_ERRLEN, "out of memory");
    }
  }
  uint64_t drop[PS_CUT_MAX_KEEP];
  int n_drop = 0;
  if (bad < 0) {
    note_whole_sets(c, resp, S);
    n_drop = sets_to_drop(c, resp, S, drop);
  }
  free_answers(resp, S);
  const char *phase = "PREPARE";
  if (bad < 0) {
    req.phase = PS__CHECKPOINT_REQUEST__PHASE__CUT;
    req.n_cut = n_cut;
    req.cut = cutp;
    req.cut_version = cut_version;
    /* The sets to keep: the newest complete ones, K - 1 of them (this set
     * makes K), and at least one: this set is not complete until every
     * shard wrote it, so the newest complete set must stay whole until
     * then whatever happens to this one. When none is known, nothing is
     * deleted. */
    int keep = sv->ckpt_keep;
    uint64_t keep_sets[PS_CUT_MAX_KEEP];
    size_t n_keep = 0;
    int want = keep > 1 ? keep - 1 : 1;
    for (int i = 0; keep > 0 && i < c->n_complete && (int)n_keep < want; i++)
      keep_sets[n_keep++] = c->complete[i];
    req.n_keep_sets = n_keep;
    req.keep_sets = keep_sets;
    req.drop_other_layouts = keep > 0 && c->n_complete >= keep;
    req.n_abandoned_sets = (size_t)n_drop;
    req.abandoned_sets = drop;
    fan_out(sv, &req, PS_CUT_WRITE_MS, resp, st, why);
    phase = "CUT";
    for (int s = 0; s < S && bad < 0; s++)
      if (st[s] != RPC_OK) bad = s;
    if (bad < 0) {
      note_complete(c, id);
      char versions[256] = "";
      size_t at = 0;
      for (int s = 0; s < S && at < sizeof versions - 24; s++)
        at += (size_t)snprintf(versions + at, sizeof versions - at, "%s%" PRIu64, s ? " " : "",
                               resp[s]->version);
      PS_INFO("checkpoint set %" PRIu64 " complete: %d shard(s), %zu worker(s) in the cut, "
              "versions [%s], %.0f ms",
              id, S, n_cut, versions, (ps_now_s() - t0) * 1e3);
    }
    free_answers(resp, S);
  }
  free(cut);
  free(cutp);
  if (bad >= 0) {
    PS_WARN("checkpoint set %" PRIu64 " abandoned: %s at shard %d (%s): %s%s", id, phase, bad,
            sv->cluster.ps[bad], why[bad],
            sv->sec.use_tls && !sv->sec.tls.ca_file
                ? " (shard 0 checks the shards' certificates against the system's CAs: give it "
                  "--tls-ca with the CA that signed them)"
                : "");
    /* After its CUT went out, shards may have written it: the next CUT
     * names it for deletion (the PREPARE answers show it incomplete). */
    req.phase = PS__CHECKPOINT_REQUEST__PHASE__ABORT;
    req.n_cut = 0;
    req.cut = NULL;
    req.n_keep_sets = 0;
    req.n_abandoned_sets = 0;
    fan_out(sv, &req, PS_CUT_CALL_MS, resp, st, why);
    free_answers(resp, S);
  }
}

static void coord_done(uv_work_t *w, int status) {
  (void)status;
  ps_server *sv = w->data;
  sv->cut->coordinating = 0;
}

void ps_cut_kick(ps_server *sv) {
  if (sv->cut) atomic_store(&sv->cut->kick, 1);
}

int ps_cut_kicked(ps_server *sv) { return sv->cut && atomic_exchange(&sv->cut->kick, 0); }

int ps_cut_coordinate(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (!c || sv->index != 0 || c->coordinating || c->stopping) return 0;
  c->coordinating = 1;
  c->coord_work.data = sv;
  uv_queue_work(&sv->loop, &c->coord_work, coord_run, coord_done);
  return 1;
}

/* ------------------------------------------------------------ life */

int ps_cut_init(ps_server *sv, uint64_t restored_set) {
  ps_cut *c = calloc(1, sizeof *c);
  if (!c) return PS_ENOMEM;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->quiet, NULL);
  uv_async_init(&sv->loop, &c->wake, on_wake);
  c->wake.data = sv;
  c->next_set = restored_set + 1;
  if (restored_set) {
    c->complete[0] = restored_set;
    c->n_complete = 1;
  }
  sv->cut = c;
  return PS_OK;
}

void ps_cut_set_info(ps_server *sv, uint64_t *set, uint64_t *version) {
  *set = *version = 0;
  ps_cut *c = sv->cut;
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  *set = c->last_set;
  *version = c->last_set_version;
  pthread_mutex_unlock(&c->mu);
}

void ps_cut_drain(ps_server *sv, double max_s) {
  ps_cut *c = sv->cut;
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  c->stopping = 1;
  pthread_mutex_unlock(&c->mu);
  double t0 = ps_now_s();
  for (;;) {
    pthread_mutex_lock(&c->mu);
    int busy = c->coordinating || c->ready || c->writing;
    pthread_mutex_unlock(&c->mu);
    if (!busy) return;
    if (ps_now_s() - t0 > max_s) {
      PS_WARN("checkpoint sets: a set still under way after %.0f s: stopping without it", max_s);
      return;
    }
    uv_run(&sv->loop, UV_RUN_ONCE);
  }
}

void ps_cut_close(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (!c) return;
  /* The RPC server is down: the held calls and the CUT call were
   * cancelled with it, and a write still under way answers nobody. */
  pthread_mutex_lock(&c->mu);
  c->call = NULL;
  held_push *list = end_phase_locked(c);
  pthread_mutex_unlock(&c->mu);
  while (list) {
    held_push *next = list->next;
    held_free(list);
    list = next;
  }
  uv_close((uv_handle_t *)&c->wake, NULL);
}

void ps_cut_free(ps_server *sv) {
  ps_cut *c = sv->cut;
  if (!c) return;
  for (int s = 0; s < PS_MAX_TASKS; s++)
    if (c->ch[s]) rpc_channel_destroy(c->ch[s]);
  ps_ckpt_state_free(&c->state);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->quiet);
  free(c);
  sv->cut = NULL;
}

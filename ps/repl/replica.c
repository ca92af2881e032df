/* Replicated shards: the primary's log and senders, the backups' apply,
 * snapshots, elections and the vote store, as ps/repl/replica.h describes. */
#include "ps/repl/replica.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/crc32c.h"
#include "common/optim.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "ps/core/rows.h"
#include "ps/core/server.h"
#include "ps/core/update.h"
#include "ps/state/table_sync.h"

enum { FOLLOWER = 0, PRIMARY = 1 };
/* Entries per Replicate call (and bytes: ps_replica_max_request). */
#define BATCH_ENTRIES 64
/* Entries the log keeps for replicas that are not members yet, beyond
 * what the members need: one that lags further takes a snapshot. */
#define LOG_SPARE 256

typedef struct {
  uint64_t term, seq;
} pos_t;

typedef struct {
  uint64_t term;
  int primary;
  uint32_t members; /* bit r: replica r */
} cfg_t;

/* An update in the primary's log. */
typedef struct rentry {
  struct rentry *next;
  int refs; /* the log's and senders' (under mu) */
  pos_t pos;
  int kind;
  uint64_t worker, request_id, base_version, offset, count, step;
  char host[64], role[16];
  int task_index;
  uint8_t session[PS_SESSION_LEN];
  int reader, idle;
  uint8_t *grad;
  size_t grad_len;
  int64_t now_ms, timeout_ms;
  uint64_t complete_lease, dataset_size;
  int want_next, names_leases;
  int quorum, result, divisor; /* SYNC_STEP */
  uint64_t *ids; /* LEASE_RENEW: the leases named; REGISTER: the chunks named done */
  size_t n_ids;
  /* REGISTER: the leases a returning worker named (one allocation: n_held
   * messages, then their pointers) */
  Ps__HeldLease *held, **held_p;
  size_t n_held;
  uint64_t trained;  /* LEASE: examples trained of the lease completed */
  uint64_t lease_id; /* PUSH: the lease its examples were drawn from */
  uint32_t batch;    /* PUSH: its examples */
  /* PUSH: the push's embedding rows, as the entry sends them */
  Ps__TableRows rows[PS_MAX_TABLES], *rows_p[PS_MAX_TABLES];
  size_t n_rows;
  uint8_t *row_ids; /* the sections' ids, uint64 LE */
  /* answered at commit */
  rpc_call *call;
  uint8_t *reply;
  size_t reply_len;
  int rec_kind;
  uint64_t rid;
} rentry;

typedef struct {
  struct ps_replica *rp;
  int r;
  pthread_t thread;
  int started;
  uint64_t next;    /* the next seq to send */
  int matched;      /* its position is in this primary's history up to next-1 */
  int need_snapshot;
  uint64_t acked;   /* applied, in this primary's history */
  int64_t last_ok_ms;
  uint64_t hold; /* a snapshot at this seq is on its way: keep the log after it (0: none) */
  int answering;  /* its last call was answered: a snapshot is worth sending */
  rpc_channel *ch;
} peer_t;

struct ps_replica {
  ps_server *sv;
  int R, S, N, me, server;
  size_t batch_bytes; /* gradient bytes per Replicate call (one entry at least) */
  char (*addrs)[PS_ADDR_LEN]; /* N */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int running;
  int role;
  uint64_t term;
  cfg_t cfg;        /* the configuration of term as known (term 0: none) */
  int64_t heard_ms; /* follower: the last Replicate of the primary */
  pos_t pos;        /* the last update applied */
  /* Started (from a checkpoint or nothing) and took no state from a
   * primary since: it holds no acknowledged update, so it may not lead
   * while a member that holds them may be alive. */
  int fresh;
  /* primary */
  rentry *head, *tail;
  pos_t log_base; /* the position before head */
  int log_len;
  uint64_t commit;
  uint32_t pending_add; /* replicas counted for acknowledgements, not yet members */
  peer_t peer[PS_MAX_REPLICAS];
  pthread_t manager;
  int manager_started;
  int64_t next_election_ms;
  int64_t became_ms;  /* when it last became the primary */
  uint64_t reigns;    /* how many times it became the primary (ps_replica_reign) */
  int said_first_ack; /* the first answer of that term was logged */
  uint64_t acked;     /* updates answered as the primary, since the start */
  int deferrals;      /* elections given up for a member further ahead, since a primary was heard */
  /* The last election was lost only for want of answers (voters slow or
   * down, none promised a later term to another candidate): the next try
   * comes after a heartbeat rather than the randomized back-off. */
  int lost_to_silence;
  /* votes: this server's, for every shard */
  pthread_mutex_t vote_mu;
  char vote_path[PATH_MAX];
  uint64_t *promised;
  cfg_t *accepted;
  /* The newest term whose primary this replica followed or was: after a
   * restart it still refuses older terms (a deposed primary must not count
   * it among its members again). */
  uint64_t followed;
  uint64_t seen_term; /* the highest term any voter reported: the next run goes above */
  rpc_channel **vote_ch; /* N, made at the first election */
};

/* A deadline ms from now on the monotonic clock (cv's). */
static struct timespec ps_deadline_in_ms(int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  if (ms < 0) ms = 0;
  ts.tv_sec += (time_t)(ms / 1000);
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

static uint32_t bit(int r) { return 1u << (unsigned)r; }
static int is_member(const cfg_t *c, int r) { return (c->members & bit(r)) != 0; }

/* ------------------------------------------------------------ vote store */

#define VOTE_MAGIC "PSVOTES2"
#define VOTE_REC 32 /* per shard: promised, accepted (term, primary, members), followed */

/* Writes the store (vote_mu held); fsynced before the caller answers. */
static int votes_save(ps_replica *rp, char *err) {
  size_t n = 8 + 4 + (size_t)rp->S * VOTE_REC + 4;
  uint8_t *b = calloc(1, n);
  if (!b) return ps_seterr(err, PS_ENOMEM, "out of memory");
  memcpy(b, VOTE_MAGIC, 8);
  ps_put_le32(b + 8, (uint32_t)rp->S);
  for (int s = 0; s < rp->S; s++) {
    uint8_t *p = b + 12 + (size_t)s * VOTE_REC;
    ps_put_le64(p, rp->promised[s]);
    ps_put_le64(p + 8, rp->accepted[s].term);
    ps_put_le32(p + 16, (uint32_t)rp->accepted[s].primary);
    ps_put_le32(p + 20, rp->accepted[s].members);
    ps_put_le64(p + 24, s == rp->sv->index ? rp->followed : 0);
  }
  ps_put_le32(b + n - 4, ps_crc32c(0, b, n - 4));
  int rc = ps_write_file_atomic(rp->vote_path, b, n, err);
  free(b);
  return rc;
}

static int votes_load(ps_replica *rp, char *err) {
  FILE *f = fopen(rp->vote_path, "rb");
  if (!f) return PS_OK; /* none yet: nothing promised */
  size_t want = 8 + 4 + (size_t)rp->S * VOTE_REC + 4;
  uint8_t *b = malloc(want + 1);
  size_t got = b ? fread(b, 1, want + 1, f) : 0;
  fclose(f);
  if (!b) return ps_seterr(err, PS_ENOMEM, "out of memory");
  int rc = PS_OK;
  if (got != want || memcmp(b, VOTE_MAGIC, 8) != 0 || ps_get_le32(b + 8) != (uint32_t)rp->S ||
      ps_get_le32(b + want - 4) != ps_crc32c(0, b, want - 4)) {
    rc = ps_seterr(err, PS_EINVAL,
                   "%s is not a vote file of %d shards (damaged, or from another layout): a "
                   "server that forgot its votes could grant a term twice, so it does not start; "
                   "remove the file only if every server of the job starts afresh",
                   rp->vote_path, rp->S);
  } else {
    for (int s = 0; s < rp->S; s++) {
      const uint8_t *p = b + 12 + (size_t)s * VOTE_REC;
      rp->promised[s] = ps_get_le64(p);
      rp->accepted[s].term = ps_get_le64(p + 8);
      rp->accepted[s].primary = (int)ps_get_le32(p + 16);
      rp->accepted[s].members = ps_get_le32(p + 20);
      if (s == rp->sv->index) rp->followed = ps_get_le64(p + 24);
    }
  }
  free(b);
  return rc;
}

/* Records (fsynced) that this replica follows or leads term t from now
 * on. 0, or an error (logged): the caller then takes no update of t. */
static int follow_term(ps_replica *rp, uint64_t t) {
  char err[PS_ERRLEN];
  pthread_mutex_lock(&rp->vote_mu);
  int rc = PS_OK;
  if (t > rp->followed) {
    uint64_t old = rp->followed;
    rp->followed = t;
    rc = votes_save(rp, err);
    if (rc != PS_OK) {
      rp->followed = old;
      PS_ERROR("replication: cannot record term %" PRIu64 ": %s", t, err);
    }
  }
  pthread_mutex_unlock(&rp->vote_mu);
  return rc;
}

/* One voter's answer (the local one, or the Vote RPC's). */
static int vote_local(ps_replica *rp, int shard, uint64_t term, int phase, const cfg_t *c,
                      uint64_t *promised, cfg_t *accepted) {
  char err[PS_ERRLEN];
  pthread_mutex_lock(&rp->vote_mu);
  int granted = 0;
  uint64_t old_p = rp->promised[shard];
  cfg_t old_a = rp->accepted[shard];
  if (phase == PS__VOTE_REQUEST__PHASE__PREPARE && term > rp->promised[shard]) {
    rp->promised[shard] = term;
    granted = 1;
  } else if (phase == PS__VOTE_REQUEST__PHASE__ACCEPT && term >= rp->promised[shard] && c) {
    rp->promised[shard] = term;
    rp->accepted[shard] = *c;
    granted = 1;
  }
  if (granted && votes_save(rp, err) != PS_OK) {
    PS_ERROR("replication: cannot write my votes: %s; vote refused", err);
    rp->promised[shard] = old_p;
    rp->accepted[shard] = old_a;
    granted = 0;
  }
  *promised = rp->promised[shard];
  *accepted = rp->accepted[shard];
  pthread_mutex_unlock(&rp->vote_mu);
  return granted;
}

static void cfg_to_msg(const cfg_t *c, Ps__ReplicaConfig *m, uint32_t *buf) {
  ps__replica_config__init(m);
  m->term = c->term;
  m->primary = (uint32_t)(c->primary >= 0 ? c->primary : 0);
  size_t n = 0;
  for (int r = 0; r < 32; r++)
    if (c->members & bit(r)) buf[n++] = (uint32_t)r;
  m->n_members = n;
  m->members = buf;
}

/* PS_EINVAL when m is not a configuration of R replicas. */
static int cfg_from_msg(const Ps__ReplicaConfig *m, int R, cfg_t *c) {
  if (!m) return PS_EINVAL;
  c->term = m->term;
  c->primary = (int)m->primary;
  c->members = 0;
  if (m->primary >= (uint32_t)R) return PS_EINVAL;
  for (size_t i = 0; i < m->n_members; i++) {
    if (m->members[i] >= (uint32_t)R) return PS_EINVAL;
    c->members |= bit((int)m->members[i]);
  }
  return is_member(c, c->primary) ? PS_OK : PS_EINVAL;
}

void ps_replica_handle_vote(ps_server *sv, rpc_call *call, const void *request) {
  ps_replica *rp = sv->repl;
  const Ps__VoteRequest *r = request;
  if (!rp) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION, "server %d does not replicate its shard",
                  sv->index);
    return;
  }
  cfg_t c = {0};
  if (r->shard >= (uint32_t)rp->S || r->term == 0 ||
      (r->phase != PS__VOTE_REQUEST__PHASE__PREPARE &&
       r->phase != PS__VOTE_REQUEST__PHASE__ACCEPT) ||
      (r->phase == PS__VOTE_REQUEST__PHASE__ACCEPT &&
       (cfg_from_msg(r->config, rp->R, &c) != PS_OK || c.term != r->term))) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT,
                  "Vote: shard %u, term %" PRIu64 ", phase %d is not a vote of this job's %d "
                  "shards x %d replicas",
                  r->shard, r->term, (int)r->phase, rp->S, rp->R);
    return;
  }
  uint64_t promised;
  cfg_t acc;
  int granted = vote_local(rp, (int)r->shard, r->term, (int)r->phase,
                           r->phase == PS__VOTE_REQUEST__PHASE__ACCEPT ? &c : NULL, &promised,
                           &acc);
  Ps__VoteResponse resp = PS__VOTE_RESPONSE__INIT;
  Ps__ReplicaConfig am;
  uint32_t buf[32];
  cfg_to_msg(&acc, &am, buf);
  resp.granted = granted;
  resp.promised = promised;
  resp.accepted = &am;
  wire_reply(call, &resp.base);
}

/* ------------------------------------------------------------ log */

static void entry_unref(rentry *e) {
  if (!e || --e->refs > 0) return;
  free(e->ids);
  free(e->held);
  free(e->grad);
  free(e->row_ids);
  free(e->reply);
  free(e);
}

/* Position of seq (in the log or its base); 0 when the log no longer
 * holds it. mu held. */
static int log_pos(ps_replica *rp, uint64_t seq, pos_t *out) {
  if (seq == rp->log_base.seq) {
    *out = rp->log_base;
    return 1;
  }
  for (rentry *e = rp->head; e; e = e->next)
    if (e->pos.seq == seq) {
      *out = e->pos;
      return 1;
    }
  return 0;
}

static void fail_call_redirect(ps_replica *rp, rpc_call *call) {
  rpc_call_fail(call, RPC_UNAVAILABLE,
                "shard %d replica %d lost its primary role before every replica had the update: "
                "send it again" PS_REDIRECT_FMT,
                rp->sv->index, rp->me, -1);
}

/* Answers the entries every member (and every replica being added)
 * applied, and drops from the log what no replica needs. mu held. */
static void advance_commit(ps_replica *rp) {
  if (rp->role != PRIMARY) return;
  uint64_t target = rp->pos.seq;
  uint32_t need = (rp->cfg.members | rp->pending_add) & ~bit(rp->me);
  for (int r = 0; r < rp->R; r++)
    if (need & bit(r)) {
      const peer_t *p = &rp->peer[r];
      uint64_t a = p->matched ? p->acked : rp->log_base.seq;
      if (a < target) target = a;
    }
  for (rentry *e = rp->head; e && e->pos.seq <= target; e = e->next) {
    if (e->pos.seq <= rp->commit) continue;
    if (e->rid)
      ps_membership_request_end(rp->sv->members, e->worker, e->rec_kind, e->rid, e->reply,
                                e->reply_len <= PS_REPLY_MAX ? e->reply_len : 0);
    if (e->call && !rp->said_first_ack) {
      rp->said_first_ack = 1;
      PS_INFO("replication: first acknowledged update as the primary, %" PRId64
              " ms after taking over",
              ps_now_ms() - rp->became_ms);
    }
    if (e->call) {
      rp->acked++;
      rpc_msg out = {.nseg = 1};
      out.seg[0] = (rpc_seg){.ptr = e->reply, .len = e->reply_len}; /* copied */
      rpc_call_reply(e->call, &out);
      e->call = NULL;
    }
  }
  if (target > rp->commit) rp->commit = target;
  /* What may go: committed, and sent to every matched non-member, or
   * beyond the spare (that one then takes a snapshot). */
  uint64_t keep_from = rp->commit;
  for (int r = 0; r < rp->R; r++) {
    if (r == rp->me || (need & bit(r))) continue;
    const peer_t *p = &rp->peer[r];
    if (p->matched && p->acked < keep_from) keep_from = p->acked;
    if (p->hold && p->hold < keep_from) keep_from = p->hold;
  }
  while (rp->head && rp->head->pos.seq <= rp->commit &&
         (rp->head->pos.seq <= keep_from || rp->log_len > LOG_SPARE)) {
    rentry *e = rp->head;
    rp->head = e->next;
    if (!rp->head) rp->tail = NULL;
    rp->log_base = e->pos;
    rp->log_len--;
    entry_unref(e);
  }
}

/* Stops being the primary: the calls still waiting are told to go
 * elsewhere; the staged answers become answers (this state holds their
 * updates, and a replica that takes it answers them so). mu held. */
static void step_down(ps_replica *rp, uint64_t term, const char *why) {
  if (term > rp->term) rp->term = term;
  if (rp->role == PRIMARY) {
    PS_WARN("replication: shard %d replica %d is no longer the primary (term %" PRIu64 "): %s",
            rp->sv->index, rp->me, rp->term, why);
    for (rentry *e = rp->head; e; e = e->next)
      if (e->call) {
        fail_call_redirect(rp, e->call);
        e->call = NULL;
      }
    while (rp->head) {
      rentry *e = rp->head;
      rp->head = e->next;
      entry_unref(e);
    }
    rp->tail = NULL;
    rp->log_len = 0;
    ps_membership_request_settle(rp->sv->members);
    rp->cfg.primary = -1;
  }
  rp->role = FOLLOWER;
  rp->pending_add = 0;
  rp->heard_ms = ps_now_ms();
  pthread_cond_broadcast(&rp->cv);
}

int ps_replica_lock(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return 0;
  pthread_mutex_lock(&rp->mu);
  if (rp->role == PRIMARY && rp->running) return 0;
  pthread_mutex_unlock(&rp->mu);
  return PS_ESTATE;
}

void ps_replica_unlock(ps_server *sv) {
  if (sv->repl) pthread_mutex_unlock(&sv->repl->mu);
}

int ps_replica_append(ps_server *sv, const ps_update *u, rpc_call *call,
                      const ProtobufCMessage *reply, int rec_kind, uint64_t rid) {
  ps_replica *rp = sv->repl;
  size_t rlen = reply ? protobuf_c_message_get_packed_size(reply) : 0;
  rentry *e = calloc(1, sizeof *e);
  uint8_t *rb = malloc(rlen ? rlen : 1);
  uint8_t *g = u->gradient && u->gradient->total ? malloc(u->gradient->total) : NULL;
  size_t n_ids = u->n_leases ? u->n_leases : u->n_done;
  const uint64_t *ids_in = u->n_leases ? u->leases : u->done_chunks;
  uint64_t *ids = n_ids ? malloc(n_ids * sizeof *ids) : NULL;
  size_t n_row_ids = u->rows ? u->rows->total : 0;
  uint8_t *row_ids = n_row_ids ? malloc(8 * n_row_ids) : NULL;
  const size_t n_held = u->n_held < PS_HELD_NAMED ? u->n_held : PS_HELD_NAMED;
  Ps__HeldLease *held = n_held ? malloc(n_held * (sizeof *held + sizeof(Ps__HeldLease *))) : NULL;
  if (!e || !rb || (u->gradient && u->gradient->total && !g) || (n_ids && !ids) ||
      (n_row_ids && !row_ids) || (n_held && !held)) {
    free(held);
    free(e);
    free(rb);
    free(g);
    free(ids);
    free(row_ids);
    /* The update is applied here but in no entry: every backup takes the
     * whole state instead (its position would match a state it lacks). */
    ps_replica_diverged(sv);
    return PS_ENOMEM;
  }
  if (reply) protobuf_c_message_pack(reply, rb);
  if (g) ps_segview_copy(u->gradient, 0, g, u->gradient->total);
  e->refs = 1;
  e->kind = u->kind;
  e->worker = u->worker;
  e->request_id = u->request_id;
  e->base_version = u->base_version;
  e->offset = u->offset;
  e->count = u->count;
  e->step = u->step;
  snprintf(e->host, sizeof e->host, "%s", u->host ? u->host : "");
  snprintf(e->role, sizeof e->role, "%s", u->role ? u->role : "");
  e->task_index = u->task_index;
  if (u->session) memcpy(e->session, u->session, PS_SESSION_LEN);
  e->reader = u->reader;
  e->idle = u->idle;
  e->grad = g;
  e->grad_len = g ? u->gradient->total : 0;
  if (n_ids) memcpy(ids, ids_in, n_ids * sizeof *ids);
  e->ids = ids;
  e->n_ids = n_ids;
  e->held = held;
  e->held_p = held ? (Ps__HeldLease **)(void *)(held + n_held) : NULL;
  e->n_held = n_held;
  for (size_t i = 0; i < e->n_held; i++) {
    ps__held_lease__init(&e->held[i]);
    e->held[i].lease_id = u->held[i].lease_id;
    e->held[i].epoch = u->held[i].epoch;
    e->held[i].chunk = u->held[i].chunk;
    e->held[i].finished = u->held[i].finished;
    e->held[i].trained = u->held[i].trained;
    e->held[i].refused = u->held[i].refused;
    e->held_p[i] = &e->held[i];
  }
  e->trained = u->trained;
  e->lease_id = u->lease_id;
  e->batch = u->batch;
  if (u->rows) {
    size_t at = 0;
    for (int i = 0; i < u->rows->n_sec; i++) {
      const size_t k = u->rows->sec[i].n;
      for (size_t j = 0; j < k; j++) ps_put_le64(row_ids + 8 * (at + j), u->rows->sec[i].ids[j]);
      ps__table_rows__init(&e->rows[i]);
      e->rows[i].table = (uint32_t)u->rows->sec[i].table;
      e->rows[i].ids = (ProtobufCBinaryData){.len = 8 * k, .data = k ? row_ids + 8 * at : NULL};
      e->rows_p[i] = &e->rows[i];
      at += k;
    }
    e->n_rows = (size_t)u->rows->n_sec;
    e->row_ids = row_ids;
  }
  e->now_ms = u->now_ms;
  e->timeout_ms = u->timeout_ms;
  e->complete_lease = u->complete_lease;
  e->dataset_size = u->dataset_size;
  e->want_next = u->want_next;
  e->names_leases = u->names_leases;
  e->quorum = u->quorum;
  e->divisor = u->divisor;
  e->result = u->result;
  e->call = call;
  e->reply = rb;
  e->reply_len = rlen;
  e->rec_kind = rec_kind;
  e->rid = rid;
  if (rid && reply) ps_membership_request_stage(sv->members, u->worker, rec_kind, rid, rb, rlen);
  rp->pos.seq++;
  rp->pos.term = rp->term;
  e->pos = rp->pos;
  if (rp->tail)
    rp->tail->next = e;
  else
    rp->head = e;
  rp->tail = e;
  rp->log_len++;
  advance_commit(rp); /* a primary alone answers at once */
  pthread_cond_broadcast(&rp->cv);
  return PS_OK;
}

void ps_replica_diverged(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return;
  for (int r = 0; r < rp->R; r++) {
    rp->peer[r].need_snapshot = 1;
    rp->peer[r].matched = 0;
  }
}

int ps_replica_known_primary(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return 0;
  pthread_mutex_lock(&rp->mu);
  int p = rp->role == PRIMARY ? rp->me : rp->cfg.term ? rp->cfg.primary : -1;
  pthread_mutex_unlock(&rp->mu);
  return p;
}

void ps_replica_redirect(ps_server *sv, rpc_call *call, const char *method) {
  ps_replica *rp = sv->repl;
  int p = ps_replica_known_primary(sv);
  if (p == rp->me) p = -1; /* it just stepped down */
  rpc_call_fail(call, RPC_UNAVAILABLE,
                "%s: shard %d replica %d (%s) is not the shard's primary" PS_REDIRECT_FMT, method,
                sv->index, rp->me, rp->addrs[rp->server], p);
}

int ps_replica_is_primary(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return 1;
  pthread_mutex_lock(&rp->mu);
  int p = rp->role == PRIMARY;
  pthread_mutex_unlock(&rp->mu);
  return p;
}

uint64_t ps_replica_reign(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return 1;
  pthread_mutex_lock(&rp->mu);
  uint64_t r = rp->role == PRIMARY ? rp->reigns : 0;
  pthread_mutex_unlock(&rp->mu);
  return r;
}

const char *ps_replica_addr(ps_server *sv, int r) {
  ps_replica *rp = sv->repl;
  return rp->addrs[sv->index * rp->R + r];
}

void ps_replica_view_get(ps_server *sv, ps_replica_view *v) {
  ps_replica *rp = sv->repl;
  memset(v, 0, sizeof *v);
  v->primary = -1;
  if (!rp) return;
  pthread_mutex_lock(&rp->mu);
  v->replica = rp->me;
  int heard = ps_now_ms() - rp->heard_ms <= rp->sv->job.replica_lease_ms;
  v->role = rp->role == PRIMARY ? "primary" : heard && rp->cfg.term ? "backup" : "follower";
  v->term = rp->term;
  v->seq = rp->pos.seq;
  v->seq_term = rp->pos.term;
  v->fresh = rp->fresh;
  v->acked = rp->acked;
  v->primary = rp->role == PRIMARY ? rp->me : rp->cfg.term ? rp->cfg.primary : -1;
  for (int r = 0; r < rp->R && v->n_members < 8; r++)
    if (is_member(&rp->cfg, r)) v->members[v->n_members++] = (uint32_t)r;
  for (int r = 0; rp->role == PRIMARY && r < rp->R && v->n_in_sync < 8; r++)
    if (is_member(&rp->cfg, r) && (r == rp->me || (rp->peer[r].matched && !rp->peer[r].need_snapshot)))
      v->in_sync[v->n_in_sync++] = (uint32_t)r;
  pthread_mutex_unlock(&rp->mu);
}

/* ------------------------------------------------------------ applying */

/* A replayed call's answer: the same as the primary's, or this state has
 * diverged (PS_ESTATE); kept under the request id, as the primary keeps
 * it, for a retry after a fail-over. */
static int record_answer(ps_server *sv, const Ps__ReplicaEntry *e, int kind,
                         const ProtobufCMessage *resp) {
  uint8_t buf[PS_REPLY_MAX];
  size_t len = protobuf_c_message_get_packed_size(resp);
  if (len > sizeof buf) return PS_ESTATE;
  protobuf_c_message_pack(resp, buf);
  if (e->reply.len && (e->reply.len != len || memcmp(e->reply.data, buf, len) != 0)) {
    PS_WARN("replication: entry %" PRIu64 " answers differently here than on the primary", e->seq);
    return PS_ESTATE;
  }
  if (!e->request_id) return PS_OK;
  uint8_t dummy[PS_REPLY_MAX];
  size_t dl = 0;
  ps_membership_request_begin(sv->members, e->worker_id, kind, e->request_id, dummy,
                              sizeof dummy, &dl);
  ps_membership_request_end(sv->members, e->worker_id, kind, e->request_id, buf, len);
  return PS_OK;
}

/* The update an entry carries, as its primary applied it (the pointers
 * borrowed from the entry; rows: its embedding rows, read and checked). */
static ps_update entry_update(const Ps__ReplicaEntry *e, ps_segview *view, const ps_rows_req *rows,
                              ps_lease_held *held) {
  size_t n_held = ps_update_held_from_msg(e->held_leases, e->n_held_leases, held);
  return (ps_update){.kind = (int)e->kind,
                     .worker = e->worker_id,
                     .request_id = e->request_id,
                     .base_version = e->base_version,
                     .offset = e->offset,
                     .count = e->count,
                     .step = e->step,
                     .host = e->host,
                     .role = e->role,
                     .task_index = e->task_index,
                     .session = e->session.len == PS_SESSION_LEN ? e->session.data : NULL,
                     .reader = e->reader,
                     .idle = e->idle,
                     .gradient = view,
                     .rows = rows,
                     .now_ms = e->now_ms,
                     .timeout_ms = e->timeout_ms,
                     .complete_lease = e->complete_lease,
                     .dataset_size = e->dataset_size,
                     .want_next = e->want_next,
                     .names_leases = e->names_leases,
                     .leases = e->leases,
                     .n_leases = e->n_leases,
                     .done_chunks = e->done_chunks,
                     .n_done = e->n_done_chunks,
                     .held = held,
                     .n_held = n_held,
                     .trained = e->trained_examples,
                     .lease_id = e->lease_id,
                     .batch = e->batch_size,
                     .quorum = e->quorum,
                     .divisor = e->divisor,
                     .result = e->result};
}

/* Applies one entry on a backup, as the primary did: the same update,
 * through the same ps_update_apply. 0, or PS_ESTATE when this state cannot
 * take it (it has diverged: a snapshot mends it). */
static int apply_entry(ps_server *sv, const Ps__ReplicaEntry *e) {
  char err[PS_ERRLEN];
  ps_seg seg = {.ptr = e->gradient.data, .len = e->gradient.len};
  ps_segview view = {.segs = &seg, .nsegs = 1, .total = e->gradient.len};
  ps_rows_req *rows = NULL;
  switch (e->kind) {
    case PS__REPLICA_ENTRY__KIND__PUSH: {
      uint64_t round = 0;
      if (ps_membership_round(sv->members, e->worker_id, &round) != PS_OK) {
        PS_WARN("replication: entry %" PRIu64 " names worker %016" PRIx64 ", unknown here",
                e->seq, e->worker_id);
        return PS_ESTATE;
      }
      if (ps_rows_from_msg(sv, e->rows, e->n_rows, &rows, err) != PS_OK) {
        PS_WARN("replication: entry %" PRIu64 " (a push) names rows refused here: %s", e->seq,
                err);
        return PS_ESTATE;
      }
      break;
    }
    case PS__REPLICA_ENTRY__KIND__REGISTER:
      if (e->session.len != PS_SESSION_LEN) return PS_ESTATE;
      break;
    case PS__REPLICA_ENTRY__KIND__SYNC_STEP:
    case PS__REPLICA_ENTRY__KIND__LEASE:
    case PS__REPLICA_ENTRY__KIND__LEASE_RENEW:
    case PS__REPLICA_ENTRY__KIND__LEASE_EXPIRE:
    case PS__REPLICA_ENTRY__KIND__LEAVE:
    case PS__REPLICA_ENTRY__KIND__IDLE:
      break;
    default:
      return PS_ESTATE;
  }
  ps_lease_held held[PS_HELD_NAMED];
  const ps_update u = entry_update(e, &view, rows, held);
  ps_update_result res = {.lease = PS__LEASE_RESPONSE__INIT};
  int rc = ps_update_apply(sv, &u, 1, &res, err);
  ps_rows_free(rows);
  if (rc != 0) {
    PS_WARN("replication: entry %" PRIu64 " (kind %d) refused here: %s", e->seq, (int)e->kind,
            err);
    return PS_ESTATE;
  }
  switch (e->kind) {
    case PS__REPLICA_ENTRY__KIND__PUSH: {
      Ps__PushResponse resp = PS__PUSH_RESPONSE__INIT;
      resp.version = res.version;
      resp.staleness = res.staleness;
      resp.dropped = res.dropped;
      return record_answer(sv, e, PS_METHOD_PUSH, &resp.base);
    }
    case PS__REPLICA_ENTRY__KIND__SYNC_STEP:
      if (res.step != e->result) {
        PS_WARN("replication: entry %" PRIu64 " (a sync step) gives %d here, %d on the primary",
                e->seq, res.step, e->result);
        return PS_ESTATE;
      }
      return PS_OK;
    case PS__REPLICA_ENTRY__KIND__LEASE:
      return record_answer(sv, e, PS_METHOD_LEASE, &res.lease.base);
    default:
      return PS_OK;
  }
}

/* ------------------------------------------------------------ snapshots */

typedef struct {
  Ps__ReplicaSnapshot snap;
  Ps__ReplicaPosition pos;
  float *params;
  float *slots[8];
  ProtobufCBinaryData slot_bin[8];
  ps_member_state *ms;
  int n_ms;
  Ps__ReplicaWorker *w;
  Ps__ReplicaWorker **wp;
  Ps__ReplicaRecent *rec;
  Ps__ReplicaRecent **recp;
  void *leases;
  size_t leases_len;
  float *sync_sum;
  uint64_t *sync_ids;
  /* embedding tables' rows and a sync step's rows (one buffer each) */
  Ps__ReplicaRows trows[PS_MAX_TABLES], *trows_p[PS_MAX_TABLES];
  Ps__ReplicaRows srows[PS_MAX_TABLES], *srows_p[PS_MAX_TABLES];
  uint8_t *tbuf[PS_MAX_TABLES], *sbuf[PS_MAX_TABLES];
} snap_buf;

static void snap_free(snap_buf *b) {
  free(b->params);
  for (int k = 0; k < 8; k++) free(b->slots[k]);
  free(b->ms);
  free(b->w);
  free(b->wp);
  free(b->rec);
  free(b->recp);
  free(b->leases);
  free(b->sync_sum);
  free(b->sync_ids);
  for (int t = 0; t < PS_MAX_TABLES; t++) {
    free(b->tbuf[t]);
    free(b->sbuf[t]);
  }
}

/* Embedding rows into a snapshot: a ReplicaRows' three arrays carved out
 * of one buffer of n rows of vals floats each. */
typedef struct {
  Ps__ReplicaRows *m;
  size_t n, at, vals;
  int table; /* sync rows: the table walked */
} rows_fill;

static int rows_alloc(Ps__ReplicaRows *m, uint8_t **buf, int table, size_t n, size_t vals) {
  *buf = malloc(n ? n * (12 + 4 * vals) : 1);
  if (!*buf) return PS_ENOMEM;
  ps__replica_rows__init(m);
  m->table = (uint32_t)table;
  m->ids = (ProtobufCBinaryData){.len = 8 * n, .data = *buf};
  m->counts = (ProtobufCBinaryData){.len = 4 * n, .data = *buf + 8 * n};
  m->values = (ProtobufCBinaryData){.len = 4 * vals * n, .data = *buf + 12 * n};
  return PS_OK;
}

static void rows_put(rows_fill *f, uint64_t id, uint32_t count, const float *v) {
  ps_put_le64(f->m->ids.data + 8 * f->at, id);
  ps_put_le32(f->m->counts.data + 4 * f->at, count);
  memcpy(f->m->values.data + 4 * f->vals * f->at, v, 4 * f->vals);
  f->at++;
}

static int count_table_row(void *user, uint64_t id, uint32_t t, const float *rec) {
  (void)id, (void)t, (void)rec;
  ((rows_fill *)user)->n++;
  return 0;
}
static int fill_table_row(void *user, uint64_t id, uint32_t t, const float *rec) {
  rows_fill *f = user;
  if (f->at == f->n) return 1;
  rows_put(f, id, t, rec);
  return 0;
}
static int count_sum_row(void *user, int table, uint64_t id, uint32_t count, const float *sum) {
  (void)id, (void)count, (void)sum;
  ((size_t *)user)[table]++;
  return 0;
}
static int fill_sum_row(void *user, int table, uint64_t id, uint32_t count, const float *sum) {
  rows_fill *f = &((rows_fill *)user)[table];
  if (f->at == f->n) return 1;
  rows_put(f, id, count, sum);
  return 0;
}

/* Every table's pushed rows and (sync) the step's rows into the snapshot.
 * mu held: no update in between. PS_ENOMEM. */
static int snap_take_rows(ps_server *sv, snap_buf *b) {
  for (int t = 0; t < sv->n_tables; t++) {
    ps_table *tb = sv->tables[t];
    const size_t vals = (size_t)ps_table_spec_of(tb)->dim * (size_t)(1 + ps_table_n_slots(tb));
    ps_table_read_lock(tb);
    rows_fill f = {.vals = vals};
    ps_table_each_row(tb, count_table_row, &f);
    int rc = rows_alloc(&b->trows[t], &b->tbuf[t], t, f.n, vals);
    if (rc == PS_OK) {
      f.m = &b->trows[t];
      ps_table_each_row(tb, fill_table_row, &f);
    }
    ps_table_unlock(tb);
    if (rc != PS_OK) return rc;
    b->trows_p[t] = &b->trows[t];
  }
  b->snap.n_tables = (size_t)sv->n_tables;
  b->snap.tables = sv->n_tables ? b->trows_p : NULL;
  if (!sv->rows_sum || ps_rows_sum_count(sv->rows_sum) == 0) return PS_OK;
  size_t per[PS_MAX_TABLES] = {0};
  ps_rows_sum_each(sv->rows_sum, count_sum_row, per);
  rows_fill f[PS_MAX_TABLES];
  for (int t = 0; t < sv->n_tables; t++) {
    const size_t vals = (size_t)ps_table_spec_of(sv->tables[t])->dim;
    if (rows_alloc(&b->srows[t], &b->sbuf[t], t, per[t], vals) != PS_OK) return PS_ENOMEM;
    f[t] = (rows_fill){.m = &b->srows[t], .n = per[t], .vals = vals, .table = t};
    b->srows_p[t] = &b->srows[t];
  }
  ps_rows_sum_each(sv->rows_sum, fill_sum_row, f);
  b->snap.n_sync_rows = (size_t)sv->n_tables;
  b->snap.sync_rows = b->srows_p;
  return PS_OK;
}

/* Checks a snapshot's rows before anything is replaced: each table once,
 * arrays of one row count, ids of the table placed here (each once),
 * values finite. PS_EINVAL / PS_ENOMEM with a message. */
static int snap_check_rows(ps_server *sv, Ps__ReplicaRows *const *rows, size_t n, int sum,
                           char *err) {
  const char *what = sum ? "sync step's rows" : "table rows";
  if (n > (size_t)sv->n_tables)
    return ps_seterr(err, PS_EINVAL, "a snapshot's %s name %zu tables (the job has %d)", what, n,
                     sv->n_tables);
  uint32_t seen = 0;
  for (size_t i = 0; i < n; i++) {
    const Ps__ReplicaRows *m = rows[i];
    if (m->table >= (uint32_t)sv->n_tables || (seen & (1u << m->table)))
      return ps_seterr(err, PS_EINVAL, "a snapshot's %s name table %" PRIu32 " twice or beyond "
                       "the job's %d", what, m->table, sv->n_tables);
    seen |= 1u << m->table;
    ps_table *tb = sv->tables[m->table];
    const ps_table_spec *sp = ps_table_spec_of(tb);
    const size_t k = m->ids.len / 8;
    const size_t vals = (size_t)sp->dim * (size_t)(sum ? 1 : 1 + ps_table_n_slots(tb));
    if (m->ids.len % 8 || m->counts.len != 4 * k || m->values.len != 4 * vals * k ||
        (!sp->rows && k > sp->max_rows_per_shard))
      return ps_seterr(err, PS_EINVAL, "a snapshot's %s of table '%s' are malformed (%zu bytes "
                       "of ids, %zu of counts, %zu of values)",
                       what, sp->name, m->ids.len, m->counts.len, m->values.len);
    uint64_t *ids = malloc((k ? k : 1) * sizeof *ids);
    if (!ids) return ps_seterr(err, PS_ENOMEM, "out of memory checking a snapshot's rows");
    for (size_t j = 0; j < k; j++) ids[j] = ps_get_le64(m->ids.data + 8 * j);
    int rc = ps_table_check_ids(tb, ids, k, NULL, err);
    free(ids);
    if (rc) return rc;
    for (size_t j = 0; j < vals * k; j++) {
      float v;
      memcpy(&v, m->values.data + 4 * j, sizeof v);
      if (!isfinite(v))
        return ps_seterr(err, PS_EINVAL, "a snapshot's %s of table '%s' hold a value that is "
                         "not finite", what, sp->name);
    }
  }
  return PS_OK;
}

/* Replaces every table's rows by the snapshot's (checked), and (with_sum)
 * the step's rows. After ps_shard_restore_state, which emptied the step.
 * An error (no memory) leaves some rows out: the caller refuses the
 * snapshot, and the primary sends another. */
static int snap_install_rows(ps_server *sv, const Ps__ReplicaSnapshot *s, int with_sum,
                             char *err) {
  int rc = PS_OK;
  for (int t = 0; t < sv->n_tables; t++) {
    ps_table_write_lock(sv->tables[t]);
    ps_table_clear(sv->tables[t]);
    ps_table_unlock(sv->tables[t]);
  }
  float *rec = malloc((size_t)PS_TABLE_MAX_DIM * (1 + PS_OPTIM_MAX_SLOTS) * sizeof(float));
  if (!rec) return ps_seterr(err, PS_ENOMEM, "out of memory for a snapshot's rows");
  for (size_t i = 0; rc == PS_OK && i < s->n_tables; i++) {
    const Ps__ReplicaRows *m = s->tables[i];
    ps_table *tb = sv->tables[m->table];
    const size_t vals = (size_t)ps_table_spec_of(tb)->dim * (size_t)(1 + ps_table_n_slots(tb));
    ps_table_write_lock(tb);
    for (size_t j = 0; rc == PS_OK && j < m->ids.len / 8; j++) {
      memcpy(rec, m->values.data + 4 * vals * j, 4 * vals);
      rc = ps_table_put_row(tb, ps_get_le64(m->ids.data + 8 * j),
                            ps_get_le32(m->counts.data + 4 * j), rec, err);
    }
    ps_table_unlock(tb);
  }
  for (size_t i = 0; with_sum && sv->rows_sum && rc == PS_OK && i < s->n_sync_rows; i++) {
    const Ps__ReplicaRows *m = s->sync_rows[i];
    const size_t vals = (size_t)ps_table_spec_of(sv->tables[m->table])->dim;
    for (size_t j = 0; rc == PS_OK && j < m->ids.len / 8; j++) {
      memcpy(rec, m->values.data + 4 * vals * j, 4 * vals);
      rc = ps_rows_sum_put(sv->rows_sum, (int)m->table, ps_get_le64(m->ids.data + 8 * j),
                           ps_get_le32(m->counts.data + 4 * j), rec, err);
    }
  }
  free(rec);
  return rc;
}

/* The state now, as a snapshot message (pointing into b). mu held (no
 * update in between). */
static int snap_take(ps_replica *rp, snap_buf *b) {
  ps_server *sv = rp->sv;
  memset(b, 0, sizeof *b);
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  int ns = ps_shard_n_slots(sv->shard);
  b->params = malloc((n ? n : 1) * sizeof(float));
  int ok = b->params != NULL && ns <= 8;
  for (int k = 0; ok && k < ns; k++) ok = (b->slots[k] = malloc((n ? n : 1) * sizeof(float))) != NULL;
  int next_rank = 0;
  if (ok) ok = ps_membership_export(sv->members, &b->ms, &b->n_ms, &next_rank) == PS_OK;
  if (!ok) {
    snap_free(b);
    return PS_ENOMEM;
  }
  uint64_t version = 0;
  ps_shard_export_state(sv->shard, b->params, b->slots, &version);
  int nrec = 0;
  for (int i = 0; i < b->n_ms; i++) nrec += b->ms[i].n_recent;
  b->w = calloc((size_t)b->n_ms + 1, sizeof *b->w);
  b->wp = calloc((size_t)b->n_ms + 1, sizeof *b->wp);
  b->rec = calloc((size_t)nrec + 1, sizeof *b->rec);
  b->recp = calloc((size_t)nrec + 1, sizeof *b->recp);
  if (!b->w || !b->wp || !b->rec || !b->recp) {
    snap_free(b);
    return PS_ENOMEM;
  }
  ps__replica_snapshot__init(&b->snap);
  ps__replica_position__init(&b->pos);
  b->pos.term = rp->pos.term;
  b->pos.seq = rp->pos.seq;
  b->snap.position = &b->pos;
  b->snap.version = version;
  b->snap.params = (ProtobufCBinaryData){.len = n * sizeof(float), .data = (uint8_t *)b->params};
  for (int k = 0; k < ns; k++)
    b->slot_bin[k] = (ProtobufCBinaryData){.len = n * sizeof(float), .data = (uint8_t *)b->slots[k]};
  b->snap.n_slots = (size_t)ns;
  b->snap.slots = b->slot_bin;
  int ri = 0;
  for (int i = 0; i < b->n_ms; i++) {
    const ps_member *m = &b->ms[i].member;
    Ps__ReplicaWorker *w = &b->w[i];
    ps__replica_worker__init(w);
    w->id = m->id;
    w->host = (char *)m->host;
    w->role = (char *)m->role;
    w->task_index = m->task_index;
    w->rank = m->rank;
    w->step = m->step;
    w->pushes = m->pushes;
    w->clock = m->clock;
    w->reader = m->reader;
    w->idle = m->idle;
    w->round = m->round;
    w->session = (ProtobufCBinaryData){.len = PS_SESSION_LEN, .data = (uint8_t *)m->session};
    w->recent = &b->recp[ri];
    for (int k = 0; k < b->ms[i].n_recent; k++, ri++) {
      const ps_recent_state *rs = &b->ms[i].recent[k];
      ps__replica_recent__init(&b->rec[ri]);
      b->rec[ri].id = rs->id;
      b->rec[ri].kind = (uint32_t)rs->kind;
      b->rec[ri].reply = (ProtobufCBinaryData){.len = rs->len, .data = (uint8_t *)rs->reply};
      b->recp[ri] = &b->rec[ri];
    }
    w->n_recent = (size_t)b->ms[i].n_recent;
    b->wp[i] = w;
  }
  b->snap.n_workers = (size_t)b->n_ms;
  b->snap.workers = b->wp;
  b->snap.next_rank = next_rank;
  /* Shard 0's lease table whole, its outstanding leases, pool and next id
   * included: the replica takes it as it is (ps_leases_replace), so that it
   * hands out what this primary does and knows the leases the workers
   * hold if it takes over. */
  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *t = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (t) {
    if (ps_leases_save(t, &b->leases, &b->leases_len) != PS_OK) {
      snap_free(b);
      return PS_ENOMEM;
    }
    b->snap.has_leases = 1;
    b->snap.leases = (ProtobufCBinaryData){.len = b->leases_len, .data = b->leases};
  }
  /* sync: the step's gradients so far. */
  int sn = 0;
  double smax = 0;
  if (ps_shard_sync_export(sv->shard, &b->sync_sum, &b->sync_ids, &sn, &smax) != PS_OK) {
    snap_free(b);
    return PS_ENOMEM;
  }
  if (sn > 0) {
    b->snap.sync_sum = (ProtobufCBinaryData){.len = n * sizeof(float), .data = (uint8_t *)b->sync_sum};
    b->snap.n_sync_ids = (size_t)sn;
    b->snap.sync_ids = b->sync_ids;
    b->snap.sync_max = smax;
  }
  if (snap_take_rows(sv, b) != PS_OK) {
    snap_free(b);
    return PS_ENOMEM;
  }
  return PS_OK;
}

/* Replaces this replica's state by a snapshot. mu held. 0, or PS_EINVAL /
 * PS_ENOMEM with nothing changed. */
static int snap_install(ps_replica *rp, const Ps__ReplicaSnapshot *s, char *err) {
  ps_server *sv = rp->sv;
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  int ns = ps_shard_n_slots(sv->shard);
  if (!s->position || s->params.len != n * sizeof(float) || s->n_slots != (size_t)ns ||
      s->n_workers > (size_t)sv->job.max_workers)
    return ps_seterr(err, PS_EINVAL, "a snapshot of another shape (%zu bytes of parameters, %zu "
                     "slot arrays; this shard has %zu values and %d)",
                     s->params.len, s->n_slots, n, ns);
  for (int k = 0; k < ns; k++)
    if (s->slots[k].len != n * sizeof(float))
      return ps_seterr(err, PS_EINVAL, "a snapshot's slot array %d has %zu bytes", k,
                       s->slots[k].len);
  if (s->n_sync_ids > (size_t)sv->job.max_workers ||
      (s->n_sync_ids > 0 && s->sync_sum.len != n * sizeof(float)) ||
      !(s->sync_max >= 0 && s->sync_max < 1e300))
    return ps_seterr(err, PS_EINVAL, "a snapshot's sync step is malformed (%zu gradients, %zu "
                     "bytes of sum)", s->n_sync_ids, s->sync_sum.len);
  int rrc = snap_check_rows(sv, s->tables, s->n_tables, 0, err);
  if (rrc == PS_OK) rrc = snap_check_rows(sv, s->sync_rows, s->n_sync_rows, 1, err);
  if (rrc != PS_OK) return rrc;
  if (s->n_sync_rows && s->n_sync_ids == 0)
    return ps_seterr(err, PS_EINVAL, "a snapshot's sync step has rows but no gradient");
  ps_member_state *ms = calloc(s->n_workers + 1, sizeof *ms);
  float *params = malloc((n ? n : 1) * sizeof(float));
  float *slots[8] = {0};
  int ok = ms && params;
  for (int k = 0; ok && k < ns; k++) ok = (slots[k] = malloc((n ? n : 1) * sizeof(float))) != NULL;
  for (size_t i = 0; ok && i < s->n_workers; i++) {
    const Ps__ReplicaWorker *w = s->workers[i];
    if (w->session.len != PS_SESSION_LEN || w->n_recent > PS_RECENT_REQUESTS) {
      ok = -1;
      break;
    }
    ps_member *m = &ms[i].member;
    m->id = w->id;
    ps_utf8_sanitize(m->host, sizeof m->host, w->host ? w->host : "");
    ps_utf8_sanitize(m->role, sizeof m->role, w->role ? w->role : "");
    m->task_index = w->task_index;
    m->rank = w->rank;
    m->step = w->step;
    m->pushes = w->pushes;
    m->clock = w->clock;
    m->reader = w->reader;
    m->idle = w->idle;
    m->round = w->round;
    m->last_seen_ms = ps_now_ms();
    memcpy(m->session, w->session.data, PS_SESSION_LEN);
    for (size_t k = 0; k < w->n_recent; k++) {
      const Ps__ReplicaRecent *rr = w->recent[k];
      if (rr->reply.len > PS_REPLY_MAX) {
        ok = -1;
        break;
      }
      ps_recent_state *o = &ms[i].recent[ms[i].n_recent++];
      o->id = rr->id;
      o->kind = (int)rr->kind;
      o->len = rr->reply.len;
      memcpy(o->reply, rr->reply.data, rr->reply.len);
    }
  }
  int rc = PS_OK;
  ps_leases *fresh_table = NULL;
  if (ok == 1 && s->has_leases) {
    pthread_mutex_lock(&sv->lease_mu);
    ps_leases *t = sv->leases;
    pthread_mutex_unlock(&sv->lease_mu);
    if (t ? ps_leases_replace(t, s->leases.data, s->leases.len, err) != PS_OK
          : (fresh_table = ps_leases_load_copy(s->leases.data, s->leases.len, err)) == NULL)
      ok = -2;
  }
  if (ok == 1) {
    if (fresh_table) {
      pthread_mutex_lock(&sv->lease_mu);
      sv->leases = fresh_table;
      pthread_mutex_unlock(&sv->lease_mu);
    }
    memcpy(params, s->params.data, n * sizeof(float));
    for (int k = 0; k < ns; k++) memcpy(slots[k], s->slots[k].data, n * sizeof(float));
    rc = ps_membership_import(sv->members, ms, (int)s->n_workers, s->next_rank);
    if (rc == PS_OK) {
      ps_shard_restore_state(sv->shard, params, slots, s->version);
      float *sum = NULL;
      if (s->n_sync_ids > 0 && n > 0 && (sum = malloc(n * sizeof(float))) != NULL)
        memcpy(sum, s->sync_sum.data, n * sizeof(float));
      int with_sum = 1;
      if ((s->n_sync_ids > 0 && n > 0 && !sum) ||
          ps_shard_sync_import(sv->shard, sum, s->sync_ids, (int)s->n_sync_ids, s->sync_max) != PS_OK) {
        PS_ERROR("replication: no memory for the snapshot's sync step: it is left out");
        with_sum = 0; /* its rows with it */
      }
      free(sum);
      rc = snap_install_rows(sv, s, with_sum, err);
      if (rc == PS_OK) {
        rp->pos.term = s->position->term;
        rp->pos.seq = s->position->seq;
      }
    } else {
      ps_seterr(err, rc, "out of memory");
    }
  } else if (ok == -2) {
    rc = PS_EINVAL; /* err says what is wrong with the lease table */
  } else {
    rc = ps_seterr(err, ok < 0 ? PS_EINVAL : PS_ENOMEM,
                   ok < 0 ? "a snapshot's worker table is malformed" : "out of memory");
  }
  free(ms);
  free(params);
  for (int k = 0; k < 8; k++) free(slots[k]);
  return rc;
}

/* ------------------------------------------------------------ backups */

void ps_replica_handle_replicate(ps_server *sv, rpc_call *call, const void *request) {
  ps_replica *rp = sv->repl;
  const Ps__ReplicateRequest *r = request;
  if (!rp) {
    rpc_call_fail(call, RPC_FAILED_PRECONDITION, "shard %d is not replicated", sv->index);
    return;
  }
  cfg_t c;
  if (r->shard != (uint32_t)sv->index || r->from_replica >= (uint32_t)rp->R ||
      (int)r->from_replica == rp->me || cfg_from_msg(r->config, rp->R, &c) != PS_OK ||
      c.primary != (int)r->from_replica || c.term == 0 || !r->prev) {
    rpc_call_fail(call, RPC_INVALID_ARGUMENT,
                  "Replicate: shard %u from replica %u is not an update for shard %d replica %d "
                  "of %d from its primary",
                  r->shard, r->from_replica, sv->index, rp->me, rp->R);
    return;
  }
  Ps__ReplicateResponse resp = PS__REPLICATE_RESPONSE__INIT;
  Ps__ReplicaPosition pos = PS__REPLICA_POSITION__INIT;
  char err[PS_ERRLEN];
  pthread_mutex_lock(&rp->mu);
  if (c.term > rp->term && follow_term(rp, c.term) != PS_OK) {
    pthread_mutex_unlock(&rp->mu);
    rpc_call_fail(call, RPC_UNAVAILABLE, "shard %d replica %d cannot record term %" PRIu64,
                  sv->index, rp->me, c.term);
    return;
  }
  if (c.term < rp->term || (c.term == rp->term && rp->role == PRIMARY)) {
    resp.result = PS__REPLICATE_RESPONSE__RESULT__STALE_TERM;
    PS_DEBUG("replication: refused an update of term %" PRIu64 " (this replica is in term %" PRIu64
             ")", c.term, rp->term);
  } else {
    if (c.term > rp->term || rp->role == PRIMARY) step_down(rp, c.term, "a newer term's primary");
    if (rp->cfg.term != c.term || rp->cfg.primary != c.primary)
      PS_INFO("replication: shard %d replica %d follows replica %d (term %" PRIu64 ")", sv->index,
              rp->me, c.primary, c.term);
    rp->cfg = c;
    rp->heard_ms = ps_now_ms();
    rp->deferrals = 0;
    if (r->snapshot) {
      if (snap_install(rp, r->snapshot, err) == PS_OK) {
        PS_INFO("replication: took the primary's state at update %" PRIu64 " (term %" PRIu64 ")",
                rp->pos.seq, rp->pos.term);
        rp->fresh = 0;
        resp.result = PS__REPLICATE_RESPONSE__RESULT__APPLIED;
      } else {
        PS_WARN("replication: a snapshot refused: %s", err);
        resp.result = PS__REPLICATE_RESPONSE__RESULT__MISMATCH;
      }
    } else if (r->prev->term != rp->pos.term || r->prev->seq != rp->pos.seq) {
      resp.result = PS__REPLICATE_RESPONSE__RESULT__MISMATCH;
    } else {
      resp.result = PS__REPLICATE_RESPONSE__RESULT__APPLIED;
      for (size_t i = 0; i < r->n_entries; i++) {
        const Ps__ReplicaEntry *e = r->entries[i];
        if (e->seq != rp->pos.seq + 1 || e->term > c.term || apply_entry(sv, e) != PS_OK) {
          if (e->seq != rp->pos.seq + 1)
            PS_WARN("replication: entry %" PRIu64 " after %" PRIu64 ": a gap; refused", e->seq,
                    rp->pos.seq);
          resp.result = PS__REPLICATE_RESPONSE__RESULT__MISMATCH;
          break;
        }
        rp->pos.seq = e->seq;
        rp->pos.term = e->term;
      }
    }
  }
  resp.term = rp->term;
  pos.term = rp->pos.term;
  pos.seq = rp->pos.seq;
  pthread_mutex_unlock(&rp->mu);
  resp.position = &pos;
  wire_reply(call, &resp.base);
}

/* ------------------------------------------------------------ senders */

static void fill_header(ps_server *sv, Ps__RequestHeader *h) {
  ps__request_header__init(h);
  h->protocol_version = PS_PROTOCOL_VERSION;
  h->job_id = sv->job.job_id;
  h->token = (ProtobufCBinaryData){.len = sv->sec.token.len, .data = sv->sec.token.bytes};
}

static rpc_channel *channel_to(ps_replica *rp, const char *addr) {
  char err[PS_ERRLEN];
  rpc_channel_opts co = {.tls = ps_security_tls(&rp->sv->sec),
                         .keepalive_ms = 0,
                         .reconnect_ms = rp->sv->job.replica_heartbeat_ms};
  rpc_channel *ch = rpc_channel_create(addr, &co, err);
  if (!ch) PS_ERROR("replication: no channel to %s: %s", addr, err);
  return ch;
}

/* One call, its answer unpacked (NULL on failure, logged at debug). */
static ProtobufCMessage *call_peer(rpc_queue *q, rpc_channel *ch, const char *method,
                                   const ProtobufCMessage *req,
                                   const ProtobufCMessageDescriptor *desc, int timeout_ms,
                                   int *status, char *why) {
  size_t len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = malloc(len ? len : 1);
  if (!buf) {
    *status = RPC_RESOURCE_EXHAUSTED;
    snprintf(why, PS_ERRLEN, "out of memory");
    return NULL;
  }
  protobuf_c_message_pack(req, buf);
  rpc_msg msg = {.nseg = 1};
  msg.seg[0] = (rpc_seg){.ptr = buf, .len = len, .release = free, .user = buf};
  uint8_t *out = NULL;
  size_t out_len = 0;
  *status = rpc_call_sync(q, ch, method, &msg, timeout_ms, 0, &out, &out_len, why);
  if (*status != RPC_OK) return NULL;
  ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, out_len, out);
  free(out);
  if (!m) {
    *status = RPC_INTERNAL;
    snprintf(why, PS_ERRLEN, "malformed answer");
  }
  return m;
}

/* An entry of the log as the Replicate call sends it (pointing into the
 * entry, which must outlive the call's message). */
static void entry_to_msg(const rentry *e, Ps__ReplicaEntry *m) {
  ps__replica_entry__init(m);
  m->kind = (Ps__ReplicaEntry__Kind)e->kind;
  m->seq = e->pos.seq;
  m->term = e->pos.term;
  m->worker_id = e->worker;
  m->request_id = e->request_id;
  m->base_version = e->base_version;
  m->offset = e->offset;
  m->count = e->count;
  m->step = e->step;
  m->host = (char *)e->host;
  m->role = (char *)e->role;
  m->task_index = e->task_index;
  m->session = (ProtobufCBinaryData){
      .len = e->kind == PS__REPLICA_ENTRY__KIND__REGISTER ? PS_SESSION_LEN : 0,
      .data = (uint8_t *)e->session};
  m->reader = e->reader;
  m->idle = e->idle;
  m->gradient = (ProtobufCBinaryData){.len = e->grad_len, .data = e->grad};
  m->now_ms = e->now_ms;
  m->timeout_ms = e->timeout_ms;
  m->complete_lease = e->complete_lease;
  m->dataset_size = e->dataset_size;
  m->want_next = e->want_next;
  m->names_leases = e->names_leases;
  m->quorum = e->quorum;
  m->divisor = e->divisor;
  m->result = e->result;
  if (e->kind == PS__REPLICA_ENTRY__KIND__LEASE_RENEW) {
    m->n_leases = e->n_ids;
    m->leases = e->ids;
  } else if (e->kind == PS__REPLICA_ENTRY__KIND__REGISTER) {
    m->n_done_chunks = e->n_ids;
    m->done_chunks = e->ids;
    m->n_held_leases = e->n_held;
    m->held_leases = e->n_held ? e->held_p : NULL;
  }
  if (e->kind == PS__REPLICA_ENTRY__KIND__PUSH || e->kind == PS__REPLICA_ENTRY__KIND__LEASE)
    m->reply = (ProtobufCBinaryData){.len = e->reply_len, .data = e->reply};
  m->n_rows = e->n_rows;
  m->rows = e->n_rows ? (Ps__TableRows **)e->rows_p : NULL;
  m->trained_examples = e->trained;
  m->lease_id = e->lease_id;
  m->batch_size = e->batch;
}

/* A replica's answer to a Replicate call of term `term` (mu held): a newer
 * term deposes this primary; a position not in this history asks for the
 * whole state; an applied batch moves the replica on and may commit
 * entries. snapshot, probe: what the call was; last: the last seq sent. */
static void take_answer(peer_t *p, const Ps__ReplicateResponse *resp, uint64_t term,
                        int snapshot, int probe, uint64_t last) {
  ps_replica *rp = p->rp;
  if (rp->term == term && rp->role == PRIMARY) {
    p->last_ok_ms = ps_now_ms();
    if (resp->result == PS__REPLICATE_RESPONSE__RESULT__STALE_TERM) {
      step_down(rp, resp->term, "a replica knows a newer term");
    } else if (resp->result == PS__REPLICATE_RESPONSE__RESULT__MISMATCH) {
      if (!p->need_snapshot || snapshot)
        PS_INFO("replication: replica %d is at update %" PRIu64 " of term %" PRIu64
                ", not in this history: sending it the whole state",
                p->r, resp->position ? resp->position->seq : 0,
                resp->position ? resp->position->term : 0);
      p->need_snapshot = 1;
      p->matched = 0;
    } else {
      if (snapshot || probe) p->need_snapshot = 0;
      p->matched = !p->need_snapshot; /* an append that ran out of memory wants one */
      p->acked = last;
      p->next = last + 1;
      advance_commit(rp);
    }
  }
}

static void *sender_main(void *arg) {
  peer_t *p = arg;
  ps_replica *rp = p->rp;
  ps_server *sv = rp->sv;
  rpc_queue *q = rpc_queue_create();
  const int hb = sv->job.replica_heartbeat_ms;
  int64_t last_sent = 0;
  int quiet = 0; /* failed calls in a row: logged once */
  pthread_mutex_lock(&rp->mu);
  while (rp->running && q) {
    if (rp->role != PRIMARY) {
      struct timespec ts = ps_deadline_in_ms(hb);
      pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
      continue;
    }
    uint64_t term = rp->term;
    cfg_t cfg = rp->cfg;
    rentry *batch[BATCH_ENTRIES];
    int nb = 0;
    pos_t prev = {0};
    snap_buf sb;
    int snapshot = 0;
    if (!p->need_snapshot && !log_pos(rp, p->next - 1, &prev)) p->need_snapshot = 1;
    int probe = p->need_snapshot && !p->answering;
    if (probe) {
      /* A replica that does not answer gets no snapshot (taking one costs
       * a copy of the state): a probe at this position first, whose
       * answer says whether it needs one. */
      prev = rp->pos;
    } else if (p->need_snapshot) {
      if (snap_take(rp, &sb) != PS_OK) {
        struct timespec ts = ps_deadline_in_ms(hb);
        pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
        continue;
      }
      snapshot = 1;
      prev = rp->pos;
      p->hold = prev.seq; /* the entries after it follow the snapshot */
    } else {
      size_t bytes = 0;
      for (rentry *e = rp->head; e && nb < BATCH_ENTRIES; e = e->next)
        if (e->pos.seq >= p->next) {
          if (nb && bytes + e->grad_len > rp->batch_bytes) break;
          e->refs++;
          batch[nb++] = e;
          bytes += e->grad_len;
        }
      int64_t now = ps_now_ms();
      if (nb == 0 && p->matched && now - last_sent < hb) {
        struct timespec ts = ps_deadline_in_ms(hb - (now - last_sent));
        pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
        continue;
      }
    }
    pthread_mutex_unlock(&rp->mu);

    Ps__RequestHeader h;
    fill_header(sv, &h);
    Ps__ReplicateRequest req = PS__REPLICATE_REQUEST__INIT;
    Ps__ReplicaConfig cm;
    uint32_t mbuf[32];
    cfg_to_msg(&cfg, &cm, mbuf);
    Ps__ReplicaPosition pm = PS__REPLICA_POSITION__INIT;
    pm.term = prev.term;
    pm.seq = prev.seq;
    req.header = &h;
    req.shard = (uint32_t)sv->index;
    req.from_replica = (uint32_t)rp->me;
    req.config = &cm;
    req.prev = &pm;
    Ps__ReplicaEntry em[BATCH_ENTRIES], *ep[BATCH_ENTRIES];
    for (int i = 0; i < nb; i++) {
      entry_to_msg(batch[i], &em[i]);
      ep[i] = &em[i];
    }
    req.n_entries = (size_t)nb;
    req.entries = ep;
    if (snapshot) req.snapshot = &sb.snap;
    if (!p->ch) p->ch = channel_to(rp, ps_replica_addr(sv, p->r));
    int st = RPC_UNAVAILABLE;
    char why[PS_ERRLEN] = "no channel";
    int timeout = snapshot ? 120000 : sv->job.replica_lease_ms;
    Ps__ReplicateResponse *resp =
        p->ch ? (Ps__ReplicateResponse *)call_peer(q, p->ch, "/ps.ParameterServer/Replicate",
                                                   &req.base, &ps__replicate_response__descriptor,
                                                   timeout, &st, why)
              : NULL;
    if (snapshot) snap_free(&sb);
    last_sent = ps_now_ms();

    /* The last seq sent, read while the batch's references are held. */
    const uint64_t last = snapshot || !nb ? prev.seq : batch[nb - 1]->pos.seq;
    pthread_mutex_lock(&rp->mu);
    p->hold = 0;
    for (int i = 0; i < nb; i++) entry_unref(batch[i]);
    p->answering = resp != NULL;
    if (!resp) {
      if (!quiet++)
        PS_WARN("replication: replica %d (%s) did not take updates: %s: %s", p->r,
                ps_replica_addr(sv, p->r), rpc_status_name(st), why);
      p->matched = 0;
      struct timespec ts = ps_deadline_in_ms(hb);
      pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
      continue;
    }
    if (quiet) PS_INFO("replication: replica %d answers again", p->r);
    quiet = 0;
    take_answer(p, resp, term, snapshot, probe, last);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  pthread_mutex_unlock(&rp->mu);
  if (q) rpc_queue_destroy(q);
  return NULL;
}

/* ------------------------------------------------------------ elections */

/* Asks every server (this one directly) for its vote; returns the number
 * granted, the newest accepted configuration among the grants, the
 * highest promise among the refusals and how many gave no answer. */
static int ballot(ps_replica *rp, uint64_t term, int phase, const cfg_t *c, cfg_t *newest,
                  uint64_t *max_promised, int *silent) {
  ps_server *sv = rp->sv;
  int shard = sv->index;
  uint64_t pr;
  cfg_t acc;
  int granted = vote_local(rp, shard, term, phase, c, &pr, &acc);
  memset(newest, 0, sizeof *newest);
  newest->primary = -1;
  *max_promised = pr;
  *silent = rp->N - 1;
  if (granted && acc.term > newest->term) *newest = acc;
  rpc_queue *q = rpc_queue_create();
  if (!q) return granted;
  rpc_request *calls[PS_MAX_TASKS] = {0};
  Ps__RequestHeader h;
  fill_header(sv, &h);
  Ps__VoteRequest req = PS__VOTE_REQUEST__INIT;
  Ps__ReplicaConfig cm;
  uint32_t mbuf[32];
  req.header = &h;
  req.shard = (uint32_t)shard;
  req.term = term;
  req.phase = (Ps__VoteRequest__Phase)phase;
  req.candidate = (uint32_t)rp->server;
  if (c) {
    cfg_to_msg(c, &cm, mbuf);
    req.config = &cm;
  }
  char why[PS_ERRLEN];
  for (int v = 0; v < rp->N; v++) {
    if (v == rp->server) continue;
    if (!rp->vote_ch[v]) rp->vote_ch[v] = channel_to(rp, rp->addrs[v]);
    rpc_msg msg;
    if (!rp->vote_ch[v] || wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) != 0) continue;
    int t = sv->job.replica_lease_ms / 2;
    calls[v] = rpc_start(q, rp->vote_ch[v], "/ps.ParameterServer/Vote", &msg, t, 0, why);
  }
  for (int v = 0; v < rp->N; v++) {
    if (!calls[v]) continue;
    ps_segview view;
    if (rpc_wait(calls[v], why, &view) == RPC_OK) {
      uint8_t *flat = malloc(view.total ? view.total : 1);
      Ps__VoteResponse *r = NULL;
      if (flat && ps_segview_copy(&view, 0, flat, view.total) == 0)
        r = ps__vote_response__unpack(NULL, view.total, flat);
      free(flat);
      if (r) {
        (*silent)--;
        if (r->promised > *max_promised) *max_promised = r->promised;
        cfg_t a;
        if (r->granted) {
          granted++;
          if (r->accepted && r->accepted->term > newest->term &&
              cfg_from_msg(r->accepted, rp->R, &a) == PS_OK)
            *newest = a;
        }
        ps__vote_response__free_unpacked(r, NULL);
      }
    }
    rpc_request_free(calls[v]);
  }
  rpc_queue_destroy(q);
  return granted;
}

/* What the other members of c say of themselves (their Status), for a
 * candidate at position mine:
 *   *all_fresh: every one answered that it restarted and took no state
 *     since (then nobody holds the updates acknowledged since the last
 *     checkpoint, and a restarted replica may lead from its checkpoint; a
 *     member that does not answer may hold them);
 *   *ahead: the replica index of one that holds more updates (a later
 *     position) and did not restart, or -1: the most up-to-date leads,
 *     so that fewer updates not yet acknowledged are lost.
 * Replica skip (-1: none) is not asked. */
static void survey_members(ps_replica *rp, const cfg_t *c, pos_t mine, int skip, int *all_fresh,
                           int *ahead) {
  ps_server *sv = rp->sv;
  *all_fresh = 1;
  *ahead = -1;
  rpc_queue *q = rpc_queue_create();
  if (!q) {
    *all_fresh = 0;
    return;
  }
  for (int r = 0; r < rp->R; r++) {
    if (r == rp->me || r == skip || !is_member(c, r)) continue;
    int v = sv->index * rp->R + r;
    if (!rp->vote_ch[v]) rp->vote_ch[v] = channel_to(rp, rp->addrs[v]);
    Ps__RequestHeader h;
    fill_header(sv, &h);
    Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
    req.header = &h;
    int st = RPC_UNAVAILABLE;
    char why[PS_ERRLEN] = "no channel";
    Ps__StatusResponse *resp =
        rp->vote_ch[v] ? (Ps__StatusResponse *)call_peer(q, rp->vote_ch[v],
                                                         "/ps.ParameterServer/Status", &req.base,
                                                         &ps__status_response__descriptor,
                                                         sv->job.replica_lease_ms / 2, &st, why)
                       : NULL;
    int ok = resp && resp->shard_index == (uint32_t)sv->index && resp->replica == (uint32_t)r;
    if (!ok || !resp->replica_fresh) *all_fresh = 0;
    if (ok && !resp->replica_fresh &&
        (resp->replica_seq_term > mine.term ||
         (resp->replica_seq_term == mine.term && resp->replica_seq > mine.seq)))
      *ahead = r;
    if (resp) protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  rpc_queue_destroy(q);
}

/* Runs for (or renews, as the primary) a configuration: members is what
 * the new one holds when this replica leads (0: decided from the newest
 * one a majority reports, for an election). Returns 1 when this replica
 * is the primary of the new term. Called without mu. */
static int run_term(ps_replica *rp, uint32_t members, const char *why) {
  ps_server *sv = rp->sv;
  int majority = rp->N / 2 + 1;
  pthread_mutex_lock(&rp->mu);
  uint64_t base_term = rp->term;
  int was_primary = rp->role == PRIMARY;
  uint64_t term = rp->term + 1;
  if (rp->seen_term >= term) term = rp->seen_term + 1;
  pthread_mutex_lock(&rp->vote_mu);
  if (rp->promised[sv->index] >= term) term = rp->promised[sv->index] + 1;
  pthread_mutex_unlock(&rp->vote_mu);
  /* A candidate goes on taking the old primary's updates until it wins:
   * it holds then every update it acknowledged, and from then on refuses
   * the old term. (A candidate that loses disturbs nobody.) */
  pthread_mutex_unlock(&rp->mu);

  cfg_t newest;
  uint64_t maxp = 0;
  int silent = 0;
  int got = ballot(rp, term, PS__VOTE_REQUEST__PHASE__PREPARE, NULL, &newest, &maxp, &silent);
  int ok = got >= majority;
  const char *fail = "no majority of the job's servers promised the term";
  cfg_t c = {.term = term, .primary = rp->me};
  if (ok && newest.term && !is_member(&newest, rp->me)) {
    ok = 0;
    fail = "this replica is not a member of the newest configuration (it may lack updates)";
  }
  pthread_mutex_lock(&rp->mu);
  int fresh = rp->fresh, deferrals = rp->deferrals;
  pos_t mine = rp->pos;
  pthread_mutex_unlock(&rp->mu);
  if (ok && !was_primary && newest.term) {
    int all_fresh = 0, ahead = -1;
    /* A candidate that holds the state need not ask the silent primary
     * (behind a partition the question would only cost its time-out). */
    survey_members(rp, &newest, mine, fresh ? -1 : newest.primary, &all_fresh, &ahead);
    if (fresh && !all_fresh) {
      ok = 0;
      fail = "this replica restarted and holds no acknowledged update, and a member that may "
             "hold them did not say it restarted too";
    } else if (!fresh && ahead >= 0 && deferrals < 3) {
      /* A few times only: one that cannot win (cut off from the voters)
       * must not keep the shard without a primary. */
      pthread_mutex_lock(&rp->mu);
      rp->deferrals++;
      pthread_mutex_unlock(&rp->mu);
      ok = 0;
      fail = "another member holds more updates: it runs first";
    }
  }
  if (ok) {
    if (members) {
      c.members = members | bit(rp->me);
    } else if (newest.term) {
      c.members = newest.members | bit(rp->me);
      if (newest.primary != rp->me) c.members &= ~bit(newest.primary);
    } else {
      c.members = (uint32_t)((1u << (unsigned)rp->R) - 1);
    }
    cfg_t n2;
    got = ballot(rp, term, PS__VOTE_REQUEST__PHASE__ACCEPT, &c, &n2, &maxp, &silent);
    ok = got >= majority;
    if (!ok) fail = "no majority accepted the configuration";
  }
  if (ok && follow_term(rp, term) != PS_OK) {
    ok = 0;
    fail = "its own term could not be recorded";
  }
  pthread_mutex_lock(&rp->mu);
  int won = 0;
  rp->lost_to_silence = !ok && got < majority && got + silent >= majority && maxp <= term;
  if (maxp > rp->seen_term) rp->seen_term = maxp;
  if (ok && rp->term <= term && (!was_primary || (rp->role == PRIMARY && rp->term == base_term))) {
    rp->term = term;
    rp->cfg = c;
    rp->fresh = 0;
    rp->deferrals = 0;
    if (!was_primary) {
      rp->role = PRIMARY;
      rp->became_ms = ps_now_ms();
      rp->reigns++;
      rp->said_first_ack = 0;
      rp->log_base = rp->pos;
      rp->commit = rp->pos.seq;
      int64_t now = ps_now_ms();
      for (int r = 0; r < rp->R; r++) {
        peer_t *p = &rp->peer[r];
        p->next = rp->pos.seq + 1;
        p->matched = 0;
        p->need_snapshot = 0;
        p->acked = 0;
        p->last_ok_ms = now;
      }
      /* The workers' clocks of silence start now. */
      int n = ps_membership_count(sv->members) + 64;
      ps_member *list = calloc((size_t)n, sizeof *list);
      int k = list ? ps_membership_list(sv->members, list, n) : 0;
      pthread_mutex_lock(&sv->lease_mu);
      ps_leases *lt = sv->leases;
      pthread_mutex_unlock(&sv->lease_mu);
      for (int i = 0; i < k; i++) {
        ps_membership_touch(sv->members, list[i].id, UINT64_MAX, now);
        if (!lt) continue;
        /* Their leases too, logged, so that the backups expire the same. */
        ps_update u = {.kind = PS_UPDATE_LEASE_RENEW, .worker = list[i].id, .now_ms = now};
        ps_update_result res = {0};
        char err[PS_ERRLEN];
        ps_update_apply(sv, &u, 0, &res, err);
        if (ps_replica_append(sv, &u, NULL, NULL, 0, 0) != PS_OK) ps_replica_diverged(sv);
      }
      free(list);
    }
    rp->pending_add &= ~c.members;
    char ms[64] = "";
    for (int r = 0; r < rp->R; r++)
      if (is_member(&c, r)) snprintf(ms + strlen(ms), sizeof ms - strlen(ms), "%s%d", *ms ? "," : "", r);
    PS_INFO("replication: shard %d replica %d is the primary of term %" PRIu64
            " (members %s; %s) at update %" PRIu64,
            sv->index, rp->me, term, ms, why, rp->pos.seq);
    won = 1;
    advance_commit(rp);
    pthread_cond_broadcast(&rp->cv);
  } else {
    if (was_primary && rp->role == PRIMARY) step_down(rp, rp->term, fail);
    PS_INFO("replication: shard %d replica %d did not get term %" PRIu64 ": %s (%d of %d votes)",
            sv->index, rp->me, term, fail, got, rp->N);
  }
  pthread_mutex_unlock(&rp->mu);
  return won;
}

static void *manager_main(void *arg) {
  ps_replica *rp = arg;
  ps_server *sv = rp->sv;
  const int hb = sv->job.replica_heartbeat_ms, lease = sv->job.replica_lease_ms;
  pthread_mutex_lock(&rp->mu);
  while (rp->running) {
    struct timespec ts = ps_deadline_in_ms(hb / 2 > 0 ? hb / 2 : 1);
    pthread_cond_timedwait(&rp->cv, &rp->mu, &ts);
    if (!rp->running) break;
    int64_t now = ps_now_ms();
    if (rp->role == FOLLOWER) {
      /* The replicas after the silent primary run one heartbeat apart, in
       * turn, so that two do not split the vote: the first usually wins
       * and the others then hear from it. */
      int turn = rp->cfg.term && rp->cfg.primary >= 0
                     ? (rp->me - rp->cfg.primary - 1 + rp->R) % rp->R
                     : rp->me;
      if (now < rp->next_election_ms || now - rp->heard_ms <= lease + (int64_t)turn * hb) continue;
      /* A replica the configuration left out may lack updates: it waits
       * for a primary to bring it back (the members run). */
      if (rp->cfg.term && !is_member(&rp->cfg, rp->me)) continue;
      pthread_mutex_unlock(&rp->mu);
      int won = run_term(rp, 0, rp->cfg.term ? "the primary fell silent" : "start");
      if (won) {
        /* The step may be complete already (every gradient came in before
         * the old primary fell): nothing else would try it. */
        /* Shard 0's new primary also coordinates the checkpoint sets: one
         * at once gives up a set the old one left held on the shards. The
         * server's hook does both. */
        sv->hooks.became_primary(sv);
      }
      pthread_mutex_lock(&rp->mu);
      if (!won) {
        /* Back off by a random part of a lease, staggered by replica, so
         * that candidates do not keep splitting the vote. */
        uint32_t rnd = 0;
        ps_random_bytes(&rnd, sizeof rnd);
        if (rp->lost_to_silence)
          /* Nobody runs against it: the voters were only slow (a loaded
           * host, a vote file's fsync) or down. A heartbeat later. */
          rp->next_election_ms = ps_now_ms() + hb + (int64_t)(rnd % (uint32_t)(hb > 0 ? hb : 1));
        else
          rp->next_election_ms =
              ps_now_ms() + lease / 2 + rp->me * hb + (int64_t)(rnd % (uint32_t)lease);
        rp->heard_ms = ps_now_ms() - lease; /* due again at next_election_ms */
      }
      continue;
    }
    /* The primary: drop members silent for a lease; add replicas that
     * caught up. */
    uint32_t members = rp->cfg.members, add = 0;
    const char *why = NULL;
    for (int r = 0; r < rp->R; r++) {
      if (r == rp->me) continue;
      peer_t *p = &rp->peer[r];
      if (is_member(&rp->cfg, r) && now - p->last_ok_ms > lease) {
        members &= ~bit(r);
        why = "a member fell silent";
      } else if (!is_member(&rp->cfg, r) && p->matched && now - p->last_ok_ms <= lease) {
        /* A replica that caught up joins in two steps: first it counts for
         * acknowledgements (so the commit point waits for it from now on),
         * then, once it holds everything acknowledged, the vote. */
        if (!(rp->pending_add & bit(r))) {
          rp->pending_add |= bit(r);
        } else if (p->acked >= rp->commit) {
          add |= bit(r);
          if (!why) why = "a replica caught up";
        }
      } else if (!is_member(&rp->cfg, r)) {
        rp->pending_add &= ~bit(r); /* it fell behind or silent again */
      }
    }
    if (!why) continue;
    members |= add;
    pthread_mutex_unlock(&rp->mu);
    run_term(rp, members, why);
    pthread_mutex_lock(&rp->mu);
  }
  pthread_mutex_unlock(&rp->mu);
  return NULL;
}

/* ------------------------------------------------------------ life */

int ps_replica_init(ps_server *sv, const char *dir, char *err) {
  ps_replica *rp = calloc(1, sizeof *rp);
  if (!rp) return ps_seterr(err, PS_ENOMEM, "out of memory");
  rp->sv = sv;
  rp->R = sv->job.replicas_per_shard;
  rp->S = sv->cluster.n_ps;
  rp->N = rp->S * rp->R;
  rp->me = sv->replica;
  rp->server = sv->server_index;
  rp->addrs = calloc((size_t)rp->N, sizeof *rp->addrs);
  rp->promised = calloc((size_t)rp->S, sizeof *rp->promised);
  rp->accepted = calloc((size_t)rp->S, sizeof *rp->accepted);
  rp->vote_ch = calloc((size_t)rp->N, sizeof *rp->vote_ch);
  if (!rp->addrs || !rp->promised || !rp->accepted || !rp->vote_ch) {
    free(rp->addrs);
    free(rp->promised);
    free(rp->accepted);
    free(rp->vote_ch);
    free(rp);
    return ps_seterr(err, PS_ENOMEM, "out of memory");
  }
  memcpy(rp->addrs, sv->replica_addrs, (size_t)rp->N * sizeof *rp->addrs);
  rp->batch_bytes = 2 * (ps_shard_end(sv->shard) - ps_shard_begin(sv->shard)) * sizeof(float);
  pthread_mutex_init(&rp->mu, NULL);
  pthread_mutex_init(&rp->vote_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&rp->cv, &ca);
  pthread_condattr_destroy(&ca);
  snprintf(rp->vote_path, sizeof rp->vote_path, "%s/%s.votes-%d", dir, sv->job.job_id,
           rp->server);
  int rc = votes_load(rp, err);
  if (rc != PS_OK) return rc;
  rp->term = rp->followed;
  rp->cfg.primary = -1;
  rp->role = FOLLOWER;
  /* A history of its own that matches nobody else's: a replica that
   * starts takes the primary's state whole. */
  uint64_t rnd = 0;
  ps_random_bytes(&rnd, sizeof rnd);
  rp->pos.term = 0;
  rp->pos.seq = (rnd >> 2) | (1ull << 40);
  rp->fresh = 1;
  for (int r = 0; r < rp->R; r++) rp->peer[r] = (peer_t){.rp = rp, .r = r};
  sv->repl = rp;
  return PS_OK;
}

int ps_replica_start(ps_server *sv, char *err) {
  ps_replica *rp = sv->repl;
  if (!rp) return PS_OK;
  pthread_mutex_lock(&rp->mu);
  rp->running = 1;
  /* Replica 0 of a shard that never had a configuration runs at once;
   * the others after a lease without hearing from a primary. */
  rp->heard_ms = ps_now_ms();
  if (rp->me == 0 && rp->accepted[sv->index].term == 0) rp->heard_ms -= 10LL * sv->job.replica_lease_ms;
  else rp->next_election_ms = ps_now_ms() + (int64_t)rp->me * sv->job.replica_heartbeat_ms * 2;
  pthread_mutex_unlock(&rp->mu);
  if (pthread_create(&rp->manager, NULL, manager_main, rp) != 0)
    return ps_seterr(err, PS_ENOMEM, "cannot start the replication thread");
  rp->manager_started = 1;
  for (int r = 0; r < rp->R; r++) {
    if (r == rp->me) continue;
    if (pthread_create(&rp->peer[r].thread, NULL, sender_main, &rp->peer[r]) != 0)
      return ps_seterr(err, PS_ENOMEM, "cannot start a replication thread");
    rp->peer[r].started = 1;
  }
  PS_INFO("replication: shard %d replica %d of %d (server %d of %d); term %" PRIu64
          ", votes in %s",
          sv->index, rp->me, rp->R, rp->server, rp->N, rp->term, rp->vote_path);
  return PS_OK;
}

void ps_replica_stop(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return;
  pthread_mutex_lock(&rp->mu);
  rp->running = 0;
  if (rp->role == PRIMARY) step_down(rp, rp->term, "stopping");
  pthread_cond_broadcast(&rp->cv);
  pthread_mutex_unlock(&rp->mu);
  if (rp->manager_started) pthread_join(rp->manager, NULL);
  rp->manager_started = 0;
  for (int r = 0; r < rp->R; r++)
    if (rp->peer[r].started) {
      pthread_join(rp->peer[r].thread, NULL);
      rp->peer[r].started = 0;
    }
}

void ps_replica_free(ps_server *sv) {
  ps_replica *rp = sv->repl;
  if (!rp) return;
  for (int r = 0; r < rp->R; r++) rpc_channel_destroy(rp->peer[r].ch);
  for (int v = 0; v < rp->N; v++) rpc_channel_destroy(rp->vote_ch[v]);
  while (rp->head) {
    rentry *e = rp->head;
    rp->head = e->next;
    entry_unref(e);
  }
  pthread_mutex_destroy(&rp->mu);
  pthread_mutex_destroy(&rp->vote_mu);
  pthread_cond_destroy(&rp->cv);
  free(rp->addrs);
  free(rp->promised);
  free(rp->accepted);
  free(rp->vote_ch);
  free(rp);
  sv->repl = NULL;
}

size_t ps_replica_max_request(struct ps_server *sv) {
  size_t range = (ps_shard_end(sv->shard) - ps_shard_begin(sv->shard)) * sizeof(float);
  int ns = ps_shard_n_slots(sv->shard);
  /* A snapshot: parameters, slots, the workers' table; or a batch of
   * entries of two ranges' bytes at most and their headers. */
  size_t snap = range * (size_t)(1 + ns) +
                (size_t)sv->job.max_workers * (PS_RECENT_REQUESTS * (PS_REPLY_MAX + 24) + 256);
  size_t batch = 2 * range + BATCH_ENTRIES * 256;
  /* Embedding tables: a snapshot holds every row a table may hold here
   * (and a sync step's rows), an entry a push's ids and row values. */
  int dmax = 0;
  for (int t = 0; t < sv->n_tables; t++) {
    const ps_table_spec *sp = ps_table_spec_of(sv->tables[t]);
    uint64_t rows = sp->rows ? ps_table_shard_rows(sp, sv->cluster.n_ps, sv->index)
                             : sp->max_rows_per_shard;
    size_t vals = (size_t)sp->dim * (size_t)(2 + ps_table_n_slots(sv->tables[t]));
    snap += (size_t)rows * (16 + 4 * vals) + 64;
    if (sp->dim > dmax) dmax = sp->dim;
  }
  if (sv->n_tables)
    batch += 2 * (size_t)sv->job.max_rows_per_request * (8 + 4 * (size_t)dmax) +
             BATCH_ENTRIES * 16 * (size_t)sv->n_tables;
  return (snap > batch ? snap : batch) + (64u << 10);
}

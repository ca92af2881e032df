#include "worker/client/ps_client.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/cluster.h"
#include "common/half.h"
#include "common/job.h"
#include "common/rpc.h"
#include "common/util.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"

#define M_REGISTER "/ps.ParameterServer/Register"
#define M_HEARTBEAT "/ps.ParameterServer/Heartbeat"
#define M_LEAVE "/ps.ParameterServer/Leave"
#define M_PULL "/ps.ParameterServer/Pull"
#define M_PUSH "/ps.ParameterServer/Push"
#define M_LEASE "/ps.ParameterServer/Lease"

/* Leases whose epoch and chunk are remembered until their completion is
 * answered: a worker holds a few at once (shard 0 grants it 2); the oldest
 * is forgotten beyond this (a lease never reported done). */
#define GRANTS_KEPT 16
/* Leases whose completion shard 0 refused, kept (of the current lease
 * epoch and the one before) for a registration again with shard 0: one
 * restored to before the refusal counts what was trained of them. */
#define REFUSED_KEPT 64
/* Acknowledged completions kept for a registration again with shard 0 (the
 * oldest dropped beyond): a restart loses the newest ones, those since its
 * last checkpoint, and a Register request must stay well within what a
 * shard takes (its range and 64 KiB): at most 10 bytes each. */
#define DONE_KEPT 4096
/* The pause between tries on a shard's replicas while its primary moves:
 * from the first, doubling to the last (an election takes a few of the
 * replicas' heartbeats). */
#define FAILOVER_PAUSE_FIRST_MS 20
#define FAILOVER_PAUSE_MAX_MS 100
#define DEFAULT_FAILOVER_MS 15000
/* The room for one server's address (host:port). */
#define SERVER_ADDR_LEN 128

typedef struct {
  /* The shard's servers: its replicas in replica order (one without
   * replication), with a channel to each, made at connect and never
   * changed after, so that any thread may use them. cur is the replica
   * believed primary; any thread moves it (after a failure, or a replica
   * naming another), so it is read once per call. */
  char addr[PS_MAX_REPLICAS][SERVER_ADDR_LEN];
  rpc_channel *ch[PS_MAX_REPLICAS];
  atomic_int cur;
  atomic_int answered; /* the replica that answered last (-1: none yet): for the log */
  size_t off, cnt; /* the shard's range of the flat vector */
  uint8_t session[PS_SESSION_LEN]; /* from its Register answer, under sess_mu */
  size_t session_len;
} shard_conn;

struct ps_client {
  ps_client_opts opts;
  char host[64], role[16];
  uint64_t worker_id;
  int rank;
  uint64_t start_version; /* shard 0's, from the first registration */
  char job_id[64];
  char *job_json;
  size_t P;
  int hb_timeout_ms;
  int wait_ms; /* extra deadline for pulls the shards may hold back */
  int nshards;
  int nrep; /* replicas per shard (1: not replicated) */
  shard_conn *shards;
  rpc_queue *q;    /* training thread */
  rpc_queue *hb_q; /* heartbeat thread */
  rpc_queue *lease_q; /* lease calls, from any thread, under lease_mu */
  pthread_mutex_t lease_mu;
  uint64_t lease_request;  /* the id of the last Lease call (under lease_mu) */
  int lease_unanswered;    /* it ended without an answer: a retry reuses its id */
  uint64_t lease_args[2];  /* its complete_id and want_next */
  /* Leases granted, not yet answered done (under done_mu): a shard 0
   * restarted from a checkpoint hears of them when this worker registers
   * again, and takes back those nobody else holds; finishing: its
   * completion was sent, unanswered. */
  struct {
    uint64_t id;
    uint32_t epoch, chunk, count;
    uint32_t trained; /* examples of it in rounds shard 0 answered */
    int finishing;
  } grants[GRANTS_KEPT];
  int n_grants;
  struct {
    uint64_t id;
    uint32_t epoch, chunk, trained;
  } refused[REFUSED_KEPT]; /* completions refused (under done_mu) */
  int n_refused;
  /* The chunks of lease epochs done_epoch and the one before whose
   * completion shard 0 acknowledged, epoch << 32 | chunk, a ring of
   * DONE_KEPT (allocated at the first): a shard 0 restarted from a
   * checkpoint that lacks them hears of them when this worker registers
   * again. Under done_mu, taken last (within lease_mu or reg_mu). */
  pthread_mutex_t done_mu;
  uint64_t *done;
  size_t done_head, done_n;
  int64_t done_epoch; /* -1: no grant yet */
  pthread_mutex_t reg_mu; /* serializes re-registration */
  pthread_mutex_t sess_mu; /* the shards' session secrets */
  ps_token token;
  atomic_int tensors_in_flight; /* zero-copy push buffers gRPC still holds */
  rpc_request **reqs;
  /* How tensor values travel (the job's "wire"). With a 16-bit one, each
   * shard's slice of a gradient is encoded into wire_grads once per round
   * (a retry sends the same bytes) with error feedback: residual holds
   * what rounding lost, added to the next gradient before it is rounded. */
  ps_wire wire;
  float *residual;      /* (P), 16-bit wire only */
  uint16_t *wire_grads; /* (P), 16-bit wire only: sent without a copy */
  ps_moving_range moving[PS_MAX_MOVING_RANGES]; /* no error feedback there */
  int n_moving;
  /* Embedding rows of the pulls and pushes (ps_client_set_rows): the
   * job's tables, and two sets of the caller's sections, each with per
   * shard and section the ids placed there (as the wire takes them) with
   * their positions in the caller's section, and per shard the rows'
   * gradients as sent (gathered at a round's first attempt, so a retry
   * sends the same bytes). Rows set after a push round go to the other
   * set than the round's, which stays as it was sent: a shard that lost
   * the round (restarted from a checkpoint taken before it) asks for it
   * again at the next pull (sync), after the next batch's rows are set. */
  struct {
    int parsed, n_tables;
    size_t max_per_request; /* the job's max_rows_per_request */
    ps_table_spec spec[PS_MAX_TABLES];
    struct row_set {
      int n_sec;
      ps_client_rows sec[PS_MAX_TABLES];
      struct shard_rows {
        size_t n[PS_MAX_TABLES], cap[PS_MAX_TABLES];
        uint8_t *ids[PS_MAX_TABLES]; /* 8 n bytes, little-endian */
        size_t *pos[PS_MAX_TABLES];
        size_t values; /* floats over the sections */
        void *grads;   /* the rows' gradients (floats, then their 16-bit encoding) */
        void *sent;    /* what goes out: grads, or the encoding */
        size_t grads_cap;
        int gathered;  /* this round's are in grads */
      } *shard;
    } set[2];
    int cur;   /* the set of the next pulls and push round */
    void *tmp; /* a pull's rows, before they are scattered */
    size_t tmp_cap;
    int *place_shard; /* a section's placement (several shards) */
    uint64_t *place_local;
    size_t place_cap;
  } rows;
  /* The push round in progress (ps_client_push_begin .. push_end). */
  struct {
    uint64_t *versions; /* per shard */
    uint64_t step;
    uint64_t request_id; /* of this round, the same on every retry of it */
    int batch_size;
    uint64_t lease_id;  /* the lease the round's examples were drawn from, or 0 */
    int rows_set;        /* the row set (rows.set) of this round */
    const float *grads;  /* the gradient of the last round (kept by the caller) */
    uint64_t *answered;  /* per shard: the last round it answered (0: none) */
    char *state;        /* per shard: PUSH_PENDING, PUSH_IN_FLIGHT, PUSH_DONE */
    char *encoded;      /* per shard (16-bit wire): its slice is in wire_grads: ENC_FINITE,
                           ENC_NONFINITE (it holds Inf or NaN), or 0: not yet */
    rpc_request **reqs; /* per shard, while in flight */
    int *rep;           /* per shard, while in flight: the replica its call went to */
    ps_push_result res;
  } push;
};

enum { PUSH_PENDING = 0, PUSH_IN_FLIGHT = 1, PUSH_DONE = 2 };
enum { ENC_FINITE = 1, ENC_NONFINITE = 2 };

/* A request header for shard s (-1: no shard yet, no session); the
 * session is copied into sess (PS_SESSION_LEN bytes), which the header
 * points to, so that a registration on another thread cannot change it
 * while the request is packed. */
static void fill_header(ps_client *c, int s, Ps__RequestHeader *h, uint8_t *sess) {
  ps__request_header__init(h);
  h->protocol_version = PS_PROTOCOL_VERSION;
  h->job_id = (char *)c->job_id;
  h->worker_id = c->worker_id;
  h->token = (ProtobufCBinaryData){.len = c->token.len, .data = c->token.bytes};
  h->encoding = (Ps__Encoding)c->wire; /* Pull and Push: the values' */
  if (s >= 0) {
    pthread_mutex_lock(&c->sess_mu);
    memcpy(sess, c->shards[s].session, c->shards[s].session_len);
    h->session = (ProtobufCBinaryData){.len = c->shards[s].session_len, .data = sess};
    pthread_mutex_unlock(&c->sess_mu);
  }
}

/* Keeps shard s's session secret from its Register answer. */
static int keep_session(ps_client *c, int s, const Ps__RegisterResponse *r, char *err) {
  if (r->session.len > PS_SESSION_LEN)
    return ps_seterr(err, PS_EPROTO, "shard %d sent a session secret of %zu bytes", s,
                     r->session.len);
  pthread_mutex_lock(&c->sess_mu);
  memcpy(c->shards[s].session, r->session.data, r->session.len);
  c->shards[s].session_len = r->session.len;
  pthread_mutex_unlock(&c->sess_mu);
  return PS_OK;
}

/* Packs a small message (no tensor) into an rpc_msg that rpc copies. */
static int pack_small(const ProtobufCMessage *m, rpc_msg *out) {
  return wire_encode(m, NULL, 0, NULL, NULL, out);
}

/* One small unary call, with its reply unpacked. Returns the gRPC status. */
static int small_call(rpc_queue *q, rpc_channel *ch, const char *method,
                      const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                      ProtobufCMessage **resp, int timeout_ms, int wait_ready, char *detail) {
  rpc_msg msg;
  *resp = NULL;
  if (pack_small(req, &msg) != 0) {
    ps_seterr(detail, PS_ENOMEM, "cannot encode request");
    return RPC_INTERNAL;
  }
  uint8_t *buf = NULL;
  size_t len = 0;
  int st = rpc_call_sync(q, ch, method, &msg, timeout_ms, wait_ready, &buf, &len, detail);
  if (st != RPC_OK) return st;
  *resp = protobuf_c_message_unpack(resp_desc, NULL, len, buf);
  free(buf);
  if (!*resp) {
    ps_seterr(detail, PS_EPROTO, "malformed reply to %s", method);
    return RPC_INTERNAL;
  }
  return RPC_OK;
}

/* The replica of shard s believed primary now (0 without replication). */
static int replica_of(ps_client *c, int s) {
  return c->nrep > 1 ? atomic_load(&c->shards[s].cur) : 0;
}

/* wait_for_ready for a call to a shard: as the caller asks without
 * replication; with it, never, so that a call to a replica that is down
 * fails at once and the next replica is tried (gRPC connects again to one
 * that comes back within its reconnect back-off, a few seconds). */
static int ready_wait(const ps_client *c, int wait_ready) { return c->nrep > 1 ? 0 : wait_ready; }

/* Replica rep of shard s answered a call: a replica other than the one
 * that answered before is the shard's new primary (said once, by the
 * thread that sees it first). */
static void answered(ps_client *c, int s, int rep) {
  if (c->nrep <= 1) return;
  int before = atomic_exchange(&c->shards[s].answered, rep);
  if (before != rep && before != -1)
    PS_INFO("shard %d: primary is now replica %d (%s)", s, rep, c->shards[s].addr[rep]);
}

/* A call's tries on the replicas of one shard: when its first failure was
 * (0: none yet), and the pause before its next try. */
typedef struct {
  double since;
  int pause_ms;
} failover_clock;

/* Replica rep of shard s ended a call with status st and message detail:
 * whether to send the call again, to the replica now believed primary
 * (the caller reads it again). Yes when the shard is replicated, the call
 * found no server (UNAVAILABLE, DEADLINE_EXCEEDED) or the replica named
 * its primary, and this call's first such failure (fc) is less than
 * window_ms ago. The shard then moves to the replica named (the primary
 * naming itself, as it does for a request it is still applying, keeps
 * it), else to the next one (unless another thread moved it already: both
 * calls then go to where it moved), and the call pauses first, as nobody
 * may be primary yet (an election takes a few of the replicas'
 * heartbeats). Without replication: no, at once. */
static int failover(ps_client *c, int s, int rep, int st, const char *detail, failover_clock *fc,
                    int window_ms) {
  if (c->nrep <= 1 || st == RPC_OK) return 0;
  int named = ps_redirect_parse(detail);
  if (st != RPC_UNAVAILABLE && st != RPC_DEADLINE_EXCEEDED && named == -2) return 0;
  double now = ps_now_s();
  if (fc->since == 0) {
    fc->since = now;
    fc->pause_ms = FAILOVER_PAUSE_FIRST_MS;
  } else if ((now - fc->since) * 1000 >= window_ms) {
    return 0;
  }
  int next = named >= 0 && named < c->nrep ? named : (rep + 1) % c->nrep;
  PS_DEBUG("shard %d replica %d: %s: %s; trying replica %d in %d ms", s, rep, rpc_status_name(st),
           detail, next, fc->pause_ms);
  int expected = rep;
  atomic_compare_exchange_strong(&c->shards[s].cur, &expected, next);
  ps_sleep_ms(fc->pause_ms);
  fc->pause_ms *= 2;
  if (fc->pause_ms > FAILOVER_PAUSE_MAX_MS) fc->pause_ms = FAILOVER_PAUSE_MAX_MS;
  return 1;
}

/* The leases granted and not answered done, then those whose completion
 * was refused, as a Register names them: a malloc'd block of n messages then their pointers
 * (*ptrs), which the caller frees (NULL when there are none, or out of memory: they are a record's,
 * not training's). */
static Ps__HeldLease *held_copy(ps_client *c, Ps__HeldLease ***ptrs, size_t *n) {
  pthread_mutex_lock(&c->done_mu);
  size_t g = (size_t)c->n_grants, k = g + (size_t)c->n_refused;
  Ps__HeldLease *m = k ? malloc(k * (sizeof *m + sizeof(Ps__HeldLease *))) : NULL;
  Ps__HeldLease **p = m ? (Ps__HeldLease **)(void *)(m + k) : NULL;
  *n = m ? k : 0;
  for (size_t i = 0; i < *n; i++) {
    ps__held_lease__init(&m[i]);
    if (i < g) {
      m[i].lease_id = c->grants[i].id;
      m[i].epoch = c->grants[i].epoch;
      m[i].chunk = c->grants[i].chunk;
      m[i].finished = c->grants[i].finishing;
      m[i].trained = c->grants[i].trained;
    } else {
      m[i].lease_id = c->refused[i - g].id;
      m[i].epoch = c->refused[i - g].epoch;
      m[i].chunk = c->refused[i - g].chunk;
      m[i].trained = c->refused[i - g].trained;
      m[i].refused = 1;
    }
    p[i] = &m[i];
  }
  pthread_mutex_unlock(&c->done_mu);
  *ptrs = p;
  return m;
}

/* A copy of the acknowledged completions, oldest first, in a malloc'd
 * array (NULL when there are none, or out of memory: they are a record's,
 * not training's). */
static uint64_t *done_copy(ps_client *c, size_t *n) {
  pthread_mutex_lock(&c->done_mu);
  uint64_t *out = c->done_n ? malloc(c->done_n * sizeof *out) : NULL;
  *n = out ? c->done_n : 0;
  for (size_t i = 0; i < *n; i++) out[i] = c->done[(c->done_head + i) % DONE_KEPT];
  pthread_mutex_unlock(&c->done_mu);
  return out;
}

/* Registers with shard s using the known worker id; fills its range.
 * again: shard s had forgotten this worker; shard 0 then hears which
 * chunks of the epoch it acknowledged as done (a restart from a
 * checkpoint may have lost them). window_ms: how long its replicas are
 * tried (replicated shards). */
static int register_with(ps_client *c, rpc_queue *q, int s, int timeout_ms, int wait_ready,
                         int again, int window_ms, char *err) {
  Ps__RequestHeader h;
  uint8_t sess[PS_SESSION_LEN];
  fill_header(c, s, &h, sess);
  Ps__RegisterRequest req = PS__REGISTER_REQUEST__INIT;
  req.header = &h;
  req.host = c->host;
  req.role = c->role;
  req.task_index = c->opts.task_index;
  uint64_t *done = NULL;
  Ps__HeldLease *held = NULL;
  if (again && s == 0) {
    done = done_copy(c, &req.n_done_chunks);
    req.done_chunks = done;
    held = held_copy(c, &req.held_leases, &req.n_held_leases);
  }
  ProtobufCMessage *resp_m = NULL;
  char detail[PS_ERRLEN] = "";
  failover_clock fc = {0};
  int rep, st;
  do {
    rep = replica_of(c, s);
    detail[0] = 0;
    st = small_call(q, c->shards[s].ch[rep], M_REGISTER, &req.base,
                    &ps__register_response__descriptor, &resp_m, timeout_ms,
                    ready_wait(c, wait_ready), detail);
  } while (failover(c, s, rep, st, detail, &fc, window_ms));
  free(done);
  free(held);
  if (st != RPC_OK)
    /* ALREADY_EXISTS: the shard still holds a registration of this id
     * whose answer was lost; it times out, and a retry then succeeds. */
    return ps_seterr(err,
                     st == RPC_UNAVAILABLE || st == RPC_DEADLINE_EXCEEDED || st == RPC_ALREADY_EXISTS
                         ? PS_EUNAVAIL
                         : PS_EPROTO,
                     "Register with shard %d (%s): %s: %s", s, c->shards[s].addr[rep],
                     rpc_status_name(st), detail);
  answered(c, s, rep);
  Ps__RegisterResponse *r = (Ps__RegisterResponse *)resp_m;
  int rc = PS_OK;
  if ((int)r->shard_index != s || r->param_count != c->P) {
    rc = ps_seterr(err, PS_EPROTO,
                   "shard at %s says it is shard %u of a model of %" PRIu64
                   " values; expected shard %d of %zu",
                   c->shards[s].addr[rep], r->shard_index, r->param_count, s, c->P);
  } else {
    c->shards[s].off = r->range_offset;
    c->shards[s].cnt = r->range_count;
    rc = keep_session(c, s, r, err);
  }
  protobuf_c_message_free_unpacked(resp_m, NULL);
  return rc;
}

/* The client's own fields from opts, its locks and its completion queues;
 * nothing is connected yet. 0, or a code with a message (the caller
 * destroys c either way). */
static int client_init(ps_client *c, const ps_client_opts *opts, char *err) {
  c->opts = *opts;
  if (c->opts.timeout_ms <= 0) c->opts.timeout_ms = 30000;
  if (c->opts.connect_timeout_ms <= 0) c->opts.connect_timeout_ms = 60000;
  if (c->opts.failover_ms <= 0) c->opts.failover_ms = DEFAULT_FAILOVER_MS;
  snprintf(c->host, sizeof c->host, "%s", opts->host ? opts->host : "");
  snprintf(c->role, sizeof c->role, "%s", opts->role ? opts->role : "worker");
  pthread_mutex_init(&c->reg_mu, NULL);
  pthread_mutex_init(&c->sess_mu, NULL);
  if (opts->token) c->token = *opts->token;
  atomic_init(&c->tensors_in_flight, 0);
  c->q = rpc_queue_create();
  c->hb_q = rpc_queue_create();
  c->lease_q = rpc_queue_create();
  pthread_mutex_init(&c->lease_mu, NULL);
  pthread_mutex_init(&c->done_mu, NULL);
  c->done_epoch = -1;
  if (!c->q || !c->hb_q || !c->lease_q)
    return ps_seterr(err, PS_ENOMEM, "cannot create completion queues");
  return PS_OK;
}

/* The first Register, with the server at ch (any shard, or a replica of
 * one): no job and no session yet. Returns the gRPC status; the answer in
 * *m, the failure's message in detail. */
static int register_first(ps_client *c, rpc_channel *ch, int call_ms, int wait_ready,
                          ProtobufCMessage **m, char *detail) {
  Ps__RequestHeader h;
  ps__request_header__init(&h);
  h.protocol_version = PS_PROTOCOL_VERSION;
  h.job_id = "";
  h.token = (ProtobufCBinaryData){.len = c->token.len, .data = c->token.bytes};
  Ps__RegisterRequest req = PS__REGISTER_REQUEST__INIT;
  req.header = &h;
  req.host = c->host;
  req.role = c->role;
  req.task_index = c->opts.task_index;
  return small_call(c->q, ch, M_REGISTER, &req.base, &ps__register_response__descriptor, m, call_ms,
                    wait_ready, detail);
}

/* The error of a first Register with target that ended with status st:
 * after a deadline, why nothing may have answered (a name that does not
 * resolve, or TLS on one side only). Returns the code. */
static int first_register_error(const char *target, int st, const char *detail, char *err) {
  char dns[PS_ERRLEN] = "", why[PS_ERRLEN + 8] = "";
  if (st == RPC_DEADLINE_EXCEEDED && ps_addr_resolve(target, dns) == PS_EUNAVAIL)
    snprintf(why, sizeof why, " (%.200s)", dns);
  else if (st == RPC_DEADLINE_EXCEEDED)
    snprintf(why, sizeof why,
             " (nothing answered: is the server up, and does it talk TLS "
             "(--tls-ca) or plaintext (--insecure) as this worker does?)");
  return ps_seterr(err, st == RPC_DEADLINE_EXCEEDED ? PS_EUNAVAIL : PS_EPROTO,
                   "Register with %s: %s: %s%s", target, rpc_status_name(st), detail, why);
}

/* Moves target to the replica of shard 0 after the one it names (the
 * first when it names none of them: zero holds the nzero replicas), after
 * a pause that doubles up to FAILOVER_PAUSE_MAX_MS: an election may be
 * under way. */
static void next_replica_of_shard0(char *target, char zero[][SERVER_ADDR_LEN], int nzero,
                                   failover_clock *fc) {
  int k = 0;
  while (k < nzero && strcmp(zero[k], target) != 0) k++;
  memcpy(target, zero[k < nzero ? (k + 1) % nzero : 0], SERVER_ADDR_LEN);
  if (!fc->pause_ms) fc->pause_ms = FAILOVER_PAUSE_FIRST_MS;
  ps_sleep_ms(fc->pause_ms);
  fc->pause_ms =
      fc->pause_ms * 2 < FAILOVER_PAUSE_MAX_MS ? fc->pause_ms * 2 : FAILOVER_PAUSE_MAX_MS;
}

/* First contact: registers this worker with shard 0, starting at the
 * server at addr (any shard); one that is not shard 0 names shard 0.
 * With replicated shards a replica of shard 0 that is not its primary
 * answers the same way, naming the primary when it knows it and listing
 * every replica: the worker follows the names (up to R + 2 hops in a
 * row), and when none is named, a replica fails, or the names go round
 * (replicas that disagree during an election), tries shard 0's replicas
 * in turn after a pause, for at most connect_timeout_ms in all. Without
 * replication: at most two calls, as the first answer names shard 0.
 * Returns shard 0's answer (the caller frees it), with target (of
 * SERVER_ADDR_LEN bytes) the server that gave it; or NULL with a
 * message. */
static Ps__RegisterResponse *register_with_shard0(ps_client *c, const char *addr,
                                                  const rpc_channel_opts *chan_opts, char *target,
                                                  char *err) {
  snprintf(target, SERVER_ADDR_LEN, "%s", addr);
  Ps__RegisterResponse *r = NULL;
  char zero[PS_MAX_REPLICAS][SERVER_ADDR_LEN]; /* shard 0's replicas, once an answer listed them */
  int nzero = 0;
  int hops = 0; /* names followed in a row */
  failover_clock fc = {0};
  double t0 = ps_now_s();
  for (int calls = 0;; calls++) {
    /* Replicated: each try within what is left of connect_timeout_ms. */
    int call_ms = c->opts.connect_timeout_ms;
    if (nzero > 1) {
      call_ms -= (int)((ps_now_s() - t0) * 1000);
      if (call_ms < 1) call_ms = 1;
    }
    rpc_channel *ch = rpc_channel_create(target, chan_opts, err);
    if (!ch) return NULL;
    ProtobufCMessage *m = NULL;
    char detail[PS_ERRLEN] = "";
    int st = register_first(c, ch, call_ms, nzero > 1 ? 0 : 1, &m, detail);
    rpc_channel_destroy(ch);
    int in_time = (ps_now_s() - t0) * 1000 < c->opts.connect_timeout_ms;
    const char *next = NULL; /* the server named to ask next; NULL: shard 0's next replica */
    if (st != RPC_OK && nzero > 1 && in_time) {
      next = NULL; /* a replica of shard 0 that is down, or not primary: the next one */
    } else if (st != RPC_OK) {
      first_register_error(target, st, detail, err);
      return NULL;
    } else {
      r = (Ps__RegisterResponse *)m;
      if (r->worker_id != 0 || r->n_shards == 0) break;
      /* Not shard 0, or not its primary: go there. */
      uint32_t R = r->replicas_per_shard;
      if (R > 1 && R <= PS_MAX_REPLICAS && r->n_replicas >= R) {
        nzero = (int)R;
        for (int k = 0; k < nzero; k++)
          snprintf(zero[k], sizeof zero[k], "%s", r->replicas[k] ? r->replicas[k] : "");
      }
      if (nzero <= 1) {
        if (calls >= 1) break; /* shard 0 did not register it: refused below */
        next = r->shards[0] ? r->shards[0] : "";
      } else if (!in_time) {
        break;
      } else if (r->shards[0] && r->shards[0][0] && strcmp(r->shards[0], target) != 0 &&
                 hops < nzero + 1) {
        next = r->shards[0];
        hops++;
      } else {
        next = NULL; /* nobody is primary yet (as far as it knows) */
      }
    }
    if (!next) {
      next_replica_of_shard0(target, zero, nzero, &fc);
      hops = 0;
    } else {
      snprintf(target, SERVER_ADDR_LEN, "%s", next);
    }
    if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
    r = NULL;
  }
  if (!r || r->worker_id == 0 || r->n_shards == 0 || !r->job_json) {
    ps_seterr(err, PS_EPROTO, "server at %s did not register this worker", target);
    if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
    return NULL;
  }
  return r;
}

/* The arrays of c->nshards entries: the shards' connections and each
 * shard's state of a push round. 0, or -1 when out of memory (what was
 * allocated is freed by ps_client_destroy). */
static int alloc_per_shard(ps_client *c) {
  c->shards = calloc((size_t)c->nshards, sizeof *c->shards);
  c->reqs = calloc((size_t)c->nshards, sizeof *c->reqs);
  c->push.versions = calloc((size_t)c->nshards, sizeof *c->push.versions);
  c->push.state = calloc((size_t)c->nshards, 1);
  c->push.encoded = calloc((size_t)c->nshards, 1);
  c->push.reqs = calloc((size_t)c->nshards, sizeof *c->push.reqs);
  c->push.rep = calloc((size_t)c->nshards, sizeof *c->push.rep);
  c->push.answered = calloc((size_t)c->nshards, sizeof *c->push.answered);
  return !c->shards || !c->reqs || !c->push.versions || !c->push.state || !c->push.encoded ||
                 !c->push.reqs || !c->push.rep || !c->push.answered
             ? -1
             : 0;
}

/* Each shard's addresses, from shard 0's answer r (given by the server at
 * target), and the replica of each believed primary. */
static void place_shard_replicas(ps_client *c, const Ps__RegisterResponse *r, const char *target) {
  int nrep = c->nrep;
  for (int s = 0; s < c->nshards; s++) {
    shard_conn *sc = &c->shards[s];
    int cur = 0;
    if (nrep == 1) {
      snprintf(sc->addr[0], sizeof sc->addr[0], "%s", r->shards[s]);
    } else {
      /* The replica believed primary: for shard 0 the one that registered
       * this worker, else the one the shard list names (its first replica
       * when the servers know no better; a wrong guess is redirected). */
      for (int k = 0; k < nrep; k++) {
        const char *a = r->replicas[(size_t)s * nrep + k];
        snprintf(sc->addr[k], sizeof sc->addr[k], "%s", a ? a : "");
      }
      int found = -1;
      for (int k = 0; s == 0 && k < nrep && found < 0; k++)
        if (strcmp(sc->addr[k], target) == 0) found = k;
      for (int k = 0; r->shards[s] && k < nrep && found < 0; k++)
        if (strcmp(sc->addr[k], r->shards[s]) == 0) found = k;
      if (found >= 0) cur = found;
    }
    atomic_init(&sc->cur, cur);
    atomic_init(&sc->answered, s == 0 ? cur : -1);
  }
  if (nrep > 1)
    PS_INFO("shards have %d replicas each; shard 0's primary is replica %d (%s)", nrep,
            atomic_load(&c->shards[0].cur), c->shards[0].addr[atomic_load(&c->shards[0].cur)]);
}

/* Takes in shard 0's answer r (given by the server at target): who this
 * worker is, the job, the model's size, the shards and their replicas,
 * and shard 0's range and session. 0, or a code with a message. */
static int adopt_registration(ps_client *c, const Ps__RegisterResponse *r, const char *target,
                              char *err) {
  /* Replicated shards: R addresses per shard, in shard order. */
  int nrep = r->replicas_per_shard > 1 ? (int)r->replicas_per_shard : 1;
  if (nrep > PS_MAX_REPLICAS || (nrep > 1 && r->n_replicas != r->n_shards * (size_t)nrep))
    return ps_seterr(err, PS_EPROTO,
                     "server at %s lists %zu replicas for %zu shards of %d replicas each (at "
                     "most %d)",
                     target, r->n_replicas, r->n_shards, nrep, PS_MAX_REPLICAS);
  c->nrep = nrep;
  c->worker_id = r->worker_id;
  c->rank = (int)r->worker_rank;
  c->start_version = r->start_version;
  c->P = r->param_count;
  c->hb_timeout_ms = r->heartbeat_timeout_ms ? (int)r->heartbeat_timeout_ms : 10000;
  snprintf(c->job_id, sizeof c->job_id, "%s", r->job_id ? r->job_id : "");
  c->job_json = strdup(r->job_json);
  c->nshards = (int)r->n_shards;
  int allocated = alloc_per_shard(c);
  if (!c->job_json || allocated != 0) return ps_seterr(err, PS_ENOMEM, "out of memory");
  place_shard_replicas(c, r, target);
  c->shards[0].off = r->range_offset;
  c->shards[0].cnt = r->range_count;
  return keep_session(c, 0, r, err);
}

/* A channel to every replica of every shard, and the registration with
 * shards 1 and on (shard 0 registered this worker already). 0, or
 * non-zero with a message. */
static int connect_shards(ps_client *c, const rpc_channel_opts *chan_opts, char *err) {
  rpc_channel_opts shard_opts = *chan_opts;
  /* A replica that comes back (and may be the next primary) is reached
   * within a failover pause, not after gRPC's reconnect back-off. */
  if (c->nrep > 1) shard_opts.reconnect_ms = FAILOVER_PAUSE_MAX_MS;
  for (int s = 0; s < c->nshards; s++)
    for (int k = 0; k < c->nrep; k++) {
      c->shards[s].ch[k] = rpc_channel_create(c->shards[s].addr[k], &shard_opts, err);
      if (!c->shards[s].ch[k]) return -1;
    }
  for (int s = 1; s < c->nshards; s++) {
    int rc = register_with(c, c->q, s, c->opts.connect_timeout_ms, 1, 0, c->opts.connect_timeout_ms,
                           err);
    if (rc != 0) return rc;
  }
  return PS_OK;
}

/* The shards' ranges must tile [0, P) in shard order. 0, or PS_EPROTO with
 * a message. */
static int check_shard_ranges(ps_client *c, char *err) {
  size_t next = 0;
  for (int s = 0; s < c->nshards; s++) {
    if (c->shards[s].off != next)
      return ps_seterr(err, PS_EPROTO,
                       "shard %d (%s) holds [%zu, %zu), expected it to start at %zu", s,
                       c->shards[s].addr[replica_of(c, s)], c->shards[s].off,
                       c->shards[s].off + c->shards[s].cnt, next);
    next += c->shards[s].cnt;
  }
  if (next != c->P)
    return ps_seterr(err, PS_EPROTO, "shards hold %zu values, the model has %zu", next, c->P);
  return PS_OK;
}

Ps__StatusResponse *ps_status_call(rpc_queue *q, rpc_channel *ch, const ps_token *token,
                                   int timeout_ms, int *code, char *why) {
  Ps__RequestHeader h = PS__REQUEST_HEADER__INIT;
  h.protocol_version = PS_PROTOCOL_VERSION;
  h.job_id = "";
  h.token = (ProtobufCBinaryData){.len = token->len, .data = (uint8_t *)token->bytes};
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  rpc_msg msg;
  *code = RPC_INTERNAL;
  if (wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) != 0) {
    snprintf(why, PS_ERRLEN, "cannot encode the Status request");
    return NULL;
  }
  uint8_t *buf = NULL;
  size_t len = 0;
  *code = rpc_call_sync(q, ch, "/ps.ParameterServer/Status", &msg, timeout_ms, 1, &buf, &len, why);
  Ps__StatusResponse *r = *code == RPC_OK ? ps__status_response__unpack(NULL, len, buf) : NULL;
  free(buf);
  if (*code == RPC_OK && !r) snprintf(why, PS_ERRLEN, "malformed Status reply");
  return r;
}

ps_client *ps_client_connect(const char *addr, const ps_client_opts *opts, char *err) {
  ps_client *c = calloc(1, sizeof *c);
  if (!c) {
    ps_seterr(err, PS_ENOMEM, "out of memory");
    return NULL;
  }
  if (client_init(c, opts, err) != 0) goto fail;
  rpc_channel_opts chan_opts = {.keepalive_ms = RPC_DEFAULT_KEEPALIVE_MS,
                                .tls = opts->tls,
                                .own_connection = opts->own_connections};
  char target[SERVER_ADDR_LEN]; /* the server that registered this worker */
  Ps__RegisterResponse *r = register_with_shard0(c, addr, &chan_opts, target, err);
  if (!r) goto fail;
  int adopted = adopt_registration(c, r, target, err);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (adopted != 0 || connect_shards(c, &chan_opts, err) != 0 || check_shard_ranges(c, err) != 0)
    goto fail;
  return c;
fail:
  ps_client_destroy(c);
  return NULL;
}

void ps_client_destroy(ps_client *c) {
  if (!c) return;
  for (int s = 0; s < c->nshards && c->shards; s++)
    for (int k = 0; k < PS_MAX_REPLICAS; k++) rpc_channel_destroy(c->shards[s].ch[k]);
  free(c->shards);
  free(c->reqs);
  for (int s = 0; s < c->nshards && c->push.reqs; s++)
    if (c->push.reqs[s]) rpc_request_free(c->push.reqs[s]); /* cancels it */
  free(c->push.reqs);
  free(c->push.rep);
  free(c->push.versions);
  free(c->push.state);
  free(c->push.encoded);
  free(c->push.answered);
  for (int k = 0; k < 2; k++) {
    struct row_set *rs = &c->rows.set[k];
    for (int s = 0; s < c->nshards && rs->shard; s++) {
      for (int t = 0; t < PS_MAX_TABLES; t++) {
        free(rs->shard[s].ids[t]);
        free(rs->shard[s].pos[t]);
      }
      free(rs->shard[s].grads);
    }
    free(rs->shard);
  }
  free(c->rows.tmp);
  free(c->rows.place_shard);
  free(c->rows.place_local);
  ps_free(c->residual);
  ps_free(c->wire_grads);
  free(c->job_json);
  if (c->q) rpc_queue_destroy(c->q);
  if (c->hb_q) rpc_queue_destroy(c->hb_q);
  if (c->lease_q) rpc_queue_destroy(c->lease_q);
  pthread_mutex_destroy(&c->lease_mu);
  pthread_mutex_destroy(&c->done_mu);
  free(c->done);
  pthread_mutex_destroy(&c->reg_mu);
  pthread_mutex_destroy(&c->sess_mu);
  memset(&c->token, 0, sizeof c->token);
  free(c);
}

const char *ps_client_job_json(const ps_client *c) { return c->job_json; }
uint64_t ps_client_worker_id(const ps_client *c) { return c->worker_id; }
int ps_client_rank(const ps_client *c) { return c->rank; }
uint64_t ps_client_start_version(const ps_client *c) { return c->start_version; }
int ps_client_num_shards(const ps_client *c) { return c->nshards; }
size_t ps_client_param_count(const ps_client *c) { return c->P; }
int ps_client_heartbeat_timeout_ms(const ps_client *c) { return c->hb_timeout_ms; }

/* A shard that answers NOT_FOUND no longer knows this worker (it timed the
 * worker out, or restarted): register again and let the caller retry. */
static int reregister(ps_client *c, rpc_queue *q, int s, char *err) {
  pthread_mutex_lock(&c->reg_mu);
  int rc = register_with(c, q, s, c->opts.timeout_ms, 1, 1, c->opts.failover_ms, err);
  pthread_mutex_unlock(&c->reg_mu);
  if (rc == 0) PS_WARN("shard %d (%s) had forgotten this worker; registered again", s,
                       c->shards[s].addr[replica_of(c, s)]);
  return rc;
}

void ps_client_set_wait_ms(ps_client *c, int wait_ms) { c->wait_ms = wait_ms > 0 ? wait_ms : 0; }

void ps_client_set_moving(ps_client *c, const ps_moving_range *mr, int n) {
  if (n < 0) n = 0;
  if (n > PS_MAX_MOVING_RANGES) n = PS_MAX_MOVING_RANGES;
  for (int r = 0; r < n; r++) c->moving[r] = mr[r];
  c->n_moving = n;
}

int ps_client_set_wire(ps_client *c, ps_wire wire, char *err) {
  if (wire == c->wire) return PS_OK;
  for (int s = 0; s < c->nshards; s++)
    if (c->push.state[s] == PUSH_IN_FLIGHT)
      return ps_seterr(err, PS_ESTATE, "the wire encoding cannot change while a push is in flight");
  float *residual = NULL;
  uint16_t *wire_grads = NULL;
  if (wire != PS_WIRE_FP32) {
    residual = ps_alloc((c->P ? c->P : 1) * sizeof *residual); /* zeroed */
    wire_grads = ps_alloc((c->P ? c->P : 1) * sizeof *wire_grads);
    if (!residual || !wire_grads) {
      ps_free(residual);
      ps_free(wire_grads);
      return ps_seterr(err, PS_ENOMEM, "out of memory for the %s gradient of %zu values",
                       ps_wire_name(wire), c->P);
    }
  }
  ps_free(c->residual);
  ps_free(c->wire_grads);
  c->residual = residual;
  c->wire_grads = wire_grads;
  c->wire = wire;
  return PS_OK;
}

ps_wire ps_client_wire(const ps_client *c) { return c->wire; }

const float *ps_client_residual(const ps_client *c) { return c->residual; }

/* The shard answered as if this worker were not (or no longer) registered
 * with it: NOT_FOUND (it forgot the worker), or UNAUTHENTICATED (the call
 * carried a session secret that another thread's registration has just
 * replaced). Registering again (which carries the current secret) and
 * retrying once settles both; a wrong job token fails that registration
 * with a message that says so. */
static int must_register(int st) { return st == RPC_NOT_FOUND || st == RPC_UNAUTHENTICATED; }

/* gRPC status of a failed call as one of our codes. */
static int status_code(int st) {
  if (st == RPC_UNAVAILABLE || st == RPC_DEADLINE_EXCEEDED) return PS_EUNAVAIL;
  if (st == RPC_ABORTED) return PS_ETIMEDOUT; /* a shard gave up waiting */
  if (st == RPC_NOT_FOUND) return PS_ENOTFOUND;
  /* A shard restarted again while the round it lost was pushed again:
   * the next try pushes it again. */
  if (st == RPC_DATA_LOSS) return PS_EUNAVAIL;
  return PS_EPROTO;
}

/* Shard s's values from a pull's tensor into out (its cnt floats): copied
 * (fp32), or decoded (16-bit). A 16-bit value that is Inf or NaN (a
 * parameter beyond fp16's range, which the shard sends as Inf) is refused:
 * PS_EPROTO with a message; out may then hold part of the range. */
static int read_values(ps_client *c, int s, const ps_segview *tensor, float *out, char *err) {
  size_t cnt = c->shards[s].cnt, bad = cnt;
  if (c->wire == PS_WIRE_FP32) {
    ps_segview_copy(tensor, 0, out, cnt * sizeof(float));
    return PS_OK;
  }
  ps_half_decode_view(c->wire, tensor, out, cnt, &bad);
  if (bad == cnt) return PS_OK;
  return ps_seterr(err, PS_EPROTO,
                   "Pull from shard %d (%s): parameter %zu (global index) arrived as %s: "
                   "beyond %s's range (a shard sends such a value as Inf), so the job's "
                   "parameters cannot travel as %s; refused (use \"wire\": \"bf16\" or "
                   "\"fp32\")",
                   s, c->shards[s].addr[replica_of(c, s)], c->shards[s].off + bad,
                   isnan(out[bad]) ? "NaN" : out[bad] > 0 ? "+Inf" : "-Inf",
                   ps_wire_name(c->wire), ps_wire_name(c->wire));
}

/* ---- embedding rows ---- */

static int grow(void **p, size_t *cap, size_t want) {
  if (want <= *cap) return PS_OK;
  size_t n = *cap ? *cap : 1024;
  while (n < want) n *= 2;
  void *q = realloc(*p, n);
  if (!q) return PS_ENOMEM;
  *p = q;
  *cap = n;
  return PS_OK;
}

int ps_client_set_rows(ps_client *c, const ps_client_rows *secs, int n_sec, char *err) {
  if (!c->rows.parsed) {
    ps_job *job = malloc(sizeof *job);
    if (!job) return ps_seterr(err, PS_ENOMEM, "out of memory");
    char jerr[PS_ERRLEN];
    int rc = ps_job_parse(c->job_json, job, jerr);
    if (rc == PS_OK) {
      c->rows.n_tables = job->n_tables;
      c->rows.max_per_request = (size_t)job->max_rows_per_request;
      memcpy(c->rows.spec, job->tables, sizeof c->rows.spec);
    }
    free(job);
    if (rc != PS_OK) return ps_seterr(err, rc, "the job's tables: %s", jerr);
    for (int k = 0; k < 2; k++) {
      c->rows.set[k].shard = calloc((size_t)c->nshards, sizeof *c->rows.set[k].shard);
      if (!c->rows.set[k].shard) return ps_seterr(err, PS_ENOMEM, "out of memory");
    }
    c->rows.parsed = 1;
  }
  for (int s = 0; s < c->nshards; s++)
    if (c->push.state[s] == PUSH_IN_FLIGHT)
      return ps_seterr(err, PS_ESTATE, "rows set while a push is in flight");
  if (n_sec < 0 || n_sec > c->rows.n_tables)
    return ps_seterr(err, PS_EINVAL, "%d row sections, but the job has %d embedding table(s)",
                     n_sec, c->rows.n_tables);
  uint32_t seen = 0;
  for (int i = 0; i < n_sec; i++) {
    int t = secs[i].table;
    if (t < 0 || t >= c->rows.n_tables || (seen & (1u << t)))
      return ps_seterr(err, PS_EINVAL, "row section %d: table %d is not one of the job's %d, or "
                       "is named twice", i, t, c->rows.n_tables);
    seen |= 1u << t;
    for (size_t j = 0; j < secs[i].n; j++)
      if (!ps_table_id_ok(&c->rows.spec[t], secs[i].ids[j]))
        return ps_seterr(err, PS_ERANGE, "table '%s': id %" PRIu64 " is not a row (it has %" PRIu64
                         ")", c->rows.spec[t].name, secs[i].ids[j], c->rows.spec[t].rows);
  }
  /* The last push round's set stays as it was sent. */
  if (c->rows.cur == c->push.rows_set) c->rows.cur ^= 1;
  struct row_set *rs = &c->rows.set[c->rows.cur];
  rs->n_sec = 0; /* none until the new ones are placed */
  for (int s = 0; s < c->nshards; s++) {
    struct shard_rows *sr = &rs->shard[s];
    memset(sr->n, 0, sizeof sr->n);
    sr->values = 0;
    sr->gathered = 0;
  }
  for (int i = 0; i < n_sec; i++) {
    const ps_table_spec *ts = &c->rows.spec[secs[i].table];
    /* Which shard each id lives on (all on the one shard there is). */
    if (c->nshards > 1) {
      if (secs[i].n > c->rows.place_cap) {
        free(c->rows.place_shard);
        free(c->rows.place_local);
        c->rows.place_shard = malloc(secs[i].n * sizeof *c->rows.place_shard);
        c->rows.place_local = malloc(secs[i].n * sizeof *c->rows.place_local);
        c->rows.place_cap = c->rows.place_shard && c->rows.place_local ? secs[i].n : 0;
        if (!c->rows.place_cap) return ps_seterr(err, PS_ENOMEM, "out of memory placing rows");
      }
      ps_table_place_many(ts, c->nshards, secs[i].ids, secs[i].n, c->rows.place_shard,
                          c->rows.place_local);
    }
    for (size_t j = 0; j < secs[i].n; j++) {
      const int s = c->nshards > 1 ? c->rows.place_shard[j] : 0;
      struct shard_rows *sr = &rs->shard[s];
      size_t k = sr->n[i];
      if (k == sr->cap[i]) {
        size_t cap = k ? 2 * k : 256;
        uint8_t *ids = realloc(sr->ids[i], cap * 8);
        if (ids) sr->ids[i] = ids;
        size_t *pos = realloc(sr->pos[i], cap * sizeof *pos);
        if (pos) sr->pos[i] = pos;
        if (!ids || !pos) return ps_seterr(err, PS_ENOMEM, "out of memory placing rows");
        sr->cap[i] = cap;
      }
      ps_put_le64(sr->ids[i] + 8 * k, secs[i].ids[j]);
      sr->pos[i][k] = j;
      sr->n[i] = k + 1;
      sr->values += (size_t)ts->dim;
    }
  }
  for (int s = 0; s < c->nshards; s++) {
    size_t n = 0;
    for (int i = 0; i < n_sec; i++) n += rs->shard[s].n[i];
    if (n > c->rows.max_per_request) {
      for (int k = 0; k < c->nshards; k++) memset(rs->shard[k].n, 0, sizeof rs->shard[k].n);
      return ps_seterr(err, PS_ERANGE,
                       "%zu rows for shard %d in one request, above the job's "
                       "max_rows_per_request (%zu): split the batch or raise it",
                       n, s, c->rows.max_per_request);
    }
  }
  if (n_sec) memcpy(rs->sec, secs, (size_t)n_sec * sizeof *secs);
  rs->n_sec = n_sec;
  return PS_OK;
}

/* Shard s's row sections of set rs for a request (into msgs and ptrs,
 * PS_MAX_TABLES each); how many. */
static size_t rows_msgs(const struct row_set *rs, int s, Ps__TableRows *msgs,
                        Ps__TableRows **ptrs) {
  size_t k = 0;
  if (!rs->n_sec) return 0;
  const struct shard_rows *sr = &rs->shard[s];
  for (int i = 0; i < rs->n_sec; i++) {
    if (!sr->n[i]) continue;
    ps__table_rows__init(&msgs[k]);
    msgs[k].table = (uint32_t)rs->sec[i].table;
    msgs[k].ids = (ProtobufCBinaryData){.len = 8 * sr->n[i], .data = sr->ids[i]};
    ptrs[k] = &msgs[k];
    k++;
  }
  return k;
}

/* Shard s's rows from a pull's tensor (after its dense values) into the
 * caller's sections. PS_EPROTO for a row value that arrived as Inf or
 * NaN. */
static int read_rows(ps_client *c, int s, const ps_segview *tensor, char *err) {
  const struct row_set *rs = &c->rows.set[c->rows.cur];
  if (!rs->n_sec || !rs->shard[s].values) return PS_OK;
  const struct shard_rows *sr = &rs->shard[s];
  const size_t vb = ps_wire_value_bytes(c->wire);
  size_t skip = c->shards[s].cnt * vb, nv = sr->values;
  if (c->wire == PS_WIRE_FP32 && c->nshards == 1) {
    /* One shard holds every row, in the sections' order: each section's
     * values straight into place, then checked in one pass. */
    size_t at = skip;
    for (int i = 0; i < rs->n_sec; i++) {
      const size_t bytes = sr->n[i] * (size_t)c->rows.spec[rs->sec[i].table].dim * sizeof(float);
      ps_segview_copy(tensor, at, rs->sec[i].values, bytes);
      at += bytes;
    }
    for (int i = 0; i < rs->n_sec; i++) {
      const size_t d = (size_t)c->rows.spec[rs->sec[i].table].dim;
      if (ps_f32_max_bits(rs->sec[i].values, sr->n[i] * d) >= PS_F32_NONFINITE_BITS)
        for (size_t k = 0; k < sr->n[i] * d; k++)
          if (!isfinite(rs->sec[i].values[k]))
            return ps_seterr(err, PS_EPROTO,
                             "Pull from shard %d: table '%s' row %" PRIu64 " arrived with a %s",
                             s, c->rows.spec[rs->sec[i].table].name, rs->sec[i].ids[k / d],
                             isnan(rs->sec[i].values[k]) ? "NaN" : "Inf");
    }
    return PS_OK;
  }
  if (grow(&c->rows.tmp, &c->rows.tmp_cap, nv * (sizeof(float) + vb)) != PS_OK)
    return ps_seterr(err, PS_ENOMEM, "out of memory for %zu row values", nv);
  float *vals = c->rows.tmp;
  if (c->wire == PS_WIRE_FP32) {
    ps_segview_copy(tensor, skip, vals, nv * sizeof(float));
  } else {
    uint16_t *h = (uint16_t *)(vals + nv);
    ps_segview_copy(tensor, skip, h, nv * vb);
    ps_half_decode(c->wire, h, vals, nv);
  }
  if (ps_f32_max_bits(vals, nv) >= PS_F32_NONFINITE_BITS) {
    size_t at = 0;
    for (int i = 0; i < rs->n_sec; i++) {
      const size_t d = (size_t)c->rows.spec[rs->sec[i].table].dim;
      for (size_t k = 0; k < sr->n[i]; k++, at += d)
        for (size_t j = 0; j < d; j++)
          if (!isfinite(vals[at + j]))
            return ps_seterr(err, PS_EPROTO,
                             "Pull from shard %d: table '%s' row %" PRIu64 " arrived with a %s",
                             s, c->rows.spec[rs->sec[i].table].name,
                             ps_get_le64(sr->ids[i] + 8 * k), isnan(vals[at + j]) ? "NaN" : "Inf");
    }
  }
  size_t at = 0;
  for (int i = 0; i < rs->n_sec; i++) {
    const size_t d = (size_t)c->rows.spec[rs->sec[i].table].dim;
    for (size_t k = 0; k < sr->n[i]; k++, at += d)
      memcpy(rs->sec[i].values + sr->pos[i][k] * d, vals + at, d * sizeof(float));
  }
  return PS_OK;
}

/* Shard s's rows' gradients gathered from the caller's sections into the
 * buffer sent (encoded on a 16-bit wire, rounded without error feedback),
 * once per round. PS_EINVAL for a value that cannot go out. */
static int gather_rows(ps_client *c, struct row_set *rs, int s, char *err) {
  struct shard_rows *sr = &rs->shard[s];
  if (sr->gathered || !sr->values) return PS_OK;
  const size_t vb = ps_wire_value_bytes(c->wire), nv = sr->values;
  if (grow(&sr->grads, &sr->grads_cap, nv * (sizeof(float) + vb)) != PS_OK)
    return ps_seterr(err, PS_ENOMEM, "out of memory for %zu row gradients", nv);
  float *g = sr->grads;
  size_t at = 0;
  for (int i = 0; i < rs->n_sec; i++) {
    const size_t d = (size_t)c->rows.spec[rs->sec[i].table].dim;
    if (c->nshards == 1) { /* every row here, in the section's order */
      memcpy(g + at, rs->sec[i].grads, sr->n[i] * d * sizeof(float));
      at += sr->n[i] * d;
      continue;
    }
    for (size_t k = 0; k < sr->n[i]; k++, at += d)
      memcpy(g + at, rs->sec[i].grads + sr->pos[i][k] * d, d * sizeof(float));
  }
  if (ps_f32_max_bits(g, nv) >= PS_F32_NONFINITE_BITS)
    for (size_t j = 0; j < nv; j++)
      if (!isfinite(g[j]))
        return ps_seterr(err, PS_EINVAL,
                         "Push to shard %d: a row gradient value is %s; not pushed", s,
                         isnan(g[j]) ? "NaN" : "Inf");
  sr->sent = g;
  if (vb == 2) sr->sent = g + nv;
  if (vb == 2 && ps_half_encode(c->wire, g, sr->sent, nv) >= ps_half_nonfinite_bits(c->wire))
    return ps_seterr(err, PS_EINVAL,
                     "Push to shard %d: a row gradient value is beyond %s's range; not pushed", s,
                     ps_wire_name(c->wire));
  sr->gathered = 1;
  return PS_OK;
}

int ps_client_pull(ps_client *c, float *params, uint64_t *versions,
                   const uint64_t *min_versions, char *err) {
  return ps_client_pull_ex(c, params, versions, min_versions, NULL, NULL, err);
}

static int push_again(ps_client *c, int s, char *err);

/* Starts shard s's pull on the replica believed primary, which *rep
 * receives. NULL (with a message) when it cannot start. */
static rpc_request *pull_start(ps_client *c, int s, const uint64_t *min_versions, int *rep,
                               char *err) {
  Ps__RequestHeader h;
  uint8_t sess[PS_SESSION_LEN];
  fill_header(c, s, &h, sess);
  Ps__PullRequest req = PS__PULL_REQUEST__INIT;
  req.header = &h;
  req.offset = c->shards[s].off;
  req.count = c->shards[s].cnt;
  req.min_version = min_versions ? min_versions[s] : 0;
  req.push_round = c->push.answered[s];
  Ps__TableRows rm[PS_MAX_TABLES], *rp[PS_MAX_TABLES];
  req.n_rows = rows_msgs(&c->rows.set[c->rows.cur], s, rm, rp);
  req.rows = rp;
  rpc_msg msg;
  *rep = replica_of(c, s);
  if (pack_small(&req.base, &msg) != 0) return NULL;
  return rpc_start(c->q, c->shards[s].ch[*rep], M_PULL, &msg, c->opts.timeout_ms + c->wait_ms,
                   ready_wait(c, 1), err);
}

int ps_client_pull_ex(ps_client *c, float *params, uint64_t *versions,
                      const uint64_t *min_versions, ps_pull_ready_fn ready, void *user,
                      char *err) {
  int rc = PS_OK;
  char forgot[c->nshards];
  int rep[c->nshards]; /* the replica each shard's call went to */
  /* Each attempt after the first follows registering again with the
   * shards that had forgotten this worker; shards restarted one after the
   * other each take one. */
  const int attempts = c->nshards + 1;
  for (int attempt = 0; attempt < attempts; attempt++) {
    int any_forgot = 0;
    memset(forgot, 0, sizeof forgot);
    /* Starting over: said before anything of this attempt is written. */
    if (ready && attempt > 0) ready(user, attempt, -1, 0);
    for (int s = 0; s < c->nshards; s++) c->reqs[s] = pull_start(c, s, min_versions, &rep[s], err);
    rc = PS_OK;
    for (int s = 0; s < c->nshards; s++) {
      char detail[PS_ERRLEN] = "";
      ps_segview view;
      int st = RPC_OK;
      /* A shard whose primary failed or moved is asked again (in shard
       * order still, while the other shards' calls go on). */
      failover_clock fc = {0};
      int pushed_again = 0;
      while (c->reqs[s]) {
        detail[0] = 0;
        st = rpc_wait(c->reqs[s], detail, &view);
        /* The shard lost this worker's last round: it goes again (once
         * per pull: a second loss is a shard restarting over and over). */
        if (st == RPC_DATA_LOSS && min_versions && !pushed_again) {
          rpc_request_free(c->reqs[s]);
          c->reqs[s] = NULL;
          pushed_again = 1;
          char perr[PS_ERRLEN];
          int prc = push_again(c, s, perr);
          if (prc != PS_OK) {
            if (rc == PS_OK) rc = ps_seterr(err, prc, "Pull from shard %d: %s", s, perr);
            break;
          }
          c->reqs[s] = pull_start(c, s, min_versions, &rep[s], err);
          continue;
        }
        if (!failover(c, s, rep[s], st, detail, &fc, c->opts.failover_ms)) break;
        rpc_request_free(c->reqs[s]);
        c->reqs[s] = pull_start(c, s, min_versions, &rep[s], err);
      }
      if (!c->reqs[s]) {
        if (rc == PS_OK) rc = ps_seterr(err, PS_EUNAVAIL, "cannot start Pull on shard %d", s);
        continue;
      }
      if (st != RPC_OK) {
        if (must_register(st)) forgot[s] = any_forgot = 1;
        if (rc == PS_OK)
          rc = ps_seterr(err, status_code(st), "Pull from shard %d (%s): %s: %s", s,
                         c->shards[s].addr[rep[s]], rpc_status_name(st), detail);
        rpc_request_free(c->reqs[s]);
        continue;
      }
      answered(c, s, rep[s]);
      /* A large reply arrives in many slices; the tensor view needs one
       * entry per slice at most. */
      int max_tsegs = view.nsegs > 0 ? view.nsegs : 1;
      ps_seg *tsegs = malloc((size_t)max_tsegs * sizeof(ps_seg));
      ps_segview tensor;
      char derr[PS_ERRLEN] = "out of memory";
      ProtobufCMessage *m = tsegs ? wire_decode(&ps__pull_response__descriptor, &view, tsegs,
                                                max_tsegs, &tensor, derr)
                                  : NULL;
      if (!m) {
        if (rc == PS_OK)
          rc = ps_seterr(err, PS_EPROTO, "Pull from shard %d: malformed reply: %s", s, derr);
      } else {
        Ps__PullResponse *r = (Ps__PullResponse *)m;
        int bad = PS_OK;
        const struct row_set *rs = &c->rows.set[c->rows.cur];
        size_t row_values = rs->n_sec ? rs->shard[s].values : 0;
        if (r->offset != c->shards[s].off || r->count != c->shards[s].cnt ||
            (int)r->encoding != (int)c->wire ||
            tensor.total != (c->shards[s].cnt + row_values) * ps_wire_value_bytes(c->wire)) {
          bad = ps_seterr(derr, PS_EPROTO,
                          "Pull from shard %d: reply holds [%" PRIu64 ", +%" PRIu64
                          ") as %s in %zu bytes, asked for [%zu, +%zu) as %s",
                          s, r->offset, r->count, ps_wire_name((int)r->encoding), tensor.total,
                          c->shards[s].off, c->shards[s].cnt, ps_wire_name(c->wire));
        } else {
          bad = read_values(c, s, &tensor, params + c->shards[s].off, derr);
          if (bad == PS_OK) bad = read_rows(c, s, &tensor, derr);
        }
        if (bad != PS_OK) {
          if (rc == PS_OK) rc = ps_seterr(err, bad, "%s", derr);
        } else {
          versions[s] = r->version;
          /* In shard order, so [0, off + cnt) has arrived, unless an
           * earlier shard failed (then nothing more is said this attempt). */
          if (ready && rc == PS_OK) ready(user, attempt, s, c->shards[s].off + c->shards[s].cnt);
        }
        protobuf_c_message_free_unpacked(m, NULL);
      }
      free(tsegs);
      rpc_request_free(c->reqs[s]);
    }
    if (rc == PS_OK || !any_forgot) break;
    /* Every shard that had forgotten this worker (a long pause makes them
     * all forget it): register again, then pull once more. */
    int rr = PS_OK;
    for (int s = 0; s < c->nshards && rr == PS_OK; s++)
      if (forgot[s]) rr = reregister(c, c->q, s, err);
    if (rr != PS_OK) {
      rc = rr;
      break;
    }
    /* Still forgotten after every attempt: shards that keep restarting,
     * as unavailable ones (the caller's retries go on). */
    if (attempt == attempts - 1) rc = PS_EUNAVAIL;
  }
  return rc;
}

static void tensor_released(void *user) {
  ps_client *c = user;
  atomic_fetch_sub(&c->tensors_in_flight, 1);
}

int ps_client_push_begin(ps_client *c, const uint64_t *versions, uint64_t step, int batch_size,
                         uint64_t lease_id) {
  for (int s = 0; s < c->nshards; s++)
    if (c->push.state[s] == PUSH_IN_FLIGHT) return PS_EINVAL; /* the last round is not over */
  memcpy(c->push.versions, versions, (size_t)c->nshards * sizeof *versions);
  memset(c->push.state, PUSH_PENDING, (size_t)c->nshards);
  memset(c->push.encoded, 0, (size_t)c->nshards);
  c->push.rows_set = c->rows.cur;
  for (int s = 0; s < c->nshards && c->rows.set[c->rows.cur].shard; s++)
    c->rows.set[c->rows.cur].shard[s].gathered = 0;
  memset(&c->push.res, 0, sizeof c->push.res);
  c->push.step = step;
  c->push.batch_size = batch_size;
  c->push.lease_id = lease_id;
  c->push.request_id++;
  return PS_OK;
}

/* Shard s's slice of grads as it goes out: the floats themselves, or (16-bit
 * wire) their encoding with error feedback, made at the round's first
 * attempt and sent again as it is by a retry, so that the residual takes
 * each gradient once. A value that would go out as Inf or NaN (one of
 * grads, or beyond fp16's range) is not pushed: PS_EINVAL with a message. */
static int slice_for(ps_client *c, int s, const float *grads, const void **tensor, size_t *bytes,
                     char *err) {
  size_t off = c->shards[s].off, cnt = c->shards[s].cnt;
  if (c->wire == PS_WIRE_FP32) {
    *tensor = grads + off;
    *bytes = cnt * sizeof(float);
    return PS_OK;
  }
  uint16_t *enc = c->wire_grads + off;
  if (!c->push.encoded[s]) {
    c->push.encoded[s] = ps_half_encode_feedback(c->wire, grads + off, c->residual + off, enc,
                                                 cnt) >= ps_half_nonfinite_bits(c->wire)
                             ? ENC_NONFINITE
                             : ENC_FINITE;
    /* Statistics keep no residual: with it zero before every encoding,
     * theirs is the plain rounding of the value. */
    for (int r = 0; r < c->n_moving; r++) {
      size_t lo = c->moving[r].off, hi = lo + c->moving[r].count;
      if (lo < off) lo = off;
      if (hi > off + cnt) hi = off + cnt;
      if (lo < hi) memset(c->residual + lo, 0, (hi - lo) * sizeof *c->residual);
    }
  }
  if (c->push.encoded[s] == ENC_NONFINITE) {
    size_t i = ps_half_first_nonfinite(c->wire, enc, cnt);
    return ps_seterr(err, PS_EINVAL,
                     "Push to shard %d: gradient value %zu (global index) is %g, which %s cannot "
                     "carry (%s); not pushed",
                     s, off + i, (double)grads[off + i], ps_wire_name(c->wire),
                     isfinite(grads[off + i]) ? "beyond its range" : "not finite");
  }
  *tensor = enc;
  *bytes = cnt * sizeof *enc;
  return PS_OK;
}

int ps_client_push_shard(ps_client *c, int s, const float *grads, char *err) {
  if (s < 0 || s >= c->nshards)
    return ps_seterr(err, PS_EINVAL, "no shard %d (%d shards)", s, c->nshards);
  if (c->push.state[s] != PUSH_PENDING) return PS_OK;
  c->push.grads = grads;
  const void *tensor = NULL;
  size_t bytes = 0;
  int rc = slice_for(c, s, grads, &tensor, &bytes, err);
  struct row_set *rs = &c->rows.set[c->push.rows_set];
  if (rc == PS_OK && rs->n_sec) rc = gather_rows(c, rs, s, err);
  if (rc != PS_OK) return rc;
  Ps__RequestHeader h;
  uint8_t sess[PS_SESSION_LEN];
  fill_header(c, s, &h, sess);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.base_version = c->push.versions[s];
  req.offset = c->shards[s].off;
  req.count = c->shards[s].cnt;
  req.step = c->push.step;
  req.request_id = c->push.request_id;
  req.batch_size = (uint32_t)c->push.batch_size;
  req.lease_id = c->push.lease_id;
  Ps__TableRows rm[PS_MAX_TABLES], *rp[PS_MAX_TABLES];
  req.n_rows = rows_msgs(rs, s, rm, rp);
  req.rows = rp;
  rpc_msg msg;
  rpc_request *r = NULL;
  /* The gradient goes out without a copy; tensor_released counts it
   * back, and the caller's buffer (or wire_grads, or the rows' buffer) is
   * not reused before that. */
  int rep = replica_of(c, s);
  int encoded;
  if (req.n_rows) {
    atomic_fetch_add(&c->tensors_in_flight, 2);
    wire_part parts[2] = {
        {tensor, bytes, tensor_released, c},
        {rs->shard[s].sent, rs->shard[s].values * ps_wire_value_bytes(c->wire),
         tensor_released, c}};
    encoded = wire_encode_parts(&req.base, parts, 2, &msg) == 0; /* releases both on failure */
  } else {
    atomic_fetch_add(&c->tensors_in_flight, 1);
    encoded = wire_encode(&req.base, tensor, bytes, tensor_released, c, &msg) == 0;
    if (!encoded) atomic_fetch_sub(&c->tensors_in_flight, 1);
  }
  if (encoded)
    r = rpc_start(c->q, c->shards[s].ch[rep], M_PUSH, &msg, c->opts.timeout_ms, ready_wait(c, 1),
                  err);
  if (!r) return ps_seterr(err, PS_EUNAVAIL, "cannot start Push on shard %d", s);
  c->push.reqs[s] = r;
  c->push.rep[s] = rep;
  c->push.state[s] = PUSH_IN_FLIGHT;
  return PS_OK;
}

/* Waits for every push in flight. A shard that answered NOT_FOUND (it
 * applied nothing) goes back to pending and *again is set; other failures
 * go back to pending too and the first one is returned. A replicated
 * shard whose primary failed or moved is pushed again, the same request
 * (its id and bytes: grads, or the round's encoding) to the replica now
 * believed primary, which applies it at most once. */
static int push_wait_all(ps_client *c, const float *grads, int *again, char *err) {
  int rc = PS_OK;
  *again = 0;
  for (int s = 0; s < c->nshards; s++) {
    if (c->push.state[s] != PUSH_IN_FLIGHT) continue;
    char detail[PS_ERRLEN] = "";
    ps_segview view;
    failover_clock fc = {0};
    int st, restarted = PS_OK;
    for (;;) {
      detail[0] = 0;
      st = rpc_wait(c->push.reqs[s], detail, &view);
      c->push.state[s] = PUSH_PENDING;
      if (!failover(c, s, c->push.rep[s], st, detail, &fc, c->opts.failover_ms)) break;
      rpc_request_free(c->push.reqs[s]);
      c->push.reqs[s] = NULL;
      restarted = ps_client_push_shard(c, s, grads, detail);
      if (restarted != PS_OK) break;
    }
    if (restarted != PS_OK) { /* pending, not in flight */
      if (rc == PS_OK) rc = ps_seterr(err, restarted, "%s", detail);
      continue;
    }
    if (st == RPC_OK) {
      answered(c, s, c->push.rep[s]);
      c->push.state[s] = PUSH_DONE;
      c->push.answered[s] = c->push.request_id;
      if (s == 0 && c->push.lease_id && c->push.batch_size > 0) {
        /* Shard 0 counted the round on its lease: what a registration
         * again names as trained of it (a round it has not answered is
         * sent again, and counted then). */
        pthread_mutex_lock(&c->done_mu);
        for (int i = 0; i < c->n_grants; i++)
          if (c->grants[i].id == c->push.lease_id)
            c->grants[i].trained += (uint32_t)c->push.batch_size;
        pthread_mutex_unlock(&c->done_mu);
      }
      uint8_t small[256];
      if (view.total <= sizeof small && ps_segview_copy(&view, 0, small, view.total) == 0) {
        Ps__PushResponse *r = ps__push_response__unpack(NULL, view.total, small);
        if (r) {
          c->push.res.staleness_sum += r->staleness;
          if (r->staleness > c->push.res.staleness_max) c->push.res.staleness_max = r->staleness;
          c->push.res.dropped += r->dropped;
          ps__push_response__free_unpacked(r, NULL);
        }
      }
    } else if (must_register(st)) {
      *again = 1;
    } else if (rc == PS_OK) {
      rc = ps_seterr(err, status_code(st), "Push to shard %d (%s): %s: %s", s,
                     c->shards[s].addr[c->push.rep[s]], rpc_status_name(st), detail);
    }
    rpc_request_free(c->push.reqs[s]);
    c->push.reqs[s] = NULL;
  }
  /* Wait (bounded) until gRPC has let go of every gradient buffer.
   * Usually at once; gRPC may drop its reference a moment after the call
   * completes, so poll finely, for at most 10 s. */
  for (int i = 0; i < 200000 && atomic_load(&c->tensors_in_flight) > 0; i++) {
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
  if (atomic_load(&c->tensors_in_flight) > 0)
    PS_WARN("gRPC still holds %d gradient buffers after the push completed",
            atomic_load(&c->tensors_in_flight));
  return rc;
}

/* Starts every pending shard; stops at the first that cannot start. */
static int push_start_pending(ps_client *c, const float *grads, char *err) {
  for (int s = 0; s < c->nshards; s++) {
    if (c->push.state[s] != PUSH_PENDING) continue;
    int rc = ps_client_push_shard(c, s, grads, err);
    if (rc != PS_OK) return rc;
  }
  return PS_OK;
}

/* Starts every pending shard and waits for every call in flight (also
 * after a failed start: nothing is left out); the first error is returned.
 * *again as for push_wait_all. */
static int push_round(ps_client *c, const float *grads, int *again, char *err) {
  int rc = push_start_pending(c, grads, err);
  char werr[PS_ERRLEN] = "";
  int wrc = push_wait_all(c, grads, again, werr);
  if (rc == PS_OK && wrc != PS_OK) {
    rc = wrc;
    snprintf(err, PS_ERRLEN, "%s", werr);
  }
  return rc;
}

/* push_end's work: every pending shard pushed and waited for, a shard that
 * had forgotten this worker registered with again and pushed once more. */
static int push_finish(ps_client *c, const float *grads, char *err) {
  int again = 0;
  int rc = push_round(c, grads, &again, err);
  /* A shard that had forgotten this worker applied nothing from it:
   * register again and push that shard's slice once more. */
  /* Shards restarted one after the other each take a round. */
  for (int round = 0; rc == PS_OK && again && round < c->nshards; round++) {
    for (int s = 0; s < c->nshards; s++) {
      if (c->push.state[s] != PUSH_PENDING) continue;
      int r = reregister(c, c->q, s, err);
      if (r != 0) return r;
    }
    rc = push_round(c, grads, &again, err);
  }
  for (int s = 0; s < c->nshards && rc == PS_OK; s++)
    if (again && c->push.state[s] == PUSH_PENDING)
      rc = ps_seterr(err, PS_EUNAVAIL,
                     "shard %d forgot this worker again after it registered again", s);
  return rc;
}

int ps_client_push_end(ps_client *c, const float *grads, ps_push_result *res, char *err) {
  int rc = push_finish(c, grads, err);
  if (res) *res = c->push.res;
  return rc;
}

/* Shard s answered a pull with DATA_LOSS: it has not taken the last round
 * it answered (it restarted from a checkpoint written before it). The
 * round goes to it again, the same request (its id and bytes: the
 * caller's gradient, the round's encoding, its rows as gathered). */
static int push_again(ps_client *c, int s, char *err) {
  if (!c->push.grads || c->push.answered[s] != c->push.request_id)
    return ps_seterr(err, PS_EPROTO,
                     "shard %d asks for push round %" PRIu64 " again, which is not the last "
                     "round (%" PRIu64 ")",
                     s, c->push.answered[s], c->push.request_id);
  PS_WARN("shard %d (%s) lacks push round %" PRIu64 " (it restarted from a checkpoint written "
          "before it): pushed again",
          s, c->shards[s].addr[replica_of(c, s)], c->push.request_id);
  c->push.state[s] = PUSH_PENDING;
  /* Shard 0 answered the round before: its examples are named as trained
   * of the lease already (registering again), and are not counted twice. */
  if (s == 0) c->push.lease_id = 0;
  return push_finish(c, c->push.grads, err);
}

int ps_client_push_pending(const ps_client *c) {
  int n = 0;
  for (int s = 0; s < c->nshards; s++) n += c->push.state[s] != PUSH_DONE;
  return n;
}

int ps_client_push(ps_client *c, const float *grads, const uint64_t *versions, uint64_t step,
                   int batch_size, ps_push_result *res, char *err) {
  int rc = ps_client_push_begin(c, versions, step, batch_size, 0);
  if (rc != PS_OK) return ps_seterr(err, rc, "a push is still in flight");
  return ps_client_push_end(c, grads, res, err);
}

void ps_client_shard_range(const ps_client *c, int s, size_t *off, size_t *cnt) {
  *off = c->shards[s].off;
  *cnt = c->shards[s].cnt;
}

int ps_client_heartbeat(ps_client *c, uint64_t step, const ps_client_hb_state *state, char *err) {
  int rc = PS_OK;
  /* A replicated shard's replicas are tried for half a heartbeat timeout
   * at most, so that the shards after it still hear from this worker in
   * time. */
  int window_ms = c->hb_timeout_ms / 2 < c->opts.failover_ms ? c->hb_timeout_ms / 2
                                                              : c->opts.failover_ms;
  for (int s = 0; s < c->nshards; s++) {
    Ps__RequestHeader h;
    uint8_t sess[PS_SESSION_LEN];
    fill_header(c, s, &h, sess);
    Ps__HeartbeatRequest req = PS__HEARTBEAT_REQUEST__INIT;
    req.header = &h;
    req.step = step;
    if (state) {
      req.idle = state->idle != 0;
      if (s == 0 && state->names_leases) { /* leases live on shard 0 */
        req.names_leases = 1;
        req.n_leases = (size_t)state->n_leases;
        req.leases = (uint64_t *)state->leases;
      }
    }
    ProtobufCMessage *m = NULL;
    char detail[PS_ERRLEN] = "";
    failover_clock fc = {0};
    int rep, st;
    do {
      rep = replica_of(c, s);
      detail[0] = 0;
      st = small_call(c->hb_q, c->shards[s].ch[rep], M_HEARTBEAT, &req.base,
                      &ps__heartbeat_response__descriptor, &m, c->hb_timeout_ms / 2 + 1, 0,
                      detail);
    } while (failover(c, s, rep, st, detail, &fc, window_ms));
    if (st == RPC_OK) answered(c, s, rep);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    if (must_register(st)) {
      if (reregister(c, c->hb_q, s, err) != 0 && rc == PS_OK) rc = PS_ENOTFOUND;
    } else if (st != RPC_OK && rc == PS_OK) {
      rc = ps_seterr(err, PS_EUNAVAIL, "Heartbeat to shard %d (%s): %s: %s", s,
                     c->shards[s].addr[rep], rpc_status_name(st), detail);
    }
  }
  return rc;
}

/* Lease id of a grant: its epoch, chunk and examples, for when its
 * completion is answered, and for a Register after a restart of shard 0. A
 * grant of another epoch keeps the completions of the epoch before it and
 * of later ones (a shard 0 restored to a checkpoint of an earlier epoch
 * takes the next epoch's as done when it gets there) and drops older
 * ones. Under lease_mu. */
static void lease_granted(ps_client *c, uint64_t id, uint32_t epoch, uint32_t chunk,
                          uint32_t count) {
  pthread_mutex_lock(&c->done_mu);
  if (c->done_epoch != (int64_t)epoch) {
    /* In order, oldest first, from the ring's start (the ring is read
     * whole before it is written: it may wrap). */
    size_t kept = 0;
    uint64_t *keep = c->done_n ? malloc(c->done_n * sizeof *keep) : NULL;
    for (size_t i = 0; keep && i < c->done_n; i++) {
      uint64_t d = c->done[(c->done_head + i) % DONE_KEPT];
      if ((d >> 32) + 1 >= epoch) keep[kept++] = d; /* a later epoch's too: back after a restore */
    }
    if (kept) memcpy(c->done, keep, kept * sizeof *keep);
    free(keep); /* out of memory: none kept (they are a record's, not training's) */
    c->done_head = 0;
    c->done_n = kept;
    c->done_epoch = epoch;
    int r = 0; /* refusals: those of this epoch and the one before */
    for (int i = 0; i < c->n_refused; i++)
      if ((int64_t)c->refused[i].epoch + 1 >= (int64_t)epoch) c->refused[r++] = c->refused[i];
    c->n_refused = r;
  }
  int known = 0;
  for (int i = 0; i < c->n_grants && !known; i++) known = c->grants[i].id == id; /* a retry */
  if (!known) {
    if (c->n_grants == GRANTS_KEPT) {
      memmove(&c->grants[0], &c->grants[1], (GRANTS_KEPT - 1) * sizeof c->grants[0]);
      c->n_grants--;
    }
    c->grants[c->n_grants].id = id;
    c->grants[c->n_grants].epoch = epoch;
    c->grants[c->n_grants].chunk = chunk;
    c->grants[c->n_grants].count = count;
    c->grants[c->n_grants].trained = 0;
    c->grants[c->n_grants].finishing = 0;
    c->n_grants++;
  }
  pthread_mutex_unlock(&c->done_mu);
}

/* The completion of lease id is being sent: its examples, all trained
 * (0 for a lease this client was not granted). Under lease_mu. */
static uint32_t lease_finishing(ps_client *c, uint64_t id) {
  uint32_t count = 0;
  pthread_mutex_lock(&c->done_mu);
  for (int i = 0; i < c->n_grants; i++)
    if (c->grants[i].id == id) {
      c->grants[i].finishing = 1;
      count = c->grants[i].count;
    }
  pthread_mutex_unlock(&c->done_mu);
  return count;
}

/* Shard 0 answered the completion of lease id: a counted one is kept (of
 * the current epoch), and the lease is forgotten. Under lease_mu. */
static void lease_completed(ps_client *c, uint64_t id, int counted) {
  pthread_mutex_lock(&c->done_mu);
  for (int i = 0; i < c->n_grants; i++) {
    if (c->grants[i].id != id) continue;
    uint32_t epoch = c->grants[i].epoch, chunk = c->grants[i].chunk;
    uint32_t trained = c->grants[i].count;
    memmove(&c->grants[i], &c->grants[i + 1], (size_t)(c->n_grants - i - 1) * sizeof c->grants[0]);
    c->n_grants--;
    if (!counted) {
      if (c->n_refused == REFUSED_KEPT) { /* the oldest goes */
        memmove(&c->refused[0], &c->refused[1], (REFUSED_KEPT - 1) * sizeof c->refused[0]);
        c->n_refused--;
      }
      c->refused[c->n_refused].id = id;
      c->refused[c->n_refused].epoch = epoch;
      c->refused[c->n_refused].chunk = chunk;
      c->refused[c->n_refused].trained = trained;
      c->n_refused++;
      break;
    }
    if (!c->done) c->done = malloc(DONE_KEPT * sizeof *c->done);
    if (c->done && (int64_t)epoch + 1 >= c->done_epoch && (int64_t)epoch <= c->done_epoch) {
      if (c->done_n == DONE_KEPT) { /* the oldest goes */
        c->done_head = (c->done_head + 1) % DONE_KEPT;
        c->done_n--;
      }
      c->done[(c->done_head + c->done_n) % DONE_KEPT] = (uint64_t)epoch << 32 | chunk;
      c->done_n++;
    }
    break;
  }
  pthread_mutex_unlock(&c->done_mu);
}

int ps_client_lease_call(ps_client *c, uint64_t complete_id, int want_next,
                         uint64_t dataset_size, ps_client_lease *out, char *err) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&c->lease_mu);
  int rc = PS_OK;
  /* resend: the call goes again, with its id, to the replica of shard 0
   * now believed primary (replicated shards), which answers a request it
   * has seen with its recorded answer. */
  int resend = 0;
  failover_clock fc = {0};
  for (int attempt = 0; attempt < 2;) {
    Ps__RequestHeader h;
    uint8_t sess[PS_SESSION_LEN];
    fill_header(c, 0, &h, sess);
    Ps__LeaseRequest req = PS__LEASE_REQUEST__INIT;
    req.header = &h;
    req.complete_lease = complete_id;
    if (complete_id) req.trained_examples = lease_finishing(c, complete_id);
    req.want_next = want_next != 0;
    req.dataset_size = dataset_size;
    /* The same request again after no answer (a retry of what the shard
     * may have granted already), else a new one. */
    int same = c->lease_args[0] == complete_id && c->lease_args[1] == (uint64_t)(want_next != 0);
    if (!resend && (!c->lease_unanswered || !same || attempt > 0)) c->lease_request++;
    c->lease_args[0] = complete_id;
    c->lease_args[1] = want_next != 0;
    req.request_id = c->lease_request;
    ProtobufCMessage *m = NULL;
    char detail[PS_ERRLEN] = "";
    int rep = replica_of(c, 0);
    int st = small_call(c->lease_q, c->shards[0].ch[rep], M_LEASE, &req.base,
                        &ps__lease_response__descriptor, &m, c->opts.timeout_ms,
                        ready_wait(c, 1), detail);
    /* No answer: shard 0 may have granted it; the next call asks again. */
    c->lease_unanswered = st == RPC_DEADLINE_EXCEEDED || st == RPC_UNAVAILABLE;
    if (st == RPC_OK) {
      answered(c, 0, rep);
      Ps__LeaseResponse *r = (Ps__LeaseResponse *)m;
      out->status = (int)r->status;
      out->lease_id = r->lease_id;
      out->epoch = (int)r->epoch;
      out->chunk = r->chunk;
      out->begin = r->begin;
      out->count = r->count;
      out->completed_counted = r->completed_counted;
      if (complete_id) lease_completed(c, complete_id, r->completed_counted);
      if (r->status == 0 && r->lease_id)
        lease_granted(c, r->lease_id, r->epoch, r->chunk, r->count);
      protobuf_c_message_free_unpacked(m, NULL);
      rc = PS_OK;
      break;
    }
    rc = ps_seterr(err, status_code(st), "Lease from shard 0 (%s): %s: %s", c->shards[0].addr[rep],
                   rpc_status_name(st), detail);
    resend = failover(c, 0, rep, st, detail, &fc, c->opts.failover_ms);
    if (resend) continue;
    if (!must_register(st) || attempt == 1 || reregister(c, c->lease_q, 0, err) != 0) break;
    attempt++;
  }
  pthread_mutex_unlock(&c->lease_mu);
  return rc;
}

void ps_client_leave(ps_client *c) {
  for (int s = 0; s < c->nshards; s++) {
    Ps__RequestHeader h;
    uint8_t sess[PS_SESSION_LEN];
    fill_header(c, s, &h, sess);
    Ps__LeaveRequest req = PS__LEAVE_REQUEST__INIT;
    req.header = &h;
    ProtobufCMessage *m = NULL;
    char detail[PS_ERRLEN] = "";
    /* Best effort: a replicated shard's replicas are tried for at most
     * one call's deadline. */
    failover_clock fc = {0};
    int rep, st;
    do {
      rep = replica_of(c, s);
      detail[0] = 0;
      st = small_call(c->q, c->shards[s].ch[rep], M_LEAVE, &req.base,
                      &ps__leave_response__descriptor, &m, 2000, 0, detail);
    } while (failover(c, s, rep, st, detail, &fc, 2000));
    if (m) protobuf_c_message_free_unpacked(m, NULL);
  }
}

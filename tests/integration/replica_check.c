/* Replication messages a backup must refuse, on a live replicated shard
 * (no workers, so its position holds still): each is refused with the
 * right code or result, and the backup's position and state (the CRC its
 * Status reports) are the same after; a well-formed next update then does
 * move its position, so the comparison can fail.
 *
 *   replica_check BACKUP_HOST:PORT
 * The job's token comes from PS_TOKEN_FILE. The backup's term must be 2 or
 * more (the caller killed a primary once), so that a stale term exists. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/auth.h"
#include "../../common/rpc.h"
#include "../../common/util.h"
#include "../../common/wire.h"
#include "../unit/check.h"
#include "proto/ps.pb-c.h"
#include "raw_client.h"

static raw_client C = {.timeout_ms = 10000};
static ps_token token;

typedef struct {
  uint32_t shard, replica, primary, members[8];
  size_t n_members;
  uint64_t term, seq, seq_term;
  uint32_t crc;
  uint64_t version;
} view;

static void get_view(view *v) {
  Ps__RequestHeader h;
  raw_header(&C, &h, &token, NULL);
  Ps__StatusRequest r = PS__STATUS_REQUEST__INIT;
  r.header = &h;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(&C, NULL, RAW_METHOD("Status"), &r.base, NULL, 0, detail, &resp, &len);
  if (st != RPC_OK) {
    fprintf(stderr, "replica_check: Status: %s: %s\n", rpc_status_name(st), detail);
    exit(1);
  }
  Ps__StatusResponse *s = ps__status_response__unpack(NULL, len, resp);
  free(resp);
  if (!s || !s->replica_role || !*s->replica_role) {
    fprintf(stderr, "replica_check: the server is not a replica\n");
    exit(1);
  }
  memset(v, 0, sizeof *v);
  v->shard = s->shard_index;
  v->replica = s->replica;
  v->primary = (uint32_t)s->replica_primary;
  v->n_members = s->n_replica_members < 8 ? s->n_replica_members : 8;
  for (size_t i = 0; i < v->n_members; i++) v->members[i] = s->replica_members[i];
  v->term = s->replica_term;
  v->seq = s->replica_seq;
  v->seq_term = s->replica_seq_term;
  v->crc = s->state_crc;
  v->version = s->version;
  snprintf(C.job_id, sizeof C.job_id, "%s", s->job_id ? s->job_id : "");
  ps__status_response__free_unpacked(s, NULL);
}

/* A Replicate as the primary of term would send it, to be spoiled by the
 * caller; sent with token t. Returns the status; *result the answer's. */
static int replicate(const view *v, const ps_token *t, const char *job, uint32_t shard,
                     uint32_t from, uint64_t term, uint64_t prev_term, uint64_t prev_seq,
                     Ps__ReplicaEntry **entries, size_t n_entries, Ps__ReplicaSnapshot *snap,
                     int *result, char *detail) {
  Ps__RequestHeader h;
  raw_header(&C, &h, t, NULL);
  h.job_id = (char *)job;
  Ps__ReplicaConfig cfg = PS__REPLICA_CONFIG__INIT;
  cfg.term = term;
  cfg.primary = from;
  uint32_t members[8];
  memcpy(members, v->members, sizeof members);
  cfg.n_members = v->n_members;
  cfg.members = members;
  Ps__ReplicaPosition prev = PS__REPLICA_POSITION__INIT;
  prev.term = prev_term;
  prev.seq = prev_seq;
  Ps__ReplicateRequest r = PS__REPLICATE_REQUEST__INIT;
  r.header = &h;
  r.shard = shard;
  r.from_replica = from;
  r.config = &cfg;
  r.prev = &prev;
  r.n_entries = n_entries;
  r.entries = entries;
  r.snapshot = snap;
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(&C, NULL, RAW_METHOD("Replicate"), &r.base, NULL, 0, detail, &resp, &len);
  *result = -1;
  if (st == RPC_OK) {
    Ps__ReplicateResponse *a = ps__replicate_response__unpack(NULL, len, resp);
    if (a) {
      *result = (int)a->result;
      ps__replicate_response__free_unpacked(a, NULL);
    }
  }
  free(resp);
  return st;
}

static int vote(const ps_token *t, uint32_t shard, uint64_t term, int phase, uint64_t cfg_term,
                char *detail) {
  Ps__RequestHeader h;
  raw_header(&C, &h, t, NULL);
  Ps__ReplicaConfig cfg = PS__REPLICA_CONFIG__INIT;
  uint32_t members[1] = {0};
  cfg.term = cfg_term;
  cfg.n_members = 1;
  cfg.members = members;
  Ps__VoteRequest r = PS__VOTE_REQUEST__INIT;
  r.header = &h;
  r.shard = shard;
  r.term = term;
  r.phase = (Ps__VoteRequest__Phase)phase;
  r.config = &cfg;
  return raw_call_on(&C, NULL, RAW_METHOD("Vote"), &r.base, NULL, 0, detail, NULL, NULL);
}

static void same_state(const view *before, const char *what) {
  view now;
  get_view(&now);
  CHECK_MSG(now.seq == before->seq && now.seq_term == before->seq_term &&
                now.crc == before->crc && now.version == before->version,
            "%s changed the backup: position %" PRIu64 "/%" PRIu64 " -> %" PRIu64 "/%" PRIu64
            ", state %08x -> %08x",
            what, before->seq_term, before->seq, now.seq_term, now.seq, before->crc, now.crc);
  printf("replica_check: %s: refused, position and state unchanged\n", what);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: replica_check BACKUP_HOST:PORT\n");
    return 2;
  }
  char detail[PS_ERRLEN], warn[PS_ERRLEN];
  const char *tf = getenv("PS_TOKEN_FILE");
  if (!tf || ps_token_load(tf, &token, warn, detail) != 0) {
    fprintf(stderr, "replica_check: PS_TOKEN_FILE: %s\n", tf ? detail : "not set");
    return 2;
  }
  rpc_global_init();
  char err[PS_ERRLEN];
  C.ch = rpc_channel_create(argv[1], NULL, err);
  C.q = rpc_queue_create();
  if (!C.ch || !C.q) return 1;
  view v;
  get_view(&v);
  printf("replica_check: shard %u replica %u, term %" PRIu64 ", primary %u, at %" PRIu64
         "/%" PRIu64 "\n",
         v.shard, v.replica, v.term, v.primary, v.seq_term, v.seq);
  CHECK_MSG(v.replica != v.primary, "the server named is the primary, not a backup");
  CHECK_MSG(v.term >= 2, "term %" PRIu64 ": no stale term to send", v.term);
  const uint32_t from = v.primary;
  int res;
  ps_token wrong = token;
  wrong.bytes[0] ^= 1;

  /* Strangers: no token, a wrong one, another job. */
  int st = replicate(&v, NULL, C.job_id, v.shard, from, v.term, v.seq_term, v.seq, NULL, 0, NULL,
                     &res, detail);
  CHECK_MSG(st == RPC_UNAUTHENTICATED, "no token: %s: %s", rpc_status_name(st), detail);
  same_state(&v, "a Replicate without the job's token");
  st = replicate(&v, &wrong, C.job_id, v.shard, from, v.term, v.seq_term, v.seq, NULL, 0, NULL,
                 &res, detail);
  CHECK_MSG(st == RPC_UNAUTHENTICATED, "wrong token: %s: %s", rpc_status_name(st), detail);
  same_state(&v, "a Replicate with a wrong token");
  st = replicate(&v, &token, "another-job", v.shard, from, v.term, v.seq_term, v.seq, NULL, 0,
                 NULL, &res, detail);
  CHECK_MSG(st == RPC_FAILED_PRECONDITION, "another job: %s: %s", rpc_status_name(st), detail);
  same_state(&v, "a Replicate of another job");

  /* Malformed: another shard, from itself, a term 0. */
  st = replicate(&v, &token, C.job_id, v.shard + 1, from, v.term, v.seq_term, v.seq, NULL, 0,
                 NULL, &res, detail);
  CHECK_MSG(st == RPC_INVALID_ARGUMENT, "another shard: %s: %s", rpc_status_name(st), detail);
  same_state(&v, "a Replicate for another shard");
  st = replicate(&v, &token, C.job_id, v.shard, v.replica, v.term, v.seq_term, v.seq, NULL, 0,
                 NULL, &res, detail);
  CHECK_MSG(st == RPC_INVALID_ARGUMENT, "from itself: %s: %s", rpc_status_name(st), detail);
  same_state(&v, "a Replicate claiming to come from the backup itself");

  /* A stale term, with a next update that would otherwise fit. */
  Ps__ReplicaEntry e = PS__REPLICA_ENTRY__INIT;
  e.kind = PS__REPLICA_ENTRY__KIND__IDLE;
  e.worker_id = 12345;
  e.idle = 1;
  e.seq = v.seq + 1;
  e.term = v.term - 1;
  Ps__ReplicaEntry *ep = &e;
  st = replicate(&v, &token, C.job_id, v.shard, from, v.term - 1, v.seq_term, v.seq, &ep, 1,
                 NULL, &res, detail);
  CHECK_MSG(st == RPC_OK && res == PS__REPLICATE_RESPONSE__RESULT__STALE_TERM,
            "stale term: %s (result %d): %s", rpc_status_name(st), res, detail);
  same_state(&v, "an update of a stale term");

  /* A gap: the position before fits, the update's number does not. */
  e.term = v.term;
  e.seq = v.seq + 2;
  st = replicate(&v, &token, C.job_id, v.shard, from, v.term, v.seq_term, v.seq, &ep, 1, NULL,
                 &res, detail);
  CHECK_MSG(st == RPC_OK && res == PS__REPLICATE_RESPONSE__RESULT__MISMATCH,
            "gap: %s (result %d): %s", rpc_status_name(st), res, detail);
  same_state(&v, "an update after a gap in the sequence");
  /* A position before that is not the backup's. */
  e.seq = v.seq + 6;
  st = replicate(&v, &token, C.job_id, v.shard, from, v.term, v.seq_term, v.seq + 5, &ep, 1, NULL,
                 &res, detail);
  CHECK_MSG(st == RPC_OK && res == PS__REPLICATE_RESPONSE__RESULT__MISMATCH,
            "other position: %s (result %d): %s", rpc_status_name(st), res, detail);
  same_state(&v, "updates after a position the backup is not at");
  /* A snapshot of the wrong shape. */
  Ps__ReplicaSnapshot snap = PS__REPLICA_SNAPSHOT__INIT;
  Ps__ReplicaPosition sp = PS__REPLICA_POSITION__INIT;
  sp.term = v.term;
  sp.seq = v.seq + 100;
  snap.position = &sp;
  float few[3] = {1, 2, 3};
  snap.params = (ProtobufCBinaryData){.len = sizeof few, .data = (uint8_t *)few};
  st = replicate(&v, &token, C.job_id, v.shard, from, v.term, v.seq_term, v.seq, NULL, 0, &snap,
                 &res, detail);
  CHECK_MSG(st == RPC_OK && res == PS__REPLICATE_RESPONSE__RESULT__MISMATCH,
            "bad snapshot: %s (result %d): %s", rpc_status_name(st), res, detail);
  same_state(&v, "a snapshot of the wrong shape");

  /* Votes: a stranger, a shard that does not exist, a configuration of
   * another term. */
  st = vote(NULL, v.shard, v.term + 100, PS__VOTE_REQUEST__PHASE__PREPARE, 0, detail);
  CHECK_MSG(st == RPC_UNAUTHENTICATED, "vote without token: %s: %s", rpc_status_name(st), detail);
  st = vote(&token, 999, v.term + 100, PS__VOTE_REQUEST__PHASE__PREPARE, 0, detail);
  CHECK_MSG(st == RPC_INVALID_ARGUMENT, "vote for shard 999: %s: %s", rpc_status_name(st), detail);
  st = vote(&token, v.shard, v.term + 100, PS__VOTE_REQUEST__PHASE__ACCEPT, v.term + 99, detail);
  CHECK_MSG(st == RPC_INVALID_ARGUMENT, "vote with a mismatched configuration: %s: %s",
            rpc_status_name(st), detail);
  same_state(&v, "malformed votes and a vote without the token");

  /* The control: the same update at the right number is applied. (The
   * primary's next message then finds the backup out of its history and
   * sends it the whole state: the test's caller checks the replicas
   * agree again.) */
  e.seq = v.seq + 1;
  st = replicate(&v, &token, C.job_id, v.shard, from, v.term, v.seq_term, v.seq, &ep, 1, NULL,
                 &res, detail);
  CHECK_MSG(st == RPC_OK && res == PS__REPLICATE_RESPONSE__RESULT__APPLIED,
            "the control update: %s (result %d): %s", rpc_status_name(st), res, detail);
  printf("replica_check: the same update at the next number is applied\n");
  rpc_queue_destroy(C.q);
  rpc_channel_destroy(C.ch);
  rpc_global_shutdown();
  printf("replica_check: all passed\n");
  return 0;
}

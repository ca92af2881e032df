/* The worker client's pull and push in parts against live shards, as the
 * pipelined step uses them:
 *   - ps_client_pull_ex says each shard's arrival in shard order, with the
 *     prefix of the vector that has arrived;
 *   - a push started shard by shard (push_begin, push_shard, push_end) is
 *     applied once by every shard; push_end after success sends nothing
 *     more (no shard applies a gradient twice);
 *   - after a pause longer than the heartbeat time-out, every shard has
 *     forgotten this worker (no heartbeats are sent here): the pull says
 *     "starting over" before anything of its new attempt arrives, registers
 *     again with every shard, and completes; so does a push.
 *
 *   client_rounds HOST:PORT PAUSE_MS
 * (shard 0 of a fresh async job of at least 2 shards with SGD, whose
 * heartbeat time-out is below PAUSE_MS, and no other worker) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rpc.h"
#include "../../common/security.h"
#include "../../common/util.h"
#include "worker/client/ps_client.h"
#include "../unit/check.h"

typedef struct {
  int calls, restarts, bad_order, last_attempt;
  int next_shard;    /* the shard expected next */
  size_t avail_seen; /* the last avail said */
  size_t want_avail[64];
} recorder;

static void on_ready(void *user, int attempt, int shard, size_t avail) {
  recorder *r = user;
  r->calls++;
  if (shard < 0) { /* starting over */
    r->restarts++;
    r->next_shard = 0;
    r->last_attempt = attempt;
    return;
  }
  if (shard != r->next_shard || avail != r->want_avail[shard] || attempt != r->last_attempt)
    r->bad_order++;
  r->next_shard = shard + 1;
  r->avail_seen = avail;
}

static int pull(ps_client *c, float *params, uint64_t *versions, recorder *r, char *err) {
  int S = ps_client_num_shards(c);
  memset(r, 0, sizeof *r);
  for (int s = 0; s < S && s < 64; s++) {
    size_t off, cnt;
    ps_client_shard_range(c, s, &off, &cnt);
    r->want_avail[s] = off + cnt;
  }
  return ps_client_pull_ex(c, params, versions, NULL, on_ready, r, err);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: client_rounds HOST:PORT PAUSE_MS\n");
    return 2;
  }
  const int pause_ms = atoi(argv[2]);
  char err[PS_ERRLEN] = "";
  rpc_global_init();
  ps_security_opts so = {.insecure = 1}; /* loopback; the token from PS_TOKEN_FILE */
  ps_security sec;
  if (ps_security_resolve(&so, PS_SECURITY_CLIENT, &sec, err) != 0) {
    fprintf(stderr, "client_rounds: %s\n", err);
    return 2;
  }
  ps_client_opts o = {.host = "client_rounds", .role = "worker", .task_index = -1,
                      .timeout_ms = 10000, .token = &sec.token};
  ps_client *c = ps_client_connect(argv[1], &o, err);
  if (!c) {
    fprintf(stderr, "client_rounds: %s\n", err);
    return 1;
  }
  const int S = ps_client_num_shards(c);
  const size_t P = ps_client_param_count(c);
  CHECK_MSG(S >= 2 && S <= 64, "%d shards: the test wants 2 to 64", S);
  float *params = calloc(P, sizeof(float)), *before = calloc(P, sizeof(float));
  float *grads = calloc(P, sizeof(float));
  uint64_t versions[64] = {0}, v0[64] = {0};
  if (!params || !before || !grads) return 1;

  /* 1. A plain pull: every shard said once, in order, prefixes growing to P. */
  recorder r;
  CHECK_MSG(pull(c, params, versions, &r, err) == 0, "pull: %s", err);
  CHECK_MSG(r.calls == S && r.restarts == 0 && r.bad_order == 0 && r.avail_seen == P,
            "pull said %d times (%d restarts, %d out of order), last avail %zu of %zu", r.calls,
            r.restarts, r.bad_order, r.avail_seen, P);
  memcpy(before, params, P * sizeof(float));
  memcpy(v0, versions, sizeof v0);

  /* 2. A push in parts, the last shard first, then push_end; then push_end
   * again, which must send nothing. */
  for (size_t i = 0; i < P; i++) grads[i] = 0.5f;
  ps_push_result res;
  CHECK(ps_client_push_begin(c, versions, 0, 8, 0) == 0);
  CHECK(ps_client_push_pending(c) == S);
  CHECK_MSG(ps_client_push_shard(c, S - 1, grads, err) == 0, "push_shard: %s", err);
  CHECK(ps_client_push_shard(c, S, grads, err) != 0); /* no such shard: an error, nothing sent */
  CHECK_MSG(ps_client_push_end(c, grads, &res, err) == 0, "push_end: %s", err);
  CHECK(ps_client_push_pending(c) == 0);
  CHECK_MSG(ps_client_push_end(c, grads, &res, err) == 0, "push_end again: %s", err);
  CHECK(pull(c, params, versions, &r, err) == 0);
  int once = 1;
  for (int s = 0; s < S; s++) once &= versions[s] == v0[s] + 1;
  CHECK_MSG(once, "each shard should have applied the push exactly once");
  /* SGD moved every value against the gradient. */
  int moved = 0;
  for (size_t i = 0; i < P; i++) moved += params[i] < before[i];
  CHECK_MSG((size_t)moved == P, "%d of %zu values moved", moved, P);

  /* 3. A pause past the heartbeat time-out: every shard forgets us. */
  printf("client_rounds: pausing %d ms without heartbeats\n", pause_ms);
  fflush(stdout);
  ps_sleep_ms(pause_ms);
  memcpy(v0, versions, sizeof v0);
  CHECK_MSG(pull(c, params, versions, &r, err) == 0, "pull after the pause: %s", err);
  CHECK_MSG(r.restarts == 1 && r.bad_order == 0 && r.next_shard == S && r.avail_seen == P,
            "after the pause: %d restarts, %d out of order, %d shards said", r.restarts,
            r.bad_order, r.next_shard);
  for (int s = 0; s < S; s++) CHECK(versions[s] == v0[s]);
  CHECK(ps_client_push(c, grads, versions, 1, 8, &res, err) == 0);
  CHECK(pull(c, params, versions, &r, err) == 0 && r.restarts == 0);
  for (int s = 0; s < S; s++) CHECK(versions[s] == v0[s] + 1);
  if (check_failed_ == 0)
    printf("client_rounds: %d shards, %zu values: pulls said each shard in order, a push in "
           "parts applied once, and after the pause the pull started over once and registered "
           "again\n",
           S, P);

  ps_client_leave(c);
  ps_client_destroy(c);
  free(params), free(before), free(grads);
  rpc_global_shutdown();
  return check_summary();
}

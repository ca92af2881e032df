/* Push rounds across a shard's restart: a round the shard applied before
 * its checkpoint, resent after it restarted from that checkpoint (the
 * first answer was lost with the process), is answered without being
 * applied again; the next round is applied.
 *
 *   restart_rounds HOST:PORT before STATE_FILE
 *       registers a new worker, pushes rounds 1 and 2 (applied: the
 *       version goes up by 2), and writes the worker id, the version and
 *       the job id to STATE_FILE
 *   restart_rounds HOST:PORT after STATE_FILE
 *       (the shard restarted from a checkpoint written after those
 *       pushes) registers again with that id, resends round 2: the
 *       version and the values stay as they are; pushes round 3: the
 *       version goes up by 1
 *
 * (one shard of an async job with SGD; the job token in PS_TOKEN_FILE) */
#include <inttypes.h>
#include <math.h>

#include "../unit/check.h"
#include "raw_client.h"

static int push_round(raw_client *c, const ps_token *t, const raw_identity *who, uint64_t round,
                      const float *g, char *detail, uint64_t *version) {
  Ps__RequestHeader h;
  raw_header(c, &h, t, who);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = c->range_off;
  req.count = c->range_cnt;
  req.batch_size = 1;
  req.base_version = c->base_version;
  req.request_id = round;
  req.step = round;
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(c, NULL, RAW_METHOD("Push"), &req.base, g, c->range_cnt * sizeof(float),
                       detail, &resp, &len);
  if (st == RPC_OK) {
    Ps__PushResponse *r = ps__push_response__unpack(NULL, len, resp);
    if (!r) {
      st = -1;
    } else {
      *version = r->version;
      ps__push_response__free_unpacked(r, NULL);
    }
  }
  free(resp);
  return st;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: restart_rounds HOST:PORT before|after STATE_FILE\n");
    return 2;
  }
  int after = strcmp(argv[2], "after") == 0;
  char err[PS_ERRLEN] = "", detail[PS_ERRLEN];
  ps_token tok;
  const char *tf = getenv("PS_TOKEN_FILE");
  CHECK(tf && ps_token_load(tf, &tok, NULL, err) == 0);
  rpc_global_init();
  raw_client c = {.timeout_ms = 10000};
  c.q = rpc_queue_create();
  c.ch = rpc_channel_create(argv[1], NULL, err);
  CHECK(c.q && c.ch);
  raw_identity who = {0}, as = {0};
  uint64_t v0 = 0, id = 0;
  if (after) {
    FILE *f = fopen(argv[3], "r");
    CHECK(f && fscanf(f, "%" SCNx64 " %" SCNu64 " %63s", &id, &v0, c.job_id) == 3);
    if (f) fclose(f);
    as.id = id;
  }
  CHECK_MSG(raw_register(&c, &tok, "worker", "test", after ? &as : NULL, &who, detail) == RPC_OK,
            "register: %s", detail);
  CHECK(!after || who.id == id);
  float *g = malloc((c.range_cnt ? c.range_cnt : 1) * sizeof(float));
  float *before = malloc((c.range_cnt ? c.range_cnt : 1) * sizeof(float));
  float *now = malloc((c.range_cnt ? c.range_cnt : 1) * sizeof(float));
  CHECK(g && before && now);
  for (uint64_t i = 0; i < c.range_cnt; i++) g[i] = 0.01f * (float)((i % 7) + 1);
  uint64_t v = 0, pulled = 0;
  CHECK(raw_pull(&c, &tok, &who, before, &pulled, detail) == RPC_OK);
  c.base_version = pulled;
  if (!after) {
    CHECK_MSG(push_round(&c, &tok, &who, 1, g, detail, &v) == RPC_OK, "round 1: %s", detail);
    CHECK_MSG(push_round(&c, &tok, &who, 2, g, detail, &v) == RPC_OK, "round 2: %s", detail);
    CHECK_MSG(v == pulled + 2, "two rounds: version %" PRIu64 ", expected %" PRIu64, v,
              pulled + 2);
    FILE *f = fopen(argv[3], "w");
    CHECK(f && fprintf(f, "%016" PRIx64 " %" PRIu64 " %s\n", who.id, v, c.job_id) > 0);
    if (f) fclose(f);
    printf("restart_rounds: worker %016" PRIx64 " pushed rounds 1 and 2: version %" PRIu64 "\n",
           who.id, v);
  } else {
    CHECK_MSG(pulled == v0, "the restored shard is at version %" PRIu64 ", the pushes left it at "
              "%" PRIu64, pulled, v0);
    CHECK_MSG(push_round(&c, &tok, &who, 2, g, detail, &v) == RPC_OK, "round 2 again: %s",
              detail);
    CHECK_MSG(v == v0, "round 2 resent: version %" PRIu64 ", expected %" PRIu64 " (applied twice)",
              v, v0);
    CHECK(raw_pull(&c, &tok, &who, now, &pulled, detail) == RPC_OK);
    CHECK_MSG(pulled == v0 && memcmp(now, before, c.range_cnt * sizeof(float)) == 0,
              "round 2 resent changed the values");
    CHECK_MSG(push_round(&c, &tok, &who, 3, g, detail, &v) == RPC_OK, "round 3: %s", detail);
    CHECK_MSG(v == v0 + 1, "round 3: version %" PRIu64 ", expected %" PRIu64, v, v0 + 1);
    printf("restart_rounds: after the restart, round 2 resent was answered at version %" PRIu64
           " with nothing applied; round 3 applied: version %" PRIu64 "\n",
           v0, v);
  }
  free(g);
  free(before);
  free(now);
  rpc_channel_destroy(c.ch);
  rpc_queue_destroy(c.q);
  rpc_global_shutdown();
  return check_summary();
}

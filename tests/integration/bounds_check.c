/* Bounds on what a client can make a shard hold, on a live shard of
 * jobs/bounds.json (sync, max_workers 4): registrations beyond max_workers,
 * pulls waiting beyond twice that, a request larger than the shard's range
 * allows, a compressed request, a 256 MiB unknown field: each is refused
 * with RESOURCE_EXHAUSTED (UNIMPLEMENTED for the compression), the
 * server's peak memory does not grow by the size of what was sent, and the
 * shard's bytes are unchanged; then the four workers' gradients do apply a
 * step (so the comparison can fail).
 *
 *   bounds_check HOST:PORT SERVER_PID   (the job token from PS_TOKEN_FILE) */
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

#define M(name) "/ps.ParameterServer/" name
enum { MAX_WORKERS = 4 };

typedef struct {
  uint64_t id;
  uint8_t session[PS_SESSION_LEN];
  size_t session_len;
} identity;

static rpc_queue *q;
static ps_token token;
static char job_id[64];
static uint64_t range_off, range_cnt;
static uint64_t base_version; /* what pushes say they were computed from */

static void header(Ps__RequestHeader *h, const identity *who) {
  ps__request_header__init(h);
  h->protocol_version = PS_PROTOCOL_VERSION;
  h->job_id = job_id;
  h->token = (ProtobufCBinaryData){.len = token.len, .data = token.bytes};
  if (who) {
    h->worker_id = who->id;
    h->session = (ProtobufCBinaryData){.len = who->session_len, .data = (uint8_t *)who->session};
  }
}

static int call(rpc_channel *ch, const char *method, const ProtobufCMessage *m,
                const void *tensor, size_t tbytes, char *detail, uint8_t **resp, size_t *len) {
  rpc_msg msg;
  if (wire_encode(m, tensor, tbytes, NULL, NULL, &msg) != 0) return -1;
  uint8_t *r = NULL;
  size_t rl = 0;
  detail[0] = '\0';
  int st = rpc_call_sync(q, ch, method, &msg, 20000, 1, &r, &rl, detail);
  if (resp) {
    *resp = r;
    *len = rl;
  } else {
    free(r);
  }
  return st;
}

static int do_register(rpc_channel *ch, identity *out, char *detail) {
  Ps__RequestHeader h;
  header(&h, NULL);
  Ps__RegisterRequest rr = PS__REGISTER_REQUEST__INIT;
  rr.header = &h;
  rr.host = "bounds";
  rr.role = "worker";
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = call(ch, M("Register"), &rr.base, NULL, 0, detail, &resp, &len);
  if (st == RPC_OK) {
    Ps__RegisterResponse *r = ps__register_response__unpack(NULL, len, resp);
    out->id = r->worker_id;
    out->session_len = r->session.len <= PS_SESSION_LEN ? r->session.len : 0;
    memcpy(out->session, r->session.data, out->session_len);
    snprintf(job_id, sizeof job_id, "%s", r->job_id);
    range_off = r->range_offset;
    range_cnt = r->range_count;
    ps__register_response__free_unpacked(r, NULL);
  }
  free(resp);
  return st;
}

static int do_push(rpc_channel *ch, const identity *who, const float *g, size_t count,
                   char *detail) {
  Ps__RequestHeader h;
  header(&h, who);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = range_off;
  req.count = count;
  req.batch_size = 1;
  req.base_version = base_version;
  return call(ch, M("Push"), &req.base, g, count * sizeof(float), detail, NULL, NULL);
}

/* The shard's values and version now (a pull that need not wait). */
static int snapshot(rpc_channel *ch, const identity *who, float *vals, uint64_t *version) {
  Ps__RequestHeader h;
  header(&h, who);
  Ps__PullRequest req = PS__PULL_REQUEST__INIT;
  req.header = &h;
  req.offset = range_off;
  req.count = range_cnt;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = call(ch, M("Pull"), &req.base, NULL, 0, detail, &resp, &len);
  CHECK_MSG(st == RPC_OK, "pull: %s %s", rpc_status_name(st), detail);
  if (st == RPC_OK) {
    ps_seg seg = {resp, len}, tseg[2];
    ps_segview v = {&seg, 1, len}, tensor;
    char err[PS_ERRLEN];
    ProtobufCMessage *m = wire_decode(&ps__pull_response__descriptor, &v, tseg, 2, &tensor, err);
    if (m) {
      ps_segview_copy(&tensor, 0, vals, range_cnt * sizeof(float));
      *version = ((Ps__PullResponse *)m)->version;
      protobuf_c_message_free_unpacked(m, NULL);
    }
  }
  free(resp);
  return st;
}

/* The server's peak resident memory (VmHWM), in MiB. */
static double peak_mib(const char *pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%s/status", pid);
  FILE *f = fopen(path, "r");
  double kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "VmHWM: %lf kB", &kb) == 1) break;
  if (f) fclose(f);
  return kb / 1024;
}

#define EXPECT(what, st_expr, code, substr)                                                  \
  do {                                                                                       \
    int st_ = (st_expr);                                                                     \
    CHECK_MSG(st_ == (code) && strstr(detail, substr) != NULL,                               \
              "%s: got %s '%s', want %s containing '%s'", what, rpc_status_name(st_), detail, \
              rpc_status_name(code), substr);                                                \
    printf("  %-44s -> %s: %.70s\n", what, rpc_status_name(st_), detail);                   \
  } while (0)

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: bounds_check HOST:PORT SERVER_PID\n");
    return 2;
  }
  char err[PS_ERRLEN], detail[PS_ERRLEN];
  const char *tf = getenv("PS_TOKEN_FILE");
  if (!tf || ps_token_load(tf, &token, NULL, err) != 0) {
    fprintf(stderr, "bounds_check: PS_TOKEN_FILE: %s\n", tf ? err : "not set");
    return 2;
  }
  rpc_global_init();
  rpc_channel_opts plain = {.keepalive_ms = RPC_DEFAULT_KEEPALIVE_MS};
  rpc_channel_opts gz = {.keepalive_ms = RPC_DEFAULT_KEEPALIVE_MS, .gzip = 1};
  rpc_channel *ch = rpc_channel_create(argv[1], &plain, err);
  rpc_channel *zch = rpc_channel_create(argv[1], &gz, err);
  q = rpc_queue_create();
  if (!ch || !zch || !q) return 1;

  identity w[MAX_WORKERS + 1];
  for (int i = 0; i < MAX_WORKERS; i++)
    EXPECT("Register within max_workers", do_register(ch, &w[i], detail), RPC_OK, "");
  EXPECT("Register beyond max_workers", do_register(ch, &w[MAX_WORKERS], detail),
         RPC_RESOURCE_EXHAUSTED, "max_workers");
  float *before = malloc(range_cnt * sizeof(float)), *after = malloc(range_cnt * sizeof(float));
  uint64_t v0 = 0, v1 = 0;
  snapshot(ch, &w[0], before, &v0);
  double peak0 = peak_mib(argv[2]);

  /* Pulls waiting for step 1 (sync: no gradient is in yet). */
  enum { WAITING = 2 * MAX_WORKERS };
  rpc_request *held[WAITING];
  for (int i = 0; i < WAITING; i++) {
    Ps__RequestHeader h;
    header(&h, &w[i % MAX_WORKERS]);
    Ps__PullRequest req = PS__PULL_REQUEST__INIT;
    req.header = &h;
    req.offset = range_off;
    req.count = range_cnt;
    req.min_version = 1;
    rpc_msg msg;
    held[i] = wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) == 0
                  ? rpc_start(q, ch, M("Pull"), &msg, 20000, 1, err)
                  : NULL;
    CHECK(held[i] != NULL);
  }
  ps_sleep_ms(500); /* they reach the shard and wait */
  {
    Ps__RequestHeader h;
    header(&h, &w[0]);
    Ps__PullRequest req = PS__PULL_REQUEST__INIT;
    req.header = &h;
    req.offset = range_off;
    req.count = range_cnt;
    req.min_version = 1;
    EXPECT("a pull beyond 2 x max_workers waiting",
           call(ch, M("Pull"), &req.base, NULL, 0, detail, NULL, NULL), RPC_RESOURCE_EXHAUSTED,
           "pulls wait");
  }
  for (int i = 0; i < WAITING; i++)
    if (held[i]) rpc_request_free(held[i]); /* cancelled */

  /* A push larger than the shard's range could ever need. */
  size_t big = range_cnt + 32 * 1024;
  float *g = calloc(big, sizeof(float));
  EXPECT("a push past the shard's size", do_push(ch, &w[0], g, big, detail),
         RPC_RESOURCE_EXHAUSTED, "");
  /* A compressed push (gzip of zeros: tiny on the wire). */
  EXPECT("a gzip-compressed push", do_push(zch, &w[0], g, range_cnt, detail), RPC_UNIMPLEMENTED,
         "");
  /* A Status request with a 256 MiB unknown field (number 100, bytes). */
  {
    size_t n = 256u << 20;
    uint8_t *raw = malloc(n + 16);
    size_t at = 0;
    raw[at++] = ((100 << 3 | 2) & 0x7f) | 0x80; /* tag 100, wire type 2: two bytes */
    raw[at++] = (100 << 3 | 2) >> 7;
    for (size_t v = n; ; v >>= 7) { /* varint length */
      raw[at++] = (uint8_t)((v & 0x7f) | (v >= 0x80 ? 0x80 : 0));
      if (v < 0x80) break;
    }
    memset(raw + at, 'x', n);
    rpc_msg msg = {.nseg = 1};
    msg.seg[0] = (rpc_seg){.ptr = raw, .len = at + n};
    uint8_t *r = NULL;
    size_t rl = 0;
    detail[0] = '\0';
    int st = rpc_call_sync(q, ch, M("Status"), &msg, 30000, 1, &r, &rl, detail);
    free(r);
    free(raw);
    EXPECT("a 256 MiB unknown field", st, RPC_RESOURCE_EXHAUSTED, "");
  }
  double peak1 = peak_mib(argv[2]);
  printf("  server peak memory: %.0f MiB before, %.0f MiB after\n", peak0, peak1);
  CHECK_MSG(peak0 > 0 && peak1 - peak0 < 64, "the server's peak memory grew by %.0f MiB",
            peak1 - peak0);
  snapshot(ch, &w[0], after, &v1);
  CHECK_MSG(v1 == v0 && memcmp(before, after, range_cnt * sizeof(float)) == 0,
            "refused requests changed the shard (version %" PRIu64 " -> %" PRIu64 ")", v0, v1);
  /* The four workers' gradients apply step 1. */
  for (size_t i = 0; i < range_cnt; i++) g[i] = 0.25f;
  for (int i = 0; i < MAX_WORKERS; i++)
    EXPECT("a sync gradient", do_push(ch, &w[i], g, range_cnt, detail), RPC_OK, "");
  snapshot(ch, &w[0], after, &v1);
  CHECK_MSG(v1 == v0 + 1 && memcmp(before, after, range_cnt * sizeof(float)) != 0,
            "the step was not applied (version %" PRIu64 " -> %" PRIu64 ")", v0, v1);
  /* Steps whose momentum grows past FLT_MAX: the one that would make the
   * model non-finite is refused, and the pull waiting for it is told at
   * once (not after its deadline) why, with nothing changed. */
  for (size_t i = 0; i < range_cnt; i++) g[i] = 8e37f;
  int refused = 0;
  for (uint64_t step = v1 + 1; step < v1 + 12 && !refused; step++) {
    Ps__RequestHeader h;
    header(&h, &w[0]);
    Ps__PullRequest req = PS__PULL_REQUEST__INIT;
    req.header = &h;
    req.offset = range_off;
    req.count = range_cnt;
    req.min_version = step;
    rpc_msg msg;
    rpc_request *waiting = wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) == 0
                               ? rpc_start(q, ch, M("Pull"), &msg, 20000, 1, err)
                               : NULL;
    ps_sleep_ms(100);
    snapshot(ch, &w[1], before, &v0);
    base_version = v0;
    for (int i = 0; i < MAX_WORKERS; i++) do_push(ch, &w[i], g, range_cnt, detail);
    double t0 = ps_now_s();
    ps_segview view;
    int st = waiting ? rpc_wait(waiting, detail, &view) : -1;
    double waited = ps_now_s() - t0;
    if (waiting) rpc_request_free(waiting);
    if (st == RPC_OK) continue;
    refused = 1;
    EXPECT("a pull waiting for a step that is refused", st, RPC_FAILED_PRECONDITION, "refused");
    CHECK_MSG(waited < 5, "the refused step's pull waited %.1f s", waited);
    snapshot(ch, &w[1], after, &v1);
    CHECK_MSG(v1 == v0 && memcmp(before, after, range_cnt * sizeof(float)) == 0,
              "the refused step changed the shard");
  }
  CHECK_MSG(refused, "no step was refused: momentum never overflowed");
  free(before);
  free(after);
  free(g);
  rpc_queue_destroy(q);
  rpc_channel_destroy(ch);
  rpc_channel_destroy(zch);
  rpc_global_shutdown();
  return check_summary();
}

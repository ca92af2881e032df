/* Bounds on what a client can make a shard hold, on a live shard of
 * jobs/bounds.json (sync, max_workers 4): registrations beyond max_workers,
 * a worker's pulls held open (a newer one replaces the one waiting, so the
 * shard holds one per registration), a request larger than the shard's range
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
#include "raw_client.h"

#define M RAW_METHOD
enum { MAX_WORKERS = 4 };

typedef raw_identity identity;
static raw_client C = {.timeout_ms = 20000};
static ps_token token;

static void header(Ps__RequestHeader *h, const identity *who) { raw_header(&C, h, &token, who); }

static int call(rpc_channel *ch, const char *method, const ProtobufCMessage *m,
                const void *tensor, size_t tbytes, char *detail, uint8_t **resp, size_t *len) {
  return raw_call_on(&C, ch, method, m, tensor, tbytes, detail, resp, len);
}

static int do_register(rpc_channel *ch, identity *out, char *detail) {
  (void)ch;
  return raw_register(&C, &token, "worker", "bounds", NULL, out, detail);
}

static int do_push(rpc_channel *ch, const identity *who, const float *g, size_t count,
                   char *detail) {
  return raw_push(&C, ch, &token, who, g, count, detail);
}

/* The shard's values and version now (a pull that need not wait). */
static int snapshot(rpc_channel *ch, const identity *who, float *vals, uint64_t *version) {
  (void)ch;
  char detail[PS_ERRLEN];
  int st = raw_pull(&C, &token, who, vals, version, detail);
  CHECK_MSG(st == RPC_OK, "pull: %s %s", rpc_status_name(st), detail);
  return st;
}

/* The number of pulls waiting on the shard (its Status). */
static int waiting_now(rpc_channel *ch, const identity *who) {
  Ps__RequestHeader h;
  header(&h, who);
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  char detail[PS_ERRLEN] = "";
  uint8_t *resp = NULL;
  size_t len = 0;
  int n = -1;
  if (call(ch, M("Status"), &req.base, NULL, 0, detail, &resp, &len) == RPC_OK) {
    Ps__StatusResponse *r = ps__status_response__unpack(NULL, len, resp);
    if (r) n = (int)r->waiting_now;
    if (r) ps__status_response__free_unpacked(r, NULL);
  }
  free(resp);
  return n;
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

#define EXPECT RAW_EXPECT

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
  C.q = rpc_queue_create();
  C.ch = ch;
  if (!ch || !zch || !C.q) return 1;

  identity w[MAX_WORKERS + 1];
  for (int i = 0; i < MAX_WORKERS; i++)
    EXPECT("Register within max_workers", do_register(ch, &w[i], detail), RPC_OK, "");
  EXPECT("Register beyond max_workers", do_register(ch, &w[MAX_WORKERS], detail),
         RPC_RESOURCE_EXHAUSTED, "max_workers");
  float *before = malloc(C.range_cnt * sizeof(float)), *after = malloc(C.range_cnt * sizeof(float));
  uint64_t v0 = 0, v1 = 0;
  snapshot(ch, &w[0], before, &v0);
  double peak0 = peak_mib(argv[2]);

  /* Pulls waiting for step 1 (sync: no gradient is in yet), two per
   * worker: each worker's second replaces its first, which is answered
   * CANCELLED at once (not held to its deadline), and the shard holds one
   * pull per worker. */
  enum { WAITING = 2 * MAX_WORKERS };
  rpc_request *held[WAITING];
  for (int i = 0; i < WAITING; i++) {
    held[i] = raw_pull_start(&C, &token, &w[i % MAX_WORKERS], 1);
    CHECK(held[i] != NULL);
    if (i + 1 == MAX_WORKERS) ps_sleep_ms(300); /* the first ones reach the shard first */
  }
  ps_sleep_ms(500); /* they reach the shard and wait */
  for (int i = 0; i < MAX_WORKERS; i++) {
    detail[0] = '\0';
    ps_segview view;
    double t0 = ps_now_s();
    int st = held[i] ? rpc_wait(held[i], detail, &view) : -1;
    EXPECT("a worker's first pull, replaced by its second", st, RPC_CANCELLED, "replaces");
    CHECK_MSG(ps_now_s() - t0 < 5, "the replaced pull was answered after %.1f s",
              ps_now_s() - t0);
  }
  int n_waiting = waiting_now(ch, &w[0]);
  CHECK_MSG(n_waiting == MAX_WORKERS, "%d pulls wait on the shard, not one per worker (%d)", n_waiting,
            MAX_WORKERS);
  for (int i = 0; i < WAITING; i++)
    if (held[i]) rpc_request_free(held[i]); /* the second ones: cancelled here */

  /* A push larger than the shard's range could ever need. */
  size_t big = C.range_cnt + 32 * 1024;
  float *g = calloc(big, sizeof(float));
  EXPECT("a push past the shard's size", do_push(ch, &w[0], g, big, detail),
         RPC_RESOURCE_EXHAUSTED, "");
  /* A compressed push (gzip of zeros: tiny on the wire). */
  EXPECT("a gzip-compressed push", do_push(zch, &w[0], g, C.range_cnt, detail), RPC_UNIMPLEMENTED,
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
    int st = rpc_call_sync(C.q, ch, M("Status"), &msg, 30000, 1, &r, &rl, detail);
    free(r);
    free(raw);
    EXPECT("a 256 MiB unknown field", st, RPC_RESOURCE_EXHAUSTED, "");
  }
  double peak1 = peak_mib(argv[2]);
  printf("  server peak memory: %.0f MiB before, %.0f MiB after\n", peak0, peak1);
  /* Half of the 256 MiB sent: a server that buffered the message whole
   * would pass it. (About 40 MiB in a plain build; a sanitized one keeps
   * freed blocks in quarantine and grew by 82 MiB once under load, past the
   * 64 MiB this bound was.) */
  CHECK_MSG(peak0 > 0 && peak1 - peak0 < 128, "the server's peak memory grew by %.0f MiB",
            peak1 - peak0);
  snapshot(ch, &w[0], after, &v1);
  CHECK_MSG(v1 == v0 && memcmp(before, after, C.range_cnt * sizeof(float)) == 0,
            "refused requests changed the shard (version %" PRIu64 " -> %" PRIu64 ")", v0, v1);
  /* The four workers' gradients apply step 1. */
  for (size_t i = 0; i < C.range_cnt; i++) g[i] = 0.25f;
  for (int i = 0; i < MAX_WORKERS; i++)
    EXPECT("a sync gradient", do_push(ch, &w[i], g, C.range_cnt, detail), RPC_OK, "");
  /* A push is answered when its gradient is taken; the step is applied
   * after that answer, so the pull waits for it (as a worker's does). */
  {
    int st = raw_pull_min(&C, &token, &w[0], v0 + 1, after, &v1, detail);
    CHECK_MSG(st == RPC_OK, "pull waiting for step 1: %s %s", rpc_status_name(st), detail);
  }
  CHECK_MSG(v1 == v0 + 1 && memcmp(before, after, C.range_cnt * sizeof(float)) != 0,
            "the step was not applied (version %" PRIu64 " -> %" PRIu64 ")", v0, v1);
  /* Steps whose momentum grows past FLT_MAX: the one that would make the
   * model non-finite is refused, and the pull waiting for it is told at
   * once (not after its deadline) why, with nothing changed. */
  for (size_t i = 0; i < C.range_cnt; i++) g[i] = 8e37f;
  int refused = 0;
  for (uint64_t step = v1 + 1; step < v1 + 12 && !refused; step++) {
    rpc_request *waiting = raw_pull_start(&C, &token, &w[0], step);
    ps_sleep_ms(100);
    snapshot(ch, &w[1], before, &v0);
    C.base_version = v0;
    for (int i = 0; i < MAX_WORKERS; i++) do_push(ch, &w[i], g, C.range_cnt, detail);
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
    CHECK_MSG(v1 == v0 && memcmp(before, after, C.range_cnt * sizeof(float)) == 0,
              "the refused step changed the shard");
  }
  CHECK_MSG(refused, "no step was refused: momentum never overflowed");
  free(before);
  free(after);
  free(g);
  rpc_queue_destroy(C.q);
  rpc_channel_destroy(ch);
  rpc_channel_destroy(zch);
  rpc_global_shutdown();
  return check_summary();
}

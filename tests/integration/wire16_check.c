/* Bad input about the encoding of tensor values, against a live shard of a
 * job whose "wire" is WIRE (bf16, fp16 or fp32): every bad request is
 * refused with the right code and a message that names the job's encoding
 * where the encoding is what is wrong, and the shard's parameter bytes and
 * version are the same afterwards; a good push then changes them (so the
 * comparison can fail). Pulls answer in the job's encoding, said in the
 * answer; Status says the encoding and counts the bytes.
 *
 *   wire16_check HOST:PORT WIRE [overflow]   (shard 0 of a fresh one-shard job)
 *   wire16_check HOST:PORT bf16 residual
 * With `overflow` (an fp16 job with momentum) it then pushes until the
 * parameters leave fp16's range and checks that pulls carry Inf codes for
 * them. With `residual` (a fresh bf16 job with "sgd", lr 1) it checks the
 * worker's client instead (ps_client, as ps-worker uses it): pushes of a
 * gradient that bf16 rounds move the parameters by what float32 pushes
 * would (see check_residual). The job's token comes from PS_TOKEN_FILE. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/auth.h"
#include "../../common/half.h"
#include "../../common/job.h"
#include "../../common/rpc.h"
#include "../../common/util.h"
#include "../../common/wire.h"
#include "worker/client/ps_client.h"
#include "../unit/check.h"
#include "proto/ps.pb-c.h"
#include "raw_client.h"

#define M RAW_METHOD

static raw_client C = {.timeout_ms = 10000};
static ps_token token;
static raw_identity me;
static ps_wire job_wire;

/* A Pull of the shard's range saying encoding enc; on success the values'
 * bytes (malloc'd, *len of them), the answer's encoding and version. */
static int pull_as(int enc, uint8_t **bytes, size_t *len, int *enc_out, uint64_t *version,
                   char *detail) {
  Ps__RequestHeader h;
  Ps__PullRequest req;
  raw_pull_request(&C, &req, &h, &token, &me, 0);
  h.encoding = (Ps__Encoding)enc;
  uint8_t *resp = NULL;
  size_t rl = 0;
  int st = raw_call_on(&C, NULL, M("Pull"), &req.base, NULL, 0, detail, &resp, &rl);
  if (st == RPC_OK) {
    ps_seg seg = {resp, rl}, tseg[2];
    ps_segview v = {&seg, 1, rl}, tensor;
    char err[PS_ERRLEN];
    ProtobufCMessage *m = wire_decode(&ps__pull_response__descriptor, &v, tseg, 2, &tensor, err);
    CHECK_MSG(m != NULL, "malformed Pull answer: %s", err);
    if (m) {
      *len = tensor.total;
      *bytes = malloc(*len ? *len : 1);
      ps_segview_copy(&tensor, 0, *bytes, *len);
      *enc_out = (int)((Ps__PullResponse *)m)->encoding;
      *version = ((Ps__PullResponse *)m)->version;
      protobuf_c_message_free_unpacked(m, NULL);
    } else {
      st = -1;
    }
  }
  free(resp);
  return st;
}

/* The shard's values as bytes in the job's encoding, and its version. */
static uint8_t *snapshot(size_t *len, uint64_t *version) {
  char detail[PS_ERRLEN];
  uint8_t *b = NULL;
  int enc = -1;
  int st = pull_as(job_wire, &b, len, &enc, version, detail);
  CHECK_MSG(st == RPC_OK, "Pull: %s %s", rpc_status_name(st), detail);
  if (st != RPC_OK) return NULL;
  CHECK_MSG(enc == (int)job_wire, "the Pull answer says encoding %d, the job's is %d", enc,
            (int)job_wire);
  CHECK_MSG(*len == C.range_cnt * ps_wire_value_bytes(job_wire),
            "the Pull answer holds %zu bytes for %llu %s values", *len,
            (unsigned long long)C.range_cnt, ps_wire_name(job_wire));
  return b;
}

/* A Push of count values saying encoding enc, with `bytes` of data. */
static int push_as(int enc, uint64_t count, const void *data, size_t bytes, char *detail) {
  Ps__RequestHeader h;
  raw_header(&C, &h, &token, &me);
  h.encoding = (Ps__Encoding)enc;
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = C.range_off;
  req.count = count;
  req.batch_size = 1;
  return raw_call_on(&C, NULL, M("Push"), &req.base, data, bytes, detail, NULL, NULL);
}

/* Status: the job's encoding and the bytes counted. */
static int status(char *wire, size_t cap, uint64_t *push_bytes, uint64_t *pull_bytes) {
  Ps__RequestHeader h;
  raw_header(&C, &h, &token, &me);
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(&C, NULL, M("Status"), &req.base, NULL, 0, detail, &resp, &len);
  Ps__StatusResponse *r = st == RPC_OK ? ps__status_response__unpack(NULL, len, resp) : NULL;
  free(resp);
  CHECK_MSG(r != NULL, "Status: %s %s", rpc_status_name(st), detail);
  if (!r) return -1;
  snprintf(wire, cap, "%s", r->wire ? r->wire : "");
  *push_bytes = r->push_bytes;
  *pull_bytes = r->pull_bytes;
  ps__status_response__free_unpacked(r, NULL);
  return 0;
}

/* Checks that a refusal names the job's encoding ("as bf16 (its job
 * file's"): the message a client needs to fix its side. */
static void expect_names_job(const char *what, const char *detail) {
  char want[64];
  snprintf(want, sizeof want, "as %s (its job file's", ps_wire_name(job_wire));
  CHECK_MSG(strstr(detail, want) != NULL, "%s: the message does not name the job's encoding: %s",
            what, detail);
}

/* Error feedback through the worker's client against a live shard. Pulls
 * are bf16 too, so each parameter read is off by up to half a bf16 step
 * (2^-9 below 1): the pushes alternate +a and -b, which keeps the
 * parameters where they started, and the check is on the mean move over
 * all of them, where those reading errors average out. a = 2^-10 (1 +
 * 2^-9), which bf16 rounds to 2^-10; b = 2^-10, exact. N pairs move every
 * parameter by -N 2^-19 with float32 pushes; by 0 with bf16 pushes each
 * rounded alone. */
/* A worker's client of the shard at addr, on the job's wire, and the job;
 * NULL with a message on stderr. */
static ps_client *client_of(const char *addr, ps_job *job) {
  char err[PS_ERRLEN] = "";
  ps_client_opts o = {.host = "wire16-check",
                      .role = "worker",
                      .task_index = -1,
                      .timeout_ms = 10000,
                      .token = &token};
  ps_client *c = ps_client_connect(addr, &o, err);
  if (!c || ps_job_parse(ps_client_job_json(c), job, err) != 0 ||
      ps_client_set_wire(c, job->wire, err) != 0) {
    fprintf(stderr, "wire16_check: %s\n", err);
    if (c) ps_client_destroy(c);
    return NULL;
  }
  return c;
}

static int check_residual(const char *addr) {
  char err[PS_ERRLEN];
  ps_job job;
  ps_client *c = client_of(addr, &job);
  if (!c) return 1;
  CHECK_MSG(job.wire == PS_WIRE_BF16 && strcmp(job.optim.name, "sgd") == 0 && job.optim.lr == 1.0f,
            "the residual check needs a bf16 job with sgd, lr 1 (not %s, %s, %g)",
            ps_wire_name(job.wire), job.optim.name, (double)job.optim.lr);
  size_t P = ps_client_param_count(c);
  int S = ps_client_num_shards(c);
  float *p0 = calloc(P, sizeof *p0), *p1 = calloc(P, sizeof *p1);
  float *ga = calloc(P, sizeof *ga), *gb = calloc(P, sizeof *gb);
  uint64_t *v = calloc((size_t)S, sizeof *v);
  const int N = 2048;
  for (size_t i = 0; i < P; i++) {
    ga[i] = 0x1p-10f * (1.0f + 0x1p-9f);
    gb[i] = -0x1p-10f;
  }
  int rc = ps_client_pull(c, p0, v, NULL, err);
  for (int k = 0; k < 2 * N && rc == PS_OK; k++)
    rc = ps_client_push(c, k & 1 ? gb : ga, v, (uint64_t)k + 1, 1, NULL, err);
  if (rc == PS_OK) rc = ps_client_pull(c, p1, v, NULL, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  double want = N * 0x1p-19, sum = 0, worst = 0, rmax = 0;
  const float *res = ps_client_residual(c);
  for (size_t i = 0; rc == PS_OK && i < P; i++) {
    double moved = (double)p0[i] - (double)p1[i];
    sum += moved;
    if (fabs(moved - want) > worst) worst = fabs(moved - want);
    if (fabs(res[i]) > rmax) rmax = fabs(res[i]);
  }
  double mean = sum / (double)P;
  printf(
      "residual: %d pushes through the client, +a and -b in turn: the parameters moved by "
      "%.6g on average (float32 pushes: %.6g; bf16 rounding each push alone: 0); each within "
      "%.3g, which reading them in bf16 allows; residual at most %.3g\n",
      2 * N, mean, want, worst, rmax);
  CHECK_MSG(fabs(mean - want) < 0x1p-13, "moved %.6g on average, float32 pushes %.6g", mean, want);
  CHECK_MSG(worst <= 0x1p-8 + 0x1p-17, "a parameter moved %.3g away from float32's", worst);
  CHECK_MSG(rmax <= 0x1p-18, "a residual of %g is more than half a bf16 step", rmax);
  ps_client_leave(c);
  ps_client_destroy(c);
  free(p0);
  free(p1);
  free(ga);
  free(gb);
  free(v);
  return check_summary();
}

/* Batchnorm's statistics on a bf16 wire (a job with batchnorm layers):
 * variances of 1 + 0.75 * 2^-7, which bf16 rounds up to 1 + 2^-7, then
 * variances of 0. With error feedback there, the second push would carry
 * 0 - 2^-9 and be refused as a negative variance (checked first: the
 * hazard is real); with ps_client_set_moving the statistics keep no
 * residual, and both pushes are applied. */
static int check_moving(const char *addr) {
  ps_moving_range mr[PS_MAX_MOVING_RANGES];
  for (int fixed = 0; fixed <= 1; fixed++) {
    char err[PS_ERRLEN] = "";
    ps_job job;
    ps_client *c = client_of(addr, &job);
    if (!c) return 1;
    const int n = ps_model_moving_ranges(&job.model, mr);
    CHECK_MSG(job.wire == PS_WIRE_BF16 && n > 0, "the moving check needs a bf16 job with batchnorm");
    if (fixed) ps_client_set_moving(c, mr, n);
    size_t P = ps_client_param_count(c);
    float *g = calloc(P, sizeof *g), *p = calloc(P, sizeof *p);
    uint64_t *v = calloc((size_t)ps_client_num_shards(c), sizeof *v);
    for (int r = 0; r < n; r++)
      for (size_t i = 0; i < mr[r].count; i++) g[mr[r].off + i] = mr[r].nonneg ? 1.0f + 0.75f * 0x1p-7f : 0.0f;
    int rc = ps_client_pull(c, p, v, NULL, err);
    if (rc == PS_OK) rc = ps_client_push(c, g, v, 1, 1, NULL, err);
    CHECK_MSG(rc == PS_OK, "first push: %s", err);
    for (int r = 0; r < n; r++)
      if (mr[r].nonneg) memset(g + mr[r].off, 0, mr[r].count * sizeof *g);
    rc = ps_client_push(c, g, v, 2, 1, NULL, err);
    if (!fixed) {
      CHECK_MSG(rc != PS_OK && strstr(err, "cannot be negative") != NULL,
                "with error feedback on the statistics the second push should be refused: %s",
                rc == PS_OK ? "it was applied" : err);
      printf("moving: with error feedback on them: %s\n", err);
    } else {
      CHECK_MSG(rc == PS_OK, "second push: %s", err);
      const float *res = ps_client_residual(c);
      int zero = 1;
      for (int r = 0; r < n; r++)
        for (size_t i = 0; i < mr[r].count; i++) zero &= res[mr[r].off + i] == 0.0f;
      CHECK_MSG(zero, "a residual kept for a statistic");
      printf("moving: without: both pushes applied, no residual kept for %d ranges\n", n);
    }
    ps_client_leave(c);
    ps_client_destroy(c);
    free(g), free(p), free(v);
  }
  return check_summary();
}

int main(int argc, char **argv) {
  int overflow = argc == 4 && strcmp(argv[3], "overflow") == 0;
  int residual = argc == 4 && strcmp(argv[3], "residual") == 0;
  int moving = argc == 4 && strcmp(argv[3], "moving") == 0;
  if ((argc != 3 && !overflow && !residual && !moving) || ps_wire_parse(argv[2], &job_wire) != 0) {
    fprintf(stderr, "usage: wire16_check HOST:PORT fp32|bf16|fp16 [overflow|residual|moving]\n");
    return 2;
  }
  char err[PS_ERRLEN], detail[PS_ERRLEN];
  const char *token_file = getenv("PS_TOKEN_FILE");
  if (token_file && ps_token_load(token_file, &token, NULL, err) != 0) {
    fprintf(stderr, "wire16_check: %s\n", err);
    return 1;
  }
  rpc_global_init();
  if (residual || moving) {
    int rc = residual ? check_residual(argv[1]) : check_moving(argv[1]);
    rpc_global_shutdown();
    return rc;
  }
  C.ch = rpc_channel_create(argv[1], NULL, err);
  C.q = rpc_queue_create();
  if (!C.ch || !C.q) {
    fprintf(stderr, "wire16_check: %s\n", err);
    return 1;
  }
  int st = raw_register(&C, &token, "worker", "wire16-check", NULL, &me, detail);
  if (st != RPC_OK) {
    fprintf(stderr, "wire16_check: Register: %s %s\n", rpc_status_name(st), detail);
    return 1;
  }
  char wire[16];
  uint64_t push0 = 0, pull0 = 0, push1 = 0, pull1 = 0;
  if (status(wire, sizeof wire, &push0, &pull0) != 0) return 1;
  CHECK_MSG(strcmp(wire, ps_wire_name(job_wire)) == 0, "Status says wire '%s', expected %s", wire,
            ps_wire_name(job_wire));
  printf("shard of a %s job, range [%llu, +%llu)\n", wire, (unsigned long long)C.range_off,
         (unsigned long long)C.range_cnt);

  size_t len0 = 0, len1 = 0, n = C.range_cnt;
  uint64_t v0 = 0, v1 = 0;
  uint8_t *before = snapshot(&len0, &v0);
  if (!before) return 1;
  float *g = calloc(n + 2, sizeof *g);
  uint16_t *h = calloc(n + 2, sizeof *h);
  for (size_t i = 0; i < n; i++) g[i] = 0.01f;
  ps_wire other16 = job_wire == PS_WIRE_BF16 ? PS_WIRE_FP16 : PS_WIRE_BF16;
  uint8_t *ignored = NULL;
  size_t ignored_len = 0;
  int enc = -1;
  uint64_t ver = 0;

  /* The encoding is not the job's: refused before anything is read,
   * naming the job's. */
  if (job_wire == PS_WIRE_FP32) {
    ps_half_encode(PS_WIRE_BF16, g, h, n);
    RAW_EXPECT("bf16 push to a float32 job", push_as(PS_WIRE_BF16, n, h, 2 * n, detail),
               RPC_FAILED_PRECONDITION, "travel as bf16");
    expect_names_job("bf16 push", detail);
    RAW_EXPECT("fp16 pull from a float32 job",
               pull_as(PS_WIRE_FP16, &ignored, &ignored_len, &enc, &ver, detail),
               RPC_FAILED_PRECONDITION, "travel as fp16");
    expect_names_job("fp16 pull", detail);
    /* the right length for float32 too: the encoding alone is refused */
    RAW_EXPECT("bf16 push of float32 bytes", push_as(PS_WIRE_BF16, n, g, 4 * n, detail),
               RPC_FAILED_PRECONDITION, "travel as bf16");
  } else {
    ps_half_encode(job_wire, g, h, n);
    RAW_EXPECT("float32 push to a 16-bit job", push_as(PS_WIRE_FP32, n, g, 4 * n, detail),
               RPC_FAILED_PRECONDITION, "travel as fp32");
    expect_names_job("float32 push", detail);
    RAW_EXPECT("float32 pull from a 16-bit job",
               pull_as(PS_WIRE_FP32, &ignored, &ignored_len, &enc, &ver, detail),
               RPC_FAILED_PRECONDITION, "travel as fp32");
    expect_names_job("float32 pull", detail);
    RAW_EXPECT("the other 16-bit encoding", push_as(other16, n, h, 2 * n, detail),
               RPC_FAILED_PRECONDITION, ps_wire_name(other16));
    expect_names_job("other 16-bit push", detail);
    RAW_EXPECT("an encoding that does not exist", push_as(7, n, h, 2 * n, detail),
               RPC_FAILED_PRECONDITION, "unknown (encoding 7)");
    /* The job's encoding with the wrong number of bytes. */
    RAW_EXPECT("odd byte count", push_as(job_wire, n, h, 2 * n - 1, detail), RPC_INVALID_ARGUMENT,
               "bytes, expected");
    RAW_EXPECT("float32 bytes saying 16-bit", push_as(job_wire, n, g, 4 * n, detail),
               RPC_INVALID_ARGUMENT, "bytes, expected");
    RAW_EXPECT("count one more than the values", push_as(job_wire, n + 1, h, 2 * n, detail),
               RPC_OUT_OF_RANGE, "outside");
    RAW_EXPECT("count one less than the values", push_as(job_wire, n - 1, h, 2 * n, detail),
               RPC_INVALID_ARGUMENT, "bytes, expected");
    /* NaN and Inf codes. */
    uint16_t inf = ps_half_nonfinite_bits(job_wire);
    h[n / 2] = (uint16_t)(inf | 1); /* a signalling NaN */
    RAW_EXPECT("a NaN code", push_as(job_wire, n, h, 2 * n, detail), RPC_INVALID_ARGUMENT, "NaN");
    h[n / 2] = h[0];
    h[n - 1] = (uint16_t)(inf | 0x8000);
    RAW_EXPECT("a -Inf code", push_as(job_wire, n, h, 2 * n, detail), RPC_INVALID_ARGUMENT, "-Inf");
    h[n - 1] = h[0];
  }
  free(ignored);

  uint8_t *after = snapshot(&len1, &v1);
  CHECK(after != NULL);
  CHECK_MSG(v1 == v0, "version moved from %llu to %llu", (unsigned long long)v0,
            (unsigned long long)v1);
  int same = after && len1 == len0 && memcmp(before, after, len0) == 0;
  CHECK_MSG(same, "parameters changed after bad input");
  printf("after the bad requests: version %llu, parameters %s\n", (unsigned long long)v1,
         same ? "byte-identical" : "CHANGED");
  free(after);

  /* A good push changes them: the comparison above can fail. */
  if (job_wire == PS_WIRE_FP32)
    st = push_as(PS_WIRE_FP32, n, g, 4 * n, detail);
  else
    st = push_as(job_wire, n, h, 2 * n, detail);
  CHECK_MSG(st == RPC_OK, "good push: %s %s", rpc_status_name(st), detail);
  after = snapshot(&len1, &v1);
  CHECK(v1 == v0 + 1);
  CHECK(after && memcmp(before, after, len0) != 0);
  printf("after a good push: version %llu, parameters changed\n", (unsigned long long)v1);
  free(after);

  /* Status counted every Push request's bytes, the refused ones too, and
   * every Pull answer's. */
  if (status(wire, sizeof wire, &push1, &pull1) == 0) {
    size_t vb = ps_wire_value_bytes(job_wire);
    CHECK_MSG(push1 - push0 > (job_wire == PS_WIRE_FP32 ? 3 : 9) * n * 2, "push_bytes grew by %llu",
              (unsigned long long)(push1 - push0));
    CHECK_MSG(pull1 - pull0 >= 3 * n * vb && pull1 - pull0 < 3 * (n * vb + 64),
              "pull_bytes grew by %llu for 3 pulls of %zu bytes",
              (unsigned long long)(pull1 - pull0), n * vb);
    printf("Status: wire %s, push_bytes +%llu, pull_bytes +%llu\n", wire,
           (unsigned long long)(push1 - push0), (unsigned long long)(pull1 - pull0));
  }
  /* overflow: drive parameters past fp16's range (momentum, gradients of
   * -65504) until a pull carries Inf codes: the shard's rule for values it
   * cannot encode, which the worker then refuses (run_tests.sh wire16). */
  if (overflow) {
    CHECK(job_wire == PS_WIRE_FP16);
    for (size_t i = 0; i < n; i++) h[i] = ps_fp16_from_float(-65504.0f);
    int got_inf = 0;
    for (int k = 0; k < 200 && !got_inf; k++) {
      st = push_as(job_wire, n, h, 2 * n, detail);
      CHECK_MSG(st == RPC_OK, "push %d: %s %s", k, rpc_status_name(st), detail);
      if (st != RPC_OK) break;
      uint8_t *b = snapshot(&len1, &v1);
      if (!b) break;
      got_inf = ps_half_max_bits((const ps_uhalf *)(const void *)b, n) >= 0x7c00;
      free(b);
      if (got_inf)
        printf("after %d pushes a pull carries Inf codes (parameters beyond 65504)\n", k + 1);
    }
    CHECK_MSG(got_inf, "the parameters never left fp16's range");
  }
  free(before);
  free(g);
  free(h);
  rpc_queue_destroy(C.q);
  rpc_channel_destroy(C.ch);
  rpc_global_shutdown();
  return check_summary();
}

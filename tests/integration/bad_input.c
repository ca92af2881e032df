/* Sends bad input to a running ps-server over gRPC and checks that each
 * gets a clear error and that the shard's parameters are byte-for-byte
 * unchanged afterwards; then checks that a good push does change them (so
 * the comparison can fail).
 *
 *   bad_input HOST:PORT     (shard 0 of a fresh job, no other workers) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rpc.h"
#include "../../common/util.h"
#include "../../common/wire.h"
#include "../unit/check.h"
#include "proto/ps.pb-c.h"

static rpc_channel *ch;
static rpc_queue *q;
static uint64_t worker_id;
static char job_id[64];
static uint64_t range_off, range_cnt;

/* Sends raw bytes to a method; returns the status; detail gets the message. */
static int send_raw(const char *method, const void *bytes, size_t len, char *detail,
                    uint8_t **resp, size_t *resp_len) {
  rpc_msg m = {.nseg = 1};
  m.seg[0] = (rpc_seg){.ptr = bytes, .len = len};
  uint8_t *r = NULL;
  size_t rl = 0;
  int st = rpc_call_sync(q, ch, method, &m, 10000, 1, &r, &rl, detail);
  if (resp) {
    *resp = r;
    *resp_len = rl;
  } else {
    free(r);
  }
  return st;
}

static int send_msg(const char *method, const ProtobufCMessage *hdr, const void *tensor,
                    size_t tbytes, char *detail, uint8_t **resp, size_t *resp_len) {
  rpc_msg m;
  if (wire_encode(hdr, tensor, tbytes, NULL, NULL, &m) != 0) return -1;
  uint8_t *r = NULL;
  size_t rl = 0;
  int st = rpc_call_sync(q, ch, method, &m, 10000, 1, &r, &rl, detail);
  if (resp) {
    *resp = r;
    *resp_len = rl;
  } else {
    free(r);
  }
  return st;
}

static void header(Ps__RequestHeader *h, uint32_t version, const char *jid, uint64_t wid) {
  ps__request_header__init(h);
  h->protocol_version = version;
  h->job_id = (char *)jid;
  h->worker_id = wid;
}

/* Pulls the shard's range; returns the values (malloc'd) and version. */
static float *pull(uint64_t *version) {
  Ps__RequestHeader h;
  header(&h, PS_PROTOCOL_VERSION, job_id, worker_id);
  Ps__PullRequest req = PS__PULL_REQUEST__INIT;
  req.header = &h;
  req.offset = range_off;
  req.count = range_cnt;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = send_msg("/ps.ParameterServer/Pull", &req.base, NULL, 0, detail, &resp, &len);
  CHECK_MSG(st == RPC_OK, "pull: %s %s", rpc_status_name(st), detail);
  if (st != RPC_OK) return NULL;
  ps_seg seg = {resp, len}, tseg[2];
  ps_segview v = {&seg, 1, len}, tensor;
  char err[PS_ERRLEN];
  ProtobufCMessage *m = wire_decode(&ps__pull_response__descriptor, &v, tseg, 2, &tensor, err);
  CHECK(m != NULL);
  float *vals = malloc(range_cnt * sizeof(float));
  CHECK(tensor.total == range_cnt * sizeof(float));
  ps_segview_copy(&tensor, 0, vals, range_cnt * sizeof(float));
  *version = ((Ps__PullResponse *)m)->version;
  protobuf_c_message_free_unpacked(m, NULL);
  free(resp);
  return vals;
}

static int push(uint32_t version, const char *jid, uint64_t wid, uint64_t off, uint64_t count,
                const float *g, size_t gbytes, char *detail) {
  Ps__RequestHeader h;
  header(&h, version, jid, wid);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = off;
  req.count = count;
  req.batch_size = 1;
  return send_msg("/ps.ParameterServer/Push", &req.base, g, gbytes, detail, NULL, NULL);
}

#define EXPECT(st_expr, code, substr)                                                    \
  do {                                                                                   \
    detail[0] = '\0';                                                                    \
    int st_ = (st_expr);                                                                 \
    CHECK_MSG(st_ == (code) && strstr(detail, substr) != NULL,                           \
              "got %s '%s', want %s containing '%s'", rpc_status_name(st_), detail,      \
              rpc_status_name(code), substr);                                            \
    printf("  %-44s -> %s: %s\n", #code, rpc_status_name(st_), detail);                 \
  } while (0)

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: bad_input HOST:PORT\n");
    return 2;
  }
  char err[PS_ERRLEN], detail[PS_ERRLEN];
  rpc_global_init();
  ch = rpc_channel_create(argv[1], NULL, err);
  q = rpc_queue_create();
  if (!ch || !q) {
    fprintf(stderr, "bad_input: %s\n", err);
    return 1;
  }
  /* Register. */
  Ps__RequestHeader h;
  header(&h, PS_PROTOCOL_VERSION, "", 0);
  Ps__RegisterRequest rr = PS__REGISTER_REQUEST__INIT;
  rr.header = &h;
  rr.host = "bad-input-test";
  rr.role = "worker";
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = send_msg("/ps.ParameterServer/Register", &rr.base, NULL, 0, detail, &resp, &len);
  if (st != RPC_OK) {
    fprintf(stderr, "bad_input: Register: %s %s\n", rpc_status_name(st), detail);
    return 1;
  }
  Ps__RegisterResponse *reg = ps__register_response__unpack(NULL, len, resp);
  free(resp);
  worker_id = reg->worker_id;
  snprintf(job_id, sizeof job_id, "%s", reg->job_id);
  range_off = reg->range_offset;
  range_cnt = reg->range_count;
  ps__register_response__free_unpacked(reg, NULL);
  printf("registered as %016llx; shard range [%llu, +%llu)\n", (unsigned long long)worker_id,
         (unsigned long long)range_off, (unsigned long long)range_cnt);

  uint64_t v0 = 0, v1 = 0;
  float *before = pull(&v0);
  if (!before) return 1;
  size_t n = range_cnt, nb = n * sizeof(float);
  float *g = calloc(n + 1, sizeof(float));
  for (size_t i = 0; i < n; i++) g[i] = 0.01f;

  /* 1. bytes that are not a protobuf message */
  const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  EXPECT(send_raw("/ps.ParameterServer/Push", garbage, sizeof garbage, detail, NULL, NULL),
         RPC_INVALID_ARGUMENT, "malformed");
  /* a length that runs past the end */
  const uint8_t truncated[] = {0x7a, 0x80, 0x80, 0x04, 1, 2, 3};
  EXPECT(send_raw("/ps.ParameterServer/Push", truncated, sizeof truncated, detail, NULL, NULL),
         RPC_INVALID_ARGUMENT, "malformed");
  /* 2. wrong length: count n, one value short */
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb - 4, detail),
         RPC_INVALID_ARGUMENT, "bytes");
  /* 3. range outside the shard */
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off + n, n, g, nb, detail),
         RPC_OUT_OF_RANGE, "outside");
  /* 4. NaN and Inf somewhere in the middle */
  g[n / 2] = NAN;
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb, detail),
         RPC_INVALID_ARGUMENT, "NaN");
  g[n / 2] = 0.01f;
  g[n - 1] = -INFINITY;
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb, detail),
         RPC_INVALID_ARGUMENT, "Inf");
  g[n - 1] = 0.01f;
  /* 5. a worker the shard does not know */
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, 0x1234567ULL, range_off, n, g, nb, detail),
         RPC_NOT_FOUND, "not registered");
  /* 6. another protocol version, another job */
  EXPECT(push(PS_PROTOCOL_VERSION + 1, job_id, worker_id, range_off, n, g, nb, detail),
         RPC_FAILED_PRECONDITION, "protocol version");
  EXPECT(push(PS_PROTOCOL_VERSION, "some-other-job", worker_id, range_off, n, g, nb, detail),
         RPC_FAILED_PRECONDITION, "job id");
  /* 7. a method the server does not have */
  EXPECT(send_raw("/ps.ParameterServer/Explode", garbage, 1, detail, NULL, NULL),
         RPC_UNIMPLEMENTED, "");

  /* 8. a data lease from a job that does not lease its data */
  {
    Ps__RequestHeader lh;
    header(&lh, PS_PROTOCOL_VERSION, job_id, worker_id);
    Ps__LeaseRequest lr = PS__LEASE_REQUEST__INIT;
    lr.header = &lh;
    lr.want_next = 1;
    lr.dataset_size = 100;
    EXPECT(send_msg("/ps.ParameterServer/Lease", &lr.base, NULL, 0, detail, NULL, NULL),
           RPC_FAILED_PRECONDITION, "does not lease its data");
  }

  float *after = pull(&v1);
  CHECK(after != NULL);
  CHECK_MSG(v1 == v0, "version moved from %llu to %llu", (unsigned long long)v0,
            (unsigned long long)v1);
  CHECK_MSG(after && memcmp(before, after, nb) == 0, "parameters changed after bad input");
  printf("after 10 bad requests: version %llu, parameters %s\n", (unsigned long long)v1,
         after && memcmp(before, after, nb) == 0 ? "byte-identical" : "CHANGED");
  free(after);

  /* A good push must change them: proves the comparison above can fail. */
  st = push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb, detail);
  CHECK_MSG(st == RPC_OK, "good push: %s %s", rpc_status_name(st), detail);
  after = pull(&v1);
  CHECK(v1 == v0 + 1);
  CHECK(after && memcmp(before, after, nb) != 0);
  printf("after a good push: version %llu, parameters changed\n", (unsigned long long)v1);
  free(after);
  free(before);
  free(g);
  rpc_queue_destroy(q);
  rpc_channel_destroy(ch);
  rpc_global_shutdown();
  return check_summary();
}

/* Sends bad input to a running ps-server over gRPC and checks that each
 * gets a clear error and that the shard's parameters are byte-for-byte
 * unchanged afterwards; then checks that a good push does change them (so
 * the comparison can fail).
 *
 *   bad_input HOST:PORT     (shard 0 of a fresh job, no other workers) */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/auth.h"
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
/* The job's token (from PS_TOKEN_FILE) and this client's session secret. */
static ps_token token;
static uint8_t session[PS_SESSION_LEN];
static size_t session_len;

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
  h->token = (ProtobufCBinaryData){.len = token.len, .data = token.bytes};
  h->session = (ProtobufCBinaryData){.len = session_len, .data = session};
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

/* Sends m (its tensor copied in) with the first occurrence of `mark` in
 * its bytes replaced by `with` (k bytes each, so the framing holds): a
 * NUL or invalid UTF-8 inside a string, which protobuf-c does not write. */
static int send_patched(const char *method, const ProtobufCMessage *m, const void *tensor,
                        size_t tbytes, const char *mark, const char *with, size_t k, char *detail,
                        uint8_t **resp, size_t *resp_len) {
  rpc_msg msg;
  if (wire_encode(m, tensor, tbytes, NULL, NULL, &msg) != 0 || msg.nseg != 1) return -1;
  size_t len = msg.seg[0].len;
  uint8_t *buf = malloc(len);
  memcpy(buf, msg.seg[0].ptr, len);
  rpc_msg_release(&msg);
  for (size_t i = 0; i + k <= len; i++) {
    if (memcmp(buf + i, mark, k) == 0) {
      memcpy(buf + i, with, k);
      break;
    }
  }
  int st = send_raw(method, buf, len, detail, resp, resp_len);
  free(buf);
  return st;
}

/* A push whose job id goes out as the bytes jid_bytes (as many as jid has)
 * when that is not NULL. */
static int push_patched(uint32_t version, const char *jid, const char *jid_bytes, uint64_t wid,
                        uint64_t off, uint64_t count, const float *g, size_t gbytes,
                        char *detail) {
  Ps__RequestHeader h;
  header(&h, version, jid, wid);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = off;
  req.count = count;
  req.batch_size = 1;
  if (jid_bytes)
    return send_patched("/ps.ParameterServer/Push", &req.base, g, gbytes, jid, jid_bytes,
                        strlen(jid), detail, NULL, NULL);
  return send_msg("/ps.ParameterServer/Push", &req.base, g, gbytes, detail, NULL, NULL);
}

static int push(uint32_t version, const char *jid, uint64_t wid, uint64_t off, uint64_t count,
                const float *g, size_t gbytes, char *detail) {
  return push_patched(version, jid, NULL, wid, off, count, g, gbytes, detail);
}

/* Registers a new worker from `host` (patched as send_patched does when
 * mark is not NULL); returns the status. */
static int register_host(const char *host, const char *mark, const char *with, char *detail) {
  Ps__RequestHeader h;
  header(&h, PS_PROTOCOL_VERSION, "", 0);
  h.session = (ProtobufCBinaryData){0};
  Ps__RegisterRequest rr = PS__REGISTER_REQUEST__INIT;
  rr.header = &h;
  rr.host = (char *)host;
  rr.role = "worker";
  rr.task_index = 77;
  if (!mark) mark = with = host;
  return send_patched("/ps.ParameterServer/Register", &rr.base, NULL, 0, mark, with, strlen(mark),
                      detail, NULL, NULL);
}

/* 1 if s is valid UTF-8 without control characters (C0, DEL, C1). */
static int clean_text(const char *s) {
  size_t n = strlen(s);
  if (ps_utf8_valid_len(s, n) != n) return 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x20 || c == 0x7f || (c == 0xc2 && i + 1 < n && (unsigned char)s[i + 1] < 0xa0))
      return 0;
  }
  return 1;
}

/* Asks for Status and checks that the reply decodes, with protobuf-c and
 * with a decoder that refuses what proto3 libraries refuse (a string that
 * is not valid UTF-8), and that every worker's host and role is clean
 * text. Returns how many hosts equal `want`, or -1. */
static int status_hosts(const char *want) {
  Ps__RequestHeader h;
  header(&h, PS_PROTOCOL_VERSION, job_id, worker_id);
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  char detail[PS_ERRLEN], err[PS_ERRLEN] = "";
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = send_msg("/ps.ParameterServer/Status", &req.base, NULL, 0, detail, &resp, &len);
  CHECK_MSG(st == RPC_OK, "Status: %s %s", rpc_status_name(st), detail);
  if (st != RPC_OK) return -1;
  ps_seg seg = {resp, len}, tseg[1];
  ps_segview v = {&seg, 1, len}, tensor;
  ProtobufCMessage *strict =
      wire_decode(&ps__status_response__descriptor, &v, tseg, 1, &tensor, err);
  CHECK_MSG(strict != NULL, "the Status reply does not decode as proto3: %s", err);
  if (strict) protobuf_c_message_free_unpacked(strict, NULL);
  Ps__StatusResponse *r = ps__status_response__unpack(NULL, len, resp);
  free(resp);
  CHECK(r != NULL);
  if (!r) return -1;
  int same = 0;
  for (size_t i = 0; i < r->n_workers; i++) {
    const Ps__WorkerInfo *w = r->workers[i];
    CHECK_MSG(clean_text(w->host) && clean_text(w->role), "worker %zu: host '%s' role '%s'", i,
              w->host, w->role);
    same += strcmp(w->host, want) == 0;
  }
  ps__status_response__free_unpacked(r, NULL);
  return same;
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
  const char *token_file = getenv("PS_TOKEN_FILE");
  if (token_file && ps_token_load(token_file, &token, NULL, err) != 0) {
    fprintf(stderr, "bad_input: %s\n", err);
    return 1;
  }
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
  session_len = reg->session.len <= sizeof session ? reg->session.len : 0;
  memcpy(session, reg->session.data, session_len);
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

  /* 9. numbers that make no sense: a push and a pull of 0 values, a
   * range whose end wraps around, a tensor that is not count*4 bytes */
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, 0, NULL, 0, detail),
         RPC_INVALID_ARGUMENT, "push of 0 values");
  {
    Ps__RequestHeader ph;
    header(&ph, PS_PROTOCOL_VERSION, job_id, worker_id);
    Ps__PullRequest pr = PS__PULL_REQUEST__INIT;
    pr.header = &ph;
    pr.offset = range_off;
    pr.count = 0;
    EXPECT(send_msg("/ps.ParameterServer/Pull", &pr.base, NULL, 0, detail, NULL, NULL),
           RPC_INVALID_ARGUMENT, "Pull of 0 values");
    pr.offset = range_off + range_cnt;
    pr.count = 1;
    pr.min_version = 1000000; /* would wait, if a range outside could */
    EXPECT(send_msg("/ps.ParameterServer/Pull", &pr.base, NULL, 0, detail, NULL, NULL),
           RPC_OUT_OF_RANGE, "outside shard");
  }
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, UINT64_MAX - 3, 16, g, 64, detail),
         RPC_OUT_OF_RANGE, "overflows");
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb + 2, detail),
         RPC_INVALID_ARGUMENT, "bytes");

  /* 10. a job id with a NUL inside ("<job>\0evil" once read as "<job>"),
   * and one that is not UTF-8: malformed, whatever follows */
  {
    char jid[96], bad[96];
    snprintf(jid, sizeof jid, "%sXevil", job_id);
    snprintf(bad, sizeof bad, "%s", jid);
    bad[strlen(job_id)] = '\0';
    EXPECT(push_patched(PS_PROTOCOL_VERSION, jid, bad, worker_id, range_off, n, g, nb, detail),
           RPC_INVALID_ARGUMENT, "malformed PushRequest: wire: in PushRequest.header, string field "
                                 "RequestHeader.job_id holds a NUL byte");
    bad[strlen(job_id)] = (char)0xff;
    EXPECT(push_patched(PS_PROTOCOL_VERSION, jid, bad, worker_id, range_off, n, g, nb, detail),
           RPC_INVALID_ARGUMENT, "is not valid UTF-8");
  }

  /* 11. host names: not UTF-8 (refused), 70 bytes of multi-byte
   * characters (cut to 61, on a character), newlines and escape sequences
   * (made harmless); the Status reply still decodes, its strings clean */
  EXPECT(register_host("bad-inputX-host", "inputX", "input\xfe", detail), RPC_INVALID_ARGUMENT,
         "RegisterRequest.host is not valid UTF-8");
  {
    char host[80] = "a", cut[80];
    for (int i = 0; i < 23; i++) strcat(host, "\xe2\x82\xac"); /* euro signs: 70 bytes */
    snprintf(cut, sizeof cut, "%.61s", host);
    EXPECT(register_host(host, NULL, NULL, detail), RPC_OK, "");
    EXPECT(register_host("bad-input\n12:00:00.000 ps-server info: forged line\x1b[31m\r", NULL,
                         NULL, detail),
           RPC_OK, "");
    int same = status_hosts(cut);
    CHECK_MSG(same == 1, "%d hosts read the 61-byte cut of the 70-byte host", same);
    printf("  Status after the odd host names: decodes, every host and role clean text\n");
  }

  float *after = pull(&v1);
  CHECK(after != NULL);
  CHECK_MSG(v1 == v0, "version moved from %llu to %llu", (unsigned long long)v0,
            (unsigned long long)v1);
  CHECK_MSG(after && memcmp(before, after, nb) == 0, "parameters changed after bad input");
  printf("after the bad requests: version %llu, parameters %s\n", (unsigned long long)v1,
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

  /* 12. finite gradients that would overflow: with momentum (the job's
   * optimizer) a push of FLT_MAX leaves everything finite (velocity
   * FLT_MAX), a second would make every velocity and parameter infinite.
   * It is refused and changes nothing; a push of zeros afterwards moves the
   * parameters by the velocity kept, and they stay finite (an infinite
   * velocity would make it refused or infinite). */
  for (size_t i = 0; i < n; i++) g[i] = FLT_MAX;
  st = push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb, detail);
  CHECK_MSG(st == RPC_OK, "first FLT_MAX push: %s %s", rpc_status_name(st), detail);
  uint64_t v2 = 0, v3 = 0;
  float *edge = pull(&v2);
  EXPECT(push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb, detail),
         RPC_INVALID_ARGUMENT, "would make parameter");
  after = pull(&v3);
  CHECK_MSG(v3 == v2, "version moved from %llu to %llu", (unsigned long long)v2,
            (unsigned long long)v3);
  CHECK_MSG(edge && after && memcmp(edge, after, nb) == 0, "parameters changed by a refused push");
  free(after);
  memset(g, 0, nb);
  st = push(PS_PROTOCOL_VERSION, job_id, worker_id, range_off, n, g, nb, detail);
  CHECK_MSG(st == RPC_OK, "zero push after the refusal: %s %s", rpc_status_name(st), detail);
  after = pull(&v3);
  int moved = 1;
  for (size_t i = 0; after && edge && i < n; i++) moved &= isfinite(after[i]) && after[i] < edge[i];
  CHECK_MSG(after && moved, "the zero push did not move every parameter down, finitely");
  printf("FLT_MAX twice with momentum: the second refused, parameters byte-identical; "
         "the velocity kept was finite\n");
  free(after);
  free(edge);
  free(before);
  free(g);
  rpc_queue_destroy(q);
  rpc_channel_destroy(ch);
  rpc_global_shutdown();
  return check_summary();
}

/* A client of one shard written from proto/ps.proto, for the tests that
 * play a hostile or careless client (auth_check, bounds_check): every
 * header field is the caller's to choose, nothing is retried, and the
 * shard's answer comes back as it was (status and message). Static
 * functions only. */
#ifndef PS_TESTS_INTEGRATION_RAW_CLIENT_H
#define PS_TESTS_INTEGRATION_RAW_CLIENT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/auth.h"
#include "../../common/rpc.h"
#include "../../common/util.h"
#include "../../common/wire.h"
#include "proto/ps.pb-c.h"

#define RAW_METHOD(name) "/ps.ParameterServer/" name

/* Who a request says it comes from. */
typedef struct {
  uint64_t id;
  uint8_t session[PS_SESSION_LEN];
  size_t session_len;
} raw_identity;

/* The shard, as its Register answers describe it. */
typedef struct {
  rpc_channel *ch;
  rpc_queue *q;
  char job_id[64];
  uint64_t range_off, range_cnt;
  uint64_t base_version; /* what pushes say they were computed from */
  int timeout_ms;
} raw_client;

/* A header with token t and identity who (either may be NULL). */
__attribute__((unused)) static void raw_header(const raw_client *c, Ps__RequestHeader *h,
                                               const ps_token *t, const raw_identity *who) {
  ps__request_header__init(h);
  h->protocol_version = PS_PROTOCOL_VERSION;
  h->job_id = (char *)c->job_id;
  if (t) h->token = (ProtobufCBinaryData){.len = t->len, .data = (uint8_t *)t->bytes};
  if (who) {
    h->worker_id = who->id;
    h->session = (ProtobufCBinaryData){.len = who->session_len, .data = (uint8_t *)who->session};
  }
}

/* One call on channel ch (NULL: the client's); its status, the message in
 * detail (PS_ERRLEN bytes); *resp (may be NULL) the reply, to free. */
__attribute__((unused)) static int raw_call_on(raw_client *c, rpc_channel *ch, const char *method,
                                               const ProtobufCMessage *m, const void *tensor,
                                               size_t tbytes, char *detail, uint8_t **resp,
                                               size_t *resp_len) {
  rpc_msg msg;
  detail[0] = '\0';
  if (wire_encode(m, tensor, tbytes, NULL, NULL, &msg) != 0) return -1;
  uint8_t *r = NULL;
  size_t rl = 0;
  int st = rpc_call_sync(c->q, ch ? ch : c->ch, method, &msg, c->timeout_ms, 1, &r, &rl, detail);
  if (resp) {
    *resp = r;
    *resp_len = rl;
  } else {
    free(r);
  }
  return st;
}

/* Register with token t as role from host; as: the identity it claims (an
 * id registered already, NULL for a new one); *out (may be NULL) the
 * identity granted. Notes the job id and the shard's range. */
__attribute__((unused)) static int raw_register(raw_client *c, const ps_token *t, const char *role,
                                                const char *host, const raw_identity *as,
                                                raw_identity *out, char *detail) {
  Ps__RequestHeader h;
  raw_header(c, &h, t, as);
  Ps__RegisterRequest rr = PS__REGISTER_REQUEST__INIT;
  rr.header = &h;
  rr.host = (char *)host;
  rr.role = (char *)role;
  rr.task_index = -1;
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(c, NULL, RAW_METHOD("Register"), &rr.base, NULL, 0, detail, &resp, &len);
  Ps__RegisterResponse *r = st == RPC_OK ? ps__register_response__unpack(NULL, len, resp) : NULL;
  if (st == RPC_OK && !r) st = -1;
  if (r) {
    if (out) {
      out->id = r->worker_id;
      out->session_len = r->session.len <= PS_SESSION_LEN ? r->session.len : 0;
      if (out->session_len) memcpy(out->session, r->session.data, out->session_len);
    }
    snprintf(c->job_id, sizeof c->job_id, "%s", r->job_id ? r->job_id : "");
    c->range_off = r->range_offset;
    c->range_cnt = r->range_count;
    ps__register_response__free_unpacked(r, NULL);
  }
  free(resp);
  return st;
}

/* A pull of the shard's whole range, once min_version is reached; h is
 * the header it points to. */
__attribute__((unused)) static void raw_pull_request(raw_client *c, Ps__PullRequest *req,
                                                     Ps__RequestHeader *h, const ps_token *t,
                                                     const raw_identity *who,
                                                     uint64_t min_version) {
  raw_header(c, h, t, who);
  ps__pull_request__init(req);
  req->header = h;
  req->offset = c->range_off;
  req->count = c->range_cnt;
  req->min_version = min_version;
}

/* Pulls the shard's whole range once it reaches min_version into vals
 * (may be NULL) and *version. */
__attribute__((unused)) static int raw_pull_min(raw_client *c, const ps_token *t,
                                                const raw_identity *who, uint64_t min_version,
                                                float *vals, uint64_t *version, char *detail) {
  Ps__RequestHeader h;
  Ps__PullRequest req;
  raw_pull_request(c, &req, &h, t, who, min_version);
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(c, NULL, RAW_METHOD("Pull"), &req.base, NULL, 0, detail, &resp, &len);
  if (st == RPC_OK && vals) {
    ps_seg seg = {resp, len}, tseg[2];
    ps_segview v = {&seg, 1, len}, tensor;
    char err[PS_ERRLEN];
    ProtobufCMessage *m = wire_decode(&ps__pull_response__descriptor, &v, tseg, 2, &tensor, err);
    if (!m || tensor.total != c->range_cnt * sizeof(float)) {
      snprintf(detail, PS_ERRLEN, "malformed Pull reply: %.200s", m ? "wrong size" : err);
      st = -1;
    } else {
      ps_segview_copy(&tensor, 0, vals, tensor.total);
      *version = ((Ps__PullResponse *)m)->version;
    }
    if (m) protobuf_c_message_free_unpacked(m, NULL);
  }
  free(resp);
  return st;
}

/* The same, answered at once (min_version 0). */
__attribute__((unused)) static int raw_pull(raw_client *c, const ps_token *t,
                                            const raw_identity *who, float *vals, uint64_t *version,
                                            char *detail) {
  return raw_pull_min(c, t, who, 0, vals, version, detail);
}

/* Pushes count values of g over the shard's range (from its start), said
 * to be computed from c->base_version. */
__attribute__((unused)) static int raw_push(raw_client *c, rpc_channel *ch, const ps_token *t,
                                            const raw_identity *who, const float *g, size_t count,
                                            char *detail) {
  Ps__RequestHeader h;
  raw_header(c, &h, t, who);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = c->range_off;
  req.count = count;
  req.batch_size = 1;
  req.base_version = c->base_version;
  return raw_call_on(c, ch, RAW_METHOD("Push"), &req.base, g, count * sizeof(float), detail, NULL,
                     NULL);
}

/* Starts a pull that waits for min_version, on the client's queue; NULL
 * when it cannot start. Finish it with rpc_wait and rpc_request_free. */
__attribute__((unused)) static rpc_request *raw_pull_start(raw_client *c, const ps_token *t,
                                                           const raw_identity *who,
                                                           uint64_t min_version) {
  Ps__RequestHeader h;
  Ps__PullRequest req;
  raw_pull_request(c, &req, &h, t, who, min_version);
  rpc_msg msg;
  char err[PS_ERRLEN];
  if (wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) != 0) return NULL;
  return rpc_start(c->q, c->ch, RAW_METHOD("Pull"), &msg, c->timeout_ms, 1, err);
}

/* EXPECT(what, status expression, code, substring): checks the status and
 * that the message (in a `detail` buffer in scope) holds the substring,
 * and prints the line. */
#define RAW_EXPECT(what, st_expr, code, substr)                                               \
  do {                                                                                        \
    int st_ = (st_expr);                                                                      \
    CHECK_MSG(st_ == (code) && strstr(detail, substr) != NULL,                                \
              "%s: got %s '%s', want %s containing '%s'", what, rpc_status_name(st_), detail, \
              rpc_status_name(code), substr);                                                 \
    printf("  %-50.50s -> %s: %.60s\n", what, rpc_status_name(st_), detail);                  \
  } while (0)

#endif

/* Trust on a live shard served over mutual TLS with a job token and a
 * read-only token: every request without the right secret is refused with
 * the right code and changes nothing (the shard's parameter bytes, version
 * and registered workers are compared before and after); a good push then
 * does change them, so the comparison can fail. Also the transport: a
 * client that trusts another CA, one without a client certificate, and a
 * plaintext one get no answer at all.
 *
 *   auth_check HOST:PORT DIR OTHER_DIR
 * DIR holds what deploy/certs.sh made for the server (ca.pem, token,
 * localhost.pem/.key for this client) and DIR/read-token the read-only
 * token; OTHER_DIR another CA's certificates. */
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

typedef raw_identity identity;
static raw_client C = {.timeout_ms = 10000};
static ps_token token, read_token, wrong_token;

static void header(Ps__RequestHeader *h, const ps_token *t, const identity *who) {
  raw_header(&C, h, t, who);
}

static int call_on(rpc_channel *c, const char *method, const ProtobufCMessage *m, const void *tensor,
                   size_t tbytes, char *detail, uint8_t **resp, size_t *resp_len, int timeout_ms) {
  raw_client shorter = C;
  shorter.timeout_ms = timeout_ms;
  return raw_call_on(&shorter, c, method, m, tensor, tbytes, detail, resp, resp_len);
}

static int call(const char *method, const ProtobufCMessage *m, const void *tensor, size_t tbytes,
                char *detail, uint8_t **resp, size_t *resp_len) {
  return raw_call_on(&C, NULL, method, m, tensor, tbytes, detail, resp, resp_len);
}

static int do_register(const ps_token *t, const char *role, const char *host, const identity *as,
                       identity *out, char *detail) {
  return raw_register(&C, t, role, host, as, out, detail);
}

static int do_pull(const ps_token *t, const identity *who, float *vals, uint64_t *version,
                   char *detail) {
  return raw_pull(&C, t, who, vals, version, detail);
}

static int do_push(const ps_token *t, const identity *who, const float *g, char *detail) {
  return raw_push(&C, NULL, t, who, g, C.range_cnt, detail);
}

static int do_simple(const char *method, const ps_token *t, const identity *who, char *detail) {
  Ps__RequestHeader h;
  header(&h, t, who);
  if (!strcmp(method, M("Lease"))) {
    Ps__LeaseRequest r = PS__LEASE_REQUEST__INIT;
    r.header = &h;
    r.want_next = 1;
    r.dataset_size = 2048;
    return call(method, &r.base, NULL, 0, detail, NULL, NULL);
  }
  if (!strcmp(method, M("Heartbeat"))) {
    Ps__HeartbeatRequest r = PS__HEARTBEAT_REQUEST__INIT;
    r.header = &h;
    return call(method, &r.base, NULL, 0, detail, NULL, NULL);
  }
  if (!strcmp(method, M("Leave"))) {
    Ps__LeaveRequest r = PS__LEAVE_REQUEST__INIT;
    r.header = &h;
    return call(method, &r.base, NULL, 0, detail, NULL, NULL);
  }
  Ps__StatusRequest r = PS__STATUS_REQUEST__INIT;
  r.header = &h;
  return call(method, &r.base, NULL, 0, detail, NULL, NULL);
}

/* The shard's Status (with the job token): workers and their hosts. */
static Ps__StatusResponse *status(void) {
  Ps__RequestHeader h;
  header(&h, &token, NULL);
  Ps__StatusRequest r = PS__STATUS_REQUEST__INIT;
  r.header = &h;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = call(M("Status"), &r.base, NULL, 0, detail, &resp, &len);
  CHECK_MSG(st == RPC_OK, "Status: %s %s", rpc_status_name(st), detail);
  Ps__StatusResponse *s = st == RPC_OK ? ps__status_response__unpack(NULL, len, resp) : NULL;
  free(resp);
  return s;
}

#define EXPECT(st_expr, code, substr)                                                        \
  do {                                                                                       \
    detail[0] = '\0';                                                                        \
    int st_ = (st_expr);                                                                     \
    CHECK_MSG(st_ == (code) && strstr(detail, substr) != NULL,                               \
              "%s: got %s '%s', want %s containing '%s'", #st_expr, rpc_status_name(st_),     \
              detail, rpc_status_name(code), substr);                                        \
    printf("  %-58.58s -> %s\n", #st_expr, rpc_status_name(st_));                           \
  } while (0)

/* A channel with these TLS files (any may be NULL; all NULL: plaintext). */
static rpc_channel *channel(const char *addr, const char *ca, const char *cert, const char *key) {
  char err[PS_ERRLEN];
  rpc_tls tls = {.ca_file = ca, .cert_file = cert, .key_file = key};
  rpc_channel_opts o = {.tls = ca || cert ? &tls : NULL};
  rpc_channel *c = rpc_channel_create(addr, &o, err);
  if (!c) fprintf(stderr, "auth_check: %s\n", err);
  return c;
}

static void load(const char *dir, const char *name, ps_token *t) {
  char path[512], err[PS_ERRLEN];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if (ps_token_load(path, t, NULL, err) != 0) {
    fprintf(stderr, "auth_check: %s\n", err);
    exit(1);
  }
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: auth_check HOST:PORT DIR OTHER_DIR\n");
    return 2;
  }
  const char *addr = argv[1], *dir = argv[2], *other = argv[3];
  char detail[PS_ERRLEN], ca[512], cert[512], key[512], oca[512], ocert[512], okey[512];
  snprintf(ca, sizeof ca, "%s/ca.pem", dir);
  snprintf(cert, sizeof cert, "%s/localhost.pem", dir);
  snprintf(key, sizeof key, "%s/localhost.key", dir);
  snprintf(oca, sizeof oca, "%s/ca.pem", other);
  snprintf(ocert, sizeof ocert, "%s/localhost.pem", other);
  snprintf(okey, sizeof okey, "%s/localhost.key", other);
  load(dir, "token", &token);
  load(dir, "read-token", &read_token);
  wrong_token = token;
  wrong_token.bytes[0] ^= 1;
  rpc_global_init();
  C.ch = channel(addr, ca, cert, key);
  C.q = rpc_queue_create();
  if (!C.ch || !C.q) return 1;

  /* Transport first (before the workers' registrations could time out):
   * another CA, no client certificate, plaintext get no answer. */
  rpc_channel *bad[3] = {channel(addr, oca, ocert, okey), channel(addr, ca, NULL, NULL),
                         channel(addr, NULL, NULL, NULL)};
  const char *bad_name[3] = {"a client of another CA", "no client certificate", "plaintext"};
  for (int i = 0; i < 3; i++) {
    Ps__RequestHeader h;
    header(&h, &token, NULL);
    Ps__StatusRequest r = PS__STATUS_REQUEST__INIT;
    r.header = &h;
    int st = bad[i] ? call_on(bad[i], M("Status"), &r.base, NULL, 0, detail, NULL, NULL, 3000)
                    : RPC_OK;
    CHECK_MSG(st == RPC_UNAVAILABLE || st == RPC_DEADLINE_EXCEEDED, "%s: got %s '%s'",
              bad_name[i], rpc_status_name(st), detail);
    printf("  %-58s -> %s\n", bad_name[i], rpc_status_name(st));
    rpc_channel_destroy(bad[i]);
  }

  /* Two workers with the job token. */
  identity a = {0}, b = {0};
  EXPECT(do_register(&token, "worker", "host-a", NULL, &a, detail), RPC_OK, "");
  EXPECT(do_register(&token, "worker", "host-b", NULL, &b, detail), RPC_OK, "");
  CHECK(a.id != 0 && b.id != 0 && a.id != b.id && a.session_len == PS_SESSION_LEN);
  CHECK(memcmp(a.session, b.session, PS_SESSION_LEN) != 0);
  printf("registered a=%016" PRIx64 " b=%016" PRIx64 "\n", a.id, b.id);

  float *before = malloc(C.range_cnt * sizeof(float)), *after = malloc(C.range_cnt * sizeof(float));
  float *g = malloc(C.range_cnt * sizeof(float));
  for (size_t i = 0; i < C.range_cnt; i++) g[i] = 0.5f;
  uint64_t v0 = 0, v1 = 0;
  CHECK(do_pull(&token, &a, before, &v0, detail) == RPC_OK);
  Ps__StatusResponse *s0 = status();

  printf("refused, and nothing changes:\n");
  /* No token, a wrong token: every method. */
  static const char *methods[] = {M("Heartbeat"), M("Leave"), M("Lease"), M("Status")};
  EXPECT(do_register(NULL, "worker", "x", NULL, NULL, detail), RPC_UNAUTHENTICATED, "token");
  EXPECT(do_register(&wrong_token, "worker", "x", NULL, NULL, detail), RPC_UNAUTHENTICATED,
         "token");
  EXPECT(do_pull(NULL, &a, NULL, NULL, detail), RPC_UNAUTHENTICATED, "token");
  EXPECT(do_push(NULL, &a, g, detail), RPC_UNAUTHENTICATED, "token");
  EXPECT(do_push(&wrong_token, &a, g, detail), RPC_UNAUTHENTICATED, "token");
  for (int i = 0; i < 4; i++) {
    EXPECT(do_simple(methods[i], NULL, &a, detail), RPC_UNAUTHENTICATED, "token");
    EXPECT(do_simple(methods[i], &wrong_token, &a, detail), RPC_UNAUTHENTICATED, "token");
  }
  /* The job token but another worker's identity: b acting for a, with
   * its own session or none. */
  identity a_by_b = {.id = a.id, .session_len = b.session_len};
  memcpy(a_by_b.session, b.session, b.session_len);
  identity a_bare = {.id = a.id};
  EXPECT(do_push(&token, &a_by_b, g, detail), RPC_UNAUTHENTICATED, "session");
  EXPECT(do_push(&token, &a_bare, g, detail), RPC_UNAUTHENTICATED, "session");
  EXPECT(do_pull(&token, &a_by_b, NULL, NULL, detail), RPC_UNAUTHENTICATED, "session");
  EXPECT(do_simple(M("Leave"), &token, &a_by_b, detail), RPC_UNAUTHENTICATED, "session");
  EXPECT(do_simple(M("Heartbeat"), &token, &a_bare, detail), RPC_UNAUTHENTICATED, "session");
  EXPECT(do_simple(M("Lease"), &token, &a_by_b, detail), RPC_UNAUTHENTICATED, "session");
  /* Registering a's id again without its session: no take-over. */
  EXPECT(do_register(&token, "chief", "evil", &a_by_b, NULL, detail), RPC_ALREADY_EXISTS,
         "session");
  EXPECT(do_register(&token, "chief", "evil", &a_bare, NULL, detail), RPC_ALREADY_EXISTS,
         "session");
  /* The read-only token: an evaluator may register and pull, nothing more. */
  identity e = {0};
  EXPECT(do_register(&read_token, "worker", "ro", NULL, NULL, detail), RPC_PERMISSION_DENIED,
         "evaluator");
  EXPECT(do_register(&read_token, "evaluator", "ro", NULL, &e, detail), RPC_OK, "");
  EXPECT(do_pull(&read_token, &e, NULL, NULL, detail), RPC_OK, "");
  EXPECT(do_simple(M("Status"), &read_token, NULL, detail), RPC_OK, "");
  EXPECT(do_push(&read_token, &e, g, detail), RPC_PERMISSION_DENIED, "read-only");
  EXPECT(do_push(&token, &e, g, detail), RPC_PERMISSION_DENIED, "read-only");
  EXPECT(do_simple(M("Lease"), &token, &e, detail), RPC_PERMISSION_DENIED, "read-only");
  EXPECT(do_simple(M("Leave"), &read_token, &e, detail), RPC_OK, "");
  /* An evaluator with the job token reads only too. */
  identity e2 = {0};
  EXPECT(do_register(&token, "evaluator", "ev", NULL, &e2, detail), RPC_OK, "");
  EXPECT(do_push(&token, &e2, g, detail), RPC_PERMISSION_DENIED, "evaluator");
  EXPECT(do_simple(M("Leave"), &token, &e2, detail), RPC_OK, "");
  /* Nothing changed: the parameters, the version, who is registered. */
  CHECK(do_pull(&token, &a, after, &v1, detail) == RPC_OK);
  CHECK_MSG(v1 == v0 && memcmp(before, after, C.range_cnt * sizeof(float)) == 0,
            "the refused requests changed the shard: version %" PRIu64 " -> %" PRIu64, v0, v1);
  Ps__StatusResponse *s1 = status();
  CHECK(s0 && s1 && s0->n_workers == 2 && s1->n_workers == 2);
  for (size_t i = 0; s1 && i < s1->n_workers; i++) {
    Ps__WorkerInfo *w = s1->workers[i];
    CHECK_MSG(strcmp(w->host, "evil") != 0 && strcmp(w->role, "chief") != 0,
              "worker %zu was taken over: host %s role %s", i, w->host, w->role);
    /* Ids are not published in full. */
    CHECK((w->worker_id & 0xffffffffu) == 0);
    CHECK(w->worker_id == (a.id & 0xffffffff00000000u) || w->worker_id == (b.id & 0xffffffff00000000u));
  }
  if (s0) ps__status_response__free_unpacked(s0, NULL);
  if (s1) ps__status_response__free_unpacked(s1, NULL);
  /* ... while the right secrets work: a's push changes the shard. */
  EXPECT(do_push(&token, &a, g, detail), RPC_OK, "");
  CHECK(do_pull(&token, &a, after, &v1, detail) == RPC_OK);
  CHECK_MSG(v1 == v0 + 1 && memcmp(before, after, C.range_cnt * sizeof(float)) != 0,
            "a good push did not change the shard (version %" PRIu64 " -> %" PRIu64 ")", v0, v1);
  EXPECT(do_simple(M("Leave"), &token, &a, detail), RPC_OK, "");
  EXPECT(do_simple(M("Leave"), &token, &b, detail), RPC_OK, "");

  free(before);
  free(after);
  free(g);
  rpc_queue_destroy(C.q);
  rpc_channel_destroy(C.ch);
  rpc_global_shutdown();
  return check_summary();
}

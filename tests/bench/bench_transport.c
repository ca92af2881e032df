/* Transport benchmark: one worker pulls and pushes a whole shard to one
 * ps-server on loopback, through the same client the worker uses (parallel
 * sharded pull/push, tensor bytes straight between buffers and gRPC
 * slices).
 *
 *   bench_transport HOST:PORT [ROUNDS] [CA CERT KEY]
 * With CA, CERT and KEY (PEM files), over mutual TLS; else plaintext. The
 * job's token comes from PS_TOKEN_FILE. Prints the median time of a pull
 * and of a push and the GB/s of parameter data each way, as JSON on the
 * last line. */
#include <stdio.h>
#include <stdlib.h>

#include "../../common/rpc.h"
#include "../../common/security.h"
#include "../../common/util.h"
#include "../../worker/ps_client.h"

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: bench_transport HOST:PORT [ROUNDS] [CA CERT KEY]\n");
    return 2;
  }
  int rounds = argc > 2 ? atoi(argv[2]) : 10;
  if (rounds < 1 || rounds > 1000) rounds = 10;
  char err[PS_ERRLEN];
  rpc_global_init();
  ps_security_opts so = {.insecure = argc < 6};
  if (argc >= 6) {
    so.tls_ca = argv[3];
    so.tls_cert = argv[4];
    so.tls_key = argv[5];
  }
  ps_security sec;
  if (ps_security_resolve(&so, PS_SECURITY_CLIENT, &sec, err) != 0) {
    fprintf(stderr, "bench_transport: %s\n", err);
    return 2;
  }
  ps_client_opts o = {.host = "bench", .role = "worker", .task_index = -1, .timeout_ms = 60000,
                      .token = &sec.token, .tls = ps_security_tls(&sec)};
  ps_client *c = ps_client_connect(argv[1], &o, err);
  if (!c) {
    fprintf(stderr, "bench_transport: %s\n", err);
    return 1;
  }
  size_t P = ps_client_param_count(c);
  float *params = ps_alloc(P * sizeof(float)), *grads = ps_alloc(P * sizeof(float));
  uint64_t *versions = calloc((size_t)ps_client_num_shards(c), sizeof(uint64_t));
  double *tpull = calloc((size_t)rounds, sizeof(double)), *tpush = calloc((size_t)rounds, sizeof(double));
  if (!params || !grads || !versions || !tpull || !tpush) return 1;
  for (size_t i = 0; i < P; i++) grads[i] = 1e-6f * (float)(i % 7);
  /* one warm-up round: connections, first snapshot */
  if (ps_client_pull(c, params, versions, NULL, err) != 0 ||
      ps_client_push(c, grads, versions, 0, 1, NULL, err) != 0) {
    fprintf(stderr, "bench_transport: %s\n", err);
    return 1;
  }
  for (int r = 0; r < rounds; r++) {
    double t0 = ps_now_s();
    if (ps_client_pull(c, params, versions, NULL, err) != 0) break;
    double t1 = ps_now_s();
    if (ps_client_push(c, grads, versions, (uint64_t)r + 1, 1, NULL, err) != 0) break;
    double t2 = ps_now_s();
    tpull[r] = t1 - t0;
    tpush[r] = t2 - t1;
  }
  qsort(tpull, (size_t)rounds, sizeof(double), cmp_double);
  qsort(tpush, (size_t)rounds, sizeof(double), cmp_double);
  double mpull = tpull[rounds / 2], mpush = tpush[rounds / 2];
  double bytes = (double)P * sizeof(float);
  printf("%zu float32 values (%.1f MB), %d rounds: pull %.1f ms (%.2f GB/s), push %.1f ms "
         "(%.2f GB/s, optimizer applied on the server included)\n",
         P, bytes / 1e6, rounds, mpull * 1e3, bytes / mpull / 1e9, mpush * 1e3,
         bytes / mpush / 1e9);
  printf("{\"values\": %zu, \"pull_ms\": %.2f, \"push_ms\": %.2f, \"pull_gbps\": %.3f, "
         "\"push_gbps\": %.3f}\n",
         P, mpull * 1e3, mpush * 1e3, bytes / mpull / 1e9, bytes / mpush / 1e9);
  ps_client_leave(c);
  ps_client_destroy(c);
  ps_free(params);
  ps_free(grads);
  free(versions);
  free(tpull);
  free(tpush);
  rpc_global_shutdown();
  return 0;
}

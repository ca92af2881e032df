/* Transport benchmark: one worker pulls and pushes a whole shard to one
 * ps-server on loopback, through the same client the worker uses (parallel
 * sharded pull/push, tensor bytes straight between buffers and gRPC
 * slices, values in the job's "wire" encoding).
 *
 *   bench_transport [--compare HOST2:PORT2] HOST:PORT [ROUNDS] [CA CERT KEY]
 * With CA, CERT and KEY (PEM files), over mutual TLS; else plaintext. The
 * job's token comes from PS_TOKEN_FILE. Prints the median time of a pull
 * and of a push and the GB/s of parameter data each way (counted as
 * float32 values, whatever the wire: the rate at which parameters move),
 * as JSON on the last line. With --compare, a second server (a job of the
 * same size, typically another "wire") is measured in the same run, its
 * rounds alternating with the first's so that the shared machine's noise
 * hits both alike, and the last line also holds the second's times and
 * their ratios to the first's (per round, then the median). For a 16-bit
 * job it also times the client's conversions of the whole vector (encode
 * with error feedback, decode). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/half.h"
#include "../../common/job.h"
#include "../../common/rpc.h"
#include "../../common/security.h"
#include "../../common/util.h"
#include "worker/client/ps_client.h"

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  return v[n / 2];
}

/* One server's job, its client and buffers, and the times measured. */
typedef struct {
  const char *addr;
  ps_client *c;
  ps_wire wire;
  size_t P;
  float *params, *grads;
  uint64_t *versions;
  double *tpull, *tpush;
} target;

static int open_target(target *t, const char *addr, const ps_client_opts *o, int rounds,
                       char *err) {
  memset(t, 0, sizeof *t);
  t->addr = addr;
  t->c = ps_client_connect(addr, o, err);
  if (!t->c) return -1;
  /* The client speaks the job's encoding, as ps-worker does. */
  ps_job job;
  if (ps_job_parse(ps_client_job_json(t->c), &job, err) != 0 ||
      ps_client_set_wire(t->c, job.wire, err) != 0)
    return -1;
  t->wire = job.wire;
  t->P = ps_client_param_count(t->c);
  t->params = ps_alloc(t->P * sizeof(float));
  t->grads = ps_alloc(t->P * sizeof(float));
  t->versions = calloc((size_t)ps_client_num_shards(t->c), sizeof(uint64_t));
  t->tpull = calloc((size_t)rounds, sizeof(double));
  t->tpush = calloc((size_t)rounds, sizeof(double));
  if (!t->params || !t->grads || !t->versions || !t->tpull || !t->tpush)
    return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (size_t i = 0; i < t->P; i++) t->grads[i] = 1e-6f * (float)(i % 7);
  /* one warm-up round: connections, first snapshot */
  if (ps_client_pull(t->c, t->params, t->versions, NULL, err) != 0 ||
      ps_client_push(t->c, t->grads, t->versions, 0, 1, NULL, err) != 0)
    return -1;
  return 0;
}

static int round_of(target *t, int r, char *err) {
  double t0 = ps_now_s();
  if (ps_client_pull(t->c, t->params, t->versions, NULL, err) != 0) return -1;
  double t1 = ps_now_s();
  if (ps_client_push(t->c, t->grads, t->versions, (uint64_t)r + 1, 1, NULL, err) != 0) return -1;
  double t2 = ps_now_s();
  t->tpull[r] = t1 - t0;
  t->tpush[r] = t2 - t1;
  return 0;
}

static void close_target(target *t) {
  if (t->c) {
    ps_client_leave(t->c);
    ps_client_destroy(t->c);
  }
  ps_free(t->params);
  ps_free(t->grads);
  free(t->versions);
  free(t->tpull);
  free(t->tpush);
}

/* The client's share of a 16-bit round: encoding the whole gradient with
 * error feedback, and decoding the whole parameter vector (median ms of
 * 5). */
static void time_conversions(const target *t, double *enc_ms, double *dec_ms) {
  float *res = ps_alloc(t->P * sizeof(float)), *out = ps_alloc(t->P * sizeof(float));
  uint16_t *h = ps_alloc(t->P * sizeof(uint16_t));
  double e[5], d[5];
  for (int k = 0; k < 5; k++) {
    double t0 = ps_now_s();
    ps_half_encode_feedback(t->wire, t->grads, res, h, t->P);
    double t1 = ps_now_s();
    ps_half_decode(t->wire, h, out, t->P);
    double t2 = ps_now_s();
    e[k] = (t1 - t0) * 1e3;
    d[k] = (t2 - t1) * 1e3;
  }
  *enc_ms = median(e, 5);
  *dec_ms = median(d, 5);
  ps_free(res);
  ps_free(out);
  ps_free(h);
}

int main(int argc, char **argv) {
  ps_malloc_tune(); /* as ps-worker does */
  const char *compare = NULL;
  if (argc > 2 && strcmp(argv[1], "--compare") == 0) {
    compare = argv[2];
    argc -= 2;
    argv += 2;
  }
  if (argc < 2) {
    fprintf(stderr,
            "usage: bench_transport [--compare HOST2:PORT2] HOST:PORT [ROUNDS] [CA CERT KEY]\n");
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
  ps_client_opts o = {.host = "bench",
                      .role = "worker",
                      .task_index = -1,
                      .timeout_ms = 60000,
                      .token = &sec.token,
                      .tls = ps_security_tls(&sec)};
  target t[2];
  int nt = compare ? 2 : 1;
  memset(t, 0, sizeof t);
  for (int i = 0; i < nt; i++)
    if (open_target(&t[i], i ? compare : argv[1], &o, rounds, err) != 0) {
      fprintf(stderr, "bench_transport: %s: %s\n", i ? compare : argv[1], err);
      return 1;
    }
  if (nt == 2 && t[1].P != t[0].P) {
    fprintf(stderr, "bench_transport: %s holds %zu values, %s %zu: compare jobs of one size\n",
            t[0].addr, t[0].P, t[1].addr, t[1].P);
    return 1;
  }
  /* Alternating: round r of the first, then round r of the second. */
  for (int r = 0; r < rounds; r++)
    for (int i = 0; i < nt; i++)
      if (round_of(&t[i], r, err) != 0) {
        fprintf(stderr, "bench_transport: %s: %s\n", t[i].addr, err);
        return 1;
      }
  double rpull[1000], rpush[1000];
  for (int r = 0; nt == 2 && r < rounds; r++) {
    rpull[r] = t[1].tpull[r] / t[0].tpull[r];
    rpush[r] = t[1].tpush[r] / t[0].tpush[r];
  }
  double mpull[2], mpush[2], enc_ms[2] = {0}, dec_ms[2] = {0};
  double bytes = (double)t[0].P * sizeof(float);
  for (int i = 0; i < nt; i++) {
    mpull[i] = median(t[i].tpull, rounds);
    mpush[i] = median(t[i].tpush, rounds);
    if (t[i].wire != PS_WIRE_FP32) time_conversions(&t[i], &enc_ms[i], &dec_ms[i]);
    printf(
        "%s: %zu values as %s (%.1f MB on the wire), %d rounds: pull %.1f ms (%.2f GB/s of "
        "float32 parameters), push %.1f ms (%.2f GB/s, optimizer applied on the server "
        "included)",
        t[i].addr, t[i].P, ps_wire_name(t[i].wire),
        (double)t[i].P * (double)ps_wire_value_bytes(t[i].wire) / 1e6, rounds, mpull[i] * 1e3,
        bytes / mpull[i] / 1e9, mpush[i] * 1e3, bytes / mpush[i] / 1e9);
    if (t[i].wire != PS_WIRE_FP32)
      printf(
          "; the client's conversions of the whole vector: encode with error feedback %.1f ms, "
          "decode %.1f ms",
          enc_ms[i], dec_ms[i]);
    printf("\n");
  }
  if (nt == 2) {
    double qpull = median(rpull, rounds), qpush = median(rpush, rounds);
    printf("%s / %s, median of the per-round ratios: pull x%.3f, push x%.3f, round trip x%.3f\n",
           ps_wire_name(t[1].wire), ps_wire_name(t[0].wire), qpull, qpush,
           (mpull[1] + mpush[1]) / (mpull[0] + mpush[0]));
    printf(
        "{\"values\": %zu, \"pull_ms\": %.2f, \"push_ms\": %.2f, \"pull_gbps\": %.3f, "
        "\"push_gbps\": %.3f, \"wire\": \"%s\", \"compare_wire\": \"%s\", "
        "\"compare_pull_ms\": %.2f, \"compare_push_ms\": %.2f, \"pull_ratio\": %.4f, "
        "\"push_ratio\": %.4f, \"compare_encode_ms\": %.2f, \"compare_decode_ms\": %.2f}\n",
        t[0].P, mpull[0] * 1e3, mpush[0] * 1e3, bytes / mpull[0] / 1e9, bytes / mpush[0] / 1e9,
        ps_wire_name(t[0].wire), ps_wire_name(t[1].wire), mpull[1] * 1e3, mpush[1] * 1e3, qpull,
        qpush, enc_ms[1], dec_ms[1]);
  } else {
    printf(
        "{\"values\": %zu, \"pull_ms\": %.2f, \"push_ms\": %.2f, \"pull_gbps\": %.3f, "
        "\"push_gbps\": %.3f, \"wire\": \"%s\"}\n",
        t[0].P, mpull[0] * 1e3, mpush[0] * 1e3, bytes / mpull[0] / 1e9, bytes / mpush[0] / 1e9,
        ps_wire_name(t[0].wire));
  }
  for (int i = 0; i < nt; i++) close_target(&t[i]);
  rpc_global_shutdown();
  return 0;
}

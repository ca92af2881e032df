/* Embedding rows against dense values on the wire: one worker's client
 * pulls and pushes IDS distinct rows of a table (dim 16, then dim 64) to a
 * ps-server, and, in the same run with rounds alternating, a dense shard
 * holding about the same number of values (IDS x dim) to another, so that
 * both move the same bytes of values per round. The push includes the
 * optimizer's update on the server (lazy Adagrad per row; SGD over the
 * dense range).
 *
 *   bench_rows ROWS_ADDR DENSE16_ADDR DENSE64_ADDR [ROUNDS] [IDS]
 *
 * ROWS_ADDR serves a job with two tables (0: dim 16, 1: dim 64) and a
 * small dense model; DENSE16/DENSE64 jobs of about IDS x 16 and IDS x 64
 * dense values. Each round's ids are new: a keyed permutation of the
 * table's ids (so distinct), as a batch of fresh click-log rows would be.
 * Prints rows/s and GB/s of values each way, the ratio of the rows' rate to
 * the dense rate (per value byte, medians of the rounds), and JSON on the
 * last line. The job token comes from PS_TOKEN_FILE. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/emb.h"
#include "../../common/job.h"
#include "../../common/rpc.h"
#include "../../common/security.h"
#include "../../common/util.h"
#include "worker/client/ps_client.h"

/* The pause after a table's first pass. */
#define SETTLE_MS 3000

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
  double *c = malloc((size_t)n * sizeof *c);
  memcpy(c, v, (size_t)n * sizeof *c);
  qsort(c, (size_t)n, sizeof(double), cmp_double);
  double m = c[n / 2];
  free(c);
  return m;
}

typedef struct {
  const char *addr;
  ps_client *c;
  ps_job *job;
  size_t P;
  float *params, *grads;
  uint64_t *versions;
} target;

static int open_target(target *t, const char *addr, const ps_client_opts *o, char *err) {
  memset(t, 0, sizeof *t);
  t->addr = addr;
  t->c = ps_client_connect(addr, o, err);
  if (!t->c) return -1;
  t->job = malloc(sizeof *t->job);
  if (!t->job || ps_job_parse(ps_client_job_json(t->c), t->job, err) != 0) return -1;
  t->P = ps_client_param_count(t->c);
  t->params = ps_alloc(t->P * sizeof(float));
  t->grads = ps_alloc(t->P * sizeof(float));
  t->versions = calloc((size_t)ps_client_num_shards(t->c), sizeof(uint64_t));
  if (!t->params || !t->grads || !t->versions) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (size_t i = 0; i < t->P; i++) t->grads[i] = 1e-6f * (float)(i % 7);
  return 0;
}

static int round_trip(target *t, uint64_t step, double *tpull, double *tpush, char *err) {
  double t0 = ps_now_s();
  if (ps_client_pull(t->c, t->params, t->versions, NULL, err) != 0) return -1;
  double t1 = ps_now_s();
  if (ps_client_push(t->c, t->grads, t->versions, step, 1, NULL, err) != 0) return -1;
  *tpull = t1 - t0;
  *tpush = ps_now_s() - t1;
  return 0;
}

int main(int argc, char **argv) {
  ps_malloc_tune();
  if (argc < 4) {
    fprintf(stderr, "usage: bench_rows ROWS_ADDR DENSE16_ADDR DENSE64_ADDR [ROUNDS] [IDS]\n");
    return 2;
  }
  int rounds = argc > 4 ? atoi(argv[4]) : 20;
  if (rounds < 1 || rounds > 1000) rounds = 20;
  size_t ids_n = argc > 5 ? (size_t)atol(argv[5]) : 10000;
  if (ids_n < 1 || ids_n > 1000000) ids_n = 10000;
  char err[PS_ERRLEN];
  rpc_global_init();
  ps_security_opts so = {.insecure = 1};
  ps_security sec;
  if (ps_security_resolve(&so, PS_SECURITY_CLIENT, &sec, err) != 0) {
    fprintf(stderr, "bench_rows: %s\n", err);
    return 2;
  }
  ps_client_opts o = {.host = "bench", .role = "worker", .task_index = -1, .timeout_ms = 60000,
                      .token = &sec.token};
  target rows, dense[2];
  if (open_target(&rows, argv[1], &o, err) != 0 || open_target(&dense[0], argv[2], &o, err) != 0 ||
      open_target(&dense[1], argv[3], &o, err) != 0) {
    fprintf(stderr, "bench_rows: %s\n", err);
    return 1;
  }
  if (rows.job->n_tables != 2) {
    fprintf(stderr, "bench_rows: %s: its job needs two tables (dim 16 and dim 64)\n", argv[1]);
    return 1;
  }
  uint64_t *ids = malloc(ids_n * sizeof *ids);
  size_t maxd = (size_t)rows.job->tables[1].dim;
  float *vals = malloc(ids_n * maxd * sizeof(float)), *g = malloc(ids_n * maxd * sizeof(float));
  for (size_t i = 0; i < ids_n * maxd; i++) g[i] = 1e-3f * (float)((i % 11) - 5);
  double *rp = calloc((size_t)rounds, sizeof(double)), *rq = calloc((size_t)rounds, sizeof(double));
  double *dp = calloc((size_t)rounds, sizeof(double)), *dq = calloc((size_t)rounds, sizeof(double));
  printf("bench_rows: %zu distinct ids per request, %d rounds each, alternating with a dense "
         "shard of about as many values\n",
         ids_n, rounds);
  char json[1024] = "{";
  double worst = 1e9;
  for (int k = 0; k < 2; k++) {
    const ps_table_spec *ts = &rows.job->tables[k];
    const size_t d = (size_t)ts->dim;
    target *dt = &dense[k];
    uint64_t step = 1;
    /* warm-up of both */
    double a, b;
    ps_client_rows rsec = {k, ids, ids_n, vals, g};
    /* The rounds draw from a working set of W ids spread over the table,
     * each round a different slice of a permutation of it (distinct ids);
     * a first pass over the whole set (timed apart: rows pushed for the
     * first time) makes every row of it, as a click log's hot rows are. */
    const uint64_t W = 20 * (uint64_t)ids_n < ts->rows ? 20 * (uint64_t)ids_n : ts->rows;
    const uint64_t key = 1000 + 7919 * (uint64_t)k;
    double fresh_pull = 0, fresh_push = 0;
    int fresh_rounds = 0;
    for (uint64_t at = 0; at < W; at += ids_n, fresh_rounds++) {
      for (size_t i = 0; i < ids_n; i++)
        ids[i] = ps_perm_forward(key, ts->rows, ps_perm_forward(key + 1, W, (at + i) % W));
      double c2, d2;
      if (ps_client_set_rows(rows.c, &rsec, 1, err) != 0 ||
          round_trip(&rows, step++, &a, &b, err) || round_trip(dt, step++, &c2, &d2, err)) {
        fprintf(stderr, "bench_rows: %s\n", err);
        return 1;
      }
      fresh_pull += a;
      fresh_push += b;
    }
    printf("dim %zu: first pass over a working set of %" PRIu64 " rows (rows made): pull %.2f ms, "
           "push %.2f ms per %zu rows\n",
           d, W, fresh_pull / fresh_rounds * 1e3, fresh_push / fresh_rounds * 1e3, ids_n);
    /* A table's arena above 512 MiB that has become dense is collapsed
     * into huge pages by a thread of the shard's, once (ps/state/table.c,
     * arena_dense): the rounds measure the steady state after it. */
    ps_sleep_ms(SETTLE_MS);
    for (int r = 0; r < rounds; r++) {
      for (size_t i = 0; i < ids_n; i++)
        ids[i] = ps_perm_forward(key, ts->rows,
                                 ps_perm_forward(key + 2 + (uint64_t)r, W, i));
      if (ps_client_set_rows(rows.c, &rsec, 1, err) != 0 ||
          round_trip(&rows, step++, &rp[r], &rq[r], err) != 0 ||
          round_trip(dt, step++, &dp[r], &dq[r], err) != 0) {
        fprintf(stderr, "bench_rows: %s\n", err);
        return 1;
      }
    }
    double mrp = median(rp, rounds), mrq = median(rq, rounds);
    double mdp = median(dp, rounds), mdq = median(dq, rounds);
    double rbytes = (double)ids_n * (double)d * 4, dbytes = (double)dt->P * 4;
    /* Value bytes per second, rows against dense. */
    double pull_ratio = (rbytes / mrp) / (dbytes / mdp), push_ratio = (rbytes / mrq) / (dbytes / mdq);
    if (pull_ratio < worst) worst = pull_ratio;
    if (push_ratio < worst) worst = push_ratio;
    printf("dim %zu: rows: pull %.2f ms (%.2f M rows/s, %.3f GB/s of values), push %.2f ms (%.2f "
           "M rows/s, %.3f GB/s); dense %zu values: pull %.2f ms (%.3f GB/s), push %.2f ms "
           "(%.3f GB/s); rows / dense (bytes/s): pull x%.3f, push x%.3f\n",
           d, mrp * 1e3, (double)ids_n / mrp / 1e6, rbytes / mrp / 1e9, mrq * 1e3,
           (double)ids_n / mrq / 1e6, rbytes / mrq / 1e9, dt->P, mdp * 1e3, dbytes / mdp / 1e9,
           mdq * 1e3, dbytes / mdq / 1e9, pull_ratio, push_ratio);
    size_t l = strlen(json);
    snprintf(json + l, sizeof json - l,
             "%s\"dim%zu\": {\"rows_pull_ms\": %.3f, \"rows_push_ms\": %.3f, \"dense_values\": "
             "%zu, \"dense_pull_ms\": %.3f, \"dense_push_ms\": %.3f, \"pull_ratio\": %.4f, "
             "\"push_ratio\": %.4f, \"pull_rows_per_s\": %.0f, \"push_rows_per_s\": %.0f}",
             k ? ", " : "", d, mrp * 1e3, mrq * 1e3, dt->P, mdp * 1e3, mdq * 1e3, pull_ratio,
             push_ratio, (double)ids_n / mrp, (double)ids_n / mrq);
  }
  size_t l = strlen(json);
  snprintf(json + l, sizeof json - l, ", \"ids\": %zu, \"worst_ratio\": %.4f}", ids_n, worst);
  printf("%s\n", json);
  ps_client_set_rows(rows.c, NULL, 0, err);
  target *all[3] = {&rows, &dense[0], &dense[1]};
  for (int i = 0; i < 3; i++) {
    ps_client_leave(all[i]->c);
    ps_client_destroy(all[i]->c);
    ps_free(all[i]->params);
    ps_free(all[i]->grads);
    free(all[i]->versions);
    free(all[i]->job);
  }
  free(ids), free(vals), free(g), free(rp), free(rq), free(dp), free(dq);
  rpc_global_shutdown();
  return 0;
}

/* The flat C API (worker/client/ps_capi.h) from C, against live servers of
 * tests/python/capi_run.py's job (a flat model: tensors a (10, 50)
 * uniform:0.1 and b (500) constant 0.25, SGD lr 1, table emb (1000 rows,
 * dim 4), leases of 100 of 1000 examples, 2 shards), so that a sanitized
 * build checks the library's memory: every call, its errors and messages,
 * pull and push exact, rows, leases, the heartbeat thread, Status.
 *   capi_check SERVERS   (PS_TOKEN_FILE: the job's token) */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/client/ps_capi.h"

static int failures;
#define CHECK(c)                                                                           \
  do {                                                                                     \
    if (!(c)) {                                                                            \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #c, \
              ps_capi_last_error());                                                       \
      failures++;                                                                          \
    }                                                                                      \
  } while (0)

enum { P = 1000 };

static ps_capi_worker *connect_ok(const char *servers) {
  ps_capi_worker *w = NULL;
  int rc =
      ps_capi_connect(servers, NULL, NULL, NULL, NULL, 1, "capi-host", NULL, 3, 5000, 10000, 1, &w);
  CHECK(rc == 0 && w);
  return w;
}

/* Refusals: each with its code, a message, no handle. */
static void check_refusals(const char *servers) {
  ps_capi_worker *w = (ps_capi_worker *)1;
  /* A token file that does not exist. */
  int rc = ps_capi_connect(servers, "/nonexistent/token", NULL, NULL, NULL, 1, NULL, NULL, -1, 1000,
                           1000, 0, &w);
  CHECK(rc < 0 && w == NULL && strstr(ps_capi_last_error(), "/nonexistent/token"));
  /* A wrong token: the server's UNAUTHENTICATED, quoted. */
  char path[] = "/tmp/capi-token-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0 && write(fd, "wrong-token-but-long-enough\n", 28) == 28);
  close(fd);
  rc = ps_capi_connect(servers, path, NULL, NULL, NULL, 1, NULL, NULL, -1, 2000, 2000, 0, &w);
  CHECK(rc < 0 && w == NULL && strstr(ps_capi_last_error(), "UNAUTHENTICATED"));
  unlink(path);
  /* Nothing listening: unavailable after the connect timeout. */
  rc = ps_capi_connect("127.0.0.1:1", NULL, NULL, NULL, NULL, 1, NULL, NULL, -1, 300, 300, 0, &w);
  CHECK(rc == -9 && w == NULL && strlen(ps_capi_last_error()) > 0);
  CHECK(strcmp(ps_capi_strerror(-9), ps_capi_strerror(-1)) != 0);
}

static void check_layout(ps_capi_worker *w) {
  CHECK(ps_capi_param_count(w) == P && ps_capi_num_shards(w) == 2 && ps_capi_mode(w) == 0);
  CHECK(strstr(ps_capi_job_json(w), "py-capi") != NULL);
  char desc[256];
  ps_capi_describe(w, desc, sizeof desc);
  CHECK(strstr(desc, "flat") && strstr(desc, "P=1000"));
  uint64_t off, cnt, total = 0;
  for (int s = 0; s < 2; s++) {
    CHECK(ps_capi_shard_range(w, s, &off, &cnt) == 0 && off == total);
    total += cnt;
  }
  CHECK(total == P && ps_capi_shard_range(w, 2, &off, &cnt) < 0);
  CHECK(ps_capi_num_tensors(w) == 2);
  char name[8]; /* short: the name is cut, not overrun */
  int nd;
  int64_t shape[PS_CAPI_MAX_DIMS];
  CHECK(ps_capi_tensor(w, 0, name, sizeof name, &off, &cnt, &nd, shape) == 0);
  CHECK(!strcmp(name, "a") && off == 0 && cnt == 500 && nd == 2 && shape[0] == 10 &&
        shape[1] == 50);
  CHECK(ps_capi_tensor(w, 1, name, sizeof name, &off, &cnt, &nd, shape) == 0);
  CHECK(!strcmp(name, "b") && off == 500 && cnt == 500 && nd == 1);
  CHECK(ps_capi_tensor(w, 2, name, sizeof name, &off, &cnt, &nd, shape) == -4);
  uint64_t rows;
  int dim;
  CHECK(ps_capi_num_tables(w) == 1 && ps_capi_table(w, 0, name, sizeof name, &rows, &dim) == 0);
  CHECK(!strcmp(name, "emb") && rows == 1000 && dim == 4);
  CHECK(ps_capi_table(w, 1, name, sizeof name, &rows, &dim) == -4);
}

/* SGD with lr 1: a push of g takes g off every value, exactly once. */
static void check_pull_push(ps_capi_worker *w) {
  float *p0 = malloc(P * sizeof *p0), *p1 = malloc(P * sizeof *p1), *g = malloc(P * sizeof *g);
  CHECK(ps_capi_pull(w, p0, P, 1) == 0);
  int in_range = 1;
  for (int i = 0; i < 500; i++) in_range &= fabsf(p0[i]) <= 0.1f;
  for (int i = 500; i < P; i++) in_range &= p0[i] == 0.25f;
  CHECK(in_range);
  CHECK(ps_capi_pull(w, p0, P - 1, 1) == -1 && strstr(ps_capi_last_error(), "999"));
  CHECK(ps_capi_pull(w, NULL, P, 1) == -1);
  for (int i = 0; i < P; i++) g[i] = 0.125f * (float)(i % 3);
  uint64_t ssum = 9, smax = 9, v[2];
  int dropped = 9;
  uint64_t step = ps_capi_step(w);
  CHECK(ps_capi_push(w, g, P, 10, &ssum, &smax, &dropped) == 0);
  CHECK(ssum == 0 && smax == 0 && dropped == 0 && ps_capi_step(w) == step + 1);
  CHECK(ps_capi_push_pending(w) == 0);
  CHECK(ps_capi_pull(w, p1, P, 1) == 0 && ps_capi_versions(w, v, 2) == 0);
  int exact = 1;
  for (int i = 0; i < P; i++) exact &= p1[i] == p0[i] - g[i];
  CHECK(exact);
  /* A retry of a round every shard applied sends nothing again. */
  CHECK(ps_capi_push_retry(w, g, P, NULL, NULL, NULL) == 0);
  uint64_t v2[2];
  CHECK(ps_capi_pull(w, p0, P, 1) == 0 && ps_capi_versions(w, v2, 2) == 0);
  CHECK(v2[0] == v[0] && v2[1] == v[1] && memcmp(p0, p1, P * sizeof *p0) == 0);
  /* A NaN is refused by the shard holding it, with its message; the
   * other shard applies the round (its version moves, the NaN's does not). */
  g[P - 1] = NAN;
  CHECK(ps_capi_push(w, g, P, 10, NULL, NULL, NULL) == -6);
  CHECK(strstr(ps_capi_last_error(), "INVALID_ARGUMENT") != NULL);
  CHECK(ps_capi_push_pending(w) == 1);
  CHECK(ps_capi_pull(w, p1, P, 1) == 0 && ps_capi_versions(w, v2, 2) == 0);
  CHECK(v2[0] == v[0] + 1 && v2[1] == v[1] && p1[P - 1] == p0[P - 1]);
  free(p0);
  free(p1);
  free(g);
}

static void check_rows(ps_capi_worker *w) {
  float *params = malloc(P * sizeof *params), *g = calloc(P, sizeof *g);
  const uint64_t ids[3] = {5, 999, 17};
  float values[12] = {0}, grads[12];
  for (int i = 0; i < 12; i++) grads[i] = 0.5f;
  const int tables[1] = {0};
  const uint64_t *idp[1] = {ids};
  const uint64_t counts[1] = {3};
  float *vals[1] = {values};
  const float *grds[1] = {grads};
  CHECK(ps_capi_set_rows(w, 1, tables, idp, counts, vals, grds) == 0);
  CHECK(ps_capi_pull(w, params, P, 1) == 0);
  float before[12];
  memcpy(before, values, sizeof before);
  int nonzero = 0;
  for (int i = 0; i < 12; i++) nonzero |= values[i] != 0.0f;
  CHECK(nonzero); /* uniform:0.05 rows */
  CHECK(ps_capi_push(w, g, P, 3, NULL, NULL, NULL) == 0);
  CHECK(ps_capi_pull(w, params, P, 1) == 0);
  int exact = 1;
  for (int i = 0; i < 12; i++) exact &= values[i] == before[i] - 0.5f;
  CHECK(exact);
  const uint64_t bad[1] = {1000};
  const uint64_t *badp[1] = {bad};
  const uint64_t one[1] = {1};
  CHECK(ps_capi_set_rows(w, 1, tables, badp, one, vals, grds) == -4);
  CHECK(strstr(ps_capi_last_error(), "1000") != NULL);
  const int no_table[1] = {3};
  CHECK(ps_capi_set_rows(w, 1, no_table, idp, counts, vals, grds) == -1);
  CHECK(ps_capi_set_rows(w, 0, NULL, NULL, NULL, NULL, NULL) == 0);
  free(params);
  free(g);
}

/* One epoch of 1000 examples in chunks of 100: every example once. */
static void check_leases(ps_capi_worker *w) {
  int seen[1000] = {0}, status, epoch, counted;
  uint64_t lease = 0, id, begin;
  uint32_t count;
  for (int k = 0; k < 20; k++) {
    CHECK(ps_capi_lease(w, lease, 1, 1000, &status, &id, &epoch, &begin, &count, &counted) == 0);
    CHECK(!lease || counted);
    if (status == 2) break;
    CHECK(status == 0 && count == 100 && begin + count <= 1000);
    for (uint64_t i = begin; status == 0 && i < begin + count; i++) seen[i]++;
    lease = status == 0 ? id : 0;
    CHECK(ps_capi_heartbeat(w) == 0); /* naming the lease held */
  }
  int once = 1;
  for (int i = 0; i < 1000; i++) once &= seen[i] == 1;
  CHECK(once && status == 2);
  ps_capi_set_idle(w, 1);
  ps_capi_set_idle(w, 0);
}

static void check_status(ps_capi_worker *w, const char *servers) {
  char *json = NULL;
  CHECK(ps_capi_worker_status(w, 3000, &json) == 0 && json);
  CHECK(json && strstr(json, "\"shard_index\":1") && strstr(json, "capi-host"));
  ps_capi_free(json);
  json = NULL;
  CHECK(ps_capi_status(servers, NULL, NULL, NULL, NULL, 1, 3000, &json) == 0 && json);
  CHECK(json && strstr(json, "\"job_id\":\"py-capi\""));
  ps_capi_free(json);
  json = NULL;
  CHECK(ps_capi_status("127.0.0.1:1", NULL, NULL, NULL, NULL, 1, 300, &json) == 0 && json);
  CHECK(json && strstr(json, "\"error\""));
  ps_capi_free(json);
  CHECK(ps_capi_status("not an address", NULL, NULL, NULL, NULL, 1, 300, &json) < 0);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: capi_check SERVERS\n");
    return 2;
  }
  CHECK(ps_capi_version() == PS_CAPI_VERSION && !strcmp(ps_capi_last_error(), ""));
  ps_capi_set_log_level(2);
  check_refusals(argv[1]);
  ps_capi_worker *w = connect_ok(argv[1]);
  if (!w) return 1;
  check_layout(w);
  check_pull_push(w);
  check_rows(w);
  check_leases(w);
  usleep(1200 * 1000); /* the heartbeat thread beats (1 s of a 3 s timeout) */
  check_status(w, argv[1]);
  ps_capi_close(w, 1);
  ps_capi_close(NULL, 1);
  if (failures)
    fprintf(stderr, "capi_check: %d check(s) failed\n", failures);
  else
    printf("capi_check: every check passed\n");
  return failures ? 1 : 0;
}

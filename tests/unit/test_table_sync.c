/* Embedding rows in sync mode (ps/state/table_sync.c through the shard's hooks):
 * two workers' rows with overlapping ids make one step with the mean
 * gradient, bit for bit against the optimizer itself; a late (dropped)
 * gradient's rows are not applied; a NaN row, a sum that would overflow
 * and a step that would make a row non-finite leave everything as it was;
 * a snapshot of the sum (each/put) gives the same step. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/emb.h"
#include "../../common/optim.h"
#include "../../common/util.h"
#include "ps/state/table.h"
#include "ps/state/table_sync.h"
#include "check.h"
#include "shard_fixture.h"

/* 4x4 inputs, dense 2: P = 16*2 + 2 = 34. */
static const char *SPEC =
    "{\"input\": [1, 4, 4], \"classes\": 2, \"layers\": ["
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 2},"
    "{\"type\": \"softmax_xent\"}]}";

enum { T_ADAM = 0, T_SGD = 1, NT = 2, DIM_A = 4, DIM_S = 2 };

typedef struct {
  ps_job job;
  ps_shard *shard;
  ps_table_spec spec[NT];
  ps_optim_config optim[NT];
  ps_table *tb[NT];
  ps_rows_sum *sum;
  size_t n;     /* dense values */
  float *dense; /* a dense gradient (n) */
} fixture;

static void fx_init(fixture *f, float sgd_lr) {
  char err[PS_ERRLEN];
  memset(f, 0, sizeof *f);
  f->job = fixture_job("test-table-sync", SPEC, "sgd", 1);
  f->shard = fixture_shard(&f->job, 0, 1);
  f->n = fixture_shard_len(f->shard);
  f->dense = malloc(f->n * sizeof(float));
  for (size_t i = 0; i < f->n; i++) f->dense[i] = 0.01f * (float)(i % 7);
  const char *names[NT] = {"emb_adam", "emb_sgd"};
  const uint64_t rows[NT] = {1000, 0};
  const int dims[NT] = {DIM_A, DIM_S};
  for (int t = 0; t < NT; t++) {
    ps_table_spec *sp = &f->spec[t];
    snprintf(sp->name, sizeof sp->name, "%s", names[t]);
    sp->rows = rows[t];
    sp->dim = dims[t];
    sp->init = PS_TABLE_INIT_UNIFORM;
    sp->init_scale = 0.05f;
    sp->max_rows_per_shard = 1000;
    sp->key = ps_table_key(names[t]);
  }
  f->optim[T_ADAM] =
      (ps_optim_config){.name = "adam", .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
  f->optim[T_SGD] = (ps_optim_config){.name = "sgd", .lr = sgd_lr};
  for (int t = 0; t < NT; t++) {
    f->tb[t] = ps_table_create(&f->spec[t], &f->optim[t], f->job.seed, 0, 1, err);
    CHECK_MSG(f->tb[t] != NULL, "%s", err);
  }
  f->sum = ps_rows_sum_create(f->tb, NT);
  CHECK(f->sum != NULL);
  ps_shard_sync_rows h;
  ps_rows_sum_hooks(f->sum, &h);
  ps_shard_set_sync_rows(f->shard, &h);
}

static void fx_free(fixture *f) {
  ps_shard_destroy(f->shard);
  ps_rows_sum_destroy(f->sum);
  for (int t = 0; t < NT; t++) ps_table_destroy(f->tb[t]);
  free(f->dense);
}

/* One worker's push: the dense gradient and rows of both tables. */
static int push(fixture *f, uint64_t worker, uint64_t base, const uint64_t *ida, size_t na,
                const float *ga, const uint64_t *ids, size_t ns, const float *gs, int *dropped,
                int *have, char *err) {
  float grad[64];
  if (na) memcpy(grad, ga, na * DIM_A * sizeof(float));
  if (ns) memcpy(grad + na * DIM_A, gs, ns * DIM_S * sizeof(float));
  ps_rows_grad g = {.n_sec = 0, .grad = grad};
  if (na) {
    g.sec[g.n_sec].table = T_ADAM;
    g.sec[g.n_sec].n = na;
    g.sec[g.n_sec++].ids = ida;
  }
  if (ns) {
    g.sec[g.n_sec].table = T_SGD;
    g.sec[g.n_sec].n = ns;
    g.sec[g.n_sec++].ids = ids;
  }
  ps_seg seg = {(const uint8_t *)f->dense, f->n * sizeof(float)};
  ps_segview v = {&seg, 1, f->n * sizeof(float)};
  return ps_shard_sync_add_rows(f->shard, worker, base, 0, f->n, &v, &g, dropped, have, err);
}

static uint32_t crc_of(ps_table *t) {
  ps_table_read_lock(t);
  uint32_t c = ps_table_crc(t);
  ps_table_unlock(t);
  return c;
}

static void read_row(ps_table *t, uint64_t id, float *out) {
  ps_table_read_lock(t);
  ps_table_read_rows(t, &id, NULL, 1, out);
  ps_table_unlock(t);
}

/* The optimizer itself on a fresh row (initial values, initial slots):
 * rec receives dim * (1 + n_slots) floats after `steps` updates with grads. */
static void reference_row(const fixture *f, int t, uint64_t id, const float *grads, int steps,
                          float *rec) {
  const ps_optimizer *opt = ps_optimizer_find(f->optim[t].name);
  const int d = f->spec[t].dim, ns = opt->n_slots;
  ps_table_init_row(&f->spec[t], f->job.seed, id, rec);
  float *sl[PS_OPTIM_MAX_SLOTS];
  for (int k = 0; k < ns; k++) {
    sl[k] = rec + (size_t)(k + 1) * (size_t)d;
    for (int i = 0; i < d; i++) sl[k][i] = opt->slot_init ? opt->slot_init(&f->optim[t], k) : 0;
  }
  for (int s = 0; s < steps; s++)
    opt->apply(&f->optim[t], (uint64_t)s + 1, f->optim[t].lr, rec, sl, grads + s * d, (size_t)d);
}

typedef struct {
  uint64_t id;
  uint32_t t;
  float rec[DIM_A * 3];
  int found;
} find_ctx;

static int find_row(void *user, uint64_t id, uint32_t t, const float *rec) {
  find_ctx *c = user;
  if (id != c->id) return 0;
  c->found = 1;
  c->t = t;
  memcpy(c->rec, rec, sizeof c->rec);
  return 1;
}

static find_ctx record_of(ps_table *t, uint64_t id) {
  find_ctx c = {.id = id};
  ps_table_read_lock(t);
  ps_table_each_row(t, find_row, &c);
  ps_table_unlock(t);
  return c;
}

/* Two workers, overlapping ids: one step with the mean (divided by 2 for
 * every row, also those only one worker named), applied once with the
 * dense mean under version 1. */
static void test_mean_step(void) {
  fixture f;
  fx_init(&f, 0.5f);
  char err[PS_ERRLEN];
  int dropped, have;
  const uint64_t a1[3] = {5, 17, 300}, a2[3] = {17, 300, 999};
  const uint64_t s1[1] = {1ULL << 40}, s2[2] = {7, 1ULL << 40};
  float ga1[3 * DIM_A], ga2[3 * DIM_A], gs1[DIM_S] = {0.3f, -0.7f},
                                        gs2[2 * DIM_S] = {1.f, 2.f, 0.1f, 0.9f};
  for (int i = 0; i < 3 * DIM_A; i++) {
    ga1[i] = 0.013f * (float)(i + 1);
    ga2[i] = -0.021f * (float)(i + 3);
  }
  float before[DIM_A];
  read_row(f.tb[T_ADAM], 17, before);
  uint32_t crc0 = crc_of(f.tb[T_ADAM]);
  CHECK(push(&f, 1, 0, a1, 3, ga1, s1, 1, gs1, &dropped, &have, err) == 0 && have == 1 && !dropped);
  CHECK(ps_rows_sum_count(f.sum) == 4);
  CHECK(push(&f, 2, 0, a2, 3, ga2, s2, 2, gs2, &dropped, &have, err) == 0 && have == 2);
  CHECK(ps_rows_sum_count(f.sum) == 6); /* 5 17 300 999 | 7 2^40 */
  /* Nothing applied before the quorum. */
  uint64_t v = 0;
  CHECK(ps_shard_sync_try_apply(f.shard, 3, 0, &v, err) == 0);
  float now[DIM_A];
  read_row(f.tb[T_ADAM], 17, now);
  CHECK(memcmp(now, before, sizeof now) == 0 && crc_of(f.tb[T_ADAM]) == crc0);
  CHECK_MSG(ps_shard_sync_try_apply(f.shard, 2, 0, &v, err) == 1 && v == 1, "%s", err);
  CHECK(ps_rows_sum_count(f.sum) == 0);
  const float inv = 1.0f / 2.0f;
  /* Adam rows: 5 (worker 1 alone), 17 and 300 (both), 999 (worker 2). */
  const uint64_t ids[4] = {5, 17, 300, 999};
  for (int r = 0; r < 4; r++) {
    float mean[DIM_A];
    for (int c = 0; c < DIM_A; c++) {
      int i1 = -1, i2 = -1;
      for (int k = 0; k < 3; k++) {
        if (a1[k] == ids[r]) i1 = k;
        if (a2[k] == ids[r]) i2 = k;
      }
      float s = i1 >= 0 ? ga1[i1 * DIM_A + c] : 0.f;
      if (i2 >= 0) s = i1 >= 0 ? s + ga2[i2 * DIM_A + c] : ga2[i2 * DIM_A + c];
      mean[c] = s * inv;
    }
    float rec[DIM_A * 3];
    reference_row(&f, T_ADAM, ids[r], mean, 1, rec);
    float got[DIM_A];
    read_row(f.tb[T_ADAM], ids[r], got);
    CHECK_MSG(memcmp(got, rec, sizeof got) == 0, "adam row %" PRIu64 " is not the mean's step",
              ids[r]);
    find_ctx fc = record_of(f.tb[T_ADAM], ids[r]);
    CHECK(fc.found && fc.t == 1 && memcmp(fc.rec, rec, sizeof rec) == 0);
  }
  /* sgd (unbounded) rows: 2^40 (both), 7 (worker 2). */
  {
    float m40[DIM_S] = {(gs1[0] + gs2[2]) * inv, (gs1[1] + gs2[3]) * inv};
    float m7[DIM_S] = {gs2[0] * inv, gs2[1] * inv};
    float rec[DIM_S], got[DIM_S];
    reference_row(&f, T_SGD, 1ULL << 40, m40, 1, rec);
    read_row(f.tb[T_SGD], 1ULL << 40, got);
    CHECK(memcmp(got, rec, sizeof got) == 0);
    reference_row(&f, T_SGD, 7, m7, 1, rec);
    read_row(f.tb[T_SGD], 7, got);
    CHECK(memcmp(got, rec, sizeof got) == 0);
  }
  /* A second step: 17 again (its t becomes 2) from one worker of two. */
  const uint64_t again[1] = {17};
  float g3[DIM_A] = {0.5f, -0.5f, 0.25f, 1.0f};
  CHECK(push(&f, 1, 1, again, 1, g3, NULL, 0, NULL, &dropped, &have, err) == 0);
  CHECK(push(&f, 2, 1, NULL, 0, NULL, NULL, 0, NULL, &dropped, &have, err) == 0 && have == 2);
  CHECK(ps_shard_sync_try_apply(f.shard, 2, 0, &v, err) == 1 && v == 2);
  {
    float g12[2 * DIM_A];
    for (int c = 0; c < DIM_A; c++) {
      g12[c] = (ga1[1 * DIM_A + c] + ga2[0 * DIM_A + c]) * inv;
      g12[DIM_A + c] = g3[c] * inv;
    }
    float rec[DIM_A * 3];
    reference_row(&f, T_ADAM, 17, g12, 2, rec);
    find_ctx fc = record_of(f.tb[T_ADAM], 17);
    CHECK(fc.found && fc.t == 2 && memcmp(fc.rec, rec, sizeof rec) == 0);
  }
  fx_free(&f);
}

/* A late gradient (of a step applied without it) and a second one from
 * the same worker are dropped with their rows. */
static void test_dropped(void) {
  fixture f;
  fx_init(&f, 0.5f);
  char err[PS_ERRLEN];
  int dropped, have;
  const uint64_t a[1] = {42}, late[1] = {43};
  float g[DIM_A] = {0.1f, 0.2f, 0.3f, 0.4f};
  CHECK(push(&f, 1, 0, a, 1, g, NULL, 0, NULL, &dropped, &have, err) == 0 && have == 1);
  /* Worker 1 again in the same step, with another row: dropped. */
  CHECK(push(&f, 1, 0, late, 1, g, NULL, 0, NULL, &dropped, &have, err) == 0 && dropped &&
        have == 1);
  CHECK(ps_rows_sum_count(f.sum) == 1);
  uint64_t v;
  CHECK(ps_shard_sync_try_apply(f.shard, 1, 0, &v, err) == 1 && v == 1);
  uint32_t crc1 = crc_of(f.tb[T_ADAM]);
  /* Worker 2's gradient of step 0 comes after it was applied: dropped. */
  CHECK(push(&f, 2, 0, late, 1, g, NULL, 0, NULL, &dropped, &have, err) == 0 && dropped &&
        have == 0);
  CHECK(ps_rows_sum_count(f.sum) == 0);
  CHECK(push(&f, 1, 1, NULL, 0, NULL, NULL, 0, NULL, &dropped, &have, err) == 0 && !dropped);
  CHECK(ps_shard_sync_try_apply(f.shard, 1, 0, &v, err) == 1 && v == 2);
  CHECK(crc_of(f.tb[T_ADAM]) == crc1);
  CHECK(!record_of(f.tb[T_ADAM], 43).found);
  ps_shard_stats st;
  ps_shard_stats_get(f.shard, &st);
  CHECK(st.dropped == 2);
  fx_free(&f);
}

/* Refusals leave the rows, the step's sum and the shard as they were. */
static void test_refusals(void) {
  fixture f;
  fx_init(&f, 1e30f);
  char err[PS_ERRLEN];
  int dropped, have;
  const uint64_t a[2] = {8, 9}, s[1] = {77};
  float g[2 * DIM_A] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f};
  float gs[DIM_S] = {0.25f, 0.5f};
  CHECK(push(&f, 1, 0, a, 2, g, s, 1, gs, &dropped, &have, err) == 0 && have == 1);
  /* A NaN in a row's gradient: refused, nothing of it in the step. */
  float gn[2 * DIM_A] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, NAN, 0.7f, 0.8f};
  CHECK(push(&f, 2, 0, a, 2, gn, s, 1, gs, &dropped, &have, err) == PS_EINVAL &&
        strstr(err, "is NaN") && strstr(err, "row 9"));
  ps_shard_stats st;
  ps_shard_stats_get(f.shard, &st);
  CHECK(st.sync_pending == 1 && st.rejected == 1 && ps_rows_sum_count(f.sum) == 3);
  /* A sum that would overflow: refused. */
  float big[DIM_S] = {3e38f, 0.f};
  CHECK(push(&f, 2, 0, NULL, 0, NULL, s, 1, big, &dropped, &have, err) == 0 && have == 2);
  CHECK(push(&f, 3, 0, NULL, 0, NULL, s, 1, big, &dropped, &have, err) == PS_EINVAL &&
        strstr(err, "would make value 0 Inf"));
  ps_shard_stats_get(f.shard, &st);
  CHECK(st.sync_pending == 2 && ps_rows_sum_count(f.sum) == 3);
  /* The step: row 77's sgd update (lr 1e30 times ~1.5e38) is not finite:
   * the step is refused and dropped, no row and no dense value moves. */
  uint32_t ca = crc_of(f.tb[T_ADAM]), cs = crc_of(f.tb[T_SGD]);
  float *p0 = malloc(f.n * sizeof(float)), *p1 = malloc(f.n * sizeof(float));
  ps_shard_copy_params(f.shard, p0);
  uint64_t v = 0;
  CHECK(ps_shard_sync_try_apply(f.shard, 2, 0, &v, err) == PS_EINVAL && strstr(err, "emb_sgd"));
  ps_shard_copy_params(f.shard, p1);
  ps_shard_stats_get(f.shard, &st);
  CHECK(st.version == 0 && st.sync_pending == 0 && st.dropped == 2);
  CHECK(memcmp(p0, p1, f.n * sizeof(float)) == 0);
  CHECK(crc_of(f.tb[T_ADAM]) == ca && crc_of(f.tb[T_SGD]) == cs);
  CHECK(!record_of(f.tb[T_ADAM], 8).found && ps_rows_sum_count(f.sum) == 0);
  /* The next step goes on from there. */
  CHECK(push(&f, 1, 0, a, 2, g, NULL, 0, NULL, &dropped, &have, err) == 0 && have == 1);
  CHECK(ps_shard_sync_try_apply(f.shard, 1, 0, &v, err) == 1 && v == 1);
  CHECK(record_of(f.tb[T_ADAM], 8).found);
  /* A restore empties the step, rows with it. */
  CHECK(push(&f, 1, 1, a, 2, g, NULL, 0, NULL, &dropped, &have, err) == 0);
  CHECK(ps_rows_sum_count(f.sum) == 2);
  ps_shard_restore_state(f.shard, p0, NULL, 1);
  CHECK(ps_rows_sum_count(f.sum) == 0);
  free(p0);
  free(p1);
  fx_free(&f);
}

static int copy_row(void *user, int table, uint64_t id, uint32_t count, const float *sum) {
  char err[PS_ERRLEN];
  return ps_rows_sum_put(user, table, id, count, sum, err);
}

/* A snapshot of the step (each, then put into another shard's sum) gives
 * the same rows bit for bit; put refuses what a step cannot hold. */
static void test_snapshot(void) {
  fixture f, g;
  fx_init(&f, 0.5f);
  fx_init(&g, 0.5f);
  char err[PS_ERRLEN];
  int dropped, have;
  const uint64_t a[2] = {11, 12}, s[1] = {5};
  float ga[2 * DIM_A] = {0.1f, -0.2f, 0.3f, 0.4f, 0.5f, 0.6f, -0.7f, 0.8f};
  float gs[DIM_S] = {0.25f, 0.5f};
  CHECK(push(&f, 1, 0, a, 2, ga, s, 1, gs, &dropped, &have, err) == 0);
  CHECK(push(&f, 2, 0, a, 1, ga, NULL, 0, NULL, &dropped, &have, err) == 0 && have == 2);
  float *sum = NULL;
  uint64_t *wids = NULL;
  int n = 0;
  double mx = 0;
  CHECK(ps_shard_sync_export(f.shard, &sum, &wids, &n, &mx) == 0 && n == 2);
  CHECK(ps_shard_sync_import(g.shard, sum, wids, n, mx) == 0);
  CHECK(ps_rows_sum_each(f.sum, copy_row, g.sum) == 0 && ps_rows_sum_count(g.sum) == 3);
  uint64_t v;
  CHECK(ps_shard_sync_try_apply(f.shard, 2, 0, &v, err) == 1);
  CHECK(ps_shard_sync_try_apply(g.shard, 2, 0, &v, err) == 1);
  for (int t = 0; t < NT; t++) CHECK(crc_of(f.tb[t]) == crc_of(g.tb[t]));
  float nan2[DIM_S] = {NAN, 0};
  CHECK(ps_rows_sum_put(g.sum, T_SGD, 5, 1, nan2, err) == PS_EINVAL);
  CHECK(ps_rows_sum_put(g.sum, NT, 5, 1, gs, err) == PS_EINVAL);
  CHECK(ps_rows_sum_put(g.sum, T_ADAM, 1000, 1, ga, err) != 0); /* not a row */
  CHECK(ps_rows_sum_put(g.sum, T_SGD, 5, 1, gs, err) == 0);
  CHECK(ps_rows_sum_put(g.sum, T_SGD, 5, 1, gs, err) == PS_EINVAL);
  free(sum);
  free(wids);
  fx_free(&f);
  fx_free(&g);
}

/* Many rows: the map grows past its first sizes and still finds each. */
static void test_many_rows(void) {
  fixture f;
  fx_init(&f, 0.5f);
  char err[PS_ERRLEN];
  ps_rows_sum *s = f.sum;
  static uint64_t ids[600];
  static float g[600 * DIM_S];
  for (int i = 0; i < 600; i++) {
    ids[i] = (uint64_t)i * 0x10001ULL;
    g[2 * i] = 1.0f;
    g[2 * i + 1] = (float)i;
  }
  for (int w = 0; w < 3; w++) {
    ps_rows_grad rg = {.n_sec = 1, .grad = g};
    rg.sec[0].table = T_SGD;
    rg.sec[0].n = 200 + 200 * (size_t)w;
    rg.sec[0].ids = ids;
    CHECK(ps_rows_sum_add(s, &rg, err) == 0);
  }
  CHECK(ps_rows_sum_count(s) == 600);
  ps_rows_sum_clear(s);
  CHECK(ps_rows_sum_count(s) == 0);
  fx_free(&f);
}

int main(void) {
  test_mean_step();
  test_dropped();
  test_refusals();
  test_snapshot();
  test_many_rows();
  return check_summary();
}

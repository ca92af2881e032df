/* Embedding tables: placement (common/emb.c), the job's "embeddings", and
 * a shard's part of a table (ps/state/table.c): pulls, lazy per-row optimizer
 * updates, refused input leaving every row as it was, checkpoint walks. */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/emb.h"
#include "../../common/job.h"
#include "../../common/half.h"
#include "../../common/optim.h"
#include "../../common/util.h"
#include "ps/state/table.h"
#include "check.h"

static ps_table_spec spec_of(const char *name, uint64_t rows, int dim) {
  ps_table_spec t;
  memset(&t, 0, sizeof t);
  snprintf(t.name, sizeof t.name, "%s", name);
  t.rows = rows;
  t.dim = dim;
  t.init = PS_TABLE_INIT_UNIFORM;
  t.init_scale = 0.05f;
  t.max_rows_per_shard = 1000;
  t.key = ps_table_key(name);
  return t;
}

static void test_permutation(void) {
  /* A permutation of [0, n) for awkward n, and its inverse. */
  uint64_t ns[] = {1, 2, 3, 5, 16, 17, 1000, 4097};
  for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
    uint64_t n = ns[k];
    uint8_t *seen = calloc(n, 1);
    int ok = 1, inv = 1;
    for (uint64_t x = 0; x < n; x++) {
      uint64_t y = ps_perm_forward(77, n, x);
      if (y >= n || seen[y]) ok = 0;
      else seen[y] = 1;
      if (ps_perm_inverse(77, n, y) != x) inv = 0;
    }
    CHECK_MSG(ok, "not a permutation of [0, %" PRIu64 ")", n);
    CHECK_MSG(inv, "inverse wrong for n %" PRIu64, n);
    free(seen);
  }
  /* Not the identity, and different keys differ. */
  int same = 0, moved = 0;
  for (uint64_t x = 0; x < 1000; x++) {
    same += ps_perm_forward(1, 1000, x) == ps_perm_forward(2, 1000, x);
    moved += ps_perm_forward(1, 1000, x) != x;
  }
  CHECK(same < 50);
  CHECK(moved > 950);
}

static void test_place_many(void) {
  /* The batch placement (AVX2 where the CPU has it) gives what placing
   * each id alone gives: the permutation, then shard and local row, for
   * counts that are not multiples of 8, small and large tables (h up to
   * 32, permuted values above 2^32), bounded and unbounded, 1 to 7
   * shards. */
  const uint64_t rows[] = {1, 2, 5, 1000, 4000000, 4194304, 4194305, (1ULL << 40) + 17,
                           UINT64_MAX - 3, 0};
  const int shards[] = {1, 2, 3, 7};
  enum { N = 1003 };
  uint64_t *ids = malloc(N * sizeof *ids), *local = malloc(N * sizeof *local);
  int *shard = malloc(N * sizeof *shard);
  int bad = 0;
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    ps_table_spec t = spec_of(r % 2 ? "odd" : "even", rows[r], 4);
    for (size_t i = 0; i < N; i++) {
      uint64_t x = ps_splitmix64(i * 31 + r);
      ids[i] = t.rows ? (i < t.rows ? i : x % t.rows) : x;
    }
    for (size_t k = 0; k < sizeof shards / sizeof shards[0]; k++) {
      const int S = shards[k];
      const size_t n = N - k; /* 1003, 1002, ...: every tail length */
      ps_table_place_many(&t, S, ids, n, shard, local);
      for (size_t i = 0; i < n; i++) {
        uint64_t l;
        int s = ps_table_place(&t, S, ids[i], &l);
        if (s != shard[i] || l != local[i]) bad++;
      }
    }
    if (t.rows > 1) {
      ps_perm_forward_many(t.key, t.rows, ids, local, N);
      for (size_t i = 0; i < N; i++) bad += local[i] != ps_perm_forward(t.key, t.rows, ids[i]);
      /* in place */
      memcpy(local, ids, N * sizeof *ids);
      ps_perm_forward_many(t.key, t.rows, local, local, N);
      for (size_t i = 0; i < N; i++) bad += local[i] != ps_perm_forward(t.key, t.rows, ids[i]);
    }
  }
  CHECK_MSG(bad == 0, "%d placements differ from one-id placement", bad);
  free(ids);
  free(local);
  free(shard);
}

static void test_placement(void) {
  /* Bounded: every id on exactly one shard at a distinct local row,
   * counts as ps_table_shard_rows says, and local_id inverts it. */
  ps_table_spec t = spec_of("cat", 10007, 4);
  const int S = 3;
  uint64_t count[3] = {0};
  uint8_t *seen[3];
  for (int s = 0; s < S; s++) seen[s] = calloc(ps_table_shard_rows(&t, S, s), 1);
  int ok = 1;
  for (uint64_t id = 0; id < t.rows; id++) {
    uint64_t local;
    int s = ps_table_place(&t, S, id, &local);
    if (s < 0 || s >= S || local >= ps_table_shard_rows(&t, S, s) || seen[s][local]) {
      ok = 0;
      continue;
    }
    seen[s][local] = 1;
    count[s]++;
    if (ps_table_local_id(&t, S, s, local) != id) ok = 0;
  }
  CHECK(ok);
  for (int s = 0; s < S; s++) {
    CHECK(count[s] == ps_table_shard_rows(&t, S, s));
    free(seen[s]);
  }
  CHECK(ps_table_shard_rows(&t, S, 0) + ps_table_shard_rows(&t, S, 1) +
            ps_table_shard_rows(&t, S, 2) == t.rows);
  /* Balanced whatever the ids: multiples of S (which id % S would put on
   * one shard) spread over all of them. */
  uint64_t mult[3] = {0};
  for (uint64_t id = 0; id < t.rows; id += S) {
    uint64_t local;
    mult[ps_table_place(&t, S, id, &local)]++;
  }
  for (int s = 0; s < S; s++) CHECK_MSG(mult[s] > 900 && mult[s] < 1330, "shard %d: %" PRIu64, s, mult[s]);
  /* Unbounded: hashed, balanced over arbitrary 64-bit ids. */
  ps_table_spec u = spec_of("hashed", 0, 4);
  uint64_t ucount[3] = {0};
  for (uint64_t i = 0; i < 30000; i++) {
    uint64_t local;
    ucount[ps_table_place(&u, S, i << 20, &local)]++;
    CHECK(local == (i << 20));
  }
  for (int s = 0; s < S; s++) CHECK(ucount[s] > 9500 && ucount[s] < 10500);
  /* Initial values: a function of (seed, table, id) only, within scale. */
  float a[4], b[4], c[4];
  ps_table_init_row(&t, 5, 42, a);
  ps_table_init_row(&t, 5, 42, b);
  ps_table_init_row(&t, 5, 43, c);
  CHECK(memcmp(a, b, sizeof a) == 0);
  CHECK(memcmp(a, c, sizeof a) != 0);
  for (int j = 0; j < 4; j++) CHECK(fabsf(a[j]) <= 0.05f);
}

static void test_job(void) {
  char err[PS_ERRLEN];
  ps_job job;
#define BASE \
      "{\"job_id\": \"t\", \"model\": {\"input\": [1, 1, 4], \"classes\": 2, \"layers\": " \
      "[{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 2}, {\"type\": " \
      "\"softmax_xent\"}]}, \"optimizer\": {\"name\": \"sgd\", \"lr\": 0.5}, %s}"
  char text[2048];
  snprintf(text, sizeof text, BASE,
           "\"embeddings\": [{\"name\": \"a\", \"rows\": 100, \"dim\": 8}, {\"name\": \"b\", "
           "\"rows\": 0, \"dim\": 4, \"init\": \"normal:0.01\", \"optimizer\": {\"name\": "
           "\"adagrad\", \"lr\": 0.1}, \"max_rows_per_shard\": 5000}]");
  int rc = ps_job_parse(text, &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(job.n_tables == 2);
  CHECK(strcmp(job.tables[0].name, "a") == 0 && job.tables[0].rows == 100 &&
        job.tables[0].dim == 8 && job.tables[0].init == PS_TABLE_INIT_UNIFORM);
  CHECK(strcmp(job.table_optim[0].name, "sgd") == 0 && job.table_optim[0].lr == 0.5f);
  CHECK(job.tables[1].rows == 0 && job.tables[1].init == PS_TABLE_INIT_NORMAL &&
        job.tables[1].init_scale == 0.01f && job.tables[1].max_rows_per_shard == 5000);
  CHECK(strcmp(job.table_optim[1].name, "adagrad") == 0 && job.table_optim[1].lr == 0.1f);
  CHECK(job.tables[0].key == ps_table_key("a"));
  /* Bad tables: each refused with a message naming the field. */
  const struct {
    const char *tables, *want;
  } bad[] = {
      {"\"embeddings\": {}", "'embeddings' must be a list"},
      {"\"embeddings\": [{\"rows\": 1, \"dim\": 1}]", "embeddings[0].name"},
      {"\"embeddings\": [{\"name\": \"a b\", \"rows\": 1, \"dim\": 1}]", "embeddings[0].name"},
      {"\"embeddings\": [{\"name\": \"a\", \"dim\": 1}]", "embeddings[0].rows"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": -1, \"dim\": 1}]", "embeddings[0].rows"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1}]", "embeddings[0].dim"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1, \"dim\": 0}]", "embeddings[0].dim"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1, \"dim\": 1, \"init\": \"uniform:-1\"}]",
       "embeddings[0].init"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1, \"dim\": 1, \"init\": \"ones\"}]",
       "embeddings[0].init"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1, \"dim\": 1, \"size\": 3}]",
       "embeddings[0].size"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1, \"dim\": 1}, {\"name\": \"a\", "
       "\"rows\": 1, \"dim\": 1}]",
       "declared twice"},
      {"\"embeddings\": [{\"name\": \"a\", \"rows\": 1, \"dim\": 1, \"optimizer\": {\"name\": "
       "\"lbfgs\"}}]",
       "(table 'a'): 'optimizer.name'"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(text, sizeof text, BASE, bad[i].tables);
    err[0] = 0;
    rc = ps_job_parse(text, &job, err);
    CHECK_MSG(rc == PS_EINVAL && strstr(err, bad[i].want), "case %zu: rc %d, '%s'", i, rc, err);
  }
}

static int count_row(void *user, uint64_t id, uint32_t t, const float *rec) {
  (void)id;
  (void)rec;
  (*(uint64_t *)user) += t;
  return 0;
}

/* The table's running checksum, recomputed from its rows. */
typedef struct {
  uint32_t sum;
  size_t rec_floats;
} crc_walk;
static int crc_row(void *user, uint64_t id, uint32_t t, const float *rec) {
  crc_walk *w = user;
  w->sum += ps_table_row_sum(id, t, rec, w->rec_floats);
  return 0;
}
static uint32_t crc_again(ps_table *t) {
  crc_walk w = {0, (size_t)ps_table_spec_of(t)->dim * (size_t)(1 + ps_table_n_slots(t))};
  ps_table_read_lock(t);
  ps_table_each_row(t, crc_row, &w);
  ps_table_unlock(t);
  return w.sum;
}

static void test_row_sum(void) {
  /* Any one bit of a row (its id, its count, any value or slot of a
   * record of even or odd length, the last word included) changes the
   * row's checksum. */
  float rec[33];
  for (int j = 0; j < 33; j++) rec[j] = 0.01f * (float)(j - 16);
  int same = 0;
  for (size_t nf = 32; nf <= 33; nf++) {
    const uint32_t base = ps_table_row_sum(12345, 7, rec, nf);
    for (int b = 0; b < 64; b++) same += ps_table_row_sum(12345 ^ (1ULL << b), 7, rec, nf) == base;
    for (int b = 0; b < 32; b++) same += ps_table_row_sum(12345, 7u ^ (1u << b), rec, nf) == base;
    for (size_t j = 0; j < nf; j++)
      for (int b = 0; b < 32; b++) {
        uint32_t u;
        memcpy(&u, &rec[j], sizeof u);
        u ^= 1u << b;
        memcpy(&rec[j], &u, sizeof u);
        same += ps_table_row_sum(12345, 7, rec, nf) == base;
        u ^= 1u << b;
        memcpy(&rec[j], &u, sizeof u);
      }
    /* and the length: a record one float shorter */
    same += ps_table_row_sum(12345, 7, rec, nf - 1) == base;
  }
  CHECK_MSG(same == 0, "%d one-bit changes left the checksum as it was", same);
}

static void test_table_rows(uint64_t rows) {
  char err[PS_ERRLEN];
  ps_table_spec sp = spec_of(rows ? "bounded" : "unbounded", rows, 3);
  ps_optim_config adam = {.name = "adam", .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
  const int S = 2;
  ps_table *tb[2];
  for (int s = 0; s < S; s++) {
    tb[s] = ps_table_create(&sp, &adam, 9, s, S, err);
    CHECK_MSG(tb[s] != NULL, "%s", err);
  }
  /* Ids of shard 0. */
  uint64_t ids[8];
  int n = 0;
  for (uint64_t id = 0; n < 8; id++) {
    uint64_t local;
    if (ps_table_place(&sp, S, id * 7 + 3, &local) == 0) ids[n++] = id * 7 + 3;
  }
  ps_table *t = tb[0];
  float out[8 * 3], init[3];
  ps_table_read_lock(t);
  CHECK(ps_table_check_ids(t, ids, 8, NULL, err) == 0);
  ps_table_read_rows(t, ids, NULL, 8, out);
  ps_table_unlock(t);
  ps_table_init_row(&sp, 9, ids[5], init);
  CHECK(memcmp(out + 15, init, sizeof init) == 0);
  /* Not this shard's, out of range, twice: refused. */
  uint64_t other = 0, local;
  while (ps_table_place(&sp, S, other, &local) != 1) other++;
  uint64_t badids[3] = {ids[0], other, ids[1]};
  CHECK(ps_table_check_ids(t, badids, 3, NULL, err) == PS_EINVAL && strstr(err, "lives on shard 1"));
  uint64_t dup[3] = {ids[0], ids[1], ids[0]};
  CHECK(ps_table_check_ids(t, dup, 3, NULL, err) == PS_EINVAL && strstr(err, "named twice"));
  if (rows) {
    uint64_t far[1] = {rows};
    CHECK(ps_table_check_ids(t, far, 1, NULL, err) == PS_ERANGE && strstr(err, "is not a row"));
    /* In a larger request (placed 8 at a time) the first refused position
     * is named, whichever its fault: an id of another shard before an id
     * out of range, and the other way round. */
    uint64_t many[40];
    for (int i = 0; i < 40; i++) many[i] = ids[i % 8];
    many[13] = other;
    many[29] = rows + 5;
    CHECK(ps_table_check_ids(t, many, 40, NULL, err) == PS_EINVAL &&
          strstr(err, "(position 13) lives on shard 1"));
    many[13] = ids[5];
    many[9] = rows + 1;
    CHECK(ps_table_check_ids(t, many, 40, NULL, err) == PS_ERANGE &&
          strstr(err, "(position 9) is not a row"));
    /* Every row of this shard once, in an order of their own: the order
     * given sorts them by local row; two of them named again, the earlier
     * repeat named. */
    uint64_t *all = malloc(rows * sizeof *all), *loc = malloc(rows * sizeof *loc);
    uint32_t *ord = malloc(rows * sizeof *ord);
    size_t m = 0;
    for (uint64_t id = 0; id < rows; id++) {
      uint64_t l;
      if (ps_table_place(&sp, S, ps_perm_forward(3, rows, id), &l) == 0)
        all[m++] = ps_perm_forward(3, rows, id);
    }
    CHECK(ps_table_check_ids_order(t, all, m, loc, ord, err) == 0);
    int sorted = 1;
    uint8_t *hit = calloc(m, 1);
    for (size_t k = 0; k < m; k++) {
      if (ord[k] >= m || hit[ord[k]]) sorted = 0;
      else hit[ord[k]] = 1;
      if (k && loc[ord[k]] <= loc[ord[k - 1]]) sorted = 0;
    }
    CHECK_MSG(sorted, "the order is not the %zu positions by local row", m);
    all[m - 10] = all[5];
    all[m - 50] = all[200];
    CHECK(ps_table_check_ids_order(t, all, m, loc, ord, err) == PS_EINVAL &&
          strstr(err, "named twice") && strstr(err, "position") &&
          strtoull(strstr(err, "(position ") + 10, NULL, 10) == m - 50);
    free(all);
    free(loc);
    free(ord);
    free(hit);
  }
  /* One push of rows 0..3: lazy Adam with the row's own count. */
  float g[4 * 3];
  for (int i = 0; i < 12; i++) g[i] = 0.01f * (float)(i + 1);
  /* With the placements the check gives (as the server passes them on). */
  uint64_t locals[4];
  CHECK(ps_table_check_ids(t, ids, 4, locals, err) == 0);
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, ids, locals, 4, g, 1.0f, err) == 0);
  ps_table_commit(t);
  ps_table_unlock(t);
  float after[8 * 3];
  ps_table_read_lock(t);
  ps_table_read_rows(t, ids, NULL, 8, after);
  ps_table_unlock(t);
  /* Adam's first step moves each value by lr (sign of g) * ~1. */
  for (int i = 0; i < 12; i++) CHECK_NEAR(after[i], out[i] - 0.1f, 1e-4, 0);
  CHECK(memcmp(after + 12, out + 12, 4 * 3 * sizeof(float)) == 0); /* untouched rows */
  /* Row 0 again (its second update: t = 2), row 4 for the first time (t = 1). */
  uint64_t two[2] = {ids[0], ids[4]};
  float g2[6] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, two, NULL, 2, g2, 1.0f, err) == 0);
  ps_table_commit(t);
  ps_table_unlock(t);
  /* The reference: the optimizer itself, on a row's record. */
  {
    const ps_optimizer *opt = ps_optimizer_find("adam");
    float rec[9];
    memcpy(rec, out, 3 * sizeof(float));
    memset(rec + 3, 0, 6 * sizeof(float));
    float *sl[2] = {rec + 3, rec + 6};
    opt->apply(&adam, 1, 0.1f, rec, sl, g, 3);
    opt->apply(&adam, 2, 0.1f, rec, sl, g2, 3);
    float r0[3];
    ps_table_read_lock(t);
    ps_table_read_rows(t, ids, NULL, 1, r0);
    ps_table_unlock(t);
    CHECK(memcmp(r0, rec, sizeof r0) == 0);
  }
  /* A NaN gradient, and an update that would overflow: refused, nothing
   * changed (a checksum of every row). */
  ps_table_read_lock(t);
  uint32_t crc = ps_table_crc(t);
  ps_table_unlock(t);
  float gn[6] = {0, 0, 0, 0, NAN, 0};
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, two, NULL, 2, gn, 1.0f, err) == PS_EINVAL && strstr(err, "is NaN"));
  ps_table_unstage(t);
  /* The same with the largest magnitude measured by the caller (as a
   * server's push does while copying the gradient out): the same refusal,
   * naming the same value. */
  CHECK(ps_table_stage_rows(t, two, NULL, NULL, 2, gn, NULL, 1.0f, ps_f32_max_bits(gn, 6), err) ==
            PS_EINVAL &&
        strstr(err, "gradient value 1 of row") && strstr(err, "(position 1) is NaN"));
  ps_table_unstage(t);
  ps_table_unlock(t);
  ps_optim_config sgd = {.name = "sgd", .lr = 1.0f};
  ps_table *big = ps_table_create(&sp, &sgd, 9, 0, S, err);
  float gbig[3] = {3e38f, 0, 0};
  ps_table_write_lock(big);
  CHECK(ps_table_stage(big, ids, NULL, 1, gbig, 1.0f, err) == 0);
  ps_table_commit(big);
  CHECK(ps_table_stage(big, ids, NULL, 1, gbig, 1.0f, err) == PS_EINVAL && strstr(err, "Inf"));
  ps_table_unstage(big);
  ps_table_unlock(big);
  ps_table_destroy(big);
  ps_table_read_lock(t);
  CHECK(ps_table_crc(t) == crc);
  ps_table_unlock(t);
  /* The walk: 5 rows pushed, counts 2 + 1 + 1 + 1 + 1. */
  ps_table_stats st;
  ps_table_stats_get(t, &st);
  CHECK(st.rows_held == 5 && st.rows_pushed == 6 && st.rejected == 2);
  uint64_t total = 0;
  ps_table_read_lock(t);
  ps_table_each_row(t, count_row, &total);
  ps_table_unlock(t);
  CHECK(total == 6);
  CHECK(crc_again(t) == crc && crc != 0);
  ps_table_destroy(tb[0]);
  ps_table_destroy(tb[1]);
}

static void test_unbounded_cap(void) {
  char err[PS_ERRLEN];
  ps_table_spec sp = spec_of("cap", 0, 2);
  sp.max_rows_per_shard = 10;
  ps_optim_config sgd = {.name = "sgd", .lr = 0.1f};
  ps_table *t = ps_table_create(&sp, &sgd, 1, 0, 1, err);
  uint64_t ids[12];
  float g[24];
  for (int i = 0; i < 12; i++) ids[i] = (uint64_t)i * 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i < 24; i++) g[i] = 1.0f;
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, ids, NULL, 8, g, 1.0f, err) == 0);
  ps_table_commit(t);
  /* 4 more would make 12 rows: refused whole, the 8 stay as they are. */
  CHECK(ps_table_stage(t, ids + 6, NULL, 6, g, 1.0f, err) == PS_ERANGE &&
        strstr(err, "max_rows_per_shard"));
  ps_table_unstage(t);
  ps_table_unlock(t);
  ps_table_stats st;
  ps_table_stats_get(t, &st);
  CHECK(st.rows_held == 8);
  /* Many rows: the map grows, every row found again. */
  sp.max_rows_per_shard = 100000;
  ps_table *m = ps_table_create(&sp, &sgd, 1, 0, 1, err);
  uint64_t *many = malloc(20000 * sizeof *many);
  float *gm = malloc(20000 * 2 * sizeof *gm);
  for (int i = 0; i < 20000; i++) many[i] = (uint64_t)i * 1000003ULL + 17;
  for (int i = 0; i < 40000; i++) gm[i] = (float)(i % 7);
  ps_table_write_lock(m);
  for (int k = 0; k < 4; k++) {
    CHECK(ps_table_stage(m, many + k * 5000, NULL, 5000, gm + k * 10000, 1.0f, err) == 0);
    ps_table_commit(m);
  }
  ps_table_unlock(m);
  float *back = malloc(20000 * 2 * sizeof *back);
  ps_table_read_lock(m);
  ps_table_read_rows(m, many, NULL, 20000, back);
  ps_table_unlock(m);
  int ok = 1;
  for (int i = 0; i < 20000 && ok; i++) {
    float init[2];
    ps_table_init_row(&sp, 1, many[i], init);
    for (int j = 0; j < 2; j++)
      if (back[i * 2 + j] != init[j] - 0.1f * gm[i * 2 + j]) ok = 0;
  }
  CHECK(ok);
  /* put_row / clear round trip. */
  float rec[2] = {3, 4};
  ps_table_write_lock(m);
  CHECK(ps_table_put_row(m, 5, 7, rec, err) == 0);
  float nanrec[2] = {NAN, 0};
  CHECK(ps_table_put_row(m, 6, 1, nanrec, err) == PS_EINVAL);
  ps_table_unlock(m);
  uint64_t five = 5;
  float got[2];
  ps_table_read_lock(m);
  ps_table_read_rows(m, &five, NULL, 1, got);
  ps_table_unlock(m);
  CHECK(got[0] == 3 && got[1] == 4);
  ps_table_read_lock(m);
  uint32_t mc = ps_table_crc(m);
  ps_table_unlock(m);
  CHECK(crc_again(m) == mc);
  ps_table_write_lock(m);
  ps_table_clear(m);
  ps_table_unlock(m);
  ps_table_stats_get(m, &st);
  CHECK(st.rows_held == 0);
  free(many);
  free(gm);
  free(back);
  ps_table_destroy(m);
  ps_table_destroy(t);
}

/* A large push is staged in two halves on two threads: a refusal in
 * either half puts every row of both back. */
static void test_split_refusal(uint64_t rows) {
  char err[PS_ERRLEN];
  ps_table_spec sp = spec_of("split", rows, 4);
  sp.max_rows_per_shard = 100000;
  ps_optim_config adam = {.name = "adam", .lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
  ps_table *t = ps_table_create(&sp, &adam, 3, 0, 1, err);
  const size_t n = 6000;
  uint64_t *ids = malloc(n * sizeof *ids);
  float *g = malloc(n * 4 * sizeof *g), *before = malloc(n * 4 * sizeof *before),
        *after = malloc(n * 4 * sizeof *after);
  for (size_t i = 0; i < n; i++) ids[i] = rows ? (i * 7919) % rows : i * 0x9e3779b97f4a7c15ULL;
  for (size_t i = 0; i < n * 4; i++) g[i] = 0.01f * (float)(i % 9);
  /* Half of them pushed once (so both made and never-pushed rows are in
   * the refused pushes). */
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, ids, NULL, n / 2, g, 1.0f, err) == 0);
  ps_table_commit(t);
  ps_table_unlock(t);
  ps_table_stats st0;
  ps_table_stats_get(t, &st0);
  uint32_t crc0 = ps_table_crc(t);
  ps_table_read_rows(t, ids, NULL, n, before);
  size_t bad_at[3] = {100, 4500, n - 1};
  for (int k = 0; k < 3; k++) {
    g[bad_at[k] * 4 + 2] = NAN;
    ps_table_write_lock(t);
    CHECK_MSG(ps_table_stage(t, ids, NULL, n, g, 1.0f, err) == PS_EINVAL && strstr(err, "NaN"),
              "NaN at %zu: %s", bad_at[k], err);
    ps_table_unlock(t);
    g[bad_at[k] * 4 + 2] = 0.0f;
    ps_table_read_rows(t, ids, NULL, n, after);
    CHECK_MSG(memcmp(before, after, n * 4 * sizeof(float)) == 0,
              "rows changed after a refused push (NaN at %zu)", bad_at[k]);
    CHECK(ps_table_crc(t) == crc0);
  }
  /* Staged whole, then undone (the dense part failed). */
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, ids, NULL, n, g, 1.0f, err) == 0);
  ps_table_unstage(t);
  ps_table_unlock(t);
  ps_table_read_rows(t, ids, NULL, n, after);
  CHECK(memcmp(before, after, n * 4 * sizeof(float)) == 0);
  ps_table_stats st1;
  ps_table_stats_get(t, &st1);
  CHECK(st1.rows_held == st0.rows_held && ps_table_crc(t) == crc0);
  /* And applied: every row moved, the checksum as recomputed. */
  ps_table_write_lock(t);
  CHECK(ps_table_stage(t, ids, NULL, n, g, 1.0f, err) == 0);
  ps_table_commit(t);
  ps_table_unlock(t);
  ps_table_stats_get(t, &st1);
  CHECK(st1.rows_held == n);
  CHECK(crc_again(t) == ps_table_crc(t));
  free(ids), free(g), free(before), free(after);
  ps_table_destroy(t);
}

/* A push is applied without a trial while the table's bounds promise
 * finite results, and with one otherwise: both give the same rows, bit for
 * bit; a restored row widens the bounds, so that a push that would
 * overflow it is refused, not applied on the strength of stale bounds. */
static void test_bounds(uint64_t rows) {
  char err[PS_ERRLEN];
  ps_table_spec sp = spec_of("bounds", rows, 8);
  sp.max_rows_per_shard = 100000;
  ps_optim_config ada = {.name = "adagrad", .lr = 0.05f, .eps = 1e-7f,
                         .initial_accumulator = 0.1f};
  ps_table *fast = ps_table_create(&sp, &ada, 5, 0, 1, err);
  ps_table *trial = ps_table_create(&sp, &ada, 5, 0, 1, err);
  CHECK(fast && trial);
  const size_t n = 5000;
  uint64_t *ids = malloc(n * sizeof *ids);
  uint64_t *locals = malloc(n * sizeof *locals);
  float *g = malloc(n * 8 * sizeof *g), *a = malloc(n * 8 * sizeof *a),
        *b = malloc(n * 8 * sizeof *b);
  for (size_t i = 0; i < n; i++) ids[i] = rows ? (i * 7919 + 13) % rows : i * 0x9e3779b97f4a7c15ULL;
  /* The trial table holds a row whose accumulator is FLT_MAX (not among
   * ids): its bounds are no promise, so its pushes take the trial. */
  uint64_t far = rows ? rows - 1 : 42;
  float rec[16];
  for (int j = 0; j < 16; j++) rec[j] = j < 8 ? 1.0f : FLT_MAX;
  CHECK(ps_table_put_row(trial, far, 1, rec, err) == 0);
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i < n * 8; i++) g[i] = 0.01f * (float)((i * 31 + (size_t)round) % 17) - 0.08f;
    ps_table *both[2] = {fast, trial};
    for (int k = 0; k < 2; k++) {
      CHECK(ps_table_check_ids(both[k], ids, n, locals, err) == 0);
      ps_table_write_lock(both[k]);
      CHECK_MSG(ps_table_stage(both[k], ids, locals, n, g, 1.0f, err) == 0, "%s", err);
      ps_table_commit(both[k]);
      ps_table_unlock(both[k]);
    }
  }
  ps_table_read_rows(fast, ids, NULL, n, a);
  ps_table_read_rows(trial, ids, NULL, n, b);
  CHECK_MSG(memcmp(a, b, n * 8 * sizeof(float)) == 0, "the trial and the bounds differ");
  CHECK(crc_again(fast) == ps_table_crc(fast));
  /* The fast table gets the large row too; a push on it that would
   * overflow its accumulator (FLT_MAX + 1e38) is refused (the bounds were
   * widened by the restore), and nothing changes. */
  CHECK(ps_table_put_row(fast, far, 1, rec, err) == 0);
  const uint32_t crc0 = ps_table_crc(fast);
  uint64_t one[1] = {far};
  float gone[8];
  for (int j = 0; j < 8; j++) gone[j] = 1e19f;
  ps_table_write_lock(fast);
  CHECK_MSG(ps_table_stage(fast, one, NULL, 1, gone, 1.0f, err) == PS_EINVAL && strstr(err, "Inf"),
            "an overflowing push on a restored row: %s", err);
  ps_table_unstage(fast);
  ps_table_unlock(fast);
  CHECK(ps_table_crc(fast) == crc0);
  float back[8];
  ps_table_read_rows(fast, one, NULL, 1, back);
  CHECK(memcmp(back, rec, sizeof back) == 0);
  ps_table_stats st;
  ps_table_stats_get(fast, &st);
  CHECK(st.rejected == 1);
  /* Duplicates found through the bit per local row (locals given), and
   * the bits cleared again: the same ids once each pass after it. */
  if (rows) {
    uint64_t dup[4] = {ids[3], ids[9], ids[11], ids[9]};
    uint64_t loc4[4];
    CHECK(ps_table_check_ids(fast, dup, 4, loc4, err) == PS_EINVAL &&
          strstr(err, "named twice (position 3)"));
    CHECK(ps_table_check_ids(fast, dup, 3, loc4, err) == 0);
    CHECK(ps_table_check_ids(fast, dup, 3, loc4, err) == 0);
  }
  free(ids), free(locals), free(g), free(a), free(b);
  ps_table_destroy(fast);
  ps_table_destroy(trial);
}

/* A bounded table above 512 MiB goes over to huge pages once a row per 4
 * KiB is held, a thread of the table's collapsing the pages mapped before
 * while pushes go on: every row reads back as pushed, before and after,
 * and the table is destroyed while the thread may still run. */
static void test_dense_arena(void) {
  char err[PS_ERRLEN];
  ps_table_spec sp = spec_of("dense", 24000000, 4); /* 24M rows of 24 bytes: 549 MiB */
  ps_optim_config sgd = {.name = "sgd", .lr = 1.0f};
  ps_table *t = ps_table_create(&sp, &sgd, 2, 0, 1, err);
  CHECK_MSG(t != NULL, "%s", err);
  if (!t) return;
  const size_t n = 10000, rounds = 15; /* 150,000 rows: past one per 4 KiB (140,625) */
  uint64_t *ids = malloc(n * rounds * sizeof *ids);
  float *g = malloc(n * 4 * sizeof *g), *out = malloc(n * 4 * sizeof *out);
  for (size_t i = 0; i < n * rounds; i++) ids[i] = ps_perm_forward(99, sp.rows, i);
  for (size_t i = 0; i < n * 4; i++) g[i] = 1.0f;
  int ok = 1;
  for (size_t r = 0; r < rounds + 3; r++) {
    /* three more rounds over rows already held, while the pages collapse */
    const uint64_t *batch = ids + (r % rounds) * n;
    ps_table_write_lock(t);
    ok &= ps_table_stage(t, batch, NULL, n, g, 1.0f, err) == 0;
    ps_table_commit(t);
    ps_table_unlock(t);
  }
  CHECK_MSG(ok, "a push was refused: %s", err);
  ps_sleep_ms(200);
  /* every row: its initial values less 1 per push (twice for the first 3 rounds' rows) */
  int same = 1;
  for (size_t r = 0; r < rounds; r++) {
    ps_table_read_rows(t, ids + r * n, NULL, n, out);
    for (size_t i = 0; i < n && same; i++) {
      float init[4];
      ps_table_init_row(&sp, 2, ids[r * n + i], init);
      for (int j = 0; j < 4; j++) {
        float e = init[j] - 1.0f;
        if (r < 3) e -= 1.0f;
        same &= out[i * 4 + j] == e;
      }
    }
  }
  CHECK_MSG(same, "rows changed across the arena's move to huge pages");
  ps_table_stats st;
  ps_table_stats_get(t, &st);
  CHECK(st.rows_held == n * rounds);
  CHECK(crc_again(t) == ps_table_crc(t));
  ps_table_destroy(t);
  free(ids), free(g), free(out);
}

int main(void) {
  test_permutation();
  test_placement();
  test_place_many();
  test_row_sum();
  test_job();
  test_table_rows(1000);
  test_table_rows(0);
  test_unbounded_cap();
  test_split_refusal(100000);
  test_split_refusal(0);
  test_bounds(100000);
  test_bounds(0);
  test_dense_arena();
  return check_summary();
}

/* Embedding rows in checkpoints (ps/ckpt/table_ckpt.c, the tables section of
 * ps/ckpt/checkpoint.c): two shards with rows of a bounded and an unbounded
 * table write a checkpoint set; it is restored onto 1, 2 and 3 shards and
 * every row (id, update count, values, slots) compared bit for bit with
 * the rows written, each on the shard placement gives it; a corrupt or
 * truncated table section, and rows in the file of the wrong shard, are
 * refused with a message naming the file and the restored-to tables
 * unchanged; a file without tables (format 2) still loads; the export
 * writes each table as .npy. Everything happens in a mkdtemp directory
 * removed at the end. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../common/emb.h"
#include "../../common/job.h"
#include "../../common/util.h"
#include "ps/ckpt/checkpoint.h"
#include "ps/state/table.h"
#include "ps/ckpt/table_ckpt.h"
#include "check.h"
#include "tmp_tree.h"

static char g_root[256];
static ps_job job;

enum { OLD_S = 2, MAX_ROWS = 4096 };
#define P_DENSE 10

static const char *JOB =
    "{\"job_id\": \"tables-ckpt\", \"seed\": 5,"
    " \"model\": {\"input\": [1, 1, 2], \"classes\": 2, \"layers\": [{\"type\": \"flatten\"},"
    "   {\"type\": \"dense\", \"units\": 2}, {\"type\": \"softmax_xent\"}]},"
    " \"optimizer\": {\"name\": \"sgd\", \"lr\": 0.1},"
    " \"dataset\": {\"name\": \"synthetic\", \"train_size\": 8, \"test_size\": 8},"
    " \"embeddings\": ["
    "   {\"name\": \"cat\", \"rows\": 5000, \"dim\": 4, \"optimizer\": {\"name\": \"adam\", \"lr\": 0.05}},"
    "   {\"name\": \"hashed\", \"rows\": 0, \"dim\": 3, \"max_rows_per_shard\": 1000,"
    "    \"optimizer\": {\"name\": \"adagrad\", \"lr\": 0.1}}]}";

/* One row as a walk finds it. */
typedef struct {
  uint64_t id;
  uint32_t t;
  float rec[4 * 3]; /* dim * (1 + slots): at most 4 * 3 here */
} row;

typedef struct {
  row *v;
  size_t n, cap;
  size_t rec_floats;
} rows;

static int collect(void *user, uint64_t id, uint32_t t, const float *rec) {
  rows *r = user;
  if (r->n == r->cap) return 1; /* bounded: more rows than the test made */
  r->v[r->n].id = id;
  r->v[r->n].t = t;
  memset(r->v[r->n].rec, 0, sizeof r->v[r->n].rec);
  memcpy(r->v[r->n].rec, rec, r->rec_floats * sizeof(float));
  r->n++;
  return 0;
}

static int row_cmp(const void *a, const void *b) {
  const row *x = a, *y = b;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* Every row of table ti over the S shards tb[s][ti], sorted by id. */
static void all_rows(ps_table *tb[][PS_MAX_TABLES], int S, int ti, rows *out) {
  out->n = 0;
  out->rec_floats = (size_t)job.tables[ti].dim * (size_t)(1 + ps_table_n_slots(tb[0][ti]));
  for (int s = 0; s < S; s++) {
    ps_table_read_lock(tb[s][ti]);
    CHECK(ps_table_each_row(tb[s][ti], collect, out) == 0);
    ps_table_unlock(tb[s][ti]);
  }
  qsort(out->v, out->n, sizeof *out->v, row_cmp);
}

static int same_rows(const rows *a, const rows *b) {
  if (a->n != b->n) return 0;
  for (size_t i = 0; i < a->n; i++)
    if (a->v[i].id != b->v[i].id || a->v[i].t != b->v[i].t ||
        memcmp(a->v[i].rec, b->v[i].rec, sizeof a->v[i].rec) != 0)
      return 0;
  return 1;
}

static void make_tables(ps_table *tb[PS_MAX_TABLES], int shard, int S) {
  char err[PS_ERRLEN];
  for (int t = 0; t < job.n_tables; t++) {
    tb[t] = ps_table_create(&job.tables[t], &job.table_optim[t], job.seed, shard, S, err);
    CHECK_MSG(tb[t] != NULL, "%s", err);
  }
}

static void free_tables(ps_table *tb[PS_MAX_TABLES]) {
  for (int t = 0; t < job.n_tables; t++) ps_table_destroy(tb[t]);
}

/* Pushes `rounds` gradients to the ids of ids[0..n) that table t of shard
 * `shard` of S holds (round r: ids i with i % (r + 1) == 0, so counts
 * differ). */
static void push_rows(ps_table *tb, int t, int shard, int S, const uint64_t *ids, size_t n,
                      int rounds) {
  char err[PS_ERRLEN];
  const int d = job.tables[t].dim;
  uint64_t *mine = malloc(n * sizeof *mine);
  float *g = malloc(n * (size_t)d * sizeof *g);
  for (int r = 0; r < rounds; r++) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
      uint64_t local;
      if (i % (size_t)(r + 1) == 0 && ps_table_place(&job.tables[t], S, ids[i], &local) == shard)
        mine[m++] = ids[i];
    }
    for (size_t i = 0; i < m * (size_t)d; i++) g[i] = 0.01f * (float)((int)(i % 7) - 3 + r);
    ps_table_write_lock(tb);
    int rc = ps_table_stage(tb, mine, NULL, m, g, 1.0f, err);
    CHECK_MSG(rc == 0, "push: %s", err);
    if (rc == 0) ps_table_commit(tb);
    ps_table_unlock(tb);
  }
  free(mine);
  free(g);
}

/* Writes shard `index` of S's checkpoint (dense: params[begin, end)) with
 * its tables' rows (tb, or none when tb is NULL) as set `set_id`. */
static int write_ckpt(const char *dir, ps_table *tb[PS_MAX_TABLES], int index, int S,
                      uint64_t set_id, const float *params, char *path) {
  char err[PS_ERRLEN];
  ps_ckpt ck;
  memset(&ck, 0, sizeof ck);
  ck.meta.index = index;
  ck.meta.num_shards = S;
  ck.meta.P = P_DENSE;
  ck.meta.begin = (size_t)P_DENSE * (size_t)index / (size_t)S;
  ck.meta.end = (size_t)P_DENSE * (size_t)(index + 1) / (size_t)S;
  ck.meta.version = 40 + (uint64_t)index;
  ck.meta.set_id = set_id;
  snprintf(ck.meta.optimizer, sizeof ck.meta.optimizer, "sgd");
  snprintf(ck.meta.job_id, sizeof ck.meta.job_id, "%s", job.job_id);
  ck.params = (float *)params + ck.meta.begin;
  static const char cut[] = "same-cut";
  ck.cut = (void *)cut;
  ck.cut_len = sizeof cut;
  int rc = PS_OK;
  if (tb) rc = ps_table_ckpt_save(&job, tb, &ck.tables, &ck.tables_len, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  if (rc == PS_OK) rc = ps_ckpt_write(dir, &ck, 0, path, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  free(ck.tables);
  return rc;
}

/* The warnings of the last restore (the files skipped, and why). */
static char g_notes[4096];
static void note(int level, const char *msg, void *user) {
  (void)user;
  size_t at = strlen(g_notes);
  if (level == PS_LOG_WARN && at + strlen(msg) + 2 < sizeof g_notes)
    snprintf(g_notes + at, sizeof g_notes - at, "%s\n", msg);
}

/* Restores shard `shard` of S (its tables tb, its dense range into
 * dense) from dir: 0, or the error with its message in err. */
static int restore(const char *dir, ps_table *tb[PS_MAX_TABLES], int shard, int S, float *dense,
                   ps_table_ckpt_counts *counts, char *err) {
  g_notes[0] = '\0';
  ps_ckpt_source src = {.dir = dir, .job_id = job.job_id, .P = P_DENSE, .optimizer = "sgd",
                        .note = note, .want_tables = 1};
  size_t b = (size_t)P_DENSE * (size_t)shard / (size_t)S;
  size_t e = (size_t)P_DENSE * (size_t)(shard + 1) / (size_t)S;
  ps_ckpt_restored got;
  int rc = ps_ckpt_load_range(&src, b, e, dense + b, NULL, 0, 0, &got, err);
  if (rc) return rc;
  CHECK(got.n_parts == OLD_S);
  rc = ps_table_ckpt_restore(&job, tb, shard, S, got.parts, got.n_parts, counts, err);
  ps_ckpt_restored_free(&got);
  return rc;
}

static uint32_t crc_of(ps_table *t) {
  ps_table_read_lock(t);
  uint32_t c = ps_table_crc(t);
  ps_table_unlock(t);
  return c;
}

static size_t file_size(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 ? (size_t)st.st_size : 0;
}

/* Flips byte `at` of path (from its end when at < 0). */
static void flip_byte(const char *path, long at) {
  FILE *f = fopen(path, "r+b");
  CHECK(f != NULL);
  if (!f) return;
  fseek(f, at, at < 0 ? SEEK_END : SEEK_SET);
  long pos = ftell(f);
  int c = fgetc(f);
  fseek(f, pos, SEEK_SET);
  fputc(c ^ 0x10, f);
  fclose(f);
}

static void copy_file(const char *from, const char *to) {
  char *data;
  size_t len;
  char err[PS_ERRLEN];
  CHECK(ps_read_file(from, &data, &len, err) == PS_OK);
  FILE *f = fopen(to, "wb");
  CHECK(f != NULL && fwrite(data, 1, len, f) == len);
  if (f) fclose(f);
  free(data);
}

/* A .npy file's header dict and its data (after the header). */
static char *read_npy(const char *path, char *dict, size_t dict_len, size_t *data_len) {
  char *raw, err[PS_ERRLEN];
  size_t len;
  if (ps_read_file(path, &raw, &len, err) != PS_OK || len < 10) return NULL;
  size_t hl = (size_t)(uint8_t)raw[8] | (size_t)(uint8_t)raw[9] << 8;
  snprintf(dict, dict_len, "%.*s", (int)hl, raw + 10);
  *data_len = len - 10 - hl;
  memmove(raw, raw + 10 + hl, *data_len);
  return raw;
}

static void test_tables_in_checkpoints(void) {
  char err[PS_ERRLEN], dir[512], path[OLD_S][PS_CKPT_PATHLEN];
  snprintf(dir, sizeof dir, "%s/set", g_root);
  CHECK(mkdir(dir, 0777) == 0);
  /* The ids: a spread of "cat" (and its last row), arbitrary 64-bit ones
   * of "hashed". */
  enum { NC = 700, NH = 500 };
  uint64_t cat[NC], hsh[NH];
  for (int i = 0; i < NC; i++) cat[i] = (uint64_t)i * 7 + 1;
  cat[NC - 1] = job.tables[0].rows - 1;
  for (int i = 0; i < NH; i++) hsh[i] = 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 3) ^ (uint64_t)i;
  ps_table *old[OLD_S][PS_MAX_TABLES];
  float dense[P_DENSE];
  for (int i = 0; i < P_DENSE; i++) dense[i] = 0.5f * (float)i - 1.0f;
  for (int s = 0; s < OLD_S; s++) {
    make_tables(old[s], s, OLD_S);
    push_rows(old[s][0], 0, s, OLD_S, cat, NC, 3);
    push_rows(old[s][1], 1, s, OLD_S, hsh, NH, 2);
    write_ckpt(dir, old[s], s, OLD_S, 9, dense, path[s]);
  }
  rows want[2], got[2];
  for (int t = 0; t < 2; t++) {
    want[t] = (rows){calloc(MAX_ROWS, sizeof(row)), 0, MAX_ROWS, 0};
    got[t] = (rows){calloc(MAX_ROWS, sizeof(row)), 0, MAX_ROWS, 0};
    all_rows(old, OLD_S, t, &want[t]);
  }
  CHECK(want[0].n == NC && want[1].n == NH);
  int counts_differ = 0;
  for (size_t i = 1; i < want[0].n; i++) counts_differ |= want[0].v[i].t != want[0].v[0].t;
  CHECK(counts_differ);

  /* Onto 1, 2 and 3 shards: every row back, bit for bit, each where
   * placement puts it. */
  for (int S = 1; S <= 3; S++) {
    ps_table *nt[3][PS_MAX_TABLES];
    float back[P_DENSE];
    memset(back, 0xff, sizeof back);
    uint64_t restored[2] = {0, 0};
    for (int s = 0; s < S; s++) {
      make_tables(nt[s], s, S);
      ps_table_ckpt_counts c;
      int rc = restore(dir, nt[s], s, S, back, &c, err);
      CHECK_MSG(rc == PS_OK, "onto %d shards, shard %d: %s", S, s, err);
      restored[0] += c.rows[0];
      restored[1] += c.rows[1];
      CHECK(c.files_without == 0);
    }
    CHECK_MSG(memcmp(back, dense, sizeof dense) == 0, "dense values onto %d shards", S);
    for (int t = 0; t < 2; t++) {
      all_rows(nt, S, t, &got[t]);
      CHECK_MSG(same_rows(&want[t], &got[t]),
                "table %d onto %d shards: %zu rows back of %zu, not the same bit for bit", t, S,
                got[t].n, want[t].n);
      CHECK(restored[t] == want[t].n);
    }
    /* A row never pushed still reads as its initial values. */
    uint64_t never = 0, local;
    int on = ps_table_place(&job.tables[0], S, never, &local);
    float r[4], init[4];
    ps_table_read_lock(nt[on][0]);
    ps_table_read_rows(nt[on][0], &never, NULL, 1, r);
    ps_table_unlock(nt[on][0]);
    ps_table_init_row(&job.tables[0], job.seed, never, init);
    CHECK(memcmp(r, init, sizeof r) == 0);
    for (int s = 0; s < S; s++) free_tables(nt[s]);
    printf("restored onto %d shard(s): %zu + %zu rows, bit for bit\n", S, got[0].n, got[1].n);
  }

  /* The file: format 3, its tables section's length and checksum in the
   * header. */
  {
    char *raw;
    size_t len;
    CHECK(ps_read_file(path[0], &raw, &len, err) == PS_OK);
    const uint8_t *b = (const uint8_t *)raw;
    uint64_t R = ps_get_le64(b + 180);
    CHECK(ps_get_le32(b + 8) == 3 && R > 16 && R < len);
    CHECK(memcmp(b + len - 4 - R, "PSTB", 4) == 0);
    free(raw);
  }

  /* Damaged: every shard's tables are refused, with the file named, and
   * tables already holding rows keep them. */
  ps_table *keep[PS_MAX_TABLES];
  make_tables(keep, 0, 1);
  push_rows(keep[0], 0, 0, 1, cat, 50, 1);
  push_rows(keep[1], 1, 0, 1, hsh, 50, 1);
  const uint32_t crc0 = crc_of(keep[0]), crc1 = crc_of(keep[1]);
  char saved[PS_CKPT_PATHLEN];
  snprintf(saved, sizeof saved, "%s/saved", g_root);
  copy_file(path[1], saved);
  float back[P_DENSE];
  /* A byte of the rows (the tables section ends 4 bytes before the end). */
  flip_byte(path[1], -40);
  int rc = restore(dir, keep, 0, 1, back, NULL, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "embedding rows are corrupt") &&
                strstr(err, "shard-1-of-2-v41-s9.ckpt"),
            "rc %d: %s", rc, err);
  printf("a flipped byte of the rows: %s\n", err);
  CHECK(crc_of(keep[0]) == crc0 && crc_of(keep[1]) == crc1);
  /* Truncated in the rows. */
  copy_file(saved, path[1]);
  CHECK(truncate(path[1], (off_t)(file_size(path[1]) - 30)) == 0);
  rc = restore(dir, keep, 0, 1, back, NULL, err);
  /* (The header says how long the file is: the file is skipped when the
   * directory is listed, with a warning saying why.) */
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "'shard-1-of-2-v41-s9.ckpt' is damaged") &&
                strstr(g_notes, "truncated checkpoint") &&
                strstr(g_notes, "shard-1-of-2-v41-s9.ckpt"),
            "rc %d: %s; notes: %s", rc, err, g_notes);
  printf("truncated rows: %s\n", err);
  CHECK(crc_of(keep[0]) == crc0 && crc_of(keep[1]) == crc1);
  copy_file(saved, path[1]);

  /* Valid files, but the rows of shard 1 in shard 0's file: refused by the
   * restore itself, the file and the row named, nothing changed. */
  {
    char swapdir[512], p2[PS_CKPT_PATHLEN];
    snprintf(swapdir, sizeof swapdir, "%s/swap", g_root);
    CHECK(mkdir(swapdir, 0777) == 0);
    write_ckpt(swapdir, old[1], 0, OLD_S, 3, dense, p2);
    write_ckpt(swapdir, old[0], 1, OLD_S, 3, dense, p2);
    rc = restore(swapdir, keep, 0, 1, back, NULL, err);
    CHECK_MSG(rc == PS_EINVAL && strstr(err, "shard-0-of-2-v40-s3.ckpt") &&
                  strstr(err, "not on shard 0 that wrote the file"),
              "rc %d: %s", rc, err);
    printf("rows in another shard's file: %s\n", err);
    CHECK(crc_of(keep[0]) == crc0 && crc_of(keep[1]) == crc1);
  }
  /* A job whose table changed: refused, named. */
  {
    ps_job changed = job;
    changed.tables[0].dim = 8;
    ps_ckpt_source src = {.dir = dir, .job_id = job.job_id, .P = P_DENSE, .want_tables = 1};
    ps_ckpt_restored gr;
    CHECK(ps_ckpt_load_range(&src, 0, P_DENSE, back, NULL, 0, 0, &gr, err) == PS_OK);
    rc = ps_table_ckpt_restore(&changed, keep, 0, 1, gr.parts, gr.n_parts, NULL, err);
    CHECK_MSG(rc == PS_EINVAL && strstr(err, "table 'cat' was written with 5000 rows of dim 4"),
              "rc %d: %s", rc, err);
    ps_ckpt_restored_free(&gr);
    CHECK(crc_of(keep[0]) == crc0 && crc_of(keep[1]) == crc1);
  }
  /* Old files, without tables (format 2): the dense values load, the
   * tables are empty. */
  {
    char olddir[512], p2[PS_CKPT_PATHLEN];
    snprintf(olddir, sizeof olddir, "%s/old", g_root);
    CHECK(mkdir(olddir, 0777) == 0);
    for (int s = 0; s < OLD_S; s++) write_ckpt(olddir, NULL, s, OLD_S, 4, dense, p2);
    ps_ckpt_meta m;
    CHECK(ps_ckpt_read_header(p2, &m, NULL, NULL, err) == PS_OK && m.format == 2 &&
          m.tables_len == 0);
    ps_table_ckpt_counts c;
    memset(back, 0, sizeof back);
    rc = restore(olddir, keep, 0, 1, back, &c, err);
    CHECK_MSG(rc == PS_OK, "%s", err);
    CHECK(c.files_without == OLD_S && c.rows[0] == 0 && c.rows[1] == 0);
    CHECK(memcmp(back, dense, sizeof dense) == 0);
    CHECK(crc_of(keep[0]) == 0 && crc_of(keep[1]) == 0);
  }
  free_tables(keep);

  /* The export: "cat" whole, pushed rows as written and the others their
   * initial values; "hashed" as sorted ids and their rows. */
  {
    char outdir[512], p[PS_CKPT_PATHLEN + 32], dict[256];
    snprintf(outdir, sizeof outdir, "%s/npy", g_root);
    CHECK(mkdir(outdir, 0777) == 0);
    ps_ckpt_source src = {.dir = dir, .job_id = job.job_id, .P = P_DENSE, .want_tables = 1};
    ps_ckpt_restored gr;
    CHECK(ps_ckpt_load_range(&src, 0, P_DENSE, back, NULL, 0, 0, &gr, err) == PS_OK);
    int files = 0;
    rc = ps_table_ckpt_export_npy(&job, gr.parts, gr.n_parts, outdir, &files, err);
    CHECK_MSG(rc == PS_OK && files == 3, "rc %d, %d files: %s", rc, files, err);
    ps_ckpt_restored_free(&gr);
    size_t len;
    snprintf(p, sizeof p, "%s/cat.emb.npy", outdir);
    float *c = (float *)read_npy(p, dict, sizeof dict, &len);
    CHECK_MSG(c && strstr(dict, "'descr': '<f4'") && strstr(dict, "'shape': (5000, 4)") &&
                  len == 5000 * 4 * sizeof(float),
              "%s", dict);
    if (c && len == 5000 * 4 * sizeof(float)) {
      int ok = 1;
      for (size_t i = 0; i < want[0].n; i++)
        ok &= memcmp(c + want[0].v[i].id * 4, want[0].v[i].rec, 4 * sizeof(float)) == 0;
      float init[4];
      ps_table_init_row(&job.tables[0], job.seed, 0, init);
      ok &= memcmp(c, init, sizeof init) == 0; /* id 0: never pushed */
      CHECK_MSG(ok, "cat.emb.npy differs from the rows");
    }
    free(c);
    snprintf(p, sizeof p, "%s/hashed.ids.npy", outdir);
    uint64_t *ids = (uint64_t *)read_npy(p, dict, sizeof dict, &len);
    CHECK_MSG(ids && strstr(dict, "'descr': '<u8'") && strstr(dict, "'shape': (500,)"), "%s",
              dict);
    snprintf(p, sizeof p, "%s/hashed.emb.npy", outdir);
    size_t vlen;
    float *v = (float *)read_npy(p, dict, sizeof dict, &vlen);
    CHECK_MSG(v && strstr(dict, "'shape': (500, 3)"), "%s", dict);
    if (ids && v && len == NH * 8 && vlen == NH * 3 * sizeof(float)) {
      int ok = 1;
      for (size_t i = 0; i < want[1].n; i++)
        ok &= ids[i] == want[1].v[i].id &&
              memcmp(v + i * 3, want[1].v[i].rec, 3 * sizeof(float)) == 0;
      CHECK_MSG(ok, "hashed.ids.npy / hashed.emb.npy differ from the rows");
    }
    free(ids);
    free(v);
  }
  for (int s = 0; s < OLD_S; s++) free_tables(old[s]);
  for (int t = 0; t < 2; t++) {
    free(want[t].v);
    free(got[t].v);
  }
}

/* The builder and the parser: a row before any table, a bad table, a
 * section that does not add up. */
static void test_section_checks(void) {
  char err[PS_ERRLEN];
  ps_ckpt_tables_builder b;
  void *sec;
  size_t len;
  float rec[6] = {1, 2, 3, 4, 5, 6};
  ps_ckpt_tables_begin(&b, 0);
  CHECK(ps_ckpt_tables_add_row(&b, 1, 1, rec) == PS_EINVAL);
  CHECK(ps_ckpt_tables_finish(&b, &sec, &len, err) == PS_EINVAL && sec == NULL);
  ps_ckpt_tables_begin(&b, 0);
  CHECK(ps_ckpt_tables_add_table(&b, "bad name", "sgd", 10, 3, 0) == PS_EINVAL);
  CHECK(ps_ckpt_tables_finish(&b, &sec, &len, err) == PS_EINVAL);
  ps_ckpt_tables_begin(&b, 0);
  CHECK(ps_ckpt_tables_add_table(&b, "t", "momentum", 10, 3, 1) == PS_OK);
  CHECK(ps_ckpt_tables_add_row(&b, 4, 2, rec) == PS_OK);
  CHECK(ps_ckpt_tables_add_row(&b, 9, 1, rec) == PS_OK);
  CHECK(ps_ckpt_tables_finish(&b, &sec, &len, err) == PS_OK && len == 16 + 72 + 2 * (12 + 24));
  ps_ckpt_table tv[PS_MAX_TABLES];
  int n;
  CHECK(ps_ckpt_tables_parse(sec, len, "f", tv, &n, err) == PS_OK && n == 1 && tv[0].n == 2);
  uint32_t cnt;
  float back[6];
  CHECK(ps_ckpt_table_row(&tv[0], 0, &cnt, back) == 4 && cnt == 2 &&
        memcmp(back, rec, sizeof rec) == 0);
  CHECK(ps_ckpt_tables_parse(sec, len - 1, "f", tv, &n, err) == PS_EINVAL && strstr(err, "'f'"));
  uint8_t *p = sec;
  ps_put_le64(p + 16 + 72 + 36, 10); /* the second row's id: beyond the table */
  CHECK(ps_ckpt_tables_parse(sec, len, "f", tv, &n, err) == PS_EINVAL &&
        strstr(err, "beyond its 10 rows"));
  ps_put_le64(p + 16 + 72 + 36, 9);
  float nan = __builtin_nanf("");
  memcpy(p + 16 + 72 + 12, &nan, 4);
  CHECK(ps_ckpt_tables_parse(sec, len, "f", tv, &n, err) == PS_EINVAL && strstr(err, "NaN"));
  free(sec);
}

int main(void) {
  char err[PS_ERRLEN];
  if (ps_job_parse(JOB, &job, err) != 0) {
    fprintf(stderr, "job: %s\n", err);
    return 1;
  }
  snprintf(g_root, sizeof g_root, "/tmp/test_table_ckpt.XXXXXX");
  if (!mkdtemp(g_root)) {
    perror("mkdtemp");
    return 1;
  }
  ps_log_init("test_table_ckpt", PS_LOG_ERROR);
  RUN(test_section_checks);
  RUN(test_tables_in_checkpoints);
  remove_tree(g_root);
  return check_summary();
}

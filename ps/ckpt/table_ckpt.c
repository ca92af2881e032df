/* Embedding rows in checkpoints (see table_ckpt.h); the section's bytes
 * are checkpoint.c's (ps_ckpt_tables_*). */
#include "ps/ckpt/table_ckpt.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/optim.h"
#include "common/util.h"

/* ---------------------------------------------------------------- save */

static int save_row(void *user, uint64_t id, uint32_t t, const float *rec) {
  return ps_ckpt_tables_add_row(user, id, t, rec);
}

int ps_table_ckpt_save(const ps_job *job, ps_table *const *tables, void **out, size_t *len,
                       char *err) {
  *out = NULL;
  *len = 0;
  if (job->n_tables == 0) return PS_OK;
  /* Room for the rows held now (a hint: the walks add what they find). */
  size_t hint = 0;
  for (int i = 0; i < job->n_tables; i++) {
    ps_table_stats st;
    ps_table_stats_get(tables[i], &st);
    size_t rec = 12 + 4 * (size_t)job->tables[i].dim * (size_t)(1 + ps_table_n_slots(tables[i]));
    if (st.rows_held < (SIZE_MAX / 2 - hint) / rec) hint += 72 + (size_t)st.rows_held * rec;
  }
  ps_ckpt_tables_builder b;
  ps_ckpt_tables_begin(&b, hint);
  for (int i = 0; i < job->n_tables; i++) {
    ps_table *t = tables[i];
    if (ps_ckpt_tables_add_table(&b, job->tables[i].name, job->table_optim[i].name,
                                 job->tables[i].rows, job->tables[i].dim,
                                 ps_table_n_slots(t)) != PS_OK)
      break;
    ps_table_read_lock(t);
    int rc = ps_table_each_row(t, save_row, &b);
    ps_table_unlock(t);
    if (rc) break;
  }
  return ps_ckpt_tables_finish(&b, out, len, err);
}

/* ---------------------------------------------------------------- checks */

/* A part's section as parsed, and which of the job's tables each of its
 * tables is (-1: one the job does not have). */
typedef struct {
  ps_ckpt_table t[PS_MAX_TABLES];
  int job_table[PS_MAX_TABLES];
  int n;
} part_view;

/* Parses every part and checks it against the job (see the contract of
 * ps_table_ckpt_restore). pv: n_parts entries. *without counts the parts
 * with no section. */
static int check_parts(const ps_job *job, const ps_ckpt_part *parts, int n_parts, part_view *pv,
                       int *without, char *err) {
  *without = 0;
  int warned_gone = 0;
  for (int p = 0; p < n_parts; p++) {
    const ps_ckpt_part *pt = &parts[p];
    part_view *v = &pv[p];
    v->n = 0;
    if (!pt->tables || pt->tables_len == 0) {
      (*without)++;
      continue;
    }
    int rc = ps_ckpt_tables_parse(pt->tables, pt->tables_len, pt->path, v->t, &v->n, err);
    if (rc) return rc;
    for (int k = 0; k < v->n; k++) {
      const ps_ckpt_table *ct = &v->t[k];
      int j = 0;
      while (j < job->n_tables && strcmp(job->tables[j].name, ct->name) != 0) j++;
      v->job_table[k] = j < job->n_tables ? j : -1;
      if (j == job->n_tables) {
        if (!warned_gone++)
          PS_WARN("checkpoint: '%s' holds rows of table '%s', which the job does not have: "
                  "they are left out",
                  pt->path, ct->name);
        continue;
      }
      const ps_table_spec *sp = &job->tables[j];
      const ps_optim_config *oc = &job->table_optim[j];
      const ps_optimizer *opt = ps_optimizer_find(oc->name);
      int slots = opt ? opt->n_slots : -1;
      if (ct->rows != sp->rows || ct->dim != sp->dim || strcmp(ct->optimizer, oc->name) != 0 ||
          ct->n_slots != slots)
        return ps_seterr(err, PS_EINVAL,
                         "'%s': table '%s' was written with %" PRIu64 " rows of dim %d, "
                         "optimizer '%s' (%d slots); the job's has %" PRIu64
                         " rows of dim %d, optimizer '%s' (%d slots)",
                         pt->path, ct->name, ct->rows, ct->dim, ct->optimizer, ct->n_slots,
                         sp->rows, sp->dim, oc->name, slots);
      for (uint64_t r = 0; r < ct->n; r++) {
        uint64_t id = ps_get_le64(ct->recs + r * ct->rec_bytes), local;
        int s = ps_table_place(sp, pt->num_shards, id, &local);
        if (s != pt->index)
          return ps_seterr(err, PS_EINVAL,
                           "'%s': table '%s' holds row %" PRIu64 ", which lives on shard %d of %d, "
                           "not on shard %d that wrote the file",
                           pt->path, ct->name, id, s, pt->num_shards, pt->index);
      }
    }
  }
  /* A table of the job that a file with a section lacks: from its start. */
  for (int j = 0; j < job->n_tables; j++)
    for (int p = 0; p < n_parts; p++) {
      if (pv[p].n == 0 && (!parts[p].tables || parts[p].tables_len == 0)) continue;
      int k = 0;
      while (k < pv[p].n && pv[p].job_table[k] != j) k++;
      if (k == pv[p].n) {
        PS_WARN("checkpoint: '%s' holds no rows of table '%s' (added to the job since?): its "
                "rows there start from their initial values",
                parts[p].path, job->tables[j].name);
        break;
      }
    }
  return PS_OK;
}

/* ---------------------------------------------------------------- restore */

int ps_table_ckpt_restore(const ps_job *job, ps_table *const *tables, int shard, int S,
                          const ps_ckpt_part *parts, int n_parts, ps_table_ckpt_counts *counts,
                          char *err) {
  if (counts) memset(counts, 0, sizeof *counts);
  if (job->n_tables == 0) return PS_OK;
  if (n_parts < 0 || (n_parts > 0 && !parts) || S < 1 || shard < 0 || shard >= S)
    return ps_seterr(err, PS_EINVAL, "table restore: bad arguments");
  part_view *pv = calloc((size_t)(n_parts ? n_parts : 1), sizeof *pv);
  if (!pv) return ps_seterr(err, PS_ENOMEM, "out of memory checking the checkpoints' rows");
  int without = 0;
  int rc = check_parts(job, parts, n_parts, pv, &without, err);
  /* Rows this shard will hold of each table: an unbounded table's bound. */
  uint64_t mine[PS_MAX_TABLES] = {0};
  for (int p = 0; rc == PS_OK && p < n_parts; p++)
    for (int k = 0; k < pv[p].n; k++) {
      int j = pv[p].job_table[k];
      if (j < 0) continue;
      const ps_ckpt_table *ct = &pv[p].t[k];
      for (uint64_t r = 0; r < ct->n; r++) {
        uint64_t local, id = ps_get_le64(ct->recs + r * ct->rec_bytes);
        mine[j] += ps_table_place(&job->tables[j], S, id, &local) == shard;
      }
    }
  for (int j = 0; rc == PS_OK && j < job->n_tables; j++)
    if (job->tables[j].rows == 0 && mine[j] > job->tables[j].max_rows_per_shard)
      rc = ps_seterr(err, PS_ERANGE,
                     "table '%s': the checkpoints hold %" PRIu64 " rows that live on shard %d of "
                     "%d, more than its max_rows_per_shard (%" PRIu64 "): raise it in the job "
                     "or restore onto more shards",
                     job->tables[j].name, mine[j], shard, S, job->tables[j].max_rows_per_shard);
  float *rec = NULL;
  if (rc == PS_OK) {
    rec = malloc((size_t)PS_TABLE_MAX_DIM * (1 + PS_CKPT_MAX_SLOTS) * sizeof(float));
    if (!rec) rc = ps_seterr(err, PS_ENOMEM, "out of memory restoring rows");
  }
  /* Checked: now the tables change, one at a time. */
  for (int j = 0; rc == PS_OK && j < job->n_tables; j++) {
    ps_table *t = tables[j];
    ps_table_write_lock(t);
    ps_table_clear(t);
    for (int p = 0; rc == PS_OK && p < n_parts; p++)
      for (int k = 0; rc == PS_OK && k < pv[p].n; k++) {
        if (pv[p].job_table[k] != j) continue;
        const ps_ckpt_table *ct = &pv[p].t[k];
        for (uint64_t r = 0; rc == PS_OK && r < ct->n; r++) {
          uint32_t count;
          uint64_t local, id = ps_ckpt_table_row(ct, r, &count, rec);
          if (ps_table_place(&job->tables[j], S, id, &local) != shard) continue;
          char why[PS_ERRLEN];
          rc = ps_table_put_row(t, id, count, rec, why);
          if (rc)
            ps_seterr(err, rc, "restoring rows of '%s': %s", parts[p].path, why);
          else if (counts)
            counts->rows[j]++;
        }
      }
    ps_table_unlock(t);
    if (rc) {
      /* Not all or nothing: leave every table empty. */
      for (int i = 0; i < job->n_tables; i++) {
        ps_table_write_lock(tables[i]);
        ps_table_clear(tables[i]);
        ps_table_unlock(tables[i]);
      }
      if (counts) memset(counts->rows, 0, sizeof counts->rows);
    }
  }
  if (counts) counts->files_without = without;
  free(rec);
  free(pv);
  return rc;
}

/* ---------------------------------------------------------------- export */

typedef struct {
  uint64_t id;
  const uint8_t *rec; /* the record in its section */
} id_rec;

static int id_rec_cmp(const void *a, const void *b) {
  const id_rec *x = a, *y = b;
  return x->id < y->id ? -1 : x->id > y->id;
}

static int table_path(char *out, const char *dir, const char *name, const char *suffix,
                      char *err) {
  int n = snprintf(out, PS_CKPT_PATHLEN, "%s/%s.%s.npy", dir, name, suffix);
  if (n < 0 || n >= PS_CKPT_PATHLEN)
    return ps_seterr(err, PS_EINVAL, "path '%s/%s.%s.npy' is too long", dir, name, suffix);
  return PS_OK;
}

/* Table j of the job from the checked parts into out_dir. */
static int export_table(const ps_job *job, int j, const ps_ckpt_part *parts, int n_parts,
                        const part_view *pv, const char *out_dir, int *files, char *err) {
  const ps_table_spec *sp = &job->tables[j];
  const size_t dim = (size_t)sp->dim;
  char path[PS_CKPT_PATHLEN];
  int rc;
  if (sp->rows > 0) {
    if (sp->rows > SIZE_MAX / sizeof(float) / dim)
      return ps_seterr(err, PS_ENOMEM, "table '%s': %" PRIu64 " rows do not fit in memory",
                       sp->name, sp->rows);
    float *all = malloc((size_t)sp->rows * dim * sizeof(float));
    if (!all)
      return ps_seterr(err, PS_ENOMEM, "out of memory for table '%s' (%" PRIu64 " x %d)",
                       sp->name, sp->rows, sp->dim);
    for (uint64_t id = 0; id < sp->rows; id++)
      ps_table_init_row(sp, job->seed, id, all + (size_t)id * dim);
    for (int p = 0; p < n_parts; p++)
      for (int k = 0; k < pv[p].n; k++) {
        if (pv[p].job_table[k] != j) continue;
        const ps_ckpt_table *ct = &pv[p].t[k];
        for (uint64_t r = 0; r < ct->n; r++) {
          const uint8_t *q = ct->recs + r * ct->rec_bytes;
          memcpy(all + (size_t)ps_get_le64(q) * dim, q + 12, dim * sizeof(float));
        }
      }
    size_t shape[2] = {(size_t)sp->rows, dim};
    rc = table_path(path, out_dir, sp->name, "emb", err);
    if (rc == PS_OK) rc = ps_npy_write(path, all, shape, 2, err);
    if (rc == PS_OK && files) (*files)++;
    free(all);
    return rc;
  }
  size_t n = 0;
  for (int p = 0; p < n_parts; p++)
    for (int k = 0; k < pv[p].n; k++)
      if (pv[p].job_table[k] == j) n += (size_t)pv[p].t[k].n;
  id_rec *v = malloc((n ? n : 1) * sizeof *v);
  uint64_t *ids = malloc((n ? n : 1) * sizeof *ids);
  float *vals = malloc((n ? n : 1) * dim * sizeof(float));
  if (!v || !ids || !vals) {
    free(v), free(ids), free(vals);
    return ps_seterr(err, PS_ENOMEM, "out of memory for table '%s' (%zu rows)", sp->name, n);
  }
  size_t at = 0;
  for (int p = 0; p < n_parts; p++)
    for (int k = 0; k < pv[p].n; k++) {
      if (pv[p].job_table[k] != j) continue;
      const ps_ckpt_table *ct = &pv[p].t[k];
      for (uint64_t r = 0; r < ct->n; r++) {
        v[at].rec = ct->recs + r * ct->rec_bytes;
        v[at].id = ps_get_le64(v[at].rec);
        at++;
      }
    }
  qsort(v, n, sizeof *v, id_rec_cmp);
  rc = PS_OK;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && v[i].id == v[i - 1].id) {
      rc = ps_seterr(err, PS_EINVAL, "table '%s': row %" PRIu64 " is held twice in the checkpoints",
                     sp->name, v[i].id);
      break;
    }
    ids[i] = v[i].id;
    memcpy(vals + i * dim, v[i].rec + 12, dim * sizeof(float));
  }
  size_t ishape[1] = {n}, vshape[2] = {n, dim};
  if (rc == PS_OK) rc = table_path(path, out_dir, sp->name, "ids", err);
  if (rc == PS_OK) rc = ps_npy_write_u64(path, ids, ishape, 1, err);
  if (rc == PS_OK && files) (*files)++;
  if (rc == PS_OK) rc = table_path(path, out_dir, sp->name, "emb", err);
  if (rc == PS_OK) rc = ps_npy_write(path, vals, vshape, 2, err);
  if (rc == PS_OK && files) (*files)++;
  free(v), free(ids), free(vals);
  return rc;
}

int ps_table_ckpt_export_npy(const ps_job *job, const ps_ckpt_part *parts, int n_parts,
                             const char *out_dir, int *files, char *err) {
  if (files) *files = 0;
  if (job->n_tables == 0) return PS_OK;
  part_view *pv = calloc((size_t)(n_parts ? n_parts : 1), sizeof *pv);
  if (!pv) return ps_seterr(err, PS_ENOMEM, "out of memory checking the checkpoints' rows");
  int without = 0;
  int rc = check_parts(job, parts, n_parts, pv, &without, err);
  if (rc == PS_OK && without == n_parts && n_parts > 0)
    PS_WARN("export: the checkpoints hold no embedding rows (written before checkpoints held "
            "tables): the tables are written with their initial values");
  for (int j = 0; rc == PS_OK && j < job->n_tables; j++)
    rc = export_table(job, j, parts, n_parts, pv, out_dir, files, err);
  free(pv);
  if (rc) return rc;
  int fd = open(out_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return ps_seterr(err, PS_EIO, "cannot open directory '%s' to sync it: %s", out_dir,
                     strerror(errno));
  if (fsync(fd) != 0 && errno != EINVAL)
    rc = ps_seterr(err, PS_EIO, "cannot sync directory '%s': %s", out_dir, strerror(errno));
  close(fd);
  return rc;
}

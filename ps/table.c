/* A shard's part of an embedding table (see table.h). */
#include "table.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../common/crc32c.h"
#include "../common/optim.h"
#include "../common/util.h"

/* Unbounded tables: rows in chunks of this many (rows never move, so a
 * chunk's address stays valid while the map grows). */
#define CHUNK_ROWS 4096

struct ps_table {
  ps_table_spec spec;
  ps_optim_config cfg;
  const ps_optimizer *opt;
  uint64_t seed;
  int shard, S;
  int n_slots;
  size_t rec_floats; /* dim * (1 + n_slots) */
  pthread_rwlock_t lock;

  /* bounded: local rows, their counts and records */
  uint64_t local_rows;
  uint32_t *counts; /* local_rows */
  float *recs;      /* local_rows * rec_floats */

  /* unbounded: map id -> row number + 1 (0: empty slot) */
  uint64_t *keys;
  uint32_t *vals;
  size_t map_cap; /* power of 2 */
  size_t n_rows;  /* rows made */
  float **chunks; /* records, CHUNK_ROWS per chunk */
  uint64_t *chunk_ids;  /* the id of every row made (for walks) */
  uint32_t *chunk_counts;
  size_t n_chunks, chunks_cap;

  /* the staged push: positions, their new records and counts */
  size_t st_n, st_cap;
  float *st_recs;
  uint32_t *st_counts;
  int64_t *st_rows; /* bounded: local row; unbounded: row number, or -1 - k for new row k */
  const uint64_t *st_ids;
  size_t st_new;
  int staged;

  /* the id set of a request's check */
  uint64_t *set_keys;
  uint8_t *set_used;
  size_t set_cap;
  pthread_mutex_t set_mu;

  /* statistics (under lock, or atomics for the pulled count) */
  uint64_t rows_held, rows_pushed, rejected;
  _Atomic uint64_t rows_pulled;
};

static uint64_t mix(uint64_t z) {
  z ^= z >> 33;
  z *= 0xff51afd7ed558ccdULL;
  z ^= z >> 33;
  z *= 0xc4ceb9fe1a85ec53ULL;
  z ^= z >> 33;
  return z;
}

ps_table *ps_table_create(const ps_table_spec *spec, const ps_optim_config *optim, uint64_t seed,
                          int shard, int S, char *err) {
  const ps_optimizer *opt = ps_optimizer_find(optim->name);
  if (!opt) {
    ps_seterr(err, PS_EINVAL, "table '%s': optimizer '%s' is not known", spec->name, optim->name);
    return NULL;
  }
  ps_table *t = calloc(1, sizeof *t);
  if (!t) {
    ps_seterr(err, PS_ENOMEM, "out of memory");
    return NULL;
  }
  t->spec = *spec;
  t->cfg = *optim;
  t->opt = opt;
  t->seed = seed;
  t->shard = shard;
  t->S = S;
  t->n_slots = opt->n_slots;
  t->rec_floats = (size_t)spec->dim * (size_t)(1 + opt->n_slots);
  pthread_rwlock_init(&t->lock, NULL);
  pthread_mutex_init(&t->set_mu, NULL);
  if (spec->rows > 0) {
    t->local_rows = ps_table_shard_rows(spec, S, shard);
    size_t n = (size_t)t->local_rows;
    /* calloc: the kernel hands out zero pages as rows are first written. */
    if (t->local_rows > SIZE_MAX / sizeof(float) / t->rec_floats ||
        !(t->counts = calloc(n ? n : 1, sizeof *t->counts)) ||
        !(t->recs = calloc(n ? n * t->rec_floats : 1, sizeof(float)))) {
      ps_seterr(err, PS_ENOMEM,
                "table '%s': out of memory for %" PRIu64 " rows of %d values and %d slot(s)",
                spec->name, t->local_rows, spec->dim, t->n_slots);
      ps_table_destroy(t);
      return NULL;
    }
  }
  return t;
}

void ps_table_destroy(ps_table *t) {
  if (!t) return;
  free(t->counts);
  free(t->recs);
  free(t->keys);
  free(t->vals);
  for (size_t i = 0; i < t->n_chunks; i++) free(t->chunks[i]);
  free(t->chunks);
  free(t->chunk_ids);
  free(t->chunk_counts);
  free(t->st_recs);
  free(t->st_counts);
  free(t->st_rows);
  free(t->set_keys);
  free(t->set_used);
  pthread_rwlock_destroy(&t->lock);
  pthread_mutex_destroy(&t->set_mu);
  free(t);
}

const ps_table_spec *ps_table_spec_of(const ps_table *t) { return &t->spec; }
int ps_table_n_slots(const ps_table *t) { return t->n_slots; }
void ps_table_read_lock(ps_table *t) { pthread_rwlock_rdlock(&t->lock); }
void ps_table_write_lock(ps_table *t) { pthread_rwlock_wrlock(&t->lock); }
void ps_table_unlock(ps_table *t) { pthread_rwlock_unlock(&t->lock); }

/* ---- unbounded tables' map ---- */

/* The row number of id, or -1. */
static int64_t map_find(const ps_table *t, uint64_t id) {
  if (!t->map_cap) return -1;
  size_t m = t->map_cap - 1;
  for (size_t i = (size_t)mix(id) & m;; i = (i + 1) & m) {
    if (!t->vals[i]) return -1;
    if (t->keys[i] == id) return (int64_t)t->vals[i] - 1;
  }
}

static void map_insert(ps_table *t, uint64_t id, uint32_t row) {
  size_t m = t->map_cap - 1;
  size_t i = (size_t)mix(id) & m;
  while (t->vals[i]) i = (i + 1) & m;
  t->keys[i] = id;
  t->vals[i] = row + 1;
}

/* Room for `more` rows beyond those made: the map at most half full, the
 * chunks allocated. Changes no row. */
static int reserve_rows(ps_table *t, size_t more, char *err) {
  size_t want = t->n_rows + more;
  if (want > t->spec.max_rows_per_shard || want >= UINT32_MAX)
    return ps_seterr(err, PS_ERANGE,
                     "table '%s': this push would make shard %d hold %zu rows, above "
                     "max_rows_per_shard %" PRIu64 "; nothing applied",
                     t->spec.name, t->shard, want, t->spec.max_rows_per_shard);
  if (want * 2 > t->map_cap) {
    size_t cap = t->map_cap ? t->map_cap : 1024;
    while (want * 2 > cap) cap *= 2;
    uint64_t *keys = malloc(cap * sizeof *keys);
    uint32_t *vals = calloc(cap, sizeof *vals);
    if (!keys || !vals) {
      free(keys);
      free(vals);
      return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory for %zu rows", t->spec.name,
                       want);
    }
    uint64_t *ok = t->keys;
    uint32_t *ov = t->vals;
    size_t oc = t->map_cap;
    t->keys = keys;
    t->vals = vals;
    t->map_cap = cap;
    for (size_t i = 0; i < oc; i++)
      if (ov[i]) map_insert(t, ok[i], ov[i] - 1);
    free(ok);
    free(ov);
  }
  size_t chunks = (want + CHUNK_ROWS - 1) / CHUNK_ROWS;
  if (chunks > t->chunks_cap) {
    size_t cap = t->chunks_cap ? t->chunks_cap : 16;
    while (cap < chunks) cap *= 2;
    float **c = realloc(t->chunks, cap * sizeof *c);
    if (!c) return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory", t->spec.name);
    t->chunks = c;
    uint64_t *ids = realloc(t->chunk_ids, cap * CHUNK_ROWS * sizeof *ids);
    if (!ids) return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory", t->spec.name);
    t->chunk_ids = ids;
    uint32_t *cnt = realloc(t->chunk_counts, cap * CHUNK_ROWS * sizeof *cnt);
    if (!cnt) return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory", t->spec.name);
    t->chunk_counts = cnt;
    t->chunks_cap = cap;
  }
  while (t->n_chunks < chunks) {
    float *c = malloc(CHUNK_ROWS * t->rec_floats * sizeof(float));
    if (!c) return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory", t->spec.name);
    t->chunks[t->n_chunks++] = c;
  }
  return PS_OK;
}

static float *urow(ps_table *t, size_t row) {
  return t->chunks[row / CHUNK_ROWS] + (row % CHUNK_ROWS) * t->rec_floats;
}

/* The record of a never-pushed row: initial values, initial slots. */
static void init_rec(const ps_table *t, uint64_t id, float *rec) {
  ps_table_init_row(&t->spec, t->seed, id, rec);
  const int d = t->spec.dim;
  for (int k = 0; k < t->n_slots; k++) {
    float v = t->opt->slot_init(&t->cfg, k);
    for (int j = 0; j < d; j++) rec[(size_t)(k + 1) * (size_t)d + (size_t)j] = v;
  }
}

/* ---- checks ---- */

int ps_table_check_ids(ps_table *t, const uint64_t *ids, size_t n, char *err) {
  for (size_t i = 0; i < n; i++) {
    uint64_t local;
    if (!ps_table_id_ok(&t->spec, ids[i]))
      return ps_seterr(err, PS_ERANGE,
                       "table '%s': id %" PRIu64 " (position %zu) is not a row (the table has "
                       "%" PRIu64 ")",
                       t->spec.name, ids[i], i, t->spec.rows);
    int s = ps_table_place(&t->spec, t->S, ids[i], &local);
    if (s != t->shard)
      return ps_seterr(err, PS_EINVAL,
                       "table '%s': id %" PRIu64 " (position %zu) lives on shard %d, not on "
                       "shard %d",
                       t->spec.name, ids[i], i, s, t->shard);
  }
  if (n < 2) return PS_OK;
  /* Duplicates: an open-addressing set of the request's ids. */
  pthread_mutex_lock(&t->set_mu);
  size_t cap = 64;
  while (cap < 2 * n) cap *= 2;
  if (cap > t->set_cap) {
    uint64_t *k = malloc(cap * sizeof *k);
    uint8_t *u = malloc(cap);
    if (!k || !u) {
      free(k);
      free(u);
      pthread_mutex_unlock(&t->set_mu);
      return ps_seterr(err, PS_ENOMEM, "out of memory checking %zu ids", n);
    }
    free(t->set_keys);
    free(t->set_used);
    t->set_keys = k;
    t->set_used = u;
    t->set_cap = cap;
  }
  memset(t->set_used, 0, cap);
  size_t m = cap - 1;
  int rc = PS_OK;
  for (size_t i = 0; i < n && rc == PS_OK; i++) {
    size_t j = (size_t)mix(ids[i]) & m;
    for (;; j = (j + 1) & m) {
      if (!t->set_used[j]) {
        t->set_used[j] = 1;
        t->set_keys[j] = ids[i];
        break;
      }
      if (t->set_keys[j] == ids[i]) {
        rc = ps_seterr(err, PS_EINVAL,
                       "table '%s': id %" PRIu64 " is named twice (position %zu); a request "
                       "names each row once",
                       t->spec.name, ids[i], i);
        break;
      }
    }
  }
  pthread_mutex_unlock(&t->set_mu);
  return rc;
}

/* ---- pulls ---- */

void ps_table_read_rows(ps_table *t, const uint64_t *ids, size_t n, float *out) {
  const size_t d = (size_t)t->spec.dim;
  for (size_t i = 0; i < n; i++) {
    float *o = out + i * d;
    const float *src = NULL;
    if (t->spec.rows) {
      uint64_t local;
      ps_table_place(&t->spec, t->S, ids[i], &local);
      if (t->counts[local]) src = t->recs + local * t->rec_floats;
    } else {
      int64_t r = map_find(t, ids[i]);
      if (r >= 0) src = urow(t, (size_t)r);
    }
    if (src)
      memcpy(o, src, d * sizeof(float));
    else
      ps_table_init_row(&t->spec, t->seed, ids[i], o);
  }
  atomic_fetch_add(&t->rows_pulled, (uint64_t)n);
}

/* ---- pushes ---- */

int ps_table_stage(ps_table *t, const uint64_t *ids, size_t n, const ps_ufloat *grad,
                   float lr_scale, char *err) {
  const size_t d = (size_t)t->spec.dim, rf = t->rec_floats;
  t->staged = 0;
  for (size_t i = 0; i < n * d; i++)
    if (!isfinite(grad[i])) {
      t->rejected++;
      return ps_seterr(err, PS_EINVAL,
                       "table '%s': gradient value %zu of row %" PRIu64 " (position %zu) is %s; "
                       "nothing applied",
                       t->spec.name, i % d, ids[i / d], i / d, isnan(grad[i]) ? "NaN" : "Inf");
    }
  if (n > t->st_cap) {
    size_t cap = n < 1024 ? 1024 : n;
    float *r = malloc(cap * rf * sizeof(float));
    uint32_t *c = malloc(cap * sizeof *c);
    int64_t *w = malloc(cap * sizeof *w);
    if (!r || !c || !w) {
      free(r);
      free(c);
      free(w);
      t->rejected++;
      return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory staging %zu rows",
                       t->spec.name, n);
    }
    free(t->st_recs);
    free(t->st_counts);
    free(t->st_rows);
    t->st_recs = r;
    t->st_counts = c;
    t->st_rows = w;
    t->st_cap = cap;
  }
  size_t fresh = 0;
  const float lr = t->cfg.lr * lr_scale;
  float *slots[PS_OPTIM_MAX_SLOTS];
  for (size_t i = 0; i < n; i++) {
    float *rec = t->st_recs + i * rf;
    const float *cur = NULL;
    uint32_t cnt = 0;
    if (t->spec.rows) {
      uint64_t local;
      ps_table_place(&t->spec, t->S, ids[i], &local);
      t->st_rows[i] = (int64_t)local;
      cnt = t->counts[local];
      if (cnt) cur = t->recs + local * rf;
    } else {
      int64_t r = map_find(t, ids[i]);
      if (r >= 0) {
        t->st_rows[i] = r;
        cur = urow(t, (size_t)r);
        cnt = t->chunk_counts[r];
      } else {
        t->st_rows[i] = -1 - (int64_t)fresh++;
      }
    }
    if (cur)
      memcpy(rec, cur, rf * sizeof(float));
    else
      init_rec(t, ids[i], rec);
    if (cnt == UINT32_MAX) cnt = UINT32_MAX - 1; /* the count saturates */
    t->st_counts[i] = cnt + 1;
    for (int k = 0; k < t->n_slots; k++) slots[k] = rec + (size_t)(k + 1) * d;
    t->opt->apply(&t->cfg, cnt + 1, lr, rec, slots, grad + i * d, d);
    for (size_t j = 0; j < rf; j++)
      if (!isfinite(rec[j])) {
        t->rejected++;
        return ps_seterr(err, PS_EINVAL,
                         "table '%s': the update would make %s %zu of row %" PRIu64
                         " %s; nothing applied",
                         t->spec.name, j < d ? "value" : "optimizer slot value", j % d, ids[i],
                         isnan(rec[j]) ? "NaN" : "Inf");
      }
  }
  if (fresh) {
    int rc = reserve_rows(t, fresh, err);
    if (rc) {
      t->rejected++;
      return rc;
    }
  }
  t->st_n = n;
  t->st_ids = ids;
  t->st_new = fresh;
  t->staged = 1;
  return PS_OK;
}

void ps_table_commit(ps_table *t) {
  if (!t->staged) return;
  const size_t rf = t->rec_floats;
  for (size_t i = 0; i < t->st_n; i++) {
    const float *rec = t->st_recs + i * rf;
    int64_t r = t->st_rows[i];
    if (t->spec.rows) {
      if (!t->counts[r]) t->rows_held++;
      memcpy(t->recs + (size_t)r * rf, rec, rf * sizeof(float));
      t->counts[r] = t->st_counts[i];
    } else {
      if (r < 0) {
        r = (int64_t)t->n_rows++;
        map_insert(t, t->st_ids[i], (uint32_t)r);
        t->chunk_ids[r] = t->st_ids[i];
        t->rows_held++;
      }
      memcpy(urow(t, (size_t)r), rec, rf * sizeof(float));
      t->chunk_counts[r] = t->st_counts[i];
    }
  }
  t->rows_pushed += t->st_n;
  t->staged = 0;
  t->st_ids = NULL;
}

void ps_table_unstage(ps_table *t) {
  t->staged = 0;
  t->st_ids = NULL;
}

void ps_table_stats_get(ps_table *t, ps_table_stats *out) {
  pthread_rwlock_rdlock(&t->lock);
  out->rows_held = t->rows_held;
  out->rows_pushed = t->rows_pushed;
  out->rejected = t->rejected;
  out->rows_pulled = atomic_load(&t->rows_pulled);
  if (t->spec.rows)
    out->bytes = t->rows_held * (t->rec_floats * sizeof(float) + sizeof(uint32_t));
  else
    out->bytes = t->n_chunks * CHUNK_ROWS * (t->rec_floats * sizeof(float) + 12) +
                 t->map_cap * 12;
  pthread_rwlock_unlock(&t->lock);
}

/* ---- checkpoints ---- */

int ps_table_each_row(ps_table *t, ps_table_row_fn fn, void *user) {
  const size_t rf = t->rec_floats;
  if (t->spec.rows) {
    for (uint64_t l = 0; l < t->local_rows; l++) {
      if (!t->counts[l]) continue;
      uint64_t id = ps_table_local_id(&t->spec, t->S, t->shard, l);
      int rc = fn(user, id, t->counts[l], t->recs + l * rf);
      if (rc) return rc;
    }
    return 0;
  }
  for (size_t r = 0; r < t->n_rows; r++) {
    int rc = fn(user, t->chunk_ids[r], t->chunk_counts[r], urow(t, r));
    if (rc) return rc;
  }
  return 0;
}

int ps_table_put_row(ps_table *t, uint64_t id, uint32_t tcount, const float *rec, char *err) {
  uint64_t local;
  if (!ps_table_id_ok(&t->spec, id) || ps_table_place(&t->spec, t->S, id, &local) != t->shard)
    return ps_seterr(err, PS_EINVAL, "table '%s': row %" PRIu64 " is not shard %d's",
                     t->spec.name, id, t->shard);
  const size_t rf = t->rec_floats;
  for (size_t j = 0; j < rf; j++)
    if (!isfinite(rec[j]))
      return ps_seterr(err, PS_EINVAL, "table '%s': row %" PRIu64 " holds a NaN or Inf",
                       t->spec.name, id);
  if (tcount == 0) tcount = 1;
  if (t->spec.rows) {
    if (!t->counts[local]) t->rows_held++;
    memcpy(t->recs + local * rf, rec, rf * sizeof(float));
    t->counts[local] = tcount;
    return PS_OK;
  }
  int64_t r = map_find(t, id);
  if (r < 0) {
    int rc = reserve_rows(t, 1, err);
    if (rc) return rc;
    r = (int64_t)t->n_rows++;
    map_insert(t, id, (uint32_t)r);
    t->chunk_ids[r] = id;
    t->rows_held++;
  }
  memcpy(urow(t, (size_t)r), rec, rf * sizeof(float));
  t->chunk_counts[r] = tcount;
  return PS_OK;
}

void ps_table_clear(ps_table *t) {
  if (t->spec.rows) {
    memset(t->counts, 0, (size_t)t->local_rows * sizeof *t->counts);
  } else {
    if (t->vals) memset(t->vals, 0, t->map_cap * sizeof *t->vals);
    t->n_rows = 0;
  }
  t->rows_held = 0;
}

static int crc_row(void *user, uint64_t id, uint32_t tcount, const float *rec) {
  uint32_t *acc = ((uint32_t **)user)[0];
  const ps_table *t = ((const ps_table **)user)[1];
  uint8_t head[12];
  ps_put_le64(head, id);
  ps_put_le32(head + 8, tcount);
  uint32_t c = ps_crc32c(0, head, sizeof head);
  c = ps_crc32c(c, rec, t->rec_floats * sizeof(float));
  *acc += c;
  return 0;
}

uint32_t ps_table_crc(ps_table *t) {
  uint32_t acc = 0;
  void *u[2] = {&acc, t};
  ps_table_each_row(t, crc_row, u);
  return acc;
}

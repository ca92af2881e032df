/* A sync step's sparse sum of embedding rows (table_sync.h): per table, the
 * rows named in the step in the order they came (ids, contributions, sums)
 * and an open-addressing map from an id to its place. */
#include "ps/state/table_sync.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

typedef struct {
  ps_table *tb;
  int dim;
  size_t n, cap;
  uint64_t *ids;   /* (cap) */
  uint32_t *count; /* (cap) gradients that named the row */
  float *sum;      /* (cap, dim) */
  float *mean;     /* (cap, dim) the staged step's gradient: ps_table_stage reads it */
  uint32_t *map;   /* (map_cap) place + 1, 0: empty */
  size_t map_cap;  /* a power of 2, at least twice n (0: none yet) */
  int staged;
} sum_table;

struct ps_rows_sum {
  int n_tables;
  uint32_t locked; /* tables write-locked by a stage */
  sum_table tab[PS_MAX_TABLES];
};

static size_t slot_of(uint64_t id, size_t cap) {
  uint64_t h = id * 0x9E3779B97F4A7C15ULL;
  h ^= h >> 29;
  return (size_t)h & (cap - 1);
}

static int64_t find(const sum_table *t, uint64_t id) {
  if (!t->map_cap) return -1;
  for (size_t i = slot_of(id, t->map_cap);; i = (i + 1) & (t->map_cap - 1)) {
    uint32_t p = t->map[i];
    if (p == 0) return -1;
    if (t->ids[p - 1] == id) return (int64_t)(p - 1);
  }
}

static void map_put(sum_table *t, uint64_t id, size_t place) {
  size_t i = slot_of(id, t->map_cap);
  while (t->map[i]) i = (i + 1) & (t->map_cap - 1);
  t->map[i] = (uint32_t)(place + 1);
}

/* Room for more rows: the arrays and the map. PS_ENOMEM leaves the rows as
 * they are (an array may have grown). */
static int reserve(sum_table *t, size_t more) {
  size_t need = t->n + more;
  if (need > UINT32_MAX - 1) return PS_ENOMEM;
  if (need > t->cap) {
    size_t cap = t->cap ? t->cap : 16;
    while (cap < need) cap *= 2;
    size_t d = (size_t)t->dim;
    uint64_t *ids = realloc(t->ids, cap * sizeof *ids);
    if (!ids) return PS_ENOMEM;
    t->ids = ids;
    uint32_t *count = realloc(t->count, cap * sizeof *count);
    if (!count) return PS_ENOMEM;
    t->count = count;
    float *sum = realloc(t->sum, cap * d * sizeof *sum);
    if (!sum) return PS_ENOMEM;
    t->sum = sum;
    float *mean = realloc(t->mean, cap * d * sizeof *mean);
    if (!mean) return PS_ENOMEM;
    t->mean = mean;
    t->cap = cap;
  }
  if (2 * need > t->map_cap) {
    size_t mc = t->map_cap ? t->map_cap : 32;
    while (mc < 2 * need) mc *= 2;
    uint32_t *map = calloc(mc, sizeof *map);
    if (!map) return PS_ENOMEM;
    free(t->map);
    t->map = map;
    t->map_cap = mc;
    for (size_t i = 0; i < t->n; i++) map_put(t, t->ids[i], i);
  }
  return PS_OK;
}

ps_rows_sum *ps_rows_sum_create(ps_table *const *tables, int n_tables) {
  if (n_tables < 0 || n_tables > PS_MAX_TABLES) return NULL;
  ps_rows_sum *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->n_tables = n_tables;
  for (int i = 0; i < n_tables; i++) {
    s->tab[i].tb = tables[i];
    s->tab[i].dim = ps_table_spec_of(tables[i])->dim;
  }
  return s;
}

void ps_rows_sum_destroy(ps_rows_sum *s) {
  if (!s) return;
  for (int i = 0; i < s->n_tables; i++) {
    sum_table *t = &s->tab[i];
    free(t->ids);
    free(t->count);
    free(t->sum);
    free(t->mean);
    free(t->map);
  }
  free(s);
}

static const char *nonfinite_word(float v) { return isnan(v) ? "NaN" : "Inf"; }

int ps_rows_sum_add(ps_rows_sum *s, const ps_rows_grad *g, char *err) {
  size_t fresh[PS_MAX_TABLES] = {0};
  uint32_t seen = 0;
  /* Check everything first: the sum changes only when all of g goes in. */
  size_t at = 0;
  for (int k = 0; k < g->n_sec; k++) {
    int ti = g->sec[k].table;
    if (ti < 0 || ti >= s->n_tables || (seen & (1u << ti)))
      return ps_seterr(err, PS_EINVAL, "row section %d names table %d (the step has %d, each once)",
                       k, ti, s->n_tables);
    seen |= 1u << ti;
    const sum_table *t = &s->tab[ti];
    const char *name = ps_table_spec_of(t->tb)->name;
    const size_t d = (size_t)t->dim;
    for (size_t j = 0; j < g->sec[k].n; j++) {
      const float *gv = g->grad + at + j * d;
      int64_t p = find(t, g->sec[k].ids[j]);
      for (size_t c = 0; c < d; c++) {
        if (!isfinite(gv[c]))
          return ps_seterr(err, PS_EINVAL,
                           "table '%s': row %" PRIu64
                           "'s gradient value %zu is %s; nothing "
                           "changed",
                           name, g->sec[k].ids[j], c, nonfinite_word(gv[c]));
        if (p >= 0) {
          float r = t->sum[(size_t)p * d + c] + gv[c];
          if (!isfinite(r))
            return ps_seterr(err, PS_EINVAL,
                             "table '%s': adding row %" PRIu64
                             "'s gradient to the step's sum "
                             "(of %" PRIu32 " gradients) would make value %zu %s; nothing changed",
                             name, g->sec[k].ids[j], t->count[p], c, nonfinite_word(r));
        }
      }
      if (p < 0) fresh[ti]++;
    }
    at += g->sec[k].n * d;
  }
  for (int k = 0; k < g->n_sec; k++) {
    int ti = g->sec[k].table;
    if (reserve(&s->tab[ti], fresh[ti]) != PS_OK)
      return ps_seterr(err, PS_ENOMEM, "out of memory for the step's rows of table '%s'",
                       ps_table_spec_of(s->tab[ti].tb)->name);
  }
  at = 0;
  for (int k = 0; k < g->n_sec; k++) {
    sum_table *t = &s->tab[g->sec[k].table];
    const size_t d = (size_t)t->dim;
    for (size_t j = 0; j < g->sec[k].n; j++) {
      const float *gv = g->grad + at + j * d;
      uint64_t id = g->sec[k].ids[j];
      int64_t p = find(t, id);
      if (p < 0) {
        p = (int64_t)t->n++;
        t->ids[p] = id;
        t->count[p] = 1;
        memcpy(t->sum + (size_t)p * d, gv, d * sizeof(float));
        map_put(t, id, (size_t)p);
      } else {
        float *out = t->sum + (size_t)p * d;
        for (size_t c = 0; c < d; c++) out[c] += gv[c];
        t->count[p]++;
      }
    }
    at += g->sec[k].n * d;
  }
  return PS_OK;
}

static void unlock_all(ps_rows_sum *s) {
  for (int i = s->n_tables - 1; i >= 0; i--)
    if (s->locked & (1u << i)) ps_table_unlock(s->tab[i].tb);
  s->locked = 0;
}

int ps_rows_sum_stage(ps_rows_sum *s, float inv, char *err) {
  for (int i = 0; i < s->n_tables; i++)
    if (s->tab[i].n) {
      ps_table_write_lock(s->tab[i].tb);
      s->locked |= 1u << i;
    }
  for (int i = 0; i < s->n_tables; i++) {
    sum_table *t = &s->tab[i];
    if (!t->n) continue;
    const size_t len = t->n * (size_t)t->dim;
    /* The dense mean's rounding: each sum times the same float factor. */
    for (size_t k = 0; k < len; k++) t->mean[k] = t->sum[k] * inv;
    int rc = ps_table_stage(t->tb, t->ids, NULL, t->n, t->mean, 1.0f, err);
    if (rc != PS_OK) {
      for (int q = 0; q < i; q++)
        if (s->tab[q].staged) {
          ps_table_unstage(s->tab[q].tb);
          s->tab[q].staged = 0;
        }
      unlock_all(s);
      return rc;
    }
    t->staged = 1;
  }
  return PS_OK;
}

static void finish(ps_rows_sum *s, int commit) {
  for (int i = 0; i < s->n_tables; i++)
    if (s->tab[i].staged) {
      if (commit)
        ps_table_commit(s->tab[i].tb);
      else
        ps_table_unstage(s->tab[i].tb);
      s->tab[i].staged = 0;
    }
  unlock_all(s);
}

void ps_rows_sum_commit(ps_rows_sum *s) { finish(s, 1); }
void ps_rows_sum_abort(ps_rows_sum *s) { finish(s, 0); }

void ps_rows_sum_clear(ps_rows_sum *s) {
  for (int i = 0; i < s->n_tables; i++) {
    sum_table *t = &s->tab[i];
    if (t->n && t->map) memset(t->map, 0, t->map_cap * sizeof *t->map);
    t->n = 0;
  }
}

size_t ps_rows_sum_count(const ps_rows_sum *s) {
  size_t n = 0;
  for (int i = 0; i < s->n_tables; i++) n += s->tab[i].n;
  return n;
}

int ps_rows_sum_each(const ps_rows_sum *s, ps_rows_sum_fn fn, void *user) {
  for (int i = 0; i < s->n_tables; i++) {
    const sum_table *t = &s->tab[i];
    for (size_t j = 0; j < t->n; j++) {
      int rc = fn(user, i, t->ids[j], t->count[j], t->sum + j * (size_t)t->dim);
      if (rc) return rc;
    }
  }
  return 0;
}

int ps_rows_sum_put(ps_rows_sum *s, int table, uint64_t id, uint32_t count, const float *sum,
                    char *err) {
  if (table < 0 || table >= s->n_tables)
    return ps_seterr(err, PS_EINVAL, "a step's row names table %d (the job has %d)", table,
                     s->n_tables);
  sum_table *t = &s->tab[table];
  const size_t d = (size_t)t->dim;
  for (size_t c = 0; c < d; c++)
    if (!isfinite(sum[c]))
      return ps_seterr(err, PS_EINVAL, "table '%s': the step's sum of row %" PRIu64 " is %s",
                       ps_table_spec_of(t->tb)->name, id, nonfinite_word(sum[c]));
  int rc = ps_table_check_ids(t->tb, &id, 1, NULL, err);
  if (rc) return rc;
  if (count == 0 || find(t, id) >= 0)
    return ps_seterr(err, PS_EINVAL, "table '%s': the step's row %" PRIu64 " %s",
                     ps_table_spec_of(t->tb)->name, id, count ? "comes twice" : "has no gradient");
  if (reserve(t, 1) != PS_OK)
    return ps_seterr(err, PS_ENOMEM, "out of memory for the step's rows of table '%s'",
                     ps_table_spec_of(t->tb)->name);
  size_t p = t->n++;
  t->ids[p] = id;
  t->count[p] = count;
  memcpy(t->sum + p * d, sum, d * sizeof(float));
  map_put(t, id, p);
  return PS_OK;
}

static int hook_add(void *user, const void *arg, char *err) {
  return ps_rows_sum_add(user, arg, err);
}
static int hook_stage(void *user, float inv, char *err) {
  return ps_rows_sum_stage(user, inv, err);
}
static void hook_commit(void *user) { ps_rows_sum_commit(user); }
static void hook_abort(void *user) { ps_rows_sum_abort(user); }
static void hook_clear(void *user) { ps_rows_sum_clear(user); }

void ps_rows_sum_hooks(ps_rows_sum *s, ps_shard_sync_rows *out) {
  *out = (ps_shard_sync_rows){hook_add, hook_stage, hook_commit, hook_abort, hook_clear, s};
}

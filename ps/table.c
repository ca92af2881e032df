/* A shard's part of an embedding table (see table.h).
 *
 * Speed. A request names thousands of rows scattered over a table of
 * hundreds of megabytes: each row costs a cache miss and, with 4 KiB
 * pages, a TLB miss, which one at a time would dominate everything. So a
 * stored row keeps its update count beside its values (one miss, not two),
 * the row arrays ask for transparent huge pages, and every pass over a
 * request's rows goes in blocks: first it locates the block's rows and
 * prefetches them, then it works on them while the memory system has them
 * in flight together. */
#include "table.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../common/crc32c.h"
#include "../common/optim.h"
#include "../common/util.h"

/* Unbounded tables: rows in chunks of this many (rows never move, so a
 * chunk's address stays valid while the map grows). */
#define CHUNK_ROWS 16384
/* Rows located and prefetched together (a block ahead of the work). */
#define BLK 32
#define HUGE_PAGE ((size_t)2 << 20)

/* A stored row: its update count (a uint32 in the first float's place; 0:
 * never pushed) and its CRC (ps_table_crc's term, in the second), then the
 * record: values, then each slot, dim floats each. */
#define HEAD 2
static inline uint32_t row_count(const float *row) {
  uint32_t c;
  memcpy(&c, row, sizeof c);
  return c;
}
static inline void set_count(float *row, uint32_t c) { memcpy(row, &c, sizeof c); }
static inline uint32_t row_crc_kept(const float *row) {
  uint32_t c;
  memcpy(&c, row + 1, sizeof c);
  return c;
}
static inline void set_crc(float *row, uint32_t c) { memcpy(row + 1, &c, sizeof c); }

struct ps_table {
  ps_table_spec spec;
  ps_optim_config cfg;
  const ps_optimizer *opt;
  uint64_t seed;
  int shard, S;
  int n_slots;
  size_t rec_floats; /* dim * (1 + n_slots) */
  size_t stride;     /* floats per stored row: HEAD + rec_floats */
  pthread_rwlock_t lock;

  /* bounded: local rows, and which were pushed (a bit each, for walks) */
  uint64_t local_rows;
  float *arena; /* local_rows * stride, mapped zeroed */
  size_t arena_bytes;
  int arena_huge; /* asked for huge pages (arena_dense) */
  uint64_t *touched;

  /* unbounded: map id -> row number + 1 (0: empty slot) */
  uint64_t *keys;
  uint32_t *vals;
  size_t map_cap; /* power of 2 */
  size_t n_rows;  /* rows made */
  float **chunks; /* CHUNK_ROWS rows each */
  uint64_t *row_ids; /* the id of every row made (for walks) */
  size_t n_chunks, chunks_cap;

  /* the staged push: for each position its old stored row (or, for a row
   * an unbounded table makes at the commit, the new one), where it goes,
   * and whether a bounded table's row is pushed for the first time; the
   * sum of the new rows' CRCs minus the old ones' */
  size_t st_n, st_cap;
  float *st_rows;
  int64_t *st_where; /* bounded: local row; unbounded: row number, or -1 - k for new row k */
  uint8_t *st_born;  /* bounded: 1 where the row had never been pushed */
  size_t *st_done;   /* per share (SHARE positions): the end of the positions it changed */
  uint32_t st_crc;
  const uint64_t *st_ids;
  size_t st_new; /* rows made (unbounded) or pushed for the first time (bounded) */
  int staged;

  /* the id set of a request's check */
  uint64_t *set_keys;
  uint8_t *set_used;
  size_t set_cap;
  pthread_mutex_t set_mu;

  /* the sum of the pushed rows' CRCs (ps_table_crc), kept as rows change */
  uint32_t crc_sum;
  /* statistics (under lock, or atomics for the pulled count) */
  uint64_t rows_held, rows_pushed, rejected;
  _Atomic uint64_t rows_pulled;
};

static uint64_t mix(uint64_t z) { return ps_fmix64(z); }

/* Zeroed memory for rows, in huge pages where the kernel gives them and
 * the area is small enough to be held whole anyway: a huge page is made
 * whole by the first row touched in it, so a large table of which a
 * batch stream touches few rows would hold 2 MiB per row touched (a
 * 100M-row table touched on 3000 rows: 6 GiB instead of 12 MiB). Above
 * HUGE_AREA_MAX the pages are the base size: memory grows with the rows
 * touched, not the rows declared, until arena_dense() finds the rows dense
 * enough for huge pages. */
#define HUGE_AREA_MAX ((size_t)512 << 20)
static void *rows_alloc(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
  if (bytes >= HUGE_PAGE && bytes <= HUGE_AREA_MAX) madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

/* A bounded table's arena above HUGE_AREA_MAX goes over to huge pages once
 * it holds a row per 4 KiB page of it: rows are placed at random, so base
 * pages then hold about 63% of the arena already, and huge pages cost at
 * most 1.6 times that, while every row read or pushed after it costs a
 * TLB miss less (a request's rows are scattered over the arena: reading
 * 10,000 rows of a 4M-row dim-16 table held on 200,000 rows took 1.5
 * times as long in base pages). New pages come huge at once; the pages
 * already mapped are collapsed by khugepaged in its own time, not here
 * (MADV_COLLAPSE would copy the arena under the write lock: 1.2 s of held
 * pushes for 544 MB, measured). Write lock held. */
static void arena_dense(ps_table *t) {
#ifdef MADV_HUGEPAGE
  if (t->arena_huge || t->rows_held < t->arena_bytes / 4096) return;
  t->arena_huge = 1;
  madvise(t->arena, t->arena_bytes, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}
static void rows_free(void *p, size_t bytes) {
  if (p) munmap(p, bytes);
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
  t->stride = HEAD + t->rec_floats;
  pthread_rwlock_init(&t->lock, NULL);
  pthread_mutex_init(&t->set_mu, NULL);
  if (spec->rows > 0) {
    t->local_rows = ps_table_shard_rows(spec, S, shard);
    size_t n = (size_t)t->local_rows;
    int ok = t->local_rows <= SIZE_MAX / sizeof(float) / t->stride / 2;
    if (ok) {
      t->arena_bytes = (n ? n : 1) * t->stride * sizeof(float);
      /* Untouched pages cost no memory: the kernel maps them as rows are
       * first written. */
      t->arena = rows_alloc(t->arena_bytes);
      t->arena_huge = t->arena_bytes <= HUGE_AREA_MAX;
      t->touched = calloc((n + 63) / 64 + 1, sizeof *t->touched);
      ok = t->arena && t->touched;
    }
    if (!ok) {
      ps_seterr(err, PS_ENOMEM,
                "table '%s': cannot map %" PRIu64 " rows of %d values and %d slot(s)", spec->name,
                t->local_rows, spec->dim, t->n_slots);
      ps_table_destroy(t);
      return NULL;
    }
  }
  return t;
}

static size_t chunk_bytes(const ps_table *t) { return CHUNK_ROWS * t->stride * sizeof(float); }

void ps_table_destroy(ps_table *t) {
  if (!t) return;
  rows_free(t->arena, t->arena_bytes);
  free(t->touched);
  free(t->keys);
  free(t->vals);
  for (size_t i = 0; i < t->n_chunks; i++) rows_free(t->chunks[i], chunk_bytes(t));
  free(t->chunks);
  free(t->row_ids);
  free(t->st_rows);
  free(t->st_where);
  free(t->st_born);
  free(t->st_done);
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

static int64_t map_find_from(const ps_table *t, uint64_t id, size_t i) {
  size_t m = t->map_cap - 1;
  for (;; i = (i + 1) & m) {
    if (!t->vals[i]) return -1;
    if (t->keys[i] == id) return (int64_t)t->vals[i] - 1;
  }
}

/* The row number of id, or -1. */
static int64_t map_find(const ps_table *t, uint64_t id) {
  if (!t->map_cap) return -1;
  return map_find_from(t, id, (size_t)mix(id) & (t->map_cap - 1));
}

static void map_insert(ps_table *t, uint64_t id, uint32_t row) {
  size_t m = t->map_cap - 1;
  size_t i = (size_t)mix(id) & m;
  while (t->vals[i]) i = (i + 1) & m;
  t->keys[i] = id;
  t->vals[i] = row + 1;
}

/* Room for `more` rows beyond those made: the map at most half full, the
 * chunks mapped. Changes no row. */
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
    uint64_t *ids = realloc(t->row_ids, cap * CHUNK_ROWS * sizeof *ids);
    if (!ids) return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory", t->spec.name);
    t->row_ids = ids;
    t->chunks_cap = cap;
  }
  while (t->n_chunks < chunks) {
    float *c = rows_alloc(chunk_bytes(t));
    if (!c) return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory", t->spec.name);
    t->chunks[t->n_chunks++] = c;
  }
  return PS_OK;
}

static float *urow(const ps_table *t, size_t row) {
  return t->chunks[row / CHUNK_ROWS] + (row % CHUNK_ROWS) * t->stride;
}

/* Prefetches the cache lines of floats [0, n) of a stored row: a pull
 * reads the head and the values only, a push the whole row. */
static void prefetch_row(const float *row, size_t n, int write) {
  uintptr_t a = (uintptr_t)row & ~(uintptr_t)63, e = (uintptr_t)(row + n);
  if (write)
    for (; a < e; a += 64) __builtin_prefetch((const void *)a, 1, 3);
  else
    for (; a < e; a += 64) __builtin_prefetch((const void *)a, 0, 3);
}

/* Rows are located a block ahead of the work on them: aim() computes
 * where each row of a block lives and prefetches it (bounded: the row;
 * unbounded: the map's slot), find() then gives the stored row (NULL:
 * never pushed) and where it goes (bounded: the local row; unbounded: the
 * row number, -1 when none). */
typedef struct {
  int64_t where[BLK];
  size_t slot[BLK];
  size_t m;
} block;

static void aim(const ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t m,
                int write, block *b) {
  b->m = m;
  if (t->spec.rows) {
    const size_t span = write ? t->stride : HEAD + (size_t)t->spec.dim;
    for (size_t j = 0; j < m; j++) {
      uint64_t local;
      if (locals)
        local = locals[j];
      else
        ps_table_place(&t->spec, t->S, ids[j], &local);
      b->where[j] = (int64_t)local;
      prefetch_row(t->arena + local * t->stride, span, write);
    }
    return;
  }
  if (!t->map_cap) return;
  for (size_t j = 0; j < m; j++) {
    b->slot[j] = (size_t)mix(ids[j]) & (t->map_cap - 1);
    __builtin_prefetch(&t->vals[b->slot[j]], 0, 3);
    __builtin_prefetch(&t->keys[b->slot[j]], 0, 3);
  }
}

static float *find(const ps_table *t, const uint64_t *ids, block *b, size_t j) {
  if (t->spec.rows) {
    float *row = t->arena + (size_t)b->where[j] * t->stride;
    return row_count(row) ? row : NULL;
  }
  b->where[j] = t->map_cap ? map_find_from(t, ids[j], b->slot[j]) : -1;
  return b->where[j] >= 0 ? urow(t, (size_t)b->where[j]) : NULL;
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

/* CRC-32C of (id, count, record) of a stored row. */
static uint32_t row_crc(const ps_table *t, uint64_t id, const float *row) {
  uint8_t head[12];
  ps_put_le64(head, id);
  ps_put_le32(head + 8, row_count(row));
  uint32_t c = ps_crc32c(0, head, sizeof head);
  return ps_crc32c(c, row + HEAD, t->rec_floats * sizeof(float));
}

/* ---- checks ---- */

int ps_table_check_ids(ps_table *t, const uint64_t *ids, size_t n, uint64_t *locals,
                       char *err) {
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
    if (locals) locals[i] = local;
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

/* ---- sharing a request's rows between two threads ----
 *
 * Requests of at least SPLIT_ROWS rows are worked on by the calling thread
 * and a helper together (rows are distinct, so no two positions touch one
 * row), each taking the next SHARE positions from a counter until none
 * are left. On a machine whose cores are busy the helper may start late,
 * or not run for a while: it then takes fewer shares, and the caller waits
 * for one share at most, not for half of the request. */
#define SPLIT_ROWS 2048
#define SHARE 512

typedef struct {
  _Atomic size_t next; /* the first position not taken yet */
  size_t n;
  void (*fn)(void *ctx, size_t lo, size_t hi, int who); /* who: 0 caller, 1 helper */
  void *ctx;
  _Atomic int stop; /* take no more shares */
} share;

static void share_run(share *sh, int who) {
  while (!atomic_load_explicit(&sh->stop, memory_order_relaxed)) {
    size_t lo = atomic_fetch_add(&sh->next, (size_t)SHARE);
    if (lo >= sh->n) return;
    sh->fn(sh->ctx, lo, sh->n - lo < SHARE ? sh->n : lo + SHARE, who);
  }
}

static void *share_helper(void *arg) {
  share_run(arg, 1);
  return NULL;
}

static void share_all(share *sh) {
  pthread_t helper;
  int threaded = sh->n >= SPLIT_ROWS && pthread_create(&helper, NULL, share_helper, sh) == 0;
  share_run(sh, 0);
  if (threaded) pthread_join(helper, NULL);
}

/* ---- pulls ---- */

typedef struct {
  ps_table *t;
  const uint64_t *ids, *locals;
  size_t n;
  float *out;
} read_part;

static void read_range(read_part *p) {
  ps_table *t = p->t;
  const size_t d = (size_t)t->spec.dim, n = p->n;
  const uint64_t *ids = p->ids, *locals = p->locals;
  block cur, next;
  if (n) aim(t, ids, locals, n < BLK ? n : BLK, 0, &next);
  for (size_t b = 0; b < n; b += BLK) {
    cur = next;
    size_t nb = b + BLK;
    if (nb < n)
      aim(t, ids + nb, locals ? locals + nb : NULL, n - nb < BLK ? n - nb : BLK, 0, &next);
    for (size_t j = 0; j < cur.m; j++) {
      float *o = p->out + (b + j) * d;
      const float *row = find(t, ids + b, &cur, j);
      if (row)
        memcpy(o, row + HEAD, d * sizeof(float));
      else
        ps_table_init_row(&t->spec, t->seed, ids[b + j], o);
    }
  }
}

static void read_share(void *ctx, size_t lo, size_t hi, int who) {
  (void)who;
  const read_part *r = ctx;
  read_part p = {r->t, r->ids + lo, r->locals ? r->locals + lo : NULL, hi - lo,
                 r->out + lo * (size_t)r->t->spec.dim};
  read_range(&p);
}

void ps_table_read_rows(ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t n,
                        float *out) {
  read_part r = {t, ids, locals, n, out};
  share sh = {.n = n, .fn = read_share, .ctx = &r};
  share_all(&sh);
  atomic_fetch_add(&t->rows_pulled, (uint64_t)n);
}

/* ---- pushes ---- */

/* 1 when none of v[0..n) is NaN or Inf (an exponent of all ones), in one
 * pass the compiler vectorizes; the caller looks for the value only when
 * there is one. */
static int all_finite(const ps_ufloat *v, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t b;
    memcpy(&b, (const void *)(v + i), sizeof b);
    bad |= (b & 0x7f800000u) == 0x7f800000u;
  }
  return !bad;
}

/* Grows the staging arrays to n positions. */
static int stage_room(ps_table *t, size_t n, char *err) {
  if (n <= t->st_cap) return PS_OK;
  size_t cap = n < 1024 ? 1024 : n;
  float *r = malloc(cap * t->stride * sizeof(float));
  int64_t *w = malloc(cap * sizeof *w);
  uint8_t *c = malloc(cap * sizeof *c);
  size_t *dn = malloc((cap / SHARE + 1) * sizeof *dn);
  if (!r || !w || !c || !dn) {
    free(r);
    free(w);
    free(c);
    free(dn);
    return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory staging %zu rows", t->spec.name,
                     n);
  }
  free(t->st_rows);
  free(t->st_where);
  free(t->st_born);
  free(t->st_done);
  t->st_rows = r;
  t->st_where = w;
  t->st_born = c;
  t->st_done = dn;
  t->st_cap = cap;
  return PS_OK;
}

/* Puts back the rows [lo, hi) of the staged push changed in place, from
 * their copies. */
static void undo(ps_table *t, size_t lo, size_t hi) {
  const size_t st = t->stride;
  for (size_t i = lo; i < hi; i++) {
    int64_t r = t->st_where[i];
    if (t->spec.rows)
      memcpy(t->arena + (size_t)r * st, t->st_rows + i * st, st * sizeof(float));
    else if (r >= 0)
      memcpy(urow(t, (size_t)r), t->st_rows + i * st, st * sizeof(float));
  }
}

/* One part of a staged push: positions [lo, hi). */
typedef struct {
  ps_table *t;
  const uint64_t *ids, *locals;
  const ps_ufloat *grad;
  float lr;
  size_t lo, hi;
  size_t done;  /* positions [lo, done) changed (to undo on failure) */
  size_t fresh; /* rows an unbounded table does not have yet; bounded: never pushed */
  uint32_t crc; /* the sum of the new rows' CRCs minus the old rows' */
  int rc;
  char err[PS_ERRLEN];
} stage_part;

static void stage_range(stage_part *p) {
  ps_table *t = p->t;
  const uint64_t *ids = p->ids;
  const size_t d = (size_t)t->spec.dim, st = t->stride;
  float *slots[PS_OPTIM_MAX_SLOTS];
  block cur, next;
  const size_t lo = p->lo, hi = p->hi;
  p->done = lo;
  p->rc = PS_OK;
  if (lo < hi)
    aim(t, ids + lo, p->locals ? p->locals + lo : NULL, hi - lo < BLK ? hi - lo : BLK, 1, &next);
  for (size_t b = lo; b < hi; b += BLK) {
    cur = next;
    size_t nb = b + BLK;
    if (nb < hi)
      aim(t, ids + nb, p->locals ? p->locals + nb : NULL, hi - nb < BLK ? hi - nb : BLK, 1,
          &next);
    for (size_t j = 0; j < cur.m; j++) {
      const size_t i = b + j;
      const ps_ufloat *g = p->grad + i * d;
      if (!all_finite(g, d))
        for (size_t v = 0; v < d; v++)
          if (!isfinite(g[v])) {
            p->rc = ps_seterr(p->err, PS_EINVAL,
                              "table '%s': gradient value %zu of row %" PRIu64
                              " (position %zu) is %s; nothing applied",
                              t->spec.name, v, ids[i], i, isnan(g[v]) ? "NaN" : "Inf");
            return;
          }
      float *row = find(t, ids + b, &cur, j);
      float *aside = t->st_rows + i * st;
      uint32_t cnt = 0, old_crc = 0;
      if (t->spec.rows) {
        row = t->arena + (size_t)cur.where[j] * st;
        memcpy(aside, row, st * sizeof(float));
        cnt = row_count(row);
        if (cnt) {
          old_crc = row_crc_kept(row);
        } else {
          init_rec(t, ids[i], row + HEAD);
          p->fresh++;
        }
        t->st_where[i] = cur.where[j];
        t->st_born[i] = cnt == 0;
      } else if (row) {
        memcpy(aside, row, st * sizeof(float));
        cnt = row_count(row);
        old_crc = row_crc_kept(row);
        t->st_where[i] = cur.where[j];
      } else {
        /* made at the commit, from here */
        row = aside;
        init_rec(t, ids[i], row + HEAD);
        t->st_where[i] = -1;
        p->fresh++;
      }
      p->done = i + 1;
      if (cnt < UINT32_MAX) cnt++; /* the count saturates */
      set_count(row, cnt);
      float *rec = row + HEAD;
      for (int k = 0; k < t->n_slots; k++) slots[k] = rec + (size_t)(k + 1) * d;
      t->opt->apply(&t->cfg, cnt, p->lr, rec, slots, g, d);
      if (!all_finite(rec, t->rec_floats))
        for (size_t v = 0; v < t->rec_floats; v++)
          if (!isfinite(rec[v])) {
            p->rc = ps_seterr(p->err, PS_EINVAL,
                              "table '%s': the update would make %s %zu of row %" PRIu64
                              " %s; nothing applied",
                              t->spec.name, v < d ? "value" : "optimizer slot value", v % d,
                              ids[i], isnan(rec[v]) ? "NaN" : "Inf");
            return;
          }
      uint32_t c = row_crc(t, ids[i], row);
      set_crc(row, c);
      p->crc += c - old_crc;
    }
  }
}

typedef struct {
  ps_table *t;
  const uint64_t *ids, *locals;
  const ps_ufloat *grad;
  float lr;
  _Atomic int *stop;
  size_t fresh[2];
  uint32_t crc[2];
  size_t fail[2]; /* the position of each thread's refused share, SIZE_MAX: none */
  int rc[2];
  char err[2][PS_ERRLEN];
} stage_ctx;

static void stage_share(void *ctx, size_t lo, size_t hi, int who) {
  stage_ctx *c = ctx;
  stage_part p = {.t = c->t, .ids = c->ids, .locals = c->locals, .grad = c->grad, .lr = c->lr,
                  .lo = lo, .hi = hi};
  stage_range(&p);
  c->t->st_done[lo / SHARE] = p.done;
  c->fresh[who] += p.fresh;
  c->crc[who] += p.crc;
  if (p.rc != PS_OK) {
    c->fail[who] = lo;
    c->rc[who] = p.rc;
    memcpy(c->err[who], p.err, PS_ERRLEN);
    atomic_store(c->stop, 1);
  }
}

/* The update is made in place, each row's old bytes copied aside first (one
 * copy per row, and the row is in cache for the update after it); a refusal
 * puts them back. A row an unbounded table does not have yet is built in
 * the staging area and made at the commit. Pulls cannot see the rows
 * meanwhile: the write lock is held from here to the commit. */
int ps_table_stage(ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t n,
                   const ps_ufloat *grad, float lr_scale, char *err) {
  t->staged = 0;
  int rc = stage_room(t, n, err);
  if (rc) {
    t->rejected++;
    return rc;
  }
  stage_ctx c = {.t = t, .ids = ids, .locals = locals, .grad = grad, .lr = t->cfg.lr * lr_scale,
                 .fail = {SIZE_MAX, SIZE_MAX}};
  share sh = {.n = n, .fn = stage_share, .ctx = &c};
  c.stop = &sh.stop;
  share_all(&sh);
  size_t fresh = c.fresh[0] + c.fresh[1];
  uint32_t crc = c.crc[0] + c.crc[1];
  if (c.fail[0] != SIZE_MAX || c.fail[1] != SIZE_MAX) {
    /* The first refused position's message, as a single thread would give:
     * every share before the failing one was taken, and run to its end. */
    const int w = c.fail[1] < c.fail[0];
    size_t taken = atomic_load(&sh.next) / SHARE, shares = (n + SHARE - 1) / SHARE;
    if (taken > shares) taken = shares;
    for (size_t k = 0; k < taken; k++) undo(t, k * SHARE, t->st_done[k]);
    t->rejected++;
    snprintf(err, PS_ERRLEN, "%s", c.err[w]);
    return c.rc[w];
  }
  if (!t->spec.rows && fresh && (rc = reserve_rows(t, fresh, err)) != 0) {
    undo(t, 0, n);
    t->rejected++;
    return rc;
  }
  t->st_n = n;
  t->st_ids = ids;
  t->st_new = fresh;
  t->st_crc = crc;
  t->staged = 1;
  return PS_OK;
}

/* Only the rows pushed for the first time need more than the sums: a
 * bounded table's row is marked touched (a row is touched exactly when its
 * count is not 0), an unbounded table's is made. */
void ps_table_commit(ps_table *t) {
  if (!t->staged) return;
  const size_t st = t->stride;
  for (size_t i = 0; i < t->st_n && t->st_new; i++) {
    int64_t r = t->st_where[i];
    if (t->spec.rows) {
      if (t->st_born[i]) {
        t->touched[r >> 6] |= 1ULL << (r & 63);
        t->rows_held++;
      }
    } else if (r < 0) {
      r = (int64_t)t->n_rows++;
      map_insert(t, t->st_ids[i], (uint32_t)r);
      t->row_ids[r] = t->st_ids[i];
      t->rows_held++;
      memcpy(urow(t, (size_t)r), t->st_rows + i * st, st * sizeof(float));
    }
  }
  if (t->spec.rows && t->st_new) arena_dense(t);
  t->crc_sum += t->st_crc;
  t->rows_pushed += t->st_n;
  t->staged = 0;
  t->st_ids = NULL;
}

void ps_table_unstage(ps_table *t) {
  if (t->staged) undo(t, 0, t->st_n);
  t->staged = 0;
  t->st_ids = NULL;
}

void ps_table_stats_get(ps_table *t, ps_table_stats *out) {
  pthread_rwlock_rdlock(&t->lock);
  out->rows_held = t->rows_held;
  out->rows_pushed = t->rows_pushed;
  out->rejected = t->rejected;
  out->rows_pulled = atomic_load(&t->rows_pulled);
  const uint64_t row_bytes = t->stride * sizeof(float);
  if (t->spec.rows)
    out->bytes = t->rows_held * row_bytes + ((t->local_rows + 63) / 64) * 8;
  else
    out->bytes = t->n_chunks * CHUNK_ROWS * (row_bytes + 8) + t->map_cap * 12;
  pthread_rwlock_unlock(&t->lock);
}

/* ---- checkpoints ---- */

int ps_table_each_row(ps_table *t, ps_table_row_fn fn, void *user) {
  if (t->spec.rows) {
    for (uint64_t w = 0; w < (t->local_rows + 63) / 64; w++) {
      uint64_t bits = t->touched[w];
      while (bits) {
        uint64_t l = w * 64 + (uint64_t)__builtin_ctzll(bits);
        bits &= bits - 1;
        const float *row = t->arena + l * t->stride;
        uint64_t id = ps_table_local_id(&t->spec, t->S, t->shard, l);
        int rc = fn(user, id, row_count(row), row + HEAD);
        if (rc) return rc;
      }
    }
    return 0;
  }
  for (size_t r = 0; r < t->n_rows; r++) {
    const float *row = urow(t, r);
    int rc = fn(user, t->row_ids[r], row_count(row), row + HEAD);
    if (rc) return rc;
  }
  return 0;
}

int ps_table_put_row(ps_table *t, uint64_t id, uint32_t tcount, const float *rec, char *err) {
  uint64_t local;
  if (!ps_table_id_ok(&t->spec, id) || ps_table_place(&t->spec, t->S, id, &local) != t->shard)
    return ps_seterr(err, PS_EINVAL, "table '%s': row %" PRIu64 " is not shard %d's",
                     t->spec.name, id, t->shard);
  for (size_t j = 0; j < t->rec_floats; j++)
    if (!isfinite(rec[j]))
      return ps_seterr(err, PS_EINVAL, "table '%s': row %" PRIu64 " holds a NaN or Inf",
                       t->spec.name, id);
  if (tcount == 0) tcount = 1;
  float *dst;
  if (t->spec.rows) {
    dst = t->arena + local * t->stride;
    uint64_t bit = 1ULL << (local & 63);
    if (t->touched[local >> 6] & bit) {
      t->crc_sum -= row_crc_kept(dst);
    } else {
      t->rows_held++;
      arena_dense(t);
    }
    t->touched[local >> 6] |= bit;
  } else {
    int64_t r = map_find(t, id);
    if (r < 0) {
      int rc = reserve_rows(t, 1, err);
      if (rc) return rc;
      r = (int64_t)t->n_rows++;
      map_insert(t, id, (uint32_t)r);
      t->row_ids[r] = id;
      t->rows_held++;
      dst = urow(t, (size_t)r);
    } else {
      dst = urow(t, (size_t)r);
      t->crc_sum -= row_crc_kept(dst);
    }
  }
  set_count(dst, tcount);
  memcpy(dst + HEAD, rec, t->rec_floats * sizeof(float));
  uint32_t c = row_crc(t, id, dst);
  set_crc(dst, c);
  t->crc_sum += c;
  return PS_OK;
}

void ps_table_clear(ps_table *t) {
  if (t->spec.rows) {
    /* Give the pages back; the mapping reads as zeros (never pushed). */
    madvise(t->arena, t->arena_bytes, MADV_DONTNEED);
#ifdef MADV_NOHUGEPAGE
    if (t->arena_bytes > HUGE_AREA_MAX && t->arena_huge) {
      madvise(t->arena, t->arena_bytes, MADV_NOHUGEPAGE);
      t->arena_huge = 0;
    }
#endif
    memset(t->touched, 0, ((t->local_rows + 63) / 64 + 1) * sizeof *t->touched);
  } else {
    if (t->vals) memset(t->vals, 0, t->map_cap * sizeof *t->vals);
    t->n_rows = 0;
  }
  t->rows_held = 0;
  t->crc_sum = 0;
}

uint32_t ps_table_crc(ps_table *t) { return t->crc_sum; }

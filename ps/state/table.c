/* sched_getcpu, CPU_SET (the helper kept off the caller's CPU). */
#define _GNU_SOURCE
/* A shard's part of an embedding table (see table.h).
 *
 * Speed. A request names thousands of rows scattered over a table of
 * hundreds of megabytes: each row costs a cache miss and, with 4 KiB
 * pages, a TLB miss, which one at a time would dominate everything. So a
 * stored row keeps its update count beside its values (one miss, not two),
 * the row arrays ask for transparent huge pages, a request's rows are
 * visited in the order of their addresses (the check sorts them), and
 * every pass over them prefetches a rolling distance ahead of its work
 * (about 48 cache lines), so that the memory system has many rows in
 * flight together; a large request's passes are shared with a helper
 * thread. */
#include "ps/state/table.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
/* Linux 6.1's synchronous collapse, which glibc's headers may not name yet
 * (its value in the generic ABI of x86-64 and arm64; an older kernel
 * answers EINVAL). */
#if defined(__linux__) && !defined(MADV_COLLAPSE) && (defined(__x86_64__) || defined(__aarch64__))
#define MADV_COLLAPSE 25
#endif

#include "common/half.h"
#include "common/optim.h"
#include "common/util.h"

/* Unbounded tables: rows in chunks of this many (rows never move, so a
 * chunk's address stays valid while the map grows). */
#define CHUNK_ROWS 16384
/* Rows located and prefetched together (a block ahead of the work). */
#define BLK 32
/* Cache lines a push's pass keeps in flight ahead of its work. */
#ifndef AHEAD_LINES
#define AHEAD_LINES 48
#endif
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
  pthread_t collapse_thread; /* collapses the pages mapped before (arena_dense) */
  int collapsing;            /* the thread was started (joined by collapse_join) */
  _Atomic int collapse_stop;
  uint64_t *touched;

  /* unbounded: map id -> row number + 1 (0: empty slot) */
  uint64_t *keys;
  uint32_t *vals;
  size_t map_cap; /* power of 2 */
  size_t n_rows;  /* rows made */
  float **chunks; /* CHUNK_ROWS rows each */
  uint64_t *row_ids; /* the id of every row made (for walks) */
  size_t n_chunks, chunks_cap;

  /* the staged push (checked, not applied: ps_table_commit applies it):
   * its ids, gradient and learning rate, and for each position where its
   * row is and whether a bounded table's row is pushed for the first time;
   * an unbounded table's rows to make are built in st_rows (stride floats
   * per position) */
  size_t st_n, st_cap;
  float *st_rows;
  int64_t *st_where; /* unbounded: row number, or -1 for a new row; bounded: room for
                      * st_locals when the caller kept none */
  uint8_t *st_born;  /* bounded: 1 where the row had never been pushed */
  const uint64_t *st_ids, *st_locals;
  const uint32_t *st_order; /* the commit's visiting order (bounded tables), or NULL */
  const ps_ufloat *st_grad;
  const ps_ufloat *const *st_grows; /* or each position's row of it (ps_table_stage_rows) */
  float st_lr;
  size_t st_new; /* rows made (unbounded) or pushed for the first time (bounded) */
  ps_optim_bounds st_bounds; /* the table's bounds once the staged push is applied */
  int staged;

  /* Upper bounds on |value| and |slot k| over every row, held or not (a
   * row never pushed has its initial record): while the optimizer's bound
   * function says a push cannot make them non-finite, a push is applied
   * without a trial (see ps_table_stage). */
  ps_optim_bounds bounds;

  /* a check's set of the request's ids (unbounded tables) */
  uint64_t *set_keys;
  uint8_t *set_used;
  size_t set_cap;
  int *chk_shard;       /* a check's placements: shards */
  uint64_t *chk_local;  /* and local rows, where the caller keeps none */
  uint32_t *chk_order, *chk_tmp; /* its sort by local row */
  size_t chk_cap;
  pthread_mutex_t set_mu;

  /* the sum of the pushed rows' CRCs (ps_table_crc), kept as rows change */
  uint32_t crc_sum;
  /* statistics (under lock, or atomics for the pulled count) */
  uint64_t rows_held, rows_pushed, rejected;
  _Atomic uint64_t rows_pulled;
};

static uint64_t mix(uint64_t z) { return ps_fmix64(z); }

/* The staged gradient's row of position i. */
static inline const ps_ufloat *grad_of(const ps_table *t, size_t i) {
  return t->st_grows ? t->st_grows[i] : t->st_grad + i * (size_t)t->spec.dim;
}
static void init_bounds(ps_table *t);

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
 * TLB miss less (a request's rows are scattered over the arena: a push of
 * 10,000 rows of a 4M-row dim-16 table held on 200,000 rows spent most of
 * its time in page walks). New pages come huge at once; the pages already
 * mapped are collapsed by a thread of the table's (MADV_COLLAPSE, 32 MiB
 * at a time, without the table's lock: the kernel makes an access to a
 * piece being collapsed wait for it, as it does for khugepaged), not under
 * the write lock (544 MB at once held pushes 1.2 s, measured). Where the
 * kernel has no MADV_COLLAPSE, khugepaged does it in its own time. Write
 * lock held. */
#if defined(MADV_HUGEPAGE) && defined(MADV_COLLAPSE)
#define COLLAPSE_PIECE ((size_t)32 << 20)
static void *collapse_main(void *arg) {
  ps_table *t = arg;
  for (size_t off = 0; off < t->arena_bytes && !atomic_load(&t->collapse_stop);
       off += COLLAPSE_PIECE) {
    const size_t len = t->arena_bytes - off < COLLAPSE_PIECE ? t->arena_bytes - off : COLLAPSE_PIECE;
    if (madvise((char *)t->arena + off, len, MADV_COLLAPSE) != 0 && errno == EINVAL) break;
  }
  return NULL;
}
#endif

/* Stops the collapse thread, if one runs, and waits for it. */
static void collapse_join(ps_table *t) {
  if (!t->collapsing) return;
  atomic_store(&t->collapse_stop, 1);
  pthread_join(t->collapse_thread, NULL);
  t->collapsing = 0;
  atomic_store(&t->collapse_stop, 0);
}

static void arena_dense(ps_table *t) {
#ifdef MADV_HUGEPAGE
  if (t->arena_huge || t->rows_held < t->arena_bytes / 4096) return;
  t->arena_huge = 1;
  madvise(t->arena, t->arena_bytes, MADV_HUGEPAGE);
#ifdef MADV_COLLAPSE
  t->collapsing = pthread_create(&t->collapse_thread, NULL, collapse_main, t) == 0;
#endif
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
  init_bounds(t);
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
  collapse_join(t);
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
  free(t->set_keys);
  free(t->set_used);
  free(t->chk_shard);
  free(t->chk_local);
  free(t->chk_order);
  free(t->chk_tmp);
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

/* A bounded table's local row of position j: from the check's placements
 * when the caller kept them, else placed again. */
static uint64_t local_row(const ps_table *t, const uint64_t *ids, const uint64_t *locals,
                          size_t j) {
  uint64_t local;
  if (locals) return locals[j];
  ps_table_place(&t->spec, t->S, ids[j], &local);
  return local;
}

static void aim(const ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t m,
                int write, block *b) {
  b->m = m;
  if (t->spec.rows) {
    const size_t span = write ? t->stride : HEAD + (size_t)t->spec.dim;
    for (size_t j = 0; j < m; j++) {
      const uint64_t local = local_row(t, ids, locals, j);
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

/* The checksum of (id, count, record) of a stored row, which
 * ps_table_crc sums over the pushed rows (replicas and restarts compare
 * the sums). It runs once per row of every push, so it is cheap: the
 * record's 64-bit words go round-robin into four multiply-xor chains,
 * which the CPU runs side by side (a CRC-32C of the row, one chain of
 * dependent instructions, took a fifth of a dim-16 push's commit), and the
 * chains are combined and mixed. Each step of a chain is a bijection of
 * its state and of its word, so a change to any one word changes the
 * chain's end, and so the checksum before its last mix. */
#define SUM_K 0x9fb21c651e98df25ULL
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint32_t row_sum(uint64_t id, uint32_t count, const float *rec, size_t nf) {
  const size_t nw = nf / 2;
  uint64_t h0 = (id ^ 0x243f6a8885a308d3ULL) * SUM_K;
  uint64_t h1 = ((uint64_t)count ^ 0x13198a2e03707344ULL) * SUM_K;
  uint64_t h2 = ((uint64_t)nf ^ 0xa4093822299f31d0ULL) * SUM_K, h3 = 0x082efa98ec4e6c89ULL;
  size_t i = 0;
  for (; i + 4 <= nw; i += 4) {
    uint64_t w[4];
    memcpy(w, rec + 2 * i, sizeof w);
    h0 = (h0 ^ w[0]) * SUM_K;
    h1 = (h1 ^ w[1]) * SUM_K;
    h2 = (h2 ^ w[2]) * SUM_K;
    h3 = (h3 ^ w[3]) * SUM_K;
  }
  for (; i < nw; i++) {
    uint64_t w;
    memcpy(&w, rec + 2 * i, sizeof w);
    h3 = (rotl64(h3, 17) ^ w) * SUM_K;
  }
  if (nf & 1) {
    uint32_t w;
    memcpy(&w, rec + nf - 1, sizeof w);
    h3 = (rotl64(h3, 17) ^ w) * SUM_K;
  }
  return (uint32_t)(ps_fmix64(h0 ^ rotl64(h1, 16) ^ rotl64(h2, 32) ^ rotl64(h3, 48)) >> 32);
}

uint32_t ps_table_row_sum(uint64_t id, uint32_t count, const float *rec, size_t rec_floats) {
  return row_sum(id, count, rec, rec_floats);
}

static inline uint32_t row_crc(const ps_table *t, uint64_t id, const float *row) {
  return row_sum(id, row_count(row), row + HEAD, t->rec_floats);
}

/* ---- sharing a request's rows between two threads ----
 *
 * Requests of at least SPLIT_ROWS rows are worked on by the calling thread
 * and a helper together (rows are distinct, so no two positions touch one
 * row), each taking the next SHARE positions from a counter until none
 * are left. On a machine whose cores are busy the helper may start late,
 * or not run for a while: it then takes fewer shares, and the caller waits
 * for one share at most, not for half of the request. It waits spinning,
 * for a bounded time (SPIN_NS), as the helper's last share ends within
 * tens of microseconds: waking a thread asleep on a condition variable
 * took 100-300 microseconds on a virtual machine (measured: a dim-16
 * push's commit of 1.4 ms had its threads busy 0.85 and 1.05 ms). */
#define SPLIT_ROWS 2048
#define SHARE 256
#define SPIN_NS 2000000

typedef struct {
  _Atomic size_t next; /* the first position not taken yet */
  size_t n;
  void (*fn)(void *ctx, size_t lo, size_t hi, int who); /* who: 0 caller, 1 helper */
  void *ctx;
  _Atomic int stop;   /* take no more shares */
  _Atomic int helped; /* 1: the helper took the share up, 2: and finished it */
} share;

static void share_run(share *sh, int who) {
  while (!atomic_load_explicit(&sh->stop, memory_order_relaxed)) {
    size_t lo = atomic_fetch_add(&sh->next, (size_t)SHARE);
    if (lo >= sh->n) return;
    sh->fn(sh->ctx, lo, sh->n - lo < SHARE ? sh->n : lo + SHARE, who);
  }
}

/* The helper: one thread for the process, started with the first request
 * large enough, waiting for a share to join. A request finding it busy
 * (another request's) runs alone; one whose share the helper has not
 * picked up by the time the caller finished takes it back, so a caller
 * never waits for a helper that has not started. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t wake, done_cv;
  share *job; /* posted, not picked up yet */
  int busy;   /* a request holds the helper */
  int done;   /* the helper finished the request's share (or never took it) */
  int ok;     /* the thread runs */
  pthread_t th;
  int away_from; /* the CPU the helper was last kept off (-1: none) */
} helper = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
            NULL, 0, 0, 0, 0, -1};
static pthread_once_t helper_once = PTHREAD_ONCE_INIT;

static void *helper_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&helper.mu);
  for (;;) {
    while (!helper.job) pthread_cond_wait(&helper.wake, &helper.mu);
    share *sh = helper.job;
    helper.job = NULL;
    atomic_store(&sh->helped, 1);
    pthread_mutex_unlock(&helper.mu);
    share_run(sh, 1);
    pthread_mutex_lock(&helper.mu);
    atomic_store(&sh->helped, 2); /* sh may be gone once this is seen */
    helper.done = 1;
    pthread_cond_signal(&helper.done_cv);
  }
  return NULL;
}

static void helper_start(void) {
  pthread_t th;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  helper.ok = pthread_create(&th, &a, helper_main, NULL) == 0;
  helper.th = th;
  pthread_attr_destroy(&a);
}

/* Keeps the helper off the calling thread's CPU (helper.mu held). Woken,
 * a thread is put on its waker's CPU where it can, where it takes the CPU
 * from the waker (which has the larger share of the work); the scheduler
 * then moves one of them to the idle CPU, which on a virtual machine took
 * 0.2-0.3 ms of a 1.3 ms commit (measured: two threads each busy a
 * quarter less than the commit lasted, with the work split evenly). */
static void helper_away(void) {
#if defined(__linux__) && defined(CPU_SET)
  const int cpu = sched_getcpu();
  if (cpu < 0 || cpu == helper.away_from) return;
  cpu_set_t all, set;
  if (sched_getaffinity(0, sizeof all, &all) != 0 || CPU_COUNT(&all) < 2) return;
  CPU_ZERO(&set);
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (c != cpu && CPU_ISSET(c, &all)) CPU_SET(c, &set);
  if (pthread_setaffinity_np(helper.th, sizeof set, &set) == 0) helper.away_from = cpu;
#endif
}

static void share_all(share *sh) {
  int joined = 0;
  if (sh->n >= SPLIT_ROWS) {
    pthread_once(&helper_once, helper_start);
    pthread_mutex_lock(&helper.mu);
    if (helper.ok && !helper.busy) {
      helper_away();
      helper.busy = 1;
      helper.done = 0;
      helper.job = sh;
      joined = 1;
      pthread_cond_signal(&helper.wake);
    }
    pthread_mutex_unlock(&helper.mu);
  }
  share_run(sh, 0);
  if (!joined) return;
  /* The helper at work on its last share: its end waited for spinning. */
  if (atomic_load(&sh->helped) == 1) {
    const double until = ps_now_s() + SPIN_NS * 1e-9;
    for (unsigned k = 1; atomic_load(&sh->helped) == 1; k++) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      if (k % 256 == 0 && ps_now_s() > until) break;
    }
  }
  pthread_mutex_lock(&helper.mu);
  if (helper.job == sh) { /* not picked up: nothing of it left to do */
    helper.job = NULL;
    helper.done = 1;
  }
  while (!helper.done) pthread_cond_wait(&helper.done_cv, &helper.mu);
  helper.busy = 0;
  pthread_mutex_unlock(&helper.mu);
}

/* ---- checks ---- */

static int named_twice(const ps_table *t, const uint64_t *ids, size_t i, char *err) {
  return ps_seterr(err, PS_EINVAL,
                   "table '%s': id %" PRIu64 " is named twice (position %zu); a request "
                   "names each row once",
                   t->spec.name, ids[i], i);
}

/* The positions 0..n-1 sorted by key[position] (keys below 2^bits),
 * stably: a least-significant-digit radix sort, 11 bits a pass, into out
 * (tmp: n more). */
#define RADIX_BITS 11
static void radix_order(const uint64_t *key, size_t n, int bits, uint32_t *out, uint32_t *tmp) {
  const int passes = bits <= 0 ? 0 : (bits + RADIX_BITS - 1) / RADIX_BITS;
  /* the last pass writes out */
  uint32_t *src = NULL, *dst = passes % 2 ? out : tmp;
  uint32_t count[1u << RADIX_BITS];
  for (int p = 0; p < passes; p++) {
    const int shift = p * RADIX_BITS;
    memset(count, 0, sizeof count);
    if (!src)
      for (size_t i = 0; i < n; i++) count[(key[i] >> shift) & ((1u << RADIX_BITS) - 1)]++;
    else
      for (size_t i = 0; i < n; i++) count[(key[src[i]] >> shift) & ((1u << RADIX_BITS) - 1)]++;
    uint32_t at = 0;
    for (size_t d = 0; d < (1u << RADIX_BITS); d++) {
      const uint32_t c = count[d];
      count[d] = at;
      at += c;
    }
    if (!src)
      for (size_t i = 0; i < n; i++)
        dst[count[(key[i] >> shift) & ((1u << RADIX_BITS) - 1)]++] = (uint32_t)i;
    else
      for (size_t i = 0; i < n; i++) {
        const uint32_t q = src[i];
        dst[count[(key[q] >> shift) & ((1u << RADIX_BITS) - 1)]++] = q;
      }
    src = dst;
    dst = dst == out ? tmp : out;
  }
  if (!passes)
    for (size_t i = 0; i < n; i++) out[i] = (uint32_t)i;
}

/* Grows the check's scratch to n positions. set_mu held. */
static int check_room(ps_table *t, size_t n) {
  if (n <= t->chk_cap) return PS_OK;
  int *sh = malloc(n * sizeof *sh);
  uint64_t *lo = malloc(n * sizeof *lo);
  uint32_t *o1 = malloc(n * sizeof *o1), *o2 = malloc(n * sizeof *o2);
  if (!sh || !lo || !o1 || !o2) {
    free(sh);
    free(lo);
    free(o1);
    free(o2);
    return PS_ENOMEM;
  }
  free(t->chk_shard);
  free(t->chk_local);
  free(t->chk_order);
  free(t->chk_tmp);
  t->chk_shard = sh;
  t->chk_local = lo;
  t->chk_order = o1;
  t->chk_tmp = o2;
  t->chk_cap = n;
  return PS_OK;
}

int ps_table_check_ids(ps_table *t, const uint64_t *ids, size_t n, uint64_t *locals,
                       char *err) {
  return ps_table_check_ids_order(t, ids, n, locals, NULL, err);
}

int ps_table_check_ids_order(ps_table *t, const uint64_t *ids, size_t n, uint64_t *locals,
                             uint32_t *order, char *err) {
  /* The first id that is not a row; those before it are placed (8 at a
   * time, see ps_table_place_many: a request's 10,000 ids in tens of
   * microseconds, on the calling thread) and must be this shard's. */
  size_t bad = n;
  if (t->spec.rows)
    for (size_t i = 0; i < n; i++)
      if (ids[i] >= t->spec.rows) {
        bad = i;
        break;
      }
  pthread_mutex_lock(&t->set_mu);
  if (check_room(t, n) != PS_OK) {
    pthread_mutex_unlock(&t->set_mu);
    return ps_seterr(err, PS_ENOMEM, "out of memory checking %zu ids", n);
  }
  uint64_t *loc = locals ? locals : t->chk_local;
  ps_table_place_many(&t->spec, t->S, ids, bad, t->S > 1 ? t->chk_shard : NULL, loc);
  int rc = PS_OK;
  if (t->S > 1)
    for (size_t i = 0; i < bad; i++)
      if (t->chk_shard[i] != t->shard) {
        rc = ps_seterr(err, PS_EINVAL,
                       "table '%s': id %" PRIu64 " (position %zu) lives on shard %d, not on "
                       "shard %d",
                       t->spec.name, ids[i], i, t->chk_shard[i], t->shard);
        break;
      }
  if (rc == PS_OK && bad < n)
    rc = ps_seterr(err, PS_ERANGE,
                   "table '%s': id %" PRIu64 " (position %zu) is not a row (the table has "
                   "%" PRIu64 ")",
                   t->spec.name, ids[bad], bad, t->spec.rows);
  if (rc != PS_OK || n < 2) {
    if (rc == PS_OK && order && n) order[0] = 0;
    pthread_mutex_unlock(&t->set_mu);
    return rc;
  }
  /* Duplicates. A bounded table's ids are distinct exactly when their
   * local rows are (the placement is a bijection): the positions sorted
   * by local row (the order asked for) put equal ones side by side, and
   * the sort being stable, the later of two is the one named twice. (A
   * set of the request's ids took three times as long; a bit per local
   * row as long at 4M rows, and 12 MB and twice the time at 100M.) */
  if (t->spec.rows) {
    const uint64_t top = t->local_rows > 1 ? t->local_rows - 1 : 1;
    uint32_t *ord = order ? order : t->chk_order;
    radix_order(loc, n, 64 - __builtin_clzll(top), ord, t->chk_tmp);
    size_t twice = SIZE_MAX;
    for (size_t k = 1; k < n; k++)
      if (loc[ord[k]] == loc[ord[k - 1]] && ord[k] < twice) twice = ord[k];
    if (twice != SIZE_MAX) rc = named_twice(t, ids, twice, err);
    pthread_mutex_unlock(&t->set_mu);
    return rc;
  }
  /* An unbounded table's: an open-addressing set of the request's ids. */
  if (order)
    for (size_t i = 0; i < n; i++) order[i] = (uint32_t)i;
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
  for (size_t i = 0; i < n && rc == PS_OK; i++) {
    size_t j = (size_t)mix(ids[i]) & m;
    for (;; j = (j + 1) & m) {
      if (!t->set_used[j]) {
        t->set_used[j] = 1;
        t->set_keys[j] = ids[i];
        break;
      }
      if (t->set_keys[j] == ids[i]) {
        rc = named_twice(t, ids, i, err);
        break;
      }
    }
  }
  pthread_mutex_unlock(&t->set_mu);
  return rc;
}

/* ---- pulls ---- */

typedef struct {
  ps_table *t;
  const uint64_t *ids, *locals;
  size_t n;
  float *out;
  const uint32_t *order; /* bounded tables with locals: the visiting order, or NULL */
  size_t lo;             /* with locals: the first of the order's [lo, lo + n) */
} read_part;

/* Rows ahead of the work a pass keeps prefetched, for rows of `lines`
 * cache lines: about AHEAD_LINES lines in flight, issued one row at a
 * time (a block of rows' lines at once fills the core's miss buffers, and
 * the prefetches then wait for room, holding up the work behind them). */
static size_t rows_ahead(size_t lines) {
  return AHEAD_LINES / lines ? AHEAD_LINES / lines : 1;
}

static void read_range(read_part *p) {
  ps_table *t = p->t;
  const size_t d = (size_t)t->spec.dim, n = p->n;
  const uint64_t *ids = p->ids, *locals = p->locals;
  if (t->spec.rows && locals) {
    /* A bounded table's rows where the check placed them, [lo, hi) of the
     * visiting order: head and values, prefetched a rolling distance
     * ahead. */
    const size_t span = HEAD + d, ahead = rows_ahead((span * sizeof(float) + 63) / 64 + 1);
    const float *arena = t->arena;
    const uint32_t *ord = p->order;
    const size_t lo = p->lo, hi = p->lo + n;
#define POS(j) (ord ? (size_t)ord[j] : (j))
    for (size_t j = lo; j < hi && j < lo + ahead; j++)
      prefetch_row(arena + locals[POS(j)] * t->stride, span, 0);
    for (size_t j = lo; j < hi; j++) {
      if (j + ahead < hi) prefetch_row(arena + locals[POS(j + ahead)] * t->stride, span, 0);
      const size_t i = POS(j);
      const float *row = arena + locals[i] * t->stride;
      float *o = p->out + i * d;
      if (row_count(row))
        memcpy(o, row + HEAD, d * sizeof(float));
      else
        ps_table_init_row(&t->spec, t->seed, ids[i], o);
    }
#undef POS
    return;
  }
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
  if (r->t->spec.rows && r->locals) {
    /* positions of the whole request, visited in order [lo, hi) */
    read_part p = *r;
    p.lo = lo;
    p.n = hi - lo;
    read_range(&p);
    return;
  }
  read_part p = {r->t, r->ids + lo, r->locals ? r->locals + lo : NULL, hi - lo,
                 r->out + lo * (size_t)r->t->spec.dim, NULL, 0};
  read_range(&p);
}

void ps_table_read_rows(ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t n,
                        float *out) {
  ps_table_read_rows_order(t, ids, locals, NULL, n, out);
}

void ps_table_read_rows_order(ps_table *t, const uint64_t *ids, const uint64_t *locals,
                              const uint32_t *order, size_t n, float *out) {
  read_part r = {t, ids, locals, n, out, order, 0};
  share sh = {.n = n, .fn = read_share, .ctx = &r};
  share_all(&sh);
  atomic_fetch_add(&t->rows_pulled, (uint64_t)n);
}

/* ---- pushes ---- */

/* Grows the staging arrays to n positions (st_rows: unbounded tables). */
static int stage_room(ps_table *t, size_t n, char *err) {
  if (n <= t->st_cap) return PS_OK;
  size_t cap = n < 1024 ? 1024 : n;
  float *r = t->spec.rows ? NULL : malloc(cap * t->stride * sizeof(float));
  int64_t *w = malloc(cap * sizeof *w);
  uint8_t *c = malloc(cap * sizeof *c);
  if ((!t->spec.rows && !r) || !w || !c) {
    free(r);
    free(w);
    free(c);
    return ps_seterr(err, PS_ENOMEM, "table '%s': out of memory staging %zu rows", t->spec.name,
                     n);
  }
  free(t->st_rows);
  free(t->st_where);
  free(t->st_born);
  t->st_rows = r;
  t->st_where = w;
  t->st_born = c;
  t->st_cap = cap;
  return PS_OK;
}

/* The next update count of a row (it saturates). */
static inline uint32_t next_count(uint32_t c) { return c < UINT32_MAX ? c + 1 : c; }

/* ---- bounds ---- */

/* Largest magnitudes are measured as float bits without the sign
 * (ps_f32_max_bits, common/half.c): NaN and Inf at or above
 * PS_F32_NONFINITE_BITS, and so above every finite value. */

static double bits_magnitude(uint32_t bits) {
  if (bits >= PS_F32_NONFINITE_BITS) return INFINITY;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* The bounds of a table no push has touched: its initial records. A
 * uniform initial value is init_scale * (2u - 1) with u in [0, 1), so at
 * most |init_scale|; a normal one init_scale times a Box-Muller draw from
 * u1 >= 2^-53, at most sqrt(-2 ln 2^-53) = 8.58 standard deviations. */
static void init_bounds(ps_table *t) {
  const double s = fabs((double)t->spec.init_scale);
  double p = t->spec.init == PS_TABLE_INIT_ZEROS    ? 0.0
             : t->spec.init == PS_TABLE_INIT_NORMAL ? 9.0 * s
                                                    : s;
  t->bounds = (ps_optim_bounds){.param = p <= FLT_MAX ? p * (1.0 + 0x1p-20) : INFINITY};
  for (int k = 0; k < t->n_slots; k++) {
    const float v = t->opt->slot_init(&t->cfg, k);
    t->bounds.slot[k] = isfinite(v) ? fabs((double)v) : INFINITY;
    if (!(v < 0.0f)) t->bounds.slot_nonneg |= 1u << k;
  }
}

/* Widens the bounds to a record put in (a restore). */
static void widen_bounds(ps_table *t, const float *rec) {
  const size_t d = (size_t)t->spec.dim;
  const double p = bits_magnitude(ps_f32_max_bits(rec, d));
  if (p > t->bounds.param) t->bounds.param = p;
  for (int k = 0; k < t->n_slots; k++) {
    const float *sl = rec + (size_t)(k + 1) * d;
    const double m = bits_magnitude(ps_f32_max_bits(sl, d));
    if (m > t->bounds.slot[k]) t->bounds.slot[k] = m;
    for (size_t j = 0; j < d; j++)
      if (sl[j] < 0.0f) t->bounds.slot_nonneg &= ~(1u << k);
  }
}

/* Whether bounds promise finite values: all within FLT_MAX (not NaN). */
static int bounds_finite(const ps_table *t, const ps_optim_bounds *b) {
  int ok = b->param <= FLT_MAX;
  for (int k = 0; k < t->n_slots; k++) ok &= b->slot[k] <= FLT_MAX;
  return ok;
}

/* ---- pushes ----
 *
 * ps_table_stage checks a push whole before any row changes, and
 * ps_table_commit applies it in place, one pass over its rows: a refused
 * or undone push leaves nothing to put back, and nothing is copied aside.
 * The check reads the gradient only, when the table's bounds carried
 * through the optimizer's bound function (with the gradient's largest
 * magnitude, and Adam's bias correction at its largest, t = 1) promise
 * finite results. Otherwise a trial computes each row's update into a
 * scratch record; the bounds are then unknown (infinite), and every later
 * push takes the trial too, until a restore measures them again. */

/* The first pass: positions [lo, hi) of the gradient's largest magnitude,
 * and for an unbounded table where each row is (none: -1). */
typedef struct {
  ps_table *t;
  int known;         /* the caller measured the largest magnitude */
  uint32_t gbits[2]; /* per thread */
  size_t fresh[2];   /* unbounded: rows to make */
} scan_ctx;

static void scan_share(void *ctx, size_t lo, size_t hi, int who) {
  scan_ctx *c = ctx;
  ps_table *t = c->t;
  const size_t d = (size_t)t->spec.dim;
  if (!c->known) { /* (known whenever the gradient comes as rows) */
    const uint32_t g = ps_f32_max_bits(t->st_grad + lo * d, (hi - lo) * d);
    if (g > c->gbits[who]) c->gbits[who] = g;
  }
  if (t->spec.rows) return;
  block cur, next;
  const uint64_t *ids = t->st_ids;
  aim(t, ids + lo, NULL, hi - lo < BLK ? hi - lo : BLK, 0, &next);
  for (size_t b = lo; b < hi; b += BLK) {
    cur = next;
    const size_t nb = b + BLK;
    if (nb < hi) aim(t, ids + nb, NULL, hi - nb < BLK ? hi - nb : BLK, 0, &next);
    for (size_t j = 0; j < cur.m; j++) {
      find(t, ids + b, &cur, j);
      t->st_where[b + j] = cur.where[j];
      c->fresh[who] += cur.where[j] < 0;
    }
  }
}

/* The trial: positions [lo, hi) of the update computed aside, each checked
 * finite. */
typedef struct {
  ps_table *t;
  _Atomic int *stop;
  size_t fail[2]; /* the position of each thread's refused share, SIZE_MAX: none */
  int rc[2];
  char err[2][PS_ERRLEN];
} trial_ctx;

static int trial_range(ps_table *t, size_t lo, size_t hi, char *err) {
  const uint64_t *ids = t->st_ids, *locals = t->st_locals;
  const size_t d = (size_t)t->spec.dim;
  float scratch[PS_TABLE_MAX_DIM * (1 + PS_OPTIM_MAX_SLOTS)];
  float *slots[PS_OPTIM_MAX_SLOTS];
  for (int k = 0; k < t->n_slots; k++) slots[k] = scratch + (size_t)(k + 1) * d;
  block cur, next;
  if (t->spec.rows)
    aim(t, ids + lo, locals ? locals + lo : NULL, hi - lo < BLK ? hi - lo : BLK, 0, &next);
  for (size_t b = lo; b < hi; b += BLK) {
    const size_t nb = b + BLK;
    if (t->spec.rows) {
      cur = next;
      if (nb < hi)
        aim(t, ids + nb, locals ? locals + nb : NULL, hi - nb < BLK ? hi - nb : BLK, 0, &next);
    }
    for (size_t i = b; i < nb && i < hi; i++) {
      const float *row = NULL;
      if (t->spec.rows)
        row = t->arena + (size_t)cur.where[i - b] * t->stride;
      else if (t->st_where[i] >= 0)
        row = urow(t, (size_t)t->st_where[i]);
      const uint32_t cnt = row ? row_count(row) : 0;
      if (cnt)
        memcpy(scratch, row + HEAD, t->rec_floats * sizeof(float));
      else
        init_rec(t, ids[i], scratch);
      t->opt->apply(&t->cfg, next_count(cnt), t->st_lr, scratch, slots, grad_of(t, i), d);
      if (ps_f32_max_bits(scratch, t->rec_floats) >= PS_F32_NONFINITE_BITS)
        for (size_t v = 0; v < t->rec_floats; v++)
          if (!isfinite(scratch[v]))
            return ps_seterr(err, PS_EINVAL,
                             "table '%s': the update would make %s %zu of row %" PRIu64
                             " %s; nothing applied",
                             t->spec.name, v < d ? "value" : "optimizer slot value", v % d,
                             ids[i], isnan(scratch[v]) ? "NaN" : "Inf");
    }
  }
  return PS_OK;
}

static void trial_share(void *ctx, size_t lo, size_t hi, int who) {
  trial_ctx *c = ctx;
  char err[PS_ERRLEN];
  int rc = trial_range(c->t, lo, hi, err);
  if (rc != PS_OK && lo < c->fail[who]) {
    c->fail[who] = lo;
    c->rc[who] = rc;
    memcpy(c->err[who], err, PS_ERRLEN);
    atomic_store(c->stop, 1);
  }
}

int ps_table_stage(ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t n,
                   const ps_ufloat *grad, float lr_scale, char *err) {
  return ps_table_stage_rows(t, ids, locals, NULL, n, grad, NULL, lr_scale, PS_TABLE_GRAD_UNKNOWN,
                             err);
}

int ps_table_stage_rows(ps_table *t, const uint64_t *ids, const uint64_t *locals,
                        const uint32_t *order, size_t n, const ps_ufloat *grad,
                        const ps_ufloat *const *grad_rows, float lr_scale, uint32_t grad_bits,
                        char *err) {
  t->staged = 0;
  t->st_order = t->spec.rows ? order : NULL;
  t->st_grows = grad_rows;
  if (grad_rows && grad_bits == PS_TABLE_GRAD_UNKNOWN) {
    grad_bits = 0;
    for (size_t i = 0; i < n; i++) {
      const uint32_t b = ps_f32_max_bits(grad_rows[i], (size_t)t->spec.dim);
      if (b > grad_bits) grad_bits = b;
    }
  }
  int rc = stage_room(t, n, err);
  if (rc) {
    t->rejected++;
    return rc;
  }
  if (t->spec.rows && !locals) {
    /* Placed here, 8 at a time, rather than one by one in the passes (a
     * sync step's sum comes without placements), into st_where's room. */
    ps_table_place_many(&t->spec, t->S, ids, n, NULL, (uint64_t *)(void *)t->st_where);
    locals = (const uint64_t *)(const void *)t->st_where;
  }
  t->st_ids = ids;
  t->st_locals = locals;
  t->st_grad = grad;
  t->st_lr = t->cfg.lr * lr_scale;
  const size_t d = (size_t)t->spec.dim;
  /* The first pass: the gradient's largest magnitude, unless the caller
   * measured it, and an unbounded table's rows. */
  scan_ctx sc = {.t = t, .known = grad_bits != PS_TABLE_GRAD_UNKNOWN};
  if (!sc.known || !t->spec.rows) {
    share sh = {.n = n, .fn = scan_share, .ctx = &sc};
    share_all(&sh);
  }
  const uint32_t gbits =
      sc.known ? grad_bits : sc.gbits[0] > sc.gbits[1] ? sc.gbits[0] : sc.gbits[1];
  if (gbits >= PS_F32_NONFINITE_BITS) {
    size_t v = 0;
    while (v < n * d && isfinite(grad_of(t, v / d)[v % d])) v++;
    const size_t i = v / d;
    const float bad = grad_of(t, i)[v % d];
    t->rejected++;
    return ps_seterr(err, PS_EINVAL,
                     "table '%s': gradient value %zu of row %" PRIu64
                     " (position %zu) is %s; nothing applied",
                     t->spec.name, v % d, ids[i], i, isnan(bad) ? "NaN" : "Inf");
  }
  ps_optim_bounds b = t->bounds;
  t->opt->bound(&t->cfg, 1, t->st_lr, bits_magnitude(gbits), &b);
  if (bounds_finite(t, &b)) {
    /* Rows the push leaves as they were keep the old bounds. */
    b.slot_nonneg = t->bounds.slot_nonneg;
    if (t->bounds.param > b.param) b.param = t->bounds.param;
    for (int k = 0; k < t->n_slots; k++)
      if (t->bounds.slot[k] > b.slot[k]) b.slot[k] = t->bounds.slot[k];
    t->st_bounds = b;
  } else {
    trial_ctx c = {.t = t, .fail = {SIZE_MAX, SIZE_MAX}};
    share tsh = {.n = n, .fn = trial_share, .ctx = &c};
    c.stop = &tsh.stop;
    share_all(&tsh);
    if (c.fail[0] != SIZE_MAX || c.fail[1] != SIZE_MAX) {
      /* The first refused position's message, as a single thread would
       * give: every share before the failing one was taken, and run to its
       * end. */
      const int w = c.fail[1] < c.fail[0];
      t->rejected++;
      snprintf(err, PS_ERRLEN, "%s", c.err[w]);
      return c.rc[w];
    }
    t->st_bounds = (ps_optim_bounds){.param = INFINITY,
                                     .slot = {INFINITY, INFINITY, INFINITY, INFINITY},
                                     .slot_nonneg = t->bounds.slot_nonneg};
  }
  const size_t fresh = sc.fresh[0] + sc.fresh[1];
  if (!t->spec.rows && fresh && (rc = reserve_rows(t, fresh, err)) != 0) {
    t->rejected++;
    return rc;
  }
  t->st_n = n;
  t->st_new = fresh;
  t->staged = 1;
  return PS_OK;
}

typedef struct {
  ps_table *t;
  uint32_t crc[2]; /* per thread: the sum of the new rows' CRCs minus the old rows' */
  size_t born[2];  /* per thread: rows pushed for the first time */
} apply_ctx;

/* The commit's pass over positions [lo, hi): each row (a never-pushed one
 * from its initial record; an unbounded table's new one built in st_rows)
 * updated in place, its count and CRC with it. */
/* The stored row of staged position i (an unbounded table's new row: its
 * record built in st_rows). */
static float *staged_row(const ps_table *t, size_t i) {
  if (t->spec.rows) return t->arena + (size_t)t->st_locals[i] * t->stride;
  const int64_t r = t->st_where[i];
  return r >= 0 ? urow(t, (size_t)r) : t->st_rows + i * t->stride;
}

static void apply_share(void *ctx, size_t lo, size_t hi, int who) {
  apply_ctx *c = ctx;
  ps_table *t = c->t;
  const uint64_t *ids = t->st_ids;
  const uint32_t *ord = t->st_order; /* [lo, hi) of the visiting order, or positions */
  const size_t d = (size_t)t->spec.dim, st = t->stride;
  float *slots[PS_OPTIM_MAX_SLOTS];
  uint32_t crc = 0;
  size_t born = 0;
#define POS(j) (ord ? (size_t)ord[j] : (j))
  /* Rows, and their gradient's rows, are prefetched `ahead` positions
   * before their update: about AHEAD_LINES cache lines in flight. The
   * gradient is read in the rows' address order, a position here and one
   * there over the request's bytes: unprefetched, its loads were half the
   * update's time (perf: a dim-16 push's commit went from 0.42 to 0.35 ms
   * with them prefetched). */
  const size_t gl = (d * sizeof(ps_ufloat) + 63) / 64 + 1;
  const size_t ahead = rows_ahead((st * sizeof(float) + 63) / 64 + 1 + gl);
  for (size_t j = lo; j < hi && j < lo + ahead; j++) {
    prefetch_row(staged_row(t, POS(j)), st, 1);
    prefetch_row((const float *)grad_of(t, POS(j)), d, 0);
  }
  for (size_t j = lo; j < hi; j++) {
    if (j + ahead < hi) {
      prefetch_row(staged_row(t, POS(j + ahead)), st, 1);
      prefetch_row((const float *)grad_of(t, POS(j + ahead)), d, 0);
    }
    const size_t i = POS(j);
    float *row = staged_row(t, i);
    if (!t->spec.rows && t->st_where[i] < 0) set_count(row, 0);
    const uint32_t cnt = row_count(row);
    uint32_t old_crc = 0;
    if (cnt) {
      old_crc = row_crc_kept(row);
    } else {
      init_rec(t, ids[i], row + HEAD);
      born++;
    }
    if (t->spec.rows) t->st_born[i] = cnt == 0;
    set_count(row, next_count(cnt));
    float *rec = row + HEAD;
    for (int k = 0; k < t->n_slots; k++) slots[k] = rec + (size_t)(k + 1) * d;
    t->opt->apply(&t->cfg, row_count(row), t->st_lr, rec, slots, grad_of(t, i), d);
    const uint32_t nc = row_crc(t, ids[i], row);
    set_crc(row, nc);
    crc += nc - old_crc;
  }
#undef POS
  c->crc[who] += crc;
  c->born[who] += born;
}

/* Applies the checked push; then only the rows pushed for the first time
 * need more than the sums: a bounded table's row is marked touched (a row
 * is touched exactly when its count is not 0), an unbounded table's is
 * made. */
void ps_table_commit(ps_table *t) {
  if (!t->staged) return;
  const size_t st = t->stride;
  apply_ctx c = {.t = t};
  share sh = {.n = t->st_n, .fn = apply_share, .ctx = &c};
  share_all(&sh);
  if (t->spec.rows) t->st_new = c.born[0] + c.born[1];
  for (size_t i = 0; i < t->st_n && t->st_new; i++) {
    int64_t r = t->spec.rows ? (int64_t)t->st_locals[i] : t->st_where[i];
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
  t->crc_sum += c.crc[0] + c.crc[1];
  t->rows_pushed += t->st_n;
  t->bounds = t->st_bounds;
  ps_table_unstage(t);
}

void ps_table_unstage(ps_table *t) {
  t->staged = 0;
  t->st_ids = NULL;
  t->st_locals = NULL;
  t->st_order = NULL;
  t->st_grad = NULL;
  t->st_grows = NULL;
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
  widen_bounds(t, rec);
  uint32_t c = row_crc(t, id, dst);
  set_crc(dst, c);
  t->crc_sum += c;
  return PS_OK;
}

void ps_table_clear(ps_table *t) {
  if (t->spec.rows) {
    collapse_join(t);
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
  init_bounds(t);
}

uint32_t ps_table_crc(ps_table *t) { return t->crc_sum; }

/* The data-lease table, as ps/state/leases.h describes.
 *
 * Each chunk of the current epoch is in one of four states:
 *   FRESH   not handed out yet in this epoch; found by walking the epoch's
 *           permutation from `cursor` (every FRESH chunk sits at or after it)
 *   POOLED  handed out, then reclaimed; waits in `pool` (a ring, FIFO)
 *   LEASED  held by exactly one entry of `leases`
 *   DONE    completed; final until the epoch ends
 * acquire serves the pool first (an epoch cannot end without those chunks),
 * then the permutation. Reclaimed chunks that are then salvaged by their
 * late holder become DONE while still in the pool; popping skips them.
 *
 * Besides its state, each chunk carries marks for the current epoch:
 * MARK_POOLED once it went to the pool (a later hand-out counts in
 * examples_rehanded), MARK_REDONE once a lost completion of it was counted
 * in examples_redone (ps_leases_rejoin counts a chunk once), MARK_DONE_HERE
 * once a worker completed it in this life of the table (not restored done
 * from a checkpoint).
 *
 * Leases live in a small array in grant order: a job has tens of workers
 * holding a few leases each, so linear scans cost less than an index.
 * Ended leases (completed or reclaimed) are remembered in a ring of the
 * last ENDED_KEEP, so a late completion can be told apart from an unknown
 * id and a retried completion answered again.
 *
 * What a worker trained under a lease that then ended without counting
 * (reclaimed, its chunk gone to another worker) is counted once: each
 * lease and ended lease carries the examples pushed under it (`pushed`),
 * an ended one also those counted in examples_abandoned or
 * examples_wasted (`acct`) and whether its chunk went to another worker
 * (`gone`: from then on its pushes count as abandoned at once). A restore
 * keeps these of the leases outstanding and of the reclaimed ones with
 * something pushed (ENDED_SAVED: a life before, known for its counts
 * only, not as this life's lease). */
#include "ps/state/leases.h"

#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/rng.h"
#include "common/util.h"

enum { CHUNK_FRESH = 0, CHUNK_POOLED = 1, CHUNK_LEASED = 2, CHUNK_DONE = 3 };
/* ENDED_DEAD: an entry whose counts moved to a lease adopted under its id. */
enum { ENDED_DEAD = 0, ENDED_COMPLETED = 1, ENDED_RECLAIMED = 2, ENDED_SAVED = 3 };
enum { ACCT_GONE = 1, ACCT_REFUSED = 2, ACCT_SAVED = 4 };
enum { MARK_REDONE = 1, MARK_POOLED = 2, MARK_DONE_HERE = 4 };
#define ENDED_KEEP 4096
/* The stream of ps_rng_u64 that seeds the permutations. */
#define PERM_STREAM 0x1ea5e5ull

typedef struct {
  uint64_t id;
  uint64_t worker;
  uint32_t chunk;
  uint32_t pushed; /* examples pushed under it (ps_leases_note_pushed) */
  int64_t seen_ms; /* granted or last renewed */
} lease;

typedef struct {
  uint64_t id;
  uint64_t worker;
  uint32_t epoch;
  uint32_t chunk;
  int kind;        /* ENDED_* */
  uint32_t pushed; /* examples pushed under it, before and after it ended */
  uint32_t acct;   /* of those (or of a refused completion's), counted abandoned or wasted */
  uint8_t gone;    /* its chunk went to another worker: pushes count as abandoned */
  uint8_t refused; /* a completion of it was refused: its count is final */
} ended_lease;

struct ps_leases {
  pthread_mutex_t mu;
  ps_lease_config cfg;
  uint32_t n_chunks;
  uint32_t epoch;
  int finished;

  /* One allocation, carved: */
  uint32_t *order; /* (n_chunks) chunk ids in this epoch's hand-out order */
  uint32_t *pool;  /* (n_chunks) ring of reclaimed chunks */
  uint8_t *state;  /* (n_chunks) CHUNK_* */
  uint8_t *counts; /* (n_chunks) completions in this epoch */
  /* (n_chunks) each: the completions of the epoch of history[i]. */
  uint8_t *hist_counts[PS_LEASE_HISTORY];
  uint8_t *marks; /* (n_chunks) MARK_* of this epoch */
  /* (n_chunks) 1: a worker finished the chunk in the next epoch, under a
   * life of this table that a restore forgot (it was ahead of this one):
   * done as soon as that epoch begins (ps_leases_rejoin) */
  uint8_t *next_done;
  /* (n_chunks) the marks of the epoch before (not kept in checkpoints): a
   * worker that comes back after it ended names its completions of it */
  uint8_t *prev_marks;
  void *block;

  uint32_t cursor; /* next position in order to look at */
  uint32_t pool_head, pool_len;
  uint32_t n_done, n_leased;

  lease *leases; /* (n_leases), grant order */
  int n_leases, cap_leases;

  ended_lease ended[ENDED_KEEP]; /* ring */
  uint32_t ended_next, ended_n;

  uint64_t next_id;
  uint64_t granted_total, reclaims_total;
  ps_lease_epoch_record cur;
  int n_history;
  ps_lease_epoch_record history[PS_LEASE_HISTORY]; /* newest first */
};

const char *ps_leases_strerror(int code) {
  switch (code) {
    case PS_LEASE_WAIT: return "nothing to lease now: retry later";
    case PS_LEASE_FINISHED: return "every epoch is done";
    case PS_LEASE_FULL: return "the worker holds as many leases as it may";
    case PS_LEASE_ELOST: return "lease reclaimed and its chunk handed out again: not counted";
    default: return ps_strerror(code);
  }
}

/* ---------------------------------------------------------------- helpers */

static uint32_t chunk_count(const ps_leases *t, uint32_t c) {
  uint64_t begin = (uint64_t)c * t->cfg.chunk_size;
  uint64_t left = t->cfg.n_examples - begin;
  return left < t->cfg.chunk_size ? (uint32_t)left : t->cfg.chunk_size;
}

static void record_reset(ps_lease_epoch_record *r, uint32_t epoch, uint32_t n_chunks) {
  memset(r, 0, sizeof *r);
  r->epoch = epoch;
  r->chunks = n_chunks;
  r->start_ms = -1;
  r->end_ms = -1;
}

/* The first id of a table's life: past every id of the life it was saved
 * from, and past those of any earlier life on this clock, which workers may
 * still hold (2^32 ids per second of wall time between two lives). */
static uint64_t first_id(uint64_t saved_next) {
  double w = ps_wall_s();
  uint64_t from_clock = w > 0 ? (uint64_t)w << 32 : 0;
  uint64_t id = saved_next > from_clock ? saved_next : from_clock;
  return id ? id : 1;
}

/* Lays out a new epoch's permutation with every chunk FRESH. */
static void epoch_begin(ps_leases *t) {
  uint32_t n = t->n_chunks;
  for (uint32_t k = 0; k < n; k++) t->order[k] = k;
  ps_rand r;
  ps_rand_seed(&r, ps_rng_u64(t->cfg.seed, PERM_STREAM, t->epoch));
  ps_rand_shuffle_u32(&r, t->order, n);
  memset(t->state, CHUNK_FRESH, n);
  memset(t->counts, 0, n);
  memset(t->marks, 0, n);
  t->cursor = 0;
  t->pool_head = t->pool_len = 0;
  t->n_done = 0;
  record_reset(&t->cur, t->epoch, n);
}

static int check_config(const ps_lease_config *cfg, uint32_t *n_chunks, char *err) {
  if (cfg->n_examples == 0) return ps_seterr(err, PS_EINVAL, "leases: no examples");
  if (cfg->chunk_size == 0) return ps_seterr(err, PS_EINVAL, "leases: chunk size 0");
  if (cfg->max_per_worker == 0)
    return ps_seterr(err, PS_EINVAL, "leases: max_per_worker must be at least 1");
  uint64_t n = cfg->n_examples / cfg->chunk_size + (cfg->n_examples % cfg->chunk_size != 0);
  if (n > PS_LEASE_MAX_CHUNKS)
    return ps_seterr(err, PS_ERANGE, "leases: %llu chunks of %u examples, more than the %u allowed",
                     (unsigned long long)n, (unsigned)cfg->chunk_size,
                     (unsigned)PS_LEASE_MAX_CHUNKS);
  *n_chunks = (uint32_t)n;
  return PS_OK;
}

/* A table with its arrays allocated and nothing else set up. */
static ps_leases *table_alloc(const ps_lease_config *cfg, uint32_t n_chunks, char *err) {
  ps_leases *t = calloc(1, sizeof *t);
  size_t n = n_chunks;
  /* u32 arrays first, so the byte arrays after them need no alignment. */
  void *block = malloc(2 * n * sizeof(uint32_t) + (5 + PS_LEASE_HISTORY) * n);
  if (!t || !block || pthread_mutex_init(&t->mu, NULL) != 0) {
    free(t);
    free(block);
    ps_seterr(err, PS_ENOMEM, "leases: out of memory for %u chunks", (unsigned)n_chunks);
    return NULL;
  }
  t->block = block;
  t->order = block;
  t->pool = t->order + n;
  t->state = (uint8_t *)(t->pool + n);
  t->counts = t->state + n;
  for (int i = 0; i < PS_LEASE_HISTORY; i++) t->hist_counts[i] = t->counts + n * (size_t)(i + 1);
  t->marks = t->counts + n * (size_t)(PS_LEASE_HISTORY + 1);
  t->next_done = t->marks + n;
  memset(t->next_done, 0, n);
  t->prev_marks = t->next_done + n;
  memset(t->prev_marks, 0, n);
  t->cfg = *cfg;
  t->n_chunks = n_chunks;
  return t;
}

ps_leases *ps_leases_create(const ps_lease_config *cfg, char *err) {
  uint32_t n_chunks = 0;
  if (!cfg) {
    ps_seterr(err, PS_EINVAL, "leases: no configuration");
    return NULL;
  }
  if (check_config(cfg, &n_chunks, err) != PS_OK) return NULL;
  ps_leases *t = table_alloc(cfg, n_chunks, err);
  if (!t) return NULL;
  t->next_id = cfg->first_id ? cfg->first_id : first_id(0);
  epoch_begin(t);
  return t;
}

void ps_leases_destroy(ps_leases *t) {
  if (!t) return;
  pthread_mutex_destroy(&t->mu);
  free(t->leases);
  free(t->block);
  free(t);
}

static ps_leases *load_blob(const void *buf, size_t len, int same_ids, char *err);

int ps_leases_replace(ps_leases *t, const void *buf, size_t len, char *err) {
  ps_leases *n = load_blob(buf, len, 1, err);
  if (!n) return PS_EINVAL;
  /* Everything but the lock changes hands: callers holding t keep a valid
   * table, now the blob's. */
  const size_t off = offsetof(ps_leases, cfg);
  unsigned char tmp[sizeof(ps_leases)];
  pthread_mutex_lock(&t->mu);
  memcpy(tmp, (unsigned char *)t + off, sizeof(ps_leases) - off);
  memcpy((unsigned char *)t + off, (unsigned char *)n + off, sizeof(ps_leases) - off);
  memcpy((unsigned char *)n + off, tmp, sizeof(ps_leases) - off);
  pthread_mutex_unlock(&t->mu);
  ps_leases_destroy(n);
  return PS_OK;
}

static void remember_ended(ps_leases *t, const lease *l, int kind) {
  ended_lease *e = &t->ended[t->ended_next];
  e->id = l->id;
  e->worker = l->worker;
  e->epoch = t->epoch;
  e->chunk = l->chunk;
  e->kind = kind;
  e->pushed = l->pushed;
  e->acct = 0;
  e->gone = 0;
  e->refused = 0;
  t->ended_next = (t->ended_next + 1) % ENDED_KEEP;
  if (t->ended_n < ENDED_KEEP) t->ended_n++;
}

/* An ended lease of this life of the table. */
static ended_lease *find_ended(ps_leases *t, uint64_t id) {
  for (uint32_t i = 0; i < t->ended_n; i++)
    if (t->ended[i].id == id &&
        (t->ended[i].kind == ENDED_COMPLETED || t->ended[i].kind == ENDED_RECLAIMED))
      return &t->ended[i];
  return NULL;
}

/* An ended lease whose pushes count (reclaimed: of this life or of one
 * before a restore). */
static ended_lease *find_acct(ps_leases *t, uint64_t id) {
  for (uint32_t i = 0; i < t->ended_n; i++)
    if (t->ended[i].id == id &&
        (t->ended[i].kind == ENDED_RECLAIMED || t->ended[i].kind == ENDED_SAVED))
      return &t->ended[i];
  return NULL;
}

static uint32_t add_sat(uint32_t a, uint64_t b) {
  uint64_t s = (uint64_t)a + b;
  return s > UINT32_MAX ? UINT32_MAX : (uint32_t)s;
}

/* The record late counts go to: the current epoch's, or after the last
 * epoch the last epoch's (the record of the epoch after it is never
 * reported). */
static ps_lease_epoch_record *late_record(ps_leases *t) {
  return t->finished && t->n_history > 0 ? &t->history[0] : &t->cur;
}

/* What e's worker pushed and is not counted yet joins examples_abandoned. */
static void count_abandoned(ps_leases *t, ended_lease *e) {
  if (e->pushed > e->acct) {
    late_record(t)->examples_abandoned += e->pushed - e->acct;
    e->acct = e->pushed;
  }
}

/* e's chunk is its holder's again after all (its late completion taken,
 * its lease adopted): what was counted abandoned of it was not trained
 * again. A refused lease's count stays. */
static void uncount_abandoned(ps_leases *t, ended_lease *e) {
  if (e->refused) return;
  ps_lease_epoch_record *r = late_record(t);
  uint64_t a = e->acct < r->examples_abandoned ? e->acct : r->examples_abandoned;
  r->examples_abandoned -= a;
  e->acct = 0;
  e->gone = 0;
}

/* A worker of a life before names chunk c of the current epoch done, or
 * takes back its lease `id` of it: that lease of then (ENDED_SAVED) is
 * settled, what it counted as abandoned uncounted (the chunk's record
 * counts the worker's examples: completed, recovered or redone). With id
 * 0 (a completion named by chunk), each of the worker's leases of c: one
 * that ended otherwise than in that completion is named again (held, or
 * refused) and counted then. Returns the most pushed under one. */
static uint32_t settle_own(ps_leases *t, uint32_t c, uint64_t worker, uint64_t id) {
  uint32_t own = 0;
  for (uint32_t i = 0; worker && i < t->ended_n; i++) {
    ended_lease *e = &t->ended[i];
    if (e->chunk != c || e->epoch != t->epoch || e->kind != ENDED_SAVED || e->worker != worker ||
        e->refused || (id && e->id != id))
      continue;
    uncount_abandoned(t, e);
    if (e->pushed > own) own = e->pushed;
    e->kind = ENDED_DEAD;
  }
  return own;
}

/* Chunk c of the current epoch goes to lease `taker` (handed out again;
 * 0: taken as done). The reclaimed leases of it count what their holders
 * pushed as abandoned, now and from then on; but a worker of a life before
 * that takes its own chunk back (own_worker: adopted, or taken as done)
 * goes on with its lease of then, whose entry is settled (settle_own):
 * returns what was pushed under it. */
static uint32_t chunk_taken(ps_leases *t, uint32_t c, uint64_t taker, uint64_t own_worker) {
  uint32_t own = settle_own(t, c, own_worker, taker);
  for (uint32_t i = 0; i < t->ended_n; i++) {
    ended_lease *e = &t->ended[i];
    if (e->chunk != c || e->epoch != t->epoch || e->id == taker ||
        (e->kind != ENDED_RECLAIMED && e->kind != ENDED_SAVED))
      continue;
    if (e->gone) continue;
    e->gone = 1;
    count_abandoned(t, e);
  }
  return own;
}

static int find_lease(const ps_leases *t, uint64_t id) {
  for (int i = 0; i < t->n_leases; i++)
    if (t->leases[i].id == id) return i;
  return -1;
}

/* Keeps the grant order, which held() reports. */
static void drop_lease(ps_leases *t, int i) {
  memmove(&t->leases[i], &t->leases[i + 1], (size_t)(t->n_leases - i - 1) * sizeof(lease));
  t->n_leases--;
  t->n_leased--;
}

static void pool_push(ps_leases *t, uint32_t c) {
  t->pool[(t->pool_head + t->pool_len) % t->n_chunks] = c;
  t->pool_len++;
}

/* Chunk c leaves the pool (taken back by a rejoining worker): the pool
 * holds each chunk at most once, so that it never holds more entries than
 * the ring has places. Keeps the order of the others. */
static void pool_remove(ps_leases *t, uint32_t c) {
  uint32_t kept = 0;
  for (uint32_t i = 0; i < t->pool_len; i++) {
    const uint32_t k = t->pool[(t->pool_head + i) % t->n_chunks];
    if (k != c) t->pool[(t->pool_head + kept++) % t->n_chunks] = k;
  }
  t->pool_len = kept;
}

/* Lease i goes back to the pool. */
static void reclaim(ps_leases *t, int i) {
  lease *l = &t->leases[i];
  t->state[l->chunk] = CHUNK_POOLED;
  t->marks[l->chunk] |= MARK_POOLED;
  pool_push(t, l->chunk);
  t->cur.reclaims++;
  t->reclaims_total++;
  remember_ended(t, l, ENDED_RECLAIMED);
  drop_lease(t, i);
}

/* The epoch's last chunk is done: its record joins the history and the next
 * epoch begins (or the run is finished). */
static void chunk_done(ps_leases *t, uint32_t c, int64_t now_ms);

/* The epoch that just began: the chunks workers finished in it under a
 * forgotten life are done (recovered); when that is all of them, it ends
 * too. */
static void take_next_done(ps_leases *t, int64_t now_ms) {
  const uint32_t epoch = t->epoch;
  for (uint32_t c = 0; c < t->n_chunks && t->epoch == epoch; c++) {
    if (!t->next_done[c]) continue;
    t->next_done[c] = 0;
    if (t->state[c] != CHUNK_FRESH) continue;
    t->cur.examples_recovered += chunk_count(t, c);
    chunk_done(t, c, now_ms);
  }
  if (t->epoch == epoch) memset(t->next_done, 0, t->n_chunks);
}

static void epoch_end(ps_leases *t, int64_t now_ms) {
  ps_lease_epoch_record *r = &t->cur;
  r->finished = 1;
  r->end_ms = now_ms;
  /* The oldest record's counts buffer takes the place of the current one. */
  uint8_t *spare = t->hist_counts[PS_LEASE_HISTORY - 1];
  memmove(&t->history[1], &t->history[0], (PS_LEASE_HISTORY - 1) * sizeof t->history[0]);
  memmove(&t->hist_counts[1], &t->hist_counts[0],
          (PS_LEASE_HISTORY - 1) * sizeof t->hist_counts[0]);
  t->history[0] = *r;
  t->hist_counts[0] = t->counts;
  t->counts = spare;
  if (t->n_history < PS_LEASE_HISTORY) t->n_history++;
  memcpy(t->prev_marks, t->marks, t->n_chunks);

  t->epoch++;
  if (t->cfg.epochs && t->epoch >= t->cfg.epochs) {
    t->finished = 1;
    memset(t->state, CHUNK_FRESH, t->n_chunks);
    memset(t->counts, 0, t->n_chunks);
    memset(t->marks, 0, t->n_chunks);
    t->cursor = t->n_chunks;
    t->pool_head = t->pool_len = 0;
    t->n_done = 0;
    record_reset(&t->cur, t->epoch, t->n_chunks);
  } else {
    epoch_begin(t);
    take_next_done(t, now_ms);
  }
}

static void chunk_done(ps_leases *t, uint32_t c, int64_t now_ms) {
  uint32_t count = chunk_count(t, c);
  t->state[c] = CHUNK_DONE;
  t->marks[c] |= MARK_DONE_HERE;
  if (t->counts[c] < 255) t->counts[c]++;
  /* Counts never pass 1 through this table; kept honest if they did. */
  if (t->counts[c] == 1) t->cur.chunks_once++;
  if (t->counts[c] == 2) t->cur.chunks_once--;
  t->n_done++;
  t->cur.chunks_completed++;
  t->cur.examples_completed += count;
  if (t->n_done == t->n_chunks) epoch_end(t, now_ms);
}

static int worker_holds(const ps_leases *t, uint64_t worker) {
  int n = 0;
  for (int i = 0; i < t->n_leases; i++) n += t->leases[i].worker == worker;
  return n;
}

/* ---------------------------------------------------------------- api */

int ps_leases_acquire(ps_leases *t, uint64_t worker, int64_t now_ms, ps_lease *out) {
  if (!t || !out) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = PS_OK;
  if (t->finished) {
    rc = PS_LEASE_FINISHED;
    goto out;
  }
  if (worker_holds(t, worker) >= (int64_t)t->cfg.max_per_worker) {
    rc = PS_LEASE_FULL;
    goto out;
  }
  if (t->n_leases == t->cap_leases) {
    int cap = t->cap_leases ? t->cap_leases * 2 : 16;
    lease *grown = realloc(t->leases, (size_t)cap * sizeof *grown);
    if (!grown) {
      rc = PS_ENOMEM;
      goto out;
    }
    t->leases = grown;
    t->cap_leases = cap;
  }
  /* Reclaimed chunks first; entries salvaged (DONE) meanwhile are dropped. */
  uint32_t c = UINT32_MAX;
  int again = 0;
  while (t->pool_len) {
    uint32_t k = t->pool[t->pool_head];
    t->pool_head = (t->pool_head + 1) % t->n_chunks;
    t->pool_len--;
    if (t->state[k] == CHUNK_POOLED) {
      c = k;
      again = 1;
      break;
    }
  }
  while (c == UINT32_MAX && t->cursor < t->n_chunks) {
    uint32_t k = t->order[t->cursor++];
    if (t->state[k] == CHUNK_FRESH) c = k;
  }
  if (c == UINT32_MAX) {
    rc = PS_LEASE_WAIT;
    goto out;
  }
  uint32_t count = chunk_count(t, c);
  lease *l = &t->leases[t->n_leases++];
  l->id = t->next_id++;
  l->worker = worker;
  l->chunk = c;
  l->pushed = 0;
  l->seen_ms = now_ms;
  t->state[c] = CHUNK_LEASED;
  t->n_leased++;
  t->granted_total++;
  if (t->cur.start_ms < 0) t->cur.start_ms = now_ms;
  t->cur.examples_handed_out += count;
  if (again) {
    t->cur.examples_rehanded += count;
    chunk_taken(t, c, l->id, 0);
  }
  out->epoch = t->epoch;
  out->chunk = c;
  out->begin = (uint64_t)c * t->cfg.chunk_size;
  out->count = count;
  out->lease_id = l->id;
out:
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int ps_leases_complete(ps_leases *t, uint64_t worker, uint64_t lease_id, int64_t now_ms) {
  if (!t) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = PS_OK;
  int i = find_lease(t, lease_id);
  if (i >= 0) {
    lease l = t->leases[i];
    if (l.worker != worker) {
      rc = PS_ESTATE;
      goto out;
    }
    /* Remember and drop the lease before the chunk is counted: counting
     * the epoch's last chunk begins the next epoch. */
    remember_ended(t, &l, ENDED_COMPLETED);
    drop_lease(t, i);
    chunk_done(t, l.chunk, now_ms);
    goto out;
  }
  ended_lease *e = find_ended(t, lease_id);
  if (!e) {
    rc = PS_ENOTFOUND;
  } else if (e->worker != worker) {
    rc = PS_ESTATE;
  } else if (e->kind == ENDED_COMPLETED) {
    rc = PS_OK; /* a retried completion: counted once already */
  } else if (!t->finished && e->epoch == t->epoch && t->state[e->chunk] == CHUNK_POOLED &&
             !e->refused) {
    /* Reclaimed, but nobody took the chunk since (or the one who took it
     * gave it back): the work is taken, and was not abandoned. */
    uncount_abandoned(t, e);
    e->kind = ENDED_COMPLETED;
    chunk_taken(t, e->chunk, e->id, 0); /* the later holders' pushes: abandoned */
    chunk_done(t, e->chunk, now_ms);
  } else {
    rc = PS_LEASE_ELOST;
  }
out:
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int ps_leases_release_worker(ps_leases *t, uint64_t worker) {
  if (!t) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int n = 0;
  for (int i = 0; i < t->n_leases;) {
    if (t->leases[i].worker == worker) {
      reclaim(t, i);
      n++;
    } else {
      i++;
    }
  }
  pthread_mutex_unlock(&t->mu);
  return n;
}

int ps_leases_renew(ps_leases *t, uint64_t worker, int64_t now_ms) {
  if (!t) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int n = 0;
  for (int i = 0; i < t->n_leases; i++) {
    if (t->leases[i].worker == worker) {
      t->leases[i].seen_ms = now_ms;
      n++;
    }
  }
  pthread_mutex_unlock(&t->mu);
  return n;
}

int ps_leases_renew_named(ps_leases *t, uint64_t worker, const uint64_t *ids, size_t n,
                          int64_t now_ms) {
  if (!t || (n && !ids)) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int renewed = 0;
  for (int i = 0; i < t->n_leases; i++) {
    if (t->leases[i].worker != worker) continue;
    for (size_t k = 0; k < n; k++) {
      if (ids[k] == t->leases[i].id) {
        t->leases[i].seen_ms = now_ms;
        renewed++;
        break;
      }
    }
  }
  pthread_mutex_unlock(&t->mu);
  return renewed;
}

int ps_leases_expire(ps_leases *t, int64_t now_ms, int64_t timeout_ms) {
  if (!t) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int n = 0;
  for (int i = 0; i < t->n_leases;) {
    if (now_ms - t->leases[i].seen_ms > timeout_ms) {
      reclaim(t, i);
      n++;
    } else {
      i++;
    }
  }
  pthread_mutex_unlock(&t->mu);
  return n;
}

int ps_leases_held(ps_leases *t, uint64_t worker, ps_lease *out, int max) {
  if (!t) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  int n = 0;
  for (int i = 0; i < t->n_leases; i++) {
    const lease *l = &t->leases[i];
    if (l->worker != worker) continue;
    if (out && n < max) {
      out[n].epoch = t->epoch;
      out[n].chunk = l->chunk;
      out[n].begin = (uint64_t)l->chunk * t->cfg.chunk_size;
      out[n].count = chunk_count(t, l->chunk);
      out[n].lease_id = l->id;
    }
    n++;
  }
  pthread_mutex_unlock(&t->mu);
  return n;
}

/* Whether this life of the table saw the worker complete chunk c of the
 * current epoch (among the leases it remembers ending). */
static int completed_by(ps_leases *t, uint64_t worker, uint32_t c, uint32_t epoch) {
  for (uint32_t i = 0; i < t->ended_n; i++)
    if (t->ended[i].chunk == c && t->ended[i].epoch == epoch &&
        t->ended[i].kind == ENDED_COMPLETED && t->ended[i].worker == worker)
      return 1;
  return 0;
}

/* Chunk c of the current epoch, named by a worker of an earlier life, is
 * free for it: not done and not leased to anyone (fresh, or in the pool). */
static int chunk_free(const ps_leases *t, uint32_t c) {
  return t->state[c] == CHUNK_FRESH || t->state[c] == CHUNK_POOLED;
}

/* Takes chunk c as done (a worker finished it under the earlier life),
 * remembered as the worker's completion. */
static void accept_done(ps_leases *t, uint64_t worker, uint32_t c, uint64_t id, int64_t now_ms,
                        ps_lease_rejoin *out) {
  lease l = {.id = 0, .worker = worker, .chunk = c};
  remember_ended(t, &l, ENDED_COMPLETED);
  chunk_taken(t, c, id, worker);
  uint32_t count = chunk_count(t, c);
  t->cur.examples_recovered += count;
  out->accepted++;
  out->examples_accepted += count;
  chunk_done(t, c, now_ms); /* last: it may begin the next epoch */
}

/* Chunk c, completed by a worker, went to another since: counted once. */
static void count_redone(ps_leases *t, uint32_t c, ps_lease_rejoin *out) {
  if (t->marks[c] & MARK_REDONE) return;
  t->marks[c] |= MARK_REDONE;
  uint32_t count = chunk_count(t, c);
  t->cur.examples_redone += count;
  out->redone++;
  out->examples_redone += count;
}

/* Leases chunk c to the worker again under its earlier id, with what it
 * pushed under it. */
static int adopt(ps_leases *t, uint64_t worker, uint64_t id, uint32_t c, uint32_t pushed,
                 int64_t now_ms) {
  if (t->n_leases == t->cap_leases) {
    int cap = t->cap_leases ? t->cap_leases * 2 : 16;
    lease *grown = realloc(t->leases, (size_t)cap * sizeof *grown);
    if (!grown) return PS_ENOMEM;
    t->leases = grown;
    t->cap_leases = cap;
  }
  lease *l = &t->leases[t->n_leases++];
  l->id = id;
  l->worker = worker;
  l->chunk = c;
  l->pushed = pushed;
  l->seen_ms = now_ms;
  /* Its pool entry goes: reclaimed again later, it would be in the pool
   * twice (and the ring overrun). */
  if (t->state[c] == CHUNK_POOLED) pool_remove(t, c);
  t->state[c] = CHUNK_LEASED;
  t->n_leased++;
  t->granted_total++;
  if (t->cur.start_ms < 0) t->cur.start_ms = now_ms;
  t->cur.examples_handed_out += chunk_count(t, c);
  return PS_OK;
}

/* A completion of the worker's lease id (of epoch and chunk, UINT32_MAX:
 * unknown) was refused after it trained `trained` examples of it: those
 * not counted yet (as abandoned, or by an earlier report of the same
 * refusal) join examples_wasted. */
static void refused(ps_leases *t, uint64_t worker, uint64_t id, uint64_t trained, uint32_t epoch,
                    uint32_t chunk) {
  ended_lease *e = id ? find_acct(t, id) : NULL;
  if (id == 0 || (e && e->worker != worker) || find_lease(t, id) >= 0) {
    /* no lease, or another worker's: counted, not remembered */
    late_record(t)->examples_wasted += trained;
    return;
  }
  if (!e) {
    lease l = {.id = id, .worker = worker, .chunk = chunk};
    remember_ended(t, &l, ENDED_SAVED);
    e = &t->ended[(t->ended_next + ENDED_KEEP - 1) % ENDED_KEEP];
    e->epoch = epoch;
  }
  e->refused = 1;
  e->gone = 1;
  if (trained > e->acct) {
    late_record(t)->examples_wasted += trained - e->acct;
    e->acct = add_sat(0, trained);
  }
  if (e->acct > e->pushed) e->pushed = e->acct;
}

int ps_leases_rejoin(ps_leases *t, uint64_t worker, const uint64_t *done, size_t n_done,
                     const ps_lease_held *held, size_t n_held, int64_t now_ms,
                     ps_lease_rejoin *out) {
  ps_lease_rejoin none;
  if (!out) out = &none;
  memset(out, 0, sizeof *out);
  if (!t || (n_done && !done) || (n_held && !held)) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  /* An epoch ends when its last chunk is done: what follows is of the old
   * epoch, no longer current, and ignored. */
  const uint32_t epoch = t->epoch;
  /* Chunks a worker finished in the next epoch (a life ahead of this one,
   * forgotten): done once that epoch begins, not trained again then. */
  const int has_next = !t->cfg.epochs || epoch + 1 < t->cfg.epochs;
  for (size_t i = 0; i < n_done && !t->finished && has_next; i++)
    if (done[i] >> 32 == (uint64_t)epoch + 1 && (uint32_t)done[i] < t->n_chunks)
      t->next_done[(uint32_t)done[i]] = 1;
  for (size_t i = 0; i < n_held && !t->finished && has_next; i++)
    if (held[i].finished && held[i].epoch == epoch + 1 && held[i].chunk < t->n_chunks &&
        held[i].lease_id && !find_ended(t, held[i].lease_id)) {
      lease l = {.id = held[i].lease_id, .worker = worker, .chunk = held[i].chunk};
      remember_ended(t, &l, ENDED_COMPLETED); /* its retried completion: counted once */
      t->next_done[held[i].chunk] = 1;
    }
  /* Completions of the epoch before, which ended since the restore: a
   * chunk another worker completed in this life was trained twice, which
   * that epoch's record (kept first in the history) counts. */
  for (size_t i = 0; i < n_done && epoch > 0 && t->n_history > 0 &&
                     t->history[0].epoch + 1 == epoch && t->epoch == epoch;
       i++) {
    uint32_t c = (uint32_t)done[i];
    if (done[i] >> 32 != (uint64_t)epoch - 1 || c >= t->n_chunks) continue;
    if ((t->prev_marks[c] & (MARK_DONE_HERE | MARK_REDONE)) != MARK_DONE_HERE ||
        completed_by(t, worker, c, epoch - 1))
      continue;
    t->prev_marks[c] |= MARK_REDONE;
    uint32_t count = chunk_count(t, c);
    t->history[0].examples_redone += count;
    out->redone++;
    out->examples_redone += count;
  }
  for (size_t i = 0; i < n_done && !t->finished && t->epoch == epoch; i++) {
    uint32_t c = (uint32_t)done[i];
    if (done[i] >> 32 != epoch || c >= t->n_chunks) continue;
    settle_own(t, c, worker, 0);
    if (t->state[c] == CHUNK_DONE) {
      /* Done in the checkpoint, or by this worker since: its own. Done
       * since by another worker: trained twice. */
      if ((t->marks[c] & MARK_DONE_HERE) && !completed_by(t, worker, c, epoch))
        count_redone(t, c, out);
    } else if (chunk_free(t, c)) {
      accept_done(t, worker, c, 0, now_ms, out);
    } else {
      count_redone(t, c, out);
    }
  }
  for (size_t i = 0; i < n_held && !t->finished && t->epoch == epoch; i++) {
    const ps_lease_held *h = &held[i];
    if (h->lease_id == 0) continue;
    if (h->refused) { /* the worker keeps those of its epoch and the one before (this
                         table's next, when it was restored to the epoch before) */
      if (h->epoch <= epoch + 1 && h->epoch + 1 >= epoch)
        refused(t, worker, h->lease_id, h->trained, h->epoch,
                h->chunk < t->n_chunks ? h->chunk : UINT32_MAX);
      continue;
    }
    if (h->epoch != epoch || h->chunk >= t->n_chunks) continue;
    /* A lease of this life is the table's to settle (at its completion);
     * what the worker trained of it counts as pushed. */
    int li = find_lease(t, h->lease_id);
    if (li >= 0) {
      if (t->leases[li].worker == worker && h->trained > t->leases[li].pushed)
        t->leases[li].pushed = h->trained;
      continue;
    }
    ended_lease *e = find_ended(t, h->lease_id);
    if (e) {
      if (e->kind == ENDED_RECLAIMED && e->worker == worker) {
        if (h->trained > e->pushed) e->pushed = h->trained;
        if (e->gone) count_abandoned(t, e);
      }
      continue;
    }
    if (!chunk_free(t, h->chunk)) {
      /* Its completion will be refused; the worker may die before: what it
       * trained of it so far is abandoned now. */
      ended_lease *s = find_acct(t, h->lease_id);
      if (s && s->worker != worker) continue;
      if (!s) {
        lease l = {.id = h->lease_id, .worker = worker, .chunk = h->chunk};
        remember_ended(t, &l, ENDED_SAVED);
        s = &t->ended[(t->ended_next + ENDED_KEEP - 1) % ENDED_KEEP];
      }
      if (h->trained > s->pushed) s->pushed = h->trained;
      s->gone = 1;
      count_abandoned(t, s);
      continue;
    }
    if (h->finished) {
      lease l = {.id = h->lease_id, .worker = worker, .chunk = h->chunk, .seen_ms = now_ms};
      remember_ended(t, &l, ENDED_COMPLETED); /* its retried completion: counted once */
      accept_done(t, worker, h->chunk, h->lease_id, now_ms, out);
    } else {
      uint32_t own = chunk_taken(t, h->chunk, h->lease_id, worker);
      if (adopt(t, worker, h->lease_id, h->chunk, own > h->trained ? own : h->trained, now_ms) ==
          PS_OK)
        out->adopted++;
    }
  }
  pthread_mutex_unlock(&t->mu);
  return PS_OK;
}

void ps_leases_note_refused(ps_leases *t, uint64_t worker, uint64_t lease_id, uint64_t trained) {
  if (!t || trained == 0) return;
  pthread_mutex_lock(&t->mu);
  refused(t, worker, lease_id, trained, t->epoch, UINT32_MAX);
  pthread_mutex_unlock(&t->mu);
}

void ps_leases_note_pushed(ps_leases *t, uint64_t worker, uint64_t lease_id, uint32_t examples) {
  if (!t || lease_id == 0 || examples == 0) return;
  pthread_mutex_lock(&t->mu);
  int i = find_lease(t, lease_id);
  if (i >= 0) {
    if (t->leases[i].worker == worker) t->leases[i].pushed = add_sat(t->leases[i].pushed, examples);
  } else {
    ended_lease *e = find_acct(t, lease_id);
    if (e && e->worker == worker) {
      e->pushed = add_sat(e->pushed, examples);
      if (e->gone) count_abandoned(t, e);
    }
  }
  pthread_mutex_unlock(&t->mu);
}

void ps_leases_stats(ps_leases *t, ps_lease_stats *out) {
  pthread_mutex_lock(&t->mu);
  memset(out, 0, sizeof *out);
  out->config = t->cfg;
  out->chunks = t->n_chunks;
  out->epoch = t->epoch;
  out->finished = t->finished;
  out->chunks_done = t->n_done;
  out->chunks_leased = t->n_leased;
  out->leases_granted = t->granted_total;
  out->reclaims_total = t->reclaims_total;
  out->current = t->cur;
  out->n_history = t->n_history;
  memcpy(out->history, t->history, (size_t)t->n_history * sizeof t->history[0]);
  pthread_mutex_unlock(&t->mu);
}

int ps_leases_epoch_record(ps_leases *t, uint32_t epoch, ps_lease_epoch_record *rec,
                           uint8_t *counts, uint32_t max) {
  if (!t) return PS_EINVAL;
  pthread_mutex_lock(&t->mu);
  const ps_lease_epoch_record *r = NULL;
  const uint8_t *c = NULL;
  if (epoch == t->epoch && !t->finished) {
    r = &t->cur;
    c = t->counts;
  } else {
    for (int i = 0; i < t->n_history; i++) {
      if (t->history[i].epoch == epoch) {
        r = &t->history[i];
        c = t->hist_counts[i];
      }
    }
  }
  int rc = PS_ENOTFOUND;
  if (r) {
    if (rec) *rec = *r;
    if (counts) memcpy(counts, c, max < t->n_chunks ? max : t->n_chunks);
    rc = (int)t->n_chunks;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

/* ---------------------------------------------------------------- checkpoint blob
 *
 * Little-endian, every integer at a fixed place:
 *
 *   0  u8[8] magic "PSLEASE\0"        8  u32 version (LEASE_VERSION)
 *  12  u64 n_examples                20  u32 chunk_size
 *  24  u32 epochs                    28  u64 seed
 *  36  u32 max_per_worker            40  u32 n_chunks
 *  44  u32 epoch                     48  u32 finished (0/1)
 *  52  u64 next_lease_id             60  u64 leases_granted
 *  68  u64 reclaims_total            76  u32 n_history (<= PS_LEASE_HISTORY)
 *  80  record of the current epoch (rec_bytes)
 *  then n_history times, newest first: record, u8 counts[n_chunks]
 *  then u8 state[n_chunks] (CHUNK_*, by chunk id), u8 counts[n_chunks]
 *  then (version 2) u8 redone[n_chunks]: 1 where the chunk's lost completion
 *       was counted in the current epoch's examples_redone, else 0
 *  then (version 3) u32 n_leases, and the outstanding leases in grant order,
 *       each u64 id, u64 worker, u32 chunk, i64 seen_ms (28 bytes), then u32
 *       pool_len and the pool's chunks in the order they are handed out: a
 *       restore puts the leased chunks back in the pool (a new life); a
 *       replica's copy of its primary's table keeps both (ps_leases_replace),
 *       so that it hands out what its primary does; then u8
 *       next_done[n_chunks]: 1 where a worker finished the chunk in the next
 *       epoch (ps_leases_rejoin), else 0
 *  then (version 4) u32 pushed[n_leases]: the examples pushed under each
 *       outstanding lease, in grant order; then u32 n_acct and n_acct
 *       reclaimed leases of this epoch and the one before whose pushes
 *       count, oldest first, each u64 id, u64 worker, u32 epoch, u32 chunk,
 *       u32 pushed, u32 acct, u32 flags (ACCT_*) (36 bytes); a restore
 *       keeps them, and the outstanding leases with something pushed, as
 *       a life before's (ENDED_SAVED)
 *  then u32 CRC-32C of every byte before it.
 *
 * A record: u32 epoch, u32 finished, u32 chunks_completed, u32 chunks_once,
 * u64 examples_completed, u64 examples_handed_out, u64 examples_rehanded,
 * u64 reclaims, i64 start_ms, i64 end_ms, then (version 2) u64
 * examples_redone, then (version 3) u64 examples_recovered, u64
 * examples_wasted, then (version 4) u64 examples_abandoned. Versions 1
 * (without examples_redone and the redone flags), 2 and 3 still load:
 * nothing was redone, recovered, wasted or abandoned then. */

static const uint8_t LEASE_MAGIC[8] = {'P', 'S', 'L', 'E', 'A', 'S', 'E', 0};
#define LEASE_VERSION 4
#define HEAD_BYTES 80
#define REC_BYTES_V1 64
#define REC_BYTES_V2 72
#define REC_BYTES_V3 88
#define REC_BYTES 96
#define ACCT_BYTES 36

/* A record's bytes in a blob of that version. */
static size_t rec_bytes(uint32_t version) {
  return version == 1   ? REC_BYTES_V1
         : version == 2 ? REC_BYTES_V2
         : version == 3 ? REC_BYTES_V3
                        : REC_BYTES;
}

/* The common little-endian helpers, advancing through the blob. */
static uint8_t *put_u32(uint8_t *p, uint32_t v) {
  ps_put_le32(p, v);
  return p + 4;
}
static uint8_t *put_u64(uint8_t *p, uint64_t v) {
  ps_put_le64(p, v);
  return p + 8;
}
static uint32_t get_u32(const uint8_t **p) {
  *p += 4;
  return ps_get_le32(*p - 4);
}
static uint64_t get_u64(const uint8_t **p) {
  *p += 8;
  return ps_get_le64(*p - 8);
}

static uint8_t *put_record(uint8_t *p, const ps_lease_epoch_record *r) {
  p = put_u32(p, r->epoch);
  p = put_u32(p, (uint32_t)r->finished);
  p = put_u32(p, r->chunks_completed);
  p = put_u32(p, r->chunks_once);
  p = put_u64(p, r->examples_completed);
  p = put_u64(p, r->examples_handed_out);
  p = put_u64(p, r->examples_rehanded);
  p = put_u64(p, r->reclaims);
  p = put_u64(p, (uint64_t)r->start_ms);
  p = put_u64(p, (uint64_t)r->end_ms);
  p = put_u64(p, r->examples_redone);
  p = put_u64(p, r->examples_recovered);
  p = put_u64(p, r->examples_wasted);
  return put_u64(p, r->examples_abandoned);
}

static void get_record(const uint8_t **p, ps_lease_epoch_record *r, uint32_t n_chunks,
                       uint32_t version) {
  r->chunks = n_chunks;
  r->epoch = get_u32(p);
  uint32_t finished = get_u32(p);
  r->finished = finished > 1 ? -1 : (int)finished; /* -1: rejected by check_record */
  r->chunks_completed = get_u32(p);
  r->chunks_once = get_u32(p);
  r->examples_completed = get_u64(p);
  r->examples_handed_out = get_u64(p);
  r->examples_rehanded = get_u64(p);
  r->reclaims = get_u64(p);
  r->start_ms = (int64_t)get_u64(p);
  r->end_ms = (int64_t)get_u64(p);
  r->examples_redone = version == 1 ? 0 : get_u64(p);
  r->examples_recovered = version < 3 ? 0 : get_u64(p);
  r->examples_wasted = version < 3 ? 0 : get_u64(p);
  r->examples_abandoned = version < 4 ? 0 : get_u64(p);
}

#define LEASE_BYTES 28

/* The bytes before the outstanding leases (version 3) or the checksum. */
static size_t fixed_bytes(uint32_t n_chunks, uint32_t n_history, uint32_t version) {
  size_t rec = rec_bytes(version);
  return HEAD_BYTES + rec + (size_t)n_history * (rec + n_chunks) +
         (version == 1 ? 2 : 3) * (size_t)n_chunks;
}

static size_t blob_bytes(uint32_t n_chunks, uint32_t n_history, uint32_t version, uint32_t n_leases,
                         uint32_t pool_len, uint32_t n_acct) {
  return fixed_bytes(n_chunks, n_history, version) +
         (version >= 3 ? 8 + (size_t)n_leases * LEASE_BYTES + 4 * (size_t)pool_len + n_chunks : 0) +
         (version >= 4 ? 4 * (size_t)n_leases + 4 + (size_t)n_acct * ACCT_BYTES : 0) + 4;
}

/* The i-th ended lease, oldest first. */
static const ended_lease *ended_at(const ps_leases *t, uint32_t i) {
  uint32_t first = t->ended_n < ENDED_KEEP ? 0 : t->ended_next;
  return &t->ended[(first + i) % ENDED_KEEP];
}

/* Whether a checkpoint keeps ended lease e: a reclaimed one (of this life
 * or one before) of this epoch or the one before, with counts. */
static int acct_kept(const ps_leases *t, const ended_lease *e) {
  return e->id != 0 && (e->kind == ENDED_RECLAIMED || e->kind == ENDED_SAVED) &&
         (e->pushed || e->acct || e->refused) && e->epoch <= t->epoch && e->epoch + 1 >= t->epoch;
}

int ps_leases_save(const ps_leases *t, void **buf, size_t *len) {
  if (!t || !buf || !len) return PS_EINVAL;
  /* Saving changes nothing; the lock is the only thing written. */
  ps_leases *mt = (ps_leases *)t;
  pthread_mutex_lock(&mt->mu);
  size_t n = t->n_chunks;
  uint32_t n_acct = 0;
  for (uint32_t i = 0; i < t->ended_n; i++) n_acct += acct_kept(t, ended_at(t, i));
  size_t total = blob_bytes(t->n_chunks, (uint32_t)t->n_history, LEASE_VERSION,
                            (uint32_t)t->n_leases, t->pool_len, n_acct);
  uint8_t *b = malloc(total);
  if (!b) {
    pthread_mutex_unlock(&mt->mu);
    return PS_ENOMEM;
  }
  memcpy(b, LEASE_MAGIC, 8);
  uint8_t *p = put_u32(b + 8, LEASE_VERSION);
  p = put_u64(p, t->cfg.n_examples);
  p = put_u32(p, t->cfg.chunk_size);
  p = put_u32(p, t->cfg.epochs);
  p = put_u64(p, t->cfg.seed);
  p = put_u32(p, t->cfg.max_per_worker);
  p = put_u32(p, t->n_chunks);
  p = put_u32(p, t->epoch);
  p = put_u32(p, (uint32_t)t->finished);
  p = put_u64(p, t->next_id);
  p = put_u64(p, t->granted_total);
  p = put_u64(p, t->reclaims_total);
  p = put_u32(p, (uint32_t)t->n_history);
  p = put_record(p, &t->cur);
  for (int i = 0; i < t->n_history; i++) {
    p = put_record(p, &t->history[i]);
    memcpy(p, t->hist_counts[i], n);
    p += n;
  }
  memcpy(p, t->state, n);
  p += n;
  memcpy(p, t->counts, n);
  p += n;
  for (size_t k = 0; k < n; k++) p[k] = (t->marks[k] & MARK_REDONE) != 0;
  p += n;
  p = put_u32(p, (uint32_t)t->n_leases);
  for (int i = 0; i < t->n_leases; i++) {
    p = put_u64(p, t->leases[i].id);
    p = put_u64(p, t->leases[i].worker);
    p = put_u32(p, t->leases[i].chunk);
    p = put_u64(p, (uint64_t)t->leases[i].seen_ms);
  }
  p = put_u32(p, t->pool_len);
  for (uint32_t i = 0; i < t->pool_len; i++)
    p = put_u32(p, t->pool[(t->pool_head + i) % t->n_chunks]);
  memcpy(p, t->next_done, n);
  p += n;
  for (int i = 0; i < t->n_leases; i++) p = put_u32(p, t->leases[i].pushed);
  p = put_u32(p, n_acct);
  for (uint32_t i = 0; i < t->ended_n; i++) {
    const ended_lease *e = ended_at(t, i);
    if (!acct_kept(t, e)) continue;
    p = put_u64(p, e->id);
    p = put_u64(p, e->worker);
    p = put_u32(p, e->epoch);
    p = put_u32(p, e->chunk);
    p = put_u32(p, e->pushed);
    p = put_u32(p, e->acct);
    p = put_u32(p, (e->gone ? ACCT_GONE : 0) | (e->refused ? ACCT_REFUSED : 0) |
                       (e->kind == ENDED_SAVED ? ACCT_SAVED : 0));
  }
  put_u32(p, ps_crc32c(0, b, (size_t)(p - b)));
  pthread_mutex_unlock(&mt->mu);
  *buf = b;
  *len = total;
  return PS_OK;
}

/* Counts consistent with a record: each chunk completed at most once, and
 * the record's sums what the counts say. */
static int check_counts(const ps_leases *t, const ps_lease_epoch_record *r, const uint8_t *counts,
                        const char *what, char *err) {
  uint32_t completed = 0;
  uint64_t examples = 0;
  for (uint32_t k = 0; k < t->n_chunks; k++) {
    if (counts[k] > 1)
      return ps_seterr(err, PS_EINVAL,
                       "lease table blob: %s, epoch %u: chunk %u completed %u times", what,
                       (unsigned)r->epoch, (unsigned)k, (unsigned)counts[k]);
    if (counts[k]) {
      completed++;
      examples += chunk_count(t, k);
    }
  }
  if (r->chunks_completed != completed || r->chunks_once != completed ||
      r->examples_completed != examples)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: %s, epoch %u: the record says %u chunks (%llu examples) "
                     "completed, the chunks %u (%llu)",
                     what, (unsigned)r->epoch, (unsigned)r->chunks_completed,
                     (unsigned long long)r->examples_completed, (unsigned)completed,
                     (unsigned long long)examples);
  if (r->examples_rehanded > r->examples_handed_out)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: %s, epoch %u: more examples re-handed out than handed out",
                     what, (unsigned)r->epoch);
  if (r->examples_recovered > r->examples_completed)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: %s, epoch %u: more examples recovered than completed", what,
                     (unsigned)r->epoch);
  /* Each chunk is counted redone once per epoch at most. */
  if (r->examples_redone > t->cfg.n_examples)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: %s, epoch %u: %llu examples redone, more than the %llu "
                     "of an epoch",
                     what, (unsigned)r->epoch, (unsigned long long)r->examples_redone,
                     (unsigned long long)t->cfg.n_examples);
  return PS_OK;
}

/* Checks the decoded state of t, with the chunks' saved states and redone
 * flags (saved_redone NULL: a version 1 blob, none): everything but the
 * lengths and the checksum, which the caller checked. */
static int check_loaded(const ps_leases *t, const uint8_t *saved_state, const uint8_t *saved_redone,
                        char *err) {
  const ps_lease_config *cfg = &t->cfg;
  if (t->finished != 0 && t->finished != 1)
    return ps_seterr(err, PS_EINVAL, "lease table blob: finished flag %d", t->finished);
  int should_finish = cfg->epochs && t->epoch >= cfg->epochs;
  if (t->finished != should_finish || (cfg->epochs && t->epoch > cfg->epochs))
    return ps_seterr(err, PS_EINVAL, "lease table blob: at epoch %u of %u, finished flag %d",
                     (unsigned)t->epoch, (unsigned)cfg->epochs, t->finished);
  if ((uint32_t)t->n_history > t->epoch)
    return ps_seterr(err, PS_EINVAL, "lease table blob: %d finished epochs kept at epoch %u",
                     t->n_history, (unsigned)t->epoch);
  for (int i = 0; i < t->n_history; i++) {
    const ps_lease_epoch_record *r = &t->history[i];
    if (r->epoch != t->epoch - 1 - (uint32_t)i || r->finished != 1)
      return ps_seterr(err, PS_EINVAL,
                       "lease table blob: kept record %d is of epoch %u (finished %d), "
                       "expected the finished epoch %u",
                       i, (unsigned)r->epoch, r->finished, (unsigned)(t->epoch - 1 - (uint32_t)i));
    int rc = check_counts(t, r, t->hist_counts[i], "kept record", err);
    if (rc) return rc;
    if (r->chunks_completed != t->n_chunks)
      return ps_seterr(err, PS_EINVAL,
                       "lease table blob: finished epoch %u has %u of %u chunks completed",
                       (unsigned)r->epoch, (unsigned)r->chunks_completed, (unsigned)t->n_chunks);
  }
  if (t->cur.epoch != t->epoch || t->cur.finished != 0)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: the current record is of epoch %u (finished %d), not %u",
                     (unsigned)t->cur.epoch, t->cur.finished, (unsigned)t->epoch);
  uint32_t done = 0;
  for (uint32_t k = 0; k < t->n_chunks; k++) {
    if (saved_state[k] > CHUNK_DONE)
      return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u in state %u", (unsigned)k,
                       (unsigned)saved_state[k]);
    if ((saved_state[k] == CHUNK_DONE) != (t->counts[k] == 1))
      return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u in state %u with %u completions",
                       (unsigned)k, (unsigned)saved_state[k], (unsigned)t->counts[k]);
    if (t->finished && saved_state[k] != CHUNK_FRESH)
      return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u in use after the last epoch",
                       (unsigned)k);
    done += saved_state[k] == CHUNK_DONE;
  }
  if (done == t->n_chunks)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: every chunk of epoch %u done, epoch not ended",
                     (unsigned)t->epoch);
  /* The flags say which chunks the current record's examples_redone holds. */
  uint64_t redone = 0;
  for (uint32_t k = 0; saved_redone && k < t->n_chunks; k++) {
    if (saved_redone[k] > 1)
      return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u with redone flag %u",
                       (unsigned)k, (unsigned)saved_redone[k]);
    if (saved_redone[k]) redone += chunk_count(t, k);
  }
  if (t->cur.examples_redone != redone)
    return ps_seterr(err, PS_EINVAL,
                     "lease table blob: the current record says %llu examples redone, the "
                     "chunks' flags %llu",
                     (unsigned long long)t->cur.examples_redone, (unsigned long long)redone);
  return check_counts(t, &t->cur, t->counts, "current record", err);
}

ps_leases *ps_leases_load(const void *buf, size_t len, char *err) {
  return load_blob(buf, len, 0, err);
}

ps_leases *ps_leases_load_copy(const void *buf, size_t len, char *err) {
  return load_blob(buf, len, 1, err);
}

/* The outstanding leases of a version 3 blob (n, at *p): each on a chunk
 * the blob says is leased, every leased chunk held once, no id twice. A
 * replica's copy (keep) holds them as its primary does; a new life only
 * checks them (their chunks go back in the pool). */
static int load_leases(ps_leases *t, const uint8_t **p, uint32_t n, const uint8_t *saved_state,
                       int keep, char *err) {
  uint32_t leased = 0;
  for (uint32_t k = 0; k < t->n_chunks; k++) leased += saved_state[k] == CHUNK_LEASED;
  if (n != leased)
    return ps_seterr(err, PS_EINVAL, "lease table blob: %u outstanding leases, %u chunks leased",
                     (unsigned)n, (unsigned)leased);
  if (n && !(t->leases = malloc((size_t)n * sizeof *t->leases)))
    return ps_seterr(err, PS_ENOMEM, "lease table blob: out of memory for %u leases", (unsigned)n);
  t->cap_leases = (int)n;
  for (uint32_t i = 0; i < n; i++) {
    lease l;
    l.id = get_u64(p);
    l.worker = get_u64(p);
    l.chunk = get_u32(p);
    l.seen_ms = (int64_t)get_u64(p);
    if (l.chunk >= t->n_chunks || saved_state[l.chunk] != CHUNK_LEASED || l.id == 0)
      return ps_seterr(err, PS_EINVAL, "lease table blob: lease %u on chunk %u, not a leased one",
                       (unsigned)i, (unsigned)l.chunk);
    for (uint32_t j = 0; j < i; j++)
      if (t->leases[j].chunk == l.chunk || t->leases[j].id == l.id)
        return ps_seterr(err, PS_EINVAL, "lease table blob: two leases of chunk %u or id %llu",
                         (unsigned)l.chunk, (unsigned long long)l.id);
    t->leases[i] = l;
  }
  if (keep) {
    t->n_leases = (int)n;
    t->n_leased = n;
  }
  return PS_OK;
}

/* The pool of a version 3 blob (at p: u32 pool_len, then its chunks) in
 * its order: each a chunk in the pool (or done since it went there, which
 * popping skips), and every chunk in the pool in it, so that the epoch can
 * end. */
static int load_pool(ps_leases *t, const uint8_t *p, char *err) {
  uint32_t n = get_u32(&p), pooled = 0;
  for (uint32_t k = 0; k < t->n_chunks; k++) pooled += t->state[k] == CHUNK_POOLED;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t c = get_u32(&p);
    if (c >= t->n_chunks || (t->state[c] != CHUNK_POOLED && t->state[c] != CHUNK_DONE))
      return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u in the pool, not a pooled one",
                       (unsigned)c);
    if (t->state[c] == CHUNK_POOLED) {
      pooled--; /* each once: a second entry of it counts below zero */
      if (pooled == UINT32_MAX)
        return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u twice in the pool",
                         (unsigned)c);
    }
    pool_push(t, c);
  }
  if (pooled)
    return ps_seterr(err, PS_EINVAL, "lease table blob: %u pooled chunks not in the pool",
                     (unsigned)pooled);
  return PS_OK;
}

/* The chunks of a loaded table in place: the permutation from the seed,
 * chunks in use back in the pool (leased ones counted as reclaimed: their
 * holders register again), or, for a replica's copy of a version 3 blob
 * (same_ids), the primary's leases and pool as they were; the next epoch's
 * chunks already done. tail: the blob past its fixed part. */
static int lay_out_chunks(ps_leases *t, const uint8_t *saved_state, const uint8_t *saved_redone,
                          uint32_t version, int same_ids, const uint8_t *tail, uint32_t n_leases,
                          uint32_t pool_len, char *err) {
  const uint32_t n_chunks = t->n_chunks;
  /* The permutation from the seed; chunks in use go to the pool, leased
   * ones counted as reclaimed (their holders re-register and start anew). */
  for (uint32_t k = 0; k < n_chunks; k++) t->order[k] = k;
  if (!t->finished) {
    ps_rand r;
    ps_rand_seed(&r, ps_rng_u64(t->cfg.seed, PERM_STREAM, t->epoch));
    ps_rand_shuffle_u32(&r, t->order, n_chunks);
  }
  t->cursor = t->finished ? n_chunks : 0;
  for (uint32_t i = 0; i < n_chunks; i++) {
    uint32_t k = t->order[i];
    uint8_t s = saved_state[k];
    if (s == CHUNK_LEASED && same_ids && version >= 3) {
      /* A replica's copy: its leases are the primary's (load_leases). */
      t->marks[k] = saved_redone && saved_redone[k] ? MARK_REDONE : 0;
      t->state[k] = CHUNK_LEASED;
      continue;
    }
    if (s == CHUNK_LEASED) {
      t->cur.reclaims++;
      t->reclaims_total++;
    }
    /* Marked as gone through the pool: handing them out again counts
     * them as re-handed out. */
    t->marks[k] = saved_redone && saved_redone[k] ? MARK_REDONE : 0;
    if (s == CHUNK_LEASED || s == CHUNK_POOLED) {
      s = CHUNK_POOLED;
      t->marks[k] |= MARK_POOLED;
      if (!(same_ids && version >= 3)) pool_push(t, k); /* else in the primary's order, below */
    }
    t->state[k] = s;
    t->n_done += s == CHUNK_DONE;
  }
  if (same_ids && version >= 3 &&
      load_pool(t, tail + 4 + (size_t)n_leases * LEASE_BYTES, err) != PS_OK)
    return PS_EINVAL;
  if (version >= 3) {
    const uint8_t *nd = tail + 8 + (size_t)n_leases * LEASE_BYTES + 4 * (size_t)pool_len;
    for (uint32_t k = 0; k < n_chunks; k++) {
      if (nd[k] > 1 || (nd[k] && t->finished)) {
        return ps_seterr(err, PS_EINVAL, "lease table blob: chunk %u with next-epoch flag %u",
                         (unsigned)k, (unsigned)nd[k]);
      }
      t->next_done[k] = nd[k];
    }
  }
  return PS_OK;
}

/* The counts of a version 4 blob (at p: the outstanding leases' pushes,
 * then the reclaimed leases whose pushes count). A new life keeps them as
 * a life before's (ENDED_SAVED), the outstanding leases' with them; a
 * replica's copy (same_ids) as its primary has them. */
static int load_acct(ps_leases *t, const uint8_t *p, uint32_t n_leases, int same_ids, char *err) {
  for (uint32_t i = 0; i < n_leases; i++) {
    t->leases[i].pushed = get_u32(&p);
    if (!same_ids && t->leases[i].pushed) remember_ended(t, &t->leases[i], ENDED_SAVED);
  }
  uint32_t n_acct = get_u32(&p);
  for (uint32_t i = 0; i < n_acct; i++) {
    lease l = {0};
    l.id = get_u64(&p);
    l.worker = get_u64(&p);
    uint32_t epoch = get_u32(&p);
    l.chunk = get_u32(&p);
    l.pushed = get_u32(&p);
    uint32_t acct = get_u32(&p), flags = get_u32(&p);
    if (l.id == 0 || flags > (ACCT_GONE | ACCT_REFUSED | ACCT_SAVED) || epoch > t->epoch ||
        epoch + 1 < t->epoch || (l.chunk >= t->n_chunks && l.chunk != UINT32_MAX))
      return ps_seterr(err, PS_EINVAL,
                       "lease table blob: reclaimed lease %u: id %llu, epoch %u (table at %u), "
                       "chunk %u, flags %u",
                       (unsigned)i, (unsigned long long)l.id, (unsigned)epoch, (unsigned)t->epoch,
                       (unsigned)l.chunk, (unsigned)flags);
    remember_ended(t, &l, same_ids && !(flags & ACCT_SAVED) ? ENDED_RECLAIMED : ENDED_SAVED);
    ended_lease *e = &t->ended[(t->ended_next + ENDED_KEEP - 1) % ENDED_KEEP];
    e->epoch = epoch;
    e->acct = acct;
    e->gone = (flags & ACCT_GONE) != 0;
    e->refused = (flags & ACCT_REFUSED) != 0;
  }
  return PS_OK;
}

/* same_ids: the blob's next lease id goes on (a replica's copy of its
 * primary's table); else ids start past it and past the wall clock's (a
 * new life after a restore). */
static ps_leases *load_blob(const void *buf, size_t len, int same_ids, char *err) {
  const uint8_t *b = buf;
  if (!b || len < HEAD_BYTES + REC_BYTES_V1 + 4) {
    ps_seterr(err, PS_EINVAL, "lease table blob: %zu bytes, shorter than any table", b ? len : 0);
    return NULL;
  }
  if (memcmp(b, LEASE_MAGIC, 8) != 0) {
    ps_seterr(err, PS_EINVAL, "lease table blob: bad magic: not a lease table");
    return NULL;
  }
  const uint8_t *p = b + 8;
  uint32_t version = get_u32(&p);
  if (version < 1 || version > LEASE_VERSION) {
    ps_seterr(err, PS_EPROTO,
              "lease table blob: version %u, this build reads versions 1 to %u (written by a "
              "newer version?)",
              (unsigned)version, (unsigned)LEASE_VERSION);
    return NULL;
  }
  ps_lease_config cfg;
  cfg.n_examples = get_u64(&p);
  cfg.chunk_size = get_u32(&p);
  cfg.epochs = get_u32(&p);
  cfg.seed = get_u64(&p);
  cfg.max_per_worker = get_u32(&p);
  uint32_t n_chunks = get_u32(&p);
  uint32_t epoch = get_u32(&p);
  uint32_t finished = get_u32(&p);
  uint64_t next_id = get_u64(&p);
  uint64_t granted = get_u64(&p);
  uint64_t reclaims = get_u64(&p);
  uint32_t n_history = get_u32(&p);
  /* The length follows from n_chunks and n_history; with it the checksum
   * is checked before anything else is believed. */
  if (n_chunks > PS_LEASE_MAX_CHUNKS || n_chunks == 0) {
    ps_seterr(err, PS_EINVAL, "lease table blob: %u chunks (1 to %u)", (unsigned)n_chunks,
              (unsigned)PS_LEASE_MAX_CHUNKS);
    return NULL;
  }
  if (n_history > PS_LEASE_HISTORY) {
    ps_seterr(err, PS_EINVAL, "lease table blob: %u epoch records, at most %d are kept",
              (unsigned)n_history, PS_LEASE_HISTORY);
    return NULL;
  }
  /* Version 3: the number of outstanding leases follows the fixed part,
   * and the pool's length them; version 4: the kept reclaimed leases'
   * number follows the outstanding leases' pushes. */
  uint32_t n_leases = 0, pool_len = 0, n_acct = 0;
  size_t fixed = fixed_bytes(n_chunks, n_history, version);
  if (version >= 3 && len >= fixed + 4) {
    const uint8_t *nl = b + fixed;
    n_leases = get_u32(&nl);
    if (n_leases > n_chunks) {
      ps_seterr(err, PS_EINVAL, "lease table blob: %u outstanding leases of %u chunks",
                (unsigned)n_leases, (unsigned)n_chunks);
      return NULL;
    }
    size_t at = fixed + 4 + (size_t)n_leases * LEASE_BYTES;
    if (len >= at + 4) {
      const uint8_t *pl = b + at;
      pool_len = get_u32(&pl);
      if (pool_len > n_chunks) {
        ps_seterr(err, PS_EINVAL, "lease table blob: a pool of %u of %u chunks", (unsigned)pool_len,
                  (unsigned)n_chunks);
        return NULL;
      }
      size_t acct_at = at + 4 + 4 * (size_t)pool_len + n_chunks + 4 * (size_t)n_leases;
      if (version >= 4 && len >= acct_at + 4) {
        const uint8_t *na = b + acct_at;
        n_acct = get_u32(&na);
        if (n_acct > ENDED_KEEP) {
          ps_seterr(err, PS_EINVAL, "lease table blob: %u reclaimed leases kept, at most %d",
                    (unsigned)n_acct, ENDED_KEEP);
          return NULL;
        }
      }
    }
  }
  size_t want = blob_bytes(n_chunks, n_history, version, n_leases, pool_len, n_acct);
  if (len != want) {
    ps_seterr(err, PS_EINVAL, "lease table blob: %zu bytes, %zu expected for %u chunks (%s)", len,
              want, (unsigned)n_chunks, len < want ? "truncated" : "trailing bytes");
    return NULL;
  }
  const uint8_t *q = b + len - 4;
  if (get_u32(&q) != ps_crc32c(0, b, len - 4)) {
    ps_seterr(err, PS_EINVAL, "lease table blob: checksum mismatch: corrupt");
    return NULL;
  }
  char why[PS_ERRLEN];
  uint32_t want_chunks = 0;
  if (check_config(&cfg, &want_chunks, why) != PS_OK) {
    ps_seterr(err, PS_EINVAL, "lease table blob: bad configuration (%s)", why);
    return NULL;
  }
  if (n_chunks != want_chunks) {
    ps_seterr(err, PS_EINVAL,
              "lease table blob: %u chunks, but %llu examples in chunks of %u make %u",
              (unsigned)n_chunks, (unsigned long long)cfg.n_examples, (unsigned)cfg.chunk_size,
              (unsigned)want_chunks);
    return NULL;
  }

  ps_leases *t = table_alloc(&cfg, n_chunks, err);
  if (!t) return NULL;
  t->epoch = epoch;
  t->finished = finished > 1 ? -1 : (int)finished;
  t->granted_total = granted;
  t->reclaims_total = reclaims;
  t->n_history = (int)n_history;
  get_record(&p, &t->cur, n_chunks, version);
  for (uint32_t i = 0; i < n_history; i++) {
    get_record(&p, &t->history[i], n_chunks, version);
    memcpy(t->hist_counts[i], p, n_chunks);
    p += n_chunks;
  }
  const uint8_t *saved_state = p;
  p += n_chunks;
  memcpy(t->counts, p, n_chunks);
  p += n_chunks;
  const uint8_t *saved_redone = version == 1 ? NULL : p;
  if (check_loaded(t, saved_state, saved_redone, err) != PS_OK) {
    ps_leases_destroy(t);
    return NULL;
  }
  if (version >= 3) {
    p = b + fixed + 4;
    if (load_leases(t, &p, n_leases, saved_state, same_ids, err) != PS_OK) {
      ps_leases_destroy(t);
      return NULL;
    }
  }

  if (lay_out_chunks(t, saved_state, saved_redone, version, same_ids, b + fixed, n_leases, pool_len,
                     err) != PS_OK ||
      (version >= 4 &&
       load_acct(t,
                 b + fixed + 8 + (size_t)n_leases * LEASE_BYTES + 4 * (size_t)pool_len + n_chunks,
                 n_leases, same_ids, err) != PS_OK)) {
    ps_leases_destroy(t);
    return NULL;
  }
  t->next_id = same_ids ? next_id : first_id(next_id);
  return t;
}

/* A shard's state: parameters, optimizer slots, version, push statistics.
 *
 * Parameters live in reference-counted, immutable snapshots. A push never
 * changes the snapshot that pulls see: it writes the updated values into
 * another buffer (read the current values, apply, write the new buffer:
 * the same memory traffic as an update in place) and then publishes it as
 * the current snapshot. So a pull is O(1): it takes a reference to the
 * current snapshot and gRPC sends straight from it, with no copy and no
 * lock held while the bytes go out, and a pull never waits for a push
 * being applied.
 *
 * Locking: `apply_mu` serializes pushes (they own the slots and the spare
 * buffers); `mu` guards the pointer to the current snapshot, the version
 * and the statistics, and is only ever held for a few instructions. The
 * checks of a push (range, length, every value finite) read only the
 * request and the shard's fixed range, so they run before any lock.
 *
 * Buffers: retired snapshots stay with the shard; once no pull holds one
 * any more (its count is back to the shard's single reference) the next
 * push reuses it, so the steady state allocates nothing.
 *
 * Copy on write: when no pull holds the current snapshot at all, a push
 * updates it in place (a third less memory traffic than writing another
 * buffer); pulls that arrive meanwhile wait for that one update. */
#include "shard.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../common/model_spec.h"
#include "../common/optim.h"

/* Enough for every optimizer of optim.c (adam has 2). */
#define SHARD_MAX_SLOTS 4
/* Retired snapshots kept for reuse: one being sent to each of a couple of
 * pullers while the next push is applied. */
#define SHARD_SPARES 3
/* Values copied and updated per piece while they are in cache. */
#define APPLY_CHUNK 4096
/* Pushes of at least this many values are checked and applied in two
 * halves at once, by the serving thread and the shard's helper thread: the
 * work is memory-bound and a second core still adds about half again. */
#define SPLIT_MIN (1u << 20)

/* The shard's helper thread: runs one job at a time for split_run. */
typedef struct {
  pthread_t thread;
  pthread_mutex_t use_mu; /* one split_run at a time */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int (*fn)(void *);
  void *arg;
  int busy, done, rc, quit, started;
} helper_thread;

/* ps_snapshot.refs is a plain int in the public header; it is only ever
 * accessed through these atomic views, which requires the two types to be
 * laid out alike. */
_Static_assert(sizeof(_Atomic int) == sizeof(int) && _Alignof(_Atomic int) == _Alignof(int),
               "ps_snapshot.refs must be usable as an atomic int");
#define SNAP_REFS(snap) ((_Atomic int *)(void *)&(snap)->refs)

/* The snapshot header is padded so that values start 64-byte aligned in the
 * same allocation. */
#define SNAP_HEADER_BYTES (((sizeof(ps_snapshot) + 63) / 64) * 64)

struct ps_shard {
  int index, num_shards;
  size_t begin, end; /* global range owned; n = end - begin */
  const ps_optimizer *opt;
  ps_optim_config cfg;
  float *slots[SHARD_MAX_SLOTS]; /* opt->n_slots arrays of (n) */

  pthread_mutex_t apply_mu;         /* serializes updates */
  helper_thread helper;             /* for split_run; started for large shards */
  int staleness_aware;              /* lr / max(1, staleness) */
  /* sync mode: the sum of the current step's gradients and who sent them */
  float *sync_sum;
  uint64_t *sync_ids;
  int sync_n, sync_cap;
  ps_snapshot *retired[SHARD_SPARES]; /* earlier snapshots, one ref each, or NULL */

  pthread_mutex_t mu;
  pthread_cond_t applied; /* signalled when an update in place ends */
  int in_place;           /* an update in place of `current` is under way */
  ps_snapshot *current;  /* the whole range at `version`; one ref held */
  uint64_t version;      /* updates applied */
  ps_shard_stats stats;  /* .version unused here: filled from version on read */
  double first_update_s, last_update_s; /* for the mean step time */
};

/* ---------------------------------------------------------------- snapshots */

/* A snapshot of count values with one reference, values uninitialized (the
 * caller copies into them at once, so zeroing would be a wasted pass). */
static ps_snapshot *snapshot_alloc(size_t begin, size_t count) {
  if (count > (SIZE_MAX - SNAP_HEADER_BYTES) / sizeof(float)) return NULL;
  void *mem = NULL;
  if (posix_memalign(&mem, 64, SNAP_HEADER_BYTES + count * sizeof(float)) != 0) return NULL;
  ps_snapshot *snap = mem;
  snap->version = 0;
  snap->begin = begin;
  snap->count = count;
  snap->values = (float *)(void *)((char *)mem + SNAP_HEADER_BYTES);
  atomic_init(SNAP_REFS(snap), 1);
  return snap;
}

static ps_snapshot *snapshot_ref(ps_snapshot *snap) {
  /* Relaxed suffices to take a reference from one already held. */
  atomic_fetch_add_explicit(SNAP_REFS(snap), 1, memory_order_relaxed);
  return snap;
}

void ps_snapshot_unref(ps_snapshot *snap) {
  if (!snap) return;
  /* acq_rel: the last owner must see every other owner's reads finished
   * before it frees. */
  if (atomic_fetch_sub_explicit(SNAP_REFS(snap), 1, memory_order_acq_rel) == 1) free(snap);
}

/* ---------------------------------------------------------------- helper thread */

static void *helper_main(void *arg) {
  helper_thread *h = arg;
  pthread_mutex_lock(&h->mu);
  for (;;) {
    while (!h->busy && !h->quit) pthread_cond_wait(&h->cv, &h->mu);
    if (h->quit) break;
    pthread_mutex_unlock(&h->mu);
    int rc = h->fn(h->arg);
    pthread_mutex_lock(&h->mu);
    h->rc = rc;
    h->busy = 0;
    h->done = 1;
    pthread_cond_broadcast(&h->cv);
  }
  pthread_mutex_unlock(&h->mu);
  return NULL;
}

static int helper_start(helper_thread *h) {
  pthread_mutex_init(&h->use_mu, NULL);
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  h->started = pthread_create(&h->thread, NULL, helper_main, h) == 0;
  return h->started ? 0 : -1;
}

static void helper_stop(helper_thread *h) {
  if (!h->started) return;
  pthread_mutex_lock(&h->mu);
  h->quit = 1;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
  pthread_join(h->thread, NULL);
  pthread_mutex_destroy(&h->mu);
  pthread_mutex_destroy(&h->use_mu);
  pthread_cond_destroy(&h->cv);
  h->started = 0;
}

/* Runs fn(a) here and fn(b) on the helper thread (or both here when it is
 * not running); returns the first non-zero result, a's first. Any thread
 * may call it; callers take turns (use_mu). */
static int split_run(helper_thread *h, int (*fn)(void *), void *a, void *b) {
  if (!h->started) {
    int ra = fn(a), rb = fn(b);
    return ra ? ra : rb;
  }
  pthread_mutex_lock(&h->use_mu);
  pthread_mutex_lock(&h->mu);
  h->fn = fn;
  h->arg = b;
  h->busy = 1;
  h->done = 0;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
  int ra = fn(a);
  pthread_mutex_lock(&h->mu);
  while (!h->done) pthread_cond_wait(&h->cv, &h->mu);
  h->done = 0;
  int rb = h->rc;
  pthread_mutex_unlock(&h->mu);
  pthread_mutex_unlock(&h->use_mu);
  return ra ? ra : rb;
}

/* ---------------------------------------------------------------- creation */

/* Rejects settings that would turn the first update into NaN or Inf, with
 * the field named; 0 if the configuration is usable. */
static int check_optim_config(const ps_optim_config *c, char *err) {
  if (!(c->lr >= 0.0f) || !isfinite(c->lr))
    return ps_seterr(err, PS_EINVAL, "optimizer %s: lr %g must be finite and >= 0", c->name,
                     (double)c->lr);
  if (strcmp(c->name, "momentum") == 0 && !isfinite(c->momentum))
    return ps_seterr(err, PS_EINVAL, "optimizer momentum: momentum %g must be finite",
                     (double)c->momentum);
  if (strcmp(c->name, "adagrad") == 0) {
    if (!(c->initial_accumulator >= 0.0f) || !isfinite(c->initial_accumulator))
      return ps_seterr(err, PS_EINVAL,
                       "optimizer adagrad: initial_accumulator %g must be finite and >= 0",
                       (double)c->initial_accumulator);
    /* With both zero, a zero gradient gives 0/0. */
    if (!(c->eps >= 0.0f) || !isfinite(c->eps) ||
        (c->eps == 0.0f && c->initial_accumulator == 0.0f))
      return ps_seterr(err, PS_EINVAL,
                       "optimizer adagrad: eps %g must be finite and >= 0, and not 0 when "
                       "initial_accumulator is 0",
                       (double)c->eps);
  }
  if (strcmp(c->name, "adam") == 0) {
    if (!(c->beta1 >= 0.0f && c->beta1 < 1.0f) || !(c->beta2 >= 0.0f && c->beta2 < 1.0f))
      return ps_seterr(err, PS_EINVAL, "optimizer adam: beta1 %g and beta2 %g must be in [0, 1)",
                       (double)c->beta1, (double)c->beta2);
    /* v starts at 0, so eps is the only thing between m/0 and the step. */
    if (!(c->eps > 0.0f) || !isfinite(c->eps))
      return ps_seterr(err, PS_EINVAL, "optimizer adam: eps %g must be finite and > 0",
                       (double)c->eps);
  }
  return PS_OK;
}

ps_shard *ps_shard_create(const ps_job *job, int index, int num_shards, char *err) {
  if (!job) {
    ps_seterr(err, PS_EINVAL, "no job given");
    return NULL;
  }
  if (num_shards < 1 || index < 0 || index >= num_shards) {
    ps_seterr(err, PS_EINVAL, "shard index %d invalid for %d shards", index, num_shards);
    return NULL;
  }
  const ps_optimizer *opt = ps_optimizer_find(job->optim.name);
  if (!opt) {
    ps_seterr(err, PS_EINVAL, "unknown optimizer '%.16s' (known: sgd, momentum, adagrad, adam)",
              job->optim.name);
    return NULL;
  }
  if (opt->n_slots > SHARD_MAX_SLOTS) {
    ps_seterr(err, PS_EINVAL, "optimizer %s needs %d slots, the shard holds at most %d",
              opt->name, opt->n_slots, SHARD_MAX_SLOTS);
    return NULL;
  }
  if (check_optim_config(&job->optim, err) != PS_OK) return NULL;

  ps_shard *s = calloc(1, sizeof *s);
  if (!s) {
    ps_seterr(err, PS_ENOMEM, "out of memory creating shard %d", index);
    return NULL;
  }
  s->index = index;
  s->num_shards = num_shards;
  s->opt = opt;
  s->cfg = job->optim;
  s->staleness_aware = job->staleness_aware_lr && job->mode_kind != PS_MODE_SYNC;
  ps_shard_range(job->model.n_params, num_shards, index, &s->begin, &s->end);
  size_t n = s->end - s->begin;
  if (pthread_mutex_init(&s->mu, NULL) != 0) {
    free(s);
    ps_seterr(err, PS_ENOMEM, "cannot create the mutex of shard %d", index);
    return NULL;
  }
  pthread_mutex_init(&s->apply_mu, NULL);
  pthread_cond_init(&s->applied, NULL);
  if (s->end - s->begin >= SPLIT_MIN) helper_start(&s->helper); /* else work on one thread */
  if (n > SIZE_MAX / sizeof(float)) goto oom;
  s->current = snapshot_alloc(s->begin, n);
  if (!s->current) goto oom;
  ps_model_init_params(&job->model, job->seed, s->begin, s->end, s->current->values);
  for (int k = 0; k < opt->n_slots; k++) {
    s->slots[k] = ps_alloc(n * sizeof(float));
    if (!s->slots[k]) goto oom;
    /* ps_alloc zeroes; only a non-zero start needs a pass. */
    float init = opt->slot_init(&s->cfg, k);
    if (init != 0.0f)
      for (size_t i = 0; i < n; i++) s->slots[k][i] = init;
  }
  return s;

oom:
  ps_seterr(err, PS_ENOMEM, "out of memory for shard %d: %zu parameters and %d slots", index, n,
            opt->n_slots);
  ps_shard_destroy(s);
  return NULL;
}

void ps_shard_destroy(ps_shard *s) {
  if (!s) return;
  helper_stop(&s->helper);
  ps_snapshot_unref(s->current);
  for (int i = 0; i < SHARD_SPARES; i++) ps_snapshot_unref(s->retired[i]);
  for (int k = 0; k < SHARD_MAX_SLOTS; k++) ps_free(s->slots[k]);
  ps_free(s->sync_sum);
  free(s->sync_ids);
  pthread_mutex_destroy(&s->mu);
  pthread_mutex_destroy(&s->apply_mu);
  pthread_cond_destroy(&s->applied);
  free(s);
}

size_t ps_shard_begin(const ps_shard *s) { return s->begin; }
size_t ps_shard_end(const ps_shard *s) { return s->end; }
int ps_shard_index(const ps_shard *s) { return s->index; }

/* ---------------------------------------------------------------- push */

/* PS_ERANGE unless [offset, offset+count) lies inside the shard's range. */
static int check_range(const ps_shard *s, const char *what, size_t offset, size_t count,
                       char *err) {
  if (count > SIZE_MAX - offset)
    return ps_seterr(err, PS_ERANGE, "%s range at offset %zu with %zu values overflows", what,
                     offset, count);
  if (offset < s->begin || offset + count > s->end)
    return ps_seterr(err, PS_ERANGE, "%s range [%zu, %zu) outside shard range [%zu, %zu)", what,
                     offset, offset + count, s->begin, s->end);
  return PS_OK;
}

typedef struct {
  size_t bad_index; /* index within the push of the first non-finite value */
  float bad_value;
} finite_scan;

/* Stops at the first NaN or Inf. The common case (all finite) is an OR over
 * exponent bits in fixed-size blocks, which the compiler vectorizes; only a
 * block that fails is searched value by value. */
static int scan_finite_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  enum { BLOCK = 16 };
  const uint32_t EXP = 0x7f800000u; /* all exponent bits set: Inf or NaN */
  size_t i = 0;
  for (;;) {
    size_t len = n - i < BLOCK ? n - i : BLOCK;
    if (len == 0) return 0;
    uint32_t any = 0;
    if (len == BLOCK) {
      for (int j = 0; j < BLOCK; j++) {
        uint32_t u;
        memcpy(&u, &values[i + j], 4);
        any |= (u & EXP) == EXP;
      }
    } else {
      any = 1; /* short tail: let the exact search below decide */
    }
    if (any) {
      for (size_t j = i; j < i + len; j++) {
        if (!isfinite(values[j])) {
          finite_scan *fs = user;
          fs->bad_index = first + j;
          fs->bad_value = values[j];
          return 1;
        }
      }
    }
    i += len;
  }
}

typedef struct {
  ps_shard *s;
  const float *in; /* current values, whole range */
  float *out;      /* the next snapshot's values, whole range */
  size_t local;    /* offset of the push's first value in the range */
  uint64_t t;
  float lr;
} apply_ctx;

/* Applies one piece: `first` counts values from the start of the push, so
 * the piece updates values [local + first, + n). Each chunk is copied from
 * the current snapshot into the next one and updated there while it is
 * still in cache. */
static int apply_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  apply_ctx *c = user;
  ps_shard *s = c->s;
  for (size_t done = 0; done < n;) {
    size_t k = n - done < APPLY_CHUNK ? n - done : APPLY_CHUNK;
    size_t at = c->local + first + done;
    float *slots[SHARD_MAX_SLOTS];
    for (int j = 0; j < s->opt->n_slots; j++) slots[j] = s->slots[j] + at;
    if (c->out != c->in) memcpy(c->out + at, c->in + at, k * sizeof(float));
    s->opt->apply(&s->cfg, c->t, c->lr, c->out + at, slots, values + done, k);
    done += k;
  }
  return 0;
}

/* A buffer for the next snapshot: a retired one that no pull holds any
 * more, or a new one. Called with apply_mu held. */
static ps_snapshot *next_buffer(ps_shard *s) {
  for (int i = 0; i < SHARD_SPARES; i++) {
    ps_snapshot *r = s->retired[i];
    if (r && atomic_load_explicit(SNAP_REFS(r), memory_order_acquire) == 1) {
      s->retired[i] = NULL;
      return r;
    }
  }
  return snapshot_alloc(s->begin, s->end - s->begin);
}

/* Keeps an old snapshot for reuse (the shard's reference moves with it);
 * when all places are taken, the oldest is let go (freed by its last
 * puller). Called with apply_mu held. */
static void retire(ps_shard *s, ps_snapshot *old) {
  ps_snapshot *drop = s->retired[0];
  memmove(&s->retired[0], &s->retired[1], (SHARD_SPARES - 1) * sizeof(ps_snapshot *));
  s->retired[SHARD_SPARES - 1] = old;
  ps_snapshot_unref(drop);
}

typedef struct {
  float *sum;
  int first; /* the step's first gradient: store rather than add */
} sum_ctx;

static int sum_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  sum_ctx *c = user;
  float *restrict out = c->sum + first;
  if (c->first)
    memcpy(out, (const void *)values, n * sizeof(float));
  else
    for (size_t i = 0; i < n; i++) out[i] += values[i];
  return 0;
}

static int reject_push(ps_shard *s, int code) {
  pthread_mutex_lock(&s->mu);
  s->stats.rejected++;
  pthread_mutex_unlock(&s->mu);
  return code;
}

typedef struct {
  const ps_segview *grad;
  size_t first, count;
  finite_scan fs;
  int found;
} scan_job;

static int scan_range(void *arg) {
  scan_job *j = arg;
  if (j->count == 0) return 0;
  j->found = ps_segview_each_float_range(j->grad, j->first, j->count, scan_finite_piece, &j->fs);
  return j->found;
}

typedef struct {
  const ps_segview *grad;
  size_t first, count;
  apply_ctx c;
} apply_job;

static int apply_range(void *arg) {
  apply_job *j = arg;
  if (j->count == 0) return 0;
  return ps_segview_each_float_range(j->grad, j->first, j->count, apply_piece, &j->c);
}

/* Range, length and finiteness of a gradient: nothing changes on error. */
static int check_gradient(ps_shard *s, size_t offset, size_t count, const ps_segview *grad,
                          char *err) {
  int rc = check_range(s, "push", offset, count, err);
  if (rc) return rc;
  size_t total = grad ? grad->total : 0;
  if (total != count * sizeof(float))
    return ps_seterr(err, PS_EINVAL, "gradient has %zu bytes, expected %zu for %zu values", total,
                     count * sizeof(float), count);
  if (grad) {
    /* The walks below follow the segments, not total: segments holding
     * more bytes than total would be applied past the end of the range. */
    size_t sum = 0;
    for (int i = 0; i < grad->nsegs; i++) sum += grad->segs[i].len;
    if (grad->nsegs < 0 || sum != total)
      return ps_seterr(err, PS_EINVAL, "gradient view says %zu bytes but its %d segments hold %zu",
                       total, grad->nsegs, sum);
  }
  if (count > 0) {
    /* Two halves at once for a large push; the first bad value is the one
     * reported either way. */
    size_t half = count >= SPLIT_MIN ? count / 2 : count;
    scan_job a = {grad, 0, half, {0, 0.0f}, 0}, b = {grad, half, count - half, {0, 0.0f}, 0};
    int bad = split_run(&s->helper, scan_range, &a, &b);
    if (bad) {
      finite_scan *fs = a.found ? &a.fs : &b.fs;
      const char *what = isnan(fs->bad_value) ? "NaN" : fs->bad_value > 0 ? "+Inf" : "-Inf";
      return ps_seterr(err, PS_EINVAL, "gradient value %zu (global index %zu) is %s",
                       fs->bad_index, offset + fs->bad_index, what);
    }
  }
  return PS_OK;
}

/* Applies a checked gradient for [offset, offset+count) with learning rate
 * lr and publishes the result as version before+1, where `before` is the
 * version it applied to (written to *before_out). Called with apply_mu held.
 * PS_ENOMEM (nothing changed) when no buffer for the next snapshot can be had. */
static int apply_update(ps_shard *s, size_t offset, size_t count, const ps_segview *grad,
                        float lr, uint64_t before, char *err) {
  ps_snapshot *cur = s->current; /* only updates replace it, and we hold apply_mu */
  size_t local = offset - s->begin, n = s->end - s->begin;
  pthread_mutex_lock(&s->mu);
  /* Nobody else holds the current snapshot, and pulls cannot take it
   * while in_place is set: update it where it is. */
  int in_place = atomic_load_explicit(SNAP_REFS(cur), memory_order_acquire) == 1;
  s->in_place = in_place;
  pthread_mutex_unlock(&s->mu);

  ps_snapshot *next = cur;
  if (!in_place) {
    next = next_buffer(s);
    if (!next)
      return ps_seterr(err, PS_ENOMEM, "out of memory for the next snapshot of %zu values", n);
    /* Values outside the update carry over unchanged. */
    memcpy(next->values, cur->values, local * sizeof(float));
    memcpy(next->values + local + count, cur->values + local + count,
           (n - local - count) * sizeof(float));
  }
  if (count > 0) {
    apply_ctx c = {s, cur->values, next->values, local, before + 1, lr};
    size_t half = count >= SPLIT_MIN ? count / 2 : count;
    apply_job a = {grad, 0, half, c}, b = {grad, half, count - half, c};
    split_run(&s->helper, apply_range, &a, &b);
  }
  next->version = before + 1;
  double now = ps_now_s();
  pthread_mutex_lock(&s->mu);
  s->current = next; /* published: pulls from now on see before + 1 */
  s->version = before + 1;
  if (in_place) {
    s->in_place = 0;
    pthread_cond_broadcast(&s->applied);
  }
  if (s->first_update_s == 0) s->first_update_s = now;
  s->last_update_s = now;
  pthread_mutex_unlock(&s->mu);
  if (!in_place) retire(s, cur);
  return PS_OK;
}

static uint64_t current_version(ps_shard *s) {
  pthread_mutex_lock(&s->mu);
  uint64_t v = s->version;
  pthread_mutex_unlock(&s->mu);
  return v;
}

int ps_shard_push(ps_shard *s, uint64_t base_version, size_t offset, size_t count,
                  const ps_segview *grad, uint64_t *new_version, uint64_t *staleness, char *err) {
  int rc = check_gradient(s, offset, count, grad, err);
  if (rc) return reject_push(s, rc);

  pthread_mutex_lock(&s->apply_mu);
  uint64_t before = current_version(s); /* only updates change it, and we hold apply_mu */
  uint64_t stale = base_version < before ? before - base_version : 0;
  /* Staleness-aware learning rate: a gradient computed k versions ago
   * moves the parameters k times less. */
  float lr = s->cfg.lr;
  if (s->staleness_aware && stale > 1) lr = (float)((double)lr / (double)stale);
  rc = apply_update(s, offset, count, grad, lr, before, err);
  if (rc) {
    pthread_mutex_unlock(&s->apply_mu);
    return reject_push(s, rc);
  }
  pthread_mutex_lock(&s->mu);
  ps_shard_stats *st = &s->stats;
  st->pushes++;
  st->staleness_mean += ((double)stale - st->staleness_mean) / (double)st->pushes;
  if (stale > st->staleness_max) st->staleness_max = stale;
  st->staleness_hist[stale < PS_STALENESS_BUCKETS - 1 ? stale : PS_STALENESS_BUCKETS - 1]++;
  pthread_mutex_unlock(&s->mu);
  pthread_mutex_unlock(&s->apply_mu);

  if (new_version) *new_version = before + 1;
  if (staleness) *staleness = stale;
  return PS_OK;
}

/* ---------------------------------------------------------------- sync steps */

int ps_shard_sync_add(ps_shard *s, uint64_t worker_id, uint64_t base_version, size_t offset,
                      size_t count, const ps_segview *grad, int *dropped, int *have,
                      char *err) {
  *dropped = 0;
  if (offset != s->begin || count != s->end - s->begin)
    return reject_push(s, ps_seterr(err, PS_ERANGE,
                                    "in sync mode a push covers the whole shard range [%zu, %zu), "
                                    "not [%zu, %zu)",
                                    s->begin, s->end, offset, offset + count));
  int rc = check_gradient(s, offset, count, grad, err);
  if (rc) return reject_push(s, rc);
  pthread_mutex_lock(&s->apply_mu);
  uint64_t version = current_version(s);
  int dup = 0;
  for (int i = 0; i < s->sync_n; i++) dup |= s->sync_ids[i] == worker_id;
  if (base_version != version || dup) {
    /* A late gradient of a step already applied (a backup worker's), or a
     * second one from the same worker: dropped, as SyncReplicasOptimizer
     * does, and counted. */
    *dropped = 1;
    *have = s->sync_n;
    pthread_mutex_unlock(&s->apply_mu);
    pthread_mutex_lock(&s->mu);
    s->stats.dropped++;
    pthread_mutex_unlock(&s->mu);
    return PS_OK;
  }
  if (s->sync_n == s->sync_cap) {
    int cap = s->sync_cap ? 2 * s->sync_cap : 8;
    uint64_t *ids = realloc(s->sync_ids, (size_t)cap * sizeof *ids);
    if (!ids) {
      pthread_mutex_unlock(&s->apply_mu);
      return reject_push(s, ps_seterr(err, PS_ENOMEM, "out of memory"));
    }
    s->sync_ids = ids;
    s->sync_cap = cap;
  }
  size_t n = s->end - s->begin;
  if (!s->sync_sum && n > 0) {
    s->sync_sum = ps_alloc(n * sizeof(float));
    if (!s->sync_sum) {
      pthread_mutex_unlock(&s->apply_mu);
      return reject_push(s, ps_seterr(err, PS_ENOMEM, "out of memory for the step's sum"));
    }
  }
  sum_ctx c = {s->sync_sum, s->sync_n == 0};
  if (n > 0) ps_segview_each_float(grad, sum_piece, &c);
  s->sync_ids[s->sync_n++] = worker_id;
  *have = s->sync_n;
  pthread_mutex_unlock(&s->apply_mu);
  pthread_mutex_lock(&s->mu);
  s->stats.pushes++;
  s->stats.staleness_hist[0]++;
  pthread_mutex_unlock(&s->mu);
  return PS_OK;
}

int ps_shard_sync_try_apply(ps_shard *s, int quorum, uint64_t *new_version, char *err) {
  if (quorum < 1) quorum = 1;
  pthread_mutex_lock(&s->apply_mu);
  if (s->sync_n < quorum) {
    pthread_mutex_unlock(&s->apply_mu);
    return 0;
  }
  size_t n = s->end - s->begin;
  /* The mean of the step's gradients, applied once. */
  float inv = 1.0f / (float)s->sync_n;
  for (size_t i = 0; i < n; i++) s->sync_sum[i] *= inv;
  ps_seg seg = {(const uint8_t *)s->sync_sum, n * sizeof(float)};
  ps_segview v = {&seg, n ? 1 : 0, n * sizeof(float)};
  uint64_t before = current_version(s);
  int rc = apply_update(s, s->begin, n, &v, s->cfg.lr, before, err);
  if (rc == 0) {
    s->sync_n = 0;
    if (new_version) *new_version = before + 1;
  } else {
    /* Undo the scaling so that the step can still be applied later. */
    for (size_t i = 0; i < n; i++) s->sync_sum[i] *= (float)s->sync_n;
  }
  pthread_mutex_unlock(&s->apply_mu);
  return rc == 0 ? 1 : rc;
}

/* ---------------------------------------------------------------- pull */

ps_snapshot *ps_shard_pull(ps_shard *s, size_t offset, size_t count, char *err) {
  if (check_range(s, "pull", offset, count, err) != PS_OK) return NULL;
  pthread_mutex_lock(&s->mu);
  while (s->in_place) pthread_cond_wait(&s->applied, &s->mu);
  ps_snapshot *cur = snapshot_ref(s->current);
  s->stats.pulls++;
  pthread_mutex_unlock(&s->mu);
  if (offset == s->begin && count == s->end - s->begin) return cur;
  /* A part of the range: a private copy, made outside the lock (the
   * current snapshot cannot change under its reference). */
  ps_snapshot *part = snapshot_alloc(offset, count);
  if (!part) {
    ps_snapshot_unref(cur);
    ps_seterr(err, PS_ENOMEM, "out of memory for a snapshot of %zu values", count);
    return NULL;
  }
  part->version = cur->version;
  memcpy(part->values, cur->values + (offset - s->begin), count * sizeof(float));
  ps_snapshot_unref(cur);
  return part;
}

/* ---------------------------------------------------------------- reading */

void ps_shard_stats_get(ps_shard *s, ps_shard_stats *out) {
  pthread_mutex_lock(&s->mu);
  *out = s->stats;
  out->version = s->version;
  out->step_time_ms =
      s->version > 1 ? 1e3 * (s->last_update_s - s->first_update_s) / (double)(s->version - 1) : 0;
  out->sync_pending = s->sync_n;
  pthread_mutex_unlock(&s->mu);
}

void ps_shard_copy_params(ps_shard *s, float *out) {
  size_t n = s->end - s->begin;
  if (n == 0) return;
  pthread_mutex_lock(&s->mu);
  while (s->in_place) pthread_cond_wait(&s->applied, &s->mu);
  ps_snapshot *cur = snapshot_ref(s->current);
  pthread_mutex_unlock(&s->mu);
  memcpy(out, cur->values, n * sizeof(float));
  ps_snapshot_unref(cur);
}

/* ---------------------------------------------------------------- checkpoints */

int ps_shard_n_slots(const ps_shard *s) { return s->opt->n_slots; }
const char *ps_shard_optimizer(const ps_shard *s) { return s->opt->name; }

void ps_shard_export_state(ps_shard *s, float *params, float **slots, uint64_t *version) {
  size_t n = s->end - s->begin;
  /* apply_mu: no update between the copies, so they belong together. */
  pthread_mutex_lock(&s->apply_mu);
  if (n) memcpy(params, s->current->values, n * sizeof(float));
  for (int k = 0; k < s->opt->n_slots; k++)
    if (n) memcpy(slots[k], s->slots[k], n * sizeof(float));
  *version = current_version(s);
  pthread_mutex_unlock(&s->apply_mu);
}

void ps_shard_restore_state(ps_shard *s, const float *params, float *const *slots,
                            uint64_t version) {
  size_t n = s->end - s->begin;
  pthread_mutex_lock(&s->apply_mu);
  pthread_mutex_lock(&s->mu);
  while (s->in_place) pthread_cond_wait(&s->applied, &s->mu);
  if (n) memcpy(s->current->values, params, n * sizeof(float));
  s->current->version = version;
  s->version = version;
  s->sync_n = 0;
  pthread_mutex_unlock(&s->mu);
  for (int k = 0; k < s->opt->n_slots; k++)
    if (n) memcpy(s->slots[k], slots[k], n * sizeof(float));
  pthread_mutex_unlock(&s->apply_mu);
}

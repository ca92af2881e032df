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
 * request and the shard's fixed range, so they run before any lock; the
 * check that the results stay finite needs the state, so it runs with
 * apply_mu held, as part of the update.
 *
 * Buffers: retired snapshots stay with the shard; once no pull holds one
 * any more (its count is back to the shard's single reference) the next
 * push reuses it, so the steady state allocates nothing.
 *
 * Copy on write: when no pull holds the current snapshot at all, a push
 * updates it in place (a third less memory traffic than writing another
 * buffer); pulls that arrive meanwhile wait for that one update.
 *
 * Finite results: a push of finite values can still drive a parameter or a
 * slot to Inf or NaN (two pushes of FLT_MAX with momentum do), and an
 * update in place cannot be taken back. So an update is known to stay
 * finite before it starts. The shard keeps upper bounds on the magnitude
 * of its parameters and of each slot (ps_optim_bounds); the scan of the
 * gradient for NaN and Inf also finds its largest magnitude, and the
 * optimizer's bound function carries the bounds through the update. When
 * they stay within FLT_MAX, as they do in training by a wide margin, the
 * update goes ahead with no extra pass. Only when they do not (values near
 * the float range, hostile or diverging) does a trial pass compute the
 * results aside, chunk by chunk in cache, and look at them: a push that
 * would make any value non-finite is refused before anything changes, and
 * one that would not is applied, with the bounds reset to the exact
 * maxima. The sync step's sum of gradients is bounded and checked the
 * same way.
 *
 * 16-bit wire (a job's "wire": bf16 or fp16): pushed gradients arrive as
 * 16-bit values and are decoded a chunk at a time, in cache, wherever the
 * float32 ones would be read in place (the checks, the trial pass, the
 * update, the sync sum), so no float32 copy of a gradient is made. A pull
 * sends the snapshot's values encoded in 16 bits, made once per snapshot
 * and kept with it (ps_shard_snapshot_encoded). Parameters and slots stay
 * float32. */
#include "ps/state/shard.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/model_spec.h"
#include "common/optim.h"

/* Enough for every optimizer of optim.c (adam has 2). */
#define SHARD_MAX_SLOTS PS_OPTIM_MAX_SLOTS
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
  ps_wire wire; /* how pushed gradients are encoded (the job's) */
  float *slots[SHARD_MAX_SLOTS]; /* opt->n_slots arrays of (n) */
  /* The model's moving statistics within the range (batchnorm's mean and
   * variance): averaged in, not trained (ps_optim_apply_ranges). */
  ps_moving_range moving[PS_MAX_MOVING_RANGES];
  int n_moving;

  pthread_mutex_t apply_mu;         /* serializes updates */
  pthread_mutex_t encode_mu;        /* serializes encoding snapshots in 16 bits */
  /* Guarded by apply_mu: bounds on |parameters| and |slot k| over the
   * whole range, and where a trial pass computes results aside: one area
   * per half of a split, each (1 + n_slots) chunks of (APPLY_CHUNK). */
  ps_optim_bounds bounds;
  float *trial[2];
  helper_thread helper;             /* for split_run; started for large shards */
  int staleness_aware;              /* lr / max(1, staleness) */
  /* sync mode: the sum of the current step's gradients and who sent them */
  float *sync_sum;
  double sync_max; /* bound on |sync_sum| (of the sync_n gradients in) */
  uint64_t *sync_ids;
  int sync_n, sync_cap;
  ps_shard_sync_rows sync_rows; /* the step's embedding rows (hooks; add NULL: none) */
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
  snap->encoded = NULL;
  snap->encoded_valid = 0;
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
  if (atomic_fetch_sub_explicit(SNAP_REFS(snap), 1, memory_order_acq_rel) == 1) {
    free(snap->encoded);
    free(snap);
  }
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

/* ---------------------------------------------------------------- bounds */

/* Largest magnitudes are measured as float bits without the sign
 * (ps_f32_max_bits, common/half.c): NaN and Inf at or above
 * PS_F32_NONFINITE_BITS, and so above every finite value. */

/* The magnitude such bits stand for: +Inf for Inf and NaN. */
static double bits_magnitude(uint32_t bits) {
  if (bits >= PS_F32_NONFINITE_BITS) return INFINITY;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* The index in v[0..n) of the first NaN or Inf, or n. */
static size_t first_nonfinite(const ps_ufloat *v, size_t n) {
  size_t i = 0;
  while (i < n && isfinite(v[i])) i++;
  return i;
}

/* Sets the bounds from the values themselves (creation, restore). Called
 * with apply_mu held, or before the shard is shared. */
static void measure_bounds(ps_shard *s) {
  size_t n = s->end - s->begin;
  s->bounds = (ps_optim_bounds){.param = bits_magnitude(ps_f32_max_bits(s->current->values, n))};
  for (int k = 0; k < s->opt->n_slots; k++) {
    s->bounds.slot[k] = bits_magnitude(ps_f32_max_bits(s->slots[k], n));
    int nonneg = 1;
    for (size_t i = 0; i < n; i++) nonneg &= !(s->slots[k][i] < 0.0f);
    if (nonneg) s->bounds.slot_nonneg |= 1u << k;
  }
}

/* Whether bounds promise finite values: all within FLT_MAX (not NaN). */
static int bounds_finite(const ps_shard *s, const ps_optim_bounds *b) {
  int ok = b->param <= FLT_MAX;
  for (int k = 0; k < s->opt->n_slots; k++) ok &= b->slot[k] <= FLT_MAX;
  return ok;
}

/* The bounds after an update whose touched values are bounded by `upd`:
 * those, for an update of the whole range; else the larger of them and
 * the bounds of the values left as they were. */
static ps_optim_bounds merge_bounds(const ps_shard *s, const ps_optim_bounds *upd, int whole) {
  ps_optim_bounds b = *upd;
  b.slot_nonneg = s->bounds.slot_nonneg;
  if (!whole) {
    if (s->bounds.param > b.param) b.param = s->bounds.param;
    for (int k = 0; k < s->opt->n_slots; k++)
      if (s->bounds.slot[k] > b.slot[k]) b.slot[k] = s->bounds.slot[k];
  }
  return b;
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
  s->wire = job->wire;
  s->staleness_aware = job->staleness_aware_lr && job->mode_kind != PS_MODE_SYNC;
  ps_shard_range(job->model.n_params, num_shards, index, &s->begin, &s->end);
  size_t n = s->end - s->begin;
  ps_moving_range all[PS_MAX_MOVING_RANGES];
  for (int r = 0, nr = ps_model_moving_ranges(&job->model, all); r < nr; r++)
    if (all[r].off < s->end && all[r].off + all[r].count > s->begin)
      s->moving[s->n_moving++] = all[r];
  if (pthread_mutex_init(&s->mu, NULL) != 0) {
    free(s);
    ps_seterr(err, PS_ENOMEM, "cannot create the mutex of shard %d", index);
    return NULL;
  }
  pthread_mutex_init(&s->apply_mu, NULL);
  pthread_mutex_init(&s->encode_mu, NULL);
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
  for (int h = 0; h < 2; h++) {
    s->trial[h] = ps_alloc((size_t)(1 + opt->n_slots) * APPLY_CHUNK * sizeof(float));
    if (!s->trial[h]) goto oom;
  }
  measure_bounds(s);
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
  for (int h = 0; h < 2; h++) ps_free(s->trial[h]);
  ps_free(s->sync_sum);
  free(s->sync_ids);
  pthread_mutex_destroy(&s->mu);
  pthread_mutex_destroy(&s->apply_mu);
  pthread_mutex_destroy(&s->encode_mu);
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

/* "NaN", "+Inf" or "-Inf", for messages. */
static const char *nonfinite_name(float v) { return isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf"; }

/* 16-bit values handed to a float function: decoded a chunk at a time
 * into a buffer that stays in cache, so that a 16-bit push is read in
 * place like a float32 one, with no copy of the whole gradient. */
typedef struct {
  ps_wire enc;
  ps_float_fn fn;
  void *user;
  float buf[APPLY_CHUNK];
} decode_walk;

static int decode_piece(const ps_uhalf *values, size_t n, size_t first, void *user) {
  decode_walk *d = user;
  for (size_t done = 0; done < n;) {
    size_t k = n - done < APPLY_CHUNK ? n - done : APPLY_CHUNK;
    ps_half_decode(d->enc, values + done, d->buf, k);
    int rc = d->fn(d->buf, k, first + done, d->user);
    if (rc) return rc;
    done += k;
  }
  return 0;
}

/* fn over the values [first, first+count) of a gradient encoded as enc,
 * as floats. (The chunk buffer, 16 KiB, is on the stack: the server's
 * threads and the helper have the default 8 MiB.) */
static int walk_values(const ps_segview *grad, ps_wire enc, size_t first, size_t count,
                       ps_float_fn fn, void *user) {
  if (enc == PS_WIRE_FP32) return ps_segview_each_float_range(grad, first, count, fn, user);
  decode_walk d = {.enc = enc, .fn = fn, .user = user};
  return ps_segview_each_half_range(grad, first, count, decode_piece, &d);
}

/* One half of a walk over a gradient: fn over its values [first,
 * first+count). */
typedef struct {
  const ps_segview *grad;
  ps_wire enc;
  size_t first, count;
  ps_float_fn fn;
  void *user;
} half_walk;

static int walk_half(void *arg) {
  half_walk *w = arg;
  if (w->count == 0) return 0;
  return walk_values(w->grad, w->enc, w->first, w->count, w->fn, w->user);
}

/* fn over the count values of grad (encoded as enc), as floats: for a
 * large push in two halves at once (user_a with the first, user_b with
 * the second), else all with user_a. Returns the first non-zero result,
 * the first half's first. */
static int walk_gradient(ps_shard *s, const ps_segview *grad, ps_wire enc, size_t count,
                         ps_float_fn fn, void *user_a, void *user_b) {
  size_t half = count >= SPLIT_MIN ? count / 2 : count;
  half_walk a = {grad, enc, 0, half, fn, user_a}, b = {grad, enc, half, count - half, fn, user_b};
  return split_run(&s->helper, walk_half, &a, &b);
}

typedef struct {
  int found;
  size_t bad_index; /* index within the push of the first non-finite value */
  float bad_value;
  uint32_t max_bits; /* the largest |value| seen, as bits (ps_f32_max_bits) */
} finite_scan;

/* Stops at the first NaN or Inf; notes the largest magnitude. */
static int scan_finite_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  finite_scan *fs = user;
  uint32_t m = ps_f32_max_bits(values, n);
  if (m >= PS_F32_NONFINITE_BITS) {
    size_t j = first_nonfinite(values, n);
    fs->found = 1;
    fs->bad_index = first + j;
    fs->bad_value = values[j];
    return 1;
  }
  if (m > fs->max_bits) fs->max_bits = m;
  return 0;
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
    ps_optim_apply_ranges(s->opt, &s->cfg, c->t, c->lr, c->out + at, slots, values + done, k,
                          s->begin + at, s->moving, s->n_moving);
    done += k;
  }
  return 0;
}

/* A trial of an update over one half of a push: apply_piece's results
 * computed aside, a chunk at a time in cache, and looked at; nothing of
 * the shard is written. */
typedef struct {
  apply_ctx c;                            /* out unused */
  float *area;                            /* (1 + n_slots) chunks of (APPLY_CHUNK) */
  uint32_t max_bits[1 + SHARD_MAX_SLOTS]; /* largest |result|: parameters, slot 0, ... */
  int found;                              /* a result would not be finite: */
  size_t bad_index;                       /* where, from the start of the push */
  int bad_slot;                           /* -1: the parameter; k: slot k */
  float bad_value, bad_grad;
} trial_ctx;

static int trial_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  trial_ctx *t = user;
  ps_shard *s = t->c.s;
  int ns = s->opt->n_slots;
  for (size_t done = 0; done < n;) {
    size_t k = n - done < APPLY_CHUNK ? n - done : APPLY_CHUNK;
    size_t at = t->c.local + first + done;
    float *res[1 + SHARD_MAX_SLOTS] = {NULL};
    for (int q = 0; q <= ns; q++) {
      res[q] = t->area + (size_t)q * APPLY_CHUNK;
      memcpy(res[q], q == 0 ? t->c.in + at : s->slots[q - 1] + at, k * sizeof(float));
    }
    ps_optim_apply_ranges(s->opt, &s->cfg, t->c.t, t->c.lr, res[0], res + 1, values + done, k,
                          s->begin + at, s->moving, s->n_moving);
    size_t bad = k;
    for (int q = 0; q <= ns; q++) {
      uint32_t m = ps_f32_max_bits(res[q], k);
      if (m > t->max_bits[q]) t->max_bits[q] = m;
      size_t i = m >= PS_F32_NONFINITE_BITS ? first_nonfinite(res[q], k) : k;
      if (i < bad) {
        bad = i;
        t->bad_slot = q - 1;
        t->bad_value = res[q][i];
      }
    }
    if (bad < k) {
      t->found = 1;
      t->bad_index = first + done + bad;
      t->bad_grad = values[done + bad];
      return 1;
    }
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
  /* sum_trial_piece: where the sums go, the largest, the first not finite */
  float *area;
  uint32_t max_bits;
  size_t bad_index;
  float bad_value;
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

/* What sum_piece would add, computed aside a chunk at a time and looked
 * at; the sum is not written. */
static int sum_trial_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  sum_ctx *c = user;
  for (size_t done = 0; done < n;) {
    size_t k = n - done < APPLY_CHUNK ? n - done : APPLY_CHUNK;
    const float *in = c->sum + first + done;
    for (size_t i = 0; i < k; i++) c->area[i] = in[i] + values[done + i];
    uint32_t m = ps_f32_max_bits(c->area, k);
    if (m >= PS_F32_NONFINITE_BITS) {
      size_t i = first_nonfinite(c->area, k);
      c->bad_index = first + done + i;
      c->bad_value = c->area[i];
      return 1;
    }
    if (m > c->max_bits) c->max_bits = m;
    done += k;
  }
  return 0;
}

typedef struct {
  size_t bad_index; /* from the start of the push */
  float bad_value;
} neg_scan;

/* Stops at the first value below zero. */
static int scan_neg_piece(const ps_ufloat *values, size_t n, size_t first, void *user) {
  neg_scan *ns = user;
  for (size_t i = 0; i < n; i++)
    if (values[i] < 0.0f) {
      ns->bad_index = first + i;
      ns->bad_value = values[i];
      return 1;
    }
  return 0;
}

/* The values a push carries for moving statistics that cannot be negative
 * (batchnorm's variances) are not: a negative one would make the model's
 * evaluation NaN. */
static int check_nonneg(ps_shard *s, size_t offset, size_t count, const ps_segview *grad,
                        char *err) {
  for (int r = 0; r < s->n_moving; r++) {
    const ps_moving_range *m = &s->moving[r];
    if (!m->nonneg) continue;
    size_t lo = m->off > offset ? m->off : offset;
    size_t hi = m->off + m->count < offset + count ? m->off + m->count : offset + count;
    if (lo >= hi) continue;
    neg_scan ns = {0};
    if (walk_values(grad, s->wire, lo - offset, hi - lo, scan_neg_piece, &ns))
      return ps_seterr(err, PS_EINVAL,
                       "gradient value %zu (global index %zu) is %g, in a batch variance "
                       "(batchnorm's moving variance [%zu, %zu)), which cannot be negative",
                       ns.bad_index, offset + ns.bad_index, (double)ns.bad_value, m->off,
                       m->off + m->count);
  }
  return PS_OK;
}

static int reject_push(ps_shard *s, int code) {
  pthread_mutex_lock(&s->mu);
  s->stats.rejected++;
  pthread_mutex_unlock(&s->mu);
  return code;
}

/* Count, range, length and finiteness of a gradient, and the largest
 * magnitude in it (*gmax): nothing changes on error. */
static int check_gradient(ps_shard *s, size_t offset, size_t count, const ps_segview *grad,
                          double *gmax, char *err) {
  *gmax = 0.0;
  /* A shard with an empty range (more shards than 16-value blocks) gets
   * pushes of its whole range, 0 values; anywhere else 0 values mean
   * nothing and must not move the version. */
  if (count == 0 && s->end > s->begin)
    return ps_seterr(err, PS_EINVAL, "push of 0 values at offset %zu: nothing to apply", offset);
  int rc = check_range(s, "push", offset, count, err);
  if (rc) return rc;
  size_t total = grad ? grad->total : 0;
  size_t vb = ps_wire_value_bytes(s->wire);
  if (total != count * vb)
    return ps_seterr(err, PS_EINVAL, "gradient has %zu bytes, expected %zu for %zu %s%svalues",
                     total, count * vb, count, s->wire == PS_WIRE_FP32 ? "" : ps_wire_name(s->wire),
                     s->wire == PS_WIRE_FP32 ? "" : " ");
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
    finite_scan a = {0}, b = {0};
    if (walk_gradient(s, grad, s->wire, count, scan_finite_piece, &a, &b)) {
      finite_scan *fs = a.found ? &a : &b;
      return ps_seterr(err, PS_EINVAL, "gradient value %zu (global index %zu) is %s", fs->bad_index,
                       offset + fs->bad_index, nonfinite_name(fs->bad_value));
    }
    *gmax = bits_magnitude(a.max_bits > b.max_bits ? a.max_bits : b.max_bits);
    if ((rc = check_nonneg(s, offset, count, grad, err))) return rc;
  }
  return PS_OK;
}

/* Whether updating [offset, offset+count) by grad (encoded as enc,
 * |values| <= gmax) with lr at step t keeps every parameter and slot
 * finite: the bounds say so, or else a trial pass computes the results
 * aside and finds them finite.
 * Writes the bounds for after the update into *after. PS_EINVAL, naming a
 * value that would not be finite, otherwise. Changes nothing; called with
 * apply_mu held. */
static int check_update(ps_shard *s, size_t offset, size_t count, const ps_segview *grad,
                        ps_wire enc, double gmax, float lr, uint64_t t, ps_optim_bounds *after,
                        char *err) {
  int whole = count == s->end - s->begin;
  ps_optim_bounds b = s->bounds;
  s->opt->bound(&s->cfg, t, lr, gmax, &b);
  if (s->n_moving) ps_moving_bound(gmax, &s->bounds, &b);
  if (bounds_finite(s, &b)) {
    *after = merge_bounds(s, &b, whole);
    return PS_OK;
  }
  trial_ctx ta = {.c = {s, s->current->values, NULL, offset - s->begin, t, lr},
                  .area = s->trial[0]};
  trial_ctx tb = ta;
  tb.area = s->trial[1];
  if (walk_gradient(s, grad, enc, count, trial_piece, &ta, &tb)) {
    const trial_ctx *f = ta.found ? &ta : &tb;
    char what[48] = "parameter";
    if (f->bad_slot >= 0)
      snprintf(what, sizeof what, "optimizer slot %d of parameter", f->bad_slot);
    return ps_seterr(err, PS_EINVAL,
                     "update refused: with optimizer %s it would make %s %zu (global index) %s "
                     "(gradient value %g there); nothing changed",
                     s->opt->name, what, offset + f->bad_index, nonfinite_name(f->bad_value),
                     (double)f->bad_grad);
  }
  ps_optim_bounds exact = {
      .param = bits_magnitude(ta.max_bits[0] > tb.max_bits[0] ? ta.max_bits[0] : tb.max_bits[0])};
  for (int k = 0; k < s->opt->n_slots; k++)
    exact.slot[k] = bits_magnitude(ta.max_bits[k + 1] > tb.max_bits[k + 1] ? ta.max_bits[k + 1]
                                                                           : tb.max_bits[k + 1]);
  *after = merge_bounds(s, &exact, whole);
  return PS_OK;
}

/* Applies a checked gradient (encoded as enc, |values| <= gmax) for
 * [offset, offset+count) with learning rate lr and publishes the result as
 * version before+1, where `before` is the version it applies to. Called with apply_mu held.
 * Nothing changes when it fails: PS_EINVAL when a parameter or slot would
 * not be finite (check_update), PS_ENOMEM when no buffer for the next
 * snapshot can be had. */
static int apply_update(ps_shard *s, size_t offset, size_t count, const ps_segview *grad,
                        ps_wire enc, double gmax, float lr, uint64_t before, char *err) {
  ps_optim_bounds after;
  int rc = check_update(s, offset, count, grad, enc, gmax, lr, before + 1, &after, err);
  if (rc) return rc;
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
    apply_ctx a = {s, cur->values, next->values, local, before + 1, lr}, b = a;
    walk_gradient(s, grad, enc, count, apply_piece, &a, &b);
  }
  s->bounds = after;
  next->version = before + 1;
  /* New values: an encoding kept with the buffer is stale. No pull holds
   * `next` (a reused buffer, or the current one updated in place). */
  next->encoded_valid = 0;
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
  return ps_shard_push_ex(s, base_version, offset, count, grad, NULL, new_version, staleness, err);
}

int ps_shard_push_ex(ps_shard *s, uint64_t base_version, size_t offset, size_t count,
                     const ps_segview *grad, const ps_shard_extra *extra, uint64_t *new_version,
                     uint64_t *staleness, char *err) {
  double gmax = 0.0;
  int rc;
  if (extra && count == 0)
    rc = check_range(s, "push", offset, 0, err);
  else
    rc = check_gradient(s, offset, count, grad, &gmax, err);
  if (rc) return reject_push(s, rc);

  pthread_mutex_lock(&s->apply_mu);
  uint64_t before = current_version(s); /* only updates change it, and we hold apply_mu */
  uint64_t stale = base_version < before ? before - base_version : 0;
  /* Staleness-aware learning rate: a gradient computed k versions ago
   * moves the parameters k times less. */
  float lr = s->cfg.lr, lr_scale = 1.0f;
  if (s->staleness_aware && stale > 1) {
    lr = (float)((double)lr / (double)stale);
    lr_scale = (float)(1.0 / (double)stale);
  }
  if (extra && (rc = extra->prepare(extra->user, lr_scale, err)) != 0) {
    pthread_mutex_unlock(&s->apply_mu);
    return reject_push(s, rc);
  }
  rc = apply_update(s, offset, count, grad, s->wire, gmax, lr, before, err);
  if (rc) {
    if (extra) extra->abort(extra->user);
    pthread_mutex_unlock(&s->apply_mu);
    return reject_push(s, rc);
  }
  if (extra) extra->commit(extra->user);
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

/* Whether adding grad (|values| <= gmax) to the step's sum keeps it
 * finite: its bound says so, or a trial pass finds it. Writes the bound on
 * the sum after the addition into *after; PS_EINVAL, naming a value,
 * otherwise. Changes nothing; called with apply_mu held while at least one
 * gradient is in. */
static int check_sum(ps_shard *s, const ps_segview *grad, double gmax, double *after, char *err) {
  /* One float addition: at most a factor 1 + 2^-24 above the exact sum. */
  double bound = (s->sync_max + gmax) * (1.0 + 0x1p-20);
  if (bound <= FLT_MAX) {
    *after = bound;
    return PS_OK;
  }
  sum_ctx c = {.sum = s->sync_sum, .area = s->trial[0]};
  if (walk_values(grad, s->wire, 0, s->end - s->begin, sum_trial_piece, &c))
    return ps_seterr(err, PS_EINVAL,
                     "gradient refused: adding it to the step's sum (of %d gradients) would make "
                     "value %zu (global index %zu) %s; nothing changed",
                     s->sync_n, c.bad_index, s->begin + c.bad_index, nonfinite_name(c.bad_value));
  *after = bits_magnitude(c.max_bits);
  return PS_OK;
}

void ps_shard_set_sync_rows(ps_shard *s, const ps_shard_sync_rows *h) {
  pthread_mutex_lock(&s->apply_mu);
  if (h)
    s->sync_rows = *h;
  else
    memset(&s->sync_rows, 0, sizeof s->sync_rows);
  pthread_mutex_unlock(&s->apply_mu);
}

/* The step is over (applied or dropped): its rows' sums go with it.
 * apply_mu held. */
static void sync_rows_clear(ps_shard *s) {
  if (s->sync_rows.clear) s->sync_rows.clear(s->sync_rows.user);
}

int ps_shard_sync_add(ps_shard *s, uint64_t worker_id, uint64_t base_version, size_t offset,
                      size_t count, const ps_segview *grad, int *dropped, int *have,
                      char *err) {
  return ps_shard_sync_add_rows(s, worker_id, base_version, offset, count, grad, NULL, dropped,
                                have, err);
}

int ps_shard_sync_add_rows(ps_shard *s, uint64_t worker_id, uint64_t base_version, size_t offset,
                           size_t count, const ps_segview *grad, const void *rows_arg,
                           int *dropped, int *have, char *err) {
  *dropped = 0;
  if (offset != s->begin || count != s->end - s->begin)
    return reject_push(s, ps_seterr(err, PS_ERANGE,
                                    "in sync mode a push covers the whole shard range [%zu, %zu), "
                                    "not [%zu, %zu)",
                                    s->begin, s->end, offset, offset + count));
  double gmax;
  int rc = check_gradient(s, offset, count, grad, &gmax, err);
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
  double sum_max = gmax;
  if (s->sync_n > 0 && n > 0 && (rc = check_sum(s, grad, gmax, &sum_max, err)) != PS_OK) {
    pthread_mutex_unlock(&s->apply_mu);
    return reject_push(s, rc);
  }
  /* The rows last: once they are in, adding the dense values cannot fail. */
  if (rows_arg && s->sync_rows.add &&
      (rc = s->sync_rows.add(s->sync_rows.user, rows_arg, err)) != PS_OK) {
    pthread_mutex_unlock(&s->apply_mu);
    return reject_push(s, rc);
  }
  sum_ctx c = {.sum = s->sync_sum, .first = s->sync_n == 0};
  if (n > 0) walk_values(grad, s->wire, 0, n, sum_piece, &c);
  s->sync_max = sum_max;
  s->sync_ids[s->sync_n++] = worker_id;
  *have = s->sync_n;
  pthread_mutex_unlock(&s->apply_mu);
  pthread_mutex_lock(&s->mu);
  s->stats.pushes++;
  s->stats.staleness_hist[0]++;
  pthread_mutex_unlock(&s->mu);
  return PS_OK;
}

int ps_shard_sync_try_apply(ps_shard *s, int quorum, int divisor, uint64_t *new_version,
                            char *err) {
  if (quorum < 1) quorum = 1;
  pthread_mutex_lock(&s->apply_mu);
  if (s->sync_n < quorum) {
    pthread_mutex_unlock(&s->apply_mu);
    return 0;
  }
  size_t n = s->end - s->begin;
  /* The step's gradients summed and divided by the workers it is for (at
   * least the gradients in it), applied once. */
  const int in = s->sync_n, by = divisor > in ? divisor : in;
  float inv = 1.0f / (float)by;
  /* The rows' mean first (staged, their tables held until the dense mean
   * is applied): a step whose rows are refused never touches the sum. */
  int rows = s->sync_rows.stage != NULL;
  char why[PS_ERRLEN] = "";
  int rc = rows ? s->sync_rows.stage(s->sync_rows.user, inv, why) : PS_OK;
  if (rc == PS_ENOMEM) {
    pthread_mutex_unlock(&s->apply_mu);
    return ps_seterr(err, rc, "%s", why);
  }
  if (rc != PS_OK) {
    s->sync_n = 0;
    sync_rows_clear(s);
    pthread_mutex_lock(&s->mu);
    s->stats.dropped += (uint64_t)in;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&s->apply_mu);
    return ps_seterr(err, PS_EINVAL, "step of %d gradients refused and dropped: %s", in, why);
  }
  for (size_t i = 0; i < n; i++) s->sync_sum[i] *= inv;
  ps_seg seg = {(const uint8_t *)s->sync_sum, n * sizeof(float)};
  ps_segview v = {&seg, n ? 1 : 0, n * sizeof(float)};
  uint64_t before = current_version(s);
  rc = apply_update(s, s->begin, n, &v, PS_WIRE_FP32,
                    s->sync_max * (double)inv * (1.0 + 0x1p-20), s->cfg.lr, before, why);
  if (rows) {
    if (rc == 0)
      s->sync_rows.commit(s->sync_rows.user);
    else
      s->sync_rows.abort(s->sync_rows.user);
  }
  if (rc == 0) {
    s->sync_n = 0;
    sync_rows_clear(s);
    if (new_version) *new_version = before + 1;
    if (by > in) {
      pthread_mutex_lock(&s->mu);
      s->stats.sync_short_steps++;
      pthread_mutex_unlock(&s->mu);
    }
  } else if (rc == PS_EINVAL) {
    /* A step whose result would not be finite never will be: its
     * gradients are dropped (and counted), so that the next can begin. */
    s->sync_n = 0;
    sync_rows_clear(s);
    pthread_mutex_lock(&s->mu);
    s->stats.dropped += (uint64_t)in;
    pthread_mutex_unlock(&s->mu);
    ps_seterr(err, rc, "step of %d gradients refused and dropped: %s", in, why);
  } else {
    /* Undo the scaling so that the step can still be applied later. */
    for (size_t i = 0; i < n; i++) s->sync_sum[i] *= (float)by;
    ps_seterr(err, rc, "%s", why);
  }
  pthread_mutex_unlock(&s->apply_mu);
  return rc == 0 ? 1 : rc;
}

/* ---------------------------------------------------------------- pull */

ps_snapshot *ps_shard_pull(ps_shard *s, size_t offset, size_t count, char *err) {
  if (count == 0 && s->end > s->begin) { /* as for a push */
    ps_seterr(err, PS_EINVAL, "pull of 0 values at offset %zu: nothing to send", offset);
    return NULL;
  }
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

/* The encoding is kept with the snapshot. Its buffer is written only while
 * a pull holds the snapshot (so no update may write the values: they stay
 * as encoded), under encode_mu, which makes concurrent pulls of one version
 * wait for the one encoding rather than each make their own; an update
 * that writes new values into the buffer (in place, or reusing a retired
 * one) does so only when no pull holds it, and marks the encoding stale. */
const uint16_t *ps_shard_snapshot_encoded(ps_shard *s, ps_snapshot *snap, size_t *nonfinite) {
  if (s->wire == PS_WIRE_FP32) return NULL;
  pthread_mutex_lock(&s->encode_mu);
  if (!snap->encoded_valid) {
    if (!snap->encoded) snap->encoded = malloc(snap->count ? snap->count * sizeof(uint16_t) : 1);
    if (snap->encoded) {
      snap->encoded_max = ps_half_encode(s->wire, snap->values, snap->encoded, snap->count);
      snap->encoded_valid = 1;
    }
  }
  const uint16_t *h = snap->encoded_valid ? snap->encoded : NULL;
  pthread_mutex_unlock(&s->encode_mu);
  if (h && nonfinite)
    *nonfinite = snap->encoded_max >= ps_half_nonfinite_bits(s->wire)
                     ? ps_half_first_nonfinite(s->wire, h, snap->count)
                     : snap->count;
  return h;
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

int ps_shard_export_state_with(ps_shard *s, float *params, float **slots, uint64_t *version,
                               int (*also)(void *user), void *user) {
  size_t n = s->end - s->begin;
  /* apply_mu: no update between the copies, so they belong together. */
  pthread_mutex_lock(&s->apply_mu);
  if (n) memcpy(params, s->current->values, n * sizeof(float));
  for (int k = 0; k < s->opt->n_slots; k++)
    if (n) memcpy(slots[k], s->slots[k], n * sizeof(float));
  *version = current_version(s);
  int rc = also ? also(user) : 0;
  pthread_mutex_unlock(&s->apply_mu);
  return rc;
}

void ps_shard_export_state(ps_shard *s, float *params, float **slots, uint64_t *version) {
  ps_shard_export_state_with(s, params, slots, version, NULL, NULL);
}

void ps_shard_restore_state(ps_shard *s, const float *params, float *const *slots,
                            uint64_t version) {
  size_t n = s->end - s->begin;
  pthread_mutex_lock(&s->apply_mu);
  pthread_mutex_lock(&s->mu);
  while (s->in_place) pthread_cond_wait(&s->applied, &s->mu);
  if (n) memcpy(s->current->values, params, n * sizeof(float));
  s->current->version = version;
  s->current->encoded_valid = 0;
  s->version = version;
  s->sync_n = 0;
  pthread_mutex_unlock(&s->mu);
  sync_rows_clear(s);
  for (int k = 0; k < s->opt->n_slots; k++)
    if (n) memcpy(s->slots[k], slots[k], n * sizeof(float));
  measure_bounds(s);
  pthread_mutex_unlock(&s->apply_mu);
}

int ps_shard_sync_export(ps_shard *s, float **sum, uint64_t **ids, int *n, double *max) {
  size_t len = s->end - s->begin;
  pthread_mutex_lock(&s->apply_mu);
  *n = s->sync_n;
  *max = s->sync_max;
  *sum = NULL;
  *ids = NULL;
  int rc = PS_OK;
  if (s->sync_n > 0) {
    *sum = malloc((len ? len : 1) * sizeof(float));
    *ids = malloc((size_t)s->sync_n * sizeof(uint64_t));
    if (!*sum || !*ids) {
      free(*sum);
      free(*ids);
      *sum = NULL;
      *ids = NULL;
      rc = PS_ENOMEM;
    } else {
      if (len) memcpy(*sum, s->sync_sum, len * sizeof(float));
      memcpy(*ids, s->sync_ids, (size_t)s->sync_n * sizeof(uint64_t));
    }
  }
  pthread_mutex_unlock(&s->apply_mu);
  return rc;
}

int ps_shard_sync_import(ps_shard *s, const float *sum, const uint64_t *ids, int n, double max) {
  size_t len = s->end - s->begin;
  if (n < 0 || (n > 0 && (!ids || (len && !sum)))) return PS_EINVAL;
  pthread_mutex_lock(&s->apply_mu);
  if (n > s->sync_cap) {
    uint64_t *grown = realloc(s->sync_ids, (size_t)n * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&s->apply_mu);
      return PS_ENOMEM;
    }
    s->sync_ids = grown;
    s->sync_cap = n;
  }
  if (n > 0 && len && !s->sync_sum) {
    s->sync_sum = ps_alloc(len * sizeof(float));
    if (!s->sync_sum) {
      pthread_mutex_unlock(&s->apply_mu);
      return PS_ENOMEM;
    }
  }
  if (n > 0) {
    if (len) memcpy(s->sync_sum, sum, len * sizeof(float));
    memcpy(s->sync_ids, ids, (size_t)n * sizeof(uint64_t));
  }
  s->sync_n = n;
  s->sync_max = n > 0 ? max : 0.0;
  pthread_mutex_unlock(&s->apply_mu);
  return PS_OK;
}

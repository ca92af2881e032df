/* The state a shard owns: its range [begin, end) of the flat parameter
 * vector, the optimizer slots, the version (updates applied), and the
 * statistics of pushes. Thread-safe: every function may be called from any
 * server thread. */
#ifndef PS_PS_SHARD_H
#define PS_PS_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/job.h"
#include "common/util.h"

/* Staleness 0..63 counted exactly (a controlled-staleness study reaches
 * 32 and more), 64 and more in the last bucket. */
#define PS_STALENESS_BUCKETS 65

typedef struct ps_shard ps_shard;

typedef struct {
  uint64_t version;
  uint64_t pushes, pulls, rejected;
  double staleness_mean;
  uint64_t staleness_max;
  uint64_t staleness_hist[PS_STALENESS_BUCKETS]; /* last bucket: >= BUCKETS-1 */
  uint64_t dropped;     /* sync: late or duplicate gradients dropped, and those of a step
                           refused because its result would not be finite */
  double step_time_ms;  /* mean time between two updates */
  int sync_pending;     /* sync: gradients in for the current step */
  uint64_t sync_short_steps; /* sync: steps applied with fewer gradients than the workers
                                they were for (the others waited for data) */
} ps_shard_stats;

/* A read-only, reference-counted copy of the parameters at one version. */
typedef struct ps_snapshot {
  uint64_t version;
  size_t begin, count; /* global range held */
  float *values;       /* count values */
  int refs;            /* atomic */
  /* A job with a 16-bit wire: the values encoded (count), made by the
   * first pull that asks (ps_shard_snapshot_encoded) and kept, with the
   * buffer, while the values stay as they are. */
  uint16_t *encoded;
  int encoded_valid;
  uint16_t encoded_max; /* the largest magnitude encoded (ps_half_encode's) */
} ps_snapshot;

/* Creates shard `index` of `num_shards` for the job: computes the range,
 * initializes the parameters from the job's seed (ps_model_init_params)
 * and the optimizer slots. NULL with a message on failure (unknown
 * optimizer, allocation). */
ps_shard *ps_shard_create(const ps_job *job, int index, int num_shards, char *err);
void ps_shard_destroy(ps_shard *s);

size_t ps_shard_begin(const ps_shard *s);
size_t ps_shard_end(const ps_shard *s);
int ps_shard_index(const ps_shard *s);

/* Applies a pushed gradient for the global range [offset, offset+count),
 * which must lie inside the shard's range. grad views count little-endian
 * values in the job's wire encoding (ps_job.wire): count*4 bytes of
 * float32, or count*2 bytes of bf16 or fp16, decoded to float32 a chunk at
 * a time as they are applied. Checks first, then applies: on any error it
 * returns PS_ERANGE/PS_EINVAL with a message, counts the push as rejected,
 * and leaves parameters, slots and version unchanged. The errors: 0 values
 * (PS_EINVAL; allowed only on a shard whose range is empty, where it is the
 * whole range), a range outside the shard's or one whose end overflows
 * (PS_ERANGE), a length that is not count*4 (count*2) bytes, a NaN or Inf
 * value, and
 * finite values with which the optimizer would make any parameter or slot
 * NaN or Inf (PS_EINVAL, the index named). On success writes the new
 * version and the staleness (version before apply - base_version, 0 if
 * base_version is ahead). With the job's staleness_aware_lr the learning
 * rate of this push is lr / max(1, staleness). */
int ps_shard_push(ps_shard *s, uint64_t base_version, size_t offset, size_t count,
                  const ps_segview *grad, uint64_t *new_version, uint64_t *staleness, char *err);

/* What a push updates besides the dense range (a Push's embedding rows):
 * prepare runs under the shard's update lock after the dense gradient was
 * checked and before it is applied (lr_scale: the staleness-aware factor
 * of this push, else 1); non-zero refuses the push, nothing applied. After
 * prepare succeeded, commit runs once the dense values are applied, or
 * abort when applying them failed: the push is all or nothing. */
typedef struct {
  int (*prepare)(void *user, float lr_scale, char *err);
  void (*commit)(void *user);
  void (*abort)(void *user);
  void *user;
} ps_shard_extra;

/* ps_shard_push with extra (may be NULL) updated under the same version;
 * with extra, count may be 0 (rows alone: the version still moves). */
int ps_shard_push_ex(ps_shard *s, uint64_t base_version, size_t offset, size_t count,
                     const ps_segview *grad, const ps_shard_extra *extra, uint64_t *new_version,
                     uint64_t *staleness, char *err);

/* sync mode. Adds a gradient for the whole range (encoded as for
 * ps_shard_push), computed from version base_version, to the current
 * step's sum. Checked as ps_shard_push, and
 * refused (PS_EINVAL) when adding it would make a value of the sum NaN or
 * Inf; nothing changes on error. A gradient of an earlier step
 * (base_version is not the current version: the step was applied without
 * it) or a second one from the same worker is dropped: *dropped = 1,
 * counted in stats. *have receives the number of gradients in for the
 * current step. */
int ps_shard_sync_add(ps_shard *s, uint64_t worker_id, uint64_t base_version, size_t offset,
                      size_t count, const ps_segview *grad, int *dropped, int *have,
                      char *err);

/* sync mode with embedding rows: what a step holds besides the dense sum
 * (the rows' sparse sum, ps/state/table_sync.h), kept in step with it. Each
 * function runs under the shard's update lock.
 * - add: ps_shard_sync_add_rows's gradient was checked and is taken (not
 *   dropped): add its rows (arg, the call's), all or nothing; non-zero
 *   refuses the gradient, nothing changed.
 * - stage: the step is applied: stage every row's sum times inv (the
 *   factor the dense sum is multiplied by: 1 / gradients in the step),
 *   before the dense mean is applied; non-zero refuses the step (PS_ENOMEM:
 *   it stays pending; any other code: it is dropped, as a step that would
 *   not be finite). Then commit once the dense mean is applied, or abort.
 * - clear: the step's gradients are gone (applied, dropped, or replaced by
 *   ps_shard_restore_state). */
typedef struct {
  int (*add)(void *user, const void *arg, char *err);
  int (*stage)(void *user, float inv, char *err);
  void (*commit)(void *user);
  void (*abort)(void *user);
  void (*clear)(void *user);
  void *user;
} ps_shard_sync_rows;

/* Sets the hooks (copied; NULL: none) before the shard serves. */
void ps_shard_set_sync_rows(ps_shard *s, const ps_shard_sync_rows *h);

/* ps_shard_sync_add with the gradient's rows (rows_arg, passed to the
 * hooks' add; NULL: no rows): the gradient and its rows are taken, dropped
 * or refused together. */
int ps_shard_sync_add_rows(ps_shard *s, uint64_t worker_id, uint64_t base_version, size_t offset,
                           size_t count, const ps_segview *grad, const void *rows_arg,
                           int *dropped, int *have, char *err);

/* sync mode. Applies the current step when at least `quorum` gradients are
 * in: their sum divided by `divisor` (the workers the step is for; at
 * least the gradients in it, which 0 means), with the optimizer, once. A
 * step short of gradients because workers wait for data moves the model
 * no further per example than a full one. Returns 1 if it applied (and
 * writes the new version), 0 if the quorum is not reached, or a negative
 * code with a message, parameters, slots and version unchanged: PS_EINVAL
 * when the step would make a parameter or slot NaN or Inf (the step's
 * gradients are then dropped and counted, since it never could be
 * applied), PS_ENOMEM (the step stays pending). */
int ps_shard_sync_try_apply(ps_shard *s, int quorum, int divisor, uint64_t *new_version,
                            char *err);
/* (With ps_shard_set_sync_rows' hooks, the step's rows are applied with it
 * under the same version; a step they refuse is dropped (PS_EINVAL) or,
 * out of memory, stays pending, as above.) */

/* A snapshot of the range [offset, offset+count) (inside the shard's range)
 * at the current version. Snapshots of the whole range are shared between
 * pulls of the same version. Release with ps_snapshot_unref. NULL with a
 * message on a bad range, or 0 values (allowed only on a shard whose range
 * is empty). */
ps_snapshot *ps_shard_pull(ps_shard *s, size_t offset, size_t count, char *err);
void ps_snapshot_unref(ps_snapshot *snap);

/* The values of snap (from ps_shard_pull, a reference held) in the job's
 * 16-bit encoding (ps_job.wire is bf16 or fp16): encoded by the first
 * caller and kept with the snapshot, so that pulls of the same version
 * (every worker's, in sync mode) send them without encoding again, and
 * the buffer is reused with the snapshot's, never allocated afresh in the
 * steady state. Valid while the reference is held. A value beyond the
 * format's range is encoded as Inf (*nonfinite, when not NULL, receives the
 * index of the first Inf or NaN, or snap->count). NULL when out of memory
 * or when the job's wire is fp32. */
const uint16_t *ps_shard_snapshot_encoded(ps_shard *s, ps_snapshot *snap, size_t *nonfinite);

void ps_shard_stats_get(ps_shard *s, ps_shard_stats *out);

/* Copies the parameters of the whole range into out (end-begin values),
 * for tests and checkpoints. */
void ps_shard_copy_params(ps_shard *s, float *out);

/* The optimizer's name and how many slot arrays it keeps. */
int ps_shard_n_slots(const ps_shard *s);
const char *ps_shard_optimizer(const ps_shard *s);

/* A consistent copy (no update in between) of the parameters, the
 * optimizer slots (n_slots arrays) and the version, for a checkpoint.
 * Each array holds end-begin values. */
void ps_shard_export_state(ps_shard *s, float *params, float **slots, uint64_t *version);
/* The same, and also(user) called while no update can run (under the lock
 * pushes take, after the copies), so that what it copies (a push's
 * embedding rows, applied under that lock too) is of the same version.
 * Returns what also returned. */
int ps_shard_export_state_with(ps_shard *s, float *params, float **slots, uint64_t *version,
                               int (*also)(void *user), void *user);

/* Replaces parameters, slots and version (a restart from a checkpoint);
 * meant before the shard serves, but safe at any time. Snapshots already
 * handed to pulls keep their old values. */
void ps_shard_restore_state(ps_shard *s, const float *params, float *const *slots,
                            uint64_t version);

/* sync mode: the current step's gradients as they stand (the sum of the
 * n in, the workers who sent them, the bound on the sum), for a replica
 * that takes the whole state; export allocates sum (end-begin values) and
 * ids (n), NULL when n is 0. import replaces them (call it after
 * ps_shard_restore_state, which empties the step). PS_ENOMEM, PS_EINVAL. */
int ps_shard_sync_export(ps_shard *s, float **sum, uint64_t **ids, int *n, double *max);
int ps_shard_sync_import(ps_shard *s, const float *sum, const uint64_t *ids, int n, double max);

#endif

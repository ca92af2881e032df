/* Where a training worker's batches come from: its static share of the
 * data set (examples i % num_workers == rank, every epoch), or chunks
 * leased from shard 0 (elastic: every example once per epoch whatever the
 * churn). Either way batches are filled ahead on the batcher's thread. */
#ifndef PS_WORKER_SOURCE_H
#define PS_WORKER_SOURCE_H

#include <stdatomic.h>
#include <stdint.h>

#include "worker/data/data.h"
#include "worker/client/ps_client.h"

typedef struct ps_source ps_source;

/* The static share, for `epochs` passes (shuffled per epoch unless
 * shuffle is 0); max_steps > 0 stops earlier. NULL when the pipeline
 * cannot start. */
ps_source *ps_source_share(const ps_dataset *train, int batch, int rank, int num_workers,
                           uint64_t seed, int shuffle, int epochs, int64_t max_steps,
                           const ps_host_mem *mem);

/* Chunks leased from shard 0 through client until its last epoch;
 * unreachable shards are retried for retry_s seconds; *stop ends the
 * asking (within a second while every chunk is leased to others; after
 * the call in flight, at most the client's deadline, otherwise). The
 * batcher's thread uses client until ps_source_destroy returns: set *stop,
 * then destroy the source, then the client. NULL when the pipeline cannot
 * start. */
ps_source *ps_source_leases(const ps_dataset *train, int batch, uint64_t seed, ps_client *client,
                            double retry_s, atomic_int *stop, int64_t max_steps,
                            const ps_host_mem *mem);

/* Logs what the source will deliver (examples, steps, epochs). */
void ps_source_log_plan(const ps_source *s, int lease_chunk, int epochs);

/* Steps it will deliver at most (INT64_MAX when the leases decide). */
int64_t ps_source_total_steps(const ps_source *s);

/* The next batch, valid until ps_source_release: 0; 1 when there is no
 * more data (nothing to release); -1 with a message in err (PS_ERRLEN
 * bytes) when the input pipeline failed, e.g. shard 0 stayed unreachable
 * for retry_s or leased a chunk outside the data set: that is not the end
 * of the data. */
int ps_source_next(ps_source *s, ps_batch **out, char *err);
void ps_source_release(ps_source *s, ps_batch *b);

/* The gradient of b was applied by every shard: when b ends a leased
 * chunk, the chunk is reported done to shard 0. */
void ps_source_batch_done(ps_source *s, const ps_batch *b);
/* The same for a chunk by its lease (any thread). */
void ps_source_chunk_done(ps_source *s, uint64_t lease);

/* Leases: logs how many finished chunks shard 0 counted (nothing for a
 * static share). */
void ps_source_log_summary(const ps_source *s);

/* What a heartbeat says of this worker's data: with leases (*names set),
 * the leases it holds (granted, not yet reported done: up to max written to
 * ids; returns how many), which shard 0 keeps alive and no other; and
 * whether it is idle: the training loop has waited PS_SOURCE_IDLE_MS for a
 * batch while every chunk left of the epoch is leased to other workers, so
 * sync steps and ssp clocks should not wait for it. Any thread. */
#define PS_SOURCE_MAX_HELD 16
#define PS_SOURCE_IDLE_MS 200
int ps_source_heartbeat_state(ps_source *s, uint64_t *ids, int max, int *names, int *idle);

/* After ps_source_next failed: whether it was because shard 0 did not
 * answer lease calls for retry_s seconds. */
int ps_source_unreachable(const ps_source *s);

/* How long the training loop has waited for a batch (0: it is not
 * waiting), and whether the leases wait for other workers' chunks. Any
 * thread; NULL gives 0. */
int64_t ps_source_waiting_ms(ps_source *s, int *for_leases);

/* Stops the batcher's thread (and its lease calls); frees. NULL is fine. */
void ps_source_destroy(ps_source *s);

#endif

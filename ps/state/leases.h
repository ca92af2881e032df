/* Data leases: shard 0 hands out the training set to workers as leases on
 * chunks of examples, so that workers may join and leave at any time and
 * every example is still seen once per epoch. A pure table: no network, no
 * clock of its own (every call is given `now_ms`), thread-safe behind one
 * mutex.
 *
 * The set of N examples is cut into chunks of C examples: chunk k covers
 * examples [k*C, min(N, (k+1)*C)), k in 0..ceil(N/C)-1. In epoch e the
 * chunks are handed out in an order that is a permutation seeded by
 * (seed, e), so a run is reproducible from its seed. A chunk taken back from
 * a worker that left or stalled ("reclaimed") returns to a pool that is
 * served before the rest of the permutation: the epoch cannot end without
 * it. When every chunk of an epoch is done, the next epoch begins, with a
 * new permutation; after the last epoch acquire answers PS_LEASE_FINISHED.
 *
 * A chunk is done at most once per epoch: a done chunk is never handed out
 * again in that epoch, and only the current holder's completion counts.
 * What the table cannot prevent is that the first holder of a reclaimed
 * chunk computed on it: the examples it pushed under the lease (shard 0
 * hears each push's lease, ps_leases_note_pushed) are counted as
 * abandoned once the chunk goes to another worker, and those it reports
 * in a refused completion as wasted, each example once; the whole chunk
 * is counted as "re-handed out". */
#ifndef PS_PS_LEASES_H
#define PS_PS_LEASES_H

#include <stddef.h>
#include <stdint.h>

/* Outcomes besides PS_OK and the negative codes of common/util.h. The
 * positive ones are not errors: they tell the worker what to do next. */
enum {
  PS_LEASE_WAIT = 1,     /* acquire: every chunk of the epoch that is not done is
                            leased to someone; retry later (stragglers finish or
                            their leases are reclaimed) */
  PS_LEASE_FINISHED = 2, /* acquire: every epoch is done; nothing more, ever */
  PS_LEASE_FULL = 3,     /* acquire: the worker already holds max_per_worker
                            leases; complete one first */
  PS_LEASE_ELOST = -32,  /* complete: the lease was reclaimed (worker released
                            or lease expired) and its chunk handed out again or
                            done by another worker: the work is not counted */
};

/* Most chunks a table takes: ceil(N/C) must not exceed this. A table takes
 * 19 bytes per chunk (8 of them the kept epochs' per-chunk counts). */
#define PS_LEASE_MAX_CHUNKS ((uint32_t)1 << 24)
/* How many finished epochs' records are kept (the newest ones). */
#define PS_LEASE_HISTORY 8

typedef struct {
  uint64_t n_examples;     /* N > 0 */
  uint32_t chunk_size;     /* C > 0: examples per chunk (the last may be smaller) */
  uint32_t epochs;         /* E: epochs to hand out; 0 = unbounded */
  uint64_t seed;           /* the permutation of epoch e is seeded by (seed, e) */
  uint32_t max_per_worker; /* leases one worker may hold at once (prefetch), >= 1 */
  uint64_t first_id;       /* the first lease id (0: from the wall clock): a replicated
                              shard 0's replicas make their tables with the primary's, so
                              that they hand out the same ids */
} ps_lease_config;

/* One lease, as acquire hands it out. */
typedef struct {
  uint32_t epoch;    /* from 0 */
  uint32_t chunk;    /* chunk id */
  uint64_t begin;    /* first example: chunk * chunk_size */
  uint32_t count;    /* examples in the chunk: chunk_size, or fewer for the last */
  uint64_t lease_id; /* never 0; unique within a table's life, and a table
                        restored from a checkpoint does not reuse the ids of
                        its previous life (they start from the wall clock) */
} ps_lease;

/* What happened in one epoch. For the current epoch the figures so far. */
typedef struct {
  uint32_t epoch;
  int finished;                 /* 1 when every chunk was done */
  uint32_t chunks;              /* chunks in an epoch: ceil(N/C) */
  uint32_t chunks_completed;    /* completions counted (sum over chunks) */
  uint32_t chunks_once;         /* chunks completed exactly once */
  uint64_t examples_completed;  /* sum of the counts of completed chunks */
  uint64_t examples_handed_out; /* sum of the counts over every lease handed out */
  uint64_t examples_rehanded;   /* of those, handed out again after a reclaim: examples
                                   a reclaimed holder may also have seen */
  uint64_t reclaims;            /* leases taken back (release, expiry, restore) */
  uint64_t examples_redone;     /* of chunks whose completion a worker had been told was
                                   counted, lost with a restore from a checkpoint that did
                                   not hold it, and leased to another worker by the time the
                                   first named it: trained again (ps_leases_rejoin) */
  uint64_t examples_recovered;  /* of examples_completed: chunks a worker finished under a
                                   lease of the table's life before a restore, taken as done
                                   when it registered again (ps_leases_rejoin) */
  uint64_t examples_wasted;     /* examples workers trained under leases whose completion was
                                   not counted (reclaimed and gone to another worker, or of a
                                   life before a restore that could not be taken back):
                                   trained again by another (ps_leases_note_refused), less
                                   what examples_abandoned counted of the lease already */
  uint64_t examples_abandoned;  /* examples pushed under leases taken back (the worker left,
                                   stalled or died) whose chunks went to another worker:
                                   trained again. Every example trained is counted once in
                                   examples_completed + examples_redone + examples_wasted +
                                   examples_abandoned */
  int64_t start_ms;             /* now_ms of the epoch's first acquire; -1: none yet */
  int64_t end_ms;               /* now_ms of its last completion; -1: not finished */
} ps_lease_epoch_record;

typedef struct {
  ps_lease_config config;
  uint32_t chunks;         /* ceil(N/C) */
  uint32_t epoch;          /* current epoch (== epochs once finished) */
  int finished;            /* 1 after the last epoch */
  uint32_t chunks_done;    /* in the current epoch */
  uint32_t chunks_leased;  /* leases outstanding now */
  uint64_t leases_granted; /* since creation (a restored table goes on counting) */
  uint64_t reclaims_total; /* since creation */
  ps_lease_epoch_record current;
  int n_history; /* finished epochs kept, at most PS_LEASE_HISTORY */
  ps_lease_epoch_record history[PS_LEASE_HISTORY]; /* newest first */
} ps_lease_stats;

typedef struct ps_leases ps_leases;

/* A table at epoch 0 with nothing leased. NULL (and a message in err, a
 * PS_ERRLEN buffer or NULL) on a bad configuration or out of memory. */
ps_leases *ps_leases_create(const ps_lease_config *cfg, char *err);
void ps_leases_destroy(ps_leases *t);

/* Message for the codes above, else ps_strerror's. */
const char *ps_leases_strerror(int code);

/* Leases the worker the next chunk of the current epoch that is neither done
 * nor leased (reclaimed chunks first, then the epoch's permutation) and
 * writes it to out. Returns PS_OK, or PS_LEASE_FINISHED, PS_LEASE_FULL,
 * PS_LEASE_WAIT (checked in that order; out untouched then), PS_EINVAL for a
 * NULL argument, PS_ENOMEM (state unchanged). */
int ps_leases_acquire(ps_leases *t, uint64_t worker, int64_t now_ms, ps_lease *out);

/* The worker reports the lease's chunk done. Returns:
 *   PS_OK          counted: the chunk is done for its epoch (and when it was
 *                  the epoch's last, the next epoch begins). Also PS_OK,
 *                  counting nothing again, for a lease this worker already
 *                  completed (a retried request), and for a reclaimed lease
 *                  of this worker whose chunk is still in the pool, neither
 *                  handed out again nor done: the work is taken, not redone.
 *   PS_LEASE_ELOST the lease was reclaimed and its chunk handed out again
 *                  (or done) since: not counted.
 *   PS_ESTATE      the lease was handed to another worker.
 *   PS_ENOTFOUND   unknown lease id: never handed out by this table, from a
 *                  life before a restore, or ended so long ago (over 4096
 *                  lease endings) that the table forgot it.
 * State is unchanged on every answer but the counting PS_OK. */
int ps_leases_complete(ps_leases *t, uint64_t worker, uint64_t lease_id, int64_t now_ms);

/* The worker left or timed out: its leases go back to the pool (same epoch).
 * Returns how many (0 for a worker holding none). */
int ps_leases_release_worker(ps_leases *t, uint64_t worker);

/* Marks the worker's leases alive at now_ms (on each heartbeat). Returns how
 * many it holds. */
int ps_leases_renew(ps_leases *t, uint64_t worker, int64_t now_ms);

/* Marks alive at now_ms those of the worker's leases named in ids (n of
 * them): a heartbeat names what the worker holds, so that a lease it never
 * heard of (its grant was lost) is not kept alive and expires. Ids the
 * worker does not hold are ignored. Returns how many were renewed. */
int ps_leases_renew_named(ps_leases *t, uint64_t worker, const uint64_t *ids, size_t n,
                          int64_t now_ms);

/* Takes back every lease last granted or renewed more than timeout_ms before
 * now_ms. Returns how many. */
int ps_leases_expire(ps_leases *t, int64_t now_ms, int64_t timeout_ms);

/* Copies up to max of the worker's leases (oldest first) into out; returns
 * how many it holds (which may exceed max). */
int ps_leases_held(ps_leases *t, uint64_t worker, ps_lease *out, int max);

void ps_leases_stats(ps_leases *t, ps_lease_stats *out);

/* The record of `epoch`: the current one or one of the last PS_LEASE_HISTORY
 * finished ones. When counts is not NULL, also writes how many times each
 * chunk was completed in that epoch, by chunk id, for the first
 * min(max, chunks) chunks (saturating at 255). Returns the number of chunks,
 * or PS_ENOTFOUND when the epoch is not kept (or, after the last epoch, is
 * the `epochs`th, which never starts). A finished epoch in which every
 * example was seen once has chunks_once == chunks_completed == chunks and
 * examples_completed == n_examples. */
int ps_leases_epoch_record(ps_leases *t, uint32_t epoch, ps_lease_epoch_record *rec,
                           uint8_t *counts, uint32_t max);

/* A lease a worker holds, as it names it when it registers again: its id,
 * epoch and chunk, whether it has trained every example of it (its
 * completion on the way), how many examples of it it trained, and whether
 * its completion was refused (a lease it no longer holds, named so that a
 * table restored to before the refusal counts what it trained). */
typedef struct {
  uint64_t lease_id;
  uint32_t epoch, chunk;
  int finished;
  uint32_t trained;
  int refused;
} ps_lease_held;

/* What ps_leases_rejoin did. */
typedef struct {
  int accepted;     /* chunks taken as done (examples_recovered) */
  int adopted;      /* leases taken back as this worker's */
  int redone;       /* chunks counted in examples_redone */
  uint64_t examples_accepted, examples_redone;
} ps_lease_rejoin;

/* A worker registering again (typically after this table was restored
 * from a checkpoint, which forgets what came after it) says what it did
 * under the table's earlier life, so that no example it trained goes
 * unrecorded:
 *  - done (n_done, each epoch << 32 | chunk): chunks of the current epoch
 *    whose completion it was told was counted;
 *  - held (n_held): its leases not yet acknowledged done.
 * A chunk of the current epoch that is neither done nor leased to another
 * worker (fresh, or in the pool of reclaimed chunks) stays the worker's: a
 * done one, or a held one it finished, is taken as done now (counted in
 * examples_recovered, and a retried completion of that lease answered as
 * counted); a held one it is still training is leased to it again under
 * its id, so that its completion counts. A done chunk that went to
 * another worker since is counted in examples_redone (once per chunk and
 * epoch, whoever names it). Leases this life of the table knows (granted,
 * or ended) are left to their completion; other epochs and ids out of
 * range are ignored. What the worker trained of a held lease counts as
 * pushed under it (ps_leases_note_pushed); of one whose chunk went to
 * another worker, it is counted as abandoned at once (the worker may die
 * before its completion is refused). A refused lease it names is counted
 * as ps_leases_note_refused counts it, once whatever the number of times
 * it is named. Returns 0 (PS_EINVAL for a NULL t, or NULL arrays
 * with counts); out (may be NULL) says what was done. */
int ps_leases_rejoin(ps_leases *t, uint64_t worker, const uint64_t *done, size_t n_done,
                     const ps_lease_held *held, size_t n_held, int64_t now_ms,
                     ps_lease_rejoin *out);

/* A worker finished a lease whose completion was not counted (PS_LEASE_ELOST,
 * PS_ENOTFOUND, PS_ESTATE): the `trained` examples it trained of it are
 * trained again by another worker, or were already: those not counted as
 * abandoned already join the current epoch's examples_wasted. A repeated
 * report of the same lease counts nothing more (while the table remembers
 * the lease: the last 4096 leases ended). */
void ps_leases_note_refused(ps_leases *t, uint64_t worker, uint64_t lease_id, uint64_t trained);

/* Shard 0 applied a push of `examples` examples the worker trained under
 * lease_id. Counted on the lease while the worker holds it; once the lease
 * was taken back and its chunk went to another worker, counted at once as
 * abandoned. A lease of another worker, a completed one or an unknown id
 * counts nothing. */
void ps_leases_note_pushed(ps_leases *t, uint64_t worker, uint64_t lease_id, uint32_t examples);

/* Serializes the whole state for a checkpoint into a malloc'd buffer (free
 * with free()). Outstanding leases are written as chunks back in the pool:
 * their holders re-register after a restore and take them back
 * (ps_leases_rejoin). PS_ENOMEM leaves *buf and *len
 * untouched. */
int ps_leases_save(const ps_leases *t, void **buf, size_t *len);

/* A table from a blob of ps_leases_save. Every field is checked: a
 * truncated, corrupt or newer-version blob gives NULL and a message in err,
 * never a crash. Leases outstanding at save time come back in the pool,
 * counted as reclaims, with what was pushed under them (abandoned when
 * their chunks go to another worker). Blobs of the previous versions
 * (before examples_redone, before examples_recovered and examples_wasted,
 * before examples_abandoned) load too, with nothing redone, recovered,
 * wasted or abandoned. */
ps_leases *ps_leases_load(const void *buf, size_t len, char *err);

/* Replaces t's whole state by a blob's, in place: a replica of shard 0
 * taking its primary's table. Unlike ps_leases_load (a new life, whose ids
 * must not meet the old ones), it goes on with the blob's next lease id, so
 * that it hands out the ids its primary does. PS_EINVAL with a message (t
 * unchanged) for a bad blob, or no memory. */
int ps_leases_replace(ps_leases *t, const void *buf, size_t len, char *err);
/* A new table that is a blob's copy, as ps_leases_replace makes it (a
 * replica of shard 0 that has no table yet). NULL with a message. */
ps_leases *ps_leases_load_copy(const void *buf, size_t len, char *err);

#endif

/* Workers known to a shard: registration, heartbeats, leave, time-outs.
 * Thread-safe. Each shard keeps its own table and times workers out on its
 * own; shard 0 assigns the ids. */
#ifndef PS_PS_MEMBERSHIP_H
#define PS_PS_MEMBERSHIP_H

#include <stdint.h>

typedef struct {
  uint64_t id;
  char host[64];
  char role[16];
  int task_index;
  int rank;             /* order of registration on this shard, from 0 */
  uint64_t step;        /* last step the worker reported */
  uint64_t pushes;
  uint64_t clock;       /* steps pushed, counted from the slowest worker's clock at join */
  int64_t last_seen_ms; /* ps_now_ms() of the last message */
} ps_member;

typedef struct ps_membership ps_membership;

ps_membership *ps_membership_create(void);
void ps_membership_destroy(ps_membership *m);

/* Adds a worker. id 0: a new id is assigned (unique within the process and
 * unlikely to repeat across restarts). id != 0: that id is used (a worker
 * that shard 0 named registering with another shard); registering a known
 * id again refreshes it. Writes the id and the rank. */
int ps_membership_add(ps_membership *m, uint64_t id, const char *host, const char *role,
                      int task_index, int64_t now_ms, uint64_t *id_out, int *rank_out);
/* Marks the worker seen (and its step when step != UINT64_MAX).
 * PS_ENOTFOUND if the id is unknown (never registered, left, or dropped). */
int ps_membership_touch(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms);
/* As touch, and counts a push. */
int ps_membership_note_push(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms);
/* Removes a worker; PS_ENOTFOUND if unknown. */
int ps_membership_remove(ps_membership *m, uint64_t id);
/* Drops workers not seen for more than timeout_ms; writes up to max of their
 * ids into dropped and returns how many were dropped. */
int ps_membership_sweep(ps_membership *m, int64_t now_ms, int timeout_ms, uint64_t *dropped,
                        int max);
/* The worker's clock and the smallest clock of the live workers that train
 * (bounded staleness compares the two; the smallest is never above the
 * worker's own). PS_ENOTFOUND if the id is unknown. */
int ps_membership_clock(ps_membership *m, uint64_t id, uint64_t *clock, uint64_t *min_clock);
/* Live workers that train (role "evaluator" is not counted). */
int ps_membership_count(ps_membership *m);
/* Copies up to max members into out; returns how many. */
int ps_membership_list(ps_membership *m, ps_member *out, int max);
/* Total workers dropped by time-out since creation. */
uint64_t ps_membership_dropped_total(ps_membership *m);

#endif

/* Workers known to a shard: registration, heartbeats, leave, time-outs.
 * Thread-safe. Each shard keeps its own table and times workers out on its
 * own; shard 0 assigns the ids. */
#ifndef PS_PS_MEMBERSHIP_H
#define PS_PS_MEMBERSHIP_H

#include <stddef.h>
#include <stdint.h>

#include "common/auth.h"

typedef struct {
  uint64_t id;
  char host[64]; /* valid UTF-8, no control characters (ps_utf8_sanitize) */
  char role[16]; /* the same */
  int task_index;
  int rank;             /* order of registration on this shard, from 0 */
  uint64_t step;        /* last step the worker reported */
  uint64_t pushes;
  uint64_t clock;       /* steps pushed, counted from the slowest worker's clock at join */
  int64_t last_seen_ms; /* ps_now_ms() of the last message */
  int reader;           /* registered with the read-only token, or as an evaluator: may not push */
  int idle;             /* waits for data: not counted until it pushes (or says so) again */
  uint64_t round;       /* the request id of its last push applied here (0: none) */
  uint8_t session[PS_SESSION_LEN]; /* its secret on this shard (never sent but to it) */
  struct ps_recent *recent; /* its recent request ids and answers (membership.c's own) */
} ps_member;

/* What a registering caller proved. */
typedef struct {
  const uint8_t *session; /* the session secret it holds for its id (may be NULL) */
  size_t session_len;
  int reader;             /* it holds the read-only token only */
} ps_member_cred;

typedef struct ps_membership ps_membership;

ps_membership *ps_membership_create(void);
/* At most max registrations at once (default: no limit): a join beyond
 * them gets PS_ERANGE and nothing changes. */
void ps_membership_set_limit(ps_membership *m, int max);
void ps_membership_destroy(ps_membership *m);

/* Registers a worker and gives it a session secret (session_out,
 * PS_SESSION_LEN bytes, may be NULL). id 0: a new id is drawn from the
 * kernel's random source (unpredictable, never 0, not in the table).
 * id != 0 and unknown: that id is used (a worker that shard 0 named
 * registering with another shard, or one this shard forgot), with a fresh
 * secret. id != 0 and known: the caller must show the id's current secret
 * in cred; then the registration is refreshed (host, role, time; rank,
 * counters and secret kept); without it PS_ESTATE and nothing changes (no
 * client can take over another's id). PS_ERANGE: the table is at its
 * limit. PS_ENOMEM, PS_EIO (no random bytes): nothing changes. Writes
 * the id and the rank. host and role (NULL is "") are stored as
 * ps_utf8_sanitize makes them: valid UTF-8 with no control characters, cut
 * on a character boundary to fit the fields. */
int ps_membership_join(ps_membership *m, uint64_t id, const char *host, const char *role,
                       int task_index, int64_t now_ms, const ps_member_cred *cred,
                       uint64_t *id_out, int *rank_out, uint8_t *session_out);
/* ps_membership_join for a caller that needs no secret (in-process use and
 * tests): a known id is refreshed whatever the secret. */
int ps_membership_add(ps_membership *m, uint64_t id, const char *host, const char *role,
                      int task_index, int64_t now_ms, uint64_t *id_out, int *rank_out);
/* Checks that session (len bytes) is the worker's secret, in constant
 * time; *reader: it registered with the read-only token. PS_ENOTFOUND for
 * an unknown id, PS_EINVAL for a wrong secret. */
int ps_membership_authorize(ps_membership *m, uint64_t id, const void *session, size_t len,
                            int *reader);
/* Marks the worker seen (and its step when step != UINT64_MAX).
 * PS_ENOTFOUND if the id is unknown (never registered, left, or dropped). */
int ps_membership_touch(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms);
/* As touch, and counts a push. */
int ps_membership_note_push(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms);
/* Push rounds: a worker's pushes carry increasing request ids, one round
 * in flight at a time; note_round records a round applied here (never
 * going back), round reads the last one. PS_ENOTFOUND if the id is
 * unknown. */
int ps_membership_note_round(ps_membership *m, uint64_t id, uint64_t round);
int ps_membership_round(ps_membership *m, uint64_t id, uint64_t *round);
/* The last rounds of n workers as a restored checkpoint holds them: a
 * worker of those ids that registers (again) starts at its round, so that
 * a push of a round the checkpoint holds is known as applied. Replaces an
 * earlier seed. PS_ENOMEM. */
int ps_membership_seed_rounds(ps_membership *m, const uint64_t *ids, const uint64_t *rounds,
                              int n);
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
/* The worker says it waits for data (idle) or not. An idle worker is left
 * out of ps_membership_count and of the smallest clock, so a sync step or
 * an ssp pull does not wait for it; when it comes back (this call with 0,
 * or a push) its clock starts at the slowest active worker's if that is
 * ahead. Returns 1 when the state changed, 0 when not, PS_ENOTFOUND. */
int ps_membership_set_idle(ps_membership *m, uint64_t id, int idle);
/* Live workers that train (role "evaluator" and idle workers are not
 * counted). */
int ps_membership_count(ps_membership *m);
/* Both counts at one instant: returns ps_membership_count's, and in *idle
 * the live workers that wait for data (idle), which that count leaves out
 * (a worker that turned idle between two separate calls would be counted
 * in neither, or in both). */
int ps_membership_count_both(ps_membership *m, int *idle);
/* Copies up to max members into out; returns how many. */
int ps_membership_list(ps_membership *m, ps_member *out, int max);
/* Request ids: a mutation a worker may retry (Push, Lease) carries a
 * non-zero id, the same on a retry; kind tells the mutations apart (each
 * counts its ids on its own). The table keeps each worker's most recent
 * PS_RECENT_REQUESTS (kind, id) with the answers given.
 *   begin: PS_OK: new, now pending: apply it, then call end;
 *          PS_REQUEST_ANSWERED: applied before: *reply (reply_cap bytes)
 *          holds the first answer (*len bytes), send it again, apply nothing;
 *          PS_REQUEST_PENDING: still being applied: the caller says so;
 *          PS_ENOTFOUND: unknown worker.
 *   end:   records the answer (reply, len <= PS_REPLY_MAX) of a pending id,
 *          or with len 0 forgets it (the request was refused and a retry
 *          may try again). */
#define PS_RECENT_REQUESTS 16
#define PS_REPLY_MAX 96
enum { PS_REQUEST_ANSWERED = 1, PS_REQUEST_PENDING = 2 };
int ps_membership_request_begin(ps_membership *m, uint64_t worker, int kind, uint64_t request_id,
                                void *reply, size_t reply_cap, size_t *len);
void ps_membership_request_end(ps_membership *m, uint64_t worker, int kind, uint64_t request_id,
                               const void *reply, size_t len);

/* Replicated shards (ps/repl/replica.h).
 *   stage: a pending request was applied and its answer is known, but it
 *     is not to be given before every replica has the update: begin keeps
 *     answering PS_REQUEST_PENDING, end (the same answer) settles it, and
 *     an export counts it as answered (the state exported holds it).
 *   settle: every staged answer becomes the answer, every pending one is
 *     forgotten (a primary that steps down keeps its state as it is).
 *   install: a registration as the primary made it (its id, secret and
 *     reader flag), through the same path as join (rank, clock).
 *   export / import: the whole table (members, their recent answers, the
 *     next rank) for a replica that takes the primary's state whole;
 *     import replaces the table. PS_ENOMEM (nothing changes). */
typedef struct {
  uint64_t id;
  int kind;
  size_t len;
  uint8_t reply[PS_REPLY_MAX];
} ps_recent_state;
typedef struct {
  ps_member member; /* .recent unused */
  int n_recent;     /* oldest first */
  ps_recent_state recent[PS_RECENT_REQUESTS];
} ps_member_state;
void ps_membership_request_stage(ps_membership *m, uint64_t worker, int kind, uint64_t request_id,
                                 const void *reply, size_t len);
void ps_membership_request_settle(ps_membership *m);
int ps_membership_install(ps_membership *m, uint64_t id, const char *host, const char *role,
                          int task_index, int64_t now_ms, const uint8_t *session, int reader,
                          int *rank_out);
int ps_membership_export(ps_membership *m, ps_member_state **out, int *n, int *next_rank);
int ps_membership_import(ps_membership *m, const ps_member_state *in, int n, int next_rank);

/* Total workers dropped by time-out since creation. */
uint64_t ps_membership_dropped_total(ps_membership *m);

#endif

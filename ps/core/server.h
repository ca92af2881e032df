/* ps-server's insides: the server's state (ps_server), the options it runs
 * from (ps_server_opts), and the functions its files share.
 *
 *   server_main.c  the command line: options, --status, then ps_server_run
 *   server.c       the server's life: build the parts, the loop's timers,
 *                  signals, run, orderly shutdown
 *   service.c      the RPC handlers (Register, Heartbeat, Leave, Pull, Push,
 *                  Status, Lease)
 *   sync.c         pulls that wait (ssp, sync) and the sync step
 *   server_ckpt.c  when and what the server checkpoints, restore at start
 *   status_cli.c   the --status client (JSON, or the --watch table)
 *
 * Threads: gRPC's completion queue is served by a pool of threads (the
 * handlers of service.c run there, against the thread-safe shard and
 * membership); the main thread runs a libuv loop that owns the timers
 * (dropping silent workers, progress lines and metrics, checkpoints) and
 * the signals (SIGINT/SIGTERM stop the server cleanly). */
#ifndef PS_PS_SERVER_H
#define PS_PS_SERVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <protobuf-c/protobuf-c.h>
#include <uv.h>

#include "common/cluster.h"
#include "common/job.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/security.h"
#include "common/util.h"
#include "ps/ckpt/checkpoint.h"
#include "ps/state/leases.h"
#include "ps/state/membership.h"
#include "ps/repl/replica.h"
#include "ps/state/shard.h"
#include "ps/state/table.h"
#include "proto/ps.pb-c.h"

/* The parsed command line of a server (the strings are borrowed: they must
 * outlive ps_server_run). */
typedef struct {
  const char *job_path;     /* required */
  const char *ps_list;      /* NULL: the cluster comes from TF_CONFIG */
  int index;                /* -1: not given */
  const char *listen_addr;  /* NULL: this shard's entry in the list */
  const char *metrics_path; /* NULL: no metrics */
  int threads;
  int log_level;
  double log_interval;  /* seconds between progress lines and metrics */
  const char *ckpt_dir; /* NULL: no checkpoints */
  double ckpt_secs;
  int64_t ckpt_updates;  /* 0: not by count */
  int ckpt_keep;
  const char *status_addr; /* --status: the shards' addresses (comma-separated): print their
                            * Status and exit */
  int watch;                /* --watch: a table refreshed every watch_interval */
  double watch_interval;    /* seconds (0: not given, 1) */
  int watch_count;          /* --watch-count: stop after that many refreshes (0: not given) */
  int metrics_port;         /* the Prometheus endpoint's port (-1: none, 0: any) */
  const char *metrics_host; /* its address (NULL: the host of the listen address) */
  double resolve_s;         /* how long to wait for a listen address's name to resolve */
  ps_security_opts sec;    /* TLS, tokens, --insecure */
} ps_server_opts;

/* The bounds (seconds) of the pull-wait histogram ps_pull_wait_seconds. */
#define PS_WAIT_BUCKETS 12
extern const double ps_wait_bounds[PS_WAIT_BUCKETS];

struct ps_prom_server;

/* A pull that waits on the server (defined in sync.c). */
typedef struct ps_waiter ps_waiter;

/* Checkpoint sets (cut.c). */
typedef struct ps_cut ps_cut;

struct ps_rows_req;
typedef struct ps_rows_req ps_rows_req;

/* A push as the handler applies it (service.c), or as a cut holds it. */
typedef struct {
  rpc_call *call;
  int kind; /* the Push method's request-id kind */
  uint64_t worker, request_id, base_version, offset, count, step;
  const ps_segview *tensor;
  const ps_rows_req *rows; /* embedding rows (their gradients follow the dense ones), or NULL */
} ps_push_args;

/* service.c's methods, each bound to its server (the user pointer of the
 * method's RPC handler). */
typedef struct ps_method ps_method;
enum { PS_SERVICE_METHODS = 10 };
/* The Push method's index among them: its request ids' kind in the
 * membership table (a backup records a replicated push's answer so). */
enum { PS_METHOD_PUSH = 4, PS_METHOD_LEASE = 6 };
typedef struct {
  struct ps_server *sv;
  const ps_method *method;
} ps_method_binding;

typedef struct ps_server {
  ps_job job;
  char *job_text;
  ps_cluster cluster; /* with replicas: each shard's first replica in ps[] */
  int index;          /* the shard */
  /* Replicated shards (job replicas_per_shard R > 1): this server's place
   * in the full list (R per shard), and that list. */
  int replica, server_index;
  char (*replica_addrs)[PS_ADDR_LEN];
  ps_replica *repl; /* NULL when R is 1 */
  ps_shard *shard;
  /* this shard's part of each of the job's embedding tables */
  ps_table *tables[PS_MAX_TABLES];
  int n_tables;
  /* sync mode with tables: the step's rows summed (the shard's hooks) */
  struct ps_rows_sum *rows_sum;
  ps_membership *members;
  rpc_server *rpc;
  ps_security sec; /* TLS and the job's tokens */
  ps_method_binding methods[PS_SERVICE_METHODS];
  ps_metrics *metrics;
  double start_s;
  double log_interval_s;
  uv_loop_t loop;
  uv_timer_t sweep_timer, report_timer;
  uv_signal_t sigint, sigterm;
  /* pulls waiting (ssp, sync) and what they waited */
  pthread_mutex_t wait_mu;
  ps_waiter *waiters;
  int n_waiting;
  uint64_t waits;
  double wait_ms_total;
  uint64_t ssp_max_lead;
  uint64_t wait_hist[PS_WAIT_BUCKETS + 1]; /* finished waits by length (ps_wait_bounds) */
  int sync_started; /* sync: min_workers have registered once */
  /* sync, restored from a checkpoint of a job under way: steps resume once
   * min_workers have registered again, or at this time (ps_now_ms) with
   * whoever came back (0: not restored) */
  int64_t sync_resume_ms;
  /* data leases (shard 0, when the job has lease_chunk): made at the first
   * Lease request, which says how many examples the data set has */
  pthread_mutex_t lease_mu;
  ps_leases *leases;
  /* checkpoints */
  const char *ckpt_dir;
  double ckpt_secs;      /* write every this many seconds (0: not by time) */
  uint64_t ckpt_updates; /* ... or every this many updates (0: not by count) */
  int ckpt_keep;
  double ckpt_last_s;
  uint64_t ckpt_last_version;
  uv_timer_t ckpt_timer;
  uint64_t ckpt_restored_set; /* the set restored at start (0: none, or files written alone) */
  ps_cut *cut; /* checkpoint sets: with a checkpoint directory */
  /* the progress watchdog (ps_sync_watch): when the version last moved */
  uint64_t watch_version;
  double watch_since_s, watch_warned_s;
  /* the metrics endpoint, and what it reports besides the shard's stats */
  struct ps_prom_server *prom;
  atomic_uint_fast64_t ckpt_written, ckpt_failed; /* files this shard wrote, or failed to */
  atomic_int_fast64_t ckpt_last_ok_ms;            /* wall clock of the last one written */
  /* bytes on the wire: Push requests received, Pull answers sent (Status) */
  atomic_uint_fast64_t push_bytes, pull_bytes;
  atomic_int wire_range_warned; /* a pull sent a parameter beyond fp16's range as Inf */
  /* for rates in progress lines */
  uint64_t last_pushes, last_pulls;
  double last_report_s;
} ps_server;

/* ---------------- server.c ---------------- */

/* Runs a server from the options (o->job_path must be set) until SIGINT or
 * SIGTERM, then shuts it down in order (final progress line, RPC server
 * stopped, final checkpoint). Returns the process's exit code: 0 after a
 * clean stop; 2 for a bad cluster spec (--ps, --index, TF_CONFIG), job file
 * or metrics file; 1 when the shard, the checkpoint restore, the RPC server
 * or the final checkpoint failed (a message on stderr, or in the log for
 * the final checkpoint). A failure before the loop runs returns at once,
 * without freeing what was built: the process is meant to exit. Call it
 * once per process. */
int ps_server_run(const ps_server_opts *o);

/* ---------------- rows.c ---------------- */

/* The embedding rows a Pull or Push names, copied out of the request
 * (aligned) and checked: tables of the job, each once; ids of the table,
 * living on this shard, each once; at most PS_MAX_ROWS_PER_REQUEST. */
struct ps_rows_req {
  int n_sec;
  struct {
    int table;
    size_t n;
    uint64_t *ids;
    uint64_t *locals; /* each id's placement on this shard (ps_table_check_ids_order) */
    uint32_t *order;  /* the positions in the order the table visits their rows */
  } sec[PS_MAX_TABLES];
  size_t total;  /* ids over the sections */
  size_t values; /* floats over the sections (n * dim each) */
  uint64_t buf[]; /* the ids, then their placements, then the orders */
};

/* *out NULL when n is 0; PS_EINVAL / PS_ERANGE / PS_ENOMEM with a message. */
int ps_rows_from_msg(ps_server *sv, Ps__TableRows *const *secs, size_t n, ps_rows_req **out,
                     char *err);
ps_rows_req *ps_rows_dup(const ps_rows_req *r);
void ps_rows_free(ps_rows_req *r);
/* Answers a pull of the rows and (count > 0) the dense range at one
 * version; takes rows (freed). */
void ps_rows_serve_pull(ps_server *sv, rpc_call *call, size_t offset, size_t count,
                        ps_rows_req *rows);
/* sync mode: sets up the step's sum of rows (sv->rows_sum) and the
 * shard's hooks; nothing without tables. PS_ENOMEM. */
int ps_rows_sync_init(ps_server *sv);
/* sync mode: ps_shard_sync_add_rows with the push's rows (may be NULL)
 * decoded from tensor (the dense values, then the rows'). Nothing changes
 * on error. */
int ps_rows_sync_add(ps_server *sv, const ps_rows_req *rows, uint64_t worker,
                     uint64_t base_version, size_t offset, size_t count,
                     const ps_segview *tensor, int *dropped, int *have, char *err);
/* Applies a push's dense range (count values, may be 0) and its rows as
 * one update (ps_shard_push_ex); tensor holds the dense values then the
 * rows'. Nothing changes on error. */
int ps_rows_push(ps_server *sv, const ps_rows_req *rows, uint64_t base_version, size_t offset,
                 size_t count, const ps_segview *tensor, uint64_t *version, uint64_t *staleness,
                 char *err);
/* Status: every table's figures (store and ptrs: room for n_tables). */
void ps_rows_status(ps_server *sv, Ps__StatusResponse *resp, Ps__TableStatus *store,
                    Ps__TableStatus **ptrs);

/* ---------------- service.c ---------------- */

/* Registers the ParameterServer methods (Register, Heartbeat, Leave, Pull,
 * Push, Status, Lease) on rpc, answered against sv; call it before
 * rpc_server_start. A method rpc_server_add_method refuses (no memory) is
 * not reported: it stays unregistered and its calls are answered
 * UNIMPLEMENTED. */
void ps_service_register(ps_server *sv, rpc_server *rpc);

/* Answers a pull with the current snapshot of [offset, offset + count),
 * sent without a copy; in a job with a 16-bit "wire", encoded into a fresh
 * buffer (one copy, half the bytes), a parameter beyond the format's range
 * becoming Inf, which workers refuse (logged once). When the shard refuses the pull (a range outside
 * it, or no memory for a partial copy) the call is answered OUT_OF_RANGE
 * with the shard's message; no memory to encode the reply,
 * RESOURCE_EXHAUSTED. The call is answered in every case; the shard's
 * values are unchanged (a granted pull is counted). */
void ps_service_serve_pull(ps_server *sv, rpc_call *call, size_t offset, size_t count);
/* The snapshot's values in the job's 16-bit encoding, kept with it (NULL:
 * out of memory); a parameter beyond the format's range goes out as Inf,
 * which the shard says once. */
const uint16_t *ps_service_encode_snapshot(ps_server *sv, ps_snapshot *snap);
/* Sends a Pull's answer, counting its bytes (Status's pull_bytes). */
void ps_service_reply_pull(ps_server *sv, rpc_call *call, rpc_msg *out);

/* Applies a push (async, ssp: to the shard; sync: to the step's sum) and
 * answers it, keeping the answer under its request id; a refused push is
 * answered with the cause and its id forgotten. Used by the Push handler
 * and for the pushes a checkpoint cut held. */
void ps_service_apply_push(ps_server *sv, const ps_push_args *a);

/* Answers a call with a small message (RESOURCE_EXHAUSTED when it cannot
 * be encoded). */
void ps_service_reply(rpc_call *call, const ProtobufCMessage *m);

/* Shard 0's Lease call on its table, at time now (a replicated shard 0's
 * backups replay it with the primary's): makes the table at the first call
 * (dataset_size), counts a completed lease, grants the next; resp gets the
 * answer. RPC_OK, or the status to fail the call with and a message in
 * err (PS_ERRLEN). quiet: no log lines or metrics (a backup's replay). */
struct Ps__LeaseResponse;
int ps_service_lease_step(ps_server *sv, uint64_t wid, uint64_t dataset_size,
                          uint64_t complete_lease, int want_next, int64_t now,
                          struct Ps__LeaseResponse *resp, int quiet, char *err);
/* A push as the shard takes it: applied (async, ssp) or added to the
 * current step (sync), the worker's round and push counted; resp gets the
 * answer. rows: the push's embedding rows (their gradients follow the
 * dense ones in tensor), or NULL. 0, or the shard's error code with a
 * message (nothing changed). Shared by a replicated shard's primary and its backups' replay. */
struct Ps__PushResponse;
int ps_service_push_step(ps_server *sv, uint64_t worker, uint64_t request_id,
                         uint64_t base_version, uint64_t offset, uint64_t count, uint64_t step,
                         const ps_segview *tensor, const ps_rows_req *rows,
                         struct Ps__PushResponse *resp, char *err);
/* A worker registering again names chunks shard 0 acknowledged as done:
 * those the table lacks are counted as redone. */
void ps_service_note_redone(ps_server *sv, uint64_t worker, const uint64_t *done, size_t n);

/* Gives the data leases a departed worker held back to the pool (logs how
 * many). Nothing happens when the shard has no lease table or the worker
 * held none. */
void ps_service_release_leases(ps_server *sv, uint64_t worker);

/* ---------------- sync.c ---------------- */

/* What ps_waits_add did with a pull (besides PS_ENOTFOUND and PS_ENOMEM). */
enum {
  PS_PULL_NOW = 0,   /* it may be answered now: the caller serves it */
  PS_PULL_WAITS = 1, /* it waits in the list; ps_waits_recheck answers it */
  PS_PULL_LOST = 2,  /* sync: the step it waits for lacks the worker's round (lost) */
};

/* Decides, under wait_mu, whether the worker's pull may be answered now
 * (async: always; ssp: the worker is at most ssp_k steps ahead of the
 * slowest; sync: the shard's version has reached min_version) and queues it
 * to wait otherwise (the call then belongs to the list, with a deadline of
 * wait_timeout_ms). The worker's pulls still waiting (a client has one out
 * per shard: those were given up) are answered CANCELLED. push_round: the
 * worker's last push round this shard answered, as it says (sync: a pull
 * for the next step when the shard has not taken that round, because it
 * restarted from a checkpoint written before it, would wait forever: it
 * gets PS_PULL_LOST, and the worker pushes the round again). Returns
 * PS_PULL_NOW, PS_PULL_WAITS or PS_PULL_LOST; PS_ENOTFOUND when the worker is not
 * registered, PS_ERANGE when twice the job's max_workers pulls wait already, PS_ENOMEM when the waiter cannot be allocated: in
 * those cases nothing is queued and the caller answers the call. rows (may
 * be NULL): the pull's embedding rows, which the waiter owns once it
 * returns PS_PULL_WAITS (the caller keeps them otherwise). */
int ps_waits_add(ps_server *sv, rpc_call *call, uint64_t worker, uint64_t min_version,
                 uint64_t push_round, size_t offset, size_t count, ps_rows_req *rows);

/* Answers the waiting pulls that may go now, fails those past their
 * deadline (ABORTED) or whose worker is gone (NOT_FOUND). Called after
 * anything that can release a pull (an update, a worker leaving or timed
 * out) and by the sweep timer. Never fails. */
void ps_waits_recheck(ps_server *sv);

/* Fails every waiting pull at once with status and "shard N: why" (a sync
 * step that can never be applied). Never fails. */
void ps_waits_fail_all(ps_server *sv, int status, const char *why);

/* Seconds without an update, while workers train, before a shard says
 * what it waits for. */
#define PS_SERVER_STALL_S 30

/* The progress watchdog, on the loop's sweep timer: when the shard's
 * version has not moved for PS_SERVER_STALL_S while workers train, logs
 * (once per period) what it waits for: a sync step's missing gradients,
 * pulls held for the slowest ssp worker, or no pushes at all. */
void ps_sync_watch(ps_server *sv);

/* Frees the waiters still in the list without answering them: at shutdown,
 * after rpc_server_shutdown has cancelled their calls. */
void ps_waits_free(ps_server *sv);

/* sync: applies the current step if enough gradients are in (the quorum:
 * live workers - backup_workers, once min_workers have registered);
 * releases the pulls waiting for it. A failure to apply is logged and
 * leaves the step pending. */
void ps_sync_try_step(ps_server *sv);

/* ---------------- server_ckpt.c ---------------- */

/* Removes this shard's temporary checkpoint files that a process killed
 * while writing left in sv->ckpt_dir, then restores the shard from the
 * newest valid checkpoints of the job there (whatever number of shards
 * wrote them), and shard 0's data leases with them. 0 also when there is none (a fresh start); an error
 * code with a message in err (PS_ERRLEN bytes) when there are some but none
 * is usable, or no memory: the shard then keeps its initial parameters
 * (but for a lease state that cannot be read, where the parameters are
 * already restored). */
int ps_server_ckpt_restore(ps_server *sv, char *err);

/* Writes a checkpoint of the shard now, on the calling thread, keeping the
 * newest ckpt_keep. Returns 0, or an error code (logged); the shard is
 * unchanged either way. */
int ps_server_ckpt_write_now(ps_server *sv);

/* The checkpoint timer's callback (t->data is the server), every second:
 * on shard 0, when a checkpoint is due (by time or by updates), it starts
 * a set across all shards (cut.c). Failures are logged. */
void ps_server_ckpt_on_timer(uv_timer_t *t);

/* The copy of the shard's state a checkpoint writes (and shard 0's data
 * leases), taken now; free it with ps_server_ckpt_state_free. PS_ENOMEM. */
int ps_server_ckpt_capture(ps_server *sv, ps_ckpt *ck);
void ps_server_ckpt_state_free(ps_ckpt *ck);

/* ---------------- cut.c ---------------- */

/* Complete sets shard 0 remembers (the most --keep-checkpoints can keep). */
#define PS_CUT_MAX_KEEP 64
/* A shard held this long by a set that does not come goes on without it. */
#define PS_CUT_HOLD_S 5.0
/* Deadlines of shard 0's calls: PREPARE and ABORT; CUT (the file written). */
#define PS_CUT_CALL_MS 5000
#define PS_CUT_WRITE_MS 120000

/* Sets up checkpoint sets (after the loop is initialized); restored_set is
 * the set the shard was restored from (0: none). PS_ENOMEM. */
int ps_cut_init(ps_server *sv, uint64_t restored_set);
/* The gate of an async or ssp push, before it is applied: 0, apply it now
 * and call ps_cut_leave after; 1, held by a cut (it is applied and
 * answered when the cut is taken); PS_ENOMEM (not held: the caller
 * answers). Without sets: 0. */
int ps_cut_push_enter(ps_server *sv, const ps_push_args *a);
/* The gate of a sync step: 0, apply it and call ps_cut_leave after; 1,
 * held (the step is tried again when the cut is taken). */
int ps_cut_step_enter(ps_server *sv);
void ps_cut_leave(ps_server *sv);
/* The Checkpoint RPC (request: a Ps__CheckpointRequest). */
void ps_cut_handle(ps_server *sv, rpc_call *call, const void *request);
/* On the sweep timer: a cut met by workers leaving is taken; a shard held
 * longer than PS_CUT_HOLD_S goes on. */
void ps_cut_watch(ps_server *sv);
/* Shard 0, on the checkpoint timer: starts a set on the work queue unless
 * one is under way. 1 when started. */
int ps_cut_coordinate(ps_server *sv);
/* Shard 0's replica that became the primary: a set at once (any thread),
 * whose PREPARE gives up a set the old primary left held on the shards
 * (ps_server_ckpt_on_timer starts it at its next tick); kicked says
 * whether one is due, and clears it. */
void ps_cut_kick(ps_server *sv);
int ps_cut_kicked(ps_server *sv);
/* After a restore: the workers' push rounds in the restored cut record
 * (async, ssp) go to the membership table, so that a worker that registers
 * again and resends a round the checkpoint holds is answered without it
 * being applied again. PS_EINVAL for a malformed record, PS_ENOMEM. */
int ps_cut_seed_rounds(ps_server *sv, const void *record, size_t len);
/* The cut record of this shard's state now, for a file written alone. */
int ps_cut_record_now(ps_server *sv, void **out, size_t *len);
/* The newest set this shard wrote, and its version there (0 0: none). */
void ps_cut_set_info(ps_server *sv, uint64_t *set, uint64_t *version);
/* Shutdown, with the loop stopped: drain first runs the loop (the RPC
 * server still up) until a set under way is over, at most max_s seconds,
 * and starts no new one; close (after the RPC server is down) forgets the
 * held calls and closes the loop's handle; free releases the rest after
 * the last uv_run. */
void ps_cut_drain(ps_server *sv, double max_s);
void ps_cut_close(ps_server *sv);
void ps_cut_free(ps_server *sv);

/* ---------------- server_prom.c ---------------- */

/* Starts the Prometheus endpoint when o->metrics_port >= 0: on
 * o->metrics_host, else the host of the listen address (addr), behind the
 * job's and the read-only token, over HTTPS with the server's certificate
 * when it has one. 0 (nothing to start, or started and logged), or 2 with
 * a message on stderr. */
int ps_server_prom_start(ps_server *sv, const ps_server_opts *o, const char *addr);
/* Stops it (before the shard is freed). */
void ps_server_prom_stop(ps_server *sv);
/* A checkpoint file this shard wrote (rc 0) or failed to write. */
void ps_server_note_ckpt(ps_server *sv, int rc);
/* A pull that waited ms milliseconds, counted under wait_mu. */
void ps_server_note_wait(ps_server *sv, int64_t ms);

/* ---------------- fd_guard.c ---------------- */

/* Raises the soft descriptor limit to the hard one and keeps a spare
 * descriptor, so that a server out of descriptors sheds connections and
 * goes on accepting (see fd_guard.c). 0, or PS_EIO when no spare can be
 * opened. */
int ps_fd_guard_init(void);
/* Connections closed so far for want of descriptors. */
uint64_t ps_fd_guard_shed(void);

/* ---------------- status_cli.c ---------------- */

/* Asks the shards at list (addresses, comma-separated, as --ps takes them)
 * for their Status, all at once, and prints it on stdout as JSON: for one
 * address its object, for several an array of them in the list's order
 * ({"address", "error"} in place of a shard that did not answer). Returns
 * the process's exit code: 0; 1 with a message on stderr when a shard did
 * not answer within timeout_ms, answered an error status or a malformed
 * reply; 2 for a bad list or security flag. */
int ps_status_print(const char *list, const ps_security_opts *sec, int timeout_ms);

/* --status LIST --watch: every interval_s, a table of the shards (version,
 * pushes and pulls per second between two refreshes, staleness, workers,
 * waiting pulls, checkpoint set, uptime; the address and the error for one
 * that does not answer) and of the workers shard 0 lists. At a terminal each
 * refresh clears the screen and fits it; elsewhere each is a block of lines
 * ending with a blank line. Stops on SIGINT or SIGTERM, or after count
 * refreshes (count > 0); returns 0 then, 2 for a bad list or security flag,
 * 1 when the client cannot be set up. Leaves SIGINT and SIGTERM blocked:
 * the process exits after it. */
int ps_status_watch(const char *list, const ps_security_opts *sec, double interval_s, int count);

#endif

/* The state of one ps-server process that its parts share (ps_server):
 * the job, the shard and its tables, the workers, shard 0's data leases,
 * the pulls waiting, the checkpoint and replication state, and the hooks
 * through which the lower parts (replication, checkpoint cuts) ask the
 * server for what only its upper parts can do.
 *
 * The parts, top to bottom (docs/ARCHITECTURE.md draws them; each folder's
 * README says what it owns): ps/main (the process: options, build,
 * timers, signals, metrics endpoint) > ps/rpc (the RPC handlers, pulls
 * that wait, the sync step) > ps/ckpt (checkpoint sets and files) >
 * ps/repl (replicated shards) > ps/core (this struct, updates and their
 * one apply function, embedding rows of a request) > ps/state (the
 * shard, tables, workers, leases). A part calls only parts below it.
 *
 * Threads: gRPC's completion queue is served by a pool of threads (the
 * handlers of ps/rpc run there, against the thread-safe shard and
 * membership); the main thread runs a libuv loop that owns the timers
 * (dropping silent workers, progress lines and metrics, checkpoints) and
 * the signals (SIGINT/SIGTERM stop the server cleanly). */
#ifndef PS_PS_CORE_SERVER_H_
#define PS_PS_CORE_SERVER_H_

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
#include "proto/ps.pb-c.h"
#include "ps/core/update.h"
#include "ps/state/leases.h"
#include "ps/state/membership.h"
#include "ps/state/shard.h"
#include "ps/state/table.h"

/* The bounds (seconds) of the pull-wait histogram ps_pull_wait_seconds. */
#define PS_WAIT_BUCKETS 12
extern const double ps_wait_bounds[PS_WAIT_BUCKETS];

struct ps_prom_server;
struct ps_server;

/* A pull that waits on the server (ps/rpc/sync.c). */
typedef struct ps_waiter ps_waiter;

/* Replicated shards (ps/repl/replica.c). */
typedef struct ps_replica ps_replica;

/* Checkpoint sets (ps/ckpt/cut.c). */
typedef struct ps_cut ps_cut;

/* The embedding rows a request names (ps/core/rows.h). */
typedef struct ps_rows_req ps_rows_req;

/* The RPC methods (ps/rpc/service.c), each bound to its server (the user
 * pointer of the method's RPC handler). */
typedef struct ps_method ps_method;
enum { PS_SERVICE_METHODS = 10 };
/* The Push and Lease methods' indexes among them: their request ids' kinds
 * in the membership table (a backup records a replicated push's answer
 * so). */
enum { PS_METHOD_PUSH = 4, PS_METHOD_LEASE = 6 };
typedef struct {
  struct ps_server *sv;
  const ps_method *method;
} ps_method_binding;

/* What the lower parts ask of the upper ones, set at start by the server
 * (ps/main/server.c): replication and checkpoint cuts reach the RPC layer
 * through these alone, never by calling it. */
typedef struct {
  /* Applies a push a checkpoint cut held, and answers its call. */
  void (*apply_push)(struct ps_server *sv, const ps_push_args *a);
  /* sync: applies the current step if enough gradients are in (a cut let
   * the updates it held go on). */
  void (*sync_step)(struct ps_server *sv);
  /* This replica just became its shard's primary: a step that may be
   * complete, pulls that may go, and (shard 0) a checkpoint set at once. */
  void (*became_primary)(struct ps_server *sv);
} ps_server_hooks;

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
  ps_server_hooks hooks; /* set by ps/main/server.c before anything runs */
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
  /* The version this run began at (a restored checkpoint's, else 0):
   * registrations say it, and a sync job's steps count from it. */
  uint64_t start_version;
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

#endif

/* A flat C API over the worker's client (ps_client.h) for callers through
 * a foreign-function interface: Python's ctypes in python/psclient, which
 * ships it as libpsclient.so (CMake target ps_client_shared).
 *
 * Plain C types only: an opaque handle, integers, pointers to caller
 * buffers; no struct crosses the boundary by value. Every function that
 * can fail returns 0 or a negative PS_E* code (common/util.h) and leaves a
 * message for the calling thread, read with ps_capi_last_error(); the
 * servers' own messages (a refused push, a wrong token) are in it, after
 * the gRPC status name.
 *
 * Threads: pull, push and set_rows are called from one thread (the
 * training loop); lease and heartbeat may be called from any thread at
 * the same time (ps_client's rules). The handle runs its own heartbeat
 * thread when asked to at connect.
 *
 * Buffers: a pull writes the caller's params (P floats) straight from
 * gRPC's slices; a push sends the caller's gradient without a copy, and
 * the client may send it again later (a retry of the round, or a sync
 * pull that finds a shard lacking it): the caller keeps it unchanged until
 * its next push (see ps_client_push_end). Row buffers likewise live until
 * the next ps_capi_set_rows. */
#ifndef PS_WORKER_PS_CAPI_H
#define PS_WORKER_PS_CAPI_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define PS_CAPI __attribute__((visibility("default")))
#else
#define PS_CAPI
#endif

/* Bumped when a signature below changes: the binding checks it. */
#define PS_CAPI_VERSION 1
/* Most dimensions ps_capi_tensor reports. */
#define PS_CAPI_MAX_DIMS 6

typedef struct ps_capi_worker ps_capi_worker;

PS_CAPI int ps_capi_version(void);
/* The calling thread's message of its last failed call ("" if none). */
PS_CAPI const char *ps_capi_last_error(void);
/* The name of a PS_E* code ("unavailable", ...). */
PS_CAPI const char *ps_capi_strerror(int code);
/* The client's log level on stderr: 0 debug, 1 info, 2 warn, 3 error. */
PS_CAPI void ps_capi_set_log_level(int level);

/* Registers a worker with the cluster, as ps-worker does: servers is the
 * --ps list ("host:port[,host:port...]": the first is contacted, the
 * others are asked for Status), or NULL/"" for TF_CONFIG's (its task
 * type, worker, chief or evaluator, is the role and its index the task
 * index unless given). token_file NULL: $PS_TOKEN_FILE. tls_ca: talk TLS
 * (with tls_cert and tls_key: mutual TLS); insecure: plaintext allowed.
 * role NULL: TF_CONFIG's, else "worker". task_index -1: unknown.
 * timeout_ms: each call's deadline (<= 0: 30000); connect_timeout_ms: how
 * long the first registration waits for the servers (<= 0: 60000).
 * heartbeat: run a thread that heartbeats every third of the job's
 * heartbeat_timeout_ms (naming the leases held). The client then speaks
 * the job's wire encoding, waits as its mode says (ssp and sync: pulls
 * may be held up to wait_timeout_ms longer) and pushes batchnorm
 * statistics as ps-worker does. *out: the handle (NULL on failure). */
PS_CAPI int ps_capi_connect(const char *servers, const char *token_file, const char *tls_ca,
                            const char *tls_cert, const char *tls_key, int insecure,
                            const char *host, const char *role, int task_index, int timeout_ms,
                            int connect_timeout_ms, int heartbeat, ps_capi_worker **out);
/* Stops the heartbeat thread, leaves every shard when leave is set (best
 * effort), frees the handle (NULL: nothing). */
PS_CAPI void ps_capi_close(ps_capi_worker *w, int leave);

/* What shard 0 said at registration. job_json is valid until close. */
PS_CAPI const char *ps_capi_job_json(const ps_capi_worker *w);
PS_CAPI uint64_t ps_capi_param_count(const ps_capi_worker *w);
PS_CAPI int ps_capi_num_shards(const ps_capi_worker *w);
PS_CAPI uint64_t ps_capi_worker_id(const ps_capi_worker *w);
PS_CAPI int ps_capi_rank(const ps_capi_worker *w);
/* The version shard 0's run began at (0, or a restored checkpoint's): a
 * sync job's steps count from it. */
PS_CAPI uint64_t ps_capi_start_version(const ps_capi_worker *w);
/* PS_MODE_ASYNC 0, PS_MODE_SSP 1, PS_MODE_SYNC 2 (common/job.h). */
PS_CAPI int ps_capi_mode(const ps_capi_worker *w);
/* The model in one line (ps_model_spec_describe) into buf (cap bytes). */
PS_CAPI void ps_capi_describe(const ps_capi_worker *w, char *buf, size_t cap);
/* Shard s's range [*off, *off + *count). PS_ERANGE for no such shard. */
PS_CAPI int ps_capi_shard_range(const ps_capi_worker *w, int s, uint64_t *off, uint64_t *count);

/* The named ranges of the flat vector, in layout order: a layered
 * model's tensors as ps-export names its .npy files ("<layer>.w" with
 * conv2d (OC, IC, KH, KW) and dense (OUT, IN), "<layer>.b", batchnorm's
 * "<layer>.gamma", ".beta", ".moving_mean", ".moving_variance"), or a
 * flat model's "tensors". Tensor i's name into name (cap bytes), its
 * range, and its shape (*ndim values into shape, PS_CAPI_MAX_DIMS room).
 * PS_ERANGE for no such tensor. */
PS_CAPI int ps_capi_num_tensors(const ps_capi_worker *w);
PS_CAPI int ps_capi_tensor(const ps_capi_worker *w, int i, char *name, size_t cap, uint64_t *off,
                           uint64_t *count, int *ndim, int64_t *shape);

/* Pulls every shard's range into params (n must be P) and keeps the
 * shards' versions for the next push. wait (sync mode): the pull waits
 * until each shard applied the step this worker pushed to last (the
 * shards hold ssp pulls by themselves). On error params may hold a mix of
 * old and new ranges. PS_EUNAVAIL and PS_ETIMEDOUT: try again. */
PS_CAPI int ps_capi_pull(ps_capi_worker *w, float *params, uint64_t n, int wait);
/* The versions of the last pull, one per shard, into out (room for n). */
PS_CAPI int ps_capi_versions(const ps_capi_worker *w, uint64_t *out, int n);

/* Pushes grads (n must be P) to every shard with the versions of the last
 * pull, as a new round with a new request id; the step counter moves on.
 * Outputs (each may be NULL): staleness summed and max over the shards,
 * shards that dropped it (sync: late). On error the shards that applied
 * it are done and the others pending: ps_capi_push_retry sends the same
 * round (its request id and bytes) to those only, so no shard applies a
 * gradient twice; a new ps_capi_push gives the pending shards up. While
 * the worker holds exactly one lease (a loop over leases), the round's
 * batch_size examples are counted against it on shard 0, so that what a
 * worker that leaves or dies trained of a chunk is in the lease records. */
PS_CAPI int ps_capi_push(ps_capi_worker *w, const float *grads, uint64_t n, int batch_size,
                         uint64_t *staleness_sum, uint64_t *staleness_max, int *dropped);
PS_CAPI int ps_capi_push_retry(ps_capi_worker *w, const float *grads, uint64_t n,
                               uint64_t *staleness_sum, uint64_t *staleness_max, int *dropped);
/* Shards of the last round not done yet. */
PS_CAPI int ps_capi_push_pending(const ps_capi_worker *w);
/* Rounds pushed (the step the heartbeats report). */
PS_CAPI uint64_t ps_capi_step(const ps_capi_worker *w);

/* The job's embedding tables: table t's name (cap bytes), rows (0:
 * unbounded) and dim. PS_ERANGE for no such table. */
PS_CAPI int ps_capi_num_tables(const ps_capi_worker *w);
PS_CAPI int ps_capi_table(const ps_capi_worker *w, int t, char *name, size_t cap, uint64_t *rows,
                          int *dim);
/* The embedding rows the next pulls and pushes carry (ps_client_set_rows):
 * n_sec sections, section i with table tables[i], counts[i] distinct
 * ids[i], values[i] (counts[i] * dim floats, written by a pull) and
 * grads[i] (read by a push). n_sec 0: none. */
PS_CAPI int ps_capi_set_rows(ps_capi_worker *w, int n_sec, const int *tables,
                             const uint64_t *const *ids, const uint64_t *counts,
                             float *const *values, const float *const *grads);

/* Data leases from shard 0 (ps_client_lease_call): reports lease
 * complete_id done (0: none) and/or asks for the next chunk of a data set
 * of dataset_size examples. *status: 0 granted (*lease_id, *epoch,
 * *begin, *count), 1 wait and ask again (every chunk left is leased to
 * others), 2 no more data. *counted: the completion was counted. The
 * heartbeats name the leases held (granted, not reported done). */
PS_CAPI int ps_capi_lease(ps_capi_worker *w, uint64_t complete_id, int want_next,
                          uint64_t dataset_size, int *status, uint64_t *lease_id, int *epoch,
                          uint64_t *begin, uint32_t *count, int *counted);
/* The worker waits for data (not counted in sync steps and ssp clocks):
 * said to the shards at once, and in every heartbeat until cleared. */
PS_CAPI void ps_capi_set_idle(ps_capi_worker *w, int idle);
/* One heartbeat to every shard now (the thread's are the same). */
PS_CAPI int ps_capi_heartbeat(ps_capi_worker *w);

/* Every server's Status (the list the worker was given; or servers with
 * the same security arguments as connect) as a JSON array, one object per
 * address: the StatusResponse's fields by their proto names, or
 * {"address", "error"} for a server that did not answer. *json_out is
 * malloc'd: free it with ps_capi_free. */
PS_CAPI int ps_capi_worker_status(ps_capi_worker *w, int timeout_ms, char **json_out);
PS_CAPI int ps_capi_status(const char *servers, const char *token_file, const char *tls_ca,
                           const char *tls_cert, const char *tls_key, int insecure, int timeout_ms,
                           char **json_out);
PS_CAPI void ps_capi_free(void *p);

#endif

/* ps-server's life: builds the parts from the options (cluster spec, job,
 * shard, membership, metrics, checkpoint restore, RPC server and its
 * methods), runs the libuv loop on the main thread (the timers that drop
 * silent workers, print progress lines and metrics, and write checkpoints;
 * SIGINT/SIGTERM stop it) and shuts down in order. */
#include "ps/main/server_run.h"

#include "ps/ckpt/cut.h"
#include "ps/ckpt/server_ckpt.h"
#include "ps/core/rows.h"
#include "ps/core/update.h"
#include "ps/repl/replica.h"
#include "ps/rpc/service.h"
#include "ps/rpc/sync.h"
#include "ps/state/table_sync.h"

#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proto/ps.pb-c.h"

/* ---------------- the loop (main thread) ---------------- */

/* Drops the workers silent for longer than the job allows. A replicated
 * shard's primary does it and logs each drop for its backups (under the
 * ordering lock, so that a drop and a registration of the same worker
 * reach the backups in the order they happened here); a backup leaves it
 * to the primary. The number dropped (their ids in dropped). */
static int sweep_workers(ps_server *sv, uint64_t *dropped, int max) {
  if (ps_replica_lock(sv) != 0) return 0;
  int64_t now = ps_now_ms();
  char err[PS_ERRLEN];
  int n = ps_membership_sweep(sv->members, now, sv->job.heartbeat_timeout_ms, dropped, max);
  for (int i = 0; i < n && i < max; i++) {
    PS_WARN("worker %016" PRIx64 " silent for more than %d ms: dropped; %d live", dropped[i],
            sv->job.heartbeat_timeout_ms, ps_membership_count(sv->members));
    /* Gone from the table already: the update gives its leases back, and
     * is what the backups apply. */
    ps_update u = {.kind = PS_UPDATE_LEAVE, .worker = dropped[i]};
    ps_update_result res = {0};
    ps_update_apply(sv, &u, 0, &res, err);
    if (sv->repl && ps_replica_append(sv, &u, NULL, NULL, 0, 0) != PS_OK)
      ps_replica_diverged(sv);
  }
  pthread_mutex_lock(&sv->lease_mu);
  const int leasing = sv->leases != NULL;
  pthread_mutex_unlock(&sv->lease_mu);
  if (leasing) {
    ps_update u = {.kind = PS_UPDATE_LEASE_EXPIRE,
                   .now_ms = now,
                   .timeout_ms = 2 * (int64_t)sv->job.heartbeat_timeout_ms};
    ps_update_result res = {0};
    ps_update_apply(sv, &u, 0, &res, err);
    if (res.changed > 0) {
      PS_WARN("leases: %d chunk(s) not renewed in time: back in the pool", res.changed);
      if (sv->repl && ps_replica_append(sv, &u, NULL, NULL, 0, 0) != PS_OK)
        ps_replica_diverged(sv);
    }
  }
  ps_replica_unlock(sv);
  return n;
}

static void on_sweep(uv_timer_t *t) {
  ps_server *sv = t->data;
  uint64_t dropped[64];
  int n = sweep_workers(sv, dropped, 64);
  if (sv->job.mode_kind == PS_MODE_SYNC) {
    /* (Also a restored shard's steps, resuming after a heartbeat timeout.) */
    pthread_mutex_lock(&sv->wait_mu);
    int waiting_start = !sv->sync_started;
    pthread_mutex_unlock(&sv->wait_mu);
    if (n > 0 || waiting_start) ps_sync_try_step(sv);
  }
  ps_waits_recheck(sv); /* deadlines, and pulls the dropped workers held back */
  ps_sync_watch(sv);    /* a shard that makes no progress says what it waits for */
  ps_cut_watch(sv);     /* a checkpoint set that cannot be met does not hold the shard */
}

static void on_report(uv_timer_t *t) {
  ps_server *sv = t->data;
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  double now = ps_now_s(), dt = now - sv->last_report_s;
  if (dt <= 0) dt = 1e-9;
  double push_rate = (double)(st.pushes - sv->last_pushes) / dt;
  double pull_rate = (double)(st.pulls - sv->last_pulls) / dt;
  int live = ps_membership_count(sv->members);
  if (st.pushes != sv->last_pushes || st.pulls != sv->last_pulls)
    PS_INFO("version %" PRIu64 " | %.1f pushes/s %.1f pulls/s | staleness mean %.2f max %" PRIu64
            " | %d workers | %" PRIu64 " refused | %" PRIu64 " dropped | %.1f ms/step",
            st.version, push_rate, pull_rate, st.staleness_mean, st.staleness_max, live,
            st.rejected, st.dropped, st.step_time_ms);
  if (sv->metrics) {
    json_t *rec = json_object();
    json_object_set_new(rec, "shard", json_integer(sv->index));
    json_object_set_new(rec, "version", json_integer((json_int_t)st.version));
    json_object_set_new(rec, "pushes", json_integer((json_int_t)st.pushes));
    json_object_set_new(rec, "pulls", json_integer((json_int_t)st.pulls));
    json_object_set_new(rec, "rejected", json_integer((json_int_t)st.rejected));
    json_object_set_new(rec, "pushes_per_sec", json_real(push_rate));
    json_object_set_new(rec, "staleness_mean", json_real(st.staleness_mean));
    json_object_set_new(rec, "staleness_max", json_integer((json_int_t)st.staleness_max));
    json_t *hist = json_array();
    int last = PS_STALENESS_BUCKETS - 1;
    while (last > 0 && st.staleness_hist[last] == 0) last--;
    for (int i = 0; i <= last; i++)
      json_array_append_new(hist, json_integer((json_int_t)st.staleness_hist[i]));
    json_object_set_new(rec, "staleness_hist", hist);
    json_object_set_new(rec, "workers", json_integer(live));
    json_object_set_new(rec, "dropped", json_integer((json_int_t)st.dropped));
    json_object_set_new(rec, "sync_short_steps", json_integer((json_int_t)st.sync_short_steps));
    json_object_set_new(rec, "step_time_ms", json_real(st.step_time_ms));
    pthread_mutex_lock(&sv->wait_mu);
    uint64_t done = sv->waits - (uint64_t)sv->n_waiting;
    json_object_set_new(rec, "waits", json_integer((json_int_t)sv->waits));
    json_object_set_new(rec, "wait_ms_mean",
                        json_real(done ? sv->wait_ms_total / (double)done : 0));
    json_object_set_new(rec, "ssp_max_lead", json_integer((json_int_t)sv->ssp_max_lead));
    pthread_mutex_unlock(&sv->wait_mu);
    ps_metrics_write(sv->metrics, rec);
    json_decref(rec);
  }
  sv->last_pushes = st.pushes;
  sv->last_pulls = st.pulls;
  sv->last_report_s = now;
}

static void on_signal(uv_signal_t *s, int signum) {
  ps_server *sv = s->data;
  PS_INFO("%s: stopping", signum == SIGINT ? "SIGINT" : "SIGTERM");
  uv_stop(&sv->loop);
}

/* ---------------- start and stop ---------------- */

/* Where this shard is in the cluster: from --ps and --index, or from
 * TF_CONFIG. Returns 0, or the exit code 2 with a message on stderr. */
static int resolve_cluster(ps_server *sv, const ps_server_opts *o) {
  char err[PS_ERRLEN];
  int index = o->index;
  if (o->ps_list) {
    if (ps_cluster_parse_ps_list(o->ps_list, &sv->cluster, err) != 0) {
      fprintf(stderr, "ps-server: --ps: %s\n", err);
      return 2;
    }
    if (index < 0) {
      fprintf(stderr, "ps-server: --index is required with --ps\n");
      return 2;
    }
  } else if (getenv("TF_CONFIG")) {
    if (ps_cluster_from_tf_config(getenv("TF_CONFIG"), &sv->cluster, err) != 0) {
      fprintf(stderr, "ps-server: TF_CONFIG: %s\n", err);
      return 2;
    }
    if (strcmp(sv->cluster.task_type, "ps") != 0) {
      fprintf(stderr, "ps-server: TF_CONFIG names task type '%s'; ps-server runs task type 'ps'\n",
              sv->cluster.task_type);
      return 2;
    }
    if (index < 0) index = sv->cluster.task_index;
  } else {
    fprintf(stderr, "ps-server: give --ps LIST --index N, or set TF_CONFIG (see --help)\n");
    return 2;
  }
  if (index >= sv->cluster.n_ps) {
    fprintf(stderr, "ps-server: index %d is outside the %d shards given\n", index,
            sv->cluster.n_ps);
    return 2;
  }
  sv->index = index;
  return 0;
}

/* Replicated shards: the server list holds R servers per shard, shard s's
 * replicas at s*R .. s*R+R-1; this server is replica index % R of shard
 * index / R. Keeps the full list and leaves each shard's first replica in
 * sv->cluster (whose n_ps then counts shards). 0, or 2 with a message. */
static int replica_layout(ps_server *sv, const ps_server_opts *o) {
  int R = sv->job.replicas_per_shard, n = sv->cluster.n_ps;
  sv->server_index = sv->index;
  if (R <= 1) return 0;
  if (n % R != 0) {
    fprintf(stderr,
            "ps-server: the job has replicas_per_shard %d, so the server list must hold %d "
            "addresses per shard (shard s's replicas at s*%d .. s*%d+%d); it holds %d\n",
            R, R, R, R, R - 1, n);
    return 2;
  }
  if (!o->ckpt_dir) {
    fprintf(stderr, "ps-server: replicas_per_shard %d needs --checkpoint-dir: each server keeps "
                    "its votes there (fsynced), which replication's safety rests on\n", R);
    return 2;
  }
  sv->replica_addrs = calloc((size_t)n, sizeof *sv->replica_addrs);
  if (!sv->replica_addrs) {
    fprintf(stderr, "ps-server: out of memory\n");
    return 1;
  }
  memcpy(sv->replica_addrs, sv->cluster.ps, (size_t)n * sizeof *sv->replica_addrs);
  sv->replica = sv->index % R;
  sv->index = sv->index / R;
  sv->cluster.n_ps = n / R;
  for (int s = 0; s < n / R; s++) memcpy(sv->cluster.ps[s], sv->replica_addrs[s * R], PS_ADDR_LEN);
  char prog[32];
  snprintf(prog, sizeof prog, "ps-server[%d.%d]", sv->index, sv->replica);
  ps_log_init(prog, o->log_level);
  return 0;
}

/* Loads the job and builds the shard, the membership table and the metrics
 * file, then restores the checkpoints. Returns 0, or the exit code (2: job
 * or metrics file, 1: shard or checkpoints) with a message on stderr. */
static int build_shard(ps_server *sv, const ps_server_opts *o) {
  char err[PS_ERRLEN];
  char prog[32];
  snprintf(prog, sizeof prog, "ps-server[%d]", sv->index);
  ps_log_init(prog, o->log_level);

  if (ps_job_load(o->job_path, &sv->job, &sv->job_text, err) != 0) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 2;
  }
  int rc = replica_layout(sv, o);
  if (rc != 0) return rc;
  sv->shard = ps_shard_create(&sv->job, sv->index, sv->cluster.n_ps, err);
  if (!sv->shard) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  for (int t = 0; t < sv->job.n_tables; t++) {
    sv->tables[t] = ps_table_create(&sv->job.tables[t], &sv->job.table_optim[t], sv->job.seed,
                                    sv->index, sv->cluster.n_ps, err);
    if (!sv->tables[t]) {
      fprintf(stderr, "ps-server: %s\n", err);
      return 1;
    }
    sv->n_tables = t + 1;
    const ps_table_spec *ts = &sv->job.tables[t];
    if (ts->rows)
      PS_INFO("table '%s': rows of %d values placed on shard %d of %d: %" PRIu64 " of %" PRIu64
              ", optimizer %s lr %g",
              ts->name, ts->dim, sv->index, sv->cluster.n_ps,
              ps_table_shard_rows(ts, sv->cluster.n_ps, sv->index), ts->rows,
              sv->job.table_optim[t].name, (double)sv->job.table_optim[t].lr);
    else
      PS_INFO("table '%s': rows of %d values made on first push (at most %" PRIu64
              " on this shard), optimizer %s lr %g",
              ts->name, ts->dim, ts->max_rows_per_shard, sv->job.table_optim[t].name,
              (double)sv->job.table_optim[t].lr);
  }
  if (sv->job.mode_kind == PS_MODE_SYNC && ps_rows_sync_init(sv) != PS_OK) {
    fprintf(stderr, "ps-server: out of memory for the sync step's rows\n");
    return 1;
  }
  sv->members = ps_membership_create();
  if (!sv->members) {
    fprintf(stderr, "ps-server: out of memory\n");
    return 1;
  }
  ps_membership_set_limit(sv->members, sv->job.max_workers);
  pthread_mutex_init(&sv->wait_mu, NULL);
  pthread_mutex_init(&sv->lease_mu, NULL);
  if (o->metrics_path) {
    sv->metrics = ps_metrics_open(o->metrics_path, err);
    if (!sv->metrics) {
      fprintf(stderr, "ps-server: %s\n", err);
      return 2;
    }
  }
  char desc[512];
  ps_model_spec_describe(&sv->job.model, desc, sizeof desc);
  PS_INFO("job '%s': %s", sv->job.job_id, desc);
  if (o->ckpt_dir) {
    sv->ckpt_dir = o->ckpt_dir;
    sv->ckpt_secs = o->ckpt_secs;
    sv->ckpt_updates = o->ckpt_updates;
    sv->ckpt_keep = o->ckpt_keep;
    if (ps_server_ckpt_restore(sv, err) != 0) {
      fprintf(stderr, "ps-server: %s\n", err);
      return 1;
    }
  }
  if (sv->job.replicas_per_shard > 1 && ps_replica_init(sv, o->ckpt_dir, err) != 0) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  PS_INFO("shard %d of %d holds [%zu, %zu) (%zu values, %.1f MB), optimizer %s lr %g, mode %s",
          sv->index, sv->cluster.n_ps, ps_shard_begin(sv->shard), ps_shard_end(sv->shard),
          ps_shard_end(sv->shard) - ps_shard_begin(sv->shard),
          (ps_shard_end(sv->shard) - ps_shard_begin(sv->shard)) * 4.0 / 1e6, sv->job.optim.name,
          (double)sv->job.optim.lr, sv->job.mode);
  return 0;
}

/* The address to bind may be a name that resolves only later (a
 * Kubernetes headless Service publishes a pod's name once the pod runs; a
 * Slurm node's name once the node is up): waits for it with backoff, at
 * most max_s seconds. 0, or 1 with a message on stderr. */
static int wait_resolvable(const char *addr, double max_s) {
  char err[PS_ERRLEN];
  double start = ps_now_s();
  int64_t backoff = 100;
  for (int said = 0;; said = 1) {
    int rc = ps_addr_resolve(addr, err);
    if (rc == 0) {
      if (said) PS_INFO("%s resolves after %.1f s", addr, ps_now_s() - start);
      return 0;
    }
    double waited = ps_now_s() - start;
    if (rc != PS_EUNAVAIL || waited >= max_s) {
      fprintf(stderr, "ps-server: cannot listen on %s: %s%s\n", addr, err,
              rc == PS_EUNAVAIL ? " (waited --resolve-s)" : "");
      return 1;
    }
    if (!said) PS_WARN("%s: waiting up to %g s for it to resolve", err, max_s);
    ps_sleep_ms(backoff);
    backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
  }
}

/* Initializes the loop, then creates the RPC server, registers the methods
 * and starts serving. Returns 0, or the exit code with a message on
 * stderr: 2 when the token or TLS flags do not resolve (a file missing or
 * bad), 1 when the RPC server cannot be made or started (the address
 * cannot be bound). */
static int start_rpc(ps_server *sv, const ps_server_opts *o) {
  char err[PS_ERRLEN];
  /* libuv first: its loop and signal handlers do not use gRPC. */
  uv_loop_init(&sv->loop);
  if (ps_fd_guard_init() != 0) PS_WARN("cannot keep a spare file descriptor: a server out of "
                                       "descriptors may stop accepting");
  if (sv->ckpt_dir && ps_cut_init(sv, sv->ckpt_restored_set) != 0) {
    fprintf(stderr, "ps-server: out of memory\n");
    return 1;
  }
  rpc_global_init();
  const char *addr = o->listen_addr    ? o->listen_addr
                     : sv->replica_addrs ? sv->replica_addrs[sv->server_index]
                                         : sv->cluster.ps[sv->index];
  if (ps_security_resolve(&o->sec, PS_SECURITY_SERVER, &sv->sec, err) != 0) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 2;
  }
  if (sv->ckpt_dir && sv->index == 0 && sv->sec.use_tls && !o->sec.tls_ca)
    PS_WARN("checkpoint sets: shard 0 calls every shard over TLS and, without --tls-ca, checks "
            "their certificates against the system's CAs; give --tls-ca when your own CA signed "
            "them (deploy/certs.sh)");
  /* No request can need more than this shard's range and a small header. */
  size_t range_bytes = (ps_shard_end(sv->shard) - ps_shard_begin(sv->shard)) * sizeof(float);
  size_t max_request = range_bytes + 64 * 1024;
  /* Embedding rows: each an id and its values (fp32 at most), up to the
   * job's max_rows_per_request, and a few bytes per table's section. */
  if (sv->job.n_tables) {
    int dmax = 0;
    for (int t = 0; t < sv->job.n_tables; t++)
      if (sv->job.tables[t].dim > dmax) dmax = sv->job.tables[t].dim;
    max_request += (size_t)sv->job.max_rows_per_request * (8 + 4 * (size_t)dmax) +
                   16 * (size_t)sv->job.n_tables;
  }
  if (sv->repl && ps_replica_max_request(sv) > max_request) max_request = ps_replica_max_request(sv);
  if (max_request > RPC_DEFAULT_MAX_MESSAGE) max_request = RPC_DEFAULT_MAX_MESSAGE;
  /* Memory for every registered worker's push at once (a sync step), and
   * no more than half of the machine's: a flood of large messages has its
   * streams reset instead of taking the host down. */
  size_t memory = (size_t)(sv->job.max_workers + 4) * max_request + (32u << 20);
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 && memory > (size_t)pages / 2 * (size_t)page)
    memory = (size_t)pages / 2 * (size_t)page;
  rpc_server_opts so = {.threads = o->threads,
                        .tls = ps_security_tls(&sv->sec),
                        .max_receive_bytes = (int)max_request,
                        .memory_bytes = memory};
  if (wait_resolvable(addr, o->resolve_s) != 0) return 1;
  int port = 0;
  sv->rpc = rpc_server_create(addr, &so, &port, err);
  if (!sv->rpc) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  ps_service_register(sv, sv->rpc);
  if (rpc_server_start(sv->rpc, err) != 0) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 1;
  }
  sv->start_s = sv->last_report_s = ps_now_s();
  sv->log_interval_s = o->log_interval;
  PS_INFO("listening on %s (port %d), %d threads; %s", addr, port, o->threads, sv->sec.summary);
  return ps_server_prom_start(sv, o, addr);
}

/* Starts the loop's timers (sweep, report, checkpoints) and signals. */
static void start_timers(ps_server *sv, const ps_server_opts *o) {
  uv_timer_init(&sv->loop, &sv->sweep_timer);
  sv->sweep_timer.data = sv;
  int sweep_ms = sv->job.heartbeat_timeout_ms / 4 > 0 ? sv->job.heartbeat_timeout_ms / 4 : 1;
  uv_timer_start(&sv->sweep_timer, on_sweep, (uint64_t)sweep_ms, (uint64_t)sweep_ms);
  uv_timer_init(&sv->loop, &sv->report_timer);
  sv->report_timer.data = sv;
  uint64_t rep_ms = (uint64_t)(o->log_interval * 1000);
  uv_timer_start(&sv->report_timer, on_report, rep_ms, rep_ms);
  if (sv->ckpt_dir) {
    uv_timer_init(&sv->loop, &sv->ckpt_timer);
    sv->ckpt_timer.data = sv;
    sv->ckpt_last_s = ps_now_s();
    uv_timer_start(&sv->ckpt_timer, ps_server_ckpt_on_timer, 200, 200);
  }
  uv_signal_init(&sv->loop, &sv->sigint);
  sv->sigint.data = sv;
  uv_signal_start(&sv->sigint, on_signal, SIGINT);
  uv_signal_init(&sv->loop, &sv->sigterm);
  sv->sigterm.data = sv;
  uv_signal_start(&sv->sigterm, on_signal, SIGTERM);
}

/* After the loop has stopped: the last progress line, the RPC server
 * stopped, the handles closed, the final checkpoint, everything freed.
 * Returns the exit code: 1 when the final checkpoint failed, else 0. */
static int shut_down(ps_server *sv) {
  on_report(&sv->report_timer);
  /* A replica that is not the primary writes no checkpoint: the primary's
   * files are the shard's. */
  int writes_ckpt = sv->ckpt_dir && ps_replica_is_primary(sv);
  ps_replica_stop(sv); /* waiting pushes are sent elsewhere */
  ps_cut_drain(sv, 60); /* a checkpoint set under way ends (its writes need the loop) */
  rpc_server_shutdown(sv->rpc); /* answers the waiting pulls CANCELLED */
  ps_cut_close(sv); /* its held calls were cancelled with the server's */
  rpc_server_destroy(sv->rpc);
  ps_server_prom_stop(sv); /* before the shard it reads goes */
  ps_waits_free(sv);
  uv_close((uv_handle_t *)&sv->sweep_timer, NULL);
  uv_close((uv_handle_t *)&sv->report_timer, NULL);
  uv_close((uv_handle_t *)&sv->sigint, NULL);
  uv_close((uv_handle_t *)&sv->sigterm, NULL);
  if (sv->ckpt_dir) uv_close((uv_handle_t *)&sv->ckpt_timer, NULL);
  uv_run(&sv->loop, UV_RUN_DEFAULT); /* also finishes a checkpoint under way */
  /* No more updates can come: the final checkpoint holds everything applied. */
  int exit_code = 0;
  if (writes_ckpt && ps_server_ckpt_write_now(sv) != 0) exit_code = 1;
  ps_replica_free(sv);
  free(sv->replica_addrs);
  ps_cut_free(sv);
  uv_loop_close(&sv->loop);
  ps_shard_destroy(sv->shard);
  ps_rows_sum_destroy(sv->rows_sum);
  for (int t = 0; t < sv->n_tables; t++) ps_table_destroy(sv->tables[t]);
  ps_leases_destroy(sv->leases);
  ps_membership_destroy(sv->members);
  ps_metrics_close(sv->metrics);
  free(sv->job_text);
  rpc_global_shutdown();
  PS_INFO("stopped");
  return exit_code;
}

/* The hook replication calls when this replica becomes its shard's
 * primary: the step may be complete already (every gradient came in
 * before the old primary fell) and nothing else would try it; pulls may
 * go; shard 0's new primary starts a checkpoint set at once. */
static void on_became_primary(ps_server *sv) {
  if (sv->job.mode_kind == PS_MODE_SYNC) ps_sync_try_step(sv);
  ps_waits_recheck(sv);
  if (sv->index == 0) ps_cut_kick(sv);
}

int ps_server_run(const ps_server_opts *o) {
  static ps_server sv;
  /* What the lower parts ask of the upper ones (ps/core/server.h). */
  sv.hooks = (ps_server_hooks){.apply_push = ps_service_apply_push,
                               .sync_step = ps_sync_try_step,
                               .became_primary = on_became_primary};
  int rc = resolve_cluster(&sv, o);
  if (rc == 0) rc = build_shard(&sv, o);
  if (rc == 0) rc = start_rpc(&sv, o);
  if (rc == 0 && sv.repl) {
    char err[PS_ERRLEN];
    if (ps_replica_start(&sv, err) != 0) {
      fprintf(stderr, "ps-server: %s\n", err);
      rc = 1;
    }
  }
  if (rc != 0) return rc;
  start_timers(&sv, o);
  uv_run(&sv.loop, UV_RUN_DEFAULT);
  return shut_down(&sv);
}

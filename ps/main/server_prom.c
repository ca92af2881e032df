/* The server's Prometheus endpoint (--metrics-port): what a scrape reads
 * from the shard, the membership table, the waiting pulls, the data
 * leases and the checkpoints. Every figure is read under the lock its
 * owner keeps, on the endpoint's thread. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/prom.h"
#include "ps/ckpt/cut.h"
#include "ps/main/server_run.h"

static void collect(ps_prom_buf *b, void *user) {
  ps_server *sv = user;
  char shard[32];
  snprintf(shard, sizeof shard, "shard=\"%d\"", sv->index);
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);

  ps_prom_process(b, "ps-server");
  char info[400], jid[200], mode[64];
  snprintf(info, sizeof info, "%s,%s,%s", shard, ps_prom_label(jid, sizeof jid, "job_id", sv->job.job_id),
           ps_prom_label(mode, sizeof mode, "mode", sv->job.mode));
  ps_prom_metric(b, "ps_shard_info", "gauge",
                 "The shard's job and consistency mode (1); num_shards is its cluster's size.",
                 info, 1);
  ps_prom_metric(b, "ps_cluster_shards", "gauge", "Shards in the cluster.", shard,
                 sv->cluster.n_ps);
  ps_prom_metric(b, "ps_shard_parameters", "gauge", "Parameters this shard holds.", shard,
                 (double)(ps_shard_end(sv->shard) - ps_shard_begin(sv->shard)));
  ps_prom_metric(b, "ps_shard_version", "gauge", "Updates applied to the shard's parameters.",
                 shard, (double)st.version);
  ps_prom_metric(b, "ps_pushes_total", "counter", "Gradient pushes applied (or, under sync, taken into a step).",
                 shard, (double)st.pushes);
  ps_prom_metric(b, "ps_pulls_total", "counter", "Parameter pulls answered.", shard,
                 (double)st.pulls);
  ps_prom_metric(b, "ps_pushes_rejected_total", "counter",
                 "Pushes refused (bad shape, non-finite values, unknown worker, ...).", shard,
                 (double)st.rejected);
  ps_prom_metric(b, "ps_gradients_dropped_total", "counter",
                 "Sync: late or duplicate gradients dropped, and those of steps refused as "
                 "non-finite.",
                 shard, (double)st.dropped);
  ps_prom_metric(b, "ps_sync_short_steps_total", "counter",
                 "Sync: steps applied with fewer gradients than the workers they were for (the "
                 "others waiting for data), divided by all of them.",
                 shard, (double)st.sync_short_steps);

  /* staleness: the shard's bucket i holds the pushes i versions stale (the
   * last, the rest); Prometheus gets them in fewer buckets */
  enum { NB = 7 };
  static const double bounds[NB] = {0, 1, 2, 4, 8, 16, PS_STALENESS_BUCKETS - 2};
  uint64_t counts[NB + 1] = {0}, total = 0;
  for (int i = 0, k = 0; i < PS_STALENESS_BUCKETS; i++) {
    while (k < NB && i > bounds[k]) k++;
    counts[k] += st.staleness_hist[i];
    total += st.staleness_hist[i];
  }
  double sum = st.staleness_mean * (double)total;
  ps_prom_family(b, "ps_push_staleness", "histogram",
                 "Versions applied between a worker's pull and its push, per push.");
  ps_prom_histogram(b, "ps_push_staleness", shard, bounds, counts, NB, sum);
  ps_prom_metric(b, "ps_push_staleness_max", "gauge", "The largest staleness of a push so far.",
                 shard, (double)st.staleness_max);
  ps_prom_metric(b, "ps_update_interval_seconds", "gauge",
                 "Mean time between two updates of the shard.", shard, st.step_time_ms / 1e3);

  uint64_t hist[PS_WAIT_BUCKETS + 1];
  pthread_mutex_lock(&sv->wait_mu);
  memcpy(hist, sv->wait_hist, sizeof hist);
  double wait_s = sv->wait_ms_total / 1e3;
  int waiting = sv->n_waiting;
  uint64_t lead = sv->ssp_max_lead;
  pthread_mutex_unlock(&sv->wait_mu);
  ps_prom_family(b, "ps_pull_wait_seconds", "histogram",
                 "How long pulls waited for the shard (ssp: the slowest worker; sync: the step).");
  ps_prom_histogram(b, "ps_pull_wait_seconds", shard, ps_wait_bounds, hist, PS_WAIT_BUCKETS,
                    wait_s);
  ps_prom_metric(b, "ps_pulls_waiting", "gauge", "Pulls waiting now.", shard, waiting);
  ps_prom_metric(b, "ps_ssp_max_lead", "gauge",
                 "ssp: the most steps a worker was ahead of the slowest when it pulled.", shard,
                 (double)lead);

  ps_prom_metric(b, "ps_workers_live", "gauge", "Workers registered and heard from.", shard,
                 ps_membership_count(sv->members));
  ps_prom_metric(b, "ps_workers_dropped_total", "counter",
                 "Workers dropped for silence (no heartbeat within the job's timeout).", shard,
                 (double)ps_membership_dropped_total(sv->members));
  ps_prom_metric(b, "ps_connections_shed_total", "counter",
                 "Connections closed for want of file descriptors.", shard,
                 (double)ps_fd_guard_shed());

  uint64_t set = 0, set_version = 0;
  ps_cut_set_info(sv, &set, &set_version);
  int64_t last_ms = atomic_load(&sv->ckpt_last_ok_ms);
  ps_prom_metric(b, "ps_checkpoint_last_success_timestamp_seconds", "gauge",
                 "When this shard last wrote a checkpoint (Unix time; 0: never).", shard,
                 (double)last_ms / 1e3);
  ps_prom_metric(b, "ps_checkpoints_written_total", "counter", "Checkpoint files written.", shard,
                 (double)atomic_load(&sv->ckpt_written));
  ps_prom_metric(b, "ps_checkpoint_failures_total", "counter", "Checkpoint files that failed.",
                 shard, (double)atomic_load(&sv->ckpt_failed));
  ps_prom_metric(b, "ps_checkpoint_set", "gauge",
                 "The newest checkpoint set this shard wrote (0: none).", shard, (double)set);

  pthread_mutex_lock(&sv->lease_mu);
  ps_leases *lt = sv->leases;
  pthread_mutex_unlock(&sv->lease_mu);
  if (lt) { /* shard 0, once a worker asked for data leases */
    ps_lease_stats ls;
    ps_leases_stats(lt, &ls);
    const ps_lease_epoch_record *e = &ls.current;
    ps_prom_metric(b, "ps_data_epoch", "gauge", "The data epoch the leases hand out.", shard,
                   e->epoch);
    ps_prom_metric(b, "ps_data_chunks", "gauge", "Chunks of the data set per epoch.", shard,
                   e->chunks);
    ps_prom_metric(b, "ps_data_chunks_completed", "gauge",
                   "Chunks of the current epoch completed.", shard, e->chunks_completed);
    ps_prom_metric(b, "ps_data_lease_reclaims_total", "counter",
                   "Leases taken back from workers that did not renew them (this epoch).", shard,
                   (double)e->reclaims);
  }
}

int ps_server_prom_start(ps_server *sv, const ps_server_opts *o, const char *addr) {
  if (o->metrics_port < 0) return 0;
  char host[256] = "";
  int port = 0;
  const char *bind_host = o->metrics_host;
  if (!bind_host) {
    if (ps_parse_hostport(addr, host, sizeof host, &port) != 0) host[0] = 0;
    ps_host_unbracket(host);
    bind_host = host;
  }
  ps_prom_opts po = {.host = bind_host,
                     .port = o->metrics_port,
                     .tokens = {&sv->sec.token, &sv->sec.read_token},
                     .tls_cert = sv->sec.use_tls ? o->sec.tls_cert : NULL,
                     .tls_key = sv->sec.use_tls ? o->sec.tls_key : NULL};
  char err[PS_ERRLEN];
  sv->prom = ps_prom_start(&po, collect, sv, err);
  if (!sv->prom) {
    fprintf(stderr, "ps-server: %s\n", err);
    return 2;
  }
  PS_INFO("metrics: Prometheus endpoint on %s://%s:%d/metrics%s", po.tls_cert ? "https" : "http",
          *bind_host ? bind_host : "*", ps_prom_port(sv->prom),
          sv->sec.token.len ? " (a bearer token: the job's or the read-only one)" : "");
  return 0;
}

void ps_server_prom_stop(ps_server *sv) {
  ps_prom_stop(sv->prom);
  sv->prom = NULL;
}

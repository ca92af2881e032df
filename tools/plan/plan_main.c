/* ps-plan: how many shards a job needs, and what it will run at. From the
 * job (its parameters, wire encoding and batch size), the worker's compute
 * per step, the number of workers, the network (bandwidth and round trip)
 * and the cores, it predicts updates/s and examples/s with asymptotic
 * bounds (the workers' own step, the servers' cores, the servers' links,
 * the workers' links, and the cores of one shared host), names the bound
 * that binds, and finds the fewest shards that keep the workers from
 * waiting on the servers.
 *
 * The costs per update are measured, not assumed: a shard's CPU and the
 * client's CPU per update, each a fixed part plus a part per megabyte
 * moved, calibrated with ps-loadgen (tests/bench/plan_check.sh --calibrate
 * prints them for a machine; the defaults are this project's 2-core test
 * machine's). tests/bench/plan_check.sh compares the predictions with
 * ps-loadgen runs on loopback and between network namespaces whose links
 * tc limits; outside the range it was checked on, the planner refuses to
 * guess unless --force. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/job.h"
#include "common/options.h"
#include "common/util.h"

/* What tests/bench/plan_check.sh checked the model on. */
#define CHECKED_MAX_WORKERS 16
#define CHECKED_MAX_SHARDS 4
#define CHECKED_MIN_PARAMS 10000
#define CHECKED_MAX_PARAMS 2000000
#define CHECKED_MAX_GBIT 10.0
#define CHECKED_MAX_RTT_MS 1.0
#define MAX_SHARDS_SEARCHED 64
#define HEADROOM 1.25 /* the servers' capacity over the workers' demand: waits stay short */

typedef struct {
  const char *job_path;
  int workers, shards, worker_hosts, rows, force, json, server_threads;
  double step_ms, link_gbit, rtt_ms, host_cores, server_cores;
  double srv_us, srv_us_idle, srv_us_per_mb, cli_us, cli_us_per_mb, contention, net_us_per_mb;
} plan_opts;

#define O(field) offsetof(plan_opts, field)

static const ps_option plan_flags[] = {
    {"job", "FILE", PS_OPT_STR, O(job_path), .help =
     "the job file: its parameters, wire encoding, batch size and tables, required"},
    {"workers", "W", PS_OPT_INT, O(workers), 1, 100000, .help = "workers, required"},
    {"step-ms", "MS", PS_OPT_SECS, O(step_ms), 0, .help =
     "a worker's compute per step in milliseconds, without pull and push, required "
     "(`ps-worker --local` logs it as compute ms/step). With --host-cores it is taken to use "
     "none of the shared host's cores (as `ps-loadgen --compute-ms`): give --host-cores the "
     "cores the workers' compute leaves"},
    {"shards", "S", PS_OPT_INT, O(shards), 0, MAX_SHARDS_SEARCHED, .def = "0", .help =
     "predict for S shards (0: for 1, 2, 4, ... and name the fewest that keep the workers "
     "from waiting)"},
    {"link-gbit", "G", PS_OPT_SECS, O(link_gbit), 0, .def = "0", .help =
     "every host's network link, Gbit/s each way (0: all on one host, over loopback)"},
    {"rtt-ms", "MS", PS_OPT_SECS, O(rtt_ms), 0, .def = "0.05",
     .help = "round trip between a worker and a shard"},
    {"host-cores", "N", PS_OPT_SECS, O(host_cores), 0, .def = "0", .help =
     "the shards and the workers share one host of N cores (a test on one machine; its "
     "network, if any, between namespaces); 0: the shards have hosts of their own"},
    {"server-cores", "N", PS_OPT_SECS, O(server_cores), 0, .excl_lo = 1, .def = "2",
     .help = "cores a shard's host gives it (at most its --threads)"},
    {"server-threads", "N", PS_OPT_INT, O(server_threads), 1, 1024, .def = "2",
     .help = "`ps-server --threads` of every shard"},
    {"worker-hosts", "H", PS_OPT_INT, O(worker_hosts), 0, 100000, .def = "0", .help =
     "hosts the workers share, and with them each host's link (0: one host per worker)"},
    {"rows", "N", PS_OPT_INT, O(rows), 0, 1 << 24, .def = "0",
     .help = "embedding rows per step of each of the job's tables"},
    {"server-us-per-update", "US", PS_OPT_SECS, O(srv_us), 0, .def = "110", .help =
     "a shard's CPU per update besides the bytes (calibrated: `tests/bench/plan_check.sh "
     "BUILD --calibrate`)"},
    {"server-us-idle", "US", PS_OPT_SECS, O(srv_us_idle), 0, .def = "192", .help =
     "more CPU per update when the shard serves one worker at a time (waking for each "
     "call), divided by the workers"},
    {"server-us-per-mb", "US", PS_OPT_SECS, O(srv_us_per_mb), 0, .def = "322",
     .help = "a shard's CPU per megabyte it receives or sends"},
    {"client-us-per-update", "US", PS_OPT_SECS, O(cli_us), 0, .def = "170",
     .help = "a worker's CPU per pull and push of one shard, besides the bytes"},
    {"client-us-per-mb", "US", PS_OPT_SECS, O(cli_us_per_mb), 0, .def = "442",
     .help = "a worker's CPU per megabyte it receives or sends"},
    {"net-us-per-mb", "US", PS_OPT_SECS, O(net_us_per_mb), 0, .def = "0", .help =
     "with --host-cores and --link-gbit (namespaces on one host): the host's CPU per "
     "megabyte the kernel forwards between them (veth, bridge, tc), on top of the "
     "processes' own (`tests/bench/plan_check.sh BUILD --calibrate` measures it)"},
    {"contention", "F", PS_OPT_SECS, O(contention), 0, .def = "0.25", .help =
     "with --host-cores: a shard's fixed CPU per update grows by this fraction for every "
     "other shard on the host"},
    {"force", NULL, PS_OPT_FLAG, O(force), .help =
     "predict outside the range the model was checked on (say so in the output)"},
    {"json", NULL, PS_OPT_FLAG, O(json), .help = "print the prediction as one JSON object"},
};

static const ps_optspec plan_spec = {
    .prog = "ps-plan",
    .synopsis =
        "Usage: ps-plan --job FILE --workers W --step-ms MS [--shards S] [--link-gbit G]\n"
        "               [--rtt-ms MS] [--host-cores N | --server-cores N] [--worker-hosts H]\n"
        "\n"
        "Predicts the updates/s and examples/s of a job and the shards it needs, and names\n"
        "the bottleneck: the workers' compute, the servers' cores, the servers' links or\n"
        "the workers' links. Refuses to guess outside what it was checked on (--force).\n",
    .opts = plan_flags,
    .n_opts = (int)(sizeof plan_flags / sizeof plan_flags[0]),
    .footer = "Exit status: 0 predicted, 1 a bad job file, 2 bad usage, 3 outside the checked "
              "range (without --force).",
};

enum { B_WORKERS, B_SERVER_CPU, B_SERVER_LINK, B_WORKER_LINK, B_HOST_CPU, B_N };
static const char *const bound_names[B_N] = {"workers' compute", "servers' cores",
                                             "servers' links", "workers' links",
                                             "shared host's cores"};

typedef struct {
  int shards;
  double step_s;     /* a worker's step with no waiting on the servers */
  double bound[B_N]; /* updates/s each allows (INFINITY: none) */
  int binding;
  double updates_s, wait;
  double srv_us, cli_us, mb_shard, mb_worker;
} plan_result;

/* Bytes of one update: a worker's pull and push together, and the largest
 * shard's share (the ranges differ by at most one value). */
static void update_bytes(const plan_opts *o, const ps_job *job, int S, double *mb_worker,
                         double *mb_shard) {
  double b = job->wire == PS_WIRE_FP32 ? 4.0 : 2.0;
  double dense = (double)job->model.n_params * b;
  double rows = 0;
  for (int t = 0; t < job->n_tables; t++)
    rows += (double)o->rows * (8.0 + b * job->tables[t].dim); /* ids, then values or grads */
  *mb_worker = 2.0 * (dense + rows) / 1e6;
  *mb_shard = 2.0 * (ceil((double)job->model.n_params / S) * b + rows / S) / 1e6;
}

static plan_result predict(const plan_opts *o, const ps_job *job, int S) {
  plan_result r = {.shards = S};
  update_bytes(o, job, S, &r.mb_worker, &r.mb_shard);
  /* Every worker talks to every shard: W connections and calls per shard.
   * On one shared host every process more than the cores adds switches:
   * a shard's fixed part grows with the shards beside it (calibrated). */
  double W = o->workers;
  double share = o->host_cores > 0 ? 1.0 + o->contention * (S - 1) : 1.0;
  r.srv_us = o->srv_us * share + o->srv_us_idle / W + o->srv_us_per_mb * r.mb_shard;
  /* a worker's fixed part is per shard it calls (a pull and a push each) */
  r.cli_us = o->cli_us * S + o->cli_us_per_mb * r.mb_worker;
  double link_Bps = o->link_gbit * 1e9 / 8.0;
  /* A step: compute, then a pull and a push, each a round trip, the client's
   * work, a shard's (the shards serve in parallel) and the bytes on the
   * slower of the links (both ends carry them). */
  double wire_s = 0;
  if (link_Bps > 0) {
    /* a pull's and a push's bytes at the link's rate (its sharing among
     * workers, and between directions, is the links' bounds below) */
    wire_s = r.mb_worker * 1e6 / link_Bps;
  }
  /* Half a shard's work lies on the worker's path (it parses, applies and
   * copies while the worker waits); the rest overlaps the worker's own
   * reading and writing (fitted to single-worker runs). */
  r.step_s = o->step_ms / 1000.0 + 2 * o->rtt_ms / 1000.0 + r.cli_us / 1e6 +
             0.5 * r.srv_us / 1e6 + wire_s;
  for (int b = 0; b < B_N; b++) r.bound[b] = INFINITY;
  r.bound[B_WORKERS] = o->workers / r.step_s;
  if (o->host_cores > 0) {
    /* everything on one host: the shards' and the workers' CPU share its
     * cores, and with links between namespaces so does the kernel's
     * forwarding of every byte */
    double net_us = link_Bps > 0 ? o->net_us_per_mb * r.mb_worker : 0;
    r.bound[B_HOST_CPU] = o->host_cores * 1e6 / (S * r.srv_us + r.cli_us + net_us);
  } else {
    double cores = o->server_cores < o->server_threads ? o->server_cores : o->server_threads;
    r.bound[B_SERVER_CPU] = cores * 1e6 / r.srv_us;
  }
  if (link_Bps > 0) {
    r.bound[B_SERVER_LINK] = link_Bps / (r.mb_shard * 1e6 / 2);
    int hosts = o->worker_hosts > 0 ? o->worker_hosts : o->workers;
    r.bound[B_WORKER_LINK] = hosts * link_Bps / (r.mb_worker * 1e6 / 2);
  }
  r.binding = B_WORKERS;
  for (int b = 0; b < B_N; b++)
    if (r.bound[b] < r.bound[r.binding]) r.binding = b;
  r.updates_s = r.bound[r.binding];
  r.wait = 1.0 - r.updates_s / r.bound[B_WORKERS];
  return r;
}

/* The bounds the servers set (not the workers'): what more shards raise. */
static double server_side(const plan_result *r) {
  double m = r->bound[B_SERVER_CPU];
  if (r->bound[B_SERVER_LINK] < m) m = r->bound[B_SERVER_LINK];
  return m;
}

static int outside_checked(const plan_opts *o, const ps_job *job, char *why, size_t len) {
  if (o->workers > CHECKED_MAX_WORKERS)
    return snprintf(why, len, "--workers %d (checked: 1 to %d)", o->workers, CHECKED_MAX_WORKERS);
  if (o->shards > CHECKED_MAX_SHARDS)
    return snprintf(why, len, "--shards %d (checked: 1 to %d)", o->shards, CHECKED_MAX_SHARDS);
  if (job->model.n_params < CHECKED_MIN_PARAMS || job->model.n_params > CHECKED_MAX_PARAMS)
    return snprintf(why, len, "%zu parameters (checked: %d to %d)", job->model.n_params,
                    CHECKED_MIN_PARAMS, CHECKED_MAX_PARAMS);
  if (o->link_gbit > 0 && (o->link_gbit < 1 || o->link_gbit > CHECKED_MAX_GBIT))
    return snprintf(why, len, "--link-gbit %g (checked: 1 to %g, or loopback)", o->link_gbit,
                    CHECKED_MAX_GBIT);
  if (o->rtt_ms > CHECKED_MAX_RTT_MS)
    return snprintf(why, len, "--rtt-ms %g (checked: up to %g)", o->rtt_ms, CHECKED_MAX_RTT_MS);
  if (o->rows > 0 && job->n_tables > 0)
    return snprintf(why, len, "embedding rows (checked: dense parameters only)");
  if (o->host_cores <= 0)
    return snprintf(why, len,
                    "shards on hosts of their own (checked: one host of 2 cores, --host-cores 2)");
  return 0;
}

static void print_result(const plan_opts *o, const ps_job *job, const plan_result *r) {
  printf("%d shard%s: %.0f updates/s, %.0f examples/s; bound by the %s", r->shards,
         r->shards == 1 ? "" : "s", r->updates_s, r->updates_s * job->batch_size,
         bound_names[r->binding]);
  if (r->wait > 0.005) printf(" (the workers wait %.0f%% of each step)", 100 * r->wait);
  printf("\n  step %.2f ms (compute %.2f); per update: %.2f MB through each worker, %.2f MB "
         "through a shard, shard CPU %.0f us, worker CPU %.0f us\n  bounds (updates/s):",
         r->step_s * 1000, o->step_ms, r->mb_worker, r->mb_shard, r->srv_us, r->cli_us);
  for (int b = 0; b < B_N; b++)
    if (isfinite(r->bound[b])) printf(" %s %.0f;", bound_names[b], r->bound[b]);
  printf("\n");
}

static void json_result(const ps_job *job, const plan_result *r, int last) {
  printf("{\"shards\": %d, \"updates_per_s\": %.2f, \"examples_per_s\": %.1f, \"bottleneck\": "
         "\"%s\", \"wait\": %.4f, \"step_ms\": %.4f, \"server_us_per_update\": %.1f, "
         "\"client_us_per_update\": %.1f",
         r->shards, r->updates_s, r->updates_s * job->batch_size, bound_names[r->binding],
         r->wait, r->step_s * 1000, r->srv_us, r->cli_us);
  static const char *const keys[B_N] = {"workers", "server_cpu", "server_link", "worker_link",
                                        "host_cpu"};
  for (int b = 0; b < B_N; b++)
    if (isfinite(r->bound[b])) printf(", \"bound_%s\": %.2f", keys[b], r->bound[b]);
  printf("}%s", last ? "" : ", ");
}

int main(int argc, char **argv) {
  plan_opts o;
  memset(&o, 0, sizeof o);
  if (ps_options_defaults(&plan_spec, &o) != 0) return 2;
  o.step_ms = -1;
  int prc = ps_options_parse(&plan_spec, argc, argv, &o);
  if (prc == 1) return 0;
  if (prc != 0) return 2;
  if (!o.job_path || o.workers <= 0 || o.step_ms < 0) {
    fprintf(stderr, "ps-plan: --job FILE, --workers W and --step-ms MS are required (see --help)\n");
    return 2;
  }
  char err[PS_ERRLEN];
  static ps_job job;
  if (ps_job_load(o.job_path, &job, NULL, err) != 0) {
    fprintf(stderr, "ps-plan: %s\n", err);
    return 1;
  }
  if (job.model.n_params == 0) {
    fprintf(stderr, "ps-plan: %s: the model has no parameters\n", o.job_path);
    return 1;
  }
  char why[160] = "";
  if (outside_checked(&o, &job, why, sizeof why) && !o.force) {
    fprintf(stderr,
            "ps-plan: outside what the model was checked on: %s. tests/bench/plan_check.sh "
            "checks it against measured runs; --force predicts anyway\n",
            why);
    return 3;
  }
  const char *caveat = why[0] && o.force ? why : NULL;
  plan_result res[8];
  int n = 0;
  if (o.shards > 0) {
    res[n++] = predict(&o, &job, o.shards);
  } else {
    for (int S = 1; S <= MAX_SHARDS_SEARCHED && n < 7; S *= 2) res[n++] = predict(&o, &job, S);
  }
  /* The fewest shards whose servers serve the workers' demand with headroom. */
  int need = 0;
  plan_result nr = {0};
  for (int S = 1; S <= MAX_SHARDS_SEARCHED; S++) {
    plan_result r = predict(&o, &job, S);
    if (server_side(&r) >= HEADROOM * r.bound[B_WORKERS] &&
        (o.host_cores <= 0 || r.bound[B_HOST_CPU] >= r.bound[B_WORKERS])) {
      need = S;
      nr = r;
      break;
    }
  }
  if (o.json) {
    printf("{\"job\": \"%s\", \"params\": %zu, \"workers\": %d, \"predictions\": [", job.job_id,
           job.model.n_params, o.workers);
    for (int i = 0; i < n; i++) json_result(&job, &res[i], i == n - 1);
    printf("], \"shards_needed\": %d, \"outside_checked\": %s}\n", need, caveat ? "true" : "false");
    return 0;
  }
  printf("job '%s': %zu parameters (%s), batch %d; %d worker%s at %.2f ms of compute per step\n",
         job.job_id, job.model.n_params, ps_wire_name(job.wire), job.batch_size, o.workers,
         o.workers == 1 ? "" : "s", o.step_ms);
  if (caveat) printf("NOTE: outside what the model was checked on (%s): a guess\n", caveat);
  for (int i = 0; i < n; i++) print_result(&o, &job, &res[i]);
  if (need > 0 && o.host_cores > 0 && !isfinite(server_side(&nr))) {
    printf("shards needed: %d. On one host the shards bring no cores of their own: the host "
           "can take %.0f updates/s against the %.0f the workers ask for\n",
           need, nr.bound[B_HOST_CPU], nr.bound[B_WORKERS]);
  } else if (need > 0) {
    printf("shards needed: %d. With %d the servers can take %.0f updates/s against the %.0f the "
           "workers ask for (%.2fx, at least %.2fx keeps their waits short)%s\n",
           need, need, server_side(&nr), nr.bound[B_WORKERS],
           server_side(&nr) / nr.bound[B_WORKERS], HEADROOM,
           o.host_cores > 0 ? "; on one shared host more shards also take its cores" : "");
  } else {
    plan_result r = predict(&o, &job, MAX_SHARDS_SEARCHED);
    printf("shards needed: none suffices up to %d: the %s bind (%.0f updates/s against the %.0f "
           "the workers ask for); add %s\n",
           MAX_SHARDS_SEARCHED, bound_names[r.binding == B_WORKERS ? B_HOST_CPU : r.binding],
           r.updates_s, r.bound[B_WORKERS],
           r.binding == B_WORKER_LINK ? "bandwidth to the workers' hosts"
                                      : (o.host_cores > 0 ? "hosts" : "faster links or cores"));
  }
  return 0;
}

/* ps-worker's flags, described once, and TF_CONFIG merged into them. */
#include "worker/main/worker_options.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/options.h"
#include "common/security.h"
#include "common/util.h"
#include "worker/train/worker.h" /* the exit codes */

#define O(field) offsetof(ps_worker_opts, field)

/* in the order of ps_pipeline_mode */
static const char *const pipeline_choices[] = {"on", "off", "auto", NULL};
static const char *const level_choices[] = {"debug", "info", "warn", "error", NULL};
static const char *const onoff_choices[] = {"on", "off", NULL};

static const ps_option worker_flags[] = {
    {"ps", "LIST", PS_OPT_STR, O(ps_addr), .help =
     "a server address (the first entry of a comma-separated list is contacted; the job and "
     "every shard's address come from shard 0)"},
    {"index", "N", PS_OPT_INT, O(index), 0, 100000, .def_doc = "the registration order",
     .help = "this worker's task index: its share of the data is the examples `i` with "
     "`i % num_workers == N`"},
    {"num-workers", "N", PS_OPT_INT, O(num_workers), 1, 100000,
     .def_doc = "`TF_CONFIG`'s worker and chief entries, else 1",
     .help = "how many workers share the data"},
    {"chief", NULL, PS_OPT_FLAG, O(chief), .def_doc = "`TF_CONFIG` type `chief`, or index 0",
     .help = "evaluate the test split"},
    {"evaluator", NULL, PS_OPT_FLAG, O(evaluator), .help =
     "evaluate only (the `evaluator` role, also `TF_CONFIG` task type `evaluator`): pull the "
     "parameters every `--eval-interval` seconds (10 when the job says 0) and evaluate the test "
     "split; pushes nothing and is not counted among the workers"},
    {"max-evals", "N", PS_OPT_INT, O(max_evals), 1, 1 << 30, .def_doc = "no limit",
     .help = "evaluator: stop after N evaluations"},
    {"idle-evals", "K", PS_OPT_INT, O(idle_evals), 1, 1 << 30, .def = "3", .help =
     "evaluator: stop once the parameters did not change for K evaluations after they started to"},
    {"local", NULL, PS_OPT_FLAG, O(local), .help =
     "train in this process with no servers (needs `--job`): the baseline the benchmark "
     "compares with"},
    {"job", "FILE", PS_OPT_STR, O(job_path), .help = "the job file, for `--local`"},
    {"epochs", "N", PS_OPT_INT, O(epochs), 1, 1000000, .def_doc = "the job's",
     .help = "passes over this worker's share of the data"},
    {"max-steps", "N", PS_OPT_I64, O(max_steps), 0, (double)(1LL << 40),
     .def_doc = "the job's", .help = "stop after N steps; 0: no limit"},
    {"data-dir", "DIR", PS_OPT_STR, O(data_dir), .def_doc = "the job's",
     .help = "the data set's directory: where the IDX or CIFAR-10 files are, and what relative "
             "`.npy`/`.npz` paths of the job are taken under"},
    {"device", "D", PS_OPT_STR, O(device), .def_doc = "`auto`", .help =
     "`cpu`, `cpu-ref`, `cuda` or `cuda:N`; `auto` is `cuda` when the build has the CUDA backend "
     "and a GPU is present, else `cpu` (the first log line says which). `cpu` runs on oneDNN "
     "(blocked layouts, one OpenMP thread team) when the build has it, else it is `cpu-ref`, the "
     "reference backend (im2col and OpenBLAS sgemm). `emu`: the emulated device, the "
     "cpu ops on memory that is not the host's (every pointer checked, copies to the host "
     "landing late as on a stream), which runs a GPU worker's code paths where there is no GPU; "
     "for checking, not for speed"},
    {"precision", "P", PS_OPT_STR, O(precision), .def_doc = "`fp32`", .help =
     "the arithmetic of convolutions and dense layers: `fp32`, or on a GPU with tensor cores "
     "(compute capability 8.0+) `tf32` (each product's inputs rounded to 10 bits of mantissa) "
     "or `bf16` (inputs as bfloat16, sums in float32). Parameters, gradients, the loss and the "
     "optimizer stay float32; a backend that cannot is an error at start"},
    {"threads", "N", PS_OPT_INT, O(threads), 0, 256, .def_doc = "the number of cores",
     .help = "compute threads; the launcher gives each worker cores/workers"},
    {"replicas", "R", PS_OPT_INT, O(replicas), 1, 256, .def = "1", .help =
     "R mirrored replicas: one per thread on the cpu, one per GPU on cuda (replica `i` on GPU "
     "`i % count`); the batch is split across them and their gradients summed (NCCL reduce "
     "onto replica 0 when each has its own GPU, else in host memory) before one push per shard"},
    {"per-replica-batch", "N", PS_OPT_INT, O(per_replica_batch), 1, 65536,
     .def_doc = "the job's `batch_size` is the global batch",
     .help = "the batch of each replica; the global batch is `N*R`, said in the log"},
    {"eval-interval", "SEC", PS_OPT_SECS, O(eval_interval), 0, .def_doc = "the job's "
     "`eval_interval_s`", .help = "seconds between the chief's evaluations; 0: only at the end"},
    {"log-interval", "SEC", PS_OPT_SECS, O(log_interval), 0, .def = "5",
     .help = "seconds between progress lines"},
    {"metrics", "FILE", PS_OPT_STR, O(metrics_path), .help =
     "append JSON Lines: per interval `time`, `worker`, `step`, `epoch`, `loss`, "
     "`train_accuracy`, `examples_per_sec`, `staleness_mean`, `staleness_max`, `dropped`, "
     "`pull_ms`, `compute_ms`, `push_ms`, and for steps that are not pipelined the compute's "
     "phases on the device's clock, `h2d_ms`, `forward_ms`, `backward_ms`, `d2h_ms`; per "
     "evaluation `test_accuracy`, `test_loss`, `elapsed_s`, `updates`"},
    {"tensorboard", "DIR", PS_OPT_STR, O(tb_dir), .help =
     "write TensorBoard event files into DIR (made when absent), the chief and the evaluator "
     "only (other workers log that they write none): per progress interval `train/loss`, "
     "`train/accuracy`, `perf/examples_per_sec`, `staleness/mean`, `staleness/max`, "
     "`time/pull_ms`, `time/compute_ms`, `time/push_ms`; per evaluation `test/loss`, "
     "`test/accuracy`; the values and steps of the `--metrics` records. View with "
     "`tensorboard --logdir DIR`"},
    {"metrics-port", "PORT", PS_OPT_INT, O(metrics_port), 0, 65535, .def_doc = "none", .help =
     "serve Prometheus metrics at `/metrics` on this port (0: one the kernel picks, said in the "
     "log): over HTTPS when the worker has `--tls-cert` and `--tls-key`; with a token a scrape "
     "must send `Authorization: Bearer` with the job's token or `--metrics-token-file`'s"},
    {"metrics-host", "ADDR", PS_OPT_STR, O(metrics_host), .def = "127.0.0.1",
     .help = "the address the metrics endpoint binds (`0.0.0.0`: every interface)"},
    {"metrics-token-file", "FILE", PS_OPT_STR, O(metrics_token_file), .help =
     "a token the metrics endpoint accepts besides the job's (the cluster's read-only token, so "
     "that a scraper holds no token that can push)"},
    {"timeout-ms", "MS", PS_OPT_INT, O(timeout_ms), 1, 3600000, .def = "30000",
     .help = "deadline of every call to a server"},
    {"retry-s", "SEC", PS_OPT_SECS, O(retry_s), 0, .def = "60", .help =
     "how long to retry unreachable servers, with exponential backoff and jitter (the first "
     "registration waits this long for them; 0: one call, no retries); then the worker leaves "
     "and exits 3"},
    {"host", "NAME", PS_OPT_STR, O(host), .def_doc = "the host name",
     .help = "name reported to the servers"},
    {"save-params", "FILE", PS_OPT_STR, O(save_path), .help =
     "at the end, pull and write the parameters (raw little-endian float32): to a "
     "temporary file, fsynced, then renamed over FILE, so a failure (named with its cause) "
     "leaves what was there"},
    {"overlap", NULL, PS_OPT_FLAG, O(overlap), .help =
     "async/ssp: push and pull on a second thread while the next step computes; gradients are "
     "one version staler (with plain SGD or Adam; momentum 0.9 on top of that staleness "
     "diverged in our runs)"},
    {"pipeline", "MODE", PS_OPT_CHOICE, O(pipeline), .choices = pipeline_choices, .def = "auto",
     .help = "`on`, `off` or `auto`: pipeline each step shard by shard (the first layers compute "
     "while later shards arrive; a shard's gradient goes out while earlier layers compute). "
     "`auto` times both on a GPU worker's first 29 steps and keeps the faster (a small model's "
     "replayed CUDA graph can beat the pipeline), and is off on the cpu, where shards on the "
     "same host applying early pushes compete with the backward pass for the cores. Either way "
     "the same gradients and parameters, bit for bit"},
    {"cuda-graphs", "MODE", PS_OPT_CHOICE, O(cuda_graphs), .choices = onoff_choices, .def = "on",
     .help = "`on` or `off`: on a GPU, record a step that is not pipelined (forward, loss, "
     "backward) as a CUDA Graph after one step of its batch size and replay it, launching it "
     "whole instead of op by op (dropout draws each replay's own masks). Models with embedding "
     "layers, and recordings that fail, run op by op (the log says why); the same results "
     "either way"},
    {"straggle-ms", "N", PS_OPT_INT, O(straggle_ms), 0, 3600000, .def = "0",
     .help = "sleep N ms in every step: an artificial straggler, for comparing consistency modes "
             "(the same as `--straggle fixed:N`)"},
    {"straggle", "SPEC", PS_OPT_STR, O(straggle), .help =
     "sleep in every step for a time drawn per step: `fixed:MS`, `uniform:LO:HI` (ms, uniform), "
     "`exp:MEAN` (exponential, mean MEAN ms, at most 100 times it): stragglers whose delays "
     "vary, reproducible from the job's seed and the worker's rank"},
    {"log-level", "L", PS_OPT_CHOICE, O(log_level), .choices = level_choices, .def = "info",
     .help = "`debug`, `info`, `warn` or `error`"},
    PS_CLIENT_SECURITY_OPTIONS(ps_worker_opts,
                               "the job's token, as the servers were given it (an evaluator may "
                               "use the servers' read-only token instead)",
                               "this worker's"),
};

static const ps_optspec worker_spec = {
    .prog = "ps-worker",
    .synopsis =
        "Usage: ps-worker --ps HOST:PORT[,...] [options]\n"
        "       ps-worker (with TF_CONFIG set, task type worker, chief or evaluator) [options]\n"
        "       ps-worker --local --job FILE [options]\n"
        "\n"
        "Trains the job served by the ps-server processes: pulls the parameters,\n"
        "computes gradients on this worker's share of the data, pushes them.\n",
    .opts = worker_flags,
    .n_opts = (int)(sizeof worker_flags / sizeof worker_flags[0]),
    .footer =
        "SIGINT or SIGTERM: the worker finishes its step, leaves the servers and exits 0.\n"
        "\n"
        "Exit codes (the last line on stderr says which and why):\n"
        "  0  done: the data or --max-steps, the evaluator saw training end, or a signal\n"
        "  1  an error: in the job or the data, a NaN loss, a request a server refused\n"
        "     (a wrong token), no memory, a failed --save-params\n"
        "  2  a bad command line: a flag, TF_CONFIG, or a file or device a flag names\n"
        "  3  the servers did not answer for --retry-s seconds (at the start or during\n"
        "     the run): starting again later may succeed",
};

/* Without --ps: the cluster and this task from TF_CONFIG. The chief counts
 * as task 0 and the workers follow it, as in TensorFlow. */
static int merge_tf_config(ps_worker_opts *o) {
  const char *tf = getenv("TF_CONFIG");
  if (!tf) {
    fprintf(stderr, "ps-worker: give --ps HOST:PORT, set TF_CONFIG, or use --local --job FILE "
                    "(see --help)\n");
    return PS_WORKER_EXIT_USAGE;
  }
  static ps_cluster cluster;
  char err[PS_ERRLEN];
  if (ps_cluster_from_tf_config(tf, &cluster, err) != 0) {
    fprintf(stderr, "ps-worker: TF_CONFIG: %s\n", err);
    return PS_WORKER_EXIT_USAGE;
  }
  if (!strcmp(cluster.task_type, "evaluator")) {
    o->evaluator = 1;
  } else if (strcmp(cluster.task_type, "worker") != 0 && strcmp(cluster.task_type, "chief") != 0) {
    fprintf(stderr, "ps-worker: TF_CONFIG names task type '%s'; ps-worker runs 'worker', "
                    "'chief' or 'evaluator'\n", cluster.task_type);
    return PS_WORKER_EXIT_USAGE;
  }
  if (cluster.n_ps == 0) {
    fprintf(stderr, "ps-worker: TF_CONFIG has no ps addresses\n");
    return PS_WORKER_EXIT_USAGE;
  }
  o->have_tf_config = 1;
  o->ps_addr = cluster.ps[0];
  int is_chief = !strcmp(cluster.task_type, "chief");
  if (o->index < 0) o->index = is_chief ? 0 : cluster.task_index + cluster.n_chief;
  if (o->num_workers == 0) o->num_workers = cluster.n_workers + cluster.n_chief;
  if (o->chief < 0) o->chief = is_chief || (cluster.n_chief == 0 && cluster.task_index == 0);
  return 0;
}

/* --straggle SPEC, or --straggle-ms N. */
static int parse_straggle(ps_worker_opts *o) {
  if (!o->straggle) {
    o->straggle_kind = o->straggle_ms > 0 ? PS_STRAGGLE_FIXED : PS_STRAGGLE_NONE;
    o->straggle_a = o->straggle_ms;
    return 0;
  }
  if (o->straggle_ms > 0) {
    fprintf(stderr, "ps-worker: --straggle and --straggle-ms: give one\n");
    return PS_WORKER_EXIT_USAGE;
  }
  double a = 0, b = 0;
  char tail = 0;
  const char *s = o->straggle;
  if (sscanf(s, "fixed:%lf%c", &a, &tail) == 1 && a >= 0 && a <= 3600000) {
    o->straggle_kind = PS_STRAGGLE_FIXED;
  } else if (sscanf(s, "uniform:%lf:%lf%c", &a, &b, &tail) == 2 && a >= 0 && b >= a &&
             b <= 3600000) {
    o->straggle_kind = PS_STRAGGLE_UNIFORM;
  } else if (sscanf(s, "exp:%lf%c", &a, &tail) == 1 && a > 0 && a <= 36000) {
    o->straggle_kind = PS_STRAGGLE_EXP;
  } else {
    fprintf(stderr,
            "ps-worker: --straggle '%s': want fixed:MS, uniform:LO:HI (0 <= LO <= HI <= "
            "3600000) or exp:MEAN (0 < MEAN <= 36000), in ms\n",
            s);
    return PS_WORKER_EXIT_USAGE;
  }
  o->straggle_a = a;
  o->straggle_b = b;
  return 0;
}

int ps_worker_opts_parse(ps_worker_opts *o, int argc, char **argv) {
  memset(o, 0, sizeof *o);
  o->index = -1;
  o->chief = -1;
  o->epochs = -1;
  o->max_steps = -1;
  o->eval_interval = -1;
  o->metrics_port = -1;
  o->threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (o->threads < 1) o->threads = 1;
  if (ps_options_defaults(&worker_spec, o) != 0) return PS_WORKER_EXIT_USAGE;
  int rc = ps_options_parse(&worker_spec, argc, argv, o);
  if (rc != 0) return rc;

  if ((rc = parse_straggle(o)) != 0) return rc;
  if (!o->local && !o->ps_addr && (rc = merge_tf_config(o)) != 0) return rc;
  if (o->evaluator) {
    o->chief = 1; /* loads the test split and evaluates */
    if (o->index < 0) o->index = 0;
  }
  if (o->local && !o->job_path) {
    fprintf(stderr, "ps-worker: --local needs --job FILE\n");
    return PS_WORKER_EXIT_USAGE;
  }
  if (o->evaluator && o->local) {
    fprintf(stderr, "ps-worker: --evaluator evaluates what servers hold; it needs --ps, not "
                    "--local\n");
    return PS_WORKER_EXIT_USAGE;
  }
  if (o->ps_addr) {
    /* Only the first address of a list is needed. */
    snprintf(o->ps_first, sizeof o->ps_first, "%s", o->ps_addr);
    char *comma = strchr(o->ps_first, ',');
    if (comma) *comma = '\0';
    char host[PS_ADDR_LEN];
    int port;
    if (ps_parse_hostport(o->ps_first, host, sizeof host, &port) != 0 || port == 0) {
      fprintf(stderr, "ps-worker: '%s' is not a server address HOST:PORT\n", o->ps_first);
      return PS_WORKER_EXIT_USAGE;
    }
    o->ps_addr = o->ps_first;
  }
  snprintf(o->hostname, sizeof o->hostname, "localhost");
  gethostname(o->hostname, sizeof o->hostname - 1);
  if (!o->host) o->host = o->hostname;
  return 0;
}

/* The worker's Prometheus endpoint (--metrics-port): steps, examples,
 * where each step's time went (a histogram per phase), the training loss
 * and accuracy, the pushes' staleness, and the chief's or evaluator's test
 * figures. The training thread adds each step under a mutex; a scrape
 * reads them on the endpoint's thread. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/prom.h"
#include "worker/train/step.h"

enum { PHASES = 3, STEP_BUCKETS = 14 };
static const char *const phase_names[PHASES] = {"pull", "compute", "push"};
static const double step_bounds[STEP_BUCKETS] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                 0.1,    0.25,  0.5,    1,     2.5,   5,    10};
/* the weight of a new step in the training loss and accuracy gauges */
#define EMA_WEIGHT 0.1

typedef struct ps_worker_mon {
  pthread_mutex_t mu;
  ps_prom_server *server;
  ps_token extra; /* --metrics-token-file */
  uint64_t steps, examples, pushes;
  double staleness_sum;
  uint64_t hist[PHASES][STEP_BUCKETS + 1];
  double phase_sum[PHASES];
  double loss, accuracy; /* moving averages; NAN before the first step */
  int epoch;
  int evals;
  double test_accuracy, test_loss, eval_time;
} ps_worker_mon;

void ps_worker_prom_step(ps_worker *w, const ps_step_result *r, int n, int epoch) {
  ps_worker_mon *m = w->mon;
  if (!m) return;
  const double t[PHASES] = {r->pull_s, r->compute_s, r->push_s};
  double acc = n > 0 ? (double)r->correct / n : 0;
  pthread_mutex_lock(&m->mu);
  m->steps++;
  m->examples += (uint64_t)n;
  for (int p = 0; p < PHASES; p++) {
    int i = 0;
    while (i < STEP_BUCKETS && t[p] > step_bounds[i]) i++;
    m->hist[p][i]++;
    m->phase_sum[p] += t[p];
  }
  if (r->pushed && w->nshards > 0) {
    m->pushes++;
    m->staleness_sum += (double)r->res.staleness_sum / w->nshards;
  }
  if (isnan(m->loss)) {
    m->loss = r->loss;
    m->accuracy = acc;
  } else {
    m->loss += EMA_WEIGHT * ((double)r->loss - m->loss);
    m->accuracy += EMA_WEIGHT * (acc - m->accuracy);
  }
  m->epoch = epoch;
  pthread_mutex_unlock(&m->mu);
}

void ps_worker_prom_eval(ps_worker *w, double accuracy, double loss) {
  ps_worker_mon *m = w->mon;
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  m->evals++;
  m->test_accuracy = accuracy;
  m->test_loss = loss;
  m->eval_time = ps_wall_s();
  pthread_mutex_unlock(&m->mu);
}

static const char *role(const ps_worker *w) {
  return w->o.local ? "local" : w->o.evaluator ? "evaluator" : w->o.chief ? "chief" : "worker";
}

static void collect(ps_prom_buf *b, void *user) {
  ps_worker *w = user;
  ps_worker_mon *m = w->mon, s;
  pthread_mutex_lock(&m->mu);
  s = *m;
  pthread_mutex_unlock(&m->mu);
  char lab[48], info[400], job[200], rl[48], dev[300];
  snprintf(lab, sizeof lab, "worker=\"%d\"", w->rank);
  ps_prom_process(b, "ps-worker");
  snprintf(info, sizeof info, "%s,%s,%s,%s", lab, ps_prom_label(rl, sizeof rl, "role", role(w)),
           ps_prom_label(job, sizeof job, "job_id", w->job.job_id),
           ps_prom_label(dev, sizeof dev, "device", w->device_desc));
  ps_prom_metric(b, "ps_worker_info", "gauge", "The worker's role, job and device (1).", info, 1);
  ps_prom_metric(b, "ps_worker_steps_total", "counter", "Training steps done.", lab,
                 (double)s.steps);
  ps_prom_metric(b, "ps_worker_examples_total", "counter", "Training examples computed.", lab,
                 (double)s.examples);
  ps_prom_metric(b, "ps_worker_epoch", "gauge", "The data epoch of the last step.", lab, s.epoch);
  ps_prom_family(b, "ps_worker_step_seconds", "histogram",
                 "Where each step's time went: waiting for parameters (pull), computing the "
                 "gradient (compute), sending it (push).");
  for (int p = 0; p < PHASES; p++) {
    char pl[96];
    snprintf(pl, sizeof pl, "%s,phase=\"%s\"", lab, phase_names[p]);
    ps_prom_histogram(b, "ps_worker_step_seconds", pl, step_bounds, s.hist[p], STEP_BUCKETS,
                      s.phase_sum[p]);
  }
  ps_prom_family(b, "ps_worker_push_staleness", "summary",
                 "Staleness of the worker's pushes (versions the shards applied since its pull, "
                 "mean over the shards).");
  ps_prom_sample(b, "ps_worker_push_staleness_sum", lab, s.staleness_sum);
  ps_prom_sample(b, "ps_worker_push_staleness_count", lab, (double)s.pushes);
  if (s.steps) {
    ps_prom_metric(b, "ps_worker_train_loss", "gauge",
                   "Training loss, a moving average over steps (weight 0.1 for the newest).", lab,
                   s.loss);
    ps_prom_metric(b, "ps_worker_train_accuracy", "gauge",
                   "Training accuracy, a moving average over steps (weight 0.1 for the newest).",
                   lab, s.accuracy);
  }
  if (s.evals) {
    ps_prom_metric(b, "ps_worker_test_accuracy", "gauge", "Accuracy on the test split, last "
                   "evaluation.", lab, s.test_accuracy);
    ps_prom_metric(b, "ps_worker_test_loss", "gauge", "Loss on the test split, last evaluation.",
                   lab, s.test_loss);
    ps_prom_metric(b, "ps_worker_last_evaluation_timestamp_seconds", "gauge",
                   "When the last evaluation finished (Unix time).", lab, s.eval_time);
  }
  ps_prom_metric(b, "ps_worker_evaluations_total", "counter", "Evaluations of the test split.",
                 lab, s.evals);
}

int ps_worker_prom_start(ps_worker *w) {
  const ps_worker_opts *o = &w->o;
  if (o->metrics_port < 0) return 0;
  ps_worker_mon *m = calloc(1, sizeof *m);
  char err[PS_ERRLEN], warning[PS_ERRLEN];
  if (!m) {
    fprintf(stderr, "ps-worker: out of memory\n");
    return PS_WORKER_EXIT_ERROR;
  }
  pthread_mutex_init(&m->mu, NULL);
  m->loss = m->accuracy = NAN;
  w->mon = m;
  if (o->metrics_token_file) {
    if (ps_token_load(o->metrics_token_file, &m->extra, warning, err) != 0) {
      fprintf(stderr, "ps-worker: --metrics-token-file: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
    if (warning[0]) PS_WARN("--metrics-token-file: %s", warning);
  }
  const char *host = o->metrics_host ? o->metrics_host : "127.0.0.1";
  int tls = o->sec.tls_cert && o->sec.tls_key;
  ps_prom_opts po = {.host = host,
                     .port = o->metrics_port,
                     .tokens = {&w->sec.token, &m->extra},
                     .tls_cert = tls ? o->sec.tls_cert : NULL,
                     .tls_key = tls ? o->sec.tls_key : NULL};
  m->server = ps_prom_start(&po, collect, w, err);
  if (!m->server) {
    fprintf(stderr, "ps-worker: %s\n", err);
    return PS_WORKER_EXIT_USAGE;
  }
  int guarded = w->sec.token.len || m->extra.len;
  PS_INFO("metrics: Prometheus endpoint on %s://%s:%d/metrics%s", tls ? "https" : "http", host,
          ps_prom_port(m->server),
          guarded ? " (a bearer token: the job's or --metrics-token-file's)" : "");
  if (guarded && !tls && strcmp(host, "127.0.0.1") != 0 && strcmp(host, "localhost") != 0 &&
      strcmp(host, "::1") != 0)
    PS_WARN("metrics: plain HTTP on %s: a scrape's token crosses the network in clear (give "
            "--tls-cert and --tls-key for HTTPS)", host);
  return 0;
}

void ps_worker_prom_stop(ps_worker *w) {
  ps_worker_mon *m = w->mon;
  if (!m) return;
  ps_prom_stop(m->server);
  pthread_mutex_destroy(&m->mu);
  free(m);
  w->mon = NULL;
}

/* ps-loadgen: load on real shards without a model to compute. W simulated
 * workers in one process, each a real client (ps_client: registration,
 * sessions, the job's wire encoding, embedding rows, TLS, a connection of
 * its own to every shard), pull and push the job's parameters in a loop, as
 * fast as they can or at a set rate, optionally sleeping a fixed "compute"
 * time between the pull and the push. It reports updates/s, the bytes each
 * way (the shards' own counters), the latency percentiles of pulls and
 * pushes, the servers' CPU per update (from their Status) and errors.
 *
 * One thread per simulated worker: each runs the blocking client exactly as
 * a ps-worker's training loop does, so what is measured is the real path,
 * not a re-implementation of it. The threads have small stacks; a thousand
 * of them cost little memory beyond each worker's parameter buffer.
 *
 * Counting window: after --warmup seconds, for --duration seconds. An
 * operation counts when it ends inside the window; the servers' counters
 * are read at the window's two ends. Besides, every shard's version is read
 * before the first worker connects and after the last has left, so that a
 * run on an async job with no other client can be checked: every push
 * acknowledged was applied once by every shard. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "common/atomic_file.h"
#include "common/cluster.h"
#include "common/job.h"
#include "common/options.h"
#include "common/rng.h"
#include "common/security.h"
#include "common/util.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "worker/client/ps_client.h"

#define LG_MAX_WORKERS 100000
#define LG_STACK_BYTES (512u << 10)
/* Latency histogram: 32 buckets per power of two of microseconds (3%
 * resolution), from 1 us to 2^28 us (4.5 minutes). */
#define LG_SUB 32
#define LG_OCTAVES 28
#define LG_BUCKETS (LG_SUB * LG_OCTAVES + 1)

typedef struct {
  const char *ps, *json_path;
  int workers, rate, compute_ms, rows, timeout_ms, connect_timeout_s, allow_errors;
  int own_conn_choice, log_level, max_memory_mb;
  double duration, warmup;
  int64_t id_space, seed;
  ps_security_opts sec;
} lg_opts;

#define O(field) offsetof(lg_opts, field)

static const char *const conn_choices[] = {"own", "shared", NULL};
static const char *const level_choices[] = {"debug", "info", "warn", "error", NULL};

static const ps_option lg_flags[] = {
    {"ps", "HOST:PORT[,...]", PS_OPT_STR, O(ps), .help =
     "the shards (any one registers the workers; all are asked for their Status), required"},
    {"workers", "W", PS_OPT_INT, O(workers), 1, LG_MAX_WORKERS, .def = "100",
     .help = "simulated workers, each a client with its own connections and one thread"},
    {"duration", "S", PS_OPT_SECS, O(duration), 0, .excl_lo = 1, .def = "10",
     .help = "seconds measured, after the warm-up"},
    {"warmup", "S", PS_OPT_SECS, O(warmup), 0, .def = "2",
     .help = "seconds of load before the measurement starts (not counted)"},
    {"rate", "R", PS_OPT_INT, O(rate), 0, 100000000, .def = "0", .help =
     "updates per second of all workers together, each worker starting its steps on its own "
     "schedule (0: as fast as they can, each step right after the last)"},
    {"compute-ms", "MS", PS_OPT_INT, O(compute_ms), 0, 3600000, .def = "0",
     .help = "sleep this long between a step's pull and its push, as a worker's compute"},
    {"rows", "N", PS_OPT_INT, O(rows), 0, 1 << 20, .def = "0", .help =
     "embedding rows per step of each of the job's tables, pulled and pushed beside the dense "
     "values (the job must have tables); ids drawn uniformly, distinct within a step"},
    {"id-space", "N", PS_OPT_I64, O(id_space), 1, 9e18, .def = "1000000",
     .help = "ids are drawn from [0, N) (a bounded table: from its rows, when fewer)"},
    {"seed", "S", PS_OPT_I64, O(seed), 0, 9e18, .def = "1",
     .help = "the seed of the ids and of the workers' start times"},
    {"connections", "C", PS_OPT_CHOICE, O(own_conn_choice), .choices = conn_choices,
     .def = "own", .help =
     "`own`: every simulated worker its own connection to every shard, as separate worker "
     "processes have; `shared`: one connection per shard for all (gRPC's default in one "
     "process)"},
    {"timeout-ms", "MS", PS_OPT_INT, O(timeout_ms), 1, 3600000, .def = "30000",
     .help = "deadline of each call"},
    {"connect-timeout", "S", PS_OPT_INT, O(connect_timeout_s), 1, 3600, .def = "120",
     .help = "how long all workers may take to register"},
    {"max-memory-mb", "MB", PS_OPT_INT, O(max_memory_mb), 1, 1 << 30, .def = "8192", .help =
     "refuse a run whose workers' buffers (W x the parameters, and their rows) would need more"},
    {"allow-errors", NULL, PS_OPT_FLAG, O(allow_errors), .help =
     "exit 0 even when calls failed (an overload test); else any failed call or registration "
     "makes the exit status 1"},
    {"json", "FILE", PS_OPT_STR, O(json_path), .help = "also write the report as JSON to FILE"},
    {"log-level", "L", PS_OPT_CHOICE, O(log_level), .choices = level_choices, .def = "info",
     .help = "`debug`, `info`, `warn` or `error`"},
    PS_CLIENT_SECURITY_OPTIONS(lg_opts, "the job's token, as the servers were given it",
                               "the workers'"),
};

static const ps_optspec lg_spec = {
    .prog = "ps-loadgen",
    .synopsis =
        "Usage: ps-loadgen --ps HOST:PORT[,...] [--workers W] [--duration S] [--rate R]\n"
        "                  [--compute-ms MS] [--rows N] [--json FILE] [security flags]\n"
        "\n"
        "Drives real shards with W simulated workers (no model compute): each pulls and\n"
        "pushes the job's parameters in a loop, through the client ps-worker uses. Reports\n"
        "updates/s, bytes/s, pull and push latency (p50, p99, p99.9), the servers' CPU per\n"
        "update and errors. It pushes gradients: point it at a job of its own (say\n"
        "{\"model\": {\"params\": P}}, max_workers >= W), never at a job being trained.\n",
    .opts = lg_flags,
    .n_opts = (int)(sizeof lg_flags / sizeof lg_flags[0]),
    .footer = "Exit status: 0 done, 1 a call or registration failed (see --allow-errors) or\n"
              "the run could not start, 2 bad usage.",
};

/* ---------------------------------------------------------------- latency */

typedef struct {
  uint32_t b[LG_BUCKETS];
  uint64_t n;
  double sum_us, max_us;
} lg_hist;

static int bucket_of(double us) {
  if (!(us >= 1.0)) return 0;
  int e;
  double m = frexp(us, &e); /* us = m * 2^e, m in [0.5, 1) */
  int oct = e - 1;
  if (oct >= LG_OCTAVES) return LG_BUCKETS - 1;
  int sub = (int)((m * 2.0 - 1.0) * LG_SUB);
  if (sub >= LG_SUB) sub = LG_SUB - 1;
  return 1 + oct * LG_SUB + sub;
}

/* The middle of a bucket, in microseconds. */
static double bucket_mid(int i) {
  if (i == 0) return 0.5;
  int oct = (i - 1) / LG_SUB, sub = (i - 1) % LG_SUB;
  return ldexp(1.0 + (sub + 0.5) / LG_SUB, oct);
}

static void hist_add(lg_hist *h, double us) {
  h->b[bucket_of(us)]++;
  h->n++;
  h->sum_us += us;
  if (us > h->max_us) h->max_us = us;
}

static void hist_merge(lg_hist *into, const lg_hist *h) {
  for (int i = 0; i < LG_BUCKETS; i++) into->b[i] += h->b[i];
  into->n += h->n;
  into->sum_us += h->sum_us;
  if (h->max_us > into->max_us) into->max_us = h->max_us;
}

/* The q-quantile in milliseconds (the bucket's middle; the max when the
 * quantile falls in the last occupied bucket beyond it). */
static double hist_quantile_ms(const lg_hist *h, double q) {
  if (h->n == 0) return 0;
  uint64_t rank = (uint64_t)ceil(q * (double)h->n), seen = 0;
  if (rank < 1) rank = 1;
  for (int i = 0; i < LG_BUCKETS; i++) {
    seen += h->b[i];
    if (seen >= rank) {
      double v = bucket_mid(i);
      return (v > h->max_us ? h->max_us : v) / 1000.0;
    }
  }
  return h->max_us / 1000.0;
}

/* ---------------------------------------------------------------- the shards' Status */

typedef struct {
  int ok;
  uint64_t version, pushes, pulls, push_bytes, pull_bytes;
  double cpu_s;
  char mode[16];
} lg_shard_stat;

typedef struct {
  int n;
  ps_cluster *cl;
  rpc_channel **ch;
  rpc_queue *q;
  const ps_security *sec;
} lg_status;

static int status_open(lg_status *st, const char *list, const ps_security *sec, char *err) {
  memset(st, 0, sizeof *st);
  st->sec = sec;
  st->cl = calloc(1, sizeof *st->cl);
  if (!st->cl) return ps_seterr(err, PS_ENOMEM, "out of memory");
  if (ps_cluster_parse_ps_list(list, st->cl, err) != 0) return PS_EINVAL;
  st->n = st->cl->n_ps;
  st->ch = calloc((size_t)st->n, sizeof *st->ch);
  st->q = rpc_queue_create();
  if (!st->ch || !st->q) return ps_seterr(err, PS_ENOMEM, "out of memory");
  rpc_channel_opts co = {.tls = ps_security_tls(sec)};
  for (int i = 0; i < st->n; i++)
    if (!(st->ch[i] = rpc_channel_create(st->cl->ps[i], &co, err))) return PS_EINVAL;
  return 0;
}

static void status_close(lg_status *st) {
  for (int i = 0; st->ch && i < st->n; i++)
    if (st->ch[i]) rpc_channel_destroy(st->ch[i]);
  if (st->q) rpc_queue_destroy(st->q);
  free(st->ch);
  free(st->cl);
  memset(st, 0, sizeof *st);
}

/* Every shard's counters; a shard that does not answer is marked !ok. */
static void status_read(lg_status *st, lg_shard_stat *out) {
  for (int i = 0; i < st->n; i++) {
    memset(&out[i], 0, sizeof out[i]);
    char why[PS_ERRLEN];
    int rc;
    Ps__StatusResponse *r = ps_status_call(st->q, st->ch[i], &st->sec->token, 10000, &rc, why);
    if (!r) {
      PS_WARN("shard %s: no Status (%s)", st->cl->ps[i], why);
      continue;
    }
    out[i] = (lg_shard_stat){.ok = 1,
                             .version = r->version,
                             .pushes = r->pushes,
                             .pulls = r->pulls,
                             .push_bytes = r->push_bytes,
                             .pull_bytes = r->pull_bytes,
                             .cpu_s = r->cpu_seconds};
    snprintf(out[i].mode, sizeof out[i].mode, "%s", r->mode ? r->mode : "");
    ps__status_response__free_unpacked(r, NULL);
  }
}

/* ---------------------------------------------------------------- the workers */

typedef struct lg_run lg_run;

typedef struct {
  lg_run *run;
  int k;
  pthread_t th;
  ps_client *c;
  float *params;
  uint64_t *versions;
  /* embedding rows, per table */
  uint64_t *ids[PS_MAX_TABLES];
  float *row_vals[PS_MAX_TABLES], *row_grads[PS_MAX_TABLES];
  ps_rand rng;
  /* results (read by the main thread after the join; updates also while
   * running, for the progress line) */
  _Atomic uint64_t updates_all; /* acknowledged pushes, whole run */
  uint64_t updates, pulls, late, rows_moved;
  lg_hist pull_h, push_h;
  uint64_t errors;
  char first_error[PS_ERRLEN + 16];
  int connected; /* 1 connected, -1 failed */
} lg_worker;

struct lg_run {
  lg_opts o;
  ps_security sec;
  ps_job job;
  int have_job;
  size_t P;
  int nshards;
  const float *grads; /* shared by all workers: read only */
  lg_worker *w;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int n_connected, n_failed, go; /* under mu */
  double t_start, t_win0, t_win1; /* set before go */
  atomic_int stop;
  int hb_ms;
  int nshards_listed; /* the --ps list, whose Status is read */
  const char *first;  /* its first address: where the workers register */
};

static volatile sig_atomic_t g_signal;
static void on_signal(int sig) { g_signal = sig; }

static void worker_error(lg_worker *w, const char *what, const char *err) {
  w->errors++;
  if (!w->first_error[0]) snprintf(w->first_error, sizeof w->first_error, "%s: %s", what, err);
  PS_DEBUG("worker %d: %s: %s", w->k, what, err);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Draws the step's ids (distinct, sorted) and sets them on the client. */
static int set_rows(lg_worker *w, char *err) {
  lg_run *r = w->run;
  ps_client_rows secs[PS_MAX_TABLES];
  for (int t = 0; t < r->job.n_tables; t++) {
    uint64_t space = (uint64_t)r->o.id_space;
    if (r->job.tables[t].rows && r->job.tables[t].rows < space) space = r->job.tables[t].rows;
    size_t n = (size_t)r->o.rows;
    for (size_t i = 0; i < n; i++) w->ids[t][i] = ps_rand_below(&w->rng, space);
    qsort(w->ids[t], n, sizeof(uint64_t), cmp_u64);
    size_t u = 0;
    for (size_t i = 0; i < n; i++)
      if (u == 0 || w->ids[t][i] != w->ids[t][u - 1]) w->ids[t][u++] = w->ids[t][i];
    secs[t] = (ps_client_rows){
        .table = t, .ids = w->ids[t], .n = u, .values = w->row_vals[t], .grads = w->row_grads[t]};
    w->rows_moved += u;
  }
  return ps_client_set_rows(w->c, secs, r->job.n_tables, err);
}

static int worker_alloc(lg_worker *w, char *err) {
  lg_run *r = w->run;
  w->params = ps_alloc(r->P * sizeof(float));
  w->versions = calloc((size_t)r->nshards, sizeof(uint64_t));
  if (!w->params || !w->versions) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (int t = 0; r->o.rows > 0 && t < r->job.n_tables; t++) {
    size_t n = (size_t)r->o.rows, dim = (size_t)r->job.tables[t].dim;
    w->ids[t] = malloc(n * sizeof(uint64_t));
    w->row_vals[t] = malloc(n * dim * sizeof(float));
    w->row_grads[t] = malloc(n * dim * sizeof(float));
    if (!w->ids[t] || !w->row_vals[t] || !w->row_grads[t])
      return ps_seterr(err, PS_ENOMEM, "out of memory");
    for (size_t i = 0; i < n * dim; i++) w->row_grads[t][i] = 1e-6f;
  }
  return 0;
}

static void worker_free(lg_worker *w) {
  ps_free(w->params);
  free(w->versions);
  for (int t = 0; t < PS_MAX_TABLES; t++) {
    free(w->ids[t]);
    free(w->row_vals[t]);
    free(w->row_grads[t]);
  }
}

/* Sleeps until t (ps_now_s), heartbeating while idle long enough that a
 * shard could time the worker out. Returns early when the run stops. */
static void idle_until(lg_worker *w, double t, double *last_heard) {
  lg_run *r = w->run;
  char err[PS_ERRLEN];
  for (;;) {
    double now = ps_now_s();
    if (now >= t || atomic_load(&r->stop)) return;
    if ((now - *last_heard) * 1000.0 >= r->hb_ms / 3.0) {
      if (ps_client_heartbeat(w->c, w->updates_all, NULL, err) != 0)
        worker_error(w, "heartbeat", err);
      *last_heard = ps_now_s();
      continue;
    }
    double left = t - now, cap = r->hb_ms / 6000.0;
    ps_sleep_ms((int64_t)(1000.0 * (left < cap ? left : cap)) + 1);
  }
}

static int in_window(const lg_run *r, double t) { return t >= r->t_win0 && t <= r->t_win1; }

static void worker_loop(lg_worker *w) {
  lg_run *r = w->run;
  char err[PS_ERRLEN];
  double period = r->o.rate > 0 ? (double)r->o.workers / (double)r->o.rate : 0;
  /* each worker's schedule starts at its own phase of the period */
  double next = r->t_start + period * (double)(ps_rand_next(&w->rng) >> 11) * 0x1p-53;
  double last_heard = ps_now_s();
  while (!atomic_load(&r->stop)) {
    if (period > 0) {
      idle_until(w, next, &last_heard);
      if (atomic_load(&r->stop)) break;
      double now = ps_now_s();
      if (now - next > 0.1 * period && in_window(r, now)) w->late++;
      next += period;
      if (next < now - period) next = now; /* far behind: no burst to catch up */
    }
    if (ps_now_s() > r->t_win1) break;
    if (r->o.rows > 0 && r->job.n_tables > 0 && set_rows(w, err) != 0) {
      worker_error(w, "rows", err);
      break; /* a bad table or id space: every step would fail alike */
    }
    double t0 = ps_now_s();
    if (ps_client_pull(w->c, w->params, w->versions, NULL, err) != 0) {
      worker_error(w, "pull", err);
      ps_sleep_ms(100);
      continue;
    }
    double t1 = ps_now_s();
    if (in_window(r, t1)) {
      hist_add(&w->pull_h, (t1 - t0) * 1e6);
      w->pulls++;
    }
    if (r->o.compute_ms > 0) idle_until(w, t1 + r->o.compute_ms / 1000.0, &last_heard);
    double t2 = ps_now_s();
    ps_push_result res;
    uint64_t step = atomic_load(&w->updates_all);
    if (ps_client_push(w->c, r->grads, w->versions, step, 1, &res, err) != 0) {
      worker_error(w, "push", err);
      ps_sleep_ms(100);
      continue;
    }
    double t3 = ps_now_s();
    last_heard = t3;
    atomic_fetch_add(&w->updates_all, 1);
    if (in_window(r, t3)) {
      hist_add(&w->push_h, (t3 - t2) * 1e6);
      w->updates++;
    }
  }
}

static void *worker_main(void *arg) {
  lg_worker *w = arg;
  lg_run *r = w->run;
  char err[PS_ERRLEN] = "";
  char host[64];
  snprintf(host, sizeof host, "loadgen-%d", w->k);
  ps_client_opts co = {.host = host,
                       .role = "worker",
                       .task_index = w->k,
                       .timeout_ms = r->o.timeout_ms,
                       .connect_timeout_ms = r->o.connect_timeout_s * 1000,
                       .token = r->sec.token.len ? &r->sec.token : NULL,
                       .tls = ps_security_tls(&r->sec),
                       .own_connections = r->o.own_conn_choice == 0};
  int ok = worker_alloc(w, err) == 0;
  if (ok && !(w->c = ps_client_connect(r->first, &co, err))) ok = 0;
  if (ok && ps_client_param_count(w->c) != r->P) {
    snprintf(err, sizeof err, "the job has %zu parameters, the first worker saw %zu",
             ps_client_param_count(w->c), r->P);
    ok = 0;
  }
  if (ok && ps_client_set_wire(w->c, r->job.wire, err) != 0) ok = 0;
  pthread_mutex_lock(&r->mu);
  if (ok) {
    w->connected = 1;
    r->n_connected++;
  } else {
    w->connected = -1;
    r->n_failed++;
    w->errors++;
    snprintf(w->first_error, sizeof w->first_error, "register: %s", err);
  }
  pthread_cond_broadcast(&r->cv);
  /* The others may take longer to register than the shards wait for a
   * silent worker: heartbeat while waiting for the start. */
  while (ok && !r->go && !atomic_load(&r->stop)) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    int64_t ns = until.tv_nsec + (int64_t)r->hb_ms * 1000000 / 3;
    until.tv_sec += ns / 1000000000;
    until.tv_nsec = ns % 1000000000;
    if (pthread_cond_timedwait(&r->cv, &r->mu, &until) == ETIMEDOUT && !r->go) {
      pthread_mutex_unlock(&r->mu);
      if (ps_client_heartbeat(w->c, 0, NULL, err) != 0) worker_error(w, "heartbeat", err);
      pthread_mutex_lock(&r->mu);
    }
  }
  pthread_mutex_unlock(&r->mu);
  if (ok && !atomic_load(&r->stop)) worker_loop(w);
  if (w->c) {
    ps_client_leave(w->c);
    ps_client_destroy(w->c);
    w->c = NULL;
  }
  return NULL;
}

/* ---------------------------------------------------------------- set-up and report */

/* The job, from a first client (which then leaves). Returns 0, 1 when
 * the servers could not be reached or answered wrong, 2 when the flags do
 * not fit the job; a message in err. */
static int learn_job(lg_run *r, char *err) {
  ps_client_opts co = {.host = "loadgen-probe",
                       .role = "worker",
                       .task_index = -1,
                       .timeout_ms = r->o.timeout_ms,
                       .connect_timeout_ms = r->o.connect_timeout_s * 1000,
                       .token = r->sec.token.len ? &r->sec.token : NULL,
                       .tls = ps_security_tls(&r->sec)};
  ps_client *c = ps_client_connect(r->first, &co, err);
  if (!c) return 1;
  int rc = ps_job_parse(ps_client_job_json(c), &r->job, err);
  r->P = ps_client_param_count(c);
  r->nshards = ps_client_num_shards(c);
  r->hb_ms = ps_client_heartbeat_timeout_ms(c);
  if (r->hb_ms <= 0) r->hb_ms = r->job.heartbeat_timeout_ms;
  ps_client_leave(c);
  ps_client_destroy(c);
  if (rc != 0) return 1;
  r->have_job = 1;
  if (r->o.rows > 0 && r->job.n_tables == 0)
    return ps_seterr(err, 2, "--rows %d: job '%s' has no embedding tables", r->o.rows,
                     r->job.job_id);
  if (r->o.workers > r->job.max_workers)
    return ps_seterr(err, 2,
                     "--workers %d: job '%s' takes at most %d workers on a shard (its "
                     "max_workers)",
                     r->o.workers, r->job.job_id, r->job.max_workers);
  double bytes = (double)r->P * 4.0 * (r->job.wire == PS_WIRE_FP32 ? 1.0 : 2.5);
  for (int t = 0; t < r->job.n_tables; t++)
    bytes += (double)r->o.rows * (8.0 + 8.0 * r->job.tables[t].dim);
  double total_mb = bytes * r->o.workers / (1024.0 * 1024.0);
  if (total_mb > r->o.max_memory_mb)
    return ps_seterr(err, 2,
                     "%d workers x %zu parameters need about %.0f MiB of buffers, over "
                     "--max-memory-mb %d",
                     r->o.workers, r->P, total_mb, r->o.max_memory_mb);
  return 0;
}

static json_t *lat_json(const lg_hist *h) {
  return json_pack("{s:I,s:f,s:f,s:f,s:f,s:f}", "count", (json_int_t)h->n, "mean_ms",
                   h->n ? h->sum_us / (double)h->n / 1000.0 : 0.0, "p50_ms",
                   hist_quantile_ms(h, 0.50), "p99_ms", hist_quantile_ms(h, 0.99), "p999_ms",
                   hist_quantile_ms(h, 0.999), "max_ms", h->max_us / 1000.0);
}

static void print_lat(const char *what, const lg_hist *h) {
  printf("  %-5s %8" PRIu64 " calls  p50 %.2f  p99 %.2f  p99.9 %.2f  max %.2f  mean %.2f ms\n",
         what, h->n, hist_quantile_ms(h, 0.50), hist_quantile_ms(h, 0.99),
         hist_quantile_ms(h, 0.999), h->max_us / 1000.0,
         h->n ? h->sum_us / (double)h->n / 1000.0 : 0.0);
}

typedef struct {
  lg_shard_stat *before, *w0, *w1, *after;
} lg_snaps;

static int report(lg_run *r, const lg_snaps *sn, double connect_s, double cpu_gen_s) {
  int ns = 0;
  lg_hist pull_h = {0}, push_h = {0};
  uint64_t updates = 0, pulls = 0, late = 0, errors = 0, acked = 0, rows_moved = 0;
  const char *first_error = "";
  int connected = 0;
  for (int k = 0; k < r->o.workers; k++) {
    lg_worker *w = &r->w[k];
    hist_merge(&pull_h, &w->pull_h);
    hist_merge(&push_h, &w->push_h);
    updates += w->updates;
    pulls += w->pulls;
    late += w->late;
    errors += w->errors;
    acked += atomic_load(&w->updates_all);
    rows_moved += w->rows_moved;
    connected += w->connected == 1;
    if (!first_error[0] && w->first_error[0]) first_error = w->first_error;
  }
  double win = r->o.duration;
  uint64_t push_b = 0, pull_b = 0;
  double cpu = 0;
  int counters_ok = 1;
  for (int i = 0; i < r->nshards_listed; i++) {
    if (!sn->w0[i].ok || !sn->w1[i].ok) {
      counters_ok = 0;
      continue;
    }
    ns++;
    push_b += sn->w1[i].push_bytes - sn->w0[i].push_bytes;
    pull_b += sn->w1[i].pull_bytes - sn->w0[i].pull_bytes;
    cpu += sn->w1[i].cpu_s - sn->w0[i].cpu_s;
  }
  json_t *applied = json_array();
  int applied_all = 1;
  uint64_t run_push_b = 0; /* the whole run's, for the bytes per push */
  for (int i = 0; i < r->nshards_listed; i++) {
    if (!sn->before[i].ok || !sn->after[i].ok) {
      json_array_append_new(applied, json_null());
      applied_all = 0;
      continue;
    }
    uint64_t d = sn->after[i].version - sn->before[i].version;
    run_push_b += sn->after[i].push_bytes - sn->before[i].push_bytes;
    json_array_append_new(applied, json_integer((json_int_t)d));
    if (d != acked) applied_all = 0;
  }
  double ups = updates / win;
  printf("ps-loadgen: %d of %d workers registered in %.2f s; %d shards, %zu parameters, wire "
         "%s, %s, %s connections\n",
         connected, r->o.workers, connect_s, r->nshards, r->P, ps_wire_name(r->job.wire),
         r->sec.use_tls ? (r->sec.tls.cert_file ? "mutual TLS" : "TLS") : "plaintext",
         r->o.own_conn_choice == 0 ? "own" : "shared");
  printf("  window %.1f s: %" PRIu64 " updates, %.1f updates/s (rate %s), %" PRIu64
         " pulls; %" PRIu64 " steps started late\n",
         win, updates, ups, r->o.rate > 0 ? "set" : "as fast as they can", pulls, late);
  if (counters_ok)
    printf("  shards: push %.1f MB/s in, pull %.1f MB/s out; CPU %.3f cores, %.1f us per "
           "update\n",
           push_b / win / 1e6, pull_b / win / 1e6, cpu / win, updates ? cpu / updates * 1e6 : 0.0);
  else
    printf("  shards: a shard did not answer Status; bytes and CPU not measured\n");
  print_lat("pull", &pull_h);
  print_lat("push", &push_h);
  printf("  load generator: CPU %.2f cores; errors %" PRIu64 "%s%s\n", cpu_gen_s / win, errors,
         errors ? ", first: " : "", first_error);
  if (r->job.mode_kind == PS_MODE_ASYNC)
    printf("  every shard applied the %" PRIu64 " pushes acknowledged over the run: %s\n", acked,
           applied_all ? "yes" : "no (another client pushed, a call failed, or a shard restarted)");
  if (r->o.json_path) {
    json_t *o = json_pack(
        "{s:i,s:i,s:i,s:I,s:s,s:b,s:b,s:s,s:s,s:f,s:f,s:I,s:f,s:I,s:I,s:i,s:i,s:I,s:I,s:o,s:o}",
        "workers", r->o.workers, "connected", connected, "shards", r->nshards, "params",
        (json_int_t)r->P, "wire", ps_wire_name(r->job.wire), "tls", r->sec.use_tls,
        "mutual_tls", r->sec.use_tls && r->sec.tls.cert_file != NULL, "connections",
        r->o.own_conn_choice == 0 ? "own" : "shared", "mode", r->job.mode, "connect_s",
        connect_s, "window_s", win, "updates", (json_int_t)updates, "updates_per_s", ups,
        "pulls", (json_int_t)pulls, "late_steps", (json_int_t)late, "rate", r->o.rate,
        "compute_ms", r->o.compute_ms, "errors", (json_int_t)errors, "acked_total",
        (json_int_t)acked, "pull", lat_json(&pull_h), "push", lat_json(&push_h));
    json_object_set_new(o, "first_error", json_string(first_error));
    json_object_set_new(o, "rows_per_step", json_integer(r->o.rows));
    json_object_set_new(o, "rows_moved", json_integer((json_int_t)rows_moved));
    json_object_set_new(o, "applied_per_shard", applied);
    json_object_set_new(o, "applied_all", json_boolean(applied_all));
    if (applied_all && acked)
      json_object_set_new(o, "push_bytes_per_update", json_real((double)run_push_b / acked));
    json_object_set_new(o, "loadgen_cpu_cores", json_real(cpu_gen_s / win));
    if (counters_ok) {
      json_object_set_new(o, "push_bytes_per_s", json_real(push_b / win));
      json_object_set_new(o, "pull_bytes_per_s", json_real(pull_b / win));
      json_object_set_new(o, "server_cpu_cores", json_real(cpu / win));
      json_object_set_new(o, "server_cpu_us_per_update",
                          json_real(updates ? cpu / updates * 1e6 : 0.0));
    }
    char *text = json_dumps(o, JSON_INDENT(1));
    json_decref(o);
    char err[PS_ERRLEN];
    int wrc = text ? ps_write_file_atomic(r->o.json_path, text, strlen(text), err) : PS_ENOMEM;
    free(text);
    if (wrc != 0) {
      fprintf(stderr, "ps-loadgen: --json %s: %s\n", r->o.json_path, err);
      return 1;
    }
  } else {
    json_decref(applied);
  }
  return errors && !r->o.allow_errors ? 1 : 0;
}

/* Waits until every worker registered or failed, or the time-out. */
static void wait_connected(lg_run *r, double deadline) {
  pthread_mutex_lock(&r->mu);
  double last = ps_now_s();
  while (r->n_connected + r->n_failed < r->o.workers && !g_signal) {
    double now = ps_now_s();
    if (now >= deadline) break;
    if (now - last >= 5.0) {
      PS_INFO("%d of %d workers registered", r->n_connected, r->o.workers);
      last = now;
    }
    pthread_mutex_unlock(&r->mu);
    ps_sleep_ms(20);
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
}

static uint64_t updates_so_far(const lg_run *r) {
  uint64_t n = 0;
  for (int k = 0; k < r->o.workers; k++) n += atomic_load(&r->w[k].updates_all);
  return n;
}

/* Sleeps until t, printing a progress line every second; returns early on
 * a signal. */
static void run_until(lg_run *r, double t, const char *phase) {
  double next = ps_now_s() + 1.0;
  uint64_t last = updates_so_far(r);
  double last_t = ps_now_s();
  while (!g_signal) {
    double now = ps_now_s();
    if (now >= t) return;
    if (now >= next) {
      uint64_t n = updates_so_far(r);
      fprintf(stderr, "ps-loadgen: %s %.0f s left: %" PRIu64 " updates, %.0f/s\n", phase, t - now,
              n, (double)(n - last) / (now - last_t));
      last = n;
      last_t = now;
      next += 1.0;
    }
    double left = (next < t ? next : t) - now;
    ps_sleep_ms((int64_t)(left * 1000.0) + 1);
  }
}

static int start_workers(lg_run *r, char *err) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, LG_STACK_BYTES);
  int started = 0;
  for (int k = 0; k < r->o.workers; k++) {
    lg_worker *w = &r->w[k];
    w->run = r;
    w->k = k;
    ps_rand_seed(&w->rng, ps_splitmix64((uint64_t)r->o.seed * 0x9e3779b97f4a7c15ull + (uint64_t)k));
    int rc = pthread_create(&w->th, &attr, worker_main, w);
    if (rc != 0) {
      pthread_attr_destroy(&attr);
      return ps_seterr(err, PS_ENOMEM, "cannot start worker thread %d of %d: %s (ulimit -u?)", k,
                       r->o.workers, strerror(rc));
    }
    started++;
  }
  pthread_attr_destroy(&attr);
  return started;
}

int main(int argc, char **argv) {
  static lg_run r;
  if (ps_options_defaults(&lg_spec, &r.o) != 0) return 2;
  int prc = ps_options_parse(&lg_spec, argc, argv, &r.o);
  if (prc == 1) return 0;
  if (prc != 0) return 2;
  ps_log_init("ps-loadgen", r.o.log_level);
  if (!r.o.ps) {
    fprintf(stderr, "ps-loadgen: --ps HOST:PORT[,...] is required (see --help)\n");
    return 2;
  }
  char err[PS_ERRLEN] = "";
  if (ps_security_resolve(&r.o.sec, PS_SECURITY_CLIENT, &r.sec, err) != 0) {
    fprintf(stderr, "ps-loadgen: %s\n", err);
    return 2;
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max; /* a connection per worker and shard */
    (void)setrlimit(RLIMIT_NOFILE, &rl);
  }
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  rpc_global_init();
  lg_status st;
  int rc = status_open(&st, r.o.ps, &r.sec, err) != 0 ? 2 : 0;
  if (rc == 0) r.first = st.cl->ps[0];
  if (rc == 0) rc = learn_job(&r, err);
  if (rc == 0 && st.n < r.nshards) {
    snprintf(err, sizeof err, "--ps lists %d address(es), the job has %d shards: list them all "
             "(their Status is read)", st.n, r.nshards);
    rc = 2;
  }
  if (rc != 0) {
    fprintf(stderr, "ps-loadgen: %s\n", err);
    status_close(&st);
    rpc_global_shutdown();
    return rc;
  }
  r.nshards_listed = st.n;
  lg_snaps sn;
  sn.before = calloc((size_t)st.n, sizeof *sn.before);
  sn.w0 = calloc((size_t)st.n, sizeof *sn.w0);
  sn.w1 = calloc((size_t)st.n, sizeof *sn.w1);
  sn.after = calloc((size_t)st.n, sizeof *sn.after);
  float *grads = ps_alloc(r.P * sizeof(float));
  r.w = calloc((size_t)r.o.workers, sizeof *r.w);
  if (!sn.before || !sn.w0 || !sn.w1 || !sn.after || !grads || !r.w) {
    fprintf(stderr, "ps-loadgen: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < r.P; i++) grads[i] = 1e-6f * (float)(1 + i % 7);
  r.grads = grads;
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  atomic_init(&r.stop, 0);
  PS_INFO("job '%s': %zu parameters on %d shards, wire %s, mode %s; %d workers%s", r.job.job_id,
          r.P, r.nshards, ps_wire_name(r.job.wire), r.job.mode, r.o.workers,
          r.o.rate > 0 ? "" : ", as fast as they can");
  status_read(&st, sn.before);
  double t_conn = ps_now_s();
  int started = start_workers(&r, err);
  if (started < r.o.workers) {
    fprintf(stderr, "ps-loadgen: %s\n", err);
    atomic_store(&r.stop, 1);
  } else {
    wait_connected(&r, t_conn + r.o.connect_timeout_s + 5.0);
  }
  double connect_s = ps_now_s() - t_conn;
  pthread_mutex_lock(&r.mu);
  int all = r.n_connected == r.o.workers, some = r.n_connected > 0;
  pthread_mutex_unlock(&r.mu);
  if (!all) {
    PS_WARN("%d of %d workers registered in %.1f s", r.n_connected, r.o.workers, connect_s);
    if (!r.o.allow_errors || !some) atomic_store(&r.stop, 1);
  }
  double cpu0 = 0;
  if (!atomic_load(&r.stop) && !g_signal) {
    r.t_start = ps_now_s();
    r.t_win0 = r.t_start + r.o.warmup;
    r.t_win1 = r.t_win0 + r.o.duration;
    pthread_mutex_lock(&r.mu);
    r.go = 1;
    pthread_cond_broadcast(&r.cv);
    pthread_mutex_unlock(&r.mu);
    run_until(&r, r.t_win0, "warm-up");
    status_read(&st, sn.w0);
    cpu0 = ps_cpu_s();
    run_until(&r, r.t_win1, "measuring");
    status_read(&st, sn.w1);
  }
  double cpu_gen = ps_cpu_s() - cpu0;
  if (g_signal) {
    /* what was measured so far: the window ends now */
    r.o.duration = ps_now_s() - r.t_win0 > 0 ? ps_now_s() - r.t_win0 : 0;
    r.t_win1 = ps_now_s();
    if (r.t_start > 0) status_read(&st, sn.w1);
  }
  atomic_store(&r.stop, 1);
  pthread_mutex_lock(&r.mu);
  pthread_cond_broadcast(&r.cv);
  pthread_mutex_unlock(&r.mu);
  for (int k = 0; k < started; k++) pthread_join(r.w[k].th, NULL);
  status_read(&st, sn.after);
  if (r.t_start == 0 || r.o.duration <= 0) {
    int errors = 0;
    const char *first = "";
    for (int k = 0; k < r.o.workers; k++) {
      errors += r.w[k].errors > 0;
      if (!first[0] && r.w[k].first_error[0]) first = r.w[k].first_error;
    }
    fprintf(stderr, "ps-loadgen: no load was measured (%d of %d workers registered%s%s)\n",
            r.n_connected, r.o.workers, first[0] ? "; first error: " : "", first);
    rc = 1;
  } else {
    rc = report(&r, &sn, connect_s, cpu_gen);
  }
  for (int k = 0; k < r.o.workers; k++) worker_free(&r.w[k]);
  free(r.w);
  ps_free(grads);
  free(sn.before);
  free(sn.w0);
  free(sn.w1);
  free(sn.after);
  status_close(&st);
  rpc_global_shutdown();
  return rc;
}

/* ps-stale: training with a staleness the experiment sets, not the
 * machines. N virtual workers in one process take turns; each gradient is
 * computed on the parameters of exactly s versions ago, s fixed or drawn
 * from a named distribution under a seed, and pushed with that base
 * version to a real shard (ps/state/shard.c: the job's optimizer, its
 * staleness-aware learning rate, its staleness histogram), so that what a
 * run shows holds for the servers. One thread computes: a run is the same
 * bit for bit when it is run again, and with one virtual worker and s = 0
 * it is `ps-worker --local`'s run.
 *
 * The shard keeps the newest parameters; this program keeps the last
 * S_max + 1 versions of them in a ring (version v at v mod (S_max + 1)), the
 * one a gradient is computed on picked by the draw. The first S_max steps
 * cannot reach back s versions: they take s = min(s, version). */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/atomic_file.h"
#include "common/crc32c.h"
#include "common/job.h"
#include "common/metrics.h"
#include "common/options.h"
#include "common/rng.h"
#include "common/util.h"
#include "ps/state/shard.h"
#include "worker/data/data.h"
#include "worker/model/device.h"
#include "worker/model/model.h"

#define STALE_MAX 4096      /* the most versions a gradient may be behind */
#define STALE_EVAL_BATCH 500 /* examples per evaluation chunk */
#define STALE_DRAW_STREAM 0x57a1eull

typedef struct {
  const char *job_path, *data_dir, *staleness, *metrics, *save_path, *device;
  int virtual_workers, threads, epochs, eval_per_epoch, max_staleness;
  int64_t seed, max_steps;
  double drain;
} stale_opts;

#define O(field) offsetof(stale_opts, field)

static const ps_option stale_flags[] = {
    {"job", "FILE", PS_OPT_STR, O(job_path), .help = "the job file (JSON), required"},
    {"data-dir", "DIR", PS_OPT_STR, O(data_dir), .def_doc = "the data set's default place",
     .help = "where the job's data set is (as `ps-worker --data-dir`)"},
    {"virtual-workers", "N", PS_OPT_INT, O(virtual_workers), 1, 4096, .def = "1", .help =
     "virtual workers taking turns, each on its share of the training set (the examples with "
     "`i % N == k`, as `ps-worker --index k --num-workers N`), each for the job's epochs"},
    {"staleness", "SPEC", PS_OPT_STR, O(staleness), .def = "fixed:0", .help =
     "the versions each gradient is behind: `fixed:S`; `uniform:S` (uniform on 0..S); "
     "`group:K` (K updates in a row computed on one version: s = 0, 1, ..., K-1, then again; "
     "the staleness of workers released together, as `uniform:K-1` is without that order); "
     "`geometric:P` (P(s = k) = (1-P)^k P, 0 < P <= 1); `hist:FILE` (drawn "
     "from counts: FILE holds the count of s = 0, 1, 2, ... separated by spaces, commas or "
     "new lines, as a shard's `staleness_hist` in `ps-server --status`)"},
    {"max-staleness", "N", PS_OPT_INT, O(max_staleness), 0, STALE_MAX, .def = "64", .help =
     "the most versions a gradient is behind: larger draws (geometric, hist) are taken as N. "
     "This program keeps N + 1 copies of the parameters"},
    {"drain", "F", PS_OPT_SECS, O(drain), 0, .def = "0", .help =
     "the last fraction F (0 to 1) of the updates come from ever fewer workers, as when "
     "asynchronous workers finish their shares one by one: in it each draw s is scaled by the "
     "share of the drain still to come and rounded down, so the staleness falls linearly to 0"},
    {"seed", "S", PS_OPT_I64, O(seed), 0, 9e18, .def = "1", .help =
     "the seed of the staleness draws (the job's seed sets the data order and the model)"},
    {"epochs", "N", PS_OPT_INT, O(epochs), 1, 1000000, .def_doc = "the job's",
     .help = "passes over its share per virtual worker"},
    {"max-steps", "N", PS_OPT_I64, O(max_steps), 0, (double)(1LL << 40), .def = "0",
     .help = "stop after N updates (0: when the epochs are done)"},
    {"eval-per-epoch", "N", PS_OPT_INT, O(eval_per_epoch), 0, 1000, .def = "4", .help =
     "test-set evaluations per epoch of the whole training set (0: only at the end)"},
    {"metrics", "FILE", PS_OPT_STR, O(metrics), .help =
     "append one JSON object per evaluation: updates, examples, epoch, test accuracy and loss, "
     "the mean and max staleness so far, seconds"},
    {"save-params", "FILE", PS_OPT_STR, O(save_path), .help =
     "write the final parameters as raw little-endian float32 (as `ps-worker --save-params`), "
     "atomically"},
    {"device", "DEV", PS_OPT_STR, O(device), .def = "cpu",
     .help = "the compute backend, as `ps-worker --device` (cpu, cpu-ref, emu, cuda)"},
    {"threads", "N", PS_OPT_INT, O(threads), 1, 1024, .def = "1",
     .help = "cpu threads of the backend"},
};

static const ps_optspec stale_spec = {
    .prog = "ps-stale",
    .synopsis =
        "Usage: ps-stale --job FILE [--virtual-workers N] [--staleness SPEC] [--drain F]\n"
        "                [--seed S]\n"
        "                [--epochs N] [--max-steps N] [--metrics FILE] [--save-params FILE]\n"
        "\n"
        "Trains the job with a staleness the experiment sets: N virtual workers take turns,\n"
        "and each gradient is computed on the parameters of exactly s versions ago (fixed, or\n"
        "drawn under a seed) and pushed with that base version to a shard of this process\n"
        "(the servers' own code: optimizer, staleness-aware learning rate, histogram). Prints\n"
        "the final test accuracy and the shard's staleness histogram. Deterministic: the same\n"
        "flags give the same bits; one virtual worker at fixed:0 is `ps-worker --local`.\n",
    .opts = stale_flags,
    .n_opts = (int)(sizeof stale_flags / sizeof stale_flags[0]),
    .footer = "Exit status: 0 done, 1 failed (a bad job, data set or loss), 2 bad usage.",
};

/* The staleness distribution. */
typedef struct {
  enum { DRAW_FIXED, DRAW_UNIFORM, DRAW_GEOMETRIC, DRAW_HIST, DRAW_GROUP } kind;
  int s;        /* fixed, uniform: S; group: K */
  double p;     /* geometric */
  uint64_t *cum; /* hist: cumulative counts, n of them */
  int n;
  int max; /* the most it can draw */
  ps_rand rng;
} stale_draw;

static int parse_hist(const char *path, stale_draw *d, char *err) {
  char *text = NULL;
  size_t len = 0;
  if (ps_read_file(path, &text, &len, err) != 0) return PS_EINVAL;
  uint64_t total = 0;
  int n = 0;
  d->cum = calloc(STALE_MAX + 1, sizeof *d->cum);
  if (!d->cum) {
    free(text);
    return ps_seterr(err, PS_ENOMEM, "out of memory");
  }
  for (char *p = text; *p;) {
    while (*p == ' ' || *p == ',' || *p == '\n' || *p == '\t' || *p == '\r') p++;
    if (!*p) break;
    char *end;
    errno = 0;
    unsigned long long c = strtoull(p, &end, 10);
    if (end == p || errno || *p == '-' || n > STALE_MAX) {
      free(text);
      return ps_seterr(err, PS_EINVAL,
                       "--staleness hist:%s: entry %d is not a count (or more than %d entries)",
                       path, n, STALE_MAX + 1);
    }
    total += c;
    d->cum[n++] = total;
    p = end;
  }
  free(text);
  if (total == 0)
    return ps_seterr(err, PS_EINVAL, "--staleness hist:%s: no counts (all zero, or empty)", path);
  d->n = n;
  d->max = n - 1;
  while (d->max > 0 && d->cum[d->max] == d->cum[d->max - 1]) d->max--;
  return PS_OK;
}

static int parse_draw(const char *spec, uint64_t seed, stale_draw *d, char *err) {
  memset(d, 0, sizeof *d);
  ps_rand_seed(&d->rng, ps_rng_u64(seed, STALE_DRAW_STREAM, 0));
  const char *colon = strchr(spec, ':');
  if (!colon || !colon[1])
    return ps_seterr(err, PS_EINVAL, "--staleness '%s': want fixed:S, uniform:S, group:K, "
                                     "geometric:P or hist:FILE", spec);
  size_t klen = (size_t)(colon - spec);
  const char *arg = colon + 1;
  char *end;
  if ((klen == 5 && !strncmp(spec, "fixed", 5)) || (klen == 7 && !strncmp(spec, "uniform", 7))) {
    long v = strtol(arg, &end, 10);
    if (*end || v < 0 || v > STALE_MAX)
      return ps_seterr(err, PS_EINVAL, "--staleness '%s': S must be an integer in 0..%d", spec,
                       STALE_MAX);
    d->kind = klen == 5 ? DRAW_FIXED : DRAW_UNIFORM;
    d->s = d->max = (int)v;
    return PS_OK;
  }
  if (klen == 5 && !strncmp(spec, "group", 5)) {
    long v = strtol(arg, &end, 10);
    if (*end || v < 1 || v > STALE_MAX)
      return ps_seterr(err, PS_EINVAL, "--staleness '%s': K must be an integer in 1..%d", spec,
                       STALE_MAX);
    d->kind = DRAW_GROUP;
    d->s = (int)v;
    d->max = (int)v - 1;
    return PS_OK;
  }
  if (klen == 9 && !strncmp(spec, "geometric", 9)) {
    double p = strtod(arg, &end);
    if (*end || !(p > 0 && p <= 1))
      return ps_seterr(err, PS_EINVAL, "--staleness '%s': P must be in (0, 1]", spec);
    d->kind = DRAW_GEOMETRIC;
    d->p = p;
    d->max = p == 1 ? 0 : STALE_MAX;
    return PS_OK;
  }
  if (klen == 4 && !strncmp(spec, "hist", 4)) {
    d->kind = DRAW_HIST;
    return parse_hist(arg, d, err);
  }
  return ps_seterr(err, PS_EINVAL, "--staleness '%s': unknown distribution '%.*s' (fixed, "
                                   "uniform, group, geometric, hist)", spec, (int)klen, spec);
}

/* The staleness of the update that makes version + 1. */
static int draw_raw(stale_draw *d, uint64_t version) {
  switch (d->kind) {
    case DRAW_FIXED: return d->s;
    case DRAW_GROUP: return (int)(version % (uint64_t)d->s);
    case DRAW_UNIFORM: return (int)ps_rand_below(&d->rng, (uint64_t)d->s + 1);
    case DRAW_GEOMETRIC: {
      int k = 0;
      /* 53 random bits against p: failures before the first success */
      while (k < STALE_MAX &&
             (double)(ps_rand_next(&d->rng) >> 11) * (1.0 / 9007199254740992.0) >= d->p)
        k++;
      return k;
    }
    case DRAW_HIST: {
      uint64_t x = ps_rand_below(&d->rng, d->cum[d->n - 1]);
      int lo = 0;
      while (d->cum[lo] <= x) lo++;
      return lo;
    }
  }
  return 0;
}

static int draw(stale_draw *d, uint64_t version) {
  int s = draw_raw(d, version);
  return s > d->max ? d->max : s;
}

/* The run: the job, data, model, the shard, the ring of versions. */
typedef struct {
  stale_opts o;
  ps_job job;
  ps_dataset train, test;
  ps_ops *ops;
  ps_model *model, *eval_model;
  ps_shard *shard;
  float *grads, *dparams; /* dparams: backend memory (NULL on a host backend) */
  float **ring;
  int ring_n;
  ps_batcher **batchers;
  int64_t *left; /* steps each virtual worker has left */
  stale_draw draw;
  ps_metrics *metrics;
  double t0;
} stale_run;

static void run_free(stale_run *r) {
  for (int k = 0; r->batchers && k < r->o.virtual_workers; k++) ps_batcher_destroy(r->batchers[k]);
  free(r->batchers);
  free(r->left);
  for (int k = 0; r->ring && k < r->ring_n; k++) free(r->ring[k]);
  free(r->ring);
  free(r->grads);
  if (r->dparams) ps_model_free_params(r->model, r->dparams);
  ps_model_destroy(r->eval_model);
  ps_model_destroy(r->model);
  if (r->ops) r->ops->destroy(r->ops);
  ps_shard_destroy(r->shard);
  ps_dataset_free(&r->train);
  ps_dataset_free(&r->test);
  free(r->draw.cum);
  ps_metrics_close(r->metrics);
}

/* The job, the data sets, the backend and models, the shard. */
static int run_setup(stale_run *r, char *err) {
  if (ps_job_load(r->o.job_path, &r->job, NULL, err) != 0) return 2;
  const ps_model_spec *spec = &r->job.model;
  if (spec->n_layers == 0 || r->job.n_tables > 0)
    return ps_seterr(err, 2, "%s: ps-stale trains layered models without embedding tables",
                     r->o.job_path);
  if (r->job.mode_kind != PS_MODE_ASYNC)
    PS_INFO("the job's mode (%s) is not used: the staleness is set by --staleness",
            r->job.mode);
  r->job.wire = PS_WIRE_FP32; /* gradients stay in this process */
  if (r->o.epochs > 0) r->job.epochs = r->o.epochs;
  if (ps_dataset_load_job(&r->job, r->o.data_dir, 1, &r->train, err) != 0 ||
      ps_dataset_load_job(&r->job, r->o.data_dir, 0, &r->test, err) != 0)
    return 1;
  char desc[256];
  r->ops = ps_device_open(r->o.device, r->o.threads, desc, sizeof desc, err);
  if (!r->ops) return 2;
  r->model = ps_model_create(spec, r->ops, r->job.batch_size, err);
  r->eval_model = r->model ? ps_model_create(spec, r->ops, STALE_EVAL_BATCH, err) : NULL;
  r->shard = r->eval_model ? ps_shard_create(&r->job, 0, 1, err) : NULL;
  if (!r->shard) return 1;
  const size_t P = spec->n_params;
  r->grads = malloc(P * sizeof(float));
  if (!r->ops->host_memory && !(r->dparams = ps_model_alloc_params(r->model)))
    return ps_seterr(err, 1, "out of memory on %s", desc);
  PS_INFO("ps-stale: job '%s' (%zu parameters, optimizer %s%s), %d virtual worker(s), "
          "staleness %s (the last %.0f%% of the updates drained), device %s",
          r->job.job_id, P, r->job.optim.name,
          r->job.staleness_aware_lr ? ", staleness-aware learning rate" : "",
          r->o.virtual_workers, r->o.staleness, r->o.drain * 100, desc);
  return r->grads ? 0 : ps_seterr(err, 1, "out of memory");
}

/* The ring of versions (version 0 in it) and the virtual workers' data. */
static int run_data(stale_run *r, char *err) {
  const size_t P = r->job.model.n_params;
  r->ring_n = r->draw.max + 1;
  PS_INFO("keeping %d version(s) of the parameters (%.1f MiB)", r->ring_n,
          (double)r->ring_n * (double)P * 4 / (1 << 20));
  r->ring = calloc((size_t)r->ring_n, sizeof *r->ring);
  for (int k = 0; r->ring && k < r->ring_n; k++)
    if (!(r->ring[k] = malloc(P * sizeof(float))))
      return ps_seterr(err, 1, "out of memory for %d versions of %zu parameters (--max-staleness)",
                       r->ring_n, P);
  if (!r->ring) return ps_seterr(err, 1, "out of memory");
  ps_shard_copy_params(r->shard, r->ring[0]);
  const int N = r->o.virtual_workers;
  r->batchers = calloc((size_t)N, sizeof *r->batchers);
  r->left = calloc((size_t)N, sizeof *r->left);
  if (!r->batchers || !r->left) return ps_seterr(err, 1, "out of memory");
  const int B = r->job.batch_size;
  for (int k = 0; k < N; k++) {
    r->batchers[k] = ps_batcher_create_ordered(&r->train, B, k, N, r->job.seed, 2,
                                               r->job.shuffle);
    if (!r->batchers[k]) return ps_seterr(err, 1, "cannot start virtual worker %d's data", k);
    int64_t per_epoch = (ps_batcher_epoch_size(r->batchers[k]) + B - 1) / B;
    r->left[k] = per_epoch * r->job.epochs;
  }
  return 0;
}

/* The test set with params (host memory): accuracy, and the loss in *loss. */
static double evaluate(stale_run *r, const float *params, float *loss) {
  const float *p = params;
  if (r->dparams) {
    ps_model_params_to_device(r->eval_model, r->dparams, params);
    p = r->dparams;
  }
  int correct = 0;
  *loss = ps_model_evaluate(r->eval_model, p, r->test.images, r->test.labels, r->test.n, &correct);
  return r->test.n ? (double)correct / r->test.n : 0.0;
}

static void report(stale_run *r, uint64_t updates, uint64_t examples, double acc, float loss) {
  ps_shard_stats st;
  ps_shard_stats_get(r->shard, &st);
  double epoch = r->train.n ? (double)examples / r->train.n : 0.0;
  PS_INFO("update %" PRIu64 " (epoch %.2f): test accuracy %.4f, loss %.4f; staleness mean %.2f "
          "max %" PRIu64,
          updates, epoch, acc, (double)loss, st.staleness_mean, st.staleness_max);
  if (!r->metrics) return;
  json_t *rec = json_pack("{s:I,s:I,s:f,s:f,s:f,s:f,s:I,s:f}", "updates", (json_int_t)updates,
                          "examples", (json_int_t)examples, "epoch", epoch, "test_accuracy", acc,
                          "test_loss", (double)loss, "staleness_mean", st.staleness_mean,
                          "staleness_max", (json_int_t)st.staleness_max, "wall_s",
                          ps_now_s() - r->t0);
  if (rec) ps_metrics_write(r->metrics, rec);
  json_decref(rec);
}

/* One update: virtual worker k's next batch on the parameters of s
 * versions ago, pushed with that base version. */
static int step(stale_run *r, int k, uint64_t version, double scale, uint64_t *examples,
                char *err) {
  const size_t P = r->job.model.n_params;
  int s = draw(&r->draw, version);
  if (scale < 1.0) s = (int)floor((double)s * scale);
  if ((uint64_t)s > version) s = (int)version;
  const uint64_t base = version - (uint64_t)s;
  const float *params = r->ring[base % (uint64_t)r->ring_n];
  ps_batch *b = NULL;
  if (ps_batcher_next(r->batchers[k], &b) != 0 || !b)
    return ps_seterr(err, 1, "virtual worker %d: no batch", k);
  const float *p = params;
  if (r->dparams) {
    ps_model_params_to_device(r->model, r->dparams, params);
    p = r->dparams;
  }
  /* The stream of `ps-worker --local` (rank k): one virtual worker at
   * fixed:0 computes what it computes. */
  float loss = ps_model_train_step(r->model, p, b->x, b->y, b->n, r->job.seed ^ 0xd0d0,
                                   version * 1024 + (uint64_t)k, r->grads, NULL);
  if (r->dparams) ps_model_params_to_host(r->model, r->grads, r->grads);
  *examples += (uint64_t)b->n;
  ps_batcher_release(r->batchers[k], b);
  if (!isfinite(loss))
    return ps_seterr(err, 1, "update %" PRIu64 ": the loss is %f. Lower the learning rate.",
                     version, (double)loss);
  ps_seg seg = {.ptr = (const uint8_t *)r->grads, .len = P * sizeof(float)};
  ps_segview view = {.segs = &seg, .nsegs = 1, .total = seg.len};
  uint64_t nv = 0, stale = 0;
  char why[PS_ERRLEN];
  if (ps_shard_push(r->shard, base, 0, P, &view, &nv, &stale, why) != 0)
    return ps_seterr(err, 1, "update %" PRIu64 ": the shard refused the gradient: %s", version,
                     why);
  if (stale != (uint64_t)s || nv != version + 1)
    return ps_seterr(err, 1, "update %" PRIu64 ": the shard saw staleness %" PRIu64 " (version %"
                     PRIu64 "), %d was drawn", version, stale, nv, s);
  ps_shard_copy_params(r->shard, r->ring[nv % (uint64_t)r->ring_n]);
  return 0;
}

static int train(stale_run *r, char *err) {
  const int N = r->o.virtual_workers;
  int64_t total = 0;
  for (int k = 0; k < N; k++) total += r->left[k];
  if (r->o.max_steps > 0 && r->o.max_steps < total) total = r->o.max_steps;
  const int64_t per_epoch = total > 0 && r->job.epochs > 0 ? total / r->job.epochs : 1;
  const int64_t every = r->o.eval_per_epoch > 0 && per_epoch / r->o.eval_per_epoch > 0
                            ? per_epoch / r->o.eval_per_epoch
                            : 0;
  uint64_t version = 0, examples = 0;
  float loss = 0;
  int k = 0;
  /* The drain: its last `drain_n` updates, each draw scaled by the share
   * of the drain still to come (1 at its start, towards 0 at the end). */
  const int64_t drain_n = (int64_t)floor(r->o.drain * (double)total);
  for (int64_t u = 0; u < total; u++) {
    while (r->left[k] == 0) k = (k + 1) % N;
    double scale = u < total - drain_n ? 1.0 : (double)(total - u) / (double)drain_n;
    if (step(r, k, version, scale, &examples, err) != 0) return 1;
    r->left[k]--;
    version++;
    k = (k + 1) % N;
    if (every > 0 && (int64_t)version % every == 0 && (int64_t)version < total) {
      double acc = evaluate(r, r->ring[version % (uint64_t)r->ring_n], &loss);
      report(r, version, examples, acc, loss);
    }
  }
  const float *final = r->ring[version % (uint64_t)r->ring_n];
  double acc = evaluate(r, final, &loss);
  report(r, version, examples, acc, loss);
  ps_shard_stats st;
  ps_shard_stats_get(r->shard, &st);
  const size_t P = r->job.model.n_params;
  printf("trained %" PRIu64 " updates, %" PRIu64 " examples in %.1f s; final test accuracy %.4f, "
         "loss %.4f; params crc32c %08x\n",
         version, examples, ps_now_s() - r->t0, acc, (double)loss,
         (unsigned)ps_crc32c(0, final, P * sizeof(float)));
  printf("staleness: mean %.3f max %" PRIu64 "; histogram (s: updates):", st.staleness_mean,
         st.staleness_max);
  for (int b = 0; b < PS_STALENESS_BUCKETS; b++)
    if (st.staleness_hist[b])
      printf(" %d%s:%" PRIu64, b, b == PS_STALENESS_BUCKETS - 1 ? "+" : "", st.staleness_hist[b]);
  printf("\n");
  if (r->o.save_path) {
    uint8_t *bytes = malloc(P * 4);
    if (!bytes) return ps_seterr(err, 1, "out of memory");
    for (size_t i = 0; i < P; i++) {
      uint32_t u;
      memcpy(&u, &final[i], 4);
      ps_put_le32(bytes + 4 * i, u);
    }
    int rc = ps_write_file_atomic(r->o.save_path, bytes, P * 4, err);
    free(bytes);
    if (rc != 0) return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  static stale_run r;
  if (ps_options_defaults(&stale_spec, &r.o) != 0) return 2;
  r.o.epochs = -1;
  int prc = ps_options_parse(&stale_spec, argc, argv, &r.o);
  if (prc == 1) return 0;
  if (prc != 0) return 2;
  if (!r.o.job_path) {
    fprintf(stderr, "ps-stale: --job FILE is required (see --help)\n");
    return 2;
  }
  char err[PS_ERRLEN] = "";
  int rc = parse_draw(r.o.staleness, (uint64_t)r.o.seed, &r.draw, err) != 0 ? 2 : 0;
  if (rc == 0 && r.draw.max > r.o.max_staleness) {
    if (r.draw.kind == DRAW_FIXED || r.draw.kind == DRAW_UNIFORM) {
      rc = ps_seterr(err, 2, "--staleness %s reaches %d versions, over --max-staleness %d",
                     r.o.staleness, r.draw.max, r.o.max_staleness);
    }
    r.draw.max = r.o.max_staleness;
  }
  if (rc == 0 && !(r.o.drain < 1.0))
    rc = ps_seterr(err, 2, "--drain %g: want a fraction of the updates, 0 <= F < 1", r.o.drain);
  if (rc == 0 && r.o.metrics && !(r.metrics = ps_metrics_open(r.o.metrics, err))) rc = 2;
  if (rc == 0) rc = run_setup(&r, err);
  if (rc == 0) rc = run_data(&r, err);
  r.t0 = ps_now_s(); /* seconds of training, not of loading */
  if (rc == 0) rc = train(&r, err);
  if (rc != 0) fprintf(stderr, "ps-stale: %s\n", err);
  run_free(&r);
  return rc;
}

/* Embedding rows trained on live shards in steps whose result is known in
 * advance: under "sync" (2 workers, threads of this program, with
 * overlapping ids: each step applies the mean of the two gradients, a row
 * named by one worker moving by half its gradient) or "async" (1 worker),
 * on plain or replicated shards (the job file says which).
 *
 * One run is one phase of STEPS steps, steps PHASE*STEPS .. (PHASE+1)*STEPS
 * of the whole: the workers register (both before either pushes), pull
 * every row of the pools and compare them with the reference after
 * PHASE*STEPS steps (so a phase after a fail-over checks that the new
 * primary serves the same rows), train, then compare again after
 * (PHASE+1)*STEPS steps, and check every shard's version. The reference
 * is the optimizer's own apply on each row's initial record: the rows must
 * match it bit for bit.
 *
 *   table_sync_check JOB ADDR[,ADDR...] PHASE STEPS [GATE]
 * (ADDR: the servers to register with, tried in turn.) With GATE (a file
 * name, sync only), worker 1 pushes its first step only once that file
 * exists (60 s at most), so that the step stays pending, worker 0's
 * gradient in, while the caller does something to the shards (a backup
 * that takes a snapshot of the pending step, or a shard restarted from its
 * checkpoint, which lost worker 0's gradient: worker 0's pull pushes it
 * again). As a worker does, the workers set the next step's rows before
 * each pull, and try a call again while a shard is unavailable or forgot
 * them (60 s at most). Exit 0 when every check held. Each call has a
 * deadline; the loops are bounded by STEPS and by time. */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/auth.h"
#include "../../common/emb.h"
#include "../../common/job.h"
#include "../../common/optim.h"
#include "../../common/rpc.h"
#include "../../common/util.h"
#include "worker/client/ps_client.h"
#include "../unit/check.h"
#include "env_token.h"

/* Pools of ids per table; each step a worker names a window of each. */
enum { NCAT = 64, PER_CAT = 24, NHASH = 32, PER_HASH = 12, MAX_W = 2, MAX_S = 8 };

static ps_job job;
static char addrs[8][256];
static int n_addrs, W, phase, steps;
static const char *gate; /* worker 1 waits for this file before its first push */
static uint64_t pool_cat[NCAT], pool_hash[NHASH];
static pthread_barrier_t registered;
static ps_token token, *tok; /* from PS_TOKEN_FILE when set */

/* The ids worker w names at step k in table t (n of them into out). */
static size_t step_ids(int t, int w, int k, uint64_t *out) {
  const int np = t ? NHASH : NCAT, per = t ? PER_HASH : PER_CAT;
  const uint64_t *pool = t ? pool_hash : pool_cat;
  for (int j = 0; j < per; j++) out[j] = pool[(k * 5 + w * (per / 2) + j) % np];
  return (size_t)per;
}

/* Worker w's gradient of value c of row id at step k. */
static float grad_of(int w, int k, uint64_t id, int c) {
  return 0.01f *
         (float)((int)((id * 31 + (uint64_t)k * 7 + (uint64_t)w * 13 + (uint64_t)c) % 17) - 8);
}

/* The reference: every pool row after `upto` steps, values only (n * dim). */
static void reference(int t, int upto, float *out) {
  const ps_optimizer *opt = ps_optimizer_find(job.table_optim[t].name);
  const int d = job.tables[t].dim, np = t ? NHASH : NCAT;
  const uint64_t *pool = t ? pool_hash : pool_cat;
  const float inv = 1.0f / (float)W; /* sync: the dense mean's factor */
  for (int i = 0; i < np; i++) {
    float rec[PS_TABLE_MAX_DIM * (1 + PS_OPTIM_MAX_SLOTS)];
    ps_table_init_row(&job.tables[t], job.seed, pool[i], rec);
    float *sl[PS_OPTIM_MAX_SLOTS];
    for (int k = 0; k < opt->n_slots; k++) {
      sl[k] = rec + (size_t)(k + 1) * (size_t)d;
      for (int j = 0; j < d; j++) sl[k][j] = opt->slot_init(&job.table_optim[t], k);
    }
    uint64_t count = 0;
    for (int k = 0; k < upto; k++) {
      float g[PS_TABLE_MAX_DIM];
      int named = 0;
      for (int w = 0; w < W; w++) {
        uint64_t ids[PER_CAT];
        size_t n = step_ids(t, w, k, ids);
        for (size_t j = 0; j < n; j++)
          if (ids[j] == pool[i]) {
            for (int c = 0; c < d; c++)
              g[c] = named ? g[c] + grad_of(w, k, pool[i], c) : grad_of(w, k, pool[i], c);
            named = 1;
          }
      }
      if (!named) continue;
      if (job.mode_kind == PS_MODE_SYNC)
        for (int c = 0; c < d; c++) g[c] *= inv;
      opt->apply(&job.table_optim[t], ++count, job.table_optim[t].lr, rec, sl, g, (size_t)d);
    }
    memcpy(out + (size_t)i * d, rec, (size_t)d * sizeof(float));
  }
}

typedef struct {
  int w;
  int ok;
  char err[PS_ERRLEN];
} worker_ctx;

/* A call's error that a worker waits out (a shard restarting). */
static int transient(int rc) {
  return rc == PS_EUNAVAIL || rc == PS_ENOTFOUND || rc == PS_ETIMEDOUT;
}

/* A pull (sync: waiting for want), tried again for 60 s at most. */
static int pull_retry(ps_client *c, float *params, uint64_t *versions, const uint64_t *want,
                      char *err) {
  const double until = ps_now_s() + 60;
  int rc;
  while (transient(rc = ps_client_pull(c, params, versions, want, err)) && ps_now_s() < until)
    ps_sleep_ms(200);
  return rc;
}

/* A push round, its end tried again for 60 s at most (the same round). */
static int push_retry(ps_client *c, const float *grads, const uint64_t *versions, uint64_t step,
                      ps_push_result *res, char *err) {
  int rc = ps_client_push_begin(c, versions, step, 8, 0);
  if (rc != PS_OK) return ps_seterr(err, rc, "a push is still in flight");
  const double until = ps_now_s() + 60;
  while (transient(rc = ps_client_push_end(c, grads, res, err)) && ps_now_s() < until)
    ps_sleep_ms(200);
  return rc;
}

/* Registers through the first address that answers (a killed replica's
 * does not), each tried for 2 s, for 60 s at most. */
static ps_client *connect_any(const char *who, char *err) {
  ps_client_opts o = {.host = who,
                      .role = "worker",
                      .task_index = -1,
                      .timeout_ms = 30000,
                      .connect_timeout_ms = 2000,
                      .failover_ms = 20000,
                      .token = tok};
  const double until = ps_now_s() + 60;
  for (int i = 0; ps_now_s() < until; i = (i + 1) % n_addrs) {
    ps_client *c = ps_client_connect(addrs[i], &o, err);
    if (c) return c;
  }
  return NULL;
}

/* Pulls every pool row (the versions into versions) and compares them with
 * the reference after `upto` steps. */
static int check_rows(ps_client *c, float *params, uint64_t *versions, int upto, int w, char *err) {
  const int dc = job.tables[0].dim, dh = job.tables[1].dim;
  float *vc = malloc(NCAT * (size_t)dc * sizeof(float)),
        *vh = malloc(NHASH * (size_t)dh * sizeof(float));
  float *rc_ = malloc(NCAT * (size_t)dc * sizeof(float)),
        *rh = malloc(NHASH * (size_t)dh * sizeof(float));
  int rc = -1;
  if (!vc || !vh || !rc_ || !rh) {
    snprintf(err, PS_ERRLEN, "out of memory");
    goto out;
  }
  ps_client_rows secs[2] = {{0, pool_cat, NCAT, vc, NULL}, {1, pool_hash, NHASH, vh, NULL}};
  if (ps_client_set_rows(c, secs, 2, err) != 0 || pull_retry(c, params, versions, NULL, err) != 0)
    goto out;
  reference(0, upto, rc_);
  reference(1, upto, rh);
  for (int t = 0; t < 2; t++) {
    const int d = t ? dh : dc, np = t ? NHASH : NCAT;
    const float *got = t ? vh : vc, *want = t ? rh : rc_;
    for (int i = 0; i < np; i++)
      if (memcmp(got + (size_t)i * d, want + (size_t)i * d, (size_t)d * sizeof(float))) {
        snprintf(err, PS_ERRLEN,
                 "worker %d: table '%s' row %" PRIu64
                 " after %d steps: %.9g ... where the "
                 "reference has %.9g ...",
                 w, job.tables[t].name, (t ? pool_hash : pool_cat)[i], upto,
                 (double)got[(size_t)i * d], (double)want[(size_t)i * d]);
        goto out;
      }
  }
  rc = 0;
out:
  free(vc);
  free(vh);
  free(rc_);
  free(rh);
  return rc;
}

static void *worker_main(void *arg) {
  worker_ctx *x = arg;
  char who[32];
  snprintf(who, sizeof who, "table-sync-check-%d", x->w);
  ps_client *c = connect_any(who, x->err);
  pthread_barrier_wait(&registered);
  if (!c) return NULL;
  const size_t P = ps_client_param_count(c);
  const int S = ps_client_num_shards(c);
  const int dc = job.tables[0].dim, dh = job.tables[1].dim;
  float *params = calloc(P ? P : 1, sizeof(float)), *grads = calloc(P ? P : 1, sizeof(float));
  float *gc = malloc(PER_CAT * (size_t)dc * sizeof(float));
  float *gh = malloc(PER_HASH * (size_t)dh * sizeof(float));
  float *vc = malloc(PER_CAT * (size_t)dc * sizeof(float));
  float *vh = malloc(PER_HASH * (size_t)dh * sizeof(float));
  uint64_t versions[MAX_S] = {0}, want_v[MAX_S];
  if (!params || !grads || !gc || !gh || !vc || !vh || S > MAX_S) {
    snprintf(x->err, PS_ERRLEN, "out of memory");
    goto out;
  }
  const int first = phase * steps;
  if (check_rows(c, params, versions, first, x->w, x->err) != 0) goto out;
  for (int s = 0; s < S; s++)
    if (versions[s] != (uint64_t)first) {
      snprintf(x->err, PS_ERRLEN, "worker %d: shard %d is at version %" PRIu64 " before step %d",
               x->w, s, versions[s], first);
      goto out;
    }
  for (int k = first; k < first + steps; k++) {
    uint64_t ic[PER_CAT], ih[PER_HASH];
    size_t nc = step_ids(0, x->w, k, ic), nh = step_ids(1, x->w, k, ih);
    for (size_t j = 0; j < nc; j++)
      for (int cc = 0; cc < dc; cc++) gc[j * (size_t)dc + (size_t)cc] = grad_of(x->w, k, ic[j], cc);
    for (size_t j = 0; j < nh; j++)
      for (int cc = 0; cc < dh; cc++) gh[j * (size_t)dh + (size_t)cc] = grad_of(x->w, k, ih[j], cc);
    if (gate && x->w == 1 && k == first) {
      const double until = ps_now_s() + 60;
      FILE *f = NULL;
      while (!(f = fopen(gate, "r")) && ps_now_s() < until) ps_sleep_ms(50);
      if (!f) {
        snprintf(x->err, PS_ERRLEN, "worker 1: no %s within 60 s", gate);
        goto out;
      }
      fclose(f);
    }
    ps_client_rows secs[2] = {{0, ic, nc, vc, gc}, {1, ih, nh, vh, gh}};
    ps_push_result res;
    if (ps_client_set_rows(c, secs, 2, x->err) != 0 ||
        push_retry(c, grads, versions, (uint64_t)k + 1, &res, x->err) != 0)
      goto out;
    if (res.dropped) {
      snprintf(x->err, PS_ERRLEN, "worker %d: step %d's gradient was dropped", x->w, k);
      goto out;
    }
    for (int s = 0; s < S; s++) want_v[s] = versions[s] + 1;
    /* The next step's rows are pulled (the round's stay as they were sent;
     * their gradients in gc and gh are written again only after the pull). */
    uint64_t nic[PER_CAT], nih[PER_HASH];
    size_t nnc = step_ids(0, x->w, k + 1, nic), nnh = step_ids(1, x->w, k + 1, nih);
    ps_client_rows next[2] = {{0, nic, nnc, vc, gc}, {1, nih, nnh, vh, gh}};
    if (ps_client_set_rows(c, next, 2, x->err) != 0 ||
        pull_retry(c, params, versions, job.mode_kind == PS_MODE_SYNC ? want_v : NULL,
                   x->err) != 0)
      goto out;
  }
  if (check_rows(c, params, versions, first + steps, x->w, x->err) != 0) goto out;
  for (int s = 0; s < S; s++)
    if (versions[s] != (uint64_t)(first + steps)) {
      snprintf(x->err, PS_ERRLEN, "worker %d: shard %d is at version %" PRIu64 " after step %d",
               x->w, s, versions[s], first + steps);
      goto out;
    }
  x->ok = 1;
out:
  ps_client_leave(c);
  ps_client_destroy(c);
  free(params);
  free(grads);
  free(gc);
  free(gh);
  free(vc);
  free(vh);
  return NULL;
}

int main(int argc, char **argv) {
  char err[PS_ERRLEN];
  if (argc != 5 && argc != 6) {
    fprintf(stderr, "usage: table_sync_check JOB ADDR[,ADDR...] PHASE STEPS [GATE]\n");
    return 2;
  }
  if (ps_job_load(argv[1], &job, NULL, err) != 0) {
    fprintf(stderr, "table_sync_check: %s\n", err);
    return 2;
  }
  for (const char *p = argv[2]; *p && n_addrs < 8;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    snprintf(addrs[n_addrs++], sizeof addrs[0], "%.*s", (int)len, p);
    p += len + (e ? 1 : 0);
  }
  phase = atoi(argv[3]);
  steps = atoi(argv[4]);
  gate = argc == 6 ? argv[5] : NULL;
  if (job.n_tables != 2 || n_addrs == 0 || phase < 0 || steps < 1 || steps > 1000) {
    fprintf(stderr,
            "table_sync_check: a job with 2 tables, an address, PHASE >= 0 and STEPS "
            "in 1..1000\n");
    return 2;
  }
  W = job.mode_kind == PS_MODE_SYNC ? 2 : 1;
  for (int i = 0; i < NCAT; i++) pool_cat[i] = (uint64_t)i * 1543 % job.tables[0].rows;
  for (int i = 0; i < NHASH; i++) pool_hash[i] = 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1);
  if (env_token_load(&token, &tok)) return 2;
  rpc_global_init();
  pthread_barrier_init(&registered, NULL, (unsigned)W);
  pthread_t th[MAX_W];
  worker_ctx x[MAX_W];
  for (int w = 0; w < W; w++) {
    x[w] = (worker_ctx){.w = w};
    if (pthread_create(&th[w], NULL, worker_main, &x[w]) != 0) {
      fprintf(stderr, "table_sync_check: cannot start a thread\n");
      return 1;
    }
  }
  for (int w = 0; w < W; w++) pthread_join(th[w], NULL);
  pthread_barrier_destroy(&registered);
  rpc_global_shutdown();
  for (int w = 0; w < W; w++) CHECK_MSG(x[w].ok, "%s", x[w].err);
  if (check_failed_ == 0)
    printf(
        "table_sync_check: %s, %d worker(s), steps %d..%d: %d + %d rows bit for bit with the "
        "optimizer's reference (%s), every shard at version %d\n",
        job.mode, W, phase * steps, (phase + 1) * steps, NCAT, NHASH,
        W > 1 ? "the mean of the workers' gradients" : "each gradient", (phase + 1) * steps);
  return check_summary();
}

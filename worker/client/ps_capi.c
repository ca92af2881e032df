/* The flat C API of ps_capi.h: a ps_client with what ps-worker's process
 * adds around it (security from files, TF_CONFIG, the job's wire and
 * waits, a heartbeat thread naming the leases held, Status), behind an
 * opaque handle, with each thread's last error kept for the caller. */
#include "worker/client/ps_capi.h"

#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/cluster.h"
#include "common/job.h"
#include "common/rpc.h"
#include "common/security.h"
#include "common/util.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "worker/client/ps_client.h"

/* Leases one worker holds at once that the heartbeats name (shard 0
 * grants a few). */
#define HELD_MAX 64

typedef struct {
  char name[48];
  uint64_t off, count;
  int ndim;
  int64_t shape[PS_CAPI_MAX_DIMS];
} capi_tensor;

struct ps_capi_worker {
  ps_client *c;
  ps_job *job;
  ps_security sec;
  char servers[4096]; /* the list given (TF_CONFIG's, joined), for Status */
  int nshards;
  uint64_t *versions, *min_versions;
  _Atomic uint64_t step; /* read by the heartbeat thread */
  int n_tensors;
  capi_tensor *tensors;
  /* Leases granted and not reported done, and the idle flag: what the
   * heartbeats say (under mu). */
  pthread_mutex_t mu;
  uint64_t held[HELD_MAX];
  int n_held, leasing, idle;
  /* The heartbeat thread: wakes every period, or when told (idle changed,
   * or close). */
  pthread_t hb_thread;
  int hb_running, hb_stop, hb_now;
  pthread_cond_t hb_cond;
  int hb_period_ms;
};

static _Thread_local char last_error[PS_ERRLEN];

/* Keeps msg as the calling thread's last error; returns code. */
static int fail(int code, const char *msg) {
  snprintf(last_error, sizeof last_error, "%s", msg && *msg ? msg : ps_strerror(code));
  return code;
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* Once per process: gRPC, the log's name, and (as ps-worker does, unless
 * PS_MALLOC_TUNE=0) malloc keeping freed pages, so that each message
 * gRPC receives does not fault in fresh ones. */
static void init_process(void) {
  const char *tune = getenv("PS_MALLOC_TUNE");
  if (!tune || strcmp(tune, "0") != 0) ps_malloc_tune();
  ps_log_init("psclient", PS_LOG_INFO);
  rpc_global_init();
}

int ps_capi_version(void) { return PS_CAPI_VERSION; }
const char *ps_capi_last_error(void) { return last_error; }
const char *ps_capi_strerror(int code) { return ps_strerror(code); }
void ps_capi_set_log_level(int level) {
  pthread_once(&init_once, init_process);
  ps_log_init("psclient", level < PS_LOG_DEBUG   ? PS_LOG_DEBUG
                          : level > PS_LOG_ERROR ? PS_LOG_ERROR
                                                 : level);
}
void ps_capi_free(void *p) { free(p); }

/* ---------------- connecting ---------------- */

/* The servers and this task from TF_CONFIG when servers is empty: the
 * list into w->servers, the role (unless given) into role_buf and the
 * task index (unless given). */
static int from_tf_config(ps_capi_worker *w, const char **role, char *role_buf, int *task_index,
                          char *err) {
  const char *tf = getenv("TF_CONFIG");
  if (!tf) return ps_seterr(err, PS_EINVAL, "no server address given and TF_CONFIG is not set");
  ps_cluster *cl = malloc(sizeof *cl);
  if (!cl) return ps_seterr(err, PS_ENOMEM, "out of memory");
  char why[PS_ERRLEN];
  int rc = ps_cluster_from_tf_config(tf, cl, why);
  if (rc != 0) {
    free(cl);
    return ps_seterr(err, PS_EINVAL, "TF_CONFIG: %s", why);
  }
  if (cl->n_ps == 0) {
    free(cl);
    return ps_seterr(err, PS_EINVAL, "TF_CONFIG has no ps addresses");
  }
  size_t at = 0;
  for (int i = 0; i < cl->n_ps && at < sizeof w->servers; i++)
    at +=
        (size_t)snprintf(w->servers + at, sizeof w->servers - at, "%s%s", i ? "," : "", cl->ps[i]);
  int is_chief = strcmp(cl->task_type, "chief") == 0;
  if (!*role && cl->task_type[0]) {
    snprintf(role_buf, 16, "%s", cl->task_type);
    *role = role_buf;
  }
  if (*task_index < 0 && cl->task_index >= 0)
    *task_index = is_chief ? 0 : cl->task_index + cl->n_chief;
  free(cl);
  return PS_OK;
}

/* What ps-worker sets after registering: the job parsed, the wire, the
 * waits of ssp and sync, batchnorm's moving ranges. */
static int adopt_job(ps_capi_worker *w, char *err) {
  char why[PS_ERRLEN];
  if (ps_job_parse(ps_client_job_json(w->c), w->job, why) != 0)
    return ps_seterr(err, PS_EPROTO, "the job from the servers does not parse: %s", why);
  if (ps_client_param_count(w->c) != w->job->model.n_params)
    return ps_seterr(err, PS_EPROTO, "the servers hold %zu values, the job's model has %zu",
                     ps_client_param_count(w->c), w->job->model.n_params);
  if (w->job->mode_kind != PS_MODE_ASYNC) ps_client_set_wait_ms(w->c, w->job->wait_timeout_ms);
  if (ps_client_set_wire(w->c, w->job->wire, err) != 0) return PS_ENOMEM;
  ps_moving_range mr[PS_MAX_MOVING_RANGES];
  ps_client_set_moving(w->c, mr, ps_model_moving_ranges(&w->job->model, mr));
  w->nshards = ps_client_num_shards(w->c);
  w->versions = calloc((size_t)w->nshards, sizeof *w->versions);
  w->min_versions = calloc((size_t)w->nshards, sizeof *w->min_versions);
  if (!w->versions || !w->min_versions) return ps_seterr(err, PS_ENOMEM, "out of memory");
  return PS_OK;
}

/* One named tensor into w->tensors (room was made for it). */
static void add_tensor(ps_capi_worker *w, const char *layer, const char *what, size_t off,
                       size_t count, int ndim, const int64_t *shape) {
  capi_tensor *t = &w->tensors[w->n_tensors++];
  snprintf(t->name, sizeof t->name, "%s%s%s", layer, what ? "." : "", what ? what : "");
  t->off = off;
  t->count = count;
  t->ndim = ndim;
  memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
}

/* The named tensors of the job's model, in layout order (see ps_capi.h). */
static int list_tensors(ps_capi_worker *w, char *err) {
  const ps_model_spec *m = &w->job->model;
  size_t most = m->flat ? (size_t)m->n_tensors : 4 * (size_t)m->n_layers;
  w->tensors = calloc(most ? most : 1, sizeof *w->tensors);
  if (!w->tensors) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (int i = 0; m->flat && i < m->n_tensors; i++) {
    int64_t shape[PS_CAPI_MAX_DIMS];
    for (int d = 0; d < m->tensors[i].ndim; d++) shape[d] = m->tensors[i].shape[d];
    add_tensor(w, m->tensors[i].name, NULL, m->tensors[i].off, m->tensors[i].count,
               m->tensors[i].ndim, shape);
  }
  for (int i = 0; !m->flat && i < m->n_layers; i++) {
    const ps_layer *L = &m->layers[i];
    if (L->type == PS_LAYER_BATCHNORM) {
      const int64_t c[1] = {(int64_t)L->w_count};
      add_tensor(w, L->name, "gamma", L->w_off, L->w_count, 1, c);
      add_tensor(w, L->name, "beta", L->b_off, L->b_count, 1, c);
      add_tensor(w, L->name, "moving_mean", L->s_off, L->s_count / 2, 1, c);
      add_tensor(w, L->name, "moving_variance", L->s_off + L->s_count / 2, L->s_count / 2, 1, c);
      continue;
    }
    if (L->w_count == 0) continue;
    int64_t ws[4] = {(int64_t)L->w_count};
    int wd = 1;
    if (L->type == PS_LAYER_CONV2D) {
      ws[0] = L->filters, ws[1] = L->in_c, ws[2] = ws[3] = L->kernel;
      wd = 4;
    } else if (L->type == PS_LAYER_DENSE) {
      ws[0] = L->units, ws[1] = (int64_t)L->in_c * L->in_h * L->in_w;
      wd = 2;
    }
    add_tensor(w, L->name, "w", L->w_off, L->w_count, wd, ws);
    const int64_t bs[1] = {(int64_t)L->b_count};
    if (L->b_count) add_tensor(w, L->name, "b", L->b_off, L->b_count, 1, bs);
  }
  return PS_OK;
}

static void *hb_main(void *arg);

/* The heartbeat thread, every third of the job's timeout (as ps-worker's
 * loop thread). */
static int start_heartbeats(ps_capi_worker *w, char *err) {
  w->hb_period_ms = ps_client_heartbeat_timeout_ms(w->c) / 3;
  if (w->hb_period_ms < 50) w->hb_period_ms = 50;
  if (pthread_create(&w->hb_thread, NULL, hb_main, w) != 0)
    return ps_seterr(err, PS_ENOMEM, "cannot start the heartbeat thread");
  w->hb_running = 1;
  return PS_OK;
}

/* The handle's own parts: locks and the server list. */
static ps_capi_worker *capi_alloc(const char *servers) {
  ps_capi_worker *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->job = calloc(1, sizeof *w->job);
  if (!w->job) {
    free(w);
    return NULL;
  }
  pthread_mutex_init(&w->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&w->hb_cond, &ca);
  pthread_condattr_destroy(&ca);
  snprintf(w->servers, sizeof w->servers, "%s", servers ? servers : "");
  return w;
}

int ps_capi_connect(const char *servers, const char *token_file, const char *tls_ca,
                    const char *tls_cert, const char *tls_key, int insecure, const char *host,
                    const char *role, int task_index, int timeout_ms, int connect_timeout_ms,
                    int heartbeat, ps_capi_worker **out) {
  pthread_once(&init_once, init_process);
  *out = NULL;
  char err[PS_ERRLEN] = "";
  ps_capi_worker *w = capi_alloc(servers);
  if (!w) return fail(PS_ENOMEM, "out of memory");
  char role_buf[16] = "", hostname[64] = "localhost";
  int rc = PS_OK;
  if (!w->servers[0]) rc = from_tf_config(w, &role, role_buf, &task_index, err);
  ps_security_opts so = {.insecure = insecure != 0,
                         .token_file = token_file,
                         .tls_ca = tls_ca,
                         .tls_cert = tls_cert,
                         .tls_key = tls_key};
  if (rc == PS_OK) rc = ps_security_resolve(&so, PS_SECURITY_CLIENT, &w->sec, err);
  /* The first address of the list is contacted. */
  char first[PS_ADDR_LEN] = "";
  size_t first_len = strcspn(w->servers, ",");
  if (first_len < sizeof first) memcpy(first, w->servers, first_len);
  gethostname(hostname, sizeof hostname - 1);
  ps_client_opts co = {.host = host && *host ? host : hostname,
                       .role = role && *role ? role : "worker",
                       .task_index = task_index,
                       .timeout_ms = timeout_ms,
                       .connect_timeout_ms = connect_timeout_ms,
                       .token = &w->sec.token,
                       .tls = ps_security_tls(&w->sec)};
  if (rc == PS_OK && !(w->c = ps_client_connect(first, &co, err)))
    rc = strstr(err, "UNAVAILABLE") || strstr(err, "DEADLINE") ? PS_EUNAVAIL : PS_EPROTO;
  if (rc == PS_OK) rc = adopt_job(w, err);
  if (rc == PS_OK) rc = list_tensors(w, err);
  if (rc == PS_OK && heartbeat) rc = start_heartbeats(w, err);
  if (rc != PS_OK) {
    ps_capi_close(w, w->c != NULL);
    return fail(rc, err);
  }
  *out = w;
  return PS_OK;
}

void ps_capi_close(ps_capi_worker *w, int leave) {
  if (!w) return;
  if (w->hb_running) {
    pthread_mutex_lock(&w->mu);
    w->hb_stop = 1;
    pthread_cond_signal(&w->hb_cond);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->hb_thread, NULL);
  }
  if (w->c && leave) ps_client_leave(w->c);
  ps_client_destroy(w->c);
  free(w->versions);
  free(w->min_versions);
  free(w->tensors);
  free(w->job);
  pthread_cond_destroy(&w->hb_cond);
  pthread_mutex_destroy(&w->mu);
  memset(&w->sec, 0, sizeof w->sec); /* the token */
  free(w);
}

/* ---------------- what the job says ---------------- */

const char *ps_capi_job_json(const ps_capi_worker *w) { return ps_client_job_json(w->c); }
uint64_t ps_capi_param_count(const ps_capi_worker *w) { return ps_client_param_count(w->c); }
int ps_capi_num_shards(const ps_capi_worker *w) { return w->nshards; }
uint64_t ps_capi_worker_id(const ps_capi_worker *w) { return ps_client_worker_id(w->c); }
int ps_capi_rank(const ps_capi_worker *w) { return ps_client_rank(w->c); }
uint64_t ps_capi_start_version(const ps_capi_worker *w) { return ps_client_start_version(w->c); }
int ps_capi_mode(const ps_capi_worker *w) { return w->job->mode_kind; }
uint64_t ps_capi_step(const ps_capi_worker *w) { return atomic_load(&w->step); }
int ps_capi_push_pending(const ps_capi_worker *w) { return ps_client_push_pending(w->c); }

void ps_capi_describe(const ps_capi_worker *w, char *buf, size_t cap) {
  ps_model_spec_describe(&w->job->model, buf, cap);
}

int ps_capi_shard_range(const ps_capi_worker *w, int s, uint64_t *off, uint64_t *count) {
  if (s < 0 || s >= w->nshards) return fail(PS_ERANGE, "no such shard");
  size_t o, n;
  ps_client_shard_range(w->c, s, &o, &n);
  *off = o;
  *count = n;
  return PS_OK;
}

int ps_capi_num_tensors(const ps_capi_worker *w) { return w->n_tensors; }

int ps_capi_tensor(const ps_capi_worker *w, int i, char *name, size_t cap, uint64_t *off,
                   uint64_t *count, int *ndim, int64_t *shape) {
  if (i < 0 || i >= w->n_tensors) return fail(PS_ERANGE, "no such tensor");
  const capi_tensor *t = &w->tensors[i];
  if (cap) snprintf(name, cap, "%s", t->name);
  *off = t->off;
  *count = t->count;
  *ndim = t->ndim;
  memcpy(shape, t->shape, (size_t)t->ndim * sizeof *shape);
  return PS_OK;
}

int ps_capi_num_tables(const ps_capi_worker *w) { return w->job->n_tables; }

int ps_capi_table(const ps_capi_worker *w, int t, char *name, size_t cap, uint64_t *rows,
                  int *dim) {
  if (t < 0 || t >= w->job->n_tables) return fail(PS_ERANGE, "no such table");
  if (cap) snprintf(name, cap, "%s", w->job->tables[t].name);
  *rows = w->job->tables[t].rows;
  *dim = w->job->tables[t].dim;
  return PS_OK;
}

/* ---------------- pull and push ---------------- */

/* n values against the model's P: PS_EINVAL with a message otherwise. */
static int check_count(const ps_capi_worker *w, uint64_t n, const void *buf, const char *what) {
  char err[PS_ERRLEN];
  if (!buf || n != ps_client_param_count(w->c))
    return fail(ps_seterr(err, PS_EINVAL, "%s: a buffer of %" PRIu64 " floats, the model has %zu",
                          what, n, ps_client_param_count(w->c)),
                err);
  return PS_OK;
}

int ps_capi_pull(ps_capi_worker *w, float *params, uint64_t n, int wait) {
  int rc = check_count(w, n, params, "pull");
  if (rc != PS_OK) return rc;
  char err[PS_ERRLEN] = "";
  const uint64_t *min = wait && w->job->mode_kind == PS_MODE_SYNC ? w->min_versions : NULL;
  rc = ps_client_pull(w->c, params, w->versions, min, err);
  return rc == PS_OK ? PS_OK : fail(rc, err);
}

int ps_capi_versions(const ps_capi_worker *w, uint64_t *out, int n) {
  for (int s = 0; s < n && s < w->nshards; s++) out[s] = w->versions[s];
  return PS_OK;
}

/* The end of a round: its outputs, and under sync the step the next pull
 * waits for (or, if the gradient was dropped, the step that went on
 * without it: done already). */
static int push_finish(ps_capi_worker *w, const float *grads, uint64_t *ssum, uint64_t *smax,
                       int *dropped) {
  char err[PS_ERRLEN] = "";
  ps_push_result res = {0};
  int rc = ps_client_push_end(w->c, grads, &res, err);
  if (ssum) *ssum = res.staleness_sum;
  if (smax) *smax = res.staleness_max;
  if (dropped) *dropped = res.dropped;
  if (rc != PS_OK) return fail(rc, err);
  for (int s = 0; s < w->nshards; s++) w->min_versions[s] = w->versions[s] + 1;
  return PS_OK;
}

int ps_capi_push(ps_capi_worker *w, const float *grads, uint64_t n, int batch_size,
                 uint64_t *staleness_sum, uint64_t *staleness_max, int *dropped) {
  int rc = check_count(w, n, grads, "push");
  if (rc != PS_OK) return rc;
  uint64_t step = atomic_load(&w->step) + 1;
  /* The examples were drawn from the lease held, when one is (the loop
   * over leases holds one at a time): shard 0 counts them against it. */
  pthread_mutex_lock(&w->mu);
  uint64_t lease = w->n_held == 1 ? w->held[0] : 0;
  pthread_mutex_unlock(&w->mu);
  rc = ps_client_push_begin(w->c, w->versions, step, batch_size > 0 ? batch_size : 1, lease);
  if (rc != PS_OK) return fail(rc, "a push is still in flight");
  atomic_store(&w->step, step);
  return push_finish(w, grads, staleness_sum, staleness_max, dropped);
}

int ps_capi_push_retry(ps_capi_worker *w, const float *grads, uint64_t n, uint64_t *staleness_sum,
                       uint64_t *staleness_max, int *dropped) {
  int rc = check_count(w, n, grads, "push");
  if (rc != PS_OK) return rc;
  return push_finish(w, grads, staleness_sum, staleness_max, dropped);
}

int ps_capi_set_rows(ps_capi_worker *w, int n_sec, const int *tables, const uint64_t *const *ids,
                     const uint64_t *counts, float *const *values, const float *const *grads) {
  if (n_sec < 0 || n_sec > PS_MAX_TABLES)
    return fail(PS_EINVAL, "row sections: at most one per table of the job");
  ps_client_rows secs[PS_MAX_TABLES];
  for (int i = 0; i < n_sec; i++)
    secs[i] = (ps_client_rows){.table = tables[i],
                               .ids = ids[i],
                               .n = (size_t)counts[i],
                               .values = values[i],
                               .grads = grads[i]};
  char err[PS_ERRLEN] = "";
  int rc = ps_client_set_rows(w->c, secs, n_sec, err);
  return rc == PS_OK ? PS_OK : fail(rc, err);
}

/* ---------------- leases and heartbeats ---------------- */

/* The held leases after a Lease call: a completion reported goes, a
 * grant comes (under mu). */
static void track_leases(ps_capi_worker *w, uint64_t complete_id, int granted, uint64_t lease) {
  pthread_mutex_lock(&w->mu);
  w->leasing = 1;
  for (int i = 0; complete_id && i < w->n_held; i++)
    if (w->held[i] == complete_id) {
      w->held[i] = w->held[--w->n_held];
      break;
    }
  if (granted && w->n_held < HELD_MAX) w->held[w->n_held++] = lease;
  pthread_mutex_unlock(&w->mu);
}

int ps_capi_lease(ps_capi_worker *w, uint64_t complete_id, int want_next, uint64_t dataset_size,
                  int *status, uint64_t *lease_id, int *epoch, uint64_t *begin, uint32_t *count,
                  int *counted) {
  ps_client_lease l;
  char err[PS_ERRLEN] = "";
  int rc = ps_client_lease_call(w->c, complete_id, want_next, dataset_size, &l, err);
  if (rc != PS_OK) return fail(rc, err);
  track_leases(w, complete_id, l.status == 0 && l.lease_id, l.lease_id);
  *status = l.status;
  *lease_id = l.lease_id;
  *epoch = l.epoch;
  *begin = l.begin;
  *count = l.count;
  *counted = l.completed_counted;
  return PS_OK;
}

/* One heartbeat naming the leases held and the idle flag. */
static int heartbeat_once(ps_capi_worker *w, char *err) {
  uint64_t held[HELD_MAX];
  ps_client_hb_state st = {.leases = held};
  pthread_mutex_lock(&w->mu);
  memcpy(held, w->held, (size_t)w->n_held * sizeof *held);
  st.n_leases = w->n_held;
  st.names_leases = w->leasing;
  st.idle = w->idle;
  pthread_mutex_unlock(&w->mu);
  return ps_client_heartbeat(w->c, atomic_load(&w->step), &st, err);
}

int ps_capi_heartbeat(ps_capi_worker *w) {
  char err[PS_ERRLEN] = "";
  int rc = heartbeat_once(w, err);
  return rc == PS_OK ? PS_OK : fail(rc, err);
}

void ps_capi_set_idle(ps_capi_worker *w, int idle) {
  pthread_mutex_lock(&w->mu);
  int changed = w->idle != (idle != 0);
  w->idle = idle != 0;
  if (changed) { /* the shards hear of it at once */
    w->hb_now = 1;
    pthread_cond_signal(&w->hb_cond);
  }
  pthread_mutex_unlock(&w->mu);
}

static void *hb_main(void *arg) {
  ps_capi_worker *w = arg;
  pthread_mutex_lock(&w->mu);
  while (!w->hb_stop) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += w->hb_period_ms / 1000;
    until.tv_nsec += (long)(w->hb_period_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    while (!w->hb_stop && !w->hb_now && pthread_cond_timedwait(&w->hb_cond, &w->mu, &until) == 0) {
    }
    if (w->hb_stop) break;
    w->hb_now = 0;
    pthread_mutex_unlock(&w->mu);
    char err[PS_ERRLEN] = "";
    if (heartbeat_once(w, err) != PS_OK) PS_WARN("heartbeat: %s", err);
    pthread_mutex_lock(&w->mu);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

/* ---------------- Status ---------------- */

static json_t *message_json(const ProtobufCMessage *m);

/* Element i of field f's values at p as JSON. */
static json_t *value_json(const ProtobufCFieldDescriptor *f, const char *p, size_t i) {
  switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32: return json_integer(((const int32_t *)p)[i]);
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32: return json_integer(((const uint32_t *)p)[i]);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64: return json_integer(((const int64_t *)p)[i]);
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64: {
      uint64_t v = ((const uint64_t *)p)[i];
      return v <= INT64_MAX ? json_integer((json_int_t)v) : json_real((double)v);
    }
    case PROTOBUF_C_TYPE_FLOAT: return json_real(((const float *)p)[i]);
    case PROTOBUF_C_TYPE_DOUBLE: return json_real(((const double *)p)[i]);
    case PROTOBUF_C_TYPE_BOOL: return json_boolean(((const protobuf_c_boolean *)p)[i]);
    case PROTOBUF_C_TYPE_ENUM: {
      int v = ((const int *)p)[i];
      const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(f->descriptor, v);
      return ev ? json_string(ev->name) : json_integer(v);
    }
    case PROTOBUF_C_TYPE_STRING: {
      const char *s = ((char *const *)p)[i];
      char clean[1024];
      ps_utf8_sanitize(clean, sizeof clean, s); /* it comes from the network */
      return json_string(clean);
    }
    case PROTOBUF_C_TYPE_BYTES:
      return json_integer((json_int_t)((const ProtobufCBinaryData *)p)[i].len);
    case PROTOBUF_C_TYPE_MESSAGE: return message_json(((ProtobufCMessage *const *)p)[i]);
  }
  return json_null();
}

/* Any message as a JSON object of its fields by their proto names
 * (repeated fields as arrays, bytes as their length). */
static json_t *message_json(const ProtobufCMessage *m) {
  if (!m) return json_null();
  json_t *o = json_object();
  const ProtobufCMessageDescriptor *d = m->descriptor;
  for (unsigned k = 0; k < d->n_fields; k++) {
    const ProtobufCFieldDescriptor *f = &d->fields[k];
    const char *base = (const char *)m;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)(base + f->quantifier_offset);
      const char *arr = *(char *const *)(base + f->offset);
      json_t *a = json_array();
      for (size_t i = 0; i < n; i++) json_array_append_new(a, value_json(f, arr, i));
      json_object_set_new(o, f->name, a);
    } else {
      json_object_set_new(o, f->name, value_json(f, base + f->offset, 0));
    }
  }
  return o;
}

/* Every address of list's Status as a JSON array into *out. */
static int status_of(const char *list, const ps_security *sec, int timeout_ms, char **out,
                     char *err) {
  ps_cluster *cl = malloc(sizeof *cl);
  if (!cl) return ps_seterr(err, PS_ENOMEM, "out of memory");
  int rc = ps_cluster_parse_ps_list(list, cl, err);
  rpc_queue *q = rc == PS_OK ? rpc_queue_create() : NULL;
  if (rc == PS_OK && !q) rc = ps_seterr(err, PS_ENOMEM, "cannot create a queue");
  json_t *all = json_array();
  rpc_channel_opts co = {.tls = ps_security_tls(sec)};
  for (int i = 0; rc == PS_OK && i < cl->n_ps; i++) {
    char why[PS_ERRLEN] = "";
    json_t *one = NULL;
    rpc_channel *ch = rpc_channel_create(cl->ps[i], &co, why);
    int st = -1;
    Ps__StatusResponse *r = ch ? ps_status_call(q, ch, &sec->token, timeout_ms, &st, why) : NULL;
    if (r) {
      one = message_json(&r->base);
      ps__status_response__free_unpacked(r, NULL);
    }
    if (ch) rpc_channel_destroy(ch);
    if (!one) {
      char clean[PS_ERRLEN + 32];
      ps_utf8_sanitize(clean, sizeof clean, why);
      one = json_pack("{s:s,s:s}", "error",
                      st < 0         ? "no channel"
                      : st == RPC_OK ? "malformed"
                                     : rpc_status_name(st),
                      "message", clean);
    }
    json_object_set_new(one, "address", json_string(cl->ps[i]));
    json_array_append_new(all, one);
  }
  if (q) rpc_queue_destroy(q);
  free(cl);
  if (rc == PS_OK && !(*out = json_dumps(all, JSON_COMPACT)))
    rc = ps_seterr(err, PS_ENOMEM, "out of memory");
  json_decref(all);
  return rc;
}

int ps_capi_worker_status(ps_capi_worker *w, int timeout_ms, char **json_out) {
  char err[PS_ERRLEN] = "";
  *json_out = NULL;
  int rc = status_of(w->servers, &w->sec, timeout_ms > 0 ? timeout_ms : 5000, json_out, err);
  return rc == PS_OK ? PS_OK : fail(rc, err);
}

int ps_capi_status(const char *servers, const char *token_file, const char *tls_ca,
                   const char *tls_cert, const char *tls_key, int insecure, int timeout_ms,
                   char **json_out) {
  pthread_once(&init_once, init_process);
  *json_out = NULL;
  char err[PS_ERRLEN] = "";
  ps_security sec;
  ps_security_opts so = {.insecure = insecure != 0,
                         .token_file = token_file,
                         .tls_ca = tls_ca,
                         .tls_cert = tls_cert,
                         .tls_key = tls_key};
  int rc = ps_security_resolve(&so, PS_SECURITY_CLIENT, &sec, err);
  if (rc == PS_OK)
    rc = status_of(servers ? servers : "", &sec, timeout_ms > 0 ? timeout_ms : 5000, json_out, err);
  memset(&sec, 0, sizeof sec);
  return rc == PS_OK ? PS_OK : fail(rc, err);
}

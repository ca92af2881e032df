/* The `ps-server --status LIST` client: asks shards for their Status and
 * prints it as JSON (ps_status_print), or, with --watch, as a table
 * refreshed every interval for a person at a terminal (ps_status_watch).
 *
 * Both go through one client: one channel per address, one queue, and
 * status_fetch, which has every shard's call in flight at once and decodes
 * the replies; a shard that does not answer costs one deadline, not one
 * per shard. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "common/cluster.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "ps/main/status_cli.h"

/* ---------------- the client: channels, queue, fetch ---------------- */

typedef struct {
  int n;
  char (*addr)[PS_ADDR_LEN];
  rpc_channel **ch;
  rpc_queue *q;
  ps_security s;
  int rpc_up; /* rpc_global_init was called */
} status_client;

/* What one shard answered at one fetch. */
typedef struct {
  Ps__StatusResponse *r; /* NULL: no answer (code and why say why) */
  int code;              /* the call's gRPC status; STATUS_MALFORMED: the reply did not decode */
  char why[PS_ERRLEN];   /* the status message, sanitized (it comes from the network) */
} status_reply;

enum { STATUS_MALFORMED = -1 };

static void status_close(status_client *c) {
  for (int i = 0; i < c->n; i++)
    if (c->ch && c->ch[i]) rpc_channel_destroy(c->ch[i]);
  if (c->q) rpc_queue_destroy(c->q);
  if (c->rpc_up) rpc_global_shutdown();
  free(c->ch);
  free(c->addr);
  memset(c, 0, sizeof *c);
}

/* Parses the list (as --ps does), resolves the security flags as a client
 * and makes the channels and the queue. Returns 0, or the process's exit
 * code with a message on stderr: 2 for a bad list or security flag, 1 when
 * a channel or the queue cannot be made. */
static int status_open(status_client *c, const char *list, const ps_security_opts *sec) {
  char err[PS_ERRLEN];
  memset(c, 0, sizeof *c);
  ps_cluster *cl = calloc(1, sizeof *cl);
  if (!cl) {
    fprintf(stderr, "ps-server: --status: out of memory\n");
    return 1;
  }
  if (ps_cluster_parse_ps_list(list, cl, err) != 0) {
    fprintf(stderr, "ps-server: --status: %s\n", err);
    free(cl);
    return 2;
  }
  c->n = cl->n_ps;
  c->addr = malloc((size_t)c->n * sizeof *c->addr);
  c->ch = calloc((size_t)c->n, sizeof *c->ch);
  if (!c->addr || !c->ch) {
    free(cl);
    status_close(c);
    fprintf(stderr, "ps-server: --status: out of memory\n");
    return 1;
  }
  memcpy(c->addr, cl->ps, (size_t)c->n * sizeof *c->addr);
  free(cl);
  /* As a client: the read-only token does as well as the job's. */
  ps_security_opts so = *sec;
  if (!so.token_file && so.read_token_file) so.token_file = so.read_token_file;
  so.read_token_file = NULL;
  if (ps_security_resolve(&so, PS_SECURITY_CLIENT, &c->s, err) != 0) {
    fprintf(stderr, "ps-server: --status: %s\n", err);
    status_close(c);
    return 2;
  }
  rpc_global_init();
  c->rpc_up = 1;
  rpc_channel_opts co = {.tls = ps_security_tls(&c->s)};
  for (int i = 0; i < c->n; i++) {
    c->ch[i] = rpc_channel_create(c->addr[i], &co, err);
    if (!c->ch[i]) {
      fprintf(stderr, "ps-server: %s\n", err);
      status_close(c);
      return 1;
    }
  }
  c->q = rpc_queue_create();
  if (!c->q) {
    fprintf(stderr, "ps-server: cannot create a queue\n");
    status_close(c);
    return 1;
  }
  return 0;
}

static void status_reply_clear(status_reply *rep) {
  if (rep->r) ps__status_response__free_unpacked(rep->r, NULL);
  rep->r = NULL;
}

/* Asks every shard for its Status at once (all calls in flight on the one
 * queue, each with the deadline timeout_ms) and decodes the replies into
 * rep[0 .. c->n), whose previous replies are freed first. */
static void status_fetch(status_client *c, int timeout_ms, status_reply *rep) {
  Ps__RequestHeader h = PS__REQUEST_HEADER__INIT;
  h.protocol_version = PS_PROTOCOL_VERSION;
  h.job_id = "";
  h.token = (ProtobufCBinaryData){.len = c->s.token.len, .data = c->s.token.bytes};
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  rpc_request *rq[PS_MAX_TASKS] = {0};
  char err[PS_ERRLEN];
  for (int i = 0; i < c->n; i++) {
    status_reply_clear(&rep[i]);
    rep[i].code = RPC_INTERNAL;
    rep[i].why[0] = '\0';
    rpc_msg msg;
    if (wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) != 0) {
      snprintf(rep[i].why, sizeof rep[i].why, "cannot encode the request (out of memory)");
      continue;
    }
    rq[i] = rpc_start(c->q, c->ch[i], "/ps.ParameterServer/Status", &msg, timeout_ms, 1, err);
    if (!rq[i]) ps_utf8_sanitize(rep[i].why, sizeof rep[i].why, err);
  }
  for (int i = 0; i < c->n; i++) {
    if (!rq[i]) continue;
    ps_segview v;
    int st = rpc_wait(rq[i], err, &v);
    rep[i].code = st;
    if (st != RPC_OK) {
      ps_utf8_sanitize(rep[i].why, sizeof rep[i].why, err);
    } else {
      ps_seg *tsegs = malloc((size_t)(v.nsegs > 0 ? v.nsegs : 1) * sizeof *tsegs);
      ps_segview tensor;
      ProtobufCMessage *m = tsegs ? wire_decode(&ps__status_response__descriptor, &v, tsegs,
                                                v.nsegs, &tensor, err)
                                  : NULL;
      free(tsegs);
      if (!m) {
        rep[i].code = STATUS_MALFORMED;
        ps_utf8_sanitize(rep[i].why, sizeof rep[i].why, tsegs ? err : "out of memory");
      } else {
        rep[i].r = (Ps__StatusResponse *)m;
      }
    }
    rpc_request_free(rq[i]);
  }
}

/* ---------------- JSON ---------------- */

static json_t *status_json(const Ps__StatusResponse *r) {
  json_t *o = json_object();
  json_object_set_new(o, "shard", json_integer(r->shard_index));
  json_object_set_new(o, "num_shards", json_integer(r->num_shards));
  json_object_set_new(o, "job_id", json_string(r->job_id ? r->job_id : ""));
  json_object_set_new(o, "mode", json_string(r->mode ? r->mode : ""));
  json_object_set_new(o, "wire", json_string(r->wire && *r->wire ? r->wire : "fp32"));
  json_object_set_new(o, "range", json_pack("[I,I]", (json_int_t)r->range_offset,
                                            (json_int_t)(r->range_offset + r->range_count)));
  json_object_set_new(o, "version", json_integer((json_int_t)r->version));
  json_object_set_new(o, "checkpoint_set", json_integer((json_int_t)r->checkpoint_set));
  json_object_set_new(o, "checkpoint_set_version",
                      json_integer((json_int_t)r->checkpoint_set_version));
  json_object_set_new(o, "pushes", json_integer((json_int_t)r->pushes));
  json_object_set_new(o, "pulls", json_integer((json_int_t)r->pulls));
  json_object_set_new(o, "rejected", json_integer((json_int_t)r->rejected));
  json_object_set_new(o, "push_bytes", json_integer((json_int_t)r->push_bytes));
  json_object_set_new(o, "pull_bytes", json_integer((json_int_t)r->pull_bytes));
  json_object_set_new(o, "state_crc", json_integer((json_int_t)r->state_crc));
  if (r->replica_role && *r->replica_role) {
    json_t *members = json_array(), *in_sync = json_array();
    for (size_t i = 0; i < r->n_replica_members; i++)
      json_array_append_new(members, json_integer(r->replica_members[i]));
    for (size_t i = 0; i < r->n_replica_in_sync; i++)
      json_array_append_new(in_sync, json_integer(r->replica_in_sync[i]));
    json_object_set_new(o, "replica",
                        json_pack("{s:i,s:s,s:I,s:i,s:I,s:I,s:o,s:o,s:b,s:I}", "index",
                                  (int)r->replica, "role", r->replica_role, "term",
                                  (json_int_t)r->replica_term, "primary", (int)r->replica_primary,
                                  "seq", (json_int_t)r->replica_seq, "seq_term",
                                  (json_int_t)r->replica_seq_term, "members", members, "in_sync",
                                  in_sync, "fresh", (int)r->replica_fresh, "acked",
                                  (json_int_t)r->replica_acked));
  }
  if (r->n_tables) {
    json_t *tables = json_array();
    for (size_t i = 0; i < r->n_tables; i++) {
      const Ps__TableStatus *t = r->tables[i];
      json_array_append_new(
          tables, json_pack("{s:s,s:I,s:i,s:s,s:I,s:I,s:I,s:I,s:I,s:I}", "name",
                            t->name ? t->name : "", "rows", (json_int_t)t->rows, "dim", (int)t->dim,
                            "optimizer", t->optimizer ? t->optimizer : "", "rows_held",
                            (json_int_t)t->rows_held, "rows_pulled", (json_int_t)t->rows_pulled,
                            "rows_pushed", (json_int_t)t->rows_pushed, "rejected",
                            (json_int_t)t->rejected, "bytes", (json_int_t)t->bytes, "crc",
                            (json_int_t)t->crc));
    }
    json_object_set_new(o, "tables", tables);
  }
  json_object_set_new(o, "staleness_mean", json_real(r->staleness_mean));
  json_object_set_new(o, "staleness_max", json_integer((json_int_t)r->staleness_max));
  json_t *hist = json_array();
  for (size_t i = 0; i < r->n_staleness_hist; i++)
    json_array_append_new(hist, json_integer((json_int_t)r->staleness_hist[i]));
  json_object_set_new(o, "staleness_hist", hist);
  json_object_set_new(o, "workers_dropped", json_integer((json_int_t)r->workers_dropped));
  json_object_set_new(o, "live_workers", json_integer(r->live_workers));
  json_object_set_new(o, "dropped", json_integer((json_int_t)r->dropped));
  json_object_set_new(o, "sync_short_steps", json_integer((json_int_t)r->sync_short_steps));
  json_object_set_new(o, "waits", json_integer((json_int_t)r->waits));
  json_object_set_new(o, "wait_ms_mean", json_real(r->wait_ms_mean));
  json_object_set_new(o, "waiting_now", json_integer(r->waiting_now));
  json_object_set_new(o, "step_time_ms", json_real(r->step_time_ms));
  json_object_set_new(o, "ssp_max_lead", json_integer((json_int_t)r->ssp_max_lead));
  json_object_set_new(o, "backup_workers", json_integer(r->backup_workers));
  json_object_set_new(o, "sync_pending", json_integer(r->sync_pending));
  json_object_set_new(o, "uptime_s", json_real(r->uptime_s));
  json_object_set_new(o, "cpu_seconds", json_real(r->cpu_seconds));
  json_t *ws = json_array();
  for (size_t i = 0; i < r->n_workers; i++) {
    Ps__WorkerInfo *w = r->workers[i];
    char id[32];
    snprintf(id, sizeof id, "%08" PRIx32 "...", (uint32_t)(w->worker_id >> 32)); /* not in full */
    json_t *held = json_array();
    for (size_t k = 0; k < w->n_leases; k++) {
      char lid[24];
      snprintf(lid, sizeof lid, "%" PRIx64, w->leases[k]);
      json_array_append_new(held, json_string(lid));
    }
    json_array_append_new(
        ws, json_pack("{s:s,s:s,s:s,s:i,s:I,s:I,s:I,s:I,s:b,s:o}", "id", id, "host",
                      w->host ? w->host : "", "role", w->role ? w->role : "", "task_index",
                      w->task_index, "step", (json_int_t)w->step, "pushes", (json_int_t)w->pushes,
                      "clock", (json_int_t)w->clock, "ms_since_seen",
                      (json_int_t)w->ms_since_seen, "idle", (int)w->idle, "leases", held));
  }
  json_object_set_new(o, "workers", ws);
  json_t *eps = json_array();
  for (size_t i = 0; i < r->n_lease_epochs; i++) {
    Ps__LeaseEpoch *e = r->lease_epochs[i];
    json_array_append_new(
        eps, json_pack("{s:i,s:b,s:i,s:i,s:i,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "epoch",
                       (int)e->epoch, "finished", (int)e->finished, "chunks", (int)e->chunks,
                       "chunks_completed", (int)e->chunks_completed, "chunks_once",
                       (int)e->chunks_once, "examples_completed", (json_int_t)e->examples_completed,
                       "examples_handed_out", (json_int_t)e->examples_handed_out,
                       "examples_rehanded", (json_int_t)e->examples_rehanded, "reclaims",
                       (json_int_t)e->reclaims, "examples_redone", (json_int_t)e->examples_redone,
                       "examples_recovered", (json_int_t)e->examples_recovered, "examples_wasted",
                       (json_int_t)e->examples_wasted, "examples_abandoned",
                       (json_int_t)e->examples_abandoned));
  }
  json_object_set_new(o, "lease_epochs", eps);
  return o;
}

/* Prints a JSON value on stdout; 0, or 1 for want of memory. */
static int json_print(json_t *o) {
  char *text = o ? json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(6)) : NULL;
  if (!text) {
    fprintf(stderr, "ps-server: --status: out of memory\n");
    return 1;
  }
  printf("%s\n", text);
  free(text);
  return 0;
}

int ps_status_print(const char *list, const ps_security_opts *sec, int timeout_ms) {
  status_client c;
  int rc = status_open(&c, list, sec);
  if (rc != 0) return rc;
  status_reply *rep = calloc((size_t)c.n, sizeof *rep);
  if (!rep) {
    fprintf(stderr, "ps-server: --status: out of memory\n");
    status_close(&c);
    return 1;
  }
  status_fetch(&c, timeout_ms, rep);
  /* One address: its object, as it always was; several: an array in their
   * order, with {"address", "error"} for a shard that did not answer. */
  json_t *all = c.n > 1 ? json_array() : NULL;
  for (int i = 0; i < c.n; i++) {
    if (rep[i].r) {
      json_t *o = status_json(rep[i].r);
      if (all)
        json_array_append_new(all, o);
      else if (json_print(o) != 0)
        rc = 1;
      if (!all) json_decref(o);
      continue;
    }
    rc = 1;
    if (rep[i].code == STATUS_MALFORMED)
      fprintf(stderr, "ps-server: malformed Status reply from %s: %s\n", c.addr[i], rep[i].why);
    else
      fprintf(stderr, "ps-server: Status from %s: %s: %s%s\n", c.addr[i],
              rpc_status_name(rep[i].code), rep[i].why,
              rep[i].code == RPC_DEADLINE_EXCEEDED
                  ? " (nothing answered: is the server up, and does it "
                    "talk TLS (--tls-ca) or plaintext (--insecure)?)"
                  : "");
    if (all) {
      char e[PS_ERRLEN + 32];
      snprintf(e, sizeof e, "%.24s: %.200s",
               rep[i].code == STATUS_MALFORMED ? "malformed reply" : rpc_status_name(rep[i].code),
               rep[i].why);
      json_array_append_new(all, json_pack("{s:s,s:s}", "address", c.addr[i], "error", e));
    }
  }
  if (all) {
    if (json_print(all) != 0) rc = 1;
    json_decref(all);
  }
  for (int i = 0; i < c.n; i++) status_reply_clear(&rep[i]);
  free(rep);
  status_close(&c);
  return rc;
}

/* ---------------- the watch: a table ---------------- */

/* The width of UTF-8 text in characters (each taken as one column). */
static size_t text_width(const char *s) {
  size_t n = 0;
  for (; *s; s++)
    if (((unsigned char)*s & 0xC0) != 0x80) n++;
  return n;
}

/* The byte length of the first max characters of s. */
static size_t text_prefix(const char *s, size_t len, size_t max) {
  size_t chars = 0, i = 0;
  for (; i < len; i++) {
    if (((unsigned char)s[i] & 0xC0) != 0x80) {
      if (chars == max) break;
      chars++;
    }
  }
  return i;
}

/* A table of text cells: columns as wide as their widest cell; a row may
 * end in one text that spans the columns from `span` on. */
enum { TABLE_COLS = 10 };
typedef struct {
  int ncol;
  const char *align; /* 'l' or 'r' per column */
  size_t w[TABLE_COLS];
  char **cell; /* rows * ncol, each malloc'd or NULL */
  int *span;   /* per row: ncol, or the column whose text spans the rest */
  int rows, cap, oom;
} table;

static void table_init(table *t, int ncol, const char *align) {
  memset(t, 0, sizeof *t);
  t->ncol = ncol;
  t->align = align;
}

static void table_free(table *t) {
  for (int i = 0; i < t->rows * t->ncol; i++) free(t->cell[i]);
  free(t->cell);
  free(t->span);
  memset(t, 0, sizeof *t);
}

/* Adds a row of n cells (n == ncol, or fewer: the last spans the rest). */
static void table_row(table *t, int n, const char *const *cells) {
  if (t->rows == t->cap) {
    int cap = t->cap ? 2 * t->cap : 16;
    char **cell = realloc(t->cell, (size_t)cap * (size_t)t->ncol * sizeof *cell);
    if (cell) t->cell = cell;
    int *span = cell ? realloc(t->span, (size_t)cap * sizeof *span) : NULL;
    if (span) t->span = span;
    if (!cell || !span) {
      t->oom = 1;
      return;
    }
    t->cap = cap;
  }
  char **row = t->cell + (size_t)t->rows * (size_t)t->ncol;
  for (int j = 0; j < t->ncol; j++) row[j] = j < n ? strdup(cells[j]) : NULL;
  for (int j = 0; j < n && j < t->ncol; j++)
    if (!row[j]) t->oom = 1;
  t->span[t->rows] = n < t->ncol ? n - 1 : t->ncol;
  for (int j = 0; j < n && j < t->ncol; j++) {
    if (j == t->span[t->rows]) break; /* a spanning text widens nothing */
    size_t w = row[j] ? text_width(row[j]) : 0;
    if (w > t->w[j]) t->w[j] = w;
  }
  t->rows++;
}

static void pad(FILE *f, size_t n) {
  for (size_t i = 0; i < n; i++) fputc(' ', f);
}

static void table_print(const table *t, FILE *f) {
  for (int i = 0; i < t->rows; i++) {
    char **row = t->cell + (size_t)i * (size_t)t->ncol;
    int span = t->span[i];
    /* the last column that has text: no padding after it */
    int last = span < t->ncol ? span : t->ncol - 1;
    while (last > 0 && !(row[last] && row[last][0]) && t->align[last] == 'l') last--;
    for (int j = 0; j <= last; j++) {
      const char *s = row[j] ? row[j] : "";
      size_t w = text_width(s);
      if (j > 0) fputs("  ", f);
      if (j == span) {
        fputs(s, f);
        break;
      }
      if (t->align[j] == 'r') pad(f, t->w[j] - w);
      fputs(s, f);
      if (t->align[j] != 'r' && j < last) pad(f, t->w[j] - w);
    }
    fputc('\n', f);
  }
}

/* What the watch keeps of a shard between refreshes: its last answer's
 * counters, for rates. */
typedef struct {
  int have;
  uint32_t shard;
  uint64_t pushes, pulls;
  double uptime_s;
} shard_seen;

static void fmt_uptime(char *out, size_t cap, double s) {
  uint64_t t = s > 0 ? (uint64_t)s : 0;
  if (t < 60)
    snprintf(out, cap, "%" PRIu64 "s", t);
  else if (t < 3600)
    snprintf(out, cap, "%" PRIu64 "m%02" PRIu64 "s", t / 60, t % 60);
  else if (t < 86400)
    snprintf(out, cap, "%" PRIu64 "h%02" PRIu64 "m", t / 3600, t / 60 % 60);
  else
    snprintf(out, cap, "%" PRIu64 "d%02" PRIu64 "h", t / 86400, t / 3600 % 24);
}

static void fmt_rate(char *out, size_t cap, uint64_t now, uint64_t before, double dt) {
  if (now < before || !(dt > 0))
    snprintf(out, cap, "-");
  else
    snprintf(out, cap, "%.1f", (double)(now - before) / dt);
}

/* One refresh, written to f: a title, one line per shard, one per worker
 * (as the first answering shard 0, else the first answering shard, lists
 * them); no blank line. seen[] is updated for the next refresh's rates. */
static void watch_frame(FILE *f, const status_client *c, const status_reply *rep,
                        shard_seen *seen, int refresh, double interval_s, int tty) {
  char when[32];
  time_t now = time(NULL);
  struct tm tm;
  if (localtime_r(&now, &tm))
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
  else
    snprintf(when, sizeof when, "?");
  fprintf(f, "ps-server --status: %d shard%s, refresh %d at %s, every %gs%s\n", c->n,
          c->n == 1 ? "" : "s", refresh, when, interval_s, tty ? " (Ctrl-C stops)" : "");

  table t;
  table_init(&t, 10, "rrrrrrrrrl");
  static const char *const shead[] = {"shard",   "version", "push/s", "pull/s", "stale mean/max",
                                      "workers", "waiting", "ckpt",   "uptime", "address"};
  table_row(&t, 10, shead);
  int list_from = -1; /* the reply whose worker list is shown */
  for (int i = 0; i < c->n; i++) {
    const Ps__StatusResponse *r = rep[i].r;
    char idx[16], ver[24], push[32], pull[32], stale[48], live[16], wait[16], ckpt[24], up[24];
    if (!r) {
      char msg[PS_ERRLEN + PS_ADDR_LEN + 64];
      if (seen[i].have)
        snprintf(idx, sizeof idx, "%" PRIu32, seen[i].shard);
      else
        snprintf(idx, sizeof idx, "?");
      if (rep[i].code == RPC_DEADLINE_EXCEEDED || rep[i].code == RPC_UNAVAILABLE)
        snprintf(msg, sizeof msg, "%s  unreachable: %s", c->addr[i], rpc_status_name(rep[i].code));
      else if (rep[i].code == STATUS_MALFORMED)
        snprintf(msg, sizeof msg, "%s  malformed reply: %.120s", c->addr[i], rep[i].why);
      else
        snprintf(msg, sizeof msg, "%s  %s: %.120s", c->addr[i], rpc_status_name(rep[i].code),
                 rep[i].why);
      const char *cells[2] = {idx, msg};
      table_row(&t, 2, cells);
      continue;
    }
    if (list_from < 0 || (r->shard_index == 0 && rep[list_from].r->shard_index != 0))
      list_from = i;
    int fresh = seen[i].have && seen[i].shard == r->shard_index;
    double dt = fresh ? r->uptime_s - seen[i].uptime_s : 0;
    snprintf(idx, sizeof idx, "%" PRIu32, r->shard_index);
    snprintf(ver, sizeof ver, "%" PRIu64, r->version);
    if (fresh) {
      fmt_rate(push, sizeof push, r->pushes, seen[i].pushes, dt);
      fmt_rate(pull, sizeof pull, r->pulls, seen[i].pulls, dt);
    } else {
      snprintf(push, sizeof push, "-");
      snprintf(pull, sizeof pull, "-");
    }
    snprintf(stale, sizeof stale, "%.2f/%" PRIu64, r->staleness_mean, r->staleness_max);
    snprintf(live, sizeof live, "%" PRIu32, r->live_workers);
    snprintf(wait, sizeof wait, "%" PRIu32, r->waiting_now);
    if (r->checkpoint_set)
      snprintf(ckpt, sizeof ckpt, "%" PRIu64, r->checkpoint_set);
    else
      snprintf(ckpt, sizeof ckpt, "-");
    fmt_uptime(up, sizeof up, r->uptime_s);
    const char *cells[10] = {idx, ver, push, pull, stale, live, wait, ckpt, up, c->addr[i]};
    table_row(&t, 10, cells);
    seen[i] = (shard_seen){.have = 1, .shard = r->shard_index, .pushes = r->pushes,
                           .pulls = r->pulls, .uptime_s = r->uptime_s};
  }
  table_print(&t, f);
  table_free(&t);

  if (list_from < 0) {
    fprintf(f, "workers: no shard answered\n");
    return;
  }
  const Ps__StatusResponse *r = rep[list_from].r;
  if (r->shard_index != 0)
    fprintf(f, "workers as shard %" PRIu32 " lists them (shard 0 did not answer):\n",
            r->shard_index);
  if (r->n_workers == 0) {
    fprintf(f, "workers: none registered\n");
    return;
  }
  table_init(&t, 9, "lllrrrrrl");
  static const char *const whead[] = {"worker", "host",   "role", "task", "step",
                                      "pushes", "leases", "seen", "idle"};
  table_row(&t, 9, whead);
  for (size_t k = 0; k < r->n_workers; k++) {
    const Ps__WorkerInfo *w = r->workers[k];
    char id[16], host[256], role[128], task[16], step[24], pushes[24], leases[16], sn[32];
    snprintf(id, sizeof id, "%08" PRIx32, (uint32_t)(w->worker_id >> 32));
    /* names from the network: no control character reaches the terminal */
    ps_utf8_sanitize(host, sizeof host, w->host);
    ps_utf8_sanitize(role, sizeof role, w->role);
    if (tty) host[text_prefix(host, strlen(host), 24)] = '\0';
    if (tty) role[text_prefix(role, strlen(role), 12)] = '\0';
    snprintf(task, sizeof task, "%" PRId32, w->task_index);
    snprintf(step, sizeof step, "%" PRIu64, w->step);
    snprintf(pushes, sizeof pushes, "%" PRIu64, w->pushes);
    snprintf(leases, sizeof leases, "%zu", w->n_leases);
    snprintf(sn, sizeof sn, "%.1fs", (double)w->ms_since_seen / 1000.0);
    const char *cells[9] = {id, host, role, task, step, pushes, leases, sn, w->idle ? "idle" : ""};
    table_row(&t, 9, cells);
  }
  table_print(&t, f);
  if (t.oom) fprintf(f, "(out of memory: rows left out)\n");
  table_free(&t);
}

/* Writes a frame to stdout: at a terminal, after clearing the screen, each
 * line cut to the terminal's width and the frame to its height; elsewhere
 * as it is, followed by a blank line. */
static void watch_show(const char *frame, size_t len, int tty) {
  if (!tty) {
    fwrite(frame, 1, len, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    return;
  }
  struct winsize ws;
  size_t cols = 0, rows = 0;
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0) {
    cols = ws.ws_col;
    rows = ws.ws_row;
  }
  size_t nlines = 0;
  for (size_t i = 0; i < len; i++)
    if (frame[i] == '\n') nlines++;
  /* too many lines: keep rows - 1, the last of them saying how many more */
  size_t keep = rows >= 3 && nlines > rows - 1 ? rows - 2 : nlines;
  fputs("\033[H\033[2J", stdout);
  const char *p = frame, *end = frame + len;
  for (size_t l = 0; l < keep && p < end; l++) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
    fwrite(p, 1, cols ? text_prefix(p, n, cols) : n, stdout);
    fputc('\n', stdout);
    p = nl ? nl + 1 : end;
  }
  if (keep < nlines) printf("... %zu more lines (a taller terminal shows them)\n", nlines - keep);
  fflush(stdout);
}

int ps_status_watch(const char *list, const ps_security_opts *sec, double interval_s, int count) {
  /* SIGINT and SIGTERM are taken with sigtimedwait between refreshes:
   * blocked before gRPC starts its threads, so that they inherit the mask
   * and no signal is lost on one of them. They stay blocked: the caller
   * exits after this. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);

  status_client c;
  int rc = status_open(&c, list, sec);
  if (rc != 0) return rc;
  status_reply *rep = calloc((size_t)c.n, sizeof *rep);
  shard_seen *seen = calloc((size_t)c.n, sizeof *seen);
  if (!rep || !seen) {
    fprintf(stderr, "ps-server: --status: out of memory\n");
    free(rep);
    free(seen);
    status_close(&c);
    return 1;
  }
  int tty = isatty(STDOUT_FILENO);
  /* A shard that does not answer holds a refresh up to this long (the
   * others answer at once: every call is in flight together). */
  double t_ms = interval_s * 1000.0;
  int timeout_ms = t_ms < 1000 ? 1000 : t_ms > 10000 ? 10000 : (int)t_ms;
  double next = ps_now_s();
  int stop = 0;
  for (int k = 1; !stop; k++) {
    status_fetch(&c, timeout_ms, rep);
    char *frame = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&frame, &len);
    if (f) {
      watch_frame(f, &c, rep, seen, k, interval_s, tty);
      if (fclose(f) == 0) watch_show(frame, len, tty);
    }
    free(frame);
    if (!f) fprintf(stderr, "ps-server: --watch: out of memory for a refresh\n");
    if (count > 0 && k >= count) break;
    next += interval_s;
    for (;;) { /* until the next refresh, or a signal */
      double left = next - ps_now_s();
      if (left <= 0) {
        if (left < -interval_s) next = ps_now_s(); /* fell behind: no burst to catch up */
        break;
      }
      struct timespec ts = {.tv_sec = (time_t)left,
                            .tv_nsec = (long)((left - (double)(time_t)left) * 1e9)};
      int sig = sigtimedwait(&sigs, NULL, &ts);
      if (sig == SIGINT || sig == SIGTERM) {
        stop = 1;
        break;
      }
      if (sig < 0 && errno != EINTR && errno != EAGAIN) break;
    }
  }
  for (int i = 0; i < c.n; i++) status_reply_clear(&rep[i]);
  free(rep);
  free(seen);
  status_close(&c);
  return 0;
}

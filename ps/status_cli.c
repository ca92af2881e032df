/* The `ps-server --status ADDR` client: asks a shard for its Status and
 * prints it as JSON. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "../common/wire.h"
#include "proto/ps.pb-c.h"
#include "server.h"

int ps_status_print(const char *addr, const ps_security_opts *sec, int timeout_ms) {
  char err[PS_ERRLEN];
  /* As a client: the read-only token does as well as the job's. */
  ps_security_opts so = *sec;
  if (!so.token_file && so.read_token_file) so.token_file = so.read_token_file;
  so.read_token_file = NULL;
  ps_security s;
  if (ps_security_resolve(&so, PS_SECURITY_CLIENT, &s, err) != 0) {
    fprintf(stderr, "ps-server: --status: %s\n", err);
    return 2;
  }
  rpc_global_init();
  rpc_channel_opts co = {.tls = ps_security_tls(&s)};
  rpc_channel *ch = rpc_channel_create(addr, &co, err);
  rpc_queue *q = rpc_queue_create();
  int rc = 1;
  if (!ch || !q) {
    fprintf(stderr, "ps-server: %s\n", ch ? "cannot create a queue" : err);
    goto out;
  }
  Ps__RequestHeader h = PS__REQUEST_HEADER__INIT;
  h.protocol_version = PS_PROTOCOL_VERSION;
  h.job_id = "";
  h.token = (ProtobufCBinaryData){.len = s.token.len, .data = s.token.bytes};
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  rpc_msg msg;
  if (wire_encode(&req.base, NULL, 0, NULL, NULL, &msg) != 0) goto out;
  uint8_t *buf = NULL;
  size_t len = 0;
  int st = rpc_call_sync(q, ch, "/ps.ParameterServer/Status", &msg, timeout_ms, 1, &buf, &len, err);
  if (st != RPC_OK) {
    fprintf(stderr, "ps-server: Status from %s: %s: %s%s\n", addr, rpc_status_name(st), err,
            st == RPC_DEADLINE_EXCEEDED ? " (nothing answered: is the server up, and does it "
                                          "talk TLS (--tls-ca) or plaintext (--insecure)?)"
                                        : "");
    goto out;
  }
  Ps__StatusResponse *r = ps__status_response__unpack(NULL, len, buf);
  free(buf);
  if (!r) {
    fprintf(stderr, "ps-server: malformed Status reply from %s\n", addr);
    goto out;
  }
  json_t *o = json_object();
  json_object_set_new(o, "shard", json_integer(r->shard_index));
  json_object_set_new(o, "num_shards", json_integer(r->num_shards));
  json_object_set_new(o, "job_id", json_string(r->job_id ? r->job_id : ""));
  json_object_set_new(o, "mode", json_string(r->mode ? r->mode : ""));
  json_object_set_new(o, "range", json_pack("[I,I]", (json_int_t)r->range_offset,
                                            (json_int_t)(r->range_offset + r->range_count)));
  json_object_set_new(o, "version", json_integer((json_int_t)r->version));
  json_object_set_new(o, "checkpoint_set", json_integer((json_int_t)r->checkpoint_set));
  json_object_set_new(o, "checkpoint_set_version",
                      json_integer((json_int_t)r->checkpoint_set_version));
  json_object_set_new(o, "pushes", json_integer((json_int_t)r->pushes));
  json_object_set_new(o, "pulls", json_integer((json_int_t)r->pulls));
  json_object_set_new(o, "rejected", json_integer((json_int_t)r->rejected));
  json_object_set_new(o, "staleness_mean", json_real(r->staleness_mean));
  json_object_set_new(o, "staleness_max", json_integer((json_int_t)r->staleness_max));
  json_t *hist = json_array();
  for (size_t i = 0; i < r->n_staleness_hist; i++)
    json_array_append_new(hist, json_integer((json_int_t)r->staleness_hist[i]));
  json_object_set_new(o, "staleness_hist", hist);
  json_object_set_new(o, "workers_dropped", json_integer((json_int_t)r->workers_dropped));
  json_object_set_new(o, "live_workers", json_integer(r->live_workers));
  json_object_set_new(o, "dropped", json_integer((json_int_t)r->dropped));
  json_object_set_new(o, "waits", json_integer((json_int_t)r->waits));
  json_object_set_new(o, "wait_ms_mean", json_real(r->wait_ms_mean));
  json_object_set_new(o, "waiting_now", json_integer(r->waiting_now));
  json_object_set_new(o, "step_time_ms", json_real(r->step_time_ms));
  json_object_set_new(o, "ssp_max_lead", json_integer((json_int_t)r->ssp_max_lead));
  json_object_set_new(o, "backup_workers", json_integer(r->backup_workers));
  json_object_set_new(o, "sync_pending", json_integer(r->sync_pending));
  json_object_set_new(o, "uptime_s", json_real(r->uptime_s));
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
        eps, json_pack("{s:i,s:b,s:i,s:i,s:i,s:I,s:I,s:I,s:I,s:I}", "epoch", (int)e->epoch,
                       "finished", (int)e->finished, "chunks", (int)e->chunks, "chunks_completed",
                       (int)e->chunks_completed, "chunks_once", (int)e->chunks_once,
                       "examples_completed", (json_int_t)e->examples_completed,
                       "examples_handed_out", (json_int_t)e->examples_handed_out,
                       "examples_rehanded", (json_int_t)e->examples_rehanded, "reclaims",
                       (json_int_t)e->reclaims, "examples_redone",
                       (json_int_t)e->examples_redone));
  }
  json_object_set_new(o, "lease_epochs", eps);
  char *text = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
  printf("%s\n", text);
  free(text);
  json_decref(o);
  ps__status_response__free_unpacked(r, NULL);
  rc = 0;
out:
  if (q) rpc_queue_destroy(q);
  if (ch) rpc_channel_destroy(ch);
  rpc_global_shutdown();
  return rc;
}

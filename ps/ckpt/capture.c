/* The copy of a shard's state that a checkpoint writes (capture.h), taken
 * for a set at its cut (cut.c) or for a file written alone at shutdown
 * (server_ckpt.c), and the count of files written. */
#include "ps/ckpt/capture.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/ckpt/table_ckpt.h"

/* The embedding rows, taken under the shard's update lock (with the dense
 * copy): of the same version. */
typedef struct {
  ps_server *sv;
  ps_ckpt *ck;
  char err[PS_ERRLEN];
} capture_rows;

static int capture_tables(void *user) {
  capture_rows *c = user;
  return ps_table_ckpt_save(&c->sv->job, c->sv->tables, &c->ck->tables, &c->ck->tables_len,
                            c->err);
}

int ps_ckpt_capture(ps_server *sv, ps_ckpt *ck) {
  memset(ck, 0, sizeof *ck);
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  ck->n_slots = ps_shard_n_slots(sv->shard);
  ck->params = ps_alloc((n ? n : 1) * sizeof(float));
  int ok = ck->params != NULL;
  for (int k = 0; k < ck->n_slots; k++) {
    ck->slots[k] = ps_alloc((n ? n : 1) * sizeof(float));
    ok = ok && ck->slots[k];
  }
  if (!ok) return PS_ENOMEM;
  capture_rows rows = {.sv = sv, .ck = ck};
  int trc = ps_shard_export_state_with(sv->shard, ck->params, ck->slots, &ck->meta.version,
                                       sv->n_tables ? capture_tables : NULL, &rows);
  if (trc) {
    PS_ERROR("checkpoint: %s", rows.err);
    return trc;
  }
  ck->meta.index = sv->index;
  ck->meta.num_shards = sv->cluster.n_ps;
  ck->meta.P = sv->job.model.n_params;
  ck->meta.begin = ps_shard_begin(sv->shard);
  ck->meta.end = ps_shard_end(sv->shard);
  snprintf(ck->meta.optimizer, sizeof ck->meta.optimizer, "%s", ps_shard_optimizer(sv->shard));
  snprintf(ck->meta.job_id, sizeof ck->meta.job_id, "%s", sv->job.job_id);
  /* Shard 0 keeps the data-lease state with its parameters. */
  pthread_mutex_lock(&sv->lease_mu);
  int rc = sv->leases ? ps_leases_save(sv->leases, &ck->extra, &ck->extra_len) : PS_OK;
  pthread_mutex_unlock(&sv->lease_mu);
  return rc;
}

void ps_ckpt_state_free(ps_ckpt *ck) {
  ps_free(ck->params);
  for (int k = 0; k < PS_CKPT_MAX_SLOTS; k++) ps_free(ck->slots[k]);
  free(ck->extra);
  free(ck->cut);
  free(ck->tables);
  memset(ck, 0, sizeof *ck);
}

void ps_ckpt_note_written(ps_server *sv, int rc) {
  if (rc == 0) {
    atomic_fetch_add(&sv->ckpt_written, 1);
    atomic_store(&sv->ckpt_last_ok_ms, (int_fast64_t)(ps_wall_s() * 1e3));
  } else {
    atomic_fetch_add(&sv->ckpt_failed, 1);
  }
}

/* When and what ps-server checkpoints: a copy of the shard (and shard 0's
 * data leases), taken at a set's cut (cut.c, started here by shard 0's
 * timer) or written alone at shutdown; and the restore at start. The copy
 * is capture.c's, the file format checkpoint.c's. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ps/ckpt/server_ckpt.h"
#include "ps/ckpt/capture.h"
#include "ps/ckpt/cut.h"
#include "ps/ckpt/table_ckpt.h"
#include "ps/repl/replica.h"

/* Writes a checkpoint now, on the calling thread: a file written alone,
 * with the cut record of what the shard has applied. */
int ps_server_ckpt_write_now(ps_server *sv) {
  ps_ckpt ck;
  char path[PS_CKPT_PATHLEN], err[PS_ERRLEN];
  double t0 = ps_now_s();
  int rc = ps_ckpt_capture(sv, &ck);
  if (rc == 0) rc = ps_cut_record_now(sv, &ck.cut, &ck.cut_len);
  if (rc == 0) rc = ps_ckpt_write(sv->ckpt_dir, &ck, sv->ckpt_keep, path, err);
  else snprintf(err, sizeof err, "out of memory for the checkpoint's copy");
  ps_ckpt_note_written(sv, rc);
  if (rc == 0)
    PS_INFO("checkpoint: version %" PRIu64 " written to %s (%.0f ms)", ck.meta.version, path,
            (ps_now_s() - t0) * 1e3);
  else
    PS_ERROR("checkpoint failed: %s", err);
  ps_ckpt_state_free(&ck);
  return rc;
}

/* Every 200 ms, on shard 0: is a set due (by time or by updates)? Shard 0
 * then takes one across all shards (cut.c); the other shards write when it
 * asks them. */
void ps_server_ckpt_on_timer(uv_timer_t *t) {
  ps_server *sv = t->data;
  if (sv->index != 0 || !ps_replica_is_primary(sv)) return; /* shard 0's primary coordinates */
  ps_shard_stats st;
  ps_shard_stats_get(sv->shard, &st);
  double now = ps_now_s();
  int due = (sv->ckpt_secs > 0 && now - sv->ckpt_last_s >= sv->ckpt_secs) ||
            (sv->ckpt_updates > 0 && st.version - sv->ckpt_last_version >= sv->ckpt_updates);
  if (ps_cut_kicked(sv)) {
    /* A new primary: at once, so that a set the old one left held on the
     * shards is given up (the newer set's PREPARE does it). */
    if (ps_cut_coordinate(sv)) sv->ckpt_last_s = now;
    else ps_cut_kick(sv); /* a set of this process under way: the next tick */
    return;
  }
  if (!due || st.version == sv->ckpt_last_version) return;
  if (ps_cut_coordinate(sv)) sv->ckpt_last_s = now;
}

/* Removes what an earlier process of this shard left of a write cut short
 * (killed while writing): its temporary files would otherwise stay
 * forever. Each file removed is logged; a failure to list the directory
 * too (the restore that follows says what is wrong with it). */
static void ckpt_remove_stale(ps_server *sv) {
  char err[PS_ERRLEN];
  if (ps_ckpt_remove_stale_temps(sv->ckpt_dir, sv->index, sv->cluster.n_ps, sv->job.job_id, NULL,
                                 err) != 0)
    PS_WARN("checkpoint: %s", err);
}

/* The rows of every table placed on this shard, from the tables sections
 * of all the old shards' files (got->parts, then freed); checked whole
 * before any row is put. 0, or an error with a message. */
static int restore_tables(ps_server *sv, ps_ckpt_restored *got, char *err) {
  if (sv->n_tables == 0) return 0;
  ps_table_ckpt_counts tc;
  int rc = ps_table_ckpt_restore(&sv->job, sv->tables, sv->index, sv->cluster.n_ps, got->parts,
                                 got->n_parts, &tc, err);
  const int files = got->n_parts;
  for (int i = 0; i < files; i++) free(got->parts[i].tables);
  free(got->parts);
  got->parts = NULL;
  got->n_parts = 0;
  if (rc) return rc;
  if (tc.files_without == files)
    PS_WARN("checkpoint: the %d file(s) restored hold no embedding rows (written before "
            "checkpoints held tables): every table starts from its initial values",
            files);
  for (int t = 0; t < sv->n_tables; t++)
    PS_INFO("checkpoint: table '%s': %" PRIu64 " rows restored from the files of %d shard(s)",
            sv->job.tables[t].name, tc.rows[t], files);
  return 0;
}

/* Restores the shard from the newest valid checkpoints of the job in the
 * directory (whatever number of shards wrote them), after removing this
 * shard's temporary files left by a process killed while writing. 0 also
 * when there is none (a fresh start); an error when there are some but
 * none is usable. */
int ps_server_ckpt_restore(ps_server *sv, char *err) {
  /* A directory that does not exist yet is made (its parent must). */
  if (mkdir(sv->ckpt_dir, 0700) == 0)
    PS_INFO("checkpoint: made the directory %s", sv->ckpt_dir);
  else if (errno != EEXIST) {
    snprintf(err, PS_ERRLEN, "cannot make the checkpoint directory '%s': %s", sv->ckpt_dir,
             strerror(errno));
    return PS_EIO;
  }
  ckpt_remove_stale(sv);
  size_t n = ps_shard_end(sv->shard) - ps_shard_begin(sv->shard);
  int n_slots = ps_shard_n_slots(sv->shard);
  float *params = ps_alloc((n ? n : 1) * sizeof(float));
  float *slots[PS_CKPT_MAX_SLOTS] = {0};
  int ok = params != NULL;
  for (int k = 0; k < n_slots; k++) ok = ok && (slots[k] = ps_alloc((n ? n : 1) * sizeof(float)));
  int rc = PS_ENOMEM;
  if (!ok) {
    snprintf(err, PS_ERRLEN, "out of memory restoring the checkpoint");
  } else {
    ps_ckpt_source src = {.dir = sv->ckpt_dir,
                          .job_id = sv->job.job_id,
                          .P = sv->job.model.n_params,
                          .optimizer = ps_shard_optimizer(sv->shard),
                          .want_tables = sv->n_tables > 0};
    ps_ckpt_restored got;
    rc = ps_ckpt_load_range(&src, ps_shard_begin(sv->shard), ps_shard_end(sv->shard), params,
                            slots, n_slots, sv->index == 0, &got, err);
    if (rc == PS_ENOTFOUND) {
      PS_INFO("checkpoint: none of job '%s' in %s: starting from the initial parameters",
              sv->job.job_id, sv->ckpt_dir);
      rc = 0;
    } else if (rc == 0) {
      /* The rows first: refused, nothing is restored (dense values neither). */
      if ((rc = restore_tables(sv, &got, err)) != 0) {
        ps_ckpt_restored_free(&got);
        goto out;
      }
      ps_shard_restore_state(sv->shard, params, slots, got.version);
      sv->start_version = got.version;
      sv->ckpt_last_version = got.version;
      sv->ckpt_restored_set = got.set_id;
      /* The job had begun: under sync the steps resume once min_workers
       * have registered again, or after a heartbeat timeout (by when every
       * live worker has called) with whoever came back. Not at the first
       * registration: the first worker back would make a step alone, and
       * the others' gradients of it would be dropped as late. */
      if (got.version > 0) sv->sync_resume_ms = ps_now_ms() + sv->job.heartbeat_timeout_ms;
      char from[64];
      if (got.set_id)
        snprintf(from, sizeof from, "set %" PRIu64, got.set_id);
      else
        snprintf(from, sizeof from, "%s", got.consistent ? "files of one moment" : "files of different moments");
      PS_INFO("checkpoint: restored [%zu, %zu) at version %" PRIu64 " from %d file(s) written by "
              "%d shard(s): %s",
              ps_shard_begin(sv->shard), ps_shard_end(sv->shard), got.version, got.files_used,
              got.num_shards, from);
      if (got.cut && ps_cut_seed_rounds(sv, got.cut, got.cut_len) != PS_OK)
        PS_WARN("checkpoint: its cut record cannot be read: pushes resent after the restart may "
                "be applied again");
      free(got.cut);
      if (got.extra && sv->job.lease_chunk > 0) {
        sv->leases = ps_leases_load(got.extra, got.extra_len, err);
        if (!sv->leases) {
          free(got.extra);
          rc = PS_EINVAL;
          goto out;
        }
        ps_lease_stats ls;
        ps_leases_stats(sv->leases, &ls);
        PS_INFO("checkpoint: data leases restored: epoch %u, %u of %u chunks done (leases "
                "outstanding at the checkpoint go back to the pool)",
                ls.epoch, ls.chunks_done, ls.chunks);
      }
      free(got.extra);
    }
  }
out:
  ps_free(params);
  for (int k = 0; k < PS_CKPT_MAX_SLOTS; k++) ps_free(slots[k]);
  return rc;
}

/* The embedding rows of a worker's steps and evaluations (see worker.h,
 * ps_worker_rows_*): per embedding layer, the batch's ids de-duplicated
 * into a plan, the rows pulled for it and the gradients pushed for it, in
 * host buffers sized once for a full batch. */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/train/worker.h"

struct ps_worker_rows {
  ps_model *m;
  int n;                         /* embedding layers */
  int table[PS_MAX_TABLES];      /* each layer's table */
  uint64_t modulo[PS_MAX_TABLES]; /* a bounded table's rows; 0: unbounded */
  ps_emb_plan plan[PS_MAX_TABLES];
  float *rows[PS_MAX_TABLES], *drows[PS_MAX_TABLES];
  ps_client_rows secs[PS_MAX_TABLES];
};

ps_worker_rows *ps_worker_rows_create(ps_worker *w, ps_model *m, int max_batch, int grads,
                                      char *err) {
  const int n = ps_model_n_embeddings(m);
  if (n == 0) return NULL;
  ps_worker_rows *r = calloc(1, sizeof *r);
  if (!r) {
    ps_seterr(err, PS_ENOMEM, "out of memory");
    return NULL;
  }
  r->m = m;
  r->n = n;
  for (int k = 0; k < n; k++) {
    const ps_layer *L = ps_model_embedding(m, k);
    const ps_table_spec *t = &w->job.tables[L->table_index];
    r->table[k] = L->table_index;
    r->modulo[k] = t->rows;
    /* At most every position a distinct row. */
    size_t cap = (size_t)max_batch * (size_t)(L->field_hi - L->field_lo) * (size_t)t->dim;
    r->rows[k] = ps_worker_host_buffer(w, cap * sizeof(float));
    if (grads) r->drows[k] = ps_worker_host_buffer(w, cap * sizeof(float));
    if (!r->rows[k] || (grads && !r->drows[k])) {
      ps_worker_rows_destroy(w, r);
      ps_seterr(err, PS_ENOMEM, "out of memory for the rows of table '%s' (%zu values)", t->name,
                cap);
      return NULL;
    }
  }
  return r;
}

void ps_worker_rows_destroy(ps_worker *w, ps_worker_rows *r) {
  if (!r) return;
  for (int k = 0; k < r->n; k++) {
    ps_emb_plan_free(&r->plan[k]);
    ps_worker_host_buffer_free(w, r->rows[k]);
    ps_worker_host_buffer_free(w, r->drows[k]);
  }
  free(r);
}

int ps_worker_rows_prepare(ps_worker *w, ps_worker_rows *r, const uint64_t *ids, int n,
                           char *err) {
  for (int k = 0; k < r->n; k++) {
    int rc = ps_model_emb_plan(r->m, k, ids, n, r->modulo[k], &r->plan[k], err);
    if (rc) return rc;
    r->secs[k] = (ps_client_rows){.table = r->table[k],
                                  .ids = r->plan[k].uniq,
                                  .n = (size_t)r->plan[k].u,
                                  .values = r->rows[k],
                                  .grads = r->drows[k]};
    ps_model_set_rows(r->m, k, &r->plan[k], r->rows[k], r->drows[k]);
  }
  return ps_client_set_rows(w->client, r->secs, r->n, err);
}

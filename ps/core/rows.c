/* Embedding rows in Pull and Push (rows.h): the ids a request names, read
 * out of it and checked; a push's rows staged, then applied with the dense
 * range as one update. (A pull's rows are read beside the dense snapshot
 * in ps/rpc/pull.c.) */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "common/wire.h"
#include "ps/core/rows.h"
#include "ps/state/table.h"
#include "ps/state/table_sync.h"

/* The request's buffer in 64-bit words: ids, placements, orders (32-bit). */
static size_t buf_words(size_t total) { return total ? 2 * total + (total + 1) / 2 : 1; }

int ps_rows_from_msg(ps_server *sv, Ps__TableRows *const *secs, size_t n, ps_rows_req **out,
                     char *err) {
  *out = NULL;
  if (n == 0) return PS_OK;
  if (n > (size_t)sv->n_tables)
    return ps_seterr(err, PS_EINVAL, "%zu row sections, but the job has %d embedding table(s)",
                     n, sv->n_tables);
  size_t total = 0;
  uint32_t seen = 0;
  for (size_t i = 0; i < n; i++) {
    const Ps__TableRows *s = secs[i];
    if (s->table >= (uint32_t)sv->n_tables)
      return ps_seterr(err, PS_EINVAL, "row section %zu names table %" PRIu32
                       ", but the job has %d embedding table(s)",
                       i, s->table, sv->n_tables);
    if (seen & (1u << s->table))
      return ps_seterr(err, PS_EINVAL, "table '%s' has two row sections",
                       sv->job.tables[s->table].name);
    seen |= 1u << s->table;
    if (s->ids.len % 8)
      return ps_seterr(err, PS_EINVAL,
                       "table '%s': ids take %zu bytes, not a multiple of 8 (uint64 each)",
                       sv->job.tables[s->table].name, s->ids.len);
    total += s->ids.len / 8;
  }
  if (total > (size_t)sv->job.max_rows_per_request)
    return ps_seterr(err, PS_ERANGE,
                     "%zu rows in one request (the job's max_rows_per_request is %d)", total,
                     sv->job.max_rows_per_request);
  ps_rows_req *r = malloc(sizeof *r + buf_words(total) * sizeof(uint64_t));
  if (!r) return ps_seterr(err, PS_ENOMEM, "out of memory for %zu row ids", total);
  memset(r, 0, sizeof *r);
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    const Ps__TableRows *s = secs[i];
    size_t k = s->ids.len / 8;
    r->sec[i].table = (int)s->table;
    r->sec[i].n = k;
    r->sec[i].ids = r->buf + at;
    r->sec[i].locals = r->buf + total + at;
    r->sec[i].order = (uint32_t *)(void *)(r->buf + 2 * total) + at;
    for (size_t j = 0; j < k; j++) r->buf[at + j] = ps_get_le64(s->ids.data + 8 * j);
    at += k;
    r->values += k * (size_t)sv->job.tables[s->table].dim;
    int rc = ps_table_check_ids_order(sv->tables[s->table], r->sec[i].ids, k, r->sec[i].locals,
                                      r->sec[i].order, err);
    if (rc) {
      free(r);
      return rc;
    }
  }
  r->n_sec = (int)n;
  r->total = total;
  *out = r;
  return PS_OK;
}

ps_rows_req *ps_rows_dup(const ps_rows_req *r) {
  if (!r) return NULL;
  size_t bytes = sizeof *r + buf_words(r->total) * sizeof(uint64_t);
  ps_rows_req *d = malloc(bytes);
  if (!d) return NULL;
  memcpy(d, r, bytes);
  for (int i = 0; i < r->n_sec; i++) {
    d->sec[i].ids = d->buf + (r->sec[i].ids - r->buf);
    d->sec[i].locals = d->buf + (r->sec[i].locals - r->buf);
    d->sec[i].order = (uint32_t *)(void *)d->buf +
                      (r->sec[i].order - (const uint32_t *)(const void *)r->buf);
  }
  return d;
}

void ps_rows_free(ps_rows_req *r) { free(r); }

/* ---- pushes ---- */

typedef struct {
  ps_server *sv;
  const ps_rows_req *rows;
  const float *grad; /* rows->values floats */
  const ps_ufloat *const *grad_rows; /* or each position's row of them */
  uint32_t bits[PS_MAX_TABLES]; /* each section's largest magnitude */
  int staged;        /* sections staged (their tables write-locked) */
} push_ctx;

static int rows_prepare(void *user, float lr_scale, char *err) {
  push_ctx *c = user;
  ps_server *sv = c->sv;
  /* Tables in table order (the lock order); sections may come in any. */
  uint32_t want = 0;
  for (int i = 0; i < c->rows->n_sec; i++) want |= 1u << c->rows->sec[i].table;
  for (int t = 0; t < sv->n_tables; t++)
    if (want & (1u << t)) ps_table_write_lock(sv->tables[t]);
  size_t at = 0, rows_before = 0;
  for (int i = 0; i < c->rows->n_sec; i++) {
    ps_table *tb = sv->tables[c->rows->sec[i].table];
    int rc = ps_table_stage_rows(tb, c->rows->sec[i].ids, c->rows->sec[i].locals,
                                 c->rows->sec[i].order, c->rows->sec[i].n,
                                 c->grad_rows ? NULL : c->grad + at,
                                 c->grad_rows ? c->grad_rows + rows_before : NULL, lr_scale,
                                 c->bits[i], err);
    if (rc) {
      for (int k = 0; k < i; k++) ps_table_unstage(sv->tables[c->rows->sec[k].table]);
      for (int t = sv->n_tables - 1; t >= 0; t--)
        if (want & (1u << t)) ps_table_unlock(sv->tables[t]);
      return rc;
    }
    at += c->rows->sec[i].n * (size_t)ps_table_spec_of(tb)->dim;
    rows_before += c->rows->sec[i].n;
  }
  c->staged = 1;
  return PS_OK;
}

static void rows_finish(push_ctx *c, int commit) {
  ps_server *sv = c->sv;
  uint32_t want = 0;
  for (int i = 0; i < c->rows->n_sec; i++) {
    ps_table *tb = sv->tables[c->rows->sec[i].table];
    if (commit)
      ps_table_commit(tb);
    else
      ps_table_unstage(tb);
    want |= 1u << c->rows->sec[i].table;
  }
  for (int t = sv->n_tables - 1; t >= 0; t--)
    if (want & (1u << t)) ps_table_unlock(sv->tables[t]);
  c->staged = 0;
}
static void rows_commit(void *user) { rows_finish(user, 1); }
static void rows_abort(void *user) { rows_finish(user, 0); }

/* The rows' gradient (rows->values floats, malloc'd into *out), decoded
 * out of the request after its dense_bytes (rows are scattered anyway;
 * the dense part is read in place), and, when bits is not NULL, each
 * section's largest magnitude (ps_f32_max_bits) into bits[i]. */
static int rows_grad(ps_server *sv, const ps_rows_req *rows, const ps_segview *tensor,
                     size_t dense_bytes, float **out, uint32_t *bits, char *err) {
  const size_t vb = ps_wire_value_bytes(sv->job.wire), row_bytes = rows->values * vb;
  float *g = malloc((rows->values ? rows->values : 1) * sizeof(float));
  if (!g) return ps_seterr(err, PS_ENOMEM, "out of memory for %zu row values", rows->values);
  int rc = PS_OK;
  if (sv->job.wire == PS_WIRE_FP32) {
    rc = ps_segview_copy(tensor, dense_bytes, g, row_bytes);
  } else {
    uint16_t *h = malloc((rows->values ? rows->values : 1) * sizeof(uint16_t));
    rc = h ? ps_segview_copy(tensor, dense_bytes, h, row_bytes) : PS_ENOMEM;
    if (rc == PS_OK) ps_half_decode(sv->job.wire, h, g, rows->values);
    free(h);
  }
  if (rc) {
    free(g);
    return ps_seterr(err, rc, "could not read the rows' gradient");
  }
  size_t at = 0;
  for (int i = 0; i < rows->n_sec && bits; i++) {
    const size_t k = rows->sec[i].n * (size_t)sv->job.tables[rows->sec[i].table].dim;
    bits[i] = ps_f32_max_bits(g + at, k);
    at += k;
  }
  *out = g;
  return PS_OK;
}

/* FP32 wire: the rows' gradient read where it lies, not copied. rows[k]
 * points at position k's values (sections one after the other) in the
 * request's segments; a row split between two segments is put together in
 * *side (malloc'd; at most one per segment boundary). Each section's
 * largest magnitude into bits[i], over the runs of rows that lie whole in
 * one segment, each run one pass. (Copying a dim-64 push's 2.6 MB out of
 * the request took 0.7 ms.) */
static int rows_grad_in_place(ps_server *sv, const ps_rows_req *rows, const ps_segview *tensor,
                              size_t dense_bytes, const ps_ufloat ***out, float **side,
                              uint32_t *bits, char *err) {
  const ps_ufloat **ptr = malloc((rows->total ? rows->total : 1) * sizeof *ptr);
  size_t max_rb = 0;
  for (int i = 0; i < rows->n_sec; i++) {
    const size_t rb = (size_t)sv->job.tables[rows->sec[i].table].dim * sizeof(float);
    if (rb > max_rb) max_rb = rb;
  }
  float *sd = malloc(((size_t)tensor->nsegs + 1) * (max_rb ? max_rb : 1));
  if (!ptr || !sd) {
    free(ptr);
    free(sd);
    return ps_seterr(err, PS_ENOMEM, "out of memory for %zu row gradients", rows->total);
  }
  int seg = 0;
  size_t seg_at = 0; /* the tensor's byte offset of segs[seg] */
  size_t at = dense_bytes, k = 0, used = 0;
  for (int i = 0; i < rows->n_sec; i++) {
    const size_t d = (size_t)sv->job.tables[rows->sec[i].table].dim, rb = d * sizeof(float);
    uint32_t b = 0;
    const ps_ufloat *run = NULL; /* the rows lying whole in the current segment */
    size_t run_n = 0;
    for (size_t r = 0; r < rows->sec[i].n; r++, k++, at += rb) {
      while (seg < tensor->nsegs && at >= seg_at + tensor->segs[seg].len) {
        seg_at += tensor->segs[seg].len;
        seg++;
      }
      if (seg < tensor->nsegs && at + rb <= seg_at + tensor->segs[seg].len) {
        const ps_ufloat *p = (const ps_ufloat *)(const void *)((const uint8_t *)tensor->segs[seg].ptr + (at - seg_at));
        if (run && p != run + run_n * d) {
          const uint32_t m = ps_f32_max_bits(run, run_n * d);
          b = m > b ? m : b;
          run = NULL;
        }
        if (!run) {
          run = p;
          run_n = 0;
        }
        run_n++;
        ptr[k] = p;
        continue;
      }
      float *dst = (float *)(void *)((uint8_t *)sd + used * max_rb);
      if (ps_segview_copy(tensor, at, dst, rb) != PS_OK) {
        free(ptr);
        free(sd);
        return ps_seterr(err, PS_EINVAL, "could not read the rows' gradient");
      }
      used++;
      const uint32_t m = ps_f32_max_bits(dst, d);
      b = m > b ? m : b;
      ptr[k] = dst;
    }
    if (run) {
      const uint32_t m = ps_f32_max_bits(run, run_n * d);
      b = m > b ? m : b;
    }
    bits[i] = b;
  }
  *out = ptr;
  *side = sd;
  return PS_OK;
}

/* Checks that tensor holds count dense values and the rows' values. */
static int check_sizes(ps_server *sv, const ps_rows_req *rows, size_t count,
                       const ps_segview *tensor, char *err) {
  const size_t vb = ps_wire_value_bytes(sv->job.wire);
  size_t dense_bytes = count * vb, row_bytes = rows->values * vb;
  if (count > SIZE_MAX / vb || tensor->total != dense_bytes + row_bytes)
    return ps_seterr(err, PS_EINVAL,
                     "gradient has %zu bytes, expected %zu: %zu dense values and %zu row "
                     "values of %zu bytes",
                     tensor->total, dense_bytes + row_bytes, count, rows->values, vb);
  return PS_OK;
}

/* The view's first dense_bytes into dense (segs: room for RPC_MAX_SEGS * 4). */
static int dense_part(const ps_segview *tensor, size_t dense_bytes, ps_seg *segs, size_t nseg,
                      ps_segview *dense, char *err) {
  *dense = (ps_segview){.segs = segs, .nsegs = 0, .total = dense_bytes};
  size_t left = dense_bytes;
  for (int i = 0; i < tensor->nsegs && left > 0; i++) {
    size_t take = tensor->segs[i].len < left ? tensor->segs[i].len : left;
    if (dense->nsegs == (int)nseg) return ps_seterr(err, PS_EINVAL, "gradient in too many pieces");
    segs[dense->nsegs++] = (ps_seg){.ptr = tensor->segs[i].ptr, .len = take};
    left -= take;
  }
  return PS_OK;
}

int ps_rows_sync_init(ps_server *sv) {
  if (sv->n_tables == 0) return PS_OK;
  sv->rows_sum = ps_rows_sum_create(sv->tables, sv->n_tables);
  if (!sv->rows_sum) return PS_ENOMEM;
  ps_shard_sync_rows h;
  ps_rows_sum_hooks(sv->rows_sum, &h);
  ps_shard_set_sync_rows(sv->shard, &h);
  return PS_OK;
}

int ps_rows_sync_add(ps_server *sv, const ps_rows_req *rows, uint64_t worker,
                     uint64_t base_version, size_t offset, size_t count,
                     const ps_segview *tensor, int *dropped, int *have, char *err) {
  if (!rows)
    return ps_shard_sync_add(sv->shard, worker, base_version, offset, count, tensor, dropped,
                             have, err);
  *dropped = 0;
  int rc = check_sizes(sv, rows, count, tensor, err);
  if (rc) return rc;
  const size_t dense_bytes = count * ps_wire_value_bytes(sv->job.wire);
  ps_seg segs[RPC_MAX_SEGS * 4];
  ps_segview dense;
  if ((rc = dense_part(tensor, dense_bytes, segs, sizeof segs / sizeof segs[0], &dense, err)))
    return rc;
  float *g = NULL;
  if ((rc = rows_grad(sv, rows, tensor, dense_bytes, &g, NULL, err))) return rc;
  ps_rows_grad rg = {.n_sec = rows->n_sec, .grad = g};
  for (int i = 0; i < rows->n_sec; i++) {
    rg.sec[i].table = rows->sec[i].table;
    rg.sec[i].n = rows->sec[i].n;
    rg.sec[i].ids = rows->sec[i].ids;
  }
  rc = ps_shard_sync_add_rows(sv->shard, worker, base_version, offset, count, &dense, &rg,
                              dropped, have, err);
  free(g);
  return rc;
}

int ps_rows_push(ps_server *sv, const ps_rows_req *rows, uint64_t base_version, size_t offset,
                 size_t count, const ps_segview *tensor, uint64_t *version, uint64_t *staleness,
                 char *err) {
  int rc = check_sizes(sv, rows, count, tensor, err);
  if (rc) return rc;
  const size_t dense_bytes = count * ps_wire_value_bytes(sv->job.wire);
  push_ctx c = {.sv = sv, .rows = rows};
  float *g = NULL;
  const ps_ufloat **grows = NULL;
  if (sv->job.wire == PS_WIRE_FP32)
    rc = rows_grad_in_place(sv, rows, tensor, dense_bytes, &grows, &g, c.bits, err);
  else
    rc = rows_grad(sv, rows, tensor, dense_bytes, &g, c.bits, err);
  if (rc) return rc;
  c.grad = g;
  c.grad_rows = grows;
  ps_seg segs[RPC_MAX_SEGS * 4];
  ps_segview dense;
  if ((rc = dense_part(tensor, dense_bytes, segs, sizeof segs / sizeof segs[0], &dense, err))) {
    free(g);
    free(grows);
    return rc;
  }
  ps_shard_extra extra = {rows_prepare, rows_commit, rows_abort, &c};
  rc = ps_shard_push_ex(sv->shard, base_version, offset, count, &dense, &extra, version, staleness,
                        err);
  free(g);
  free(grows);
  return rc;
}

void ps_rows_status(ps_server *sv, Ps__StatusResponse *resp, Ps__TableStatus *store,
                    Ps__TableStatus **ptrs) {
  for (int i = 0; i < sv->n_tables; i++) {
    ps_table_stats st;
    ps_table_stats_get(sv->tables[i], &st);
    Ps__TableStatus *t = &store[i];
    ps__table_status__init(t);
    t->name = sv->job.tables[i].name;
    t->rows = sv->job.tables[i].rows;
    t->dim = (uint32_t)sv->job.tables[i].dim;
    t->rows_held = st.rows_held;
    t->rows_pulled = st.rows_pulled;
    t->rows_pushed = st.rows_pushed;
    t->rejected = st.rejected;
    t->bytes = st.bytes;
    t->optimizer = sv->job.table_optim[i].name;
    ps_table_read_lock(sv->tables[i]);
    t->crc = ps_table_crc(sv->tables[i]);
    ps_table_unlock(sv->tables[i]);
    ptrs[i] = t;
  }
  resp->n_tables = (size_t)sv->n_tables;
  resp->tables = ptrs;
}

/* A shard's part of one embedding table (common/emb.h): the rows placed on
 * this shard, each with its optimizer slots and its own update count.
 *
 * Bounded tables (rows > 0) keep their part in one array indexed by the
 * local row (allocated zeroed at start: pages a row never touched cost no
 * memory); unbounded ones keep rows in chunks found through an
 * open-addressing map from the id, made on the first push that names the
 * id. A row never pushed reads as its initial values (ps_table_init_row),
 * computed when pulled, so pulls change nothing.
 *
 * Locking: a pull holds the table's read lock while it reads its rows (and
 * while the shard takes the dense snapshot, so that one Pull's rows and
 * dense values are of one version); a push holds the write lock from
 * ps_table_stage to ps_table_commit (or ps_table_unstage), which is taken
 * under the shard's update lock. Order: the shard's update lock, then the
 * tables in table order, then the shard's own state lock. */
#ifndef PS_PS_TABLE_H
#define PS_PS_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "common/job.h"

typedef struct ps_table ps_table;

/* Shard `shard` of S's part of table spec (copied) with optimizer optim.
 * NULL with a message (unknown optimizer, out of memory for a bounded
 * table's array). */
ps_table *ps_table_create(const ps_table_spec *spec, const ps_optim_config *optim, uint64_t seed,
                          int shard, int S, char *err);
void ps_table_destroy(ps_table *t);
const ps_table_spec *ps_table_spec_of(const ps_table *t);
int ps_table_n_slots(const ps_table *t);

void ps_table_read_lock(ps_table *t);
void ps_table_write_lock(ps_table *t);
void ps_table_unlock(ps_table *t);

/* Checks ids[0..n) for a pull or push: each a row of the table (below
 * rows), placed on this shard, none twice. PS_ERANGE / PS_EINVAL with a
 * message naming the table and the position. Any lock or none. */
int ps_table_check_ids(ps_table *t, const uint64_t *ids, size_t n, uint64_t *locals,
                       char *err);
/* (locals, when not NULL, receives each id's placement on this shard, n
 * values, which the functions below take to skip computing it again.) */
/* ps_table_check_ids, and order (when not NULL) receives the positions
 * 0..n-1 sorted by their rows' addresses (a bounded table's local rows;
 * an unbounded table's: the positions as they are). Visiting a request's
 * rows in that order reads the table's memory in one sweep: neighbouring
 * rows share the caches of the page translations, which random order
 * misses on each row (pulls and pushes took a third longer so, on a
 * virtual machine). */
int ps_table_check_ids_order(ps_table *t, const uint64_t *ids, size_t n, uint64_t *locals,
                             uint32_t *order, char *err);

/* The rows of ids (checked; locals from the check, or NULL) into out (n *
 * dim floats). Read lock held. */
void ps_table_read_rows(ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t n,
                        float *out);
/* The same, visiting the rows in order (from ps_table_check_ids_order;
 * NULL: as they come); out is in the positions' order all the same. */
void ps_table_read_rows_order(ps_table *t, const uint64_t *ids, const uint64_t *locals,
                              const uint32_t *order, size_t n, float *out);

/* Checks a push of the rows ids (checked; locals from the check, or NULL)
 * by one step of the optimizer with grad (n * dim float32 values, any
 * alignment) and lr * lr_scale: refuses (nothing changes) a NaN or Inf
 * gradient value, a new value or slot that would be NaN or Inf, and, for
 * an unbounded table, more rows than max_rows_per_shard or no memory for
 * the new ones (PS_EINVAL, PS_ERANGE, PS_ENOMEM with a message naming the
 * table, the id and the value). On success ps_table_commit applies it and
 * cannot fail; ps_table_unstage drops it instead. ids, locals and grad
 * must stay as they are until then. Write lock held from here to
 * the commit or ps_table_unstage, so that no pull sees a push half
 * applied. */
int ps_table_stage(ps_table *t, const uint64_t *ids, const uint64_t *locals, size_t n,
                   const ps_ufloat *grad, float lr_scale, char *err);
/* ps_table_stage with more of the push known:
 * - order (from ps_table_check_ids_order, kept until the commit; NULL: as
 *   the rows come): the commit visits the rows in it;
 * - grad_rows, in place of grad (NULL then): grad_rows[i] holds position
 *   i's dim values (any alignment; kept until the commit). A server's push
 *   points them into the request's own bytes, which are not copied;
 * - grad_bits: the gradient's largest magnitude, ps_f32_max_bits of its
 *   n * dim values (the caller read them anyway, as it copied or pointed
 *   at them), which spares a bounded table a pass over them;
 *   PS_TABLE_GRAD_UNKNOWN: not measured. */
#define PS_TABLE_GRAD_UNKNOWN UINT32_MAX
int ps_table_stage_rows(ps_table *t, const uint64_t *ids, const uint64_t *locals,
                        const uint32_t *order, size_t n, const ps_ufloat *grad,
                        const ps_ufloat *const *grad_rows, float lr_scale, uint32_t grad_bits,
                        char *err);
void ps_table_commit(ps_table *t);
void ps_table_unstage(ps_table *t);

typedef struct {
  uint64_t rows_held;   /* rows pushed at least once (bounded and unbounded) */
  uint64_t rows_pulled; /* over all pulls */
  uint64_t rows_pushed; /* applied */
  uint64_t rejected;    /* pushes refused */
  uint64_t bytes;       /* memory held for rows and slots */
} ps_table_stats;
void ps_table_stats_get(ps_table *t, ps_table_stats *out);

/* Checkpoints: every row pushed at least once, as (id, t, values, slots).
 * each calls fn(user, id, t, rec) with rec the row's dim * (1 + n_slots)
 * floats (values, then each slot), in an unspecified order; fn returning
 * non-zero stops the walk (returned). Read lock held by the caller. */
typedef int (*ps_table_row_fn)(void *user, uint64_t id, uint32_t t, const float *rec);
int ps_table_each_row(ps_table *t, ps_table_row_fn fn, void *user);
/* Puts one row back (a restore; the id must be a valid id of the table,
 * placed on this shard, and rec finite: PS_EINVAL otherwise; PS_ERANGE
 * past max_rows_per_shard, PS_ENOMEM). Write lock held. */
int ps_table_put_row(ps_table *t, uint64_t id, uint32_t tcount, const float *rec, char *err);
/* Forgets every row (back to the initial values). Write lock held. */
void ps_table_clear(ps_table *t);
/* A checksum of every pushed row (the sum of each row's
 * ps_table_row_sum, so independent of the order rows were made in; kept up
 * to date as rows change, so O(1)): equal on shards holding the same rows
 * bit for bit. Read lock held. */
uint32_t ps_table_crc(ps_table *t);
/* A row's checksum: of its id, update count t and record (rec_floats
 * floats: values, then slots). */
uint32_t ps_table_row_sum(uint64_t id, uint32_t t, const float *rec, size_t rec_floats);

#endif

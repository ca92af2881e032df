/* Embedding rows in sync mode: a step's sparse sum. Each worker's pushed
 * rows are added per (table, id) as its dense gradient is added to the
 * step's dense sum (ps_shard_sync_add_rows); when the step is applied,
 * every row in the sum moves by one optimizer step with sum * inv, inv
 * being the dense mean's factor (1 / gradients in the step, whether or not
 * each named the row), under the step's version. The functions are the
 * shard's ps_shard_sync_rows hooks (ps_rows_sum_hooks), so they run under
 * the shard's update lock; the sum itself takes no lock.
 *
 * A row's sum is the contributions added in the order they came, the
 * first copied (as the dense sum does), so a step is the same bit for bit
 * wherever the same gradients are added in the same order (a replicated
 * shard's backups). */
#ifndef PS_PS_TABLE_SYNC_H
#define PS_PS_TABLE_SYNC_H

#include <stddef.h>
#include <stdint.h>

#include "ps/state/shard.h"
#include "ps/state/table.h"

typedef struct ps_rows_sum ps_rows_sum;

/* The sum over tables[0..n_tables) (borrowed: they must outlive it).
 * NULL when out of memory. */
ps_rows_sum *ps_rows_sum_create(ps_table *const *tables, int n_tables);
void ps_rows_sum_destroy(ps_rows_sum *s);

/* One gradient's rows: sections of distinct tables, each naming ids of its
 * table on this shard, each once (as ps_table_check_ids checks); grad
 * holds the sections' values one after the other, n * dim each. */
typedef struct {
  int n_sec;
  struct {
    int table;
    size_t n;
    const uint64_t *ids;
  } sec[PS_MAX_TABLES];
  const float *grad;
} ps_rows_grad;

/* Adds g to the sum, all or nothing: PS_EINVAL (a NaN or Inf gradient
 * value, or a sum that would become one, named by table, id and
 * position), PS_ENOMEM; the sum is unchanged then. */
int ps_rows_sum_add(ps_rows_sum *s, const ps_rows_grad *g, char *err);

/* Stages every row in the sum by one step of its table's optimizer with
 * sum * inv (write-locking the tables, in table order, until commit or
 * abort). The refusals of ps_table_stage, nothing staged then and no lock
 * held. */
int ps_rows_sum_stage(ps_rows_sum *s, float inv, char *err);
void ps_rows_sum_commit(ps_rows_sum *s);
void ps_rows_sum_abort(ps_rows_sum *s);
/* Forgets every row's sum (the memory is kept for the next step). */
void ps_rows_sum_clear(ps_rows_sum *s);

/* Rows in the sum over all tables. */
size_t ps_rows_sum_count(const ps_rows_sum *s);

/* Every row's sum as (table, id, contributions, sum: dim floats), in the
 * order rows came in per table, tables in order; fn returning non-zero
 * stops the walk (returned). For a replica's snapshot. */
typedef int (*ps_rows_sum_fn)(void *user, int table, uint64_t id, uint32_t count, const float *sum);
int ps_rows_sum_each(const ps_rows_sum *s, ps_rows_sum_fn fn, void *user);
/* Puts a row's sum back (a snapshot's, after ps_rows_sum_clear): PS_EINVAL
 * for a table out of range, an id already in, a sum not finite; PS_ENOMEM. */
int ps_rows_sum_put(ps_rows_sum *s, int table, uint64_t id, uint32_t count, const float *sum,
                    char *err);

/* The shard's hooks with this sum (ps_shard_set_sync_rows): add takes a
 * const ps_rows_grad *. */
void ps_rows_sum_hooks(ps_rows_sum *s, ps_shard_sync_rows *out);

#endif

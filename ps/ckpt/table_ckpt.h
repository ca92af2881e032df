/* Embedding rows in checkpoints: a shard's tables (ps/state/table.h) into the
 * tables section of its checkpoint file (ps/ckpt/checkpoint.h), and back from
 * the sections of the files of any number of old shards (resharding: a
 * shard keeps the rows that placement, common/emb.h, gives it under the
 * new number of shards); and the tables as NumPy files (ps-export).
 *
 * Functions return 0 or a negative PS_E* code with a message in err
 * (NULL or PS_ERRLEN bytes). */
#ifndef PS_PS_TABLE_CKPT_H
#define PS_PS_TABLE_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "common/job.h"
#include "ps/ckpt/checkpoint.h"
#include "ps/state/table.h"

/* The tables section of tables[0 .. job->n_tables) (table i is
 * job->tables[i] with optimizer job->table_optim[i]): every row pushed at
 * least once, with its count and slots. Each table is read-locked in turn,
 * in table order: call it under the shard's update lock
 * (ps_shard_export_state_with) so that the rows are of the dense values'
 * version. *out (malloc'd) NULL and *len 0 when the job has no tables.
 * PS_ENOMEM; nothing is handed back on error. */
int ps_table_ckpt_save(const ps_job *job, ps_table *const *tables, void **out, size_t *len,
                       char *err);

/* What ps_table_ckpt_restore put back. */
typedef struct {
  uint64_t rows[PS_MAX_TABLES]; /* rows put into each table of the job */
  int files_without;            /* files of the group that hold no tables section */
} ps_table_ckpt_counts;

/* Replaces the rows of tables[0 .. job->n_tables) (shard `shard` of S) by
 * those of parts[0 .. n_parts) (every old shard's tables section, as
 * ps_ckpt_load_range hands them back with want_tables) that are placed on
 * this shard under S.
 *
 * Everything is checked before any row changes: each section parses; each
 * of its tables is the job's table of that name with the same rows, dim,
 * optimizer and number of slots (a table the job no longer has is skipped
 * with a warning; a table of the job that a file lacks starts from its
 * initial values, with a warning); each row lies on the shard whose file
 * holds it (under that file's number of shards); an unbounded table gets
 * at most max_rows_per_shard rows here. Errors then: PS_EINVAL or PS_ERANGE
 * with a message naming the file, the table and the row, and no table
 * changed. Then each table is cleared and its rows put (write lock held
 * per table); out of memory then (PS_ENOMEM) leaves every table cleared.
 * counts may be NULL. */
int ps_table_ckpt_restore(const ps_job *job, ps_table *const *tables, int shard, int S,
                          const ps_ckpt_part *parts, int n_parts, ps_table_ckpt_counts *counts,
                          char *err);

/* Writes every table of the job into out_dir (which must exist) from
 * parts (every old shard's tables section, as for restore, checked the
 * same way): a bounded table as "<name>.emb.npy", (rows, dim) float32,
 * row id at index id, rows never pushed holding their initial values
 * (ps_table_init_row); an unbounded one as "<name>.ids.npy", (n,) uint64,
 * the ids of the n rows held in increasing order, and "<name>.emb.npy",
 * (n, dim) float32, row i the values of ids[i]. *files (may be NULL)
 * counts the files written. PS_EINVAL, PS_EIO, PS_ENOMEM. */
int ps_table_ckpt_export_npy(const ps_job *job, const ps_ckpt_part *parts, int n_parts,
                             const char *out_dir, int *files, char *err);

#endif

/* The embedding rows of a Pull or Push on this shard: read out of the
 * request and checked, and a push's rows applied with its dense range as
 * one update (or, under sync, added to the step's sum). Calls ps/state. */
#ifndef PS_PS_CORE_ROWS_H
#define PS_PS_CORE_ROWS_H

#include <stddef.h>
#include <stdint.h>

#include "ps/core/server.h"

/* The embedding rows a Pull or Push names, copied out of the request
 * (aligned) and checked: tables of the job, each once; ids of the table,
 * living on this shard, each once; at most PS_MAX_ROWS_PER_REQUEST. */
struct ps_rows_req {
  int n_sec;
  struct {
    int table;
    size_t n;
    uint64_t *ids;
    uint64_t *locals; /* each id's placement on this shard (ps_table_check_ids_order) */
    uint32_t *order;  /* the positions in the order the table visits their rows */
  } sec[PS_MAX_TABLES];
  size_t total;  /* ids over the sections */
  size_t values; /* floats over the sections (n * dim each) */
  uint64_t buf[]; /* the ids, then their placements, then the orders */
};

/* *out NULL when n is 0; PS_EINVAL / PS_ERANGE / PS_ENOMEM with a message. */
int ps_rows_from_msg(ps_server *sv, Ps__TableRows *const *secs, size_t n, ps_rows_req **out,
                     char *err);
ps_rows_req *ps_rows_dup(const ps_rows_req *r);
void ps_rows_free(ps_rows_req *r);
/* sync mode: sets up the step's sum of rows (sv->rows_sum) and the
 * shard's hooks; nothing without tables. PS_ENOMEM. */
int ps_rows_sync_init(ps_server *sv);
/* sync mode: ps_shard_sync_add_rows with the push's rows (may be NULL)
 * decoded from tensor (the dense values, then the rows'). Nothing changes
 * on error. */
int ps_rows_sync_add(ps_server *sv, const ps_rows_req *rows, uint64_t worker,
                     uint64_t base_version, size_t offset, size_t count,
                     const ps_segview *tensor, int *dropped, int *have, char *err);
/* Applies a push's dense range (count values, may be 0) and its rows as
 * one update (ps_shard_push_ex); tensor holds the dense values then the
 * rows'. Nothing changes on error. */
int ps_rows_push(ps_server *sv, const ps_rows_req *rows, uint64_t base_version, size_t offset,
                 size_t count, const ps_segview *tensor, uint64_t *version, uint64_t *staleness,
                 char *err);
/* Status: every table's figures (store and ptrs: room for n_tables). */
void ps_rows_status(ps_server *sv, Ps__StatusResponse *resp, Ps__TableStatus *store,
                    Ps__TableStatus **ptrs);

#endif

/* Embedding tables: what a job declares, where each row lives, and how a
 * row starts. Shared by ps-server (which stores the rows) and ps-worker
 * (which asks each shard for the rows of its batch), so that both place a
 * row id on the same shard.
 *
 * A job declares its tables beside its dense model:
 *
 *   "embeddings": [
 *     {"name": "cat", "rows": 4000000, "dim": 16,
 *      "init": "uniform:0.05",          (or "normal:STD", "zeros"; default uniform:0.05)
 *      "optimizer": {"name": "adagrad", "lr": 0.05}}   (default: the job's optimizer)
 *   ]
 *
 * rows > 0: ids are 0 .. rows-1 (anything else is refused), and each shard
 * stores its part densely, allocated at start (untouched pages cost no
 * memory). rows = 0: ids are any 64-bit value (hashed feature strings);
 * a shard creates a row on its first push, and holds at most
 * "max_rows_per_shard" of them (default 2^26; a push that would create
 * more is refused, nothing applied).
 *
 * Placement. A bounded table's ids go through a keyed permutation of
 * [0, rows) (a Feistel network over the next power of 4, cycle-walking
 * back into range); the permuted value p lives on shard p % S at local
 * row p / S. So every shard holds rows/S rows (+-1) and whatever the ids'
 * distribution (contiguous ranges, multiples of S, Zipf's few hot ids),
 * they spread as randomly placed ids would, and a shard indexes its rows
 * without a map. An unbounded table's id lives on shard mix(id) % S.
 * The key is the table's name: a job's placement depends on the table's
 * name, rows and the number of shards only.
 *
 * A row's initial values are a pure function of (job seed, table name,
 * id): the same whichever shard holds it, so resharding, restarts and
 * unbounded tables (created on first touch) all see the same start.
 *
 * Optimizers update a row only when a push touches it ("lazy"), counting
 * each row's own updates t for Adam's bias correction: 1 - beta^t with
 * the row's t is exact for the moments the row holds, however rarely it
 * is touched. */
#ifndef PS_COMMON_EMB_H
#define PS_COMMON_EMB_H

#include <stddef.h>
#include <stdint.h>

#define PS_MAX_TABLES 16
#define PS_TABLE_MAX_DIM 1024
/* Ids one Pull or Push may name, over all its tables. */
#define PS_MAX_ROWS_PER_REQUEST (1u << 20)

enum { PS_TABLE_INIT_UNIFORM = 0, PS_TABLE_INIT_NORMAL = 1, PS_TABLE_INIT_ZEROS = 2 };

/* One table of a job (its optimizer is the job's table_optim[i]). */
typedef struct {
  char name[32];
  uint64_t rows;   /* 0: unbounded ids */
  int dim;         /* values per row, 1..PS_TABLE_MAX_DIM */
  int init;        /* PS_TABLE_INIT_* */
  float init_scale;
  uint64_t max_rows_per_shard; /* unbounded tables: rows a shard may create */
  uint64_t key;    /* from the name: the placement's and the init's key */
} ps_table_spec;

/* Checks a table's name: [A-Za-z0-9_.-], 1..31 characters. */
int ps_table_name_ok(const char *name);

/* The key of a table name. */
uint64_t ps_table_key(const char *name);

/* Where id lives among S shards: returns the shard and writes the local
 * row (bounded tables; unbounded: the id itself). The id must be valid
 * (ps_table_id_ok). */
int ps_table_place(const ps_table_spec *t, int S, uint64_t id, uint64_t *local);

/* ps_table_place of ids[0, n) (each valid) at once: their shards into
 * shard[0, n) (NULL: not wanted), their local rows into local[0, n), which
 * may be ids itself. Several times faster per id (8 ids a step where the
 * CPU has AVX2). */
void ps_table_place_many(const ps_table_spec *t, int S, const uint64_t *ids, size_t n, int *shard,
                         uint64_t *local);

/* Rows shard s of S holds of a bounded table (0 for an unbounded one). */
uint64_t ps_table_shard_rows(const ps_table_spec *t, int S, int s);

/* The id at local row `local` of shard s (bounded tables): the inverse of
 * ps_table_place. */
uint64_t ps_table_local_id(const ps_table_spec *t, int S, int s, uint64_t local);

/* 1 when id is a row of the table (below rows; any id when unbounded). */
static inline int ps_table_id_ok(const ps_table_spec *t, uint64_t id) {
  return t->rows == 0 || id < t->rows;
}

/* The initial values of row id (dim floats). */
void ps_table_init_row(const ps_table_spec *t, uint64_t seed, uint64_t id, float *out);

/* The keyed permutation of [0, n) itself (n >= 1), and its inverse. */
uint64_t ps_perm_forward(uint64_t key, uint64_t n, uint64_t x);
uint64_t ps_perm_inverse(uint64_t key, uint64_t n, uint64_t y);
/* ps_perm_forward of x[0, count) (each below n) into y (which may be x). */
void ps_perm_forward_many(uint64_t key, uint64_t n, const uint64_t *x, uint64_t *y,
                          size_t count);

#endif

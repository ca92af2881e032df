/* A batch's embedding ids de-duplicated (see emb_plan.h).
 *
 * Three passes over the positions, each O(total):
 *   1. ids to rows: an open-addressing table (linear probing) of slots
 *      holding an id and its row of uniq; a new id appends a row. Each
 *      slot holds its id, so a probe is one cache line, and the slot of
 *      the id PREFETCH_AHEAD positions on is prefetched, so that a batch
 *      larger than the caches waits on few of its misses (on the 2-core
 *      target, 1M positions of 290k distinct ids: this pass in about half
 *      the time of slots holding only a row, which read uniq to compare).
 *      The table is a power of two of slots and at most half full: it
 *      starts at the size the last batch ended with (at most the size for
 *      `total` distinct ids, so that clearing it costs O(total)) and
 *      doubles, re-inserting the rows so far, when the distinct ids pass
 *      half of it. Batches of a steady size never re-insert.
 *   2. the count of positions per row into rev_off[r + 1], summed into
 *      starts (a counting sort by row).
 *   3. examples placed at their row's cursor, positions in increasing
 *      order, so each row's examples come out in position order; the
 *      cursors end one row later, and are shifted back into rev_off. */
#include "emb_plan.h"

#include <stdlib.h>
#include <string.h>

#include "../common/util.h"

/* A slot: an id and its row, or row -1 for an empty slot. */
struct ps_emb_slot {
  uint64_t id;
  int32_t row;
};

enum { MIN_TABLE = 64, PREFETCH_AHEAD = 16 };

/* The id's bits mixed so that ids differing only in high bits (a field
 * number in the top byte, multiples of a power of two) spread over the
 * slots: xor-shifts and odd multipliers, each step invertible. */
static inline uint64_t mix64(uint64_t x) { return ps_fmix64(x); }

/* The most slots a batch of `total` positions can need: a power of two
 * >= 2*total (total distinct ids, half full). */
static size_t table_slots(size_t total) {
  size_t s = MIN_TABLE;
  while (s < 2 * total) s *= 2;
  return s;
}

/* The capacity for `want` elements, up from cap: want, or 1.5 times cap if
 * that is more, so that a slowly growing batch reallocates a logarithmic
 * number of times. */
static size_t next_cap(size_t cap, size_t want) {
  const size_t next = cap + cap / 2;
  return next > want ? next : want;
}

/* idx, rev_ex, uniq and rev_off hold a batch of `total` positions (u <=
 * total rows), grown with their contents kept. 0, or PS_ENOMEM: the
 * capacities are those of the buffers that could not grow (the ones that
 * did keep their contents). */
static int grow(ps_emb_plan *p, size_t total) {
  const size_t want_pos = total ? total : 1, want_rows = total + 1;
  if (want_pos > p->cap_total) {
    const size_t next = next_cap(p->cap_total, want_pos);
    int32_t *idx = realloc(p->idx, next * sizeof *idx);
    if (!idx) return PS_ENOMEM;
    p->idx = idx;
    int32_t *ex = realloc(p->rev_ex, next * sizeof *ex);
    if (!ex) return PS_ENOMEM;
    p->rev_ex = ex;
    p->cap_total = next;
  }
  if (want_rows > p->cap_uniq) {
    const size_t next = next_cap(p->cap_uniq, want_rows);
    uint64_t *uniq = realloc(p->uniq, next * sizeof *uniq);
    if (!uniq) return PS_ENOMEM;
    p->uniq = uniq;
    int32_t *off = realloc(p->rev_off, next * sizeof *off);
    if (!off) return PS_ENOMEM;
    p->rev_off = off;
    p->cap_uniq = next;
  }
  return 0;
}

/* Room for `slots` slots; the table's contents are not kept (it is
 * cleared and refilled next). 0, or PS_ENOMEM with the table as it was. */
static int table_reserve(ps_emb_plan *p, size_t slots) {
  if (slots <= p->cap_table) return 0;
  const size_t next = next_cap(p->cap_table, slots);
  struct ps_emb_slot *t = malloc(next * sizeof *t);
  if (!t) return PS_ENOMEM;
  free(p->table);
  p->table = t;
  p->cap_table = next;
  return 0;
}

/* The table as `slots` slots (a power of two, reserved) holding rows
 * [0, u) of uniq, which are distinct. */
static void table_reset(ps_emb_plan *p, size_t slots, int32_t u) {
  memset(p->table, 0xff, slots * sizeof *p->table); /* every row -1 */
  const size_t mask = slots - 1;
  for (int32_t r = 0; r < u; r++) {
    size_t s = (size_t)mix64(p->uniq[r]) & mask;
    while (p->table[s].row >= 0) s = (s + 1) & mask;
    p->table[s].id = p->uniq[r];
    p->table[s].row = r;
  }
  p->slots = slots;
}

static int check_offsets(const uint64_t *ids, const int32_t *offsets, int n, char *err) {
  if (n < 0) return ps_seterr(err, PS_EINVAL, "embedding plan: %d examples", n);
  if (!offsets) return ps_seterr(err, PS_EINVAL, "embedding plan: no offsets");
  if (offsets[0] != 0)
    return ps_seterr(err, PS_EINVAL, "embedding plan: offsets[0] is %d, not 0", (int)offsets[0]);
  for (int e = 0; e < n; e++)
    if (offsets[e + 1] < offsets[e])
      return ps_seterr(err, PS_EINVAL,
                       "embedding plan: offsets decrease at example %d (%d, then %d)", e,
                       (int)offsets[e], (int)offsets[e + 1]);
  if (offsets[n] > 0 && !ids)
    return ps_seterr(err, PS_EINVAL, "embedding plan: no ids for %d positions", (int)offsets[n]);
  return 0;
}

/* Pass 1: idx and uniq, u into *u_out. 0, or PS_ENOMEM when the table
 * could not double. */
static int assign_rows(ps_emb_plan *p, const uint64_t *ids, size_t total, int32_t *u_out) {
  size_t slots = table_slots(total);
  if (p->slots >= MIN_TABLE && p->slots < slots) slots = p->slots;
  if (table_reserve(p, slots)) return PS_ENOMEM;
  table_reset(p, slots, 0);
  size_t mask = slots - 1;
  int32_t u = 0;
  for (size_t j = 0; j < total; j++) {
    if (j + PREFETCH_AHEAD < total)
      __builtin_prefetch(&p->table[(size_t)mix64(ids[j + PREFETCH_AHEAD]) & mask]);
    const uint64_t id = ids[j];
    size_t s = (size_t)mix64(id) & mask;
    while (p->table[s].row >= 0 && p->table[s].id != id) s = (s + 1) & mask;
    int32_t row = p->table[s].row;
    if (row < 0) { /* first appearance: a new row */
      row = u++;
      p->uniq[row] = id;
      if (2 * (size_t)u <= slots) {
        p->table[s].id = id;
        p->table[s].row = row;
      } else { /* more than half full: double (never past table_slots(total)) */
        slots *= 2;
        if (table_reserve(p, slots)) return PS_ENOMEM;
        table_reset(p, slots, u);
        mask = slots - 1;
      }
    }
    p->idx[j] = row;
  }
  *u_out = u;
  return 0;
}

/* Passes 2 and 3: rev_off and rev_ex from idx. */
static void reverse(ps_emb_plan *p, const int32_t *offsets, int n, int32_t u) {
  int32_t *off = p->rev_off;
  memset(off, 0, ((size_t)u + 1) * sizeof *off);
  const size_t total = (size_t)offsets[n];
  for (size_t j = 0; j < total; j++) off[p->idx[j] + 1]++;
  for (int32_t r = 0; r < u; r++) off[r + 1] += off[r]; /* off[r]: row r's start */
  /* Row r's cursor is off[r]; placing its entries moves it to its end,
   * which is row r+1's start. */
  for (int e = 0; e < n; e++)
    for (int32_t j = offsets[e]; j < offsets[e + 1]; j++) p->rev_ex[off[p->idx[j]]++] = e;
  memmove(off + 1, off, (size_t)u * sizeof *off);
  off[0] = 0;
}

int ps_emb_plan_build(ps_emb_plan *p, const uint64_t *ids, const int32_t *offsets, int n,
                      char *err) {
  int rc = check_offsets(ids, offsets, n, err);
  if (rc) return rc;
  const size_t total = (size_t)offsets[n];
  /* The arrays the batch can need (u <= total) before anything is
   * written; the table grows as the distinct ids come. */
  int32_t u = 0;
  if (grow(p, total) || assign_rows(p, ids, total, &u)) {
    p->n = p->total = p->u = 0;
    p->slots = 0;
    return ps_seterr(err, PS_ENOMEM, "embedding plan: out of memory for %zu positions", total);
  }
  reverse(p, offsets, n, u);
  p->n = n;
  p->total = (int)total;
  p->u = u;
  return 0;
}

void ps_emb_plan_free(ps_emb_plan *p) {
  if (!p) return;
  free(p->uniq);
  free(p->idx);
  free(p->rev_off);
  free(p->rev_ex);
  free(p->table);
  memset(p, 0, sizeof *p);
}

/* A batch's embedding ids de-duplicated, on the host: what the embedding
 * ops of kernels/ops.h (embedding_bag_forward, embedding_bag_backward) take.
 *
 * A batch of n examples has, for one embedding field, a bag of 64-bit ids
 * per example, given as CSR: bag e is ids[offsets[e] .. offsets[e+1]) (bags
 * may be empty; positions j run over [0, total), total = offsets[n]). The
 * plan holds:
 *
 *   uniq     (u)        the distinct ids, in order of first appearance: the
 *                       rows to pull from the parameter servers, in this
 *                       order, as the (u, dim) rows the ops read
 *   idx      (total)    idx[j]: the row of ids[j] in uniq (the forward's
 *                       gather)
 *   rev_off  (u + 1)    the reverse CSR (the backward's scatter, without
 *   rev_ex   (total)    atomics): for row r, rev_ex[rev_off[r] ..
 *                       rev_off[r+1]) are the examples of the positions
 *                       holding uniq[r], in increasing position order (an
 *                       example appears once per position: twice for an id
 *                       twice in its bag)
 *
 * Built in O(total) expected time with an open-addressing hash table (linear
 * probing, at most half full, doubled as the distinct ids come). A plan
 * keeps its buffers and its table's size from batch to batch: they grow
 * when a batch needs more and never shrink, so a steady stream of batches
 * of similar size allocates nothing. One plan is used by one thread at a
 * time; plans share nothing. */
#ifndef PS_KERNELS_EMB_PLAN_H
#define PS_KERNELS_EMB_PLAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  /* The last batch built (all 0 and the arrays unspecified before the
   * first build, and after a build that failed for want of memory). */
  int n;            /* examples */
  int total;        /* positions: offsets[n] */
  int u;            /* distinct ids */
  uint64_t *uniq;   /* (u) */
  int32_t *idx;     /* (total) */
  int32_t *rev_off; /* (u + 1) */
  int32_t *rev_ex;  /* (total) */

  /* Private: capacities (in elements) and the hash table. */
  size_t cap_total, cap_uniq; /* idx and rev_ex; uniq and rev_off (u + 1 of them) */
  struct ps_emb_slot *table;  /* slots: an id and its row */
  size_t cap_table;           /* slots allocated */
  size_t slots;               /* slots the last batch ended with (a power of two) */
} ps_emb_plan;

/* An empty plan; a zeroed ps_emb_plan is the same. */
#define PS_EMB_PLAN_INIT \
  { 0 }

/* De-duplicates the batch (ids: offsets[n] of them, may be NULL when that is
 * 0; offsets: n+1 entries). Returns 0 with the plan filled in, or:
 *  PS_EINVAL: n < 0, offsets NULL, offsets[0] != 0, or offsets decreasing
 *    somewhere (which also rules out negative offsets), or ids NULL for a
 *    non-empty batch; a message in err (NULL or PS_ERRLEN bytes) names the
 *    first bad entry. The plan is unchanged (the previous batch's results
 *    stay readable).
 *  PS_ENOMEM: its buffers could not grow; the plan holds no batch then (n,
 *    total and u are 0) but stays valid: build again or free it.
 * Offsets are int32, so total is at most INT32_MAX, and every index the
 * plan holds fits an int32. */
int ps_emb_plan_build(ps_emb_plan *p, const uint64_t *ids, const int32_t *offsets, int n,
                      char *err);

/* Frees the plan's buffers and empties it (it may be built again). NULL is
 * fine. */
void ps_emb_plan_free(ps_emb_plan *p);

#endif

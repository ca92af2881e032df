/* The kernels of embedding (click-through-rate) models: the host plan that
 * de-duplicates a batch's ids (kernels/emb_plan.h), and the ops
 * embedding_bag_forward / _backward, copy_cols and sigmoid_xent_forward /
 * _backward of kernels/ops.h, on the cpu backend (one thread, and three of
 * its own), the emulated device (kernels/emu: every pointer checked to be
 * device memory, index arrays checked to stay in bounds) and, where built,
 * the oneDNN backend.
 *
 *  - The plan: hand cases (duplicates in a bag and across bags, empty bags,
 *    the ids 0 and UINT64_MAX), ids that differ only in high bits, a large
 *    batch after a small one (the buffers and the table grow), reuse (a
 *    batch no larger than one before allocates nothing: the buffers stay
 *    where they are), and the errors, which leave the plan as it was. Each
 *    plan is checked whole by check_plan: uniq distinct and in order of
 *    first appearance, idx mapping every position to its id, the reverse
 *    CSR listing each row's examples in position order.
 *  - The ops against naive loops written here in the order ops.h states
 *    (float sums from 0, products rounded on their own), so bit for bit:
 *    the backward's reference scans every position for each row and does
 *    not use the plan's reverse CSR it checks. Outputs are prefilled with
 *    NaN, so an op that skips or accumulates into an output fails.
 *  - Finite differences: loss = mean sigmoid_xent(concat over two fields
 *    of embedding_bag(rows_f) . w) with the concatenation done by
 *    copy_cols, differentiated by the backward ops (sigmoid_xent_backward,
 *    dense_backward, copy_cols to split the gradient, embedding_bag_backward)
 *    w.r.t. every row entry, with sum and with mean pooling; and the
 *    loss's own gradient w.r.t. the logits, extremes (+-100) included.
 *    Central differences with the perturbation as stored in float.
 *    Tolerance |num - ana| <= GRAD_RTOL * max(|num|, |ana|) + GRAD_ATOL:
 *    the loss is summed in double but its logits are float32 (rounding
 *    2^-24 |logit| each, a loss error of at most 2^-24 |logit| / n, so a
 *    difference quotient error of about 1e-7 / (2 eps) = 5e-6 at eps 0.01),
 *    and the truncation error eps^2 |L'''| / 6 is below 1e-6 for
 *    |w| <= 1 (|sigmoid''| <= 0.1); GRAD_ATOL 5e-5 and GRAD_RTOL 1e-3 are
 *    10x over both (measured: below 6e-6), while a missing mean scale, a
 *    wrong row or a dropped duplicate is an error of 10% or more.
 *  - The loss at extreme logits (+-100, +-1e4): finite, no NaN, against a
 *    softplus written here; probabilities in [0, 1].
 *  - On the emulated device, the ops recorded into a graph run nothing
 *    until it is launched, and then give the plain ops' results on the
 *    inputs copied in since.
 *  - On the emulated device, in child processes: an index past the rows,
 *    a reverse entry past the examples, decreasing offsets, a short
 *    output buffer and host pointers abort, as a GPU would fault. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../common/util.h"
#include "../../kernels/emb_plan.h"
#include "../../kernels/emu/ops_emu.h"
#include "../../kernels/ops.h"
#include "check.h"
#ifdef PS_HAVE_DNNL
#include "../../kernels/dnnl/ops_dnnl.h"
#endif

#define GRAD_RTOL 1e-3
#define GRAD_ATOL 5e-5
#define GRAD_EPS 0.01f

static ps_ops *ops; /* the backend under test */

/* ---- helpers ---- */

/* A local xorshift, so that the inputs do not depend on the code under
 * test. */
static uint64_t rand_state = 0x9E3779B97F4A7C15ULL;

static uint64_t rand_u64(void) {
  rand_state ^= rand_state << 13;
  rand_state ^= rand_state >> 7;
  rand_state ^= rand_state << 17;
  return rand_state;
}

static double rand_unit(void) { return (double)(rand_u64() >> 11) * (1.0 / 9007199254740992.0); }

static int rand_below(int k) { return (int)(rand_unit() * k); }

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "test_emb_kernels: out of memory\n");
    abort();
  }
  return p;
}

static float *uniform_floats(size_t n, float lo, float hi) {
  float *a = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) a[i] = lo + (hi - lo) * (float)rand_unit();
  return a;
}

/* Backend memory holding a copy of host (bytes of it), or NaN floats. */
static void *dev_put(const void *host, size_t bytes) {
  void *p = ops->alloc(ops->ctx, bytes);
  if (!p) {
    fprintf(stderr, "test_emb_kernels: %s: out of backend memory\n", ops->name);
    abort();
  }
  ops->to_device(ops->ctx, p, host, bytes);
  return p;
}

static float *dev_nans(size_t n) {
  float *h = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) h[i] = NAN;
  float *p = dev_put(h, n * sizeof(float));
  free(h);
  return p;
}

/* Backend memory into host memory, complete on return. */
static void dev_get(void *host, const void *dev, size_t bytes) {
  ops->to_host(ops->ctx, host, dev, bytes);
  ops->sync(ops->ctx);
}

static void *dev_fetch(const void *dev, size_t bytes) {
  void *h = xmalloc(bytes);
  dev_get(h, dev, bytes);
  return h;
}

static void dev_free(void *p) { ops->free(ops->ctx, p); }

/* One CHECK per array, bit for bit. */
static void check_bits(const char *what, const float *got, const float *want, size_t n) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ == 0) first = i;
  CHECK_MSG(bad == 0, "%s on %s: %zu of %zu differ; first at %zu: got %.9g, want %.9g", what,
            ops->name, bad, n, first, bad ? (double)got[first] : 0.0,
            bad ? (double)want[first] : 0.0);
}

/* A batch: n examples' bags of ids (CSR), bag sizes in [0, max_bag], ids
 * drawn from `pool` values spread over 64 bits (so there are duplicates in
 * bags and across them when pool is small). */
typedef struct {
  int n;
  int32_t *offsets; /* (n + 1) */
  uint64_t *ids;    /* (offsets[n]) */
} batch;

static uint64_t pool_id(int k) { return (uint64_t)k * 0x9E3779B97F4A7C15ULL ^ 0xABCDEF; }

static batch batch_random(int n, int max_bag, int pool) {
  batch b = {.n = n, .offsets = xmalloc(((size_t)n + 1) * sizeof(int32_t))};
  b.offsets[0] = 0;
  for (int e = 0; e < n; e++) b.offsets[e + 1] = b.offsets[e] + rand_below(max_bag + 1);
  b.ids = xmalloc((size_t)b.offsets[n] * sizeof(uint64_t));
  for (int32_t j = 0; j < b.offsets[n]; j++) b.ids[j] = pool_id(rand_below(pool));
  return b;
}

static void batch_free(batch *b) {
  free(b->offsets);
  free(b->ids);
}

/* ---- the plan ---- */

static int cmp_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* The whole of a plan against its batch: one CHECK per property, so a
 * broken plan shows what is wrong rather than thousands of failures. */
static void check_plan(const char *what, const ps_emb_plan *p, const uint64_t *ids,
                       const int32_t *offsets, int n) {
  const int32_t total = offsets[n];
  CHECK_MSG(p->n == n && p->total == total && p->u >= 0 && p->u <= total,
            "%s: n %d total %d u %d, want n %d total %d", what, p->n, p->total, p->u, n,
            (int)total);
  if (p->n != n || p->total != total || p->u < 0 || p->u > total) return;
  const int32_t u = p->u;

  /* idx maps each position to its id, and rows appear in order: a
   * position's row is an earlier one or the next new one. */
  int32_t next = 0, bad_map = 0, bad_order = 0;
  for (int32_t j = 0; j < total; j++) {
    const int32_t r = p->idx[j];
    if (r < 0 || r >= u || p->uniq[r] != ids[j]) {
      bad_map++;
      continue;
    }
    if (r == next)
      next++;
    else if (r > next)
      bad_order++;
  }
  CHECK_MSG(bad_map == 0, "%s: %d positions map to a wrong row", what, (int)bad_map);
  CHECK_MSG(bad_order == 0 && next == u, "%s: rows not in order of first appearance (%d of %d)",
            what, (int)next, (int)u);

  /* uniq distinct. */
  uint64_t *sorted = xmalloc((size_t)u * sizeof *sorted);
  memcpy(sorted, p->uniq, (size_t)u * sizeof *sorted);
  qsort(sorted, (size_t)u, sizeof *sorted, cmp_u64);
  int dup = 0;
  for (int32_t r = 1; r < u; r++) dup += sorted[r] == sorted[r - 1];
  CHECK_MSG(dup == 0, "%s: %d duplicate ids in uniq", what, dup);
  free(sorted);

  /* The reverse CSR: each row's examples, one per position, in position
   * order. */
  int bad_off = p->rev_off[0] != 0 || p->rev_off[u] != total;
  for (int32_t r = 0; r < u; r++) bad_off += p->rev_off[r + 1] < p->rev_off[r];
  CHECK_MSG(bad_off == 0, "%s: rev_off is not a CSR of the %d positions", what, (int)total);
  if (bad_off) return;
  int32_t *cursor = calloc((size_t)u + 1, sizeof *cursor);
  int bad_rev = 0;
  for (int e = 0; e < n; e++)
    for (int32_t j = offsets[e]; j < offsets[e + 1]; j++) {
      const int32_t r = p->idx[j];
      if (r < 0 || r >= u) continue; /* reported above */
      const int32_t k = p->rev_off[r] + cursor[r]++;
      bad_rev += k >= p->rev_off[r + 1] || p->rev_ex[k] != e;
    }
  for (int32_t r = 0; r < u; r++) bad_rev += cursor[r] != p->rev_off[r + 1] - p->rev_off[r];
  CHECK_MSG(bad_rev == 0, "%s: %d reverse entries wrong", what, bad_rev);
  free(cursor);
}

/* Duplicates in a bag and across bags, empty bags first, inside and last,
 * and the ids 0 and UINT64_MAX (no value is reserved as "empty"). */
static void test_plan_hand(void) {
  const uint64_t M = UINT64_MAX;
  /* bags: {}, {5, 7, 5}, {}, {7, 9}, {9, 9, 5}, {0, M, 0}, {} */
  const int32_t offsets[] = {0, 0, 3, 3, 5, 8, 11, 11};
  const uint64_t ids[] = {5, 7, 5, 7, 9, 9, 9, 5, 0, M, 0};
  ps_emb_plan p = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  CHECK(ps_emb_plan_build(&p, ids, offsets, 7, err) == 0);
  check_plan("hand", &p, ids, offsets, 7);
  const uint64_t uniq[] = {5, 7, 9, 0, M};
  const int32_t idx[] = {0, 1, 0, 1, 2, 2, 2, 0, 3, 4, 3};
  const int32_t rev_off[] = {0, 3, 5, 8, 10, 11};
  const int32_t rev_ex[] = {1, 1, 4, 1, 3, 3, 4, 4, 5, 5, 5};
  CHECK(p.u == 5 && memcmp(p.uniq, uniq, sizeof uniq) == 0);
  CHECK(p.total == 11 && memcmp(p.idx, idx, sizeof idx) == 0);
  CHECK(memcmp(p.rev_off, rev_off, sizeof rev_off) == 0);
  CHECK(memcmp(p.rev_ex, rev_ex, sizeof rev_ex) == 0);

  /* No positions at all: no examples, then only empty bags. */
  const int32_t none[] = {0, 0, 0, 0};
  CHECK(ps_emb_plan_build(&p, NULL, none, 0, err) == 0);
  CHECK(p.n == 0 && p.total == 0 && p.u == 0 && p.rev_off[0] == 0);
  CHECK(ps_emb_plan_build(&p, NULL, none, 3, err) == 0);
  CHECK(p.n == 3 && p.total == 0 && p.u == 0 && p.rev_off[0] == 0);
  check_plan("empty bags", &p, NULL, none, 3);

  /* One id everywhere: one row holding every example, in order. */
  const int32_t one_off[] = {0, 2, 3, 5};
  const uint64_t one_ids[] = {42, 42, 42, 42, 42};
  CHECK(ps_emb_plan_build(&p, one_ids, one_off, 3, err) == 0);
  check_plan("one id", &p, one_ids, one_off, 3);
  const int32_t one_ex[] = {0, 0, 1, 2, 2};
  CHECK(p.u == 1 && p.rev_off[1] == 5 && memcmp(p.rev_ex, one_ex, sizeof one_ex) == 0);
  ps_emb_plan_free(&p);
  ps_emb_plan_free(&p); /* twice is fine: it is emptied */
  ps_emb_plan_free(NULL);
}

/* Ids equal in their low 32 bits (a field number in the high bits,
 * multiples of 2^32): a table indexed by low bits would put them all in
 * one chain. */
static void test_plan_high_bits(void) {
  enum { N = 4000 };
  int32_t *offsets = xmalloc((N + 1) * sizeof *offsets);
  uint64_t *ids = xmalloc(N * sizeof *ids);
  for (int e = 0; e <= N; e++) offsets[e] = e;
  for (int j = 0; j < N; j++) ids[j] = ((uint64_t)(j % 1000) << 32) | 7u;
  ps_emb_plan p = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  CHECK(ps_emb_plan_build(&p, ids, offsets, N, err) == 0);
  check_plan("high bits", &p, ids, offsets, N);
  CHECK(p.u == 1000);
  ps_emb_plan_free(&p);
  free(offsets), free(ids);
}

/* A small batch, then one far larger (buffers and table grow), then
 * smaller and equal ones: no allocation (the buffers stay put), and every
 * plan right. */
static void test_plan_grow_and_reuse(void) {
  ps_emb_plan p = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  batch small = batch_random(4, 3, 5);
  CHECK(ps_emb_plan_build(&p, small.ids, small.offsets, small.n, err) == 0);
  check_plan("small", &p, small.ids, small.offsets, small.n);
  const size_t small_slots = p.slots;

  batch big = batch_random(20000, 12, 60000); /* ~120k positions, ~52k distinct */
  CHECK(ps_emb_plan_build(&p, big.ids, big.offsets, big.n, err) == 0);
  check_plan("big", &p, big.ids, big.offsets, big.n);
  /* It started at the small batch's size and doubled as the ids came. */
  CHECK_MSG(p.slots >= 2 * (size_t)p.u && p.slots > small_slots && p.cap_table >= p.slots,
            "table of %zu slots (%zu allocated) for %d distinct ids", p.slots, p.cap_table, p.u);
  CHECK(p.u > 40000);

  const void *bufs[5] = {p.uniq, p.idx, p.rev_off, p.rev_ex, p.table};
  batch mid = batch_random(5000, 12, 1000);
  for (int round = 0; round < 3; round++) {
    const batch *b = round == 1 ? &big : round == 0 ? &mid : &small;
    CHECK(ps_emb_plan_build(&p, b->ids, b->offsets, b->n, err) == 0);
    check_plan(round == 1   ? "big again"
               : round == 0 ? "mid after big"
                            : "small after big",
               &p, b->ids, b->offsets, b->n);
    const void *now[5] = {p.uniq, p.idx, p.rev_off, p.rev_ex, p.table};
    CHECK_MSG(memcmp(bufs, now, sizeof bufs) == 0, "round %d: the plan reallocated", round);
    CHECK(p.slots >= 2 * (size_t)p.u);
  }
  ps_emb_plan_free(&p);
  batch_free(&small), batch_free(&big), batch_free(&mid);
}

/* Bad offsets and arguments: PS_EINVAL with a message, the plan as it
 * was (the last good batch still readable). */
static void test_plan_errors(void) {
  const int32_t good_off[] = {0, 2, 3};
  const uint64_t good_ids[] = {1, 2, 1};
  ps_emb_plan p = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  CHECK(ps_emb_plan_build(&p, good_ids, good_off, 2, err) == 0);

  const int32_t start1[] = {1, 2, 3};
  const int32_t decreasing[] = {0, 3, 2, 4};
  const int32_t negative[] = {0, -1, 2};
  const uint64_t ids[] = {9, 9, 9, 9};
  struct {
    const char *what;
    const uint64_t *ids;
    const int32_t *offsets;
    int n;
    const char *says;
  } cases[] = {
      {"negative n", ids, good_off, -1, "-1 examples"},
      {"no offsets", ids, NULL, 2, "no offsets"},
      {"offsets[0] = 1", ids, start1, 2, "offsets[0] is 1"},
      {"decreasing", ids, decreasing, 3, "decrease at example 1"},
      {"a negative offset", ids, negative, 2, "decrease at example 0"},
      {"no ids", NULL, good_off, 2, "no ids"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    err[0] = '\0';
    const int rc = ps_emb_plan_build(&p, cases[i].ids, cases[i].offsets, cases[i].n, err);
    CHECK_MSG(rc == PS_EINVAL, "%s: got %d", cases[i].what, rc);
    CHECK_MSG(strstr(err, cases[i].says) != NULL, "%s: message \"%s\"", cases[i].what, err);
    check_plan(cases[i].what, &p, good_ids, good_off, 2); /* unchanged */
  }
  CHECK(ps_emb_plan_build(&p, NULL, NULL, -1, NULL) == PS_EINVAL); /* err may be NULL */
  ps_emb_plan_free(&p);
}

/* ---- the embedding ops ---- */

/* y (n, dim) as ops.h says, in float in its order. */
static void ref_bag_forward(int n, int dim, const int32_t *offsets, const int32_t *idx, int mean,
                            const float *rows, float *y) {
  for (int e = 0; e < n; e++)
    for (int c = 0; c < dim; c++) {
      float sum = 0.0f;
      for (int32_t j = offsets[e]; j < offsets[e + 1]; j++) sum += rows[(size_t)idx[j] * dim + c];
      const int32_t m = offsets[e + 1] - offsets[e];
      if (mean && m > 0) sum *= 1.0f / (float)m;
      y[(size_t)e * dim + c] = sum;
    }
}

/* drows (u, dim) from the positions directly (not the reverse CSR): for
 * each row, every position in increasing order, its example's dy. */
static void ref_bag_backward(int n, int dim, const int32_t *offsets, const int32_t *idx, int u,
                             int mean, const float *dy, float *drows) {
  for (int r = 0; r < u; r++) {
    float *sum = drows + (size_t)r * dim;
    for (int c = 0; c < dim; c++) sum[c] = 0.0f;
    for (int e = 0; e < n; e++)
      for (int32_t j = offsets[e]; j < offsets[e + 1]; j++) {
        if (idx[j] != r) continue;
        const float s = 1.0f / (float)(offsets[e + 1] - offsets[e]);
        for (int c = 0; c < dim; c++) {
          float g = dy[(size_t)e * dim + c];
          if (mean) g *= s;
          sum[c] += g;
        }
      }
  }
}

typedef struct {
  int n, dim, max_bag, pool;
} bag_case;

static const bag_case bag_cases[] = {
    {1, 1, 1, 1},      {7, 3, 4, 5},     /* duplicates everywhere, some empty bags */
    {33, 17, 9, 300},  {5, 8, 0, 4},     /* every bag empty: u = 0 */
    {512, 64, 8, 900}, {300, 5, 30, 20}, /* large enough to split over threads; hot rows */
};

static void bag_one(const bag_case *k, int mean) {
  char what[128];
  snprintf(what, sizeof what, "n%d dim%d bag<=%d pool%d %s", k->n, k->dim, k->max_bag, k->pool,
           mean ? "mean" : "sum");
  batch b = batch_random(k->n, k->max_bag, k->pool);
  ps_emb_plan p = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  CHECK(ps_emb_plan_build(&p, b.ids, b.offsets, b.n, err) == 0);
  const int n = k->n, dim = k->dim, u = p.u, total = p.total;
  const size_t ny = (size_t)n * dim, nr = (size_t)u * dim;
  float *rows = uniform_floats(nr, -1, 1), *dy = uniform_floats(ny, -1, 1);
  float *y_want = xmalloc(ny * sizeof(float)), *dr_want = xmalloc(nr * sizeof(float));
  ref_bag_forward(n, dim, b.offsets, p.idx, mean, rows, y_want);
  ref_bag_backward(n, dim, b.offsets, p.idx, u, mean, dy, dr_want);

  int32_t *d_off = dev_put(b.offsets, ((size_t)n + 1) * sizeof(int32_t));
  int32_t *d_idx = dev_put(p.idx, (size_t)total * sizeof(int32_t));
  int32_t *d_roff = dev_put(p.rev_off, ((size_t)u + 1) * sizeof(int32_t));
  int32_t *d_rex = dev_put(p.rev_ex, (size_t)total * sizeof(int32_t));
  float *d_rows = dev_put(rows, nr * sizeof(float)), *d_dy = dev_put(dy, ny * sizeof(float));
  float *d_y = dev_nans(ny), *d_dr = dev_nans(nr);
  ops->embedding_bag_forward(ops->ctx, n, dim, d_off, d_idx, mean, d_rows, d_y);
  ops->embedding_bag_backward(ops->ctx, n, dim, d_off, u, d_roff, d_rex, mean, d_dy, d_dr);
  float *y = dev_fetch(d_y, ny * sizeof(float)), *dr = dev_fetch(d_dr, nr * sizeof(float));
  char w2[160];
  snprintf(w2, sizeof w2, "embedding_bag_forward %s", what);
  check_bits(w2, y, y_want, ny);
  snprintf(w2, sizeof w2, "embedding_bag_backward %s", what);
  check_bits(w2, dr, dr_want, nr);

  free(rows), free(dy), free(y_want), free(dr_want), free(y), free(dr);
  dev_free(d_off), dev_free(d_idx), dev_free(d_roff), dev_free(d_rex), dev_free(d_rows);
  dev_free(d_dy), dev_free(d_y), dev_free(d_dr);
  ps_emb_plan_free(&p);
  batch_free(&b);
}

static void test_bag_ops(void) {
  for (size_t i = 0; i < sizeof bag_cases / sizeof bag_cases[0]; i++) {
    bag_one(&bag_cases[i], 0);
    bag_one(&bag_cases[i], 1);
  }
  /* No examples, or no columns: nothing to do, nothing touched. */
  const int32_t zero = 0;
  int32_t *d_off = dev_put(&zero, sizeof zero);
  float *d_y = dev_nans(1);
  ops->embedding_bag_forward(ops->ctx, 0, 4, d_off, d_off, 1, d_y, d_y);
  ops->embedding_bag_backward(ops->ctx, 0, 4, d_off, 0, d_off, d_off, 1, d_y, d_y);
  float y;
  dev_get(&y, d_y, sizeof y);
  CHECK(isnan(y));
  dev_free(d_off), dev_free(d_y);
}

/* Three feature matrices of widths 3, 1 and 6 into one (n, 10) matrix and
 * back out; into a wider matrix, the columns outside those written keep
 * their values. */
static void test_copy_cols(void) {
  enum { N = 37, F = 3, W = 10, WIDE = 13 };
  static const int width[F] = {3, 1, 6}, at[F] = {0, 3, 4};
  float *feat[F], *d_feat[F], *d_back[F];
  float *d_x = dev_nans((size_t)N * W), *d_wide = dev_nans((size_t)N * WIDE);
  for (int f = 0; f < F; f++) {
    feat[f] = uniform_floats((size_t)N * width[f], -1, 1);
    d_feat[f] = dev_put(feat[f], (size_t)N * width[f] * sizeof(float));
    d_back[f] = dev_nans((size_t)N * width[f]);
    ops->copy_cols(ops->ctx, N, width[f], d_feat[f], width[f], d_x + at[f], W);
    ops->copy_cols(ops->ctx, N, width[f], d_feat[f], width[f], d_wide + 2 + at[f], WIDE);
  }
  for (int f = 0; f < F; f++)
    ops->copy_cols(ops->ctx, N, width[f], d_x + at[f], W, d_back[f], width[f]);
  float *x = dev_fetch(d_x, (size_t)N * W * sizeof(float));
  float *wide = dev_fetch(d_wide, (size_t)N * WIDE * sizeof(float));
  float *want = xmalloc((size_t)N * W * sizeof(float));
  for (int f = 0; f < F; f++)
    for (int i = 0; i < N; i++)
      memcpy(want + (size_t)i * W + at[f], feat[f] + (size_t)i * width[f],
             (size_t)width[f] * sizeof(float));
  check_bits("copy_cols concatenation", x, want, (size_t)N * W);
  int kept = 1, placed = 1;
  for (int i = 0; i < N; i++)
    for (int c = 0; c < WIDE; c++) {
      const float v = wide[(size_t)i * WIDE + c];
      if (c < 2 || c >= 2 + W)
        kept &= isnan(v);
      else
        placed &= memcmp(&v, &want[(size_t)i * W + c - 2], sizeof v) == 0;
    }
  CHECK_MSG(kept && placed, "copy_cols into a wider matrix on %s: kept %d placed %d", ops->name,
            kept, placed);
  for (int f = 0; f < F; f++) {
    float *back = dev_fetch(d_back[f], (size_t)N * width[f] * sizeof(float));
    check_bits("copy_cols split", back, feat[f], (size_t)N * width[f]);
    free(back), free(feat[f]);
    dev_free(d_feat[f]), dev_free(d_back[f]);
  }
  free(x), free(wide), free(want);
  dev_free(d_x), dev_free(d_wide);
}

/* ---- the logistic loss ---- */

/* log(1 + exp(t)), written otherwise than the ops: by the sign of t. */
static double softplus(double t) { return t > 0 ? t + log1p(exp(-t)) : log1p(exp(t)); }

/* Logits from -1e4 to 1e4 with both labels: the losses are finite (the
 * naive log(sigmoid) is -inf at -100 in float), the probabilities in
 * [0, 1], the sum and the count those of a reference written here; an
 * empty batch gives {0, 0}. */
static void test_sigmoid_values(void) {
  static const float xs[] = {-1e4f, -100.0f, -20.0f, -1.5f,  -1e-3f, 0.0f,
                             1e-3f, 0.7f,    20.0f,  100.0f, 1e4f};
  enum { NX = sizeof xs / sizeof xs[0], N = 2 * NX };
  float logits[N], labels[N];
  for (int i = 0; i < N; i++) logits[i] = xs[i % NX], labels[i] = (float)(i / NX);
  float *d_x = dev_put(logits, sizeof logits), *d_y = dev_put(labels, sizeof labels);
  float *d_p = dev_nans(N), *d_g = dev_nans(N);
  const double nan2[2] = {NAN, NAN};
  double *d_st = dev_put(nan2, sizeof nan2);
  ops->sigmoid_xent_forward(ops->ctx, N, d_x, d_y, d_p, d_st);
  ops->sigmoid_xent_backward(ops->ctx, N, d_p, d_y, d_g);
  float p[N], g[N];
  double st[2];
  dev_get(p, d_p, sizeof p);
  dev_get(g, d_g, sizeof g);
  dev_get(st, d_st, sizeof st);

  double want = 0.0;
  int right = 0, finite = 1, in_range = 1;
  for (int i = 0; i < N; i++) {
    const double x = logits[i];
    want += labels[i] == 1.0f ? softplus(-x) : softplus(x);
    const double pw = 1.0 / (1.0 + exp(-x));
    right += (pw >= 0.5) == (labels[i] == 1.0f);
    in_range &= p[i] >= 0.0f && p[i] <= 1.0f;
    finite &= isfinite(g[i]);
    CHECK_MSG(fabs(p[i] - pw) <= 1e-6 * pw + 1e-38, "sigmoid(%g) on %s: %.9g, want %.9g", (double)x,
              ops->name, (double)p[i], pw);
    const float gw = (float)((pw - labels[i]) / N);
    CHECK_MSG(fabs(g[i] - gw) <= 1e-6 * fabs(gw) + 1e-9, "dlogit(%g, %g) on %s: %.9g, want %.9g",
              (double)x, (double)labels[i], ops->name, (double)g[i], (double)gw);
  }
  CHECK_MSG(isfinite(st[0]) && fabs(st[0] - want) <= 1e-12 * want,
            "sigmoid_xent loss sum on %s: %.17g, want %.17g", ops->name, st[0], want);
  CHECK_MSG(st[1] == right, "sigmoid_xent right on %s: %g, want %d", ops->name, st[1], right);
  CHECK(in_range && finite);
  /* x = 100 with label 1 costs exp(-100); x = -100 with label 1 costs 100. */
  CHECK(want > 2 * (1e4 + 100 + 20));

  /* An empty batch. */
  ops->to_device(ops->ctx, d_st, nan2, sizeof nan2);
  ops->sigmoid_xent_forward(ops->ctx, 0, d_x, d_y, d_p, d_st);
  dev_get(st, d_st, sizeof st);
  CHECK(st[0] == 0.0 && st[1] == 0.0);
  dev_free(d_x), dev_free(d_y), dev_free(d_p), dev_free(d_g), dev_free(d_st);
}

/* The mean loss at logits x (host), through the backend. */
static double sigmoid_loss(int n, const float *x, float *d_x, const float *d_y, float *d_p,
                           double *d_st) {
  ops->to_device(ops->ctx, d_x, x, (size_t)n * sizeof(float));
  ops->sigmoid_xent_forward(ops->ctx, n, d_x, d_y, d_p, d_st);
  double st[2];
  dev_get(st, d_st, sizeof st);
  return st[0] / n;
}

/* |num - ana| within the tolerance of the header; returns the error. */
static double grad_close(const char *what, int at, double num, double ana) {
  const double err = fabs(num - ana), scale = fmax(fabs(num), fabs(ana));
  CHECK_MSG(err <= GRAD_RTOL * scale + GRAD_ATOL, "%s on %s, entry %d: numeric %.9g, analytic %.9g",
            what, ops->name, at, num, ana);
  return err;
}

/* d(mean loss)/d(logit) by central differences, extremes included. */
static void test_sigmoid_gradcheck(void) {
  enum { N = 9 };
  float x[N] = {-100.0f, 100.0f, 0.0f, 3.0f, -2.5f, 0.3f, -0.7f, 100.0f, -100.0f};
  const float y[N] = {1, 0, 1, 0, 0, 1, 1, 1, 0};
  float *d_x = dev_put(x, sizeof x), *d_y = dev_put(y, sizeof y), *d_p = dev_nans(N);
  float *d_g = dev_nans(N);
  double *d_st = dev_put((double[2]){0, 0}, 2 * sizeof(double));
  sigmoid_loss(N, x, d_x, d_y, d_p, d_st);
  ops->sigmoid_xent_backward(ops->ctx, N, d_p, d_y, d_g);
  float g[N];
  dev_get(g, d_g, sizeof g);
  double worst = 0.0;
  for (int i = 0; i < N; i++) {
    const float x0 = x[i];
    x[i] = x0 + GRAD_EPS;
    const float up = x[i];
    const double lp = sigmoid_loss(N, x, d_x, d_y, d_p, d_st);
    x[i] = x0 - GRAD_EPS;
    const float down = x[i];
    const double lm = sigmoid_loss(N, x, d_x, d_y, d_p, d_st);
    x[i] = x0;
    worst =
        fmax(worst, grad_close("sigmoid_xent dlogits", i, (lp - lm) / ((double)up - down), g[i]));
  }
  if (check_failed_ == 0 && getenv("PS_TEST_VERBOSE"))
    printf("sigmoid_xent gradient on %s: largest error %.3g\n", ops->name, worst);
  dev_free(d_x), dev_free(d_y), dev_free(d_p), dev_free(d_g), dev_free(d_st);
}

/* ---- a tiny model, by finite differences ----
 * Two fields (embedding widths 3 and 5) pooled per example, concatenated
 * by copy_cols into x (n, 8), logits = x w (dense, no bias), the mean
 * logistic loss. */

enum { MF = 2, MN = 6, MW = 8 };
static const int model_dim[MF] = {3, 5}, model_at[MF] = {0, 3};

typedef struct {
  ps_emb_plan plan[MF];
  batch b[MF];
  float *rows[MF]; /* host (u_f, dim_f) */
  int32_t *d_off[MF], *d_idx[MF], *d_roff[MF], *d_rex[MF];
  float *d_rows[MF], *d_e[MF], *d_de[MF], *d_drows[MF];
  float *d_x, *d_dx, *d_w, *d_dw, *d_b, *d_db, *d_logit, *d_dlogit, *d_p, *d_label;
  double *d_st;
  int mean;
} model;

static void model_init(model *m, int mean) {
  memset(m, 0, sizeof *m);
  m->mean = mean;
  char err[PS_ERRLEN] = "";
  for (int f = 0; f < MF; f++) {
    m->b[f] = batch_random(MN, 4, 5); /* duplicates, some empty bags */
    CHECK(ps_emb_plan_build(&m->plan[f], m->b[f].ids, m->b[f].offsets, MN, err) == 0);
    const ps_emb_plan *p = &m->plan[f];
    const size_t nr = (size_t)p->u * model_dim[f];
    m->rows[f] = uniform_floats(nr, -1, 1);
    m->d_off[f] = dev_put(m->b[f].offsets, (MN + 1) * sizeof(int32_t));
    m->d_idx[f] = dev_put(p->idx, (size_t)p->total * sizeof(int32_t));
    m->d_roff[f] = dev_put(p->rev_off, ((size_t)p->u + 1) * sizeof(int32_t));
    m->d_rex[f] = dev_put(p->rev_ex, (size_t)p->total * sizeof(int32_t));
    m->d_rows[f] = dev_put(m->rows[f], nr * sizeof(float));
    m->d_e[f] = dev_nans((size_t)MN * model_dim[f]);
    m->d_de[f] = dev_nans((size_t)MN * model_dim[f]);
    m->d_drows[f] = dev_nans(nr);
  }
  float *w = uniform_floats(MW, -1, 1), label[MN];
  for (int i = 0; i < MN; i++) label[i] = (float)(i % 2);
  const float zero = 0.0f;
  m->d_w = dev_put(w, MW * sizeof(float));
  m->d_b = dev_put(&zero, sizeof zero);
  m->d_label = dev_put(label, sizeof label);
  m->d_x = dev_nans((size_t)MN * MW), m->d_dx = dev_nans((size_t)MN * MW);
  m->d_dw = dev_nans(MW), m->d_db = dev_nans(1);
  m->d_logit = dev_nans(MN), m->d_dlogit = dev_nans(MN), m->d_p = dev_nans(MN);
  m->d_st = dev_put((double[2]){0, 0}, 2 * sizeof(double));
  free(w);
}

static void model_free(model *m) {
  for (int f = 0; f < MF; f++) {
    dev_free(m->d_off[f]), dev_free(m->d_idx[f]), dev_free(m->d_roff[f]);
    dev_free(m->d_rex[f]), dev_free(m->d_rows[f]), dev_free(m->d_e[f]);
    dev_free(m->d_de[f]), dev_free(m->d_drows[f]);
    free(m->rows[f]);
    ps_emb_plan_free(&m->plan[f]);
    batch_free(&m->b[f]);
  }
  dev_free(m->d_x), dev_free(m->d_dx), dev_free(m->d_w), dev_free(m->d_dw);
  dev_free(m->d_b), dev_free(m->d_db), dev_free(m->d_logit), dev_free(m->d_dlogit);
  dev_free(m->d_p), dev_free(m->d_label), dev_free(m->d_st);
}

/* The mean loss with the host rows as they are now. */
static double model_loss(model *m) {
  for (int f = 0; f < MF; f++) {
    const int d = model_dim[f];
    ops->to_device(ops->ctx, m->d_rows[f], m->rows[f], (size_t)m->plan[f].u * d * sizeof(float));
    ops->embedding_bag_forward(ops->ctx, MN, d, m->d_off[f], m->d_idx[f], m->mean, m->d_rows[f],
                               m->d_e[f]);
    ops->copy_cols(ops->ctx, MN, d, m->d_e[f], d, m->d_x + model_at[f], MW);
  }
  ops->dense_forward(ops->ctx, MN, MW, 1, m->d_x, m->d_w, m->d_b, m->d_logit);
  ops->sigmoid_xent_forward(ops->ctx, MN, m->d_logit, m->d_label, m->d_p, m->d_st);
  double st[2];
  dev_get(st, m->d_st, sizeof st);
  return st[0] / MN;
}

/* drows of each field, after a model_loss. */
static void model_backward(model *m) {
  ops->sigmoid_xent_backward(ops->ctx, MN, m->d_p, m->d_label, m->d_dlogit);
  ops->dense_backward(ops->ctx, MN, MW, 1, m->d_x, m->d_w, m->d_dlogit, m->d_dx, m->d_dw, m->d_db);
  for (int f = 0; f < MF; f++) {
    const int d = model_dim[f];
    ops->copy_cols(ops->ctx, MN, d, m->d_dx + model_at[f], MW, m->d_de[f], d);
    ops->embedding_bag_backward(ops->ctx, MN, d, m->d_off[f], m->plan[f].u, m->d_roff[f],
                                m->d_rex[f], m->mean, m->d_de[f], m->d_drows[f]);
  }
}

static void model_gradcheck(int mean) {
  model m;
  model_init(&m, mean);
  model_loss(&m);
  model_backward(&m);
  const char *what = mean ? "model d rows (mean pooling)" : "model d rows (sum pooling)";
  double worst = 0.0;
  int entries = 0;
  for (int f = 0; f < MF; f++) {
    const size_t nr = (size_t)m.plan[f].u * model_dim[f];
    float *g = dev_fetch(m.d_drows[f], nr * sizeof(float));
    for (size_t i = 0; i < nr; i++, entries++) {
      const float v = m.rows[f][i];
      m.rows[f][i] = v + GRAD_EPS;
      const float up = m.rows[f][i];
      const double lp = model_loss(&m);
      m.rows[f][i] = v - GRAD_EPS;
      const float down = m.rows[f][i];
      const double lm = model_loss(&m);
      m.rows[f][i] = v;
      worst = fmax(worst, grad_close(what, entries, (lp - lm) / ((double)up - down), g[i]));
    }
    free(g);
  }
  CHECK(entries > 4); /* the rows were there to check */
  if (getenv("PS_TEST_VERBOSE"))
    printf("%s on %s: %d entries, largest error %.3g\n", what, ops->name, entries, worst);
  model_free(&m);
}

static void test_model_gradcheck(void) {
  model_gradcheck(0);
  model_gradcheck(1);
}

/* ---- the emulated device's faults ---- */

/* Runs fn in a child process: 1 when it died of SIGABRT (a GPU fault's
 * stand-in), 0 when it returned or died otherwise. */
static int aborts(void (*fn)(ps_ops *), ps_ops *emu) {
  fflush(NULL);
  const pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    if (!getenv("PS_TEST_VERBOSE") && !freopen("/dev/null", "w", stderr)) _exit(2);
    fn(emu);
    _exit(0);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return 0;
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

/* Two examples, bags {0, 1} and {1}, over u = 2 rows of dim 4: y holds
 * 8 floats, rows 16 (room for dim 5 and 8). */
typedef struct {
  int32_t *off, *idx, *roff, *rex;
  float *rows, *y;
} emu_case;

static emu_case emu_case_make(ps_ops *o, const int32_t *idx) {
  const int32_t off[3] = {0, 2, 3}, roff[3] = {0, 1, 3}, rex[3] = {0, 0, 1};
  emu_case c;
  c.off = o->alloc(o->ctx, sizeof off), c.idx = o->alloc(o->ctx, 3 * sizeof(int32_t));
  c.roff = o->alloc(o->ctx, sizeof roff), c.rex = o->alloc(o->ctx, sizeof rex);
  c.rows = o->alloc(o->ctx, 16 * sizeof(float)), c.y = o->alloc(o->ctx, 8 * sizeof(float));
  o->to_device(o->ctx, c.off, off, sizeof off);
  o->to_device(o->ctx, c.idx, idx, 3 * sizeof(int32_t));
  o->to_device(o->ctx, c.roff, roff, sizeof roff);
  o->to_device(o->ctx, c.rex, rex, sizeof rex);
  return c;
}

static void emu_good(ps_ops *o) {
  const int32_t idx[3] = {0, 1, 1};
  emu_case c = emu_case_make(o, idx);
  o->embedding_bag_forward(o->ctx, 2, 4, c.off, c.idx, 1, c.rows, c.y);
  o->embedding_bag_backward(o->ctx, 2, 4, c.off, 2, c.roff, c.rex, 1, c.y, c.rows);
}

static void emu_idx_past_rows(ps_ops *o) {
  const int32_t idx[3] = {0, 4, 1}; /* row 4: rows holds 4 of dim 4 */
  emu_case c = emu_case_make(o, idx);
  o->embedding_bag_forward(o->ctx, 2, 4, c.off, c.idx, 0, c.rows, c.y);
}

static void emu_rev_past_examples(ps_ops *o) {
  const int32_t idx[3] = {0, 1, 1}, rex[3] = {0, 0, 2}; /* example 2 of 2 */
  emu_case c = emu_case_make(o, idx);
  o->to_device(o->ctx, c.rex, rex, sizeof rex);
  o->embedding_bag_backward(o->ctx, 2, 4, c.off, 2, c.roff, c.rex, 0, c.y, c.rows);
}

static void emu_offsets_decreasing(ps_ops *o) {
  const int32_t idx[3] = {0, 1, 1}, off[3] = {0, 2, 1};
  emu_case c = emu_case_make(o, idx);
  o->to_device(o->ctx, c.off, off, sizeof off);
  o->embedding_bag_forward(o->ctx, 2, 4, c.off, c.idx, 0, c.rows, c.y);
}

static void emu_short_output(ps_ops *o) {
  const int32_t idx[3] = {0, 1, 1};
  emu_case c = emu_case_make(o, idx);
  o->embedding_bag_forward(o->ctx, 2, 5, c.off, c.idx, 0, c.rows, c.y); /* y: 10 floats of 8 */
}

static void emu_host_pointer(ps_ops *o) {
  float host[4] = {0}, probs[4];
  double st[2];
  o->sigmoid_xent_forward(o->ctx, 4, host, host, probs, st);
}

static void test_emu_faults(void) {
  ps_ops *emu = ps_ops_emu_create(1);
  CHECK(emu != NULL);
  if (!emu) return;
  CHECK_MSG(!aborts(emu_good, emu), "the emu device aborted a good call");
  CHECK_MSG(aborts(emu_idx_past_rows, emu), "an idx past the rows did not abort");
  CHECK_MSG(aborts(emu_rev_past_examples, emu), "a reverse entry past the examples did not abort");
  CHECK_MSG(aborts(emu_offsets_decreasing, emu), "decreasing offsets did not abort");
  CHECK_MSG(aborts(emu_short_output, emu), "a short output did not abort");
  CHECK_MSG(aborts(emu_host_pointer, emu), "host pointers did not abort");
  emu->destroy(emu);
}

/* The ops recorded into a graph (graph_begin .. graph_end) run nothing;
 * the launch, after new rows and dy are copied in, gives what running
 * them plainly on those inputs gives. */
static void test_emu_graph(void) {
  ops = ps_ops_emu_create(1);
  CHECK(ops != NULL);
  if (!ops) return;
  enum { N = 40, DIM = 6 };
  batch b = batch_random(N, 5, 30);
  ps_emb_plan p = PS_EMB_PLAN_INIT;
  char err[PS_ERRLEN] = "";
  CHECK(ps_emb_plan_build(&p, b.ids, b.offsets, N, err) == 0);
  const size_t nr = (size_t)p.u * DIM, ny = (size_t)N * DIM;
  int32_t *d_off = dev_put(b.offsets, (N + 1) * sizeof(int32_t));
  int32_t *d_idx = dev_put(p.idx, (size_t)p.total * sizeof(int32_t));
  int32_t *d_roff = dev_put(p.rev_off, ((size_t)p.u + 1) * sizeof(int32_t));
  int32_t *d_rex = dev_put(p.rev_ex, (size_t)p.total * sizeof(int32_t));
  float *d_rows = dev_nans(nr), *d_dy = dev_nans(ny), *d_y = dev_nans(ny), *d_dr = dev_nans(nr);
  float *d_cat = dev_nans(2 * ny), *d_p = dev_nans(N), *d_g = dev_nans(N);
  double *d_st = dev_put((double[2]){0, 0}, 2 * sizeof(double));

  CHECK(ops->graph_begin(ops->ctx) == 0);
  ops->embedding_bag_forward(ops->ctx, N, DIM, d_off, d_idx, 1, d_rows, d_y);
  ops->copy_cols(ops->ctx, N, DIM, d_y, DIM, d_cat + DIM, 2 * DIM);
  ops->embedding_bag_backward(ops->ctx, N, DIM, d_off, p.u, d_roff, d_rex, 1, d_dy, d_dr);
  ops->sigmoid_xent_forward(ops->ctx, N, d_y, d_dy, d_p, d_st);
  ops->sigmoid_xent_backward(ops->ctx, N, d_p, d_dy, d_g);
  CHECK(ops->graph_end(ops->ctx) == 0);
  float *y0 = dev_fetch(d_y, ny * sizeof(float));
  CHECK_MSG(isnan(y0[0]), "a recorded op ran");

  float *rows = uniform_floats(nr, -1, 1), *dy = uniform_floats(ny, 0, 1);
  ops->to_device(ops->ctx, d_rows, rows, nr * sizeof(float));
  ops->to_device(ops->ctx, d_dy, dy, ny * sizeof(float));
  CHECK(ops->graph_launch(ops->ctx) == 0);
  float *y = dev_fetch(d_y, ny * sizeof(float)), *dr = dev_fetch(d_dr, nr * sizeof(float));
  float *cat = dev_fetch(d_cat, 2 * ny * sizeof(float)), *g = dev_fetch(d_g, N * sizeof(float));
  float *y_want = xmalloc(ny * sizeof(float)), *dr_want = xmalloc(nr * sizeof(float));
  ref_bag_forward(N, DIM, b.offsets, p.idx, 1, rows, y_want);
  ref_bag_backward(N, DIM, b.offsets, p.idx, p.u, 1, dy, dr_want);
  check_bits("graph: embedding_bag_forward", y, y_want, ny);
  check_bits("graph: embedding_bag_backward", dr, dr_want, nr);
  int placed = 1;
  for (int i = 0; i < N; i++)
    placed &=
        memcmp(cat + (size_t)i * 2 * DIM + DIM, y + (size_t)i * DIM, DIM * sizeof(float)) == 0;
  CHECK_MSG(placed, "graph: copy_cols");
  float probs[N], labels[N], g_want[N];
  double st[2];
  memcpy(labels, dy, sizeof labels); /* the recorded labels: dy's first N floats */
  ps_sigmoid_xent_host_forward(N, y, labels, probs, st);
  ps_sigmoid_xent_host_backward(N, probs, labels, g_want);
  check_bits("graph: sigmoid_xent_backward", g, g_want, N);

  free(y0), free(rows), free(dy), free(y), free(dr), free(cat), free(g), free(y_want),
      free(dr_want);
  dev_free(d_off), dev_free(d_idx), dev_free(d_roff), dev_free(d_rex), dev_free(d_rows);
  dev_free(d_dy), dev_free(d_y), dev_free(d_dr), dev_free(d_cat), dev_free(d_p), dev_free(d_g);
  dev_free(d_st);
  ps_emb_plan_free(&p);
  batch_free(&b);
  ops->destroy(ops);
  ops = NULL;
}

/* ---- the backends ---- */

static void run_backend(ps_ops *o, const char *label) {
  CHECK_MSG(o != NULL, "cannot create the %s backend", label);
  if (!o) return;
  ops = o;
  fprintf(stderr, "-- %s\n", label);
  CHECK(ops->embedding_bag_forward && ops->embedding_bag_backward && ops->copy_cols &&
        ops->sigmoid_xent_forward && ops->sigmoid_xent_backward);
  RUN(test_bag_ops);
  RUN(test_copy_cols);
  RUN(test_sigmoid_values);
  RUN(test_sigmoid_gradcheck);
  RUN(test_model_gradcheck);
  if (strcmp(o->name, "emu") == 0) {
    ps_emu_counts counts;
    ps_ops_emu_counts(o, &counts);
    CHECK_MSG(counts.blocks == 0, "%d device blocks not freed", counts.blocks);
  }
  o->destroy(o);
  ops = NULL;
}

int main(void) {
  RUN(test_plan_hand);
  RUN(test_plan_high_bits);
  RUN(test_plan_grow_and_reuse);
  RUN(test_plan_errors);
  /* threads = 0 first: a backend with threads sets OpenBLAS to one thread
   * for the rest of the process. */
  run_backend(ps_ops_cpu_create(0), "cpu backend, threads = 0");
  run_backend(ps_ops_emu_create(0), "emulated device (cpu ops, device memory checked)");
  run_backend(ps_ops_cpu_create(3), "cpu backend, threads = 3");
#ifdef PS_HAVE_DNNL
  run_backend(ps_ops_dnnl_create(2), "oneDNN backend, threads = 2");
#endif
  RUN(test_emu_graph);
  RUN(test_emu_faults);
  return check_summary();
}

/* ROC AUC and log-loss (see auc.h). */
#include "common/auc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* A float's bits turned into an unsigned integer of the same order
 * (negative floats reversed below the positive ones); -0 counts as +0. */
static uint32_t auc__order_bits(float x) {
  if (x == 0.0f) x = 0.0f;
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static int auc__cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* The AUC from counts of positives and negatives per score group, walked
 * in ascending score order: each positive beats the negatives below its
 * group and ties half of those in it. */
typedef struct {
  double wins;        /* positive-negative pairs ranked right, ties half */
  uint64_t neg_below; /* negatives in the groups walked */
} auc__walk;

static void auc__group(auc__walk *w, uint64_t pos, uint64_t neg) {
  w->wins += (double)pos * ((double)w->neg_below + 0.5 * (double)neg);
  w->neg_below += neg;
}

double ps_auc(const float *scores, const float *labels, size_t n) {
  if (n == 0) return NAN;
  uint64_t *keys = malloc(n * sizeof *keys);
  if (!keys) return NAN;
  uint64_t n_pos = 0;
  for (size_t i = 0; i < n; i++) {
    if (isnan(scores[i])) {
      free(keys);
      return NAN;
    }
    uint64_t pos = labels[i] > 0.5f;
    n_pos += pos;
    /* the score's order in the high half, the label in the lowest bit */
    keys[i] = (uint64_t)auc__order_bits(scores[i]) << 32 | pos;
  }
  uint64_t n_neg = n - n_pos;
  if (n_pos == 0 || n_neg == 0) {
    free(keys);
    return NAN;
  }
  qsort(keys, n, sizeof *keys, auc__cmp_u64);
  auc__walk w = {0};
  for (size_t i = 0; i < n;) {
    uint64_t group = keys[i] >> 32, pos = 0, neg = 0;
    for (; i < n && keys[i] >> 32 == group; i++) {
      if (keys[i] & 1)
        pos++;
      else
        neg++;
    }
    auc__group(&w, pos, neg);
  }
  free(keys);
  return w.wins / ((double)n_pos * (double)n_neg);
}

double ps_logloss(const float *probs, const float *labels, size_t n) {
  if (n == 0) return NAN;
  const double lo = 1e-7, hi = 1.0 - 1e-7;
  double sum = 0.0;
  for (size_t i = 0; i < n; i++) {
    double p = probs[i], y = labels[i];
    if (isnan(p)) return NAN;
    p = p < lo ? lo : p > hi ? hi : p;
    sum -= y * log(p) + (1.0 - y) * log(1.0 - p);
  }
  return sum / (double)n;
}

/* ---- streaming AUC ---- */

/* Bins: the float's bits without their 10 lowest (of 23 mantissa bits),
 * for [0, 1]: 0x3f800000 >> 10 is the bin of 1.0. */
#define AUC_HIST_SHIFT 10
#define AUC_HIST_BINS ((0x3f800000u >> AUC_HIST_SHIFT) + 1)

int ps_auc_hist_init(ps_auc_hist *h, char *err) {
  memset(h, 0, sizeof *h);
  h->pos = calloc(AUC_HIST_BINS, sizeof *h->pos);
  h->neg = calloc(AUC_HIST_BINS, sizeof *h->neg);
  if (!h->pos || !h->neg) {
    ps_auc_hist_free(h);
    return ps_seterr(err, PS_ENOMEM, "out of memory for the AUC histogram (%zu bytes)",
                     (size_t)AUC_HIST_BINS * 2 * sizeof(uint64_t));
  }
  h->bins = AUC_HIST_BINS;
  return PS_OK;
}

void ps_auc_hist_add(ps_auc_hist *h, const float *probs, const float *labels, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float p = probs[i];
    if (!(p > 0.0f)) p = 0.0f; /* NaN, -0 and below 0 */
    if (p > 1.0f) p = 1.0f;
    uint32_t u;
    memcpy(&u, &p, sizeof u);
    size_t bin = u >> AUC_HIST_SHIFT;
    if (labels[i] > 0.5f) {
      h->pos[bin]++;
      h->n_pos++;
    } else {
      h->neg[bin]++;
      h->n_neg++;
    }
  }
}

double ps_auc_hist_value(const ps_auc_hist *h) {
  if (h->n_pos == 0 || h->n_neg == 0) return NAN;
  auc__walk w = {0};
  for (size_t b = 0; b < h->bins; b++)
    if (h->pos[b] || h->neg[b]) auc__group(&w, h->pos[b], h->neg[b]);
  return w.wins / ((double)h->n_pos * (double)h->n_neg);
}

void ps_auc_hist_free(ps_auc_hist *h) {
  free(h->pos);
  free(h->neg);
  memset(h, 0, sizeof *h);
}

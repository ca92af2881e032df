/* Ranking and calibration metrics of a binary classifier (click models):
 * the ROC AUC and the log-loss, over arrays, and a streaming AUC over
 * probabilities that holds a fixed-size histogram instead of the scores.
 *
 * A label counts as positive when it is > 0.5 (labels are 0 or 1). */
#ifndef PS_COMMON_AUC_H
#define PS_COMMON_AUC_H

#include <stddef.h>
#include <stdint.h>

/* The area under the ROC curve of scores against labels: the probability
 * that a random positive scores above a random negative, a tie counting
 * one half. Sorts a copy, O(n log n). Returns NaN when one class is absent,
 * when a score is NaN, or when the copy cannot be allocated (never
 * crashes). */
double ps_auc(const float *scores, const float *labels, size_t n);

/* The mean of -(y log p + (1 - y) log(1 - p)), with each probability p
 * clamped to [1e-7, 1 - 1e-7] (so one confident miss costs about 16, not
 * infinity); labels may be fractional. NaN when n is 0 or a p is NaN. No
 * allocation. */
double ps_logloss(const float *probs, const float *labels, size_t n);

/* A streaming AUC: each probability (clamped to [0, 1], NaN taken as 0)
 * falls in a bin by the top bits of its float32 (the bins are about 1.2e-4
 * of the value wide, finer near 0), positives and negatives counted per
 * bin; scores in one bin count as tied. Against ps_auc the AUC differs by
 * less than half the share of pairs that share a bin (below 1e-4 for
 * spread probabilities). 16 MiB of counts. */
typedef struct {
  uint64_t *pos, *neg; /* (bins) */
  size_t bins;
  uint64_t n_pos, n_neg;
} ps_auc_hist;

/* 0, or PS_ENOMEM (with a message; *h left zeroed). */
int ps_auc_hist_init(ps_auc_hist *h, char *err);
void ps_auc_hist_add(ps_auc_hist *h, const float *probs, const float *labels, size_t n);
/* NaN when one class is absent. */
double ps_auc_hist_value(const ps_auc_hist *h);
void ps_auc_hist_free(ps_auc_hist *h);

#endif

/* Click-through-rate (CTR) data for embedding-table models: Criteo's TSV
 * click logs, and synthetic click logs whose ground truth is known.
 *
 * Criteo TSV (the Kaggle Display Advertising Challenge's train.txt and the
 * Criteo 1TB day_N files): one example per line, fields separated by TAB:
 *
 *   label  I1 .. I13  C1 .. C26
 *
 * label "0" or "1"; I1..I13 decimal integers (a leading '-' allowed, at most
 * 18 digits), empty when missing; C1..C26 1 to 8 hex digits (Criteo writes
 * 8 lowercase ones), empty when missing. Lines end in LF or CRLF; the last
 * one may lack its line end. Files may be gzip-compressed (detected from
 * the content, not the name). Criteo's unlabeled test files are not read.
 *
 * As held here:
 *   - dense value: the signed logarithm of the integer x,
 *       x >= 0: log(1 + x),   x < 0: -log(1 - x)
 *     computed in double and rounded to float (ps_ctr_dense_value); a
 *     missing value is 0, as x = 0 is. (Criteo's I2 holds -1 .. -3; the
 *     usual recipe of DLRM clamps those to 0 first; this keeps them apart.)
 *   - categorical value: ps_ctr_feature_id(field, value) of the value with
 *     its hex letters lowercased, a 64-bit hash of (field, bytes), never 0;
 *     a missing value is the empty string of its field, so each field has
 *     its own "missing" id. Ids are meant for an unbounded embedding table
 *     (common/emb.h, rows = 0); a bounded one takes them modulo its rows.
 *
 * A line may carry one more field after C26: the example's ground-truth
 * click probability (a decimal in [0, 1], as ps-ctr-gen --truth writes);
 * then every line of the file must, and it lands in `truth`.
 *
 * Synthetic click logs (ps_ctr_synthetic): example i is a pure function of
 * (cfg, i), so workers generate disjoint slices and a test split [a, b)
 * reproducibly. Per categorical field f a value rank r in [0, vocab) is
 * drawn from Zipf(zipf_s) (P(r) proportional to 1/(r+1)^s; rejection-
 * inversion sampling: O(1), no tables); the value string is the 8 lowercase
 * hex digits of a 32-bit hash of (seed, f, r) (so two ranks of a field
 * share a string now and then: about one pair per field at vocab 100000),
 * and its id is ps_ctr_feature_id of that string. Dense feature j is a
 * lognormal count c = min(floor(exp(m_j + 1.5 z)), PS_CTR_SYNTH_MAX_COUNT),
 * z roughly normal, m_j in [0, 3) from the seed, held as
 * ps_ctr_dense_value(c), as the reader would. The hidden model is a
 * factorization machine: each id has a weight w = weight_scale * n and k
 * factors v = factor_scale * (n_1 .. n_k), n roughly standard normal (a
 * hash of (seed, id)), and
 *
 *   logit = bias + sum_f w'_f + sum_{f<g} <v'_f, v'_g>
 *                + sum_j u_j (dense_j - m_j),      u_j = dense_scale * n
 *   truth = sigmoid(logit),   label = 1 when uniform(seed, i) < truth,
 *
 * where w'_f = w_f - mean_f(w) and v'_f = v_f - mean_f(v): a field's mean
 * over its 2048 most frequent values, weighted by their frequencies.
 * Without it the few hot values of each field (rank 0 alone is 8% of a
 * field at the defaults) shift every example's logit by an amount that
 * depends on the seed, and the click rate with it.
 *
 * With the defaults (13 dense and 26 categorical fields, vocab 100000,
 * Zipf 1.05, k = 8, weight_scale 0.15, factor_scale 0.12, dense_scale
 * 0.15, bias -1.45), over the examples [0, 1000000):
 *
 *   seed   click rate   AUC of truth   log-loss of truth
 *   1      0.2836       0.7986         0.4717
 *   2      0.2168       0.7792         0.4313
 *   3      0.2276       0.7825         0.4394
 *   4      0.2158       0.7991         0.4157
 *   5      0.2232       0.7958         0.4253
 *
 * So a model can reach an AUC of about 0.78 to 0.80 on such data and no
 * more (Criteo's own click rate is about 0.26). The interactions matter:
 * the truth's logit without its pairwise term, what per-value weights
 * alone (a logistic regression) approach, scores an AUC of 0.745 at seed 1
 * (300000 examples). */
#ifndef PS_WORKER_DATA_CTR_H
#define PS_WORKER_DATA_CTR_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define PS_CTR_CRITEO_DENSE 13
#define PS_CTR_CRITEO_CAT 26
#define PS_CTR_MAX_FIELDS 1024 /* n_dense and n_cat each at most this */
/* The largest count the generator draws: below it, the float of a count
 * maps back to the count exactly (so written files reload to the same
 * floats, and ps_ctr_write_tsv can recover the integer). */
#define PS_CTR_SYNTH_MAX_COUNT 100000

typedef struct {
  int64_t n;          /* examples */
  int n_dense, n_cat; /* 13 and 26 for Criteo */
  float *dense;       /* (n, n_dense) ps_ctr_dense_value of the integers */
  uint64_t *ids;      /* (n, n_cat) ps_ctr_feature_id of each value, never 0 */
  float *labels;      /* (n) 0 or 1 */
  float *truth;       /* (n) the ground-truth click probability (synthetic
                       * data, or a file with a truth column), else NULL */
  uint32_t *values;   /* (n, n_cat) synthetic data only: the number whose 8
                       * lowercase hex digits are the value string (what
                       * ps_ctr_write_tsv writes); NULL for data read */
} ps_ctr_data;

/* Frees the arrays (malloc'd) and zeroes *d; d may be zeroed already. */
void ps_ctr_free(ps_ctr_data *d);

/* Reads a Criteo TSV file (plain or gzip) of 13 dense and 26 categorical
 * fields. max_rows > 0: stops after that many examples (what follows is not
 * read); otherwise reads every line. Memory grows with the examples kept
 * (264 bytes each for Criteo), not with the file. Returns 0, or
 * PS_EIO (cannot open or read), PS_EINVAL (malformed: the message names the
 * file, the line and the field; a file without examples too) or PS_ENOMEM;
 * on error *out is left zeroed. */
int ps_ctr_load_tsv(const char *path, int64_t max_rows, ps_ctr_data *out, char *err);

/* As ps_ctr_load_tsv, from len bytes of text in memory (no NUL needed);
 * name goes into messages. */
int ps_ctr_parse_tsv(const char *text, size_t len, const char *name, int64_t max_rows,
                     ps_ctr_data *out, char *err);

/* As the two above for lines of n_dense integer and n_cat categorical
 * fields (each 0 .. PS_CTR_MAX_FIELDS, not both 0), as ps_ctr_write_tsv
 * writes a synthetic set of another shape. */
int ps_ctr_load_tsv_shape(const char *path, int n_dense, int n_cat, int64_t max_rows,
                          ps_ctr_data *out, char *err);
int ps_ctr_parse_tsv_shape(const char *text, size_t len, const char *name, int n_dense, int n_cat,
                           int64_t max_rows, ps_ctr_data *out, char *err);

/* The id of a categorical value: a 64-bit hash of (field, the len bytes of
 * value), never 0; value "" (len 0) is the field's missing value. The bytes
 * are taken as they are (the reader lowercases hex letters first). */
uint64_t ps_ctr_feature_id(int field, const char *value, size_t len);

/* The dense value of integer x: log(1 + x) for x >= 0, -log(1 - x) below. */
float ps_ctr_dense_value(int64_t x);

typedef struct {
  int n_dense, n_cat; /* default 13, 26 */
  uint64_t vocab;     /* distinct values per categorical field, e.g. 100000 */
  double zipf_s;      /* Zipf exponent of value frequencies, e.g. 1.05 */
  int factors;        /* k of the hidden factorization model, e.g. 8 */
  double weight_scale, factor_scale, dense_scale, bias; /* sizes of the hidden model's terms */
  uint64_t seed;
} ps_ctr_synth_cfg;

/* Bounds ps_ctr_synthetic checks. */
#define PS_CTR_MAX_VOCAB (UINT64_C(1) << 40)
#define PS_CTR_MAX_ZIPF 20.0
#define PS_CTR_MAX_FACTORS 256

/* The defaults above (seed 1). */
void ps_ctr_synth_defaults(ps_ctr_synth_cfg *cfg);

/* Checks cfg: shape as for ps_ctr_parse_tsv_shape, vocab in
 * [1, PS_CTR_MAX_VOCAB], zipf_s in [0, PS_CTR_MAX_ZIPF], factors in
 * [1, PS_CTR_MAX_FACTORS], the scales finite and >= 0, bias finite.
 * 0 or PS_EINVAL with a message naming the field. */
int ps_ctr_synth_check(const ps_ctr_synth_cfg *cfg, char *err);

/* The examples [first, first + n) of cfg's click log (n >= 1, first >= 0,
 * first + n <= INT64_MAX), with truth and values. Returns 0, PS_EINVAL
 * (a bad cfg), PS_ERANGE (bad first or n) or PS_ENOMEM; on error *out is
 * left zeroed. About 4 s per million Criteo-shaped examples on one core
 * (a shared 2-core AMD EPYC), 40% of it the Zipf draws. */
int ps_ctr_synthetic(const ps_ctr_synth_cfg *cfg, int64_t first, int64_t n, ps_ctr_data *out,
                     char *err);

/* Part `part` of `parts` of those examples: first + part, first + part +
 * parts, ... below first + n (what a static share of rank `part` of
 * `parts` workers trains on), without the value strings (out->values
 * NULL: a training set needs the ids only; the writer refuses it). The
 * same examples, bit for bit, as ps_ctr_synthetic gives at those rows.
 * PS_ERANGE also for parts < 1, part outside [0, parts) or no example. */
int ps_ctr_synthetic_part(const ps_ctr_synth_cfg *cfg, int64_t first, int64_t n, int part,
                          int parts, ps_ctr_data *out, char *err);

/* Writes the rows [first_row, d->n) of d as Criteo TSV (0: the whole set),
 * so that ps_ctr_load_tsv(_shape) reads back the same ids, labels and dense
 * floats. d must carry its value strings (d->values: synthetic data) and
 * dense values that are ps_ctr_dense_value of integers of magnitude at most
 * PS_CTR_SYNTH_MAX_COUNT. Returns 0; PS_EINVAL when d is not such a set
 * (nothing written), PS_ERANGE for a first_row outside [0, n], PS_EIO when
 * writing fails (part of the rows may have been written). */
int ps_ctr_write_tsv(FILE *f, const ps_ctr_data *d, int64_t first_row, char *err);

/* As ps_ctr_write_tsv, for the rows [first_row, first_row + count); with
 * with_truth each line ends in a column of d->truth (%.9g, which reads back
 * to the same float; PS_EINVAL when d has no truth). */
int ps_ctr_write_tsv_rows(FILE *f, const ps_ctr_data *d, int64_t first_row, int64_t count,
                          int with_truth, char *err);

#endif

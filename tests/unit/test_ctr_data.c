/* Tests of the click-through data (worker/data/data_ctr.c) and the metrics of
 * common/auc.c: Criteo TSV lines valid and broken, the generator's
 * determinism, its Zipf frequencies and its ground truth, the round trip
 * synthetic -> TSV (plain and gzip) -> reader, and AUC by hand. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "common/auc.h"
#include "common/util.h"
#include "tests/unit/check.h"
#include "tests/unit/tmp_tree.h"
#include "worker/data/data_ctr.h"

static char tmpdir[64];

static const char *tmp_path(char *buf, const char *name) {
  snprintf(buf, PATH_MAX, "%s/%s", tmpdir, name);
  return buf;
}

static int is_zeroed(const ps_ctr_data *d) {
  return d->n == 0 && d->n_dense == 0 && d->n_cat == 0 && !d->dense && !d->ids && !d->labels &&
         !d->truth && !d->values;
}

/* A Criteo line: label, 13 dense fields, 26 categorical ones; dense[j] and
 * cat[f] NULL give the fields below (j, and 8 hex digits from f). */
static void criteo_line(char *buf, size_t cap, const char *label, const char *const *dense,
                        const char *const *cat) {
  size_t n = (size_t)snprintf(buf, cap, "%s", label);
  for (int j = 0; j < 13; j++) {
    if (dense && dense[j])
      n += (size_t)snprintf(buf + n, cap - n, "\t%s", dense[j]);
    else
      n += (size_t)snprintf(buf + n, cap - n, "\t%d", j);
  }
  for (int f = 0; f < 26; f++) {
    if (cat && cat[f])
      n += (size_t)snprintf(buf + n, cap - n, "\t%s", cat[f]);
    else
      n += (size_t)snprintf(buf + n, cap - n, "\t%08x", 0x1000u * (unsigned)f + 0xabcu);
  }
}

static int same_data(const ps_ctr_data *a, const ps_ctr_data *b, int64_t a0, int64_t b0,
                     int64_t n) {
  if (a->n_dense != b->n_dense || a->n_cat != b->n_cat) return 0;
  for (int64_t i = 0; i < n; i++) {
    if (a->labels[a0 + i] != b->labels[b0 + i]) return 0;
    if (memcmp(a->dense + (a0 + i) * a->n_dense, b->dense + (b0 + i) * b->n_dense,
               sizeof(float) * (size_t)a->n_dense) != 0)
      return 0;
    if (memcmp(a->ids + (a0 + i) * a->n_cat, b->ids + (b0 + i) * b->n_cat,
               sizeof(uint64_t) * (size_t)a->n_cat) != 0)
      return 0;
    if (a->truth && b->truth && a->truth[a0 + i] != b->truth[b0 + i]) return 0;
  }
  return 1;
}

/* ---- the reader ---- */

static void test_parse_valid(void) {
  char l1[1024], l2[1024], l3[1024], text[4096];
  criteo_line(l1, sizeof l1, "1", NULL, NULL);
  /* missing dense (I1, I13) and categorical (C1, C26) values, a negative
   * count, hex in capitals and a value shorter than 8 digits */
  const char *dense2[13] = {"",   "-2", NULL, "0",  NULL, NULL, NULL,
                            NULL, NULL, NULL, NULL, NULL, ""};
  const char *cat2[26] = {"", "ABCDEF01", "7"};
  cat2[25] = "";
  criteo_line(l2, sizeof l2, "0", dense2, cat2);
  criteo_line(l3, sizeof l3, "1", NULL, NULL);
  /* CRLF on the first line, LF on the second, none on the last */
  snprintf(text, sizeof text, "%s\r\n%s\n%s", l1, l2, l3);
  ps_ctr_data d;
  char err[PS_ERRLEN] = "";
  int rc = ps_ctr_parse_tsv(text, strlen(text), "t.tsv", 0, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc != 0) return;
  CHECK(d.n == 3 && d.n_dense == 13 && d.n_cat == 26 && !d.truth && !d.values);
  CHECK(d.labels[0] == 1.0f && d.labels[1] == 0.0f && d.labels[2] == 1.0f);
  CHECK(d.dense[0] == 0.0f);                    /* I1 = 0 */
  CHECK(d.dense[5] == (float)log1p(5.0));       /* I6 = 5 */
  CHECK(d.dense[13 + 0] == 0.0f);               /* missing */
  CHECK(d.dense[13 + 1] == (float)-log1p(2.0)); /* -2 */
  CHECK(d.dense[13 + 12] == 0.0f);
  CHECK(d.dense[13 + 2] == ps_ctr_dense_value(2));
  char hex[9];
  for (int f = 0; f < 26; f++) {
    snprintf(hex, sizeof hex, "%08x", 0x1000u * (unsigned)f + 0xabcu);
    CHECK(d.ids[f] == ps_ctr_feature_id(f, hex, 8));
    CHECK(d.ids[2 * 26 + f] == d.ids[f]); /* the same values, the same ids */
  }
  CHECK(d.ids[26 + 0] == ps_ctr_feature_id(0, "", 0));
  CHECK(d.ids[26 + 25] == ps_ctr_feature_id(25, "", 0));
  CHECK(d.ids[26 + 0] != d.ids[26 + 25]); /* each field its own missing id */
  CHECK(d.ids[26 + 1] == ps_ctr_feature_id(1, "abcdef01", 8));
  CHECK(d.ids[26 + 2] == ps_ctr_feature_id(2, "7", 1));
  ps_ctr_free(&d);
  CHECK(is_zeroed(&d));

  /* a line as Criteo's train.txt has them: I12 and C22 missing */
  const char *criteo =
      "0\t1\t1\t5\t0\t1382\t4\t15\t2\t181\t1\t2\t\t2\t68fd1e64\t80e26c9b\tfb936136\t"
      "7b4723c4\t25c83c98\t7e0ccccf\tde7995b8\t1f89b562\ta73ee510\ta8cd5504\tb2cb9c98\t"
      "37c9c164\t2824a5f6\t1adce6ef\t8ba8b39a\t891b62e7\te5ba7672\tf54016b9\t21ddcdc9\t"
      "b1252a9d\t07b5194c\t\t3a171ecb\tc5c50484\te8b83407\t9727dd16\n";
  rc = ps_ctr_parse_tsv(criteo, strlen(criteo), "train.txt", 0, &d, err);
  CHECK_MSG(rc == 0 && d.n == 1, "%s", err);
  if (rc == 0) {
    CHECK(d.labels[0] == 0.0f && d.dense[4] == (float)log1p(1382.0) && d.dense[11] == 0.0f);
    CHECK(d.ids[0] == ps_ctr_feature_id(0, "68fd1e64", 8));
    CHECK(d.ids[21] == ps_ctr_feature_id(21, "", 0));
    CHECK(d.ids[25] == ps_ctr_feature_id(25, "9727dd16", 8));
  }
  ps_ctr_free(&d);

  /* max_rows: the first two only; a broken third line is not looked at */
  snprintf(text, sizeof text, "%s\n%s\nnot a line\n", l1, l2);
  rc = ps_ctr_parse_tsv(text, strlen(text), "t.tsv", 2, &d, err);
  CHECK_MSG(rc == 0 && d.n == 2, "%s", err);
  ps_ctr_free(&d);
  rc = ps_ctr_parse_tsv(text, strlen(text), "t.tsv", 0, &d, err);
  CHECK(rc == PS_EINVAL && strstr(err, "line 3") && is_zeroed(&d));
}

static void test_feature_ids(void) {
  /* distinct per field and value; "" and "0" differ; never 0 */
  uint64_t a = ps_ctr_feature_id(0, "", 0), b = ps_ctr_feature_id(0, "0", 1),
           c = ps_ctr_feature_id(1, "0", 1), e = ps_ctr_feature_id(0, "00", 2);
  CHECK(a != b && b != c && b != e && a != 0 && b != 0 && c != 0);
  CHECK(ps_ctr_feature_id(3, "deadbeef", 8) == ps_ctr_feature_id(3, "deadbeef", 8));
  CHECK(ps_ctr_feature_id(3, "deadbeef", 8) != ps_ctr_feature_id(4, "deadbeef", 8));
  /* 200000 values of one field: no collision (ids of one field and length
   * up to 8 bytes are a bijection of the value) */
  size_t n = 200000;
  uint64_t *ids = malloc(n * sizeof *ids);
  CHECK(ids != NULL);
  if (!ids) return;
  char hex[9];
  for (size_t i = 0; i < n; i++) {
    snprintf(hex, sizeof hex, "%08zx", i * 2654435761u % 0xffffffffu);
    ids[i] = ps_ctr_feature_id(7, hex, 8);
  }
  int zero = 0;
  for (size_t i = 0; i < n; i++) zero += ids[i] == 0;
  CHECK(zero == 0);
  /* bits look random: each of the 64 bits set in about half */
  int bad_bits = 0;
  for (int bit = 0; bit < 64; bit++) {
    size_t ones = 0;
    for (size_t i = 0; i < n; i++) ones += (ids[i] >> bit) & 1;
    if (fabs((double)ones / (double)n - 0.5) > 0.01) bad_bits++;
  }
  CHECK(bad_bits == 0);
  free(ids);
  /* the dense transform */
  CHECK(ps_ctr_dense_value(0) == 0.0f);
  CHECK(ps_ctr_dense_value(1) == (float)log(2.0));
  CHECK(ps_ctr_dense_value(-1) == -(float)log(2.0));
  CHECK(isfinite(ps_ctr_dense_value(INT64_MIN)) && isfinite(ps_ctr_dense_value(INT64_MAX)));
}

/* Each kind of broken input: refused, the message names the file and the
 * line (and what is wrong), *out zeroed. */
static void test_bad_input(void) {
  char good[1024], text[8192];
  criteo_line(good, sizeof good, "0", NULL, NULL);
  const char *d_frac[13] = {"1.5"}, *d_word[13] = {NULL, "abc"}, *d_minus[13] = {"-"},
             *d_long[13] = {"1234567890123456789"}, *d_plus[13] = {"+3"};
  const char *c_long[26] = {"123456789"}, *c_nonhex[26] = {NULL, "xyz"}, *c_space[26] = {"ab cd"};
  struct {
    const char *what;
    char line[2048];
    const char *want; /* in the message */
  } cases[16];
  int nc = 0;
#define CASE(w, msg) (cases[nc].what = (w), cases[nc].want = (msg), cases[nc++].line)
  criteo_line(CASE("label 2", "label"), 2048, "2", NULL, NULL);
  criteo_line(CASE("empty label", "label"), 2048, "", NULL, NULL);
  criteo_line(CASE("fractional dense", "I1"), 2048, "1", d_frac, NULL);
  criteo_line(CASE("word dense", "I2"), 2048, "1", d_word, NULL);
  criteo_line(CASE("lone minus", "I1"), 2048, "1", d_minus, NULL);
  criteo_line(CASE("19 digits", "I1"), 2048, "1", d_long, NULL);
  criteo_line(CASE("plus sign", "I1"), 2048, "1", d_plus, NULL);
  criteo_line(CASE("9 hex digits", "C1"), 2048, "1", NULL, c_long);
  criteo_line(CASE("not hex", "C2"), 2048, "1", NULL, c_nonhex);
  criteo_line(CASE("space in hex", "C1"), 2048, "1", NULL, c_space);
  /* 39 fields: the last categorical field cut off */
  criteo_line(CASE("39 fields", "39 fields; wants 40"), 2048, "1", NULL, NULL);
  *strrchr(cases[nc - 1].line, '\t') = '\0';
  /* 41 fields where line 1 has 40 */
  criteo_line(CASE("41 fields", "41 fields"), 2048, "1", NULL, NULL);
  strcat(cases[nc - 1].line, "\t0.5");
  snprintf(CASE("empty line", "1 fields"), 2048, "%s", "");
  snprintf(CASE("overlong line", "longer"), 2048, "%s", "");
  memset(cases[nc - 1].line, '1', 1500);
  cases[nc - 1].line[1500] = '\0';
#undef CASE
  for (int c = 0; c < nc; c++) {
    /* the bad line is line 2, after a good one, and a good one follows */
    snprintf(text, sizeof text, "%s\n%s\n%s\n", good, cases[c].line, good);
    ps_ctr_data d;
    memset(&d, 0xff, sizeof d); /* the reader must zero it */
    char err[PS_ERRLEN] = "";
    int rc = ps_ctr_parse_tsv(text, strlen(text), "bad.tsv", 0, &d, err);
    CHECK_MSG(rc == PS_EINVAL, "%s: rc %d", cases[c].what, rc);
    CHECK_MSG(strstr(err, "'bad.tsv' line 2") && strstr(err, cases[c].want), "%s: '%s'",
              cases[c].what, err);
    CHECK_MSG(is_zeroed(&d), "%s: out not zeroed", cases[c].what);
  }

  /* a truth column: on every line, or refused; its value in [0, 1] */
  snprintf(text, sizeof text, "%s\t0.25\n%s\t1\n", good, good);
  ps_ctr_data d;
  char err[PS_ERRLEN] = "";
  int rc = ps_ctr_parse_tsv(text, strlen(text), "t.tsv", 0, &d, err);
  CHECK_MSG(rc == 0 && d.n == 2 && d.truth && d.truth[0] == 0.25f && d.truth[1] == 1.0f, "%s", err);
  ps_ctr_free(&d);
  snprintf(text, sizeof text, "%s\t0.25\n%s\n", good, good);
  rc = ps_ctr_parse_tsv(text, strlen(text), "t.tsv", 0, &d, err);
  CHECK(rc == PS_EINVAL && strstr(err, "line 2") && strstr(err, "truth") && is_zeroed(&d));
  snprintf(text, sizeof text, "%s\t1.5\n", good);
  rc = ps_ctr_parse_tsv(text, strlen(text), "t.tsv", 0, &d, err);
  CHECK(rc == PS_EINVAL && strstr(err, "line 1") && strstr(err, "probability") && is_zeroed(&d));

  /* no examples at all */
  rc = ps_ctr_parse_tsv("", 0, "empty.tsv", 0, &d, err);
  CHECK(rc == PS_EINVAL && strstr(err, "empty.tsv") && is_zeroed(&d));
  /* a bad shape */
  rc = ps_ctr_parse_tsv_shape(good, strlen(good), "t.tsv", 0, 0, 0, &d, err);
  CHECK(rc == PS_EINVAL && is_zeroed(&d));
  /* a file that is not there */
  rc = ps_ctr_load_tsv("/nonexistent/criteo.tsv", 0, &d, err);
  CHECK(rc == PS_EIO && strstr(err, "/nonexistent/criteo.tsv") && is_zeroed(&d));
}

/* ---- the generator ---- */

static void test_determinism(void) {
  ps_ctr_synth_cfg cfg;
  ps_ctr_synth_defaults(&cfg);
  ps_ctr_data all, part, again, other;
  char err[PS_ERRLEN] = "";
  int rc = ps_ctr_synthetic(&cfg, 0, 1000, &all, err);
  CHECK_MSG(rc == 0, "%s", err);
  rc |= ps_ctr_synthetic(&cfg, 300, 400, &part, err);
  rc |= ps_ctr_synthetic(&cfg, 0, 1000, &again, err);
  cfg.seed = 2;
  rc |= ps_ctr_synthetic(&cfg, 0, 1000, &other, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc == 0) {
    CHECK(all.n == 1000 && all.truth && all.values);
    CHECK(same_data(&all, &again, 0, 0, 1000));
    CHECK(memcmp(all.values, again.values, 1000 * 26 * sizeof(uint32_t)) == 0);
    CHECK(same_data(&all, &part, 300, 0, 400)); /* the slice [300, 700) */
    CHECK(!same_data(&all, &other, 0, 0, 1));   /* another seed, another log */
    int zero = 0, labels_ok = 1;
    for (int64_t i = 0; i < all.n * all.n_cat; i++) zero += all.ids[i] == 0;
    for (int64_t i = 0; i < all.n; i++)
      labels_ok &= (all.labels[i] == 0.0f || all.labels[i] == 1.0f) && all.truth[i] > 0.0f &&
                   all.truth[i] < 1.0f;
    CHECK(zero == 0 && labels_ok);
  }
  /* A worker's share: rows 2, 5, 8, ... of [0, 1000) for part 2 of 3,
   * the same examples bit for bit, without the value strings. */
  ps_ctr_data share;
  cfg.seed = 1;
  rc = ps_ctr_synthetic_part(&cfg, 0, 1000, 2, 3, &share, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc == 0) {
    CHECK(share.n == 333 && !share.values);
    int same = 1;
    for (int64_t k = 0; k < share.n; k++) same &= same_data(&all, &share, 2 + 3 * k, k, 1);
    CHECK_MSG(same, "a part's examples differ from the whole log's");
    ps_ctr_data d1;
    CHECK(ps_ctr_synthetic_part(&cfg, 0, 1000, 0, 1, &d1, err) == 0 && same_data(&all, &d1, 0, 0, 1000));
    ps_ctr_free(&d1);
    /* the writer needs the value strings */
    FILE *f = tmpfile();
    CHECK(f && ps_ctr_write_tsv(f, &share, 0, err) == PS_EINVAL);
    if (f) fclose(f);
  }
  ps_ctr_free(&share);
  ps_ctr_data none;
  CHECK(ps_ctr_synthetic_part(&cfg, 0, 1000, 3, 3, &none, err) == PS_ERANGE && is_zeroed(&none));
  CHECK(ps_ctr_synthetic_part(&cfg, 0, 2, 2, 3, &none, err) == PS_ERANGE && is_zeroed(&none));
  CHECK(ps_ctr_synthetic_part(&cfg, 0, 10, 0, 0, &none, err) == PS_ERANGE && is_zeroed(&none));
  ps_ctr_free(&all);
  ps_ctr_free(&part);
  ps_ctr_free(&again);
  ps_ctr_free(&other);

  /* refused: bad configurations and ranges, *out zeroed */
  ps_ctr_synth_defaults(&cfg);
  ps_ctr_data d;
  CHECK(ps_ctr_synthetic(&cfg, 0, 0, &d, err) == PS_ERANGE && is_zeroed(&d));
  CHECK(ps_ctr_synthetic(&cfg, -1, 5, &d, err) == PS_ERANGE && is_zeroed(&d));
  CHECK(ps_ctr_synthetic(&cfg, INT64_MAX, 2, &d, err) == PS_ERANGE && is_zeroed(&d));
  /* more than memory can hold: refused before allocating */
  CHECK(ps_ctr_synthetic(&cfg, 0, INT64_C(100000000000000000), &d, err) == PS_ENOMEM &&
        is_zeroed(&d));
  cfg.vocab = 0;
  CHECK(ps_ctr_synthetic(&cfg, 0, 5, &d, err) == PS_EINVAL && strstr(err, "vocab") &&
        is_zeroed(&d));
  ps_ctr_synth_defaults(&cfg);
  cfg.zipf_s = NAN;
  CHECK(ps_ctr_synthetic(&cfg, 0, 5, &d, err) == PS_EINVAL && strstr(err, "Zipf"));
  ps_ctr_synth_defaults(&cfg);
  cfg.factors = 0;
  CHECK(ps_ctr_synthetic(&cfg, 0, 5, &d, err) == PS_EINVAL && strstr(err, "factors"));
  ps_ctr_synth_defaults(&cfg);
  cfg.factor_scale = -1;
  CHECK(ps_ctr_synthetic(&cfg, 0, 5, &d, err) == PS_EINVAL && strstr(err, "factor_scale"));
}

static int cmp_count_desc(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x < y) - (x > y);
}

/* The share of the most frequent values of a field against Zipf's law:
 * the value of rank r has probability (r+1)^-s / sum_{k=1..V} k^-s. */
static void check_zipf(uint64_t vocab, double s, int64_t n) {
  ps_ctr_synth_cfg cfg;
  ps_ctr_synth_defaults(&cfg);
  cfg.n_dense = 0;
  cfg.n_cat = 1;
  cfg.vocab = vocab;
  cfg.zipf_s = s;
  ps_ctr_data d;
  char err[PS_ERRLEN] = "";
  int rc = ps_ctr_synthetic(&cfg, 0, n, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc != 0) return;
  /* counts per distinct id: sort the ids, count the runs */
  uint64_t *ids = malloc((size_t)n * sizeof *ids);
  int64_t *counts = calloc((size_t)n, sizeof *counts);
  CHECK(ids && counts);
  if (ids && counts) {
    memcpy(ids, d.ids, (size_t)n * sizeof *ids);
    qsort(ids, (size_t)n, sizeof *ids, cmp_count_desc); /* any order groups equal ids */
    int64_t runs = 0;
    for (int64_t i = 0; i < n; runs++) {
      int64_t j = i;
      while (j < n && ids[j] == ids[i]) j++;
      counts[runs] = j - i;
      i = j;
    }
    qsort(counts, (size_t)runs, sizeof *counts, cmp_count_desc);
    double h = 0.0;
    for (uint64_t k = 1; k <= vocab; k++) h += pow((double)k, -s);
    for (int r = 0; r < 3 && (uint64_t)r < vocab; r++) {
      double p = pow(r + 1.0, -s) / h, got = (double)counts[r] / (double)n;
      double sd = sqrt(p * (1 - p) / (double)n);
      CHECK_MSG(fabs(got - p) < 5 * sd + 1e-4, "vocab %llu s %g rank %d: %.5f, theory %.5f",
                (unsigned long long)vocab, s, r, got, p);
    }
    CHECK((uint64_t)runs <= vocab);
  }
  free(ids);
  free(counts);
  ps_ctr_free(&d);
}

static void test_zipf(void) {
  check_zipf(1000, 1.05, 300000);
  check_zipf(100000, 1.05, 300000);
  check_zipf(50, 1.0, 200000);   /* s = 1: the logarithmic case */
  check_zipf(10, 0.0, 200000);   /* uniform */
  check_zipf(1000, 2.5, 200000); /* steep */
  check_zipf(1, 1.05, 1000);     /* one value */
}

/* The ground truth's AUC and click rate are where data_ctr.h says, and a
 * weakened predictor (the truth's logit with noise added) does worse. */
static void test_ground_truth(void) {
  ps_ctr_synth_cfg cfg;
  ps_ctr_synth_defaults(&cfg);
  int64_t n = 200000;
  ps_ctr_data d;
  char err[PS_ERRLEN] = "";
  int rc = ps_ctr_synthetic(&cfg, 0, n, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc != 0) return;
  double clicks = 0;
  for (int64_t i = 0; i < n; i++) clicks += d.labels[i];
  double auc = ps_auc(d.truth, d.labels, (size_t)n), rate = clicks / (double)n;
  double ll = ps_logloss(d.truth, d.labels, (size_t)n);
  fprintf(stderr, "  defaults, 200000 examples: click rate %.4f, truth AUC %.4f, log-loss %.4f\n",
          rate, auc, ll);
  CHECK_MSG(auc > 0.75 && auc < 0.82, "AUC %.4f", auc);
  CHECK_MSG(rate > 0.2 && rate < 0.3, "click rate %.4f", rate);
  /* calibrated: the truth's mean is the click rate */
  double mean = 0;
  for (int64_t i = 0; i < n; i++) mean += d.truth[i];
  CHECK_NEAR(mean / (double)n, rate, 0.005, 0.0);

  float *weak = malloc((size_t)n * sizeof *weak), *flat = malloc((size_t)n * sizeof *flat);
  CHECK(weak && flat);
  if (weak && flat) {
    for (int64_t i = 0; i < n; i++) {
      double p = d.truth[i], logit = log(p / (1 - p));
      /* noise from a fixed sequence: Box-Muller over a simple LCG */
      uint64_t a = (uint64_t)i * 6364136223846793005ull + 1442695040888963407ull;
      uint64_t b = a * 6364136223846793005ull + 1442695040888963407ull;
      double u1 = ((double)(a >> 11) + 1.0) / 9007199254740993.0;
      double u2 = (double)(b >> 11) / 9007199254740992.0;
      double z = sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
      weak[i] = (float)(1.0 / (1.0 + exp(-(logit + 1.5 * z))));
      flat[i] = 0.5f;
    }
    double weak_auc = ps_auc(weak, d.labels, (size_t)n);
    CHECK_MSG(weak_auc < auc - 0.03, "weakened %.4f, truth %.4f", weak_auc, auc);
    CHECK_NEAR(ps_auc(flat, d.labels, (size_t)n), 0.5, 1e-12, 0);
    CHECK(ps_logloss(weak, d.labels, (size_t)n) > ll);
  }
  free(weak);
  free(flat);

  /* the streaming AUC against the exact one */
  ps_auc_hist h;
  rc = ps_auc_hist_init(&h, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc == 0) {
    ps_auc_hist_add(&h, d.truth, d.labels, (size_t)n / 2);
    ps_auc_hist_add(&h, d.truth + n / 2, d.labels + n / 2, (size_t)(n - n / 2));
    CHECK_NEAR(ps_auc_hist_value(&h), auc, 1e-4, 0);
    ps_auc_hist_free(&h);
  }
  ps_ctr_free(&d);
}

/* ---- writing and reading back ---- */

static int write_file(const char *path, const ps_ctr_data *d, int with_truth, char *err) {
  FILE *f = fopen(path, "w");
  if (!f) return ps_seterr(err, PS_EIO, "cannot create %s", path);
  int rc = ps_ctr_write_tsv_rows(f, d, 0, d->n, with_truth, err);
  if (fclose(f) != 0 && rc == 0) rc = PS_EIO;
  return rc;
}

static void test_roundtrip(void) {
  ps_ctr_synth_cfg cfg;
  ps_ctr_synth_defaults(&cfg);
  ps_ctr_data d, back, mem, tail;
  char err[PS_ERRLEN] = "", path[PATH_MAX];
  int rc = ps_ctr_synthetic(&cfg, 5000, 3000, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc != 0) return;
  tmp_path(path, "synth.tsv");
  rc = write_file(path, &d, 0, err);
  CHECK_MSG(rc == 0, "%s", err);
  rc = ps_ctr_load_tsv(path, 0, &back, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc == 0) {
    CHECK(back.n == d.n && !back.truth);
    CHECK(same_data(&d, &back, 0, 0, d.n));
    /* the same text parsed in memory */
    char *text;
    size_t len;
    if (ps_read_file(path, &text, &len, err) == 0) {
      rc = ps_ctr_parse_tsv(text, len, path, 0, &mem, err);
      CHECK_MSG(rc == 0 && same_data(&d, &mem, 0, 0, d.n), "%s", err);
      ps_ctr_free(&mem);
      free(text);
    }
    /* max_rows from a file */
    rc = ps_ctr_load_tsv(path, 100, &tail, err);
    CHECK(rc == 0 && tail.n == 100 && same_data(&d, &tail, 0, 0, 100));
    ps_ctr_free(&tail);
    /* data read has no value strings: it cannot be written */
    FILE *f = fopen(tmp_path(path, "refused.tsv"), "w");
    if (f) {
      CHECK(ps_ctr_write_tsv(f, &back, 0, err) == PS_EINVAL && strstr(err, "value strings"));
      CHECK(ftell(f) == 0);
      fclose(f);
    }
  }
  ps_ctr_free(&back);

  /* with the truth column, and only the rows from 1000 on */
  tmp_path(path, "truth.tsv");
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (f) {
    rc = ps_ctr_write_tsv_rows(f, &d, 1000, d.n - 1000, 1, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(ps_ctr_write_tsv_rows(f, &d, 1000, d.n, 1, err) == PS_ERANGE);
    fclose(f);
    rc = ps_ctr_load_tsv(path, 0, &back, err);
    CHECK_MSG(rc == 0 && back.n == d.n - 1000 && back.truth, "%s", err);
    if (rc == 0) CHECK(same_data(&d, &back, 1000, 0, back.n)); /* truth compared too */
    ps_ctr_free(&back);
  }
  /* a dense value that is no integer's: refused before writing */
  float keep = d.dense[7];
  d.dense[7] = 0.123f;
  f = fopen(tmp_path(path, "refused2.tsv"), "w");
  if (f) {
    CHECK(ps_ctr_write_tsv(f, &d, 0, err) == PS_EINVAL && strstr(err, "I8"));
    CHECK(ftell(f) == 0);
    fclose(f);
  }
  d.dense[7] = keep;
  ps_ctr_free(&d);

  /* every count the generator can draw maps to a float and back */
  int bad = 0;
  for (int64_t c = -PS_CTR_SYNTH_MAX_COUNT; c <= PS_CTR_SYNTH_MAX_COUNT; c++) {
    float x = ps_ctr_dense_value(c);
    double back_c = floor(expm1(fabs((double)x)) + 0.5);
    bad += (x < 0 ? -back_c : back_c) != (double)c;
  }
  CHECK(bad == 0);

  /* another shape */
  cfg.n_dense = 3;
  cfg.n_cat = 5;
  cfg.factors = 3;
  cfg.seed = 77;
  rc = ps_ctr_synthetic(&cfg, 0, 500, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc == 0) {
    tmp_path(path, "shape.tsv");
    rc = write_file(path, &d, 0, err);
    CHECK_MSG(rc == 0, "%s", err);
    rc = ps_ctr_load_tsv_shape(path, 3, 5, 0, &back, err);
    CHECK_MSG(rc == 0 && same_data(&d, &back, 0, 0, d.n), "%s", err);
    ps_ctr_free(&back);
    rc = ps_ctr_load_tsv(path, 0, &back, err); /* read as Criteo: refused */
    CHECK(rc == PS_EINVAL && strstr(err, "line 1") && strstr(err, "9 fields") && is_zeroed(&back));
    ps_ctr_free(&d);
  }
}

static void test_gzip(void) {
  ps_ctr_synth_cfg cfg;
  ps_ctr_synth_defaults(&cfg);
  ps_ctr_data d, back;
  char err[PS_ERRLEN] = "", path[PATH_MAX], plain[PATH_MAX];
  int rc = ps_ctr_synthetic(&cfg, 0, 20000, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc != 0) return;
  tmp_path(plain, "gz_source.tsv");
  CHECK(write_file(plain, &d, 0, err) == 0);
  char *text = NULL;
  size_t len = 0;
  CHECK(ps_read_file(plain, &text, &len, err) == 0);
  /* gzip under a name without .gz: detected from the content */
  tmp_path(path, "criteo_day_0");
  gzFile g = gzopen(path, "wb");
  CHECK(g != NULL);
  if (g && text) {
    CHECK(gzwrite(g, text, (unsigned)len) == (int)len);
    CHECK(gzclose(g) == Z_OK);
    rc = ps_ctr_load_tsv(path, 0, &back, err);
    CHECK_MSG(rc == 0 && same_data(&d, &back, 0, 0, d.n) && back.n == d.n, "%s", err);
    ps_ctr_free(&back);
    rc = ps_ctr_load_tsv(path, 777, &back, err);
    CHECK(rc == 0 && back.n == 777 && same_data(&d, &back, 0, 0, 777));
    ps_ctr_free(&back);

    /* cut short: a clear error, out zeroed */
    FILE *f = fopen(path, "rb");
    char *gz = malloc(1 << 22);
    size_t glen = f && gz ? fread(gz, 1, 1 << 22, f) : 0;
    if (f) fclose(f);
    tmp_path(path, "cut.tsv.gz");
    f = fopen(path, "wb");
    if (f && gz && glen > 100) {
      fwrite(gz, 1, glen / 2, f);
      fclose(f);
      f = NULL;
      rc = ps_ctr_load_tsv(path, 0, &back, err);
      CHECK_MSG(rc != 0 && strstr(err, "cut.tsv.gz") && is_zeroed(&back), "rc %d: %s", rc, err);
      /* corrupt bytes in the middle */
      gz[glen / 2] ^= 0x55;
      gz[glen / 2 + 1] ^= 0xaa;
      f = fopen(path, "wb");
      if (f) {
        fwrite(gz, 1, glen, f);
        fclose(f);
        f = NULL;
      }
      rc = ps_ctr_load_tsv(path, 0, &back, err);
      CHECK_MSG(rc != 0 && strstr(err, "cut.tsv.gz") && is_zeroed(&back), "rc %d: %s", rc, err);
    }
    if (f) fclose(f);
    free(gz);
  }
  free(text);
  /* a plain file, CRLF line ends throughout */
  tmp_path(path, "crlf.tsv");
  FILE *f = fopen(path, "w");
  if (f) {
    char line[1024];
    criteo_line(line, sizeof line, "1", NULL, NULL);
    for (int i = 0; i < 5000; i++) fprintf(f, "%s\r\n", line);
    fclose(f);
    rc = ps_ctr_load_tsv(path, 0, &back, err);
    CHECK_MSG(rc == 0 && back.n == 5000 && back.labels[4999] == 1.0f, "%s", err);
    ps_ctr_free(&back);
  }
  /* an overlong line in a file (no line end for more than the read size) */
  tmp_path(path, "binary.bin");
  f = fopen(path, "w");
  if (f) {
    for (int i = 0; i < (3 << 20); i++) fputc('7', f);
    fclose(f);
    rc = ps_ctr_load_tsv(path, 0, &back, err);
    CHECK_MSG(rc == PS_EINVAL && strstr(err, "line 1") && strstr(err, "longer") && is_zeroed(&back),
              "%s", err);
  }
  ps_ctr_free(&d);
}

/* ---- AUC and log-loss by hand ---- */

static void test_auc_by_hand(void) {
  /* 4 pairs: (0.35 vs 0.1) (0.35 vs 0.4 lost) (0.8 vs both): 3/4 */
  const float s1[] = {0.1f, 0.4f, 0.35f, 0.8f}, y1[] = {0, 0, 1, 1};
  CHECK_NEAR(ps_auc(s1, y1, 4), 0.75, 1e-12, 0);
  /* ties count half: pos 0.5 beats neg 0.2, ties neg 0.5; pos 0.9 beats
   * both: (1 + 0.5 + 2) / 4 */
  const float s2[] = {0.2f, 0.5f, 0.5f, 0.9f}, y2[] = {0, 1, 0, 1};
  CHECK_NEAR(ps_auc(s2, y2, 4), 0.875, 1e-12, 0);
  /* all tied: 1/2 */
  const float s3[] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f}, y3[] = {0, 1, 0, 1, 1};
  CHECK_NEAR(ps_auc(s3, y3, 5), 0.5, 1e-12, 0);
  /* perfect and reversed; negative scores and -0 tied with +0 */
  const float s4[] = {-3.0f, -0.0f, 0.0f, 2.0f}, y4[] = {0, 0, 1, 1};
  CHECK_NEAR(ps_auc(s4, y4, 4), 0.875, 1e-12, 0); /* +0 vs -0: a tie */
  const float y5[] = {1, 1, 0, 0};
  CHECK_NEAR(ps_auc(s1, y5, 4), 0.25, 1e-12, 0);
  /* one class, no data, a NaN score: NaN */
  const float y6[] = {1, 1, 1, 1};
  CHECK(isnan(ps_auc(s1, y6, 4)));
  CHECK(isnan(ps_auc(s1, y1, 0)));
  const float s7[] = {0.1f, NAN, 0.3f, 0.4f};
  CHECK(isnan(ps_auc(s7, y1, 4)));
  /* the streaming AUC on the same cases (one bin per distinct score) */
  ps_auc_hist h;
  char err[PS_ERRLEN];
  if (ps_auc_hist_init(&h, err) == 0) {
    ps_auc_hist_add(&h, s2, y2, 4);
    CHECK_NEAR(ps_auc_hist_value(&h), 0.875, 1e-12, 0);
    ps_auc_hist_free(&h);
    CHECK(ps_auc_hist_init(&h, err) == 0);
    CHECK(isnan(ps_auc_hist_value(&h)));
    ps_auc_hist_free(&h);
  }

  /* log-loss: -log(0.5) each; clamped at 1e-7 */
  const float p1[] = {0.5f, 0.5f}, l1[] = {1, 0};
  CHECK_NEAR(ps_logloss(p1, l1, 2), log(2.0), 1e-9, 0);
  const float p2[] = {0.0f}, l2[] = {1};
  CHECK_NEAR(ps_logloss(p2, l2, 1), -log(1e-7), 1e-6, 0);
  const float p3[] = {0.9f, 0.2f}, l3[] = {1, 0};
  CHECK_NEAR(ps_logloss(p3, l3, 2), -(log(0.9f) + log(0.8f)) / 2, 1e-6, 0);
  CHECK(isnan(ps_logloss(p1, l1, 0)));
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/test_ctr_data.XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(test_parse_valid);
  RUN(test_feature_ids);
  RUN(test_bad_input);
  RUN(test_determinism);
  RUN(test_zipf);
  RUN(test_ground_truth);
  RUN(test_roundtrip);
  RUN(test_gzip);
  RUN(test_auc_by_hand);
  remove_tree(tmpdir);
  return check_summary();
}

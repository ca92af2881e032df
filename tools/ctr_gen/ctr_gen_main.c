/* ps-ctr-gen: a synthetic click log as Criteo TSV, whose ground truth is
 * known (see worker/data/data_ctr.h), and what a perfect model would score on
 * it. The examples are generated and written in pieces, so the memory
 * stays small whatever --rows; the flag table drives parsing and --help. */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/auc.h"
#include "common/options.h"
#include "common/util.h"
#include "worker/data/data_ctr.h"

/* Examples generated and written at a time. */
#define GEN_CHUNK 65536

typedef struct {
  int64_t rows, first, seed, vocab;
  const char *zipf;
  int factors;
  const char *out;
  int truth;
} gen_opts;

#define O(field) offsetof(gen_opts, field)

static const ps_option gen_flags[] = {
    {"rows", "N", PS_OPT_I64, O(rows), 1, 1e15, .help = "how many examples to write, required"},
    {"first", "I", PS_OPT_I64, O(first), 0, 1e18, .def = "0", .help =
     "the index of the first example: examples `I` .. `I+N-1` of the log are written, so "
     "disjoint ranges of one seed make disjoint splits (a test split, workers' shares)"},
    {"seed", "S", PS_OPT_I64, O(seed), 0, 9e18, .def = "1", .help =
     "the log's seed: the values, the hidden model and every draw"},
    {"vocab", "V", PS_OPT_I64, O(vocab), 1, 1099511627776.0, .def = "100000",
     .help = "distinct values of each categorical field"},
    {"zipf", "S", PS_OPT_STR, O(zipf), .def = "1.05", .help =
     "the Zipf exponent of the values' frequencies (value of rank `r` drawn with probability "
     "proportional to `1/(r+1)^S`), in [0, 20]"},
    {"factors", "K", PS_OPT_INT, O(factors), 1, PS_CTR_MAX_FACTORS, .def = "8",
     .help = "the size of the hidden factorization machine's factors"},
    {"out", "FILE", PS_OPT_STR, O(out), .def = "-",
     .help = "where to write the TSV; `-` is standard output"},
    {"truth", NULL, PS_OPT_FLAG, O(truth), .help =
     "end each line with one more column, the example's ground-truth click probability "
     "(`ps_ctr_load_tsv` reads it into `truth`)"},
};

static const ps_optspec gen_spec = {
    .prog = "ps-ctr-gen",
    .synopsis =
        "Usage: ps-ctr-gen --rows N [--first I] [--seed S] [--vocab V] [--zipf S] [--factors K]\n"
        "                  [--out FILE|-] [--truth]\n"
        "\n"
        "Writes examples of a synthetic click log as Criteo TSV (label, 13 integer and 26\n"
        "categorical fields): Zipf-distributed categorical values, lognormal counts, and\n"
        "labels drawn from a hidden factorization machine. Each example is a function of\n"
        "the seed and its index alone. On stderr: the click rate, and the AUC and log-loss\n"
        "of the ground-truth probabilities, the best a model can do on these examples.\n",
    .opts = gen_flags,
    .n_opts = (int)(sizeof gen_flags / sizeof gen_flags[0]),
    .footer = "Exit status: 0 done, 1 failed (a file named by --out is removed), 2 bad usage.",
};

/* What the written examples add up to. */
typedef struct {
  ps_auc_hist auc;
  double clicks, loss;
} gen_stats;

/* Writes the examples [o->first, o->first + o->rows) to f. */
static int gen_write(const gen_opts *o, const ps_ctr_synth_cfg *cfg, FILE *f, gen_stats *st,
                     char *err) {
  for (int64_t done = 0; done < o->rows;) {
    int64_t m = o->rows - done < GEN_CHUNK ? o->rows - done : GEN_CHUNK;
    ps_ctr_data d;
    int rc = ps_ctr_synthetic(cfg, o->first + done, m, &d, err);
    if (rc == 0) rc = ps_ctr_write_tsv_rows(f, &d, 0, m, o->truth, err);
    if (rc == 0) {
      ps_auc_hist_add(&st->auc, d.truth, d.labels, (size_t)m);
      for (int64_t i = 0; i < m; i++) st->clicks += d.labels[i];
      st->loss += ps_logloss(d.truth, d.labels, (size_t)m) * (double)m;
    }
    ps_ctr_free(&d);
    if (rc != 0) return rc;
    done += m;
  }
  return PS_OK;
}

int main(int argc, char **argv) {
  gen_opts o = {0};
  if (ps_options_defaults(&gen_spec, &o) != 0) return 2;
  int prc = ps_options_parse(&gen_spec, argc, argv, &o);
  if (prc == 1) return 0; /* --help */
  if (prc != 0) return 2;
  if (o.rows <= 0) {
    fprintf(stderr, "ps-ctr-gen: --rows N is required (see --help)\n");
    return 2;
  }
  if (o.rows > INT64_MAX - o.first) {
    fprintf(stderr, "ps-ctr-gen: --first %lld with --rows %lld runs past the last index\n",
            (long long)o.first, (long long)o.rows);
    return 2;
  }
  ps_ctr_synth_cfg cfg;
  ps_ctr_synth_defaults(&cfg);
  char *end = NULL;
  cfg.zipf_s = strtod(o.zipf, &end);
  if (!*o.zipf || *end || !(cfg.zipf_s >= 0.0 && cfg.zipf_s <= PS_CTR_MAX_ZIPF)) {
    fprintf(stderr, "ps-ctr-gen: --zipf wants a number in [0, %g], not '%s'\n",
            PS_CTR_MAX_ZIPF, o.zipf);
    return 2;
  }
  cfg.seed = (uint64_t)o.seed;
  cfg.vocab = (uint64_t)o.vocab;
  cfg.factors = o.factors;
  char err[PS_ERRLEN] = "";
  if (ps_ctr_synth_check(&cfg, err) != 0) {
    fprintf(stderr, "ps-ctr-gen: %s\n", err);
    return 2;
  }

  int to_stdout = strcmp(o.out, "-") == 0;
  FILE *f = to_stdout ? stdout : fopen(o.out, "w");
  if (!f) {
    fprintf(stderr, "ps-ctr-gen: cannot create '%s': %s\n", o.out, strerror(errno));
    return 1;
  }
  setvbuf(f, NULL, _IOFBF, 1 << 20);
  gen_stats st = {0};
  double t0 = ps_now_s();
  int rc = ps_auc_hist_init(&st.auc, err);
  if (rc == 0) rc = gen_write(&o, &cfg, f, &st, err);
  if (rc == 0 && (fflush(f) != 0 || ferror(f)))
    rc = ps_seterr(err, PS_EIO, "cannot write '%s': %s", o.out, strerror(errno));
  if (!to_stdout && fclose(f) != 0 && rc == 0)
    rc = ps_seterr(err, PS_EIO, "cannot write '%s': %s", o.out, strerror(errno));
  if (rc != 0) {
    fprintf(stderr, "ps-ctr-gen: %s\n", err);
    if (!to_stdout) unlink(o.out);
    ps_auc_hist_free(&st.auc);
    return 1;
  }
  double secs = ps_now_s() - t0;
  fprintf(stderr,
          "ps-ctr-gen: wrote examples [%lld, %lld) of seed %llu to %s in %.1f s: click rate "
          "%.4f; the ground truth's AUC %.4f, log-loss %.4f\n",
          (long long)o.first, (long long)(o.first + o.rows), (unsigned long long)cfg.seed,
          to_stdout ? "stdout" : o.out, secs, st.clicks / (double)o.rows,
          ps_auc_hist_value(&st.auc), st.loss / (double)o.rows);
  ps_auc_hist_free(&st.auc);
  return 0;
}

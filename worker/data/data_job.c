/* The job's data set: which reader, where its files are, the check
 * against the model's input, normalisation and augmentation. */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "common/auc.h"
#include "common/util.h"
#include "worker/data/data.h"
#include "worker/data/data_ctr.h"

int ps_dataset_normalize(ps_dataset *d, const float *mean, const float *std, int count, char *err) {
  if (!d || !mean || !std) return ps_seterr(err, PS_EINVAL, "ps_dataset_normalize: NULL argument");
  if (count != 1 && count != d->c)
    return ps_seterr(err, PS_EINVAL,
                     "normalisation has %d values of mean and std; the data has %d channel%s "
                     "(give 1 value, or %d)",
                     count, d->c, d->c == 1 ? "" : "s", d->c);
  for (int ch = 0; ch < count; ch++) {
    if (!(std[ch] > 0.0f))
      return ps_seterr(err, PS_EINVAL, "normalisation: std[%d] = %g, must be > 0", ch,
                       (double)std[ch]);
  }
  size_t hw = (size_t)d->h * d->w;
  for (size_t i = 0; i < (size_t)d->n; i++) {
    for (int ch = 0; ch < d->c; ch++) {
      int k = count == 1 ? 0 : ch;
      float m = mean[k], inv = 1.0f / std[k];
      float *p = d->images + (i * (size_t)d->c + (size_t)ch) * hw;
      for (size_t j = 0; j < hw; j++) p[j] = (p[j] - m) * inv;
    }
  }
  return PS_OK;
}

/* path as given when absolute or when there is no dir; else dir/path. */
static int job__path(const char *dir, const char *path, char *buf, size_t cap, char *err) {
  int k = path[0] == '/' || !dir || !dir[0] ? snprintf(buf, cap, "%s", path)
                                            : snprintf(buf, cap, "%s/%s", dir, path);
  if (k < 0 || (size_t)k >= cap)
    return ps_seterr(err, PS_EINVAL, "data set path '%s/%s' is too long", dir ? dir : "", path);
  return PS_OK;
}

/* A click log as a data set: dense values as the examples (n_dense x 1 x
 * 1), labels 0 and 1 (classes 1: a binary model), ids beside; the truth's
 * AUC when the log has one. Frees c. */
static int job__from_ctr(ps_ctr_data *c, ps_dataset *out, char *err) {
  memset(out, 0, sizeof *out);
  size_t n = (size_t)c->n;
  if (c->n > INT32_MAX) {
    ps_ctr_free(c);
    return ps_seterr(err, PS_ERANGE, "%" PRId64 " examples (at most %d)", (int64_t)n, INT32_MAX);
  }
  out->n = (int)n;
  out->c = c->n_dense ? c->n_dense : 1, out->h = out->w = 1;
  out->classes = 1;
  out->n_ids = c->n_cat;
  /* The arrays move over (ps_free is free): the dense values and ids are
   * not copied, which would hold the set twice while it is read. */
  if (c->n_dense) {
    out->images = c->dense;
    c->dense = NULL;
  } else {
    out->images = ps_alloc(n * sizeof(float));
  }
  out->ids = c->ids;
  c->ids = NULL;
  out->labels = ps_alloc(n);
  if (!out->images || !out->labels) {
    ps_dataset_free(out);
    ps_ctr_free(c);
    return ps_seterr(err, PS_ENOMEM, "out of memory for %zu examples", n);
  }
  for (size_t i = 0; i < n; i++) out->labels[i] = c->labels[i] >= 0.5f;
  out->truth_auc = c->truth ? ps_auc(c->truth, c->labels, n) : 0.0;
  ps_ctr_free(c);
  return PS_OK;
}

/* Reads the split with the job's reader; `where` receives what to name in
 * a shape message (a file or a folder). */
static int job__read(const ps_job *job, const char *dir, int train, int part, int parts,
                     ps_dataset *out, char *where, size_t cap, char *err) {
  const ps_model_spec *spec = &job->model;
  const char *name = job->dataset;
  snprintf(where, cap, "%s", dir ? dir : "");
  if (!strcmp(name, "synthetic")) {
    int rc =
        ps_dataset_synthetic(train ? job->synthetic_train : job->synthetic_test, spec->in_c,
                             spec->in_h, spec->in_w, spec->classes, job->seed, train ? 0 : 1, out);
    if (rc) return ps_seterr(err, rc, "cannot make the synthetic data set");
    return PS_OK;
  }
  if (!strcmp(name, "ctr-synthetic")) {
    ps_ctr_synth_cfg cfg;
    ps_ctr_synth_defaults(&cfg);
    cfg.n_dense = spec->in_c * spec->in_h * spec->in_w;
    cfg.n_cat = spec->n_ids;
    cfg.vocab = job->ctr_vocab;
    cfg.zipf_s = job->ctr_zipf;
    cfg.seed = job->ctr_seed;
    ps_ctr_data c;
    int64_t first = train ? 0 : job->synthetic_train;
    int rc = parts > 1 ? ps_ctr_synthetic_part(&cfg, first, job->synthetic_train, part, parts, &c,
                                               err)
                       : ps_ctr_synthetic(&cfg, first,
                                          train ? job->synthetic_train : job->synthetic_test, &c,
                                          err);
    if (rc) return rc;
    snprintf(where, cap, "ctr-synthetic");
    return job__from_ctr(&c, out, err);
  }
  if (!strcmp(name, "criteo")) {
    char path[PATH_MAX];
    int rc = job__path(dir, train ? job->data_train : job->data_test, path, sizeof path, err);
    if (rc) return rc;
    snprintf(where, cap, "%s", path);
    ps_ctr_data c;
    rc = ps_ctr_load_tsv_shape(path, spec->in_c * spec->in_h * spec->in_w, spec->n_ids,
                               train ? job->synthetic_train : job->synthetic_test, &c, err);
    if (rc) return rc;
    return job__from_ctr(&c, out, err);
  }
  if (!strcmp(name, "fashion-mnist") || !strcmp(name, "mnist"))
    return ps_dataset_load_named(name, dir, train, out, err);
  if (!strcmp(name, "cifar10")) return ps_dataset_load_cifar10(dir, train, out, err);
  char x[PATH_MAX], y[PATH_MAX];
  int rc;
  if (!strcmp(name, "npz")) {
    rc = job__path(dir, train ? job->data_train : job->data_test, x, sizeof x, err);
    if (rc) return rc;
    snprintf(where, cap, "%s", x);
    return ps_dataset_load_npz(x, job->data_x, job->data_y, job->data_layout, spec->classes, out,
                               err);
  }
  if (!strcmp(name, "npy")) {
    rc = job__path(dir, train ? job->data_train_x : job->data_test_x, x, sizeof x, err);
    if (!rc) rc = job__path(dir, train ? job->data_train_y : job->data_test_y, y, sizeof y, err);
    if (rc) return rc;
    snprintf(where, cap, "%s", x);
    return ps_dataset_load_npy(x, y, job->data_layout, spec->classes, out, err);
  }
  return ps_seterr(err, PS_EINVAL, "unknown data set '%s'", name);
}

/* The examples must be the model's input; the message names both shapes,
 * and for a 4-D array read in one layout that would fit in the other, the
 * job key that fixes it. */
static int job__check_shape(const ps_job *job, const ps_dataset *d, const char *where, char *err) {
  const ps_model_spec *spec = &job->model;
  if (d->n_ids != spec->n_ids)
    return ps_seterr(err, PS_EINVAL, "'%s': examples carry %d categorical ids; the model has %d",
                     where, d->n_ids, spec->n_ids);
  if (d->c == spec->in_c && d->h == spec->in_h && d->w == spec->in_w) {
    if (d->classes == spec->classes) return PS_OK;
    return ps_seterr(err, PS_EINVAL, "'%s': the data set has %d classes; the model has %d", where,
                     d->classes, spec->classes);
  }
  const char *hint = "";
  int npy = !strcmp(job->dataset, "npz") || !strcmp(job->dataset, "npy");
  /* (n, a, b, c) read as NHWC gives c x a x b; read as NCHW, a x b x c. */
  if (npy && job->data_layout == PS_LAYOUT_NHWC && d->h == spec->in_c && d->w == spec->in_h &&
      d->c == spec->in_w)
    hint = " (the array looks NCHW: set \"layout\": \"nchw\")";
  if (npy && job->data_layout == PS_LAYOUT_NCHW && d->w == spec->in_c && d->c == spec->in_h &&
      d->h == spec->in_w)
    hint = " (the array looks NHWC: set \"layout\": \"nhwc\")";
  return ps_seterr(err, PS_EINVAL,
                   "'%s': examples are %dx%dx%d (CxHxW) but the model's input is %dx%dx%d%s", where,
                   d->c, d->h, d->w, spec->in_c, spec->in_h, spec->in_w, hint);
}

/* Training augmentation: crop and flip from the job, padding in the value
 * a black pixel has after normalisation. */
static int job__augment(const ps_job *job, ps_dataset *d, char *err) {
  if (job->data_crop_pad == 0 && !job->data_flip) return PS_OK;
  d->aug.crop_pad = job->data_crop_pad;
  d->aug.flip = job->data_flip;
  d->aug.fill = ps_alloc((size_t)d->c * sizeof(float));
  if (!d->aug.fill) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (int ch = 0; ch < d->c; ch++) {
    int k = job->data_norm_count == 1 ? 0 : ch;
    d->aug.fill[ch] = job->data_norm_count ? -job->data_mean[k] / job->data_std[k] : 0.0f;
  }
  return PS_OK;
}

int ps_dataset_job_parts(const ps_job *job) { return !strcmp(job->dataset, "ctr-synthetic"); }

int ps_dataset_load_job(const ps_job *job, const char *dir, int train, ps_dataset *out, char *err) {
  return ps_dataset_load_job_part(job, dir, train, 0, 1, out, err);
}

int ps_dataset_load_job_part(const ps_job *job, const char *dir, int train, int part, int parts,
                             ps_dataset *out, char *err) {
  if (!out) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_job: out is NULL");
  memset(out, 0, sizeof *out);
  if (!job) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_job: job is NULL");
  if (parts > 1 && (!train || !ps_dataset_job_parts(job)))
    return ps_seterr(err, PS_EINVAL, "data set '%s': no part of its %s split can be read alone",
                     job->dataset, train ? "train" : "test");
  if (!dir) dir = job->data_dir;
  char where[PATH_MAX];
  ps_dataset d;
  int rc = job__read(job, dir, train, part, parts, &d, where, sizeof where, err);
  if (rc) return rc;
  rc = job__check_shape(job, &d, where, err);
  if (!rc && job->data_norm_count > 0)
    rc = ps_dataset_normalize(&d, job->data_mean, job->data_std, job->data_norm_count, err);
  if (!rc && train) rc = job__augment(job, &d, err);
  if (rc) {
    ps_dataset_free(&d);
    return rc;
  }
  *out = d;
  return PS_OK;
}

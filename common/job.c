/* Job file: parse, fill defaults, validate.
 *
 * Validation is strict and happens once, here, on the server that reads the
 * file: workers receive the same text at Register and parse it with the same
 * code, so a job that passes here can be trusted everywhere. Unknown keys are
 * errors because a misspelt optional key ("learning_rate" for "lr") would
 * otherwise fall back to a default without anyone noticing. */
#include "job.h"

#include <float.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keras.h"
#include "util.h"

#define MAX_SYNTHETIC (1 << 24)

/* Names the job accepts, in the "a, b, c" form messages quote. */
static const char OPTIMIZERS[] = "sgd, momentum, adagrad, adam";
static const char DATASETS[] =
    "fashion-mnist, mnist, cifar10, npz, npy, synthetic, ctr-synthetic, criteo";

/* Each data set: its default directory and the keys that only it takes
 * (keys that apply to every set are DATASET_COMMON_KEYS). */
static const struct {
  const char *name;
  const char *dir;
  const char *keys;
} DATASET_KINDS[] = {
    {"fashion-mnist", "/usr/share/datasets/fashion-mnist", ""},
    {"mnist", "/usr/share/datasets/mnist", ""},
    {"cifar10", "/usr/share/datasets/cifar10", ""},
    {"npz", "", "train, test, x, y, layout"},
    {"npy", "", "train_x, train_y, test_x, test_y, layout"},
    {"synthetic", "", "train_size, test_size"},
    {"ctr-synthetic", "", "train_size, test_size, vocab, zipf, data_seed"},
    {"criteo", "", "train, test, train_size, test_size"},
};
#define N_DATASET_KINDS (sizeof DATASET_KINDS / sizeof DATASET_KINDS[0])
static const char DATASET_COMMON_KEYS[] = "name, dir, mean, std, crop_pad, flip";

/* Is key one of the names in `known` ("a, b, c")? */
static int key_known(const char *key, const char *known) {
  size_t klen = strlen(key);
  for (const char *p = known; *p;) {
    size_t n = strcspn(p, ",");
    if (n == klen && memcmp(p, key, n) == 0) return 1;
    p += n;
    while (*p == ',' || *p == ' ') p++;
  }
  return 0;
}

/* Rejects any key of obj not in `known` ("a, b, c"); `where` is the dotted
 * path of obj ("" for the top level). */
static int check_keys(json_t *obj, const char *known, const char *where, char *err) {
  const char *key;
  json_t *v;
  json_object_foreach(obj, key, v) {
    if (!key_known(key, known))
      return ps_seterr(err, PS_EINVAL, "unknown field '%s%s%.60s' (known: %s)", where,
                       *where ? "." : "", key, known);
  }
  return 0;
}

/* Optional integer field in [lo, hi]; absent leaves *out unchanged. */
static int get_int(json_t *obj, const char *key, const char *name, long long lo, long long hi,
                   long long *out, char *err) {
  json_t *v = json_object_get(obj, key);
  if (!v) return 0;
  if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
    return ps_seterr(err, PS_EINVAL, "'%s' must be an integer in %lld..%lld", name, lo, hi);
  *out = json_integer_value(v);
  return 0;
}

/* Optional finite number stored as float; lo_open/hi_open say whether the
 * bounds are exclusive. The bounds are checked on the float actually
 * stored, so 1e-50 (0 in float) fails "> 0" and 1e300 fails "finite". */
static int get_float(json_t *obj, const char *key, const char *name, double lo, int lo_open,
                     double hi, int hi_open, float *out, char *err) {
  json_t *v = json_object_get(obj, key);
  if (!v) return 0;
  double d = json_is_number(v) ? json_number_value(v) : NAN;
  /* A double beyond FLT_MAX has no float value (the cast would be UB). */
  int ok = isfinite(d) && fabs(d) <= FLT_MAX;
  float f = ok ? (float)d : 0.0f;
  ok = ok && (lo_open ? f > lo : f >= lo) && (hi_open ? f < hi : f <= hi);
  if (!ok) {
    char range[64];
    if (isinf(hi))
      snprintf(range, sizeof range, "%s %g", lo_open ? ">" : ">=", lo);
    else
      snprintf(range, sizeof range, "in %c%g, %g%c", lo_open ? '(' : '[', lo, hi,
               hi_open ? ')' : ']');
    return ps_seterr(err, PS_EINVAL, "'%s' must be a finite number %s", name, range);
  }
  *out = f;
  return 0;
}

/* Optional string of at most cap-1 characters, copied into out. */
static int get_string(json_t *obj, const char *key, const char *name, char *out, size_t cap,
                      char *err) {
  json_t *v = json_object_get(obj, key);
  if (!v) return 0;
  const char *s = json_string_value(v);
  if (!s) return ps_seterr(err, PS_EINVAL, "'%s' must be a string", name);
  if (strlen(s) >= cap)
    return ps_seterr(err, PS_EINVAL, "'%s' is too long (at most %zu characters)", name, cap - 1);
  memcpy(out, s, strlen(s) + 1);
  return 0;
}

static void set_defaults(ps_job *job) {
  memset(job, 0, sizeof *job);
  snprintf(job->optim.name, sizeof job->optim.name, "adam");
  job->optim.lr = 0.001f;
  job->optim.momentum = 0.9f;
  job->optim.nesterov = 0;
  job->optim.beta1 = 0.9f;
  job->optim.beta2 = 0.999f;
  job->optim.eps = 1e-8f;
  job->optim.initial_accumulator = 0.1f;
  job->seed = 1;
  job->batch_size = 64;
  job->epochs = 1;
  job->max_steps = 0;
  snprintf(job->mode, sizeof job->mode, "async");
  job->mode_kind = PS_MODE_ASYNC;
  job->wait_timeout_ms = 60000;
  job->min_workers = 1;
  job->shuffle = 1;
  snprintf(job->dataset, sizeof job->dataset, "fashion-mnist");
  snprintf(job->data_dir, sizeof job->data_dir, "/usr/share/datasets/fashion-mnist");
  job->synthetic_train = 2048;
  job->synthetic_test = 512;
  job->ctr_vocab = 100000;
  job->ctr_zipf = 1.05;
  job->ctr_seed = 1;
  snprintf(job->data_x, sizeof job->data_x, "x");
  snprintf(job->data_y, sizeof job->data_y, "y");
  job->data_layout = PS_LAYOUT_NHWC;
  job->eval_interval_s = 30.0;
  job->heartbeat_timeout_ms = 10000;
  job->max_workers = 256;
  job->replicas_per_shard = 1;
  job->max_rows_per_request = 131072;
  job->replica_heartbeat_ms = 100;
  job->replica_lease_ms = 500;
}

static int parse_job_id(json_t *root, ps_job *job, char *err) {
  json_t *v = json_object_get(root, "job_id");
  if (!v) return ps_seterr(err, PS_EINVAL, "'job_id' is required");
  const char *id = json_string_value(v);
  size_t n = id ? strlen(id) : 0;
  /* The id travels in every request and names checkpoint files, so it is
   * kept to characters that are safe in paths and logs. */
  int ok = id && n >= 1 && n < sizeof job->job_id;
  for (size_t i = 0; ok && i < n; i++) {
    char ch = id[i];
    ok = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
         ch == '.' || ch == '_' || ch == '-';
  }
  if (!ok)
    return ps_seterr(err, PS_EINVAL,
                     "'job_id' must be a string of 1..%zu characters from [A-Za-z0-9._-]",
                     sizeof job->job_id - 1);
  memcpy(job->job_id, id, n + 1);
  return 0;
}

static int parse_optimizer(json_t *root, ps_optim_config *o, char *err) {
  json_t *obj = json_object_get(root, "optimizer");
  if (!obj) return 0;
  if (!json_is_object(obj))
    return ps_seterr(err, PS_EINVAL, "'optimizer' must be an object such as {\"name\": \"adam\"}");
  static const char *const known =
      "name, lr, beta1, beta2, eps, momentum, nesterov, initial_accumulator";
  int rc;
  if ((rc = check_keys(obj, known, "optimizer", err))) return rc;
  json_t *nv = json_object_get(obj, "name");
  if (nv) {
    const char *name = json_string_value(nv);
    if (!name || !key_known(name, OPTIMIZERS))
      return ps_seterr(err, PS_EINVAL, "'optimizer.name' %s%.32s%s is not known (known: %s)",
                       name ? "'" : "", name ? name : "(not a string)", name ? "'" : "",
                       OPTIMIZERS);
    snprintf(o->name, sizeof o->name, "%s", name);
  }
  if ((rc = get_float(obj, "lr", "optimizer.lr", 0, 1, INFINITY, 0, &o->lr, err))) return rc;
  if ((rc = get_float(obj, "beta1", "optimizer.beta1", 0, 0, 1, 1, &o->beta1, err))) return rc;
  if ((rc = get_float(obj, "beta2", "optimizer.beta2", 0, 0, 1, 1, &o->beta2, err))) return rc;
  if ((rc = get_float(obj, "eps", "optimizer.eps", 0, 1, INFINITY, 0, &o->eps, err))) return rc;
  if ((rc = get_float(obj, "momentum", "optimizer.momentum", 0, 0, 1, 1, &o->momentum, err)))
    return rc;
  if ((rc = get_float(obj, "initial_accumulator", "optimizer.initial_accumulator", 0, 0, INFINITY,
                      0, &o->initial_accumulator, err)))
    return rc;
  json_t *nest = json_object_get(obj, "nesterov");
  if (nest) {
    if (!json_is_boolean(nest))
      return ps_seterr(err, PS_EINVAL, "'optimizer.nesterov' must be true or false");
    o->nesterov = json_is_true(nest);
  }
  return 0;
}

/* "embeddings": the job's tables (emb.h). */
static int parse_tables(json_t *root, ps_job *job, char *err) {
  json_t *arr = json_object_get(root, "embeddings");
  if (!arr) return 0;
  if (!json_is_array(arr))
    return ps_seterr(err, PS_EINVAL,
                     "'embeddings' must be a list of tables such as [{\"name\": \"cat\", "
                     "\"rows\": 1000000, \"dim\": 16}]");
  if (json_array_size(arr) > PS_MAX_TABLES)
    return ps_seterr(err, PS_EINVAL, "'embeddings' lists %zu tables (at most %d)",
                     json_array_size(arr), PS_MAX_TABLES);
  static const char *const known = "name, rows, dim, init, optimizer, max_rows_per_shard";
  size_t i;
  json_t *obj;
  json_array_foreach(arr, i, obj) {
    ps_table_spec *t = &job->tables[i];
    char where[48];
    snprintf(where, sizeof where, "embeddings[%zu]", i);
    if (!json_is_object(obj))
      return ps_seterr(err, PS_EINVAL, "'%s' must be an object such as {\"name\": \"cat\", "
                       "\"rows\": 1000000, \"dim\": 16}", where);
    int rc;
    if ((rc = check_keys(obj, known, where, err))) return rc;
    json_t *nv = json_object_get(obj, "name");
    const char *name = nv ? json_string_value(nv) : NULL;
    if (!name || !ps_table_name_ok(name))
      return ps_seterr(err, PS_EINVAL,
                       "'%s.name' is required: 1 to 31 characters of [A-Za-z0-9_.-]", where);
    for (size_t k = 0; k < i; k++)
      if (strcmp(job->tables[k].name, name) == 0)
        return ps_seterr(err, PS_EINVAL, "'%s.name': table '%s' is declared twice", where, name);
    snprintf(t->name, sizeof t->name, "%s", name);
    char f[96];
    json_t *rv = json_object_get(obj, "rows");
    if (!rv || !json_is_integer(rv) || json_integer_value(rv) < 0)
      return ps_seterr(err, PS_EINVAL,
                       "'%s.rows' is required: the number of ids (an integer >= 1), or 0 for "
                       "unbounded ids (rows made on first touch)", where);
    t->rows = (uint64_t)json_integer_value(rv);
    long long v = 0;
    snprintf(f, sizeof f, "%s.dim", where);
    if (!json_object_get(obj, "dim"))
      return ps_seterr(err, PS_EINVAL, "'%s' is required (values per row, 1..%d)", f,
                       PS_TABLE_MAX_DIM);
    if ((rc = get_int(obj, "dim", f, 1, PS_TABLE_MAX_DIM, &v, err))) return rc;
    t->dim = (int)v;
    v = 1LL << 26;
    snprintf(f, sizeof f, "%s.max_rows_per_shard", where);
    if ((rc = get_int(obj, "max_rows_per_shard", f, 1, 1LL << 40, &v, err))) return rc;
    t->max_rows_per_shard = (uint64_t)v;
    t->init = PS_TABLE_INIT_UNIFORM;
    t->init_scale = 0.05f;
    json_t *iv = json_object_get(obj, "init");
    if (iv) {
      const char *is = json_string_value(iv);
      char *end = NULL;
      double sc = 0;
      int ok = is != NULL;
      if (ok && strcmp(is, "zeros") == 0) {
        t->init = PS_TABLE_INIT_ZEROS;
        t->init_scale = 0;
      } else if (ok && (strncmp(is, "uniform:", 8) == 0 || strncmp(is, "normal:", 7) == 0)) {
        int normal = is[0] == 'n';
        sc = strtod(is + (normal ? 7 : 8), &end);
        ok = end && *end == 0 && end != is + (normal ? 7 : 8) && isfinite(sc) && sc > 0 &&
             sc <= 1e6;
        t->init = normal ? PS_TABLE_INIT_NORMAL : PS_TABLE_INIT_UNIFORM;
        t->init_scale = (float)sc;
      } else {
        ok = 0;
      }
      if (!ok)
        return ps_seterr(err, PS_EINVAL,
                         "'%s.init' must be \"uniform:SCALE\" (values in [-SCALE, SCALE]), "
                         "\"normal:STD\" or \"zeros\", with 0 < SCALE <= 1e6", where);
    }
    t->key = ps_table_key(t->name);
    /* The table's optimizer starts as the job's; its own object overrides
     * fields (parsed as the job's, the message then prefixed). */
    job->table_optim[i] = job->optim;
    if ((rc = parse_optimizer(obj, &job->table_optim[i], err))) {
      char inner[PS_ERRLEN];
      snprintf(inner, sizeof inner, "%s", err);
      return ps_seterr(err, rc, "%s (table '%s'): %s", where, t->name, inner);
    }
    job->n_tables = (int)i + 1;
  }
  return 0;
}

/* The table row of a data set name; -1 if unknown. */
static int dataset_kind(const char *name) {
  for (size_t k = 0; k < N_DATASET_KINDS; k++)
    if (strcmp(DATASET_KINDS[k].name, name) == 0) return (int)k;
  return -1;
}

/* Rejects the keys of obj that belong to data sets other than kind k,
 * naming the sets they are for. */
static int check_dataset_keys(json_t *obj, int k, char *err) {
  const char *key;
  json_t *v;
  json_object_foreach(obj, key, v) {
    if (key_known(key, DATASET_COMMON_KEYS) || key_known(key, DATASET_KINDS[k].keys)) continue;
    char owners[64] = "";
    for (size_t o = 0; o < N_DATASET_KINDS; o++) {
      if (!key_known(key, DATASET_KINDS[o].keys)) continue;
      size_t len = strlen(owners);
      snprintf(owners + len, sizeof owners - len, "%s%s", len ? " or " : "",
               DATASET_KINDS[o].name);
    }
    return ps_seterr(err, PS_EINVAL,
                     "'dataset.%s' does not apply to the %s dataset: keys like it apply only to "
                     "the %s dataset",
                     key, DATASET_KINDS[k].name, owners);
  }
  return 0;
}

/* Optional path (at most cap-1 characters); `required` makes absence an
 * error naming the data set. */
static int get_path(json_t *obj, const char *key, int required, const char *set, char *out,
                    size_t cap, char *err) {
  char name[48];
  snprintf(name, sizeof name, "dataset.%s", key);
  if (!json_object_get(obj, key)) {
    if (!required) return 0;
    return ps_seterr(err, PS_EINVAL, "'%s' is required for the %s dataset", name, set);
  }
  int rc = get_string(obj, key, name, out, cap, err);
  if (rc) return rc;
  if (!out[0]) return ps_seterr(err, PS_EINVAL, "'%s' must not be empty", name);
  return 0;
}

/* "mean" and "std": both or neither, each a list of 1 value (every
 * channel) or one per input channel; every std > 0. */
static int parse_normalisation(json_t *obj, ps_job *job, char *err) {
  json_t *mean = json_object_get(obj, "mean"), *std = json_object_get(obj, "std");
  if (!mean && !std) return 0;
  if (!mean || !std)
    return ps_seterr(err, PS_EINVAL, "'dataset.mean' and 'dataset.std' go together: give both");
  int in_c = job->model.in_c;
  const char *names[2] = {"dataset.mean", "dataset.std"};
  json_t *arrays[2] = {mean, std};
  float *outs[2] = {job->data_mean, job->data_std};
  for (int a = 0; a < 2; a++) {
    size_t n = json_is_array(arrays[a]) ? json_array_size(arrays[a]) : 0;
    if (n == 0 || n > PS_JOB_MAX_CHANNELS || (n != 1 && n != (size_t)in_c))
      return ps_seterr(err, PS_EINVAL,
                       "'%s' must be a list of 1 number or of one per input channel (%d), at "
                       "most %d",
                       names[a], in_c, PS_JOB_MAX_CHANNELS);
    for (size_t i = 0; i < n; i++) {
      json_t *v = json_array_get(arrays[a], i);
      double d = json_is_number(v) ? json_number_value(v) : NAN;
      int ok = isfinite(d) && fabs(d) <= FLT_MAX && (a == 0 || (float)d > 0.0f);
      if (!ok)
        return ps_seterr(err, PS_EINVAL, "'%s[%zu]' must be a finite number%s", names[a], i,
                         a == 0 ? "" : " > 0");
      outs[a][i] = (float)d;
    }
  }
  if (json_array_size(mean) != json_array_size(std))
    return ps_seterr(err, PS_EINVAL, "'dataset.mean' has %zu values but 'dataset.std' has %zu",
                     json_array_size(mean), json_array_size(std));
  job->data_norm_count = (int)json_array_size(mean);
  return 0;
}

/* The keys of the file formats: paths, array names, layout. */
static int parse_dataset_files(json_t *obj, ps_job *job, char *err) {
  int npz = strcmp(job->dataset, "npz") == 0, npy = strcmp(job->dataset, "npy") == 0;
  int rc;
  if (npz) {
    if ((rc = get_path(obj, "train", 1, "npz", job->data_train, sizeof job->data_train, err)) ||
        (rc = get_path(obj, "test", 1, "npz", job->data_test, sizeof job->data_test, err)) ||
        (rc = get_path(obj, "x", 0, "npz", job->data_x, sizeof job->data_x, err)) ||
        (rc = get_path(obj, "y", 0, "npz", job->data_y, sizeof job->data_y, err)))
      return rc;
  }
  if (npy) {
    if ((rc = get_path(obj, "train_x", 1, "npy", job->data_train_x, sizeof job->data_train_x,
                       err)) ||
        (rc = get_path(obj, "train_y", 1, "npy", job->data_train_y, sizeof job->data_train_y,
                       err)) ||
        (rc = get_path(obj, "test_x", 1, "npy", job->data_test_x, sizeof job->data_test_x, err)) ||
        (rc = get_path(obj, "test_y", 1, "npy", job->data_test_y, sizeof job->data_test_y, err)))
      return rc;
  }
  json_t *layout = json_object_get(obj, "layout");
  if (layout) {
    const char *l = json_string_value(layout);
    if (l && strcmp(l, "nhwc") == 0)
      job->data_layout = PS_LAYOUT_NHWC;
    else if (l && strcmp(l, "nchw") == 0)
      job->data_layout = PS_LAYOUT_NCHW;
    else
      return ps_seterr(err, PS_EINVAL, "'dataset.layout' must be \"nhwc\" or \"nchw\"");
  }
  return 0;
}

/* ctr-synthetic's generator (vocab, zipf, data_seed) and criteo's files;
 * both are click logs: a binary model with ids. */
static int parse_ctr_dataset(json_t *obj, ps_job *job, char *err) {
  const int synth = strcmp(job->dataset, "ctr-synthetic") == 0;
  const int criteo = strcmp(job->dataset, "criteo") == 0;
  if (!synth && !criteo) return 0;
  int rc;
  if (criteo) {
    if ((rc = get_path(obj, "train", 1, "criteo", job->data_train, sizeof job->data_train, err)) ||
        (rc = get_path(obj, "test", 1, "criteo", job->data_test, sizeof job->data_test, err)))
      return rc;
    /* Without sizes, whole files. */
    if (!json_object_get(obj, "train_size")) job->synthetic_train = 0;
    if (!json_object_get(obj, "test_size")) job->synthetic_test = 0;
  }
  long long v = job->ctr_vocab;
  if ((rc = get_int(obj, "vocab", "dataset.vocab", 1, (long long)1 << 40, &v, err))) return rc;
  job->ctr_vocab = (uint64_t)v;
  json_t *z = json_object_get(obj, "zipf");
  if (z) {
    double d = json_is_number(z) ? json_number_value(z) : NAN;
    if (!(d >= 0.0 && d <= 20.0))
      return ps_seterr(err, PS_EINVAL, "'dataset.zipf' must be a number in [0, 20]");
    job->ctr_zipf = d;
  }
  v = (long long)job->ctr_seed;
  if ((rc = get_int(obj, "data_seed", "dataset.data_seed", 1, LLONG_MAX, &v, err))) return rc;
  job->ctr_seed = (uint64_t)v;
  if (job->model.classes != 1 || job->model.n_ids < 1)
    return ps_seterr(err, PS_EINVAL,
                     "'dataset.name' %s is click logs (labels 0 and 1 with categorical ids): the "
                     "model needs \"classes\": 1 (ending in sigmoid_xent) and \"ids\" (the "
                     "categorical fields)",
                     job->dataset);
  return 0;
}

static int parse_dataset(json_t *root, ps_job *job, char *err) {
  json_t *obj = json_object_get(root, "dataset");
  if (!obj) return 0;
  if (!json_is_object(obj))
    return ps_seterr(err, PS_EINVAL,
                     "'dataset' must be an object such as {\"name\": \"fashion-mnist\"}");
  static const char *const known =
      "name, dir, train_size, test_size, train, test, x, y, train_x, train_y, test_x, test_y, "
      "layout, mean, std, crop_pad, flip, vocab, zipf, data_seed";
  int rc;
  if ((rc = check_keys(obj, known, "dataset", err))) return rc;
  json_t *nv = json_object_get(obj, "name");
  if (nv) {
    const char *name = json_string_value(nv);
    if (!name || dataset_kind(name) < 0)
      return ps_seterr(err, PS_EINVAL, "'dataset.name' %s%.32s%s is not known (known: %s)",
                       name ? "'" : "", name ? name : "(not a string)", name ? "'" : "", DATASETS);
    snprintf(job->dataset, sizeof job->dataset, "%s", name);
    /* Each file set has its own default directory; the others have none. */
    snprintf(job->data_dir, sizeof job->data_dir, "%s", DATASET_KINDS[dataset_kind(name)].dir);
  }
  if ((rc = check_dataset_keys(obj, dataset_kind(job->dataset), err))) return rc;
  if ((rc = get_string(obj, "dir", "dataset.dir", job->data_dir, sizeof job->data_dir, err)))
    return rc;
  long long v = job->synthetic_train;
  if ((rc = get_int(obj, "train_size", "dataset.train_size", 1, MAX_SYNTHETIC, &v, err))) return rc;
  job->synthetic_train = (int)v;
  v = job->synthetic_test;
  if ((rc = get_int(obj, "test_size", "dataset.test_size", 1, MAX_SYNTHETIC, &v, err))) return rc;
  job->synthetic_test = (int)v;
  if ((rc = parse_dataset_files(obj, job, err))) return rc;
  if ((rc = parse_ctr_dataset(obj, job, err))) return rc;
  if ((rc = parse_normalisation(obj, job, err))) return rc;
  v = 0;
  if ((rc = get_int(obj, "crop_pad", "dataset.crop_pad", 0, 64, &v, err))) return rc;
  job->data_crop_pad = (int)v;
  json_t *flip = json_object_get(obj, "flip");
  if (flip) {
    if (!json_is_boolean(flip))
      return ps_seterr(err, PS_EINVAL, "'dataset.flip' must be true or false");
    job->data_flip = json_is_true(flip);
  }
  return 0;
}

/* The model's embedding layers name the job's tables: each must exist
 * with the layer's dim. */
static int resolve_embedding_layers(ps_job *job, char *err) {
  for (int i = 0; i < job->model.n_layers; i++) {
    ps_layer *L = &job->model.layers[i];
    if (L->type != PS_LAYER_EMBEDDING) continue;
    int t = 0;
    while (t < job->n_tables && strcmp(job->tables[t].name, L->table) != 0) t++;
    if (t == job->n_tables)
      return ps_seterr(err, PS_EINVAL,
                       "layer %d (%s): table '%s' is not one of the job's \"embeddings\"", i,
                       L->name, L->table);
    if (job->tables[t].dim != L->emb_dim)
      return ps_seterr(err, PS_EINVAL,
                       "layer %d (%s): 'dim' is %d but table '%s' has rows of %d values", i,
                       L->name, L->emb_dim, L->table, job->tables[t].dim);
    L->table_index = t;
  }
  return 0;
}

/* "async", "ssp:K" (K >= 0) or "sync", and the options that go with them. */
static int parse_mode(json_t *root, ps_job *job, char *err) {
  json_t *mode = json_object_get(root, "mode");
  if (mode) {
    const char *m = json_string_value(mode);
    if (!m) return ps_seterr(err, PS_EINVAL, "'mode' must be a string: async, ssp:K or sync");
    if (strcmp(m, "async") == 0) {
      job->mode_kind = PS_MODE_ASYNC;
    } else if (strcmp(m, "sync") == 0) {
      job->mode_kind = PS_MODE_SYNC;
    } else if (strncmp(m, "ssp:", 4) == 0) {
      char *end = NULL;
      long k = strtol(m + 4, &end, 10);
      if (end == m + 4 || *end || k < 0 || k > 1000000)
        return ps_seterr(err, PS_EINVAL,
                         "mode '%.40s': ssp needs a bound K >= 0 on how far a worker may run "
                         "ahead, as in \"ssp:2\"", m);
      job->mode_kind = PS_MODE_SSP;
      job->ssp_k = (int)k;
    } else {
      return ps_seterr(err, PS_EINVAL, "mode '%.40s' is not known (async, ssp:K or sync)", m);
    }
    snprintf(job->mode, sizeof job->mode, "%s", m);
  }
  long long v = 0;
  int rc;
  if ((rc = get_int(root, "backup_workers", "backup_workers", 0, 1000000, &v, err))) return rc;
  if (v > 0 && job->mode_kind != PS_MODE_SYNC)
    return ps_seterr(err, PS_EINVAL, "'backup_workers' applies only to mode sync (mode is %s)",
                     job->mode);
  job->backup_workers = (int)v;
  v = 1;
  if ((rc = get_int(root, "min_workers", "min_workers", 1, 1000000, &v, err))) return rc;
  if (v > 1 && job->mode_kind != PS_MODE_SYNC)
    return ps_seterr(err, PS_EINVAL, "'min_workers' applies only to mode sync (mode is %s)",
                     job->mode);
  job->min_workers = (int)v;
  json_t *sal = json_object_get(root, "staleness_aware_lr");
  if (sal) {
    if (!json_is_boolean(sal))
      return ps_seterr(err, PS_EINVAL, "'staleness_aware_lr' must be true or false");
    job->staleness_aware_lr = json_is_true(sal);
    if (job->staleness_aware_lr && job->mode_kind == PS_MODE_SYNC)
      return ps_seterr(err, PS_EINVAL,
                       "'staleness_aware_lr' applies to async and ssp (sync has no staleness)");
  }
  v = job->wait_timeout_ms;
  if ((rc = get_int(root, "wait_timeout_ms", "wait_timeout_ms", 1, INT_MAX, &v, err))) return rc;
  job->wait_timeout_ms = (int)v;
  v = 0;
  if ((rc = get_int(root, "lease_chunk", "lease_chunk", 0, 1 << 24, &v, err))) return rc;
  job->lease_chunk = (int)v;
  v = job->max_workers;
  if ((rc = get_int(root, "max_workers", "max_workers", 1, 4096, &v, err))) return rc;
  job->max_workers = (int)v;
  if (job->min_workers > job->max_workers)
    return ps_seterr(err, PS_EINVAL, "'min_workers' (%d) is above 'max_workers' (%d)",
                     job->min_workers, job->max_workers);
  json_t *sh = json_object_get(root, "shuffle");
  if (sh) {
    if (!json_is_boolean(sh)) return ps_seterr(err, PS_EINVAL, "'shuffle' must be true or false");
    job->shuffle = json_is_true(sh);
  }
  return 0;
}

/* Replicated shards: R replicas per shard, how often a primary speaks to
 * its backups, and how long a silence makes a replica act. */
static int parse_replication(json_t *root, ps_job *job, char *err) {
  long long v = job->replicas_per_shard;
  int rc;
  if ((rc = get_int(root, "replicas_per_shard", "replicas_per_shard", 1, PS_MAX_REPLICAS, &v,
                    err)))
    return rc;
  job->replicas_per_shard = (int)v;
  v = job->replica_heartbeat_ms;
  if ((rc = get_int(root, "replica_heartbeat_ms", "replica_heartbeat_ms", 10, 60000, &v, err)))
    return rc;
  job->replica_heartbeat_ms = (int)v;
  v = job->replica_lease_ms;
  if ((rc = get_int(root, "replica_lease_ms", "replica_lease_ms", 30, 600000, &v, err)))
    return rc;
  job->replica_lease_ms = (int)v;
  if (job->replica_lease_ms < 3 * job->replica_heartbeat_ms)
    return ps_seterr(err, PS_EINVAL,
                     "'replica_lease_ms' (%d) must be at least 3 x 'replica_heartbeat_ms' (%d): "
                     "a replica must miss several heartbeats before it acts",
                     job->replica_lease_ms, job->replica_heartbeat_ms);
  return 0;
}

static int parse_root(json_t *root, ps_job *job, char *err) {
  if (!json_is_object(root)) return ps_seterr(err, PS_EINVAL, "the job must be a JSON object");
  static const char *const known =
      "job_id, model, optimizer, seed, batch_size, epochs, max_steps, mode, backup_workers, "
      "min_workers, max_workers, lease_chunk, "
      "staleness_aware_lr, wait_timeout_ms, shuffle, dataset, eval_interval_s, "
      "heartbeat_timeout_ms, wire, replicas_per_shard, replica_heartbeat_ms, replica_lease_ms, "
      "embeddings, max_rows_per_request";
  int rc;
  if ((rc = check_keys(root, known, "", err))) return rc;
  if ((rc = parse_job_id(root, job, err))) return rc;

  json_t *model = json_object_get(root, "model");
  if (!model) return ps_seterr(err, PS_EINVAL, "'model' is required (see model_spec.h)");
  if (json_is_object(model) && json_object_get(model, "keras"))
    return ps_seterr(err, PS_EINVAL,
                     "model: {\"keras\": ...} names a file, read when the job is loaded from "
                     "its file (ps-server --job, ps-worker --local --job)");
  /* The spec's messages already say "model: ..." or "layer N (type): ...". */
  if ((rc = ps_model_spec_from_json(model, &job->model, err))) return rc;

  if ((rc = parse_optimizer(root, &job->optim, err))) return rc;

  long long v = (long long)job->seed;
  if ((rc = get_int(root, "seed", "seed", 0, LLONG_MAX, &v, err))) return rc;
  job->seed = (uint64_t)v;
  v = job->batch_size;
  if ((rc = get_int(root, "batch_size", "batch_size", 1, 65536, &v, err))) return rc;
  job->batch_size = (int)v;
  v = job->epochs;
  if ((rc = get_int(root, "epochs", "epochs", 1, 1000000, &v, err))) return rc;
  job->epochs = (int)v;
  v = job->max_steps;
  if ((rc = get_int(root, "max_steps", "max_steps", 0, LLONG_MAX, &v, err))) return rc;
  job->max_steps = v;

  if ((rc = parse_mode(root, job, err))) return rc;

  if ((rc = parse_dataset(root, job, err))) return rc;

  json_t *ev = json_object_get(root, "eval_interval_s");
  if (ev) {
    double s = json_is_number(ev) ? json_number_value(ev) : -1.0;
    if (!json_is_number(ev) || !isfinite(s) || s < 0)
      return ps_seterr(err, PS_EINVAL, "'eval_interval_s' must be a finite number >= 0");
    job->eval_interval_s = s;
  }
  v = job->heartbeat_timeout_ms;
  if ((rc = get_int(root, "heartbeat_timeout_ms", "heartbeat_timeout_ms", 1, INT_MAX, &v, err)))
    return rc;
  job->heartbeat_timeout_ms = (int)v;
  if ((rc = parse_replication(root, job, err))) return rc;
  /* After the job's optimizer: a table's starts as a copy of it. */
  if ((rc = parse_tables(root, job, err))) return rc;
  v = job->max_rows_per_request;
  if ((rc = get_int(root, "max_rows_per_request", "max_rows_per_request", 1,
                    PS_MAX_ROWS_PER_REQUEST, &v, err)))
    return rc;
  job->max_rows_per_request = (int)v;
  if ((rc = resolve_embedding_layers(job, err))) return rc;
  json_t *wire = json_object_get(root, "wire");
  if (wire) {
    const char *name = json_string_value(wire);
    if (!name || ps_wire_parse(name, &job->wire) != 0)
      return ps_seterr(err, PS_EINVAL, "'wire' %s%.32s%s is not known (known: %s)",
                       name ? "'" : "", name ? name : "(not a string)", name ? "'" : "",
                       PS_WIRE_NAMES);
  }
  return 0;
}

int ps_job_check_layers(const ps_job *job, char *err) {
  if (!job->model.flat) return 0;
  return ps_seterr(err, PS_EINVAL,
                   "job '%s' has a flat model (%zu parameters, no layers): ps-worker has no "
                   "layers to compute; train it with workers that compute the model themselves "
                   "(Python: python/psclient, docs/python.md)",
                   job->job_id, job->model.n_params);
}

int ps_job_parse(const char *json_text, ps_job *job, char *err) {
  set_defaults(job);
  json_error_t jerr;
  json_t *root = json_loads(json_text ? json_text : "", JSON_REJECT_DUPLICATES, &jerr);
  if (!root)
    return ps_seterr(err, PS_EINVAL, "job: JSON syntax error at line %d, column %d: %s", jerr.line,
                     jerr.column, jerr.text);
  int rc = parse_root(root, job, err);
  json_decref(root);
  return rc;
}

/* A job's "model": {"keras": FILE} replaced in root by FILE's translation
 * (FILE relative to the job file's directory unless absolute). 1 when it
 * was replaced, 0 when the model is a spec already, PS_E* with a message
 * (naming FILE) otherwise. */
static int resolve_keras(json_t *root, const char *job_path, char *err) {
  json_t *model = json_object_get(root, "model");
  json_t *file = json_is_object(model) ? json_object_get(model, "keras") : NULL;
  if (!file) return 0;
  if (!json_is_string(file) || json_string_length(file) == 0)
    return ps_seterr(err, PS_EINVAL, "model: 'keras' must name a file (a string)");
  if (json_object_size(model) != 1)
    return ps_seterr(err, PS_EINVAL,
                     "model: with 'keras' nothing else may be given (the file is the model)");
  const char *name = json_string_value(file);
  char full[4096];
  const char *slash = strrchr(job_path, '/');
  if (name[0] == '/' || !slash)
    snprintf(full, sizeof full, "%s", name);
  else
    snprintf(full, sizeof full, "%.*s/%s", (int)(slash - job_path), job_path, name);
  char *text = NULL, why[PS_ERRLEN];
  int rc = ps_read_file(full, &text, NULL, why);
  if (rc) return ps_seterr(err, rc, "model: Keras model file: %s", why);
  void *spec = NULL;
  char notes[1024] = "";
  rc = ps_keras_to_spec(text, &spec, notes, sizeof notes, why);
  free(text);
  if (rc) return ps_seterr(err, rc, "model: Keras model '%s': %s", full, why);
  for (char *line = strtok(notes, "\n"); line; line = strtok(NULL, "\n"))
    PS_INFO("model: Keras model '%s': %s", full, line);
  json_object_set_new(root, "model", (json_t *)spec);
  return 1;
}

int ps_job_load(const char *path, ps_job *job, char **text_out, char *err) {
  if (text_out) *text_out = NULL;
  char *text = NULL;
  char why[PS_ERRLEN];
  int rc = ps_read_file(path, &text, NULL, why);
  if (rc) return ps_seterr(err, rc, "job file: %s", why);
  /* Parsed here rather than through ps_job_parse so that every message,
   * syntax or validation, starts with the file's name. */
  set_defaults(job);
  json_error_t jerr;
  json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
  if (!root) {
    rc = ps_seterr(err, PS_EINVAL, "%s: JSON syntax error at line %d, column %d: %s", path,
                   jerr.line, jerr.column, jerr.text);
    free(text);
    return rc;
  }
  int resolved = resolve_keras(root, path, why);
  rc = resolved < 0 ? resolved : parse_root(root, job, why);
  if (rc == 0 && resolved) {
    /* The text others parse carries the translation. */
    char *dumped = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    char *copy = dumped ? strdup(dumped) : NULL; /* free() for the caller, whatever jansson uses */
    free(dumped);
    if (!copy) rc = ps_seterr(why, PS_ENOMEM, "out of memory writing the job's text");
    free(text);
    text = copy;
  }
  json_decref(root);
  if (rc) {
    free(text);
    return ps_seterr(err, rc, "%s: %s", path, why);
  }
  if (text_out)
    *text_out = text;
  else
    free(text);
  return 0;
}

/* ps-import-keras: a Keras model (the JSON of model.to_json()) as the
 * model spec of a job file. The flag table drives parsing and --help. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/atomic_file.h"
#include "common/job.h"
#include "common/keras.h"
#include "common/model_spec.h"
#include "common/options.h"
#include "common/optim.h"
#include "common/util.h"
#include "worker/data/data.h"
#include "ps/ckpt/checkpoint.h"

typedef struct {
  const char *model, *out, *weights, *job, *ckpt_dir;
} import_opts;

#define O(field) offsetof(import_opts, field)

static const ps_option import_flags[] = {
    {"model", "FILE", PS_OPT_STR, O(model), .help =
     "the Keras model's JSON (`model.to_json()` of tf_keras or Keras 3: a Sequential or "
     "functional model, residual blocks included), required"},
    {"out", "FILE", PS_OPT_STR, O(out), .def_doc = "standard output", .help =
     "where to write the model spec (the value of a job's `\"model\"` key), replaced "
     "atomically"},
    {"weights", "FILE", PS_OPT_STR, O(weights), .help =
     "the model's weights as a NumPy `.npz` of `model.get_weights()` in order "
     "(`np.savez(FILE, *model.get_weights())`): with `--job` and `--checkpoint-dir`, written "
     "as the job's starting checkpoint instead of printing the spec"},
    {"job", "FILE", PS_OPT_STR, O(job), .help =
     "with `--weights`: the job file, whose model must be this Keras model's spec"},
    {"checkpoint-dir", "DIR", PS_OPT_STR, O(ckpt_dir), .help =
     "with `--weights`: where to write the starting checkpoint (version 0, one shard; made if "
     "missing); start the servers with `--checkpoint-dir DIR` and they restore it, on any "
     "number of shards"},
};

static const ps_optspec import_spec = {
    .prog = "ps-import-keras",
    .synopsis =
        "Usage: ps-import-keras --model FILE [--out FILE]\n"
        "       ps-import-keras --model FILE --weights W.npz --job FILE --checkpoint-dir DIR\n"
        "\n"
        "Translates a Keras model into this system's model spec. Layers: InputLayer,\n"
        "Conv2D, Dense, MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D,\n"
        "Flatten, Dropout, Activation, ReLU, Softmax, Add and BatchNormalization (over\n"
        "the channel axis), channels-last; the model ends in a Dense layer with a\n"
        "softmax or logits. Anything else is refused, naming\n"
        "the layer and what is not supported. The spec's own initialisation applies\n"
        "(Keras's initializers are not carried over), or, with --weights, the model's\n"
        "trained weights as the job's starting checkpoint.\n",
    .opts = import_flags,
    .n_opts = (int)(sizeof import_flags / sizeof import_flags[0]),
    .footer = "Exit status: 0 done, 1 the model cannot be translated (nothing is written),\n"
              "2 bad usage.",
};

/* --weights: the job's starting checkpoint from the Keras weights. */
static int write_weights(const import_opts *o, const char *keras_json) {
  char err[PS_ERRLEN];
  ps_job *job = calloc(1, sizeof *job);
  if (!job) return 1;
  int rc = ps_job_load(o->job, job, NULL, err);
  if (rc) {
    fprintf(stderr, "ps-import-keras: %s\n", err);
    free(job);
    return 1;
  }
  /* The job's model must be the translation of this Keras model. */
  void *specv = NULL;
  ps_model_spec *ks = calloc(1, sizeof *ks);
  rc = !ks ? ps_seterr(err, PS_ENOMEM, "out of memory")
           : ps_keras_to_spec(keras_json, &specv, NULL, 0, err);
  if (rc == 0) rc = ps_model_spec_from_json(specv, ks, err);
  json_decref(specv);
  char kd[512], jd[512];
  if (rc == 0) {
    ps_model_spec_describe(ks, kd, sizeof kd);
    ps_model_spec_describe(&job->model, jd, sizeof jd);
    if (strcmp(kd, jd) != 0 || ks->in_c != job->model.in_c || ks->in_h != job->model.in_h ||
        ks->in_w != job->model.in_w)
      rc = ps_seterr(err, PS_EINVAL,
                     "the job's model is not this Keras model's spec (job: %.100s; Keras: "
                     "%.100s): put ps-import-keras's output in the job's \"model\"",
                     jd, kd);
  }
  free(ks);
  ps_np_floats w = {0};
  if (rc == 0) rc = ps_npz_load_floats(o->weights, &w, err);
  const ps_optimizer *opt = ps_optimizer_find(job->optim.name);
  size_t P = job->model.n_params;
  float *params = NULL, *slots[PS_CKPT_MAX_SLOTS] = {0};
  ps_keras_tensor *t = NULL;
  if (rc == 0 && !opt) rc = ps_seterr(err, PS_EINVAL, "unknown optimizer '%s'", job->optim.name);
  if (rc == 0 && (!(params = ps_alloc(P * sizeof(float))) ||
                  !(t = calloc((size_t)w.n + 1, sizeof *t))))
    rc = ps_seterr(err, PS_ENOMEM, "out of memory for %zu parameters", P);
  for (int i = 0; rc == 0 && i < w.n; i++) {
    t[i].data = w.arrays[i].data;
    t[i].ndim = w.arrays[i].ndim > 4 ? 5 : w.arrays[i].ndim;
    for (int d = 0; d < w.arrays[i].ndim && d < 4; d++) t[i].shape[d] = w.arrays[i].shape[d];
  }
  if (rc == 0) rc = ps_keras_weights(keras_json, &job->model, t, w.n, params, err);
  if (rc == 0) {
    for (size_t i = 0; i < P; i++)
      if (!isfinite(params[i])) {
        rc = ps_seterr(err, PS_EINVAL, "the weights hold a non-finite value (parameter %zu)", i);
        break;
      }
  }
  ps_ckpt ck = {0};
  if (rc == 0) {
    ck.meta.index = 0;
    ck.meta.num_shards = 1;
    ck.meta.P = P;
    ck.meta.begin = 0;
    ck.meta.end = P;
    snprintf(ck.meta.optimizer, sizeof ck.meta.optimizer, "%s", job->optim.name);
    snprintf(ck.meta.job_id, sizeof ck.meta.job_id, "%s", job->job_id);
    ck.params = params;
    ck.n_slots = opt->n_slots;
    for (int k = 0; k < opt->n_slots && rc == 0; k++) {
      if (!(slots[k] = ps_alloc((P ? P : 1) * sizeof(float)))) {
        rc = ps_seterr(err, PS_ENOMEM, "out of memory");
        break;
      }
      float v = opt->slot_init ? opt->slot_init(&job->optim, k) : 0.0f;
      for (size_t i = 0; i < P; i++) slots[k][i] = v;
      ck.slots[k] = slots[k];
    }
  }
  char path[PS_CKPT_PATHLEN];
  if (rc == 0 && mkdir(o->ckpt_dir, 0777) != 0 && errno != EEXIST)
    rc = ps_seterr(err, PS_EIO, "cannot make '%.200s': %s", o->ckpt_dir, strerror(errno));
  if (rc == 0) rc = ps_ckpt_write(o->ckpt_dir, &ck, 0, path, err);
  for (int k = 0; k < PS_CKPT_MAX_SLOTS; k++) ps_free(slots[k]);
  ps_free(params);
  free(t);
  const int n_arrays = w.n;
  ps_np_floats_free(&w);
  if (rc) {
    fprintf(stderr, "ps-import-keras: %s\n", err);
    free(job);
    return 1;
  }
  fprintf(stderr,
          "ps-import-keras: wrote the Keras weights (%d arrays, %zu parameters) as job '%s''s "
          "starting checkpoint %s\n",
          n_arrays, P, job->job_id, path);
  free(job);
  return 0;
}

int main(int argc, char **argv) {
  import_opts o = {0};
  if (ps_options_defaults(&import_spec, &o)) return 2;
  int prc = ps_options_parse(&import_spec, argc, argv, &o);
  if (prc == 1) return 0;
  if (prc) return 2;
  if (!o.model) {
    fprintf(stderr, "ps-import-keras: --model FILE is required (see --help)\n");
    return 2;
  }
  char err[PS_ERRLEN], notes[1024];
  char *text = NULL;
  size_t len = 0;
  if (ps_read_file(o.model, &text, &len, err)) {
    fprintf(stderr, "ps-import-keras: %s\n", err);
    return 1;
  }
  if (o.weights || o.job || o.ckpt_dir) {
    if (!o.weights || !o.job || !o.ckpt_dir || o.out) {
      fprintf(stderr, "ps-import-keras: --weights, --job and --checkpoint-dir go together, "
                      "without --out (see --help)\n");
      free(text);
      return 2;
    }
    int wrc = write_weights(&o, text);
    free(text);
    return wrc;
  }
  void *specv = NULL;
  int rc = ps_keras_to_spec(text, &specv, notes, sizeof notes, err);
  free(text);
  if (rc) {
    fprintf(stderr, "ps-import-keras: %s: %s\n", o.model, err);
    return 1;
  }
  json_t *spec = specv;
  /* The result must be a spec this system takes. */
  ps_model_spec *ms = calloc(1, sizeof *ms);
  if (!ms || ps_model_spec_from_json(spec, ms, err)) {
    fprintf(stderr, "ps-import-keras: %s: the translated spec is refused: %s\n", o.model,
            ms ? err : "out of memory");
    free(ms);
    json_decref(spec);
    return 1;
  }
  char desc[512];
  ps_model_spec_describe(ms, desc, sizeof desc);
  free(ms);
  /* 15 digits: batchnorm's momentum 0.99 reads "0.99", not the 17 digits of
   * the nearest double; every float32 the spec holds survives it. */
  char *body = json_dumps(spec, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(15));
  json_decref(spec);
  if (!body) {
    fprintf(stderr, "ps-import-keras: out of memory\n");
    return 1;
  }
  fputs(notes, stderr);
  rc = 0;
  if (o.out) {
    ps_atomic_file f;
    rc = ps_atomic_open(&f, o.out, err);
    if (rc == 0) {
      ps_atomic_write(&f, body, strlen(body));
      ps_atomic_write(&f, "\n", 1);
      rc = ps_atomic_commit(&f, err);
    }
    if (rc) fprintf(stderr, "ps-import-keras: %s\n", err);
  } else {
    printf("%s\n", body);
    if (fflush(stdout)) {
      fprintf(stderr, "ps-import-keras: writing the spec to standard output failed\n");
      rc = 1;
    }
  }
  free(body);
  if (rc) return 1;
  fprintf(stderr, "ps-import-keras: %s: %s\n", o.model, desc);
  return 0;
}

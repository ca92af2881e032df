/* ps-export: the model's parameters from shard checkpoints (written with any
 * number of shards), for use outside this system: one NumPy .npy file per
 * tensor (np.load, PyTorch, Keras) and per embedding table, or the
 * inference graph as an ONNX file (onnxruntime and other ONNX readers). The
 * flag table drives parsing and --help. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/job.h"
#include "common/options.h"
#include "common/util.h"
#include "ps/ckpt/checkpoint.h"
#include "tools/export/export_onnx.h"
#include "ps/ckpt/table_ckpt.h"

#ifndef PS_EXPORT_VERSION
#define PS_EXPORT_VERSION "unknown"
#endif

typedef struct {
  const char *job_path, *ckpt_dir, *out;
  int format; /* index into format_choices */
  int log_level;
} export_opts;

enum { FORMAT_NPY, FORMAT_ONNX };
static const char *const format_choices[] = {"npy", "onnx", NULL};
static const char *const level_choices[] = {"debug", "info", "warn", "error", NULL};

#define O(field) offsetof(export_opts, field)

static const ps_option export_flags[] = {
    {"job", "FILE", PS_OPT_STR, O(job_path),
     .help = "the job file the checkpoints were written for, required"},
    {"checkpoints", "DIR", PS_OPT_STR, O(ckpt_dir),
     .help = "the servers' checkpoint directory, required: the newest usable set is read"},
    {"out", "PATH", PS_OPT_STR, O(out), .help =
     "required: with `npy`, the directory for the `.npy` files (made if missing); with `onnx`, "
     "the file to write (replaced atomically)"},
    {"format", "F", PS_OPT_CHOICE, O(format), .choices = format_choices, .def = "npy", .help =
     "`npy`: one NumPy file per tensor, `<layer>.w.npy` (conv2d: OC, IC, KH, KW; dense: OUT, "
     "IN) and `<layer>.b.npy` (none for a layer without a bias), batchnorm's "
     "`<layer>.gamma.npy`, `.beta.npy`, `.moving_mean.npy` and `.moving_variance.npy` (C), "
     "float32; and per embedding table `<table>.emb.npy`, float32: a bounded table's (rows, "
     "dim), row `id` at index `id` (rows never pushed hold their initial values), an "
     "unbounded one's (n, dim) for the n rows held, whose ids are in `<table>.ids.npy` (n) "
     "uint64, increasing; `onnx`: the inference graph (input `input` [N, C, H, W], output "
     "`probabilities` [N, classes], dropout left out, batchnorm with its moving statistics) "
     "with the parameters as initializers, ONNX operator set 13"},
    {"log-level", "L", PS_OPT_CHOICE, O(log_level), .choices = level_choices, .def = "info",
     .help = "`debug`, `info`, `warn` or `error`"},
};

static const ps_optspec export_spec = {
    .prog = "ps-export",
    .synopsis = "Usage: ps-export --job FILE --checkpoints DIR --out PATH [--format npy|onnx]\n"
                "\n"
                "Writes the parameters of the job's model, restored from the newest usable set\n"
                "of shard checkpoints in DIR (written with any number of shards), as NumPy\n"
                "files or as an ONNX model.\n",
    .opts = export_flags,
    .n_opts = (int)(sizeof export_flags / sizeof export_flags[0]),
    .footer = "Exit status: 0 done, 1 failed (nothing is left half-written), 2 bad usage.",
};

/* A flat model (no layers): the whole vector as one file, OUT/params.npy
 * (P) float32, in the order of the job's "tensors" when it names them. */
static int export_flat_npy(const ps_job *job, const float *params, const char *out_dir,
                           int *files, char *err) {
  if (mkdir(out_dir, 0777) != 0) {
    struct stat st;
    if (errno != EEXIST || stat(out_dir, &st) != 0 || !S_ISDIR(st.st_mode))
      return ps_seterr(err, PS_EIO, "cannot create directory '%s': %s", out_dir,
                       errno == EEXIST ? "a file of that name exists" : strerror(errno));
  }
  char path[4096];
  if (snprintf(path, sizeof path, "%s/params.npy", out_dir) >= (int)sizeof path)
    return ps_seterr(err, PS_EINVAL, "the path '%s/params.npy' is too long", out_dir);
  const size_t shape[1] = {job->model.n_params};
  int rc = ps_npy_write(path, params, shape, 1, err);
  if (rc == 0) *files = 1;
  return rc;
}

/* Writes params in the chosen format; 0, or an error code with a message. */
static int export_params(const export_opts *o, const ps_job *job, const float *params,
                         const ps_ckpt_restored *got, char *err) {
  char desc[512];
  ps_model_spec_describe(&job->model, desc, sizeof desc);
  if (o->format == FORMAT_ONNX) {
    ps_onnx_meta meta = {.producer_version = PS_EXPORT_VERSION,
                         .job_id = job->job_id,
                         .version = got->version,
                         .num_shards = got->num_shards};
    uint64_t bytes = 0;
    if (job->n_tables)
      PS_WARN("the ONNX graph holds no embedding tables: export them with --format npy");
    int rc = ps_onnx_export(&job->model, params, &meta, o->out, &bytes, err);
    if (rc == 0)
      PS_INFO("wrote the ONNX model '%s' (%llu bytes, opset 13): job '%s', %s, from the %d-shard "
              "checkpoints (version %llu)",
              o->out, (unsigned long long)bytes, job->job_id, desc, got->num_shards,
              (unsigned long long)got->version);
    return rc;
  }
  int files = 0, tfiles = 0;
  int rc = job->model.flat ? export_flat_npy(job, params, o->out, &files, err)
                           : ps_ckpt_export_npy(&job->model, params, o->out, &files, err);
  if (rc == 0)
    rc = ps_table_ckpt_export_npy(job, got->parts, got->n_parts, o->out, &tfiles, err);
  files += tfiles;
  if (rc == 0 && job->n_tables)
    PS_INFO("wrote the %d embedding table(s) as %d .npy files (from the rows of %d shards' "
            "files)",
            job->n_tables, tfiles, got->n_parts);
  if (rc == 0)
    PS_INFO("wrote %d .npy files to '%s': job '%s', %s, from the %d-shard checkpoints "
            "(version %llu)",
            files, o->out, job->job_id, desc, got->num_shards, (unsigned long long)got->version);
  return rc;
}

int main(int argc, char **argv) {
  export_opts o = {0};
  if (ps_options_defaults(&export_spec, &o) != 0) return 2;
  int prc = ps_options_parse(&export_spec, argc, argv, &o);
  if (prc == 1) return 0; /* --help */
  if (prc != 0) return 2;
  if (!o.job_path || !o.ckpt_dir || !o.out) {
    fprintf(stderr, "ps-export: %s is required (see --help)\n",
            !o.job_path   ? "--job FILE"
            : !o.ckpt_dir ? "--checkpoints DIR"
                          : "--out PATH");
    return 2;
  }
  ps_log_init("ps-export", o.log_level);

  char err[PS_ERRLEN] = "";
  /* ps_job is large (the layer table): keep it off the stack. */
  ps_job *job = calloc(1, sizeof *job);
  if (!job) {
    fprintf(stderr, "ps-export: out of memory\n");
    return 1;
  }
  int rc = ps_job_load(o.job_path, job, NULL, err);
  /* Refuse a model ONNX cannot express before reading any checkpoint. */
  if (rc == 0 && o.format == FORMAT_ONNX) rc = ps_onnx_check_spec(&job->model, err);
  if (rc) {
    fprintf(stderr, "ps-export: %s\n", err);
    free(job);
    return 1;
  }
  size_t P = job->model.n_params;
  float *params = ps_alloc(P * sizeof(float));
  if (!params) {
    fprintf(stderr, "ps-export: out of memory for %zu parameters\n", P);
    free(job);
    return 1;
  }
  ps_ckpt_source src = {.dir = o.ckpt_dir, .job_id = job->job_id, .P = P,
                        .want_tables = job->n_tables > 0 && o.format == FORMAT_NPY};
  ps_ckpt_restored got;
  rc = ps_ckpt_load_range(&src, 0, P, params, NULL, 0, 0, &got, err);
  if (rc) {
    fprintf(stderr, "ps-export: %s\n", err);
    if (rc == PS_ENOTFOUND)
      fprintf(stderr,
              "ps-export: is '%s' the directory ps-server wrote to, and '%s' the job it ran?\n",
              o.ckpt_dir, o.job_path);
    ps_free(params);
    free(job);
    return 1;
  }
  rc = export_params(&o, job, params, &got, err);
  if (rc) fprintf(stderr, "ps-export: %s\n", err);
  ps_ckpt_restored_free(&got);
  ps_free(params);
  free(job);
  return rc ? 1 : 0;
}

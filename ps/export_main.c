/* ps-export: the model's parameters from shard checkpoints (written with any
 * number of shards) as one NumPy .npy file per tensor, for use outside this
 * system (np.load, PyTorch, Keras). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/job.h"
#include "../common/util.h"
#include "checkpoint.h"

static void usage(FILE *f) {
  fprintf(f,
          "Usage: ps-export --job FILE --checkpoints DIR --out DIR [options]\n"
          "\n"
          "Writes the parameters of the job's model, restored from the newest usable set\n"
          "of shard checkpoints in DIR (written with any number of shards), as one NumPy\n"
          ".npy file per tensor: <layer>.w.npy (conv2d: OC, IC, KH, KW; dense: OUT, IN)\n"
          "and <layer>.b.npy, float32.\n"
          "\n"
          "  --job FILE           the job file the checkpoints were written for\n"
          "  --checkpoints DIR    the servers' checkpoint directory\n"
          "  --out DIR            where to write the .npy files (created if missing)\n"
          "  --log-level LEVEL    debug, info, warn or error (default info)\n"
          "  --help               this text\n"
          "\n"
          "Exit status: 0 done, 1 failed, 2 bad usage.\n");
}

int main(int argc, char **argv) {
  const char *job_path = NULL, *ckpt_dir = NULL, *out_dir = NULL;
  int level = PS_LOG_INFO;
  static const struct option opts[] = {
      {"job", required_argument, 0, 'j'}, {"checkpoints", required_argument, 0, 'c'},
      {"out", required_argument, 0, 'o'}, {"log-level", required_argument, 0, 'v'},
      {"help", no_argument, 0, 'h'},      {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 'j': job_path = optarg; break;
      case 'c': ckpt_dir = optarg; break;
      case 'o': out_dir = optarg; break;
      case 'v':
        level = ps_log_level_parse(optarg);
        if (level < 0) {
          fprintf(stderr, "ps-export: --log-level '%s': use debug, info, warn or error\n", optarg);
          return 2;
        }
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "ps-export: unexpected argument '%s' (see --help)\n", argv[optind]);
    return 2;
  }
  if (!job_path || !ckpt_dir || !out_dir) {
    fprintf(stderr, "ps-export: %s is required (see --help)\n",
            !job_path   ? "--job FILE"
            : !ckpt_dir ? "--checkpoints DIR"
                        : "--out DIR");
    return 2;
  }
  ps_log_init("ps-export", level);

  char err[PS_ERRLEN] = "";
  /* ps_job is large (the layer table): keep it off the stack. */
  ps_job *job = calloc(1, sizeof *job);
  if (!job) {
    fprintf(stderr, "ps-export: out of memory\n");
    return 1;
  }
  int rc = ps_job_load(job_path, job, NULL, err);
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
  ps_ckpt_source src = {.dir = ckpt_dir, .job_id = job->job_id, .P = P};
  ps_ckpt_restored got;
  rc = ps_ckpt_load_range(&src, 0, P, params, NULL, 0, 0, &got, err);
  if (rc == 0) free(got.cut);
  if (rc) {
    fprintf(stderr, "ps-export: %s\n", err);
    if (rc == PS_ENOTFOUND)
      fprintf(stderr,
              "ps-export: is '%s' the directory ps-server wrote to, and '%s' the job it ran?\n",
              ckpt_dir, job_path);
    ps_free(params);
    free(job);
    return 1;
  }
  int files = 0;
  rc = ps_ckpt_export_npy(&job->model, params, out_dir, &files, err);
  if (rc) {
    fprintf(stderr, "ps-export: %s\n", err);
  } else {
    char desc[512];
    ps_model_spec_describe(&job->model, desc, sizeof desc);
    PS_INFO(
        "wrote %d .npy files to '%s': job '%s', %s, from the %d-shard checkpoints "
        "(version %llu)",
        files, out_dir, job->job_id, desc, got.num_shards, (unsigned long long)got.version);
  }
  ps_free(params);
  free(job);
  return rc ? 1 : 0;
}

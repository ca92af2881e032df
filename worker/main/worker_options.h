/* ps-worker's flags: one table (worker_options.c) drives parsing, --help
 * and the README's flag table; TF_CONFIG is merged into the flags in one
 * place, ps_worker_opts_parse. */
#ifndef PS_WORKER_WORKER_OPTIONS_H
#define PS_WORKER_WORKER_OPTIONS_H

#include <stdint.h>

#include "common/cluster.h"
#include "common/security.h"

/* --straggle: none, fixed:A ms, uniform:A:B ms, exp:A (mean A ms) */
enum { PS_STRAGGLE_NONE, PS_STRAGGLE_FIXED, PS_STRAGGLE_UNIFORM, PS_STRAGGLE_EXP };

/* --pipeline */
typedef enum { PS_PIPELINE_ON, PS_PIPELINE_OFF, PS_PIPELINE_AUTO } ps_pipeline_mode;

typedef struct {
  const char *ps_addr;   /* the first server address (of --ps or TF_CONFIG); NULL with --local */
  const char *job_path, *metrics_path, *data_dir, *host, *save_path, *device, *precision;
  const char *tb_dir;    /* --tensorboard; NULL: none */
  int metrics_port;      /* the Prometheus endpoint's port (-1: none, 0: any) */
  const char *metrics_host, *metrics_token_file;
  int index;             /* -1: the registration order */
  int num_workers;       /* 0 until resolved; then >= 1 */
  int chief;             /* -1: decided once the rank is known */
  int local, evaluator, overlap;
  int max_evals, idle_evals;
  int threads, timeout_ms, straggle_ms;
  /* --straggle SPEC (or --straggle-ms N: fixed), parsed: the delay of every
   * step, drawn per step (ps_step_straggle_ms) */
  const char *straggle;
  int straggle_kind; /* PS_STRAGGLE_* */
  double straggle_a, straggle_b;
  int epochs;            /* -1: the job's */
  int64_t max_steps;     /* -1: the job's */
  int replicas, per_replica_batch;
  int pipeline;          /* a ps_pipeline_mode */
  int cuda_graphs;       /* --cuda-graphs: 0 on, 1 off (the choice's index) */
  int log_level;         /* PS_LOG_* */
  double log_interval;
  double eval_interval;  /* -1: the job's */
  double retry_s;
  ps_security_opts sec;  /* TLS, token, --insecure */
  int have_tf_config;    /* the cluster came from TF_CONFIG */
  /* storage the resolved strings point into */
  char ps_first[PS_ADDR_LEN];
  char hostname[64];
} ps_worker_opts;

/* Parses argv, merges TF_CONFIG when there is no --ps, and checks what
 * goes together. Returns 0 to go on; 1 when --help was printed (exit 0);
 * 2 on bad flags or a bad TF_CONFIG, with a message on stderr (exit 2). */
int ps_worker_opts_parse(ps_worker_opts *o, int argc, char **argv);

#endif

/* What the shard tests share: a job of the given model and optimizer with
 * fixed hyperparameters, and a shard of it. Include after check.h. */
#ifndef PS_TESTS_SHARD_FIXTURE_H
#define PS_TESTS_SHARD_FIXTURE_H

#include <string.h>

#include "common/job.h"
#include "ps/state/shard.h"

static inline ps_job fixture_job(const char *job_id, const char *spec, const char *optimizer,
                                 int sync) {
  ps_job job;
  memset(&job, 0, sizeof job);
  snprintf(job.job_id, sizeof job.job_id, "%s", job_id);
  char err[PS_ERRLEN] = "";
  int rc = ps_model_spec_parse(spec, &job.model, err);
  CHECK_MSG(rc == PS_OK, "spec: %s", err);
  snprintf(job.optim.name, sizeof job.optim.name, "%s", optimizer);
  job.optim.lr = 0.05f;
  job.optim.momentum = 0.9f;
  job.optim.beta1 = 0.9f;
  job.optim.beta2 = 0.999f;
  job.optim.eps = 1e-8f;
  job.optim.initial_accumulator = 0.1f;
  job.seed = 7;
  snprintf(job.mode, sizeof job.mode, "%s", sync ? "sync" : "async");
  job.mode_kind = sync ? PS_MODE_SYNC : PS_MODE_ASYNC;
  return job;
}

static inline ps_shard *fixture_shard(const ps_job *job, int index, int nshards) {
  char err[PS_ERRLEN] = "";
  ps_shard *s = ps_shard_create(job, index, nshards, err);
  CHECK_MSG(s != NULL, "create: %s", err);
  return s;
}

static inline size_t fixture_shard_len(const ps_shard *s) {
  return ps_shard_end(s) - ps_shard_begin(s);
}

#endif

/* Flat models ({"params": P}, common/model_spec.h): what Python workers'
 * jobs declare. Parsing (tensors tiling the vector, initializers), each
 * refusal naming the field, the initial values (per tensor, independent of
 * the shards), the one-line description, and a job around one. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/check.h"
#include "common/job.h"
#include "common/model_spec.h"
#include "common/util.h"

static ps_model_spec spec; /* large: off the stack */
static ps_job job;

static int parse(const char *json, char *err) { return ps_model_spec_parse(json, &spec, err); }

static void expect_error(const char *json, const char *needle) {
  char err[PS_ERRLEN] = "";
  int rc = parse(json, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, needle), "%s -> %d '%s', expected '%s'", json, rc, err,
            needle);
}

static void test_parse(void) {
  char err[PS_ERRLEN];
  CHECK(parse("{\"params\": 7}", err) == 0);
  CHECK(spec.flat && spec.n_params == 7 && spec.n_layers == 0 && spec.n_tensors == 0);
  CHECK(spec.flat_init.kind == PS_INIT_ZEROS);
  CHECK(parse("{\"params\": 42, \"init\": {\"uniform\": 0.5}, \"tensors\": ["
              "{\"name\": \"fc.weight\", \"shape\": [4, 10], \"init\": {\"normal\": 0.1}},"
              "{\"name\": \"fc.bias\", \"shape\": [2]}]}",
              err) == 0);
  CHECK(spec.n_tensors == 2 && !strcmp(spec.tensors[0].name, "fc.weight"));
  CHECK(spec.tensors[0].off == 0 && spec.tensors[0].count == 40 && spec.tensors[0].ndim == 2);
  CHECK(spec.tensors[0].shape[0] == 4 && spec.tensors[0].shape[1] == 10);
  CHECK(spec.tensors[0].init.kind == PS_INIT_NORMAL && spec.tensors[0].init.value == 0.1f);
  CHECK(spec.tensors[1].off == 40 && spec.tensors[1].count == 2);
  CHECK(spec.tensors[1].init.kind == PS_INIT_UNIFORM && spec.tensors[1].init.value == 0.5f);
  CHECK(parse("{\"params\": 1, \"init\": {\"constant\": -2}}", err) == 0);
  CHECK(spec.flat_init.kind == PS_INIT_CONSTANT && spec.flat_init.value == -2.0f);
}

static void test_refusals(void) {
  expect_error("{\"params\": 0}", "'params' must be an integer");
  expect_error("{\"params\": 2.5}", "'params' must be an integer");
  expect_error("{\"params\": 4294967296}", "'params' must be an integer");
  expect_error("{\"params\": 4, \"layers\": []}", "unknown field 'layers'");
  expect_error("{\"params\": 4, \"init\": \"ones\"}", "'init' must be");
  expect_error("{\"params\": 4, \"init\": {\"uniform\": -1}}",
               "'uniform' must be a finite number >= 0");
  expect_error("{\"params\": 4, \"init\": {\"uniform\": 1, \"normal\": 1}}", "'init' must be");
  expect_error("{\"params\": 4, \"tensors\": []}", "'tensors' must be a list of 1 to");
  expect_error("{\"params\": 4, \"tensors\": [{\"shape\": [4]}]}", "'name' is required");
  expect_error("{\"params\": 4, \"tensors\": [{\"name\": \"a b\", \"shape\": [4]}]}",
               "'name' is required");
  expect_error(
      "{\"params\": 4, \"tensors\": [{\"name\": \"a\", \"shape\": [2]}, "
      "{\"name\": \"a\", \"shape\": [2]}]}",
      "tensor 'a': the name is given twice");
  expect_error("{\"params\": 4, \"tensors\": [{\"name\": \"a\", \"shape\": [0]}]}",
               "tensor 'a': 'shape'[0] must be a positive integer");
  expect_error("{\"params\": 4, \"tensors\": [{\"name\": \"a\", \"shape\": [1,1,1,1,1,1,1]}]}",
               "'shape' must be a list of 1 to 6");
  expect_error("{\"params\": 4, \"tensors\": [{\"name\": \"a\", \"shape\": [3]}]}",
               "the tensors hold 3 values but 'params' is 4");
  expect_error("{\"params\": 4, \"tensors\": [{\"name\": \"a\", \"shape\": [5]}]}",
               "tensor 'a': the tensors hold more than 'params' (4)");
  expect_error("{\"params\": 4, \"tensors\": [{\"name\": \"a\", \"shape\": [4], \"x\": 1}]}",
               "unknown field 'x'");
}

/* Each tensor's init, the same whichever range a shard asks for. */
static void test_init(void) {
  char err[PS_ERRLEN];
  CHECK(parse("{\"params\": 20010, \"init\": {\"constant\": 3}, \"tensors\": ["
              "{\"name\": \"u\", \"shape\": [10000], \"init\": {\"uniform\": 0.5}},"
              "{\"name\": \"n\", \"shape\": [100, 100], \"init\": {\"normal\": 2}},"
              "{\"name\": \"z\", \"shape\": [5], \"init\": \"zeros\"},"
              "{\"name\": \"c\", \"shape\": [5]}]}",
              err) == 0);
  const size_t P = spec.n_params;
  float *all = malloc(P * sizeof *all), *part = malloc(P * sizeof *part);
  ps_model_init_params(&spec, 7, 0, P, all);
  double umax = 0, usum = 0, nsum = 0, nsq = 0;
  for (size_t i = 0; i < 10000; i++) {
    umax = fmax(umax, fabs(all[i]));
    usum += all[i];
  }
  for (size_t i = 10000; i < 20000; i++) nsum += all[i], nsq += (double)all[i] * all[i];
  CHECK(umax <= 0.5 && umax > 0.49 && fabs(usum / 10000) < 0.02);
  CHECK_NEAR(sqrt(nsq / 10000 - (nsum / 10000) * (nsum / 10000)), 2.0, 0.1, 0);
  int tail = 1;
  for (size_t i = 20000; i < 20005; i++) tail &= all[i] == 0.0f;
  for (size_t i = 20005; i < P; i++) tail &= all[i] == 3.0f;
  CHECK(tail);
  /* Any window, as a shard's range: the same values. */
  const size_t cuts[][2] = {{0, 1}, {9990, 10020}, {123, 20007}, {20004, 20010}};
  for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
    ps_model_init_params(&spec, 7, cuts[k][0], cuts[k][1], part);
    CHECK(memcmp(part, all + cuts[k][0], (cuts[k][1] - cuts[k][0]) * sizeof *part) == 0);
  }
  /* Another seed, other values. */
  ps_model_init_params(&spec, 8, 0, 10, part);
  CHECK(memcmp(part, all, 10 * sizeof *part) != 0);
  /* No tensors: the model's init everywhere. */
  CHECK(parse("{\"params\": 100, \"init\": {\"uniform\": 0.01}}", err) == 0);
  ps_model_init_params(&spec, 1, 0, 100, part);
  int small = 1, any = 0;
  for (int i = 0; i < 100; i++) small &= fabsf(part[i]) <= 0.01f, any |= part[i] != 0.0f;
  CHECK(small && any);
  free(all);
  free(part);
}

static void test_describe_and_job(void) {
  char err[PS_ERRLEN], buf[256];
  CHECK(parse("{\"params\": 12, \"tensors\": [{\"name\": \"a\", \"shape\": [3, 4]}]}", err) == 0);
  ps_model_spec_describe(&spec, buf, sizeof buf);
  CHECK_MSG(!strcmp(buf, "flat(1 tensors, no layers) P=12"), "'%s'", buf);
  CHECK(parse("{\"params\": 12}", err) == 0);
  ps_model_spec_describe(&spec, buf, sizeof buf);
  CHECK_MSG(!strcmp(buf, "flat(no layers) P=12"), "'%s'", buf);
  ps_moving_range mr[PS_MAX_MOVING_RANGES];
  CHECK(ps_model_moving_ranges(&spec, mr) == 0);
  /* A job of a flat model, with tables, leases and sync: accepted. */
  int rc = ps_job_parse(
      "{\"job_id\": \"flat\", \"model\": {\"params\": 9}, \"mode\": \"sync\","
      " \"lease_chunk\": 10, \"optimizer\": {\"name\": \"sgd\", \"lr\": 0.1},"
      " \"embeddings\": [{\"name\": \"e\", \"rows\": 10, \"dim\": 2}]}",
      &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(job.model.flat && job.model.n_params == 9 && job.n_tables == 1 && job.lease_chunk == 10);
  /* ps-worker's check: refused with a message that says why. */
  CHECK(ps_job_check_layers(&job, err) == PS_EINVAL && strstr(err, "no layers") &&
        strstr(err, "'flat'"));
  CHECK(ps_job_parse("{\"job_id\": \"l\", \"model\": {\"input\": [1, 1, 4], \"classes\": 2, "
                     "\"layers\": [{\"type\": \"dense\", \"units\": 2}, "
                     "{\"type\": \"softmax_xent\"}]}}",
                     &job, err) == 0);
  CHECK(ps_job_check_layers(&job, err) == 0);
}

int main(void) {
  test_parse();
  test_refusals();
  test_init();
  test_describe_and_job();
  return check_summary();
}

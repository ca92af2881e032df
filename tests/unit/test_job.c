/* Job file: every field, defaults, validation messages, file errors. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "common/job.h"
#include "common/keras.h"
#include "common/util.h"
#include "tests/unit/check.h"

#define MODEL                                                                       \
  "{\"input\": [1, 28, 28], \"classes\": 10, \"layers\": [{\"type\": \"flatten\"}," \
  "{\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}"

static void test_full_job(void) {
  const char *text =
      "{\"job_id\": \"fmnist-cnn.v2_a\", \"model\": " MODEL
      ","
      " \"optimizer\": {\"name\": \"momentum\", \"lr\": 0.05, \"beta1\": 0.8, \"beta2\": 0.99,"
      "   \"eps\": 1e-6, \"momentum\": 0.95, \"nesterov\": true, \"initial_accumulator\": 0.2},"
      " \"seed\": 1234567890123, \"batch_size\": 128, \"epochs\": 3, \"max_steps\": 500,"
      " \"mode\": \"async\","
      " \"dataset\": {\"name\": \"synthetic\", \"dir\": \"/tmp/x\", \"train_size\": 100,"
      "   \"test_size\": 20},"
      " \"eval_interval_s\": 2.5, \"heartbeat_timeout_ms\": 1500}";
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = ps_job_parse(text, &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(strcmp(job.job_id, "fmnist-cnn.v2_a") == 0);
  CHECK(job.model.n_params == 7850 && job.model.classes == 10);
  CHECK(strcmp(job.optim.name, "momentum") == 0);
  CHECK(job.optim.lr == 0.05f && job.optim.beta1 == 0.8f && job.optim.beta2 == 0.99f);
  CHECK(job.optim.eps == 1e-6f && job.optim.momentum == 0.95f && job.optim.nesterov == 1);
  CHECK(job.optim.initial_accumulator == 0.2f);
  CHECK(job.seed == 1234567890123ULL);
  CHECK(job.batch_size == 128 && job.epochs == 3 && job.max_steps == 500);
  CHECK(strcmp(job.mode, "async") == 0);
  CHECK(strcmp(job.dataset, "synthetic") == 0 && strcmp(job.data_dir, "/tmp/x") == 0);
  CHECK(job.synthetic_train == 100 && job.synthetic_test == 20);
  CHECK(job.eval_interval_s == 2.5 && job.heartbeat_timeout_ms == 1500);
}

static void test_defaults(void) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = ps_job_parse("{\"job_id\": \"j\", \"model\": " MODEL "}", &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(strcmp(job.job_id, "j") == 0);
  CHECK(strcmp(job.optim.name, "adam") == 0);
  CHECK(job.optim.lr == 0.001f && job.optim.beta1 == 0.9f && job.optim.beta2 == 0.999f);
  CHECK(job.optim.eps == 1e-8f && job.optim.momentum == 0.9f && job.optim.nesterov == 0);
  CHECK(job.optim.initial_accumulator == 0.1f);
  CHECK(job.seed == 1 && job.batch_size == 64 && job.epochs == 1 && job.max_steps == 0);
  CHECK(strcmp(job.mode, "async") == 0);
  CHECK(strcmp(job.dataset, "fashion-mnist") == 0);
  CHECK(strcmp(job.data_dir, "/usr/share/datasets/fashion-mnist") == 0);
  CHECK(job.synthetic_train == 2048 && job.synthetic_test == 512);
  CHECK(job.eval_interval_s == 30.0 && job.heartbeat_timeout_ms == 10000);
  CHECK(job.replicas_per_shard == 1 && job.replica_heartbeat_ms == 100 &&
        job.replica_lease_ms == 500);

  /* A partial optimizer keeps the other defaults; each data set has its
   * own default directory. */
  rc = ps_job_parse("{\"job_id\": \"j\", \"model\": " MODEL
                    ", \"optimizer\": {\"name\": "
                    "\"sgd\"}, \"dataset\": {\"name\": \"mnist\"}}",
                    &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(strcmp(job.optim.name, "sgd") == 0 && job.optim.lr == 0.001f);
  CHECK(strcmp(job.data_dir, "/usr/share/datasets/mnist") == 0);
  rc = ps_job_parse("{\"job_id\": \"j\", \"model\": " MODEL
                    ", \"dataset\": {\"name\": \"synthetic\"}}",
                    &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(job.data_dir[0] == '\0' && job.synthetic_train == 2048 && job.synthetic_test == 512);
}

/* The job made of `fields` (text after the required ones) must fail with a
 * message containing want. */
static void expect_error(const char *fields, const char *want) {
  char text[2048];
  snprintf(text, sizeof text, "{\"job_id\": \"j\", \"model\": " MODEL "%s}", fields);
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = ps_job_parse(text, &job, err);
  CHECK_MSG(rc == PS_EINVAL, "rc %d for %s", rc, fields);
  CHECK_MSG(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

static void expect_error_text(const char *text, const char *want) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = ps_job_parse(text, &job, err);
  CHECK_MSG(rc == PS_EINVAL, "rc %d for %s", rc, text);
  CHECK_MSG(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

static void test_invalid(void) {
  expect_error_text("{\"model\": " MODEL "}", "'job_id' is required");
  expect_error_text("{\"job_id\": \"\", \"model\": " MODEL "}", "'job_id' must be");
  expect_error_text("{\"job_id\": \"a b\", \"model\": " MODEL "}", "[A-Za-z0-9._-]");
  expect_error_text("{\"job_id\": \"a/b\", \"model\": " MODEL "}", "'job_id'");
  expect_error_text("{\"job_id\": 7, \"model\": " MODEL "}", "'job_id'");
  char id64[400];
  snprintf(id64, sizeof id64, "{\"job_id\": \"%064d\", \"model\": " MODEL "}", 0);
  expect_error_text(id64, "1..63 characters");
  expect_error_text("{\"job_id\": \"j\"}", "'model' is required");
  expect_error_text(
      "{\"job_id\": \"j\", \"model\": {\"input\": [1, 2, 2], \"classes\": 3, "
      "\"layers\": [{\"type\": \"dense\", \"units\": 0}]}}",
      "layer 0 (dense): 'units' must be a positive integer");
  expect_error_text("[1, 2]", "the job must be a JSON object");
  expect_error_text("{\"job_id\": \"j\", \"job_id\": \"k\", \"model\": " MODEL "}", "duplicate");
  expect_error_text("{\"job_id\": \"j\", ", "JSON syntax error at line 1, column");

  expect_error(", \"learning_rate\": 0.1", "unknown field 'learning_rate'");
  /* Replicated shards. */
  expect_error(", \"replicas_per_shard\": 0", "'replicas_per_shard'");
  expect_error(", \"replicas_per_shard\": 6", "'replicas_per_shard'");
  expect_error(", \"replicas_per_shard\": 2.5", "'replicas_per_shard'");
  expect_error(", \"replica_heartbeat_ms\": 200, \"replica_lease_ms\": 500",
               "at least 3 x 'replica_heartbeat_ms'");
  expect_error(", \"optimizer\": {\"name\": \"rmsprop\"}",
               "'optimizer.name' 'rmsprop' is not known");
  expect_error(", \"optimizer\": {\"name\": 3}", "'optimizer.name'");
  expect_error(", \"optimizer\": \"adam\"", "'optimizer' must be an object");
  expect_error(", \"optimizer\": {\"lr\": 0}", "'optimizer.lr' must be a finite number > 0");
  expect_error(", \"optimizer\": {\"lr\": -0.1}", "'optimizer.lr'");
  expect_error(", \"optimizer\": {\"lr\": \"0.1\"}", "'optimizer.lr'");
  expect_error(", \"optimizer\": {\"lr\": 1e300}", "'optimizer.lr'");
  expect_error(", \"optimizer\": {\"lr\": 1e-60}", "'optimizer.lr'");
  expect_error(", \"optimizer\": {\"beta1\": 1.0}",
               "'optimizer.beta1' must be a finite number in [0, 1)");
  expect_error(", \"optimizer\": {\"beta2\": -0.5}", "'optimizer.beta2'");
  expect_error(", \"optimizer\": {\"eps\": 0}", "'optimizer.eps'");
  expect_error(", \"optimizer\": {\"momentum\": 1.5}", "'optimizer.momentum'");
  expect_error(", \"optimizer\": {\"initial_accumulator\": -1}", "'optimizer.initial_accumulator'");
  expect_error(", \"optimizer\": {\"nesterov\": \"yes\"}",
               "'optimizer.nesterov' must be true or false");
  expect_error(", \"optimizer\": {\"learning_rate\": 0.1}",
               "unknown field 'optimizer.learning_rate'");
  expect_error(", \"seed\": -1", "'seed' must be an integer");
  expect_error(", \"seed\": 1.5", "'seed'");
  expect_error(", \"batch_size\": 0", "'batch_size' must be an integer in 1..65536");
  expect_error(", \"batch_size\": 65537", "'batch_size' must be an integer in 1..65536");
  expect_error(", \"epochs\": 0", "'epochs'");
  expect_error(", \"max_steps\": -1", "'max_steps'");
  expect_error(", \"mode\": \"bsp\"", "mode 'bsp' is not known (async, ssp:K or sync)");
  expect_error(", \"mode\": \"ssp:\"", "ssp needs a bound K >= 0");
  expect_error(", \"mode\": \"ssp:-1\"", "ssp needs a bound K >= 0");
  expect_error(", \"mode\": \"ssp:2x\"", "ssp needs a bound K >= 0");
  expect_error(", \"backup_workers\": 1", "'backup_workers' applies only to mode sync");
  expect_error(", \"mode\": \"sync\", \"staleness_aware_lr\": true",
               "'staleness_aware_lr' applies to async and ssp");
  expect_error(", \"staleness_aware_lr\": 1", "'staleness_aware_lr' must be true or false");
  expect_error(", \"shuffle\": \"no\"", "'shuffle' must be true or false");
  expect_error(", \"wait_timeout_ms\": 0", "'wait_timeout_ms' must be an integer");
  expect_error(", \"mode\": 1", "'mode' must be a string");
  expect_error(", \"dataset\": {\"name\": \"imagenet\"}", "'dataset.name' 'imagenet' is not known");
  expect_error(", \"dataset\": \"mnist\"", "'dataset' must be an object");
  expect_error(", \"dataset\": {\"name\": \"mnist\", \"path\": \"/x\"}",
               "unknown field 'dataset.path'");
  expect_error(", \"dataset\": {\"train_size\": 10}", "apply only to the synthetic or ctr-synthetic or criteo dataset");
  expect_error(", \"dataset\": {\"name\": \"synthetic\", \"train_size\": 0}",
               "'dataset.train_size'");
  expect_error(", \"dataset\": {\"name\": \"synthetic\", \"test_size\": \"5\"}",
               "'dataset.test_size'");
  expect_error(", \"dataset\": {\"dir\": 5}", "'dataset.dir' must be a string");
  char longdir[600];
  snprintf(longdir, sizeof longdir, ", \"dataset\": {\"dir\": \"/%0300d\"}", 0);
  expect_error(longdir, "'dataset.dir' is too long");
  expect_error(", \"eval_interval_s\": -1", "'eval_interval_s' must be a finite number >= 0");
  expect_error(", \"heartbeat_timeout_ms\": 0", "'heartbeat_timeout_ms'");
}

/* Writes text to a fresh temporary file; its path into path (64 bytes). */
static int write_temp(const char *text, char *path) {
  snprintf(path, 64, "/tmp/test_job_XXXXXX");
  int fd = mkstemp(path);
  if (fd < 0) return -1;
  size_t n = strlen(text);
  int ok = write(fd, text, n) == (ssize_t)n;
  close(fd);
  return ok ? 0 : -1;
}

static void test_load(void) {
  char path[64], err[PS_ERRLEN] = "";
  ps_job job;
  char *text = NULL;

  const char *good = "{\n  \"job_id\": \"from-file\",\n  \"model\": " MODEL "\n}\n";
  CHECK(write_temp(good, path) == 0);
  int rc = ps_job_load(path, &job, &text, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(text != NULL && strcmp(text, good) == 0);
  CHECK(strcmp(job.job_id, "from-file") == 0);
  free(text);
  rc = ps_job_load(path, &job, NULL, err); /* text_out is optional */
  CHECK(rc == 0);
  unlink(path);

  /* Syntax error: the missing comma is found at the start of line 3. */
  const char *bad = "{\n  \"job_id\": \"x\"\n  \"model\": {}\n}\n";
  CHECK(write_temp(bad, path) == 0);
  text = (char *)1;
  rc = ps_job_load(path, &job, &text, err);
  CHECK(rc == PS_EINVAL);
  CHECK(text == NULL);
  CHECK_MSG(strstr(err, path) != NULL, "%s", err);
  CHECK_MSG(strstr(err, "line 3, column 9") != NULL, "%s", err);
  unlink(path);

  /* A validation error names the file too. */
  CHECK(write_temp("{\"job_id\": \"x\", \"model\": " MODEL ", \"batch_size\": 0}", path) == 0);
  rc = ps_job_load(path, &job, NULL, err);
  CHECK(rc == PS_EINVAL);
  CHECK_MSG(strstr(err, path) == err && strstr(err, "'batch_size'") != NULL, "%s", err);
  unlink(path);

  /* A missing file says so, with its name. */
  rc = ps_job_load("/nonexistent/job.json", &job, &text, err);
  CHECK(rc != 0);
  CHECK(text == NULL);
  CHECK_MSG(strstr(err, "/nonexistent/job.json") != NULL, "%s", err);
  CHECK_MSG(strstr(err, "No such file") != NULL, "%s", err);
}

/* The consistency modes and their options. */
static void test_modes(void) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  CHECK(ps_job_parse("{\"job_id\": \"j\", \"model\": " MODEL ", \"mode\": \"ssp:3\", "
                     "\"staleness_aware_lr\": true, \"wait_timeout_ms\": 500}",
                     &job, err) == 0);
  CHECK(job.mode_kind == PS_MODE_SSP && job.ssp_k == 3 && job.staleness_aware_lr == 1 &&
        job.wait_timeout_ms == 500 && strcmp(job.mode, "ssp:3") == 0);
  CHECK(ps_job_parse("{\"job_id\": \"j\", \"model\": " MODEL ", \"mode\": \"sync\", "
                     "\"backup_workers\": 1, \"shuffle\": false}",
                     &job, err) == 0);
  CHECK(job.mode_kind == PS_MODE_SYNC && job.backup_workers == 1 && job.shuffle == 0);
  CHECK(ps_job_parse("{\"job_id\": \"j\", \"model\": " MODEL "}", &job, err) == 0);
  CHECK(job.mode_kind == PS_MODE_ASYNC && job.shuffle == 1 && job.backup_workers == 0 &&
        job.wait_timeout_ms == 60000);
}

/* "model": {"keras": FILE}: FILE (relative to the job file's directory)
 * is translated as ps-import-keras does; the job's text carries the
 * translation, which parses to the same job with no file; errors name the
 * file. */
static void test_keras_model(void) {
  char dir[] = "/tmp/test_job_keras_XXXXXX", path[128], kpath[128], err[PS_ERRLEN] = "";
  CHECK(mkdtemp(dir) != NULL);
  char *fixture = NULL;
  CHECK_MSG(ps_read_file(KERAS_FIXTURES "/tf2_conv_bn.json", &fixture, NULL, err) == 0, "%s",
            err);
  snprintf(kpath, sizeof kpath, "%s/model.json", dir);
  FILE *f = fopen(kpath, "w");
  CHECK(f != NULL);
  if (!f || !fixture) return;
  fputs(fixture, f);
  fclose(f);
  snprintf(path, sizeof path, "%s/job.json", dir);
  f = fopen(path, "w");
  fputs("{\"job_id\": \"k\", \"model\": {\"keras\": \"model.json\"}, \"batch_size\": 8}", f);
  fclose(f);
  ps_job job, again;
  char *text = NULL;
  int rc = ps_job_load(path, &job, &text, err);
  CHECK_MSG(rc == 0, "%s", err);
  void *spec = NULL;
  CHECK(ps_keras_to_spec(fixture, &spec, NULL, 0, err) == 0);
  ps_model_spec want;
  CHECK(spec && ps_model_spec_from_json(spec, &want, err) == 0);
  if (spec) json_decref(spec);
  CHECK(rc == 0 && job.model.n_params == want.n_params && job.model.n_layers == want.n_layers &&
        job.batch_size == 8);
  int bn = 0;
  for (int i = 0; i < job.model.n_layers; i++) bn |= job.model.layers[i].type == PS_LAYER_BATCHNORM;
  CHECK_MSG(bn, "the fixture's BatchNormalization is in the spec");
  CHECK(text && !strstr(text, "\"keras\"") && strstr(text, "\"layers\""));
  CHECK_MSG(text && ps_job_parse(text, &again, err) == 0, "%s", err);
  CHECK(again.model.n_params == job.model.n_params && strcmp(again.job_id, "k") == 0);
  free(text);
  /* The same model given as text (not from a file): refused, with why. */
  rc = ps_job_parse("{\"job_id\": \"k\", \"model\": {\"keras\": \"model.json\"}}", &again, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "names a file, read when the job is loaded"), "%s", err);
  /* A missing file, a file Keras's JSON of an unsupported model, extra keys. */
  f = fopen(path, "w");
  fputs("{\"job_id\": \"k\", \"model\": {\"keras\": \"nope.json\"}}", f);
  fclose(f);
  rc = ps_job_load(path, &job, NULL, err);
  CHECK_MSG(rc != 0 && strstr(err, "nope.json") && strstr(err, "No such file"), "%s", err);
  f = fopen(path, "w");
  fprintf(f, "{\"job_id\": \"k\", \"model\": {\"keras\": \"%s\"}}",
          KERAS_FIXTURES "/tf2_dilated.json");
  fclose(f);
  rc = ps_job_load(path, &job, NULL, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "tf2_dilated.json") && strstr(err, "dilation"), "%s",
            err);
  f = fopen(path, "w");
  fputs("{\"job_id\": \"k\", \"model\": {\"keras\": \"model.json\", \"classes\": 3}}", f);
  fclose(f);
  rc = ps_job_load(path, &job, NULL, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "with 'keras' nothing else"), "%s", err);
  unlink(path);
  unlink(kpath);
  rmdir(dir);
  free(fixture);
}

/* Every job the project ships (deploy/jobs/ and tests/integration/jobs/)
 * parses, but broken.json, which is broken on purpose: a job file that a
 * spec change broke is found here, not by a user. The directories come
 * from the command line (ctest passes them). */
static const char *g_job_dirs[4];
static int g_n_job_dirs;

static void test_shipped_jobs(void) {
  int seen = 0;
  for (int d = 0; d < g_n_job_dirs; d++) {
    DIR *dir = opendir(g_job_dirs[d]);
    CHECK_MSG(dir != NULL, "cannot open %s", g_job_dirs[d]);
    if (!dir) continue;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
      size_t len = strlen(e->d_name);
      if (len < 6 || strcmp(e->d_name + len - 5, ".json") != 0) continue;
      if (strcmp(e->d_name, "broken.json") == 0) continue;
      char path[1024], err[PS_ERRLEN] = "";
      snprintf(path, sizeof path, "%s/%s", g_job_dirs[d], e->d_name);
      ps_job job;
      char *text = NULL;
      int rc = ps_job_load(path, &job, &text, err);
      free(text);
      CHECK_MSG(rc == 0, "%s: %s", path, err);
      seen++;
    }
    closedir(dir);
  }
  CHECK_MSG(g_n_job_dirs == 0 || seen > 0, "no job files found");
  if (g_n_job_dirs) printf("%d shipped job files parse\n", seen);
}

/* Click-through jobs: embedding layers name the job's tables, the click
 * log data sets want a binary model with ids. */
#define CTR_MODEL                                                                        \
  "{\"input\": [13, 1, 1], \"ids\": 26, \"classes\": 1, \"layers\": ["                      \
  "{\"type\": \"embedding\", \"name\": \"e\", \"table\": \"cat\", \"dim\": 4},"                \
  "{\"type\": \"concat\", \"inputs\": [\"input\", \"e\"]},"                                \
  "{\"type\": \"dense\", \"units\": 1}, {\"type\": \"sigmoid_xent\"}]}"
static void test_ctr_jobs(void) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = ps_job_parse("{\"job_id\": \"c\", \"model\": " CTR_MODEL
                        ", \"embeddings\": [{\"name\": \"x\", \"rows\": 10, \"dim\": 2}, "
                        "{\"name\": \"cat\", \"rows\": 0, \"dim\": 4}], \"dataset\": {\"name\": "
                        "\"ctr-synthetic\", \"train_size\": 100, \"vocab\": 50, \"zipf\": 1.2, "
                        "\"data_seed\": 3}}",
                        &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(job.model.layers[0].table_index == 1 && job.model.n_ids == 26);
  CHECK(job.ctr_vocab == 50 && job.ctr_zipf == 1.2 && job.ctr_seed == 3);
  CHECK(job.synthetic_train == 100 && job.synthetic_test == 512);
  rc = ps_job_parse("{\"job_id\": \"c\", \"model\": " CTR_MODEL
                    ", \"embeddings\": [{\"name\": \"cat\", \"rows\": 0, \"dim\": 4}], "
                    "\"dataset\": {\"name\": \"criteo\", \"train\": \"a.tsv\", \"test\": \"b.tsv\"}}",
                    &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(job.synthetic_train == 0 && job.synthetic_test == 0); /* whole files */
  expect_error_text("{\"job_id\": \"c\", \"model\": " CTR_MODEL "}",
                    "table 'cat' is not one of the job's \"embeddings\"");
  expect_error_text("{\"job_id\": \"c\", \"model\": " CTR_MODEL
                    ", \"embeddings\": [{\"name\": \"cat\", \"rows\": 0, \"dim\": 8}]}",
                    "'dim' is 4 but table 'cat' has rows of 8 values");
  expect_error_text("{\"job_id\": \"c\", \"model\": " CTR_MODEL
                    ", \"embeddings\": [{\"name\": \"cat\", \"rows\": 0, \"dim\": 4}], "
                    "\"dataset\": {\"name\": \"criteo\", \"train\": \"a.tsv\"}}",
                    "criteo");
  expect_error_text("{\"job_id\": \"c\", \"model\": " CTR_MODEL
                    ", \"embeddings\": [{\"name\": \"cat\", \"rows\": 0, \"dim\": 4}], "
                    "\"dataset\": {\"name\": \"ctr-synthetic\", \"zipf\": -1}}",
                    "'dataset.zipf' must be a number in [0, 20]");
  /* Click logs for a model without ids or with classes > 1. */
  expect_error(", \"dataset\": {\"name\": \"ctr-synthetic\"}",
               "the model needs \"classes\": 1 (ending in sigmoid_xent) and \"ids\"");
  expect_error(", \"dataset\": {\"name\": \"fashion-mnist\", \"vocab\": 10}",
               "apply only to the ctr-synthetic dataset");
}

int main(int argc, char **argv) {
  for (int a = 1; a < argc && g_n_job_dirs < 4; a++) g_job_dirs[g_n_job_dirs++] = argv[a];
  RUN(test_full_job);
  RUN(test_modes);
  RUN(test_defaults);
  RUN(test_invalid);
  RUN(test_ctr_jobs);
  RUN(test_load);
  RUN(test_keras_model);
  RUN(test_shipped_jobs);
  return check_summary();
}

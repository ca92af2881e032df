/* Cluster spec: --ps lists and TF_CONFIG. */
#include <stdlib.h>
#include <string.h>

#include "common/cluster.h"
#include "common/util.h"
#include "tests/unit/check.h"

/* ps_cluster is large (64 KiB): one instance, reused. */
static ps_cluster C;

static void test_ps_list_valid(void) {
  char err[PS_ERRLEN] = "";
  memset(&C, 0, sizeof C);
  int rc = ps_cluster_parse_ps_list("localhost:2222", &C, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(C.n_ps == 1 && strcmp(C.ps[0], "localhost:2222") == 0);

  rc = ps_cluster_parse_ps_list(
      "ps-0.ps.default.svc.cluster.local:2222, 10.0.0.7:1,[::1]:65535,[fe80::1%eth0]:80,h_1:9", &C,
      err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(C.n_ps == 5);
  CHECK(strcmp(C.ps[0], "ps-0.ps.default.svc.cluster.local:2222") == 0);
  CHECK(strcmp(C.ps[1], "10.0.0.7:1") == 0); /* spaces around entries trimmed */
  CHECK(strcmp(C.ps[2], "[::1]:65535") == 0);
  CHECK(strcmp(C.ps[3], "[fe80::1%eth0]:80") == 0);
  CHECK(strcmp(C.ps[4], "h_1:9") == 0);

  /* The largest list fits. */
  char *big = malloc(PS_MAX_TASKS * 16 + 1);
  CHECK(big != NULL);
  if (!big) return;
  big[0] = '\0';
  for (int i = 0; i < PS_MAX_TASKS; i++)
    sprintf(big + strlen(big), "%sh%d:%d", i ? "," : "", i, 1000 + i);
  rc = ps_cluster_parse_ps_list(big, &C, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(C.n_ps == PS_MAX_TASKS && strcmp(C.ps[PS_MAX_TASKS - 1], "h255:1255") == 0);
  strcat(big, ",extra:1");
  rc = ps_cluster_parse_ps_list(big, &C, err);
  CHECK(rc == PS_EINVAL && strstr(err, "more than 256 entries") != NULL);
  free(big);
}

static void expect_list_error(const char *csv, const char *want) {
  char err[PS_ERRLEN] = "";
  /* On error the spec is left as it was. */
  CHECK(ps_cluster_parse_ps_list("keep:1", &C, err) == 0);
  int rc = ps_cluster_parse_ps_list(csv, &C, err);
  CHECK_MSG(rc == PS_EINVAL, "rc %d for '%s'", rc, csv);
  CHECK_MSG(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
  CHECK(C.n_ps == 1 && strcmp(C.ps[0], "keep:1") == 0);
}

static void test_ps_list_invalid(void) {
  expect_list_error("", "entry 0 is empty");
  expect_list_error("a:1,,b:2", "entry 1 is empty");
  expect_list_error("a:1,", "entry 1 is empty");
  expect_list_error("localhost", "entry 0 'localhost': missing ':port'");
  expect_list_error("a:1,b:", "entry 1 'b:': missing port");
  expect_list_error(":2222", "missing host");
  expect_list_error("h:0", "'h:0': the port is outside 1..65535");
  expect_list_error("h:65536", "outside 1..65535");
  expect_list_error("h:999999999999", "outside 1..65535");
  expect_list_error("h:-1", "the port is not a number");
  expect_list_error("h:+80", "the port is not a number");
  expect_list_error("h:80x", "the port is not a number");
  expect_list_error("::1:2222", "an IPv6 address must be in brackets");
  expect_list_error("[::1:2222", "must be written [addr]:port");
  expect_list_error("[::g]:2222", "not a valid IPv6 address");
  expect_list_error("[]:2222", "must be written [addr]:port");
  expect_list_error("256.1.1.1:80", "not a valid IPv4 address");
  expect_list_error("1.2.3:80", "not a valid IPv4 address");
  expect_list_error("my host:80", "not allowed in a host name");
  expect_list_error("a..b:80", "not a valid host name");
  expect_list_error("h:1,g:2,h:1", "'h:1' appears twice (entries 0 and 2)");
  char longer[200];
  memset(longer, 'a', 150);
  strcpy(longer + 150, ":1");
  expect_list_error(longer, "longer than 127 characters");
  char err[PS_ERRLEN] = "";
  CHECK(ps_cluster_parse_ps_list(NULL, &C, err) == PS_EINVAL);
}

static void test_tf_config_valid(void) {
  char err[PS_ERRLEN] = "";
  int rc = ps_cluster_from_tf_config(
      "{\"cluster\": {\"ps\": [\"ps0:2222\", \"ps1:2222\"], \"worker\": [\"w0:2222\", "
      "\"w1:2222\", \"w2:2222\"], \"chief\": [\"c0:2222\"]},"
      " \"task\": {\"type\": \"worker\", \"index\": 2}, \"environment\": \"cloud\"}",
      &C, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(C.n_ps == 2 && strcmp(C.ps[1], "ps1:2222") == 0);
  CHECK(C.n_workers == 3 && strcmp(C.workers[2], "w2:2222") == 0);
  CHECK(C.n_chief == 1 && strcmp(C.chief, "c0:2222") == 0);
  CHECK(strcmp(C.task_type, "worker") == 0 && C.task_index == 2);

  rc = ps_cluster_from_tf_config(
      "{\"cluster\": {\"ps\": [\"[::1]:2222\"]}, \"task\": {\"type\": \"ps\", \"index\": 0}}", &C,
      err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(C.n_ps == 1 && C.n_workers == 0 && C.n_chief == 0 && C.chief[0] == '\0');
  CHECK(strcmp(C.task_type, "ps") == 0 && C.task_index == 0);

  rc = ps_cluster_from_tf_config(
      "{\"cluster\": {\"ps\": [\"p:1\"], \"chief\": [\"c:1\"]}, \"task\": {\"type\": \"chief\", "
      "\"index\": 0}}",
      &C, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(strcmp(C.task_type, "chief") == 0 && C.task_index == 0);

  /* The evaluator has no list of its own: any index is fine. */
  rc = ps_cluster_from_tf_config(
      "{\"cluster\": {\"ps\": [\"p:1\"]}, \"task\": {\"type\": \"evaluator\", \"index\": 5}}", &C,
      err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(strcmp(C.task_type, "evaluator") == 0 && C.task_index == 5);

  /* Without a task the role comes from elsewhere. */
  rc = ps_cluster_from_tf_config("{\"cluster\": {\"ps\": [\"p:1\"], \"worker\": []}}", &C, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(C.task_type[0] == '\0' && C.task_index == -1 && C.n_workers == 0);
}

static void expect_tf_error(const char *text, const char *want) {
  char err[PS_ERRLEN] = "";
  int rc = ps_cluster_from_tf_config(text, &C, err);
  CHECK_MSG(rc == PS_EINVAL, "rc %d for %s", rc, text);
  CHECK_MSG(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
  /* A failed parse leaves an empty spec, never a half-filled one. */
  CHECK(C.n_ps == 0 && C.n_workers == 0 && C.task_index == -1);
}

#define PS1 "\"cluster\": {\"ps\": [\"p:1\"], \"worker\": [\"w:1\", \"w:2\"]}"

static void test_tf_config_invalid(void) {
  expect_tf_error("", "the text is empty");
  expect_tf_error("{\"cluster\": ", "JSON syntax error at line 1");
  expect_tf_error("[]", "must be a JSON object");
  expect_tf_error("{\"task\": {\"type\": \"ps\", \"index\": 0}}", "'cluster' is required");
  expect_tf_error("{\"cluster\": {\"worker\": [\"w:1\"]}}", "cluster.ps is missing or empty");
  expect_tf_error("{\"cluster\": {\"ps\": []}}", "cluster.ps is missing or empty");
  expect_tf_error("{\"cluster\": {\"ps\": \"p:1\"}}", "cluster.ps must be an array");
  expect_tf_error("{\"cluster\": {\"ps\": [\"p:1\", 5]}}", "cluster.ps[1] must be a string");
  expect_tf_error("{\"cluster\": {\"ps\": [\"p:1\"], \"worker\": [\"w\"]}}",
                  "cluster.worker[0] 'w': missing ':port'");
  expect_tf_error("{\"cluster\": {\"ps\": [\"p:1\"], \"chief\": [\"c:1\", \"c:2\"]}}",
                  "cluster.chief has 2 entries, at most 1");
  expect_tf_error("{\"cluster\": {\"ps\": [\"p:1\"], \"master\": [\"m:1\"]}}",
                  "unknown job 'cluster.master'");
  expect_tf_error("{\"cluster\": {\"ps\": [\"p:1\"], \"evaluator\": [\"e:1\"]}}",
                  "cluster.evaluator is not allowed");
  expect_tf_error("{\"cluster\": {\"ps\": [\"p:1\"], \"worker\": [\"p:1\"]}}",
                  "address 'p:1' appears twice (ps[0] and worker[0])");
  expect_tf_error("{" PS1 ", \"tasks\": {}}", "unknown field 'tasks'");
  expect_tf_error("{" PS1 ", \"task\": 3}", "'task' must be an object");
  expect_tf_error("{" PS1 ", \"task\": {\"index\": 0}}", "task.type is required");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"master\", \"index\": 0}}",
                  "task.type 'master' is not known");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"ps\"}}", "task.index is required");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"ps\", \"index\": -1}}",
                  "task.index must be an integer >= 0");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"ps\", \"index\": \"0\"}}",
                  "task.index must be an integer");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"ps\", \"index\": 1}}",
                  "task.index 1 is out of range: cluster.ps has 1 entry");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"worker\", \"index\": 2}}",
                  "task.index 2 is out of range: cluster.worker has 2 entries");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"chief\", \"index\": 0}}",
                  "task.type is 'chief' but cluster.chief is missing or empty");
  expect_tf_error("{" PS1 ", \"task\": {\"type\": \"ps\", \"index\": 0, \"idx\": 1}}",
                  "unknown field 'task.idx'");
}

/* Numeric addresses, every interface and localhost resolve; a name under
 * .invalid (RFC 2606: never registered) does not, with the name said; a
 * malformed address is refused. */
static void test_addr_resolve(void) {
  char err[PS_ERRLEN];
  CHECK(ps_addr_resolve("127.0.0.1:5000", err) == 0);
  CHECK(ps_addr_resolve("[::1]:5000", err) == 0);
  CHECK(ps_addr_resolve("0.0.0.0:1", err) == 0);
  CHECK(ps_addr_resolve("localhost:2222", err) == 0);
  CHECK(ps_addr_resolve("ps-0.ps.invalid:2222", err) == PS_EUNAVAIL);
  CHECK_MSG(strstr(err, "'ps-0.ps.invalid' does not resolve") != NULL, "%s", err);
  CHECK(ps_addr_resolve("no-port", err) == PS_EINVAL);
  CHECK(ps_addr_resolve(":80", err) == PS_EINVAL);
}

int main(void) {
  RUN(test_ps_list_valid);
  RUN(test_ps_list_invalid);
  RUN(test_addr_resolve);
  RUN(test_tf_config_valid);
  RUN(test_tf_config_invalid);
  return check_summary();
}

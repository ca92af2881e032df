/* Cluster spec: the addresses of the ps tasks and this process's role, from
 * flags (--ps host:port,... --index N) or from TF_CONFIG in TensorFlow's
 * format:
 *   {"cluster": {"ps": ["h:p", ...], "worker": [...], "chief": [...]},
 *    "task": {"type": "ps", "index": 0}} */
#ifndef PS_COMMON_CLUSTER_H
#define PS_COMMON_CLUSTER_H

#define PS_MAX_TASKS 256
#define PS_ADDR_LEN 128

typedef struct {
  int n_ps;
  char ps[PS_MAX_TASKS][PS_ADDR_LEN];
  int n_workers;
  char workers[PS_MAX_TASKS][PS_ADDR_LEN];
  int n_chief;
  char chief[PS_ADDR_LEN];
  char task_type[16]; /* "ps", "worker", "chief", "evaluator", or "" */
  int task_index;     /* -1 when not given */
} ps_cluster;

/* Parses a comma-separated list of host:port into c->ps. Each entry is
 * checked for the host:port shape. */
int ps_cluster_parse_ps_list(const char *csv, ps_cluster *c, char *err);

/* Whether the host of addr (host:port, [v6]:port) resolves now: 0 (also
 * for a numeric address, or an empty host: every interface); PS_EUNAVAIL
 * when the name does not resolve yet (no such name, or DNS failed: a
 * Kubernetes headless Service or a new node may publish it later);
 * PS_EINVAL for a malformed address. A message in err either way but 0. */
int ps_addr_resolve(const char *addr, char *err);

/* Parses TF_CONFIG text. Unknown task types and bad indices are errors. */
int ps_cluster_from_tf_config(const char *json_text, ps_cluster *c, char *err);

#endif

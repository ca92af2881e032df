/* Cluster spec from a --ps list or from TF_CONFIG.
 *
 * Addresses are checked for shape only (no DNS here): a typo such as a
 * missing port or an unbracketed IPv6 address is caught at startup with a
 * message, instead of as a connection that never succeeds. */
#include "cluster.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <limits.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static int is_digit(char ch) { return ch >= '0' && ch <= '9'; }

static int is_name_char(char ch) {
  return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || is_digit(ch) || ch == '-' ||
         ch == '.' || ch == '_';
}

/* Checks that s is host:port with a port in 1..65535 and a host that is a
 * name, an IPv4 address, or an IPv6 address in brackets. Returns NULL if so,
 * else what is wrong (the caller quotes s itself). */
static const char *hostport_problem(const char *s) {
  size_t len = strlen(s);
  if (len == 0) return "empty address";
  if (len >= PS_ADDR_LEN) return "address too long";
  const char *colon = strrchr(s, ':');
  if (!colon) return "missing ':port' (expected host:port)";
  const char *p = colon + 1;
  size_t nd = strlen(p);
  if (nd == 0) return "missing port after ':'";
  for (size_t i = 0; i < nd; i++)
    if (!is_digit(p[i])) return "the port is not a number";
  if (nd > 5 || atoi(p) < 1 || atoi(p) > 65535) return "the port is outside 1..65535";

  char host[PS_ADDR_LEN];
  size_t hl = (size_t)(colon - s);
  memcpy(host, s, hl);
  host[hl] = '\0';
  if (hl == 0) return "missing host before ':'";
  if (host[0] == '[') {
    if (hl < 3 || host[hl - 1] != ']') return "an IPv6 address must be written [addr]:port";
    char addr[PS_ADDR_LEN];
    memcpy(addr, host + 1, hl - 2);
    addr[hl - 2] = '\0';
    /* A link-local zone ("%eth0") is legal in a target but not for
     * inet_pton: check the address part only. */
    char *zone = strchr(addr, '%');
    if (zone) *zone = '\0';
    struct in6_addr a6;
    if (inet_pton(AF_INET6, addr, &a6) != 1) return "not a valid IPv6 address";
  } else {
    if (strchr(host, ':')) return "an IPv6 address must be in brackets, e.g. [::1]:2222";
    int all_numeric = 1;
    for (size_t i = 0; i < hl; i++) {
      if (!is_name_char(host[i])) return "the host has a character not allowed in a host name";
      if (!is_digit(host[i]) && host[i] != '.') all_numeric = 0;
    }
    if (host[0] == '.' || host[0] == '-' || strstr(host, "..")) return "not a valid host name";
    struct in_addr a4;
    if (all_numeric && inet_pton(AF_INET, host, &a4) != 1) return "not a valid IPv4 address";
  }
  /* What passes here must also split with the shared parser the transport
   * uses, or the two would disagree about what an address is. */
  int port;
  if (ps_parse_hostport(s, host, sizeof host, &port) != 0) return "expected host:port";
  return NULL;
}

int ps_addr_resolve(const char *addr, char *err) {
  char host[PS_ADDR_LEN];
  int port;
  if (ps_parse_hostport(addr, host, sizeof host, &port) != 0)
    return ps_seterr(err, PS_EINVAL, "'%.150s' is not host:port", addr);
  ps_host_unbracket(host);
  if (!host[0]) return 0;
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
  int rc = getaddrinfo(host, NULL, &hints, &res);
  if (rc == 0) {
    freeaddrinfo(res);
    return 0;
  }
  return ps_seterr(err, PS_EUNAVAIL, "the name '%.120s' does not resolve: %s", host,
                   gai_strerror(rc));
}

int ps_cluster_parse_ps_list(const char *csv, ps_cluster *c, char *err) {
  if (!csv) return ps_seterr(err, PS_EINVAL, "no list given");
  /* Entries are collected aside so that c is unchanged on any error. */
  char(*tmp)[PS_ADDR_LEN] = malloc(sizeof(char[PS_MAX_TASKS][PS_ADDR_LEN]));
  if (!tmp) return ps_seterr(err, PS_ENOMEM, "out of memory");
  int rc = 0, n = 0;
  const char *p = csv;
  for (;;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    /* Tolerate spaces around entries ("a:1, b:2"), as people type them. */
    while (len && (*p == ' ' || *p == '\t')) p++, len--;
    while (len && (p[len - 1] == ' ' || p[len - 1] == '\t')) len--;
    const char *why;
    if (n >= PS_MAX_TASKS) {
      rc = ps_seterr(err, PS_EINVAL, "more than %d entries", PS_MAX_TASKS);
      break;
    }
    if (len == 0) {
      rc = ps_seterr(err, PS_EINVAL, "entry %d is empty (in '%.80s')", n, csv);
      break;
    }
    if (len >= PS_ADDR_LEN) {
      rc = ps_seterr(err, PS_EINVAL, "entry %d is longer than %d characters", n, PS_ADDR_LEN - 1);
      break;
    }
    memcpy(tmp[n], p, len);
    tmp[n][len] = '\0';
    if ((why = hostport_problem(tmp[n]))) {
      rc = ps_seterr(err, PS_EINVAL, "entry %d '%s': %s", n, tmp[n], why);
      break;
    }
    /* Two shards on one address would be one server answering for both. */
    for (int j = 0; j < n && !rc; j++)
      if (strcmp(tmp[j], tmp[n]) == 0)
        rc = ps_seterr(err, PS_EINVAL, "'%s' appears twice (entries %d and %d)", tmp[n], j, n);
    if (rc) break;
    n++;
    if (!e) break;
    p = e + 1;
  }
  if (rc == 0) {
    memcpy(c->ps, tmp, (size_t)n * PS_ADDR_LEN);
    c->n_ps = n;
  }
  free(tmp);
  return rc;
}

/* Reads the list cluster.<name> into out (at most max entries). */
static int parse_task_list(json_t *cluster, const char *name, int max, char (*out)[PS_ADDR_LEN],
                           int *n_out, char *err) {
  json_t *arr = json_object_get(cluster, name);
  *n_out = 0;
  if (!arr) return 0;
  if (!json_is_array(arr))
    return ps_seterr(err, PS_EINVAL, "cluster.%s must be an array of \"host:port\"", name);
  if (json_array_size(arr) > (size_t)max)
    return ps_seterr(err, PS_EINVAL, "cluster.%s has %zu entries, at most %d", name,
                     json_array_size(arr), max);
  size_t i;
  json_t *v;
  json_array_foreach(arr, i, v) {
    const char *s = json_string_value(v);
    const char *why;
    if (!s) return ps_seterr(err, PS_EINVAL, "cluster.%s[%zu] must be a string", name, i);
    if ((why = hostport_problem(s)))
      return ps_seterr(err, PS_EINVAL, "cluster.%s[%zu] '%.80s': %s", name, i, s, why);
    snprintf(out[i], PS_ADDR_LEN, "%s", s);
  }
  *n_out = (int)json_array_size(arr);
  return 0;
}

/* The address of task k counting ps, then workers, then the chief; its
 * label ("worker[2]") into label. */
static const char *task_addr(const ps_cluster *c, int k, char *label, size_t cap) {
  if (k < c->n_ps) {
    snprintf(label, cap, "ps[%d]", k);
    return c->ps[k];
  }
  k -= c->n_ps;
  if (k < c->n_workers) {
    snprintf(label, cap, "worker[%d]", k);
    return c->workers[k];
  }
  snprintf(label, cap, "chief[0]");
  return c->chief;
}

/* Every address appears once across ps, worker and chief. */
static int check_duplicates(const ps_cluster *c, char *err) {
  int n = c->n_ps + c->n_workers + c->n_chief;
  for (int a = 0; a < n; a++) {
    char la[32], lb[32];
    const char *sa = task_addr(c, a, la, sizeof la);
    for (int b = a + 1; b < n; b++) {
      const char *sb = task_addr(c, b, lb, sizeof lb);
      if (strcmp(sa, sb) == 0)
        return ps_seterr(err, PS_EINVAL, "address '%.80s' appears twice (%s and %s)", sa, la, lb);
    }
  }
  return 0;
}

static int parse_tf_config(json_t *root, ps_cluster *c, char *err) {
  if (!json_is_object(root)) return ps_seterr(err, PS_EINVAL, "must be a JSON object");
  const char *key;
  json_t *v;
  /* "environment" and "rpc_layer" are written by TensorFlow tooling and
   * mean nothing here; anything else is most likely a typo. */
  json_object_foreach(root, key, v) {
    if (strcmp(key, "cluster") && strcmp(key, "task") && strcmp(key, "environment") &&
        strcmp(key, "rpc_layer"))
      return ps_seterr(err, PS_EINVAL,
                       "unknown field '%.40s' (known: cluster, task, environment, "
                       "rpc_layer)",
                       key);
  }
  json_t *cluster = json_object_get(root, "cluster");
  if (!json_is_object(cluster))
    return ps_seterr(err, PS_EINVAL, "'cluster' is required (an object of task lists)");
  json_object_foreach(cluster, key, v) {
    if (strcmp(key, "evaluator") == 0)
      return ps_seterr(err, PS_EINVAL,
                       "cluster.evaluator is not allowed: an evaluator is not part "
                       "of the cluster, give it as task.type only");
    if (strcmp(key, "ps") && strcmp(key, "worker") && strcmp(key, "chief"))
      return ps_seterr(err, PS_EINVAL, "unknown job 'cluster.%.40s' (known: ps, worker, chief)",
                       key);
  }
  int rc;
  if ((rc = parse_task_list(cluster, "ps", PS_MAX_TASKS, c->ps, &c->n_ps, err))) return rc;
  if ((rc = parse_task_list(cluster, "worker", PS_MAX_TASKS, c->workers, &c->n_workers, err)))
    return rc;
  char chief[1][PS_ADDR_LEN];
  if ((rc = parse_task_list(cluster, "chief", 1, chief, &c->n_chief, err))) return rc;
  if (c->n_chief) memcpy(c->chief, chief[0], PS_ADDR_LEN);
  if (c->n_ps == 0) return ps_seterr(err, PS_EINVAL, "cluster.ps is missing or empty");
  if ((rc = check_duplicates(c, err))) return rc;

  json_t *task = json_object_get(root, "task");
  if (!task) return 0; /* role given elsewhere (flags) */
  if (!json_is_object(task))
    return ps_seterr(err, PS_EINVAL, "'task' must be an object {\"type\", \"index\"}");
  json_object_foreach(task, key, v) {
    if (strcmp(key, "type") && strcmp(key, "index") && strcmp(key, "trial"))
      return ps_seterr(err, PS_EINVAL, "unknown field 'task.%.40s' (known: type, index)", key);
  }
  const char *type = json_string_value(json_object_get(task, "type"));
  if (!type) return ps_seterr(err, PS_EINVAL, "task.type is required (a string)");
  int size;
  if (strcmp(type, "ps") == 0)
    size = c->n_ps;
  else if (strcmp(type, "worker") == 0)
    size = c->n_workers;
  else if (strcmp(type, "chief") == 0)
    size = c->n_chief;
  else if (strcmp(type, "evaluator") == 0)
    size = INT_MAX; /* the evaluator has no list: any index */
  else
    return ps_seterr(err, PS_EINVAL,
                     "task.type '%.40s' is not known (known: ps, worker, chief, "
                     "evaluator)",
                     type);
  json_t *iv = json_object_get(task, "index");
  if (!iv) return ps_seterr(err, PS_EINVAL, "task.index is required (an integer)");
  if (!json_is_integer(iv) || json_integer_value(iv) < 0 || json_integer_value(iv) > INT_MAX)
    return ps_seterr(err, PS_EINVAL, "task.index must be an integer >= 0");
  long long idx = json_integer_value(iv);
  if (idx >= size) {
    if (size == 0)
      return ps_seterr(err, PS_EINVAL, "task.type is '%s' but cluster.%s is missing or empty", type,
                       type);
    return ps_seterr(err, PS_EINVAL, "task.index %lld is out of range: cluster.%s has %d entr%s",
                     idx, type, size, size == 1 ? "y" : "ies");
  }
  snprintf(c->task_type, sizeof c->task_type, "%s", type);
  c->task_index = (int)idx;
  return 0;
}

static void cluster_reset(ps_cluster *c) {
  memset(c, 0, sizeof *c);
  c->task_index = -1;
}

int ps_cluster_from_tf_config(const char *json_text, ps_cluster *c, char *err) {
  cluster_reset(c);
  if (!json_text || !*json_text) return ps_seterr(err, PS_EINVAL, "the text is empty");
  json_error_t jerr;
  json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &jerr);
  if (!root)
    return ps_seterr(err, PS_EINVAL, "JSON syntax error at line %d, column %d: %s", jerr.line,
                     jerr.column, jerr.text);
  int rc = parse_tf_config(root, c, err);
  json_decref(root);
  /* A half-filled spec must not be mistaken for a valid one. */
  if (rc) cluster_reset(c);
  return rc;
}

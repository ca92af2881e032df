#include "prom.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util.h"

#ifndef PS_BUILD_VERSION
#define PS_BUILD_VERSION "unknown"
#endif

/* ------------------------------------------------------------ the text */

struct ps_prom_buf {
  char *s;
  size_t len, cap;
  int failed; /* out of memory: the scrape answers 500 */
};

ps_prom_buf *ps_prom_buf_new(void) { return calloc(1, sizeof(ps_prom_buf)); }

void ps_prom_buf_free(ps_prom_buf *b) {
  if (!b) return;
  free(b->s);
  free(b);
}

const char *ps_prom_text(const ps_prom_buf *b, size_t *len) {
  if (len) *len = b->len;
  return b->s ? b->s : "";
}

static void put(ps_prom_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(ps_prom_buf *b, const char *fmt, ...) {
  if (b->failed) return;
  for (int tries = 0; tries < 2; tries++) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->cap - b->len;
    int n = vsnprintf(b->s ? b->s + b->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n < 0) break;
    if ((size_t)n < room) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len <= (size_t)n) cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s) break;
    b->s = s;
    b->cap = cap;
  }
  b->failed = 1;
}

/* A value as the format spells it. */
static void put_value(ps_prom_buf *b, double v) {
  if (isnan(v))
    put(b, "NaN\n");
  else if (isinf(v))
    put(b, "%sInf\n", v > 0 ? "+" : "-");
  else if (v == (double)(int64_t)v && fabs(v) < 9e15)
    put(b, "%lld\n", (long long)v);
  else
    put(b, "%.15g\n", v);
}

void ps_prom_family(ps_prom_buf *b, const char *name, const char *type, const char *help) {
  put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void ps_prom_sample(ps_prom_buf *b, const char *name, const char *labels, double value) {
  if (labels && *labels)
    put(b, "%s{%s} ", name, labels);
  else
    put(b, "%s ", name);
  put_value(b, value);
}

void ps_prom_metric(ps_prom_buf *b, const char *name, const char *type, const char *help,
                    const char *labels, double value) {
  ps_prom_family(b, name, type, help);
  ps_prom_sample(b, name, labels, value);
}

void ps_prom_histogram(ps_prom_buf *b, const char *name, const char *labels,
                       const double *bounds, const uint64_t *counts, int n, double sum) {
  const char *sep = labels && *labels ? "," : "";
  if (!labels) labels = "";
  uint64_t cum = 0;
  for (int i = 0; i <= n; i++) {
    cum += counts[i];
    if (i < n)
      put(b, "%s_bucket{%s%sle=\"%.17g\"} %llu\n", name, labels, sep, bounds[i],
          (unsigned long long)cum);
    else
      put(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, (unsigned long long)cum);
  }
  char full[160];
  snprintf(full, sizeof full, "%s_sum", name);
  ps_prom_sample(b, full, labels, sum);
  snprintf(full, sizeof full, "%s_count", name);
  ps_prom_sample(b, full, labels, (double)cum);
}

char *ps_prom_label(char *dst, size_t cap, const char *key, const char *value) {
  char clean[256];
  size_t n = ps_utf8_sanitize(clean, sizeof clean, value);
  int k = snprintf(dst, cap, "%s=\"", key);
  if (k < 0 || (size_t)k + 2 > cap) {
    if (cap) dst[0] = 0;
    return dst;
  }
  size_t o = (size_t)k;
  /* whole characters only, with room for the closing quote and the NUL */
  for (size_t i = 0; i < n;) {
    size_t cl = ps_utf8_char_len((const uint8_t *)clean + i, n - i);
    if (cl == 0) break; /* not after ps_utf8_sanitize */
    char c = clean[i];
    const char *esc = c == '\\' ? "\\\\" : c == '"' ? "\\\"" : c == '\n' ? "\\n" : NULL;
    size_t need = esc ? 2 : cl;
    if (o + need + 2 > cap) break;
    memcpy(dst + o, esc ? esc : clean + i, need);
    o += need;
    i += cl;
  }
  dst[o++] = '"';
  dst[o] = 0;
  return dst;
}

/* ------------------------------------------------------------ process metrics */

void ps_prom_process(ps_prom_buf *b, const char *program) {
  char lab[128], ver[96];
  snprintf(lab, sizeof lab, "%s,%s", ps_prom_label(ver, sizeof ver, "program", program),
           "version=\"" PS_BUILD_VERSION "\"");
  ps_prom_metric(b, "ps_build_info", "gauge", "The program and the version it was built from (1).",
                 lab, 1);
  long tick = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
  char *stat = NULL;
  size_t len = 0;
  if (tick > 0 && ps_read_file("/proc/self/stat", &stat, &len, NULL) == 0) {
    /* the fields after the command name, which may hold spaces: from the
     * last ')' on, field 3 (state) is the first */
    char *p = strrchr(stat, ')');
    unsigned long long f[64] = {0};
    int k = 3;
    if (p) {
      p++;
      while (*p && k < 64) {
        while (*p == ' ') p++;
        if (!*p) break;
        f[k] = strtoull(p, &p, 10);
        if (*p && *p != ' ') while (*p && *p != ' ') p++; /* the state letter */
        k++;
      }
    }
    free(stat);
    if (k > 24) {
      ps_prom_metric(b, "process_cpu_seconds_total", "counter",
                     "User and system CPU time spent in seconds.", NULL,
                     (double)(f[14] + f[15]) / (double)tick);
      ps_prom_metric(b, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
                     NULL, (double)f[23]);
      ps_prom_metric(b, "process_resident_memory_bytes", "gauge",
                     "Resident memory size in bytes.", NULL, (double)f[24] * (double)page);
      ps_prom_metric(b, "process_threads", "gauge", "Number of OS threads in the process.",
                     NULL, (double)f[20]);
      char *ps = NULL;
      if (ps_read_file("/proc/stat", &ps, &len, NULL) == 0) {
        char *bt = strstr(ps, "\nbtime ");
        if (bt)
          ps_prom_metric(b, "process_start_time_seconds", "gauge",
                         "Start time of the process since unix epoch in seconds.", NULL,
                         (double)strtoull(bt + 7, NULL, 10) + (double)f[22] / (double)tick);
        free(ps);
      }
    }
  }
  DIR *d = opendir("/proc/self/fd");
  if (d) {
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
      if (e->d_name[0] != '.') n++;
    closedir(d);
    ps_prom_metric(b, "process_open_fds", "gauge", "Number of open file descriptors.", NULL,
                   n - 1 /* the directory's own */);
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
    ps_prom_metric(b, "process_max_fds", "gauge", "Maximum number of open file descriptors.",
                   NULL, rl.rlim_cur == RLIM_INFINITY ? INFINITY : (double)rl.rlim_cur);
}

/* ------------------------------------------------------------ the endpoint */

struct ps_prom_server {
  struct MHD_Daemon *d;
  int port;
  ps_prom_collect_fn fn;
  void *user;
  ps_token tokens[2];
  int ntokens;
  char *cert, *key; /* PEM text, kept while the daemon runs */
};

static enum MHD_Result answer(struct MHD_Connection *c, unsigned code, const char *type,
                              char *body, size_t len, int must_free) {
  struct MHD_Response *r = MHD_create_response_from_buffer(
      len, body, must_free ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
  if (!r) {
    if (must_free) free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  if (code == MHD_HTTP_UNAUTHORIZED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer realm=\"ps metrics\"");
  if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result ret = MHD_queue_response(c, code, r);
  MHD_destroy_response(r);
  return ret;
}

static const char k_text[] = "text/plain; charset=utf-8";

static int authorized(const ps_prom_server *s, struct MHD_Connection *c) {
  if (s->ntokens == 0) return 1;
  const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (!h || strncasecmp(h, "Bearer ", 7) != 0) return 0;
  h += 7;
  while (*h == ' ') h++;
  size_t n = strlen(h);
  int ok = 0;
  for (int i = 0; i < s->ntokens; i++) ok |= ps_ct_equal(h, n, s->tokens[i].bytes, s->tokens[i].len);
  return ok;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
  (void)version;
  (void)upload_data;
  ps_prom_server *s = cls;
  static char k_405[] = "only GET and HEAD\n", k_404[] = "not found: the metrics are at /metrics\n",
              k_401[] = "a bearer token is needed (the job's or the read-only token)\n",
              k_500[] = "out of memory\n", k_root[] = "ps metrics: GET /metrics\n";
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
    *upload_data_size = 0; /* a body is not read */
    return answer(c, MHD_HTTP_METHOD_NOT_ALLOWED, k_text, k_405, sizeof k_405 - 1, 0);
  }
  if (!*con_cls) { /* the headers are in; answer on the next call */
    *con_cls = s;
    return MHD_YES;
  }
  if (!authorized(s, c)) return answer(c, MHD_HTTP_UNAUTHORIZED, k_text, k_401, sizeof k_401 - 1, 0);
  if (strcmp(url, "/") == 0) return answer(c, MHD_HTTP_OK, k_text, k_root, sizeof k_root - 1, 0);
  if (strcmp(url, "/metrics") != 0)
    return answer(c, MHD_HTTP_NOT_FOUND, k_text, k_404, sizeof k_404 - 1, 0);
  ps_prom_buf *b = ps_prom_buf_new();
  if (b) s->fn(b, s->user);
  if (!b || b->failed) {
    ps_prom_buf_free(b);
    return answer(c, MHD_HTTP_INTERNAL_SERVER_ERROR, k_text, k_500, sizeof k_500 - 1, 0);
  }
  char *body = b->s ? b->s : strdup("");
  size_t len = b->len;
  b->s = NULL;
  ps_prom_buf_free(b);
  if (!body) return answer(c, MHD_HTTP_INTERNAL_SERVER_ERROR, k_text, k_500, sizeof k_500 - 1, 0);
  return answer(c, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", body, len, 1);
}

/* A listening socket on host:port: a clear error where MHD would give
 * none. */
static int listen_on(const char *host, int port, int *fam, char *err) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  int rc = getaddrinfo(host && *host ? host : NULL, ps, &hints, &res);
  if (rc != 0) {
    ps_seterr(err, PS_EINVAL, "metrics: cannot resolve '%.200s': %s", host ? host : "",
              gai_strerror(rc));
    return -1;
  }
  int fd = -1, e = 0;
  for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      e = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      e = errno;
      close(fd);
      fd = -1;
      continue;
    }
    *fam = a->ai_family;
  }
  freeaddrinfo(res);
  if (fd < 0)
    ps_seterr(err, PS_EIO, "metrics: cannot listen on %.200s port %d: %s", host ? host : "*", port,
              strerror(e));
  return fd;
}

ps_prom_server *ps_prom_start(const ps_prom_opts *o, ps_prom_collect_fn fn, void *user,
                              char *err) {
  ps_prom_server *s = calloc(1, sizeof *s);
  if (!s) {
    ps_seterr(err, PS_ENOMEM, "out of memory");
    return NULL;
  }
  s->fn = fn;
  s->user = user;
  for (int i = 0; i < 2; i++)
    if (o->tokens[i] && o->tokens[i]->len) s->tokens[s->ntokens++] = *o->tokens[i];
  if ((o->tls_cert != NULL) != (o->tls_key != NULL)) {
    ps_seterr(err, PS_EINVAL, "metrics: HTTPS needs both a certificate and a key");
    free(s);
    return NULL;
  }
  if (o->tls_cert) {
    size_t n;
    if (ps_read_file(o->tls_cert, &s->cert, &n, err) != 0 ||
        ps_read_file(o->tls_key, &s->key, &n, err) != 0) {
      free(s->cert);
      free(s);
      return NULL;
    }
  }
  int fam = AF_INET;
  int fd = listen_on(o->host, o->port, &fam, err);
  if (fd < 0) {
    free(s->cert);
    free(s->key);
    free(s);
    return NULL;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
  if (fam == AF_INET6) flags |= MHD_USE_IPv6;
  if (s->cert) flags |= MHD_USE_TLS;
  struct MHD_OptionItem tls[] = {
      {MHD_OPTION_HTTPS_MEM_CERT, 0, s->cert},
      {MHD_OPTION_HTTPS_MEM_KEY, 0, s->key},
      {MHD_OPTION_END, 0, NULL},
  };
  s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_LISTEN_SOCKET, fd,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned)32,
                          MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10,
                          MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                          MHD_OPTION_ARRAY, s->cert ? tls : tls + 2, MHD_OPTION_END);
  if (!s->d) {
    ps_seterr(err, PS_EIO, "metrics: the HTTP%s endpoint on port %d did not start%s",
              s->cert ? "S" : "", s->port, s->cert ? " (is the key the certificate's?)" : "");
    close(fd);
    free(s->cert);
    free(s->key);
    free(s);
    return NULL;
  }
  return s;
}

int ps_prom_port(const ps_prom_server *s) { return s ? s->port : 0; }

void ps_prom_stop(ps_prom_server *s) {
  if (!s) return;
  MHD_stop_daemon(s->d); /* closes the listening socket too */
  free(s->cert);
  free(s->key);
  free(s);
}

/* Prometheus metrics: the text exposition format (version 0.0.4) written
 * into a buffer by a process's collector, and the HTTP endpoint that
 * serves it (libmicrohttpd, one thread of its own).
 *
 * A scrape calls the collector on the endpoint's thread; the collector
 * reads the process's counters (they must be safe to read from another
 * thread) and appends families with the functions below. Names follow
 * Prometheus's conventions: snake_case, a unit suffix (_seconds, _bytes),
 * counters end in _total. */
#ifndef PS_COMMON_PROM_H
#define PS_COMMON_PROM_H

#include <stddef.h>
#include <stdint.h>

#include "auth.h"

typedef struct ps_prom_buf ps_prom_buf;

/* Starts a family: its # HELP and # TYPE lines (type: "counter", "gauge",
 * "histogram"). Each family is started once per scrape, before its
 * samples. */
void ps_prom_family(ps_prom_buf *b, const char *name, const char *type, const char *help);

/* One sample: name{labels} value. labels is NULL or the text between the
 * braces, already escaped (ps_prom_label below). NaN and the infinities
 * are written as Prometheus spells them. */
void ps_prom_sample(ps_prom_buf *b, const char *name, const char *labels, double value);

/* A family of one sample, the common case. */
void ps_prom_metric(ps_prom_buf *b, const char *name, const char *type, const char *help,
                    const char *labels, double value);

/* A histogram's samples (after ps_prom_family(..., "histogram", ...)):
 * counts[i] observations in (bounds[i-1], bounds[i]] for i < n and
 * counts[n] above bounds[n-1] (n + 1 counts, not cumulative: the buckets
 * written are), sum the sum of the observations. */
void ps_prom_histogram(ps_prom_buf *b, const char *name, const char *labels,
                       const double *bounds, const uint64_t *counts, int n, double sum);

/* Writes key="value" into dst (cap bytes), the value escaped as the format
 * wants (backslash, double quote, newline) and made valid UTF-8; cut to fit.
 * Returns dst. */
char *ps_prom_label(char *dst, size_t cap, const char *key, const char *value);

/* The families every process exposes: process_* (CPU seconds, resident
 * and virtual memory, open and maximum descriptors, start time, threads;
 * read from /proc) and ps_build_info{program, version} = 1. */
void ps_prom_process(ps_prom_buf *b, const char *program);

/* The text so far (NUL-terminated) and its length; for tests. */
const char *ps_prom_text(const ps_prom_buf *b, size_t *len);
ps_prom_buf *ps_prom_buf_new(void);
void ps_prom_buf_free(ps_prom_buf *b);

typedef void (*ps_prom_collect_fn)(ps_prom_buf *b, void *user);

/* Where and how the endpoint listens. */
typedef struct {
  const char *host; /* an address or name to bind; NULL or "": every interface */
  int port;         /* 0: one the kernel picks (ps_prom_port says which) */
  /* Bearer tokens a scrape may present (Authorization: Bearer TOKEN); with
   * none given the endpoint is open. */
  const ps_token *tokens[2];
  /* HTTPS with this certificate and key (PEM files); NULL: plain HTTP */
  const char *tls_cert, *tls_key;
} ps_prom_opts;

typedef struct ps_prom_server ps_prom_server;

/* Serves GET /metrics (the collector's text), GET / (a line that points
 * there); anything else is 404 or 405, a missing or wrong token 401. At
 * most 32 connections, each closed after 10 s idle. NULL with a message in
 * err (PS_ERRLEN bytes) when the address cannot be resolved or bound, or a
 * TLS file cannot be read. */
ps_prom_server *ps_prom_start(const ps_prom_opts *o, ps_prom_collect_fn fn, void *user,
                              char *err);
/* The port it listens on. */
int ps_prom_port(const ps_prom_server *s);
/* Stops it (a scrape under way finishes first) and frees it. NULL is fine. */
void ps_prom_stop(ps_prom_server *s);

#endif

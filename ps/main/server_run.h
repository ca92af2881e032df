/* ps-server's process: the options it runs from, ps_server_run (builds the
 * parts, runs the loop, shuts down in order), the metrics endpoint and the
 * descriptor guard. The top of the server: it may call every part. */
#ifndef PS_PS_MAIN_SERVER_RUN_H
#define PS_PS_MAIN_SERVER_RUN_H

#include "common/security.h"
#include "ps/core/server.h"

/* The parsed command line of a server (the strings are borrowed: they must
 * outlive ps_server_run). */
typedef struct {
  const char *job_path;     /* required */
  const char *ps_list;      /* NULL: the cluster comes from TF_CONFIG */
  int index;                /* -1: not given */
  const char *listen_addr;  /* NULL: this shard's entry in the list */
  const char *metrics_path; /* NULL: no metrics */
  int threads;
  int log_level;
  double log_interval;  /* seconds between progress lines and metrics */
  const char *ckpt_dir; /* NULL: no checkpoints */
  double ckpt_secs;
  int64_t ckpt_updates;  /* 0: not by count */
  int ckpt_keep;
  const char *status_addr; /* --status: the shards' addresses (comma-separated): print their
                            * Status and exit */
  int watch;                /* --watch: a table refreshed every watch_interval */
  double watch_interval;    /* seconds (0: not given, 1) */
  int watch_count;          /* --watch-count: stop after that many refreshes (0: not given) */
  int metrics_port;         /* the Prometheus endpoint's port (-1: none, 0: any) */
  const char *metrics_host; /* its address (NULL: the host of the listen address) */
  double resolve_s;         /* how long to wait for a listen address's name to resolve */
  ps_security_opts sec;    /* TLS, tokens, --insecure */
} ps_server_opts;



/* Runs a server from the options (o->job_path must be set) until SIGINT or
 * SIGTERM, then shuts it down in order (final progress line, RPC server
 * stopped, final checkpoint). Returns the process's exit code: 0 after a
 * clean stop; 2 for a bad cluster spec (--ps, --index, TF_CONFIG), job file
 * or metrics file; 1 when the shard, the checkpoint restore, the RPC server
 * or the final checkpoint failed (a message on stderr, or in the log for
 * the final checkpoint). A failure before the loop runs returns at once,
 * without freeing what was built: the process is meant to exit. Call it
 * once per process. */
int ps_server_run(const ps_server_opts *o);

/* ---- the metrics endpoint (server_prom.c) ---- */


/* Starts the Prometheus endpoint when o->metrics_port >= 0: on
 * o->metrics_host, else the host of the listen address (addr), behind the
 * job's and the read-only token, over HTTPS with the server's certificate
 * when it has one. 0 (nothing to start, or started and logged), or 2 with
 * a message on stderr. */
int ps_server_prom_start(ps_server *sv, const ps_server_opts *o, const char *addr);
/* Stops it (before the shard is freed). */
void ps_server_prom_stop(ps_server *sv);

/* ---- fd_guard.c ---- */


/* Raises the soft descriptor limit to the hard one and keeps a spare
 * descriptor, so that a server out of descriptors sheds connections and
 * goes on accepting (see fd_guard.c). 0, or PS_EIO when no spare can be
 * opened. */
int ps_fd_guard_init(void);
/* Connections closed so far for want of descriptors. */
uint64_t ps_fd_guard_shed(void);

#endif

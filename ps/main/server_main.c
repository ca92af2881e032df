/* ps-server: one shard of the model's parameters. This file is the command
 * line: the flag table (which drives parsing, --help and docs/flags.md),
 * the --status client's dispatch (status_cli.c), then the server's run
 * (server.c; ps/README.md says which folder holds what). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/options.h"
#include "common/util.h"
#include "ps/ckpt/cut.h"
#include "ps/main/server_run.h"
#include "ps/main/status_cli.h"

#define O(field) offsetof(ps_server_opts, field)

static const char *const level_choices[] = {"debug", "info", "warn", "error", NULL};

static const ps_option server_flags[] = {
    {"job", "FILE", PS_OPT_STR, O(job_path),
     .help = "the job file, required: JSON with the model, optimizer, data set, ..."},
    {"ps", "LIST", PS_OPT_STR, O(ps_list), .help =
     "addresses of all shards, comma-separated, in shard order (without `--ps`: `TF_CONFIG` "
     "with task type `ps`); a job with `replicas_per_shard` R lists R servers per shard, "
     "shard s's replicas at entries s*R .. s*R+R-1"},
    {"index", "N", PS_OPT_INT, O(index), 0, PS_MAX_TASKS - 1, .def_doc = "`TF_CONFIG`'s task",
     .help = "which shard this process is, from 0 (with replicas: which entry of the list)"},
    {"listen", "ADDR", PS_OPT_STR, O(listen_addr), .def_doc = "this shard's entry of the list",
     .help = "address to bind; `0.0.0.0:PORT` accepts connections on every interface"},
    {"resolve-s", "SEC", PS_OPT_SECS, O(resolve_s), 0, .def = "120", .help =
     "when the address to bind is a name that does not resolve yet (a Kubernetes headless "
     "Service, a node coming up), wait this long for it, with backoff"},
    {"threads", "N", PS_OPT_INT, O(threads), 1, 64, .def = "2",
     .help = "threads serving requests"},
    {"checkpoint-dir", "DIR", PS_OPT_STR, O(ckpt_dir), .help =
     "restore from the newest consistent checkpoints there at start (any number of shards may "
     "have written them; made if missing); write checkpoint sets there while running (every "
     "shard at one cut, shard 0 decides when) and this shard's state on SIGTERM/SIGINT. Give "
     "every shard the same directory (shared storage) for sets a restore can check"},
    {"checkpoint-secs", "N", PS_OPT_SECS, O(ckpt_secs), 0, .def = "30",
     .help = "shard 0: take a set every N seconds; 0: not by time"},
    {"checkpoint-updates", "N", PS_OPT_I64, O(ckpt_updates), 0, (double)(1LL << 62), .def = "0",
     .help = "shard 0: ... or every N of its updates; 0: not by count"},
    {"keep-checkpoints", "K", PS_OPT_INT, O(ckpt_keep), 1, PS_CUT_MAX_KEEP, .def = "3",
     .help = "keep the newest K complete sets (shard 0 names them; each shard deletes its other "
     "files); the newest complete set stays until a newer one is complete, so K = 1 holds two "
     "while one is written"},
    {"metrics", "FILE", PS_OPT_STR, O(metrics_path), .help =
     "append JSON Lines every log interval: `time`, `shard`, `version`, `pushes`, `pulls`, "
     "`rejected`, `pushes_per_sec`, `staleness_mean`, `staleness_max`, `staleness_hist`, "
     "`workers`, `dropped`, `waits`, `wait_ms_mean`, `ssp_max_lead`, `step_time_ms`"},
    {"metrics-port", "PORT", PS_OPT_INT, O(metrics_port), 0, 65535, .def_doc = "none", .help =
     "serve Prometheus metrics at `/metrics` on this port (0: one the kernel picks, said in the "
     "log): over HTTPS with `--tls-cert`, and with a token a scrape must send `Authorization: "
     "Bearer` with the job's or the read-only token"},
    {"metrics-host", "ADDR", PS_OPT_STR, O(metrics_host),
     .def_doc = "the host of the listen address",
     .help = "the address the metrics endpoint binds (`0.0.0.0`: every interface)"},
    {"log-interval", "SEC", PS_OPT_SECS, O(log_interval), 0, .excl_lo = 1, .def = "5",
     .help = "seconds between progress lines and metrics"},
    {"log-level", "L", PS_OPT_CHOICE, O(log_level), .choices = level_choices, .def = "info",
     .help = "`debug`, `info`, `warn` or `error`"},
    {"status", "LIST", PS_OPT_STR, O(status_addr), .help =
     "print the `Status` of the shards at LIST (addresses, comma-separated, as `--ps` takes "
     "them) as JSON and exit: one address, its object; several, an array of them (with "
     "`--token-file` or `--read-token-file`, and the TLS flags of a client: `--tls-ca`, and "
     "`--tls-cert` and `--tls-key` for a server that asks for client certificates)"},
    {"watch", NULL, PS_OPT_FLAG, O(watch), .help =
     "with `--status`: instead of JSON, a table refreshed every `--watch-interval` until SIGINT "
     "or SIGTERM (exit 0): per shard its version, pushes and pulls per second since the last "
     "refresh, staleness mean/max, live workers, waiting pulls, checkpoint set and uptime (or "
     "the error, for one that does not answer); per worker shard 0 lists, its host, role, task, "
     "step, pushes, leases held, seconds since heard and idleness. At a terminal each refresh "
     "redraws the screen; into a pipe or a file each is a block of lines ending with a blank "
     "line"},
    {"watch-interval", "SEC", PS_OPT_SECS, O(watch_interval), 0.1, .def_doc = "1",
     .help = "with `--watch`: seconds between refreshes (at least 0.1)"},
    {"watch-count", "N", PS_OPT_INT, O(watch_count), 1, 1000000000,
     .def_doc = "until a signal", .help = "with `--watch`: stop after N refreshes (exit 0)"},
    {"token-file", "FILE", PS_OPT_STR, O(sec.token_file), .def_doc = "`$PS_TOKEN_FILE`",
     .help = "the job's token (16 to 256 bytes; a final newline is ignored): every request must "
     "carry it, or is refused `UNAUTHENTICATED`"},
    {"read-token-file", "FILE", PS_OPT_STR, O(sec.read_token_file), .help =
     "a second, read-only token: it lets a client read `Status` and register as an evaluator, "
     "which may pull but not push"},
    {"tls-cert", "FILE", PS_OPT_STR, O(sec.tls_cert),
     .help = "this server's certificate chain (PEM); with `--tls-key`, serve TLS"},
    {"tls-key", "FILE", PS_OPT_STR, O(sec.tls_key), .help = "its private key (PEM)"},
    {"tls-ca", "FILE", PS_OPT_STR, O(sec.tls_ca), .help =
     "a CA (PEM): clients that present a certificate must have one it signed"},
    {"tls-require-client-cert", NULL, PS_OPT_FLAG, O(sec.tls_require_client_cert),
     .help = "mutual TLS: refuse clients without a certificate signed by `--tls-ca`"},
    {"insecure", NULL, PS_OPT_FLAG, O(sec.insecure), .help =
     "allow plaintext (no `--tls-cert`) and a server without a token, each said in the log; for "
     "a cluster on loopback or a network of its own"},
};

static const ps_optspec server_spec = {
    .prog = "ps-server",
    .synopsis = "Usage: ps-server --job FILE (--ps HOST:PORT,... --index N | TF_CONFIG) [options]\n"
                "       ps-server --status HOST:PORT[,...] [--watch [--watch-interval SEC] "
                "[--watch-count N]]\n"
                "\n"
                "Serves shard N of the model's parameters to ps-worker processes.\n",
    .opts = server_flags,
    .n_opts = (int)(sizeof server_flags / sizeof server_flags[0]),
    .footer =
        "SIGINT or SIGTERM: a final checkpoint (with --checkpoint-dir), then exit 0.\n"
        "\n"
        "Exit codes (the last line on stderr says which and why):\n"
        "  0  stopped by SIGINT or SIGTERM, the final checkpoint written\n"
        "  1  a failure: the address cannot be bound, no checkpoint there can be\n"
        "     restored, the final checkpoint cannot be written, no memory\n"
        "  2  a bad command line: a flag, the job file, the cluster (--ps, --index,\n"
        "     TF_CONFIG), the token, TLS or metrics files a flag names\n"
        "With --status: 0, or 1 when a shard did not answer; with --watch: 0.",
};

/* What ps_server_run's exit codes mean (server.h), for the last line. */
static const char *const exit_meaning[] = {
    [0] = "stopped",
    [1] = "a failure: see above",
    [2] = "a bad command line, job or cluster: see --help",
};

/* The process's exit code rc, with a last line that says what it means
 * when it is not 0. */
static int exit_code(int rc) {
  if (rc != 0) fprintf(stderr, "ps-server: exit %d (%s)\n", rc, exit_meaning[rc]);
  return rc;
}

int main(int argc, char **argv) {
  ps_malloc_tune();
  ps_server_opts o = {.index = -1, .metrics_port = -1};
  if (ps_options_defaults(&server_spec, &o) != 0) return exit_code(2);
  int rc = ps_options_parse(&server_spec, argc, argv, &o);
  if (rc == 1) return 0; /* --help */
  if (rc != 0) return exit_code(2);
  if ((o.watch || o.watch_count || o.watch_interval > 0) && !o.status_addr) {
    fprintf(stderr, "ps-server: --%s needs --status LIST (the shards to watch)\n",
            o.watch ? "watch" : o.watch_count ? "watch-count" : "watch-interval");
    return exit_code(2);
  }
  if ((o.watch_count || o.watch_interval > 0) && !o.watch) {
    fprintf(stderr, "ps-server: --%s needs --watch\n",
            o.watch_count ? "watch-count" : "watch-interval");
    return exit_code(2);
  }
  if (o.status_addr && o.watch)
    return ps_status_watch(o.status_addr, &o.sec, o.watch_interval > 0 ? o.watch_interval : 1.0,
                           o.watch_count);
  if (o.status_addr) return ps_status_print(o.status_addr, &o.sec, 10000);
  if (!o.job_path) {
    fprintf(stderr, "ps-server: --job FILE is required (see --help)\n");
    return exit_code(2);
  }
  return exit_code(ps_server_run(&o));
}

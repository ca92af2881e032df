/* The one module that calls gRPC core (its C API changes between releases,
 * so a version change touches rpc.c alone).
 *
 * Server: registered unary methods served by a pool of threads on one
 * completion queue; unknown methods are answered UNIMPLEMENTED. A handler
 * may answer at once or later, from any thread.
 * Client: channels (one per target, thread-safe) and queues (one per thread
 * that waits on calls); several calls in flight on one queue, each with a
 * deadline.
 *
 * Buffer ownership: an rpc_msg segment with a `release` function is sent
 * without a copy; gRPC keeps the pointer until the bytes are sent, then
 * release(user) is called exactly once (also when the call fails). A
 * segment without `release` is copied before the function returns. */
#ifndef PS_COMMON_RPC_H
#define PS_COMMON_RPC_H

#include <stddef.h>

#include "util.h"

/* gRPC status codes (same numbers as grpc_status_code). */
enum {
  RPC_OK = 0,
  RPC_CANCELLED = 1,
  RPC_UNKNOWN = 2,
  RPC_INVALID_ARGUMENT = 3,
  RPC_DEADLINE_EXCEEDED = 4,
  RPC_NOT_FOUND = 5,
  RPC_ALREADY_EXISTS = 6,
  RPC_PERMISSION_DENIED = 7,
  RPC_RESOURCE_EXHAUSTED = 8,
  RPC_FAILED_PRECONDITION = 9,
  RPC_ABORTED = 10,
  RPC_OUT_OF_RANGE = 11,
  RPC_UNIMPLEMENTED = 12,
  RPC_INTERNAL = 13,
  RPC_UNAVAILABLE = 14,
  RPC_DATA_LOSS = 15,
  RPC_UNAUTHENTICATED = 16,
};
const char *rpc_status_name(int code);

#define RPC_MAX_SEGS 4
typedef struct {
  const void *ptr;
  size_t len;
  void (*release)(void *user); /* NULL: copied at once */
  void *user;
} rpc_seg;

typedef struct {
  rpc_seg seg[RPC_MAX_SEGS];
  int nseg;
} rpc_msg;

/* Calls release on every segment that has one (for a message that will
 * not be handed to rpc after all). */
void rpc_msg_release(rpc_msg *m);

/* Process-wide set-up and tear-down (grpc_init / grpc_shutdown). */
void rpc_global_init(void);
void rpc_global_shutdown(void);

/* Default message-size limit on both sides: 1 GiB. */
#define RPC_DEFAULT_MAX_MESSAGE (1 << 30)

/* Transport security: TLS with PEM files. A server needs its certificate
 * chain and key; with ca_file it can ask clients for a certificate signed
 * by that CA (require_client_cert refuses clients without one). A client
 * verifies the server against ca_file (the system's roots when NULL) and
 * presents cert_file/key_file when both are given (mutual TLS). NULL
 * options mean plaintext. */
typedef struct {
  const char *ca_file;
  const char *cert_file, *key_file;
  int require_client_cert; /* server only */
  const char *server_name; /* client only: the name the server's certificate must carry
                              (default: the target's host) */
} rpc_tls;

/* ---------------- server ---------------- */
typedef struct rpc_server rpc_server;
typedef struct rpc_call rpc_call;

/* Called on a server thread. `request` is valid until the call is answered.
 * The handler (or anyone it hands the call to) must answer exactly once
 * with rpc_call_reply or rpc_call_fail. */
typedef void (*rpc_handler)(rpc_call *call, const ps_segview *request, void *user);

typedef struct {
  int threads;           /* threads serving the queue; default 2 */
  int max_message_bytes; /* default RPC_DEFAULT_MAX_MESSAGE */
  int calls_per_method;  /* calls waiting per method; default 8 */
  const rpc_tls *tls;    /* NULL: plaintext */
  /* Bounds on what a client may make the server hold (0: the default). */
  int max_receive_bytes; /* largest request; default max_message_bytes */
  int max_streams;       /* calls in flight per connection; default 32 */
  int max_metadata_bytes; /* request headers; default 16 KiB */
  int idle_ms;           /* a connection with no call this long is closed; default 10 min */
  /* What all connections may hold in memory (0: no bound): a request that
   * would pass it has its stream reset rather than being buffered whole
   * (gRPC reads a message before it checks its size). */
  size_t memory_bytes;
} rpc_server_opts;

/* Creates a server listening on addr ("host:port"; port 0 picks a free one,
 * written to *bound_port). Compressed requests are refused (a small request
 * must not expand into a large one). NULL with a message on failure (an
 * address that cannot be bound, TLS files that cannot be read). */
rpc_server *rpc_server_create(const char *addr, const rpc_server_opts *opts, int *bound_port,
                              char *err);
/* Registers a method by full path ("/ps.ParameterServer/Push"); before start. */
int rpc_server_add_method(rpc_server *s, const char *path, rpc_handler fn, void *user);
int rpc_server_start(rpc_server *s, char *err);
/* Stops accepting calls, cancels those in flight, joins the threads (never
 * call it from a handler).
 * Calls not yet answered are answered CANCELLED by the shutdown. */
void rpc_server_shutdown(rpc_server *s);
void rpc_server_destroy(rpc_server *s);

/* Answer with a message (ownership of its segments passes to rpc). */
void rpc_call_reply(rpc_call *c, rpc_msg *response);
/* Answer with a non-OK status and a message for the client. */
void rpc_call_fail(rpc_call *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The client's address ("ipv4:127.0.0.1:5555"); valid until answered. */
const char *rpc_call_peer(rpc_call *c);

/* ---------------- client ---------------- */
typedef struct rpc_channel rpc_channel;
typedef struct rpc_queue rpc_queue;
typedef struct rpc_request rpc_request;

#define RPC_DEFAULT_KEEPALIVE_MS 10000
typedef struct {
  int max_message_bytes; /* default RPC_DEFAULT_MAX_MESSAGE */
  int keepalive_ms;      /* NULL options: RPC_DEFAULT_KEEPALIVE_MS; 0 disables */
  const rpc_tls *tls;    /* NULL: plaintext */
  int gzip;              /* compress requests (servers here refuse them: for tests) */
  int reconnect_ms;      /* > 0: try to connect again every this many ms after a failure
                            (default: back-off from 1 s to 3 s) */
  int own_connection;    /* a connection of this channel's own: gRPC otherwise shares one
                            among the process's channels to a target with the same options
                            (many simulated workers in one process, ps-loadgen) */
} rpc_channel_opts;

/* A channel to target. NULL with a message when the TLS files cannot be
 * read; an unreachable target is not an error here (calls fail
 * UNAVAILABLE). */
rpc_channel *rpc_channel_create(const char *target, const rpc_channel_opts *opts, char *err);
void rpc_channel_destroy(rpc_channel *ch);
const char *rpc_channel_target(const rpc_channel *ch);

/* A queue on which one thread waits for its calls. */
rpc_queue *rpc_queue_create(void);
void rpc_queue_destroy(rpc_queue *q);

/* Starts a unary call; ownership of req's segments passes to rpc. Every
 * call has a deadline: timeout_ms <= 0 is refused (segments released).
 * wait_for_ready: wait for a connection (until the deadline) rather than
 * failing UNAVAILABLE at once. NULL with a message on failure. */
rpc_request *rpc_start(rpc_queue *q, rpc_channel *ch, const char *path, rpc_msg *req,
                       int timeout_ms, int wait_for_ready, char *err);

/* Waits for the call to end; returns its gRPC status code. detail (may be
 * NULL, else PS_ERRLEN bytes) receives the status message. On RPC_OK,
 * *response views the reply; it stays valid until rpc_request_free. */
int rpc_wait(rpc_request *r, char *detail, ps_segview *response);
/* Frees a call; one not yet waited for is cancelled and waited for, so this
 * runs on the thread that owns the queue. Free every request of a queue
 * before rpc_queue_destroy. */
void rpc_request_free(rpc_request *r);

/* Start + wait + copy: convenience for small calls. *resp receives a
 * malloc'd contiguous copy of the reply (free with free()). */
int rpc_call_sync(rpc_queue *q, rpc_channel *ch, const char *path, rpc_msg *req, int timeout_ms,
                  int wait_for_ready, uint8_t **resp, size_t *resp_len, char *detail);

#endif

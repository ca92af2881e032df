/* gRPC C core behind rpc.h. Every gRPC call of the project lives here, so
 * that a change of the core API (it changes between releases) touches one
 * file. GRPC-NOTES.md records the facts this file relies on.
 *
 * Server: one completion queue polled by a pool of threads. Each call struct
 * is first a waiting request slot (its tag is the struct), then, once
 * matched, an answer batch (same tag, next phase). A matched call is owned by
 * two parties: the handler, who must answer it once, and gRPC, until the
 * answer batch completes. A reference count on the struct covers both, so a
 * handler may answer from any thread, at any time, even after the server
 * answered the call CANCELLED on shutdown.
 *
 * Client: pluck queues (one waiting thread each), one batch of six ops per
 * unary call, the call's struct as its tag. */
#include "rpc.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/compression.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The server lets clients ping this often without data; clients never ask
 * for a shorter keepalive (a faster pinger would get GOAWAY). */
#define SERVER_MIN_PING_INTERVAL_MS 1000
#define CLIENT_KEEPALIVE_TIMEOUT_MS 20000
#define DEFAULT_SERVER_THREADS 2
#define DEFAULT_CALLS_PER_METHOD 8
#define DEFAULT_MAX_STREAMS 32
#define MAX_RECONNECT_BACKOFF_MS 3000
#define DEFAULT_MAX_METADATA (16 * 1024)
#define DEFAULT_IDLE_MS (10 * 60 * 1000)
#define STATUS_DETAIL_MAX 1024

static const char *const status_names[] = {
    [RPC_OK] = "OK",
    [RPC_CANCELLED] = "CANCELLED",
    [RPC_UNKNOWN] = "UNKNOWN",
    [RPC_INVALID_ARGUMENT] = "INVALID_ARGUMENT",
    [RPC_DEADLINE_EXCEEDED] = "DEADLINE_EXCEEDED",
    [RPC_NOT_FOUND] = "NOT_FOUND",
    [RPC_ALREADY_EXISTS] = "ALREADY_EXISTS",
    [RPC_PERMISSION_DENIED] = "PERMISSION_DENIED",
    [RPC_RESOURCE_EXHAUSTED] = "RESOURCE_EXHAUSTED",
    [RPC_FAILED_PRECONDITION] = "FAILED_PRECONDITION",
    [RPC_ABORTED] = "ABORTED",
    [RPC_OUT_OF_RANGE] = "OUT_OF_RANGE",
    [RPC_UNIMPLEMENTED] = "UNIMPLEMENTED",
    [RPC_INTERNAL] = "INTERNAL",
    [RPC_UNAVAILABLE] = "UNAVAILABLE",
    [RPC_DATA_LOSS] = "DATA_LOSS",
    [RPC_UNAUTHENTICATED] = "UNAUTHENTICATED",
};

const char *rpc_status_name(int code) {
  if (code < 0 || code >= (int)(sizeof(status_names) / sizeof(status_names[0])))
    return "UNKNOWN_STATUS_CODE";
  return status_names[code];
}

void rpc_msg_release(rpc_msg *m) {
  if (m == NULL)
    return;
  for (int i = 0; i < m->nseg && i < RPC_MAX_SEGS; i++) {
    if (m->seg[i].release != NULL)
      m->seg[i].release(m->seg[i].user);
    m->seg[i].release = NULL;
  }
  m->nseg = 0;
}

/* gRPC's locks are Abseil's, and a libabsl built without NDEBUG (Debian's)
 * checks every lock taken against a graph of lock orders, to report
 * potential deadlocks: a hash lookup per Lock whose chains grow with the
 * process's mutexes. With a thousand clients in one process (ps-loadgen)
 * it was a tenth of the CPU, and a few percent in a server. It reports
 * only; turning it off changes nothing else. Looked up by name, so that a
 * build against another Abseil (or one without the check) runs as is. */
static void absl_deadlock_check_off(void) {
  static const char *const names[] = {
      "_ZN4absl7debian329SetMutexDeadlockDetectionModeENS0_15OnDeadlockCycleE",
      "_ZN4absl12lts_2022062329SetMutexDeadlockDetectionModeENS0_15OnDeadlockCycleE",
      "_ZN4absl29SetMutexDeadlockDetectionModeENS_15OnDeadlockCycleE",
  };
  if (getenv("PS_ABSL_DEADLOCK_CHECK")) return; /* keep it, to debug gRPC's locking */
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    void *f = dlsym(RTLD_DEFAULT, names[i]);
    if (f) {
      void (*set_mode)(int) = (void (*)(int))f; /* absl::OnDeadlockCycle::kIgnore is 0 */
      set_mode(0);
      return;
    }
  }
}

void rpc_global_init(void) {
  absl_deadlock_check_off();
  grpc_init();
}

void rpc_global_shutdown(void) { grpc_shutdown(); }

static int msg_valid(const rpc_msg *m) {
  if (m == NULL || m->nseg < 0 || m->nseg > RPC_MAX_SEGS)
    return 0;
  for (int i = 0; i < m->nseg; i++)
    if (m->seg[i].ptr == NULL && m->seg[i].len > 0)
      return 0;
  return 1;
}

/* Takes ownership of m's segments: those with release become slices that
 * call it when gRPC drops them, the others are copied. Empty segments are
 * released at once. */
static grpc_byte_buffer *msg_to_buffer(rpc_msg *m) {
  grpc_slice sl[RPC_MAX_SEGS];
  size_t n = 0;
  for (int i = 0; m != NULL && i < m->nseg; i++) {
    rpc_seg *s = &m->seg[i];
    if (s->len == 0) {
      if (s->release != NULL)
        s->release(s->user);
    } else if (s->release != NULL) {
      sl[n++] = grpc_slice_new_with_user_data((void *)s->ptr, s->len, s->release, s->user);
    } else {
      sl[n++] = grpc_slice_from_copied_buffer((const char *)s->ptr, s->len);
    }
    s->release = NULL;
  }
  if (m != NULL)
    m->nseg = 0;
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, n); /* takes its own refs */
  for (size_t i = 0; i < n; i++)
    grpc_slice_unref(sl[i]);
  return bb;
}

/* ---- a received message seen as a ps_segview, without copying ---- */

#define VIEW_INLINE_SEGS 8

typedef struct {
  ps_seg inl[VIEW_INLINE_SEGS];
  ps_seg *segs;      /* inl, or malloc'd for many slices */
  grpc_slice *owned; /* slices of a decompressed buffer (rare), else NULL */
  size_t nowned;
  ps_segview view;
} payload_view;

static ps_seg *view_segs(payload_view *pv, size_t n) {
  if (n <= VIEW_INLINE_SEGS)
    return pv->inl;
  return malloc(n * sizeof(ps_seg));
}

/* The slices of an uncompressed byte buffer are read in place (inlined
 * slices keep their bytes inside the buffer's slice array, which does not
 * move while the buffer lives). A compressed buffer goes through a reader,
 * which inflates it; we keep references to the inflated slices. Returns 0,
 * or -1 when out of memory (pv is then empty and needs no free). */
static int payload_view_init(payload_view *pv, grpc_byte_buffer *bb) {
  memset(pv, 0, sizeof(*pv));
  pv->segs = pv->inl;
  pv->view.segs = pv->segs;
  if (bb == NULL)
    return 0;
  if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE) {
    const grpc_slice_buffer *sb = &bb->data.raw.slice_buffer;
    if ((pv->segs = view_segs(pv, sb->count)) == NULL)
      return -1;
    size_t total = 0;
    for (size_t i = 0; i < sb->count; i++) {
      pv->segs[i].ptr = GRPC_SLICE_START_PTR(sb->slices[i]);
      pv->segs[i].len = GRPC_SLICE_LENGTH(sb->slices[i]);
      total += pv->segs[i].len;
    }
    pv->view = (ps_segview){.segs = pv->segs, .nsegs = (int)sb->count, .total = total};
    return 0;
  }

  grpc_byte_buffer_reader rd;
  if (!grpc_byte_buffer_reader_init(&rd, bb))
    return -1;
  size_t cap = 0;
  grpc_slice s;
  while (grpc_byte_buffer_reader_next(&rd, &s)) {
    if (pv->nowned == cap) {
      size_t ncap = cap ? 2 * cap : 16;
      grpc_slice *p = realloc(pv->owned, ncap * sizeof(*p));
      if (p == NULL) {
        grpc_slice_unref(s);
        goto fail;
      }
      pv->owned = p;
      cap = ncap;
    }
    pv->owned[pv->nowned++] = s;
  }
  grpc_byte_buffer_reader_destroy(&rd);
  /* Only now: an inlined slice's bytes live in our array, which has
   * stopped moving. */
  if ((pv->segs = view_segs(pv, pv->nowned)) == NULL) {
    pv->segs = pv->inl;
    goto fail_unref;
  }
  size_t total = 0;
  for (size_t i = 0; i < pv->nowned; i++) {
    pv->segs[i].ptr = GRPC_SLICE_START_PTR(pv->owned[i]);
    pv->segs[i].len = GRPC_SLICE_LENGTH(pv->owned[i]);
    total += pv->segs[i].len;
  }
  pv->view = (ps_segview){.segs = pv->segs, .nsegs = (int)pv->nowned, .total = total};
  return 0;

fail:
  grpc_byte_buffer_reader_destroy(&rd);
fail_unref:
  for (size_t i = 0; i < pv->nowned; i++)
    grpc_slice_unref(pv->owned[i]);
  free(pv->owned);
  memset(pv, 0, sizeof(*pv));
  return -1;
}

static void payload_view_free(payload_view *pv) {
  for (size_t i = 0; i < pv->nowned; i++)
    grpc_slice_unref(pv->owned[i]);
  free(pv->owned);
  if (pv->segs != NULL && pv->segs != pv->inl)
    free(pv->segs);
  memset(pv, 0, sizeof(*pv));
}

static void copy_detail(char *dst, const char *src) {
  if (dst != NULL)
    snprintf(dst, PS_ERRLEN, "%s", src);
}

/* ================= server ================= */

typedef struct {
  char *path;
  rpc_handler fn;
  void *user;
  void *handle; /* grpc_server_register_method's */
} method;

enum { PHASE_WAITING, PHASE_ANSWERING };
enum { ANS_NONE, ANS_HANDLER, ANS_SHUTDOWN }; /* who answered the call */

struct rpc_call {
  rpc_server *s;
  method *m; /* NULL: the slot for unknown methods */
  int phase; /* which event the tag stands for next */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_call_details details; /* unknown methods only */
  grpc_byte_buffer *payload; /* the request; freed with the struct */
  payload_view req;
  char *peer;
  int cancelled;           /* RECV_CLOSE_ON_SERVER's */
  grpc_byte_buffer *reply; /* destroyed when the answer batch ends */
  atomic_int answered;     /* ANS_*: the first to set it answers */
  atomic_int refs;         /* the handler's duty to answer + gRPC's side */
  rpc_call *prev, *next;   /* in s->active while gRPC's side lives */
  rpc_call *cancel_next;   /* shutdown's list of calls it answers */
};

struct rpc_server {
  grpc_server *srv;
  grpc_completion_queue *cq;
  rpc_server_opts opts;
  method *methods;
  int nmethods;
  pthread_t *threads;
  int nthreads;
  int started, stopped;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* active emptied, shutdown tag seen */
  int shutting_down; /* under mu */
  int shutdown_seen; /* under mu */
  rpc_call *active;  /* matched calls whose gRPC side lives; under mu */
  char shutdown_tag; /* its address is the tag */
};

/* Frees the struct once both the handler and gRPC are done with it. Touches
 * nothing of the server, which may be gone by then. */
static void call_unref(rpc_call *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1)
    return;
  payload_view_free(&c->req);
  if (c->payload != NULL)
    grpc_byte_buffer_destroy(c->payload);
  if (c->peer != NULL)
    gpr_free(c->peer);
  free(c);
}

static void active_insert_locked(rpc_server *s, rpc_call *c) {
  c->prev = NULL;
  c->next = s->active;
  if (s->active != NULL)
    s->active->prev = c;
  s->active = c;
}

static void active_remove_locked(rpc_server *s, rpc_call *c) {
  if (c->prev != NULL)
    c->prev->next = c->next;
  else
    s->active = c->next;
  if (c->next != NULL)
    c->next->prev = c->prev;
  c->prev = c->next = NULL;
}

/* gRPC is done with the call: give back its resources, then leave `active`
 * (last: shutdown destroys the server once `active` is empty), and drop
 * gRPC's reference. */
static void release_grpc_side(rpc_call *c) {
  rpc_server *s = c->s;
  grpc_metadata_array_destroy(&c->md);
  if (c->m == NULL)
    grpc_call_details_destroy(&c->details);
  if (c->reply != NULL)
    grpc_byte_buffer_destroy(c->reply);
  c->reply = NULL;
  grpc_call_unref(c->call);
  c->call = NULL;
  pthread_mutex_lock(&s->mu);
  active_remove_locked(s, c);
  if (s->active == NULL)
    pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  call_unref(c);
}

/* Sends the answer in one batch; its completion releases gRPC's side.
 * Called once per call, by whoever won c->answered. */
static void start_answer(rpc_call *c, int status, const char *detail, grpc_byte_buffer *reply) {
  grpc_op ops[4];
  size_t n = 0;
  memset(ops, 0, sizeof(ops));
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (reply != NULL) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = reply;
  }
  grpc_slice det = grpc_slice_from_copied_string(detail != NULL ? detail : "");
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = (grpc_status_code)status;
  ops[n++].data.send_status_from_server.status_details = detail != NULL ? &det : NULL;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;

  c->reply = reply;
  c->phase = PHASE_ANSWERING;
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, c, NULL);
  grpc_slice_unref(det); /* the batch keeps its own copy */
  if (e != GRPC_CALL_OK) {
    PS_WARN("rpc: could not answer a call (%s)", grpc_call_error_to_string(e));
    release_grpc_side(c);
  }
}

/* Posts a fresh request slot for m (NULL: unknown methods). */
static int post_slot(rpc_server *s, method *m) {
  rpc_call *c = calloc(1, sizeof(*c));
  if (c == NULL)
    return PS_ENOMEM;
  c->s = s;
  c->m = m;
  c->phase = PHASE_WAITING;
  atomic_init(&c->refs, 1);
  atomic_init(&c->answered, ANS_NONE);
  grpc_metadata_array_init(&c->md);
  grpc_call_error e;
  if (m != NULL) {
    e = grpc_server_request_registered_call(s->srv, m->handle, &c->call, &c->deadline, &c->md,
                                            &c->payload, s->cq, s->cq, c);
  } else {
    grpc_call_details_init(&c->details);
    e = grpc_server_request_call(s->srv, &c->call, &c->details, &c->md, s->cq, s->cq, c);
  }
  if (e != GRPC_CALL_OK) {
    grpc_metadata_array_destroy(&c->md);
    if (m == NULL)
      grpc_call_details_destroy(&c->details);
    free(c);
    PS_ERROR("rpc: could not post a request for %s (%s)", m ? m->path : "unknown methods",
             grpc_call_error_to_string(e));
    return PS_ESTATE;
  }
  return PS_OK;
}

/* A slot that never matched (the server is shutting down). */
static void free_slot(rpc_call *c) {
  grpc_metadata_array_destroy(&c->md);
  if (c->m == NULL)
    grpc_call_details_destroy(&c->details);
  if (c->payload != NULL)
    grpc_byte_buffer_destroy(c->payload);
  if (c->call != NULL)
    grpc_call_unref(c->call);
  free(c);
}

enum { ACT_HANDLE, ACT_UNIMPLEMENTED, ACT_CANCEL, ACT_NOMEM };

static void on_new_call(rpc_server *s, rpc_call *c) {
  c->peer = grpc_call_get_peer(c->call);
  int nomem = c->m != NULL && payload_view_init(&c->req, c->payload) != 0;

  /* Decided under the lock that shutdown takes, so that every matched call
   * is either in `active` before shutdown looks, or sees shutting_down. */
  int act;
  pthread_mutex_lock(&s->mu);
  if (!s->shutting_down)
    post_slot(s, c->m); /* first, so the method keeps its slots */
  if (c->m == NULL) {
    act = ACT_UNIMPLEMENTED;
    atomic_store(&c->answered, ANS_HANDLER);
  } else if (s->shutting_down) {
    act = ACT_CANCEL;
    atomic_store(&c->answered, ANS_SHUTDOWN);
  } else if (nomem) {
    act = ACT_NOMEM;
    atomic_store(&c->answered, ANS_HANDLER);
  } else {
    act = ACT_HANDLE;
    atomic_store(&c->refs, 2);
  }
  active_insert_locked(s, c);
  pthread_mutex_unlock(&s->mu);

  switch (act) {
  case ACT_HANDLE:
    c->m->fn(c, &c->req.view, c->m->user);
    break;
  case ACT_UNIMPLEMENTED: {
    char msg[STATUS_DETAIL_MAX];
    char *path = grpc_slice_to_c_string(c->details.method);
    snprintf(msg, sizeof(msg), "unknown method %s", path);
    gpr_free(path);
    start_answer(c, RPC_UNIMPLEMENTED, msg, NULL);
    break;
  }
  case ACT_CANCEL:
    start_answer(c, RPC_CANCELLED, "server shutting down", NULL);
    break;
  default:
    start_answer(c, RPC_RESOURCE_EXHAUSTED, "server out of memory", NULL);
    break;
  }
}

static void dispatch(rpc_server *s, void *tag, int ok) {
  if (tag == &s->shutdown_tag) {
    pthread_mutex_lock(&s->mu);
    s->shutdown_seen = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return;
  }
  rpc_call *c = tag;
  if (c->phase == PHASE_ANSWERING)
    release_grpc_side(c); /* ok or not: the call is over either way */
  else if (!ok)
    free_slot(c);
  else
    on_new_call(s, c);
}

static void *serve(void *arg) {
  rpc_server *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
    if (ev.type == GRPC_OP_COMPLETE)
      dispatch(s, ev.tag, ev.success);
  }
  return NULL;
}

static grpc_arg int_arg(const char *key, int value) {
  grpc_arg a;
  memset(&a, 0, sizeof(a));
  a.type = GRPC_ARG_INTEGER;
  a.key = (char *)key;
  a.value.integer = value;
  return a;
}

/* The PEM files of tls, read into NUL-terminated strings (free with
 * tls_pem_free). */
typedef struct {
  char *ca, *cert, *key;
} tls_pem;

static void tls_pem_free(tls_pem *p) {
  free(p->ca);
  free(p->cert);
  free(p->key);
  memset(p, 0, sizeof *p);
}

static int tls_pem_read(const rpc_tls *tls, tls_pem *p, char *err) {
  memset(p, 0, sizeof *p);
  const char *files[3] = {tls->ca_file, tls->cert_file, tls->key_file};
  char **dst[3] = {&p->ca, &p->cert, &p->key};
  for (int i = 0; i < 3; i++) {
    if (!files[i]) continue;
    size_t len = 0;
    char why[PS_ERRLEN];
    if (ps_read_file(files[i], dst[i], &len, why) != 0) {
      tls_pem_free(p);
      return ps_seterr(err, PS_EIO, "TLS: %s", why);
    }
    if (!strstr(*dst[i], "-----BEGIN ")) {
      tls_pem_free(p);
      return ps_seterr(err, PS_EINVAL, "TLS: '%s' is not a PEM file", files[i]);
    }
  }
  if ((p->cert == NULL) != (p->key == NULL)) {
    tls_pem_free(p);
    return ps_seterr(err, PS_EINVAL, "TLS: a certificate needs its key and a key its certificate");
  }
  return 0;
}

/* Server credentials: TLS from the files, or plaintext. NULL with a
 * message when the files cannot be read. */
static grpc_server_credentials *server_creds(const rpc_tls *tls, char *err) {
  if (tls == NULL)
    return grpc_insecure_server_credentials_create();
  tls_pem p;
  if (tls_pem_read(tls, &p, err) != 0)
    return NULL;
  if (p.cert == NULL) {
    tls_pem_free(&p);
    ps_seterr(err, PS_EINVAL, "TLS: a server needs a certificate and its key");
    return NULL;
  }
  if (tls->require_client_cert && p.ca == NULL) {
    tls_pem_free(&p);
    ps_seterr(err, PS_EINVAL, "TLS: requiring client certificates needs the CA that signs them");
    return NULL;
  }
  grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
  grpc_ssl_client_certificate_request_type req =
      tls->require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
      : p.ca                   ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  grpc_server_credentials *c = grpc_ssl_server_credentials_create_ex(p.ca, &pair, 1, req, NULL);
  tls_pem_free(&p); /* gRPC keeps its own copies */
  if (c == NULL)
    ps_seterr(err, PS_EINVAL, "TLS: gRPC refused the certificate or key");
  return c;
}

rpc_server *rpc_server_create(const char *addr, const rpc_server_opts *opts, int *bound_port,
                              char *err) {
  if (addr == NULL) {
    ps_seterr(err, PS_EINVAL, "rpc_server_create: no address");
    return NULL;
  }
  rpc_server *s = calloc(1, sizeof(*s));
  if (s == NULL) {
    ps_seterr(err, PS_ENOMEM, "rpc_server_create: out of memory");
    return NULL;
  }
  if (opts != NULL)
    s->opts = *opts;
  if (s->opts.threads <= 0)
    s->opts.threads = DEFAULT_SERVER_THREADS;
  if (s->opts.max_message_bytes <= 0)
    s->opts.max_message_bytes = RPC_DEFAULT_MAX_MESSAGE;
  if (s->opts.calls_per_method <= 0)
    s->opts.calls_per_method = DEFAULT_CALLS_PER_METHOD;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);

  if (s->opts.max_receive_bytes <= 0)
    s->opts.max_receive_bytes = s->opts.max_message_bytes;
  if (s->opts.max_streams <= 0)
    s->opts.max_streams = DEFAULT_MAX_STREAMS;
  if (s->opts.max_metadata_bytes <= 0)
    s->opts.max_metadata_bytes = DEFAULT_MAX_METADATA;
  if (s->opts.idle_ms <= 0)
    s->opts.idle_ms = DEFAULT_IDLE_MS;
  grpc_arg args[] = {
      int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, s->opts.max_receive_bytes),
      int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, s->opts.max_message_bytes),
      int_arg(GRPC_ARG_MAX_CONCURRENT_STREAMS, s->opts.max_streams),
      int_arg(GRPC_ARG_MAX_METADATA_SIZE, s->opts.max_metadata_bytes),
      int_arg(GRPC_ARG_MAX_CONNECTION_IDLE_MS, s->opts.idle_ms),
      /* identity only: a compressed request is refused, never inflated */
      int_arg(GRPC_COMPRESSION_CHANNEL_ENABLED_ALGORITHMS_BITSET, 1),
      /* Clients' keepalive pings must not count as abuse. */
      int_arg(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, SERVER_MIN_PING_INTERVAL_MS),
      int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1),
  };
  /* What the server's connections may hold in memory, in all. */
  grpc_resource_quota *quota = NULL;
  grpc_arg all[sizeof(args) / sizeof(args[0]) + 1];
  memcpy(all, args, sizeof args);
  size_t nargs = sizeof(args) / sizeof(args[0]);
  if (s->opts.memory_bytes > 0) {
    quota = grpc_resource_quota_create("rpc_server");
    grpc_resource_quota_resize(quota, s->opts.memory_bytes);
    grpc_arg *qa = &all[nargs++];
    memset(qa, 0, sizeof *qa);
    qa->type = GRPC_ARG_POINTER;
    qa->key = (char *)GRPC_ARG_RESOURCE_QUOTA;
    qa->value.pointer.p = quota;
    qa->value.pointer.vtable = grpc_resource_quota_arg_vtable();
  }
  grpc_channel_args cargs = {.num_args = nargs, .args = all};
  s->srv = grpc_server_create(&cargs, NULL);
  if (quota != NULL)
    grpc_resource_quota_unref(quota);
  s->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(s->srv, s->cq, NULL);

  grpc_server_credentials *creds = server_creds(s->opts.tls, err);
  if (creds == NULL) {
    rpc_server_destroy(s);
    return NULL;
  }
  int port = grpc_server_add_http2_port(s->srv, addr, creds);
  grpc_server_credentials_release(creds);
  if (port == 0) {
    ps_seterr(err, PS_EIO, "rpc: cannot listen on %s (address in use or malformed?)", addr);
    rpc_server_destroy(s);
    return NULL;
  }
  if (bound_port != NULL)
    *bound_port = port;
  return s;
}

int rpc_server_add_method(rpc_server *s, const char *path, rpc_handler fn, void *user) {
  if (s == NULL || path == NULL || path[0] != '/' || fn == NULL)
    return PS_EINVAL;
  if (s->started || s->stopped)
    return PS_ESTATE;
  method *ms = realloc(s->methods, (size_t)(s->nmethods + 1) * sizeof(method));
  if (ms == NULL)
    return PS_ENOMEM;
  s->methods = ms;
  method *m = &s->methods[s->nmethods];
  if ((m->path = strdup(path)) == NULL)
    return PS_ENOMEM;
  m->fn = fn;
  m->user = user;
  m->handle = grpc_server_register_method(s->srv, m->path, NULL,
                                          GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
  if (m->handle == NULL) { /* registered twice */
    free(m->path);
    return PS_EINVAL;
  }
  s->nmethods++;
  return PS_OK;
}

/* On error the server is started but may serve fewer calls at once than
 * asked; rpc_server_shutdown / _destroy still clean it up. */
int rpc_server_start(rpc_server *s, char *err) {
  if (s == NULL || s->started || s->stopped)
    return ps_seterr(err, PS_ESTATE, "rpc_server_start: already started or stopped");
  grpc_server_start(s->srv);
  s->started = 1;
  int rc = PS_OK;
  /* The methods array no longer moves: slots may point into it. */
  for (int i = 0; i < s->nmethods && rc == PS_OK; i++)
    for (int k = 0; k < s->opts.calls_per_method && rc == PS_OK; k++)
      rc = post_slot(s, &s->methods[i]);
  if (rc == PS_OK)
    rc = post_slot(s, NULL);
  if (rc != PS_OK)
    return ps_seterr(err, rc, "rpc: could not post request slots");
  if ((s->threads = calloc((size_t)s->opts.threads, sizeof(pthread_t))) == NULL)
    return ps_seterr(err, PS_ENOMEM, "rpc: out of memory for threads");
  for (int i = 0; i < s->opts.threads; i++) {
    if (pthread_create(&s->threads[i], NULL, serve, s) != 0)
      return ps_seterr(err, PS_ENOMEM, "rpc: could only start %d of %d server threads", s->nthreads,
                       s->opts.threads);
    s->nthreads++;
  }
  return PS_OK;
}

/* Stands in for the server threads when there are none (never started). */
static void pump_until_stopped(rpc_server *s) {
  for (;;) {
    pthread_mutex_lock(&s->mu);
    int done = s->shutdown_seen && s->active == NULL;
    pthread_mutex_unlock(&s->mu);
    if (done)
      return;
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_OP_COMPLETE)
      dispatch(s, ev.tag, ev.success);
  }
}

/* Must not be called from a handler running on a server thread (it joins
 * them). Safe to call twice. */
void rpc_server_shutdown(rpc_server *s) {
  if (s == NULL || s->stopped)
    return;
  s->stopped = 1;

  /* Take every unanswered call away from its handler: the handler's later
   * answer is then dropped (its segments released). */
  rpc_call *todo = NULL;
  pthread_mutex_lock(&s->mu);
  s->shutting_down = 1;
  for (rpc_call *c = s->active; c != NULL; c = c->next) {
    int expect = ANS_NONE;
    if (atomic_compare_exchange_strong(&c->answered, &expect, ANS_SHUTDOWN)) {
      c->cancel_next = todo;
      todo = c;
    }
  }
  pthread_mutex_unlock(&s->mu);
  /* Their gRPC side stays until these batches complete, so they are alive. */
  while (todo != NULL) {
    rpc_call *c = todo;
    todo = c->cancel_next;
    start_answer(c, RPC_CANCELLED, "server shutting down", NULL);
  }

  grpc_server_shutdown_and_notify(s->srv, s->cq, &s->shutdown_tag);
  grpc_server_cancel_all_calls(s->srv);
  if (s->nthreads == 0) {
    pump_until_stopped(s);
  } else {
    /* Wait also for `active` to empty: no batch may start on the queue
     * after it is shut down. */
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_seen || s->active != NULL)
      pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
  }
  grpc_server_destroy(s->srv);
  s->srv = NULL;

  grpc_completion_queue_shutdown(s->cq);
  for (int i = 0; i < s->nthreads; i++)
    pthread_join(s->threads[i], NULL);
  if (s->nthreads == 0) {
    for (;;) {
      grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
      if (ev.type == GRPC_QUEUE_SHUTDOWN)
        break;
      if (ev.type == GRPC_OP_COMPLETE)
        dispatch(s, ev.tag, ev.success);
    }
  }
  s->nthreads = 0;
  grpc_completion_queue_destroy(s->cq);
  s->cq = NULL;
}

void rpc_server_destroy(rpc_server *s) {
  if (s == NULL)
    return;
  rpc_server_shutdown(s);
  for (int i = 0; i < s->nmethods; i++)
    free(s->methods[i].path);
  free(s->methods);
  free(s->threads);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}

void rpc_call_reply(rpc_call *c, rpc_msg *response) {
  if (c == NULL) {
    rpc_msg_release(response);
    return;
  }
  int expect = ANS_NONE;
  if (!atomic_compare_exchange_strong(&c->answered, &expect, ANS_HANDLER)) {
    rpc_msg_release(response); /* shutdown answered it already */
  } else if (response != NULL && !msg_valid(response)) {
    rpc_msg_release(response);
    start_answer(c, RPC_INTERNAL, "server built a malformed reply", NULL);
  } else {
    start_answer(c, RPC_OK, NULL, msg_to_buffer(response));
  }
  call_unref(c);
}

void rpc_call_fail(rpc_call *c, int status, const char *fmt, ...) {
  if (c == NULL)
    return;
  int expect = ANS_NONE;
  if (atomic_compare_exchange_strong(&c->answered, &expect, ANS_HANDLER)) {
    char msg[STATUS_DETAIL_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    /* OK with no message would read as a broken reply: keep it an error. */
    start_answer(c, status == RPC_OK ? RPC_UNKNOWN : status, msg, NULL);
  }
  call_unref(c);
}

const char *rpc_call_peer(rpc_call *c) {
  return c != NULL && c->peer != NULL ? c->peer : "unknown";
}

/* ================= client ================= */

typedef struct {
  char *path; /* must outlive the channel's registration */
  void *handle;
} channel_method;

struct rpc_channel {
  grpc_channel *ch;
  char *target;
  pthread_mutex_t mu;
  channel_method *methods; /* under mu */
  int nmethods, cap;
};

struct rpc_queue {
  grpc_completion_queue *cq;
};

struct rpc_request {
  rpc_queue *q;
  grpc_call *call;
  grpc_byte_buffer *send, *recv;
  grpc_metadata_array init_md, trail_md;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  int done;    /* its tag was plucked */
  int success; /* the event's */
  int viewed;  /* resp is built */
  payload_view resp;
};

rpc_channel *rpc_channel_create(const char *target, const rpc_channel_opts *opts, char *err) {
  if (target == NULL || target[0] == '\0') {
    ps_seterr(err, PS_EINVAL, "rpc_channel_create: no target");
    return NULL;
  }
  int max_msg = RPC_DEFAULT_MAX_MESSAGE, keepalive = RPC_DEFAULT_KEEPALIVE_MS;
  if (opts != NULL) {
    if (opts->max_message_bytes > 0)
      max_msg = opts->max_message_bytes;
    keepalive = opts->keepalive_ms > 0 ? opts->keepalive_ms : 0;
  }
  if (keepalive > 0 && keepalive < SERVER_MIN_PING_INTERVAL_MS)
    keepalive = SERVER_MIN_PING_INTERVAL_MS;

  rpc_channel *ch = calloc(1, sizeof(*ch));
  if (ch == NULL || (ch->target = strdup(target)) == NULL) {
    free(ch);
    ps_seterr(err, PS_ENOMEM, "rpc_channel_create: out of memory");
    return NULL;
  }
  pthread_mutex_init(&ch->mu, NULL);

  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  const rpc_tls *tls = opts != NULL ? opts->tls : NULL;
  if (tls != NULL) {
    tls_pem p;
    if (tls_pem_read(tls, &p, err) != 0) {
      grpc_channel_credentials_release(creds);
      free(ch->target);
      pthread_mutex_destroy(&ch->mu);
      free(ch);
      return NULL;
    }
    grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
    grpc_channel_credentials_release(creds);
    creds = grpc_ssl_credentials_create(p.ca, p.cert ? &pair : NULL, NULL, NULL);
    tls_pem_free(&p);
  }
  grpc_arg args[16];
  size_t n = 0;
  if (opts != NULL && opts->gzip)
    args[n++] = int_arg(GRPC_COMPRESSION_CHANNEL_DEFAULT_ALGORITHM, GRPC_COMPRESS_GZIP);
  if (opts != NULL && opts->own_connection)
    args[n++] = int_arg(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (tls != NULL && tls->server_name != NULL) {
    args[n].type = GRPC_ARG_STRING;
    args[n].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
    args[n++].value.string = (char *)tls->server_name;
  }
  args[n++] = int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_msg);
  args[n++] = int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_msg);
  /* A shard that comes back is found within seconds (gRPC's default
   * reconnect back-off grows to two minutes). */
  if (opts != NULL && opts->reconnect_ms > 0) {
    /* A replica that comes back is to be reached at once (a primary's
     * backup rejoining, a worker's next primary). */
    args[n++] = int_arg(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, opts->reconnect_ms);
    args[n++] = int_arg(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, opts->reconnect_ms);
    args[n++] = int_arg(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, opts->reconnect_ms);
  } else {
    args[n++] = int_arg(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, MAX_RECONNECT_BACKOFF_MS);
  }
  if (keepalive > 0) {
    args[n++] = int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive);
    args[n++] =
        int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                keepalive < CLIENT_KEEPALIVE_TIMEOUT_MS ? keepalive : CLIENT_KEEPALIVE_TIMEOUT_MS);
    args[n++] = int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    /* Else the pings stop after two without data, and a dead idle peer
     * goes unnoticed. */
    args[n++] = int_arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  grpc_channel_args cargs = {.num_args = n, .args = args};
  ch->ch = grpc_channel_create(target, creds, &cargs); /* never NULL: a lame channel at worst */
  grpc_channel_credentials_release(creds);
  return ch;
}

void rpc_channel_destroy(rpc_channel *ch) {
  if (ch == NULL)
    return;
  grpc_channel_destroy(ch->ch);
  for (int i = 0; i < ch->nmethods; i++)
    free(ch->methods[i].path);
  free(ch->methods);
  free(ch->target);
  pthread_mutex_destroy(&ch->mu);
  free(ch);
}

const char *rpc_channel_target(const rpc_channel *ch) { return ch != NULL ? ch->target : ""; }

/* The registration handle of path on ch, registering it on first use;
 * NULL when out of memory. */
static void *channel_method_handle(rpc_channel *ch, const char *path) {
  void *h = NULL;
  pthread_mutex_lock(&ch->mu);
  for (int i = 0; i < ch->nmethods; i++)
    if (strcmp(ch->methods[i].path, path) == 0) {
      h = ch->methods[i].handle;
      goto out;
    }
  if (ch->nmethods == ch->cap) {
    int ncap = ch->cap ? 2 * ch->cap : 8;
    channel_method *p = realloc(ch->methods, (size_t)ncap * sizeof(*p));
    if (p == NULL)
      goto out;
    ch->methods = p;
    ch->cap = ncap;
  }
  char *copy = strdup(path);
  if (copy == NULL)
    goto out;
  h = grpc_channel_register_call(ch->ch, copy, NULL, NULL);
  ch->methods[ch->nmethods++] = (channel_method){.path = copy, .handle = h};
out:
  pthread_mutex_unlock(&ch->mu);
  return h;
}

rpc_queue *rpc_queue_create(void) {
  rpc_queue *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return NULL;
  q->cq = grpc_completion_queue_create_for_pluck(NULL);
  return q;
}

/* Every request started on q must have been freed. */
void rpc_queue_destroy(rpc_queue *q) {
  if (q == NULL)
    return;
  grpc_completion_queue_shutdown(q->cq);
  for (;;) {
    grpc_event ev =
        grpc_completion_queue_pluck(q->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
  }
  grpc_completion_queue_destroy(q->cq);
  free(q);
}

static void request_free_parts(rpc_request *r) {
  payload_view_free(&r->resp);
  if (r->send != NULL)
    grpc_byte_buffer_destroy(r->send);
  if (r->recv != NULL)
    grpc_byte_buffer_destroy(r->recv);
  grpc_metadata_array_destroy(&r->init_md);
  grpc_metadata_array_destroy(&r->trail_md);
  grpc_slice_unref(r->details);
  if (r->error_string != NULL)
    gpr_free((void *)r->error_string);
  if (r->call != NULL)
    grpc_call_unref(r->call);
  free(r);
}

rpc_request *rpc_start(rpc_queue *q, rpc_channel *ch, const char *path, rpc_msg *req,
                       int timeout_ms, int wait_for_ready, char *err) {
  if (q == NULL || ch == NULL || path == NULL || path[0] != '/' || !msg_valid(req)) {
    rpc_msg_release(req);
    ps_seterr(err, PS_EINVAL, "rpc_start: bad arguments");
    return NULL;
  }
  /* Every call has a deadline: a lost peer must not hang its waiter. */
  if (timeout_ms <= 0) {
    rpc_msg_release(req);
    ps_seterr(err, PS_EINVAL, "rpc_start %s: timeout_ms must be positive (got %d)", path,
              timeout_ms);
    return NULL;
  }
  void *handle = channel_method_handle(ch, path);
  rpc_request *r = handle != NULL ? calloc(1, sizeof(*r)) : NULL;
  if (r == NULL) {
    rpc_msg_release(req);
    ps_seterr(err, PS_ENOMEM, "rpc_start %s: out of memory", path);
    return NULL;
  }
  r->q = q;
  grpc_metadata_array_init(&r->init_md);
  grpc_metadata_array_init(&r->trail_md);
  r->details = grpc_empty_slice();
  r->send = msg_to_buffer(req);
  gpr_timespec deadline =
      gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
  r->call = grpc_channel_create_registered_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, q->cq,
                                                handle, deadline, NULL);
  if (r->call == NULL) {
    request_free_parts(r);
    ps_seterr(err, PS_ESTATE, "rpc_start %s: gRPC would not create the call", path);
    return NULL;
  }

  grpc_op ops[6];
  memset(ops, 0, sizeof(ops));
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (wait_for_ready)
    ops[0].flags =
        GRPC_INITIAL_METADATA_WAIT_FOR_READY | GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = r->send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &r->init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &r->recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &r->trail_md;
  ops[5].data.recv_status_on_client.status = &r->status;
  ops[5].data.recv_status_on_client.status_details = &r->details;
  ops[5].data.recv_status_on_client.error_string = &r->error_string;
  grpc_call_error e = grpc_call_start_batch(r->call, ops, 6, r, NULL);
  if (e != GRPC_CALL_OK) {
    request_free_parts(r);
    ps_seterr(err, PS_ESTATE, "rpc_start %s: %s", path, grpc_call_error_to_string(e));
    return NULL;
  }
  return r;
}

int rpc_wait(rpc_request *r, char *detail, ps_segview *response) {
  static const ps_seg no_segs[1];
  if (response != NULL)
    *response = (ps_segview){.segs = no_segs, .nsegs = 0, .total = 0};
  if (r == NULL) {
    copy_detail(detail, "rpc_wait: no request");
    return RPC_INVALID_ARGUMENT;
  }
  if (!r->done) {
    /* The call's deadline bounds this wait. */
    grpc_event ev =
        grpc_completion_queue_pluck(r->q->cq, r, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    r->done = 1;
    r->success = ev.type == GRPC_OP_COMPLETE && ev.success;
  }
  /* RECV_STATUS_ON_CLIENT makes the batch succeed even when the call
   * failed: the status code is what counts. */
  int code = (int)r->status;
  if (code == RPC_OK && !r->success) {
    copy_detail(detail, "the call's batch failed inside gRPC");
    return RPC_UNKNOWN;
  }
  if (code != RPC_OK) {
    if (detail != NULL) {
      size_t n = GRPC_SLICE_LENGTH(r->details);
      if (n > 0)
        snprintf(detail, PS_ERRLEN, "%.*s", (int)(n < PS_ERRLEN ? n : PS_ERRLEN - 1),
                 (const char *)GRPC_SLICE_START_PTR(r->details));
      else
        copy_detail(detail, r->error_string != NULL ? r->error_string : rpc_status_name(code));
    }
    return code;
  }
  if (r->recv == NULL) {
    copy_detail(detail, "the server answered OK without a message");
    return RPC_INTERNAL;
  }
  if (!r->viewed) {
    if (payload_view_init(&r->resp, r->recv) != 0) {
      copy_detail(detail, "out of memory for the reply's view");
      return RPC_RESOURCE_EXHAUSTED;
    }
    r->viewed = 1;
  }
  copy_detail(detail, "");
  if (response != NULL)
    *response = r->resp.view;
  return RPC_OK;
}

/* A request not yet waited for is cancelled; its completion is plucked
 * here, so call this on the queue's thread. */
void rpc_request_free(rpc_request *r) {
  if (r == NULL)
    return;
  if (!r->done) {
    grpc_call_cancel(r->call, NULL);
    grpc_completion_queue_pluck(r->q->cq, r, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    r->done = 1;
  }
  request_free_parts(r);
}

int rpc_call_sync(rpc_queue *q, rpc_channel *ch, const char *path, rpc_msg *req, int timeout_ms,
                  int wait_for_ready, uint8_t **resp, size_t *resp_len, char *detail) {
  char err[PS_ERRLEN];
  if (resp != NULL)
    *resp = NULL;
  if (resp_len != NULL)
    *resp_len = 0;
  rpc_request *r = rpc_start(q, ch, path, req, timeout_ms, wait_for_ready, err);
  if (r == NULL) {
    copy_detail(detail, err);
    return RPC_INTERNAL;
  }
  ps_segview v;
  int code = rpc_wait(r, detail, &v);
  if (code == RPC_OK && resp != NULL) {
    uint8_t *buf = malloc(v.total > 0 ? v.total : 1);
    if (buf == NULL) {
      copy_detail(detail, "out of memory for the reply");
      code = RPC_RESOURCE_EXHAUSTED;
    } else {
      size_t off = 0;
      for (int i = 0; i < v.nsegs; i++) {
        memcpy(buf + off, v.segs[i].ptr, v.segs[i].len);
        off += v.segs[i].len;
      }
      *resp = buf;
      if (resp_len != NULL)
        *resp_len = v.total;
    }
  }
  rpc_request_free(r);
  return code;
}

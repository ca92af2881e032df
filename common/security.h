/* A process's security settings from its flags: TLS files and the job's
 * tokens, checked for what goes together, with the warnings a user must
 * see when something is left open. Shared by ps-server, ps-worker and the
 * --status client. */
#ifndef PS_COMMON_SECURITY_H
#define PS_COMMON_SECURITY_H

#include "auth.h"
#include "rpc.h"

/* The flags (every field may be NULL/0). */
typedef struct {
  int insecure;                /* plaintext, and (servers) no token, allowed */
  const char *token_file;      /* NULL: $PS_TOKEN_FILE */
  const char *read_token_file; /* servers: the read-only token */
  const char *tls_cert, *tls_key, *tls_ca;
  int tls_require_client_cert; /* servers */
} ps_security_opts;

/* The option rows (common/options.h) of a client's security flags,
 * --token-file, --tls-ca, --tls-cert, --tls-key and --insecure, for an
 * options struct of type T whose ps_security_opts is its field `sec`.
 * TOKEN_HELP says what the token is to this program, HOLDER whose the
 * certificate is ("this worker's"). */
#define PS_CLIENT_SECURITY_OPTIONS(T, TOKEN_HELP, HOLDER)                                      \
  {"token-file", "FILE", PS_OPT_STR, offsetof(T, sec.token_file),                             \
   .def_doc = "`$PS_TOKEN_FILE`", .help = TOKEN_HELP},                                         \
      {"tls-ca", "FILE", PS_OPT_STR, offsetof(T, sec.tls_ca),                                  \
       .help = "talk TLS, and trust servers whose certificates this CA (PEM) signed"},         \
      {"tls-cert", "FILE", PS_OPT_STR, offsetof(T, sec.tls_cert),                              \
       .help = HOLDER " certificate (PEM), for servers that require client certificates"},     \
      {"tls-key", "FILE", PS_OPT_STR, offsetof(T, sec.tls_key),                                \
       .help = "its private key (PEM)"},                                                       \
      {"insecure", NULL, PS_OPT_FLAG, offsetof(T, sec.insecure),                               \
       .help = "talk plaintext to servers that serve plaintext (said in the log)"}

typedef struct {
  ps_token token;      /* the job token (empty: none) */
  ps_token read_token; /* servers: the read-only token (empty: none) */
  rpc_tls tls;
  int use_tls;
  /* what the log should say about it, one line */
  char summary[160];
} ps_security;

enum { PS_SECURITY_SERVER = 1, PS_SECURITY_CLIENT = 2 };

/* Resolves the flags for a server or a client: reads the token files,
 * checks that TLS has what it needs (a server: certificate and key; mutual
 * TLS: a CA), and refuses an unprotected set-up (no TLS, or a server with
 * no token) unless insecure is set. 0, or PS_EINVAL/PS_EIO with a message
 * in err that says what to give. Warnings (a token file others can read,
 * plaintext, no token) are logged with PS_WARN. */
int ps_security_resolve(const ps_security_opts *o, int role, ps_security *out, char *err);

/* rpc's TLS options for out, or NULL for plaintext. */
const rpc_tls *ps_security_tls(const ps_security *s);

#endif

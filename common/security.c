/* Security settings from flags (see security.h). */
#include "security.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static int load(const char *path, const char *what, ps_token *t, char *err) {
  char warning[PS_ERRLEN], why[PS_ERRLEN];
  if (ps_token_load(path, t, warning, why) != 0)
    return ps_seterr(err, PS_EINVAL, "%s: %s", what, why);
  if (warning[0]) PS_WARN("%s", warning);
  return PS_OK;
}

int ps_security_resolve(const ps_security_opts *o, int role, ps_security *out, char *err) {
  memset(out, 0, sizeof *out);
  const int server = role == PS_SECURITY_SERVER;
  const char *token_file = o->token_file ? o->token_file : getenv("PS_TOKEN_FILE");
  if (token_file && token_file[0] && load(token_file, "--token-file", &out->token, err) != 0)
    return PS_EINVAL;
  if (server && o->read_token_file &&
      load(o->read_token_file, "--read-token-file", &out->read_token, err) != 0)
    return PS_EINVAL;
  if (out->read_token.len && !out->token.len)
    return ps_seterr(err, PS_EINVAL, "--read-token-file needs --token-file (the job token)");
  if (out->read_token.len &&
      ps_ct_equal(out->read_token.bytes, out->read_token.len, out->token.bytes, out->token.len))
    return ps_seterr(err, PS_EINVAL, "the read-only token must differ from the job token");
  if ((o->tls_cert != NULL) != (o->tls_key != NULL))
    return ps_seterr(err, PS_EINVAL, "--tls-cert and --tls-key go together");
  if (o->tls_require_client_cert && !o->tls_ca)
    return ps_seterr(err, PS_EINVAL,
                     "--tls-require-client-cert needs --tls-ca (the CA that signs the clients)");
  out->use_tls = server ? o->tls_cert != NULL : (o->tls_ca != NULL || o->tls_cert != NULL);
  if (!out->use_tls && (o->tls_ca || o->tls_cert))
    return ps_seterr(err, PS_EINVAL, "a server needs --tls-cert and --tls-key for TLS");
  if (!out->use_tls && !o->insecure)
    return ps_seterr(err, PS_EINVAL,
                     server ? "give --tls-cert and --tls-key (deploy/certs.sh makes them), or "
                              "--insecure to serve plaintext"
                            : "give --tls-ca (the CA that signed the servers' certificates; "
                              "deploy/certs.sh makes it), or --insecure to talk plaintext");
  if (server && !out->token.len && !o->insecure)
    return ps_seterr(err, PS_EINVAL,
                     "give --token-file (or PS_TOKEN_FILE) with the job's token, or --insecure "
                     "to let anyone who reaches the port in");
  if (out->use_tls) {
    out->tls = (rpc_tls){.ca_file = o->tls_ca,
                         .cert_file = o->tls_cert,
                         .key_file = o->tls_key,
                         .require_client_cert = o->tls_require_client_cert};
  }
  if (!out->use_tls)
    PS_WARN("--insecure: plaintext; anyone on the path can read and change what is sent");
  if (server && !out->token.len)
    PS_WARN("--insecure without a token: anyone who reaches the port can read and change the "
            "model");
  snprintf(out->summary, sizeof out->summary, "%s%s, %s%s",
           out->use_tls ? "TLS" : "plaintext",
           out->use_tls && o->tls_cert && (server ? o->tls_ca != NULL : 1)
               ? (server ? (o->tls_require_client_cert ? " (client certificates required)"
                                                       : " (client certificates checked)")
                         : " (mutual)")
               : "",
           out->token.len ? "job token" : "no token",
           out->read_token.len ? " and read-only token" : "");
  return PS_OK;
}

const rpc_tls *ps_security_tls(const ps_security *s) { return s->use_tls ? &s->tls : NULL; }

/* Job tokens, constant-time comparison, random secrets (see auth.h). */
#include "auth.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>

#include "util.h"

int ps_token_load(const char *path, ps_token *out, char *warning, char *err) {
  memset(out, 0, sizeof *out);
  if (warning) warning[0] = '\0';
  char *text = NULL;
  size_t len = 0;
  if (ps_read_file(path, &text, &len, err) != 0) return PS_EIO;
  while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == ' ' ||
                     text[len - 1] == '\t'))
    len--;
  int rc = PS_OK;
  if (len < PS_TOKEN_MIN || len > PS_TOKEN_MAX) {
    rc = ps_seterr(err, PS_EINVAL,
                   "token file '%s' holds %zu bytes; a token has %d to %d (make one with: "
                   "head -c 32 /dev/urandom | base64 > FILE)",
                   path, len, PS_TOKEN_MIN, PS_TOKEN_MAX);
  } else {
    for (size_t i = 0; i < len && rc == PS_OK; i++) {
      unsigned char ch = (unsigned char)text[i];
      if (ch <= ' ' || ch == 0x7f)
        rc = ps_seterr(err, PS_EINVAL,
                       "token file '%s' has white space or a control character inside the token "
                       "(at byte %zu)",
                       path, i);
    }
  }
  if (rc == PS_OK) {
    memcpy(out->bytes, text, len);
    out->len = len;
    struct stat st;
    if (warning && stat(path, &st) == 0 && (st.st_mode & (S_IRGRP | S_IROTH)))
      snprintf(warning, PS_ERRLEN, "token file '%s' can be read by others than its owner "
                                   "(chmod 600 it)", path);
  }
  memset(text, 0, len);
  free(text);
  return rc;
}

int ps_ct_equal(const void *a, size_t alen, const void *b, size_t blen) {
  const volatile unsigned char *x = a, *y = b;
  unsigned diff = alen != blen;
  size_t n = alen < blen ? alen : blen;
  for (size_t i = 0; i < n; i++) diff |= (unsigned)(x[i] ^ y[i]);
  return diff == 0;
}

int ps_random_bytes(void *buf, size_t len) {
  unsigned char *p = buf;
  while (len > 0) {
    ssize_t got = getrandom(p, len, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return PS_EIO;
    }
    p += got;
    len -= (size_t)got;
  }
  return PS_OK;
}

/* Secrets of a job: the job token (any member of the job), the read-only
 * token (Status, evaluators), session secrets (one registered worker on
 * one shard). Compared in constant time; drawn from the kernel's random
 * source. */
#ifndef PS_COMMON_AUTH_H
#define PS_COMMON_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define PS_TOKEN_MIN 16  /* bytes */
#define PS_TOKEN_MAX 256
#define PS_SESSION_LEN 16

typedef struct {
  uint8_t bytes[PS_TOKEN_MAX];
  size_t len; /* 0: no token */
} ps_token;

/* Reads a token file: its content without trailing white space (a final
 * newline is not part of the token). Refused with a message: a file that
 * cannot be read, a token shorter than PS_TOKEN_MIN or longer than
 * PS_TOKEN_MAX bytes, or one with white space or control characters inside;
 * *out is then empty. A file that others than its owner may read is
 * accepted with a warning in *warning (PS_ERRLEN bytes, "" when none). */
int ps_token_load(const char *path, ps_token *out, char *warning, char *err);

/* Whether a (alen bytes) equals b (blen bytes), in time that depends only
 * on the lengths. */
int ps_ct_equal(const void *a, size_t alen, const void *b, size_t blen);

/* Fills buf with len bytes from the kernel's random source (getrandom).
 * 0, or PS_EIO when it fails (never with fewer bytes). */
int ps_random_bytes(void *buf, size_t len);

#endif

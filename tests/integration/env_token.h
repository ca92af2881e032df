/* The job's token for a test client, from the file PS_TOKEN_FILE names
 * (the test harness sets it; unset or empty: no token). */
#ifndef PS_TESTS_ENV_TOKEN_H
#define PS_TESTS_ENV_TOKEN_H

#include <stdio.h>
#include <stdlib.h>

#include "../../common/auth.h"
#include "../../common/util.h"

/* *out = t loaded from the file, or left NULL without one. 0, or 2 (the
 * check programs' exit for bad arguments) with a message on stderr. */
static inline int env_token_load(ps_token *t, ps_token **out) {
  const char *tf = getenv("PS_TOKEN_FILE");
  if (!tf || !*tf) return 0;
  char err[PS_ERRLEN];
  if (ps_token_load(tf, t, NULL, err) != 0) {
    fprintf(stderr, "PS_TOKEN_FILE: %s\n", err);
    return 2;
  }
  *out = t;
  return 0;
}

#endif

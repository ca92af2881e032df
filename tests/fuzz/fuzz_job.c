/* libFuzzer target: a job file's text (the JSON a user writes) through
 * ps_job_parse, which must accept it or refuse it with a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/job.h"
#include "../../common/util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  ps_job job;
  char err[PS_ERRLEN] = "";
  if (ps_job_parse(text, &job, err) != 0 && !err[0]) abort();
  free(text);
  return 0;
}

#include "metrics.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

struct ps_metrics {
  FILE *f;
  pthread_mutex_t mu;
};

ps_metrics *ps_metrics_open(const char *path, char *err) {
  FILE *f = fopen(path, "a");
  if (!f) {
    ps_seterr(err, PS_EIO, "cannot open metrics file '%s': %s", path, strerror(errno));
    return NULL;
  }
  ps_metrics *m = calloc(1, sizeof *m);
  if (!m) {
    fclose(f);
    ps_seterr(err, PS_ENOMEM, "out of memory");
    return NULL;
  }
  m->f = f;
  pthread_mutex_init(&m->mu, NULL);
  return m;
}

int ps_metrics_write(ps_metrics *m, void *record) {
  json_t *r = record;
  if (!m || !json_is_object(r)) return PS_EINVAL;
  if (!json_object_get(r, "time")) json_object_set_new(r, "time", json_real(ps_wall_s()));
  /* 13 significant digits: `time` (seconds since 1970, ten digits) keeps
   * its milliseconds; 9 would round it to 10 s. */
  char *line = json_dumps(r, JSON_COMPACT | JSON_REAL_PRECISION(13));
  if (!line) return PS_ENOMEM;
  pthread_mutex_lock(&m->mu);
  int rc = fprintf(m->f, "%s\n", line) < 0 || fflush(m->f) != 0 ? PS_EIO : PS_OK;
  pthread_mutex_unlock(&m->mu);
  free(line);
  return rc;
}

void ps_metrics_close(ps_metrics *m) {
  if (!m) return;
  fclose(m->f);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

#include "tbevents.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "proto/tb_event.pb-c.h"
#include "util.h"

struct ps_tb {
  FILE *f;
  pthread_mutex_t mu;
  int failed; /* a write failed: the file's end may be torn */
  char path[PATH_MAX];
};

uint32_t ps_tb_masked_crc(const void *buf, size_t n) {
  uint32_t crc = ps_crc32c(0, buf, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* mkdir -p: 0, or PS_EIO / PS_EINVAL with a message. */
static int make_dirs(const char *dir, char *err) {
  char p[PATH_MAX];
  size_t n = strlen(dir);
  if (n == 0) return ps_seterr(err, PS_EINVAL, "the TensorBoard directory is empty");
  if (n >= sizeof p)
    return ps_seterr(err, PS_EINVAL, "TensorBoard directory '%.200s...': path too long", dir);
  memcpy(p, dir, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (p[i] != '/' && p[i] != '\0') continue;
    if (p[i - 1] == '/') continue; /* "a//b", or a trailing slash */
    char c = p[i];
    p[i] = '\0';
    if (mkdir(p, 0777) != 0 && errno != EEXIST)
      return ps_seterr(err, PS_EIO, "cannot create TensorBoard directory '%.200s': %s", p,
                       strerror(errno));
    p[i] = c;
  }
  struct stat st;
  if (stat(dir, &st) != 0)
    return ps_seterr(err, PS_EIO, "TensorBoard directory '%.200s': %s", dir, strerror(errno));
  if (!S_ISDIR(st.st_mode))
    return ps_seterr(err, PS_EIO, "TensorBoard directory '%.200s' exists and is not a directory",
                     dir);
  return 0;
}

/* Frames `len` bytes at buf + 12 (buf has room for the 12-byte header
 * before and the 4-byte footer after) and writes the record, flushed.
 * Called with w->mu held. */
static int write_record(ps_tb *w, uint8_t *buf, size_t len, char *err) {
  if (w->failed)
    return ps_seterr(err, PS_ESTATE, "TensorBoard file '%.200s': an earlier write failed", w->path);
  ps_put_le64(buf, (uint64_t)len);
  ps_put_le32(buf + 8, ps_tb_masked_crc(buf, 8));
  ps_put_le32(buf + 12 + len, ps_tb_masked_crc(buf + 12, len));
  errno = 0;
  if (fwrite(buf, 1, len + 16, w->f) != len + 16 || fflush(w->f) != 0) {
    w->failed = 1;
    return ps_seterr(err, PS_EIO, "cannot write TensorBoard file '%.200s': %s", w->path,
                     errno ? strerror(errno) : "short write");
  }
  return 0;
}

/* Packs ev into one record and writes it. */
static int write_event(ps_tb *w, const Tb__Event *ev, char *err) {
  size_t len = tb__event__get_packed_size(ev);
  uint8_t *buf = malloc(len + 16);
  if (!buf) return ps_seterr(err, PS_ENOMEM, "out of memory");
  tb__event__pack(ev, buf + 12);
  pthread_mutex_lock(&w->mu);
  int rc = write_record(w, buf, len, err);
  pthread_mutex_unlock(&w->mu);
  free(buf);
  return rc;
}

/* Creates the file, O_EXCL: a name taken (the same second, host and pid)
 * gets ".1", ".2", ... Returns the stream, or NULL with a message. */
static FILE *create_file(const char *dir, char *path, size_t cap, char *err) {
  char host[256] = "";
  if (gethostname(host, sizeof host - 1) != 0 || !host[0]) snprintf(host, sizeof host, "localhost");
  for (char *c = host; *c; c++)
    if (*c == '/') *c = '_';
  long long now = (long long)time(NULL);
  for (int k = 0; k < 100; k++) {
    char suffix[16] = "";
    if (k > 0) snprintf(suffix, sizeof suffix, ".%d", k);
    int n = snprintf(path, cap, "%s/events.out.tfevents.%lld.%s.%ld%s", dir, now, host,
                     (long)getpid(), suffix);
    if (n < 0 || (size_t)n >= cap) {
      ps_seterr(err, PS_EINVAL, "TensorBoard directory '%.200s...': path too long", dir);
      return NULL;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) {
      ps_seterr(err, PS_EIO, "cannot create TensorBoard file '%.200s': %s", path, strerror(errno));
      return NULL;
    }
    FILE *f = fdopen(fd, "wb");
    if (!f) {
      ps_seterr(err, PS_EIO, "cannot open TensorBoard file '%.200s': %s", path, strerror(errno));
      close(fd);
      unlink(path);
    }
    return f;
  }
  ps_seterr(err, PS_EIO, "cannot create a TensorBoard file in '%.200s': 100 names taken", dir);
  return NULL;
}

ps_tb *ps_tb_open(const char *dir, char *err) {
  if (!dir) {
    ps_seterr(err, PS_EINVAL, "no TensorBoard directory");
    return NULL;
  }
  if (make_dirs(dir, err) != 0) return NULL;
  ps_tb *w = calloc(1, sizeof *w);
  if (!w) {
    ps_seterr(err, PS_ENOMEM, "out of memory");
    return NULL;
  }
  w->f = create_file(dir, w->path, sizeof w->path, err);
  if (!w->f) {
    free(w);
    return NULL;
  }
  pthread_mutex_init(&w->mu, NULL);
  Tb__Event ev = TB__EVENT__INIT;
  ev.wall_time = ps_wall_s();
  ev.what_case = TB__EVENT__WHAT_FILE_VERSION;
  ev.file_version = "brain.Event:2";
  if (write_event(w, &ev, err) != 0) {
    fclose(w->f);
    unlink(w->path);
    pthread_mutex_destroy(&w->mu);
    free(w);
    return NULL;
  }
  return w;
}

const char *ps_tb_path(const ps_tb *w) { return w ? w->path : ""; }

int ps_tb_scalars(ps_tb *w, int64_t step, int n, const char *const *tags, const float *values,
                  char *err) {
  if (!w || n < 1 || !tags || !values)
    return ps_seterr(err, PS_EINVAL, "TensorBoard scalars: no writer or no values");
  for (int i = 0; i < n; i++)
    if (!tags[i]) return ps_seterr(err, PS_EINVAL, "TensorBoard scalar %d has no tag", i);
  Tb__Summary__Value *vals = calloc((size_t)n, sizeof *vals);
  Tb__Summary__Value **ptrs = calloc((size_t)n, sizeof *ptrs);
  if (!vals || !ptrs) {
    free(vals);
    free(ptrs);
    return ps_seterr(err, PS_ENOMEM, "out of memory");
  }
  for (int i = 0; i < n; i++) {
    tb__summary__value__init(&vals[i]);
    vals[i].tag = (char *)tags[i]; /* only read by pack */
    vals[i].value_case = TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
    vals[i].simple_value = values[i];
    ptrs[i] = &vals[i];
  }
  Tb__Summary sum = TB__SUMMARY__INIT;
  sum.n_value = (size_t)n;
  sum.value = ptrs;
  Tb__Event ev = TB__EVENT__INIT;
  ev.wall_time = ps_wall_s();
  ev.step = step;
  ev.what_case = TB__EVENT__WHAT_SUMMARY;
  ev.summary = &sum;
  int rc = write_event(w, &ev, err);
  free(ptrs);
  free(vals);
  return rc;
}

int ps_tb_scalar(ps_tb *w, const char *tag, int64_t step, float value, char *err) {
  return ps_tb_scalars(w, step, 1, &tag, &value, err);
}

int ps_tb_close(ps_tb *w, char *err) {
  if (!w) return 0;
  int rc = 0;
  errno = 0;
  if (fflush(w->f) != 0 || (fsync(fileno(w->f)) != 0 && errno != EINVAL))
    rc = ps_seterr(err, PS_EIO, "cannot sync TensorBoard file '%.200s': %s", w->path,
                   strerror(errno));
  if (fclose(w->f) != 0 && rc == 0)
    rc = ps_seterr(err, PS_EIO, "cannot close TensorBoard file '%.200s': %s", w->path,
                   strerror(errno));
  pthread_mutex_destroy(&w->mu);
  free(w);
  return rc;
}

/* CIFAR-10 binary files: records of 1 label byte and 3072 pixel bytes
 * (red, green, blue planes of 32x32, row-major), 10000 records a file as
 * shipped, though any whole number of records is read. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/util.h"
#include "worker/data/data.h"

enum {
  CIFAR_C = 3,
  CIFAR_H = 32,
  CIFAR_W = 32,
  CIFAR_PIXELS = CIFAR_C * CIFAR_H * CIFAR_W,
  CIFAR_RECORD = 1 + CIFAR_PIXELS,
  CIFAR_CLASSES = 10,
  CIFAR_TRAIN_FILES = 5,
};

/* The folder the archive unpacks to, tried when dir holds no files. */
#define CIFAR_SUBDIR "cifar-10-batches-bin"

/* The files of a split: up to CIFAR_TRAIN_FILES paths and their records. */
typedef struct {
  char path[CIFAR_TRAIN_FILES][PATH_MAX];
  uint64_t records[CIFAR_TRAIN_FILES];
  int count;
} cifar_files;

/* Size of a regular file in records; PS_EINVAL if it is not a whole
 * number of them. */
static int cifar__records(const char *path, uint64_t *records, char *err) {
  struct stat st;
  if (stat(path, &st) != 0)
    return ps_seterr(err, PS_EIO, "cannot open CIFAR-10 file '%s': %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return ps_seterr(err, PS_EIO, "CIFAR-10 file '%s': not a regular file", path);
  uint64_t size = (uint64_t)st.st_size;
  if (size == 0 || size % CIFAR_RECORD != 0)
    return ps_seterr(err, PS_EINVAL,
                     "CIFAR-10 file '%s': %llu bytes is not a whole number of %d-byte records "
                     "(truncated, or not CIFAR-10 binary)",
                     path, (unsigned long long)size, CIFAR_RECORD);
  *records = size / CIFAR_RECORD;
  return PS_OK;
}

/* Whether dir/name exists; the path goes into buf. */
static int cifar__exists(const char *dir, const char *sub, const char *name, char *buf,
                         size_t cap) {
  int k =
      sub ? snprintf(buf, cap, "%s/%s/%s", dir, sub, name) : snprintf(buf, cap, "%s/%s", dir, name);
  struct stat st;
  return k > 0 && (size_t)k < cap && stat(buf, &st) == 0;
}

/* The split's files: test_batch.bin, or data_batch_1.bin and as many of
 * the following ones as exist, without gaps. */
static int cifar__find(const char *dir, int train, cifar_files *f, char *err) {
  const char *first = train ? "data_batch_1.bin" : "test_batch.bin";
  char probe[PATH_MAX];
  const char *sub = NULL;
  if (!cifar__exists(dir, NULL, first, probe, sizeof probe)) {
    if (!cifar__exists(dir, CIFAR_SUBDIR, first, probe, sizeof probe))
      return ps_seterr(err, PS_EIO,
                       "CIFAR-10 file not found: neither '%s/%s' nor '%s/" CIFAR_SUBDIR
                       "/%s' exists",
                       dir, first, dir, first);
    sub = CIFAR_SUBDIR;
  }
  f->count = 0;
  int missing = 0;
  for (int k = 0; k < (train ? CIFAR_TRAIN_FILES : 1); k++) {
    char name[32];
    if (train)
      snprintf(name, sizeof name, "data_batch_%d.bin", k + 1);
    else
      snprintf(name, sizeof name, "test_batch.bin");
    if (!cifar__exists(dir, sub, name, probe, sizeof probe)) {
      missing = k + 1;
      continue;
    }
    if (missing)
      return ps_seterr(err, PS_EINVAL,
                       "CIFAR-10 files in '%s': data_batch_%d.bin is missing but '%s' exists", dir,
                       missing, probe);
    snprintf(f->path[f->count], PATH_MAX, "%s", probe);
    int rc = cifar__records(f->path[f->count], &f->records[f->count], err);
    if (rc) return rc;
    f->count++;
  }
  return PS_OK;
}

/* Reads the records of one file into images and labels (from example
 * `first` on), a staging buffer of whole records at a time. */
static int cifar__read(const char *path, uint64_t records, ps_dataset *d, uint64_t first,
                       char *err) {
  enum { STAGE_RECORDS = 256 };
  FILE *f = fopen(path, "rb");
  if (!f)
    return ps_seterr(err, PS_EIO, "cannot open CIFAR-10 file '%s': %s", path, strerror(errno));
  uint8_t *stage = malloc((size_t)STAGE_RECORDS * CIFAR_RECORD);
  if (!stage) {
    fclose(f);
    return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", path);
  }
  float scale[256];
  for (int v = 0; v < 256; v++) scale[v] = (float)v / 255.0f;
  int rc = PS_OK;
  for (uint64_t done = 0; done < records && !rc;) {
    size_t k = records - done < STAGE_RECORDS ? (size_t)(records - done) : STAGE_RECORDS;
    size_t got = fread(stage, CIFAR_RECORD, k, f);
    if (got != k) {
      /* The size was checked: a short read is a file that changed. */
      rc = ps_seterr(err, PS_EIO, "CIFAR-10 file '%s': truncated while reading record %llu", path,
                     (unsigned long long)(done + got));
      break;
    }
    for (size_t r = 0; r < k; r++) {
      const uint8_t *rec = stage + r * CIFAR_RECORD;
      uint64_t i = first + done + r;
      if (rec[0] >= CIFAR_CLASSES) {
        rc = ps_seterr(err, PS_EINVAL,
                       "CIFAR-10 file '%s': record %llu has label %d, outside [0, %d) (not "
                       "CIFAR-10, or CIFAR-100?)",
                       path, (unsigned long long)(done + r), rec[0], CIFAR_CLASSES);
        break;
      }
      d->labels[i] = rec[0];
      float *img = d->images + i * CIFAR_PIXELS;
      for (int j = 0; j < CIFAR_PIXELS; j++) img[j] = scale[rec[1 + j]];
    }
    done += k;
  }
  free(stage);
  fclose(f);
  return rc;
}

/* On error *out is left zeroed. */
int ps_dataset_load_cifar10(const char *dir, int train, ps_dataset *out, char *err) {
  if (!out) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_cifar10: out is NULL");
  memset(out, 0, sizeof *out);
  if (!dir) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_cifar10: dir is NULL");
  cifar_files *f = calloc(1, sizeof *f);
  if (!f) return ps_seterr(err, PS_ENOMEM, "out of memory");
  int rc = cifar__find(dir, train, f, err);
  uint64_t n = 0;
  for (int k = 0; !rc && k < f->count; k++) n += f->records[k];
  if (!rc && n > INT_MAX)
    rc = ps_seterr(err, PS_ERANGE, "CIFAR-10 files in '%s': %llu records, more than %d", dir,
                   (unsigned long long)n, INT_MAX);
  if (!rc && n > SIZE_MAX / (CIFAR_PIXELS * sizeof(float)))
    rc = ps_seterr(err, PS_ERANGE, "CIFAR-10 files in '%s' do not fit in memory", dir);
  ps_dataset d = {.n = (int)n, .c = CIFAR_C, .h = CIFAR_H, .w = CIFAR_W, .classes = CIFAR_CLASSES};
  if (!rc) {
    d.images = ps_alloc((size_t)n * CIFAR_PIXELS * sizeof(float));
    d.labels = ps_alloc((size_t)n);
    if (!d.images || !d.labels) rc = ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", dir);
  }
  uint64_t first = 0;
  for (int k = 0; !rc && k < f->count; k++) {
    rc = cifar__read(f->path[k], f->records[k], &d, first, err);
    first += f->records[k];
  }
  free(f);
  if (rc) {
    ps_dataset_free(&d);
    return rc;
  }
  *out = d;
  return PS_OK;
}

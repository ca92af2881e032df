/* Helpers shared by the fuzz targets (static functions only). */
#ifndef PS_TESTS_FUZZ_FUZZ_UTIL_H
#define PS_TESTS_FUZZ_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* The next `bytes` bytes of the input as a little-endian number (0 past
 * the end), consumed. */
__attribute__((unused)) static uint64_t fuzz_take(const uint8_t **p, size_t *n, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i<bytes && * n> 0; i++, (*p)++, (*n)--) v |= (uint64_t) * *p << (8 * i);
  return v;
}

/* A fresh directory of this process's own, <shm or tmp>/<name>.<pid>, into
 * dir (len bytes); 0, or 1 when it cannot be made. run.sh removes it. */
__attribute__((unused)) static int fuzz_make_dir(const char *name, char *dir, size_t len) {
  snprintf(dir, len, "%s/%s.%d", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", name,
           (int)getpid());
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", dir, dir);
  return system(cmd) == 0 ? 0 : 1;
}

/* Writes len bytes to path; aborts when it cannot (a broken harness). */
__attribute__((unused)) static void fuzz_write_file(const char *path, const void *buf, size_t len) {
  FILE *f = fopen(path, "wb");
  if (!f) abort();
  if (len && fwrite(buf, 1, len, f) != len) abort();
  fclose(f);
}

#endif

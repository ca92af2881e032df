/* libFuzzer target: IDX data files (what --data-dir points at, plain or
 * gzip). The input is split in two, an images file and a labels file, by
 * its first byte; a second byte chooses whether each is gzip-compressed
 * (zlib, as the data sets ship). ps_dataset_load_idx must load them or
 * refuse them with a message: a wrong or damaged file never crashes the
 * worker. Files live in a directory of their own under /dev/shm (or /tmp). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "../../common/util.h"
#include "worker/data/data.h"
#include "fuzz_util.h"

static char dir[256];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  return fuzz_make_dir("ps-fuzz-idx", dir, sizeof dir);
}

static void write_file(const char *path, const uint8_t *buf, size_t len, int gz) {
  if (gz) {
    gzFile f = gzopen(path, "wb");
    if (!f) abort();
    if (len && gzwrite(f, buf, (unsigned)len) != (int)len) abort();
    gzclose(f);
    return;
  }
  fuzz_write_file(path, buf, len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  const size_t cut = size > 2 ? (size_t)data[0] * (size - 2) / 255 : 0;
  const int gz = data[1];
  data += 2;
  size -= 2;
  char images[320], labels[320];
  snprintf(images, sizeof images, "%s/images%s", dir, gz & 1 ? ".gz" : "");
  snprintf(labels, sizeof labels, "%s/labels%s", dir, gz & 2 ? ".gz" : "");
  write_file(images, data, cut, gz & 1);
  write_file(labels, data + cut, size - cut, gz & 2);
  ps_dataset d;
  char err[PS_ERRLEN] = "";
  if (ps_dataset_load_idx(images, labels, 10, &d, err) == 0)
    ps_dataset_free(&d);
  else if (!err[0])
    abort();
  unlink(images);
  unlink(labels);
  return 0;
}

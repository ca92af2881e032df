/* libFuzzer target: checkpoint files, which a shard trusts after a crash.
 * Two modes, by the first byte:
 *  - even: the rest of the input is the file; ps_ckpt_read must load it or
 *    refuse it with a message, never crash;
 *  - odd: a valid checkpoint whose range, version, slots, extra blob,
 *    values and (with a tables section) embedding rows come from the input
 *    is written with ps_ckpt_write and must read back equal; then one byte of the file, chosen by the input, is
 *    changed (or the file is cut short), and that file must be refused:
 *    the checksums cover every byte.
 * Files live in a directory of their own under /dev/shm (or /tmp). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../common/util.h"
#include "ps/ckpt/checkpoint.h"
#include "fuzz_util.h"

static char dir[256];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  return fuzz_make_dir("ps-fuzz-ckpt", dir, sizeof dir);
}

static void *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) abort();
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  void *buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) abort();
  fclose(f);
  *len = (size_t)n;
  return buf;
}

/* 1 when ps_ckpt_read accepts path; a refusal must say why. */
static int accepted(const char *path) {
  ps_ckpt c;
  char err[PS_ERRLEN] = "";
  if (ps_ckpt_read(path, &c, err) != 0) {
    if (!err[0]) abort();
    return 0;
  }
  ps_ckpt_free(&c);
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const int mode = data[0] & 1;
  data++;
  size--;
  char path[PS_CKPT_PATHLEN];
  if (mode == 0) {
    snprintf(path, sizeof path, "%s/raw.ckpt", dir);
    fuzz_write_file(path, data, size);
    (void)accepted(path);
    return 0;
  }
  /* A valid checkpoint from the input. */
  ps_ckpt ck;
  memset(&ck, 0, sizeof ck);
  const size_t P = 1 + fuzz_take(&data, &size, 2) % 3000;
  const size_t begin = fuzz_take(&data, &size, 2) % P;
  const size_t end = begin + fuzz_take(&data, &size, 2) % (P - begin + 1);
  ck.meta = (ps_ckpt_meta){.index = 0,
                           .num_shards = 1 + (int)(fuzz_take(&data, &size, 1) % 4),
                           .P = P,
                           .begin = begin,
                           .end = end,
                           .version = fuzz_take(&data, &size, 4)};
  snprintf(ck.meta.optimizer, sizeof ck.meta.optimizer, "adam");
  snprintf(ck.meta.job_id, sizeof ck.meta.job_id, "fuzz-%u", (unsigned)fuzz_take(&data, &size, 1));
  ck.n_slots = (int)(fuzz_take(&data, &size, 1) % 3);
  const size_t n = end - begin;
  float *arrays = calloc((n ? n : 1) * (size_t)(1 + ck.n_slots), sizeof(float));
  if (!arrays) return 0;
  for (size_t i = 0; i < n * (size_t)(1 + ck.n_slots); i++)
    arrays[i] = (float)(int32_t)fuzz_take(&data, &size, 2) / 256.0f;
  ck.params = arrays;
  for (int k = 0; k < ck.n_slots; k++) ck.slots[k] = arrays + n * (size_t)(1 + k);
  uint8_t extra[64];
  ck.extra_len = fuzz_take(&data, &size, 1) % sizeof extra;
  for (size_t i = 0; i < ck.extra_len; i++) extra[i] = (uint8_t)fuzz_take(&data, &size, 1);
  ck.extra = ck.extra_len ? extra : NULL;
  char err[PS_ERRLEN] = "";
  /* Rows: one unbounded table of dim 1..4 (sgd: no slots), 0..7 rows. */
  if (fuzz_take(&data, &size, 1) & 1) {
    ps_ckpt_tables_builder b;
    ps_ckpt_tables_begin(&b, 0);
    const int dim = 1 + (int)(fuzz_take(&data, &size, 1) % 4);
    if (ps_ckpt_tables_add_table(&b, "t", "sgd", 0, dim, 0) != 0) abort();
    const int rows = (int)(fuzz_take(&data, &size, 1) % 8);
    for (int r = 0; r < rows; r++) {
      float rec[4];
      for (int j = 0; j < dim; j++) rec[j] = (float)(int32_t)fuzz_take(&data, &size, 2) / 256.0f;
      if (ps_ckpt_tables_add_row(&b, fuzz_take(&data, &size, 8), (uint32_t)r, rec) != 0) abort();
    }
    if (ps_ckpt_tables_finish(&b, &ck.tables, &ck.tables_len, err) != 0) abort();
  }
  if (ps_ckpt_write(dir, &ck, 1, path, err) != 0) abort(); /* a valid one must be written */
  ps_ckpt back;
  if (ps_ckpt_read(path, &back, err) != 0) abort();
  if (back.meta.begin != begin || back.meta.end != end || back.meta.version != ck.meta.version ||
      back.n_slots != ck.n_slots || back.extra_len != ck.extra_len ||
      (n && memcmp(back.params, ck.params, n * sizeof(float)) != 0) ||
      (ck.extra_len && memcmp(back.extra, extra, ck.extra_len) != 0) ||
      back.tables_len != ck.tables_len ||
      (ck.tables_len && memcmp(back.tables, ck.tables, ck.tables_len) != 0))
    abort();
  free(ck.tables);
  for (int k = 0; k < ck.n_slots; k++)
    if (n && memcmp(back.slots[k], ck.slots[k], n * sizeof(float)) != 0) abort();
  ps_ckpt_free(&back);
  free(arrays);
  /* One byte changed, or the file cut short: refused. */
  size_t len;
  uint8_t *file = read_file(path, &len);
  const uint64_t where = fuzz_take(&data, &size, 4) % len, how = fuzz_take(&data, &size, 1);
  char bad[PS_CKPT_PATHLEN + 16];
  snprintf(bad, sizeof bad, "%s/bad.ckpt", dir);
  if (how & 1) {
    fuzz_write_file(bad, file, where); /* cut short */
  } else {
    file[where] ^= (uint8_t)(how | 2);
    fuzz_write_file(bad, file, len);
  }
  if (accepted(bad)) abort(); /* damage went unnoticed */
  free(file);
  unlink(path);
  return 0;
}

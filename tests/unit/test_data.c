/* Tests of worker/data/data.c: IDX reading (plain, gzip, broken files), the named
 * sets, the synthetic set, and the batcher's sharding, shuffling and
 * shutdown. */
#include <dirent.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "common/util.h"
#include "tests/unit/check.h"
#include "tests/unit/tmp_tree.h"
#include "worker/data/data.h"

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

static char tmpdir[64];

static const char *tmp_path(char *buf, const char *name) {
  snprintf(buf, PATH_MAX, "%s/%s", tmpdir, name);
  return buf;
}

static void put_be32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

/* Writes an IDX file: magic, ndims dimensions, then the first `len` bytes
 * of data (fewer than the dimensions say makes a truncated file). */
static int write_idx(const char *path, int gz, uint32_t magic, const uint32_t *dims, int ndims,
                     const uint8_t *data, size_t len) {
  uint8_t hdr[16];
  put_be32(hdr, magic);
  for (int i = 0; i < ndims; i++) put_be32(hdr + 4 + 4 * i, dims[i]);
  size_t hlen = 4 + 4 * (size_t)ndims;
  if (gz) {
    gzFile f = gzopen(path, "wb");
    if (!f) return -1;
    int ok = gzwrite(f, hdr, (unsigned)hlen) == (int)hlen &&
             (len == 0 || gzwrite(f, data, (unsigned)len) == (int)len);
    return gzclose(f) == Z_OK && ok ? 0 : -1;
  }
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  int ok = fwrite(hdr, 1, hlen, f) == hlen && (len == 0 || fwrite(data, 1, len, f) == len);
  return fclose(f) == 0 && ok ? 0 : -1;
}

/* A small image/label pair: 5 images of 3x4, pixels i*12+j spread over
 * 0..255, labels 0..4 (classes 5 makes label 4 the largest allowed). */
enum { SMALL_N = 5, SMALL_H = 3, SMALL_W = 4, SMALL_D = SMALL_H * SMALL_W };
static uint8_t small_pixels[SMALL_N * SMALL_D];
static uint8_t small_labels[SMALL_N] = {3, 0, 4, 1, 2};

static void make_small(void) {
  for (int i = 0; i < SMALL_N * SMALL_D; i++) small_pixels[i] = (uint8_t)(i * 53 % 256);
  small_pixels[0] = 0;
  small_pixels[1] = 255; /* both ends of the range */
}

static int write_small(const char *images, const char *labels, int gz_images, int gz_labels) {
  uint32_t idims[3] = {SMALL_N, SMALL_H, SMALL_W}, ldims[1] = {SMALL_N};
  if (write_idx(images, gz_images, 0x803, idims, 3, small_pixels, sizeof small_pixels)) return -1;
  return write_idx(labels, gz_labels, 0x801, ldims, 1, small_labels, sizeof small_labels);
}

static int is_zeroed(const ps_dataset *d) {
  return d->n == 0 && d->c == 0 && d->h == 0 && d->w == 0 && d->classes == 0 && !d->images &&
         !d->labels;
}

static void check_small(const ps_dataset *d) {
  CHECK(d->n == SMALL_N);
  CHECK(d->c == 1 && d->h == SMALL_H && d->w == SMALL_W);
  CHECK(d->classes == 5);
  if (d->n != SMALL_N || !d->images) return;
  int bad = 0;
  for (int i = 0; i < SMALL_N * SMALL_D; i++)
    if (d->images[i] != (float)small_pixels[i] / 255.0f) bad++;
  CHECK(bad == 0);
  CHECK(d->images[0] == 0.0f && d->images[1] == 1.0f);
  CHECK(memcmp(d->labels, small_labels, SMALL_N) == 0);
}

static void test_idx_plain(void) {
  char ip[PATH_MAX], lp[PATH_MAX], err[PS_ERRLEN];
  tmp_path(ip, "plain-images");
  tmp_path(lp, "plain-labels");
  CHECK(write_small(ip, lp, 0, 0) == 0);
  ps_dataset d;
  int rc = ps_dataset_load_idx(ip, lp, 5, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  check_small(&d);
  ps_dataset_free(&d);
  CHECK(is_zeroed(&d));
  ps_dataset_free(&d); /* twice is harmless */
}

static void test_idx_gzip(void) {
  char ip[PATH_MAX], lp[PATH_MAX], err[PS_ERRLEN];
  /* No .gz suffix: compression is detected from the content. */
  tmp_path(ip, "gz-images");
  tmp_path(lp, "gz-labels");
  CHECK(write_small(ip, lp, 1, 1) == 0);
  FILE *f = fopen(ip, "rb");
  CHECK(f && fgetc(f) == 0x1f && fgetc(f) == 0x8b); /* really gzip on disk */
  if (f) fclose(f);
  ps_dataset d;
  int rc = ps_dataset_load_idx(ip, lp, 5, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  check_small(&d);
  ps_dataset_free(&d);

  /* One compressed, one not. */
  tmp_path(ip, "mixed-images.gz");
  tmp_path(lp, "mixed-labels");
  CHECK(write_small(ip, lp, 1, 0) == 0);
  rc = ps_dataset_load_idx(ip, lp, 5, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  check_small(&d);
  ps_dataset_free(&d);
}

/* Loads and expects failure with a message holding both substrings;
 * `out` must come back zeroed. */
static void expect_load_error(const char *ip, const char *lp, int classes, const char *sub1,
                              const char *sub2) {
  char err[PS_ERRLEN] = "";
  ps_dataset d;
  memset(&d, 0x5a, sizeof d); /* garbage in: must be zeroed on error */
  int rc = ps_dataset_load_idx(ip, lp, classes, &d, err);
  if (getenv("TEST_DATA_VERBOSE")) printf("  error: %s\n", err);
  CHECK(rc < 0);
  CHECK(is_zeroed(&d));
  CHECK_MSG(strstr(err, sub1) != NULL, "'%s' not in \"%s\"", sub1, err);
  if (sub2) CHECK_MSG(strstr(err, sub2) != NULL, "'%s' not in \"%s\"", sub2, err);
  if (rc == 0) ps_dataset_free(&d);
}

static void test_idx_errors(void) {
  char ip[PATH_MAX], lp[PATH_MAX], bad[PATH_MAX];
  tmp_path(ip, "ok-images");
  tmp_path(lp, "ok-labels");
  CHECK(write_small(ip, lp, 0, 0) == 0);
  uint32_t idims[3] = {SMALL_N, SMALL_H, SMALL_W}, ldims[1] = {SMALL_N};

  /* Missing files. */
  tmp_path(bad, "does-not-exist");
  expect_load_error(bad, lp, 5, "does-not-exist", "No such file");
  expect_load_error(ip, bad, 5, "does-not-exist", "label file");

  /* Wrong magic, and the two files swapped. */
  tmp_path(bad, "badmagic-images");
  CHECK(write_idx(bad, 0, 0x12345678, idims, 3, small_pixels, sizeof small_pixels) == 0);
  expect_load_error(bad, lp, 5, "bad magic", "badmagic-images");
  expect_load_error(lp, ip, 5, "bad magic", "swapped");

  /* Truncated: inside the header, inside the pixels, inside the labels. */
  tmp_path(bad, "short-header");
  CHECK(write_idx(bad, 0, 0x803, idims, 1, NULL, 0) == 0);
  expect_load_error(bad, lp, 5, "truncated", "header");
  tmp_path(bad, "short-pixels");
  CHECK(write_idx(bad, 0, 0x803, idims, 3, small_pixels, sizeof small_pixels - 7) == 0);
  expect_load_error(bad, lp, 5, "truncated", "short-pixels");
  expect_load_error(bad, lp, 5, "needs 60 bytes, only 53 present", NULL);
  tmp_path(bad, "short-pixels.gz");
  CHECK(write_idx(bad, 1, 0x803, idims, 3, small_pixels, sizeof small_pixels - 7) == 0);
  expect_load_error(bad, lp, 5, "truncated", "short-pixels.gz");
  tmp_path(bad, "short-labels");
  CHECK(write_idx(bad, 0, 0x801, ldims, 1, small_labels, SMALL_N - 1) == 0);
  expect_load_error(ip, bad, 5, "truncated", "the label data needs 5 bytes, only 4");

  /* A header that promises far more than the file holds (60000 images of
   * 28 x 28 in 60 bytes of pixels): refused before anything that size is
   * allocated, plain or compressed. */
  uint32_t huge[3] = {60000, 28, 28}, huge_labels[1] = {60000};
  tmp_path(bad, "huge-header");
  CHECK(write_idx(bad, 0, 0x803, huge, 3, small_pixels, sizeof small_pixels) == 0);
  tmp_path(lp, "huge-labels");
  CHECK(write_idx(lp, 0, 0x801, huge_labels, 1, small_labels, SMALL_N) == 0);
  expect_load_error(bad, lp, 5, "truncated", "needs 47040000 bytes, only 60 present");
  tmp_path(bad, "huge-header.gz");
  CHECK(write_idx(bad, 1, 0x803, huge, 3, small_pixels, sizeof small_pixels) == 0);
  expect_load_error(bad, lp, 5, "huge-header.gz", "the header is corrupt");
  tmp_path(lp, "ok-labels");

  /* A gzip stream cut short (no trailer, part of the deflate data gone). */
  tmp_path(bad, "cut.gz");
  CHECK(write_idx(bad, 1, 0x803, idims, 3, small_pixels, sizeof small_pixels) == 0);
  struct stat st;
  CHECK(stat(bad, &st) == 0 && st.st_size > 20);
  CHECK(truncate(bad, st.st_size - 12) == 0);
  expect_load_error(bad, lp, 5, "cut.gz", "truncated");

  /* Damaged compressed data: a flipped byte in the deflate stream is caught
   * either by the decoder or by the CRC in the gzip trailer. */
  tmp_path(bad, "flipped.gz");
  CHECK(write_idx(bad, 1, 0x803, idims, 3, small_pixels, sizeof small_pixels) == 0);
  FILE *f = fopen(bad, "r+b");
  CHECK(f != NULL);
  if (f) {
    int c = 0;
    CHECK(fseek(f, 30, SEEK_SET) == 0 && (c = fgetc(f)) != EOF);
    CHECK(fseek(f, 30, SEEK_SET) == 0 && fputc(c ^ 0x55, f) != EOF);
    fclose(f);
  }
  expect_load_error(bad, lp, 5, "flipped.gz", "corrupt gzip data");

  /* More data than the header says. */
  tmp_path(bad, "long-labels");
  uint8_t more[SMALL_N + 1] = {0};
  CHECK(write_idx(bad, 0, 0x801, ldims, 1, more, sizeof more) == 0);
  expect_load_error(ip, bad, 5, "long-labels", "past the size");

  /* Counts that differ. */
  tmp_path(bad, "four-labels");
  uint32_t four[1] = {SMALL_N - 1};
  CHECK(write_idx(bad, 0, 0x801, four, 1, small_labels, SMALL_N - 1) == 0);
  expect_load_error(ip, bad, 5, "5 images", "4 labels");

  /* Labels >= classes: small_labels holds a 4. */
  expect_load_error(ip, lp, 4, "out of range", "label 4 of example 2");
  /* Nonsense arguments. */
  expect_load_error(ip, lp, 0, "classes", NULL);
  expect_load_error(ip, lp, 257, "classes", NULL);
}

static void test_named_small(void) {
  char dir[128], ip[PATH_MAX], lp[PATH_MAX], err[PS_ERRLEN];
  snprintf(dir, sizeof dir, "%s/mnist", tmpdir);
  CHECK(mkdir(dir, 0700) == 0);
  /* Labels must be < 10 for the named sets; small_labels are. Train is
   * plain, test is gzip-compressed. */
  snprintf(ip, sizeof ip, "%s/train-images-idx3-ubyte", dir);
  snprintf(lp, sizeof lp, "%s/train-labels-idx1-ubyte", dir);
  CHECK(write_small(ip, lp, 0, 0) == 0);
  snprintf(ip, sizeof ip, "%s/t10k-images-idx3-ubyte.gz", dir);
  snprintf(lp, sizeof lp, "%s/t10k-labels-idx1-ubyte.gz", dir);
  CHECK(write_small(ip, lp, 1, 1) == 0);

  for (int train = 0; train <= 1; train++) {
    ps_dataset d;
    int rc = ps_dataset_load_named(train ? "mnist" : "fashion-mnist", dir, train, &d, err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(d.n == SMALL_N && d.h == SMALL_H && d.w == SMALL_W && d.classes == 10);
    if (rc == 0) CHECK(memcmp(d.labels, small_labels, SMALL_N) == 0);
    ps_dataset_free(&d);
  }

  ps_dataset d;
  CHECK(ps_dataset_load_named("cifar10", dir, 1, &d, err) < 0);
  CHECK(is_zeroed(&d));
  CHECK(strstr(err, "unknown data set 'cifar10'") != NULL);
  CHECK(ps_dataset_load_named("mnist", tmpdir, 1, &d, err) < 0);
  CHECK(is_zeroed(&d));
  CHECK_MSG(strstr(err, "train-images-idx3-ubyte.gz") && strstr(err, "not found"), "%s", err);
}

static void test_fashion_mnist(void) {
  struct stat st;
  if (stat(FASHION_DIR, &st) != 0) {
    printf("SKIPPED test_fashion_mnist: %s not present\n", FASHION_DIR);
    return;
  }
  for (int train = 1; train >= 0; train--) {
    char err[PS_ERRLEN];
    ps_dataset d;
    double t0 = ps_now_s();
    int rc = ps_dataset_load_named("fashion-mnist", FASHION_DIR, train, &d, err);
    double dt = ps_now_s() - t0;
    CHECK_MSG(rc == 0, "%s", err);
    if (rc) continue;
    printf("fashion-mnist %s: %d examples loaded in %.3f s\n", train ? "train" : "test", d.n, dt);
    int want = train ? 60000 : 10000;
    CHECK(d.n == want);
    CHECK(d.c == 1 && d.h == 28 && d.w == 28 && d.classes == 10);
    int count[10] = {0}, out_of_range = 0;
    for (int i = 0; i < d.n; i++) {
      if (d.labels[i] < 10)
        count[d.labels[i]]++;
      else
        out_of_range++;
    }
    CHECK(out_of_range == 0);
    for (int k = 0; k < 10; k++) CHECK_MSG(count[k] == want / 10, "class %d: %d", k, count[k]);
    double sum = 0;
    float lo = 1, hi = 0;
    size_t total = (size_t)d.n * 784;
    for (size_t j = 0; j < total; j++) {
      sum += d.images[j];
      if (d.images[j] < lo) lo = d.images[j];
      if (d.images[j] > hi) hi = d.images[j];
    }
    CHECK(lo == 0.0f && hi == 1.0f);
    /* The widely used normalization constant of Fashion-MNIST (train mean
     * 0.2860): a check that bytes become byte/255 in the right order. */
    if (train) CHECK_NEAR(sum / (double)total, 0.2860, 0.0005, 0);
    /* The first training and test images are both ankle boots (9). */
    CHECK(d.labels[0] == 9);
    ps_dataset_free(&d);
  }
}

static void test_synthetic(void) {
  enum { N = 2000, H = 28, W = 28, D = H * W, K = 10 };
  ps_dataset a, b, test, other;
  CHECK(ps_dataset_synthetic(N, 1, H, W, K, 7, 0, &a) == 0);
  CHECK(ps_dataset_synthetic(N, 1, H, W, K, 7, 0, &b) == 0);
  CHECK(ps_dataset_synthetic(N, 1, H, W, K, 7, 1, &test) == 0);
  CHECK(ps_dataset_synthetic(N, 1, H, W, K, 8, 0, &other) == 0);
  CHECK(a.n == N && a.c == 1 && a.h == H && a.w == W && a.classes == K);

  /* Deterministic across calls; splits and seeds differ. */
  CHECK(memcmp(a.images, b.images, sizeof(float) * N * D) == 0);
  CHECK(memcmp(a.labels, b.labels, N) == 0);
  CHECK(memcmp(a.images, test.images, sizeof(float) * N * D) != 0);
  CHECK(memcmp(a.labels, test.labels, N) != 0);
  CHECK(memcmp(a.images, other.images, sizeof(float) * N * D) != 0);

  int out_of_range = 0, count[K] = {0};
  for (size_t j = 0; j < (size_t)N * D; j++)
    if (!(a.images[j] >= 0.0f && a.images[j] <= 1.0f)) out_of_range++;
  CHECK(out_of_range == 0);
  for (int i = 0; i < N; i++) count[a.labels[i] < K ? a.labels[i] : 0]++;
  for (int k = 0; k < K; k++) CHECK_MSG(count[k] > N / K / 2, "class %d: %d", k, count[k]);

  /* Learnable, and train and test share templates: the nearest class mean
   * of the train split classifies the test split almost perfectly. */
  double *mean = calloc((size_t)K * D, sizeof *mean);
  CHECK(mean != NULL);
  if (mean) {
    for (int i = 0; i < N; i++)
      for (int j = 0; j < D; j++) mean[a.labels[i] * D + j] += a.images[(size_t)i * D + j];
    for (int k = 0; k < K; k++)
      for (int j = 0; j < D; j++) mean[k * D + j] /= count[k] ? count[k] : 1;
    int correct = 0;
    for (int i = 0; i < N; i++) {
      int best = -1;
      double best_d = 0;
      for (int k = 0; k < K; k++) {
        double dist = 0;
        for (int j = 0; j < D; j++) {
          double e = test.images[(size_t)i * D + j] - mean[k * D + j];
          dist += e * e;
        }
        if (best < 0 || dist < best_d) best = k, best_d = dist;
      }
      correct += best == test.labels[i];
    }
    CHECK_MSG(correct > N * 95 / 100, "nearest mean: %d of %d", correct, N);
    free(mean);
  }

  /* Bad arguments leave out zeroed. */
  ps_dataset z;
  CHECK(ps_dataset_synthetic(0, 1, H, W, K, 7, 0, &z) < 0 && is_zeroed(&z));
  CHECK(ps_dataset_synthetic(10, 1, H, W, 300, 7, 0, &z) < 0 && is_zeroed(&z));

  ps_dataset_free(&a);
  ps_dataset_free(&b);
  ps_dataset_free(&test);
  ps_dataset_free(&other);
}

/* A dataset whose example i has every value equal to i (and label i % 251),
 * so a batch row tells which example it is. */
static int make_index_dataset(ps_dataset *d, int n, int dim) {
  memset(d, 0, sizeof *d);
  d->images = ps_alloc((size_t)n * dim * sizeof(float));
  d->labels = ps_alloc((size_t)n);
  if (!d->images || !d->labels) {
    ps_dataset_free(d);
    return -1;
  }
  d->n = n;
  d->c = 1;
  d->h = 1;
  d->w = dim;
  d->classes = 251;
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < dim; j++) d->images[(size_t)i * dim + j] = (float)i;
    d->labels[i] = (uint8_t)(i % 251);
  }
  return 0;
}

/* Consumes `epochs` epochs from b and writes the example order of each
 * into order[e * m ...] (m = epoch size); checks every batch on the way. */
static void drain_epochs(ps_batcher *b, const ps_dataset *ds, int rank, int workers, int bs,
                         int epochs, int *order) {
  int m = ps_batcher_epoch_size(b), dim = ds->w;
  int64_t expect_index = 0;
  int bad_row = 0, bad_shard = 0, bad_n = 0, bad_meta = 0;
  for (int e = 0; e < epochs; e++) {
    for (int pos = 0; pos < m;) {
      ps_batch *batch = NULL;
      if (ps_batcher_next(b, &batch) != 0 || !batch) {
        CHECK(!"ps_batcher_next failed");
        return;
      }
      if (batch->index != expect_index++ || batch->epoch != e) bad_meta++;
      int want_n = m - pos < bs ? m - pos : bs;
      if (batch->n != want_n) bad_n++;
      for (int j = 0; j < batch->n && pos < m; j++, pos++) {
        const float *row = batch->x + (size_t)j * dim;
        int id = (int)row[0];
        if (row[dim - 1] != row[0] || batch->y[j] != id % 251) bad_row++;
        if (id % workers != rank) bad_shard++;
        order[e * m + pos] = id;
      }
      ps_batcher_release(b, batch);
    }
  }
  CHECK(bad_meta == 0);
  CHECK(bad_n == 0);
  CHECK(bad_row == 0);
  CHECK(bad_shard == 0);
}

static void test_batcher_partition(void) {
  enum { N = 1003, DIM = 5, WORKERS = 3, BS = 16, EPOCHS = 2 };
  ps_dataset ds;
  CHECK(make_index_dataset(&ds, N, DIM) == 0);
  int *seen = calloc((size_t)EPOCHS * N, sizeof *seen);
  int *order = malloc(sizeof(int) * EPOCHS * N);
  CHECK(seen && order);
  if (!seen || !order) goto out;
  for (int r = 0; r < WORKERS; r++) {
    ps_batcher *b = ps_batcher_create(&ds, BS, r, WORKERS, 42, 3);
    CHECK(b != NULL);
    if (!b) continue;
    int m = ps_batcher_epoch_size(b);
    CHECK(m == (N - r + WORKERS - 1) / WORKERS); /* 335, 334, 334 */
    drain_epochs(b, &ds, r, WORKERS, BS, EPOCHS, order);
    for (int e = 0; e < EPOCHS; e++)
      for (int p = 0; p < m; p++) seen[e * N + order[e * m + p]]++;
    /* Each epoch is a new shuffle, not the shard in index order. */
    CHECK(memcmp(order, order + m, sizeof(int) * m) != 0);
    int ascending = 1;
    for (int p = 1; p < m; p++) ascending &= order[p] > order[p - 1];
    CHECK(!ascending);
    ps_batcher_destroy(b);
  }
  /* Over all ranks, every example exactly once per epoch. */
  int wrong = 0;
  for (int i = 0; i < EPOCHS * N; i++) wrong += seen[i] != 1;
  CHECK_MSG(wrong == 0, "%d examples not seen exactly once", wrong);
out:
  free(seen);
  free(order);
  ps_dataset_free(&ds);
}

static void test_batcher_reproducible(void) {
  enum { N = 500, DIM = 3, WORKERS = 2, BS = 7, EPOCHS = 3 };
  ps_dataset ds;
  CHECK(make_index_dataset(&ds, N, DIM) == 0);
  int *o1 = malloc(sizeof(int) * EPOCHS * N), *o2 = malloc(sizeof(int) * EPOCHS * N),
      *o3 = malloc(sizeof(int) * EPOCHS * N);
  CHECK(o1 && o2 && o3);
  /* Same seed, different depths: the order must not depend on timing. */
  ps_batcher *b1 = ps_batcher_create(&ds, BS, 1, WORKERS, 9, 1);
  ps_batcher *b2 = ps_batcher_create(&ds, BS, 1, WORKERS, 9, 5);
  ps_batcher *b3 = ps_batcher_create(&ds, BS, 1, WORKERS, 10, 5);
  CHECK(b1 && b2 && b3);
  if (o1 && o2 && o3 && b1 && b2 && b3) {
    int m = ps_batcher_epoch_size(b1);
    drain_epochs(b1, &ds, 1, WORKERS, BS, EPOCHS, o1);
    drain_epochs(b2, &ds, 1, WORKERS, BS, EPOCHS, o2);
    drain_epochs(b3, &ds, 1, WORKERS, BS, EPOCHS, o3);
    CHECK(memcmp(o1, o2, sizeof(int) * EPOCHS * m) == 0);
    CHECK(memcmp(o1, o3, sizeof(int) * m) != 0);
  }
  ps_batcher_destroy(b1);
  ps_batcher_destroy(b2);
  ps_batcher_destroy(b3);
  free(o1);
  free(o2);
  free(o3);
  ps_dataset_free(&ds);
}

static void test_batcher_destroy(void) {
  enum { N = 4000, DIM = 784, BS = 256 };
  ps_dataset ds;
  CHECK(make_index_dataset(&ds, N, DIM) == 0);

  /* Right after create, while the thread may be mid-fill. */
  int64_t t0 = ps_now_ms();
  ps_batcher *b = ps_batcher_create(&ds, BS, 0, 1, 1, 4);
  CHECK(b != NULL);
  ps_batcher_destroy(b);
  CHECK_MSG(ps_now_ms() - t0 < 1000, "%lld ms", (long long)(ps_now_ms() - t0));

  /* Consumer stopped mid-epoch holding a batch; the ring is full and the
   * producer is blocked waiting for a free slot. */
  b = ps_batcher_create(&ds, BS, 0, 1, 1, 4);
  CHECK(b != NULL);
  ps_batch *batch = NULL, *held = NULL;
  for (int i = 0; i < 3 && b; i++) {
    CHECK(ps_batcher_next(b, &batch) == 0);
    if (i < 2)
      ps_batcher_release(b, batch);
    else
      held = batch;
  }
  CHECK(held && held->epoch == 0 && held->index == 2);
  ps_sleep_ms(50);
  t0 = ps_now_ms();
  ps_batcher_destroy(b);
  CHECK_MSG(ps_now_ms() - t0 < 500, "%lld ms", (long long)(ps_now_ms() - t0));

  /* Holding every slot: next cannot block forever, it refuses. */
  b = ps_batcher_create(&ds, BS, 0, 1, 1, 2);
  ps_batch *x1 = NULL, *x2 = NULL, *x3 = NULL;
  CHECK(b && ps_batcher_next(b, &x1) == 0 && ps_batcher_next(b, &x2) == 0);
  CHECK(ps_batcher_next(b, &x3) == PS_ESTATE && x3 == NULL);
  ps_batcher_release(b, x1);
  ps_batcher_release(b, x1); /* a second release is ignored */
  CHECK(ps_batcher_next(b, &x3) == 0 && x3 && x3->index == 2);
  ps_batcher_destroy(b);

  ps_dataset_free(&ds);
}

static void test_batcher_args(void) {
  ps_dataset ds;
  CHECK(make_index_dataset(&ds, 10, 2) == 0);
  CHECK(ps_batcher_create(NULL, 4, 0, 1, 0, 2) == NULL);
  CHECK(ps_batcher_create(&ds, 0, 0, 1, 0, 2) == NULL);
  CHECK(ps_batcher_create(&ds, 4, 3, 3, 0, 2) == NULL);
  CHECK(ps_batcher_create(&ds, 4, -1, 3, 0, 2) == NULL);
  CHECK(ps_batcher_create(&ds, 4, 0, 1, 0, 0) == NULL);
  CHECK(ps_batcher_create(&ds, 4, 11, 12, 0, 2) == NULL); /* empty shard */
  ps_batcher_destroy(NULL);

  /* A batch larger than the shard: every batch is the whole shard. */
  ps_batcher *b = ps_batcher_create(&ds, 100, 1, 4, 0, 2); /* examples 1, 5, 9 */
  CHECK(b && ps_batcher_epoch_size(b) == 3);
  ps_batch *batch = NULL;
  for (int e = 0; e < 3 && b; e++) {
    CHECK(ps_batcher_next(b, &batch) == 0 && batch->n == 3 && batch->epoch == e);
    ps_batcher_release(b, batch);
  }
  ps_batcher_destroy(b);
  ps_dataset_free(&ds);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/test_data.XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  make_small();
  RUN(test_idx_plain);
  RUN(test_idx_gzip);
  RUN(test_idx_errors);
  RUN(test_named_small);
  RUN(test_fashion_mnist);
  RUN(test_synthetic);
  RUN(test_batcher_partition);
  RUN(test_batcher_reproducible);
  RUN(test_batcher_destroy);
  RUN(test_batcher_args);
  remove_tree(tmpdir);
  return check_summary();
}

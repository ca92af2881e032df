/* Tests of the data formats besides IDX: NumPy .npy and .npz (written here
 * byte by byte, stored and deflated members, zip64 fields), CIFAR-10 binary,
 * the job's "dataset" keys, normalisation and the batcher's augmentation;
 * and each kind of broken input. */
#include <dirent.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "common/job.h"
#include "common/util.h"
#include "tests/unit/check.h"
#include "tests/unit/tmp_tree.h"
#include "worker/data/data.h"

static char tmpdir[64];

static const char *tmp_path(char *buf, const char *name) {
  snprintf(buf, PATH_MAX, "%s/%s", tmpdir, name);
  return buf;
}

static int is_zeroed(const ps_dataset *d) {
  return d->n == 0 && d->c == 0 && d->h == 0 && d->w == 0 && d->classes == 0 && !d->images &&
         !d->labels && !d->aug.fill && d->aug.crop_pad == 0 && d->aug.flip == 0;
}

/* ---- writing .npy and .npz bytes ---- */

/* A growing byte buffer; `failed` once an allocation failed. */
typedef struct {
  uint8_t *p;
  size_t len, cap;
  int failed;
} bytes;

static void put(bytes *b, const void *src, size_t n) {
  if (b->failed) return;
  if (b->len + n > b->cap) {
    size_t cap = (b->len + n) * 2 + 64;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
      b->failed = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  if (n) memcpy(b->p + b->len, src, n);
  b->len += n;
}

static void put16(bytes *b, uint32_t v) {
  uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
  put(b, x, 2);
}

static void put32(bytes *b, uint32_t v) {
  uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
  put(b, x, 4);
}

static void put64(bytes *b, uint64_t v) {
  put32(b, (uint32_t)v);
  put32(b, (uint32_t)(v >> 32));
}

/* A .npy file of format version `major`: the dict as numpy writes it
 * (padded with spaces and a newline to a multiple of 64), then the data. */
static bytes npy(int major, const char *descr, const char *shape, const void *data, size_t len) {
  char dict[256];
  snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr,
           shape);
  bytes b = {0};
  size_t pre = major == 1 ? 10 : 12, hlen = strlen(dict) + 1;
  hlen += (64 - (pre + hlen) % 64) % 64;
  put(&b, "\x93NUMPY", 6);
  uint8_t ver[2] = {(uint8_t)major, 0};
  put(&b, ver, 2);
  if (major == 1)
    put16(&b, (uint32_t)hlen);
  else
    put32(&b, (uint32_t)hlen);
  put(&b, dict, strlen(dict));
  for (size_t i = strlen(dict); i + 1 < hlen; i++) put(&b, " ", 1);
  put(&b, "\n", 1);
  put(&b, data, len);
  return b;
}

/* As npy, with the header dict given whole (for broken headers). */
static bytes npy_raw(const char *dict, const void *data, size_t len) {
  bytes b = {0};
  put(&b, "\x93NUMPY\x01\x00", 8);
  put16(&b, (uint32_t)strlen(dict));
  put(&b, dict, strlen(dict));
  put(&b, data, len);
  return b;
}

typedef struct {
  const char *name;
  bytes data;
  int deflate;
} zip_member;

/* A zip archive of the members, written as numpy's zipfile would, with
 * zip64 = 1: the central entries' sizes and offsets in zip64 extra fields
 * and a zip64 end record (what archives over 4 GiB need). */
static bytes zip(const zip_member *m, int count, int zip64) {
  bytes b = {0};
  uint32_t crc[8], csize[8], off[8];
  bytes comp[8];
  for (int k = 0; k < count; k++) {
    crc[k] = (uint32_t)crc32(0, m[k].data.p, (uInt)m[k].data.len);
    comp[k] = (bytes){0};
    if (m[k].deflate) {
      z_stream s;
      memset(&s, 0, sizeof s);
      deflateInit2(&s, 6, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
      uLong bound = deflateBound(&s, (uLong)m[k].data.len);
      comp[k].p = malloc(bound);
      s.next_in = m[k].data.p;
      s.avail_in = (uInt)m[k].data.len;
      s.next_out = comp[k].p;
      s.avail_out = (uInt)bound;
      deflate(&s, Z_FINISH);
      comp[k].len = s.total_out;
      deflateEnd(&s);
    } else {
      comp[k].p = malloc(m[k].data.len + 1);
      memcpy(comp[k].p, m[k].data.p, m[k].data.len);
      comp[k].len = m[k].data.len;
    }
    csize[k] = (uint32_t)comp[k].len;
    off[k] = (uint32_t)b.len;
    put32(&b, 0x04034b50);
    put16(&b, 20);
    put16(&b, 0);
    put16(&b, m[k].deflate ? 8 : 0);
    put32(&b, 0); /* time, date */
    put32(&b, crc[k]);
    put32(&b, csize[k]);
    put32(&b, (uint32_t)m[k].data.len);
    put16(&b, (uint32_t)strlen(m[k].name));
    put16(&b, 0);
    put(&b, m[k].name, strlen(m[k].name));
    put(&b, comp[k].p, comp[k].len);
  }
  size_t cd = b.len;
  for (int k = 0; k < count; k++) {
    put32(&b, 0x02014b50);
    put16(&b, 45);
    put16(&b, 20);
    put16(&b, 0);
    put16(&b, m[k].deflate ? 8 : 0);
    put32(&b, 0);
    put32(&b, crc[k]);
    put32(&b, zip64 ? 0xffffffffu : csize[k]);
    put32(&b, zip64 ? 0xffffffffu : (uint32_t)m[k].data.len);
    put16(&b, (uint32_t)strlen(m[k].name));
    put16(&b, zip64 ? 28 : 0);
    put16(&b, 0);
    put16(&b, 0);
    put16(&b, 0);
    put32(&b, 0);
    put32(&b, zip64 ? 0xffffffffu : off[k]);
    put(&b, m[k].name, strlen(m[k].name));
    if (zip64) {
      put16(&b, 1);
      put16(&b, 24);
      put64(&b, m[k].data.len);
      put64(&b, csize[k]);
      put64(&b, off[k]);
    }
    free(comp[k].p);
  }
  size_t cd_size = b.len - cd;
  if (zip64) {
    size_t rec = b.len;
    put32(&b, 0x06064b50);
    put64(&b, 44);
    put16(&b, 45);
    put16(&b, 45);
    put32(&b, 0);
    put32(&b, 0);
    put64(&b, (uint64_t)count);
    put64(&b, (uint64_t)count);
    put64(&b, cd_size);
    put64(&b, cd);
    put32(&b, 0x07064b50);
    put32(&b, 0);
    put64(&b, rec);
    put32(&b, 1);
  }
  put32(&b, 0x06054b50);
  put32(&b, 0);
  put16(&b, zip64 ? 0xffff : (uint32_t)count);
  put16(&b, zip64 ? 0xffff : (uint32_t)count);
  put32(&b, zip64 ? 0xffffffffu : (uint32_t)cd_size);
  put32(&b, zip64 ? 0xffffffffu : (uint32_t)cd);
  put16(&b, 0);
  return b;
}

static int write_bytes(const char *path, const bytes *b) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  int ok = !b->failed && (b->len == 0 || fwrite(b->p, 1, b->len, f) == b->len);
  return fclose(f) == 0 && ok ? 0 : -1;
}

/* ---- a small set: 4 images of 3x2x5 (CxHxW), classes 3 ---- */

enum { SN = 4, SC = 3, SH = 2, SW = 5, SD = SC * SH * SW, SCLASSES = 3 };
static const int64_t small_y[SN] = {2, 0, 1, 2};

/* Pixel byte of example i, channel ch, row y, column x (all distinct
 * within an example, both ends of 0..255 present). */
static uint8_t small_px(int i, int ch, int y, int x) {
  return (uint8_t)((i * 61 + ch * 100 + y * 7 + x * 13) * 3 % 256);
}

/* The small set's images as bytes, NHWC or NCHW. */
static void small_bytes(uint8_t *out, int nhwc) {
  for (int i = 0; i < SN; i++)
    for (int ch = 0; ch < SC; ch++)
      for (int y = 0; y < SH; y++)
        for (int x = 0; x < SW; x++) {
          size_t k = nhwc ? (((size_t)i * SH + y) * SW + x) * SC + ch
                          : (((size_t)i * SC + ch) * SH + y) * SW + x;
          out[k] = small_px(i, ch, y, x);
        }
}

/* The set as loaded: NCHW floats equal to byte/255 exactly. */
static void check_small(const ps_dataset *d, const char *what) {
  CHECK_MSG(d->n == SN && d->c == SC && d->h == SH && d->w == SW && d->classes == SCLASSES,
            "%s: %d examples %dx%dx%d in %d classes", what, d->n, d->c, d->h, d->w, d->classes);
  if (d->n != SN || d->c != SC || d->h != SH || d->w != SW || !d->images) return;
  int bad = 0, bad_labels = 0;
  for (int i = 0; i < SN; i++) {
    for (int ch = 0; ch < SC; ch++)
      for (int y = 0; y < SH; y++)
        for (int x = 0; x < SW; x++)
          bad += d->images[(((size_t)i * SC + ch) * SH + y) * SW + x] !=
                 (float)small_px(i, ch, y, x) / 255.0f;
    bad_labels += d->labels[i] != small_y[i];
  }
  CHECK_MSG(bad == 0, "%s: %d pixels differ", what, bad);
  CHECK_MSG(bad_labels == 0, "%s: %d labels differ", what, bad_labels);
}

static bytes small_x_npy(int nhwc) {
  uint8_t px[SN * SD];
  small_bytes(px, nhwc);
  return npy(1, "|u1", nhwc ? "(4, 2, 5, 3)" : "(4, 3, 2, 5)", px, sizeof px);
}

/* Labels in the given integer dtype. */
static bytes small_y_npy(const char *descr, const char *shape) {
  uint8_t raw[SN * 8];
  int size = descr[2] - '0';
  for (int i = 0; i < SN; i++)
    for (int k = 0; k < size; k++) raw[i * size + k] = (uint8_t)((uint64_t)small_y[i] >> (8 * k));
  return npy(1, descr, shape ? shape : "(4,)", raw, (size_t)SN * size);
}

static void test_npy_uint8(void) {
  char err[PS_ERRLEN] = "";
  const char *dtypes[] = {"<i8", "<i4", "|u1", "<u2", "<i2", "<u8"};
  for (int layout = 0; layout < 2; layout++) {
    bytes x = small_x_npy(layout == PS_LAYOUT_NHWC);
    for (size_t t = 0; t < sizeof dtypes / sizeof *dtypes; t++) {
      bytes y = small_y_npy(dtypes[t], t == 1 ? "(4, 1)" : NULL);
      ps_dataset d;
      int rc =
          ps_dataset_parse_npy(x.p, x.len, "x.npy", y.p, y.len, "y.npy", layout, SCLASSES, &d, err);
      CHECK_MSG(rc == 0, "layout %d labels %s: %s", layout, dtypes[t], err);
      check_small(&d, dtypes[t]);
      CHECK(d.aug.crop_pad == 0 && d.aug.flip == 0 && !d.aug.fill);
      ps_dataset_free(&d);
      free(y.p);
    }
    free(x.p);
  }
  /* Through files, and (n, h, w) as one channel. */
  char xp[PATH_MAX], yp[PATH_MAX];
  uint8_t gray[2 * 3 * 2] = {0, 255, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  bytes x = npy(1, "|u1", "(2, 3, 2)", gray, sizeof gray);
  int64_t lab[2] = {1, 0};
  bytes y = npy(1, "<i8", "(2,)", lab, sizeof lab);
  CHECK(write_bytes(tmp_path(xp, "gray_x.npy"), &x) == 0);
  CHECK(write_bytes(tmp_path(yp, "gray_y.npy"), &y) == 0);
  ps_dataset d;
  int rc = ps_dataset_load_npy(xp, yp, PS_LAYOUT_NHWC, 2, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(d.n == 2 && d.c == 1 && d.h == 3 && d.w == 2 && d.classes == 2);
  if (rc == 0) {
    CHECK(d.images[0] == 0.0f && d.images[1] == 1.0f && d.images[11] == 10.0f / 255.0f);
    CHECK(d.labels[0] == 1 && d.labels[1] == 0);
  }
  ps_dataset_free(&d);
  free(x.p);
  free(y.p);
}

static void test_npy_float_and_versions(void) {
  char err[PS_ERRLEN] = "";
  /* float32 NHWC (2, 2, 2, 2): taken as is, transposed to NCHW. */
  float xf[16];
  for (int k = 0; k < 16; k++) xf[k] = (float)k * 0.5f - 3.0f; /* negatives too */
  double xd[16];
  for (int k = 0; k < 16; k++) xd[k] = xf[k];
  uint8_t lab[2] = {1, 0};
  for (int major = 1; major <= 3; major++) {
    bytes x = major == 2 ? npy(major, "<f8", "(2, 2, 2, 2)", xd, sizeof xd)
                         : npy(major, "<f4", "(2, 2, 2, 2)", xf, sizeof xf);
    bytes y = npy(major, "|u1", "(2,)", lab, sizeof lab);
    ps_dataset d;
    int rc = ps_dataset_parse_npy(x.p, x.len, "x", y.p, y.len, "y", PS_LAYOUT_NHWC, 2, &d, err);
    CHECK_MSG(rc == 0, "version %d: %s", major, err);
    int bad = 0;
    for (int i = 0; rc == 0 && i < 2; i++)
      for (int ch = 0; ch < 2; ch++)
        for (int p = 0; p < 4; p++)
          bad += d.images[(i * 2 + ch) * 4 + p] != xf[(i * 4 + p) * 2 + ch];
    CHECK_MSG(bad == 0, "version %d: %d values differ", major, bad);
    ps_dataset_free(&d);
    /* The same bytes read as NCHW are not transposed. */
    rc = ps_dataset_parse_npy(x.p, x.len, "x", y.p, y.len, "y", PS_LAYOUT_NCHW, 2, &d, err);
    CHECK(rc == 0 && memcmp(d.images, xf, sizeof xf) == 0);
    ps_dataset_free(&d);
    free(x.p);
    free(y.p);
  }
}

/* The small set in an archive: x stored, y deflated (and the other way). */
static bytes small_npz(int x_deflate, int y_deflate, int zip64, const char *xn, const char *yn) {
  zip_member m[3] = {
      {xn, small_x_npy(1), x_deflate},
      {"other.npy", npy(1, "|u1", "(1,)", "\x07", 1), 0},
      {yn, small_y_npy("<i8", NULL), y_deflate},
  };
  bytes z = zip(m, 3, zip64);
  for (int k = 0; k < 3; k++) free(m[k].data.p);
  return z;
}

static void test_npz(void) {
  char err[PS_ERRLEN] = "", path[PATH_MAX];
  for (int v = 0; v < 4; v++) {
    bytes z = small_npz(v & 1, !(v & 1), v >= 2, "x.npy", "y.npy");
    ps_dataset d;
    int rc =
        ps_dataset_parse_npz(z.p, z.len, "mem.npz", "x", "y", PS_LAYOUT_NHWC, SCLASSES, &d, err);
    CHECK_MSG(rc == 0, "variant %d: %s", v, err);
    check_small(&d, "npz");
    ps_dataset_free(&d);
    free(z.p);
  }
  /* Other array names; a file on disk; deflate really smaller on disk. */
  bytes z = small_npz(1, 1, 0, "images.npy", "labels");
  CHECK(write_bytes(tmp_path(path, "named.npz"), &z) == 0);
  ps_dataset d;
  int rc = ps_dataset_load_npz(path, "images", "labels", PS_LAYOUT_NHWC, SCLASSES, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  check_small(&d, "named npz");
  ps_dataset_free(&d);
  free(z.p);
}

/* ---- errors ---- */

/* Expects failure with a message holding both substrings; out zeroed. */
static void expect_npy_error(const bytes *x, const bytes *y, int layout, int classes,
                             const char *sub1, const char *sub2) {
  char err[PS_ERRLEN] = "";
  ps_dataset d;
  memset(&d, 0x5a, sizeof d);
  int rc = ps_dataset_parse_npy(x->p, x->len, "bad_x.npy", y->p, y->len, "bad_y.npy", layout,
                                classes, &d, err);
  if (getenv("TEST_DATA_VERBOSE")) printf("  error: %s\n", err);
  CHECK_MSG(rc == PS_EINVAL || rc == PS_ERANGE, "rc %d for '%s'", rc, sub1);
  CHECK(is_zeroed(&d));
  CHECK_MSG(strstr(err, sub1) != NULL, "'%s' not in '%s'", sub1, err);
  if (sub2) CHECK_MSG(strstr(err, sub2) != NULL, "'%s' not in '%s'", sub2, err);
}

static void expect_npz_error(const bytes *z, const char *x_name, const char *sub1,
                             const char *sub2) {
  char err[PS_ERRLEN] = "";
  ps_dataset d;
  memset(&d, 0x5a, sizeof d);
  int rc =
      ps_dataset_parse_npz(z->p, z->len, "bad.npz", x_name, "y", PS_LAYOUT_NHWC, SCLASSES, &d, err);
  if (getenv("TEST_DATA_VERBOSE")) printf("  error: %s\n", err);
  CHECK_MSG(rc == PS_EINVAL, "rc %d for '%s'", rc, sub1);
  CHECK(is_zeroed(&d));
  CHECK_MSG(strstr(err, sub1) != NULL, "'%s' not in '%s'", sub1, err);
  if (sub2) CHECK_MSG(strstr(err, sub2) != NULL, "'%s' not in '%s'", sub2, err);
}

static void test_npy_errors(void) {
  bytes x = small_x_npy(1), y = small_y_npy("<i8", NULL);
  /* Bad magic; a zip given as .npy. */
  bytes junk = {(uint8_t *)"PK\x03\x04 not numpy at all", 22, 0, 0};
  expect_npy_error(&junk, &y, 0, SCLASSES, "bad_x.npy", "bad magic");
  bytes z = small_npz(0, 0, 0, "x.npy", "y.npy");
  expect_npy_error(&z, &y, 0, SCLASSES, "bad magic", "an .npz?");
  free(z.p);
  /* Unknown version; truncated header; header too long. */
  bytes v9 = npy(1, "|u1", "(4,)", "abcd", 4);
  v9.p[6] = 9;
  expect_npy_error(&v9, &y, 0, SCLASSES, "bad_x.npy", "version 9.0");
  free(v9.p);
  bytes cut = {x.p, 40, 0, 0};
  expect_npy_error(&cut, &y, 0, SCLASSES, "bad_x.npy", "truncated .npy header");
  uint8_t huge[12] = {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 0, 0, 0, 0x10};
  bytes hb = {huge, sizeof huge, 0, 0};
  expect_npy_error(&hb, &y, 0, SCLASSES, "bad_x.npy", "header of");
  /* Truncated data, data past the header's size. */
  bytes short_x = {x.p, x.len - 1, 0, 0};
  expect_npy_error(&short_x, &y, 0, SCLASSES, "bad_x.npy", "truncated");
  bytes long_y = small_y_npy("<i8", NULL);
  put(&long_y, "\0", 1);
  expect_npy_error(&x, &long_y, 0, SCLASSES, "bad_y.npy", "continues past");
  free(long_y.p);
  /* Dtypes: float labels, int images, big-endian, structured, Fortran order. */
  float fl[4] = {0, 1, 2, 0};
  bytes fy = npy(1, "<f4", "(4,)", fl, sizeof fl);
  expect_npy_error(&x, &fy, 0, SCLASSES, "bad_y.npy", "must be integers");
  free(fy.p);
  bytes ix = small_y_npy("<i8", "(2, 2)");
  expect_npy_error(&ix, &y, 0, SCLASSES, "bad_x.npy", "3-D");
  free(ix.p);
  static const uint8_t zeros[256];
  bytes i16 = npy(1, "<u2", "(4, 2, 2)", zeros, 4 * 4 * 2);
  expect_npy_error(&i16, &y, 0, SCLASSES, "bad_x.npy", "images of dtype '<u2'");
  free(i16.p);
  bytes be = npy(1, ">f4", "(4, 2, 2)", zeros, 4 * 4 * 4);
  expect_npy_error(&be, &y, 0, SCLASSES, "bad_x.npy", "big-endian");
  free(be.p);
  bytes c16 = npy(1, "<c16", "(4,)", zeros, 4 * 16);
  expect_npy_error(&c16, &y, 0, SCLASSES, "bad_x.npy", "unsupported dtype '<c16'");
  free(c16.p);
  uint8_t px[4 * 4] = {0};
  bytes fort =
      npy_raw("{'descr': '|u1', 'fortran_order': True, 'shape': (4, 2, 2), }\n", px, sizeof px);
  expect_npy_error(&fort, &y, 0, SCLASSES, "bad_x.npy", "Fortran order");
  free(fort.p);
  bytes st = npy_raw("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }\n", px,
                     sizeof px);
  expect_npy_error(&st, &y, 0, SCLASSES, "bad_x.npy", "structured");
  free(st.p);
  bytes nokey = npy_raw("{'descr': '|u1', 'shape': (4, 2, 2), }\n", px, sizeof px);
  expect_npy_error(&nokey, &y, 0, SCLASSES, "bad_x.npy", "lacks 'fortran_order'");
  free(nokey.p);
  bytes syn =
      npy_raw("{'descr': '|u1', 'fortran_order': False, 'shape': (4, -2, 2), }\n", px, sizeof px);
  expect_npy_error(&syn, &y, 0, SCLASSES, "bad_x.npy", "malformed .npy header");
  free(syn.p);
  /* A shape whose product overflows 64 bits. */
  bytes ovf = npy(1, "|u1", "(4611686018427387903, 4611686018427387903, 8)", px, 4);
  expect_npy_error(&ovf, &y, 0, SCLASSES, "bad_x.npy", "overflows");
  free(ovf.p);
  bytes big = npy(1, "|u1", "(4, 70000, 2)", px, 4);
  expect_npy_error(&big, &y, 0, SCLASSES, "bad_x.npy", "truncated");
  free(big.p);
  /* Labels out of range (and negative), counts that differ, label shape. */
  int64_t lab[4] = {0, 1, 3, 0};
  bytes oor = npy(1, "<i8", "(4,)", lab, sizeof lab);
  expect_npy_error(&x, &oor, 0, SCLASSES, "bad_y.npy", "label 3 of example 2 is outside [0, 3)");
  free(oor.p);
  lab[2] = -1;
  bytes neg = npy(1, "<i8", "(4,)", lab, sizeof lab);
  expect_npy_error(&x, &neg, 0, SCLASSES, "label -1", NULL);
  free(neg.p);
  bytes three = npy(1, "<i8", "(3,)", lab, 3 * 8);
  expect_npy_error(&x, &three, 0, SCLASSES, "counts differ", "4 images but 'bad_y.npy' has 3");
  free(three.p);
  bytes y2 = npy(1, "|u1", "(2, 2)", "\0\0\0\0", 4);
  expect_npy_error(&x, &y2, 0, SCLASSES, "bad_y.npy", "shape (n) or (n, 1)");
  free(y2.p);
  bytes empty = npy(1, "|u1", "(0, 2, 2)", "", 0);
  expect_npy_error(&empty, &y, 0, SCLASSES, "bad_x.npy", "no examples");
  free(empty.p);
  /* NaN in float images. */
  float nanx[4 * 2 * 2] = {0};
  nanx[5] = NAN;
  bytes fn = npy(1, "<f4", "(4, 2, 2)", nanx, sizeof nanx);
  expect_npy_error(&fn, &y, 0, SCLASSES, "bad_x.npy", "example 1 holds a value that is not");
  free(fn.p);
  free(x.p);
  free(y.p);

  /* Files: a missing one names it. */
  char err[PS_ERRLEN] = "";
  ps_dataset d;
  CHECK(ps_dataset_load_npy("/nonexistent/x.npy", "/nonexistent/y.npy", 0, 3, &d, err) == PS_EIO);
  CHECK(strstr(err, "/nonexistent/x.npy") != NULL && is_zeroed(&d));
}

static void test_npz_errors(void) {
  /* A missing member names the members present. */
  bytes z = small_npz(1, 0, 0, "x.npy", "y.npy");
  expect_npz_error(&z, "images", "no array 'images'", "it holds: x, other, y");
  /* Not a zip; a .npy given as .npz; an archive cut short. */
  bytes x = small_x_npy(1);
  expect_npz_error(&x, "x", "bad.npz", "not an .npz archive");
  free(x.p);
  bytes junk = {(uint8_t *)"just some text that is long enough", 34, 0, 0};
  expect_npz_error(&junk, "x", "bad.npz", "bad magic");
  bytes cut = {z.p, z.len - 30, 0, 0};
  expect_npz_error(&cut, "x", "bad.npz", "corrupt zip archive");
  /* The central directory pointing past the file. */
  bytes moved = {malloc(z.len), z.len, 0, 0};
  memcpy(moved.p, z.p, z.len);
  moved.p[moved.len - 3] ^= 0x40; /* the high byte of the cd offset */
  expect_npz_error(&moved, "x", "bad.npz", "central directory outside the file");
  free(moved.p);
  /* A flipped byte in the deflated x: the inflate or the CRC fails. */
  bytes bad = {malloc(z.len), z.len, 0, 0};
  memcpy(bad.p, z.p, z.len);
  bad.p[30 + 5 + 20] ^= 0x55;
  expect_npz_error(&bad, "x", "bad.npz", "member 'x'");
  free(bad.p);
  /* A flipped byte in the stored y: the CRC fails. */
  bytes bad_y = {malloc(z.len), z.len, 0, 0};
  memcpy(bad_y.p, z.p, z.len);
  size_t cd = bad_y.p[z.len - 6] | (size_t)bad_y.p[z.len - 5] << 8;
  bad_y.p[cd - 3] ^= 0x01; /* the last data byte of y, the last member */
  expect_npz_error(&bad_y, "x", "member 'y'", "CRC-32");
  free(bad_y.p);
  /* An unknown compression method. */
  bytes m = {malloc(z.len), z.len, 0, 0};
  memcpy(m.p, z.p, z.len);
  m.p[cd + 10] = 12; /* bzip2, in x's central entry */
  expect_npz_error(&m, "x", "member 'x'", "compression method 12");
  free(m.p);
  /* A deflate stream cut short: x's compressed size 4 bytes smaller. */
  bytes short_x = {malloc(z.len), z.len, 0, 0};
  memcpy(short_x.p, z.p, z.len);
  uint32_t csize = short_x.p[cd + 20] | (uint32_t)short_x.p[cd + 21] << 8;
  short_x.p[cd + 20] = (uint8_t)(csize - 4);
  short_x.p[cd + 21] = (uint8_t)((csize - 4) >> 8);
  expect_npz_error(&short_x, "x", "member 'x': corrupt deflate data", "cut short");
  free(short_x.p);
  free(z.p);
}

/* ---- CIFAR-10 ---- */

/* Writes `records` records into dir/name; record r of file f has label
 * (f + r) % 10 and pixel j = (f * 7 + r * 3 + j) % 256. */
static int write_cifar(const char *dir, const char *name, int f, int records, int label_add) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *fp = fopen(path, "wb");
  if (!fp) return -1;
  uint8_t rec[3073];
  for (int r = 0; r < records; r++) {
    rec[0] = (uint8_t)((f + r) % 10 + label_add);
    for (int j = 0; j < 3072; j++) rec[1 + j] = (uint8_t)((f * 7 + r * 3 + j) % 256);
    if (fwrite(rec, 1, sizeof rec, fp) != sizeof rec) {
      fclose(fp);
      return -1;
    }
  }
  return fclose(fp);
}

static void expect_cifar_error(const char *dir, int train, const char *sub1, const char *sub2) {
  char err[PS_ERRLEN] = "";
  ps_dataset d;
  memset(&d, 0x5a, sizeof d);
  int rc = ps_dataset_load_cifar10(dir, train, &d, err);
  if (getenv("TEST_DATA_VERBOSE")) printf("  error: %s\n", err);
  CHECK(rc < 0);
  CHECK(is_zeroed(&d));
  CHECK_MSG(strstr(err, sub1) != NULL, "'%s' not in '%s'", sub1, err);
  if (sub2) CHECK_MSG(strstr(err, sub2) != NULL, "'%s' not in '%s'", sub2, err);
}

static void test_cifar10(void) {
  char dir[PATH_MAX], err[PS_ERRLEN] = "";
  tmp_path(dir, "cifar");
  mkdir(dir, 0700);
  for (int f = 1; f <= 5; f++) {
    char name[32];
    snprintf(name, sizeof name, "data_batch_%d.bin", f);
    CHECK(write_cifar(dir, name, f, 2 + f, 0) == 0);
  }
  CHECK(write_cifar(dir, "test_batch.bin", 9, 4, 0) == 0);
  ps_dataset d;
  int rc = ps_dataset_load_cifar10(dir, 1, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(d.n == 3 + 4 + 5 + 6 + 7 && d.c == 3 && d.h == 32 && d.w == 32 && d.classes == 10);
  int i = 0, bad = 0;
  for (int f = 1; rc == 0 && f <= 5; f++)
    for (int r = 0; r < 2 + f; r++, i++) {
      bad += d.labels[i] != (f + r) % 10;
      for (int j = 0; j < 3072; j += 97)
        bad += d.images[(size_t)i * 3072 + j] != (float)((f * 7 + r * 3 + j) % 256) / 255.0f;
    }
  CHECK(bad == 0);
  ps_dataset_free(&d);
  rc = ps_dataset_load_cifar10(dir, 0, &d, err);
  CHECK_MSG(rc == 0 && d.n == 4 && d.labels[3] == (9 + 3) % 10, "%s", err);
  ps_dataset_free(&d);

  /* The folder the archive unpacks to is found under dir. */
  char sub[PATH_MAX];
  tmp_path(sub, "cifar-up");
  mkdir(sub, 0700);
  char inner[PATH_MAX + 32];
  snprintf(inner, sizeof inner, "%s/cifar-10-batches-bin", sub);
  mkdir(inner, 0700);
  CHECK(write_cifar(inner, "test_batch.bin", 0, 2, 0) == 0);
  rc = ps_dataset_load_cifar10(sub, 0, &d, err);
  CHECK_MSG(rc == 0 && d.n == 2, "%s", err);
  ps_dataset_free(&d);

  /* Errors: no files, a gap, a partial record, a label of 10. */
  expect_cifar_error(sub, 1, "data_batch_1.bin", "not found");
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/data_batch_3.bin", dir);
  unlink(path);
  expect_cifar_error(dir, 1, "data_batch_3.bin is missing", "data_batch_4.bin");
  CHECK(write_cifar(dir, "data_batch_3.bin", 3, 5, 0) == 0);
  FILE *fp = fopen(path, "ab");
  if (fp) {
    fputc(1, fp);
    fclose(fp);
  }
  expect_cifar_error(dir, 1, "data_batch_3.bin", "not a whole number");
  CHECK(write_cifar(dir, "data_batch_3.bin", 3, 5, 10) == 0);
  expect_cifar_error(dir, 1, "data_batch_3.bin", "label 1");
}

/* ---- normalisation ---- */

static void test_normalize(void) {
  char err[PS_ERRLEN] = "";
  bytes x = small_x_npy(1), y = small_y_npy("<i8", NULL);
  ps_dataset d;
  CHECK(ps_dataset_parse_npy(x.p, x.len, "x", y.p, y.len, "y", 0, SCLASSES, &d, err) == 0);
  float mean[3] = {0.5f, 0.25f, 0.0f}, std[3] = {0.5f, 2.0f, 0.1f};
  CHECK(ps_dataset_normalize(&d, mean, std, 3, err) == 0);
  int bad = 0;
  for (int i = 0; i < SN; i++)
    for (int ch = 0; ch < SC; ch++)
      for (int p = 0; p < SH * SW; p++) {
        float want = ((float)small_px(i, ch, p / SW, p % SW) / 255.0f - mean[ch]) / std[ch];
        float got = d.images[((size_t)i * SC + ch) * SH * SW + (size_t)p];
        bad += fabsf(got - want) > 1e-6f * (1.0f + fabsf(want));
      }
  CHECK(bad == 0);
  /* One value for every channel; counts and std checked, data untouched. */
  float before = d.images[7];
  float bad_std[3] = {1.0f, 0.0f, 1.0f};
  CHECK(ps_dataset_normalize(&d, mean, std, 2, err) == PS_EINVAL && strstr(err, "3 channels"));
  CHECK(ps_dataset_normalize(&d, mean, bad_std, 3, err) == PS_EINVAL && strstr(err, "std[1]"));
  CHECK(d.images[7] == before);
  CHECK(ps_dataset_normalize(&d, mean, std, 1, err) == 0);
  CHECK(fabsf(d.images[7] - (before - 0.5f) / 0.5f) < 1e-6f);
  ps_dataset_free(&d);
  free(x.p);
  free(y.p);
}

/* ---- the job ---- */

/* A job around the small set's shape; `dataset` is the dataset object. */
static int parse_job(const char *dataset, ps_job *job, char *err) {
  char text[2048];
  snprintf(text, sizeof text,
           "{\"job_id\": \"t\", \"model\": {\"input\": [3, 2, 5], \"classes\": 3, \"layers\": "
           "[{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 3}, "
           "{\"type\": \"softmax_xent\"}]}, \"dataset\": %s}",
           dataset);
  return ps_job_parse(text, job, err);
}

static void expect_job_error(const char *dataset, const char *sub) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = parse_job(dataset, &job, err);
  if (getenv("TEST_DATA_VERBOSE")) printf("  error: %s\n", err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, sub), "%s: '%s' not in '%s'", dataset, sub, err);
}

static void test_job_keys(void) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = parse_job(
      "{\"name\": \"npz\", \"dir\": \"/d\", \"train\": \"tr.npz\", \"test\": "
      "\"/abs/te.npz\", \"x\": \"img\", \"layout\": \"nchw\", \"mean\": [0.5], "
      "\"std\": [0.25], \"crop_pad\": 2, \"flip\": true}",
      &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(!strcmp(job.dataset, "npz") && !strcmp(job.data_dir, "/d"));
  CHECK(!strcmp(job.data_train, "tr.npz") && !strcmp(job.data_test, "/abs/te.npz"));
  CHECK(!strcmp(job.data_x, "img") && !strcmp(job.data_y, "y"));
  CHECK(job.data_layout == PS_LAYOUT_NCHW && job.data_norm_count == 1);
  CHECK(job.data_mean[0] == 0.5f && job.data_std[0] == 0.25f);
  CHECK(job.data_crop_pad == 2 && job.data_flip == 1);
  rc = parse_job(
      "{\"name\": \"npy\", \"train_x\": \"a\", \"train_y\": \"b\", \"test_x\": \"c\", "
      "\"test_y\": \"d\", \"mean\": [0.1, 0.2, 0.3], \"std\": [1, 2, 3]}",
      &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(job.data_layout == PS_LAYOUT_NHWC && job.data_norm_count == 3 && job.data_std[2] == 3.0f);
  CHECK(!strcmp(job.data_test_y, "d") && job.data_dir[0] == '\0');
  rc = parse_job("{\"name\": \"cifar10\", \"flip\": false}", &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  CHECK(!strcmp(job.data_dir, "/usr/share/datasets/cifar10") && job.data_flip == 0);
  /* Normalisation and augmentation apply to the IDX sets too. */
  CHECK(parse_job("{\"name\": \"mnist\", \"crop_pad\": 1, \"mean\": [0], \"std\": [1]}", &job,
                  err) == 0);

  expect_job_error("{\"name\": \"npz\", \"train\": \"a\", \"test\": \"b\", \"colour\": 1}",
                   "unknown field 'dataset.colour'");
  expect_job_error("{\"name\": \"npz\", \"test\": \"b\"}",
                   "'dataset.train' is required for the npz");
  expect_job_error("{\"name\": \"npy\", \"train_x\": \"a\", \"train_y\": \"b\", \"test_x\": \"c\"}",
                   "'dataset.test_y' is required");
  expect_job_error("{\"name\": \"npz\", \"train\": \"\", \"test\": \"b\"}", "must not be empty");
  expect_job_error("{\"name\": \"cifar10\", \"layout\": \"nhwc\"}",
                   "'dataset.layout' does not apply to the cifar10 dataset: keys like it apply "
                   "only to the npz or npy dataset");
  expect_job_error("{\"name\": \"npy\", \"train\": \"a\"}", "only to the npz or criteo dataset");
  expect_job_error("{\"name\": \"npz\", \"train\": \"a\", \"test\": \"b\", \"layout\": \"chw\"}",
                   "\"nhwc\" or \"nchw\"");
  expect_job_error("{\"mean\": [0.5]}", "give both");
  expect_job_error("{\"mean\": [0.5, 0.5], \"std\": [1, 1]}", "one per input channel (3)");
  expect_job_error("{\"mean\": [0.5], \"std\": [1, 1, 1]}", "has 1 values but");
  expect_job_error("{\"mean\": [0.5], \"std\": [0]}",
                   "'dataset.std[0]' must be a finite number > 0");
  expect_job_error("{\"mean\": \"x\", \"std\": [1]}", "'dataset.mean' must be a list");
  expect_job_error("{\"crop_pad\": 65}", "'dataset.crop_pad' must be an integer in 0..64");
  expect_job_error("{\"flip\": 1}", "'dataset.flip' must be true or false");
}

/* Writes the small set as train.npz and test.npz under tmpdir/job. */
static void write_job_files(char *dir) {
  tmp_path(dir, "job");
  mkdir(dir, 0700);
  char path[PATH_MAX + 16];
  bytes z = small_npz(1, 0, 0, "x.npy", "y.npy");
  snprintf(path, sizeof path, "%s/train.npz", dir);
  CHECK(write_bytes(path, &z) == 0);
  snprintf(path, sizeof path, "%s/test.npz", dir);
  CHECK(write_bytes(path, &z) == 0);
  free(z.p);
}

static void test_job_load(void) {
  char dir[PATH_MAX], err[PS_ERRLEN] = "";
  write_job_files(dir);
  ps_job job;
  int rc = parse_job(
      "{\"name\": \"npz\", \"dir\": \"/nonexistent\", \"train\": \"train.npz\", "
      "\"test\": \"test.npz\", \"mean\": [0.5, 0.5, 0.5], \"std\": [0.5, 0.25, "
      "1], \"crop_pad\": 1, \"flip\": true}",
      &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  /* The directory given to the loader (--data-dir) overrides the job's. */
  ps_dataset train, test;
  rc = ps_dataset_load_job(&job, dir, 1, &train, err);
  CHECK_MSG(rc == 0, "%s", err);
  rc = ps_dataset_load_job(&job, dir, 0, &test, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc == 0) {
    CHECK(train.aug.crop_pad == 1 && train.aug.flip == 1 && train.aug.fill);
    if (train.aug.fill)
      CHECK(train.aug.fill[0] == -1.0f && train.aug.fill[1] == -2.0f && train.aug.fill[2] == -0.5f);
    /* The test split: normalised the same, never augmented. */
    CHECK(test.aug.crop_pad == 0 && test.aug.flip == 0 && !test.aug.fill);
    CHECK(test.images[0] == train.images[0]);
    /* Batches of the test split are its examples as they are; those of
     * the train split are augmented. */
    ps_batcher *b = ps_batcher_create_ordered(&test, SN, 0, 1, 5, 1, 0);
    ps_batch *batch = NULL;
    CHECK(b && ps_batcher_next(b, &batch) == 0 && batch->n == SN &&
          memcmp(batch->x, test.images, sizeof(float) * SN * SD) == 0);
    ps_batcher_destroy(b);
    b = ps_batcher_create_ordered(&train, SN, 0, 1, 5, 1, 0);
    CHECK(b && ps_batcher_next(b, &batch) == 0 && batch->n == SN &&
          memcmp(batch->x, train.images, sizeof(float) * SN * SD) != 0);
    ps_batcher_destroy(b);
    CHECK(fabsf(test.images[0] - ((float)small_px(0, 0, 0, 0) / 255.0f - 0.5f) / 0.5f) < 1e-6f);
  }
  ps_dataset_free(&train);
  ps_dataset_free(&test);
  ps_dataset d;
  /* The job's own dir, which does not exist: the message names the file. */
  memset(&d, 0x5a, sizeof d);
  rc = ps_dataset_load_job(&job, NULL, 1, &d, err);
  CHECK(rc == PS_EIO && strstr(err, "/nonexistent/train.npz") && is_zeroed(&d));

  /* A shape the model does not take: both shapes named, and the layout
   * that would fit. */
  rc = parse_job(
      "{\"name\": \"npz\", \"train\": \"train.npz\", \"test\": \"test.npz\", "
      "\"layout\": \"nchw\"}",
      &job, err);
  CHECK(rc == 0);
  memset(&d, 0x5a, sizeof d);
  rc = ps_dataset_load_job(&job, dir, 1, &d, err);
  if (getenv("TEST_DATA_VERBOSE")) printf("  error: %s\n", err);
  CHECK(rc == PS_EINVAL && is_zeroed(&d));
  CHECK_MSG(strstr(err, "train.npz") &&
                strstr(err,
                       "examples are 2x5x3 (CxHxW) but the model's "
                       "input is 3x2x5") &&
                strstr(err, "\"layout\": \"nhwc\""),
            "%s", err);
  /* Paths are used as given without a dir. */
  char abs[PATH_MAX + 64];
  snprintf(abs, sizeof abs, "{\"name\": \"npz\", \"train\": \"%s/train.npz\", \"test\": \"x\"}",
           dir);
  CHECK(parse_job(abs, &job, err) == 0);
  rc = ps_dataset_load_job(&job, "", 1, &d, err);
  CHECK_MSG(rc == 0, "%s", err);
  check_small(&d, "absolute path");
  ps_dataset_free(&d);
}

/* ---- augmentation ---- */

/* A hand-made set of n examples c x h x w, every value distinct. */
static int make_aug_set(ps_dataset *d, int n, int c, int h, int w, int pad, int flip) {
  memset(d, 0, sizeof *d);
  size_t dim = (size_t)c * h * w;
  d->images = ps_alloc((size_t)n * dim * sizeof(float));
  d->labels = ps_alloc((size_t)n);
  d->aug.fill = ps_alloc((size_t)c * sizeof(float));
  if (!d->images || !d->labels || !d->aug.fill) return -1;
  d->n = n, d->c = c, d->h = h, d->w = w, d->classes = 10;
  for (size_t k = 0; k < (size_t)n * dim; k++) d->images[k] = (float)k + 1.0f;
  for (int i = 0; i < n; i++) d->labels[i] = (uint8_t)(i % 10);
  for (int ch = 0; ch < c; ch++) d->aug.fill[ch] = -1.0f - (float)ch;
  d->aug.crop_pad = pad;
  d->aug.flip = flip;
  return 0;
}

/* Which crop and flip turn example i into got: 0..(2p+1)^2*2-1, or -1. */
static int which_transform(const ps_dataset *d, int i, const float *got) {
  int p = d->aug.crop_pad, h = d->h, w = d->w;
  const float *src = d->images + (size_t)i * d->c * h * w;
  for (int dy = -p; dy <= p; dy++)
    for (int dx = -p; dx <= p; dx++)
      for (int f = 0; f <= d->aug.flip; f++) {
        int same = 1;
        for (int ch = 0; ch < d->c && same; ch++)
          for (int y = 0; y < h && same; y++)
            for (int x = 0; x < w && same; x++) {
              int sy = y + dy, sx = (f ? w - 1 - x : x) + dx;
              float want = sy >= 0 && sy < h && sx >= 0 && sx < w
                               ? src[((size_t)ch * h + sy) * w + sx]
                               : d->aug.fill[ch];
              same = got[((size_t)ch * h + y) * w + x] == want;
            }
        if (same) return ((dy + p) * (2 * p + 1) + dx + p) * 2 + f;
      }
  return -1;
}

/* The images of `epochs` epochs of an ordered batcher (one worker). */
static float *drain(const ps_dataset *d, uint64_t seed, int epochs, int depth) {
  size_t dim = (size_t)d->c * d->h * d->w;
  float *out = malloc((size_t)epochs * d->n * dim * sizeof(float));
  ps_batcher *b = ps_batcher_create_ordered(d, 5, 0, 1, seed, depth, 0);
  if (!out || !b) {
    free(out);
    ps_batcher_destroy(b);
    return NULL;
  }
  size_t at = 0;
  while (at < (size_t)epochs * d->n) {
    ps_batch *batch = NULL;
    if (ps_batcher_next(b, &batch) != 0) break;
    memcpy(out + at * dim, batch->x, (size_t)batch->n * dim * sizeof(float));
    at += (size_t)batch->n;
    ps_batcher_release(b, batch);
  }
  ps_batcher_destroy(b);
  return out;
}

static void test_augment(void) {
  enum { N = 24, C = 2, H = 5, W = 6, EPOCHS = 3 };
  size_t dim = (size_t)C * H * W;
  ps_dataset d;
  CHECK(make_aug_set(&d, N, C, H, W, 2, 1) == 0);
  float *a = drain(&d, 17, EPOCHS, 1), *b = drain(&d, 17, EPOCHS, 4), *c = drain(&d, 18, 1, 2);
  CHECK(a && b && c);
  if (a && b && c) {
    /* The same seed replays exactly, whatever the prefetch depth. */
    CHECK(memcmp(a, b, (size_t)EPOCHS * N * dim * sizeof(float)) == 0);
    /* Another seed, another epoch: other draws. */
    CHECK(memcmp(a, c, (size_t)N * dim * sizeof(float)) != 0);
    for (int e = 1; e < EPOCHS; e++)
      CHECK(memcmp(a, a + (size_t)e * N * dim, (size_t)N * dim * sizeof(float)) != 0);
    /* Each example is one crop (and maybe mirror) of its original, and
     * the draws cover flipped, unflipped, shifted and padded cases. */
    int bad = 0, flipped = 0, shifted = 0;
    for (int e = 0; e < EPOCHS; e++)
      for (int i = 0; i < N; i++) {
        int t = which_transform(&d, i, a + ((size_t)e * N + i) * dim);
        if (t < 0) {
          bad++;
          continue;
        }
        flipped += t % 2;
        shifted += t / 2 != 12; /* (dy, dx) = (0, 0) is 12 of 0..24 */
      }
    CHECK_MSG(bad == 0, "%d examples are no crop of their original", bad);
    CHECK(flipped > 0 && flipped < EPOCHS * N && shifted > 0);
  }
  free(a);
  free(b);
  free(c);

  /* Flip only: a mirror image or the original; crop only: no mirror. */
  ps_dataset_free(&d);
  CHECK(make_aug_set(&d, N, C, H, W, 0, 1) == 0);
  a = drain(&d, 3, 1, 2);
  int bad = 0;
  for (int i = 0; a && i < N; i++) bad += which_transform(&d, i, a + (size_t)i * dim) < 0;
  CHECK(a && bad == 0);
  free(a);
  /* No augmentation: exact copies. */
  d.aug.flip = 0;
  a = drain(&d, 3, 1, 2);
  CHECK(a && memcmp(a, d.images, (size_t)N * dim * sizeof(float)) == 0);
  free(a);
  ps_dataset_free(&d);
}

/* np.savez(f, *arrays): members arr_0, arr_1, ... as float32 (float64
 * converted), shapes kept; anything else refused with the member named. */
static void test_npz_floats(void) {
  char err[PS_ERRLEN] = "";
  const float k[6] = {1, -2, 3.5f, 4, 5, 6};
  const double b[2] = {0.25, -8};
  zip_member m[2] = {{"arr_0.npy", npy(1, "<f4", "(2, 3)", k, sizeof k), 1},
                     {"arr_1.npy", npy(2, "<f8", "(2,)", b, sizeof b), 0}};
  bytes z = zip(m, 2, 1);
  ps_np_floats w;
  CHECK_MSG(ps_npz_parse_floats(z.p, z.len, "w.npz", &w, err) == 0, "%s", err);
  CHECK(w.n == 2);
  if (w.n == 2) {
    CHECK(w.arrays[0].ndim == 2 && w.arrays[0].shape[0] == 2 && w.arrays[0].shape[1] == 3);
    CHECK(w.arrays[0].count == 6 && memcmp(w.arrays[0].data, k, sizeof k) == 0);
    CHECK(w.arrays[1].ndim == 1 && w.arrays[1].shape[0] == 2);
    CHECK(w.arrays[1].data[0] == 0.25f && w.arrays[1].data[1] == -8.0f);
  }
  ps_np_floats_free(&w);
  CHECK(w.n == 0 && w.arrays == NULL);
  /* Out of order is fine (found by name); a gap or another name is not. */
  zip_member swapped[2] = {m[1], m[0]};
  bytes z2 = zip(swapped, 2, 0);
  CHECK(ps_npz_parse_floats(z2.p, z2.len, "w.npz", &w, err) == 0 && w.n == 2 &&
        w.arrays[0].count == 6);
  ps_np_floats_free(&w);
  zip_member named[2] = {m[0], {"kernel.npy", m[1].data, 0}};
  bytes z3 = zip(named, 2, 0);
  CHECK(ps_npz_parse_floats(z3.p, z3.len, "w.npz", &w, err) == PS_EINVAL &&
        strstr(err, "no array 'arr_1'") && w.n == 0 && w.arrays == NULL);
  zip_member ints[1] = {{"arr_0.npy", npy(1, "<i8", "(1,)", "\1\0\0\0\0\0\0\0", 8), 0}};
  bytes z4 = zip(ints, 1, 0);
  CHECK(ps_npz_parse_floats(z4.p, z4.len, "w.npz", &w, err) == PS_EINVAL &&
        strstr(err, "w.npz:arr_0") && strstr(err, "float32 or float64 wanted"));
  /* A damaged archive. */
  z.p[z.len - 30] ^= 0xff;
  z.p[40] ^= 0x55;
  CHECK(ps_npz_parse_floats(z.p, z.len, "w.npz", &w, err) != 0 && w.n == 0);
  free(ints[0].data.p);
  free(z.p);
  free(z2.p);
  free(z3.p);
  free(z4.p);
  free(m[0].data.p);
  free(m[1].data.p);
}

/* A worker's share of a generated click log: the whole log's examples
 * rank, rank + W, ... and only its train split. */
static void test_ctr_share(void) {
  ps_job job;
  char err[PS_ERRLEN] = "";
  int rc = ps_job_parse(
      "{\"job_id\": \"c\", \"model\": {\"input\": [13, 1, 1], \"ids\": 26, \"classes\": 1, "
      "\"layers\": [{\"type\": \"embedding\", \"name\": \"e\", \"table\": \"cat\", \"dim\": 4}, "
      "{\"type\": \"concat\", \"inputs\": [\"input\", \"e\"]}, {\"type\": \"dense\", \"units\": 1}, "
      "{\"type\": \"sigmoid_xent\"}]}, \"embeddings\": [{\"name\": \"cat\", \"rows\": 0, \"dim\": "
      "4}], \"dataset\": {\"name\": \"ctr-synthetic\", \"train_size\": 101, \"test_size\": 20}}",
      &job, err);
  CHECK_MSG(rc == 0, "%s", err);
  if (rc) return;
  CHECK(ps_dataset_job_parts(&job));
  ps_dataset all, share, bad;
  CHECK(ps_dataset_load_job(&job, NULL, 1, &all, err) == 0);
  CHECK_MSG(ps_dataset_load_job_part(&job, NULL, 1, 1, 2, &share, err) == 0, "%s", err);
  CHECK(all.n == 101 && share.n == 50 && share.n_ids == 26);
  int same = 1;
  for (int k = 0; k < share.n && all.n == 101; k++) {
    const int i = 1 + 2 * k;
    same &= all.labels[i] == share.labels[k] &&
            memcmp(all.ids + (size_t)i * 26, share.ids + (size_t)k * 26, 26 * sizeof(uint64_t)) == 0 &&
            memcmp(all.images + (size_t)i * 13, share.images + (size_t)k * 13, 13 * sizeof(float)) == 0;
  }
  CHECK_MSG(same, "the share is not rows 1, 3, 5, ... of the whole set");
  /* the test split, or a reader without parts: refused, nothing made */
  CHECK(ps_dataset_load_job_part(&job, NULL, 0, 1, 2, &bad, err) == PS_EINVAL &&
        strstr(err, "test split") && bad.n == 0);
  ps_dataset_free(&all);
  ps_dataset_free(&share);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/test_data_formats.XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(test_ctr_share);
  RUN(test_npy_uint8);
  RUN(test_npy_float_and_versions);
  RUN(test_npz);
  RUN(test_npy_errors);
  RUN(test_npz_errors);
  RUN(test_npz_floats);
  RUN(test_cifar10);
  RUN(test_normalize);
  RUN(test_job_keys);
  RUN(test_job_load);
  RUN(test_augment);
  remove_tree(tmpdir);
  return check_summary();
}

/* NumPy data: .npy arrays and .npz archives (zip files of .npy members).
 *
 * A file is read whole into memory and parsed there, so the fuzz target
 * and the tests reach the same code as a worker. The zip reader takes the
 * sizes and offsets from the central directory only (numpy writes local
 * headers with zip64 placeholders), inflates deflate members with zlib and
 * checks every member's CRC-32. */
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "common/util.h"
#include "worker/data/data.h"

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAX_HEADER 65536 /* numpy itself refuses more than 10000 by default */
#define NPY_MAX_DIMS 8

/* Deflate expands at most about 1032:1; a member that claims more is a
 * corrupt directory, refused before the allocation. */
#define DEFLATE_MAX_RATIO 1100

#define ZIP_EOCD 0x06054b50u
#define ZIP64_LOCATOR 0x07064b50u
#define ZIP64_EOCD 0x06064b50u
#define ZIP_CENTRAL 0x02014b50u
#define ZIP_LOCAL 0x04034b50u

/* Element types: the dtype strings numpy writes on little-endian hosts. */
typedef enum {
  NPY_U8,
  NPY_I8,
  NPY_U16,
  NPY_I16,
  NPY_U32,
  NPY_I32,
  NPY_U64,
  NPY_I64,
  NPY_F32,
  NPY_F64
} npy_dtype;

static const struct {
  const char *descr;
  npy_dtype type;
  int size;
} NPY_DTYPES[] = {
    {"|u1", NPY_U8, 1},  {"<u1", NPY_U8, 1},  {"|i1", NPY_I8, 1},  {"<i1", NPY_I8, 1},
    {"<u2", NPY_U16, 2}, {"<i2", NPY_I16, 2}, {"<u4", NPY_U32, 4}, {"<i4", NPY_I32, 4},
    {"<u8", NPY_U64, 8}, {"<i8", NPY_I64, 8}, {"<f4", NPY_F32, 4}, {"<f8", NPY_F64, 8},
};

/* One parsed array; data points into the caller's buffer. */
typedef struct {
  npy_dtype type;
  int itemsize;
  char descr[16];
  int ndim;
  uint64_t shape[NPY_MAX_DIMS];
  uint64_t count; /* product of shape */
  const uint8_t *data;
} npy_array;

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const uint8_t *p) { return le32(p) | (uint64_t)le32(p + 4) << 32; }

/* ---- .npy header: a Python dict literal ---- */

typedef struct {
  const char *p, *end;
} lit_cursor;

static void lit__skip(lit_cursor *c) {
  while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int lit__eat(lit_cursor *c, char ch) {
  lit__skip(c);
  if (c->p < c->end && *c->p == ch) {
    c->p++;
    return 1;
  }
  return 0;
}

/* A quoted string (single or double quotes, no escapes) into out. */
static int lit__string(lit_cursor *c, char *out, size_t cap) {
  lit__skip(c);
  if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return -1;
  char q = *c->p++;
  size_t n = 0;
  while (c->p < c->end && *c->p != q) {
    if (*c->p == '\\' || n + 1 >= cap) return -1;
    out[n++] = *c->p++;
  }
  if (c->p >= c->end) return -1;
  c->p++;
  out[n] = '\0';
  return 0;
}

/* A tuple of non-negative integers, "()", "(5,)" or "(2, 3)"; Python 2's
 * "5L" too. Each value below 2^63. */
static int lit__shape(lit_cursor *c, uint64_t *shape, int *ndim) {
  if (!lit__eat(c, '(')) return -1;
  *ndim = 0;
  for (;;) {
    if (lit__eat(c, ')')) return 0;
    lit__skip(c);
    if (c->p >= c->end || *c->p < '0' || *c->p > '9' || *ndim >= NPY_MAX_DIMS) return -1;
    uint64_t v = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
      if (v > (UINT64_C(1) << 62) / 10) return -1;
      v = v * 10 + (uint64_t)(*c->p++ - '0');
    }
    if (c->p < c->end && *c->p == 'L') c->p++;
    shape[(*ndim)++] = v;
    if (lit__eat(c, ',')) continue;
    if (lit__eat(c, ')')) return 0;
    return -1;
  }
}

/* Parses the dict {'descr': ..., 'fortran_order': ..., 'shape': (...)}
 * of `len` bytes into a (all but data). */
static int npy__dict(const char *text, size_t len, const char *path, npy_array *a, char *err) {
  lit_cursor c = {text, text + len};
  int have_descr = 0, have_order = 0, have_shape = 0, fortran = 0;
  char key[32], descr[16];
  if (!lit__eat(&c, '{')) goto syntax;
  for (;;) {
    if (lit__eat(&c, '}')) break;
    if (lit__string(&c, key, sizeof key) != 0 || !lit__eat(&c, ':')) goto syntax;
    if (strcmp(key, "descr") == 0 && !have_descr) {
      if (lit__string(&c, descr, sizeof descr) != 0) {
        if (lit__eat(&c, '[') || lit__eat(&c, '('))
          return ps_seterr(err, PS_EINVAL,
                           "'%s': a structured dtype; only plain numeric arrays are read", path);
        goto syntax;
      }
      have_descr = 1;
    } else if (strcmp(key, "fortran_order") == 0 && !have_order) {
      lit__skip(&c);
      if ((size_t)(c.end - c.p) >= 4 && memcmp(c.p, "True", 4) == 0) {
        fortran = 1;
        c.p += 4;
      } else if ((size_t)(c.end - c.p) >= 5 && memcmp(c.p, "False", 5) == 0) {
        c.p += 5;
      } else {
        goto syntax;
      }
      have_order = 1;
    } else if (strcmp(key, "shape") == 0 && !have_shape) {
      if (lit__shape(&c, a->shape, &a->ndim) != 0) goto syntax;
      have_shape = 1;
    } else {
      return ps_seterr(err, PS_EINVAL,
                       "'%s': .npy header has an unexpected or repeated key '%.20s'", path, key);
    }
    if (!lit__eat(&c, ',')) {
      if (lit__eat(&c, '}')) break;
      goto syntax;
    }
  }
  if (!have_descr || !have_order || !have_shape)
    return ps_seterr(err, PS_EINVAL, "'%s': .npy header lacks '%s'", path,
                     !have_descr   ? "descr"
                     : !have_order ? "fortran_order"
                                   : "shape");
  if (fortran)
    return ps_seterr(err, PS_EINVAL,
                     "'%s': array is in Fortran order; save it in C order "
                     "(np.ascontiguousarray) to read it here",
                     path);
  snprintf(a->descr, sizeof a->descr, "%s", descr);
  for (size_t i = 0; i < sizeof NPY_DTYPES / sizeof NPY_DTYPES[0]; i++) {
    if (strcmp(descr, NPY_DTYPES[i].descr) == 0) {
      a->type = NPY_DTYPES[i].type;
      a->itemsize = NPY_DTYPES[i].size;
      return PS_OK;
    }
  }
  if (descr[0] == '>')
    return ps_seterr(err, PS_EINVAL,
                     "'%s': dtype '%s' is big-endian; convert it with astype('<%s')", path, descr,
                     descr + 1);
  return ps_seterr(err, PS_EINVAL,
                   "'%s': unsupported dtype '%s' (images: |u1, <f4, <f8; labels: integers)", path,
                   descr);
syntax:
  return ps_seterr(err, PS_EINVAL, "'%s': malformed .npy header near byte %zu", path,
                   (size_t)(c.p - text));
}

/* Parses a whole .npy file of len bytes; the data must be exactly what the
 * header describes. */
static int npy__parse(const uint8_t *buf, size_t len, const char *path, npy_array *a, char *err) {
  memset(a, 0, sizeof *a);
  if (len < 10 || memcmp(buf, NPY_MAGIC, 6) != 0)
    return ps_seterr(err, PS_EINVAL, "'%s': bad magic: not a .npy file%s", path,
                     len >= 4 && le32(buf) == ZIP_LOCAL ? " (a zip archive: an .npz?)" : "");
  int major = buf[6], minor = buf[7];
  size_t hstart, hlen;
  if (major == 1) {
    hstart = 10;
    hlen = le16(buf + 8);
  } else if (major == 2 || major == 3) {
    if (len < 12) return ps_seterr(err, PS_EINVAL, "'%s': truncated .npy header", path);
    hstart = 12;
    hlen = le32(buf + 8);
  } else {
    return ps_seterr(err, PS_EINVAL, "'%s': .npy format version %d.%d (known: 1.0, 2.0, 3.0)", path,
                     major, minor);
  }
  if (hlen > NPY_MAX_HEADER)
    return ps_seterr(err, PS_EINVAL, "'%s': .npy header of %zu bytes (at most %d)", path, hlen,
                     NPY_MAX_HEADER);
  if (len - hstart < hlen)
    return ps_seterr(err, PS_EINVAL, "'%s': truncated .npy header: %zu bytes promised, %zu present",
                     path, hlen, len - hstart);
  int rc = npy__dict((const char *)buf + hstart, hlen, path, a, err);
  if (rc) return rc;
  uint64_t count = 1;
  for (int i = 0; i < a->ndim; i++) {
    if (a->shape[i] != 0 && count > UINT64_MAX / a->shape[i])
      return ps_seterr(err, PS_ERANGE, "'%s': shape overflows", path);
    count *= a->shape[i];
  }
  size_t data_len = len - hstart - hlen;
  if (count > SIZE_MAX / (size_t)a->itemsize || count * (size_t)a->itemsize > data_len)
    return ps_seterr(err, PS_EINVAL,
                     "'%s': truncated: the header describes %llu values of %d bytes, only %zu "
                     "bytes present",
                     path, (unsigned long long)count, a->itemsize, data_len);
  if (count * (size_t)a->itemsize < data_len)
    return ps_seterr(err, PS_EINVAL,
                     "'%s': data continues past the size its header gives; header and payload "
                     "disagree",
                     path);
  a->count = count;
  a->data = buf + hstart + hlen;
  return PS_OK;
}

/* ---- arrays to a data set ---- */

static double npy__float(const npy_array *a, uint64_t i) {
  const uint8_t *p = a->data + i * (uint64_t)a->itemsize;
  if (a->type == NPY_F32) {
    uint32_t u = le32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  uint64_t u = le64(p);
  double d;
  memcpy(&d, &u, sizeof d);
  return d;
}

/* Label i as a signed value; uint64 beyond INT64_MAX comes back as -1
 * (out of every range all the same). */
static int64_t npy__int(const npy_array *a, uint64_t i) {
  const uint8_t *p = a->data + i * (uint64_t)a->itemsize;
  switch (a->type) {
    case NPY_U8: return p[0];
    case NPY_I8: return (int8_t)p[0];
    case NPY_U16: return le16(p);
    case NPY_I16: return (int16_t)le16(p);
    case NPY_U32: return le32(p);
    case NPY_I32: return (int32_t)le32(p);
    case NPY_U64: return le64(p) > INT64_MAX ? -1 : (int64_t)le64(p);
    case NPY_I64: return (int64_t)le64(p);
    default: return -1;
  }
}

/* The example shape of x per layout; PS_EINVAL for anything implausible. */
static int npy__image_shape(const npy_array *x, const char *path, int layout, int *c, int *h,
                            int *w, char *err) {
  uint64_t d[3];
  if (x->ndim == 3) {
    d[0] = 1, d[1] = x->shape[1], d[2] = x->shape[2];
  } else if (x->ndim == 4 && layout == PS_LAYOUT_NCHW) {
    d[0] = x->shape[1], d[1] = x->shape[2], d[2] = x->shape[3];
  } else if (x->ndim == 4) {
    d[0] = x->shape[3], d[1] = x->shape[1], d[2] = x->shape[2];
  } else {
    return ps_seterr(err, PS_EINVAL,
                     "'%s': images must be a 3-D (n, h, w) or 4-D (n, h, w, c) or (n, c, h, w) "
                     "array; this one has %d dimensions",
                     path, x->ndim);
  }
  if (x->shape[0] == 0) return ps_seterr(err, PS_EINVAL, "'%s': no examples (n = 0)", path);
  if (x->shape[0] > INT_MAX || d[0] == 0 || d[1] == 0 || d[2] == 0 || d[0] > 65535 ||
      d[1] > 65535 || d[2] > 65535 || d[0] * d[1] * d[2] > INT_MAX / 4)
    return ps_seterr(err, PS_EINVAL, "'%s': implausible image shape %llu x %llu x %llu", path,
                     (unsigned long long)d[0], (unsigned long long)d[1], (unsigned long long)d[2]);
  *c = (int)d[0], *h = (int)d[1], *w = (int)d[2];
  return PS_OK;
}

/* Images of x into d->images (n, c, h, w), from (n, h, w, c) for NHWC. */
static int npy__images(const npy_array *x, const char *path, int layout, ps_dataset *d, char *err) {
  if (x->type != NPY_U8 && x->type != NPY_F32 && x->type != NPY_F64)
    return ps_seterr(err, PS_EINVAL, "'%s': images of dtype '%s'; use uint8 (|u1) or float32 (<f4)",
                     path, x->descr);
  size_t dim = (size_t)d->c * d->h * d->w, hw = (size_t)d->h * d->w;
  if ((uint64_t)d->n * dim > SIZE_MAX / sizeof(float))
    return ps_seterr(err, PS_ERANGE, "'%s': %d x %zu values do not fit in memory", path, d->n, dim);
  d->images = ps_alloc((size_t)d->n * dim * sizeof(float));
  if (!d->images) return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", path);
  float scale[256];
  for (int v = 0; v < 256; v++) scale[v] = (float)v / 255.0f;
  int nhwc = x->ndim == 4 && layout == PS_LAYOUT_NHWC;
  for (size_t i = 0; i < (size_t)d->n; i++) {
    float *dst = d->images + i * dim;
    uint64_t base = (uint64_t)i * dim;
    for (size_t ch = 0; ch < (size_t)d->c; ch++) {
      for (size_t p = 0; p < hw; p++) {
        /* Where channel ch of pixel p sits in the source. */
        uint64_t from = base + (nhwc ? p * (size_t)d->c + ch : ch * hw + p);
        if (x->type == NPY_U8) {
          dst[ch * hw + p] = scale[x->data[from]];
          continue;
        }
        double f = npy__float(x, from);
        if (!isfinite(f) || fabs(f) > FLT_MAX)
          return ps_seterr(err, PS_EINVAL,
                           "'%s': example %zu holds a value that is not a finite float32", path, i);
        dst[ch * hw + p] = (float)f;
      }
    }
  }
  return PS_OK;
}

static int npy__labels(const npy_array *y, const char *path, int classes, ps_dataset *d,
                       char *err) {
  if (y->type == NPY_F32 || y->type == NPY_F64)
    return ps_seterr(err, PS_EINVAL, "'%s': labels of dtype '%s'; labels must be integers", path,
                     y->descr);
  d->labels = ps_alloc((size_t)d->n);
  if (!d->labels) return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", path);
  for (uint64_t i = 0; i < (uint64_t)d->n; i++) {
    int64_t v = npy__int(y, i);
    if (v < 0 || v >= classes)
      return ps_seterr(err, PS_EINVAL, "'%s': label %lld of example %llu is outside [0, %d)", path,
                       (long long)v, (unsigned long long)i, classes);
    d->labels[i] = (uint8_t)v;
  }
  return PS_OK;
}

/* Both arrays into *out (zeroed on error). */
static int npy__dataset(const npy_array *x, const char *x_path, const npy_array *y,
                        const char *y_path, int layout, int classes, ps_dataset *out, char *err) {
  ps_dataset d = {0};
  int rc = npy__image_shape(x, x_path, layout, &d.c, &d.h, &d.w, err);
  if (rc) return rc;
  int y_ok = y->ndim == 1 || (y->ndim == 2 && y->shape[1] == 1);
  if (!y_ok)
    return ps_seterr(err, PS_EINVAL,
                     "'%s': labels must have shape (n) or (n, 1); these have %d "
                     "dimensions",
                     y_path, y->ndim);
  if (y->shape[0] != x->shape[0])
    return ps_seterr(err, PS_EINVAL, "counts differ: '%s' has %llu images but '%s' has %llu labels",
                     x_path, (unsigned long long)x->shape[0], y_path,
                     (unsigned long long)y->shape[0]);
  d.n = (int)x->shape[0];
  d.classes = classes;
  rc = npy__labels(y, y_path, classes, &d, err);
  if (!rc) rc = npy__images(x, x_path, layout, &d, err);
  if (rc) {
    ps_dataset_free(&d);
    return rc;
  }
  *out = d;
  return PS_OK;
}

static int npy__check_args(ps_dataset *out, int layout, int classes, const char *fn, char *err) {
  if (!out) return ps_seterr(err, PS_EINVAL, "%s: out is NULL", fn);
  memset(out, 0, sizeof *out);
  if (classes < 1 || classes > 256)
    return ps_seterr(err, PS_EINVAL, "%s: classes = %d, expected 1..256", fn, classes);
  if (layout != PS_LAYOUT_NHWC && layout != PS_LAYOUT_NCHW)
    return ps_seterr(err, PS_EINVAL, "%s: unknown layout %d", fn, layout);
  return PS_OK;
}

int ps_dataset_parse_npy(const uint8_t *x, size_t x_len, const char *x_path, const uint8_t *y,
                         size_t y_len, const char *y_path, int layout, int classes, ps_dataset *out,
                         char *err) {
  int rc = npy__check_args(out, layout, classes, "ps_dataset_parse_npy", err);
  if (rc) return rc;
  if (!x || !y || !x_path || !y_path)
    return ps_seterr(err, PS_EINVAL, "ps_dataset_parse_npy: NULL argument");
  npy_array xa, ya;
  rc = npy__parse(x, x_len, x_path, &xa, err);
  if (!rc) rc = npy__parse(y, y_len, y_path, &ya, err);
  if (!rc) rc = npy__dataset(&xa, x_path, &ya, y_path, layout, classes, out, err);
  return rc;
}

/* ---- .npz: the zip container ---- */

/* The central directory's place and size. */
typedef struct {
  const uint8_t *buf;
  size_t len;
  const char *path;
  uint64_t cd_offset, cd_size, entries;
} zip_archive;

/* One central directory entry. */
typedef struct {
  const uint8_t *name;
  size_t name_len;
  uint16_t flags, method;
  uint32_t crc;
  uint64_t csize, usize, local_offset;
} zip_entry;

static int zip__corrupt(const zip_archive *z, const char *what, char *err) {
  return ps_seterr(err, PS_EINVAL, "'%s': corrupt zip archive: %s", z->path, what);
}

/* The zip64 end record that the locator before the end record points at. */
static int zip__open64(zip_archive *z, size_t eocd, char *err) {
  if (eocd < 20 || le32(z->buf + eocd - 20) != ZIP64_LOCATOR)
    return zip__corrupt(z, "zip64 fields without a zip64 locator", err);
  uint64_t off = le64(z->buf + eocd - 20 + 8);
  if (off > eocd - 20 || eocd - 20 - off < 56 || le32(z->buf + off) != ZIP64_EOCD)
    return zip__corrupt(z, "bad zip64 end of central directory", err);
  const uint8_t *r = z->buf + off;
  if (le32(r + 16) != 0 || le32(r + 20) != 0)
    return ps_seterr(err, PS_EINVAL, "'%s': a multi-volume zip archive is not supported", z->path);
  z->entries = le64(r + 32);
  z->cd_size = le64(r + 40);
  z->cd_offset = le64(r + 48);
  return PS_OK;
}

/* Finds the end of central directory record (the last one, within the
 * 64 KiB a comment may take) and, through it, the central directory. */
static int zip__open(zip_archive *z, char *err) {
  if (z->len < 22) {
    if (z->len >= 6 && memcmp(z->buf, NPY_MAGIC, 6) == 0)
      return ps_seterr(err, PS_EINVAL, "'%s': a .npy file, not an .npz archive", z->path);
    return ps_seterr(err, PS_EINVAL, "'%s': bad magic: not a zip archive (.npz)", z->path);
  }
  size_t lo = z->len - 22 > 65535 ? z->len - 22 - 65535 : 0, eocd = SIZE_MAX;
  for (size_t i = z->len - 22 + 1; i-- > lo;) {
    if (le32(z->buf + i) == ZIP_EOCD && i + 22 + le16(z->buf + i + 20) <= z->len) {
      eocd = i;
      break;
    }
  }
  if (eocd == SIZE_MAX) {
    if (memcmp(z->buf, NPY_MAGIC, 6) == 0)
      return ps_seterr(err, PS_EINVAL, "'%s': a .npy file, not an .npz archive", z->path);
    if (le32(z->buf) == ZIP_LOCAL)
      return zip__corrupt(z, "no end of central directory (truncated?)", err);
    return ps_seterr(err, PS_EINVAL, "'%s': bad magic: not a zip archive (.npz)", z->path);
  }
  const uint8_t *e = z->buf + eocd;
  if (le16(e + 4) != 0 || le16(e + 6) != 0)
    return ps_seterr(err, PS_EINVAL, "'%s': a multi-volume zip archive is not supported", z->path);
  z->entries = le16(e + 10);
  z->cd_size = le32(e + 12);
  z->cd_offset = le32(e + 16);
  if (z->entries == 0xffff || z->cd_size == 0xffffffffu || z->cd_offset == 0xffffffffu) {
    int rc = zip__open64(z, eocd, err);
    if (rc) return rc;
  }
  if (z->cd_offset > eocd || z->cd_size > eocd - z->cd_offset)
    return zip__corrupt(z, "central directory outside the file", err);
  /* Each entry takes at least 46 bytes: a count beyond that is a lie. */
  if (z->entries > z->cd_size / 46)
    return zip__corrupt(z, "more entries than the central directory holds", err);
  return PS_OK;
}

/* Reads the zip64 extra field (id 1) of a central entry for the sizes and
 * offset whose 32-bit fields are 0xffffffff, in the order the format sets. */
static int zip__extra64(const zip_archive *z, const uint8_t *extra, size_t len, zip_entry *e,
                        char *err) {
  while (len >= 4) {
    uint16_t id = le16(extra), size = le16(extra + 2);
    if (size > len - 4) break;
    if (id == 1) {
      const uint8_t *p = extra + 4, *end = p + size;
      uint64_t *fields[3] = {&e->usize, &e->csize, &e->local_offset};
      for (int f = 0; f < 3; f++) {
        if (*fields[f] != 0xffffffffu) continue;
        if (end - p < 8) return zip__corrupt(z, "short zip64 extra field", err);
        *fields[f] = le64(p);
        p += 8;
      }
      return PS_OK;
    }
    extra += 4 + size;
    len -= 4 + (size_t)size;
  }
  if (e->usize == 0xffffffffu || e->csize == 0xffffffffu || e->local_offset == 0xffffffffu)
    return zip__corrupt(z, "zip64 sizes without a zip64 extra field", err);
  return PS_OK;
}

/* Entry at *pos of the central directory; advances *pos. */
static int zip__entry(const zip_archive *z, uint64_t *pos, zip_entry *e, char *err) {
  uint64_t left = z->cd_offset + z->cd_size - *pos;
  const uint8_t *p = z->buf + *pos;
  if (left < 46 || le32(p) != ZIP_CENTRAL)
    return zip__corrupt(z, "bad central directory entry", err);
  size_t name_len = le16(p + 28), extra_len = le16(p + 30), comment_len = le16(p + 32);
  if (46 + name_len + extra_len + comment_len > left)
    return zip__corrupt(z, "central directory entry runs past the directory", err);
  e->flags = le16(p + 8);
  e->method = le16(p + 10);
  e->crc = le32(p + 16);
  e->csize = le32(p + 20);
  e->usize = le32(p + 24);
  e->local_offset = le32(p + 42);
  e->name = p + 46;
  e->name_len = name_len;
  *pos += 46 + name_len + extra_len + comment_len;
  return zip__extra64(z, p + 46 + name_len, extra_len, e, err);
}

/* Does the entry hold array `name` ("x" matches "x.npy" and "x")? */
static int zip__matches(const zip_entry *e, const char *name) {
  size_t n = strlen(name);
  if (e->name_len == n) return memcmp(e->name, name, n) == 0;
  return e->name_len == n + 4 && memcmp(e->name, name, n) == 0 &&
         memcmp(e->name + n, ".npy", 4) == 0;
}

/* "a, b, c" of the arrays in the archive (without .npy), cut to fit. */
static void zip__list(const zip_archive *z, char *out, size_t cap) {
  out[0] = '\0';
  uint64_t pos = z->cd_offset;
  char why[PS_ERRLEN];
  for (uint64_t k = 0; k < z->entries; k++) {
    zip_entry e = {0};
    if (zip__entry(z, &pos, &e, why) != 0) break;
    size_t n = e.name_len;
    if (n > 4 && memcmp(e.name + n - 4, ".npy", 4) == 0) n -= 4;
    size_t used = strlen(out);
    if (used + n + 8 >= cap) {
      snprintf(out + used, cap - used, "%s...", used ? ", " : "");
      return;
    }
    snprintf(out + used, cap - used, "%s%.*s", used ? ", " : "", (int)n, (const char *)e.name);
  }
  if (!out[0]) snprintf(out, cap, "none");
}

/* Inflates a raw deflate stream of e->csize bytes into exactly e->usize. */
static int zip__inflate(const zip_archive *z, const char *member, const uint8_t *src,
                        const zip_entry *e, uint8_t *dst, char *err) {
  z_stream s;
  memset(&s, 0, sizeof s);
  if (inflateInit2(&s, -MAX_WBITS) != Z_OK)
    return ps_seterr(err, PS_ENOMEM, "'%s': cannot start zlib", z->path);
  uint64_t in_left = e->csize, out_left = e->usize;
  int zrc = Z_OK;
  s.next_in = (Bytef *)src;
  s.next_out = dst;
  while (zrc == Z_OK) {
    /* zlib counts in unsigned int: at most 1 GiB at a time each way. */
    if (s.avail_in == 0 && in_left > 0) {
      s.avail_in = in_left > (1u << 30) ? 1u << 30 : (uInt)in_left;
      in_left -= s.avail_in;
    }
    if (s.avail_out == 0 && out_left > 0) {
      s.avail_out = out_left > (1u << 30) ? 1u << 30 : (uInt)out_left;
      out_left -= s.avail_out;
    }
    /* Z_BUF_ERROR (no progress possible) ends the loop too: the input ran
     * out, or the output is full with more to come. */
    zrc = inflate(&s, Z_NO_FLUSH);
  }
  const char *why = NULL;
  if (zrc == Z_STREAM_END && s.total_out != e->usize)
    why = "it inflates to fewer bytes than the directory says";
  else if (zrc == Z_BUF_ERROR && s.avail_out == 0 && out_left == 0)
    why = "it inflates to more bytes than the directory says";
  else if (zrc == Z_BUF_ERROR)
    why = "the stream is cut short";
  else if (zrc != Z_STREAM_END)
    why = s.msg ? s.msg : "unknown zlib error";
  char msg[96];
  if (why) snprintf(msg, sizeof msg, "%s", why);
  inflateEnd(&s);
  if (why)
    return ps_seterr(err, PS_EINVAL, "'%s': member '%s': corrupt deflate data: %s", z->path, member,
                     msg);
  return PS_OK;
}

/* CRC-32 of len bytes, in pieces zlib's unsigned int can count. */
static uint32_t zip__crc(const uint8_t *p, uint64_t len) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (len > 0) {
    uInt k = len > (1u << 30) ? 1u << 30 : (uInt)len;
    crc = crc32(crc, p, k);
    p += k;
    len -= k;
  }
  return (uint32_t)crc;
}

/* The bytes of array `name`: *data points into the archive (stored) or to
 * *owned (deflated, malloc'd; the caller frees it). */
static int zip__extract(const zip_archive *z, const char *name, const uint8_t **data, size_t *len,
                        uint8_t **owned, char *err) {
  *owned = NULL;
  uint64_t pos = z->cd_offset;
  zip_entry e = {0};
  int found = 0;
  for (uint64_t k = 0; k < z->entries && !found; k++) {
    int rc = zip__entry(z, &pos, &e, err);
    if (rc) return rc;
    found = zip__matches(&e, name);
  }
  if (!found) {
    char list[120];
    zip__list(z, list, sizeof list);
    return ps_seterr(err, PS_EINVAL, "'%s': no array '%s' in the archive (it holds: %s)", z->path,
                     name, list);
  }
  if (e.flags & 1)
    return ps_seterr(err, PS_EINVAL, "'%s': member '%s' is encrypted", z->path, name);
  if (e.method != 0 && e.method != 8)
    return ps_seterr(err, PS_EINVAL,
                     "'%s': member '%s' uses compression method %u (known: 0 stored, 8 deflate)",
                     z->path, name, e.method);
  /* The local header: only its name and extra lengths are needed. */
  if (e.local_offset > z->len || z->len - e.local_offset < 30 ||
      le32(z->buf + e.local_offset) != ZIP_LOCAL)
    return zip__corrupt(z, "bad local header", err);
  const uint8_t *lh = z->buf + e.local_offset;
  uint64_t start = e.local_offset + 30 + le16(lh + 26) + le16(lh + 28);
  if (start > z->len || e.csize > z->len - start)
    return ps_seterr(err, PS_EINVAL, "'%s': member '%s' is truncated", z->path, name);
  const uint8_t *src = z->buf + start;
  if (e.usize > SIZE_MAX)
    return ps_seterr(err, PS_ERANGE, "'%s': member '%s' too large", z->path, name);
  if (e.method == 0) {
    if (e.usize != e.csize) return zip__corrupt(z, "stored member whose sizes differ", err);
    *data = src;
  } else {
    if (e.usize / DEFLATE_MAX_RATIO > e.csize)
      return zip__corrupt(z, "member claims more than deflate can expand to", err);
    *owned = malloc(e.usize ? (size_t)e.usize : 1);
    if (!*owned) return ps_seterr(err, PS_ENOMEM, "out of memory inflating '%s'", z->path);
    int rc = zip__inflate(z, name, src, &e, *owned, err);
    if (rc) {
      free(*owned);
      *owned = NULL;
      return rc;
    }
    *data = *owned;
  }
  if (zip__crc(*data, e.usize) != e.crc) {
    free(*owned);
    *owned = NULL;
    return ps_seterr(err, PS_EINVAL, "'%s': member '%s' fails its CRC-32 check (corrupt)", z->path,
                     name);
  }
  *len = (size_t)e.usize;
  return PS_OK;
}

int ps_dataset_parse_npz(const uint8_t *buf, size_t len, const char *path, const char *x_name,
                         const char *y_name, int layout, int classes, ps_dataset *out, char *err) {
  int rc = npy__check_args(out, layout, classes, "ps_dataset_parse_npz", err);
  if (rc) return rc;
  if (!buf || !path || !x_name || !y_name)
    return ps_seterr(err, PS_EINVAL, "ps_dataset_parse_npz: NULL argument");
  zip_archive z = {.buf = buf, .len = len, .path = path};
  rc = zip__open(&z, err);
  if (rc) return rc;
  const uint8_t *xd = NULL, *yd = NULL;
  size_t xl = 0, yl = 0;
  uint8_t *xo = NULL, *yo = NULL;
  rc = zip__extract(&z, x_name, &xd, &xl, &xo, err);
  if (!rc) rc = zip__extract(&z, y_name, &yd, &yl, &yo, err);
  /* Messages name the member as "archive:member". */
  char x_path[PATH_MAX], y_path[PATH_MAX];
  snprintf(x_path, sizeof x_path, "%s:%s", path, x_name);
  snprintf(y_path, sizeof y_path, "%s:%s", path, y_name);
  npy_array xa, ya;
  if (!rc) rc = npy__parse(xd, xl, x_path, &xa, err);
  if (!rc) rc = npy__parse(yd, yl, y_path, &ya, err);
  if (!rc) rc = npy__dataset(&xa, x_path, &ya, y_path, layout, classes, out, err);
  free(xo);
  free(yo);
  return rc;
}

/* ---- files ---- */

/* Reads a whole file into a malloc'd buffer (size from fstat: one
 * allocation, no doubling). */
static int npy__read_file(const char *path, const char *kind, uint8_t **out, size_t *len,
                          char *err) {
  *out = NULL;
  *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f)
    return ps_seterr(err, PS_EIO, "cannot open %s file '%s': %s", kind, path, strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > SIZE_MAX) {
    fclose(f);
    return ps_seterr(err, PS_EIO, "%s file '%s': not a regular file", kind, path);
  }
  size_t n = (size_t)st.st_size;
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) {
    fclose(f);
    return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", path);
  }
  size_t got = n ? fread(buf, 1, n, f) : 0;
  int bad = ferror(f);
  fclose(f);
  if (bad || got != n) {
    free(buf);
    return ps_seterr(err, PS_EIO, "%s file '%s': read error", kind, path);
  }
  *out = buf;
  *len = n;
  return PS_OK;
}

int ps_dataset_load_npy(const char *x_path, const char *y_path, int layout, int classes,
                        ps_dataset *out, char *err) {
  int rc = npy__check_args(out, layout, classes, "ps_dataset_load_npy", err);
  if (rc) return rc;
  if (!x_path || !y_path) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_npy: NULL argument");
  uint8_t *x = NULL, *y = NULL;
  size_t xl = 0, yl = 0;
  rc = npy__read_file(x_path, "image", &x, &xl, err);
  if (!rc) rc = npy__read_file(y_path, "label", &y, &yl, err);
  if (!rc) rc = ps_dataset_parse_npy(x, xl, x_path, y, yl, y_path, layout, classes, out, err);
  free(x);
  free(y);
  return rc;
}

int ps_dataset_load_npz(const char *path, const char *x_name, const char *y_name, int layout,
                        int classes, ps_dataset *out, char *err) {
  int rc = npy__check_args(out, layout, classes, "ps_dataset_load_npz", err);
  if (rc) return rc;
  if (!path) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_npz: NULL argument");
  uint8_t *buf = NULL;
  size_t len = 0;
  rc = npy__read_file(path, "npz", &buf, &len, err);
  if (!rc) rc = ps_dataset_parse_npz(buf, len, path, x_name, y_name, layout, classes, out, err);
  free(buf);
  return rc;
}

/* ---- float arrays (weights) ---- */

void ps_np_floats_free(ps_np_floats *w) {
  if (!w) return;
  for (int i = 0; i < w->n; i++) free(w->arrays[i].data);
  free(w->arrays);
  memset(w, 0, sizeof *w);
}

/* Member arr_<i> as float32 into a. */
static int npz__float_member(const zip_archive *z, int i, ps_np_array *a, char *err) {
  char name[32], where[PATH_MAX];
  snprintf(name, sizeof name, "arr_%d", i);
  snprintf(where, sizeof where, "%s:%s", z->path, name);
  const uint8_t *d = NULL;
  size_t len = 0;
  uint8_t *owned = NULL;
  npy_array na;
  int rc = zip__extract(z, name, &d, &len, &owned, err);
  if (!rc) rc = npy__parse(d, len, where, &na, err);
  if (!rc && na.type != NPY_F32 && na.type != NPY_F64)
    rc = ps_seterr(err, PS_EINVAL, "'%s': dtype '%s': float32 or float64 wanted", where, na.descr);
  if (!rc && na.ndim > PS_NP_MAX_DIMS)
    rc = ps_seterr(err, PS_EINVAL, "'%s': %d dimensions (at most %d)", where, na.ndim,
                   PS_NP_MAX_DIMS);
  if (!rc && !(a->data = malloc(na.count ? (size_t)na.count * sizeof(float) : 1)))
    rc = ps_seterr(err, PS_ENOMEM, "out of memory for '%s'", where);
  if (!rc) {
    a->ndim = na.ndim;
    for (int k = 0; k < na.ndim; k++) a->shape[k] = (int64_t)na.shape[k];
    a->count = (size_t)na.count;
    for (uint64_t k = 0; k < na.count; k++) a->data[k] = (float)npy__float(&na, k);
  }
  free(owned);
  return rc;
}

int ps_npz_parse_floats(const uint8_t *buf, size_t len, const char *path, ps_np_floats *out,
                        char *err) {
  memset(out, 0, sizeof *out);
  zip_archive z = {.buf = buf, .len = len, .path = path};
  int rc = zip__open(&z, err);
  if (rc) return rc;
  if (z.entries == 0) return ps_seterr(err, PS_EINVAL, "'%s': an empty archive", path);
  if (z.entries > PS_NP_MAX_ARRAYS)
    return ps_seterr(err, PS_EINVAL, "'%s': %llu members (at most %d)", path,
                     (unsigned long long)z.entries, PS_NP_MAX_ARRAYS);
  /* np.savez(f, *arrays) names them arr_0, arr_1, ...: every member must be
   * one of them. */
  int n = (int)z.entries;
  out->arrays = calloc((size_t)n, sizeof *out->arrays);
  if (!out->arrays) return ps_seterr(err, PS_ENOMEM, "out of memory");
  for (int i = 0; i < n && rc == 0; i++) {
    rc = npz__float_member(&z, i, &out->arrays[i], err);
    if (rc == 0) out->n = i + 1;
  }
  if (rc) ps_np_floats_free(out);
  return rc;
}

int ps_npz_load_floats(const char *path, ps_np_floats *out, char *err) {
  memset(out, 0, sizeof *out);
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = npy__read_file(path, "npz", &buf, &len, err);
  if (!rc) rc = ps_npz_parse_floats(buf, len, path, out, err);
  free(buf);
  return rc;
}

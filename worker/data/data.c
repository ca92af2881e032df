/* Data sets (IDX files, synthetic) and the prefetching batcher, which also
 * augments training examples. Other formats: data_npy.c, data_cifar.c.
 *
 * Buffers of a ps_dataset come from ps_alloc and are released with ps_free,
 * so a caller may also build a dataset by hand (ps_alloc'd) and hand it to
 * ps_dataset_free. */
#include "worker/data/data.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>
#include <zlib.h>

#include "common/rng.h"
#include "common/util.h"

#define IDX_MAGIC_IMAGES 0x00000803u /* unsigned bytes, 3 dimensions */
#define IDX_MAGIC_LABELS 0x00000801u /* unsigned bytes, 1 dimension */

/* Streams of ps_rng_* used by this file ("data" in the high bytes), kept
 * apart from the streams other modules use for initialization or dropout. */
#define STREAM_TEMPLATE 0x6461746100000001ull
#define STREAM_LABEL(split) (0x6461746100000010ull + 16 * (uint64_t)(split))
#define STREAM_NOISE(split) (0x6461746100000011ull + 16 * (uint64_t)(split))
#define STREAM_SHUFFLE 0x6461746100000100ull
#define STREAM_AUGMENT 0x6461746100000200ull

/* Pixel noise of the synthetic set, in units of the [0, 1] pixel range. */
#define SYNTH_NOISE_STDDEV 0.3f

/* ---- IDX files ---- */

/* One open IDX file; `kind` ("image" or "label") goes into messages. */
typedef struct {
  gzFile f;
  const char *path;
  const char *kind;
  uint64_t disk_bytes; /* the file's size on disk */
} idx_file;

static int idx__open(idx_file *x, const char *path, const char *kind, char *err) {
  x->path = path;
  x->kind = kind;
  errno = 0;
  /* gzopen reads plain files unchanged, so gzip is detected from the
   * content (the 1f 8b magic), not from the file name. */
  x->f = gzopen(path, "rb");
  if (!x->f) {
    return ps_seterr(err, errno ? PS_EIO : PS_ENOMEM, "cannot open %s file '%s': %s", kind, path,
                     errno ? strerror(errno) : "out of memory");
  }
  /* A larger buffer than zlib's 8 KiB default halves the load time. */
  gzbuffer(x->f, 1 << 18);
  struct stat st;
  /* A pipe (a FIFO, /dev/stdin, a shell's process substitution) has no
   * size to check against: reading tells. */
  x->disk_bytes = stat(path, &st) == 0 && S_ISREG(st.st_mode) ? (uint64_t)st.st_size : UINT64_MAX;
  return PS_OK;
}

/* Deflate expands at most about 1032:1; anything above this is a header
 * that promises more than the file can hold. */
#define GZIP_MAX_RATIO 1100

/* Whether the file holds the `data` bytes its header promises after the
 * `hdr` bytes of the header: exactly that on disk for a plain file (with
 * the messages reading would give), at most GZIP_MAX_RATIO times the disk
 * size for gzip. Checked before allocating, so a damaged header costs an
 * error, not gigabytes of memory. */
static int idx__can_hold(idx_file *x, uint64_t hdr, uint64_t data, const char *what, char *err) {
  if (x->disk_bytes == UINT64_MAX) return PS_OK; /* not a regular file: reading will tell */
  if (gzdirect(x->f)) {
    if (x->disk_bytes < hdr + data)
      return ps_seterr(err, PS_EINVAL,
                       "%s file '%s': truncated: %s needs %llu bytes, only %llu present", x->kind,
                       x->path, what, (unsigned long long)data,
                       (unsigned long long)(x->disk_bytes - hdr));
    if (x->disk_bytes > hdr + data)
      return ps_seterr(err, PS_EINVAL,
                       "%s file '%s': data continues past the size its header gives; "
                       "header and payload disagree",
                       x->kind, x->path);
    return PS_OK;
  }
  if ((hdr + data) / GZIP_MAX_RATIO <= x->disk_bytes) return PS_OK;
  return ps_seterr(err, PS_EINVAL,
                   "%s file '%s': its header describes %llu bytes of %s, more than %llu "
                   "compressed bytes can hold; the header is corrupt",
                   x->kind, x->path, (unsigned long long)data, what,
                   (unsigned long long)x->disk_bytes);
}

static void idx__close(idx_file *x) {
  if (x->f) gzclose(x->f);
  x->f = NULL;
}

static int idx__zerror(idx_file *x, const char *what, int zerr, const char *zmsg, char *err) {
  if (zerr == Z_ERRNO)
    return ps_seterr(err, PS_EIO, "%s file '%s': cannot read %s: %s", x->kind, x->path, what,
                     strerror(errno));
  /* zlib prefixes its message with the path, which ours already names;
   * and it decodes ahead, so `what` would often name the wrong part. */
  size_t plen = strlen(x->path);
  if (zmsg && strncmp(zmsg, x->path, plen) == 0 && zmsg[plen] == ':') zmsg += plen + 1;
  while (zmsg && *zmsg == ' ') zmsg++;
  return ps_seterr(err, PS_EINVAL, "%s file '%s': corrupt gzip data: %s", x->kind, x->path,
                   zmsg && *zmsg ? zmsg : "unknown zlib error");
}

/* Reads exactly len bytes. A short read, a cut gzip stream or corrupt
 * compressed data is an error; `what` names the part of the file, and the
 * buffer is bytes [before, before+len) of that part of `total` bytes, so a
 * part read in chunks reports its whole size. */
static int idx__read(idx_file *x, void *buf, size_t len, const char *what, size_t before,
                     size_t total, char *err) {
  uint8_t *p = buf;
  size_t done = 0;
  while (done < len) {
    size_t want = len - done;
    if (want > (1u << 30)) want = 1u << 30; /* gzread counts in unsigned int */
    int got = gzread(x->f, p + done, (unsigned)want);
    if (got > 0) {
      done += (size_t)got;
      continue;
    }
    int zerr = Z_OK;
    const char *zmsg = gzerror(x->f, &zerr);
    /* Z_BUF_ERROR is zlib's "unexpected end of file": a truncated file. */
    if (zerr != Z_OK && zerr != Z_BUF_ERROR) return idx__zerror(x, what, zerr, zmsg, err);
    return ps_seterr(err, PS_EINVAL,
                     "%s file '%s': truncated: %s needs %zu bytes, only %zu present", x->kind,
                     x->path, what, total, before + done);
  }
  return PS_OK;
}

/* Fails if anything follows the data: a header whose counts do not match
 * the payload is more likely a broken file than a useful one. */
static int idx__expect_end(idx_file *x, char *err) {
  uint8_t extra;
  /* This read also makes zlib check the gzip trailer (CRC and length). */
  int got = gzread(x->f, &extra, 1);
  if (got < 0) {
    int zerr = Z_OK;
    const char *zmsg = gzerror(x->f, &zerr);
    return idx__zerror(x, "the trailer", zerr, zmsg, err);
  }
  if (got > 0) {
    return ps_seterr(err, PS_EINVAL,
                     "%s file '%s': data continues past the size its header gives; "
                     "header and payload disagree",
                     x->kind, x->path);
  }
  return PS_OK;
}

static uint32_t be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Reads the magic and `ndims` big-endian dimensions; checks the magic. */
static int idx__header(idx_file *x, uint32_t magic, uint32_t *dims, int ndims, char *err) {
  uint8_t hdr[16];
  size_t len = 4 + 4 * (size_t)ndims;
  /* The magic first, so a wrong file is called wrong, not short. */
  int rc = idx__read(x, hdr, 4, "the header", 0, len, err);
  if (rc) return rc;
  uint32_t got = be32(hdr);
  if (got != magic) {
    const char *hint = "not an IDX file, or not of unsigned bytes";
    if (got == IDX_MAGIC_IMAGES || got == IDX_MAGIC_LABELS)
      hint = got == IDX_MAGIC_IMAGES ? "this is an image file; are the paths swapped?"
                                     : "this is a label file; are the paths swapped?";
    return ps_seterr(err, PS_EINVAL, "%s file '%s': bad magic 0x%08x, expected 0x%08x (%s)",
                     x->kind, x->path, got, magic, hint);
  }
  rc = idx__read(x, hdr + 4, len - 4, "the header", 4, len, err);
  if (rc) return rc;
  for (int i = 0; i < ndims; i++) dims[i] = be32(hdr + 4 + 4 * i);
  return PS_OK;
}

/* Converts the pixel bytes through a small staging buffer, so the whole
 * file is never held as bytes and as floats at once. */
static int idx__read_pixels(idx_file *x, float *dst, size_t count, char *err) {
  enum { STAGE = 1 << 16 };
  uint8_t *stage = malloc(STAGE);
  if (!stage) return ps_seterr(err, PS_ENOMEM, "out of memory reading '%s'", x->path);
  /* A table keeps the contract byte/255 exact (multiplying by 1/255.0f
   * rounds differently for some bytes) at the cost of a lookup. */
  float scale[256];
  for (int v = 0; v < 256; v++) scale[v] = (float)v / 255.0f;
  size_t done = 0;
  int rc = PS_OK;
  while (done < count) {
    size_t k = count - done < STAGE ? count - done : STAGE;
    rc = idx__read(x, stage, k, "the pixel data", done, count, err);
    if (rc) break;
    for (size_t i = 0; i < k; i++) dst[done + i] = scale[stage[i]];
    done += k;
  }
  free(stage);
  return rc;
}

/* Reads both open files into d (whose buffers the caller frees, also on
 * error). */
static int idx__load(idx_file *im, idx_file *lb, int classes, ps_dataset *d, char *err) {
  uint32_t idims[3] = {0, 0, 0}, ldims[1] = {0};
  int rc = idx__header(im, IDX_MAGIC_IMAGES, idims, 3, err);
  if (!rc) rc = idx__header(lb, IDX_MAGIC_LABELS, ldims, 1, err);
  if (rc) return rc;

  /* Check the headers against each other before reading megabytes. */
  uint32_t n = idims[0], rows = idims[1], cols = idims[2];
  if (n != ldims[0]) {
    return ps_seterr(err, PS_EINVAL,
                     "counts differ: image file '%s' has %u images but label file '%s' has %u "
                     "labels",
                     im->path, n, lb->path, ldims[0]);
  }
  if (n == 0 || n > INT_MAX || rows == 0 || cols == 0 || rows > 65535 || cols > 65535 ||
      (uint64_t)rows * cols > INT_MAX / 4) {
    return ps_seterr(err, PS_EINVAL, "image file '%s': implausible shape %u x %u x %u in header",
                     im->path, n, rows, cols);
  }
  size_t dim = (size_t)rows * cols;
  if ((uint64_t)n * dim > SIZE_MAX / sizeof(float)) {
    return ps_seterr(err, PS_ERANGE, "image file '%s': %u x %zu pixels do not fit in memory",
                     im->path, n, dim);
  }
  rc = idx__can_hold(im, 16, (uint64_t)n * dim, "the pixel data", err);
  if (!rc) rc = idx__can_hold(lb, 8, n, "the label data", err);
  if (rc) return rc;
  d->n = (int)n;
  d->c = 1;
  d->h = (int)rows;
  d->w = (int)cols;
  d->classes = classes;
  d->images = ps_alloc((size_t)n * dim * sizeof(float));
  d->labels = ps_alloc(n);
  if (!d->images || !d->labels) {
    return ps_seterr(err, PS_ENOMEM, "out of memory loading '%s' (%u images of %u x %u)", im->path,
                     n, rows, cols);
  }
  rc = idx__read_pixels(im, d->images, (size_t)n * dim, err);
  if (!rc) rc = idx__expect_end(im, err);
  if (!rc) rc = idx__read(lb, d->labels, n, "the label data", 0, n, err);
  if (!rc) rc = idx__expect_end(lb, err);
  if (rc) return rc;
  for (uint32_t i = 0; i < n; i++) {
    if (d->labels[i] >= classes) {
      return ps_seterr(err, PS_EINVAL,
                       "label file '%s': label %u of example %u is out of range (classes = %d)",
                       lb->path, d->labels[i], i, classes);
    }
  }
  return PS_OK;
}

/* On error *out is left zeroed and nothing is held. */
int ps_dataset_load_idx(const char *images_path, const char *labels_path, int classes,
                        ps_dataset *out, char *err) {
  if (!out) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_idx: out is NULL");
  memset(out, 0, sizeof *out);
  if (!images_path || !labels_path)
    return ps_seterr(err, PS_EINVAL, "ps_dataset_load_idx: a path is NULL");
  if (classes < 1 || classes > 256)
    return ps_seterr(err, PS_EINVAL, "ps_dataset_load_idx: classes = %d, expected 1..256", classes);

  idx_file im = {0}, lb = {0};
  ps_dataset d = {0};
  int rc = idx__open(&im, images_path, "image", err);
  if (!rc) rc = idx__open(&lb, labels_path, "label", err);
  if (!rc) rc = idx__load(&im, &lb, classes, &d, err);
  idx__close(&im);
  idx__close(&lb);
  if (rc) {
    ps_dataset_free(&d);
  } else {
    *out = d;
  }
  return rc;
}

/* Writes into buf the first of dir/base and dir/base.gz that exists. */
static int named__find(const char *dir, const char *base, char *buf, size_t len, char *err) {
  int k = snprintf(buf, len, "%s/%s", dir, base);
  if (k < 0 || (size_t)k + 3 >= len)
    return ps_seterr(err, PS_EINVAL, "data set path '%s/%s' is too long", dir, base);
  if (access(buf, F_OK) == 0) return PS_OK;
  strcat(buf, ".gz");
  if (access(buf, F_OK) == 0) return PS_OK;
  return ps_seterr(err, PS_EIO, "data set file not found: neither '%s/%s' nor '%s' exists", dir,
                   base, buf);
}

/* 10 classes for both; each file is taken plain if present, else .gz. On
 * error *out is left zeroed; a missing file names both paths tried. */
int ps_dataset_load_named(const char *name, const char *dir, int train, ps_dataset *out,
                          char *err) {
  if (!out) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_named: out is NULL");
  memset(out, 0, sizeof *out);
  if (!name || !dir) return ps_seterr(err, PS_EINVAL, "ps_dataset_load_named: NULL argument");
  /* Both sets share file names and format; only the pictures differ. */
  if (strcmp(name, "fashion-mnist") != 0 && strcmp(name, "mnist") != 0)
    return ps_seterr(err, PS_EINVAL, "unknown data set '%s' (known: fashion-mnist, mnist)", name);
  const char *split = train ? "train" : "t10k";
  char base[32], images[PATH_MAX], labels[PATH_MAX];
  snprintf(base, sizeof base, "%s-images-idx3-ubyte", split);
  int rc = named__find(dir, base, images, sizeof images, err);
  if (rc) return rc;
  snprintf(base, sizeof base, "%s-labels-idx1-ubyte", split);
  rc = named__find(dir, base, labels, sizeof labels, err);
  if (rc) return rc;
  return ps_dataset_load_idx(images, labels, 10, out, err);
}

/* ---- synthetic data ---- */

/* Templates are drawn on a coarse grid of cells (4x4 pixels for 28x28) so
 * that they have spatial structure a CNN with pooling can pick up; pure
 * per-pixel noise templates would be learnable too, but only through the
 * exact pixel positions. */
static int synth__cell(int h, int w) {
  int m = h < w ? h : w;
  return m / 7 > 1 ? m / 7 : 1;
}

/* PS_EINVAL for a bad size, classes outside 1..256 or a negative split,
 * PS_ERANGE if it would not fit in memory, PS_ENOMEM; *out zeroed then.
 * (The signature has no err buffer: the codes say all there is.) */
int ps_dataset_synthetic(int n, int c, int h, int w, int classes, uint64_t seed, int split,
                         ps_dataset *out) {
  if (!out) return PS_EINVAL;
  memset(out, 0, sizeof *out);
  if (n < 1 || c < 1 || h < 1 || w < 1 || classes < 1 || classes > 256 || split < 0)
    return PS_EINVAL;
  if ((int64_t)c * h * w > INT_MAX / 4) return PS_ERANGE;
  size_t dim = (size_t)c * h * w;
  if ((uint64_t)n * dim > SIZE_MAX / sizeof(float)) return PS_ERANGE;

  ps_dataset d = {.n = n, .c = c, .h = h, .w = w, .classes = classes};
  float *templates = ps_alloc((size_t)classes * dim * sizeof(float));
  d.images = ps_alloc((size_t)n * dim * sizeof(float));
  d.labels = ps_alloc((size_t)n);
  if (!templates || !d.images || !d.labels) {
    ps_free(templates);
    ps_dataset_free(&d);
    return PS_ENOMEM;
  }

  /* Templates depend on the seed only, so train and test share them. */
  int cell = synth__cell(h, w);
  int gh = (h + cell - 1) / cell, gw = (w + cell - 1) / cell;
  for (int k = 0; k < classes; k++) {
    float *t = templates + (size_t)k * dim;
    for (int ch = 0; ch < c; ch++) {
      for (int y = 0; y < h; y++) {
        for (int x = 0; x < w; x++) {
          uint64_t cell_id = (((uint64_t)k * c + ch) * gh + y / cell) * gw + x / cell;
          t[((size_t)ch * h + y) * w + x] = ps_rng_uniform(seed, STREAM_TEMPLATE, cell_id);
        }
      }
    }
  }

  /* Labels are drawn, not i % classes: the batcher shards by i % workers,
   * and a worker count that divides the class count would otherwise see
   * only some classes. Noise streams differ per split, so the splits hold
   * different examples. */
  for (int i = 0; i < n; i++) {
    int label = (int)(ps_rng_u64(seed, STREAM_LABEL(split), (uint64_t)i) % (uint64_t)classes);
    d.labels[i] = (uint8_t)label;
    const float *t = templates + (size_t)label * dim;
    float *img = d.images + (size_t)i * dim;
    for (size_t j = 0; j < dim; j++) {
      /* Sum of four 16-bit uniforms (Irwin-Hall): near-normal noise from one
       * hash per pixel, several times cheaper than Box-Muller. */
      uint64_t r = ps_rng_u64(seed, STREAM_NOISE(split), (uint64_t)i * dim + j);
      float s = (float)(r & 0xffff) + (float)(r >> 16 & 0xffff) + (float)(r >> 32 & 0xffff) +
                (float)(r >> 48);
      float noise = (s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f; /* unit variance */
      float v = t[j] + SYNTH_NOISE_STDDEV * noise;
      img[j] = v < 0.0f ? 0.0f : v > 1.0f ? 1.0f : v;
    }
  }
  ps_free(templates);
  *out = d;
  return PS_OK;
}

/* Frees the buffers and zeroes *d; NULL or an already freed set is fine. */
void ps_dataset_free(ps_dataset *d) {
  if (!d) return;
  ps_free(d->images);
  ps_free(d->labels);
  ps_free(d->ids);
  ps_free(d->aug.fill);
  memset(d, 0, sizeof *d);
}

/* ---- batcher ----
 *
 * `depth` batch slots cycle between three owners: the free list (the
 * producer may fill them), the ready queue (filled, in order) and the
 * consumer (between next and release). The producer fills a slot without
 * holding the lock; the slot is its own until it is queued. */

enum { SLOT_FREE, SLOT_FILLING, SLOT_READY, SLOT_HELD };

struct ps_batcher {
  const ps_dataset *ds; /* borrowed: must outlive the batcher, unchanged */
  size_t dim;           /* floats per example */
  int batch_size;
  int rank;
  uint64_t seed;
  int depth;
  int shuffle; /* 0: every epoch in index order */
  ps_host_mem mem;    /* where the slots live */
  ps_chunk_fn source; /* chunk mode: where the examples come from */
  void *source_user;
  uint32_t order_cap;
  uint64_t chunk_tag;
  int ended;

  uint32_t *shard; /* (shard_n) this worker's example indices, ascending */
  uint32_t shard_n;

  ps_batch *slots; /* (depth) */
  int *state;      /* (depth) SLOT_* */
  int *free_list;  /* (depth) stack of free slot numbers */
  int free_count;
  int *ready;     /* (depth) ring of filled slot numbers, oldest first */
  int ready_head; /* position of the oldest in ready */
  int ready_count;
  int held; /* slots the consumer holds */
  int stop;

  uv_mutex_t mu;
  uv_cond_t can_fill; /* a slot became free, or stop */
  uv_cond_t can_take; /* a batch became ready, or stop */
  uv_thread_t thread;
  int mu_ok, fill_ok, take_ok; /* which of the above to destroy */

  /* Producer-only state. */
  uint32_t *order; /* (shard_n) this epoch's permutation of shard */
  int epoch;
  uint32_t pos; /* next position in order */
  int64_t next_index;
};

/* The order of one epoch depends only on (seed, epoch, rank), so a worker
 * restarted at epoch e sees the same sequence it would have seen. */
static void batcher__shuffle(ps_batcher *b) {
  ps_rand r;
  uint64_t key = (uint64_t)(uint32_t)b->rank << 32 | (uint32_t)b->epoch;
  ps_rand_seed(&r, ps_rng_u64(b->seed, STREAM_SHUFFLE, key));
  memcpy(b->order, b->shard, (size_t)b->shard_n * sizeof *b->order);
  if (b->shuffle) ps_rand_shuffle_u32(&r, b->order, b->shard_n);
}

/* Chunk mode: the next chunk into order; 0, or 1 at the end of the data. */
static int batcher__next_chunk(ps_batcher *b) {
  uint64_t begin = 0, tag = 0;
  uint32_t count = 0;
  int epoch = 0;
  int rc = b->source(b->source_user, &begin, &count, &tag, &epoch);
  if (rc != 0 || count == 0 || begin + count > (uint64_t)b->ds->n) return 1;
  if (count > b->order_cap) {
    uint32_t *o = realloc(b->order, (size_t)count * sizeof *o);
    if (!o) return 1;
    b->order = o;
    b->order_cap = count;
  }
  for (uint32_t j = 0; j < count; j++) b->order[j] = (uint32_t)begin + j;
  if (b->shuffle) {
    ps_rand r;
    ps_rand_seed(&r, ps_rng_u64(b->seed, STREAM_SHUFFLE, tag ^ 0x5eed));
    ps_rand_shuffle_u32(&r, b->order, count);
  }
  b->shard_n = count;
  b->chunk_tag = tag;
  b->epoch = epoch;
  return 0;
}

/* Example i of the set, cropped and flipped as ds->aug says, into dst.
 * The draw depends on (seed, epoch, i) only: the same example in the same
 * epoch is augmented alike on any worker, in any batch, at any depth. */
static void batcher__augment(const ps_batcher *b, int epoch, uint32_t i, float *dst) {
  const ps_dataset *ds = b->ds;
  const ps_augment *a = &ds->aug;
  uint64_t r = ps_rng_u64(b->seed, STREAM_AUGMENT, (uint64_t)(uint32_t)epoch << 32 | i);
  int pad = a->crop_pad, span = 2 * pad + 1;
  /* Offsets of the window in [-pad, pad]; independent bits of r for each. */
  int dy = (int)(r % (uint64_t)span) - pad;
  int dx = (int)((r >> 20) % (uint64_t)span) - pad;
  int flip = a->flip && (r >> 63);
  int h = ds->h, w = ds->w;
  const float *src = ds->images + (size_t)i * b->dim;
  for (int ch = 0; ch < ds->c; ch++) {
    float fill = a->fill ? a->fill[ch] : 0.0f;
    const float *plane = src + (size_t)ch * h * w;
    for (int y = 0; y < h; y++) {
      float *row = dst + ((size_t)ch * h + y) * w;
      int sy = y + dy;
      for (int x = 0; x < w; x++) {
        /* The crop first, then the mirror of the cropped window. */
        int sx = (flip ? w - 1 - x : x) + dx;
        row[x] = sy >= 0 && sy < h && sx >= 0 && sx < w ? plane[(size_t)sy * w + sx] : fill;
      }
    }
  }
}

static void batcher__fill(ps_batcher *b, ps_batch *out) {
  if (b->source) {
    if (!b->ended && b->pos == 0 && batcher__next_chunk(b) != 0) b->ended = 1;
    if (b->ended) {
      out->n = 0;
      out->index = b->next_index++;
      out->tag = 0;
      out->last_in_chunk = 0;
      return;
    }
  } else if (b->pos == 0) {
    batcher__shuffle(b);
  }
  uint32_t left = b->shard_n - b->pos;
  int k = left < (uint32_t)b->batch_size ? (int)left : b->batch_size;
  const ps_dataset *ds = b->ds;
  int augment = ds->aug.crop_pad > 0 || ds->aug.flip;
  for (int j = 0; j < k; j++) {
    uint32_t i = b->order[b->pos + (uint32_t)j];
    if (augment)
      batcher__augment(b, b->epoch, i, out->x + (size_t)j * b->dim);
    else
      memcpy(out->x + (size_t)j * b->dim, ds->images + (size_t)i * b->dim,
             b->dim * sizeof(float));
    out->y[j] = ds->labels[i];
    if (ds->n_ids)
      memcpy(out->ids + (size_t)j * ds->n_ids, ds->ids + (size_t)i * ds->n_ids,
             (size_t)ds->n_ids * sizeof(uint64_t));
  }
  out->n = k;
  out->epoch = b->epoch;
  out->index = b->next_index++;
  out->tag = b->chunk_tag;
  b->pos += (uint32_t)k;
  out->last_in_chunk = b->pos == b->shard_n;
  if (b->pos == b->shard_n) {
    b->pos = 0;
    b->epoch++;
  }
}

static void batcher__run(void *arg) {
  ps_batcher *b = arg;
  uv_mutex_lock(&b->mu);
  for (;;) {
    while (b->free_count == 0 && !b->stop) uv_cond_wait(&b->can_fill, &b->mu);
    if (b->stop) break;
    int s = b->free_list[--b->free_count];
    b->state[s] = SLOT_FILLING;
    uv_mutex_unlock(&b->mu);

    batcher__fill(b, &b->slots[s]);

    uv_mutex_lock(&b->mu);
    b->state[s] = SLOT_READY;
    b->ready[(b->ready_head + b->ready_count) % b->depth] = s;
    b->ready_count++;
    uv_cond_signal(&b->can_take);
  }
  uv_mutex_unlock(&b->mu);
}

static void batcher__free(ps_batcher *b) {
  if (b->slots) {
    for (int s = 0; s < b->depth; s++) {
      b->mem.free(b->mem.ctx, b->slots[s].x);
      b->mem.free(b->mem.ctx, b->slots[s].y);
      ps_free(b->slots[s].ids);
    }
  }
  if (b->take_ok) uv_cond_destroy(&b->can_take);
  if (b->fill_ok) uv_cond_destroy(&b->can_fill);
  if (b->mu_ok) uv_mutex_destroy(&b->mu);
  free(b->slots);
  free(b->state);
  free(b->free_list);
  free(b->ready);
  free(b->shard);
  free(b->order);
  free(b);
}

/* The dataset is borrowed and must stay alive and unchanged until
 * ps_batcher_destroy. NULL also when this worker's shard is empty
 * (fewer examples than workers). */
static ps_batcher *batcher__create(const ps_dataset *ds, int batch_size, int rank,
                                   int num_workers, uint64_t seed, int depth, int shuffle,
                                   ps_chunk_fn source, void *user, const ps_host_mem *mem);

ps_batcher *ps_batcher_create_source(const ps_dataset *ds, int batch_size, uint64_t seed,
                                     int depth, ps_chunk_fn source, void *user) {
  return ps_batcher_create_source_in(ds, batch_size, seed, depth, source, user, NULL);
}

ps_batcher *ps_batcher_create_source_in(const ps_dataset *ds, int batch_size, uint64_t seed,
                                        int depth, ps_chunk_fn source, void *user,
                                        const ps_host_mem *mem) {
  if (!source) return NULL;
  return batcher__create(ds, batch_size, 0, 1, seed, depth, 1, source, user, mem);
}

ps_batcher *ps_batcher_create(const ps_dataset *ds, int batch_size, int rank, int num_workers,
                              uint64_t seed, int depth) {
  return ps_batcher_create_ordered(ds, batch_size, rank, num_workers, seed, depth, 1);
}

ps_batcher *ps_batcher_create_ordered(const ps_dataset *ds, int batch_size, int rank,
                                      int num_workers, uint64_t seed, int depth, int shuffle) {
  return batcher__create(ds, batch_size, rank, num_workers, seed, depth, shuffle, NULL, NULL,
                         NULL);
}

ps_batcher *ps_batcher_create_ordered_in(const ps_dataset *ds, int batch_size, int rank,
                                         int num_workers, uint64_t seed, int depth, int shuffle,
                                         const ps_host_mem *mem) {
  return batcher__create(ds, batch_size, rank, num_workers, seed, depth, shuffle, NULL, NULL,
                         mem);
}

static void *plain_alloc(void *ctx, size_t bytes) {
  (void)ctx;
  return ps_alloc(bytes);
}

static void plain_free(void *ctx, void *p) {
  (void)ctx;
  ps_free(p);
}

static ps_batcher *batcher__create(const ps_dataset *ds, int batch_size, int rank,
                                   int num_workers, uint64_t seed, int depth, int shuffle,
                                   ps_chunk_fn source, void *user, const ps_host_mem *mem) {
  if (!ds || !ds->images || !ds->labels || ds->n < 1 || ds->c < 1 || ds->h < 1 || ds->w < 1 ||
      batch_size < 1 || num_workers < 1 || rank < 0 || rank >= num_workers || depth < 1)
    return NULL;
  uint32_t shard_n = (uint32_t)((ds->n - rank + num_workers - 1) / num_workers);
  if (shard_n == 0) return NULL;

  ps_batcher *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->ds = ds;
  b->dim = (size_t)ds->c * ds->h * ds->w;
  b->batch_size = batch_size;
  b->rank = rank;
  b->seed = seed;
  b->depth = depth;
  b->shuffle = shuffle;
  b->mem = mem && mem->alloc && mem->free ? *mem
                                          : (ps_host_mem){.alloc = plain_alloc, .free = plain_free};
  b->source = source;
  b->source_user = user;
  b->shard_n = shard_n;
  b->shard = malloc((size_t)shard_n * sizeof *b->shard);
  b->order = malloc((size_t)shard_n * sizeof *b->order);
  b->order_cap = shard_n;
  b->slots = calloc((size_t)depth, sizeof *b->slots);
  b->state = calloc((size_t)depth, sizeof *b->state);
  b->free_list = calloc((size_t)depth, sizeof *b->free_list);
  b->ready = calloc((size_t)depth, sizeof *b->ready);
  if (!b->shard || !b->order || !b->slots || !b->state || !b->free_list || !b->ready) goto fail;
  for (uint32_t j = 0; j < shard_n; j++) b->shard[j] = (uint32_t)rank + j * (uint32_t)num_workers;
  for (int s = 0; s < depth; s++) {
    b->slots[s].x = b->mem.alloc(b->mem.ctx, (size_t)batch_size * b->dim * sizeof(float));
    b->slots[s].y = b->mem.alloc(b->mem.ctx, (size_t)batch_size);
    if (!b->slots[s].x || !b->slots[s].y) goto fail;
    if (ds->n_ids &&
        !(b->slots[s].ids = ps_alloc((size_t)batch_size * ds->n_ids * sizeof(uint64_t))))
      goto fail;
    b->state[s] = SLOT_FREE;
    /* Pushed in reverse so that slot 0 is filled first (tidier to debug). */
    b->free_list[b->free_count++] = depth - 1 - s;
  }
  b->mu_ok = uv_mutex_init(&b->mu) == 0;
  if (!b->mu_ok) goto fail;
  b->fill_ok = uv_cond_init(&b->can_fill) == 0;
  if (!b->fill_ok) goto fail;
  b->take_ok = uv_cond_init(&b->can_take) == 0;
  if (!b->take_ok) goto fail;
  if (uv_thread_create(&b->thread, batcher__run, b) != 0) goto fail;
  return b;

fail:
  batcher__free(b);
  return NULL;
}

/* Returns 0 and the oldest ready batch; PS_ESTATE without blocking if the
 * consumer already holds all `depth` batches (none could ever become
 * ready), PS_EINVAL on NULL arguments. */
int ps_batcher_next(ps_batcher *b, ps_batch **out) {
  if (!b || !out) return PS_EINVAL;
  *out = NULL;
  uv_mutex_lock(&b->mu);
  while (b->ready_count == 0 && !b->stop) {
    if (b->held == b->depth) {
      uv_mutex_unlock(&b->mu);
      return PS_ESTATE;
    }
    uv_cond_wait(&b->can_take, &b->mu);
  }
  if (b->stop) {
    uv_mutex_unlock(&b->mu);
    return PS_ESTATE;
  }
  int s = b->ready[b->ready_head];
  b->ready_head = (b->ready_head + 1) % b->depth;
  b->ready_count--;
  b->state[s] = SLOT_HELD;
  b->held++;
  uv_mutex_unlock(&b->mu);
  *out = &b->slots[s];
  return PS_OK;
}

/* Hands a batch from ps_batcher_next back for refilling. Batches may be
 * released in any order; a pointer not currently held is ignored. */
void ps_batcher_release(ps_batcher *b, ps_batch *batch) {
  if (!b || !batch || batch < b->slots || batch >= b->slots + b->depth) return;
  int s = (int)(batch - b->slots);
  uv_mutex_lock(&b->mu);
  if (b->state[s] == SLOT_HELD) {
    b->state[s] = SLOT_FREE;
    b->held--;
    b->free_list[b->free_count++] = s;
    uv_cond_signal(&b->can_fill);
  }
  uv_mutex_unlock(&b->mu);
}

int ps_batcher_epoch_size(const ps_batcher *b) { return b ? (int)b->shard_n : 0; }

/* Stops and joins the prefetch thread (it waits at most for the batch it is
 * filling), then frees everything, batches still held included. Must not
 * race with ps_batcher_next or ps_batcher_release. NULL is a no-op. */
void ps_batcher_destroy(ps_batcher *b) {
  if (!b) return;
  uv_mutex_lock(&b->mu);
  b->stop = 1;
  uv_cond_broadcast(&b->can_fill);
  uv_cond_broadcast(&b->can_take);
  uv_mutex_unlock(&b->mu);
  uv_thread_join(&b->thread);
  batcher__free(b);
}

/* The CPU backend: the reference implementation of kernels/ops.h.
 *
 * Convolution is im2col + OpenBLAS sgemm over chunks of the batch, dense
 * layers are sgemm, and everything else is a plain loop.
 *
 * Threads. With threads > 0 the backend computes with that many threads:
 * the caller and threads-1 workers started here. Every op splits its work
 * into static parts (examples of the batch, planes, rows, ranges), one per
 * thread, and OpenBLAS is set to one thread so that each part's sgemm calls
 * run where they are made. On the 2-core target this runs the CNN's
 * convolutions 1.6x to 2x faster than one caller with a 2-thread OpenBLAS,
 * which gains little on sgemms of these shapes (one short dimension of 32 or
 * 64 filters) and leaves the loops around them to one core. Static parts
 * make every result a pure function of the inputs and the thread count.
 * With threads == 0 everything runs in the caller and OpenBLAS keeps its
 * own threading.
 *
 * The ops of one backend must not be called from two threads at once: the
 * workers serve one op at a time. */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rng.h"
#include "../../common/util.h" /* ps_alloc, ps_free */
#include "../ops.h"

/* Scratch floats of one convolution chunk (columns plus sgemm output), per
 * thread. A thread's share of the batch is processed this many floats'
 * worth of examples at a time, so that im2col's output and the sgemm's are
 * still in the core's L2 cache (1 MiB on the target; this is half of it,
 * leaving room for sgemm's packed panels) when they are read again. On the
 * 2-core target with 2 threads, the CNN's convolutions ran 1.5x (first) and
 * 2x (second) faster this way than with one chunk per thread, and it keeps
 * the workspace bounded for any batch size. */
#define CONV_CHUNK_FLOATS ((size_t)128 << 10)

/* Below this many floats (elementwise ops) or multiply-adds (dense) an op
 * runs in the caller: waking the workers costs more than it saves. */
#define PARALLEL_MIN_FLOATS ((size_t)1 << 15)
#define PARALLEL_MIN_MACS ((size_t)1 << 20)

/* One part of an op: part `part` of `parts`. */
typedef void (*part_fn)(void *job, int part, int parts);

typedef struct cpu_backend cpu_backend;

typedef struct {
  cpu_backend *be;
  int part; /* 1..nthreads-1; the caller does part 0 */
  pthread_t tid;
} cpu_worker;

struct cpu_backend {
  ps_ops ops;   /* ops.ctx points back at this struct */
  int nthreads; /* parts each op is split into; 1: all in the caller */
  int nworkers; /* workers started (nthreads - 1 once running) */
  cpu_worker *workers;

  /* The job being run, under mu. Workers wait on `wake` for generation to
   * change, run their part, and the last to finish signals `done`. */
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  part_fn fn;
  void *job;
  unsigned long generation;
  int running; /* workers still in the current job */
  int stop;
  double marks[PS_MARKS]; /* ps_now_s() of each mark; 0: not recorded */
};

/* ---- the thread team ---- */

static void *worker_main(void *arg) {
  cpu_worker *w = arg;
  cpu_backend *be = w->be;
  unsigned long seen = 0;
  pthread_mutex_lock(&be->mu);
  for (;;) {
    while (!be->stop && be->generation == seen) pthread_cond_wait(&be->wake, &be->mu);
    if (be->stop) break;
    seen = be->generation;
    part_fn fn = be->fn;
    void *job = be->job;
    pthread_mutex_unlock(&be->mu);
    fn(job, w->part, be->nthreads);
    pthread_mutex_lock(&be->mu);
    if (--be->running == 0) pthread_cond_signal(&be->done);
  }
  pthread_mutex_unlock(&be->mu);
  return NULL;
}

/* Runs fn(job, p, nthreads) for every part p, part 0 in the caller, and
 * returns when all are done; or fn(job, 0, 1) in the caller when the team
 * is one thread or the op is too small to be worth splitting. */
static void run_parts(cpu_backend *be, int worth_splitting, part_fn fn, void *job) {
  if (be->nthreads == 1 || !worth_splitting) {
    fn(job, 0, 1);
    return;
  }
  pthread_mutex_lock(&be->mu);
  be->fn = fn;
  be->job = job;
  be->running = be->nworkers;
  be->generation++;
  pthread_cond_broadcast(&be->wake);
  pthread_mutex_unlock(&be->mu);
  fn(job, 0, be->nthreads);
  pthread_mutex_lock(&be->mu);
  while (be->running > 0) pthread_cond_wait(&be->done, &be->mu);
  pthread_mutex_unlock(&be->mu);
}

/* [*begin, *end): part `part` of n items cut into `parts` near-equal runs. */
static void part_range(size_t n, int part, int parts, size_t *begin, size_t *end) {
  *begin = n * (size_t)part / (size_t)parts;
  *end = n * (size_t)(part + 1) / (size_t)parts;
}

/* ---- loops over float arrays ----
 *
 * Written so that GCC vectorizes them at every build type. At -O2 (the
 * default build type, RelWithDebInfo) GCC 12 vectorizes a loop only if the
 * vector code replaces it whole: no runtime check that its arrays do not
 * overlap, and a trip count known to be a multiple of the vector width. So
 * the arrays are restrict parameters (callers pass arrays that do not
 * overlap), and each loop runs over vec_floor(n) elements, whose low zero
 * bits GCC can see, before a tail loop of fewer than VEC_FLOATS. A select
 * in such a loop becomes a compare and a mask, never a branch.
 *
 * Not a loop over a block of a few floats, as this file had: that is
 * vectorized at -O2, but -O3 (Release) unrolls loops of a small constant
 * count completely before the vectorizer runs, which leaves scalar code and,
 * for relu, a branch per element that random signs mispredict half the
 * time: in a Release build relu took 10 ms instead of 0.7 on conv1's
 * output, and training ran at 0.80 of the default build's speed
 * (tests/bench/build_types.sh).
 *
 * Loops marked with a trailing "vectorized" comment are checked by the
 * test unit.kernels_vectorized (tests/bench/check_vectorized.sh): GCC must
 * report each of them vectorized at -O2 and at -O3, wherever it is
 * inlined. */

/* A multiple of every x86 vector width in floats (4, 8, 16). */
enum { VEC_FLOATS = 16 };

/* n rounded down to a multiple of VEC_FLOATS. */
static inline size_t vec_floor(size_t n) { return n / VEC_FLOATS * VEC_FLOATS; }

/* dst[i] = src[i] + bias. Not inlined: in the loops of conv_forward_part,
 * GCC turns the inlined loop's guard into n > 15, no longer sees that the
 * trip count is a multiple of the vector width, and leaves it scalar at
 * -O2. */
__attribute__((noinline)) static void add_scalar(float *restrict dst, const float *restrict src,
                                                 size_t n, float bias) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) dst[i] = src[i] + bias; /* vectorized */
  for (size_t i = nv; i < n; i++) dst[i] = src[i] + bias;
}

/* dst[i] += src[i] */
static void add_into(float *restrict dst, const float *restrict src, size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) dst[i] += src[i]; /* vectorized */
  for (size_t i = nv; i < n; i++) dst[i] += src[i];
}

/* The sum of a[0..n), in SUM_LANES partial sums so the adds do not wait on
 * each other: lane k sums a[k], a[k + SUM_LANES], ... in order, then the
 * lanes are added in order, then the tail; the same sum at every build type
 * and vector width. The inner loop is the one vectorized: `unroll 1` keeps
 * -O3 from unrolling it into its outer loop first (which -O3 would then
 * vectorize instead, to the same code), so one loop is checked for both. */
enum { SUM_LANES = 8 };

static float sum_floats(const float *a, size_t n) {
  float part[SUM_LANES] = {0};
  const size_t nv = n - n % SUM_LANES;
  for (size_t i = 0; i < nv; i += SUM_LANES)
#pragma GCC unroll 1
    for (int k = 0; k < SUM_LANES; k++) part[k] += a[i + k]; /* vectorized */
  float sum = 0.0f;
  for (int k = 0; k < SUM_LANES; k++) sum += part[k];
  for (size_t i = nv; i < n; i++) sum += a[i];
  return sum;
}

/* ---- convolution ---- */

/* Rows of the column matrix: one per (ic, kh, kw), the weights' order. */
static size_t conv_rows(const ps_conv_shape *s) { return (size_t)s->c * s->kh * s->kw; }

static size_t conv_out_plane(const ps_conv_shape *s) { return (size_t)s->oh * s->ow; }

/* Examples per chunk: as many of a thread's share of the batch as fit in
 * CONV_CHUNK_FLOATS, at least one. */
static int conv_chunk(const ps_conv_shape *s, int nthreads) {
  size_t share = ((size_t)s->n + (size_t)nthreads - 1) / (size_t)nthreads;
  size_t per_example = (conv_rows(s) + (size_t)s->oc) * conv_out_plane(s);
  size_t fit = per_example ? CONV_CHUNK_FLOATS / per_example : share;
  size_t chunk = fit < share ? fit : share;
  return chunk > 0 ? (int)chunk : 1;
}

/* A thread's workspace: a chunk's columns (C*KH*KW, chunk*OH*OW), the
 * sgemm output or dy gathered channel-major (OC, chunk*OH*OW), and from
 * conv_part_grads on, the thread's share of dW (OC, C*KH*KW) and db (OC). */
static size_t conv_part_grads(const ps_conv_shape *s, int chunk) {
  return (size_t)chunk * (conv_rows(s) + (size_t)s->oc) * conv_out_plane(s);
}

static size_t conv_part_floats(const ps_conv_shape *s, int chunk) {
  return conv_part_grads(s, chunk) + (size_t)s->oc * conv_rows(s) + (size_t)s->oc;
}

/* For kernel offset k, the outputs o in [*lo, *hi) whose input position
 * o*stride - pad + k lies inside [0, in); the others read padding. */
static void conv_valid_range(int in, int out, int k, int stride, int pad, int *lo, int *hi) {
  int first = pad - k; /* o*stride must reach this for the position to be >= 0 */
  int last = in - 1 + pad - k;
  *lo = first > 0 ? (first + stride - 1) / stride : 0;
  *hi = last >= 0 ? last / stride + 1 : 0;
  if (*hi > out) *hi = out;
  if (*lo > *hi) *lo = *hi;
}

/* The (OH, OW) block of the columns for tap (kh, kw) of one input plane
 * xp (H, W): dst[oh][ow] = xp[oh*stride - pad + kh][ow*stride - pad + kw],
 * or 0 where that falls in the padding. */
static void im2col_block(const ps_conv_shape *s, int kh, int kw, const float *xp, float *dst) {
  const int stride = s->stride, pad = s->pad, ow_n = s->ow;
  const size_t ohw = conv_out_plane(s);
  int oh_lo, oh_hi, ow_lo, ow_hi;
  conv_valid_range(s->h, s->oh, kh, stride, pad, &oh_lo, &oh_hi);
  conv_valid_range(s->w, ow_n, kw, stride, pad, &ow_lo, &ow_hi);
  if (oh_lo == oh_hi || ow_lo == ow_hi) {
    memset(dst, 0, ohw * sizeof(float));
    return;
  }
  if (stride == 1 && ow_n == s->w) {
    /* "Same" padding, stride 1: the block is the plane shifted by
     * (kh - pad, kw - pad), so one copy of the span from the first to the
     * last valid entry does it; the entries of that span left of ow_lo or
     * right of ow_hi wrapped around from a neighbouring row, and are
     * padding. One memcpy per block instead of one per row. */
    const ptrdiff_t shift = (ptrdiff_t)(kh - pad) * s->w + (kw - pad);
    const size_t f0 = (size_t)oh_lo * ow_n + ow_lo, f1 = (size_t)(oh_hi - 1) * ow_n + ow_hi;
    memset(dst, 0, f0 * sizeof(float));
    memcpy(dst + f0, xp + (ptrdiff_t)f0 + shift, (f1 - f0) * sizeof(float));
    memset(dst + f1, 0, (ohw - f1) * sizeof(float));
    for (int oh = oh_lo; oh < oh_hi; oh++) {
      float *d = dst + (size_t)oh * ow_n;
      for (int ow = 0; ow < ow_lo; ow++) d[ow] = 0.0f;
      for (int ow = ow_hi; ow < ow_n; ow++) d[ow] = 0.0f;
    }
    return;
  }
  for (int oh = 0; oh < s->oh; oh++) {
    float *d = dst + (size_t)oh * ow_n;
    if (oh < oh_lo || oh >= oh_hi) {
      memset(d, 0, (size_t)ow_n * sizeof(float));
      continue;
    }
    const float *src = xp + (size_t)(oh * stride - pad + kh) * s->w - pad + kw;
    for (int ow = 0; ow < ow_lo; ow++) d[ow] = 0.0f;
    for (int ow = ow_lo; ow < ow_hi; ow++) d[ow] = src[(size_t)ow * stride];
    for (int ow = ow_hi; ow < ow_n; ow++) d[ow] = 0.0f;
  }
}

/* The adjoint of im2col_block: dxp (H, W) += the entries of the block that
 * came from it. The block is scratch and may be changed. */
static void col2im_block(const ps_conv_shape *s, int kh, int kw, float *block, float *dxp) {
  const int stride = s->stride, pad = s->pad, ow_n = s->ow;
  int oh_lo, oh_hi, ow_lo, ow_hi;
  conv_valid_range(s->h, s->oh, kh, stride, pad, &oh_lo, &oh_hi);
  conv_valid_range(s->w, ow_n, kw, stride, pad, &ow_lo, &ow_hi);
  if (oh_lo == oh_hi || ow_lo == ow_hi) return;
  if (stride == 1 && ow_n == s->w) {
    /* As in im2col_block: one add over the span, with the wrapped-around
     * entries (padding taps, whose gradient goes nowhere) zeroed first. */
    const ptrdiff_t shift = (ptrdiff_t)(kh - pad) * s->w + (kw - pad);
    const size_t f0 = (size_t)oh_lo * ow_n + ow_lo, f1 = (size_t)(oh_hi - 1) * ow_n + ow_hi;
    for (int oh = oh_lo; oh < oh_hi; oh++) {
      float *d = block + (size_t)oh * ow_n;
      for (int ow = 0; ow < ow_lo; ow++) d[ow] = 0.0f;
      for (int ow = ow_hi; ow < ow_n; ow++) d[ow] = 0.0f;
    }
    add_into(dxp + (ptrdiff_t)f0 + shift, block + f0, f1 - f0);
    return;
  }
  for (int oh = oh_lo; oh < oh_hi; oh++) {
    const float *d = block + (size_t)oh * ow_n;
    float *dst = dxp + (size_t)(oh * stride - pad + kh) * s->w - pad + kw;
    for (int ow = ow_lo; ow < ow_hi; ow++) dst[(size_t)ow * stride] += d[ow];
  }
}

/* col (C*KH*KW, m*OH*OW) from x (m, C, H, W): column i*OH*OW + oh*OW + ow
 * holds the input patch under output pixel (oh, ow) of example i, with
 * zeros where the patch hangs over the padding. Example-major outer loops
 * keep each input plane in L1 while its KH*KW blocks are written. */
static void im2col(const ps_conv_shape *s, int m, const float *x, float *col) {
  const size_t plane = (size_t)s->h * s->w, ohw = conv_out_plane(s);
  const size_t ld = (size_t)m * ohw; /* row stride of col */
  for (int i = 0; i < m; i++) {
    for (int c = 0; c < s->c; c++) {
      const float *xp = x + ((size_t)i * s->c + c) * plane; /* (H, W) */
      for (int kh = 0; kh < s->kh; kh++) {
        for (int kw = 0; kw < s->kw; kw++) {
          size_t row = ((size_t)c * s->kh + kh) * s->kw + kw;
          im2col_block(s, kh, kw, xp, col + row * ld + (size_t)i * ohw);
        }
      }
    }
  }
}

/* dx (m, C, H, W) = the sum, over the column entries that im2col copied from
 * each input position, of dcol (C*KH*KW, m*OH*OW); entries that came from
 * padding are dropped. dx is overwritten; dcol is scratch and is changed. */
static void col2im(const ps_conv_shape *s, int m, float *dcol, float *dx) {
  const size_t plane = (size_t)s->h * s->w, ohw = conv_out_plane(s);
  const size_t ld = (size_t)m * ohw;
  memset(dx, 0, (size_t)m * s->c * plane * sizeof(float));
  for (int i = 0; i < m; i++) {
    for (int c = 0; c < s->c; c++) {
      float *dxp = dx + ((size_t)i * s->c + c) * plane; /* (H, W) */
      for (int kh = 0; kh < s->kh; kh++) {
        for (int kw = 0; kw < s->kw; kw++) {
          size_t row = ((size_t)c * s->kh + kh) * s->kw + kw;
          col2im_block(s, kh, kw, dcol + row * ld + (size_t)i * ohw, dxp);
        }
      }
    }
  }
}

typedef struct {
  const ps_conv_shape *s;
  const float *x, *w, *b, *dy;
  float *y, *dx, *dw, *db;
  float *work;        /* part p's scratch starts at work + p * part_floats */
  size_t part_floats; /* conv_part_floats(s, chunk) */
  int chunk;          /* examples per im2col */
} conv_job;

static void conv_forward_part(void *arg, int part, int parts) {
  const conv_job *j = arg;
  const ps_conv_shape *s = j->s;
  const size_t rows = conv_rows(s), ohw = conv_out_plane(s);
  const size_t in_example = (size_t)s->c * s->h * s->w, out_example = (size_t)s->oc * ohw;
  size_t first, end;
  part_range((size_t)s->n, part, parts, &first, &end);
  for (size_t n0 = first; n0 < end; n0 += (size_t)j->chunk) {
    const int m = end - n0 < (size_t)j->chunk ? (int)(end - n0) : j->chunk;
    const size_t ld = (size_t)m * ohw;
    float *col = j->work + (size_t)part * j->part_floats; /* (C*KH*KW, m*OH*OW) */
    float *out = col + rows * ld;                         /* (OC, m*OH*OW) */
    im2col(s, m, j->x + n0 * in_example, col);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s->oc, (int)ld, (int)rows, 1.0f, j->w,
                (int)rows, col, (int)ld, 0.0f, out, (int)ld);
    /* out is channel-major over the chunk; y wants example-major. The bias
     * is added in this one copy instead of in a pass of its own. */
    for (int i = 0; i < m; i++) {
      float *yi = j->y + (n0 + (size_t)i) * out_example; /* (OC, OH*OW) */
      for (int oc = 0; oc < s->oc; oc++)
        add_scalar(yi + oc * ohw, out + oc * ld + i * ohw, ohw, j->b[oc]);
    }
  }
}

/* Overwrites this part's share of dW and db (in its scratch) and its
 * examples' rows of dx. */
static void conv_backward_part(void *arg, int part, int parts) {
  const conv_job *j = arg;
  const ps_conv_shape *s = j->s;
  const size_t rows = conv_rows(s), ohw = conv_out_plane(s), oc_n = (size_t)s->oc;
  const size_t in_example = (size_t)s->c * s->h * s->w, out_example = oc_n * ohw;
  float *scratch = j->work + (size_t)part * j->part_floats;
  float *dw_part = scratch + conv_part_grads(s, j->chunk); /* (OC, C*KH*KW) */
  float *db_part = dw_part + oc_n * rows;                  /* (OC) */
  size_t first, end;
  part_range((size_t)s->n, part, parts, &first, &end);
  memset(db_part, 0, oc_n * sizeof(float));
  if (first == end) memset(dw_part, 0, oc_n * rows * sizeof(float));
  for (size_t n0 = first; n0 < end; n0 += (size_t)j->chunk) {
    const int m = end - n0 < (size_t)j->chunk ? (int)(end - n0) : j->chunk;
    const size_t ld = (size_t)m * ohw;
    float *col = scratch;          /* (C*KH*KW, m*OH*OW); later dcol */
    float *dyt = col + rows * ld;  /* (OC, m*OH*OW) */
    /* The forward's columns are not kept (work is shared scratch), so they
     * are rebuilt; that is one cheap pass next to the two sgemms. */
    im2col(s, m, j->x + n0 * in_example, col);
    /* dy channel-major, so dW is one sgemm over every column of the chunk;
     * db is summed in the same pass. */
    for (int i = 0; i < m; i++) {
      const float *dyi = j->dy + (n0 + (size_t)i) * out_example; /* (OC, OH*OW) */
      for (size_t oc = 0; oc < oc_n; oc++) {
        const float *src = dyi + oc * ohw;
        memcpy(dyt + oc * ld + i * ohw, src, ohw * sizeof(float));
        db_part[oc] += sum_floats(src, ohw);
      }
    }
    /* dW (OC, C*KH*KW) (+)= dyt (OC, m*OH*OW) col^T; the first chunk
     * overwrites, later chunks accumulate. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s->oc, (int)rows, (int)ld, 1.0f, dyt,
                (int)ld, col, (int)ld, n0 == first ? 0.0f : 1.0f, dw_part, (int)rows);
    if (j->dx) {
      /* dcol (C*KH*KW, m*OH*OW) = W^T dyt, written over the columns, which
       * are no longer needed. */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)rows, (int)ld, s->oc, 1.0f, j->w,
                  (int)rows, dyt, (int)ld, 0.0f, col, (int)ld);
      col2im(s, m, col, j->dx + n0 * in_example);
    }
  }
}

static size_t cpu_conv2d_workspace(void *ctx, const ps_conv_shape *s) {
  const cpu_backend *be = ctx;
  return (size_t)be->nthreads * conv_part_floats(s, conv_chunk(s, be->nthreads));
}

static void cpu_conv2d_forward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                               const float *b, float *y, float *work) {
  cpu_backend *be = ctx;
  const int chunk = conv_chunk(s, be->nthreads);
  conv_job job = {.s = s, .x = x, .w = w, .b = b, .y = y, .work = work,
                  .part_floats = conv_part_floats(s, chunk), .chunk = chunk};
  run_parts(be, s->n > 1, conv_forward_part, &job);
}

static void cpu_conv2d_backward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                                const float *dy, float *dx, float *dw, float *db, float *work) {
  cpu_backend *be = ctx;
  const int chunk = conv_chunk(s, be->nthreads);
  conv_job job = {.s = s, .x = x, .w = w, .dy = dy, .dx = dx, .work = work,
                  .part_floats = conv_part_floats(s, chunk), .chunk = chunk};
  /* Each part leaves its dW and db in its scratch; they are summed here in
   * part order, so the result does not depend on which thread ran first. */
  const int parts = be->nthreads > 1 && s->n > 1 ? be->nthreads : 1;
  run_parts(be, parts > 1, conv_backward_part, &job);
  const size_t nw = (size_t)s->oc * conv_rows(s);
  for (int p = 0; p < parts; p++) {
    const float *dw_part = work + (size_t)p * job.part_floats + conv_part_grads(s, chunk);
    if (p == 0) {
      memcpy(dw, dw_part, nw * sizeof(float));
      memcpy(db, dw_part + nw, (size_t)s->oc * sizeof(float));
    } else {
      add_into(dw, dw_part, nw);
      add_into(db, dw_part + nw, (size_t)s->oc);
    }
  }
}

/* ---- max pooling ---- */

typedef struct {
  const ps_pool_shape *s;
  const float *x, *dy;
  float *y, *dx;
  int32_t *argmax;
  const int32_t *argmax_in;
} pool_job;

/* Moves the running maximum (*best, *best_v) to tap `at` of xp if that is
 * greater. */
static inline void max_tap(const float *xp, int at, int *best, float *best_v) {
  const float v = xp[at];
  const int better = v > *best_v;
  *best = better ? at : *best;
  *best_v = better ? v : *best_v;
}

/* 2x2 windows with stride 2, the common pooling, one output row at a time
 * (the row's first window starts at xp[top]) over its first windows, a
 * multiple of POOL_VEC of them: GCC vectorizes these loops at -O2 as at -O3
 * (see "loops over float arrays"); with the stride a constant, each tap of
 * consecutive windows is every other float of a row, loaded as whole
 * vectors and split into even and odd. Both return how many windows they
 * did; the callers do the rest of the row one window at a time, with the
 * same selects in the same order. */
enum { POOL_VEC = 4 };

static int maxpool2_forward_row(const float *restrict xp, int top, int w, int ow_n,
                                float *restrict y, int32_t *restrict argmax) {
  const int nv = ow_n & ~(POOL_VEC - 1);
  for (int ow = 0; ow < nv; ow++) { /* vectorized */
    const int first = top + 2 * ow;
    int best = first;
    float best_v = xp[first];
    max_tap(xp, first + 1, &best, &best_v);
    max_tap(xp, first + w, &best, &best_v);
    max_tap(xp, first + w + 1, &best, &best_v);
    y[ow] = best_v;
    argmax[ow] = best;
  }
  return nv;
}

/* The windows do not overlap, so each tap of the zeroed plane gets at most
 * one window's gradient: assigned here as 0 + dy (as the scatter in
 * maxpool_backward_part adds it: a -0 gradient lands as +0) where the tap
 * was the maximum, else 0 again. dx_top is the plane's row `top` / w, and
 * dx_bottom the row below it: as two restrict rows, GCC needs no check that
 * the stores to one do not overlap the other's. */
static int maxpool2_backward_row(float *restrict dx_top, float *restrict dx_bottom, int top, int w,
                                 int ow_n, const float *restrict dy,
                                 const int32_t *restrict argmax) {
  const int nv = ow_n & ~(POOL_VEC - 1);
  for (int ow = 0; ow < nv; ow++) { /* vectorized */
    const int first = top + 2 * ow;
    const float g = 0.0f + dy[ow];
    dx_top[2 * ow] = argmax[ow] == first ? g : 0.0f;
    dx_top[2 * ow + 1] = argmax[ow] == first + 1 ? g : 0.0f;
    dx_bottom[2 * ow] = argmax[ow] == first + w ? g : 0.0f;
    dx_bottom[2 * ow + 1] = argmax[ow] == first + w + 1 ? g : 0.0f;
  }
  return nv;
}

/* The maximum is kept in locals and updated with selects, which GCC turns
 * into maxss and cmov (or, in maxpool2_forward_row, vector compares and
 * masks): after a relu, which input of a window wins is a coin toss, and a
 * branch there is mispredicted half the time (a select on the output
 * arrays instead compiles to such a branch, 2.5x slower). Later taps
 * replace the maximum only when greater, so ties keep the first in
 * row-major order. */
static void maxpool_forward_part(void *arg, int part, int parts) {
  const pool_job *j = arg;
  const ps_pool_shape *s = j->s;
  const int stride = s->stride, size = s->size, w = s->w;
  const int pairs = size == 2 && stride == 2; /* maxpool2_forward_row's windows */
  const size_t in_plane = (size_t)s->h * w, out_plane = (size_t)s->oh * s->ow;
  size_t first, end;
  part_range((size_t)s->n * s->c, part, parts, &first, &end);
  for (size_t p = first; p < end; p++) {
    const float *xp = j->x + p * in_plane; /* (H, W) */
    float *yp = j->y + p * out_plane;      /* (OH, OW) */
    int32_t *ap = j->argmax + p * out_plane;
    for (int oh = 0; oh < s->oh; oh++) {
      float *y_row = yp + (size_t)oh * s->ow;
      int32_t *a_row = ap + (size_t)oh * s->ow;
      int ow = pairs ? maxpool2_forward_row(xp, oh * 2 * w, w, s->ow, y_row, a_row) : 0;
      for (; ow < s->ow; ow++) {
        const int top = oh * stride * w + ow * stride; /* the window's first tap */
        int best = top;
        float best_v = xp[top];
        if (size == 2) {
          /* The common window, spelled out: 1.8x faster than the loops. */
          max_tap(xp, top + 1, &best, &best_v);
          max_tap(xp, top + w, &best, &best_v);
          max_tap(xp, top + w + 1, &best, &best_v);
        } else {
          for (int kh = 0; kh < size; kh++)
            for (int kw = 0; kw < size; kw++) max_tap(xp, top + kh * w + kw, &best, &best_v);
        }
        y_row[ow] = best_v;
        a_row[ow] = best;
      }
    }
  }
}

/* Overlapping windows (stride < size) can pick the same input, so the
 * gradient is accumulated into a zeroed plane rather than assigned. */
static void maxpool_backward_part(void *arg, int part, int parts) {
  const pool_job *j = arg;
  const ps_pool_shape *s = j->s;
  const int pairs = s->size == 2 && s->stride == 2; /* maxpool2_backward_row's windows */
  const size_t in_plane = (size_t)s->h * s->w, out_plane = (size_t)s->oh * s->ow;
  size_t first, end;
  part_range((size_t)s->n * s->c, part, parts, &first, &end);
  for (size_t p = first; p < end; p++) {
    float *dxp = j->dx + p * in_plane;
    const float *dyp = j->dy + p * out_plane;
    const int32_t *ap = j->argmax_in + p * out_plane;
    memset(dxp, 0, in_plane * sizeof(float));
    for (int oh = 0; oh < s->oh; oh++) {
      const size_t row = (size_t)oh * s->ow;
      const int top = oh * 2 * s->w;
      int ow = pairs ? maxpool2_backward_row(dxp + top, dxp + top + s->w, top, s->w, s->ow,
                                             dyp + row, ap + row)
                     : 0;
      for (; ow < s->ow; ow++) dxp[ap[row + ow]] += dyp[row + ow];
    }
  }
}

static void cpu_maxpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                                int32_t *argmax) {
  pool_job job = {.s = s, .x = x, .y = y, .argmax = argmax};
  size_t floats = (size_t)s->n * s->c * s->h * s->w;
  run_parts(ctx, floats >= PARALLEL_MIN_FLOATS, maxpool_forward_part, &job);
}

static void cpu_maxpool_backward(void *ctx, const ps_pool_shape *s, const float *dy,
                                 const int32_t *argmax, float *dx) {
  pool_job job = {.s = s, .dy = dy, .dx = dx, .argmax_in = argmax};
  size_t floats = (size_t)s->n * s->c * s->h * s->w;
  run_parts(ctx, floats >= PARALLEL_MIN_FLOATS, maxpool_backward_part, &job);
}

/* ---- average pooling ----
 *
 * The arithmetic every backend repeats to the bit (ops.h): a window's taps
 * summed from 0 in row-major order, then divided by the tap count; backward
 * adds each window's share to a zeroed plane, windows in (oh, ow) order. */

static void avgpool_forward_part(void *arg, int part, int parts) {
  const pool_job *j = arg;
  const ps_pool_shape *s = j->s;
  const float area = (float)(s->size * s->size);
  const size_t in_plane = (size_t)s->h * s->w, out_plane = (size_t)s->oh * s->ow;
  size_t first, end;
  part_range((size_t)s->n * s->c, part, parts, &first, &end);
  for (size_t p = first; p < end; p++) {
    const float *xp = j->x + p * in_plane; /* (H, W) */
    float *yp = j->y + p * out_plane;      /* (OH, OW) */
    for (int oh = 0; oh < s->oh; oh++) {
      for (int ow = 0; ow < s->ow; ow++) {
        const float *top = xp + (size_t)oh * s->stride * s->w + (size_t)ow * s->stride;
        float sum = 0.0f;
        for (int kh = 0; kh < s->size; kh++)
          for (int kw = 0; kw < s->size; kw++) sum += top[(size_t)kh * s->w + kw];
        yp[(size_t)oh * s->ow + ow] = sum / area;
      }
    }
  }
}

static void avgpool_backward_part(void *arg, int part, int parts) {
  const pool_job *j = arg;
  const ps_pool_shape *s = j->s;
  const float area = (float)(s->size * s->size);
  const size_t in_plane = (size_t)s->h * s->w, out_plane = (size_t)s->oh * s->ow;
  size_t first, end;
  part_range((size_t)s->n * s->c, part, parts, &first, &end);
  for (size_t p = first; p < end; p++) {
    float *dxp = j->dx + p * in_plane;
    const float *dyp = j->dy + p * out_plane;
    memset(dxp, 0, in_plane * sizeof(float));
    for (int oh = 0; oh < s->oh; oh++) {
      for (int ow = 0; ow < s->ow; ow++) {
        float *top = dxp + (size_t)oh * s->stride * s->w + (size_t)ow * s->stride;
        const float g = dyp[(size_t)oh * s->ow + ow] / area;
        for (int kh = 0; kh < s->size; kh++)
          for (int kw = 0; kw < s->size; kw++) top[(size_t)kh * s->w + kw] += g;
      }
    }
  }
}

static void cpu_avgpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y) {
  pool_job job = {.s = s, .x = x, .y = y};
  size_t floats = (size_t)s->n * s->c * s->h * s->w;
  run_parts(ctx, floats >= PARALLEL_MIN_FLOATS, avgpool_forward_part, &job);
}

static void cpu_avgpool_backward(void *ctx, const ps_pool_shape *s, const float *dy, float *dx) {
  pool_job job = {.s = s, .dy = dy, .dx = dx};
  size_t floats = (size_t)s->n * s->c * s->h * s->w;
  run_parts(ctx, floats >= PARALLEL_MIN_FLOATS, avgpool_backward_part, &job);
}

/* Global average pooling: one (H, W) plane per output, its mean. */
typedef struct {
  size_t planes, plane; /* n*c planes of h*w floats */
  const float *x, *dy;
  float *y, *dx;
} global_pool_job;

static void global_avgpool_forward_part(void *arg, int part, int parts) {
  const global_pool_job *j = arg;
  const float area = (float)j->plane;
  size_t first, end;
  part_range(j->planes, part, parts, &first, &end);
  for (size_t p = first; p < end; p++) {
    const float *xp = j->x + p * j->plane;
    float sum = 0.0f;
    for (size_t i = 0; i < j->plane; i++) sum += xp[i];
    j->y[p] = sum / area;
  }
}

static void global_avgpool_backward_part(void *arg, int part, int parts) {
  const global_pool_job *j = arg;
  const float area = (float)j->plane;
  size_t first, end;
  part_range(j->planes, part, parts, &first, &end);
  for (size_t p = first; p < end; p++) {
    float *dxp = j->dx + p * j->plane;
    const float g = j->dy[p] / area;
    for (size_t i = 0; i < j->plane; i++) dxp[i] = g;
  }
}

static void cpu_global_avgpool_forward(void *ctx, int n, int c, int h, int w, const float *x,
                                       float *y) {
  global_pool_job job = {.planes = (size_t)n * c, .plane = (size_t)h * w, .x = x, .y = y};
  run_parts(ctx, job.planes * job.plane >= PARALLEL_MIN_FLOATS, global_avgpool_forward_part, &job);
}

static void cpu_global_avgpool_backward(void *ctx, int n, int c, int h, int w, const float *dy,
                                        float *dx) {
  global_pool_job job = {.planes = (size_t)n * c, .plane = (size_t)h * w, .dy = dy, .dx = dx};
  run_parts(ctx, job.planes * job.plane >= PARALLEL_MIN_FLOATS, global_avgpool_backward_part, &job);
}

/* ---- batch normalization ----
 *
 * Parts split the channels; the arithmetic is ps_bn_host_* (NCHW). */

typedef struct {
  int n, c, hw;
  float eps;
  const float *x, *dy, *gamma, *beta, *mean_in, *var_in, *invstd_in;
  float *y, *dx, *mean, *var, *invstd, *dgamma, *dbeta;
} bn_job;

static void bn_train_part(void *arg, int part, int parts) {
  const bn_job *j = arg;
  size_t first, end;
  part_range((size_t)j->c, part, parts, &first, &end);
  ps_bn_host_train(j->n, j->c, j->hw, 1, (int)first, (int)end, j->eps, j->x, j->gamma, j->beta,
                   j->y, j->mean, j->var, j->invstd);
}

static void bn_infer_part(void *arg, int part, int parts) {
  const bn_job *j = arg;
  size_t first, end;
  part_range((size_t)j->c, part, parts, &first, &end);
  ps_bn_host_infer(j->n, j->c, j->hw, 1, (int)first, (int)end, j->eps, j->x, j->gamma, j->beta,
                   j->mean_in, j->var_in, j->y);
}

static void bn_backward_part(void *arg, int part, int parts) {
  const bn_job *j = arg;
  size_t first, end;
  part_range((size_t)j->c, part, parts, &first, &end);
  ps_bn_host_backward(j->n, j->c, j->hw, 1, (int)first, (int)end, j->x, j->dy, j->gamma,
                      j->mean_in, j->invstd_in, j->dx, j->dgamma, j->dbeta);
}

/* Worth splitting: enough values, and a channel for every part. */
static int bn_split(const bn_job *j) {
  return (size_t)j->n * j->c * j->hw >= PARALLEL_MIN_FLOATS && j->c > 1;
}

static void cpu_batchnorm_forward_train(void *ctx, int n, int c, int hw, float eps, const float *x,
                                        const float *gamma, const float *beta, float *y,
                                        float *mean, float *var, float *invstd) {
  bn_job job = {.n = n, .c = c, .hw = hw, .eps = eps, .x = x, .gamma = gamma, .beta = beta,
                .y = y, .mean = mean, .var = var, .invstd = invstd};
  run_parts(ctx, bn_split(&job), bn_train_part, &job);
}

static void cpu_batchnorm_forward_infer(void *ctx, int n, int c, int hw, float eps, const float *x,
                                        const float *gamma, const float *beta, const float *mean,
                                        const float *var, float *y) {
  bn_job job = {.n = n, .c = c, .hw = hw, .eps = eps, .x = x, .gamma = gamma, .beta = beta,
                .mean_in = mean, .var_in = var, .y = y};
  run_parts(ctx, bn_split(&job), bn_infer_part, &job);
}

static void cpu_batchnorm_backward(void *ctx, int n, int c, int hw, const float *x,
                                   const float *dy, const float *gamma, const float *mean,
                                   const float *invstd, float *dx, float *dgamma, float *dbeta) {
  bn_job job = {.n = n, .c = c, .hw = hw, .x = x, .dy = dy, .gamma = gamma, .mean_in = mean,
                .invstd_in = invstd, .dx = dx, .dgamma = dgamma, .dbeta = dbeta};
  run_parts(ctx, bn_split(&job), bn_backward_part, &job);
}

/* ---- dense ----
 *
 * Parts split the output features for y, dW and db (each part packs its
 * rows of W), and the input features for dx. */

typedef struct {
  int n, in, out;
  const float *x, *w, *b, *dy;
  float *y, *dx, *dw, *db;
} dense_job;

static void dense_forward_part(void *arg, int part, int parts) {
  const dense_job *j = arg;
  size_t j0, j1;
  part_range((size_t)j->out, part, parts, &j0, &j1);
  const int cols = (int)(j1 - j0);
  if (cols == 0) return;
  for (int i = 0; i < j->n; i++)
    memcpy(j->y + (size_t)i * j->out + j0, j->b + j0, (size_t)cols * sizeof(float));
  /* y[:, j0:j1] (n, cols) += x (n, in) W[j0:j1]^T */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, cols, j->in, 1.0f, j->x, j->in,
              j->w + j0 * (size_t)j->in, j->in, 1.0f, j->y + j0, j->out);
}

static void dense_backward_part(void *arg, int part, int parts) {
  const dense_job *j = arg;
  size_t j0, j1, k0, k1;
  part_range((size_t)j->out, part, parts, &j0, &j1);
  part_range((size_t)j->in, part, parts, &k0, &k1);
  const int rows = (int)(j1 - j0), cols = (int)(k1 - k0);
  if (rows > 0) {
    memset(j->db + j0, 0, (size_t)rows * sizeof(float));
    for (int i = 0; i < j->n; i++) add_into(j->db + j0, j->dy + (size_t)i * j->out + j0, rows);
    /* dW[j0:j1] (rows, in) = dy[:, j0:j1]^T (rows, n) x (n, in) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows, j->in, j->n, 1.0f, j->dy + j0,
                j->out, j->x, j->in, 0.0f, j->dw + j0 * (size_t)j->in, j->in);
  }
  if (j->dx && cols > 0) {
    /* dx[:, k0:k1] (n, cols) = dy (n, out) W[:, k0:k1] (out, cols) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, j->n, cols, j->out, 1.0f, j->dy,
                j->out, j->w + k0, j->in, 0.0f, j->dx + k0, j->in);
  }
}

static void cpu_dense_forward(void *ctx, int n, int in, int out, const float *x, const float *w,
                              const float *b, float *y) {
  if (n == 0 || out == 0) return;
  if (in == 0) {
    for (int i = 0; i < n; i++) memcpy(y + (size_t)i * out, b, (size_t)out * sizeof(float));
    return;
  }
  dense_job job = {.n = n, .in = in, .out = out, .x = x, .w = w, .b = b, .y = y};
  run_parts(ctx, (size_t)n * in * out >= PARALLEL_MIN_MACS, dense_forward_part, &job);
}

static void cpu_dense_backward(void *ctx, int n, int in, int out, const float *x, const float *w,
                               const float *dy, float *dx, float *dw, float *db) {
  if (n == 0 || in == 0 || out == 0) {
    memset(db, 0, (size_t)out * sizeof(float));
    memset(dw, 0, (size_t)out * in * sizeof(float));
    if (dx) memset(dx, 0, (size_t)n * in * sizeof(float));
    return;
  }
  dense_job job = {.n = n, .in = in, .out = out, .x = x, .w = w, .dy = dy,
                   .dx = dx, .dw = dw, .db = db};
  run_parts(ctx, (size_t)n * in * out >= PARALLEL_MIN_MACS, dense_backward_part, &job);
}

/* ---- elementwise ---- */

typedef struct {
  size_t n;
  const float *x, *y, *dy, *mask;
  float *out, *mask_out;
  float rate;
  uint64_t seed, stream;
} map_job;

/* out[i] = f(a[i], b[i]) for i in [0, n): one op's loop over arrays that
 * do not overlap (see "loops over float arrays"). An op of one input is
 * given it as both a and b. */
typedef void (*map_span_fn)(float *restrict out, const float *restrict a, const float *restrict b,
                            size_t n);

/* Floats of the stack tile that an op run in place goes through. */
enum { MAP_TILE = 512 };

/* Runs span over this part's range. Element-wise ops may run in place
 * (ops.h: out is a or b, or overlaps neither), and a span's arrays must not
 * overlap; so in place each tile of the range is computed into a stack tile
 * and then copied over the input it was read from. */
static void map_part(const map_job *j, int part, int parts, map_span_fn span, const float *a,
                     const float *b) {
  size_t begin, end;
  part_range(j->n, part, parts, &begin, &end);
  float *out = j->out;
  if (out != a && out != b) {
    span(out + begin, a + begin, b + begin, end - begin);
    return;
  }
  for (size_t i = begin; i < end; i += MAP_TILE) {
    float tile[MAP_TILE];
    const size_t m = end - i < MAP_TILE ? end - i : MAP_TILE;
    span(tile, a + i, b + i, m);
    memcpy(out + i, tile, m * sizeof(float));
  }
}

/* max(x, 0) as a select: x where x > 0, else +0 (so -0 and NaN give +0). */
static inline float relu(float x) { return x > 0.0f ? x : 0.0f; }

/* The gradient g where the output y is positive, else +0. g is an argument,
 * read whether or not it is used: a conditional read would keep GCC from
 * vectorizing the loop ("control flow in loop"). */
static inline float relu_grad(float y, float g) { return y > 0.0f ? g : 0.0f; }

static void relu_forward_span(float *restrict y, const float *restrict x,
                              const float *restrict unused, size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) y[i] = relu(x[i]); /* vectorized */
  for (size_t i = nv; i < n; i++) y[i] = relu(x[i]);
}

static void relu_backward_span(float *restrict dx, const float *restrict y,
                               const float *restrict dy, size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) dx[i] = relu_grad(y[i], dy[i]); /* vectorized */
  for (size_t i = nv; i < n; i++) dx[i] = relu_grad(y[i], dy[i]);
}

static void dropout_backward_span(float *restrict dx, const float *restrict dy,
                                  const float *restrict mask, size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) dx[i] = dy[i] * mask[i]; /* vectorized */
  for (size_t i = nv; i < n; i++) dx[i] = dy[i] * mask[i];
}

static void add_span(float *restrict y, const float *restrict a, const float *restrict b,
                     size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) y[i] = a[i] + b[i]; /* vectorized */
  for (size_t i = nv; i < n; i++) y[i] = a[i] + b[i];
}

static void relu_forward_part(void *arg, int part, int parts) {
  const map_job *j = arg;
  map_part(j, part, parts, relu_forward_span, j->x, j->x);
}

static void relu_backward_part(void *arg, int part, int parts) {
  const map_job *j = arg;
  map_part(j, part, parts, relu_backward_span, j->y, j->dy);
}

/* A rate >= 1 drops everything (no infinite scale); a rate <= 0 keeps
 * everything with scale 1. */
static void dropout_forward_part(void *arg, int part, int parts) {
  const map_job *j = arg;
  const float rate = j->rate;
  const float scale = rate >= 1.0f ? 0.0f : rate <= 0.0f ? 1.0f : 1.0f / (1.0f - rate);
  size_t i, end;
  part_range(j->n, part, parts, &i, &end);
  for (; i < end; i++) {
    float keep = ps_rng_uniform(j->seed, j->stream, i) >= rate ? scale : 0.0f;
    j->mask_out[i] = keep;
    j->out[i] = j->x[i] * keep;
  }
}

static void dropout_backward_part(void *arg, int part, int parts) {
  const map_job *j = arg;
  map_part(j, part, parts, dropout_backward_span, j->dy, j->mask);
}

static void add_part(void *arg, int part, int parts) {
  const map_job *j = arg;
  map_part(j, part, parts, add_span, j->x, j->y);
}

static void cpu_relu_forward(void *ctx, size_t n, const float *x, float *y) {
  map_job job = {.n = n, .x = x, .out = y};
  run_parts(ctx, n >= PARALLEL_MIN_FLOATS, relu_forward_part, &job);
}

static void cpu_relu_backward(void *ctx, size_t n, const float *y, const float *dy, float *dx) {
  map_job job = {.n = n, .y = y, .dy = dy, .out = dx};
  run_parts(ctx, n >= PARALLEL_MIN_FLOATS, relu_backward_part, &job);
}

static void cpu_add(void *ctx, size_t n, const float *a, const float *b, float *y) {
  map_job job = {.n = n, .x = a, .y = b, .out = y}; /* a, b in the job's x, y */
  run_parts(ctx, n >= PARALLEL_MIN_FLOATS, add_part, &job);
}

static void cpu_dropout_forward(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                                const float *x, float *y, float *mask) {
  map_job job = {.n = n, .x = x, .out = y, .mask_out = mask, .rate = rate, .seed = seed,
                 .stream = stream};
  /* Each element costs a hash, so smaller arrays are worth splitting. */
  run_parts(ctx, n >= PARALLEL_MIN_FLOATS / 8, dropout_forward_part, &job);
}

static void cpu_dropout_backward(void *ctx, size_t n, const float *mask, const float *dy,
                                 float *dx) {
  map_job job = {.n = n, .dy = dy, .mask = mask, .out = dx};
  run_parts(ctx, n >= PARALLEL_MIN_FLOATS, dropout_backward_part, &job);
}

/* ---- softmax + cross-entropy ----
 *
 * (n, k) with k classes is small next to everything else: no parts. */

static float cpu_softmax_xent_forward(void *ctx, int n, int k, const float *logits,
                                      const uint8_t *labels, float *probs) {
  (void)ctx;
  if (n == 0) return 0.0f;
  return (float)(ps_xent_host_forward(n, k, logits, labels, probs) / n);
}

static void cpu_softmax_xent_stats(void *ctx, int n, int k, const float *logits,
                                   const uint8_t *labels, float *probs, double *stats) {
  (void)ctx;
  stats[0] = n > 0 ? ps_xent_host_forward(n, k, logits, labels, probs) : 0.0;
  stats[1] = n > 0 ? ps_xent_host_correct(n, k, probs, labels) : 0;
}

static void cpu_softmax_xent_backward(void *ctx, int n, int k, const float *probs,
                                      const uint8_t *labels, float *dlogits) {
  (void)ctx;
  ps_xent_host_backward(n, k, probs, labels, dlogits);
}

/* ---- embeddings ----
 *
 * The host arithmetic (ps_emb_host_*, shared with the dnnl backend) and the
 * backend's ops, which split it over the threads by examples (forward) or
 * by unique rows (backward): every output row is one thread's, summed in
 * the order ops.h gives, so the result does not depend on the threads. */

/* x[i] *= s */
static void scale_floats(float *restrict x, size_t n, float s) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) x[i] *= s; /* vectorized */
  for (size_t i = nv; i < n; i++) x[i] *= s;
}

/* dst[i] += src[i] * s, the product rounded before the sum, as the CUDA
 * backend's __fmul_rn and __fadd_rn: never a fused multiply-add, which GCC
 * does not form in the build's ISO C mode (-std=c11 means
 * -ffp-contract=off) and clang does not form across two statements. The
 * bit-for-bit tests (test_emb_kernels, test_cuda_parity) would show one. */
static void add_scaled_into(float *restrict dst, const float *restrict src, size_t n, float s) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) { /* vectorized */
    const float t = src[i] * s;
    dst[i] += t;
  }
  for (size_t i = nv; i < n; i++) {
    const float t = src[i] * s;
    dst[i] += t;
  }
}

/* Mean pooling's scale of a bag of m > 0 positions (ops.h). */
static inline float bag_scale(int32_t m) { return 1.0f / (float)m; }

void ps_emb_host_bag_forward(int dim, const int32_t *offsets, const int32_t *idx, int mean,
                             const float *rows, float *y, int e0, int e1) {
  const size_t d = (size_t)dim;
  for (int e = e0; e < e1; e++) {
    float *ye = y + (size_t)e * d;
    memset(ye, 0, d * sizeof(float));
    const int32_t j0 = offsets[e], j1 = offsets[e + 1];
    for (int32_t j = j0; j < j1; j++) add_into(ye, rows + (size_t)idx[j] * d, d);
    if (mean && j1 > j0) scale_floats(ye, d, bag_scale(j1 - j0));
  }
}

void ps_emb_host_bag_backward(int dim, const int32_t *offsets, const int32_t *rev_off,
                              const int32_t *rev_ex, int mean, const float *dy, float *drows,
                              int r0, int r1) {
  const size_t d = (size_t)dim;
  for (int r = r0; r < r1; r++) {
    float *dr = drows + (size_t)r * d;
    memset(dr, 0, d * sizeof(float));
    for (int32_t k = rev_off[r]; k < rev_off[r + 1]; k++) {
      const int32_t e = rev_ex[k];
      const float *g = dy + (size_t)e * d;
      if (mean)
        add_scaled_into(dr, g, d, bag_scale(offsets[e + 1] - offsets[e])); /* m >= 1: it holds k */
      else
        add_into(dr, g, d);
    }
  }
}

/* In double from the float logit: z = exp(-|x|) in (0, 1] never overflows,
 * sigmoid(x) is 1/(1+z) or z/(1+z) by the sign of x (no cancellation), and
 * log1p(z) is log(1 + exp(-|x|)) without log(0). */
void ps_sigmoid_xent_host_forward(int n, const float *logits, const float *labels, float *probs,
                                  double *stats) {
  double loss = 0.0, right = 0.0;
  for (int i = 0; i < n; i++) {
    const double x = logits[i], y = labels[i];
    const double z = exp(-fabs(x));
    probs[i] = (float)(x >= 0.0 ? 1.0 / (1.0 + z) : z / (1.0 + z));
    loss += fmax(x, 0.0) - x * y + log1p(z);
    right += (probs[i] >= 0.5f) == (labels[i] >= 0.5f);
  }
  stats[0] = loss;
  stats[1] = right;
}

void ps_sigmoid_xent_host_backward(int n, const float *probs, const float *labels, float *dlogits) {
  const float inv_n = n > 0 ? 1.0f / (float)n : 0.0f;
  for (int i = 0; i < n; i++) {
    const float d = probs[i] - labels[i];
    dlogits[i] = d * inv_n;
  }
}

typedef struct {
  int n, dim, mean, u;
  const int32_t *offsets, *idx, *rev_off, *rev_ex;
  const float *rows, *dy;
  float *y, *drows;
} emb_job;

static void emb_forward_part(void *arg, int part, int parts) {
  const emb_job *j = arg;
  size_t e0, e1;
  part_range((size_t)j->n, part, parts, &e0, &e1);
  ps_emb_host_bag_forward(j->dim, j->offsets, j->idx, j->mean, j->rows, j->y, (int)e0, (int)e1);
}

static void emb_backward_part(void *arg, int part, int parts) {
  const emb_job *j = arg;
  size_t r0, r1;
  part_range((size_t)j->u, part, parts, &r0, &r1);
  ps_emb_host_bag_backward(j->dim, j->offsets, j->rev_off, j->rev_ex, j->mean, j->dy, j->drows,
                           (int)r0, (int)r1);
}

static void cpu_embedding_bag_forward(void *ctx, int n, int dim, const int32_t *offsets,
                                      const int32_t *idx, int mean, const float *rows, float *y) {
  if (n <= 0 || dim <= 0) return;
  emb_job job = {
      .n = n, .dim = dim, .mean = mean, .offsets = offsets, .idx = idx, .rows = rows, .y = y};
  const size_t work = ((size_t)offsets[n] + (size_t)n) * (size_t)dim;
  run_parts(ctx, work >= PARALLEL_MIN_FLOATS, emb_forward_part, &job);
}

static void cpu_embedding_bag_backward(void *ctx, int n, int dim, const int32_t *offsets, int u,
                                       const int32_t *rev_off, const int32_t *rev_ex, int mean,
                                       const float *dy, float *drows) {
  if (u <= 0 || dim <= 0) return;
  emb_job job = {.n = n,
                 .dim = dim,
                 .mean = mean,
                 .u = u,
                 .offsets = offsets,
                 .rev_off = rev_off,
                 .rev_ex = rev_ex,
                 .dy = dy,
                 .drows = drows};
  const size_t work = ((size_t)rev_off[u] + (size_t)u) * (size_t)dim;
  run_parts(ctx, work >= PARALLEL_MIN_FLOATS, emb_backward_part, &job);
}

typedef struct {
  int n, width, src_stride, dst_stride;
  const float *src;
  float *dst;
} cols_job;

static void copy_cols_part(void *arg, int part, int parts) {
  const cols_job *j = arg;
  size_t i0, i1;
  part_range((size_t)j->n, part, parts, &i0, &i1);
  for (size_t i = i0; i < i1; i++)
    memcpy(j->dst + i * (size_t)j->dst_stride, j->src + i * (size_t)j->src_stride,
           (size_t)j->width * sizeof(float));
}

static void cpu_copy_cols(void *ctx, int n, int width, const float *src, int src_stride, float *dst,
                          int dst_stride) {
  if (n <= 0 || width <= 0) return;
  cols_job job = {.n = n,
                  .width = width,
                  .src_stride = src_stride,
                  .dst_stride = dst_stride,
                  .src = src,
                  .dst = dst};
  run_parts(ctx, (size_t)n * (size_t)width >= PARALLEL_MIN_FLOATS, copy_cols_part, &job);
}

void ps_fm_host_forward(int f, int d, const float *x, float *y, int e0, int e1) {
  for (int e = e0; e < e1; e++) {
    const float *xe = x + (size_t)e * f * d;
    for (int k = 0; k < d; k++) {
      float s = 0.0f, q = 0.0f;
      for (int j = 0; j < f; j++) {
        const float v = xe[(size_t)j * d + k];
        s += v;
        q += v * v;
      }
      y[(size_t)e * d + k] = 0.5f * (s * s - q);
    }
  }
}

void ps_fm_host_backward(int f, int d, const float *x, const float *dy, float *dx, int e0,
                         int e1) {
  for (int e = e0; e < e1; e++) {
    const float *xe = x + (size_t)e * f * d;
    float *dxe = dx + (size_t)e * f * d;
    for (int k = 0; k < d; k++) {
      float s = 0.0f;
      for (int j = 0; j < f; j++) s += xe[(size_t)j * d + k];
      const float g = dy[(size_t)e * d + k];
      for (int j = 0; j < f; j++) dxe[(size_t)j * d + k] = g * (s - xe[(size_t)j * d + k]);
    }
  }
}

typedef struct {
  int n, f, d;
  const float *x, *dy;
  float *y;
} fm_job;

static void fm_forward_part(void *arg, int part, int parts) {
  const fm_job *j = arg;
  size_t e0, e1;
  part_range((size_t)j->n, part, parts, &e0, &e1);
  ps_fm_host_forward(j->f, j->d, j->x, j->y, (int)e0, (int)e1);
}

static void fm_backward_part(void *arg, int part, int parts) {
  const fm_job *j = arg;
  size_t e0, e1;
  part_range((size_t)j->n, part, parts, &e0, &e1);
  ps_fm_host_backward(j->f, j->d, j->x, j->dy, j->y, (int)e0, (int)e1);
}

static void cpu_fm_forward(void *ctx, int n, int f, int d, const float *x, float *y) {
  if (n <= 0 || d <= 0) return;
  fm_job job = {.n = n, .f = f, .d = d, .x = x, .y = y};
  run_parts(ctx, (size_t)n * f * d >= PARALLEL_MIN_FLOATS, fm_forward_part, &job);
}

static void cpu_fm_backward(void *ctx, int n, int f, int d, const float *x, const float *dy,
                            float *dx) {
  if (n <= 0 || d <= 0 || f <= 0) return;
  fm_job job = {.n = n, .f = f, .d = d, .x = x, .dy = dy, .y = dx};
  run_parts(ctx, (size_t)n * f * d >= PARALLEL_MIN_FLOATS, fm_backward_part, &job);
}

/* (n) logits: small next to the rest of a step, no parts. */
static void cpu_sigmoid_xent_forward(void *ctx, int n, const float *logits, const float *labels,
                                     float *probs, double *stats) {
  (void)ctx;
  ps_sigmoid_xent_host_forward(n > 0 ? n : 0, logits, labels, probs, stats);
}

static void cpu_sigmoid_xent_backward(void *ctx, int n, const float *probs, const float *labels,
                                      float *dlogits) {
  (void)ctx;
  ps_sigmoid_xent_host_backward(n, probs, labels, dlogits);
}

/* ---- memory ----
 *
 * The backend's memory is host memory and every op is done when it
 * returns: copies are memcpy, and sync has nothing to wait for. */

static void *cpu_mem_alloc(void *ctx, size_t bytes) {
  (void)ctx;
  return ps_alloc(bytes);
}

static void cpu_mark(void *ctx, int i) {
  cpu_backend *be = ctx;
  if (i >= 0 && i < PS_MARKS) be->marks[i] = ps_now_s();
}

static void cpu_marks_read(void *ctx, double *ms, int n) {
  cpu_backend *be = ctx;
  for (int i = 0; i < n; i++)
    ms[i] = i < PS_MARKS && be->marks[i] > 0 && be->marks[PS_MARK_BEGIN] > 0
                ? (be->marks[i] - be->marks[PS_MARK_BEGIN]) * 1e3
                : -1.0;
  memset(be->marks, 0, sizeof be->marks);
}

static void cpu_mem_free(void *ctx, void *p) {
  (void)ctx;
  ps_free(p);
}

/* All three directions: host to host. */
static void cpu_mem_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  if (bytes && dst != src) memcpy(dst, src, bytes);
}

static void cpu_sync(void *ctx) { (void)ctx; }

static uint64_t cpu_to_host_async(void *ctx, void *dst, const void *src, size_t bytes) {
  cpu_mem_copy(ctx, dst, src, bytes);
  return 0;
}

static int cpu_ticket_done(void *ctx, uint64_t ticket) {
  (void)ctx;
  (void)ticket;
  return 1;
}

static void cpu_ticket_wait(void *ctx, uint64_t ticket) {
  (void)ctx;
  (void)ticket;
}

static void cpu_scale(void *ctx, size_t n, float alpha, float *x) {
  (void)ctx;
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) x[i] *= alpha; /* vectorized */
  for (size_t i = nv; i < n; i++) x[i] *= alpha;
}

/* ---- the table ---- */

/* Stops and joins the workers that were started, then frees everything. */
static void cpu_free(cpu_backend *be) {
  if (be->nworkers > 0) {
    pthread_mutex_lock(&be->mu);
    be->stop = 1;
    pthread_cond_broadcast(&be->wake);
    pthread_mutex_unlock(&be->mu);
    for (int i = 0; i < be->nworkers; i++) pthread_join(be->workers[i].tid, NULL);
  }
  pthread_cond_destroy(&be->done);
  pthread_cond_destroy(&be->wake);
  pthread_mutex_destroy(&be->mu);
  free(be->workers);
  free(be);
}

static void cpu_destroy(ps_ops *ops) {
  if (ops) cpu_free(ops->ctx);
}

/* threads > 0: compute with that many threads (the caller and threads-1
 * workers) and set OpenBLAS, process-wide, to one thread; threads == 0: one
 * thread and OpenBLAS's own threading, untouched. NULL if memory or a
 * thread cannot be had (nothing is left running then). */
ps_ops *ps_ops_cpu_create(int threads) {
  cpu_backend *be = calloc(1, sizeof *be);
  if (!be) return NULL;
  be->nthreads = threads > 1 ? threads : 1;
  if (pthread_mutex_init(&be->mu, NULL) != 0) goto fail_mu;
  if (pthread_cond_init(&be->wake, NULL) != 0) goto fail_wake;
  if (pthread_cond_init(&be->done, NULL) != 0) goto fail_done;
  if (be->nthreads > 1) {
    be->workers = calloc((size_t)be->nthreads - 1, sizeof *be->workers);
    if (!be->workers) {
      cpu_free(be);
      return NULL;
    }
    for (int i = 0; i < be->nthreads - 1; i++) {
      be->workers[i] = (cpu_worker){.be = be, .part = i + 1};
      if (pthread_create(&be->workers[i].tid, NULL, worker_main, &be->workers[i]) != 0) {
        cpu_free(be); /* joins the ones already started */
        return NULL;
      }
      be->nworkers = i + 1;
    }
  }
  if (threads > 0) openblas_set_num_threads(1);
  be->ops = (ps_ops){
      .name = "cpu",
      .ctx = be,
      .conv2d_workspace = cpu_conv2d_workspace,
      .conv2d_forward = cpu_conv2d_forward,
      .conv2d_backward = cpu_conv2d_backward,
      .maxpool_forward = cpu_maxpool_forward,
      .maxpool_backward = cpu_maxpool_backward,
      .avgpool_forward = cpu_avgpool_forward,
      .avgpool_backward = cpu_avgpool_backward,
      .global_avgpool_forward = cpu_global_avgpool_forward,
      .global_avgpool_backward = cpu_global_avgpool_backward,
      .batchnorm_forward_train = cpu_batchnorm_forward_train,
      .batchnorm_forward_infer = cpu_batchnorm_forward_infer,
      .batchnorm_backward = cpu_batchnorm_backward,
      .dense_forward = cpu_dense_forward,
      .dense_backward = cpu_dense_backward,
      .relu_forward = cpu_relu_forward,
      .relu_backward = cpu_relu_backward,
      .add = cpu_add,
      .dropout_forward = cpu_dropout_forward,
      .dropout_backward = cpu_dropout_backward,
      .softmax_xent_forward = cpu_softmax_xent_forward,
      .softmax_xent_backward = cpu_softmax_xent_backward,
      .softmax_xent_stats = cpu_softmax_xent_stats,
      .destroy = cpu_destroy,
      .alloc = cpu_mem_alloc,
      .free = cpu_mem_free,
      .to_device = cpu_mem_copy,
      .to_host = cpu_mem_copy,
      .copy = cpu_mem_copy,
      .sync = cpu_sync,
      .host_memory = 1,
      .to_device_async = cpu_mem_copy,
      .to_host_async = cpu_to_host_async,
      .ticket_done = cpu_ticket_done,
      .ticket_wait = cpu_ticket_wait,
      .scale = cpu_scale,
      .host_alloc = cpu_mem_alloc,
      .host_free = cpu_mem_free,
      .mark = cpu_mark,
      .marks_read = cpu_marks_read,
      .embedding_bag_forward = cpu_embedding_bag_forward,
      .embedding_bag_backward = cpu_embedding_bag_backward,
      .copy_cols = cpu_copy_cols,
      .sigmoid_xent_forward = cpu_sigmoid_xent_forward,
      .sigmoid_xent_backward = cpu_sigmoid_xent_backward,
      .fm_forward = cpu_fm_forward,
      .fm_backward = cpu_fm_backward,
  };
  return &be->ops;

fail_done:
  pthread_cond_destroy(&be->wake);
fail_wake:
  pthread_mutex_destroy(&be->mu);
fail_mu:
  free(be);
  return NULL;
}

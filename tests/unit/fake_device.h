/* A stand-in "device" backend for tests on machines without a GPU: the CPU
 * ops behind a table whose memory is not host memory (see below). Included
 * by the unit tests that need one; static functions only. */
#ifndef PS_TESTS_UNIT_FAKE_DEVICE_H
#define PS_TESTS_UNIT_FAKE_DEVICE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/util.h"
#include "../../kernels/ops.h"

/* ---- the stand-in device ----
 *
 * The CPU ops behind a table whose memory is "device memory": blocks from
 * its own alloc, registered here. Every op checks its pointers against the
 * blocks, then runs the CPU op. Copies to the host are queued and land at
 * the next op or sync. alloc fails on purpose at call number fail_at. */

enum { MAX_BLOCKS = 256, MAX_PENDING = 16, MAX_ASYNC = 64 };

typedef struct {
  ps_ops ops; /* ops.ctx points back here */
  ps_ops *cpu;
  struct {
    const char *p;
    size_t bytes;
  } blocks[MAX_BLOCKS];
  int n_blocks;
  struct {
    void *dst;
    const void *src;
    size_t bytes;
  } pending[MAX_PENDING];
  int n_pending;
  /* to_host_async: a copy of the bytes when it was called, landing in dst
   * only at ticket_wait, the second ticket_done asked of it, or sync. */
  struct {
    void *dst;
    void *bytes_then;
    size_t bytes;
    uint64_t ticket;
    int asked;
  } async[MAX_ASYNC];
  int n_async;
  uint64_t last_ticket;
  int allocs;  /* alloc calls so far */
  int fail_at; /* the alloc call that fails (0-based); -1: none */
  int bad;     /* pointer checks that failed */
} fake_dev;

static int in_block(const fake_dev *f, const void *p, size_t bytes) {
  const char *c = p;
  for (int i = 0; i < f->n_blocks; i++)
    if (c >= f->blocks[i].p && bytes <= f->blocks[i].bytes &&
        (size_t)(c - f->blocks[i].p) <= f->blocks[i].bytes - bytes)
      return 1;
  return 0;
}

/* p (NULL allowed when `optional`) must be device memory for `bytes`. */
static void need(fake_dev *f, const void *p, size_t bytes, int optional, const char *what) {
  if (!p && optional) return;
  if (!p || !in_block(f, p, bytes)) {
    f->bad++;
    fprintf(stderr, "stand-in device: %s: %p (%zu bytes) is not device memory\n", what, p, bytes);
  }
}

static void flush(fake_dev *f) {
  for (int i = 0; i < f->n_pending; i++)
    memcpy(f->pending[i].dst, f->pending[i].src, f->pending[i].bytes);
  f->n_pending = 0;
}

/* Flushes the queued copies and names the CPU backend's ctx. */
static fake_dev *enter(void *ctx) {
  fake_dev *f = ctx;
  flush(f);
  return f;
}

#define F4 sizeof(float)

static size_t fk_conv2d_workspace(void *ctx, const ps_conv_shape *s) {
  fake_dev *f = enter(ctx);
  return f->cpu->conv2d_workspace(f->cpu->ctx, s);
}

static void conv_need(fake_dev *f, const ps_conv_shape *s, const float *x, const float *w,
                      const float *b, const float *y, const float *work) {
  const size_t n = (size_t)s->n;
  need(f, x, n * s->c * s->h * s->w * F4, 0, "conv x");
  need(f, w, (size_t)s->oc * s->c * s->kh * s->kw * F4, 0, "conv w");
  need(f, b, (size_t)s->oc * F4, 0, "conv b");
  need(f, y, n * s->oc * s->oh * s->ow * F4, 0, "conv y");
  need(f, work, f->cpu->conv2d_workspace(f->cpu->ctx, s) * F4, 0, "conv work");
}

static void fk_conv2d_forward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                              const float *b, float *y, float *work) {
  fake_dev *f = enter(ctx);
  conv_need(f, s, x, w, b, y, work);
  f->cpu->conv2d_forward(f->cpu->ctx, s, x, w, b, y, work);
}

static void fk_conv2d_backward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                               const float *dy, float *dx, float *dw, float *db, float *work) {
  fake_dev *f = enter(ctx);
  conv_need(f, s, x, w, db, dy, work); /* db has b's size, dy y's */
  need(f, dx, (size_t)s->n * s->c * s->h * s->w * F4, 1, "conv dx");
  need(f, dw, (size_t)s->oc * s->c * s->kh * s->kw * F4, 0, "conv dw");
  f->cpu->conv2d_backward(f->cpu->ctx, s, x, w, dy, dx, dw, db, work);
}

static void fk_maxpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                               int32_t *argmax) {
  fake_dev *f = enter(ctx);
  const size_t planes = (size_t)s->n * s->c;
  need(f, x, planes * s->h * s->w * F4, 0, "maxpool x");
  need(f, y, planes * s->oh * s->ow * F4, 0, "maxpool y");
  need(f, argmax, planes * s->oh * s->ow * sizeof(int32_t), 1, "maxpool argmax");
  f->cpu->maxpool_forward(f->cpu->ctx, s, x, y, argmax);
}

static void fk_maxpool_backward(void *ctx, const ps_pool_shape *s, const float *dy,
                                const int32_t *argmax, float *dx) {
  fake_dev *f = enter(ctx);
  const size_t planes = (size_t)s->n * s->c;
  need(f, dy, planes * s->oh * s->ow * F4, 0, "maxpool dy");
  need(f, argmax, planes * s->oh * s->ow * sizeof(int32_t), 0, "maxpool argmax");
  need(f, dx, planes * s->h * s->w * F4, 0, "maxpool dx");
  f->cpu->maxpool_backward(f->cpu->ctx, s, dy, argmax, dx);
}

static void fk_dense_forward(void *ctx, int n, int in, int out, const float *x, const float *w,
                             const float *b, float *y) {
  fake_dev *f = enter(ctx);
  need(f, x, (size_t)n * in * F4, 0, "dense x");
  need(f, w, (size_t)out * in * F4, 0, "dense w");
  need(f, b, (size_t)out * F4, 0, "dense b");
  need(f, y, (size_t)n * out * F4, 0, "dense y");
  f->cpu->dense_forward(f->cpu->ctx, n, in, out, x, w, b, y);
}

static void fk_dense_backward(void *ctx, int n, int in, int out, const float *x, const float *w,
                              const float *dy, float *dx, float *dw, float *db) {
  fake_dev *f = enter(ctx);
  need(f, x, (size_t)n * in * F4, 0, "dense x");
  need(f, w, (size_t)out * in * F4, 0, "dense w");
  need(f, dy, (size_t)n * out * F4, 0, "dense dy");
  need(f, dx, (size_t)n * in * F4, 1, "dense dx");
  need(f, dw, (size_t)out * in * F4, 0, "dense dw");
  need(f, db, (size_t)out * F4, 0, "dense db");
  f->cpu->dense_backward(f->cpu->ctx, n, in, out, x, w, dy, dx, dw, db);
}

static void fk_relu_forward(void *ctx, size_t n, const float *x, float *y) {
  fake_dev *f = enter(ctx);
  need(f, x, n * F4, 0, "relu x");
  need(f, y, n * F4, 0, "relu y");
  f->cpu->relu_forward(f->cpu->ctx, n, x, y);
}

static void fk_relu_backward(void *ctx, size_t n, const float *y, const float *dy, float *dx) {
  fake_dev *f = enter(ctx);
  need(f, y, n * F4, 0, "relu y");
  need(f, dy, n * F4, 0, "relu dy");
  need(f, dx, n * F4, 0, "relu dx");
  f->cpu->relu_backward(f->cpu->ctx, n, y, dy, dx);
}

static void fk_dropout_forward(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                               const float *x, float *y, float *mask) {
  fake_dev *f = enter(ctx);
  need(f, x, n * F4, 0, "dropout x");
  need(f, y, n * F4, 0, "dropout y");
  need(f, mask, n * F4, 0, "dropout mask");
  f->cpu->dropout_forward(f->cpu->ctx, n, rate, seed, stream, x, y, mask);
}

static void fk_dropout_backward(void *ctx, size_t n, const float *mask, const float *dy,
                                float *dx) {
  fake_dev *f = enter(ctx);
  need(f, mask, n * F4, 0, "dropout mask");
  need(f, dy, n * F4, 0, "dropout dy");
  need(f, dx, n * F4, 0, "dropout dx");
  f->cpu->dropout_backward(f->cpu->ctx, n, mask, dy, dx);
}

static float fk_softmax_xent_forward(void *ctx, int n, int k, const float *logits,
                                     const uint8_t *labels, float *probs) {
  fake_dev *f = enter(ctx);
  need(f, logits, (size_t)n * k * F4, 0, "softmax logits");
  need(f, labels, (size_t)n, 0, "softmax labels");
  need(f, probs, (size_t)n * k * F4, 0, "softmax probs");
  return f->cpu->softmax_xent_forward(f->cpu->ctx, n, k, logits, labels, probs);
}

static void fk_softmax_xent_backward(void *ctx, int n, int k, const float *probs,
                                     const uint8_t *labels, float *dlogits) {
  fake_dev *f = enter(ctx);
  need(f, probs, (size_t)n * k * F4, 0, "softmax probs");
  need(f, labels, (size_t)n, 0, "softmax labels");
  need(f, dlogits, (size_t)n * k * F4, 0, "softmax dlogits");
  f->cpu->softmax_xent_backward(f->cpu->ctx, n, k, probs, labels, dlogits);
}

static void *fk_alloc(void *ctx, size_t bytes) {
  fake_dev *f = enter(ctx);
  if (f->allocs++ == f->fail_at || f->n_blocks == MAX_BLOCKS) return NULL;
  void *p = ps_alloc(bytes);
  if (!p) return NULL;
  f->blocks[f->n_blocks].p = p;
  f->blocks[f->n_blocks].bytes = bytes;
  f->n_blocks++;
  return p;
}

static void fk_free(void *ctx, void *p) {
  fake_dev *f = enter(ctx);
  if (!p) return;
  for (int i = 0; i < f->n_blocks; i++)
    if (f->blocks[i].p == p) {
      f->blocks[i] = f->blocks[--f->n_blocks];
      ps_free(p);
      return;
    }
  f->bad++;
  fprintf(stderr, "stand-in device: free of %p, which is not a device block\n", p);
}

static void fk_to_device(void *ctx, void *dst, const void *src_host, size_t bytes) {
  fake_dev *f = enter(ctx);
  need(f, dst, bytes, 0, "to_device dst");
  if (bytes && in_block(f, src_host, 1)) {
    f->bad++;
    fprintf(stderr, "stand-in device: to_device from device memory\n");
  }
  if (bytes) memcpy(dst, src_host, bytes);
}

static void fk_to_host(void *ctx, void *dst_host, const void *src, size_t bytes) {
  fake_dev *f = enter(ctx);
  need(f, src, bytes, 0, "to_host src");
  if (bytes && in_block(f, dst_host, 1)) {
    f->bad++;
    fprintf(stderr, "stand-in device: to_host into device memory\n");
  }
  if (!bytes) return;
  if (f->n_pending == MAX_PENDING) flush(f);
  f->pending[f->n_pending].dst = dst_host;
  f->pending[f->n_pending].src = src;
  f->pending[f->n_pending].bytes = bytes;
  f->n_pending++;
}

static void fk_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  fake_dev *f = enter(ctx);
  need(f, dst, bytes, 0, "copy dst");
  need(f, src, bytes, 0, "copy src");
  if (bytes && dst != src) memcpy(dst, src, bytes);
}

/* Lands the asynchronous copies up to ticket t, in order. */
static void land(fake_dev *f, uint64_t t) {
  int k = 0;
  for (int i = 0; i < f->n_async; i++) {
    if (f->async[i].ticket <= t) {
      memcpy(f->async[i].dst, f->async[i].bytes_then, f->async[i].bytes);
      free(f->async[i].bytes_then);
    } else {
      f->async[k++] = f->async[i];
    }
  }
  f->n_async = k;
}

static void fk_sync(void *ctx) { land(enter(ctx), UINT64_MAX); }

static void fk_to_device_async(void *ctx, void *dst, const void *src_host, size_t bytes) {
  fk_to_device(ctx, dst, src_host, bytes);
}

static uint64_t fk_to_host_async(void *ctx, void *dst_host, const void *src, size_t bytes) {
  fake_dev *f = enter(ctx);
  need(f, src, bytes, 0, "to_host_async src");
  if (bytes && in_block(f, dst_host, 1)) {
    f->bad++;
    fprintf(stderr, "stand-in device: to_host_async into device memory\n");
  }
  if (!bytes) return 0;
  if (f->n_async == MAX_ASYNC) land(f, f->async[0].ticket);
  void *then = malloc(bytes);
  if (!then) abort();
  memcpy(then, src, bytes);
  f->async[f->n_async].dst = dst_host;
  f->async[f->n_async].bytes_then = then;
  f->async[f->n_async].bytes = bytes;
  f->async[f->n_async].ticket = ++f->last_ticket;
  f->async[f->n_async].asked = 0;
  f->n_async++;
  return f->last_ticket;
}

static int fk_ticket_done(void *ctx, uint64_t ticket) {
  fake_dev *f = enter(ctx);
  for (int i = 0; i < f->n_async; i++)
    if (f->async[i].ticket == ticket && !f->async[i].asked++) return 0; /* not yet, once */
  land(f, ticket);
  return 1;
}

static void fk_ticket_wait(void *ctx, uint64_t ticket) { land(enter(ctx), ticket); }

static void fk_scale(void *ctx, size_t n, float alpha, float *x) {
  fake_dev *f = enter(ctx);
  need(f, x, n * F4, 0, "scale x");
  f->cpu->scale(f->cpu->ctx, n, alpha, x);
}

static void fk_destroy(ps_ops *ops) { (void)ops; }

__attribute__((unused)) static void fake_init(fake_dev *f, ps_ops *cpu) {
  memset(f, 0, sizeof *f);
  f->cpu = cpu;
  f->fail_at = -1;
  f->ops = (ps_ops){
      .name = "stand-in",
      .ctx = f,
      .conv2d_workspace = fk_conv2d_workspace,
      .conv2d_forward = fk_conv2d_forward,
      .conv2d_backward = fk_conv2d_backward,
      .maxpool_forward = fk_maxpool_forward,
      .maxpool_backward = fk_maxpool_backward,
      .dense_forward = fk_dense_forward,
      .dense_backward = fk_dense_backward,
      .relu_forward = fk_relu_forward,
      .relu_backward = fk_relu_backward,
      .dropout_forward = fk_dropout_forward,
      .dropout_backward = fk_dropout_backward,
      .softmax_xent_forward = fk_softmax_xent_forward,
      .softmax_xent_backward = fk_softmax_xent_backward,
      .destroy = fk_destroy,
      .alloc = fk_alloc,
      .free = fk_free,
      .to_device = fk_to_device,
      .to_host = fk_to_host,
      .copy = fk_copy,
      .sync = fk_sync,
      .host_memory = 0,
      .to_device_async = fk_to_device_async,
      .to_host_async = fk_to_host_async,
      .ticket_done = fk_ticket_done,
      .ticket_wait = fk_ticket_wait,
      .scale = fk_scale,
  };
}

/* A stand-in on the heap with a one-thread CPU backend of its own, both
 * freed by ops->destroy: for code that owns and destroys its backends (the
 * replicas). NULL when memory or a thread cannot be had. */
static void fk_destroy_owned(ps_ops *ops) {
  fake_dev *f = ops->ctx;
  land(f, UINT64_MAX);
  if (f->bad) fprintf(stderr, "stand-in device: %d bad pointers\n", f->bad);
  if (f->n_blocks) fprintf(stderr, "stand-in device: %d blocks not freed\n", f->n_blocks);
  f->cpu->destroy(f->cpu);
  free(f);
}

__attribute__((unused)) static ps_ops *fake_dev_create(void) {
  fake_dev *f = malloc(sizeof *f);
  ps_ops *cpu = ps_ops_cpu_create(1);
  if (!f || !cpu) {
    free(f);
    if (cpu) cpu->destroy(cpu);
    return NULL;
  }
  fake_init(f, cpu);
  f->ops.destroy = fk_destroy_owned;
  return &f->ops;
}

#endif

/* The emulated device (see ops_emu.h): the cpu backend's ops behind a
 * table whose memory is not host memory.
 *
 * Memory: blocks from its own alloc, registered here. Every op checks that
 * each pointer it is given lies, with its whole extent, inside one block,
 * and aborts with what and where otherwise (what a GPU would fault on);
 * copies check their direction. Copies to the host (to_host) are queued and
 * land at the next op or sync, as on a stream; to_host_async keeps the
 * bytes of the moment it was called and lands them only at ticket_wait, at
 * the second ticket_done asked of its ticket, or at sync, so a caller that
 * reads too early sees stale bytes. alloc fails on purpose at call number
 * fail_at (ps_ops_emu_fail_alloc_at). One thread at a time, like the cpu
 * backend. */
#include "ops_emu.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/util.h"

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
  /* host_alloc's blocks: asynchronous copies from or into other host
   * memory are counted (on a GPU they would wait for a staging copy). */
  struct {
    const char *p;
    size_t bytes;
  } host[MAX_BLOCKS];
  int n_host;
  int async_copies, pageable_async;
  pthread_mutex_t host_mu; /* host_alloc may be called from any thread */
  /* Graphs: while recording, the ops are checked and kept in rec (not
   * run); graph_end makes rec the graph, which graph_launch runs. */
  int recording;
  struct em_call *rec, *graph;
  int n_rec, cap_rec, n_graph;
  int graphs, launches; /* graphs recorded and launched */
  /* set_rng_step's base: on the device, read by dropout when it runs (a
   * replayed graph's dropout takes the base of its replay) */
  uint64_t rng_base;
  int allocs;  /* alloc calls so far */
  int fail_at; /* the alloc call that fails (0-based); -1: none */
} emu_dev;

static int in_block(const emu_dev *f, const void *p, size_t bytes) {
  const char *c = p;
  for (int i = 0; i < f->n_blocks; i++)
    if (c >= f->blocks[i].p && bytes <= f->blocks[i].bytes &&
        (size_t)(c - f->blocks[i].p) <= f->blocks[i].bytes - bytes)
      return 1;
  return 0;
}

/* p (NULL allowed when `optional`) must be device memory for `bytes`. */
static void need(emu_dev *f, const void *p, size_t bytes, int optional, const char *what) {
  if (!p && optional) return;
  if (!p || !in_block(f, p, bytes)) {
    /* What a GPU would fault on: say what and stop. */
    fprintf(stderr, "emu device: %s: %p (%zu bytes) is not device memory\n", what, p, bytes);
    abort();
  }
}

static void flush(emu_dev *f) {
  for (int i = 0; i < f->n_pending; i++)
    memcpy(f->pending[i].dst, f->pending[i].src, f->pending[i].bytes);
  f->n_pending = 0;
}

/* Flushes the queued copies and names the CPU backend's ctx. */
static emu_dev *enter(void *ctx) {
  emu_dev *f = ctx;
  flush(f);
  return f;
}

#define F4 sizeof(float)

/* ---- calls, run at once or recorded into a graph ---- */

enum {
  OP_CONV_FWD, OP_CONV_BWD, OP_POOL_FWD, OP_POOL_BWD, OP_DENSE_FWD, OP_DENSE_BWD, OP_RELU_FWD,
  OP_RELU_BWD, OP_DROP_FWD, OP_DROP_BWD, OP_XENT_STATS, OP_XENT_BWD, OP_SCALE, OP_COPY, OP_MARK,
  OP_AVGPOOL_FWD, OP_AVGPOOL_BWD, OP_GAP_FWD, OP_GAP_BWD, OP_ADD, OP_BN_TRAIN, OP_BN_INFER,
  OP_BN_BWD, OP_EMB_FWD, OP_EMB_BWD, OP_COPY_COLS, OP_SIGMOID_FWD, OP_SIGMOID_BWD,
  OP_FM_FWD, OP_FM_BWD
};

enum { CALL_PTRS = 5 }; /* the most pointers an op reads (batchnorm's backward) */

/* One op's arguments: p the pointers it reads, q those it writes. */
typedef struct em_call {
  int op;
  ps_conv_shape cs;
  ps_pool_shape ps;
  int n, in, out, k;
  size_t len;
  float rate, alpha;
  uint64_t seed, stream;
  const void *p[CALL_PTRS];
  void *q[CALL_PTRS];
} em_call;

static void run_call(emu_dev *f, const em_call *c) {
  void *ctx = f->cpu->ctx;
  ps_ops *o = f->cpu;
  switch (c->op) {
    case OP_CONV_FWD:
      o->conv2d_forward(ctx, &c->cs, c->p[0], c->p[1], c->p[2], c->q[0], c->q[1]);
      break;
    case OP_CONV_BWD:
      o->conv2d_backward(ctx, &c->cs, c->p[0], c->p[1], c->p[2], c->q[0], c->q[1], c->q[2],
                         c->q[3]);
      break;
    case OP_POOL_FWD: o->maxpool_forward(ctx, &c->ps, c->p[0], c->q[0], c->q[1]); break;
    case OP_POOL_BWD: o->maxpool_backward(ctx, &c->ps, c->p[0], c->p[1], c->q[0]); break;
    case OP_AVGPOOL_FWD: o->avgpool_forward(ctx, &c->ps, c->p[0], c->q[0]); break;
    case OP_AVGPOOL_BWD: o->avgpool_backward(ctx, &c->ps, c->p[0], c->q[0]); break;
    case OP_GAP_FWD:
      o->global_avgpool_forward(ctx, c->ps.n, c->ps.c, c->ps.h, c->ps.w, c->p[0], c->q[0]);
      break;
    case OP_GAP_BWD:
      o->global_avgpool_backward(ctx, c->ps.n, c->ps.c, c->ps.h, c->ps.w, c->p[0], c->q[0]);
      break;
    case OP_DENSE_FWD:
      o->dense_forward(ctx, c->n, c->in, c->out, c->p[0], c->p[1], c->p[2], c->q[0]);
      break;
    case OP_DENSE_BWD:
      o->dense_backward(ctx, c->n, c->in, c->out, c->p[0], c->p[1], c->p[2], c->q[0], c->q[1],
                        c->q[2]);
      break;
    case OP_RELU_FWD: o->relu_forward(ctx, c->len, c->p[0], c->q[0]); break;
    case OP_RELU_BWD: o->relu_backward(ctx, c->len, c->p[0], c->p[1], c->q[0]); break;
    case OP_ADD: o->add(ctx, c->len, c->p[0], c->p[1], c->q[0]); break;
    case OP_DROP_FWD:
      o->dropout_forward(ctx, c->len, c->rate, c->seed, f->rng_base + c->stream, c->p[0], c->q[0],
                         c->q[1]);
      break;
    case OP_DROP_BWD: o->dropout_backward(ctx, c->len, c->p[0], c->p[1], c->q[0]); break;
    case OP_XENT_STATS:
      o->softmax_xent_stats(ctx, c->n, c->k, c->p[0], c->p[1], c->q[0], c->q[1]);
      break;
    case OP_XENT_BWD: o->softmax_xent_backward(ctx, c->n, c->k, c->p[0], c->p[1], c->q[0]); break;
    case OP_BN_TRAIN:
      o->batchnorm_forward_train(ctx, c->n, c->k, c->in, c->alpha, c->p[0], c->p[1], c->p[2],
                                 c->q[0], c->q[1], c->q[2], c->q[3]);
      break;
    case OP_BN_INFER:
      o->batchnorm_forward_infer(ctx, c->n, c->k, c->in, c->alpha, c->p[0], c->p[1], c->p[2],
                                 c->p[3], c->p[4], c->q[0]);
      break;
    case OP_BN_BWD:
      o->batchnorm_backward(ctx, c->n, c->k, c->in, c->p[0], c->p[1], c->p[2], c->p[3], c->p[4],
                            c->q[0], c->q[1], c->q[2]);
      break;
    case OP_EMB_FWD:
      o->embedding_bag_forward(ctx, c->n, c->in, c->p[0], c->p[1], c->k, c->p[2], c->q[0]);
      break;
    case OP_EMB_BWD:
      o->embedding_bag_backward(ctx, c->n, c->in, c->p[0], c->out, c->p[1], c->p[2], c->k, c->p[3],
                                c->q[0]);
      break;
    case OP_COPY_COLS: o->copy_cols(ctx, c->n, c->in, c->p[0], c->out, c->q[0], c->k); break;
    case OP_SIGMOID_FWD:
      o->sigmoid_xent_forward(ctx, c->n, c->p[0], c->p[1], c->q[0], c->q[1]);
      break;
    case OP_SIGMOID_BWD: o->sigmoid_xent_backward(ctx, c->n, c->p[0], c->p[1], c->q[0]); break;
    case OP_FM_FWD: o->fm_forward(ctx, c->n, c->in, c->out, c->p[0], c->q[0]); break;
    case OP_FM_BWD: o->fm_backward(ctx, c->n, c->in, c->out, c->p[0], c->p[1], c->q[0]); break;
    case OP_SCALE: o->scale(ctx, c->len, c->alpha, c->q[0]); break;
    case OP_COPY: memcpy(c->q[0], c->p[0], c->len); break;
    case OP_MARK: o->mark(ctx, c->n); break;
    default: abort();
  }
}

/* A checked op: run now, or kept while recording. */
static void call(emu_dev *f, em_call c) {
  if (!f->recording) {
    run_call(f, &c);
    return;
  }
  if (f->n_rec == f->cap_rec) {
    int cap = f->cap_rec ? 2 * f->cap_rec : 64;
    em_call *grown = realloc(f->rec, (size_t)cap * sizeof *grown);
    if (!grown) {
      fprintf(stderr, "emu device: out of host memory recording a graph\n");
      abort();
    }
    f->rec = grown;
    f->cap_rec = cap;
  }
  f->rec[f->n_rec++] = c;
}

/* What a GPU cannot do inside a stream capture (wait, copy to or from the
 * host, allocate): stop and say what, as CUDA would fail the capture. */
static void not_recording(const emu_dev *f, const char *what) {
  if (!f->recording) return;
  fprintf(stderr, "emu device: %s while recording a graph (a GPU's stream capture would fail)\n",
          what);
  abort();
}

static int em_graph_begin(void *ctx) {
  emu_dev *f = enter(ctx);
  if (f->recording) return PS_ESTATE;
  f->recording = 1;
  f->n_rec = 0;
  return 0;
}

static int em_graph_end(void *ctx) {
  emu_dev *f = enter(ctx);
  if (!f->recording) return PS_ESTATE;
  f->recording = 0;
  free(f->graph);
  f->graph = NULL;
  f->n_graph = 0;
  if (f->n_rec) {
    f->graph = malloc((size_t)f->n_rec * sizeof *f->graph);
    if (!f->graph) return PS_ENOMEM;
    memcpy(f->graph, f->rec, (size_t)f->n_rec * sizeof *f->graph);
  }
  f->n_graph = f->n_rec;
  f->graphs++;
  return 0;
}

/* Each op again, its pointers checked again (a block freed since would
 * fault on a GPU). */
static int em_graph_launch(void *ctx) {
  emu_dev *f = enter(ctx);
  not_recording(f, "graph_launch");
  if (!f->graph && f->n_graph == 0 && f->graphs == 0) return PS_ESTATE;
  for (int i = 0; i < f->n_graph; i++) {
    const em_call *c = &f->graph[i];
    for (int j = 0; j < CALL_PTRS; j++) {
      if (c->p[j] && c->op != OP_MARK) need(f, c->p[j], 1, 0, "graph launch: a pointer read");
      if (c->q[j] && c->op != OP_MARK) need(f, c->q[j], 1, 0, "graph launch: a pointer written");
    }
    run_call(f, c);
  }
  f->launches++;
  return 0;
}

static size_t em_conv2d_workspace(void *ctx, const ps_conv_shape *s) {
  emu_dev *f = enter(ctx);
  return f->cpu->conv2d_workspace(f->cpu->ctx, s);
}

static void conv_need(emu_dev *f, const ps_conv_shape *s, const float *x, const float *w,
                      const float *b, const float *y, const float *work) {
  const size_t n = (size_t)s->n;
  need(f, x, n * s->c * s->h * s->w * F4, 0, "conv x");
  need(f, w, (size_t)s->oc * s->c * s->kh * s->kw * F4, 0, "conv w");
  need(f, b, (size_t)s->oc * F4, 0, "conv b");
  need(f, y, n * s->oc * s->oh * s->ow * F4, 0, "conv y");
  need(f, work, f->cpu->conv2d_workspace(f->cpu->ctx, s) * F4, 0, "conv work");
}

static void em_conv2d_forward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                              const float *b, float *y, float *work) {
  emu_dev *f = enter(ctx);
  conv_need(f, s, x, w, b, y, work);
  call(f, (em_call){.op = OP_CONV_FWD, .cs = *s, .p = {x, w, b}, .q = {y, work}});
}

static void em_conv2d_backward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                               const float *dy, float *dx, float *dw, float *db, float *work) {
  emu_dev *f = enter(ctx);
  conv_need(f, s, x, w, db, dy, work); /* db has b's size, dy y's */
  need(f, dx, (size_t)s->n * s->c * s->h * s->w * F4, 1, "conv dx");
  need(f, dw, (size_t)s->oc * s->c * s->kh * s->kw * F4, 0, "conv dw");
  call(f, (em_call){.op = OP_CONV_BWD, .cs = *s, .p = {x, w, dy}, .q = {dx, dw, db, work}});
}

static void em_maxpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                               int32_t *argmax) {
  emu_dev *f = enter(ctx);
  const size_t planes = (size_t)s->n * s->c;
  need(f, x, planes * s->h * s->w * F4, 0, "maxpool x");
  need(f, y, planes * s->oh * s->ow * F4, 0, "maxpool y");
  need(f, argmax, planes * s->oh * s->ow * sizeof(int32_t), 1, "maxpool argmax");
  call(f, (em_call){.op = OP_POOL_FWD, .ps = *s, .p = {x}, .q = {y, argmax}});
}

static void em_maxpool_backward(void *ctx, const ps_pool_shape *s, const float *dy,
                                const int32_t *argmax, float *dx) {
  emu_dev *f = enter(ctx);
  const size_t planes = (size_t)s->n * s->c;
  need(f, dy, planes * s->oh * s->ow * F4, 0, "maxpool dy");
  need(f, argmax, planes * s->oh * s->ow * sizeof(int32_t), 0, "maxpool argmax");
  need(f, dx, planes * s->h * s->w * F4, 0, "maxpool dx");
  call(f, (em_call){.op = OP_POOL_BWD, .ps = *s, .p = {dy, argmax}, .q = {dx}});
}

static void em_avgpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y) {
  emu_dev *f = enter(ctx);
  const size_t planes = (size_t)s->n * s->c;
  need(f, x, planes * s->h * s->w * F4, 0, "avgpool x");
  need(f, y, planes * s->oh * s->ow * F4, 0, "avgpool y");
  call(f, (em_call){.op = OP_AVGPOOL_FWD, .ps = *s, .p = {x}, .q = {y}});
}

static void em_avgpool_backward(void *ctx, const ps_pool_shape *s, const float *dy, float *dx) {
  emu_dev *f = enter(ctx);
  const size_t planes = (size_t)s->n * s->c;
  need(f, dy, planes * s->oh * s->ow * F4, 0, "avgpool dy");
  need(f, dx, planes * s->h * s->w * F4, 0, "avgpool dx");
  call(f, (em_call){.op = OP_AVGPOOL_BWD, .ps = *s, .p = {dy}, .q = {dx}});
}

/* The plane's shape travels in the call's pool shape (size and stride
 * unused). */
static void em_global_avgpool_forward(void *ctx, int n, int c, int h, int w, const float *x,
                                      float *y) {
  emu_dev *f = enter(ctx);
  const size_t planes = (size_t)n * c;
  need(f, x, planes * h * w * F4, 0, "global_avgpool x");
  need(f, y, planes * F4, 0, "global_avgpool y");
  call(f, (em_call){.op = OP_GAP_FWD, .ps = {.n = n, .c = c, .h = h, .w = w}, .p = {x}, .q = {y}});
}

static void em_global_avgpool_backward(void *ctx, int n, int c, int h, int w, const float *dy,
                                       float *dx) {
  emu_dev *f = enter(ctx);
  const size_t planes = (size_t)n * c;
  need(f, dy, planes * F4, 0, "global_avgpool dy");
  need(f, dx, planes * h * w * F4, 0, "global_avgpool dx");
  call(f,
       (em_call){.op = OP_GAP_BWD, .ps = {.n = n, .c = c, .h = h, .w = w}, .p = {dy}, .q = {dx}});
}

/* Batch normalization: n, c (k), hw (in) and eps (alpha) travel in the
 * call. */
static void em_batchnorm_forward_train(void *ctx, int n, int c, int hw, float eps, const float *x,
                                       const float *gamma, const float *beta, float *y,
                                       float *mean, float *var, float *invstd) {
  emu_dev *f = enter(ctx);
  const size_t all = (size_t)n * c * hw * F4, ch = (size_t)c * F4;
  need(f, x, all, 0, "batchnorm x");
  need(f, gamma, ch, 0, "batchnorm gamma");
  need(f, beta, ch, 0, "batchnorm beta");
  need(f, y, all, 0, "batchnorm y");
  need(f, mean, ch, 0, "batchnorm mean");
  need(f, var, ch, 0, "batchnorm var");
  need(f, invstd, ch, 0, "batchnorm invstd");
  call(f, (em_call){.op = OP_BN_TRAIN, .n = n, .k = c, .in = hw, .alpha = eps,
                    .p = {x, gamma, beta}, .q = {y, mean, var, invstd}});
}

static void em_batchnorm_forward_infer(void *ctx, int n, int c, int hw, float eps, const float *x,
                                       const float *gamma, const float *beta, const float *mean,
                                       const float *var, float *y) {
  emu_dev *f = enter(ctx);
  const size_t all = (size_t)n * c * hw * F4, ch = (size_t)c * F4;
  need(f, x, all, 0, "batchnorm x");
  need(f, gamma, ch, 0, "batchnorm gamma");
  need(f, beta, ch, 0, "batchnorm beta");
  need(f, mean, ch, 0, "batchnorm mean");
  need(f, var, ch, 0, "batchnorm var");
  need(f, y, all, 0, "batchnorm y");
  call(f, (em_call){.op = OP_BN_INFER, .n = n, .k = c, .in = hw, .alpha = eps,
                    .p = {x, gamma, beta, mean, var}, .q = {y}});
}

static void em_batchnorm_backward(void *ctx, int n, int c, int hw, const float *x,
                                  const float *dy, const float *gamma, const float *mean,
                                  const float *invstd, float *dx, float *dgamma, float *dbeta) {
  emu_dev *f = enter(ctx);
  const size_t all = (size_t)n * c * hw * F4, ch = (size_t)c * F4;
  need(f, x, all, 0, "batchnorm x");
  need(f, dy, all, 0, "batchnorm dy");
  need(f, gamma, ch, 0, "batchnorm gamma");
  need(f, mean, ch, 0, "batchnorm mean");
  need(f, invstd, ch, 0, "batchnorm invstd");
  need(f, dx, all, 1, "batchnorm dx");
  need(f, dgamma, ch, 0, "batchnorm dgamma");
  need(f, dbeta, ch, 0, "batchnorm dbeta");
  call(f, (em_call){.op = OP_BN_BWD, .n = n, .k = c, .in = hw, .p = {x, dy, gamma, mean, invstd},
                    .q = {dx, dgamma, dbeta}});
}

static void em_dense_forward(void *ctx, int n, int in, int out, const float *x, const float *w,
                             const float *b, float *y) {
  emu_dev *f = enter(ctx);
  need(f, x, (size_t)n * in * F4, 0, "dense x");
  need(f, w, (size_t)out * in * F4, 0, "dense w");
  need(f, b, (size_t)out * F4, 0, "dense b");
  need(f, y, (size_t)n * out * F4, 0, "dense y");
  call(f, (em_call){.op = OP_DENSE_FWD, .n = n, .in = in, .out = out, .p = {x, w, b}, .q = {y}});
}

static void em_dense_backward(void *ctx, int n, int in, int out, const float *x, const float *w,
                              const float *dy, float *dx, float *dw, float *db) {
  emu_dev *f = enter(ctx);
  need(f, x, (size_t)n * in * F4, 0, "dense x");
  need(f, w, (size_t)out * in * F4, 0, "dense w");
  need(f, dy, (size_t)n * out * F4, 0, "dense dy");
  need(f, dx, (size_t)n * in * F4, 1, "dense dx");
  need(f, dw, (size_t)out * in * F4, 0, "dense dw");
  need(f, db, (size_t)out * F4, 0, "dense db");
  call(f, (em_call){.op = OP_DENSE_BWD, .n = n, .in = in, .out = out, .p = {x, w, dy},
                     .q = {dx, dw, db}});
}

static void em_relu_forward(void *ctx, size_t n, const float *x, float *y) {
  emu_dev *f = enter(ctx);
  need(f, x, n * F4, 0, "relu x");
  need(f, y, n * F4, 0, "relu y");
  call(f, (em_call){.op = OP_RELU_FWD, .len = n, .p = {x}, .q = {y}});
}

static void em_relu_backward(void *ctx, size_t n, const float *y, const float *dy, float *dx) {
  emu_dev *f = enter(ctx);
  need(f, y, n * F4, 0, "relu y");
  need(f, dy, n * F4, 0, "relu dy");
  need(f, dx, n * F4, 0, "relu dx");
  call(f, (em_call){.op = OP_RELU_BWD, .len = n, .p = {y, dy}, .q = {dx}});
}

static void em_add(void *ctx, size_t n, const float *a, const float *b, float *y) {
  emu_dev *f = enter(ctx);
  need(f, a, n * F4, 0, "add a");
  need(f, b, n * F4, 0, "add b");
  need(f, y, n * F4, 0, "add y");
  call(f, (em_call){.op = OP_ADD, .len = n, .p = {a, b}, .q = {y}});
}

static void em_dropout_forward(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                               const float *x, float *y, float *mask) {
  emu_dev *f = enter(ctx);
  need(f, x, n * F4, 0, "dropout x");
  need(f, y, n * F4, 0, "dropout y");
  need(f, mask, n * F4, 0, "dropout mask");
  call(f, (em_call){.op = OP_DROP_FWD, .len = n, .rate = rate, .seed = seed, .stream = stream,
                     .p = {x}, .q = {y, mask}});
}

static void em_set_rng_step(void *ctx, uint64_t base) {
  emu_dev *f = enter(ctx);
  not_recording(f, "set_rng_step"); /* a copy to the device: outside a recording */
  f->rng_base = base;
}

static void em_dropout_backward(void *ctx, size_t n, const float *mask, const float *dy,
                                float *dx) {
  emu_dev *f = enter(ctx);
  need(f, mask, n * F4, 0, "dropout mask");
  need(f, dy, n * F4, 0, "dropout dy");
  need(f, dx, n * F4, 0, "dropout dx");
  call(f, (em_call){.op = OP_DROP_BWD, .len = n, .p = {mask, dy}, .q = {dx}});
}

static float em_softmax_xent_forward(void *ctx, int n, int k, const float *logits,
                                     const uint8_t *labels, float *probs) {
  emu_dev *f = enter(ctx);
  not_recording(f, "softmax_xent_forward (it waits for its result)");
  need(f, logits, (size_t)n * k * F4, 0, "softmax logits");
  need(f, labels, (size_t)n, 0, "softmax labels");
  need(f, probs, (size_t)n * k * F4, 0, "softmax probs");
  return f->cpu->softmax_xent_forward(f->cpu->ctx, n, k, logits, labels, probs);
}

static void em_softmax_xent_stats(void *ctx, int n, int k, const float *logits,
                                  const uint8_t *labels, float *probs, double *stats) {
  emu_dev *f = enter(ctx);
  need(f, logits, (size_t)n * k * F4, 0, "softmax logits");
  need(f, labels, (size_t)n, 0, "softmax labels");
  need(f, probs, (size_t)n * k * F4, 0, "softmax probs");
  need(f, stats, 2 * sizeof(double), 0, "softmax stats");
  call(f, (em_call){.op = OP_XENT_STATS, .n = n, .k = k, .p = {logits, labels}, .q = {probs, stats}});
}

static void em_softmax_xent_backward(void *ctx, int n, int k, const float *probs,
                                     const uint8_t *labels, float *dlogits) {
  emu_dev *f = enter(ctx);
  need(f, probs, (size_t)n * k * F4, 0, "softmax probs");
  need(f, labels, (size_t)n, 0, "softmax labels");
  need(f, dlogits, (size_t)n * k * F4, 0, "softmax dlogits");
  call(f, (em_call){.op = OP_XENT_BWD, .n = n, .k = k, .p = {probs, labels}, .q = {dlogits}});
}

/* ---- embeddings ----
 * Besides the pointers, what a GPU would fault on or read out of bounds
 * through the index arrays: offsets that decrease or do not start at 0, an
 * idx below 0 or past the rows given, a reverse entry that is not an
 * example. The index arrays are read here, so only when the op runs now:
 * while recording a graph their contents are those of before the copies
 * that precede the launch, and only the fixed-size arrays are checked. */

static void emb_fault(const char *what, long at, long value) {
  fprintf(stderr, "emu device: %s: entry %ld is %ld\n", what, at, value);
  abort();
}

/* offsets (n+1) lies in device memory, starts at 0 and never decreases;
 * returns offsets[n] (0 while recording). */
static int32_t need_offsets(emu_dev *f, int n, const int32_t *offsets, const char *what) {
  need(f, offsets, ((size_t)n + 1) * sizeof(int32_t), 0, what);
  if (f->recording) return 0;
  if (offsets[0] != 0) emb_fault(what, 0, offsets[0]);
  for (int e = 0; e < n; e++)
    if (offsets[e + 1] < offsets[e]) emb_fault(what, e + 1, offsets[e + 1]);
  return offsets[n];
}

/* The entries of a (count of them) lie in [0, limit); returns the largest
 * plus 1 (0 for none). limit < 0: no upper limit. */
static long need_indices(const int32_t *a, int32_t count, long limit, const char *what) {
  long top = 0;
  for (int32_t k = 0; k < count; k++) {
    if (a[k] < 0 || (limit >= 0 && a[k] >= limit)) emb_fault(what, k, a[k]);
    if (a[k] + 1L > top) top = a[k] + 1L;
  }
  return top;
}

static void em_embedding_bag_forward(void *ctx, int n, int dim, const int32_t *offsets,
                                     const int32_t *idx, int mean, const float *rows, float *y) {
  emu_dev *f = enter(ctx);
  const size_t d = (size_t)(dim > 0 ? dim : 0);
  const int32_t total = need_offsets(f, n, offsets, "embedding_bag_forward offsets");
  need(f, idx, (size_t)total * sizeof(int32_t), 0, "embedding_bag_forward idx");
  const long u = f->recording ? 1 : need_indices(idx, total, -1, "embedding_bag_forward idx");
  need(f, rows, (size_t)u * d * F4, 0, "embedding_bag_forward rows");
  need(f, y, (size_t)n * d * F4, 0, "embedding_bag_forward y");
  call(f, (em_call){
              .op = OP_EMB_FWD, .n = n, .in = dim, .k = mean, .p = {offsets, idx, rows}, .q = {y}});
}

static void em_embedding_bag_backward(void *ctx, int n, int dim, const int32_t *offsets, int u,
                                      const int32_t *rev_off, const int32_t *rev_ex, int mean,
                                      const float *dy, float *drows) {
  emu_dev *f = enter(ctx);
  const size_t d = (size_t)(dim > 0 ? dim : 0);
  need_offsets(f, n, offsets, "embedding_bag_backward offsets");
  const int32_t entries = need_offsets(f, u, rev_off, "embedding_bag_backward rev_off");
  need(f, rev_ex, (size_t)entries * sizeof(int32_t), 0, "embedding_bag_backward rev_ex");
  if (!f->recording) need_indices(rev_ex, entries, n, "embedding_bag_backward rev_ex");
  need(f, dy, (size_t)n * d * F4, 0, "embedding_bag_backward dy");
  need(f, drows, (size_t)u * d * F4, 0, "embedding_bag_backward drows");
  call(f, (em_call){.op = OP_EMB_BWD,
                    .n = n,
                    .in = dim,
                    .out = u,
                    .k = mean,
                    .p = {offsets, rev_off, rev_ex, dy},
                    .q = {drows}});
}

/* The extent of n rows of width floats, stride apart: the last row's end. */
static size_t cols_extent(int n, int width, int stride) {
  return n > 0 && width > 0 ? ((size_t)(n - 1) * (size_t)stride + (size_t)width) * F4 : 0;
}

static void em_copy_cols(void *ctx, int n, int width, const float *src, int src_stride, float *dst,
                         int dst_stride) {
  emu_dev *f = enter(ctx);
  if (n > 0 && width > 0 && (src_stride < width || dst_stride < width)) {
    fprintf(stderr, "emu device: copy_cols: width %d over a stride of %d and %d\n", width,
            src_stride, dst_stride);
    abort();
  }
  need(f, src, cols_extent(n, width, src_stride), 0, "copy_cols src");
  need(f, dst, cols_extent(n, width, dst_stride), 0, "copy_cols dst");
  call(f, (em_call){.op = OP_COPY_COLS,
                    .n = n,
                    .in = width,
                    .out = src_stride,
                    .k = dst_stride,
                    .p = {src},
                    .q = {dst}});
}

static void em_sigmoid_xent_forward(void *ctx, int n, const float *logits, const float *labels,
                                    float *probs, double *stats) {
  emu_dev *f = enter(ctx);
  const size_t bytes = (size_t)(n > 0 ? n : 0) * F4;
  need(f, logits, bytes, 0, "sigmoid_xent logits");
  need(f, labels, bytes, 0, "sigmoid_xent labels");
  need(f, probs, bytes, 0, "sigmoid_xent probs");
  need(f, stats, 2 * sizeof(double), 0, "sigmoid_xent stats");
  call(f, (em_call){.op = OP_SIGMOID_FWD, .n = n, .p = {logits, labels}, .q = {probs, stats}});
}

static void em_sigmoid_xent_backward(void *ctx, int n, const float *probs, const float *labels,
                                     float *dlogits) {
  emu_dev *f = enter(ctx);
  const size_t bytes = (size_t)(n > 0 ? n : 0) * F4;
  need(f, probs, bytes, 0, "sigmoid_xent probs");
  need(f, labels, bytes, 0, "sigmoid_xent labels");
  need(f, dlogits, bytes, 0, "sigmoid_xent dlogits");
  call(f, (em_call){.op = OP_SIGMOID_BWD, .n = n, .p = {probs, labels}, .q = {dlogits}});
}

static void em_fm_forward(void *ctx, int n, int f, int d, const float *x, float *y) {
  emu_dev *e = enter(ctx);
  const size_t nn = (size_t)(n > 0 ? n : 0), ff = (size_t)(f > 0 ? f : 0);
  const size_t dd = (size_t)(d > 0 ? d : 0);
  need(e, x, nn * ff * dd * F4, 0, "fm x");
  need(e, y, nn * dd * F4, 0, "fm y");
  call(e, (em_call){.op = OP_FM_FWD, .n = n, .in = f, .out = d, .p = {x}, .q = {y}});
}

static void em_fm_backward(void *ctx, int n, int f, int d, const float *x, const float *dy,
                           float *dx) {
  emu_dev *e = enter(ctx);
  const size_t nn = (size_t)(n > 0 ? n : 0), ff = (size_t)(f > 0 ? f : 0);
  const size_t dd = (size_t)(d > 0 ? d : 0);
  need(e, x, nn * ff * dd * F4, 0, "fm x");
  need(e, dy, nn * dd * F4, 0, "fm dy");
  need(e, dx, nn * ff * dd * F4, 0, "fm dx");
  call(e, (em_call){.op = OP_FM_BWD, .n = n, .in = f, .out = d, .p = {x, dy}, .q = {dx}});
}

static void *em_alloc(void *ctx, size_t bytes) {
  emu_dev *f = enter(ctx);
  not_recording(f, "alloc");
  if (f->allocs++ == f->fail_at || f->n_blocks == MAX_BLOCKS) return NULL;
  void *p = ps_alloc(bytes);
  if (!p) return NULL;
  f->blocks[f->n_blocks].p = p;
  f->blocks[f->n_blocks].bytes = bytes;
  f->n_blocks++;
  return p;
}

static void em_free(void *ctx, void *p) {
  emu_dev *f = enter(ctx);
  not_recording(f, "free");
  if (!p) return;
  for (int i = 0; i < f->n_blocks; i++)
    if (f->blocks[i].p == p) {
      f->blocks[i] = f->blocks[--f->n_blocks];
      ps_free(p);
      return;
    }
  fprintf(stderr, "emu device: free of %p, which is not a device block\n", p);
  abort();
}

static void em_to_device(void *ctx, void *dst, const void *src_host, size_t bytes) {
  emu_dev *f = enter(ctx);
  not_recording(f, "to_device");
  need(f, dst, bytes, 0, "to_device dst");
  if (bytes && in_block(f, src_host, 1)) {
    fprintf(stderr, "emu device: to_device from device memory\n");
    abort();
  }
  if (bytes) memcpy(dst, src_host, bytes);
}

static void em_to_host(void *ctx, void *dst_host, const void *src, size_t bytes) {
  emu_dev *f = enter(ctx);
  not_recording(f, "to_host");
  need(f, src, bytes, 0, "to_host src");
  if (bytes && in_block(f, dst_host, 1)) {
    fprintf(stderr, "emu device: to_host into device memory\n");
    abort();
  }
  if (!bytes) return;
  if (f->n_pending == MAX_PENDING) flush(f);
  f->pending[f->n_pending].dst = dst_host;
  f->pending[f->n_pending].src = src;
  f->pending[f->n_pending].bytes = bytes;
  f->n_pending++;
}

static void em_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  emu_dev *f = enter(ctx);
  need(f, dst, bytes, 0, "copy dst");
  need(f, src, bytes, 0, "copy src");
  if (bytes && dst != src) call(f, (em_call){.op = OP_COPY, .len = bytes, .p = {src}, .q = {dst}});
}

/* Lands the asynchronous copies up to ticket t, in order. */
static void land(emu_dev *f, uint64_t t) {
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

static void em_sync(void *ctx) {
  emu_dev *f = enter(ctx);
  not_recording(f, "sync");
  land(f, UINT64_MAX);
}

/* Whether [p, p+bytes) lies inside one of host_alloc's blocks. */
static int in_host_block(emu_dev *f, const void *p, size_t bytes) {
  const char *c = p;
  int in = 0;
  pthread_mutex_lock(&f->host_mu);
  for (int i = 0; i < f->n_host && !in; i++)
    in = c >= f->host[i].p && bytes <= f->host[i].bytes &&
         (size_t)(c - f->host[i].p) <= f->host[i].bytes - bytes;
  pthread_mutex_unlock(&f->host_mu);
  return in;
}

static void *em_host_alloc(void *ctx, size_t bytes) {
  emu_dev *f = ctx; /* any thread: no queue is touched */
  void *p = ps_alloc(bytes ? bytes : 1);
  if (!p) return NULL;
  pthread_mutex_lock(&f->host_mu);
  if (f->n_host == MAX_BLOCKS) {
    pthread_mutex_unlock(&f->host_mu);
    ps_free(p);
    return NULL;
  }
  f->host[f->n_host].p = p;
  f->host[f->n_host].bytes = bytes;
  f->n_host++;
  pthread_mutex_unlock(&f->host_mu);
  return p;
}

static void em_host_free(void *ctx, void *p) {
  emu_dev *f = ctx;
  if (!p) return;
  pthread_mutex_lock(&f->host_mu);
  for (int i = 0; i < f->n_host; i++)
    if (f->host[i].p == p) {
      f->host[i] = f->host[--f->n_host];
      pthread_mutex_unlock(&f->host_mu);
      ps_free(p);
      return;
    }
  pthread_mutex_unlock(&f->host_mu);
  fprintf(stderr, "emu device: host_free of %p, which host_alloc did not give\n", p);
  abort();
}

static void em_mark(void *ctx, int i) {
  emu_dev *f = enter(ctx);
  call(f, (em_call){.op = OP_MARK, .n = i});
}

static void em_marks_read(void *ctx, double *ms, int n) {
  emu_dev *f = enter(ctx);
  not_recording(f, "marks_read");
  f->cpu->marks_read(f->cpu->ctx, ms, n);
}

static void em_to_device_async(void *ctx, void *dst, const void *src_host, size_t bytes) {
  emu_dev *f = ctx;
  f->async_copies += bytes > 0;
  if (bytes && !in_host_block(f, src_host, bytes)) f->pageable_async++;
  em_to_device(ctx, dst, src_host, bytes);
}

static uint64_t em_to_host_async(void *ctx, void *dst_host, const void *src, size_t bytes) {
  emu_dev *f = enter(ctx);
  not_recording(f, "to_host_async");
  f->async_copies += bytes > 0;
  if (bytes && !in_host_block(f, dst_host, bytes)) f->pageable_async++;
  need(f, src, bytes, 0, "to_host_async src");
  if (bytes && in_block(f, dst_host, 1)) {
    fprintf(stderr, "emu device: to_host_async into device memory\n");
    abort();
  }
  if (!bytes) return 0;
  if (f->n_async == MAX_ASYNC) land(f, f->async[0].ticket);
  void *then = malloc(bytes);
  if (!then) {
    fprintf(stderr, "emu device: out of host memory for an asynchronous copy\n");
    abort();
  }
  memcpy(then, src, bytes);
  f->async[f->n_async].dst = dst_host;
  f->async[f->n_async].bytes_then = then;
  f->async[f->n_async].bytes = bytes;
  f->async[f->n_async].ticket = ++f->last_ticket;
  f->async[f->n_async].asked = 0;
  f->n_async++;
  return f->last_ticket;
}

static int em_ticket_done(void *ctx, uint64_t ticket) {
  emu_dev *f = enter(ctx);
  for (int i = 0; i < f->n_async; i++)
    if (f->async[i].ticket == ticket && !f->async[i].asked++) return 0; /* not yet, once */
  land(f, ticket);
  return 1;
}

static void em_ticket_wait(void *ctx, uint64_t ticket) {
  emu_dev *f = enter(ctx);
  not_recording(f, "ticket_wait");
  land(f, ticket);
}

static void em_scale(void *ctx, size_t n, float alpha, float *x) {
  emu_dev *f = enter(ctx);
  need(f, x, n * F4, 0, "scale x");
  call(f, (em_call){.op = OP_SCALE, .len = n, .alpha = alpha, .q = {x}});
}


static void em_destroy(ps_ops *ops);

static void emu_init(emu_dev *f, ps_ops *cpu) {
  memset(f, 0, sizeof *f);
  f->cpu = cpu;
  f->fail_at = -1;
  f->ops = (ps_ops){
      .name = "emu",
      .ctx = f,
      .conv2d_workspace = em_conv2d_workspace,
      .conv2d_forward = em_conv2d_forward,
      .conv2d_backward = em_conv2d_backward,
      .maxpool_forward = em_maxpool_forward,
      .maxpool_backward = em_maxpool_backward,
      .avgpool_forward = em_avgpool_forward,
      .avgpool_backward = em_avgpool_backward,
      .global_avgpool_forward = em_global_avgpool_forward,
      .global_avgpool_backward = em_global_avgpool_backward,
      .batchnorm_forward_train = em_batchnorm_forward_train,
      .batchnorm_forward_infer = em_batchnorm_forward_infer,
      .batchnorm_backward = em_batchnorm_backward,
      .dense_forward = em_dense_forward,
      .dense_backward = em_dense_backward,
      .relu_forward = em_relu_forward,
      .relu_backward = em_relu_backward,
      .add = em_add,
      .dropout_forward = em_dropout_forward,
      .set_rng_step = em_set_rng_step,
      .dropout_backward = em_dropout_backward,
      .softmax_xent_forward = em_softmax_xent_forward,
      .softmax_xent_backward = em_softmax_xent_backward,
      .softmax_xent_stats = em_softmax_xent_stats,
      .destroy = em_destroy,
      .alloc = em_alloc,
      .free = em_free,
      .to_device = em_to_device,
      .to_host = em_to_host,
      .copy = em_copy,
      .sync = em_sync,
      .host_memory = 0,
      .to_device_async = em_to_device_async,
      .to_host_async = em_to_host_async,
      .ticket_done = em_ticket_done,
      .ticket_wait = em_ticket_wait,
      .scale = em_scale,
      .host_alloc = em_host_alloc,
      .host_free = em_host_free,
      .mark = em_mark,
      .graph_begin = em_graph_begin,
      .graph_end = em_graph_end,
      .graph_launch = em_graph_launch,
      .marks_read = em_marks_read,
      .embedding_bag_forward = em_embedding_bag_forward,
      .embedding_bag_backward = em_embedding_bag_backward,
      .copy_cols = em_copy_cols,
      .sigmoid_xent_forward = em_sigmoid_xent_forward,
      .sigmoid_xent_backward = em_sigmoid_xent_backward,
      .fm_forward = em_fm_forward,
      .fm_backward = em_fm_backward,
  };
}


static void em_destroy(ps_ops *ops) {
  if (!ops) return;
  emu_dev *f = ops->ctx;
  land(f, UINT64_MAX);
  flush(f);
  /* Like a device that goes away: what was not freed goes with it. */
  for (int i = 0; i < f->n_blocks; i++) ps_free((void *)f->blocks[i].p);
  for (int i = 0; i < f->n_host; i++) ps_free((void *)f->host[i].p);
  pthread_mutex_destroy(&f->host_mu);
  free(f->rec);
  free(f->graph);
  f->cpu->destroy(f->cpu);
  free(f);
}

ps_ops *ps_ops_emu_create(int threads) {
  emu_dev *f = malloc(sizeof *f);
  ps_ops *cpu = ps_ops_cpu_create(threads);
  if (!f || !cpu) {
    free(f);
    if (cpu) cpu->destroy(cpu);
    return NULL;
  }
  emu_init(f, cpu);
  pthread_mutex_init(&f->host_mu, NULL);
  return &f->ops;
}

static emu_dev *emu_of(const ps_ops *ops) {
  if (!ops || !ops->name || strcmp(ops->name, "emu") != 0) {
    fprintf(stderr, "emu device: a hook called with a table that is not the emu backend\n");
    abort();
  }
  return ops->ctx;
}

void ps_ops_emu_fail_alloc_at(ps_ops *ops, int call) { emu_of(ops)->fail_at = call; }

void ps_ops_emu_counts(const ps_ops *ops, ps_emu_counts *out) {
  const emu_dev *f = emu_of(ops);
  out->allocs = f->allocs;
  out->blocks = f->n_blocks;
  out->pending = f->n_pending + f->n_async;
  out->host_blocks = f->n_host;
  out->async_copies = f->async_copies;
  out->graphs = f->graphs;
  out->launches = f->launches;
  out->pageable_async = f->pageable_async;
}

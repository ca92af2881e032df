/* The oneDNN CPU backend (see ops_dnnl.h).
 *
 * Convolution (forward, backward data, backward weights with the bias) is
 * oneDNN's primitives, created the first time a shape is seen and kept;
 * dense layers are OpenBLAS sgemm in parts (faster here than oneDNN's inner
 * product, see "dense"). Max and average pooling, batch normalization,
 * relu, dropout, the softmax and scale are OpenMP loops here, written to
 * give the reference's bits.
 *
 * Why blocked layouts. With plain NCHW activations oneDNN's convolutions
 * are no faster than the reference's im2col + sgemm; with nChw16c (16
 * channels of one pixel side by side, an AVX-512 register) its JIT kernels
 * run the quickstart CNN's convolutions about twice as fast on a 2-core
 * AVX-512 machine (nChw8c on AVX2, whose kernels have no 16-wide form: a
 * layout a JIT kernel does not take leaves oneDNN only its reference
 * loops, hundreds of times slower, so each convolution picks layouts
 * oneDNN has a kernel for, conv_choose). So a convolution writes its
 * output blocked when the buffer is this backend's, relu, pooling and
 * batch normalization work on it as it is, and the layout is recorded per
 * buffer (the buffer table below) for the next op. An op that needs NCHW (dense after
 * flatten, dropout, copies out) reorders first, in place.
 *
 * Why one OpenMP team. oneDNN here runs on OpenMP (Debian's libdnnl is
 * built on GNU OpenMP); a second team of our own (pthreads, or OpenBLAS's
 * threads) would spin against it for the same cores between ops, which on
 * 2 cores costs more than the faster convolutions gain. So every loop here
 * is an OpenMP loop, on the same team, and OpenBLAS (dense layers) runs
 * one thread inside each of the team's threads. The other
 * side of it: GNU OpenMP's threads spin for a while at the end of every
 * parallel region, which is what makes them fast on idle cores, and slow
 * when other processes want the same cores (then OMP_WAIT_POLICY=passive,
 * read by the OpenMP runtime when the program starts, is the setting). */
#include "ops_dnnl.h"

#include <cblas.h>
#include <dnnl.h>
#include <dnnl_debug.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/rng.h"
#include "../../common/util.h" /* ps_alloc, ps_free, ps_now_s */

/* Below this many elements an element-wise loop runs in the calling thread:
 * waking the team costs more than it saves. */
#define PARALLEL_MIN_FLOATS ((long)1 << 15)

/* A failed oneDNN call is a bug or out of memory inside an op, which has no
 * way to report it: say where, and stop. */
#define DNNL_CHECK(call) dn__check((call), #call, __FILE__, __LINE__)

static void dn__check(dnnl_status_t st, const char *what, const char *file, int line) {
  if (st == dnnl_success) return;
  fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, dnnl_status2str(st));
  abort();
}

static void *dn__xalloc(size_t bytes, const char *what) {
  void *p = ps_alloc(bytes);
  if (!p) {
    fprintf(stderr, "ops_dnnl: out of memory (%zu bytes for %s)\n", bytes, what);
    abort();
  }
  return p;
}

/* ---- layouts ----
 *
 * An activation (n, c, h, w) held with channel blocks of `blk` (1: NCHW,
 * 8: nChw8c, 16: nChw16c); blk divides c, so the blocked array has exactly
 * n*c*h*w elements and fits wherever the NCHW one does. s32: the elements
 * are int32 (maxpool's argmax), else float. */
typedef struct {
  int blk;
  int n, c, h, w;
  int s32;
} act_layout;

static size_t layout_elems(const act_layout *l) {
  return (size_t)l->n * l->c * l->h * l->w;
}

static int layout_equal(const act_layout *a, const act_layout *b) {
  return a->blk == b->blk && a->n == b->n && a->c == b->c && a->h == b->h && a->w == b->w;
}

/* The block an activation of c channels is held in when it can be: the
 * widest that oneDNN's JIT convolutions take on this CPU (max_blk: 16 on
 * AVX-512, 8 on AVX2 and SSE4.1, whose kernels have no nChw16c form: there
 * a 16-block layout would leave oneDNN only its reference convolution,
 * hundreds of times slower). */
static int pick_blk(int max_blk, int c) {
  return max_blk >= 16 && c % 16 == 0 ? 16 : c % 8 == 0 ? 8 : 1;
}

static dnnl_format_tag_t blk_tag(int blk) {
  return blk == 16 ? dnnl_nChw16c : blk == 8 ? dnnl_nChw8c : dnnl_nchw;
}

static void act_md(dnnl_memory_desc_t *md, int blk, int n, int c, int h, int w, int s32) {
  const dnnl_dims_t dims = {n, c, h, w};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(md, 4, dims, s32 ? dnnl_s32 : dnnl_f32, blk_tag(blk)));
}

/* ---- the backend ---- */

/* A buffer from alloc, and the layout of what the last op wrote at its
 * start (blk 1: NCHW, the state of every other buffer too). */
typedef struct {
  char *base;
  size_t bytes;
  act_layout lay;
  size_t prefix; /* blocked: the first `prefix` NCHW floats are in place (see below) */
  float *saved;  /* the blocked floats they displaced */
  size_t saved_cap;
} buf_entry;

/* A primitive kept for one shape and layout (key). Convolutions keep the
 * weights' layout they chose (md_w) and a buffer for the weights in it
 * when that is not the caller's (OC, IC, KH, KW). */
enum { P_CONV_FWD = 1, P_CONV_BWD_DATA, P_CONV_BWD_W, P_REORDER };
enum { KEY_INTS = 14 };

typedef struct {
  int k[KEY_INTS];
} prim_key;

typedef struct {
  prim_key key;
  dnnl_primitive_t prim;
  dnnl_memory_desc_t md_w;   /* the primitive's (diff) weights */
  int w_plain;               /* md_w is the caller's layout */
  dnnl_primitive_t w_reorder; /* caller's -> md_w, or md_w -> caller's (backward weights) */
  float *w_buf;              /* md_w's bytes when !w_plain */
  int ref;                   /* oneDNN's reference implementation (see note_impl) */
  int ref_counted;
  char what[40];             /* "convolution forward", ... */
} prim_entry;

enum { N_SCRATCH = 4 };

typedef struct {
  ps_ops ops; /* ops.ctx points back at this struct */
  int nthreads; /* 0: OpenMP's default */
  dnnl_engine_t eng;
  dnnl_stream_t stream;
  buf_entry *bufs;
  size_t n_bufs, cap_bufs;
  prim_entry **prims; /* each its own allocation: callers hold entries across additions */
  size_t n_prims, cap_prims;
  /* Scratch buffers, grown on demand: 0 and 1 for an op's reordered
   * operands, 2 and 3 for turning a buffer back into NCHW in place. */
  void *scratch[N_SCRATCH];
  size_t scratch_bytes[N_SCRATCH];
  double marks[PS_MARKS]; /* mark's host clock, seconds (0: not recorded) */
  int max_blk;            /* 16 or 8: see pick_blk */
  int ref_impls;          /* primitives for which oneDNN had only a reference implementation */
  char first_ref[160];    /* the first of them: "convolution backward_data: ref:any" */
} dnnl_backend;

/* Every op starts here: the calling thread's OpenMP team size (an OpenMP
 * setting is per thread, and the backend may be created in one thread and
 * used in another), which oneDNN also reads. */
static dnnl_backend *enter(void *ctx) {
  dnnl_backend *be = ctx;
  if (be->nthreads > 0 && omp_get_max_threads() != be->nthreads) omp_set_num_threads(be->nthreads);
  return be;
}

static void *scratch(dnnl_backend *be, int slot, size_t bytes) {
  if (be->scratch_bytes[slot] < bytes) {
    ps_free(be->scratch[slot]);
    be->scratch[slot] = dn__xalloc(bytes, "scratch");
    be->scratch_bytes[slot] = bytes;
  }
  return be->scratch[slot];
}

/* [*begin, *end): the calling thread's share of n items in a parallel
 * region (all of them outside one). */
static void thread_span(long n, long *begin, long *end) {
  const long t = omp_get_thread_num(), nt = omp_get_num_threads();
  *begin = n * t / nt;
  *end = n * (t + 1) / nt;
}

/* ---- the buffer table ----
 *
 * Each buffer from alloc has an entry: NCHW (lay.blk 1), or an activation
 * held blocked (lay) in its first layout_elems(lay) floats. Ops call
 * read_plain / write_plain for what they read or write as NCHW, and
 * write_blocked for a blocked output, before they touch the memory.
 *
 * A blocked buffer keeps its values wherever it is not written. Turning it
 * all into NCHW for a small write (the softmax's gradient landing at the
 * start of a gradient buffer that held a large blocked activation) would
 * cost a reorder of the whole buffer for a few floats, every step; so a
 * write of NCHW floats [0, k) at its start instead moves the blocked
 * floats it covers aside (saved) and records prefix = k: the first k NCHW
 * floats are in place, the rest still blocked. Reading [0, k) as NCHW is
 * then free; anything else puts the buffer back together as NCHW
 * (buf_make_plain), and a later write of the whole of it drops the state. */

/* The entry whose bytes hold p (its start for an empty one), or NULL. */
static buf_entry *buf_find(dnnl_backend *be, const void *p) {
  const char *c = p;
  for (size_t i = 0; i < be->n_bufs; i++) {
    buf_entry *e = &be->bufs[i];
    if (c == e->base || (c > e->base && c < e->base + e->bytes)) return e;
  }
  return NULL;
}

/* The entry when an op may hold `bytes` at p blocked: p starts a buffer of
 * ours that large; else NULL. */
static buf_entry *buf_taggable(dnnl_backend *be, const void *p, size_t bytes) {
  buf_entry *e = buf_find(be, p);
  return e && e->base == (const char *)p && e->bytes >= bytes ? e : NULL;
}

static void reorder(dnnl_backend *be, const void *src, const act_layout *from, void *dst,
                    int to_blk);

/* Turns a blocked buffer back into NCHW, in place (through scratch), with
 * its NCHW prefix where it is. */
static void buf_make_plain(dnnl_backend *be, buf_entry *e) {
  if (!e || e->lay.blk == 1) return;
  const size_t n = layout_elems(&e->lay), k = e->prefix;
  float *base = (float *)(void *)e->base;
  float *plain = scratch(be, 2, n * sizeof(float));
  float *head = k ? scratch(be, 3, k * sizeof(float)) : NULL;
  if (k) {
    memcpy(head, base, k * sizeof(float));
    memcpy(base, e->saved, k * sizeof(float));
  }
  reorder(be, base, &e->lay, plain, 1);
  memcpy(base + k, plain + k, (n - k) * sizeof(float));
  if (k) memcpy(base, head, k * sizeof(float));
  e->lay.blk = 1;
  e->prefix = 0;
}

/* elems floats at p are about to be read as NCHW. */
static void read_plain(dnnl_backend *be, const void *p, size_t elems) {
  buf_entry *e = buf_find(be, p);
  if (!e || e->lay.blk == 1) return;
  if ((const char *)p + elems * sizeof(float) <= e->base + e->prefix * sizeof(float)) return;
  buf_make_plain(be, e);
}

/* elems floats at p are about to be written as NCHW. */
static void write_plain(dnnl_backend *be, const void *p, size_t elems) {
  buf_entry *e = buf_find(be, p);
  if (!e || e->lay.blk == 1) return;
  const size_t n = layout_elems(&e->lay);
  if (e->base != (const char *)p) {
    if ((const char *)p + elems * sizeof(float) > e->base + e->prefix * sizeof(float))
      buf_make_plain(be, e);
    return;
  }
  if (elems >= n) { /* all of the blocked floats overwritten */
    e->lay.blk = 1;
    e->prefix = 0;
    return;
  }
  if (elems <= e->prefix) return;
  if (e->saved_cap < elems) {
    float *saved = ps_alloc(elems * sizeof(float));
    if (!saved) { /* no room to move them aside: the plain way */
      buf_make_plain(be, e);
      return;
    }
    if (e->prefix) memcpy(saved, e->saved, e->prefix * sizeof(float));
    ps_free(e->saved);
    e->saved = saved;
    e->saved_cap = elems;
  }
  const float *base = (const float *)(const void *)e->base;
  memcpy(e->saved + e->prefix, base + e->prefix, (elems - e->prefix) * sizeof(float));
  e->prefix = elems;
}

/* An op is about to write an activation in layout lay (blocked) at p,
 * which buf_taggable accepted. */
static void write_blocked(dnnl_backend *be, const void *p, const act_layout *lay) {
  buf_entry *e = buf_find(be, p);
  e->lay = *lay;
  e->prefix = 0;
}

/* An op writes the activation (n, c, h, w) at p with block blk. */
static void write_act(dnnl_backend *be, const void *p, int blk, int n, int c, int h, int w,
                      int s32) {
  const act_layout lay = {blk, n, c, h, w, s32};
  if (blk > 1)
    write_blocked(be, p, &lay);
  else
    write_plain(be, p, layout_elems(&lay));
}

/* The block of the activation (n, c, h, w) at p: the recorded one when p
 * starts a buffer holding exactly that shape, all blocked; otherwise 1,
 * with what is read made NCHW. */
static int view_blk(dnnl_backend *be, const void *p, int n, int c, int h, int w) {
  buf_entry *e = buf_find(be, p);
  if (!e || e->lay.blk == 1) return 1;
  const act_layout want = {e->lay.blk, n, c, h, w, e->lay.s32};
  if (e->base == (const char *)p && layout_equal(&e->lay, &want) && e->prefix == 0)
    return e->lay.blk;
  read_plain(be, p, layout_elems(&want));
  return 1;
}

/* ---- primitives ---- */

static prim_entry *prim_find(dnnl_backend *be, const prim_key *key) {
  for (size_t i = 0; i < be->n_prims; i++)
    if (memcmp(&be->prims[i]->key, key, sizeof *key) == 0) return be->prims[i];
  return NULL;
}

/* A new entry for key, the rest zeroed; the caller fills it in. */
static prim_entry *prim_add(dnnl_backend *be, const prim_key *key) {
  if (be->n_prims == be->cap_prims) {
    size_t cap = be->cap_prims ? 2 * be->cap_prims : 16;
    prim_entry **p = realloc(be->prims, cap * sizeof *p);
    if (!p) {
      fprintf(stderr, "ops_dnnl: out of memory for the primitive cache\n");
      abort();
    }
    be->prims = p;
    be->cap_prims = cap;
  }
  prim_entry *e = calloc(1, sizeof *e);
  if (!e) {
    fprintf(stderr, "ops_dnnl: out of memory for the primitive cache\n");
    abort();
  }
  e->key = *key;
  be->prims[be->n_prims++] = e;
  return e;
}

static dnnl_primitive_t make_prim(const_dnnl_primitive_desc_t pd) {
  dnnl_primitive_t p;
  DNNL_CHECK(dnnl_primitive_create(&p, pd));
  return p;
}

/* Runs primitive p on the given arguments (memory descriptors and
 * pointers), to completion. */
typedef struct {
  int arg;
  const dnnl_memory_desc_t *md;
  const void *ptr;
} exec_arg;

static void run_prim(dnnl_backend *be, dnnl_primitive_t p, int nargs, const exec_arg *args) {
  enum { MAX_ARGS = 6 };
  dnnl_exec_arg_t ea[MAX_ARGS];
  for (int i = 0; i < nargs; i++) {
    ea[i].arg = args[i].arg;
    DNNL_CHECK(dnnl_memory_create(&ea[i].memory, args[i].md, be->eng, (void *)args[i].ptr));
  }
  DNNL_CHECK(dnnl_primitive_execute(p, be->stream, nargs, ea));
  DNNL_CHECK(dnnl_stream_wait(be->stream));
  for (int i = 0; i < nargs; i++) dnnl_memory_destroy(ea[i].memory);
}

/* src (layout from) to dst in the same shape with block to_blk. */
static void reorder(dnnl_backend *be, const void *src, const act_layout *from, void *dst,
                    int to_blk) {
  const prim_key key = {{P_REORDER, from->blk, to_blk, from->n, from->c, from->h, from->w,
                         from->s32}};
  dnnl_memory_desc_t md_src, md_dst;
  act_md(&md_src, from->blk, from->n, from->c, from->h, from->w, from->s32);
  act_md(&md_dst, to_blk, from->n, from->c, from->h, from->w, from->s32);
  prim_entry *e = prim_find(be, &key);
  if (!e) {
    dnnl_primitive_desc_t pd;
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&pd, &md_src, be->eng, &md_dst, be->eng, NULL));
    dnnl_primitive_t p = make_prim(pd);
    dnnl_primitive_desc_destroy(pd);
    e = prim_add(be, &key);
    e->prim = p;
  }
  const exec_arg args[] = {{DNNL_ARG_FROM, &md_src, src}, {DNNL_ARG_TO, &md_dst, dst}};
  run_prim(be, e->prim, 2, args);
}

/* The weights' layout the primitive chose (queried as `what`), and, when it
 * is not the caller's (md_user), a buffer and a reorder between the two:
 * user -> md_w when to_prim, else md_w -> user. */
static void keep_weights(dnnl_backend *be, prim_entry *e, const_dnnl_primitive_desc_t pd,
                         dnnl_query_t what, const dnnl_memory_desc_t *md_user, int to_prim) {
  e->md_w = *dnnl_primitive_desc_query_md(pd, what, 0);
  e->w_plain = dnnl_memory_desc_equal(&e->md_w, md_user);
  if (e->w_plain) return;
  e->w_buf = dn__xalloc(dnnl_memory_desc_get_size(&e->md_w), "weights");
  dnnl_primitive_desc_t rpd;
  if (to_prim)
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&rpd, md_user, be->eng, &e->md_w, be->eng, NULL));
  else
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&rpd, &e->md_w, be->eng, md_user, be->eng, NULL));
  e->w_reorder = make_prim(rpd);
  dnnl_primitive_desc_destroy(rpd);
}

/* ---- convolution ---- */

typedef struct {
  dnnl_memory_desc_t src, wt, wt_any, bias, dst;
  dnnl_dims_t strides, pad;
} conv_mds;

static void conv_mds_init(conv_mds *m, const ps_conv_shape *s, int src_blk, int dst_blk) {
  act_md(&m->src, src_blk, s->n, s->c, s->h, s->w, 0);
  act_md(&m->dst, dst_blk, s->n, s->oc, s->oh, s->ow, 0);
  const dnnl_dims_t wdims = {s->oc, s->c, s->kh, s->kw}, bdims = {s->oc};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&m->wt, 4, wdims, dnnl_f32, dnnl_oihw));
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&m->wt_any, 4, wdims, dnnl_f32, dnnl_format_tag_any));
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&m->bias, 1, bdims, dnnl_f32, dnnl_x));
  m->strides[0] = m->strides[1] = s->stride;
  m->pad[0] = m->pad[1] = s->pad;
}

static prim_key conv_key(int kind, const ps_conv_shape *s, int src_blk, int dst_blk) {
  return (prim_key){{kind, s->n, s->c, s->h, s->w, s->oc, s->kh, s->kw, s->stride, s->pad,
                     src_blk, dst_blk}};
}

/* The forward descriptor: for the forward primitive, and as the hint the
 * backward ones are created with. The caller destroys it. */
static dnnl_primitive_desc_t conv_fwd_pd(dnnl_backend *be, const conv_mds *m) {
  dnnl_convolution_desc_t cd;
  DNNL_CHECK(dnnl_convolution_forward_desc_init(&cd, dnnl_forward_training,
                                                dnnl_convolution_direct, &m->src, &m->wt_any,
                                                &m->bias, &m->dst, m->strides, m->pad, m->pad));
  dnnl_primitive_desc_t pd;
  DNNL_CHECK(dnnl_primitive_desc_create(&pd, &cd, NULL, be->eng, NULL));
  return pd;
}

/* Whether oneDNN found only its reference implementation for pd (plain
 * loops: correct, but hundreds of times slower than the JIT kernels this
 * backend is for). */
static int is_ref_impl(const_dnnl_primitive_desc_t pd) {
  const char *impl = NULL;
  return dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
         impl && strncmp(impl, "ref", 3) == 0;
}

/* A reference-implementation primitive is about to run: counted once per
 * primitive, and said once on stderr. */
static void using_ref(dnnl_backend *be, prim_entry *e) {
  if (!e->ref || e->ref_counted) return;
  e->ref_counted = 1;
  if (be->ref_impls++ == 0) {
    snprintf(be->first_ref, sizeof be->first_ref, "%s: ref", e->what);
    fprintf(stderr,
            "ps-worker: warning: oneDNN has only its reference implementation for a %s of this "
            "shape on this CPU: slow; --device cpu-ref may be faster\n",
            e->what);
  }
}

static prim_entry *conv_prim(dnnl_backend *be, int kind, const ps_conv_shape *s, int src_blk,
                             int dst_blk, const conv_mds *m) {
  const prim_key key = conv_key(kind, s, src_blk, dst_blk);
  prim_entry *e = prim_find(be, &key);
  if (e) return e;
  dnnl_primitive_desc_t fwd = conv_fwd_pd(be, m), pd = fwd;
  dnnl_convolution_desc_t cd;
  if (kind == P_CONV_BWD_DATA) {
    DNNL_CHECK(dnnl_convolution_backward_data_desc_init(&cd, dnnl_convolution_direct, &m->src,
                                                        &m->wt_any, &m->dst, m->strides, m->pad,
                                                        m->pad));
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &cd, NULL, be->eng, fwd));
  } else if (kind == P_CONV_BWD_W) {
    DNNL_CHECK(dnnl_convolution_backward_weights_desc_init(&cd, dnnl_convolution_direct, &m->src,
                                                           &m->wt_any, &m->bias, &m->dst,
                                                           m->strides, m->pad, m->pad));
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &cd, NULL, be->eng, fwd));
  }
  e = prim_add(be, &key);
  e->prim = make_prim(pd);
  e->ref = is_ref_impl(pd);
  snprintf(e->what, sizeof e->what, "%s",
           kind == P_CONV_FWD       ? "convolution forward"
           : kind == P_CONV_BWD_DATA ? "convolution backward_data"
                                     : "convolution backward_weights");
  keep_weights(be, e, pd, kind == P_CONV_BWD_W ? dnnl_query_diff_weights_md : dnnl_query_weights_md,
               &m->wt, kind != P_CONV_BWD_W);
  if (pd != fwd) dnnl_primitive_desc_destroy(pd);
  dnnl_primitive_desc_destroy(fwd);
  return e;
}

/* The caller's weights w in the primitive's layout. */
static const float *weights_in(dnnl_backend *be, prim_entry *e, const conv_mds *m,
                               const float *w) {
  if (e->w_plain) return w;
  const exec_arg args[] = {{DNNL_ARG_FROM, &m->wt, w}, {DNNL_ARG_TO, &e->md_w, e->w_buf}};
  run_prim(be, e->w_reorder, 2, args);
  return e->w_buf;
}

/* Scratch is not needed: oneDNN keeps its own. */
static size_t dn_conv2d_workspace(void *ctx, const ps_conv_shape *s) {
  (void)ctx, (void)s;
  return 0;
}

/* Blocks of a convolution's two activation sides: a, its input side (src,
 * diff_src), and b, its output side (dst, diff_dst). */
typedef struct {
  int a, b;
} blk_pair;

/* The first of n candidate pairs for which oneDNN has a JIT kernel of
 * `kind` on this CPU (m set for it, its index in *chosen); if none has,
 * the first pair's, which is then oneDNN's reference (counted). Layouts
 * that mix NCHW and blocks, or 16-blocks on AVX2, can leave oneDNN
 * nothing but its reference loops, hundreds of times slower: callers list
 * the layouts the operands are in first, then ones they can be reordered
 * to or written in. */
static prim_entry *conv_choose(dnnl_backend *be, int kind, const ps_conv_shape *s,
                               const blk_pair *cands, int n, conv_mds *m, int *chosen) {
  for (int i = 0; i < n; i++) {
    int seen = 0;
    for (int j = 0; j < i; j++) seen |= cands[j].a == cands[i].a && cands[j].b == cands[i].b;
    if (seen) continue;
    conv_mds_init(m, s, cands[i].a, cands[i].b);
    prim_entry *e = conv_prim(be, kind, s, cands[i].a, cands[i].b, m);
    if (!e->ref) {
      *chosen = i;
      return e;
    }
  }
  conv_mds_init(m, s, cands[0].a, cands[0].b);
  prim_entry *e = conv_prim(be, kind, s, cands[0].a, cands[0].b, m);
  using_ref(be, e);
  *chosen = 0;
  return e;
}

/* p, an activation (n, c, h, w) held in block `have`, in block `want`:
 * p itself, or a copy in scratch slot. */
static const float *act_in(dnnl_backend *be, const float *p, int have, int want, int n, int c,
                           int h, int w, int slot) {
  if (have == want) return p;
  const act_layout from = {have, n, c, h, w, 0};
  float *q = scratch(be, slot, layout_elems(&from) * sizeof(float));
  reorder(be, p, &from, q, want);
  return q;
}

static void dn_conv2d_forward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                              const float *b, float *y, float *work) {
  (void)work;
  dnnl_backend *be = enter(ctx);
  if (s->n == 0 || s->oc == 0 || s->oh == 0 || s->ow == 0) return;
  const act_layout out = {pick_blk(be->max_blk, s->oc), s->n, s->oc, s->oh, s->ow, 0};
  const int y_blk = buf_taggable(be, y, layout_elems(&out) * 4) ? out.blk : 1;
  const int x_blk = view_blk(be, x, s->n, s->c, s->h, s->w);
  const blk_pair cands[] = {{x_blk, y_blk},
                            {pick_blk(be->max_blk, s->c), y_blk},
                            {x_blk, 1},
                            {1, 1}};
  conv_mds m;
  int k;
  prim_entry *e = conv_choose(be, P_CONV_FWD, s, cands, 4, &m, &k);
  const float *xp = act_in(be, x, x_blk, cands[k].a, s->n, s->c, s->h, s->w, 0);
  const float *wp = weights_in(be, e, &m, w);
  write_act(be, y, cands[k].b, s->n, s->oc, s->oh, s->ow, 0);
  const exec_arg args[] = {{DNNL_ARG_SRC, &m.src, xp}, {DNNL_ARG_WEIGHTS, &e->md_w, wp},
                           {DNNL_ARG_BIAS, &m.bias, b}, {DNNL_ARG_DST, &m.dst, y}};
  run_prim(be, e->prim, 4, args);
}

static void dn_conv2d_backward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                               const float *dy, float *dx, float *dw, float *db, float *work) {
  (void)work;
  dnnl_backend *be = enter(ctx);
  const size_t nw = (size_t)s->oc * s->c * s->kh * s->kw;
  if (s->n == 0 || s->oc == 0 || s->oh == 0 || s->ow == 0) {
    /* Nothing was summed: zero gradients, as the reference gives. */
    write_plain(be, dw, nw);
    write_plain(be, db, (size_t)s->oc);
    memset(dw, 0, nw * sizeof(float));
    memset(db, 0, (size_t)s->oc * sizeof(float));
    if (dx) {
      write_plain(be, dx, (size_t)s->n * s->c * s->h * s->w);
      memset(dx, 0, (size_t)s->n * s->c * s->h * s->w * sizeof(float));
    }
    return;
  }
  const int dy_blk = view_blk(be, dy, s->n, s->oc, s->oh, s->ow);
  const int x_blk = view_blk(be, x, s->n, s->c, s->h, s->w);
  const int c_blk = pick_blk(be->max_blk, s->c), oc_blk = pick_blk(be->max_blk, s->oc);
  /* Weights: x and dy as they are, both in their own blocks, or NCHW (the
   * only form with a kernel for a first convolution's few input channels
   * on AVX2: oneDNN's gemm convolution). */
  const blk_pair wc[] = {{x_blk, dy_blk}, {c_blk, oc_blk}, {x_blk, 1}, {1, 1}};
  conv_mds m;
  int k;
  prim_entry *e = conv_choose(be, P_CONV_BWD_W, s, wc, 4, &m, &k);
  const float *xp = act_in(be, x, x_blk, wc[k].a, s->n, s->c, s->h, s->w, 0);
  const float *dyp = act_in(be, dy, dy_blk, wc[k].b, s->n, s->oc, s->oh, s->ow, 1);
  float *dwp = e->w_plain ? dw : e->w_buf;
  write_plain(be, dw, nw);
  write_plain(be, db, (size_t)s->oc);
  const exec_arg args[] = {{DNNL_ARG_SRC, &m.src, xp}, {DNNL_ARG_DIFF_DST, &m.dst, dyp},
                           {DNNL_ARG_DIFF_WEIGHTS, &e->md_w, dwp},
                           {DNNL_ARG_DIFF_BIAS, &m.bias, db}};
  run_prim(be, e->prim, 4, args);
  if (!e->w_plain) {
    const exec_arg back[] = {{DNNL_ARG_FROM, &e->md_w, dwp}, {DNNL_ARG_TO, &m.wt, dw}};
    run_prim(be, e->w_reorder, 2, back);
  }
  if (!dx) return;
  const act_layout in = {c_blk, s->n, s->c, s->h, s->w, 0};
  const int dx_blk = buf_taggable(be, dx, layout_elems(&in) * 4) ? in.blk : 1;
  /* Data: dy as it is or in its own block; dx blocked where it can be. */
  const blk_pair dc[] = {{dx_blk, dy_blk}, {dx_blk, oc_blk}, {1, dy_blk}, {1, 1}};
  conv_mds md;
  prim_entry *ed = conv_choose(be, P_CONV_BWD_DATA, s, dc, 4, &md, &k);
  const float *dyd = act_in(be, dy, dy_blk, dc[k].b, s->n, s->oc, s->oh, s->ow, 1);
  const float *wp = weights_in(be, ed, &md, w);
  write_act(be, dx, dc[k].a, s->n, s->c, s->h, s->w, 0);
  const exec_arg dargs[] = {{DNNL_ARG_DIFF_DST, &md.dst, dyd}, {DNNL_ARG_WEIGHTS, &ed->md_w, wp},
                            {DNNL_ARG_DIFF_SRC, &md.src, dx}};
  run_prim(be, ed->prim, 3, dargs);
}

/* ---- max pooling ----
 *
 * One loop for every layout: plane q of the (n, c/blk) blocks holds blk
 * channels side by side (blk 1: one plane of NCHW), and the blk lanes of a
 * window are blk/4 vectors of four. Per lane it is the reference's
 * arithmetic in the reference's order: the first tap, then the others in
 * row-major order replacing the maximum only when greater (ties keep the
 * first; a NaN first tap stays, a later NaN never wins); backward adds each
 * gradient to a zeroed plane in (oh, ow) order. */

/* Four floats (or int32) as one SSE register, in GCC's vector extension:
 * the selects below compile to compares and masks at every build type,
 * where GCC's vectorizer turns the same selects written per element into
 * branches ("control flow in loop"), which random signs mispredict. Loads
 * and stores go through memcpy (any alignment). */
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

static inline f32x4 load4(const float *p) {
  f32x4 v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store4(void *p, const void *v) { memcpy(p, v, 16); }

/* a where mask, else b (mask lanes all ones or all zeros). */
static inline i32x4 select4(i32x4 mask, i32x4 a, i32x4 b) { return (a & mask) | (b & ~mask); }

/* One plane of 4*vecs channels: every window's lanes as vecs vectors.
 * Inlined with vecs and size constants (size 0: s->size), so that the
 * maxima stay in registers. */
static inline __attribute__((always_inline)) void pool_fwd_plane_vec(
    const ps_pool_shape *s, int vecs, int size, const float *restrict xq, float *restrict yq,
    int32_t *restrict aq) {
  enum { MAX_VECS = 4 };
  const int blk = 4 * vecs;
  if (size == 0) size = s->size;
  for (int oh = 0; oh < s->oh; oh++) {
    for (int ow = 0; ow < s->ow; ow++) {
      const int top = oh * s->stride * s->w + ow * s->stride;
      f32x4 best_v[MAX_VECS];
      i32x4 best[MAX_VECS];
      for (int q = 0; q < vecs; q++) {
        best_v[q] = load4(xq + (size_t)top * blk + 4 * q);
        best[q] = (i32x4){top, top, top, top};
      }
      for (int kh = 0; kh < size; kh++) {
        for (int kw = kh == 0 ? 1 : 0; kw < size; kw++) {
          const int at = top + kh * s->w + kw;
          const i32x4 at4 = {at, at, at, at};
          for (int q = 0; q < vecs; q++) {
            const f32x4 v = load4(xq + (size_t)at * blk + 4 * q);
            const i32x4 better = v > best_v[q]; /* false for NaN either side */
            best[q] = select4(better, at4, best[q]);
            best_v[q] = (f32x4)select4(better, (i32x4)v, (i32x4)best_v[q]);
          }
        }
      }
      const size_t o = ((size_t)oh * s->ow + ow) * blk;
      for (int q = 0; q < vecs; q++) {
        store4(yq + o + 4 * q, &best_v[q]);
        store4(aq + o + 4 * q, &best[q]);
      }
    }
  }
}

/* One NCHW plane: the reference's scalar selects. */
static void pool_fwd_plane_1(const ps_pool_shape *s, const float *restrict xq, float *restrict yq,
                             int32_t *restrict aq) {
  for (int oh = 0; oh < s->oh; oh++) {
    for (int ow = 0; ow < s->ow; ow++) {
      const int top = oh * s->stride * s->w + ow * s->stride;
      int32_t best = top;
      float best_v = xq[top];
      for (int kh = 0; kh < s->size; kh++) {
        for (int kw = kh == 0 ? 1 : 0; kw < s->size; kw++) {
          const int at = top + kh * s->w + kw;
          const float v = xq[at];
          const int better = v > best_v;
          best = better ? at : best;
          best_v = better ? v : best_v;
        }
      }
      yq[(size_t)oh * s->ow + ow] = best_v;
      aq[(size_t)oh * s->ow + ow] = best;
    }
  }
}

static void pool_forward(const ps_pool_shape *s, int blk, const float *x, float *y,
                         int32_t *argmax) {
  const long planes = (long)s->n * (s->c / blk);
  const size_t in_plane = (size_t)s->h * s->w * blk, out_plane = (size_t)s->oh * s->ow * blk;
  const int parallel = (long)planes * (long)in_plane >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for schedule(static) if (parallel)
  for (long q = 0; q < planes; q++) {
    const float *xq = x + (size_t)q * in_plane;
    float *yq = y + (size_t)q * out_plane;
    int32_t *aq = argmax + (size_t)q * out_plane;
    if (blk == 16 && s->size == 2)
      pool_fwd_plane_vec(s, 4, 2, xq, yq, aq);
    else if (blk == 16)
      pool_fwd_plane_vec(s, 4, 0, xq, yq, aq);
    else if (blk == 8 && s->size == 2)
      pool_fwd_plane_vec(s, 2, 2, xq, yq, aq);
    else if (blk == 8)
      pool_fwd_plane_vec(s, 2, 0, xq, yq, aq);
    else
      pool_fwd_plane_1(s, xq, yq, aq);
  }
}

static inline __attribute__((always_inline)) void pool_bwd_plane(
    const ps_pool_shape *s, int blk, const float *restrict dyq, const int32_t *restrict aq,
    float *restrict dxq) {
  memset(dxq, 0, (size_t)s->h * s->w * blk * sizeof(float));
  const size_t outs = (size_t)s->oh * s->ow;
  for (size_t o = 0; o < outs; o++)
    for (int l = 0; l < blk; l++) dxq[(size_t)aq[o * blk + l] * blk + l] += dyq[o * blk + l];
}

static void pool_backward(const ps_pool_shape *s, int blk, const float *dy,
                          const int32_t *argmax, float *dx) {
  const long planes = (long)s->n * (s->c / blk);
  const size_t in_plane = (size_t)s->h * s->w * blk, out_plane = (size_t)s->oh * s->ow * blk;
  const int parallel = (long)planes * (long)in_plane >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for schedule(static) if (parallel)
  for (long q = 0; q < planes; q++) {
    const float *dyq = dy + (size_t)q * out_plane;
    const int32_t *aq = argmax + (size_t)q * out_plane;
    float *dxq = dx + (size_t)q * in_plane;
    if (blk == 16)
      pool_bwd_plane(s, 16, dyq, aq, dxq);
    else if (blk == 8)
      pool_bwd_plane(s, 8, dyq, aq, dxq);
    else
      pool_bwd_plane(s, 1, dyq, aq, dxq);
  }
}

/* y and argmax in x's layout when both are buffers of ours, else NCHW. */
static void dn_maxpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                               int32_t *argmax) {
  dnnl_backend *be = enter(ctx);
  if (s->n == 0 || s->c == 0 || s->oh == 0 || s->ow == 0) return;
  const size_t out_bytes = (size_t)s->n * s->c * s->oh * s->ow * 4;
  int blk = view_blk(be, x, s->n, s->c, s->h, s->w);
  if (blk > 1 && !(buf_taggable(be, y, out_bytes) && buf_taggable(be, argmax, out_bytes))) {
    buf_make_plain(be, buf_find(be, x));
    blk = 1;
  }
  write_act(be, y, blk, s->n, s->c, s->oh, s->ow, 0);
  write_act(be, argmax, blk, s->n, s->c, s->oh, s->ow, 1);
  pool_forward(s, blk, x, y, argmax);
}

/* Works in argmax's layout: dy is brought to it (scratch) if it differs, and
 * dx is written in it when dx is ours, else NCHW through scratch. */
static void dn_maxpool_backward(void *ctx, const ps_pool_shape *s, const float *dy,
                                const int32_t *argmax, float *dx) {
  dnnl_backend *be = enter(ctx);
  if (s->n == 0 || s->c == 0) return;
  const act_layout in = {1, s->n, s->c, s->h, s->w, 0};
  if (s->oh == 0 || s->ow == 0) {
    write_plain(be, dx, layout_elems(&in));
    memset(dx, 0, layout_elems(&in) * sizeof(float));
    return;
  }
  const int blk = view_blk(be, argmax, s->n, s->c, s->oh, s->ow);
  const act_layout out = {view_blk(be, dy, s->n, s->c, s->oh, s->ow), s->n, s->c, s->oh, s->ow,
                          0};
  const float *dyb = dy;
  if (out.blk != blk) {
    if (blk == 1) {
      read_plain(be, dy, layout_elems(&out));
    } else {
      float *t = scratch(be, 0, layout_elems(&out) * 4);
      reorder(be, dy, &out, t, blk);
      dyb = t;
    }
  }
  const size_t in_bytes = layout_elems(&in) * 4;
  if (blk == 1 || buf_taggable(be, dx, in_bytes)) {
    write_act(be, dx, blk, s->n, s->c, s->h, s->w, 0);
    pool_backward(s, blk, dyb, argmax, dx);
    return;
  }
  float *t = scratch(be, 1, in_bytes);
  pool_backward(s, blk, dyb, argmax, t);
  const act_layout held = {blk, s->n, s->c, s->h, s->w, 0};
  write_plain(be, dx, layout_elems(&in));
  reorder(be, t, &held, dx, 1);
}

/* ---- average pooling ----
 *
 * Loops in every layout, as max pooling's: plane q of the (n, c/blk) blocks
 * holds blk channels side by side, and each lane is the reference's
 * arithmetic in the reference's order (a window's taps summed from 0 in
 * row-major order, divided by the tap count; backward adds each window's
 * share to a zeroed plane in (oh, ow) order), so the results are its bits.
 * The gradient dx is written blocked (pick_blk) when dx is ours: the layout
 * the forward input had when a convolution (and a relu) wrote it, so the
 * relu or convolution backward before it reads it as it is. Global average
 * pooling's output (n, c, 1, 1) is the same bytes in every layout: NCHW. */

static inline __attribute__((always_inline)) void avg_fwd_plane(const ps_pool_shape *s, int blk,
                                                                const float *restrict xq,
                                                                float *restrict yq) {
  const float area = (float)(s->size * s->size);
  for (int oh = 0; oh < s->oh; oh++) {
    for (int ow = 0; ow < s->ow; ow++) {
      const size_t top = (size_t)oh * s->stride * s->w + (size_t)ow * s->stride;
      float sum[16] = {0};
      for (int kh = 0; kh < s->size; kh++) {
        for (int kw = 0; kw < s->size; kw++) {
          const float *t = xq + (top + (size_t)kh * s->w + kw) * blk;
          for (int l = 0; l < blk; l++) sum[l] += t[l];
        }
      }
      float *o = yq + ((size_t)oh * s->ow + ow) * blk;
      for (int l = 0; l < blk; l++) o[l] = sum[l] / area;
    }
  }
}

static inline __attribute__((always_inline)) void avg_bwd_plane(const ps_pool_shape *s, int blk,
                                                                const float *restrict dyq,
                                                                float *restrict dxq) {
  const float area = (float)(s->size * s->size);
  memset(dxq, 0, (size_t)s->h * s->w * blk * sizeof(float));
  for (int oh = 0; oh < s->oh; oh++) {
    for (int ow = 0; ow < s->ow; ow++) {
      const size_t top = (size_t)oh * s->stride * s->w + (size_t)ow * s->stride;
      const float *d = dyq + ((size_t)oh * s->ow + ow) * blk;
      float g[16];
      for (int l = 0; l < blk; l++) g[l] = d[l] / area;
      for (int kh = 0; kh < s->size; kh++) {
        for (int kw = 0; kw < s->size; kw++) {
          float *t = dxq + (top + (size_t)kh * s->w + kw) * blk;
          for (int l = 0; l < blk; l++) t[l] += g[l];
        }
      }
    }
  }
}

static void avg_forward(const ps_pool_shape *s, int blk, const float *x, float *y) {
  const long planes = (long)s->n * (s->c / blk);
  const size_t in_plane = (size_t)s->h * s->w * blk, out_plane = (size_t)s->oh * s->ow * blk;
  const int parallel = (long)planes * (long)in_plane >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for schedule(static) if (parallel)
  for (long q = 0; q < planes; q++) {
    const float *xq = x + (size_t)q * in_plane;
    float *yq = y + (size_t)q * out_plane;
    if (blk == 16)
      avg_fwd_plane(s, 16, xq, yq);
    else if (blk == 8)
      avg_fwd_plane(s, 8, xq, yq);
    else
      avg_fwd_plane(s, 1, xq, yq);
  }
}

static void avg_backward(const ps_pool_shape *s, int blk, const float *dy, float *dx) {
  const long planes = (long)s->n * (s->c / blk);
  const size_t in_plane = (size_t)s->h * s->w * blk, out_plane = (size_t)s->oh * s->ow * blk;
  const int parallel = (long)planes * (long)in_plane >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for schedule(static) if (parallel)
  for (long q = 0; q < planes; q++) {
    const float *dyq = dy + (size_t)q * out_plane;
    float *dxq = dx + (size_t)q * in_plane;
    if (blk == 16)
      avg_bwd_plane(s, 16, dyq, dxq);
    else if (blk == 8)
      avg_bwd_plane(s, 8, dyq, dxq);
    else
      avg_bwd_plane(s, 1, dyq, dxq);
  }
}

/* The block a gradient of (n, c, h, w) is written in at dx. */
static int grad_blk(dnnl_backend *be, const void *dx, int n, int c, int h, int w) {
  const act_layout lay = {pick_blk(be->max_blk, c), n, c, h, w, 0};
  return buf_taggable(be, dx, layout_elems(&lay) * sizeof(float)) ? lay.blk : 1;
}

/* y in x's layout when y is a buffer of ours, else NCHW. */
static void dn_avgpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y) {
  dnnl_backend *be = enter(ctx);
  if (s->n == 0 || s->c == 0 || s->oh == 0 || s->ow == 0) return;
  const size_t out_bytes = (size_t)s->n * s->c * s->oh * s->ow * sizeof(float);
  int blk = view_blk(be, x, s->n, s->c, s->h, s->w);
  if (blk > 1 && !buf_taggable(be, y, out_bytes)) {
    buf_make_plain(be, buf_find(be, x));
    blk = 1;
  }
  write_act(be, y, blk, s->n, s->c, s->oh, s->ow, 0);
  avg_forward(s, blk, x, y);
}

/* dy is brought to dx's layout (scratch) when it is held in another. */
static void dn_avgpool_backward(void *ctx, const ps_pool_shape *s, const float *dy, float *dx) {
  dnnl_backend *be = enter(ctx);
  if (s->n == 0 || s->c == 0) return;
  const act_layout in = {1, s->n, s->c, s->h, s->w, 0};
  if (s->oh == 0 || s->ow == 0) {
    write_plain(be, dx, layout_elems(&in));
    memset(dx, 0, layout_elems(&in) * sizeof(float));
    return;
  }
  const int blk = grad_blk(be, dx, s->n, s->c, s->h, s->w);
  const act_layout out = {view_blk(be, dy, s->n, s->c, s->oh, s->ow), s->n, s->c, s->oh, s->ow, 0};
  const float *dyb = dy;
  if (out.blk != blk) {
    if (blk == 1) {
      read_plain(be, dy, layout_elems(&out));
    } else {
      float *t = scratch(be, 0, layout_elems(&out) * sizeof(float));
      reorder(be, dy, &out, t, blk);
      dyb = t;
    }
  }
  write_act(be, dx, blk, s->n, s->c, s->h, s->w, 0);
  avg_backward(s, blk, dyb, dx);
}

static inline __attribute__((always_inline)) void gap_fwd_plane(size_t hw, int blk,
                                                                const float *restrict xq,
                                                                float *restrict yq) {
  float sum[16] = {0};
  for (size_t i = 0; i < hw; i++)
    for (int l = 0; l < blk; l++) sum[l] += xq[i * blk + l];
  for (int l = 0; l < blk; l++) yq[l] = sum[l] / (float)hw;
}

static inline __attribute__((always_inline)) void gap_bwd_plane(size_t hw, int blk,
                                                                const float *restrict dyq,
                                                                float *restrict dxq) {
  float g[16];
  for (int l = 0; l < blk; l++) g[l] = dyq[l] / (float)hw;
  for (size_t i = 0; i < hw; i++)
    for (int l = 0; l < blk; l++) dxq[i * blk + l] = g[l];
}

static void dn_global_avgpool_forward(void *ctx, int n, int c, int h, int w, const float *x,
                                      float *y) {
  dnnl_backend *be = enter(ctx);
  if (n == 0 || c == 0) return;
  const int blk = view_blk(be, x, n, c, h, w);
  write_plain(be, y, (size_t)n * c);
  const size_t hw = (size_t)h * w;
  const long planes = (long)n * (c / blk);
  const int parallel = (long)planes * (long)(hw * blk) >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for schedule(static) if (parallel)
  for (long q = 0; q < planes; q++) {
    const float *xq = x + (size_t)q * hw * blk;
    float *yq = y + (size_t)q * blk; /* channel (q mod c/blk)*blk of example q / (c/blk) */
    if (blk == 16)
      gap_fwd_plane(hw, 16, xq, yq);
    else if (blk == 8)
      gap_fwd_plane(hw, 8, xq, yq);
    else
      gap_fwd_plane(hw, 1, xq, yq);
  }
}

static void dn_global_avgpool_backward(void *ctx, int n, int c, int h, int w, const float *dy,
                                       float *dx) {
  dnnl_backend *be = enter(ctx);
  if (n == 0 || c == 0) return;
  read_plain(be, dy, (size_t)n * c);
  const int blk = grad_blk(be, dx, n, c, h, w);
  write_act(be, dx, blk, n, c, h, w, 0);
  const size_t hw = (size_t)h * w;
  const long planes = (long)n * (c / blk);
  const int parallel = (long)planes * (long)(hw * blk) >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for schedule(static) if (parallel)
  for (long q = 0; q < planes; q++) {
    const float *dyq = dy + (size_t)q * blk;
    float *dxq = dx + (size_t)q * hw * blk;
    if (blk == 16)
      gap_bwd_plane(hw, 16, dyq, dxq);
    else if (blk == 8)
      gap_bwd_plane(hw, 8, dyq, dxq);
    else
      gap_bwd_plane(hw, 1, dyq, dxq);
  }
}

/* ---- batch normalization ----
 *
 * ps_bn_host_* (the reference's arithmetic) in the layout the activation is
 * held in, each channel block a task on the team: every channel's sums run
 * over the same values in the same order (in double) whatever the block,
 * so the results are the reference's bits. y is written in x's layout (when
 * y is ours); dx in x's layout too (when dx is ours), since it goes back to
 * the op that wrote x, which holds that layout: a conv or relu reads it as
 * it is, dense or dropout (NCHW) need no reorder. The statistics, gamma,
 * beta and their gradients are plain vectors of c floats. */

/* The layout the activation (n, c, hw) at p is held in: the recorded one
 * when p starts a buffer holding exactly n examples of c channels of hw
 * values, all blocked (h and w come only as their product here, so the
 * recorded ones are kept for the output, for the next op's view_blk);
 * otherwise NCHW as (n, c, hw, 1), with what is read made NCHW. */
static act_layout bn_view(dnnl_backend *be, const void *p, int n, int c, int hw) {
  const buf_entry *e = buf_find(be, p);
  if (e && e->lay.blk > 1 && e->base == (const char *)p && !e->lay.s32 && e->prefix == 0 &&
      e->lay.n == n && e->lay.c == c && (long)e->lay.h * e->lay.w == hw)
    return e->lay;
  read_plain(be, p, (size_t)n * c * hw);
  return (act_layout){1, n, c, hw, 1, 0};
}

/* The block ps_bn_host_* runs in on an activation held in block `held`:
 * that one, except with one value per channel (hw 1, after dense), where
 * every block layout is NCHW's bytes (element (i, kb*blk + l) at
 * (i*(c/blk) + kb)*blk + l = i*c + k): then the widest block that divides
 * c, so that a pass reads blk neighbouring channels at once instead of one
 * channel strided by c. */
static int bn_blk(int held, int c, int hw) {
  if (hw != 1) return held;
  for (int b = 16; b > 1; b--)
    if (c % b == 0) return b;
  return 1;
}

/* Worth waking the team: enough values, and a block for each thread. */
static int bn_parallel(int n, int c, int hw, int blk) {
  return (long)n * c * hw >= PARALLEL_MIN_FLOATS && c / blk > 1;
}

/* x's layout for the forward ops: held as it is when y can take it, else
 * NCHW (x made so, as pooling does). With hw 1 every layout is the same
 * bytes, so nothing is reordered. */
static act_layout bn_forward_layout(dnnl_backend *be, const float *x, float *y, int n, int c,
                                    int hw) {
  act_layout lx = bn_view(be, x, n, c, hw);
  if (lx.blk > 1 && !buf_taggable(be, y, layout_elems(&lx) * sizeof(float))) {
    if (hw > 1) buf_make_plain(be, buf_find(be, x));
    lx.blk = 1;
  }
  write_act(be, y, lx.blk, n, c, lx.h, lx.w, 0);
  return lx;
}

static void dn_batchnorm_forward_train(void *ctx, int n, int c, int hw, float eps, const float *x,
                                       const float *gamma, const float *beta, float *y, float *mean,
                                       float *var, float *invstd) {
  dnnl_backend *be = enter(ctx);
  if (c == 0) return;
  read_plain(be, gamma, (size_t)c);
  read_plain(be, beta, (size_t)c);
  write_plain(be, mean, (size_t)c);
  write_plain(be, var, (size_t)c);
  write_plain(be, invstd, (size_t)c);
  if ((long)n * hw == 0) { /* no values: the reference's empty statistics */
    ps_bn_host_train(n, c, hw, 1, 0, c, eps, x, gamma, beta, y, mean, var, invstd);
    return;
  }
  const act_layout lx = bn_forward_layout(be, x, y, n, c, hw);
  const int blk = bn_blk(lx.blk, c, hw);
  const long blocks = c / blk;
#pragma omp parallel for schedule(static) if (bn_parallel(n, c, hw, blk))
  for (long kb = 0; kb < blocks; kb++)
    ps_bn_host_train(n, c, hw, blk, (int)kb, (int)kb + 1, eps, x, gamma, beta, y, mean, var,
                     invstd);
}

static void dn_batchnorm_forward_infer(void *ctx, int n, int c, int hw, float eps, const float *x,
                                       const float *gamma, const float *beta, const float *mean,
                                       const float *var, float *y) {
  dnnl_backend *be = enter(ctx);
  if (c == 0 || (long)n * hw == 0) return;
  read_plain(be, gamma, (size_t)c);
  read_plain(be, beta, (size_t)c);
  read_plain(be, mean, (size_t)c);
  read_plain(be, var, (size_t)c);
  const act_layout lx = bn_forward_layout(be, x, y, n, c, hw);
  const int blk = bn_blk(lx.blk, c, hw);
  const long blocks = c / blk;
#pragma omp parallel for schedule(static) if (bn_parallel(n, c, hw, blk))
  for (long kb = 0; kb < blocks; kb++)
    ps_bn_host_infer(n, c, hw, blk, (int)kb, (int)kb + 1, eps, x, gamma, beta, mean, var, y);
}

/* p, held in `held`, in block `want`: p itself (also with hw 1, where the
 * bytes are the same), or a copy in scratch slot; p's own buffer keeps its
 * layout (x is still to be read by the backward ops before this one). */
static const float *bn_operand(dnnl_backend *be, const float *p, const act_layout *held, int want,
                               int slot) {
  if (held->blk == want || (long)held->h * held->w == 1) return p;
  return act_in(be, p, held->blk, want, held->n, held->c, held->h, held->w, slot);
}

/* Works in x's layout when dx can be held in it (or is NULL), else NCHW;
 * x and dy are brought to it through scratch when held otherwise. */
static void dn_batchnorm_backward(void *ctx, int n, int c, int hw, const float *x, const float *dy,
                                  const float *gamma, const float *mean, const float *invstd,
                                  float *dx, float *dgamma, float *dbeta) {
  dnnl_backend *be = enter(ctx);
  if (c == 0) return;
  read_plain(be, gamma, (size_t)c);
  read_plain(be, mean, (size_t)c);
  read_plain(be, invstd, (size_t)c);
  write_plain(be, dgamma, (size_t)c);
  write_plain(be, dbeta, (size_t)c);
  if ((long)n * hw == 0) { /* nothing summed: zero gradients, as the reference gives */
    ps_bn_host_backward(n, c, hw, 1, 0, c, x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
    return;
  }
  const act_layout lx = bn_view(be, x, n, c, hw), ld = bn_view(be, dy, n, c, hw);
  /* The shape a blocked dx is recorded with: x's, else dy's (their h, w). */
  const act_layout *shape = lx.blk > 1 ? &lx : &ld;
  int held = lx.blk;
  if (dx && held > 1 && !buf_taggable(be, dx, layout_elems(&lx) * sizeof(float))) held = 1;
  const float *xp = bn_operand(be, x, &lx, held, 0);
  const float *dyp = bn_operand(be, dy, &ld, held, 1);
  if (dx) write_act(be, dx, held, n, c, shape->h, shape->w, 0);
  const int blk = bn_blk(held, c, hw);
  const long blocks = c / blk;
#pragma omp parallel for schedule(static) if (bn_parallel(n, c, hw, blk))
  for (long kb = 0; kb < blocks; kb++)
    ps_bn_host_backward(n, c, hw, blk, (int)kb, (int)kb + 1, xp, dyp, gamma, mean, invstd, dx,
                        dgamma, dbeta);
}

/* ---- dense ----
 *
 * OpenBLAS sgemm in parts on the team (OpenBLAS at one thread): each
 * thread's part of the output features for y, dW and db, and of the input
 * features for dx, as the reference splits them. Measured on the target
 * (1 thread, the quickstart's 64 x 3136 -> 128 layer), sgemm took 0.69 ms
 * forward and 1.19 ms backward where oneDNN's inner product took 0.99 and
 * 1.39. The sums are the reference's: y and dW the same sgemm calls on the
 * same parts for the same team size, db the rows added in order. */

#define PARALLEL_MIN_MACS ((size_t)1 << 20)

/* Whether a dense op is split over the team: not when it is small, nor
 * with threads == 0, where OpenBLAS keeps its own threading and one call
 * in the caller uses it. */
static int dense_parallel(const dnnl_backend *be, int n, int in, int out) {
  return be->nthreads > 0 && (size_t)n * in * out >= PARALLEL_MIN_MACS;
}

static void dense_forward_part(int n, int in, int out, const float *x, const float *w,
                               const float *b, float *y, long j0, long j1) {
  const int cols = (int)(j1 - j0);
  if (cols == 0) return;
  for (int i = 0; i < n; i++)
    memcpy(y + (size_t)i * out + j0, b + j0, (size_t)cols * sizeof(float));
  /* y[:, j0:j1] (n, cols) += x (n, in) W[j0:j1]^T */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, cols, in, 1.0f, x, in,
              w + (size_t)j0 * in, in, 1.0f, y + j0, out);
}

static void dense_backward_part(int n, int in, int out, const float *x, const float *w,
                                const float *dy, float *dx, float *dw, float *db, long j0, long j1,
                                long k0, long k1) {
  const int rows = (int)(j1 - j0), cols = (int)(k1 - k0);
  if (rows > 0) {
    memset(db + j0, 0, (size_t)rows * sizeof(float));
    for (int i = 0; i < n; i++) {
      const float *d = dy + (size_t)i * out + j0;
      for (int j = 0; j < rows; j++) db[j0 + j] += d[j];
    }
    /* dW[j0:j1] (rows, in) = dy[:, j0:j1]^T (rows, n) x (n, in) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows, in, n, 1.0f, dy + j0, out, x, in,
                0.0f, dw + (size_t)j0 * in, in);
  }
  if (dx && cols > 0) {
    /* dx[:, k0:k1] (n, cols) = dy (n, out) W[:, k0:k1] (out, cols) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, cols, out, 1.0f, dy, out, w + k0, in,
                0.0f, dx + k0, in);
  }
}

static void dn_dense_forward(void *ctx, int n, int in, int out, const float *x, const float *w,
                             const float *b, float *y) {
  dnnl_backend *be = enter(ctx);
  if (n == 0 || out == 0) return;
  write_plain(be, y, (size_t)n * out);
  if (in == 0) {
    for (int i = 0; i < n; i++) memcpy(y + (size_t)i * out, b, (size_t)out * sizeof(float));
    return;
  }
  read_plain(be, x, (size_t)n * in); /* flatten's (N, C*H*W) is NCHW's order */
  const int parallel = dense_parallel(be, n, in, out);
#pragma omp parallel if (parallel)
  {
    long j0, j1;
    thread_span(out, &j0, &j1);
    dense_forward_part(n, in, out, x, w, b, y, j0, j1);
  }
}

static void dn_dense_backward(void *ctx, int n, int in, int out, const float *x, const float *w,
                              const float *dy, float *dx, float *dw, float *db) {
  dnnl_backend *be = enter(ctx);
  if (dx) write_plain(be, dx, (size_t)n * in);
  write_plain(be, dw, (size_t)out * in);
  write_plain(be, db, (size_t)out);
  if (n == 0 || in == 0 || out == 0) {
    memset(db, 0, (size_t)out * sizeof(float));
    memset(dw, 0, (size_t)out * in * sizeof(float));
    if (dx) memset(dx, 0, (size_t)n * in * sizeof(float));
    return;
  }
  read_plain(be, x, (size_t)n * in);
  read_plain(be, dy, (size_t)n * out);
  const int parallel = dense_parallel(be, n, in, out);
#pragma omp parallel if (parallel)
  {
    long j0, j1, k0, k1;
    thread_span(out, &j0, &j1);
    thread_span(in, &k0, &k1);
    dense_backward_part(n, in, out, x, w, dy, dx, dw, db, j0, j1, k0, k1);
  }
}

/* ---- element-wise ----
 *
 * Element-wise ops may run in place (out is an input, or overlaps none).
 * relu works in whatever layout its input is held in, so a blocked input
 * gives a blocked output (when the output is a buffer of ours, else both
 * become NCHW); dropout's mask is indexed in NCHW order, so it works on
 * NCHW. */

/* The layout of the n floats at p as an element-wise op may carry it to
 * its output: blocked only when p starts a buffer holding exactly n
 * floats blocked; otherwise NCHW (made so). */
static act_layout elementwise_layout(dnnl_backend *be, const void *p, size_t n) {
  buf_entry *e = buf_find(be, p);
  if (e && e->lay.blk > 1) {
    if (e->base == (const char *)p && layout_elems(&e->lay) == n && !e->lay.s32 &&
        e->prefix == 0)
      return e->lay;
    read_plain(be, p, n);
  }
  const act_layout plain = {1, (int)(n > INT32_MAX ? INT32_MAX : n), 1, 1, 1, 0};
  return plain;
}

/* max(x, 0) as a select: x where x > 0, else +0 (so -0 and NaN give +0). */
static void relu_span(const float *x, float *y, long i, long end) {
  for (; i + 4 <= end; i += 4) {
    const f32x4 v = load4(x + i);
    const i32x4 r = (i32x4)v & (v > (f32x4){0, 0, 0, 0});
    store4(y + i, &r);
  }
  for (; i < end; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

/* dy where y > 0, else +0. */
static void relu_grad_span(const float *y, const float *dy, float *dx, long i, long end) {
  for (; i + 4 <= end; i += 4) {
    const i32x4 r = (i32x4)load4(dy + i) & (load4(y + i) > (f32x4){0, 0, 0, 0});
    store4(dx + i, &r);
  }
  for (; i < end; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

static void relu_loop(long n, const float *x, float *y) {
#pragma omp parallel if (n >= PARALLEL_MIN_FLOATS)
  {
    long begin, end;
    thread_span(n, &begin, &end);
    relu_span(x, y, begin, end);
  }
}

static void dn_relu_forward(void *ctx, size_t n, const float *x, float *y) {
  dnnl_backend *be = enter(ctx);
  act_layout lay = elementwise_layout(be, x, n);
  if (lay.blk > 1 && !buf_taggable(be, y, n * sizeof(float))) {
    buf_make_plain(be, buf_find(be, x));
    lay.blk = 1;
  }
  if (y != x) {
    if (lay.blk > 1)
      write_blocked(be, y, &lay);
    else
      write_plain(be, y, n);
  }
  relu_loop((long)n, x, y);
}

/* Two operands a and b of n floats and the output out (which may be
 * either): all three in one layout, the one a and b share when it is the
 * same blocked layout (and out can hold it), else NCHW (the operands made
 * plain). */
static void binary_layout(dnnl_backend *be, const float *a, const float *b, float *out, size_t n) {
  act_layout la = elementwise_layout(be, a, n);
  act_layout lb = elementwise_layout(be, b, n);
  if (!layout_equal(&la, &lb) || (la.blk > 1 && !buf_taggable(be, out, n * sizeof(float)))) {
    if (la.blk > 1) buf_make_plain(be, buf_find(be, a));
    if (lb.blk > 1) buf_make_plain(be, buf_find(be, b));
    la.blk = 1;
  }
  if (out != a && out != b) {
    if (la.blk > 1)
      write_blocked(be, out, &la);
    else
      write_plain(be, out, n);
  }
}

static void dn_relu_backward(void *ctx, size_t n, const float *y, const float *dy, float *dx) {
  dnnl_backend *be = enter(ctx);
  binary_layout(be, y, dy, dx, n);
  const long len = (long)n;
#pragma omp parallel if (len >= PARALLEL_MIN_FLOATS)
  {
    long begin, end;
    thread_span(len, &begin, &end);
    relu_grad_span(y, dy, dx, begin, end);
  }
}

/* See binary_layout. */
static void dn_add(void *ctx, size_t n, const float *a, const float *b, float *y) {
  dnnl_backend *be = enter(ctx);
  binary_layout(be, a, b, y, n);
  const long len = (long)n;
#pragma omp parallel for simd schedule(static) if (len >= PARALLEL_MIN_FLOATS)
  for (long i = 0; i < len; i++) y[i] = a[i] + b[i];
}

/* A rate >= 1 drops everything (no infinite scale); a rate <= 0 keeps
 * everything with scale 1. Each element costs a hash, so smaller arrays
 * are worth splitting. */
static void dn_dropout_forward(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                               const float *x, float *y, float *mask) {
  dnnl_backend *be = enter(ctx);
  read_plain(be, x, n);
  if (y != x) write_plain(be, y, n);
  write_plain(be, mask, n);
  const float scale = rate >= 1.0f ? 0.0f : rate <= 0.0f ? 1.0f : 1.0f / (1.0f - rate);
  const long len = (long)n;
#pragma omp parallel for schedule(static) if (len >= PARALLEL_MIN_FLOATS / 8)
  for (long i = 0; i < len; i++) {
    const float keep = ps_rng_uniform(seed, stream, (uint64_t)i) >= rate ? scale : 0.0f;
    mask[i] = keep;
    y[i] = x[i] * keep;
  }
}

static void dn_dropout_backward(void *ctx, size_t n, const float *mask, const float *dy,
                                float *dx) {
  dnnl_backend *be = enter(ctx);
  read_plain(be, dy, n);
  read_plain(be, mask, n);
  if (dx != dy) write_plain(be, dx, n);
  const long len = (long)n;
#pragma omp parallel for simd schedule(static) if (len >= PARALLEL_MIN_FLOATS)
  for (long i = 0; i < len; i++) dx[i] = dy[i] * mask[i];
}

static void dn_scale(void *ctx, size_t n, float alpha, float *x) {
  dnnl_backend *be = enter(ctx);
  (void)elementwise_layout(be, x, n); /* all of a blocked buffer, or NCHW */
  const long len = (long)n;
#pragma omp parallel for simd schedule(static) if (len >= PARALLEL_MIN_FLOATS)
  for (long i = 0; i < len; i++) x[i] *= alpha;
}

/* ---- softmax + cross-entropy ----
 *
 * (n, k) with k classes is small next to everything else: no threads. The
 * reference's arithmetic: each row shifted by its maximum before expf, the
 * loss from the log-sum-exp in double; a label outside [0, k) gives NaN. */

static float dn_softmax_xent_forward(void *ctx, int n, int k, const float *logits,
                                     const uint8_t *labels, float *probs) {
  dnnl_backend *be = enter(ctx);
  if (n == 0) return 0.0f;
  read_plain(be, logits, (size_t)n * k);
  write_plain(be, probs, (size_t)n * k);
  return (float)(ps_xent_host_forward(n, k, logits, labels, probs) / n);
}

static void dn_softmax_xent_stats(void *ctx, int n, int k, const float *logits,
                                  const uint8_t *labels, float *probs, double *stats) {
  dnnl_backend *be = enter(ctx);
  if (n == 0) {
    stats[0] = stats[1] = 0.0;
    return;
  }
  read_plain(be, logits, (size_t)n * k);
  write_plain(be, probs, (size_t)n * k);
  stats[0] = ps_xent_host_forward(n, k, logits, labels, probs);
  stats[1] = ps_xent_host_correct(n, k, probs, labels);
}

static void dn_softmax_xent_backward(void *ctx, int n, int k, const float *probs,
                                     const uint8_t *labels, float *dlogits) {
  dnnl_backend *be = enter(ctx);
  read_plain(be, probs, (size_t)n * k);
  write_plain(be, dlogits, (size_t)n * k);
  ps_xent_host_backward(n, k, probs, labels, dlogits);
}

/* ---- embeddings and the logistic loss ----
 *
 * The reference's arithmetic (ps_emb_host_*, ps_sigmoid_xent_host_*, in
 * ops_cpu.c), split over the team by examples (forward) or unique rows
 * (backward): each output row is one thread's, summed in the order ops.h
 * gives, so the bits are the reference's. Everything is read and written
 * as plain arrays (made NCHW first where a buffer is held blocked). */

static void dn_embedding_bag_forward(void *ctx, int n, int dim, const int32_t *offsets,
                                     const int32_t *idx, int mean, const float *rows, float *y) {
  dnnl_backend *be = enter(ctx);
  if (n <= 0 || dim <= 0) return;
  const long total = offsets[n];
  buf_make_plain(be, buf_find(be, rows)); /* read up to the largest idx, which is not given */
  write_plain(be, y, (size_t)n * (size_t)dim);
#pragma omp parallel if ((total + n) * (long)dim >= PARALLEL_MIN_FLOATS)
  {
    long e0, e1;
    thread_span(n, &e0, &e1);
    ps_emb_host_bag_forward(dim, offsets, idx, mean, rows, y, (int)e0, (int)e1);
  }
}

static void dn_embedding_bag_backward(void *ctx, int n, int dim, const int32_t *offsets, int u,
                                      const int32_t *rev_off, const int32_t *rev_ex, int mean,
                                      const float *dy, float *drows) {
  dnnl_backend *be = enter(ctx);
  if (u <= 0 || dim <= 0) return;
  read_plain(be, dy, (size_t)(n > 0 ? n : 0) * (size_t)dim);
  write_plain(be, drows, (size_t)u * (size_t)dim);
  const long entries = rev_off[u];
#pragma omp parallel if ((entries + u) * (long)dim >= PARALLEL_MIN_FLOATS)
  {
    long r0, r1;
    thread_span(u, &r0, &r1);
    ps_emb_host_bag_backward(dim, offsets, rev_off, rev_ex, mean, dy, drows, (int)r0, (int)r1);
  }
}

/* A strided write leaves the floats between the rows as they are, so a
 * blocked dst is made NCHW (read_plain) rather than declared NCHW. */
static void dn_copy_cols(void *ctx, int n, int width, const float *src, int src_stride, float *dst,
                         int dst_stride) {
  dnnl_backend *be = enter(ctx);
  if (n <= 0 || width <= 0) return;
  read_plain(be, src, (size_t)(n - 1) * (size_t)src_stride + (size_t)width);
  const size_t dst_floats = (size_t)(n - 1) * (size_t)dst_stride + (size_t)width;
  if (dst_stride == width)
    write_plain(be, dst, dst_floats);
  else
    read_plain(be, dst, dst_floats);
  const long rows = n;
#pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN_FLOATS)
  for (long i = 0; i < rows; i++)
    memcpy(dst + i * dst_stride, src + i * src_stride, (size_t)width * sizeof(float));
}

/* The interaction: the reference's loops (memory bound, small). */
static void dn_fm_forward(void *ctx, int n, int f, int d, const float *x, float *y) {
  dnnl_backend *be = enter(ctx);
  if (n <= 0 || d <= 0) return;
  read_plain(be, x, (size_t)n * f * d);
  write_plain(be, y, (size_t)n * d);
  ps_fm_host_forward(f, d, x, y, 0, n);
}

static void dn_fm_backward(void *ctx, int n, int f, int d, const float *x, const float *dy,
                           float *dx) {
  dnnl_backend *be = enter(ctx);
  if (n <= 0 || d <= 0 || f <= 0) return;
  read_plain(be, x, (size_t)n * f * d);
  read_plain(be, dy, (size_t)n * d);
  write_plain(be, dx, (size_t)n * f * d);
  ps_fm_host_backward(f, d, x, dy, dx, 0, n);
}

/* (n) logits: small next to everything else, no threads. */
static void dn_sigmoid_xent_forward(void *ctx, int n, const float *logits, const float *labels,
                                    float *probs, double *stats) {
  dnnl_backend *be = enter(ctx);
  if (n > 0) {
    read_plain(be, logits, (size_t)n);
    read_plain(be, labels, (size_t)n);
    write_plain(be, probs, (size_t)n);
  }
  ps_sigmoid_xent_host_forward(n > 0 ? n : 0, logits, labels, probs, stats);
}

static void dn_sigmoid_xent_backward(void *ctx, int n, const float *probs, const float *labels,
                                     float *dlogits) {
  dnnl_backend *be = enter(ctx);
  if (n <= 0) return;
  read_plain(be, probs, (size_t)n);
  read_plain(be, labels, (size_t)n);
  write_plain(be, dlogits, (size_t)n);
  ps_sigmoid_xent_host_backward(n, probs, labels, dlogits);
}

/* ---- memory ----
 *
 * Host memory; every op is done when it returns. Copies out deliver NCHW
 * whatever the layout the source is held in; copies in make the
 * destination NCHW. */

static void *dn_alloc(void *ctx, size_t bytes) {
  dnnl_backend *be = ctx;
  if (be->n_bufs == be->cap_bufs) {
    size_t cap = be->cap_bufs ? 2 * be->cap_bufs : 32;
    buf_entry *b = realloc(be->bufs, cap * sizeof *b);
    if (!b) return NULL;
    be->bufs = b;
    be->cap_bufs = cap;
  }
  void *p = ps_alloc(bytes);
  if (!p) return NULL;
  be->bufs[be->n_bufs++] = (buf_entry){.base = p, .bytes = bytes, .lay = {.blk = 1}};
  return p;
}

static void dn_free(void *ctx, void *p) {
  dnnl_backend *be = ctx;
  if (!p) return;
  for (size_t i = 0; i < be->n_bufs; i++) {
    if (be->bufs[i].base == p) {
      ps_free(be->bufs[i].saved);
      be->bufs[i] = be->bufs[--be->n_bufs];
      break;
    }
  }
  ps_free(p);
}

/* Floats covering `bytes` (a copy of a part of a float may be asked for). */
static size_t floats_of(size_t bytes) { return (bytes + sizeof(float) - 1) / sizeof(float); }

/* bytes at src as NCHW into dst: a whole blocked buffer is reordered
 * straight into dst, a part of one is made NCHW first. dst == src: the
 * bytes made NCHW where they are. */
static void copy_out(dnnl_backend *be, void *dst, const void *src, size_t bytes) {
  buf_entry *e = buf_find(be, src);
  if (dst == src || bytes == 0) {
    read_plain(be, src, floats_of(bytes));
    return;
  }
  write_plain(be, dst, floats_of(bytes));
  if (e && e->lay.blk > 1 && e->prefix == 0 && e->base == (const char *)src &&
      bytes == layout_elems(&e->lay) * sizeof(float)) {
    reorder(be, src, &e->lay, dst, 1);
    return;
  }
  read_plain(be, src, floats_of(bytes));
  memcpy(dst, src, bytes);
}

static void dn_to_device(void *ctx, void *dst, const void *src_host, size_t bytes) {
  dnnl_backend *be = enter(ctx);
  if (bytes == 0 || dst == src_host) return;
  write_plain(be, dst, floats_of(bytes));
  memcpy(dst, src_host, bytes);
}

static void dn_to_host(void *ctx, void *dst_host, const void *src, size_t bytes) {
  dnnl_backend *be = enter(ctx);
  copy_out(be, dst_host, src, bytes);
}

/* Backend to backend: a whole blocked buffer into the start of a buffer of
 * ours is copied as it is, with its layout; anything else as NCHW. */
static void dn_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  dnnl_backend *be = enter(ctx);
  if (dst == src) return;
  buf_entry *e = buf_find(be, src);
  if (e && e->lay.blk > 1 && e->prefix == 0 && e->base == (const char *)src &&
      bytes == layout_elems(&e->lay) * sizeof(float) && buf_taggable(be, dst, bytes)) {
    const act_layout lay = e->lay;
    write_blocked(be, dst, &lay);
    memcpy(dst, src, bytes);
    return;
  }
  copy_out(be, dst, src, bytes);
}

static void dn_sync(void *ctx) { (void)ctx; }

/* Host memory for batches and transfers: plain aligned memory, outside the
 * buffer table (always NCHW). */
static void *dn_host_alloc(void *ctx, size_t bytes) {
  (void)ctx;
  return ps_alloc(bytes);
}

static void dn_host_free(void *ctx, void *p) {
  (void)ctx;
  ps_free(p);
}

/* Every op is done when it returns: the host clock. */
static void dn_mark(void *ctx, int i) {
  dnnl_backend *be = ctx;
  if (i >= 0 && i < PS_MARKS) be->marks[i] = ps_now_s();
}

static void dn_marks_read(void *ctx, double *ms, int n) {
  dnnl_backend *be = ctx;
  for (int i = 0; i < n; i++)
    ms[i] = i < PS_MARKS && be->marks[i] > 0 && be->marks[PS_MARK_BEGIN] > 0
                ? (be->marks[i] - be->marks[PS_MARK_BEGIN]) * 1e3
                : -1.0;
  memset(be->marks, 0, sizeof be->marks);
}

static uint64_t dn_to_host_async(void *ctx, void *dst, const void *src, size_t bytes) {
  dn_to_host(ctx, dst, src, bytes);
  return 0;
}

static int dn_ticket_done(void *ctx, uint64_t ticket) {
  (void)ctx, (void)ticket;
  return 1;
}

static void dn_ticket_wait(void *ctx, uint64_t ticket) { (void)ctx, (void)ticket; }

/* ---- the table ---- */

static void dn_free_all(dnnl_backend *be) {
  for (size_t i = 0; i < be->n_prims; i++) {
    prim_entry *e = be->prims[i];
    dnnl_primitive_destroy(e->prim);
    if (e->w_reorder) dnnl_primitive_destroy(e->w_reorder);
    ps_free(e->w_buf);
    free(e);
  }
  free(be->prims);
  for (int i = 0; i < N_SCRATCH; i++) ps_free(be->scratch[i]);
  /* Buffers still allocated are the callers' to free; what we keep beside
   * them is ours. */
  for (size_t i = 0; i < be->n_bufs; i++) ps_free(be->bufs[i].saved);
  free(be->bufs);
  if (be->stream) dnnl_stream_destroy(be->stream);
  if (be->eng) dnnl_engine_destroy(be->eng);
  free(be);
}

static void dn_destroy(ps_ops *ops) {
  if (ops) dn_free_all(ops->ctx);
}

int ps_ops_dnnl_ref_impls(const ps_ops *ops, char *first, size_t len) {
  const dnnl_backend *be = ops->ctx;
  if (first && len) snprintf(first, len, "%s", be->first_ref);
  return be->ref_impls;
}

int ps_ops_dnnl_block(const ps_ops *ops) { return ((const dnnl_backend *)ops->ctx)->max_blk; }

void ps_dnnl_version(char *buf, size_t len) {
  const dnnl_version_t *v = dnnl_version();
  snprintf(buf, len, "%d.%d.%d", v->major, v->minor, v->patch);
}

ps_ops *ps_ops_dnnl_create(int threads) {
  dnnl_backend *be = calloc(1, sizeof *be);
  if (!be) return NULL;
  be->nthreads = threads > 0 ? threads : 0;
  /* 16-channel blocks where the JIT kernels have them (AVX-512), else 8;
   * PS_DNNL_BLOCK=8 forces 8 (tests run both forms on such a machine). */
  dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  be->max_blk = (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core ? 16 : 8;
  const char *force = getenv("PS_DNNL_BLOCK");
  if (force && !strcmp(force, "8")) be->max_blk = 8;
  /* Each of the team's threads calls sgemm on its own part. */
  if (threads > 0) openblas_set_num_threads(1);
  if (dnnl_engine_create(&be->eng, dnnl_cpu, 0) != dnnl_success ||
      dnnl_stream_create(&be->stream, be->eng, dnnl_stream_default_flags) != dnnl_success) {
    dn_free_all(be);
    return NULL;
  }
  be->ops = (ps_ops){
      .name = "cpu",
      .ctx = be,
      .conv2d_workspace = dn_conv2d_workspace,
      .conv2d_forward = dn_conv2d_forward,
      .conv2d_backward = dn_conv2d_backward,
      .maxpool_forward = dn_maxpool_forward,
      .maxpool_backward = dn_maxpool_backward,
      .avgpool_forward = dn_avgpool_forward,
      .avgpool_backward = dn_avgpool_backward,
      .global_avgpool_forward = dn_global_avgpool_forward,
      .global_avgpool_backward = dn_global_avgpool_backward,
      .batchnorm_forward_train = dn_batchnorm_forward_train,
      .batchnorm_forward_infer = dn_batchnorm_forward_infer,
      .batchnorm_backward = dn_batchnorm_backward,
      .dense_forward = dn_dense_forward,
      .dense_backward = dn_dense_backward,
      .relu_forward = dn_relu_forward,
      .relu_backward = dn_relu_backward,
      .add = dn_add,
      .dropout_forward = dn_dropout_forward,
      .dropout_backward = dn_dropout_backward,
      .softmax_xent_forward = dn_softmax_xent_forward,
      .softmax_xent_backward = dn_softmax_xent_backward,
      .softmax_xent_stats = dn_softmax_xent_stats,
      .destroy = dn_destroy,
      .alloc = dn_alloc,
      .free = dn_free,
      .to_device = dn_to_device,
      .to_host = dn_to_host,
      .copy = dn_copy,
      .sync = dn_sync,
      .host_memory = 1,
      .to_device_async = dn_to_device,
      .to_host_async = dn_to_host_async,
      .ticket_done = dn_ticket_done,
      .ticket_wait = dn_ticket_wait,
      .scale = dn_scale,
      .host_alloc = dn_host_alloc,
      .host_free = dn_host_free,
      .mark = dn_mark,
      .marks_read = dn_marks_read,
      .embedding_bag_forward = dn_embedding_bag_forward,
      .embedding_bag_backward = dn_embedding_bag_backward,
      .copy_cols = dn_copy_cols,
      .sigmoid_xent_forward = dn_sigmoid_xent_forward,
      .sigmoid_xent_backward = dn_sigmoid_xent_backward,
      .fm_forward = dn_fm_forward,
      .fm_backward = dn_fm_backward,
  };
  return &be->ops;
}

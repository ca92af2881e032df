/* The CUDA backend: kernels/ops.h on one device (see ops_cuda.h for the
 * contract), the twin of kernels/cpu/ops_cpu.c.
 *
 *   convolution      cuDNN forward / backward-data / backward-filter, NCHW
 *                    float, FMA math (no TF32), algorithms from the _v7
 *                    heuristics, cached per shape; bias and its gradient
 *                    are small kernels here
 *   max pooling      kernels here, with the CPU's int32 argmax (same ties)
 *   average pooling  kernels here, the CPU's sums in the CPU's order
 *   dense            cuBLAS sgemm (row-major through the transposes) and
 *                    a kernel for the bias and its gradient
 *   batch norm       kernels here, one block per channel, sums in double
 *                    (the CPU's two-pass mean and biased variance)
 *   relu, dropout    kernels here (dropout: the CPU's counter-based RNG)
 *   softmax + xent   cuDNN softmax for the probabilities, kernels for the
 *                    loss (one block, deterministic) and its gradient
 *   embeddings       kernels here, a thread per (row, column), the CPU's
 *                    sums in the CPU's order (no atomics); copy_cols a
 *                    2D copy; the logistic loss in one block, in double
 *
 * Why kernels of our own rather than cuDNN in places: pooling, relu and the
 * softmax gradient then give the CPU's results bit for bit (cuDNN's pooling
 * backward also takes x and y, which the pooling backward ops here are not
 * given), and every reduction here has a fixed order, so a step can be
 * replayed.
 *
 * All state (handles, stream, workspace, plans) lives in cuda_backend; there
 * is no global device state. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <math.h>
#include <math_constants.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "../../common/util.h" /* error codes and PS_ERRLEN only: no link dependency */
}
#include <cuda_bf16.h>

#include "cuda_check.h"
#include "ops_cuda.h"

/* Threads per block of the elementwise kernels, and the most blocks one
 * launch uses; larger arrays are covered by grid-stride loops. */
enum { THREADS = 256, MAX_BLOCKS = 1 << 16 };

/* The most workspace one convolution algorithm may ask for. The FFT
 * algorithms can want gigabytes on large shapes; one of the GEMM-based
 * algorithms always fits well under this. */
static const size_t MAX_CONV_WORKSPACE = (size_t)512 << 20;

/* cuBLAS's workspace (it recommends 32 MiB on Hopper, 4 MiB before). */
static const size_t BLAS_WORKSPACE = (size_t)32 << 20;

/* One convolution shape with its descriptors and chosen algorithms. Each
 * direction has a convolution descriptor of its own because the math type
 * is set per descriptor and could differ between the three choices. */
typedef struct {
  ps_conv_shape s;              /* the key: every field that goes into a descriptor */
  cudnnTensorDescriptor_t x, y; /* (n, c, h, w), (n, oc, oh, ow); also dx, dy */
  cudnnFilterDescriptor_t w;    /* (oc, c, kh, kw): the (OC, IC*KH*KW) layout */
  cudnnConvolutionDescriptor_t conv_fwd, conv_bwd_data, conv_bwd_filter;
  cudnnConvolutionFwdAlgo_t fwd;
  cudnnConvolutionBwdDataAlgo_t bwd_data;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter;
  size_t fwd_bytes, bwd_data_bytes, bwd_filter_bytes; /* workspace each needs */
  int pass[3]; /* pick_algo's pass of each choice (forward, data, filter) */
} conv_plan;

typedef struct {
  ps_ops ops; /* ops.ctx points back at this struct */
  int device;
  cudaStream_t stream; /* every op and copy of the backend, in order */
  /* Copies beside compute (to_device_async, to_host_async): their own
   * stream, ordered against `stream` with events. A ticket t is the event
   * tickets[t % N_TICKETS] recorded after its copy; when that event has
   * since been recorded again, waiting for it waits for a later copy on
   * the same stream, which is never too short. */
  cudaStream_t copy_stream;
  cudaEvent_t h2d_done;     /* recorded on copy_stream after each to_device_async */
  cudaEvent_t compute_mark; /* recorded on stream before each to_host_async */
  cudaEvent_t marks[PS_MARKS]; /* ps_ops.mark, timed, on stream */
  bool marked[PS_MARKS];
  cudaEvent_t tickets[64];
  uint64_t last_ticket;
  cudnnHandle_t cudnn;
  cublasHandle_t cublas;
  void *work; /* cuDNN workspace: the largest any plan needs */
  size_t work_bytes;
  float *stage; /* aligned copies of misaligned conv weights and their gradient */
  size_t stage_floats;
  conv_plan *plans; /* every shape seen; a model has a handful */
  int n_plans, cap_plans;
  cudnnTensorDescriptor_t probs_desc; /* (n, k, 1, 1), set per call */
  double *loss_dev;                   /* 1 value: the summed loss */
  uint64_t *rng_base_dev;             /* set_rng_step's base of the dropout streams */
  ps_precision precision;             /* of convolutions and dense layers */
  bool capturing;                     /* between graph_begin and graph_end */
  /* The marks recorded into the graph being captured, and into the graph
   * instantiated: its replays record them again (as external event
   * records), so a launch counts them as recorded for marks_read. */
  bool capture_marks[PS_MARKS], graph_marks[PS_MARKS];
  cudaGraphExec_t graph;              /* the last capture, ready to launch */
  void *blas_work;                    /* cuBLAS's workspace: none allocated in a capture */
  __nv_bfloat16 *half;                /* bf16: the operands' bfloat16 copies */
  size_t half_count;
  double *loss_host;                  /* 1 value, pinned */
} cuda_backend;

/* ---- small helpers ---- */

/* The backend behind ctx, with its device made current on this thread. */
static cuda_backend *enter(void *ctx) {
  cuda_backend *be = (cuda_backend *)ctx;
  CUDA_CHECK(cudaSetDevice(be->device));
  return be;
}

static unsigned blocks_for(size_t n) {
  size_t b = (n + THREADS - 1) / THREADS;
  return (unsigned)(b < (size_t)MAX_BLOCKS ? b : (size_t)MAX_BLOCKS);
}

#define GRID_STRIDE(i, n)                                                         \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)(n); \
       i += (size_t)gridDim.x * blockDim.x)

static void zero_async(cuda_backend *be, void *p, size_t bytes) {
  if (p && bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, be->stream));
}

enum { N_TICKETS = 64 };

/* Waits for both streams. */
static void sync_streams(cuda_backend *be) {
  CUDA_CHECK(cudaStreamSynchronize(be->stream));
  CUDA_CHECK(cudaStreamSynchronize(be->copy_stream));
}

/* Frees p once the work queued on the streams (which may still read it) is
 * done. */
static void free_after_stream(cuda_backend *be, void *p) {
  if (!p) return;
  sync_streams(be);
  CUDA_CHECK(cudaFree(p));
}

/* Grows the cuDNN workspace to at least `bytes`. */
static void ensure_work(cuda_backend *be, size_t bytes) {
  if (bytes <= be->work_bytes) return;
  free_after_stream(be, be->work);
  be->work = NULL;
  be->work_bytes = 0;
  CUDA_CHECK(cudaMalloc(&be->work, bytes));
  be->work_bytes = bytes;
}

/* Two 16-byte aligned regions of `floats` each in the staging buffer,
 * grown as needed: *w0 for a copy of the weights, *w1 for their gradient. */
static void stage_regions(cuda_backend *be, size_t floats, float **w0, float **w1) {
  const size_t per = (floats + 63) & ~(size_t)63;
  if (2 * per > be->stage_floats) {
    free_after_stream(be, be->stage);
    be->stage = NULL;
    be->stage_floats = 0;
    CUDA_CHECK(cudaMalloc((void **)&be->stage, 2 * per * sizeof(float)));
    be->stage_floats = 2 * per;
  }
  *w0 = be->stage;
  *w1 = be->stage + per;
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* ---- bf16 operands ----
 * With --precision bf16 each convolution and dense layer converts its
 * float32 operands into bfloat16 copies (round to nearest even), runs on
 * them with float32 accumulation, and converts bfloat16 results back. The
 * copies live in one growing buffer, cut into 256-byte aligned pieces. */

static __global__ void to_bf16_kernel(size_t n, const float *x, __nv_bfloat16 *y) {
  GRID_STRIDE(i, n) y[i] = __float2bfloat16_rn(x[i]);
}

static __global__ void from_bf16_kernel(size_t n, const __nv_bfloat16 *x, float *y) {
  GRID_STRIDE(i, n) y[i] = __bfloat162float(x[i]);
}

static size_t half_round(size_t n) { return (n + 127) & ~(size_t)127; } /* 256 bytes */

/* Room for pieces of the given counts (0 ends the list), at most 6. */
static void half_pieces(cuda_backend *be, const size_t *counts, __nv_bfloat16 **out) {
  size_t total = 0;
  for (int i = 0; counts[i]; i++) total += half_round(counts[i]);
  if (total > be->half_count) {
    free_after_stream(be, be->half);
    be->half = NULL;
    be->half_count = 0;
    CUDA_CHECK(cudaMalloc(&be->half, total * sizeof(__nv_bfloat16)));
    be->half_count = total;
  }
  size_t at = 0;
  for (int i = 0; counts[i]; i++) {
    out[i] = be->half + at;
    at += half_round(counts[i]);
  }
}

static void to_bf16(cuda_backend *be, const float *x, __nv_bfloat16 *y, size_t n) {
  if (n == 0) return;
  to_bf16_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, x, y);
  CUDA_CHECK_LAUNCH();
}

static void from_bf16(cuda_backend *be, const __nv_bfloat16 *x, float *y, size_t n) {
  if (n == 0) return;
  from_bf16_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, x, y);
  CUDA_CHECK_LAUNCH();
}

/* ---- the counter-based RNG of common/rng.c, on both sides ----
 *
 * The same splitmix64 finalizer, so ps_rng_uniform(seed, stream, i) is the
 * same float here as on the CPU. The key depends only on (seed, stream):
 * computed once, on the host, or by the dropout kernel from the stream
 * base set_rng_step keeps on the device. */
__host__ __device__ static inline uint64_t rng_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

__host__ __device__ static inline uint64_t rng_key(uint64_t seed, uint64_t stream) {
  return rng_mix64(seed + 0x9e3779b97f4a7c15ULL * (stream + 1));
}

/* ps_rng_uniform: the top 24 bits as an exact float, times the exact 2^-24. */
__device__ static inline float rng_uniform(uint64_t key, uint64_t counter) {
  const uint64_t bits = rng_mix64(key ^ rng_mix64(counter + 0x632be59bd9b4e019ULL));
  return (float)(bits >> 40) * (1.0f / 16777216.0f);
}

/* ---- kernels ----
 *
 * Products and differences that the CPU rounds separately are written with
 * the _rn intrinsics where a fused multiply-add could otherwise form (nvcc
 * contracts a*b - c by default), so that those results match bit for bit. */

/* y (planes, plane) += b[plane index % channels] */
static __global__ void bias_add_kernel(size_t total, size_t plane, int channels, const float *b,
                                       float *y) {
  GRID_STRIDE(i, total) y[i] += b[(i / plane) % (size_t)channels];
}

/* db[c] = the sum of dy over the n examples and the plane of channel c: one
 * block per channel, a fixed order. Thread t takes the elements t, t + B,
 * t + 2B, ... of the channel's n x plane values (B threads); their example
 * and offset advance by B's quotient and remainder, so the loop divides
 * nothing (a 64-bit divide per element cost more than the load). */
static __global__ void bias_grad_kernel(int n, int channels, size_t plane, const float *dy,
                                        float *db) {
  __shared__ float part[THREADS];
  const int c = blockIdx.x;
  float sum = 0.0f;
  if (plane > 0) {
    const size_t step_i = blockDim.x / plane, step_j = blockDim.x % plane;
    size_t i = threadIdx.x / plane, j = threadIdx.x % plane;
    const size_t stride = (size_t)channels * plane;
    for (; i < (size_t)n; i += step_i, j += step_j) {
      if (j >= plane) {
        j -= plane;
        i++;
        if (i >= (size_t)n) break;
      }
      sum += dy[i * stride + (size_t)c * plane + j];
    }
  }
  part[threadIdx.x] = sum;
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[c] = part[0];
}

/* As the CPU: the window's taps in row-major order, a later tap replacing
 * the maximum only when greater (ties keep the first; a NaN never wins, and
 * a NaN first tap stays). argmax may be NULL. */
static __global__ void maxpool_forward_kernel(size_t total, int h, int w, int oh, int ow, int size,
                                              int stride, const float *x, float *y,
                                              int32_t *argmax) {
  const size_t out_plane = (size_t)oh * ow, in_plane = (size_t)h * w;
  GRID_STRIDE(i, total) {
    const size_t p = i / out_plane;
    const int o = (int)(i % out_plane);
    const float *xp = x + p * in_plane;
    const int top = (o / ow) * stride * w + (o % ow) * stride;
    int best = top;
    float best_v = xp[top];
    for (int kh = 0; kh < size; kh++) {
      for (int kw = 0; kw < size; kw++) {
        const int at = top + kh * w + kw;
        const float v = xp[at];
        if (v > best_v) {
          best = at;
          best_v = v;
        }
      }
    }
    y[i] = best_v;
    if (argmax) argmax[i] = best;
  }
}

/* A gather, one thread per input: the outputs whose window covers the
 * input, in increasing output index (the order in which the CPU adds them
 * into its zeroed plane), that picked it. No atomics, the CPU's sums. */
static __global__ void maxpool_backward_kernel(size_t total, int h, int w, int oh, int ow, int size,
                                               int stride, const float *dy, const int32_t *argmax,
                                               float *dx) {
  const size_t out_plane = (size_t)oh * ow, in_plane = (size_t)h * w;
  GRID_STRIDE(i, total) {
    const size_t p = i / in_plane;
    const int q = (int)(i % in_plane), ih = q / w, iw = q % w;
    /* Windows r with r*stride <= ih <= r*stride + size - 1. */
    const int r0 = ih >= size ? (ih - size + stride) / stride : 0;
    const int c0 = iw >= size ? (iw - size + stride) / stride : 0;
    const int r1 = min(ih / stride, oh - 1), c1 = min(iw / stride, ow - 1);
    const float *dyp = dy + p * out_plane;
    const int32_t *ap = argmax + p * out_plane;
    float sum = 0.0f;
    for (int r = r0; r <= r1; r++) {
      for (int c = c0; c <= c1; c++) {
        const int o = r * ow + c;
        if (ap[o] == q) sum += dyp[o];
      }
    }
    dx[i] = sum;
  }
}

/* As the CPU: a window's taps summed from 0 in row-major order, divided by
 * the tap count (IEEE division: this file is built without fast math). */
static __global__ void avgpool_forward_kernel(size_t total, int h, int w, int oh, int ow, int size,
                                              int stride, const float *x, float *y) {
  const size_t out_plane = (size_t)oh * ow, in_plane = (size_t)h * w;
  const float area = (float)(size * size);
  GRID_STRIDE(i, total) {
    const size_t p = i / out_plane;
    const int o = (int)(i % out_plane);
    const float *top = x + p * in_plane + (size_t)(o / ow) * stride * w + (size_t)(o % ow) * stride;
    float sum = 0.0f;
    for (int kh = 0; kh < size; kh++)
      for (int kw = 0; kw < size; kw++) sum += top[(size_t)kh * w + kw];
    y[i] = sum / area;
  }
}

/* A gather, one thread per input: the shares of the windows that cover it,
 * in increasing output index (the order in which the CPU adds them into its
 * zeroed plane). */
static __global__ void avgpool_backward_kernel(size_t total, int h, int w, int oh, int ow,
                                               int size, int stride, const float *dy, float *dx) {
  const size_t out_plane = (size_t)oh * ow, in_plane = (size_t)h * w;
  const float area = (float)(size * size);
  GRID_STRIDE(i, total) {
    const size_t p = i / in_plane;
    const int q = (int)(i % in_plane), ih = q / w, iw = q % w;
    /* Windows r with r*stride <= ih <= r*stride + size - 1. */
    const int r0 = ih >= size ? (ih - size + stride) / stride : 0;
    const int c0 = iw >= size ? (iw - size + stride) / stride : 0;
    const int r1 = min(ih / stride, oh - 1), c1 = min(iw / stride, ow - 1);
    const float *dyp = dy + p * out_plane;
    float sum = 0.0f;
    for (int r = r0; r <= r1; r++)
      for (int c = c0; c <= c1; c++) sum += dyp[r * ow + c] / area;
    dx[i] = sum;
  }
}

/* One thread per plane, its values in order from 0: the CPU's sum. */
static __global__ void global_avgpool_forward_kernel(size_t planes, size_t hw, const float *x,
                                                     float *y) {
  GRID_STRIDE(p, planes) {
    const float *xp = x + p * hw;
    float sum = 0.0f;
    for (size_t i = 0; i < hw; i++) sum += xp[i];
    y[p] = sum / (float)hw;
  }
}

static __global__ void global_avgpool_backward_kernel(size_t total, size_t hw, const float *dy,
                                                      float *dx) {
  GRID_STRIDE(i, total) dx[i] = dy[i / hw] / (float)hw;
}

/* y (n, out) = b, row after row. */
static __global__ void broadcast_rows_kernel(size_t total, int out, const float *b, float *y) {
  GRID_STRIDE(i, total) y[i] = b[i % (size_t)out];
}

/* db[j] = sum over the n rows of dy[i][j], rows in order (as the CPU). */
static __global__ void sum_rows_kernel(int n, int out, const float *dy, float *db) {
  GRID_STRIDE(j, out) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += dy[(size_t)i * out + j];
    db[j] = sum;
  }
}

static __global__ void relu_forward_kernel(size_t n, const float *x, float *y) {
  GRID_STRIDE(i, n) {
    const float v = x[i];
    y[i] = v > 0.0f ? v : 0.0f;
  }
}

static __global__ void relu_backward_kernel(size_t n, const float *y, const float *dy, float *dx) {
  GRID_STRIDE(i, n) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* Rounded to nearest as written, like the CPU's a[i] + b[i]. */
static __global__ void add_kernel(size_t n, const float *a, const float *b, float *y) {
  GRID_STRIDE(i, n) y[i] = __fadd_rn(a[i], b[i]);
}

/* Inverted dropout with ps_rng_uniform(seed, base + stream, i), the stream's
 * base read from the device when the kernel runs: a step recorded once
 * replays with the masks of the step set_rng_step named. */
static __global__ void dropout_forward_base_kernel(size_t n, float rate, float scale,
                                                   uint64_t seed, uint64_t stream,
                                                   const uint64_t *base, const float *x, float *y,
                                                   float *mask) {
  const uint64_t key = rng_key(seed, *base + stream);
  GRID_STRIDE(i, n) {
    const float keep = rng_uniform(key, i) >= rate ? scale : 0.0f;
    mask[i] = keep;
    y[i] = __fmul_rn(x[i], keep);
  }
}

static __global__ void set_u64_kernel(uint64_t *p, uint64_t v) { *p = v; }

static __global__ void dropout_backward_kernel(size_t n, const float *mask, const float *dy,
                                               float *dx) {
  GRID_STRIDE(i, n) dx[i] = __fmul_rn(dy[i], mask[i]);
}

/* *loss = the sum over the n rows of log-sum-exp(row) - row[label], each
 * row shifted by its maximum (as the CPU, so no overflow and no log(0));
 * NaN if a label is outside [0, k). One block: rows strided over the
 * threads, then a fixed tree, so the sum is the same every run. */
static __global__ void xent_loss_kernel(int n, int k, const float *logits, const uint8_t *labels,
                                        double *loss) {
  __shared__ double part[THREADS];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float *l = logits + (size_t)i * k;
    float max = l[0];
    for (int j = 1; j < k; j++) max = l[j] > max ? l[j] : max;
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += (double)expf(l[j] - max);
    const int label = labels[i];
    acc += label < k ? log(sum) - (double)(l[label] - max) : CUDART_NAN;
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = part[0];
}

/* The end of a one-block statistics kernel: each thread's loss sum and
 * hit count summed over the block in a fixed tree (the same order on
 * every run), stats[0] the losses, stats[1] the hits. */
static __device__ void stats_reduce(double *part, int *hits, double acc, int right,
                                    double *stats) {
  part[threadIdx.x] = acc;
  hits[threadIdx.x] = right;
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if ((int)threadIdx.x < half) {
      part[threadIdx.x] += part[threadIdx.x + half];
      hits[threadIdx.x] += hits[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    stats[0] = part[0];
    stats[1] = (double)hits[0];
  }
}

/* stats[0] = the loss sum as xent_loss_kernel; stats[1] = the examples
 * whose first largest probability is at the label (the CPU's arg-max: strict
 * >, in index order). One block, the same fixed tree. */
static __global__ void xent_stats_kernel(int n, int k, const float *logits, const float *probs,
                                         const uint8_t *labels, double *stats) {
  __shared__ double part[THREADS];
  __shared__ int hits[THREADS];
  double acc = 0.0;
  int right = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float *l = logits + (size_t)i * k;
    const float *p = probs + (size_t)i * k;
    float max = l[0];
    int best = 0;
    for (int j = 1; j < k; j++) {
      max = l[j] > max ? l[j] : max;
      if (p[j] > p[best]) best = j;
    }
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += (double)expf(l[j] - max);
    const int label = labels[i];
    acc += label < k ? log(sum) - (double)(l[label] - max) : CUDART_NAN;
    right += best == label;
  }
  stats_reduce(part, hits, acc, right, stats);
}

/* dlogits = probs * inv_n, minus inv_n at the label: the CPU's two
 * roundings, unfused. */
static __global__ void xent_backward_kernel(size_t total, int k, float inv_n, const float *probs,
                                            const uint8_t *labels, float *dlogits) {
  GRID_STRIDE(i, total) {
    float d = __fmul_rn(probs[i], inv_n);
    if ((int)labels[i / (size_t)k] == (int)(i % (size_t)k)) d = __fsub_rn(d, inv_n);
    dlogits[i] = d;
  }
}

/* ---- batch normalization kernels ----
 *
 * One block per channel (blockIdx.x = k) for the statistics and the
 * gradient sums: its threads stride over the channel's n*hw values, each
 * summing its share in double, then a fixed tree over the block, so the
 * sums are the same every run (and within the last bit or two of the
 * CPU's, which also sums in double). The block then writes the channel's
 * outputs itself, so one launch does a whole op and needs no scratch
 * memory: nothing to allocate while a step is captured into a graph.
 * Float results use the reference's formulas with the _rn intrinsics
 * (no fused multiply-add), so that with equal statistics they are equal. */

/* Threads of the per-channel blocks: more than THREADS, because a layer
 * has few channels (often fewer than the device has SMs) and each block
 * must keep enough loads in flight on its own. __launch_bounds__ holds the
 * kernels to the registers this takes (64 a thread). */
enum { BN_THREADS = 1024 };

/* Calls f(at) for the elements at = (i*c + k)*hw + j of channel k, for the
 * element numbers e = i*hw + j = first, first + step, ... below n*hw: the
 * example and offset advance by step's quotient and remainder, so the loop
 * divides nothing (as bias_grad_kernel). */
template <typename F>
__device__ static inline void bn_for_channel(int n, int c, size_t hw, int k, size_t first,
                                             size_t step, F f) {
  if (hw == 0) return;
  const size_t step_i = step / hw, step_j = step % hw;
  const size_t stride = (size_t)c * hw, base = (size_t)k * hw;
  size_t i = first / hw, j = first % hw;
  for (; i < (size_t)n; i += step_i, j += step_j) {
    if (j >= hw) { /* j + step_j < 2*hw: one carry at most */
      j -= hw;
      i++;
      if (i >= (size_t)n) break;
    }
    f(i * stride + base + j);
  }
}

/* The sum of v over the block (blockDim.x a power of two, part one double
 * per thread), in a fixed tree; every thread gets it. part is free again
 * on return. */
__device__ static double bn_block_sum(double v, double *part) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  const double sum = part[0];
  __syncthreads(); /* everyone has read part[0] before it is written again */
  return sum;
}

/* forward_train, channel blockIdx.x: the mean, then the sum of squared
 * deviations from it (two passes, as the CPU: no cancellation of E[x^2] -
 * mean^2), the statistics, then y. m = n*hw may be 0 (statistics 0, as
 * the CPU's). */
static __global__ void __launch_bounds__(BN_THREADS)
    bn_train_kernel(int n, int c, size_t hw, float eps, const float *x, const float *gamma,
                    const float *beta, float *y, float *mean, float *var, float *invstd) {
  __shared__ double part[BN_THREADS];
  __shared__ float coef[3]; /* mean, gamma * invstd, beta */
  const int k = blockIdx.x;
  const double m = (double)n * (double)hw;
  double s = 0.0;
  bn_for_channel(n, c, hw, k, threadIdx.x, blockDim.x, [&](size_t at) { s += (double)x[at]; });
  s = bn_block_sum(s, part); /* every thread calls it: it has barriers */
  const double mu = m > 0 ? s / m : 0.0;
  double q = 0.0;
  bn_for_channel(n, c, hw, k, threadIdx.x, blockDim.x, [&](size_t at) {
    const double d = (double)x[at] - mu;
    q += d * d;
  });
  q = bn_block_sum(q, part);
  if (threadIdx.x == 0) {
    const double v = m > 0 ? q / m : 0.0;
    const float is = (float)(1.0 / sqrt(v + (double)eps));
    mean[k] = (float)mu;
    var[k] = (float)v;
    invstd[k] = is;
    coef[0] = (float)mu;
    coef[1] = __fmul_rn(gamma[k], is);
    coef[2] = beta[k];
  }
  __syncthreads();
  const float mf = coef[0], scale = coef[1], shift = coef[2];
  /* Each thread writes only the elements it read above (after the block's
   * last read of x in bn_block_sum), so this is right even in place. */
  bn_for_channel(n, c, hw, k, threadIdx.x, blockDim.x, [&](size_t at) {
    y[at] = __fadd_rn(__fmul_rn(__fsub_rn(x[at], mf), scale), shift);
  });
}

/* forward_infer: elementwise, a grid of (channels, parts of a channel);
 * each thread computes its channel's scale once, as the CPU does. */
static __global__ void bn_infer_kernel(int n, int c, size_t hw, float eps, const float *x,
                                       const float *gamma, const float *beta, const float *mean,
                                       const float *var, float *y) {
  const int k = blockIdx.x;
  const float mf = mean[k], shift = beta[k];
  const float scale = __fmul_rn(gamma[k], (float)(1.0 / sqrt((double)var[k] + (double)eps)));
  bn_for_channel(
      n, c, hw, k, (size_t)blockIdx.y * blockDim.x + threadIdx.x, (size_t)gridDim.y * blockDim.x,
      [&](size_t at) { y[at] = __fadd_rn(__fmul_rn(__fsub_rn(x[at], mf), scale), shift); });
}

/* backward, channel blockIdx.x: dbeta = sum dy, dgamma = sum dy * xhat
 * (xhat rounded in float, as the CPU), then dx unless it is NULL. */
static __global__ void __launch_bounds__(BN_THREADS)
    bn_backward_kernel(int n, int c, size_t hw, const float *x, const float *dy, const float *gamma,
                       const float *mean, const float *invstd, float *dx, float *dgamma,
                       float *dbeta) {
  __shared__ double part[BN_THREADS];
  __shared__ float coef[3]; /* gamma * invstd, dbeta / m, dgamma / m */
  const int k = blockIdx.x;
  const double m = (double)n * (double)hw;
  const float mf = mean[k], is = invstd[k];
  double sd = 0.0, sdx = 0.0;
  bn_for_channel(n, c, hw, k, threadIdx.x, blockDim.x, [&](size_t at) {
    const double g = dy[at];
    sd += g;
    sdx += g * (double)__fmul_rn(__fsub_rn(x[at], mf), is);
  });
  sd = bn_block_sum(sd, part);
  sdx = bn_block_sum(sdx, part);
  if (threadIdx.x == 0) {
    dbeta[k] = (float)sd;
    dgamma[k] = (float)sdx;
    coef[0] = __fmul_rn(gamma[k], is);
    coef[1] = m > 0 ? (float)(sd / m) : 0.0f;
    coef[2] = m > 0 ? (float)(sdx / m) : 0.0f;
  }
  if (!dx) return; /* the same for the whole block: no thread waits below */
  __syncthreads();
  const float a = coef[0], b = coef[1], q = coef[2];
  bn_for_channel(n, c, hw, k, threadIdx.x, blockDim.x, [&](size_t at) {
    const float xh = __fmul_rn(__fsub_rn(x[at], mf), is);
    dx[at] = __fmul_rn(a, __fsub_rn(__fsub_rn(dy[at], b), __fmul_rn(xh, q)));
  });
}

/* ---- convolution ---- */

static bool same_conv_shape(const ps_conv_shape *a, const ps_conv_shape *b) {
  return a->n == b->n && a->c == b->c && a->h == b->h && a->w == b->w && a->oc == b->oc &&
         a->kh == b->kh && a->kw == b->kw && a->stride == b->stride && a->pad == b->pad &&
         a->oh == b->oh && a->ow == b->ow;
}

/* Index in perf[0..count) of the algorithm to use, or -1. In the
 * heuristics' order, the first that (pass 0) runs with FMA math and is
 * deterministic, else (pass 1) runs with FMA math, else (pass 2) runs at
 * all, with the math type cuDNN proposed (which may be TF32 tensor cores:
 * results then differ from the CPU's by about 1e-3, and a warning says so).
 * FMA math keeps float32 products exact before accumulation, as the CPU's
 * sgemm does; deterministic algorithms (no atomics) make a step replayable.
 * workspace(algo, math, &bytes) asks cuDNN whether the algorithm supports the
 * shape with that math type, and how much workspace it needs.
 *
 * The heuristics rather than cudnnFind*AlgorithmEx: their choice is the
 * same on every run and every replica (Find times the candidates, and a near
 * tie in time can go either way, changing the rounding of the results from
 * one run to the next), they need no buffers (so conv2d_workspace can choose
 * before any data exists), and they take microseconds, not a benchmark. */
template <typename Perf, typename WorkspaceFn>
static int pick_algo(const Perf *perf, int count, WorkspaceFn workspace, size_t *bytes,
                     cudnnMathType_t *math, int *pass_out, ps_precision precision) {
  /* tf32 and bf16: tensor cores wanted. In the heuristics' order, the first
   * deterministic algorithm with the math type cuDNN proposes for it, else
   * (pass 1) the first at all; fp32 as above. */
  const bool fp32 = precision == PS_PRECISION_FP32;
  for (int pass = 0; pass < (fp32 ? 3 : 2); pass++) {
    for (int i = 0; i < count; i++) {
      const Perf &p = perf[i];
      if (p.status != CUDNN_STATUS_SUCCESS) continue;
      const bool tensor_op =
          p.mathType == CUDNN_TENSOR_OP_MATH || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
      if (fp32 && pass < 2 && tensor_op) continue;
      if (pass == 0 && p.determinism != CUDNN_DETERMINISTIC) continue;
      const cudnnMathType_t m = fp32 && pass < 2 ? CUDNN_FMA_MATH : p.mathType;
      size_t b = 0;
      if (workspace(p.algo, m, &b) != CUDNN_STATUS_SUCCESS || b > MAX_CONV_WORKSPACE) continue;
      if (fp32 && pass == 2)
        fprintf(stderr,
                "cuda backend: warning: no FMA-math convolution algorithm fits; using "
                "algorithm %d with math type %d (results may differ from the CPU's by ~1e-3)\n",
                (int)p.algo, (int)m);
      *bytes = b;
      *math = m;
      *pass_out = pass;
      return i;
    }
  }
  return -1;
}

static void conv_plan_choose(cuda_backend *be, conv_plan *p) {
  /* More than any cuDNN has (FWD 8, BWD_DATA 6, BWD_FILTER 7 algorithms). */
  enum { MAX_PERF = 16 };
  int got = 0;
  cudnnMathType_t math;

  cudnnConvolutionFwdAlgoPerf_t fwd[MAX_PERF];
  CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(be->cudnn, p->x, p->w, p->conv_fwd, p->y,
                                                     MAX_PERF, &got, fwd));
  int i = pick_algo(
      fwd, got,
      [&](cudnnConvolutionFwdAlgo_t a, cudnnMathType_t m, size_t *b) {
        CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv_fwd, m));
        return cudnnGetConvolutionForwardWorkspaceSize(be->cudnn, p->x, p->w, p->conv_fwd, p->y, a,
                                                       b);
      },
      &p->fwd_bytes, &math, &p->pass[0], be->precision);
  if (i < 0) PS_CUDA_FATAL("no cuDNN forward convolution algorithm supports this shape");
  p->fwd = fwd[i].algo;
  CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv_fwd, math));

  cudnnConvolutionBwdDataAlgoPerf_t bd[MAX_PERF];
  CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(be->cudnn, p->w, p->y, p->conv_bwd_data,
                                                          p->x, MAX_PERF, &got, bd));
  i = pick_algo(
      bd, got,
      [&](cudnnConvolutionBwdDataAlgo_t a, cudnnMathType_t m, size_t *b) {
        CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv_bwd_data, m));
        return cudnnGetConvolutionBackwardDataWorkspaceSize(be->cudnn, p->w, p->y, p->conv_bwd_data,
                                                            p->x, a, b);
      },
      &p->bwd_data_bytes, &math, &p->pass[1], be->precision);
  if (i < 0) PS_CUDA_FATAL("no cuDNN backward-data convolution algorithm supports this shape");
  p->bwd_data = bd[i].algo;
  CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv_bwd_data, math));

  cudnnConvolutionBwdFilterAlgoPerf_t bf[MAX_PERF];
  CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
      be->cudnn, p->x, p->y, p->conv_bwd_filter, p->w, MAX_PERF, &got, bf));
  i = pick_algo(
      bf, got,
      [&](cudnnConvolutionBwdFilterAlgo_t a, cudnnMathType_t m, size_t *b) {
        CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv_bwd_filter, m));
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(be->cudnn, p->x, p->y,
                                                              p->conv_bwd_filter, p->w, a, b);
      },
      &p->bwd_filter_bytes, &math, &p->pass[2], be->precision);
  if (i < 0) PS_CUDA_FATAL("no cuDNN backward-filter convolution algorithm supports this shape");
  p->bwd_filter = bf[i].algo;
  CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv_bwd_filter, math));
}

static void conv_plan_destroy(conv_plan *p) {
  if (p->x) CUDNN_CHECK(cudnnDestroyTensorDescriptor(p->x));
  if (p->y) CUDNN_CHECK(cudnnDestroyTensorDescriptor(p->y));
  if (p->w) CUDNN_CHECK(cudnnDestroyFilterDescriptor(p->w));
  if (p->conv_fwd) CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(p->conv_fwd));
  if (p->conv_bwd_data) CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(p->conv_bwd_data));
  if (p->conv_bwd_filter) CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(p->conv_bwd_filter));
}

/* The plan of shape s (which must not be degenerate), made on first use:
 * descriptors, algorithms, and a workspace large enough for them. */
static conv_plan *conv_plan_get(cuda_backend *be, const ps_conv_shape *s) {
  for (int i = 0; i < be->n_plans; i++)
    if (same_conv_shape(&be->plans[i].s, s)) return &be->plans[i];
  if (be->n_plans == be->cap_plans) {
    int cap = be->cap_plans ? 2 * be->cap_plans : 8;
    conv_plan *grown = (conv_plan *)realloc(be->plans, (size_t)cap * sizeof *grown);
    if (!grown) PS_CUDA_FATAL("out of host memory for a convolution plan");
    be->plans = grown;
    be->cap_plans = cap;
  }
  conv_plan *p = &be->plans[be->n_plans++];
  memset(p, 0, sizeof *p);
  p->s = *s;
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  /* bf16: the operands are bfloat16 copies, cuDNN accumulates in float32
   * (its "pseudo bfloat16" configuration: float32 compute type below). */
  const cudnnDataType_t dt =
      be->precision == PS_PRECISION_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, dt, s->n, s->c, s->h, s->w));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, dt, s->n, s->oc, s->oh, s->ow));
  CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, dt, CUDNN_TENSOR_NCHW, s->oc, s->c, s->kh, s->kw));
  cudnnConvolutionDescriptor_t *convs[3] = {&p->conv_fwd, &p->conv_bwd_data, &p->conv_bwd_filter};
  for (int d = 0; d < 3; d++) {
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(convs[d]));
    /* The CPU computes a cross-correlation (im2col, no kernel flip). */
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(*convs[d], s->pad, s->pad, s->stride, s->stride, 1,
                                                1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CUDNN_CHECK(cudnnSetConvolutionMathType(
        *convs[d], be->precision == PS_PRECISION_FP32 ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH));
  }
  int n, c, oh, ow;
  CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(p->conv_fwd, p->x, p->w, &n, &c, &oh, &ow));
  if (n != s->n || c != s->oc || oh != s->oh || ow != s->ow)
    PS_CUDA_FATAL("conv shape: oh, ow disagree with cuDNN (call ps_conv_shape_finish)");
  conv_plan_choose(be, p);
  size_t need = p->fwd_bytes;
  if (p->bwd_data_bytes > need) need = p->bwd_data_bytes;
  if (p->bwd_filter_bytes > need) need = p->bwd_filter_bytes;
  ensure_work(be, need);
  return p;
}

/* No input channel, no output, or no example: nothing for cuDNN to do. */
static bool conv_degenerate(const ps_conv_shape *s) {
  return s->n <= 0 || s->c <= 0 || s->oc <= 0 || s->oh <= 0 || s->ow <= 0 || s->kh <= 0 ||
         s->kw <= 0;
}

static size_t conv_w_count(const ps_conv_shape *s) { return (size_t)s->oc * s->c * s->kh * s->kw; }

static size_t cuda_conv2d_workspace(void *ctx, const ps_conv_shape *s) {
  cuda_backend *be = enter(ctx);
  if (!conv_degenerate(s)) conv_plan_get(be, s); /* choose the algorithms now */
  return 0;
}

static void conv_bias_add(cuda_backend *be, const ps_conv_shape *s, const float *b, float *y) {
  const size_t plane = (size_t)s->oh * s->ow, total = (size_t)s->n * s->oc * plane;
  if (total == 0) return;
  bias_add_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(total, plane, s->oc, b, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_conv2d_forward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                                const float *b, float *y, float *work) {
  (void)work; /* the backend's own, see ops_cuda.h */
  cuda_backend *be = enter(ctx);
  if (conv_degenerate(s)) {
    /* With no input channel every output is its bias; otherwise y is empty. */
    const size_t total = (size_t)(s->n > 0 ? s->n : 0) * (s->oc > 0 ? s->oc : 0) *
                         (s->oh > 0 ? s->oh : 0) * (s->ow > 0 ? s->ow : 0);
    if (total) {
      zero_async(be, y, total * sizeof(float));
      conv_bias_add(be, s, b, y);
    }
    return;
  }
  const conv_plan *p = conv_plan_get(be, s);
  const float one = 1.0f, zero = 0.0f;
  if (be->precision == PS_PRECISION_BF16) {
    const size_t nx = (size_t)s->n * s->c * s->h * s->w, ny = (size_t)s->n * s->oc * s->oh * s->ow;
    const size_t counts[] = {nx, conv_w_count(s), ny, 0};
    __nv_bfloat16 *h[3];
    half_pieces(be, counts, h);
    to_bf16(be, x, h[0], nx);
    to_bf16(be, w, h[1], conv_w_count(s));
    CUDNN_CHECK(cudnnConvolutionForward(be->cudnn, &one, p->x, h[0], p->w, h[1], p->conv_fwd,
                                        p->fwd, be->work, p->fwd_bytes, &zero, p->y, h[2]));
    from_bf16(be, h[2], y, ny);
    conv_bias_add(be, s, b, y);
    return;
  }
  if (!aligned16(w)) {
    float *wa, *unused;
    stage_regions(be, conv_w_count(s), &wa, &unused);
    CUDA_CHECK(cudaMemcpyAsync(wa, w, conv_w_count(s) * sizeof(float), cudaMemcpyDeviceToDevice,
                               be->stream));
    w = wa;
  }
  CUDNN_CHECK(cudnnConvolutionForward(be->cudnn, &one, p->x, x, p->w, w, p->conv_fwd, p->fwd,
                                      be->work, p->fwd_bytes, &zero, p->y, y));
  conv_bias_add(be, s, b, y);
}

static void cuda_conv2d_backward(void *ctx, const ps_conv_shape *s, const float *x, const float *w,
                                 const float *dy, float *dx, float *dw, float *db, float *work) {
  (void)work;
  cuda_backend *be = enter(ctx);
  const size_t wn = conv_w_count(s);
  const size_t plane = (size_t)(s->oh > 0 ? s->oh : 0) * (s->ow > 0 ? s->ow : 0);
  if (s->oc > 0) {
    bias_grad_kernel<<<(unsigned)s->oc, THREADS, 0, be->stream>>>(s->n > 0 ? s->n : 0, s->oc, plane,
                                                                  dy, db);
    CUDA_CHECK_LAUNCH();
  }
  if (conv_degenerate(s)) {
    zero_async(be, dw, wn * sizeof(float));
    if (dx && s->n > 0 && s->c > 0)
      zero_async(be, dx, (size_t)s->n * s->c * s->h * s->w * sizeof(float));
    return;
  }
  const conv_plan *p = conv_plan_get(be, s);
  const float one = 1.0f, zero = 0.0f;
  if (be->precision == PS_PRECISION_BF16) {
    const size_t nx = (size_t)s->n * s->c * s->h * s->w, ny = (size_t)s->n * s->oc * s->oh * s->ow;
    const size_t counts[] = {nx, wn, ny, wn, dx ? nx : 1, 0};
    __nv_bfloat16 *h[5]; /* x, w, dy, dw, dx */
    half_pieces(be, counts, h);
    to_bf16(be, x, h[0], nx);
    to_bf16(be, dy, h[2], ny);
    if (dx) {
      to_bf16(be, w, h[1], wn);
      CUDNN_CHECK(cudnnConvolutionBackwardData(be->cudnn, &one, p->w, h[1], p->y, h[2],
                                               p->conv_bwd_data, p->bwd_data, be->work,
                                               p->bwd_data_bytes, &zero, p->x, h[4]));
      from_bf16(be, h[4], dx, nx);
    }
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(be->cudnn, &one, p->x, h[0], p->y, h[2],
                                               p->conv_bwd_filter, p->bwd_filter, be->work,
                                               p->bwd_filter_bytes, &zero, p->w, h[3]));
    from_bf16(be, h[3], dw, wn);
    return;
  }
  float *dw_out = dw;
  if (!aligned16(w) || !aligned16(dw)) {
    float *wa, *dwa;
    stage_regions(be, wn, &wa, &dwa);
    if (!aligned16(w)) {
      CUDA_CHECK(cudaMemcpyAsync(wa, w, wn * sizeof(float), cudaMemcpyDeviceToDevice, be->stream));
      w = wa;
    }
    if (!aligned16(dw)) dw_out = dwa;
  }
  if (dx)
    CUDNN_CHECK(cudnnConvolutionBackwardData(be->cudnn, &one, p->w, w, p->y, dy, p->conv_bwd_data,
                                             p->bwd_data, be->work, p->bwd_data_bytes, &zero, p->x,
                                             dx));
  CUDNN_CHECK(cudnnConvolutionBackwardFilter(be->cudnn, &one, p->x, x, p->y, dy, p->conv_bwd_filter,
                                             p->bwd_filter, be->work, p->bwd_filter_bytes, &zero,
                                             p->w, dw_out));
  if (dw_out != dw)
    CUDA_CHECK(
        cudaMemcpyAsync(dw, dw_out, wn * sizeof(float), cudaMemcpyDeviceToDevice, be->stream));
}

/* ---- max pooling ---- */

static void cuda_maxpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y,
                                 int32_t *argmax) {
  cuda_backend *be = enter(ctx);
  if (s->n <= 0 || s->c <= 0 || s->oh <= 0 || s->ow <= 0) return;
  const size_t total = (size_t)s->n * s->c * s->oh * s->ow;
  maxpool_forward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(
      total, s->h, s->w, s->oh, s->ow, s->size, s->stride, x, y, argmax);
  CUDA_CHECK_LAUNCH();
}

static void cuda_maxpool_backward(void *ctx, const ps_pool_shape *s, const float *dy,
                                  const int32_t *argmax, float *dx) {
  cuda_backend *be = enter(ctx);
  if (s->n <= 0 || s->c <= 0 || s->h <= 0 || s->w <= 0) return;
  const size_t total = (size_t)s->n * s->c * s->h * s->w;
  if (s->oh <= 0 || s->ow <= 0) {
    zero_async(be, dx, total * sizeof(float));
    return;
  }
  maxpool_backward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(
      total, s->h, s->w, s->oh, s->ow, s->size, s->stride, dy, argmax, dx);
  CUDA_CHECK_LAUNCH();
}

/* ---- average pooling ---- */

static void cuda_avgpool_forward(void *ctx, const ps_pool_shape *s, const float *x, float *y) {
  cuda_backend *be = enter(ctx);
  if (s->n <= 0 || s->c <= 0 || s->oh <= 0 || s->ow <= 0) return;
  const size_t total = (size_t)s->n * s->c * s->oh * s->ow;
  avgpool_forward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(
      total, s->h, s->w, s->oh, s->ow, s->size, s->stride, x, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_avgpool_backward(void *ctx, const ps_pool_shape *s, const float *dy, float *dx) {
  cuda_backend *be = enter(ctx);
  if (s->n <= 0 || s->c <= 0 || s->h <= 0 || s->w <= 0) return;
  const size_t total = (size_t)s->n * s->c * s->h * s->w;
  if (s->oh <= 0 || s->ow <= 0) {
    zero_async(be, dx, total * sizeof(float));
    return;
  }
  avgpool_backward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(
      total, s->h, s->w, s->oh, s->ow, s->size, s->stride, dy, dx);
  CUDA_CHECK_LAUNCH();
}

static void cuda_global_avgpool_forward(void *ctx, int n, int c, int h, int w, const float *x,
                                        float *y) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || c <= 0 || h <= 0 || w <= 0) return;
  const size_t planes = (size_t)n * c;
  global_avgpool_forward_kernel<<<blocks_for(planes), THREADS, 0, be->stream>>>(
      planes, (size_t)h * w, x, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_global_avgpool_backward(void *ctx, int n, int c, int h, int w, const float *dy,
                                         float *dx) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || c <= 0 || h <= 0 || w <= 0) return;
  const size_t total = (size_t)n * c * h * w;
  global_avgpool_backward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(
      total, (size_t)h * w, dy, dx);
  CUDA_CHECK_LAUNCH();
}

/* ---- batch normalization ----
 *
 * Our own kernels (see above) rather than cuDNN's: cuDNN returns the
 * unbiased variance in its running variance (the contract wants the biased
 * one, and m = 1 would divide by zero), sums in float, and wants
 * descriptors per shape; these sum in double in a fixed order, need no
 * workspace or descriptor, and stay float32 at every set_precision. */

static void cuda_batchnorm_forward_train(void *ctx, int n, int c, int hw, float eps, const float *x,
                                         const float *gamma, const float *beta, float *y,
                                         float *mean, float *var, float *invstd) {
  cuda_backend *be = enter(ctx);
  if (c <= 0) return;
  /* An empty batch still has statistics (0, 0, 1/sqrt(eps)), as the CPU's. */
  bn_train_kernel<<<(unsigned)c, BN_THREADS, 0, be->stream>>>(
      n > 0 ? n : 0, c, (size_t)(hw > 0 ? hw : 0), eps, x, gamma, beta, y, mean, var, invstd);
  CUDA_CHECK_LAUNCH();
}

static void cuda_batchnorm_forward_infer(void *ctx, int n, int c, int hw, float eps, const float *x,
                                         const float *gamma, const float *beta, const float *mean,
                                         const float *var, float *y) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || c <= 0 || hw <= 0) return;
  /* Enough blocks in all to fill the device (about MAX_BLOCKS), at most
   * one per THREADS values of a channel; gridDim.y is at most 65535. */
  const size_t per_channel = (size_t)n * hw;
  size_t parts = (per_channel + THREADS - 1) / THREADS;
  const size_t fill = (size_t)MAX_BLOCKS / (size_t)c;
  if (parts > fill) parts = fill;
  if (parts > 65535) parts = 65535;
  if (parts < 1) parts = 1;
  const dim3 grid((unsigned)c, (unsigned)parts);
  bn_infer_kernel<<<grid, THREADS, 0, be->stream>>>(n, c, (size_t)hw, eps, x, gamma, beta, mean,
                                                    var, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_batchnorm_backward(void *ctx, int n, int c, int hw, const float *x,
                                    const float *dy, const float *gamma, const float *mean,
                                    const float *invstd, float *dx, float *dgamma, float *dbeta) {
  cuda_backend *be = enter(ctx);
  if (c <= 0) return;
  /* An empty batch: dgamma = dbeta = 0, written by the kernel. */
  bn_backward_kernel<<<(unsigned)c, BN_THREADS, 0, be->stream>>>(
      n > 0 ? n : 0, c, (size_t)(hw > 0 ? hw : 0), x, dy, gamma, mean, invstd, dx, dgamma, dbeta);
  CUDA_CHECK_LAUNCH();
}

/* ---- dense ----
 *
 * cuBLAS is column-major, and a row-major (r, c) matrix is its transpose
 * (c, r) in column-major with the same leading dimension c. So each
 * row-major product C = A B is computed as C^T = B^T A^T. */

/* C (float32, column-major m x n) = A B + beta C, A and B bfloat16, the
 * products summed in float32. */
static void gemm_bf16(cuda_backend *be, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                      int k, const __nv_bfloat16 *a, int lda, const __nv_bfloat16 *b, int ldb,
                      float beta, float *c, int ldc) {
  const float one = 1.0f;
  CUBLAS_CHECK(cublasGemmEx(be->cublas, ta, tb, m, n, k, &one, a, CUDA_R_16BF, lda, b, CUDA_R_16BF,
                            ldb, &beta, c, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static void cuda_dense_forward(void *ctx, int n, int in, int out, const float *x, const float *w,
                               const float *b, float *y) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || out <= 0) return;
  const size_t total = (size_t)n * out;
  broadcast_rows_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(total, out, b, y);
  CUDA_CHECK_LAUNCH();
  if (in <= 0) return;
  /* y^T (out, n) += W (out, in) x^T (in, n); W is W^T (in, out) to cuBLAS. */
  const float one = 1.0f;
  if (be->precision == PS_PRECISION_BF16) {
    const size_t counts[] = {(size_t)out * in, (size_t)n * in, 0};
    __nv_bfloat16 *h[2];
    half_pieces(be, counts, h);
    to_bf16(be, w, h[0], counts[0]);
    to_bf16(be, x, h[1], counts[1]);
    gemm_bf16(be, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, h[0], in, h[1], in, 1.0f, y, out);
    return;
  }
  CUBLAS_CHECK(cublasSgemm(be->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, in, x, in,
                           &one, y, out));
}

static void cuda_dense_backward(void *ctx, int n, int in, int out, const float *x, const float *w,
                                const float *dy, float *dx, float *dw, float *db) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || in <= 0 || out <= 0) { /* as the CPU: all zeros */
    zero_async(be, db, (size_t)(out > 0 ? out : 0) * sizeof(float));
    if (in > 0 && out > 0) zero_async(be, dw, (size_t)out * in * sizeof(float));
    if (dx && n > 0 && in > 0) zero_async(be, dx, (size_t)n * in * sizeof(float));
    return;
  }
  sum_rows_kernel<<<blocks_for((size_t)out), THREADS, 0, be->stream>>>(n, out, dy, db);
  CUDA_CHECK_LAUNCH();
  const float one = 1.0f, zero = 0.0f;
  if (be->precision == PS_PRECISION_BF16) {
    const size_t counts[] = {(size_t)n * in, (size_t)n * out, (size_t)out * in, 0};
    __nv_bfloat16 *h[3]; /* x, dy, w */
    half_pieces(be, counts, h);
    to_bf16(be, x, h[0], counts[0]);
    to_bf16(be, dy, h[1], counts[1]);
    gemm_bf16(be, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, h[0], in, h[1], out, 0.0f, dw, in);
    if (dx) {
      to_bf16(be, w, h[2], counts[2]);
      gemm_bf16(be, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, h[2], in, h[1], out, 0.0f, dx, in);
    }
    return;
  }
  /* dW (out, in) = dy^T x, as dW^T (in, out) = x^T (in, n) dy (n, out). */
  CUBLAS_CHECK(cublasSgemm(be->cublas, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, &one, x, in, dy, out,
                           &zero, dw, in));
  /* dx (n, in) = dy W, as dx^T (in, n) = W^T (in, out) dy^T (out, n). */
  if (dx)
    CUBLAS_CHECK(cublasSgemm(be->cublas, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, &one, w, in, dy, out,
                             &zero, dx, in));
}

/* ---- elementwise ---- */

static void cuda_relu_forward(void *ctx, size_t n, const float *x, float *y) {
  cuda_backend *be = enter(ctx);
  if (n == 0) return;
  relu_forward_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, x, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_relu_backward(void *ctx, size_t n, const float *y, const float *dy, float *dx) {
  cuda_backend *be = enter(ctx);
  if (n == 0) return;
  relu_backward_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, y, dy, dx);
  CUDA_CHECK_LAUNCH();
}

static void cuda_add(void *ctx, size_t n, const float *a, const float *b, float *y) {
  cuda_backend *be = enter(ctx);
  if (n == 0) return;
  add_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, a, b, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_dropout_forward(void *ctx, size_t n, float rate, uint64_t seed, uint64_t stream,
                                 const float *x, float *y, float *mask) {
  cuda_backend *be = enter(ctx);
  if (n == 0) return;
  /* The CPU's scale, computed the same way on the host. */
  const float scale = rate >= 1.0f ? 0.0f : rate <= 0.0f ? 1.0f : 1.0f / (1.0f - rate);
  dropout_forward_base_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(
      n, rate, scale, seed, stream, be->rng_base_dev, x, y, mask);
  CUDA_CHECK_LAUNCH();
}

/* The base, written by a kernel on the stream (its value an argument, so no
 * host buffer is read after the call returns), in order with the ops. */
static void cuda_set_rng_step(void *ctx, uint64_t base) {
  cuda_backend *be = enter(ctx);
  if (be->capturing) PS_CUDA_FATAL("set_rng_step while a graph is being recorded");
  set_u64_kernel<<<1, 1, 0, be->stream>>>(be->rng_base_dev, base);
  CUDA_CHECK_LAUNCH();
}

static void cuda_dropout_backward(void *ctx, size_t n, const float *mask, const float *dy,
                                  float *dx) {
  cuda_backend *be = enter(ctx);
  if (n == 0) return;
  dropout_backward_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, mask, dy, dx);
  CUDA_CHECK_LAUNCH();
}

/* ---- softmax + cross-entropy ---- */

/* Waits for the loss (the caller needs the value). */
static float cuda_softmax_xent_forward(void *ctx, int n, int k, const float *logits,
                                       const uint8_t *labels, float *probs) {
  cuda_backend *be = enter(ctx);
  if (n <= 0) return 0.0f;
  if (k <= 0) return NAN; /* no label can be in [0, k) */
  CUDNN_CHECK(
      cudnnSetTensor4dDescriptor(be->probs_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k, 1, 1));
  const float one = 1.0f, zero = 0.0f;
  CUDNN_CHECK(cudnnSoftmaxForward(be->cudnn, CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                  &one, be->probs_desc, logits, &zero, be->probs_desc, probs));
  xent_loss_kernel<<<1, THREADS, 0, be->stream>>>(n, k, logits, labels, be->loss_dev);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemcpyAsync(be->loss_host, be->loss_dev, sizeof(double), cudaMemcpyDeviceToHost,
                             be->stream));
  CUDA_CHECK(cudaStreamSynchronize(be->stream));
  return (float)(*be->loss_host / n);
}

/* Queued on the stream; nothing waits. */
static void cuda_softmax_xent_stats(void *ctx, int n, int k, const float *logits,
                                    const uint8_t *labels, float *probs, double *stats) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || k <= 0) {
    const double none[2] = {n <= 0 ? 0.0 : NAN, 0.0};
    CUDA_CHECK(cudaMemcpyAsync(stats, none, sizeof none, cudaMemcpyHostToDevice, be->stream));
    CUDA_CHECK(cudaStreamSynchronize(be->stream)); /* none is on this stack */
    return;
  }
  CUDNN_CHECK(
      cudnnSetTensor4dDescriptor(be->probs_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k, 1, 1));
  const float one = 1.0f, zero = 0.0f;
  CUDNN_CHECK(cudnnSoftmaxForward(be->cudnn, CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                  &one, be->probs_desc, logits, &zero, be->probs_desc, probs));
  xent_stats_kernel<<<1, THREADS, 0, be->stream>>>(n, k, logits, probs, labels, stats);
  CUDA_CHECK_LAUNCH();
}

static void cuda_softmax_xent_backward(void *ctx, int n, int k, const float *probs,
                                       const uint8_t *labels, float *dlogits) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || k <= 0) return;
  const float inv_n = 1.0f / (float)n;
  const size_t total = (size_t)n * k;
  xent_backward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(total, k, inv_n, probs,
                                                                      labels, dlogits);
  CUDA_CHECK_LAUNCH();
}

/* ---- embeddings and the logistic loss ----
 *
 * embedding_bag_forward and _backward: one thread per (example, column)
 * and per (unique row, column), consecutive threads on consecutive
 * columns. Each thread sums its column over the bag's positions (or the
 * row's reverse entries) in the order ops.h fixes, with _rn intrinsics (no
 * fused multiply-add), so the result is the CPU's bit for bit and there
 * are no atomics. Why not a warp per row: the embeddings of CTR models
 * are 8 to 64 wide, and a warp per row would leave 24 of 32 lanes idle at
 * dim 8; with a thread per column every lane works whatever dim, a warp
 * covers 32/dim rows at once when dim < 32, and the lanes of one row still
 * read it as one coalesced access (rows and dy are row-major). The cost is
 * a hot row (an id in many examples) being one thread's serial loop per
 * column, but the contract's order makes the sum serial anyway (a split
 * sum would round differently); four entries' loads are issued before
 * their four adds, so that the loop waits for a load latency per four
 * entries rather than per entry.
 *
 * copy_cols is a 2D device-to-device copy on the stream. The loss: one
 * block, examples strided over the threads, in double like the CPU, then a
 * fixed tree (as xent_stats_kernel): the same sum every run, within ~1e-15
 * relative of the CPU's in-order sum. */

/* Mean pooling's scale of a bag of m > 0 positions, as the CPU's 1.0f /
 * (float)m. */
__device__ static inline float emb_bag_scale(int32_t m) { return __fdiv_rn(1.0f, (float)m); }

static __global__ void emb_bag_forward_kernel(size_t total, int dim,
                                              const int32_t *__restrict__ offsets,
                                              const int32_t *__restrict__ idx, int mean,
                                              const float *__restrict__ rows,
                                              float *__restrict__ y) {
  const size_t d = (size_t)dim;
  GRID_STRIDE(i, total) {
    const size_t e = i / d, c = i % d;
    const int32_t j0 = offsets[e], j1 = offsets[e + 1];
    float sum = 0.0f;
    int32_t j = j0;
    for (; j1 - j >= 4; j += 4) {
      const float v0 = rows[(size_t)idx[j] * d + c], v1 = rows[(size_t)idx[j + 1] * d + c];
      const float v2 = rows[(size_t)idx[j + 2] * d + c], v3 = rows[(size_t)idx[j + 3] * d + c];
      sum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(sum, v0), v1), v2), v3);
    }
    for (; j < j1; j++) sum = __fadd_rn(sum, rows[(size_t)idx[j] * d + c]);
    if (mean && j1 > j0) sum = __fmul_rn(sum, emb_bag_scale(j1 - j0));
    y[i] = sum;
  }
}

/* dy[e][c], times the scale of e's bag under mean pooling (e holds a
 * position, so its bag is not empty). */
__device__ static inline float emb_grad_term(const float *__restrict__ dy,
                                             const int32_t *__restrict__ offsets, int mean,
                                             size_t d, size_t c, int32_t e) {
  const float g = dy[(size_t)e * d + c];
  return mean ? __fmul_rn(g, emb_bag_scale(offsets[e + 1] - offsets[e])) : g;
}

static __global__ void emb_bag_backward_kernel(size_t total, int dim,
                                               const int32_t *__restrict__ offsets,
                                               const int32_t *__restrict__ rev_off,
                                               const int32_t *__restrict__ rev_ex, int mean,
                                               const float *__restrict__ dy,
                                               float *__restrict__ drows) {
  const size_t d = (size_t)dim;
  GRID_STRIDE(i, total) {
    const size_t r = i / d, c = i % d;
    const int32_t k0 = rev_off[r], k1 = rev_off[r + 1];
    float sum = 0.0f;
    int32_t k = k0;
    for (; k1 - k >= 4; k += 4) {
      const int32_t e0 = rev_ex[k], e1 = rev_ex[k + 1], e2 = rev_ex[k + 2], e3 = rev_ex[k + 3];
      const float t0 = emb_grad_term(dy, offsets, mean, d, c, e0);
      const float t1 = emb_grad_term(dy, offsets, mean, d, c, e1);
      const float t2 = emb_grad_term(dy, offsets, mean, d, c, e2);
      const float t3 = emb_grad_term(dy, offsets, mean, d, c, e3);
      sum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(sum, t0), t1), t2), t3);
    }
    for (; k < k1; k++) sum = __fadd_rn(sum, emb_grad_term(dy, offsets, mean, d, c, rev_ex[k]));
    drows[i] = sum;
  }
}

/* stats[0] = the sum of the losses, stats[1] = the examples whose
 * prediction (probs >= 0.5f) is their label's (>= 0.5f); probs written on
 * the way. The CPU's double arithmetic, each operation rounded on its own. */
static __global__ void sigmoid_xent_kernel(int n, const float *logits, const float *labels,
                                           float *probs, double *stats) {
  __shared__ double part[THREADS];
  __shared__ int hits[THREADS];
  double acc = 0.0;
  int right = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const double x = logits[i], y = labels[i];
    const double z = exp(-fabs(x));
    const float p =
        (float)(x >= 0.0 ? __ddiv_rn(1.0, __dadd_rn(1.0, z)) : __ddiv_rn(z, __dadd_rn(1.0, z)));
    probs[i] = p;
    acc = __dadd_rn(acc, __dadd_rn(__dsub_rn(fmax(x, 0.0), __dmul_rn(x, y)), log1p(z)));
    right += (p >= 0.5f) == (labels[i] >= 0.5f);
  }
  stats_reduce(part, hits, acc, right, stats);
}

/* (p - y) * inv_n: the CPU's two roundings, unfused. */
static __global__ void sigmoid_xent_backward_kernel(int n, float inv_n, const float *probs,
                                                    const float *labels, float *dlogits) {
  GRID_STRIDE(i, n) dlogits[i] = __fmul_rn(__fsub_rn(probs[i], labels[i]), inv_n);
}

/* One thread per (example, k): the CPU's sums, in its order and
 * roundings. */
static __global__ void fm_forward_kernel(size_t total, int f, int d, const float *x, float *y) {
  GRID_STRIDE(t, total) {
    const size_t e = t / (size_t)d, k = t % (size_t)d;
    const float *xe = x + e * (size_t)f * d;
    float s = 0.0f, q = 0.0f;
    for (int j = 0; j < f; j++) {
      const float v = xe[(size_t)j * d + k];
      s = __fadd_rn(s, v);
      q = __fadd_rn(q, __fmul_rn(v, v));
    }
    y[t] = __fmul_rn(0.5f, __fsub_rn(__fmul_rn(s, s), q));
  }
}

static __global__ void fm_backward_kernel(size_t total, int f, int d, const float *x,
                                          const float *dy, float *dx) {
  GRID_STRIDE(t, total) {
    const size_t e = t / (size_t)d, k = t % (size_t)d;
    const float *xe = x + e * (size_t)f * d;
    float s = 0.0f;
    for (int j = 0; j < f; j++) s = __fadd_rn(s, xe[(size_t)j * d + k]);
    const float g = dy[t];
    float *dxe = dx + e * (size_t)f * d;
    for (int j = 0; j < f; j++)
      dxe[(size_t)j * d + k] = __fmul_rn(g, __fsub_rn(s, xe[(size_t)j * d + k]));
  }
}

static void cuda_fm_forward(void *ctx, int n, int f, int d, const float *x, float *y) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || d <= 0) return;
  const size_t total = (size_t)n * d;
  fm_forward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(total, f, d, x, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_fm_backward(void *ctx, int n, int f, int d, const float *x, const float *dy,
                             float *dx) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || d <= 0 || f <= 0) return;
  const size_t total = (size_t)n * d;
  fm_backward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(total, f, d, x, dy, dx);
  CUDA_CHECK_LAUNCH();
}

static void cuda_embedding_bag_forward(void *ctx, int n, int dim, const int32_t *offsets,
                                       const int32_t *idx, int mean, const float *rows, float *y) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || dim <= 0) return;
  const size_t total = (size_t)n * dim;
  emb_bag_forward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(total, dim, offsets, idx,
                                                                        mean, rows, y);
  CUDA_CHECK_LAUNCH();
}

static void cuda_embedding_bag_backward(void *ctx, int n, int dim, const int32_t *offsets, int u,
                                        const int32_t *rev_off, const int32_t *rev_ex, int mean,
                                        const float *dy, float *drows) {
  cuda_backend *be = enter(ctx);
  (void)n; /* the examples' count is only the extent of dy and offsets */
  if (u <= 0 || dim <= 0) return;
  const size_t total = (size_t)u * dim;
  emb_bag_backward_kernel<<<blocks_for(total), THREADS, 0, be->stream>>>(
      total, dim, offsets, rev_off, rev_ex, mean, dy, drows);
  CUDA_CHECK_LAUNCH();
}

static void cuda_copy_cols(void *ctx, int n, int width, const float *src, int src_stride,
                           float *dst, int dst_stride) {
  cuda_backend *be = enter(ctx);
  if (n <= 0 || width <= 0) return;
  CUDA_CHECK(cudaMemcpy2DAsync(dst, (size_t)dst_stride * sizeof(float), src,
                               (size_t)src_stride * sizeof(float), (size_t)width * sizeof(float),
                               (size_t)n, cudaMemcpyDeviceToDevice, be->stream));
}

/* Queued on the stream; nothing waits. n = 0 writes {0, 0} too. */
static void cuda_sigmoid_xent_forward(void *ctx, int n, const float *logits, const float *labels,
                                      float *probs, double *stats) {
  cuda_backend *be = enter(ctx);
  sigmoid_xent_kernel<<<1, THREADS, 0, be->stream>>>(n > 0 ? n : 0, logits, labels, probs, stats);
  CUDA_CHECK_LAUNCH();
}

static void cuda_sigmoid_xent_backward(void *ctx, int n, const float *probs, const float *labels,
                                       float *dlogits) {
  cuda_backend *be = enter(ctx);
  if (n <= 0) return;
  const float inv_n = 1.0f / (float)n;
  sigmoid_xent_backward_kernel<<<blocks_for((size_t)n), THREADS, 0, be->stream>>>(n, inv_n, probs,
                                                                                  labels, dlogits);
  CUDA_CHECK_LAUNCH();
}

/* ---- memory (the table's members) ---- */

/* Zeroed device memory on the backend's device; NULL when it is out of
 * memory (not sticky: the device goes on). The zeroing is waited for, so
 * the memory reads as zeros from any stream. */
static void *cuda_mem_alloc(void *ctx, size_t bytes) {
  cuda_backend *be = enter(ctx);
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return NULL;
  }
  CUDA_CHECK(e);
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, be->stream));
  CUDA_CHECK(cudaStreamSynchronize(be->stream));
  return p;
}

/* Waits for the stream, whose queued ops may still use p. */
/* Page-locked and zeroed; any thread (portable: every device sees it). */
static void *cuda_host_alloc(void *ctx, size_t bytes) {
  (void)ctx;
  void *p = NULL;
  if (bytes == 0) bytes = 1;
  cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: the device goes on */
    return NULL;
  }
  memset(p, 0, bytes);
  return p;
}

static void cuda_host_free(void *ctx, void *p) {
  (void)ctx;
  if (p) CUDA_CHECK(cudaFreeHost(p));
}

static void cuda_mem_free(void *ctx, void *p) {
  if (p) free_after_stream(enter(ctx), p);
}

static void cuda_to_device(void *ctx, void *dst, const void *src_host, size_t bytes) {
  cuda_backend *be = enter(ctx);
  if (bytes)
    CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, be->stream));
}

/* On the compute stream, after the copy queue's copies the ops wait for.
 * In a capture, a node of the graph that records the event at each launch. */
static void cuda_mark(void *ctx, int i) {
  cuda_backend *be = enter(ctx);
  if (i < 0 || i >= PS_MARKS) return;
  CUDA_CHECK(cudaEventRecordWithFlags(be->marks[i], be->stream,
                                      be->capturing ? cudaEventRecordExternal : 0));
  /* Recorded while capturing, the event is recorded when the graph runs. */
  if (be->capturing)
    be->capture_marks[i] = true;
  else
    be->marked[i] = true;
}

/* ---- graphs ----
 * Stream capture in this thread's mode: the ops called between graph_begin
 * and graph_end are recorded (not run), then instantiated; graph_launch
 * runs them. A failure to capture or instantiate is reported, not fatal:
 * the caller runs the ops plainly instead. */
static int cuda_graph_begin(void *ctx) {
  cuda_backend *be = enter(ctx);
  if (be->capturing) return PS_ESTATE;
  cudaError_t e = cudaStreamBeginCapture(be->stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return PS_EUNAVAIL;
  }
  be->capturing = true;
  for (int i = 0; i < PS_MARKS; i++) be->capture_marks[i] = false;
  return 0;
}

static int cuda_graph_end(void *ctx) {
  cuda_backend *be = enter(ctx);
  if (!be->capturing) return PS_ESTATE;
  be->capturing = false;
  cudaGraph_t g = NULL;
  cudaError_t e = cudaStreamEndCapture(be->stream, &g);
  if (e != cudaSuccess || !g) {
    (void)cudaGetLastError();
    if (g) (void)cudaGraphDestroy(g);
    return PS_EUNAVAIL;
  }
  if (be->graph) {
    CUDA_CHECK(cudaGraphExecDestroy(be->graph));
    be->graph = NULL;
  }
  e = cudaGraphInstantiate(&be->graph, g, 0);
  CUDA_CHECK(cudaGraphDestroy(g));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    be->graph = NULL;
    return PS_EUNAVAIL;
  }
  for (int i = 0; i < PS_MARKS; i++) be->graph_marks[i] = be->capture_marks[i];
  return 0;
}

static int cuda_graph_launch(void *ctx) {
  cuda_backend *be = enter(ctx);
  if (!be->graph) return PS_ESTATE;
  CUDA_CHECK(cudaGraphLaunch(be->graph, be->stream));
  /* Its marks are recorded again by this launch: a step replayed from the
   * graph reports its phases as a step run op by op does (without this,
   * marks_read gave -1 for them and the phases came out negative). */
  for (int i = 0; i < PS_MARKS; i++) be->marked[i] = be->marked[i] || be->graph_marks[i];
  return 0;
}

static void cuda_marks_read(void *ctx, double *ms, int n) {
  cuda_backend *be = enter(ctx);
  for (int i = 0; i < n; i++) {
    ms[i] = -1.0;
    if (i >= PS_MARKS || !be->marked[i] || !be->marked[PS_MARK_BEGIN]) continue;
    float t = 0.0f;
    CUDA_CHECK(cudaEventSynchronize(be->marks[i]));
    CUDA_CHECK(cudaEventElapsedTime(&t, be->marks[PS_MARK_BEGIN], be->marks[i]));
    ms[i] = t;
  }
  for (int i = 0; i < PS_MARKS; i++) be->marked[i] = false;
}

/* tf32 and bf16 need tensor cores that take them: compute capability 8.0
 * (Ampere) and later. The plans made so far are dropped (their descriptors
 * and algorithms are the old precision's) and made again on next use. */
static void seterr(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int cuda_set_precision(void *ctx, ps_precision p, char *err) {
  cuda_backend *be = enter(ctx);
  if (p != PS_PRECISION_FP32 && p != PS_PRECISION_TF32 && p != PS_PRECISION_BF16) {
    seterr(err, "precision %d is not one of fp32, tf32, bf16", (int)p);
    return PS_EINVAL;
  }
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be->device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, be->device));
  if (p != PS_PRECISION_FP32 && major < 8) {
    seterr(err,
           "%s needs tensor cores of compute capability 8.0 or later (Ampere); cuda:%d is %d.%d: "
           "use fp32",
           p == PS_PRECISION_TF32 ? "tf32" : "bf16", be->device, major, minor);
    return PS_EUNAVAIL;
  }
  CUDA_CHECK(cudaStreamSynchronize(be->stream));
  for (int i = 0; i < be->n_plans; i++) conv_plan_destroy(&be->plans[i]);
  be->n_plans = 0;
  if (be->graph) { /* recorded at the old precision */
    CUDA_CHECK(cudaGraphExecDestroy(be->graph));
    be->graph = NULL;
  }
  CUBLAS_CHECK(cublasSetMathMode(
      be->cublas, p == PS_PRECISION_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  be->precision = p;
  return 0;
}

static void cuda_to_host(void *ctx, void *dst_host, const void *src, size_t bytes) {
  cuda_backend *be = enter(ctx);
  if (bytes)
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, be->stream));
}

static void cuda_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  cuda_backend *be = enter(ctx);
  if (bytes && dst != src)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, be->stream));
}

static void cuda_sync(void *ctx) { sync_streams(enter(ctx)); }

static void cuda_to_device_async(void *ctx, void *dst, const void *src_host, size_t bytes) {
  cuda_backend *be = enter(ctx);
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, be->copy_stream));
  CUDA_CHECK(cudaEventRecord(be->h2d_done, be->copy_stream));
  /* The ops queued from now on wait for this copy, and for nothing else
   * on the copy stream queued after it. */
  CUDA_CHECK(cudaStreamWaitEvent(be->stream, be->h2d_done, 0));
}

static uint64_t cuda_to_host_async(void *ctx, void *dst_host, const void *src, size_t bytes) {
  cuda_backend *be = enter(ctx);
  if (!bytes) return 0;
  CUDA_CHECK(cudaEventRecord(be->compute_mark, be->stream));
  CUDA_CHECK(cudaStreamWaitEvent(be->copy_stream, be->compute_mark, 0));
  CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, be->copy_stream));
  uint64_t t = ++be->last_ticket;
  CUDA_CHECK(cudaEventRecord(be->tickets[t % N_TICKETS], be->copy_stream));
  return t;
}

static int cuda_ticket_done(void *ctx, uint64_t ticket) {
  cuda_backend *be = enter(ctx);
  if (ticket == 0) return 1;
  cudaError_t e = cudaEventQuery(be->tickets[ticket % N_TICKETS]);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError(); /* not an error: clear it */
    return 0;
  }
  CUDA_CHECK(e);
  return 1;
}

static void cuda_ticket_wait(void *ctx, uint64_t ticket) {
  cuda_backend *be = enter(ctx);
  if (ticket) CUDA_CHECK(cudaEventSynchronize(be->tickets[ticket % N_TICKETS]));
}

static __global__ void scale_kernel(size_t n, float alpha, float *x) {
  GRID_STRIDE(i, n) x[i] *= alpha;
}

static void cuda_scale(void *ctx, size_t n, float alpha, float *x) {
  cuda_backend *be = enter(ctx);
  if (!n) return;
  scale_kernel<<<blocks_for(n), THREADS, 0, be->stream>>>(n, alpha, x);
  CUDA_CHECK_LAUNCH();
}

/* ---- creation and destruction ---- */

/* Frees whatever of be was made. On destroy (strict) a failed call aborts
 * like any other; after a failed create the errors are ignored, the create
 * has already said what went wrong first. Waits for the stream before
 * freeing: queued work may still use the buffers. */
#define RELEASE(check, call) \
  do {                       \
    if (strict)              \
      check(call);           \
    else                     \
      (void)(call);          \
  } while (0)
static void cuda_free_backend(cuda_backend *be, bool strict) {
  if (be->stream) RELEASE(CUDA_CHECK, cudaStreamSynchronize(be->stream));
  if (be->copy_stream) RELEASE(CUDA_CHECK, cudaStreamSynchronize(be->copy_stream));
  for (int i = 0; i < N_TICKETS; i++)
    if (be->tickets[i]) RELEASE(CUDA_CHECK, cudaEventDestroy(be->tickets[i]));
  if (be->h2d_done) RELEASE(CUDA_CHECK, cudaEventDestroy(be->h2d_done));
  if (be->compute_mark) RELEASE(CUDA_CHECK, cudaEventDestroy(be->compute_mark));
  for (int i = 0; i < PS_MARKS; i++)
    if (be->marks[i]) RELEASE(CUDA_CHECK, cudaEventDestroy(be->marks[i]));
  if (be->copy_stream) RELEASE(CUDA_CHECK, cudaStreamDestroy(be->copy_stream));
  for (int i = 0; i < be->n_plans; i++) conv_plan_destroy(&be->plans[i]);
  free(be->plans);
  if (be->half) RELEASE(CUDA_CHECK, cudaFree(be->half));
  if (be->graph) RELEASE(CUDA_CHECK, cudaGraphExecDestroy(be->graph));
  if (be->work) RELEASE(CUDA_CHECK, cudaFree(be->work));
  if (be->stage) RELEASE(CUDA_CHECK, cudaFree(be->stage));
  if (be->loss_dev) RELEASE(CUDA_CHECK, cudaFree(be->loss_dev));
  if (be->rng_base_dev) RELEASE(CUDA_CHECK, cudaFree(be->rng_base_dev));
  if (be->loss_host) RELEASE(CUDA_CHECK, cudaFreeHost(be->loss_host));
  if (be->probs_desc) RELEASE(CUDNN_CHECK, cudnnDestroyTensorDescriptor(be->probs_desc));
  if (be->cublas) RELEASE(CUBLAS_CHECK, cublasDestroy(be->cublas));
  if (be->blas_work) RELEASE(CUDA_CHECK, cudaFree(be->blas_work));
  if (be->cudnn) RELEASE(CUDNN_CHECK, cudnnDestroy(be->cudnn));
  if (be->stream) RELEASE(CUDA_CHECK, cudaStreamDestroy(be->stream));
  free(be);
}
#undef RELEASE

static void cuda_destroy(ps_ops *ops) {
  if (!ops) return;
  cuda_free_backend(enter(ops->ctx), true);
}

static void seterr(char *err, const char *fmt, ...) {
  if (!err) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, PS_ERRLEN, fmt, ap);
  va_end(ap);
}

/* Whether a call made while creating the backend failed; if so err says
 * which and why. Creation reports instead of aborting: a worker can fall
 * back to the CPU backend. */
static bool failed(cudaError_t e, const char *call, int device, char *err) {
  if (e == cudaSuccess) return false;
  (void)cudaGetLastError(); /* clear a non-sticky error */
  seterr(err, "CUDA device %d: %s: %s", device, call, cudaGetErrorString(e));
  return true;
}
static bool failed(cudnnStatus_t s, const char *call, int device, char *err) {
  if (s == CUDNN_STATUS_SUCCESS) return false;
  seterr(err, "CUDA device %d: %s: %s", device, call, cudnnGetErrorString(s));
  return true;
}
static bool failed(cublasStatus_t s, const char *call, int device, char *err) {
  if (s == CUBLAS_STATUS_SUCCESS) return false;
  seterr(err, "CUDA device %d: %s: %s", device, call, cublasGetStatusString(s));
  return true;
}

#ifndef PS_CUDA_ARCHS
#define PS_CUDA_ARCHS "?"
#endif

/* Writes a mark: a kernel of this build runs on the device. */
static __global__ void probe_kernel(int *out) { *out = 0x5053; }

/* Runs probe_kernel on be's stream and reads its mark back: a card whose
 * architecture the fatbinary carries no code for (nor PTX its driver can
 * compile) fails here, when the backend is created, rather than at the
 * first step. */
static bool probe_failed(cuda_backend *be, int device, char *err) {
  int *mark = NULL, got = 0;
  cudaError_t e = cudaMalloc((void **)&mark, sizeof(int));
  if (e == cudaSuccess) {
    probe_kernel<<<1, 1, 0, be->stream>>>(mark);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(&got, mark, sizeof(int), cudaMemcpyDeviceToHost, be->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(be->stream);
  if (mark) (void)cudaFree(mark);
  if (e == cudaSuccess && got == 0x5053) return false;
  (void)cudaGetLastError();
  cudaDeviceProp prop;
  int major = 0, minor = 0;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    major = prop.major;
    minor = prop.minor;
  }
  seterr(err,
         "CUDA device %d (compute capability %d.%d) cannot run this build's kernels: %s; the "
         "build carries code for CUDA architectures %s (rebuild with "
         "-DCMAKE_CUDA_ARCHITECTURES=%d%d)",
         device, major, minor, e != cudaSuccess ? cudaGetErrorString(e) : "wrong result",
         PS_CUDA_ARCHS, major, minor);
  return true;
}

extern "C" ps_ops *ps_ops_cuda_create(int device, char *err) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    seterr(err, "no usable CUDA device: %s", cudaGetErrorString(e));
    return NULL;
  }
  if (device < 0 || device >= count) {
    seterr(err, "CUDA device %d does not exist (%d visible; see CUDA_VISIBLE_DEVICES)", device,
           count);
    return NULL;
  }
  cuda_backend *be = (cuda_backend *)calloc(1, sizeof *be);
  if (!be) {
    seterr(err, "out of memory creating the CUDA backend");
    return NULL;
  }
  be->device = device;
#define TRY(call)                             \
  do {                                        \
    if (failed((call), #call, device, err)) { \
      cuda_free_backend(be, false);           \
      return NULL;                            \
    }                                         \
  } while (0)
  TRY(cudaSetDevice(device));
  TRY(cudaStreamCreateWithFlags(&be->stream, cudaStreamNonBlocking));
  TRY(cudaStreamCreateWithFlags(&be->copy_stream, cudaStreamNonBlocking));
  if (probe_failed(be, device, err)) {
    cuda_free_backend(be, false);
    return NULL;
  }
  TRY(cudaEventCreateWithFlags(&be->h2d_done, cudaEventDisableTiming));
  TRY(cudaEventCreateWithFlags(&be->compute_mark, cudaEventDisableTiming));
  for (int i = 0; i < PS_MARKS; i++) TRY(cudaEventCreate(&be->marks[i]));
  for (int i = 0; i < N_TICKETS; i++)
    TRY(cudaEventCreateWithFlags(&be->tickets[i], cudaEventDisableTiming));
  TRY(cudnnCreate(&be->cudnn));
  TRY(cudnnSetStream(be->cudnn, be->stream));
  TRY(cublasCreate(&be->cublas));
  TRY(cublasSetStream(be->cublas, be->stream));
  /* Plain float32 FMA: no TF32 tensor cores, whose 10-bit products would
   * put the dense layers ~1e-3 away from the CPU. */
  TRY(cublasSetMathMode(be->cublas, CUBLAS_DEFAULT_MATH));
  /* A workspace of its own, so that cuBLAS allocates nothing while a step
   * is captured into a graph. */
  TRY(cudaMalloc(&be->blas_work, BLAS_WORKSPACE));
  TRY(cublasSetWorkspace(be->cublas, be->blas_work, BLAS_WORKSPACE));
  TRY(cudnnCreateTensorDescriptor(&be->probs_desc));
  TRY(cudaMalloc((void **)&be->loss_dev, sizeof(double)));
  TRY(cudaMalloc((void **)&be->rng_base_dev, sizeof(uint64_t)));
  TRY(cudaMemset(be->rng_base_dev, 0, sizeof(uint64_t)));
  TRY(cudaMallocHost((void **)&be->loss_host, sizeof(double)));
#undef TRY
  be->ops.name = "cuda";
  be->ops.ctx = be;
  be->ops.conv2d_workspace = cuda_conv2d_workspace;
  be->ops.conv2d_forward = cuda_conv2d_forward;
  be->ops.conv2d_backward = cuda_conv2d_backward;
  be->ops.maxpool_forward = cuda_maxpool_forward;
  be->ops.maxpool_backward = cuda_maxpool_backward;
  be->ops.avgpool_forward = cuda_avgpool_forward;
  be->ops.avgpool_backward = cuda_avgpool_backward;
  be->ops.global_avgpool_forward = cuda_global_avgpool_forward;
  be->ops.global_avgpool_backward = cuda_global_avgpool_backward;
  be->ops.batchnorm_forward_train = cuda_batchnorm_forward_train;
  be->ops.batchnorm_forward_infer = cuda_batchnorm_forward_infer;
  be->ops.batchnorm_backward = cuda_batchnorm_backward;
  be->ops.dense_forward = cuda_dense_forward;
  be->ops.dense_backward = cuda_dense_backward;
  be->ops.relu_forward = cuda_relu_forward;
  be->ops.relu_backward = cuda_relu_backward;
  be->ops.add = cuda_add;
  be->ops.dropout_forward = cuda_dropout_forward;
  be->ops.set_rng_step = cuda_set_rng_step;
  be->ops.dropout_backward = cuda_dropout_backward;
  be->ops.softmax_xent_forward = cuda_softmax_xent_forward;
  be->ops.softmax_xent_backward = cuda_softmax_xent_backward;
  be->ops.softmax_xent_stats = cuda_softmax_xent_stats;
  be->ops.destroy = cuda_destroy;
  be->ops.alloc = cuda_mem_alloc;
  be->ops.free = cuda_mem_free;
  be->ops.host_alloc = cuda_host_alloc;
  be->ops.host_free = cuda_host_free;
  be->ops.mark = cuda_mark;
  be->ops.set_precision = cuda_set_precision;
  be->ops.graph_begin = cuda_graph_begin;
  be->ops.graph_end = cuda_graph_end;
  be->ops.graph_launch = cuda_graph_launch;
  be->ops.marks_read = cuda_marks_read;
  be->ops.to_device = cuda_to_device;
  be->ops.to_host = cuda_to_host;
  be->ops.copy = cuda_copy;
  be->ops.sync = cuda_sync;
  be->ops.host_memory = 0;
  be->ops.to_device_async = cuda_to_device_async;
  be->ops.to_host_async = cuda_to_host_async;
  be->ops.ticket_done = cuda_ticket_done;
  be->ops.ticket_wait = cuda_ticket_wait;
  be->ops.scale = cuda_scale;
  be->ops.embedding_bag_forward = cuda_embedding_bag_forward;
  be->ops.embedding_bag_backward = cuda_embedding_bag_backward;
  be->ops.copy_cols = cuda_copy_cols;
  be->ops.fm_forward = cuda_fm_forward;
  be->ops.fm_backward = cuda_fm_backward;
  be->ops.sigmoid_xent_forward = cuda_sigmoid_xent_forward;
  be->ops.sigmoid_xent_backward = cuda_sigmoid_xent_backward;
  return &be->ops;
}

/* ---- memory helpers ---- */

/* The backend of ops; aborts on a table of another backend. */
static cuda_backend *backend_of(ps_ops *ops) {
  if (!ops || !ops->name || strcmp(ops->name, "cuda") != 0)
    PS_CUDA_FATAL("ps_cuda_* helper called with a table that is not the cuda backend");
  return enter(ops->ctx);
}

extern "C" void ps_cuda_make_current(ps_ops *ops) { (void)backend_of(ops); }

extern "C" void *ps_cuda_stream(ps_ops *ops) { return (void *)backend_of(ops)->stream; }

extern "C" int ps_cuda_conv_choice(ps_ops *ops, const ps_conv_shape *s, ps_cuda_conv_info *out) {
  cuda_backend *be = backend_of(ops);
  memset(out, 0, sizeof *out);
  for (int i = 0; i < be->n_plans; i++) {
    const conv_plan *p = &be->plans[i];
    if (!same_conv_shape(&p->s, s)) continue;
    out->algo[0] = (int)p->fwd;
    out->algo[1] = (int)p->bwd_data;
    out->algo[2] = (int)p->bwd_filter;
    const cudnnConvolutionDescriptor_t d[3] = {p->conv_fwd, p->conv_bwd_data, p->conv_bwd_filter};
    for (int k = 0; k < 3; k++) {
      cudnnMathType_t m = CUDNN_DEFAULT_MATH;
      CUDNN_CHECK(cudnnGetConvolutionMathType(d[k], &m));
      out->fma[k] = m == CUDNN_FMA_MATH;
      out->tensor_op[k] = m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION ||
                          m == CUDNN_DEFAULT_MATH;
      out->deterministic[k] = p->pass[k] == 0;
    }
    return 0;
  }
  return -1;
}

extern "C" int ps_cuda_device_of(ps_ops *ops) { return backend_of(ops)->device; }

extern "C" int ps_cuda_alloc(void **p, size_t bytes) {
  *p = NULL;
  if (bytes == 0) return 0;
  cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError(); /* not sticky: clear it, the device goes on */
    *p = NULL;
    return PS_ENOMEM;
  }
  CUDA_CHECK(e);
  return 0;
}

extern "C" void ps_cuda_free(void *p) {
  if (p) CUDA_CHECK(cudaFree(p));
}

extern "C" int ps_cuda_host_alloc(void **p, size_t bytes) {
  *p = NULL;
  if (bytes == 0) return 0;
  cudaError_t e = cudaHostAlloc(p, bytes, cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    *p = NULL;
    return PS_ENOMEM;
  }
  CUDA_CHECK(e);
  return 0;
}

extern "C" void ps_cuda_host_free(void *p) {
  if (p) CUDA_CHECK(cudaFreeHost(p));
}

extern "C" void ps_cuda_memcpy_h2d(ps_ops *ops, void *dst_dev, const void *src_host, size_t bytes) {
  cuda_backend *be = backend_of(ops);
  if (bytes)
    CUDA_CHECK(cudaMemcpyAsync(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, be->stream));
}

extern "C" void ps_cuda_memcpy_d2h(ps_ops *ops, void *dst_host, const void *src_dev, size_t bytes) {
  cuda_backend *be = backend_of(ops);
  if (bytes)
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, be->stream));
}

extern "C" void ps_cuda_memcpy_d2d(ps_ops *ops, void *dst_dev, const void *src_dev, size_t bytes) {
  cuda_backend *be = backend_of(ops);
  if (bytes)
    CUDA_CHECK(cudaMemcpyAsync(dst_dev, src_dev, bytes, cudaMemcpyDeviceToDevice, be->stream));
}

extern "C" void ps_cuda_memset_zero(ps_ops *ops, void *dst_dev, size_t bytes) {
  zero_async(backend_of(ops), dst_dev, bytes);
}

extern "C" void ps_cuda_sync(ps_ops *ops) { sync_streams(backend_of(ops)); }

extern "C" int ps_cuda_device_name(int device, char *name, size_t len, size_t *total_bytes) {
  if (name && len) name[0] = '\0';
  if (total_bytes) *total_bytes = 0;
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* an invalid index is not sticky: clear it */
    return PS_EINVAL;
  }
  if (name && len) snprintf(name, len, "%s", prop.name);
  if (total_bytes) *total_bytes = prop.totalGlobalMem;
  return 0;
}

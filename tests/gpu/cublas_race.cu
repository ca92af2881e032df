// cuBLAS alone, as the CUDA backend calls it for a dense layer: one handle
// on one stream with a workspace of its own (32 MiB), math mode
// CUBLAS_DEFAULT_MATH, and the three float32 GEMMs of a dense layer
// (forward y^T += W x^T; dW^T = x^T dy; dx^T = W^T dy^T) for the shapes of
// test_cuda_parity's dense cases, at 256-byte-aligned and at 4-byte-offset
// pointers. Nothing of this project's code runs: a hazard that
// `compute-sanitizer --tool racecheck` reports here is cuBLAS's own, which
// tests/gpu/on_device.sh sets beside the report it gives for
// test_cuda_parity (the kit's evidence for or against the project).
//   cublas_race [REPEATS]      (default 1); exit 0, or 1 with the failing call
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "cublas_race: %s:%d: %s: %s\n", __FILE__, __LINE__, #x,           \
              cudaGetErrorString(e_));                                                   \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)
#define CHECK_BLAS(x)                                                                    \
  do {                                                                                   \
    cublasStatus_t s_ = (x);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      fprintf(stderr, "cublas_race: %s:%d: %s: status %d\n", __FILE__, __LINE__, #x,     \
              (int)s_);                                                                  \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

struct shape {
  int n, in, out;
};
// test_cuda_parity's dense_cases with a batch and features (the others
// make no GEMM).
static const shape shapes[] = {{1, 1, 1},       {3, 5, 7},     {7, 33, 1},
                               {64, 3136, 128}, {64, 128, 10}, {2, 1000, 300}};

static float *device_floats(size_t n, unsigned seed) {
  float *h = (float *)malloc(n * sizeof(float));
  float *d = NULL;
  if (!h) return NULL;
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    h[i] = (float)(seed >> 8) / 16777216.0f - 0.5f;
  }
  if (cudaMalloc((void **)&d, n * sizeof(float)) != cudaSuccess ||
      cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
    d = NULL;
  free(h);
  return d;
}

int main(int argc, char **argv) {
  int repeats = argc > 1 ? atoi(argv[1]) : 1;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("cublas_race: no CUDA device: nothing run\n");
    return 77;
  }
  cudaStream_t stream;
  cublasHandle_t h;
  void *work = NULL;
  const size_t work_bytes = (size_t)32 << 20;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_BLAS(cublasCreate(&h));
  CHECK_BLAS(cublasSetStream(h, stream));
  CHECK_BLAS(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  CHECK_CUDA(cudaMalloc(&work, work_bytes));
  CHECK_BLAS(cublasSetWorkspace(h, work, work_bytes));
  int gemms = 0;
  const float one = 1.0f, zero = 0.0f;
  for (int r = 0; r < repeats; r++)
    for (const shape &s : shapes)
      for (int off = 0; off < 2; off++) {
        const size_t nx = (size_t)s.n * s.in, ny = (size_t)s.n * s.out, nw = (size_t)s.out * s.in;
        float *x = device_floats(nx + 1, 1), *w = device_floats(nw + 1, 2);
        float *dy = device_floats(ny + 1, 3), *y = device_floats(ny + 1, 4);
        float *dw = device_floats(nw + 1, 5), *dx = device_floats(nx + 1, 6);
        if (!x || !w || !dy || !y || !dw || !dx) {
          fprintf(stderr, "cublas_race: out of device memory\n");
          return 1;
        }
        float *wo = w + off, *dwo = dw + off; // the parameters' offset, as the parity test's
        CHECK_BLAS(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, s.out, s.n, s.in, &one, wo, s.in, x,
                               s.in, &one, y, s.out));
        CHECK_BLAS(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, s.in, s.out, s.n, &one, x, s.in, dy,
                               s.out, &zero, dwo, s.in));
        CHECK_BLAS(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, s.in, s.n, s.out, &one, wo, s.in, dy,
                               s.out, &zero, dx, s.in));
        gemms += 3;
        CHECK_CUDA(cudaStreamSynchronize(stream));
        cudaFree(x);
        cudaFree(w);
        cudaFree(dy);
        cudaFree(y);
        cudaFree(dw);
        cudaFree(dx);
      }
  CHECK_BLAS(cublasDestroy(h));
  CHECK_CUDA(cudaFree(work));
  CHECK_CUDA(cudaStreamDestroy(stream));
  printf("cublas_race: %d GEMMs of the dense layers' shapes on one handle and stream\n", gemms);
  return 0;
}

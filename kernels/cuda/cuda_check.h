/* Fail-fast checks for CUDA, cuBLAS and cuDNN calls, for the .cu files of
 * the CUDA backend.
 *
 * A failed call prints the call as written, the file and line, and the
 * library's error string to stderr, then abort()s: a failed kernel or
 * library call leaves device buffers in an unknown state, and training on
 * from there would push garbage to the parameter servers. abort() rather than
 * exit(): the process stops where it failed (a core dump, a debugger), and no
 * atexit handler runs against a broken device.
 *
 * Kernel launches are asynchronous: CUDA_CHECK_LAUNCH() after a launch
 * catches a bad configuration at once, while a fault inside the kernel shows
 * at the next synchronizing call, which then names its own line. Build with
 * -DPS_CUDA_SYNC_LAUNCHES to synchronize after every launch, so that such a
 * fault names the launch that caused it (slow; for debugging).
 *
 * Where a failure is an expected outcome that the caller can handle (out of
 * memory in an allocation, no device at start-up) the code checks by hand and
 * returns an error code instead. */
#ifndef PS_KERNELS_CUDA_CHECK_H
#define PS_KERNELS_CUDA_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stdio.h>
#include <stdlib.h>

#define PS_CUDA_FAIL_(kind, call, msg)                                                   \
  do {                                                                                   \
    fprintf(stderr, "%s:%d: %s error in %s: %s\n", __FILE__, __LINE__, kind, call, msg); \
    abort();                                                                             \
  } while (0)

#define CUDA_CHECK(call)                                                               \
  do {                                                                                 \
    cudaError_t ps_e_ = (call);                                                        \
    if (ps_e_ != cudaSuccess) PS_CUDA_FAIL_("CUDA", #call, cudaGetErrorString(ps_e_)); \
  } while (0)

#define CUBLAS_CHECK(call)                                          \
  do {                                                              \
    cublasStatus_t ps_s_ = (call);                                  \
    if (ps_s_ != CUBLAS_STATUS_SUCCESS)                             \
      PS_CUDA_FAIL_("cuBLAS", #call, cublasGetStatusString(ps_s_)); \
  } while (0)

#define CUDNN_CHECK(call)                                                                         \
  do {                                                                                            \
    cudnnStatus_t ps_s_ = (call);                                                                 \
    if (ps_s_ != CUDNN_STATUS_SUCCESS) PS_CUDA_FAIL_("cuDNN", #call, cudnnGetErrorString(ps_s_)); \
  } while (0)

/* After every kernel launch. */
#ifdef PS_CUDA_SYNC_LAUNCHES
#define CUDA_CHECK_LAUNCH()              \
  do {                                   \
    CUDA_CHECK(cudaGetLastError());      \
    CUDA_CHECK(cudaDeviceSynchronize()); \
  } while (0)
#else
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
#endif

/* A broken promise of the caller (a shape cuDNN disagrees with, host memory
 * gone): the same report and abort() as a failed call. */
#define PS_CUDA_FATAL(what) PS_CUDA_FAIL_("ps", "cuda backend", what)

#endif

#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "cuda_device.h"
}

extern "C" int ps_cuda_device_count(char *why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* clear it: a later launch check must not report it */
    if (why) snprintf(why, 128, "%s", cudaGetErrorString(e));
    return 0;
  }
  if (n == 0 && why) snprintf(why, 128, "no CUDA device");
  return n;
}

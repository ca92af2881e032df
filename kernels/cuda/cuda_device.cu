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
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    /* The versions say what to do: no driver, or one older than the
     * runtime this build carries (it is linked statically). */
    if (why && e == cudaErrorInsufficientDriver && driver == 0)
      snprintf(why, 128, "no NVIDIA driver is loaded (this build needs one for CUDA %d.%d)",
               runtime / 1000, runtime % 1000 / 10);
    else if (why && e == cudaErrorInsufficientDriver)
      snprintf(why, 128, "the NVIDIA driver supports CUDA %d.%d, this build needs %d.%d: update "
               "the driver", driver / 1000, driver % 1000 / 10, runtime / 1000,
               runtime % 1000 / 10);
    else if (why)
      snprintf(why, 128, "%s", cudaGetErrorString(e));
    return 0;
  }
  if (n == 0 && why) snprintf(why, 128, "no CUDA device");
  return n;
}

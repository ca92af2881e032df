/* What the CUDA runtime sees. Built only with WITH_CUDA; callers guard
 * their use with #ifdef PS_WITH_CUDA (see worker/model/device.c). */
#ifndef PS_KERNELS_CUDA_DEVICE_H
#define PS_KERNELS_CUDA_DEVICE_H

/* Number of usable CUDA devices (0 when there is no driver or no device);
 * why writes a short reason when it is 0 (may be NULL, else 128 bytes). */
int ps_cuda_device_count(char *why);

#endif

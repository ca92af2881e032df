/* Choosing the compute backend of a worker from a device name.
 *
 *   NULL, "auto"   CUDA device 0 when this build has the CUDA backend and a
 *                  device is visible, else the cpu backend
 *   "cpu"          the cpu backend with cpu_threads threads: oneDNN's
 *                  (ps_ops_dnnl_create) when the build has it
 *                  (PS_HAVE_DNNL), else the reference (ps_ops_cpu_create)
 *   "cpu-ref"      the reference cpu backend (ps_ops_cpu_create), im2col +
 *                  OpenBLAS, in either build
 *   "cuda"         CUDA device 0 (an error if there is none)
 *   "cuda:N"       CUDA device N, N a decimal index (of the devices that
 *                  CUDA_VISIBLE_DEVICES leaves)
 *   "emu"          the emulated device (kernels/emu/ops_emu.h): the cpu ops
 *                  behind device-like memory, to run and check a GPU
 *                  worker's code paths where there is no GPU
 *
 * Anything else ("gpu", "cuda:x", "cuda:", "CPU") is malformed. Compiles in
 * both builds: without WITH_CUDA, asking for cuda is an error that says so. */
#ifndef PS_WORKER_DEVICE_H
#define PS_WORKER_DEVICE_H

#include <stddef.h>

#include "kernels/ops.h"

/* The backend for spec, freed by the caller with ops->destroy(ops). desc
 * (desc_len bytes, may be NULL) receives a one-line description for the
 * log: "cpu (2 threads, oneDNN 2.6.3)", "cpu-ref (2 threads)", "cuda:0 (NVIDIA H100 80GB HBM3, 79 GiB)"; "auto"
 * falling back to the cpu because device 0 could not be opened says why
 * there too. NULL on failure, with a message in err (NULL or PS_ERRLEN
 * bytes): a malformed spec, a build without CUDA, no CUDA device, an index
 * out of range, a backend that cannot be created; nothing is left open. */
ps_ops *ps_device_open(const char *spec, int cpu_threads, char *desc, size_t desc_len, char *err);

#endif

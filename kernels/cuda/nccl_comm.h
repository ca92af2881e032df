/* NCCL communicators for the replicas of one worker, one per GPU (an
 * all-in-one-process clique from ncclCommInitAll). Built only with
 * WITH_CUDA; without NCCL (WITH_NCCL off, or the library not found)
 * ps_nccl_create says so and the replicas sum through host memory.
 *
 * Each rank's calls are made from that rank's own thread (the replica's),
 * queued on the stream of that rank's backend, so they are ordered with
 * its ops; the collective completes once every rank has queued its part.
 * Failures of NCCL calls after creation abort with the call, file, line and
 * NCCL's message, as the CUDA checks do. */
#ifndef PS_KERNELS_CUDA_NCCL_COMM_H
#define PS_KERNELS_CUDA_NCCL_COMM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../ops.h"

typedef struct ps_nccl ps_nccl;

/* 1 when this build has NCCL. */
int ps_nccl_available(void);

/* Communicators over devices[0..n) (distinct CUDA devices, n >= 1): rank r
 * is devices[r]. NULL with a message in err (PS_ERRLEN bytes) when NCCL is
 * not built in or cannot set them up. */
ps_nccl *ps_nccl_create(int n, const int *devices, char *err);
void ps_nccl_destroy(ps_nccl *g);

/* Rank `rank`'s part of recv (rank 0 only; NULL elsewhere) = sum over the
 * ranks of their send (count floats of device memory), queued on ops'
 * stream (ops: the cuda backend of rank's device). In place at rank 0
 * (send == recv) is fine. */
void ps_nccl_reduce_sum(ps_nccl *g, int rank, ps_ops *ops, const float *send, float *recv,
                        size_t count);

/* Rank `rank`'s part of a broadcast of rank 0's buf (count floats of
 * device memory) into every rank's buf, queued on ops' stream. */
void ps_nccl_broadcast(ps_nccl *g, int rank, ps_ops *ops, float *buf, size_t count);

#ifdef __cplusplus
}
#endif

#endif

/* NCCL for the replicas of one worker (see nccl_comm.h). */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_check.h"
#include "ops_cuda.h"

extern "C" {
#include "../../common/util.h"
#include "nccl_comm.h"
}

#ifdef PS_WITH_NCCL
#include <nccl.h>

#define NCCL_CHECK(call)                                                           \
  do {                                                                             \
    ncclResult_t ps_r_ = (call);                                                   \
    if (ps_r_ != ncclSuccess) PS_CUDA_FAIL_("NCCL", #call, ncclGetErrorString(ps_r_)); \
  } while (0)

struct ps_nccl {
  int n;
  ncclComm_t *comms; /* (n): rank r's */
};

extern "C" int ps_nccl_available(void) { return 1; }

extern "C" ps_nccl *ps_nccl_create(int n, const int *devices, char *err) {
  if (n < 1 || !devices) {
    ps_seterr(err, PS_EINVAL, "NCCL: need at least one device");
    return NULL;
  }
  for (int i = 0; i < n; i++)
    for (int j = 0; j < i; j++)
      if (devices[i] == devices[j]) {
        ps_seterr(err, PS_EINVAL, "NCCL: device %d appears twice (one rank per GPU)", devices[i]);
        return NULL;
      }
  ps_nccl *g = (ps_nccl *)calloc(1, sizeof *g);
  if (g) g->comms = (ncclComm_t *)calloc((size_t)n, sizeof *g->comms);
  if (!g || !g->comms) {
    free(g);
    ps_seterr(err, PS_ENOMEM, "NCCL: out of memory");
    return NULL;
  }
  ncclResult_t r = ncclCommInitAll(g->comms, n, devices);
  if (r != ncclSuccess) {
    ps_seterr(err, PS_EUNAVAIL, "NCCL: ncclCommInitAll over %d devices: %s", n,
              ncclGetErrorString(r));
    free(g->comms);
    free(g);
    return NULL;
  }
  g->n = n;
  return g;
}

extern "C" void ps_nccl_destroy(ps_nccl *g) {
  if (!g) return;
  for (int i = 0; i < g->n; i++) NCCL_CHECK(ncclCommDestroy(g->comms[i]));
  free(g->comms);
  free(g);
}

static ncclComm_t comm_of(ps_nccl *g, int rank) {
  if (!g || rank < 0 || rank >= g->n) PS_CUDA_FATAL("NCCL: no such rank");
  return g->comms[rank];
}

extern "C" void ps_nccl_reduce_sum(ps_nccl *g, int rank, ps_ops *ops, const float *send,
                                   float *recv, size_t count) {
  ncclComm_t c = comm_of(g, rank);
  ps_cuda_make_current(ops);
  NCCL_CHECK(ncclReduce(send, rank == 0 ? recv : NULL, count, ncclFloat, ncclSum, 0, c,
                        (cudaStream_t)ps_cuda_stream(ops)));
}

extern "C" void ps_nccl_broadcast(ps_nccl *g, int rank, ps_ops *ops, float *buf, size_t count) {
  ncclComm_t c = comm_of(g, rank);
  ps_cuda_make_current(ops);
  NCCL_CHECK(ncclBroadcast(buf, buf, count, ncclFloat, 0, c, (cudaStream_t)ps_cuda_stream(ops)));
}

#else /* without NCCL */

struct ps_nccl {
  int unused;
};

extern "C" int ps_nccl_available(void) { return 0; }

extern "C" ps_nccl *ps_nccl_create(int n, const int *devices, char *err) {
  (void)n;
  (void)devices;
  ps_seterr(err, PS_EINVAL, "this ps-worker was built without NCCL");
  return NULL;
}

extern "C" void ps_nccl_destroy(ps_nccl *g) { (void)g; }

extern "C" void ps_nccl_reduce_sum(ps_nccl *g, int rank, ps_ops *ops, const float *send,
                                   float *recv, size_t count) {
  (void)g, (void)rank, (void)ops, (void)send, (void)recv, (void)count;
  PS_CUDA_FATAL("NCCL call in a build without NCCL");
}

extern "C" void ps_nccl_broadcast(ps_nccl *g, int rank, ps_ops *ops, float *buf, size_t count) {
  (void)g, (void)rank, (void)ops, (void)buf, (void)count;
  PS_CUDA_FATAL("NCCL call in a build without NCCL");
}

#endif

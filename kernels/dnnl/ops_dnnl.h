/* The oneDNN CPU backend: the ops of kernels/ops.h with convolutions on
 * oneDNN's primitives, dense layers on OpenBLAS sgemm in parts, and OpenMP
 * loops for the rest, all on one OpenMP thread team. Built when CMake
 * finds oneDNN (PS_HAVE_DNNL). */
#ifndef PS_KERNELS_DNNL_OPS_DNNL_H
#define PS_KERNELS_DNNL_OPS_DNNL_H

#include <stddef.h>

#include "../ops.h"

/* The backend, with the semantics of the reference (ps_ops_cpu_create):
 * the same outputs up to float rounding (convolution and dense sum in
 * another order), bit for bit for relu, dropout, max and average pooling,
 * batch normalization and the softmax. threads > 0: every op runs on an
 * OpenMP team of that many threads (set for the calling thread at each
 * op), and OpenBLAS (dense
 * layers, in parts on the team) is set to one thread for the process;
 * threads == 0: OpenMP's default team, and dense layers in one call with
 * OpenBLAS's own threading. Results depend only on the inputs and the
 * thread count. Its memory is host memory (host_memory = 1).
 *
 * Layouts. An activation written by an op into a buffer this backend's
 * alloc gave (at its start) may be held in oneDNN's blocked layout
 * (nChw16c or nChw8c) when its channels are a multiple of the block: the
 * backend records the layout of each such buffer and the next op reads it
 * as it is (conv, relu, max and average pooling, batch normalization) or
 * turns it back into NCHW first (dense, dropout, softmax, scale of part
 * of it, copies out). to_host,
 * copy and to_host_async always deliver NCHW, so callers that read
 * backend memory through them never see the blocked layout; a caller that
 * reads an op's output buffer directly (host memory) must not rely on its
 * layout. Pointers from elsewhere are always NCHW. maxpool's argmax holds
 * the reference's flat plane indices, in the layout of y.
 *
 * Float32 only (set_precision NULL) and no recorded graphs (graph_* NULL);
 * host_alloc is plain aligned memory and mark the host clock, as on the
 * reference. Failing oneDNN calls inside an op (out of memory) abort with
 * the call, file and line: an op has no way to report an error.
 *
 * NULL when oneDNN cannot create its CPU engine or memory runs out. One
 * backend is used by one thread at a time. */
ps_ops *ps_ops_dnnl_create(int threads);

/* How many primitives this backend made for which oneDNN had only its
 * reference implementation (each is also said once on stderr), and the
 * first of them in first (e.g. "convolution forward: ref:any"). 0 where
 * every convolution runs on a JIT kernel, as it should. */
int ps_ops_dnnl_ref_impls(const ps_ops *ops, char *first, size_t len);

/* The widest channel block activations are held in: 16 (AVX-512), or 8
 * (AVX2 and older, or PS_DNNL_BLOCK=8 in the environment). */
int ps_ops_dnnl_block(const ps_ops *ops);

/* "2.6.3": the version of the oneDNN library loaded, into buf. */
void ps_dnnl_version(char *buf, size_t len);

#endif

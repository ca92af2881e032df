/* The emulated device: the cpu backend's ops behind memory that is not host
 * memory (host_memory = 0), for running the code paths of a GPU worker on
 * a machine without one (`ps-worker --device emu`) and testing them.
 *
 * Its memory is blocks from its own alloc; every op checks that the
 * pointers it gets lie inside them (a host pointer, a short buffer or a
 * freed block aborts with a message, as a GPU would fault), and copies
 * check their direction. Copies to the host land late, as on a stream:
 * to_host at the next op or sync, to_host_async only once its ticket is
 * waited for (or asked about twice, or at sync), with the bytes of the
 * moment it was queued. Graphs: between graph_begin and graph_end the ops
 * are checked and recorded, not run, and what a GPU's stream capture
 * forbids (copies to or from the host, waits, allocation) aborts with a
 * message; graph_launch runs the recorded ops again. Results are the cpu
 * backend's with the same thread
 * count, bit for bit. Not fast: it is for checking, not for training. */
#ifndef PS_KERNELS_EMU_OPS_EMU_H
#define PS_KERNELS_EMU_OPS_EMU_H

#include "../ops.h"

/* threads as for ps_ops_cpu_create; NULL when memory or a thread cannot be
 * had. Freed with ops->destroy, which also frees blocks still allocated. */
ps_ops *ps_ops_emu_create(int threads);

/* For tests. fail_alloc_at: the alloc call number `call` (0-based, counted
 * from creation) returns NULL; -1 for none. counts: alloc calls so far,
 * blocks allocated now, copies to the host not landed yet, host_alloc's
 * blocks now, the asynchronous copies so far (with bytes), and those of
 * them whose host side was not
 * host_alloc's memory (a GPU would have staged them through a page-locked
 * buffer first). Both abort on a table that is not the emu backend. */
void ps_ops_emu_fail_alloc_at(ps_ops *ops, int call);
typedef struct {
  int allocs, blocks, pending, host_blocks, async_copies, pageable_async;
  int graphs, launches; /* graphs recorded (graph_end) and launched */
} ps_emu_counts;
void ps_ops_emu_counts(const ps_ops *ops, ps_emu_counts *out);

#endif

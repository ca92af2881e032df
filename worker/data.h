/* Data sets and the input pipeline of a worker.
 *
 * Images are held as float32 (n, c*h*w) scaled to [0, 1]; labels as bytes.
 * A batcher walks this worker's shard of the training set (examples i with
 * i % num_workers == rank), reshuffled every epoch from (seed, epoch, rank),
 * and fills batches on its own thread so compute never waits for input. */
#ifndef PS_WORKER_DATA_H
#define PS_WORKER_DATA_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  int n;          /* examples */
  int c, h, w;    /* shape of one example */
  int classes;
  float *images;  /* (n, c*h*w) in [0, 1] */
  uint8_t *labels;
} ps_dataset;

/* Reads an IDX image file (magic 0x00000803) and its label file
 * (0x00000801), gzip-compressed or plain (detected from the content).
 * Errors name the file and the problem: bad magic, truncated data,
 * counts that differ, labels >= classes. */
int ps_dataset_load_idx(const char *images_path, const char *labels_path, int classes,
                        ps_dataset *out, char *err);

/* The train (train=1) or test split of a named set in dir: "fashion-mnist"
 * and "mnist" read train-images-idx3-ubyte(.gz) etc. */
int ps_dataset_load_named(const char *name, const char *dir, int train, ps_dataset *out,
                          char *err);

/* A deterministic synthetic set that a small CNN learns in seconds: each
 * class is a fixed random template (from seed) plus per-example noise;
 * split 0 = train, 1 = test (different examples, same templates). */
int ps_dataset_synthetic(int n, int c, int h, int w, int classes, uint64_t seed, int split,
                         ps_dataset *out);

void ps_dataset_free(ps_dataset *d);

typedef struct {
  float *x;        /* (n, c*h*w) */
  uint8_t *y;      /* (n) */
  int n;
  int epoch;       /* 0-based epoch these examples come from */
  int64_t index;   /* sequence number of the batch from this batcher */
  /* with a chunk source: the chunk's tag (its lease), and whether this is
   * the chunk's last batch; n == 0 marks the end of the data */
  uint64_t tag;
  int last_in_chunk;
} ps_batch;

/* Where a batcher gets its examples from, chunk by chunk (data leases):
 * called on the batcher's thread whenever it needs the next chunk; writes
 * [begin, begin+count) of the data set, a tag and the epoch. Returns 0, 1
 * when there is no more data, or a negative code on failure (which also
 * ends the data). It may block (it should give up when asked to stop). */
typedef int (*ps_chunk_fn)(void *user, uint64_t *begin, uint32_t *count, uint64_t *tag,
                           int *epoch);

typedef struct ps_batcher ps_batcher;

/* Where a batcher's slots live: host memory from alloc (zeroed; NULL when
 * it cannot be had) released with free, called from the creating thread.
 * A GPU worker passes page-locked memory (ops->host_alloc), so that each
 * batch is copied to the device straight from its slot. NULL: ps_alloc. */
typedef struct {
  void *(*alloc)(void *ctx, size_t bytes);
  void (*free)(void *ctx, void *p);
  void *ctx;
} ps_host_mem;

/* Starts the prefetch thread: batches of batch_size (the last batch of an
 * epoch may be smaller) from the examples with i % num_workers == rank,
 * shuffled per epoch, `depth` batches ahead. NULL on failure. */
ps_batcher *ps_batcher_create(const ps_dataset *ds, int batch_size, int rank, int num_workers,
                              uint64_t seed, int depth);
/* As ps_batcher_create; shuffle 0 keeps every epoch in index order (for
 * runs that must see the same examples in the same order, as the sync
 * equivalence test does). */
ps_batcher *ps_batcher_create_ordered(const ps_dataset *ds, int batch_size, int rank,
                                      int num_workers, uint64_t seed, int depth, int shuffle);
/* A batcher whose examples come from `source`, chunk by chunk; each chunk
 * is shuffled (from seed and its tag) and cut into batches that never span
 * two chunks. */
ps_batcher *ps_batcher_create_source(const ps_dataset *ds, int batch_size, uint64_t seed,
                                     int depth, ps_chunk_fn source, void *user);
/* As ps_batcher_create_ordered and ps_batcher_create_source, with slots in
 * mem's memory (NULL: ps_alloc). */
ps_batcher *ps_batcher_create_ordered_in(const ps_dataset *ds, int batch_size, int rank,
                                         int num_workers, uint64_t seed, int depth, int shuffle,
                                         const ps_host_mem *mem);
ps_batcher *ps_batcher_create_source_in(const ps_dataset *ds, int batch_size, uint64_t seed,
                                        int depth, ps_chunk_fn source, void *user,
                                        const ps_host_mem *mem);
/* Blocks until a batch is ready; it stays valid until ps_batcher_release. */
int ps_batcher_next(ps_batcher *b, ps_batch **out);
void ps_batcher_release(ps_batcher *b, ps_batch *batch);
/* Number of examples in this worker's shard (one epoch). */
int ps_batcher_epoch_size(const ps_batcher *b);
void ps_batcher_destroy(ps_batcher *b);

#endif

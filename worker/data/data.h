/* Data sets and the input pipeline of a worker.
 *
 * Images are held as float32 (n, c*h*w) scaled to [0, 1] (then normalised
 * per channel where the job asks); labels as bytes. A batcher walks this
 * worker's shard of the training set (examples i with i % num_workers ==
 * rank), reshuffled every epoch from (seed, epoch, rank), augments each
 * example where the set asks for it, and fills batches on its own thread so
 * compute never waits for input.
 *
 * Readers: IDX (data.c), NumPy .npy/.npz (data_npy.c), CIFAR-10 binary
 * (data_cifar.c); the job's "dataset" object picks one (data_job.c). */
#ifndef PS_WORKER_DATA_H
#define PS_WORKER_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "common/job.h"

/* Training-time augmentation, done by the batcher as it copies an example
 * into a batch; seeded from (batcher seed, epoch, example index), so a run
 * replays exactly. Zeroed (the default): examples are copied unchanged. */
typedef struct {
  int crop_pad; /* > 0: an h x w window at a random offset of the image padded
                 * by crop_pad on every side */
  int flip;     /* mirror left-right with probability 1/2 */
  float *fill;  /* (c) value of a padding pixel (a black pixel after
                 * normalisation); NULL: 0. ps_alloc'd, freed with the set */
} ps_augment;

typedef struct {
  int n;          /* examples */
  int c, h, w;    /* shape of one example */
  int classes;
  float *images;  /* (n, c*h*w) in [0, 1], or normalised */
  uint8_t *labels;
  int n_ids;      /* categorical ids per example (click logs), else 0 */
  uint64_t *ids;  /* (n, n_ids), or NULL */
  double truth_auc; /* the AUC of the labels' true probabilities (synthetic
                     * click logs), 0 when unknown */
  ps_augment aug; /* applied to batches drawn from this set (a train split) */
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

/* ---- NumPy (data_npy.c) ----
 *
 * x: images of dtype uint8 (scaled to [0, 1] like IDX), float32 or float64
 * (taken as they are), shape (n, h, w, c) for PS_LAYOUT_NHWC or (n, c, h, w)
 * for PS_LAYOUT_NCHW, or (n, h, w) for one channel; held as (n, c, h, w).
 * y: labels of any integer dtype, shape (n) or (n, 1), in [0, classes).
 * Little-endian, C order, .npy format versions 1.0, 2.0 and 3.0. On error
 * (a message naming the file and the problem) *out is left zeroed. */
int ps_dataset_load_npy(const char *x_path, const char *y_path, int layout, int classes,
                        ps_dataset *out, char *err);

/* x and y are the arrays x_name and y_name ("x" finds the member "x.npy")
 * of the .npz archive at path, stored or deflate-compressed, zip64 too. */
int ps_dataset_load_npz(const char *path, const char *x_name, const char *y_name, int layout,
                        int classes, ps_dataset *out, char *err);

/* As the two above, from files already in memory; the names (x_path etc.)
 * only go into messages. */
int ps_dataset_parse_npy(const uint8_t *x, size_t x_len, const char *x_path, const uint8_t *y,
                         size_t y_len, const char *y_path, int layout, int classes,
                         ps_dataset *out, char *err);
int ps_dataset_parse_npz(const uint8_t *buf, size_t len, const char *path, const char *x_name,
                         const char *y_name, int layout, int classes, ps_dataset *out, char *err);

/* Float arrays of an .npz archive written by np.savez(path, *arrays): its
 * members arr_0, arr_1, ... in that order (every member must be one),
 * float32 or float64 (held as float32), C order; e.g. a Keras model's
 * get_weights(). */
#define PS_NP_MAX_DIMS 8
#define PS_NP_MAX_ARRAYS 4096
typedef struct {
  float *data;
  int ndim;
  int64_t shape[PS_NP_MAX_DIMS];
  size_t count;
} ps_np_array;
typedef struct {
  ps_np_array *arrays;
  int n;
} ps_np_floats;
/* On error *out is left empty, with a message naming the member. */
int ps_npz_load_floats(const char *path, ps_np_floats *out, char *err);
int ps_npz_parse_floats(const uint8_t *buf, size_t len, const char *path, ps_np_floats *out,
                        char *err);
void ps_np_floats_free(ps_np_floats *w);

/* ---- CIFAR-10 binary (data_cifar.c) ----
 *
 * Records of 1 label byte and 3072 pixel bytes (3x32x32, channel-major);
 * train: data_batch_1.bin .. data_batch_5.bin, test: test_batch.bin, in dir
 * or in dir/cifar-10-batches-bin. On error *out is left zeroed. */
int ps_dataset_load_cifar10(const char *dir, int train, ps_dataset *out, char *err);

/* ---- the job's data set (data_job.c) ---- */

/* images = (images - mean[c]) / std[c], per channel; count is 1 (the same
 * for every channel) or d->c. PS_EINVAL (and d unchanged) for another
 * count or a std that is not > 0. */
int ps_dataset_normalize(ps_dataset *d, const float *mean, const float *std, int count,
                         char *err);

/* The train (train=1) or test split of the job's data set: reads it (files
 * under dir, which overrides the job's "dir"; NULL: the job's), checks its
 * shape and classes against the model's input, normalises it and, for the
 * train split only, sets its augmentation. On error (the message names the
 * file and the problem) *out is left zeroed. */
int ps_dataset_load_job(const ps_job *job, const char *dir, int train, ps_dataset *out,
                        char *err);

/* 1 when the job's reader can make part of the train split alone
 * (ctr-synthetic: a worker generates only its static share). */
int ps_dataset_job_parts(const ps_job *job);

/* As ps_dataset_load_job, for part `part` of `parts` of the train split:
 * its examples part, part + parts, ... (the static share of rank `part`
 * among `parts` workers); PS_EINVAL when the reader cannot
 * (ps_dataset_job_parts) and parts > 1. */
int ps_dataset_load_job_part(const ps_job *job, const char *dir, int train, int part, int parts,
                             ps_dataset *out, char *err);

typedef struct {
  float *x;        /* (n, c*h*w) */
  uint8_t *y;      /* (n) */
  uint64_t *ids;   /* (n, n_ids) of the set's ids, or NULL (host memory) */
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

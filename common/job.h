/* The job: what to train and how. Read by ps-server from a JSON job file;
 * shard 0 hands the same text to every worker at Register.
 *
 * {
 *   "job_id": "fmnist-cnn",             (required)
 *   "model": { ...model spec... },       (required, see model_spec.h; or
 *            {"keras": "model.json"}: a Keras model.to_json() file,
 *            translated as ps-import-keras does, see keras.h; or
 *            {"params": P, ...}: a flat vector, no layers, for workers that
 *            compute the model themselves, see model_spec.h)
 *   "optimizer": {"name": "adam", "lr": 0.001, "beta1": 0.9, "beta2": 0.999,
 *                 "eps": 1e-8, "momentum": 0.9, "nesterov": false,
 *                 "initial_accumulator": 0.1},
 *   "seed": 1, "batch_size": 64, "epochs": 2, "max_steps": 0,
 *   "mode": "async",                     (or "ssp:K", or "sync")
 *   "backup_workers": 0, "min_workers": 1, "staleness_aware_lr": false, "wait_timeout_ms": 60000,
 *   "shuffle": true, "lease_chunk": 0,
 *   "dataset": {"name": "fashion-mnist", "dir": "/usr/share/datasets/fashion-mnist"},
 *   "eval_interval_s": 20, "heartbeat_timeout_ms": 10000,
 *   "wire": "fp32",                      (or "bf16", "fp16": 16-bit values on the wire)
 *   "replicas_per_shard": 1, "replica_heartbeat_ms": 100, "replica_lease_ms": 500,
 *   "embeddings": [{"name": "cat", "rows": 1000000, "dim": 16}],  (see emb.h)
 *   "max_rows_per_request": 131072      (rows one Pull or Push names, over its tables)
 * }
 * dataset.name is "fashion-mnist", "mnist" (IDX files in dir), "cifar10"
 * (CIFAR-10 binary: data_batch_1.bin .. data_batch_5.bin and test_batch.bin
 * in dir), "npz", "npy" or "synthetic" (with "train_size", "test_size"):
 *   {"name": "npz", "train": "train.npz", "test": "test.npz",
 *    "x": "x", "y": "y", "layout": "nhwc"}   (names of the arrays: x, y)
 *   {"name": "npy", "train_x": "a.npy", "train_y": "b.npy",
 *    "test_x": "c.npy", "test_y": "d.npy", "layout": "nchw"}
 * relative paths are under "dir" (or --data-dir) when one is given;
 * Click logs, for a binary model with ids (model_spec.h), input [dense
 * fields, 1, 1] and "ids" the categorical fields (worker/data/data_ctr.h):
 *   {"name": "ctr-synthetic", "train_size": 1000000, "test_size": 100000,
 *    "vocab": 100000, "zipf": 1.05, "data_seed": 1}
 *                     examples [0, train_size) and the next test_size of
 *                     the generator's log with a hidden factorization
 *                     machine (ground-truth AUC about 0.78-0.80)
 *   {"name": "criteo", "train": "train.tsv", "test": "test.tsv",
 *    "train_size": N, "test_size": M}   Criteo TSV files (plain or gzip),
 *                     the first N (M) lines of each (absent: all)
 * "layout" is how 4-D image arrays are laid out, "nhwc" (NumPy's habit,
 * the default) or "nchw". Any data set also takes
 *   "mean": [..], "std": [..]   one value, or one per input channel:
 *                               (pixel in [0, 1] - mean) / std
 *   "crop_pad": 4, "flip": true  training batches only: a random crop of
 *                               the image padded by crop_pad on every side,
 *                               a random left-right mirror. */
#ifndef PS_COMMON_JOB_H
#define PS_COMMON_JOB_H

#include <stdint.h>

#include "emb.h"
#include "half.h"

#define PS_MAX_REPLICAS 5
#include "model_spec.h"

typedef struct {
  char name[16]; /* sgd | momentum | adagrad | adam */
  float lr;
  float momentum;            /* momentum */
  int nesterov;              /* momentum */
  float beta1, beta2, eps;   /* adam; eps also adagrad */
  float initial_accumulator; /* adagrad */
} ps_optim_config;

/* How 4-D image arrays of npz and npy files are laid out. */
enum { PS_LAYOUT_NHWC = 0, PS_LAYOUT_NCHW = 1 };

/* Most channels a per-channel "mean" and "std" may list. */
#define PS_JOB_MAX_CHANNELS 16

/* Consistency modes, enforced by every shard. */
enum { PS_MODE_ASYNC = 0, PS_MODE_SSP = 1, PS_MODE_SYNC = 2 };

typedef struct {
  char job_id[64];
  ps_model_spec model;
  ps_optim_config optim;
  uint64_t seed;
  int batch_size;
  int epochs;          /* passes over the training set per worker shard */
  int64_t max_steps;   /* per worker; 0 = no limit */
  char mode[16];       /* "async", "ssp:K" or "sync", as written */
  int mode_kind;       /* PS_MODE_* */
  int ssp_k;           /* ssp: how many steps a worker may run ahead */
  int backup_workers;  /* sync: a step is applied once live - B gradients are in */
  int min_workers;     /* sync: no step is applied before this many workers registered */
  int staleness_aware_lr; /* async/ssp: lr / max(1, staleness) */
  int wait_timeout_ms; /* ssp/sync: how long a pull may wait on the server */
  int shuffle;         /* reshuffle every epoch (default true) */
  int lease_chunk;     /* > 0: shard 0 leases chunks of this many examples (elastic data) */
  char dataset[32];    /* fashion-mnist | mnist | cifar10 | npz | npy | synthetic */
  char data_dir[256];  /* IDX and CIFAR-10 files; npz, npy: base of relative paths */
  int synthetic_train, synthetic_test; /* synthetic sets' sizes; criteo: rows read (0: all) */
  uint64_t ctr_vocab, ctr_seed;        /* ctr-synthetic: values per field, generator seed */
  double ctr_zipf;                     /* ctr-synthetic: Zipf exponent of the values */
  char data_train[256], data_test[256];    /* npz: the archives */
  char data_x[64], data_y[64];             /* npz: the arrays' names in them */
  char data_train_x[256], data_train_y[256], data_test_x[256], data_test_y[256]; /* npy */
  int data_layout;     /* npz, npy: PS_LAYOUT_* of 4-D image arrays */
  int data_norm_count; /* values in data_mean and data_std: 0 (none), 1 or in_c */
  float data_mean[PS_JOB_MAX_CHANNELS], data_std[PS_JOB_MAX_CHANNELS];
  int data_crop_pad;   /* training batches: random crop after padding by this */
  int data_flip;       /* training batches: random left-right mirror */
  double eval_interval_s;
  int heartbeat_timeout_ms;
  int max_workers;     /* registered at once on a shard (evaluators included); default 256 */
  ps_wire wire;        /* how pulled parameters and pushed gradients travel; default fp32 */
  /* Replicated shards (ps/repl/replica.h): replicas per shard (1: none), a
   * primary's heartbeat to its backups, and the silence after which a
   * backup runs for primary or a primary drops a backup. */
  int replicas_per_shard;   /* default 1, at most PS_MAX_REPLICAS */
  int replica_heartbeat_ms; /* default 100 */
  int replica_lease_ms;     /* default 500, at least 3 heartbeats */
  /* Embedding tables (common/emb.h): sparse rows on the shards, each with
   * its own optimizer (default: the job's). */
  int n_tables;
  int max_rows_per_request; /* rows one Pull or Push may name over its tables (default 131072) */
  ps_table_spec tables[PS_MAX_TABLES];
  ps_optim_config table_optim[PS_MAX_TABLES];
} ps_job;

/* Parses a job from JSON text, filling defaults for absent optional fields.
 * On error returns PS_EINVAL with a message that names the field. */
int ps_job_parse(const char *json_text, ps_job *job, char *err);

/* Whether a job's model has layers to compute, as ps-worker needs: 0, or
 * PS_EINVAL with a message saying that a flat model ({"params": P}) is
 * for workers that compute the model themselves (Python workers). */
int ps_job_check_layers(const ps_job *job, char *err);

/* Reads and parses a job file; the message names the file and the line and
 * column of a JSON syntax error. If text_out is not NULL it receives the
 * job's text (malloc'd): the file's, or, when its model is {"keras":
 * FILE} (FILE relative to the job file's directory unless absolute), the
 * job with that model translated into a spec, so that whoever parses the
 * text (workers, from the server) needs no file of its own. */
int ps_job_load(const char *path, ps_job *job, char **text_out, char *err);

#endif

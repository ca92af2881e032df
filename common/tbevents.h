/* TensorBoard event files: scalars as TensorFlow's Event records
 * (proto/tb_event.proto) in TFRecord framing, which `tensorboard --logdir`
 * reads as a live run.
 *
 * A record: the data's length (uint64, little-endian), the masked CRC-32C
 * of those 8 bytes (uint32, little-endian), the data, the masked CRC-32C of
 * the data. Each Event is flushed as it is written. */
#ifndef PS_COMMON_TBEVENTS_H
#define PS_COMMON_TBEVENTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct ps_tb ps_tb;

/* TFRecord's checksum of n bytes: CRC-32C rotated right by 15 bits plus
 * 0xa282ead8 (a checksum of data that holds checksums stays useful). */
uint32_t ps_tb_masked_crc(const void *buf, size_t n);

/* Creates dir (and its parents) when absent and a new event file in it,
 * named events.out.tfevents.<unix seconds>.<hostname>.<pid> (".N" added
 * when that name exists), whose first record says the file version
 * ("brain.Event:2"). NULL with a message in err when dir cannot be made
 * or is not a directory, or the file cannot be created or written. */
ps_tb *ps_tb_open(const char *dir, char *err);

/* The file's path (valid until ps_tb_close). */
const char *ps_tb_path(const ps_tb *w);

/* Writes one Event at step holding n scalars (tags[i], values[i]; NaN and
 * infinities as they are) and flushes it. Returns 0; PS_EINVAL for a NULL
 * writer or tag, or n < 1; PS_EIO with a message in err when the write or
 * the flush fails, after which the file's end may be torn and every later
 * call returns PS_ESTATE, writing nothing. Thread-safe. */
int ps_tb_scalars(ps_tb *w, int64_t step, int n, const char *const *tags, const float *values,
                  char *err);
/* The same for one scalar. */
int ps_tb_scalar(ps_tb *w, const char *tag, int64_t step, float value, char *err);

/* Flushes, fsyncs and closes the file; frees w (NULL is a no-op).
 * Returns 0, or PS_EIO with a message in err when one of them fails. */
int ps_tb_close(ps_tb *w, char *err);

#endif

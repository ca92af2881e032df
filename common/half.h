/* 16-bit floats on the wire: bfloat16 and IEEE binary16 (fp16).
 *
 * A job's "wire" (ps_wire) says how tensor values travel in field 15:
 * float32 (4 bytes each, the default) or one of the 16-bit formats (2 bytes
 * each, little-endian). Shards keep parameters and optimizer state in
 * float32 either way; only the bytes on the wire change.
 *
 * Encoding rounds to nearest, ties to even. A NaN encodes as a quiet NaN of
 * the same sign; a finite value beyond the format's range encodes as Inf of
 * its sign (bf16: |x| >= 0x1.fefp127, a hair under FLT_MAX; fp16:
 * |x| >= 65520, halfway past 65504, the largest fp16). Decoding is exact:
 * every 16-bit value is a float32 value. The loops (ps_half_encode,
 * _decode, _encode_feedback, _max_bits) are written so that GCC
 * vectorizes them at -O2; they read 16-bit values at any alignment. */
#ifndef PS_COMMON_HALF_H
#define PS_COMMON_HALF_H

#include <stddef.h>
#include <stdint.h>

#include "util.h"

/* How tensor values travel; the numbers are proto/ps.proto's Encoding. */
typedef enum { PS_WIRE_FP32 = 0, PS_WIRE_BF16 = 1, PS_WIRE_FP16 = 2 } ps_wire;
#define PS_WIRE_NAMES "fp32, bf16, fp16"

/* "fp32", "bf16" or "fp16"; "unknown" for anything else (a number off the
 * wire may be anything). */
const char *ps_wire_name(int wire);
/* The ps_wire a name stands for; PS_EINVAL (nothing written) otherwise. */
int ps_wire_parse(const char *name, ps_wire *out);
/* Bytes per value on the wire: 4 for fp32, 2 for the 16-bit formats. */
size_t ps_wire_value_bytes(ps_wire wire);

/* One value at a time (the loops below use the same code). */
uint16_t ps_bf16_from_float(float x);
float ps_bf16_to_float(uint16_t h);
uint16_t ps_fp16_from_float(float x);
float ps_fp16_to_float(uint16_t h);

/* A 16-bit value that may sit at any address (gRPC's slices put tensor
 * bytes wherever the stream put them), as ps_ufloat is for floats. */
typedef uint16_t ps_uhalf __attribute__((aligned(1)));

/* The 16-bit formats only (wire is PS_WIRE_BF16 or PS_WIRE_FP16; anything
 * else is a programming error and encodes/decodes as fp16). */

/* out[i] = encode(in[i]) for i < n. Returns ps_half_max_bits of out: at
 * or above ps_half_nonfinite_bits(wire) when some value went out as Inf or
 * NaN. */
/* 1 when fp16 conversions use the CPU's F16C instructions (x86-64 with
 * AVX and F16C, unless PS_NO_F16C is set in the environment): the same
 * results, 4-5 times faster. */
int ps_half_fp16_hardware(void);
uint16_t ps_half_encode(ps_wire wire, const float *in, uint16_t *out, size_t n);
/* out[i] = decode(in[i]) for i < n: exact. */
void ps_half_decode(ps_wire wire, const ps_uhalf *in, float *out, size_t n);
/* The largest value of in[i] & 0x7fff over i < n (0 when n is 0): at or
 * above ps_half_nonfinite_bits(wire) when some value is Inf or NaN. */
uint16_t ps_half_max_bits(const ps_uhalf *in, size_t n);
/* float32 values: the largest |in[i]| over i < n as the float's bits
 * without the sign (0 when n is 0), one vectorized pass: at or above
 * PS_F32_NONFINITE_BITS when some value is Inf or NaN. */
#define PS_F32_NONFINITE_BITS 0x7f800000u
uint32_t ps_f32_max_bits(const ps_ufloat *in, size_t n);
/* 0x7f80 (bf16) or 0x7c00 (fp16): magnitudes at or above are Inf or NaN. */
uint16_t ps_half_nonfinite_bits(ps_wire wire);
/* The index of the first Inf or NaN in in[0, n), or n. */
size_t ps_half_first_nonfinite(ps_wire wire, const ps_uhalf *in, size_t n);

/* Error feedback: encodes x = g[i] + residual[i] and keeps what rounding
 * lost, residual[i] = x - decode(out[i]) (exact in float32), so that it
 * goes out with the next gradient instead of being lost. Where out[i] is
 * Inf or NaN (x was, or x is beyond the format's range) residual[i]
 * becomes 0, so that one bad value cannot poison every later push.
 * Returns ps_half_max_bits of out, as ps_half_encode does. */
uint16_t ps_half_encode_feedback(ps_wire wire, const float *g, float *residual, uint16_t *out,
                                 size_t n);

/* Calls fn(values, n, first, user) over the 16-bit values [first,
 * first + count) of the view, in order, in pieces of contiguous values read
 * in place (a value split across two segments is staged through a small
 * buffer); stops and returns fn's value when it is non-zero. PS_ERANGE when
 * the view holds fewer values (its total is read as total / 2 values). */
typedef int (*ps_half_fn)(const ps_uhalf *values, size_t n, size_t first, void *user);
int ps_segview_each_half_range(const ps_segview *v, size_t first, size_t count, ps_half_fn fn,
                               void *user);

/* Decodes the first count 16-bit values of the view into out, and writes
 * the index of the first Inf or NaN among them into *nonfinite (count when
 * there is none; nonfinite may be NULL). PS_ERANGE (out untouched) when the
 * view holds fewer values. */
int ps_half_decode_view(ps_wire wire, const ps_segview *v, float *out, size_t count,
                        size_t *nonfinite);

#endif

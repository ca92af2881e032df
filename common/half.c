/* bfloat16 and fp16: encoding (round to nearest, ties to even), exact
 * decoding, error feedback, and 16-bit values read from scattered bytes.
 *
 * Every conversion is integer arithmetic on the float's bits, with one
 * exception (fp16's subnormal encoding adds 0.5f, the float unit doing the
 * rounding), written as selects between the cases rather than branches so
 * that the loops vectorize. None depends on the float unit's
 * flush-to-zero or denormals-are-zero settings: the fp16 decode builds
 * subnormal values from an integer conversion, and the one addition gives
 * 0.5 + |x|, a normal float. */
#include "half.h"

#include <stdlib.h>
#include <string.h>

static const char *const WIRE_NAMES[] = {
    [PS_WIRE_FP32] = "fp32", [PS_WIRE_BF16] = "bf16", [PS_WIRE_FP16] = "fp16"};

const char *ps_wire_name(int wire) {
  return wire >= PS_WIRE_FP32 && wire <= PS_WIRE_FP16 ? WIRE_NAMES[wire] : "unknown";
}

int ps_wire_parse(const char *name, ps_wire *out) {
  for (int w = PS_WIRE_FP32; name && w <= PS_WIRE_FP16; w++)
    if (strcmp(name, WIRE_NAMES[w]) == 0) {
      *out = (ps_wire)w;
      return PS_OK;
    }
  return PS_EINVAL;
}

size_t ps_wire_value_bytes(ps_wire wire) { return wire == PS_WIRE_FP32 ? 4 : 2; }

/* ---------------------------------------------------------------- one value */

static inline uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* bf16 is the top half of a float32: add just under half of the dropped
 * half (plus one when the kept part is odd: ties go to even) and cut. The
 * carry runs into the exponent where it must, up to Inf. NaN is kept
 * apart, since the carry could turn it into Inf, and made quiet so that a
 * payload living only in the dropped half still reads as NaN. */
static inline uint16_t bf16_encode(float x) {
  uint32_t u = bits_of(x);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float bf16_decode(uint16_t h) { return float_of((uint32_t)h << 16); }

/* fp16 from float32 (after F. Giesen's float_to_half_fast3_rtne):
 *  - |x| >= 65536 (bits 143 << 23) and Inf: Inf; NaN: a quiet NaN;
 *  - |x| < 2^-14 (bits 113 << 23), fp16's subnormals and zero: adding 0.5
 *    (bits 126 << 23), whose ulp is 2^-24, the fp16 subnormal step, makes
 *    the float unit round |x| to a multiple of 2^-24 (ties to even, as
 *    the default rounding mode does); the low bits of the sum are that
 *    multiple, 0x400 when it rounds up to the smallest normal;
 *  - otherwise rebias the exponent (127 -> 15) and round the 13 dropped
 *    mantissa bits as bf16 does its 16; the carry may reach 0x7c00, Inf
 *    (65520 and above: halfway past 65504 rounds up, 65504 being odd). */
static inline uint16_t fp16_encode(float x) {
  uint32_t u = bits_of(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  uint32_t sub = bits_of(float_of(a) + 0.5f) - (126u << 23);
  uint32_t big = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
  /* Selected with masks: as ?: GCC would compute `sub` in a branch, where
   * a float addition (which it must assume may trap) cannot be made a
   * select, and the loops would stay scalar. */
  uint32_t is_big = 0u - (uint32_t)(a >= (143u << 23));
  uint32_t is_sub = 0u - (uint32_t)(a < (113u << 23));
  uint32_t h = (big & is_big) | (sub & is_sub) | (normal & ~(is_big | is_sub));
  return (uint16_t)(h | sign);
}

/* float32 from fp16, exactly: normal values rebias the exponent (15 ->
 * 127), Inf and NaN take exponent 255 with their mantissa, and subnormals
 * (m * 2^-24, m < 1024) come from an integer conversion and an exact
 * scaling by a power of two. */
static inline float fp16_decode(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = h & 0x7c00u;
  uint32_t mag = (uint32_t)(h & 0x7fffu) << 13;
  uint32_t normal = mag + (112u << 23);
  uint32_t infnan = mag + (224u << 23);
  uint32_t sub = bits_of((float)(int32_t)(h & 0x3ffu) * 0x1p-24f);
  uint32_t is_infnan = 0u - (uint32_t)(e == 0x7c00u); /* masks, as in fp16_encode */
  uint32_t is_sub = 0u - (uint32_t)(e == 0);
  uint32_t r = (infnan & is_infnan) | (sub & is_sub) | (normal & ~(is_infnan | is_sub));
  return float_of(r | sign);
}

uint16_t ps_bf16_from_float(float x) { return bf16_encode(x); }
float ps_bf16_to_float(uint16_t h) { return bf16_decode(h); }
uint16_t ps_fp16_from_float(float x) { return fp16_encode(x); }
float ps_fp16_to_float(uint16_t h) { return fp16_decode(h); }

/* ---------------------------------------------------------------- loops */

/* Each loop runs over vec_floor(n) values, a multiple of the vector width
 * GCC can see (at -O2 it vectorizes only loops that leave no remainder),
 * then over the rest one at a time: the same code, so the same results. */
enum { HALF_VEC = 16 };
static inline size_t vec_floor(size_t n) { return n / HALF_VEC * HALF_VEC; }

/* The largest magnitude written is gathered on the way (as signed 16-bit
 * values, all non-negative, which SSE2 can max): the caller learns of an
 * Inf or NaN without a second pass. */
/* The F16C path (below), where the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__)
#define PS_HAVE_F16C_PATH 1
static int use_f16c(void);
static uint16_t f16c_encode_n(const float *restrict in, uint16_t *restrict out, size_t n);
static void f16c_decode_n(const ps_uhalf *restrict in, float *restrict out, size_t n);
#else
#define PS_HAVE_F16C_PATH 0
#endif

static inline __attribute__((always_inline)) uint16_t encode_n(int bf16, const float *restrict in,
                                                               uint16_t *restrict out, size_t n) {
  const size_t nv = vec_floor(n);
  int16_t m = 0;
  for (size_t i = 0; i < nv; i++) { /* vectorized */
    out[i] = bf16 ? bf16_encode(in[i]) : fp16_encode(in[i]);
    int16_t a = (int16_t)(out[i] & 0x7fffu);
    m = a > m ? a : m;
  }
  for (size_t i = nv; i < n; i++) {
    out[i] = bf16 ? bf16_encode(in[i]) : fp16_encode(in[i]);
    int16_t a = (int16_t)(out[i] & 0x7fffu);
    m = a > m ? a : m;
  }
  return (uint16_t)m;
}

uint16_t ps_half_encode(ps_wire wire, const float *restrict in, uint16_t *restrict out, size_t n) {
  if (wire == PS_WIRE_BF16) return encode_n(1, in, out, n);
#if PS_HAVE_F16C_PATH
  if (use_f16c()) return f16c_encode_n(in, out, n);
#endif
  return encode_n(0, in, out, n);
}

static void bf16_decode_n(const ps_uhalf *restrict in, float *restrict out, size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) out[i] = bf16_decode(in[i]); /* vectorized */
  for (size_t i = nv; i < n; i++) out[i] = bf16_decode(in[i]);
}

static void fp16_decode_n(const ps_uhalf *restrict in, float *restrict out, size_t n) {
  const size_t nv = vec_floor(n);
  for (size_t i = 0; i < nv; i++) out[i] = fp16_decode(in[i]); /* vectorized */
  for (size_t i = nv; i < n; i++) out[i] = fp16_decode(in[i]);
}

void ps_half_decode(ps_wire wire, const ps_uhalf *restrict in, float *restrict out, size_t n) {
  if (wire == PS_WIRE_BF16)
    bf16_decode_n(in, out, n);
#if PS_HAVE_F16C_PATH
  else if (use_f16c())
    f16c_decode_n(in, out, n);
#endif
  else
    fp16_decode_n(in, out, n);
}

uint16_t ps_half_nonfinite_bits(ps_wire wire) { return wire == PS_WIRE_BF16 ? 0x7f80u : 0x7c00u; }

uint16_t ps_half_max_bits(const ps_uhalf *in, size_t n) {
  /* As signed 16-bit values (all non-negative), which SSE2 can max. */
  const size_t nv = vec_floor(n);
  int16_t m = 0;
  for (size_t i = 0; i < nv; i++) { /* vectorized */
    int16_t a = (int16_t)(in[i] & 0x7fffu);
    m = a > m ? a : m;
  }
  for (size_t i = nv; i < n; i++) {
    int16_t a = (int16_t)(in[i] & 0x7fffu);
    m = a > m ? a : m;
  }
  return (uint16_t)m;
}

uint32_t ps_f32_max_bits(const ps_ufloat *in, size_t n) {
  /* As signed 32-bit values (all non-negative): 16 at a time in four
   * vectors of 4 lanes, maxed side by side (compare and select, which
   * SSE2 has; one vector's chain took 4 cycles a vector, 2.2 GB/s). GCC's
   * and Clang's vector types, which other targets lower to what they have. */
  typedef int32_t v4 __attribute__((vector_size(16)));
  const v4 mask = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  v4 m0 = {0, 0, 0, 0}, m1 = m0, m2 = m0, m3 = m0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v4 x[4];
    memcpy(x, (const void *)(in + i), sizeof x);
    x[0] &= mask;
    x[1] &= mask;
    x[2] &= mask;
    x[3] &= mask;
    v4 g0 = x[0] > m0, g1 = x[1] > m1, g2 = x[2] > m2, g3 = x[3] > m3;
    m0 = (x[0] & g0) | (m0 & ~g0);
    m1 = (x[1] & g1) | (m1 & ~g1);
    m2 = (x[2] & g2) | (m2 & ~g2);
    m3 = (x[3] & g3) | (m3 & ~g3);
  }
  int32_t m = 0;
  for (int j = 0; j < 4; j++) {
    const int32_t c[4] = {m0[j], m1[j], m2[j], m3[j]};
    for (int k = 0; k < 4; k++) m = c[k] > m ? c[k] : m;
  }
  for (; i < n; i++) {
    uint32_t u;
    memcpy(&u, (const void *)(in + i), sizeof u);
    const int32_t a = (int32_t)(u & 0x7fffffffu);
    m = a > m ? a : m;
  }
  return (uint32_t)m;
}

size_t ps_half_first_nonfinite(ps_wire wire, const ps_uhalf *in, size_t n) {
  uint16_t lim = ps_half_nonfinite_bits(wire);
  size_t i = 0;
  while (i < n && (in[i] & 0x7fffu) < lim) i++;
  return i;
}

/* What rounding lost, or 0 where the encoding is not finite (a mask, not
 * ?:, for the reason given in fp16_encode). */
static inline float bf16_lost(float x, uint16_t h) {
  uint32_t finite = 0u - (uint32_t)((h & 0x7fffu) < 0x7f80u);
  return float_of(bits_of(x - bf16_decode(h)) & finite);
}

static inline float fp16_lost(float x, uint16_t h) {
  uint32_t finite = 0u - (uint32_t)((h & 0x7fffu) < 0x7c00u);
  return float_of(bits_of(x - fp16_decode(h)) & finite);
}

/* g + r encoded into out, what rounding lost kept in r; returns the largest
 * magnitude bits as *_encode_n does. One body for both formats: each caller
 * passes a constant, so that its encoder inlines into a vectorized loop of
 * its own. */
static inline __attribute__((always_inline)) uint16_t feedback_n(int bf16, const float *restrict g,
                                                                 float *restrict r,
                                                                 uint16_t *restrict out, size_t n) {
  const size_t nv = vec_floor(n);
  int16_t m = 0; /* as in encode_n */
  for (size_t i = 0; i < nv; i++) { /* vectorized */
    float x = g[i] + r[i];
    out[i] = bf16 ? bf16_encode(x) : fp16_encode(x);
    r[i] = bf16 ? bf16_lost(x, out[i]) : fp16_lost(x, out[i]);
    int16_t a = (int16_t)(out[i] & 0x7fffu);
    m = a > m ? a : m;
  }
  for (size_t i = nv; i < n; i++) {
    float x = g[i] + r[i];
    out[i] = bf16 ? bf16_encode(x) : fp16_encode(x);
    r[i] = bf16 ? bf16_lost(x, out[i]) : fp16_lost(x, out[i]);
    int16_t a = (int16_t)(out[i] & 0x7fffu);
    m = a > m ? a : m;
  }
  return (uint16_t)m;
}

/* ---------------------------------------------------------------- F16C
 * x86-64 CPUs with F16C convert 8 values an instruction (vcvtps2ph rounds
 * to nearest even, vcvtph2ps is exact), 4-5 times faster than the integer
 * code above. They differ from it only in NaNs, which keep part of their
 * payload; the fix-up makes every NaN 0x7e00 with its sign, as
 * fp16_encode does, so the results are the same bits on every CPU (the
 * unit test compares them with the one-value functions). Chosen once, at
 * the first call, by what the CPU says it has. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>

__attribute__((target("avx,f16c"))) static inline __m128i f16c_encode8(__m256 x, __m128i *mx) {
  __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
  __m128i nan = _mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00));
  __m128i canon = _mm_or_si128(_mm_andnot_si128(_mm_set1_epi16(0x7fff), h), _mm_set1_epi16(0x7e00));
  h = _mm_or_si128(_mm_and_si128(nan, canon), _mm_andnot_si128(nan, h));
  *mx = _mm_max_epi16(*mx, _mm_and_si128(h, _mm_set1_epi16(0x7fff)));
  return h;
}

__attribute__((target("avx,f16c"))) static inline uint16_t f16c_max(__m128i mx) {
  int16_t lanes[8];
  _mm_storeu_si128((__m128i *)(void *)lanes, mx);
  int16_t m = 0;
  for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
  return (uint16_t)m;
}

__attribute__((target("avx,f16c"))) static uint16_t f16c_encode_n(const float *restrict in,
                                                                 uint16_t *restrict out,
                                                                 size_t n) {
  __m128i mx = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(void *)(out + i), f16c_encode8(_mm256_loadu_ps(in + i), &mx));
  uint16_t m = f16c_max(mx);
  for (; i < n; i++) {
    out[i] = fp16_encode(in[i]);
    uint16_t a = out[i] & 0x7fffu;
    m = a > m ? a : m;
  }
  return m;
}

__attribute__((target("avx,f16c"))) static void f16c_decode_n(const ps_uhalf *restrict in,
                                                             float *restrict out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + i))));
  for (; i < n; i++) out[i] = fp16_decode(in[i]);
}

__attribute__((target("avx,f16c"))) static uint16_t f16c_feedback_n(const float *restrict g,
                                                                   float *restrict r,
                                                                   uint16_t *restrict out,
                                                                   size_t n) {
  __m128i mx = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_add_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(r + i));
    __m128i h = f16c_encode8(x, &mx);
    _mm_storeu_si128((__m128i *)(void *)(out + i), h);
    /* What rounding lost, 0 where the encoding is Inf or NaN. */
    __m128i finite16 = _mm_cmplt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)),
                                       _mm_set1_epi16(0x7c00));
    __m256 finite = _mm256_castsi256_ps(_mm256_setr_m128i(_mm_unpacklo_epi16(finite16, finite16),
                                                          _mm_unpackhi_epi16(finite16, finite16)));
    __m256 lost = _mm256_sub_ps(x, _mm256_cvtph_ps(h));
    _mm256_storeu_ps(r + i, _mm256_and_ps(lost, finite));
  }
  uint16_t m = f16c_max(mx);
  for (; i < n; i++) {
    float x = g[i] + r[i];
    out[i] = fp16_encode(x);
    r[i] = fp16_lost(x, out[i]);
    uint16_t a = out[i] & 0x7fffu;
    m = a > m ? a : m;
  }
  return m;
}

static int use_f16c(void) {
  static int known = -1; /* a benign race: every thread computes the same */
  int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
  if (k < 0) {
    /* CPUID leaf 1, ECX: bit 27 OSXSAVE, 28 AVX, 29 F16C; and the OS keeps
     * the YMM state (XCR0 bits 1 and 2). From cpuid.h rather than
     * __builtin_cpu_supports, which not every compiler knows "f16c" in. */
    unsigned a, b, c, d;
    k = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27)) && (c & (1u << 28)) &&
        (c & (1u << 29))) {
      unsigned lo, hi;
      __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      k = (lo & 6u) == 6u;
    }
    if (getenv("PS_NO_F16C")) k = 0;
    __atomic_store_n(&known, k, __ATOMIC_RELAXED);
  }
  return k;
}
#else
static int use_f16c(void) { return 0; }
#endif

int ps_half_fp16_hardware(void) { return use_f16c(); }

uint16_t ps_half_encode_feedback(ps_wire wire, const float *restrict g, float *restrict residual,
                                 uint16_t *restrict out, size_t n) {
  if (wire == PS_WIRE_BF16) return feedback_n(1, g, residual, out, n);
#if PS_HAVE_F16C_PATH
  if (use_f16c()) return f16c_feedback_n(g, residual, out, n);
#endif
  return feedback_n(0, g, residual, out, n);
}

/* ---------------------------------------------------------------- scattered bytes */

typedef struct {
  ps_half_fn fn;
  void *user;
} half_tramp;

static int half_piece(const void *values, size_t n, size_t first, void *user) {
  const half_tramp *t = user;
  return t->fn(values, n, first, t->user);
}

int ps_segview_each_half_range(const ps_segview *v, size_t first, size_t count, ps_half_fn fn,
                               void *user) {
  half_tramp t = {fn, user};
  return ps_segview_each_elem_range(v, 2, first, count, half_piece, &t);
}

typedef struct {
  ps_wire wire;
  float *out;
  size_t nonfinite; /* the first index of an Inf or NaN, or count */
  size_t count;
} decode_ctx;

static int decode_piece(const ps_uhalf *values, size_t n, size_t first, void *user) {
  decode_ctx *c = user;
  ps_half_decode(c->wire, values, c->out + first, n);
  if (c->nonfinite == c->count && ps_half_max_bits(values, n) >= ps_half_nonfinite_bits(c->wire))
    c->nonfinite = first + ps_half_first_nonfinite(c->wire, values, n);
  return 0;
}

int ps_half_decode_view(ps_wire wire, const ps_segview *v, float *out, size_t count,
                        size_t *nonfinite) {
  if (count > v->total / 2) return PS_ERANGE;
  decode_ctx c = {.wire = wire, .out = out, .nonfinite = count, .count = count};
  int rc = ps_segview_each_half_range(v, 0, count, decode_piece, &c);
  if (nonfinite) *nonfinite = c.nonfinite;
  return rc;
}

/* 16-bit floats (common/half.c): every bf16 and fp16 value decoded against
 * a formula and encoded back to itself; rounding to nearest even at every
 * boundary between two neighbours, and of random floats against a
 * reference that searches the decoded values; subnormals, overflow to Inf,
 * NaN kept NaN; the loops against the one-value functions (any length, any
 * alignment); error feedback; 16-bit values read from scattered segments. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/half.h"
#include "common/rng.h"

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t enc(ps_wire w, float x) {
  return w == PS_WIRE_BF16 ? ps_bf16_from_float(x) : ps_fp16_from_float(x);
}

static float dec(ps_wire w, uint16_t h) {
  return w == PS_WIRE_BF16 ? ps_bf16_to_float(h) : ps_fp16_to_float(h);
}

static int is_nan16(ps_wire w, uint16_t h) {
  return w == PS_WIRE_BF16 ? (h & 0x7fff) > 0x7f80 : (h & 0x7fff) > 0x7c00;
}

/* The value of h from the format's definition, in double. */
static double reference_value(ps_wire w, uint16_t h) {
  int mbits = w == PS_WIRE_BF16 ? 7 : 10, ebits = w == PS_WIRE_BF16 ? 8 : 5;
  int bias = (1 << (ebits - 1)) - 1;
  int sign = h >> 15, e = (h >> mbits) & ((1 << ebits) - 1), m = h & ((1 << mbits) - 1);
  double v;
  if (e == (1 << ebits) - 1)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = ldexp(m, 1 - bias - mbits);
  else
    v = ldexp(m + (1 << mbits), e - bias - mbits);
  return sign ? -v : v;
}

/* Every 16-bit value: decodes to its definition's value, and encodes back
 * to itself; a NaN decodes to NaN and encodes to NaN. */
static void test_exhaustive(void) {
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    int bad_value = 0, bad_round = 0, nans = 0;
    for (uint32_t h = 0; h < 65536; h++) {
      float f = dec(w, (uint16_t)h);
      double ref = reference_value(w, (uint16_t)h);
      if (is_nan16(w, (uint16_t)h)) {
        nans++;
        bad_value += !isnan(f);
        bad_round += !is_nan16(w, enc(w, f));
        continue;
      }
      /* -0 too: the sign is compared through the bits */
      bad_value += (double)f != ref || !signbit(f) != !signbit(ref);
      bad_round += enc(w, f) != h;
    }
    CHECK_MSG(bad_value == 0, "%s: %d values decode wrong", ps_wire_name(w), bad_value);
    CHECK_MSG(bad_round == 0, "%s: %d values do not encode back to themselves", ps_wire_name(w),
              bad_round);
    CHECK(nans == (wi ? 2 * 1023 : 2 * 127));
  }
}

/* Between two neighbouring finite values a < b (of the same sign, as
 * 16-bit codes h and h+1): the midpoint goes to the even code, anything
 * below it to a, above it to b. The midpoints are exact in float32 (9 or
 * 12 significant bits). The last finite value and Inf: the midpoint and
 * above go to Inf. Covers every rounding boundary of both formats,
 * subnormals and the overflow threshold included. */
static void test_boundaries(void) {
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    uint16_t inf = w == PS_WIRE_BF16 ? 0x7f80 : 0x7c00;
    int bad = 0;
    for (uint32_t sign = 0; sign <= 0x8000; sign += 0x8000) {
      for (uint32_t h = 0; h < inf; h++) {
        double a = reference_value(w, (uint16_t)(h | sign));
        double b = reference_value(w, (uint16_t)((h + 1) | sign));
        /* past the largest: where the next value would be, had the
         * exponent room (the threshold of overflow is halfway to it) */
        if (isinf(b)) b = a + (a - reference_value(w, (uint16_t)((h - 1) | sign)));
        float mid = (float)((a + b) / 2);
        bad += (double)mid != (a + b) / 2;
        uint16_t even = (h & 1) ? (uint16_t)((h + 1) | sign) : (uint16_t)(h | sign);
        float below = nextafterf(mid, (float)a), above = nextafterf(mid, (float)b);
        bad += enc(w, mid) != even;
        bad += enc(w, below) != (uint16_t)(h | sign);
        bad += enc(w, above) != (uint16_t)((h + 1) | sign);
      }
    }
    CHECK_MSG(bad == 0, "%s: %d boundary cases rounded wrong", ps_wire_name(w), bad);
  }
}

/* A reference encoder: the nearest of the finite values (ties to the even
 * code), or Inf at and beyond the midpoint past the largest; NaN as NaN.
 * Searches the sorted non-negative values. */
static uint16_t reference_encode(ps_wire w, float x, const double *pos, uint16_t inf) {
  if (isnan(x)) return (uint16_t)(inf | 0x40); /* any NaN: compared as NaN */
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  double ax = fabs((double)x);
  size_t lo = 0, hi = inf; /* pos[0, inf) finite, increasing; pos[inf] = Inf */
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (pos[mid] <= ax)
      lo = mid;
    else
      hi = mid;
  }
  /* pos[lo] <= ax < pos[lo + 1] (or ax at or above the largest finite) */
  if (lo == (size_t)inf - 1) {
    double top = pos[inf - 1], next = top + (top - pos[inf - 2]); /* where Inf would start */
    return (uint16_t)(sign | (ax >= (top + next) / 2 ? inf : inf - 1));
  }
  double da = ax - pos[lo], db = pos[lo + 1] - ax;
  uint16_t h = (uint16_t)(da < db ? lo : db < da ? lo + 1 : (lo & 1) ? lo + 1 : lo);
  (void)w;
  return (uint16_t)(sign | h);
}

static void test_random_against_reference(void) {
  ps_rand r;
  ps_rand_seed(&r, 12345);
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    uint16_t inf = w == PS_WIRE_BF16 ? 0x7f80 : 0x7c00;
    double *pos = malloc(((size_t)inf + 1) * sizeof *pos);
    for (uint32_t h = 0; h <= inf; h++) pos[h] = reference_value(w, (uint16_t)h);
    int bad = 0;
    for (int i = 0; i < 1000000; i++) {
      uint32_t u = (uint32_t)ps_rand_next(&r);
      /* half of them in the format's range, where the rounding happens */
      if (i & 1)
        u = (u & 0x80ffffffu) |
            ((uint32_t)(wi ? 100 + ps_rand_below(&r, 45) : ps_rand_below(&r, 256)) << 23);
      float x = float_of(u);
      uint16_t got = enc(w, x), want = reference_encode(w, x, pos, inf);
      if (isnan(x) ? !is_nan16(w, got) : got != want) {
        if (bad++ < 5)
          fprintf(stderr, "%s(%a) = %04x, reference %04x\n", ps_wire_name(w), (double)x, got, want);
      }
    }
    CHECK_MSG(bad == 0, "%s: %d of 1000000 random floats encoded unlike the reference",
              ps_wire_name(w), bad);
    free(pos);
  }
}

/* Chosen values, written out. */
static void test_chosen(void) {
  /* bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1) */
  CHECK(ps_bf16_from_float(1.0f + 0x1p-8f) == 0x3f80);
  CHECK(ps_bf16_from_float(1.0f + 3 * 0x1p-8f) == 0x3f82); /* halfway, up to even */
  CHECK(ps_bf16_from_float(1.0f + 0x1p-8f + 0x1p-23f) == 0x3f81);
  CHECK(ps_bf16_from_float(-1.0f - 0x1p-8f) == 0xbf80);
  CHECK(ps_bf16_from_float(FLT_MAX) == 0x7f80); /* past the last midpoint: Inf */
  CHECK(ps_bf16_from_float(float_of(0x7f7f7fffu)) == 0x7f7f);
  CHECK(ps_bf16_from_float(-FLT_MAX) == 0xff80);
  CHECK(ps_bf16_from_float(INFINITY) == 0x7f80 && ps_bf16_from_float(-INFINITY) == 0xff80);
  CHECK(ps_bf16_from_float(0x1p-149f) == 0x0000);             /* the smallest float subnormal */
  CHECK(ps_bf16_from_float(float_of(0x00018000u)) == 0x0002); /* a subnormal tie, to even */
  CHECK(ps_bf16_from_float(-0.0f) == 0x8000);
  /* NaN stays NaN, even one whose payload is only in the dropped bits
   * (naive rounding would make 0x7f800001 Inf) */
  CHECK(is_nan16(PS_WIRE_BF16, ps_bf16_from_float(float_of(0x7f800001u))));
  CHECK(is_nan16(PS_WIRE_BF16, ps_bf16_from_float(float_of(0xffffffffu))));
  CHECK(ps_bf16_from_float(NAN) == 0x7fc0);
  CHECK(isnan(ps_bf16_to_float(0x7f81)));

  /* fp16 */
  CHECK(ps_fp16_from_float(1.0f) == 0x3c00);
  CHECK(ps_fp16_from_float(1.0f + 0x1p-11f) == 0x3c00);     /* halfway: to even */
  CHECK(ps_fp16_from_float(1.0f + 3 * 0x1p-11f) == 0x3c02); /* halfway: to even, up */
  CHECK(ps_fp16_from_float(65504.0f) == 0x7bff);
  CHECK(ps_fp16_from_float(65519.996f) == 0x7bff);
  CHECK(ps_fp16_from_float(65520.0f) == 0x7c00); /* overflow to Inf */
  CHECK(ps_fp16_from_float(-65520.0f) == 0xfc00);
  CHECK(ps_fp16_from_float(1e10f) == 0x7c00 && ps_fp16_from_float(FLT_MAX) == 0x7c00);
  CHECK(ps_fp16_from_float(0x1p-24f) == 0x0001); /* the smallest subnormal */
  CHECK(ps_fp16_from_float(0x1p-25f) == 0x0000); /* halfway to it: to even, 0 */
  CHECK(ps_fp16_from_float(nextafterf(0x1p-25f, 1)) == 0x0001);
  CHECK(ps_fp16_from_float(3 * 0x1p-25f) == 0x0002); /* halfway between 1 and 2 */
  CHECK(ps_fp16_from_float(0x1p-14f - 0x1p-25f) ==
        0x0400); /* largest subnormal/smallest normal tie */
  CHECK(ps_fp16_from_float(0x1p-14f - 3 * 0x1p-25f) == 0x03fe);
  CHECK(ps_fp16_from_float(1e-8f) == 0x0000 && ps_fp16_from_float(-1e-8f) == 0x8000);
  CHECK(ps_fp16_from_float(0x1p-149f) == 0x0000);
  CHECK(ps_fp16_to_float(0x0001) == 0x1p-24f && ps_fp16_to_float(0x03ff) == 1023 * 0x1p-24f);
  CHECK(ps_fp16_to_float(0x7bff) == 65504.0f && ps_fp16_to_float(0xfbff) == -65504.0f);
  CHECK(isinf(ps_fp16_to_float(0x7c00)) && ps_fp16_to_float(0xfc00) < 0);
  CHECK(isnan(ps_fp16_to_float(0x7c01)) && isnan(ps_fp16_to_float(0xfe00)));
  CHECK(ps_fp16_from_float(NAN) == 0x7e00);
  CHECK(is_nan16(PS_WIRE_FP16, ps_fp16_from_float(float_of(0x7f800001u))));
  CHECK(ps_fp16_from_float(-NAN) == 0xfe00);

  /* names */
  ps_wire w = PS_WIRE_FP32;
  CHECK(ps_wire_parse("bf16", &w) == PS_OK && w == PS_WIRE_BF16);
  CHECK(ps_wire_parse("fp16", &w) == PS_OK && w == PS_WIRE_FP16);
  CHECK(ps_wire_parse("fp32", &w) == PS_OK && w == PS_WIRE_FP32);
  CHECK(ps_wire_parse("FP16", &w) == PS_EINVAL && w == PS_WIRE_FP32);
  CHECK(ps_wire_parse(NULL, &w) == PS_EINVAL);
  CHECK(strcmp(ps_wire_name(PS_WIRE_BF16), "bf16") == 0 && strcmp(ps_wire_name(7), "unknown") == 0);
  CHECK(ps_wire_value_bytes(PS_WIRE_FP32) == 4 && ps_wire_value_bytes(PS_WIRE_BF16) == 2);
}

/* The loops give the one-value functions' results, at every length (the
 * vectorized part and the tail) and from any byte alignment. */
static void test_loops(void) {
  enum { N = 65536 + 37 };
  float *in = malloc(N * sizeof *in), *out = malloc(N * sizeof *out);
  uint16_t *h = malloc(N * sizeof *h);
  uint8_t *raw = malloc(2 * N + 1);
  ps_rand r;
  ps_rand_seed(&r, 99);
  for (size_t i = 0; i < N; i++) in[i] = float_of((uint32_t)ps_rand_next(&r));
  in[5] = NAN;
  in[6] = INFINITY;
  in[7] = 70000.0f;
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    int bad = 0;
    for (size_t n = 0; n < 40; n++) {                /* every tail length */
      uint16_t mx = ps_half_encode(w, in + 8, h, n); /* the Inf and NaN above left out */
      for (size_t i = 0; i < n; i++) bad += h[i] != enc(w, in[8 + i]);
      bad += mx != ps_half_max_bits(h, n);
    }
    /* the largest magnitude returned: an Inf or NaN shows */
    bad += ps_half_encode(w, in, h, N) < ps_half_nonfinite_bits(w);
    for (size_t i = 0; i < N; i++) bad += h[i] != enc(w, in[i]);
    /* decode every code (and a tail), from an odd address */
    for (size_t i = 0; i < N; i++) h[i] = (uint16_t)i;
    for (int shift = 0; shift < 2; shift++) {
      memcpy(raw + shift, h, 2 * N);
      ps_half_decode(w, (const ps_uhalf *)(const void *)(raw + shift), out, N);
      for (size_t i = 0; i < N; i++) {
        float want = dec(w, h[i]);
        bad += isnan(want) ? !isnan(out[i]) : bits_of(out[i]) != bits_of(want);
      }
    }
    CHECK_MSG(bad == 0, "%s: %d loop results differ from the one-value functions", ps_wire_name(w),
              bad);
    /* the largest magnitude, and where the first Inf or NaN is */
    uint16_t v[37] = {0};
    for (int i = 0; i < 37; i++) v[i] = (uint16_t)(0x8000 | i);
    CHECK(ps_half_max_bits(v, 37) == 36 && ps_half_max_bits(v, 0) == 0);
    CHECK(ps_half_first_nonfinite(w, v, 37) == 37);
    v[33] = ps_half_nonfinite_bits(w) | 0x8000;
    CHECK(ps_half_max_bits(v, 37) == ps_half_nonfinite_bits(w));
    CHECK(ps_half_first_nonfinite(w, v, 37) == 33);
  }
  free(in);
  free(out);
  free(h);
  free(raw);
}

/* Error feedback: what goes out plus the residual kept is exactly what
 * came in (gradient plus the residual before); a value that cannot be
 * carried leaves a zero residual. */
static void test_feedback(void) {
  enum { N = 1003 };
  float g[N], res[N], before[N];
  uint16_t h[N];
  ps_rand r;
  ps_rand_seed(&r, 5);
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    memset(res, 0, sizeof res);
    int bad = 0;
    for (int round = 0; round < 20; round++) {
      for (int i = 0; i < N; i++)
        g[i] = (float)(((double)(ps_rand_next(&r) >> 11) * 0x1p-53 - 0.5) *
                       ldexp(1.0, (int)ps_rand_below(&r, 40) - 30));
      g[7] = NAN;
      g[8] = w == PS_WIRE_FP16 ? 1e6f : INFINITY;
      memcpy(before, res, sizeof res);
      bad += ps_half_encode_feedback(w, g, res, h, N) != ps_half_max_bits(h, N);
      for (int i = 0; i < N; i++) {
        if (i == 7 || i == 8) {
          bad += res[i] != 0.0f || !((h[i] & 0x7fff) >= ps_half_nonfinite_bits(w));
          continue;
        }
        double in = (double)(float)(g[i] + before[i]);
        bad += h[i] != enc(w, (float)in);
        bad += (double)dec(w, h[i]) + (double)res[i] != in; /* exact */
      }
    }
    CHECK_MSG(bad == 0, "%s: %d error-feedback results wrong", ps_wire_name(w), bad);
  }
}

/* 16-bit values read from segments of every odd size, values split across
 * two of them; the first Inf or NaN found. */
static void test_segments(void) {
  enum { N = 1001 };
  uint16_t h[N];
  for (int i = 0; i < N; i++) h[i] = ps_fp16_from_float((float)i - 500.0f);
  const uint8_t *bytes = (const uint8_t *)h;
  for (size_t piece = 1; piece <= 9; piece += 2) {
    ps_seg segs[3 * N];
    int ns = 0;
    size_t at = 0;
    while (at < 2 * N) {
      size_t k = 2 * N - at < piece ? 2 * N - at : piece;
      segs[ns++] = (ps_seg){bytes + at, k};
      at += k;
      if (ns % 3 == 0) segs[ns++] = (ps_seg){NULL, 0}; /* empty ones are skipped */
    }
    ps_segview v = {segs, ns, 2 * N};
    float out[N];
    size_t bad = 0;
    CHECK(ps_half_decode_view(PS_WIRE_FP16, &v, out, N, &bad) == PS_OK && bad == N);
    int wrong = 0;
    for (int i = 0; i < N; i++) wrong += out[i] != (float)i - 500.0f;
    CHECK_MSG(wrong == 0, "piece %zu: %d values wrong", piece, wrong);
    CHECK(ps_half_decode_view(PS_WIRE_FP16, &v, out, N + 1, &bad) == PS_ERANGE);
    h[600] = 0xfc00; /* -Inf */
    h[900] = 0x7e00; /* NaN */
    CHECK(ps_half_decode_view(PS_WIRE_FP16, &v, out, N, &bad) == PS_OK && bad == 600);
    CHECK(ps_half_decode_view(PS_WIRE_FP16, &v, out, 600, &bad) == PS_OK && bad == 600);
    CHECK(ps_half_decode_view(PS_WIRE_FP16, &v, out, 601, &bad) == PS_OK && bad == 600);
    h[600] = ps_fp16_from_float(100.0f);
    h[900] = ps_fp16_from_float(400.0f);
  }
}

static void test_f32_max_bits(void) {
  /* The largest magnitude's bits of float32 values, against one value at a
   * time: every length to 70 (each tail after the 16-value steps), any
   * alignment, the largest anywhere, and NaN, Inf, -0 and subnormals. */
  uint8_t buf[4 * 80 + 4];
  float v[80];
  uint64_t x = 12345;
  int bad = 0;
  for (int len = 0; len <= 70; len++)
    for (int off = 0; off < 4; off++)
      for (int kind = 0; kind < 5; kind++) {
        for (int i = 0; i < len; i++) {
          x = x * 6364136223846793005ULL + 1442695040888963407ULL;
          v[i] = (float)((int64_t)(x >> 33) - (1LL << 30)) * 1e-9f;
        }
        if (len) {
          const int at = (int)(x % (uint64_t)len);
          v[at] = kind == 0 ? -3e38f : kind == 1 ? NAN : kind == 2 ? -INFINITY
                  : kind == 3 ? -0.0f : 1e-42f;
          if (kind == 4)
            for (int i = 0; i < len; i++) v[i] = i == at ? v[i] : 0.0f;
        }
        memcpy(buf + off, v, (size_t)len * sizeof(float));
        uint32_t want = 0;
        for (int i = 0; i < len; i++) {
          uint32_t u;
          memcpy(&u, &v[i], sizeof u);
          if ((u & 0x7fffffffu) > want) want = u & 0x7fffffffu;
        }
        bad += ps_f32_max_bits((const ps_ufloat *)(const void *)(buf + off), (size_t)len) != want;
      }
  CHECK_MSG(bad == 0, "%d of %d cases differ from the one-value maximum", bad, 71 * 4 * 5);
  const float inf[3] = {1.0f, INFINITY, 2.0f};
  CHECK(ps_f32_max_bits(inf, 3) >= PS_F32_NONFINITE_BITS);
  const float fin[3] = {1.0f, -3.4e38f, 2.0f};
  CHECK(ps_f32_max_bits(fin, 3) < PS_F32_NONFINITE_BITS);
}

int main(void) {
  printf("fp16 loops: %s\n", ps_half_fp16_hardware() ? "F16C" : "portable");
  RUN(test_exhaustive);
  RUN(test_boundaries);
  RUN(test_chosen);
  RUN(test_random_against_reference);
  RUN(test_loops);
  RUN(test_feedback);
  RUN(test_segments);
  RUN(test_f32_max_bits);
  return check_summary();
}

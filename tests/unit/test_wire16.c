/* 16-bit values on the wire, at the shard (ps/state/shard.c with a job whose
 * "wire" is bf16 or fp16) and in the job file:
 *  - a 16-bit push is applied exactly as a float32 push of the decoded
 *    values (async, split over two threads for a large shard, sync), from
 *    segments that split values anywhere;
 *  - bad 16-bit input (odd byte count, float32 bytes, NaN or Inf codes) is
 *    refused and counted, nothing changed;
 *  - error feedback: pushing one tiny gradient many times moves the
 *    parameters by what float32 pushes would, while rounding each push
 *    alone (no residual) does not;
 *  - the job key: default fp32, the three names, anything else refused
 *    with the choices named. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/half.h"
#include "common/job.h"
#include "common/model_spec.h"
#include "ps/state/shard.h"
#include "shard_fixture.h"

/* 8x8 inputs, one dense layer of 16: P = 1040, one shard. */
static const char *SPEC =
    "{\"input\": [1, 8, 8], \"classes\": 16, \"layers\": ["
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 16},"
    "{\"type\": \"softmax_xent\"}]}";
/* 4x32x32 inputs, dense 256: P = 4096*256 + 256 = 1048832, above the
 * 2^20 values from which a shard applies a push in two halves at once. */
static const char *BIG_SPEC =
    "{\"input\": [4, 32, 32], \"classes\": 256, \"layers\": ["
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 256},"
    "{\"type\": \"softmax_xent\"}]}";

static ps_job make_job(const char *spec, const char *optimizer, ps_wire wire, int sync) {
  ps_job job = fixture_job("test-wire16", spec, optimizer, sync);
  job.wire = wire;
  return job;
}

static ps_shard *make_shard(const ps_job *job) { return fixture_shard(job, 0, 1); }

#define shard_len fixture_shard_len

/* The bytes as segments of `piece` bytes (the last one shorter), so that
 * with an odd piece 16-bit values straddle two segments. segs must hold
 * len / piece + 1 entries. */
static ps_segview pieces(const void *bytes, size_t len, size_t piece, ps_seg *segs) {
  int n = 0;
  for (size_t at = 0; at < len; at += piece)
    segs[n++] = (ps_seg){(const uint8_t *)bytes + at, len - at < piece ? len - at : piece};
  return (ps_segview){segs, n, len};
}

static int push_view(ps_shard *s, size_t count, const ps_segview *v, char *err) {
  uint64_t version, stale;
  return ps_shard_push(s, 0, ps_shard_begin(s), count, v, &version, &stale, err);
}

static int push_floats(ps_shard *s, const float *g, size_t count, char *err) {
  ps_seg seg = {(const uint8_t *)g, count * sizeof(float)};
  ps_segview v = {&seg, 1, seg.len};
  return push_view(s, count, &v, err);
}

/* A 16-bit push gives the parameters (and optimizer state, seen through a
 * second push) of a float32 push of the decoded values, bit for bit. */
static void check_same_as_fp32(const char *spec, ps_wire wire, const char *opt, size_t piece) {
  ps_job j16 = make_job(spec, opt, wire, 0), j32 = make_job(spec, opt, PS_WIRE_FP32, 0);
  ps_shard *s16 = make_shard(&j16), *s32 = make_shard(&j32);
  if (!s16 || !s32) goto done;
  size_t n = shard_len(s16);
  float *g = malloc(n * sizeof *g), *dec = malloc(n * sizeof *dec);
  float *p16 = malloc(n * sizeof *p16), *p32 = malloc(n * sizeof *p32);
  uint16_t *h = malloc(n * sizeof *h);
  ps_seg *segs = malloc((2 * n / piece + 2) * sizeof *segs);
  char err[PS_ERRLEN] = "";
  for (int round = 0; round < 2; round++) {
    for (size_t i = 0; i < n; i++) g[i] = sinf((float)(i + 1) * 0.37f + (float)round) * 0.01f;
    ps_half_encode(wire, g, h, n);
    ps_half_decode(wire, h, dec, n);
    ps_segview v = pieces(h, n * 2, piece, segs);
    CHECK_MSG(push_view(s16, n, &v, err) == PS_OK, "%s push: %s", ps_wire_name(wire), err);
    CHECK_MSG(push_floats(s32, dec, n, err) == PS_OK, "fp32 push: %s", err);
  }
  ps_shard_copy_params(s16, p16);
  ps_shard_copy_params(s32, p32);
  CHECK_MSG(memcmp(p16, p32, n * sizeof *p16) == 0,
            "%s (%s, %zu values, %zu-byte segments): parameters differ from float32's",
            ps_wire_name(wire), opt, n, piece);
  free(g);
  free(dec);
  free(p16);
  free(p32);
  free(h);
  free(segs);
done:
  ps_shard_destroy(s16);
  ps_shard_destroy(s32);
}

static void test_push_matches_fp32(void) {
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    check_same_as_fp32(SPEC, w, "adam", 2080);  /* one segment */
    check_same_as_fp32(SPEC, w, "momentum", 7); /* values split across segments */
    check_same_as_fp32(SPEC, w, "sgd", 1);
  }
  /* a large shard: two halves at once, the split inside a segment */
  check_same_as_fp32(BIG_SPEC, PS_WIRE_BF16, "adam", 65537);
}

/* sync: the step's mean of two 16-bit gradients, as of their decoded
 * values pushed as float32. */
static void test_sync(void) {
  ps_job j16 = make_job(SPEC, "momentum", PS_WIRE_FP16, 1);
  ps_job j32 = make_job(SPEC, "momentum", PS_WIRE_FP32, 1);
  ps_shard *s16 = make_shard(&j16), *s32 = make_shard(&j32);
  if (!s16 || !s32) goto done;
  size_t n = shard_len(s16);
  float g[1040], dec[1040], p16[1040], p32[1040];
  uint16_t h[1040];
  ps_seg segs[2 * 1040 / 3 + 2];
  char err[PS_ERRLEN] = "";
  for (uint64_t worker = 1; worker <= 2; worker++) {
    for (size_t i = 0; i < n; i++) g[i] = cosf((float)(i * worker)) * 0.1f;
    ps_half_encode(PS_WIRE_FP16, g, h, n);
    ps_half_decode(PS_WIRE_FP16, h, dec, n);
    ps_segview v16 = pieces(h, 2 * n, 3, segs);
    ps_seg seg = {(const uint8_t *)dec, n * 4};
    ps_segview v32 = {&seg, 1, n * 4};
    int dropped = 0, have = 0;
    CHECK(ps_shard_sync_add(s16, worker, 0, 0, n, &v16, &dropped, &have, err) == PS_OK);
    CHECK(ps_shard_sync_add(s32, worker, 0, 0, n, &v32, &dropped, &have, err) == PS_OK);
  }
  uint64_t v = 0;
  CHECK(ps_shard_sync_try_apply(s16, 2, 0, &v, err) == 1 && v == 1);
  CHECK(ps_shard_sync_try_apply(s32, 2, 0, &v, err) == 1 && v == 1);
  ps_shard_copy_params(s16, p16);
  ps_shard_copy_params(s32, p32);
  CHECK(memcmp(p16, p32, sizeof p16) == 0);
done:
  ps_shard_destroy(s16);
  ps_shard_destroy(s32);
}

/* Bad 16-bit input: refused with a message, counted, nothing changed. */
static void test_bad_input(void) {
  for (int wi = 0; wi < 2; wi++) {
    ps_wire w = wi ? PS_WIRE_FP16 : PS_WIRE_BF16;
    ps_job job = make_job(SPEC, "adam", w, 0);
    ps_shard *s = make_shard(&job);
    if (!s) continue;
    size_t n = shard_len(s);
    float before[1040], after[1040], g[1040];
    uint16_t h[1041];
    for (size_t i = 0; i < n; i++) g[i] = 0.01f;
    ps_half_encode(w, g, h, n);
    ps_shard_copy_params(s, before);
    char err[PS_ERRLEN] = "";
    ps_seg seg = {(const uint8_t *)h, 2 * n - 1}; /* odd */
    ps_segview v = {&seg, 1, seg.len};
    CHECK(push_view(s, n, &v, err) == PS_EINVAL);
    CHECK_MSG(strstr(err, "gradient has 2079 bytes, expected 2080 for 1040") &&
                  strstr(err, ps_wire_name(w)),
              "%s", err);
    seg.len = 2 * n + 2; /* one value too many */
    v.total = seg.len;
    CHECK(push_view(s, n, &v, err) == PS_EINVAL && strstr(err, "2082 bytes"));
    CHECK(push_floats(s, g, n, err) == PS_EINVAL && strstr(err, "4160 bytes")); /* float32 bytes */
    seg.len = v.total = 2 * n;
    uint16_t nan = w == PS_WIRE_BF16 ? 0x7fc0 : 0x7e00, inf = ps_half_nonfinite_bits(w);
    h[333] = nan;
    CHECK(push_view(s, n, &v, err) == PS_EINVAL);
    CHECK_MSG(strstr(err, "gradient value 333 (global index 333) is NaN"), "%s", err);
    h[333] = (uint16_t)(inf | 0x8000);
    CHECK(push_view(s, n, &v, err) == PS_EINVAL && strstr(err, "is -Inf"));
    h[333] = h[0];
    h[1039] = inf;
    CHECK(push_view(s, n, &v, err) == PS_EINVAL && strstr(err, "value 1039") &&
          strstr(err, "+Inf"));
    ps_shard_copy_params(s, after);
    ps_shard_stats st;
    ps_shard_stats_get(s, &st);
    CHECK(memcmp(before, after, sizeof before) == 0);
    CHECK(st.version == 0 && st.rejected == 6 && st.pushes == 0);
    /* and a good one is applied: the comparison above could fail */
    h[1039] = h[0];
    CHECK(push_view(s, n, &v, err) == PS_OK);
    ps_shard_copy_params(s, after);
    CHECK(memcmp(before, after, sizeof before) != 0);
    ps_shard_destroy(s);
  }
}

/* Error feedback, on the shard. SGD with lr 1 from parameters set to 0:
 * each push of g moves a parameter by -g. N pushes of the same gradient
 * move it by N*g with float32 on the wire; with a 16-bit wire and the
 * residual within half a 16-bit step of N*g; rounding each push alone
 * moves it by N*round(g), far off. Two gradients: 1 + 2^-9 in bf16 (which
 * rounds it to 1, losing 2^-9 each push), and 1e-8 in fp16 (below half
 * the smallest subnormal: rounded alone it is 0 and nothing moves). */
static double moved_by(ps_wire wire, float gv, int n_push, int feedback) {
  ps_job job = make_job(SPEC, "sgd", wire, 0);
  job.optim.lr = 1.0f;
  ps_shard *s = make_shard(&job);
  if (!s) return NAN;
  size_t n = shard_len(s);
  static float zero[1040], g[1040], res[1040], p[1040];
  static uint16_t h[1040];
  memset(zero, 0, sizeof zero);
  memset(res, 0, sizeof res);
  float *slots[1] = {NULL};
  ps_shard_restore_state(s, zero, slots, 0);
  for (size_t i = 0; i < n; i++) g[i] = gv;
  char err[PS_ERRLEN] = "";
  for (int k = 0; k < n_push; k++) {
    int rc;
    if (wire == PS_WIRE_FP32) {
      rc = push_floats(s, g, n, err);
    } else {
      if (feedback)
        ps_half_encode_feedback(wire, g, res, h, n);
      else
        ps_half_encode(wire, g, h, n);
      ps_seg seg = {(const uint8_t *)h, 2 * n};
      ps_segview v = {&seg, 1, seg.len};
      rc = push_view(s, n, &v, err);
    }
    CHECK_MSG(rc == PS_OK, "push %d: %s", k, err);
  }
  ps_shard_copy_params(s, p);
  ps_shard_destroy(s);
  size_t unlike = 0; /* every parameter moved alike */
  for (size_t i = 1; i < n; i++) unlike += p[i] != p[0];
  CHECK(unlike == 0);
  return -(double)p[0];
}

static void test_error_feedback(void) {
  const int N = 1000;
  /* half_step: half the 16-bit step near g; rtol: float32's own error in
   * the parameter, which adds 1e-8 to about 1e-5 a thousand times (1 + 2^-9
   * adds exactly) */
  struct {
    ps_wire wire;
    float g;
    double half_step, rtol;
  } cases[] = {{PS_WIRE_BF16, 1.0f + 0x1p-9f, 0x1p-8, 1e-7}, {PS_WIRE_FP16, 1e-8f, 0x1p-25, 1e-4}};
  for (int c = 0; c < 2; c++) {
    ps_wire w = cases[c].wire;
    double exact = (double)N * cases[c].g;
    double fp32 = moved_by(PS_WIRE_FP32, cases[c].g, N, 0);
    double fb = moved_by(w, cases[c].g, N, 1);
    double plain = moved_by(w, cases[c].g, N, 0);
    printf("%s, %d pushes of %g: exact %.9g, float32 %.9g, %s with residual %.9g, without %.9g\n",
           ps_wire_name(w), N, (double)cases[c].g, exact, fp32, ps_wire_name(w), fb, plain);
    double rtol = cases[c].rtol;
    CHECK_NEAR(fp32, exact, 0, rtol);
    /* with the residual: what is still held back is under half a step */
    CHECK_NEAR(fb, fp32, cases[c].half_step, 2 * rtol);
    /* without: every push loses its rounding error; the difference is
     * N times it, far beyond the tolerance above */
    double lost = fabs(plain - fp32);
    CHECK_MSG(lost > 100 * (cases[c].half_step + 2 * rtol * exact),
              "%s without the residual lost only %g", ps_wire_name(w), lost);
  }
}

/* The 16-bit encoding of a snapshot: made once per version and shared by
 * the pulls of it, and never stale: after an update in place, and in a
 * retired buffer used again, it is made anew. */
static int encoding_right(ps_shard *s, ps_snapshot *snap, ps_wire w) {
  static uint16_t want[1040];
  size_t bad = 0;
  const uint16_t *h = ps_shard_snapshot_encoded(s, snap, &bad);
  ps_half_encode(w, snap->values, want, snap->count);
  return h && bad == snap->count && memcmp(h, want, snap->count * sizeof *h) == 0;
}

static void test_snapshot_encoded(void) {
  ps_job job = make_job(SPEC, "sgd", PS_WIRE_BF16, 0);
  job.optim.lr = 1.0f;
  ps_shard *s = make_shard(&job);
  if (!s) return;
  size_t n = shard_len(s);
  char err[PS_ERRLEN] = "";
  float g[1040];
  for (size_t i = 0; i < n; i++) g[i] = 0.5f;
  ps_snapshot *a = ps_shard_pull(s, 0, n, err), *b = ps_shard_pull(s, 0, n, err);
  CHECK(a && a == b && encoding_right(s, a, PS_WIRE_BF16));
  const uint16_t *ha = ps_shard_snapshot_encoded(s, a, NULL);
  CHECK(ps_shard_snapshot_encoded(s, b, NULL) == ha); /* kept, not made again */
  CHECK(push_floats(s, g, n, err) == PS_EINVAL);      /* (float32 bytes: refused) */
  uint16_t h[1040];
  ps_half_encode(PS_WIRE_BF16, g, h, n);
  ps_seg seg = {(const uint8_t *)h, 2 * n};
  ps_segview v = {&seg, 1, 2 * n};
  CHECK(push_view(s, n, &v, err) == PS_OK); /* a and b held: a new snapshot */
  ps_snapshot *c = ps_shard_pull(s, 0, n, err);
  CHECK(c && c != a && encoding_right(s, c, PS_WIRE_BF16));
  ps_snapshot_unref(a);
  ps_snapshot_unref(b);
  ps_snapshot_unref(c);
  /* nothing held: the next update is made in place, in c's buffer */
  CHECK(push_view(s, n, &v, err) == PS_OK);
  ps_snapshot *d = ps_shard_pull(s, 0, n, err);
  CHECK_MSG(d == c && encoding_right(s, d, PS_WIRE_BF16),
            "after an update in place the encoding is %s", d == c ? "stale" : "(not in place)");
  /* held across each push: retired buffers come back, with their old
   * encodings, which must not be sent */
  int wrong = 0;
  for (int k = 0; k < 8; k++) {
    CHECK(push_view(s, n, &v, err) == PS_OK);
    ps_snapshot *e = ps_shard_pull(s, 0, n, err);
    wrong += !encoding_right(s, e, PS_WIRE_BF16);
    ps_snapshot_unref(d);
    d = e;
  }
  CHECK_MSG(wrong == 0, "%d pulls of reused buffers got a stale encoding", wrong);
  /* a part of the range: its own copy, encoded too */
  ps_snapshot *part = ps_shard_pull(s, 100, 7, err);
  CHECK(part && part->count == 7 && encoding_right(s, part, PS_WIRE_BF16));
  ps_snapshot_unref(part);
  ps_snapshot_unref(d);
  ps_shard_destroy(s);

  /* fp16: a parameter beyond its range is encoded as Inf, and said */
  job = make_job(SPEC, "sgd", PS_WIRE_FP16, 0);
  s = make_shard(&job);
  if (!s) return;
  float p[1040] = {0};
  p[77] = -70000.0f;
  float *slots[1] = {NULL};
  ps_shard_restore_state(s, p, slots, 3);
  ps_snapshot *f = ps_shard_pull(s, 0, n, err);
  size_t bad = 0;
  const uint16_t *hf = ps_shard_snapshot_encoded(s, f, &bad);
  CHECK(hf && bad == 77 && hf[77] == 0xfc00 && hf[78] == 0);
  ps_snapshot_unref(f);
  ps_shard_destroy(s);

  /* float32: nothing to encode */
  job = make_job(SPEC, "sgd", PS_WIRE_FP32, 0);
  s = make_shard(&job);
  if (!s) return;
  f = ps_shard_pull(s, 0, n, err);
  CHECK(ps_shard_snapshot_encoded(s, f, NULL) == NULL);
  ps_snapshot_unref(f);
  ps_shard_destroy(s);
}

/* The job file's "wire". */
static void test_job_key(void) {
#define JOB_BASE                                                                       \
  "{\"job_id\": \"j\", \"model\": {\"input\": [1, 2, 2], \"classes\": 2, \"layers\": " \
  "[{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 2}, "                    \
  "{\"type\": \"softmax_xent\"}]}%s}"
  struct {
    const char *extra;
    int ok;
    ps_wire want;
  } cases[] = {{"", 1, PS_WIRE_FP32},
               {", \"wire\": \"fp32\"", 1, PS_WIRE_FP32},
               {", \"wire\": \"bf16\"", 1, PS_WIRE_BF16},
               {", \"wire\": \"fp16\"", 1, PS_WIRE_FP16},
               {", \"wire\": \"fp8\"", 0, 0},
               {", \"wire\": \"BF16\"", 0, 0},
               {", \"wire\": 16", 0, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[512], err[PS_ERRLEN] = "";
    snprintf(text, sizeof text, JOB_BASE, cases[i].extra);
    ps_job job;
    int rc = ps_job_parse(text, &job, err);
    if (cases[i].ok) {
      CHECK_MSG(rc == PS_OK && job.wire == cases[i].want, "'%s': %s", cases[i].extra, err);
    } else {
      CHECK_MSG(rc == PS_EINVAL && strstr(err, "'wire'") && strstr(err, "fp32, bf16, fp16"),
                "'%s': %s", cases[i].extra, err);
    }
  }
  char err[PS_ERRLEN] = "";
  ps_job job;
  CHECK(ps_job_parse("{\"job_id\": \"j\", \"model\": {\"input\": [1, 2, 2], \"classes\": 2, "
                     "\"layers\": [{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 2}, "
                     "{\"type\": \"softmax_xent\"}]}, \"wire\": \"fp8\"}",
                     &job, err) == PS_EINVAL);
  printf("  %s\n", err);
}

int main(void) {
  RUN(test_job_key);
  RUN(test_push_matches_fp32);
  RUN(test_sync);
  RUN(test_bad_input);
  RUN(test_error_feedback);
  RUN(test_snapshot_encoded);
  return check_summary();
}

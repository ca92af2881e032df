/* The shard's state (ps/state/shard.c): creation, pushes given as scattered
 * segments, versions and staleness, statistics, shared snapshots, and the
 * refusal of bad input without any change of state. */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/half.h"
#include "common/model_spec.h"
#include "ps/state/shard.h"
#include "shard_fixture.h"

/* 8x8 inputs, one dense layer of 16: P = 64*16 + 16 = 1040. With S = 2 the
 * boundary P/2 = 520 is rounded down to 512, so shard 1 owns [512, 1040). */
static const char *SPEC =
    "{\"input\": [1, 8, 8], \"classes\": 16, \"layers\": ["
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 16},"
    "{\"type\": \"softmax_xent\"}]}";

static ps_job make_job(const char *optimizer) {
  return fixture_job("test-shard", SPEC, optimizer, 0);
}

static ps_shard *make_shard(const ps_job *job, int index) { return fixture_shard(job, index, 2); }

#define shard_len fixture_shard_len

/* Pushes count floats as one aligned segment. */
static int push_floats(ps_shard *s, uint64_t base, size_t offset, const float *g, size_t count,
                       uint64_t *version, uint64_t *stale, char *err) {
  ps_seg seg = {(const uint8_t *)g, count * sizeof(float)};
  ps_segview v = {&seg, 1, seg.len};
  return ps_shard_push(s, base, offset, count, &v, version, stale, err);
}

static void test_create(void) {
  ps_job job = make_job("adam");
  CHECK(job.model.n_params == 1040);
  ps_shard *s0 = make_shard(&job, 0), *s1 = make_shard(&job, 1);
  if (!s0 || !s1) goto done;
  /* The two ranges tile [0, P). */
  CHECK(ps_shard_begin(s0) == 0 && ps_shard_end(s0) == 512);
  CHECK(ps_shard_begin(s1) == 512 && ps_shard_end(s1) == 1040);
  CHECK(ps_shard_index(s0) == 0 && ps_shard_index(s1) == 1);
  /* Initial values do not depend on the sharding. */
  float all[1040], got[528];
  ps_model_init_params(&job.model, job.seed, 0, 1040, all);
  ps_shard_copy_params(s1, got);
  CHECK(memcmp(got, all + 512, 528 * sizeof(float)) == 0);
  ps_shard_stats st;
  ps_shard_stats_get(s1, &st);
  CHECK(st.version == 0 && st.pushes == 0 && st.pulls == 0 && st.rejected == 0);

  char err[PS_ERRLEN] = "";
  ps_job bad = make_job("rmsprop");
  CHECK(ps_shard_create(&bad, 0, 2, err) == NULL);
  CHECK_MSG(strstr(err, "unknown optimizer 'rmsprop'") != NULL, "%s", err);
  CHECK(ps_shard_create(&job, 2, 2, err) == NULL);
  CHECK_MSG(strstr(err, "shard index 2 invalid for 2 shards") != NULL, "%s", err);
  bad = make_job("adam");
  bad.optim.eps = 0.0f;
  CHECK(ps_shard_create(&bad, 0, 2, err) == NULL);
  CHECK_MSG(strstr(err, "eps") != NULL, "%s", err);
done:
  ps_shard_destroy(s0);
  ps_shard_destroy(s1);
}

/* Splits the bytes of g into segments at the given byte cuts, each segment
 * copied to an odd address so that no float in it is aligned. */
typedef struct {
  ps_seg segs[16];
  uint8_t *bufs[16];
  ps_segview view;
} scattered;

static void scatter(scattered *sc, const float *g, size_t count, const size_t *cuts, int ncuts) {
  const uint8_t *bytes = (const uint8_t *)g;
  size_t total = count * sizeof(float), at = 0;
  int n = 0;
  for (int i = 0; i <= ncuts; i++) {
    size_t to = i < ncuts ? cuts[i] : total;
    size_t len = to - at;
    sc->bufs[n] = malloc(len + 1);
    memcpy(sc->bufs[n] + 1, bytes + at, len);
    sc->segs[n].ptr = sc->bufs[n] + 1;
    sc->segs[n].len = len;
    n++;
    at = to;
  }
  sc->view.segs = sc->segs;
  sc->view.nsegs = n;
  sc->view.total = total;
}

static void unscatter(scattered *sc) {
  for (int i = 0; i < sc->view.nsegs; i++) free(sc->bufs[i]);
}

/* A gradient in odd pieces gives the same state as the same gradient in one
 * piece: for adam (two slots, bias corrections from the version), over
 * three pushes, each with a different split. */
static void test_push_segments(void) {
  ps_job job = make_job("adam");
  ps_shard *a = make_shard(&job, 1), *b = make_shard(&job, 1);
  if (!a || !b) goto done;
  enum { COUNT = 301 };
  size_t begin = ps_shard_begin(a), offset = begin + 3; /* not on a block boundary */
  float before[528], pa[528], pb[528], g[COUNT];
  ps_shard_copy_params(a, before);
  /* Cuts inside floats (1, 6, 13, 1203), a zero-length segment (6, 6),
   * whole-float cuts (40), and long runs that the staging buffer handles. */
  const size_t cuts[3][6] = {{1, 6, 6, 13, 40, 1203},
                             {2, 3, 400, 401, 402, 1199},
                             {4, 8, 12, 600, 1000, 1201}};
  for (int step = 0; step < 3; step++) {
    for (int i = 0; i < COUNT; i++) g[i] = sinf(0.37f * (float)i + (float)step) * 0.1f;
    char err[PS_ERRLEN] = "";
    uint64_t va = 0, vb = 0, sa = 9, sb = 9;
    CHECK(push_floats(a, (uint64_t)step, offset, g, COUNT, &va, &sa, err) == PS_OK);
    scattered sc;
    scatter(&sc, g, COUNT, cuts[step], 6);
    int rc = ps_shard_push(b, (uint64_t)step, offset, COUNT, &sc.view, &vb, &sb, err);
    CHECK_MSG(rc == PS_OK, "%s", err);
    unscatter(&sc);
    CHECK(va == (uint64_t)step + 1 && vb == va);
    CHECK(sa == 0 && sb == 0);
  }
  ps_shard_copy_params(a, pa);
  ps_shard_copy_params(b, pb);
  CHECK(memcmp(pa, pb, sizeof pa) == 0);
  /* Only [offset, offset+COUNT) moved. */
  size_t lo = offset - begin, hi = lo + COUNT, changed_outside = 0, unchanged_inside = 0;
  for (size_t i = 0; i < 528; i++) {
    int same = memcmp(&pa[i], &before[i], sizeof(float)) == 0;
    if (i < lo || i >= hi) changed_outside += !same;
    else unchanged_inside += same;
  }
  CHECK(changed_outside == 0);
  CHECK(unchanged_inside == 0);
done:
  ps_shard_destroy(a);
  ps_shard_destroy(b);
}

/* A push of the whole range to shard 0, which starts at 0. */
static void test_version_staleness_stats(void) {
  ps_job job = make_job("sgd");
  ps_shard *s = make_shard(&job, 0);
  if (!s) return;
  size_t n = shard_len(s);
  float *g = calloc(n, sizeof(float));
  char err[PS_ERRLEN] = "";
  uint64_t v = 0, st = 0;
  /* (base, expected staleness) at versions 0, 1, 2, 3 */
  const uint64_t base[4] = {0, 0, 5, 1}, want[4] = {0, 1, 0, 2};
  for (int i = 0; i < 4; i++) {
    CHECK(push_floats(s, base[i], 0, g, n, &v, &st, err) == PS_OK);
    CHECK(v == (uint64_t)i + 1);
    CHECK_MSG(st == want[i], "push %d: staleness %llu, expected %llu", i,
              (unsigned long long)st, (unsigned long long)want[i]);
  }
  ps_shard_stats stats;
  ps_shard_stats_get(s, &stats);
  CHECK(stats.version == 4 && stats.pushes == 4 && stats.rejected == 0);
  CHECK_NEAR(stats.staleness_mean, 0.75, 1e-12, 0); /* (0+1+0+2)/4 */
  CHECK(stats.staleness_max == 2);
  CHECK(stats.staleness_hist[0] == 2 && stats.staleness_hist[1] == 1 &&
        stats.staleness_hist[2] == 1);

  /* 70 more pushes from base 0 at versions 4..73: staleness 4..73; those of
   * 64 and more (10 of them) share the last bucket. */
  for (int i = 0; i < 70; i++) CHECK(push_floats(s, 0, 0, g, n, &v, &st, err) == PS_OK);
  ps_shard_stats_get(s, &stats);
  CHECK(stats.version == 74 && stats.pushes == 74);
  CHECK(stats.staleness_max == 73);
  CHECK(PS_STALENESS_BUCKETS == 65);
  CHECK(stats.staleness_hist[PS_STALENESS_BUCKETS - 1] == 10);
  CHECK(stats.staleness_hist[4] == 1 && stats.staleness_hist[30] == 1 &&
        stats.staleness_hist[63] == 1);
  uint64_t sum = 0;
  for (int i = 0; i < PS_STALENESS_BUCKETS; i++) sum += stats.staleness_hist[i];
  CHECK(sum == 74);
  /* mean of 0,1,0,2 and 4..73 = (3 + 2695) / 74 */
  CHECK_NEAR(stats.staleness_mean, 2698.0 / 74.0, 1e-9, 0);
  free(g);
  ps_shard_destroy(s);
}

static void test_snapshots(void) {
  ps_job job = make_job("momentum");
  ps_shard *s = make_shard(&job, 1);
  if (!s) return;
  size_t begin = ps_shard_begin(s), n = shard_len(s);
  float params[528];
  char err[PS_ERRLEN] = "";

  ps_snapshot *a = ps_shard_pull(s, begin, n, err);
  ps_snapshot *b = ps_shard_pull(s, begin, n, err);
  CHECK(a != NULL && b != NULL);
  if (!a || !b) goto done;
  CHECK(a == b);        /* same version: shared */
  CHECK(a->refs == 3);  /* two pulls and the shard's cache */
  CHECK(a->version == 0 && a->begin == begin && a->count == n);
  ps_shard_copy_params(s, params);
  CHECK(memcmp(a->values, params, n * sizeof(float)) == 0);

  /* A partial range is a private copy. */
  ps_snapshot *p = ps_shard_pull(s, begin + 5, 20, err);
  CHECK(p != NULL && p != a);
  if (p) {
    CHECK(p->refs == 1 && p->begin == begin + 5 && p->count == 20 && p->version == 0);
    CHECK(memcmp(p->values, params + 5, 20 * sizeof(float)) == 0);
  }

  /* After a push the next pull is a new snapshot; the old one still holds
   * the old values for whoever is sending it. */
  float g[528];
  for (size_t i = 0; i < n; i++) g[i] = 1.0f;
  CHECK(push_floats(s, 0, begin, g, n, NULL, NULL, err) == PS_OK);
  ps_snapshot *c = ps_shard_pull(s, begin, n, err);
  CHECK(c != NULL && c != a);
  if (c) {
    CHECK(c->version == 1);
    CHECK(c->refs == 2);
    CHECK(a->refs == 3); /* the two pulls, and the shard keeps it retired for reuse */
    CHECK(memcmp(a->values, params, n * sizeof(float)) == 0);
    /* momentum, first step: p -= lr * g = 0.05 */
    CHECK_NEAR(c->values[0], params[0] - 0.05f, 1e-6, 0);
  }
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.pulls == 4);

  /* Bad ranges. */
  CHECK(ps_shard_pull(s, begin - 1, 10, err) == NULL);
  CHECK_MSG(strstr(err, "pull range [511, 521) outside shard range [512, 1040)") != NULL, "%s",
            err);
  CHECK(ps_shard_pull(s, begin, n + 1, err) == NULL);
  CHECK_MSG(strstr(err, "pull range [512, 1041) outside") != NULL, "%s", err);
  CHECK(ps_shard_pull(s, (size_t)-4, 8, err) == NULL);
  CHECK_MSG(strstr(err, "overflows") != NULL, "%s", err);

  ps_snapshot_unref(a);
  ps_snapshot_unref(b);
  ps_snapshot_unref(p);
  ps_snapshot_unref(c);
  ps_snapshot_unref(NULL);

  /* Once no pull holds a retired snapshot, the next push writes into it
   * rather than allocating: a and c's buffers come round again. */
  ps_snapshot *seen[4];
  int reused = 0;
  for (int i = 0; i < 4; i++) {
    CHECK(push_floats(s, (uint64_t)i, begin, g, n, NULL, NULL, err) == PS_OK);
    seen[i] = ps_shard_pull(s, begin, n, err);
    reused += seen[i] == a || seen[i] == c;
    CHECK(seen[i] && seen[i]->version == (uint64_t)i + 2);
    ps_snapshot_unref(seen[i]);
  }
  CHECK(reused >= 1);
done:
  /* The cache's reference is dropped here; ASan reports any snapshot left. */
  ps_shard_destroy(s);
}

/* Each bad push: the code, the message, and nothing changed. */
typedef struct {
  const char *what;
  size_t offset, count;
  size_t bytes;     /* bytes handed in */
  int bad_at;       /* index to poison, or -1 */
  float bad_value;
  int want_rc;
  char want_msg[128];
} bad_case;

static void test_bad_input(void) {
  ps_job job = make_job("adam");
  ps_shard *s = make_shard(&job, 1), *ref = make_shard(&job, 1);
  if (!s || !ref) goto done;
  size_t begin = ps_shard_begin(s);
  float g[528], before[528], after[528];
  for (int i = 0; i < 528; i++) g[i] = 0.01f * (float)(i % 13) - 0.05f;

  /* One good push first, so that slots and version are not at their
   * initial values when the bad ones come. */
  char err[PS_ERRLEN] = "";
  CHECK(push_floats(s, 0, begin, g, 528, NULL, NULL, err) == PS_OK);
  CHECK(push_floats(ref, 0, begin, g, 528, NULL, NULL, err) == PS_OK);

  bad_case cases[] = {
      {"before range", 412, 100, 400, -1, 0, PS_ERANGE, ""},
      {"past range", 1000, 100, 400, -1, 0, PS_ERANGE, ""},
      {"short", 612, 100, 396, -1, 0, PS_EINVAL,
       "gradient has 396 bytes, expected 400 for 100 values"},
      {"long", 612, 100, 404, -1, 0, PS_EINVAL,
       "gradient has 404 bytes, expected 400 for 100 values"},
      {"NaN", 612, 100, 400, 17, NAN, PS_EINVAL, "gradient value 17 (global index 629) is NaN"},
      {"+Inf", 612, 100, 400, 99, INFINITY, PS_EINVAL,
       "gradient value 99 (global index 711) is +Inf"},
      {"-Inf", 612, 100, 400, 0, -INFINITY, PS_EINVAL,
       "gradient value 0 (global index 612) is -Inf"},
  };
  snprintf(cases[0].want_msg, sizeof cases[0].want_msg,
           "push range [412, 512) outside shard range [512, 1040)");
  snprintf(cases[1].want_msg, sizeof cases[1].want_msg,
           "push range [1000, 1100) outside shard range [512, 1040)");
  int ncases = (int)(sizeof cases / sizeof cases[0]);

  uint64_t rejected = 0;
  for (int k = 0; k < ncases; k++) {
    bad_case *c = &cases[k];
    float buf[128];
    for (int i = 0; i < 128; i++) buf[i] = g[i];
    if (c->bad_at >= 0) buf[c->bad_at] = c->bad_value;
    /* Twice: once in one segment, once split inside the bad float and at
     * odd addresses, so that the staged path is checked as well. */
    for (int split = 0; split < 2; split++) {
      ps_shard_copy_params(s, before);
      ps_shard_stats st0, st1;
      ps_shard_stats_get(s, &st0);
      ps_seg one = {(const uint8_t *)buf, c->bytes};
      ps_segview v1 = {&one, 1, c->bytes};
      scattered sc;
      size_t at = c->bad_at >= 0 ? (size_t)c->bad_at * 4 + 2 : 7;
      const size_t cuts[2] = {3, at > 3 ? at : 5};
      scatter(&sc, buf, 128, cuts, 2);
      sc.segs[sc.view.nsegs - 1].len -= 128 * 4 - c->bytes;
      sc.view.total = c->bytes;
      memset(err, 0, sizeof err);
      uint64_t v = 77, stale = 77;
      int rc = ps_shard_push(s, 1, c->offset, c->count, split ? &sc.view : &v1, &v, &stale, err);
      unscatter(&sc);
      rejected++;
      CHECK_MSG(rc == c->want_rc, "%s: rc %d", c->what, rc);
      CHECK_MSG(strstr(err, c->want_msg) != NULL, "%s: message '%s', expected '%s'", c->what,
                err, c->want_msg);
      CHECK_MSG(v == 77 && stale == 77, "%s: outputs written on error", c->what);
      ps_shard_copy_params(s, after);
      CHECK_MSG(memcmp(before, after, sizeof before) == 0, "%s: params changed", c->what);
      ps_shard_stats_get(s, &st1);
      CHECK_MSG(st1.version == st0.version && st1.pushes == st0.pushes, "%s: version moved",
                c->what);
      CHECK_MSG(st1.rejected == rejected, "%s: rejected %llu, expected %llu", c->what,
                (unsigned long long)st1.rejected, (unsigned long long)rejected);
    }
  }
  /* Overflowing range. */
  CHECK(push_floats(s, 1, (size_t)-8, g, 16, NULL, NULL, err) == PS_ERANGE);
  CHECK_MSG(strstr(err, "overflows") != NULL, "%s", err);
  rejected++;
  /* A view whose segments hold more than its total: applying it would run
   * past the pushed range. */
  ps_seg wide = {(const uint8_t *)g, 404};
  ps_segview lying = {&wide, 1, 400};
  CHECK(ps_shard_push(s, 1, 612, 100, &lying, NULL, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "gradient view says 400 bytes but its 1 segments hold 404") != NULL, "%s",
            err);
  rejected++;

  /* Slots and version untouched: the same good push now gives the shard
   * that saw the rejections exactly the state of one that never did (adam
   * reads both slots and t = version + 1). */
  CHECK(push_floats(s, 1, begin, g, 528, NULL, NULL, err) == PS_OK);
  CHECK(push_floats(ref, 1, begin, g, 528, NULL, NULL, err) == PS_OK);
  ps_shard_copy_params(s, after);
  ps_shard_copy_params(ref, before);
  CHECK(memcmp(before, after, sizeof before) == 0);
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.version == 2 && st.pushes == 2 && st.rejected == rejected);
done:
  ps_shard_destroy(s);
  ps_shard_destroy(ref);
}

/* ---- refused requests change nothing ---- */

/* What a refused request must leave as it was: parameters, optimizer
 * slots, version. */
typedef struct {
  size_t n;
  float *params, *slots[2];
  uint64_t version;
} shard_state;

static shard_state state_of(ps_shard *s) {
  shard_state st = {.n = shard_len(s)};
  st.params = malloc(st.n * sizeof(float));
  for (int k = 0; k < 2; k++) st.slots[k] = calloc(st.n, sizeof(float));
  ps_shard_export_state(s, st.params, st.slots, &st.version);
  return st;
}

static int state_equal(const shard_state *a, const shard_state *b) {
  size_t bytes = a->n * sizeof(float);
  return a->n == b->n && a->version == b->version && memcmp(a->params, b->params, bytes) == 0 &&
         memcmp(a->slots[0], b->slots[0], bytes) == 0 &&
         memcmp(a->slots[1], b->slots[1], bytes) == 0;
}

static int state_finite(const shard_state *a) {
  int ok = 1;
  for (size_t i = 0; i < a->n; i++)
    ok &= isfinite(a->params[i]) && isfinite(a->slots[0][i]) && isfinite(a->slots[1][i]);
  return ok;
}

static void state_free(shard_state *a) {
  free(a->params);
  free(a->slots[0]);
  free(a->slots[1]);
}

/* A push or pull of 0 values means nothing: refused, and the version does
 * not move. A shard whose range is empty (more shards than 16-value
 * blocks) still takes a push and a pull of its whole range. */
static void test_zero_count(void) {
  ps_job job = make_job("momentum");
  ps_shard *s = make_shard(&job, 0);
  if (!s) return;
  char err[PS_ERRLEN] = "";
  float g[1] = {1.0f};
  shard_state before = state_of(s);
  CHECK(push_floats(s, 0, 16, g, 0, NULL, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "push of 0 values at offset 16") != NULL, "%s", err);
  ps_segview none = {NULL, 0, 0};
  CHECK(ps_shard_push(s, 0, 0, 0, &none, NULL, NULL, err) == PS_EINVAL);
  CHECK(ps_shard_push(s, 0, 0, 0, NULL, NULL, NULL, err) == PS_EINVAL);
  CHECK(ps_shard_pull(s, 16, 0, err) == NULL);
  CHECK_MSG(strstr(err, "pull of 0 values at offset 16") != NULL, "%s", err);
  shard_state after = state_of(s);
  CHECK(state_equal(&before, &after));
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.version == 0 && st.rejected == 3 && st.pushes == 0);
  state_free(&before);
  state_free(&after);
  ps_shard_destroy(s);

  /* P = 1040 over 100 shards: some own nothing. */
  int empty = -1;
  for (int i = 0; i < 100 && empty < 0; i++) {
    size_t b, e;
    ps_shard_range(job.model.n_params, 100, i, &b, &e);
    if (b == e) empty = i;
  }
  CHECK(empty >= 0);
  s = ps_shard_create(&job, empty, 100, err);
  CHECK_MSG(s != NULL, "%s", err);
  if (!s) return;
  uint64_t v = 0;
  CHECK(ps_shard_push(s, 0, ps_shard_begin(s), 0, &none, &v, NULL, err) == PS_OK && v == 1);
  ps_snapshot *snap = ps_shard_pull(s, ps_shard_begin(s), 0, err);
  CHECK(snap != NULL && snap->count == 0);
  ps_snapshot_unref(snap);
  ps_shard_destroy(s);
}

/* The defect an outside client found: two pushes of FLT_MAX with momentum.
 * Each value is finite, but the second would make every velocity +Inf
 * (0.9*FLT_MAX + FLT_MAX) and every parameter -Inf: refused whole, parameters, slots and version as
 * they were, whether the update would have gone in place or into the next
 * snapshot (a pull holding the current one). */
static void test_flt_max_momentum(void) {
  ps_job job = make_job("momentum");
  ps_shard *s = make_shard(&job, 0);
  if (!s) return;
  size_t n = shard_len(s);
  char err[PS_ERRLEN] = "";
  float g[512];
  for (size_t i = 0; i < n; i++) g[i] = FLT_MAX;
  uint64_t v = 0;
  CHECK(push_floats(s, 0, 0, g, n, &v, NULL, err) == PS_OK && v == 1);
  shard_state one = state_of(s);
  CHECK(state_finite(&one));
  for (int hold = 0; hold < 2; hold++) {
    ps_snapshot *snap = hold ? ps_shard_pull(s, 0, n, err) : NULL;
    CHECK(push_floats(s, 1, 0, g, n, &v, NULL, err) == PS_EINVAL);
    CHECK_MSG(strstr(err,
                     "update refused: with optimizer momentum it would make parameter 0 "
                     "(global index) -Inf (gradient value 3.40282e+38 there)") != NULL,
              "%s", err);
    shard_state now = state_of(s);
    CHECK_MSG(state_equal(&one, &now), "hold %d: state changed", hold);
    state_free(&now);
    if (snap) CHECK(memcmp(snap->values, one.params, n * sizeof(float)) == 0);
    ps_snapshot_unref(snap);
  }
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.version == 1 && st.pushes == 1 && st.rejected == 2);
  /* Near the edge but finite: checked value by value, and applied exactly
   * as the formula says (v = 0.9v - FLT_MAX, p -= lr*v). */
  for (size_t i = 0; i < n; i++) g[i] = -FLT_MAX;
  CHECK(push_floats(s, 1, 0, g, n, &v, NULL, err) == PS_OK && v == 2);
  shard_state two = state_of(s);
  int exact = 1;
  for (size_t i = 0; i < n; i++) {
    float vel = job.optim.momentum * one.slots[0][i] + g[i];
    exact &= two.slots[0][i] == vel && two.params[i] == one.params[i] - job.optim.lr * vel;
  }
  CHECK(exact);
  state_free(&one);
  state_free(&two);
  ps_shard_destroy(s);
}

/* Every optimizer, pushed towards overflow by -FLT_MAX gradients over the
 * whole range or a part, in place or into the next snapshot: each push is
 * applied while everything stays finite, and the first that would make a
 * value non-finite is refused with nothing changed. */
static void test_finite_results(void) {
  const char *names[] = {"sgd", "momentum", "momentum", "adagrad", "adam"};
  for (int o = 0; o < 5; o++) {
    for (int part = 0; part < 2; part++) {
      for (int hold = 0; hold < 2; hold++) {
        ps_job job = make_job(names[o]);
        job.optim.nesterov = o == 2;
        ps_shard *s = make_shard(&job, 1);
        if (!s) return;
        size_t off = ps_shard_begin(s) + (part ? 100 : 0), cnt = part ? 50 : shard_len(s);
        float g[528];
        for (size_t i = 0; i < cnt; i++) g[i] = i % 3 ? -FLT_MAX : -FLT_MAX / 2;
        char err[PS_ERRLEN] = "";
        int refused = 0, pushes = 0;
        while (!refused && pushes < 40) {
          shard_state before = state_of(s);
          ps_snapshot *snap = hold ? ps_shard_pull(s, ps_shard_begin(s), shard_len(s), err) : NULL;
          int rc = push_floats(s, before.version, off, g, cnt, NULL, NULL, err);
          ps_snapshot_unref(snap);
          shard_state after = state_of(s);
          if (rc == PS_OK) {
            pushes++;
            CHECK_MSG(state_finite(&after), "%s part %d hold %d: push %d made a value non-finite",
                      names[o], part, hold, pushes);
          } else {
            refused = 1;
            CHECK_MSG(rc == PS_EINVAL && strstr(err, "would make") != NULL, "%s: %d %s", names[o],
                      rc, err);
            CHECK_MSG(state_equal(&before, &after), "%s part %d hold %d: a refusal changed state",
                      names[o], part, hold);
          }
          state_free(&before);
          state_free(&after);
        }
        CHECK_MSG(refused, "%s part %d hold %d: %d pushes, none refused", names[o], part, hold,
                  pushes);
        ps_shard_destroy(s);
      }
    }
  }
}

/* A push split over two threads: a value that would overflow in either
 * half is found, named by its index, and changes nothing. */
static void test_split_overflow(void) {
  ps_job job = make_job("momentum");
  char err[PS_ERRLEN] = "";
  /* 64x64 inputs, dense 256: P = 4096*256 + 256 = 1048832, just above SPLIT_MIN */
  int rc = ps_model_spec_parse(
      "{\"input\": [1, 64, 64], \"classes\": 256, \"layers\": ["
      "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 256},"
      "{\"type\": \"softmax_xent\"}]}",
      &job.model, err);
  CHECK_MSG(rc == 0, "%s", err);
  ps_shard *s = ps_shard_create(&job, 0, 1, err);
  if (!s) return;
  size_t n = shard_len(s);
  CHECK(n >= (1u << 20));
  float *g = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) g[i] = 0.001f;
  for (size_t bad_at = n / 4; bad_at < n; bad_at += n / 2) {
    g[bad_at] = FLT_MAX;
    shard_state before = state_of(s);
    CHECK(push_floats(s, 0, 0, g, n, NULL, NULL, err) == PS_OK); /* v = FLT_MAX there */
    shard_state one = state_of(s);
    CHECK(push_floats(s, 0, 0, g, n, NULL, NULL, err) == PS_EINVAL);
    char want[96];
    snprintf(want, sizeof want, "would make parameter %zu (global index) -Inf", bad_at);
    CHECK_MSG(strstr(err, want) != NULL, "%s", err);
    shard_state now = state_of(s);
    CHECK(state_equal(&one, &now));
    /* back to small values: the shard's bounds are exact again */
    g[bad_at] = -FLT_MAX;
    CHECK(push_floats(s, 0, 0, g, n, NULL, NULL, err) == PS_OK);
    g[bad_at] = 0.001f;
    state_free(&before);
    state_free(&one);
    state_free(&now);
  }
  free(g);
  ps_shard_destroy(s);
}

/* sync: a gradient that would overflow the step's sum is refused (the sum
 * as it was); one that brings it back from the edge is taken; a step whose
 * result would not be finite is refused, its gradients dropped, and
 * parameters, slots and version stay as they were. */
static void test_sync_overflow(void) {
  ps_job job = make_job("sgd");
  job.mode_kind = PS_MODE_SYNC;
  ps_shard *s = make_shard(&job, 0);
  if (!s) return;
  size_t n = shard_len(s);
  char err[PS_ERRLEN] = "";
  float big[512], neg[512];
  for (size_t i = 0; i < n; i++) {
    big[i] = FLT_MAX;
    neg[i] = -FLT_MAX;
  }
  ps_seg sb = {(const uint8_t *)big, n * 4}, sn = {(const uint8_t *)neg, n * 4};
  ps_segview vb = {&sb, 1, n * 4}, vn = {&sn, 1, n * 4};
  int dropped = -1, have = -1;
  uint64_t ver = 0;
  shard_state start = state_of(s);
  CHECK(ps_shard_sync_add(s, 1, 0, 0, n, &vb, &dropped, &have, err) == 0 && have == 1);
  CHECK(ps_shard_sync_add(s, 2, 0, 0, n, &vb, &dropped, &have, err) == PS_EINVAL);
  CHECK_MSG(strstr(err,
                   "adding it to the step's sum (of 1 gradients) would make value 0 (global "
                   "index 0) +Inf") != NULL,
            "%s", err);
  CHECK(ps_shard_sync_add(s, 2, 0, 0, n, &vn, &dropped, &have, err) == 0 && have == 2);
  CHECK(ps_shard_sync_try_apply(s, 2, 0, &ver, err) == 1 && ver == 1); /* the mean is 0 */
  shard_state one = state_of(s);
  CHECK(memcmp(one.params, start.params, n * sizeof(float)) == 0);
  /* Steps of -FLT_MAX: p grows by lr*FLT_MAX each, until a step would
   * overflow. */
  int rc = 1;
  uint64_t steps = 1;
  shard_state before = state_of(s);
  while (rc == 1 && steps < 40) {
    state_free(&before);
    before = state_of(s);
    CHECK(ps_shard_sync_add(s, 1, steps, 0, n, &vn, &dropped, &have, err) == 0 && have == 1);
    rc = ps_shard_sync_try_apply(s, 1, 0, &ver, err);
    steps += rc == 1;
  }
  CHECK_MSG(rc == PS_EINVAL && strstr(err,
                                      "step of 1 gradients refused and dropped: update "
                                      "refused") != NULL,
            "%d %s", rc, err);
  shard_state now = state_of(s);
  CHECK(state_equal(&before, &now) && state_finite(&now));
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.sync_pending == 0 && st.dropped == 1 && st.rejected == 1 && st.version == steps);
  /* the next step begins afresh */
  CHECK(ps_shard_sync_add(s, 1, steps, 0, n, &vb, &dropped, &have, err) == 0 && have == 1);
  CHECK(ps_shard_sync_try_apply(s, 1, 0, &ver, err) == 1 && ver == steps + 1);
  state_free(&start);
  state_free(&one);
  state_free(&before);
  state_free(&now);
  ps_shard_destroy(s);
}

/* Pushes and pulls from several threads: every push is applied exactly
 * once. With sgd and a gradient of 1 everywhere every push is the same
 * `p -= 0.25`, so whatever the interleaving the result is that operation
 * repeated, bit for bit. */
typedef struct {
  ps_shard *s;
  int pushes;
  int failures;
} worker_arg;

static void *worker(void *p) {
  worker_arg *w = p;
  size_t begin = ps_shard_begin(w->s), n = shard_len(w->s);
  float *g = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) g[i] = 1.0f;
  char err[PS_ERRLEN];
  for (int i = 0; i < w->pushes; i++) {
    if (push_floats(w->s, 0, begin, g, n, NULL, NULL, err) != PS_OK) w->failures++;
    ps_snapshot *snap = ps_shard_pull(w->s, begin, n, err);
    if (!snap) w->failures++;
    ps_snapshot_unref(snap);
  }
  free(g);
  return NULL;
}

static void test_threads(void) {
  ps_job job = make_job("sgd");
  job.optim.lr = 0.25f;
  ps_shard *s = make_shard(&job, 0);
  if (!s) return;
  size_t n = shard_len(s);
  float init[512], got[512];
  ps_shard_copy_params(s, init);
  enum { T = 4, PUSHES = 50 };
  pthread_t th[T];
  worker_arg args[T];
  for (int i = 0; i < T; i++) {
    args[i] = (worker_arg){s, PUSHES, 0};
    pthread_create(&th[i], NULL, worker, &args[i]);
  }
  int failures = 0;
  for (int i = 0; i < T; i++) {
    pthread_join(th[i], NULL);
    failures += args[i].failures;
  }
  CHECK(failures == 0);
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.version == T * PUSHES && st.pushes == T * PUSHES && st.pulls == T * PUSHES);
  ps_shard_copy_params(s, got);
  int exact = 1;
  for (size_t i = 0; i < n; i++) {
    float want = init[i];
    for (int k = 0; k < T * PUSHES; k++) want -= 0.25f;
    if (got[i] != want) exact = 0;
  }
  CHECK(exact);
  ps_shard_destroy(s);
}

/* Whether two shards of one range hold the same parameters, within
 * float32 rounding of one update (1e-6 relative). */
static int same_params(ps_shard *x, ps_shard *y) {
  float a[512], b[512];
  size_t n = shard_len(x);
  ps_shard_copy_params(x, a);
  ps_shard_copy_params(y, b);
  int same = 1;
  for (size_t i = 0; i < n; i++) same &= fabsf(a[i] - b[i]) <= 1e-6f * fmaxf(1.0f, fabsf(b[i]));
  return same;
}

/* A sync step with fewer gradients than the workers it is for (the others
 * wait for data): its sum is divided by the workers, so that it equals one
 * push of g / 4 on an async shard, and a divisor below the gradients in
 * the step divides by the gradients (the mean). */
static void test_sync_divisor(void) {
  ps_job job = make_job("sgd");
  job.mode_kind = PS_MODE_SYNC;
  ps_shard *s = make_shard(&job, 0), *ref = make_shard(&job, 0);
  if (!s || !ref) goto done;
  size_t n = shard_len(s);
  char err[PS_ERRLEN] = "";
  float g[512], quarter[512], half[512];
  for (size_t i = 0; i < n; i++) {
    g[i] = 0.5f + (float)i * 0.001f;
    quarter[i] = g[i] / 4.0f;
    half[i] = g[i];
  }
  ps_seg sg = {(const uint8_t *)g, n * 4};
  ps_segview v = {&sg, 1, n * 4};
  int dropped = -1, have = -1;
  uint64_t ver = 0;
  CHECK(ps_shard_sync_add(s, 101, 0, 0, n, &v, &dropped, &have, err) == 0 && have == 1);
  CHECK_MSG(ps_shard_sync_try_apply(s, 1, 4, &ver, err) == 1 && ver == 1, "%s", err);
  CHECK(push_floats(ref, 0, 0, quarter, n, NULL, NULL, err) == PS_OK);
  CHECK_MSG(same_params(s, ref), "one gradient of four workers: not g / 4");
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.sync_short_steps == 1);
  /* two gradients, divisor 1: their mean (g), not their sum */
  CHECK(ps_shard_sync_add(s, 101, 1, 0, n, &v, &dropped, &have, err) == 0);
  CHECK(ps_shard_sync_add(s, 102, 1, 0, n, &v, &dropped, &have, err) == 0 && have == 2);
  CHECK(ps_shard_sync_try_apply(s, 2, 1, &ver, err) == 1 && ver == 2);
  CHECK(push_floats(ref, 1, 0, half, n, NULL, NULL, err) == PS_OK);
  CHECK_MSG(same_params(s, ref), "two gradients, divisor 1: not their mean");
  ps_shard_stats_get(s, &st);
  CHECK(st.sync_short_steps == 1); /* a full step is not counted */
done:
  ps_shard_destroy(s);
  ps_shard_destroy(ref);
}

/* sync mode: gradients of one step are summed and their mean applied once;
 * late and duplicate gradients are dropped and counted; a bad one changes
 * nothing. */
static void test_sync_steps(void) {
  ps_job job = make_job("sgd");
  job.mode_kind = PS_MODE_SYNC;
  ps_shard *s = make_shard(&job, 0), *ref = make_shard(&job, 0);
  if (!s || !ref) goto done;
  size_t n = shard_len(s);
  char err[PS_ERRLEN] = "";
  float g1[512], g2[512], mean[512];
  for (size_t i = 0; i < n; i++) {
    g1[i] = 0.5f + (float)i * 0.001f;
    g2[i] = -0.25f + (float)(i % 7) * 0.01f;
    mean[i] = (g1[i] + g2[i]) / 2.0f;
  }
  ps_seg sg1 = {(const uint8_t *)g1, n * 4}, sg2 = {(const uint8_t *)g2, n * 4};
  ps_segview v1 = {&sg1, 1, n * 4}, v2 = {&sg2, 1, n * 4};
  int dropped = -1, have = -1;
  uint64_t ver = 0;
  CHECK(ps_shard_sync_add(s, 101, 0, 0, n, &v1, &dropped, &have, err) == 0);
  CHECK(dropped == 0 && have == 1);
  CHECK(ps_shard_sync_try_apply(s, 2, 0, &ver, err) == 0); /* quorum not reached */
  /* the same worker again: dropped, the step unchanged */
  CHECK(ps_shard_sync_add(s, 101, 0, 0, n, &v2, &dropped, &have, err) == 0);
  CHECK(dropped == 1 && have == 1);
  /* a NaN: refused, nothing added */
  g2[3] = NAN;
  CHECK(ps_shard_sync_add(s, 102, 0, 0, n, &v2, &dropped, &have, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "NaN") != NULL, "%s", err);
  g2[3] = -0.25f + 3 * 0.01f;
  /* a part of the range: refused */
  CHECK(ps_shard_sync_add(s, 102, 0, 0, n - 16, &v2, &dropped, &have, err) == PS_ERANGE);
  CHECK(ps_shard_sync_add(s, 102, 0, 0, n, &v2, &dropped, &have, err) == 0);
  CHECK(dropped == 0 && have == 2);
  CHECK(ps_shard_sync_try_apply(s, 2, 0, &ver, err) == 1 && ver == 1);
  /* equals one push of the mean on a shard in async mode */
  CHECK(push_floats(ref, 0, 0, mean, n, NULL, NULL, err) == PS_OK);
  CHECK(same_params(s, ref));
  /* a late gradient of step 0, now that step 1 is under way: dropped */
  CHECK(ps_shard_sync_add(s, 103, 0, 0, n, &v1, &dropped, &have, err) == 0);
  CHECK(dropped == 1 && have == 0);
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.version == 1 && st.dropped == 2 && st.rejected == 2 && st.pushes == 2);
done:
  ps_shard_destroy(s);
  ps_shard_destroy(ref);
}

/* staleness_aware_lr: a push k versions stale moves the parameters with lr/k. */
static void test_staleness_aware_lr(void) {
  ps_job job = make_job("sgd");
  job.staleness_aware_lr = 1;
  ps_shard *s = make_shard(&job, 0);
  if (!s) return;
  size_t n = shard_len(s);
  char err[PS_ERRLEN] = "";
  float g[512], before[512], after[512];
  for (size_t i = 0; i < n; i++) g[i] = 1.0f;
  for (int i = 0; i < 4; i++) CHECK(push_floats(s, (uint64_t)i, 0, g, n, NULL, NULL, err) == 0);
  ps_shard_copy_params(s, before);
  uint64_t st = 0;
  CHECK(push_floats(s, 0, 0, g, n, NULL, &st, err) == 0); /* 4 versions stale */
  CHECK(st == 4);
  ps_shard_copy_params(s, after);
  /* sgd: p -= (0.05 / 4) * 1 */
  CHECK_NEAR(before[0] - after[0], 0.0125, 1e-6, 0);
  ps_shard_destroy(s);
}

/* A shard large enough that pushes are checked and applied in two halves
 * on two threads: the result equals the plain formula, and a bad value in
 * either half is found, reported by its index, and changes nothing. */
static void test_split_push(void) {
  ps_job job = make_job("sgd");
  char err[PS_ERRLEN] = "";
  /* 64x64 inputs, dense 600: P = 4096*600 + 600 = 2458200 */
  CHECK(ps_model_spec_parse("{\"input\": [1, 64, 64], \"classes\": 10, \"layers\": ["
                            "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 600},"
                            "{\"type\": \"dense\", \"units\": 10}, {\"type\": \"softmax_xent\"}]}",
                            &job.model, err) == 0);
  ps_shard *s = ps_shard_create(&job, 0, 1, err);
  if (!s) return;
  size_t n = shard_len(s);
  CHECK(n > (2u << 20));
  float *g = malloc(n * sizeof(float)), *p0 = malloc(n * sizeof(float)),
        *p1 = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) g[i] = (float)(i % 13) * 0.01f - 0.05f;
  ps_shard_copy_params(s, p0);
  /* misaligned, in uneven segments: both halves cross segment boundaries */
  uint8_t *raw = malloc(n * 4 + 3);
  memcpy(raw + 3, g, n * 4);
  ps_seg segs[3] = {{raw + 3, 1000003}, {raw + 3 + 1000003, n * 2 - 1000003},
                    {raw + 3 + n * 2, n * 2}};
  ps_segview v = {segs, 3, n * 4};
  for (size_t bad_at = n / 4; bad_at < n; bad_at += n / 2) {
    float nan = NAN;
    memcpy(raw + 3 + bad_at * 4, &nan, 4);
    CHECK(ps_shard_push(s, 0, 0, n, &v, NULL, NULL, err) == PS_EINVAL);
    char want[128];
    snprintf(want, sizeof want, "gradient value %zu (global index %zu) is NaN", bad_at, bad_at);
    CHECK_MSG(strstr(err, want) != NULL, "%s", err);
    ps_shard_copy_params(s, p1);
    CHECK(memcmp(p0, p1, n * sizeof(float)) == 0);
    memcpy(raw + 3 + bad_at * 4, &g[bad_at], 4);
  }
  CHECK(ps_shard_push(s, 0, 0, n, &v, NULL, NULL, err) == 0);
  ps_shard_copy_params(s, p1);
  int same = 1;
  for (size_t i = 0; i < n; i++) same &= p1[i] == p0[i] - job.optim.lr * g[i];
  CHECK(same);
  free(raw);
  free(g);
  free(p0);
  free(p1);
  ps_shard_destroy(s);
}

/* batchnorm's moving statistics: a push's values there are averaged in
 * with the layer's momentum (slots untouched), the rest trained; a
 * negative batch variance is refused with nothing changed, on the float32
 * and the 16-bit wire; a sync step averages the workers' statistics. */
static const char *BN_SPEC =
    "{\"input\": [1, 8, 8], \"classes\": 10, \"layers\": ["
    "{\"type\": \"conv2d\", \"filters\": 4, \"kernel\": 3, \"bias\": false},"
    "{\"type\": \"batchnorm\", \"momentum\": 0.75}, {\"type\": \"relu\"},"
    "{\"type\": \"flatten\"}, {\"type\": \"dense\", \"units\": 10},"
    "{\"type\": \"softmax_xent\"}]}";

static void test_moving_stats(void) {
  ps_job job = fixture_job("test-bn", BN_SPEC, "momentum", 0);
  ps_shard *s = fixture_shard(&job, 0, 1);
  if (!s) return;
  const ps_layer *bn = &job.model.layers[1];
  const size_t n = shard_len(s), mean = bn->s_off, var = bn->s_off + 4;
  CHECK(bn->type == PS_LAYER_BATCHNORM && mean == 36 + 8 && n == job.model.n_params);
  char err[PS_ERRLEN] = "";
  float *g = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) g[i] = 0.01f * (float)(i % 13) - 0.05f;
  for (int k = 0; k < 4; k++) {
    g[mean + k] = 2.0f + (float)k;  /* batch means */
    g[var + k] = 0.5f * (float)k;   /* batch variances, one of them 0 */
  }
  shard_state before = state_of(s);
  uint64_t v = 0;
  CHECK(push_floats(s, 0, 0, g, n, &v, NULL, err) == PS_OK && v == 1);
  shard_state after = state_of(s);
  int ok = 1;
  for (size_t i = 0; i < n; i++) {
    const int moving = i >= mean && i < var + 4;
    float want_p, want_v = before.slots[0][i];
    if (moving) {
      want_p = 0.75f * before.params[i] + (1.0f - 0.75f) * g[i];
    } else {
      want_v = job.optim.momentum * before.slots[0][i] + g[i];
      want_p = before.params[i] - job.optim.lr * want_v;
    }
    ok &= after.params[i] == want_p && after.slots[0][i] == want_v;
  }
  CHECK_MSG(ok, "moving statistics averaged in, everything else trained");
  CHECK(after.params[mean] == 0.25f * 2.0f && after.params[var] == 0.75f);

  /* A negative batch variance: refused whole, nothing changes. */
  g[var + 2] = -0.5f;
  CHECK(push_floats(s, 1, 0, g, n, &v, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "gradient value 50 (global index 50) is -0.5, in a batch variance "
                        "(batchnorm's moving variance [48, 52)), which cannot be negative") != NULL,
            "%s", err);
  /* A push of a part of the range is checked where it overlaps. */
  CHECK(push_floats(s, 1, var + 1, g + var + 1, 8, &v, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "gradient value 1 (global index 50)") != NULL, "%s", err);
  CHECK(push_floats(s, 1, var + 3, g + var + 3, 8, &v, NULL, err) == PS_OK && v == 2);
  ps_shard_destroy(s);

  /* The same on the 16-bit wire. */
  job.wire = PS_WIRE_FP16;
  s = fixture_shard(&job, 0, 1);
  shard_state w0 = state_of(s);
  uint16_t *h = malloc(n * sizeof(uint16_t));
  ps_half_encode(PS_WIRE_FP16, g, h, n);
  ps_seg seg = {(const uint8_t *)h, n * 2};
  ps_segview view = {&seg, 1, n * 2};
  CHECK(ps_shard_push(s, 0, 0, n, &view, &v, NULL, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "which cannot be negative") != NULL, "%s", err);
  shard_state w1 = state_of(s);
  CHECK(state_equal(&w0, &w1));
  ps_shard_stats st;
  ps_shard_stats_get(s, &st);
  CHECK(st.rejected == 1 && st.version == 0);
  ps_shard_destroy(s);

  /* Sync: the step applies the mean of the workers' statistics. */
  job = fixture_job("test-bn", BN_SPEC, "sgd", 1);
  s = fixture_shard(&job, 0, 1);
  g[var + 2] = 1.0f;
  float *g2 = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) g2[i] = g[i];
  for (int k = 0; k < 4; k++) g2[mean + k] = -1.0f, g2[var + k] = 3.0f;
  ps_seg s1 = {(const uint8_t *)g, n * 4}, s2 = {(const uint8_t *)g2, n * 4};
  ps_segview v1 = {&s1, 1, n * 4}, v2 = {&s2, 1, n * 4};
  int dropped, have;
  CHECK(ps_shard_sync_add(s, 1, 0, 0, n, &v1, &dropped, &have, err) == 0);
  CHECK(ps_shard_sync_add(s, 2, 0, 0, n, &v2, &dropped, &have, err) == 0 && have == 2);
  CHECK(ps_shard_sync_try_apply(s, 2, 0, &v, err) == 1 && v == 1);
  float *p = malloc(n * sizeof(float));
  ps_shard_copy_params(s, p);
  ok = 1;
  for (int k = 0; k < 4; k++) {
    const float m = (g[mean + k] + g2[mean + k]) * 0.5f, q = (g[var + k] + g2[var + k]) * 0.5f;
    ok &= fabsf(p[mean + k] - 0.25f * m) < 1e-6f && fabsf(p[var + k] - (0.75f + 0.25f * q)) < 1e-6f;
  }
  CHECK_MSG(ok, "sync: the moving statistics take the workers' mean");
  ps_shard_destroy(s);
  free(g), free(g2), free(h), free(p);
  state_free(&before), state_free(&after), state_free(&w0), state_free(&w1);
}

int main(void) {
  RUN(test_split_push);
  RUN(test_moving_stats);
  RUN(test_sync_steps);
  RUN(test_sync_divisor);
  RUN(test_staleness_aware_lr);
  RUN(test_create);
  RUN(test_push_segments);
  RUN(test_version_staleness_stats);
  RUN(test_snapshots);
  RUN(test_bad_input);
  RUN(test_zero_count);
  RUN(test_flt_max_momentum);
  RUN(test_finite_results);
  RUN(test_split_overflow);
  RUN(test_sync_overflow);
  RUN(test_threads);
  return check_summary();
}

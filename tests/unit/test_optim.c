/* The optimizers of ps/optim.c against steps worked out by hand.
 *
 * Tolerances: the optimizers compute in float32, so a value near 1 carries
 * about 6e-8 of rounding per operation; a few steps of a few operations
 * stay well below the 2e-6 used here, while any mistake in a formula (a
 * missing bias correction, eps in the wrong place, nesterov's extra term)
 * moves the result by 1e-3 or more. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "check.h"
#include "common/optim.h"
#include "common/rng.h"

#define TOL 2e-6

static ps_optim_config config(const char *name) {
  ps_optim_config c;
  memset(&c, 0, sizeof c);
  strcpy(c.name, name);
  c.lr = 0.1f;
  c.momentum = 0.9f;
  c.beta1 = 0.9f;
  c.beta2 = 0.999f;
  c.eps = 1e-8f;
  c.initial_accumulator = 0.1f;
  return c;
}

/* One update of a single parameter with its slots. */
static void step1(const ps_optimizer *o, const ps_optim_config *c, uint64_t t, float *p,
                  float *slot_vals, float g) {
  float *slots[2] = {&slot_vals[0], &slot_vals[1]};
  o->apply(c, t, c->lr, p, slots, &g, 1);
}

static void test_table(void) {
  const char *names[] = {"sgd", "momentum", "adagrad", "adam"};
  int slots[] = {0, 1, 1, 2};
  for (int i = 0; i < 4; i++) {
    const ps_optimizer *o = ps_optimizer_find(names[i]);
    CHECK(o != NULL);
    if (!o) continue;
    CHECK(strcmp(o->name, names[i]) == 0);
    CHECK(o->n_slots == slots[i]);
  }
  CHECK(ps_optimizer_find("rmsprop") == NULL);
  CHECK(ps_optimizer_find("") == NULL);
  CHECK(ps_optimizer_find(NULL) == NULL);
}

static void test_sgd(void) {
  const ps_optimizer *o = ps_optimizer_find("sgd");
  ps_optim_config c = config("sgd");
  float p = 1.0f, s[2] = {0, 0};
  step1(o, &c, 1, &p, s, 0.5f); /* 1 - 0.1*0.5 = 0.95 */
  CHECK_NEAR(p, 0.95, TOL, 0);
  step1(o, &c, 2, &p, s, -1.0f); /* 0.95 + 0.1 = 1.05 */
  CHECK_NEAR(p, 1.05, TOL, 0);
  step1(o, &c, 3, &p, s, 0.25f); /* 1.05 - 0.025 = 1.025 */
  CHECK_NEAR(p, 1.025, TOL, 0);
  /* The lr argument is the one used, not cfg->lr (a caller may scale it). */
  float q = 1.0f, g = 2.0f;
  o->apply(&c, 1, 0.5f, &q, NULL, &g, 1); /* 1 - 0.5*2 = 0 */
  CHECK_NEAR(q, 0.0, TOL, 0);
}

static void test_momentum(void) {
  const ps_optimizer *o = ps_optimizer_find("momentum");
  ps_optim_config c = config("momentum"); /* lr 0.1, mu 0.9 */
  CHECK(o->slot_init(&c, 0) == 0.0f);
  float p = 1.0f, v[2] = {0, 0};
  /* g=1:  v = 0.9*0 + 1 = 1;         p = 1 - 0.1*1 = 0.9 */
  step1(o, &c, 1, &p, v, 1.0f);
  CHECK_NEAR(v[0], 1.0, TOL, 0);
  CHECK_NEAR(p, 0.9, TOL, 0);
  /* g=1:  v = 0.9*1 + 1 = 1.9;       p = 0.9 - 0.19 = 0.71 */
  step1(o, &c, 2, &p, v, 1.0f);
  CHECK_NEAR(v[0], 1.9, TOL, 0);
  CHECK_NEAR(p, 0.71, TOL, 0);
  /* g=-2: v = 1.71 - 2 = -0.29;      p = 0.71 + 0.029 = 0.739 */
  step1(o, &c, 3, &p, v, -2.0f);
  CHECK_NEAR(v[0], -0.29, TOL, 0);
  CHECK_NEAR(p, 0.739, TOL, 0);
}

static void test_nesterov(void) {
  const ps_optimizer *o = ps_optimizer_find("momentum");
  ps_optim_config c = config("momentum");
  c.nesterov = 1;
  float p = 1.0f, v[2] = {0, 0};
  /* g=1:  v = 1;     p -= 0.1*(1 + 0.9*1)     = 0.19    -> 0.81 */
  step1(o, &c, 1, &p, v, 1.0f);
  CHECK_NEAR(v[0], 1.0, TOL, 0);
  CHECK_NEAR(p, 0.81, TOL, 0);
  /* g=1:  v = 1.9;   p -= 0.1*(1 + 0.9*1.9)   = 0.271   -> 0.539 */
  step1(o, &c, 2, &p, v, 1.0f);
  CHECK_NEAR(v[0], 1.9, TOL, 0);
  CHECK_NEAR(p, 0.539, TOL, 0);
  /* g=-2: v = -0.29; p -= 0.1*(-2 + 0.9*-0.29) = -0.2261 -> 0.7651 */
  step1(o, &c, 3, &p, v, -2.0f);
  CHECK_NEAR(v[0], -0.29, TOL, 0);
  CHECK_NEAR(p, 0.7651, TOL, 0);
}

static void test_adagrad(void) {
  const ps_optimizer *o = ps_optimizer_find("adagrad");
  ps_optim_config c = config("adagrad");
  c.initial_accumulator = 0.25f;
  c.eps = 0.1f; /* large on purpose, so that its place in the formula shows */
  CHECK(o->slot_init(&c, 0) == 0.25f);
  float p = 1.0f, a[2] = {o->slot_init(&c, 0), 0};
  /* g=1.2:  a = 0.25 + 1.44 = 1.69, sqrt 1.3;   p -= 0.1*1.2/(1.3+0.1) = 0.0857142857
   *         -> 0.9142857143 */
  step1(o, &c, 1, &p, a, 1.2f);
  CHECK_NEAR(a[0], 1.69, TOL, 0);
  CHECK_NEAR(p, 0.9142857143, TOL, 0);
  /* g=-0.9: a = 1.69 + 0.81 = 2.5, sqrt 1.5811388301;
   *         p += 0.09/1.6811388301 = 0.0535351384  -> 0.9678208527 */
  step1(o, &c, 2, &p, a, -0.9f);
  CHECK_NEAR(a[0], 2.5, TOL, 0);
  CHECK_NEAR(p, 0.9678208527, TOL, 0);
  /* g=0.4:  a = 2.5 + 0.16 = 2.66, sqrt 1.6309506430;
   *         p -= 0.04/1.7309506430 = 0.0231086890   -> 0.9447121638 */
  step1(o, &c, 3, &p, a, 0.4f);
  CHECK_NEAR(a[0], 2.66, TOL, 0);
  CHECK_NEAR(p, 0.9447121638, TOL, 0);
}

static void test_adam(void) {
  const ps_optimizer *o = ps_optimizer_find("adam");
  ps_optim_config c = config("adam"); /* lr 0.1, b1 0.9, b2 0.999, eps 1e-8 */
  CHECK(o->slot_init(&c, 0) == 0.0f && o->slot_init(&c, 1) == 0.0f);
  float p = 1.0f, mv[2] = {0, 0};
  /* The slots are compared with a relative 2e-5: 0.999f is 0.99900001, so
   * 1 - beta2 in float is 0.000999987, 1.3e-5 below 0.001. The step itself
   * does not see this, as the bias correction uses the same beta2. */
  const double SLOT_RTOL = 2e-5;
  /* t=1, g=0.5: m = 0.1*0.5 = 0.05, v = 0.001*0.25 = 0.00025;
   *   m^ = 0.05/(1-0.9) = 0.5, v^ = 0.00025/(1-0.999) = 0.25, sqrt 0.5;
   *   p -= 0.1*0.5/(0.5+1e-8) = 0.1 (less 2e-9) -> 0.9 */
  step1(o, &c, 1, &p, mv, 0.5f);
  CHECK_NEAR(mv[0], 0.05, 0, SLOT_RTOL);
  CHECK_NEAR(mv[1], 0.00025, 0, SLOT_RTOL);
  CHECK_NEAR(p, 0.9, TOL, 0);
  /* t=2, g=0.5: m = 0.045 + 0.05 = 0.095, v = 0.00024975 + 0.00025 = 0.00049975;
   *   m^ = 0.095/0.19 = 0.5, v^ = 0.00049975/0.001999 = 0.25;
   *   p -= 0.1 -> 0.8 (a constant gradient moves by lr per step) */
  step1(o, &c, 2, &p, mv, 0.5f);
  CHECK_NEAR(mv[0], 0.095, 0, SLOT_RTOL);
  CHECK_NEAR(mv[1], 0.00049975, 0, SLOT_RTOL);
  CHECK_NEAR(p, 0.8, TOL, 0);
  /* t=3, g=-1: m = 0.0855 - 0.1 = -0.0145, v = 0.00049925025 + 0.001 = 0.00149925025;
   *   m^ = -0.0145/0.271 = -0.0535055351, v^ = 0.00149925025/0.002997001 = 0.5002501668,
   *   sqrt 0.7072836537; p += 0.1*0.0535055351/0.7072836537 = 0.0075649370
   *   -> 0.8075649370 */
  step1(o, &c, 3, &p, mv, -1.0f);
  CHECK_NEAR(mv[0], -0.0145, 0, SLOT_RTOL);
  CHECK_NEAR(mv[1], 0.00149925025, 0, SLOT_RTOL);
  CHECK_NEAR(p, 0.8075649370, TOL, 0);
}

/* t enters through the bias corrections: the same first gradient at t=1000
 * (slots fresh, as for a parameter first pushed late) takes a smaller step.
 * m = 0.05, v = 0.00025; 1-0.9^1000 = 1, 1-0.999^1000 = 0.6323045752;
 * v^ = 0.000395378, sqrt 0.0198841; p -= 0.1*0.05/0.0198841 = 0.2514565
 * -> 0.7485434552. */
static void test_adam_late_t(void) {
  const ps_optimizer *o = ps_optimizer_find("adam");
  ps_optim_config c = config("adam");
  float p = 1.0f, mv[2] = {0, 0};
  step1(o, &c, 1000, &p, mv, 0.5f);
  CHECK_NEAR(p, 0.7485434552, TOL, 0);
}

/* The vector loops run in blocks with a scalar tail: a run of 37 values
 * (two blocks and a tail of 5) must equal 37 single-value updates, for
 * every optimizer, over three steps. */
static void test_blocks_equal_scalar(void) {
  enum { N = 37 };
  const char *names[] = {"sgd", "momentum", "adagrad", "adam"};
  for (int nesterov = 0; nesterov < 2; nesterov++) {
    for (int k = 0; k < 4; k++) {
      const ps_optimizer *o = ps_optimizer_find(names[k]);
      ps_optim_config c = config(names[k]);
      c.nesterov = nesterov;
      float pv[N], pg[N], s0v[N], s1v[N];   /* vector run */
      float ps[N], s0s[N], s1s[N];          /* one at a time */
      for (int i = 0; i < N; i++) {
        pv[i] = ps[i] = 0.5f - 0.03f * (float)i;
        s0v[i] = s0s[i] = o->n_slots > 0 ? o->slot_init(&c, 0) : 0.0f;
        s1v[i] = s1s[i] = o->n_slots > 1 ? o->slot_init(&c, 1) : 0.0f;
      }
      int same = 1;
      for (uint64_t t = 1; t <= 3; t++) {
        for (int i = 0; i < N; i++) pg[i] = sinf((float)(i + 7 * t));
        float *sv[2] = {s0v, s1v};
        o->apply(&c, t, c.lr, pv, sv, pg, N);
        for (int i = 0; i < N; i++) {
          float *ss[2] = {&s0s[i], &s1s[i]};
          o->apply(&c, t, c.lr, &ps[i], ss, &pg[i], 1);
        }
      }
      /* Same operations in the same order: allow only the last-bit
       * differences a fused multiply-add in one path could make. */
      for (int i = 0; i < N; i++)
        if (fabsf(pv[i] - ps[i]) > 1e-6f || fabsf(s0v[i] - s0s[i]) > 1e-6f ||
            fabsf(s1v[i] - s1s[i]) > 1e-6f)
          same = 0;
      CHECK_MSG(same, "%s nesterov=%d: block loop differs from scalar", names[k], nesterov);
    }
  }
}

/* ---- bounds: what the shard trusts to skip looking at an update ---- */

static ps_rand rng;
static uint64_t next_u64(void) { return ps_rand_next(&rng); }

/* A float of any magnitude: zeros, subnormals, up to FLT_MAX, either sign
 * (nonneg: none negative). */
static float any_float(int nonneg) {
  uint64_t r = next_u64();
  uint32_t bits;
  switch (r % 8) {
    case 0: bits = 0; break;
    case 1: bits = (uint32_t)(r >> 8) & 0x007fffffu; break;             /* subnormal */
    case 2: bits = 0x7f7fffffu - ((uint32_t)(r >> 8) & 0xffffu); break; /* near FLT_MAX */
    default: bits = (uint32_t)(r >> 8) % 0x7f800000u; break;            /* any finite */
  }
  if (!nonneg && (r >> 63)) bits |= 0x80000000u;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static double max_abs(const float *v, int n) {
  double m = 0;
  for (int i = 0; i < n; i++) m = fabs((double)v[i]) > m ? fabs((double)v[i]) : m;
  return m;
}

/* Random states and gradients of every magnitude, random settings: where
 * the bounds say the update stays within FLT_MAX, every value after the
 * update is finite and within its bound. Half the draws scale the
 * magnitudes down by a random power of two, so that both verdicts come up
 * often. */
static void test_bounds_hold(void) {
  enum { N = 64, TRIALS = 4000 };
  const char *names[] = {"sgd", "momentum", "adagrad", "adam"};
  const float lrs[] = {0.0f, 1e-3f, 0.1f, 1.0f, 30.0f};
  const float mus[] = {0.0f, 0.9f, 1.5f, -0.5f};
  const float epss[] = {1e-8f, 1.0f, 1e-30f, 10.0f};
  const float b1s[] = {0.0f, 0.9f, 0.999999f}, b2s[] = {0.0f, 0.999f, 0.5f};
  const uint64_t ts[] = {1, 2, 1000, 1000000000};
  int safe[4] = {0}, unsafe[4] = {0};
  ps_rand_seed(&rng, 7);
  for (int trial = 0; trial < TRIALS; trial++) {
    int k = trial % 4;
    const ps_optimizer *o = ps_optimizer_find(names[k]);
    ps_optim_config c = config(names[k]);
    c.nesterov = (int)(next_u64() % 2);
    c.momentum = mus[next_u64() % 4];
    c.eps = epss[next_u64() % 4];
    c.beta1 = b1s[next_u64() % 3];
    c.beta2 = b2s[next_u64() % 3];
    float lr = lrs[next_u64() % 5];
    uint64_t t = ts[next_u64() % 4];
    float scale = next_u64() % 2 ? 1.0f : ldexpf(1.0f, -(int)(next_u64() % 130));
    float p[N], g[N], s0[N], s1[N];
    for (int i = 0; i < N; i++) {
      p[i] = any_float(0) * scale;
      g[i] = any_float(0) * scale;
      s0[i] = any_float(k == 2) * scale; /* adagrad's accumulator is never negative */
      s1[i] = any_float(1) * scale;      /* nor adam's v */
    }
    ps_optim_bounds b = {max_abs(p, N), {max_abs(s0, N), max_abs(s1, N)}, 3u};
    o->bound(&c, t, lr, max_abs(g, N), &b);
    float *slots[2] = {s0, s1};
    o->apply(&c, t, lr, p, slots, g, N);
    int ok = b.param <= FLT_MAX;
    for (int j = 0; j < o->n_slots; j++) ok &= b.slot[j] <= FLT_MAX;
    if (!ok) {
      unsafe[k]++;
      continue;
    }
    safe[k]++;
    int within = 1;
    for (int i = 0; i < N; i++) {
      within &= isfinite(p[i]) && fabs((double)p[i]) <= b.param;
      for (int j = 0; j < o->n_slots; j++)
        within &= isfinite(slots[j][i]) && fabs((double)slots[j][i]) <= b.slot[j];
    }
    CHECK_MSG(within, "%s trial %d: a value beyond its bound (param bound %g)", names[k], trial,
              b.param);
  }
  for (int k = 0; k < 4; k++)
    CHECK_MSG(safe[k] > 100 && unsafe[k] > 100, "%s: %d safe, %d unsafe draws", names[k], safe[k],
              unsafe[k]);
}

/* Ordinary values give bounds close to the truth (so a shard stays on its
 * fast path), and a slot whose sign is unknown gives none where a square
 * root of it is taken. */
static void test_bounds_tight_and_signs(void) {
  ps_optim_config c = config("sgd");
  ps_optim_bounds b = {1.0, {0}, 0};
  ps_optimizer_find("sgd")->bound(&c, 1, 0.1f, 1.0, &b);
  CHECK_NEAR(b.param, 1.1, 1e-5, 0);
  c = config("momentum");
  b = (ps_optim_bounds){1.0, {2.0}, 0};
  ps_optimizer_find("momentum")->bound(&c, 1, 0.1f, 1.0, &b); /* v <= 0.9*2+1, p <= 1+0.28 */
  CHECK_NEAR(b.slot[0], 2.8, 1e-5, 0);
  CHECK_NEAR(b.param, 1.28, 1e-5, 0);
  c = config("adagrad");
  b = (ps_optim_bounds){1.0, {1.0}, 1u};
  ps_optimizer_find("adagrad")->bound(&c, 1, 0.1f, 1.0, &b);
  CHECK(b.param <= 1.2 && b.slot[0] <= 2.01);
  b = (ps_optim_bounds){1.0, {1.0}, 0u};
  ps_optimizer_find("adagrad")->bound(&c, 1, 0.1f, 1.0, &b);
  CHECK(isinf(b.param));
  c = config("adam");
  b = (ps_optim_bounds){1.0, {1.0, 1.0}, 3u};
  ps_optimizer_find("adam")->bound(&c, 10, 1e-3f, 1.0, &b);
  CHECK(b.param < 1e8 && b.slot[0] <= 1.91 && b.slot[1] <= 2.0);
  b = (ps_optim_bounds){1.0, {1.0, 1.0}, 1u};
  ps_optimizer_find("adam")->bound(&c, 10, 1e-3f, 1.0, &b);
  CHECK(isinf(b.param));
}

/* ps_optim_apply_ranges: inside the moving ranges the pushed values are
 * averaged in and the slots stay; elsewhere the optimizer, exactly as a
 * plain apply; for windows that start, end and fall inside ranges. */
static void test_moving_ranges(void) {
  const ps_optimizer *opt = ps_optimizer_find("momentum");
  ps_optim_config cfg = config("momentum");
  const ps_moving_range mr[3] = {{10, 5, 0.9f, 0}, {15, 5, 0.9f, 1}, {40, 3, 0.5f, 1}};
  enum { P = 64 };
  for (size_t first = 0; first < 48; first += 7) {
    for (size_t n = 1; first + n <= P; n += 5) {
      float p[P], v[P], g[P], p0[P], v0[P];
      for (int i = 0; i < P; i++) {
        p[i] = p0[i] = 0.5f + 0.01f * (float)i;
        v[i] = v0[i] = -0.1f * (float)(i % 3);
        g[i] = 0.25f - 0.02f * (float)i;
      }
      float *slots[1] = {v + first};
      ps_optim_apply_ranges(opt, &cfg, 1, cfg.lr, p + first, slots, g + first, n, first, mr, 3);
      int ok = 1;
      for (size_t i = 0; i < P; i++) {
        float want_p = p0[i], want_v = v0[i];
        if (i >= first && i < first + n) {
          float mu = -1;
          for (int r = 0; r < 3; r++)
            if (i >= mr[r].off && i < mr[r].off + mr[r].count) mu = mr[r].momentum;
          if (mu >= 0) {
            want_p = mu * p0[i] + (1.0f - mu) * g[i];
          } else {
            want_v = cfg.momentum * v0[i] + g[i];
            want_p = p0[i] - cfg.lr * want_v;
          }
        }
        ok &= fabsf(p[i] - want_p) <= TOL && v[i] == want_v;
      }
      CHECK_MSG(ok, "window [%zu, %zu)", first, first + n);
    }
  }
  /* The bound covers the averages: max of the old values and the pushed. */
  ps_optim_bounds before = {.param = 2.0}, b = {.param = 1.0};
  ps_moving_bound(5.0, &before, &b);
  CHECK(b.param >= 5.0 && b.param < 5.001);
  b.param = 7.0;
  ps_moving_bound(5.0, &before, &b);
  CHECK(b.param == 7.0);
}

int main(void) {
  RUN(test_moving_ranges);
  RUN(test_table);
  RUN(test_sgd);
  RUN(test_momentum);
  RUN(test_nesterov);
  RUN(test_adagrad);
  RUN(test_adam);
  RUN(test_adam_late_t);
  RUN(test_blocks_equal_scalar);
  RUN(test_bounds_hold);
  RUN(test_bounds_tight_and_signs);
  return check_summary();
}

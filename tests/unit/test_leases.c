/* The data-lease table (ps/state/leases.c): epochs and permutations, several
 * workers, release, expiry and renewal, late and lost completions, the
 * wait/full/finished answers, the kept records, checkpoint blobs (round trip
 * and corrupt ones, the previous version's), lost completions counted as
 * redone, threads, and randomized simulations (churn; kills and restores)
 * checked against their own ledgers. */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/crc32c.h"
#include "common/rng.h"
#include "common/util.h"
#include "ps/state/leases.h"

static ps_leases *make(uint64_t n, uint32_t chunk, uint32_t epochs, uint64_t seed,
                       uint32_t max_per_worker) {
  ps_lease_config cfg = {.n_examples = n,
                         .chunk_size = chunk,
                         .epochs = epochs,
                         .seed = seed,
                         .max_per_worker = max_per_worker};
  char err[PS_ERRLEN] = "";
  ps_leases *t = ps_leases_create(&cfg, err);
  CHECK_MSG(t != NULL, "%s", err);
  return t;
}

static ps_lease_stats stats_of(ps_leases *t) {
  ps_lease_stats s;
  ps_leases_stats(t, &s);
  return s;
}

/* The fields that any call that fails must leave as they were. */
static int same_state(const ps_lease_stats *a, const ps_lease_stats *b) {
  return a->epoch == b->epoch && a->finished == b->finished && a->chunks_done == b->chunks_done &&
         a->chunks_leased == b->chunks_leased && a->leases_granted == b->leases_granted &&
         a->reclaims_total == b->reclaims_total &&
         a->current.chunks_completed == b->current.chunks_completed &&
         a->current.examples_completed == b->current.examples_completed &&
         a->current.examples_handed_out == b->current.examples_handed_out &&
         a->current.reclaims == b->current.reclaims && a->n_history == b->n_history;
}

/* A finished epoch's record shows every chunk completed exactly once, both
 * in its sums and chunk by chunk. */
static void check_epoch_exactly_once(ps_leases *t, uint32_t epoch, uint64_t n_examples) {
  ps_lease_epoch_record r;
  uint8_t counts[4096];
  int n = ps_leases_epoch_record(t, epoch, &r, counts, sizeof counts);
  CHECK_MSG(n > 0, "epoch %u not kept (%d)", (unsigned)epoch, n);
  if (n <= 0) return;
  CHECK(r.epoch == epoch && r.finished == 1 && r.chunks == (uint32_t)n);
  CHECK_MSG(r.chunks_once == r.chunks && r.chunks_completed == r.chunks,
            "epoch %u: %u once, %u completions, %u chunks", (unsigned)epoch,
            (unsigned)r.chunks_once, (unsigned)r.chunks_completed, (unsigned)r.chunks);
  CHECK(r.examples_completed == n_examples);
  CHECK(r.examples_handed_out >= n_examples);
  CHECK(r.examples_handed_out - r.examples_rehanded == n_examples);
  CHECK(r.end_ms >= r.start_ms && r.start_ms >= 0);
  int all_once = 1;
  for (int k = 0; k < n && k < (int)sizeof counts; k++) all_once &= counts[k] == 1;
  CHECK_MSG(all_once, "epoch %u: some chunk not completed exactly once", (unsigned)epoch);
}

static void test_config(void) {
  char err[PS_ERRLEN];
  ps_lease_config ok = {
      .n_examples = 10, .chunk_size = 3, .epochs = 1, .seed = 1, .max_per_worker = 1};
  ps_lease_config c = ok;
  c.n_examples = 0;
  err[0] = '\0';
  CHECK(ps_leases_create(&c, err) == NULL && err[0] != '\0');
  c = ok;
  c.chunk_size = 0;
  err[0] = '\0';
  CHECK(ps_leases_create(&c, err) == NULL && err[0] != '\0');
  c = ok;
  c.max_per_worker = 0;
  err[0] = '\0';
  CHECK(ps_leases_create(&c, err) == NULL && err[0] != '\0');
  c = ok;
  c.n_examples = (uint64_t)PS_LEASE_MAX_CHUNKS * 2 + 1;
  c.chunk_size = 2;
  err[0] = '\0';
  CHECK(ps_leases_create(&c, err) == NULL && strstr(err, "chunks") != NULL);
  CHECK(ps_leases_create(NULL, NULL) == NULL);

  ps_leases *t = ps_leases_create(&ok, err);
  CHECK(t != NULL);
  if (!t) return;
  ps_lease_stats s = stats_of(t);
  CHECK(s.chunks == 4 && s.epoch == 0 && !s.finished && s.chunks_done == 0 &&
        s.chunks_leased == 0 && s.n_history == 0);
  CHECK(s.config.n_examples == 10 && s.config.chunk_size == 3 && s.config.max_per_worker == 1);
  CHECK(s.current.start_ms == -1 && s.current.end_ms == -1);
  ps_lease l;
  CHECK(ps_leases_acquire(NULL, 1, 0, &l) == PS_EINVAL);
  CHECK(ps_leases_acquire(t, 1, 0, NULL) == PS_EINVAL);
  CHECK(strcmp(ps_leases_strerror(PS_LEASE_ELOST), ps_strerror(PS_LEASE_ELOST)) != 0);
  CHECK(strcmp(ps_leases_strerror(PS_ENOTFOUND), ps_strerror(PS_ENOTFOUND)) == 0);
  ps_leases_destroy(t);
  ps_leases_destroy(NULL);
}

/* One worker walks E epochs with one lease at a time; returns the hand-out
 * order in orders[epoch][i]. */
static void walk(ps_leases *t, uint32_t epochs, uint32_t n_chunks, uint32_t orders[][16]) {
  int64_t now = 0;
  for (uint32_t e = 0; e < epochs; e++) {
    for (uint32_t i = 0; i < n_chunks; i++) {
      ps_lease l;
      int rc = ps_leases_acquire(t, 42, now, &l);
      CHECK_MSG(rc == PS_OK, "epoch %u, lease %u: %d", (unsigned)e, (unsigned)i, rc);
      if (rc != PS_OK) return;
      CHECK(l.epoch == e && l.lease_id != 0);
      orders[e][i] = l.chunk;
      /* One lease at a time. */
      ps_lease extra;
      CHECK(ps_leases_acquire(t, 42, now, &extra) == PS_LEASE_FULL);
      CHECK(ps_leases_complete(t, 42, l.lease_id, now + 5) == PS_OK);
      now += 10;
    }
  }
}

static void test_single_worker_epochs(void) {
  /* 103 examples in chunks of 10: 11 chunks, the last of 3 examples. */
  enum { N = 103, C = 10, E = 4, K = 11 };
  ps_leases *t = make(N, C, E, 1234, 1);
  if (!t) return;
  uint32_t orders[E][16];
  walk(t, E, K, orders);
  ps_lease l;
  CHECK(ps_leases_acquire(t, 42, 1000, &l) == PS_LEASE_FINISHED);
  CHECK(ps_leases_acquire(t, 7, 1000, &l) == PS_LEASE_FINISHED);
  ps_lease_stats s = stats_of(t);
  CHECK(s.finished && s.epoch == E && s.n_history == E && s.chunks_leased == 0);
  CHECK(s.leases_granted == (uint64_t)E * K && s.reclaims_total == 0);
  CHECK(s.history[0].epoch == E - 1 && s.history[E - 1].epoch == 0);
  for (uint32_t e = 0; e < E; e++) {
    /* Every chunk once per epoch, in a permutation. */
    int seen[K] = {0};
    for (int i = 0; i < K; i++)
      if (orders[e][i] < K) seen[orders[e][i]]++;
    int perm = 1;
    for (int k = 0; k < K; k++) perm &= seen[k] == 1;
    CHECK_MSG(perm, "epoch %u is not a permutation", (unsigned)e);
    check_epoch_exactly_once(t, e, N);
    ps_lease_epoch_record r;
    CHECK(ps_leases_epoch_record(t, e, &r, NULL, 0) == K);
    CHECK(r.examples_handed_out == N && r.examples_rehanded == 0 && r.reclaims == 0);
  }
  /* The epochs' orders differ from one another. */
  for (uint32_t a = 0; a < E; a++)
    for (uint32_t b = a + 1; b < E; b++)
      CHECK(memcmp(orders[a], orders[b], K * sizeof orders[0][0]) != 0);
  /* The epoch after the last never starts. */
  CHECK(ps_leases_epoch_record(t, E, NULL, NULL, 0) == PS_ENOTFOUND);
  ps_leases_destroy(t);

  /* Same seed, same orders; another seed, other orders. */
  ps_leases *same = make(N, C, E, 1234, 1);
  ps_leases *other = make(N, C, E, 1235, 1);
  if (!same || !other) {
    ps_leases_destroy(same);
    ps_leases_destroy(other);
    return;
  }
  uint32_t orders_same[E][16], orders_other[E][16];
  walk(same, E, K, orders_same);
  walk(other, E, K, orders_other);
  for (uint32_t e = 0; e < E; e++) {
    CHECK(memcmp(orders[e], orders_same[e], K * sizeof orders[0][0]) == 0);
    CHECK(memcmp(orders[e], orders_other[e], K * sizeof orders[0][0]) != 0);
  }
  ps_leases_destroy(same);
  ps_leases_destroy(other);
}

static void test_chunk_bounds(void) {
  ps_leases *t = make(103, 10, 1, 5, 20);
  if (!t) return;
  uint64_t covered = 0;
  int ok = 1;
  ps_lease l;
  for (int i = 0; i < 11; i++) {
    CHECK(ps_leases_acquire(t, 1, 0, &l) == PS_OK);
    ok &= l.begin == (uint64_t)l.chunk * 10;
    ok &= l.count == (l.chunk == 10 ? 3u : 10u);
    covered += l.count;
  }
  CHECK(ok && covered == 103);
  CHECK(ps_leases_acquire(t, 1, 0, &l) == PS_LEASE_WAIT);
  ps_lease held[16];
  CHECK(ps_leases_held(t, 1, held, 16) == 11);
  CHECK(ps_leases_held(t, 1, held, 2) == 11); /* max bounds the copy only */
  CHECK(ps_leases_held(t, 2, held, 16) == 0);
  ps_leases_destroy(t);
}

static void test_three_workers(void) {
  enum { N = 200, C = 9, E = 3, K = 23 };
  ps_leases *t = make(N, C, E, 99, 2);
  if (!t) return;
  const uint64_t w[3] = {101, 202, 303};
  ps_lease held[3][2];
  int nheld[3] = {0, 0, 0};
  int done[E][K];
  memset(done, 0, sizeof done);
  int leased_to[K];
  for (int k = 0; k < K; k++) leased_to[k] = -1;
  int64_t now = 0;
  int finished = 0, rounds = 0;
  while (!finished && rounds++ < 1000) {
    for (int i = 0; i < 3; i++) {
      /* Fill up to two leases, then complete the older one (worker 1 the
       * newer one: completions out of grant order). */
      while (nheld[i] < 2) {
        ps_lease l;
        int rc = ps_leases_acquire(t, w[i], now, &l);
        if (rc == PS_LEASE_FINISHED) finished = 1;
        if (rc != PS_OK) break;
        CHECK_MSG(leased_to[l.chunk] == -1, "chunk %u leased twice", (unsigned)l.chunk);
        leased_to[l.chunk] = i;
        held[i][nheld[i]++] = l;
      }
      if (nheld[i] == 0) continue;
      int pick = (i == 1 && nheld[i] == 2) ? 1 : 0;
      ps_lease l = held[i][pick];
      CHECK(ps_leases_complete(t, w[i], l.lease_id, now) == PS_OK);
      if (l.epoch < E && l.chunk < K) done[l.epoch][l.chunk]++;
      leased_to[l.chunk] = -1;
      held[i][pick] = held[i][nheld[i] - 1];
      nheld[i]--;
      now += 3;
    }
  }
  CHECK(finished);
  int all_once = 1;
  for (int e = 0; e < E; e++)
    for (int k = 0; k < K; k++) all_once &= done[e][k] == 1;
  CHECK(all_once);
  for (uint32_t e = 0; e < E; e++) check_epoch_exactly_once(t, e, N);
  ps_leases_destroy(t);
}

static void test_wait_full_finished(void) {
  /* Two chunks, two epochs, one lease per worker. */
  ps_leases *t = make(4, 2, 2, 3, 1);
  if (!t) return;
  ps_lease a, b, c;
  CHECK(ps_leases_acquire(t, 1, 0, &a) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 0, &c) == PS_LEASE_FULL);
  CHECK(ps_leases_acquire(t, 2, 0, &b) == PS_OK);
  CHECK(a.chunk != b.chunk);
  memset(&c, 0xab, sizeof c);
  ps_lease_stats before = stats_of(t);
  CHECK(ps_leases_acquire(t, 3, 0, &c) == PS_LEASE_WAIT);
  ps_lease_stats after = stats_of(t);
  CHECK(same_state(&before, &after));
  CHECK(c.lease_id == 0xababababababababull); /* untouched */
  CHECK(ps_leases_complete(t, 1, a.lease_id, 1) == PS_OK);
  /* One chunk done, the other leased: still nothing for anyone. */
  CHECK(ps_leases_acquire(t, 3, 2, &c) == PS_LEASE_WAIT);
  CHECK(ps_leases_acquire(t, 1, 2, &c) == PS_LEASE_WAIT);
  CHECK(ps_leases_complete(t, 2, b.lease_id, 3) == PS_OK);
  /* The epoch advanced on the last completion. */
  ps_lease_stats s = stats_of(t);
  CHECK(s.epoch == 1 && s.chunks_done == 0 && s.n_history == 1 && s.history[0].end_ms == 3);
  CHECK(ps_leases_acquire(t, 3, 4, &a) == PS_OK && a.epoch == 1);
  CHECK(ps_leases_acquire(t, 1, 4, &b) == PS_OK && b.epoch == 1);
  CHECK(ps_leases_complete(t, 3, a.lease_id, 5) == PS_OK);
  CHECK(ps_leases_complete(t, 1, b.lease_id, 6) == PS_OK);
  /* Finished comes before full and wait. */
  CHECK(ps_leases_acquire(t, 1, 7, &c) == PS_LEASE_FINISHED);
  CHECK(ps_leases_acquire(t, 9, 7, &c) == PS_LEASE_FINISHED);
  s = stats_of(t);
  CHECK(s.finished && s.epoch == 2 && s.n_history == 2);
  check_epoch_exactly_once(t, 0, 4);
  check_epoch_exactly_once(t, 1, 4);
  ps_leases_destroy(t);
}

static void test_release_mid_epoch(void) {
  enum { N = 48, C = 5, K = 10 };
  ps_leases *t = make(N, C, 1, 11, 2);
  if (!t) return;
  ps_lease a1, a2, b1, b2;
  CHECK(ps_leases_acquire(t, 1, 0, &a1) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 0, &a2) == PS_OK);
  CHECK(ps_leases_acquire(t, 2, 0, &b1) == PS_OK);
  CHECK(ps_leases_complete(t, 1, a1.lease_id, 1) == PS_OK);
  /* Worker 1 leaves holding a2. */
  CHECK(ps_leases_release_worker(t, 1) == 1);
  CHECK(ps_leases_release_worker(t, 1) == 0);
  CHECK(ps_leases_held(t, 1, NULL, 0) == 0);
  ps_lease_stats s = stats_of(t);
  CHECK(s.reclaims_total == 1 && s.current.reclaims == 1 && s.chunks_leased == 1 &&
        s.chunks_done == 1);
  /* The reclaimed chunk is served first, as a re-hand-out. */
  CHECK(ps_leases_acquire(t, 2, 2, &b2) == PS_OK);
  CHECK(b2.chunk == a2.chunk && b2.lease_id != a2.lease_id);
  s = stats_of(t);
  CHECK(s.current.examples_rehanded == a2.count);
  /* Its first holder comes back late: not counted, nothing changes. */
  CHECK(ps_leases_complete(t, 1, a2.lease_id, 3) == PS_LEASE_ELOST);
  ps_lease_stats after = stats_of(t);
  CHECK(same_state(&s, &after));
  CHECK(ps_leases_complete(t, 2, b1.lease_id, 4) == PS_OK);
  CHECK(ps_leases_complete(t, 2, b2.lease_id, 4) == PS_OK);
  /* A third worker and worker 2 finish the epoch. */
  int64_t now = 5;
  for (int guard = 0; guard < 100; guard++) {
    ps_lease l;
    uint64_t w = 2 + (uint64_t)(guard & 1);
    int rc = ps_leases_acquire(t, w, now, &l);
    if (rc == PS_LEASE_FINISHED) break;
    CHECK(rc == PS_OK);
    if (rc != PS_OK) break;
    CHECK(ps_leases_complete(t, w, l.lease_id, now) == PS_OK);
    now++;
  }
  s = stats_of(t);
  CHECK(s.finished);
  check_epoch_exactly_once(t, 0, N);
  ps_lease_epoch_record r;
  CHECK(ps_leases_epoch_record(t, 0, &r, NULL, 0) == K);
  CHECK(r.reclaims == 1 && r.examples_rehanded == a2.count &&
        r.examples_handed_out == N + a2.count);
  ps_leases_destroy(t);
}

static void test_expire_renew(void) {
  ps_leases *t = make(100, 10, 0, 5, 2);
  if (!t) return;
  ps_lease a, b, b2;
  CHECK(ps_leases_acquire(t, 1, 0, &a) == PS_OK);
  CHECK(ps_leases_acquire(t, 2, 0, &b) == PS_OK);
  CHECK(ps_leases_acquire(t, 2, 100, &b2) == PS_OK);
  CHECK(ps_leases_renew(t, 1, 500) == 1);
  CHECK(ps_leases_renew(t, 9, 500) == 0);
  /* Exactly at the time-out nothing expires yet. */
  CHECK(ps_leases_expire(t, 1000, 1000) == 0);
  /* b is older than the time-out; b2 and a (renewed) are not. */
  CHECK(ps_leases_expire(t, 1050, 1000) == 1);
  CHECK(ps_leases_held(t, 2, NULL, 0) == 1 && ps_leases_held(t, 1, NULL, 0) == 1);
  CHECK(ps_leases_expire(t, 1101, 1000) == 1); /* b2 */
  CHECK(ps_leases_renew(t, 1, 1400) == 1);
  CHECK(ps_leases_expire(t, 2300, 1000) == 0);
  CHECK(ps_leases_expire(t, 2401, 1000) == 1); /* a at last */
  ps_lease_stats s = stats_of(t);
  CHECK(s.chunks_leased == 0 && s.reclaims_total == 3 && s.current.reclaims == 3);
  /* The reclaimed chunks come back first, in the order they were reclaimed. */
  ps_lease l;
  CHECK(ps_leases_acquire(t, 3, 2500, &l) == PS_OK && l.chunk == b.chunk);
  CHECK(ps_leases_acquire(t, 3, 2500, &l) == PS_OK && l.chunk == b2.chunk);
  CHECK(ps_leases_acquire(t, 4, 2500, &l) == PS_OK && l.chunk == a.chunk);
  ps_leases_destroy(t);
}

/* A heartbeat that names the worker's leases keeps those alive only: a
 * lease whose grant the worker never heard of expires (no orphan kept
 * alive forever). */
static void test_renew_named(void) {
  ps_leases *t = make(100, 10, 0, 5, 2);
  if (!t) return;
  ps_lease a, orphan, other;
  CHECK(ps_leases_acquire(t, 1, 0, &a) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 0, &orphan) == PS_OK); /* its answer was lost */
  CHECK(ps_leases_acquire(t, 2, 0, &other) == PS_OK);
  uint64_t named[] = {a.lease_id, other.lease_id /* not worker 1's */, 12345};
  for (int64_t now = 500; now <= 3000; now += 500)
    CHECK(ps_leases_renew_named(t, 1, named, 3, now) == 1);
  CHECK(ps_leases_renew_named(t, 1, NULL, 0, 3000) == 0);
  /* At 3000 only a (renewed at 3000) is younger than 1000 ms. */
  CHECK(ps_leases_expire(t, 3000, 1000) == 2);
  ps_lease held[4];
  CHECK(ps_leases_held(t, 1, held, 4) == 1 && held[0].lease_id == a.lease_id);
  CHECK(ps_leases_held(t, 2, held, 4) == 0);
  ps_leases_destroy(t);
}

static void test_late_and_lost_completions(void) {
  ps_leases *t = make(60, 10, 0, 8, 2);
  if (!t) return;
  ps_lease a, b, c;
  /* Expired, but nobody took the chunk since: the late result is taken. */
  CHECK(ps_leases_acquire(t, 1, 0, &a) == PS_OK);
  CHECK(ps_leases_expire(t, 5000, 1000) == 1);
  CHECK(ps_leases_complete(t, 1, a.lease_id, 5001) == PS_OK);
  ps_lease_stats s = stats_of(t);
  CHECK(s.chunks_done == 1 && s.reclaims_total == 1 && s.current.chunks_completed == 1);
  /* ... and its chunk, though still queued in the pool, is not handed out. */
  CHECK(ps_leases_acquire(t, 2, 5002, &b) == PS_OK && b.chunk != a.chunk);
  CHECK(stats_of(t).current.examples_rehanded == 0);
  /* A retried completion: answered again, counted once. */
  CHECK(ps_leases_complete(t, 1, a.lease_id, 5003) == PS_OK);
  CHECK(stats_of(t).chunks_done == 1);

  /* Released and handed to another: lost, nothing changes. */
  CHECK(ps_leases_release_worker(t, 2) == 1);
  CHECK(ps_leases_acquire(t, 3, 5004, &c) == PS_OK && c.chunk == b.chunk);
  s = stats_of(t);
  CHECK(ps_leases_complete(t, 2, b.lease_id, 5005) == PS_LEASE_ELOST);
  ps_lease_stats after = stats_of(t);
  CHECK(same_state(&s, &after));
  /* Someone else's lease, live or ended: not yours. */
  CHECK(ps_leases_complete(t, 1, c.lease_id, 5006) == PS_ESTATE);
  CHECK(ps_leases_complete(t, 3, b.lease_id, 5006) == PS_ESTATE);
  /* Ids never handed out. */
  CHECK(ps_leases_complete(t, 3, 0, 5006) == PS_ENOTFOUND);
  CHECK(ps_leases_complete(t, 3, c.lease_id + 1000, 5006) == PS_ENOTFOUND);
  after = stats_of(t);
  CHECK(same_state(&s, &after));
  CHECK(ps_leases_complete(t, 3, c.lease_id, 5007) == PS_OK);
  CHECK(stats_of(t).chunks_done == 2);
  /* Reclaimed and completed by the new holder: the old one is lost even
   * though the chunk is no longer leased. */
  CHECK(ps_leases_complete(t, 2, b.lease_id, 5008) == PS_LEASE_ELOST);
  ps_leases_destroy(t);
}

static void test_history_kept(void) {
  /* 12 unbounded epochs of 3 chunks: the last 8 finished ones are kept. */
  ps_leases *t = make(3, 1, 0, 4, 1);
  if (!t) return;
  for (int i = 0; i < 12 * 3; i++) {
    ps_lease l;
    CHECK(ps_leases_acquire(t, 1, i, &l) == PS_OK);
    CHECK(ps_leases_complete(t, 1, l.lease_id, i) == PS_OK);
  }
  ps_lease_stats s = stats_of(t);
  CHECK(s.epoch == 12 && !s.finished && s.n_history == PS_LEASE_HISTORY);
  CHECK(s.history[0].epoch == 11 && s.history[PS_LEASE_HISTORY - 1].epoch == 4);
  for (uint32_t e = 4; e < 12; e++) check_epoch_exactly_once(t, e, 3);
  CHECK(ps_leases_epoch_record(t, 3, NULL, NULL, 0) == PS_ENOTFOUND);
  ps_lease_epoch_record r;
  CHECK(ps_leases_epoch_record(t, 12, &r, NULL, 0) == 3);
  CHECK(r.epoch == 12 && !r.finished && r.chunks_completed == 0 && r.start_ms == -1);
  ps_leases_destroy(t);
}

/* Saves t, destroys it, and returns the table loaded back. */
static ps_leases *round_trip(ps_leases *t) {
  void *buf = NULL;
  size_t len = 0;
  CHECK(ps_leases_save(t, &buf, &len) == PS_OK);
  ps_leases_destroy(t);
  if (!buf) return NULL;
  char err[PS_ERRLEN] = "";
  ps_leases *back = ps_leases_load(buf, len, err);
  CHECK_MSG(back != NULL, "%s", err);
  free(buf);
  return back;
}

static void test_save_load(void) {
  enum { N = 95, C = 10, K = 10 };
  ps_leases *t = make(N, C, 3, 7, 2);
  ps_leases *twin = make(N, C, 3, 7, 2);
  if (!t || !twin) {
    ps_leases_destroy(t);
    ps_leases_destroy(twin);
    return;
  }
  /* Epoch 0 in full, on both. */
  for (int i = 0; i < K; i++) {
    ps_lease l, m;
    CHECK(ps_leases_acquire(t, 1, i, &l) == PS_OK);
    CHECK(ps_leases_complete(t, 1, l.lease_id, i) == PS_OK);
    CHECK(ps_leases_acquire(twin, 1, i, &m) == PS_OK && m.chunk == l.chunk);
    CHECK(ps_leases_complete(twin, 1, m.lease_id, i) == PS_OK);
  }
  /* Epoch 1: three done, one reclaimed into the pool, two outstanding. */
  ps_lease l[6];
  int done[K] = {0};
  for (int i = 0; i < 6; i++)
    CHECK(ps_leases_acquire(t, 10 + (uint64_t)(i / 2), 100, &l[i]) == PS_OK);
  for (int i = 0; i < 3; i++) {
    CHECK(ps_leases_complete(t, 10 + (uint64_t)(i / 2), l[i].lease_id, 101) == PS_OK);
    done[l[i].chunk] = 1;
  }
  CHECK(ps_leases_release_worker(t, 11) == 1); /* l[3] */
  ps_lease_stats before = stats_of(t);
  CHECK(before.chunks_done == 3 && before.chunks_leased == 2 && before.reclaims_total == 1);
  ps_lease_epoch_record r0;
  uint8_t c0[K];
  CHECK(ps_leases_epoch_record(t, 0, &r0, c0, K) == K);

  t = round_trip(t);
  if (!t) {
    ps_leases_destroy(twin);
    return;
  }
  ps_lease_stats s = stats_of(t);
  CHECK(s.epoch == 1 && !s.finished && s.chunks_done == 3 && s.chunks_leased == 0);
  CHECK(s.config.n_examples == N && s.config.chunk_size == C && s.config.epochs == 3 &&
        s.config.seed == 7 && s.config.max_per_worker == 2);
  /* The two outstanding leases were taken back by the restore. */
  CHECK(s.reclaims_total == 3 && s.current.reclaims == 3);
  CHECK(s.leases_granted == before.leases_granted);
  CHECK(s.current.examples_handed_out == before.current.examples_handed_out);
  CHECK(s.current.examples_completed == before.current.examples_completed);
  CHECK(s.n_history == 1);
  ps_lease_epoch_record r1;
  uint8_t c1[K];
  CHECK(ps_leases_epoch_record(t, 0, &r1, c1, K) == K);
  CHECK(memcmp(c0, c1, K) == 0 && r1.examples_handed_out == r0.examples_handed_out &&
        r1.start_ms == r0.start_ms && r1.end_ms == r0.end_ms && r1.finished);
  check_epoch_exactly_once(t, 0, N);
  /* Leases of the previous life are unknown now. */
  CHECK(ps_leases_complete(t, 10, l[4].lease_id, 200) == PS_ENOTFOUND);

  /* The rest of epoch 1: first the three chunks in the pool (re-handed
   * out), then the fresh ones in the order of the epoch's permutation. */
  int pooled = 0;
  for (int i = 0; i < 3; i++) {
    ps_lease m;
    CHECK(ps_leases_acquire(t, 20, 300, &m) == PS_OK);
    CHECK(m.lease_id > l[5].lease_id);
    pooled += m.chunk == l[3].chunk || m.chunk == l[4].chunk || m.chunk == l[5].chunk;
    CHECK(!done[m.chunk]);
    done[m.chunk] = 1;
    CHECK(ps_leases_complete(t, 20, m.lease_id, 301) == PS_OK);
  }
  CHECK(pooled == 3);
  CHECK(stats_of(t).current.examples_rehanded == (uint64_t)l[3].count + l[4].count + l[5].count);
  uint32_t twin_order[K];
  for (int i = 0; i < K; i++) {
    ps_lease m;
    CHECK(ps_leases_acquire(twin, 1, 400, &m) == PS_OK);
    twin_order[i] = m.chunk;
    CHECK(ps_leases_complete(twin, 1, m.lease_id, 400) == PS_OK);
  }
  int j = 0;
  for (int i = 0; i < K; i++) {
    if (done[twin_order[i]]) continue;
    ps_lease m;
    CHECK(ps_leases_acquire(t, 20, 500, &m) == PS_OK);
    CHECK_MSG(m.chunk == twin_order[i], "fresh chunk %d: %u, twin %u", j, (unsigned)m.chunk,
              (unsigned)twin_order[i]);
    done[m.chunk] = 1;
    CHECK(ps_leases_complete(t, 20, m.lease_id, 501) == PS_OK);
    j++;
  }
  CHECK(j == 4);
  s = stats_of(t);
  CHECK(s.epoch == 2 && s.n_history == 2);
  check_epoch_exactly_once(t, 1, N);

  /* A table with nothing outstanding saves and loads to the same bytes
   * (but for the next lease id, which moves past the previous life's). */
  void *b1 = NULL, *b2 = NULL;
  size_t n1 = 0, n2 = 0;
  CHECK(ps_leases_save(t, &b1, &n1) == PS_OK);
  t = round_trip(t);
  if (t) CHECK(ps_leases_save(t, &b2, &n2) == PS_OK);
  CHECK(b1 && b2 && n1 == n2);
  if (b1 && b2 && n1 == n2) {
    CHECK(memcmp(b1, b2, 52) == 0);
    CHECK(memcmp((char *)b1 + 60, (char *)b2 + 60, n1 - 64) == 0);
  }
  free(b1);
  free(b2);

  /* Finished tables stay finished. */
  for (int guard = 0; t && guard < 100; guard++) {
    ps_lease m;
    int rc = ps_leases_acquire(t, 1, 600, &m);
    if (rc != PS_OK) break;
    CHECK(ps_leases_complete(t, 1, m.lease_id, 600) == PS_OK);
  }
  if (t) t = round_trip(t);
  if (t) {
    ps_lease m;
    CHECK(ps_leases_acquire(t, 1, 700, &m) == PS_LEASE_FINISHED);
    s = stats_of(t);
    CHECK(s.finished && s.epoch == 3 && s.n_history == 3);
    for (uint32_t e = 0; e < 3; e++) check_epoch_exactly_once(t, e, N);
  }
  ps_leases_destroy(t);
  ps_leases_destroy(twin);
}

static void fix_crc(uint8_t *b, size_t len) {
  uint32_t crc = ps_crc32c(0, b, len - 4);
  for (int i = 0; i < 4; i++) b[len - 4 + (size_t)i] = (uint8_t)(crc >> (8 * i));
}

/* Loading b fails with a message (containing want, when not NULL). */
static int load_fails(const uint8_t *b, size_t len, const char *want) {
  char err[PS_ERRLEN] = "";
  ps_leases *t = ps_leases_load(b, len, err);
  if (t) {
    ps_leases_destroy(t);
    return 0;
  }
  if (err[0] == '\0') return 0;
  if (want && !strstr(err, want)) {
    fprintf(stderr, "  message: %s (wanted \"%s\")\n", err, want);
    return 0;
  }
  return 1;
}

static void test_load_corrupt(void) {
  /* A table mid-epoch with some history and an outstanding lease. */
  ps_leases *t = make(37, 4, 5, 3, 2);
  if (!t) return;
  for (int i = 0; i < 10 + 10 + 4; i++) {
    ps_lease l;
    CHECK(ps_leases_acquire(t, 1, i, &l) == PS_OK);
    CHECK(ps_leases_complete(t, 1, l.lease_id, i) == PS_OK);
  }
  ps_lease out;
  CHECK(ps_leases_acquire(t, 2, 50, &out) == PS_OK);
  uint8_t *b = NULL;
  size_t len = 0;
  CHECK(ps_leases_save(t, (void **)&b, &len) == PS_OK);
  ps_leases_destroy(t);
  if (!b) return;
  enum { K = 10, HIST = 2, REC = 96 };
  /* ... then 1 outstanding lease (28 bytes), an empty pool, the next
   * epoch's flags, the lease's pushes and no reclaimed leases kept */
  CHECK(len == 80 + REC + HIST * (REC + K) + 3 * K + 4 + 28 + 4 + K + 4 + 4 + 4);

  CHECK(ps_leases_load(NULL, 0, NULL) == NULL);
  CHECK(load_fails(b, 0, "shorter"));
  /* Every truncation. */
  int all = 1;
  for (size_t n = 0; n < len; n++) all &= load_fails(b, n, NULL);
  CHECK_MSG(all, "a truncated blob loaded");
  /* Every single-byte change. */
  uint8_t *c = malloc(len + 1);
  if (!c) {
    free(b);
    return;
  }
  all = 1;
  for (size_t i = 0; i < len; i++) {
    memcpy(c, b, len);
    c[i] ^= 0x5a;
    all &= load_fails(c, len, NULL);
  }
  CHECK_MSG(all, "a corrupted blob loaded");
  /* A byte too many. */
  memcpy(c, b, len);
  c[len] = 0;
  CHECK(load_fails(c, len + 1, "trailing"));
  memcpy(c, b, len);
  c[0] = 'X';
  CHECK(load_fails(c, len, "magic"));
  memcpy(c, b, len);
  c[13] ^= 1; /* a bit of n_examples: checksum */
  CHECK(load_fails(c, len, "checksum"));
  memcpy(c, b, len);
  c[8] = 5; /* version 5 */
  CHECK(load_fails(c, len, "version"));
  {
    char err[PS_ERRLEN];
    CHECK(ps_leases_load(c, len, err) == NULL && strstr(err, "newer") != NULL);
  }

  /* Well-formed blobs (right length and checksum) that say impossible
   * things. Offsets: see the layout in ps/state/leases.c. */
  size_t state_at = 80 + REC + HIST * (REC + K);
  size_t counts_at = state_at + K;
  size_t redone_at = counts_at + K;
  memcpy(c, b, len);
  c[state_at + 3] = 9;
  fix_crc(c, len);
  CHECK(load_fails(c, len, "state 9"));
  /* A chunk done without a completion. */
  memcpy(c, b, len);
  for (int k = 0; k < K; k++) {
    if (c[state_at + (size_t)k] != 3) {
      c[state_at + (size_t)k] = 3;
      break;
    }
  }
  fix_crc(c, len);
  CHECK(load_fails(c, len, "completions"));
  /* A chunk completed twice in a kept epoch. */
  memcpy(c, b, len);
  c[80 + REC + REC + 2] = 2;
  fix_crc(c, len);
  CHECK(load_fails(c, len, "2 times"));
  /* Counts that disagree with the record's sums. */
  memcpy(c, b, len);
  for (int k = 0; k < K; k++) {
    if (c[state_at + (size_t)k] == 0) {
      c[state_at + (size_t)k] = 3;
      c[counts_at + (size_t)k] = 1;
      break;
    }
  }
  fix_crc(c, len);
  CHECK(load_fails(c, len, "record says"));
  /* n_chunks that does not follow from N and C (the length is checked
   * after): 0xffffffff chunks. */
  memcpy(c, b, len);
  memset(c + 40, 0xff, 4);
  fix_crc(c, len);
  CHECK(load_fails(c, len, "chunks"));
  /* Chunk size 0. */
  memcpy(c, b, len);
  memset(c + 20, 0, 4);
  fix_crc(c, len);
  CHECK(load_fails(c, len, "chunk size"));
  /* Epoch beyond the last. */
  memcpy(c, b, len);
  c[44] = 9;
  fix_crc(c, len);
  CHECK(load_fails(c, len, NULL));
  /* Too many records. */
  memcpy(c, b, len);
  c[76] = 200;
  fix_crc(c, len);
  CHECK(load_fails(c, len, "records"));
  /* History out of order. */
  memcpy(c, b, len);
  c[80 + REC] = 0; /* newest kept record claims epoch 0 */
  fix_crc(c, len);
  CHECK(load_fails(c, len, "kept record"));
  /* A redone flag that is not 0 or 1. */
  memcpy(c, b, len);
  c[redone_at + 1] = 2;
  fix_crc(c, len);
  CHECK(load_fails(c, len, "redone flag 2"));
  /* A flag the current record's examples_redone does not hold (and the
   * other way round). */
  memcpy(c, b, len);
  c[redone_at + 1] = 1;
  fix_crc(c, len);
  CHECK(load_fails(c, len, "examples redone"));
  memcpy(c, b, len);
  c[80 + 64] = 4; /* the current record's examples_redone */
  fix_crc(c, len);
  CHECK(load_fails(c, len, "examples redone"));
  /* More examples redone in a kept epoch than it has. */
  memcpy(c, b, len);
  c[80 + REC + 64] = 38;
  fix_crc(c, len);
  CHECK(load_fails(c, len, "more than the 37"));
  /* The untouched blob loads. */
  memcpy(c, b, len);
  {
    char err[PS_ERRLEN] = "";
    ps_leases *ok = ps_leases_load(c, len, err);
    CHECK_MSG(ok != NULL, "%s", err);
    ps_leases_destroy(ok);
  }
  free(c);
  free(b);
}

/* ---------------------------------------------------------------- redone */

/* A copy of t as a checkpoint holds it: saved and loaded back (t stays). */
static ps_leases *restored_copy(ps_leases *t) {
  void *buf = NULL;
  size_t len = 0;
  CHECK(ps_leases_save(t, &buf, &len) == PS_OK);
  if (!buf) return NULL;
  char err[PS_ERRLEN] = "";
  ps_leases *back = ps_leases_load(buf, len, err);
  CHECK_MSG(back != NULL, "%s", err);
  free(buf);
  return back;
}

static uint64_t packed(uint32_t epoch, uint32_t chunk) { return (uint64_t)epoch << 32 | chunk; }

/* A worker registering again after a restore from a checkpoint names its
 * acknowledged completions and the leases it holds. What nobody else holds
 * stays the worker's: done chunks and finished leases are taken as done
 * (recovered), unfinished leases are leased to it again under their ids. A
 * done chunk another worker holds since is counted redone, once. Kept in
 * checkpoints; reset when the epoch ends. */
static void test_rejoin(void) {
  enum { N = 95, C = 10, K = 10 };
  ps_leases *t = make(N, C, 3, 11, 2);
  if (!t) return;
  ps_lease_rejoin r;
  uint64_t one = 0;
  ps_lease_held none = {0};
  CHECK(ps_leases_rejoin(NULL, 1, NULL, 0, NULL, 0, 0, &r) == PS_EINVAL);
  CHECK(ps_leases_rejoin(t, 1, NULL, 1, NULL, 0, 0, &r) == PS_EINVAL);
  CHECK(ps_leases_rejoin(t, 1, NULL, 0, NULL, 1, 0, &r) == PS_EINVAL);
  CHECK(ps_leases_rejoin(t, 1, &one, 0, &none, 0, 0, NULL) == PS_OK);
  /* Before the checkpoint: a, b done; c (worker 1) and p (worker 2)
   * outstanding. */
  ps_lease a, b, c, p, d, e, g, h;
  CHECK(ps_leases_acquire(t, 1, 0, &a) == PS_OK &&
        ps_leases_complete(t, 1, a.lease_id, 1) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 2, &b) == PS_OK &&
        ps_leases_complete(t, 1, b.lease_id, 3) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 4, &c) == PS_OK);
  CHECK(ps_leases_acquire(t, 2, 4, &p) == PS_OK);
  ps_leases *back = restored_copy(t);
  if (!back) {
    ps_leases_destroy(t);
    return;
  }
  /* After it: c, p, d and e acknowledged; g (worker 2) held; h (worker 1)
   * completed as the table died, the answer lost. */
  CHECK(ps_leases_complete(t, 1, c.lease_id, 5) == PS_OK);
  CHECK(ps_leases_complete(t, 2, p.lease_id, 5) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 6, &d) == PS_OK &&
        ps_leases_complete(t, 1, d.lease_id, 7) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 8, &e) == PS_OK &&
        ps_leases_complete(t, 1, e.lease_id, 9) == PS_OK);
  CHECK(ps_leases_acquire(t, 2, 9, &g) == PS_OK);
  CHECK(ps_leases_acquire(t, 1, 9, &h) == PS_OK &&
        ps_leases_complete(t, 1, h.lease_id, 9) == PS_OK);
  ps_leases_destroy(t);
  t = back; /* the restart */
  /* Worker 3 registers first and takes c from the pool. */
  ps_lease m;
  CHECK(ps_leases_acquire(t, 3, 10, &m) == PS_OK && m.chunk == c.chunk);
  uint64_t w1_done[] = {packed(0, a.chunk), packed(0, b.chunk), packed(0, c.chunk),
                        packed(0, d.chunk), packed(0, e.chunk)};
  ps_lease_held w1_held[] = {{.lease_id = h.lease_id, .epoch = 0, .chunk = h.chunk, .finished = 1}};
  CHECK(ps_leases_rejoin(t, 1, w1_done, 5, w1_held, 1, 11, &r) == PS_OK);
  /* a, b done; c worker 3's now: redone; d, e and h taken as done. */
  CHECK(r.accepted == 3 && r.adopted == 0 && r.redone == 1);
  CHECK(r.examples_accepted == (uint64_t)d.count + e.count + h.count);
  CHECK(r.examples_redone == c.count);
  uint64_t w2_done[] = {packed(0, p.chunk)};
  ps_lease_held w2_held[] = {{.lease_id = g.lease_id, .epoch = 0, .chunk = g.chunk, .finished = 0}};
  CHECK(ps_leases_rejoin(t, 2, w2_done, 1, w2_held, 1, 12, &r) == PS_OK);
  CHECK(r.accepted == 1 && r.adopted == 1 && r.redone == 0);
  ps_lease_stats s = stats_of(t);
  CHECK(s.current.examples_recovered == (uint64_t)d.count + e.count + h.count + p.count);
  CHECK(s.current.examples_redone == c.count);
  CHECK(s.chunks_done == 2 + 4 && s.chunks_leased == 2);
  /* The retried completion of h is answered as counted (once); g's and
   * c's count. */
  CHECK(ps_leases_complete(t, 1, h.lease_id, 13) == PS_OK);
  CHECK(ps_leases_complete(t, 2, g.lease_id, 13) == PS_OK);
  CHECK(ps_leases_complete(t, 3, m.lease_id, 13) == PS_OK);
  s = stats_of(t);
  CHECK(s.chunks_done == 2 + 4 + 2 && s.chunks_leased == 0);
  CHECK(s.current.chunks_completed == 8 && s.current.chunks_once == 8);
  /* Idempotent: the same names again change nothing. */
  ps_lease_stats before = stats_of(t);
  CHECK(ps_leases_rejoin(t, 1, w1_done, 5, w1_held, 1, 14, &r) == PS_OK);
  CHECK(r.accepted == 0 && r.adopted == 0 && r.redone == 0);
  CHECK(ps_leases_rejoin(t, 2, w2_done, 1, w2_held, 1, 14, &r) == PS_OK);
  CHECK(r.accepted == 0 && r.adopted == 0 && r.redone == 0);
  s = stats_of(t);
  CHECK(same_state(&s, &before));
  /* A held lease on a chunk another worker holds is not taken: its
   * completion is refused, and the examples trained of it are wasted. */
  ps_lease q;
  CHECK(ps_leases_acquire(t, 4, 15, &q) == PS_OK);
  ps_lease_held stale = {.lease_id = 0xfeedull, .epoch = 0, .chunk = q.chunk, .finished = 0};
  CHECK(ps_leases_rejoin(t, 5, NULL, 0, &stale, 1, 15, &r) == PS_OK && r.adopted == 0);
  CHECK(ps_leases_complete(t, 5, 0xfeedull, 16) == PS_ENOTFOUND);
  ps_leases_note_refused(t, 5, 0xfeedull, q.count);
  ps_leases_note_refused(t, 5, 0xfeedull, 0);
  ps_leases_note_refused(NULL, 5, 0xfeedull, 5);
  CHECK(stats_of(t).current.examples_wasted == q.count);
  /* Reported again (a retry, or named again when registering): once. */
  ps_leases_note_refused(t, 5, 0xfeedull, q.count);
  ps_lease_held named_refused = {
      .lease_id = 0xfeedull, .epoch = 0, .chunk = q.chunk, .trained = q.count, .refused = 1};
  CHECK(ps_leases_rejoin(t, 5, NULL, 0, &named_refused, 1, 15, &r) == PS_OK);
  CHECK(stats_of(t).current.examples_wasted == q.count);
  /* A lease of this life is the table's (its own completion settles it),
   * and epochs other than this one and the next, chunks out of range and
   * id 0 are ignored. */
  ps_lease_held odd[] = {{.lease_id = q.lease_id, .epoch = 0, .chunk = q.chunk, .finished = 1},
                         {.lease_id = 77, .epoch = 2, .chunk = 0, .finished = 1},
                         {.lease_id = 78, .epoch = 0, .chunk = K, .finished = 1},
                         {.lease_id = 79, .epoch = 1, .chunk = K, .finished = 1},
                         {.lease_id = 0, .epoch = 0, .chunk = 0, .finished = 1}};
  uint64_t odd_done[] = {packed(2, 0), packed(0, K), packed(1, K), packed(0xffffffffu, 0)};
  before = stats_of(t);
  CHECK(ps_leases_rejoin(t, 4, odd_done, 4, odd, 5, 17, &r) == PS_OK);
  CHECK(r.accepted == 0 && r.adopted == 0 && r.redone == 0);
  s = stats_of(t);
  CHECK(same_state(&s, &before));

  /* Saved and loaded: the figures and the redone flags. */
  uint64_t recovered = s.current.examples_recovered, redone = s.current.examples_redone;
  uint64_t wasted = s.current.examples_wasted;
  t = round_trip(t);
  if (!t) return;
  s = stats_of(t);
  CHECK(s.current.examples_recovered == recovered && s.current.examples_redone == redone &&
        s.current.examples_wasted == wasted);
  /* The rest of the epoch; its record keeps the figures, the next epoch
   * starts at 0. */
  for (int guard = 0; guard < 100 && stats_of(t).epoch == 0; guard++) {
    ps_lease l;
    if (ps_leases_acquire(t, 6, 20, &l) != PS_OK) break;
    CHECK(ps_leases_complete(t, 6, l.lease_id, 21) == PS_OK);
  }
  s = stats_of(t);
  CHECK(s.epoch == 1 && s.n_history == 1);
  CHECK(s.history[0].examples_recovered == recovered && s.history[0].examples_redone == redone &&
        s.history[0].examples_wasted == wasted);
  CHECK(s.current.examples_recovered == 0 && s.current.examples_redone == 0 &&
        s.current.examples_wasted == 0);
  ps_lease_epoch_record rec;
  CHECK(ps_leases_epoch_record(t, 0, &rec, NULL, 0) == K);
  CHECK(rec.finished && rec.chunks_once == K && rec.chunks_completed == K &&
        rec.examples_completed == N);
  /* Epoch 0's names mean nothing now. */
  CHECK(ps_leases_rejoin(t, 1, w1_done, 5, w1_held, 1, 22, &r) == PS_OK);
  CHECK(r.accepted == 0 && r.adopted == 0 && r.redone == 0);
  /* The chunk that ends an epoch, taken as done, begins the next. */
  for (int guard = 0; guard < 100 && stats_of(t).chunks_done < K - 1; guard++) {
    ps_lease l;
    if (ps_leases_acquire(t, 6, 30, &l) != PS_OK) break;
    CHECK(ps_leases_complete(t, 6, l.lease_id, 31) == PS_OK);
  }
  s = stats_of(t);
  CHECK(s.epoch == 1 && s.chunks_done == K - 1);
  uint32_t last = K;
  for (uint32_t k = 0; k < K && last == K; k++) {
    uint8_t counts[K];
    ps_leases_epoch_record(t, 1, NULL, counts, K);
    if (!counts[k]) last = k;
  }
  /* ... with a chunk of the next epoch that a life ahead of this one saw
   * finished: done (recovered) as soon as that epoch begins. */
  uint64_t last_done[] = {packed(1, last), packed(2, 3)};
  CHECK(ps_leases_rejoin(t, 7, last_done, 2, NULL, 0, 32, &r) == PS_OK && r.accepted == 1);
  s = stats_of(t);
  CHECK(s.epoch == 2 && s.n_history == 2 && s.history[0].examples_recovered > 0);
  CHECK(s.chunks_done == 1 && s.current.chunks_completed == 1 && s.current.examples_recovered == C);
  uint8_t c2[K];
  CHECK(ps_leases_epoch_record(t, 2, NULL, c2, K) == K && c2[3] == 1);
  ps_leases_destroy(t);
}

/* An older blob from a version 4 blob of a table with nothing redone,
 * recovered, wasted or abandoned: version 3 drops the records' last 8
 * bytes (examples_abandoned) and the counts after the next-epoch flags,
 * version 2 also the records' examples_recovered and examples_wasted and
 * everything after the redone flags, version 1 also the records'
 * examples_redone and the redone flags; its version, its checksum.
 * Returns its length. */
static size_t to_older(const uint8_t *b, size_t len, uint8_t *out, int version) {
  enum { HEAD = 80, REC4 = 96 };
  const size_t rec = version == 1 ? 64 : version == 2 ? 72 : 88;
  uint32_t n_chunks =
      (uint32_t)b[40] | (uint32_t)b[41] << 8 | (uint32_t)b[42] << 16 | (uint32_t)b[43] << 24;
  uint32_t n_history = b[76];
  const uint8_t *p = b;
  uint8_t *q = out;
  memcpy(q, p, HEAD);
  q[8] = (uint8_t)version;
  p += HEAD;
  q += HEAD;
  for (uint32_t i = 0; i <= n_history; i++) {
    memcpy(q, p, rec);
    p += REC4;
    q += rec;
    if (i == 0) continue; /* the current record has no counts of its own here */
    memcpy(q, p, n_chunks);
    p += n_chunks;
    q += n_chunks;
  }
  /* state, counts, and (version 2) the redone flags; (version 3) the
   * leases, the pool and the next-epoch flags; not the counts after them */
  const uint8_t *nl = p + 3 * (size_t)n_chunks;
  uint32_t n_leases = (uint32_t)nl[0] | (uint32_t)nl[1] << 8;
  const uint8_t *pl = nl + 4 + 28 * (size_t)n_leases;
  uint32_t pool_len = (uint32_t)pl[0] | (uint32_t)pl[1] << 8;
  const uint8_t *acct = pl + 4 + 4 * (size_t)pool_len + n_chunks;
  const uint8_t *na = acct + 4 * (size_t)n_leases;
  uint32_t n_acct = (uint32_t)na[0] | (uint32_t)na[1] << 8;
  CHECK(na + 4 + 36 * (size_t)n_acct + 4 == b + len);
  const size_t tail =
      version == 3 ? (size_t)(acct - p) : (size_t)(version == 1 ? 2 : 3) * (size_t)n_chunks;
  memcpy(q, p, tail);
  q += tail;
  size_t n = (size_t)(q - out) + 4;
  fix_crc(out, n);
  return n;
}

static size_t to_version1(const uint8_t *b, size_t len, uint8_t *out) {
  return to_older(b, len, out, 1);
}

/* A pooled chunk taken back by a rejoining worker leaves the pool: when it
 * is reclaimed again it is in the pool once. Before, each round left one
 * more entry, until the pool held more entries than the table has chunks
 * (the ring overrun, and a saved blob its own loader refused). */
static void test_rejoin_pooled_again(void) {
  enum { N = 30, C = 10, ROUNDS = 5 };
  ps_leases *t = make(N, C, 2, 5, 3);
  if (!t) return;
  ps_lease l;
  CHECK(ps_leases_acquire(t, 1, 0, &l) == PS_OK);
  const uint32_t chunk = l.chunk;
  int64_t now = 0;
  for (int round = 0; round < ROUNDS; round++) {
    now += 1000;
    CHECK(ps_leases_expire(t, now, 500) == 1); /* reclaimed: into the pool */
    ps_lease_held h = {.lease_id = 1000 + (uint64_t)round, .epoch = 0, .chunk = chunk};
    ps_lease_rejoin r;
    CHECK(ps_leases_rejoin(t, 2, NULL, 0, &h, 1, now, &r) == PS_OK && r.adopted == 1);
  }
  now += 1000;
  CHECK(ps_leases_expire(t, now, 500) == 1);
  ps_leases *back = restored_copy(t);
  CHECK(back != NULL);
  /* Each of the three chunks is handed out once, the pooled one first. */
  ps_leases *tables[] = {t, back};
  for (int k = 0; k < 2 && back; k++) {
    uint32_t seen = 0;
    for (int i = 0; i < 3; i++) {
      ps_lease m;
      CHECK(ps_leases_acquire(tables[k], 10 + (uint64_t)i, now, &m) == PS_OK);
      CHECK(i > 0 || m.chunk == chunk);
      CHECK(!(seen >> m.chunk & 1));
      seen |= 1u << m.chunk;
    }
    ps_lease none;
    CHECK(ps_leases_acquire(tables[k], 20, now, &none) == PS_LEASE_WAIT);
  }
  ps_leases_destroy(back);
  ps_leases_destroy(t);
}

static void test_load_version1(void) {
  enum { N = 95, C = 10, K = 10 };
  ps_leases *t = make(N, C, 3, 5, 2);
  if (!t) return;
  /* Epoch 0 done, epoch 1 with 3 done, one reclaimed, one outstanding. */
  for (int i = 0; i < K + 3; i++) {
    ps_lease l;
    CHECK(ps_leases_acquire(t, 1, i, &l) == PS_OK &&
          ps_leases_complete(t, 1, l.lease_id, i) == PS_OK);
  }
  ps_lease l1, l2;
  CHECK(ps_leases_acquire(t, 2, 20, &l1) == PS_OK && ps_leases_release_worker(t, 2) == 1);
  CHECK(ps_leases_acquire(t, 3, 21, &l2) == PS_OK);
  uint8_t *b = NULL;
  size_t len = 0;
  CHECK(ps_leases_save(t, (void **)&b, &len) == PS_OK);
  if (!b) {
    ps_leases_destroy(t);
    return;
  }
  uint8_t *v1 = malloc(len);
  if (!v1) {
    free(b);
    ps_leases_destroy(t);
    return;
  }
  size_t n1 = to_version1(b, len, v1);
  CHECK(n1 == 80 + 64 + 1 * (64 + K) + 2 * K + 4);
  char err[PS_ERRLEN] = "";
  ps_leases *old = ps_leases_load(v1, n1, err);
  CHECK_MSG(old != NULL, "%s", err);
  ps_leases *now = ps_leases_load(b, len, err);
  CHECK_MSG(now != NULL, "%s", err);
  if (old && now) {
    ps_lease_stats so = stats_of(old), sn = stats_of(now);
    CHECK(same_state(&so, &sn));
    CHECK(so.current.examples_redone == 0 && so.history[0].examples_redone == 0);
    CHECK(so.current.examples_rehanded == sn.current.examples_rehanded);
    CHECK(so.history[0].end_ms == sn.history[0].end_ms);
    check_epoch_exactly_once(old, 0, N);
    /* It goes on as the table it was saved from: saved again, it is a
     * version 2 blob. */
    uint8_t *b2 = NULL;
    size_t len2 = 0;
    uint8_t *b3 = NULL;
    size_t len3 = 0;
    CHECK(ps_leases_save(old, (void **)&b2, &len2) == PS_OK && b2 && b2[8] == 4);
    CHECK(ps_leases_save(now, (void **)&b3, &len3) == PS_OK && len2 == len3);
    free(b3);
    free(b2);
    ps_lease m;
    CHECK(ps_leases_acquire(old, 4, 30, &m) == PS_OK && ps_leases_acquire(now, 4, 30, &m) == PS_OK);
  }
  ps_leases_destroy(old);
  ps_leases_destroy(now);
  /* Version 1 blobs are checked as strictly: every truncation, and a
   * bit of the history's counts (with the checksum fixed). */
  int all = 1;
  for (size_t n = 0; n < n1; n++) all &= load_fails(v1, n, NULL);
  CHECK_MSG(all, "a truncated version 1 blob loaded");
  v1[80 + 64 + 64 + 1] = 2;
  fix_crc(v1, n1);
  CHECK(load_fails(v1, n1, "2 times"));
  /* Version 2 (examples_redone, no examples_recovered nor _wasted) loads
   * too, as the same table. */
  size_t n2 = to_older(b, len, v1, 2);
  CHECK(n2 == 80 + 72 + 1 * (72 + K) + 3 * K + 4);
  ps_leases *v2t = ps_leases_load(v1, n2, err);
  CHECK_MSG(v2t != NULL, "%s", err);
  if (v2t) {
    ps_leases *cur = ps_leases_load(b, len, err);
    if (cur) {
      ps_lease_stats s2 = stats_of(v2t), sc = stats_of(cur);
      CHECK(same_state(&s2, &sc) && s2.current.examples_recovered == 0 &&
            s2.current.examples_wasted == 0);
      ps_leases_destroy(cur);
    }
    ps_leases_destroy(v2t);
  }
  /* Version 3 (no examples_abandoned, no counts of pushes) loads too. */
  size_t n3 = to_older(b, len, v1, 3);
  ps_leases *v3t = ps_leases_load(v1, n3, err);
  CHECK_MSG(v3t != NULL, "%s", err);
  if (v3t) {
    ps_leases *cur = ps_leases_load(b, len, err);
    if (cur) {
      ps_lease_stats s3 = stats_of(v3t), sc = stats_of(cur);
      CHECK(same_state(&s3, &sc) && s3.current.examples_abandoned == 0);
      ps_leases_destroy(cur);
    }
    ps_leases_destroy(v3t);
  }
  for (size_t n = 0; n < n3; n++) CHECK(load_fails(v1, n, NULL) || n == n3);
  free(v1);
  free(b);
  ps_leases_destroy(t);
}

/* Workers train leased chunks a batch at a time (each push counted on
 * its lease, ps_leases_note_pushed); shard 0 writes checkpoints and is
 * killed and restored from its last one, at random, sometimes while a
 * completion is on its way (applied by the table that dies, the answer
 * lost). Workers stall (their leases taken back while they go on) and die
 * (their leases taken back, a new worker in their place). The workers
 * register again after a restore naming their acknowledged completions,
 * the leases they hold with what they trained of them, and the leases
 * whose completion was refused (ps_leases_rejoin); they report what they
 * trained of a lease whose completion is not counted
 * (ps_leases_note_refused). Whatever happens, the records account for
 * every example trained, exactly: trained = completed + redone + wasted +
 * abandoned. (A restore forgets the pushes of a worker that died since
 * the checkpoint: nobody can name them; kills restore checkpoints taken
 * after the last death.) */
#ifndef KILLS_MAX
#define KILLS_MAX 6
#endif
static int quiet_sim; /* 1: no line per run */

static void redone_sim(uint64_t seed) {
  enum { N = 600, C = 10, K = 60, E = 3, W = 3, MAXH = 2, ACKED = 1024, B = 4, REF = 64 };
  ps_leases *t = make(N, C, E, seed, MAXH);
  if (!t) return;
  ps_rand rng;
  ps_rand_seed(&rng, seed);
  struct {
    uint64_t id;
    ps_lease held[MAXH];
    int finishing[MAXH]; /* its completion applied, the answer lost */
    uint32_t trained[MAXH];
    int nheld;
    uint64_t acked[ACKED];
    int nacked;
    ps_lease_held refused[REF];
    int nrefused;
    int64_t epoch; /* of acked: the last grant's */
  } w[W];
  memset(w, 0, sizeof w);
  uint64_t next_worker = 1;
  for (int i = 0; i < W; i++) {
    w[i].id = next_worker++;
    w[i].epoch = -1;
  }
  void *ckpt = NULL, *prev = NULL;
  size_t ckpt_len = 0, prev_len = 0;
  uint32_t ckpt_epoch = 0, prev_epoch = 0;
  int ckpt_step = 0, last_kill = -1000, prev_step = 0, last_death = -1;
  uint64_t trained = 0;
  int kills = 0, finished = 0, steps = 0, in_flight_kills = 0, adopted = 0, accepted = 0;
  int back_kills = 0, stalls = 0, deaths = 0; /* back_kills: restores to the epoch before */
  uint64_t max_id = 0;
  while (!finished && steps < 200000) {
    steps++;
    int i = (int)ps_rand_below(&rng, W);
    uint64_t dice = ps_rand_below(&rng, 1000);
    if (dice < 300) {
      if (w[i].nheld == MAXH) continue;
      ps_lease l;
      int rc = ps_leases_acquire(t, w[i].id, steps, &l);
      if (rc == PS_LEASE_FINISHED) finished = 1;
      if (rc != PS_OK) continue;
      if (l.lease_id > max_id) max_id = l.lease_id;
      if (w[i].epoch != (int64_t)l.epoch) { /* as the client: this epoch's and the one before */
        int kept = 0;
        for (int k = 0; k < w[i].nacked; k++)
          if ((w[i].acked[k] >> 32) + 1 >= l.epoch) w[i].acked[kept++] = w[i].acked[k];
        w[i].nacked = kept;
        kept = 0;
        for (int k = 0; k < w[i].nrefused; k++)
          if (w[i].refused[k].epoch + 1 >= l.epoch) w[i].refused[kept++] = w[i].refused[k];
        w[i].nrefused = kept;
      }
      w[i].epoch = l.epoch;
      w[i].finishing[w[i].nheld] = 0;
      w[i].trained[w[i].nheld] = 0;
      w[i].held[w[i].nheld++] = l;
    } else if (dice < 700) {
      /* A batch of the oldest lease not trained through, pushed. */
      for (int k = 0; k < w[i].nheld; k++) {
        uint32_t left = w[i].held[k].count - w[i].trained[k];
        if (left == 0) continue;
        uint32_t n = left < B ? left : B;
        ps_leases_note_pushed(t, w[i].id, w[i].held[k].lease_id, n);
        w[i].trained[k] += n;
        trained += n;
        break;
      }
    } else if (dice < 880) {
      if (w[i].nheld == 0 || w[i].trained[0] < w[i].held[0].count) continue;
      ps_lease l = w[i].held[0];
      memmove(&w[i].held[0], &w[i].held[1], sizeof w[i].held[0]);
      memmove(&w[i].finishing[0], &w[i].finishing[1], sizeof w[i].finishing[0]);
      memmove(&w[i].trained[0], &w[i].trained[1], sizeof w[i].trained[0]);
      w[i].nheld--;
      int rc = ps_leases_complete(t, w[i].id, l.lease_id, steps);
      if (rc != PS_OK) {
        ps_leases_note_refused(t, w[i].id, l.lease_id, l.count);
        if (w[i].nrefused < REF)
          w[i].refused[w[i].nrefused++] = (ps_lease_held){.lease_id = l.lease_id,
                                                          .epoch = l.epoch,
                                                          .chunk = l.chunk,
                                                          .trained = l.count,
                                                          .refused = 1};
      } else if ((int64_t)l.epoch + 1 >= w[i].epoch && w[i].nacked < ACKED) {
        w[i].acked[w[i].nacked++] = packed(l.epoch, l.chunk);
      }
    } else if (dice < 895) {
      /* A stall: the worker's leases are taken back; it goes on with them
       * (a late completion is taken while nobody took the chunk). */
      if (ps_leases_release_worker(t, w[i].id) > 0) stalls++;
    } else if (dice < 900) {
      /* A death: what it pushed stays trained; a new worker in its place. */
      ps_leases_release_worker(t, w[i].id);
      memset(&w[i], 0, sizeof w[i]);
      w[i].id = next_worker++;
      w[i].epoch = -1;
      last_death = steps;
      deaths++;
    } else if (dice < 970) {
      /* The last checkpoint of an epoch is kept when the next epoch's
       * first is written: some kills restore it (the epoch before). */
      if (ckpt && ckpt_epoch != stats_of(t).epoch) {
        free(prev);
        prev = ckpt;
        prev_len = ckpt_len;
        prev_epoch = ckpt_epoch;
        prev_step = ckpt_step;
      } else {
        free(ckpt);
      }
      ckpt = NULL;
      CHECK(ps_leases_save(t, &ckpt, &ckpt_len) == PS_OK);
      ckpt_epoch = stats_of(t).epoch;
      ckpt_step = steps;
    } else if (ckpt && kills < KILLS_MAX && ckpt_epoch + 1 >= stats_of(t).epoch &&
               ckpt_step > last_kill + 200 && ckpt_step > last_death) {
      /* A kill restores a checkpoint of the current epoch or the one
       * before (the workers name the completions of both), written a while
       * after the last restart. Sometimes a completion is on its way: the
       * dying table applies it, its answer is lost. */
      last_kill = steps;
      if (w[i].nheld && w[i].trained[0] == w[i].held[0].count && ps_rand_below(&rng, 2) &&
          ps_leases_complete(t, w[i].id, w[i].held[0].lease_id, steps) == PS_OK) {
        w[i].finishing[0] = 1;
        in_flight_kills++;
      }
      const void *from = ckpt;
      size_t from_len = ckpt_len;
      /* Never one older than the last restart: a restart's life made
       * records (wasted examples) that a restore to an earlier state
       * would forget, and the newest complete set is always taken. */
      if (prev && prev_epoch + 1 == stats_of(t).epoch && prev_step > last_kill &&
          prev_step > last_death && ps_rand_below(&rng, 2)) {
        from = prev;
        from_len = prev_len;
      }
      back_kills += from == prev || ckpt_epoch < stats_of(t).epoch;
      /* A restored life's ids start past the wall clock's second (ids of
       * every earlier life are below it); a simulation restores within the
       * second, so it starts past the ids handed out. */
      uint8_t *blob = malloc(from_len);
      if (!blob) break;
      memcpy(blob, from, from_len);
      for (int k = 0; k < 8; k++) blob[52 + k] = (uint8_t)((max_id + 1) >> (8 * k));
      fix_crc(blob, from_len);
      char err[PS_ERRLEN] = "";
      ps_leases *back = ps_leases_load(blob, from_len, err);
      free(blob);
      CHECK_MSG(back != NULL, "%s", err);
      if (!back) break;
      ps_leases_destroy(t);
      t = back;
      kills++;
      /* The workers register again, in turn, naming what they did. */
      for (int j = 0; j < W; j++) {
        ps_lease_held h[MAXH + REF];
        int n = 0;
        for (int k = 0; k < w[j].nheld; k++)
          h[n++] = (ps_lease_held){.lease_id = w[j].held[k].lease_id,
                                   .epoch = w[j].held[k].epoch,
                                   .chunk = w[j].held[k].chunk,
                                   .finished = w[j].finishing[k],
                                   .trained = w[j].trained[k]};
        for (int k = 0; k < w[j].nrefused; k++) h[n++] = w[j].refused[k];
        ps_lease_rejoin r;
        CHECK(ps_leases_rejoin(t, w[j].id, w[j].acked, (size_t)w[j].nacked, h, (size_t)n, steps,
                               &r) == PS_OK);
        adopted += r.adopted;
        accepted += r.accepted;
      }
    }
  }
  free(ckpt);
  free(prev);
  CHECK_MSG(finished, "seed %llu: not finished in %d steps", (unsigned long long)seed, steps);
  /* A worker still holding a lease (of a life a restore forgot, or taken
   * back) trains it through and reports it, as ps-worker does before it
   * hears that the data is done. */
  for (int i = 0; i < W; i++)
    for (int k = 0; k < w[i].nheld; k++) {
      uint32_t left = w[i].held[k].count - w[i].trained[k];
      ps_leases_note_pushed(t, w[i].id, w[i].held[k].lease_id, left);
      trained += left;
      int rc = ps_leases_complete(t, w[i].id, w[i].held[k].lease_id, steps);
      if (rc != PS_OK)
        ps_leases_note_refused(t, w[i].id, w[i].held[k].lease_id, w[i].held[k].count);
    }
  uint64_t completed = 0, redone = 0, wasted = 0, recovered = 0, abandoned = 0;
  for (uint32_t e = 0; e < E; e++) {
    ps_lease_epoch_record r;
    CHECK(ps_leases_epoch_record(t, e, &r, NULL, 0) == K);
    CHECK(r.finished && r.chunks_once == K && r.examples_completed == N);
    completed += r.examples_completed;
    redone += r.examples_redone;
    wasted += r.examples_wasted;
    recovered += r.examples_recovered;
    abandoned += r.examples_abandoned;
  }
  CHECK_MSG(trained == completed + redone + wasted + abandoned,
            "seed %llu: %llu trained, the records %llu completed + %llu redone + %llu wasted + "
            "%llu abandoned",
            (unsigned long long)seed, (unsigned long long)trained, (unsigned long long)completed,
            (unsigned long long)redone, (unsigned long long)wasted, (unsigned long long)abandoned);
  if (!quiet_sim)
    fprintf(
        stderr,
        "  rejoin sim %llu: %d kills (%d to the epoch before, %d with a completion on its way), "
        "%d stalls, %d deaths; %llu trained = %llu completed (%llu recovered) + %llu redone + "
        "%llu wasted + %llu abandoned; %d leases taken back, %d chunks taken as done\n",
        (unsigned long long)seed, kills, back_kills, in_flight_kills, stalls, deaths,
        (unsigned long long)trained, (unsigned long long)completed, (unsigned long long)recovered,
        (unsigned long long)redone, (unsigned long long)wasted, (unsigned long long)abandoned,
        adopted, accepted);
  CHECK(kills >= 2 && adopted + accepted > 0 && abandoned > 0);
  ps_leases_destroy(t);
}

static void test_redone_sim(void) {
  static const uint64_t seeds[] = {1, 42, 20240607, 7, 99, 12345, 31337, 2026, 5, 11};
  for (size_t k = 0; k < sizeof seeds / sizeof seeds[0]; k++) redone_sim(seeds[k]);
  /* And 200 more, quietly: these found late counts after the last epoch
   * lost from its record, a lease's late completion taken while a later
   * holder had pushed, and a worker's second lease of a chunk taken for
   * its first. */
  quiet_sim = 1;
  for (uint64_t k = 0; k < 200; k++) redone_sim(1000 + k * 7919);
  quiet_sim = 0;
}

/* ---------------------------------------------------------------- threads */

typedef struct {
  ps_leases *t;
  uint64_t worker;
  uint64_t examples;
} thread_arg;

static void *thread_worker(void *p) {
  thread_arg *a = p;
  /* Bounded in time: a shared machine may stall a thread that holds a lease
   * for a while, and the others wait for it. */
  int64_t give_up = ps_now_ms() + 60000;
  while (ps_now_ms() < give_up) {
    ps_lease l;
    int rc = ps_leases_acquire(a->t, a->worker, ps_now_ms(), &l);
    if (rc == PS_LEASE_FINISHED) break;
    if (rc == PS_LEASE_WAIT) {
      sched_yield();
      continue;
    }
    if (rc != PS_OK) break;
    if (ps_leases_complete(a->t, a->worker, l.lease_id, ps_now_ms()) == PS_OK)
      a->examples += l.count;
  }
  return NULL;
}

static void test_threads(void) {
  enum { N = 1000, C = 7, E = 3, T = 4 };
  ps_leases *t = make(N, C, E, 21, 2);
  if (!t) return;
  pthread_t th[T];
  thread_arg args[T];
  int started = 0;
  for (int i = 0; i < T; i++) {
    args[i] = (thread_arg){.t = t, .worker = 100 + (uint64_t)i, .examples = 0};
    if (pthread_create(&th[i], NULL, thread_worker, &args[i]) == 0)
      started++;
    else
      break;
  }
  CHECK(started == T);
  uint64_t total = 0;
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    total += args[i].examples;
  }
  CHECK(total == (uint64_t)N * E);
  CHECK(stats_of(t).finished);
  for (uint32_t e = 0; e < E; e++) check_epoch_exactly_once(t, e, N);
  ps_leases_destroy(t);
}

/* ---------------------------------------------------------------- churn */

/* 1000 examples in 77 chunks of 13 (the last of 12), 8 epochs (all kept). */
enum { CH_N = 1000, CH_C = 13, CH_K = 77, CH_E = 8, CH_SLOTS = 6, CH_MAXHELD = 2 };

typedef struct {
  int alive;
  int stalled; /* stops heart-beating (its leases expire) */
  uint64_t id;
  ps_lease held[8];
  int nheld;
} churn_worker;

/* Workers join, take leases, complete, die (released) or stall (their
 * leases expire, and they may come back with late results), and the server
 * restarts from checkpoints, at random from `seed`, in a bounded loop. */
static void churn(uint64_t seed) {
  ps_leases *t = make(CH_N, CH_C, CH_E, seed, CH_MAXHELD);
  if (!t) return;
  ps_rand rng;
  ps_rand_seed(&rng, seed);
  churn_worker w[CH_SLOTS];
  memset(w, 0, sizeof w);
  uint64_t next_worker = 1;
  /* The test's own ledger: completions the table accepted. */
  int ledger[CH_E][CH_K];
  memset(ledger, 0, sizeof ledger);
  int64_t now = 0;
  const int64_t timeout = 200;
  int finished = 0, steps = 0, restores = 0, lost = 0, late_ok = 0, invariant_ok = 1;
  while (!finished && steps < 200000) {
    steps++;
    now += 10;
    int i = (int)ps_rand_below(&rng, CH_SLOTS);
    churn_worker *x = &w[i];
    uint64_t dice = ps_rand_below(&rng, 100);
    if (!x->alive) {
      if (dice < 30) {
        memset(x, 0, sizeof *x);
        x->alive = 1;
        x->id = next_worker++;
      }
    } else if (dice < 3) {
      /* Dies: the server releases its leases. */
      int holds = ps_leases_held(t, x->id, NULL, 0);
      CHECK(ps_leases_release_worker(t, x->id) == holds);
      x->alive = 0;
    } else if (dice < 8) {
      x->stalled = !x->stalled;
    } else if (dice < 50 && x->nheld < 8) {
      if (!x->stalled) {
        ps_lease l;
        int rc = ps_leases_acquire(t, x->id, now, &l);
        if (rc == PS_OK)
          x->held[x->nheld++] = l;
        else if (rc == PS_LEASE_FINISHED)
          finished = 1;
        else if (rc != PS_LEASE_WAIT && rc != PS_LEASE_FULL)
          CHECK_MSG(0, "acquire: %d", rc);
      }
    } else if (x->nheld > 0) {
      /* Completes one of its leases, maybe one it lost while stalled. */
      int k = (int)ps_rand_below(&rng, (uint64_t)x->nheld);
      ps_lease l = x->held[k];
      x->held[k] = x->held[--x->nheld];
      int rc = ps_leases_complete(t, x->id, l.lease_id, now);
      if (rc == PS_OK) {
        if (l.epoch < CH_E && l.chunk < CH_K) ledger[l.epoch][l.chunk]++;
        if (x->stalled) late_ok++;
      } else if (rc == PS_LEASE_ELOST || rc == PS_ENOTFOUND) {
        lost++;
      } else {
        CHECK_MSG(0, "complete: %d", rc);
      }
    }
    for (int j = 0; j < CH_SLOTS; j++)
      if (w[j].alive && !w[j].stalled) ps_leases_renew(t, w[j].id, now);
    ps_leases_expire(t, now, timeout);

    /* No chunk leased twice at once; counters agree with the holders. */
    ps_lease_stats s = stats_of(t);
    uint32_t held_total = 0;
    uint8_t leased[CH_K] = {0};
    for (int j = 0; j < CH_SLOTS; j++) {
      if (!w[j].alive) continue;
      ps_lease h[CH_MAXHELD + 1];
      int n = ps_leases_held(t, w[j].id, h, CH_MAXHELD + 1);
      invariant_ok &= n >= 0 && n <= CH_MAXHELD;
      for (int m = 0; m < n && m <= CH_MAXHELD; m++) {
        invariant_ok &= h[m].chunk < CH_K && h[m].epoch == s.epoch;
        if (h[m].chunk < CH_K) invariant_ok &= leased[h[m].chunk]++ == 0;
      }
      held_total += (uint32_t)n;
    }
    invariant_ok &= held_total == s.chunks_leased;
    invariant_ok &= s.chunks_done + s.chunks_leased <= CH_K;

    /* Now and then the server restarts from a checkpoint: every worker's
     * leases are forgotten and they register again. */
    if (steps % 997 == 0 && !finished) {
      t = round_trip(t);
      if (!t) return;
      restores++;
      for (int j = 0; j < CH_SLOTS; j++) {
        w[j].nheld = 0;
        w[j].id = next_worker++;
      }
    }
  }
  CHECK_MSG(finished, "churn did not finish in %d steps", steps);
  CHECK(invariant_ok);
  CHECK(restores > 0 && lost > 0 && late_ok > 0);
  ps_lease_stats s = stats_of(t);
  CHECK(s.finished && s.epoch == CH_E && s.n_history == CH_E);
  CHECK(s.reclaims_total > 0);
  uint64_t reclaims = 0, rehanded = 0;
  int ledger_once = 1;
  for (uint32_t e = 0; e < CH_E; e++) {
    check_epoch_exactly_once(t, e, CH_N);
    ps_lease_epoch_record r;
    CHECK(ps_leases_epoch_record(t, e, &r, NULL, 0) == CH_K);
    reclaims += r.reclaims;
    rehanded += r.examples_rehanded;
    for (int k = 0; k < CH_K; k++) ledger_once &= ledger[e][k] == 1;
  }
  CHECK_MSG(ledger_once, "the test's ledger saw a chunk completed other than once");
  CHECK(reclaims == s.reclaims_total);
  CHECK(rehanded > 0);
  fprintf(stderr, "  churn %llu: %d steps, %d restores, %llu reclaims, %d lost, %d late taken\n",
          (unsigned long long)seed, steps, restores, (unsigned long long)reclaims, lost, late_ok);
  ps_leases_destroy(t);
}

static void test_churn(void) {
  churn(2024);
  churn(7);
  churn(123456789);
}

/* A replica of shard 0 takes its primary's table in place: afterwards it
 * holds what a load of the blob holds (leases outstanding back in the
 * pool), and a bad blob changes nothing. */
static void test_replace(void) {
  ps_leases *a = make(1000, 100, 2, 7, 2);
  ps_leases *b = make(1000, 100, 2, 9, 2);
  ps_lease l;
  CHECK(ps_leases_acquire(a, 1, 0, &l) == PS_OK);
  CHECK(ps_leases_complete(a, 1, l.lease_id, 1) == PS_OK);
  ps_lease out2;
  CHECK(ps_leases_acquire(a, 2, 2, &out2) == PS_OK); /* outstanding */
  CHECK(ps_leases_acquire(b, 3, 0, &l) == PS_OK);
  void *blob = NULL, *got = NULL, *want = NULL, *before = NULL, *after = NULL;
  size_t blob_len = 0, got_len = 0, want_len = 0, before_len = 0, after_len = 0;
  char err[PS_ERRLEN];
  CHECK(ps_leases_save(a, &blob, &blob_len) == PS_OK);
  /* A bad blob: refused, b unchanged. */
  CHECK(ps_leases_save(b, &before, &before_len) == PS_OK);
  ((uint8_t *)blob)[blob_len / 2] ^= 1;
  CHECK(ps_leases_replace(b, blob, blob_len, err) == PS_EINVAL && err[0]);
  CHECK(ps_leases_save(b, &after, &after_len) == PS_OK);
  CHECK(after_len == before_len && memcmp(after, before, after_len) == 0);
  ((uint8_t *)blob)[blob_len / 2] ^= 1;
  CHECK(ps_leases_replace(b, blob, blob_len, err) == PS_OK);
  /* A replica's copy is its primary's table, outstanding lease, pool and
   * next id included: saved, the same bytes. */
  CHECK(ps_leases_save(b, &got, &got_len) == PS_OK && ps_leases_save(a, &want, &want_len) == PS_OK);
  CHECK(got_len == want_len && memcmp(got, want, got_len) == 0);
  ps_lease_stats st;
  ps_leases_stats(b, &st);
  CHECK(st.config.seed == 7 && st.current.chunks_completed == 1 && st.chunks_leased == 1);
  /* It goes on as the primary does: the same grants, and the outstanding
   * lease's completion counts. */
  ps_lease lb, la;
  CHECK(ps_leases_acquire(b, 4, 5, &lb) == PS_OK && ps_leases_acquire(a, 4, 5, &la) == PS_OK);
  CHECK(lb.chunk == la.chunk && lb.lease_id == la.lease_id);
  CHECK(ps_leases_complete(b, 2, out2.lease_id, 6) == PS_OK);
  CHECK(ps_leases_complete(a, 2, out2.lease_id, 6) == PS_OK);
  /* A new life from the same blob (a restore): the lease goes back in the
   * pool, its id unknown, and the ids start anew. */
  ps_leases *c = ps_leases_load(blob, blob_len, err);
  CHECK(c != NULL);
  if (c) {
    ps_lease_stats sc = stats_of(c);
    CHECK(sc.chunks_leased == 0 && sc.current.reclaims == 1);
  }
  free(blob);
  free(got);
  free(want);
  free(before);
  free(after);
  ps_leases_destroy(a);
  ps_leases_destroy(b);
  ps_leases_destroy(c);
}

int main(void) {
  RUN(test_replace);
  RUN(test_config);
  RUN(test_single_worker_epochs);
  RUN(test_chunk_bounds);
  RUN(test_three_workers);
  RUN(test_wait_full_finished);
  RUN(test_release_mid_epoch);
  RUN(test_expire_renew);
  RUN(test_renew_named);
  RUN(test_late_and_lost_completions);
  RUN(test_history_kept);
  RUN(test_save_load);
  RUN(test_load_corrupt);
  RUN(test_rejoin);
  RUN(test_rejoin_pooled_again);
  RUN(test_load_version1);
  RUN(test_redone_sim);
  RUN(test_threads);
  RUN(test_churn);
  return check_summary();
}

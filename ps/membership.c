/* The table of workers a shard knows, as ps/membership.h describes.
 *
 * A plain array in registration order behind one mutex: a job has tens of
 * workers, not thousands, so a linear search costs less than keeping an
 * index in step. Removal keeps the order, so a listing reads in the order
 * workers joined. */
#include "membership.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../common/util.h"

struct ps_membership {
  pthread_mutex_t mu;
  ps_member *members; /* (n), registration order */
  int n, cap;
  int next_rank;
  uint64_t dropped_total;
};

/* A bijective 64-bit finalizer (splitmix64): distinct inputs give distinct
 * ids, and neighbouring inputs give unrelated-looking ones. */
static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

/* Process-wide, so that two tables in one process (tests, several shards in
 * one process) never hand out the same id: ids are mix64(id_base + k*c) for
 * a counter k that no two calls share. */
static pthread_once_t id_once = PTHREAD_ONCE_INIT;
static uint64_t id_base;
static atomic_uint_fast64_t id_counter;

/* Wall time (not the monotonic clock, which restarts at boot) and the pid
 * make a restarted server unlikely to reuse the ids of its previous life,
 * which workers may still hold. */
static void id_base_init(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  id_base = mix64(ns ^ ((uint64_t)getpid() << 40));
}

ps_membership *ps_membership_create(void) {
  ps_membership *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  if (pthread_mutex_init(&m->mu, NULL) != 0) {
    free(m);
    return NULL;
  }
  pthread_once(&id_once, id_base_init);
  return m;
}

void ps_membership_destroy(ps_membership *m) {
  if (!m) return;
  pthread_mutex_destroy(&m->mu);
  free(m->members);
  free(m);
}

/* Index of id in the table, or -1. Called with the lock held. */
/* Evaluators read the parameters but train nothing: they are not counted
 * among the live workers (quorums, clocks). */
static int trains(const ps_member *w) { return strcmp(w->role, "evaluator") != 0; }

static int find(const ps_membership *m, uint64_t id) {
  for (int i = 0; i < m->n; i++)
    if (m->members[i].id == id) return i;
  return -1;
}

/* A fresh id, never 0 and not in the table. Called with the lock held. */
static uint64_t new_id(const ps_membership *m) {
  for (;;) {
    /* The odd multiplier keeps id_base + k*c distinct for every k below
     * 2^64, and mix64 is a bijection, so generated ids never repeat in one
     * process. The table check guards against an explicit id (from shard 0)
     * that happens to equal a generated one. */
    uint64_t k = atomic_fetch_add(&id_counter, 1);
    uint64_t id = mix64(id_base + k * 0x9e3779b97f4a7c15ull);
    if (id != 0 && find(m, id) < 0) return id;
  }
}

int ps_membership_add(ps_membership *m, uint64_t id, const char *host, const char *role,
                      int task_index, int64_t now_ms, uint64_t *id_out, int *rank_out) {
  pthread_mutex_lock(&m->mu);
  int at = id ? find(m, id) : -1;
  ps_member *w;
  if (at >= 0) {
    /* Known id: a worker registering again after a lost reply or a
     * restart of its own keeps its rank and counters. */
    w = &m->members[at];
  } else {
    if (m->n == m->cap) {
      int cap = m->cap ? m->cap * 2 : 16;
      ps_member *grown = realloc(m->members, (size_t)cap * sizeof *grown);
      if (!grown) {
        pthread_mutex_unlock(&m->mu);
        return PS_ENOMEM;
      }
      m->members = grown;
      m->cap = cap;
    }
    /* A newcomer's clock starts at the slowest live worker's, so that
     * under bounded staleness it neither holds the others back nor runs
     * ahead of them. */
    uint64_t min_clock = 0;
    int seen = 0;
    for (int i = 0; i < m->n; i++)
      if (trains(&m->members[i]) && (!seen++ || m->members[i].clock < min_clock))
        min_clock = m->members[i].clock;
    w = &m->members[m->n++];
    memset(w, 0, sizeof *w);
    w->clock = min_clock;
    w->id = id ? id : new_id(m);
    w->rank = m->next_rank++;
  }
  snprintf(w->host, sizeof w->host, "%s", host ? host : "");
  snprintf(w->role, sizeof w->role, "%s", role ? role : "");
  w->task_index = task_index;
  w->last_seen_ms = now_ms;
  if (id_out) *id_out = w->id;
  if (rank_out) *rank_out = w->rank;
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

/* Shared by touch and note_push. */
static int touch(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms, int push) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  if (at < 0) {
    pthread_mutex_unlock(&m->mu);
    return PS_ENOTFOUND;
  }
  ps_member *w = &m->members[at];
  w->last_seen_ms = now_ms;
  if (step != UINT64_MAX) w->step = step;
  if (push) {
    w->pushes++;
    w->clock++;
  }
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

int ps_membership_clock(ps_membership *m, uint64_t id, uint64_t *clock, uint64_t *min_clock) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  if (at < 0) {
    pthread_mutex_unlock(&m->mu);
    return PS_ENOTFOUND;
  }
  uint64_t lo = m->members[at].clock;
  for (int i = 0; i < m->n; i++)
    if (trains(&m->members[i]) && m->members[i].clock < lo) lo = m->members[i].clock;
  *clock = m->members[at].clock;
  *min_clock = lo;
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

int ps_membership_touch(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms) {
  return touch(m, id, step, now_ms, 0);
}

int ps_membership_note_push(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms) {
  return touch(m, id, step, now_ms, 1);
}

int ps_membership_remove(ps_membership *m, uint64_t id) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  if (at < 0) {
    pthread_mutex_unlock(&m->mu);
    return PS_ENOTFOUND;
  }
  memmove(&m->members[at], &m->members[at + 1], (size_t)(m->n - at - 1) * sizeof(ps_member));
  m->n--;
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

int ps_membership_sweep(ps_membership *m, int64_t now_ms, int timeout_ms, uint64_t *dropped,
                        int max) {
  pthread_mutex_lock(&m->mu);
  int kept = 0, gone = 0;
  /* Compacts in place, keeping the registration order of the survivors. */
  for (int i = 0; i < m->n; i++) {
    ps_member *w = &m->members[i];
    if (now_ms - w->last_seen_ms > (int64_t)timeout_ms) {
      if (dropped && gone < max) dropped[gone] = w->id;
      gone++;
    } else {
      if (kept != i) m->members[kept] = *w;
      kept++;
    }
  }
  m->n = kept;
  m->dropped_total += (uint64_t)gone;
  pthread_mutex_unlock(&m->mu);
  return gone;
}

int ps_membership_count(ps_membership *m) {
  pthread_mutex_lock(&m->mu);
  int n = 0;
  for (int i = 0; i < m->n; i++) n += trains(&m->members[i]);
  pthread_mutex_unlock(&m->mu);
  return n;
}

int ps_membership_list(ps_membership *m, ps_member *out, int max) {
  pthread_mutex_lock(&m->mu);
  int n = m->n < max ? m->n : max;
  if (n > 0) memcpy(out, m->members, (size_t)n * sizeof *out);
  pthread_mutex_unlock(&m->mu);
  return n < 0 ? 0 : n;
}

uint64_t ps_membership_dropped_total(ps_membership *m) {
  pthread_mutex_lock(&m->mu);
  uint64_t d = m->dropped_total;
  pthread_mutex_unlock(&m->mu);
  return d;
}

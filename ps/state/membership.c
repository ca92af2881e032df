/* The table of workers a shard knows, as ps/state/membership.h describes.
 *
 * A plain array in registration order behind one mutex: a job has tens of
 * workers, not thousands, so a linear search costs less than keeping an
 * index in step. Removal keeps the order, so a listing reads in the order
 * workers joined. */
#include "ps/state/membership.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* A worker's recent request ids, in a ring. */
typedef struct {
  uint64_t id;
  int kind;
  int state; /* 0 free, 1 pending, 2 answered, 3 applied and its answer staged (a replicated
                shard: answered once every replica has it; pending until then) */
  size_t len;
  uint8_t reply[PS_REPLY_MAX];
} recent_slot;

struct ps_recent {
  recent_slot slot[PS_RECENT_REQUESTS];
  int next;
};

struct ps_membership {
  pthread_mutex_t mu;
  ps_member *members; /* (n), registration order */
  int n, cap;
  int next_rank;
  int limit; /* 0: none */
  uint64_t dropped_total;
  /* Push rounds restored from a checkpoint, given to those workers when
   * they register again. */
  uint64_t *seed_id, *seed_round;
  int n_seed;
};

ps_membership *ps_membership_create(void) {
  ps_membership *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  if (pthread_mutex_init(&m->mu, NULL) != 0) {
    free(m);
    return NULL;
  }
  return m;
}

void ps_membership_set_limit(ps_membership *m, int max) {
  pthread_mutex_lock(&m->mu);
  m->limit = max > 0 ? max : 0;
  pthread_mutex_unlock(&m->mu);
}

void ps_membership_destroy(ps_membership *m) {
  if (!m) return;
  pthread_mutex_destroy(&m->mu);
  for (int i = 0; i < m->n; i++) free(m->members[i].recent);
  free(m->members);
  free(m->seed_id);
  free(m->seed_round);
  free(m);
}

/* Index of id in the table, or -1. Called with the lock held. */
/* Evaluators read the parameters but train nothing: they are not counted
 * among the live workers (quorums, clocks). */
static int is_trainer(const ps_member *w) { return strcmp(w->role, "evaluator") != 0; }
static int trains(const ps_member *w) { return is_trainer(w) && !w->idle; }

/* Back from idle: not behind the slowest active worker. Lock held. */
static void wake(ps_membership *m, ps_member *w) {
  w->idle = 0;
  int seen = 0;
  uint64_t lo = 0;
  for (int i = 0; i < m->n; i++) {
    const ps_member *o = &m->members[i];
    if (o != w && trains(o) && (!seen++ || o->clock < lo)) lo = o->clock;
  }
  if (seen && lo > w->clock) w->clock = lo;
}

static int find(const ps_membership *m, uint64_t id) {
  for (int i = 0; i < m->n; i++)
    if (m->members[i].id == id) return i;
  return -1;
}

/* A fresh id from the kernel's random source, never 0 and not in the
 * table: unpredictable, so an id is no use to anyone who was not told it.
 * Called with the lock held. PS_EIO when no random bytes can be had. */
static int new_id(const ps_membership *m, uint64_t *out) {
  for (int tries = 0; tries < 64; tries++) {
    uint64_t id;
    if (ps_random_bytes(&id, sizeof id) != 0) return PS_EIO;
    if (id != 0 && find(m, id) < 0) {
      *out = id;
      return PS_OK;
    }
  }
  return PS_EIO;
}

int ps_membership_add(ps_membership *m, uint64_t id, const char *host, const char *role,
                      int task_index, int64_t now_ms, uint64_t *id_out, int *rank_out) {
  return ps_membership_join(m, id, host, role, task_index, now_ms, NULL, id_out, rank_out, NULL);
}

int ps_membership_join(ps_membership *m, uint64_t id, const char *host, const char *role,
                       int task_index, int64_t now_ms, const ps_member_cred *cred,
                       uint64_t *id_out, int *rank_out, uint8_t *session_out) {
  pthread_mutex_lock(&m->mu);
  int at = id ? find(m, id) : -1;
  ps_member *w;
  if (at >= 0) {
    /* Known id: a worker registering again after a lost reply or a
     * restart of its own keeps its rank, counters and secret, if it can
     * show the secret. */
    w = &m->members[at];
    if (cred && !ps_ct_equal(cred->session, cred->session_len, w->session, PS_SESSION_LEN)) {
      pthread_mutex_unlock(&m->mu);
      return PS_ESTATE;
    }
  } else {
    if (m->limit && m->n >= m->limit) {
      pthread_mutex_unlock(&m->mu);
      return PS_ERANGE;
    }
    uint64_t fresh = id;
    uint8_t secret[PS_SESSION_LEN];
    if ((!fresh && new_id(m, &fresh) != 0) || ps_random_bytes(secret, sizeof secret) != 0) {
      pthread_mutex_unlock(&m->mu);
      return PS_EIO;
    }
    struct ps_recent *recent = calloc(1, sizeof *recent);
    if (!recent) {
      pthread_mutex_unlock(&m->mu);
      return PS_ENOMEM;
    }
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
    w->id = fresh;
    w->recent = recent;
    w->rank = m->next_rank++;
    for (int i = 0; i < m->n_seed; i++)
      if (m->seed_id[i] == fresh) w->round = m->seed_round[i];
    /* An evaluator reads: it may not change the model whatever token it
     * registered with, and a later refresh does not change that. */
    w->reader = (cred && cred->reader) || (role && strcmp(role, "evaluator") == 0);
    memcpy(w->session, secret, sizeof secret);
  }
  /* Both come from the worker and go out again in Status replies (a proto3
   * `string`, which must be valid UTF-8) and in logs: cut on a character
   * boundary, invalid bytes and control characters replaced. */
  ps_utf8_sanitize(w->host, sizeof w->host, host);
  ps_utf8_sanitize(w->role, sizeof w->role, role);
  w->task_index = task_index;
  w->last_seen_ms = now_ms;
  if (id_out) *id_out = w->id;
  if (rank_out) *rank_out = w->rank;
  if (session_out) memcpy(session_out, w->session, PS_SESSION_LEN);
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

int ps_membership_authorize(ps_membership *m, uint64_t id, const void *session, size_t len,
                            int *reader) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id), rc = PS_ENOTFOUND;
  if (at >= 0) {
    const ps_member *w = &m->members[at];
    rc = ps_ct_equal(session, len, w->session, PS_SESSION_LEN) ? PS_OK : PS_EINVAL;
    if (reader) *reader = w->reader;
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
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
    if (w->idle) wake(m, w);
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

int ps_membership_set_idle(ps_membership *m, uint64_t id, int idle) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id), rc = PS_ENOTFOUND;
  if (at >= 0) {
    ps_member *w = &m->members[at];
    rc = (w->idle != 0) != (idle != 0);
    if (rc && idle) w->idle = 1;
    else if (rc) wake(m, w);
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
}

int ps_membership_touch(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms) {
  return touch(m, id, step, now_ms, 0);
}

int ps_membership_note_push(ps_membership *m, uint64_t id, uint64_t step, int64_t now_ms) {
  return touch(m, id, step, now_ms, 1);
}

int ps_membership_note_round(ps_membership *m, uint64_t id, uint64_t round) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  if (at >= 0 && round > m->members[at].round) m->members[at].round = round;
  pthread_mutex_unlock(&m->mu);
  return at >= 0 ? PS_OK : PS_ENOTFOUND;
}

int ps_membership_seed_rounds(ps_membership *m, const uint64_t *ids, const uint64_t *rounds,
                              int n) {
  uint64_t *si = malloc((size_t)(n > 0 ? n : 1) * sizeof *si);
  uint64_t *sr = malloc((size_t)(n > 0 ? n : 1) * sizeof *sr);
  if (!si || !sr) {
    free(si);
    free(sr);
    return PS_ENOMEM;
  }
  if (n > 0) {
    memcpy(si, ids, (size_t)n * sizeof *si);
    memcpy(sr, rounds, (size_t)n * sizeof *sr);
  }
  pthread_mutex_lock(&m->mu);
  free(m->seed_id);
  free(m->seed_round);
  m->seed_id = si;
  m->seed_round = sr;
  m->n_seed = n;
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

int ps_membership_round(ps_membership *m, uint64_t id, uint64_t *round) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  if (at >= 0) *round = m->members[at].round;
  pthread_mutex_unlock(&m->mu);
  return at >= 0 ? PS_OK : PS_ENOTFOUND;
}

int ps_membership_remove(ps_membership *m, uint64_t id) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  if (at < 0) {
    pthread_mutex_unlock(&m->mu);
    return PS_ENOTFOUND;
  }
  free(m->members[at].recent);
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
      free(w->recent);
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

int ps_membership_request_begin(ps_membership *m, uint64_t worker, int kind, uint64_t request_id,
                                void *reply, size_t reply_cap, size_t *len) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, worker), rc = PS_ENOTFOUND;
  if (at >= 0) {
    struct ps_recent *r = m->members[at].recent;
    rc = PS_OK;
    for (int i = 0; i < PS_RECENT_REQUESTS && rc == PS_OK; i++) {
      recent_slot *s = &r->slot[i];
      if (s->state == 0 || s->id != request_id || s->kind != kind) continue;
      if (s->state == 1 || s->state == 3) {
        rc = PS_REQUEST_PENDING;
      } else {
        *len = s->len <= reply_cap ? s->len : 0;
        memcpy(reply, s->reply, *len);
        rc = PS_REQUEST_ANSWERED;
      }
    }
    if (rc == PS_OK) { /* the oldest slot makes room */
      recent_slot *s = &r->slot[r->next];
      r->next = (r->next + 1) % PS_RECENT_REQUESTS;
      s->id = request_id;
      s->kind = kind;
      s->state = 1;
      s->len = 0;
    }
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
}

void ps_membership_request_end(ps_membership *m, uint64_t worker, int kind, uint64_t request_id,
                               const void *reply, size_t len) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, worker);
  for (int i = 0; at >= 0 && i < PS_RECENT_REQUESTS; i++) {
    recent_slot *s = &m->members[at].recent->slot[i];
    if ((s->state != 1 && s->state != 3) || s->id != request_id || s->kind != kind) continue;
    if (len == 0 || len > PS_REPLY_MAX) {
      s->state = 0; /* refused (or an answer too large to keep): a retry tries again */
    } else {
      memcpy(s->reply, reply, len);
      s->len = len;
      s->state = 2;
    }
    break;
  }
  pthread_mutex_unlock(&m->mu);
}

int ps_membership_count(ps_membership *m) {
  int idle;
  return ps_membership_count_both(m, &idle);
}

int ps_membership_count_both(ps_membership *m, int *idle) {
  pthread_mutex_lock(&m->mu);
  int n = 0, k = 0;
  for (int i = 0; i < m->n; i++) {
    n += trains(&m->members[i]);
    k += is_trainer(&m->members[i]) && m->members[i].idle;
  }
  pthread_mutex_unlock(&m->mu);
  *idle = k;
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

void ps_membership_request_stage(ps_membership *m, uint64_t worker, int kind, uint64_t request_id,
                                 const void *reply, size_t len) {
  if (len == 0 || len > PS_REPLY_MAX) return; /* stays pending; end decides */
  pthread_mutex_lock(&m->mu);
  int at = find(m, worker);
  for (int i = 0; at >= 0 && i < PS_RECENT_REQUESTS; i++) {
    recent_slot *s = &m->members[at].recent->slot[i];
    if (s->state != 1 || s->id != request_id || s->kind != kind) continue;
    memcpy(s->reply, reply, len);
    s->len = len;
    s->state = 3;
    break;
  }
  pthread_mutex_unlock(&m->mu);
}

void ps_membership_request_settle(ps_membership *m) {
  pthread_mutex_lock(&m->mu);
  for (int w = 0; w < m->n; w++)
    for (int i = 0; i < PS_RECENT_REQUESTS; i++) {
      recent_slot *s = &m->members[w].recent->slot[i];
      if (s->state == 3) s->state = 2;
      else if (s->state == 1) s->state = 0;
    }
  pthread_mutex_unlock(&m->mu);
}

int ps_membership_install(ps_membership *m, uint64_t id, const char *host, const char *role,
                          int task_index, int64_t now_ms, const uint8_t *session, int reader,
                          int *rank_out) {
  pthread_mutex_lock(&m->mu);
  int at = find(m, id);
  pthread_mutex_unlock(&m->mu);
  /* The same path as the primary's join (a newcomer's clock, its rank),
   * then the primary's secret and reader flag. */
  int rank = 0;
  ps_member_cred cred = {.session = session, .session_len = PS_SESSION_LEN, .reader = reader};
  int rc = ps_membership_join(m, id, host, role, task_index, now_ms, at >= 0 ? &cred : NULL,
                              NULL, &rank, NULL);
  if (rc != PS_OK) return rc;
  pthread_mutex_lock(&m->mu);
  at = find(m, id);
  if (at >= 0) {
    memcpy(m->members[at].session, session, PS_SESSION_LEN);
    m->members[at].reader = reader || strcmp(m->members[at].role, "evaluator") == 0;
  }
  pthread_mutex_unlock(&m->mu);
  if (rank_out) *rank_out = rank;
  return PS_OK;
}

int ps_membership_export(ps_membership *m, ps_member_state **out, int *n, int *next_rank) {
  pthread_mutex_lock(&m->mu);
  ps_member_state *st = calloc((size_t)(m->n > 0 ? m->n : 1), sizeof *st);
  if (!st) {
    pthread_mutex_unlock(&m->mu);
    return PS_ENOMEM;
  }
  for (int w = 0; w < m->n; w++) {
    st[w].member = m->members[w];
    st[w].member.recent = NULL;
    /* Oldest first, so that an import refills the ring in the same order. */
    const struct ps_recent *r = m->members[w].recent;
    for (int k = 0; k < PS_RECENT_REQUESTS; k++) {
      const recent_slot *s = &r->slot[(r->next + k) % PS_RECENT_REQUESTS];
      if (s->state != 2 && s->state != 3) continue;
      ps_recent_state *o = &st[w].recent[st[w].n_recent++];
      o->id = s->id;
      o->kind = s->kind;
      o->len = s->len;
      memcpy(o->reply, s->reply, s->len);
    }
  }
  *out = st;
  *n = m->n;
  *next_rank = m->next_rank;
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

int ps_membership_import(ps_membership *m, const ps_member_state *in, int n, int next_rank) {
  ps_member *members = calloc((size_t)(n > 0 ? n : 1), sizeof *members);
  int ok = members != NULL;
  for (int w = 0; ok && w < n; w++) {
    members[w] = in[w].member;
    members[w].recent = calloc(1, sizeof(struct ps_recent));
    if (!members[w].recent) {
      ok = 0;
      break;
    }
    int k = in[w].n_recent < PS_RECENT_REQUESTS ? in[w].n_recent : PS_RECENT_REQUESTS;
    for (int i = 0; i < k; i++) {
      recent_slot *s = &members[w].recent->slot[i];
      s->id = in[w].recent[i].id;
      s->kind = in[w].recent[i].kind;
      s->len = in[w].recent[i].len <= PS_REPLY_MAX ? in[w].recent[i].len : 0;
      memcpy(s->reply, in[w].recent[i].reply, s->len);
      s->state = 2;
    }
    members[w].recent->next = k % PS_RECENT_REQUESTS;
  }
  if (!ok) {
    for (int w = 0; members && w < n; w++) free(members[w].recent);
    free(members);
    return PS_ENOMEM;
  }
  pthread_mutex_lock(&m->mu);
  for (int i = 0; i < m->n; i++) free(m->members[i].recent);
  free(m->members);
  m->members = members;
  m->n = m->cap = n;
  if (m->cap == 0) {
    free(m->members);
    m->members = NULL;
  }
  m->next_rank = next_rank;
  pthread_mutex_unlock(&m->mu);
  return PS_OK;
}

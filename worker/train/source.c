/* A training worker's data source: the static share or leases from shard 0
 * (see source.h). */
#include "worker/train/source.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

struct ps_source {
  ps_batcher *batcher;
  int batch, n_examples;
  int64_t total_steps;
  /* leases */
  ps_client *client; /* NULL for the static share */
  double retry_s;
  atomic_int *stop;
  atomic_uint_fast64_t chunks_done, chunks_lost;
  /* Why the leases ended early: written by the batcher's thread before it
   * hands out its last (empty) batch, read after that batch is taken. */
  int failed;
  int unreachable; /* ... because shard 0 did not answer for retry_s */
  char failure[PS_ERRLEN];
  /* What heartbeats say of the data (under mu): the leases granted and not
   * yet reported done, whether the batcher waits for others' chunks, and
   * since when the training loop has waited for a batch (0: it is not). */
  pthread_mutex_t mu;
  uint64_t held[PS_SOURCE_MAX_HELD];
  int n_held;
  int lease_waiting;
  int64_t consumer_waiting_since;
};

ps_source *ps_source_share(const ps_dataset *train, int batch, int rank, int num_workers,
                           uint64_t seed, int shuffle, int epochs, int64_t max_steps,
                           const ps_host_mem *mem) {
  ps_source *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  s->batch = batch;
  s->n_examples = train->n;
  s->batcher = ps_batcher_create_ordered_in(train, batch, rank, num_workers, seed, 4, shuffle, mem);
  if (!s->batcher) {
    pthread_mutex_destroy(&s->mu);
    free(s);
    return NULL;
  }
  int epoch_size = ps_batcher_epoch_size(s->batcher);
  int64_t steps_per_epoch = (epoch_size + batch - 1) / batch;
  s->total_steps = steps_per_epoch * epochs;
  if (max_steps > 0 && max_steps < s->total_steps) s->total_steps = max_steps;
  return s;
}

/* Ends the leases with a failure, which the training loop reports when it
 * takes the empty batch that follows. */
static int lease_failed(ps_source *s, const char *why) {
  snprintf(s->failure, sizeof s->failure, "%s", why);
  s->failed = 1;
  return -1;
}

/* The batcher's chunk source in lease mode: asks shard 0 for the next
 * chunk, waiting while every chunk left is leased to someone else. Stops
 * asking once *s->stop is set (a signal, an error of the training loop, or
 * the tear-down, which then destroys the source before the client). */
static int next_chunk(void *user, uint64_t *begin, uint32_t *count, uint64_t *tag, int *epoch) {
  ps_source *s = user;
  char err[PS_ERRLEN];
  double give_up = ps_now_s() + s->retry_s;
  int64_t backoff = 50;
  int said_waiting = 0;
  while (!atomic_load(s->stop)) {
    ps_client_lease l;
    int rc = ps_client_lease_call(s->client, 0, 1, (uint64_t)s->n_examples, &l, err);
    if (rc == 0 && l.status == 0) {
      if (l.count == 0 || l.begin + l.count > (uint64_t)s->n_examples) {
        snprintf(err, sizeof err,
                 "shard 0 leased examples [%" PRIu64 ", %" PRIu64 ") of a data set of %d: "
                 "not the same data set?",
                 l.begin, l.begin + l.count, s->n_examples);
        return lease_failed(s, err);
      }
      *begin = l.begin;
      *count = l.count;
      *tag = l.lease_id;
      *epoch = l.epoch;
      pthread_mutex_lock(&s->mu);
      s->lease_waiting = 0;
      if (s->n_held < PS_SOURCE_MAX_HELD) s->held[s->n_held++] = l.lease_id;
      pthread_mutex_unlock(&s->mu);
      return 0;
    }
    if (rc == 0 && l.status == 2) return 1; /* the last epoch is done */
    if (rc == 0) {
      pthread_mutex_lock(&s->mu);
      s->lease_waiting = 1;
      pthread_mutex_unlock(&s->mu);
    }
    if (rc != 0) {
      if (rc != PS_EUNAVAIL && rc != PS_ETIMEDOUT) return lease_failed(s, err);
      if (ps_now_s() > give_up) {
        s->unreachable = 1;
        return lease_failed(s, err);
      }
      PS_WARN("%s; retrying", err);
    } else {
      if (!said_waiting++)
        PS_INFO("leases: every chunk left of this epoch is leased to other workers; waiting");
      give_up = ps_now_s() + s->retry_s; /* waiting for others' chunks is progress */
    }
    ps_sleep_ms(backoff);
    if (backoff < 1000) backoff *= 2;
  }
  return 1;
}

ps_source *ps_source_leases(const ps_dataset *train, int batch, uint64_t seed, ps_client *client,
                            double retry_s, atomic_int *stop, int64_t max_steps,
                            const ps_host_mem *mem) {
  ps_source *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  s->batch = batch;
  s->n_examples = train->n;
  s->client = client;
  s->retry_s = retry_s;
  s->stop = stop;
  /* The data comes chunk by chunk from shard 0 until its last epoch. */
  s->total_steps = max_steps > 0 ? max_steps : INT64_MAX;
  s->batcher = ps_batcher_create_source_in(train, batch, seed, 4, next_chunk, s, mem);
  if (!s->batcher) {
    pthread_mutex_destroy(&s->mu);
    free(s);
    return NULL;
  }
  return s;
}

void ps_source_log_plan(const ps_source *s, int lease_chunk, int epochs) {
  if (s->client) {
    PS_INFO("training: data leased from shard 0 in chunks of %d examples, %d epoch(s) over "
            "the %d examples for the whole cluster, batch %d",
            lease_chunk, epochs, s->n_examples, s->batch);
  } else {
    int epoch_size = ps_batcher_epoch_size(s->batcher);
    int64_t steps_per_epoch = (epoch_size + s->batch - 1) / s->batch;
    PS_INFO("training: %d examples in this worker's share, %" PRId64 " steps per epoch, %" PRId64
            " steps, batch %d",
            epoch_size, steps_per_epoch, s->total_steps, s->batch);
  }
}

int64_t ps_source_total_steps(const ps_source *s) { return s->total_steps; }

int ps_source_next(ps_source *s, ps_batch **out, char *err) {
  ps_batch *b = NULL;
  pthread_mutex_lock(&s->mu);
  s->consumer_waiting_since = ps_now_ms();
  pthread_mutex_unlock(&s->mu);
  int got = ps_batcher_next(s->batcher, &b);
  pthread_mutex_lock(&s->mu);
  s->consumer_waiting_since = 0;
  pthread_mutex_unlock(&s->mu);
  if (got != 0) {
    snprintf(err, PS_ERRLEN, "the input pipeline has stopped");
    return -1;
  }
  if (b->n == 0) { /* leases: no more data, or they failed */
    ps_batcher_release(s->batcher, b);
    if (s->failed) {
      snprintf(err, PS_ERRLEN, "%s", s->failure);
      return -1;
    }
    return 1;
  }
  *out = b;
  return 0;
}

void ps_source_release(ps_source *s, ps_batch *b) { ps_batcher_release(s->batcher, b); }

void ps_source_chunk_done(ps_source *s, uint64_t lease) {
  if (!s->client) return;
  pthread_mutex_lock(&s->mu);
  for (int i = 0; i < s->n_held; i++)
    if (s->held[i] == lease) {
      s->held[i] = s->held[--s->n_held];
      break;
    }
  pthread_mutex_unlock(&s->mu);
  /* Every example of the chunk went into a pushed gradient. A shard 0 that
   * does not answer (restarting) is asked again, as a grant is, for at
   * most --retry-s: the completion must reach it, counted or not (a
   * refused one says what was trained under it, which the records count). */
  ps_client_lease l;
  char err[PS_ERRLEN] = "";
  int rc;
  double give_up = ps_now_s() + s->retry_s;
  int64_t backoff = 50;
  while ((rc = ps_client_lease_call(s->client, lease, 0, 0, &l, err)) != 0 &&
         (rc == PS_EUNAVAIL || rc == PS_ETIMEDOUT) && ps_now_s() < give_up &&
         !atomic_load(s->stop)) {
    PS_WARN("%s; retrying the completion of lease %" PRIx64, err, lease);
    ps_sleep_ms(backoff);
    if (backoff < 1000) backoff *= 2;
  }
  if (rc == 0 && l.completed_counted) {
    atomic_fetch_add(&s->chunks_done, 1);
  } else {
    atomic_fetch_add(&s->chunks_lost, 1);
    PS_WARN("chunk of lease %" PRIx64 " finished but not counted (%s)", lease,
            err[0] ? err : "the lease had expired and went to another worker");
  }
}

void ps_source_batch_done(ps_source *s, const ps_batch *b) {
  if (s->client && b->last_in_chunk) ps_source_chunk_done(s, b->tag);
}

void ps_source_log_summary(const ps_source *s) {
  if (s->client)
    PS_INFO("leases: %" PRIu64 " chunk(s) done and counted, %" PRIu64 " not counted",
            (uint64_t)atomic_load(&s->chunks_done), (uint64_t)atomic_load(&s->chunks_lost));
}

int ps_source_heartbeat_state(ps_source *s, uint64_t *ids, int max, int *names, int *idle) {
  *names = *idle = 0;
  if (!s || !s->client) return 0;
  pthread_mutex_lock(&s->mu);
  int n = s->n_held < max ? s->n_held : max;
  memcpy(ids, s->held, (size_t)n * sizeof *ids);
  *names = 1;
  *idle = s->lease_waiting && s->consumer_waiting_since &&
          ps_now_ms() - s->consumer_waiting_since >= PS_SOURCE_IDLE_MS;
  pthread_mutex_unlock(&s->mu);
  return n;
}

int ps_source_unreachable(const ps_source *s) { return s && s->unreachable; }

int64_t ps_source_waiting_ms(ps_source *s, int *for_leases) {
  *for_leases = 0;
  if (!s) return 0;
  pthread_mutex_lock(&s->mu);
  int64_t since = s->consumer_waiting_since;
  *for_leases = s->lease_waiting;
  pthread_mutex_unlock(&s->mu);
  return since ? ps_now_ms() - since : 0;
}

void ps_source_destroy(ps_source *s) {
  if (!s) return;
  ps_batcher_destroy(s->batcher);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

/* The worker's loop thread: a libuv loop that owns the heartbeat timer
 * (the blocking heartbeat calls run on libuv's work queue) and
 * SIGINT/SIGTERM (the training loop stops after the current step and the
 * worker leaves cleanly). */
#include "worker/main/loop.h"

#include <inttypes.h>

#include "common/util.h"

static void hb_run(uv_work_t *req) {
  ps_worker *w = req->data;
  char err[PS_ERRLEN];
  uint64_t held[PS_SOURCE_MAX_HELD];
  ps_client_hb_state st = {.leases = held};
  st.n_leases = ps_source_heartbeat_state(atomic_load(&w->ev.source), held, PS_SOURCE_MAX_HELD,
                                          &st.names_leases, &st.idle);
  w->ev.idle_said = st.idle;
  if (ps_client_heartbeat(w->client, atomic_load(&w->step), &st, err) != 0)
    PS_WARN("heartbeat: %s", err);
}

static void hb_done(uv_work_t *req, int status) {
  (void)status;
  ps_worker *w = req->data;
  w->ev.hb_busy = 0;
}

static void on_hb_timer(uv_timer_t *t) {
  ps_worker *w = t->data;
  if (w->ev.hb_busy || !w->client) return; /* the previous one is still out */
  w->ev.hb_busy = 1;
  w->ev.hb_work.data = w;
  uv_queue_work(&w->ev.loop, &w->ev.hb_work, hb_run, hb_done);
}

/* Between heartbeats: when the worker starts or stops waiting for data,
 * the shards hear of it at once (a sync step or an ssp pull may be waiting
 * for this worker's gradient). */
static void on_idle_watch(uv_timer_t *t) {
  ps_worker *w = t->data;
  uint64_t held[PS_SOURCE_MAX_HELD];
  int names = 0, idle = 0;
  ps_source_heartbeat_state(atomic_load(&w->ev.source), held, PS_SOURCE_MAX_HELD, &names, &idle);
  if (idle != w->ev.idle_said) on_hb_timer(&w->ev.hb_timer);
}

/* A worker that makes no progress says so, and what it waits for: every
 * PS_WORKER_STALL_S without a finished step, one line. */
static void on_stall_watch(uv_timer_t *t) {
  ps_worker *w = t->data;
  uint64_t step = atomic_load(&w->step);
  int64_t now = ps_now_ms();
  ps_source *source = atomic_load(&w->ev.source);
  /* No steps before the input pipeline exists (loading the data). */
  if (!source || step != w->ev.stall_step || atomic_load(&w->stop)) {
    w->ev.stall_step = step;
    w->ev.stall_since = now;
    return;
  }
  if (now - w->ev.stall_since < PS_WORKER_STALL_S * 1000) return;
  int for_leases = 0;
  int64_t waiting = ps_source_waiting_ms(source, &for_leases);
  PS_WARN("no step finished for %" PRId64 " s (at step %" PRIu64 "): %s",
          (now - w->ev.stall_since) / 1000, step,
          waiting && for_leases ? "waiting for data: every chunk left of the epoch is leased to "
                                  "other workers (ps-server --status on shard 0 lists who holds "
                                  "which)"
          : waiting             ? "waiting for the input pipeline"
                                : "inside a step: a pull, the compute or a push (the shards' "
                                  "--status says what a pull waits for)");
  w->ev.stall_since = now; /* again after another stall period */
}

static void on_signal(uv_signal_t *s, int signum) {
  ps_worker *w = s->data;
  if (atomic_exchange(&w->stop, 1) == 0)
    PS_INFO("%s: finishing the current step, then leaving", signum == SIGINT ? "SIGINT" : "SIGTERM");
  else
    PS_INFO("second signal: still finishing the current step");
}

static void on_quit(uv_async_t *a) {
  ps_worker *w = a->data;
  uv_timer_stop(&w->ev.hb_timer);
  uv_close((uv_handle_t *)&w->ev.hb_timer, NULL);
  uv_timer_stop(&w->ev.idle_timer);
  uv_close((uv_handle_t *)&w->ev.idle_timer, NULL);
  uv_timer_stop(&w->ev.stall_timer);
  uv_close((uv_handle_t *)&w->ev.stall_timer, NULL);
  uv_close((uv_handle_t *)&w->ev.sigint, NULL);
  uv_close((uv_handle_t *)&w->ev.sigterm, NULL);
  uv_close((uv_handle_t *)&w->ev.quit, NULL);
}

static void loop_main(void *arg) {
  ps_worker *w = arg;
  uv_run(&w->ev.loop, UV_RUN_DEFAULT);
}

int ps_worker_loop_start(ps_worker *w) {
  uv_loop_init(&w->ev.loop);
  uv_timer_init(&w->ev.loop, &w->ev.hb_timer);
  w->ev.hb_timer.data = w;
  uv_timer_init(&w->ev.loop, &w->ev.idle_timer);
  w->ev.idle_timer.data = w;
  uv_timer_init(&w->ev.loop, &w->ev.stall_timer);
  w->ev.stall_timer.data = w;
  w->ev.stall_since = ps_now_ms();
  uv_timer_start(&w->ev.stall_timer, on_stall_watch, 1000, 1000);
  uv_signal_init(&w->ev.loop, &w->ev.sigint);
  w->ev.sigint.data = w;
  uv_signal_start(&w->ev.sigint, on_signal, SIGINT);
  uv_signal_init(&w->ev.loop, &w->ev.sigterm);
  w->ev.sigterm.data = w;
  uv_signal_start(&w->ev.sigterm, on_signal, SIGTERM);
  uv_async_init(&w->ev.loop, &w->ev.quit, on_quit);
  w->ev.quit.data = w;
  if (w->client) {
    int period = ps_client_heartbeat_timeout_ms(w->client) / 3;
    if (period < 50) period = 50;
    uv_timer_start(&w->ev.hb_timer, on_hb_timer, (uint64_t)period, (uint64_t)period);
    uv_timer_start(&w->ev.idle_timer, on_idle_watch, 100, 100);
  }
  if (uv_thread_create(&w->ev.thread, loop_main, w) != 0) {
    on_quit(&w->ev.quit);
    uv_run(&w->ev.loop, UV_RUN_DEFAULT);
    uv_loop_close(&w->ev.loop);
    return -1;
  }
  w->ev.running = 1;
  return 0;
}

void ps_worker_loop_stop(ps_worker *w) {
  if (!w->ev.running) return;
  uv_async_send(&w->ev.quit);
  uv_thread_join(&w->ev.thread);
  uv_loop_close(&w->ev.loop);
  w->ev.running = 0;
}

void ps_worker_loop_attach_source(ps_worker *w) { atomic_store(&w->ev.source, w->source); }

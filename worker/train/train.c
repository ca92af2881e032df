/* The training loop: a batch from the data source, one step of the kind
 * chosen at the start, the progress line and metrics on schedule, the
 * chief's evaluation on schedule; at the end the final pull, the saved
 * parameters and the final evaluation. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "worker/train/step.h"

/* What the progress line of one interval sums up. */
typedef struct {
  double last_log, sum_loss, t_pull, t_comp, t_push;
  double phase_ms[4]; /* sums over phase_n steps (ps_worker.phase_ms) */
  int64_t n_ex, n_correct, n_steps, phase_n;
  uint64_t stale_sum, stale_n, stale_max, dropped;
} progress;

static void progress_add(progress *p, const ps_step_result *r, int n, int nshards) {
  p->t_pull += r->pull_s;
  p->t_comp += r->compute_s;
  p->t_push += r->push_s;
  p->sum_loss += (double)r->loss * n;
  p->n_ex += n;
  p->n_correct += r->correct;
  p->n_steps++;
  if (r->pushed) {
    p->stale_sum += r->res.staleness_sum;
    p->stale_n += (uint64_t)nshards;
    if (r->res.staleness_max > p->stale_max) p->stale_max = r->res.staleness_max;
    if (r->count_dropped) p->dropped += r->res.dropped > 0;
  }
}

/* The progress line and metrics record; then a new interval. */
static void progress_report(ps_worker *w, progress *p, int64_t step, int64_t total, int epoch,
                            double now) {
  double dt = now - p->last_log;
  double eps = p->n_ex / (dt > 0 ? dt : 1e-9);
  double smean = p->stale_n ? (double)p->stale_sum / p->stale_n : 0.0;
  double ms = 1e3 / p->n_steps;
  char drop_note[48] = "";
  if (w->job.mode_kind == PS_MODE_SYNC)
    snprintf(drop_note, sizeof drop_note, " | %" PRIu64 " dropped", p->dropped);
  char of_total[32] = "";
  if (total != INT64_MAX) snprintf(of_total, sizeof of_total, "/%" PRId64, total);
  PS_INFO("step %" PRId64 "%s epoch %d | loss %.4f acc %.3f | %.0f ex/s | "
          "staleness %.2f max %" PRIu64 "%s | pull %.1f compute %.1f push %.1f ms/step",
          step, of_total, epoch, p->sum_loss / p->n_ex, (double)p->n_correct / p->n_ex, eps, smean,
          p->stale_max, drop_note, p->t_pull * ms, p->t_comp * ms, p->t_push * ms);
  if (w->metrics) {
    json_t *rec = json_pack(
        "{s:i,s:I,s:i,s:f,s:f,s:f,s:f,s:I,s:I,s:f,s:f,s:f}", "worker", w->rank, "step",
        (json_int_t)step, "epoch", epoch, "loss", p->sum_loss / p->n_ex, "train_accuracy",
        (double)p->n_correct / p->n_ex, "examples_per_sec", eps, "staleness_mean", smean,
        "staleness_max", (json_int_t)p->stale_max, "dropped", (json_int_t)p->dropped, "pull_ms",
        p->t_pull * ms, "compute_ms", p->t_comp * ms, "push_ms", p->t_push * ms);
    if (p->phase_n > 0) {
      /* The compute's phases on the backend's clock (CUDA events on a GPU). */
      static const char *const names[4] = {"h2d_ms", "forward_ms", "backward_ms", "d2h_ms"};
      for (int i = 0; i < 4; i++)
        json_object_set_new(rec, names[i], json_real(p->phase_ms[i] / (double)p->phase_n));
    }
    ps_metrics_write(w->metrics, rec);
    json_decref(rec);
  }
  if (w->tb) {
    static const char *const tags[] = {"train/loss",      "train/accuracy", "perf/examples_per_sec",
                                       "staleness/mean",  "staleness/max",  "time/pull_ms",
                                       "time/compute_ms", "time/push_ms"};
    const float vals[] = {(float)(p->sum_loss / p->n_ex), (float)((double)p->n_correct / p->n_ex),
                          (float)eps, (float)smean, (float)p->stale_max, (float)(p->t_pull * ms),
                          (float)(p->t_comp * ms), (float)(p->t_push * ms)};
    ps_worker_tb_write(w, step, 8, tags, vals);
  }
  memset(p, 0, sizeof *p);
  p->last_log = now;
}

/* Writes the P parameters to fd (closed here) and syncs them: 0, or the
 * errno of the first failure. fsync's EINVAL (a device or pipe that cannot
 * sync) is not one. */
static int write_params_fd(int fd, const float *params, size_t P) {
  FILE *f = fdopen(fd, "wb");
  if (!f) {
    int e = errno;
    close(fd);
    return e;
  }
  int e = 0;
  errno = 0;
  if (fwrite(params, sizeof(float), P, f) != P) e = errno ? errno : EIO;
  if (!e && fflush(f) != 0) e = errno;
  if (!e && fsync(fileno(f)) != 0 && errno != EINVAL) e = errno;
  if (fclose(f) != 0 && !e) e = errno;
  return e;
}

/* fsyncs the directory of path, so that a rename into it survives a crash:
 * 0, or an errno value (EINVAL, a file system that cannot sync a
 * directory, is not one). */
static int sync_dir_of(const char *path) {
  const char *slash = strrchr(path, '/');
  char dir[PATH_MAX];
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else
    snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int e = fsync(fd) != 0 && errno != EINVAL ? errno : 0;
  close(fd);
  return e;
}

/* --save-params: the parameters as raw little-endian float32. A regular
 * file (or none yet) at path is replaced atomically: the bytes go to a
 * temporary file in the same directory, fsynced, renamed over the final
 * name, then the directory is fsynced; on a failure the temporary file is
 * removed and what was at path is left as it was. A symbolic link's target
 * is what gets replaced; a device or a pipe (/dev/null) is written in
 * place. Returns 0, or PS_WORKER_EXIT_ERROR with the cause (strerror) logged. */
static int save_params(ps_worker *w, const char *path) {
  const size_t P = w->job.model.n_params;
  char final_path[PATH_MAX], tmp[PATH_MAX + 32];
  struct stat st;
  if (!realpath(path, final_path)) snprintf(final_path, sizeof final_path, "%s", path);
  if (stat(final_path, &st) == 0 && !S_ISREG(st.st_mode)) {
    int fd = open(final_path, O_WRONLY | O_CLOEXEC);
    int e = fd < 0 ? errno : write_params_fd(fd, w->params, P);
    if (e) {
      PS_ERROR("--save-params: cannot write the parameters to '%s': %s", path, strerror(e));
      return PS_WORKER_EXIT_ERROR;
    }
    PS_INFO("wrote the %zu parameters to %s", P, path);
    return 0;
  }
  const char *slash = strrchr(final_path, '/');
  int dir_len = slash ? (int)(slash - final_path + 1) : 0;
  int n = snprintf(tmp, sizeof tmp, "%.*s.%s.tmp-%ld", dir_len, final_path, final_path + dir_len,
                   (long)getpid());
  if (n < 0 || (size_t)n >= sizeof tmp) {
    PS_ERROR("--save-params: the path '%s' is too long", path);
    return PS_WORKER_EXIT_ERROR;
  }
  /* The name holds this process's id: a file there is a dead process's. */
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0666);
  int e = fd < 0 ? errno : write_params_fd(fd, w->params, P);
  const char *what = "write";
  if (!e && rename(tmp, final_path) != 0) {
    e = errno;
    what = "rename the new parameters to";
  }
  if (e) {
    if (fd >= 0) unlink(tmp);
    PS_ERROR("--save-params: cannot %s '%s': %s (%s)", what, path, strerror(e),
             fd >= 0 ? "the temporary file is removed; what was there is unchanged"
                     : "nothing was written");
    return PS_WORKER_EXIT_ERROR;
  }
  if ((e = sync_dir_of(final_path)) != 0) {
    PS_ERROR("--save-params: wrote '%s' but cannot sync its directory: %s (the file may not "
             "survive a crash)",
             path, strerror(e));
    return PS_WORKER_EXIT_ERROR;
  }
  PS_INFO("wrote the %zu parameters to %s", P, path);
  return 0;
}

/* ", ground truth's AUC X" for a test split that knows it. */
static const char *truth_note(const ps_worker *w) {
  static _Thread_local char buf[64];
  buf[0] = '\0';
  if (w->test.truth_auc > 0)
    snprintf(buf, sizeof buf, "; the ground truth's AUC is %.4f", w->test.truth_auc);
  return buf;
}

/* After the last step: the final pull, --save-params, the chief's final
 * evaluation. */
static int finish(ps_worker *w, int64_t steps, int64_t examples, double t0) {
  char err[PS_ERRLEN];
  double elapsed = ps_now_s() - t0;
  ps_source_log_summary(w->source);
  if (w->o.straggle_kind != PS_STRAGGLE_NONE)
    PS_INFO("straggler: slept %" PRId64 " ms over %" PRId64 " steps (%.1f ms a step)",
            w->straggled_ms, steps, steps ? (double)w->straggled_ms / (double)steps : 0.0);
  printf("trained %" PRId64 " steps, %" PRId64 " examples in %.1f s: %.0f examples/s\n", steps,
         examples, elapsed, examples / (elapsed > 0 ? elapsed : 1e-9));
  /* Under sync every worker waits (this pull) for the step its last
   * gradient went to before it leaves: leaving first would shrink that
   * step's quorum, and a slower worker's gradient for it would be dropped
   * as late. */
  if ((w->o.chief || w->o.save_path || w->job.mode_kind == PS_MODE_SYNC) && w->client &&
      ps_worker_pull(w, err) != 0) {
    PS_ERROR("final pull: %s", err);
    return PS_WORKER_EXIT_ERROR;
  }
  if (w->o.save_path && save_params(w, w->o.save_path) != 0) return PS_WORKER_EXIT_ERROR;
  if (w->o.chief) {
    float tl;
    double acc = ps_worker_evaluate(w, steps, t0, &tl);
    if (w->eval_err[0]) {
      PS_ERROR("final evaluation: %s", w->eval_err);
      return PS_WORKER_EXIT_ERROR;
    }
    if (w->job.model.classes == 1)
      printf("final test AUC %.4f (test loss %.4f, accuracy %.4f, %d examples%s)\n", acc,
             (double)tl, w->eval_acc, w->test.n, truth_note(w));
    else
      printf("final test accuracy %.4f (test loss %.4f, %d examples)\n", acc, (double)tl,
             w->test.n);
  }
  fflush(stdout);
  return PS_WORKER_EXIT_DONE;
}

int ps_worker_train(ps_worker *w) {
  char err[PS_ERRLEN];
  ps_source_log_plan(w->source, w->job.lease_chunk, w->job.epochs);
  const int64_t total = ps_source_total_steps(w->source);
  const ps_step_kind *kind = ps_step_choose(w);
  /* sync: every step averages the gradients of a full quorum. A worker
   * behind the others (its gradients dropped as late) stops with them
   * when the job's steps are applied: the steps it missed, made alone
   * after they finished, would average one gradient each at a learning
   * rate chosen for the quorum's batch (16 workers at batch 32: from 512
   * examples a step to 32, and the model fell from 0.82 to 0.25). */
  if (w->job.mode_kind == PS_MODE_SYNC && w->client && total > 0 && total < INT64_MAX)
    w->sync_end_version = ps_client_start_version(w->client) + (uint64_t)total;
  void *state = NULL;
  if (kind->begin(w, &state, err) != 0) return ps_worker_failure(w, err);
  double t0 = ps_now_s(), last_eval = t0;
  progress p = {.last_log = t0};
  int64_t total_ex = 0, step = 0;
  int rc = PS_WORKER_EXIT_DONE;
  for (; step < total && !atomic_load(&w->stop); step++) {
    ps_batch *b = NULL;
    int src = ps_source_next(w->source, &b, err);
    if (src != 0) {
      if (src < 0) {
        PS_ERROR("the input pipeline failed: %s", err);
        rc = PS_WORKER_EXIT_ERROR;
        if (ps_source_unreachable(w->source)) ps_worker_note_gave_up(w, w->o.retry_s, err);
      }
      break;
    }
    ps_step_result r = {0};
    if (kind->run(state, step, b, &r, err) != 0) {
      ps_source_release(w->source, b);
      rc = ps_worker_failure(w, err);
      break;
    }
    if (r.job_done) {
      ps_source_release(w->source, b);
      PS_INFO("sync: the job's steps are applied (version %" PRIu64 "): this worker stops after "
              "%" PRId64 " of its %" PRId64 " steps (its gradients that came late were dropped)",
              w->versions[0], step, total);
      break;
    }
    progress_add(&p, &r, b->n, w->nshards);
    if (w->phase_ok) {
      for (int i = 0; i < 4; i++) p.phase_ms[i] += w->phase_ms[i];
      p.phase_n++;
      w->phase_ok = 0;
    }
    total_ex += b->n;
    int epoch = b->epoch;
    ps_worker_prom_step(w, &r, b->n, epoch);
    if (r.applied) ps_source_batch_done(w->source, b);
    ps_source_release(w->source, b);
    atomic_store(&w->step, (uint64_t)step + 1);

    double now = ps_now_s();
    if (now - p.last_log >= w->o.log_interval || step + 1 == total)
      progress_report(w, &p, step + 1, total, epoch, now);
    if (w->o.chief && w->o.eval_interval > 0 && now - last_eval >= w->o.eval_interval &&
        step + 1 < total) {
      float tl;
      if (kind->eval_params) kind->eval_params(state);
      double acc = ps_worker_evaluate(w, step + 1, t0, &tl);
      PS_INFO("step %" PRId64 ": test %s %.4f, test loss %.4f (%d examples)", step + 1,
              ps_worker_metric(w), acc, (double)tl, w->test.n);
      last_eval = ps_now_s();
    }
  }
  if (kind->end(state, rc == PS_WORKER_EXIT_DONE, err) != 0) {
    int end_rc = ps_worker_failure(w, err);
    if (rc == PS_WORKER_EXIT_DONE) rc = end_rc;
  }
  return rc == PS_WORKER_EXIT_DONE ? finish(w, step, total_ex, t0) : rc;
}

/* Building and tearing down a worker's parts (see setup.h): the device,
 * the job, the data, the models and buffers, metrics and the data source;
 * and the process's exit code. */
#include "worker/main/setup.h"

#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/emu/ops_emu.h"
#include "worker/main/loop.h"
#include "worker/model/device.h"

/* How long the first registration waits for the servers: --retry-s, or
 * with --retry-s 0 (no retries) one call's deadline. */
static int connect_timeout_ms(const ps_worker_opts *o) {
  if (o->retry_s <= 0) return o->timeout_ms;
  return o->retry_s * 1000 < INT_MAX ? (int)(o->retry_s * 1000) : INT_MAX;
}

/* The job: from the servers (registering with them), or from the file
 * with --local; then the options the job fills in. Returns 0, or the exit
 * code with the message printed (or kept in w->gave_up_msg). */
static int setup_job(ps_worker *w, char *err) {
  ps_worker_opts *o = &w->o;
  if (o->local) {
    if (ps_job_load(o->job_path, &w->job, &w->job_text, err) != 0) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
    if (ps_job_check_layers(&w->job, err) != 0) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
    w->rank = o->index >= 0 ? o->index : 0;
    if (o->chief < 0) o->chief = 1;
  } else {
    if (ps_security_resolve(&o->sec, PS_SECURITY_CLIENT, &w->sec, err) != 0) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
    PS_INFO("servers: %s", w->sec.summary);
    ps_client_opts co = {.host = o->host,
                         .role = o->evaluator ? "evaluator" : o->chief == 1 ? "chief" : "worker",
                         .task_index = o->index,
                         .timeout_ms = o->timeout_ms,
                         .connect_timeout_ms = connect_timeout_ms(o),
                         .token = &w->sec.token,
                         .tls = ps_security_tls(&w->sec)};
    double t0 = ps_now_s();
    w->client = ps_client_connect(o->ps_addr, &co, err);
    if (!w->client) {
      /* No code comes back, but the connection waits for the servers (gRPC's
       * wait-for-ready) until connect_timeout_ms: a failure that took that
       * long is servers that never answered. */
      double waited = ps_now_s() - t0;
      if (waited * 1000 + 10 >= co.connect_timeout_ms) {
        ps_worker_note_gave_up(w, waited, err);
        return PS_WORKER_EXIT_UNREACHABLE;
      }
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_ERROR;
    }
    w->nshards = ps_client_num_shards(w->client);
    if (ps_job_parse(ps_client_job_json(w->client), &w->job, err) != 0) {
      fprintf(stderr, "ps-worker: the job from %s does not parse: %s\n", o->ps_addr, err);
      return PS_WORKER_EXIT_ERROR;
    }
    if (ps_job_check_layers(&w->job, err) != 0) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
    if (ps_client_param_count(w->client) != w->job.model.n_params) {
      fprintf(stderr, "ps-worker: the servers hold %zu values, the job's model has %zu\n",
              ps_client_param_count(w->client), w->job.model.n_params);
      return PS_WORKER_EXIT_ERROR;
    }
    w->rank = o->index >= 0 ? o->index : ps_client_rank(w->client);
    if (w->job.mode_kind != PS_MODE_ASYNC) ps_client_set_wait_ms(w->client, w->job.wait_timeout_ms);
    if (ps_client_set_wire(w->client, w->job.wire, err) != 0) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_ERROR;
    }
    ps_moving_range mr[PS_MAX_MOVING_RANGES];
    ps_client_set_moving(w->client, mr, ps_model_moving_ranges(&w->job.model, mr));
    if (o->chief < 0) o->chief = !o->have_tf_config && w->rank == 0;
    PS_INFO("registered as worker %016" PRIx64 " (rank %d) with %d shards of job '%s', mode %s, "
            "wire %s%s",
            ps_client_worker_id(w->client), w->rank, w->nshards, w->job.job_id, w->job.mode,
            ps_wire_name(w->job.wire),
            w->job.wire != PS_WIRE_FP32 ? " (16-bit values, pushes with error feedback)" : "");
  }
  if (o->num_workers == 0) o->num_workers = 1;
  /* With data leases the share of the data is decided by shard 0. */
  if (w->rank >= o->num_workers && !(w->client && w->job.lease_chunk > 0) && !o->evaluator) {
    fprintf(stderr, "ps-worker: index %d but only %d workers share the data (--num-workers)\n",
            w->rank, o->num_workers);
    return PS_WORKER_EXIT_USAGE;
  }
  if (o->per_replica_batch > 0) {
    int global = o->per_replica_batch * o->replicas;
    PS_INFO("batch: %d per replica x %d replica(s) = global batch %d (the job says %d)",
            o->per_replica_batch, o->replicas, global, w->job.batch_size);
    w->job.batch_size = global;
  } else if (o->replicas > 1) {
    PS_INFO("batch: global batch %d split over %d replicas (about %d each)", w->job.batch_size,
            o->replicas, (w->job.batch_size + o->replicas - 1) / o->replicas);
  }
  if (o->epochs < 0) o->epochs = w->job.epochs;
  if (o->max_steps < 0) o->max_steps = w->job.max_steps;
  if (o->eval_interval < 0) o->eval_interval = w->job.eval_interval_s;
  return 0;
}

/* The training split (and the test split for the chief), checked against
 * the model's input. */
static int setup_data(ps_worker *w, char *err) {
  const ps_model_spec *spec = &w->job.model;
  double tl = ps_now_s();
  /* Every worker makes the synthetic test split (it costs no file). */
  int all_test = !strcmp(w->job.dataset, "synthetic");
  /* A generated click log: a worker on a static share makes its share
   * only (half the memory and time for two workers). */
  w->train_share = w->client && w->job.lease_chunk == 0 && !w->o.evaluator &&
                   w->o.num_workers > 1 && w->rank < w->o.num_workers &&
                   ps_dataset_job_parts(&w->job);
  int rc = w->train_share ? ps_dataset_load_job_part(&w->job, w->o.data_dir, 1, w->rank,
                                                     w->o.num_workers, &w->train, err)
                          : ps_dataset_load_job(&w->job, w->o.data_dir, 1, &w->train, err);
  if (rc == 0 && (w->o.chief || all_test))
    rc = ps_dataset_load_job(&w->job, w->o.data_dir, 0, &w->test, err);
  if (rc != 0) {
    fprintf(stderr, "ps-worker: %s\n", err);
    return PS_WORKER_EXIT_ERROR;
  }
  if (w->train.c != spec->in_c || w->train.h != spec->in_h || w->train.w != spec->in_w ||
      w->train.classes != spec->classes) {
    fprintf(stderr, "ps-worker: the data set has examples %dx%dx%d in %d classes; the model wants "
                    "%dx%dx%d in %d\n",
            w->train.c, w->train.h, w->train.w, w->train.classes, spec->in_c, spec->in_h,
            spec->in_w, spec->classes);
    return PS_WORKER_EXIT_ERROR;
  }
  if (w->train_share)
    PS_INFO("data: %s, %d train examples (this worker's share: rank %d of %d workers) / %d test "
            "(%.1f s to make)",
            w->job.dataset, w->train.n, w->rank, w->o.num_workers, w->test.n, ps_now_s() - tl);
  else
    PS_INFO("data: %s, %d train / %d test examples (%.1f s to load)", w->job.dataset, w->train.n,
            w->test.n, ps_now_s() - tl);
  return 0;
}

/* The models (training, replicas, the chief's evaluation) and the buffers
 * of what is pulled and pushed. */
static int setup_compute(ps_worker *w, char *err) {
  const ps_model_spec *spec = &w->job.model;
  err[0] = '\0';
  w->model = ps_model_create(spec, w->ops, w->job.batch_size, err);
  if (w->o.replicas > 1) {
    w->reps = ps_replicas_create_for(spec, w->o.replicas, w->job.batch_size, w->ops->name, err);
    if (!w->reps) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_ERROR;
    }
    if (ps_replicas_set_precision(w->reps, w->precision, err) != 0) {
      fprintf(stderr, "ps-worker: --precision %s: %s\n", ps_precision_name(w->precision), err);
      return PS_WORKER_EXIT_USAGE;
    }
    PS_INFO("replicas: %d, %s", w->o.replicas,
            !ps_replicas_on_device(w->reps) ? "one per cpu thread, summed in host memory"
            : ps_replicas_nccl(w->reps)     ? "one per GPU, summed on the GPUs with NCCL"
                                            : "on devices, summed in host memory");
  }
  w->eval_model = w->o.chief ? ps_model_create(spec, w->ops, PS_EVAL_BATCH, err) : NULL;
  const size_t P = spec->n_params;
  size_t ns = w->nshards > 0 ? (size_t)w->nshards : 1;
  w->params = ps_worker_host_buffer(w, P * sizeof(float));
  w->grads = ps_worker_host_buffer(w, P * sizeof(float));
  w->versions = calloc(ns, sizeof(uint64_t));
  w->min_versions = calloc(ns, sizeof(uint64_t));
  w->dparams = w->params;
  w->dgrads = w->grads;
  if (w->model && !w->ops->host_memory) {
    w->dparams = ps_model_alloc_params(w->model);
    w->dgrads = ps_model_alloc_params(w->model);
  }
  if (!w->model || (w->o.chief && !w->eval_model) || !w->params || !w->grads || !w->versions ||
      !w->min_versions || !w->dparams || !w->dgrads) {
    fprintf(stderr, "ps-worker: %s\n", err[0] ? err : "out of memory");
    return PS_WORKER_EXIT_ERROR;
  }
  if (ps_model_n_embeddings(w->model) > 0) {
    /* The rows live on the servers and are fetched per batch. */
    const char *no = w->o.local ? "--local (the rows live on the servers)"
                     : w->reps  ? "--replicas > 1 (the replicas compute whole steps)"
                                : NULL;
    if (no) {
      fprintf(stderr, "ps-worker: a model with embedding layers and %s: not supported\n", no);
      return PS_WORKER_EXIT_USAGE;
    }
    err[0] = '\0';
    if (!w->o.evaluator &&
        !(w->rows = ps_worker_rows_create(w, w->model, w->job.batch_size, 1, err))) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_ERROR;
    }
    if (w->eval_model &&
        !(w->eval_rows = ps_worker_rows_create(w, w->eval_model, PS_EVAL_BATCH, 0, err))) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_ERROR;
    }
  }
  char why[160];
  if (w->ops->graph_begin && w->o.cuda_graphs == 0 && !w->reps &&
      !ps_model_graph_able(w->model, why, sizeof why))
    PS_INFO("cuda graphs: not used: %s", why);
  char desc[512];
  ps_model_spec_describe(spec, desc, sizeof desc);
  PS_INFO("model: %s; device %s%s", desc, w->device_desc,
          w->o.chief ? "; chief: evaluates the test split" : "");
  return 0;
}

int ps_worker_setup(ps_worker *w) {
  char err[PS_ERRLEN];
  ps_worker_opts *o = &w->o;
  /* The device first: the first log line says where this worker computes. */
  w->ops = ps_device_open(o->device, o->threads, w->device_desc, sizeof w->device_desc, err);
  if (!w->ops) {
    fprintf(stderr, "ps-worker: --device %s: %s\n", o->device ? o->device : "auto", err);
    return PS_WORKER_EXIT_USAGE;
  }
  PS_INFO("device: %s", w->device_desc);
  if (o->precision) {
    if (ps_precision_parse(o->precision, &w->precision) != 0) {
      fprintf(stderr, "ps-worker: --precision %s: not one of fp32, tf32, bf16\n", o->precision);
      return PS_WORKER_EXIT_USAGE;
    }
    if (w->precision != PS_PRECISION_FP32) {
      if (!w->ops->set_precision) {
        fprintf(stderr, "ps-worker: --precision %s: the %s backend computes in fp32 only\n",
                o->precision, w->ops->name);
        return PS_WORKER_EXIT_USAGE;
      }
      if (w->ops->set_precision(w->ops->ctx, w->precision, err) != 0) {
        fprintf(stderr, "ps-worker: --precision %s: %s\n", o->precision, err);
        return PS_WORKER_EXIT_USAGE;
      }
      PS_INFO("precision: %s for convolutions and dense layers (float32 parameters, gradients "
              "and optimizer)", o->precision);
    }
  }
  int rc = setup_job(w, err);
  /* Registered: the heartbeats begin now. Loading the data and building
   * the model can take longer than the job's heartbeat timeout (16 workers
   * decoding the data set on 2 cores took 6 s), and a shard that drops
   * the worker meanwhile runs sync steps without it. */
  if (rc == 0 && ps_worker_loop_start(w) != 0) {
    fprintf(stderr, "ps-worker: cannot start the event loop thread\n");
    return PS_WORKER_EXIT_ERROR;
  }
  if (rc == 0) rc = setup_data(w, err);
  if (rc == 0) rc = setup_compute(w, err);
  if (rc != 0) return rc;
  if (o->metrics_path) {
    w->metrics = ps_metrics_open(o->metrics_path, err);
    if (!w->metrics) {
      fprintf(stderr, "ps-worker: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
  }
  if (o->tb_dir && !o->chief) {
    PS_INFO("--tensorboard: only the chief and the evaluator write TensorBoard files; "
            "this worker writes none");
  } else if (o->tb_dir) {
    w->tb = ps_tb_open(o->tb_dir, err);
    if (!w->tb) {
      fprintf(stderr, "ps-worker: --tensorboard: %s\n", err);
      return PS_WORKER_EXIT_USAGE;
    }
    PS_INFO("tensorboard: writing %s", ps_tb_path(w->tb));
  }
  int prc = ps_worker_prom_start(w);
  if (prc != 0) return prc;
  if (!o->evaluator) {
    /* Batches in the backend's host memory (page-locked on a GPU): each is
     * copied to the device straight from its slot, on the copy queue. With
     * replicas each replica copies its part from host memory itself. */
    ps_host_mem batch_mem = {0};
    if (!w->reps && w->ops->host_alloc && w->ops->host_free)
      batch_mem = (ps_host_mem){
          .alloc = w->ops->host_alloc, .free = w->ops->host_free, .ctx = w->ops->ctx};
    if (w->client && w->job.lease_chunk > 0)
      w->source = ps_source_leases(&w->train, w->job.batch_size, w->job.seed, w->client,
                                   o->retry_s, &w->stop, o->max_steps, &batch_mem);
    else
      w->source = ps_source_share(&w->train, w->job.batch_size, w->train_share ? 0 : w->rank,
                                  w->train_share ? 1 : o->num_workers, w->job.seed, w->job.shuffle,
                                  o->epochs, o->max_steps, &batch_mem);
    if (!w->source) {
      fprintf(stderr, "ps-worker: cannot start the input pipeline\n");
      return PS_WORKER_EXIT_ERROR;
    }
    ps_worker_loop_attach_source(w);
  }
  return 0;
}

void ps_worker_teardown(ps_worker *w) {
  /* Every thread that uses the client, the models or the buffers ends
   * before they go: the overlapped step's communication thread already
   * (its begin undoes itself on failure, and the training loop calls its
   * end on every exit); the loop thread here, once a heartbeat still out
   * on libuv's work queue is done (uv_run returns only then); the
   * batcher's next. */
  ps_worker_loop_stop(w);
  ps_worker_prom_stop(w);
  /* The batcher's thread may be asking shard 0 for a lease, or waiting to
   * ask again: it stops before the client it uses goes. */
  atomic_store(&w->stop, 1);
  ps_source_destroy(w->source);
  if (w->client) {
    ps_client_leave(w->client);
    ps_client_destroy(w->client);
  }
  ps_replicas_destroy(w->reps);
  ps_worker_rows_destroy(w, w->rows);
  ps_worker_rows_destroy(w, w->eval_rows);
  if (w->model && w->dparams != w->params) ps_model_free_params(w->model, w->dparams);
  if (w->model && w->dgrads != w->grads) ps_model_free_params(w->model, w->dgrads);
  ps_model_destroy(w->model);
  ps_model_destroy(w->eval_model);
  ps_worker_host_buffer_free(w, w->params); /* before the backend they may belong to */
  ps_worker_host_buffer_free(w, w->grads);
  if (w->ops && strcmp(w->ops->name, "emu") == 0) {
    /* What a GPU would have staged: asynchronous copies whose host side is
     * not the backend's page-locked memory. */
    ps_emu_counts c;
    ps_ops_emu_counts(w->ops, &c);
    PS_INFO("emu device: %d asynchronous copies, %d of them from or to pageable host memory; "
            "%d graph(s) recorded, %d launch(es)",
            c.async_copies, c.pageable_async, c.graphs, c.launches);
  }
  if (w->ops) w->ops->destroy(w->ops);
  free(w->versions);
  free(w->min_versions);
  ps_dataset_free(&w->train);
  ps_dataset_free(&w->test);
  ps_metrics_close(w->metrics);
  char err[PS_ERRLEN];
  if (ps_tb_close(w->tb, err) != 0) PS_WARN("--tensorboard: %s", err);
  free(w->job_text);
}

/* What each exit code means, for the last line. */
static const char *const exit_meaning[] = {
    [PS_WORKER_EXIT_DONE] = "done",
    [PS_WORKER_EXIT_ERROR] = "an error in the job, the data or a request: see above",
    [PS_WORKER_EXIT_USAGE] = "a bad command line: see --help",
    [PS_WORKER_EXIT_UNREACHABLE] = "the servers could not be reached; a later start may succeed",
};

int ps_worker_exit_code(ps_worker *w, int rc) {
  /* A retry that gave up is what failed, however the failure came up. */
  if (rc == PS_WORKER_EXIT_ERROR && atomic_load(&w->gave_up)) rc = PS_WORKER_EXIT_UNREACHABLE;
  if (rc == PS_WORKER_EXIT_UNREACHABLE)
    fprintf(stderr, "ps-worker: %s; exit %d (%s)\n", w->gave_up_msg, rc, exit_meaning[rc]);
  else if (rc != PS_WORKER_EXIT_DONE)
    fprintf(stderr, "ps-worker: exit %d (%s)\n", rc, exit_meaning[rc]);
  return rc;
}

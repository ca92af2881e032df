/* Answering a Pull (pull.h): the shard's snapshot of the range, sent from
 * its immutable buffer without a copy (or encoded once in the job's 16-bit
 * wire format), and a pull of embedding rows read beside it at one
 * version. */
#include "ps/rpc/pull.h"

#include <stdatomic.h>
#include <stdlib.h>

#include "common/half.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"
#include "ps/core/rows.h"

static void release_snapshot(void *user) { ps_snapshot_unref(user); }

/* The snapshot's values in the job's 16-bit encoding, kept with the
 * snapshot (NULL: out of memory). A parameter beyond fp16's range goes out
 * as Inf, which the worker refuses, saying why; the shard says it once
 * too. */
const uint16_t *ps_pull_encode_snapshot(ps_server *sv, ps_snapshot *snap) {
  size_t i = snap->count;
  const uint16_t *h = ps_shard_snapshot_encoded(sv->shard, snap, &i);
  if (h && i < snap->count && atomic_exchange(&sv->wire_range_warned, 1) == 0) {
    PS_WARN("parameter %zu (global index) is %g, beyond %s's range: pulls send it as Inf, which "
            "workers refuse (a job whose parameters grow this large cannot use \"wire\": "
            "\"%s\"); said once",
            snap->begin + i, (double)snap->values[i], ps_wire_name(sv->job.wire),
            ps_wire_name(sv->job.wire));
  }
  return h;
}

/* Answers a pull with the current snapshot, sent without a copy (fp32), or
 * encoded in 16 bits. */
void ps_pull_serve(ps_server *sv, rpc_call *call, size_t offset, size_t count) {
  char err[PS_ERRLEN];
  ps_snapshot *snap = ps_shard_pull(sv->shard, offset, count, err);
  if (!snap) {
    rpc_call_fail(call, RPC_OUT_OF_RANGE, "%s", err);
    return;
  }
  Ps__PullResponse resp = PS__PULL_RESPONSE__INIT;
  resp.version = snap->version;
  resp.offset = snap->begin;
  resp.count = snap->count;
  resp.encoding = (Ps__Encoding)sv->job.wire;
  /* gRPC drops the reference when it has sent the values (float32, or
   * their 16-bit encoding kept with the snapshot). */
  const void *values = snap->values;
  size_t bytes = snap->count * sizeof(float);
  if (sv->job.wire != PS_WIRE_FP32) {
    values = ps_pull_encode_snapshot(sv, snap);
    bytes = snap->count * sizeof(uint16_t);
  }
  rpc_msg out;
  if (!values || wire_encode(&resp.base, values, bytes, release_snapshot, snap, &out) != 0) {
    ps_snapshot_unref(snap);
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
    return;
  }
  ps_pull_reply(sv, call, &out);
}

void ps_pull_reply(ps_server *sv, rpc_call *call, rpc_msg *out) {
  size_t sent = 0;
  for (int i = 0; i < out->nseg; i++) sent += out->seg[i].len;
  atomic_fetch_add(&sv->pull_bytes, sent);
  rpc_call_reply(call, out);
}

void ps_pull_serve_rows(ps_server *sv, rpc_call *call, size_t offset, size_t count,
                        ps_rows_req *rows) {
  char err[PS_ERRLEN];
  const size_t vb = ps_wire_value_bytes(sv->job.wire);
  float *vals = malloc((rows->values ? rows->values : 1) * sizeof(float));
  if (!vals) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory for %zu row values", rows->values);
    ps_rows_free(rows);
    return;
  }
  /* The rows and the dense snapshot at one version: no push commits rows
   * while the read locks are held, and a push's dense values are applied
   * only with its rows. */
  uint32_t locked = 0;
  for (int i = 0; i < rows->n_sec; i++) locked |= 1u << rows->sec[i].table;
  for (int t = 0; t < sv->n_tables; t++)
    if (locked & (1u << t)) ps_table_read_lock(sv->tables[t]);
  size_t at = 0;
  for (int i = 0; i < rows->n_sec; i++) {
    ps_table *tb = sv->tables[rows->sec[i].table];
    ps_table_read_rows_order(tb, rows->sec[i].ids, rows->sec[i].locals, rows->sec[i].order,
                             rows->sec[i].n, vals + at);
    at += rows->sec[i].n * (size_t)ps_table_spec_of(tb)->dim;
  }
  ps_snapshot *snap = NULL;
  uint64_t version = 0;
  if (count > 0) {
    snap = ps_shard_pull(sv->shard, offset, count, err);
  } else {
    ps_shard_stats st;
    ps_shard_stats_get(sv->shard, &st);
    version = st.version;
  }
  for (int t = sv->n_tables - 1; t >= 0; t--)
    if (locked & (1u << t)) ps_table_unlock(sv->tables[t]);
  ps_rows_free(rows);
  if (count > 0 && !snap) {
    free(vals);
    rpc_call_fail(call, RPC_OUT_OF_RANGE, "%s", err);
    return;
  }
  Ps__PullResponse resp = PS__PULL_RESPONSE__INIT;
  resp.version = snap ? snap->version : version;
  resp.offset = snap ? snap->begin : offset;
  resp.count = snap ? snap->count : 0;
  resp.encoding = (Ps__Encoding)sv->job.wire;
  wire_part parts[2];
  int np = 0;
  if (snap) {
    const void *dense = snap->values;
    if (sv->job.wire != PS_WIRE_FP32) dense = ps_pull_encode_snapshot(sv, snap);
    if (!dense) {
      ps_snapshot_unref(snap);
      free(vals);
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
      return;
    }
    parts[np++] = (wire_part){dense, snap->count * vb, release_snapshot, snap};
  }
  void *rbytes = vals;
  if (sv->job.wire != PS_WIRE_FP32) {
    uint16_t *h = malloc((at ? at : 1) * sizeof(uint16_t));
    if (!h) {
      if (snap) ps_snapshot_unref(snap);
      free(vals);
      rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
      return;
    }
    ps_half_encode(sv->job.wire, vals, h, at);
    free(vals);
    rbytes = h;
  }
  parts[np++] = (wire_part){rbytes, at * vb, free, rbytes};
  rpc_msg out;
  if (wire_encode_parts(&resp.base, parts, np, &out) != 0) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
    return;
  }
  ps_pull_reply(sv, call, &out);
}

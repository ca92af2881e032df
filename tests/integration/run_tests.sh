#!/usr/bin/env bash
# Integration tests with real ps-server and ps-worker processes on loopback.
#   run_tests.sh synthetic|bad_input|fashion_mnist BUILD_DIR
# Every wait is bounded; every process started here is stopped on exit.
set -euo pipefail
name=$1
build=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d "/tmp/ps-it-$name.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(",".join("127.0.0.1:%d" % s.getsockname()[1] for s in socks))
PY
}

# final_accuracy LOG: the chief's final test accuracy.
final_accuracy() { sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$1" | tail -1; }

# status FILE KEY: a value from a Status JSON file
status() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

# trained_s LOG: seconds the worker took to train
trained_s() { sed -n 's/^trained .* in \([0-9.]*\) s:.*/\1/p' "$1" | tail -1; }

# at_least A B: A >= B
at_least() { python3 -c "import sys; sys.exit(0 if float('$1') >= float('$2') else 1)"; }

# pipeline_run NAME WORKER-ARGS...: jobs/pipeline.json on 3 shards and one
# worker; logs in $out/NAME/, the final parameters in $out/NAME.bin.
pipeline_run() {
  local name=$1; shift
  "$root/deploy/local-cluster.sh" --job "$here/jobs/pipeline.json" --bin "$build" \
    --servers 3 --workers 1 --out "$out/$name" --timeout 120 --threads 1 -- \
    --save-params "$out/$name.bin" "$@" >"$out/$name.out" 2>&1 \
    || { tail -20 "$out/$name.out"; fail "the run $name ($*) failed"; }
}

case "$name" in
synthetic)
  # 2 shards, 2 workers, a small CNN on the synthetic set: seconds.
  start=$(date +%s)
  "$root/deploy/local-cluster.sh" --job "$here/jobs/synthetic.json" --bin "$build" \
    --out "$out" --timeout 240 --threads 1 -- --log-interval 1 >"$out/cluster.out" 2>&1 \
    || { cat "$out/cluster.out"; fail "the cluster run failed"; }
  acc=$(final_accuracy "$out/worker-0.log")
  echo "synthetic: final test accuracy $acc in $(( $(date +%s) - start )) s"
  [ -n "$acc" ] || fail "no final accuracy in the chief's log"
  at_least "$acc" 0.90 || fail "accuracy $acc below 0.90"
  # The servers' own records: every push of both workers applied, with staleness recorded.
  steps=$(( 2 * 3 * 1024 / 32 ))
  python3 - "$out" "$steps" <<'PY' || fail "server records do not match"
import json, sys
out, steps = sys.argv[1], int(sys.argv[2])
for s in (0, 1):
    st = json.load(open(f"{out}/status-{s}.json"))
    assert st["version"] == steps, f"shard {s}: version {st['version']}, expected {steps} pushes applied"
    assert st["pushes"] == steps and st["rejected"] == 0, st
    assert sum(st["staleness_hist"]) == steps, st["staleness_hist"]
    # (whether two workers overlap at all is up to timing: no bound on it)
    assert st["staleness_max"] >= st["staleness_mean"], st
    print(f"shard {s}: version {st['version']}, staleness mean {st['staleness_mean']:.2f} max {st['staleness_max']}")
recs = [json.loads(l) for l in open(f"{out}/worker-0.jsonl")]
need = {"time", "worker", "step", "loss", "examples_per_sec"}
assert any(need <= set(r) for r in recs), "no progress record with " + str(need)
assert any("test_accuracy" in r for r in recs), "no evaluation record"
srecs = [json.loads(l) for l in open(f"{out}/server-0.jsonl")]
assert srecs and "staleness_mean" in srecs[-1], "no server metrics"
PY
  ;;
bad_input)
  # A job file that does not parse: a clear message with line and column.
  if "$build/ps-server" --job "$here/jobs/broken.json" --ps 127.0.0.1:1 --index 0 \
       >"$out/broken.log" 2>&1; then
    fail "ps-server accepted a job file that does not parse"
  fi
  cat "$out/broken.log"
  grep -q "broken.json" "$out/broken.log" && grep -q "line 6" "$out/broken.log" \
    || fail "the message does not name the file and line 6"
  # Missing job file, bad flags.
  "$build/ps-server" --job /nonexistent.json --ps 127.0.0.1:1 --index 0 >"$out/m.log" 2>&1 && fail "missing job file accepted"
  grep -q "nonexistent.json" "$out/m.log" || fail "missing-file message does not name the file"
  "$build/ps-server" --job "$here/jobs/synthetic.json" --ps 127.0.0.1:1 --index 3 >"$out/i.log" 2>&1 && fail "index outside the list accepted"
  "$build/ps-worker" --ps nonsense >"$out/w.log" 2>&1 && fail "ps-worker accepted a bad address"
  grep -q "HOST:PORT" "$out/w.log" || fail "bad-address message unclear"
  "$build/ps-worker" --ps 127.0.0.1:1 --pipeline sometimes >"$out/p.log" 2>&1 \
    && fail "ps-worker accepted --pipeline sometimes"
  grep -q "on, off or auto" "$out/p.log" || fail "bad --pipeline message unclear"
  "$build/ps-worker" --local --job "$here/jobs/synthetic.json" --device tpu >"$out/d.log" 2>&1 \
    && fail "ps-worker accepted --device tpu"
  grep -q "cuda:N or emu" "$out/d.log" || fail "bad --device message does not list emu"
  # A checkpoint directory holding only a corrupt checkpoint of this job:
  # the shard refuses to start (rather than silently start afresh) and says why.
  mkdir -p "$out/ckpt"
  { printf 'PSCKPT\0\1'; head -c 300 /dev/urandom; } >"$out/ckpt/shard-0-of-1-v5.ckpt"
  if "$build/ps-server" --job "$here/jobs/synthetic.json" --ps 127.0.0.1:1 --index 0 \
       --checkpoint-dir "$out/ckpt" >"$out/ckpt.log" 2>&1; then
    fail "ps-server started from a corrupt checkpoint"
  fi
  cat "$out/ckpt.log" | tail -2
  grep -q "shard-0-of-1-v5.ckpt" "$out/ckpt.log" || fail "the message does not name the corrupt file"
  # Bad requests to a live shard leave its parameters unchanged.
  ports=$(free_ports 1)
  "$build/ps-server" --job "$here/jobs/synthetic.json" --ps "$ports" --index 0 >"$out/server.log" 2>&1 &
  pids+=($!)
  "$build/bad_input" "$ports" || { cat "$out/server.log"; fail "bad-input checks"; }
  grep -q "refused" "$out/server.log" || fail "the server did not log the refused pushes"
  kill -TERM "${pids[0]}"
  wait "${pids[0]}" || fail "ps-server did not exit 0 on SIGTERM"
  pids=()
  ;;
fashion_mnist)
  # 2 shards, 2 workers on the real Fashion-MNIST, one epoch in all.
  [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
    || fail "dataset-fashion-mnist is not installed (deploy/install-deps.sh installs it)"
  start=$(date +%s)
  "$root/deploy/local-cluster.sh" --job "$root/deploy/jobs/fashion_mnist_cnn.json" --bin "$build" \
    --out "$out" --timeout 600 --threads 1 -- --epochs 1 --eval-interval 0 >"$out/cluster.out" 2>&1 \
    || { tail -30 "$out/cluster.out"; fail "the cluster run failed"; }
  acc=$(final_accuracy "$out/worker-0.log")
  echo "fashion_mnist: final test accuracy $acc after one epoch in $(( $(date +%s) - start )) s"
  at_least "$acc" 0.85 || fail "accuracy $acc below 0.85"
  ;;
replicas)
  # One worker with 2 mirrored replicas against 2 shards reaches the same
  # threshold as the plain run (synthetic above).
  "$root/deploy/local-cluster.sh" --job "$here/jobs/synthetic.json" --bin "$build" --workers 1 \
    --out "$out" --timeout 120 --threads 1 -- --replicas 2 --log-interval 1 \
    >"$out/cluster.out" 2>&1 || { tail -20 "$out/cluster.out"; fail "the run failed"; }
  grep -q "split over 2 replicas" "$out/worker-0.log" || fail "the worker did not use 2 replicas"
  acc=$(final_accuracy "$out/worker-0.log")
  echo "replicas: final test accuracy $acc with 2 replicas"
  at_least "$acc" 0.90 || fail "accuracy $acc below 0.90"
  ;;
overlap)
  # Pushes and pulls on a second thread while the next step computes: the
  # run converges, and the shards see the extra version of staleness.
  "$root/deploy/local-cluster.sh" --job "$here/jobs/overlap.json" --bin "$build" --workers 2 \
    --out "$out" --timeout 120 --threads 1 -- --overlap >"$out/cluster.out" 2>&1 \
    || { tail -20 "$out/cluster.out"; fail "the run failed"; }
  grep -q "overlap: pushes and pulls run beside compute" "$out/worker-0.log" \
    || fail "the worker did not overlap"
  acc=$(final_accuracy "$out/worker-0.log")
  smean=$(status "$out/status-0.json" staleness_mean)
  echo "overlap: final test accuracy $acc; staleness mean $smean"
  at_least "$acc" 0.90 || fail "accuracy $acc below 0.90"
  at_least "$smean" 0.9 || fail "staleness $smean: the pushes were not one version staler"
  ;;
evaluator)
  # TensorFlow's evaluator role: evaluates what the shards hold while 2 sync
  # workers train; it is not counted among the workers (sync steps go on
  # without it) and stops by itself once training is over.
  ports=$(free_ports 2)
  for s in 0 1; do
    "$build/ps-server" --job "$here/jobs/sync_equiv.json" --ps "$ports" --index "$s" \
      >"$out/server-$s.log" 2>&1 &
    pids+=($!)
  done
  "$build/ps-worker" --ps "${ports%%,*}" --evaluator --eval-interval 0.2 --idle-evals 3 \
    --max-evals 300 --threads 1 --metrics "$out/evaluator.jsonl" >"$out/evaluator.log" 2>&1 &
  epid=$!; pids+=($epid)
  sleep 0.5
  wpids=()
  for k in 0 1; do
    "$build/ps-worker" --ps "${ports%%,*}" --index "$k" --num-workers 2 --threads 1 \
      --straggle-ms 20 >"$out/worker-$k.log" 2>&1 &
    wpids+=($!); pids+=($!)
  done
  for k in 0 1; do wait "${wpids[$k]}" || { tail -5 "$out/worker-$k.log"; fail "worker $k failed"; }; done
  for i in $(seq 1 300); do kill -0 "$epid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$epid" 2>/dev/null && fail "the evaluator did not stop by itself"
  wait "$epid" || { tail -5 "$out/evaluator.log"; fail "the evaluator failed"; }
  "$build/ps-server" --status "${ports%%,*}" >"$out/status.json"
  [ "$(status "$out/status.json" version)" = 40 ] || fail "sync did not apply its 40 steps"
  grep -q "training is over" "$out/evaluator.log" || fail "the evaluator did not see training end"
  n=$(grep -c test_accuracy "$out/evaluator.jsonl")
  echo "evaluator: $n evaluations; $(grep '^final test accuracy' "$out/evaluator.log")"
  [ "$n" -ge 3 ] || fail "only $n evaluations recorded"
  ;;
sync_equivalence)
  # sync with 2 workers, batch b each == 1 worker, batch 2b, same number of
  # updates, same examples in the same order (no shuffle, no dropout).
  "$root/deploy/local-cluster.sh" --job "$here/jobs/sync_equiv.json" --bin "$build" \
    --out "$out/sync" --timeout 120 --threads 1 -- --save-params "$out/sync-%k.bin" \
    >"$out/sync.out" 2>&1 || { tail -20 "$out/sync.out"; fail "the sync run failed"; }
  "$root/deploy/local-cluster.sh" --job "$here/jobs/sync_equiv_1w.json" --bin "$build" \
    --workers 1 --out "$out/one" --timeout 120 --threads 1 -- --save-params "$out/one.bin" \
    >"$out/one.out" 2>&1 || { tail -20 "$out/one.out"; fail "the one-worker run failed"; }
  v=$(status "$out/sync/status-0.json" version)
  [ "$v" = 40 ] || fail "sync applied $v steps, expected 40"
  python3 - "$out" <<'PY' || fail "parameters differ"
import struct, sys
out = sys.argv[1]
def load(p):
    b = open(p, "rb").read()
    return struct.unpack("<%df" % (len(b) // 4), b)
a, b, c = load(f"{out}/sync-0.bin"), load(f"{out}/one.bin"), load(f"{out}/sync-1.bin")
assert len(a) == len(b) == len(c) and len(a) > 0
assert a == c, "the two sync workers ended with different parameters"
# float32 sums in another order: a few ulps per step over 40 steps
worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
moved = max(abs(x - y) for x, y in zip(a, load(f"{out}/one.bin")))
print(f"sync_equivalence: {len(a)} parameters, largest relative difference {worst:.2e}")
assert worst < 1e-4, worst
PY
  ;;
pipeline)
  # The pipelined step (each shard's parameters go to the compute as they
  # arrive, each shard's gradient out as soon as it is written) computes
  # what the plain step does: one worker, 3 shards, dropout and momentum,
  # 30 steps with --pipeline on, off and auto (off on the cpu) end with the
  # same parameter bytes.
  for mode in on off auto; do pipeline_run "$mode" --pipeline "$mode"; done
  grep -q "pipeline: each shard" "$out/on/worker-0.log" || fail "the pipelined step was not used"
  if grep -q "pipeline: each shard" "$out/off/worker-0.log"; then fail "--pipeline off was ignored"; fi
  if grep -q "pipeline: each shard" "$out/auto/worker-0.log"; then fail "auto pipelined on the cpu"; fi
  # The layout puts shards 1 and 2 in the dense layers: their pushes start
  # before the convolution's backward pass, in every step.
  early=$(sed -n 's/.*pipeline: \([0-9]*\) of \([0-9]*\) shard pushes started while.*/\1 \2/p' \
    "$out/on/worker-0.log")
  echo "pipeline: early pushes / all pushes: ${early:-none}"
  [ "$early" = "60 90" ] || fail "expected 60 of 90 pushes to start during the backward pass"
  for s in 0 1 2; do
    v=$(status "$out/on/status-$s.json" version)
    [ "$v" = 30 ] || fail "shard $s applied $v steps with the pipeline, expected 30"
  done
  # The client's pull and push in parts against 3 live shards, and a pause
  # that makes every shard forget the client (heartbeat time-out 400 ms).
  ports=$(free_ports 3)
  sed 's/"heartbeat_timeout_ms": 5000/"heartbeat_timeout_ms": 400/' "$here/jobs/pipeline.json" \
    >"$out/short-hb.json"
  for s in 0 1 2; do
    "$build/ps-server" --job "$out/short-hb.json" --ps "$ports" --index "$s" \
      >"$out/rounds-server-$s.log" 2>&1 &
    pids+=($!)
  done
  timeout 60 "$build/client_rounds" "${ports%%,*}" 1500 >"$out/rounds.log" 2>&1 \
    || { cat "$out/rounds.log"; fail "client_rounds failed"; }
  grep "^client_rounds: 3 shards" "$out/rounds.log" || fail "client_rounds said nothing"
  python3 - "$out" <<'PY' || fail "parameters differ"
import struct, sys
out = sys.argv[1]
def load(p):
    b = open(p, "rb").read()
    return struct.unpack("<%df" % (len(b) // 4), b)
a, b = load(f"{out}/on.bin"), load(f"{out}/off.bin")
assert len(a) == len(b) and len(a) > 0
assert load(f"{out}/auto.bin") == b, "auto differs from off"
diff = sum(x != y for x, y in zip(a, b))
print(f"pipeline: {len(a)} parameters after 30 steps over 3 shards, {diff} differ")
assert diff == 0, f"{diff} parameters differ"
PY
  ;;
device_paths)
  # A GPU worker's code paths (parameters and gradients in device memory,
  # copies each way, the copy queue and tickets of the pipelined step,
  # replicas that copy in and out, --overlap's buffers) on the emulated
  # device, whose memory checks every pointer and whose copies land late:
  # each run ends with the parameter bytes of the same run on the cpu.
  pipeline_run cpu --device cpu
  pipeline_run emu-pipeline --device emu --pipeline on
  pipeline_run emu-plain --device emu --pipeline off
  pipeline_run cpu-replicas --device cpu --replicas 2
  pipeline_run emu-replicas --device emu --replicas 2
  pipeline_run cpu-overlap --device cpu --overlap
  pipeline_run emu-overlap --device emu --overlap
  grep -q "device: emu" "$out/emu-pipeline/worker-0.log" || fail "the emulated device was not used"
  grep -q "pipeline: each shard" "$out/emu-pipeline/worker-0.log" || fail "no pipelined step"
  grep -q "replicas: 2, on devices" "$out/emu-replicas/worker-0.log" || fail "no device replicas"
  for pair in "cpu emu-pipeline" "cpu emu-plain" "cpu-replicas emu-replicas" \
              "cpu-overlap emu-overlap"; do
    set -- $pair
    cmp -s "$out/$1.bin" "$out/$2.bin" || fail "$2 ended with other parameters than $1"
    echo "device_paths: $2 == $1, bit for bit"
  done
  cmp -s "$out/cpu.bin" "$out/cpu-overlap.bin" && fail "overlap changed nothing: the comparison cannot tell"
  ;;
ssp_bound)
  # ssp:1 with 3 workers, one a straggler: the servers' records show no pull
  # granted more than 1 step ahead of the slowest live worker, and that the
  # bound did hold the fast workers back.
  "$root/deploy/local-cluster.sh" --job "$here/jobs/ssp.json" --bin "$build" --workers 3 \
    --straggler-ms 30 --out "$out" --timeout 180 --threads 1 >"$out/cluster.out" 2>&1 \
    || { tail -20 "$out/cluster.out"; fail "the ssp run failed"; }
  for s in 0 1; do
    lead=$(status "$out/status-$s.json" ssp_max_lead)
    waits=$(status "$out/status-$s.json" waits)
    echo "ssp_bound: shard $s: largest lead at a granted pull $lead (bound 1), $waits pulls waited"
    [ "$lead" -le 1 ] || fail "shard $s granted a pull $lead steps ahead"
    [ "$waits" -gt 0 ] || fail "shard $s never held a pull back: the bound was not exercised"
  done
  ;;
sync_backup)
  # sync, 3 workers, 1 backup, one straggler: steps go at the pace of the
  # two fast workers and the straggler's late gradients are dropped.
  "$root/deploy/local-cluster.sh" --job "$here/jobs/backup.json" --bin "$build" --workers 3 \
    --straggler-ms 30 --out "$out" --timeout 180 --threads 1 >"$out/cluster.out" 2>&1 \
    || { tail -20 "$out/cluster.out"; fail "the sync run failed"; }
  dropped=$(status "$out/status-0.json" dropped)
  fast=$(trained_s "$out/worker-0.log"); slow=$(trained_s "$out/worker-2.log")
  echo "sync_backup: $dropped late gradients dropped; fast worker ${fast} s, straggler ${slow} s"
  [ "$dropped" -ge 3 ] || fail "only $dropped late gradients were dropped"
  # Without the backup, every step would wait for the straggler and the fast
  # workers could not finish before it (their time includes the start-up
  # barrier, hence a margin rather than a ratio of step times).
  python3 -c "import sys; sys.exit(0 if $fast < 0.7 * $slow else 1)" \
    || fail "the fast workers went at the straggler's pace (${fast} s vs ${slow} s)"
  ;;
sync_kill)
  # sync, 3 workers; one is SIGKILLed mid-run: the shards drop it after the
  # heartbeat time-out, the quorum shrinks, and the others finish.
  ports=$(free_ports 2)
  for s in 0 1; do
    "$build/ps-server" --job "$here/jobs/sync3.json" --ps "$ports" --index "$s" \
      >"$out/server-$s.log" 2>&1 &
    pids+=($!)
  done
  wpids=()
  for k in 0 1 2; do
    "$build/ps-worker" --ps "${ports%%,*}" --index "$k" --num-workers 3 --threads 1 \
      --straggle-ms 100 --log-interval 0.2 >"$out/worker-$k.log" 2>&1 &
    wpids+=($!); pids+=($!)
  done
  # Kill worker 2 once steps are under way (bounded wait for that).
  for i in $(seq 1 100); do
    grep -q "step [0-9]*/" "$out/worker-2.log" 2>/dev/null && break
    sleep 0.1
  done
  sleep 0.3
  kill -9 "${wpids[2]}" || fail "worker 2 ended before it could be killed"
  echo "sync_kill: killed worker 2 (pid ${wpids[2]}) mid-run"
  for k in 0 1; do
    for i in $(seq 1 600); do kill -0 "${wpids[$k]}" 2>/dev/null || break; sleep 0.1; done
    kill -0 "${wpids[$k]}" 2>/dev/null && fail "worker $k still running 60 s after the kill: hung"
    wait "${wpids[$k]}" || { tail -5 "$out/worker-$k.log"; fail "worker $k failed"; }
  done
  grep -q "^final test accuracy" "$out/worker-0.log" || fail "the chief did not finish"
  "$build/ps-server" --status "${ports%%,*}" >"$out/status.json"
  dropped_workers=$(status "$out/status.json" workers_dropped)
  echo "sync_kill: the run completed; shard 0 timed out $dropped_workers worker(s)"
  [ "$dropped_workers" -ge 1 ] || fail "the killed worker was never timed out"
  ;;
*)
  fail "unknown test '$name'"
  ;;
esac
rm -rf "$out"
echo "PASS: $name"

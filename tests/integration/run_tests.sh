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

# at_least A B: A >= B
at_least() { python3 -c "import sys; sys.exit(0 if float('$1') >= float('$2') else 1)"; }

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
    assert st["staleness_max"] >= 1, "two async workers never saw a stale push?"
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
*)
  fail "unknown test '$name'"
  ;;
esac
rm -rf "$out"
echo "PASS: $name"

#!/usr/bin/env bash
# GPU benchmark, for a machine with a CUDA device and a CUDA build:
#   - examples/s per GPU of the quickstart CNN and of a larger CNN, trained
#     in-process (ps-worker --local --device cuda);
#   - the same with 1 ps-server + 1 ps-worker on loopback, and the share of
#     each step spent waiting on the servers (pull + push time / step time).
# Exits 77 (skipped) with the reason when no device is there.
#   tests/bench/gpu.sh [BUILD_DIR] [STEPS]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-300}
out=$(mktemp -d /tmp/ps-gpu-bench.XXXXXX)
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done' EXIT
probe=$("$build/ps-worker" --device cuda --local --job "$root/tests/integration/jobs/synthetic.json" \
          --max-steps 1 --eval-interval 0 2>&1) || {
  echo "SKIPPED: $(echo "$probe" | grep -o 'device cuda.*' | head -1)"; exit 77; }
echo "$probe" | grep "device:" | head -1
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for job in fashion_mnist_cnn fashion_mnist_larger_cnn; do
  j="$root/deploy/jobs/$job.json"
  "$build/ps-worker" --device cuda --local --job "$j" --max-steps "$steps" --eval-interval 0 \
    --log-interval 1000 >"$out/$job-local.log" 2>&1
  p=$(port)
  "$build/ps-server" --job "$j" --ps "127.0.0.1:$p" --index 0 --threads 4 >"$out/$job-server.log" 2>&1 &
  pids+=($!); spid=$!
  "$build/ps-worker" --device cuda --ps "127.0.0.1:$p" --max-steps "$steps" --eval-interval 0 \
    --log-interval 2 --metrics "$out/$job.jsonl" >"$out/$job-ps.log" 2>&1
  kill -TERM "$spid"; wait "$spid" || true
  python3 - "$out" "$job" <<'PY'
import json, re, sys
out, job = sys.argv[1], sys.argv[2]
def eps(path):
    for line in open(path):
        m = re.match(r"trained .*: (\d+) examples/s", line)
        if m: return float(m.group(1))
    return float("nan")
recs = [json.loads(l) for l in open(f"{out}/{job}.jsonl") if "pull_ms" in l]
wait = sum(r["pull_ms"] + r["push_ms"] for r in recs)
total = sum(r["pull_ms"] + r["push_ms"] + r["compute_ms"] for r in recs)
print(f"{job}: local {eps(f'{out}/{job}-local.log'):.0f} examples/s; 1 server + 1 worker "
      f"{eps(f'{out}/{job}-ps.log'):.0f} examples/s; waiting on the servers "
      f"{100 * wait / total if total else float('nan'):.1f}% of each step")
PY
done

#!/usr/bin/env bash
# GPU benchmark, for a machine with a CUDA device and a CUDA build:
#   - examples/s per GPU of the quickstart CNN and of a larger CNN, trained
#     in-process (ps-worker --local --device cuda);
#   - the same with 2 ps-servers + 1 ps-worker on loopback, with the
#     pipelined step (--pipeline on, the default) and without, and the share
#     of each step spent waiting on the servers (pull + push time / step
#     time; with the pipeline, the forward pass run while pulling counts as
#     compute, and pushes that went out during the backward pass cost no
#     push time);
#   - for the steps that are not pipelined, where the time goes: pull and
#     push (host clock), parameters and batch in, forward, backward and
#     gradients out (CUDA events, the worker's h2d_ms ... d2h_ms records);
#   - with --pipeline auto too (it times both on the first steps and keeps
#     the faster): its rate against off's;
#   - W GPU workers sharing the GPU against 4 shards on the host's cores
#     (cnn_gpu job, W = 1, 2, 4): the sum of their rates, the GPU's busy
#     share (nvidia-smi) and the shards' CPU use (cores busy, from
#     /proc/PID/stat), so the line says which filled up first;
#   - with several GPUs, --replicas over all of them (NCCL) against one.
# Exits 77 (skipped) with the reason when no device is there.
#   tests/bench/gpu.sh [BUILD_DIR] [STEPS]
# DATA_DIR (optional): where the Fashion-MNIST files are, when not in the
# job's data_dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-300}
out=$(mktemp -d /tmp/ps-gpu-bench.XXXXXX)
# The job's token: every server and client here finds it in PS_TOKEN_FILE.
export PS_TOKEN_FILE="$out/token"
(umask 077; head -c 32 /dev/urandom | base64 >"$PS_TOKEN_FILE")
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done' EXIT
probe=$("$build/ps-worker" --device cuda --local --job "$root/tests/integration/jobs/synthetic.json" \
          --max-steps 1 --eval-interval 0 2>&1) || {
  echo "SKIPPED: $(echo "$probe" | grep -o 'device cuda.*' | head -1)"; exit 77; }
echo "$probe" | grep "device:" | head -1
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# cluster NAME JOB WORKER-ARGS...: 2 servers + 1 worker; metrics in NAME.jsonl
cluster() {
  local name=$1 j=$2; shift 2
  local addrs="127.0.0.1:$(port),127.0.0.1:$(port)" spids=()
  for s in 0 1; do
    "$build/ps-server" --insecure --job "$j" --ps "$addrs" --index "$s" --threads 4 \
      >"$out/$name-server-$s.log" 2>&1 &
    pids+=($!); spids+=($!)
  done
  "$build/ps-worker" --insecure --device cuda --ps "${addrs%%,*}" --max-steps "$steps" --eval-interval 0 \
    --log-interval 2 --metrics "$out/$name.jsonl" ${DATA_DIR:+--data-dir "$DATA_DIR"} "$@" \
    >"$out/$name.log" 2>&1
  for p in "${spids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
}

report() {
  python3 - "$out" "$@" <<'PY'
import json, re, sys
out, job, names = sys.argv[1], sys.argv[2], sys.argv[3:]
def eps(path):
    for line in open(path):
        m = re.match(r"trained .*: (\d+) examples/s", line)
        if m: return float(m.group(1))
    return float("nan")
line = [f"{job}: local {eps(f'{out}/{job}-local.log'):.0f} examples/s"]
for n in names:
    recs = [json.loads(l) for l in open(f"{out}/{n}.jsonl") if "pull_ms" in l]
    wait = sum(r["pull_ms"] + r["push_ms"] for r in recs)
    total = sum(r["pull_ms"] + r["push_ms"] + r["compute_ms"] for r in recs)
    share = 100 * wait / total if total else float("nan")
    mode = n.split("-pipeline-")[1]
    if mode == "auto":
        off = eps(f"{out}/{job}-pipeline-off.log")
        line.append(f"--pipeline auto: {eps(f'{out}/{n}.log'):.0f} examples/s, "
                    f"{eps(f'{out}/{n}.log') / off:.2f}x off's")
        continue
    line.append(f"2 servers + 1 worker, --pipeline {mode}: {eps(f'{out}/{n}.log'):.0f} examples/s, "
                f"waiting {share:.1f}% of each step")
    # Where a plain step's time goes: pull and push on the host clock, the
    # compute's phases on CUDA events (ps-worker records them for steps that
    # are not pipelined).
    ph = [r for r in recs if "forward_ms" in r]
    if ph:
        mean = lambda k: sum(r[k] for r in ph) / len(ph)
        parts = ("pull_ms", "h2d_ms", "forward_ms", "backward_ms", "d2h_ms", "push_ms")
        line.append(f"--pipeline {mode} step, ms: " +
                    " ".join(f"{k[:-3]} {mean(k):.2f}" for k in parts) +
                    f" (compute on the host clock {mean('compute_ms'):.2f})")
print("; ".join(line))
PY
}

for job in fashion_mnist_cnn fashion_mnist_larger_cnn fashion_mnist_cnn_gpu; do
  j="$root/deploy/jobs/$job.json"
  "$build/ps-worker" --device cuda --local --job "$j" --max-steps "$steps" --eval-interval 0 \
    --log-interval 1000 ${DATA_DIR:+--data-dir "$DATA_DIR"} >"$out/$job-local.log" 2>&1
  # The same at tf32 and bf16 (where the GPU has them).
  for p in tf32 bf16; do
    if "$build/ps-worker" --device cuda --local --job "$j" --max-steps "$steps" --eval-interval 0 \
         --precision "$p" --log-interval 1000 ${DATA_DIR:+--data-dir "$DATA_DIR"} \
         >"$out/$job-local-$p.log" 2>&1; then
      echo "$job: local --precision $p: $(grep -o '[0-9]* examples/s' "$out/$job-local-$p.log" | tail -1)"
    else
      echo "$job: local --precision $p: $(tail -1 "$out/$job-local-$p.log")"
    fi
  done
  cluster "$job-pipeline-off" "$j" --pipeline off
  cluster "$job-pipeline-on" "$j" --pipeline on
  cluster "$job-pipeline-auto" "$j" --pipeline auto
  report "$job" "$job-pipeline-off" "$job-pipeline-on" "$job-pipeline-auto"
done

# W workers on one GPU against 4 shards: what fills up first.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
j="$root/deploy/jobs/fashion_mnist_cnn_gpu.json"
hz=$(getconf CLK_TCK)
for W in 1 2 4; do
  addrs="127.0.0.1:$(port),127.0.0.1:$(port),127.0.0.1:$(port),127.0.0.1:$(port)"
  spids=()
  for s in 0 1 2 3; do
    "$build/ps-server" --insecure --job "$j" --ps "$addrs" --index "$s" --threads 4 \
      >"$out/scale-$W-server-$s.log" 2>&1 &
    pids+=($!); spids+=($!)
  done
  t0=$(date +%s.%N); c0=0
  for p in "${spids[@]}"; do c0=$((c0 + $(ticks "$p"))); done
  wpids=()
  for ((k = 0; k < W; k++)); do
    "$build/ps-worker" --insecure --device cuda --ps "${addrs%%,*}" --num-workers "$W" --index "$k" \
      --max-steps "$steps" --eval-interval 0 --log-interval 1000 ${DATA_DIR:+--data-dir "$DATA_DIR"} \
      >"$out/scale-$W-worker-$k.log" 2>&1 &
    wpids+=($!)
  done
  # The GPU's busy share, sampled every 0.5 s while the workers train.
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 \
    >"$out/smi-$W.txt" 2>/dev/null &
  smi=$!
  for p in "${wpids[@]}"; do wait "$p" || true; done
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null || true
  gpu=$(awk '$1 ~ /^[0-9]+$/ {s += $1; n++} END {if (n) printf "%.0f%%", s / n; else print "?"}' \
        "$out/smi-$W.txt")
  c1=0
  for p in "${spids[@]}"; do c1=$((c1 + $(ticks "$p"))); done
  t1=$(date +%s.%N)
  for p in "${spids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
  sum=$(cat "$out"/scale-"$W"-worker-*.log | sed -n 's/^trained .*: \([0-9]*\) examples\/s/\1/p' |
        awk '{s += $1} END {print s + 0}')
  cores=$(python3 -c "print(f'{($c1 - $c0) / $hz / ($t1 - $t0):.1f}')")
  echo "W=$W GPU workers on one GPU, 4 shards: $sum examples/s in all; the GPU busy $gpu of" \
    "the time, the shards $cores of $(nproc) cores"
done

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -ge 2 ]; then
  j="$root/deploy/jobs/fashion_mnist_larger_cnn.json"
  for r in 1 "$gpus"; do
    "$build/ps-worker" --device cuda --local --job "$j" --max-steps "$steps" --eval-interval 0 \
      --replicas "$r" --per-replica-batch 64 --log-interval 1000 ${DATA_DIR:+--data-dir "$DATA_DIR"} \
      >"$out/replicas-$r.log" 2>&1
    grep "replicas:\|^trained" "$out/replicas-$r.log" || true
  done
else
  echo "replicas across GPUs: skipped, ${gpus:-0} GPU(s)"
fi

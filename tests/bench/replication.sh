#!/usr/bin/env bash
# Replicated shards: training examples/s and push latency with R = 1, 2, 3
# replicas per shard, in one run (alternating, ROUNDS times), on the
# quickstart job (deploy/jobs/fashion_mnist_cnn.json): 2 shards, 2 workers,
# STEPS steps each, on loopback.
#
#   tests/bench/replication.sh BUILD_DIR [STEPS] [ROUNDS]
#
# Prints, per R, the examples/s of the two workers together (median over
# the rounds), the mean push time per step (the worker's "push" ms: until
# every replica of every shard has the gradient), and the ratio to R = 1.
set -euo pipefail
build=$(cd "${1:?usage: replication.sh BUILD_DIR [STEPS] [ROUNDS]}" && pwd)
steps=${2:-300}
rounds=${3:-2}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d /tmp/ps-bench-repl.XXXXXX)
for r in 1 2 3; do
  python3 - "$root/deploy/jobs/fashion_mnist_cnn.json" "$out/job-$r.json" "$r" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
j["replicas_per_shard"] = int(sys.argv[3])
j["eval_interval_s"] = 0
json.dump(j, open(sys.argv[2], "w"))
PY
done
for round in $(seq 1 "$rounds"); do
  for r in 1 2 3; do
    run=$out/r$r-$round
    "$root/deploy/local-cluster.sh" --job "$out/job-$r.json" --bin "$build" --servers 2 \
      --workers 2 --out "$run" --timeout 900 -- --max-steps "$steps" --log-interval 5 \
      >"$run.out" 2>&1 || { tail -20 "$run.out"; echo "FAIL: R=$r round $round" >&2; exit 1; }
    echo "R=$r round $round: $(grep -h '^trained' "$run"/worker-*.log | tr '\n' ' ')"
  done
done
python3 - "$out" "$rounds" <<'PY'
import glob, json, re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
res = {}
for r in (1, 2, 3):
    eps, push = [], []
    for k in range(1, rounds + 1):
        run = f"{out}/r{r}-{k}"
        total = 0.0
        for log in glob.glob(f"{run}/worker-*.log"):
            m = re.findall(r"^trained \d+ steps, \d+ examples in [0-9.]+ s: (\d+) examples/s",
                           open(log).read(), re.M)
            total += float(m[-1])
        eps.append(total)
        for f in glob.glob(f"{run}/worker-*.jsonl"):
            for line in open(f):
                rec = json.loads(line)
                if "push_ms" in rec and rec.get("step", 0) > 20:
                    push.append(rec["push_ms"])
    res[r] = (statistics.median(eps), statistics.mean(push) if push else float("nan"))
base = res[1][0]
print("replicas  examples/s  push ms/step  vs R=1")
for r in (1, 2, 3):
    print(f"R={r}       {res[r][0]:10.0f}  {res[r][1]:12.2f}  {res[r][0] / base:6.2f}")
PY
rm -rf "$out"

#!/usr/bin/env bash
# Runs the same job under async, ssp:2, sync, and sync with one backup
# worker, with W workers on loopback and an optional straggler, and writes
# into one directory: every run's logs and metrics, a CSV table and PNG
# plots (test accuracy against wall time and against updates applied).
# The chief of each run also writes TensorBoard event files into
# OUT/tb/MODE (--tensorboard): `tensorboard --logdir OUT/tb` overlays the
# modes' curves (loss, accuracy, throughput, staleness, step times).
#
#   deploy/compare.sh [--workers 4] [--servers 2] [--straggler-ms 0]
#       [--job deploy/jobs/compare_fmnist.json] [--target 0.85]
#       [--modes "async ssp:2 sync sync+backup"] [--out runs/compare] [--bin build]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
workers=4 servers=2 straggler=0 job="$here/jobs/compare_fmnist.json" target=0.85
modes="async ssp:2 sync sync+backup" out="$root/runs/compare" bin="$root/build"
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers=$2; shift 2 ;;
    --servers) servers=$2; shift 2 ;;
    --straggler-ms) straggler=$2; shift 2 ;;
    --job) job=$2; shift 2 ;;
    --target) target=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --help|-h) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
command -v gnuplot >/dev/null || { echo "compare: gnuplot is missing (deploy/install-deps.sh)" >&2; exit 2; }
[ -x "$bin/ps-server" ] || { echo "compare: no ps-server in $bin (build first)" >&2; exit 2; }
mkdir -p "$out"

for mode in $modes; do
  name=${mode//:/}; name=${name//+/-}
  # The job with this mode: sync waits for all W workers before step 1.
  python3 - "$job" "$mode" "$workers" "$out/$name.job.json" <<'PY'
import json, sys
job, mode, workers, dest = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3]), sys.argv[4]
for k in ("backup_workers", "min_workers", "staleness_aware_lr"):
    job.pop(k, None)
if mode.startswith("sync"):
    job["mode"] = "sync"
    job["min_workers"] = workers
    if mode == "sync+backup":
        job["backup_workers"] = 1
else:
    job["mode"] = mode
job["job_id"] = job["job_id"] + "-" + mode.replace(":", "").replace("+", "-")
json.dump(job, open(dest, "w"), indent=2)
PY
  echo "=== $mode: $workers workers, $servers servers, straggler ${straggler} ms"
  rm -rf "$out/$name" "$out/tb/$name"
  start=$(date +%s.%N)
  "$here/local-cluster.sh" --job "$out/$name.job.json" --bin "$bin" --servers "$servers" \
    --workers "$workers" --straggler-ms "$straggler" --threads 1 --out "$out/$name" \
    --timeout 1200 -- --log-interval 5 --tensorboard "$out/tb/$name" >"$out/$name.out" 2>&1 \
    || { tail -20 "$out/$name.out"; echo "compare: the $mode run failed" >&2; exit 1; }
  end=$(date +%s.%N)
  echo "$mode $start $end" >>"$out/.times"
  grep "^final test accuracy" "$out/$name/worker-0.log"
done

python3 - "$out" "$target" "$modes" <<'PY'
import csv, glob, json, os, sys
out, target, modes = sys.argv[1], float(sys.argv[2]), sys.argv[3].split()
times = {}
for line in open(f"{out}/.times"):
    m, a, b = line.split()
    times[m] = float(b) - float(a)
rows = []
for mode in modes:
    name = mode.replace(":", "").replace("+", "-")
    d = f"{out}/{name}"
    evals = [json.loads(l) for l in open(f"{d}/worker-0.jsonl") if "test_accuracy" in l]
    with open(f"{out}/{name}.dat", "w") as f:
        f.write("# elapsed_s updates test_accuracy\n")
        for e in evals:
            f.write(f"{e['elapsed_s']:.2f} {e['updates']} {e['test_accuracy']:.4f}\n")
    reach = next((e["elapsed_s"] for e in evals if e["test_accuracy"] >= target), None)
    st = json.load(open(f"{d}/status-0.json"))
    eps = 0.0
    for log in glob.glob(f"{d}/worker-*.log"):
        for line in open(log):
            if line.startswith("trained "):
                eps += float(line.split(": ")[-1].split()[0])
    rows.append({
        "mode": mode,
        "time_to_target_s": f"{reach:.1f}" if reach is not None else "not reached",
        "final_accuracy": f"{evals[-1]['test_accuracy']:.4f}" if evals else "",
        "examples_per_sec": f"{eps:.0f}",
        "updates": st["version"],
        "staleness_mean": f"{st['staleness_mean']:.2f}",
        "staleness_max": st["staleness_max"],
        "dropped": st["dropped"],
        "pull_waits": st["waits"],
        "wall_s": f"{times.get(mode, 0):.1f}",
    })
with open(f"{out}/summary.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
cols = list(rows[0].keys())
print(f"target test accuracy {target}")
print("| " + " | ".join(cols) + " |")
print("|" + "---|" * len(cols))
for r in rows:
    print("| " + " | ".join(str(r[c]) for c in cols) + " |")
PY

plots() { # x column, x label, file
  local cmd="set terminal pngcairo size 900,560; set output '$out/$3';"
  cmd+=" set key bottom right; set grid; set xlabel '$2'; set ylabel 'test accuracy';"
  cmd+=" set yrange [0.5:1]; plot"
  local sep=""
  for mode in $modes; do
    name=${mode//:/}; name=${name//+/-}
    cmd+="$sep '$out/$name.dat' using $1:3 with linespoints title '$mode'"
    sep=","
  done
  gnuplot -e "$cmd"
}
plots 1 "wall time (s)" accuracy_vs_time.png
plots 2 "updates applied (shard 0 version)" accuracy_vs_updates.png
rm -f "$out/.times"
echo "compare: table $out/summary.csv, plots $out/accuracy_vs_time.png $out/accuracy_vs_updates.png"
echo "compare: TensorBoard: tensorboard --logdir $out/tb"

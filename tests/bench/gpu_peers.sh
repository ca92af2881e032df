#!/usr/bin/env bash
# Against PyTorch on the same GPU: examples/s of ps-worker --local and of
# PyTorch eager and torch.compile (tests/bench/torch_peer.py) training the
# same models: same layers, batch, optimizer and initial value ranges, data
# already on the device for PyTorch, TF32 off on both sides, WARMUP (30)
# untimed steps, then STEPS timed.
#
#   tests/bench/gpu_peers.sh [BIN_DIR] [STEPS]      (build, 300)
#
# For each job it first checks that PyTorch's model has as many parameters
# as ours (batchnorm's running mean and variance count on both sides, as
# in our flat layout's P); a mismatch is an ERROR line and that job's
# ratios are marked not comparable. Then, per job, ours, eager and compile
# run back to back, so each ratio's numbers come from neighbouring minutes
# of the machine (ROUNDS > 1 repeats the three and takes each one's
# median). Prints a table: job, batch, ours, eager, compile, ours/eager,
# ours/compile. The last line sums up the ratios.
#
# Ours' examples/s excludes its warm-up too: it runs WARMUP + STEPS steps
# with a progress record every 0.02 s (--log-interval 0.02 --metrics; a
# record costs about 30 microseconds, under 0.2% of that), and the rate is
# taken from the first record at or past step WARMUP to the last. Its
# "trained" line counts every step, warm-up included; the notes give that
# figure too.
#
# Exit status: 0 done (a torch.compile that fails is reported "not run",
# not a failure); 1 something failed or a parameter count differs; 2 bad
# arguments or no ps-worker; 77 skipped: torch is not importable, or
# DEVICE is cuda and PyTorch sees no CUDA device.
#
# Environment:
#   DEVICE=cuda          cuda or cpu (cpu: a smoke test, not a result)
#   DATA_DIR             where the Fashion-MNIST files are, when not in the
#                        jobs' dataset.dir (/usr/share/datasets/fashion-mnist)
#   PYTHON=python3       the Python that has torch
#   JOBS                 jobs to run (names in deploy/jobs, space-separated)
#   ROUNDS=1             repeats of each job's three runs (medians)
#   WARMUP=30            untimed steps before the STEPS timed
#   COMPILE_MODE=default torch.compile's mode (reduce-overhead: CUDA graphs,
#                        as ours replays its step from one)
#   CUDNN_BENCHMARK=1    let PyTorch's cuDNN time its algorithms (default off:
#                        heuristics pick, as ours)
#   RUN_LIMIT=240        seconds each run may take
#   GPU_PEERS_BUDGET     seconds for the whole script (default: PART_LIMIT,
#                        which tests/gpu/on_device.sh sets, else none): runs
#                        that would start too late are reported "no time"
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/bench
steps=${2:-300}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
jobs=${JOBS:-fashion_mnist_cnn fashion_mnist_larger_cnn fashion_mnist_cnn_gpu fashion_mnist_resnet}
rounds=${ROUNDS:-1}
warmup=${WARMUP:-30}
compile_mode=${COMPILE_MODE:-default}
run_limit=${RUN_LIMIT:-240}
budget=${GPU_PEERS_BUDGET:-${PART_LIMIT:-0}}

die() { echo "gpu_peers: $*" >&2; exit 2; }
for v in steps rounds warmup run_limit budget; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "${v^^} must be a whole number, not '${!v}'"
done
[ "$steps" -gt 0 ] || die "STEPS must be at least 1"
[ "$rounds" -gt 0 ] || die "ROUNDS must be at least 1"
bin_arg=${1:-build}
[ -x "$bin_arg/ps-worker" ] || die "no ps-worker in $bin_arg (build first, or give BIN_DIR)"
bin=$(cd "$bin_arg" && pwd)
for j in $jobs; do [ -f "$root/deploy/jobs/$j.json" ] || die "no job deploy/jobs/$j.json"; done

if ! "$py" -c 'import torch' >/dev/null 2>&1; then
  echo "gpu_peers: SKIPPED: torch is not importable"
  exit 77
fi
if [[ $device == cuda* ]] &&
   ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
  echo "gpu_peers: SKIPPED: torch.cuda.is_available() is false (no CUDA device PyTorch can use)"
  exit 77
fi

out=$(mktemp -d /tmp/gpu-peers.XXXXXX)
results=$out/results.jsonl
t_start=$(date +%s)
# The report needs a few seconds at the end; a run starts only with at
# least min_run seconds left.
deadline=$((budget > 0 ? t_start + budget - 8 : 0))
min_run=20

# Each run goes through timeout(1), which makes it a process group of its
# own; the traps stop the group running when the script is interrupted.
current=""
# shellcheck disable=SC2317 # run by the trap
cleanup() {
  if [ -n "$current" ]; then
    kill -TERM -- "-$current" 2>/dev/null || true
    sleep 1
    kill -KILL -- "-$current" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# limit_now: seconds the next run may take (0: too little time left).
limit_now() {
  local t=$run_limit left
  if [ "$deadline" -gt 0 ]; then
    left=$((deadline - $(date +%s)))
    [ "$left" -ge "$min_run" ] || { echo 0; return; }
    [ "$left" -lt "$t" ] && t=$left
  fi
  echo "$t"
}

# bounded LOG SECS CMD...: CMD with its output in LOG, at most SECS s.
bounded() {
  local log=$1 secs=$2 rc=0
  shift 2
  timeout -k 5 "$secs" "$@" >"$log" 2>&1 &
  current=$!
  wait "$current" || rc=$?
  current=""
  return "$rc"
}

# The parsing and the report, in Python (PyTorch's side has one anyway).
read -r -d '' helper <<'PY' || true
import json, re, statistics, sys

def ours(log, metrics, warmup, rc):
    """ours' rate after its warm-up and over all steps, from its log and
    its progress records."""
    text = open(log, errors="replace").read()
    rec = {"who": "ours"}
    if rc != 0:
        lines = [l for l in text.splitlines()
                 if l.strip() and not re.match(r"ps-worker: exit \d", l)]
        rec["status"] = "timed out" if rc in (124, 137) else "failed"
        rec["note"] = ("stopped at its time limit" if rc in (124, 137) else f"exit {rc}: " +
                       (lines[-1][-300:] if lines else "no output"))
        return rec
    m = re.search(r"^trained (\d+) steps, (\d+) examples in [0-9.]+ s: (\d+) examples/s",
                  text, re.M)
    p = re.search(r"model: .* P=(\d+)", text)
    plan = re.search(r"training: (\d+) examples in this worker's share, (\d+) steps per epoch, "
                     r"\d+ steps, batch (\d+)", text)
    if p: rec["params"] = int(p.group(1))
    if not m or not plan:
        rec["status"] = "failed"
        lines = [l for l in text.splitlines()
                 if l.strip() and not re.match(r"ps-worker: exit \d", l)]
        rec["note"] = lines[-1][-300:] if lines else "no output"
        return rec
    total, examples = int(m.group(1)), int(m.group(2))
    share, spe, batch = (int(g) for g in plan.groups())
    rec.update(status="ok", batch=batch, rate_all=float(m.group(3)), steps_all=total)
    # Examples of step s (1-based): a whole batch, but the last step of
    # each epoch takes what is left of the share.
    last = share - (spe - 1) * batch
    n = lambda s: last if s % spe == 0 else batch  # noqa: E731
    exact = sum(n(s) for s in range(1, total + 1)) == examples
    prog = []
    try:
        prog = [json.loads(l) for l in open(metrics) if '"examples_per_sec"' in l]
    except OSError:
        pass
    start = next((i for i, r in enumerate(prog) if r["step"] >= warmup), None)
    if start is None or start + 1 >= len(prog) or prog[-1]["step"] != total:
        rec["rate"] = rec["rate_all"]
        rec["note"] = "too few progress records: the rate counts every step, warm-up included"
        return rec
    ex = secs = 0.0
    for a, b in zip(prog[start:], prog[start + 1:]):
        k = sum(n(s) for s in range(a["step"] + 1, b["step"] + 1)) if exact else \
            (b["step"] - a["step"]) * batch
        ex += k
        # Each record's rate is its interval's examples over its seconds,
        # and the intervals tile the run: this sums to the elapsed time.
        secs += k / b["examples_per_sec"]
    if not exact:  # the records' clock instead (milliseconds)
        secs = prog[-1]["time"] - prog[start]["time"]
        rec["note"] = "partial batches not accounted for: approximate"
    rec["rate"] = ex / secs if secs > 0 else None
    rec["steps"] = prog[-1]["step"] - prog[start]["step"]
    rec["from_step"] = prog[start]["step"]
    return rec

def torch_run(log, who, rc):
    rec = {"who": who}
    lines = [l for l in open(log, errors="replace").read().splitlines() if l.strip()]
    js = [l for l in lines if l.startswith("{")]
    j = {}
    if js:
        try:
            j = json.loads(js[-1])
        except ValueError:
            pass
    rec.update({k: j[k] for k in ("batch", "params", "torch", "gpu", "steps", "loss") if k in j})
    if j.get("examples_per_s") is not None and rc == 0:
        rec.update(status="ok", rate=j["examples_per_s"])
    elif rc == 3:
        rec.update(status="not run", note=j.get("error", lines[-1] if lines else "")[:300])
    elif rc == 2:
        rec.update(status="not translatable", note=(lines[-1] if lines else "")[:300])
    elif rc in (124, 137):
        rec.update(status="timed out", note="stopped at its time limit (RUN_LIMIT, or what the "
                   "budget left)")
    else:
        rec.update(status="failed", note=f"exit {rc}: " + ((lines[-1] if lines else "")[-300:]))
    return rec

def fmt(x, spec):
    return "-" if x is None else format(x, spec)

def report(path, jobs, steps, warmup, device, torch_version):
    recs = [json.loads(l) for l in open(path)]
    params = {r["job"]: r for r in recs if r.get("kind") == "params"}
    runs = [r for r in recs if r.get("kind") == "run"]
    rows, notes, summary = [], [], {"eager": [], "compile": []}
    hdr = ["job", "batch", "ours", "eager", "compile", "ours/eager", "ours/compile"]
    for job in jobs:
        mine = [r for r in runs if r["job"] == job]
        rate = {}
        for who in ("ours", "eager", "compile"):
            ok = [r["rate"] for r in mine if r["who"] == who and r.get("status") == "ok"
                  and r.get("rate")]
            rate[who] = statistics.median(ok) if ok else None
            bad = [r for r in mine if r["who"] == who and r.get("status") != "ok"]
            for r in bad:
                notes.append(f"{job}: {who}: {r.get('status')}"
                             + (f" ({r['note']})" if r.get("note") else ""))
        pr = params.get(job, {})
        if pr.get("note"):
            notes.append(f"{job}: {pr['note']}")
        if pr and not pr.get("ok") and pr.get("torch") is not None:
            notes.append(f"{job}: not comparable: ours has {pr.get('ours')} parameters, "
                         f"PyTorch's model {pr['torch']}")
        rounds = len({r.get("round") for r in mine})
        for r in mine:
            if r["who"] == "ours" and r.get("status") == "ok":
                if rounds > 1:
                    notes.append(f"{job}: round {r.get('round')}: ours {r['rate']:,.0f}")
                timed = (f"timed steps {r['from_step'] + 1}-{r['steps_all']}" if "from_step" in r
                         else "every step timed")
                notes.append(f"{job}: ours {timed}; over all {r.get('steps_all')} steps, warm-up "
                             f"included (its trained line): {r['rate_all']:,.0f} examples/s"
                             + (f"; {r['note']}" if r.get("note") else ""))
        batch = next((r["batch"] for r in mine if r.get("batch")), None)
        comparable = params.get(job, {}).get("ok", False)
        ratio = {}
        for who in ("eager", "compile"):
            if rate["ours"] and rate[who]:
                ratio[who] = rate["ours"] / rate[who]
                if comparable:
                    summary[who].append(f"{job} {ratio[who]:.2f}x")
            else:
                ratio[who] = None
        cell = lambda who: ("not comparable" if not comparable and ratio[who] is not None
                            else fmt(ratio[who], ".2f"))  # noqa: E731
        rows.append([job, fmt(batch, "d"), fmt(rate["ours"], ",.0f"), fmt(rate["eager"], ",.0f"),
                     fmt(rate["compile"], ",.0f"), cell("eager"), cell("compile")])
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print()
    gpu = next((r["gpu"] for r in runs if r.get("gpu")), None)
    tv = next((r["torch"] for r in runs if r.get("torch")), torch_version)
    print(f"examples/s on {gpu or device}, PyTorch {tv}, {steps} steps after {warmup} warm-up "
          f"steps (ours: from its first progress record at or past step {warmup} to its last):")
    for r in [hdr] + rows:
        print("  ".join(str(c).ljust(w[i]) if i == 0 else str(c).rjust(w[i])
                        for i, c in enumerate(r)))
    if notes:
        print()
        for n in notes:
            print("note:", n)
    print()
    print("gpu_peers: ours/eager " + (", ".join(summary["eager"]) or "none") +
          "; ours/compile " + (", ".join(summary["compile"]) or "none"))

if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "ours":
        r = ours(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif cmd == "torch":
        r = torch_run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        report(sys.argv[2], sys.argv[3].split(), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
               sys.argv[7])
        sys.exit(0)
    print(json.dumps(r))
PY
helper_py() { "$py" -c "$helper" "$@"; }

# add_record JSON KEY=VALUE...: one line of results.jsonl, with the keys added.
add_record() {
  "$py" -c 'import json, sys
r = json.loads(sys.argv[1])
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    r[k] = int(v) if v.isdigit() else v
print(json.dumps(r))' "$@" >>"$results"
}

# why LOG: the line that says why a run stopped (not ps-worker's closing
# "exit N (...)", which follows it).
why() { grep -v -e '^\s*$' -e '^ps-worker: exit [0-9]' "$1" | tail -1; }

torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)
echo "gpu_peers: device $device; ours: $bin/ps-worker; PyTorch $torch_version ($py);" \
  "$warmup warm-up + $steps timed steps; logs in $out"
if [[ $device == cuda* ]]; then nvidia-smi -L 2>/dev/null | head -1 || true; fi
data_args=()
[ -n "${DATA_DIR:-}" ] && data_args=(--data-dir "$DATA_DIR")
peer_args=(--device "$device" --steps "$steps" --warmup "$warmup" --compile-mode "$compile_mode"
           "${data_args[@]}")
[ "${CUDNN_BENCHMARK:-0}" = 1 ] && peer_args+=(--cudnn-benchmark)
failed=0

# 1. The parameter counts: ours from its model line (P=...), PyTorch's
# from --count-params.
declare -A usable
# param_note JOB TEXT [KEY=VALUE...]: a parameter check that came to no
# comparison, said now and noted in the report.
param_note() {
  local job=$1 text=$2
  shift 2
  echo "gpu_peers: $job: $text"
  add_record '{"kind": "params", "ok": false}' "job=$job" "note=$text" "$@"
}
for job in $jobs; do
  j=$root/deploy/jobs/$job.json
  t=$(limit_now)
  if [ "$t" -eq 0 ]; then
    param_note "$job" "no time left for the parameter check (the budget of $budget s)"
    continue
  fi
  rc=0
  bounded "$out/$job-probe.log" "$t" "$bin/ps-worker" --local --device "$device" --job "$j" \
    --max-steps 1 --eval-interval 0 "${data_args[@]}" || rc=$?
  ours_p=$(grep -o 'P=[0-9]*' "$out/$job-probe.log" | head -1 | cut -c3- || true)
  if [ "$rc" -ne 0 ] || [ -z "$ours_p" ]; then
    param_note "$job" "ERROR: ours did not run (exit $rc): $(why "$out/$job-probe.log")"
    failed=1
    continue
  fi
  t=$(limit_now)
  if [ "$t" -eq 0 ]; then
    param_note "$job" "no time left for the parameter check (the budget of $budget s)"
    continue
  fi
  rc=0
  bounded "$out/$job-count.log" "$t" "$py" "$here/torch_peer.py" --job "$j" --count-params || rc=$?
  torch_p=$(grep -E '^[0-9]+$' "$out/$job-count.log" | tail -1 || true)
  if [ "$rc" -eq 2 ]; then
    param_note "$job" "PyTorch cannot mirror it: $(tail -1 "$out/$job-count.log")" "ours=$ours_p"
    usable[$job]=ours
    continue
  elif [ "$rc" -ne 0 ] || [ -z "$torch_p" ]; then
    param_note "$job" "ERROR: torch_peer.py --count-params failed (exit $rc): $(tail -1 \
      "$out/$job-count.log")" "ours=$ours_p"
    failed=1
    usable[$job]=ours
    continue
  fi
  echo "params: $job ours $ours_p, torch $torch_p"
  if [ "$ours_p" = "$torch_p" ]; then
    add_record '{"kind": "params", "ok": true}' "job=$job" "ours=$ours_p" "torch=$torch_p"
  else
    echo "gpu_peers: ERROR: $job: the parameter counts differ (ours $ours_p, torch $torch_p):" \
      "its ratios are not comparable"
    failed=1
    add_record '{"kind": "params", "ok": false}' "job=$job" "ours=$ours_p" "torch=$torch_p"
  fi
  usable[$job]=all
done

# 2. The runs: per job ours, eager, compile, back to back.
no_time() {
  add_record "{\"kind\": \"run\", \"who\": \"$2\", \"status\": \"no time\", \"note\": \"$3\"}" \
    "job=$1" "round=$r"
  echo "gpu_peers: $1: $2: no time ($3)"
}
# said REC WHO: the run's line, and whether it counts as a failure (a
# compile that fails or runs out of time is "not run", no failure).
said() {
  echo "gpu_peers: $job: $2: $(echo "$1" | "$py" -c 'import json, sys
r = json.load(sys.stdin)
print(r["status"], "%.0f examples/s" % r["rate"] if r.get("rate") else r.get("note", ""))')"
  case "$1" in
    *'"status": "ok"'* | *'"status": "not run"'*) ;;
    *'"status": "timed out"'*) [ "$2" = compile ] || failed=1 ;;
    *) failed=1 ;;
  esac
}
usable_jobs=()
for job in $jobs; do [ -z "${usable[$job]:-}" ] || usable_jobs+=("$job"); done
for ((r = 1; r <= rounds; r++)); do
  for ((k = 0; k < ${#usable_jobs[@]}; k++)); do
    job=${usable_jobs[k]}
    j=$root/deploy/jobs/$job.json
    t=$(limit_now)
    if [ "$t" -eq 0 ]; then
      no_time "$job" ours "the budget of $budget s ran out"
    else
      rc=0
      rm -f "$out/$job-ours-$r.jsonl"
      bounded "$out/$job-ours-$r.log" "$t" "$bin/ps-worker" --local --device "$device" --job "$j" \
        --max-steps $((warmup + steps)) --eval-interval 0 --log-interval 0.02 \
        --metrics "$out/$job-ours-$r.jsonl" "${data_args[@]}" || rc=$?
      rec=$(helper_py ours "$out/$job-ours-$r.log" "$out/$job-ours-$r.jsonl" "$warmup" "$rc")
      add_record "$rec" kind=run "job=$job" "round=$r"
      said "$rec" ours
    fi
    [ "${usable[$job]}" = all ] || continue
    for mode in eager compile; do
      t=$(limit_now)
      # Under a budget, a compile (the slow one) leaves the later jobs'
      # ours and eager runs about 25 s each, so that every job gets its
      # ours/eager ratio.
      if [ "$mode" = compile ] && [ "$deadline" -gt 0 ] && [ "$t" -gt 0 ]; then
        later=$(( (${#usable_jobs[@]} - k - 1) + (rounds - r) * ${#usable_jobs[@]} ))
        left=$((deadline - $(date +%s) - 25 * later))
        [ "$left" -lt "$t" ] && t=$left
        [ "$t" -ge "$min_run" ] || t=0
      fi
      if [ "$t" -eq 0 ]; then
        no_time "$job" "$mode" "the budget of $budget s is spent or kept for the other jobs"
        continue
      fi
      rc=0
      bounded "$out/$job-$mode-$r.log" "$t" "$py" "$here/torch_peer.py" --job "$j" --mode "$mode" \
        "${peer_args[@]}" || rc=$?
      rec=$(helper_py torch "$out/$job-$mode-$r.log" "$mode" "$rc")
      add_record "$rec" kind=run "job=$job" "round=$r"
      said "$rec" "$mode"
    done
  done
done

helper_py report "$results" "$jobs" "$steps" "$warmup" "$device" "$torch_version"
exit "$failed"

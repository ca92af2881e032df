#!/usr/bin/env bash
# deploy/study.py on a tiny grid (ps-stale on the synthetic job: 2
# optimizers x 2 staleness values x 2 seeds): a study stopped after 3 runs
# goes on with the other 5 and runs none twice; a run killed mid-way
# (no result.json) is run again; the report has a row per configuration
# with the seeds' mean and sd, and its plots, also as one HTML page; a bad spec is refused with
# exit 2; a cluster study (2 modes, local clusters on loopback) runs and
# reports too.
# Usage: study.sh BUILD_DIR
set -euo pipefail
build=${1:?build dir}
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mktemp -d "/tmp/ps-it-study.XXXXXX")
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
study() { timeout 600 python3 "$root/deploy/study.py" "$@"; }

cat >"$out/tiny.json" <<'EOF'
{"name": "tiny", "runner": "stale",
 "models": {"synthetic": "tests/integration/jobs/synthetic.json"},
 "target": 0.9, "seeds": [1, 2],
 "grid": {"optimizer": ["momentum:0.05:0.9", "adam:0.003"], "staleness": ["fixed:0", "fixed:4"],
          "virtual_workers": [4]},
 "fixed": {"epochs": 3, "eval_per_epoch": 4}}
EOF
study "$out/tiny.json" --out "$out/s" --bin "$build" --max-runs 3 >"$out/first.log" 2>&1 \
  || { cat "$out/first.log"; fail "the first part of the study failed"; }
[ "$(ls "$out"/s/runs/*/result.json | wc -l)" = 3 ] || fail "--max-runs 3 left $(ls "$out"/s/runs/*/result.json | wc -l) results"
# A run killed mid-way: its directory without result.json.
mkdir -p "$out/s/runs/partial" && touch "$out/s/runs/partial/log.txt"
victim=$(ls -d "$out"/s/runs/*/ | grep -v partial | head -1)
rm "$victim/result.json"
study "$out/tiny.json" --out "$out/s" --bin "$build" >"$out/second.log" 2>&1 \
  || { cat "$out/second.log"; fail "the study's second part failed"; }
grep -q "8 runs, 2 done before, 6 to run" "$out/second.log" \
  || { head -3 "$out/second.log"; fail "the resumed study did not run exactly the 6 runs left"; }
[ "$(ls "$out"/s/runs/*/result.json | wc -l)" = 8 ] || fail "not 8 results after the resume"
study "$out/tiny.json" --out "$out/s" --bin "$build" >"$out/third.log" 2>&1 || fail "a finished study failed"
grep -q "8 runs, 8 done before, 0 to run" "$out/third.log" || fail "a finished study ran again"
rep=$out/s/report.md
[ "$(grep -c '^| momentum\|^| adam' "$rep")" = 4 ] || { cat "$rep"; fail "the report has not 4 configuration rows"; }
grep -q '^| adam:0.003 | fixed:0 | [0-9]* ± [0-9]* |' "$rep" || { cat "$rep"; fail "no mean ± sd in the report"; }
grep -q 'vs s = 0' "$rep" || fail "no column normalized by s = 0"
[ "$(grep -c '^<tr><td>\(momentum\|adam\)' "$out/s/report.html")" = 4 ] \
  || { head -c 2000 "$out/s/report.html"; fail "report.html has not the 4 configuration rows"; }
if command -v gnuplot >/dev/null; then
  [ "$(ls "$out"/s/*.png | wc -l)" = 4 ] || fail "not 4 plots"
  for png in "$out"/s/*.png; do grep -q "$(basename "$png")" "$rep" || fail "$png not in the report"; done
  # The same report as one page, the plots inline.
  [ "$(grep -o 'src="data:image/png;base64,' "$out/s/report.html" | wc -l)" = 4 ] \
    || fail "report.html does not hold the 4 plots inline"
  # A band starts at the first evaluation: nothing drawn where no seed
  # had been evaluated yet.
  python3 - "$out/s" <<'PY' || fail "a band starts before the runs' first evaluation"
import glob, json, sys
first = min(json.loads(open(m).readline())["updates"] for m in glob.glob(f"{sys.argv[1]}/runs/*/metrics.jsonl"))
for dat in glob.glob(f"{sys.argv[1]}/plots/*-updates.*.dat"):
    x0 = float(open(dat).readline().split()[0])
    assert x0 >= first, f"{dat} starts at {x0}, before the first evaluation at {first} updates"
PY
else
  echo "study: gnuplot is missing: the plots were not checked (deploy/install-deps.sh installs it)"
fi
# The report again for another target, from the runs' evaluations.
study "$out/tiny.json" --out "$out/s" --bin "$build" --report-only --target 0.5 --report-name r50 \
  >"$out/r50.log" 2>&1 || fail "--report-only --target 0.5 failed"
grep -q "target test accuracy 0.5," "$out/s/r50.md" || fail "the report for target 0.5 does not say so"
grep -q "8 runs, 8 done before, 0 to run" "$out/r50.log" || fail "--report-only ran something"
echo "study: stopped after 3 runs, resumed with the 6 left (one killed mid-way run again); report with 4 rows"

# A run whose loss stops being finite is a result (diverged), not a failure.
cat >"$out/div.json" <<'EOF'
{"name": "div", "runner": "stale", "models": {"synthetic": "tests/integration/jobs/synthetic.json"},
 "target": 0.9, "seeds": [1], "grid": {"optimizer": ["sgd:1e10"], "staleness": ["fixed:4"]},
 "fixed": {"epochs": 3}}
EOF
study "$out/div.json" --out "$out/d" --bin "$build" >"$out/div.log" 2>&1 \
  || { cat "$out/div.log"; fail "a study with a diverging run exited non-zero"; }
grep -q '"status": "diverged (update [0-9]*)"' "$out"/d/runs/*/result.json || fail "the run is not reported as diverged"
grep -q "| diverged |" "$out/d/report.md" || { cat "$out/d/report.md"; fail "the report does not say diverged"; }
echo "study: a diverging run is reported as diverged"

# Bad specs.
bad() { # WHAT PATTERN JSON
  printf '%s' "$3" >"$out/bad.json"
  local rc=0
  study "$out/bad.json" --out "$out/bad" --bin "$build" >"$out/bad.log" 2>&1 || rc=$?
  [ "$rc" = 2 ] || { cat "$out/bad.log"; fail "$1: exit $rc, not 2"; }
  grep -q -e "$2" "$out/bad.log" || { cat "$out/bad.log"; fail "$1: no message matching '$2'"; }
}
bad "not JSON" "Expecting" '{"name": '
bad "no models" '"models" must map' '{"target": 0.9}'
bad "a missing job" "no job file" '{"models": {"m": "nope.json"}, "target": 0.9}'
bad "an unknown axis" "grid axis 'colour'" '{"models": {"m": "tests/integration/jobs/synthetic.json"}, "target": 0.9, "grid": {"colour": [1]}}'
bad "a bad optimizer" "want sgd:LR" '{"models": {"m": "tests/integration/jobs/synthetic.json"}, "target": 0.9, "grid": {"optimizer": ["rmsprop:1"]}}'
bad "a bad target" '"target" must be' '{"models": {"m": "tests/integration/jobs/synthetic.json"}, "target": 2}'
echo "study: bad specs refused with exit 2"

# Stragglers whose delays are drawn per step (ps-worker --straggle): the
# same delays when run again, their mean near the one asked for.
for k in 1 2; do
  timeout 120 "$build/ps-worker" --local --job "$root/tests/integration/jobs/synthetic.json" \
    --max-steps 100 --threads 1 --straggle exp:5 >"$out/straggle-$k.log" 2>&1 || fail "--straggle exp:5 failed"
done
s1=$(grep -o "slept [0-9]* ms over 100 steps" "$out/straggle-1.log" || true)
s2=$(grep -o "slept [0-9]* ms over 100 steps" "$out/straggle-2.log" || true)
[ -n "$s1" ] && [ "$s1" = "$s2" ] || fail "--straggle exp:5: '$s1' then '$s2'"
ms=$(echo "$s1" | awk '{print $2}')
[ "$ms" -ge 300 ] && [ "$ms" -le 700 ] || fail "--straggle exp:5 slept $ms ms in 100 steps (mean 5 ms asked)"
echo "study: --straggle exp:5 $s1, the same twice"

# The cluster runner: async and sync, 2 workers, 1 seed, the second a
# straggler; in half of them every worker draws its delays per step
# instead (the straggler's fixed delay and a drawn one together were once
# passed to one worker, which refused them: no run may fail).
cat >"$out/cluster.json" <<'EOF'
{"name": "cl", "runner": "cluster",
 "models": {"synthetic": "tests/integration/jobs/synthetic.json"},
 "target": 0.9, "seeds": [1], "time_limit_s": 240,
 "grid": {"mode": ["async", "sync"], "workers": [2], "servers": [1], "straggler_ms": [3],
          "straggle_all": ["none", "exp:2"]},
 "fixed": {"epochs": 2, "eval_interval_s": 1}}
EOF
study "$out/cluster.json" --out "$out/c" --bin "$build" >"$out/cluster.log" 2>&1 \
  || { tail -5 "$out/cluster.log"; tail -5 "$out"/c/runs/*/log.txt; fail "the cluster study failed"; }
[ "$(grep -c '^| async\|^| sync' "$out/c/report.md")" = 4 ] || { cat "$out/c/report.md"; fail "the cluster report has not 4 rows"; }
grep -q "\"--straggle\"" "$out"/c/runs/*/run.json || fail "no run with --straggle exp:2"
python3 - "$out"/c/runs/*/result.json <<'PY' || fail "a run of the cluster study did not end 'done'"
import json, sys
bad = [(f, json.load(open(f))["status"]) for f in sys.argv[1:] if json.load(open(f))["status"] != "done"]
for f, s in bad:
    print(f"{f}: {s}")
sys.exit(1 if bad else 0)
PY
echo "study: a cluster study of async and sync, with and without drawn stragglers, ran and reported"
echo "PASS: study"

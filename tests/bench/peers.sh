#!/usr/bin/env bash
# Against TensorFlow: the same model, data, optimizer and batch trained by
#   tf1:     TensorFlow in one process (tf_keras model.fit, 2 intra- and
#            2 inter-op threads)
#   local:   ps-worker --local --threads 2
#   tfps:    TensorFlow's ParameterServerStrategy, 2 ps + 2 workers + the
#            chief as local processes on loopback (coordinator.schedule)
#   cluster: deploy/local-cluster.sh, 2 ps-server + 2 ps-worker
# for the quickstart CNN (the job deploy/quickstart.sh runs) and
# deploy/jobs/cnn_large.json. Each system runs twice: PEERS_STEPS steps
# after PEERS_WARMUP steps for examples/s (no evaluation), then
# PEERS_EPOCHS epochs from fresh parameters with the test split evaluated
# every PEERS_EVAL_S seconds, for the test accuracy and the training time
# until it first reaches PEERS_TARGET. Prints a markdown table and writes
# the raw numbers to BUILD_DIR/peers/results.json (logs beside it).
#
#   tests/bench/peers.sh [BUILD_DIR]      (default: build)
#
# TensorFlow goes into a venv, BUILD_DIR/peers-venv (reused when present):
# tensorflow-cpu and tf_keras at the versions pinned below, from PyPI.
# Knobs (environment):
#   PEERS_ONLY=tf1,local,tfps,cluster  the systems to run
#   PEERS_MODELS=quickstart,large      the models
#   PEERS_STEPS=300 PEERS_WARMUP=30    the examples/s runs: steps per worker (the
#                                      strategy: steps scheduled, all workers)
#   PEERS_EPOCHS=3                     the accuracy runs (0: none)
#   PEERS_MAX_STEPS=0                  cap on an accuracy run's steps, all workers together (0: none)
#   PEERS_EVAL_S=20 PEERS_TARGET=0.89  evaluation interval, accuracy target
#   PEERS_TIMEOUT=2400                 seconds each system may take per model
set -euo pipefail

tf_pin=tensorflow-cpu==2.18.1
keras_pin=tf_keras==2.18.0

root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
here=$root/tests/bench
only=${PEERS_ONLY:-tf1,local,tfps,cluster}
models=${PEERS_MODELS:-quickstart,large}
steps=${PEERS_STEPS:-300} warmup=${PEERS_WARMUP:-30} epochs=${PEERS_EPOCHS:-3}
max_steps=${PEERS_MAX_STEPS:-0} eval_s=${PEERS_EVAL_S:-20} target=${PEERS_TARGET:-0.89}
limit=${PEERS_TIMEOUT:-2400}
out=$build/peers
venv=$build/peers-venv

die() { echo "peers: $*" >&2; exit 2; }
for v in steps warmup epochs max_steps limit; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "PEERS_${v^^} must be a whole number, not '${!v}'"
done
[[ $eval_s =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "PEERS_EVAL_S must be a number of seconds, not '$eval_s'"
[[ $target =~ ^0?\.[0-9]+$ ]] || die "PEERS_TARGET must be an accuracy in (0, 1), not '$target'"
[ "$steps" -gt 0 ] || die "PEERS_STEPS must be at least 1"
IFS=, read -r -a parts <<<"$only"
IFS=, read -r -a model_names <<<"$models"
for p in "${parts[@]}"; do
  case "$p" in tf1|local|tfps|cluster) ;; *) die "PEERS_ONLY: unknown system '$p' (tf1, local, tfps, cluster)" ;; esac
done
# The quickstart's job, as deploy/quickstart.sh names it.
quickstart_job=$(sed -n 's/.*--job \([^ ]*\.json\).*/\1/p' "$root/deploy/quickstart.sh" | head -1)
[ -n "$quickstart_job" ] || die "cannot find the job deploy/quickstart.sh runs"
job_of() {
  case "$1" in
    quickstart) echo "$root/$quickstart_job" ;;
    large) echo "$root/deploy/jobs/cnn_large.json" ;;
    *) die "PEERS_MODELS: unknown model '$1' (quickstart, large)" ;;
  esac
}
for m in "${model_names[@]}"; do job_of "$m" >/dev/null; done
if [ ! -x "$build/ps-worker" ] || [ ! -x "$build/ps-server" ]; then
  die "no ps-server/ps-worker in $build (build first)"
fi
wants() { [[ ",$only," == *",$1,"* ]]; }

# Every part runs under timeout(1), which puts it in a process group of
# its own: stopping that group stops everything the part started.
groups=()
# shellcheck disable=SC2317 # run by the trap
cleanup() {
  local g
  for g in "${groups[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
  [ "${#groups[@]}" -eq 0 ] || sleep 1
  for g in "${groups[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# run_bounded LOG CMD...: CMD with its output in LOG, at most $limit s.
run_bounded() {
  local log=$1 g rc=0; shift
  timeout -k 10 "$limit" "$@" >"$log" 2>&1 &
  g=$!
  groups+=("$g")
  wait "$g" || rc=$?
  kill -KILL -- "-$g" 2>/dev/null || true # whatever the part left behind
  local keep=() x
  for x in "${groups[@]}"; do [ "$x" = "$g" ] || keep+=("$x"); done
  groups=("${keep[@]}")
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || echo "peers: time limit of ${limit}s passed (PEERS_TIMEOUT)" >>"$log"
  return "$rc"
}

setup_venv() {
  local pins="$tf_pin $keras_pin"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.peers-pins" 2>/dev/null)" = "$pins" ]; then
    return 0
  fi
  echo "peers: installing $pins into $venv (from PyPI; about 600 MB)"
  rm -rf "$venv"
  python3 -m venv "$venv" || { echo "peers: cannot create a venv with python3 -m venv" >&2; exit 1; }
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check -q "$tf_pin" "$keras_pin" \
      >"$build/peers-pip.log" 2>&1; then
    tail -5 "$build/peers-pip.log" >&2
    echo "peers: pip could not install $pins into $venv (log: $build/peers-pip.log);" \
         "TensorFlow's parts need PyPI, or run PEERS_ONLY=local,cluster" >&2
    rm -rf "$venv"
    exit 1
  fi
  echo "$pins" >"$venv/.peers-pins"
}

# now: seconds since the epoch, with a fraction
now() { date +%s.%N; }

# part_tf KIND MODEL JOB DIR: tf1 (single) or tfps (ps), both phases.
part_tf() {
  local kind=$1 job=$3 dir=$4 extra=()
  [ "$kind" = ps ] && extra=(--logdir "$dir")
  [ "$kind" = single ] && extra=(--threads 2)
  CUDA_VISIBLE_DEVICES=-1 run_bounded "$dir/part.log" "$venv/bin/python" -u "$here/peers_tf.py" "$kind" \
    --job "$job" --steps "$steps" --warmup "$warmup" --epochs "$epochs" --max-steps "$max_steps" \
    --eval-s "$eval_s" --target "$target" --out "$dir/result.json" "${extra[@]}"
}

# part_local JOB DIR: ps-worker --local, the examples/s run then the accuracy run.
part_local() {
  local job=$1 dir=$2
  run_bounded "$dir/speed.log" "$build/ps-worker" --local --job "$job" --threads 2 \
    --max-steps $((warmup + steps)) --eval-interval 0 --log-interval 1 --metrics "$dir/speed.jsonl" || return
  [ "$epochs" -gt 0 ] || return 0
  run_bounded "$dir/acc.log" "$build/ps-worker" --local --job "$job" --threads 2 --epochs "$epochs" \
    --max-steps "$max_steps" --eval-interval "$eval_s" --log-interval 5 --metrics "$dir/acc.jsonl"
}

# part_cluster JOB DIR: deploy/local-cluster.sh, 2 servers + 2 workers, both runs.
part_cluster() {
  local job=$1 dir=$2 t0
  run_bounded "$dir/speed.log" "$root/deploy/local-cluster.sh" --job "$job" --bin "$build" \
    --servers 2 --workers 2 --out "$dir/speed" --timeout "$limit" -- \
    --max-steps $((warmup + steps)) --eval-interval 0 --log-interval 1 || return
  [ "$epochs" -gt 0 ] || return 0
  t0=$(now)
  run_bounded "$dir/acc.log" "$root/deploy/local-cluster.sh" --job "$job" --bin "$build" \
    --servers 2 --workers 2 --out "$dir/acc" --timeout "$limit" -- \
    --epochs "$epochs" --max-steps $(((max_steps + 1) / 2)) --eval-interval "$eval_s" --log-interval 5 || return
  echo "$t0 $(now)" >"$dir/acc.wall"
}

if wants tf1 || wants tfps; then setup_venv; fi
mkdir -p "$out"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
failed=0
for m in "${model_names[@]}"; do
  job=$(job_of "$m")
  data=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["dataset"]["dir"])' "$job")
  ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1 \
    || { echo "peers: no Fashion-MNIST in $data (deploy/install-deps.sh installs it)" >&2; exit 1; }
  for p in "${parts[@]}"; do
    dir=$out/$m/$p
    rm -rf "$dir"; mkdir -p "$dir"
    echo "peers: $m ($(basename "$job")): $p ..."
    t0=$(now) rc=0
    case "$p" in
      tf1) part_tf single "$m" "$job" "$dir" || rc=$? ;;
      tfps) part_tf ps "$m" "$job" "$dir" || rc=$? ;;
      local) part_local "$job" "$dir" || rc=$? ;;
      cluster) part_cluster "$job" "$dir" || rc=$? ;;
    esac
    echo "$t0 $(now)" >"$dir/wall"
    if [ "$rc" -ne 0 ]; then
      failed=1
      echo "failed (exit $rc)" >"$dir/status"
      echo "peers: $m: $p FAILED (exit $rc); logs in $dir" >&2
      for f in "$dir"/*.log; do echo "--- $f"; tail -5 "$f"; done >&2
    else
      echo ok >"$dir/status"
    fi
  done
done
python3 "$here/peers_report.py" "$out" --models "$models" --parts "$only" --steps "$steps" \
  --warmup "$warmup" --epochs "$epochs" --max-steps "$max_steps" --eval-s "$eval_s" --target "$target" \
  --load-before "$load_before" --pins "$tf_pin $keras_pin" --quickstart-job "$quickstart_job"
exit "$failed"

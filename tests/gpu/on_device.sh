#!/usr/bin/env bash
# The GPU kit: on a GPU machine, from the repository root, with the bundle
# that tests/gpu/bundle.sh made here (.gpu/bundle.tar.xz; carry .gpu). It
# runs its parts in order of value, each bounded in time, within one time
# budget (default 330 s, so that the whole kit ends within 6 minutes): a
# part that would start with less than 15 s left is skipped and says so.
#
#   1. parity      test_cuda_parity: every CUDA op against its CPU twin
#   2. training    the quickstart CNN 300 steps at fp32, tf32 and bf16 (each
#                  within 0.01 of fp32's test accuracy); the ResNet job on the
#                  GPU and on the cpu (within 0.04 of each other)
#   3. bitwise     the pipelined step against the plain one (3 shards), and
#                  CUDA Graphs replayed against the same steps op by op: the
#                  same parameters, bit for bit
#   4. sanitizers  compute-sanitizer memcheck, racecheck and synccheck on
#                  test_cuda_parity, memcheck on a few training steps (CNN,
#                  ResNet); cuBLAS alone (cublas_race) under racecheck beside
#                  them; tests/gpu/sanitizer_report.py tells the expected
#                  reports (a refusal made on purpose, cuBLAS's own hazards)
#                  from the rest
#   5. benchmark   tests/bench/gpu.sh (ours: local, cluster, phases)
#   6. peers       tests/bench/gpu_peers.sh (PyTorch on the same models)
#
# Each part ends with one line "PART <name>: PASS|FAIL|SKIP (...) in N s";
# the last line counts them. Everything goes to stdout and, when OUT is
# set, to $OUT/gpu.log (and each part's full output to $OUT/parts/).
#   tests/gpu/on_device.sh [BUDGET_S] [BENCH_STEPS]   (330, 200)
set -uo pipefail
root=$(pwd)
budget=${1:-330}
steps=${2:-200}
t0=$(date +%s)
b=/tmp/ps-gpu
rm -rf "$b" && mkdir -p "$b/parts" && tar -C "$b" -xf .gpu/bundle.tar.xz || exit 1
log=${OUT:+$OUT/gpu.log}
[ -n "${OUT:-}" ] && mkdir -p "$OUT/parts"
say() { echo "$*"; [ -n "$log" ] && echo "$*" >>"$log"; return 0; }
left() { echo $((budget - ($(date +%s) - t0))); }
# The CUDA libraries: the system's, else those of the Python packages there
# (PyTorch's wheels carry cuBLAS, cuDNN and NCCL). Only they come through
# LD_LIBRARY_PATH; the bundled libraries are found through RUNPATHs.
extra=$(python3 - <<'PY' 2>/dev/null
import glob, os, sys
dirs = set()
for p in sys.path:
    for lib in glob.glob(os.path.join(p, "nvidia", "*", "lib")):
        dirs.add(lib)
print(":".join(sorted(dirs)))
PY
)
cuda_lib=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [ -d "$d" ] && cuda_lib="$cuda_lib:$d"; done
lib_path="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${extra}${cuda_lib}"
export LD_LIBRARY_PATH="${lib_path#:}"

nvidia-smi -L 2>&1 | while read -r l; do say "$l"; done
drv=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
say "driver supports CUDA ${drv:-?}; this build needs 13.0 or newer"
if [ -n "$drv" ] && [ "${drv%%.*}" -lt 13 ]; then
  say "STOP: the NVIDIA driver is too old for this build (CUDA $drv < 13.0): update the driver," \
    "or build with a CUDA toolkit the driver supports"
  exit 2
fi
for p in "$b"/bin/*; do
  missing=$(ldd "$p" | grep "not found")
  if [ -n "$missing" ]; then
    say "STOP: $(basename "$p") cannot load: $missing"
    say "  (cuBLAS 13, cuDNN 9 and NCCL 2 must be on the system or in LD_LIBRARY_PATH, e.g." \
      "pip install nvidia-cublas nvidia-cudnn-cu13 nvidia-nccl-cu13)"
    exit 2
  fi
done

passed=0 failed=0 skipped=0
# part NAME MAX_S FUNCTION: runs FUNCTION (its output to parts/NAME.log) for
# at most MAX_S seconds and what is left of the budget; FUNCTION's last
# line is the part's summary, its exit status the verdict (77: skipped).
part() {
  local name=$1 max=$2 fn=$3 l s rc
  l=$(left)
  if [ "$l" -lt 15 ]; then
    say "PART $name: SKIP (the kit's budget of $budget s is spent)"
    skipped=$((skipped + 1))
    return
  fi
  [ "$max" -gt "$l" ] && max=$l
  s=$(date +%s)
  PART_LIMIT=$max timeout --kill-after=5 "$max" bash -c "$(declare -f); $fn" >"$b/parts/$name.log" 2>&1
  rc=$?
  local summary; summary=$(grep -v '^\s*$' "$b/parts/$name.log" | tail -1)
  local took=$(($(date +%s) - s))
  [ -n "${OUT:-}" ] && cp "$b/parts/$name.log" "$OUT/parts/"
  if [ "$rc" = 0 ]; then
    say "PART $name: PASS ($summary) in $took s"; passed=$((passed + 1))
  elif [ "$rc" = 77 ]; then
    say "PART $name: SKIP ($summary) in $took s"; skipped=$((skipped + 1))
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "PART $name: FAIL (timed out after $max s; last: $summary)"; failed=$((failed + 1))
  else
    say "PART $name: FAIL ($summary) in $took s"; failed=$((failed + 1))
  fi
}
export b root steps

acc_of() { sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$1" | tail -1; }
rate_of() { grep -o '[0-9]* examples/s' "$1" | tail -1; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

parity() {
  "$b/bin/test_cuda_parity" 2>&1 | tail -20
  local rc=${PIPESTATUS[0]}
  return "$rc"
}

training() {
  local fails=0 p rc
  for p in fp32 tf32 bf16; do
    timeout 60 "$b/bin/ps-worker" --local --device cuda --precision "$p" \
      --job deploy/jobs/fashion_mnist_cnn.json --data-dir "$b/data" --max-steps 300 \
      --eval-interval 0 >"$b/precision-$p.log" 2>&1
    rc=$?
    if [ "$rc" = 2 ] && grep -q "compute capability" "$b/precision-$p.log"; then
      echo "precision $p: not on this GPU"
      continue
    fi
    echo "precision $p: exit $rc, $(rate_of "$b/precision-$p.log"), accuracy $(acc_of "$b/precision-$p.log")"
    [ "$rc" = 0 ] || fails=$((fails + 1))
  done
  for p in tf32 bf16; do
    [ -n "$(acc_of "$b/precision-$p.log")" ] && [ -n "$(acc_of "$b/precision-fp32.log")" ] || continue
    python3 -c "import sys; sys.exit(0 if float('$(acc_of "$b/precision-$p.log")') >= float('$(acc_of "$b/precision-fp32.log")') - 0.01 else 1)" ||
      { echo "FAIL: precision $p ends more than 0.01 below fp32's accuracy"; fails=$((fails + 1)); }
  done
  local d
  for d in cuda cpu; do
    timeout 150 "$b/bin/ps-worker" --local --device "$d" --job deploy/jobs/fashion_mnist_resnet.json \
      --data-dir "$b/data" --max-steps 300 --eval-interval 0 >"$b/resnet-$d.log" 2>&1 ||
      { echo "FAIL: the ResNet job on $d: $(tail -1 "$b/resnet-$d.log")"; fails=$((fails + 1)); }
    echo "resnet on $d: $(rate_of "$b/resnet-$d.log"), accuracy $(acc_of "$b/resnet-$d.log")"
  done
  if [ -n "$(acc_of "$b/resnet-cuda.log")" ] && [ -n "$(acc_of "$b/resnet-cpu.log")" ]; then
    python3 -c "import sys; sys.exit(0 if abs(float('$(acc_of "$b/resnet-cuda.log")') - float('$(acc_of "$b/resnet-cpu.log")')) <= 0.04 else 1)" ||
      { echo "FAIL: the ResNet's accuracy on the GPU differs from the cpu's by more than 0.04"; fails=$((fails + 1)); }
  fi
  echo "fp32 $(acc_of "$b/precision-fp32.log"), tf32 $(acc_of "$b/precision-tf32.log"), bf16 $(acc_of "$b/precision-bf16.log"); resnet cuda $(acc_of "$b/resnet-cuda.log") cpu $(acc_of "$b/resnet-cpu.log"); $fails failure(s)"
  [ "$fails" = 0 ]
}

bitwise() {
  local fails=0 mode g s p addrs spids
  for mode in on off; do
    addrs="127.0.0.1:$(port),127.0.0.1:$(port),127.0.0.1:$(port)"
    spids=()
    for s in 0 1 2; do
      "$b/bin/ps-server" --insecure --job tests/integration/jobs/pipeline.json --ps "$addrs" --index "$s" \
        >"$b/server-$mode-$s.log" 2>&1 &
      spids+=($!)
    done
    timeout 60 "$b/bin/ps-worker" --insecure --device cuda --ps "${addrs%%,*}" --num-workers 1 \
      --pipeline "$mode" --save-params "$b/$mode.bin" --log-interval 1 >"$b/pipeline-$mode.log" 2>&1 ||
      { echo "FAIL: --pipeline $mode: $(tail -1 "$b/pipeline-$mode.log")"; fails=$((fails + 1)); }
    for p in "${spids[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p"; done
  done
  if cmp -s "$b/on.bin" "$b/off.bin"; then echo "pipeline on == off, bit for bit"
  else echo "FAIL: the pipelined step ended with other parameters"; fails=$((fails + 1)); fi
  for g in on off; do
    timeout 60 "$b/bin/ps-worker" --local --device cuda --cuda-graphs "$g" \
      --job deploy/jobs/fashion_mnist_cnn.json --data-dir "$b/data" --max-steps 40 \
      --eval-interval 0 --save-params "$b/graphs-$g.bin" >"$b/graphs-$g.log" 2>&1 ||
      { echo "FAIL: --cuda-graphs $g: $(tail -1 "$b/graphs-$g.log")"; fails=$((fails + 1)); }
  done
  if cmp -s "$b/graphs-on.bin" "$b/graphs-off.bin"; then echo "cuda graphs on == off, bit for bit"
  else echo "FAIL: the replayed steps ended with other parameters"; fails=$((fails + 1)); fi
  echo "pipeline on/off and cuda graphs on/off: $fails failure(s)"
  [ "$fails" = 0 ]
}

sanitizers() {
  local cs fails=0 tool
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -z "$cs" ]; then
    echo "compute-sanitizer is not on this machine: memcheck, racecheck and synccheck not run"
    return 77
  fi
  # cuBLAS alone first: the evidence racecheck's reports are read against.
  timeout 60 "$cs" --tool racecheck "$b/bin/cublas_race" >"$b/san-cublas.log" 2>&1
  python3 tests/gpu/sanitizer_report.py racecheck cublas_race "$b/san-cublas.log" $? |
    sed 's/^/(cuBLAS alone) /'
  for tool in memcheck racecheck synccheck; do
    timeout 90 "$cs" --tool "$tool" "$b/bin/test_cuda_parity" >"$b/san-$tool.log" 2>&1
    python3 tests/gpu/sanitizer_report.py "$tool" test_cuda_parity "$b/san-$tool.log" $? \
      --library "$b/san-cublas.log" || fails=$((fails + 1))
  done
  timeout 60 "$cs" --tool memcheck "$b/bin/ps-worker" --local --device cuda \
    --job deploy/jobs/fashion_mnist_cnn.json --data-dir "$b/data" --max-steps 5 \
    --eval-interval 0 >"$b/san-train.log" 2>&1
  python3 tests/gpu/sanitizer_report.py memcheck "training (CNN)" "$b/san-train.log" $? || fails=$((fails + 1))
  timeout 60 "$cs" --tool memcheck "$b/bin/ps-worker" --local --device cuda \
    --job deploy/jobs/fashion_mnist_resnet.json --data-dir "$b/data" --max-steps 3 \
    --eval-interval 0 >"$b/san-resnet.log" 2>&1
  python3 tests/gpu/sanitizer_report.py memcheck "training (ResNet)" "$b/san-resnet.log" $? || fails=$((fails + 1))
  echo "memcheck, racecheck, synccheck: $fails part(s) with unexpected reports"
  [ "$fails" = 0 ]
}

benchmark() {
  DATA_DIR="$b/data" bash tests/bench/gpu.sh "$b/bin" "$steps"
}

peers() {
  DATA_DIR="$b/data" bash tests/bench/gpu_peers.sh "$b/bin" "$steps"
}

part parity 90 parity
part training 150 training
part bitwise 90 bitwise
part sanitizers 150 sanitizers
part benchmark 150 benchmark
part peers 150 peers
say "on_device: $passed passed, $failed failed, $skipped skipped in $(($(date +%s) - t0)) s (budget $budget s)"
exit $((failed > 0))

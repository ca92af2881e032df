#!/usr/bin/env bash
# On a GPU machine, from the repository root, with .gpu/bundle.tar.xz made
# by tests/gpu/bundle.sh here (carry .gpu): the GPU tests, a check that the
# pipelined step on the GPU gives the plain step's parameters bit for bit,
# and the GPU benchmark. Results go to stdout and, when OUT is set, to
# $OUT/gpu.log. Each part is bounded in time.
#   tests/gpu/on_device.sh [STEPS]    (benchmark steps, default 300)
set -uo pipefail
root=$(pwd)
steps=${1:-300}
b=/tmp/ps-gpu
rm -rf "$b" && mkdir -p "$b" && tar -C "$b" -xJf .gpu/bundle.tar.xz || exit 1
# The CUDA libraries: the system's, else those of the Python packages there.
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
# Only the CUDA libraries come through LD_LIBRARY_PATH (after the user's);
# the bundled ones are on the programs' RUNPATH ($ORIGIN/../lib).
lib_path="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${extra}${cuda_lib}"
export LD_LIBRARY_PATH="${lib_path#:}"
log=${OUT:+$OUT/gpu.log}
say() { echo "$*"; [ -n "$log" ] && echo "$*" >>"$log"; return 0; }
run() { # name timeout command...
  local name=$1 t=$2; shift 2
  say "== $name: $*"
  local o; o=$(timeout "$t" "$@" 2>&1); local rc=$?
  say "$o"
  say "== $name: exit $rc"
  return $rc
}
fails=0
nvidia-smi -L 2>&1 | while read -r l; do say "$l"; done
# The driver: the build's runtime (CUDA 13) needs a driver that supports it.
drv=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
say "driver supports CUDA ${drv:-?}; this build needs 13.0 or newer"
if [ -n "$drv" ] && [ "${drv%%.*}" -lt 13 ]; then
  say "STOP: the NVIDIA driver is too old for this build (CUDA $drv < 13.0): update the driver, " \
    "or build with a CUDA toolkit the driver supports"
  exit 2
fi
for p in ps-server ps-worker test_cuda_parity test_model test_replicas bench_replicas; do
  missing=$(ldd "$b/bin/$p" | grep "not found")
  if [ -n "$missing" ]; then
    say "STOP: $p cannot load: $missing"
    say "  (cuBLAS 13, cuDNN 9 and NCCL 2 must be on the system or in LD_LIBRARY_PATH, e.g." \
      "pip install nvidia-cublas nvidia-cudnn-cu13 nvidia-nccl-cu13)"
    exit 2
  fi
done
run test_cuda_parity 300 "$b/bin/test_cuda_parity" || fails=$((fails + 1))
# The CUDA ops and a short training under compute-sanitizer (memory
# errors, shared-memory races, barrier misuse), where the machine has it.
cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$cs" ]; then
  for tool in memcheck racecheck synccheck; do
    run "compute-sanitizer $tool" 900 "$cs" --tool "$tool" --error-exitcode 1 \
      "$b/bin/test_cuda_parity" || fails=$((fails + 1))
  done
  run "compute-sanitizer memcheck training" 900 "$cs" --tool memcheck --error-exitcode 1 \
    "$b/bin/ps-worker" --local --device cuda --job deploy/jobs/fashion_mnist_cnn.json \
    --data-dir "$b/data" --max-steps 5 --eval-interval 0 || fails=$((fails + 1))
  # Batchnorm's kernels and the residual model's buffers (the ResNet job).
  run "compute-sanitizer memcheck batchnorm" 900 "$cs" --tool memcheck --error-exitcode 1 \
    "$b/bin/ps-worker" --local --device cuda --job deploy/jobs/fashion_mnist_resnet.json \
    --data-dir "$b/data" --max-steps 3 --eval-interval 0 || fails=$((fails + 1))
else
  say "compute-sanitizer: not on this machine: memcheck, racecheck and synccheck not run"
fi
# test_replicas reads job files from the repository (PS_SOURCE_DIR).
(cd "$root" && run test_model 300 "$b/bin/test_model") || fails=$((fails + 1))
(cd "$root" && PS_SOURCE_DIR="$root" run test_replicas 300 "$b/bin/test_replicas") ||
  fails=$((fails + 1))
# The pipelined step on the GPU against the plain one: 3 shards, 30 steps.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for mode in on off; do
  addrs="127.0.0.1:$(port),127.0.0.1:$(port),127.0.0.1:$(port)"
  spids=()
  for s in 0 1 2; do
    "$b/bin/ps-server" --insecure --job tests/integration/jobs/pipeline.json --ps "$addrs" --index "$s" \
      >"$b/server-$mode-$s.log" 2>&1 &
    spids+=($!)
  done
  run "pipeline $mode" 120 "$b/bin/ps-worker" --insecure --device cuda --ps "${addrs%%,*}" --num-workers 1 \
    --pipeline "$mode" --save-params "$b/$mode.bin" --log-interval 1 || fails=$((fails + 1))
  for p in "${spids[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p"; done
done
if cmp -s "$b/on.bin" "$b/off.bin"; then say "pipeline on == off on the GPU, bit for bit"
else say "FAIL: the pipelined step on the GPU ended with other parameters"; fails=$((fails + 1)); fi
# CUDA Graphs: 40 steps of the quickstart CNN recorded and replayed end
# with the parameters of the same steps run op by op, bit for bit.
for g in on off; do
  run "cuda graphs $g" 300 "$b/bin/ps-worker" --local --device cuda --cuda-graphs "$g" \
    --job deploy/jobs/fashion_mnist_cnn.json --data-dir "$b/data" --max-steps 40 \
    --eval-interval 0 --save-params "$b/graphs-$g.bin" || fails=$((fails + 1))
done
if cmp -s "$b/graphs-on.bin" "$b/graphs-off.bin"; then say "cuda graphs on == off, bit for bit"
else say "FAIL: the replayed step ended with other parameters"; fails=$((fails + 1)); fi
# tf32 and bf16 compute (where the GPU has the tensor cores): 300 steps of
# the quickstart CNN reach the accuracy of fp32 within 0.02.
acc_of() { sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$1" | tail -1; }
for p in fp32 tf32 bf16; do
  timeout 300 "$b/bin/ps-worker" --local --device cuda --precision "$p" \
    --job deploy/jobs/fashion_mnist_cnn.json --data-dir "$b/data" --max-steps 300 \
    --eval-interval 0 >"$b/precision-$p.log" 2>&1
  rc=$?
  if [ "$rc" = 2 ] && grep -q "compute capability" "$b/precision-$p.log"; then
    say "precision $p: not on this GPU: $(grep -o 'needs tensor cores.*' "$b/precision-$p.log")"
    continue
  fi
  say "precision $p: exit $rc, $(grep "^trained" "$b/precision-$p.log"), accuracy $(acc_of "$b/precision-$p.log")"
  [ "$rc" = 0 ] || fails=$((fails + 1))
done
for p in tf32 bf16; do
  [ -n "$(acc_of "$b/precision-$p.log")" ] || continue
  python3 -c "import sys; sys.exit(0 if float('$(acc_of "$b/precision-$p.log")') >= float('$(acc_of "$b/precision-fp32.log")') - 0.02 else 1)" \
    || { say "FAIL: precision $p trains worse than fp32"; fails=$((fails + 1)); }
done
# Batchnorm in training and evaluation: 300 steps of the ResNet job on the
# GPU and on the cpu end within 0.04 of each other's test accuracy (the
# evaluation normalizes with the moving statistics both updated).
for d in cuda cpu; do
  timeout 600 "$b/bin/ps-worker" --local --device "$d" --job deploy/jobs/fashion_mnist_resnet.json \
    --data-dir "$b/data" --max-steps 300 --eval-interval 0 >"$b/resnet-$d.log" 2>&1 \
    || { say "FAIL: the ResNet job on $d: $(tail -1 "$b/resnet-$d.log")"; fails=$((fails + 1)); }
  say "resnet on $d: $(grep "^trained" "$b/resnet-$d.log"), accuracy $(acc_of "$b/resnet-$d.log")"
done
if [ -n "$(acc_of "$b/resnet-cuda.log")" ] && [ -n "$(acc_of "$b/resnet-cpu.log")" ]; then
  python3 -c "import sys; sys.exit(0 if abs(float('$(acc_of "$b/resnet-cuda.log")') - float('$(acc_of "$b/resnet-cpu.log")')) <= 0.04 else 1)" \
    || { say "FAIL: the ResNet's accuracy on the GPU differs from the cpu's by more than 0.04"; fails=$((fails + 1)); }
fi
# The benchmark (the data set from the bundle).
DATA_DIR="$b/data" run gpu.sh 540 bash tests/bench/gpu.sh "$b/bin" "$steps" || fails=$((fails + 1))
say "on_device: $fails part(s) failed"
exit $((fails > 0))

#!/usr/bin/env bash
# Release against the default build type: builds the tree CPU-only twice,
# into BUILD_DIR/bt-default (no CMAKE_BUILD_TYPE: RelWithDebInfo, -O2) and
# BUILD_DIR/bt-release (-DCMAKE_BUILD_TYPE=Release, -O3), then runs
# BENCH_ROUNDS (default 5) interleaved rounds of
#   ps-worker --local --job deploy/jobs/fashion_mnist_cnn.json
#             --max-steps BENCH_STEPS (300) --eval-interval 0 --threads 2
# with each (the order swapped every other round), then bench_elementwise
# (relu and max pooling on the quickstart's largest activation) with each.
# Prints examples/s and ms per op each round, and the medians of the
# Release/default ratios within rounds (the machine is shared and drifts).
#
#   tests/bench/build_types.sh [BUILD_DIR]      (default: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
mkdir -p "$build"
build=$(cd "$build" && pwd)
out=$(mktemp -d /tmp/ps-bench-bt.XXXXXX)
trap 'echo "failed; logs in $out" >&2' ERR
steps=${BENCH_STEPS:-300} rounds=${BENCH_ROUNDS:-5}
job="$root/deploy/jobs/fashion_mnist_cnn.json"
types=(default release)
declare -A cmake_args=([default]="" [release]="-DCMAKE_BUILD_TYPE=Release")

# The worker with the configuration's flags; bench_elementwise is not a
# CMake target, so it is compiled here against the configuration's
# libraries (the code it times is theirs; its own flags do not matter).
for t in "${types[@]}"; do
  bt=$build/bt-$t
  # shellcheck disable=SC2086  # cmake_args holds zero or one word
  cmake -S "$root" -B "$bt" -DWITH_CUDA=OFF ${cmake_args[$t]} >"$out/cmake-$t.log"
  cmake --build "$bt" -j"${BENCH_JOBS:-2}" --target ps-worker ps_kernels ps_util \
    >"$out/build-$t.log" || { tail -20 "$out/build-$t.log"; exit 1; }
  cc=$(sed -n 's/^CMAKE_C_COMPILER:[A-Z]*=//p' "$bt/CMakeCache.txt")
  read -ra blas <<<"$(pkg-config --libs openblas)"
  "$cc" -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -I"$root" \
    "$root/tests/bench/bench_elementwise.c" "$bt/libps_kernels.a" "$bt/libps_util.a" \
    "${blas[@]}" -lpthread -lm -o "$bt/bench_elementwise"
  echo "$t: $bt (cmake ${cmake_args[$t]:-with no CMAKE_BUILD_TYPE})"
done

# examples/s from a run's summary line
eps() { sed -n 's/.*: \([0-9]*\) examples\/s$/\1/p' "$1" | tail -1; }

train() { # TYPE ROUND: one training run
  "$build/bt-$1/ps-worker" --local --job "$job" --max-steps "$steps" --eval-interval 0 \
    --threads 2 --log-interval 1000 >"$out/$1-$2.log" 2>&1
}
ops() { # TYPE ROUND: the op benchmark, its JSON line
  "$build/bt-$1/bench_elementwise" --threads 2 --reps 200 | tail -1 >"$out/$1-$2.ops.json"
}

for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order=(default release); else order=(release default); fi
  for t in "${order[@]}"; do train "$t" "$r"; done
  for t in "${order[@]}"; do ops "$t" "$r"; done
  echo "round $r: default $(eps "$out/default-$r.log"), release $(eps "$out/release-$r.log") examples/s"
done

python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
med = statistics.median
def eps(path):
    for line in reversed(open(path).read().splitlines()):
        if line.endswith(" examples/s"):
            return float(line.split(": ")[-1].split()[0])
    raise SystemExit(f"no examples/s in {path}")
runs = {t: [eps(f"{out}/{t}-{r}.log") for r in range(1, n + 1)] for t in ("default", "release")}
ops = {t: [json.load(open(f"{out}/{t}-{r}.ops.json")) for r in range(1, n + 1)]
       for t in ("default", "release")}
names = ("relu_forward", "relu_backward", "maxpool_forward", "maxpool_backward")
print("round | default ex/s | release ex/s | release/default | "
      + " | ".join(f"{op} ms (default / release)" for op in names))
for r in range(n):
    d, rel = runs["default"][r], runs["release"][r]
    cells = [f"{ops['default'][r][op + '_ms']:.3f} / {ops['release'][r][op + '_ms']:.3f}"
             for op in names]
    print(f"{r + 1} | {d:.0f} | {rel:.0f} | {rel / d:.3f} | " + " | ".join(cells))
ratio = med(b / a for a, b in zip(runs["default"], runs["release"]))
print(f"build types, medians over {n} rounds: default {med(runs['default']):.0f} examples/s, "
      f"release {med(runs['release']):.0f}; release/default within rounds {ratio:.3f}")
for op in names:
    a = [o[op + "_ms"] for o in ops["default"]]
    b = [o[op + "_ms"] for o in ops["release"]]
    print(f"  {op:<17} default {med(a):6.3f} ms, release {med(b):6.3f} ms "
          f"(release/default time within rounds {med(y / x for x, y in zip(a, b)):.3f})")
PY
rm -rf "$out"

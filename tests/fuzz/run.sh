#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer and
# UndefinedBehaviorSanitizer) and runs each for SECONDS (default 60),
# starting from the seeds in tests/fuzz/seeds/TARGET. A crash, a leak or a
# sanitizer report fails the run and leaves the input in the output folder.
#   tests/fuzz/run.sh [SECONDS] [TARGET...]   (targets: wire job leases ckpt idx npy auth keras)
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
shift || true
targets=("${@:-wire job leases ckpt idx npy auth keras}")
read -r -a targets <<<"${targets[*]}"
build=build-fuzz
deploy/install-deps.sh clang libclang-rt-14-dev
CC=clang cmake -S . -B "$build" -DWITH_CUDA=OFF -DPS_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link" >/dev/null
cmake --build "$build" -j"$(nproc)" --target ps_rpc ps_spec ps_shardlib ps_util ps_workerlib >/dev/null
out=$(mktemp -d /tmp/ps-fuzz.XXXXXX)
fsan="-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -g -O1"
protobuf_inc=$(find "$build" -name ps.pb-c.h -printf '%h\n' | head -1)
for t in "${targets[@]}"; do
  case "$t" in
    wire) libs=("$build/libps_rpc.a" "$build/libps_proto.a" "$build/libps_util.a") ;;
    job | keras) libs=("$build/libps_spec.a" "$build/libps_util.a") ;;
    leases | ckpt) libs=("$build/libps_shardlib.a" "$build/libps_spec.a" "$build/libps_util.a") ;;
    auth) libs=("$build/libps_shardlib.a" "$build/libps_rpc.a" "$build/libps_proto.a"
                "$build/libps_spec.a" "$build/libps_util.a") ;;
    idx | npy) libs=("$build/libps_workerlib.a" "$build/libps_kernels.a" "$build/libps_util.a" -lz -luv -lopenblas) ;;
    *) echo "fuzz: no target '$t'" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  clang $fsan -I. -I"$protobuf_inc/.." -I"$protobuf_inc" "tests/fuzz/fuzz_$t.c" "${libs[@]}" \
    $(pkg-config --libs libprotobuf-c jansson grpc) -lm -lpthread -o "$out/fuzz_$t"
  mkdir -p "$out/corpus-$t"
  [ -d "tests/fuzz/seeds/$t" ] && cp tests/fuzz/seeds/"$t"/* "$out/corpus-$t/" 2>/dev/null || true
  # Keras's JSON: the test fixtures written by tf_keras and Keras 3 (up to
  # 14 KB, hence the larger inputs).
  maxlen=4096
  if [ "$t" = keras ]; then cp tests/fixtures/keras/*.json "$out/corpus-$t/"; maxlen=16384; fi
  echo "fuzz: $t for $secs s"
  (cd "$out" && ASAN_OPTIONS=detect_leaks=1 "./fuzz_$t" -max_total_time="$secs" -max_len="$maxlen" \
     -print_final_stats=1 "corpus-$t" 2>"$out/$t.log") ||
    { tail -40 "$out/$t.log"; echo "fuzz: $t FAILED; inputs and log in $out" >&2; exit 1; }
  grep -E "stat::number_of_executed_units|cov:" "$out/$t.log" | tail -2
  rm -rf /dev/shm/ps-fuzz-ckpt.* /tmp/ps-fuzz-ckpt.* /dev/shm/ps-fuzz-idx.* /tmp/ps-fuzz-idx.*
done
rm -rf "$out"

#!/usr/bin/env bash
# Packs what a GPU machine without this project's dependencies needs to run
# its GPU tests and benchmark (tests/gpu/on_device.sh): a CUDA build's
# programs and tests, the shared libraries they need that a CUDA image does
# not have (gRPC and its dependencies, protobuf-c, libuv, OpenBLAS, jansson),
# and the Fashion-MNIST files. The CUDA runtime is linked statically; the
# other CUDA libraries (cuBLAS, cuDNN, NCCL) are not packed: the machine
# has them. The programs find the packed libraries through their RUNPATH
# ($ORIGIN/../lib), and each packed library finds the ones it needs beside
# it through its own ($ORIGIN): a RUNPATH serves only the object that has
# it, so without the libraries' own, libgrpc would look for its libcares,
# abseil, upb and re2 on the system (patchelf writes both). Not
# LD_LIBRARY_PATH, so the system's own libraries keep their precedence for
# everything else. tests/gpu/bundle_check.sh proves it loads on a machine
# without this project's dependencies (CTest: gpu.bundle). Writes OUT
# (default .gpu/bundle.tar.xz, ignored by git), well under 64 MiB.
#   tests/gpu/bundle.sh [BUILD_DIR [OUT]]     (default build-gpu; built if need be)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
out=${2:-.gpu/bundle.tar.xz}
deploy/install-deps.sh patchelf
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
[ -f "$build/CMakeCache.txt" ] ||
  cmake -S . -B "$build" -DWITH_CUDA=ON -DPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
grep -q '^WITH_CUDA:BOOL=ON' "$build/CMakeCache.txt" || { echo "bundle: $build has no CUDA backend" >&2; exit 1; }
stage=$(mktemp -d /tmp/ps-gpu-bundle.XXXXXX)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/data"
progs=(ps-server ps-worker ps-export test_cuda_parity test_model test_replicas bench_replicas client_rounds
       cublas_race)
cmake --build "$build" -j"$(nproc)" --target "${progs[@]}" >/dev/null
for p in "${progs[@]}"; do
  cp "$build/$p" "$stage/bin/"
  patchelf --set-rpath '$ORIGIN/../lib' "$stage/bin/$p"
done
# Every library the programs load, but the C runtime and CUDA's.
for p in "${progs[@]}"; do ldd "$build/$p"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' |
  grep -Ev '/lib(cuda|cudart|cublas|cublasLt|cudnn[a-z_]*|nccl)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
for lib in "$stage"/lib/*; do patchelf --set-rpath '$ORIGIN' "$lib"; done
cp /usr/share/datasets/fashion-mnist/*.gz "$stage/data/"
mkdir -p "$(dirname "$out")"
[ "$out" != .gpu/bundle.tar.xz ] || grep -qx '/.gpu/' .gitignore 2>/dev/null || echo '/.gpu/' >>.gitignore
case "$out" in
  *.tar) tar -C "$stage" -cf "$out" . ;; # uncompressed: the check in CTest
  *) tar -C "$stage" -cJf "$out" . ;;
esac
echo "bundle: $out, $(du -h "$out" | cut -f1): ${#progs[@]} programs," \
  "$(ls "$stage/lib" | wc -l) libraries, the data set"

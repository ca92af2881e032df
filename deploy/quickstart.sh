#!/usr/bin/env bash
# Installs what is missing, builds, then runs the main job: a local cluster
# of 2 ps-server + 2 ps-worker processes on loopback training a CNN on
# Fashion-MNIST (from the dataset-fashion-mnist package), showing the
# chief's progress and ending with the test accuracy.
# Logs and metrics go to runs/quickstart/. Extra arguments go to the workers.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
cmake -S . -B build >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
rm -rf runs/quickstart
exec deploy/local-cluster.sh --job deploy/jobs/fashion_mnist_cnn.json --bin build \
  --servers 2 --workers 2 --out runs/quickstart -- "$@"

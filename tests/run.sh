#!/usr/bin/env bash
# Installs what is missing, builds (warnings are errors), and runs the whole
# suite with CTest: unit tests, gradient checks, protocol tests, and the
# integration tests with real ps-server/ps-worker processes on loopback.
#   tests/run.sh                 everything
#   tests/run.sh -L unit         only the unit tests (any ctest arguments)
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --tests
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -DPS_WERROR=ON ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure "$@"

#!/usr/bin/env bash
# The Python workers' tests (CTest python.*): the binding from the source
# tree against this build's libpsclient.so and ps-server.
#   tests/python/run.sh NAME BUILD_DIR
# NAME: binding | leases | flat | mixed (numpy; mixed also torch) | capi (the
# C API under the build's own flags, ASan included) | install (pip install
# ./python into a fresh venv, then used from another directory).
# A Python with NumPy (and PyTorch for mixed) is looked for ($PS_PYTHON,
# /usr/bin/python3, python3); missing, they are installed with
# deploy/install-deps.sh (Debian's python3-numpy, python3-torch) where that
# can run, else the test is skipped (77) saying why.
set -euo pipefail
name=$1
build=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

need=(numpy)
[ "$name" = mixed ] && need+=(torch)
imports=$(IFS=,; echo "${need[*]}")

find_python() {
  local py
  for py in ${PS_PYTHON:-} /usr/bin/python3 python3; do
    if command -v "$py" >/dev/null && "$py" -c "import $imports" 2>/dev/null; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

if ! py=$(find_python); then
  pkgs=(python3-numpy)
  [ "$name" = mixed ] && pkgs+=(python3-torch)
  echo "python.$name: no Python with $imports; installing ${pkgs[*]}"
  "$root/deploy/install-deps.sh" "${pkgs[@]}" >&2 || true
  py=$(find_python) || { echo "SKIPPED: python.$name needs $imports for Python and could not install ${pkgs[*]} (deploy/install-deps.sh needs root or sudo and Debian's archive)"; exit 77; }
fi

# The build's library and programs, the package from the source tree.
export PS_CLIENT_LIB="$build/libpsclient.so" PS_BIN="$build" PYTHONPATH="$root/python"
export PYTHONDONTWRITEBYTECODE=1
[ -f "$PS_CLIENT_LIB" ] || { echo "FAIL: $PS_CLIENT_LIB is not built (target ps_client_shared)"; exit 1; }
# A sanitized library runs in Python only with the sanitizers' runtime loaded
# first. LeakSanitizer stays on (as CI asks) for the C programs the tests
# start; what Python and its modules keep at exit is suppressed (lsan.supp).
if grep -q "^PS_SANITIZE:BOOL=ON" "$build/CMakeCache.txt" 2>/dev/null; then
  asan=$(gcc -print-file-name=libasan.so) ubsan=$(gcc -print-file-name=libubsan.so)
  export LD_PRELOAD="$asan $ubsan"
  export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
fi

case "$name" in
  binding|leases|flat|mixed)
    exec timeout 300 "$py" "$here/test_$name.py" ;;
  capi)
    exec timeout 120 "$py" "$here/capi_run.py" "$build/capi_check" ;;
  install)
    exec timeout 300 bash "$here/install.sh" "$build" "$py" ;;
  *) echo "run.sh: unknown test '$name'" >&2; exit 2 ;;
esac

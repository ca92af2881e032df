#!/usr/bin/env bash
# python.install: `pip install ./python` into a fresh venv (with the system's
# site packages: Debian's NumPy), then the package used from another
# directory against a live server: the library it ships is found and loaded.
# The copy of python/ built here uses this build's libpsclient.so
# ($PS_BUILD_DIR: only the target ps_client_shared is brought up to date),
# and builds offline (--no-build-isolation: the venv's own setuptools).
#   install.sh BUILD_DIR PYTHON
set -euo pipefail
build=$1 py=$2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d /tmp/ps-pyinstall.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
unset PYTHONPATH PS_CLIENT_LIB

if ! "$py" -m venv --system-site-packages "$tmp/venv" >"$tmp/venv.log" 2>&1; then
  cat "$tmp/venv.log"
  echo "SKIPPED: $py cannot make a venv (Debian: apt-get install python3-venv)"
  exit 77
fi
mkdir -p "$tmp/src"
cp -r "$root/python" "$tmp/src/python"
rm -rf "$tmp/src/python/build" "$tmp/src/python/build-cmake" "$tmp/src/python/psclient/libpsclient.so"
t0=$(date +%s.%N)
PS_BUILD_DIR="$build" "$tmp/venv/bin/pip" install --no-build-isolation --no-index --no-deps -q \
  "$tmp/src/python"
echo "python.install: pip install took $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
cd "$tmp"
"$tmp/venv/bin/python" - <<'PY'
import os, sys
import numpy as np
import psclient
from psclient.cluster import LocalCluster
pkg = os.path.dirname(psclient.__file__)
assert pkg.startswith(sys.prefix), f"imported from {pkg}, not the venv {sys.prefix}"
assert os.path.exists(os.path.join(pkg, "libpsclient.so")), os.listdir(pkg)
from psclient import _lib
loaded = _lib.lib()._name
assert loaded == os.path.join(pkg, "libpsclient.so"), loaded
job = {"job_id": "py-install", "model": {"params": 100}, "optimizer": {"name": "sgd", "lr": 1.0}}
with LocalCluster(job, servers=1) as c, psclient.connect(c.servers, insecure=True) as w:
    p0 = w.pull().copy()
    w.push(np.ones(100, np.float32))
    assert np.array_equal(w.pull(), p0 - 1), "a push through the installed package"
print(f"python.install: psclient {psclient.__version__} from {pkg}, library {loaded}: pull and push")
PY

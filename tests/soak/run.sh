#!/usr/bin/env bash
# A soak run: tests/soak/run.sh [SECONDS] [soak.py ARGS...] (default 180 s)
# against the programs of ../../build (PS_BUILD=DIR, or --build DIR, for
# another). Prints the timeline; exits 1 on a violation, with the seed that
# reproduces it in the last line. See docs/fault-tolerance.md "Soak runs".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
secs=180
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then secs=$1; shift; fi
exec python3 "$here/soak.py" --build "${PS_BUILD:-$here/../../build}" --duration "$secs" "$@"

#!/usr/bin/env bash
# The cpu backend's hot loops are vectorized at every build type, by GCC's
# own account: compiles kernels/cpu/ops_cpu.c as BUILD_DIR does (its
# compile_commands.json: same compiler, includes, definitions, warnings),
# with the optimization level replaced by -O2 (the default build type,
# RelWithDebInfo) and by -O3 (Release), each also for AVX2 on x86-64, and
# -fopt-info-vec-all. Every loop marked /* vectorized */ must be reported
# "loop vectorized" at each of them, and "couldn't vectorize loop" at none,
# in every copy GCC makes of it (a helper inlined into several callers is
# reported once per caller). Nothing is run, so no timing is involved.
#
#   tests/bench/check_vectorized.sh BUILD_DIR [SOURCE MIN_MARKS]
# SOURCE (relative to the repository) and how many marked loops it must
# hold at least: another file's loops (common/half.c: unit.half_vectorized).
#
# Exits 77 (skipped) with a compiler other than GCC, whose reports read
# otherwise; GCC before 12 does not vectorize at -O2, so there only -O3 is
# checked.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: tests/bench/check_vectorized.sh BUILD_DIR}
src=$root/${2:-kernels/cpu/ops_cpu.c}
base=$(basename "$src")
# At least this many marked loops: removing a mark must be deliberate.
min_marks=${3:-9}

db=$build/compile_commands.json
[ -f "$db" ] || { echo "no $db (CMAKE_EXPORT_COMPILE_COMMANDS)"; exit 1; }
# The build's command for ops_cpu.c less what this check replaces: output,
# optimization, debug info, sanitizers.
mapfile -t cmd < <(python3 - "$db" "$src" <<'PY'
import json, os, shlex, sys
db, src = sys.argv[1], os.path.realpath(sys.argv[2])
for e in json.load(open(db)):
    if os.path.realpath(os.path.join(e["directory"], e["file"])) != src:
        continue
    args = e.get("arguments") or shlex.split(e["command"])
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif a == "-c" or a.startswith(("-O", "-g", "-fsanitize")) or a in ("-MD", "-MMD"):
            pass
        elif os.path.realpath(os.path.join(e["directory"], a)) != src:
            out.append(a)
    print("\n".join(out))
    break
PY
)
[ "${#cmd[@]}" -gt 0 ] || { echo "$src is not in $db"; exit 1; }

cc=${cmd[0]}
macros=$("$cc" -dM -E - </dev/null)
if ! grep -q '__GNUC__' <<<"$macros" || grep -q '__clang__' <<<"$macros"; then
  echo "SKIPPED: $cc is not GCC (this check reads GCC's -fopt-info reports)"
  exit 77
fi
version=$("$cc" -dumpfullversion)
levels=(-O2 -O3)
if [ "${version%%.*}" -lt 12 ]; then
  echo "note: GCC $version does not vectorize at -O2; checking -O3 only"
  levels=(-O3)
fi
configs=()
for o in "${levels[@]}"; do
  configs+=("$o")
  case $("$cc" -dumpmachine) in x86_64*) configs+=("$o -mavx2 -mfma") ;; esac
done

mapfile -t marks < <(grep -n '/\* vectorized \*/' "$src" | cut -d: -f1)
if [ "${#marks[@]}" -lt "$min_marks" ]; then
  echo "FAIL: ${#marks[@]} loops marked /* vectorized */ in $src, expected at least $min_marks"
  exit 1
fi

work=$(mktemp -d /tmp/ps-vec.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail=0
for config in "${configs[@]}"; do
  read -ra flags <<<"$config"
  report=$work/report.txt
  rm -f "$report" # -fopt-info appends
  "${cmd[@]}" "${flags[@]}" -c "$src" -o "$work/$base.o" -fopt-info-vec-all="$report"
  bad=()
  for line in "${marks[@]}"; do
    at="$base:$line:[0-9]+:"
    done_n=$(grep -cE "$at optimized: loop vectorized" "$report" || true)
    missed_n=$(grep -cE "$at missed: couldn't vectorize loop" "$report" || true)
    if [ "$done_n" -lt 1 ] || [ "$missed_n" -gt 0 ]; then
      bad+=("line $line ($done_n vectorized, $missed_n not): $(sed -n "${line}p" "$src" | sed 's/^ *//')")
    fi
  done
  if [ "${#bad[@]}" -gt 0 ]; then
    fail=1
    echo "FAIL $config: loops marked /* vectorized */ that GCC did not vectorize:"
    printf '  %s\n' "${bad[@]}"
    # GCC's reasons, for the first of them
    first=${bad[0]#line }
    { grep -E "$base:${first%% *}:[0-9]+: missed" "$report" || true; } | sort -u | head -5 |
      sed 's/^/    /'
  else
    echo "ok $config: ${#marks[@]} marked loops vectorized"
  fi
done
exit "$fail"

#!/usr/bin/env bash
# ps-stale, the controlled-staleness mode: a gradient computed on the
# parameters of exactly s versions ago, pushed to the servers' own shard.
#   - one virtual worker at fixed:0 is `ps-worker --local` bit for bit
#     (dropout and momentum; batchnorm's moving statistics; Adam);
#   - fixed:S gives staleness S on every update after the first S, as the
#     shard's histogram counts them, at S = 4 with 8 virtual workers and at
#     S = 32 with 64;
#   - a run is the same bit for bit when run again; another draw seed
#     changes it; uniform, geometric and hist draw within their support;
#     group:K gives 0..K-1 in turn; --drain F scales the last F of the
#     draws down to 0;
#   - bad flags and files are refused with exit 2 and a message.
# Usage: stale.sh BUILD_DIR
set -euo pipefail
build=${1:?build dir}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d "/tmp/ps-it-stale.XXXXXX")
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
stale() { timeout 300 "$build/ps-stale" "$@"; }

# hist_of LOG: the histogram line's "s:n" pairs, one per line
hist_of() { sed -n 's/^staleness: .*histogram (s: updates)://p' "$1" | tr ' ' '\n' | grep ':' || true; }
updates_of() { sed -n 's/^trained \([0-9]*\) updates.*/\1/p' "$1"; }

# 1. The --local twin.
for j in synthetic batchnorm chaos; do
  job=$here/jobs/$j.json
  timeout 300 "$build/ps-worker" --local --job "$job" --threads 1 --max-steps 150 \
    --save-params "$out/local-$j.bin" >"$out/local-$j.log" 2>&1 || { tail -3 "$out/local-$j.log"; fail "$j: ps-worker --local failed"; }
  stale --job "$job" --max-steps 150 --save-params "$out/stale-$j.bin" >"$out/stale-$j.log" 2>&1 \
    || { tail -3 "$out/stale-$j.log"; fail "$j: ps-stale failed"; }
  cmp -s "$out/local-$j.bin" "$out/stale-$j.bin" \
    || fail "$j: one virtual worker at fixed:0 differs from ps-worker --local"
  [ "$(hist_of "$out/stale-$j.log")" = "0:150" ] || fail "$j: staleness not all 0: $(hist_of "$out/stale-$j.log")"
  echo "stale: $j: 150 updates at fixed:0 equal ps-worker --local's bit for bit"
done

# 2. fixed:S measured by the shard.
check_fixed() { # N S
  local log=$out/fixed-$1-$2.log
  stale --job "$here/jobs/synthetic.json" --virtual-workers "$1" --staleness "fixed:$2" \
    >"$log" 2>&1 || { tail -3 "$log"; fail "fixed:$2 with $1 virtual workers failed"; }
  local u want
  u=$(updates_of "$log")
  want=$(for ((s = 0; s < $2; s++)); do echo "$s:1"; done; echo "$2:$((u - $2))")
  [ "$(hist_of "$log")" = "$want" ] \
    || fail "fixed:$2 ($1 virtual workers): the shard's histogram is $(hist_of "$log" | tr '\n' ' '), want $(echo $want)"
  echo "stale: fixed:$2 with $1 virtual workers: $((u - $2)) of $u updates at staleness $2 (the first $2 reach back as far as there are versions)"
}
check_fixed 8 4
check_fixed 64 32

# 3. Reproducible; the seed matters; the draws stay in their support.
for k in 1 2; do
  stale --job "$here/jobs/synthetic.json" --virtual-workers 16 --staleness uniform:6 --seed 3 \
    --save-params "$out/u$k.bin" >"$out/u$k.log" 2>&1 || fail "uniform:6 run $k failed"
done
cmp -s "$out/u1.bin" "$out/u2.bin" || fail "uniform:6 --seed 3 twice: the parameters differ"
stale --job "$here/jobs/synthetic.json" --virtual-workers 16 --staleness uniform:6 --seed 4 \
  --save-params "$out/u3.bin" >"$out/u3.log" 2>&1 || fail "uniform:6 --seed 4 failed"
cmp -s "$out/u1.bin" "$out/u3.bin" && fail "uniform:6 with seeds 3 and 4 gave the same parameters"
hist_of "$out/u1.log" | awk -F: '$1 > 6 { bad = 1 } END { exit bad }' || fail "uniform:6 drew above 6"
[ "$(hist_of "$out/u1.log" | wc -l)" = 7 ] || fail "uniform:6 did not draw every s of 0..6: $(hist_of "$out/u1.log" | tr '\n' ' ')"
echo "stale: uniform:6 is the same bit for bit twice, and another seed differs"
stale --job "$here/jobs/synthetic.json" --virtual-workers 16 --staleness geometric:0.3 \
  --max-staleness 8 >"$out/g.log" 2>&1 || fail "geometric:0.3 failed"
hist_of "$out/g.log" | awk -F: '$1 > 8 { bad = 1 } END { exit bad }' || fail "geometric drew above --max-staleness 8"
printf '0 5\n0, 7\n' >"$out/h.txt" # s = 1 and s = 3 only
stale --job "$here/jobs/synthetic.json" --virtual-workers 4 --staleness "hist:$out/h.txt" \
  >"$out/h.log" 2>&1 || fail "hist failed"
u=$(updates_of "$out/h.log")
# the first update reaches back 0 versions and the next two at most 1, 2
hist_of "$out/h.log" | awk -F: '$1 != 0 && $1 != 1 && $1 != 2 && $1 != 3 { bad = 1 } END { exit bad }' \
  || fail "hist: drew outside {1, 3}: $(hist_of "$out/h.log" | tr '\n' ' ')"
n3=$(hist_of "$out/h.log" | awk -F: '$1 == 3 { print $2 }')
[ "${n3:-0}" -gt $((u / 3)) ] || fail "hist: s = 3 (weight 7 of 12) drawn ${n3:-0} times in $u"
echo "stale: geometric stays within --max-staleness; hist draws from its support"
# group:5: s = 0, 1, 2, 3, 4 in turn, so each of 0..4 as often as the others
# (within one, for the last group left unfinished).
stale --job "$here/jobs/synthetic.json" --virtual-workers 8 --staleness group:5 \
  >"$out/gr.log" 2>&1 || fail "group:5 failed"
hist_of "$out/gr.log" | awk -F: '$1 > 4 { bad = 1 } { n[$1] = $2; if (!lo || $2 < lo) lo = $2;
    if ($2 > hi) hi = $2 } END { exit bad || length(n) != 5 || hi - lo > 1 }' \
  || fail "group:5: not s = 0..4 equally often: $(hist_of "$out/gr.log" | tr '\n' ' ')"
echo "stale: group:5 gives s = 0..4 in turn"
# --drain 0.5 with fixed:8: the last half of the U updates draw
# floor(8 (U - u) / (U / 2)) at update u, falling to 0 as the workers of an
# asynchronous run finish one by one; the first half is fixed:8's.
stale --job "$here/jobs/synthetic.json" --virtual-workers 8 --staleness fixed:8 --drain 0.5 \
  >"$out/dr.log" 2>&1 || fail "fixed:8 --drain 0.5 failed"
u=$(updates_of "$out/dr.log")
want=$(awk -v U="$u" 'BEGIN { d = int(0.5 * U)
    for (i = 0; i < U; i++) { s = 8; if (i >= U - d) s = int(8 * (U - i) / d); if (s > i) s = i; n[s]++ }
    for (s = 0; s <= 8; s++) if (n[s]) print s ":" n[s] }')
[ "$(hist_of "$out/dr.log")" = "$want" ] \
  || fail "fixed:8 --drain 0.5: the shard's histogram is $(hist_of "$out/dr.log" | tr '\n' ' '), want $(echo $want)"
echo "stale: --drain 0.5 scales the last $((u / 2)) of $u draws down to 0: $(echo $want)"

# 4. Bad input.
refused() { # WHAT PATTERN ARGS...
  local what=$1 pat=$2
  shift 2
  local rc=0
  stale "$@" >"$out/bad.log" 2>&1 || rc=$?
  [ "$rc" = 2 ] || { cat "$out/bad.log"; fail "$what: exit $rc, not 2"; }
  grep -q -e "$pat" "$out/bad.log" || { cat "$out/bad.log"; fail "$what: no message matching '$pat'"; }
}
refused "no job" "--job FILE is required"
refused "unknown distribution" "unknown distribution" --job "$here/jobs/synthetic.json" --staleness zipf:2
refused "negative S" "S must be an integer" --job "$here/jobs/synthetic.json" --staleness fixed:-1
refused "S over the ring" "over --max-staleness" --job "$here/jobs/synthetic.json" --staleness fixed:70
refused "a drain of the whole run" "want a fraction" --job "$here/jobs/synthetic.json" --drain 1
refused "a negative drain" "drain" --job "$here/jobs/synthetic.json" --drain -0.1
refused "geometric P" "P must be in" --job "$here/jobs/synthetic.json" --staleness geometric:0
printf '3 x 4\n' >"$out/bad.txt"
refused "a hist file that is not counts" "is not a count" --job "$here/jobs/synthetic.json" --staleness "hist:$out/bad.txt"
printf '0 0\n' >"$out/zero.txt"
refused "a hist file of zeros" "no counts" --job "$here/jobs/synthetic.json" --staleness "hist:$out/zero.txt"
refused "a missing job" "nope.json" --job "$out/nope.json"
refused "zero virtual workers" "virtual-workers" --job "$here/jobs/synthetic.json" --virtual-workers 0
echo "stale: bad flags and files refused with exit 2"
echo "PASS: stale"

#!/usr/bin/env bash
# A replicated shard's primary cut off from its backups and from the
# workers (network namespaces): exactly one primary acknowledges at any
# time. One shard x 3 replicas, each server on a host of its own, the two
# workers on a fourth, all joined by a bridge (veth pairs, addresses in
# 198.18.0.0/15, the range set aside for network tests). Once the workers
# train, the primary's link goes down for 4 s (the lease is 0.5 s):
#   - the cut-off primary acknowledges nothing while cut off (its count of
#     acknowledged updates does not move) and steps down;
#   - another replica becomes primary and acknowledges pushes meanwhile;
#   - after the link comes back, the old primary follows the new one and
#     takes its state; the workers finish; the shard applied exactly the
#     steps the workers trained; every replica holds the same state.
# Needs root (ip netns); without it, exits 77 (skipped).
#   partition.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" -ne 0 ]; then echo "SKIPPED: needs root to create network namespaces"; exit 77; fi
command -v ip >/dev/null || { echo "SKIPPED: iproute2 (ip) is not installed"; exit 77; }
tag="pp$$"
out=$(mktemp -d "/tmp/ps-it-partition.XXXXXX")
export PS_TOKEN_FILE="$out/token"
(umask 077; head -c 32 /dev/urandom | base64 >"$PS_TOKEN_FILE")
hosts=(s0 s1 s2 w)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for h in "${hosts[@]}" sw; do ip netns del "$tag-$h" 2>/dev/null; done
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$out"/*.log; do echo "--- $f"; tail -8 "$f"; done >&2; exit 1; }

if ! ip netns add "$tag-sw" 2>"$out/netns.err"; then
  echo "SKIPPED: cannot create network namespaces here: $(cat "$out/netns.err")"; exit 77
fi
ip -n "$tag-sw" link add br0 type bridge && ip -n "$tag-sw" link set br0 up || fail "bridge"
addr_of() { case $1 in s0) echo 198.18.0.1 ;; s1) echo 198.18.0.2 ;; s2) echo 198.18.0.3 ;; w) echo 198.18.0.10 ;; esac; }
for h in "${hosts[@]}"; do
  ns="$tag-$h"
  ip netns add "$ns" || fail "ip netns add $ns"
  ip link add "$tag-$h-a" type veth peer name "$tag-$h-b" || fail "veth"
  ip link set "$tag-$h-a" netns "$ns" && ip link set "$tag-$h-b" netns "$tag-sw" || fail "veth netns"
  ip -n "$ns" addr add "$(addr_of "$h")/24" dev "$tag-$h-a" && ip -n "$ns" link set "$tag-$h-a" up
  ip -n "$ns" link set lo up
  ip -n "$tag-sw" link set "$tag-$h-b" master br0 && ip -n "$tag-sw" link set "$tag-$h-b" up || fail "bridge port"
done

python3 - "$here/jobs/synthetic.json" "$out/job.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
j.update(replicas_per_shard=3, epochs=40)
json.dump(j, open(sys.argv[2], "w"))
PY
port=5000
list="198.18.0.1:$port,198.18.0.2:$port,198.18.0.3:$port"
mkdir -p "$out/ck0" "$out/ck1" "$out/ck2"
for i in 0 1 2; do
  ip netns exec "$tag-s$i" "$build/ps-server" --insecure --job "$out/job.json" --ps "$list" \
    --index "$i" --listen "0.0.0.0:$port" --checkpoint-dir "$out/ck$i" --log-interval 1 \
    >"$out/server-$i.log" 2>&1 &
  pids+=($!)
done
# st I: server I's Status (asked inside its own host, on loopback).
st() { ip netns exec "$tag-s$1" "$build/ps-server" --insecure --status "127.0.0.1:$port" 2>/dev/null; }
field() { python3 -c 'import json,sys; r=json.load(sys.stdin)["replica"]; print(r[sys.argv[1]])' "$1" 2>/dev/null; }
primary=""
for _ in $(seq 1 100); do
  for i in 0 1 2; do [ "$(st "$i" | field role)" = primary ] && primary=$i; done
  [ -n "$primary" ] && break; sleep 0.2
done
[ -n "$primary" ] || fail "no primary within 20 s"
wpids=()
for k in 0 1; do
  ip netns exec "$tag-w" "$build/ps-worker" --insecure --ps "$list" --index "$k" --num-workers 2 \
    --threads 1 --straggle-ms 15 --timeout-ms 1500 --log-interval 1 >"$out/worker-$k.log" 2>&1 &
  pids+=($!); wpids+=($!)
done
for _ in $(seq 1 200); do grep -q "step [0-9]*/" "$out/worker-1.log" && break; sleep 0.1; done
sleep 1
ip -n "$tag-s$primary" link set "$tag-s$primary-a" down || fail "link down"
echo "partition: cut server $primary (the primary) off"
sleep 0.3
a0=$(st "$primary" | field acked)
sleep 3.5
# The election (a 0.5 s lease) and the workers' failover (1.5 s timeouts)
# fit in the 3.5 s; on a loaded machine hold the cut up to 10 s more until
# another replica is primary and has acknowledged an update.
for _ in $(seq 1 50); do
  role_cut=$(st "$primary" | field role)
  newp=""; n_after=""
  for i in 0 1 2; do
    [ "$i" = "$primary" ] && continue
    [ "$(st "$i" | field role)" = primary ] && { newp=$i; n_after=$(st "$i" | field acked); }
  done
  [ "$role_cut" != primary ] && [ -n "$newp" ] && [ "${n_after:-0}" -gt 0 ] && break
  sleep 0.2
done
a1=$(st "$primary" | field acked)
ip -n "$tag-s$primary" link set "$tag-s$primary-a" up || fail "link up"
echo "partition: restored server $primary's link"
echo "partition: the cut-off primary acknowledged $a0 updates before the cut + 0.3 s and $a1 at its end; it is now '$role_cut'"
[ -n "$a0" ] && [ "$a0" = "$a1" ] || fail "the cut-off primary acknowledged updates while cut off ($a0 -> $a1)"
[ "$role_cut" != primary ] || fail "the cut-off primary did not step down"
[ -n "$newp" ] || fail "no other replica became primary during the cut"
[ "${n_after:-0}" -gt 0 ] || fail "the new primary (server $newp) acknowledged nothing during the cut"
echo "partition: server $newp became primary and acknowledged $n_after updates during the cut"
for k in 0 1; do
  for _ in $(seq 1 1200); do kill -0 "${wpids[$k]}" 2>/dev/null || break; sleep 0.1; done
  kill -0 "${wpids[$k]}" 2>/dev/null && fail "worker $k still running 120 s after the cut"
  wait "${wpids[$k]}" || fail "worker $k failed"
done
trained=$(cat "$out"/worker-*.log | sed -n 's/^trained \([0-9]*\) steps.*/\1/p' | awk '{s += $1} END {print s + 0}')
ok=""
for _ in $(seq 1 100); do
  for i in 0 1 2; do st "$i" >"$out/status-$i.json"; done
  if python3 - "$out" "$trained" <<'PY'
import json, sys
out, trained = sys.argv[1], int(sys.argv[2])
st = [json.load(open(f"{out}/status-{i}.json")) for i in range(3)]
p = [s for s in st if s["replica"]["role"] == "primary"]
assert len(p) == 1
assert all(s["version"] == trained and s["state_crc"] == p[0]["state_crc"] for s in st)
PY
  then ok=1; break; fi
  sleep 0.3
done
[ -n "$ok" ] || fail "after the cut the replicas do not all hold $trained applied pushes and one state (see $out/status-*.json)"
echo "partition: the workers trained $trained steps; every replica applied them, one state"
for p in "${pids[@]:0:3}"; do kill -TERM "$p" 2>/dev/null; done
for p in "${pids[@]:0:3}"; do wait "$p" || fail "a server did not stop cleanly"; done
if grep -l "Sanitizer\|runtime error:" "$out"/*.log; then fail "a sanitizer report"; fi
rm -rf "$out"
echo "PASS: partition"

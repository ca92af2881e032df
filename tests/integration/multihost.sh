#!/usr/bin/env bash
# Several hosts on one machine: a server host and two worker hosts, each a
# network namespace created here, joined by veth pairs, with addresses from
# 198.18.0.0/15 (the range set aside for network tests). One worker's link
# is cut for longer than the heartbeat time-out and then restored: the shard
# drops that worker, the worker retries, registers again, and the run
# completes. Needs root (ip netns); without it, exits 77 (skipped).
#   multihost.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" -ne 0 ]; then echo "SKIPPED: needs root to create network namespaces"; exit 77; fi
command -v ip >/dev/null || { echo "SKIPPED: iproute2 (ip) is not installed"; exit 77; }
tag="ps$$"
srv="$tag-srv" w1="$tag-w1" w2="$tag-w2"
out=$(mktemp -d "/tmp/ps-it-multihost.XXXXXX")
# The job's token: every server and client here finds it in PS_TOKEN_FILE.
export PS_TOKEN_FILE="$out/token"
(umask 077; head -c 32 /dev/urandom | base64 >"$PS_TOKEN_FILE")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for ns in "$srv" "$w1" "$w2"; do ip netns del "$ns" 2>/dev/null; done
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$out"/*.log; do echo "--- $f"; tail -8 "$f"; done >&2; exit 1; }

if ! ip netns add "$srv" 2>"$out/netns.err"; then
  echo "SKIPPED: cannot create network namespaces here: $(cat "$out/netns.err")"; exit 77
fi
ip netns add "$w1" && ip netns add "$w2" || fail "ip netns add"
# server host <-> worker host k: 198.18.k.1 <-> 198.18.k.2
for k in 1 2; do
  ns="$tag-w$k"
  ip link add "$tag-s$k" type veth peer name "$tag-h$k" || fail "veth"
  ip link set "$tag-s$k" netns "$srv" && ip link set "$tag-h$k" netns "$ns" || fail "veth netns"
  ip -n "$srv" addr add "198.18.$k.1/24" dev "$tag-s$k" && ip -n "$srv" link set "$tag-s$k" up
  ip -n "$ns" addr add "198.18.$k.2/24" dev "$tag-h$k" && ip -n "$ns" link set "$tag-h$k" up
  ip -n "$ns" link set lo up
  ip -n "$ns" route add default via "198.18.$k.1" || fail "route"
done
ip -n "$srv" link set lo up

port=5000
ip netns exec "$srv" "$build/ps-server" --insecure --job "$here/jobs/multihost.json" \
  --ps "198.18.1.1:$port" --index 0 --listen "0.0.0.0:$port" --log-interval 1 \
  >"$out/server.log" 2>&1 &
pids+=($!); spid=$!
for k in 1 2; do
  ip netns exec "$tag-w$k" "$build/ps-worker" --insecure --ps "198.18.$k.1:$port" --index $((k - 1)) \
    --num-workers 2 --threads 1 --straggle-ms 40 --timeout-ms 2000 --retry-s 60 \
    --log-interval 1 $([ "$k" -eq 1 ] && echo --pipeline on) >"$out/worker-$k.log" 2>&1 &
  pids+=($!)
done
wpids=("${pids[1]}" "${pids[2]}")

# Cut worker 1's link once it is training, for 5 s (heartbeat time-out: 2 s).
for i in $(seq 1 100); do grep -q "step [0-9]*/" "$out/worker-1.log" && break; sleep 0.1; done
ip -n "$w1" link set "$tag-h1" down || fail "link down"
echo "multihost: cut worker 1's link"
sleep 5
ip -n "$w1" link set "$tag-h1" up || fail "link up"
ip -n "$w1" route add default via 198.18.1.1 2>/dev/null
echo "multihost: restored worker 1's link"

for k in 0 1; do
  for i in $(seq 1 900); do kill -0 "${wpids[$k]}" 2>/dev/null || break; sleep 0.1; done
  kill -0 "${wpids[$k]}" 2>/dev/null && fail "worker $((k + 1)) still running 90 s after the outage"
  wait "${wpids[$k]}" || fail "worker $((k + 1)) failed"
done
grep -q "silent for more than" "$out/server.log" || fail "the server never timed worker 1 out"
grep -q "registered again" "$out/worker-1.log" || fail "worker 1 did not register again"
grep -q "^final test accuracy" "$out/worker-1.log" || fail "the chief did not finish"
kill -TERM "$spid"; wait "$spid" || fail "ps-server did not stop cleanly"
echo "multihost: worker 1 was dropped, rejoined, and the run completed:"
grep -h "silent for more than\|registered again\|^final test accuracy" "$out"/*.log
rm -rf "$out"
echo "PASS: multihost"

#!/usr/bin/env bash
# Chaos on loopback: during a training run with data leases and shard
# checkpoints, SIGKILL a worker, start a new one, SIGKILL shard 0 (which
# holds the leases) and restart it from its checkpoint, SIGSTOP a worker for
# longer than the heartbeat time-out and SIGCONT it. The run must complete
# and reach its accuracy threshold, and shard 0's records must show every
# chunk of every epoch completed exactly once. Worker 1 (and the one that
# replaces a killed worker) runs the pipelined step; worker 2 computes on
# the emulated device (--device emu), with its pipelined step.
#   chaos.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d "/tmp/ps-it-chaos.XXXXXX")
# The job's token: every server and client here finds it in PS_TOKEN_FILE.
export PS_TOKEN_FILE="$out/token"
(umask 077; head -c 32 /dev/urandom | base64 >"$PS_TOKEN_FILE")
job="$here/jobs/chaos.json"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$out"/*.log; do echo "--- $f"; tail -6 "$f"; done >&2; exit 1; }
ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(",".join("127.0.0.1:%d" % x.getsockname()[1] for x in s))')
mkdir -p "$out/ckpt"
start_server() { # index, log suffix
  "$build/ps-server" --insecure --job "$job" --ps "$ports" --index "$1" --checkpoint-dir "$out/ckpt" \
    --checkpoint-secs 1 --log-interval 1 >>"$out/server-$1.log" 2>&1 &
  pids+=($!)
  spid[$1]=$!
}
start_worker() { # k
  "$build/ps-worker" --insecure --ps "${ports%%,*}" --threads 1 --straggle-ms 25 --timeout-ms 2000 \
    --retry-s 60 --log-interval 1 $([ "$1" -eq 0 ] && echo --chief) \
    $([ $(( $1 % 2 )) -eq 1 ] && echo --pipeline on) $([ "$1" -eq 2 ] && echo --device emu) \
    >"$out/worker-$1.log" 2>&1 &
  pids+=($!)
  wpid[$1]=$!
}
declare -a spid wpid
start_server 0; start_server 1
sleep 0.3
for k in 0 1 2; do start_worker "$k"; done
waitfor() { # pattern file seconds
  for i in $(seq 1 $(( $3 * 10 ))); do grep -q "$1" "$2" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
waitfor "step [0-9]*" "$out/worker-1.log" 30 || fail "worker 1 never started training"
sleep 1
kill -9 "${wpid[1]}" && echo "chaos: SIGKILL worker 1"
start_worker 3 && echo "chaos: started worker 3"
sleep 1.5
kill -9 "${spid[0]}" && echo "chaos: SIGKILL shard 0"
sleep 1
start_server 0 && echo "chaos: restarted shard 0 from its checkpoint"
waitfor "restored" "$out/server-0.log" 10 || fail "shard 0 did not restore from its checkpoint"
sleep 1
kill -STOP "${wpid[2]}" && echo "chaos: SIGSTOP worker 2 for 5 s (time-out 2 s)"
sleep 5
kill -CONT "${wpid[2]}" && echo "chaos: SIGCONT worker 2"

for k in 0 2 3; do
  for i in $(seq 1 1200); do kill -0 "${wpid[$k]}" 2>/dev/null || break; sleep 0.1; done
  kill -0 "${wpid[$k]}" 2>/dev/null && fail "worker $k still running 120 s after the chaos"
  wait "${wpid[$k]}" || fail "worker $k failed"
done
acc=$(sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$out/worker-0.log")
[ -n "$acc" ] || fail "the chief reported no accuracy"
"$build/ps-server" --insecure --status "${ports%%,*}" >"$out/status-0.json" || fail "no Status from shard 0"
python3 - "$out" "$acc" <<'PY' || fail "the records do not show every example once per epoch"
import json, sys
out, acc = sys.argv[1], float(sys.argv[2])
st = json.load(open(f"{out}/status-0.json"))
eps = [e for e in st["lease_epochs"] if e["finished"]]
assert len(eps) == 3, f"expected 3 finished epochs in shard 0's records, got {st['lease_epochs']}"
for e in eps:
    assert e["chunks_once"] == e["chunks"] == e["chunks_completed"], e
    assert e["examples_completed"] == 8192, e
    print(f"chaos: epoch {e['epoch']}: {e['chunks']} chunks each completed once, "
          f"{e['examples_completed']} examples; {e['reclaims']} leases reclaimed, "
          f"{e['examples_rehanded']} examples handed out again")
print(f"chaos: final test accuracy {acc}")
assert acc >= 0.9, acc
PY
grep -q "silent for more than" "$out"/server-*.log || fail "no worker was timed out"
grep -q "registered again" "$out"/worker-2.log || fail "worker 2 did not register again after SIGCONT"
for s in 0 1; do kill -TERM "${spid[$s]}"; done
for s in 0 1; do wait "${spid[$s]}" || fail "shard $s did not stop cleanly"; done
rm -rf "$out"
echo "PASS: chaos"

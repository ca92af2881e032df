#!/usr/bin/env bash
# What the shards sustain as the workers grow: ps-loadgen against S local
# shards of a flat job of P parameters, W = 1, 10, 100 and 1000 simulated
# workers (each its own connections), then 1000 sharing one connection per
# shard, then 100 over mutual TLS. One line per run: updates/s, the pull
# and push latency percentiles, the servers' CPU per update and the cores
# the servers and the load generator used.
#   tests/bench/loadgen.sh BUILD_DIR [P] [SHARDS] [SECONDS]
set -euo pipefail
build=$(cd "${1:?usage: loadgen.sh BUILD_DIR [P] [SHARDS] [SECONDS]}" && pwd)
P=${2:-100000}
S=${3:-2}
secs=${4:-8}
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mktemp -d /tmp/ps-bench-loadgen.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$out"
}
trap cleanup EXIT
cat >"$out/job.json" <<EOF
{"job_id": "loadgen-bench", "model": {"params": $P}, "optimizer": {"name": "sgd", "lr": 0.001},
 "dataset": {"name": "synthetic"}, "max_workers": 1024}
EOF
"$root/deploy/certs.sh" "$out/certs" 127.0.0.1 localhost >/dev/null
c=$out/certs

start() { # plaintext|tls
  local s=0 addr
  ports=$(python3 "$root/tests/pylib/ports.py" "$S")
  for addr in ${ports//,/ }; do
    if [ "$1" = tls ]; then
      "$build/ps-server" --job "$out/job.json" --ps "$ports" --index "$s" --log-level warn \
        --token-file "$c/token" --tls-cert "$c/127.0.0.1.pem" --tls-key "$c/127.0.0.1.key" \
        --tls-ca "$c/ca.pem" --tls-require-client-cert >"$out/server-$s.log" 2>&1 &
    else
      "$build/ps-server" --insecure --job "$out/job.json" --ps "$ports" --index "$s" \
        --log-level warn >"$out/server-$s.log" 2>&1 &
    fi
    pids+=($!)
    s=$((s + 1))
  done
}
stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}
run() { # NAME ARGS...
  local name=$1
  shift
  timeout 600 "$build/ps-loadgen" --ps "$ports" --duration "$secs" --warmup 2 --log-level warn \
    --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1 || { tail -5 "$out/$name.log"; exit 1; }
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {r['updates_per_s']:.0f} | {r['pull']['p50_ms']:.1f} / {r['pull']['p99_ms']:.1f} / "
      f"{r['pull']['p999_ms']:.1f} | {r['push']['p50_ms']:.1f} / {r['push']['p99_ms']:.1f} / {r['push']['p999_ms']:.1f} | "
      f"{r['server_cpu_us_per_update']:.0f} | {r['server_cpu_cores']:.2f} | {r['loadgen_cpu_cores']:.2f} | {r['errors']} |")
PY
}
echo "ps-loadgen: $S shards, $P float32 parameters, $secs s per run ($(nproc) cores)"
echo "| workers | updates/s | pull p50 / p99 / p99.9 ms | push p50 / p99 / p99.9 ms | server CPU us/update | server cores | load generator cores | errors |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
start plaintext
for w in 1 10 100 1000; do run "$w" --insecure --workers "$w"; done
run "1000 (one shared connection per shard)" --insecure --workers 1000 --connections shared
stop
start tls
run "100 (mutual TLS)" --workers 100 --token-file "$c/token" --tls-ca "$c/ca.pem" \
  --tls-cert "$c/127.0.0.1.pem" --tls-key "$c/127.0.0.1.key"
stop

#!/usr/bin/env bash
# Runs a local cluster on loopback: S ps-server processes and W ps-worker
# processes training one job, then stops the servers.
#
#   deploy/local-cluster.sh --job FILE [--servers 2] [--workers 2]
#       [--bin DIR] [--out DIR] [--timeout SEC] [--threads N] [--straggler-ms N]
#       [--tls DIR] [--checkpoint-dir DIR [--checkpoint-secs N]]
#       [--worker-vmem-mb N] [-- WORKER-ARGS...]
# --straggler-ms N makes the last worker sleep N ms in every step.
# --worker-vmem-mb N runs every worker under `ulimit -v` of N MiB (a job
# whose embedding tables are larger than a worker may hold).
# Every process gets the job's token (PS_TOKEN_FILE, or OUT/token made
# here). Plaintext on loopback (--insecure) unless --tls DIR: mutual TLS
# with the CA and certificates deploy/certs.sh makes in DIR.
# A job with "replicas_per_shard": R gets R servers per shard (--servers
# counts shards; the checkpoint directory defaults to OUT/ckpt, where the
# replicas keep their votes). In WORKER-ARGS, %k stands for the worker's
# index. --checkpoint-dir DIR: every server checkpoints there (a set every
# --checkpoint-secs, default 30).
#
# Logs go to OUT/server-S.log and OUT/worker-W.log; worker 0 (the chief)
# is shown on the terminal. Metrics: OUT/worker-W.jsonl, OUT/server-S.jsonl.
# Exits non-zero if any process fails or the time limit passes; every
# process it started is stopped on exit.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
job="" servers=2 workers=2 bin="$here/../build" out="" timeout=900 threads="" straggler=0 tls=""
ckpt="" ckpt_secs=30 vmem_mb=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --job) job=$2; shift 2 ;;
    --servers) servers=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --straggler-ms) straggler=$2; shift 2 ;;
    --tls) tls=$2; shift 2 ;;
    --checkpoint-dir) ckpt=$2; shift 2 ;;
    --checkpoint-secs) ckpt_secs=$2; shift 2 ;;
    --worker-vmem-mb) vmem_mb=$2; shift 2 ;;
    --help|-h) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "local-cluster: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$job" ] || { echo "local-cluster: --job FILE is required" >&2; exit 2; }
[ -x "$bin/ps-server" ] && [ -x "$bin/ps-worker" ] || {
  echo "local-cluster: no ps-server/ps-worker in $bin (build first)" >&2; exit 2; }
[ -n "$out" ] || out=$(mktemp -d /tmp/ps-cluster.XXXXXX)
mkdir -p "$out"
# The job's token, which every request carries.
if [ -z "${PS_TOKEN_FILE:-}" ]; then
  if [ -n "$tls" ] && [ -f "$tls/token" ]; then PS_TOKEN_FILE=$tls/token; else
    PS_TOKEN_FILE=$out/token
    (umask 077; head -c 32 /dev/urandom | base64 >"$PS_TOKEN_FILE")
  fi
fi
export PS_TOKEN_FILE
# Plaintext on loopback, or mutual TLS with certificates for 127.0.0.1.
if [ -n "$tls" ]; then
  "$here/certs.sh" "$tls" 127.0.0.1 localhost >/dev/null
  server_sec=(--tls-cert "$tls/127.0.0.1.pem" --tls-key "$tls/127.0.0.1.key" --tls-ca "$tls/ca.pem"
              --tls-require-client-cert)
  client_sec=(--tls-ca "$tls/ca.pem" --tls-cert "$tls/localhost.pem" --tls-key "$tls/localhost.key")
else
  server_sec=(--insecure) client_sec=(--insecure)
fi
# One BLAS thread per worker when the workers share the cores.
if [ -z "$threads" ]; then
  cores=$(nproc)
  threads=$(( cores / workers )); [ "$threads" -ge 1 ] || threads=1
fi

# A job with "replicas_per_shard": R runs R servers per shard (--servers
# counts shards then), each keeping its votes in the checkpoint directory.
replicas=$(python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1])).get("replicas_per_shard", 1)))' "$job" 2>/dev/null || echo 1)
if [ "$replicas" -gt 1 ]; then
  shards=$servers; servers=$((shards * replicas))
  [ -n "$ckpt" ] || { ckpt=$out/ckpt; mkdir -p "$ckpt"; }
fi

# Free loopback ports, chosen by the kernel.
ports=$(python3 - "$servers" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(",".join("127.0.0.1:%d" % s.getsockname()[1] for s in socks))
PY
)

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

server_pids=()
for ((s = 0; s < servers; s++)); do
  "$bin/ps-server" "${server_sec[@]}" --job "$job" --ps "$ports" --index "$s" --metrics "$out/server-$s.jsonl" \
    ${ckpt:+--checkpoint-dir "$ckpt" --checkpoint-secs "$ckpt_secs"} >"$out/server-$s.log" 2>&1 &
  pids+=($!); server_pids+=($!)
done
[ "$replicas" -gt 1 ] && echo "local-cluster: $shards shards x $replicas replicas (votes and checkpoints in $ckpt)"
echo "local-cluster: $servers servers on $ports ($([ -n "$tls" ] && echo "mutual TLS" || echo plaintext), job token $PS_TOKEN_FILE); $workers workers; logs in $out"

worker_pids=()
for ((k = 0; k < workers; k++)); do
  args=(--ps "${ports%%,*}" --index "$k" --num-workers "$workers" --threads "$threads"
        --metrics "$out/worker-$k.jsonl" "${extra[@]//%k/$k}")
  if [ "$straggler" -gt 0 ] && [ "$k" -eq $((workers - 1)) ] && [ "$workers" -gt 1 ]; then
    args+=(--straggle-ms "$straggler")
  fi
  # The log exists before the worker starts, so that the tail below finds
  # it (the worker's redirection runs in the background: a tail started
  # first found no file, gave up, and the terminal showed nothing).
  : >"$out/worker-$k.log"
  (
    [ -z "$vmem_mb" ] || ulimit -v $((vmem_mb * 1024))
    exec "$bin/ps-worker" "${client_sec[@]}" "${args[@]}"
  ) >"$out/worker-$k.log" 2>&1 &
  pids+=($!); worker_pids+=($!)
  # Show the chief's progress on the terminal while it runs.
  [ "$k" -eq 0 ] && tail -n +1 -f --pid="$!" "$out/worker-0.log" &
done

# Wait for the workers, bounded by the time limit.
deadline=$(( $(date +%s) + timeout ))
status=0
for p in "${worker_pids[@]}"; do
  while kill -0 "$p" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "local-cluster: time limit of ${timeout}s passed; stopping" >&2
      exit 124
    fi
    sleep 0.2
  done
  wait "$p" || status=$?
done
sleep 0.3 # let the terminal tail print the chief's last lines
IFS=, read -r -a addrs <<<"$ports"
for ((s = 0; s < servers; s++)); do
  "$bin/ps-server" "${client_sec[@]}" --status "${addrs[$s]}" >"$out/status-$s.json" || status=1
done
for p in "${server_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
for p in "${server_pids[@]}"; do
  if ! wait "$p"; then echo "local-cluster: a server exited with an error" >&2; status=1; fi
done
pids=()
if [ "$status" -ne 0 ]; then
  echo "local-cluster: FAILED (status $status); see the logs in $out" >&2
  for f in "$out"/worker-*.log "$out"/server-*.log; do echo "--- $f"; tail -5 "$f"; done >&2
fi
exit "$status"

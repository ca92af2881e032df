#!/usr/bin/env bash
# Benchmarks, measured as ratios within one run (the machine is shared):
#   transport: one worker pulls and pushes a 10M-float32 shard to one
#              ps-server on loopback, against iperf3's single-stream TCP rate,
#              in plaintext and over mutual TLS
#   training:  examples/s of the quickstart CNN with 1 server + 1 worker
#              (plain, and with --overlap) and with 2 servers + 2 workers,
#              against the same model trained in-process (ps-worker --local)
#   wire:      the transport's 10M-value shard as float32 against 16-bit values
#              on the wire (BENCH_WIRE, default bf16), rounds alternating in
#              one run (bench_transport --compare), and the client's share
#              (encoding with error feedback, decoding)
#   wire_accuracy: deploy/jobs/compare_fmnist.json (async, 2 servers + 4
#              workers, Fashion-MNIST) with float32 and with 16-bit values on
#              the wire (BENCH_WIRE), for each of BENCH_SEEDS (default
#              "3 4 5", the job's "seed"), the two runs of a seed one after
#              the other: final test accuracy, mean and spread, examples/s,
#              and the shards' bytes per push and per pull
#   pipeline:  examples/s of the quickstart CNN with BENCH_SHARDS (default 4)
#              servers + 1 worker, --pipeline on against off
#   tls:       examples/s of the quickstart CNN with 2 servers + 1 worker,
#              over mutual TLS against plaintext
#   checkpoints: examples/s of the quickstart CNN with 2 servers + 1 worker,
#              with a checkpoint set every second against none, and how long
#              shard 0 took for each set
#   rows:      embedding rows against dense values: 10,000 distinct rows per
#              request (dim 16 and 64) pulled and pushed, rounds alternating
#              with a dense shard of as many values (bench_rows; medians of
#              BENCH_ROUNDS, default 300)
#   pslite:    the rows bench beside dmlc ps-lite's key-value store (dense
#              values and rows) on the same machine: PSLITE_SRC, a ps-lite
#              checkout, is built into BUILD_DIR/pslite (tests/bench/pslite_kv.cc)
#   versus:    this build's ps-server against another build's (BENCH_BASE, a
#              build directory of an earlier version), the transport's 10M-value
#              pull and push, rounds alternating between the two servers in one
#              run (bench_transport --compare), each order BENCH_REPEATS times
#              (default 2): the median ratios of this build's times to the other's
#   tests/bench/run.sh [versus|rows|pslite|transport|wire|wire_accuracy|training|pipeline|tls|checkpoints|all]
#       [BUILD_DIR]
set -euo pipefail
what=${1:-all}
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${2:-$root/build}" && pwd)
out=$(mktemp -d /tmp/ps-bench.XXXXXX)
# The job's token: every server and client here finds it in PS_TOKEN_FILE.
export PS_TOKEN_FILE="$out/token"
(umask 077; head -c 32 /dev/urandom | base64 >"$PS_TOKEN_FILE")
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

transport() {
  command -v iperf3 >/dev/null || { echo "iperf3 is missing (deploy/install-deps.sh)"; exit 1; }
  "$root/deploy/certs.sh" "$out/certs" 127.0.0.1 localhost >/dev/null
  local c=$out/certs
  # plaintext, then mutual TLS, one after the other in the same run
  local mode p spid
  for mode in plain tls; do
    p=$(port)
    local sec=(--insecure) csec=()
    if [ "$mode" = tls ]; then
      sec=(--tls-cert "$c/127.0.0.1.pem" --tls-key "$c/127.0.0.1.key" --tls-ca "$c/ca.pem"
           --tls-require-client-cert)
      csec=("$c/ca.pem" "$c/localhost.pem" "$c/localhost.key")
    fi
    "$build/ps-server" "${sec[@]}" --job "$root/tests/bench/jobs_transport.json" \
      --ps "127.0.0.1:$p" --index 0 >"$out/server-$mode.log" 2>&1 &
    pids+=($!); spid=$!
    "$build/bench_transport" "127.0.0.1:$p" 20 "${csec[@]}" | tee "$out/transport-$mode.txt"
    kill -TERM "$spid"; wait "$spid" || true
  done
  local ip; ip=$(port)
  iperf3 -s -1 -B 127.0.0.1 -p "$ip" >/dev/null 2>&1 &
  pids+=($!)
  sleep 0.5
  iperf3 -c 127.0.0.1 -p "$ip" -t 5 -P 1 -J >"$out/iperf.json"
  python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
t = json.loads(open(f"{out}/transport-plain.txt").read().strip().splitlines()[-1])
s = json.loads(open(f"{out}/transport-tls.txt").read().strip().splitlines()[-1])
ip = json.load(open(f"{out}/iperf.json"))
gbps = ip["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
print(f"iperf3 loopback, one stream: {gbps:.2f} GB/s")
print(f"pull: {t['pull_gbps']:.2f} GB/s = {t['pull_gbps']/gbps:.3f} of iperf3 ({t['pull_ms']:.1f} ms per 10M values)")
print(f"push: {t['push_gbps']:.2f} GB/s = {t['push_gbps']/gbps:.3f} of iperf3 ({t['push_ms']:.1f} ms per 10M values)")
print(f"mutual TLS: pull {s['pull_ms']:.1f} ms = {t['pull_ms']/s['pull_ms']:.3f} of plaintext's rate, "
      f"push {s['push_ms']:.1f} ms = {t['push_ms']/s['push_ms']:.3f} of plaintext's rate")
PY
}

rows() {
  # Embedding rows against dense values: 10k distinct ids per request, dim
  # 16 and 64, rounds alternating with a dense shard of as many values.
  local pr p16 p64
  pr=$(port); p16=$(port); p64=$(port)
  "$build/ps-server" --insecure --job "$root/tests/bench/jobs_rows.json" --ps "127.0.0.1:$pr" \
    --index 0 >"$out/server-rows.log" 2>&1 &
  pids+=($!)
  "$build/ps-server" --insecure --job "$root/tests/bench/jobs_rows_dense16.json" \
    --ps "127.0.0.1:$p16" --index 0 >"$out/server-dense16.log" 2>&1 &
  pids+=($!)
  "$build/ps-server" --insecure --job "$root/tests/bench/jobs_rows_dense64.json" \
    --ps "127.0.0.1:$p64" --index 0 >"$out/server-dense64.log" 2>&1 &
  pids+=($!)
  "$build/bench_rows" "127.0.0.1:$pr" "127.0.0.1:$p16" "127.0.0.1:$p64" "${BENCH_ROUNDS:-300}" \
    "${BENCH_IDS:-10000}" | tee "$out/rows.txt"
}

pslite() {
  # The rows bench beside dmlc ps-lite's key-value store on the same machine
  # (tests/bench/pslite_kv.cc): PSLITE_SRC, a ps-lite checkout
  # (https://github.com/dmlc/ps-lite), is built into BUILD_DIR/pslite (reused
  # when there); it needs libzmq3-dev, libprotobuf-dev and protobuf-compiler.
  # BENCH_RUNS (default 3) runs of each, alternating.
  local src=${PSLITE_SRC:-} pl=$build/pslite
  [ -n "$src" ] && [ -f "$src/include/ps/kv_app.h" ] ||
    { echo "PSLITE_SRC must name a ps-lite checkout (https://github.com/dmlc/ps-lite)" >&2; exit 2; }
  if [ ! -x "$pl/pslite_kv" ]; then
    cmake -S "$src" -B "$pl/build" -DCMAKE_BUILD_TYPE=Release >"$out/pslite-cmake.log" 2>&1
    cmake --build "$pl/build" -j2 --target pslite >"$out/pslite-build.log" 2>&1
    g++ -O2 -std=c++14 -I "$src/include" -I "$pl/build" "$root/tests/bench/pslite_kv.cc" \
      "$pl/build/libpslite.a" -lzmq -lprotobuf -lpthread -o "$pl/pslite_kv"
  fi
  kv() { # the worker's JSON line; a start that fails (ps-lite's scheduler
    # aborted now and then here) is tried again, on another port
    local try line
    for try in 1 2 3; do
      line=$(kv_once "$@")
      [ -n "$line" ] && { echo "$line"; return 0; }
      echo "ps-lite: $* failed to start (try $try)" >&2
    done
    return 1
  }
  kv_once() { # scheduler, one server, one worker on loopback
    local sp; sp=$(port)
    local e=(env DMLC_NUM_SERVER=1 DMLC_NUM_WORKER=1 DMLC_PS_ROOT_URI=127.0.0.1
             DMLC_PS_ROOT_PORT="$sp" DMLC_NODE_HOST=127.0.0.1)
    "${e[@]}" DMLC_ROLE=scheduler "$pl/pslite_kv" "$@" >/dev/null 2>&1 &
    local a=$!
    "${e[@]}" DMLC_ROLE=server "$pl/pslite_kv" "$@" >/dev/null 2>&1 &
    local b=$!
    timeout 300 "${e[@]}" DMLC_ROLE=worker "$pl/pslite_kv" "$@" 2>/dev/null | tail -1 || true
    kill "$a" "$b" 2>/dev/null || true
    wait "$a" "$b" 2>/dev/null || true
  }
  local r pr p16 p64 s1 s2 s3 rounds=${BENCH_ROUNDS:-300}
  : >"$out/pslite.jsonl"
  for r in $(seq 1 "${BENCH_RUNS:-3}"); do
    pr=$(port); p16=$(port); p64=$(port)
    "$build/ps-server" --insecure --job "$root/tests/bench/jobs_rows.json" --ps "127.0.0.1:$pr" \
      --index 0 >"$out/server-rows.log" 2>&1 &
    s1=$!
    "$build/ps-server" --insecure --job "$root/tests/bench/jobs_rows_dense16.json" \
      --ps "127.0.0.1:$p16" --index 0 >"$out/server-dense16.log" 2>&1 &
    s2=$!
    "$build/ps-server" --insecure --job "$root/tests/bench/jobs_rows_dense64.json" \
      --ps "127.0.0.1:$p64" --index 0 >"$out/server-dense64.log" 2>&1 &
    s3=$!
    pids+=("$s1" "$s2" "$s3")
    echo "{\"ours\": $("$build/bench_rows" "127.0.0.1:$pr" "127.0.0.1:$p16" "127.0.0.1:$p64" \
      "$rounds" 10000 | tail -1)}" >>"$out/pslite.jsonl"
    kill "$s1" "$s2" "$s3"; wait "$s1" "$s2" "$s3" 2>/dev/null || true
    for d in 16 64; do
      local n=$((d == 16 ? 161202 : 642402)) rows=$((d == 16 ? 4000000 : 1000000))
      echo "{\"dim\": $d, \"dense1\": $(kv dense1 "$n" "$rounds"), \"dense\": $(kv dense "$n" "$rounds"), \"rows\": $(kv rows "$d" "$rows" "$rounds" 10000)}" >>"$out/pslite.jsonl"
    done
  done
  python3 - "$out/pslite.jsonl" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
ours = [r["ours"] for r in runs if "ours" in r]
peer = {16: [r for r in runs if r.get("dim") == 16], 64: [r for r in runs if r.get("dim") == 64]}
print("rows: 10,000 distinct ids per request; rates are value bytes/s (4 bytes a value)")
print("| run | dim | ours: rows pull, push (ms) | ps-lite: rows pull, push | ps-lite dense, 1 key: pull, push | ps-lite dense, a key a value: pull, push | ours / ps-lite dense (best form): pull, push |")
print("|---|---|---|---|---|---|---|")
for i, o in enumerate(ours):
    for d in (16, 64):
        if i >= len(peer[d]):
            continue
        p = peer[d][i]; m = o["dim%d" % d]
        rb = 10000 * d * 4
        def rate(values, ms): return values * 4 / ms
        ours_pull, ours_push = rate(10000 * d, m["rows_pull_ms"]), rate(10000 * d, m["rows_push_ms"])
        best_pull = max(rate(p[k]["values"], p[k]["pull_ms"]) for k in ("dense", "dense1"))
        best_push = max(rate(p[k]["values"], p[k]["push_ms"]) for k in ("dense", "dense1"))
        print(f"| {i + 1} | {d} | {m['rows_pull_ms']:.3f}, {m['rows_push_ms']:.3f} | "
              f"{p['rows']['pull_ms']:.3f}, {p['rows']['push_ms']:.3f} | "
              f"{p['dense']['pull_ms']:.3f}, {p['dense']['push_ms']:.3f} | "
              f"{p['dense1']['pull_ms']:.3f}, {p['dense1']['push_ms']:.3f} | "
              f"x{ours_pull / best_pull:.3f}, x{ours_push / best_push:.3f} |")
print("ours against our dense shard (bench_rows): " + "; ".join(
    f"run {i + 1}: dim 16 x{o['dim16']['pull_ratio']:.3f}, x{o['dim16']['push_ratio']:.3f}, "
    f"dim 64 x{o['dim64']['pull_ratio']:.3f}, x{o['dim64']['push_ratio']:.3f}" for i, o in enumerate(ours)))
PY
}

wire() {
  local w=${BENCH_WIRE:-bf16} p32 p16 s32 s16
  python3 - "$root/tests/bench/jobs_transport.json" "$w" >"$out/jobs_transport_$w.json" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
job["wire"] = sys.argv[2]
json.dump(job, sys.stdout)
PY
  p32=$(port)
  p16=$(port)
  "$build/ps-server" --insecure --job "$root/tests/bench/jobs_transport.json" \
    --ps "127.0.0.1:$p32" --index 0 >"$out/server-fp32.log" 2>&1 &
  pids+=($!); s32=$!
  "$build/ps-server" --insecure --job "$out/jobs_transport_$w.json" \
    --ps "127.0.0.1:$p16" --index 0 >"$out/server-$w.log" 2>&1 &
  pids+=($!); s16=$!
  "$build/bench_transport" --compare "127.0.0.1:$p16" "127.0.0.1:$p32" "${BENCH_ROUNDS:-20}" \
    | tee "$out/transport-wire.txt"
  kill -TERM "$s32" "$s16"; wait "$s32" "$s16" || true
}

wire_accuracy() {
  local w=${BENCH_WIRE:-bf16} seed wire run
  [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
    || { echo "dataset-fashion-mnist is not installed (deploy/install-deps.sh)"; exit 1; }
  for seed in ${BENCH_SEEDS:-3 4 5}; do
    for wire in fp32 "$w"; do
      run=$wire-$seed
      python3 - "$root/deploy/jobs/compare_fmnist.json" "$wire" "$seed" >"$out/$run.json" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
job["wire"], job["seed"], job["mode"] = sys.argv[2], int(sys.argv[3]), "async"
json.dump(job, sys.stdout, indent=1)
PY
      "$root/deploy/local-cluster.sh" --job "$out/$run.json" --bin "$build" --servers 2 --workers 4 \
        --threads 1 --out "$out/$run" --timeout 1200 -- --log-interval 5 >"$out/$run.out" 2>&1 \
        || { tail -20 "$out/$run.out"; echo "wire_accuracy: the run $run failed" >&2; exit 1; }
      echo "$run: $(grep -h '^final test accuracy' "$out/$run/worker-0.log")"
    done
  done
  python3 - "$out" "$w" ${BENCH_SEEDS:-3 4 5} <<'PY'
import json, re, statistics, sys
out, w, seeds = sys.argv[1], sys.argv[2], sys.argv[3:]
def run(wire, seed):
    d = f"{out}/{wire}-{seed}"
    acc = float(re.search(r"^final test accuracy ([0-9.]+)", open(f"{d}/worker-0.log").read(), re.M).group(1))
    eps = sum(float(m) for k in range(4) for m in
              re.findall(r"examples in [0-9.]+ s: ([0-9.]+) examples/s", open(f"{d}/worker-{k}.log").read())[-1:])
    st = [json.load(open(f"{d}/status-{s}.json")) for s in (0, 1)]
    push = sum(s["push_bytes"] for s in st) / sum(s["pushes"] for s in st)
    pull = sum(s["pull_bytes"] for s in st) / sum(s["pulls"] for s in st)
    return acc, eps, push, pull
res = {wire: [run(wire, s) for s in seeds] for wire in ("fp32", w)}
for wire, rs in res.items():
    acc = [r[0] for r in rs]
    print(f"{wire}: final test accuracy over seeds {' '.join(seeds)}: " + ", ".join(f"{a:.4f}" for a in acc) +
          f"; mean {statistics.mean(acc):.4f}, spread (max - min) {max(acc) - min(acc):.4f}, "
          f"sd {statistics.stdev(acc) if len(acc) > 1 else 0:.4f}; "
          f"{statistics.median(r[1] for r in rs):.0f} examples/s (median, 4 workers); "
          f"{statistics.median(r[2] for r in rs):.0f} bytes per push, {statistics.median(r[3] for r in rs):.0f} per pull")
d = [b[0] - a[0] for a, b in zip(res["fp32"], res[w])]
r = [b[1] / a[1] for a, b in zip(res["fp32"], res[w])]
print(f"{w} - fp32, seed by seed: accuracy " + ", ".join(f"{x:+.4f}" for x in d) +
      f" (mean {statistics.mean(d):+.4f}); examples/s ratio " + ", ".join(f"{x:.3f}" for x in r))
PY
}

# examples/s from a run's summary line
eps() { sed -n 's/.*: \([0-9]*\) examples\/s$/\1/p' "$1" | tail -1; }

training() {
  local steps=${BENCH_STEPS:-300}
  local job="$root/deploy/jobs/fashion_mnist_cnn.json"
  local l=() c=() o=() q=()
  # Interleaved pairs: whatever else the machine does hits both alike.
  for round in $(seq 1 "${BENCH_ROUNDS:-5}"); do
    "$build/ps-worker" --local --job "$job" --max-steps "$steps" --eval-interval 0 \
      --log-interval 1000 >"$out/local-$round.log" 2>&1
    l+=("$(eps "$out/local-$round.log")")
    local p; p=$(port)
    "$build/ps-server" --insecure --job "$job" --ps "127.0.0.1:$p" --index 0 >"$out/server-$round.log" 2>&1 &
    pids+=($!); local spid=$!
    "$build/ps-worker" --insecure --ps "127.0.0.1:$p" --max-steps "$steps" --eval-interval 0 \
      --log-interval 1000 >"$out/cluster-$round.log" 2>&1
    kill -TERM "$spid"; wait "$spid" || true
    c+=("$(eps "$out/cluster-$round.log")")
    p=$(port)
    "$build/ps-server" --insecure --job "$job" --ps "127.0.0.1:$p" --index 0 >"$out/server-o$round.log" 2>&1 &
    pids+=($!); spid=$!
    "$build/ps-worker" --insecure --ps "127.0.0.1:$p" --max-steps "$steps" --eval-interval 0 --overlap \
      --log-interval 1000 >"$out/overlap-$round.log" 2>&1
    kill -TERM "$spid"; wait "$spid" || true
    o+=("$(eps "$out/overlap-$round.log")")
    # 2 servers + 2 workers (a thread each) on the same cores, side by side
    # for the same steps each
    "$root/deploy/local-cluster.sh" --job "$job" --bin "$build" --servers 2 --workers 2 \
      --threads 1 --out "$out/c22-$round" --timeout 600 -- --max-steps "$steps" \
      --eval-interval 0 --log-interval 1000 >"$out/c22-$round.out" 2>&1 \
      || { tail -5 "$out/c22-$round.out"; exit 1; }
    q+=("$(python3 - "$out/c22-$round"/worker-[01].log <<'PY'
import re, sys
# all examples over the longer worker's time (they start together): no
# credit for a worker that ran part of the time alone
runs = [re.findall(r"trained \d+ steps, (\d+) examples in ([0-9.]+) s", open(f).read())[-1] for f in sys.argv[1:]]
print(round(sum(int(e) for e, _ in runs) / max(float(t) for _, t in runs)))
PY
)")
    echo "round $round: local ${l[-1]}, 1 server + 1 worker ${c[-1]}, with --overlap ${o[-1]}, 2 servers + 2 workers ${q[-1]} examples/s"
  done
  python3 - "${l[@]}" "${c[@]}" "${o[@]}" "${q[@]}" <<'PY'
import statistics, sys
v = [float(x) for x in sys.argv[1:]]
n = len(v) // 4
loc, clu, ovl, c22 = v[:n], v[n:2*n], v[2*n:3*n], v[3*n:]
# Each round's runs follow one another within seconds: the ratio within a
# round is what the noise of this shared machine disturbs least.
rc = statistics.median(c / l for c, l in zip(clu, loc))
ro = statistics.median(o / l for o, l in zip(ovl, loc))
print(f"training, medians over {n} rounds: local {statistics.median(loc):.0f} examples/s, "
      f"1 server + 1 worker {statistics.median(clu):.0f} (ratio {rc:.3f}, server overhead "
      f"{100*(1-rc):.1f}%), with --overlap {statistics.median(ovl):.0f} (ratio {ro:.3f})")
r22 = statistics.median(q / l for q, l in zip(c22, loc))
print(f"2 servers + 2 workers {statistics.median(c22):.0f} examples/s: {r22:.3f} of one --local process "
      f"(rounds: {', '.join(f'{q / l:.3f}' for q, l in zip(c22, loc))})")
PY
}

# One run of S servers + 1 worker; WORKER-ARGS... go to the worker; the
# log goes to $out/NAME.log. Plaintext unless server_sec/client_sec say.
server_sec=(--insecure) client_sec=(--insecure)
cluster_run() {
  local name=$1 shards=$2; shift 2
  local job="$root/deploy/jobs/fashion_mnist_cnn.json" addrs="" spids=()
  for s in $(seq 1 "$shards"); do addrs+="${addrs:+,}127.0.0.1:$(port)"; done
  for s in $(seq 0 $((shards - 1))); do
    "$build/ps-server" "${server_sec[@]}" --job "$job" --ps "$addrs" --index "$s" \
      >"$out/$name-server-$s.log" 2>&1 &
    pids+=($!); spids+=($!)
  done
  "$build/ps-worker" "${client_sec[@]}" --ps "${addrs%%,*}" --eval-interval 0 --log-interval 1000 "$@" \
    >"$out/$name.log" 2>&1
  for p in "${spids[@]}"; do kill -TERM "$p"; wait "$p" || true; done
}

# Training over mutual TLS against plaintext: the quickstart CNN, 2 servers
# + 1 worker, interleaved rounds.
tls() {
  local steps=${BENCH_STEPS:-300} plain=() sec=()
  "$root/deploy/certs.sh" "$out/certs" 127.0.0.1 localhost >/dev/null
  local c=$out/certs
  for round in $(seq 1 "${BENCH_ROUNDS:-5}"); do
    server_sec=(--insecure) client_sec=(--insecure)
    cluster_run "plain-$round" 2 --max-steps "$steps"
    plain+=("$(eps "$out/plain-$round.log")")
    server_sec=(--tls-cert "$c/127.0.0.1.pem" --tls-key "$c/127.0.0.1.key" --tls-ca "$c/ca.pem"
                --tls-require-client-cert)
    client_sec=(--tls-ca "$c/ca.pem" --tls-cert "$c/localhost.pem" --tls-key "$c/localhost.key")
    cluster_run "tls-$round" 2 --max-steps "$steps"
    sec+=("$(eps "$out/tls-$round.log")")
    echo "round $round: 2 servers + 1 worker: plaintext ${plain[-1]}, mutual TLS ${sec[-1]} examples/s"
  done
  server_sec=(--insecure) client_sec=(--insecure)
  python3 - "${plain[@]}" "${sec[@]}" <<'PY'
import statistics, sys
v = [float(x) for x in sys.argv[1:]]
n = len(v) // 2
p, t = v[:n], v[n:]
r = statistics.median(b / a for a, b in zip(p, t))
print(f"tls, medians over {n} rounds: plaintext {statistics.median(p):.0f} examples/s, "
      f"mutual TLS {statistics.median(t):.0f}; TLS/plaintext within rounds {r:.3f}")
PY
}

# Checkpoint sets every second against none: the quickstart CNN, 2
# servers + 1 worker, interleaved rounds.
checkpoints() {
  local steps=${BENCH_STEPS:-600} none=() sets=()
  server_sec=(--insecure) client_sec=(--insecure)
  for round in $(seq 1 "${BENCH_ROUNDS:-5}"); do
    cluster_run "none-$round" 2 --max-steps "$steps"
    none+=("$(eps "$out/none-$round.log")")
    server_sec=(--insecure --checkpoint-dir "$out/ck-$round" --checkpoint-secs 1)
    cluster_run "sets-$round" 2 --max-steps "$steps"
    server_sec=(--insecure)
    sets+=("$(eps "$out/sets-$round.log")")
    echo "round $round: 2 servers + 1 worker: no checkpoints ${none[-1]}, a set every second ${sets[-1]} examples/s"
  done
  cat "$out"/sets-*-server-0.log >"$out/sets-server-0.all"
  python3 - "$out/sets-server-0.all" "${none[@]}" "${sets[@]}" <<'PY'
import re, statistics, sys
v = [float(x) for x in sys.argv[2:]]
n = len(v) // 2
a, b = v[:n], v[n:]
r = statistics.median(y / x for x, y in zip(a, b))
ms = [float(m) for m in re.findall(r"complete: .*, ([0-9.]+) ms", open(sys.argv[1]).read())]
print(f"checkpoints, medians over {n} rounds: none {statistics.median(a):.0f} examples/s, a set "
      f"every second {statistics.median(b):.0f}; with/without within rounds {r:.3f}; "
      f"{len(ms)} sets, median {statistics.median(ms):.0f} ms, max {max(ms):.0f} ms from PREPARE to "
      f"every file on disk")
PY
}

pipeline() {
  local steps=${BENCH_STEPS:-300} shards=${BENCH_SHARDS:-4}
  local on=() off=()
  for round in $(seq 1 "${BENCH_ROUNDS:-5}"); do
    cluster_run "on-$round" "$shards" --max-steps "$steps" --pipeline on
    on+=("$(eps "$out/on-$round.log")")
    cluster_run "off-$round" "$shards" --max-steps "$steps" --pipeline off
    off+=("$(eps "$out/off-$round.log")")
    echo "round $round: $shards servers + 1 worker: --pipeline on ${on[-1]}, off ${off[-1]} examples/s"
  done
  python3 - "${on[@]}" "${off[@]}" <<'PY'
import statistics, sys
v = [float(x) for x in sys.argv[1:]]
n = len(v) // 2
on, off = v[:n], v[n:]
r = statistics.median(a / b for a, b in zip(on, off))
print(f"pipeline, medians over {n} rounds: on {statistics.median(on):.0f} examples/s, "
      f"off {statistics.median(off):.0f}; on/off within rounds {r:.3f}")
PY
}

versus() {
  local base=${BENCH_BASE:?BENCH_BASE: the build directory of the ps-server to compare with}
  base=$(cd "$base" && pwd)
  local pa pb
  pa=$(port); pb=$(port)
  "$base/ps-server" --insecure --job "$root/tests/bench/jobs_transport.json" --ps "127.0.0.1:$pa" \
    --index 0 >"$out/server-base.log" 2>&1 &
  pids+=($!)
  "$build/ps-server" --insecure --job "$root/tests/bench/jobs_transport.json" --ps "127.0.0.1:$pb" \
    --index 0 >"$out/server-this.log" 2>&1 &
  pids+=($!)
  local i
  for ((i = 0; i < ${BENCH_REPEATS:-2}; i++)); do
    # The ratios are the second server's times over the first's: this
    # build second, then first (its ratios inverted below).
    "$build/bench_transport" --compare "127.0.0.1:$pb" "127.0.0.1:$pa" 40 | tail -1 >>"$out/this-second.txt"
    "$build/bench_transport" --compare "127.0.0.1:$pa" "127.0.0.1:$pb" 40 | tail -1 >>"$out/this-first.txt"
  done
  python3 - "$out" "$base" <<'PY'
import json, statistics, sys
out, base = sys.argv[1], sys.argv[2]
pull, push = [], []
for name, inv in (("this-second.txt", False), ("this-first.txt", True)):
    for line in open(f"{out}/{name}"):
        r = json.loads(line)
        pull.append(1 / r["pull_ratio"] if inv else r["pull_ratio"])
        push.append(1 / r["push_ratio"] if inv else r["push_ratio"])
print(f"this ps-server's time / {base}'s, 10M values, {len(pull)} runs of 40 alternating rounds:")
print(f"  pull x{statistics.median(pull):.3f} (runs {', '.join(f'{x:.3f}' for x in pull)})")
print(f"  push x{statistics.median(push):.3f} (runs {', '.join(f'{x:.3f}' for x in push)})")
PY
}

case "$what" in
  versus) versus ;;
  transport) transport ;;
  wire) wire ;;
  rows) rows ;;
  pslite) pslite ;;
  wire_accuracy) wire_accuracy ;;
  training) training ;;
  pipeline) pipeline ;;
  tls) tls ;;
  checkpoints) checkpoints ;;
  all) transport; wire; training; pipeline; tls; checkpoints ;;
  *) echo "usage: tests/bench/run.sh [versus|transport|rows|pslite|wire|wire_accuracy|training|pipeline|tls|checkpoints|all] [BUILD_DIR]" >&2; exit 2 ;;
esac

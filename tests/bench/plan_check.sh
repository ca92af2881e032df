#!/usr/bin/env bash
# ps-plan against measured runs. Each configuration runs ps-loadgen (W
# simulated workers, --compute-ms as their compute) against S shards of a
# flat job of P parameters, and asks ps-plan for the same configuration;
# prints predicted and measured updates/s, the error and the bottleneck
# ps-plan names. Two settings, all on this one host (--host-cores: the
# shards and the workers share its cores):
#   loopback: P 100k and 1M, S 1, 2, 4, W 1 and 16, compute 0 and 10 ms;
#   links:    the shards and the workers in network namespaces of their own
#             (veth to a bridge), each host's link limited by tc (netem:
#             rate and half the round trip each way): 1 and 10 Gbit/s,
#             0.2 and 1 ms round trip, S 1 and 2, W 4 and 16, P 1M (needs
#             root; skipped with a message otherwise). Without netem in the
#             kernel: tbf for the rate, the round trip as measured.
# With --calibrate it measures instead the costs ps-plan's defaults hold (a
# shard's and a worker's CPU per update, fixed and per MB, and what more
# shards on one host cost) on this machine and prints them as ps-plan
# flags, and the kernel's cost of links between namespaces (--links uses
# it: PLAN_NET_US_PER_MB, default 250, the mean of two calibrations here: 175 and 317).
#   tests/bench/plan_check.sh BUILD_DIR [--calibrate | --loopback | --links]
set -euo pipefail
build=$(cd "${1:?usage: plan_check.sh BUILD_DIR [--calibrate|--loopback|--links]}" && pwd)
what=${2:-all}
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mktemp -d /tmp/ps-plan-check.XXXXXX)
cores=$(nproc)
pids=()
ns_made=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for n in "${ns_made[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$out"
}
trap cleanup EXIT
secs=${PLAN_CHECK_SECS:-4}

job() { # P: writes $out/job-P.json
  cat >"$out/job-$1.json" <<EOF
{"job_id": "plan-check", "model": {"params": $1}, "optimizer": {"name": "sgd", "lr": 0.0001},
 "dataset": {"name": "synthetic"}, "batch_size": 64, "max_workers": 64}
EOF
}

# servers PREFIX S P: S shards of job-P; addresses in $ports. PREFIX runs
# each (an "ip netns exec NS" for shard s is built by the caller through
# srv_ns and srv_ip).
servers() {
  local S=$1 P=$2 s addr
  ports=""
  for ((s = 0; s < S; s++)); do
    if [ -n "${srv_ns:-}" ]; then addr="10.77.0.$((10 + s)):7070"; else addr=$(python3 "$root/tests/pylib/ports.py" 1); fi
    ports+="${ports:+,}$addr"
  done
  for ((s = 0; s < S; s++)); do
    ${srv_ns:+ip netns exec psplan-s$s} "$build/ps-server" --insecure --job "$out/job-$P.json" \
      --ps "$ports" --index "$s" --log-level warn >"$out/server-$s.log" 2>&1 &
    pids+=($!)
  done
  sleep 0.7
}
stop_servers() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

# measure NAME W COMPUTE_MS: ps-loadgen against $ports; $out/NAME.json
measure() {
  ${wk_ns:+ip netns exec psplan-w} timeout 300 "$build/ps-loadgen" --insecure --ps "$ports" \
    --workers "$2" --compute-ms "$3" --duration "$secs" --warmup 1 --log-level warn \
    --json "$out/$1.json" >"$out/$1.log" 2>&1 || { tail -5 "$out/$1.log"; exit 1; }
}

# row NAME P S W COMPUTE [PLAN-ARGS...]: one line of the table
row() {
  local name=$1 P=$2 S=$3 W=$4 c=$5
  shift 5
  "$build/ps-plan" --job "$out/job-$P.json" --workers "$W" --step-ms "$c" --shards "$S" \
    --host-cores "$cores" --worker-hosts 1 --json "$@" >"$out/$name.plan"
  python3 - "$out/$name.json" "$out/$name.plan" "$P" "$S" "$W" "$c" "$*" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
p = json.load(open(sys.argv[2]))["predictions"][0]
P, S, W, c, net = sys.argv[3:8]
err = (p["updates_per_s"] - m["updates_per_s"]) / m["updates_per_s"]
print(f"| {int(P):,} | {S} | {W} | {c} | {net or 'loopback'} | {p['updates_per_s']:.0f} | "
      f"{m['updates_per_s']:.0f} | {100 * err:+.0f}% | {p['bottleneck']} |", flush=True)
with open(sys.argv[2] + ".err", "w") as f:
    f.write(f"{abs(err)}\n")
PY
}

header() {
  echo "| parameters | shards | workers | compute ms | network | predicted updates/s | measured | error | bottleneck (ps-plan) |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
}

summary() {
  cat "$out"/*.plan.err | python3 -c "
import sys
e = sorted(float(x) for x in sys.stdin)
print(f'{len(e)} runs: median error {100 * e[len(e) // 2]:.0f}%, worst {100 * e[-1]:.0f}%')"
  rm -f "$out"/*.plan.err
}

calibrate() {
  echo "calibration: 1 shard, 1 and 4 workers, P 10k, 100k, 1M, no compute ($cores cores shared)"
  local P W S
  for P in 10000 100000 1000000; do
    job "$P"
    servers 1 "$P"
    for W in 1 4; do measure "cal-$P-$W" "$W" 0; done
    [ "$P" = 10000 ] && measure cal-s1 16 0
    stop_servers
  done
  # the fixed parts per shard: 16 workers, 1, 2 and 4 shards of a small job
  for S in 2 4; do
    servers "$S" 10000
    measure "cal-s$S" 16 0
    stop_servers
  done
  python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
pts = []
for P in (10000, 100000, 1000000):
    for W in (1, 4):
        r = json.load(open(f"{out}/cal-{P}-{W}.json"))
        mb = 2 * P * 4 / 1e6
        cli = r["loadgen_cpu_cores"] / r["updates_per_s"] * 1e6
        pts.append((P, W, mb, r["server_cpu_us_per_update"], cli))
        print(f"  P {P:>8} W {W}: {r['updates_per_s']:.0f} updates/s, shard {r['server_cpu_us_per_update']:.0f} us, "
              f"client {cli:.0f} us per update ({mb:.2f} MB)")
def fit(xs, ys):
    n = len(xs); mx = sum(xs) / n; my = sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b
a4, b4 = fit([p[2] for p in pts if p[1] == 4], [p[3] for p in pts if p[1] == 4])
a1, _ = fit([p[2] for p in pts if p[1] == 1], [p[3] - b4 * p[2] for p in pts if p[1] == 1])
ka, kb = fit([p[2] for p in pts], [p[4] for p in pts])
# a shard's extra part when it serves few workers at once: idle / W, from W = 1 and 4
idle = max(0.0, (a1 - a4) * 4 / 3)
# per shard, with 16 workers on 1, 2 and 4 shards (0.08 MB per update: the fixed parts)
srv, cli = {}, {}
for S in (1, 2, 4):
    r = json.load(open(f"{out}/cal-s{S}.json"))
    srv[S] = r["server_cpu_us_per_update"] / S
    cli[S] = r["loadgen_cpu_cores"] / r["updates_per_s"] * 1e6
    print(f"  P    10000 W 16 S {S}: {r['updates_per_s']:.0f} updates/s, per shard {srv[S]:.0f} us, "
          f"client {cli[S]:.0f} us per update")
mb = 2 * 10000 * 4 / 1e6
base = max(0.0, srv[1] - idle / 16 - b4 * mb)
contention = max(0.0, (srv[4] / srv[1] - 1) / 3)
cs = fit([1, 2, 4], [cli[1], cli[2], cli[4]])[1]
print(f"ps-plan flags: --server-us-per-update {base:.0f} --server-us-idle {idle:.0f} "
      f"--server-us-per-mb {b4:.0f} --client-us-per-update {cs:.0f} --client-us-per-mb {kb:.0f} "
      f"--contention {contention:.2f}")
PY
  # The kernel's forwarding between namespaces (veth, bridge, tc): the same
  # run (1M, 1 shard, 4 workers: the host's cores bind) on unshaped links
  # between namespaces against loopback; the cores lost per update, per MB.
  if [ "$(id -u)" != 0 ]; then
    echo "calibration: --net-us-per-mb not measured (namespaces need root)"
    return 0
  fi
  job 1000000
  net_up 1
  srv_ns=1 wk_ns=1
  servers 1 1000000
  measure cal-ns 4 0
  stop_servers
  unset srv_ns wk_ns
  net_down
  python3 - "$out" "$cores" <<'PY'
import json, sys
out, cores = sys.argv[1], float(sys.argv[2])
lo = json.load(open(f"{out}/cal-1000000-4.json"))["updates_per_s"]
ns = json.load(open(f"{out}/cal-ns.json"))["updates_per_s"]
extra = cores * 1e6 / ns - cores * 1e6 / lo
print(f"  namespaces: {ns:.0f} updates/s against {lo:.0f} on loopback: {extra:.0f} us of the host's "
      f"cores more per update (8.00 MB)")
print(f"ps-plan flag for links between namespaces on this host: --net-us-per-mb {max(extra, 0) / 8:.0f}")
PY
}

loopback() {
  echo "loopback ($cores cores shared by the shards and ps-loadgen, $secs s per run)"
  header
  local P S W c
  for P in 100000 1000000; do
    job "$P"
    for S in 1 2 4; do
      servers "$S" "$P"
      for W in 1 16; do
        for c in 0 10; do
          measure "lo-$P-$S-$W-$c" "$W" "$c"
          row "lo-$P-$S-$W-$c" "$P" "$S" "$W" "$c"
        done
      done
      stop_servers
    done
  done
  summary
}

# The namespaces: psplan-w (the workers, 10.77.0.1), psplan-s0.. (shard s,
# 10.77.0.10+s), each with eth0 to a bridge in psplan-br.
net_up() { # SHARDS
  local n i
  ip netns add psplan-br && ns_made+=(psplan-br)
  ip -n psplan-br link add br0 type bridge
  ip -n psplan-br link set br0 up
  local hosts=(w)
  for ((i = 0; i < $1; i++)); do hosts+=("s$i"); done
  for n in "${hosts[@]}"; do
    ip netns add "psplan-$n" && ns_made+=("psplan-$n")
    ip link add "pp-$n" type veth peer name eth0 netns "psplan-$n"
    ip link set "pp-$n" netns psplan-br
    ip -n psplan-br link set "pp-$n" master br0 up
    if [ "$n" = w ]; then i=1; else i=$((10 + ${n#s})); fi
    ip -n "psplan-$n" addr add "10.77.0.$i/24" dev eth0
    ip -n "psplan-$n" link set eth0 up
    ip -n "psplan-$n" link set lo up
  done
}
net_down() {
  for n in "${ns_made[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ns_made=()
}
# shape GBIT RTT_MS: every host's eth0 at GBIT each way, with half the round
# trip added each way (netem). A kernel without netem gets a token bucket
# (tbf) for the rate and no added delay: shape then sets rtt to the round
# trip measured between the namespaces.
shape() {
  local n
  rtt=$2
  for n in "${ns_made[@]}"; do
    [ "$n" = psplan-br ] && continue
    if [ "$netem" = 1 ]; then
      ip netns exec "$n" tc qdisc replace dev eth0 root netem rate "${1}gbit" \
        delay "$(python3 -c "print($2 / 2)")ms" limit 100000
    else
      ip netns exec "$n" tc qdisc replace dev eth0 root tbf rate "${1}gbit" burst 1mb latency 20ms
    fi
  done
  if [ "$netem" != 1 ]; then
    rtt=$(ip netns exec psplan-w ping -c 20 -i 0.01 -q 10.77.0.10 | sed -n 's|.*= [0-9.]*/\([0-9.]*\)/.*|\1|p')
  fi
}

links() {
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "links: skipped: needs root, ip and tc (iproute2) for network namespaces"
    return 0
  fi
  echo "links: network namespaces, tc netem on every host's link ($cores cores shared, $secs s per run)"
  header
  local P=1000000 S W g want rtts
  job "$P"
  netem=1
  ip netns add psplan-probe && ns_made+=(psplan-probe)
  ip -n psplan-probe link add p0 type veth peer name p1
  ip netns exec psplan-probe tc qdisc add dev p0 root netem delay 1ms 2>/dev/null || netem=0
  net_down
  rtts="0.2 1"
  if [ "$netem" != 1 ]; then
    echo "(no netem in this kernel: links limited by tbf, no delay added; the round trip is measured)"
    rtts=measured
  fi
  for S in 1 2; do
    net_up "$S"
    srv_ns=1 wk_ns=1
    for g in 1 10; do
      for want in $rtts; do
        shape "$g" "${want/measured/0}"
        servers "$S" "$P"
        for W in 4 16; do
          measure "net-$S-$g-$rtt-$W" "$W" 0
          row "net-$S-$g-$rtt-$W" "$P" "$S" "$W" 0 --link-gbit "$g" --rtt-ms "$rtt" \
            --net-us-per-mb "${PLAN_NET_US_PER_MB:-250}"
        done
        stop_servers
      done
    done
    unset srv_ns wk_ns
    net_down
  done
  summary
}

case "$what" in
  --calibrate) calibrate ;;
  --loopback) loopback ;;
  --links) links ;;
  all) loopback; links ;;
  *) echo "plan_check.sh: unknown mode '$what'" >&2; exit 2 ;;
esac

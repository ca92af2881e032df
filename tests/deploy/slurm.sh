#!/usr/bin/env bash
# deploy/slurm/ps-job.sbatch against a real Slurm made here for the test:
# a private slurm.conf, munged with a key of its own, slurmctld and slurmd
# in the foreground. Two nodes, n1 and n2, each a network namespace with
# a slurmd (its own /etc/hosts and host name in a mount and UTS namespace),
# slurmctld in a third one, joined by a bridge (198.18.0.0/24); where
# namespaces cannot be made (or PS_SLURM_NODES=1), one node, localhost.
#   tests/deploy/slurm.sh BUILD_DIR
# Checks:
# 1. a bad option (PS_SERVERS=0): the job exits 2 and says why;
# 2. tests/integration/jobs/synthetic.json with 2 servers and 2 workers over
#    mutual TLS (certificates made for the nodes' names): the job exits 0,
#    every task ran where the plan puts it, the chief's final test accuracy
#    is >= 0.9, every task wrote its log and metrics;
# 3. stop and resubmit: a longer run with leases, --checkpoint-dir and
#    1-second sets is stopped, once a set exists, by SIGTERM to the batch
#    script (scancel --batch --signal=TERM): the workers leave, the servers
#    write their final checkpoints; the same command submitted again
#    restores them (`checkpoint: restored`, the lease epoch) and finishes
#    with accuracy >= 0.9;
# 4. requeue: the same run, requeued by Slurm (`scontrol requeue`, which
#    kills every process of the job) once a set exists, runs again under
#    the same job id, restores from its checkpoints, and completes.
# Exits 77 (skipped) when not root or Slurm/munge are not installed (Debian:
# slurm-wlm and munge, see deploy/install-deps.sh --tests). Nothing under /etc/slurm
# nor a system Slurm is touched: SLURM_CONF points at the private
# configuration. Every wait is bounded; everything started here is stopped
# on exit; the files go too, unless the test fails or PS_SLURM_KEEP is set.
set -uo pipefail
build=$(cd "${1:?usage: slurm.sh BUILD_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
script=$root/deploy/slurm/ps-job.sbatch
skip() { echo "SKIPPED: $*"; exit 77; }

[ "$(id -u)" -eq 0 ] || skip "needs root (slurmd runs the jobs' tasks, here as root)"
missing=()
for c in slurmctld slurmd sbatch srun scontrol sinfo squeue scancel munged python3; do
  command -v "$c" >/dev/null || missing+=("$c")
done
[ ${#missing[@]} -eq 0 ] \
  || skip "not installed: ${missing[*]} (Debian: slurm-wlm and munge; deploy/install-deps.sh --tests installs them)"
[ -x "$build/ps-server" ] && [ -x "$build/ps-worker" ] || { echo "FAIL: no ps-server/ps-worker in $build" >&2; exit 1; }

tag="ps$$"
out=$(mktemp -d /tmp/ps-it-slurm.XXXXXX)
chmod 755 "$out" # munged wants its socket's directories searchable by all
conf=$out/etc/slurm.conf
export SLURM_CONF=$conf
unset SLURM_JOB_ID SLURM_JOBID SLURM_JOB_NODELIST SLURM_NODELIST PS_TOKEN_FILE
mode=netns
ctl="$tag-ctl" nodes=() node_ns=() pids=() munged_pid="" ctld_pid=""
in_ctl=() # the prefix that runs a command where slurmctld is reachable

stop_pid() { # PID: SIGTERM, up to 5 s, then SIGKILL
  local p=$1 i
  kill -TERM "$p" 2>/dev/null || return 0
  for i in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null
  wait "$p" 2>/dev/null
}
cleanup() {
  set +e
  if [ -n "$ctld_pid" ] && kill -0 "$ctld_pid" 2>/dev/null; then
    jobs=$("${in_ctl[@]}" squeue -h -o %i 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$jobs" ] && "${in_ctl[@]}" scancel $jobs 2>/dev/null
    for _ in $(seq 1 40); do
      [ -z "$("${in_ctl[@]}" squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for p in "${pids[@]}"; do stop_pid "$p"; done
  [ -n "$ctld_pid" ] && stop_pid "$ctld_pid"
  [ -n "$munged_pid" ] && stop_pid "$munged_pid"
  # What the cluster started and outlived it (slurmstepd, tasks): in our
  # namespaces, or with our configuration in their environment.
  if [ "$mode" = netns ]; then
    for ns in "${node_ns[@]}" "$ctl"; do
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    done
  fi
  for e in $(grep -lzxF "SLURM_CONF=$conf" /proc/[0-9]*/environ 2>/dev/null); do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" != $$ ] && kill -KILL "$p" 2>/dev/null
  done
  if [ "${passed:-0}" = 1 ] && [ -z "${PS_SLURM_KEEP:-}" ]; then rm -rf "$out"; else echo "slurm: files kept in $out" >&2; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  # The run that failed first (its workers' progress, then its servers'
  # restores), then every log's tail.
  if [ -n "${run:-}" ]; then
    for f in "$out/$run"/worker-*.log; do
      [ -f "$f" ] && { echo "--- $f (progress)"; grep -E "step|restored|accuracy|error" "$f" | tail -n 25; }
    done
    grep -h "restored\|error" "$out/$run"/server-*.log 2>/dev/null | tail -n 8
  fi >&2
  for f in "$out"/*.out "$out"/*/*.log "$out"/log/*.log; do
    [ -f "$f" ] && { echo "--- $f"; tail -n 12 "$f"; }
  done >&2
  exit 1
}
# wait_until SECONDS WHAT COMMAND...: poll every 0.5 s.
wait_until() {
  local secs=$1 what=$2 i
  shift 2
  for ((i = 0; i < secs * 2; i++)); do "$@" && return 0; sleep 0.5; done
  fail "$what: not within $secs s"
}
final_accuracy() { sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$1" 2>/dev/null | tail -1; }
at_least() { python3 -c "import sys; sys.exit(0 if float('$1') >= float('$2') else 1)"; }
job_field() { "${in_ctl[@]}" scontrol show job "$1" 2>/dev/null | grep -o "$2=[^ ]*" | head -1 | cut -d= -f2; }

mkdir -p "$out/etc" "$out/state" "$out/spool" "$out/log" "$out/munge" "$out/bin"
# The jobs run copies of the programs (a build going on beside the test
# rewrites BUILD_DIR's); a copy made while the linker writes is taken again.
copied() {
  cp "$build/ps-server" "$build/ps-worker" "$out/bin/" 2>/dev/null \
    && "$out/bin/ps-server" --help >/dev/null 2>&1 && "$out/bin/ps-worker" --help >/dev/null 2>&1
}
wait_until 60 "a working copy of $build/ps-server and ps-worker" copied

# The network: a bridge in ctl's namespace, a veth to each node's.
if [ "${PS_SLURM_NODES:-2}" = 1 ] || ! command -v nsenter >/dev/null || ! command -v unshare >/dev/null \
   || ! ip netns add "$ctl" 2>"$out/netns.err"; then
  mode=single
  echo "slurm: one node (localhost)$([ -s "$out/netns.err" ] && echo ": no network namespaces here: $(cat "$out/netns.err")")"
else
  node_ns=("$tag-n1" "$tag-n2")
  nodes=(n1 n2)
  printf '127.0.0.1 localhost\n198.18.0.1 slurmctl\n198.18.0.11 n1\n198.18.0.12 n2\n' >"$out/etc/hosts"
  ip -n "$ctl" link set lo up && ip -n "$ctl" link add br0 type bridge && ip -n "$ctl" link set br0 up \
    && ip -n "$ctl" addr add 198.18.0.1/24 dev br0 || fail "the bridge"
  for k in 1 2; do
    ns="$tag-n$k"
    ip netns add "$ns" || fail "ip netns add $ns"
    ip link add "$tag-v$k" type veth peer name "$tag-e$k" || fail "veth"
    ip link set "$tag-v$k" netns "$ctl" && ip link set "$tag-e$k" netns "$ns" || fail "veth to namespaces"
    ip -n "$ctl" link set "$tag-v$k" master br0 && ip -n "$ctl" link set "$tag-v$k" up || fail "bridge port"
    ip -n "$ns" addr add "198.18.0.1$k/24" dev "$tag-e$k" && ip -n "$ns" link set "$tag-e$k" up \
      && ip -n "$ns" link set lo up || fail "node $k's link"
  done
fi
# $out/host NS NAME COMMAND...: COMMAND in network namespace NS as host
# NAME, with the private /etc/hosts (mount and UTS namespaces of its own;
# nsenter rather than ip netns exec, which would hide /sys/fs/cgroup that
# slurmd looks at).
cat >"$out/host" <<'EOF'
#!/bin/sh
ns=$1 name=$2 hosts=$(dirname "$0")/etc/hosts
shift 2
exec nsenter --net="/run/netns/$ns" unshare --mount --uts -- \
  sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' sh "$hosts" "$name" "$@"
EOF
chmod 755 "$out/host"
if [ "$mode" = netns ]; then
  in_ctl=("$out/host" "$ctl" slurmctl)
  ctld_host="slurmctl(198.18.0.1)" ctld_port=6817 slurmd_port=6818 port=5000
  node_lines="NodeName=n1 NodeAddr=198.18.0.11 CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=198.18.0.12 CPUs=2 State=UNKNOWN"
else
  nodes=(localhost)
  # Free ports: slurmctld, slurmd, and two consecutive ones for the servers.
  read -r ctld_port slurmd_port port < <(python3 - <<'PY'
import random, socket
def free(p):
    s = socket.socket()
    try: s.bind(("127.0.0.1", p)); return True
    except OSError: return False
    finally: s.close()
while True:
    a, b, c = random.sample(range(20000, 60000, 2), 3)
    if free(a) and free(b) and free(c) and free(c + 1): print(a, b, c); break
PY
)
  ctld_host=localhost
  node_lines="NodeName=localhost CPUs=2 State=UNKNOWN"
fi
nn=${#nodes[@]}

# munged with a key of its own, on a socket of its own.
(umask 077; head -c 1024 /dev/urandom >"$out/munge/munge.key")
munged -F --socket="$out/munge/socket" --key-file="$out/munge/munge.key" --log-file="$out/log/munged.log" \
  --pid-file="$out/munge/munged.pid" --seed-file="$out/munge/seed" >"$out/log/munged.out" 2>&1 &
munged_pid=$!
wait_until 10 "munged's socket" test -S "$out/munge/socket"

cat >"$conf" <<EOF
ClusterName=pstest
SlurmctldHost=$ctld_host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$out/munge/socket
StateSaveLocation=$out/state
SlurmdSpoolDir=$out/spool/%n
SlurmctldPidFile=$out/state/slurmctld.pid
SlurmdPidFile=$out/spool/slurmd-%n.pid
SlurmctldLogFile=$out/log/slurmctld.log
SlurmdLogFile=$out/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=8
MinJobAge=600
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
for n in "${nodes[@]}"; do mkdir -p "$out/spool/$n"; done
if [ "$mode" = netns ]; then
  "$out/host" "$ctl" slurmctl slurmctld -D -f "$conf" >"$out/log/slurmctld.out" 2>&1 &
  ctld_pid=$!
  for k in 1 2; do
    "$out/host" "$tag-n$k" "n$k" slurmd -D -f "$conf" -N "n$k" >"$out/log/slurmd-n$k.out" 2>&1 &
    pids+=($!)
  done
else
  slurmctld -D -f "$conf" >"$out/log/slurmctld.out" 2>&1 &
  ctld_pid=$!
  slurmd -D -f "$conf" -N localhost >"$out/log/slurmd-localhost.out" 2>&1 &
  pids+=($!)
fi
all_idle() {
  local st
  st=$("${in_ctl[@]}" sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | wc -l)
  [ "$st" -eq "$nn" ]
}
wait_until 60 "all $nn node(s) idle in sinfo" all_idle
echo "slurm: $("${in_ctl[@]}" sinfo -V) up: $nn node(s) ${nodes[*]} idle ($mode)"

# sub ARGS...: sbatch from $out on all nodes; prints the job id.
sub() { (cd "$out" && "${in_ctl[@]}" sbatch --parsable --nodes="$nn" "$@"); }
synthetic=$root/tests/integration/jobs/synthetic.json

# 1. A bad option (from the environment, as sbatch passes it on).
rc=0
(cd "$out" && PS_SERVERS=0 timeout 120 "${in_ctl[@]}" sbatch --wait --nodes="$nn" -o "$out/bad.out" "$script" \
  --job "$synthetic") >/dev/null || rc=$?
[ "$rc" = 2 ] || fail "a job with PS_SERVERS=0 exited $rc, not 2"
grep -q "must be at least 1" "$out/bad.out" || fail "no message for PS_SERVERS=0"
echo "slurm: PS_SERVERS=0: exit 2: $(grep -h "ps-job:" "$out/bad.out" | tail -1)"

# 2. The synthetic job over mutual TLS.
run=run1
start=$(date +%s)
rc=0
(cd "$out" && timeout 240 "${in_ctl[@]}" sbatch --wait --nodes="$nn" -o "$out/run1.out" "$script" \
  --job "$synthetic" --servers 2 --workers 2 --tls "$out/tls" --out "$out/run1" --bin "$out/bin" \
  --port "$port" -- --log-interval 1) >/dev/null || rc=$?
cat "$out/run1.out"
[ "$rc" = 0 ] || fail "the synthetic job exited $rc"
acc=$(final_accuracy "$out/run1/worker-0.log")
[ -n "$acc" ] || fail "no final accuracy in the chief's log"
at_least "$acc" 0.9 || fail "accuracy $acc below 0.9"
for i in 0 1; do
  want=${nodes[$((i % nn))]}
  grep -q "ps-launch: .* server $i on $want," "$out/run1/server-$i.log" || fail "server $i did not run on $want"
  want=${nodes[$(((2 + i) % nn))]}
  grep -q "ps-launch: .* worker $i on $want," "$out/run1/worker-$i.log" || fail "worker $i did not run on $want"
  for f in server-$i.jsonl worker-$i.jsonl; do [ -s "$out/run1/$f" ] || fail "no metrics $f"; done
  grep -q "stopped" "$out/run1/server-$i.log" || fail "server $i did not stop cleanly"
done
grep -q "mutual TLS" "$out/run1.out" || fail "the job did not run over TLS"
python3 -c "import json,sys; s=json.load(open(sys.argv[1])); assert len(s)==2 and all(x['version']>0 for x in s)" \
  "$out/run1/status.json" || fail "status.json: not the 2 shards' status"
echo "slurm: synthetic: exit 0, final test accuracy $acc in $(( $(date +%s) - start )) s"

# A longer run for 3 and 4: leases (shard 0's checkpoint holds the epoch),
# 20 epochs at 20 ms a step (about 15 s), a checkpoint set every second.
python3 - "$synthetic" "$out/long.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
# Momentum 0.5: this job checks stopping and resuming; with 0.9, two async
# workers (one straggling) could end a run at chance in any resumption.
j.update(job_id="slurm-resume", epochs=20, lease_chunk=128)
j["optimizer"]["momentum"] = 0.5
json.dump(j, open(sys.argv[2], "w"), indent=1)
PY
long=(--job "$out/long.json" --servers 2 --workers 2 --bin "$out/bin" --port "$port" --checkpoint-secs 1)
wargs=(-- --straggle-ms 20 --log-interval 1)
has_set() { # DIR: a complete set (both shards' files of one set)
  local f id
  for f in "$1"/shard-0-of-2-v*-s*.ckpt; do
    [ -e "$f" ] || continue
    id=${f##*-s}
    compgen -G "$1/shard-1-of-2-v*-s$id" >/dev/null && return 0
  done
  return 1
}
stop_files() { # DIR I: shard I's files written at a stop (no set id)
  local f b
  for f in "$1/shard-$2-of-2-v"*.ckpt; do
    b=${f##*/}
    [[ $b =~ ^shard-$2-of-2-v[0-9]+\.ckpt$ ]] && echo "$b"
  done
}
running() { [ "$(job_field "$1" JobState)" = RUNNING ]; }
ended() { case "$(job_field "$1" JobState)" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) return 0 ;; esac; return 1; }

# 3. SIGTERM to the batch script once a set exists, then the same command again.
run=run2
cmd=("$script" "${long[@]}" --out "$out/run2" --checkpoint-dir "$out/ckpt2" "${wargs[@]}")
jid=$(sub -o "$out/run2.out" "${cmd[@]}") || fail "sbatch"
wait_until 120 "job $jid: a checkpoint set" has_set "$out/ckpt2"
running "$jid" || fail "job $jid ended before it was stopped"
"${in_ctl[@]}" scancel --batch --signal=TERM "$jid" || fail "scancel --batch --signal=TERM $jid"
wait_until 90 "job $jid to end after SIGTERM" ended "$jid"
cat "$out/run2.out"
grep -q "SIGTERM while the workers ran" "$out/run2.out" || fail "the batch script did not see SIGTERM"
[ "$(stat -c %a "$out/run2/token")" = 600 ] || fail "the job token $out/run2/token is not mode 600"
for i in 0 1; do
  grep -q "SIGTERM: stopping" "$out/run2/server-$i.log" || fail "server $i got no SIGTERM"
  last=$(stop_files "$out/ckpt2" "$i" | tail -1)
  [ -n "$last" ] || fail "server $i wrote no checkpoint when stopped"
  grep -q "checkpoint: version .* written to .*/$last" "$out/run2/server-$i.log" || fail "no log of $last"
done
echo "slurm: job $jid stopped by SIGTERM: final checkpoints $(stop_files "$out/ckpt2" 0) $(stop_files "$out/ckpt2" 1)"
rc=0
(cd "$out" && timeout 240 "${in_ctl[@]}" sbatch --wait --nodes="$nn" -o "$out/run2.out" "${cmd[@]}") >/dev/null || rc=$?
[ "$rc" = 0 ] || fail "the resubmitted job exited $rc"
for i in 0 1; do
  grep -q "checkpoint: restored" "$out/run2/server-$i.log" || fail "server $i did not restore from the checkpoint"
done
restored=$(grep -h "checkpoint: restored" "$out/run2/server-0.log" | tail -1)
leases=$(grep -h "data leases restored" "$out/run2/server-0.log" | tail -1)
[ -n "$leases" ] || fail "shard 0 did not restore its leases"
acc=$(final_accuracy "$out/run2/worker-0.log")
[ -n "$acc" ] && at_least "$acc" 0.9 || fail "resubmitted: accuracy '$acc' below 0.9"
echo "slurm: resubmitted: ${restored#*info: }; ${leases#*info: }; final test accuracy $acc"

# 4. Slurm requeues the job once a set exists; it runs again and resumes.
run=run3
cmd=("$script" "${long[@]}" --out "$out/run3" --checkpoint-dir "$out/ckpt3" "${wargs[@]}")
jid=$(sub -o "$out/run3.out" "${cmd[@]}") || fail "sbatch"
wait_until 120 "job $jid: a checkpoint set" has_set "$out/ckpt3"
running "$jid" || fail "job $jid ended before the requeue"
"${in_ctl[@]}" scontrol requeue "$jid" || fail "scontrol requeue $jid"
pending() { [ "$(job_field "$1" JobState)" = PENDING ]; }
wait_until 60 "job $jid pending again after the requeue" pending "$jid"
# A requeued job waits (BeginTime) two minutes; let it start now.
"${in_ctl[@]}" scontrol update JobId="$jid" StartTime=now || fail "scontrol update StartTime=now"
wait_until 240 "requeued job $jid to end" ended "$jid"
cat "$out/run3.out"
state=$(job_field "$jid" JobState) ec=$(job_field "$jid" ExitCode) restarts=$(job_field "$jid" Restarts)
[ "$state" = COMPLETED ] && [ "$ec" = 0:0 ] || fail "requeued job $jid: $state, exit code $ec"
[ "$restarts" = 1 ] || fail "job $jid restarted $restarts times, not 1"
grep -q "(restart 1)" "$out/run3.out" || fail "the batch script did not run again as restart 1"
for i in 0 1; do
  grep -q "checkpoint: restored" "$out/run3/server-$i.log" || fail "server $i did not restore after the requeue"
done
restored=$(grep -h "checkpoint: restored" "$out/run3/server-0.log" | tail -1)
acc=$(final_accuracy "$out/run3/worker-0.log")
[ -n "$acc" ] && at_least "$acc" 0.9 || fail "requeued: accuracy '$acc' below 0.9"
echo "slurm: requeued job $jid ran again (restart 1): ${restored#*info: }; final test accuracy $acc"
passed=1
echo "PASS: deploy.slurm"

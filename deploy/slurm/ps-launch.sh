#!/usr/bin/env bash
# One task of a job that deploy/slurm/ps-job.sbatch runs: srun starts this
# on every task of the server step and of the worker step.
#
#   ps-launch.sh server                 shard SLURM_PROCID
#   ps-launch.sh worker [-- ARGS...]    worker SLURM_PROCID (ARGS go to ps-worker; %k: its index)
#   ps-launch.sh addresses              print the servers' address list
#   ps-launch.sh hosts server|worker    print where each task goes, one node a line
#                                       (the SLURM_HOSTFILE of the step)
#
# Placement, computed identically by every task from SLURM_JOB_NODELIST
# (`scontrol show hostnames`: the N nodes in allocation order), PS_SERVERS
# (S) and PS_PORT (the base port P):
#   server i runs on node[i % N] and listens on port P + i / N, so shards on
#     one node (S > N) get consecutive ports;
#   worker k runs on node[(S + k) % N] (the workers start where the servers
#     left off).
# A task that finds itself on another node than the plan says exits 2.
#
# The rest comes from the environment the batch script exports: PS_BIN,
# PS_JOB, PS_WORKERS, PS_OUT (logs: OUT/server-i.log, OUT/worker-k.log,
# appended to; metrics: OUT/server-i.jsonl, OUT/worker-k.jsonl),
# PS_TOKEN_FILE, PS_TLS (a deploy/certs.sh directory with NODE.pem and
# NODE.key for every node; empty: plaintext), PS_CHECKPOINT_DIR,
# PS_CHECKPOINT_SECS, PS_SERVER_ARGS (more ps-server flags, split at spaces).
set -euo pipefail
role=${1:-}
shift || true
[ "${1:-}" = -- ] && shift

die() { echo "ps-launch: $*" >&2; exit 2; }

[ -n "${SLURM_JOB_NODELIST:-}" ] || die "SLURM_JOB_NODELIST is not set (run inside a Slurm job)"
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
n=${#hosts[@]}
[ "$n" -ge 1 ] || die "no nodes in SLURM_JOB_NODELIST '$SLURM_JOB_NODELIST'"
S=${PS_SERVERS:?PS_SERVERS is not set}
W=${PS_WORKERS:-0}
P=${PS_PORT:-5000}

server_host() { echo "${hosts[$(($1 % n))]}"; }
server_port() { echo $((P + $1 / n)); }
worker_host() { echo "${hosts[$(((S + $1) % n))]}"; }
addresses() {
  local i list=""
  for ((i = 0; i < S; i++)); do list+="${list:+,}$(server_host "$i"):$(server_port "$i")"; done
  echo "$list"
}

case "$role" in
addresses) addresses; exit 0 ;;
hosts)
  case "${1:-}" in
  server) for ((i = 0; i < S; i++)); do server_host "$i"; done ;;
  worker) for ((k = 0; k < W; k++)); do worker_host "$k"; done ;;
  *) die "hosts: server or worker" ;;
  esac
  exit 0 ;;
server | worker) ;;
*) die "usage: ps-launch.sh server|worker [-- WORKER-ARGS] | addresses | hosts server|worker" ;;
esac

i=${SLURM_PROCID:?SLURM_PROCID is not set (run by srun)}
node=${SLURMD_NODENAME:-$(hostname -s)}
if [ "$role" = server ]; then want=$(server_host "$i"); else want=$(worker_host "$i"); fi
[ "$node" = "$want" ] || die "$role $i runs on $node, but the plan puts it on $want (srun did not follow SLURM_HOSTFILE)"
bin=${PS_BIN:?PS_BIN is not set}
out=${PS_OUT:?PS_OUT is not set}
mkdir -p "$out"
ps=$(addresses)
if [ -n "${PS_TLS:-}" ]; then
  [ -f "$PS_TLS/$node.pem" ] || die "no certificate $PS_TLS/$node.pem for this node (deploy/certs.sh $PS_TLS $node)"
  server_sec=(--tls-cert "$PS_TLS/$node.pem" --tls-key "$PS_TLS/$node.key" --tls-ca "$PS_TLS/ca.pem"
              --tls-require-client-cert)
  client_sec=(--tls-ca "$PS_TLS/ca.pem" --tls-cert "$PS_TLS/$node.pem" --tls-key "$PS_TLS/$node.key")
else
  server_sec=(--insecure) client_sec=(--insecure)
fi
export PS_TOKEN_FILE=${PS_TOKEN_FILE:?PS_TOKEN_FILE is not set}

log="$out/$role-$i.log"
exec >>"$log" 2>&1
echo "ps-launch: $(date '+%F %T') $role $i on $node, job ${SLURM_JOB_ID:-?} step ${SLURM_STEP_ID:-?}" \
  "(restart ${SLURM_RESTART_COUNT:-0}); servers $ps"

if [ "$role" = server ]; then
  args=(--job "$PS_JOB" --ps "$ps" --index "$i" --listen "0.0.0.0:$(server_port "$i")"
        --metrics "$out/server-$i.jsonl")
  if [ -n "${PS_CHECKPOINT_DIR:-}" ]; then
    args+=(--checkpoint-dir "$PS_CHECKPOINT_DIR" --checkpoint-secs "${PS_CHECKPOINT_SECS:-30}")
  fi
  # shellcheck disable=SC2206 # split at spaces, like the systemd units' PS_SERVER_ARGS
  extra=(${PS_SERVER_ARGS:-})
  exec "$bin/ps-server" "${server_sec[@]}" "${args[@]}" "${extra[@]}"
fi

# A worker: compute threads shared among the workers on this node, unless
# the arguments say.
extra=("${@//%k/$i}")
threads=()
if [[ " ${extra[*]} " != *" --threads "* && " ${extra[*]} " != *" --threads="* ]]; then
  here=0
  for ((k = 0; k < W; k++)); do
    if [ "$(worker_host "$k")" = "$node" ]; then here=$((here + 1)); fi
  done
  cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
  t=$((cpus / (here > 0 ? here : 1))); [ "$t" -ge 1 ] || t=1
  threads=(--threads "$t")
fi
exec "$bin/ps-worker" "${client_sec[@]}" --ps "$ps" --index "$i" --num-workers "$W" \
  --metrics "$out/worker-$i.jsonl" "${threads[@]}" "${extra[@]}"

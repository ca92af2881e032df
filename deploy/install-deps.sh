#!/usr/bin/env bash
# Installs the Debian packages the build and the quickstart need; with
# --tests also those only the tests use (Prometheus, Slurm and munge, the
# package and man page tools, venv, NumPy and PyTorch); and any named on the
# command line (tests/fuzz/run.sh asks for clang). Idempotent: quiet when
# everything is already there. Uses sudo when not root. Services that
# Debian's packages enable and start on a systemd host (prometheus, munge,
# slurmctld, slurmd) are stopped and disabled again when this script
# installed them: the tests start their own.
#   deploy/install-deps.sh [--tests] [PACKAGE...]
set -euo pipefail

tests=()
if [ "${1:-}" = --tests ]; then
  shift
  tests=(
    python3-venv                          # the tensorboard and Kubernetes checks' venvs
    prometheus                            # integration.prometheus
    dpkg-dev file help2man                # deploy.deb: cpack -G DEB, Depends:, man pages
    patchelf                              # gpu.bundle: the GPU bundle's RUNPATHs
    slurmctld slurmd slurm-client munge   # deploy.slurm: a Slurm cluster of its own
    python3-numpy python3-torch           # python.*: Python workers (NumPy, PyTorch's CPU build)
  )
fi
packages=(
  cmake gcc make pkg-config
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
  libuv1-dev libopenblas-dev libjansson-dev zlib1g-dev libmicrohttpd-dev
  libdnnl-dev                           # the oneDNN cpu backend (optional for the build)
  dataset-fashion-mnist
  iproute2 iputils-ping iperf3 gnuplot-nox python3 openssl
  "${tests[@]}"
  "$@"
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
  for svc in prometheus munge slurmctld slurmd; do
    case " ${missing[*]} " in *" $svc "*) $sudo systemctl disable --now "$svc" >/dev/null 2>&1 || true ;; esac
  done
fi
echo "install-deps: done"

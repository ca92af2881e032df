#!/usr/bin/env bash
# Installs the Debian packages the build, the tests and the quickstart need,
# and any named on the command line (tests/fuzz/run.sh asks for clang).
# Idempotent: quiet when everything is already there. Uses sudo when not root.
#   deploy/install-deps.sh [PACKAGE...]
set -euo pipefail

packages=(
  cmake gcc make pkg-config
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
  libuv1-dev libopenblas-dev libjansson-dev zlib1g-dev libmicrohttpd-dev
  dpkg-dev file help2man   # cpack -G DEB (Depends: from dpkg-shlibdeps) and the man pages
  dataset-fashion-mnist
  iproute2 iperf3 gnuplot-nox python3 python3-venv openssl prometheus
  slurmctld slurmd slurm-client munge   # tests/deploy/slurm.sh: a Slurm cluster of its own
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
echo "install-deps: done"

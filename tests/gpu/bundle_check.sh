#!/usr/bin/env bash
# Proves here, without a GPU, that the GPU bundle runs on a machine that
# has none of this project's dependencies:
#  1. tests/gpu/bundle_libs.py follows every library each bundled program
#     loads, as the dynamic loader would there, and refuses one found
#     neither in the bundle nor on its list of system and CUDA libraries;
#  2. then every program is started (--help, or no arguments) in a private
#     mount namespace in which the system's library folder holds nothing but
#     those system libraries (a tmpfs over it with copies of them), with
#     LD_LIBRARY_PATH set as tests/gpu/on_device.sh sets it (CUDA's folder
#     alone): the loader must find every other library in the bundle.
# Part 2 is skipped (exit 77, when part 1 passed) without root or unshare.
#   tests/gpu/bundle_check.sh BUNDLE.tar.xz|BUNDLE.tar
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tarball=$(cd "$(dirname "${1:?usage: bundle_check.sh BUNDLE.tar[.xz]}")" && pwd)/$(basename "$1")
work=$(mktemp -d /tmp/ps-bundle-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xf "$tarball"
cuda_lib=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [ -d "$d" ] && cuda_lib="$cuda_lib:$d"; done
cuda_lib=${cuda_lib#:}
static=0
PS_BUNDLE_LD_LIBRARY_PATH=$cuda_lib python3 "$root/tests/gpu/bundle_libs.py" "$work" || static=1

if [ "$(id -u)" -ne 0 ] || ! command -v unshare >/dev/null; then
  echo "bundle_check: SKIPPED the loading test: it needs root and unshare (a mount namespace)"
  [ "$static" = 0 ] || exit 1
  exit 77
fi
# The system libraries the loader may still find: the list of bundle_libs.py.
libdir=$(dirname "$(readlink -f /lib64/ld-linux-x86-64.so.2)")
keep=(libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 ld-linux-x86-64.so.2
      libstdc++.so.6 libgcc_s.so.1 libresolv.so.2 libutil.so.1)
mkdir -p "$work/keep"
for l in "${keep[@]}"; do [ -e "$libdir/$l" ] && cp -L "$libdir/$l" "$work/keep/"; done
# Inside the namespace only dash's builtins and the bundle's programs run
# after the bind mount (dash needs libc alone; grep or cp would not load):
# each program's output and exit status are read here after. A program that
# cannot load says "error while loading shared libraries" and exits 127.
mkdir -p "$work/ran"
cat >"$work/inside.sh" <<EOF
mount --make-rprivate / && mount --bind "$work/keep" "$libdir" || exit 3
export LD_LIBRARY_PATH="$cuda_lib"
for p in "$work"/bin/*; do
  n=\${p##*/}
  "\$p" --help >"$work/ran/\$n.out" 2>&1 </dev/null
  echo \$? >"$work/ran/\$n.rc"
done
EOF
unshare -m /bin/sh "$work/inside.sh" || { echo "bundle_check: the mount namespace could not be set up" >&2; exit 1; }
fails=0
for p in "$work"/bin/*; do
  n=$(basename "$p")
  rc=$(cat "$work/ran/$n.rc" 2>/dev/null || echo none)
  if [ "$rc" = none ] || [ "$rc" = 127 ] || grep -q "error while loading shared libraries" "$work/ran/$n.out"; then
    echo "bundle_check: $n does not load without the system's libraries (exit $rc):"
    head -5 "$work/ran/$n.out"
    fails=$((fails + 1))
  else
    echo "bundle_check: $n loads (exit $rc) with only the system's C runtime and CUDA's libraries"
  fi
done
if [ "$fails" -gt 0 ] || [ "$static" != 0 ]; then
  echo "bundle_check: FAILED: $fails program(s) do not load; the libraries' walk $([ "$static" = 0 ] && echo passed || echo failed)" >&2
  exit 1
fi
echo "bundle_check: every program of the bundle loads on a machine without this project's dependencies"

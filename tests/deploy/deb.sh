#!/usr/bin/env bash
# deploy.deb: the Debian package, built, installed for real and run.
#   tests/deploy/deb.sh BUILD_DIR
# - Builds the package: a CPU-only build (WITH_CUDA=OFF, RelWithDebInfo,
#   prefix /usr) in BUILD_DIR/deb-build, kept between runs (a later run
#   rebuilds what changed), of the programs and their man pages, then
#   `cpack -G DEB`.
# - Its control fields: Depends (from dpkg-shlibdeps) names libgrpc,
#   libprotobuf-c, libuv, libjansson, OpenBLAS (or a BLAS) and
#   libmicrohttpd; Recommends dataset-fashion-mnist; the description says
#   the build is for the CPU.
# - Installs it with dpkg into a scratch root, not onto this machine:
#   `dpkg --root=DIR -i` with dpkg's database in DIR, the maintainer scripts
#   run outside a chroot with DPKG_ROOT=DIR (--force-script-chrootless, as
#   Debian's bootstrap tools do; the postinst makes the user `ps` in
#   DIR/etc/passwd), --force-depends since DIR holds no libraries (the
#   programs run with this machine's).
# - From the installed files alone: ps-server, ps-worker, ps-export, ps-import-keras, ps-ctr-gen,
#   ps-stale, ps-loadgen and ps-plan
#   --help exit 0; each man page shows every flag of its program's --help;
#   the units run the installed programs and, where systemd-analyze is
#   installed, pass `systemd-analyze verify` (ExecStart pointed into DIR, as
#   deploy/systemd/verify.sh does); the installed local-cluster.sh, without
#   --bin, trains the installed jobs/synthetic.json on 2 servers and 2
#   workers on loopback (plaintext, --insecure) to a final test accuracy of
#   0.90 or more.
# - `dpkg --root=DIR -r` removes every file again.
# Skipped (77) without root, dpkg, cpack or dpkg-shlibdeps. Every wait is
# bounded; whatever it starts is stopped on exit.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:?usage: deb.sh BUILD_DIR}" && pwd)
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAIL: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || skip "not root (dpkg installs as root, here into a scratch root)"
for tool in dpkg dpkg-deb dpkg-query cpack; do
  command -v "$tool" >/dev/null || skip "no $tool (Debian: apt-get install dpkg cmake)"
done
command -v dpkg-shlibdeps >/dev/null \
  || skip "no dpkg-shlibdeps, which makes Depends: (Debian: apt-get install dpkg-dev)"
command -v file >/dev/null || skip "no file, which cpack needs for Depends: (apt-get install file)"

tmp=$(mktemp -d /tmp/ps-deb.XXXXXX)
dest=$tmp/root
bg=()
cleanup() {
  for p in "${bg[@]}"; do kill "$p" 2>/dev/null || true; done
  # Anything still running a program of the scratch root, by its pid.
  local exe pid
  for exe in /proc/[0-9]*/exe; do
    pid=${exe#/proc/}; pid=${pid%/exe}
    case "$(readlink "$exe" 2>/dev/null)" in "$dest"/*) kill -9 "$pid" 2>/dev/null || true ;; esac
  done
  rm -rf "$tmp"
}
trap cleanup EXIT

# ---- the package ----
debb=$build/deb-build
prefix=/usr
echo "deb: building in $debb"
timeout 120 cmake -S "$root" -B "$debb" -DWITH_CUDA=OFF -DPS_WERROR=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX="$prefix" \
  -DCMAKE_SKIP_INSTALL_ALL_DEPENDENCY=ON >"$tmp/configure.log" 2>&1 \
  || { tail -30 "$tmp/configure.log"; fail "cmake configure of $debb failed"; }
timeout 600 cmake --build "$debb" -j"$(nproc)" --target ps-server ps-worker ps-export ps-import-keras ps-ctr-gen ps-stale ps-loadgen ps-plan ps_man \
  >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log"; fail "the build in $debb failed"; }
pkg=$(sed -n 's/^set(CPACK_PACKAGE_NAME "\(.*\)")$/\1/p' "$debb/CPackConfig.cmake")
[ -n "$pkg" ] || fail "no CPACK_PACKAGE_NAME in $debb/CPackConfig.cmake"
rm -f "$debb/${pkg}"_*.deb
(cd "$debb" && timeout 180 cpack -G DEB) >"$tmp/cpack.log" 2>&1 \
  || { tail -30 "$tmp/cpack.log"; fail "cpack -G DEB failed"; }
debs=("$debb/${pkg}"_*.deb)
[ -f "${debs[0]}" ] && [ ${#debs[@]} -eq 1 ] || fail "cpack made no single ${pkg}_*.deb in $debb"
deb=${debs[0]}
echo "deb: $(basename "$deb"), $(stat -c %s "$deb") bytes"

# ---- its control fields ----
depends=$(dpkg-deb -f "$deb" Depends)
echo "deb: Depends: $depends"
for lib in 'libgrpc[0-9]' 'libprotobuf-c[0-9]' 'libuv1' 'libjansson[0-9]' \
           'libopenblas[0-9a-z-]*|libblas[0-9]' 'libmicrohttpd[0-9]'; do
  grep -Eq "(^|[,|] *)($lib)" <<<"$depends" || fail "Depends: names no $lib: $depends"
done
grep -q 'dataset-fashion-mnist' <<<"$(dpkg-deb -f "$deb" Recommends)" \
  || fail "Recommends: does not name dataset-fashion-mnist"
# (grep -q on a pipe would end it early: under pipefail, a SIGPIPE failure)
grep -q 'CPU' <<<"$(dpkg-deb -f "$deb" Description)" || fail "the description does not say CPU"
[ "$(dpkg-deb -f "$deb" Version)" = "$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' \
      "$debb/CPackConfig.cmake")" ] || fail "Version: is not the project's version"
for script in postinst prerm postrm; do
  dpkg-deb -I "$deb" "$script" >/dev/null 2>&1 || fail "no $script in the package"
done

# ---- installed into a scratch root ----
mkdir -p "$dest/var/lib/dpkg/info" "$dest/var/lib/dpkg/updates" "$dest/etc"
touch "$dest/var/lib/dpkg/status"
dpkg_root() {
  dpkg --root="$dest" --force-depends --force-script-chrootless --log=/dev/null "$@"
}
dpkg_root -i "$deb" >"$tmp/dpkg-i.log" 2>&1 || { cat "$tmp/dpkg-i.log"; fail "dpkg -i failed"; }
status=$(dpkg-query --admindir="$dest/var/lib/dpkg" -W -f='${Status}' "$pkg")
[ "$status" = "install ok installed" ] || { cat "$tmp/dpkg-i.log"; fail "$pkg is '$status'"; }
echo "deb: installed into $dest (dpkg --root): $status"
if command -v systemd-sysusers >/dev/null; then
  grep -q '^ps:' "$dest/etc/passwd" 2>/dev/null || fail "the postinst made no user ps"
  echo "deb: the postinst made the user: $(grep '^ps:' "$dest/etc/passwd")"
fi

p=$dest$prefix
expect=(bin/ps-server bin/ps-worker bin/ps-export bin/ps-import-keras bin/ps-ctr-gen bin/ps-stale
        bin/ps-loadgen bin/ps-plan share/ps/proto/ps.proto
        share/ps/proto/tb_event.proto share/ps/jobs/synthetic.json
        share/ps/grafana/ps-dashboard.json share/ps/scripts/certs.sh
        share/ps/scripts/local-cluster.sh lib/systemd/system/ps-server@.service
        lib/systemd/system/ps-worker@.service lib/sysusers.d/ps.conf
        share/doc/ps/examples/cluster.env)
for j in "$root"/deploy/jobs/*.json; do expect+=("share/ps/jobs/$(basename "$j")"); done
man=yes
if [ -z "$(sed -n 's/^HELP2MAN:FILEPATH=\(.*help2man\)$/\1/p' "$debb/CMakeCache.txt")" ]; then
  man=""
  echo "deb: NOTE: help2man was not installed for the build: no man pages to check"
else
  expect+=(share/man/man1/ps-server.1.gz share/man/man1/ps-worker.1.gz)
fi
for f in "${expect[@]}"; do [ -f "$p/$f" ] || fail "the package installed no $prefix/$f"; done
for f in bin/ps-server bin/ps-worker bin/ps-export bin/ps-import-keras bin/ps-ctr-gen bin/ps-stale \
         bin/ps-loadgen bin/ps-plan share/ps/scripts/local-cluster.sh \
         share/ps/scripts/certs.sh; do
  [ -x "$p/$f" ] || fail "$prefix/$f is not executable"
done
echo "deb: ${#expect[@]} files where they belong under $prefix"

# ---- the installed programs and man pages ----
for prog in ps-server ps-worker ps-export ps-import-keras ps-ctr-gen ps-stale ps-loadgen ps-plan; do
  timeout 30 "$p/bin/$prog" --help >"$tmp/$prog.help" 2>&1 \
    || { cat "$tmp/$prog.help"; fail "installed $prog --help did not exit 0"; }
done
if [ -n "$man" ]; then
  for prog in ps-server ps-worker; do
    page=$p/share/man/man1/$prog.1.gz
    if command -v man >/dev/null; then
      MANWIDTH=200 timeout 30 man -l "$page" 2>/dev/null | sed 's/.\x08//g' >"$tmp/$prog.man"
    else
      zcat "$page" | sed 's/\\-/-/g' >"$tmp/$prog.man"
    fi
    grep -q "^ *$prog - " "$tmp/$prog.man" || fail "$prog.1 has no NAME line"
    flags=$(grep -oE '^  --[a-z][a-z0-9-]*' "$tmp/$prog.help" | sed 's/^ *//' | sort -u)
    n=0
    for flag in $flags; do
      grep -qE -- "(^|[^a-z-])$flag([^a-z0-9-]|$)" "$tmp/$prog.man" \
        || fail "$prog.1 does not show $flag"
      n=$((n + 1))
    done
    [ "$n" -ge 10 ] || fail "$prog --help lists only $n flags"
    echo "deb: $prog.1 shows all $n flags of $prog --help"
  done
fi

# ---- the installed units ----
units=$p/lib/systemd/system
mkdir -p "$tmp/units"
for prog in ps-server ps-worker; do
  grep -q "^ExecStart=$prefix/bin/$prog --index %i " "$units/$prog@.service" \
    || fail "$prog@.service does not run $prefix/bin/$prog: $(grep '^ExecStart=' "$units/$prog@.service")"
  diff <(grep -v '^ExecStart=' "$root/deploy/systemd/$prog@.service") \
       <(grep -v '^ExecStart=' "$units/$prog@.service") >/dev/null \
    || fail "the installed $prog@.service differs from deploy/systemd's beyond ExecStart="
  # An instance (index 0) of the installed template, its program in the scratch root.
  sed "s|^ExecStart=$prefix/bin/|ExecStart=$p/bin/|" "$units/$prog@.service" \
    >"$tmp/units/$prog@0.service"
done
if command -v systemd-analyze >/dev/null; then
  (cd "$tmp/units" && timeout 60 systemd-analyze verify ps-server@0.service ps-worker@0.service) \
    >"$tmp/verify.out" 2>&1 || { cat "$tmp/verify.out"; fail "systemd-analyze verify failed"; }
  [ ! -s "$tmp/verify.out" ] || { cat "$tmp/verify.out"; fail "systemd-analyze verify warned"; }
  echo "deb: the installed units pass systemd-analyze verify"
else
  echo "deb: NOTE: no systemd-analyze: the installed units are not verified"
fi

# ---- a job, with the installed script, programs and job file ----
script=$p/share/ps/scripts/local-cluster.sh
# The script's own default for --bin, resolved as it resolves it.
# shellcheck disable=SC2154 # bin: set by the script's line, evaluated
default_bin=$(here=$(dirname "$script"); eval "$(grep -m1 -E '^job=.* bin=' "$script")"; \
              cd "$bin" 2>/dev/null && pwd -P) || true
[ "$default_bin" = "$(cd "$p/bin" && pwd -P)" ] \
  || fail "the installed local-cluster.sh looks for the programs in '$default_bin', not $prefix/bin"
command -v python3 >/dev/null || fail "no python3, which local-cluster.sh needs for free ports"
out=$tmp/cluster
start=$(date +%s)
env -u PS_TOKEN_FILE timeout -k 10 300 "$script" --job "$p/share/ps/jobs/synthetic.json" \
  --servers 2 --workers 2 --out "$out" --timeout 240 --threads 1 -- --log-interval 1 \
  >"$tmp/cluster.out" 2>&1 &
bg+=($!)
rc=0
wait "${bg[0]}" || rc=$?
bg=()
[ "$rc" -eq 0 ] || { tail -30 "$tmp/cluster.out"; fail "the installed local-cluster.sh exited $rc"; }
grep -q 'plaintext' "$tmp/cluster.out" || fail "the cluster was not plaintext (--insecure)"
acc=$(sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$out/worker-0.log" | tail -1)
[ -n "$acc" ] || { tail -20 "$out/worker-0.log"; fail "no final test accuracy in the chief's log"; }
awk -v a="$acc" 'BEGIN { exit !(a >= 0.90) }' || fail "final test accuracy $acc below 0.90"
echo "deb: the installed programs trained jobs/synthetic.json (2 servers, 2 workers):" \
  "final test accuracy $acc in $(( $(date +%s) - start )) s"

# ---- removed again ----
dpkg_root -r "$pkg" >"$tmp/dpkg-r.log" 2>&1 || { cat "$tmp/dpkg-r.log"; fail "dpkg -r failed"; }
left=""
[ ! -d "$dest$prefix" ] || left=$(find "$dest$prefix" -type f | head -5)
[ -z "$left" ] || fail "dpkg -r left files behind: $left"
echo "deb: dpkg -r removed every file"
echo "PASS: deploy.deb"

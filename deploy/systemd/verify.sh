#!/usr/bin/env bash
# Checks the systemd units here against a build:
#   deploy/systemd/verify.sh BUILD_DIR
# - `systemd-analyze verify` has nothing to say about either unit, with
#   ExecStart pointed at BUILD_DIR's programs (it only warns about an
#   unknown key or a value it cannot parse: a warning fails here);
# - the example cluster.env's flags are accepted by the programs;
# - what a unit does not restart (RestartPreventExitStatus) is its
#   program's exit code for a bad flag.
# Exits 77 (skipped) where systemd-analyze is not installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: verify.sh BUILD_DIR}" && pwd)
if ! command -v systemd-analyze >/dev/null; then
  echo "SKIPPED: systemd-analyze is not installed (Debian: apt-get install systemd)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

for prog in ps-server ps-worker; do
  # An instance of the template (index 0), running this build's program.
  sed "s|/usr/local/bin/|$build/|g" "$here/$prog@.service" >"$tmp/$prog@0.service"
  grep -q "^ExecStart=$build/$prog " "$tmp/$prog@0.service" \
    || fail "$prog@.service: ExecStart does not run /usr/local/bin/$prog"
done
(cd "$tmp" && timeout 60 systemd-analyze verify ps-server@0.service ps-worker@0.service) \
  >"$tmp/verify.out" 2>&1 || { cat "$tmp/verify.out"; fail "systemd-analyze verify failed"; }
[ ! -s "$tmp/verify.out" ] || { cat "$tmp/verify.out"; fail "systemd-analyze verify warned"; }
echo "verify: ps-server@.service and ps-worker@.service pass systemd-analyze verify" \
  "($(systemd-analyze --version | head -1))"

for prog in ps-server ps-worker; do
  var=PS_SERVER_ARGS
  [ "$prog" = ps-worker ] && var=PS_WORKER_ARGS
  # systemd splits an unquoted $VAR at white space, as read -a does.
  read -ra args <<<"$(sed -n "s/^$var=//p" "$here/cluster.env")"
  [ "${#args[@]}" -gt 0 ] || fail "cluster.env sets no $var"
  # Every flag parses (a bad one stops the parse before --help, exit 2).
  "$build/$prog" --index 0 "${args[@]}" --help >/dev/null \
    || fail "$prog does not accept cluster.env's $var: ${args[*]}"
  prevent=$(sed -n 's/^RestartPreventExitStatus=//p' "$here/$prog@.service")
  rc=0
  "$build/$prog" --no-such-flag >/dev/null 2>&1 || rc=$?
  [ "$rc" = "$prevent" ] \
    || fail "$prog exits $rc on a bad flag; $prog@.service does not restart on '$prevent'"
  echo "$prog: cluster.env's $var parse (${#args[@]} arguments); a bad flag exits $rc, which" \
    "$prog@.service does not restart"
done
echo "PASS: deploy/systemd"

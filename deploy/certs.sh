#!/usr/bin/env bash
# Makes the TLS material of a cluster with openssl: a CA, and for each host a
# certificate (for the names and addresses given, usable by a server and as
# a client certificate) and its key. Also the job's token, unless one is
# there already.
#
#   deploy/certs.sh DIR HOST[:PORT][,HOST...] ...
#
# Writes DIR/ca.pem (give it to every process: --tls-ca), DIR/ca.key (keep
# it off the cluster), DIR/HOST.pem and DIR/HOST.key for each host (the
# server on HOST: --tls-cert/--tls-key; a worker on HOST: the same for
# mutual TLS), and DIR/token (--token-file). Keys are mode 600. A host that
# looks like an IPv4 or IPv6 address goes in the certificate as an IP
# address, any other as a DNS name; "localhost" also gets 127.0.0.1 and ::1.
# Existing files are kept, so the command can be run again to add hosts.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
dir=$1; shift
command -v openssl >/dev/null || { echo "certs: openssl is not installed" >&2; exit 2; }
mkdir -p "$dir"
umask 077
days=825
if [ ! -f "$dir/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/CN=ps cluster CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
  echo "certs: made the CA $dir/ca.pem"
fi
if [ ! -f "$dir/token" ]; then
  head -c 32 /dev/urandom | base64 >"$dir/token"
  echo "certs: made the job token $dir/token"
fi
hosts=()
for arg in "$@"; do
  IFS=, read -r -a parts <<<"$arg"
  for h in "${parts[@]}"; do
    h=${h%:*[0-9]}      # host:port -> host (an IPv6 address comes in brackets)
    h=${h#[}; h=${h%]}
    [ -n "$h" ] && hosts+=("$h")
  done
done
for h in "${hosts[@]}"; do
  [ -f "$dir/$h.pem" ] && continue
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then
    san="IP:$h"
  else
    san="DNS:$h"
    [ "$h" = localhost ] && san="$san,IP:127.0.0.1,IP:::1"
  fi
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$h" \
    -keyout "$dir/$h.key" -out "$dir/$h.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
    "$san" >"$dir/$h.ext"
  openssl x509 -req -in "$dir/$h.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days "$days" -extfile "$dir/$h.ext" -out "$dir/$h.pem" 2>/dev/null
  rm -f "$dir/$h.csr" "$dir/$h.ext"
  echo "certs: $dir/$h.pem and $dir/$h.key ($san)"
done
chmod 644 "$dir/ca.pem" "$dir"/*.pem

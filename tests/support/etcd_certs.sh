#!/usr/bin/env bash
# Certificates for a test etcd with TLS, made with openssl (P-256 keys, valid two days):
#   etcd_certs.sh DIR IP...
#   DIR/ca.pem                      the CA etcd trusts and the clients verify etcd against
#   DIR/server.pem, server.key      etcd's, for every IP given (subjectAltName), serving and peering
#   DIR/client.pem, client.key      a client's, signed by that CA, with no Common Name (etcd 3.4's
#                                   JSON gateway refuses a certificate with one once its
#                                   authentication is on)
#   DIR/named.pem, named.key        a client's signed by that CA, with the Common Name trainer
#   DIR/other-ca.pem                a CA that signed nothing etcd knows
#   DIR/stranger.pem, stranger.key  a client's signed by that other CA
set -euo pipefail
dir=$1
shift
(($# > 0)) || { echo "etcd_certs.sh: give the IPs etcd serves on" >&2; exit 2; }
mkdir -p "$dir"
cd "$dir"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
ca() { # NAME CN
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -subj "/CN=$2" -days 2 -out "$1.pem"
}
signed() { # NAME SUBJECT CA EXTENSIONS
  key "$1.key"
  openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
  printf '%s\n' "$4" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
san=""
for ip in "$@"; do san+="${san:+,}IP:$ip"; done
ca ca flotilla-test-ca
signed server /CN=etcd ca "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
signed client /O=flotilla-test ca "extendedKeyUsage=clientAuth"
signed named /CN=trainer ca "extendedKeyUsage=clientAuth"
ca other-ca flotilla-test-other-ca
signed stranger /CN=stranger other-ca "extendedKeyUsage=clientAuth"
chmod 600 ./*.key

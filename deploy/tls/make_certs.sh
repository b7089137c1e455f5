#!/usr/bin/env bash
# Make a test CA and certificates for mutual TLS between Tandem's services.
#   deploy/tls/make_certs.sh OUT_DIR [NAME ...]
# Writes OUT_DIR/ca.{crt,key} and OUT_DIR/NAME.{crt,key} for each NAME (default: router
# prefill decode client), each valid for localhost and 127.0.0.1 (plus NAME as a DNS name).
# Its subject is /OU=ROLE/CN=NAME: a NAME starting with "client" gets OU=client (may call the
# router's client API only), every other OU=service (the router and workers).
# For testing and local clusters only: production certificates come from your own CA.
set -euo pipefail
out=${1:?usage: make_certs.sh OUT_DIR [NAME ...]}
shift
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(router prefill decode client)
mkdir -p "$out"
cd "$out"
if [ ! -f ca.crt ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=tandem-test-ca" \
    -keyout ca.key -out ca.crt 2>/dev/null
fi
for name in "${names[@]}"; do
  role=service
  case "$name" in client*) role=client ;; esac
  openssl req -newkey rsa:2048 -nodes -subj "/OU=$role/CN=$name" -keyout "$name.key" -out "$name.csr" 2>/dev/null
  printf "subjectAltName=DNS:localhost,DNS:%s,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n" \
    "$name" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
done
echo "$out: ca.crt and ${names[*]}"

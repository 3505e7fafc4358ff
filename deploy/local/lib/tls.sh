# shellcheck shell=bash
# TLS material for the local services: a local CA, server and client certificates.

TLS_DIR="$STATE_DIR/tls"
TLS_DAYS=3650
TLS_CLIENT_KEY_PASSWORD=outbox-key-secret
TLS_KEYSTORE_PASSWORD=outbox-keystore-secret

# Generated once into .services/tls/ by openssl; everything is built in a temp
# directory and renamed, so an interrupted run never leaves half a set. EC P-256
# keys: quick to generate on a small CI box, accepted by Java, OpenSSL and Python.
tls_ensure() {
  [[ -f $TLS_DIR/.complete ]] && return 0
  command -v openssl >/dev/null || apt_install openssl
  local tmp="$TLS_DIR.tmp"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  log "generating TLS material in $TLS_DIR (CA, server and client certificates)"
  (
    cd "$tmp"
    umask 077
    tls_make_ca ca "outbox-dispatcher local development CA"
    tls_make_ca other-ca "outbox-dispatcher untrusted CA (signs nothing here)"
    tls_make_leaf server localhost "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
    tls_make_leaf client outbox-dispatcher "extendedKeyUsage=clientAuth"
    openssl pkcs8 -topk8 -in client.key -out client-encrypted.key \
      -passout "pass:$TLS_CLIENT_KEY_PASSWORD" 2>/dev/null
    # The broker's keystore: key, its certificate and the CA, as PKCS#12 (Java reads it natively).
    openssl pkcs12 -export -in server.crt -inkey server.key -certfile ca.crt -name broker \
      -out broker.p12 -passout "pass:$TLS_KEYSTORE_PASSWORD"
    rm -f ./*.csr ./*.srl
    # Certificates are public; keys stay 0600 (the user running the tests reads them).
    chmod 0644 ./*.crt
    touch .complete
  )
  chmod 0755 "$tmp"
  rm -rf "$TLS_DIR"
  mv "$tmp" "$TLS_DIR"
}

# tls_make_ca NAME COMMON_NAME: a self-signed CA in NAME.crt / NAME.key.
tls_make_ca() {
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.crt" -days "$TLS_DAYS" -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
}

# tls_make_leaf NAME COMMON_NAME EXTENSIONS: a key and a certificate signed by ca.
tls_make_leaf() {
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
    -days "$TLS_DAYS" -sha256 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.ext"
}

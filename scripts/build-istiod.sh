#!/usr/bin/env bash
# build-istiod.sh: builds pilot-discovery (istiod) from the tools module tools/istiod
# into a cache directory that internal/kubetest's istiod fixture starts it from. The
# NDS tests (internal/ndssource) and the bench run it on the test API server.
# `make istiod-bin` and `make test` run it.
#
#   default output: $repo/.cache/istiod-bin/<istio version>/  (ignored by git)
#   MESHDNS_ISTIOD_BIN=DIR   build into DIR instead (kubetest reads the same variable)
#
# Idempotent: when the binary exists and the stamp written after the last build
# matches the tools module (go.mod, go.sum and the build flags), it prints "up to
# date" and builds nothing.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mod="$repo/tools/istiod"

log() { printf 'build-istiod: %s\n' "$*" >&2; }
# shellcheck source=lib/toolbuild.sh
. "$repo/scripts/lib/toolbuild.sh"

version="$(modver "$mod/go.mod" istio.io/istio)"
[ -n "$version" ] || { log "no 'require istio.io/istio vX' line in $mod/go.mod"; exit 1; }

out="${MESHDNS_ISTIOD_BIN:-$repo/.cache/istiod-bin/$version}"
ldflags="-s -w"

stamp() {
	{
		echo "go $(go env GOVERSION) GOFLAGS=$GOFLAGS ldflags=$ldflags"
		cat "$mod/go.mod" "$mod/go.sum"
	} | sha256sum | cut -d' ' -f1
}
bins=(pilot-discovery)
want="$(stamp)"
cache_claim "istio $version"

start=$(date +%s)
log "building pilot-discovery (istio.io/istio $version) ..."
rc=0
if [ -x /usr/bin/time ]; then
	(cd "$mod" && /usr/bin/time -f '%M' -o "$out/.rss" \
		go build -p 2 -ldflags "$ldflags" -o "$out/.pilot-discovery.tmp" istio.io/istio/pilot/cmd/pilot-discovery) || rc=$?
else
	(cd "$mod" && go build -p 2 -ldflags "$ldflags" -o "$out/.pilot-discovery.tmp" istio.io/istio/pilot/cmd/pilot-discovery) || rc=$?
fi
rss="$(tail -1 "$out/.rss" 2>/dev/null || true)"
rm -f "$out/.rss"
if [ "$rc" -ne 0 ]; then
	rm -f "$out/.pilot-discovery.tmp"
	log "building pilot-discovery failed (exit $rc)"
	exit "$rc"
fi
mv -f "$out/.pilot-discovery.tmp" "$out/pilot-discovery"
# The CRDs istiod needs on the test API server come from the same module version.
crds="$(cd "$mod" && go list -m -f '{{.Dir}}' istio.io/istio)/manifests/charts/base/files/crd-all.gen.yaml"
cp -f "$crds" "$out/.crd-all.gen.yaml.tmp" && mv -f "$out/.crd-all.gen.yaml.tmp" "$out/crd-all.gen.yaml"
echo "$want" >"$out/.stamp"
log "built pilot-discovery in $(($(date +%s) - start))s, $(du -m "$out/pilot-discovery" | cut -f1) MB${rss:+, peak RSS of the largest build process $((rss / 1024)) MB}: $out"

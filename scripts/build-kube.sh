#!/usr/bin/env bash
# build-kube.sh: builds the test control plane (kube-apiserver, kube-controller-manager,
# etcd) from the tools modules tools/kube and tools/etcd into a cache directory that
# internal/kubetest starts them from. `make kube-bin` and `make test` run it.
#
#   scripts/build-kube.sh        the control plane
#   scripts/build-kube.sh node   the test node's own binaries (internal/nodetest):
#                                kubelet, kube-scheduler, kube-proxy, kubectl from tools/kube,
#                                containerd, containerd-shim-runc-v2, ctr from tools/containerd
#
#   default output: $repo/.cache/kube-bin/<kubernetes version>/  (ignored by git)
#   MESHDNS_KUBE_BIN=DIR   build into DIR instead (kubetest reads the same variable)
#   node: $repo/.cache/node-bin/<kubernetes version>/, or MESHDNS_NODE_BIN=DIR
#
# Idempotent: when the three binaries exist and the stamp written after the last build
# matches the tools modules (go.mod, go.sum, the etcd main and this script's build
# flags), it prints "up to date" and builds nothing. A cold build needs ~2.5 GB of RAM
# and a few minutes (kube-apiserver is the big one); the binaries are built one after
# the other so two cores are not oversubscribed.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kube_mod="$repo/tools/kube"
etcd_mod="$repo/tools/etcd"
containerd_mod="$repo/tools/containerd"
target="${1:-control-plane}"
case "$target" in control-plane|node) ;; *) echo "usage: $0 [control-plane|node]" >&2; exit 2 ;; esac

log() { printf 'build-kube: %s\n' "$*" >&2; }
# shellcheck source=lib/toolbuild.sh
. "$repo/scripts/lib/toolbuild.sh"

kube_version="$(modver "$kube_mod/go.mod" k8s.io/kubernetes)"
[ -n "$kube_version" ] || { log "no 'require k8s.io/kubernetes vX' line in $kube_mod/go.mod"; exit 1; }
etcd_version="$(modver "$etcd_mod/go.mod" go.etcd.io/etcd/server/v3)"
[ -n "$etcd_version" ] || { log "no 'require go.etcd.io/etcd/server/v3 vX' line in $etcd_mod/go.mod"; exit 1; }
major="${kube_version#v}"; major="${major%%.*}"
minor="${kube_version#v*.}"; minor="${minor%%.*}"

containerd_version="$(modver "$containerd_mod/go.mod" github.com/containerd/containerd/v2)"
[ -n "$containerd_version" ] || { log "no 'require github.com/containerd/containerd/v2 vX' line in $containerd_mod/go.mod"; exit 1; }

if [ "$target" = node ]; then
	out="${MESHDNS_NODE_BIN:-$repo/.cache/node-bin/$kube_version}"
	bins=(kubelet kube-scheduler kube-proxy kubectl containerd containerd-shim-runc-v2 ctr)
else
	out="${MESHDNS_KUBE_BIN:-$repo/.cache/kube-bin/$kube_version}"
	bins=(kube-apiserver kube-controller-manager etcd)
fi

kube_ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$kube_version"
kube_ldflags+=" -X k8s.io/component-base/version.gitMajor=$major -X k8s.io/component-base/version.gitMinor=$minor"
kube_ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"

# containerd's own version ldflag and the build tags its release builds use where no
# C library is linked (no btrfs, zfs or devmapper snapshotters: overlayfs serves here).
containerd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
containerd_tags="no_btrfs no_zfs no_devmapper"

stamp() {
	{
		echo "go $(go env GOVERSION) GOFLAGS=$GOFLAGS ldflags=$kube_ldflags"
		if [ "$target" = node ]; then
			echo "node ${bins[*]} containerd ldflags=$containerd_ldflags tags=$containerd_tags"
			cat "$kube_mod/go.mod" "$kube_mod/go.sum" "$containerd_mod/go.mod" "$containerd_mod/go.sum"
		else
			cat "$kube_mod/go.mod" "$kube_mod/go.sum" "$etcd_mod/go.mod" "$etcd_mod/go.sum" "$etcd_mod/main.go"
		fi
	} | sha256sum | cut -d' ' -f1
}

want="$(stamp)"
# One builder at a time per output directory (two `make test` sharing MESHDNS_KUBE_BIN).
cache_claim "$target: kubernetes $kube_version, etcd $etcd_version, containerd $containerd_version"

# The replace list must be exactly the staging modules k8s.io/kubernetes replaces with
# ./staging/src/..., each at the matching v0 version; otherwise a bump silently builds
# against the wrong staging versions (or does not build).
check_replaces() {
	local upstream_mod want_list have_list staging_version
	upstream_mod="$(cd "$kube_mod" && go mod download -json "k8s.io/kubernetes@$kube_version" |
		awk -F'"' '$2 == "GoMod" {print $4}')"
	staging_version="v0.${kube_version#v1.}"
	want_list="$(awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}' "$upstream_mod" | sort)"
	have_list="$(awk -v v="$staging_version" '$2 == "=>" && $1 == $3 && $4 == v {print $1}' "$kube_mod/go.mod" | sort)"
	if [ "$want_list" != "$have_list" ]; then
		log "tools/kube/go.mod replaces do not match the staging modules of k8s.io/kubernetes $kube_version:"
		diff <(echo "$want_list") <(echo "$have_list") >&2 || true
		log "(each needs: replace k8s.io/X => k8s.io/X $staging_version)"
		exit 1
	fi
	log "replace list matches k8s.io/kubernetes $kube_version ($(echo "$want_list" | wc -l) staging modules at $staging_version)"
}
check_replaces

timed_build() { # timed_build NAME DIR PACKAGE LDFLAGS [TAGS]
	local name="$1" dir="$2" pkg="$3" ldflags="$4" tags="${5:-}" start rc=0 rss=""
	start=$(date +%s)
	log "building $name ($pkg) ..."
	if [ -x /usr/bin/time ]; then
		(cd "$dir" && /usr/bin/time -f '%M' -o "$out/.$name.rss" \
			go build -p 2 -tags "$tags" -ldflags "$ldflags" -o "$out/.$name.tmp" "$pkg") || rc=$?
		rss="$(tail -1 "$out/.$name.rss" 2>/dev/null || true)"
		rm -f "$out/.$name.rss"
	else
		(cd "$dir" && go build -p 2 -tags "$tags" -ldflags "$ldflags" -o "$out/.$name.tmp" "$pkg") || rc=$?
	fi
	if [ "$rc" -ne 0 ]; then
		rm -f "$out/.$name.tmp"
		log "building $name failed (exit $rc)"
		exit "$rc"
	fi
	mv -f "$out/.$name.tmp" "$out/$name"
	log "built $name in $(($(date +%s) - start))s, $(du -m "$out/$name" | cut -f1) MB${rss:+, peak RSS of the largest build process $((rss / 1024)) MB}"
}

total_start=$(date +%s)
if [ "$target" = node ]; then
	# tools/kube's go.mod names only the control plane as tools; these build from the
	# same module graph (-mod=readonly fails here, naming the module, if one is missing).
	for b in kubelet kube-scheduler kube-proxy kubectl; do
		timed_build "$b" "$kube_mod" "k8s.io/kubernetes/cmd/$b" "$kube_ldflags"
	done
	for b in containerd containerd-shim-runc-v2 ctr; do
		timed_build "$b" "$containerd_mod" "github.com/containerd/containerd/v2/cmd/$b" "$containerd_ldflags" "$containerd_tags"
	done
else
	timed_build etcd "$etcd_mod" . "-s -w"
	timed_build kube-apiserver "$kube_mod" k8s.io/kubernetes/cmd/kube-apiserver "$kube_ldflags"
	timed_build kube-controller-manager "$kube_mod" k8s.io/kubernetes/cmd/kube-controller-manager "$kube_ldflags"
fi
echo "$want" >"$out/.stamp"
log "done in $(($(date +%s) - total_start))s: $out ($target: kubernetes $kube_version, etcd $etcd_version, containerd $containerd_version)"

#!/usr/bin/env bash
# Regenerates the bpf2go output of internal/redirect (and of the tests' socket load
# balancer, internal/redirect/socklb) from bpf/ in a temporary copy
# of the module and compares it with the committed files. Exits non-zero when they
# differ (run `go generate ./internal/redirect` and commit the result) or when
# generation fails (it needs the pinned clang-14 and llvm-strip-14).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cp "$root/go.mod" "$root/go.sum" "$tmp/"
cp -r "$root/bpf" "$tmp/bpf"
mkdir -p "$tmp/internal"
cp -r "$root/internal/redirect" "$tmp/internal/redirect"

generated=(redirect_bpfel.go redirect_bpfel.o watchclock_bpfel.go watchclock_bpfel.o
	socklb/socklb_bpfel.go socklb/socklb_bpfel.o)
for f in "${generated[@]}"; do
	rm -f "$tmp/internal/redirect/$f"
done

(cd "$tmp" && go generate ./internal/redirect/...)

status=0
for f in "${generated[@]}"; do
	committed="$root/internal/redirect/$f"
	fresh="$tmp/internal/redirect/$f"
	if [[ ! -f "$committed" ]]; then
		echo "missing: internal/redirect/$f (run: go generate ./internal/redirect/...)" >&2
		status=1
	elif ! cmp -s "$committed" "$fresh"; then
		echo "differs: internal/redirect/$f does not match bpf/ (run: go generate ./internal/redirect/...)" >&2
		if [[ "$f" == *.go ]]; then
			diff -u "$committed" "$fresh" >&2 || true
		fi
		status=1
	fi
done
if [[ $status -eq 0 ]]; then
	echo "bpf2go output is up to date: ${generated[*]}"
fi
exit $status

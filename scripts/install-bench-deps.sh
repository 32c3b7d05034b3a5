#!/usr/bin/env bash
# install-bench-deps.sh: install what `make bench` needs. Idempotent: re-running only
# installs what is missing.
#
#   - Debian packages: dnsperf, unbound, dnsmasq-base, bind9-dnsutils (dig), util-linux (taskset,
#     nsenter), gcc (bench/echo); for the datapath comparison also iproute2, iptables, conntrack
#   - CoreDNS v1.14.7 built with `go install` into a cache directory outside the repository
#     (never vendored or committed): ${MESHDNS_BENCH_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/meshdns-bench/bin}
#
# Environment:
#   MESHDNS_BENCH_BIN   where the coredns binary goes (default above)
#   COREDNS_VERSION     default v1.14.7
#   SKIP_APT=1          do not touch apt (e.g. packages provided otherwise)
set -euo pipefail

COREDNS_VERSION="${COREDNS_VERSION:-v1.14.7}"
BIN_DIR="${MESHDNS_BENCH_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/meshdns-bench/bin}"

log() { printf 'install-bench-deps: %s\n' "$*" >&2; }

# pkg_for_binary: package -> a binary it provides, used to decide whether it is needed.
need_pkgs=()
check() { # check BINARY PACKAGE
	if command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; then
		log "ok: $1 ($(command -v "$1" 2>/dev/null || echo "/usr/sbin/$1"))"
	else
		need_pkgs+=("$2")
	fi
}
check dnsperf dnsperf
check unbound unbound
check dnsmasq dnsmasq-base
check dig bind9-dnsutils
check taskset util-linux
check nsenter util-linux
check cc gcc # builds bench/echo, the machine floor
# datapath comparison (netns client, iptables mode, conntrack entries)
check ip iproute2
check iptables iptables
check conntrack conntrack

if [ "${#need_pkgs[@]}" -gt 0 ]; then
	if [ "${SKIP_APT:-0}" = 1 ]; then
		log "missing packages (SKIP_APT=1, not installing): ${need_pkgs[*]}"
		exit 1
	fi
	SUDO=""
	if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
	log "apt-get install ${need_pkgs[*]}"
	export DEBIAN_FRONTEND=noninteractive
	$SUDO apt-get update -q
	# --no-install-recommends keeps it small; the bench runs its own unbound/dnsmasq
	# instances with private configs and never uses the packaged services.
	$SUDO apt-get install -y -q --no-install-recommends "${need_pkgs[@]}"
fi

# CoreDNS: built from source with the Go toolchain (Debian has no coredns package).
mkdir -p "$BIN_DIR"
want="${COREDNS_VERSION#v}"
have=""
if [ -x "$BIN_DIR/coredns" ]; then
	have="$("$BIN_DIR/coredns" -version 2>/dev/null | sed -n 's/^CoreDNS-\([0-9.]*\).*/\1/p' | head -1)"
fi
if [ "$have" = "$want" ]; then
	log "ok: coredns $have ($BIN_DIR/coredns)"
else
	command -v go >/dev/null 2>&1 || { log "go not found: needed to build coredns"; exit 1; }
	log "go install github.com/coredns/coredns@$COREDNS_VERSION -> $BIN_DIR (takes a few minutes)"
	# Build outside any module so the project's go.mod is not involved.
	(cd "${TMPDIR:-/tmp}" && GOBIN="$BIN_DIR" GOFLAGS="${GOFLAGS:--buildvcs=false}" \
		go install "github.com/coredns/coredns@$COREDNS_VERSION")
	"$BIN_DIR/coredns" -version | head -1 >&2
fi
log "done; coredns at $BIN_DIR/coredns"

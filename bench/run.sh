#!/usr/bin/env bash
# bench/run.sh: the `make bench` entry point. Builds the harness (benchrun, the
# fake upstream, the floor server) and our binary, checks the peers are
# installed, and runs bench/cmd/benchrun, which prints the results table and
# writes bench/RESULTS.md.
#
# Environment:
#   BENCH_QUICK=1          smoke run: 1 x 3 s per scenario, scale 1k/10k only
#   BENCH_WORK=DIR         scratch dir (default ${TMPDIR:-/tmp}/meshdns-bench)
#   BENCH_PEERS=a,b        subset of meshdns,coredns-prod,coredns-hosts,floor,unbound,dnsmasq
#   BENCH_WAIT_IDLE=10m    first wait (up to 10m) until both cores are idle
#   BENCH_NO_INSTALL=1     do not run scripts/install-bench-deps.sh when something is missing
#   BENCH_NO_BUILD=1       do not (re)build bin/meshdns-ebpf
#   BENCH_MESHDNS_ARGS=".."  extra flags for our resolver (default --authoritative=true)
#   COREDNS=PATH           CoreDNS binary (default: the install script's cache dir)
#   BENCH_KUBE=0           skip the Kubernetes node mode benchmark (bench/kube)
#   BENCH_KUBE_ONLY=1      run only bench/kube; the rest of bench/RESULTS.md is kept
#   BENCH_KUBE_SCALES=a,b  its Service counts (default 10000,100000)
#   BENCH_KUBE_DURATION=10s  each of its dnsperf runs
#   BENCH_KUBE_MESH=N      its mesh run: N ServiceEntries + N Services over two clusters (default 10000; 0 skips)
#   BENCH_KUBE_ISTIOD=N    its istiod run: the NDS source beside the Kubernetes source at N Services (default 10000; 0 skips)
# Extra arguments are passed to benchrun (see `benchrun -h`), e.g. -reps 5 -duration 20s.
#
# bench/run.sh budgets [flags]: only the per-workload budgets lane (`benchrun
# budgets`, a few minutes; make bench-budgets): the agent on CPU 1, the load
# generators and the upstream on CPU 0; prints its section (flags: benchrun
# budgets -h). BENCH_PPROF=1: the agent built with -tags benchpprof, its heap
# profile saved at each phase's end (benchrun budgets -heap-profiles).
#
# bench/run.sh egress [flags]: only the DNS-gated egress lane (`benchrun egress`,
# make bench-egress; needs root, gcc and musl-gcc): resolve -> connect cycles from
# glibc, musl and Go clients with the agent without and with --egress; prints its
# section (flags: benchrun egress -h).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
work="${BENCH_WORK:-${TMPDIR:-/tmp}/meshdns-bench}"
bin_cache="${MESHDNS_BENCH_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/meshdns-bench/bin}"
coredns="${COREDNS:-$bin_cache/coredns}"
mkdir -p "$work/bin"

# One benchmark at a time on this machine: the lock is held (fd 9) until
# benchrun exits.
exec 9>"${TMPDIR:-/tmp}/meshdns-bench.lock"
if ! flock -n 9; then
	printf 'bench: another benchmark is running (lock %s)\n' "${TMPDIR:-/tmp}/meshdns-bench.lock" >&2
	exit 1
fi

log() { printf 'bench: %s\n' "$*" >&2; }

if [ "$(nproc)" -lt 2 ]; then
	log "need at least 2 cores (server and load generator on different cores); have $(nproc)"
	exit 1
fi

if [ "${1:-}" = budgets ]; then
	shift
	for t in taskset chrt; do
		command -v "$t" >/dev/null 2>&1 || { log "budgets: $t is missing (util-linux)"; exit 1; }
	done
	log "building benchrun and bin/meshdns-ebpf"
	go build -o "$work/bin/benchrun" ./bench/cmd/benchrun
	if [ "${BENCH_PPROF:-0}" = 1 ]; then
		# The agent with net/http/pprof (cmd/meshdns-ebpf/benchpprof.go): a heap
		# profile at each phase's end, into $work/budgets/profiles.
		go build -tags grpcnotrace,benchpprof -o "$work/bin/meshdns-ebpf-pprof" ./cmd/meshdns-ebpf
		exec taskset -c 0 "$work/bin/benchrun" budgets -meshdns "$work/bin/meshdns-ebpf-pprof" -work "$work" -gen-cpu 0 -server-cpu 1 \
			-heap-profiles "$work/budgets/profiles" "$@"
	fi
	go build -o "$repo/bin/meshdns-ebpf" ./cmd/meshdns-ebpf
	exec taskset -c 0 "$work/bin/benchrun" budgets -meshdns "$repo/bin/meshdns-ebpf" -work "$work" -gen-cpu 0 -server-cpu 1 "$@"
fi
if [ "${1:-}" = egress ]; then
	shift
	PATH="$PATH:/usr/sbin:/sbin"
	for t in gcc musl-gcc taskset nsenter unshare dig conntrack; do
		command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] || { log "egress: $t is missing"; exit 1; }
	done
	log "building benchrun, bin/meshdns-ebpf and the egress clients (gcc, musl-gcc, go)"
	go build -o "$work/bin/benchrun" ./bench/cmd/benchrun
	go build -o "$repo/bin/meshdns-ebpf" ./cmd/meshdns-ebpf
	gcc -O2 -Wall -o "$work/bin/egressload-glibc" test/e2e/testdata/egressload/egressload.c
	musl-gcc -static -O2 -Wall -o "$work/bin/egressload-musl" test/e2e/testdata/egressload/egressload.c
	go build -o "$work/bin/goegress" ./test/e2e/testdata/goegress
	exec taskset -c 0 "$work/bin/benchrun" egress -meshdns "$repo/bin/meshdns-ebpf" -work "$work" \
		-egressload-glibc "$work/bin/egressload-glibc" -egressload-musl "$work/bin/egressload-musl" -goegress "$work/bin/goegress" "$@"
fi

missing=()
for t in dnsperf unbound dnsmasq taskset "${CC:-cc}"; do
	command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] || missing+=("$t")
done
[ -x "$coredns" ] || missing+=("coredns ($coredns)")
if [ "${#missing[@]}" -gt 0 ]; then
	if [ "${BENCH_NO_INSTALL:-0}" = 1 ]; then
		log "missing: ${missing[*]}; run scripts/install-bench-deps.sh"
		exit 1
	fi
	log "missing: ${missing[*]}; running scripts/install-bench-deps.sh"
	MESHDNS_BENCH_BIN="$bin_cache" "$repo/scripts/install-bench-deps.sh"
fi
PATH="$PATH:/usr/sbin:/sbin"

log "building harness into $work/bin"
go build -o "$work/bin/benchrun" ./bench/cmd/benchrun
go build -o "$work/bin/fakeupstream" ./bench/fakeupstream
go build -o "$work/bin/floor" ./bench/floor
go build -o "$work/bin/lookup" ./bench/lookup
# The machine floor (bench/echo): a C server that does nothing, run beside our
# fixed-rate runs. Without a C compiler the report says it was not measured.
echo_args=()
if "${CC:-cc}" -O2 -Wall -o "$work/bin/echo" bench/echo/echo.c; then
	echo_args=(-echo "$work/bin/echo")
else
	log "WARNING: ${CC:-cc} could not build bench/echo/echo.c; the machine floor is skipped"
fi

meshdns="$repo/bin/meshdns-ebpf"
skip=""
if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then
	if [ -d "$repo/cmd/meshdns-ebpf" ]; then
		log "building bin/meshdns-ebpf"
		if ! go build -o "$repo/bin/meshdns-ebpf" ./cmd/meshdns-ebpf; then
			log "WARNING: go build ./cmd/meshdns-ebpf failed; meshdns is skipped in this run"
			skip="go build ./cmd/meshdns-ebpf failed (see the make bench output)"
		fi
	else
		log "cmd/meshdns-ebpf does not exist yet; meshdns is skipped in this run"
		skip="cmd/meshdns-ebpf does not exist yet"
	fi
fi

args=(-repo "$repo" -work "$work" -fakeupstream "$work/bin/fakeupstream" -floor "$work/bin/floor" -lookup "$work/bin/lookup"
	-coredns "$coredns" -meshdns "$meshdns" -out "$repo/bench/RESULTS.md" "${echo_args[@]}")
[ -n "$skip" ] && args+=(-meshdns-skip "$skip")
[ "${BENCH_QUICK:-0}" = 1 ] && args+=(-quick)
[ -n "${BENCH_PEERS:-}" ] && args+=(-peers "$BENCH_PEERS")
[ -n "${BENCH_WAIT_IDLE:-}" ] && args+=(-wait-idle "$BENCH_WAIT_IDLE")
[ -n "${BENCH_MESHDNS_ARGS+x}" ] && args+=(-meshdns-args "$BENCH_MESHDNS_ARGS")

# The harness itself stays on the generator's core; servers go to core 1.
if [ "${BENCH_KUBE_ONLY:-0}" != 1 ]; then
	taskset -c 0 "$work/bin/benchrun" "${args[@]}" "$@"
fi

# The Kubernetes node mode against CoreDNS's kubernetes plugin, both on one
# real API server (bench/kube). Its section goes into RESULTS.md above the
# hand-written part.
if [ "${BENCH_KUBE:-1}" != 0 ] && [ -z "$skip" ]; then
	log "Kubernetes benchmark (bench/kube): building the control plane and istiod if needed"
	scripts/build-kube.sh
	scripts/build-istiod.sh
	kube_out="$work/kube.md"
	rm -f "$kube_out"
	MESHDNS_BENCH_KUBE=1 MESHDNS="$meshdns" COREDNS="$coredns" MESHDNS_BENCH_KUBE_OUT="$kube_out" \
		MESHDNS_BENCH_KUBE_SCALES="${BENCH_KUBE_SCALES:-10000,100000}" \
		MESHDNS_BENCH_KUBE_DURATION="${BENCH_KUBE_DURATION:-10s}" \
		MESHDNS_BENCH_KUBE_MESH="${BENCH_KUBE_MESH:-10000}" \
		MESHDNS_BENCH_KUBE_ISTIOD="${BENCH_KUBE_ISTIOD:-10000}" \
		MESHDNS_BENCH_ECHO="${echo_args[1]:-}" \
		go test -count=1 -timeout 120m -run TestKubernetesBench -v ./bench/kube/ >"$work/kube.log" 2>&1 ||
		{ log "Kubernetes benchmark failed; see $work/kube.log"; tail -30 "$work/kube.log" >&2; exit 1; }
	grep -E 'kube_test.go|mesh_test.go|istiod_test.go' "$work/kube.log" >&2 || true
	# In place of the Kubernetes section of an earlier run (BENCH_KUBE_ONLY=1
	# keeps the rest of the file).
	"$work/bin/benchrun" kube-section "$kube_out" bench/RESULTS.md
	log "Kubernetes results put into bench/RESULTS.md"
fi

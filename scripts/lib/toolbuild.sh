# toolbuild.sh: what the builds of the test binaries share (build-kube.sh,
# build-tools.sh and build-istiod.sh source it after defining log()): the Go
# build environment, reading a module's version from a go.mod, and the cache
# directory protocol. A directory $out holds the binaries named in the array
# bins and a .stamp with the hash of everything that built them ($want): a
# build is skipped while both match, and one builder at a time holds
# $out/.lock.

export PATH="$PATH:/usr/local/go/bin"
export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0
# -trimpath: the binaries do not depend on where the repo or the module cache live.
export GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

# modver GO.MOD MODULE: the required version of MODULE, from a one-line or
# block require (the versions come from the tools modules themselves, so a
# bump is one edit there).
modver() {
	awk -v m="$2" '$1 == "require" && $2 == m {print $3; exit} $1 == m && $2 ~ /^v/ {print $2; exit}' "$1"
}

# cache_up_to_date: every binary is there and the stamp matches $want.
cache_up_to_date() {
	local b
	for b in "${bins[@]}"; do [ -x "$out/$b" ] || return 1; done
	[ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ]
}

# cache_claim WHAT: exits the script when $out is up to date (WHAT says what it
# holds); otherwise takes $out's lock (fd 9, held until the script exits), looks
# again (a concurrent run may have built it meanwhile) and clears the stamp, so an
# interrupted build is never taken for a finished one.
cache_claim() {
	mkdir -p "$out"
	if cache_up_to_date; then
		log "up to date in $out ($1)"
		exit 0
	fi
	exec 9>"$out/.lock"
	flock 9
	if cache_up_to_date; then
		log "up to date in $out (built by a concurrent run)"
		exit 0
	fi
	rm -f "$out/.stamp"
}

// Package version holds the build's version string, set at link time by the Makefile.
package version

import "runtime"

// Version is set with -ldflags "-X github.com/meshdns/meshdns-ebpf/internal/version.Version=...".
var Version = "dev"

// String describes the build: version and Go version.
func String() string { return Version + " (" + runtime.Version() + ")" }

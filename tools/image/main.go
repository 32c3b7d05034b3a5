// Command image builds the meshdns-ebpf OCI image without a container engine:
// a root filesystem from the locked Debian packages the iptables fallback needs,
// the agent binary, a multi-platform index, written as an OCI image layout and an
// OCI archive, and pushes it to a registry. The same inputs (lock, .debs,
// binaries, version, revision, SOURCE_DATE_EPOCH) give the same digest.
//
//	image build -lock deploy/image/debs.lock -debs DIR -bin amd64=PATH[,arm64=PATH] \
//	            -version V [-revision SHA] -epoch SECONDS -out DIR
//	image push  -layout DIR/oci -ref REGISTRY/meshdns-ebpf:TAG
//	image bundle -name localhost/NAME -out DIR [-host PATH] [-file DEST=SRC] ...
//	            (a test workload image from files of this machine; bundle.go)
package main

import (
	"fmt"
	"io"
	"os"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: image build|push|bundle [flags]")
	}
	switch args[0] {
	case "build":
		return runBuild(args[1:], stdout)
	case "push":
		return runPush(args[1:], stdout)
	case "bundle":
		return runBundle(args[1:], stdout)
	default:
		return fmt.Errorf("unknown command %q (want build, push or bundle)", args[0])
	}
}

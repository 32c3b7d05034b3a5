// Command etcd is etcd's own server main, built from go.etcd.io/etcd/server/v3 for
// the test control plane (internal/kubetest). scripts/build-kube.sh builds it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }

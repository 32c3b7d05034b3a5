package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
)

// restConfig is the API server connection of --kubeconfig or --kubernetes.
func (c *Config) restConfig() (*rest.Config, error) {
	if c.InCluster {
		rc, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("--kubernetes: %w (outside a pod, give --kubeconfig FILE)", err)
		}
		return rc, nil
	}
	rc, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", c.Kubeconfig, err)
	}
	return rc, nil
}

// setupKubernetes connects the Kubernetes source (client-go logs through
// slog) and returns the nameservers to capture: --nameservers when given,
// else the cluster DNS Service's cluster IPs.
func (c *Config) setupKubernetes(ctx context.Context, log *slog.Logger) (*rest.Config, []netip.Addr, error) {
	klog.SetSlogLogger(log.With("component", "client-go"))
	rc, err := c.restConfig()
	if err != nil {
		return nil, nil, err
	}
	nameservers := c.Nameservers
	if nameservers == nil && c.Mode != ModeOff {
		dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		ips, err := kubesource.ClusterDNS(dctx, rc, c.ClusterDNSService)
		if err != nil {
			return nil, nil, fmt.Errorf("%w (give --nameservers to capture other addresses, or --cluster-dns-service)", err)
		}
		nameservers = ips
		log.Info("capturing the cluster DNS Service", "service", c.ClusterDNSService, "ips", ips)
	}
	if c.NodeName == "" {
		log.Warn("no --node-name (or $NODE_NAME): the Pods of this node are not watched, so clients' namespaces are unknown and bare names answer only when unambiguous")
	}
	return rc, nameservers, nil
}

package meshsource

import (
	"net/netip"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
)

// The informers keep these compact objects, not the API objects: a
// transform turns each object into one as it arrives. They are immutable
// once made.

// serviceEntry is an Istio ServiceEntry as DNS sees it.
type serviceEntry struct {
	kubeclient.Meta
	// order is the creation timestamp (UTC, fixed width, so it sorts as
	// time) and the UID: every node allocates VIPs in this order.
	order      string
	hosts      []string
	addrs      []netip.Addr // spec.addresses that are IP addresses (not CIDRs)
	status     []statusAddr // status.addresses, written by Istio's allocator
	resolution string       // NONE (also when unset), STATIC, DNS, DNS_ROUND_ROBIN, DYNAMIC_DNS
	exportTo   []string
}

// statusAddr is one of status.addresses: an address Istio allocated for a
// host ("" for every host of the entry).
type statusAddr struct {
	host string
	addr netip.Addr
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (s *serviceEntry) DeepCopyObject() runtime.Object { return s }

// orderLayout is RFC 3339 in UTC with whole seconds (what the API server
// stores): fixed width, so the strings sort in time order.
const orderLayout = "2006-01-02T15:04:05Z"

// transformServiceEntry keeps what DNS needs of a ServiceEntry of any
// served version (they share one schema).
func transformServiceEntry(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil // already transformed, or a tombstone
	}
	se := &serviceEntry{
		Meta:  kubeclient.Meta{Name: u.GetName(), Namespace: u.GetNamespace()},
		order: u.GetCreationTimestamp().UTC().Format(orderLayout) + "/" + string(u.GetUID()),
	}
	se.hosts = stringSlice(u.Object, "spec", "hosts")
	for _, a := range stringSlice(u.Object, "spec", "addresses") {
		if ip, err := netip.ParseAddr(a); err == nil && ip.Zone() == "" {
			se.addrs = append(se.addrs, ip.Unmap())
		}
	}
	se.resolution, _, _ = unstructured.NestedString(u.Object, "spec", "resolution")
	se.exportTo = stringSlice(u.Object, "spec", "exportTo")
	list, _, _ := unstructured.NestedSlice(u.Object, "status", "addresses")
	for _, item := range list {
		m, ok := item.(map[string]any)
		if !ok {
			continue
		}
		v, _ := m["value"].(string)
		ip, err := netip.ParseAddr(v)
		if err != nil || ip.Zone() != "" {
			continue
		}
		h, _ := m["host"].(string)
		se.status = append(se.status, statusAddr{host: strings.ToLower(strings.TrimSuffix(h, ".")), addr: ip.Unmap()})
	}
	return se, nil
}

// stringSlice reads a list of strings, skipping anything else.
func stringSlice(obj map[string]any, fields ...string) []string {
	list, _, _ := unstructured.NestedSlice(obj, fields...)
	var out []string
	for _, v := range list {
		if s, ok := v.(string); ok {
			out = append(out, s)
		}
	}
	return out
}

// crd is the ServiceEntry CustomResourceDefinition as the source needs it:
// whether it is established and which versions it serves.
type crd struct {
	kubeclient.Meta
	established bool
	served      []string // in the CRD's order
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (c *crd) DeepCopyObject() runtime.Object { return c }

func transformCRD(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil
	}
	c := &crd{Meta: kubeclient.Meta{Name: u.GetName()}}
	versions, _, _ := unstructured.NestedSlice(u.Object, "spec", "versions")
	for _, v := range versions {
		m, ok := v.(map[string]any)
		if !ok {
			continue
		}
		name, _ := m["name"].(string)
		if served, _ := m["served"].(bool); served && name != "" {
			c.served = append(c.served, name)
		}
	}
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, v := range conds {
		if m, ok := v.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
			c.established = true
		}
	}
	return c, nil
}

// versionPreference is the order the source picks a served version in:
// the newest API first. All of them carry the same schema.
var versionPreference = []string{"v1", "v1beta1", "v1alpha3"}

// version returns the version of the CRD to watch, "" when there is none
// to watch (absent, not established yet, nothing served).
func (c *crd) version() string {
	if c == nil || !c.established || len(c.served) == 0 {
		return ""
	}
	for _, v := range versionPreference {
		if slices.Contains(c.served, v) {
			return v
		}
	}
	return c.served[0]
}

// secret is an Istio remote secret: one kubeconfig per data key, the key
// naming the remote cluster.
type secret struct {
	kubeclient.Meta
	data map[string][]byte
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (s *secret) DeepCopyObject() runtime.Object { return s }

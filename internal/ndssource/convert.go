package ndssource

import (
	"net/netip"
	"slices"
	"strings"

	nds "istio.io/istio/pkg/dns/proto"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// variant is one host as a view received it: a name and its NameInfo,
// converted. Views that received the same content share one variant
// (interned by key), so N views of the same mesh cost one host each.
type variant struct {
	key  string // name, NUL, fingerprint of the NameInfo
	info *nds.NameTable_NameInfo
	host nametable.Host
	refs int // views holding it
}

// sameInfo reports whether two NameInfos are equal field by field (the
// quick check before a fingerprint: most names do not change between
// pushes).
func sameInfo(a, b *nds.NameTable_NameInfo) bool {
	return a.GetRegistry() == b.GetRegistry() && a.GetShortname() == b.GetShortname() &&
		a.GetNamespace() == b.GetNamespace() && slices.Equal(a.GetIps(), b.GetIps()) &&
		slices.Equal(a.GetAltHosts(), b.GetAltHosts())
}

// fingerprint identifies a NameInfo's content; the order of its addresses
// does not count (istiod lists a headless Service's endpoints in map
// order, which changes from push to push).
func fingerprint(info *nds.NameTable_NameInfo) string {
	ips := slices.Clone(info.GetIps())
	slices.Sort(ips)
	alts := slices.Clone(info.GetAltHosts())
	slices.Sort(alts)
	var b strings.Builder
	for _, s := range []string{strings.Join(ips, ","), info.GetRegistry(), info.GetShortname(), info.GetNamespace(), strings.Join(alts, ",")} {
		b.WriteString(s)
		b.WriteByte('|')
	}
	return b.String()
}

// hostOf converts a NameTable entry into a name table host the way the
// Istio agent reads it (pkg/dns/client): the name answers its ips; a
// Kubernetes entry in the cluster domain also answers <shortname>.<ns>.
// and <shortname>.<ns>.svc. (the table's Kubernetes host gives these, and
// the bare <shortname>. to clients of <ns>, for a Service; a headless
// Service's pod entry, whose shortname is "<pod>.<service>", gets the two
// as alternative names); altHosts are alternative names. istiod has
// already decided every address, auto-allocated VIPs included, so the
// table allocates none. Addresses that are not IPs are skipped, as the
// Istio agent skips them.
func hostOf(name string, info *nds.NameTable_NameInfo, domain string) nametable.Host {
	h := nametable.Host{Name: name, NoPTR: true}
	for _, s := range info.GetIps() {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			continue
		}
		if a = a.Unmap(); a.Is4() {
			h.V4 = append(h.V4, a)
		} else {
			h.V6 = append(h.V6, a)
		}
	}
	short, ns := strings.ToLower(info.GetShortname()), strings.ToLower(info.GetNamespace())
	lname := strings.ToLower(strings.TrimSuffix(name, "."))
	var alts []string
	if info.GetRegistry() == nametable.RegistryKubernetes && short != "" && ns != "" &&
		lname == short+"."+ns+".svc."+domain {
		if strings.Contains(short, ".") {
			alts = append(alts, short+"."+ns, short+"."+ns+".svc")
		} else {
			h.Kubernetes = true
		}
	}
	if alts = append(alts, info.GetAltHosts()...); len(alts) > 0 {
		h.Extra = &nametable.HostExtra{AltNames: alts}
	}
	return h
}

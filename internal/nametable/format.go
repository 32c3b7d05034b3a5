// Package nametable holds the resolver's name table: the immutable lookup
// snapshot (Table) the resolver reads without locks, the Builder that merges
// the hosts every name source contributes and publishes a new snapshot per
// batch of changes (copying only the shards a change touches), VIP
// allocation for external hosts without addresses, and the name table file
// format (JSON or YAML, close to Istio's NameTable).
//
// The file format is documented in docs/name-table.md, the merge rules in
// docs/kubernetes.md.
package nametable

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// RegistryKubernetes marks a host as a Kubernetes service. Any other registry
// value (or none) is an external host (an Istio ServiceEntry, say).
const RegistryKubernetes = "Kubernetes"

// File is the on-disk name table. JSON and YAML use the same field names.
type File struct {
	// Table maps a host name (FQDN without trailing dot; "*.example.com" for
	// a wildcard) to what is known about it. Same key as Istio's NameTable.
	Table map[string]HostInfo `json:"table,omitempty"`
	// Clients maps a pod IP to its namespace. Optional: it lets a bare
	// single-label name resolve to the client's own namespace.
	Clients map[string]string `json:"clients,omitempty"`
}

// HostInfo describes one host (Istio's NameTable.NameInfo plus ports).
type HostInfo struct {
	IPs       []string `json:"ips,omitempty"`
	Registry  string   `json:"registry,omitempty"`
	Shortname string   `json:"shortname,omitempty"`
	Namespace string   `json:"namespace,omitempty"`
	AltHosts  []string `json:"altHosts,omitempty"`
	// AltHostsProto is alt_hosts, the proto field name of altHosts: protojson
	// reads either (Istio's debug endpoints write the proto names), so the
	// file does too. Giving both is an error, as it is to protojson.
	AltHostsProto []string `json:"alt_hosts,omitempty"`
	Ports         []Port   `json:"ports,omitempty"`
}

// Port is a named service port, answered as SRV _name._protocol.host.
type Port struct {
	Name     string `json:"name"`
	Port     int    `json:"port"`
	Protocol string `json:"protocol,omitempty"` // TCP (default), UDP or SCTP
}

// Parse decodes JSON (when the first non-space byte is '{') or YAML. Unknown
// fields are errors, so typos do not go unnoticed. Errors carry the line
// (syntax errors) or the field path (type errors).
func Parse(data []byte) (*File, error) {
	trimmed := bytes.TrimSpace(data)
	f := &File{}
	if len(trimmed) == 0 {
		return f, nil
	}
	if trimmed[0] == '{' {
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(f); err != nil {
			return nil, jsonError(data, err)
		}
		if rest := data[dec.InputOffset():]; len(bytes.TrimLeft(rest, jsonSpace)) > 0 {
			off := dec.InputOffset() + int64(len(rest)-len(bytes.TrimLeft(rest, jsonSpace)))
			return nil, fmt.Errorf("line %d: unexpected data after the JSON object", lineOf(data, off))
		}
		return f, nil
	}
	if err := yaml.UnmarshalStrict(data, f); err != nil {
		// sigs.k8s.io/yaml reports "yaml: line N: ..." for syntax errors
		// and the JSON field path for type errors.
		return nil, fmt.Errorf("%s", strings.TrimPrefix(err.Error(), "error converting YAML to JSON: "))
	}
	return f, nil
}

// jsonSpace is JSON's white space.
const jsonSpace = " \t\n\r"

func jsonError(data []byte, err error) error {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		return fmt.Errorf("line %d: %w", lineOf(data, se.Offset), err)
	case errors.As(err, &te):
		return fmt.Errorf("line %d: field %s: %w", lineOf(data, te.Offset), te.Field, err)
	}
	return err
}

func lineOf(data []byte, off int64) int {
	if off > int64(len(data)) {
		off = int64(len(data))
	}
	return bytes.Count(data[:off], []byte{'\n'}) + 1
}

// Hosts validates the file and converts it into hosts, keyed by the
// table's keys, and clients. Errors name the host and field
// ("table[\"a.b\"].ips[1]: ...").
func (f *File) Hosts(domain string) (map[string]Host, map[netip.Addr]string, error) {
	domain = strings.ToLower(strings.Trim(domain, "."))
	if domain == "" {
		domain = DefaultClusterDomain
	}
	svc := ".svc." + domain + "."
	keys := make([]string, 0, len(f.Table))
	for k := range f.Table {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	hosts := make(map[string]Host, len(keys))
	names := make(map[string]string, len(keys))
	for _, k := range keys {
		info := f.Table[k]
		h, err := info.host(k, svc)
		if err != nil {
			return nil, nil, err
		}
		if prev, dup := names[h.Name]; dup {
			return nil, nil, fmt.Errorf("table[%q]: same host as table[%q] (names are case-insensitive)", k, prev)
		}
		names[h.Name] = k
		hosts[k] = h
	}
	var clients map[netip.Addr]string
	if len(f.Clients) > 0 {
		clients = make(map[netip.Addr]string, len(f.Clients))
		for ipStr, ns := range f.Clients {
			ip, err := netip.ParseAddr(ipStr)
			if err != nil || ip.Zone() != "" {
				return nil, nil, fmt.Errorf("clients[%q]: not an IP address", ipStr)
			}
			if ns == "" || strings.Contains(ns, ".") || !isLabel(strings.ToLower(ns)) {
				return nil, nil, fmt.Errorf("clients[%q]: namespace %q is not a single DNS label", ipStr, ns)
			}
			clients[ip.Unmap()] = strings.ToLower(ns)
		}
	}
	return hosts, clients, nil
}

func (info *HostInfo) host(k, svc string) (Host, error) {
	name, err := NormName(k)
	if err != nil {
		return Host{}, fmt.Errorf("table[%q]: %w", k, err)
	}
	return info.hostOf(k, name, svc)
}

// hostOf is host with the key's host name, NormName(k), given.
func (info *HostInfo) hostOf(k, name, svc string) (Host, error) {
	h := Host{Name: name, Kubernetes: info.Registry == RegistryKubernetes}
	if info.Registry != "" && !h.Kubernetes && strings.EqualFold(info.Registry, RegistryKubernetes) {
		return h, fmt.Errorf("table[%q].registry: %q: did you mean %q?", k, info.Registry, RegistryKubernetes)
	}
	for i, s := range info.IPs {
		a, err := netip.ParseAddr(strings.TrimSpace(s))
		if err != nil || a.Zone() != "" {
			return h, fmt.Errorf("table[%q].ips[%d]: %q is not an IP address", k, i, s)
		}
		h.V4 = append(h.V4, a) // the Builder splits by family
	}
	wild := strings.HasPrefix(name, "*.")
	// shortname and namespace are Istio's fields; they must agree with
	// <short>.<ns>.svc.<domain>, the only form that gets short names.
	var short, ns string
	if h.Kubernetes && !wild && strings.HasSuffix(name, svc) {
		head := strings.TrimSuffix(name, svc) // "<short>.<ns>"
		if i := strings.IndexByte(head, '.'); i >= 0 && strings.IndexByte(head[i+1:], '.') < 0 {
			short, ns = head[:i], head[i+1:]
		}
	}
	for _, fld := range []struct{ n, v, want string }{{"shortname", info.Shortname, short}, {"namespace", info.Namespace, ns}} {
		v := strings.ToLower(fld.v)
		if v == "" {
			continue
		}
		if strings.Contains(v, ".") || !isLabel(v) {
			return h, fmt.Errorf("table[%q].%s: %q is not a single DNS label", k, fld.n, fld.v)
		}
		if v != fld.want {
			return h, fmt.Errorf("table[%q].%s: %q does not match the host name (short names are derived from <short>.<ns>.svc.<domain>)", k, fld.n, fld.v)
		}
	}
	alts, altField := info.AltHosts, "altHosts"
	if info.AltHostsProto != nil {
		if info.AltHosts != nil {
			return h, fmt.Errorf("table[%q]: both altHosts and alt_hosts given (the JSON and the proto name of one field)", k)
		}
		alts, altField = info.AltHostsProto, "alt_hosts"
	}
	var altNames []string
	for i, alt := range alts {
		n, err := NormName(alt)
		if err != nil {
			return h, fmt.Errorf("table[%q].%s[%d]: %w", k, altField, i, err)
		}
		altNames = append(altNames, n)
	}
	if altNames != nil {
		h.Extra = &HostExtra{AltNames: altNames}
	}
	for i, port := range info.Ports {
		hp, err := parsePort(port)
		if err != nil {
			return h, fmt.Errorf("table[%q].ports[%d]: %w", k, i, err)
		}
		h.Ports = append(h.Ports, hp)
	}
	// An external, non-wildcard host without addresses is a ServiceEntry of
	// resolution DNS: it gets a VIP.
	h.NeedVIP = len(h.V4) == 0 && !h.Kubernetes && !wild
	return h, nil
}

func parsePort(port Port) (HostPort, error) {
	hp := HostPort{Name: strings.ToLower(port.Name)}
	if hp.Name == "" || strings.Contains(hp.Name, ".") || !isLabel(hp.Name) {
		return hp, fmt.Errorf("name: %q is not a single DNS label", port.Name)
	}
	if port.Port < 1 || port.Port > 65535 {
		return hp, fmt.Errorf("port: %d out of range 1-65535", port.Port)
	}
	hp.Port = uint16(port.Port)
	switch strings.ToUpper(port.Protocol) {
	case "", "TCP":
		hp.Protocol = "tcp"
	case "UDP":
		hp.Protocol = "udp"
	case "SCTP":
		hp.Protocol = "sctp"
	default:
		return hp, fmt.Errorf("protocol: %q is not TCP, UDP or SCTP", port.Protocol)
	}
	return hp, nil
}

// FileSource is the source name Build uses.
const FileSource = "file"

// Build validates a file and builds a table from it alone (tests and
// tools; the agent feeds a Builder through the name store).
func Build(f *File, opts Options) (*Table, error) {
	b, err := NewBuilder(opts)
	if err != nil {
		return nil, err
	}
	hosts, clients, err := f.Hosts(b.Domain())
	if err != nil {
		return nil, err
	}
	b.AddSource(FileSource, 0)
	if err := b.Load(FileSource, hosts, clients); err != nil {
		return nil, err
	}
	return b.Publish()
}

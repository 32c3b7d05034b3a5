// Package nametable holds the resolver's name table: the file format (JSON or
// YAML, close to Istio's NameTable), parsing and validation, the immutable
// lookup snapshot with precomputed answers, deterministic VIP allocation for
// external hosts without addresses, and a watcher that reloads the file live
// (including the Kubernetes ConfigMap "..data" symlink swap).
//
// The format is documented in docs/name-table.md.
package nametable

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
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
	Ports     []Port   `json:"ports,omitempty"`
}

// Port is a named service port, answered as SRV _name._protocol.host.
type Port struct {
	Name     string `json:"name"`
	Port     int    `json:"port"`
	Protocol string `json:"protocol,omitempty"` // TCP (default), UDP or SCTP
}

// ReadFile reads and parses a name table file. A missing file or one that
// holds only whitespace/comments is a valid empty table.
func ReadFile(path string) (*File, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return &File{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read name table %s: %w", path, err)
	}
	f, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("name table %s: %w", path, err)
	}
	return f, nil
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
		if dec.More() {
			return nil, fmt.Errorf("line %d: unexpected data after the JSON object", lineOf(data, dec.InputOffset()))
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

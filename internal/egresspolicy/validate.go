package egresspolicy

import (
	"fmt"
	"strings"
)

// Problem is one thing wrong with a policy, at a field path relative to
// the policy ("egress[0].names[1]", "podSelector.matchExpressions[0].values").
type Problem struct {
	Field  string
	Detail string
}

func (p Problem) String() string { return p.Field + ": " + p.Detail }

// Problems is every problem of a policy; as an error it names them all.
type Problems []Problem

func (ps Problems) Error() string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, "; ")
}

// Prefixed returns ps with prefix in front of every field path (a source
// adds "spec." or "policies[2].").
func (ps Problems) Prefixed(prefix string) Problems {
	out := make(Problems, len(ps))
	for i, p := range ps {
		out[i] = Problem{prefix + p.Field, p.Detail}
	}
	return out
}

func (ps *Problems) add(field, format string, args ...any) {
	*ps = append(*ps, Problem{field, fmt.Sprintf(format, args...)})
}

// Validate returns every problem of p (nil when it has none), as a
// Problems error. Call Default first for a source's defaults.
func (p *Policy) Validate() error {
	var ps Problems
	switch p.Mode {
	case Enforce, Audit:
	default:
		ps.add("mode", "%q is not a mode: want %q or %q", p.Mode, Enforce, Audit)
	}
	switch p.FailMode {
	case FailOpen, FailClosed:
	default:
		ps.add("failMode", "%q is not a fail mode: want %q or %q", p.FailMode, FailOpen, FailClosed)
	}
	if p.Unit != "" {
		if !p.PodSelector.Empty() {
			ps.add("podSelector", "a policy for a unit or cgroup selects no pods")
		}
		if strings.ContainsAny(p.Unit, " \t\n") || (!strings.HasPrefix(p.Unit, "/") && !strings.Contains(p.Unit, ".")) {
			ps.add("unit", "%q is neither a systemd unit (app.service) nor a cgroup path (/...)", p.Unit)
		}
	}
	if len(p.ExcludeNamespaces) > 0 && (p.Namespace != "" || p.Unit != "") {
		ps.add("excludeNamespaces", "only a policy of every namespace excludes namespaces")
	}
	validateSelector(&ps, "podSelector", p.PodSelector)
	if len(p.Egress) == 0 {
		ps.add("egress", "no rules: a policy allows at least one name")
	}
	for i, r := range p.Egress {
		at := fmt.Sprintf("egress[%d]", i)
		if len(r.Names) == 0 {
			ps.add(at+".names", "no names")
		}
		for j, n := range r.Names {
			if err := checkName(n); err != "" {
				ps.add(fmt.Sprintf("%s.names[%d]", at, j), "%q: %s", n, err)
			}
		}
		for j, port := range r.Ports {
			pat := fmt.Sprintf("%s.ports[%d]", at, j)
			if port.Port < 1 || port.Port > 65535 {
				ps.add(pat+".port", "%d is not a port (1-65535)", port.Port)
			}
			switch port.Protocol {
			case TCP, UDP:
			default:
				ps.add(pat+".protocol", "%q is not a protocol: want %q or %q", port.Protocol, TCP, UDP)
			}
		}
	}
	if ps == nil {
		return nil
	}
	return ps
}

// checkName says what is wrong with an allowed name ("" if nothing): a
// DNS name (labels of letters, digits, '-' and '_', 1-63 bytes, no '-' at
// either end, 253 bytes in all), optionally after a "*." wildcard label.
func checkName(n string) string {
	if n == "" {
		return "empty name"
	}
	base := strings.TrimSuffix(n, ".")
	if rest, ok := strings.CutPrefix(base, "*."); ok {
		if rest == "" {
			return "a wildcard needs a domain after \"*.\""
		}
		base = rest
	}
	if base == "*" {
		return "\"*\" alone would allow every name: list the names, or use audit mode to find them"
	}
	if strings.Contains(base, "*") {
		return "a wildcard is only \"*.\" in front of a domain (\"*.example.com\"); it matches every depth"
	}
	if len(base) > 253 {
		return "longer than 253 bytes"
	}
	for label := range strings.SplitSeq(base, ".") {
		if label == "" {
			return "empty label"
		}
		if len(label) > 63 {
			return fmt.Sprintf("label %q is longer than 63 bytes", label)
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Sprintf("label %q starts or ends with '-'", label)
		}
		for i := 0; i < len(label); i++ {
			if c := label[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Sprintf("label %q has %q: a name has letters, digits, '-' and '_'", label, c)
			}
		}
	}
	return ""
}

func validateSelector(ps *Problems, at string, s Selector) {
	for k, v := range s.MatchLabels {
		if err := checkLabelKey(k); err != "" {
			ps.add(at+".matchLabels", "key %q: %s", k, err)
		}
		if err := checkLabelValue(v); err != "" {
			ps.add(at+".matchLabels["+k+"]", "value %q: %s", v, err)
		}
	}
	for i, r := range s.MatchExpressions {
		rat := fmt.Sprintf("%s.matchExpressions[%d]", at, i)
		if err := checkLabelKey(r.Key); err != "" {
			ps.add(rat+".key", "%q: %s", r.Key, err)
		}
		switch r.Operator {
		case In, NotIn:
			if len(r.Values) == 0 {
				ps.add(rat+".values", "operator %s needs at least one value", r.Operator)
			}
			for j, v := range r.Values {
				if err := checkLabelValue(v); err != "" {
					ps.add(fmt.Sprintf("%s.values[%d]", rat, j), "%q: %s", v, err)
				}
			}
		case Exists, DoesNotExist:
			if len(r.Values) != 0 {
				ps.add(rat+".values", "operator %s takes no values", r.Operator)
			}
		default:
			ps.add(rat+".operator", "%q is not an operator: want In, NotIn, Exists or DoesNotExist", r.Operator)
		}
	}
}

// checkLabelKey checks a Kubernetes label key: [prefix/]name, the prefix a
// DNS subdomain of at most 253 bytes, the name at most 63 bytes.
func checkLabelKey(k string) string {
	name := k
	if prefix, n, ok := strings.Cut(k, "/"); ok {
		if prefix == "" || len(prefix) > 253 || checkName(prefix) != "" || strings.Contains(prefix, "_") {
			return "the prefix is not a DNS subdomain"
		}
		name = n
	}
	if name == "" {
		return "empty name"
	}
	return checkLabelValue(name)
}

// checkLabelValue checks a label value (and a key's name part): at most 63
// bytes of alphanumerics, '-', '_' and '.', starting and ending with an
// alphanumeric; empty is a valid value.
func checkLabelValue(v string) string {
	if len(v) > 63 {
		return "longer than 63 bytes"
	}
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !alnum(c) && c != '-' && c != '_' && c != '.' {
			return fmt.Sprintf("has %q", c)
		}
	}
	if v != "" && (!alnum(v[0]) || !alnum(v[len(v)-1])) {
		return "must start and end with a letter or digit"
	}
	return ""
}

package egresspolicy

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// Set is an immutable set of valid policies; sources publish a new one on
// every change. A nil or empty Set selects nothing (egress enforcement is
// off).
type Set struct {
	policies []*Policy

	mu     sync.Mutex
	merged map[string]*Policy // by the indexes of the policies combined
}

// NewSet validates and copies ps into a Set, in a stable order (by ID). It
// fails, naming every problem, when one policy is invalid or two share an
// ID: a source filters out what it does not accept before.
func NewSet(ps []Policy) (*Set, error) {
	s := &Set{merged: map[string]*Policy{}}
	var errs []error
	seen := map[string]bool{}
	for i := range ps {
		p := ps[i].clone()
		if err := p.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("policy %s: %w", p.ID(), err))
			continue
		}
		if seen[p.ID()] {
			errs = append(errs, fmt.Errorf("policy %s: listed twice", p.ID()))
			continue
		}
		seen[p.ID()] = true
		p.ix.add(p.Egress)
		s.policies = append(s.policies, p)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	slices.SortFunc(s.policies, func(a, b *Policy) int { return cmp.Compare(a.ID(), b.ID()) })
	return s, nil
}

// Len is the number of policies.
func (s *Set) Len() int {
	if s == nil {
		return 0
	}
	return len(s.policies)
}

// Policies returns the policies in ID order; they must not be changed.
func (s *Set) Policies() []*Policy {
	if s == nil {
		return nil
	}
	return slices.Clone(s.policies)
}

// Select returns the policy that governs w: the one policy selecting it,
// or the combination of all that do (see the package doc); false when
// none does. A combination is built once per set of policies and kept.
func (s *Set) Select(w Workload) (*Policy, bool) {
	if s == nil {
		return nil, false
	}
	var hit []int
	for i, p := range s.policies {
		if p.selects(w) {
			hit = append(hit, i)
		}
	}
	switch len(hit) {
	case 0:
		return nil, false
	case 1:
		return s.policies[hit[0]], true
	}
	var key strings.Builder
	for _, i := range hit {
		key.WriteString(strconv.Itoa(i))
		key.WriteByte(',')
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if m, ok := s.merged[key.String()]; ok {
		return m, true
	}
	m := s.combine(hit)
	s.merged[key.String()] = m
	return m, true
}

// combine builds the policy of several: the union of their rules, the
// stricter of each mode.
func (s *Set) combine(hit []int) *Policy {
	m := &Policy{Source: "combined", Mode: Audit, FailMode: FailOpen}
	var ids []string
	for _, i := range hit {
		p := s.policies[i]
		ids = append(ids, p.ID())
		m.Egress = append(m.Egress, p.Egress...)
		if p.Mode == Enforce {
			m.Mode = Enforce
		}
		if p.FailMode == FailClosed {
			m.FailMode = FailClosed
		}
		m.ClusterInternal = m.ClusterInternal || p.ClusterInternal
		m.Namespace, m.Unit = p.Namespace, p.Unit
	}
	m.Name = strings.Join(ids, ", ")
	m.ix.add(m.Egress)
	return m
}

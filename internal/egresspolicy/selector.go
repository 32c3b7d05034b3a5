package egresspolicy

import (
	"maps"
	"slices"
)

// Operator is a label selector requirement's operator.
type Operator string

const (
	In           Operator = "In"
	NotIn        Operator = "NotIn"
	Exists       Operator = "Exists"
	DoesNotExist Operator = "DoesNotExist"
)

// Requirement is one matchExpressions entry.
type Requirement struct {
	Key      string   `json:"key"`
	Operator Operator `json:"operator"`
	Values   []string `json:"values,omitempty"`
}

// Selector is a Kubernetes label selector (metav1.LabelSelector's
// semantics, without apimachinery): every matchLabels pair and every
// requirement must hold; an empty selector matches every label set.
type Selector struct {
	MatchLabels      map[string]string `json:"matchLabels,omitempty"`
	MatchExpressions []Requirement     `json:"matchExpressions,omitempty"`
}

// Empty reports whether s selects everything.
func (s Selector) Empty() bool { return len(s.MatchLabels) == 0 && len(s.MatchExpressions) == 0 }

// Matches reports whether labels satisfy s. It assumes s is valid.
func (s Selector) Matches(labels map[string]string) bool {
	for k, v := range s.MatchLabels {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	for _, r := range s.MatchExpressions {
		v, ok := labels[r.Key]
		switch r.Operator {
		case In:
			if !ok || !slices.Contains(r.Values, v) {
				return false
			}
		case NotIn:
			// As Kubernetes: a pod without the key is not "in" the
			// values, so NotIn holds.
			if ok && slices.Contains(r.Values, v) {
				return false
			}
		case Exists:
			if !ok {
				return false
			}
		case DoesNotExist:
			if ok {
				return false
			}
		default:
			return false
		}
	}
	return true
}

func (s Selector) clone() Selector {
	c := Selector{MatchLabels: maps.Clone(s.MatchLabels)}
	for _, r := range s.MatchExpressions {
		c.MatchExpressions = append(c.MatchExpressions, Requirement{r.Key, r.Operator, slices.Clone(r.Values)})
	}
	return c
}

// Command promql-metrics parses PromQL expressions with Prometheus' own parser
// and prints the metric names each one selects. It reads a JSON array of
// expressions on stdin and writes a JSON array of {"expr", "metrics", "error"}
// in the same order. test/deploy uses it to check that every metric the
// dashboard and the alerts name exists on a live agent.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Expr    string   `json:"expr"`
	Metrics []string `json:"metrics"`
	Error   string   `json:"error,omitempty"`
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promql-metrics: read a JSON array of expressions:", err)
		os.Exit(2)
	}
	out := make([]result, 0, len(exprs))
	for _, e := range exprs {
		out = append(out, parse(e))
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "promql-metrics:", err)
		os.Exit(1)
	}
}

// parse returns the metric names expr selects: each vector selector's name,
// or its __name__ equality matcher. A selector with neither is reported as
// an error: it names no metric that could be checked.
func parse(expr string) result {
	r := result{Expr: expr, Metrics: []string{}}
	ast, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	parser.Inspect(ast, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
				name = m.Value
			}
		}
		if name == "" {
			r.Error = fmt.Sprintf("selector %s names no metric", vs)
			return nil
		}
		if !slices.Contains(r.Metrics, name) {
			r.Metrics = append(r.Metrics, name)
		}
		return nil
	})
	slices.Sort(r.Metrics)
	return r
}

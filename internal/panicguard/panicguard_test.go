package panicguard

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

func TestRecoveredCountsByStageAndLogsTheStack(t *testing.T) {
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	c, err := New(reg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() { c.Recovered(StageUpstream, recover(), "name", "x.example.") }()
		var m map[string]int
		m["boom"]++ // a nil map write: a real runtime panic
	}()
	if got := metrictest.Value(t, reg, "meshdns_panics_total", "stage", StageUpstream); got != 1 {
		t.Errorf("meshdns_panics_total{stage=upstream} = %v, want 1", got)
	}
	if got := metrictest.Value(t, reg, "meshdns_panics_total", "stage", StageServe); got != 0 {
		t.Errorf("meshdns_panics_total{stage=serve} = %v, want 0 (present from the start)", got)
	}
	out := logs.String()
	for _, want := range []string{"assignment to entry in nil map", "stage=upstream", "name=x.example.", "panicguard_test.go"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	if _, err := New(reg, nil); err == nil {
		t.Errorf("a second Counter on the same registry registered without an error")
	}
	c.Unregister()
	if _, err := New(reg, nil); err != nil {
		t.Errorf("New after Unregister: %v", err)
	}
}

func TestNilCounterOnlyLogs(t *testing.T) {
	var c *Counter
	func() {
		defer func() { c.Recovered(StageServe, recover()) }()
		panic("injected")
	}()
	c.Unregister()
}

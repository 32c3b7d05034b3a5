package agenttest

import (
	"bytes"
	"strings"
	"sync"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Log is a process's output, written by the process and read by the test at
// once.
type Log struct {
	// Max, when not 0, is how many bytes it keeps; later output is dropped
	// (an agent under a flood of warnings must not grow the test's memory).
	Max int

	mu sync.Mutex
	b  bytes.Buffer
}

func (l *Log) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	keep := p
	if l.Max > 0 && l.b.Len()+len(p) > l.Max {
		keep = p[:max(0, l.Max-l.b.Len())]
	}
	l.b.Write(keep)
	return len(p), nil // what is dropped still counts as written: the process never blocks on it
}

// String is everything written so far.
func (l *Log) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Tail is the last n lines.
func (l *Log) Tail(n int) string {
	lines := strings.Split(l.String(), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Contains reports whether s was written.
func (l *Log) Contains(s string) bool { return strings.Contains(l.String(), s) }

// WaitFor waits up to timeout until s was written.
func (l *Log) WaitFor(s string, timeout time.Duration) bool {
	return testenv.WaitFor(timeout, func() bool { return l.Contains(s) })
}

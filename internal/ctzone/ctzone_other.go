//go:build !linux

package ctzone

import (
	"context"
	"errors"
)

// errNotLinux: iptables capture and conntrack zones are Linux's.
var errNotLinux = errors.New("the iptables fallback (iptables, conntrack zones) needs Linux")

// Rules is the iptables capture; on this system it cannot be installed.
type Rules struct{}

// New fails: the fallback needs Linux.
func New(Config) (*Rules, error) { return nil, errNotLinux }

// Start fails: the fallback needs Linux.
func (*Rules) Start(context.Context) error { return errNotLinux }

// Backend is empty: nothing is installed.
func (*Rules) Backend() string { return "" }

// StopCapture fails: the fallback needs Linux.
func (*Rules) StopCapture() error { return errNotLinux }

// Handoff does nothing: nothing is installed.
func (*Rules) Handoff() {}

// Close fails: the fallback needs Linux.
func (*Rules) Close() error { return errNotLinux }

// Probe fails: the fallback needs Linux.
func Probe(string) error { return errNotLinux }

// Cleanup fails: the fallback needs Linux.
func Cleanup(string) ([]string, error) { return nil, errNotLinux }

// ReadConntrackStatus fails: conntrack is Linux's.
func ReadConntrackStatus() (*ConntrackStatus, error) { return nil, errNotLinux }

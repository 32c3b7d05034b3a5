//go:build !linux

package filesource

// background runs fn; only Linux lowers a thread's priority.
func background(fn func()) { fn() }

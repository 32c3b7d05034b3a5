// Package agenttest runs the meshdns-ebpf binary (and the test programs around
// it) as children of a test: it builds each program once per test binary,
// starts it with its output in a Log the test can wait on, and stops or kills
// it, reporting its exit status. test/e2e, test/kube, test/deploy and
// test/overload share it, so an agent process is started and stopped the same
// way everywhere.
//
// The test decides how the process is placed (a cgroup, a network namespace,
// capabilities: internal/testenv.Command) and hands the prepared *exec.Cmd to
// Start; plain commands come from Command, which dies with the test binary.
package agenttest

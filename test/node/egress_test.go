package node

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/connload"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// DNS-gated egress on the node (docs/egress.md): the agent installed with
// components/egress, an "internet" of 198.18.0.0/15 routed from the node, a
// DNSEgressPolicy in enforce mode in one namespace and Istio's REGISTRY_ONLY in
// another, and the resolve -> connect client (test/e2e/testdata/egressload, musl)
// run in their pods.
const (
	egressNSPolicy   = "egress-policy"   // a DNSEgressPolicy selects its client
	egressNSRegistry = "egress-registry" // a Sidecar says REGISTRY_ONLY
	egressAllowed    = "allowed.egress.example"
	egressAllowedIP  = "198.18.0.10"
	egressOther      = "other.egress.example" // resolved, never allowed
	egressOtherIP    = "198.18.0.20"
	egressRegistered = "registered.egress.example" // egress-registry's ServiceEntry host
	egressRegIP      = "198.18.0.30"
	egressFresh      = "fresh.egress.example" // a new address of egressFreshNet on every query, TTL 1
	egressFreshNet   = "198.18.128.0/17"
	egressNever      = "198.19" // a /16 no answer names
	egressPort       = 8080
	egressCycles     = 50
	// egressRolloutCount is how many rollout restarts run under egress load.
	egressRolloutCount = 10
)

func egressWorkloads() string {
	client := func(ns string) string {
		return fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %s, labels: {app: client}}
spec:
  terminationGracePeriodSeconds: 1
  dnsConfig: {options: [{name: timeout, value: "2"}, {name: attempts, value: "1"}]}
  containers:
    - {name: client, image: %s, imagePullPolicy: Never, command: [/pause]}
`, ns, muslImage)
	}
	return `apiVersion: v1
kind: Namespace
metadata: {name: ` + egressNSPolicy + `}
---
apiVersion: v1
kind: Namespace
metadata: {name: ` + egressNSRegistry + `}
---
apiVersion: meshdns.io/v1alpha1
kind: DNSEgressPolicy
metadata: {name: allow-one, namespace: ` + egressNSPolicy + `}
spec:
  podSelector: {matchLabels: {app: client}}
  egress: [{names: [` + egressAllowed + `, ` + egressFresh + `]}]
  mode: enforce
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: ` + egressNSRegistry + `}
spec:
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: registered, namespace: ` + egressNSRegistry + `}
spec:
  hosts: [` + egressRegistered + `]
  addresses: [` + egressRegIP + `]
  ports: [{number: ` + fmt.Sprint(egressPort) + `, name: tcp, protocol: TCP}]
  location: MESH_EXTERNAL
  resolution: NONE
` + client(egressNSPolicy) + client(egressNSRegistry)
}

// egressOverlay writes, into dir, the test overlay plus components/egress with
// the node's Pod and Service CIDRs as its internal destinations: what a user's
// overlay adds to install the agent with egress.
func (e *env) egressOverlay(t *testing.T, dir string) string {
	t.Helper()
	plain := overlay(t, e.root, filepath.Join(e.dir, "overlay"), e.tag, e.n.UnifiedRoot)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	rel := func(p string) string {
		r, err := filepath.Rel(dir, p)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	service, _, _ := strings.Cut(kubetest.ServiceCIDRs, ",")
	k := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
components:
  - %s
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: meshdns-ebpf, namespace: meshdns-system}
      spec: {template: {spec: {containers: [{name: agent, env: [
        {name: MESHDNS_EGRESS_INTERNAL_CIDRS, value: "%s,%s"}]}]}}}
`, rel(plain), rel(filepath.Join(e.root, "deploy", "kubernetes", "components", "egress")), nodetest.PodCIDR, service)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// applyAgent applies the overlay ov and waits until its agent serves.
func (e *env) applyAgent(t *testing.T, ov string) agentPod {
	t.Helper()
	if out, err := e.n.Kubectl("apply", "-k", ov); err != nil {
		t.Fatalf("kubectl apply -k %s: %v\n%s", ov, err, out)
	}
	if out, err := e.n.Kubectl("-n", agentNS, "rollout", "status", "ds/meshdns-ebpf", "--timeout=180s"); err != nil {
		t.Fatalf("kubectl rollout status: %v\n%s\n%s", err, out, e.podsAndEvents(t))
	}
	return e.waitSettled(t, 3*time.Minute)
}

// checkEgress installs the agent with egress, runs the clients of both
// namespaces and puts the plain install back for the checks after it.
func (e *env) checkEgress(t *testing.T) {
	// The internet: 198.18.0.0/15 in a namespace of its own, routed from the
	// node's namespace, which the pods reach through the CNI bridge.
	world := testenv.NewNetns(t, "nodetest-inet")
	testenv.Veth(t, e.n.Netns, "vinet", "169.254.110.1/30", world, "eth0", "169.254.110.2/30")
	e.n.Netns.IP(t, "route", "add", "198.18.0.0/15", "via", "169.254.110.2")
	world.IP(t, "route", "add", "default", "via", "169.254.110.1")
	e.n.Netns.Exec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	inet := testenv.StartInternet(t, world, netip.MustParsePrefix("198.18.0.0/15"), egressPort)
	e.upstream.Set(egressAllowed, netip.MustParseAddr(egressAllowedIP))
	e.upstream.Set(egressOther, netip.MustParseAddr(egressOtherIP))
	e.upstream.SetFresh(egressFresh, netip.MustParsePrefix(egressFreshNet), 1)

	// The Sidecar CRD before the agent starts (istioegress watches Sidecars).
	e.n.CP.InstallIstioCRD(t, kubetest.SidecarCRD)
	start := time.Now()
	p := e.applyAgent(t, e.egressOverlay(t, filepath.Join(e.dir, "overlay-egress")))
	e.rep.add(t, "agent %s with components/egress Ready and serving %v after `kubectl apply -k`", p.Metadata.Name, time.Since(start).Round(time.Millisecond))
	defer func() {
		// Back to the plain install for Uninstall and what follows.
		for _, ns := range []string{egressNSPolicy, egressNSRegistry} {
			if out, err := e.n.Kubectl("delete", "namespace", ns, "--timeout=120s"); err != nil {
				t.Errorf("delete namespace %s: %v\n%s", ns, err, out)
			}
		}
		p := e.applyAgent(t, filepath.Join(e.dir, "overlay"))
		e.rep.add(t, "plain install back: agent %s", p.Metadata.Name)
	}()

	applyStdin(t, e.n, egressWorkloads())
	for _, ns := range []string{egressNSPolicy, egressNSRegistry} {
		if out, err := e.n.Kubectl("wait", "--for=condition=Ready", "pod", "client", "-n", ns, "--timeout=100s"); err != nil {
			t.Fatalf("pod %s/client not Ready: %v\n%s\n%s", ns, err, out, e.podsAndEvents(t))
		}
	}
	// The policy's status: Accepted=True, written by the agent.
	waitFor(t, 30*time.Second, "DNSEgressPolicy allow-one Accepted=True", func() bool {
		out, _ := e.n.Kubectl("get", "dnsegresspolicy", "-n", egressNSPolicy, "allow-one",
			"-o", `jsonpath={.status.conditions[?(@.type=="Accepted")].status}`)
		return out == "True"
	})
	e.rep.add(t, "DNSEgressPolicy %s/allow-one: Accepted=True", egressNSPolicy)

	e.checkFirstConnect(t)
	// Both policies in force (the Sidecar's comes through its own watch):
	// wait until a never-resolved address is denied.
	for _, ns := range []string{egressNSPolicy, egressNSRegistry} {
		waitFor(t, 30*time.Second, ns+"/client selected (a never-resolved connect denied)", func() bool {
			s, err := e.egressRun(ns, "-n", "1", "-x", egressNever, egressAllowed)
			return err == nil && s.EPERM == 1
		})
	}

	acceptedBefore := inet.Accepted()
	for _, c := range []struct {
		ns, what string
		args     []string
		allowed  bool
	}{
		{egressNSPolicy, "the allowed name", []string{egressAllowed}, true},
		{egressNSPolicy, "another resolved name", []string{egressOther}, false},
		{egressNSPolicy, "never-resolved addresses", []string{"-x", egressNever, egressAllowed}, false},
		{egressNSRegistry, "the ServiceEntry host", []string{egressRegistered}, true},
		{egressNSRegistry, "another external name", []string{egressOther}, false},
		{egressNSRegistry, "never-resolved addresses", []string{"-x", egressNever, egressRegistered}, false},
	} {
		s, err := e.egressRun(c.ns, append([]string{"-n", fmt.Sprint(egressCycles)}, c.args...)...)
		if err != nil {
			t.Errorf("%s, %s: %v", c.ns, c.what, err)
			continue
		}
		e.rep.add(t, "%s, %s: %d cycles, %d connected, %d EPERM, %d other failures (connect after the answer p99 %d µs)",
			c.ns, c.what, s.Cycles, s.OK, s.EPERM, s.Failed, s.P99)
		switch {
		case s.Cycles != egressCycles:
			t.Errorf("%s, %s: %d cycles, want %d", c.ns, c.what, s.Cycles, egressCycles)
		case c.allowed && s.OK != s.Cycles:
			t.Errorf("%s, %s: want every connect through, got %+v", c.ns, c.what, s)
		case !c.allowed && s.EPERM != s.Cycles:
			t.Errorf("%s, %s: want every connect denied with EPERM, got %+v", c.ns, c.what, s)
		}
	}
	e.rep.add(t, "the internet accepted %d connections", inet.Accepted()-acceptedBefore)
	if got := inet.Accepted() - acceptedBefore; got < 2*egressCycles {
		t.Errorf("the internet accepted %d connections, want at least %d (the allowed ones)", got, 2*egressCycles)
	}
	if !t.Failed() {
		e.egressRollouts(t)
	}
}

// checkFirstConnect runs a pod the enforce policy selects whose container's
// first act is a lookup and a connect to a never-resolved address: the pod is
// selected when kubelet makes its cgroup, before its containers start, so that
// connect is denied.
func (e *env) checkFirstConnect(t *testing.T) {
	const name = "first-connect"
	applyStdin(t, e.n, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: %s, labels: {app: client}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  dnsConfig: {options: [{name: timeout, value: "2"}, {name: attempts, value: "1"}]}
  containers:
    - name: client
      image: %s
      imagePullPolicy: Never
      command: [/usr/local/bin/egressload, -p, "%d", -n, "1", -x, "%s", %s]
`, name, egressNSPolicy, muslImage, egressPort, egressNever, egressAllowed))
	start := time.Now()
	waitFor(t, 100*time.Second, "pod "+name+" ran", func() bool {
		out, _ := e.n.Kubectl("get", "pod", "-n", egressNSPolicy, name, "-o", "jsonpath={.status.phase}")
		return out == "Succeeded" || out == "Failed"
	})
	out, err := e.n.Kubectl("logs", "-n", egressNSPolicy, name)
	s, perr := connload.Parse(out, 5)
	if perr != nil {
		t.Fatalf("pod %s: %v: %v", name, err, perr)
	}
	e.rep.add(t, "%s/%s, whose container's first act is a connect to a never-resolved address: %d EPERM, %d connected, %d other failures (%v from its creation to its end)",
		egressNSPolicy, name, s.EPERM, s.OK, s.Failed, time.Since(start).Round(time.Millisecond))
	if s.Cycles != 1 || s.EPERM != 1 {
		t.Errorf("pod %s's first connect: %+v; want it denied with EPERM (the pod selected before its container started)", name, s)
	}
}

// egressRollouts restarts the DaemonSet egressRolloutCount times, each as
// RolloutRestart does (checkRollout: the DNS load, seamless resolution), while
// the policy's pod runs resolve -> connect cycles of a name that answers a new
// address every time: an EPERM is a false deny.
func (e *env) egressRollouts(t *testing.T) {
	stop := make(chan struct{})
	done := make(chan connload.Summary)
	go func() {
		var total connload.Summary
		for {
			select {
			case <-stop:
				done <- total
				return
			default:
			}
			s, err := e.egressRun(egressNSPolicy, "-n", "100", egressFresh)
			if err != nil {
				total.Fails = append(total.Fails, err.Error())
				continue
			}
			total.Cycles += s.Cycles
			total.OK += s.OK
			total.EPERM += s.EPERM
			total.Failed += s.Failed
			total.Fails = append(total.Fails, s.Fails...)
		}
	}()
	start := time.Now()
	for i := range egressRolloutCount {
		t.Run(fmt.Sprintf("rollout%d", i+1), func(t *testing.T) { e.checkRollout(t, "restart", 0) })
	}
	close(stop)
	total := <-done
	e.rep.add(t, "%d rollout restarts in %v under %s's resolve -> connect cycles of %s (TTL 1, a new address every answer): %d cycles, %d connected, %d EPERM (false denies), %d other failures",
		egressRolloutCount, time.Since(start).Round(time.Millisecond), egressNSPolicy, egressFresh, total.Cycles, total.OK, total.EPERM, total.Failed)
	if len(total.Fails) > 0 {
		t.Logf("failed cycles (first %d): %s", min(len(total.Fails), 20), strings.Join(total.Fails[:min(len(total.Fails), 20)], "; "))
	}
	if total.EPERM > 0 {
		t.Errorf("%d false denies of an allowed name across the rollouts", total.EPERM)
	}
	if total.Cycles == 0 {
		t.Errorf("no resolve -> connect cycle ran during the rollouts")
	}
}

// egressRun runs egressload in ns/client with args and reads its report.
func (e *env) egressRun(ns string, args ...string) (connload.Summary, error) {
	out, err := e.n.Kubectl(append([]string{"exec", "-n", ns, "client", "--", "egressload", "-p", fmt.Sprint(egressPort)}, args...)...)
	s, perr := connload.Parse(out, 5)
	if perr != nil {
		return s, fmt.Errorf("egressload %v: %v: %w", args, err, perr)
	}
	return s, nil
}

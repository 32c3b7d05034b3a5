package agent

import (
	"flag"
	"maps"
	"slices"
	"testing"
)

// boolLike lists the flags of fs that take an on/off value: they accept
// "true" and "false" and refuse anything else. Each is tried on a scratch
// flag set from newFS, so nothing here changes fs.
func boolLike(newFS func() *flag.FlagSet) []string {
	var names []string
	newFS().VisitAll(func(f *flag.Flag) {
		try := func(v string) bool { return newFS().Lookup(f.Name).Value.Set(v) == nil }
		if try("true") && try("false") && !try("not-a-boolean") {
			names = append(names, f.Name)
		}
	})
	slices.Sort(names)
	return names
}

// isBoolFlag is what the flag package asks to allow the bare form.
func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// Every on/off flag of `run` takes the bare form, =true and =false, and
// the bare form never takes the next argument as its value (it was so for
// --authoritative: `run --authoritative --remote-kubeconfigs DIR` failed
// with `invalid value "--remote-kubeconfigs" for flag -authoritative`).
func TestBooleanFlagsOfRun(t *testing.T) {
	fields := map[string]func(*Config) bool{
		"capture-all":          func(c *Config) bool { return c.CaptureAll },
		"capture-loopback":     func(c *Config) bool { return c.CaptureLoopback },
		"persist":              func(c *Config) bool { return c.Persist },
		"kubernetes":           func(c *Config) bool { return c.InCluster },
		"authoritative":        func(c *Config) bool { return c.Authoritative },
		"service-entries":      func(c *Config) bool { return c.Mesh.ServiceEntries },
		"istio-remote-secrets": func(c *Config) bool { return c.Mesh.IstioRemoteSecrets },
		"attribution":          func(c *Config) bool { return c.Workloads.Attribution },
		"namespace-metrics":    func(c *Config) bool { return c.Workloads.Namespaces },
		"egress":               func(c *Config) bool { return c.Egress.Enabled },
	}
	newFS := func() *flag.FlagSet { _, fs := runFlags(); return fs }
	if got, want := boolLike(newFS), slices.Sorted(maps.Keys(fields)); !slices.Equal(got, want) {
		t.Fatalf("on/off flags of run: %v; this test covers %v (add the new one to the table)", got, want)
	}
	parse := func(t *testing.T, args ...string) (*Config, *flag.FlagSet) {
		t.Helper()
		c, fs := runFlags()
		if err := fs.Parse(args); err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		return c, fs
	}
	for name, get := range fields {
		t.Run(name, func(t *testing.T) {
			_, fs := parse(t)
			if !isBoolFlag(fs.Lookup(name)) {
				t.Errorf("--%s is not a boolean flag: its bare form takes the next argument as its value", name)
			}
			for _, tc := range []struct {
				args []string
				want bool
			}{
				{[]string{"--" + name}, true},
				{[]string{"--" + name + "=true"}, true},
				{[]string{"--" + name + "=false"}, false},
				{[]string{"-" + name}, true},
			} {
				if c, _ := parse(t, tc.args...); get(c) != tc.want {
					t.Errorf("%v: %v, want %v", tc.args, get(c), tc.want)
				}
			}
			// The bare form followed by another flag and its value.
			c, fs := parse(t, "--"+name, "--remote-kubeconfigs", "/dir", "--mode", "off")
			if !get(c) || c.Mesh.RemoteKubeconfigs != "/dir" || c.Mode != ModeOff || fs.NArg() != 0 {
				t.Errorf("--%s --remote-kubeconfigs /dir --mode off: %s=%v, remote-kubeconfigs %q, mode %q, args %v",
					name, name, get(c), c.Mesh.RemoteKubeconfigs, c.Mode, fs.Args())
			}
		})
	}
}

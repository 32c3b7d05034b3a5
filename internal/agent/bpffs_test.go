package agent

import (
	"strings"
	"testing"
)

// The mount holding a pin directory, and its propagation, from mountinfo.
func TestMountOf(t *testing.T) {
	info := strings.Join([]string{
		`27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw`,
		`30 27 0:26 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw`,
		`41 30 0:33 / /sys/fs/bpf rw,nosuid,nodev,noexec,relatime shared:16 - bpf bpf rw,mode=700`,
		`501 480 0:33 / /host/sys/fs/bpf rw,relatime master:16 - bpf bpf rw,mode=700`,
		`502 480 0:33 / /priv/bpf rw,relatime - bpf bpf rw`,
		`503 480 0:33 / /both/bpf rw,relatime shared:40 master:16 - bpf bpf rw`,
		`504 480 0:34 / /tmp/with\040space rw,relatime - bpf bpf rw`,
		`garbage`,
	}, "\n")
	for dir, want := range map[string]string{
		"/sys/fs/bpf":               "/sys/fs/bpf (bpf, shared)",
		"/sys/fs/bpf/meshdns/links": "/sys/fs/bpf (bpf, shared)",
		"/sys/fs/bpfx":              "/sys (sysfs, shared)",
		"/host/sys/fs/bpf":          "/host/sys/fs/bpf (bpf, slave)",
		"/priv/bpf/":                "/priv/bpf (bpf, private)",
		"/both/bpf":                 "/both/bpf (bpf, shared and slave)",
		"/tmp/with space/meshdns":   "/tmp/with space (bpf, private)",
		"/var/lib":                  "/ (ext4, shared)",
	} {
		m, ok := mountOf(info, dir)
		if !ok || m.String() != want {
			t.Errorf("mountOf(%q) = %v %v, want %s", dir, m, ok, want)
		}
	}
	if _, ok := mountOf("garbage\n", "/x"); ok {
		t.Errorf("a mount found in garbage")
	}
}

// A private bpffs mount is worth a warning in a pod only (outside one, the
// agent runs in the node's own mount namespace).
func TestBPFFSWarning(t *testing.T) {
	for _, tc := range []struct {
		prop  string
		inPod bool
		warn  bool
	}{{"private", true, true}, {"private", false, false}, {"slave", true, false}, {"shared", true, false}, {"shared and slave", true, false}} {
		w := bpffsWarning(mount{Point: "/sys/fs/bpf", FSType: "bpf", Propagation: tc.prop}, tc.inPod)
		if (w != "") != tc.warn || (w != "" && !strings.Contains(w, "mount --make-shared /sys/fs/bpf")) {
			t.Errorf("%s, in a pod %v: warning %q", tc.prop, tc.inPod, w)
		}
	}
}

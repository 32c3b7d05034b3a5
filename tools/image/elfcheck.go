package main

import (
	"bytes"
	"debug/elf"
	"fmt"
	"path"
	"strings"
)

// platform is what the tool knows about one target architecture.
type platform struct {
	arch, variant string
	triplet       string // Debian multiarch directory
	machine       elf.Machine
}

var platforms = map[string]platform{
	"amd64": {arch: "amd64", triplet: "x86_64-linux-gnu", machine: elf.EM_X86_64},
	"arm64": {arch: "arm64", variant: "v8", triplet: "aarch64-linux-gnu", machine: elf.EM_AARCH64},
}

// checkELF checks every ELF file of the tree: built for the platform's machine,
// its program interpreter present, and every DT_NEEDED library found in the
// dynamic loader's default directories. A package missing from the lock, or a
// file the exclusions dropped that something links against, fails here rather
// than when the fallback first runs iptables on a node.
func checkELF(t fsTree, pf platform) (checked int, err error) {
	dirs := []string{"lib/" + pf.triplet, "usr/lib/" + pf.triplet, "lib", "usr/lib"}
	var problems []string
	for _, name := range t.sorted() {
		f := t[name]
		if f.link != "" || f.dir || !bytes.HasPrefix(f.data, []byte(elf.ELFMAG)) {
			continue
		}
		ef, err := elf.NewFile(bytes.NewReader(f.data))
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		checked++
		if ef.Machine != pf.machine {
			problems = append(problems, fmt.Sprintf("%s: built for %v, want %v", name, ef.Machine, pf.machine))
		}
		for _, p := range ef.Progs {
			if p.Type != elf.PT_INTERP {
				continue
			}
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				problems = append(problems, fmt.Sprintf("%s: read interpreter: %v", name, err))
				continue
			}
			interp := cleanName(strings.TrimRight(string(b), "\x00"))
			if _, ok := t.resolve(interp); !ok {
				problems = append(problems, fmt.Sprintf("%s: program interpreter /%s is not in the image", name, interp))
			}
		}
		libs, err := ef.ImportedLibraries()
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", name, err))
		}
		for _, lib := range libs {
			found := false
			for _, d := range dirs {
				if _, ok := t.resolve(path.Join(d, lib)); ok {
					found = true
					break
				}
			}
			if !found {
				problems = append(problems, fmt.Sprintf("%s: needs %s, which is not in the image", name, lib))
			}
		}
		ef.Close()
	}
	if len(problems) > 0 {
		return checked, fmt.Errorf("ELF check failed:\n  %s", strings.Join(problems, "\n  "))
	}
	return checked, nil
}

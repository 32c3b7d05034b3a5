//go:build !linux

package nodeaddr

// ifaNoDAD: no meaning here (node addresses are added on Linux only).
const ifaNoDAD = 0

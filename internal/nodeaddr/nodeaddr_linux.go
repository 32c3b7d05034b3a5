package nodeaddr

import "golang.org/x/sys/unix"

// ifaNoDAD: an IPv6 address usable at once (no duplicate address detection).
const ifaNoDAD = unix.IFA_F_NODAD

package nametable

// Key is the object key the host's source contributed it under (a Service
// or ServiceEntry "namespace/name", a file entry's host name): for
// listings such as `meshdns-ebpf table`.
func (h *Host) Key() string { return h.key }

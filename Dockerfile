# Multi-stage build of the agent image. Written and reviewed, not built on the
# project's own machines (no container engine there). The BPF objects are committed,
# so the build needs no clang.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/meshdns-ebpf ./cmd/meshdns-ebpf

# iptables and conntrack are needed for the fallback mode.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables conntrack \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/meshdns-ebpf /meshdns-ebpf
LABEL org.opencontainers.image.title="meshdns-ebpf" \
      org.opencontainers.image.description="DNS capture for service meshes with eBPF socket redirects"
ENTRYPOINT ["/meshdns-ebpf"]
CMD ["run"]

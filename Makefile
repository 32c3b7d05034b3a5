# meshdns-ebpf. The two commands of the README:
#   make run    build and run the agent standalone (as root), with the embedded default name table
#   make test   install the test dependencies and run the whole suite (CI runs exactly this)
#   make image  build the OCI image (no container engine needed) into out/image
#   make node-e2e  the DaemonSet on a real single-node cluster of this machine (test/node)

GO        ?= go
BIN       := bin/meshdns-ebpf
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -X github.com/meshdns/meshdns-ebpf/internal/version.Version=$(VERSION)
# Flags for `make run`; override on the command line, e.g.
#   make run RUN_FLAGS="--cgroup /sys/fs/cgroup/unified/mygroup --upstream 127.0.0.1:5300"
RUN_FLAGS ?=
# Flags for go test; the privileged packages run one at a time so the fail-open
# timing checks are not starved on a 2-core machine.
TEST_FLAGS ?= -count=1 -p 1 -timeout 40m

export PATH := $(PATH):/usr/local/go/bin
export GOTOOLCHAIN := local
# grpcnotrace: gRPC (the NDS source's client) leaves out golang.org/x/net/trace,
# whose html/template use makes the linker keep every exported method of every
# type: 82 MB instead of 51 MB for the agent (docs/istio.md).
export GOFLAGS := -buildvcs=false -tags=grpcnotrace

.PHONY: all build run test deps test-deps kube-bin tools-bin istiod-bin node-bin node-e2e unit generate check-generate vet bench bench-budgets bench-egress soak fuzz clean \
	image image-lock image-push

# The image (docs/kubernetes.md). `make image` builds it from deploy/image/debs.lock
# and the agent built here; the same commit gives the same digest. Its .debs are
# cached in IMAGE_CACHE (fetched with apt once). IMAGE_ARCHES="amd64 arm64" builds
# both platforms into one index.
IMAGE_ARCHES      ?= amd64
IMAGE_CACHE       ?= $(CURDIR)/.cache/image
IMAGE_LOCK        ?= $(CURDIR)/deploy/image/debs.lock
IMAGE_OUT         ?= $(CURDIR)/out/image
IMAGE_NAME        ?= localhost/meshdns-ebpf
IMAGE_TAG         ?= $(VERSION)
REVISION          ?= $(shell git rev-parse HEAD 2>/dev/null)
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
IMAGE_TOOL        := $(IMAGE_OUT)/bin/image-tool

all: build

deps:
	@scripts/install-deps.sh --run

# Test dependencies: packages, then the Kubernetes test control plane (etcd,
# kube-apiserver, kube-controller-manager built from Go modules into .cache/kube-bin),
# the test node's binaries (kubelet, kube-scheduler, kube-proxy, kubectl, containerd
# into .cache/node-bin), the chart and monitoring tools (helm, promtool,
# promql-metrics into .cache/tools-bin) and istiod (pilot-discovery, into
# .cache/istiod-bin); minutes cold, nothing when warm. See docs/testing.md.
test-deps:
	@scripts/install-deps.sh
	@scripts/build-kube.sh
	@scripts/build-kube.sh node
	@scripts/build-tools.sh
	@scripts/build-istiod.sh

kube-bin:
	@scripts/build-kube.sh

tools-bin:
	@scripts/build-tools.sh

istiod-bin:
	@scripts/build-istiod.sh

node-bin:
	@scripts/build-kube.sh node

# The node end-to-end test alone (`make test` runs it too): a real single-node
# cluster in namespaces of its own, the DaemonSet installed as docs/kubernetes.md
# says, rollouts and faults under load. Its figures: out/node-e2e.txt.
node-e2e: test-deps
	$(GO) test -count=1 -v -timeout 30m -run '^TestNode$$' ./test/node
	@cat out/node-e2e.txt 2>/dev/null || true

build:
	CGO_ENABLED=0 $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/meshdns-ebpf

run: deps build
	@echo
	@echo "meshdns-ebpf is starting. In another shell, try:"
	@echo "  dig productpage.default.svc.cluster.local      # a mesh name, answered by meshdns"
	@echo "  dig +tcp reviews.default.svc.cluster.local     # the same over TCP"
	@echo "  $(BIN) stats                                   # what the datapath redirected"
	@echo "  $(BIN) status"
	@echo "Stop with Ctrl-C: capture stops and nothing stays attached."
	@echo
	./$(BIN) run --persist=false $(RUN_FLAGS)

generate:
	$(GO) generate ./internal/redirect/...

check-generate:
	scripts/check-bpf-generated.sh

vet:
	$(GO) vet ./...
	cd tools/image && $(GO) vet ./...
	cd tools/prom && $(GO) vet ./promql-metrics
	@# Linux-only parts sit behind build tags with stubs that say so; the rest builds anywhere.
	GOOS=darwin $(GO) build ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# The tests of concurrent state on the query path, under the race detector.
RACE_TESTS := HealthFlips|RateLimitingUpstream|SilentUpstream|PanicInAResolution|PanicOnTheQueryPath|WorkloadBudget|RecoveredCounts

test: test-deps check-generate vet
	@rm -f out/image-test.txt out/node-e2e.txt
	CGO_ENABLED=1 $(GO) test -race -count=1 -run '$(RACE_TESTS)' ./internal/resolver/... ./internal/panicguard
	$(GO) test $(TEST_FLAGS) ./...
	cd tools/image && $(GO) test -count=1 ./...
	@cat out/image-test.txt 2>/dev/null || true
	@cat out/node-e2e.txt 2>/dev/null || true

bench: build
	bench/run.sh

# Only the per-workload budgets lane of the benchmark (a few minutes).
bench-budgets:
	bench/run.sh budgets

# Only the DNS-gated egress lane of the benchmark (a few minutes, root).
bench-egress:
	bench/run.sh egress

# `make fuzz` (not part of `make test`): every fuzz target for FUZZTIME, one at a
# time on one core. FuzzServeDNS: any message gets a well-formed reply within its
# size limit; FuzzPathsAgree: the wire encoder and the dns.Msg encoder render one
# decision as the same response, over generated tables and questions; the nametable targets: the
# streaming reader and decoder agree with Parse. FuzzPathsAgree's coverage varies
# from run to run (shuffled answers, map order in the table builder), so the
# fuzzer would spend a minute minimizing almost every input: it does not minimize.
FUZZTIME ?= 60s
FUZZ_TARGETS := internal/resolver:FuzzServeDNS internal/resolver:FuzzPathsAgree \
	internal/nametable:FuzzEntryDecoderMatchesJSON internal/nametable:FuzzReaderMatchesParse
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
	  min=; case $$t in *:FuzzPathsAgree) min="-fuzzminimizetime 0";; esac; \
	  echo "fuzz $${t#*:} ($(FUZZTIME))"; \
	  $(GO) test -run XXX -fuzz "^$${t#*:}\$$" -fuzztime $(FUZZTIME) $$min -parallel 1 ./$${t%%:*}/; \
	done

# `make soak` (not part of `make test`): SOAK (10 minutes) of mixed load through
# the eBPF datapath while the agent is upgraded and restarted every 30 s, the name
# table is rewritten and the upstream fails; 0 lost queries, RSS printed
# (test/e2e TestSoak). Then SOAK of a noisy workload behind an upstream that
# rate-limits (test/overload): no health flapping, no panic, the agent stays up.
SOAK ?= 10m
soak: test-deps
	MESHDNS_SOAK=$(SOAK) CI=true $(GO) test -count=1 -timeout 60m -v -run '^TestSoak$$' ./test/e2e
	MESHDNS_FLAP_SOAK=$(SOAK) CI=true $(GO) test -count=1 -timeout 60m -v -run '^TestNoisyWorkloadBehindARateLimitingUpstream$$' ./test/overload

image:
	@cd tools/image && CGO_ENABLED=0 $(GO) build -trimpath -o $(IMAGE_TOOL) .
	@IMAGE_CACHE=$(IMAGE_CACHE) IMAGE_LOCK=$(IMAGE_LOCK) scripts/image-debs.sh fetch $(IMAGE_ARCHES)
	@bins=; for a in $(IMAGE_ARCHES); do \
	  CGO_ENABLED=0 GOOS=linux GOARCH=$$a GOAMD64=v1 GOARM64=v8.0 $(GO) build -trimpath \
	    -ldflags "-s -w $(LDFLAGS)" -o $(IMAGE_OUT)/bin/$$a/meshdns-ebpf ./cmd/meshdns-ebpf || exit 1; \
	  bins=$$bins$${bins:+,}$$a=$(IMAGE_OUT)/bin/$$a/meshdns-ebpf; \
	done; \
	$(IMAGE_TOOL) build -lock $(IMAGE_LOCK) -debs $(IMAGE_CACHE)/debs -bin $$bins \
	  -version $(IMAGE_TAG) -revision "$(REVISION)" -epoch $(SOURCE_DATE_EPOCH) \
	  -name $(IMAGE_NAME) -out $(IMAGE_OUT)

# Re-resolve deploy/image/packages to the versions Debian serves now (commit the lock).
image-lock:
	IMAGE_CACHE=$(IMAGE_CACHE) scripts/image-debs.sh lock amd64 arm64

# Push the index built by `make image`: make image-push REGISTRY=registry.example.com/team
image-push: image
	@test -n "$(REGISTRY)" || { echo "make image-push: set REGISTRY=host/path"; exit 1; }
	$(IMAGE_TOOL) push -layout $(IMAGE_OUT)/oci -ref $(REGISTRY)/meshdns-ebpf:$(IMAGE_TAG)

clean:
	rm -rf bin out

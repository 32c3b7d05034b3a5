# meshdns-ebpf. The two commands of the README:
#   make run    build and run the agent standalone (as root), with the embedded default name table
#   make test   install the test dependencies and run the whole suite (CI runs exactly this)

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
export GOFLAGS := -buildvcs=false

.PHONY: all build run test deps test-deps unit generate check-generate vet bench soak clean

all: build

deps:
	@scripts/install-deps.sh --run

test-deps:
	@scripts/install-deps.sh

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
	$(GO) generate ./internal/redirect

check-generate:
	scripts/check-bpf-generated.sh

vet:
	$(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

test: test-deps check-generate vet
	$(GO) test $(TEST_FLAGS) ./...

bench: build
	bench/run.sh

# `make soak` (not part of `make test`): SOAK (10 minutes) of mixed load through
# the eBPF datapath while the agent is upgraded and restarted every 30 s, the name
# table is rewritten and the upstream fails; 0 lost queries, RSS printed
# (test/e2e TestSoak).
SOAK ?= 10m
soak: test-deps
	MESHDNS_SOAK=$(SOAK) CI=true $(GO) test -count=1 -timeout 60m -v -run '^TestSoak$$' ./test/e2e

clean:
	rm -rf bin

GO      ?= go
PKGS    ?= ./...
BIN     ?= bin

.PHONY: all build test race lint bench demo verify services clean

all: build

## build: compile every package and the onceflow command into bin/
build:
	$(GO) build $(PKGS)
	$(GO) build -o $(BIN)/onceflow ./cmd/onceflow

## test: vet, then every test against the embedded default and the loopback services
test:
	$(GO) vet $(PKGS)
	$(GO) test -count=1 -timeout 15m $(PKGS)

## race: the tests under the race detector (slower)
race:
	$(GO) test -count=1 -race -timeout 30m $(PKGS)

## lint: gofmt and go vet
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

## bench: the Go benchmarks and the end-to-end benchmark suite
bench:
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

## demo: the quickstart on the embedded default (no service needed)
demo:
	$(GO) run ./examples/quickstart

## services: start the loopback services the integration tests use, if they are down
services:
	scripts/services.sh start

clean:
	rm -rf $(BIN)

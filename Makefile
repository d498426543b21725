GO      ?= go
# The repository holds four modules, tied together by go.work: the library (.), the runnable
# examples, the benchmark and the console's browser test, so that the library's go.mod lists
# none of their dependencies.
PKGS    ?= ./... ./examples/... ./bench/... ./console/browsertest/...
BIN     ?= bin

.PHONY: all help build test console-screenshots test-conformance-full test-order-full test-poison-full test-outage-full test-verify-kafka test-verify-kafka-full race lint bench bench-micro bench-e2e bench-profile bench-scale bench-memory bench-scaleout demo verify services up down clean FORCE

# BENCH_QUICK=1 makes every bench target a short smoke run. BENCH_FLAGS go to onceflow-bench,
# SCALEOUT_FLAGS to its scale-out command.
BENCH_QUICK ?=
BENCH_FLAGS ?=
SCALEOUT_FLAGS ?=
BENCHTIME   ?= 1s
ifeq ($(BENCH_QUICK),1)
BENCHTIME := 100x
endif

all: build

## help: list the targets
help:
	@awk '/^## / { sub(/^## /, ""); doc = doc (doc == "" ? "" : " ") $$0; next } /^[a-z0-9-]+:/ && doc != "" { print "  " doc } { doc = "" }' $(MAKEFILE_LIST) | fold -s -w 100

## build: compile every package and the onceflow command into bin/
build:
	$(GO) build $(PKGS)
	$(GO) build -o $(BIN)/onceflow ./cmd/onceflow

## test: vet and every test against the embedded default and the loopback services, in two streams
## of one package at a time: the packages that load the database servers, which would overload
## PostgreSQL two at once, and beside them vet and the others (scripts/test.sh)
test:
	GO=$(GO) scripts/test.sh -timeout 15m -- $(PKGS)

## test-order-full: the ExactlyOnceInOrder multi-process test at the size of issue 7 (1,000 keys x
## 100 messages, shuffled and duplicated, 3 consumer processes killed 12 times), on SQLite and on
## PostgreSQL with RabbitMQ; `make test` runs it at 80 keys x 30 messages
test-order-full:
	ONCEFLOW_ORDER_FULL=1 $(GO) test -count=1 -timeout 40m -v -run 'TestInOrder_ShuffledDuplicated' ./ordering

## test-conformance-full: the conformance suite on every broker x database in every commit mode;
## `make test` runs each broker x database pair in one mode, the modes in turn
test-conformance-full:
	ONCEFLOW_CONFORMANCE=all $(GO) test -count=1 -timeout 30m -v -run 'TestConformance$$' ./conformance

## test-poison-full: the conformance suite's Poison scenario on every broker x database x mode (81
## runs, about 5 minutes); `make test` runs it on every broker with one database and one mode each
test-poison-full:
	ONCEFLOW_CONFORMANCE_POISON=all $(GO) test -count=1 -timeout 20m -v -run 'TestConformance_Poison' ./conformance

## test-outage-full: the conformance suite's Outage scenario (the database cut mid-drain for three
## times a message's redelivery schedule) on every broker x server database x mode, in every dedup
## mode that applies; `make test` runs it on every broker and mode with one database each
test-outage-full:
	ONCEFLOW_CONFORMANCE_OUTAGE=all $(GO) test -count=1 -timeout 20m -v -run 'TestConformance_Outage' ./conformance

## test-verify-kafka: onceflow verify against an in-process Kafka cluster and PostgreSQL, every
## mode, with kills and database connection cuts (about 6 minutes, slow by Kafka's session
## timeouts, see docs/brokers.md)
test-verify-kafka:
	ONCEFLOW_VERIFY_KAFKA=1 $(GO) test -count=1 -timeout 20m -v -run 'TestVerify_Kafka' ./cmd/onceflow

## test-verify-kafka-full: onceflow verify's ExactlyOnceByOffset mode (offsets in the business
## transaction) against an in-process Kafka cluster and PostgreSQL at full size: 10,000 records,
## 20 kills or more, 3 rebalances of the group or more (counted by the cluster), 2 connection
## cuts (about 4 minutes)
test-verify-kafka-full:
	ONCEFLOW_VERIFY_KAFKA=full $(GO) test -count=1 -timeout 40m -v -run 'TestVerify_KafkaOffsetsInTheTransaction' ./cmd/onceflow

## console-screenshots: run the console's browser test (headless Chromium, the Debian package
## chromium) and write its screenshots to docs/console/, which docs/console.md shows
console-screenshots:
	ONCEFLOW_SCREENSHOTS=1 $(GO) test -count=1 -v ./console/browsertest/...

## race: the tests under the race detector (slower; docs/brokers.md lists two races inside
## watermill-amqp and watermill-nats that it may report)
race:
	$(GO) test -count=1 -race -timeout 30m $(PKGS)

## lint: gofmt and go vet
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

## bench: the Go micro-benchmarks (about 3 minutes), then the end-to-end suite: onceflow's default
## handler and tuned variants beside a hand-written batch consumer on each broker's own client (the
## expert), the watermill baseline and the database's own rate, on RabbitMQ -> PostgreSQL and
## MariaDB, NATS and Redis -> PostgreSQL and the embedded SQLite queue; writes
## bench/results/latest.json and docs/performance.svg (docs/performance.md); then one handler in 1,
## 2 and 4 processes (bench-scaleout)
bench: bench-micro bench-e2e bench-scaleout

## bench-micro: the Go benchmarks of every package
bench-micro:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

## bench-e2e: the end-to-end suite alone: backlog drains of 1 KiB and 100-byte payloads, steady
## state at 100 and 1,000 msgs/s, a slow processor, reruns under failures; 3 rounds (about 20
## minutes; BENCH_QUICK=1 for a smoke run of about 4 minutes; BENCH_FLAGS=-list lists the cells)
bench-e2e: $(BIN)/onceflow-bench
	BENCH_QUICK=$(BENCH_QUICK) $(BIN)/onceflow-bench run $(BENCH_FLAGS)

## bench-profile: CPU profiles of the consumer in every drain cell at concurrency 16 of RabbitMQ ->
## PostgreSQL, 1 KiB and 100-byte payloads, onceflow's and the expert's, into bin/profiles (go tool
## pprof; BENCH_FLAGS='-setups nats' for another setup; the figures of a profiled run are not for
## the record)
bench-profile: $(BIN)/onceflow-bench
	BENCH_QUICK=$(BENCH_QUICK) $(BIN)/onceflow-bench run -setups postgres -concurrency 16 -rounds 1 -seconds 5 \
		-scenarios drain,small -cpuprofile-dir $(BIN)/profiles \
		-out $(BIN)/profiles/results.json -chart '' $(BENCH_FLAGS)

## bench-scale: ExactlyOnce with 10 million dedup keys against an empty table, and with the purge
## running (loads the keys once into PostgreSQL, about 2 GB; bench/results/scale.json)
bench-scale: $(BIN)/onceflow-bench
	BENCH_QUICK=$(BENCH_QUICK) $(BIN)/onceflow-bench scale $(BENCH_FLAGS)

## bench-scaleout: one handler in 1, 2 and 4 consumer processes on RabbitMQ and on an in-process
## Kafka cluster, against one PostgreSQL, 3 rounds: the rate and its ratio to one process
## (bench/results/scaleout.json, docs/scaling.md; about 3 minutes)
bench-scaleout: $(BIN)/onceflow-bench
	BENCH_QUICK=$(BENCH_QUICK) $(BIN)/onceflow-bench scaleout $(SCALEOUT_FLAGS)

## bench-memory: peak RSS and growth of one consumer at concurrency 16 over 1 million messages
## (bench/results/memory.json)
bench-memory: $(BIN)/onceflow-bench
	BENCH_QUICK=$(BENCH_QUICK) $(BIN)/onceflow-bench memory $(BENCH_FLAGS)

$(BIN)/onceflow-bench: FORCE
	$(GO) build -o $(BIN)/onceflow-bench ./bench/cmd/onceflow-bench

FORCE:

## demo: the quickstart on the embedded default (no service needed)
demo:
	$(GO) run ./examples/quickstart

## services: start the loopback services the integration tests use, if they are installed and down
services:
	scripts/services.sh start

## up: start PostgreSQL, MariaDB, RabbitMQ, NATS and Redis in Docker on the default ports (docker-compose.yml)
up:
	docker compose up -d --wait

## down: stop the Docker services and remove their data
down:
	docker compose down -v

clean:
	rm -rf $(BIN)

# Toolcall Ledger. `make dev` runs the whole ledger in one process; `make
# test` starts what the tests need (deploy/testservices.sh) and runs them all.
SHELL := /bin/bash
GO ?= go
DATA_DIR ?= ./.ledger
TEST_TIMEOUT ?= 13m
BENCH_COUNT ?= 1

.PHONY: dev build test test-services-start test-services-stop bench fuzz lint vet

dev:
	$(GO) run ./cmd/ledger dev --data-dir $(DATA_DIR)

build:
	$(GO) build -o bin/ledger ./cmd/ledger

# Starts PostgreSQL and ClickHouse (reusing running ones), runs every test
# with LEDGER_TEST_REQUIRE=1 so that a missing service fails instead of
# skipping, and stops what it started.
test:
	@set -euo pipefail; \
	env_file=$$(mktemp); \
	trap 'bash deploy/testservices.sh stop >&2 || true; rm -f "$$env_file"' EXIT; \
	bash deploy/testservices.sh start > "$$env_file"; \
	source "$$env_file"; \
	export LEDGER_TEST_REQUIRE=1; \
	echo "== go vet" >&2; $(GO) vet ./...; \
	echo "== go test" >&2; $(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...

vet:
	$(GO) vet ./...

lint: vet
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi

bench:
	$(GO) test -run '^$$' -bench . -benchmem -count $(BENCH_COUNT) ./...

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecodeEnvelope -fuzztime 60s ./ledger/
	$(GO) test -run '^$$' -fuzz FuzzApplySequence -fuzztime 60s ./statemachine/

